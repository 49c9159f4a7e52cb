"""Every HTTP route, in one table: the engine's app (strata/server/app.py) and the `strata serve`
proxy (strata/server/proxy.py) both build their routes from ROUTES, so a route is added once and
the two cannot disagree (tests/test_server_routes.py checks that each app serves exactly these).

What the proxy does with a route (`proxy`):
- ADMIT: the request takes an engine slot: its body is checked here, it waits in the server's
  bounded queue, is sent to the engine and its answer relayed (a stream as it comes);
- PASS: answered by the engine at once, without a slot: the body (if any) checked here, then
  sent on, with a short deadline;
- LOCAL: answered by the proxy itself (its own health, its metrics with the engine's after them).

The API key: every route needs it when one is set, except those marked `open` (a load
balancer's health probe carries no key). An engine that `strata serve` started needs the
server's secret on every route.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote

from strata.server.embeddings import EmbeddingRequest
from strata.server.errors import APIError, invalid
from strata.server.llama_routes import DetokenizeRequest, TokenizeRequest
from strata.server.schemas import ChatCompletionRequest, CompletionRequest

ADMIT, PASS, LOCAL = "admit", "pass", "local"

# a model id never holds control characters, and a path segment "." or ".." would be resolved
# away by the URL instead of reaching the engine as a name
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def model_path(model_id: str) -> str:
    """The engine's path for /v1/models/{model_id}: the id quoted whole (its slashes and dots
    stay part of the name), never a way to reach another engine route."""
    if _CONTROL.search(model_id):
        raise invalid("model: the model id holds control characters", param="model")
    if any(seg in (".", "..") for seg in model_id.split("/")):
        raise APIError("not_found_error", f"model {model_id!r} not found", param="model", code="model_not_found")
    return "/v1/models/" + quote(model_id, safe="")


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # Starlette's pattern
    name: str  # the handler's name in each app's handler table
    proxy: str  # ADMIT, PASS or LOCAL (the module docstring)
    body: type | None = None  # the request model a POST body is validated into (on both sides)
    open: bool = False  # served without the user's API key
    # the engine's path for a route with path parameters (the parameters -> the path), checked
    # and quoted by the proxy; None: the route's own path
    engine_path: Callable[[dict[str, str]], str] | None = None


ROUTES: tuple[Route, ...] = (
    Route("GET", "/health", "health", LOCAL, open=True),
    Route("GET", "/metrics", "metrics", LOCAL),
    Route("GET", "/v1/models", "models", PASS),
    Route("GET", "/v1/models/{model_id:path}", "model", PASS,
          engine_path=lambda params: model_path(params["model_id"])),
    Route("POST", "/v1/chat/completions", "chat", ADMIT, body=ChatCompletionRequest),
    Route("POST", "/v1/completions", "completions", ADMIT, body=CompletionRequest),
    Route("POST", "/v1/embeddings", "embeddings", ADMIT, body=EmbeddingRequest),
    # llama-server's own routes (strata/server/llama_routes.py)
    Route("POST", "/tokenize", "tokenize", PASS, body=TokenizeRequest),
    Route("POST", "/detokenize", "detokenize", PASS, body=DetokenizeRequest),
    Route("GET", "/props", "props", PASS),
    Route("GET", "/slots", "slots", PASS),
)

# the paths served without the user's API key (strata/server/edge.py)
KEY_EXEMPT = frozenset(r.path for r in ROUTES if r.open)


def add_routes(app, handlers: dict[str, Callable]) -> None:
    """Add every route of ROUTES to a FastAPI app, each to the handler its name names; the
    handler table must name exactly the table's routes."""
    names = {r.name for r in ROUTES}
    if set(handlers) != names:
        raise AssertionError(f"route handlers differ from ROUTES: {sorted(set(handlers) ^ names)}")
    for r in ROUTES:
        app.add_api_route(r.path, handlers[r.name], methods=[r.method], name=r.name)
