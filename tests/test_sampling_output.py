"""TextOutput (strata/batch/output.py): UTF-8-safe deltas and stop strings.

Tokens are given as byte strings (a token's bytes are all TextOutput sees), plus one run on
the test model's real tokenizer.
"""

from __future__ import annotations


from strata.batch.output import TextOutput
from tests.support.model_fixtures import default_model_or_skip


def feed_all(pieces: list[bytes], stop: list[str]) -> tuple[list[str], TextOutput]:
    table = dict(enumerate(pieces))
    out = TextOutput(table.__getitem__, stop)
    deltas = []
    for i in range(len(pieces)):
        deltas.append(out.feed(i))
        if out.stopped:
            break
    return deltas, out


def test_plain_text_passes_through_token_by_token():
    deltas, out = feed_all([b"Hello", b",", b" world"], [])
    assert deltas == ["Hello", ",", " world"]
    assert out.finish() == "" and out.text == "Hello, world"


def test_stop_string_split_across_tokens_is_never_shown():
    deltas, out = feed_all([b"Hel", b"lo S", b"TO", b"P and more", b"never fed"], ["STOP"])
    assert out.stopped
    assert deltas == ["Hel", "lo ", "", ""]  # "S" and "STO" held: they may begin "STOP"
    assert out.text == "Hello "
    assert all("S" not in d for d in deltas)


def test_held_prefix_is_released_when_it_stops_matching():
    deltas, out = feed_all([b"a ST", b"ART"], ["STOP"])
    assert deltas == ["a ", "START"]
    assert not out.stopped


def test_held_text_is_released_at_finish():
    deltas, out = feed_all([b"abc S", b"TO"], ["STOP"])
    assert deltas == ["abc ", ""]
    assert out.finish() == "STO"
    assert out.text == "abc STO"


def test_stop_inside_one_token_cuts_before_it():
    deltas, out = feed_all([b"x", b"yz</end>tail"], ["</end>"])
    assert deltas == ["x", "yz"] and out.stopped and out.text == "xyz"


def test_earliest_stop_string_wins():
    deltas, out = feed_all([b"hello world"], ["world", "hello"])
    assert out.stopped and out.text == ""


def test_multibyte_characters_split_across_tokens_never_break():
    # é = C3 A9, € = E2 82 AC, 🙂 = F0 9F 99 82
    pieces = [b"caf\xc3", b"\xa9 ", b"\xe2\x82", b"\xac", b"\xf0", b"\x9f", b"\x99", b"\x82!"]
    deltas, out = feed_all(pieces, [])
    assert "".join(deltas) + out.finish() == "café €🙂!"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas == ["caf", "é ", "", "€", "", "", "", "🙂!"]


def test_stop_string_of_multibyte_characters_split_mid_character():
    deltas, out = feed_all([b"price: 5\xe2", b"\x82\xac\xe2\x82", b"\xac more"], ["€€"])
    assert out.stopped and out.text == "price: 5"
    assert all("\ufffd" not in d and "€" not in d for d in deltas)


def test_unfinished_character_at_finish_becomes_one_replacement_char():
    deltas, out = feed_all([b"ok\xe2\x82"], [])
    assert deltas == ["ok"]
    assert out.finish() == "\ufffd"


def test_real_tokenizer_stream_equals_decoding_and_cuts_at_stop():
    from strata.gguf.reader import GGUFFile
    from strata.text.tokenizer import Tokenizer

    with GGUFFile(default_model_or_skip()) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    text = "Déjà vu: naïve café 🙂 costs 5€. The END is near."
    ids = tok.encode(text, add_special=False)
    out = TextOutput(tok.token_bytes, [])
    deltas = [out.feed(i) for i in ids]
    assert "".join(deltas) + out.finish() == text
    assert all("\ufffd" not in d for d in deltas)

    out = TextOutput(tok.token_bytes, [" END"])
    streamed = ""
    for i in ids:
        streamed += out.feed(i)
        if out.stopped:
            break
    assert out.stopped and streamed == out.text == "Déjà vu: naïve café 🙂 costs 5€. The"
