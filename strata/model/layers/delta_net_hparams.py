"""What Gated DeltaNet layers read of the metadata, as llama.cpp reads it (src/models/qwen35moe.cpp,
qwen35.cpp, qwen3next.cpp): which layers are recurrent (`attention.recurrent_layers`, else every
`full_attention_interval`-th layer is full attention), the `ssm.*` sizes, the shared expert's
width and the nextn (MTP) layers that follow the main stack, counted in block_count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from strata.errors import StrataError
from strata.gguf.key_rules import AT_LEAST_2, Key, Kind, Range, Relation


@dataclass(frozen=True)
class DeltaNetTraits:
    """The facts the DeltaNet layers of the architectures that have them differ in."""

    grouped_heads: bool  # value head j reads key head j // (H_v / H_k); else j % H_k (tiled)
    fused_ba: bool  # beta and alpha come from one ssm_ba matrix, [b(r) | a(r)] per key group
    fused_qkvz: bool  # a fused ssm_in (earlier converters) may stand in for attn_qkv + attn_gate
    # the output gate's activation on z: "silu" (Qwen3-Next, Qwen3.5) or "sigmoid" (qwen4exp,
    # transformers models/qwen4_exp/modeling_qwen4_exp.py:499)
    output_gate: str = "silu"


KEYS = (
    Key("ssm.conv_kernel", Kind.COUNT, required=True, range=AT_LEAST_2),
    Key("ssm.state_size", Kind.COUNT, required=True, range=Range(1, 1024)),
    Key("ssm.group_count", Kind.COUNT, required=True, range=Range(1, 4096)),
    Key("ssm.time_step_rank", Kind.COUNT, required=True, range=Range(1, 4096)),
    Key("ssm.inner_size", Kind.COUNT, required=True, range=Range(1, 2**31 - 1)),
    Key("full_attention_interval", Kind.COUNT, range=Range(1, 2**31 - 1), default=4),
    Key("attention.recurrent_layers", Kind.FLAGS),
)
RELATIONS = (
    Relation("ssm.time_step_rank", ("ssm.time_step_rank", "ssm.group_count"),
             lambda v: v["ssm.time_step_rank"] % v["ssm.group_count"] == 0,
             lambda v: f"must be a multiple of ssm.group_count ({v['ssm.group_count']})"),
    Relation("ssm.inner_size", ("ssm.inner_size", "ssm.state_size", "ssm.time_step_rank"),
             lambda v: v["ssm.inner_size"] == v["ssm.state_size"] * v["ssm.time_step_rank"],
             lambda v: f"must equal ssm.state_size x ssm.time_step_rank ({v['ssm.state_size'] * v['ssm.time_step_rank']})"),
    Relation("attention.recurrent_layers", ("attention.recurrent_layers", "block_count"),
             lambda v: len(v["attention.recurrent_layers"]) == v["block_count"],
             lambda v: f"must have one entry per block ({v['block_count']} in block_count)"),
)


@dataclass(frozen=True)
class HybridConfig:
    traits: DeltaNetTraits
    recurrent: tuple[bool, ...]  # per main-stack layer: Gated DeltaNet (else full attention)
    d_conv: int  # causal conv kernel length
    d_state: int  # head size of q, k and v in the DeltaNet layers
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    shexp_ff: int  # shared expert width (MoE archs)
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

    def extra_state_bytes(self, n_embd: int, replay_tokens: int, checkpoint: bool) -> int:
        """A sequence's private state beyond the DeltaNet states and conv windows (none here; an
        architecture with more declares it: qwen4exp's n-gram conv history)."""
        return 0

    def extra_position_bytes(self, n_attention: int) -> int:
        """What one more position costs a sequence beside its KV cache (none here; qwen4exp's
        indexer keys and token id)."""
        return 0

    def key_head_of(self) -> np.ndarray:
        """For each value head, the key head it reads (DeltaNetTraits: tiled or grouped)."""
        j = np.arange(self.n_v_heads)
        r = self.n_v_heads // self.n_k_heads
        return j // r if self.traits.grouped_heads else j % self.n_k_heads


def read_hparams(traits: DeltaNetTraits, moe: bool, arch: str, v: Mapping[str, Any], n_layer: int,
                 label: str | None) -> HybridConfig:
    """The DeltaNet hyperparameters from checked metadata values (strata.model.config)."""
    layers = v.get("attention.recurrent_layers")
    if layers is not None:
        recurrent = tuple(bool(x) for x in list(layers)[:n_layer])
    else:
        every = v["full_attention_interval"]
        recurrent = tuple((i + 1) % every != 0 for i in range(n_layer))
    shexp = v.get("expert_shared_feed_forward_length") or v.get("feed_forward_length", 0)
    if moe and not shexp:
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
        n_nextn=v["nextn_predict_layers"],
    )
