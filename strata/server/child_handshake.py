"""How `strata serve` and its engine child know each other, with nothing another local process
can read or stand in for.

- The server makes a new key for every child it starts and writes it as the first line of the
  child's stdin, a pipe only the server holds: never in argv (`ps`, /proc/<pid>/cmdline) nor in
  the environment (/proc/<pid>/environ keeps the initial block even after os.environ.pop).
- The child binds port 0 itself, so there is no window in which the port is known and free, and
  reports the port it got on its stdout (another pipe only the server holds), with a proof that
  it holds the key: a line printed by anything else in the child cannot pass for the report.
- Before the server sends a request on a new connection, the peer must answer a challenge (a
  fresh nonce) with the HMAC of that nonce under the key. A process that took the port after
  the child died gets the nonce and nothing else: not the key, not a prompt.

Kept free of the web stack: `strata serve` starts its first engine before it imports FastAPI.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from urllib.parse import parse_qs

# (environment of the child) "stdio": read the key from stdin's first line, report the port on stdout
ENV_HANDSHAKE = "STRATA_ENGINE_HANDSHAKE"
PORT_REPORT = "strata-engine-port"  # the stdout line: "<PORT_REPORT> <port> <proof>"
CHALLENGE_PATH = "/.strata/challenge"  # GET ?nonce=<hex> -> the proof, as text
NONCE_BYTES = 16
MAX_KEY_LINE = 256  # a key line longer than this is not one the server wrote


def new_key() -> str:
    return secrets.token_urlsafe(32)


def proof(key: str, purpose: str, value: str) -> str:
    """HMAC-SHA256 of `purpose:value` under the key (purpose keeps a port proof from serving as
    a challenge answer and back)."""
    return hmac.new(key.encode(), f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()


def matches(key: str, purpose: str, value: str, claimed: str) -> bool:
    return hmac.compare_digest(proof(key, purpose, value), claimed)


# ------------------------------------------------------------ the key, server -> child

def send_key(stdin, key: str) -> None:
    """Write the key line on the child's stdin (a pipe: it waits in the pipe's buffer)."""
    stdin.write(key.encode("ascii") + b"\n")
    stdin.flush()


def read_key(fd: int) -> str | None:
    """The key line from the raw descriptor (byte by byte, so nothing past the line is taken
    from a reader that later watches the same pipe for end-of-file); None at end-of-file or
    for a line that is not a key."""
    line = bytearray()
    while len(line) <= MAX_KEY_LINE:
        b = os.read(fd, 1)
        if not b:
            return None
        if b == b"\n":
            text = line.decode("ascii", errors="replace").strip()
            return text or None
        line += b
    return None


# ------------------------------------------------------------ the port, child -> server

def port_report(key: str, port: int) -> str:
    return f"{PORT_REPORT} {port} {proof(key, 'port', str(port))}"


def parse_port_report(line: str, key: str) -> int | None:
    """The port of a genuine report line, else None."""
    parts = line.strip().split(" ")
    if len(parts) != 3 or parts[0] != PORT_REPORT or not parts[1].isdigit():
        return None
    port = int(parts[1])
    if not 0 < port < 65536 or not matches(key, "port", str(port), parts[2]):
        return None
    return port


# ------------------------------------------------------------ the challenge on each connection

def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def challenge_target(nonce: str) -> str:
    return f"{CHALLENGE_PATH}?nonce={nonce}"


def answers(key: str, nonce: str, body: bytes) -> bool:
    return matches(key, "challenge", nonce, body.decode("ascii", errors="replace").strip())


class ChallengeResponder:
    """ASGI middleware of a supervised engine, outermost: answers the challenge route before any
    key check (the server asks it before it sends the key); every other request passes on."""

    def __init__(self, app, key: str):
        self.app = app
        self._key = key

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("path") != CHALLENGE_PATH:
            return await self.app(scope, receive, send)
        nonce = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("nonce", [""])[0]
        valid = len(nonce) == 2 * NONCE_BYTES and all(c in "0123456789abcdef" for c in nonce)
        status, body = (200, proof(self._key, "challenge", nonce).encode()) if valid else (400, b"bad nonce")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
