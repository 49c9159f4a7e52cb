"""The hybrid family's layer parts, each a load and a run written only against the Backend:
gated full attention, Gated DeltaNet, and the FFN (routed experts plus a gated shared expert, or
one dense SwiGLU). A layer is `norm -> mixer -> add -> norm -> FFN`, the residual stream carried
as (x, y) as in strata.model.transformer (the add is left to the next norm, which fuses it).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, RopeParams, SourceView, TensorSource
from strata.errors import StrataError
from strata.model.config import ModelConfig
from strata.model.hybrid.fused_qkvz import split_ssm_in
from strata.model.hybrid.tensors import TensorSpec, input_forms
from strata.model.transformer import TensorLookup, _expect


class _AsColumn(SourceView):
    """A 1-D tensor (n,) seen as an (n, 1) matrix: the shared expert's one-output gate, fused
    into the router's linear."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.src.shape[0]), 1)


class _Reader:
    """Tensors of one layer (`prefix`), each checked against its expected shape."""

    def __init__(self, get: TensorLookup, prefix: str, label: str = "pack"):
        self.get, self.prefix, self.label = get, prefix, label

    def req(self, name: str, shape: tuple[int, ...] | None) -> TensorSource:
        return _expect(self.get(self.prefix + name), self.prefix + name, shape)

    def opt(self, name: str) -> TensorSource | None:
        return self.get(self.prefix + name)

    def either(self, fused: str, fused_shape: tuple[int, ...], parts: Sequence[tuple[str, tuple[int, ...]]]):
        """The fused tensor if the pack has it, else the parts: [sources]."""
        if self.opt(fused) is not None:
            return [self.req(fused, fused_shape)]
        missing = [n for n, _ in parts if self.opt(n) is None]
        if missing:
            raise StrataError(f"pack: missing required tensor {self.prefix}{missing[0]} "
                              f"(or {self.prefix}{fused} in its place)")
        return [self.req(n, s) for n, s in parts]

    def spec(self, t: TensorSpec) -> TensorSource:
        """A tensor of the family's table (its name is whole, prefix included)."""
        return _expect(self.get(t.name), t.name, t.ne)


# How each input form becomes the rows of [attn_qkv | attn_gate] that DeltaNet reads.
_INPUT_ROWS = {
    "split": lambda sources, h: sources,
    "fused": lambda sources, h: [split_ssm_in(sources[0], h)],
}


def _input_projection(cfg: ModelConfig, r: _Reader) -> tuple[list[TensorSource], str]:
    """The q/k/v + z rows of a DeltaNet layer from the first input form the pack holds whole
    (tensors.input_forms), and that form's name."""
    forms = input_forms(cfg, r.prefix)
    for form, specs in forms.items():
        if all(r.get(t.name) is not None for t in specs):
            return _INPUT_ROWS[form]([r.spec(t) for t in specs], cfg.hybrid), form
    split = forms["split"]
    missing = next(t.name for t in split if r.get(t.name) is None)
    others = [t.name for form, specs in forms.items() if form != "split" for t in specs]
    instead = f" (or {' + '.join(others)} in its place)" if others else ""
    raise StrataError(f"pack: missing required tensor {missing}{instead}")


