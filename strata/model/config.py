"""Model hyperparameters read from GGUF metadata, one table of keys per concern.

Architectures share a key layout (`{arch}.block_count`, ...); what differs between them is
kept in ARCH_TRAITS so the forward pass never branches on architecture names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from strata.errors import StrataError


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
}


# RoPE position scalings this build implements (positions divided by the factor for "linear")
ROPE_SCALINGS = ("none", "linear")


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

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def _get(md: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False):
    if key in md:
        return md[key]
    if required:
        raise StrataError(f"pack metadata is missing required key {key!r}")
    return default


def config_from_metadata(md: Mapping[str, Any], arch_override: str | None = None) -> ModelConfig:
    arch = arch_override or md.get("general.architecture")
    if arch not in ARCH_TRAITS:
        raise StrataError(
            f"unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCH_TRAITS))})"
        )
    a = arch
    n_embd = int(_get(md, f"{a}.embedding_length", required=True))
    n_head = int(_get(md, f"{a}.attention.head_count", required=True))
    n_head_kv = int(_get(md, f"{a}.attention.head_count_kv", n_head))
    head_dim = int(_get(md, f"{a}.attention.key_length", n_embd // n_head))
    scaling_type = str(_get(md, f"{a}.rope.scaling.type", "none") or "none")
    factor = float(_get(md, f"{a}.rope.scaling.factor", 1.0) or 1.0)
    if scaling_type not in ROPE_SCALINGS:
        raise StrataError(f"pack metadata {a}.rope.scaling.type = {scaling_type!r} is not supported "
                          f"(supported: {', '.join(ROPE_SCALINGS)})")
    rope_scale = factor if scaling_type == "linear" else 1.0
    tokens = md.get("tokenizer.ggml.tokens")
    traits = ARCH_TRAITS[a]
    return ModelConfig(
        arch=a,
        traits=traits,
        # nextn (MTP) layers are counted in block_count but are not part of the main stack
        n_layer=int(_get(md, f"{a}.block_count", required=True)) - int(_get(md, f"{a}.nextn_predict_layers", 0) or 0),
        n_embd=n_embd,
        n_ff=int(_get(md, f"{a}.feed_forward_length", 0) or 0),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ctx_train=int(_get(md, f"{a}.context_length", 4096)),
        rms_eps=float(_get(md, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(_get(md, f"{a}.rope.freq_base", 10000.0)),
        rope_dim=int(_get(md, f"{a}.rope.dimension_count", head_dim)),
        rope_scale=rope_scale,
        n_expert=int(_get(md, f"{a}.expert_count", 0) or 0),
        n_expert_used=int(_get(md, f"{a}.expert_used_count", 0) or 0),
        expert_ff=int(_get(md, f"{a}.expert_feed_forward_length", 0) or 0),
        norm_topk=bool(_get(md, f"{a}.expert_weights_norm", traits.norm_topk_default)),
        vocab_size=len(tokens) if tokens is not None else int(_get(md, f"{a}.vocab_size", 0)),
        name=str(md.get("general.name", a)),
    )
