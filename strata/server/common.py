"""HTTP pieces shared by the engine's API app and the `strata serve` proxy (the API key is checked by edge.py):
bounded and timed body reading, a small thread pool for request preparation, OpenAI-shaped
error handlers, draining on shutdown."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata.server.errors import APIError, error_for_status

# Past the limit the body is read and dropped (so the client sees our 413, not a reset
# connection) up to this many bytes; beyond that the connection is simply answered and closed.
DISCARD_LIMIT = 64 * 1024 * 1024
BODY_TIMEOUT_S = 30.0  # default time for a request body to arrive once its headers have
PREPARE_THREADS = 2  # threads that parse, validate, template and tokenize request bodies
INLINE_BODY_BYTES = 2048  # bodies up to this size are parsed on the event loop (~0.1 ms)
MAX_PREPARE_JOBS = 64  # jobs waiting for or running on those threads; more are refused (429)


async def read_body(request: Request, limit: int, timeout: float | None = BODY_TIMEOUT_S) -> bytes:
    """The whole body, at most `limit` bytes (413 past it), within `timeout` seconds (408 and
    the connection closed: a client that declares more than it sends must not hold a handler)."""
    declared = request.headers.get("content-length", "")
    too_large = APIError("request_too_large_error", f"the request body is larger than {limit} bytes",
                         code="request_too_large", headers={"connection": "close"})
    if declared.isdigit() and int(declared) > DISCARD_LIMIT:
        raise too_large
    chunks: list[bytes] = []
    size = 0

    async def receive_all() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DISCARD_LIMIT:
                break

    try:
        await asyncio.wait_for(receive_all(), timeout if timeout and timeout > 0 else None)
    except ClientDisconnect:
        # the connection ended inside the body (or its framing was broken): nobody reads this
        # answer, but it must not be logged as an internal error
        raise APIError("invalid_request_error", "the request body ended before it was complete",
                       code="incomplete_body", headers={"connection": "close"}) from None
    except asyncio.TimeoutError:
        raise APIError("request_timeout_error", f"the request body did not arrive within body_timeout = {timeout:g} s",
                       code="body_timeout", headers={"connection": "close"}) from None
    if size > limit:
        raise too_large
    return b"".join(chunks)


class Preparer:
    """Work whose cost grows with a request (parsing a big body, templating, tokenizing,
    rendering a big answer) runs here, on a few threads of its own, never on the event loop:
    the loop answers /health and writes every stream's tokens, and a request that took it for
    seconds would stall all of them (and get the engine restarted by strata serve's health
    watch). At most `max_jobs` jobs wait or run at once; past that a request is refused with
    429 rather than queued without bound (each job holds its body).

    Only work that a small body bounds (parsing it, a small /tokenize) runs on the loop: its cost
    is bounded by `inline_bytes`, and it is less than the hand-over to a thread, which waits for
    the GIL while the engine's thread holds it."""

    def __init__(self, threads: int = PREPARE_THREADS, inline_bytes: int = INLINE_BODY_BYTES,
                 max_jobs: int = MAX_PREPARE_JOBS):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="strata-prepare")
        self.inline_bytes = inline_bytes
        self.max_jobs = max_jobs
        self.jobs = 0  # waiting for a thread or running

    async def run(self, size: int, fn, *args):
        """fn(*args) on the loop when `size` (the body's bytes) is small, else on the pool. Only
        for work that the body's size bounds (parsing it): anything else goes to off_loop."""
        if size <= self.inline_bytes:
            return fn(*args)
        return await self.off_loop(fn, *args)

    async def off_loop(self, fn, *args, answer: bool = False):
        """fn(*args) on the pool, whatever the body's size (templating a 2 KiB body may take the
        template's whole time limit). `answer`: rendering the answer of work already done, which
        is never refused (a request is refused before its work, not after)."""
        if self.jobs >= self.max_jobs and not answer:
            raise APIError("rate_limit_error", f"too many requests are being prepared (limit {self.max_jobs}); "
                           "retry later", code="busy")
        self.jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.jobs -= 1

    async def cancellable(self, request: Request, size: int, fn, *args):
        """fn(cancel, *args) on the pool, `cancel` (a threading.Event) set when the client goes
        away: fn looks at it between chunks of its work and stops (raising Cancelled), so an
        abandoned request stops spending CPU. Returns fn's result, or a 499 answer that nobody
        reads (the access log shows it). Work whose cost the body's `size` bounds runs on the
        loop when that is small, as run() does."""
        cancel = threading.Event()
        if size <= self.inline_bytes:
            return fn(cancel, *args)

        def job():
            if cancel.is_set():  # the client left while the job waited for a thread
                raise Cancelled()
            return fn(cancel, *args)

        work = asyncio.ensure_future(self.off_loop(job))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                cancel.set()
                work.add_done_callback(_ignore_outcome)  # (it raises Cancelled, or finishes unread)
        if work.done():
            return work.result()
        return Response(status_code=499)


class Cancelled(Exception):
    """Raised by prepared work that saw its cancel flag: its client has gone."""


def json_bytes(obj) -> bytes:
    """`obj` as JSON, byte for byte as FastAPI's JSONResponse writes it: for answers rendered on
    the preparing threads (a big one takes seconds, which the event loop must not spend)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def json_answer(obj) -> Response:
    return Response(json_bytes(obj), media_type="application/json")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (call after the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `cleanup`, even when the client leaves before the
    body iterator started (then the iterator's own `finally` never runs)."""

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def install_error_handlers(app: FastAPI, log=None) -> None:
    async def api_error(_request: Request, exc: APIError):
        return exc.response()

    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_for_status(exc.status_code, message).response(headers=getattr(exc, "headers", None))

    async def unexpected(_request: Request, exc: Exception):
        (log or _stderr)("strata: internal error:\n" + "".join(traceback.format_exception(exc)).rstrip())
        return APIError("server_error", f"internal error: {type(exc).__name__}: {exc}").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Drain:
    """Shutdown in two steps: `begin(grace)` refuses new work at once; when the grace period
    ends, `expired` is set and whatever is still running is ended cleanly."""

    def __init__(self):
        self.draining = False
        self.expired = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def begin(self, grace_s: float) -> None:
        if self.draining:
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(grace_s, 0.0), self.expired.set)

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError("unavailable_error", "the server is shutting down", code="shutting_down")


async def first_of(awaitable, events: dict[str, asyncio.Event], timeout: float | None = None):
    """Await `awaitable`, unless one of `events` fires first or `timeout` passes.

    Returns ("done", result) or (event name, None) or ("timeout", None). The awaitable is
    cancelled when it loses. Exceptions of the awaitable propagate."""
    task = asyncio.ensure_future(awaitable)
    waiters = {asyncio.ensure_future(ev.wait()): name for name, ev in events.items()}
    try:
        done, _ = await asyncio.wait({task, *waiters}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        for w in waiters:
            w.cancel()
    if task in done:
        return "done", task.result()
    task.add_done_callback(_ignore_outcome)  # the loser's outcome does not matter
    task.cancel()
    for w, name in waiters.items():
        if w in done:
            return name, None
    return "timeout", None


def _ignore_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
