"""The core thread's events, delivered onto the event loop a batch at a time.

The core puts each request's TokenEvent ... FinishEvent on its handle's queue from its own
thread. A front end on an event loop must not block on those queues, and should not pay a
loop wake-up per token either: a window of B requests makes B events at once. So each handle
gets a listener (RequestHandle.listen) that marks it ready and, when no wake-up is pending
yet, schedules one (call_soon_threadsafe); that one wake-up hands every ready handle all of
its queued events. A stream then writes the events it got together as one chunk.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator

from strata.protocol import FinishEvent, RequestHandle, TokenEvent

Event = TokenEvent | FinishEvent


class LoopWaker:
    """One per event loop: coalesces the core thread's notifications into few loop wake-ups."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._ready: list[Inbox] = []
        self._scheduled = False

    def mark(self, inbox: "Inbox") -> None:
        """Called on the core thread after an event was put on the inbox's handle."""
        with self._lock:
            self._ready.append(inbox)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _flush(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
            self._scheduled = False
        for inbox in ready:
            inbox.wake()


_wakers: dict[asyncio.AbstractEventLoop, LoopWaker] = {}


def waker_for(loop: asyncio.AbstractEventLoop) -> LoopWaker:
    waker = _wakers.get(loop)
    if waker is None:
        for old in [lp for lp in _wakers if lp.is_closed()]:  # loops of finished servers (tests)
            del _wakers[old]
        waker = _wakers[loop] = LoopWaker(loop)
    return waker


class Inbox:
    """A handle's events as seen from the loop: `batch()` waits for and returns all that are queued."""

    def __init__(self, handle: RequestHandle, waker: LoopWaker):
        self.handle = handle
        self._waiter: asyncio.Future | None = None
        self._loop = waker.loop
        handle.listen(lambda: waker.mark(self))

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _take(self) -> list[Event]:
        out: list[Event] = []
        events = self.handle.events
        while True:
            try:
                out.append(events.get_nowait())
            except queue.Empty:
                return out

    async def batch(self) -> list[Event]:
        while True:
            got = self._take()
            if got:
                return got
            # no await between the empty look and setting the waiter: a put after the look
            # marks this inbox, and the wake-up it schedules runs after we wait
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


async def core_batches(handle: RequestHandle) -> AsyncIterator[list[Event]]:
    """Yield the handle's events in the batches they arrived in, ending with the FinishEvent's."""
    inbox = Inbox(handle, waker_for(asyncio.get_running_loop()))
    try:
        while True:
            batch = await inbox.batch()
            for i, ev in enumerate(batch):
                if isinstance(ev, FinishEvent):
                    yield batch[: i + 1]
                    return
            yield batch
    finally:
        handle.listen(None)


async def core_events(handle: RequestHandle) -> AsyncIterator[Event]:
    """Yield the handle's events one by one, ending after the FinishEvent."""
    async for batch in core_batches(handle):
        for ev in batch:
            yield ev
