"""The OpenAI-compatible API over an engine core (served by the `strata engine` process).

The core generates on its own thread and hands each request a thread-safe queue of
TokenEvent ... FinishEvent; strata.server.events moves them onto the event loop in batches
(one loop wake-up per window, not per token), and a stream writes each batch as one chunk.

While the core loads, /health answers 503 and generation routes answer 503; `attach(core)`
makes the API ready.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from strata.protocol import FinishEvent, GenerationRequest, RequestHandle, TokenEvent
from strata.errors import StrataError
from strata.server import embeddings, llama_routes, request_cost, route_privacy, sse, tool_use
from strata.server.access_log import ACCESS_KEY, USAGE_TRAILER_HEADER, AccessLog, AccessRecord, usage_trailer
from strata.server.common import ClosingStreamingResponse, install_error_handlers, json_answer, read_body, wait_for_disconnect
from strata.server.edge import EdgeMiddleware
from strata.server.embeddings import EmbeddingRequest
from strata.server.engine_state import EngineState
from strata.server.errors import APIError, invalid
from strata.server.events import core_batches, core_events
from strata.server.metrics import CONTENT_TYPE
from strata.server.prompt_limits import overflow
from strata.server.routes import add_routes
from strata.server.tool_use import OutputPlan
from strata.server.schemas import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from strata.text.content_text import ContentText

ANSWER_PREFIX = {"chat": "chatcmpl", "completion": "cmpl"}  # a job's kind -> its answer id's prefix


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- one request being served

@dataclass
class _Job:
    """A validated request, tokenized and submitted."""

    kind: str  # "chat" | "completion"
    handle: RequestHandle
    prompt_tokens: int
    logprobs: bool
    top_logprobs: int
    include_usage: bool
    echo_text: str = ""
    finished: bool = False  # the FinishEvent arrived (nothing left to cancel)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    text_chunk: Callable[[str], bytes] | None = None  # the stream's text-only chunk (sse.Template)
    access: AccessRecord | None = None  # the access log's record of this request
    usage_trailer: bool = False  # end the stream with usage_trailer() after [DONE] (strata serve asked)
    parser: Any = None  # the output's tool-call parser (strata.text.tool_calls), when tools were shown


def _usage(fin: FinishEvent) -> dict[str, Any]:
    # (prompt_tokens, completion_tokens first: strata serve reads them for its access log)
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


class EngineAPI(EngineState):
    """The engine's HTTP API: the routes of ROUTES (strata/server/routes.py) over EngineState."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.app = self._build()

    # ------------------------------------------------------------ building requests
    def _prompt_ids(self, core, req) -> tuple[list[int], str, OutputPlan]:
        """Token ids of the prompt, the text to echo (completions with echo), and what the output
        is held to. Runs on the preparer's threads: templating and tokenizing a big prompt take
        seconds of CPU."""
        tok = core.tokenizer
        n_ctx = int(core.n_ctx)
        if isinstance(req, ChatCompletionRequest):
            request_cost.refuse_chat_text(self.limits, req, n_ctx)  # tools and template kwargs included
            content = ContentText(tok)  # what the request wrote stays text (strata/text/content_text.py)
            messages, tools, plan = tool_use.plan_chat(core, req, content.hide(req.message_dicts()), content.hide)
            try:
                text = core.chat.render(messages, add_generation_prompt=True, tools=tools,
                                        **content.hide(req.chat_template_kwargs or {}))
            except StrataError as e:
                raise invalid(e.message, param="messages") from None
            self.limits.refuse_if_cannot_fit([text], n_ctx, "messages")  # what the template made of it
            return content.encode(text), "", plan
        plan = tool_use.plan_completion(req)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            self.limits.refuse_if_cannot_fit([prompt], n_ctx, "prompt")
            return list(tok.encode(prompt, add_special=True, parse_special=True)), prompt, plan
        if len(prompt) >= n_ctx:
            raise overflow(len(prompt), n_ctx, "prompt")
        self.limits.check_ids(prompt, "prompt" if prompt is req.prompt else "prompt[0]")
        return list(prompt), tok.decode(prompt) if req.echo else "", plan

    def _submit(self, core, req, kind: str, ids: list[int], echo_text: str, plan: OutputPlan) -> _Job:
        n_ctx = int(core.n_ctx)
        if len(ids) >= n_ctx:
            raise overflow(len(ids), n_ctx)
        if isinstance(req, ChatCompletionRequest):
            requested = req.requested_max_tokens()
            logprobs, top = req.logprobs, (req.top_logprobs or 0)
        else:
            requested = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
            logprobs, top = req.logprobs is not None, (req.logprobs or 0)
        room = n_ctx - len(ids)
        max_tokens = room if requested is None else min(requested, room)
        if req.min_tokens is not None and req.min_tokens > max_tokens:
            raise invalid(f"min_tokens: {req.min_tokens} is more than the {max_tokens} tokens this request may "
                          f"generate (max_tokens, or the room left in the context)", param="min_tokens")
        if req.logit_bias:
            self.limits.check_ids(sorted(req.logit_bias), "logit_bias", keyed=True)
        params = req.sampling(max_tokens, logprobs=logprobs, top_logprobs=top)
        params.constraint = plan.constraint
        self.refuse_if_queue_full(core)
        job_id = self.new_id()
        try:
            # the request id is the answer's id, so /slots shows a client which slot runs its request
            handle = core.submit(GenerationRequest(prompt_ids=ids, params=params,
                                                   request_id=f"{ANSWER_PREFIX[kind]}-{job_id}",
                                                   cache_salt=req.cache_salt or ""))
        except StrataError as e:
            if hasattr(e, "n_prompt_tokens"):
                raise overflow(e.n_prompt_tokens, getattr(e, "n_ctx", n_ctx)) from None
            raise invalid(e.message) from None
        return _Job(kind, handle, len(ids), logprobs, top, req.include_usage(),
                    echo_text=echo_text if getattr(req, "echo", False) else "", id=job_id, parser=plan.parser())

    # ------------------------------------------------------------ logprobs in both formats
    def _token_str(self, token_id: int) -> tuple[str, list[int]]:
        raw = bytes(self.core.tokenizer.token_bytes(token_id))
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprob(self, ev: TokenEvent) -> dict[str, Any]:
        text, raw = self._token_str(ev.token_id)
        tops = []
        for t in ev.top_logprobs or []:
            t_text, t_raw = self._token_str(t.token_id)
            tops.append({"token": t_text, "logprob": t.logprob, "bytes": t_raw})
        return {"token": text, "logprob": ev.logprob, "bytes": raw, "top_logprobs": tops}

    def _legacy_logprobs(self, events: list[TokenEvent], offset0: int) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = offset0
        for ev in events:
            text, _ = self._token_str(ev.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(ev.logprob)
            out["top_logprobs"].append({self._token_str(t.token_id)[0]: t.logprob for t in ev.top_logprobs or []})
            out["text_offset"].append(offset)
            offset += len(ev.text)
        return out

    # ------------------------------------------------------------ responses
    def _outcome(self, endpoint: str, fin: FinishEvent, job: _Job) -> None:
        self.metrics.finished(endpoint, fin.reason, fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)
        if job.access is not None:
            job.access.set(fin.prompt_tokens, fin.completion_tokens)

    async def _complete(self, request: Request, job: _Job, endpoint: str) -> Response:
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, job.handle))
        texts: list[str] = []
        tokens: list[TokenEvent] = []
        fin: FinishEvent | None = None
        try:
            async for ev in core_events(job.handle):
                if isinstance(ev, FinishEvent):
                    fin = ev
                else:
                    texts.append(ev.text)
                    if job.logprobs:
                        tokens.append(ev)
        finally:
            watcher.cancel()
            self.untrack(job.handle)
            if fin is None:
                job.handle.cancel()
        self._outcome(endpoint, fin, job)
        err = self.ended_error(fin)
        if err is not None:
            raise err
        text = "".join(texts) + fin.text_tail
        if job.logprobs:  # a context's tokens x 20 alternatives: seconds to render, off the loop
            return await self.preparer.off_loop(self._whole_answer, job, text, fin, tokens, answer=True)
        return self._whole_answer(job, text, fin, tokens)

    def _whole_answer(self, job: _Job, text: str, fin: FinishEvent, tokens: list[TokenEvent]) -> Response:
        if job.kind == "chat":
            message, finish = _message(job, text, fin.reason)
            choice = {"index": 0, "message": message,
                      "logprobs": {"content": [self._chat_logprob(t) for t in tokens]} if job.logprobs else None,
                      "finish_reason": finish}
            body = {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created,
                    "model": self.model_name, "choices": [choice], "usage": _usage(fin)}
        else:
            choice = {"index": 0, "text": job.echo_text + text,
                      "logprobs": self._legacy_logprobs(tokens, len(job.echo_text)) if job.logprobs else None,
                      "finish_reason": fin.reason}
            body = {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created,
                    "model": self.model_name, "choices": [choice], "usage": _usage(fin)}
        return json_answer(body)

    def _chunk(self, job: _Job, delta_text: str | None, finish: str | None, lp: list[TokenEvent],
               role: bool = False, tool_call: dict[str, Any] | None = None) -> bytes:
        return sse.event(self._chunk_object(job, delta_text, finish, lp, role, tool_call))

    def _chunk_object(self, job: _Job, delta_text: str | None, finish: str | None, lp: list[TokenEvent],
                      role: bool = False, tool_call: dict[str, Any] | None = None) -> dict[str, Any]:
        if job.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            if tool_call is not None:
                delta["tool_calls"] = [tool_call]
            choice = {"index": 0, "delta": delta,
                      "logprobs": {"content": [self._chat_logprob(t) for t in lp]} if lp else None,
                      "finish_reason": finish}
            obj = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created,
                   "model": self.model_name, "choices": [choice]}
        else:
            choice = {"index": 0, "text": delta_text or "",
                      "logprobs": self._legacy_logprobs(lp, 0) if lp else None, "finish_reason": finish}
            obj = {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created,
                   "model": self.model_name, "choices": [choice]}
        if job.include_usage:
            obj["usage"] = None
        return obj

    def _text_chunk(self, job: _Job, text: str) -> bytes:
        """The chunk of a token with text and no logprobs, the one sent per token: only its text
        is encoded (a template per stream), byte for byte what _chunk() would give."""
        if job.text_chunk is None:
            job.text_chunk = sse.Template(self._chunk_object(job, sse.Template.MARK, None, []))
        return job.text_chunk(text)

    async def _stream(self, job: _Job, endpoint: str) -> AsyncIterator[bytes]:
        """The SSE body: the events that arrived together go out as one chunk (one write)."""
        pending_lp: list[TokenEvent] = []  # logprobs of tokens whose text is still held back
        fin: FinishEvent | None = None
        try:
            if job.kind == "chat":
                yield self._chunk(job, "", None, [], role=True)
            elif job.echo_text:
                yield self._chunk(job, job.echo_text, None, [])
            async for batch in core_batches(job.handle):
                out: list[bytes] = []
                for ev in batch:
                    if isinstance(ev, FinishEvent):
                        fin = ev
                        job.finished = True
                        break
                    if job.logprobs:
                        pending_lp.append(ev)
                    if ev.text and job.parser is not None:
                        pending_lp = self._parsed_chunks(job, job.parser.feed(ev.text), pending_lp, out)
                    elif ev.text:
                        out.append(self._chunk(job, ev.text, None, pending_lp) if pending_lp
                                   else self._text_chunk(job, ev.text))
                        pending_lp = []
                if fin is not None:
                    out.append(self._final_chunks(job, endpoint, fin, pending_lp))
                if out:
                    yield b"".join(out)
        finally:
            # a client that went away cancels its generation and frees its slot at once
            await self._release_job(job)()

    def _final_chunks(self, job: _Job, endpoint: str, fin: FinishEvent, pending_lp: list[TokenEvent]) -> bytes:
        """What ends a stream: the held-back text, the finish reason, the usage, [DONE] (or an error)."""
        self._outcome(endpoint, fin, job)
        trailer = usage_trailer(fin.prompt_tokens, fin.completion_tokens) if job.usage_trailer else b""
        err = self.ended_error(fin)
        if err is not None:
            return sse.error_and_done(err.message, err.type, err.code) + trailer
        out: list[bytes] = []
        finish = fin.reason
        if job.parser is not None:
            pending_lp = self._parsed_chunks(job, job.parser.feed(fin.text_tail) + job.parser.finish(), pending_lp, out)
            finish = "tool_calls" if job.parser.calls else finish
            if pending_lp:
                out.append(self._chunk(job, "", None, pending_lp))
        elif fin.text_tail or pending_lp:
            out.append(self._chunk(job, fin.text_tail, None, pending_lp))
        out.append(self._chunk(job, None if job.kind == "chat" else "", finish, []))
        if job.include_usage:
            usage_obj = {"id": f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{job.id}",
                         "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
                         "created": job.created, "model": self.model_name, "choices": [],
                         "usage": _usage(fin)}
            out.append(sse.event(usage_obj))
        out.append(sse.DONE)
        out.append(trailer)
        return b"".join(out)

    def _parsed_chunks(self, job: _Job, deltas: list, lp: list[TokenEvent], out: list[bytes]) -> list[TokenEvent]:
        """The parser's deltas as chunks onto `out`: content as content, a call as OpenAI streams
        one (its index, id, type and name first, then its arguments). Returns the logprobs still
        waiting for a chunk to ride on (the parser may hold text back)."""
        for d in deltas:
            if d.content is not None:
                out.append(self._chunk(job, d.content, None, lp))
            else:
                head = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
                out.append(self._chunk(job, None, None, lp, tool_call=head))
                out.append(self._chunk(job, None, None, [], tool_call={"index": d.index,
                                                                        "function": {"arguments": d.arguments}}))
            lp = []
        return lp

    def _release_job(self, job: _Job):
        async def release() -> None:
            self.untrack(job.handle)
            if not job.finished:
                job.handle.cancel()
        return release

    async def _generate(self, request: Request, model_cls, endpoint: str) -> Response:
        raw = await read_body(request, self.max_request_bytes, self.body_timeout)
        req = await self.preparer.run(len(raw), request_cost.parse_generation, model_cls, raw, self.core)
        core = self.ready_core()
        self.check_model(req.model)
        try:
            # never on the loop, however small the body: a template may spin for its whole time limit
            ids, echo_text, plan = await self.preparer.off_loop(self._prompt_ids, core, req)
            if plan.constraint is not None:
                await self.preparer.off_loop(tool_use.check_constraint, core, plan)
            kind = "chat" if model_cls is ChatCompletionRequest else "completion"
            job = self._submit(core, req, kind, ids, echo_text, plan)
        except APIError as e:
            self.metrics.finished(endpoint, "rejected")
            raise e
        job.access = request.scope.get(ACCESS_KEY)
        job.usage_trailer = self.usage_trailer and request.headers.get(USAGE_TRAILER_HEADER) == "1"
        self.track(job.handle)
        if req.stream:
            return ClosingStreamingResponse(self._stream(job, endpoint), self._release_job(job),
                                            media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        return await self._complete(request, job, endpoint)

    # ------------------------------------------------------------ routes
    def _build(self) -> FastAPI:
        app = FastAPI(title="strata engine", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app, self.log)
        app.add_middleware(EdgeMiddleware, policy=self.edge)
        if self.access_log:  # added last: outermost, so refusals at the edge are logged too
            app.add_middleware(AccessLog, log=self.log or _stderr, prefix="strata engine")

        async def health():
            # "unhealthy": loaded, but the scheduler's thread is gone or a window has run past
            # --watchdog-s; strata serve restarts an engine that says so
            alive, unhealthy = (True, None) if self.core is None else self.core.liveness()
            if self.core is None or self.drain.draining or not alive:
                state = ("shutting_down" if self.drain.draining else "unhealthy" if self.core is not None
                         else "failed" if self.failure else "loading")
                why = {"loading": "the engine is loading", "failed": self.failure or "",
                       "shutting_down": "the server is shutting down", "unhealthy": unhealthy}[state]
                body = APIError("unavailable_error", why, code=state).body()
                body["status"] = state
                return JSONResponse(body, status_code=503)
            return {"status": "ok"}

        async def metrics(request: Request):
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        async def models(request: Request):
            self.ready_core()
            return {"object": "list", "data": [self._model_card()]}

        async def model(model_id: str, request: Request):
            self.ready_core()
            self.check_model(model_id)
            return self._model_card()

        async def chat(request: Request):
            return await self._generate(request, ChatCompletionRequest, "chat")

        async def completions(request: Request):
            return await self._generate(request, CompletionRequest, "completions")

        async def embed(request: Request):
            raw, req = await self.parsed(request, EmbeddingRequest)
            return await embeddings.embed(self, request, raw, req)

        async def tokenize(request: Request):
            raw, req = await self.parsed(request, llama_routes.TokenizeRequest)
            return await self.preparer.cancellable(request, len(raw), llama_routes.tokenize, self.ready_core(), req)

        async def detokenize(request: Request):
            raw, req = await self.parsed(request, llama_routes.DetokenizeRequest)
            return await self.preparer.run(len(raw), llama_routes.detokenize, self, self.ready_core(), req)

        async def props(request: Request):
            return route_privacy.props_view(llama_routes.props(self.ready_core()))

        async def slots(request: Request):
            return route_privacy.slots_view(llama_routes.slots(self, self.ready_core()), self.expose_slots)

        add_routes(app, {"health": health, "metrics": metrics, "models": models, "model": model, "chat": chat,
                         "completions": completions, "embeddings": embed, "tokenize": tokenize,
                         "detokenize": detokenize, "props": props, "slots": slots})
        return app

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "strata",
                "meta": {"n_ctx": int(self.core.n_ctx), "parallel": int(self.core.parallel)}}


def _message(job: _Job, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """(the assistant message, the finish reason) of a whole answer: with tools shown, its
    calls parsed out of the text (content null when the answer is only calls; finish_reason
    "tool_calls" when it made any)."""
    if job.parser is None:
        return {"role": "assistant", "content": text}, reason
    deltas = job.parser.feed(text) + job.parser.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    calls = job.parser.calls
    if not calls:
        return {"role": "assistant", "content": content}, reason
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}, "tool_calls"


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    await wait_for_disconnect(request)
    handle.cancel()


def create_app(core: Any = None, **kwargs) -> FastAPI:
    """An API app; with `core` given it is ready at once (tests), else call attach() later."""
    api = EngineAPI(**kwargs)
    if core is not None:
        api.attach(core)
    app = api.app
    app.state.api = api
    return app
