"""What the engine says and refuses about --max-context, once the model is built: a context past
the one the model was trained for is allowed with one warning (as llama.cpp warns "n_ctx_seq >
n_ctx_train"), and a --max-context whose KV cache cannot fit the free memory even for one slot is
refused in one line, with the most that fits (before any request finds out by running out)."""

from __future__ import annotations

from typing import Any

from strata.errors import OutOfMemory

GiB = 1 << 30


def past_training_warning(max_context: int | None, n_ctx_train: int, arch: str, metadata: Any) -> str | None:
    """The warning for a --max-context past the pack's <arch>.context_length, or None. A pack that
    does not say its training context (the engine then assumes one) gets no warning: nothing
    true could be said about it."""
    key = f"{arch}.context_length"
    if max_context is None or key not in metadata or max_context <= n_ctx_train:
        return None
    return (f"strata: warning: --max-context {max_context} is past the {n_ctx_train} positions the model was "
            f"trained for ({key}): past them its output may degrade")


def check_one_slot_fits(max_context: int | None, n_ctx: int, bytes_per_position: int, free: int | None,
                        backend: str, kv: str) -> None:
    """Refuse a --max-context the user gave whose KV cache, for one slot at full context, is more
    than the memory free now (after the weights): no request could ever reach that context. The
    model's own default context is not refused (its caches grow as requests need them; the
    engine's sizing note says how far they get)."""
    if max_context is None or free is None or bytes_per_position <= 0:
        return
    need = n_ctx * bytes_per_position
    if need <= free:
        return
    fits = free // bytes_per_position
    raise OutOfMemory(f"--max-context {max_context}: one slot's KV cache at full context would take "
                      f"{need / GiB:.1f} GiB on {backend} (--kv {kv}), {free / GiB:.1f} GiB is free: "
                      f"about {fits} tokens fit (a smaller --max-context" + (", or --kv int8)" if kv != "int8" else ")"))
