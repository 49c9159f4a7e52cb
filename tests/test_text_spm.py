"""SentencePiece-style (`llama`) vocabularies on a small synthetic vocabulary.

The expectation is an independent re-implementation of llama.cpp's SPM algorithm, which
works differently from ours: it merges the adjacent pair whose joined text is the
best-scoring token, over and over (ours runs BPE with merges derived from the scores), then
spells characters missing from the vocabulary as <0xNN> byte tokens.
"""

from __future__ import annotations

import random

import pytest

from strata.errors import StrataError
from strata.text.tokenizer import Tokenizer

SP = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]  # types 2, 3, 3
USER = "<tool>"  # type 4

BASE_CHARS = SP + "abcdehlnorstw"
# (piece, score): higher is better; every score distinct so that no tie decides anything
PIECES = [
    ("el", -1.05), ("he", -1.1), (SP + "t", -1.0), (SP + "the", -1.2), ("ll", -1.3),
    ("lo", -1.35), ("llo", -1.5), (SP + "he", -1.6), (SP + "hello", -1.7), ("hel", -1.8),
    ("or", -1.9), (SP + "w", -1.95), ("wor", -2.0), (SP + "wor", -2.1), ("ld", -2.2),
    (SP + "world", -2.3), ("an", -2.4), (SP + "an", -2.5), (SP + "and", -2.6), ("at", -2.7),
    (SP + "c", -2.8), (SP + "cat", -2.9), ("th", -3.0), ("st", -3.1), ("es", -3.2), ("est", -3.3),
    ("hello", -3.4), ("ne", -3.5), ("ro", -3.6),
]


def synthetic_vocab(add_space_prefix: bool | None = None, add_bos: bool | None = None) -> dict:
    tokens, types, scores = [], [], []
    for i, s in enumerate(SPECIALS):
        tokens.append(s), types.append(2 if i == 0 else 3), scores.append(0.0)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>"), types.append(6), scores.append(0.0)
    for i, c in enumerate(BASE_CHARS):
        tokens.append(c), types.append(1), scores.append(-10.0 - i * 0.01)
    for piece, score in PIECES:
        tokens.append(piece), types.append(1), scores.append(score)
    tokens.append(USER), types.append(4), scores.append(0.0)
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    if add_space_prefix is not None:
        md["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = add_bos
    return md


def reference_encode(md: dict, text: str, parse_special: bool = True) -> list[int]:
    """llama.cpp's SPM tokenization, written out plainly (quadratic, fine for tests)."""
    tokens, types, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.scores"]
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    matchable = [t for i, t in enumerate(tokens) if types[i] == 4 or (parse_special and types[i] in (2, 3))]
    prefix = md.get("tokenizer.ggml.add_space_prefix", True)

    fragments: list[str | int] = [text]  # str = raw text, int = a matched token id
    for special in sorted(matchable, key=len, reverse=True):
        nxt = []
        for frag in fragments:
            if isinstance(frag, int):
                nxt.append(frag)
                continue
            parts = frag.split(special)
            for k, part in enumerate(parts):
                if k:
                    nxt.append(tokens.index(special))
                if part:
                    nxt.append(part)
        fragments = nxt

    out, prev_special = [], True
    for frag in fragments:
        if isinstance(frag, int):
            out.append(frag)
            prev_special = True
            continue
        s = (SP if prefix and prev_special else "") + frag.replace(" ", SP)
        prev_special = False
        symbols = list(s)
        while True:
            best = None
            for k in range(len(symbols) - 1):
                joined = symbols[k] + symbols[k + 1]
                if joined in normal and (best is None or scores[normal[joined]] > scores[normal[best[1]]]):
                    best = (k, joined)  # strict '>' keeps the leftmost of equal scores
            if best is None:
                break
            k, joined = best
            symbols[k:k + 2] = [joined]
        for sym in symbols:
            if sym in normal:
                out.append(normal[sym])
            else:
                out.extend(tokens.index(f"<0x{b:02X}>") for b in sym.encode("utf-8"))
    return out


@pytest.fixture(scope="module")
def spm():
    md = synthetic_vocab()
    return md, Tokenizer.from_metadata(md)


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


def test_hand_checked_cases(spm):
    md, tok = spm
    # by hand: ▁ h e l l o -> 'el' (-1.05, best of he/el/ll/lo) -> 'lo' (-1.35, beats 'hel')
    # -> 'hel' -> 'hello' (-3.4) -> '▁hello' (-1.7)
    assert pieces(tok, tok.encode("hello")) == [SP + "hello"]
    assert pieces(tok, tok.encode("the cat")) == [SP + "the", SP + "cat"]
    assert pieces(tok, tok.encode("hello world")) == [SP + "hello", SP + "world"]
    # 'é' is not in the vocabulary: its two UTF-8 bytes
    assert pieces(tok, tok.encode("é")) == [SP, "<0xC3>", "<0xA9>"]


CASES = [
    "hello world", "the cat and the hat", "  two  spaces ", "", "a", "wordless",
    "hello<s>world</s>", "<s>hello", "tool<tool>use", "newline\nhere", "café ☕ hello 😀",
    "<unk> unknown", "helloworld thestest",
]


@pytest.mark.parametrize("text", CASES)
def test_matches_llama_cpp_algorithm(spm, text):
    md, tok = spm
    assert tok.encode(text) == reference_encode(md, text)
    assert tok.encode(text, parse_special=False) == reference_encode(md, text, parse_special=False)


def test_random_strings(spm):
    md, tok = spm
    rng = random.Random(1234)
    alphabet = "abcdehlnorstw  éx"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        assert tok.encode(text) == reference_encode(md, text), text


def test_no_space_prefix():
    md = synthetic_vocab(add_space_prefix=False)
    tok = Tokenizer.from_metadata(md)
    for text in ("hello world", "hello<s>hello", " the"):
        assert tok.encode(text) == reference_encode(md, text)
    assert pieces(tok, tok.encode("hello")) == ["hello"]


def test_bos_and_decode(spm):
    md, tok = spm
    assert tok.add_bos  # SentencePiece vocabularies add BOS unless the file says otherwise
    body = tok.encode("hello")
    assert tok.encode("hello", add_special=True) == [1, *body]
    assert tok.encode("<s>hello", add_special=True) == [1, *body]
    assert not Tokenizer.from_metadata(synthetic_vocab(add_bos=False)).encode("hello", add_special=True)[0] == 1
    ids = tok.encode("café hello")
    assert tok.decode(ids) == " café hello"  # the '▁' prefix is a space; bytes rejoin to 'é'
    assert tok.token_bytes(tok.token_to_id("<0x0A>")) == b"\n"
    assert tok.decode([1, *ids, 2], skip_special=True) == " café hello"
    assert tok.decode([1, *ids]).startswith("<s>")
    assert tok.eog_ids == {2}
    assert tok.is_special(0) and tok.is_special(1) and not tok.is_special(tok.token_to_id(USER))


def test_missing_scores_is_an_error():
    md = synthetic_vocab()
    del md["tokenizer.ggml.scores"]
    with pytest.raises(StrataError, match="tokenizer.ggml.scores"):
        Tokenizer.from_metadata(md)
