"""Model hyperparameters read from GGUF metadata: the common keys (layers/hparams.py), then the
pack's architecture's own (its ArchSpec in strata/model/archs/), checked once by one table walk
(strata/gguf/key_rules.py) before anything is read, so nothing here can fail on a bad value.
"""

from __future__ import annotations

from typing import Any, Mapping

from strata.errors import StrataError
from strata.gguf.key_rules import Key, Relation, checked_table
from strata.gguf.reader import shown
from strata.model.archs import ARCHS
from strata.model.layers.hparams import (
    COMMON_KEYS, COMMON_RELATIONS, TOKENIZER_KEYS, TOKENIZER_RELATIONS, ArchTraits, ModelConfig,
)

__all__ = ["ArchTraits", "KEYS", "ModelConfig", "RELATIONS", "checked_values", "config_from_metadata", "table_for"]


def _unique(items) -> tuple:
    out: list = []
    for x in items:
        if not any(x is y for y in out):
            out.append(x)
    return tuple(out)


# Every key and relation some architecture reads (the pack's table as a whole).
KEYS: tuple[Key, ...] = _unique((*COMMON_KEYS, *(k for s in ARCHS.values() for k in s.keys), *TOKENIZER_KEYS))
RELATIONS: tuple[Relation, ...] = _unique((*COMMON_RELATIONS, *(r for s in ARCHS.values() for r in s.relations),
                                           *TOKENIZER_RELATIONS))


def table_for(arch: str | None) -> tuple[tuple[Key, ...], tuple[Relation, ...]]:
    """The keys and relations a pack of `arch` is checked against; an architecture not in the
    registry gets the general and tokenizer keys only (the reader then names it unsupported)."""
    spec = ARCHS.get(arch) if isinstance(arch, str) else None
    if spec is None:
        general = tuple(k for k in (*COMMON_KEYS, *TOKENIZER_KEYS) if k.name.startswith(("general.", "tokenizer.")))
        return general, COMMON_RELATIONS + TOKENIZER_RELATIONS
    return (*COMMON_KEYS, *spec.keys, *TOKENIZER_KEYS), (*COMMON_RELATIONS, *spec.relations, *TOKENIZER_RELATIONS)


def checked_values(label: str | None, md: Mapping[str, Any], types: Mapping[str, Any] | None = None,
                   arch: str | None = None) -> dict[str, Any]:
    """Check the pack's metadata against its architecture's table; returns {key name: value}
    with defaults filled in, for every key the architecture reads. arch: defaults to the pack's."""
    arch = arch or md.get("general.architecture")
    keys, relations = table_for(arch)
    return checked_table(f"pack {label}: " if label else "", md, types, arch, keys, relations)


def config_from_metadata(md: Mapping[str, Any], arch_override: str | None = None, *,
                         label: str | None = None, types: Mapping[str, Any] | None = None) -> ModelConfig:
    """The model's hyperparameters. label names the pack in messages; types are the GGUF value
    types (reader's)."""
    arch = arch_override or md.get("general.architecture")
    v = checked_values(label, md, types, arch)  # first, so that a missing architecture is named as such
    if arch not in ARCHS:
        raise StrataError(
            f"{'pack ' + label + ': ' if label else ''}unsupported architecture '{shown(arch)}' "
            f"(supported: {', '.join(sorted(ARCHS))})"
        )
    spec = ARCHS[arch]
    traits = spec.traits
    linear = v["rope.scaling.type"] == "linear"
    # nextn (MTP) layers are counted in block_count but are not part of the main stack
    n_layer = v["block_count"] - v["nextn_predict_layers"]
    return ModelConfig(
        arch=arch,
        traits=traits,
        n_layer=n_layer,
        n_embd=v["embedding_length"],
        n_ff=v.get("feed_forward_length", 0),
        n_head=v["attention.head_count"],
        n_head_kv=v["attention.head_count_kv"],
        head_dim=v["attention.key_length"],
        n_ctx_train=v["context_length"],
        rms_eps=v["attention.layer_norm_rms_epsilon"],
        rope_base=v["rope.freq_base"],
        rope_dim=v["rope.dimension_count"],
        rope_scale=(v["rope.scaling.factor"] or 1.0) if linear else 1.0,
        n_expert=v.get("expert_count", 0),
        n_expert_used=v.get("expert_used_count", 0),
        expert_ff=v.get("expert_feed_forward_length", 0),
        norm_topk=bool(v.get("expert_weights_norm", traits.norm_topk_default)),
        vocab_size=len(v["tokenizer.ggml.tokens"]),
        name=str(v.get("general.name", arch)),
        **spec.read(v, n_layer, label),
    )
