"""The CUDA backend (CuPy): weights stay in their GGUF block layout on the device.

Every 2-D and expert weight is uploaded once as raw blocks; mat-vec and small windows run the
native MMVQ kernels of strata.kernels.cuda (activations quantized to Q8_1 on the device,
windows wider than 8 columns run as several launches). A type without a native kernel (or
dropped from the table with --no-native) takes the generic path: dequantized once on the host
and kept as float16 on the device, then cuBLAS. Element-wise ops and attention use the
array-module implementations of Backend with xp = cupy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, TensorSource
from strata.kernels.dequant import dequantize, dequantize_rows
from strata.kernels.ggml_types import type_by_id, type_by_name


@dataclass
class _Part:
    type_id: int
    rows: int
    k: int
    blocks: Any  # cupy uint8 (rows, row_bytes) for native; cupy float16 (rows, k) for generic
    native: bool


@dataclass
class CudaLinear:
    parts: list[_Part]
    names: tuple[str, ...]


@dataclass
class CudaExperts:
    type_id: int
    blocks: Any  # (n_expert, rows, row_bytes) uint8, or (n_expert, rows, k) float16 (generic)
    native: bool


@dataclass
class CudaEmbedding:
    source: TensorSource  # host memmap of the blocks: rows are dequantized per lookup
    row_len: int


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, no_native: set[str] | None = None):
        import cupy as cp

        from strata.kernels.cuda import mmvq

        self.xp = cp
        self._mmvq = mmvq
        dropped = {type_by_name(n).id for n in (no_native or set())}
        self.native_types = set(mmvq.supported_types()) - dropped

    # ---- weights ----------------------------------------------------------------------
    def _part(self, src: TensorSource) -> _Part:
        cp = self.xp
        k, rows = int(src.shape[0]), int(np.prod(src.shape[1:]))
        raw = np.asarray(src.data())
        if src.ggml_type in self.native_types:
            t = type_by_id(src.ggml_type)
            return _Part(src.ggml_type, rows, k, cp.asarray(raw.reshape(rows, t.row_bytes(k))), True)
        w = dequantize(src.ggml_type, raw, rows * k).reshape(rows, k)
        return _Part(src.ggml_type, rows, k, cp.asarray(w.astype(np.float16)), False)

    def linear_weight(self, sources: Sequence[TensorSource]) -> CudaLinear:
        return CudaLinear([self._part(s) for s in sources], tuple(s.name for s in sources))

    def expert_weight(self, source: TensorSource) -> CudaExperts:
        cp = self.xp
        k, rows, n_exp = (int(x) for x in source.shape)
        raw = np.asarray(source.data())
        if source.ggml_type in self.native_types:
            t = type_by_id(source.ggml_type)
            return CudaExperts(source.ggml_type, cp.asarray(raw.reshape(n_exp, rows, t.row_bytes(k))), True)
        w = dequantize(source.ggml_type, raw, n_exp * rows * k).reshape(n_exp, rows, k)
        return CudaExperts(source.ggml_type, cp.asarray(w.astype(np.float16)), False)

    def vector(self, source: TensorSource) -> Any:
        n = int(np.prod(source.shape))
        return self.xp.asarray(dequantize(source.ggml_type, np.asarray(source.data()), n))

    def embedding(self, source: TensorSource) -> CudaEmbedding:
        return CudaEmbedding(source, int(source.shape[0]))

    # ---- ops ----------------------------------------------------------------------------
    def _one(self, p: _Part, x: Any) -> Any:
        if p.native:
            return self._mmvq.mmvq(p.type_id, p.blocks, p.rows, p.k, x)
        return self.xp.matmul(x, p.blocks.T.astype(self.xp.float32))

    def linear(self, w: CudaLinear, x: Any) -> Any:
        x = self.xp.ascontiguousarray(x, dtype=self.xp.float32)
        outs = [self._one(p, x) for p in w.parts]
        return outs[0] if len(outs) == 1 else self.xp.concatenate(outs, axis=1)

    def linear_experts(self, w: CudaExperts, x: Any, expert_ids: Any) -> Any:
        cp = self.xp
        ids = cp.asarray(expert_ids, dtype=cp.int32)
        n, k = ids.shape
        if x.ndim == 3:  # one input row per (token, expert): flatten to n*k columns of 1 expert
            flat_x = cp.ascontiguousarray(x.reshape(n * k, -1), dtype=cp.float32)
            return self.linear_experts(w, flat_x, ids.reshape(n * k, 1)).reshape(n, k, -1)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if w.native:
            return self._mmvq.mmvq_experts(w.type_id, w.blocks, ids, x)
        sel = w.blocks[ids].astype(cp.float32)  # (n, k, rows, in)
        return cp.einsum("nkri,ni->nkr", sel, x)

    def embed(self, table: CudaEmbedding, token_ids) -> Any:
        ids = np.asarray(token_ids if isinstance(token_ids, np.ndarray) else self.to_host(token_ids), dtype=np.int64)
        src = table.source
        t = type_by_id(src.ggml_type)
        rb = t.row_bytes(table.row_len)
        raw = np.asarray(src.data()).reshape(-1, rb)[ids]
        return self.xp.asarray(dequantize_rows(src.ggml_type, raw))

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a: Any) -> Any:
        return self.xp.asnumpy(a)

    def free_bytes(self) -> int | None:
        free, _total = self.xp.cuda.runtime.memGetInfo()
        return int(free)
