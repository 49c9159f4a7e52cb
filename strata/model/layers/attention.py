"""Attention over a window's spans, each against its own KV cache, written only against the Backend.

Plain: q, k and v from one fused linear (optional q/k/v biases), optional per-head q/k RMS norms,
rotary embeddings, then the output projection. Gated (Qwen3-Next, Qwen3.5): q comes with a gate
per head ([q | gate], 2 x head_dim per head, or one attn_qkv in place of the three), q/k norms
always, and the output is multiplied by sigmoid(gate) before its projection.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, RopeParams
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.tensors import Reader, TensorSpec, expect


def norm_spec(name: str, n: int) -> TensorSpec:
    """An RMS norm's gains (F32, synth fills them near 1)."""
    return TensorSpec(name, (n,), fill="norm", scale=0.02)


def tensors(cfg: ModelConfig, p: str, *, gated: bool) -> list[TensorSpec]:
    """The attention tensors of the layer with prefix p."""
    E, D, kv = cfg.n_embd, cfg.head_dim, cfg.kv_dim
    if gated:
        q2 = 2 * cfg.q_dim
        return [
            # attn_qkv.weight (E, q2 + 2 kv) may replace the three (llama.cpp's create_tensor_qkv)
            TensorSpec(p + "attn_q.weight", (E, q2), "attn_q", required=False),
            TensorSpec(p + "attn_k.weight", (E, kv), "attn_k", required=False),
            TensorSpec(p + "attn_v.weight", (E, kv), "attn_v", required=False),
            TensorSpec(p + "attn_output.weight", (cfg.q_dim, E), "attn_output"),
            norm_spec(p + "attn_q_norm.weight", D),
            norm_spec(p + "attn_k_norm.weight", D),
        ]
    out = [
        TensorSpec(p + "attn_q.weight", (E, cfg.q_dim), "attn_q"),
        TensorSpec(p + "attn_k.weight", (E, kv), "attn_k"),
        TensorSpec(p + "attn_v.weight", (E, kv), "attn_v"),
        TensorSpec(p + "attn_output.weight", (cfg.q_dim, E), "attn_output"),
        # read wherever a pack has them; synth writes them for the archs whose traits say so
        *(TensorSpec(p + f"{t}.bias", (n,), fill="bias", scale=0.02, required=False, synth=cfg.traits.qkv_bias)
          for t, n in (("attn_q", cfg.q_dim), ("attn_k", kv), ("attn_v", kv))),
    ]
    if cfg.traits.qk_norm:
        out += [norm_spec(p + "attn_q_norm.weight", D), norm_spec(p + "attn_k_norm.weight", D)]
    return out


class Attention:
    """One attention layer's weights and its run over a window (module doc)."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: Reader, rope: RopeParams, *, gated: bool):
        self.b, self.cfg, self.rope, self.gated = b, cfg, rope, gated
        E, D, kv = cfg.n_embd, cfg.head_dim, cfg.kv_dim
        self.qkv_bias = None
        if gated:
            q2 = 2 * cfg.q_dim
            self.wqkv = b.linear_weight(r.either("attn_qkv.weight", (E, q2 + 2 * kv),
                                                 [("attn_q.weight", (E, q2)), ("attn_k.weight", (E, kv)),
                                                  ("attn_v.weight", (E, kv))]))
            self.wo = b.linear_weight([r.req("attn_output.weight", (cfg.q_dim, E))])
            self.q_norm = b.vector(r.req("attn_q_norm.weight", (D,)))
            self.k_norm = b.vector(r.req("attn_k_norm.weight", (D,)))
            return
        q = r.req("attn_q.weight", (E, cfg.q_dim))
        k = r.req("attn_k.weight", (E, kv))
        v = r.req("attn_v.weight", (E, kv))
        biases = [r.opt("attn_q.bias"), r.opt("attn_k.bias"), r.opt("attn_v.bias")]
        if any(x is not None for x in biases):
            parts = []
            for x, n in zip(biases, (cfg.q_dim, kv, kv)):
                parts.append(b.to_host(b.vector(x)) if x is not None else np.zeros(n, np.float32))
            self.qkv_bias = b.asarray(np.concatenate(parts).astype(np.float32))
        self.wqkv = b.linear_weight([q, k, v])
        qk = cfg.traits.qk_norm
        self.q_norm = b.vector(expect(r.opt("attn_q_norm.weight"), r.prefix + "attn_q_norm.weight", (D,))) if qk else None
        self.k_norm = b.vector(expect(r.opt("attn_k_norm.weight"), r.prefix + "attn_k_norm.weight", (D,))) if qk else None
        self.wo = b.linear_weight([r.req("attn_output.weight", (cfg.q_dim, E))])

    def run(self, h: Any, layer: int, kv_spans: Sequence[Any], positions: Any) -> Any:
        """h (n, E) normed rows; layer: the attention layer's index in the KV cache."""
        b, c = self.b, self.cfg
        n, D = h.shape[0], c.head_dim
        qkv = b.linear(self.wqkv, h)
        if not self.gated:
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            q = qkv[:, : c.q_dim].reshape(n, c.n_head, D)
            k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].reshape(n, c.n_head_kv, D)
            v = qkv[:, c.q_dim + c.kv_dim :].reshape(n, c.n_head_kv, D)
            att = b.attend(layer, q, k, v, kv_spans, positions, self.rope, self.q_norm, self.k_norm, c.rms_eps)
            return b.linear(self.wo, att)
        xp = b.xp
        qg = qkv[:, : 2 * c.q_dim].reshape(n, c.n_head, 2, D)
        q = xp.ascontiguousarray(qg[:, :, 0])
        gate = xp.ascontiguousarray(qg[:, :, 1]).reshape(n, c.q_dim)
        k = xp.ascontiguousarray(qkv[:, 2 * c.q_dim : 2 * c.q_dim + c.kv_dim]).reshape(n, c.n_head_kv, D)
        v = xp.ascontiguousarray(qkv[:, 2 * c.q_dim + c.kv_dim :]).reshape(n, c.n_head_kv, D)
        att = b.attend(layer, q, k, v, kv_spans, positions, self.rope, self.q_norm, self.k_norm, c.rms_eps)
        return b.linear(self.wo, att * b.sigmoid(gate))
