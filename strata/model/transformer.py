"""The decoder-only transformer (llama, qwen2, qwen3, qwen3moe), written against a Backend.

One forward runs a *window*: the new tokens of one or more sequences, each a contiguous span
of positions appended to that sequence's KV cache. Matrix work is batched over the whole
window; attention runs per span over its own cache. The same block code serves the MTP draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from strata.backend.base import Backend, RopeParams, TensorSource
from strata.errors import StrataError
from strata.model.config import ModelConfig
from strata.model.kv_cache import KVCache


@dataclass
class Span:
    """One sequence's tokens in a window: positions [start, start + count) of `cache`.

    long_prompt: these are rows of a prompt long enough (Backend.long_prompt_tokens) for the
    backend's prompt path (CUDA: dequantized weights + GEMM). The scheduler sets it from the
    request alone, never from what shares the window, so a row's arithmetic stays the same
    whatever it is batched with."""

    cache: KVCache
    start: int
    count: int
    long_prompt: bool = False


def reserve(spans: Sequence[Span]) -> None:
    """Before a window: each span must start where its cache ends; the caches get room."""
    for sp in spans:
        if sp.start != sp.cache.length:
            raise RuntimeError(f"span starts at {sp.start} but its cache holds {sp.cache.length}")
        sp.cache.ensure(sp.start + sp.count)


def advance(spans: Sequence[Span]) -> None:
    """After a window: each cache holds its span's positions."""
    for sp in spans:
        sp.cache.length = sp.start + sp.count


@dataclass
class BlockWeights:
    attn_norm: Any
    wqkv: Any  # q, k, v fused along the output rows
    qkv_bias: Any | None
    q_norm: Any | None
    k_norm: Any | None
    wo: Any
    ffn_norm: Any
    # dense FFN
    wgate_up: Any | None = None
    wdown: Any | None = None
    # routed experts
    router: Any | None = None
    gate_exps: Any | None = None
    up_exps: Any | None = None
    down_exps: Any | None = None


TensorLookup = Callable[[str], TensorSource | None]


def _expect(src: TensorSource | None, name: str, shape: tuple[int, ...] | None) -> TensorSource:
    if src is None:
        raise StrataError(f"pack: missing required tensor {name}")
    if shape is not None and tuple(src.shape) != tuple(shape):
        raise StrataError(
            f"tensor {name} has shape {list(src.shape)} but the metadata implies {list(shape)}"
        )
    return src


def load_block(backend: Backend, cfg: ModelConfig, get: TensorLookup, prefix: str) -> BlockWeights:
    """Load one transformer block whose tensors are named `{prefix}attn_q.weight` etc."""
    E, D = cfg.n_embd, cfg.head_dim

    def req(name: str, shape: tuple[int, ...] | None) -> TensorSource:
        return _expect(get(prefix + name), prefix + name, shape)

    def opt(name: str) -> TensorSource | None:
        return get(prefix + name)

    q = req("attn_q.weight", (E, cfg.q_dim))
    k = req("attn_k.weight", (E, cfg.kv_dim))
    v = req("attn_v.weight", (E, cfg.kv_dim))
    biases = [opt("attn_q.bias"), opt("attn_k.bias"), opt("attn_v.bias")]
    qkv_bias = None
    if any(b is not None for b in biases):
        parts = []
        for b, n in zip(biases, (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)):
            parts.append(backend.to_host(backend.vector(b)) if b is not None else np.zeros(n, np.float32))
        qkv_bias = backend.asarray(np.concatenate(parts).astype(np.float32))
    q_norm = opt("attn_q_norm.weight")
    k_norm = opt("attn_k_norm.weight")
    bw = BlockWeights(
        attn_norm=backend.vector(req("attn_norm.weight", (E,))),
        wqkv=backend.linear_weight([q, k, v]),
        qkv_bias=qkv_bias,
        q_norm=backend.vector(_expect(q_norm, prefix + "attn_q_norm.weight", (D,))) if cfg.traits.qk_norm else None,
        k_norm=backend.vector(_expect(k_norm, prefix + "attn_k_norm.weight", (D,))) if cfg.traits.qk_norm else None,
        wo=backend.linear_weight([req("attn_output.weight", (cfg.q_dim, E))]),
        ffn_norm=backend.vector(req("ffn_norm.weight", (E,))),
    )
    if cfg.traits.moe:
        X, F = cfg.n_expert, cfg.expert_ff
        bw.router = backend.linear_weight([req("ffn_gate_inp.weight", (E, X))])
        bw.gate_exps = backend.expert_weight(req("ffn_gate_exps.weight", (E, F, X)))
        bw.up_exps = backend.expert_weight(req("ffn_up_exps.weight", (E, F, X)))
        bw.down_exps = backend.expert_weight(req("ffn_down_exps.weight", (F, E, X)))
    else:
        F = cfg.n_ff
        bw.wgate_up = backend.linear_weight([req("ffn_gate.weight", (E, F)), req("ffn_up.weight", (E, F))])
        bw.wdown = backend.linear_weight([req("ffn_down.weight", (F, E))])
    return bw


