"""Shapes and type plans for synthetic packs (`strata pack synth --preset NAME`).

A type plan maps a role to a type name, or to "T1/T2" for types alternating by layer.
Roles name groups of tensors, so `--type attn=Q4_K` retypes all four attention matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
MOE_ARCHS = ("qwen3moe",)
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
