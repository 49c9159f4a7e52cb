"""A request can only end itself; the scheduler cannot die silently (straight to the scheduler,
no HTTP; tests/test_engine_faults.py is the served side).

* What would fail inside a window is refused by EngineCore.submit with the field named: a seed
  outside [0, 2**64), a prompt token id outside the vocabulary.
* Anything that still fails ends that request alone, with an error event, and the loop goes on:
  a seed numpy refuses at admission, a token id the embedding cannot look up inside a shared
  window (its neighbour's tokens equal its solo run's), an exception in admission or in
  planning a window (STRATA_FAULT_INJECT points admit-raise, plan-raise), an exception inside
  the window's forward after the caches advanced (window-raise: the caches roll back, each
  request reruns alone).
* The watchdog: a window that hangs (hang@slot) makes liveness() say so, and a loop thread that
  dies past every guard is reported and answers later requests at once.
"""

from __future__ import annotations

import pytest

from strata.batch.faults import FaultInjector
from strata.protocol import FinishEvent, GenerationRequest, SamplingParams
from strata.errors import StrataError
from support.server_proc import wait_until
from tests.support.engines import greedy, load_engine, request
from tests.support.model_fixtures import synth_model

A = [1, 17, 230, 45, 99, 12]  # the neighbour that must keep its tokens
B = [1, 300, 301, 302, 7]
SAMPLED = dict(max_tokens=10, temperature=0.8, top_k=40, seed=7)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return str(synth_model(tmp_path_factory.mktemp("faults"), "llama"))  # vocab 1024


def engine(pack, parallel=2, faults=""):
    core, lines = load_engine(["--pack", pack, "--device", "cpu", "--parallel", str(parallel)])
    core.scheduler.faults = FaultInjector(faults)
    core.scheduler.log = lines.append
    return core, lines


def drive(core, windows: int) -> None:
    """Admit and run `windows` windows on this thread (what the loop does)."""
    for _ in range(windows):
        core.scheduler._admit()
        core.scheduler._guarded_step()


@pytest.fixture(scope="module")
def solo(pack):
    """Each prompt's tokens alone in the engine: greedy, and sampled with a seed."""
    core, _ = engine(pack, parallel=1)
    out = {}
    for name, prompt in (("A", A), ("B", B)):
        for kind, params in (("greedy", greedy(10)), ("sampled", SamplingParams(**SAMPLED))):
            h = core.scheduler.submit(request(prompt, params))
            core.scheduler.run_until_idle()
            out[name, kind] = h.collect(timeout=30)[0]
    return out


def test_submit_refuses_a_bad_seed_or_token_id_naming_it(pack):
    core, _ = engine(pack, parallel=1)
    for seed in (-1, 2**64, 1.5):
        with pytest.raises(StrataError, match=r"seed must be a whole number in \[0, 2\*\*64\)"):
            core.submit(request(A, SamplingParams(max_tokens=2, seed=seed)))
    core.submit(request(A, SamplingParams(max_tokens=2, seed=2**64 - 1)))  # the top of the range is fine
    for bad, at in (([1, 10**9], 1), ([-1, 2], 0), ([5, 6, 1024], 2)):
        with pytest.raises(StrataError, match=rf"prompt token id {bad[at]} at position {at} is outside "
                                              rf"the vocabulary \[0, 1024\)"):
            core.submit(request(bad, greedy(2)))


def test_a_seed_numpy_refuses_ends_that_request_and_the_next_is_served(pack, solo):
    core, lines = engine(pack, parallel=1)
    core.start()
    try:
        h = core.scheduler.submit(request(A, SamplingParams(max_tokens=4, seed=-1)))  # past submit's check
        ids, _, fin = h.collect(timeout=30)
        assert fin.reason == "error" and fin.code == "internal_error" and ids == []
        assert "the request's start" in fin.error and "ValueError" in fin.error
        nxt = core.submit(request(A, greedy(10)))
        assert nxt.collect(timeout=30)[0] == solo["A", "greedy"]
        assert core.scheduler.thread.is_alive() and core.liveness() == (True, None)
        assert sum("slot 0: the request's start failed" in ln for ln in lines) == 1
    finally:
        core.stop()


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_bad_token_id_in_a_shared_window_ends_only_its_request(pack, solo, kind):
    core, lines = engine(pack)
    params = greedy(10) if kind == "greedy" else SamplingParams(**SAMPLED)
    good = core.scheduler.submit(request(A, params))
    drive(core, 3)  # the neighbour is decoding when the bad request joins
    bad = core.scheduler.submit(GenerationRequest([1, 10**9], greedy(4)))  # past submit's check
    core.scheduler.run_until_idle()
    ids, _, fin = good.collect(timeout=30)
    assert fin.reason == "length" and ids == solo["A", kind]
    ids, _, fin = bad.collect(timeout=30)
    assert fin.reason == "error" and fin.code == "internal_error" and ids == []
    assert "IndexError" in fin.error and "the request's window" in fin.error
    assert sum("each runs alone" in ln for ln in lines) == 1


