"""Routed experts, the one implementation every MoE architecture uses: a router picks
n_expert_used experts per row, each a SwiGLU over its own weights, combined by the routing
weights; optionally (Qwen3-Next, Qwen3.5) a shared expert every row takes, gated per row by
sigmoid of one more router output.

The router and the shared expert's gate read the same rows, so they are one linear of
n_expert + 1 outputs. Gate and up experts come as two tensors or one ffn_gate_up_exps
(llama.cpp's create_tensor_gate_up_exps).
"""

from __future__ import annotations

from typing import Any

from strata.backend.base import Backend
from strata.gguf.key_rules import AT_LEAST_1, Key, Kind, Relation
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.tensors import AsColumn, Reader, TensorSpec

KEYS = (
    Key("expert_count", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("expert_used_count", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("expert_feed_forward_length", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("expert_weights_norm", Kind.FLAG),
)
# the shared expert's width; feed_forward_length is read only as its fallback
SHARED_KEYS = (
    Key("feed_forward_length", Kind.COUNT, range=AT_LEAST_1),
    Key("expert_shared_feed_forward_length", Kind.COUNT, range=AT_LEAST_1),
)
RELATIONS = (
    Relation("expert_used_count", ("expert_used_count", "expert_count"),
             lambda v: v["expert_used_count"] <= v["expert_count"],
             lambda v: f"must be in [1, expert_count ({v['expert_count']})]"),
)


def tensors(cfg: ModelConfig, p: str, *, shared_ff: int = 0, fused_gate_up: bool = False) -> list[TensorSpec]:
    """shared_ff: the shared expert's width (0: none); fused_gate_up: ffn_gate_up_exps may stand
    in for the gate and up experts (then neither is required)."""
    E, X, F = cfg.n_embd, cfg.n_expert, cfg.expert_ff
    router_fill = "bias" if shared_ff else "weight"  # how synth fills the F32 router
    out = [
        TensorSpec(p + "ffn_gate_inp.weight", (E, X), fill=router_fill),
        TensorSpec(p + "ffn_gate_exps.weight", (E, F, X), "ffn_gate_exps", required=not fused_gate_up),
        TensorSpec(p + "ffn_up_exps.weight", (E, F, X), "ffn_up_exps", required=not fused_gate_up),
        TensorSpec(p + "ffn_down_exps.weight", (F, E, X), "ffn_down_exps"),
    ]
    if shared_ff:
        S = shared_ff
        out += [TensorSpec(p + "ffn_gate_inp_shexp.weight", (E,), fill="bias"),
                TensorSpec(p + "ffn_gate_shexp.weight", (E, S), "ffn_gate_shexp"),
                TensorSpec(p + "ffn_up_shexp.weight", (E, S), "ffn_up_shexp"),
                TensorSpec(p + "ffn_down_shexp.weight", (S, E), "ffn_down_shexp")]
    return out


class MoE:
    """shared_ff: the shared expert's width (0: none); normalize: renormalise the chosen
    experts' weights to sum 1."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: Reader, *, shared_ff: int = 0, normalize: bool):
        E, X, F = cfg.n_embd, cfg.n_expert, cfg.expert_ff
        self.b, self.cfg = b, cfg
        self.shared_ff, self.normalize = shared_ff, normalize
        router = [r.req("ffn_gate_inp.weight", (E, X))]
        if shared_ff:
            router.append(AsColumn(r.req("ffn_gate_inp_shexp.weight", (E,))))
        self.router = b.linear_weight(router)
        if r.opt("ffn_gate_up_exps.weight") is not None:
            self.gate_up_exps = b.expert_weight(r.req("ffn_gate_up_exps.weight", (E, 2 * F, X)))
            self.gate_exps = self.up_exps = None
        else:
            self.gate_up_exps = None
            self.gate_exps = b.expert_weight(r.req("ffn_gate_exps.weight", (E, F, X)))
            self.up_exps = b.expert_weight(r.req("ffn_up_exps.weight", (E, F, X)))
        self.down_exps = b.expert_weight(r.req("ffn_down_exps.weight", (F, E, X)))
        if shared_ff:
            S = shared_ff
            self.w_shared_gate_up = b.linear_weight([r.req("ffn_gate_shexp.weight", (E, S)),
                                                     r.req("ffn_up_shexp.weight", (E, S))])
            self.w_shared_down = b.linear_weight([r.req("ffn_down_shexp.weight", (S, E))])

    def run(self, h: Any) -> Any:
        b, c = self.b, self.cfg
        X, F, S = c.n_expert, c.expert_ff, self.shared_ff
        logits = b.linear(self.router, h)  # (n, X), or (n, X + 1) with the shared expert's gate
        ids, w = b.route(b.xp.ascontiguousarray(logits[:, :X]) if S else logits, c.n_expert_used, self.normalize)
        if self.gate_up_exps is not None:
            gu = b.linear_experts(self.gate_up_exps, h, ids)
            g, u = gu[:, :, :F], gu[:, :, F:]
        else:
            g, u = b.linear_experts_pair(self.gate_exps, self.up_exps, h, ids)
        routed = b.combine_experts(b.linear_experts(self.down_exps, b.swiglu(g, u), ids), w)  # (n, E)
        if not S:
            return routed
        sgu = b.linear(self.w_shared_gate_up, h)
        shared = b.linear(self.w_shared_down, b.swiglu(sgu[:, :S], sgu[:, S:]))
        return routed + shared * b.sigmoid(logits[:, X:])
