"""A block: norm -> mixer (attention or Gated DeltaNet) -> add -> norm -> FFN (dense or MoE).

The residual stream arrives as x + y, y being the previous block's output not yet added (None
before the first block): the add is left to the next norm so a backend can fuse add, norm and
activation quantization. A block returns (x, y) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from strata.backend.base import Backend
from strata.model.layers.attention import norm_spec
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.tensors import Reader, TensorSpec


@dataclass
class WindowView:
    """What a block reads of the window it runs in."""

    spans: Sequence[Any]  # each sequence's span over its state (a recurrent layer's cache and rows)
    kv_spans: Sequence[Any]  # the same spans over the sequences' KV caches (attention)
    positions: Any  # the window's positions on the device (Backend.begin_window)
    table: Any = None  # the recurrent layers' window table on the device (recurrent_state.py)


def block_tensors(cfg: ModelConfig, p: str, mixer: list[TensorSpec], ffn: list[TensorSpec],
                  post_norm: str) -> list[TensorSpec]:
    """A block's tensors in conversion order; post_norm: the second norm's name."""
    E = cfg.n_embd
    return [norm_spec(p + "attn_norm.weight", E), *mixer, norm_spec(p + post_norm + ".weight", E), *ffn]


class Block:
    """index: the block's layer within its mixer's kind (the KV cache's or the recurrent state's)."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: Reader, mixer: Any, ffn: Any, *, post_norm: str,
                 recurrent: bool = False, index: int = 0):
        E = cfg.n_embd
        self.b, self.eps = b, cfg.rms_eps
        self.attn_norm = b.vector(r.req("attn_norm.weight", (E,)))
        self.post_norm = b.vector(r.req(post_norm + ".weight", (E,)))
        self.mixer, self.ffn = mixer, ffn
        self.recurrent, self.index = recurrent, index

    def run(self, x: Any, y: Any, w: WindowView) -> tuple[Any, Any]:
        b, eps = self.b, self.eps
        x, h = b.add_rms_norm(x, y, self.attn_norm, eps)
        if self.recurrent:
            a = self.mixer.run(h, self.index, w.spans, w.table)
        else:
            a = self.mixer.run(h, self.index, w.kv_spans, w.positions)
        x, h = b.add_rms_norm(x, a, self.post_norm, eps)
        return x, self.ffn.run(h)
