"""qwen2: llama's graph and tensors, with NEOX rope and q/k/v biases."""

from __future__ import annotations

from strata.model.archs import decoder, llama
from strata.model.archs.spec import ArchSpec
from strata.model.layers import ffn
from strata.model.layers.hparams import ArchTraits

SPEC = ArchSpec(
    name="qwen2",
    traits=ArchTraits(rope_neox=True, qk_norm=False, moe=False, qkv_bias=True, norm_topk_default=False),
    keys=ffn.KEYS,
    block_tensors=llama.tensors,
    block=llama.block,
    draft_block=decoder.draft_block,
    tiny=llama.TINY_SHAPE,
)
