"""Incremental detokenization: token ids in, text out, never half a UTF-8 character.

One token may carry part of a character (byte tokens, byte-level BPE pieces of an emoji),
so text is released only once its bytes form whole characters. The pieces returned, joined,
equal Tokenizer.decode of all ids fed (same skip_special), flush() included.
"""

from __future__ import annotations

import codecs

from strata.text.tokenizer import Tokenizer


class StreamDecoder:
    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        # errors="replace" matches decode(): bytes that can never become a character are
        # replaced as soon as that is certain, and a dangling tail at flush().
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def feed_many(self, ids) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """Whatever is pending at the end of the stream (an incomplete character as U+FFFD)."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])
