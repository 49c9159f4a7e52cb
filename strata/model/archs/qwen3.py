"""qwen3: llama's graph and tensors, with NEOX rope and per-head RMS norms of q and k
(attn_q_norm, attn_k_norm) before it."""

from __future__ import annotations

from strata.model.archs import decoder, llama
from strata.model.archs.spec import ArchSpec
from strata.model.layers import ffn
from strata.model.layers.hparams import ArchTraits

SPEC = ArchSpec(
    name="qwen3",
    traits=ArchTraits(rope_neox=True, qk_norm=True, moe=False, qkv_bias=False, norm_topk_default=False),
    keys=ffn.KEYS,
    block_tensors=llama.tensors,
    block=llama.block,
    draft_block=decoder.draft_block,
    tiny=llama.TINY_SHAPE,
)
