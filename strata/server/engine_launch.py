"""Starting a `strata engine` child: its command line, environment and process flags.

Kept free of the web stack (no FastAPI, no httpx) so that `strata serve` can start its first
engine before it imports them: the engine then loads its model while the server builds its
app, and the server answers ~1 s sooner. Later engines (restarts) are started the same way by
the supervisor.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.server.child_handshake import ENV_HANDSHAKE, new_key, send_key
from strata.store.paths import ENV_CACHE_DIR

# environment set by `strata serve` for its engine child (read by strata/server/engine_process.py)
ENV_PARENT_WATCH = "STRATA_PARENT_WATCH"  # "stdin": exit when stdin reaches end-of-file
ENV_PARENT_PID = "STRATA_PARENT_PID"
# The engine's key and port travel over its stdin and stdout, never argv or the environment
# (strata/server/child_handshake.py): every route of the child, /health included, needs the key,
# so no other local process can reach the engine around the server's API key, queue bound and
# timeouts, nor stand in for it.
HANDSHAKE = "stdio"
# the interpreter's flag that keeps the working directory off sys.path (Python >= 3.11): a
# queue.py or json.py in the folder `strata serve` runs from must not be imported by the engine
SAFE_PATH_FLAG = "-P"
# environment variables that name folders the engine reads (made absolute for the child)
DIR_VARIABLES = (ENV_CACHE_DIR, "CUPY_CACHE_DIR")


def engine_command() -> list[str]:
    """How to start `strata engine` with this interpreter."""
    module = "strata" if importlib.util.find_spec("strata.__main__") else "strata.cli.main"
    return [sys.executable, SAFE_PATH_FLAG, "-m", module, "engine"]


def engine_argv(command: list[str], args: list[str], parallel: int, alias: str | None) -> list[str]:
    """The child's argv: port 0 (the child binds a free port itself and reports it on stdout, so
    no other process can learn the port before the child holds it); paths made absolute."""
    # --no-access-log: the server writes the one line per request (with the engine's usage)
    argv = [*command, *absolute_paths(args, Path.cwd()), "--parallel", str(parallel), "--host", "127.0.0.1",
            "--port", "0", "--no-access-log"]
    if alias:
        argv += ["--alias", alias]
    return argv


def absolute_paths(args: list[str], base: Path) -> list[str]:
    """args with the relative values of path flags joined to `base`: the child runs in the
    package's folder (package_root), not the user's."""
    from strata.server import config

    if not any(a.partition("=")[0] in config.PATH_FLAGS + config.PACK_RELATIVE_FLAGS for a in args):
        return list(args)
    return config.absolute_paths(args, base)


def package_root() -> str:
    """The folder that holds the strata package (a checkout or site-packages)."""
    return str(Path(__file__).resolve().parents[2])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(ENV_HANDSHAKE, None)
    # `python -m strata` must work even when strata is run from a checkout, not installed
    root = package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONSAFEPATH"] = "1"  # (as -P: for anything the child itself starts with this interpreter)
    env["PYTHONUNBUFFERED"] = "1"
    env[ENV_PARENT_WATCH] = "stdin"
    env[ENV_PARENT_PID] = str(os.getpid())
    env[ENV_HANDSHAKE] = HANDSHAKE
    for var in DIR_VARIABLES:  # the child runs elsewhere: a relative folder means the user's
        if env.get(var) and not os.path.isabs(env[var]):
            env[var] = os.path.abspath(env[var])
    return env


def child_flags() -> dict[str, Any]:
    # Own process group / session: a Ctrl-C in the terminal reaches only the server, which
    # then stops the engine in order (and CTRL_BREAK can target the engine's group on Windows).
    if sys.platform == "win32":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


@dataclass
class Launched:
    """An engine process started, not yet watched: the supervisor adopts it as an EngineChild.
    Its port is known once the child reports it (EngineChild)."""

    proc: subprocess.Popen
    argv: list[str]
    key: str  # this child's own key: a new one for every start
    started_at: float = field(default_factory=time.monotonic)
    adopted: bool = False  # a supervisor watches and stops it now


def launch(argv: list[str]) -> Launched:
    """Start the child in the package's folder (a fixed working directory, so nothing of the
    user's folder is on its path), and hand it a new key over its stdin."""
    key = new_key()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env(), cwd=package_root(), **child_flags())
    try:
        send_key(proc.stdin, key)
    except OSError:  # (the child is already gone: its exit code tells why)
        pass
    return Launched(proc, argv, key)


def launch_first(args: list[str], parallel: int, alias: str | None, command: list[str] | None = None) -> Launched:
    """The server's first engine."""
    return launch(engine_argv(command or engine_command(), args, parallel, alias))
