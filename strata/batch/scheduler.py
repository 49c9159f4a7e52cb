"""The batch scheduler: slots, admission, windows, MTP proposals and verification.

One engine thread runs windows back to back. A window is one forward of the main model over
the new tokens of every busy slot: a prefill chunk, one token, or (with MTP) the last token
plus that slot's drafts. See docs/BATCHING.md for the rules; in short:
- every decoding slot adds its token(s) to every window; the --prefill budget is shared among
  the prompts not yet done (strata/batch/budget.py), so a short one is not held behind a long one;
- without --batch-mtp, MTP runs only while a single slot is busy;
- with --batch-mtp, each slot whose probe entry allows it verifies its own proposal inside
  the shared window (ragged spans); the others add one token;
- a failure in one slot's MTP path turns MTP off for that slot (said once) and the request
  goes on: nothing in the MTP path may end the engine;
- a slot whose recurrent state has no rollback copy (a hybrid model's slot past
  --state-checkpoints) never drafts, and a failed window it was in ends its request: its state
  was updated in place, so the window cannot be rerun;
- a request can only end itself: a failure in its admission, its part of a window or its
  output ends that request (reason "error") and the others go on; a window that fails with
  an exception naming no request runs its requests one at a time to find the one that fails
  (`_one_at_a_time`). Out of memory outside a KV growth ends the window's requests (a retry
  may find room) and a lost device ends them all (`_guarded_step`);
- the loop cannot die silently: it keeps a heartbeat, and `liveness()` says when its thread is
  gone or a window has run past the watchdog (the served engine's /health answers 503).
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from strata.batch.budget import PrefillSharing
from strata.batch.delivery import Delivery
from strata.batch.faults import FaultInjector
from strata.batch.output import TextOutput
from strata.batch.prefix_cache import BLOCK, PrefixCache
from strata.batch.prefix_cache import supports as prefix_supports
from strata.batch.slots import Slot
from strata.protocol import FinishEvent, GenerationRequest, RequestHandle, TokenEvent, TopLogprob
from strata.sampling.logit_adjust import apply_rows, banned_now, has_adjustments, penalty_tail, row_adjust
from strata.model.state import StateLost
from strata.model.transformer import Span, Transformer
from strata.mtp.fused_window import forward_with_next_drafts
from strata.sampling.verify import verify
from strata.sampling.filters import distribution, is_greedy, log_softmax, sampler_row


@dataclass
class SchedulerConfig:
    parallel: int
    max_ctx: int
    kv_kind: str
    prefill_chunk: int
    spec: int = 0
    spec_min_p: float = 0.0
    batch_mtp: bool = False
    fused_drafts: bool = False  # --spec 1 greedy windows draft the next one (fused_window.py)
    # No MTP for sampled requests that carry a seed (the default model's automatic MTP): such a
    # request then draws exactly plain decoding's tokens for its seed, whatever shares its
    # windows (a slot drafts only while it is alone, and speculative sampling draws its
    # randomness differently). Greedy and unseeded requests draft as usual.
    plain_for_seeded: bool = False
    prefix_cache_bytes: int = 0  # prompt reuse (strata/batch/prefix_cache.py); 0: off


FUSED_DRAFTS_ENV = "STRATA_MTP_FUSED"


def fused_drafts_default(backend: Any) -> bool:
    """Fused drafting where the backend replays window graphs (CUDA: one graph and one host
    wait per window instead of two; measured faster at 1, 2 and 4 slots on
    the H200), not on the CPU (the same speed at 1 slot, slower batch-MTP: the draft's head runs
    for every row). STRATA_MTP_FUSED=1 / 0 forces it on / off."""
    forced = os.environ.get(FUSED_DRAFTS_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return backend.graphs is not None


@dataclass
class _Entry:
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


@dataclass
class _Window:
    """What a window's forward gave (see _run_window)."""

    spans: list[Span]
    hidden: Any
    logits: Any  # per logit row: the row, its argmax, or a device-drawn id (_forward)
    fuse_at: dict[int, tuple[int, int]]
    draft_out: Any


