"""`strata serve`'s HTTP side: the proxy app in front of the supervised engine child
(strata/server/supervisor.py), and run_server, which serves it until a signal.

Each route of ROUTES is admitted (a slot, the queue: strata/server/admission.py), passed on at
once, or answered here. A stream's bytes are relayed as they come, unparsed; if the engine dies
or time runs out mid-stream, the stream ends with an error event and [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from strata.server import sse
from strata.server.access_log import ACCESS_KEY, USAGE_TRAILER, USAGE_TRAILER_HEADER, AccessLog, AccessRecord
from strata.server.admission import OUTCOME_ERRORS, Admission, ClientGone, raise_outcome
from strata.server.common import (ClosingStreamingResponse, Preparer, first_of, install_error_handlers, read_body,
                                  wait_for_disconnect)
from strata.server.config import ServerConfig
from strata.server.connections import ACCEPT_BATCH, ConnectionLimits, guarded_protocol
from strata.server.edge import EdgeMiddleware, EdgePolicy
from strata.server.engine_child import EngineChild
from strata.server.engine_client import EngineUnreachable, Reply
from strata.server.engine_launch import Launched
from strata.server.errors import APIError
from strata.server.metrics import CONTENT_TYPE
from strata.server.routes import ADMIT, KEY_EXEMPT, PASS, ROUTES, Route, add_routes
from strata.server.schemas import parse_request
from strata.server.serving import bind, request_exit, serve
from strata.server.shutdown import ServeShutdown
from strata.server.supervisor import Supervisor, died, log_stderr
from strata.server.upstream import UpstreamReader

PASS_TIMEOUT_S = 30.0  # a route answered without a slot (models, props, tokenize ...)
EXIT_SETTLE_S = 5.0  # after a broken upstream connection, how long to wait for the exit code
# the usage of a non-streamed answer: the engine writes it last, compact (JSONResponse); an
# embeddings answer has no completion tokens
BODY_USAGE = re.compile(rb'"usage":\{"prompt_tokens":(\d+)(?:,"completion_tokens":(\d+))?')


class ServeApp:
    """The server's HTTP app: the routes of ROUTES (strata/server/routes.py), each admitted,
    passed on or answered here, in front of the supervised engine child."""

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

    async def _upstream_error(self, child: EngineChild, exc: Exception) -> APIError:
        if await child.wait_exit(EXIT_SETTLE_S):
            return died(child.exit_code)
        return APIError("server_error", f"the engine connection failed: {exc}", status=503,
                        code="engine_connection_failed")

    async def _generate(self, request: Request, route: Route) -> Response:
        try:
            return await self._admit_and_forward(request, route)
        except APIError as e:
            self.sup.metrics.requests.labels(str(e.code or e.type)).inc()
            raise

    async def _admit_and_forward(self, request: Request, route: Route) -> Response:
        sup = self.sup
        raw = await read_body(request, self.cfg.max_request_bytes, self.cfg.body_timeout)
        req = await self.preparer.run(len(raw), parse_request, route.body, raw)
        sup.drain.refuse_if_draining()
        async with Admission(sup, self.cfg) as admission:
            gone = asyncio.Event()
            watcher = asyncio.ensure_future(_set_when_gone(request, gone))
            try:
                deadline = self._deadline()
                child = await self._ready_child(deadline, gone)
                await admission.lease(child, self._left(deadline), gone)
                rec: AccessRecord | None = request.scope.get(ACCESS_KEY)
                headers = {"content-type": "application/json"}
                if rec is not None:  # the engine then ends a stream with its usage, for the access log
                    headers[USAGE_TRAILER_HEADER] = "1"
                waits = {"gone": gone, "shutdown": sup.drain.expired}
                try:
                    outcome, resp = await first_of(sup.client.send("POST", child.url + route.path, raw, headers),
                                                   waits, self._left(deadline))
                except EngineUnreachable as e:
                    raise await self._upstream_error(child, e) from None
                raise_outcome(outcome, self.cfg)
                if req.stream and resp.status_code == 200:
                    watcher.cancel()  # from here Starlette watches for the disconnect
                    cleanup = self._relay_cleanup(resp, admission.detach())
                    return ClosingStreamingResponse(self._relay(resp, child, deadline, cleanup, rec), cleanup,
                                                    media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
                try:
                    outcome, body = await first_of(resp.aread(), waits, self._left(deadline))
                except EngineUnreachable as e:
                    raise await self._upstream_error(child, e) from None
                finally:
                    await resp.aclose()
                raise_outcome(outcome, self.cfg)
                if rec is not None and (m := _last_match(BODY_USAGE, body)) is not None:
                    rec.set(int(m[1]), int(m[2] or 0))
                sup.metrics.requests.labels("ok" if resp.status_code < 400 else f"http_{resp.status_code}").inc()
                return Response(body, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type", "application/json"))
            except ClientGone:
                sup.metrics.requests.labels("client_gone").inc()
                return Response(status_code=499)
            finally:
                watcher.cancel()

    async def _ready_child(self, deadline, gone: asyncio.Event) -> EngineChild:
        outcome, child = await first_of(self.sup.ready_child(self._left(deadline)),
                                        {"gone": gone, "shutdown": self.sup.drain.expired})
        raise_outcome(outcome, self.cfg)
        return child

    @staticmethod
    def _relay_cleanup(resp: Reply, release: Callable[[], None]):
        done = False

        async def cleanup() -> None:
            nonlocal done
            if done:
                return
            done = True
            release()
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
                    err = OUTCOME_ERRORS[value](self.cfg)  # "shutdown" or "timeout"
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

    def _passed(self, route: Route):
        """The handler of a route that takes no slot: its body (if any) bounded and checked
        here, then passed on to the engine's path for it."""
        async def handler(request: Request) -> Response:
            body = None
            if route.body is not None:
                body = await read_body(request, self.cfg.max_request_bytes, self.cfg.body_timeout)
                await self.preparer.run(len(body), parse_request, route.body, body)
            path = route.path if route.engine_path is None else route.engine_path(request.path_params)
            return await self._pass(path, body)
        return handler

    def _admitted(self, route: Route):
        async def handler(request: Request) -> Response:
            return await self._generate(request, route)
        return handler

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
            allowed_origins=self.cfg.allowed_origins, key_exempt=KEY_EXEMPT))
        if self.cfg.access_log:  # added last: outermost, so refusals at the edge are logged too
            app.add_middleware(AccessLog, log=sup.log, prefix="strata serve")

        async def health():
            status, body = sup.health()
            return JSONResponse(body, status_code=status)

        async def metrics(request: Request):
            text = sup.metrics.render()
            child = sup.child
            if child is not None and child.alive and child.is_ready:
                with contextlib.suppress(EngineUnreachable):
                    r = await sup.client.get(child.url + "/metrics", timeout=2.0)
                    if r.status_code == 200:
                        text += r.content
            return Response(text, media_type=CONTENT_TYPE)

        handlers: dict[str, Callable] = {"health": health, "metrics": metrics}  # the LOCAL routes
        for route in ROUTES:
            if route.proxy == ADMIT:
                handlers[route.name] = self._admitted(route)
            elif route.proxy == PASS:
                handlers[route.name] = self._passed(route)
        add_routes(app, handlers)
        return app


def _last_match(pattern: re.Pattern, body: bytes) -> re.Match | None:
    """The pattern's last match in body (a JSON answer's usage comes last; an answer's text
    cannot imitate it: the quotes inside JSON strings are escaped)."""
    found = None
    for found in pattern.finditer(body):
        pass
    return found


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
