"""A new user's mistakes, each one line and exit code 2 at once, as real child processes:
`strata serve` with a pack that is missing or that its engine refuses, `parallel` against
`--parallel`, `strata inspect` without a pack, `strata tokenize --help`, and `strata generate`
sampling flags outside the ranges the HTTP API takes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from strata.sampling.bounds import SAMPLING_BOUNDS
from strata.errors import StrataError
from strata.server.config import config_from_dict
from strata.server.errors import APIError
from strata.server.schemas import CompletionRequest, parse_request
from support.early import Early, finish, selected, strata_later
from support.server_proc import HTTP, ROOT, metric, spawn_serve, wait_until
from tests.support.model_fixtures import default_model_or_skip


def strata(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def early(request, tmp_path_factory):
    """The two `strata serve` runs that load the test model start with the module, in the
    background: they load while the quick tests run (each test still takes its own run)."""
    e = Early()
    try:
        try:
            default_model_or_skip()
            model = True
        except pytest.skip.Exception:
            model = False  # (the tests that need it skip themselves)
        if model and selected(request, "test_serve_stops_when_its_first_engine_refuses_the_pack"):
            e.start("refused", lambda: refused_pack_serve(tmp_path_factory.mktemp("refused")))
        if model and selected(request, "test_an_engine_that_had_served_is_restarted_with_back_off"):
            e.start("back-off", lambda: linked_pack_serve(tmp_path_factory.mktemp("back-off")))
        yield e
    finally:
        e.close()


def one_line(done: subprocess.CompletedProcess) -> str:
    """The one line of a user error (exit code 2, no traceback, nothing else on stderr)."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: ") and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def _config(tmp_path, data: dict):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- strata serve

def test_serve_with_a_missing_pack_stops_at_once(tmp_path):
    cfg = _config(tmp_path, {"args": ["--pack", "models/nope.gguf"]})
    line = one_line(strata("serve", "--config", str(cfg), "--port", "0"))
    # the relative path taken from the config's folder, named with the config and its key
    assert line == f"strata: {cfg}: args: pack {tmp_path.resolve() / 'models/nope.gguf'}: no such file or directory"


@pytest.mark.parametrize("args,fragment", [
    (["--mtp", "no-draft.gguf", "--spec", "1"], "--mtp"),
    (["--pack", "not-a-pack.gguf"], "not a GGUF file"),
    (["--kv", "int4"], "argument --kv"),
])
def test_serve_refuses_before_starting_an_engine(tmp_path, args, fragment):
    (tmp_path / "not-a-pack.gguf").write_bytes(b"no GGUF here" * 8)
    line = one_line(strata("serve", "--config", str(_config(tmp_path, {"args": args})), "--port", "0"))
    assert fragment in line


def _wrong_draft(path):
    """An MTP draft for a model of another width: found, but refused by the engine as it loads."""
    from strata.mtp.train.export import write_draft

    e = 64
    rng = np.random.default_rng(0)
    # (its metadata says the model's width, 576, so the check of its keys before start-up passes;
    # its tensors are 64 wide, which the engine finds as it loads them)
    return write_draft(path, {"enorm": np.ones(e, np.float32), "hnorm": np.ones(e, np.float32),
                              "eh_proj": rng.standard_normal((e, 2 * e)).astype(np.float32),
                              "output_norm": np.ones(e, np.float32)}, target_arch="llama", n_embd=576)


def refused_pack_serve(tmp_path) -> subprocess.Popen:
    draft = _wrong_draft(tmp_path / "wrong.mtp.gguf")
    cfg = _config(tmp_path, {"args": ["--mtp", str(draft), "--spec", "1", "--max-context", "256"]})
    return strata_later("serve", "--config", str(cfg), "--port", "0")


