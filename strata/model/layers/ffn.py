"""The dense FFN: SwiGLU, gate and up from one fused linear, then down."""

from __future__ import annotations

from typing import Any

from strata.backend.base import Backend
from strata.gguf.key_rules import AT_LEAST_1, Key, Kind
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.tensors import Reader, TensorSpec

KEYS = (Key("feed_forward_length", Kind.COUNT, required=True, range=AT_LEAST_1),)


def tensors(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    E, F = cfg.n_embd, cfg.n_ff
    return [TensorSpec(p + "ffn_gate.weight", (E, F), "ffn_gate"),
            TensorSpec(p + "ffn_up.weight", (E, F), "ffn_up"),
            TensorSpec(p + "ffn_down.weight", (F, E), "ffn_down")]


class DenseFFN:
    def __init__(self, b: Backend, cfg: ModelConfig, r: Reader):
        E, F = cfg.n_embd, cfg.n_ff
        self.b, self.n_ff = b, F
        self.w_gate_up = b.linear_weight([r.req("ffn_gate.weight", (E, F)), r.req("ffn_up.weight", (E, F))])
        self.w_down = b.linear_weight([r.req("ffn_down.weight", (F, E))])

    def run(self, h: Any) -> Any:
        b, F = self.b, self.n_ff
        gu = b.linear(self.w_gate_up, h)
        return b.linear(self.w_down, b.swiglu(gu[:, :F], gu[:, F:]))
