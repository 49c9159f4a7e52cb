"""What a request writes is text: special-token text in it (`<|im_start|>` in a message) is
tokenized as the characters it is, never as the special token, so no user can forge a system or
assistant turn. Only the chat template adds special tokens (llama-server keeps parse_special off
for content too).

How: each special-token text in the request's strings is replaced by a private marker before
the template renders; the rendered prompt is cut at the markers; the template's text is
tokenized with its special tokens and each marker's text as plain text (Tokenizer.encode_parts,
which tokenizes the text between two special tokens in one piece, so the ids are those of the
same text with that token written out in letters). A prompt whose strings hold no special text
is the template's text tokenized as before, byte for byte. A template that cuts or escapes a
marker leaves its remains as plain text: they hold no special text (the marker replaced it), so
the prompt holds no forged token, only those characters where the special text was.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from strata.text.tokenizer import Tokenizer

OPEN, CLOSE = "\U000F0000", "\U000F0001"  # private-use characters around a marker


class ContentText:
    """One request's markers: hide() replaces special texts in its strings, encode() tokenizes
    the prompt rendered from them."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.pattern = tok.special_pattern
        self.nonce = secrets.token_hex(8)  # unguessable: no request can write a marker
        self.texts: list[str] = []  # marker i -> the special text it stands for
        self._marker = re.compile(re.escape(OPEN + self.nonce) + r":(\d+)" + re.escape(CLOSE))

    def hide(self, value: Any) -> Any:
        """`value` (strings, lists, dicts, as a request's JSON) with every special text in its
        strings and keys replaced by a marker."""
        if self.pattern is None:
            return value
        if isinstance(value, str):
            return self.pattern.sub(self._marker_for, value)
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.hide(v) for v in value)
        return value

    def _marker_for(self, m: re.Match) -> str:
        self.texts.append(m.group())
        return f"{OPEN}{self.nonce}:{len(self.texts) - 1}{CLOSE}"

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a prompt rendered from hidden values, BOS added as the vocabulary asks."""
        if not self.texts:
            return self.tok.encode(rendered, add_special=True)
        parts: list[tuple[str, bool]] = []
        at = 0
        for m in self._marker.finditer(rendered):
            i = int(m.group(1))
            if i < len(self.texts):
                parts += [(rendered[at : m.start()], True), (self.texts[i], False)]
                at = m.end()
        parts.append((rendered[at:], True))
        return self.tok.encode_parts(parts, add_special=True)
