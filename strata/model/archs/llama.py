"""llama (and SmolLM): the plain decoder.

Hyperparameters: the common ones and feed_forward_length. Tensors, per block: attn_norm,
attn_q/k/v, attn_output (q/k/v biases where a pack has them), ffn_norm, ffn_gate/up/down. Graph:
each block is attention (rope on adjacent pairs) then a dense SwiGLU FFN.
"""

from __future__ import annotations

from strata.backend.base import Backend, RopeParams
from strata.model.archs import decoder
from strata.model.archs.spec import ArchSpec
from strata.model.layers import attention, ffn
from strata.model.layers.attention import Attention
from strata.model.layers.block import Block, block_tensors
from strata.model.layers.ffn import DenseFFN
from strata.model.layers.hparams import ArchTraits, ModelConfig
from strata.model.layers.tensors import Reader, TensorSpec


def tensors(cfg: ModelConfig, p: str, i: int) -> list[TensorSpec]:
    return block_tensors(cfg, p, attention.tensors(cfg, p, gated=False), ffn.tensors(cfg, p), "ffn_norm")


def block(b: Backend, cfg: ModelConfig, r: Reader, rope: RopeParams, i: int, index: int) -> Block:
    return Block(b, cfg, r, Attention(b, cfg, r, rope, gated=False), DenseFFN(b, cfg, r), post_norm="ffn_norm",
                 index=index)


TINY_SHAPE = dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, types="tiny-dense")

SPEC = ArchSpec(
    name="llama",
    traits=ArchTraits(rope_neox=False, qk_norm=False, moe=False, qkv_bias=False, norm_topk_default=False),
    keys=ffn.KEYS,
    block_tensors=tensors,
    block=block,
    draft_block=decoder.draft_block,
    tiny=TINY_SHAPE,
    presets={
        # the test model's shapes (SmolLM2-135M-Instruct Q4_1)
        "smollm": dict(n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, head_dim=64, context=8192,
                       rope_freq_base=100000.0, rms_eps=1e-5, tied_output=True, types="smollm"),
        "dense-8b": dict(n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, head_dim=128, context=8192,
                         rope_freq_base=500000.0, rms_eps=1e-5, types="dense-8b"),
    },
)
