"""The backend interface the model is written against.

A backend owns (1) how weights live on its device and (2) the ops the forward pass calls.
Model code only ever calls these methods and array functions of `self.xp` (numpy or cupy),
so the CUDA backend plugs in without touching model code.

Ops with a plain array-module implementation are written here once, for any `xp`; a backend
overrides them where it has something faster (fused kernels on the GPU).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Collection, Protocol, Sequence

import numpy as np

from strata.kernels.ggml_types import type_by_id


class TensorSource(Protocol):
    """What a pack hands to a backend: one tensor in its GGUF block layout."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order: ne0 (row length) first

    def data(self) -> Any: ...  # uint8 array of the raw blocks


@dataclass(frozen=True)
class SourceView:
    """A TensorSource seen another way (a reshape, rows reordered): the same name and type;
    a subclass says its shape and, where the blocks differ, its data."""

    src: TensorSource

    @property
    def name(self) -> str:
        return self.src.name

    @property
    def ggml_type(self) -> int:
        return self.src.ggml_type

    def data(self) -> Any:
        return self.src.data()


@dataclass(frozen=True)
class ExpertTier:
    """Where a backend's expert pool keeps things, in words for the engine's start-up line."""

    slots: str  # the pool's slots ("on the cuda", "as float32 in host RAM")
    blocks: str  # every expert's blocks, the tier a miss is filled from ("in host RAM")


@dataclass(frozen=True)
class RopeParams:
    base: float
    dim: int  # features rotated per head
    scale: float  # linear position scaling
    neox: bool  # pairs (i, i + dim/2) instead of (2i, 2i + 1)
    frozen: tuple[int, ...] = ()  # pairs left unrotated (IMRoPE's fourth section for text tokens)


def window_positions(spans: Sequence[Any]) -> np.ndarray:
    """Absolute positions (n,) int64 of a window's tokens, span after span."""
    if not spans:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(s.start, s.start + s.count, dtype=np.int64) for s in spans])


