"""A slot's text output: UTF-8-safe deltas, stop strings, EOS, token limits.

Text is released only when it can no longer be the beginning of a stop string, so a
client never sees part of a stop string; what is held back at the end is released in the
FinishEvent (text_tail) unless a stop string matched.
"""

from __future__ import annotations

import codecs
from typing import Callable


class TextOutput:
    def __init__(self, token_bytes: Callable[[int], bytes], stop: list[str]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded text not yet released
        self.text = ""  # everything released so far
        self.stopped = False

    def feed(self, token_id: int) -> str:
        """Add a token; returns the text it releases ("" while held back)."""
        self._held += self._utf8.decode(self._token_bytes(token_id))
        hits = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        if hits:  # the earliest match in the text wins, whatever the order of the list
            out = self._held[: min(hits)]
            self._held = ""
            self.stopped = True
            self.text += out
            return out
        keep = self._longest_stop_prefix_suffix()
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        self.text += out
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest tail of the held text that starts some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best

    def finish(self) -> str:
        """Release what is held (called when generation ends without a stop string)."""
        tail = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        self.text += tail
        return tail
