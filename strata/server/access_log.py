"""The access log of both HTTP apps (the engine's and `strata serve`'s): one line per request,
with the token counts the route learnt (an AccessRecord in the ASGI scope), and the usage
trailer through which a served engine tells the proxy a stream's counts."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote

ACCESS_KEY = "strata.access"  # the ASGI scope's AccessRecord, filled in by the routes
# `strata serve` asks its engine child for a stream's usage in a comment after `data: [DONE]`
# (the proxy strips it; clients never see it), so every stream's line has exact token counts
USAGE_TRAILER_HEADER = "x-strata-usage-trailer"
USAGE_TRAILER = re.compile(rb": strata-usage (\d+) (\d+)\n\n")
MAX_LOGGED_PATH = 200


@dataclass
class AccessRecord:
    """Token counts of one request, when the route knows them (the engine's usage)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def set(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens, self.completion_tokens = int(prompt_tokens), int(completion_tokens)


def usage_trailer(prompt_tokens: int, completion_tokens: int) -> bytes:
    return b": strata-usage %d %d\n\n" % (prompt_tokens, completion_tokens)


def access_line(prefix: str, method: str, path: str, status: int, rec: AccessRecord, ms: float) -> str:
    """'strata serve: POST /v1/completions 200 in=5 out=16 41 ms' ('-': not known). The path is
    the client's: re-quoted (no control character or space reaches the log) and bounded."""
    shown = quote(path, safe="/:@!$&'()*+,;=-._~%")
    if len(shown) > MAX_LOGGED_PATH:
        shown = shown[:MAX_LOGGED_PATH] + "..."
    count = lambda n: "-" if n is None else str(n)  # noqa: E731
    return (f"{prefix}: {quote(method[:16], safe='')} {shown} {status} in={count(rec.prompt_tokens)} "
            f"out={count(rec.completion_tokens)} {ms:.0f} ms")


class AccessLog:
    """ASGI middleware, outermost: one line per HTTP request once its answer has been sent (a
    stream's when it ends), with the status sent (500 when none was; 499: the client left first).

    Health polls (the supervisor's every 2 s, a load balancer's) would bury the requests, so
    `/health` is logged only when its status differs from the last one logged: loading -> ready,
    ready -> unhealthy, each once."""

    QUIET_PATHS = ("/health",)

    def __init__(self, app, log: Callable[[str], None], prefix: str):
        self.app, self.log, self.prefix = app, log, prefix
        self._last_status: dict[str, int] = {}  # quiet path -> status last logged

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rec = scope[ACCESS_KEY] = AccessRecord()
        status = 500
        t0 = time.perf_counter()

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            if path not in self.QUIET_PATHS or self._last_status.get(path) != status:
                self._last_status[path] = status
                self.log(access_line(self.prefix, scope.get("method", "?"), path, status, rec,
                                     1000 * (time.perf_counter() - t0)))
