"""The MMVQ CUDA source and its compiled kernels: one module per type, rarer instances apart.

The C++ lives in *.cuh beside this file; the parts that depend on Python tables (codebooks,
which types are 4-bit lookups, mmvq_wide's warps) are generated here, and the source is compiled
at first use of a type with NVRTC (cupy.RawModule; CuPy caches the binaries on disk). The
benchmark knobs (STRATA_MMVQ_*) are read from the environment once, here, into KNOBS.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from strata.kernels.cuda import launch as pdl
from strata.kernels.cuda.mmvq_policy import (FLOAT_TYPES, LOOKUP_4BIT, MAX_COLS, QUANT_TYPES, WARPS, DeviceFacts,
                                             dynamic_smem, ids_name, mmvq_name, read_knobs)

KNOBS = read_knobs(os.environ)  # the one reading of the MMVQ knobs
OPTIONS = ("--use_fast_math", "-std=c++17") + KNOBS.defines

_HERE = Path(__file__).parent
_lock = threading.Lock()
_modules: dict[int, object] = {}


def supported_types() -> tuple[int, ...]:
    return QUANT_TYPES + FLOAT_TYPES


def _cp():
    import cupy

    return cupy


@functools.cache
def source() -> str:
    """pdl.cuh, the shared decoders and kernels, with the generated tables and traits."""
    from strata.kernels.cuda.tables import table_source

    files = ("pdl.cuh", "mmvq_common.cuh", "mmvq_decode.cuh", "mmvq_kernels.cuh")
    pdl_src, common, decode, kernels = ((_HERE / f).read_text() for f in files)
    lut16 = " || ".join(f"ID == {t}" for t in LOOKUP_4BIT)
    lut16 = f"template <int ID> struct LUT16 {{ static constexpr bool YES = {lut16}; }};\n"
    wide = "".join(f"ID == {t} ? {w} : " for t, w in KNOBS.wide_warps.items())
    wide = (f"template <int ID> struct WideWarps {{ static constexpr int N = {wide}0; }};\n"
            f"#define WIDE_SMEM_MAX {KNOBS.wide_smem}\n")
    return pdl_src + common + table_source() + decode + lut16 + wide + kernels


def names(type_id: int) -> list[str]:
    """The instances of a type's own module: every column count and the experts kernels."""
    if type_id in FLOAT_TYPES:
        return [f"mmvf<{type_id}, {nc}>" for nc in range(1, MAX_COLS + 1)] + [f"mmvf_ids<{type_id}>"]
    return ([mmvq_name(type_id, nc) for nc in range(1, MAX_COLS + 1)] + [mmvq_name(type_id, 1, True)]
            + [ids_name(type_id, a) for a in (False, True)])


def module(type_id: int):
    """The compiled module of one type (all column counts + the experts kernel)."""
    mod = _modules.get(type_id)
    if mod is None:
        mod = _cp().RawModule(code=source(), options=OPTIONS, name_expressions=names(type_id))
        mod.compile()
        with _lock:
            _modules[type_id] = mod
    return mod


@functools.cache
def _plain_module():
    """The module of the extern "C" kernels: activation quantization, and prefill's experts
    plan, sorted-activation gather and row scatter."""
    return _cp().RawModule(code=source(), options=OPTIONS)


@functools.cache
def plain_function(name: str):
    return _plain_module().get_function(name)


def quant_kernel():
    return plain_function("quantize_q8_1")


def compile_all(type_ids=None, threads: int = 8) -> None:
    """Compile the modules of several types at once (NVRTC runs outside the GIL)."""
    ids = [t for t in (type_ids or supported_types()) if t not in _modules]
    quant_kernel()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(module, ids))


@functools.cache
def named_function(name: str):
    """One kernel instance compiled on first use in a module of its own (kernels that only
    some packs or windows need stay out of the per-type modules)."""
    mod = _cp().RawModule(code=source(), options=OPTIONS, name_expressions=[name])
    mod.compile()
    return mod.get_function(name)


@functools.cache
def function(type_id: int, name: str):
    """A kernel instance by name: from its type's module, or compiled apart."""
    fn = module(type_id).get_function(name) if name in names(type_id) else named_function(name)
    dyn = dynamic_smem(KNOBS, name)
    if dyn:
        fn.max_dynamic_shared_size_bytes = dyn  # past the 48 KB a launch gets unasked
    return fn


# ------------------------------------------------------------------ device facts
def resident_warps_of(fn) -> int:
    """Warps of this kernel that stay resident on the whole device at once (occupancy from
    its registers and shared memory), so a grid of that many warps runs in one wave."""
    attrs = _cp().cuda.Device().attributes
    regs_per_warp = -(-fn.num_regs * 32 // 256) * 256
    by_regs = attrs["MaxRegistersPerMultiprocessor"] // max(1, regs_per_warp * WARPS)
    by_smem = attrs["MaxSharedMemoryPerMultiprocessor"] // (fn.shared_size_bytes + 1024)
    by_threads = attrs["MaxThreadsPerMultiProcessor"] // (WARPS * 32)
    per_sm = max(1, min(by_regs, by_smem, by_threads, 32))
    return attrs["MultiProcessorCount"] * per_sm * WARPS


@functools.cache
def resident_warps(type_id: int, name: str) -> int:
    return resident_warps_of(function(type_id, name))


@functools.cache
def _sm_count() -> int:
    return int(_cp().cuda.Device().attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def _smem_optin_of(device: int) -> int:
    """cudaDevAttrMaxSharedMemoryPerBlockOptin (97) of a device, asked once."""
    return int(_cp().cuda.runtime.deviceGetAttribute(97, device))


def smem_optin() -> int:
    return _smem_optin_of(_cp().cuda.Device().id)


def device_facts() -> DeviceFacts:
    """The current device's facts for mmvq_policy (PDL asked each time: tests switch it)."""
    return DeviceFacts(_sm_count(), smem_optin(), pdl.enabled(), resident_warps)