class Backend(ABC):
    name = "abstract"
    xp: Any = None  # the array module
    # prompts of at least this many tokens have their rows multiplied by the backend's prompt
    # path (Span.long_prompt); None: one path for every row
    long_prompt_tokens: int | None = None

    # ---- weights -------------------------------------------------------------------
    @abstractmethod
    def linear_weight(self, sources: Sequence[TensorSource]) -> Any:
        """A 2-D weight (or several with one row length, fused along the output rows)."""

    def head_columns(self, w: Any, ids: np.ndarray) -> Any | None:
        """The weight `w` restricted to the outputs `ids`, for an MTP draft with a vocabulary
        (mtp.vocab) to compute the shared head on those tokens only; None where the full head
        is cheap enough to keep (here by default: worth it only where the head is a large part
        of a step, the CPU)."""
        return None

    @abstractmethod
    def expert_weight(self, source: TensorSource) -> Any:
        """A 3-D expert weight: ne [in, out, n_expert]."""

    # ---- the expert store (strata.experts: the cache's plan, its counters) ----------------
    # where an expert pool smaller than the experts keeps things (None: the backend builds no
    # pool, every expert is resident)
    expert_pool: ExpertTier | None = None

    def expert_bytes(self, ggml_type: int, shape: tuple[int, ...]) -> int:
        """Bytes one expert of an expert tensor (ne [in, out, n_expert]) takes on the device,
        resident or in a pool's slot: here its GGUF blocks."""
        return type_by_id(ggml_type).row_bytes(int(shape[0])) * int(shape[1])

    def configure_experts(self, plan: Any, policy: str, policy_args: dict, rates: Any) -> None:
        """The expert cache for the expert tensors still to load (strata.experts.budget.CachePlan;
        None: every expert resident), its policy and a profile's rates(layer) -> per-expert
        tokens per position or None. Here: every expert stays resident."""

    def expert_cache_stats(self) -> dict | None:
        """The cache's counters (strata.experts.cache.CacheStats.as_dict plus slots, experts,
        pool_bytes, policy); None without a cache."""
        return None

    def expert_counts(self) -> tuple[dict[str, Any], dict[str, int]] | None:
        """(tokens routed per expert, token positions counted), per expert layer since load;
        None where the backend does not count its routing."""
        return None

    @abstractmethod
    def vector(self, source: TensorSource) -> Any:
        """A 1-D float tensor (norm weights, biases) as float32 on the device."""

    @abstractmethod
    def embedding(self, source: TensorSource) -> Any:
        """The token embedding table, in whatever form `embed` reads."""

    # ---- matrix ops ----------------------------------------------------------------
    @abstractmethod
    def linear(self, w: Any, x: Any) -> Any:
        """x (n, in) float32 -> (n, out) float32."""

    @abstractmethod
    def linear_experts(self, w: Any, x: Any, expert_ids: Any) -> Any:
        """expert_ids (n, k); x (n, in) shared by a token's k experts, or (n, k, in) one row per
        (token, expert) -> (n, k, out)."""

    def linear_experts_pair(self, w1: Any, w2: Any, x: Any, expert_ids: Any) -> tuple[Any, Any]:
        """Two expert matrices over the same x (n, in), e.g. gate and up: a backend may run
        them together. -> ((n, k, out1), (n, k, out2))."""
        return self.linear_experts(w1, x, expert_ids), self.linear_experts(w2, x, expert_ids)

    @abstractmethod
    def embed(self, table: Any, token_ids: Any) -> Any:
        """token_ids (n,) -> (n, n_embd) float32."""

    def window(self, n_tokens: int) -> None:
        """Called before each forward with the window's token count (CPU: BLAS thread policy)."""

    def end_blocks(self) -> None:
        """Called once the window's blocks have run: linears after this (the output head on
        chosen rows) no longer take the window's rows one to one."""

    def begin_window(self, spans: Sequence[Any]) -> Any:
        """Called once per window (main model or draft) after the caches have room; returns
        the positions (n,) on the device. Spans are Span(cache, start, count)."""
        self.window(int(sum(sp.count for sp in spans)))
        return self.asarray(window_positions(spans))

    def free_bytes(self) -> int | None:
        """Memory still free on the device for per-slot state (None: unknown)."""
        return None

    def weight_bytes(self, tensors: Sequence[Any], mapped: Collection[str] = ()) -> int | None:
        """A lower bound of the device memory these pack tensors (TensorInfo) take once loaded,
        checked against free_bytes() before loading (None: not checked). The tensors named in
        `mapped` (an expert pool's: its slots are counted apart) take none."""
        return None

    def load_peak_bytes(self, tensors: Sequence[Any], mapped: Collection[str] = ()) -> int:
        """Memory a load of these tensors takes for a moment beyond what it keeps (a tensor's
        temporaries while it is made): room the expert cache's auto leaves. Nothing here."""
        return 0

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether exc says the backend's memory ran out (a request or a load, not a bug)."""
        return isinstance(exc, MemoryError)

    def release_cached_memory(self) -> None:
        """Give memory kept for reuse back, after running out (a no-op without such a cache)."""

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether exc means the device can run nothing more in this process (a lost context)."""
        return False

    def inject_fault(self, kind: str) -> None:
        """Test hook (the scheduler's STRATA_FAULT_INJECT device points): fault for real."""
        raise RuntimeError(f"the {self.name} backend has no fault {kind!r} to inject")

    def upload_mark(self) -> int:
        """A point in the backend's uploads, for drop_uploads_since (a load that may fail)."""
        return 0

    def drop_uploads_since(self, mark: int) -> None:
        """Forget the uploads made after `mark` (a draft that did not fit: its weights go)."""

    def argmax_rows(self, x: Any) -> Any:
        """Index of each row's largest value (the first on ties, as numpy)."""
        return self.xp.argmax(x, axis=-1)

    samples_on_device = False  # whether sample_rows draws tokens itself
    def start_line(self) -> str | None:
        """A line for the engine's start-up log about how this backend runs (None: nothing to say)."""
        return None

    graphs: Any = None  # a backend that captures windows (CUDA: cuda_graphs.WindowGraphs) sets its graph runner
    # whether a window's forward returns once its work is issued (the device runs it while the
    # host goes on) rather than once it is done
    issues_async = False

    def sample_rows(self, logits: Any, params: np.ndarray) -> Any:
        """Tokens drawn on the device from logits rows (n, V) with per-row params (n, 5) float64
        (temperature, top_k, top_p, min_p, u: strata.kernels.cuda.sample's layout), exactly as
        strata.sampling draws them from u; or None where the backend does not sample itself
        (the host samples from the rows)."""
        return None

    def top_rows(self, logits: Any) -> tuple[Any, Any]:
        """Per row: the argmax, and its softmax probability 1 / sum(exp(z - max)) (float32)."""
        xp = self.xp
        m = logits.max(axis=-1, keepdims=True)
        return xp.argmax(logits, axis=-1), 1.0 / xp.exp(logits - m).sum(axis=-1)

    # ---- transfers -----------------------------------------------------------------
    def asarray(self, a: Any, dtype: Any = None) -> Any:
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a: Any) -> Any:
        return a

    # ---- element-wise and attention ops (any xp) -----------------------------------
    def add_rms_norm(self, x: Any, y: Any, weight: Any, eps: float) -> tuple[Any, Any]:
        """(x + y, rms_norm(x + y)); y None means no add. Backends fuse the add, the norm and
        the quantization of the normed rows for the linear that follows."""
        if y is not None:
            x = x + y
        return x, self.rms_norm(x, weight, eps)

    def attend(self, layer: int, q: Any, k: Any, v: Any, spans: Sequence[Any], positions: Any,
               rope: RopeParams, q_norm: Any = None, k_norm: Any = None, eps: float = 0.0) -> Any:
        """Normalise q and k per head (q_norm / k_norm weights, qwen3) when given, rotate them,
        append k and v to each span's cache at `layer`, and attend each span's queries over
        its cache. q (n, n_head, d), k and v (n, n_kv, d). -> (n, n_head * d)."""
        xp = self.xp
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)
            k = self.rms_norm(k, k_norm, eps)
        kw = dict(base=rope.base, dim=rope.dim, scale=rope.scale, neox=rope.neox)
        if rope.frozen:
            kw["frozen"] = rope.frozen
        q = self.rope(q, positions, **kw)
        k = self.rope(k, positions, **kw)
        outs, off = [], 0
        for sp in spans:
            sl = slice(off, off + sp.count)
            sp.cache.write(layer, sp.start, k[sl], v[sl])
            kk, vv = sp.cache.read(layer, sp.start + sp.count)
            outs.append(self.attention(q[sl], kk, vv, positions[sl]))
            off += sp.count
        return outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)

    def route(self, logits: Any, k: int, normalize: bool) -> tuple[Any, Any]:
        """MoE routing: softmax over experts, the k most probable (ties: lower id), their
        probabilities (renormalised to sum 1 when `normalize`). -> ids (n, k), weights (n, k)."""
        xp = self.xp
        p = xp.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        # stable on numpy so ties pick the lower expert id, as the reference does
        ids = (xp.argsort(-p, axis=-1, kind="stable") if xp is np else xp.argsort(-p, axis=-1))[:, :k]
        w = xp.take_along_axis(p, ids, axis=-1)
        if normalize:
            w = w / w.sum(axis=-1, keepdims=True)
        return ids, w

    def combine_experts(self, d: Any, w: Any) -> Any:
        """d (n, k, n_embd) expert outputs, w (n, k) -> (n, n_embd) weighted sum."""
        return (d * w[:, :, None].astype(d.dtype)).sum(axis=1)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        xp = self.xp
        var = xp.mean(x * x, axis=-1, keepdims=True)
        return (x / xp.sqrt(var + eps)) * weight

    def swiglu(self, gate: Any, up: Any) -> Any:
        xp = self.xp
        return gate / (1.0 + xp.exp(-gate)) * up

    def rope(self, x: Any, positions: Any, *, base: float, dim: int, scale: float, neox: bool,
             frozen: tuple[int, ...] = ()) -> Any:
        """Rotate the first `dim` features of each head. x (n, heads, head_dim), positions (n,);
        the pairs in `frozen` stay as they are."""
        half = dim // 2
        cos, sin = self._rope_table(positions, base, dim, scale)
        if frozen:
            idx = self.xp.asarray(np.asarray(frozen, np.int64))
            cos, sin = cos.copy(), sin.copy()
            cos[..., idx], sin[..., idx] = 1.0, 0.0
        out = x.copy()
        if neox:
            a, b = x[..., :half], x[..., half:dim]
        else:
            a, b = x[..., 0:dim:2], x[..., 1:dim:2]
        ra = a * cos - b * sin
        rb = a * sin + b * cos
        if neox:
            out[..., :half], out[..., half:dim] = ra, rb
        else:
            out[..., 0:dim:2], out[..., 1:dim:2] = ra, rb
        return out

    def _rope_table(self, positions: Any, base: float, dim: int, scale: float):
        """cos/sin (n, 1, dim/2) for these positions; q and k of every layer share one window's
        positions, so the last table is kept and reused (60 recomputations per token saved)."""
        xp = self.xp
        key = (id(positions), base, dim, scale)
        memo = getattr(self, "_rope_memo", None)
        if memo is not None and memo[0] == key and memo[1] is positions:
            return memo[2]
        half = dim // 2
        inv = base ** (-xp.arange(0, half, dtype=xp.float64) * 2.0 / dim)
        ang = (xp.asarray(positions, dtype=xp.float64)[:, None] / scale) * inv[None, :]
        table = (xp.cos(ang).astype(xp.float32)[:, None, :], xp.sin(ang).astype(xp.float32)[:, None, :])
        self._rope_memo = (key, positions, table)
        return table

    def attention(self, q: Any, k: Any, v: Any, q_positions: Any) -> Any:
        """Causal attention of one sequence's new tokens over its cache.

        q (t, n_head, d); k, v (n_head_kv, L, d) float32 with L = last position + 1;
        q_positions (t,) absolute positions. Returns (t, n_head * d).
        """
        xp = self.xp
        t, n_head, d = q.shape
        n_kv, L, _ = k.shape
        g = n_head // n_kv
        # (n_kv, g*t, d): query heads grouped under the kv head they share (GQA)
        qg = q.reshape(t, n_kv, g, d).transpose(1, 2, 0, 3).reshape(n_kv, g * t, d)
        scores = xp.matmul(qg, k.transpose(0, 2, 1)) * (1.0 / float(d) ** 0.5)
        pos = xp.asarray(q_positions).reshape(1, t)
        keys = xp.arange(L).reshape(L, 1)
        mask = keys > pos  # (L, t): key after the query's position
        scores = scores.reshape(n_kv, g, t, L)
        scores = xp.where(mask.T[None, None, :, :], -xp.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = xp.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = xp.matmul(p.reshape(n_kv, g * t, L), v)  # (n_kv, g*t, d)
        return out.reshape(n_kv, g, t, d).transpose(2, 0, 1, 3).reshape(t, n_head * d)

    # ---- linear attention (Gated DeltaNet, strata/model/hybrid) ----------------------
    def sigmoid(self, x: Any) -> Any:
        return 1.0 / (1.0 + self.xp.exp(-x))

    def softplus(self, x: Any) -> Any:
        """log(1 + e^x), x itself above 20 (as ggml)."""
        xp = self.xp
        return xp.where(x > 20.0, x, xp.log1p(xp.exp(xp.minimum(x, 20.0))))

    def l2_norm(self, x: Any, eps: float) -> Any:
        """x / sqrt(sum(x^2) + eps) over the last axis."""
        xp = self.xp
        return x / xp.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)

    def causal_conv(self, state: Any, x: Any, w: Any, out_state: Any) -> Any:
        """Depthwise causal conv with SiLU: state (K-1, C) the previous inputs (oldest first),
        x (t, C) new inputs, w (C, K). Returns silu(y) (t, C), y[i] = sum_j xin[i + j] * w[:, j]
        over xin = [state; x]; the last K-1 rows of xin go to out_state."""
        xp = self.xp
        K = w.shape[1]
        t = x.shape[0]
        xin = xp.concatenate([state, x], axis=0)
        y = xin[0:t] * w[:, 0]
        for j in range(1, K):
            y = y + xin[j : j + t] * w[:, j]
        out_state[...] = xin[t:]
        return y / (1.0 + xp.exp(-y))

    def gated_delta(self, state: Any, out_state: Any, q: Any, k: Any, v: Any, g: Any, beta: Any,
                    key_head: Any) -> Any:
        """The gated delta rule over t tokens of one sequence. state (H, dk, dv) before them (read),
        out_state where the state after them goes (may be state itself); q, k (t, Hk, dk) l2-normed,
        v (t, H, dv), g (t, H) log-decay, beta (t, H), key_head (H,) the key head of each value
        head. Per token: S *= e^g; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(dk). -> o (t, H, dv)."""
        xp = self.xp
        t = q.shape[0]
        scale = 1.0 / float(q.shape[-1]) ** 0.5
        qh = q[:, key_head] * scale  # (t, H, dk)
        kh = k[:, key_head]
        S = state.copy()
        out = xp.empty(v.shape, dtype=xp.float32)
        decay = xp.exp(g)
        for i in range(t):
            S *= decay[i][:, None, None]
            kv = xp.matmul(kh[i][:, None, :], S)[:, 0, :]  # (H, dv)
            d = (v[i] - kv) * beta[i][:, None]
            S += kh[i][:, :, None] * d[:, None, :]
            out[i] = xp.matmul(qh[i][:, None, :], S)[:, 0, :]
        out_state[...] = S
        return out

    def delta_net_kernels(self, hybrid: Any) -> bool:
        """Whether delta_net_window runs on kernels for this model (HybridConfig), which read the
        window from the device only (so a graph of the window may replay)."""
        return False

    def keep_replay_rows(self, proj: Any, pool: Any, layer: int, spans: Sequence[Any], table: Any) -> None:
        """Each short sequence's rows of a DeltaNet layer's input projection into the pool's
        replay rows (strata/model/recurrent_state.py), for a rollback inside the window."""
        off = 0
        for sp in spans:
            if sp.cache.keeps_replay():
                pool.replay[layer, sp.cache.replay_row, : sp.count] = proj[off : off + sp.count]
            off += sp.count

    def delta_net_window(self, layer: Any, proj: Any, pool: Any, index: int, table: Any, n_spans: int,
                         write_out: bool) -> Any:
        """A whole window of one DeltaNet layer (strata.model.hybrid.layers.DeltaNet) in a few
        launches, from its input projection's rows and the window table (recurrent_state.py):
        the gated-norm output (n, value_dim), or None for a replay (write_out False). Returns
        NotImplemented where the backend has no such kernels (the layer then runs its generic
        ops per sequence)."""
        return NotImplemented
