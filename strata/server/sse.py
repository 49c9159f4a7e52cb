"""Server-sent events as OpenAI streams them: `data: <json>\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# no proxy buffering, no caching: tokens must reach the client as they are made
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def error_event(message: str, type_: str = "server_error", code: Any = None) -> bytes:
    """The last event of a stream that fails after its 200 was sent (followed by DONE)."""
    return event({"error": {"message": message, "type": type_, "param": None, "code": code}})


def error_and_done(message: str, type_: str = "server_error", code: Any = None) -> bytes:
    return error_event(message, type_, code) + DONE
