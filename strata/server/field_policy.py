"""What the generation routes do with each request field they do not act on: none is ignored.

OpenAI's and llama-server's requests carry many fields beyond the ones Strata samples with. Each
such field is in one of these tables, and is either

- accepted because it never changes the tokens (`user`, `metadata`, `store`, prompt caching
  hints: reuse of a prompt's KV never changes what is generated), or
- accepted only at the values that leave the result as it is (`n: 1`, `typical_p: 1`,
  `mirostat: 0` ...: what clients send when they mean "off"), and refused with a 400 naming it
  at any other value, since Strata does not have that sampler.

A field in no table and not in the request model is refused too ("unknown field"). The fields
Strata acts on are the request models' own (strata/server/schemas.py); docs/SERVER.md lists both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from strata.server.errors import invalid

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_NOTE_CHARS = 256  # a string field that changes nothing (safety_identifier, prompt_cache_key ...)


@dataclass(frozen=True)
class Rule:
    accepts: Callable[[Any], bool]
    takes: str  # the values accepted, as the refusal says them ("1 (off)", "true or false")
    changes_nothing: bool = False  # True: any value of that shape is accepted, it never changes the result

    def refusal(self, name: str, value: Any) -> str:
        if self.changes_nothing:
            return f"{name}: must be {self.takes}"
        return f"{name}: only {self.takes} is supported, not {_shown(value)}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---- predicates (None: the field left at its default, which every rule accepts)

def equal(x: float) -> Callable[[Any], bool]:
    return lambda v: v is None or (_number(v) and v == x)


def at_most(x: float) -> Callable[[Any], bool]:
    return lambda v: v is None or (_number(v) and v <= x)


def a_number(v: Any) -> bool:
    return v is None or _number(v)


def false(v: Any) -> bool:
    return v is None or v is False


def a_bool(v: Any) -> bool:
    return v is None or isinstance(v, bool)


def empty(v: Any) -> bool:
    return v is None or (type(v) in (str, list, dict) and len(v) == 0)


def null(v: Any) -> bool:
    return v is None  # ({} is not "off": an empty web_search_options turns search on with defaults)


def one_of(*values: str) -> Callable[[Any], bool]:
    return lambda v: v is None or (isinstance(v, str) and v in values)


def short_string(v: Any) -> bool:
    return v is None or (isinstance(v, str) and len(v) <= MAX_NOTE_CHARS)


def an_object(v: Any) -> bool:
    return v is None or isinstance(v, dict)


def strings(v: Any) -> bool:
    return v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def metadata(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and len(v) <= MAX_METADATA_PAIRS and all(
        isinstance(k, str) and len(k) <= MAX_METADATA_KEY and isinstance(x, str) and len(x) <= MAX_METADATA_VALUE
        for k, x in v.items()))


def whole_from(low: int) -> Callable[[Any], bool]:
    return lambda v: v is None or (_whole(v) and v >= low)


def text_only(v: Any) -> bool:
    return v is None or v == ["text"]


def off(takes: str, accepts: Callable[[Any], bool]) -> Rule:
    return Rule(accepts, takes)


def inert(takes: str, accepts: Callable[[Any], bool]) -> Rule:
    return Rule(accepts, takes, changes_nothing=True)


# ---- the tables: field -> rule

SHARED: dict[str, Rule] = {
    # OpenAI's, changing nothing here
    "user": inert("a string of at most 256 characters", short_string),
    "metadata": inert(f"an object of at most {MAX_METADATA_PAIRS} string pairs", metadata),
    "store": inert("true or false (nothing is stored)", a_bool),
    "service_tier": inert("a string", short_string),
    "safety_identifier": inert("a string of at most 256 characters", short_string),
    "prompt_cache_key": inert("a string of at most 256 characters", short_string),
    "prompt_cache_retention": inert("a string", short_string),
    "prompt_cache_options": inert("an object", an_object),
    # llama-server's, changing nothing here: Strata reuses cached prompt KV whenever it can, and
    # never shifts the context (a prompt that does not fit is refused), so nothing is discarded
    "cache_prompt": inert("true or false", a_bool),
    "n_cache_reuse": inert("a whole number >= 0", whole_from(0)),
    "n_keep": inert("a whole number >= -1", whole_from(-1)),
    "sse_ping_interval": inert("a number (no pings are sent)", a_number),
    # samplers Strata does not have, taken at their off values
    "n": off("1", equal(1)),
    "typical_p": off("1 (off)", equal(1)),
    "mirostat": off("0 (off)", equal(0)),
    "mirostat_tau": inert("a number (read only with mirostat)", a_number),
    "mirostat_eta": inert("a number (read only with mirostat)", a_number),
    "dynatemp_range": off("0 (off)", equal(0)),
    "dynatemp_exponent": inert("a number (read only with dynatemp_range)", a_number),
    "xtc_probability": off("0 (off)", equal(0)),
    "xtc_threshold": inert("a number (read only with xtc_probability)", a_number),
    "dry_multiplier": off("0 (off)", equal(0)),
    "dry_base": inert("a number (read only with dry_multiplier)", a_number),
    "dry_allowed_length": inert("a number (read only with dry_multiplier)", a_number),
    "dry_penalty_last_n": inert("a number (read only with dry_multiplier)", a_number),
    "dry_sequence_breakers": inert("a list of strings (read only with dry_multiplier)", strings),
    "top_n_sigma": off("a value <= 0 (off)", at_most(0)),
    "min_keep": off("0", equal(0)),
    "n_probs": off("0 (use logprobs)", equal(0)),
    "n_cmpl": off("1", equal(1)),
    "id_slot": off("-1 (any slot)", equal(-1)),
    "t_max_predict_ms": off("0 (off)", equal(0)),
    "n_indent": off("0 (off)", equal(0)),
    "samplers": off("null (Strata's order is fixed: GET /props)", empty),
    "grammar": off("an empty grammar (use response_format)", empty),
    "lora": off("no adapters", empty),
    "timings_per_token": off("false", false),
    "return_tokens": off("false", false),
    "return_progress": off("false", false),
    "post_sampling_probs": off("false", false),
    "response_fields": off("null", empty),
}

CHAT: dict[str, Rule] = {
    **SHARED,
    "prediction": inert("an object (a latency hint: the tokens are the same)", an_object),
    "audio": off("null (text only)", null),
    "modalities": off('["text"]', text_only),
    "moderation": off("null", null),
    "web_search_options": off("null", null),
    "verbosity": off("null", null),
    "reasoning_effort": off("null", null),
    "reasoning_format": off("null or 'none' (the text as generated)", one_of("none")),
    "functions": off("null (use tools)", empty),
    "function_call": off("null (use tool_choice)", null),
}

COMPLETIONS: dict[str, Rule] = {
    **SHARED,
    "best_of": off("1", equal(1)),
    "suffix": off("an empty suffix", empty),
}


def apply(data: dict[str, Any], rules: dict[str, Rule]) -> dict[str, Any]:
    """`data` without the table's fields, once each is checked: a 400 naming the first refused."""
    rest = {}
    for name, value in data.items():
        rule = rules.get(name)
        if rule is None:
            rest[name] = value
        elif not rule.accepts(value):
            raise invalid(rule.refusal(name, value), param=name)
    return rest
