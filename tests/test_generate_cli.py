"""`strata generate` as a user runs it: a child process on the real test model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.model_fixtures import chat_ids, default_model_or_skip, engine, run

default_model_or_skip()

QUESTION = "What is the capital of France?"
RAW_PROMPT = "The capital of France is"
BAD_FLAGS = [
    (["--prompt", "x", "--temperature", "warm"], "--temperature"),
    (["--prompt", "x", "--no-such-flag"], "--no-such-flag"),
    (["--max-tokens", "4"], "--prompt"),
    (["--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["--prompt", "x", "--kv", "f8"], "--kv"),
]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "strata.cli.main", "generate", "--device", "cpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class _Children:
    """Every `strata generate` of this module, started at once (none needs another's output:
    two cores run them side by side); done(key) waits for one and returns what it did."""

    def __init__(self, runs: dict[str, list[str]]):
        self.procs = {key: _start(*args) for key, args in runs.items()}

    def done(self, key: str, timeout: float = 180) -> subprocess.CompletedProcess:
        proc = self.procs[key]
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    d = tmp_path_factory.mktemp("generate-cli")
    bogus = d / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    runs = {"json": ["--prompt", QUESTION, "--max-tokens", "8", "--json"],
            "raw": ["--raw", "--prompt", RAW_PROMPT, "--max-tokens", "6"],
            "unknown-pack": ["--pack", str(d / "no-such-model.gguf"), "--prompt", "x"],
            "not-gguf": ["--pack", str(bogus), "--prompt", "x"]}
    runs.update({" ".join(args): args for args, _ in BAD_FLAGS})
    started = _Children(runs)
    yield started
    started.stop()


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: "), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def core(children):  # (after the children started: the model loads here while they run)
    return engine(None, 4)


def test_json_output_matches_the_engine_in_process(core, children):
    done = children.done("json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)  # stdout holds the JSON object only (logs go to stderr)
    assert {"prompt_token_ids", "completion_token_ids", "text", "timings"} <= set(out)
    assert out["prompt_token_ids"] == chat_ids(core, QUESTION)
    events, fin = run(core, out["prompt_token_ids"], max_tokens=8, temperature=0.0)
    assert out["completion_token_ids"] == [e.token_id for e in events]
    assert out["text"] == "".join(e.text for e in events) + fin.text_tail
    assert "Paris" in out["text"]
    assert out["finish_reason"] == fin.reason
    t = out["timings"]
    assert t["load_s"] > 0 and t["total_s"] > 0 and t["tokens_per_s"] > 0


def test_raw_prompt_skips_the_chat_template_and_streams_text(core, children):
    done = children.done("raw")
    assert done.returncode == 0, done.stderr
    ids = core.tokenizer.encode(RAW_PROMPT, add_special=True)
    assert len(ids) < 10  # no system prompt, no role markers
    events, fin = run(core, ids, max_tokens=6, temperature=0.0)
    assert done.stdout == "".join(e.text for e in events) + fin.text_tail + "\n"


@pytest.mark.parametrize("args, fragment", BAD_FLAGS)
def test_bad_flag_exits_2_with_one_line(children, args, fragment):
    assert_one_line_error(children.done(" ".join(args)), fragment)


def test_unknown_pack_exits_2_naming_it(children):
    assert_one_line_error(children.done("unknown-pack"), "no-such-model")


def test_pack_that_is_not_gguf_exits_2(children):
    assert_one_line_error(children.done("not-gguf"), "model.gguf")
