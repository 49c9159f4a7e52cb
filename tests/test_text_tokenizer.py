"""Byte-level BPE tokenizer against llama.cpp's ids for the test model, plus streaming,
BOS handling, end-of-generation ids and the pre-tokenizer table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from strata.errors import StrataError
from strata.text.bytelevel import BYTE_TO_CHAR
from strata.text.pretokenizers import TABLE
from strata.text.stream import StreamDecoder
from strata.text.tokenizer import Tokenizer
from tests.support.model_fixtures import default_metadata


def shared_dir() -> Path | None:
    for candidate in (os.environ.get("STRATA_SHARED"), Path(__file__).resolve().parents[2] / "shared"):
        if candidate and Path(candidate, "reference").is_dir():
            return Path(candidate)
    return None


def reference(name: str) -> dict:
    shared = shared_dir()
    if shared is None:
        pytest.skip("../shared (or $STRATA_SHARED) is absent")
    return json.loads((shared / "reference" / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def metadata() -> dict:
    return dict(default_metadata())  # a copy: a test may edit its own


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_metadata(metadata)


def test_reference_ids_every_item(tok):
    items = reference("smollm2-tokenize.json")["items"]
    assert items
    wrong = []
    for item in items:
        ids = tok.encode(item["text"], add_special=item["add_special"], parse_special=item["parse_special"])
        if ids != item["ids"]:
            wrong.append((item["text"], ids, item["ids"]))
    assert not wrong, wrong


def test_reference_pieces_and_roundtrip(tok):
    checked = 0
    for item in reference("smollm2-tokenize.json")["items"]:
        # pieces: text when the token's bytes are valid UTF-8, else the list of bytes
        for token_id, piece in zip(item["ids"], item.get("pieces", [])):
            expected = piece.encode("utf-8") if isinstance(piece, str) else bytes(piece)
            assert tok.token_bytes(token_id) == expected, (token_id, piece)
            if isinstance(piece, str):
                assert tok.piece(token_id) == piece
            checked += 1
        if item.get("detokenized_roundtrip_equal"):
            assert tok.decode(item["ids"]) == item["text"]
    assert checked > 100


def test_greedy_completions_decode(tok):
    for item in reference("smollm2-greedy.json")["items"]:
        ids = item["completion_token_ids"]
        # llama.cpp's text leaves out the end-of-generation token that stopped it
        assert tok.decode(ids, skip_special=True) == item["completion_text"]
        assert tok.encode(item["templated_prompt"], add_special=True) == item["prompt_token_ids"]


def test_special_tokens_parsed_or_plain(tok, metadata):
    im_start = metadata["tokenizer.ggml.tokens"].index("<|im_start|>")
    assert tok.encode("<|im_start|>user") == [im_start, tok.encode("user")[0]]
    plain = tok.encode("<|im_start|>user", parse_special=False)
    assert im_start not in plain
    assert tok.decode(plain) == "<|im_start|>user"
    assert tok.is_special(im_start) and not tok.is_special(plain[0])
    assert tok.decode([im_start, *tok.encode("hi")], skip_special=True) == "hi"


def test_ids_and_end_of_generation(tok, metadata):
    tokens = metadata["tokenizer.ggml.tokens"]
    assert tok.vocab_size == len(tokens) == 49152
    assert tok.bos_id == metadata["tokenizer.ggml.bos_token_id"]
    assert tok.eos_id == metadata["tokenizer.ggml.eos_token_id"]
    # eos (<|im_end|>) plus the control token <|endoftext|>; <|im_start|> does not end a turn
    assert tok.eog_ids == {tok.eos_id, tokens.index("<|endoftext|>")}
    assert tok.token_to_id("<|im_end|>") == tokens.index("<|im_end|>")
    assert tok.piece(tok.eos_id) == "<|im_end|>"
    with pytest.raises(StrataError, match="token id 49152"):
        tok.token_bytes(49152)


def test_add_special_adds_one_bos(metadata):
    md = dict(metadata, **{"tokenizer.ggml.add_bos_token": True})
    t = Tokenizer.from_metadata(md)
    bos = t.bos_id
    body = t.encode("Hello")
    assert t.encode("Hello", add_special=True) == [bos, *body]
    assert t.encode("<|im_start|>Hello", add_special=True) == [bos, *body]  # no double BOS
    assert t.encode("", add_special=True) == [bos]
    # the file's own setting (add_bos_token false) adds nothing
    assert Tokenizer.from_metadata(metadata).encode("Hello", add_special=True) == body
    md_eos = dict(metadata, **{"tokenizer.ggml.add_eos_token": True})
    assert Tokenizer.from_metadata(md_eos).encode("Hello", add_special=True) == [*body, t.eos_id]


STREAM_TEXTS = [
    "emoji: 😀🎉👍🏽 🇫🇷 done",
    "日本語のテキストです。中文测试。",
    "mixed Ünïcödé ✓ and 한국어 text 🧪",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_never_splits_characters(tok, text):
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    chunks, held = [], 0
    for i in ids:
        out = stream.feed(i)
        held += out == ""
        assert "\ufffd" not in out
        chunks.append(out)
    chunks.append(stream.flush())
    assert "".join(chunks) == tok.decode(ids) == text
    assert held > 0  # the text has tokens ending mid-character: the check bites


def test_stream_incomplete_tail_and_specials(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    stream = StreamDecoder(tok)
    assert stream.feed(ids[0]) == "" and stream.pending
    assert stream.flush() == "\ufffd"
    skipping = StreamDecoder(tok, skip_special=True)
    assert skipping.feed(tok.eos_id) == ""
    assert StreamDecoder(tok).feed(tok.eos_id) == "<|im_end|>"


# --- metadata errors -------------------------------------------------------------------

def _byte_vocab(pre: str | None, model: str = "gpt2") -> dict:
    """A byte-level vocabulary of the 256 single bytes, no merges: ids are bytes."""
    md = {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.tokens": [BYTE_TO_CHAR[b] for b in range(256)],
        "tokenizer.ggml.token_type": [1] * 256,
        "tokenizer.ggml.merges": [],
    }
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


def test_unknown_pre_and_model_are_named():
    with pytest.raises(StrataError, match="'no-such-pre'"):
        Tokenizer.from_metadata(_byte_vocab("no-such-pre"))
    with pytest.raises(StrataError, match="tokenizer.ggml.model = 'bert'"):
        Tokenizer.from_metadata(_byte_vocab("gpt-2", model="bert"))
    with pytest.raises(StrataError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    bad_types = dict(_byte_vocab("gpt-2"), **{"tokenizer.ggml.token_type": [1] * 10})
    with pytest.raises(StrataError, match="token_type"):
        Tokenizer.from_metadata(bad_types)
    bad_bos = dict(_byte_vocab("gpt-2"), **{"tokenizer.ggml.bos_token_id": 999})
    with pytest.raises(StrataError, match="bos_token_id = 999"):
        Tokenizer.from_metadata(bad_bos)


# --- every pre-tokenizer of the table against an independent regex engine ---------------

PRE_SAMPLE = (
    "Hello World's  THE quick-brown fox,   jumped 1234567 times!\n\n"
    "  indented\tcode();\r\n日本語のテキスト 中文 한국어 ÉCOLE naïve x=1.5e10 'LL 'Re\n"
)


def _isolated_splits(text: str, regexes) -> list[str]:
    """Apply each regex in turn; matches and the text between them all become pieces."""
    regex = pytest.importorskip("regex")
    pieces = [text]
    for pattern in regexes:
        compiled = regex.compile(pattern)
        nxt = []
        for piece in pieces:
            pos = 0
            for m in compiled.finditer(piece):
                if m.start() == m.end():
                    continue
                if m.start() > pos:
                    nxt.append(piece[pos:m.start()])
                nxt.append(m.group())
                pos = m.end()
            if pos < len(piece):
                nxt.append(piece[pos:])
        pieces = nxt
    return pieces


@pytest.mark.parametrize("name", sorted({id(s): n for n, s in TABLE.items()}.values()))
def test_pretokenizer_table(name):
    t = Tokenizer.from_metadata(_byte_vocab(name))
    assert t.pretokenize(PRE_SAMPLE) == _isolated_splits(PRE_SAMPLE, TABLE[name].regexes)
    ids = t.encode(PRE_SAMPLE)
    assert bytes(ids) == PRE_SAMPLE.encode("utf-8")  # ids are the bytes in this vocabulary
    assert t.decode(ids) == PRE_SAMPLE


def test_missing_pre_means_default():
    assert Tokenizer.from_metadata(_byte_vocab(None)).pretokenize("a+=1") == _isolated_splits(
        "a+=1", TABLE["default"].regexes
    )
