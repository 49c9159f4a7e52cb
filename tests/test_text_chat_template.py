"""Chat templates rendered as transformers renders them; the test model's prompts against
llama.cpp's templated prompts and ids."""

from __future__ import annotations

import json
import logging
from datetime import datetime

import pytest

from strata.errors import StrataError
from strata.text.chat_template import ChatTemplate
from strata.text.tokenizer import Tokenizer

try:  # the model-metadata fixture and the shared-reference helper live with the tokenizer tests
    from test_text_tokenizer import metadata, reference  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.test_text_tokenizer import metadata, reference  # noqa: F401


def render(source: str, messages, **kwargs) -> str:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, **kwargs)


USER = [{"role": "user", "content": "hi"}]


def test_model_template_matches_llama_cpp(metadata):  # noqa: F811
    template = ChatTemplate.from_metadata(metadata)
    tok = Tokenizer.from_metadata(metadata)
    assert not template.is_fallback
    items = reference("smollm2-greedy.json")["items"]
    assert items
    for item in items:
        text = template.render(item["prompt_messages"], add_generation_prompt=True)
        assert text == item["templated_prompt"]
        assert tok.encode(text, add_special=True) == item["prompt_token_ids"]


def test_vocab_bos_eos_texts(metadata):  # noqa: F811
    md = dict(metadata, **{"tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}"})
    assert ChatTemplate.from_metadata(md).render(USER) == "<|im_start|>|<|im_end|>"


def test_fallback_chatml_is_logged(caplog):
    with caplog.at_level(logging.WARNING):
        template = ChatTemplate.from_metadata({"tokenizer.ggml.tokens": ["a"]})
    assert template.is_fallback
    assert any("tokenizer.chat_template" in r.getMessage() for r in caplog.records)
    assert template.render(USER) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(USER, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_loop_controls_and_whitespace_control():
    source = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "[{{ m.content }}]\n"
        "{% endfor %}"
    )
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    # trim_blocks eats the newline after each tag, lstrip_blocks the indentation before it
    assert render(source, msgs) == "[a]\n"


def test_tojson_does_not_escape():
    msgs = [{"role": "user", "content": "<b>naïve & \"quoted\"</b>"}]
    out = render("{{ messages[0].content | tojson }}", msgs)
    assert out == json.dumps(msgs[0]["content"], ensure_ascii=False)
    assert "<b>" in out and "ï" in out
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = render("{{ tools | tojson(indent=2) }}", USER, tools=tools)
    assert json.loads(out) == tools and "\n  " in out


def test_raise_exception_becomes_strata_error():
    source = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with system') }}{% endif %}"
    with pytest.raises(StrataError, match="Conversation must start with system"):
        render(source, USER)


def test_strftime_now_and_extra_variables():
    out = render("{{ strftime_now('%Y') }}|{{ enable_thinking }}", USER, enable_thinking=False)
    year, flag = out.split("|")
    assert int(year) in {datetime.now().year - 1, datetime.now().year, datetime.now().year + 1}
    assert flag == "False"


def test_list_content_is_flattened():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert render("{{ messages[0].content }}", msgs) == "one\ntwo"
    assert msgs[0]["content"][0] == {"type": "text", "text": "one"}  # caller's list untouched


@pytest.mark.parametrize(
    "messages, field",
    [
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\.content"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}],
         r"messages\[0\]\.content\[1\]\.type"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
        (["hello"], r"messages\[0\]"),
        ("hello", r"messages"),
    ],
)
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(StrataError, match=field):
        render("{{ messages }}", messages)


def test_tool_call_turn_without_content_is_allowed():
    msgs = [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]}]
    assert render("[{{ messages[0].content }}]{{ messages[0].tool_calls[0].function.name }}", msgs) == "[]f"


def test_sandbox_and_syntax_errors():
    with pytest.raises(StrataError, match="chat template"):
        render("{{ messages.append(1) }}", USER)  # immutable sandbox refuses mutation
    with pytest.raises(StrataError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}")
