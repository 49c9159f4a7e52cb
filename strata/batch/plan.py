"""What the next window does, decided without doing it (docs/BATCHING.md).

`plan_window` is pure: it reads the busy slots, the prefill shares of this window and the
configuration, and returns a `WindowPlan`: which slots decode, which fuse their next draft into
the window, which go back from fused drafting to catch-up, which verify the draft the last
window made, which draft now (and how many tokens), and how many prompt tokens each
prefilling slot adds. The scheduler then carries it out (strata/batch/scheduler.py): drafts,
grammar cuts and cache growth make the window's `Entry` list, which the runner runs
(strata/batch/runner.py) and the scheduler applies (strata/batch/apply.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.batch.slots import Slot
from strata.mtp.state import Proposer
from strata.sampling.filters import is_greedy


@dataclass
class Entry:
    """One slot's part of a window: its tokens, and for a decode its drafts to verify."""

    slot: Slot
    tokens: list[int]
    kind: str  # "prefill" | "decode"
    drafts: list[int] = field(default_factory=list)
    q: list[Any] = field(default_factory=list)
    cut_q: Any = None  # the draft distribution of a sampled draft the grammar cut (verify's `rejected`)
    wants_logits: bool = True
    # where the slot's caches and rng stood when its window began: a failed window goes back there
    start: int | None = None
    draft_start: int | None = None
    rng_state: dict | None = None

    @property
    def n_rows(self) -> int:
        """The window's logit rows that are this entry's: every decode token, a prompt's last."""
        return len(self.tokens) if self.kind == "decode" else int(self.wants_logits)


@dataclass(frozen=True)
class WindowPlan:
    n_busy: int  # busy slots when the window was planned (MTP alone or batched: mtp_allowed)
    decode: list[Slot]  # slots that add their pending token (and drafts), in slot order
    fused: frozenset[int]  # slots that draft their next window inside this one (fused_window.py)
    unfuse: list[Slot]  # slots one draft entry ahead that go back to catch-up
    stored: list[tuple[Slot, int]]  # fused slots that verify the draft the last window made, at most k
    propose: list[tuple[Slot, int]]  # slots that draft now, at most k tokens (k > 0)
    fallbacks: list[str]  # why slots that would draft alone do not in this window (metrics)
    prefill: list[tuple[Slot, int]]  # prefilling slots and their prompt tokens in this window


def mtp_allowed(s: Slot, n_busy: int, batch_mtp: bool, proposer: Proposer | None) -> tuple[bool, str | None]:
    """Whether the slot may verify a proposal in a window of n_busy slots; and why not, when
    that counts as a fallback (batch-MTP refused for the slot by the probe)."""
    if proposer is None or s.mtp is None or s.mtp.failed is not None or not s.mtp.admitted:
        return False, None
    if n_busy <= 1:
        return True, None
    if not batch_mtp:
        return False, None
    if not s.batch_mtp:
        return False, s.batch_mtp_reason or "probe"
    return True, None


def draft_room(s: Slot, spec: int, max_ctx: int) -> int:
    """At most how many drafts the slot's window carries: a window emits up to k + 1 tokens,
    within max_tokens and the context."""
    room = max_ctx - len(s.prompt) - s.n_generated
    return min(spec, room - 1, s.handle.request.params.max_tokens - s.n_generated - 1)


def prefill_needs(busy: list[Slot]) -> list[tuple[int, int]]:
    """(slot index, prompt tokens left) of each prefilling slot (strata/batch/budget.py shares them)."""
    return [(s.index, len(s.prompt) - s.n_prefilled) for s in busy if s.prefilling]


def plan_window(busy: list[Slot], shares: dict[int, int], cfg: Any, proposer: Proposer | None) -> WindowPlan:
    """The window over `busy` (the slots busy when it began; those that ended since are skipped),
    with `shares` prompt tokens per prefilling slot. cfg: the SchedulerConfig."""
    decode = [s for s in busy if s.busy and not s.prefilling]
    fused = frozenset(s.index for s in _fused_candidates(busy, decode, cfg, proposer))
    unfuse = [s for s in decode if s.mtp is not None and s.mtp.next_draft is not None and s.index not in fused]
    stored = [(s, draft_room(s, cfg.spec, cfg.max_ctx)) for s in decode
              if s.index in fused and s.mtp.next_draft is not None]
    storing = {s.index for s, _ in stored}
    propose, fallbacks = [], []
    for s in decode:
        if s.index in storing:
            continue
        ok, reason = mtp_allowed(s, len(busy), cfg.batch_mtp, proposer)
        if not ok:
            if reason is not None:
                fallbacks.append(reason)
            continue
        k = draft_room(s, cfg.spec, cfg.max_ctx)
        if k > 0:
            propose.append((s, k))
    prefill = [(s, shares[s.index]) for s in busy if shares.get(s.index, 0) > 0]
    return WindowPlan(len(busy), decode, fused, unfuse, stored, propose, fallbacks, prefill)


def _fused_candidates(busy: list[Slot], decode: list[Slot], cfg: Any, proposer: Proposer | None) -> list[Slot]:
    """Slots that may draft their next window inside this one: --spec 1, a greedy window (the
    draft reads the target's argmax), MTP allowed for the slot."""
    if not cfg.fused_drafts or cfg.spec != 1 or proposer is None or proposer.draft is None:
        return []
    if not all(is_greedy(s.handle.request.params) and not s.handle.request.params.logprobs and not s.adjusted
               for s in busy if s.busy):  # (the fused graph takes the rows' argmax before any adjustment)
        return []
    return [s for s in decode if not s.mtp.fused_failed and mtp_allowed(s, len(busy), cfg.batch_mtp, proposer)[0]]


def grammar_cut(s: Slot, drafts: list[int], q: list[Any]) -> tuple[list[int], list[Any], Any]:
    """The drafts up to the first one the request's grammar does not allow (it is never
    verified: the target gives it probability 0), and the cut draft's distribution when it
    was sampled (verify draws that position as a rejection). The matcher ends where it began."""
    m = s.matcher
    if m is None or not drafts:
        return drafts, q, None
    n = 0
    for d in drafts:
        if not m.accept(d):
            break
        n += 1
    m.rollback(n)
    cut_q = q[n] if n < len(drafts) else None
    return drafts[:n], q[:n], cut_q
