"""The hybrid linear-attention family (Qwen3-Next, Qwen3.5): what its metadata says, as llama.cpp
reads it (src/models/qwen35moe.cpp, qwen35.cpp, qwen3next.cpp).

Layers are Gated DeltaNet (a recurrent state per sequence) except every `full_attention_interval`-th,
which is gated full attention; nextn (MTP) layers follow the main stack and are counted in
block_count. The three architectures differ in a few facts, kept in FAMILY so that the layers
never branch on an architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from strata.errors import StrataError


@dataclass(frozen=True)
class FamilyTraits:
    moe: bool  # routed experts + a sigmoid-gated shared expert (else one dense SwiGLU FFN)
    imrope: bool  # rope.dimension_sections (IMRoPE) instead of plain NEOX rope
    grouped_heads: bool  # value head j reads key head j // (H_v / H_k); else j % H_k (tiled)
    fused_ba: bool  # beta and alpha come from one ssm_ba matrix, [b(r) | a(r)] per key group
    fused_qkvz: bool  # a fused ssm_in (earlier converters) may stand in for attn_qkv + attn_gate


FAMILY: dict[str, FamilyTraits] = {
    "qwen35moe": FamilyTraits(moe=True, imrope=True, grouped_heads=False, fused_ba=False, fused_qkvz=False),
    "qwen35": FamilyTraits(moe=False, imrope=True, grouped_heads=False, fused_ba=False, fused_qkvz=False),
    "qwen3next": FamilyTraits(moe=True, imrope=False, grouped_heads=True, fused_ba=True, fused_qkvz=True),
}
HYBRID_ARCHS = tuple(FAMILY)
HYBRID_MOE_ARCHS = tuple(a for a, t in FAMILY.items() if t.moe)
IMROPE_ARCHS = tuple(a for a, t in FAMILY.items() if t.imrope)


@dataclass(frozen=True)
class HybridConfig:
    traits: FamilyTraits
    recurrent: tuple[bool, ...]  # per main-stack layer: Gated DeltaNet (else full attention)
    d_conv: int  # causal conv kernel length
    d_state: int  # head size of q, k and v in the DeltaNet layers
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    shexp_ff: int  # shared expert width (MoE archs)
    sections: tuple[int, ...]  # IMRoPE sections (empty: plain NEOX)
    n_nextn: int

    @property
    def key_dim(self) -> int:
        return self.d_state * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.d_state * self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def n_recurrent(self) -> int:
        return sum(self.recurrent)

    def key_head_of(self) -> np.ndarray:
        """For each value head, the key head it reads (module doc: tiled or grouped)."""
        j = np.arange(self.n_v_heads)
        r = self.n_v_heads // self.n_k_heads
        return j // r if self.traits.grouped_heads else j % self.n_k_heads


def frozen_rope_pairs(sections: tuple[int, ...], rope_dim: int) -> tuple[int, ...]:
    """IMRoPE pairs that text tokens leave unrotated. A text token's four position components are
    (p, p, p, 0); pair i takes component (i % sum) % 3 while that stays inside its section, else
    the fourth (0: no rotation). Every other pair is NEOX rope at p."""
    if not sections:
        return ()
    total = sum(sections)
    frozen = []
    for i in range(rope_dim // 2):
        s = i % total if total else 0
        comp = s % 3
        if not s < 3 * sections[comp]:
            frozen.append(i)
    return tuple(frozen)


def read_hybrid(arch: str, v: Mapping[str, Any], n_layer: int, label: str | None) -> HybridConfig:
    """The family's hyperparameters from checked metadata values (strata.pack.metadata_rules)."""
    traits = FAMILY[arch]
    layers = v.get("attention.recurrent_layers")
    if layers is not None:
        recurrent = tuple(bool(x) for x in list(layers)[:n_layer])
    else:
        every = v["full_attention_interval"]
        recurrent = tuple((i + 1) % every != 0 for i in range(n_layer))
    sections = tuple(int(x) for x in v.get("rope.dimension_sections", ())) if traits.imrope else ()
    shexp = v.get("expert_shared_feed_forward_length") or v.get("feed_forward_length", 0)
    if traits.moe and not shexp:
        where = f"pack {label}: " if label else ""
        raise StrataError(f"{where}metadata key {arch}.expert_shared_feed_forward_length: missing "
                          f"(and no {arch}.feed_forward_length to fall back on)")
    return HybridConfig(
        traits=traits,
        recurrent=recurrent,
        d_conv=v["ssm.conv_kernel"],
        d_state=v["ssm.state_size"],
        n_k_heads=v["ssm.group_count"],
        n_v_heads=v["ssm.time_step_rank"],
        shexp_ff=int(shexp),
        sections=sections,
        n_nextn=v["nextn_predict_layers"],
    )