# ----------------------------------------------------------------------------- attention
class GatedAttention:
    """Full attention whose q projection carries a sigmoid output gate per head ([q | gate])."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: _Reader, rope: RopeParams):
        E, D = cfg.n_embd, cfg.head_dim
        q2, kv = 2 * cfg.q_dim, cfg.kv_dim
        self.b, self.cfg, self.rope = b, cfg, rope
        self.wqkv = b.linear_weight(r.either("attn_qkv.weight", (E, q2 + 2 * kv),
                                             [("attn_q.weight", (E, q2)), ("attn_k.weight", (E, kv)),
                                              ("attn_v.weight", (E, kv))]))
        self.wo = b.linear_weight([r.req("attn_output.weight", (cfg.q_dim, E))])
        self.q_norm = b.vector(r.req("attn_q_norm.weight", (D,)))
        self.k_norm = b.vector(r.req("attn_k_norm.weight", (D,)))

    def run(self, h: Any, layer: int, kv_spans: Sequence[Any], positions: Any) -> Any:
        """h (n, E) normed rows; layer: the attention layer's index in the KV cache."""
        b, c, xp = self.b, self.cfg, self.b.xp
        n, H, D = h.shape[0], c.n_head, c.head_dim
        qkv = b.linear(self.wqkv, h)
        qg = qkv[:, : 2 * c.q_dim].reshape(n, H, 2, D)
        q = xp.ascontiguousarray(qg[:, :, 0])
        gate = xp.ascontiguousarray(qg[:, :, 1]).reshape(n, c.q_dim)
        k = xp.ascontiguousarray(qkv[:, 2 * c.q_dim : 2 * c.q_dim + c.kv_dim]).reshape(n, c.n_head_kv, D)
        v = xp.ascontiguousarray(qkv[:, 2 * c.q_dim + c.kv_dim :]).reshape(n, c.n_head_kv, D)
        att = b.attend(layer, q, k, v, kv_spans, positions, self.rope, self.q_norm, self.k_norm, c.rms_eps)
        return b.linear(self.wo, att * b.sigmoid(gate))


