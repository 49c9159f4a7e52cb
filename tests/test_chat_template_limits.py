"""Chat templates render under limits (time, text, loop steps, nesting): a model file's template
that would hang the engine or grow its memory fails that render with one TemplateLimitError,
and a pack whose template breaks a limit on a sample conversation fails at load with one line.
Normal templates render exactly as the unlimited transformers environment renders them."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import StrataError
from strata.text import chat_template as ct
from strata.text import template_budget
from strata.text.chat_template import ChatTemplate
from strata.text.template_budget import ChatTemplateError, TemplateLimitError, TemplateLimits

USER = [{"role": "user", "content": "hi"}]
MiB = 1 << 20
HANG_S = 60.0  # a render still going after this never stops: a guard against a hang only


def refused(source: str, messages=USER, limits: TemplateLimits = TemplateLimits()) -> tuple[str, float, int]:
    """(error message, seconds, peak traced bytes) of a render that must break a limit."""
    template = ChatTemplate(source, limits=limits)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TemplateLimitError) as e:
            template.render(messages)
        seconds = time.monotonic() - t0
        assert seconds < HANG_S, seconds
        return str(e.value), seconds, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class ClockLooks:
    """Each look a render's budget takes at the clock (Budget.check_time): the loop steps it had
    made then, and whether the look stopped it. Counting steps rather than timing them: a
    render stopped by its time limit ends at its first look past the deadline and looks every
    few steps, however slowly this machine runs it; `seconds` is how long it ran."""

    def __init__(self, monkeypatch):
        self.steps: list[int] = []
        self.stopped: list[bool] = []
        self.seconds = 0.0
        check = template_budget.Budget.check_time

        def spied(budget) -> None:
            self.steps.append(budget.limits.loop_items - budget.loop_left)
            try:
                check(budget)
            except TemplateLimitError:
                self.stopped.append(True)
                raise
            self.stopped.append(False)
        monkeypatch.setattr(template_budget.Budget, "check_time", spied)

    def __enter__(self) -> "ClockLooks":
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.monotonic() - self.t0

    def assert_stopped_at(self, limit_s: float, most_steps_between_looks: int = 4096) -> None:
        assert self.seconds >= limit_s, f"ended after {self.seconds:.3f} s, before its {limit_s} s limit"
        assert self.seconds < limit_s + HANG_S, self.seconds
        # the first look that found the deadline passed ended the render (nothing caught it and went on)
        assert self.stopped[-1] and self.stopped.count(True) == 1
        # and it looked at the clock all along, every few steps: a step is microseconds, so it
        # stopped within a few thousand steps of its deadline
        between = [b - a for a, b in zip(self.steps, self.steps[1:])]
        assert len(between) > 1 and max(between) <= most_steps_between_looks, max(between, default=None)


# --- templates that once hung or escaped as tracebacks ---------------------------------------------

def test_nested_range_loops_stop_at_the_time_limit(monkeypatch):
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = ChatTemplate(source, limits=TemplateLimits(loop_items=10**12))  # so time is what stops it
    assert TemplateLimits().seconds == 2.0
    limit = r"^the chat template \(tokenizer.chat_template\) ran past its 2 s limit$"
    with ClockLooks(monkeypatch) as looks, pytest.raises(TemplateLimitError, match=limit):
        template.render(USER)
    looks.assert_stopped_at(2.0)


def test_nested_loops_over_a_string_stop_at_the_time_limit(monkeypatch):
    # no range(), no call, no output in the body: only the loops' own steps can see the clock;
    # 20000 x 20000 steps: past the limit on any machine (2000 x 2000 could finish in time)
    source = "{% set s = messages[0].content * 10000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    template = ChatTemplate(source, limits=TemplateLimits(seconds=0.5, loop_items=10**12))
    with ClockLooks(monkeypatch) as looks, pytest.raises(TemplateLimitError, match=r"ran past its 0.5 s limit"):
        template.render(USER)
    looks.assert_stopped_at(0.5)


def test_loop_steps_of_all_loops_together_are_bounded():
    source = "{% for i in range(1000) %}{% for m in messages %}{% endfor %}{% endfor %}"
    message, _, _ = refused(source, messages=USER * 10, limits=TemplateLimits(loop_items=5000))
    assert "ran past its limit of 5000 loop steps" in message


def test_a_billion_character_string_is_refused_before_it_is_made():
    message, _, peak = refused("{{ 'a' * 10**9 }}")
    assert "would make text of 1000000000 characters" in message
    assert peak < 4 * MiB  # sized from its operands, never allocated


@pytest.mark.parametrize("source, limit", [
    ("{{ 'a' * 2**62 }}", "would make text of 4611686018427387904 characters"),
    ("{% for i in range(10**9) %}{% endfor %}", "asked for range() of 1000000000 items, past its limit of 100000"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested calls past its limit of 64 levels"),
    ("{% for x in messages recursive %}{{ loop(messages) }}{% endfor %}", "nested calls past its limit"),
    ("{{ 2 ** (2 ** 62) }}", "would make a number of"),
    ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "would make a number of"),
])
def test_escapes_of_the_issue_are_one_error(source, limit):
    message, _, peak = refused(source)
    assert message.startswith("the chat template (tokenizer.chat_template) ") and limit in message
    assert "\n" not in message and peak < 8 * MiB


# Each way a template can make a large value in one step, refused before it is made.
@pytest.mark.parametrize("source", [
    "{{ 'a'|center(10**9) }}",
    "{{ 'a'.ljust(10**9) }}",
    "{{ 'a'.zfill(10**9) }}",
    "{{ '\t'.expandtabs(10**9) }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ '{:>{w}}'.format(1, w=10**9) }}",
    "{{ '%1000000000d' % 1 }}",
    "{{ '%*d' % (10**9, 1) }}",
    "{{ '%.1000000000f' % 1.0 }}",
    "{{ '%s'|format(1)|indent(10**9, true) }}",
    "{{ ('x' * 1000)|replace('', 'y' * 10000) }}",
    "{{ ('x' * 100000).replace('', 'y' * 100) }}",
    "{{ ('x' * 1000).join(range(20000)|map('string')) }}",
    "{{ range(20000)|map('string')|join('x' * 1000) }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{{ range(3)|batch(10**9, 'x')|list }}",
    "{{ lipsum(10**6) }}",
    "{{ ('a' * 1000000).translate({97: 'x' * 1000000}) }}",
    "{{ ('a' * 1000).encode().center(10**9) }}",
    "{{ (['%999999999d'] * 2)|format(1) }}",
    "{{ (['x' * 100000] * 100000)|indent(2) }}",
    "{{ ([{'k': [1] * 100000}] * 100000)|sum(attribute='k', start=[]) }}",
    "{{ messages * 10**9 }}",
    "{{ [messages[0].content * 100000] * 100000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
])
def test_large_values_are_refused_before_they_are_made(source):
    message, _, peak = refused(source)
    assert "the chat template (tokenizer.chat_template)" in message
    assert peak < 16 * MiB, f"{peak / MiB:.0f} MiB"


def test_text_made_in_all_is_bounded():
    # each piece is small, but 100,000 fresh 100 KB pieces held in one capture would be 10 GB
    source = ("{% set x %}{% for i in range(100000) %}{{ messages[0].content * 50000 ~ i }}{% endfor %}"
              "{% endset %}{{ x|length }}")
    message, _, peak = refused(source)
    assert "made more than its limit of" in message and "characters of text in all" in message
    assert peak < 64 * MiB


def test_output_limit_follows_the_input():
    content = "x" * 100_000
    repeat = "{% for i in range(N) %}{{ messages[0].content }}{% endfor %}"
    # 8 x the input's text plus 1 MiB: ten copies fit, a hundred do not
    assert len(ChatTemplate(repeat.replace("N", "10")).render([{"role": "user", "content": content}])) == 10 ** 6
    message, _, _ = refused(repeat.replace("N", "100"), messages=[{"role": "user", "content": content}])
    assert "made output past its limit of" in message


def test_template_code_errors_are_one_error_type():
    for source in ("{{ 1 / 0 }}", "{{ 1 + 'a' }}", "{{ messages[5].content }}", "{{ none.x.y }}",
                   "{{ messages.append(1) }}", "{% include 'other' %}", "{{ 10 ** 4000 }}", "{{ 'ab'|truncate(1) }}",
                   "{{ range(2**70) }}", "{{ 2.0 ** 100000 }}"):
        with pytest.raises(ChatTemplateError, match="chat template"):
            ChatTemplate(source).render(USER)


def test_sources_that_do_not_compile_are_one_line():
    for source, limits in (("{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", TemplateLimits()),
                           ("{{ 1 }}" * 10, TemplateLimits(source_chars=20))):
        with pytest.raises(StrataError, match=r"^tokenizer.chat_template: ") as e:
            ChatTemplate(source, limits=limits)
        assert "\n" not in str(e.value)


# --- normal templates render as before ------------------------------------------------------------

# A template in the style of tool-calling chat models, written to use what real templates use:
# namespaces, loop variables, macros, captures, recursive loops, filters, string methods, every
# intercepted operator, range(), loop controls, tojson, raise_exception and strftime_now.
FEATURES = """
{%- macro render_args(args) -%}
{%- for k, v in args|dictsort %}{{ k }}={{ v|tojson }}{{ ', ' if not loop.last }}{% endfor -%}
{%- endmacro -%}
{%- set ns = namespace(system='', tool_turns=0, last_user=-1) -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content|trim -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set rest = messages -%}
{%- endif -%}
{%- for i in range(rest|length - 1, -1, -1) -%}
  {%- if rest[i].role == 'user' and ns.last_user < 0 %}{% set ns.last_user = i %}{% endif -%}
{%- endfor -%}
{{ bos_token }}<|system|>{{ ns.system or 'You are helpful.' }} (%s)|{{ '%d turns' % (rest|length) }}
{%- if tools %}
# Tools
{{ tools|tojson(indent=2) }}
{%- for t in tools %}
- {{ t.function.name|upper }}: {{ '{:<12}'.format(t.function.name) }}|{{ t.function.name|center(16) }}
{%- endfor %}
{%- endif %}
{% for m in rest -%}
  {%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' ~ m.role) }}{% endif -%}
  {%- if m.role == 'tool' %}{% set ns.tool_turns = ns.tool_turns + 1 %}{% endif -%}
  {%- set head %}<|{{ m.role }}|>{% if loop.index0 == ns.last_user %}[last]{% endif %}{% endset -%}
  {{ head }}
  {%- if m.content.startswith('/') %}{{ m.content[1:].split(' ')|map('capitalize')|join(' ') }}
  {%- else %}{{ m.content|replace('\t', '    ') ~ ('' if m.content.endswith('.') else '') }}{% endif -%}
  {%- if m.tool_calls is defined %}{% for c in m.tool_calls %}
<call>{{ c.function.name }}({{ render_args(c.function.arguments) }})</call>
{%- endfor %}{% endif %}
{{ '=' * 3 + '\n' if not loop.last else '' }}
  {%- if loop.index is divisibleby 3 %}{% continue %}{% endif -%}
  {%- if loop.index > 1000 %}{% break %}{% endif -%}
{% endfor -%}
{%- for item in [{'name': 'a', 'kids': [{'name': 'b', 'kids': []}]}] recursive -%}
({{ item.name }}{{ loop(item.kids) }})
{%- endfor %}
{{ loop_cycle_demo if false }}{% for x in range(4) %}{{ loop.cycle('o', 'e') }}{{ loop.length }}{% endfor %}
{{ 2 ** 10 }} {{ 7 % 3 }} {{ [1, 2] + [3] }} {{ (rest|map(attribute='content')|map('length')|sum) }} {{ 'y' ~ 1.5 }}
{{ strftime_now('%Y')|length }} {{ range(3) }} {{ range(3)|list }} {{ range(5)|reverse|list }} {{ messages|length }}
{% for r in messages|map(attribute='role') %}{{ r }}{{ loop.length }}{{ loop.last }}{{ loop.revindex }}{% endfor %}
{% for m in messages if m.role == 'user' %}{{ loop.index }}{% else %}none{% endfor %}
{{ (rest|selectattr('role', 'equalto', 'user')|list|length) }} {{ ns.tool_turns }} {{ eos_token }}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}
"""


def transformers_environment_render(source: str, messages, **kwargs) -> str:
    """The render without limits: jinja as transformers configures it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = ct._tojson
    env.globals["raise_exception"] = ct._raise_exception
    env.globals["strftime_now"] = ct._strftime_now
    context = {"bos_token": "<s>", "eos_token": "</s>", "tools": None, "add_generation_prompt": True, **kwargs}
    return env.from_string(source).render(messages=ct.normalize_messages(messages), **context)


