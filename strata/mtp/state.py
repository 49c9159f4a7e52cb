"""The contract between the scheduler and MTP: a slot's draft state and the proposer protocol.

The scheduler holds one `DraftState` per slot (`Slot.mtp`, None when nothing proposes) and
hands it to a `Proposer`; MTP never sees the scheduler's own types. A slot is seen here only
through `Drafting`: the few fields a proposer reads (its pending token, prompt, rng, ...).

    proposer.admit(slot.mtp)                  # a request starts: its draft state is ready
    drafts, q = proposer.propose(slot, k, p)  # up to k drafts, their distributions (None: greedy)
    proposer.commit(slot.mtp, h, start, toks) # the window's verified tokens and main hiddens
    proposer.fail(slot.mtp, why)              # MTP is off for this slot from now on
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from strata.protocol import SamplingParams


@dataclass
class DraftState:
    """A slot's MTP state. `cache` and `failed` last as long as the slot (the cache is allocated
    once and reused; a failure turns MTP off for the slot); the rest belongs to the request in
    service and goes with `reset()`."""

    cache: Any = None  # the draft's private KV cache (strata.model.kv_cache.KVCache), once admitted
    failed: str | None = None  # why MTP failed for this slot ("where: error"), said once
    admitted: bool = False  # this request's MTP admission succeeded
    # catch-up: main hiddens h_C..h_{M-1} and tokens x_{C+1}..x_{M-1} not yet seen by the draft
    # (C: the draft cache's length, M: the pending token's position)
    hidden_pending: list[Any] = field(default_factory=list)
    tokens_pending: list[int] = field(default_factory=list)
    # fused drafting (strata/mtp/fused_window.py): the draft made inside the last window for the
    # next one, (token, top probability), and the main hidden of the pending token's position - 1
    # (what a normal catch-up needs if the next window does not fuse)
    next_draft: tuple[int, float] | None = None
    fused_hidden: Any = None
    fused_failed: bool = False  # a fused window of this request failed: it drafts unfused until it ends

    @property
    def caught_up(self) -> bool:
        """Nothing waits for the draft's catch-up."""
        return not self.hidden_pending and not self.tokens_pending

    def reset(self) -> None:
        """A new request: nothing pending, not fused, not admitted; the cache emptied, kept."""
        self.admitted = False
        self.hidden_pending, self.tokens_pending = [], []
        self.next_draft = self.fused_hidden = None
        self.fused_failed = False
        if self.cache is not None:
            self.cache.reset()

    def drop_pending(self) -> None:
        """Forget the catch-up and any fused draft (MTP stops for this request)."""
        self.hidden_pending, self.tokens_pending = [], []
        self.next_draft = self.fused_hidden = None

    def fail(self, why: str) -> bool:
        """MTP off for this slot; True the first time (the caller says it once)."""
        first = self.failed is None
        if first:
            self.failed = why
        self.drop_pending()
        return first

    def unfuse(self) -> None:
        """A slot whose draft is one entry ahead (the pending token's) goes back to catch-up:
        the draft forgets that entry, and the hidden it read waits with the pending token."""
        self.cache.truncate(self.cache.length - 1)
        self.hidden_pending, self.tokens_pending = [self.fused_hidden], []
        self.next_draft = self.fused_hidden = None

    def stop_fusing(self) -> None:
        """A fused window failed: this request drafts through the proposer until it ends."""
        self.fused_failed = True
        self.next_draft = self.fused_hidden = None


class Drafting(Protocol):
    """What a proposer reads of a slot (strata.batch.slots.Slot has these)."""

    mtp: DraftState
    pending: int | None  # the last sampled token, not yet in the cache
    prompt: list[int]
    n_generated: int
    rng: np.random.Generator | None


Work = tuple[Drafting, int, SamplingParams]  # a slot, at most k drafts, its request's sampling
Proposal = tuple[list[int], list[Any]]  # drafts, and the distribution each was drawn from (None: greedy)


class Proposer(Protocol):
    """Where a slot's speculative tokens come from (strata.mtp.proposer.DraftProposer; tests
    plug in proposers whose correctness they control). Subclasses get the defaults below."""

    # the scheduler keeps main hiddens for the draft's catch-up (commit) and with the prefix cache
    wants_hidden: bool = False
    # the draft a fused window runs (strata/mtp/fused_window.py); None: windows never fuse
    draft: Any = None

    def admit(self, state: DraftState) -> None:
        """A request starts in the slot: its draft state is ready to draft."""

    def propose(self, slot: Drafting, k: int, params: SamplingParams) -> Proposal:
        ...

    def propose_many(self, work: Sequence[Work]) -> list[Proposal]:
        """Proposals for several slots; the scheduler calls it with two or more. If it raises,
        the scheduler puts every slot's catch-up back and proposes for each alone."""
        return [self.propose(s, k, p) for s, k, p in work]

    def commit(self, state: DraftState, hidden: Any, start: int, tokens: Sequence[int]) -> None:
        """The window's tokens that stay (from position `start`) and their main hiddens."""

    def fail(self, state: DraftState, why: str) -> bool:
        """MTP off for this slot (see DraftState.fail)."""
        return state.fail(why)
