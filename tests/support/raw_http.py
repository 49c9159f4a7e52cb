"""HTTP/1.1 requests written byte by byte on a socket: the hostile ones that an HTTP client
library would refuse to send (wrong Content-Length, bad bytes in the path, huge headers,
chunked bodies written by hand, a body that stops half-way)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int  # 0: the server closed the connection without an answer
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    seconds: float = 0.0


def build(method: str, path: str, headers: dict[str, str] | list[tuple[str, str]] | None = None,
          body: bytes = b"", *, host: str = "", content_length: int | None = None, chunked: bool = False) -> bytes:
    """The request's bytes. Host and Content-Length are added unless given (content_length
    overrides the true length; chunked writes the body as one chunk)."""
    items = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    names = {k.lower() for k, _ in items}
    if "host" not in names and host:
        items.insert(0, ("Host", host))
    if chunked:
        items.append(("Transfer-Encoding", "chunked"))
        body = (f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n") if body else b"0\r\n\r\n"
    elif "content-length" not in names and (body or method in ("POST", "PUT", "PATCH")):
        items.append(("Content-Length", str(len(body) if content_length is None else content_length)))
    head = f"{method} ".encode() + (path.encode("latin-1") if isinstance(path, str) else path) + b" HTTP/1.1\r\n"
    head += b"".join(k.encode("latin-1") + b": " + v.encode("latin-1") + b"\r\n" for k, v in items)
    return head + b"\r\n" + body


def send(url: str, raw: bytes, timeout: float = 15.0) -> RawResponse:
    """Send `raw` on a new connection; read one response (headers + Content-Length body)."""
    u = urlsplit(url)
    t0 = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before it has read everything
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            if not lines[0].startswith("HTTP/"):
                return RawResponse(0, seconds=time.monotonic() - t0)
            status = int(lines[0].split()[1])
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            want = int(headers.get("content-length", "0") or 0)
            while len(rest) < want:
                chunk = s.recv(65536)
                if not chunk:
                    break
                rest += chunk
        except ConnectionResetError:
            return RawResponse(0, seconds=time.monotonic() - t0)
    return RawResponse(status, headers, rest, time.monotonic() - t0)
