"""Tool calls per chat-template family (strata.text.tool_calls): family detection, what is
rendered (the test model's own template and a template that renders tools itself), the
streaming parser against every split of its input, and the forcing grammars compiled on the
test model's tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from strata.errors import StrataError
from strata.grammar import compile_constraint
from strata.text.chat_template import ChatTemplate, normalize_messages
from strata.text.tokenizer import Tokenizer
from strata.text.tool_calls import (
    DEFAULT_FAMILY,
    FAMILIES,
    HERMES,
    LLAMA3,
    MISTRAL,
    SMOLLM2,
    ToolFormat,
    parse_calls,
    tool_format_for,
)
from tests.support.grammar_walk import random_walk
from tests.support.model_fixtures import default_metadata

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                  "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                                  "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: takes none
TOOLS = [WEATHER, ADD, NOW]
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 3})]

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 C, clear"},
    {"role": "tool", "tool_call_id": "call_b", "content": "5"},
]

# A template of our own in the Qwen style: it renders `tools` and tool turns itself.
RENDERS_TOOLS = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}Tools:{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant{{ '\\n' }}"
    "{% for call in message.tool_calls %}{{ '\\n' if not loop.first }}<tool_call>{{ '\\n' }}"
    '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}'
    "{{ '\\n' }}</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'tool' %}<|im_start|>user{{ '\\n' }}<tool_response>{{ '\\n' }}{{ message.content }}"
    "{{ '\\n' }}</tool_response><|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def metadata() -> dict:
    return dict(default_metadata())  # a copy: a test may edit its own


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_metadata(metadata)


@pytest.fixture(scope="module")
def smol(metadata) -> ChatTemplate:
    return ChatTemplate.from_metadata(metadata)


def run(parser, pieces) -> tuple[str, list[tuple[str, str]], list]:
    """Feed the pieces, finish; (content, (name, arguments) of each call, the deltas)."""
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    calls = [(d.name, d.arguments) for d in deltas if d.index is not None]
    assert [(c.name, c.arguments) for c in parser.calls] == calls
    assert [d.index for d in deltas if d.index is not None] == list(range(len(calls)))
    return content, calls, deltas


def splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# --- families ---------------------------------------------------------------------------------

def test_the_test_model_speaks_smollm2_and_does_not_render_tools(smol):
    fmt = tool_format_for(smol)
    assert fmt.name == "smollm2" and not fmt.renders_tools


@pytest.mark.parametrize("source, family, renders", [
    (RENDERS_TOOLS, "hermes", True),
    ("{% for m in messages %}[TOOL_CALLS]{{ tools }}{% endfor %}", "mistral", True),
    ("{{ '<|python_tag|>' if tools }}{% for m in messages %}{{ m.content }}{% endfor %}", "llama3", True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", DEFAULT_FAMILY.name, False),
])
def test_families_are_found_by_their_markers(source, family, renders):
    fmt = tool_format_for(ChatTemplate(source))
    assert (fmt.name, fmt.renders_tools) == (family, renders)


# --- what is rendered ---------------------------------------------------------------------------

def test_smollm2_gets_tools_in_the_system_message_and_history_as_text(smol):
    fmt = tool_format_for(smol)
    messages, tools = fmt.prepare(HISTORY, TOOLS, "auto")
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    listed = messages[0]["content"].split("<tools>")[1].split("</tools>")[0]
    assert json.loads(listed) == [t["function"] for t in TOOLS]
    prompt = smol.render(messages)
    assert "<tool_response>\n18 C, clear\n</tool_response>\n<tool_response>\n5\n</tool_response>" in prompt
    assert prompt.count("<|im_start|>user") == 2  # the two results are one turn
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls, _ = run(fmt.parser(), [turn])  # what the model is shown, read back: round trip
    assert content == "" and calls == [(n, json.dumps(a)) for n, a in CALLS]
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_renders_no_tools(smol):
    messages, tools = tool_format_for(smol).prepare(HISTORY[:2], TOOLS, "none")
    assert tools is None and "<tools>" not in smol.render(messages)
    messages, _ = tool_format_for(smol).prepare(HISTORY[1:2], TOOLS, None)  # default: auto
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]


def test_templates_that_render_tools_get_them_as_transformers_passes_them():
    template = ChatTemplate(RENDERS_TOOLS)
    fmt = tool_format_for(template)
    messages, tools = fmt.prepare(HISTORY, TOOLS, "auto")
    assert tools == TOOLS and messages == HISTORY
    prompt = template.render(messages, tools=tools)
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in prompt
    # arguments reach the template as a mapping: tojson writes an object, not a quoted string
    assert '"arguments": {"city": "Paris", "unit": "c"}' in prompt
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls, _ = run(fmt.parser(), [turn])
    assert content == "" and calls == [(n, json.dumps(a)) for n, a in CALLS]
    assert "<tool_response>\n18 C, clear\n</tool_response>" in prompt
    assert fmt.prepare(HISTORY, TOOLS, "none")[1] is None


def test_normalize_messages_passes_tool_turns():
    out = normalize_messages(HISTORY + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
            {"id": "d", "type": "function", "function": {"name": "g", "arguments": {"x": 1}}}]}])
    assert out[2]["content"] == ""
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    assert out[2]["tool_calls"][0]["id"] == "call_a" and out[3] == HISTORY[3]
    assert out[-1]["tool_calls"][0]["function"]["arguments"] == "[1, 2]"  # not an object: left as text
    assert out[-1]["tool_calls"][1]["function"]["arguments"] == {"x": 1}
    assert isinstance(HISTORY[2]["tool_calls"][0]["function"]["arguments"], str)  # the input is not changed


@pytest.mark.parametrize("calls, field", [
    ("nope", "messages[0].tool_calls: must be a list"),
    ([{"function": {"arguments": "{}"}}], "messages[0].tool_calls[0].function.name"),
    ([{"type": "function"}], "messages[0].tool_calls[0].function: must be an object"),
    ([{"function": {"name": "f", "arguments": 5}}], "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_calls_name_the_field(calls, field):
    with pytest.raises(StrataError) as e:
        normalize_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert field in str(e.value) and "\n" not in str(e.value)


# --- reading the output ---------------------------------------------------------------------------

OUTPUTS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
              '\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n',
    "smollm2": '<tool_call>[{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}, '
               '{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}]</tool_call>',
    "llama3": ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}};'
              ' {"name": "add", "parameters": {"a": 2, "b": 3}}',
    "mistral": 'Sure: [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
               '{"name": "add", "arguments": {"a": 2, "b": 3}}]',
}
CONTENT = {"hermes": "Let me check.", "smollm2": "", "llama3": "", "mistral": "Sure:"}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_split_of_the_output_gives_the_same_calls(family):
    rng = random.Random(family.name)
    text = OUTPUTS[family.name]
    results = [run(ToolFormat(family, True).parser(), pieces)[:2] for pieces in splits(text, rng)]
    assert results[0] == (CONTENT[family.name], [(n, json.dumps(a)) for n, a in CALLS])
    assert all(r == results[0] for r in results)


def test_calls_come_whole_with_fresh_ids():
    _, _, deltas = run(ToolFormat(HERMES, True).parser(), list(OUTPUTS["hermes"]))
    calls = [d for d in deltas if d.index is not None]
    assert all(d.id.startswith("call_") and len(d.id) > 10 and d.name and d.arguments for d in calls)
    assert len({d.id for d in calls}) == 2


NOW_CALL = [("now", "{}")]


@pytest.mark.parametrize("family, text, content, calls", [
    (HERMES, 'ok <tool_call>\n{"name": "add", "argu', 'ok <tool_call>\n{"name": "add", "argu', []),  # unterminated
    (HERMES, '<tool_call>{"name": add}</tool_call> then', '<tool_call>{"name": add}</tool_call> then', []),  # not JSON
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    (HERMES, "a < b and <tool", "a < b and <tool", []),  # a held marker start, released at the end
    (SMOLLM2, "<tool_call>[]</tool_call>No function fits.", "No function fits.", []),  # an empty list: no calls
    (SMOLLM2, '<tool_call>[{"name": "now", "arguments": {}}]', "", NOW_CALL),  # the close never came: still a call
    (LLAMA3, "The answer is {x}.", "The answer is {x}.", []),  # JSON only counts at the start
    (LLAMA3, '{"name": "now"', '{"name": "now"', []),
    (LLAMA3, '<|python_tag|>{"name": "now"}', "", NOW_CALL),
    (MISTRAL, "plain text, no calls", "plain text, no calls", []),
])
def test_broken_or_absent_calls_are_content(family, text, content, calls):
    for pieces in ([text], list(text)):
        assert run(ToolFormat(family, True).parser(), pieces)[:2] == (content, calls)


def test_content_streams_and_only_a_possible_marker_is_held():
    parser = ToolFormat(HERMES, True).parser()
    assert [d.content for d in parser.feed("Hello wor")] == ["Hello wor"]
    assert [d.content for d in parser.feed("ld <tool_")] == ["ld"]  # " <tool_" may start a call
    assert [d.content for d in parser.feed("box> ok")] == [" <tool_box> ok"]


def test_parse_calls_accepts_objects_lists_and_string_arguments():
    assert parse_calls('{"name": "f", "arguments": {"x": 1}}') == [("f", '{"x": 1}')]
    assert parse_calls('[{"name": "f", "arguments": "{\\"x\\":1}"}] {"name": "g"}') == [("f", '{"x": 1}'), ("g", "{}")]
    assert parse_calls('{"name": "f", "arguments": [1]}') is None
    assert parse_calls("") is None and parse_calls("[]") == []


# --- forcing calls ------------------------------------------------------------------------------

def accepts(compiled, tok, text: str) -> bool:
    m = compiled.matcher()
    ok = all(m.accept(t) for t in tok.encode(text))
    return ok and m.is_accepting()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_forcing_grammars_accept_the_family_format_only(family, tok):
    fmt = ToolFormat(family, False)
    many = compile_constraint(fmt.constraint(TOOLS, "required", True), tok)
    one = compile_constraint(fmt.constraint(TOOLS, "required", False), tok)
    both, first = family.render_calls(CALLS), family.render_calls(CALLS[:1])
    assert accepts(many, tok, both) and accepts(many, tok, first) and accepts(one, tok, first)
    assert not accepts(one, tok, both)  # parallel_tool_calls false: one call
    assert not accepts(many, tok, family.render_calls([("delete_all", {})]))  # not a tool
    assert not accepts(many, tok, family.render_calls([("add", {"a": 2, "b": 3, "c": 4})]))  # not a parameter
    assert not accepts(many, tok, family.render_calls([("add", {"a": 2})]))  # a required one missing
    assert not accepts(many, tok, family.render_calls([("now", {"x": 1})]))  # takes no parameters
    assert not accepts(many, tok, "I cannot call tools.")
    _, calls, _ = run(fmt.parser(), [both])
    assert calls == [(n, json.dumps(a)) for n, a in CALLS]


def test_a_named_function_is_the_only_one_allowed(tok):
    fmt = ToolFormat(HERMES, True)
    named = compile_constraint(fmt.constraint(TOOLS, {"type": "function", "function": {"name": "add"}}, True), tok)
    assert accepts(named, tok, HERMES.render_calls([("add", {"a": 1, "b": 1})]))
    assert not accepts(named, tok, HERMES.render_calls([("get_weather", {"city": "Oslo"})]))
    assert fmt.constraint(TOOLS, "auto", True) is None and fmt.constraint(TOOLS, "none", True) is None
    assert fmt.constraint(TOOLS, None, True) is None


@pytest.mark.parametrize("family", [HERMES, SMOLLM2], ids=lambda f: f.name)
def test_random_walks_under_the_forcing_grammar_parse_as_valid_calls(family, tok):
    fmt = ToolFormat(family, False)
    compiled = compile_constraint(fmt.constraint([WEATHER, ADD], "required", False), tok)
    rng = random.Random(11)
    stops = set(tok.eog_ids) | {tok.eos_id}
    for _ in range(4):
        ids = random_walk(compiled.matcher(), rng, stops)
        content, calls, _ = run(fmt.parser(), [tok.decode(ids)])
        assert content == "" and len(calls) == 1
        name, arguments = calls[0]
        arguments = json.loads(arguments)
        if name == "add":
            assert set(arguments) == {"a", "b"} and all(0 <= v <= 9 for v in arguments.values())
        else:
            assert name == "get_weather" and set(arguments) <= {"city", "unit"} and len(arguments["city"]) <= 8
            assert arguments.get("unit", "c") in ("c", "f")


@pytest.mark.parametrize("tools, choice, field", [
    ("nope", "auto", "tools: must be a list"),
    ([{"type": "retrieval"}], "auto", "tools[0].type"),
    ([{"type": "function"}], "auto", "tools[0].function: missing"),
    ([{"type": "function", "function": {"name": ""}}], "auto", "tools[0].function.name"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name: 'get_weather' is listed twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "tools[0].function.parameters"),
    (TOOLS, "sometimes", "tool_choice: must be"),
    (TOOLS, {"type": "function", "function": {"name": "fly"}}, "tool_choice.function.name: 'fly' is not one of"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name: missing"),
    ([], "required", "tool_choice: 'required' needs at least one tool"),
])
def test_bad_tools_and_choices_name_the_field(tools, choice, field):
    fmt = ToolFormat(SMOLLM2, False)
    for call in (lambda: fmt.constraint(tools, choice, True), lambda: fmt.prepare(HISTORY[:2], tools, choice)):
        with pytest.raises(StrataError) as e:
            call()
        assert field in str(e.value) and "\n" not in str(e.value)


def test_names_and_schemas_with_grammar_punctuation_are_only_data(tok):
    odd = {"type": "function", "function": {
        "name": 'we}ird"name//#', "description": 'braces { } "quotes" // and # and %json and\nnewlines',
        "parameters": {"type": "object", "properties": {"k}": {"type": "string", "description": "}}}"}}}}}
    compiled = compile_constraint(ToolFormat(HERMES, True).constraint([odd], "required", True), tok)
    text = HERMES.render_calls([('we}ird"name//#', {"k}": "v"})])
    assert accepts(compiled, tok, text)
    assert run(ToolFormat(HERMES, True).parser(), list(text))[1] == [('we}ird"name//#', '{"k}": "v"}')]
