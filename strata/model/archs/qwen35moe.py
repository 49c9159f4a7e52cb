"""qwen35moe (Qwen3.5 MoE): the Gated DeltaNet / gated-attention stack (hybrid.py) with routed
experts plus a sigmoid-gated shared expert, and IMRoPE.

Hyperparameters: the common ones, the experts' and the shared expert's width, the DeltaNet's
(`ssm.*`, full_attention_interval or attention.recurrent_layers), rope.dimension_sections.
Tensors: hybrid.py's blocks; DeltaNet input as attn_qkv + attn_gate, beta and alpha as ssm_beta +
ssm_alpha; the FFN's ffn_gate_inp, ffn_gate/up/down_exps (or ffn_gate_up_exps), ffn_gate_inp_shexp,
ffn_gate/up/down_shexp. Graph: hybrid.py's stack, value head j reading key head j % H_k.
"""

from __future__ import annotations

from strata.backend.base import Backend
from strata.model.archs.hybrid import stack
from strata.model.archs.spec import ArchSpec
from strata.model.layers import delta_net_hparams, moe, rope
from strata.model.layers.delta_net_hparams import DeltaNetTraits
from strata.model.layers.hparams import ArchTraits, ModelConfig
from strata.model.layers.moe import MoE
from strata.model.layers.tensors import Reader, TensorSpec


def ffn_tensors(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    return moe.tensors(cfg, p, shared_ff=cfg.hybrid.shexp_ff, fused_gate_up=True)


def ffn(b: Backend, cfg: ModelConfig, r: Reader) -> MoE:
    # the chosen experts' weights are always renormalised: this family's expert_weights_norm is not read
    return MoE(b, cfg, r, shared_ff=cfg.hybrid.shexp_ff, normalize=True)


TRAITS = ArchTraits(rope_neox=True, qk_norm=True, moe=True, qkv_bias=False, norm_topk_default=True)
DELTA_NET = DeltaNetTraits(grouped_heads=False, fused_ba=False, fused_qkvz=False)
_STACK = stack("qwen35moe", DELTA_NET, moe=True, imrope=True, ffn_tensors=ffn_tensors, ffn=ffn)

# 3 DeltaNet layers and 1 gated-attention layer, one nextn layer
TINY_SHAPE = dict(n_layer=4, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=2,
                  expert_ff=128, rope_freq_base=1e7, rope_dim=32, rope_sections=(6, 5, 5, 0), ssm_state=32,
                  ssm_groups=2, ssm_heads=4, shexp_ff=256, nextn=1, types="tiny-hybrid")
# the report's model class at full size (GPU benches)
FULL_SHAPE = dict(n_layer=40, n_embd=2048, n_ff=512, n_head=16, n_head_kv=2, head_dim=256, vocab=248320,
                  n_expert=256, n_expert_used=8, expert_ff=512, context=262144, rope_freq_base=1e7, rope_dim=64,
                  rope_sections=(11, 11, 10, 0), ssm_state=128, ssm_groups=16, ssm_heads=32, shexp_ff=512, nextn=1,
                  types="hybrid-full")

SPEC = ArchSpec(
    name="qwen35moe",
    traits=TRAITS,
    keys=moe.KEYS + moe.SHARED_KEYS + delta_net_hparams.KEYS + rope.IMROPE_KEYS,
    relations=moe.RELATIONS + delta_net_hparams.RELATIONS + rope.IMROPE_RELATIONS,
    read=_STACK.read,
    block_tensors=_STACK.block_tensors,
    nextn_tensors=_STACK.nextn_tensors,
    block=_STACK.block,
    draft_block=_STACK.draft_block,
    delta_net=DELTA_NET,
    shared_expert=True,
    tiny=TINY_SHAPE,
    presets={"qwen35moe-35b-a3b": FULL_SHAPE, "qwen35moe-tiny": TINY_SHAPE},
)
