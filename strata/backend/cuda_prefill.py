"""Prefill on the GPU: a weight times many columns as device dequantization + one cuBLAS GEMM.

The MMVQ kernels take at most 8 columns per launch, so a window of n columns costs ceil(n/8)
launches that each stream the whole weight. For wide windows it is cheaper to widen the
weight once to float16 (strata.kernels.cuda.dequant: bit-exact values, rounded to f16) and
run one tensor-core GEMM. The widened weight goes into a scratch buffer kept by the
PrefillPath, a tile of rows at a time, so memory stays bounded whatever the weight.

GEMM precision: float16 inputs (weights and activations rounded to f16, relative error
<= 2^-11 each), float32 accumulation and float32 output, through cublasGemmEx with
CUBLAS_COMPUTE_32F. (cupy.matmul on two float16 arrays returns float16: its output would be
rounded to f16 and overflow past 65504, hence the direct call.)

    path = PrefillPath(scratch_bytes=DEFAULT_SCRATCH_BYTES)
    y = path.linear(type_id, blocks, rows, k, x, out=None)   # x (n, k) float32 -> (n, rows) float32
    path.prefer(type_id, n, rows, k) -> bool                  # this path beats ceil(n/8) MMVQ launches
"""

from __future__ import annotations

import numpy as np

from strata.kernels.ggml_types import type_by_id

MAX_MMVQ_COLS = 8  # strata.kernels.cuda.mmvq.MAX_COLS (not imported: keeps this module CuPy-free)

# Scratch for one tile of widened weights (whole rows). Each tile costs a dequant launch and a
# GEMM call (~80 us of host time per tile, eager), so tiles are large: 128 MiB holds a 4096 x
# 14336 weight in one tile. H200 run (docs/notes/gpu-runs.md, prefill run 1), Q4_K 14336x4096,
# n=512: 8 MiB (14 tiles) 1.21 ms, 32 MiB (4) 0.39 ms, 64 MiB (2) 0.25 ms, 128 MiB (1) 0.18 ms.
DEFAULT_SCRATCH_BYTES = 128 << 20

# Smallest window (columns) at which dequant + GEMM beats MMVQ launches of 8 columns, per type,
# as (small weights: rows * k < SMALL_WEIGHTS, large weights). Measured eager (Python launch cost
# included, as the CUDA backend runs today) by bench/bench_gpu_prefill.py on the H200, run 2 of
# "Prefill path" in docs/notes/gpu-runs.md; measured n were 16, 32, 64, 128, 512, so a value is
# "from this n on" and n between 9 and the value stays on MMVQ. Small = 576x1536, large = the
# worse of 4096x14336 and 14336x4096. On GPU time alone (no launch cost) it is 16 (small) and
# 32 (large; 16 for TQ1_0) for every quantized type.
SMALL_WEIGHTS = 1 << 22
CROSSOVER: dict[str, tuple[int, int]] = {
    "Q4_0": (64, 32), "Q4_1": (64, 32), "Q5_0": (64, 32), "Q5_1": (64, 32), "Q8_0": (64, 32),
    "Q2_K": (64, 32), "Q3_K": (64, 32), "Q4_K": (64, 32), "Q5_K": (64, 32), "Q6_K": (64, 32),
    "IQ2_XXS": (64, 32), "IQ2_XS": (64, 32), "IQ2_S": (64, 32), "IQ3_XXS": (64, 32), "IQ3_S": (64, 32),
    "IQ1_S": (64, 32), "IQ1_M": (64, 32), "IQ4_NL": (64, 32), "IQ4_XS": (64, 32), "TQ1_0": (64, 16),
    "TQ2_0": (64, 32), "MXFP4": (64, 32), "NVFP4": (64, 32), "Q1_0": (64, 64), "Q2_0": (64, 64),
    "F32": (64, 32), "F16": (32, 16), "BF16": (64, 16),
}
DEFAULT_CROSSOVER = (64, 64)  # a type missing from the table (none today)

# cuBLAS enum values (cublas_api.h / library_types.h)
_OP_N, _OP_T = 0, 1
_R_16F, _R_32F = 2, 0
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_POINTER_MODE_HOST = 0


def crossover(type_id: int, rows: int, k: int) -> int:
    """Columns from which PrefillPath.linear is faster than MMVQ launches (measured table)."""
    t = type_by_id(type_id)
    small, large = CROSSOVER.get(t.name if t else "", DEFAULT_CROSSOVER)
    return small if rows * k < SMALL_WEIGHTS else large


