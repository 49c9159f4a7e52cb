"""The supervisor's client to its engine child (strata/server/engine_client.py) against a real
HTTP/1.1 peer on 127.0.0.1 (a small asyncio server that counts its connections): kept-alive
reuse, a connection the peer closed while idle, a body closed early, chunked streams,
connection failures and timeouts as one error type. The whole path through a real `strata
serve` and its engine is covered by the server tests (test_server_*.py, test_engine_faults.py)."""

from __future__ import annotations

import asyncio

import pytest

from strata.server.engine_client import EngineClient, EngineUnreachable


class Peer:
    """HTTP/1.1 on 127.0.0.1: `/len` answers with a Content-Length, `/chunks` with 3 chunks
    (then waits for the client to go away if `/chunks?hold`), `/close` answers and closes,
    `/slow` never answers. Records connections and what each request's headers held."""

    def __init__(self):
        self.connections = 0
        self.auth: list[str] = []
        self.gone = asyncio.Event()
        self.server = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                target = lines[0].split(" ")[1]
                headers = dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln)
                self.auth.append(headers.get("authorization", ""))
                n = int(headers.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                if target == "/len":
                    out = b"got " + body
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(out) + out)
                elif target.startswith("/chunks"):
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                        await writer.drain()
                    if "hold" in target:
                        await reader.read()  # returns at the client's close
                        self.gone.set()
                        return
                    writer.write(b"0\r\n\r\n")
                elif target == "/close":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                    await writer.drain()
                    return
                elif target == "/slow":
                    await asyncio.sleep(30)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_requests_reuse_one_kept_alive_connection_and_send_the_headers():
    async def main():
        peer = Peer()
        url = await peer.start()
        client = EngineClient(headers={"Authorization": "Bearer s3cret"})
        for i in range(5):
            r = await client.post(url + "/len", str(i).encode(), timeout=5)
            assert (r.status_code, r.content) == (200, b"got %d" % i)
        r = await client.send("POST", url + "/chunks", b"{}")
        assert [c async for c in r.aiter_raw()] == [b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"]
        assert (await client.get(url + "/len", timeout=5)).content == b"got "
        await client.aclose()
        await peer.stop()
        return peer

    peer = run(main())
    assert peer.connections == 1
    assert peer.auth == ["Bearer s3cret"] * 7


def test_a_connection_the_peer_closed_while_idle_is_replaced():
    async def main():
        peer = Peer()
        url = await peer.start()
        client = EngineClient()
        assert (await client.get(url + "/close", timeout=5)).content == b"ok"
        await asyncio.sleep(0.1)  # the peer's close has arrived
        assert (await client.get(url + "/len", timeout=5)).content == b"got "
        await client.aclose()
        await peer.stop()
        return peer

    assert run(main()).connections == 2


def test_a_stream_closed_before_its_end_closes_its_connection():
    """That is how the engine learns a stream's client left (it cancels the generation)."""
    async def main():
        peer = Peer()
        url = await peer.start()
        client = EngineClient()
        r = await client.send("POST", url + "/chunks?hold", b"{}")
        first = await r.aiter_raw().__anext__()
        await r.aclose()
        await asyncio.wait_for(peer.gone.wait(), 5)
        assert (await client.get(url + "/len", timeout=5)).status_code == 200  # a new connection
        await client.aclose()
        await peer.stop()
        return first, peer

    first, peer = run(main())
    assert first == b"data: 1\n\n" and peer.connections == 2


def test_failures_are_one_error_type():
    async def main():
        peer = Peer()
        url = await peer.start()
        client = EngineClient()
        with pytest.raises(EngineUnreachable, match="did not answer GET /slow within 0.2 s"):
            await client.get(url + "/slow", timeout=0.2)
        await peer.stop()  # the listening socket is closed at once
        with pytest.raises(EngineUnreachable, match="cannot connect to the engine"):
            await client.get(url + "/len", timeout=5)
        await client.aclose()

    run(main())