def test_a_window_that_raises_after_the_caches_advanced_ends_only_that_slot(pack, solo):
    core, lines = engine(pack, faults="window-raise@1")
    first = core.scheduler.submit(request(A, greedy(10)))  # slot 0
    drive(core, 2)
    second = core.scheduler.submit(request(B, SamplingParams(**SAMPLED)))  # slot 1: every window raises
    drive(core, 3)
    third = core.scheduler.submit(request(B, SamplingParams(**SAMPLED)))  # slot 1 again
    core.scheduler.run_until_idle()
    ids, _, fin = first.collect(timeout=30)
    assert fin.reason == "length" and ids == solo["A", "greedy"]  # the rolled-back window reran alone
    for h in (second, third):
        ids, _, fin = h.collect(timeout=30)
        assert fin.reason == "error" and fin.code == "internal_error" and ids == []
        assert "injected fault at window-raise for slot 1" in fin.error
    # slot 1 serves again once the fault is gone, from a clean cache
    core.scheduler.faults = FaultInjector("")
    h = core.scheduler.submit(request(B, SamplingParams(**SAMPLED)))
    core.scheduler.run_until_idle()
    assert h.collect(timeout=30)[0] == solo["B", "sampled"]


@pytest.mark.parametrize("point", ["admit-raise", "plan-raise"])
def test_an_exception_outside_the_window_ends_only_that_request(pack, solo, point):
    core, lines = engine(pack, faults=f"{point}@1")
    handles = [core.scheduler.submit(request(p, greedy(10))) for p in (A, B)]  # slots 0 and 1
    core.scheduler.run_until_idle()
    (ids0, _, fin0), (ids1, _, fin1) = (h.collect(timeout=30) for h in handles)
    assert fin0.reason == "length" and ids0 == solo["A", "greedy"]
    assert fin1.reason == "error" and fin1.code == "internal_error" and ids1 == []
    assert f"injected fault at {point} for slot 1" in fin1.error
    h = core.scheduler.submit(request(B, greedy(10)))  # slot 0, free again
    core.scheduler.run_until_idle()
    assert h.collect(timeout=30)[0] == solo["B", "greedy"]


def test_the_watchdog_reports_a_hung_window(pack, solo):
    core, lines = engine(pack, parallel=1, faults="hang@0")
    core.opts.watchdog_s = 0.3
    core.start()
    try:
        h = core.submit(request(A, greedy(10)))
        assert wait_until(lambda: not core.liveness()[0], 60), "the hung window was not noticed"
        alive, why = core.liveness()
        assert "a window has been running for" in why and "the watchdog allows 0.3 s" in why
        core.scheduler.faults.release()  # the window goes on: alive again, the request completes
        assert h.collect(timeout=30)[0] == solo["A", "greedy"]
        assert wait_until(lambda: core.liveness() == (True, None), 60)
    finally:
        core.scheduler.faults.release()
        core.stop()


class _Escape(BaseException):
    """Gets past `except Exception`, as nothing in the engine should."""


def test_a_loop_thread_that_dies_is_visible_and_ends_every_request(pack):
    core, lines = engine(pack, parallel=1)
    sch = core.scheduler

    def broken() -> None:
        raise _Escape("boom")

    sch._step_or_recover = broken
    core.start()
    running = sch.submit(request(A, greedy(4)))
    _, _, fin = running.collect(timeout=30)
    assert fin.reason == "error" and fin.code == "internal_error"
    assert fin.error == "the engine's scheduler stopped: _Escape: boom"
    assert wait_until(lambda: not sch.thread.is_alive(), 60)
    assert core.liveness() == (False, fin.error)
    later = core.submit(request(A, greedy(4))).events.get_nowait()  # answered by submit itself, not left waiting
    assert isinstance(later, FinishEvent) and later.reason == "error" and later.error == fin.error
    assert any("the engine's scheduler stopped: _Escape: boom" in ln and "Traceback" in ln for ln in lines)
