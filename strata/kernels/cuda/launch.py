"""Kernel launches with programmatic dependent launch (PDL: Hopper, sm_90, and later).

A launch in a stream normally starts only once the kernel before it has finished, and a new
kernel then needs a few microseconds to fill the GPU: for decode's chains of mat-vecs that
each stream 1-30 MB of weights, the HBM idles through every such ramp and tail. A kernel
launched with PDL may start as soon as every block of the kernel before it has called
allow_dependents() (pdl.cuh): Strata's MMVQ kernels then issue their first weight copies (the
weights are constant) and wait in wait_prior_grids() for the previous kernel's output; the
float mat-vec asks L2 for its rows, the add + norm kernel reads its norm weights, RoPE and
attention read the window and cache tables (attention also asks L2 for the older cache rows)
before they wait; the rest wait first. Each then allows its successor.

CuPy launches kernels without launch attributes, so this goes through the driver's
cuLaunchKernelEx by ctypes. It is used only while a CUDA graph is being captured (decode
windows): the graph keeps the programmatic edges, and the slower Python-side launch is paid
once per captured window rather than per replay. STRATA_CUDA_PDL=0 turns it off (benchmarks
compare both); on GPUs before sm_90, or a driver without cuLaunchKernelEx, it is never used
and the kernels' PDL instructions compile to nothing.

    launch(fn, grid, block, args, shared_mem=0)   fn a cupy RawKernel (or Function); args as CuPy takes them
    enabled() -> bool               PDL available and not switched off
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import numpy as np

PDL_ENV = "STRATA_CUDA_PDL"
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID, cuda.h (CUDA 12.0+)


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue: a 64-byte union, pointer-aligned
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_void_p), ("value", ctypes.c_int)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


@functools.cache
def _driver():
    """libcuda's cuLaunchKernelEx, or None."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        fn = ctypes.CDLL(name).cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _device_supports() -> bool:
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90 and _driver() is not None


def enabled() -> bool:
    return os.environ.get(PDL_ENV, "1") != "0" and _device_supports()


# numpy scalar types -> their ctypes (the kernels' int / long long / float parameters)
_SCALARS = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint32: ctypes.c_uint32,
            np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def _c_arg(a):
    if hasattr(a, "data") and hasattr(a.data, "ptr"):  # a cupy array: its device pointer
        return ctypes.c_void_p(a.data.ptr)
    if a is None:
        return ctypes.c_void_p(0)
    kind = _SCALARS.get(type(a))
    if kind is None:
        raise TypeError(f"launch: kernel argument of type {type(a).__name__} (give numpy scalars)")
    return kind(a)


def _capturing(stream) -> bool:
    return stream.ptr != 0 and stream.is_capturing()


def launch(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
    """fn(grid, block, args, shared_mem=...), with PDL while the current stream captures a
    graph (enabled())."""
    import cupy

    stream = cupy.cuda.get_current_stream() if enabled() else None
    if stream is None or not _capturing(stream):
        fn(grid, block, args, shared_mem=shared_mem)
        return
    values = [_c_arg(a) for a in args]  # kept alive until the call returns
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.value = 1
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    cfg = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), int(shared_mem), stream.ptr, ctypes.pointer(attr), 1)
    handle = getattr(fn, "kernel", fn).ptr  # a RawKernel's compiled cupy.cuda.Function
    rc = _driver()(ctypes.byref(cfg), handle, params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {rc}) for a {g} x {b} launch")
