"""Tool calls: how each chat-template family is told about tools and how it writes its calls.

Models are tuned to one way of calling tools, and their chat template shows which. A family
is one row of FAMILIES (markers, call format, the system text for templates that cannot list
tools themselves); `tool_format_for(template)` picks the first row whose markers appear in
the template's source. Three things come from the row, all through `ToolFormat`:

- **prepare**: what the template renders. A template that mentions `tools` renders them
  itself, so they pass as transformers passes them (the OpenAI tool objects) and the history's
  tool turns pass untouched. A template that does not (SmolLM2's) gets the tools in the system
  message, in the family's own words, and the history's calls and results rewritten into
  text in the family's format: what the model would have seen in training.
- **constraint**: for tool_choice "required" or a named function, a Lark grammar
  (strata.grammar) that forces the family's wrapper around {"name": <an allowed name>,
  <arguments key>: <that function's parameters schema>}: one call, or one or more when
  parallel_tool_calls.
- **parser**: the model's streamed text split into content and calls. Text that may be the
  start of a call's marker is held back until it is known not to be; a call is released
  whole, once its block has closed (or the output ended) and its JSON parsed, so a block that
  turns out to be broken is given back as plain content instead of as a call already sent.

The families (FAMILIES, in detection order):

- mistral: `[TOOL_CALLS][{"name": n, "arguments": {...}}, ...]`; found by `[TOOL_CALLS]`.
- hermes: `<tool_call>\\n{"name": n, "arguments": {...}}\\n</tool_call>`, one block per call;
  found by `<tool_call>` (Qwen2.5, Qwen3, Hermes), and the default for templates showing none.
- llama3: `{"name": n, "parameters": {...}}` as the whole answer (`; ` between calls), also
  after `<|python_tag|>`; found by `<|python_tag|>` (Llama 3.1 / 3.2 JSON tool calling).
- smollm2: `<tool_call>[{"name": n, "arguments": {...}}, ...]</tool_call>`, tools listed as a
  JSON list inside `<tools>...</tools>` in the system prompt, results as user turns in
  `<tool_response>`; found by `SmolLM`. This is the APIGen function-calling data SmolLM2-1.7B-
  Instruct was tuned on (the 135M and 360M were tuned without function-calling data, so for
  them only a forcing grammar makes calls reliable).

A call is one Delta carrying its index, id, name and its whole arguments. Arguments always
come out as JSON text (re-serialized from what was parsed, so a model's odd spacing or an
arguments value written as a JSON string both give clean JSON).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from strata.protocol import ConstraintSpec
from strata.errors import StrataError
from strata.grammar.schema import lark_json_rule
from strata.text.chat_template import ChatTemplate, normalize_messages


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Delta:
    """One piece of streamed output: content, or (index set) a tool call."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --- families -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    name: str
    markers: tuple[str, ...]  # texts in a template's source that identify the family
    open: str  # the text that starts a block of calls
    close: str | None  # the text that ends it; None: the block runs to the end of the output
    body: str  # "object": one call per block, blocks repeat; "list": one block, a JSON list of calls
    pad: str = ""  # written inside the markers around the JSON (reading allows any whitespace there)
    args_key: str = "arguments"  # the key a call's arguments are written under
    bare: bool = False  # a block may also start without `open`, as the output's first text
    separator: str = "\n"  # between repeated blocks (body "object")
    # For templates that do not render tools: how the tools are listed and results shown.
    listing: str = "lines"  # "lines": one tool object per line; "list": a JSON list of functions
    result_role: str = "user"
    result_open: str = "<tool_response>\n"
    result_close: str = "\n</tool_response>"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls as the model writes them: (name, arguments mapping) pairs. A bare family's
        calls are written without the marker, as its model writes calls to custom tools."""
        objects = [{"name": name, self.args_key: arguments} for name, arguments in calls]
        if self.body == "list":
            return self.wrap(_dumps(objects))
        return self.separator.join(self.wrap(_dumps(o)) for o in objects)

    def wrap(self, inner: str) -> str:
        return self.written_open + inner + self.written_close

    @property
    def written_open(self) -> str:
        """The text written before a block's JSON (a bare family writes none)."""
        return "" if self.bare else self.open + self.pad

    @property
    def written_close(self) -> str:
        return self.pad + self.close if self.close else ""


HERMES = Family("hermes", ("<tool_call>",), open="<tool_call>", close="</tool_call>", pad="\n", body="object")
SMOLLM2 = Family("smollm2", ("SmolLM",), open="<tool_call>", close="</tool_call>", body="list", listing="list")
LLAMA3 = Family("llama3", ("<|python_tag|>",), open="<|python_tag|>", close=None, body="object",
                args_key="parameters", bare=True, separator="; ", result_role="ipython", result_open="",
                result_close="")
MISTRAL = Family("mistral", ("[TOOL_CALLS]",), open="[TOOL_CALLS]", close=None, body="list",
                 result_role="tool", result_open="", result_close="")

