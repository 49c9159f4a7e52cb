"""The model a config runs as: one class for every architecture (transformer.py), its blocks
built from the architecture's entry in strata/model/archs/."""

from __future__ import annotations

from typing import Callable

from strata.backend.base import Backend
from strata.model.config import ModelConfig
from strata.model.transformer import TensorLookup, Transformer


def build_model(backend: Backend, cfg: ModelConfig, get: TensorLookup,
                progress: Callable[[int, int], None] | None = None) -> Transformer:
    return Transformer(backend, cfg, get, progress)
