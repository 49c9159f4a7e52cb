"""Proposers: where a slot's speculative tokens come from.

`DraftProposer` runs the MTP draft module: it first catches the slot's private draft KV
cache up with the main model's true hidden states (entries the draft has not seen yet),
then drafts up to k tokens one step at a time, and finally rolls its cache back to the
committed entries, so rejected speculation never stays in the draft cache.
Tests plug in other proposers with the same two methods (e.g. one that replays a known
continuation) to drive the verifier with proposals whose correctness they control.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata.batch.slots import Slot
from strata.engine.protocol import SamplingParams
from strata.mtp.draft import DraftModel
from strata.sampling import distribution, is_greedy, sample_from


def top_probability(logits: np.ndarray) -> float:
    z = logits.astype(np.float64) - float(np.max(logits))
    return float(1.0 / np.exp(z).sum())


class DraftProposer:
    wants_hidden = True  # the scheduler keeps main hiddens for the draft's catch-up

    def __init__(self, draft: DraftModel, *, max_ctx: int, kv_kind: str, chunk: int, min_p: float):
        self.draft = draft
        self.max_ctx = max_ctx
        self.kv_kind = kv_kind
        self.chunk = max(1, chunk)
        self.min_p = min_p

    def admit(self, s: Slot) -> None:
        """MTP admission: the slot's private draft state (allocated once, reused)."""
        if s.draft_cache is None:
            s.draft_cache = self.draft.new_cache(self.max_ctx, self.kv_kind)
        s.draft_cache.length = 0

    def committed(self, s: Slot) -> int:
        return s.draft_cache.length if s.draft_cache is not None else 0

    def propose(self, s: Slot, k: int, params: SamplingParams) -> tuple[list[int], list[Any]]:
        d = self.draft
        b = d.b
        xp = b.xp
        greedy = is_greedy(params)
        # catch-up: entries for x_{C+1}..x_M with the main model's hiddens h_C..h_{M-1}
        toks = s.tokens_pending + [s.pending]
        hid = xp.concatenate(s.hidden_pending, axis=0) if len(s.hidden_pending) > 1 else s.hidden_pending[0]
        committed = s.draft_cache.length + len(toks)
        for a in range(0, len(toks), self.chunk):
            g, lg = d.step(s.draft_cache, np.asarray(toks[a : a + self.chunk]), hid[a : a + self.chunk])
        s.hidden_pending, s.tokens_pending = [], []
        drafts: list[int] = []
        qs: list[Any] = []
        g, row = g[-1:], b.to_host(lg[-1])
        while top_probability(row) >= self.min_p:
            if greedy:
                tok, qd = int(np.argmax(row)), None
            else:
                qd = distribution(row, params)
                tok = sample_from(qd, s.rng)
            drafts.append(tok)
            qs.append(qd)
            if len(drafts) >= k:
                break
            g, lg = d.step(s.draft_cache, np.asarray([tok]), g)
            row = b.to_host(lg[-1])
        s.draft_cache.truncate(committed)  # speculative entries are recomputed from true hiddens
        return drafts, qs
