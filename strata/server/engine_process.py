"""The `strata engine` process: bind the port, serve the API (503 while loading), load the
engine core on a thread, and leave when the parent server is gone.

A supervised engine (started by `strata serve`) watches its stdin, a pipe from the server:
end-of-file means the server died, even by SIGKILL, and the engine exits at once. This
works on Windows too; on Linux PR_SET_PDEATHSIG is set as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import traceback
from typing import Callable

from strata.engine.options import EngineOptions
from strata.errors import EXIT_DEVICE_LOST, StrataError
from strata.server.engine_launch import ENV_ENGINE_SECRET, ENV_PARENT_PID, ENV_PARENT_WATCH
from strata.server.gc_policy import settle_after_load

ENGINE_DRAIN_S = 30.0
# The exit code of a supervised engine whose port (picked by `strata serve`) was taken before it
# could bind: the server's race, not the user's error (exit 2), so the server does not stop for it
EXIT_PORT_TAKEN = 75  # EX_TEMPFAIL


class PortTaken(StrataError):
    exit_code = EXIT_PORT_TAKEN


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _exit_now(log: Callable[[str], None], why: str) -> None:
    log(f"strata engine: {why}; exiting")
    os._exit(0)


def _exit_soon(log: Callable[[str], None], why: str) -> None:
    """The engine can serve nothing more (the scheduler's on_fatal): exit once the window's
    requests have had their error answers written, so that `strata serve` starts a new one."""
    log(f"strata engine: {why}; exiting (code {EXIT_DEVICE_LOST}) so that it can be started again")
    timer = threading.Timer(0.5, os._exit, args=(EXIT_DEVICE_LOST,))
    timer.daemon = True
    timer.start()


def _set_pdeathsig() -> None:
    """Linux: have the kernel kill us when the parent dies (best effort; stdin EOF is the main guard)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except Exception:  # noqa: BLE001 - optional hardening
        pass


def watch_parent(log: Callable[[str], None]) -> None:
    if os.environ.get(ENV_PARENT_WATCH) != "stdin":
        return
    _set_pdeathsig()
    expected = os.environ.get(ENV_PARENT_PID, "")
    if expected.isdigit() and hasattr(os, "getppid") and sys.platform != "win32" and os.getppid() != int(expected):
        _exit_now(log, "the server that started this engine is already gone")

    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        return

    def wait_eof() -> None:
        # os.read on the raw descriptor: a thread blocked in sys.stdin's buffered reader
        # would make the interpreter abort at exit (it cannot take the buffer's lock)
        with contextlib.suppress(OSError):
            while os.read(fd, 4096):
                pass
        _exit_now(log, "the server that started this engine is gone (stdin closed)")

    threading.Thread(target=wait_eof, name="strata-parent-watch", daemon=True).start()


def _key_and_edge(opts: EngineOptions) -> dict:
    """The supervisor's secret (every route) when there is one, else the user's --api-key
    (every route but /health, as llama-server: probes carry no key)."""
    from strata.server.edge import EdgePolicy

    secret = os.environ.pop(ENV_ENGINE_SECRET, None)  # popped: not inherited by anything we start
    key, exempt = (secret, frozenset()) if secret else (opts.api_key, frozenset({"/health"}))
    edge = EdgePolicy.for_bind(opts.host, api_key=key, key_exempt=exempt, allowed_hosts=opts.allowed_hosts,
                               allowed_origins=opts.allowed_origins)
    return {"api_key": key, "edge": edge}


def load_core(opts: EngineOptions, log: Callable[[str], None]):
    try:
        from strata.engine.core import EngineCore
    except ImportError as e:
        raise StrataError(f"the engine core is not available in this build ({e})") from None
    return EngineCore.load(opts, log=log)


class _Loading:
    """The engine core loading on its own thread, begun before the web stack is imported: the
    weights load (numpy, mostly outside the GIL) while FastAPI and the app are built. The core
    starts only once the app is there to take it (`attach_to`)."""

    def __init__(self, opts: EngineOptions, log: Callable[[str], None], loader):
        self.failure: list[BaseException] = []
        self.core = None
        self._app_ready = threading.Event()
        self._api = self._app = None
        self._log = log
        threading.Thread(target=self._run, args=(opts, loader), name="strata-load", daemon=True).start()

    def attach_to(self, api, app) -> None:
        self._api, self._app = api, app
        self._app_ready.set()

    def _run(self, opts: EngineOptions, loader) -> None:
        from strata.server.serving import request_exit

        log = self._log
        try:
            core = loader(opts, log)
        except BaseException as e:  # noqa: BLE001 - reported after the server stops
            self._app_ready.wait()
            self._api.failure = e.message if isinstance(e, StrataError) else f"{type(e).__name__}: {e}"
            self.failure.append(e)
            request_exit(self._app)
            return
        self._app_ready.wait()  # (the server listens before the core starts taking requests)
        api = self._api
        try:
            core.scheduler.on_fatal = lambda why: _exit_soon(log, why)
            # before the scheduler starts: the one full collection then pauses no window
            settle_after_load()  # (the collector stops walking what loading left: strata.server.gc_policy)
            core.start()
            self.core = core
            api.attach(core)
            log(f"strata engine: ready: model {api.model_name}, {core.parallel} slot(s), context {core.n_ctx}")
        except BaseException as e:  # noqa: BLE001
            api.failure = e.message if isinstance(e, StrataError) else f"{type(e).__name__}: {e}"
            self.failure.append(e)
            request_exit(self._app)


def run_engine(opts: EngineOptions, log: Callable[[str], None] = log_stderr, loader=load_core) -> int:
    """Serve the API on opts.host:opts.port; `loader(opts, log)` builds the core (on a thread)."""
    watch_parent(log)  # (start-up warnings for flags are printed by the core's loader)
    supervised = ENV_ENGINE_SECRET in os.environ  # (read before _key_and_edge pops it)
    key_and_edge = _key_and_edge(opts)
    loading = _Loading(opts, log, loader)

    from strata.server.app import EngineAPI
    from strata.server.serving import bind, serve

    api = EngineAPI(model_name=opts.alias, log=log, max_queued=getattr(opts, "max_queued", None),
                    body_timeout=opts.body_timeout, access_log=not opts.no_access_log,
                    usage_trailer=supervised, **key_and_edge)
    app = api.app

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop = asyncio.get_running_loop()
        loading.attach_to(api, app)
        yield
        if loading.core is not None:
            await loop.run_in_executor(None, loading.core.stop)

    app.router.lifespan_context = lifespan
    try:
        sock = bind(opts.host, opts.port)
    except StrataError as e:
        if supervised:
            raise PortTaken(e.message) from None
        raise
    host, port = sock.getsockname()[:2]
    log(f"strata engine: listening on http://{host}:{port} (loading the model)")

    serve(app, sock, on_signal=lambda: api.begin_drain(ENGINE_DRAIN_S), graceful_timeout_s=ENGINE_DRAIN_S + 5)
    if loading.failure:
        e = loading.failure[0]
        if isinstance(e, StrataError):
            raise e
        log("strata engine: internal error while loading:\n" + "".join(traceback.format_exception(e)).rstrip())
        return 1
    return 0