class BlockRunner:
    """Runs blocks over a window: the part shared by the main model and the MTP draft."""

    def __init__(self, backend: Backend, cfg: ModelConfig):
        self.b = backend
        self.cfg = cfg

    def block(self, bw: BlockWeights, layer: int, x: Any, y: Any, spans: Sequence[Span],
              positions: Any) -> tuple[Any, Any]:
        """One block. The residual stream arrives as x + y, y being the previous block's output
        not yet added (None before the first block): the add is left to the next norm so a
        backend can fuse add, norm and activation quantization. Returns (x, y) the same way."""
        b, c = self.b, self.cfg
        n = x.shape[0]
        x, h = b.add_rms_norm(x, y, bw.attn_norm, c.rms_eps)
        qkv = b.linear(bw.wqkv, h)
        if bw.qkv_bias is not None:
            qkv = qkv + bw.qkv_bias
        q = qkv[:, : c.q_dim].reshape(n, c.n_head, c.head_dim)
        k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(n, c.n_head_kv, c.head_dim)
        v = qkv[:, c.q_dim + c.kv_dim :].reshape(n, c.n_head_kv, c.head_dim)
        rope = RopeParams(c.rope_base, c.rope_dim, c.rope_scale, c.traits.rope_neox)
        att = b.attend(layer, q, k, v, spans, positions, rope, bw.q_norm, bw.k_norm, c.rms_eps)
        x, h = b.add_rms_norm(x, b.linear(bw.wo, att), bw.ffn_norm, c.rms_eps)
        if bw.router is None:
            gu = b.linear(bw.wgate_up, h)
            return x, b.linear(bw.wdown, b.swiglu(gu[:, : c.n_ff], gu[:, c.n_ff :]))
        return x, self._moe(bw, h)

    def _moe(self, bw: BlockWeights, h: Any) -> Any:
        b, c = self.b, self.cfg
        logits = b.linear(bw.router, h)  # (n, n_expert)
        ids, w = b.route(logits, c.n_expert_used, c.norm_topk)
        g, u = b.linear_experts_pair(bw.gate_exps, bw.up_exps, h, ids)
        d = b.linear_experts(bw.down_exps, b.swiglu(g, u), ids)  # (n, k, n_embd)
        return b.combine_experts(d, w)


def load_embedding(model: Any, backend: Backend, cfg: ModelConfig, get: TensorLookup) -> None:
    """The token embedding (model.embd, .embd_source, .n_vocab), its shape checked."""
    E = cfg.n_embd
    emb = _expect(get("token_embd.weight"), "token_embd.weight", None)
    if emb.shape[0] != E:
        raise StrataError(f"tensor token_embd.weight has shape {list(emb.shape)} but the metadata implies [{E}, *]")
    if cfg.vocab_size and emb.shape[1] != cfg.vocab_size:
        raise StrataError(
            f"tensor token_embd.weight has shape {list(emb.shape)} but the metadata implies [{E}, {cfg.vocab_size}]"
        )
    model.n_vocab = emb.shape[1]
    model.embd = backend.embedding(emb)
    model.embd_source = emb


