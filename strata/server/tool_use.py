"""A request's tools and structured output: what the chat template renders, the grammar the
output is held to (SamplingParams.constraint, applied by the engine where rows are sampled),
and how the output text becomes content and tool calls.

- `response_format` json_object / json_schema (and llama-server's `json_schema`), on chat and
  completions: a ConstraintSpec of that kind. The output then is JSON that parses (a json_schema
  one validating against the schema, made strict: strata/grammar/schema.py), unless it is cut
  by max_tokens.
- `tools` with `tool_choice` (chat): the template's tool-call family (strata/text/tool_calls.py)
  decides what is rendered; "required" or a named function also forces the family's call
  format with a grammar; every answer with tools shown is parsed into content and calls.

A constraint is compiled once here, off the event loop, so a schema the grammar library cannot
use is a 400 naming the field before the request is queued (the engine's compile is then a hit
in the same cache).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from strata.protocol import ConstraintSpec
from strata.errors import StrataError
from strata.server.errors import invalid
from strata.server.served_core import ServedCore

# the kind a response_format type asks for (text: none)
FORMAT_KINDS: dict[str, str | None] = {"text": None, "json_object": "json_object", "json_schema": "json_schema"}
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


@dataclass
class OutputPlan:
    """What a request's output is held to and how it is read."""

    constraint: ConstraintSpec | None = None
    constraint_field: str = ""  # the request field the constraint came from, for a 400
    tool_format: Any = None  # strata.text.tool_calls.ToolFormat when the output may hold calls

    def parser(self):
        return self.tool_format.parser() if self.tool_format is not None else None


def _refusal(e: StrataError, default: str):
    """The library's one line as a 400, naming the field it names (`tools[0].function.name: ...`)."""
    m = _FIELD_PREFIX.match(e.message)
    return invalid(e.message, param=m.group(1) if m else default)


def format_constraint(req) -> tuple[ConstraintSpec | None, str]:
    """(the constraint of response_format or json_schema, the field it came from)."""
    fmt, schema = req.response_format, req.json_schema
    if fmt is not None and schema is not None and fmt.type != "text":
        raise invalid("json_schema: response_format is given too; give one of them", param="json_schema")
    if schema is not None:
        return ConstraintSpec("json_schema", json.dumps(schema)), "json_schema"
    if fmt is None:
        return None, ""
    given = fmt.given_schema()
    kind = FORMAT_KINDS[fmt.type]
    if kind == "json_object" and given is not None:
        kind = "json_schema"  # llama-server's {"type": "json_object", "schema": {...}}
    if kind is None:
        if given is not None:
            raise invalid("response_format.schema: a schema needs type 'json_schema'", param="response_format.schema")
        return None, ""
    if kind == "json_schema" and given is None:
        raise invalid("response_format.json_schema.schema: required field is missing",
                      param="response_format.json_schema.schema")
    return ConstraintSpec(kind, "" if given is None else json.dumps(given)), "response_format"


def plan_completion(req) -> OutputPlan:
    spec, where = format_constraint(req)
    return OutputPlan(spec, where)


def plan_chat(core: ServedCore, req, messages: list[dict], hide=lambda value: value) -> tuple[list[dict], list[dict] | None, OutputPlan]:
    """(the messages and tools to render, the plan) of a chat request. `hide`: what the
    request's own strings go through before they are rendered (ContentText.hide: special-token
    text in a tool's description stays text, also where the tools are written into a message)."""
    spec, where = format_constraint(req)
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice: needs tools", param="tool_choice")
        return messages, None, OutputPlan(spec, where)
    from strata.text.tool_calls import resolve_choice, tool_format_for  # (the grammar library loads on first use)

    fmt = tool_format_for(core.chat)
    try:
        shown, tools = fmt.prepare(messages, hide(req.tools), req.tool_choice)
        choice = resolve_choice(req.tool_choice, req.tools)
        forced = fmt.constraint(req.tools, req.tool_choice, req.parallel_tool_calls is not False)
    except StrataError as e:
        raise _refusal(e, "tools") from None
    if choice == "none":
        return shown, tools, OutputPlan(spec, where)
    if spec is not None:
        # a grammar holds the whole output: it cannot be the response format and also a call
        raise invalid("response_format: cannot be combined with tools unless tool_choice is 'none'",
                      param="response_format")
    return shown, tools, OutputPlan(forced, "tool_choice", fmt)


def check_constraint(core: ServedCore, plan: OutputPlan) -> None:
    """Compile the plan's constraint (a cache hit for the engine later); 400 naming its field.
    Run off the event loop: a large schema takes a while."""
    if plan.constraint is None:
        return
    from strata.grammar import GrammarError, compile_constraint

    try:
        compile_constraint(plan.constraint, core.tokenizer, n_vocab=core.cfg.vocab_size if core.cfg is not None else None)
    except GrammarError as e:
        raise invalid(f"{plan.constraint_field}: {e.message}", param=plan.constraint_field) from None
