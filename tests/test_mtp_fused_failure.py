"""A failing fused window takes MTP from no innocent slot (--spec 1, greedy, STRATA_MTP_FUSED=1).

Fused drafting (strata/mtp/fused_window.py) drafts the next window of every fused slot inside
one forward, so when it fails, which slot's part failed is not known. The window then runs
plain with its drafts, and its fused slots stop fusing for the rest of their requests: they
keep MTP through the separate draft step, where a draft that keeps failing turns MTP off for
its own slot alone. A new request in such a slot fuses again.

On the `seed-moe` synthetic pack (an MTP draft) with --batch-mtp at two slots on the CPU: greedy
tokens equal plain decoding (--spec 0) and, after a fused window failed, each slot proposes the
drafts an engine that never fuses (STRATA_MTP_FUSED=0) proposes, window by window.
"""

from __future__ import annotations

import pytest

from strata.batch.faults import FaultInjector
from tests.support.engines import greedy, load_engine, request, shared_seed_moe

PROMPTS = [[1, 17, 230, 45, 99, 12], [1, 300, 301, 302, 7]]
LATER = [[1, 40, 41, 42], [1, 900, 17, 230, 5, 6, 7]]
MAX_TOKENS = 16
FAILED_LINE = "a fused window failed for slots"


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return shared_seed_moe(tmp_path_factory)


def _engine(pack, *mtp: str):
    core, lines = load_engine(["--pack", str(pack), "--device", "cpu", "--kv", "int8", "--parallel", "2", *mtp])
    core.scheduler.log = lines.append
    return core, lines


def _mtp_engine(pack, fused: bool, faults: FaultInjector | None = None):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_MTP_FUSED", "1" if fused else "0")
        core, lines = _engine(pack, "--mtp", str(pack / "mtp"), "--spec", "1", "--batch-mtp")
    assert core.scheduler.cfg.fused_drafts is fused and all(s.batch_mtp for s in core.scheduler.slots)
    if faults is not None:
        core.scheduler.faults = faults
    return core, lines


@pytest.fixture(scope="module")
def plain(pack):
    """Plain decoding's greedy tokens (--spec 0) of both rounds of prompts, two at a time."""
    core, _ = _engine(pack, "--spec", "0")
    assert core.scheduler.proposer is None
    return [_run(core, prompts)[0] for prompts in (PROMPTS, LATER)]


@pytest.fixture(scope="module")
def never_fused(pack):
    """The drafts each slot proposes, window by window, when no window fuses."""
    core, _ = _mtp_engine(pack, False)
    return _run(core, PROMPTS)


class _Once(FaultInjector):
    """A point that fires once, at its check number `skip` + 1, then is gone (a transient failure)."""

    def __init__(self, spec: str, skip: int = 0):
        super().__init__(spec)
        self.skip = skip

    def check(self, where, slot, backend=None):
        if (where, slot) in self.points and self.skip > 0:
            self.skip -= 1
            return
        try:
            super().check(where, slot, backend)
        except Exception:
            self.points.discard((where, slot))
            raise


class _Breaks(FaultInjector):
    """Slot 1's draft breaks in a fused window and stays broken: once mtp-fused@1 has fired,
    mtp-draft@1 fires at every draft (a failure first seen in the fused path, then in its own)."""

    def __init__(self):
        super().__init__("mtp-fused@1")

    def check(self, where, slot, backend=None):
        try:
            super().check(where, slot, backend)
        except Exception:
            self.points.add(("mtp-draft", 1))
            raise


def _run(core, prompts):
    """Both prompts at once, driven on this thread. -> (each request's tokens, the windows: per
    window {slot: (its drafts, whether the window fused it)})."""
    sch = core.scheduler
    windows: list[dict[int, tuple[list[int], bool]]] = []
    apply = sch._apply

    def recording(entries, window):
        windows.append({e.slot.index: (list(e.drafts), e.slot.index in window.fuse_at)
                        for e in entries if e.kind == "decode"})
        return apply(entries, window)

    sch._apply = recording
    try:
        served = _served(core, prompts)
    finally:
        del sch._apply
    return [ids for ids, _, _ in served], windows


def _served(core, prompts):
    """Both prompts at once (greedy), driven on this thread until both end. -> each request's
    (tokens, text, finish event)."""
    handles = [core.submit(request(p, greedy(MAX_TOKENS))) for p in prompts]
    core.scheduler.run_until_idle()
    return [h.collect(timeout=60) for h in handles]


def _drafts(windows, slot):
    return [w[slot][0] for w in windows if slot in w]


def _fused(windows, slot):
    return [w[slot][1] for w in windows if slot in w]


