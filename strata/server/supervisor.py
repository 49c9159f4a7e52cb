"""`strata serve`: run the engine as a child process and proxy the API to it.

Life cycle of the engine child:
- started when the server starts, with a new key on its stdin; it binds a free port and reports
  it on its stdout; nothing is sent before that report, and each connection first has the child
  prove it holds its key (strata/server/child_handshake.py); /health is 503 until the child's
  /health says ok;
- the first child exiting with code 2 before it is ready is a user error (bad pack, bad flag:
  the child's `strata: <reason>` line): the server stops with that line and exit code 2, since
  no restart can mend it (most such errors are caught before the spawn: config.check_engine_start);
- any other child that exits before it is ready (a crash while loading, startup_timeout, or a
  user error on a restart after an engine had served) makes requests fail with 503 and that
  reason; the next start waits out a growing back-off (1 s, 2 s, 4 s ... 60 s), so nothing spins;
- a child that dies while serving: requests it was running end with 503 ("stopped
  unexpectedly"), requests queued here end with 503 ("was not sent");
- the supervisor starts the next child itself (at once after a crash, after the back-off after
  a failed start), or a request does if it comes first;
- SIGTERM/SIGINT of the server: stop accepting, say what is waited for, let running requests
  finish (up to `shutdown_timeout`, then end them cleanly), stop the child, exit 0; a second
  signal ends them all at once, cleanly, and exits with 128 + its number (strata.server.shutdown).

The queue lives here: at most `parallel` requests are sent to the child at once, at most
`max_queued` wait; more get 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import signal
import sys
import threading
import time
from typing import Any, AsyncIterator, Callable
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from strata.errors import StrataError
from strata.server import sse
from strata.server.common import (ClosingStreamingResponse, Drain, Preparer, first_of, install_error_handlers, read_body,
                                  wait_for_disconnect)
from strata.server.config import ServerConfig
from strata.server.connections import ACCEPT_BATCH, ConnectionLimits, guarded_protocol
from strata.server.edge import EdgeMiddleware, EdgePolicy
from strata.server.app import ACCESS_KEY, USAGE_TRAILER, USAGE_TRAILER_HEADER, AccessLog, AccessRecord
from strata.server.engine_client import EngineClient, EngineUnreachable, Reply
from strata.server.child_handshake import parse_port_report
from strata.server.engine_launch import Launched, engine_argv, engine_command, launch
from strata.server.errors import APIError, invalid
from strata.server.metrics import CONTENT_TYPE, ServerMetrics
from strata.server.embeddings import EmbeddingRequest
from strata.server.llama_routes import DetokenizeRequest, TokenizeRequest
from strata.server.schemas import REQUEST_MODELS, parse_request
from strata.server.serving import bind, request_exit, serve
from strata.server.shutdown import ServeShutdown
from strata.server.upstream import UpstreamReader

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)  # waits after the 1st, 2nd, ... failed start
# A ready engine that dies sooner than this after it became ready is a quick death: the first is
# restarted at once, those in a row after it wait out BACKOFF_S as failed starts do, so an engine
# that dies at every start does not reload its model in a loop
STABLE_S = 60.0
STOP_GRACE_S = 10.0  # how long a stopping engine may take before it is killed
HEALTH_POLL_S = 0.1
# A ready engine's /health is asked every WATCH_POLL_S. Its event loop never runs windows, so a
# live engine answers in milliseconds even while busy: WATCH_MISSES answers that do not come
# within WATCH_ANSWER_S in a row mean a stopped or hung process, and it is restarted.
WATCH_POLL_S = 1.0
WATCH_ANSWER_S = 2.0
WATCH_MISSES = 3
PASS_TIMEOUT_S = 30.0  # a route answered without a slot (models, props, tokenize ...)
EXIT_SETTLE_S = 5.0  # after a broken upstream connection, how long to wait for the exit code
USER_ERROR_EXIT = 2  # a child's exit code for a StrataError: its last `strata: <reason>` line says what
# the usage of a non-streamed answer: the engine writes it last, compact (JSONResponse); an
# embeddings answer has no completion tokens
BODY_USAGE = re.compile(rb'"usage":\{"prompt_tokens":(\d+)(?:,"completion_tokens":(\d+))?')

# routes whose requests take an engine slot (queued here, bounded, timed), and their request models
ADMITTED: dict[str, type] = {**REQUEST_MODELS, "/v1/embeddings": EmbeddingRequest}
# routes answered by the engine at once, without a slot: checked here, then passed on
PASSED: dict[str, type] = {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}

DIED_MESSAGE = "the engine stopped unexpectedly (exit code {code}); it is being restarted"
WAITED_MESSAGE = "the engine stopped while this request waited; it was not sent; the engine is being restarted"
SHUTDOWN_MESSAGE = "the server is shutting down; this request was ended"


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class EngineUnavailable(APIError):
    def __init__(self, message: str, code: str = "engine_unavailable"):
        super().__init__("unavailable_error", message, code=code)


def _died(code: int | None) -> APIError:
    return APIError("server_error", DIED_MESSAGE.format(code=code), status=503, code="engine_stopped")


# ---------------------------------------------------------------- one engine child

class EngineChild:
    """One engine process: its pipes, its exit, its readiness, its slots."""

    def __init__(self, launched: Launched, parallel: int, log: Callable[[str], None],
                 loop: asyncio.AbstractEventLoop):
        # the port the child bound and reported on its stdout, with proof that it holds its key
        # (strata/server/child_handshake.py); nothing is sent to it before
        self.key = launched.key
        self.port: int | None = None
        self.url = ""
        self.reported = asyncio.Event()
        self.log = log
        self.loop = loop
        self.exited = asyncio.Event()
        self.exit_code: int | None = None
        self.is_ready = False
        self.ready_at = 0.0
        self.reason: str | None = None  # the child's last `strata: <reason>` line
        self.unhealthy: str | None = None  # why it is being restarted while it still runs (Supervisor._watch)
        self.last_line = ""
        self.slots = asyncio.Semaphore(parallel)
        self.ready: asyncio.Future = loop.create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.started_at = launched.started_at
        self.proc = launched.proc
        self._readers = [threading.Thread(target=self._pipe, args=(s,), daemon=True, name="strata-engine-log")
                         for s in (self.proc.stdout, self.proc.stderr)]
        for t in self._readers:
            t.start()
        threading.Thread(target=self._wait, daemon=True, name="strata-engine-wait").start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    def _pipe(self, stream) -> None:
        """Forward the child's output to our log line by line; remember its error line; take
        the first genuine port report from its stdout (not logged: it holds a proof)."""
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if stream is self.proc.stdout and self.port is None and (port := parse_port_report(line, self.key)):
                self.port = port
                with contextlib.suppress(RuntimeError):  # loop already closed: the server is gone
                    self.loop.call_soon_threadsafe(self._on_port, port)
                continue
            if line.startswith("strata: ") and not line.startswith("strata: warning:"):
                self.reason = line[len("strata: "):]
            if line.strip():
                self.last_line = line.strip()
            self.log(f"[engine] {line}")
        stream.close()

    def _wait(self) -> None:
        code = self.proc.wait()
        for t in self._readers:  # so the error line is in hand before anyone reads self.reason
            t.join(timeout=2.0)
        with contextlib.suppress(RuntimeError):  # loop already closed: the server is gone
            self.loop.call_soon_threadsafe(self._on_exit, code)

    def _on_port(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.reported.set()

    def _on_exit(self, code: int) -> None:
        self.exit_code = code
        self.exited.set()

    def stop_gracefully(self) -> None:
        if not self.alive:
            return
        with contextlib.suppress(OSError):
            if sys.platform == "win32":
                self.proc.send_signal(signal.CTRL_BREAK_EVENT)
            else:
                self.proc.terminate()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()

    async def wait_exit(self, timeout: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.exited.wait(), timeout)
        return self.exited.is_set()

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()


def _start_failure_reason(child: EngineChild) -> str:
    # exit 2 is a user error: the engine's last `strata: <reason>` line says what is wrong
    if child.exit_code == 2 and child.reason:
        return child.reason
    tail = f" (last output: {child.last_line})" if child.last_line else ""
    return f"it exited with code {child.exit_code}{tail}"


# ---------------------------------------------------------------- the supervisor

class Supervisor:
    def __init__(self, cfg: ServerConfig, log: Callable[[str], None] = log_stderr,
                 command: list[str] | None = None, first: Launched | None = None):
        """`first`: the first engine, already started (strata serve starts it before it imports
        the web stack, so the model loads meanwhile); None: started with the server."""
        self.cfg = cfg
        self.parallel = cfg.engine_parallel()
        self.log = log
        self.command = command or engine_command()
        self.metrics = ServerMetrics()
        self.drain = Drain()
        self.child: EngineChild | None = None
        self.failures = 0
        self.quick_deaths = 0  # ready engines in a row that died within STABLE_S
        self.retry_at = 0.0
        self.last_failure: str | None = None
        self.outstanding = 0  # admitted requests: waiting here or running in the engine
        self.client: EngineClient | None = None
        self._lock = asyncio.Lock()
        self._starts = 0
        self.ever_ready = False  # some engine child became ready: later start failures are retried
        self.fatal: StrataError | None = None  # the first engine's user error: the server stops with it
        self.on_fatal: Callable[[], None] = lambda: None  # stops the server (run_server sets it)
        self.stopping = False  # stop() has begun: the monitor starts no engine
        self.stop_grace_s = STOP_GRACE_S  # how long stop() waits for the engine (less after "stop now")
        self._first = first

    def engine_argv(self) -> list[str]:
        return engine_argv(self.command, self.cfg.args, self.parallel, self.cfg.model)

    # ------------------------------------------------------------ starting and stopping
    async def start(self) -> None:
        # each child's key goes only to the port that child reported (EngineChild.reported)
        self.client = EngineClient(admitted_only=True)
        async with self._lock:
            self._spawn()

    def _spawn(self) -> EngineChild:
        """A new engine child, with a new key (engine_launch.launch)."""
        launched, self._first = self._first, None
        if launched is None:
            launched = launch(self.engine_argv())
        launched.adopted = True
        if self._starts:
            self.metrics.engine_restarts.inc()
            self.log("strata serve: restarting the engine")
        self._starts += 1
        self.metrics.engine_starts.inc()
        child = EngineChild(launched, self.parallel, self.log, asyncio.get_running_loop())
        self.log(f"strata serve: engine pid {child.pid} starting")
        self.child = child
        asyncio.get_running_loop().create_task(self._watch(child))
        return child

    async def _watch(self, child: EngineChild) -> None:
        """Wait for the child to become ready (or fail), then watch its health until it exits."""
        deadline = child.started_at + self.cfg.startup_timeout
        admitted = False
        while child.alive and not child.ready.done():
            if time.monotonic() > deadline:
                child.kill()
                await child.wait_exit(STOP_GRACE_S)
                self._start_failed(child, f"the engine did not become ready within {self.cfg.startup_timeout:g} s")
                break
            if not child.reported.is_set():  # nothing goes to the child before it reported its port
                await first_of(child.reported.wait(), {"exited": child.exited}, HEALTH_POLL_S)
                continue
            if not admitted:
                admitted = True
                self.client.admit("127.0.0.1", child.port, child.key)
                self.log(f"strata serve: engine pid {child.pid} listens on port {child.port}")
            try:
                r = await self.client.get(child.url + "/health", timeout=2.0)
                if r.status_code == 200:
                    child.is_ready = True
                    child.ready_at = time.monotonic()
                    self.ever_ready = True
                    self.failures = 0
                    self.last_failure = None  # (/health no longer shows why an earlier start failed)
                    self.metrics.engine_up.set(1)
                    child.ready.set_result(child)
                    self.log(f"strata serve: engine ready (pid {child.pid})")
                    break
            except EngineUnreachable:
                pass
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.exited.wait(), HEALTH_POLL_S)
        if child.is_ready:
            await self._until_unhealthy(child)
        await child.exited.wait()
        if child.port is not None:
            self.client.forget("127.0.0.1", child.port)
        self.metrics.engine_up.set(0)
        if not child.ready.done() and child.exit_code == USER_ERROR_EXIT and not self.ever_ready \
                and not self.drain.draining:
            self._user_error(child, f"the engine could not start: {_start_failure_reason(child)}")
        elif not child.ready.done():
            why = _start_failure_reason(child)
            self._start_failed(child, f"the engine could not start: {why}")
        elif child.unhealthy is not None:
            self.metrics.engine_exits.labels("unhealthy").inc()
        elif child.is_ready and not self.drain.draining:
            self.metrics.engine_exits.labels("crash").inc()
            self.log(f"strata serve: {DIED_MESSAGE.format(code=child.exit_code)}")
        else:
            self.metrics.engine_exits.labels("stopped").inc()
        if child.ready.done() and child.is_ready:
            self._after_death(child)
        await self._restart_when_due(child)

    def _after_death(self, child: EngineChild) -> None:
        """When the monitor may start the next engine after a ready one died (STABLE_S)."""
        quick = time.monotonic() - child.ready_at < STABLE_S
        self.quick_deaths = self.quick_deaths + 1 if quick else 0
        if self.quick_deaths >= 2:
            self.retry_at = time.monotonic() + BACKOFF_S[min(self.quick_deaths - 2, len(BACKOFF_S) - 1)]

    async def _restart_when_due(self, child: EngineChild) -> None:
        """Start the next engine without waiting for a request (a load balancer that sends
        requests only to a healthy backend would never send the one that restarts it): at once
        after a crash, after the back-off after a failed start."""
        while not (self.drain.draining or self.stopping or self.fatal is not None):
            wait = self.retry_at - time.monotonic()
            if wait <= 0:
                async with self._lock:
                    if self.child is child and not (self.drain.draining or self.stopping or self.fatal is not None):
                        self._spawn()
                return
            await asyncio.sleep(min(wait, 1.0))  # (a shutdown meanwhile is seen within a second)

    async def _until_unhealthy(self, child: EngineChild) -> None:
        """Poll a ready child's /health until it exits; kill it when it says it is unhealthy (a
        dead scheduler, a window past its watchdog) or stops answering (stopped, hung). Its
        running requests then end as after any crash (503 engine_stopped), and a new engine is
        started (_restart_when_due)."""
        misses = 0
        while child.alive:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.exited.wait(), WATCH_POLL_S)
            if not child.alive or self.drain.draining:
                return
            why = None
            try:
                r = await self.client.get(child.url + "/health", timeout=WATCH_ANSWER_S)
                misses = 0
                body = r.json() if r.status_code == 503 else {}
                if isinstance(body, dict) and body.get("status") == "unhealthy":
                    why = (body.get("error") or {}).get("message") or "it says it is unhealthy"
            except (EngineUnreachable, ValueError):  # (ValueError: a body that is not JSON)
                misses += 1
                if misses >= WATCH_MISSES:
                    why = f"its /health did not answer within {WATCH_ANSWER_S:g} s, {misses} times in a row"
            if why is not None and child.alive:
                child.unhealthy = why
                self.log(f"strata serve: the engine is unhealthy ({why}); restarting it")
                child.kill()
                return

    def _start_failed(self, child: EngineChild, message: str) -> None:
        if child.ready.done():
            return
        self.metrics.engine_exits.labels("start_failure").inc()
        wait = BACKOFF_S[min(self.failures, len(BACKOFF_S) - 1)]
        self.failures += 1
        self.retry_at = time.monotonic() + wait
        self.last_failure = message
        self.log(f"strata serve: {message} (next attempt in {wait:g} s at the earliest)")
        child.ready.set_exception(EngineUnavailable(message, code="engine_start_failed"))

    def _user_error(self, child: EngineChild, message: str) -> None:
        """The first engine refused what it was given (exit 2): no restart can mend that, so the
        server stops, and run_server raises `message` (one line, exit code 2)."""
        self.metrics.engine_exits.labels("start_failure").inc()
        self.last_failure = message
        self.retry_at = float("inf")  # no request starts another while the server stops
        self.fatal = StrataError(message)
        child.ready.set_exception(EngineUnavailable(message, code="engine_start_failed"))
        self.drain.begin(0.0)
        self.on_fatal()

    async def stop(self) -> None:
        self.stopping = True
        child = self.child
        if child is not None and child.alive:
            self.log(f"strata serve: stopping the engine (pid {child.pid})")
            child.stop_gracefully()
            if not await child.wait_exit(self.stop_grace_s):
                child.kill()
                await child.wait_exit(STOP_GRACE_S)
        if child is not None:
            child.close_stdin()
        if self.client is not None:
            await self.client.aclose()

    async def ready_child(self, timeout: float | None) -> EngineChild:
        """The running engine, started (again) if needed; EngineUnavailable when it cannot start."""
        async with self._lock:
            child = self.child
            if child is None or not child.alive:
                if child is not None and not child.is_ready and time.monotonic() < self.retry_at:
                    left = self.retry_at - time.monotonic()
                    raise EngineUnavailable(f"{self.last_failure} (next attempt in {left:.0f} s)",
                                            code="engine_start_failed")
                child = self._spawn()
        if child.ready.done():
            return child.ready.result()
        try:
            return await asyncio.wait_for(asyncio.shield(child.ready), timeout)
        except asyncio.TimeoutError:
            raise APIError("timeout_error", "timed out waiting for the engine to start") from None

    # ------------------------------------------------------------ health
    def health(self) -> tuple[int, dict[str, Any]]:
        child = self.child
        if self.drain.draining:
            state, why = "shutting_down", "the server is shutting down"
        elif child is not None and child.alive and child.unhealthy is not None:
            state, why = "unhealthy", f"the engine is being restarted: {child.unhealthy}"
        elif child is not None and child.alive and child.is_ready:
            return 200, {"status": "ok"}
        elif child is not None and child.alive:
            state, why = "loading", "the engine is starting"
        elif self.last_failure is not None:
            left = max(0.0, self.retry_at - time.monotonic())
            state, why = "unavailable", f"{self.last_failure} (next attempt in {left:.0f} s)"
        else:
            left = self.retry_at - time.monotonic()
            state, why = "unavailable", ("the engine stopped; it is being restarted" if left <= 0 else
                                         f"the engine stopped; it is started again in {math.ceil(left)} s")
        body = EngineUnavailable(why, code=state).body()
        body["status"] = state
        return 503, body


# ---------------------------------------------------------------- the proxy app

class _Lease:
    """One engine slot held by one request."""

    def __init__(self, sup: Supervisor, child: EngineChild):
        self.sup, self.child = sup, child
        self.released = False
        sup.metrics.in_flight.inc()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.child.slots.release()
            self.sup.metrics.in_flight.dec()


class ServeApp:
    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.cfg = sup.cfg
        self.preparer = Preparer()  # parsing and validating big bodies, off the event loop
        self.app = self._build()

    def _deadline(self) -> float | None:
        t = self.cfg.request_timeout
        return time.monotonic() + t if t > 0 else None

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _timed_out(self) -> APIError:
        return APIError("timeout_error", f"the request took longer than request_timeout = {self.cfg.request_timeout:g} s",
                        code="timeout")

    async def _acquire(self, child: EngineChild, deadline, gone: asyncio.Event) -> _Lease:
        sup = self.sup
        sup.metrics.queued.inc()
        try:
            outcome, _ = await first_of(child.slots.acquire(),
                                        {"died": child.exited, "shutdown": sup.drain.expired, "gone": gone},
                                        self._left(deadline))
        finally:
            sup.metrics.queued.dec()
        if outcome == "done":
            if child.alive:
                return _Lease(sup, child)
            child.slots.release()
            outcome = "died"
        raise {"died": APIError("server_error", WAITED_MESSAGE, status=503, code="engine_stopped"),
               "shutdown": APIError("unavailable_error", SHUTDOWN_MESSAGE, code="shutting_down"),
               "gone": _ClientGone(),
               "timeout": self._timed_out()}[outcome]

    async def _upstream_error(self, child: EngineChild, exc: Exception) -> APIError:
        if await child.wait_exit(EXIT_SETTLE_S):
            return _died(child.exit_code)
        return APIError("server_error", f"the engine connection failed: {exc}", status=503,
                        code="engine_connection_failed")

    async def _generate(self, request: Request, path: str) -> Response:
        try:
            return await self._admit_and_forward(request, path)
        except APIError as e:
            self.sup.metrics.requests.labels(str(e.code or e.type)).inc()
            raise

    async def _admit_and_forward(self, request: Request, path: str) -> Response:
        sup = self.sup
        raw = await read_body(request, self.cfg.max_request_bytes, self.cfg.body_timeout)
        req = await self.preparer.run(len(raw), parse_request, ADMITTED[path], raw)
        sup.drain.refuse_if_draining()
        if sup.outstanding >= sup.parallel + self.cfg.max_queued:
            raise APIError("rate_limit_error",
                           f"too many requests waiting (max_queued = {self.cfg.max_queued}); retry later",
                           code="queue_full")
        sup.outstanding += 1
        lease: _Lease | None = None
        handed_over = False
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_set_when_gone(request, gone))
        try:
            deadline = self._deadline()
            child = await self._ready_child(deadline, gone)
            lease = await self._acquire(child, deadline, gone)
            rec: AccessRecord | None = request.scope.get(ACCESS_KEY)
            headers = {"content-type": "application/json"}
            if rec is not None:  # the engine then ends a stream with its usage, for the access log
                headers[USAGE_TRAILER_HEADER] = "1"
            try:
                outcome, resp = await first_of(sup.client.send("POST", child.url + path, raw, headers),
                                               {"gone": gone, "shutdown": sup.drain.expired}, self._left(deadline))
            except EngineUnreachable as e:
                raise await self._upstream_error(child, e) from None
            self._raise_outcome(outcome)
            if req.stream and resp.status_code == 200:
                watcher.cancel()  # from here Starlette watches for the disconnect
                handed_over = True
                cleanup = self._relay_cleanup(resp, lease)
                return ClosingStreamingResponse(self._relay(resp, child, deadline, cleanup, rec), cleanup,
                                                media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
            try:
                outcome, body = await first_of(resp.aread(), {"gone": gone, "shutdown": sup.drain.expired},
                                               self._left(deadline))
            except EngineUnreachable as e:
                raise await self._upstream_error(child, e) from None
            finally:
                await resp.aclose()
            self._raise_outcome(outcome)
            if rec is not None and (m := _last_match(BODY_USAGE, body)) is not None:
                rec.set(int(m[1]), int(m[2] or 0))
            sup.metrics.requests.labels("ok" if resp.status_code < 400 else f"http_{resp.status_code}").inc()
            return Response(body, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        except _ClientGone:
            sup.metrics.requests.labels("client_gone").inc()
            return Response(status_code=499)
        finally:
            watcher.cancel()
            if not handed_over:
                sup.outstanding -= 1
                if lease is not None:
                    lease.release()

    def _raise_outcome(self, outcome: str) -> None:
        if outcome == "gone":
            raise _ClientGone()
        if outcome == "shutdown":
            raise APIError("unavailable_error", SHUTDOWN_MESSAGE, code="shutting_down")
        if outcome == "timeout":
            raise self._timed_out()

    async def _ready_child(self, deadline, gone: asyncio.Event) -> EngineChild:
        outcome, child = await first_of(self.sup.ready_child(self._left(deadline)),
                                        {"gone": gone, "shutdown": self.sup.drain.expired})
        self._raise_outcome(outcome)
        return child

    def _relay_cleanup(self, resp: Reply, lease: _Lease):
        done = False

        async def cleanup() -> None:
            nonlocal done
            if done:
                return
            done = True
            self.sup.outstanding -= 1
            lease.release()
            await resp.aclose()  # closing the upstream makes the engine cancel the generation
        return cleanup

    async def _relay(self, resp: Reply, child: EngineChild, deadline, cleanup,
                     rec: AccessRecord | None = None) -> AsyncIterator[bytes]:
        """Pass the engine's SSE bytes through as they come, unparsed (what arrived since the last
        write goes out as one chunk); if the engine dies or time runs out, end the stream with an
        error event and [DONE]. What the engine sends after its [DONE] (the usage trailer this
        proxy asked for: app.usage_trailer) is kept back and read into `rec`. The stream is
        counted, and `rec` filled, before [DONE] goes out: a client may leave as soon as it
        reads it."""
        sup = self.sup
        at_boundary = True  # the bytes sent so far end between two events
        done_tail = sse.DoneSplitter()
        outcome_label: str | None = "ok"  # None once counted: [DONE] is on its way to the client
        reader = UpstreamReader(resp.aiter_raw())
        # one watcher and one timer for the whole stream, not a race per chunk
        shutdown = asyncio.ensure_future(sup.drain.expired.wait())
        shutdown.add_done_callback(lambda f: f.cancelled() or reader.stop("shutdown"))
        left = self._left(deadline)
        timer = None if left is None else asyncio.get_running_loop().call_later(left, reader.stop, "timeout")
        try:
            while True:
                what, value = await reader.next()
                if what == "data":
                    value = done_tail.feed(value)
                    if value:
                        at_boundary = value.endswith(b"\n\n")
                        yield value
                    # past [DONE], only the usage trailer (when asked for) is still awaited
                    if not done_tail.done or (rec is not None and not USAGE_TRAILER.search(done_tail.after)):
                        continue
                if done_tail.done:  # the engine finished the stream, whatever ended the read after it
                    m = USAGE_TRAILER.search(done_tail.after or b"")
                    if rec is not None and m is not None:
                        rec.set(int(m[1]), int(m[2]))
                    sup.metrics.requests.labels(outcome_label).inc()
                    outcome_label = None
                    yield done_tail.held
                    return
                if what == "end":
                    break
                if what == "error":
                    if not isinstance(value, EngineUnreachable):
                        raise value
                    err = await self._upstream_error(child, value)
                else:
                    err = (APIError("unavailable_error", SHUTDOWN_MESSAGE, code="shutting_down")
                           if value == "shutdown" else self._timed_out())
                sup.metrics.requests.labels(err.code).inc()
                outcome_label = None
                yield (b"" if at_boundary else b"\n\n") + sse.error_and_done(err.message, err.type, err.code)
                return
        except asyncio.CancelledError:
            if outcome_label is not None:  # (a client that leaves after [DONE] was served)
                outcome_label = "client_gone"
            raise
        finally:
            shutdown.cancel()
            if timer is not None:
                timer.cancel()
            reader.close()
            if outcome_label is not None:
                sup.metrics.requests.labels(outcome_label).inc()
            await cleanup()

    async def _proxy_get(self, request: Request, path: str) -> Response:
        return await self._pass(path, None)

    async def _proxy_post(self, request: Request, path: str) -> Response:
        """A route that takes no slot: its body bounded and checked here, then passed on."""
        raw = await read_body(request, self.cfg.max_request_bytes, self.cfg.body_timeout)
        await self.preparer.run(len(raw), parse_request, PASSED[path], raw)
        return await self._pass(path, raw)

    async def _pass(self, path: str, body: bytes | None) -> Response:
        """The engine's answer to GET path (body None) or POST path with body."""
        self.sup.drain.refuse_if_draining()
        child = await self.sup.ready_child(self._left(self._deadline()))
        try:
            if body is None:
                r = await self.sup.client.get(child.url + path, timeout=PASS_TIMEOUT_S)
            else:
                r = await self.sup.client.post(child.url + path, content=body, timeout=PASS_TIMEOUT_S,
                                               headers={"content-type": "application/json"})
        except EngineUnreachable as e:
            raise await self._upstream_error(child, e) from None
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"))

    def _build(self) -> FastAPI:
        sup = self.sup

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            await sup.start()
            try:
                yield
            finally:
                await sup.stop()

        app = FastAPI(title="strata serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        install_error_handlers(app, sup.log)
        app.add_middleware(EdgeMiddleware, policy=EdgePolicy.for_bind(
            self.cfg.host, api_key=self.cfg.api_key, allowed_hosts=self.cfg.allowed_hosts,
            allowed_origins=self.cfg.allowed_origins))
        if self.cfg.access_log:  # added last: outermost, so refusals at the edge are logged too
            app.add_middleware(AccessLog, log=sup.log, prefix="strata serve")

        @app.get("/health")
        async def health():
            status, body = sup.health()
            return JSONResponse(body, status_code=status)

        @app.get("/metrics")
        async def metrics(request: Request):
            text = sup.metrics.render()
            child = sup.child
            if child is not None and child.alive and child.is_ready:
                with contextlib.suppress(EngineUnreachable):
                    r = await sup.client.get(child.url + "/metrics", timeout=2.0)
                    if r.status_code == 200:
                        text += r.content
            return Response(text, media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models(request: Request):
            return await self._proxy_get(request, "/v1/models")

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str, request: Request):
            return await self._proxy_get(request, model_path(model_id))

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._generate(request, "/v1/chat/completions")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, "/v1/completions")

        @app.post("/v1/embeddings")
        async def embeddings(request: Request):
            return await self._generate(request, "/v1/embeddings")

        # llama-server's own routes
        @app.post("/tokenize")
        async def tokenize(request: Request):
            return await self._proxy_post(request, "/tokenize")

        @app.post("/detokenize")
        async def detokenize(request: Request):
            return await self._proxy_post(request, "/detokenize")

        @app.get("/props")
        async def props(request: Request):
            return await self._proxy_get(request, "/props")

        @app.get("/slots")
        async def slots(request: Request):
            return await self._proxy_get(request, "/slots")

        return app