WEATHER = {"name": "get_weather", "description": "Weather <now>",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}]
CONVERSATIONS = [
    USER,
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "/tell me a story"},
     {"role": "assistant", "content": "Once.", "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
     {"role": "tool", "content": "sunny\tand warm"}, {"role": "user", "content": "naïve <b>ok</b>"}],
    [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "word " * (i % 7)} for i in range(200)],
]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_normal_templates_render_as_without_limits(i):
    messages = CONVERSATIONS[i]
    template = ChatTemplate(FEATURES, bos_token="<s>", eos_token="</s>")
    for tools in (None, TOOLS):
        expected = transformers_environment_render(FEATURES, messages, tools=tools)
        assert template.render(messages, tools=tools) == expected
    assert "(a(b))" in expected and "<call>get_weather(city=\"Paris\", days=3)</call>" in template.render(
        CONVERSATIONS[1]) and "GET_WEATHER" in template.render(USER, tools=TOOLS)


def test_raise_exception_is_still_the_templates_own_message():
    with pytest.raises(ChatTemplateError, match="^chat template: bad role robot$"):
        ChatTemplate(FEATURES).render([{"role": "robot", "content": "x"}])


@pytest.fixture(scope="module")
def model_metadata():
    from strata.gguf.reader import GGUFFile
    from tests.support.model_fixtures import default_model_or_skip

    with GGUFFile(default_model_or_skip()) as f:
        return dict(f.metadata)


