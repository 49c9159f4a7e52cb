"""Child processes that a test module starts early, in the background, for tests that run later
in it: a `strata serve` or `strata engine` takes ~4 s to load the model (more on a loaded
machine), time that then overlaps the module's other tests (and the other children's loading)
instead of adding to the module's wall time. A test takes its child as it would have started it
and asserts the same things; only the moment the child was started moves.

A child is started only for a test that this session runs (selected(), so that `-k` or a
deselection does not start what no test will use); whatever no test took is killed with the
module (a module-scoped fixture's teardown: close())."""

from __future__ import annotations

import subprocess
import sys
from typing import Callable, TypeVar

from support.server_proc import ROOT

T = TypeVar("T")


def strata_later(*args: str) -> subprocess.Popen:
    """subprocess.run([python, -m, strata.cli.main, *args], cwd=ROOT, capture_output=True,
    text=True) started now; finish() waits for it."""
    return subprocess.Popen([sys.executable, "-m", "strata.cli.main", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """What subprocess.run(..., timeout=timeout) returns (or raises) for a child already started."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def selected(request, *names: str) -> bool:
    """Whether a test of the requesting module named one of `names` (with its parameters, as
    "test_x[True]", or without, for any of them) runs in this session."""
    return any(getattr(item, "module", None) is request.module
               and (item.name in names or getattr(item, "originalname", item.name) in names)
               for item in request.session.items)


def _stop(child) -> None:
    if isinstance(child, tuple):  # (a child, what the test needs with it)
        for part in child:
            _stop(part)
    elif hasattr(child, "kill_tree"):  # a StrataProcess: its engine too
        child.kill_tree()
    elif isinstance(child, subprocess.Popen) and child.poll() is None:
        child.kill()
        child.communicate(timeout=10)


class Early:
    """Children by key: start() now, take() in the test (or start it then, if nobody did)."""

    def __init__(self) -> None:
        self._children: dict[str, object] = {}

    def start(self, key: str, spawn: Callable[[], T]) -> None:
        self._children[key] = spawn()

    def take(self, key: str, spawn: Callable[[], T]) -> T:
        child = self._children.pop(key, None)
        return child if child is not None else spawn()

    def close(self) -> None:
        children, self._children = list(self._children.values()), {}
        for child in children:
            _stop(child)
