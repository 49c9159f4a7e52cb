"""The default BLAS thread count follows what the machine is doing, not its core count: the
cores other work leaves free (usable cores minus the 1-minute load average), said in the
engine's start-up line; --threads and STRATA_CPU_THREADS still set it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from threadpoolctl import threadpool_info

from strata.backend.cpu import ENV_THREADS, CpuBackend, default_threads
from support.server_proc import ROOT
from tests.support.model_fixtures import default_model_or_skip

LINE = re.compile(r"^strata: cpu: (\d+) BLAS threads? \((.*)\)$", re.M)


@pytest.mark.parametrize("cores,load,want", [
    (2, 0.0, 2),   # a quiet machine: every core
    (2, 0.4, 2),   # 1.6 cores free: rounded up
    (2, 0.6, 1),   # 1.4 free: one thread, not one spinning against other work
    (2, 6.7, 1),   # busy: at least one thread
    (8, 3.2, 5),
    (64, 0.0, 64),
    (1, 0.0, 1),
    (4, None, 4),  # no load average (Windows): every usable core
])
def test_the_default_is_the_free_cores(cores, load, want):
    assert default_threads(cores, load) == want


def _blas_threads() -> set[int]:
    return {m["num_threads"] for m in threadpool_info() if m["user_api"] == "blas"}


def test_the_backend_runs_with_the_count_it_says(monkeypatch):
    monkeypatch.delenv(ENV_THREADS, raising=False)
    before = _blas_threads()
    b = CpuBackend()
    n, why = LINE.match(b.start_line()).groups()
    cores, load = re.match(r"(\d+) usable cores, 1-minute load average ([\d.]+);", why).groups()
    # (the load the line shows is rounded to 2 places: the choice from it can differ only at a x.5 edge)
    assert abs(int(n) - default_threads(int(cores), float(load))) <= 1
    assert int(n) == b.threads
    try:
        b.window(1)
        if before:  # (a numpy without a BLAS threadpoolctl knows has nothing to limit)
            assert _blas_threads() == {b.threads}
    finally:
        if before:  # the worker's own share again, for the tests after this one
            CpuBackend(threads=max(before)).window(1)


def test_the_flag_and_the_variable_are_said_as_the_reason(monkeypatch):
    monkeypatch.setenv(ENV_THREADS, "1")
    assert CpuBackend().start_line() == f"strata: cpu: 1 BLAS thread ({ENV_THREADS}=1)"
    assert CpuBackend(threads=1).start_line() == "strata: cpu: 1 BLAS thread (--threads 1)"


def test_strata_generate_says_the_count_it_chose():
    """A real `strata generate` with neither --threads nor STRATA_CPU_THREADS: its start-up line
    names the count and the numbers it was chosen from."""
    default_model_or_skip()
    env = {k: v for k, v in os.environ.items() if k != ENV_THREADS}
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--prompt", "Hi", "--max-tokens", "2",
                        "--temperature", "0", "--spec", "0", "--max-context", "256", "--json", "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    said = [ln for ln in lines if LINE.match(ln)]
    assert len(said) == 1, lines
    n, why = LINE.match(said[0]).groups()
    m = re.fullmatch(r"(\d+) usable cores, 1-minute load average ([\d.]+); --threads N sets it", why)
    assert m, why
    cores, load = int(m.group(1)), float(m.group(2))
    assert 1 <= int(n) <= cores and abs(int(n) - default_threads(cores, load)) <= 1
    at = lines.index(said[0])  # after the pack's line (a pack that fails to open stays one line), before its load
    assert lines[at - 1].startswith("strata: pack ") and lines[at + 1].startswith("strata: loading "), lines
