"""llama-server's own routes, with its field names, so its clients work unchanged:
POST /tokenize, POST /detokenize, GET /props, GET /slots.

They read the loaded core and never queue for a slot: tokenizing is the tokenizer's work alone
(bounded in size, done and rendered off the event loop, stopped when its client leaves), and
/props and /slots only describe the engine. Bodies are parsed as strictly as the generation
routes' (strict JSON, no unknown fields, every field bounded).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Annotated, Any

from fastapi.responses import Response
from pydantic import Field

from strata import __version__
from strata.protocol import KNOBS, SamplingParams
from strata.sampling.filters import CHAIN
from strata.server.common import Cancelled, json_answer, json_bytes
from strata.server.errors import invalid
from strata.server.schemas import MAX_PROMPT_IDS, Strict, TokenId
from strata.server.served_core import ServedCore

if TYPE_CHECKING:
    from strata.server.engine_state import EngineState

# the order Strata's samplers run in, under llama-server's names (strata/sampling/logit_adjust.py, then
# strata/sampling/filters.py): bias, penalties and grammar first, then temperature and the filters
SAMPLERS = ("penalties", *CHAIN)
# llama-server's samplers at their off values: a knob Strata has (strata/protocol.py, KNOBS) shows
# its value instead
OFF_SAMPLERS = {"typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "mirostat": 0, "dynatemp_range": 0.0,
                "dry_multiplier": 0.0}
# The most content a /tokenize takes: its answer then has at most this many tokens (+ BOS, EOS),
# each token rendered with its piece (docs/SERVER.md, "Request limits")
MAX_TOKENIZE_BYTES = 1 << 20
RENDER_CHUNK = 1 << 15  # tokens rendered between two looks at the cancel flag


class TokenizeRequest(Strict):
    content: str
    add_special: bool = False  # BOS (and EOS) as the vocabulary asks
    parse_special: bool = True  # '<|im_start|>' written in the text is that control token
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)] = []


def piece(tokenizer: Any, token_id: int) -> str | list[int]:
    """A token's text, or its bytes when they are not valid UTF-8 alone (half of a character),
    as llama-server's with_pieces gives them."""
    raw = bytes(tokenizer.token_bytes(token_id))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize(cancel: threading.Event, core: ServedCore, req: TokenizeRequest) -> Response:
    """The answer of POST /tokenize, rendered to bytes here (on the preparer's threads: a
    million pieces as JSON take seconds, which the event loop must not spend). Its size is
    bounded before any work: each token holds at least one byte of the content (BOS and EOS
    aside), so MAX_TOKENIZE_BYTES bounds the tokens. `cancel` (its client left) is looked at
    between chunks of the work."""
    n_bytes = len(req.content.encode("utf-8"))
    if n_bytes > MAX_TOKENIZE_BYTES:
        raise invalid(f"content: {n_bytes} bytes is more than /tokenize takes ({MAX_TOKENIZE_BYTES} bytes); "
                      "tokenize a long text in parts", param="content")
    tok = core.tokenizer
    ids = list(tok.encode(req.content, add_special=req.add_special, parse_special=req.parse_special))
    if not req.with_pieces:
        _stop_if(cancel)
        return json_answer({"tokens": ids})
    memo: dict[int, bytes] = {}  # id -> its item's JSON (at most one entry per vocabulary token)
    parts = [b'{"tokens":[']
    for start in range(0, len(ids), RENDER_CHUNK):
        _stop_if(cancel)
        items = []
        for i in ids[start:start + RENDER_CHUNK]:
            item = memo.get(i)
            if item is None:
                item = memo[i] = json_bytes({"id": i, "piece": piece(tok, i)})
            items.append(item)
        parts.append((b"," if start else b"") + b",".join(items))
    parts.append(b"]}")
    return Response(b"".join(parts), media_type="application/json")


def _stop_if(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise Cancelled()


def detokenize(api: "EngineState", core: ServedCore, req: DetokenizeRequest) -> Response:
    api.limits.check_ids(req.tokens, "tokens")  # 400 naming the first id outside the vocabulary
    return json_answer({"content": core.tokenizer.decode(req.tokens)})


def generation_settings(p: SamplingParams, n_predict: int) -> dict[str, Any]:
    """A request's sampling as llama-server's `params` object. Samplers Strata does not have
    appear at their off values: requests can only ask for those (docs/SERVER.md)."""
    return {
        "n_predict": n_predict, "max_tokens": n_predict, "seed": -1 if p.seed is None else p.seed,
        **OFF_SAMPLERS, **{k.llama or name: getattr(p, name) for name, k in KNOBS.items()},
        "logit_bias": [[t, b] for t, b in sorted(p.logit_bias.items())],
        "stop": list(p.stop), "ignore_eos": p.ignore_eos, "n_probs": p.top_logprobs, "min_keep": 0, "n_keep": 0,
        "grammar": p.constraint.kind if p.constraint is not None else "",
        "samplers": list(SAMPLERS),
    }


def _speculative(core: ServedCore) -> bool:
    return core.draft is not None and core.opts is not None and core.opts.spec > 0


def _model_path(core: ServedCore) -> str:
    return str(core.pack.main.path) if core.pack is not None else ""


def props(core: ServedCore) -> dict[str, Any]:
    n_ctx = int(core.n_ctx)
    chat = core.chat
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": _speculative(core), "is_processing": False,
            "params": generation_settings(SamplingParams(), -1),  # -1: the rest of the context
            "prompt": "",
            "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1, "n_decoded": 0},
        },
        "total_slots": int(core.parallel),
        "model_path": _model_path(core),
        "chat_template": chat.source,
        "bos_token": chat.bos_token,
        "eos_token": chat.eos_token,
        "modalities": {"vision": False, "audio": False},
        "build_info": f"strata {__version__}",
        "is_sleeping": False,
    }


def slots(api: "EngineState", core: ServedCore) -> list[dict[str, Any]]:
    """core.slots_info() under llama-server's names, with the request each slot runs (its id as
    the client got it, its sampling) and Strata's own counts beside them."""
    running = {h.request.request_id: (task, h.request.params) for h, task in api.live.items()}
    n_ctx = int(core.n_ctx)
    out = []
    for s in core.slots_info():
        task, params = running.get(s.get("request_id") or "", (-1, None))
        busy = bool(s["is_processing"])
        decoded = int(s.get("n_decoded", 0))
        n_predict = params.max_tokens if params is not None else -1
        mtp = s.get("mtp") or {}
        out.append({
            "id": int(s["id"]), "id_task": task, "n_ctx": n_ctx, "speculative": _speculative(core),
            "is_processing": busy,
            "params": generation_settings(params or SamplingParams(), n_predict),
            "next_token": {"has_next_token": busy, "n_remain": n_predict - decoded if busy and n_predict >= 0 else -1,
                           "n_decoded": decoded},
            # Strata's: the request's id as its client got it, its prompt and what reuse spared
            "request_id": s.get("request_id") or None,
            "n_prompt_tokens": int(s.get("n_prompt_tokens", 0)),
            "n_prompt_tokens_cached": int(s.get("n_cached_prompt_tokens", 0)),
            "mtp": {k: int(mtp.get(k, 0)) for k in ("windows", "drafted", "accepted")},
            # the engine's expert cache (shared by the slots: a window's tokens share its uploads); null without one
            "expert_cache": s.get("expert_cache"),
        })
    return out
