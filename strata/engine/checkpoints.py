"""Which slots' recurrent state keeps a rollback copy (hybrid models; strata/model/recurrent_state.py).

A slot with a **checkpoint** keeps two copies of its recurrent state plus the inputs that replay
accepted drafts, so a window can be cut back (rejected drafts, a failed window rerun). Without
one, the slot keeps a single copy that windows update in place: it never drafts (one token per
window, with or without --batch-mtp) and a window that fails for it ends its request.

`--state-checkpoints N` gives the first N slots a checkpoint; `auto` (the default) gives as many
as the memory left holds: what the backend has free once the weights and the draft are loaded,
less a margin it keeps for its own sizing (MARGIN_BYTES), less one state copy for every slot.
The engine core and `strata probe` decide with the same functions, and say it in the same line.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.backend.cuda_graphs import WIDE_GRAPH_MIN_FREE_BYTES
from strata.kernels.probe import slot_ranges

MiB = 1 << 20

# backend -> bytes kept free besides the checkpoints. On the GPU the margin under which window
# graphs of prompt chunks are no longer captured (strata/backend/cuda_graphs.py): checkpoints never
# take the memory that keeps prompt chunks graphed. The CPU's figure is the host's free memory.
MARGIN_BYTES: dict[str, int] = {"cuda": WIDE_GRAPH_MIN_FREE_BYTES}


def checkpoint_count(per_slot: int, budget: int | None, parallel: int) -> int:
    """How many slots get a checkpoint of `per_slot` bytes out of `budget` (None: not known, so
    every slot, as before the engine sized them)."""
    if budget is None or per_slot <= 0:
        return parallel
    return max(0, min(parallel, budget // per_slot))


def checkpoint_budget(free: int | None, backend: str, parallel: int, one_copy: int) -> int | None:
    """The bytes left for checkpoints: `free` (the backend's free memory after the weights) less
    the backend's margin and one state copy per slot (which every slot needs); None when the free
    memory is not known."""
    if free is None:
        return None
    return max(0, free - MARGIN_BYTES.get(backend, 0) - parallel * one_copy)


@dataclass(frozen=True)
class CheckpointPlan:
    parallel: int
    count: int  # slots [0, count) keep a rollback copy
    per_slot: int  # bytes one checkpoint costs (second state copy + replay inputs)
    budget: int | None  # bytes there were for checkpoints (auto); None: unknown, or asked
    asked: int | None  # --state-checkpoints N, None: auto

    def has(self, slot: int) -> bool:
        return slot < self.count

    def flags(self) -> list[bool]:
        """Per slot: does it keep a checkpoint."""
        return [self.has(i) for i in range(self.parallel)]

    def line(self) -> str | None:
        """The start-up line naming the slots without a checkpoint and why (None: every slot has one)."""
        lacking = list(range(self.count, self.parallel))
        if not lacking:
            return None
        if self.asked is not None:
            why = f"--state-checkpoints {self.asked}"
        else:  # (what the checkpoints given left of the budget)
            left = (self.budget or 0) - self.count * self.per_slot
            why = f"needs {self.per_slot / MiB:.1f} MiB each, {left / MiB:.1f} MiB left"
        verb, tail = (("have", "they decode") if len(lacking) > 1 else ("has", "it decodes"))
        return (f"strata: recurrent state: {slot_ranges(lacking)} {verb} no rollback copy ({why}): "
                f"{tail} one token per window")


def plan_checkpoints(asked: int | None, parallel: int, per_slot: int, budget: int | None) -> CheckpointPlan:
    """The first `asked` slots (at most every slot), or as many as `budget` holds when not asked."""
    if asked is not None:
        return CheckpointPlan(parallel, min(asked, parallel), per_slot, None, asked)
    return CheckpointPlan(parallel, checkpoint_count(per_slot, budget, parallel), per_slot, budget, None)
