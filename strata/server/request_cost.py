"""Cost bounds of a generation request, checked before the work they bound is spent.

- A prompt of token ids longer than the context is refused before its ids are validated one
  by one (2^21 ids take seconds to validate; the context holds thousands).
- A chat request's text (its messages, its tools and its chat_template_kwargs, which the
  template renders into the prompt) is held to what the context can take before it is
  templated and tokenized: a text of B bytes is at least B / L tokens, L the byte length of
  the vocabulary's longest token (strata/server/prompt_limits.py). Without this, 12 MB of
  tools is templated and tokenized into millions of tokens only to be refused afterwards.
"""

from __future__ import annotations

import json
from typing import Any

from strata.server.errors import APIError
from strata.server.prompt_limits import PromptLimits, overflow
from strata.server.schemas import parse_json_object, validate


def parse_generation(model_cls: type, raw: bytes, core: Any):
    """A chat or completions body -> its request model, refusing an id prompt longer than the
    loaded core's context (`core` None while loading: no check) before validating its ids."""
    data = parse_json_object(raw)
    if core is not None and "prompt" in model_cls.model_fields:
        refuse_long_id_prompt(data, int(core.n_ctx))
    return validate(model_cls, data)


def refuse_long_id_prompt(data: dict[str, Any], n_ctx: int) -> None:
    prompt, param = data.get("prompt"), "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt, param = prompt[0], "prompt[0]"  # a batch of one prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and len(prompt) >= n_ctx:
        raise overflow(len(prompt), n_ctx, param)


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")) if value else 0


def refuse_chat_text(limits: PromptLimits, req: Any, n_ctx: int) -> None:
    """400 when the chat request's text cannot fit the context, naming what pushed it over:
    `messages` (their text alone is at least n_ctx tokens), else `tools`, else
    `chat_template_kwargs` (the text of all three is more than the context can hold)."""
    limits.refuse_if_cannot_fit([m.text() for m in req.messages], n_ctx, "messages")
    if not limits.max_token_bytes:
        return
    room = n_ctx * limits.max_token_bytes  # bytes that n_ctx tokens can hold at most
    total = sum(len(m.text().encode("utf-8")) for m in req.messages)
    total += sum(_json_bytes(m.tool_calls and [c.model_dump() for c in m.tool_calls]) for m in req.messages)
    for param, value in (("tools", req.tools), ("chat_template_kwargs", req.chat_template_kwargs)):
        total += _json_bytes(value)
        if total >= room:
            raise APIError("exceed_context_size_error",
                           f"{param}: the request's messages, tools and chat_template_kwargs hold {total} bytes of "
                           f"text, more than a context of {n_ctx} tokens can take (at most {room} bytes: "
                           f"{limits.max_token_bytes} bytes per token at most)",
                           param=param, code="exceed_context_size_error", extra={"n_ctx": int(n_ctx)})
