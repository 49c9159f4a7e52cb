"""Tools and structured output with the official openai client, over real HTTP against a real
`strata serve` and the test model: response_format json_object / json_schema (chat and
completions) and `.parse()` with a pydantic model; tool_choice required and named, streamed and
not, parallel_tool_calls, a tool round trip; bad schemas and choices as one 400 naming the field.

The test model (SmolLM2-135M) was not tuned on tool calls: forced calls (required, named) are
what it can make reliably, so those are what is asserted. Schemas bound their strings and
numbers so that a whole answer fits in a few dozen tokens (the grammar ends it when complete).
The server is the one of tests/support/shared_server.py, shared with other modules.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

from support import shared_server
from support.server_proc import HTTP, openai_client
from support.shared_server import AUTH, KEY

MAX = 48  # tokens per answer: room for the bounded answers below

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two small numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                 "properties": {"name": {"type": "string", "maxLength": 10},
                                "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


# the key, "smol" served, 2 slots, a context of shared_server.N_CTX (512: the longest prompt
# here, two tools' definitions and a question, is ~260 tokens, and an answer at most MAX)
server = shared_server.module_fixture(__name__)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY, timeout=300)


def chat(client, **kw):
    return client.chat.completions.create(model="smol", **{"temperature": 0, "max_tokens": MAX, **kw})


@pytest.fixture(scope="module")
def weather_call(client):
    """The plain answer to ASK_WEATHER with tool_choice required: greedy, so the same answer for
    each test that looks at it (asked once, not once per test)."""
    return chat(client, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required")


def valid_person(value) -> bool:
    return (set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 10
            and isinstance(value["age"], int) and 0 <= value["age"] <= 120)


# ---------------------------------------------------------------- structured output

def test_json_schema_output_parses_and_validates(client):
    r = chat(client, messages=[{"role": "user", "content": "Invent a person."}],
             response_format={"type": "json_schema",
                              "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r
    assert valid_person(json.loads(r.choices[0].message.content))


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="smol", temperature=0, max_tokens=MAX, response_format=Person,
                                      messages=[{"role": "user", "content": "Describe a person."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_json_object_and_completions(client, server):
    r = chat(client, messages=[{"role": "user", "content": "Answer in JSON: a colour."}], max_tokens=24,
             response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    # completions takes response_format too, and llama-server's json_schema field
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}},
                  {"json_schema": PERSON_SCHEMA}):
        c = client.completions.create(model="smol", prompt="A person as JSON:", temperature=0, max_tokens=MAX,
                                      extra_body=extra)
        assert c.choices[0].finish_reason == "stop" and valid_person(json.loads(c.choices[0].text))


# ---------------------------------------------------------------- tool calls

def check_weather_call(call) -> None:
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12


def test_tool_choice_required(weather_call):
    choice = weather_call.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        check_weather_call(call)


def test_named_tool_choice_and_one_call_only(client):
    r = chat(client, messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=[WEATHER, ADD],
             tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "add"
    args = json.loads(calls[0].function.arguments)
    assert set(args) == {"a", "b"} and all(0 <= args[k] <= 9 for k in args)


def test_streamed_tool_calls_are_openais_deltas(client, weather_call):
    chunks = list(chat(client, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:  # the first delta of a call: id, type and name
                assert call["id"] is None and d.type == "function" and d.function.name
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls and all(c["name"] == "get_weather" and json.loads(c["arguments"])["city"] for c in calls.values())
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    # the stream says what the plain answer says
    plain = weather_call.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in plain] == [json.loads(c["arguments"]) for c in calls.values()]


def test_a_tool_round_trip(client, weather_call):
    first = weather_call.choices[0].message
    call = first.tool_calls[0]
    history = [*ASK_WEATHER,
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = chat(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=16)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    again = chat(client, messages=history, tools=[WEATHER], tool_choice="required")
    check_weather_call(again.choices[0].message.tool_calls[0])


# ---------------------------------------------------------------- refusals

def post(server, body) -> httpx.Response:
    return HTTP.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                     json={"messages": ASK_WEATHER, "max_tokens": 4, **body})


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "json_schema": PERSON_SCHEMA}, "json_schema"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
])
def test_bad_tools_and_formats_are_400_naming_the_field(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "\n" not in err["message"] and "Traceback" not in err["message"]


def test_tools_with_choice_none_are_not_shown(server):
    r = post(server, {"tools": [WEATHER], "tool_choice": "none", "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") is None
