"""The runner: one window's forward, from its entries to what the host needs of it.

`WindowRunner.run(entries, fused)` lays the entries out as one ragged batch (a span per slot),
runs the main model over it (fused with the next drafts where the plan says so:
strata/mtp/fused_window.py), applies the requests' logit adjustments and hands back a
`WindowResult`: the hidden states, and per logit row either a token id (`ids`: the argmax of
greedy rows, a device-drawn id of sampled ones) or the whole row (`rows`, when some request
needs distributions or log-probabilities). Each entry remembers where its caches and rng
stood before the window, so a failed window can be rolled back (strata/batch/recovery.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from strata.batch.delivery import Delivery
from strata.batch.faults import FaultInjector
from strata.batch.plan import Entry
from strata.batch.slots import Slot
from strata.model.state import StateLost
from strata.model.transformer import Span
from strata.mtp.fused_window import forward_with_next_drafts
from strata.sampling.filters import device_can_sample, is_greedy, sampler_row
from strata.sampling.logit_adjust import apply_rows, penalty_tail, row_adjust


@dataclass
class WindowResult:
    """What a window's forward gave. Logit rows are the window's rows that are sampled or
    verified, in entry order (Entry.n_rows each); exactly one of ids and rows is set when
    there are any."""

    spans: list[Span]
    hidden: Any  # the final-normed hidden state of every window row (device)
    ids: np.ndarray | None  # per logit row: the argmax (greedy) or a device-drawn id (host)
    rows: Any  # per logit row: the adjusted logits (host), when a request needs whole rows
    fuse_at: dict[int, tuple[int, int]]  # fused slot -> (its first draft row, its draft span's start)
    draft_out: tuple[np.ndarray, np.ndarray] | None  # the fused drafts: ids and top probabilities per draft row


def cut_back(cache: Any, n: int) -> bool:
    """cache.truncate(n); False when the cache cannot go back there (StateLost)."""
    try:
        cache.truncate(n)
    except StateLost:
        return False
    return True


class WindowRunner:
    def __init__(self, model: Any, faults: FaultInjector, delivery: Delivery, eog: set[int],
                 draft: Any, on_fused_failure: Callable[[list[Slot], Exception], None]):
        self.model = model
        self.faults = faults
        self.delivery = delivery
        self.eog = eog
        self.draft = draft  # the proposer's draft model, for fused windows (None: never fused)
        self.on_fused_failure = on_fused_failure  # the fused slots stop fusing (recovery)
        self.windows = 0

    def run(self, entries: list[Entry], fused: frozenset[int]) -> WindowResult:
        """The forward of the entries (fused with the next drafts where it may), the caches
        advanced; each entry remembers where its caches stood (Recovery._roll_back)."""
        for e in entries:
            s = e.slot
            e.start = s.cache.length
            e.draft_start = s.mtp.cache.length if s.mtp is not None and s.mtp.cache is not None else None
            e.rng_state = s.rng.bit_generator.state if s.rng is not None else None  # (_sample_on_device draws)
        self.faults.check_slots("gpu-trap", [e.slot.index for e in entries], self.model.b)
        self.windows += 1
        long_prompt = self.model.b.long_prompt_tokens
        spans = [Span(e.slot.cache, e.slot.cache.length, len(e.tokens),
                      long_prompt=e.kind == "prefill" and long_prompt is not None and len(e.slot.prompt) >= long_prompt)
                 for e in entries]
        tokens = np.concatenate([np.asarray(e.tokens, dtype=np.int64) for e in entries])
        # logits only for the rows that are sampled or verified
        rows, off = [], 0
        for e in entries:
            if e.kind == "decode":
                rows.extend(range(off, off + len(e.tokens)))
            elif e.wants_logits:
                rows.append(off + len(e.tokens) - 1)
            off += len(e.tokens)
        fuse_at, draft_rows, draft_spans = self._fused_rows(entries, fused)
        if draft_rows:
            try:
                for i in fuse_at:
                    self.faults.check("mtp-fused", i)
                self.delivery.release()  # (it waits on the device for the drafts)
                hidden, ids, dids, dtop = forward_with_next_drafts(self.model, self.draft, tokens, spans,
                                                                   rows, draft_rows, draft_spans)
                # (a fused window brings its hidden states and its rows' argmax along)
                return WindowResult(spans, hidden, ids, None, fuse_at, (dids, dtop))
            except Exception as e:  # the window runs plain (its drafts stay); its fused slots stop fusing
                back = [cut_back(sp.cache, sp.start) for sp in list(spans) + draft_spans]
                self.on_fused_failure([x.slot for x in entries if x.slot.index in fuse_at], e)
                if not all(back):  # a state updated in place: the failed-window path ends its request
                    raise
        hidden, ids, logit_rows = self._forward(entries, tokens, spans, rows)
        return WindowResult(spans, hidden, ids, logit_rows, {}, None)

    @staticmethod
    def _fused_rows(entries: list[Entry], fused: frozenset[int]) -> tuple[dict[int, tuple[int, int]], list[int], list[Span]]:
        """The window rows that make draft entries: those of fused slots whose draft is caught
        up to their pending token. -> ({slot index: (first draft row, draft span start)},
        window rows, draft spans)."""
        fuse_at: dict[int, tuple[int, int]] = {}
        rows: list[int] = []
        spans: list[Span] = []
        off = 0
        for e in entries:
            s = e.slot
            st = s.mtp
            if (e.kind == "decode" and s.index in fused and st.failed is None and not st.fused_failed
                    and st.cache is not None and st.cache.length == s.cache.length and st.caught_up):
                fuse_at[s.index] = (len(rows), st.cache.length)
                rows.extend(range(off, off + len(e.tokens)))
                spans.append(Span(st.cache, st.cache.length, len(e.tokens)))
            off += len(e.tokens)
        return fuse_at, rows, spans

    def _forward(self, entries: list[Entry], tokens: np.ndarray, spans: list[Span],
                 rows: list[int]) -> tuple[Any, np.ndarray | None, Any]:
        """The window's hidden states, and per logit row what the host needs: the argmax of
        greedy rows without logprobs (a few bytes to copy on the GPU instead of a vocabulary of
        floats per row), else device-drawn ids where it can, else the rows. -> (hidden, ids, rows)."""
        b = self.model.b
        if not b.issues_async:
            self.delivery.release()  # the forward runs on this thread: tell the front end first
        out = self.model.forward(tokens, spans, logit_rows=rows or None)
        # test points, after the caches advanced: the failure path must roll them back for real
        for where in ("hang", "window-raise"):
            self.faults.check_slots(where, [e.slot.index for e in entries])
        if not rows:
            self.delivery.release()
            return out, None, None
        hidden, logits = out
        self._adjust_logits(entries, logits)
        only_argmax = all(is_greedy(e.slot.handle.request.params) and not e.slot.handle.request.params.logprobs
                          for e in entries if e.kind == "decode" or e.wants_logits)
        ids = b.argmax_rows(logits) if only_argmax else self._sample_on_device(entries, logits)
        self.delivery.release()  # all issued: the front end's turn comes while the device works
        if ids is not None:
            return hidden, np.asarray(b.to_host(ids)), None
        return hidden, None, b.to_host(logits)

    def _sample_on_device(self, entries: list[Entry], logits: Any) -> Any:
        """Token ids of every logits row, drawn by the backend (strata.kernels.cuda.sample) with
        one uniform from each sampled slot's rng, as the host would draw it; None when this
        window needs whole rows on the host (logprobs, a filter the device sampler lacks, or
        sampled MTP verification, which needs the target's distributions) or the backend does
        not sample."""
        b = self.model.b
        rows = [e for e in entries if e.kind == "decode" or e.wants_logits]
        if not b.samples_on_device or any(
                e.slot.handle.request.params.logprobs
                or not device_can_sample(e.slot.handle.request.params)
                or ((e.drafts or e.cut_q is not None) and not is_greedy(e.slot.handle.request.params))
                for e in rows):
            return None
        params = []
        for e in rows:
            p = e.slot.handle.request.params
            n = len(e.tokens) if e.kind == "decode" else 1
            params += [sampler_row(p, e.slot.rng.random() if not is_greedy(p) else 0.0)] * n
        return b.sample_rows(logits, np.asarray(params, dtype=np.float64))

    def _adjust_logits(self, entries: list[Entry], logits: Any) -> None:
        """The requests' logit adjustments (strata.sampling.logit_adjust), applied to the window's rows
        where they are: row j of a decode entry is adjusted as if its first j drafts were
        already output (their tokens in the penalty window, the grammar advanced past them)."""
        if not any(e.slot.adjusted for e in entries):
            return
        rows = []
        for e in entries:
            if e.kind != "decode" and not e.wants_logits:
                continue
            n = len(e.tokens) if e.kind == "decode" else 1
            s = e.slot
            if not s.adjusted:
                rows += [None] * n
                continue
            p = s.handle.request.params
            end_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eog))
            masks = _grammar_masks(s, e.drafts[: n - 1])
            tail = penalty_tail(p, s.history)
            for j in range(n):
                rows.append(row_adjust(p, tail + e.drafts[:j], s.n_generated + j, end_ids, masks[j]))
        apply_rows(self.model.b.xp, logits, rows)


def _grammar_masks(s: Slot, drafts: list[int]) -> list[Any]:
    """The grammar's allowed tokens for the row after each prefix of the drafts (the drafts
    were checked by plan.grammar_cut); [None, ...] without a grammar."""
    m = s.matcher
    if m is None:
        return [None] * (len(drafts) + 1)
    masks = []
    for j in range(len(drafts) + 1):
        buf = np.zeros(m.vocab_words, np.uint32)
        m.fill_mask(buf)
        masks.append(buf)
        if j < len(drafts):
            m.accept(drafts[j])
    m.rollback(len(drafts))
    return masks