# ----------------------------------------------------------------------------- Gated DeltaNet
class DeltaNet:
    """Gated DeltaNet linear attention (strata/model/recurrent_state.py keeps its state).

    One linear gives the conv's q/k/v inputs, the output gate z and the delta rule's beta and
    alpha (q/k/v and z from attn_qkv + attn_gate, or from a fused ssm_in put in their row order
    at load: `input_form` says which the pack held); a causal conv (SiLU) mixes the last d_conv
    inputs; q and k are l2-normed; the gated delta rule updates the per-sequence state and reads
    it with q; the output is RMS-normed per head, gated by silu(z) and projected back."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: _Reader):
        h = cfg.hybrid
        E, H = cfg.n_embd, h.n_v_heads
        self.b, self.cfg, self.h = b, cfg, h
        if h.traits.fused_ba:
            ba = [r.req("ssm_ba.weight", (E, 2 * H))]
            # per key group g, [b(r) | a(r)]; value head g*r + i
            per = H // h.n_k_heads
            heads = np.arange(H)
            groups, i = heads // per, heads % per
            beta_cols, alpha_cols = groups * 2 * per + i, groups * 2 * per + per + i
        else:
            ba = [r.req("ssm_beta.weight", (E, H)), r.req("ssm_alpha.weight", (E, H))]
            beta_cols, alpha_cols = np.arange(H), H + np.arange(H)
        qkvz, self.input_form = _input_projection(cfg, r)
        self.w_in = b.linear_weight([*qkvz, *ba])
        base = h.conv_dim + h.value_dim
        self.beta_cols = b.asarray(base + beta_cols.astype(np.int64))
        self.alpha_cols = b.asarray(base + alpha_cols.astype(np.int64))
        self.conv_w = b.vector(r.req("ssm_conv1d.weight", (h.d_conv, h.conv_dim))).reshape(h.conv_dim, h.d_conv)
        self.dt_bias = b.vector(r.req("ssm_dt.bias", (H,)))
        self.a = b.vector(r.req("ssm_a", (H,)))
        self.norm = b.vector(r.req("ssm_norm.weight", (h.d_state,)))
        self.w_out = b.linear_weight([r.req("ssm_out.weight", (h.value_dim, E))])
        self.key_head = b.asarray(h.key_head_of().astype(np.int64))

    def _gates(self, proj: Any) -> tuple[Any, Any]:
        """(g, beta) (n, H) from the input projection's rows."""
        b = self.b
        beta = b.sigmoid(proj[:, self.beta_cols])
        g = b.softplus(proj[:, self.alpha_cols] + self.dt_bias) * self.a
        return g, beta

    def _mix(self, cache: Any, layer: int, proj: Any) -> Any:
        """One sequence's rows of the input projection through conv and delta rule: the state
        read at the window's start, written to the other copy. -> o (t, H, d)."""
        b, h = self.b, self.h
        t, S = proj.shape[0], h.d_state
        g, beta = self._gates(proj)
        conv_in, state_in = cache.read(layer)
        conv_out, state_out = cache.target(layer)
        c = b.causal_conv(conv_in, proj[:, : h.conv_dim], self.conv_w, conv_out)
        q = b.l2_norm(c[:, : h.key_dim].reshape(t, h.n_k_heads, S), self.cfg.rms_eps)
        k = b.l2_norm(c[:, h.key_dim : 2 * h.key_dim].reshape(t, h.n_k_heads, S), self.cfg.rms_eps)
        v = c[:, 2 * h.key_dim :].reshape(t, h.n_v_heads, S)
        return b.gated_delta(state_in, state_out, q, k, v, g, beta, self.key_head)

    def run(self, hn: Any, layer: int, spans: Sequence[Any], table: Any) -> Any:
        """hn (n, E) normed rows of the window; layer: the recurrent layer's index in the state;
        table: the window's (cell, active, first row, count) rows on the device."""
        b, h, xp = self.b, self.h, self.b.xp
        n, C = hn.shape[0], h.conv_dim
        proj = b.linear(self.w_in, hn)
        pool = spans[0].cache.pool
        b.keep_replay_rows(proj, pool, layer, spans, table)  # what a cut inside this window replays
        y = b.delta_net_window(self, proj, pool, layer, table, len(spans), True)
        if y is NotImplemented:
            outs, off = [], 0
            for sp in spans:
                outs.append(self._mix(sp.cache, layer, proj[off : off + sp.count]))
                off += sp.count
            o = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
            z = proj[:, C : C + h.value_dim].reshape(n, h.n_v_heads, h.d_state)
            y = b.swiglu(z, b.rms_norm(o, self.norm, self.cfg.rms_eps)).reshape(n, h.value_dim)  # silu(z) * norm(o)
        return b.linear(self.w_out, y)

    def replay(self, cache: Any, layer: int, proj: Any) -> None:
        """Apply kept rows of the input projection to the state again (a rollback)."""
        b = self.b
        table = b.asarray(np.asarray([cache.table_row(0, int(proj.shape[0]))], np.int64))
        if b.delta_net_window(self, proj, cache.pool, layer, table, 1, False) is NotImplemented:
            self._mix(cache, layer, proj)

    @staticmethod
    def replay_width(cfg: ModelConfig) -> int:
        h = cfg.hybrid
        return h.conv_dim + h.value_dim + 2 * h.n_v_heads