# a model id never holds control characters, and a path segment "." or ".." would be resolved
# away by the URL instead of reaching the engine as a name
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def model_path(model_id: str) -> str:
    """The engine's path for /v1/models/{model_id}: the id quoted whole (its slashes and dots
    stay part of the name), never a way to reach another engine route."""
    if _CONTROL.search(model_id):
        raise invalid("model: the model id holds control characters", param="model")
    if any(seg in (".", "..") for seg in model_id.split("/")):
        raise APIError("not_found_error", f"model {model_id!r} not found", param="model", code="model_not_found")
    return "/v1/models/" + quote(model_id, safe="")


def _last_match(pattern: re.Pattern, body: bytes) -> re.Match | None:
    """The pattern's last match in body (a JSON answer's usage comes last; an answer's text
    cannot imitate it: the quotes inside JSON strings are escaped)."""
    found = None
    for found in pattern.finditer(body):
        pass
    return found


class _ClientGone(Exception):
    """The client disconnected before its answer began."""


async def _set_when_gone(request: Request, gone: asyncio.Event) -> None:
    await wait_for_disconnect(request)
    gone.set()


def run_server(cfg: ServerConfig, log: Callable[[str], None] = log_stderr, command: list[str] | None = None,
               first: Launched | None = None) -> int:
    """Serve until a signal (exit 0; a second signal stops at once: 128 + its number), or until
    the first engine refuses its pack or flags: then that one line as a StrataError (exit 2).
    `first`: the first engine, already started."""
    sup = Supervisor(cfg, log, command, first)
    app = ServeApp(sup).app
    sup.on_fatal = lambda: request_exit(app)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    log(f"strata serve: listening on http://{host}:{port} ({sup.parallel} slot(s), queue bound {cfg.max_queued})")

    shutdown = ServeShutdown(sup, app, cfg.shutdown_timeout, log)
    protocol = guarded_protocol(ConnectionLimits(cfg.header_timeout, cfg.max_connections), log, "strata serve")
    serve(app, sock, on_signal=shutdown.first, on_again=shutdown.again, graceful_timeout_s=cfg.shutdown_timeout + 5,
          http_protocol=protocol, backlog=ACCEPT_BATCH)
    if sup.fatal is not None:
        raise sup.fatal
    log("strata serve: stopped")
    return shutdown.exit_code
