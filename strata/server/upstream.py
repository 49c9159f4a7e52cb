"""An upstream streaming response read on its own task, for the proxy's relay.

The relay must also stop when the server shuts down or the request's time runs out. Racing
every read against those (a task per read, as `first_of` does) costs more than the read when
each chunk is a token. Instead one task reads the upstream into a buffer, and `stop()` (from a
timer or an event's callback) wakes the relay. The relay takes whatever has arrived since its
last write as one chunk, so a slow writer coalesces tokens instead of falling behind. Past
MAX_BUFFER bytes the reader waits, so a client that stops reading holds back the engine.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

MAX_BUFFER = 1 << 20


class UpstreamReader:
    def __init__(self, chunks: AsyncIterator[bytes]):
        self._buffer = bytearray()
        self._ended = False
        self._error: Exception | None = None
        self._stopped: str | None = None
        self._loop = asyncio.get_running_loop()
        self._wake_relay: asyncio.Future | None = None
        self._wake_reader: asyncio.Future | None = None
        self._task = asyncio.ensure_future(self._read(chunks))
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (errors are kept in _error)

    async def _read(self, chunks: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in chunks:
                self._buffer += chunk
                self._wake(self._wake_relay)
                if len(self._buffer) > MAX_BUFFER:
                    self._wake_reader = self._loop.create_future()
                    await self._wake_reader
        except Exception as e:  # noqa: BLE001 - handed to the relay, which knows which are expected
            self._error = e
        finally:
            self._ended = True
            self._wake(self._wake_relay)

    @staticmethod
    def _wake(f: asyncio.Future | None) -> None:
        if f is not None and not f.done():
            f.set_result(None)

    def stop(self, why: str) -> None:
        """Read no more; next() answers ("stop", why) once the bytes already read are taken."""
        if self._stopped is None:
            self._stopped = why
            self._task.cancel()
            self._wake(self._wake_relay)

    async def next(self) -> tuple[str, object]:
        """("data", bytes) with everything read so far, then ("stop", why), ("error", exc) or
        ("end", None)."""
        while True:
            if self._buffer:
                data = bytes(self._buffer)
                self._buffer.clear()
                self._wake(self._wake_reader)
                return "data", data
            if self._stopped is not None:
                return "stop", self._stopped
            if self._ended:
                return ("error", self._error) if self._error is not None else ("end", None)
            self._wake_relay = self._loop.create_future()
            try:
                await self._wake_relay
            finally:
                self._wake_relay = None

    def close(self) -> None:
        """Stop reading (before the upstream response is closed)."""
        self._task.cancel()
