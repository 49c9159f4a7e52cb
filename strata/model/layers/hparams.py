"""The hyperparameters every layer reads (`ModelConfig`), and the metadata keys every
architecture shares, as llama.cpp's converters write them (`{arch}.block_count`, ...).

An architecture's own keys (its FFN's, its DeltaNet's, its rope's) come with the layers that read
them and are listed by its ArchSpec (strata/model/archs/); strata/model/config.py joins the three
tables for a pack's architecture and checks the metadata against them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.gguf.key_rules import (
    ALIGNMENT, AT_LEAST_0, AT_LEAST_1, NAME, POSITIVE, Key, Kind, Range, Relation, not_empty, utf8_problem,
)


@dataclass(frozen=True)
class ArchTraits:
    """The small switches the shared layers read."""

    rope_neox: bool  # rotate (i, i + d/2) pairs instead of adjacent (2i, 2i+1) pairs
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    moe: bool  # routed experts instead of one dense FFN
    qkv_bias: bool  # optional biases on q/k/v that synthetic packs carry (qwen2)
    norm_topk_default: bool  # renormalise the chosen experts' weights when metadata is silent


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    traits: ArchTraits
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_scale: float  # linear position scaling factor (1.0 = none)
    n_expert: int
    n_expert_used: int
    expert_ff: int
    norm_topk: bool
    vocab_size: int
    name: str
    rope_sections: tuple[int, ...] = ()  # IMRoPE sections (empty: plain rope)
    # the Gated DeltaNet layers' own hyperparameters (layers/delta_net.py: HybridConfig); None
    # for an architecture without recurrent layers
    hybrid: Any = None

    @property
    def n_layer_all(self) -> int:
        """Main stack plus nextn layers (block_count)."""
        return self.n_layer + (self.hybrid.n_nextn if self.hybrid is not None else 0)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


# Keys every architecture reads, before its own; order matters only for defaults that use earlier keys.
COMMON_KEYS: tuple[Key, ...] = (
    Key("general.architecture", Kind.TEXT, required=True),
    ALIGNMENT,
    NAME,
    Key("embedding_length", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("block_count", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("nextn_predict_layers", Kind.COUNT, range=AT_LEAST_0, default=0),
    Key("context_length", Kind.COUNT, range=AT_LEAST_1, default=4096),
    Key("attention.head_count", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("attention.head_count_kv", Kind.COUNT, range=AT_LEAST_1, default=lambda v: v["attention.head_count"]),
    Key("attention.key_length", Kind.COUNT, range=AT_LEAST_1,
        default=lambda v: v["embedding_length"] // v["attention.head_count"]),
    Key("attention.value_length", Kind.COUNT, range=AT_LEAST_1, default=lambda v: v["attention.key_length"]),
    Key("attention.layer_norm_rms_epsilon", Kind.REAL, range=POSITIVE, default=1e-6),
    Key("rope.freq_base", Kind.REAL, range=POSITIVE, default=10000.0),
    Key("rope.dimension_count", Kind.COUNT, range=AT_LEAST_1, default=lambda v: v["attention.key_length"]),
    Key("rope.scaling.type", Kind.TEXT, default="none", choices=("none", "linear")),
    Key("rope.scaling.factor", Kind.REAL, range=Range(0, None), default=1.0),  # 0: none (llama.cpp's reading)
    Key("vocab_size", Kind.COUNT, range=AT_LEAST_1),
)

# The tokenizer's keys, after the architecture's.
TOKENIZER_KEYS: tuple[Key, ...] = (
    Key("tokenizer.ggml.model", Kind.TEXT, required=True),
    Key("tokenizer.ggml.pre", Kind.TEXT),
    Key("tokenizer.ggml.tokens", Kind.TEXTS, required=True, check=lambda t: not_empty(t) or utf8_problem(t)),
    Key("tokenizer.ggml.token_type", Kind.COUNTS),
    Key("tokenizer.ggml.scores", Kind.REALS),
    Key("tokenizer.ggml.merges", Kind.TEXTS, check=lambda m: utf8_problem(m, "merge")),
    *(Key(f"tokenizer.ggml.{name}_token_id", Kind.COUNT)  # negative: none (some converters write -1)
      for name in ("bos", "eos", "eot", "eom", "padding")),
    *(Key(f"tokenizer.ggml.{name}", Kind.FLAG) for name in ("add_bos_token", "add_eos_token", "add_space_prefix")),
    Key("tokenizer.chat_template", Kind.TEXT),
)

COMMON_RELATIONS: tuple[Relation, ...] = (
    Relation("attention.head_count_kv", ("attention.head_count", "attention.head_count_kv"),
             lambda v: v["attention.head_count"] % v["attention.head_count_kv"] == 0,
             lambda v: f"must divide attention.head_count ({v['attention.head_count']})"),
    Relation("attention.value_length", ("attention.key_length", "attention.value_length"),
             lambda v: v["attention.value_length"] == v["attention.key_length"],
             lambda v: f"must equal attention.key_length ({v['attention.key_length']})"),
    Relation("rope.dimension_count", ("rope.dimension_count", "attention.key_length"),
             lambda v: v["rope.dimension_count"] <= v["attention.key_length"] and v["rope.dimension_count"] % 2 == 0,
             lambda v: f"must be even and <= the head size attention.key_length ({v['attention.key_length']})"),
    Relation("nextn_predict_layers", ("nextn_predict_layers", "block_count"),
             lambda v: v["nextn_predict_layers"] < v["block_count"],
             lambda v: f"must be below block_count ({v['block_count']})"),
)


def _n_tokens(v) -> int:
    return len(v["tokenizer.ggml.tokens"])


_TOKEN_IDS = tuple(k.name for k in TOKENIZER_KEYS if k.name.endswith("_token_id"))

TOKENIZER_RELATIONS: tuple[Relation, ...] = (
    Relation("vocab_size", ("vocab_size", "tokenizer.ggml.tokens"),
             lambda v: v["vocab_size"] == _n_tokens(v),
             lambda v: f"must equal the number of tokens in tokenizer.ggml.tokens ({_n_tokens(v)})"),
    *(Relation(name, (name, "tokenizer.ggml.tokens"), lambda v, name=name: len(v[name]) == _n_tokens(v),
               lambda v: f"must have one entry per token ({_n_tokens(v)} in tokenizer.ggml.tokens)")
      for name in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")),
    *(Relation(name, (name, "tokenizer.ggml.tokens"), lambda v, name=name: v[name] < _n_tokens(v),
               lambda v: f"must be a token id below {_n_tokens(v)}")
      for name in _TOKEN_IDS),
)
