"""The stack the Qwen3-Next / Qwen3.5 architectures share, as llama.cpp's graphs build it
(src/models/qwen35moe.cpp, qwen35.cpp, qwen3next.cpp, on delta-net-base.cpp): Gated DeltaNet on
the recurrent layers, gated attention on the others (every `full_attention_interval`-th), each
followed by the architecture's FFN; nextn (MTP) layers after the main stack are a gated-attention
block with that FFN, their input and head norms. An architecture gives its FFN (tensors and
layer), its DeltaNet traits and whether its rope is IMRoPE; `stack` makes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from strata.backend.base import Backend, RopeParams
from strata.model.layers import attention, delta_net
from strata.model.layers.attention import Attention, norm_spec
from strata.model.layers.block import Block, block_tensors
from strata.model.layers.delta_net import DeltaNet
from strata.model.layers.delta_net_hparams import DeltaNetTraits, read_hparams
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.tensors import Reader, TensorLookup, TensorSpec

POST_NORM = "post_attention_norm"


@dataclass(frozen=True)
class Stack:
    """An architecture's parts for its ArchSpec (block_tensors, nextn_tensors, block, draft_block, read)."""

    block_tensors: Callable[[ModelConfig, str, int], list[TensorSpec]]
    nextn_tensors: Callable[[ModelConfig, int], list[TensorSpec]]
    block: Callable[..., Block]
    draft_block: Callable[..., tuple[ModelConfig, Block]]
    read: Callable[[Mapping[str, Any], int, str | None], dict[str, Any]]


def stack(name: str, traits: DeltaNetTraits, moe: bool, imrope: bool,
          ffn_tensors: Callable[[ModelConfig, str], list[TensorSpec]],
          ffn: Callable[[Backend, ModelConfig, Reader], Any]) -> Stack:
    """ffn_tensors(cfg, prefix) and ffn(backend, cfg, reader): the architecture's FFN."""

    def tensors(cfg: ModelConfig, p: str, i: int) -> list[TensorSpec]:
        mixer = delta_net.tensors(cfg, p) if cfg.hybrid.recurrent[i] else attention.tensors(cfg, p, gated=True)
        return block_tensors(cfg, p, mixer, ffn_tensors(cfg, p), POST_NORM)

    def nextn_tensors(cfg: ModelConfig, i: int) -> list[TensorSpec]:
        """nextn.embed_tokens / shared_head_head are optional (the model's own are shared)."""
        p, E = f"blk.{i}.", cfg.n_embd
        return [TensorSpec(p + "nextn.eh_proj.weight", (2 * E, E), "nextn_eh_proj"),
                norm_spec(p + "nextn.enorm.weight", E), norm_spec(p + "nextn.hnorm.weight", E),
                *block_tensors(cfg, p, attention.tensors(cfg, p, gated=True), ffn_tensors(cfg, p), POST_NORM),
                TensorSpec(p + "nextn.shared_head_norm.weight", (E,), fill="norm", scale=0.02, required=False)]

    def block(b: Backend, cfg: ModelConfig, r: Reader, rope: RopeParams, i: int, index: int) -> Block:
        recurrent = cfg.hybrid.recurrent[i]
        mixer = DeltaNet(b, cfg, r) if recurrent else Attention(b, cfg, r, rope, gated=True)
        return Block(b, cfg, r, mixer, ffn(b, cfg, r), post_norm=POST_NORM, recurrent=recurrent, index=index)

    def draft_block(b: Backend, cfg: ModelConfig, get: TensorLookup, prefix: str,
                    rope: RopeParams) -> tuple[ModelConfig, Block]:
        """The nextn layer: gated attention with this FFN, at KV layer 0 of the draft's own cache."""
        r = Reader(get, prefix)
        return cfg, Block(b, cfg, r, Attention(b, cfg, r, rope, gated=True), ffn(b, cfg, r), post_norm=POST_NORM)

    def read(v: Mapping[str, Any], n_layer: int, label: str | None) -> dict[str, Any]:
        sections = tuple(int(x) for x in v.get("rope.dimension_sections", ())) if imrope else ()
        return {"hybrid": read_hparams(traits, moe, name, v, n_layer, label), "rope_sections": sections}

    return Stack(tensors, nextn_tensors, block, draft_block, read)
