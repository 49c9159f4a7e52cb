"""End to end: `strata serve` supervising a real engine child: the engine killed mid-stream
and while requests wait, a pack that cannot start (refused before any engine), SIGTERM and
SIGKILL of the server."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

import httpx
import pytest

from strata.server.supervisor import DIED_MESSAGE, SHUTDOWN_MESSAGE, WAITED_MESSAGE
from support.server_proc import HTTP, ROOT, metric, pid_alive, start_serve, wait_until

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

LONG = {"prompt": "Write a long story about a cat.", "max_tokens": 400, "ignore_eos": True}
SHUTDOWN_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = {"parallel": 1, "max_queued": 1, "args": ["--max-context", "512"], "shutdown_timeout": SHUTDOWN_TIMEOUT_S}
    p = start_serve(tmp_path_factory.mktemp("sup"), cfg)
    try:
        p.wait_healthy()
        yield p
    finally:
        p.kill_tree()


class StreamReader(threading.Thread):
    """A streaming request read on a thread; `first` is set once text arrived (after
    `on_first`, called on this thread as the first text is read)."""

    def __init__(self, url: str, body: dict, on_first: Callable[[], None] | None = None):
        super().__init__(daemon=True)
        self.url, self.body, self.on_first = url, {**body, "stream": True}, on_first
        self.events: list[str] = []
        self.texts: list[float] = []  # when each event with text arrived
        self.first = threading.Event()
        self.status = 0

    def run(self) -> None:
        with HTTP.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    if '"text":"' in line and '"text":""' not in line:
                        self.texts.append(time.monotonic())
                        if not self.first.is_set() and self.on_first is not None:
                            self.on_first()
                        self.first.set()
        self.first.set()


def post_on_thread(url: str, body: dict, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(HTTP.post(url + "/v1/completions", json=body, timeout=120)),
                         daemon=True)
    t.start()
    return t


def current_engine(server) -> int:
    return server.engine_pids()[-1]


def test_engine_killed_mid_stream_and_while_a_request_waits(server):
    restarts0 = metric(server.url, "strata_server_engine_restarts_total")
    pid = current_engine(server)
    # the engine is stopped (SIGSTOP) as the stream's first text is read, so the stream is still
    # running when the engine is killed, however slowly this client goes on; `strata serve` takes
    # in, queues and refuses requests without the engine (and kills a stopped one only after its
    # /health misses several answers, far longer than the steps below take)
    stream = StreamReader(server.url, LONG, on_first=lambda: os.kill(pid, signal.SIGSTOP))
    stream.start()
    assert stream.first.wait(60) and stream.status == 200
    waited: list[httpx.Response] = []
    t = post_on_thread(server.url, {"prompt": "Hi", "max_tokens": 2}, waited)
    # (a guard against a hang only)
    assert wait_until(lambda: metric(server.url, "strata_server_queue_depth") == 1, 60), "not queued"
    # one running + one waiting is the bound (parallel 1, max_queued 1): a third is turned away
    r = HTTP.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert stream.is_alive() and "[DONE]" not in stream.events, "the stream ended before the engine was killed"
    os.kill(pid, signal.SIGKILL)
    stream.join(60)
    t.join(60)
    # the stream that had begun ends with an error event, then [DONE]
    assert stream.events[-1] == "[DONE]"
    err = json.loads(stream.events[-2])["error"]
    assert err["message"] == DIED_MESSAGE.format(code=-signal.SIGKILL) and err["type"] == "server_error"
    # the request that waited was never sent
    assert waited[0].status_code == 503
    assert waited[0].json()["error"] == {"message": WAITED_MESSAGE, "type": "server_error", "param": None,
                                         "code": "engine_stopped"}
    assert HTTP.get(server.url + "/health").status_code == 503
    # the engine is restarted and the next request is served
    r = HTTP.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert current_engine(server) != pid and not pid_alive(pid)
    assert metric(server.url, "strata_server_engine_restarts_total") == restarts0 + 1


def test_engine_killed_during_a_plain_request(server):
    out: list[httpx.Response] = []
    t = post_on_thread(server.url, LONG, out)
    assert wait_until(lambda: metric(server.url, "strata_slots_busy") == 1, 30), "never started"
    os.kill(current_engine(server), signal.SIGKILL)
    t.join(30)
    assert out[0].status_code == 503
    err = out[0].json()["error"]
    assert err["message"] == DIED_MESSAGE.format(code=-signal.SIGKILL) and err["type"] == "server_error"
    r = HTTP.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200


def outliving(server, seconds: float) -> dict:
    """LONG with max_tokens for 3 times what this engine streams in `seconds` (the rate measured
    here, on a short stream of the same request, between its first and last token): a stream
    that still runs `seconds` after its first text. (The engine finishes a request that the
    stopping server ended before it exits, so every token past that is waited for.)"""
    n = 24
    probe = StreamReader(server.url, {**LONG, "max_tokens": n})  # (ignore_eos: n tokens)
    probe.start()
    probe.join(120)
    assert probe.status == 200 and len(probe.texts) >= 2, probe.events[-3:]
    rate = (n - 1) / max(probe.texts[-1] - probe.texts[0], 1e-3)  # tokens per second after the first
    return {**LONG, "max_tokens": min(LONG["max_tokens"], max(96, math.ceil(3 * rate * seconds)))}


def test_sigterm_ends_a_running_stream_cleanly_and_leaves_nothing(server):
    # running past shutdown_timeout after its first text (and the SIGTERM sent at once after it)
    stream = StreamReader(server.url, outliving(server, SHUTDOWN_TIMEOUT_S + 0.5))
    stream.start()
    assert stream.first.wait(60)
    pids = server.engine_pids()
    assert server.stop(signal.SIGTERM) == 0
    stream.join(30)
    # the stream ended with an error event and [DONE] once shutdown_timeout ran out
    assert stream.events[-1] == "[DONE]"
    assert json.loads(stream.events[-2])["error"]["message"] == SHUTDOWN_MESSAGE
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10), "engine left behind"


def test_sigkill_of_the_server_takes_the_engine_down(tmp_path):
    p = start_serve(tmp_path, {"args": ["--max-context", "256"]})
    try:
        p.wait_line(r"engine pid \d+ starting")
        pid = p.engine_pids()[0]
        p.proc.kill()
        p.proc.wait(10)
        assert wait_until(lambda: not pid_alive(pid), 15), "orphaned engine"
    finally:
        p.kill_tree()


def test_an_engine_that_refuses_to_start(tmp_path):
    # a user error stops strata serve at once, one line and exit 2, before any engine starts
    # (restarts of an engine that had served keep the back-off: tests/test_cli_user_errors.py)
    missing = tmp_path / "no-such-pack"
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({"args": ["--pack", str(missing)]}))
    done = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--config", str(cfg), "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"strata: {cfg}: args: pack {missing}: no such file or directory"]
