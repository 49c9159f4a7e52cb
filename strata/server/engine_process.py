"""The `strata engine` process: bind the port, serve the API (503 while loading), load the
engine core on a thread, and leave when the parent server is gone.

A supervised engine (started by `strata serve`) reads its key from the first line of its
stdin, binds a free port and reports it on stdout (strata/server/child_handshake.py), then
watches its stdin, a pipe from the server: end-of-file means the server died, even by SIGKILL,
and the engine exits at once. This works on Windows too; on Linux PR_SET_PDEATHSIG is set as well.

Run by hand, the "listening" line comes once the socket is bound and a pack named by
--pack/--native has opened with its metadata checked: a pack that cannot load is one line and
exit 2, with no listening line before it.
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
from strata.server.child_handshake import ENV_HANDSHAKE, ChallengeResponder, port_report, read_key
from strata.server.engine_launch import ENV_PARENT_PID, ENV_PARENT_WATCH, HANDSHAKE
from strata.server.gc_policy import settle_after_load

ENGINE_DRAIN_S = 30.0

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


def _server_key(log: Callable[[str], None]) -> str | None:
    """The key `strata serve` wrote on our stdin (None when run by hand). Read before the
    stdin watch starts: the watch then sees only the pipe's end."""
    if os.environ.pop(ENV_HANDSHAKE, None) != HANDSHAKE:  # popped: not inherited by anything we start
        return None
    try:
        key = read_key(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):
        key = None
    if key is None:
        _exit_now(log, "the server that started this engine gave it no key")
    return key


def _key_and_edge(opts: EngineOptions, secret: str | None) -> dict:
    """The supervisor's key (every route) when there is one, else the user's --api-key
    (every route but /health, as llama-server: probes carry no key)."""
    from strata.server.edge import EdgePolicy
    from strata.server.routes import KEY_EXEMPT

    key, exempt = (secret, frozenset()) if secret else (opts.api_key, KEY_EXEMPT)
    edge = EdgePolicy.for_bind(opts.host, api_key=key, key_exempt=exempt, allowed_hosts=opts.allowed_hosts,
                               allowed_origins=opts.allowed_origins)
    return {"api_key": key, "edge": edge}


def check_pack(opts: EngineOptions) -> None:
    """Open a pack named by --pack / --native and check its metadata and tensor shapes (no
    tensor data is read), and an --mtp draft: a StrataError before the engine says it listens.
    (The default model needs no check: it is fetched and checked where it is cached.)"""
    if opts.pack is None and opts.native is None:
        return
    from strata.engine.pack_check import check_pack_files

    check_pack_files(opts.pack, opts.native, opts.ple_gguf, opts.mtp)


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

    def __init__(self, opts: EngineOptions, log: Callable[[str], None], loader, check: bool = True):
        self._check = check
        self.failure: list[BaseException] = []
        self.core = None
        self.checked = threading.Event()  # check_pack has passed, or failed (then `failure`)
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
            if self._check:
                check_pack(opts)
        except BaseException as e:  # noqa: BLE001 - raised by run_engine, before it says it listens
            self.failure.append(e)
            self.checked.set()
            return
        self.checked.set()
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
    server_key = _server_key(log)
    supervised = server_key is not None
    watch_parent(log)  # (start-up warnings for flags are printed by the core's loader)
    key_and_edge = _key_and_edge(opts, server_key)
    # (a served engine's pack was checked by the server before it started the engine: config.check_engine_start)
    loading = _Loading(opts, log, loader, check=not supervised)

    from strata.server.app import EngineAPI
    from strata.server.serving import bind, serve

    api = EngineAPI(model_name=opts.alias, log=log, max_queued=opts.max_queued,
                    body_timeout=opts.body_timeout, access_log=not opts.no_access_log,
                    usage_trailer=supervised, expose_slots=opts.slots, **key_and_edge)
    app = api.app
    if supervised:  # outermost: the server checks who answers before it sends the key
        app.add_middleware(ChallengeResponder, key=server_key)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop = asyncio.get_running_loop()
        loading.attach_to(api, app)
        yield
        if loading.core is not None:
            await loop.run_in_executor(None, loading.core.stop)

    app.router.lifespan_context = lifespan
    sock = bind(opts.host, opts.port)
    loading.checked.wait()
    if loading.failure:  # the pack cannot load: its one line, and no "listening" before it
        sock.close()
        return _failed(loading.failure[0], log)
    host, port = sock.getsockname()[:2]
    if supervised:  # on stdout, a pipe only the server reads (the port is 0 in our argv)
        print(port_report(server_key, port), flush=True)
    log(f"strata engine: listening on http://{host}:{port} (loading the model)")

    # Any local process can open connections to the engine's loopback port without its key: the
    # same header deadline and connection cap as the server's front (its defaults)
    from strata.server.connections import ACCEPT_BATCH, ConnectionLimits, guarded_protocol
    serve(app, sock, on_signal=lambda: api.begin_drain(ENGINE_DRAIN_S), graceful_timeout_s=ENGINE_DRAIN_S + 5,
          http_protocol=guarded_protocol(ConnectionLimits(), log, "strata engine"), backlog=ACCEPT_BATCH)
    if loading.failure:
        return _failed(loading.failure[0], log)
    return 0


def _failed(e: BaseException, log: Callable[[str], None]) -> int:
    """A user error is raised (its one line, exit 2); anything else is logged whole (exit 1)."""
    if isinstance(e, StrataError):
        raise e
    log("strata engine: internal error while loading:\n" + "".join(traceback.format_exception(e)).rstrip())
    return 1
