"""One engine child process as the supervisor (strata/server/supervisor.py) sees it: its pipes
forwarded to the log, its port report, its exit, its readiness, its slots."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from typing import Callable

from strata.server.child_handshake import parse_port_report
from strata.server.engine_launch import Launched

USER_ERROR_EXIT = 2  # a child's exit code for a StrataError: its last `strata: <reason>` line says what


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


def start_failure_reason(child: EngineChild) -> str:
    # exit 2 is a user error: the engine's last `strata: <reason>` line says what is wrong
    if child.exit_code == USER_ERROR_EXIT and child.reason:
        return child.reason
    tail = f" (last output: {child.last_line})" if child.last_line else ""
    return f"it exited with code {child.exit_code}{tail}"