# ----------------------------------------------------------------------------- FFN
class HybridFFN:
    """Routed experts plus a sigmoid-gated shared expert (MoE archs), or a dense SwiGLU."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: _Reader):
        E = cfg.n_embd
        self.b, self.cfg = b, cfg
        self.moe = cfg.hybrid.traits.moe
        if not self.moe:
            F = cfg.n_ff
            self.w_gate_up = b.linear_weight([r.req("ffn_gate.weight", (E, F)), r.req("ffn_up.weight", (E, F))])
            self.w_down = b.linear_weight([r.req("ffn_down.weight", (F, E))])
            return
        X, F, S = cfg.n_expert, cfg.expert_ff, cfg.hybrid.shexp_ff
        # the router and the shared expert's gate read the same rows: one linear, X + 1 outputs
        self.router = b.linear_weight([r.req("ffn_gate_inp.weight", (E, X)),
                                       _AsColumn(r.req("ffn_gate_inp_shexp.weight", (E,)))])
        if r.opt("ffn_gate_up_exps.weight") is not None:
            self.gate_up_exps = b.expert_weight(r.req("ffn_gate_up_exps.weight", (E, 2 * F, X)))
            self.gate_exps = self.up_exps = None
        else:
            self.gate_up_exps = None
            self.gate_exps = b.expert_weight(r.req("ffn_gate_exps.weight", (E, F, X)))
            self.up_exps = b.expert_weight(r.req("ffn_up_exps.weight", (E, F, X)))
        self.down_exps = b.expert_weight(r.req("ffn_down_exps.weight", (F, E, X)))
        self.w_shared_gate_up = b.linear_weight([r.req("ffn_gate_shexp.weight", (E, S)),
                                                 r.req("ffn_up_shexp.weight", (E, S))])
        self.w_shared_down = b.linear_weight([r.req("ffn_down_shexp.weight", (S, E))])

    def run(self, hn: Any) -> Any:
        b, c = self.b, self.cfg
        if not self.moe:
            gu = b.linear(self.w_gate_up, hn)
            return b.linear(self.w_down, b.swiglu(gu[:, : c.n_ff], gu[:, c.n_ff :]))
        X, F, S = c.n_expert, c.expert_ff, c.hybrid.shexp_ff
        logits = b.linear(self.router, hn)  # (n, X + 1)
        ids, w = b.route(b.xp.ascontiguousarray(logits[:, :X]), c.n_expert_used, True)
        if self.gate_up_exps is not None:
            gu = b.linear_experts(self.gate_up_exps, hn, ids)
            g, u = gu[:, :, :F], gu[:, :, F:]
        else:
            g, u = b.linear_experts_pair(self.gate_exps, self.up_exps, hn, ids)
        routed = b.combine_experts(b.linear_experts(self.down_exps, b.swiglu(g, u), ids), w)
        sgu = b.linear(self.w_shared_gate_up, hn)
        shared = b.linear(self.w_shared_down, b.swiglu(sgu[:, :S], sgu[:, S:]))
        return routed + shared * b.sigmoid(logits[:, X:])


# ----------------------------------------------------------------------------- one layer
class HybridLayer:
    """norm -> mixer (DeltaNet or gated attention) -> add -> post-attention norm -> FFN."""

    def __init__(self, b: Backend, cfg: ModelConfig, get: TensorLookup, prefix: str, rope: RopeParams,
                 recurrent: bool, index: int):
        r = _Reader(get, prefix)
        E = cfg.n_embd
        self.b, self.cfg = b, cfg
        self.recurrent = recurrent
        self.index = index  # within its kind: the state's (recurrent) or the KV cache's layer
        self.attn_norm = b.vector(r.req("attn_norm.weight", (E,)))
        self.post_norm = b.vector(r.req("post_attention_norm.weight", (E,)))
        self.mixer = DeltaNet(b, cfg, r) if recurrent else GatedAttention(b, cfg, r, rope)
        self.ffn = HybridFFN(b, cfg, r)

    def run(self, x: Any, y: Any, spans: Sequence[Any], kv_spans: Sequence[Any], positions: Any,
            table: Any = None) -> tuple[Any, Any]:
        b, eps = self.b, self.cfg.rms_eps
        x, h = b.add_rms_norm(x, y, self.attn_norm, eps)
        if self.recurrent:
            a = self.mixer.run(h, self.index, spans, table)
        else:
            a = self.mixer.run(h, self.index, kv_spans, positions)
        x, h = b.add_rms_norm(x, a, self.post_norm, eps)
        return x, self.ffn.run(h)

    # the MTP draft runs a full-attention layer through BlockRunner's interface
    def block(self, bw: Any, layer: int, x: Any, y: Any, spans: Sequence[Any], positions: Any) -> tuple[Any, Any]:
        return self.run(x, y, spans, spans, positions)
