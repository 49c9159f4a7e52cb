"""The model a config runs as: one class for every architecture with one residual vector
(transformer.py), another for those whose residual is hyper-connection streams
(hyper_transformer.py); their blocks built from the architecture's entry in strata/model/archs/."""

from __future__ import annotations

from typing import Callable

from strata.backend.base import Backend
from strata.gguf.row_source import HostTables
from strata.model.archs import ARCHS
from strata.model.config import ModelConfig
from strata.model.hyper_transformer import HyperTransformer
from strata.model.transformer import TensorLookup, Transformer


def build_model(backend: Backend, cfg: ModelConfig, get: TensorLookup,
                progress: Callable[[int, int], None] | None = None, tables: HostTables | None = None) -> Transformer:
    """tables: how tensors that stay on the host are read by rows (strata/gguf/row_source.py; the
    n-gram table of an architecture on streams; default mmap). The caller keeps it to say what
    was opened."""
    if ARCHS[cfg.arch].residual_streams:
        return HyperTransformer(backend, cfg, get, progress, tables=tables)
    return Transformer(backend, cfg, get, progress)
