"""Proposers whose correctness the tests control (the protocol of strata/mtp/state.py)."""

from __future__ import annotations

import numpy as np

from strata.mtp.state import Proposer


class ReplayProposer(Proposer):
    """Proposes the target's own known continuation, wrong at chosen draft positions.

    `continuations[prompt_key]` is the target's greedy continuation; `wrong_at` holds draft
    positions (1-based within a window) that are replaced by a wrong token, so the test
    knows exactly how many drafts each window must accept.
    """

    wants_hidden = False

    def __init__(self, continuations: dict[tuple, list[int]], wrong_at: set[int] = frozenset(), vocab: int = 1000):
        self.cont = continuations
        self.wrong_at = set(wrong_at)
        self.vocab = vocab
        self.expected_accepts: list[int] = []

    def propose(self, slot, k, params):
        cont = self.cont[tuple(slot.prompt)]
        done = slot.n_generated  # tokens emitted so far; slot.pending is cont[done - 1]
        want = cont[done : done + k]
        drafts = []
        accepts = None
        for j, tok in enumerate(want, start=1):
            if j in self.wrong_at:
                tok = (tok + 1) % self.vocab
                if accepts is None:
                    accepts = j - 1
            drafts.append(int(tok))
        self.expected_accepts.append(len(drafts) if accepts is None else accepts)
        return drafts, [None] * len(drafts)


class SampledProposer(Proposer):
    """Draws each draft from a fixed distribution q over a few tokens (for the sampling test)."""

    wants_hidden = False

    def __init__(self, support: list[int], q: list[float], vocab: int, seed: int = 0):
        self.support = np.asarray(support)
        self.qv = np.zeros(vocab)
        self.qv[self.support] = q
        self.rng = np.random.default_rng(seed)

    def propose(self, slot, k, params):
        toks = [int(self.rng.choice(self.support, p=self.qv[self.support])) for _ in range(k)]
        return toks, [self.qv] * k