class Scheduler:
    def __init__(self, model: Transformer, tokenizer: Any, cfg: SchedulerConfig, *,
                 proposer: Any = None, slot_batch_mtp: list[tuple[bool, str | None]] | None = None,
                 slot_checkpoints: list[bool] | None = None,
                 log: Callable[[str], None] = print, faults: FaultInjector | None = None):
        self.model = model
        self.tok = tokenizer
        self.cfg = cfg
        self.proposer = proposer if cfg.spec > 0 else None
        self.log = log
        self.faults = faults or FaultInjector()
        self.eog = set(getattr(tokenizer, "eog_ids", set()) or set())
        checkpoints = slot_checkpoints or [True] * cfg.parallel  # (a hybrid model's rollback copies)
        self.slots = [Slot(i, self._new_cache(keep)) for i, keep in enumerate(checkpoints)]
        for s, (on, reason) in zip(self.slots, slot_batch_mtp or [(False, None)] * cfg.parallel):
            s.batch_mtp, s.batch_mtp_reason = on, reason
        self.queue: collections.deque[RequestHandle] = collections.deque()
        self.cv = threading.Condition()
        self.running = False
        self.on_fatal: Callable[[str], None] | None = None  # the served engine exits (engine_process)
        self.lost: str | None = None  # why the device can run nothing more, once it cannot
        self.dead: str | None = None  # why the loop ended by an exception no guard caught, once it has
        self.thread: threading.Thread | None = None
        # heartbeat: when the loop last made progress, and when the running step began (None
        # between steps); read by liveness() from other threads
        self.beat = time.monotonic()
        self.step_since: float | None = None
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.windows = 0
        self.prefill = PrefillSharing()  # how each window's prefill budget is shared (strata/batch/budget.py)
        self.finished = collections.Counter()
        reusable = all(prefix_supports(sl.cache) for sl in self.slots)
        self.prefix = PrefixCache(cfg.prefix_cache_bytes if reusable else 0)
        if cfg.prefix_cache_bytes and not reusable:
            log("strata batch: prompt reuse is off for this model: its recurrent state cannot be cut at a "
                "block boundary; every request reports cached_tokens 0")
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, all requests
        # this thread's events reach the front end's listeners once the next window's device
        # work is issued (strata.batch.delivery)
        self.delivery = Delivery()

    def _new_cache(self, checkpoint: bool) -> Any:
        """A slot's cache; without a checkpoint a hybrid model's keeps one recurrent state copy."""
        cfg = self.cfg
        if checkpoint:
            return self.model.new_cache(cfg.max_ctx, cfg.kv_kind)
        return self.model.new_cache(cfg.max_ctx, cfg.kv_kind, checkpoint=False)

    # ---- public, thread-safe ------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> RequestHandle:
        h = RequestHandle(req)
        with self.cv:  # (under the lock: _died empties the queue under it too)
            if self.lost is not None:  # the device can run nothing more (on_fatal was called)
                h.events.put(FinishEvent("error", len(req.prompt_ids), 0, "", self.lost, "device_lost"))
            elif self.dead is not None:  # no loop is left to serve it
                h.events.put(FinishEvent("error", len(req.prompt_ids), 0, "", self.dead, "internal_error"))
            else:
                self.queue.append(h)
                self.cv.notify()
        return h

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="strata-scheduler", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.running = False
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def queue_depth(self) -> int:
        return len(self.queue)

    def slots_busy(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    def liveness(self, watchdog_s: float) -> tuple[bool, str | None]:
        """(alive, why not): not alive when the loop's thread is gone without stop() or one step
        has run longer than watchdog_s (a hung window). A lost device is not reported here:
        on_fatal already ends the served engine."""
        if self.dead is not None:
            return False, self.dead
        t = self.thread
        if t is not None and self.running and not t.is_alive():
            return False, "the scheduler thread is gone"
        since = self.step_since
        if since is not None and time.monotonic() - since > watchdog_s:
            return False, (f"a window has been running for {time.monotonic() - since:.0f} s "
                           f"(the watchdog allows {watchdog_s:g} s, --watchdog-s)")
        return True, None

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - past every guard below: said, never silent
            self._died(e)

    def _serve(self) -> None:
        while True:
            with self.cv:
                while self.running and not self.queue and not any(s.busy for s in self.slots):
                    self.cv.wait()
                if not self.running:
                    break
            self.beat = time.monotonic()
            self._admit()
            self._guarded_step()
        for s in self.slots:
            if s.busy:
                self._finish(s, "cancelled")
        while self.queue:
            h = self.queue.popleft()
            self.delivery.put(h.events, FinishEvent("cancelled", len(h.request.prompt_ids), 0))
        self.delivery.release()

    def _died(self, e: BaseException) -> None:
        """The loop ends: every request in hand or queued ends with the reason, later ones at
        once (submit), and liveness() reports it."""
        why = f"the engine's scheduler stopped: {type(e).__name__}: {e}"
        self.log(f"strata batch: {why} | " + "".join(traceback.format_exception(e)).replace("\n", " | "))
        with self.cv:
            self.dead = why
            self.running = False
            waiting = list(self.queue)
            self.queue.clear()
        ended = [(s.handle, len(s.prompt), s.n_generated) for s in self.slots if s.busy]
        ended += [(h, len(h.request.prompt_ids), 0) for h in waiting]
        for h, n_prompt, n_gen in ended:
            self.delivery.put(h.events, FinishEvent("error", n_prompt, n_gen, "", why, "internal_error"))
        self.delivery.release()

    def run_until_idle(self) -> None:
        """Drive windows on the caller's thread (CLI and tests) until every request finished."""
        while True:
            self._admit()
            if not any(s.busy for s in self.slots):
                self.delivery.release()
                return
            self._guarded_step()

    def _guarded_step(self) -> None:
        """One window, timed for the watchdog (liveness); a failure never ends the engine."""
        self.step_since = time.monotonic()
        try:
            self._step_or_recover()
        finally:
            self.step_since = None
            self.beat = time.monotonic()
            if not any(s.busy for s in self.slots):  # no window follows to release them
                self.delivery.release()

    def _step_or_recover(self) -> None:
        """What step() let through: out of memory ends the window's requests (code
        out_of_memory); a device that lost its context (a sticky CUDA error: every later window
        would fail) ends them with code device_lost and calls on_fatal, which a served engine
        answers by exiting so that it is restarted. Anything else came from planning the window,
        outside any one request's part: each busy slot then steps alone, and one whose own step
        fails ends (internal_error)."""
        try:
            self.step()
        except Exception as e:
            b = self.model.b
            self.log(f"strata batch: window failed: {type(e).__name__}: {e}")
            if b.is_fatal(e):
                self._device_lost(e)
                return
            if b.is_out_of_memory(e):  # not a bug: the window's requests end, the cached memory goes back
                error, code = self._failure(e)
                for s in self.slots:
                    if s.busy:
                        self._finish(s, "error", error=error, code=code)
                return
            for s in [s for s in self.slots if s.busy]:
                try:
                    self.step(only=s)
                except Exception as exc:
                    if b.is_fatal(exc):
                        self._device_lost(exc)
                        return
                    self._end_failed(s, exc, "the request's window")

    def _device_lost(self, e: Exception) -> None:
        why = f"the GPU lost its context ({type(e).__name__}: {e}); no later window can run"
        self.log(f"strata batch: {why}")
        for s in self.slots:
            if s.busy:
                self._finish(s, "error", error=f"the GPU failed: {e}", code="device_lost")
        with self.cv:
            self.lost = f"the GPU failed earlier: {e}"
            self.running = False  # the loop ends; queued requests are cancelled
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _failure(self, e: Exception, what: str | None = None) -> tuple[str, str]:
        """The (error line, code) of a failure (not a lost device) for the requests it ends.
        Out of memory is the requests' (a retry may find room; the cached memory goes back);
        anything else is a bug of ours or an input that got past the checks: its traceback goes
        to the log once."""
        b = self.model.b
        where = f" in {what}" if what else ""
        if b.is_out_of_memory(e):
            b.release_cached_memory()
            return f"out of memory{where}: {e}", "out_of_memory"
        self.log("strata batch: " + "".join(traceback.format_exception(e)).replace("\n", " | "))
        return f"internal error{where}: {type(e).__name__}: {e}", "internal_error"

    def _end_failed(self, s: Slot, e: Exception, what: str) -> None:
        """End the one request whose part of the work failed; the others go on."""
        self.log(f"strata batch: slot {s.index}: {what} failed ({type(e).__name__}: {e}); "
                 f"the request ends, the others go on")
        error, code = self._failure(e, what)
        if s.busy:
            self._finish(s, "error", error=error, code=code)

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
        s.mtp_admitted = False
        self.faults.check("admit-raise", s.index)
        if h.request.embed:  # prefilled only: no draft, no output
            s.embed_sum = 0.0
            return
        seeded_sample = not is_greedy(p) and p.seed is not None
        may_draft = self.proposer is not None and s.mtp_failed is None and s.rolls_back  # (a rejected draft rolls back)
        if may_draft and not (seeded_sample and self.cfg.plain_for_seeded):
            try:  # MTP admission: the slot's private draft state
                self.faults.check("mtp-admit", s.index)
                self.proposer.admit(s)
                s.mtp_admitted = True
            except Exception as e:
                self._mtp_fail(s, "admission", e)
        self._reuse_prefix(s)

    def _draft_cache(self, s: Slot) -> Any:
        """The slot's draft cache when its draft reads main hiddens (its KV goes with the prefix)."""
        if s.mtp_admitted and getattr(self.proposer, "wants_hidden", False):
            return s.draft_cache
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
            s.mtp_admitted, draft = False, None
        m, hidden = self.prefix.load(s.prompt, s.cache, draft, limit, salt)
        if m == 0:
            return
        s.n_prefilled = s.cached = m
        self.cached_tokens += m
        if draft is not None:
            s.hidden_pending, s.tokens_pending = [hidden], []

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

    def _note_block_ends(self, s: Slot, hidden: Any, start: int, n: int) -> None:
        """Keep the main hidden at each prefix-cache block's last position that this window
        computed (a draft resuming after that block reads it); only where a draft reads hiddens."""
        if self.prefix.budget <= 0 or self._draft_cache(s) is None:
            return
        for end in range((start // BLOCK + 1) * BLOCK, start + n + 1, BLOCK):
            s.block_hidden[end // BLOCK - 1] = hidden[end - 1 - start : end - start].copy()

    def _mtp_fail(self, s: Slot, where: str, e: Exception) -> None:
        if s.mtp_failed is None:
            s.mtp_failed = f"{where}: {e}"
            self.log(f"strata batch: MTP {where} for slot {s.index} failed ({e}); "
                     f"MTP is off for this slot, its requests go on one token per window")
        self.fallbacks[f"mtp_{where}_failed"] += 1
        s.hidden_pending, s.tokens_pending = [], []
        s.next_draft = s.fused_hidden = None

    def _mtp_allowed(self, s: Slot, n_busy: int) -> tuple[bool, str | None]:
        if self.proposer is None or s.mtp_failed is not None or not s.mtp_admitted:
            return False, None
        if n_busy <= 1:
            return True, None
        if not self.cfg.batch_mtp:
            return False, None
        if not s.batch_mtp:
            return False, s.batch_mtp_reason or "probe"
        return True, None

    # ---- one window ---------------------------------------------------------------------------
    def step(self, only: Slot | None = None) -> None:
        """One window over every busy slot (only: over that slot alone, as if it were the only
        one busy; how _step_or_recover finds which request a failure belongs to)."""
        entries, fused = self._plan(only)
        if not entries:
            return
        try:
            window = self._run_window(entries, fused)
        except Exception as e:
            b = self.model.b
            if b.is_out_of_memory(e) or b.is_fatal(e):
                raise  # the window's requests end (_step_or_recover)
            self._one_at_a_time(entries, fused, e)
            return
        self._apply(entries, window)

    def _plan(self, only: Slot | None) -> tuple[list[_Entry], set[int]]:
        """The window's entries, their KV caches grown; and the slots that draft inside it."""
        busy = [s for s in self.slots if s.busy and (only is None or s is only)]
        for s in busy:
            if s.handle.cancelled:
                self._finish(s, "cancelled")
        busy = [s for s in busy if s.busy]
        if not busy:
            return [], set()
        self.faults.check_slots("plan-raise", [s.index for s in busy])
        entries: list[_Entry] = []
        decoding = []
        for s in busy:
            if s.prefilling:
                continue
            if s.cache.length + 1 > self.cfg.max_ctx:
                self._finish(s, "length")
                continue
            decoding.append(s)
        fused = {s.index for s in self._fused_candidates(busy, decoding)}
        for s in decoding:
            if s.next_draft is not None and s.index not in fused:
                self._unfuse(s)
        stored = {s.index: self._stored_proposal(s) for s in decoding if s.index in fused and s.next_draft is not None}
        proposals = self._proposals([s for s in decoding if s.index not in stored], len(busy))
        proposals.update(stored)
        for s in decoding:
            drafts, q = proposals.get(s.index, ([], []))
            drafts, q, cut_q = self._grammar_cut(s, drafts, q)
            entries.append(_Entry(s, [s.pending] + drafts, "decode", drafts, q, cut_q))
        shares = self.prefill.shares([(s.index, len(s.prompt) - s.n_prefilled) for s in busy if s.prefilling],
                                     self.cfg.prefill_chunk)
        for s in busy:
            n = shares.get(s.index, 0)
            if n == 0:
                continue
            toks = s.prompt[s.n_prefilled : s.n_prefilled + n]
            last = s.n_prefilled + n == len(s.prompt)
            entries.append(_Entry(s, toks, "prefill", wants_logits=last and s.embed_sum is None))
        return self._with_room([e for e in entries if e.slot.busy]), fused

    @staticmethod
    def _grammar_cut(s: Slot, drafts: list[int], q: list[Any]) -> tuple[list[int], list[Any], Any]:
        """The drafts up to the first one the request's grammar does not allow (it is never
        verified: the target gives it probability 0), and the cut draft's distribution when it
        was sampled (verify draws that position as a rejection)."""
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

    def _run_window(self, entries: list[_Entry], fused: set[int]) -> _Window:
        """The forward of the entries (fused with the next drafts where it may), the caches
        advanced; each entry remembers where its caches stood, for _roll_back."""
        for e in entries:
            s = e.slot
            e.start = s.cache.length
            e.draft_start = s.draft_cache.length if s.draft_cache is not None else None
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
        draft_out = None
        if draft_rows:
            try:
                for i in fuse_at:
                    self.faults.check("mtp-fused", i)
                self.delivery.release()  # (it waits on the device for the drafts)
                hidden, logits, dids, dtop = forward_with_next_drafts(self.model, self.proposer.draft, tokens, spans,
                                                                      rows, draft_rows, draft_spans)
                draft_out = (dids, dtop)
            except Exception as e:  # the window runs plain (its drafts stay); its fused slots stop fusing
                back = [self._cut_back(sp.cache, sp.start) for sp in list(spans) + draft_spans]
                self._stop_fusing([x.slot for x in entries if x.slot.index in fuse_at], e)
                if not all(back):  # a state updated in place: the failed-window path ends its request
                    raise
                fuse_at, draft_rows = {}, []
        if draft_out is None:  # (a fused window brought its hidden states and rows' argmax along)
            hidden, logits = self._forward(entries, tokens, spans, rows)
        return _Window(spans, hidden, logits, fuse_at, draft_out)

    def _apply(self, entries: list[_Entry], w: _Window) -> None:
        """Each entry's tokens verified and emitted, its caches kept to what stays; a failure
        here ends that entry's request alone (its neighbours' rows are theirs)."""
        li, off = 0, 0
        for e, sp in zip(entries, w.spans):
            n = len(e.tokens)
            n_rows = n if e.kind == "decode" else int(e.wants_logits)
            try:
                self._apply_entry(e, sp, w, off, li)
            except Exception as exc:
                if self.model.b.is_fatal(exc):
                    raise
                self._roll_back(e)
                self._end_failed(e.slot, exc, "the request's output")
            li += n_rows
            off += n

    def _apply_entry(self, e: _Entry, sp: Span, w: _Window, off: int, li: int) -> None:
        n = len(e.tokens)
        hidden = w.hidden[off : off + n]
        if e.kind == "prefill":
            self._keep_hidden(e.slot, hidden, sp.start, e.tokens)
            self._note_block_ends(e.slot, hidden, sp.start, n)
            e.slot.n_prefilled += n
            if e.slot.embed_sum is not None:
                self._embed_chunk(e.slot, hidden)
            if e.wants_logits:
                self._accept(e.slot, [], [], w.logits[li : li + 1])
                if e.slot.busy:  # after the first token (off its time to first token)
                    self._remember_prefix(e.slot)  # (requests admitted meanwhile reuse it already)
            return
        keep = self._after_decode(e, hidden, sp.start, w.logits[li : li + n])
        if e.slot.index in w.fuse_at:
            self._fused_after(e.slot, keep, hidden, w.draft_out, *w.fuse_at[e.slot.index])

    def _embed_chunk(self, s: Slot, hidden: Any) -> None:
        """An embedding request adds its chunk's hiddens; after the last chunk it ends with their
        mean, L2-normalised (float64 on the host: one vector)."""
        s.embed_sum = s.embed_sum + hidden.astype(self.model.b.xp.float32).sum(axis=0)
        if s.prefilling:
            return
        v = np.asarray(self.model.b.to_host(s.embed_sum), dtype=np.float64) / max(1, len(s.prompt))
        norm = float(np.linalg.norm(v))
        self._finish(s, "stop", embedding=(v / norm if norm > 0 else v).tolist())

    def _one_at_a_time(self, entries: list[_Entry], fused: set[int], first: Exception) -> None:
        """A window failed with an exception that names no request (a bug, or an input that got
        past the checks). Every entry's caches go back to where the window began and each entry
        runs alone: one whose window fails again ends (internal_error); the others get the
        tokens the window would have given them. An entry whose recurrent state cannot go back
        (no rollback copy) ends at once: rerun, it would compute on a state the window changed."""
        back = [self._roll_back(e) for e in entries]
        for e, ok in zip(entries, back):
            if not ok:
                self._end_state_lost(e.slot, first)
        kept = [e for e, ok in zip(entries, back) if ok]
        if len(entries) == 1 and kept:
            self._end_failed(kept[0].slot, first, "the request's window")
        if len(entries) == 1 or not kept:
            return
        self.log(f"strata batch: a window of {len(entries)} requests failed ({type(first).__name__}: {first}); "
                 f"each runs alone to find the one that fails")
        for e in kept:
            if not e.slot.busy:
                continue
            try:
                window = self._run_window([e], fused)
            except Exception as exc:
                if self.model.b.is_fatal(exc):
                    raise
                self._roll_back(e)
                self._end_failed(e.slot, exc, "the request's window")
                continue
            self._apply([e], window)

    @classmethod
    def _roll_back(cls, e: _Entry) -> bool:
        """The entry's caches and rng back to where its window began (what a failed window wrote
        or drew is dropped). False when its cache cannot go back: a recurrent state without a
        rollback copy, which the window updated in place."""
        s = e.slot
        back = e.start is None or cls._cut_back(s.cache, e.start)
        if e.draft_start is not None and s.draft_cache is not None:
            s.draft_cache.truncate(e.draft_start)
        if e.rng_state is not None and s.rng is not None:
            s.rng.bit_generator.state = e.rng_state
        return back

    @staticmethod
    def _cut_back(cache: Any, n: int) -> bool:
        """cache.truncate(n); False when the cache cannot go back there (StateLost)."""
        try:
            cache.truncate(n)
        except StateLost:
            return False
        return True

    def _end_state_lost(self, s: Slot, e: Exception) -> None:
        """A failed window may have written this slot's one-copy recurrent state: its request
        ends instead of rerunning on that state; the window's other requests rerun as usual."""
        self.log(f"strata batch: slot {s.index}: a window failed ({type(e).__name__}: {e}) after it may have "
                 f"updated the slot's recurrent state, which has no rollback copy; the request ends, the others go on")
        error, code = self._failure(e, "the request's window")
        if s.busy:
            self._finish(s, "error", code=code,
                         error=f"{error} (its recurrent state has no rollback copy: the window cannot be rerun)")

    def _sample_on_device(self, entries: list[_Entry], logits: Any) -> Any:
        """Token ids of every logits row, drawn by the backend (strata.kernels.cuda.sample) with
        one uniform from each sampled slot's rng, as the host would draw it; None when this
        window needs whole rows on the host (logprobs, or sampled MTP verification, which needs
        the target's distributions) or the backend does not sample."""
        b = self.model.b
        rows = [e for e in entries if e.kind == "decode" or e.wants_logits]
        if not b.samples_on_device or any(
                e.slot.handle.request.params.logprobs
                or ((e.drafts or e.cut_q is not None) and not is_greedy(e.slot.handle.request.params))
                for e in rows):
            return None
        params = []
        for e in rows:
            p = e.slot.handle.request.params
            n = len(e.tokens) if e.kind == "decode" else 1
            params += [sampler_row(p, e.slot.rng.random() if not is_greedy(p) else 0.0)] * n
        return b.sample_rows(logits, np.asarray(params, dtype=np.float64))

    def _keep_hidden(self, s: Slot, h: Any, start: int, toks: list[int]) -> None:
        """Remember main hiddens/tokens the draft has not consumed yet (only if it may run)."""
        if self.proposer is None or not getattr(self.proposer, "wants_hidden", False) or not s.mtp_admitted:
            return
        # The draft holds entries for x_1..x_C (C = its cache length); it still needs tokens
        # at positions > C and main hiddens at positions >= C (entry p reads h_{p-1}).
        c = self.proposer.committed(s)
        if start + len(toks) > c:  # a fused slot's draft has seen them all already
            s.hidden_pending.append(h[max(0, c - start):])
        s.tokens_pending.extend(t for i, t in enumerate(toks) if start + i > c)

    def _forward(self, entries: list[_Entry], tokens: np.ndarray, spans: list[Span], rows: list[int]) -> tuple[Any, Any]:
        """The window's hidden states, and per logit row what the host needs: the argmax of
        greedy rows without logprobs (a few bytes to copy on the GPU instead of a vocabulary of
        floats per row), else device-drawn ids where it can, else the rows."""
        b = self.model.b
        if not b.issues_async:
            self.delivery.release()  # the forward runs on this thread: tell the front end first
        out = self.model.forward(tokens, spans, logit_rows=rows or None)
        # test points, after the caches advanced: the failure path must roll them back for real
        for where in ("hang", "window-raise"):
            self.faults.check_slots(where, [e.slot.index for e in entries])
        if not rows:
            self.delivery.release()
            return out, None
        hidden, logits = out
        self._adjust_logits(entries, logits)
        only_argmax = all(is_greedy(e.slot.handle.request.params) and not e.slot.handle.request.params.logprobs
                          for e in entries if e.kind == "decode" or e.wants_logits)
        if only_argmax:
            picked = b.argmax_rows(logits)
        else:
            ids = self._sample_on_device(entries, logits)
            picked = ids if ids is not None else logits
        self.delivery.release()  # all issued: the front end's turn comes while the device works
        return hidden, b.to_host(picked)

    def _adjust_logits(self, entries: list[_Entry], logits: Any) -> None:
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
            masks = self._grammar_masks(s, e.drafts[: n - 1])
            tail = penalty_tail(p, s.history)
            for j in range(n):
                rows.append(row_adjust(p, tail + e.drafts[:j], s.n_generated + j, end_ids, masks[j]))
        apply_rows(self.model.b.xp, logits, rows)

    @staticmethod
    def _grammar_masks(s: Slot, drafts: list[int]) -> list[Any]:
        """The grammar's allowed tokens for the row after each prefix of the drafts (the drafts
        were checked by _grammar_cut); [None, ...] without a grammar."""
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

    def _after_decode(self, e: _Entry, h: Any, start: int, logits: np.ndarray) -> int:
        """Verify and emit; returns how many of the window's tokens stay in the cache (0 when
        the request ended)."""
        s = e.slot
        accepted_tokens = self._accept(s, e.drafts, e.q, logits, e.cut_q)
        if e.drafts:
            s.counters.record(len(e.drafts), accepted_tokens - 1 if accepted_tokens else 0)
        if not s.busy:
            return 0
        keep = accepted_tokens  # x_M plus the accepted drafts stay in the cache
        s.cache.truncate(start + keep)
        self._note_block_ends(s, h, start, keep)
        self._keep_hidden(s, h[:keep], start, e.tokens[:keep])
        return keep

    # ---- fused drafting (--spec 1, greedy; strata/mtp/fused_window.py) --------------------------
    def _fused_candidates(self, busy: list[Slot], decoding: list[Slot]) -> list[Slot]:
        """Slots that may draft their next window inside this one: --spec 1, a greedy window
        (the draft reads the target's argmax), MTP allowed for the slot."""
        if not self.cfg.fused_drafts or self.cfg.spec != 1 or getattr(self.proposer, "draft", None) is None:
            return []
        if not all(is_greedy(s.handle.request.params) and not s.handle.request.params.logprobs and not s.adjusted
                   for s in busy):  # (the fused graph takes the rows' argmax before any adjustment)
            return []
        return [s for s in decoding if not s.fused_failed and self._mtp_allowed(s, len(busy))[0]]

    @staticmethod
    def _fused_rows(entries: list[_Entry], fused: set[int]) -> tuple[dict[int, tuple[int, int]], list[int], list[Span]]:
        """The window rows that make draft entries: those of fused slots whose draft is caught
        up to their pending token. -> ({slot index: (first draft row, draft span start)},
        window rows, draft spans)."""
        fuse_at: dict[int, tuple[int, int]] = {}
        rows: list[int] = []
        spans: list[Span] = []
        off = 0
        for e in entries:
            s = e.slot
            if (e.kind == "decode" and s.index in fused and s.mtp_failed is None and not s.fused_failed
                    and s.draft_cache is not None and s.draft_cache.length == s.cache.length
                    and not s.hidden_pending and not s.tokens_pending):
                fuse_at[s.index] = (len(rows), s.draft_cache.length)
                rows.extend(range(off, off + len(e.tokens)))
                spans.append(Span(s.draft_cache, s.draft_cache.length, len(e.tokens)))
            off += len(e.tokens)
        return fuse_at, rows, spans

    def _stored_proposal(self, s: Slot) -> tuple[list[int], list[Any]]:
        """The draft the last window made for this one, within the request's room and --spec-min-p."""
        tok, top = s.next_draft
        params = s.handle.request.params
        room = self.cfg.max_ctx - len(s.prompt) - s.n_generated
        k = min(self.cfg.spec, room - 1, params.max_tokens - s.n_generated - 1)
        try:
            self.faults.check("mtp-draft", s.index)
        except Exception as e:
            self._mtp_fail(s, "draft", e)
            return [], []
        if k <= 0 or top < self.cfg.spec_min_p:
            return [], []
        return [tok], [None]

    def _fused_after(self, s: Slot, keep: int, h: Any, draft_out: Any, first: int, start: int) -> None:
        """After the verdict: the draft keeps its entries up to the new pending token, whose
        entry's guess is the next window's draft."""
        if not s.busy or keep == 0 or draft_out is None:
            return  # the request ended (its slot was reset)
        dids, dtop = draft_out
        s.draft_cache.truncate(start + keep)
        s.next_draft = (int(dids[first + keep - 1]), float(dtop[first + keep - 1]))
        s.fused_hidden = h[keep - 1 : keep]

    def _stop_fusing(self, slots: list[Slot], e: Exception) -> None:
        """A fused window failed (its caches went back to where it began): which slot's part
        failed is not known, so none loses MTP. Each stops fusing for the rest of its request and
        drafts through the proposer, one slot at a time where a batch fails (_proposals), so a
        draft that keeps failing turns MTP off for its own slot alone (_mtp_fail). The draft
        already holds the pending token's entry (the last window made it): the plain window's
        hiddens are kept for the normal catch-up from there (_keep_hidden)."""
        for s in slots:
            s.fused_failed = True
            s.next_draft = s.fused_hidden = None
            self.fallbacks["fused_draft_failed"] += 1
        self.log(f"strata batch: a fused window failed for slots {', '.join(str(s.index) for s in slots)} ({e}); "
                 f"the window runs plain, these requests go on drafting without fusing")

    def _unfuse(self, s: Slot) -> None:
        """A slot whose draft is one entry ahead (the pending token's) goes back to catch-up:
        the draft forgets that entry, and the hidden it read waits with the pending token."""
        s.draft_cache.truncate(s.draft_cache.length - 1)
        s.hidden_pending, s.tokens_pending = [s.fused_hidden], []
        s.next_draft = s.fused_hidden = None

    def _accept(self, s: Slot, drafts: list[int], q: list[Any], logits: np.ndarray, cut_q: Any = None) -> int:
        """Verify and emit; returns how many window tokens stay in the cache (1 + accepted)."""
        params = s.handle.request.params
        greedy = is_greedy(params)
        if not greedy and not drafts and np.ndim(logits[0]) == 0:  # drawn on the device (_sample_on_device)
            tok = int(logits[0])
            if self._emit(s, tok, logits[0]):
                s.pending = tok
            return 1
        p = list(logits) if greedy else [distribution(row, params) for row in logits]
        verdict = verify(drafts, p, q, s.rng, greedy, cut_q)
        for j, tok in enumerate(verdict.tokens):
            if not self._emit(s, tok, logits[j]):
                return verdict.accepted + 1
        s.pending = verdict.tokens[-1]
        return verdict.accepted + 1

    def _with_room(self, entries: list[_Entry]) -> list[_Entry]:
        """Each entry's KV cache grown for its tokens before the window. A request whose cache
        finds no memory ends (out_of_memory, said once) and the window goes on without it: the
        other requests keep their tokens. The cache keeps the capacity it had (a failed growth
        is rolled back); what the backend holds cached for reuse goes back to the device."""
        kept = []
        for e in entries:
            cache = e.slot.cache
            need = cache.length + len(e.tokens)
            try:
                self.faults.check("kv-grow", e.slot.index)
                cache.ensure(need)
            except Exception as exc:
                if self.model.b.is_fatal(exc):
                    raise
                if not self.model.b.is_out_of_memory(exc):  # a bug: this request ends, the window goes on
                    self._end_failed(e.slot, exc, "the growth of the request's KV cache")
                    continue
                self.model.b.release_cached_memory()
                self.log(f"strata batch: slot {e.slot.index}: out of memory growing its KV cache to {need} "
                         f"tokens ({exc}); the request ends, the others go on")
                self._finish(e.slot, "error", code="out_of_memory",
                             error=f"out of memory: the KV cache could not grow to {need} tokens ({exc})")
                continue
            kept.append(e)
        return kept

    def _proposals(self, slots: list[Slot], n_busy: int) -> dict[int, tuple[list[int], list[Any]]]:
        """Drafts for every slot allowed MTP in this window (batched over slots when possible)."""
        work = []
        for s in slots:
            ok, reason = self._mtp_allowed(s, n_busy)
            if not ok:
                if reason is not None:
                    self.fallbacks[reason] += 1
                continue
            params = s.handle.request.params
            # a window emits up to k + 1 tokens: stay within max_tokens and the context
            room = self.cfg.max_ctx - len(s.prompt) - s.n_generated
            k = min(self.cfg.spec, room - 1, params.max_tokens - s.n_generated - 1)
            if k <= 0:
                continue
            try:
                self.faults.check("mtp-draft", s.index)
            except Exception as e:
                self._mtp_fail(s, "draft", e)
                continue
            work.append((s, k, params))
        if not work:
            return {}
        self.delivery.release()  # drafting waits on the device
        many = getattr(self.proposer, "propose_many", None)
        if many is not None and len(work) > 1:
            # what a batch that fails part-way has consumed of each slot's catch-up goes back
            caught_up = [(s.hidden_pending, s.tokens_pending, None if s.draft_cache is None else s.draft_cache.length)
                         for s, _, _ in work]
            try:
                return {s.index: r for (s, _, _), r in zip(work, many(work))}
            except Exception:  # find the failing slot below, one at a time, each from where it stood
                for (s, _, _), (hidden, toks, length) in zip(work, caught_up):
                    s.hidden_pending, s.tokens_pending = hidden, toks
                    if length is not None:
                        s.draft_cache.truncate(length)
        out = {}
        for s, k, params in work:
            try:
                out[s.index] = self.proposer.propose(s, k, params)
            except Exception as e:
                self._mtp_fail(s, "draft", e)
        return out

    # ---- output ---------------------------------------------------------------------------------
    def _end_by_grammar(self, s: Slot, tok: int, params) -> bool:
        """End a request whose grammar refused its token, with why (strata.grammar.matcher's refusal)."""
        end_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(self.eog))
        error, code = s.matcher.refusal(tok, banned_now(params, s.n_generated - 1, end_ids))
        self._finish(s, "error", code=code, error=error)
        return False

    def _emit(self, s: Slot, tok: int, logits_row: np.ndarray) -> bool:
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
