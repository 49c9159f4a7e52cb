"""When a front end hears of a window's events: once the next window's device work is issued.

A served engine's HTTP loop and the scheduler thread share one interpreter lock. Told of each
event as it is put, the loop wakes while the scheduler is still emitting the window's tokens
and planning the next one, and the two take turns at the lock on the host's critical path
(the device idles meanwhile). Held until the next window's work is on the device, the loop's
turn falls in the time the scheduler spends waiting for that work, with the lock free.

The events themselves are queued at once (a consumer blocked in `RequestHandle.collect` sees
them at once); only the listeners' calls wait. The scheduler releases them after it issues a
window's device work, before it drafts, when it has nothing left to run, and when it stops:
a notice waits at most for one window's host work.
"""

from __future__ import annotations

from typing import Any

from strata.protocol import EventQueue


class Delivery:
    """The scheduler thread's puts; listeners called on release() (that thread only)."""

    def __init__(self) -> None:
        self._held: dict[int, EventQueue] = {}  # by id, in the order first put

    def put(self, events: EventQueue, event: Any) -> None:
        events.put_quietly(event)
        if events.listener is not None:
            self._held.setdefault(id(events), events)

    def release(self) -> None:
        if not self._held:
            return
        held, self._held = self._held, {}
        for events in held.values():
            events.notify()
