"""Shapes and type plans for synthetic packs (`strata pack synth --preset NAME`).

A type plan maps a role to a type name, or to "T1/T2" for types alternating by layer.
Roles name groups of tensors, so `--type attn=Q4_K` retypes all four attention matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from strata.model.hybrid.config import HYBRID_ARCHS, HYBRID_MOE_ARCHS

DENSE_LAYOUT_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")  # one block shape (model/transformer.py)
SUPPORTED_ARCHS = DENSE_LAYOUT_ARCHS + HYBRID_ARCHS
MOE_ARCHS = ("qwen3moe",) + HYBRID_MOE_ARCHS
QK_NORM_ARCHS = ("qwen3", "qwen3moe")  # per-head RMS norm on q and k
QKV_BIAS_ARCHS = ("qwen2",)

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
    # the hybrid family (strata/model/hybrid/tensors.py)
    "ssm_in": "attn_qkv / attn_gate of a DeltaNet layer",
    "ssm_ba": "ssm_beta / ssm_alpha / ssm_ba",
    "ssm_out": "ssm_out",
    "ffn_gate_shexp": "ffn_gate_shexp",
    "ffn_up_shexp": "ffn_up_shexp",
    "ffn_down_shexp": "ffn_down_shexp",
    "nextn_eh_proj": "nextn.eh_proj",
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
    # the hybrid family only (0: not used)
    rope_dim: int = 0  # rotated features per head (0: head_dim)
    rope_sections: tuple[int, ...] = ()  # IMRoPE sections (qwen35, qwen35moe)
    ssm_conv: int = 4
    ssm_state: int = 0  # DeltaNet head size
    ssm_groups: int = 0  # key heads
    ssm_heads: int = 0  # value heads
    shexp_ff: int = 0  # shared expert width
    attn_interval: int = 4  # every N-th layer is full attention
    nextn: int = 0  # nextn (MTP) layers after the main stack
    delta_net_input: str = "split"  # DeltaNet input projection form (model/hybrid/tensors.INPUT_FORMS)

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


_SEED_MOE_TYPES = {
    "embed": "Q8_0",
    "output": "Q6_K",
    **_all_attn("Q4_K"),
    "ffn_gate_exps": "IQ3_S",
    "ffn_up_exps": "IQ3_XXS",
    "ffn_down_exps": "Q2_0/IQ4_NL",
}

PRESETS: dict[str, SynthSpec] = {
    # The bug report's MoE shapes, scaled down so CI can build and run it in seconds.
    "seed-moe": SynthSpec(
        arch="qwen3moe", n_layer=4, n_embd=256, n_ff=640, n_head=4, n_head_kv=2, head_dim=64,
        n_expert=16, n_expert_used=4, expert_ff=640, context=4096, rope_freq_base=1e6,
        types=_SEED_MOE_TYPES,
    ),
    # The report's shapes at full size (tens of GiB: GPU machine only).
    "seed-moe-full": SynthSpec(
        arch="qwen3moe", n_layer=48, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4, head_dim=128,
        n_expert=128, n_expert_used=8, expert_ff=640, context=32768, rope_freq_base=1e6,
        types=_SEED_MOE_TYPES,
    ),
    # The test model's shapes (SmolLM2-135M-Instruct Q4_1).
    "smollm": SynthSpec(
        arch="llama", n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, head_dim=64,
        context=8192, rope_freq_base=100000.0, rms_eps=1e-5, tied_output=True,
        types={"embed": "Q8_0", **_all_attn("Q4_1"), "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1"},
    ),
    "dense-8b": SynthSpec(
        arch="llama", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, head_dim=128,
        context=8192, rope_freq_base=500000.0, rms_eps=1e-5,
        types={"embed": "Q4_K", "output": "Q6_K", **_all_attn("Q4_K"),
               "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"},
    ),
}

# Defaults when --arch is given without --preset: a tiny model of that architecture.
_TINY_DENSE_TYPES = {"embed": "Q8_0", "output": "Q6_K", **_all_attn("Q8_0"),
                     "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"}
TINY: dict[str, SynthSpec] = {
    arch: SynthSpec(arch=arch, n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                    types=_TINY_DENSE_TYPES)
    for arch in ("llama", "qwen2", "qwen3")
}
TINY["qwen3moe"] = replace(PRESETS["seed-moe"], n_layer=2, n_expert=4, n_expert_used=2)


# The hybrid family: a tiny model of each (3 DeltaNet layers and 1 gated-attention layer, one nextn
# layer), and full-size ones at the shapes of the report's model class for the GPU benches.
_HYBRID_TYPES = {"embed": "Q8_0", "output": "Q6_K", **_all_attn("Q8_0"), "ssm_in": "Q8_0", "ssm_ba": "Q8_0",
                 "ssm_out": "Q8_0", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K",
                 "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q4_0",
                 "ffn_gate_shexp": "Q8_0", "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q8_0", "nextn_eh_proj": "Q8_0"}
_TINY_HYBRID = SynthSpec(arch="qwen35moe", n_layer=4, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                         n_expert=8, n_expert_used=2, expert_ff=128, rope_freq_base=1e7, rope_dim=32,
                         rope_sections=(6, 5, 5, 0), ssm_state=32, ssm_groups=2, ssm_heads=4, shexp_ff=256,
                         nextn=1, types=_HYBRID_TYPES)
TINY["qwen35moe"] = _TINY_HYBRID
TINY["qwen35"] = replace(_TINY_HYBRID, arch="qwen35", n_expert=0, n_expert_used=0, expert_ff=0, shexp_ff=0)
TINY["qwen3next"] = replace(_TINY_HYBRID, arch="qwen3next", rope_sections=())

# 3-bit experts as in the report (IQ3_S gate, IQ3_XXS up, Q2_0 / IQ4_NL downs)
_HYBRID_FULL_TYPES = {**_HYBRID_TYPES, **_all_attn("Q4_K"), "ssm_in": "Q4_K", "ssm_ba": "Q8_0", "ssm_out": "Q4_K",
                      "ffn_gate_exps": "IQ3_S", "ffn_up_exps": "IQ3_XXS", "ffn_down_exps": "Q2_0/IQ4_NL",
                      "ffn_gate_shexp": "Q4_K", "ffn_up_shexp": "Q4_K", "ffn_down_shexp": "Q6_K"}
PRESETS["qwen35moe-35b-a3b"] = SynthSpec(
    arch="qwen35moe", n_layer=40, n_embd=2048, n_ff=512, n_head=16, n_head_kv=2, head_dim=256,
    vocab=248320, n_expert=256, n_expert_used=8, expert_ff=512, context=262144, rope_freq_base=1e7,
    rope_dim=64, rope_sections=(11, 11, 10, 0), ssm_state=128, ssm_groups=16, ssm_heads=32, shexp_ff=512,
    nextn=1, types=_HYBRID_FULL_TYPES)
PRESETS["qwen3next-80b-a3b"] = replace(
    PRESETS["qwen35moe-35b-a3b"], arch="qwen3next", n_layer=48, n_expert=512, n_expert_used=10,
    vocab=151936, rope_sections=())
PRESETS["qwen35-tiny"] = TINY["qwen35"]
PRESETS["qwen35moe-tiny"] = TINY["qwen35moe"]
PRESETS["qwen3next-tiny"] = TINY["qwen3next"]
