"""Chat templates: a model's Jinja template rendered the way `transformers` renders it.

Models are tuned on prompts their own template produced, so the environment matches
transformers' exactly: a sandbox that also forbids mutating objects, trim_blocks and
lstrip_blocks, the loop-controls extension ({% break %}/{% continue %}), a `tojson` that
neither HTML-escapes nor ASCII-escapes, and the globals `raise_exception` and
`strftime_now`. OpenAI-style list content is flattened to text first (text parts joined
with newlines, as llama.cpp's server does), since most templates expect a string.

The template came with the model file, so it renders under limits (template_limits.py): one
that runs too long or makes too much text fails that render with a TemplateLimitError, and a
file whose template breaks a limit on a sample conversation fails at load, naming the key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2

from strata.errors import StrataError
from strata.text.template_budget import Budget, ChatTemplateError, TemplateLimitError, TemplateLimits, applied
from strata.text.template_limits import LimitedEnvironment
from strata.text.template_sizes import text_size

log = logging.getLogger(__name__)

TEMPLATE_KEY = "tokenizer.chat_template"

# Used when the file has no template: plain ChatML, what most small instruct models speak.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FALLBACK_ORIGIN = "ChatML fallback template"


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


def _raise_exception(message: str = "error raised by the chat template"):
    raise _TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Markup-free and not HTML-escaped: '<' and non-ASCII text stay as they are.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = LimitedEnvironment()
    env.filters["tojson"] = _tojson
    env.limit_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _require_object(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise StrataError(f"{where}: must be an object, not {type(value).__name__}")
    return value


def _flatten_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            kind = _require_object(part, at).get("type")
            if kind != "text":
                raise StrataError(f"{at}.type: {kind!r} is not supported (only 'text' parts)")
            text = part.get("text")
            if not isinstance(text, str):
                raise StrataError(f"{at}.text: missing or not a string")
            texts.append(text)
        return "\n".join(texts)
    raise StrataError(f"{where}: must be a string or a list of text parts, not {type(content).__name__}")


def _tool_arguments(arguments: Any, where: str) -> Any:
    # transformers hands templates the arguments as a mapping (Qwen's and Llama's templates
    # `tojson` them); OpenAI clients send JSON text, so text holding a JSON object becomes one.
    if arguments is None:
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str):
        raise StrataError(f"{where}: must be a JSON string or an object, not {type(arguments).__name__}")
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Copies of an assistant turn's tool_calls, arguments as a mapping where they are a JSON object."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise StrataError(f"{where}: must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = _require_object(_require_object(call, at).get("function"), f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise StrataError(f"{at}.function.name: missing or not a string")
        arguments = _tool_arguments(function.get("arguments", {}), f"{at}.function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked copies of the messages with string content; StrataError names a bad field.
    Tool turns pass as transformers passes them: an assistant's `tool_calls` (arguments as a
    mapping when they are a JSON object), and `role: "tool"` results with their content."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise StrataError("messages: must be a list of message objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = _require_object(message, where).get("role")
        if not isinstance(role, str) or not role:
            raise StrataError(f"{where}.role: missing or not a string")
        copy = dict(message)
        content = message.get("content")
        if content is None:
            # An assistant turn that only calls tools may omit content (OpenAI allows it).
            if not message.get("tool_calls"):
                raise StrataError(f"{where}.content: missing")
            copy["content"] = ""
        else:
            copy["content"] = _flatten_content(content, f"{where}.content")
        if message.get("tool_calls") is not None:
            copy["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(copy)
    return out


# The conversation every pack's template renders once at load, under the render limits: a
# system prompt and two turns, as most templates expect.
SAMPLE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS texts it may refer to. Renders run under
    `limits` (template_limits.py), on any thread, several at once."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = TEMPLATE_KEY,
                 limits: TemplateLimits = TemplateLimits()):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        self.limits = limits
        if len(source) > limits.source_chars:
            raise StrataError(f"{origin}: the chat template is {len(source)} characters, past its limit of "
                              f"{limits.source_chars}")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise StrataError(f"{origin}: template syntax error at line {e.lineno}: {e.message}") from None
        except Exception as e:  # jinja's own limits on odd sources: a 10,000-digit literal, deep nesting
            raise StrataError(f"{origin}: the chat template does not compile: {type(e).__name__}: {e}") from None

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], name: str | None = None,
                      limits: TemplateLimits = TemplateLimits()) -> "ChatTemplate":
        """The file's template (`tokenizer.chat_template`, or `.<name>` for a named one);
        ChatML when the file has none, said in a log line. The file's template renders a
        sample conversation first: one that breaks a limit there fails the load."""
        key = TEMPLATE_KEY if name is None else f"{TEMPLATE_KEY}.{name}"
        source = md.get(key)
        tokens = md.get("tokenizer.ggml.tokens")
        tokens = [] if tokens is None else tokens
        bos, eos = (_token_text(md, tokens, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
        if source is None:
            if name is not None:
                raise StrataError(f"{key}: the file has no chat template named {name!r}")
            log.warning("%s: absent in the model file; using a ChatML fallback template", TEMPLATE_KEY)
            return cls(CHATML, bos, eos, origin=FALLBACK_ORIGIN, limits=limits)
        template = cls(str(source), bos, eos, origin=key, limits=limits)
        template.check_sample()
        return template

    def check_sample(self) -> None:
        """Render SAMPLE under the limits; StrataError naming the key when a limit breaks. The
        template's other refusals (its raise_exception, say, for a system turn) depend on the
        messages and are left to the requests that meet them."""
        try:
            self.render(SAMPLE)
        except TemplateLimitError as e:
            raise StrataError(f"{self.origin}: the chat template {e.reason} on a sample conversation; "
                              f"this model file's template cannot be used") from None
        except ChatTemplateError:
            pass

    @property
    def is_fallback(self) -> bool:
        return self.origin == FALLBACK_ORIGIN

    def render(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """The prompt text; ChatTemplateError (a StrataError) when the template fails on these
        messages, TemplateLimitError when it breaks a limit."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        context.update(messages=normalize_messages(messages), tools=tools, add_generation_prompt=add_generation_prompt)
        budget = Budget(self.limits, self.origin, text_size(context, self.limits.output_cap))
        try:
            with applied(budget):
                return self._template.render(**context)
        except ChatTemplateError:
            raise
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        except RecursionError:
            raise budget.error("nested past Python's recursion limit") from None
        except (MemoryError, OverflowError) as e:
            raise budget.error(f"made a value too large to hold ({type(e).__name__}: {e})") from None
        except jinja2.TemplateError as e:  # undefined names, sandbox refusals
            raise ChatTemplateError(f"chat template ({self.origin}) failed: {e}") from None
        except Exception as e:  # its own code on these messages: a TypeError, 1/0, a filter's assert
            raise ChatTemplateError(f"chat template ({self.origin}) failed on these messages: {e}") from None


def _token_text(md: Mapping[str, Any], tokens, key: str) -> str:
    value = md.get(key)
    if value is None or not 0 <= int(value) < len(tokens):
        return ""
    return str(tokens[int(value)])
