"""Model hyperparameters read from GGUF metadata, one table of keys per concern.

Architectures share a key layout (`{arch}.block_count`, ...); what differs between them is
kept in ARCH_TRAITS so the forward pass never branches on architecture names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from strata.errors import StrataError
from strata.gguf.reader import shown
from strata.model.hybrid.config import FAMILY, HybridConfig, read_hybrid
from strata.pack.metadata_rules import checked_values


@dataclass(frozen=True)
class ArchTraits:
    rope_neox: bool  # rotate (i, i + d/2) pairs instead of adjacent (2i, 2i+1) pairs
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (qwen3)
    moe: bool  # routed experts instead of one dense FFN
    qkv_bias: bool  # optional biases on q/k/v (qwen2)
    norm_topk_default: bool  # renormalise the chosen experts' weights when metadata is silent


ARCH_TRAITS: dict[str, ArchTraits] = {
    "llama": ArchTraits(rope_neox=False, qk_norm=False, moe=False, qkv_bias=False, norm_topk_default=False),
    "qwen2": ArchTraits(rope_neox=True, qk_norm=False, moe=False, qkv_bias=True, norm_topk_default=False),
    "qwen3": ArchTraits(rope_neox=True, qk_norm=True, moe=False, qkv_bias=False, norm_topk_default=False),
    "qwen3moe": ArchTraits(rope_neox=True, qk_norm=True, moe=True, qkv_bias=False, norm_topk_default=True),
    # the hybrid family: what they share with the others; the rest is HybridConfig
    **{arch: ArchTraits(rope_neox=True, qk_norm=True, moe=t.moe, qkv_bias=False, norm_topk_default=True)
       for arch, t in FAMILY.items()},
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    traits: ArchTraits
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_scale: float  # linear position scaling factor (1.0 = none)
    n_expert: int
    n_expert_used: int
    expert_ff: int
    norm_topk: bool
    vocab_size: int
    name: str
    hybrid: HybridConfig | None = None  # the linear-attention family's own hyperparameters

    @property
    def n_layer_all(self) -> int:
        """Main stack plus nextn layers (block_count)."""
        return self.n_layer + (self.hybrid.n_nextn if self.hybrid is not None else 0)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def config_from_metadata(md: Mapping[str, Any], arch_override: str | None = None, *,
                         label: str | None = None, types: Mapping[str, Any] | None = None) -> ModelConfig:
    """The model's hyperparameters. Every value comes from metadata_rules.checked_values, which
    checks the keys (types, ranges, relations) and fills in defaults, so nothing here can fail on
    a bad value. label names the pack in messages; types are the GGUF value types (reader's)."""
    arch = arch_override or md.get("general.architecture")
    v = checked_values(label, md, types, arch)  # first, so that a missing architecture is named as such
    if arch not in ARCH_TRAITS:
        raise StrataError(
            f"{'pack ' + label + ': ' if label else ''}unsupported architecture '{shown(arch)}' "
            f"(supported: {', '.join(sorted(ARCH_TRAITS))})"
        )
    traits = ARCH_TRAITS[arch]
    linear = v["rope.scaling.type"] == "linear"
    n_layer = v["block_count"] - v["nextn_predict_layers"]
    return ModelConfig(
        arch=arch,
        traits=traits,
        # nextn (MTP) layers are counted in block_count but are not part of the main stack
        n_layer=n_layer,
        n_embd=v["embedding_length"],
        n_ff=v.get("feed_forward_length", 0),
        n_head=v["attention.head_count"],
        n_head_kv=v["attention.head_count_kv"],
        head_dim=v["attention.key_length"],
        n_ctx_train=v["context_length"],
        rms_eps=v["attention.layer_norm_rms_epsilon"],
        rope_base=v["rope.freq_base"],
        rope_dim=v["rope.dimension_count"],
        rope_scale=(v["rope.scaling.factor"] or 1.0) if linear else 1.0,
        n_expert=v.get("expert_count", 0),
        n_expert_used=v.get("expert_used_count", 0),
        expert_ff=v.get("expert_feed_forward_length", 0),
        norm_topk=bool(v.get("expert_weights_norm", traits.norm_topk_default)),
        vocab_size=len(v["tokenizer.ggml.tokens"]),
        name=str(v.get("general.name", arch)),
        hybrid=read_hybrid(arch, v, n_layer, label) if arch in FAMILY else None,
    )
