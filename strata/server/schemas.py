"""Request models for the OpenAI-compatible API, with our own validation.

Validation errors become one 400 that names the field (`messages[0].content: ...`).
Numbers are strict (a string "5" is not a number) so wrong types are rejected the way
OpenAI rejects them. Fields we do not act on are either ignored (harmless: `user`) or
rejected with a clear message when they would change the result (`tools`, `n` != 1).

Every field is bounded here, at the edge (the LIMITS below), so nothing a body holds reaches
the engine's thread in a shape it cannot take: no NaN or infinity, no integer past its range,
no seed numpy refuses, no unbounded list. Token ids are checked against the loaded model's
vocabulary by the engine's API (it knows the vocabulary; this module does not).
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from strata.engine.protocol import SamplingParams
from strata.engine.sampling_bounds import SAMPLING_BOUNDS
from strata.server.errors import APIError, invalid
from strata.server.strict_json import parse_json_object  # noqa: F401 - the routes' body parser

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_MESSAGES = 4096
MAX_PROMPT_IDS = 1 << 21  # more than any context; a longer prompt is refused before it is copied
MAX_NAME_CHARS = 256  # model, user, name
SEED_RANDOM = -1  # llama-server's "pick a random seed"
SEED_LIMIT = 1 << 64  # numpy takes any seed in [0, 2**64) the same way on every platform

TokenId = Annotated[int, Field(ge=0, lt=1 << 63)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class _Strict(BaseModel):
    # allow_inf_nan=False: 1e400 parses to inf; no field means anything by it
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Strict(BaseModel):
    """A request body whose every field is known: an unknown one is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _refuse_unless(ok: Callable[[Any], bool], message: str):
    """A field validator for values that would change the result and that we do not support."""
    def check(cls, v):
        if not ok(v):
            raise ValueError(message)
        return v
    return check


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class OtherPart(_Strict):
    """Any non-text content part: accepted by the parser, refused with a clear message."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, OtherPart]], None] = None
    name: Name | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                if not isinstance(part, TextPart):
                    raise ValueError(f"content part {i} has type {part.type!r}; only 'text' parts are supported")
        return v

    def text(self) -> str:
        """OpenAI list-form content flattened to one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


def _bounded(kind: type, name: str):
    """A field type in the range SAMPLING_BOUNDS gives `name` (shared with `strata generate`)."""
    return Annotated[kind, Field(**SAMPLING_BOUNDS[name].field())]


MaxTokens = _bounded(int, "max_tokens")
Temperature = _bounded(float, "temperature")
TopP = _bounded(float, "top_p")
TopK = _bounded(int, "top_k")
MinP = _bounded(float, "min_p")


class _Sampling(_Strict):
    """Fields shared by chat and completions requests."""

    model: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], None] = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    user: Name | None = None

    _one_choice = field_validator("n")(_refuse_unless(lambda v: v == 1, "only n = 1 is supported"))
    _no_penalties = field_validator("frequency_penalty", "presence_penalty")(
        _refuse_unless(lambda v: v == 0, "penalties are not supported (only 0)"))

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, v):
        if v == SEED_RANDOM:
            return None  # clients send -1 for "random" (llama-server's convention)
        if v is not None and not 0 <= v < SEED_LIMIT:
            raise ValueError(f"must be -1 (random) or in [0, 2**64), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, *, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, seed=self.seed, stop=self.stop_list(), ignore_eos=self.ignore_eos,
            logprobs=logprobs, top_logprobs=top_logprobs)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    _no_tools = field_validator("tools")(_refuse_unless(lambda v: not v, "tools are not supported"))
    _text_format = field_validator("response_format")(_refuse_unless(
        lambda v: v is None or v.get("type", "text") == "text", "only response_format type 'text' is supported"))

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


PromptIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]
PromptType = Union[str, list[str], PromptIds, list[PromptIds]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    _no_suffix = field_validator("suffix")(_refuse_unless(lambda v: not v, "suffix is not supported"))
    _best_of_one = field_validator("best_of")(_refuse_unless(lambda v: v in (None, 1), "only best_of = 1 is supported"))

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is empty")
            if isinstance(v[0], (str, list)) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        return v

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p


# OpenAI's default for the legacy completions endpoint
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _field_path(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (drop pydantic's union tags)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "int", "float", "bool") or "[" in str(part) or str(part).startswith(("function-", "constrained-", "constrained")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def _pick_error(errors: list[dict]) -> dict:
    """Among a union's errors, the one from the branch the value was written for names the real
    problem: a range error (`prompt[1]` < 0 in a list of ids) over a type mismatch of another
    branch (`prompt[0]` is not a string), then the deepest."""
    return max(errors, key=lambda e: (not e["type"].endswith("_type"), len(e["loc"])))


def _format_validation(err: ValidationError) -> APIError:
    errors = err.errors(include_url=False)
    e = _pick_error(errors) if len(errors) > 1 else errors[0]
    path = _field_path(tuple(e["loc"]))
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if e["type"] == "missing":
        msg = "required field is missing"
    elif e["type"] == "extra_forbidden":
        msg = "unknown field"
    return invalid(f"{path}: {msg}", param=path)


def parse_request(model: type[BaseModel], raw: bytes):
    """A request body (bytes) -> the validated request model; 400 naming the field."""
    return validate(model, parse_json_object(raw))


def validate(model: type[BaseModel], data: dict[str, Any]):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _format_validation(e) from None


# route path -> request model (shared by the engine app and the serve proxy)
REQUEST_MODELS: dict[str, type[_Sampling]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def check_model_name(requested: str | None, served: str) -> None:
    """404 when a client asks for a model this server does not serve (empty/None means 'any')."""
    if requested and requested != served:
        raise APIError("not_found_error", f"model {requested!r} not found; this server serves {served!r}",
                       param="model", code="model_not_found")
