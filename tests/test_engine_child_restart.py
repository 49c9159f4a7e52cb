"""The supervisor restarts its engine child by itself: a load balancer that routes only to
healthy backends sends no request to an unhealthy one, so /health must become ok again with
no request; and once a restarted engine is ready, /health forgets why an earlier start failed."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import pytest

from support.server_proc import HTTP, spawn_serve, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, POSIX signals")


def engine_child(server_pid: int) -> int | None:
    """The server's engine child, seen in /proc as soon as it exists (before it can be ready)."""
    from pathlib import Path

    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == server_pid and b"engine" in cmdline:
            return int(stat.parent.name)
    return None


def poll(url: str, bodies: list[dict]) -> int:
    """/health's status; its body appended to `bodies`."""
    try:
        r = HTTP.get(url + "/health", timeout=5)
    except httpx.HTTPError:
        return 0
    bodies.append(r.json())
    return r.status_code


def test_health_recovers_without_requests_and_forgets_an_old_failure(tmp_path):
    p = spawn_serve(tmp_path, {"parallel": 1, "args": ["--max-context", "256"]})
    try:
        # the first engine is stopped as soon as it exists, then killed: a failed start
        found: list[int] = []
        assert wait_until(lambda: bool(found.append(engine_child(p.proc.pid)) or found[-1]), 30, 0.002)
        first = found[-1]
        os.kill(first, signal.SIGSTOP)
        p.wait_listening()
        os.kill(first, signal.SIGKILL)
        p.wait_line(r"the engine could not start: it exited with code -9")
        # no request is sent: the supervisor starts the next engine itself, after its back-off
        seen: list[dict] = []
        assert wait_until(lambda: poll(p.url, seen) == 200, 120, 0.2), seen[-3:]
        assert any("could not start" in json.dumps(b) for b in seen)  # (it said why, while it was true)
        pids = p.engine_pids()
        assert len(pids) == 2 and pids[0] == first
        # the ready engine dies: /health tells what happens now, not the old failure, and
        # becomes ok again by itself
        os.kill(pids[1], signal.SIGKILL)
        after: list[dict] = []
        assert wait_until(lambda: poll(p.url, after) != 200, 30, 0.05), "the death was never seen"
        assert wait_until(lambda: poll(p.url, after) == 200, 120, 0.2), after[-3:]
        assert not any("could not start" in json.dumps(b) for b in after), after
        assert len(p.engine_pids()) == 3
    finally:
        p.kill_tree()


def test_ready_engines_that_die_soon_in_a_row_wait_out_the_back_off():
    """The monitor's restart policy: one quick death is restarted at once, more in a row wait
    1, 2, 4 ... s (as failed starts do); an engine that served STABLE_S resets the count."""
    from types import SimpleNamespace

    from strata.server.config import ServerConfig
    from strata.server.supervisor import BACKOFF_S, STABLE_S, Supervisor

    sup = Supervisor(ServerConfig(), log=lambda line: None)
    waits = []
    for ready_for in (1.0, 1.0, 1.0, STABLE_S + 1.0, 1.0):
        now = time.monotonic()
        sup._after_death(SimpleNamespace(ready_at=now - ready_for))
        waits.append(max(0.0, sup.retry_at - now))
    assert waits[0] == 0.0 and waits[3] <= waits[2]
    assert abs(waits[1] - BACKOFF_S[0]) < 0.5 and abs(waits[2] - BACKOFF_S[1]) < 0.5
    assert sup.quick_deaths == 1  # (counted again from the engine that had served long enough)
