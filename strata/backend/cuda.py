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

Prefill: an MoE's (token, expert) pairs are grouped by expert (one weight pass per tile of 8
pairs, the decode kernel's bits; long prompts' rows on int8 tensor cores, a tile of 32 pairs:
mmq_grouped), attention takes a KV group's 8 query heads per block, and long prompts' rows
multiply large weights through dequant + cuBLAS GEMM in fixed row tiles (chosen per request,
never per window, so batching stays bit-invariant).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, RopeParams, TensorSource, window_positions
from strata.errors import OutOfMemory, StrataError
from strata.kernels.cuda.launch import launch
from strata.kernels.dequant import dequantize, dequantize_rows
from strata.kernels.ggml_types import type_by_id, type_by_name


# Switches read from the environment (on unless set to 0) and number knobs (benchmarks, tests)
FUSED_ENV = "STRATA_CUDA_FUSED"
PREFILL_ENV = "STRATA_CUDA_PREFILL"
GROUPED_ENV = "STRATA_CUDA_GROUPED"
GQA_ENV = "STRATA_CUDA_ATT_GQA_MIN"
PREFILL_MIN_WEIGHT_ENV = "STRATA_CUDA_PREFILL_MIN_WEIGHT"  # tests move the floor to tiny packs
PROMPT_TILE_ENV = "STRATA_CUDA_PROMPT_TILE"  # benchmarks try other row tiles
SPLIT_ENV = "STRATA_CUDA_SPLIT_COLUMNS"  # small matrices' columns in parallel (mmvq.split_columns)
PROMPT_ATTENTION_ENV = "STRATA_CUDA_PROMPT_ATTENTION"  # long prompts' attention on tensor cores
PROMPT_EXPERTS_ENV = "STRATA_CUDA_PROMPT_EXPERTS"  # long prompts' experts on tensor cores (mmq_grouped)

MAX_SPLITS = 64  # attention key splits per (head, token)
ATT_COUNTERS = 1 << 16  # tokens x heads a window may have for attention_kv to merge its own splits

# Windows of at least this many tokens run attention with one block per KV group's query heads
# (fused.attention_kv gqa=True: K/V loaded once for the group; the same bits as one block per
# head). Decode windows keep one head per block (more blocks in flight for a few tokens).
GQA_MIN_TOKENS = 16
# ... and only where a block takes at least this many query heads: measured faster with 8
# (seed-moe pp512 3249 -> 3379), the same with 4 (dense-8b), slower with 3 (SmolLM2: 37.9k ->
# 33.6k tok/s: the 8-head kernel's registers leave one block per SM)
GQA_MIN_HEADS = 8

# Experts grouped by expert (mmvq_grouped: one weight pass per tile of up to 8 pairs of one
# expert) from this many (token, expert) pairs per expert on average: prefill windows. Decode
# windows (a few tokens, captured in graphs) keep one pass per pair; both give the same bits.
GROUPED_PAIRS_PER_EXPERT = 2

# Long prompts' rows (Span.long_prompt, prompts of at least LONG_PROMPT_TOKENS tokens) multiply
# large weights (rows * k >= PROMPT_GEMM_MIN_WEIGHT) through dequant + cuBLAS GEMM in fixed
# tiles of PROMPT_GEMM_ROWS rows (backend/cuda_prefill.py); every other row takes MMVQ. The two
# round differently (f16 vs Q8_1 activations), so the choice is made per request (its prompt
# length) and per weight, never per window: a row's bits do not depend on what shares it.
# Measured on the H200 (bench_gpu_engine.py, dense-8b pp512):
# MMVQ 2783 tok/s; GEMM row tiles of 64 / 128 / 256 rows 6370 / 7888 / 8820. A window on this
# path costs ~50 ms of dequantization and launches before its GEMMs (~4 ms per row tile), so it
# beats MMVQ (~0.36 ms per row) from ~150 rows on: hence prompts of 256 tokens or more. Slower
# on SmolLM2's small weights whatever the rows (hence the weight floor).
LONG_PROMPT_TOKENS = 256
PROMPT_GEMM_ROWS = 256
PROMPT_GEMM_MIN_WEIGHT = 1 << 22


# CUDA errors after which the context can run nothing more (the process must start again):
# ECC uncorrectable, hardware stack error, illegal instruction, misaligned address, invalid
# address space, invalid PC, launch failure (a trap), illegal address
STICKY_CUDA_ERRORS = frozenset({214, 714, 715, 716, 717, 718, 719, 700})


def env_switch(name: str) -> bool:
    """An on/off switch from the environment: on unless set to 0 (benchmarks compare)."""
    return os.environ.get(name, "1") != "0"


