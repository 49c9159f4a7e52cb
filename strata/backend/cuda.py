"""The CUDA backend (CuPy): weights stay in their GGUF block layout on the device.

Every 2-D and expert weight is uploaded once as raw blocks; mat-vec and small windows run the
native MMVQ kernels of strata.kernels.cuda (activations quantized to Q8_1 on the device,
windows wider than 8 columns run as several launches). A type without a native kernel (or
dropped from the table with --no-native) takes the generic path: dequantized once on the host
and kept as float16 on the device, then cuBLAS.

Decode of a small model is bound by launches, not bytes, so by default (STRATA_CUDA_FUSED unset
or 1) the backend runs fused kernels (strata.kernels.cuda.fused): one launch each for
rms_norm, rope, swiglu and attention instead of the 5-20 CuPy launches of the generic array
code; consecutive parts of a fused weight (q,k,v / gate,up) with one native type are stored
as one weight and run as one MMVQ launch; activations are quantized once per linear() and
shared by its parts; mat-vec launches go straight to the compiled kernel. STRATA_CUDA_FUSED=0
keeps the generic path (array-module ops of Backend with xp = cupy, one launch per part).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, TensorSource
from strata.kernels.dequant import dequantize, dequantize_rows
from strata.kernels.ggml_types import type_by_id, type_by_name


FUSED_ENV = "STRATA_CUDA_FUSED"


def fused_enabled() -> bool:
    return os.environ.get(FUSED_ENV, "1") != "0"


@dataclass
class _Part:
    type_id: int
    rows: int
    k: int
    blocks: Any  # cupy uint8 (rows, row_bytes) for native; cupy float16 (rows, k) for generic
    native: bool
    offset: int = 0  # first output row of this part in the weight's output
    launches: dict = field(default_factory=dict)  # ncols -> (kernel, grid, leading args)


@dataclass
class CudaLinear:
    parts: list[_Part]
    names: tuple[str, ...]
    rows: int = 0  # output rows of all parts
    needs_q8: bool = False  # some part multiplies Q8_1-quantized activations


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

    def __init__(self, no_native: set[str] | None = None, fused: bool | None = None):
        import cupy as cp

        from strata.kernels.cuda import fused as fused_kernels
        from strata.kernels.cuda import mmvq

        self.xp = cp
        self._mmvq = mmvq
        self._fk = fused_kernels
        self.fused = fused_enabled() if fused is None else fused
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

    def _merged(self, sources: Sequence[TensorSource]) -> _Part:
        """One native part from several sources of one type and row length, rows stacked:
        each output row is the same dot product as in its own weight, one launch for all."""
        t = type_by_id(sources[0].ggml_type)
        k = int(sources[0].shape[0])
        raws = [np.asarray(s.data()).reshape(-1, t.row_bytes(k)) for s in sources]
        raw = np.concatenate(raws, axis=0)
        return _Part(t.id, raw.shape[0], k, self.xp.asarray(raw), True)

    def linear_weight(self, sources: Sequence[TensorSource]) -> CudaLinear:
        names = tuple(s.name for s in sources)
        if not self.fused:
            return CudaLinear([self._part(s) for s in sources], names)
        groups: list[list[TensorSource]] = []  # runs of consecutive mergeable sources
        for s in sources:
            prev = groups[-1][-1] if groups else None
            if (prev is not None and s.ggml_type == prev.ggml_type and s.shape[0] == prev.shape[0]
                    and s.ggml_type in self.native_types):
                groups[-1].append(s)
            else:
                groups.append([s])
        parts = [self._merged(g) if len(g) > 1 else self._part(g[0]) for g in groups]
        off = 0
        for p in parts:
            p.offset, off = off, off + p.rows
        needs_q8 = any(p.native and p.type_id not in self._mmvq.FLOAT_TYPES for p in parts)
        return CudaLinear(parts, names, off, needs_q8)

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
        if self.fused and x.ndim == 2:
            return self._linear_fused(w, x)
        x = self.xp.ascontiguousarray(x, dtype=self.xp.float32)
        outs = [self._one(p, x) for p in w.parts]
        return outs[0] if len(outs) == 1 else self.xp.concatenate(outs, axis=1)

    def _linear_fused(self, w: CudaLinear, x: Any) -> Any:
        cp = self.xp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[0]
        q8 = self._quantize(x) if w.needs_q8 else None  # once, shared by every part
        if len(w.parts) == 1:
            return self._run(w.parts[0], x, q8, None)
        if n == 1:  # a column slice of one row is contiguous: parts write in place
            out = cp.empty((1, w.rows), dtype=cp.float32)
            for p in w.parts:
                self._run(p, x, q8, out[:, p.offset : p.offset + p.rows])
            return out
        return cp.concatenate([self._run(p, x, q8, None) for p in w.parts], axis=1)

    def _quantize(self, x: Any):
        """Q8_1 activations of x (n, k) float32 contiguous, k a multiple of 32 (every native
        quantized type's rows are): mmvq.quantize_q8_1's kernel without its argument checks."""
        mm = self._mmvq
        n, k = x.shape
        buf = mm.empty_q8(n, k)
        nblocks = n * (k // mm.QK)
        if nblocks:
            mm._quant_kernel()(((nblocks * 32 + 255) // 256,), (256,), (x, np.int32(nblocks), buf.q, buf.meta, buf.s))
        return buf

    def _run(self, p: _Part, x: Any, q8: Any, out: Any) -> Any:
        """One part of a linear: x (n, k) -> (n, p.rows), into `out` when given."""
        cp, mm = self.xp, self._mmvq
        n = x.shape[0]
        if not p.native:
            r = cp.matmul(x, p.blocks.T.astype(cp.float32))
            if out is None:
                return r
            out[...] = r
            return out
        if p.type_id in mm.FLOAT_TYPES:
            return mm.mmvq(p.type_id, p.blocks, p.rows, p.k, x, out=out)
        if not 0 < n <= mm.MAX_COLS:  # several launches: the wrapper splits the columns
            return mm.mmvq(p.type_id, p.blocks, p.rows, p.k, q8, out=out)
        launch = p.launches.get(n)
        if launch is None:
            # the launch mmvq.mmvq makes for n columns, with everything but the activations
            # and the output worked out once
            name = f"mmvq<{p.type_id}, {n}>"
            rpw = mm._rows_per_warp(p.type_id, name, p.rows)
            row_bytes = type_by_id(p.type_id).row_bytes(p.k)
            launch = (mm._function(p.type_id, name), (-(-p.rows // (rpw * mm.WARPS)),),
                      (p.blocks, np.int32(p.rows), np.int32(row_bytes), np.int32(p.k), np.int32(rpw)))
            p.launches[n] = launch
        fn, grid, lead = launch
        if out is None:
            out = cp.empty((n, p.rows), dtype=cp.float32)
        fn(grid, (mm.WARPS * 32,), lead + (q8.q, q8.meta, out))
        return out

    # fused element-wise ops and attention; None from a kernel wrapper = a layout it does
    # not take, computed by the generic array code instead
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        y = self._fk.rms_norm(x, weight, eps) if self.fused else None
        return y if y is not None else super().rms_norm(x, weight, eps)

    def swiglu(self, gate: Any, up: Any) -> Any:
        y = self._fk.swiglu(gate, up) if self.fused else None
        return y if y is not None else super().swiglu(gate, up)

    def rope(self, x: Any, positions: Any, *, base: float, dim: int, scale: float, neox: bool) -> Any:
        y = self._fk.rope(x, positions, base=base, dim=dim, scale=scale, neox=neox) if self.fused else None
        return y if y is not None else super().rope(x, positions, base=base, dim=dim, scale=scale, neox=neox)

    def attention(self, q: Any, k: Any, v: Any, q_positions: Any) -> Any:
        y = self._fk.attention(q, k, v, q_positions) if self.fused else None
        return y if y is not None else super().attention(q, k, v, q_positions)

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
