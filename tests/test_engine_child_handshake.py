"""No other local process can stand in for the engine child of `strata serve`, nor learn its
key: the key travels on the child's stdin (never argv or the environment, both readable in
/proc), a new one for every start; the child binds a free port itself and reports it on its
stdout; the server sends nothing to a port before the process there proves it holds the key.

The attacker is played for real: a thread of this test reads the child's argv and environment
from /proc as soon as the child exists, binds the port it finds there first (what took the
engine over when the server chose the port and passed it in argv), and takes the child's own
port the moment the child dies. It answers every request with a fake completion."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from strata.server.child_handshake import CHALLENGE_PATH, new_nonce, parse_port_report, proof
from strata.server.engine_client import EngineClient, EngineUnreachable
from strata.server.engine_launch import launch_first
from support.server_proc import HTTP, spawn_serve, wait_until

LINUX = sys.platform.startswith("linux")
CANARY = "canary-prompt-7f3a"  # a prompt the squatter must never see
FAKE_TEXT = "SQUATTED"
FAKE_BODY = (b'{"status":"ok","id":"x","object":"text_completion","model":"x","choices":[{"index":0,"text":"'
             + FAKE_TEXT.encode() + b'","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
             b'"total_tokens":2}}')


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def proc_strings(pid: int) -> list[bytes]:
    """Every argv item and environment entry (NAME=value, and the value alone) of a process."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    env = [e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e]
    return [s for s in argv + env + [e.split(b"=", 1)[-1] for e in env] if s]


class Squatter:
    """A local process's attack, on threads: watch /proc for the server's engine children, read
    their argv and environment, bind any port named there (or a port given), and answer what
    arrives with a fake completion, keeping every byte received."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.seen: dict[int, list[bytes]] = {}  # child pid -> its argv and environment strings
        self.received = bytearray()
        self.request_lines: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            for pid in children_of(self.server_pid):
                if pid in self.seen:
                    continue
                try:
                    strings = proc_strings(pid)
                except OSError:
                    continue
                if not any(b"engine" == s for s in strings):  # (the interpreter before exec: later)
                    continue
                self.seen[pid] = strings
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"--port" in argv and argv[argv.index(b"--port") + 1] != b"0":
                    self.take(int(argv[argv.index(b"--port") + 1]), patience=5.0)
            time.sleep(0.005)

    def take(self, port: int, patience: float) -> bool:
        """Bind 127.0.0.1:port as soon as it is free (within `patience` seconds) and serve on it."""
        end = time.monotonic() + patience
        while time.monotonic() < end and not self._stop.is_set():
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                time.sleep(0.001)
                continue
            s.listen(64)
            s.settimeout(0.2)
            self._socks.append(s)
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()
            return True
        return False

    def _accept(self, s: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = s.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        buf = b""
        with conn:
            while not self._stop.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with self._lock:
                    self.received += data
                buf += data
                while b"\r\n\r\n" in buf:  # each request head: answered as if it were the engine
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    with self._lock:
                        self.request_lines.append(head.split(b"\r\n", 1)[0])
                    m = re.search(rb"(?i)content-length: *(\d+)", head)
                    buf = buf[int(m[1]):] if m else buf
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                 % len(FAKE_BODY) + FAKE_BODY)

    def stop(self) -> None:
        self._stop.set()
        for s in self._socks:
            s.close()


def engine_port(server) -> int:
    return int(server.wait_line(r"engine pid \d+ listens on port (\d+)")[1])


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_local_squatter_gets_neither_the_key_nor_a_prompt(tmp_path):
    p = spawn_serve(tmp_path, {"parallel": 1, "args": ["--max-context", "256"]})
    squatter = Squatter(p.proc.pid)
    try:
        p.wait_listening()
        p.wait_healthy()
        first = p.engine_pids()[0]
        assert wait_until(lambda: first in squatter.seen, 10), "the squatter never saw the engine"
        port = engine_port(p)
        # nothing in the child's argv or environment opens the engine
        for s in set(squatter.seen[first]):
            text = s.decode("utf-8", "replace")
            if len(text) >= 16 and text.isprintable():
                r = HTTP.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {text}"},
                             timeout=30)
                assert r.status_code == 401, text
        # the child dies; its port is taken at once by the squatter
        os.kill(first, signal.SIGKILL)
        assert squatter.take(port, patience=10.0), "the dead engine's port never came free"
        # clients get the real (restarted) engine's answers; one sent while the server had not
        # yet seen the death may end with 503 engine_stopped, never with the squatter's text
        answered = 0
        for _ in range(6):
            r = HTTP.post(p.url + "/v1/completions", json={"prompt": CANARY, "max_tokens": 2}, timeout=120)
            assert FAKE_TEXT not in r.text
            if r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped":
                continue
            assert r.status_code == 200 and r.json()["model"] != "x", r.text
            answered += 1
        assert answered >= 3
        # the new child bound a port of its own (the squatter holds the old one)
        assert len(p.engine_pids()) == 2 and re.findall(r"listens on port (\d+)", p.output())[-1] != str(port)
    finally:
        squatter.stop()
        p.kill_tree()
    with squatter._lock:
        received = bytes(squatter.received).lower()
        lines = list(squatter.request_lines)
    assert b"authorization" not in received and b"bearer" not in received
    assert CANARY.encode() not in received
    # all that ever reached it: challenges (a fresh nonce each), nothing else
    assert all(line.startswith(f"GET {CHALLENGE_PATH}?nonce=".encode()) for line in lines), lines


def test_a_peer_that_fails_the_challenge_is_sent_nothing():
    """The client's side of the challenge, against a peer that answers 200 to everything."""
    received = bytearray()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            received.extend(data)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(FAKE_BODY) + FAKE_BODY)
            await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = EngineClient(admitted_only=True)
        try:
            with pytest.raises(EngineUnreachable, match="not the address of an engine"):
                await client.post(f"http://127.0.0.1:{port}/v1/completions", content=CANARY.encode(), timeout=10)
            client.admit("127.0.0.1", port, "the-real-key-" + "k" * 32)
            with pytest.raises(EngineUnreachable, match="failed the engine's challenge"):
                await client.post(f"http://127.0.0.1:{port}/v1/completions", content=CANARY.encode(), timeout=10)
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    assert b"GET " + CHALLENGE_PATH.encode() in received  # it was asked ...
    assert b"k" * 32 not in received and CANARY.encode() not in received  # ... and told nothing
    assert b"authorization" not in received.lower()


