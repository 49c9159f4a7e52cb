"""Request models for the OpenAI-compatible API, with our own validation.

Validation errors become one 400 that names the field (`messages[0].content: ...`).
Numbers are strict (a string "5" is not a number) so wrong types are rejected the way
OpenAI rejects them. No field is ignored: the fields Strata acts on are the models' own; the
others are in strata/server/field_policy.py's tables (accepted because they change nothing, or
only at their off values); any other field is refused as unknown.

Every field is bounded here, at the edge (the LIMITS below), so nothing a body holds reaches
the engine's thread in a shape it cannot take: no NaN or infinity, no integer past its range,
no seed numpy refuses, no unbounded list. Token ids are checked against the loaded model's
vocabulary by the engine's API (it knows the vocabulary; this module does not).
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator

from strata.protocol import KNOB_DEFAULTS, KNOBS, SamplingParams
from strata.sampling.bounds import MAX_TOKENS, REQUEST_BOUNDS
from strata.server import field_policy, logit_bias
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
UNLIMITED = -1  # llama-server's max_tokens / n_predict for "until the context is full"
MAX_TOOL_CALLS = 128  # per assistant message
MAX_TOOLS = 128  # per request (OpenAI's limit)
MAX_CACHE_SALT_CHARS = 1024

TokenId = Annotated[int, Field(ge=0, lt=1 << 63)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class Strict(BaseModel):
    """A request body whose every field is known: an unknown one is a 400 naming it.
    (allow_inf_nan=False: 1e400 parses to inf; no field means anything by it)"""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _refuse_unless(ok: Callable[[Any], bool], message: str):
    """A field validator for values that would change the result and that we do not support."""
    def check(cls, v):
        if not ok(v):
            raise ValueError(message)
        return v
    return check


class TextPart(Strict):
    type: Literal["text"]
    text: str


class OtherPart(Strict):
    """Any non-text content part: accepted by the parser, refused with a clear message."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: str


class FunctionCall(Strict):
    name: Name
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, OtherPart]], None] = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None  # an assistant's
    tool_call_id: Name | None = None  # a tool result's: the call it answers
    reasoning_content: str | None = None  # a reasoning model's earlier thinking, for templates that show it
    refusal: str | None = None  # OpenAI's answers carry it; only null is taken back
    audio: Any = None
    function_call: Any = None

    _no_refusal = field_validator("refusal")(_refuse_unless(lambda v: v is None, "only null is supported"))
    _no_audio = field_validator("audio")(_refuse_unless(lambda v: v is None, "only null is supported (text only)"))
    _no_function_call = field_validator("function_call")(
        _refuse_unless(lambda v: v is None, "only null is supported (use tool_calls)"))

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

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' shape): string content, and the
        tool fields when given."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = False  # padding against length side channels: none is sent, nothing changes


MaxTokens = Annotated[int, Field(**REQUEST_BOUNDS["max_tokens"].field())]


def _knob_fields() -> dict[str, Any]:
    """The request fields of the sampling knobs (strata/protocol.py, KNOBS), each bounded by its
    row: a nullable one defaults to None (the engine's default then), the others to the default."""
    out: dict[str, Any] = {}
    for name, k in KNOBS.items():
        kind = Annotated[int if k.bound.whole else float, Field(**k.bound.field())]
        out[name] = (Optional[kind], None) if k.nullable else (kind, KNOB_DEFAULTS[name])
    return out


# template variables a request's chat_template_kwargs may not set: the server sets them
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _unlimited_to_context(v):
    # llama-server's -1 ("until the context is full"); the engine API cuts it to the room left
    return MAX_TOKENS if v == UNLIMITED and type(v) is int else v


def _policy(rules: dict[str, field_policy.Rule]) -> dict[str, field_policy.Rule]:
    """field_policy's table for a route, less the knobs: a sampler Strata has is a field, even
    where the table still names it at its off value."""
    return {name: rule for name, rule in rules.items() if name not in KNOBS}


# the knobs' fields, made from the table, under the fields written out below
_Knobs = create_model("_Knobs", __base__=Strict, **_knob_fields())