def env_int(name: str, default: int, minimum: int) -> int:
    """A whole-number setting from the environment (benchmark and test knobs): one clear line
    naming the variable when it is not a number >= minimum."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise StrataError(f"{name}={raw!r}: expected a whole number >= {minimum}")
    return value




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
    source: TensorSource  # host memmap of the blocks
    row_len: int
    blocks: Any = None  # the blocks on the device (rows gathered there), or None: on the host


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, no_native: set[str] | None = None, fused: bool | None = None):
        import cupy as cp

        from strata.kernels.cuda import attention_prefill
        from strata.kernels.cuda import fused as fused_kernels
        from strata.kernels.cuda import mmvq

        self.xp = cp
        self._mmvq = mmvq
        self._fk = fused_kernels
        self._fa = attention_prefill
        self.fused = env_switch(FUSED_ENV) if fused is None else fused
        dropped = {type_by_name(n).id for n in (no_native or set())}
        self.native_types = set(mmvq.supported_types()) - dropped
        self._q8_memo: tuple[Any, Any] | None = None  # (activations, their Q8Buffer)
        # (expert ids, {row range: (its mmvq.ExpertPlan, its Q8 slices)}): gate, up and down share them
        self._plan_memo: tuple[Any, dict] | None = None
        self._uploads: dict[int, tuple[Any, Any]] = {}  # id(source) -> (source, its blocks on the device)
        self._prefill = None  # cuda_prefill.PrefillPath, made at the first wide window
        self.capturing = False  # set by the graph runner while it warms up and captures a window
        # what made the window being warmed up uncapturable (cuBLAS, a host upload, the grouped
        # experts' plan): the runner then keeps that shape eager (cuda_graphs.WindowGraphs)
        self.capture_blockers: set[str] = set()
        # calls of each grouped experts kernel (mmvq_experts_grouped, mmq_experts_grouped): tests and benchmarks
        self.expert_kernels: Counter[str] = Counter()
        self.prefill = self.fused and env_switch(PREFILL_ENV)
        self.long_prompt_tokens = LONG_PROMPT_TOKENS if self.prefill else None
        self.prompt_gemm_min_weight = env_int(PREFILL_MIN_WEIGHT_ENV, PROMPT_GEMM_MIN_WEIGHT, 0)
        self.prompt_gemm_rows = env_int(PROMPT_TILE_ENV, PROMPT_GEMM_ROWS, 1)
        # (first row, end row, span) of the current window's long-prompt spans, and their rows as
        # the projections' prompt path sees them (emptied for the head's rows)
        self._prompt_spans: list[tuple[int, int, Any, int]] = []  # (first row, end row, span, span index)
        self._prompt_rows: list[tuple[int, int]] = []
        self._head_attention = None  # (table, splits) of the rows before the prompts, once per window
        self.prompt_attention = self.prefill and env_switch(PROMPT_ATTENTION_ENV)  # (attend)
        self._win_n = 0
        self.grouped = self.fused and env_switch(GROUPED_ENV)
        self.prompt_experts = self.prefill and self.grouped and env_switch(PROMPT_EXPERTS_ENV)
        self.split_columns = env_switch(SPLIT_ENV)
        self.gqa_min_tokens = env_int(GQA_ENV, GQA_MIN_TOKENS, 1)  # benchmarks compare
        self.gqa_min_heads = GQA_MIN_HEADS
        self._win = None  # the current window's table on the device (fused path)
        # set by the graph runner: (table buffer a graph reads, [(offset, length, splits)] of each
        # window the captured function begins, in order); _win_next counts the windows begun
        self._win_static: tuple[Any, list[tuple[int, int, int]]] | None = None
        self._win_next = 0
        self.splits = 1  # attention key splits of the current window
        self.samples_on_device = self.fused  # sampled rows drawn by kernels/cuda/sample.cu
        self.issues_async = True  # kernels and graphs are launched on a stream; to_host waits
        # attention_kv's merge counters (one per token x head; the kernels leave them zeroed):
        # made here, never during a graph capture
        self._att_counters = cp.zeros(ATT_COUNTERS, dtype=cp.int32) if self.fused else None
        from strata.backend.cuda_graphs import GRAPHS_ENV, WindowGraphs

        self.graphs = WindowGraphs(self) if self.fused and env_switch(GRAPHS_ENV) else None

    # ---- weights ----------------------------------------------------------------------
    def _upload(self, src: TensorSource, rows: int) -> Any:
        """The raw blocks of a tensor on the device as (rows, row_bytes) uint8, uploaded once
        (a tied embedding and output head share them)."""
        # keyed by the source object, not its name: a draft's tensors may share the main
        # model's names; the entry holds the source so its id is never reused
        hit = self._uploads.get(id(src))
        if hit is None:
            row_bytes = type_by_id(src.ggml_type).row_bytes(int(src.shape[0]))
            hit = (src, self._device(np.asarray(src.data()).reshape(rows, row_bytes), src.name))
            self._uploads[id(src)] = hit
        return hit[1]

    def _part(self, src: TensorSource) -> _Part:
        k, rows = int(src.shape[0]), int(np.prod(src.shape[1:]))
        if src.ggml_type in self.native_types:
            return _Part(src.ggml_type, rows, k, self._upload(src, rows), True)
        raw = np.asarray(src.data())
        w = dequantize(src.ggml_type, raw, rows * k).reshape(rows, k)
        return _Part(src.ggml_type, rows, k, self._device(w.astype(np.float16), f"{src.name} (as float16)"), False)

    def _merged(self, sources: Sequence[TensorSource]) -> _Part:
        """One native part from several sources of one type and row length, rows stacked:
        each output row is the same dot product as in its own weight, one launch for all."""
        t = type_by_id(sources[0].ggml_type)
        k = int(sources[0].shape[0])
        raws = [np.asarray(s.data()).reshape(-1, t.row_bytes(k)) for s in sources]
        raw = np.concatenate(raws, axis=0)
        return _Part(t.id, raw.shape[0], k, self._device(raw, ", ".join(s.name for s in sources)), True)

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
        k, rows, n_exp = (int(x) for x in source.shape)
        raw = np.asarray(source.data())
        if source.ggml_type in self.native_types:
            blocks = raw.reshape(n_exp, rows, type_by_id(source.ggml_type).row_bytes(k))
            return CudaExperts(source.ggml_type, self._device(blocks, source.name), True)
        w = dequantize(source.ggml_type, raw, n_exp * rows * k).reshape(n_exp, rows, k)
        return CudaExperts(source.ggml_type, self._device(w.astype(np.float16), f"{source.name} (as float16)"), False)

    def vector(self, source: TensorSource) -> Any:
        n = int(np.prod(source.shape))
        return self._device(dequantize(source.ggml_type, np.asarray(source.data()), n), source.name)

    def embedding(self, source: TensorSource) -> CudaEmbedding:
        from strata.kernels.cuda import dequant

        k, rows = int(source.shape[0]), int(np.prod(source.shape[1:]))
        on_device = self.fused and source.ggml_type in dequant.supported_types() and k % 32 == 0
        return CudaEmbedding(source, k, self._upload(source, rows) if on_device else None)

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

    def _memo(self, x: Any):
        """The Q8_1 blocks a fused kernel made along with x (norm, swiglu), if x is that array."""
        m = self._q8_memo
        return m[1] if m is not None and m[0] is x else None

    def _q8_for(self, x: Any) -> tuple[Any, Any]:
        """x as contiguous float32 and its Q8_1 blocks: the ones a fused kernel made along with
        x, else quantized now and remembered (gate and up, or an MoE's experts, read the same rows)."""
        q8 = self._memo(x)
        x = self.xp.ascontiguousarray(x, dtype=self.xp.float32)
        if q8 is None:
            q8 = self._quantize(x)
            self._q8_memo = (x, q8)
        return x, q8

    def _linear_fused(self, w: CudaLinear, x: Any) -> Any:
        cp = self.xp
        q8 = self._memo(x)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[0]
        if q8 is None and w.needs_q8:
            q8 = self._quantize(x)  # once, shared by every part
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
            launch(mm._quant_kernel(), ((nblocks * 32 + 255) // 256,), (256,), (x, np.int32(nblocks), buf.q, buf.meta, buf.s))
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
            return mm.mmvq(p.type_id, p.blocks, p.rows, p.k, x, out=out)  # (float: no split)
        if self._prompt_rows and n == self._win_n and p.rows * p.k >= self.prompt_gemm_min_weight:
            return self._run_prompt_rows(p, x, q8, out)
        if not 0 < n <= mm.MAX_COLS:
            # several launches: the wrapper splits the columns
            return mm.mmvq(p.type_id, p.blocks, p.rows, p.k, q8 if q8 is not None else x, out=out,
                           split=self.split_columns)
        cached = p.launches.get(n)
        if cached is None:
            # the launch mmvq.mmvq makes for n columns, with everything but the activations
            # and the output worked out once
            row_bytes = type_by_id(p.type_id).row_bytes(p.k)
            (ln,) = mm.column_launches(p.type_id, p.rows, n, self.split_columns,
                                       mm.rows_aligned(p.blocks, row_bytes), p.k)
            cached = (mm._function(p.type_id, ln.name), ln,
                      (p.blocks, np.int32(p.rows), np.int32(row_bytes), np.int32(p.k), np.int32(ln.rpw)))
            p.launches[n] = cached
        fn, ln, lead = cached
        if out is None:
            out = cp.empty((n, p.rows), dtype=cp.float32)
        launch(fn, ln.grid, ln.block, lead + (q8.q, q8.meta, out), shared_mem=ln.smem)  # PDL while captured
        return out

    def _run_prompt_rows(self, p: _Part, x: Any, q8: Any, out: Any) -> Any:
        """A window with long-prompt rows: those rows through dequant + GEMM in fixed row tiles,
        the others (decode rows, short prompts) through MMVQ as in any window."""
        if self.capturing and not self._prefill_path().capturable:  # the runner then keeps it eager
            self.capture_blockers.add("prompt GEMM (cuBLAS)")
        mm = self._mmvq
        n = x.shape[0]
        if out is None or not out.flags.c_contiguous:
            res = self.xp.empty((n, p.rows), dtype=self.xp.float32)
        else:
            res = out
        a = 0
        for r0, r1 in self._prompt_rows + [(n, n)]:
            if a < r0:  # the rows before this prompt's: MMVQ on their Q8_1 blocks
                part = mm.Q8Buffer(q8.q[a:r0], q8.meta[a:r0], q8.s[a:r0], r0 - a, q8.k)
                mm.mmvq(p.type_id, p.blocks, p.rows, p.k, part, out=res[a:r0], split=self.split_columns)
            if r0 < r1:
                self._prefill_path().linear(p.type_id, p.blocks, p.rows, p.k, x[r0:r1], out=res[r0:r1],
                                            tile_m=self.prompt_gemm_rows)
            a = r1
        if res is not out and out is not None:
            out[...] = res
            return out
        return res

    # fused element-wise ops and attention; None from a kernel wrapper = a layout it does
    # not take, computed by the generic array code instead
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        y = self._fk.rms_norm(x, weight, eps) if self.fused else None
        return y if y is not None else super().rms_norm(x, weight, eps)

    def swiglu(self, gate: Any, up: Any) -> Any:
        if self.fused and gate.shape[-1] % self._mmvq.QK == 0:
            rows = gate.size // gate.shape[-1]
            q8 = self._mmvq.empty_q8(rows, int(gate.shape[-1]))
            y = self._fk.swiglu_q8(gate, up, q8)
            if y is not None:
                self._q8_memo = (y, q8)  # the down projection reads these rows next
                return y
        y = self._fk.swiglu(gate, up) if self.fused else None
        return y if y is not None else super().swiglu(gate, up)

    def rope(self, x: Any, positions: Any, *, base: float, dim: int, scale: float, neox: bool,
             frozen: tuple[int, ...] = ()) -> Any:
        y = self._fk.rope(x, positions, base=base, dim=dim, scale=scale, neox=neox) if self.fused and not frozen else None
        return y if y is not None else super().rope(x, positions, base=base, dim=dim, scale=scale, neox=neox,
                                                    frozen=frozen)

    def attention(self, q: Any, k: Any, v: Any, q_positions: Any) -> Any:
        y = self._fk.attention(q, k, v, q_positions) if self.fused else None
        return y if y is not None else super().attention(q, k, v, q_positions)

    def delta_net_kernels(self, hybrid: Any) -> bool:
        from strata.kernels.cuda import delta_net as dn

        return self.fused and dn.supported(hybrid.d_state, hybrid.d_conv)

    def keep_replay_rows(self, proj: Any, pool: Any, layer: int, spans: Sequence[Any], table: Any) -> None:
        if not self.fused:
            return super().keep_replay_rows(proj, pool, layer, spans, table)
        from strata.kernels.cuda import delta_net as dn

        dn.keep_rows(proj, pool.replay, layer, table, len(spans))  # (the table, not the host: graphable)

    def delta_net_window(self, layer: Any, proj: Any, pool: Any, index: int, table: Any, n_spans: int,
                         write_out: bool) -> Any:
        from strata.kernels.cuda import delta_net as dn

        h = layer.h
        if not self.delta_net_kernels(h):
            return NotImplemented
        y = dn.conv_window(proj[:, : h.conv_dim], layer.conv_w, pool.conv, index, table, n_spans)
        return dn.delta_window(y, proj, layer, pool.ssm, index, table, n_spans, layer.cfg.rms_eps, write_out)

    # ---- window ops: the decode path a CUDA graph captures ------------------------------
    def begin_window(self, spans: Sequence[Any]) -> Any:
        """Uploads the window table (fused.cu) unless a graph runner filled its own buffer;
        returns the positions, the table's first n entries."""
        self._q8_memo = self._plan_memo = self._head_attention = None
        n = int(sum(sp.count for sp in spans))
        self._win_n = n
        self._prompt_spans = [(a, b, spans[i], i) for a, b, i in self.prompt_layout(spans)]
        self._prompt_rows = [(a, b) for a, b, _, _ in self._prompt_spans]
        if not self.fused or not self._cuda_caches(spans):
            self._win = None
            return self.xp.asarray(window_positions(spans))
        if self._win_static is not None:
            buf, parts = self._win_static
            if self._win_next >= len(parts):
                raise RuntimeError(f"a graphed function began more than the {len(parts)} window(s) it declared")
            off, length, self.splits = parts[self._win_next]
            self._win_next += 1
            self._win = buf[off : off + length]
        else:
            self._win = self.xp.asarray(self.window_table(spans))
            self.splits = self.splits_for(spans)
        return self._win[:n]

    def prompt_layout(self, spans: Sequence[Any]) -> tuple[tuple[int, int, int], ...]:
        """(first row, end row, span index) of each long prompt's span in the window: which
        rows take the prompt paths (part of a window graph's shape)."""
        out, off = [], 0
        for i, sp in enumerate(spans):
            if self.prefill and getattr(sp, "long_prompt", False):
                out.append((off, off + int(sp.count), i))
            off += int(sp.count)
        return tuple(out)

    def end_blocks(self) -> None:
        # the head's rows are a selection of the window's (logit rows): never the prompt path,
        # even when as many rows are chosen as the window has
        self._prompt_rows = []

    def _cuda_caches(self, spans: Sequence[Any]) -> bool:
        fk = self._fk
        return all(sp.cache.xp is self.xp and sp.cache.d <= fk.KV_MAX_HEAD_DIM
                   and sp.cache.d % fk.KV_HEAD_DIM_STEP == 0 for sp in spans)

    def window_table(self, spans: Sequence[Any]) -> np.ndarray:
        """The window table (see fused.cu) of these spans, on the host."""
        counts = [int(sp.count) for sp in spans]
        n, ns = sum(counts), len(spans)
        tab = np.empty(2 * n + 3 * ns, dtype=np.int64)
        tab[:n] = window_positions(spans)
        tab[n : 2 * n] = np.repeat(np.arange(ns), counts)
        for i, sp in enumerate(spans):
            tab[2 * n + 3 * i : 2 * n + 3 * i + 3] = (sp.start, sp.start + sp.count, self._cache_table(sp.cache))
        return tab

    def _cache_table(self, cache: Any) -> int:
        """Address of the cache's table: capacity, then per layer the addresses of k, v and
        the int8 scales. Rebuilt when the cache's arrays move (its generation: a growth, also
        one that ran out of memory half way)."""
        memo = getattr(cache, "_cuda_table", None)
        if memo is None or memo[2] != cache.generation:
            ptrs = [cache._cap]
            for layer in range(cache.n_layer):
                scales = (cache._ks[layer].data.ptr, cache._vs[layer].data.ptr) if cache.kind == "int8" else (0, 0)
                ptrs += [cache._k[layer].data.ptr, cache._v[layer].data.ptr, *scales]
            memo = (cache._cap, self.xp.asarray(np.asarray(ptrs, dtype=np.int64)), cache.generation)
            cache._cuda_table = memo
        return int(memo[1].data.ptr)

    def splits_for(self, spans: Sequence[Any]) -> int:
        """Attention key splits: one thread block per 256-key chunk of the longest span (a power
        of two, at most 64: graph keys stay few). A span's chunks then never share a block, so
        its attention rounds the same whatever else is in the window (batch invariance), up to
        64 chunks (16k keys)."""
        longest = max(int(sp.start + sp.count) for sp in spans)
        chunks = min(-(-longest // self._fk.ATT_CHUNK), MAX_SPLITS)
        return 1 << max(0, (chunks - 1).bit_length())

    def attend(self, layer: int, q: Any, k: Any, v: Any, spans: Sequence[Any], positions: Any,
               rope: RopeParams, q_norm: Any = None, k_norm: Any = None, eps: float = 0.0) -> Any:
        if self._win is None or rope.frozen:  # (the fused kernel rotates every pair)
            return super().attend(layer, q, k, v, spans, positions, rope, q_norm, k_norm, eps)
        fk = self._fk
        int8 = spans[0].cache.kind == "int8"
        qr = fk.rope_kv_write(q, k, v, self._win, layer, int8, base=rope.base, dim=rope.dim,
                              scale=rope.scale, neox=rope.neox, q_norm=q_norm, k_norm=k_norm, eps=eps)
        n, heads, d = (int(x) for x in q.shape)
        n_kv = int(k.shape[1])
        q8 = self._mmvq.empty_q8(n, heads * d) if d % self._mmvq.QK == 0 else None
        # long prompts' rows attend through attention_prefill (f16 tensor cores) where their head
        # size has a kernel: the same per-request rule as their projections' GEMM path
        prompts = self._prompt_spans if self.prompt_attention and self._fa.supported(d) else []
        if not prompts:
            out = fk.attention_kv(qr, self._win, layer, n_kv, int8, self.splits, q8, self._att_counters,
                                  gqa=self._gqa(n, heads, n_kv))
        else:
            out = self._attend_with_prompts(layer, qr, spans, prompts, n_kv, int8, q8)
        self._q8_memo = (out, q8) if q8 is not None else None  # the output projection reads them
        return out

    def _gqa(self, n: int, heads: int, n_kv: int) -> bool:
        return n >= self.gqa_min_tokens and self._fk.heads_per_block(heads, n_kv) >= self.gqa_min_heads

    def _attend_with_prompts(self, layer: int, qr: Any, spans: Sequence[Any], prompts: list, n_kv: int,
                             int8: bool, q8: Any) -> Any:
        """Long prompts' rows through attention_prefill, the others through attention_kv. The
        scheduler puts prefill rows after decode rows, so the prompts usually end the window:
        attention_kv then takes only the rows before them (a table of their own spans); otherwise
        it takes every row and the prompts' rows are overwritten."""
        cp, fk, fa, mm = self.xp, self._fk, self._fa, self._mmvq
        n, heads, d = (int(x) for x in qr.shape)
        out = cp.empty((n, heads * d), dtype=cp.float32)
        first = prompts[0][0]
        tail = all(a == b for (_, a, _, _), (b, _, _, _) in zip(prompts, prompts[1:])) and prompts[-1][1] == n
        if not tail:
            fk.attention_kv(qr, self._win, layer, n_kv, int8, self.splits, q8, self._att_counters,
                            gqa=self._gqa(n, heads, n_kv), out=out)
        elif first:
            if self.capturing:  # the head rows' table is uploaded from the host: not capturable
                self.capture_blockers.add("decode rows before a prompt's")
            if self._head_attention is None:  # the same for every layer of the window
                head_spans, off = [], 0
                for sp in spans:  # the spans of rows [0, first)
                    if off >= first:
                        break
                    head_spans.append(sp)
                    off += int(sp.count)
                self._head_attention = (cp.asarray(self.window_table(head_spans)), self.splits_for(head_spans))
            table, splits = self._head_attention
            part = mm.Q8Buffer(q8.q[:first], q8.meta[:first], q8.s[:first], first, q8.k) if q8 is not None else None
            fk.attention_kv(qr[:first], table, layer, n_kv, int8, splits, part,
                            self._att_counters, gqa=self._gqa(first, heads, n_kv), out=out[:first])
        for a, b, sp, i in prompts:  # start and cache from the window table (graph replays)
            fa.attention_prefill_window(qr[a:b], self._win, n, i, layer, sp.cache, int(sp.start), out[a:b])
            if q8 is not None:
                mm.quantize_q8_1(out[a:b], mm.Q8Buffer(q8.q[a:b], q8.meta[a:b], q8.s[a:b], b - a, q8.k))
        return out

    def add_rms_norm(self, x: Any, y: Any, weight: Any, eps: float) -> tuple[Any, Any]:
        cp = self.xp
        n = int(x.shape[-1])
        if not self.fused or x.ndim != 2 or x.dtype != cp.float32 or (y is not None and y.shape != x.shape):
            return super().add_rms_norm(x, y, weight, eps)
        x = cp.ascontiguousarray(x)
        y = cp.ascontiguousarray(y, dtype=cp.float32) if y is not None else None
        q8 = self._mmvq.empty_q8(x.shape[0], n) if n % self._mmvq.QK == 0 else None
        r = self._fk.add_rms_norm_q8(x, y, weight, eps, q8)
        if r is None:
            return super().add_rms_norm(x, y, weight, eps)
        x, h = r
        self._q8_memo = (h, q8) if q8 is not None else None
        return x, h

    def route(self, logits: Any, k: int, normalize: bool) -> tuple[Any, Any]:
        r = self._fk.moe_route(logits, k, normalize) if self.fused else None
        return r if r is not None else super().route(logits, k, normalize)

    def combine_experts(self, d: Any, w: Any) -> Any:
        y = self._fk.moe_combine(d, w) if self.fused else None
        return y if y is not None else super().combine_experts(d, w)

    def linear_experts(self, w: CudaExperts, x: Any, expert_ids: Any) -> Any:
        cp = self.xp
        q8 = self._memo(x)
        ids = cp.asarray(expert_ids, dtype=cp.int32)
        n, k = ids.shape
        if self._grouped(ids, w):
            return self._experts_grouped(w, x, ids)
        if x.ndim == 3:  # one input row per (token, expert): flatten to n*k columns of 1 expert
            flat_x = cp.ascontiguousarray(x.reshape(n * k, -1), dtype=cp.float32)
            if q8 is not None:
                self._q8_memo = (flat_x, q8)
            return self.linear_experts(w, flat_x, ids.reshape(n * k, 1)).reshape(n, k, -1)
        if w.native and w.type_id not in self._mmvq.FLOAT_TYPES:
            x, q8 = self._q8_for(x)
            return self._mmvq.mmvq_experts(w.type_id, w.blocks, ids, x, q8=q8)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if w.native:
            return self._mmvq.mmvq_experts(w.type_id, w.blocks, ids, x)
        sel = w.blocks[ids].astype(cp.float32)  # (n, k, rows, in)
        return cp.einsum("nkri,ni->nkr", sel, x)

    def sample_rows(self, logits: Any, params: np.ndarray) -> Any:
        if not self.fused or logits.ndim != 2:
            return None
        from strata.kernels.cuda import sample

        return sample.sample_rows(self.xp.ascontiguousarray(logits, dtype=self.xp.float32), params)

    def _top(self, x: Any) -> tuple[Any, Any] | None:
        """(argmax, top probability) per row by one kernel (kernels/cuda/sample.cu top_rows)."""
        if not self.fused or x.ndim != 2 or x.dtype != self.xp.float32:
            return None
        from strata.kernels.cuda import sample

        return sample.top_rows(x)

    def argmax_rows(self, x: Any) -> Any:
        top = self._top(x)
        return top[0] if top is not None else super().argmax_rows(x)

    def top_rows(self, logits: Any) -> tuple[Any, Any]:
        top = self._top(logits)
        return top if top is not None else super().top_rows(logits)

    def linear_experts_pair(self, w1: CudaExperts, w2: CudaExperts, x: Any, expert_ids: Any) -> tuple[Any, Any]:
        mm = self._mmvq
        quantized = all(w.native and w.type_id not in mm.FLOAT_TYPES for w in (w1, w2))
        if not (self.fused and quantized and x.ndim == 2 and w1.blocks.shape[0] == w2.blocks.shape[0]):
            return super().linear_experts_pair(w1, w2, x, expert_ids)
        ids = self.xp.asarray(expert_ids, dtype=self.xp.int32)
        if self._grouped(ids, w1, w2):
            return self._experts_grouped(w1, x, ids), self._experts_grouped(w2, x, ids)
        _, q8 = self._q8_for(x)
        return mm.mmvq_experts_pair(w1.type_id, w1.blocks, w2.type_id, w2.blocks, ids, q8)

    def _grouped(self, ids: Any, *ws: CudaExperts) -> bool:
        """Whether these experts run grouped by expert: quantized native weights and many pairs,
        or a window with long prompts' rows, whose pairs always take mmq_grouped (their bits
        must not depend on the window's size). Not in a decode window's graph (one pass per
        pair there, the same bits). A wide window's graph holds it (the plan is one kernel that
        reads the window's ids), unless the plan takes CuPy's sort (thousands of experts)."""
        mm = self._mmvq
        n_expert = int(ws[0].blocks.shape[0])
        if not (self.grouped and ids.ndim == 2
                and all(w.native and w.type_id not in mm.FLOAT_TYPES and w.blocks.shape[0] == n_expert for w in ws)):
            return False
        prompt = bool(self._expert_prompt_rows(ids))
        if not (prompt or ids.size >= GROUPED_PAIRS_PER_EXPERT * n_expert):
            return False
        if self.capturing:
            from strata.backend.cuda_graphs import MAX_GRAPH_TOKENS

            if self._win_n <= MAX_GRAPH_TOKENS and not prompt:
                return False
            if not mm.plan_in_one_launch(int(ids.size), n_expert):
                self.capture_blockers.add("grouped experts (plan by CuPy's sort)")
        return True

    def _expert_prompt_rows(self, ids: Any) -> list[tuple[int, int]]:
        """The long prompts' row ranges of an experts call over the window's rows ([] when
        their experts keep MMVQ, or the call is not over the window's rows)."""
        return self._prompt_rows if self.prompt_experts and int(ids.shape[0]) == self._win_n else []

    def _experts_grouped(self, w: CudaExperts, x: Any, ids: Any) -> Any:
        """x (n, in) shared by a token's experts or (n, k, in) one row per pair -> (n, k, out).
        Long prompts' rows through mmq_grouped (tensor cores), the others through mmvq_grouped,
        each range of rows on a plan of its own."""
        mm, cp = self._mmvq, self.xp
        n, k = ids.shape
        n_expert = int(w.blocks.shape[0])
        memo = self._plan_memo
        if memo is None or memo[0] is not ids:
            memo = (ids, {})  # gate, up and down share the plans
            self._plan_memo = memo
        q8 = self._memo(x)
        per_pair = x.ndim == 3
        if q8 is None:
            _, q8 = self._q8_for(x.reshape(n * k, -1) if per_pair else x)
        prompts = self._expert_prompt_rows(ids)
        ranges, a = [], 0
        for r0, r1 in prompts + [(n, n)]:
            if a < r0:
                ranges.append((a, r0, False))
            if r0 < r1:
                ranges.append((r0, r1, True))
            a = r1
        out = None if len(ranges) == 1 else cp.empty((n * k, int(w.blocks.shape[1])), dtype=cp.float32)
        for a, b, prompt in ranges:
            # a type or length mmq_grouped does not take keeps mmvq_grouped (a fixed choice per matrix)
            mmq = prompt and mm.mmq_supports(w.type_id, q8.k)
            cols = mm.MMQ_COLS if mmq else mm.GROUP_COLS
            entry = memo[1].get((a, b, n_expert, cols))
            if entry is None:
                plan = mm.expert_plan(ids if len(ranges) == 1 else ids[a:b], n_expert, cols=cols)
                entry = memo[1][(a, b, n_expert, cols)] = (plan, {})
            plan, slices = entry
            part = q8
            if len(ranges) > 1:  # this range's activation rows (views), the same object for gate and up
                per = k if per_pair else 1
                cached = slices.get(per_pair)
                if cached is None or cached[0] is not q8:
                    cached = slices[per_pair] = (q8, mm.Q8Buffer(q8.q[a * per : b * per], q8.meta[a * per : b * per],
                                                                 q8.s[a * per : b * per], (b - a) * per, q8.k))
                part = cached[1]
            run = mm.mmq_experts_grouped if mmq else mm.mmvq_experts_grouped
            self.expert_kernels[run.__name__] += 1
            y = run(w.type_id, w.blocks, plan, part, per_pair=per_pair)
            if out is None:
                return y.reshape(n, k, -1)
            out[a * k : b * k] = y
        return out.reshape(n, k, -1)

    def _prefill_path(self):
        if self._prefill is None:
            from strata.backend.cuda_prefill import PrefillPath

            self._prefill = PrefillPath()
        return self._prefill

    def embed(self, table: CudaEmbedding, token_ids) -> Any:
        if table.blocks is None:
            return self.xp.asarray(self.embed_host(table, token_ids))
        from strata.kernels.cuda import dequant

        ids = token_ids if isinstance(token_ids, self.xp.ndarray) else self.xp.asarray(np.asarray(token_ids, np.int64))
        return dequant.get_rows(table.source.ggml_type, table.blocks, ids, table.row_len)

    def embed_host(self, table: CudaEmbedding, token_ids) -> np.ndarray:
        """Embedding rows dequantized on the host (n, n_embd) float32: a few rows per window."""
        ids = np.asarray(token_ids if isinstance(token_ids, np.ndarray) else self.to_host(token_ids), dtype=np.int64)
        src = table.source
        t = type_by_id(src.ggml_type)
        rb = t.row_bytes(table.row_len)
        raw = np.asarray(src.data()).reshape(-1, rb)[ids]
        return dequantize_rows(src.ggml_type, raw)

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a: Any) -> Any:
        return self.xp.asnumpy(a)

    def free_bytes(self) -> int | None:
        """The device's free memory plus what CuPy's pool holds free for reuse, within the pool's
        limit when one is set (CUPY_GPU_MEMORY_LIMIT)."""
        free, _total = self.xp.cuda.runtime.memGetInfo()
        pool = self.xp.get_default_memory_pool()
        free = int(free) + int(pool.free_bytes())
        limit = int(pool.get_limit())
        return min(free, max(0, limit - int(pool.used_bytes()))) if limit else free

    def weight_bytes(self, tensors: Sequence[Any]) -> int | None:
        """What the pack's tensors take here once loaded, at least: native types their own
        blocks, others dequantized to float16, 1-D tensors float32. The token embedding is left
        out (it may stay on the host)."""
        total = 0
        for t in tensors:
            if t.name.startswith("token_embd"):
                continue
            n = int(np.prod(t.shape))
            if len(t.shape) == 1:
                total += 4 * n
            elif t.ggml_type in self.native_types:
                total += int(t.nbytes)
            else:
                total += 2 * n
        return total

    def is_out_of_memory(self, exc: BaseException) -> bool:
        cp = self.xp
        if isinstance(exc, (MemoryError, cp.cuda.memory.OutOfMemoryError)):
            return True
        # an allocation the runtime refused outside the pool (cudaErrorMemoryAllocation)
        return isinstance(exc, cp.cuda.runtime.CUDARuntimeError) and getattr(exc, "status", None) == 2

    def release_cached_memory(self) -> None:
        self.xp.get_default_memory_pool().free_all_blocks()

    def is_fatal(self, exc: BaseException) -> bool:
        cp = self.xp
        errors = (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError)
        return isinstance(exc, errors) and getattr(exc, "status", None) in STICKY_CUDA_ERRORS

    def inject_fault(self, kind: str) -> None:
        if kind != "gpu-trap":
            super().inject_fault(kind)
        trap = self.xp.RawKernel('extern "C" __global__ void strata_trap() { asm volatile("trap;"); }', "strata_trap")
        trap((1,), (1,), ())
        self.xp.cuda.Device().synchronize()  # the sticky error, here and in every call after

    def upload_mark(self) -> int:
        return len(self._uploads)

    def drop_uploads_since(self, mark: int) -> None:
        for key in list(self._uploads)[mark:]:  # insertion order: the ones made after the mark
            del self._uploads[key]

    def _device(self, host: np.ndarray, what: str) -> Any:
        """host on the device; out of memory there, one line naming what was being loaded."""
        try:
            return self.xp.asarray(host)
        except Exception as e:
            if not self.is_out_of_memory(e):
                raise
        self.release_cached_memory()
        raise OutOfMemory(f"out of GPU memory loading {what}: {host.nbytes / 2**20:.1f} MiB needed, "
                          f"{(self.free_bytes() or 0) / 2**20:.1f} MiB free")
