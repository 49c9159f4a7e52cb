"""Gated DeltaNet linear attention, written only against the Backend; a sequence's state (conv
window and delta-rule matrix) is kept by strata/model/recurrent_state.py.

One linear gives the conv's q/k/v inputs, the output gate z and the delta rule's beta and alpha
(q/k/v and z from attn_qkv + attn_gate, or from a fused ssm_in put in their row order at load:
`input_form` says which the pack held); a causal conv (SiLU) mixes the last d_conv inputs; q and
k are l2-normed; the gated delta rule updates the per-sequence state and reads it with q; the
output is RMS-normed per head, gated by silu(z) and projected back.

A layer's input projection comes in one of INPUT_FORMS: "split" attn_qkv + attn_gate (today's
converters), or "fused" one ssm_in holding q, k, v and z per key group (earlier qwen3next
converters; fused_qkvz.py has the layout). The layer takes the first form a pack holds whole,
synth writes the one it is asked for.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, TensorSource
from strata.errors import StrataError
from strata.model.layers.attention import norm_spec
from strata.model.layers.fused_qkvz import split_ssm_in
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.tensors import Reader, TensorSpec

INPUT_FORMS = ("split", "fused")


def _input_tensors(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h = cfg.hybrid
    E = cfg.n_embd
    out = [TensorSpec(p + "attn_qkv.weight", (E, h.conv_dim), "ssm_in", required=False, form="split"),
           TensorSpec(p + "attn_gate.weight", (E, h.value_dim), "ssm_in", required=False, form="split")]
    if h.traits.fused_qkvz:
        out.append(TensorSpec(p + "ssm_in.weight", (E, h.conv_dim + h.value_dim), "ssm_in", required=False,
                              form="fused"))
    return out


def input_forms(cfg: ModelConfig, p: str) -> dict[str, list[TensorSpec]]:
    """The input projection forms a DeltaNet layer (prefix p) may hold, in the order tried."""
    out: dict[str, list[TensorSpec]] = {}
    for t in _input_tensors(cfg, p):
        out.setdefault(t.form, []).append(t)
    return out


def tensors(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h = cfg.hybrid
    E, H = cfg.n_embd, h.n_v_heads
    out = [
        *_input_tensors(cfg, p),
        TensorSpec(p + "ssm_conv1d.weight", (h.d_conv, h.conv_dim), fill="bias"),
        TensorSpec(p + "ssm_dt.bias", (H,), fill="bias", scale=0.5),
        TensorSpec(p + "ssm_a", (H,), fill="ssm_a", scale=0.0),
        norm_spec(p + "ssm_norm.weight", h.d_state),
        TensorSpec(p + "ssm_out.weight", (h.value_dim, E), "ssm_out"),
    ]
    if h.traits.fused_ba:
        out.append(TensorSpec(p + "ssm_ba.weight", (E, 2 * H), "ssm_ba"))
    else:
        out += [TensorSpec(p + "ssm_beta.weight", (E, H), "ssm_ba"),
                TensorSpec(p + "ssm_alpha.weight", (E, H), "ssm_ba")]
    return out


# How each input form becomes the rows of [attn_qkv | attn_gate] that DeltaNet reads.
_INPUT_ROWS = {
    "split": lambda sources, h: sources,
    "fused": lambda sources, h: [split_ssm_in(sources[0], h)],
}


def _input_projection(cfg: ModelConfig, r: Reader) -> tuple[list[TensorSource], str]:
    """The q/k/v + z rows of a DeltaNet layer from the first input form the pack holds whole
    (input_forms), and that form's name."""
    forms = input_forms(cfg, r.prefix)
    for form, specs in forms.items():
        if all(r.get(t.name) is not None for t in specs):
            return _INPUT_ROWS[form]([r.spec(t) for t in specs], cfg.hybrid), form
    split = forms["split"]
    missing = next(t.name for t in split if r.get(t.name) is None)
    others = [t.name for form, specs in forms.items() if form != "split" for t in specs]
    instead = f" (or {' + '.join(others)} in its place)" if others else ""
    raise StrataError(f"pack: missing required tensor {missing}{instead}")


class DeltaNet:
    """One Gated DeltaNet layer's weights (the CUDA kernels read its device constants: h, conv_w,
    beta_cols, alpha_cols, dt_bias, a, key_head, norm) and its run over a window (module doc)."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: Reader):
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
        # the window kernels gate with silu; another gate runs the generic ops
        silu = h.traits.output_gate == "silu"
        y = b.delta_net_window(self, proj, pool, layer, table, len(spans), True) if silu else NotImplemented
        if y is NotImplemented:
            outs, off = [], 0
            for sp in spans:
                outs.append(self._mix(sp.cache, layer, proj[off : off + sp.count]))
                off += sp.count
            o = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
            z = proj[:, C : C + h.value_dim].reshape(n, h.n_v_heads, h.d_state)
            normed = b.rms_norm(o, self.norm, self.cfg.rms_eps)
            y = b.swiglu(z, normed) if silu else normed * b.sigmoid(z)  # silu(z) * norm(o), or sigmoid(z)
            y = y.reshape(n, h.value_dim)
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
