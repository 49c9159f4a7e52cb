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

The class routes each op; the work is in files by concern: cuda_weights (uploads), expert_store
(experts and their address tables), cuda_window (the per-window state and table), cuda_linear,
cuda_attention, cuda_experts, cuda_graphs (window graphs) and cuda_prefill (long prompts' GEMMs).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Collection, Sequence

import numpy as np

from strata.backend import cuda_attention, cuda_experts, cuda_linear
from strata.backend.base import Backend, RopeParams, TensorSource, window_positions
from strata.backend.cuda_weights import CudaEmbedding, CudaLinear, Uploads, weight_bytes
from strata.backend.cuda_window import Capture, WindowState, prompt_layout, splits_for, window_table
from strata.backend.expert_store import CudaExperts, ExpertStore
from strata.errors import OutOfMemory, StrataError
from strata.kernels.dequant import dequantize, dequantize_rows
from strata.kernels.ggml_types import type_by_id, type_by_name

# Switches read from the environment (on unless set to 0) and number knobs (benchmarks, tests)
FUSED_ENV = "STRATA_CUDA_FUSED"
PREFILL_ENV = "STRATA_CUDA_PREFILL"
GROUPED_ENV = "STRATA_CUDA_GROUPED"
GQA_ENV = "STRATA_CUDA_ATT_GQA_MIN"
PREFILL_MIN_WEIGHT_ENV = "STRATA_CUDA_PREFILL_MIN_WEIGHT"  # tests move the floor to tiny packs
PROMPT_TILE_ENV = "STRATA_CUDA_PROMPT_TILE"  # benchmarks try other row tiles
SPLIT_ENV = "STRATA_CUDA_SPLIT_COLUMNS"  # small matrices' columns in parallel (mmvq_policy.split_columns)
PROMPT_ATTENTION_ENV = "STRATA_CUDA_PROMPT_ATTENTION"  # long prompts' attention on tensor cores
PROMPT_EXPERTS_ENV = "STRATA_CUDA_PROMPT_EXPERTS"  # long prompts' experts on tensor cores (mmq_grouped)

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


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, no_native: set[str] | None = None, fused: bool | None = None):
        import cupy as cp

        from strata.backend.cuda_graphs import GRAPHS_ENV, WindowGraphs
        from strata.kernels.cuda import fused as fused_kernels
        from strata.kernels.cuda import mmvq

        self.xp = cp
        self.mm = mmvq
        self.fk = fused_kernels
        self.fused = env_switch(FUSED_ENV) if fused is None else fused
        dropped = {type_by_name(n).id for n in (no_native or set())}
        self.native_types = set(mmvq.supported_types()) - dropped
        self.uploads = Uploads(self._device, self.native_types, mmvq.FLOAT_TYPES)
        self.expert_store = ExpertStore(self._device, self.native_types)
        self._prefill = None  # cuda_prefill.PrefillPath, made at the first long prompt's linear
        self.capture = Capture()  # set by the graph runner while it warms up and captures a window
        self.win = WindowState()  # the current window's (begin_window makes one per window)
        # calls of each grouped experts kernel (mmvq_experts_grouped, mmq_experts_grouped): tests and benchmarks
        self.expert_kernels: Counter[str] = Counter()
        self.prefill = self.fused and env_switch(PREFILL_ENV)
        self.long_prompt_tokens = LONG_PROMPT_TOKENS if self.prefill else None
        self.prompt_gemm_min_weight = env_int(PREFILL_MIN_WEIGHT_ENV, PROMPT_GEMM_MIN_WEIGHT, 0)
        self.prompt_gemm_rows = env_int(PROMPT_TILE_ENV, PROMPT_GEMM_ROWS, 1)
        self.prompt_attention = self.prefill and env_switch(PROMPT_ATTENTION_ENV)  # (attend)
        self.grouped = self.fused and env_switch(GROUPED_ENV)
        self.prompt_experts = self.prefill and self.grouped and env_switch(PROMPT_EXPERTS_ENV)
        self.split_columns = env_switch(SPLIT_ENV)
        self.gqa_min_tokens = env_int(GQA_ENV, cuda_attention.GQA_MIN_TOKENS, 1)  # benchmarks compare
        self.gqa_min_heads = cuda_attention.GQA_MIN_HEADS
        self.samples_on_device = self.fused  # sampled rows drawn by kernels/cuda/sample.cu
        self.issues_async = True  # kernels and graphs are launched on a stream; to_host waits
        # attention_kv's merge counters (one per token x head; the kernels leave them zeroed):
        # made here, never during a graph capture
        self.att_counters = cp.zeros(cuda_attention.ATT_COUNTERS, dtype=cp.int32) if self.fused else None
        self.graphs = WindowGraphs(self) if self.fused and env_switch(GRAPHS_ENV) else None

    # ---- weights ----------------------------------------------------------------------
    def linear_weight(self, sources: Sequence[TensorSource]) -> CudaLinear:
        return self.uploads.linear_weight(sources, self.fused)

    def expert_weight(self, source: TensorSource) -> CudaExperts:
        return self.expert_store.add(source)

    def vector(self, source: TensorSource) -> Any:
        n = int(np.prod(source.shape))
        return self._device(dequantize(source.ggml_type, np.asarray(source.data()), n), source.name)

    def embedding(self, source: TensorSource) -> CudaEmbedding:
        from strata.kernels.cuda import dequant

        k, rows = int(source.shape[0]), int(np.prod(source.shape[1:]))
        on_device = self.fused and source.ggml_type in dequant.supported_types() and k % 32 == 0
        return CudaEmbedding(source, k, self.uploads.blocks(source, rows) if on_device else None)

    # ---- matrix ops ---------------------------------------------------------------------
    def linear(self, w: CudaLinear, x: Any) -> Any:
        if self.fused and x.ndim == 2:
            return cuda_linear.linear_fused(self, w, x)
        x = self.xp.ascontiguousarray(x, dtype=self.xp.float32)
        outs = [self.mm.mmvq(p.type_id, p.blocks, p.rows, p.k, x) if p.native else cuda_linear.run_generic(self.xp, p, x)
                for p in w.parts]
        return outs[0] if len(outs) == 1 else self.xp.concatenate(outs, axis=1)

    def linear_experts(self, w: CudaExperts, x: Any, expert_ids: Any) -> Any:
        return cuda_experts.linear_experts(self, w, x, expert_ids)

    def linear_experts_pair(self, w1: CudaExperts, w2: CudaExperts, x: Any, expert_ids: Any) -> tuple[Any, Any]:
        r = cuda_experts.linear_experts_pair(self, w1, w2, x, expert_ids)
        return r if r is not None else super().linear_experts_pair(w1, w2, x, expert_ids)

    def prefill_path(self):
        """The long prompts' GEMM path (cuda_prefill.PrefillPath), made at its first use."""
        if self._prefill is None:
            from strata.backend.cuda_prefill import PrefillPath

            self._prefill = PrefillPath()
        return self._prefill

    # fused element-wise ops and attention; None from a kernel wrapper = a layout it does
    # not take, computed by the generic array code instead
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        y = self.fk.rms_norm(x, weight, eps) if self.fused else None
        return y if y is not None else super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: Any, y: Any, weight: Any, eps: float) -> tuple[Any, Any]:
        cp = self.xp
        n = int(x.shape[-1])
        if not self.fused or x.ndim != 2 or x.dtype != cp.float32 or (y is not None and y.shape != x.shape):
            return super().add_rms_norm(x, y, weight, eps)
        x = cp.ascontiguousarray(x)
        y = cp.ascontiguousarray(y, dtype=cp.float32) if y is not None else None
        q8 = self.mm.empty_q8(x.shape[0], n) if n % self.mm.QK == 0 else None
        r = self.fk.add_rms_norm_q8(x, y, weight, eps, q8)
        if r is None:
            return super().add_rms_norm(x, y, weight, eps)
        x, h = r
        self.win.keep_q8(h, q8)  # the projections read these rows next
        return x, h

    def swiglu(self, gate: Any, up: Any) -> Any:
        if self.fused and gate.shape[-1] % self.mm.QK == 0:
            rows = gate.size // gate.shape[-1]
            q8 = self.mm.empty_q8(rows, int(gate.shape[-1]))
            y = self.fk.swiglu_q8(gate, up, q8)
            if y is not None:
                self.win.keep_q8(y, q8)  # the down projection reads these rows next
                return y
        y = self.fk.swiglu(gate, up) if self.fused else None
        return y if y is not None else super().swiglu(gate, up)

    def rope(self, x: Any, positions: Any, *, base: float, dim: int, scale: float, neox: bool,
             frozen: tuple[int, ...] = ()) -> Any:
        y = self.fk.rope(x, positions, base=base, dim=dim, scale=scale, neox=neox) if self.fused and not frozen else None
        return y if y is not None else super().rope(x, positions, base=base, dim=dim, scale=scale, neox=neox,
                                                    frozen=frozen)

    def attention(self, q: Any, k: Any, v: Any, q_positions: Any) -> Any:
        y = self.fk.attention(q, k, v, q_positions) if self.fused else None
        return y if y is not None else super().attention(q, k, v, q_positions)

    def route(self, logits: Any, k: int, normalize: bool) -> tuple[Any, Any]:
        r = self.fk.moe_route(logits, k, normalize) if self.fused else None
        return r if r is not None else super().route(logits, k, normalize)

    def combine_experts(self, d: Any, w: Any) -> Any:
        y = self.fk.moe_combine(d, w) if self.fused else None
        return y if y is not None else super().combine_experts(d, w)

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

    # ---- sampling ------------------------------------------------------------------------
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

    # ---- window ops: the decode path a CUDA graph captures ------------------------------
    def begin_window(self, spans: Sequence[Any]) -> Any:
        """A new WindowState, with the window table (fused.cu) uploaded unless a graph runner
        filled its own buffer; returns the positions, the table's first n entries."""
        n = int(sum(sp.count for sp in spans))
        layout = self.prompt_layout(spans)
        self.win = win = WindowState(n, prompt_spans=[(a, b, spans[i], i) for a, b, i in layout])
        if not self.fused or not self.caches_on_device(spans):
            return self.xp.asarray(window_positions(spans))
        if self.capture.feed is not None:
            win.table, win.splits = self.capture.feed.take()
        else:
            win.table, win.splits = self.xp.asarray(self.window_table(spans)), self.splits_for(spans)
        return win.table[:n]

    def prompt_layout(self, spans: Sequence[Any]) -> tuple[tuple[int, int, int], ...]:
        """(first row, end row, span index) of each long prompt's span (part of a graph's shape)."""
        return prompt_layout(spans, self.prefill)

    def end_blocks(self) -> None:
        self.win.blocks_done = True  # the head's rows are a selection: never the prompt path

    def caches_on_device(self, spans: Sequence[Any]) -> bool:
        """Whether every span's cache is one the fused attention kernels read."""
        fk = self.fk
        return all(sp.cache.xp is self.xp and sp.cache.d <= fk.KV_MAX_HEAD_DIM
                   and sp.cache.d % fk.KV_HEAD_DIM_STEP == 0 for sp in spans)

    def window_table(self, spans: Sequence[Any]) -> np.ndarray:
        """The window table (see fused.cu) of these spans, on the host."""
        return window_table(spans)

    def splits_for(self, spans: Sequence[Any]) -> int:
        return splits_for(spans, self.fk.ATT_CHUNK)

    def attend(self, layer: int, q: Any, k: Any, v: Any, spans: Sequence[Any], positions: Any,
               rope: RopeParams, q_norm: Any = None, k_norm: Any = None, eps: float = 0.0) -> Any:
        if self.win.table is None or rope.frozen:  # (the fused kernel rotates every pair)
            return super().attend(layer, q, k, v, spans, positions, rope, q_norm, k_norm, eps)
        return cuda_attention.attend(self, layer, q, k, v, spans, rope, q_norm, k_norm, eps)

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

    def weight_bytes(self, tensors: Sequence[Any], mapped: Collection[str] = ()) -> int | None:
        return weight_bytes([t for t in tensors if t.name not in mapped], self.native_types)

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
        return self.uploads.mark()

    def drop_uploads_since(self, mark: int) -> None:
        self.uploads.drop_since(mark)

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
