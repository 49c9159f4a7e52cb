"""Text that is not Unicode (a lone UTF-16 surrogate: what Python makes of bytes that are not
UTF-8 in argv or on standard input, or of a "\\ud800" escape) is refused in one line naming where
it came from, wherever it reaches the tokenizer: the HTTP edge refuses it first
(tests/test_server_hostile.py), the CLI's flags and standard input here, and the tokenizer
itself for any other caller. Real child processes for the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata.errors import StrataError
from support.server_proc import ROOT
from tests.support.model_fixtures import default_model_or_skip


def strata(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    # (argv strings with surrogates reach the child as the bytes they escape: os.fsencode)
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], cwd=ROOT, input=stdin,
                          capture_output=True, timeout=120)


def one_line(done: subprocess.CompletedProcess) -> str:
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2, (done.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def model():
    return str(default_model_or_skip())


@pytest.mark.parametrize("flag", ["--prompt", "--system", "--stop"])
def test_generate_names_the_flag_whose_bytes_are_not_utf8(model, flag):
    args = ["generate", "--pack", model, "--max-tokens", "1", "--prompt", "hi"]
    args += [flag, "ab\udcffc"]  # the byte 0xFF, as argv brings it
    line = one_line(strata(*args))
    assert line.startswith(f"strata: {flag}: character 2 is a lone UTF-16 surrogate U+DCFF") and "0xFF" in line


def test_tokenize_names_its_argument_and_standard_input(model):
    line = one_line(strata("tokenize", "--pack", model, "x\udcc3"))
    assert "the text to tokenize: character 1" in line and "0xC3 is not UTF-8" in line
    line = one_line(strata("tokenize", "--pack", model, "-", stdin=b"fine\n\xed\xa0\x80"))
    assert line.startswith("strata: standard input: character 5 is a lone UTF-16 surrogate")
    ok = strata("tokenize", "--pack", model, "-", stdin="caf\u00e9".encode())
    assert ok.returncode == 0 and ok.stdout.split(), ok.stderr


def test_the_tokenizer_refuses_a_lone_surrogate_in_one_line(model):
    from strata.pack.loader import open_pack
    from strata.text.tokenizer import Tokenizer

    pack = open_pack(pack=model)
    try:
        tok = Tokenizer.from_metadata(pack.metadata)
    finally:
        pack.close()
    for text, at in (("\ud800", 0), ("ok \udfff", 3), ("a\udc80b", 1)):
        with pytest.raises(StrataError, match=rf"^text to tokenize: character {at} is a lone UTF-16 surrogate"):
            tok.encode(text)
    assert tok.encode("\U0001F600 ok")  # a real astral character (a surrogate pair in UTF-16) is fine
