"""Numeric engine flags have bounds (one table, FLAG_BOUNDS): a value past them is one line naming
the flag and exit code 2, before anything loads (--port 99999 ended in an OverflowError from
bind(), --threads 100000 started 66 threads on 2 cores, --watchdog-s 0.001 restarted the engine
at every window)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strata.engine.options import FLAG_BOUNDS, parse_engine_args
from strata.errors import StrataError
from support.server_proc import ROOT


def _past(flag: str) -> list[str]:
    b = FLAG_BOUNDS[flag]
    high = b.top()
    return [str(b.low - 1), str(int(high) + 1 if b.whole else high * 2)]


@pytest.mark.parametrize("flag", sorted(FLAG_BOUNDS))
def test_every_bounded_flag_refuses_both_sides_and_takes_its_bounds(flag):
    b = FLAG_BOUNDS[flag]
    for value in _past(flag):
        with pytest.raises(StrataError, match=rf"^bad engine flag: argument {flag}: expected .* got '{value}'$"):
            parse_engine_args([flag, value])
    for value in (b.low, b.top()):
        text = str(int(value)) if b.whole else str(value)
        parse_engine_args([flag, text])  # both ends are taken


@pytest.mark.parametrize("flag", [f for f, b in FLAG_BOUNDS.items() if not b.whole])
def test_seconds_refuse_nan_and_infinity(flag):
    for value in ("nan", "inf"):
        with pytest.raises(StrataError, match=rf"argument {flag}:"):
            parse_engine_args([flag, value])


def test_the_reported_values():
    assert FLAG_BOUNDS["--port"].top() == 65535 and FLAG_BOUNDS["--watchdog-s"].low >= 1
    assert FLAG_BOUNDS["--threads"].top() == (os.cpu_count() or 1)


def _strata(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,flag", [
    (["engine", "--port", "99999"], "--port"),
    (["serve", "--port", "99999"], "--port"),
    (["generate", "--prompt", "Hi", "--threads", "100000"], "--threads"),
    (["engine", "--watchdog-s", "0.001"], "--watchdog-s"),
])
def test_the_command_line_says_one_line_and_exits_2(args, flag):
    r = _strata(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}: expected" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("key,why", [("", "is empty"), ("   ", "is empty"), (" k", "white space"), ("clé", "ASCII")])
def test_an_api_key_no_client_can_send_is_one_line(key, why):
    # "" would serve with no auth at all and "   " would lock everyone out (as the config's api_key)
    r = _strata("engine", "--api-key", key)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "argument --api-key: the key" in lines[0] and why in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
