"""ARCHS: every architecture Strata loads, the one registry (strata/model/archs/spec.py says what
an entry holds). Each is one file of this folder, built from the shared layers of
strata/model/layers/; the config reader, the loader's tensor check, synthetic packs and their
presets all look an architecture up here, and nothing else names one.

A new architecture: its file (hyperparameters, tensors, the layers its block stacks) and its line
below.
"""

from __future__ import annotations

from strata.model.archs import llama, qwen2, qwen3, qwen3moe, qwen3next, qwen4exp, qwen35, qwen35moe
from strata.model.archs.spec import ArchSpec, model_tensors

ARCHS: dict[str, ArchSpec] = {spec.name: spec for spec in (
    llama.SPEC,
    qwen2.SPEC,
    qwen3.SPEC,
    qwen3moe.SPEC,
    qwen35moe.SPEC,
    qwen35.SPEC,
    qwen3next.SPEC,
    qwen4exp.SPEC,
)}

# Lists of architectures by trait, for the tables and flags that take a list.
SUPPORTED_ARCHS = tuple(ARCHS)
HYBRID_ARCHS = tuple(a for a, s in ARCHS.items() if s.recurrent)  # Gated DeltaNet layers: a recurrent state
DENSE_LAYOUT_ARCHS = tuple(a for a in ARCHS if a not in HYBRID_ARCHS)  # attention only: a KV cache
MOE_ARCHS = tuple(a for a, s in ARCHS.items() if s.traits.moe)
HYBRID_MOE_ARCHS = tuple(a for a in MOE_ARCHS if a in HYBRID_ARCHS)

__all__ = ["ARCHS", "ArchSpec", "DENSE_LAYOUT_ARCHS", "HYBRID_ARCHS", "HYBRID_MOE_ARCHS", "MOE_ARCHS",
           "SUPPORTED_ARCHS", "model_tensors"]
