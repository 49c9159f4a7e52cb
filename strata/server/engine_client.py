"""The supervisor's HTTP/1.1 client for its engine child: keep-alive connections, one request at
a time on each, framed by h11 (the HTTP/1.1 state machine uvicorn is built on).

Why not httpx: the proxy relays every token of every stream, and forwards every request, on one
event loop. httpx (through httpcore and anyio) opens a cancel scope and a timeout per read and
builds several objects per request; on the H200 with 8 streaming clients the proxy's loop spent
most of its time there, and a burst of 8 requests reached the engine over ~25 ms instead of at
once (each arriving alone, in its own window). This client does what the supervisor needs and
no more: the engine is a known peer on 127.0.0.1 that answers with a Content-Length or a chunked
body; timeouts are the caller's (the proxy races its own deadlines; `get`/`post` take one).

A response whose body is not read to its end is closed with its connection (that is how the
engine learns that a stream's client left: it cancels the generation). A pooled connection
that the engine closed while idle is retried once on a fresh one, but only when nothing of the
answer arrived (the request was not taken).

With `admitted_only`, the client talks only to the engine addresses it was told with their keys
(`admit`: the port a child reported over its own pipe), and each new connection must answer a
challenge with that key before any request, and so the key, is sent on it
(strata/server/child_handshake.py): a process that took the port of an engine that died gets
a nonce, never a key or a prompt.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import h11

from strata.server.child_handshake import answers, challenge_target, new_nonce

READ_SIZE = 1 << 16
CONNECT_TIMEOUT_S = 5.0
# the challenge is answered by the engine's event loop, which a request's work may hold for a
# while (it is not the engine's own liveness check: the supervisor's /health watch is)
CHALLENGE_TIMEOUT_S = 30.0
MAX_IDLE = 64  # kept-alive connections per engine address


class EngineUnreachable(Exception):
    """The engine could not be connected to, closed the connection, or broke HTTP."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reused: bool = False):
        self.reader, self.writer = reader, writer
        self.h = h11.Connection(h11.CLIENT)
        self.reused = reused

    def close(self) -> None:
        self.writer.close()

    async def next_event(self):
        while True:
            try:
                ev = self.h.next_event()
            except h11.RemoteProtocolError as e:
                raise EngineUnreachable(f"the engine's answer is not valid HTTP: {e}") from None
            if ev is not h11.NEED_DATA:
                return ev
            try:
                data = await self.reader.read(READ_SIZE)
            except (ConnectionError, OSError) as e:
                raise EngineUnreachable(f"the connection to the engine failed: {type(e).__name__}: {e}") from None
            self.h.receive_data(data)  # b"" is the end of the connection


