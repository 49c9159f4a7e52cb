"""When a front end hears of a window's events (strata/batch/delivery.py).

A listener (RequestHandle.listen: what the HTTP loop registers) is told of a window's events
once, together, when the next window's device work has been issued: after the forward on a
backend that issues asynchronously (CUDA), just before it on one that computes on the calling
thread (the CPU), and when nothing is left to run. The events themselves are queued at once.
Driven through the real scheduler on a tiny synthetic pack; the log records the model's
forward calls, the scheduler's apply of each window and every listener call in order.
"""

from __future__ import annotations

import pytest

from tests.support.engines import greedy, load_engine, request
from tests.support.model_fixtures import synth_model

PROMPTS = ([1, 17, 230, 45], [1, 300, 301, 302, 7, 8])
TOKENS = (5, 3)  # different lengths: one request ends while the other goes on


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return str(synth_model(tmp_path_factory.mktemp("delivery"), "llama"))


def traced_run(pack, issues_async: bool) -> tuple[list[tuple], list]:
    """Run both requests; returns (the log, the handles). Entries: ("F0",) forward begins,
    ("F1",) it returned, ("A",) a window's apply begins, ("N", i, queued) handle i's listener."""
    core, _ = load_engine(["--pack", pack, "--device", "cpu", "--parallel", "2"])
    sched = core.scheduler
    core.model.b.issues_async = issues_async  # (the CUDA order, on the CPU backend's arithmetic)
    log: list[tuple] = []
    forward = core.model.forward

    def traced_forward(*a, **k):
        log.append(("F0",))
        try:
            return forward(*a, **k)
        finally:
            log.append(("F1",))

    core.model.forward = traced_forward
    apply = sched._apply
    sched._apply = lambda entries, w: (log.append(("A",)), apply(entries, w))[1]
    handles = [core.submit(request(p, greedy(n, ignore_eos=True))) for p, n in zip(PROMPTS, TOKENS)]
    for i, h in enumerate(handles):
        h.listen(lambda i=i, h=h: log.append(("N", i, h.events.qsize())))
    sched.run_until_idle()
    return log, handles


def _neighbours(log: list[tuple]) -> list[tuple[str | None, str | None]]:
    """For each listener call: the entries before and after it that are not listener calls."""
    marks = [e[0] for e in log]
    out = []
    for j, e in enumerate(log):
        if e[0] != "N":
            continue
        before = next((m for m in reversed(marks[:j]) if m != "N"), None)
        after = next((m for m in marks[j + 1:] if m != "N"), None)
        out.append((before, after))
    return out


@pytest.mark.parametrize("issues_async", [True, False], ids=["async", "sync"])
def test_each_window_is_told_once_per_request_and_every_event_is_told(pack, issues_async):
    log, handles = traced_run(pack, issues_async)
    for i, (h, n) in enumerate(zip(handles, TOKENS)):
        told = [e[2] for e in log if e[0] == "N" and e[1] == i]
        # n tokens and the end: the last call sees all of them queued, none was left untold
        assert told and told[-1] == n + 1, (i, told)
        # a prefill window, then one decode window per token after the first: n windows put
        # events on this handle (the first token comes with the prefill) and each is told once
        assert len(told) == n, (i, told)
        assert told == sorted(told) and len(set(told)) == len(told), told  # each call brings new events


def test_an_async_backend_hears_after_the_next_forward_is_issued(pack):
    log, _ = traced_run(pack, issues_async=True)
    sides = _neighbours(log)
    # every call comes right after a forward returned (the next window's work is on the
    # device), or after the last window when nothing is left to run: never from inside an
    # apply, where the loop would take turns with the scheduler at the interpreter lock
    assert sides and all(before == "F1" for before, after in sides if after is not None), sides
    assert any(after == "A" for _, after in sides)  # (told between the forward and that window's apply)
    assert [after for _, after in sides].count(None) == 1  # the last window's, once idle


def test_a_sync_backend_hears_before_the_next_forward_runs(pack):
    log, _ = traced_run(pack, issues_async=False)
    sides = _neighbours(log)
    # the forward runs on the scheduler's own thread: the front end is told before it starts,
    # so its tokens do not wait a whole forward; the last window's are told when idle
    assert sides and all(after in ("F0", None) for _, after in sides), sides
    assert sum(1 for _, after in sides if after is None) == 1  # the longer request's last window