# Detection order: the first family whose marker the template's source contains.
FAMILIES: tuple[Family, ...] = (MISTRAL, HERMES, LLAMA3, SMOLLM2)
DEFAULT_FAMILY = HERMES  # the most widely tuned format, for templates that show none

_TOOLS_WORD = re.compile(r"\btools\b")

SYSTEM_INTRO = "You can call functions to help answer. They are described as JSON between the tools tags:"
SYSTEM_FORMAT = "To call functions, answer with exactly this form and nothing else:"
SYSTEM_NONE = "When no function fits the request, answer in plain text."
EXAMPLE_CALL = ("function_name", {"argument_name": "value"})


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- request checks ---------------------------------------------------------------------------

def check_tools(tools: Any) -> list[dict]:
    """The request's tools, checked: OpenAI function tools with distinct names."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise StrataError("tools: must be a list of tool objects")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise StrataError(f"{at}: must be an object")
        if tool.get("type", "function") != "function":
            raise StrataError(f"{at}.type: {tool.get('type')!r} is not supported (only 'function')")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise StrataError(f"{at}.function: missing or not an object")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise StrataError(f"{at}.function.name: missing, empty or longer than 256 characters")
        if name in seen:
            raise StrataError(f"{at}.function.name: {name!r} is listed twice")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise StrataError(f"{at}.function.parameters: must be a JSON schema object")
        seen.add(name)
        out.append({"type": "function", "function": dict(function)})
    return out


def resolve_choice(tool_choice: Any, tools: list[dict]) -> str | tuple[str, str]:
    """The choice as "none", "auto", "required" or ("function", name); OpenAI's default is
    "auto" when there are tools, else "none"."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise StrataError("tool_choice: 'required' needs at least one tool in tools")
        return tool_choice
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise StrataError("tool_choice.function.name: missing or not a string")
        if name not in {t["function"]["name"] for t in tools}:
            raise StrataError(f"tool_choice.function.name: {name!r} is not one of the tools")
        return ("function", name)
    raise StrataError("tool_choice: must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")


# --- forcing calls -----------------------------------------------------------------------------

NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: a function without parameters takes none


def call_schema(family: Family, tools: list[dict]) -> dict:
    """The JSON of one call to any of `tools`: its name, and arguments under that function's schema."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]},
                       family.args_key: t["function"].get("parameters") or NO_PARAMETERS},
        "required": ["name", family.args_key],
    } for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def call_grammar(family: Family, tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for the family's wrapper around one call, or one or
    more when `parallel`. Tool schemas are compiled leniently: client libraries emit keywords
    and formats the grammar library does not enforce, and a call is better made with those
    ignored than the whole request refused."""
    one = call_schema(family, tools)

    def wrap(rule: str) -> str:
        return " ".join(p for p in (_literal(family.written_open), rule, _literal(family.written_close)) if p)

    if family.body == "list":
        calls = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        rules = [f"start: {wrap('calls')}", f"calls: {lark_json_rule(calls, 'tools', lenient=True)}"]
    else:
        start = f"start: block ({_literal(family.separator)} block)*" if parallel else "start: block"
        rules = [start, f"block: {wrap('call')}", f"call: {lark_json_rule(one, 'tools', lenient=True)}"]
    return "\n".join(rules) + "\n"


# --- reading calls ------------------------------------------------------------------------------

def _json_values(text: str) -> list | None:
    """The JSON values `text` holds one after another (whitespace, ',' or ';' between them),
    or None when anything else is there."""
    decoder, values, i, n = json.JSONDecoder(), [], 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (values and text[i] in ",;")):
            i += 1
        if i == n:
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        values.append(value)


