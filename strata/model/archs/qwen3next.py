"""qwen3next (Qwen3-Next): qwen35moe's stack and FFN with plain NEOX rope and its own DeltaNet
layout, as llama.cpp's src/models/qwen3next.cpp reads it.

Hyperparameters: qwen35moe's without rope.dimension_sections. Tensors: beta and alpha in one
ssm_ba matrix ([b(r) | a(r)] per key group); the DeltaNet input as attn_qkv + attn_gate or, as
earlier converters wrote it, one fused ssm_in (layers/fused_qkvz.py). Graph: value head j reads
key head j // (H_v / H_k).
"""

from __future__ import annotations

from strata.model.archs import qwen35moe
from strata.model.archs.hybrid import stack
from strata.model.archs.spec import ArchSpec
from strata.model.layers import delta_net_hparams, moe
from strata.model.layers.delta_net_hparams import DeltaNetTraits

DELTA_NET = DeltaNetTraits(grouped_heads=True, fused_ba=True, fused_qkvz=True)
_STACK = stack("qwen3next", DELTA_NET, moe=True, imrope=False, ffn_tensors=qwen35moe.ffn_tensors, ffn=qwen35moe.ffn)
_TINY = {**qwen35moe.TINY_SHAPE, "rope_sections": ()}

SPEC = ArchSpec(
    name="qwen3next",
    traits=qwen35moe.TRAITS,
    keys=moe.KEYS + moe.SHARED_KEYS + delta_net_hparams.KEYS,
    relations=moe.RELATIONS + delta_net_hparams.RELATIONS,
    read=_STACK.read,
    block_tensors=_STACK.block_tensors,
    nextn_tensors=_STACK.nextn_tensors,
    block=_STACK.block,
    draft_block=_STACK.draft_block,
    delta_net=DELTA_NET,
    shared_expert=True,
    tiny=_TINY,
    presets={
        "qwen3next-80b-a3b": {**qwen35moe.FULL_SHAPE, "n_layer": 48, "n_expert": 512, "n_expert_used": 10,
                              "vocab": 151936, "rope_sections": ()},
        "qwen3next-tiny": _TINY,
    },
)
