"""`strata tokenize` as a user runs it: a child process, real model file, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.model_fixtures import default_model_or_skip

try:
    from test_text_tokenizer import reference
except ImportError:  # tests/ imported as a package
    from tests.test_text_tokenizer import reference

default_model_or_skip()


def strata(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata.cli.main", "tokenize", *args],
        capture_output=True, text=True, timeout=60,
    )


def _item(text: str, parse_special: bool) -> dict:
    items = reference("smollm2-tokenize.json")["items"]
    return next(i for i in items if i["text"] == text and i["parse_special"] == parse_special)


def test_default_model_plain_and_json():
    item = _item("Hello, world!", True)
    done = strata(item["text"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(i) for i in item["ids"]]
    done = strata("--json", item["text"])
    assert json.loads(done.stdout) == {"ids": item["ids"]}


def test_special_tokens_parsed_unless_no_special():
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    plain = _item(text, False)
    done = strata("--json", "--no-special", text)
    assert json.loads(done.stdout)["ids"] == plain["ids"]
    parsed = json.loads(strata("--json", text).stdout)["ids"]
    assert parsed[0] == 1 and len(parsed) < len(plain["ids"])  # <|im_start|> is id 1 in this vocab


def test_explicit_pack_and_bad_pack():
    done = strata("--pack", str(default_model_or_skip()), "--json", "")
    assert done.returncode == 0 and json.loads(done.stdout) == {"ids": []}
    done = strata("--pack", "/nonexistent/model.gguf", "x")
    assert done.returncode == 2
    assert done.stderr.startswith("strata: ") and "/nonexistent/model.gguf" in done.stderr
    assert "Traceback" not in done.stderr
