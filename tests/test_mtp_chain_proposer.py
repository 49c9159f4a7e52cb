"""The proposer's chained drafting (all k greedy draft steps in one call, as the GPU runs them
in one graph): each slot keeps its drafts up to its own k and up to the first whose top
probability is under --spec-min-p, exactly as the step-by-step loop stops; the catch-up
items handed to the draft are the slot's pending tokens and hiddens. Runs on the CPU with a
recording draft (the GPU test tests/test_cuda_window.py::test_draft_chain_equals_step_by_step
checks the draft's chain against its steps)."""

from __future__ import annotations

import numpy as np

from strata.batch.slots import Slot
from strata.protocol import SamplingParams
from strata.mtp.proposer import DraftProposer
from strata.mtp.state import DraftState


class _Cache:
    def __init__(self, length: int):
        self.length = length

    def truncate(self, n: int) -> None:
        self.length = n


class ChainDraft:
    """Answers chain_greedy with fixed ids / top probabilities per slot; records its calls."""

    b = type("B", (), {"xp": np})()

    def __init__(self, ids, tops):
        self.ids, self.tops = np.asarray(ids), np.asarray(tops, dtype=np.float32)
        self.calls = []

    def can_chain(self, items) -> bool:
        return True

    def chain_greedy(self, items, k):
        self.calls.append(([list(np.asarray(t)) for _, t, _ in items], k))
        for cache, toks, _ in items:
            cache.length += len(toks)
        return self.ids[:, :k], self.tops[:, :k]


def _slot(i: int, pending: int, tokens_pending: list[int]) -> Slot:
    s = Slot(index=i, cache=None, mtp=DraftState(cache=_Cache(10)))
    s.pending = pending
    s.mtp.tokens_pending = list(tokens_pending)
    s.mtp.hidden_pending = [np.zeros((len(tokens_pending) + 1, 4), np.float32)]
    return s


def test_chained_drafts_stop_at_k_and_at_min_p():
    draft = ChainDraft(ids=[[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]],
                       tops=[[0.9, 0.8, 0.2, 0.9], [0.1, 0.9, 0.9, 0.9], [0.7, 0.6, 0.95, 0.5]])
    prop = DraftProposer(draft, max_ctx=64, kv_kind="f16", chunk=64, min_p=0.5)
    greedy = SamplingParams(temperature=0.0)
    slots = [_slot(0, 5, [3, 4]), _slot(1, 6, []), _slot(2, 7, [1])]
    out = prop.propose_many([(slots[0], 4, greedy), (slots[1], 3, greedy), (slots[2], 2, greedy)])
    assert [d for d, _ in out] == [[11, 12], [], [31, 32]]  # min-p at step 3 / step 1; k = 2
    assert all(q == [None] * len(d) for d, q in out)
    (toks, k), = draft.calls
    assert k == 4 and toks == [[3, 4, 5], [6], [1, 7]]  # catch-up: pending tokens, then the last one
    assert all(s.mtp.caught_up for s in slots)
