"""Run an ASGI app with uvicorn on a socket we bind ourselves, with our own signal handling.

- We bind the socket first, so a busy port is one StrataError line and port 0 tells us the
  real port before serving.
- SIGTERM / SIGINT (and CTRL_BREAK on Windows) start a drain: `on_signal()` is called once,
  the listening socket closes, running requests finish (or are ended by the app when its
  grace period runs out), then the process exits with 0. uvicorn's own handler would
  re-raise the signal after shutdown (exit by signal, not 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from typing import Callable

import uvicorn

from strata.errors import StrataError

SHUTDOWN_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGBREAK") if hasattr(signal, name))


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # protocol says TCP, and accepted connections inherit it. With Nagle on, a stream's small
    # writes wait for the peer's delayed ACK (40 ms on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if hasattr(socket, "SO_REUSEADDR") and not hasattr(socket, "SO_EXCLUSIVEADDRUSE"):
        # POSIX: allow quick restarts (TIME_WAIT); on Windows SO_REUSEADDR would allow port theft
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None] | None,
                 on_again: Callable[[int], None] | None = None):
        super().__init__(config)
        self._on_signal = on_signal
        self._on_again = on_again
        self._signalled = False
        self._again = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._signalled and self._on_again is not None and not self._again and self._loop is not None:
            self._again = True  # a second signal: the app ends its requests now (a third: as below)
            self._loop.call_soon_threadsafe(self._on_again, sig)
            return
        if self._signalled and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        if not self._signalled and self._on_signal is not None and self._loop is not None:
            # a signal handler may interrupt the loop anywhere: hand the work to the loop
            self._loop.call_soon_threadsafe(self._on_signal)
        self._signalled = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(app, sock: socket.socket, *, on_signal: Callable[[], None] | None = None,
          on_again: Callable[[int], None] | None = None, graceful_timeout_s: float | None = None,
          log_level: str = "warning", http_protocol: type | None = None, backlog: int = 2048) -> None:
    """Serve until a shutdown signal (or `server.should_exit`); returns after a clean shutdown.
    `on_signal` runs once on the event loop when the first shutdown signal arrives, and
    `on_again(signal number)` once when a second one does (without it a second Ctrl-C stops
    waiting for running requests). `http_protocol`: uvicorn's HTTP protocol class to use instead
    of its default (strata.server.connections.guarded_protocol); `backlog`: the listen queue, and
    how many connections are accepted per wake-up."""
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=graceful_timeout_s, timeout_keep_alive=5, backlog=backlog,
                            **({"http": http_protocol} if http_protocol is not None else {}))
    server = _Server(config, on_signal, on_again)
    app.state.uvicorn_server = server
    server.run(sockets=[sock])


def request_exit(app) -> None:
    """Ask the uvicorn server running `app` to stop (from any thread)."""
    server = getattr(app.state, "uvicorn_server", None)
    if server is not None:
        server.should_exit = True