class Reply:
    """An answer whose status and headers have arrived; its body is read by the caller
    (aiter_raw / aread), or already read (`content`) for get/post."""

    def __init__(self, client: "EngineClient", key: tuple[str, int], conn: _Conn, response: h11.Response):
        self._client, self._key, self._conn = client, key, conn
        self.status_code = response.status_code
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in response.headers}
        self.content = b""
        self._done = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        while True:
            ev = await conn.next_event()
            if isinstance(ev, h11.Data):
                yield bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                self._done = True
                self._release()
                return
            elif isinstance(ev, h11.ConnectionClosed):
                self._drop()
                raise EngineUnreachable("the engine closed the connection before the answer ended")

    async def aread(self) -> bytes:
        parts = [chunk async for chunk in self.aiter_raw()]
        self.content = b"".join(parts)
        return self.content

    def json(self) -> Any:
        return json.loads(self.content)

    async def aclose(self) -> None:
        if not self._done:
            self._drop()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._put(self._key, conn)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class EngineClient:
    def __init__(self, headers: dict[str, str] | None = None, admitted_only: bool = False):
        self._headers = [(k.lower(), v) for k, v in (headers or {}).items()]
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._admitted_only = admitted_only
        self._keys: dict[tuple[str, int], str] = {}  # admitted engine address -> its key

    # ------------------------------------------------------------ engines
    def admit(self, host: str, port: int, key: str) -> None:
        """An engine this client may talk to: the address its child reported, and its key."""
        self._keys[(host, port)] = key

    def forget(self, host: str, port: int) -> None:
        """The engine at this address is gone: no more requests to it, its connections closed."""
        self._keys.pop((host, port), None)
        for conn in self._idle.pop((host, port), []):
            conn.close()

    # ------------------------------------------------------------ connections
    async def _connect(self, key: tuple[str, int], secret: str | None) -> _Conn:
        """A new connection; with the engine's key, one whose peer proved it holds that key (the
        key the request was sent with, not looked up again: the address may be forgotten
        meanwhile, when the engine dies)."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*key), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise EngineUnreachable(f"cannot connect to the engine at {key[0]}:{key[1]}: {type(e).__name__}: {e}") from None
        conn = _Conn(reader, writer)
        if secret is not None:
            try:
                await asyncio.wait_for(self._challenge(conn, key, secret), CHALLENGE_TIMEOUT_S)
            except asyncio.TimeoutError:
                conn.close()
                raise EngineUnreachable(f"the peer at {key[0]}:{key[1]} did not answer the engine's "
                                        f"challenge within {CHALLENGE_TIMEOUT_S:g} s") from None
            except BaseException:
                conn.close()
                raise
        return conn

    async def _challenge(self, conn: _Conn, key: tuple[str, int], secret: str) -> None:
        """The peer proves it holds the engine's key (an HMAC of a fresh nonce) before this
        connection carries anything else."""
        nonce = new_nonce()
        h = conn.h
        conn.writer.write(h.send(h11.Request(method="GET", target=challenge_target(nonce),
                                             headers=[("host", f"{key[0]}:{key[1]}")]))
                          + h.send(h11.EndOfMessage()))
        await conn.writer.drain()
        ev = await conn.next_event()
        status = getattr(ev, "status_code", 0)
        body = b""
        while not isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)) and len(body) <= 256:
            ev = await conn.next_event()
            if isinstance(ev, h11.Data):
                body += bytes(ev.data)
        if status != 200 or not isinstance(ev, h11.EndOfMessage) or not answers(secret, nonce, body):
            raise EngineUnreachable(f"the process at {key[0]}:{key[1]} is not the engine "
                                    f"(it failed the engine's challenge)")
        try:
            h.start_next_cycle()
        except h11.LocalProtocolError:  # (the peer closes the connection after its answer)
            raise EngineUnreachable(f"the engine at {key[0]}:{key[1]} closed the connection after "
                                    f"its challenge") from None

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                conn.reused = True
                return conn
            conn.close()
        return None

    def _put(self, key: tuple[str, int], conn: _Conn) -> None:
        h = conn.h
        forgotten = self._admitted_only and key not in self._keys  # (its engine is gone)
        if h.our_state is h11.DONE and h.their_state is h11.DONE and not forgotten:
            h.start_next_cycle()
            idle = self._idle.setdefault(key, [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    # ------------------------------------------------------------ requests
    async def send(self, method: str, url: str, content: bytes | None = None,
                   headers: dict[str, str] | None = None) -> Reply:
        """Send a request; returns once the answer's status and headers arrived (its body unread)."""
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        hdrs = [("host", parts.netloc), *self._headers, *((k.lower(), v) for k, v in (headers or {}).items())]
        secret = self._keys.get(key)
        if secret is not None:
            hdrs.append(("authorization", f"Bearer {secret}"))
        elif self._admitted_only:
            raise EngineUnreachable(f"{key[0]}:{key[1]} is not the address of an engine this server started")
        if content is not None:
            hdrs.append(("content-length", str(len(content))))
        for attempt in (0, 1):
            conn = self._take(key) or await self._connect(key, secret)
            try:
                data = conn.h.send(h11.Request(method=method, target=target, headers=hdrs))
                if content:
                    data += conn.h.send(h11.Data(data=content))
                data += conn.h.send(h11.EndOfMessage())
                conn.writer.write(data)
                await conn.writer.drain()
                ev = await conn.next_event()
            except (ConnectionError, OSError, EngineUnreachable) as e:
                conn.close()
                if conn.reused and attempt == 0:  # closed while idle: the request never reached it
                    continue
                if isinstance(e, EngineUnreachable):
                    raise
                raise EngineUnreachable(f"the connection to the engine failed: {type(e).__name__}: {e}") from None
            except BaseException:
                conn.close()
                raise
            if isinstance(ev, h11.ConnectionClosed):
                conn.close()
                if conn.reused and attempt == 0:
                    continue
                raise EngineUnreachable("the engine closed the connection without answering")
            return Reply(self, key, conn, ev)
        raise AssertionError("unreachable")

    async def request(self, method: str, url: str, content: bytes | None = None,
                      headers: dict[str, str] | None = None, timeout: float | None = None) -> Reply:
        """The whole answer, body read (`content`), within `timeout` seconds."""
        async def whole() -> Reply:
            r = await self.send(method, url, content, headers)
            try:
                await r.aread()
            finally:
                await r.aclose()
            return r

        try:
            return await asyncio.wait_for(whole(), timeout)
        except asyncio.TimeoutError:
            raise EngineUnreachable(f"the engine did not answer {method} {urlsplit(url).path} "
                                    f"within {timeout:g} s") from None

    async def get(self, url: str, timeout: float | None = None) -> Reply:
        return await self.request("GET", url, timeout=timeout)

    async def post(self, url: str, content: bytes, timeout: float | None = None,
                   headers: dict[str, str] | None = None) -> Reply:
        return await self.request("POST", url, content, headers, timeout)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
