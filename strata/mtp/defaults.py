"""The draft shipped with Strata for the default model (SmolLM2-135M-Instruct Q4_1).

Made by `strata mtp train` (how: docs/MTP.md). The engine uses it when no --pack is given,
--spec K > 0 and no --mtp is named; and by default on a backend where `DEFAULT_SPEC` says
it measured faster (the GPU and, with the draft's narrowed head, the CPU).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFT_FILE = "smollm2-135m-instruct.mtp.gguf"


def default_draft_path() -> Path | None:
    """Path of the shipped draft for the default model, or None if this build lacks it."""
    path = Path(__file__).parent / "data" / DEFAULT_DRAFT_FILE
    return path if path.is_file() else None


# MTP for the default model on a backend only where it measures faster than plain decoding.
# GPU (H200, session 7's draft, bench/bench_mtp.py --device cuda, 128-token answers): --spec 1 at
# min-p 0 gives 1.24-1.31x plain decoding at one slot (--spec 2-3 within noise of it, and worse
# for batch-MTP at 4 slots: 1.0x vs 1.13x). CPU (2-core machine, session 7): 1.05-1.12x at
# --spec 1, since the draft's head is narrowed to its vocabulary there (0.92-0.99x with the
# full head; a 2-row verification window still costs ~1.5 steps). Without --batch-mtp MTP runs
# only while one slot is busy, so concurrent clients keep plain batching unless they ask for
# batch-MTP. Numbers and method: docs/MTP.md.
DEFAULT_SPEC: dict[str, tuple[int, float]] = {"cuda": (1, 0.0), "cpu": (1, 0.0)}


def default_spec(backend: str, given_flags: tuple[str, ...],
                 table: dict[str, tuple[int, float]] | None = None) -> tuple[int, float | None] | None:
    """(--spec, --spec-min-p) to run the default model with on this backend when the user named
    neither --spec nor --mtp, or None (leave MTP as asked). A --spec-min-p the user gave is kept
    (None in the pair). table: DEFAULT_SPEC unless given."""
    table = DEFAULT_SPEC if table is None else table
    if "--spec" in given_flags or "--mtp" in given_flags or backend not in table:
        return None
    spec, min_p = table[backend]
    return spec, (None if "--spec-min-p" in given_flags else min_p)
