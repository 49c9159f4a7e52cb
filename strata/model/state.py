"""What a sequence carries between windows, as the scheduler, the proposer and the prefix cache see it.

Attention-only models keep a KVCache (kv_cache.py); the hybrid family a HybridCache
(recurrent_state.py: the KV cache of its attention layers plus conv windows and delta states).
Both satisfy SequenceState, so speculation (truncate after a rejected draft) and window planning never ask which family they run.
"""

from __future__ import annotations

from typing import Protocol

from strata.errors import StrataError


class StateLost(StrataError):
    """A sequence without a checkpoint was asked to go back to where its state no longer is."""


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
