"""Starting a `strata engine` child: its command line, environment and process flags.

Kept free of the web stack (no FastAPI, no httpx) so that `strata serve` can start its first
engine before it imports them: the engine then loads its model while the server builds its
app, and the server answers ~1 s sooner. Later engines (restarts) are started the same way by
the supervisor.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# environment set by `strata serve` for its engine child (read by strata/server/engine_process.py)
ENV_PARENT_WATCH = "STRATA_PARENT_WATCH"  # "stdin": exit when stdin reaches end-of-file
ENV_PARENT_PID = "STRATA_PARENT_PID"
# The key `strata serve` gives its engine child, through the environment (argv shows in `ps`):
# every route of the child, /health included, needs it, so no other local process can reach the
# engine around the server's API key, queue bound and timeouts.
ENV_ENGINE_SECRET = "STRATA_ENGINE_SECRET"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_command() -> list[str]:
    """How to start `strata engine` with this interpreter."""
    module = "strata" if importlib.util.find_spec("strata.__main__") else "strata.cli.main"
    return [sys.executable, "-m", module, "engine"]


def engine_argv(command: list[str], args: list[str], parallel: int, port: int, alias: str | None) -> list[str]:
    # --no-access-log: the server writes the one line per request (with the engine's usage)
    argv = [*command, *args, "--parallel", str(parallel), "--host", "127.0.0.1", "--port", str(port),
            "--no-access-log"]
    if alias:
        argv += ["--alias", alias]
    return argv


def child_env(secret: str = "") -> dict[str, str]:
    env = dict(os.environ)
    if secret:
        env[ENV_ENGINE_SECRET] = secret
    # `python -m strata` must work even when strata is run from a checkout, not installed
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env[ENV_PARENT_WATCH] = "stdin"
    env[ENV_PARENT_PID] = str(os.getpid())
    return env


def child_flags() -> dict[str, Any]:
    # Own process group / session: a Ctrl-C in the terminal reaches only the server, which
    # then stops the engine in order (and CTRL_BREAK can target the engine's group on Windows).
    if sys.platform == "win32":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


@dataclass
class Launched:
    """An engine process started, not yet watched: the supervisor adopts it as an EngineChild."""

    proc: subprocess.Popen
    argv: list[str]
    port: int
    secret: str
    started_at: float = field(default_factory=time.monotonic)
    adopted: bool = False  # a supervisor watches and stops it now


def launch(argv: list[str], port: int, secret: str) -> Launched:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env(secret), **child_flags())
    return Launched(proc, argv, port, secret)


def launch_first(args: list[str], parallel: int, alias: str | None, command: list[str] | None = None) -> Launched:
    """The server's first engine, with a fresh secret and a free port."""
    port = free_port()
    return launch(engine_argv(command or engine_command(), args, parallel, port, alias), port,
                  secrets.token_urlsafe(32))