class PrefillPath:
    """Dequantize-to-f16 + cuBLAS GEMM for wide windows; keeps its scratch buffers between calls."""

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES):
        import cupy

        self.cp = cupy
        self.scratch_bytes = int(scratch_bytes)
        self._w16 = None  # float16 flat scratch: one tile of widened weights
        self._x16 = None  # float16 flat scratch: the activations
        self._o32 = None  # float32 flat scratch: outputs of padded row tiles
        self._alpha = np.ones(1, dtype=np.float32)  # host scalars for cublasGemmEx (host pointer mode)
        self._beta = np.zeros(1, dtype=np.float32)

    @staticmethod
    def prefer(type_id: int, n: int, rows: int, k: int) -> bool:
        """Whether linear() beats today's path (ceil(n/8) MMVQ launches) for this window."""
        return n > MAX_MMVQ_COLS and n >= crossover(type_id, rows, k)

    def tile_rows(self, rows: int, k: int) -> int:
        return max(1, min(rows, self.scratch_bytes // (2 * k)))

    def _scratch(self, name: str, size: int):
        """A float16 flat buffer of at least `size` elements, grown (never shrunk) as needed."""
        buf = getattr(self, name)
        if buf is None or buf.size < size:
            buf = self.cp.empty(size, dtype=self.cp.float16)
            setattr(self, name, buf)
        return buf[:size]

    def linear(self, type_id: int, blocks, rows: int, k: int, x, out=None, tile_m: int | None = None):
        """W (rows, k) of GGML type `type_id` (device blocks, uint8 (rows, row_bytes)) times
        x (n, k) float32 -> float32 (n, rows), into `out` when given.

        tile_m: run every GEMM on exactly tile_m activation rows (the last tile zero-padded).
        cuBLAS picks its kernel by shape, so a row's result then depends only on the row itself
        and the weight, never on how many rows came with it (batch invariance of prompt rows)."""
        cp = self.cp
        from strata.kernels.cuda import dequant

        t, w, row_bytes, n_table = dequant._table(type_id, blocks, k)
        if n_table != rows:
            raise ValueError(f"prefill: {t.name} {rows} x {k} needs {rows * row_bytes} bytes, got {w.size}")
        w = w.reshape(rows, row_bytes)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"prefill: activations must be (n, {k}), got {x.shape}")
        n = x.shape[0]
        if out is None:
            out = cp.empty((n, rows), dtype=cp.float32)
        elif out.shape != (n, rows) or out.dtype != cp.float32 or not out.flags.c_contiguous:
            raise ValueError(f"prefill: out must be C-contiguous float32 ({n}, {rows}), got {out.dtype} {out.shape}")
        if n == 0 or rows == 0:
            return out
        step = tile_m or n
        m = -(-n // step) * step  # rows the GEMMs run on
        x16 = self._scratch("_x16", m * k).reshape(m, k)
        cp.copyto(x16[:n], x, casting="same_kind")  # round to nearest f16
        x16[n:] = 0
        target = out
        if m != n:
            if self._o32 is None or self._o32.size < m * rows:
                self._o32 = cp.empty(m * rows, dtype=cp.float32)
            target = self._o32[: m * rows].reshape(m, rows)

        def gemms(w16, r0: int, count: int) -> None:
            for j in range(0, m, step):
                self._gemm(w16, x16[j : j + step], target[j : j + step], r0, count, k)

        if t.name == "F16":  # already float16: multiply the blocks themselves
            gemms(w.view(cp.float16), 0, rows)
        else:
            tr = self.tile_rows(rows, k)
            w16 = self._scratch("_w16", tr * k)
            for r0 in range(0, rows, tr):
                r1 = min(rows, r0 + tr)
                tile = w16[: (r1 - r0) * k].reshape(r1 - r0, k)
                # the checked wrapper's launch (blocks and tile were checked above)
                dequant._launch(type_id, w[r0:r1], row_bytes, k, r1 - r0, None, r1 - r0, tile)
                gemms(tile, r0, r1 - r0)
        if target is not out:
            out[...] = target[:n]
        return out

    def _gemm(self, w16, x16, out, r0: int, m: int, k: int) -> None:
        """out[:, r0:r0+m] = x16 @ w16.T with float32 accumulation. Column-major view: out^T
        (rows x n, ld rows) = W (m x k, stored as k x m: op T) times x^T (k x n, ld k).
        CuPy's cuBLAS wrappers refuse to run during stream capture: not graph-capturable."""
        from cupy.cuda import cublas

        n, rows = out.shape
        handle = self.cp.cuda.device.get_cublas_handle()
        mode = cublas.getPointerMode(handle)
        if mode != _POINTER_MODE_HOST:
            cublas.setPointerMode(handle, _POINTER_MODE_HOST)
        try:
            cublas.gemmEx(handle, _OP_T, _OP_N, m, n, k,
                          self._alpha.ctypes.data, w16.data.ptr, _R_16F, k,
                          x16.data.ptr, _R_16F, k,
                          self._beta.ctypes.data, out.data.ptr + 4 * r0, _R_32F, rows,
                          _COMPUTE_32F, _GEMM_DEFAULT)
        finally:
            if mode != _POINTER_MODE_HOST:
                cublas.setPointerMode(handle, mode)
