"""Rotary position embeddings: plain (NEOX or adjacent pairs, from the traits) or IMRoPE, whose
`rope.dimension_sections` leave some pairs of a text token unrotated."""

from __future__ import annotations

from strata.backend.base import RopeParams
from strata.gguf.key_rules import Key, Kind, Relation
from strata.model.layers.hparams import ModelConfig


def _four_sections(values) -> str | None:
    return None if len(values) == 4 and all(int(x) >= 0 for x in values) else \
        f"must be 4 non-negative integers, found {len(values)} value(s)"


IMROPE_KEYS = (Key("rope.dimension_sections", Kind.COUNTS, required=True, check=_four_sections),)
IMROPE_RELATIONS = (
    Relation("rope.dimension_sections", ("rope.dimension_sections", "rope.dimension_count"),
             lambda v: 0 < sum(int(x) for x in v["rope.dimension_sections"]) <= v["rope.dimension_count"] // 2,
             lambda v: f"must sum to between 1 and half of rope.dimension_count ({v['rope.dimension_count'] // 2})"),
)


def frozen_rope_pairs(sections: tuple[int, ...], rope_dim: int) -> tuple[int, ...]:
    """IMRoPE pairs that text tokens leave unrotated. A text token's four position components are
    (p, p, p, 0); pair i takes component (i % sum) % 3 while that stays inside its section, else
    the fourth (0: no rotation). Every other pair is NEOX rope at p."""
    if not sections:
        return ()
    total = sum(sections)
    frozen = []
    for i in range(rope_dim // 2):
        s = i % total if total else 0
        comp = s % 3
        if not s < 3 * sections[comp]:
            frozen.append(i)
    return tuple(frozen)


def rope_params(cfg: ModelConfig) -> RopeParams:
    """What attention rotates q and k by (cfg.rope_sections empty: no IMRoPE)."""
    return RopeParams(cfg.rope_base, cfg.rope_dim, cfg.rope_scale, cfg.traits.rope_neox,
                      frozen_rope_pairs(cfg.rope_sections, cfg.rope_dim))
