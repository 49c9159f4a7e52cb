"""Server-sent events as OpenAI streams them: `data: <json>\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # what json.dumps(str, ensure_ascii=False) gives
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# no proxy buffering, no caching: tokens must reach the client as they are made
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class Template:
    """`event(obj)` for objects that differ only in one string (a stream's text deltas): the
    object is encoded once with MARK in that place; each event then encodes only its string.
    The bytes are exactly those of `event()` of the whole object."""

    MARK = "\u0000strata-delta\u0000"

    def __init__(self, obj_with_mark: Any):
        mark = encode_basestring(self.MARK).encode("utf-8")
        head, found, tail = event(obj_with_mark).partition(mark)
        if not found or mark in tail:
            raise ValueError("the object must hold Template.MARK exactly once")
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + encode_basestring(text).encode("utf-8") + self.tail


def error_event(message: str, type_: str = "server_error", code: Any = None) -> bytes:
    """The last event of a stream that fails after its 200 was sent (followed by DONE)."""
    return event({"error": {"message": message, "type": type_, "param": None, "code": code}})


def error_and_done(message: str, type_: str = "server_error", code: Any = None) -> bytes:
    return error_event(message, type_, code) + DONE


class DoneSplitter:
    """Splits a relayed SSE stream at its `data: [DONE]` event, wherever the reads cut it.

    feed() returns the bytes that may go to the client now. The part of the [DONE] event that
    has not gone out yet is kept in `held`, and what follows it collects in `after`: a relay
    sends `held` only once its bookkeeping for the stream is done, because a client (the
    openai SDK among them) may close the connection the moment it reads [DONE], and whatever
    the relay would do after that write could be cut short. (An event's JSON holds no raw
    newline, so only the real end matches.)"""

    def __init__(self):
        self.tail = b""  # the last bytes passed on, fewer than the marker's length
        self.held = b""
        self.after: bytes | None = None

    @property
    def done(self) -> bool:
        """[DONE] has been read (its bytes are passed on or held)."""
        return self.after is not None

    def feed(self, data: bytes) -> bytes:
        if self.after is not None:
            self.after += data
            return b""
        window = self.tail + data
        at = window.find(DONE)
        if at < 0:
            self.tail = window[-(len(DONE) - 1):]
            return data
        cut = at + len(DONE) - len(self.tail)  # > 0: the marker was not all in the tail
        self.after = data[cut:]
        start = max(0, at - len(self.tail))  # where the marker begins in data (0: in an earlier read)
        self.held = data[start:cut]
        return data[:start]
