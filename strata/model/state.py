"""What a sequence carries between windows, as the scheduler, the proposer and the prefix cache see it.

Attention-only models keep a KVCache (kv_cache.py); models with Gated DeltaNet layers a
HybridCache (recurrent_state.py: the KV cache of its attention layers plus conv windows and delta
states). Both satisfy SequenceState, so speculation (truncate after a rejected draft, or
snapshot / restore around any run of windows) and window planning never ask which they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from strata.errors import StrataError


class StateLost(StrataError):
    """A sequence without a checkpoint was asked to go back to where its state no longer is."""


@dataclass(frozen=True)
class Snapshot:
    """A sequence's state as of `length` positions, for SequenceState.restore."""

    length: int
    cuts: int  # the KV cache's count of cuts when taken (a restore after another cut is refused)
    recurrent: Any = None  # a copy of the recurrent state (conv windows, delta states); None without


class SequenceState(Protocol):
    length: int  # positions the state holds
    max_ctx: int

    @property
    def checkpointed(self) -> bool:
        """Whether truncate can go back inside the last window (a recurrent state without its
        rollback copy cannot; a KV cache always can)."""
        ...

    @property
    def nbytes(self) -> int: ...

    @property
    def bytes_per_position(self) -> int: ...

    def ensure(self, end: int) -> None: ...
    def truncate(self, n: int) -> None: ...
    def reset(self) -> None: ...

    def snapshot(self) -> Snapshot:
        """The state as it is now, to go back to with restore after any windows that only add
        positions (a KV cache keeps its positions; a recurrent state is copied)."""
        ...

    def restore(self, snap: Snapshot) -> None:
        """Back to `snap`; StateLost if the state was cut back since it was taken."""
        ...