class _Sampling(_Knobs):
    """Fields shared by chat and completions requests: the knobs' (_Knobs) and these."""

    # other spellings of a field: alias -> the field (llama-server's names)
    aliases: ClassVar[dict[str, str]] = {**{k.alias: name for name, k in KNOBS.items() if k.alias},
                                         "n_predict": "max_tokens"}
    # the fields not acted on (field_policy.py); each route's own table
    field_rules: ClassVar[dict[str, field_policy.Rule]] = _policy(field_policy.SHARED)

    model: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], None] = None
    max_tokens: MaxTokens | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logit_bias: Any = None  # {"id": bias} or [[id, bias]] -> {id: bias} (strata/server/logit_bias.py)
    # vLLM's: prompt KV is reused only between requests with the same salt (docs/SERVER.md, "Prompt reuse")
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None

    _unlimited = field_validator("max_tokens", mode="before")(lambda cls, v: _unlimited_to_context(v))

    @field_validator("logit_bias")
    @classmethod
    def _bias_table(cls, v):
        return None if v is None else logit_bias.parse(v)

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
        """The engine's parameters; a knob left out (or null) keeps SamplingParams' default."""
        knobs = {name: getattr(self, name) for name in KNOBS if getattr(self, name) is not None}
        return SamplingParams(
            max_tokens=max_tokens, seed=self.seed, stop=self.stop_list(), ignore_eos=self.ignore_eos,
            logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=dict(self.logit_bias or {}), **knobs)


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output is held to the schema either way (strict schemas: docs/SERVER.md)


class ResponseFormat(Strict):
    """OpenAI's response_format; llama-server's `schema` beside `type` is taken too."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def given_schema(self) -> dict[str, Any] | None:
        inner = self.json_schema.schema_ if self.json_schema is not None else None
        return inner if inner is not None else self.schema_


class _Structured(_Sampling):
    """Structured output, on both routes: the output held to JSON (strata/server/tool_use.py)."""

    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None  # llama-server's: the schema alone


class ChatCompletionRequest(_Structured):
    field_rules: ClassVar[dict[str, field_policy.Rule]] = _policy(field_policy.CHAT)

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None  # checked by tool_use.py
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None

    _unlimited_completion = field_validator("max_completion_tokens", mode="before")(
        lambda cls, v: _unlimited_to_context(v))
    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables(cls, v):
        taken = sorted(RESERVED_TEMPLATE_VARS & set(v or ()))
        if taken:
            raise ValueError(f"{taken[0]!r} is set by the server, not by a request")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]


PromptIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]
PromptType = Union[str, list[str], PromptIds, list[PromptIds]]


class CompletionRequest(_Structured):
    field_rules: ClassVar[dict[str, field_policy.Rule]] = _policy(field_policy.COMPLETIONS)

    prompt: PromptType
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None

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


def _format_validation(err: ValidationError, spelled: dict[str, str] | None = None) -> APIError:
    """One 400 naming the field as the client spelled it (`spelled`: field -> the alias given)."""
    errors = err.errors(include_url=False)
    e = _pick_error(errors) if len(errors) > 1 else errors[0]
    loc = tuple(e["loc"])
    if loc and spelled and loc[0] in spelled:
        loc = (spelled[loc[0]], *loc[1:])
    path = _field_path(loc)
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


def _unalias(data: dict[str, Any], aliases: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(data with each alias under its field's name, field -> the alias the client used)."""
    spelled: dict[str, str] = {}
    for alias, name in aliases.items():
        if alias not in data:
            continue
        if name in data and data[name] != data[alias]:
            raise invalid(f"{alias}: {name} is given too, with another value; give one of them", param=alias)
        data = {k: v for k, v in data.items() if k != alias} | {name: data[alias]}
        spelled[name] = alias
    return data, spelled


def validate(model: type[BaseModel], data: dict[str, Any]):
    rules = getattr(model, "field_rules", None)
    if rules:
        data = field_policy.apply(data, rules)
    data, spelled = _unalias(data, getattr(model, "aliases", {}))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _format_validation(e, spelled) from None


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
