"""The engine API's state (EngineState): what its routes read and how a request is admitted,
refused or ended, apart from the routes themselves (strata/server/app.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Callable

from fastapi import Request

from strata.protocol import FinishEvent, RequestHandle
from strata.server.access_log import ACCESS_KEY, AccessRecord
from strata.server.common import BODY_TIMEOUT_S, Drain, Preparer, read_body
from strata.server.edge import EdgePolicy
from strata.server.errors import APIError
from strata.server.metrics import EngineMetrics
from strata.server.model_id import served_names
from strata.server.prompt_limits import PromptLimits
from strata.server.schemas import check_model_name, parse_request
from strata.server.served_core import ServedCore

SHUTDOWN_MESSAGE = "the server is shutting down; this request was ended"
# finish codes of a request its own grammar or logit_bias ended (strata.grammar.matcher's LIMIT_CODE
# and DEAD_END_CODE) -> the field named in the 400
REQUEST_ENDED_ITSELF = {"grammar_limit": None, "grammar_dead_end": "logit_bias"}


class EngineState:
    """State of the engine's HTTP API that every route reads: the core (None while loading),
    the served model's names, auth, metrics, the running requests, drain. The routes are
    EngineAPI's (strata/server/app.py); embeddings and llama-server's routes take this state."""

    def __init__(self, *, model_name: str | None = None, api_key: str | None = None,
                 max_request_bytes: int = 16 * 1024 * 1024, max_queued: int | None = None,
                 log: Callable[[str], None] | None = None, edge: EdgePolicy | None = None,
                 body_timeout: float = BODY_TIMEOUT_S, access_log: bool = False, usage_trailer: bool = False,
                 expose_slots: bool = False):
        self.core: ServedCore | None = None
        self.failure: str | None = None
        self._model_name = model_name
        self._served: tuple[str, frozenset[str]] | None = None  # (id, accepted names), from the core
        self.access_log = access_log
        self.usage_trailer = usage_trailer  # honour USAGE_TRAILER_HEADER (an engine strata serve started)
        self.api_key = api_key
        self.expose_slots = expose_slots  # /slots shows each request's sampling and id (strata/server/route_privacy.py)
        # Host / Origin / key policy of every route (the key: the user's, or the secret of an
        # engine that `strata serve` started)
        self.edge = edge or EdgePolicy(api_key=api_key)
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout
        self.preparer = Preparer()
        self.limits = PromptLimits()
        self.max_queued = max_queued
        self.log = log
        self.metrics = EngineMetrics(lambda: self.core)
        self.drain = Drain()
        # running requests -> their task number (llama-server's id_task on /slots)
        self.live: dict[RequestHandle, int] = {}
        self._tasks = itertools.count()
        self.created = int(time.time())

    # ------------------------------------------------------------ life cycle
    def attach(self, core: ServedCore) -> None:
        self.limits = PromptLimits.of_core(core)  # before self.core: no request sees one without the other
        self._served = served_names(core)
        self.core = core

    @property
    def model_name(self) -> str:
        """The served id: --alias, else the pack's file stem (model_id_of)."""
        if self._model_name:
            return self._model_name
        return self._served[0] if self._served is not None else "strata"

    def check_model(self, requested: str | None) -> None:
        """404 unless the request names this model: its id or the pack's general.name (or none)."""
        names = {self.model_name} | (self._served[1] if self._served is not None else set())
        if requested and requested not in names:
            check_model_name(requested, self.model_name)

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:24]

    def track(self, handle: RequestHandle) -> None:
        """A submitted request: ended by a drain, shown on /slots."""
        self.live[handle] = next(self._tasks)

    def untrack(self, handle: RequestHandle) -> None:
        self.live.pop(handle, None)

    @staticmethod
    def access_record(request: Request) -> AccessRecord | None:
        return request.scope.get(ACCESS_KEY)

    def begin_drain(self, grace_s: float) -> None:
        """Refuse new requests now; end the ones still running when the grace period ends."""
        self.drain.begin(grace_s)
        asyncio.get_running_loop().create_task(self._end_live_after_grace())

    async def _end_live_after_grace(self) -> None:
        await self.drain.expired.wait()
        for handle in list(self.live):
            handle.cancel()

    def refuse_if_queue_full(self, core) -> None:
        """429 when max_queued requests already wait for a slot (an embeddings call counts as one:
        it keeps at most `parallel` of its inputs in the engine at once, strata/server/embeddings.py)."""
        if self.max_queued is not None and core.queue_depth() >= self.max_queued:
            raise APIError("rate_limit_error", f"too many queued requests (limit {self.max_queued}); retry later",
                           code="queue_full")

    def ready_core(self):
        self.drain.refuse_if_draining()
        if self.core is None:
            why = self.failure or "the engine is loading"
            raise APIError("unavailable_error", why, code="loading" if self.failure is None else "unavailable")
        return self.core

    def ended_error(self, fin: FinishEvent) -> APIError | None:
        """The error to report for a generation that did not end normally."""
        if fin.reason == "error" and fin.code in ("out_of_memory", "device_lost"):  # worth a retry
            return APIError("unavailable_error", fin.error or "generation failed", code=fin.code)
        if fin.reason == "error" and fin.code in REQUEST_ENDED_ITSELF:  # the request's grammar or logit_bias
            return APIError("invalid_request_error", fin.error or "generation failed",
                            param=REQUEST_ENDED_ITSELF[fin.code], code=fin.code)
        if fin.reason == "error":
            return APIError("server_error", fin.error or "generation failed", code=fin.code)
        if fin.reason == "cancelled" and self.drain.expired.is_set():
            return APIError("unavailable_error", SHUTDOWN_MESSAGE, code="shutting_down")
        return None

    async def parsed(self, request: Request, model_cls):
        """(the body, the request model it validates into): bounded reading, strict parsing."""
        raw = await read_body(request, self.max_request_bytes, self.body_timeout)
        return raw, await self.preparer.run(len(raw), parse_request, model_cls, raw)
