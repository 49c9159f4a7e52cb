"""The decoder-only transformer (llama, qwen2, qwen3, qwen3moe), written against a Backend.

One forward runs a *window*: the new tokens of one or more sequences, each a contiguous span
of positions appended to that sequence's KV cache. Matrix work is batched over the whole
window; attention runs per span over its own cache. The same block code serves the MTP draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from strata.backend.base import Backend, TensorSource
from strata.errors import StrataError
from strata.model.config import ModelConfig
from strata.model.kv_cache import KVCache


@dataclass
class Span:
    """One sequence's tokens in a window: positions [start, start + count) of `cache`."""

    cache: KVCache
    start: int
    count: int


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

    def block(self, bw: BlockWeights, layer: int, x: Any, spans: Sequence[Span], positions: Any) -> Any:
        b, c, xp = self.b, self.cfg, self.b.xp
        n = x.shape[0]
        h = b.rms_norm(x, bw.attn_norm, c.rms_eps)
        qkv = b.linear(bw.wqkv, h)
        if bw.qkv_bias is not None:
            qkv = qkv + bw.qkv_bias
        q = qkv[:, : c.q_dim].reshape(n, c.n_head, c.head_dim)
        k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(n, c.n_head_kv, c.head_dim)
        v = qkv[:, c.q_dim + c.kv_dim :].reshape(n, c.n_head_kv, c.head_dim)
        if bw.q_norm is not None:
            q = b.rms_norm(q, bw.q_norm, c.rms_eps)
            k = b.rms_norm(k, bw.k_norm, c.rms_eps)
        rope = dict(base=c.rope_base, dim=c.rope_dim, scale=c.rope_scale, neox=c.traits.rope_neox)
        q = b.rope(q, positions, **rope)
        k = b.rope(k, positions, **rope)
        outs = []
        off = 0
        for sp in spans:
            sl = slice(off, off + sp.count)
            sp.cache.write(layer, sp.start, k[sl], v[sl])
            kk, vv = sp.cache.read(layer, sp.start + sp.count)
            outs.append(b.attention(q[sl], kk, vv, positions[sl]))
            off += sp.count
        att = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
        x = x + b.linear(bw.wo, att)
        h = b.rms_norm(x, bw.ffn_norm, c.rms_eps)
        if bw.router is None:
            gu = b.linear(bw.wgate_up, h)
            y = b.linear(bw.wdown, b.swiglu(gu[:, : c.n_ff], gu[:, c.n_ff :]))
        else:
            y = self._moe(bw, h)
        return x + y

    def _moe(self, bw: BlockWeights, h: Any) -> Any:
        b, c, xp = self.b, self.cfg, self.b.xp
        logits = b.linear(bw.router, h)  # (n, n_expert)
        p = xp.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        k = c.n_expert_used
        # stable on numpy so ties pick the lower expert id, as the reference does (cupy sorts stably too)
        ids = (xp.argsort(-p, axis=-1, kind="stable") if xp is np else xp.argsort(-p, axis=-1))[:, :k]
        w = xp.take_along_axis(p, ids, axis=-1)
        if c.norm_topk:
            w = w / w.sum(axis=-1, keepdims=True)
        g = b.linear_experts(bw.gate_exps, h, ids)
        u = b.linear_experts(bw.up_exps, h, ids)
        d = b.linear_experts(bw.down_exps, b.swiglu(g, u), ids)  # (n, k, n_embd)
        return (d * w[:, :, None].astype(d.dtype)).sum(axis=1)


def positions_of(xp: Any, spans: Sequence[Span]) -> Any:
    return xp.asarray(np.concatenate([np.arange(s.start, s.start + s.count) for s in spans]).astype(np.int64))


class Transformer:
    def __init__(self, backend: Backend, cfg: ModelConfig, get: TensorLookup,
                 progress: Callable[[int, int], None] | None = None):
        self.b = backend
        self.cfg = cfg
        E = cfg.n_embd
        emb = _expect(get("token_embd.weight"), "token_embd.weight", None)
        if emb.shape[0] != E:
            raise StrataError(f"tensor token_embd.weight has shape {list(emb.shape)} but the metadata implies [{E}, *]")
        if cfg.vocab_size and emb.shape[1] != cfg.vocab_size:
            raise StrataError(
                f"tensor token_embd.weight has shape {list(emb.shape)} but the metadata implies [{E}, {cfg.vocab_size}]"
            )
        self.n_vocab = emb.shape[1]
        self.embd = backend.embedding(emb)
        self.embd_source = emb
        self.blocks: list[BlockWeights] = []
        for i in range(cfg.n_layer):
            self.blocks.append(load_block(backend, cfg, get, f"blk.{i}."))
            if progress:
                progress(i + 1, cfg.n_layer)
        self.output_norm = backend.vector(_expect(get("output_norm.weight"), "output_norm.weight", (E,)))
        out = get("output.weight")
        self.output_source = out if out is not None else emb  # tied output head
        self.output = backend.linear_weight([self.output_source])
        self.runner = BlockRunner(backend, cfg)

    def new_cache(self, max_ctx: int, kind: str) -> KVCache:
        c = self.cfg
        return KVCache(self.b.xp, c.n_layer, c.n_head_kv, c.head_dim, max_ctx, kind)

    def forward(self, tokens: Any, spans: Sequence[Span]) -> Any:
        """Run a window; returns the final-normed hidden states (n, n_embd).

        Caches advance: each span's cache.length becomes start + count.
        """
        b = self.b
        b.window(int(sum(sp.count for sp in spans)))
        for sp in spans:
            if sp.start != sp.cache.length:
                raise RuntimeError(f"span starts at {sp.start} but its cache holds {sp.cache.length}")
            sp.cache.ensure(sp.start + sp.count)
        x = b.embed(self.embd, tokens)
        pos = positions_of(b.xp, spans)
        for i, bw in enumerate(self.blocks):
            x = self.runner.block(bw, i, x, spans, pos)
        for sp in spans:
            sp.cache.length = sp.start + sp.count
        return b.rms_norm(x, self.output_norm, self.cfg.rms_eps)

    def logits(self, hidden: Any) -> Any:
        return self.b.linear(self.output, hidden)
