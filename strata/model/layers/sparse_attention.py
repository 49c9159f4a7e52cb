"""Qwen Sparse Attention (qwen4exp's attention layers): gated GQA attention whose keys are chosen
per query by a learned indexer (transformers models/qwen4_exp/modeling_qwen4_exp.py:670-895).

Attention: [q | gate] per head from attn_q, k and v; per-head RMS norms of q and k, NEOX rope on
the first rope.dimension_count features; softmax(q k / sqrt(d)) over the selected keys; the output
times sigmoid(gate), projected by attn_output.

Indexer, for the query at position p (modeling_qwen4_exp.py:713-770):
- q_i = rope_p(RMS(W_iq u) gamma_q), heads (indexer.head_count, indexer.key_length); the raw key
  k_t = W_ik u_t is kept per position (the sequence state's indexer keys), not normed;
- the visible tokens 0..p form nb = floor((p + 1) / r) complete blocks of r = the layer's compress
  ratio; block b's key K_b = rope_{r b}(RMS(mean of k_t over the block) gamma_k);
- score_b = sum over heads of relu(q_i . K_b) / sqrt(key_length); the top min(top_k / r, nb)
  blocks are kept (torch.topk's rule: highest first);
- the query attends to those blocks' tokens and the incomplete tail nb r .. p, nothing else.

Prefill and decode use the same rule, query by query. A layer whose compress ratio is 0 attends to
every earlier token, as llama.cpp then does (its converter writes 0 for every layer whose type is
not "full_attention", and transformers >= 5.23 renames that type: conversion/qwen4exp.py:64-68).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, RopeParams
from strata.gguf.key_rules import AT_LEAST_1, Key, Kind, Relation
from strata.model.layers import attention
from strata.model.layers.attention import norm_spec
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.tensors import Reader, TensorSpec


def _ratios_fit(v) -> bool:
    top = v["attention.indexer.top_k"]
    return all(int(r) >= 0 and (int(r) == 0 or top % int(r) == 0) for r in v["attention.compress_ratios"])


KEYS = (
    Key("attention.indexer.head_count", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("attention.indexer.key_length", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("attention.indexer.top_k", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("attention.compress_ratios", Kind.COUNTS, required=True),
)
RELATIONS = (
    # one entry per block; a file with MTP layers may leave theirs out (a converter that writes
    # only the trunk's list): those layers then take the trunk's ratio
    Relation("attention.compress_ratios", ("attention.compress_ratios", "block_count"),
             lambda v: len(v["attention.compress_ratios"]) in
             (v["block_count"], v["block_count"] - (v.get("nextn_predict_layers") or 0)),
             lambda v: f"must have one entry per block ({v['block_count']} in block_count"
                       + (f", or {v['block_count'] - v['nextn_predict_layers']} without the MTP layers)"
                          if v.get("nextn_predict_layers") else ")")),
    Relation("attention.compress_ratios", ("attention.compress_ratios", "attention.indexer.top_k"), _ratios_fit,
             lambda v: f"must be 0 (dense) or divide attention.indexer.top_k ({v['attention.indexer.top_k']})"),
    Relation("attention.indexer.key_length", ("attention.indexer.key_length", "rope.dimension_count"),
             lambda v: v["attention.indexer.key_length"] >= v["rope.dimension_count"],
             lambda v: f"must be >= rope.dimension_count ({v['rope.dimension_count']})"),
)


def tensors(cfg: ModelConfig, p: str, n_idx_heads: int, idx_dim: int) -> list[TensorSpec]:
    E = cfg.n_embd
    return [*attention.tensors(cfg, p, gated=True),
            TensorSpec(p + "indexer.q_proj.weight", (E, n_idx_heads * idx_dim), "indexer"),
            TensorSpec(p + "indexer.k_proj.weight", (E, idx_dim), "indexer"),
            norm_spec(p + "indexer.q_norm.weight", idx_dim), norm_spec(p + "indexer.k_norm.weight", idx_dim)]


def masked_attention(xp: Any, q: Any, k: Any, v: Any, allowed: Any) -> Any:
    """q (t, n_head, d); k, v (n_kv, L, d); allowed (t, L) bool -> (t, n_head * d): softmax over
    the allowed keys of each query (GQA: head h reads kv head h // (n_head / n_kv))."""
    t, n_head, d = q.shape
    n_kv, L, _ = k.shape
    g = n_head // n_kv
    qg = q.reshape(t, n_kv, g, d).transpose(1, 2, 0, 3).reshape(n_kv, g * t, d)
    scores = (xp.matmul(qg, k.transpose(0, 2, 1)) * (1.0 / float(d) ** 0.5)).reshape(n_kv, g, t, L)
    scores = xp.where(allowed[None, None], scores, -xp.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = xp.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = xp.matmul(p.reshape(n_kv, g * t, L), v)
    return out.reshape(n_kv, g, t, d).transpose(2, 0, 1, 3).reshape(t, n_head * d)


def selected(scores: np.ndarray, q_pos: np.ndarray, L: int, ratio: int, keep_blocks: int) -> np.ndarray:
    """The indexer's choice (module doc): scores (t, NB) of the complete blocks as of the last
    query, q_pos (t,) -> allowed (t, L) bool. Ties go to the lower block (the records have none)."""
    t = len(q_pos)
    allowed = np.zeros((t, L), bool)
    for i, p in enumerate(q_pos):
        nb = (int(p) + 1) // ratio
        if nb <= keep_blocks:
            allowed[i, : p + 1] = True
            continue
        top = np.argsort(-scores[i, :nb], kind="stable")[:keep_blocks]
        cols = (top[:, None] * ratio + np.arange(ratio)[None, :]).reshape(-1)
        allowed[i, cols] = True
        allowed[i, nb * ratio : p + 1] = True
    return allowed


class SparseAttention:
    """One QSA layer's weights and its run over a window (module doc). ratio: this layer's
    compress ratio (0: dense)."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: Reader, rope: RopeParams, ratio: int, top_k: int,
                 n_idx_heads: int, idx_dim: int):
        self.b, self.cfg, self.rope = b, cfg, rope
        self.ratio, self.keep_blocks = ratio, (top_k // ratio if ratio else 0)
        self.n_idx, self.idx_dim = n_idx_heads, idx_dim
        E, D, kv = cfg.n_embd, cfg.head_dim, cfg.kv_dim
        q2 = 2 * cfg.q_dim
        self.wqkv = b.linear_weight([r.req("attn_q.weight", (E, q2)), r.req("attn_k.weight", (E, kv)),
                                     r.req("attn_v.weight", (E, kv)),
                                     r.req("indexer.q_proj.weight", (E, n_idx_heads * idx_dim)),
                                     r.req("indexer.k_proj.weight", (E, idx_dim))])
        self.wo = b.linear_weight([r.req("attn_output.weight", (cfg.q_dim, E))])
        self.q_norm = b.vector(r.req("attn_q_norm.weight", (D,)))
        self.k_norm = b.vector(r.req("attn_k_norm.weight", (D,)))
        self.iq_norm = b.vector(r.req("indexer.q_norm.weight", (idx_dim,)))
        self.ik_norm = b.vector(r.req("indexer.k_norm.weight", (idx_dim,)))
        self.input_form = "split"

    def _rope(self, x: Any, positions: Any) -> Any:
        p = self.rope
        return self.b.rope(x, positions, base=p.base, dim=p.dim, scale=p.scale, neox=p.neox)

    def run(self, h: Any, layer: int, spans: Sequence[Any], positions: Any) -> Any:
        """h (n, E) the hyper-connection's read; layer: the attention layer's index in the
        caches; spans over the sequences' qwen4exp states."""
        b, c, xp = self.b, self.cfg, self.b.xp
        n, D, eps = h.shape[0], c.head_dim, c.rms_eps
        proj = b.linear(self.wqkv, h)
        a, kv, nq = 2 * c.q_dim, c.kv_dim, self.n_idx * self.idx_dim
        qg = proj[:, :a].reshape(n, c.n_head, 2, D)
        q = self._rope(b.rms_norm(xp.ascontiguousarray(qg[:, :, 0]), self.q_norm, eps), positions)
        gate = xp.ascontiguousarray(qg[:, :, 1]).reshape(n, c.q_dim)
        k = self._rope(b.rms_norm(proj[:, a : a + kv].reshape(n, c.n_head_kv, D), self.k_norm, eps), positions)
        v = xp.ascontiguousarray(proj[:, a + kv : a + 2 * kv]).reshape(n, c.n_head_kv, D)
        iq = proj[:, a + 2 * kv : a + 2 * kv + nq].reshape(n, self.n_idx, self.idx_dim)
        iq = self._rope(b.rms_norm(iq, self.iq_norm, eps), positions)
        ik = xp.ascontiguousarray(proj[:, a + 2 * kv + nq :])
        outs, off = [], 0
        for sp in spans:
            sl = slice(off, off + sp.count)
            end = sp.start + sp.count
            sp.cache.kv.write(layer, sp.start, k[sl], v[sl])
            sp.cache.write_index_keys(layer, sp.start, ik[sl])
            kk, vv = sp.cache.kv.read(layer, end)
            if self.ratio:
                allowed = self._select(iq[sl], sp.cache.index_keys(layer, end), positions[sl], end)
                outs.append(masked_attention(xp, q[sl], kk, vv, allowed))
            else:
                outs.append(b.attention(q[sl], kk, vv, positions[sl]))
            off += sp.count
        att = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
        return b.linear(self.wo, att * b.sigmoid(gate))

    def _select(self, iq: Any, raw: Any, q_pos: Any, L: int) -> Any:
        """The allowed (t, L) keys of one span's queries: block keys from the raw keys, scores, top blocks."""
        b, xp, r = self.b, self.b.xp, self.ratio
        NB = L // r
        if NB <= self.keep_blocks:  # every query sees every block: causal
            pos = xp.asarray(q_pos).reshape(-1, 1)
            return xp.arange(L).reshape(1, L) <= pos
        pooled = raw[: NB * r].reshape(NB, r, self.idx_dim).mean(axis=1)
        starts = xp.arange(NB, dtype=xp.int64) * r
        K = self._rope(b.rms_norm(pooled, self.ik_norm, self.cfg.rms_eps)[:, None, :], starts)[:, 0]
        s = xp.matmul(iq, K.T)  # (t, heads, NB)
        scores = xp.maximum(s, 0.0).sum(axis=1) * (1.0 / float(self.idx_dim) ** 0.5)
        allowed = selected(np.asarray(b.to_host(scores)), np.asarray(b.to_host(q_pos)), L, r, self.keep_blocks)
        return b.asarray(allowed)
