"""Native quantized mat-vec (MMVQ) on NVIDIA GPUs through CuPy: the entry points.

Weights stay in their GGUF block layout on the device (uploaded once, never dequantized);
activations are quantized on the GPU to Q8_1-style blocks of 32 (int8 q, float32 d and s,
exactly strata.kernels.activation_quant's math), and one launch multiplies up to MAX_COLS
columns. The source and its compilation are mmvq_build's, the choice of instance and launch
shape mmvq_policy's, the experts' kernels experts.py's.

    quantize_q8_1(x_dev) -> Q8Buffer
    mmvq(type_id, w_dev, rows, k, x_dev, out=None) -> (ncols, rows) float32 cupy array
    column_launches(type_id, rows, ncols, ...) -> [Launch]: the policy on this device
    supported_types() -> tuple of GGML type ids;  register(table): fill the native kernel table
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.kernels.cuda import mmvq_build as build
from strata.kernels.cuda import mmvq_policy as policy
from strata.kernels.cuda.launch import launch
from strata.kernels.cuda.mmvq_build import KNOBS, compile_all, supported_types  # noqa: F401
from strata.kernels.cuda.mmvq_policy import (FLOAT_TYPES, MAX_COLS, QK, QUANT_TYPES, RPW, WARPS,  # noqa: F401
                                             Launch, column_groups)
from strata.kernels.ggml_types import type_by_id


def _cp():
    import cupy

    return cupy


# ------------------------------------------------------------------ activations
@dataclass
class Q8Buffer:
    """Quantized activations on the device: q int8 (ncols, k); meta (ncols, k/32, 2) int32
    records of float32 d and the two 16-value int16 sums of q packed (what the kernels read);
    s float32 (ncols, k/32) = d * sum(q) (activation_quant's s, for callers)."""

    q: object
    meta: object
    s: object
    ncols: int
    k: int

    @property
    def d(self):
        return self.meta.view(_cp().float32)[..., 0]

    def rows(self, a: int, b: int) -> "Q8Buffer":
        """Columns [a, b) of these activations (views, no copy)."""
        return Q8Buffer(self.q[a:b], self.meta[a:b], self.s[a:b], b - a, self.k)


def empty_q8(ncols: int, k: int) -> Q8Buffer:
    cp = _cp()
    return Q8Buffer(cp.empty((ncols, k), dtype=cp.int8), cp.empty((ncols, k // QK, 2), dtype=cp.int32),
                    cp.empty((ncols, k // QK), dtype=cp.float32), ncols, k)


def quantize_q8_1(x_dev, out: Q8Buffer | None = None) -> Q8Buffer:
    """float32 (ncols, k) or (k,) device array -> Q8Buffer (k a multiple of 32)."""
    cp = _cp()
    x = cp.ascontiguousarray(cp.asarray(x_dev, dtype=cp.float32))
    if x.ndim == 1:
        x = x[None, :]
    ncols, k = x.shape
    if k % QK:
        raise ValueError(f"quantize_q8_1: row length {k} is not a multiple of {QK}")
    buf = out if out is not None else empty_q8(ncols, k)
    nblocks = ncols * (k // QK)
    if nblocks:
        threads = 256
        grid = (nblocks * 32 + threads - 1) // threads
        launch(build.quant_kernel(), (grid,), (threads,), (x, np.int32(nblocks), buf.q, buf.meta, buf.s))
    return buf


# ------------------------------------------------------------------ launches
def rows_aligned(w_dev, row_bytes: int) -> bool:
    """Rows that start on 16-byte boundaries have kernel instances of their own for one column
    (decode, experts): their tile copies need no alignment arithmetic (mmvq_kernels.cuh, A16)."""
    return KNOBS.aligned and row_bytes % 16 == 0 and w_dev.data.ptr % 16 == 0


def split_columns(type_id: int, rows: int, ncols: int, aligned: bool = False) -> tuple[str, int, int] | None:
    """mmvq_policy.split_columns on this device."""
    return policy.split_columns(build.device_facts(), KNOBS, type_id, rows, ncols, aligned)


def column_launches(type_id: int, rows: int, ncols: int, split: bool = True,
                    aligned: bool = False, k: int = 0) -> list[Launch]:
    """mmvq_policy.column_launches on this device; CudaBackend caches these per weight and
    column count."""
    return policy.column_launches(build.device_facts(), KNOBS, type_id, rows, ncols, split, aligned, k)


def weights(type_id: int, w_dev, k: int):
    """(the GGML type, w as the kernels read it: uint8, contiguous, 16-byte aligned); a clear
    error for a type or row length without a kernel."""
    cp = _cp()
    t = type_by_id(type_id)
    if t is None or type_id not in supported_types():
        raise ValueError(f"mmvq: no CUDA kernel for GGML type {t.name if t else type_id}")
    if k <= 0 or k % t.block_size or (t.quantized and k % QK):
        raise ValueError(f"mmvq: {t.name} rows of {k} weights are not whole blocks")
    w = cp.asarray(w_dev)
    if w.dtype != cp.uint8:
        w = w.view(cp.uint8) if w.flags.c_contiguous else cp.ascontiguousarray(w).view(cp.uint8)
    if not w.flags.c_contiguous or w.data.ptr % 16:
        w = cp.ascontiguousarray(w).copy()  # kernels read aligned 4- and 16-byte pieces
    return t, w


def check_matrix_bytes(what: str, rows: int, row_bytes: int) -> None:
    """The kernels address a matrix by 32-bit byte offsets (fewer registers than 64-bit row
    pointers: more resident warps); an expert's matrix is addressed from its own start."""
    if rows * row_bytes >= 1 << 32:
        raise ValueError(f"{what}: a matrix of {rows} rows x {row_bytes} bytes is 4 GiB or more")


def columns(x_dev):
    """Activations as contiguous float32 (ncols, k) columns."""
    cp = _cp()
    x = cp.asarray(x_dev, dtype=cp.float32)
    if x.ndim == 1:
        x = x[None, :]
    return cp.ascontiguousarray(x)


def mmvq(type_id: int, w_dev, rows: int, k: int, x_dev, out=None, q8: Q8Buffer | None = None,
         split: bool = True):
    """W (rows, k) of GGML type `type_id` times x (ncols, k) -> float32 (ncols, rows).

    x_dev: float32 columns (quantized here) or a Q8Buffer already quantized. More than
    MAX_COLS columns run as several launches. `out` (ncols, rows) float32 may be given.
    split: a small matrix's columns may run in parallel (split_columns; same bits either way).
    """
    cp = _cp()
    t, w = weights(type_id, w_dev, k)
    row_bytes = t.row_bytes(k)
    check_matrix_bytes("mmvq", rows, row_bytes)
    if w.size != rows * row_bytes:
        raise ValueError(f"mmvq: {t.name} {rows} x {k} needs {rows * row_bytes} bytes, got {w.size}")
    if isinstance(x_dev, Q8Buffer):
        if t.id in FLOAT_TYPES:
            raise ValueError("mmvq: float weights take float activations, not a Q8Buffer")
        act, ncols = x_dev, x_dev.ncols
    else:
        x = columns(x_dev)
        if x.shape[1] != k:
            raise ValueError(f"mmvq: activations have {x.shape[1]} values per column, weights {k}")
        ncols = x.shape[0]
        act = x if t.id in FLOAT_TYPES else quantize_q8_1(x, q8)
    if out is None:
        out = cp.empty((ncols, rows), dtype=cp.float32)
    if t.id in FLOAT_TYPES:  # a group of columns per grid row, as the quantized kernels
        vec = np.int32(row_bytes % 16 == 0 and (k * t.type_size) % 16 == 0)
        for c0, nc, groups in column_groups(ncols):
            launch(build.function(t.id, f"mmvf<{t.id}, {nc}>"), ((rows + WARPS - 1) // WARPS, groups), (WARPS * 32,), (
                w, np.int32(rows), np.int32(row_bytes), np.int32(k), act[c0:], out[c0:], vec))
        return out
    for ln in column_launches(t.id, rows, ncols, split, rows_aligned(w, row_bytes), k):
        launch(build.function(t.id, ln.name), ln.grid, ln.block, (
            w, np.int32(rows), np.int32(row_bytes), np.int32(k), np.int32(ln.rpw),
            act.q[ln.c0:], act.meta[ln.c0:], out[ln.c0:]), shared_mem=ln.smem)
    return out


# ------------------------------------------------------------------ native table
def _table_impl(type_id: int):
    def impl(w, x):
        """w uint8 (rows, row_bytes), x float32 (ncols, k) (host or device) -> cupy (ncols, rows)."""
        cp = _cp()
        w_dev = cp.asarray(w)
        x_dev = columns(x)
        return mmvq(type_id, w_dev, w_dev.shape[0], x_dev.shape[1], x_dev)

    impl.__qualname__ = f"cuda.mmvq[{type_by_id(type_id).name}]"
    return impl


def register(table) -> None:
    """Add one "cuda" row per supported type to a strata.kernels.native_table.NativeTable."""
    for type_id in supported_types():
        table.register("cuda", type_id, MAX_COLS, _table_impl(type_id), "strata.kernels.cuda.mmvq")