def test_serve_stops_when_its_first_engine_refuses_the_pack(tmp_path, early):
    default_model_or_skip()
    done = finish(early.take("refused", lambda: refused_pack_serve(tmp_path)), timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("strata: the engine could not start: ") and "mtp.enorm.weight" in last
    assert "Traceback" not in done.stderr and "next attempt" not in done.stderr


def linked_pack_serve(tmp_path):
    """A `strata serve` of the test model through a symbolic link, and the link."""
    link = tmp_path / "pack.gguf"
    link.symlink_to(default_model_or_skip())
    return spawn_serve(tmp_path, {"args": ["--pack", str(link), "--max-context", "256"]}), link


def test_an_engine_that_had_served_is_restarted_with_back_off(tmp_path, early):
    """Only an engine that was ready once is started again; when that restart is refused (here:
    the pack is gone), requests get 503 with the reason and the server stays up."""
    p, link = early.take("back-off", lambda: linked_pack_serve(tmp_path))
    try:
        p.wait_listening()
        p.wait_healthy()
        link.unlink()
        os.kill(p.engine_pids()[0], signal.SIGKILL)
        assert wait_until(lambda: HTTP.get(p.url + "/health", timeout=5).status_code == 503, 60)  # (a hang guard)
        r = HTTP.post(p.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_start_failed"
        assert f"pack {link}: no such file or directory" in r.json()["error"]["message"]
        r2 = HTTP.post(p.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r2.status_code == 503 and "next attempt in" in r2.json()["error"]["message"]
        assert metric(p.url, "strata_server_engine_starts_total") == 2
        assert p.stop(signal.SIGTERM) == 0
    finally:
        p.kill_tree()


def test_parallel_key_against_parallel_flag(tmp_path):
    with pytest.raises(StrataError) as e:
        config_from_dict({"parallel": 2, "args": ["--parallel", "3"]}, "c.json")
    assert e.value.message == "c.json: parallel: 2 disagrees with args' --parallel 3; give one of them"
    assert config_from_dict({"parallel": 3, "args": ["--parallel=3"]}, "c.json").engine_parallel() == 3
    assert config_from_dict({"args": ["--parallel", "3"]}, "c.json").engine_parallel() == 3
    cfg = _config(tmp_path, {"parallel": 2, "args": ["--parallel", "3"]})
    assert "parallel: 2 disagrees with args' --parallel 3" in one_line(strata("serve", "--config", str(cfg)))


# ---------------------------------------------------------------- inspect, tokenize

def test_inspect_without_a_pack_names_its_own_argument():
    line = one_line(strata("inspect"))
    assert "strata inspect DIR|FILE.gguf" in line and "--pack" not in line


def test_tokenize_help_lists_only_what_tokenize_uses():
    done = strata("tokenize", "--help")
    assert done.returncode == 0
    for flag in ("--pack", "--native", "--ple-gguf", "--json", "--no-special", "--add-special"):
        assert flag in done.stdout
    for flag in ("--spec", "--device", "--parallel", "--kv", "--batch-mtp", "--max-context"):
        assert flag not in done.stdout, flag


# ---------------------------------------------------------------- generate's sampling flags

# flag, field, values just outside the field's range (and a non-number)
OUTSIDE = {
    "--temperature": ("temperature", ["2.5", "-0.1", "nan"]),
    "--top-p": ("top_p", ["5", "0", "1.01"]),
    "--min-p": ("min_p", ["1.5", "-1"]),
    "--top-k": ("top_k", ["-1", "1.5", str(2**31 + 1)]),
    "--max-tokens": ("max_tokens", ["0", str(2**30 + 1)]),
}


@pytest.mark.parametrize("flag,value", [(f, v) for f, (_, vs) in OUTSIDE.items() for v in vs])
def test_generate_refuses_sampling_flags_outside_the_api_ranges(flag, value):
    line = one_line(strata("generate", "--device", "cpu", "--prompt", "x", flag, value))
    field = OUTSIDE[flag][0]
    assert flag in line and SAMPLING_BOUNDS[field].describe() in line


@pytest.mark.parametrize("field", sorted(SAMPLING_BOUNDS))
def test_the_api_takes_the_same_ranges(field):
    """One table: the request schema refuses what generate refuses, and takes the ends it takes."""
    b = SAMPLING_BOUNDS[field]
    step = 1 if b.whole else 1e-6
    inside = [b.high] + ([] if b.low_open else [b.low])
    outside = [b.high + step, b.low if b.low_open else b.low - step]
    for value in inside:
        parse_request(CompletionRequest, json.dumps({"prompt": "x", field: value}).encode())
    for value in outside:
        with pytest.raises(APIError) as e:
            parse_request(CompletionRequest, json.dumps({"prompt": "x", field: value}).encode())
        assert e.value.body()["error"]["param"] == field
    assert not b.holds(math.nan)
