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
