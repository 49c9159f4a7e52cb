"""The served engine's garbage collector, once the model is loaded.

What loading leaves (the pack's tensor tables, the tokenizer's vocabulary, the model's layers,
the web app) lives as long as the process, yet CPython's cyclic collector walks all of it at
every full collection: on the H200 with a SmolLM2-shaped pack those took 56-64 ms, inside a
window, while every stream waited. gc.freeze() moves what is alive now out of the collector's
sight (it is still freed by reference counting; only cycles among it would stay), so later
collections look at what the requests make. A served engine does this once, after its load and before its
scheduler starts (the one full collection pauses no window); an in-process engine (tests, benchmarks, the CLI) keeps the interpreter's default.
"""

from __future__ import annotations

import gc


def settle_after_load() -> int:
    """Collect what loading left as garbage, then freeze the rest; returns how many objects
    were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
