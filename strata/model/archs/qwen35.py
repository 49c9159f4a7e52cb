"""qwen35 (Qwen3.5 dense): the Gated DeltaNet / gated-attention stack (hybrid.py) with a dense
SwiGLU FFN (feed_forward_length; ffn_gate/up/down), IMRoPE, and qwen35moe's DeltaNet."""

from __future__ import annotations

from strata.model.archs import qwen35moe
from strata.model.archs.hybrid import stack
from strata.model.archs.spec import ArchSpec
from strata.model.layers import delta_net_hparams, ffn, rope
from strata.model.layers.delta_net_hparams import DeltaNetTraits
from strata.model.layers.ffn import DenseFFN
from strata.model.layers.hparams import ArchTraits

DELTA_NET = DeltaNetTraits(grouped_heads=False, fused_ba=False, fused_qkvz=False)
_STACK = stack("qwen35", DELTA_NET, moe=False, imrope=True, ffn_tensors=ffn.tensors, ffn=DenseFFN)
_TINY = {**qwen35moe.TINY_SHAPE, "n_expert": 0, "n_expert_used": 0, "expert_ff": 0, "shexp_ff": 0}

SPEC = ArchSpec(
    name="qwen35",
    traits=ArchTraits(rope_neox=True, qk_norm=True, moe=False, qkv_bias=False, norm_topk_default=True),
    keys=ffn.KEYS + delta_net_hparams.KEYS + rope.IMROPE_KEYS,
    relations=delta_net_hparams.RELATIONS + rope.IMROPE_RELATIONS,
    read=_STACK.read,
    block_tensors=_STACK.block_tensors,
    nextn_tensors=_STACK.nextn_tensors,
    block=_STACK.block,
    draft_block=_STACK.draft_block,
    delta_net=DELTA_NET,
    tiny=_TINY,
    presets={"qwen35-tiny": _TINY},
)
