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

The proxy in front of the child is strata/server/proxy.py; its queue (at most `parallel`
requests sent to the child at once, at most `max_queued` waiting, more get 429) is
strata/server/admission.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from typing import Any, Callable

from strata.errors import StrataError
from strata.server.common import Drain, first_of
from strata.server.config import ServerConfig
from strata.server.engine_child import USER_ERROR_EXIT, EngineChild, start_failure_reason
from strata.server.engine_client import EngineClient, EngineUnreachable
from strata.server.engine_launch import Launched, engine_argv, engine_command, launch
from strata.server.errors import APIError
from strata.server.metrics import ServerMetrics

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
DIED_MESSAGE = "the engine stopped unexpectedly (exit code {code}); it is being restarted"
WAITED_MESSAGE = "the engine stopped while this request waited; it was not sent; the engine is being restarted"
SHUTDOWN_MESSAGE = "the server is shutting down; this request was ended"


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class EngineUnavailable(APIError):
    def __init__(self, message: str, code: str = "engine_unavailable"):
        super().__init__("unavailable_error", message, code=code)


def died(code: int | None) -> APIError:
    return APIError("server_error", DIED_MESSAGE.format(code=code), status=503, code="engine_stopped")


# ---------------------------------------------------------------- the supervisor

class Supervisor:
    """The engine child's life cycle (the module docstring): starts it, watches its health,
    restarts it with back-off, and says what /health of the server answers."""

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
            self._user_error(child, f"the engine could not start: {start_failure_reason(child)}")
        elif not child.ready.done():
            why = start_failure_reason(child)
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
