"""POST /v1/embeddings: OpenAI's embeddings route over a causal language model.

What the vector is: the engine prefills the input and returns the mean of its final-normed
hidden states over the input's tokens, L2-normalised (strata/protocol.py,
GenerationRequest.embed). The model was trained to predict the next token, not to embed, so
the vectors are usable for rough similarity between texts, not as a trained embedding model's
(docs/SERVER.md, "Embeddings").

Each input is its own engine request: several inputs fill several slots and are computed in
the same windows. A call keeps at most `parallel` of its inputs in the engine at once and counts
as one request against max_queued, as it does at strata serve's queue (docs/SERVER.md, "Request
limits"): its inputs cannot fill the engine's queue ahead of other clients' requests.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Annotated, Literal, Union

import numpy as np
from fastapi.responses import Response
from pydantic import Field, field_validator

from strata.protocol import FinishEvent, GenerationRequest, SamplingParams
from strata.errors import StrataError
from strata.server.common import json_answer, wait_for_disconnect
from strata.server.errors import APIError, invalid
from strata.server.events import core_events
from strata.server.prompt_limits import overflow
from strata.server.schemas import MAX_PROMPT_IDS, Name, Strict, TokenId
from strata.server.served_core import ServedCore

if TYPE_CHECKING:
    from fastapi import Request

    from strata.server.engine_state import EngineState

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


def _prompt_ids(api: "EngineState", core: ServedCore, req: EmbeddingRequest) -> list[tuple[str, list[int]]]:
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


def _width(core: ServedCore) -> int | None:
    return core.cfg.n_embd if core.cfg is not None else None


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    # base64: the float32 little-endian bytes, as OpenAI sends them (its client's default)
    if fmt == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vec]


async def _embed_one(api: "EngineState", core: ServedCore, ids: list[int], window: asyncio.Semaphore) -> FinishEvent:
    """One input through the engine, once the call's window has room for it."""
    async with window:
        try:
            handle = core.submit(GenerationRequest(prompt_ids=ids, params=SamplingParams(max_tokens=1),
                                                   request_id=f"embd-{api.new_id()}", embed=True))
        except StrataError as e:
            raise invalid(e.message, param="input") from None
        api.track(handle)
        try:
            async for ev in core_events(handle):
                if isinstance(ev, FinishEvent):
                    return ev
            raise AssertionError("core_events ends with a FinishEvent")
        finally:
            api.untrack(handle)
            handle.cancel()  # (a no-op once finished; frees the slot of one whose caller left)


async def _embed_all(api: "EngineState", request: "Request", core: ServedCore,
                     inputs: list[list[int]]) -> list[FinishEvent] | None:
    """Every input's FinishEvent (None: the client left first), at most `parallel` inputs in the
    engine at once: a call of 2048 inputs then holds as many queue entries as `parallel`
    requests, and a request sent after it waits for the inputs already in the engine, not for
    all of them. What is left is cancelled when the client leaves or an input is refused."""
    window = asyncio.Semaphore(max(1, int(core.parallel)))
    tasks = [asyncio.ensure_future(_embed_one(api, core, ids, window)) for ids in inputs]
    everything = asyncio.gather(*tasks)
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    left = True
    try:
        done, _ = await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
        left = everything not in done
    finally:
        gone.cancel()
        for t in tasks:
            t.cancel()  # (no-ops for those done)
        await asyncio.gather(*tasks, return_exceptions=True)
        if left and everything.done() and not everything.cancelled():
            everything.exception()  # (read: the outcome of an abandoned call matters to no one)
    return None if left else everything.result()


async def embed(api: "EngineState", request: "Request", raw: bytes, req: EmbeddingRequest) -> Response:
    core = api.ready_core()
    api.check_model(req.model)
    try:
        inputs = await api.preparer.off_loop(_prompt_ids, api, core, req)
        api.refuse_if_queue_full(core)  # the call is one request against max_queued
    except APIError:
        api.metrics.finished("embeddings", "rejected")
        raise
    finished = await _embed_all(api, request, core, [ids for _, ids in inputs])
    if finished is None:
        api.metrics.finished("embeddings", "cancelled")
        return Response(status_code=499)  # the client left (nobody reads this; the access log shows it)
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
    # 2048 vectors of a thousand floats are seconds of encoding: off the loop
    return await api.preparer.off_loop(_answer, api.model_name, finished, req.encoding_format, n_prompt,
                                       answer=True)


def _answer(model: str, finished: list[FinishEvent], fmt: str, n_prompt: int) -> Response:
    data = [{"object": "embedding", "index": i, "embedding": _encode(f.embedding, fmt)}
            for i, f in enumerate(finished)]
    return json_answer({"object": "list", "data": data, "model": model,
                        "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt}})


def _outcome(finished: list[FinishEvent]) -> str:
    reasons = {f.reason for f in finished}
    return next((r for r in ("error", "cancelled") if r in reasons), "stop")