def test_a_fused_window_that_fails_once_keeps_mtp_on_for_its_slots(pack, plain, never_fused):
    # slot 0's part of the fused path fails once, in the 4th fused window
    core, lines = _mtp_engine(pack, True, _Once("mtp-fused@0", skip=3))
    sch = core.scheduler
    outs, windows = _run(core, PROMPTS)
    assert outs == plain[0] and never_fused[0] == plain[0]  # lossless
    for s in sch.slots:
        assert s.mtp_failed is None
        fused = _fused(windows, s.index)
        assert fused[:3] == [True] * 3 and not any(fused[3:]), fused  # the 4th ran plain, then no fusing ...
        drafts = _drafts(windows, s.index)
        assert len(drafts) > 8 and all(drafts[:-1]), str(drafts)  # ... but a draft in every window:
        # those of an engine that never fuses (the draft went on from where it stood)
        assert drafts == _drafts(never_fused[1], s.index)
    assert sch.fallbacks["fused_draft_failed"] == 2 and not any("mtp_" in k for k in sch.fallbacks), sch.fallbacks
    failed = [ln for ln in lines if FAILED_LINE in ln]
    assert len(failed) == 1 and "slots 0, 1 (injected fault at mtp-fused for slot 0)" in failed[0], lines


@pytest.mark.parametrize("how", ["fault-points", "draft-raises"])
def test_a_slot_whose_draft_keeps_failing_loses_mtp_alone(pack, plain, how):
    """Slot 1's draft breaks while both slots are fused (and stays broken): the fused window
    fails, both stop fusing, and slot 1's next own draft step fails: MTP goes off for slot 1
    only, slot 0 drafts on. `fault-points`: the scheduler's points (mtp-fused@1, then mtp-draft@1
    at every draft: _Breaks); `draft-raises`: the draft model raises whenever slot 1's draft cache
    is in its forward (the fused window, then the batched draft step of both slots, which then
    drafts one slot at a time)."""
    core, lines = _mtp_engine(pack, True)
    sch = core.scheduler
    handles = [core.submit(request(p, greedy(MAX_TOKENS))) for p in PROMPTS]
    for _ in range(4):  # the prompts' window, the draft step's window, then fused windows
        sch._admit()
        sch._guarded_step()
    assert all(s.mtp.next_draft is not None for s in sch.slots)  # both fused
    broken = sch.slots[1]
    if how == "fault-points":
        sch.faults = _Breaks()
    else:
        draft = sch.proposer.draft
        block_out = draft._block_out

        def failing(tokens, hidden, spans):
            if any(sp.cache is broken.mtp.cache for sp in spans):
                raise RuntimeError("slot 1's draft state is broken")
            return block_out(tokens, hidden, spans)

        draft._block_out = failing
    before = [s.counters.drafted for s in sch.slots]
    sch.run_until_idle()
    assert [h.collect(timeout=60)[0] for h in handles] == plain[0]  # (submitted above)
    assert sch.slots[0].mtp_failed is None and sch.slots[1].mtp_failed.startswith("draft: ")
    assert sch.slots[0].counters.drafted > before[0] + 3  # slot 0 drafted on
    assert sch.slots[1].counters.drafted == before[1] + 1  # (the failed fused window's, verified plain)
    off = [ln for ln in lines if "MTP is off for this slot" in ln]
    assert len(off) == 1 and "MTP draft for slot 1 failed" in off[0], lines
    assert sum(FAILED_LINE in ln for ln in lines) == 1


def test_a_new_request_in_a_slot_that_stopped_fusing_fuses_again(pack, plain):
    core, lines = _mtp_engine(pack, True, _Once("mtp-fused@1"))  # the first fused window fails
    sch = core.scheduler
    outs, windows = _run(core, PROMPTS)
    assert outs == plain[0]
    assert not any(fused for w in windows for _, fused in w.values())  # no window fused
    outs, windows = _run(core, LATER)  # the next requests in both slots
    assert outs == plain[1]
    for s in sch.slots:
        assert s.mtp_failed is None and not s.mtp.fused_failed
        fused = _fused(windows, s.index)
        assert len(fused) > 8 and all(fused), fused  # fused again, from their first decode window
    assert sum(FAILED_LINE in ln for ln in lines) == 1


def test_a_state_that_cannot_go_back_ends_its_request_and_the_fused_neighbour_keeps_mtp(pack, plain):
    """The fused window fails and slot 1's cache cannot be cut back to where the window began
    (as a recurrent state without a rollback copy, updated in place): that window is a failed
    window as before (slot 1's request ends, slot 0 reruns alone), and slot 0 keeps MTP."""
    from strata.model.state import StateLost

    core, lines = _mtp_engine(pack, True, _Once("mtp-fused@0", skip=2))
    sch = core.scheduler
    lost = sch.slots[1].cache
    truncate = lost.truncate

    def cut(n):
        if "mtp-fused" not in {p for p, _ in sch.faults.points}:  # (from the failing window on)
            raise StateLost("the state was updated in place")
        return truncate(n)

    lost.truncate = cut
    try:
        (ids0, _, fin0), (ids1, _, fin1) = _served(core, PROMPTS)
    finally:
        del lost.truncate
    assert ids0 == plain[0][0] and fin0.reason == "length"
    assert fin1.reason == "error" and "no rollback copy" in fin1.error and ids1 == plain[0][1][: len(ids1)]
    s0 = sch.slots[0]
    assert s0.mtp_failed is None and s0.counters.drafted >= MAX_TOKENS - 2  # it drafted every window
    assert sum(FAILED_LINE in ln for ln in lines) == 1
    assert sum("which has no rollback copy; the request ends, the others go on" in ln for ln in lines) == 1, lines
