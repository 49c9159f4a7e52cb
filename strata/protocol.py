"""The contract between the engine core (scheduler, model) and its front ends (HTTP API, CLI).

The engine core runs generation on its own thread. A front end submits a
GenerationRequest and reads events from the handle's thread-safe queue until a
FinishEvent arrives; an event loop can instead ask to be told of each put
(RequestHandle.listen) and take the events without blocking. Text deltas are already
UTF-8 safe and already cut at stop strings: front ends forward them as they are.

The numeric sampling parameters (KNOBS) carry their range and names here, in one row per
SamplingParams field, so the front ends' fields and flags are made from one table.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable


MAX_TOKENS = 1 << 30  # engine contexts are capped at 2**30 tokens
MAX_TOP_K = 1 << 31


@dataclass(frozen=True)
class Bound:
    """The values a sampling parameter takes; past them a request gets a 400 naming the field
    and `strata generate` one line naming the flag."""

    low: float
    high: float
    low_open: bool = False  # the low end itself is outside (top_p > 0)
    whole: bool = False  # a whole number (top_k, max_tokens)

    def holds(self, v: float) -> bool:
        # (written so NaN, which compares false with everything, is outside)
        above = v > self.low if self.low_open else v >= self.low
        return bool(above and v <= self.high)

    def field(self) -> dict[str, Any]:
        """pydantic Field constraints for this range."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}

    def describe(self) -> str:
        """'[0, 2]', '(0, 1]', 'a whole number in [1, 2**30]'."""
        show = {MAX_TOKENS: "2**30", MAX_TOP_K: "2**31"}
        lo, hi = (show.get(x, f"{x:g}") for x in (self.low, self.high))
        span = f"{'(' if self.low_open else '['}{lo}, {hi}]"
        return f"a whole number in {span}" if self.whole else f"a number in {span}"


@dataclass(frozen=True)
class Knob:
    """A numeric sampling parameter as every front end sees it. The HTTP request field of the
    same name (strata/server/schemas.py), its key in llama-server's `params` on /props and
    /slots (strata/server/llama_routes.py) and `strata generate`'s flag (strata/cli/generate.py)
    are made from these rows; what the parameter does is the sampler code's
    (strata/sampling/filters.py, logit_adjust.py)."""

    bound: Bound
    nullable: bool = False  # a request may send null: the default then, as when left out
    llama: str | None = None  # its llama-server name where that differs
    alias: str | None = None  # another spelling a request may use (llama-server's)
    flag_help: str | None = None  # `strata generate --<name>`'s help; None: no flag
    flag_default: float | None = None  # the flag's default where it differs from the request's


def knob(default: float, bound: Bound, **kw: Any) -> Any:
    """A SamplingParams field that is a Knob (kept in the field's metadata)."""
    return field(default=default, metadata={"knob": Knob(bound, **kw)})


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = knob(1.0, Bound(0.0, 2.0), flag_help="0 (greedy) to 2", flag_default=0.0)  # 0: greedy
    top_k: int = knob(0, Bound(0, MAX_TOP_K, whole=True), flag_help="sample among the K likeliest tokens (0: off)")
    top_p: float = knob(1.0, Bound(0.0, 1.0, low_open=True), flag_help="nucleus sampling, (0, 1]")
    min_p: float = knob(0.0, Bound(0.0, 1.0), flag_help="drop tokens under P x the top probability, [0, 1]")
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20
    # Logit adjustments, applied where the row is sampled (on the device for GPU slots) and
    # seen by the speculative verifier as the distribution itself (strata/sampling/logit_adjust.py):
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-inf bans)
    # llama-server's penalties over the last repeat_last_n tokens (prompt and output; -1: the
    # whole sequence, 0: off): a repeated token's logit is divided by repetition_penalty when
    # positive (multiplied when negative), then lowered by frequency_penalty x its count and by
    # presence_penalty once
    repetition_penalty: float = knob(1.0, Bound(0.0, math.inf, low_open=True), nullable=True,
                                     llama="repeat_penalty", alias="repeat_penalty")
    frequency_penalty: float = knob(0.0, Bound(-2.0, 2.0), nullable=True)
    presence_penalty: float = knob(0.0, Bound(-2.0, 2.0), nullable=True)
    repeat_last_n: int = knob(64, Bound(-1, MAX_TOKENS, whole=True), nullable=True)
    # end-of-generation and stop tokens are banned until this many were made
    min_tokens: int = knob(0, Bound(0, MAX_TOKENS, whole=True), nullable=True)
    constraint: "ConstraintSpec | None" = None  # grammar the output must follow (strata/grammar)


# name -> its Knob, in field order: the numeric sampling parameters every front end takes
KNOBS: dict[str, Knob] = {f.name: f.metadata["knob"] for f in fields(SamplingParams) if "knob" in f.metadata}
# name -> its default
KNOB_DEFAULTS: dict[str, float] = {f.name: f.default for f in fields(SamplingParams) if f.name in KNOBS}


@dataclass(frozen=True)
class ConstraintSpec:
    """What constrained decoding holds the output to: kind "json_object" (any JSON object),
    "json_schema" (source: the schema as JSON text, strict), "lark" (source: a Lark grammar in
    llguidance's dialect, e.g. a tool-call wrapper around JSON arguments)."""

    kind: str
    source: str = ""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    # an embedding request: the prompt is prefilled, nothing is generated, and the FinishEvent
    # carries the mean of the prompt's final-normed hidden states, L2-normalised
    embed: bool = False
    # the prefix cache's scope: prompt KV is reused only between requests with the same salt
    # (strata/batch/prefix_cache.py); "" is the scope of every request that sends none
    cache_salt: str = ""


@dataclass
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the text this token adds (may be "" while a UTF-8 character or stop string is pending)
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None


@dataclass
class FinishEvent:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    text_tail: str = ""  # text held back (pending stop-string prefix) released at the end
    error: str | None = None  # one line, when reason == "error"
    code: str | None = None  # with "error": "out_of_memory" when the device had no room for the request
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not a prefill
    embedding: list[float] | None = None  # an embed request's vector


class EventQueue(queue.Queue):
    """A queue.Queue that calls its listener (if any) after each put, on the putting thread;
    put_quietly() leaves that call to a later notify() (strata.batch.delivery)."""

    def __init__(self) -> None:
        super().__init__()
        self.listener: Callable[[], None] | None = None

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self.notify()

    def put_quietly(self, item) -> None:
        super().put(item)

    def notify(self) -> None:
        listener = self.listener
        if listener is not None:
            listener()


class RequestHandle:
    """What submit() returns: a queue of TokenEvent ... FinishEvent, and cancel()."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: "EventQueue[TokenEvent | FinishEvent]" = EventQueue()
        self._cancelled = threading.Event()

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Have `listener()` called on the core's thread after events are put (None: stop): at
        once, or for a window's events once the next window's device work is issued (the
        scheduler's strata.batch.delivery). It is called once at once when events are already
        waiting. It must be quick and must not block: it runs on the core's thread."""
        self.events.listener = listener
        if listener is not None and not self.events.empty():
            listener()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def collect(self, timeout: float | None = None) -> "tuple[list[int], str, FinishEvent]":
        """Block until the request finishes: (token ids, whole text, the FinishEvent)."""
        ids: list[int] = []
        text: list[str] = []
        while True:
            ev = self.events.get(timeout=timeout)
            if isinstance(ev, FinishEvent):
                text.append(ev.text_tail)
                return ids, "".join(text), ev
            ids.append(ev.token_id)
            text.append(ev.text)
