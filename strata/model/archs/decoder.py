"""The MTP draft block of the plain decoders (llama, qwen2, qwen3, qwen3moe): the target's
attention, and an FFN dense or routed as the draft's own tensors say (a strata-mtp draft file may
carry either, of its own width)."""

from __future__ import annotations

import dataclasses

from strata.backend.base import Backend, RopeParams
from strata.model.layers.attention import Attention
from strata.model.layers.block import Block
from strata.model.layers.ffn import DenseFFN
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.moe import MoE
from strata.model.layers.tensors import Reader, TensorLookup


def draft_block(b: Backend, cfg: ModelConfig, get: TensorLookup, prefix: str,
                rope: RopeParams) -> tuple[ModelConfig, Block]:
    has_router = get(prefix + "ffn_gate_inp.weight") is not None
    gate = get(prefix + "ffn_gate.weight")
    n_ff = gate.shape[1] if gate is not None else cfg.n_ff
    dcfg = dataclasses.replace(cfg, traits=dataclasses.replace(cfg.traits, moe=has_router), n_ff=n_ff, n_layer=1)
    r = Reader(get, prefix)
    attn = Attention(b, dcfg, r, rope, gated=False)
    ffn = MoE(b, dcfg, r, normalize=dcfg.norm_topk) if has_router else DenseFFN(b, dcfg, r)
    return dcfg, Block(b, dcfg, r, attn, ffn, post_norm="ffn_norm")
