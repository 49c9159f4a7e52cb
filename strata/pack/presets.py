"""Shapes and type plans for synthetic packs (`strata pack synth --preset NAME`).

A type plan maps a role to a type name, or to "T1/T2" for types alternating by layer.
Roles name groups of tensors, so `--type attn=Q4_K` retypes all four attention matrices.
Each architecture's file (strata/model/archs/) gives the shapes of its tiny pack (TINY) and of
its named presets (PRESETS), naming one of TYPE_PLANS; the architecture lists are the registry's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from strata.model.archs import (  # noqa: F401  (the lists other modules read from here)
    ARCHS, DENSE_LAYOUT_ARCHS, HYBRID_ARCHS, HYBRID_MOE_ARCHS, MOE_ARCHS, SUPPORTED_ARCHS,
)

QK_NORM_ARCHS = tuple(a for a, s in ARCHS.items() if s.traits.qk_norm)  # per-head RMS norm on q and k
QKV_BIAS_ARCHS = tuple(a for a, s in ARCHS.items() if s.traits.qkv_bias)

# role -> the tensor (without blk.N. / .weight) it types; "attn" expands to four roles
ROLE_TENSORS = {
    "embed": "token_embd",
    "output": "output",
    "attn_q": "attn_q",
    "attn_k": "attn_k",
    "attn_v": "attn_v",
    "attn_output": "attn_output",
    "ffn_gate": "ffn_gate",
    "ffn_up": "ffn_up",
    "ffn_down": "ffn_down",
    "ffn_gate_exps": "ffn_gate_exps",
    "ffn_up_exps": "ffn_up_exps",
    "ffn_down_exps": "ffn_down_exps",
    # the Gated DeltaNet stack (strata/model/archs/hybrid.py)
    "ssm_in": "attn_qkv / attn_gate of a DeltaNet layer",
    "ssm_ba": "ssm_beta / ssm_alpha / ssm_ba",
    "ssm_out": "ssm_out",
    "ffn_gate_shexp": "ffn_gate_shexp",
    "ffn_up_shexp": "ffn_up_shexp",
    "ffn_down_shexp": "ffn_down_shexp",
    "nextn_eh_proj": "nextn.eh_proj",
    # qwen4exp (strata/model/archs/qwen4exp.py)
    "hc": "hc_attn_* / hc_ffn_* / output_hc_* (down, up, inject)",
    "indexer": "indexer.q_proj / indexer.k_proj",
    "ple_proj": "ple_key / ple_value",
    "ple_table": "per_layer_token_embd",
}
ROLE_ALIASES = {"attn": ("attn_q", "attn_k", "attn_v", "attn_output")}


@dataclass(frozen=True)
class SynthSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab: int = 49152
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    context: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    tied_output: bool = False
    types: dict[str, str] = field(default_factory=dict)  # role -> "TYPE" or "T1/T2"
    # architectures with Gated DeltaNet layers only (0: not used)
    rope_dim: int = 0  # rotated features per head (0: head_dim)
    rope_sections: tuple[int, ...] = ()  # IMRoPE sections (empty: plain rope)
    ssm_conv: int = 4
    ssm_state: int = 0  # DeltaNet head size
    ssm_groups: int = 0  # key heads
    ssm_heads: int = 0  # value heads
    shexp_ff: int = 0  # shared expert width
    attn_interval: int = 4  # every N-th layer is full attention
    nextn: int = 0  # nextn (MTP) layers after the main stack
    delta_net_input: str = "split"  # DeltaNet input projection form (strata.model.layers.delta_net.INPUT_FORMS)
    # an architecture's own shapes, read by its ArchSpec.synth_keys (qwen4exp: hyper-connections,
    # indexer, n-gram table)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHS

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHS

    def with_types(self, overrides: dict[str, str]) -> "SynthSpec":
        return replace(self, types={**self.types, **overrides})


def _all_attn(t: str) -> dict[str, str]:
    return {r: t for r in ROLE_ALIASES["attn"]}


_HYBRID_TYPES = {"embed": "Q8_0", "output": "Q6_K", **_all_attn("Q8_0"), "ssm_in": "Q8_0", "ssm_ba": "Q8_0",
                 "ssm_out": "Q8_0", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K",
                 "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q4_0",
                 "ffn_gate_shexp": "Q8_0", "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q8_0", "nextn_eh_proj": "Q8_0"}

# The type plans the architectures' presets name.
TYPE_PLANS: dict[str, dict[str, str]] = {
    "seed-moe": {"embed": "Q8_0", "output": "Q6_K", **_all_attn("Q4_K"), "ffn_gate_exps": "IQ3_S",
                 "ffn_up_exps": "IQ3_XXS", "ffn_down_exps": "Q2_0/IQ4_NL"},
    "smollm": {"embed": "Q8_0", **_all_attn("Q4_1"), "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1"},
    "dense-8b": {"embed": "Q4_K", "output": "Q6_K", **_all_attn("Q4_K"),
                 "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"},
    "tiny-dense": {"embed": "Q8_0", "output": "Q6_K", **_all_attn("Q8_0"),
                   "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"},
    "tiny-hybrid": _HYBRID_TYPES,
    # 3-bit experts as in the report (IQ3_S gate, IQ3_XXS up, Q2_0 / IQ4_NL downs)
    "hybrid-full": {**_HYBRID_TYPES, **_all_attn("Q4_K"), "ssm_in": "Q4_K", "ssm_ba": "Q8_0", "ssm_out": "Q4_K",
                    "ffn_gate_exps": "IQ3_S", "ffn_up_exps": "IQ3_XXS", "ffn_down_exps": "Q2_0/IQ4_NL",
                    "ffn_gate_shexp": "Q4_K", "ffn_up_shexp": "Q4_K", "ffn_down_shexp": "Q6_K"},
    # what llama-quantize writes for IQ3_S on Qwen3.8-Flash-Next: 640-wide downs and the 160-wide
    # n-gram rows fall back to IQ4_NL; the small projections Q8_0
    "streams-iq3s": {**_HYBRID_TYPES, **_all_attn("Q4_K"), "ssm_in": "Q4_K", "ssm_ba": "Q8_0", "ssm_out": "Q4_K",
                      "ffn_gate_exps": "IQ3_S", "ffn_up_exps": "IQ3_S", "ffn_down_exps": "IQ4_NL",
                      "ffn_gate_shexp": "IQ3_S", "ffn_up_shexp": "IQ3_S", "ffn_down_shexp": "IQ4_NL",
                      "hc": "Q8_0", "indexer": "F16", "ple_proj": "Q8_0", "ple_table": "IQ4_NL"},
}


def _spec(arch: str, shape: Mapping[str, Any]) -> SynthSpec:
    fields = dict(shape)
    return SynthSpec(arch=arch, **{**fields, "types": dict(TYPE_PLANS[fields["types"]])})


# --arch without --preset: a tiny model of that architecture (a hybrid one with its nextn layer)
TINY: dict[str, SynthSpec] = {arch: _spec(arch, spec.tiny) for arch, spec in ARCHS.items()}
PRESETS: dict[str, SynthSpec] = {name: _spec(arch, shape) for arch, spec in ARCHS.items()
                                 for name, shape in spec.presets.items()}
