"""The OpenAI-compatible API over an engine core (served by the `strata engine` process).

The core generates on its own thread and hands each request a thread-safe queue of
TokenEvent ... FinishEvent; strata.server.events moves them onto the event loop in batches
(one loop wake-up per window, not per token), and a stream writes each batch as one chunk.

While the core loads, /health answers 503 and generation routes answer 503; `attach(core)`
makes the API ready.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from strata.protocol import FinishEvent, GenerationRequest, RequestHandle, TokenEvent
from strata.errors import StrataError
from strata.server import embeddings, llama_routes, request_cost, sse, tool_use
from strata.server import route_privacy
from strata.text.content_text import ContentText
from strata.server.common import (BODY_TIMEOUT_S, ClosingStreamingResponse, Drain, Preparer,
                                  install_error_handlers, json_answer, read_body, wait_for_disconnect)
from strata.server.edge import EdgeMiddleware, EdgePolicy
from strata.server.embeddings import EmbeddingRequest
from strata.server.errors import APIError, invalid
from strata.server.events import core_batches, core_events
from strata.server.metrics import CONTENT_TYPE, EngineMetrics
from strata.server.prompt_limits import PromptLimits, overflow
from strata.server.tool_use import OutputPlan
from strata.server.schemas import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest,
                                   CompletionRequest, check_model_name, parse_request)

SHUTDOWN_MESSAGE = "the server is shutting down; this request was ended"
ANSWER_PREFIX = {"chat": "chatcmpl", "completion": "cmpl"}  # a job's kind -> its answer id's prefix
# finish codes of a request its own grammar or logit_bias ended (strata.grammar.matcher's LIMIT_CODE
# and DEAD_END_CODE) -> the field named in the 400
REQUEST_ENDED_ITSELF = {"grammar_limit": None, "grammar_dead_end": "logit_bias"}


# ---------------------------------------------------------------- the served model id

# file stems that name no model (`model-00001-of-00003.gguf`, `ggml-model-q4_0.gguf`'s split sets):
# such a pack is served under its general.name, slugged, as a directory pack is
GENERIC_STEMS = frozenset({"model", "ggml-model", "consolidated", "pytorch_model"})
_NOT_IN_SLUG = re.compile(r"[^a-z0-9._-]+")


def slug(name: str) -> str:
    """'Smollm2 135M 8k Lc100K Mix1 Ep2' -> 'smollm2-135m-8k-lc100k-mix1-ep2': lower case,
    spaces to '-', only [a-z0-9._-]."""
    return _NOT_IN_SLUG.sub("", "-".join(name.lower().split())).strip("-.")


def model_id_of(pack: Any, named_dir: bool) -> str:
    """The id a pack is served under without --alias: the file stem the user named
    (`SmolLM2-135M-Instruct.Q4_1`; a split set's stem without `-0000i-of-0000N`), else (a
    directory, a generic stem) its general.name slugged, else the file stem, else 'strata'."""
    from strata.pack.loader import SHARD_NAME

    name = pack.main.path.name
    m = SHARD_NAME.match(name)
    stem = m["stem"] if m else (name[:-5] if name.lower().endswith(".gguf") else Path(name).stem)
    if not named_dir and stem and stem.lower() not in GENERIC_STEMS:
        return stem
    general = pack.metadata.get("general.name")
    return (slug(general) if isinstance(general, str) else "") or stem or "strata"


def _served_names(core: Any) -> tuple[str, frozenset[str]]:
    """(the served id, every name a request may give for it). A core without a pack (the tests'
    scripted ones) is served under its model_name."""
    pack, opts = getattr(core, "pack", None), getattr(core, "opts", None)
    if pack is None or opts is None:
        return core.model_name, frozenset({core.model_name})
    from strata.pack.loader import user_path

    named_dir = opts.pack is not None and opts.native is None and user_path(opts.pack).is_dir()
    served = model_id_of(pack, named_dir)
    general = pack.metadata.get("general.name")
    # general.name as is: the id clients were given before ids were file stems
    return served, frozenset({served} | ({general} if isinstance(general, str) and general else set()))


# ---------------------------------------------------------------- the access log

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


class EngineAPI:
    """State of the engine's HTTP API: the core (None while loading), auth, metrics, drain."""

    def __init__(self, *, model_name: str | None = None, api_key: str | None = None,
                 max_request_bytes: int = 16 * 1024 * 1024, max_queued: int | None = None,
                 log: Callable[[str], None] | None = None, edge: EdgePolicy | None = None,
                 body_timeout: float = BODY_TIMEOUT_S, access_log: bool = False, usage_trailer: bool = False,
                 expose_slots: bool = False):
        self.core: Any = None
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
        self.app = self._build()

    # ------------------------------------------------------------ life cycle
    def attach(self, core: Any) -> None:
        self.limits = PromptLimits.of_core(core)  # before self.core: no request sees one without the other
        self._served = _served_names(core)
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

        @app.get("/health")
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

        @app.get("/metrics")
        async def metrics(request: Request):
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models(request: Request):
            self.ready_core()
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str, request: Request):
            self.ready_core()
            self.check_model(model_id)
            return self._model_card()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._generate(request, ChatCompletionRequest, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, CompletionRequest, "completions")

        @app.post("/v1/embeddings")
        async def embed(request: Request):
            raw, req = await self._parsed(request, EmbeddingRequest)
            return await embeddings.embed(self, request, raw, req)

        # llama-server's own routes (strata/server/llama_routes.py)
        @app.post("/tokenize")
        async def tokenize(request: Request):
            raw, req = await self._parsed(request, llama_routes.TokenizeRequest)
            return await self.preparer.cancellable(request, len(raw), llama_routes.tokenize, self.ready_core(), req)

        @app.post("/detokenize")
        async def detokenize(request: Request):
            raw, req = await self._parsed(request, llama_routes.DetokenizeRequest)
            return await self.preparer.run(len(raw), llama_routes.detokenize, self, self.ready_core(), req)

        @app.get("/props")
        async def props(request: Request):
            return route_privacy.props_view(llama_routes.props(self.ready_core()))

        @app.get("/slots")
        async def slots(request: Request):
            return route_privacy.slots_view(llama_routes.slots(self, self.ready_core()), self.expose_slots)

        return app

    async def _parsed(self, request: Request, model_cls):
        """(the body, the request model it validates into): bounded reading, strict parsing."""
        raw = await read_body(request, self.max_request_bytes, self.body_timeout)
        return raw, await self.preparer.run(len(raw), parse_request, model_cls, raw)

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
