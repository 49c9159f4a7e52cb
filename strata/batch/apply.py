"""After a window: verify each slot's tokens, emit them, keep in the caches what stays.

`WindowApply` is the part of the `Scheduler` (strata/batch/scheduler.py) that turns a
`WindowResult` into slot state and events: a prefill chunk's hiddens are kept for the draft
and the prefix cache; a decode entry's rows verify its drafts (strata/sampling/verify.py), the
verdict's tokens go out one by one (`_emit`, which ends the request on a stop, a length or a
grammar's refusal), and the caches are cut back to the tokens that stay. A failure in one
entry ends that request alone: its neighbours' rows are theirs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata.batch.plan import Entry
from strata.batch.prefix_cache import BLOCK
from strata.batch.runner import WindowResult
from strata.batch.slots import Slot
from strata.protocol import FinishEvent, TokenEvent, TopLogprob
from strata.sampling.filters import distribution, is_greedy, log_softmax
from strata.sampling.logit_adjust import banned_now
from strata.sampling.verify import verify


class WindowApply:
    """Mixed into Scheduler: reads its model, tok, cfg, eog, proposer, prefix, delivery, finished."""

    def _apply(self, entries: list[Entry], w: WindowResult) -> None:
        """Each entry's tokens verified and emitted, its caches kept to what stays; a failure
        here ends that entry's request alone (its neighbours' rows are theirs)."""
        li, off = 0, 0
        for e, sp in zip(entries, w.spans):
            try:
                self._apply_entry(e, sp.start, w, off, li)
            except Exception as exc:
                if self.model.b.is_fatal(exc):
                    raise
                self._roll_back(e)
                self._end_failed(e.slot, exc, "the request's output")
            li += e.n_rows
            off += len(e.tokens)

    def _apply_entry(self, e: Entry, start: int, w: WindowResult, off: int, li: int) -> None:
        n = len(e.tokens)
        hidden = w.hidden[off : off + n]
        ids = None if w.ids is None else w.ids[li : li + e.n_rows]
        rows = None if w.rows is None else w.rows[li : li + e.n_rows]
        if e.kind == "prefill":
            self._keep_hidden(e.slot, hidden, start, e.tokens)
            self._note_block_ends(e.slot, hidden, start, n)
            e.slot.n_prefilled += n
            if e.slot.embed_sum is not None:
                self._embed_chunk(e.slot, hidden)
            if e.wants_logits:
                self._accept(e.slot, [], [], ids, rows)
                if e.slot.busy:  # after the first token (off its time to first token)
                    self._remember_prefix(e.slot)  # (requests admitted meanwhile reuse it already)
            return
        keep = self._after_decode(e, hidden, start, ids, rows)
        if e.slot.index in w.fuse_at:
            self._fused_after(e.slot, keep, hidden, w.draft_out, *w.fuse_at[e.slot.index])

    def _embed_chunk(self, s: Slot, hidden: Any) -> None:
        """An embedding request adds its chunk's hiddens as the head reads them (model.head_input:
        final-normed rows, or a mix of residual streams); after the last chunk it ends with their
        mean, L2-normalised (float64 on the host: one vector)."""
        rows = self.model.head_input(hidden)
        s.embed_sum = s.embed_sum + rows.astype(self.model.b.xp.float32).sum(axis=0)
        if s.prefilling:
            return
        v = np.asarray(self.model.b.to_host(s.embed_sum), dtype=np.float64) / max(1, len(s.prompt))
        norm = float(np.linalg.norm(v))
        self._finish(s, "stop", embedding=(v / norm if norm > 0 else v).tolist())

    def _after_decode(self, e: Entry, h: Any, start: int, ids: np.ndarray | None, rows: Any) -> int:
        """Verify and emit; returns how many of the window's tokens stay in the cache (0 when
        the request ended)."""
        s = e.slot
        accepted_tokens = self._accept(s, e.drafts, e.q, ids, rows, e.cut_q)
        if e.drafts:
            s.counters.record(len(e.drafts), accepted_tokens - 1 if accepted_tokens else 0)
        if not s.busy:
            return 0
        keep = accepted_tokens  # x_M plus the accepted drafts stay in the cache
        s.cache.truncate(start + keep)
        self._note_block_ends(s, h, start, keep)
        self._keep_hidden(s, h[:keep], start, e.tokens[:keep])
        return keep

    def _accept(self, s: Slot, drafts: list[int], q: list[Any], ids: np.ndarray | None, rows: Any,
                cut_q: Any = None) -> int:
        """Verify and emit; returns how many window tokens stay in the cache (1 + accepted).
        ids / rows: the entry's logit rows as the runner gave them (WindowResult)."""
        params = s.handle.request.params
        greedy = is_greedy(params)
        if not greedy and rows is None:  # drawn on the device (WindowRunner._sample_on_device)
            tok = int(ids[0])
            if self._emit(s, tok, None):
                s.pending = tok
            return 1
        if greedy:
            p = [int(t) for t in ids] if ids is not None else [int(np.argmax(r)) for r in rows]
        else:
            p = [distribution(row, params) for row in rows]
        verdict = verify(drafts, p, q, s.rng, greedy, cut_q)
        for j, tok in enumerate(verdict.tokens):
            if not self._emit(s, tok, None if rows is None else rows[j]):
                return verdict.accepted + 1
        s.pending = verdict.tokens[-1]
        return verdict.accepted + 1

    def _keep_hidden(self, s: Slot, h: Any, start: int, toks: list[int]) -> None:
        """The draft's catch-up: the proposer keeps the main hiddens and tokens it has not
        consumed yet (only for a request whose MTP admission succeeded)."""
        if s.mtp is not None and s.mtp.admitted:
            self.proposer.commit(s.mtp, h, start, toks)

    def _note_block_ends(self, s: Slot, hidden: Any, start: int, n: int) -> None:
        """Keep the main hidden at each prefix-cache block's last position that this window
        computed (a draft resuming after that block reads it); only where a draft reads hiddens."""
        if self.prefix.budget <= 0 or self._draft_cache(s) is None:
            return
        for end in range((start // BLOCK + 1) * BLOCK, start + n + 1, BLOCK):
            s.block_hidden[end // BLOCK - 1] = hidden[end - 1 - start : end - start].copy()

    def _fused_after(self, s: Slot, keep: int, h: Any, draft_out: Any, first: int, start: int) -> None:
        """After the verdict: the draft keeps its entries up to the new pending token, whose
        entry's guess is the next window's draft."""
        if not s.busy or keep == 0 or draft_out is None:
            return  # the request ended (its slot was reset)
        dids, dtop = draft_out
        s.mtp.cache.truncate(start + keep)
        s.mtp.next_draft = (int(dids[first + keep - 1]), float(dtop[first + keep - 1]))
        s.mtp.fused_hidden = h[keep - 1 : keep]

    # ---- output ---------------------------------------------------------------------------------
    def _end_by_grammar(self, s: Slot, tok: int, params) -> bool:
        """End a request whose grammar refused its token, with why (strata.grammar.matcher's refusal)."""
        end_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(self.eog))
        error, code = s.matcher.refusal(tok, banned_now(params, s.n_generated - 1, end_ids))
        self._finish(s, "error", code=code, error=error)
        return False

    def _emit(self, s: Slot, tok: int, logits_row: np.ndarray | None) -> bool:
        """Send one token (logits_row: its row, for log-probabilities); False when the request ended."""
        params = s.handle.request.params
        s.n_generated += 1
        ends = (tok in self.eog and not params.ignore_eos) or tok in params.stop_token_ids
        # a library limit met computing the mask, or an end the mask did not allow (sampled from a row
        # where the grammar and the request's bans left nothing): the request ends with why
        if s.matcher is not None and (s.matcher.error is not None or (ends and not s.matcher.allows(tok))):
            return self._end_by_grammar(s, tok, params)
        if ends:
            self._finish(s, "stop")
            return False
        s.history.append(tok)
        if s.matcher is not None and not s.matcher.accept(tok):  # a library limit, or every allowed token banned
            return self._end_by_grammar(s, tok, params)
        lp, top = None, None
        if params.logprobs:
            ls = log_softmax(logits_row)
            lp = float(ls[tok])
            if params.top_logprobs:
                idx = np.argsort(-ls, kind="stable")[: params.top_logprobs]
                top = [TopLogprob(int(i), self._piece(int(i)), float(ls[i])) for i in idx]
        text = s.output.feed(tok)
        self.delivery.put(s.handle.events, TokenEvent(tok, text, lp, top))
        if s.output.stopped:
            self._finish(s, "stop", tail=False)
            return False
        if s.matcher is not None and s.matcher.is_stopped():  # the grammar is complete: nothing may follow
            self._finish(s, "stop")
            return False
        if s.n_generated >= params.max_tokens or len(s.prompt) + s.n_generated >= self.cfg.max_ctx:
            self._finish(s, "length")  # prompt + completion never exceed the context
            return False
        return True

    def _piece(self, tok: int) -> str:
        return self.tok.token_bytes(tok).decode("utf-8", errors="replace")

    def _finish(self, s: Slot, reason: str, *, error: str | None = None, code: str | None = None,
                tail: bool = True, embedding: list[float] | None = None) -> None:
        """End the slot's request with `reason` (its held text first, unless it errs) and free the slot."""
        h = s.handle
        text_tail = ""
        if tail and s.output is not None and reason != "error":
            try:
                text_tail = s.output.finish()
            except Exception as e:  # noqa: BLE001 - the request still ends, without its held text
                self.log(f"strata batch: slot {s.index}: releasing the held text failed ({type(e).__name__}: {e})")
        if reason in ("stop", "length") and s.embed_sum is None:
            self._remember_prefix(s)  # the output too: a next turn's prompt starts with it
        self.delivery.put(h.events, FinishEvent(reason, len(s.prompt), s.n_generated, text_tail, error, code, s.cached,
                                                embedding))
        self.finished[reason] += 1
        s.reset()
