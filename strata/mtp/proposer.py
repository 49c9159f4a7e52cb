"""Proposers: where a slot's speculative tokens come from.

`DraftProposer` runs the MTP draft module: it first catches the slot's private draft KV
cache up with the main model's true hidden states (entries the draft has not seen yet),
then drafts up to k tokens one step at a time, and finally rolls its cache back to the
committed entries, so rejected speculation never stays in the draft cache.
Tests plug in other proposers of the same protocol (strata/mtp/state.py; e.g. one that replays
a known continuation) to drive the verifier with proposals whose correctness they control.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.protocol import SamplingParams
from strata.mtp.draft import DraftModel
from strata.mtp.state import DraftState, Drafting, Proposal, Proposer, Work
from strata.sampling.filters import distribution, is_greedy, sample_from


def top_probability(logits: np.ndarray) -> float:
    z = logits.astype(np.float64) - float(np.max(logits))
    return float(1.0 / np.exp(z).sum())


class DraftProposer(Proposer):
    wants_hidden = True  # the scheduler keeps main hiddens for the draft's catch-up

    def __init__(self, draft: DraftModel, *, max_ctx: int, kv_kind: str, chunk: int, min_p: float):
        self.draft = draft
        self.max_ctx = max_ctx
        self.kv_kind = kv_kind
        self.chunk = max(1, chunk)
        self.min_p = min_p

    def admit(self, state: DraftState) -> None:
        """MTP admission: the slot's private draft state (allocated once, reused)."""
        if state.cache is None:
            state.cache = self.draft.new_cache(self.max_ctx, self.kv_kind)
        state.cache.length = 0

    def commit(self, state: DraftState, hidden: Any, start: int, tokens: Sequence[int]) -> None:
        """Keep the main hiddens and tokens the draft has not consumed yet. The draft holds
        entries for x_1..x_C (C = its cache length); it still needs tokens at positions > C and
        main hiddens at positions >= C (entry p reads h_{p-1})."""
        c = state.cache.length if state.cache is not None else 0
        if start + len(tokens) > c:  # a fused slot's draft has seen them all already
            state.hidden_pending.append(hidden[max(0, c - start):])
        state.tokens_pending.extend(t for i, t in enumerate(tokens) if start + i > c)

    def propose(self, s: Drafting, k: int, params: SamplingParams) -> Proposal:
        return self.propose_many([(s, k, params)])[0]

    def propose_many(self, work: Sequence[Work]) -> list[Proposal]:
        """Draft for several slots at once: every draft step is one batched forward over them."""
        d, xp = self.draft, self.draft.b.xp
        # catch-up: entries for x_{C+1}..x_M with the main model's hiddens h_C..h_{M-1}
        items = []
        for s, _, _ in work:
            st = s.mtp
            toks = st.tokens_pending + [s.pending]
            hid = xp.concatenate(st.hidden_pending, axis=0) if len(st.hidden_pending) > 1 else st.hidden_pending[0]
            while len(toks) > self.chunk:  # long histories (MTP was off for a while) go first, alone
                d.step_last([(st.cache, toks[: self.chunk], hid[: self.chunk])], full=False)
                toks, hid = toks[self.chunk :], hid[self.chunk :]
            items.append((st.cache, toks, hid))
            st.hidden_pending, st.tokens_pending = [], []
        # greedy drafting needs each row's argmax and top probability only: computed on the
        # device, not over a vocabulary of floats on the host
        full = not all(is_greedy(params) for _, _, params in work)
        if not full and d.can_chain(items):
            return self._chained(work, items)
        g, rows = d.step_last(items, full=full)
        committed = [s.mtp.cache.length for s, _, _ in work]
        out: list[Proposal] = [([], []) for _ in work]
        live = list(range(len(work)))
        while live:
            nxt_items, nxt_live = [], []
            for pos, i in enumerate(live):
                s, k, params = work[i]
                row = rows[pos] if full else None
                top = top_probability(row) if full else float(rows[1][pos])
                if top < self.min_p:
                    continue
                if not full:
                    tok, qd = int(rows[0][pos]), None
                elif is_greedy(params):
                    tok, qd = int(np.argmax(row)), None
                else:
                    qd = distribution(row, params)
                    tok = sample_from(qd, s.rng)
                out[i][0].append(tok)
                out[i][1].append(qd)
                if len(out[i][0]) < k:
                    nxt_items.append((s.mtp.cache, [tok], g[pos : pos + 1]))
                    nxt_live.append(i)
            if not nxt_items:
                break
            g, rows = d.step_last(nxt_items, full=full)
            live = nxt_live
        for (s, _, _), c in zip(work, committed):
            s.mtp.cache.truncate(c)  # speculative entries are recomputed from true hiddens next time
        return out

    def _chained(self, work: Sequence[Work], items: list) -> list[Proposal]:
        """Greedy drafting with window graphs: all k steps of every slot in one replay (each
        step fed the last one's argmax on the device), then each slot keeps its drafts up to
        the first whose top probability is under --spec-min-p: the drafts the step-by-step
        loop makes, at one host wait per window instead of one per step."""
        k = max(kk for _, kk, _ in work)
        ids, tops = self.draft.chain_greedy(items, k)
        out: list[Proposal] = []
        for i, (_, kk, _) in enumerate(work):
            drafts: list[int] = []
            for j in range(kk):
                if float(tops[i, j]) < self.min_p:
                    break
                drafts.append(int(ids[i, j]))
            out.append((drafts, [None] * len(drafts)))
        return out
