"""Recovery: what happens when a window, a request's part of it, or a slot's MTP path fails.

`Recovery` is the part of the `Scheduler` (strata/batch/scheduler.py) that keeps one failure
from reaching further than it must (docs/BATCHING.md, "Failures"):
- a request can only end itself: a failure in its admission, its part of a window or its
  output ends that request (reason "error") and the others go on;
- a window that fails with an exception naming no request runs its requests one at a time to
  find the one that fails (`_one_at_a_time`), each from where its caches stood (`_roll_back`);
  a slot whose recurrent state has no rollback copy ends instead (`_end_state_lost`);
- out of memory growing one KV cache ends that request (`_with_room`); out of memory in the
  window ends the window's requests; a lost device ends them all (`_step_or_recover`);
- a failure in one slot's MTP path turns MTP off for that slot, said once (`_mtp_fail`), and a
  failed fused window makes its slots draft unfused (`_stop_fusing`); nothing in the MTP path
  ends a request or the engine;
- an exception past every guard ends the loop, said, never silent (`_died`).
"""

from __future__ import annotations

import time
import traceback

from strata.batch.plan import Entry
from strata.batch.runner import cut_back
from strata.batch.slots import Slot
from strata.protocol import FinishEvent


class Recovery:
    """Mixed into Scheduler: reads its model, slots, cv, queue, log, fallbacks, faults, runner."""

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

    def _with_room(self, entries: list[Entry]) -> list[Entry]:
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

    def _one_at_a_time(self, entries: list[Entry], fused: frozenset[int], first: Exception) -> None:
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
                window = self.runner.run([e], fused)
            except Exception as exc:
                if self.model.b.is_fatal(exc):
                    raise
                self._roll_back(e)
                self._end_failed(e.slot, exc, "the request's window")
                continue
            self._apply([e], window)

    @staticmethod
    def _roll_back(e: Entry) -> bool:
        """The entry's caches and rng back to where its window began (what a failed window wrote
        or drew is dropped). False when its cache cannot go back: a recurrent state without a
        rollback copy, which the window updated in place."""
        s = e.slot
        back = e.start is None or cut_back(s.cache, e.start)
        if e.draft_start is not None and s.mtp is not None and s.mtp.cache is not None:
            s.mtp.cache.truncate(e.draft_start)
        if e.rng_state is not None and s.rng is not None:
            s.rng.bit_generator.state = e.rng_state
        return back

    def _end_state_lost(self, s: Slot, e: Exception) -> None:
        """A failed window may have written this slot's one-copy recurrent state: its request
        ends instead of rerunning on that state; the window's other requests rerun as usual."""
        self.log(f"strata batch: slot {s.index}: a window failed ({type(e).__name__}: {e}) after it may have "
                 f"updated the slot's recurrent state, which has no rollback copy; the request ends, the others go on")
        error, code = self._failure(e, "the request's window")
        if s.busy:
            self._finish(s, "error", code=code,
                         error=f"{error} (its recurrent state has no rollback copy: the window cannot be rerun)")

    # ---- the MTP path ---------------------------------------------------------------------------
    def _mtp_fail(self, s: Slot, where: str, e: Exception) -> None:
        """MTP off for this slot (said once); its request goes on one token per window."""
        if self.proposer.fail(s.mtp, f"{where}: {e}"):
            self.log(f"strata batch: MTP {where} for slot {s.index} failed ({e}); "
                     f"MTP is off for this slot, its requests go on one token per window")
        self.fallbacks[f"mtp_{where}_failed"] += 1

    def _stop_fusing(self, slots: list[Slot], e: Exception) -> None:
        """A fused window failed (its caches went back to where it began): which slot's part
        failed is not known, so none loses MTP. Each stops fusing for the rest of its request and
        drafts through the proposer, one slot at a time where a batch fails (_proposals), so a
        draft that keeps failing turns MTP off for its own slot alone (_mtp_fail). The draft
        already holds the pending token's entry (the last window made it): the plain window's
        hiddens are kept for the normal catch-up from there (_keep_hidden)."""
        for s in slots:
            s.mtp.stop_fusing()
            self.fallbacks["fused_draft_failed"] += 1
        self.log(f"strata batch: a fused window failed for slots {', '.join(str(s.index) for s in slots)} ({e}); "
                 f"the window runs plain, these requests go on drafting without fusing")