def load_head(model: Any, backend: Backend, cfg: ModelConfig, get: TensorLookup) -> None:
    """The final norm and output head (model.output_norm, .output, .output_source); a pack
    without output.weight ties the head to the embedding."""
    model.output_norm = backend.vector(_expect(get("output_norm.weight"), "output_norm.weight", (cfg.n_embd,)))
    out = get("output.weight")
    model.output_source = out if out is not None else model.embd_source
    model.output = backend.linear_weight([model.output_source])


class Transformer:
    graphable = True  # the CUDA window graphs and fused drafting may capture its windows
    draft_graphable = True  # a draft of its block shape may replay captured graphs
    def __init__(self, backend: Backend, cfg: ModelConfig, get: TensorLookup,
                 progress: Callable[[int, int], None] | None = None):
        self.b = backend
        self.cfg = cfg
        load_embedding(self, backend, cfg, get)
        self.blocks: list[BlockWeights] = []
        for i in range(cfg.n_layer):
            self.blocks.append(load_block(backend, cfg, get, f"blk.{i}."))
            if progress:
                progress(i + 1, cfg.n_layer)
        load_head(self, backend, cfg, get)
        self.runner = BlockRunner(backend, cfg)

    def draft_parts(self, cfg: ModelConfig, get: TensorLookup, prefix: str) -> tuple[ModelConfig, Any, Any]:
        """An MTP draft's block (strata.mtp.draft): this model's block shape, its FFN dense or
        routed as the draft's tensors say. -> (the draft's config, block weights, runner)."""
        import dataclasses

        has_router = get(prefix + "ffn_gate_inp.weight") is not None
        gate = get(prefix + "ffn_gate.weight")
        n_ff = gate.shape[1] if gate is not None else cfg.n_ff
        dcfg = dataclasses.replace(cfg, traits=dataclasses.replace(cfg.traits, moe=has_router), n_ff=n_ff, n_layer=1)
        return dcfg, load_block(self.b, dcfg, get, prefix), BlockRunner(self.b, dcfg)

    def new_cache(self, max_ctx: int, kind: str) -> KVCache:
        c = self.cfg
        return KVCache(self.b.xp, c.n_layer, c.n_head_kv, c.head_dim, max_ctx, kind)

    def forward(self, tokens: Any, spans: Sequence[Span], logit_rows: Any = None) -> Any:
        """Run a window; returns the final-normed hidden states (n, n_embd), or with
        `logit_rows` (row indices) the pair (hidden, logits of those rows).

        Caches advance: each span's cache.length becomes start + count. A backend with window
        graphs (CUDA) replays a captured graph of the window (head included) for windows it takes.
        """
        b = self.b
        reserve(spans)
        graphs = getattr(b, "graphs", None)
        if graphs is not None and graphs.takes(spans, wide=True):
            out = graphs.run(self, tokens, spans, logit_rows)
        else:
            out = self.run_window(b.embed(self.embd, tokens), spans)
            if logit_rows is not None:
                out = (out, self.logits(out[b.xp.asarray(np.asarray(logit_rows, np.int64))]))
        advance(spans)
        return out

    def run_window(self, x: Any, spans: Sequence[Span]) -> Any:
        """The device work of a window from its embedded tokens x (n, n_embd): blocks, then
        the final norm. Reads spans only through b.begin_window (what a graph captures)."""
        x, y = self.run_blocks(x, spans)
        return self.b.add_rms_norm(x, y, self.output_norm, self.cfg.rms_eps)[1]

    def run_blocks(self, x: Any, spans: Sequence[Span]) -> tuple[Any, Any]:
        """All blocks; the residual stream after the last one is x + y (see BlockRunner.block)."""
        pos = self.b.begin_window(spans)
        y = None
        for i, bw in enumerate(self.blocks):
            x, y = self.runner.block(bw, i, x, y, spans, pos)
        self.b.end_blocks()
        return x, y

    def logits(self, hidden: Any) -> Any:
        return self.b.linear(self.output, hidden)
