"""Requests that reach a served engine together, whatever the client's timing.

A test whose requests must share a window (one fails in slot 1, the other goes on beside it)
cannot send them one after the other and hope the first is still running when the second
comes: on a loaded machine the client may be held up longer than the first request lasts, and
the second then takes the free slot 0. So the engine process is stopped (SIGSTOP) while the
requests are sent, and let go (SIGCONT) once `strata serve` has taken every one of them in:
the engine then reads them together, and the one it starts second finds the first still to
run, as long as each request runs longer than the engine takes to read an HTTP request.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable

from support.server_proc import StrataProcess, metric, wait_until

IN_FLIGHT = "strata_server_requests_in_flight"  # requests `strata serve` holds an engine slot for


def send_together(server: StrataProcess, senders: list[Callable[[], Any]], timeout: float = 120.0) -> list[Any]:
    """Run each sender (a blocking call: a request and its whole answer) on its own thread while
    the server's engine is stopped; the engine goes on once the server holds them all. Returns
    what each sender returned, in order (an exception a sender raised is raised here)."""
    engine = server.engine_pids()[-1]
    before = metric(server.url, IN_FLIGHT)
    out: list[Any] = [None] * len(senders)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = senders[i]()
        except BaseException as e:  # (re-raised on the test's thread below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(senders))]
    os.kill(engine, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        # a guard against a hang only: the server forwards each request as it comes
        assert wait_until(lambda: metric(server.url, IN_FLIGHT) >= before + len(senders), 60, 0.1), \
            "the server did not take the requests in"
    finally:
        os.kill(engine, signal.SIGCONT)
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a request got no answer"
    if errors:
        raise errors[0]
    return out
