"""POST /v1/embeddings: OpenAI's embeddings route over a causal language model.

What the vector is: the engine prefills the input and returns the mean of its final-normed
hidden states over the input's tokens, L2-normalised (strata/engine/protocol.py,
GenerationRequest.embed). The model was trained to predict the next token, not to embed, so
the vectors are usable for rough similarity between texts, not as a trained embedding model's
(docs/SERVER.md, "Embeddings").

Each input is its own engine request: several inputs fill several slots and are computed in
the same windows.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import numpy as np
from pydantic import Field, field_validator

from strata.engine.protocol import FinishEvent, GenerationRequest, RequestHandle, SamplingParams
from strata.errors import StrataError
from strata.server.common import wait_for_disconnect
from strata.server.errors import APIError, invalid
from strata.server.events import core_events
from strata.server.prompt_limits import overflow
from strata.server.schemas import MAX_PROMPT_IDS, Name, Strict, TokenId

if TYPE_CHECKING:
    from fastapi import Request

    from strata.server.app import EngineAPI

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
Ids = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]


class EmbeddingRequest(Strict):
    input: Union[str, Annotated[list[str], Field(max_length=MAX_INPUTS)], Ids,
                 Annotated[list[Ids], Field(max_length=MAX_INPUTS)]]
    model: Name | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # checked against the model's width
    user: Name | None = None  # accepted; it changes nothing

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input is empty")
        return v

    @property
    def stream(self) -> bool:  # (the serve proxy asks every request model)
        return False

    def inputs(self) -> list[tuple[str, str | list[int]]]:
        """(param, text or ids) per input: a list of ids is one input, a list of lists several."""
        v = self.input
        if isinstance(v, str):
            return [("input", v)]
        if isinstance(v[0], int):
            return [("input", list(v))]
        return [(f"input[{i}]", x) for i, x in enumerate(v)]


def _prompt_ids(api: "EngineAPI", core: Any, req: EmbeddingRequest) -> list[tuple[str, list[int]]]:
    """Each input's token ids, each checked to fit the context (on the preparer's threads)."""
    width = _width(core)
    if req.dimensions is not None and req.dimensions != width:
        raise invalid(f"dimensions: this model's embeddings have {width} dimensions; only {width} is supported",
                      param="dimensions")
    n_ctx = int(core.n_ctx)
    out = []
    for param, x in req.inputs():
        if isinstance(x, str):
            api.limits.refuse_if_cannot_fit([x], n_ctx, param)
            ids = list(core.tokenizer.encode(x, add_special=True, parse_special=True))
        else:
            api.limits.check_ids(x, param)
            ids = x
        if not ids:
            raise invalid(f"{param}: the input is empty", param=param)
        if len(ids) >= n_ctx:
            raise overflow(len(ids), n_ctx, param)
        out.append((param, ids))
    return out


def _width(core: Any) -> int | None:
    return getattr(getattr(core, "cfg", None), "n_embd", None)


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    # base64: the float32 little-endian bytes, as OpenAI sends them (its client's default)
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vec]


async def _finish(handle: RequestHandle) -> FinishEvent:
    async for ev in core_events(handle):
        if isinstance(ev, FinishEvent):
            return ev
    raise AssertionError("core_events ends with a FinishEvent")


async def _cancel_all_on_disconnect(request: "Request", handles: list[RequestHandle]) -> None:
    await wait_for_disconnect(request)
    for h in handles:
        h.cancel()


async def embed(api: "EngineAPI", request: "Request", raw: bytes, req: EmbeddingRequest) -> dict[str, Any]:
    core = api.ready_core()
    api.check_model(req.model)
    try:
        inputs = await api.preparer.run(len(raw), _prompt_ids, api, core, req)
    except APIError:
        api.metrics.finished("embeddings", "rejected")
        raise
    handles: list[RequestHandle] = []
    try:
        for _, ids in inputs:
            handles.append(core.submit(GenerationRequest(prompt_ids=ids, params=SamplingParams(max_tokens=1),
                                                         request_id=f"embd-{api.new_id()}", embed=True)))
    except StrataError as e:
        for h in handles:
            h.cancel()
        raise invalid(e.message, param="input") from None
    for h in handles:
        api.track(h)
    watcher = asyncio.ensure_future(_cancel_all_on_disconnect(request, handles))
    try:
        finished = await asyncio.gather(*(_finish(h) for h in handles))
    finally:
        watcher.cancel()
        for h in handles:
            api.untrack(h)
            h.cancel()  # (a no-op for a finished one; frees the slot of one a failure left running)
    n_prompt = sum(f.prompt_tokens for f in finished)
    api.metrics.finished("embeddings", _outcome(finished), n_prompt, cached_tokens=sum(f.cached_tokens for f in finished))
    for fin in finished:
        err = api.ended_error(fin)
        if err is not None:
            raise err
        if fin.embedding is None:
            raise APIError("server_error", "the engine returned no embedding for this input")
    rec = api.access_record(request)
    if rec is not None:
        rec.set(n_prompt, 0)
    data = [{"object": "embedding", "index": i, "embedding": _encode(f.embedding, req.encoding_format)}
            for i, f in enumerate(finished)]
    return {"object": "list", "data": data, "model": api.model_name,
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt}}


def _outcome(finished: list[FinishEvent]) -> str:
    reasons = {f.reason for f in finished}
    return next((r for r in ("error", "cancelled") if r in reasons), "stop")
