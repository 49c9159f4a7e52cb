"""The draft shipped with Strata for the default model (SmolLM2-135M-Instruct Q4_1).

Made by `strata mtp train` (how: docs/MTP.md). The engine uses it when no --pack is given,
--spec K > 0 and no --mtp is named; and, on a GPU, by default (`default_spec`).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFT_FILE = "smollm2-135m-instruct.mtp.gguf"


def default_draft_path() -> Path | None:
    """Path of the shipped draft for the default model, or None if this build lacks it."""
    path = Path(__file__).parent / "data" / DEFAULT_DRAFT_FILE
    return path if path.is_file() else None


# MTP for the default model where it measured faster than plain decoding: on the GPU (H200,
# --spec 3 --spec-min-p 0.5: 1.06-1.10x on code / lists / prose, docs/MTP.md), not on the CPU
# backend (0.87x at best), whose verification windows cost about one step per token.
DEFAULT_SPEC = {"cuda": (3, 0.5)}


def default_spec(backend: str, given_flags: tuple[str, ...]) -> tuple[int, float | None] | None:
    """(--spec, --spec-min-p) to run the default model with on this backend when the user named
    neither --spec nor --mtp, or None (leave MTP as asked). A --spec-min-p the user gave is kept
    (None in the pair)."""
    if "--spec" in given_flags or "--mtp" in given_flags or backend not in DEFAULT_SPEC:
        return None
    spec, min_p = DEFAULT_SPEC[backend]
    return spec, (None if "--spec-min-p" in given_flags else min_p)
