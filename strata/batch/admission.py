"""Admission: a queued request takes a free slot; and prompt reuse through the prefix cache.

`Admission` is the part of the `Scheduler` (strata/batch/scheduler.py) that starts requests:
the slot's sampling state, grammar and output are set up, its MTP admission is tried (a
failure turns MTP off for that slot alone), and the longest computed prefix of its prompt comes
from the prefix cache (strata/batch/prefix_cache.py). A failure while starting a request ends
that request; the loop goes on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata.batch.output import TextOutput
from strata.batch.slots import Slot
from strata.protocol import FinishEvent, RequestHandle
from strata.sampling.filters import is_greedy
from strata.sampling.logit_adjust import has_adjustments


class Admission:
    """Mixed into Scheduler: reads its queue, cv, slots, cfg, tok, model, proposer, prefix, faults."""

    def _admit(self) -> None:
        for s in self.slots:
            if s.busy:
                continue
            with self.cv:
                if not self.queue:
                    return
                h = self.queue.popleft()
            if h.cancelled:
                self.delivery.put(h.events, FinishEvent("cancelled", len(h.request.prompt_ids), 0))
                continue
            try:
                self._start_request(s, h)
            except Exception as e:  # (a seed numpy refuses, ...): that request ends, not the loop
                s.handle = h  # (so that _finish ends it, whatever step failed)
                self._end_failed(s, e, "the request's start")

    def _start_request(self, s: Slot, h: RequestHandle) -> None:
        s.reset()
        s.handle = h  # first: a failure below ends this request (_admit)
        p = h.request.params
        s.prompt = list(h.request.prompt_ids)
        s.history = list(s.prompt)
        s.adjusted = has_adjustments(p)
        if p.constraint is not None:
            from strata.grammar import compile_constraint  # (the grammar library loads on first use)

            s.matcher = compile_constraint(p.constraint, self.tok, n_vocab=self.model.cfg.vocab_size).matcher()
        s.rng = np.random.default_rng(p.seed)
        s.output = TextOutput(self.tok.token_bytes, list(p.stop))
        self.faults.check("admit-raise", s.index)
        if h.request.embed:  # prefilled only: no draft, no output
            s.embed_sum = 0.0
            return
        seeded_sample = not is_greedy(p) and p.seed is not None
        may_draft = s.mtp is not None and s.mtp.failed is None and s.rolls_back  # (a rejected draft rolls back)
        if may_draft and not (seeded_sample and self.cfg.plain_for_seeded):
            try:  # MTP admission: the slot's private draft state
                self.faults.check("mtp-admit", s.index)
                self.proposer.admit(s.mtp)
                s.mtp.admitted = True
            except Exception as e:
                self._mtp_fail(s, "admission", e)
        self._reuse_prefix(s)

    def _draft_cache(self, s: Slot) -> Any:
        """The slot's draft cache when its draft reads main hiddens (its KV goes with the prefix)."""
        if s.mtp is not None and s.mtp.admitted and self.proposer.wants_hidden:
            return s.mtp.cache
        return None

    def _reuse_prefix(self, s: Slot) -> None:
        """The longest computed prefix of the prompt comes from the prefix cache (at least one
        prompt token is left to prefill: its logits give the first output token)."""
        draft = self._draft_cache(s)
        limit = len(s.prompt) - 1
        salt = s.handle.request.cache_salt  # the request's reuse scope
        if draft is not None and self.prefix.match(s.prompt, limit, False, salt) > self.prefix.match(s.prompt, limit, True, salt):
            # more of the prompt was computed than its draft KV (a neighbour still decoding has
            # not let its draft catch up): the reuse wins, this request runs without MTP
            s.mtp.admitted, draft = False, None
        m, hidden = self.prefix.load(s.prompt, s.cache, draft, limit, salt)
        if m == 0:
            return
        s.n_prefilled = s.cached = m
        self.cached_tokens += m
        if draft is not None:
            s.mtp.hidden_pending, s.mtp.tokens_pending = [hidden], []

    def _remember_prefix(self, s: Slot) -> None:
        """What the slot's caches hold of its sequence, kept for later requests."""
        # every position before the last output token holds that token's KV (the last one is
        # not in the cache yet, or a rejected draft's is there)
        tokens = s.history if s.n_generated == 0 else s.history[:-1]
        try:
            self.prefix.store(tokens, s.cache, self._draft_cache(s), s.block_hidden, s.handle.request.cache_salt)
        except Exception as e:  # noqa: BLE001 - reuse is an optimisation: the request is not hurt
            if self.model.b.is_fatal(e):
                raise
            self.log(f"strata batch: slot {s.index}: keeping its prefix failed ({type(e).__name__}: {e})")
