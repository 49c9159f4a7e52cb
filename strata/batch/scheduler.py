"""The batch scheduler: slots, the queue, and the loop that runs windows back to back.

One engine thread runs windows back to back. A window is one forward of the main model over
the new tokens of every busy slot: a prefill chunk, one token, or (with MTP) the last token
plus that slot's drafts. See docs/BATCHING.md for the rules; in short:
- every decoding slot adds its token(s) to every window; the --prefill budget is shared among
  the prompts not yet done (strata/batch/budget.py), so a short one is not held behind a long one;
- without --batch-mtp, MTP runs only while a single slot is busy;
- with --batch-mtp, each slot whose probe entry allows it verifies its own proposal inside
  the shared window (ragged spans); the others add one token;
- a slot whose recurrent state has no rollback copy (a hybrid model's slot past
  --state-checkpoints) never drafts;
- failures reach no further than they must (strata/batch/recovery.py);
- the loop cannot die silently: it keeps a heartbeat, and `liveness()` says when its thread is
  gone or a window has run past the watchdog (the served engine's /health answers 503).

A window (`step`) is three jobs, one module each: `plan_window` decides it without side effects
(strata/batch/plan.py), `WindowRunner.run` runs it (strata/batch/runner.py) and `_apply` verifies,
emits and keeps what stays (strata/batch/apply.py). What changes state before the plan (ending
cancelled requests and those out of context) and between plan and run (unfusing, drafting through
the proposer, cutting drafts at the grammar, growing the KV caches) are explicit steps of `step`.
Requests start in strata/batch/admission.py.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from strata.batch.admission import Admission
from strata.batch.apply import WindowApply
from strata.batch.budget import PrefillSharing
from strata.batch.delivery import Delivery
from strata.batch.faults import FaultInjector
from strata.batch.plan import Entry, WindowPlan, grammar_cut, plan_window, prefill_needs
from strata.batch.prefix_cache import PrefixCache
from strata.batch.prefix_cache import supports as prefix_supports
from strata.batch.recovery import Recovery
from strata.batch.runner import WindowRunner
from strata.batch.slots import Slot
from strata.model.transformer import Transformer
from strata.mtp.state import DraftState, Proposal, Proposer
from strata.protocol import FinishEvent, GenerationRequest, RequestHandle


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


class Scheduler(Admission, Recovery, WindowApply):
    def __init__(self, model: Transformer, tokenizer: Any, cfg: SchedulerConfig, *,
                 proposer: Proposer | None = None, slot_batch_mtp: list[tuple[bool, str | None]] | None = None,
                 slot_checkpoints: list[bool] | None = None,
                 log: Callable[[str], None] = print, faults: FaultInjector | None = None):
        self.model = model
        self.tok = tokenizer
        self.cfg = cfg
        self.proposer = proposer if cfg.spec > 0 else None
        self.log = log
        self.eog = set(tokenizer.eog_ids)  # (strata.text.tokenizer.Tokenizer)
        checkpoints = slot_checkpoints or [True] * cfg.parallel  # (a hybrid model's rollback copies)
        self.slots = [Slot(i, self._new_cache(keep), mtp=None if self.proposer is None else DraftState())
                      for i, keep in enumerate(checkpoints)]
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
        self.runner = WindowRunner(model, faults or FaultInjector(), self.delivery, self.eog,
                                   None if self.proposer is None else self.proposer.draft, self._stop_fusing)

    @property
    def windows(self) -> int:
        """Windows run so far (metrics)."""
        return self.runner.windows

    @property
    def faults(self) -> FaultInjector:
        """The fault points the tests arm (strata/batch/faults.py), shared with the runner."""
        return self.runner.faults

    @faults.setter
    def faults(self, faults: FaultInjector) -> None:
        self.runner.faults = faults

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

    def run_until_idle(self) -> None:
        """Drive windows on the caller's thread (CLI and tests) until every request finished."""
        while True:
            self._admit()
            if not any(s.busy for s in self.slots):
                self.delivery.release()
                return
            self._guarded_step()


    # ---- one window ---------------------------------------------------------------------------
    def step(self, only: Slot | None = None) -> None:
        """One window over every busy slot (only: over that slot alone, as if it were the only
        one busy; how _step_or_recover finds which request a failure belongs to)."""
        busy = self._before_window(only)
        if not busy:
            return
        shares = self.prefill.shares(prefill_needs(busy), self.cfg.prefill_chunk)
        plan = plan_window(busy, shares, self.cfg, self.proposer)
        entries = self._prepare(plan)
        if not entries:
            return
        try:
            result = self.runner.run(entries, plan.fused)
        except Exception as e:
            b = self.model.b
            if b.is_out_of_memory(e) or b.is_fatal(e):
                raise  # the window's requests end (_step_or_recover)
            self._one_at_a_time(entries, plan.fused, e)
            return
        self._apply(entries, result)

    def _before_window(self, only: Slot | None) -> list[Slot]:
        """The slots busy for the next window, after the requests that end before it ended:
        cancelled ones, and decoding ones with no context left. (Those out of context stay in the
        list: the window's size in slots is counted with them.)"""
        busy = [s for s in self.slots if s.busy and (only is None or s is only)]
        for s in busy:
            if s.handle.cancelled:
                self._finish(s, "cancelled")
        busy = [s for s in busy if s.busy]
        if not busy:
            return []
        self.faults.check_slots("plan-raise", [s.index for s in busy])
        for s in busy:
            if not s.prefilling and s.cache.length + 1 > self.cfg.max_ctx:
                self._finish(s, "length")
        return busy

    def _prepare(self, plan: WindowPlan) -> list[Entry]:
        """The plan carried out up to the forward: fused slots that stop fusing go back to
        catch-up, the drafts are made (the last window's, or the proposer's now) and cut at the
        grammar, and every entry's KV cache grows for its tokens."""
        for s in plan.unfuse:
            s.mtp.unfuse()
        proposals = {s.index: self._stored_proposal(s, k) for s, k in plan.stored}
        for reason in plan.fallbacks:
            self.fallbacks[reason] += 1
        proposals.update(self._proposals(plan.propose))
        entries: list[Entry] = []
        for s in plan.decode:
            drafts, q = proposals.get(s.index, ([], []))
            drafts, q, cut_q = grammar_cut(s, drafts, q)
            entries.append(Entry(s, [s.pending] + drafts, "decode", drafts, q, cut_q))
        for s, n in plan.prefill:
            toks = s.prompt[s.n_prefilled : s.n_prefilled + n]
            last = s.n_prefilled + n == len(s.prompt)
            entries.append(Entry(s, toks, "prefill", wants_logits=last and s.embed_sum is None))
        return self._with_room([e for e in entries if e.slot.busy])

    def _stored_proposal(self, s: Slot, k: int) -> Proposal:
        """The draft the last window made for this one, within k and --spec-min-p."""
        tok, top = s.mtp.next_draft
        try:
            self.faults.check("mtp-draft", s.index)
        except Exception as e:
            self._mtp_fail(s, "draft", e)
            return [], []
        if k <= 0 or top < self.cfg.spec_min_p:
            return [], []
        return [tok], [None]

    def _proposals(self, slots: list[tuple[Slot, int]]) -> dict[int, Proposal]:
        """Drafts for the slots that draft in this window (batched over slots when there are
        several); a slot whose drafting fails loses MTP alone (_mtp_fail)."""
        work = []
        for s, k in slots:
            try:
                self.faults.check("mtp-draft", s.index)
            except Exception as e:
                self._mtp_fail(s, "draft", e)
                continue
            work.append((s, k, s.handle.request.params))
        if not work:
            return {}
        self.delivery.release()  # drafting waits on the device
        if len(work) > 1:
            # what a batch that fails part-way has consumed of each slot's catch-up goes back
            caught_up = [(s.mtp.hidden_pending, s.mtp.tokens_pending, None if s.mtp.cache is None else s.mtp.cache.length)
                         for s, _, _ in work]
            try:
                return {s.index: r for (s, _, _), r in zip(work, self.proposer.propose_many(work))}
            except Exception:  # find the failing slot below, one at a time, each from where it stood
                for (s, _, _), (hidden, toks, length) in zip(work, caught_up):
                    s.mtp.hidden_pending, s.mtp.tokens_pending = hidden, toks
                    if length is not None:
                        s.mtp.cache.truncate(length)
        out = {}
        for s, k, params in work:
            try:
                out[s.index] = self.proposer.propose(s, k, params)
            except Exception as e:
                self._mtp_fail(s, "draft", e)
        return out
