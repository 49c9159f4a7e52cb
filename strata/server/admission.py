"""A request's place in `strata serve`'s queue and its engine slot (Admission), and the error each
way a wait can end maps to (OUTCOME_ERRORS).

At most `parallel` requests run in the engine at once and at most `max_queued` wait here; a
request past both gets 429. An admitted request counts against that bound from the moment it
is admitted until its answer is done: for a whole answer when the handler returns, for a stream
when the stream ends (`detach()` hands the release to the stream's cleanup).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from strata.server.common import first_of
from strata.server.config import ServerConfig
from strata.server.errors import APIError
from strata.server.supervisor import SHUTDOWN_MESSAGE, WAITED_MESSAGE

if TYPE_CHECKING:
    from strata.server.engine_child import EngineChild
    from strata.server.supervisor import Supervisor


class ClientGone(Exception):
    """The client disconnected before its answer began."""


def timed_out(cfg: ServerConfig) -> APIError:
    return APIError("timeout_error", f"the request took longer than request_timeout = {cfg.request_timeout:g} s",
                    code="timeout")


# how a wait for the engine ended (strata.server.common.first_of's outcome) -> what the request
# gets; "done" is no error
OUTCOME_ERRORS: dict[str, Callable[[ServerConfig], Exception]] = {
    "gone": lambda cfg: ClientGone(),
    "shutdown": lambda cfg: APIError("unavailable_error", SHUTDOWN_MESSAGE, code="shutting_down"),
    "timeout": timed_out,
    "died": lambda cfg: APIError("server_error", WAITED_MESSAGE, status=503, code="engine_stopped"),
}


def raise_outcome(outcome: str, cfg: ServerConfig) -> None:
    """Raise the error of a wait that did not end with what it waited for."""
    if outcome in OUTCOME_ERRORS:
        raise OUTCOME_ERRORS[outcome](cfg)


class Admission:
    """`async with Admission(sup, cfg) as a:` counts the request against the queue bound (429
    when full), `await a.lease(child, ...)` waits for one of the engine's slots, and leaving the
    block gives both back, unless `detach()` handed them to a stream first."""

    def __init__(self, sup: "Supervisor", cfg: ServerConfig):
        self.sup, self.cfg = sup, cfg
        self._child: "EngineChild | None" = None  # set while a slot is held
        self._counted = False
        self._detached = False

    async def __aenter__(self) -> "Admission":
        sup = self.sup
        if sup.outstanding >= sup.parallel + self.cfg.max_queued:
            raise APIError("rate_limit_error",
                           f"too many requests waiting (max_queued = {self.cfg.max_queued}); retry later",
                           code="queue_full")
        sup.outstanding += 1
        self._counted = True
        return self

    async def __aexit__(self, *exc) -> None:
        if not self._detached:
            self.release()

    async def lease(self, child: "EngineChild", timeout: float | None, gone: asyncio.Event) -> None:
        """One of `child`'s slots, waited for until the deadline; the outcome's error when the
        engine dies, the server shuts down or the client leaves first."""
        sup = self.sup
        sup.metrics.queued.inc()
        try:
            outcome, _ = await first_of(child.slots.acquire(),
                                        {"died": child.exited, "shutdown": sup.drain.expired, "gone": gone}, timeout)
        finally:
            sup.metrics.queued.dec()
        if outcome == "done":
            if child.alive:
                self._child = child
                sup.metrics.in_flight.inc()
                return
            child.slots.release()
            outcome = "died"
        raise_outcome(outcome, self.cfg)

    def detach(self) -> Callable[[], None]:
        """Leave the release to the caller (a stream's cleanup): the function that releases."""
        self._detached = True
        return self.release

    def release(self) -> None:
        """Give back the slot and the place in the queue (once; later calls do nothing)."""
        if self._counted:
            self._counted = False
            self.sup.outstanding -= 1
        if self._child is not None:
            self._child.slots.release()
            self._child = None
            self.sup.metrics.in_flight.dec()