def _call_of(item: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one parsed call object, or None when it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = next((item[k] for k in ("arguments", "parameters") if k in item), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text in a string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return item["name"], _dumps(arguments)


def parse_calls(body: str) -> list[tuple[str, str]] | None:
    """The calls in one block's text: call objects, lists of them, or both in a row. An empty
    list is no calls (SmolLM2's way of saying none fits); None when the text is not calls."""
    values = _json_values(body)
    if not values:
        return None
    items = [x for v in values for x in (v if isinstance(v, list) else [v])]
    calls = [_call_of(x) for x in items]
    return None if any(c is None for c in calls) else calls


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with (it may be the marker's start)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """Streamed output text in, content and tool-call deltas out (one family's format)."""

    def __init__(self, family: Family):
        self.family = family
        self.calls: list[ToolCall] = []  # the complete calls so far
        self._text = ""  # received, not yet released or placed in a block
        self._block: str | None = None  # inside a block: the text that opened it (blanks and marker; "" when bare)
        self._begun = False  # content or a block has been seen (a bare block can only come first)
        self._after_block = False  # a block has just closed: whitespace following it is not content

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        return self._scan(final=False)

    def finish(self) -> list[Delta]:
        """End of output: a block still open is parsed as it stands, or given back as content."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._block is None:
                if not self._scan_text(out, final):
                    return _merged(out)
            elif not self._scan_block(out, final):
                return _merged(out)

    def _scan_text(self, out: list[Delta], final: bool) -> bool:
        """Release content up to the next block; True when a block has opened. Whitespace that
        only separates calls from each other or from the content is not content: it is held
        until text follows it, and dropped before a block and after one."""
        family, text = self.family, self._text
        if self._after_block:
            text = self._text = text.lstrip()
        if family.bare and not self._begun:
            stripped = text.lstrip()
            if stripped.startswith(("{", "[")):
                self._block, self._begun = "", True
                return True
            if not stripped and not final:
                return False  # only blanks so far: a bare block may still come
        at = text.find(family.open)
        if at >= 0:
            before = text[:at].rstrip()
            self._release(out, before)
            # the blank before the marker goes with the block: content again if the block breaks
            after = at + len(family.open)
            self._block, self._text, self._begun = text[len(before):after], text[after:], True
            return True
        if final:
            ready = text
        else:
            ready = text[: len(text) - _held_prefix(text, family.open)].rstrip()
        self._release(out, ready)
        self._text = text[len(ready):]
        return False

    def _release(self, out: list[Delta], text: str) -> None:
        if text:
            out.append(Delta(content=text))
            self._begun, self._after_block = True, False

    def _scan_block(self, out: list[Delta], final: bool) -> bool:
        """Close the open block when its end is here; True when it closed."""
        close = self.family.close
        end = self._text.find(close) if close else -1
        if end < 0 and not final:
            return False
        body = self._text if end < 0 else self._text[:end]
        raw = self._block + (self._text if end < 0 else self._text[: end + len(close)])
        self._text = "" if end < 0 else self._text[end + len(close):]
        self._block = None
        if not close:  # a block that runs to the end may hold more calls, each behind the marker again
            body = body.replace(self.family.open, "\n")
        calls = parse_calls(body)
        if calls is None:
            self._release(out, raw)
            return True
        self._after_block = True
        for name, arguments in calls:
            call = ToolCall(new_call_id(), name, arguments)
            out.append(Delta(index=len(self.calls), id=call.id, name=name, arguments=arguments))
            self.calls.append(call)
        return True


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Adjacent content deltas as one."""
    out: list[Delta] = []
    for d in deltas:
        if d.content is not None and out and out[-1].content is not None:
            out[-1] = Delta(content=out[-1].content + d.content)
        else:
            out.append(d)
    return out


# --- the format a template speaks --------------------------------------------------------------

class ToolFormat:
    """One template's tool calling: what to render, what to force, how to read the output."""

    def __init__(self, family: Family, renders_tools: bool):
        self.family = family
        self.name = family.name
        self.renders_tools = renders_tools

    def prepare(self, messages: list[dict], tools: list[dict] | None,
                tool_choice) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools to render (see the module docstring)."""
        tools = check_tools(tools)
        shown = [] if resolve_choice(tool_choice, tools) == "none" else tools
        if self.renders_tools:
            return list(messages), (shown or None)
        return self._inline(normalize_messages(messages), shown), None

    def _inline(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        family, out = self.family, []
        gathering = False  # the last turn in `out` holds tool results; more join it, as Qwen shows them
        for message in messages:
            if message["role"] == "tool":
                result = family.result_open + message["content"] + family.result_close
                if gathering:
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": family.result_role, "content": result})
                gathering = True
                continue
            gathering = False
            message = dict(message)
            calls = message.pop("tool_calls", None)
            if calls:
                text = family.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
                message["content"] = f"{message['content']}\n{text}" if message["content"] else text
            out.append(message)
        if not tools:
            return out
        text = self.system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            return [dict(out[0], role="system", content=f"{out[0]['content']}\n\n{text}".lstrip()), *out[1:]]
        return [{"role": "system", "content": text}, *out]

    def system_text(self, tools: list[dict]) -> str:
        """The tools and the call format, in the family's layout, for the system message."""
        family = self.family
        if family.listing == "list":
            listed = _dumps([t["function"] for t in tools])
        else:
            listed = "\n" + "\n".join(_dumps(t) for t in tools) + "\n"
        return "\n".join([SYSTEM_INTRO, f"<tools>{listed}</tools>", SYSTEM_FORMAT,
                          family.render_calls([EXAMPLE_CALL]), SYSTEM_NONE])

    def constraint(self, tools: list[dict], tool_choice, parallel_tool_calls: bool = True) -> ConstraintSpec | None:
        """A Lark grammar forcing calls, for "required" or a named function; None otherwise."""
        tools = check_tools(tools)
        choice = resolve_choice(tool_choice, tools)
        if choice in ("none", "auto"):
            return None
        allowed = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice[1]]
        return ConstraintSpec("lark", call_grammar(self.family, allowed, parallel_tool_calls))

    def parser(self) -> "ToolCallParser":
        return ToolCallParser(self.family)


def tool_format_for(template: ChatTemplate) -> ToolFormat:
    """The template's family (first marker match in FAMILIES, else DEFAULT_FAMILY)."""
    source = template.source
    family = next((f for f in FAMILIES if any(m in source for m in f.markers)), DEFAULT_FAMILY)
    return ToolFormat(family, renders_tools=bool(_TOOLS_WORD.search(source)))
