"""qwen3moe: qwen3's attention with routed experts in place of the dense FFN.

Hyperparameters: the common ones and the experts' (expert_count, expert_used_count,
expert_feed_forward_length, expert_weights_norm: renormalised unless it says otherwise).
Tensors, per block: qwen3's attention, ffn_norm, ffn_gate_inp (the router), ffn_gate/up/down_exps.
Graph: attention (NEOX rope, q/k norms), then MoE without a shared expert.
"""

from __future__ import annotations

from strata.backend.base import Backend, RopeParams
from strata.model.archs import decoder
from strata.model.archs.spec import ArchSpec
from strata.model.layers import attention, moe
from strata.model.layers.attention import Attention
from strata.model.layers.block import Block, block_tensors
from strata.model.layers.hparams import ArchTraits, ModelConfig
from strata.model.layers.moe import MoE
from strata.model.layers.tensors import Reader, TensorSpec


def tensors(cfg: ModelConfig, p: str, i: int) -> list[TensorSpec]:
    return block_tensors(cfg, p, attention.tensors(cfg, p, gated=False), moe.tensors(cfg, p), "ffn_norm")


def block(b: Backend, cfg: ModelConfig, r: Reader, rope: RopeParams, i: int, index: int) -> Block:
    return Block(b, cfg, r, Attention(b, cfg, r, rope, gated=False), MoE(b, cfg, r, normalize=cfg.norm_topk),
                 post_norm="ffn_norm", index=index)


# the bug report's MoE shapes, scaled down so CI builds and runs it in seconds
_SEED = dict(n_layer=4, n_embd=256, n_ff=640, n_head=4, n_head_kv=2, head_dim=64, n_expert=16, n_expert_used=4,
             expert_ff=640, context=4096, rope_freq_base=1e6, types="seed-moe")

SPEC = ArchSpec(
    name="qwen3moe",
    traits=ArchTraits(rope_neox=True, qk_norm=True, moe=True, qkv_bias=False, norm_topk_default=True),
    keys=moe.KEYS,
    relations=moe.RELATIONS,
    block_tensors=tensors,
    block=block,
    draft_block=decoder.draft_block,
    tiny={**_SEED, "n_layer": 2, "n_expert": 4, "n_expert_used": 2},
    presets={
        "seed-moe": _SEED,
        # the report's shapes at full size (tens of GiB: GPU machine only)
        "seed-moe-full": dict(n_layer=48, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4, head_dim=128,
                              n_expert=128, n_expert_used=8, expert_ff=640, context=32768, rope_freq_base=1e6,
                              types="seed-moe"),
    },
)
