"""Ctrl-C on `strata serve` while a stream runs, with real child processes: the first SIGINT
says at once what the shutdown waits for, and the stream ends with a `shutting_down` event and
`[DONE]` when the grace period runs out (exit 0); a second SIGINT ends it at once, just as
cleanly, with no traceback and exit code 130."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
import threading

import pytest

from strata.server.shutdown import UVICORN_ERROR_LOGGER, ServeShutdown
from support.early import Early, selected
from support.server_proc import HTTP, StrataProcess, spawn_serve

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="sends POSIX SIGINT to a child process")

GRACE_S = 2.0  # the first test's shutdown_timeout: the stream outlives it
LONG_GRACE_S = 600.0  # the second test's: only the second Ctrl-C can end the stream in time
WAIT_S = 120.0  # bounds for events that come in well under a second on an idle machine
WAITING_LINE = r"strata serve: shutting down: waiting up to {grace} s for 1 request to finish \(Ctrl-C again to stop now\)"


def _config(grace: float) -> dict:
    return {"parallel": 1, "shutdown_timeout": grace, "args": ["--max-context", "2048"]}


@pytest.fixture(scope="module", autouse=True)
def early(request, tmp_path_factory):
    """Both servers load their model while the other test runs."""
    e = Early()
    try:
        for name, grace in (("test_one_ctrl_c_says_what_it_waits_for_and_ends_the_stream_cleanly", GRACE_S),
                            ("test_a_second_ctrl_c_stops_now_cleanly_with_exit_code_130", LONG_GRACE_S)):
            if selected(request, name):
                e.start(name, lambda grace=grace: spawn_serve(tmp_path_factory.mktemp("sigint"), _config(grace)))
        yield e
    finally:
        e.close()


class _Stream:
    """A long completion stream read on a thread: its events, in order."""

    def __init__(self, server: StrataProcess):
        self.events: list[str] = []
        self.started = threading.Event()
        self.ended = threading.Event()
        self.error: BaseException | None = None
        body = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(server.url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e
        finally:
            self.started.set()
            self.ended.set()

    def assert_ended_cleanly(self) -> None:
        assert self.ended.wait(WAIT_S), "the stream did not end"
        assert self.error is None, repr(self.error)
        assert self.events[-1] == "[DONE]", self.events[-3:]
        assert json.loads(self.events[-2])["error"]["code"] == "shutting_down", self.events[-3:]


def _serving(early: Early, name: str) -> StrataProcess:
    p = early.take(name, lambda: None)
    p.wait_listening()
    p.wait_healthy()
    return p


def _assert_clean(output: str) -> None:
    for bad in ("Traceback", "ERROR", "Exception in ASGI application", "CancelledError"):
        assert bad not in output, output


def test_one_ctrl_c_says_what_it_waits_for_and_ends_the_stream_cleanly(early):
    p = _serving(early, "test_one_ctrl_c_says_what_it_waits_for_and_ends_the_stream_cleanly")
    try:
        stream = _Stream(p)
        assert stream.started.wait(WAIT_S) and stream.error is None, repr(stream.error)
        start = len(p.lines)
        p.proc.send_signal(signal.SIGINT)
        p.wait_line(WAITING_LINE.format(grace=f"{GRACE_S:g}"), WAIT_S, start)
        stream.assert_ended_cleanly()
        assert p.proc.wait(WAIT_S) == 0
        _assert_clean(p.output())
        # said at once: the server wrote it before the stream's access line, which it writes when
        # the stream has ended (the order of one process's output, not a race between two)
        lines = p.lines[start:]
        said = next(i for i, line in enumerate(lines) if re.search(WAITING_LINE.format(grace=f"{GRACE_S:g}"), line))
        ended = next(i for i, line in enumerate(lines) if line.startswith("strata serve: POST /v1/completions 200"))
        assert said < ended, lines
    finally:
        p.kill_tree()


def test_a_second_ctrl_c_stops_now_cleanly_with_exit_code_130(early):
    p = _serving(early, "test_a_second_ctrl_c_stops_now_cleanly_with_exit_code_130")
    try:
        stream = _Stream(p)
        assert stream.started.wait(WAIT_S) and stream.error is None, repr(stream.error)
        start = len(p.lines)
        p.proc.send_signal(signal.SIGINT)
        p.wait_line(WAITING_LINE.format(grace=f"{LONG_GRACE_S:g}"), WAIT_S, start)
        p.proc.send_signal(signal.SIGINT)
        p.wait_line(r"strata serve: stopping now: ending 1 request$", WAIT_S, start)
        stream.assert_ended_cleanly()  # well before the 600 s grace period
        assert p.proc.wait(WAIT_S) == 128 + signal.SIGINT
        _assert_clean(p.output())
        assert "strata serve: stopped" in p.output()
    finally:
        p.kill_tree()


def test_cancelled_requests_leave_no_asgi_traceback():
    """uvicorn logs "Exception in ASGI application" with the exception of a request's task; for
    one cancelled at shutdown that is no error, and a traceback per request is what a double
    Ctrl-C used to print. Other exceptions are still logged."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    logger.addHandler(handler)
    try:
        ServeShutdown(sup=None, app=None, grace_s=1.0, log=print)  # installs the filter
        for exc in (asyncio.CancelledError(), RuntimeError("a real bug")):
            try:
                raise exc
            except BaseException as e:  # noqa: BLE001
                logger.error("Exception in ASGI application\n", exc_info=e)
    finally:
        logger.removeHandler(handler)
    assert [type(r.exc_info[1]).__name__ for r in records] == ["RuntimeError"]
