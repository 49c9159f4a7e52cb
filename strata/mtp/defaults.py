"""The draft shipped with Strata for the default model (SmolLM2-135M-Instruct Q4_1).

Made by `strata mtp train` (how: docs/MTP.md). The engine uses it when no --pack is given,
--spec K > 0 and no --mtp is named.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFT_FILE = "smollm2-135m-instruct.mtp.gguf"


def default_draft_path() -> Path | None:
    """Path of the shipped draft for the default model, or None if this build lacks it."""
    path = Path(__file__).parent / "data" / DEFAULT_DRAFT_FILE
    return path if path.is_file() else None