def read_port_report(launched, timeout: float = 60.0) -> int:
    """The port a launched child reports on its stdout (its other lines are skipped)."""
    found: list[int] = []

    def read() -> None:
        for raw in iter(launched.proc.stdout.readline, b""):
            port = parse_port_report(raw.decode("utf-8", "replace"), launched.key)
            if port:
                found.append(port)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    assert found, "no port report from the engine child"
    return found[0]


def test_each_start_has_its_own_key_which_only_that_child_proves():
    a = launch_first(["--max-context", "256"], 1, None)
    b = launch_first(["--max-context", "256"], 1, None)
    try:
        ports = [read_port_report(a), read_port_report(b)]
        assert a.key != b.key and len(a.key) >= 32
        for launched, port, other in ((a, ports[0], b), (b, ports[1], a)):
            if LINUX:  # where other local users could read them
                strings = proc_strings(launched.proc.pid)
                assert not any(k.encode() in s for s in strings for k in (a.key, b.key))
                assert b"--port" in strings and strings[strings.index(b"--port") + 1] == b"0"
            nonce = new_nonce()
            r = HTTP.get(f"http://127.0.0.1:{port}{CHALLENGE_PATH}", params={"nonce": nonce}, timeout=30)
            assert r.status_code == 200
            assert r.text == proof(launched.key, "challenge", nonce) != proof(other.key, "challenge", nonce)
            # its own key opens it (503 while it loads, or 200), the other child's does not
            mine = HTTP.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {launched.key}"},
                            timeout=30)
            theirs = HTTP.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {other.key}"},
                              timeout=30)
            assert mine.status_code in (200, 503) and theirs.status_code == 401
    finally:
        for launched in (a, b):
            launched.proc.kill()
            launched.proc.wait(10)
            for pipe in (launched.proc.stdin, launched.proc.stdout, launched.proc.stderr):
                pipe.close()
