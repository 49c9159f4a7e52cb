"""Prompt rows on the GPU: a weight times many columns as device dequantization + cuBLAS GEMM.

The MMVQ kernels stream the whole weight once per 8 columns. For a long prompt it is cheaper
to widen the weight once to float16 (strata.kernels.cuda.dequant: bit-exact values, rounded to
f16) and run tensor-core GEMMs. The widened weight goes into a scratch buffer kept by the
PrefillPath, a tile of rows at a time, so memory stays bounded whatever the weight. Which rows
take this path is the backend's rule (CudaBackend: rows of prompts of 256+ tokens, on weights
of 4M+ elements), fixed per request so batching stays bit-invariant; `tile_m` makes every
GEMM run on a fixed number of rows for the same reason.

GEMM precision: float16 inputs (weights and activations rounded to f16, relative error
<= 2^-11 each), float32 accumulation and float32 output, through cublasGemmEx with
CUBLAS_COMPUTE_32F. (cupy.matmul on two float16 arrays returns float16: its output would be
rounded to f16 and overflow past 65504, hence the direct call.)

    path = PrefillPath(scratch_bytes=DEFAULT_SCRATCH_BYTES)
    y = path.linear(type_id, blocks, rows, k, x, out=None, tile_m=None)  # x (n, k) f32 -> (n, rows) f32
"""

from __future__ import annotations

import numpy as np

# Scratch for one tile of widened weights (whole rows). Each tile costs a dequant launch and a
# GEMM call (~80 us of host time per tile, eager), so tiles are large: 128 MiB holds a 4096 x
# 14336 weight in one tile. Measured on the H200, Q4_K 14336x4096,
# n=512: 8 MiB (14 tiles) 1.21 ms, 32 MiB (4) 0.39 ms, 64 MiB (2) 0.25 ms, 128 MiB (1) 0.18 ms.
DEFAULT_SCRATCH_BYTES = 128 << 20

# cuBLAS enum values (cublas_api.h / library_types.h)
_OP_N, _OP_T = 0, 1
_R_16F, _R_32F = 2, 0
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_POINTER_MODE_HOST = 0


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
        self._alpha_ptr, self._beta_ptr = self._alpha.ctypes.data, self._beta.ctypes.data
        from strata.backend import cublas_gemm

        # Strata's own cuBLAS handle (capturable: backend/cublas_gemm.py); None: CuPy's wrapper,
        # and windows with GEMM rows stay eager
        self._blas = cublas_gemm.load(cupy)
        self.capturable = self._blas is not None

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
        dequant.to_f16(type_id, x, n, x16)  # rows past n: zeros (round to nearest f16)
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
        On Strata's own handle where it loaded (capturable), else through CuPy's wrapper
        (which refuses to run during stream capture)."""
        n, rows = out.shape
        if self._blas is not None:
            self._blas.gemm_ex(_OP_T, _OP_N, m, n, k, self._alpha_ptr, w16.data.ptr, _R_16F, k,
                               x16.data.ptr, _R_16F, k, self._beta_ptr, out.data.ptr + 4 * r0, _R_32F, rows,
                               _COMPUTE_32F, _GEMM_DEFAULT)
            return
        from cupy.cuda import cublas

        handle = self.cp.cuda.device.get_cublas_handle()
        mode = cublas.getPointerMode(handle)
        if mode != _POINTER_MODE_HOST:
            cublas.setPointerMode(handle, _POINTER_MODE_HOST)
        try:
            cublas.gemmEx(handle, _OP_T, _OP_N, m, n, k,
                          self._alpha_ptr, w16.data.ptr, _R_16F, k,
                          x16.data.ptr, _R_16F, k,
                          self._beta_ptr, out.data.ptr + 4 * r0, _R_32F, rows,
                          _COMPUTE_32F, _GEMM_DEFAULT)
        finally:
            if mode != _POINTER_MODE_HOST:
                cublas.setPointerMode(handle, mode)
