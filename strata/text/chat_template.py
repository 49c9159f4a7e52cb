"""Chat templates: a model's Jinja template rendered the way `transformers` renders it.

Models are tuned on prompts their own template produced, so the environment matches
transformers' exactly: a sandbox that also forbids mutating objects, trim_blocks and
lstrip_blocks, the loop-controls extension ({% break %}/{% continue %}), a `tojson` that
neither HTML-escapes nor ASCII-escapes, and the globals `raise_exception` and
`strftime_now`. OpenAI-style list content is flattened to text first (text parts joined
with newlines, as llama.cpp's server does), since most templates expect a string.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import StrataError

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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
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


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked copies of the messages with string content; StrataError names a bad field."""
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
        out.append(copy)
    return out


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS texts it may refer to."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = TEMPLATE_KEY):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise StrataError(f"{origin}: template syntax error at line {e.lineno}: {e.message}") from None

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], name: str | None = None) -> "ChatTemplate":
        """The file's template (`tokenizer.chat_template`, or `.<name>` for a named one);
        ChatML when the file has none, said in a log line."""
        key = TEMPLATE_KEY if name is None else f"{TEMPLATE_KEY}.{name}"
        source = md.get(key)
        tokens = md.get("tokenizer.ggml.tokens")
        tokens = [] if tokens is None else tokens
        bos, eos = (_token_text(md, tokens, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
        if source is None:
            if name is not None:
                raise StrataError(f"{key}: the file has no chat template named {name!r}")
            log.warning("%s: absent in the model file; using a ChatML fallback template", TEMPLATE_KEY)
            return cls(CHATML, bos, eos, origin=FALLBACK_ORIGIN)
        return cls(str(source), bos, eos, origin=key)

    @property
    def is_fallback(self) -> bool:
        return self.origin == FALLBACK_ORIGIN

    def render(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        context.update(messages=normalize_messages(messages), tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise StrataError(f"chat template: {e}") from None
        except jinja2.TemplateError as e:  # undefined names, sandbox refusals
            raise StrataError(f"chat template ({self.origin}) failed: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise StrataError(f"chat template ({self.origin}) failed on these messages: {e}") from None


def _token_text(md: Mapping[str, Any], tokens, key: str) -> str:
    value = md.get(key)
    if value is None or not 0 <= int(value) < len(tokens):
        return ""
    return str(tokens[int(value)])
