"""Run `strata serve` (or `strata engine`) as a real child process for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import http.cookiejar

import httpx

ROOT = Path(__file__).resolve().parents[2]

# One client for the tests' requests, for use as httpx.get/post/stream/request are: each request
# opens its own connection and closes it after the answer (no keep-alive), sends the same
# headers, keeps no cookies and has httpx's default 5 s timeout. httpx.get and its kin build a
# new client (and its TLS context: ~40 ms of CPU, more on a loaded machine) per call, which
# adds up over hundreds of requests and polls.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0),
                    cookies=httpx.Cookies(http.cookiejar.CookieJar(
                        policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0); look at its state where /proc exists
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False
    return True


def wait_until(cond, timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


class StrataProcess:
    """`python -m strata.cli.main <command> ...` with its output collected line by line."""

    def __init__(self, command: str, args: list[str], cwd: Path | None = None, python_flags: tuple[str, ...] = ()):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen([sys.executable, *python_flags, "-m", "strata.cli.main", command, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd or ROOT, env=env)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            with self._cv:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def output(self) -> str:
        with self._cv:
            return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = 60.0, start: int = 0) -> re.Match:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines[start:]:
                    m = rx.search(line)
                    if m:
                        return m
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader_pending()):
                    raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines))
                self._cv.wait(min(left, 0.2))

    def _reader_pending(self) -> bool:
        return self.proc.stdout is not None and not self.proc.stdout.closed and self.proc.poll() is None

    def wait_listening(self, timeout: float = 60.0) -> str:
        m = self.wait_line(r"listening on (http://[\d.]+:\d+)", timeout)
        self.url = m.group(1)
        return self.url

    def wait_healthy(self, timeout: float = 120.0) -> None:
        def ok() -> bool:
            try:
                return HTTP.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        if not wait_until(ok, timeout, 0.1):
            raise AssertionError("server not healthy; output:\n" + self.output())

    def engine_pids(self) -> list[int]:
        with self._cv:
            return [int(m.group(1)) for line in self.lines if (m := re.search(r"engine pid (\d+) starting", line))]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError("the server did not stop; output:\n" + self.output())

    def kill_tree(self) -> None:
        """Test clean-up: never leave a server or engine behind, whatever happened."""
        pids = self.engine_pids()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def spawn_serve(tmp_path: Path, config: dict | str | None, *extra: str) -> StrataProcess:
    """start_serve without waiting: the child loads while the caller does something else (call
    wait_listening before using its url)."""
    args = ["--port", "0", *extra]
    if config is not None:
        path = tmp_path / "serve.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        args = ["--config", str(path), *args]
    return StrataProcess("serve", args)


def start_serve(tmp_path: Path, config: dict | str | None, *extra: str) -> StrataProcess:
    p = spawn_serve(tmp_path, config, *extra)
    p.wait_listening()
    return p


@contextlib.contextmanager
def healthy(p: StrataProcess):
    """`p` (a started child) once it listens and is healthy, for the block (a module fixture's
    body); killed with its children after it, whatever happened."""
    try:
        p.wait_listening()
        p.wait_healthy()
        yield p
    finally:
        p.kill_tree()


@contextlib.contextmanager
def serving(tmp_path: Path, config: dict | str | None, *extra: str):
    """A healthy `strata serve` child for the block (a module fixture's body), killed with its
    engine after it."""
    with healthy(spawn_serve(tmp_path, config, *extra)) as p:
        yield p


def openai_client(server: StrataProcess, key: str, timeout: float = 120):
    """The official openai client on the server, without its retries (a test sees every failure)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """The sum of a metric's samples (0 when absent)."""
    text = HTTP.get(url + "/metrics", headers=headers or {}, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
