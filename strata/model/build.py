"""Which model class runs a config: one table, keyed by whether the architecture is hybrid."""

from __future__ import annotations

from typing import Any, Callable

from strata.backend.base import Backend
from strata.model.config import ModelConfig
from strata.model.hybrid.model import HybridModel
from strata.model.transformer import TensorLookup, Transformer


def build_model(backend: Backend, cfg: ModelConfig, get: TensorLookup,
                progress: Callable[[int, int], None] | None = None) -> Any:
    cls = HybridModel if cfg.hybrid is not None else Transformer
    return cls(backend, cfg, get, progress)
