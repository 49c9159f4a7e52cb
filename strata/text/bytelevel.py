"""GPT-2's byte-level alphabet: every byte as one printable character.

Byte-level BPE vocabularies store token text in this alphabet (a space is 'Ġ', a newline
'Ċ'), so a token's exact bytes are its characters mapped back through the inverse table.
Printable Latin-1 bytes stand for themselves; the other 68 bytes take code points 256.. in
byte order.
"""

from __future__ import annotations


def _byte_to_char() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}
# str.translate table: alphabet character -> the Latin-1 character of its byte, so that
# `text.translate(_TO_LATIN1).encode("latin-1")` yields the bytes in one C-level pass.
# Latin-1 characters outside the alphabet map to a non-Latin-1 sentinel so that they, too,
# fall through to the slow path instead of encoding as themselves.
_TO_LATIN1 = {b: "\uffff" for b in range(256) if chr(b) not in CHAR_TO_BYTE}
_TO_LATIN1.update({ord(c): b for c, b in CHAR_TO_BYTE.items()})


def decode_bytelevel(text: str) -> bytes:
    """Bytes of a byte-level token. A character outside the alphabet (a hand-added token)
    stands for its own UTF-8 encoding, as llama.cpp treats it."""
    mapped = text.translate(_TO_LATIN1)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(
            bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in text
        )
