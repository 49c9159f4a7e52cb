"""How `strata serve` stops on a signal: Ctrl-C (SIGINT), SIGTERM, CTRL_BREAK on Windows.

- The first signal starts the drain (strata.server.common.Drain): no new request is taken,
  running ones may finish for up to `shutdown_timeout`, then each is ended cleanly (a stream
  with a `shutting_down` error event and `[DONE]`, a waiting request with 503). It says at
  once, in one line, what the shutdown waits for, so a terminal never shows only `^C`.
- A second signal stops now: every request is ended at once, the same clean way, the engine
  is given FORCED_STOP_GRACE_S instead of its usual grace, and the exit code is 128 + the
  signal's number (130 for Ctrl-C), as a shell reports a process stopped by that signal.
  Whatever has still not ended after FORCED_REQUEST_GRACE_S (a client that stopped reading) is
  cancelled; those cancellations are not errors, so uvicorn's "Exception in ASGI application"
  traceback for them is dropped (QuietCancellations).
- A third Ctrl-C leaves it to uvicorn: it stops waiting for anything.

Only signal numbers and the event loop are used, nothing that exists on POSIX alone (process
groups), so the same holds on Windows, where Ctrl-C is SIGINT and CTRL_BREAK is SIGBREAK.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

FORCED_REQUEST_GRACE_S = 3.0  # after "stop now": time for the ended requests to send their last bytes
FORCED_STOP_GRACE_S = 2.0  # after "stop now": time for the engine to exit before it is killed
UVICORN_ERROR_LOGGER = "uvicorn.error"


class QuietCancellations(logging.Filter):
    """Drops log records about a task cancelled at shutdown: the server cancelled it on
    purpose, and a traceback per request would bury the lines that matter."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def _requests(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")


class ServeShutdown:
    """The signal callbacks of strata.server.serving.serve for a Supervisor and its app; both
    run on the event loop."""

    def __init__(self, sup: Any, app: Any, grace_s: float, log: Callable[[str], None]):
        self.sup, self.app, self.grace_s, self.log = sup, app, grace_s, log
        self.exit_code = 0
        quiet = logging.getLogger(UVICORN_ERROR_LOGGER)
        if not any(isinstance(f, QuietCancellations) for f in quiet.filters):
            quiet.addFilter(QuietCancellations())

    def first(self) -> None:
        running = self.sup.outstanding
        self.sup.drain.begin(self.grace_s)
        if running:
            self.log(f"strata serve: shutting down: waiting up to {self.grace_s:g} s for {_requests(running)} "
                     "to finish (Ctrl-C again to stop now)")
        else:
            self.log("strata serve: shutting down (no request is running)")

    def again(self, sig: int) -> None:
        self.exit_code = 128 + int(sig)
        running = self.sup.outstanding
        self.log(f"strata serve: stopping now: ending {_requests(running)}" if running else
                 "strata serve: stopping now")
        drain = self.sup.drain
        drain.begin(0.0)  # (no-op when the first signal began it)
        drain.expired.set()  # every relay and waiting request ends itself, cleanly
        self.sup.stop_grace_s = FORCED_STOP_GRACE_S
        asyncio.get_running_loop().call_later(FORCED_REQUEST_GRACE_S, self._cancel_the_rest)

    def _cancel_the_rest(self) -> None:
        """Requests that did not end by themselves (a client that no longer reads, an answer
        passed through from the engine) are cancelled: their connections close."""
        server = getattr(self.app.state, "uvicorn_server", None)
        for task in list(getattr(getattr(server, "server_state", None), "tasks", ())):
            task.cancel()
