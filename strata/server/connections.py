"""Bounds on the connections a server holds open, below the HTTP parser (uvicorn's h11 protocol).

Without them, connections that never finish their request head (slow-loris) are held forever:
uvicorn times out only idle keep-alive connections, and its `limit_concurrency` answers 503 only
to a request whose head has arrived. Enough such connections use up the process's file
descriptors; then no one is answered and every failed accept is logged with a traceback.

- header_timeout: a connection whose request head (request line and headers) is not complete
  this many seconds after it opened, or after the first byte of its next request, is answered
  408 and closed. (The body has its own limit: body_timeout, strata.server.common.read_body.)
- max_connections: while that many are open, a new connection is answered 503 and closed at
  once, so it costs a descriptor only for that moment (until what the client sent with it is
  read, REFUSE_LINGER_S at most; in a flood, past MAX_LINGERING such, it is just closed). The
  soft open-file limit is raised to the hard one, so that the cap and a batch of accepts fit
  under it; where they still do not, the cap is lowered, said in one line.
- Each condition is logged as one line at most every LOG_INTERVAL_S, with how many connections
  it concerned, never one line per connection; so is a failed accept, which asyncio would log
  with a traceback each time, many times per wake-up.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 512
LOG_INTERVAL_S = 10.0  # at most one line per condition in this time
LOG_BATCH_S = 0.5  # a first line waits this long, so that a burst is counted in it
FD_RESERVE = 64  # descriptors kept for everything but client connections (model files, pipes, the engine)
# A refused connection is closed once what the client sent is read (closing with unread bytes
# makes the kernel send a reset, which can destroy the 503 before the client reads it), or
# after this long at most
REFUSE_LINGER_S = 1.0
MAX_LINGERING = 64  # refused connections waiting so at once; beyond, one is closed at once (a flood)
# connections accepted per wake-up of the listening socket (uvicorn's `backlog`, also the
# listen queue): each is a descriptor before the protocol can refuse it
ACCEPT_BATCH = 256
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message (selector_events)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def _answer(status: int, reason: str, type_: str, code: str, message: str) -> bytes:
    """A whole HTTP answer, written before any request was parsed, then the connection closes."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class RateLimitedLine:
    """One log line for many events: the first waits LOG_BATCH_S, later ones until LOG_INTERVAL_S
    has passed since the last line; each line says how many events it covers."""

    def __init__(self, log: Callable[[str], None], render: Callable[[int], str],
                 interval_s: float = LOG_INTERVAL_S, batch_s: float = LOG_BATCH_S):
        self.log, self.render, self.interval_s, self.batch_s = log, render, interval_s, batch_s
        self.count = 0
        self._last = float("-inf")
        self._pending: asyncio.TimerHandle | None = None

    def hit(self) -> None:
        self.count += 1
        if self._pending is None:
            delay = max(self.batch_s, self._last + self.interval_s - time.monotonic())
            self._pending = asyncio.get_running_loop().call_later(delay, self._flush)

    def _flush(self) -> None:
        self._pending = None
        n, self.count = self.count, 0
        self._last = time.monotonic()
        if n:
            self.log(self.render(n))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _raise_open_file_limit() -> int | None:
    """The soft open-file limit after raising it to the hard one (as Go's runtime does at start;
    None: no such limit, e.g. on Windows, or an unlimited one)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    # an unlimited hard limit is refused by Linux (nr_open): then ask for a round number
    for target in ((hard,) if hard != resource.RLIM_INFINITY else ()) + (1 << 16,):
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                return target
            except (ValueError, OSError):
                continue
    return soft


def usable_connection_cap(wanted: int, log: Callable[[str], None], who: str) -> int:
    """`wanted`, or less when the process may not open that many files. Accepting works in
    batches (ACCEPT_BATCH connections at a time, before any of them can be refused), so in a
    flood the descriptors in use pass the cap for a moment: the soft open-file limit is raised
    to the hard one, for room beyond the cap, MAX_LINGERING and FD_RESERVE."""
    need = wanted + MAX_LINGERING + FD_RESERVE + ACCEPT_BATCH
    soft = _raise_open_file_limit()
    if soft is None or soft >= need:
        return wanted
    cap = max(1, soft - (need - wanted))
    log(f"{who}: max_connections lowered from {wanted} to {cap}: the open-file limit is {soft} (ulimit -n)")
    return cap


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, line: RateLimitedLine) -> None:
    """asyncio logs a traceback for each failed accept (out of descriptors or memory), up to
    its whole accept batch per wake-up: counted into one rate-limited line instead."""
    previous = loop.get_exception_handler()

    def handler(loop, context) -> None:
        if context.get("message") == ACCEPT_FAILED:
            line.hit()
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)
    loop.set_exception_handler(handler)


def guarded_protocol(limits: ConnectionLimits, log: Callable[[str], None], who: str) -> type:
    """uvicorn's h11 protocol with `limits` (a class for uvicorn.Config(http=...)); `who` starts
    the log lines ("strata serve")."""
    cap = usable_connection_cap(limits.max_connections, log, who)
    timeout = limits.header_timeout_s
    state: dict[str, RateLimitedLine] = {}  # made on first use: it needs the running loop
    lingering: set = set()  # refused connections not closed yet
    quieted: list = []  # the loop whose accept errors are counted (set on the first connection)

    def line(kind: str) -> RateLimitedLine:
        if kind not in state:
            render = {
                "refused": lambda n: (f"{who}: {cap} connections open, refusing new ones (max_connections = {cap}; "
                                      f"{_plural(n, 'connection')} refused)"),
                "slow": lambda n: (f"{who}: closed {_plural(n, 'connection')} that did not send a complete request "
                                   f"head within header_timeout = {timeout:g} s"),
                "accept": lambda n: (f"{who}: accepting a connection failed {_plural(n, 'time')}: out of file "
                                     "descriptors or memory (ulimit -n, max_connections)"),
            }[kind]
            state[kind] = RateLimitedLine(log, render)
        return state[kind]

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _between_requests = False  # a response ended; the next head has not begun
        _refused = False  # answered 503 at connect: what it sends is dropped, then it closes

        def connection_made(self, transport) -> None:
            if not quieted:
                quieted.append(self.loop)
                quiet_accept_errors(self.loop, line("accept"))
            over = len(self.connections) >= cap  # (this one is not in the set yet)
            super().connection_made(transport)
            if over:
                line("refused").hit()
                self._refused = True
                if len(lingering) >= MAX_LINGERING:
                    transport.close()  # no answer in a flood: descriptors come first
                    return
                lingering.add(self)
                transport.write(_answer(503, "Service Unavailable", "unavailable_error", "too_many_connections",
                                        f"the server holds {cap} connections, its limit (max_connections); "
                                        "retry later"))
                if transport.can_write_eof():
                    transport.write_eof()
                self._head_timer = self.loop.call_later(REFUSE_LINGER_S, transport.close)
                return
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                self.transport.close()  # its bytes are read: the close is a clean one
                return
            if self._between_requests:  # the first byte of the next request's head
                self._between_requests = False
                self._start_head_timer()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._stop_head_timer()  # its head is in

        def eof_received(self):
            if self._refused:
                self.transport.close()
            return super().eof_received()

        def on_response_complete(self) -> None:
            self._between_requests = True  # (idle time until the next head: uvicorn's keep-alive timeout)
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            lingering.discard(self)
            super().connection_lost(exc)

        def _start_head_timer(self) -> None:
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            line("slow").hit()
            self.transport.write(_answer(408, "Request Timeout", "request_timeout_error", "header_timeout",
                                         f"the request head did not arrive within header_timeout = {timeout:g} s"))
            self.transport.close()

    return GuardedH11Protocol