def test_the_test_models_template_renders_a_megabyte_conversation_as_before(model_metadata):
    template = ChatTemplate.from_metadata(model_metadata)
    body = "lorem ipsum dolor sit amet " * 37  # ~1 KB a turn, 1000 turns
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"{i} {body}"} for i in range(1000)]
    text = template.render(messages)
    assert len(text) > 10 ** 6
    assert text == transformers_environment_render(template.source, messages, bos_token=template.bos_token,
                                                   eos_token=template.eos_token)


# --- load -------------------------------------------------------------------------------------------

HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_pack_whose_template_breaks_a_limit_fails_at_load(monkeypatch):
    md = {"tokenizer.ggml.tokens": ["a"], "tokenizer.chat_template": HOSTILE}
    with ClockLooks(monkeypatch) as looks, \
            pytest.raises(StrataError, match=r"^tokenizer.chat_template: the chat template ran past its 0.3 s limit "
                                             r"on a sample conversation; this model file's template cannot be used$"):
        ChatTemplate.from_metadata(md, limits=TemplateLimits(seconds=0.3, loop_items=10**12))
    looks.assert_stopped_at(0.3)
    with pytest.raises(StrataError, match=r"^tokenizer.chat_template: the chat template would make text"):
        ChatTemplate.from_metadata(dict(md, **{"tokenizer.chat_template": "{{ 'a' * 10**9 }}"}))


