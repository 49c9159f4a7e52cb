"""End to end: the config's request_timeout (504, the slot freed, the server serving on) and
startup_timeout (an engine slower to load than allowed is stopped; requests get 503)."""

from __future__ import annotations

import signal
import time

import pytest

from support.server_proc import HTTP, pid_alive, start_serve, wait_until

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

REQUEST_TIMEOUT_S = 3.0


def _slots_busy(url: str) -> float:
    for line in HTTP.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("strata_slots_busy "):
            return float(line.split()[1])
    return -1.0


def test_request_timeout_gives_504_and_frees_the_slot(tmp_path):
    # 3 s: long enough for the short request below on a loaded 2-core machine, far shorter than
    # 2000 tokens take anywhere
    p = start_serve(tmp_path, {"parallel": 1, "request_timeout": REQUEST_TIMEOUT_S, "args": ["--max-context", "2048"]})
    try:
        p.wait_healthy()
        t0 = time.monotonic()
        r = HTTP.post(p.url + "/v1/completions", timeout=120,
                      json={"prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True})
        elapsed = time.monotonic() - t0
        # the limit ended it (its 504 says so), and not before the limit ran out
        assert r.status_code == 504, r.text
        assert "request_timeout" in r.json()["error"]["message"]
        assert elapsed >= REQUEST_TIMEOUT_S, elapsed
        # the timed-out request's slot is freed (the engine notices the dropped request; a guard
        # against a hang only)...
        assert wait_until(lambda: _slots_busy(p.url) == 0, 60), "the timed-out request kept its slot"
        # ...and serves again: a short request gets its tokens
        r2 = HTTP.post(p.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] >= 1
        assert p.stop(signal.SIGTERM) == 0
    finally:
        p.kill_tree()


def test_startup_timeout_stops_a_slow_engine(tmp_path):
    p = start_serve(tmp_path, {"startup_timeout": 0.2, "args": ["--max-context", "256"]})
    try:
        r = HTTP.post(p.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503
        assert "did not become ready within 0.2 s" in r.json()["error"]["message"]
        pids = p.engine_pids()
        # (a guard against a hang only)
        assert pids and wait_until(lambda: not pid_alive(pids[0]), 60), "the slow engine was left running"
        assert p.stop(signal.SIGTERM) == 0
    finally:
        p.kill_tree()
