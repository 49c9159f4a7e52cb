"""The connection edge of `strata serve`, against a real server on 127.0.0.1 with small limits:
connections that never finish their request head are closed after header_timeout, no more
than max_connections are held open (others get 503 at once), each condition is one log line
(not one per connection), and a malformed Origin is a 400, never an internal error."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time

import pytest

from strata.server.connections import ACCEPT_FAILED, RateLimitedLine, quiet_accept_errors
from strata.server.edge import EdgePolicy, origin_parts
from support.server_proc import HTTP, ROOT, serving, wait_until

KEY = "conn-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 32
IDLE = 40  # half-head connections opened at once: CAP are held, the rest refused
HEADER_TIMEOUT_S = 2.0
WAIT_S = 60.0  # bound for events that take HEADER_TIMEOUT_S and milliseconds on an idle machine
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # the head never ends
SLOW_LINE = re.compile(r"^strata serve: closed (\d+) connections? that did not send a complete request head "
                       rf"within header_timeout = {HEADER_TIMEOUT_S:g} s$")
REFUSED_LINE = re.compile(rf"^strata serve: {CAP} connections open, refusing new ones \(max_connections = {CAP}; "
                          r"(\d+) connections? refused\)$")
MALFORMED_ORIGINS = ("http://[evil", "http://[", "https://[::1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the header timeout as a config key, the cap as a flag over the key's value
    cfg = {"api_key": KEY, "parallel": 1, "header_timeout": HEADER_TIMEOUT_S, "max_connections": 4 * CAP,
           "args": ["--max-context", "256"]}
    with serving(tmp_path_factory.mktemp("conn"), cfg, "--max-connections", str(CAP)) as p:
        yield p


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server writes until it closes the connection."""
    sock.settimeout(WAIT_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _answered_already(sock: socket.socket) -> bool:
    """Whether the server has written to this connection yet (without waiting)."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def _counted(server, start: int, pattern: re.Pattern) -> list[int]:
    return [int(m[1]) for line in server.lines[start:] if (m := pattern.match(line))]


def test_slow_heads_are_closed_and_connections_are_capped(server):
    start = len(server.lines)
    socks = []
    try:
        for _ in range(IDLE):
            s = socket.create_connection(_address(server), timeout=WAIT_S)
            s.sendall(HALF_HEAD)
            socks.append(s)
        # the ones past the cap are answered 503 and closed at once, the others are held
        refused = [s for s in socks[CAP:] if _read_to_close(s).startswith(b"HTTP/1.1 503 ")]
        assert len(refused) == IDLE - CAP
        r = HTTP.get(server.url + "/health", timeout=WAIT_S)  # while CAP are held: refused the same way
        if r.status_code != 503:  # only if header_timeout closed some already (this process stalled)
            assert any(_answered_already(s) for s in socks[:CAP]), r.text
        else:
            assert r.json()["error"]["code"] == "too_many_connections", r.text
        # after header_timeout each held one is answered 408 and closed
        for s in socks[:CAP]:
            answer = _read_to_close(s)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "header_timeout"
    finally:
        for s in socks:
            s.close()
    # room again: a real request is served
    served = HTTP.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=AUTH,
                       timeout=WAIT_S)
    assert served.status_code == 200, served.text
    # one line per condition, counting every connection (a burst is one line; a second could come
    # only LOG_INTERVAL_S after the first if the burst were spread over more than LOG_BATCH_S)
    assert wait_until(lambda: sum(_counted(server, start, SLOW_LINE)) == CAP, WAIT_S), server.lines[start:]
    refusals = IDLE - CAP + (r.status_code == 503)
    assert wait_until(lambda: sum(_counted(server, start, REFUSED_LINE)) == refusals, WAIT_S), server.lines[start:]
    assert len(_counted(server, start, SLOW_LINE)) <= 2 and len(_counted(server, start, REFUSED_LINE)) <= 2
    assert "Traceback" not in server.output()


def test_a_request_head_sent_in_pieces_within_the_timeout_is_served(server):
    """The deadline is for the whole head, not between bytes: a head that trickles in but
    completes in time is answered."""
    with socket.create_connection(_address(server), timeout=WAIT_S) as s:
        for piece in (b"GET /health HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"Connection: close\r\n\r\n"):
            s.sendall(piece)
            time.sleep(HEADER_TIMEOUT_S / 20)
        assert _read_to_close(s).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("origin", MALFORMED_ORIGINS)
@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("GET", "/metrics"), ("OPTIONS", "/v1/chat/completions")])
@pytest.mark.parametrize("with_key", [True, False])
def test_a_malformed_origin_is_400_naming_origin(server, origin, method, path, with_key):
    headers = {"Origin": origin, **(AUTH if with_key else {})}
    if method == "OPTIONS":
        headers["Access-Control-Request-Method"] = "POST"
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}) if method == "POST" else None
    r = HTTP.request(method, server.url + path, headers=headers, content=body, timeout=WAIT_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "Origin" and r.json()["error"]["code"] == "invalid_origin"
    assert "access-control-allow-origin" not in r.headers
    assert "internal error" not in server.output() and "Traceback" not in server.output()


def test_origin_parts_never_raise():
    for origin in (*MALFORMED_ORIGINS, "http://localhost:99999", "http://[::1]:x"):
        assert origin_parts(origin) is None
        assert not EdgePolicy.for_bind("127.0.0.1").origin_ok(origin)
    assert origin_parts("https://[::1]:8080") == ("https", "::1")
    assert origin_parts("null") == ("", None)


def test_a_burst_of_events_is_one_line_with_its_count():
    lines: list[str] = []

    async def burst() -> None:
        done = asyncio.Event()
        rl = RateLimitedLine(lambda s: (lines.append(s), done.set()), lambda n: f"{n} events", batch_s=0.01)
        for _ in range(1000):
            rl.hit()
        await asyncio.wait_for(done.wait(), WAIT_S)
        rl.hit()  # inside the interval: held for the next line, not written now
        await asyncio.sleep(0.05)

    asyncio.run(burst())
    assert lines == ["1000 events"]


def test_failed_accepts_are_one_line_not_a_traceback_each():
    """asyncio reports each accept that fails for want of descriptors to the loop's exception
    handler (a traceback each, many per wake-up); other reports still reach the old handler."""
    lines: list[str] = []
    others: list[dict] = []

    async def flood() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: others.append(context))
        done = asyncio.Event()
        line = RateLimitedLine(lambda s: (lines.append(s), done.set()), lambda n: f"{n} failed", batch_s=0.01)
        quiet_accept_errors(loop, line)
        for _ in range(500):
            loop.call_exception_handler({"message": ACCEPT_FAILED, "exception": OSError(24, "Too many open files")})
        loop.call_exception_handler({"message": "something else"})
        await asyncio.wait_for(done.wait(), WAIT_S)

    asyncio.run(flood())
    assert lines == ["500 failed"]
    assert [c["message"] for c in others] == ["something else"]


@pytest.mark.parametrize("flag,value,line", [
    ("--max-connections", "0", "strata: command line: max_connections: Input should be greater than or equal to 1 (got 0)"),
    ("--header-timeout", "0", "strata: command line: header_timeout: Input should be greater than 0 (got 0.0)"),
    ("--header-timeout", "nan", "strata: command line: header_timeout: Input should be a finite number (got nan)"),
])
def test_bad_connection_limits_are_one_line(flag, value, line):
    done = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--port", "0", flag, value],
                          cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [line])