def test_a_template_that_refuses_the_sample_by_its_own_rules_still_loads():
    # templates may refuse system turns or odd orders; that is the request's problem, not the file's
    source = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok"
    template = ChatTemplate.from_metadata({"tokenizer.ggml.tokens": ["a"], "tokenizer.chat_template": source})
    assert template.render(USER) == "ok"


def test_the_engine_refuses_a_pack_with_a_hostile_template_in_one_line(tmp_path):
    from strata.gguf.constants import ValueType
    from strata.gguf.reader import GGUFFile
    from strata.gguf.writer import write_gguf
    from tests.support.model_fixtures import synth_model

    def with_template(source: str) -> str:
        src = synth_model(tmp_path / "synth", "llama")
        with GGUFFile(src) as f:
            md = dict(f.metadata, **{"tokenizer.chat_template": source})
            types = dict(f.metadata_types, **{"tokenizer.chat_template": ValueType.STRING})
            tensors = [(t.name, t.ggml_type, t.shape, t.data()) for t in f.tensors.values()]
            return str(write_gguf(tmp_path / f"chat{len(source)}.gguf", md, tensors, types))

    def generate(pack: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--device", "cpu", "--pack", pack,
                               "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True, timeout=120)

    done = generate(with_template("{{ 'a' * 10**9 }}"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and lines[-1].startswith("strata: tokenizer.chat_template: "), done.stderr
    assert "would make text of 1000000000 characters" in lines[-1]
    fine = generate(with_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"))
    assert fine.returncode == 0, fine.stderr


# --- threads ----------------------------------------------------------------------------------------

def test_renders_on_several_threads_keep_their_own_limits():
    """Hostile and normal renders at once: each hostile one fails on its own budget, each normal
    one is exact and is not charged for the others' text or time."""
    hostile = ChatTemplate(HOSTILE, limits=TemplateLimits(seconds=0.5, loop_items=10**12))
    big = ChatTemplate("{{ messages[0].content * 7 }}")
    normal = ChatTemplate(FEATURES, bos_token="<s>", eos_token="</s>")
    expected = transformers_environment_render(FEATURES, CONVERSATIONS[2])
    content = [{"role": "user", "content": "z" * 200_000}]  # 1.4 MB out of a 1.6 MB+ allowance, each
    barrier = threading.Barrier(12)

    def job(kind: str):
        barrier.wait()
        if kind == "hostile":
            with pytest.raises(TemplateLimitError, match="0.5 s limit"):
                hostile.render(USER)
            return "refused"
        if kind == "big":
            return len(big.render(content))
        return [normal.render(CONVERSATIONS[2]) == expected for _ in range(5)]

    kinds = ["hostile", "big", "normal"] * 4
    with ThreadPoolExecutor(len(kinds)) as pool:
        results = list(pool.map(job, kinds))
    assert results == [{"hostile": "refused", "big": 1_400_000, "normal": [True] * 5}[k] for k in kinds]
