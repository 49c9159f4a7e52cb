"""`strata serve --config`: what a hostile or mistyped file holds is one line naming the file and
the key (exit 2 on the command line), never a traceback, a hang or a server without its key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata.errors import StrataError
from strata.server.config import MAX_CONFIG_BYTES, NUMBER_BOUNDS, load_config
from support.server_proc import ROOT


def _refusal(tmp_path: Path, text: str) -> str:
    f = tmp_path / "c.json"
    f.write_text(text)
    with pytest.raises(StrataError) as e:
        load_config(str(f))
    msg = e.value.message
    assert "\n" not in msg and msg.startswith(f"{f}: ")
    return msg[len(f"{f}: "):]


@pytest.mark.parametrize("text,words", [
    ('{"api_key": ""}', "api_key: empty"),
    ('{"api_key": "   "}', "api_key: empty"),
    ('{"api_key": " secret"}', "api_key: begins or ends with white space"),
    ('{"api_key": "sécret"}', "api_key: only printable ASCII"),
    # json keeps the last of two values without a word: here it would turn the key off
    ('{"api_key": "secret", "api_key": ""}', "api_key: given twice"),
    ('{"port": 8080, "port": 9090}', "port: given twice"),
])
def test_api_key_and_duplicate_keys_are_refused(tmp_path, text, words):
    assert _refusal(tmp_path, text).startswith(words)


@pytest.mark.parametrize("text,words", [
    ('{"max_request_bytes": 1000000000000000}', "max_request_bytes: Input should be less than or equal to"),
    ('{"max_request_bytes": 1e15}', "max_request_bytes: Input should be a valid integer"),
    ('{"request_timeout": Infinity}', "request_timeout: Input should be a finite number"),
    ('{"body_timeout": -Infinity}', "body_timeout: Input should be a finite number"),
    ('{"shutdown_timeout": NaN}', "shutdown_timeout: Input should be a finite number"),
    ('{"startup_timeout": 1e300}', "startup_timeout: Input should be less than or equal to"),
    ('{"parallel": 100000}', "parallel: Input should be less than or equal to"),
    ('{"port": %s}' % ("9" * 5000), "port: Input should be a valid integer (got <an integer of 5000 digits>)"),
    ('{"args": ["--spec", %s]}' % ("1" * 5000), "args[1]: Input should be a valid string"),
])
def test_numbers_are_finite_and_bounded_per_key(tmp_path, text, words):
    assert _refusal(tmp_path, text).startswith(words)


def test_every_numeric_key_has_bounds_and_its_bounds_are_accepted(tmp_path):
    for key, (lo, hi) in NUMBER_BOUNDS.items():
        for value in (max(lo, 1), hi):
            f = tmp_path / "c.json"
            f.write_text('{"%s": %r}' % (key, value))
            assert getattr(load_config(str(f)), key) == value


@pytest.mark.parametrize("text,words", [
    ("[" * 100_000 + "]" * 100_000, "nested more than"),
    ('{"args": ' + "[" * 100_000 + "]" * 100_000 + "}", "args: nested more than"),
    ('{"model": {"a": ' + '{"b": ' * 50_000 + "1" + "}" * 50_001 + "}", "model: nested more than"),
])
def test_deep_nesting_is_one_line_naming_the_key(tmp_path, text, words):
    assert _refusal(tmp_path, text).startswith(words)


def test_brackets_inside_strings_are_not_nesting(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"model": "%s\\"%s", "api_key": "k"}' % ("[" * 100, "{" * 100))
    assert load_config(str(f)).model == "[" * 100 + '"' + "{" * 100


def test_files_that_are_not_regular_or_too_large_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_text("{" + " " * MAX_CONFIG_BYTES + "}")
    for path, words in [("/dev/zero", "not a regular file"), (str(fifo), "not a regular file"),
                        (str(tmp_path), "not a regular file"), (str(big), "larger than 1 MiB")]:
        with pytest.raises(StrataError, match=words) as e:
            load_config(path)
        assert e.value.message.startswith(f"config file {path}: ")


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_refuses_a_fifo_and_an_empty_key_in_one_line_exit_2(tmp_path):
    # before: the FIFO blocked `strata serve` in open() (the timeout above ends the test)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = _serve("--config", str(fifo))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"strata: config file {fifo}: not a regular file"]
    f = tmp_path / "c.json"
    f.write_text('{"api_key": "secret",\n "api_key": ""}')
    r = _serve("--config", str(f))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"strata: {f}: api_key: given twice in one object; give it once"]
