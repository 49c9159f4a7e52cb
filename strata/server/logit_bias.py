"""A request's `logit_bias` in either of its two spellings, as one {token id: bias} table.

OpenAI's: an object {"<token id>": bias}, bias in [-100, 100]. llama-server's: a list of
[token id, bias] pairs, where `false` for the bias means "never this token" (-inf). Both
spellings are taken on both routes. Token texts as keys (llama-server takes them too) are
refused: say ids (`POST /tokenize` gives them). Ids are checked against the vocabulary by the
engine's API, which knows it.
"""

from __future__ import annotations

import math
from typing import Any

LIMIT = 100.0  # OpenAI's bound on a bias; -inf is spelled `false`
MAX_ENTRIES = 1 << 18  # more than any vocabulary's tokens
BANNED = -math.inf


def _token_id(key: Any) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
        return int(key)
    raise ValueError(f"key {key!r} is not a token id (a whole number >= 0; POST /tokenize gives a text's ids)")


def _bias(token: int, value: Any) -> float:
    if value is False:
        return BANNED
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -LIMIT <= value <= LIMIT:
        raise ValueError(f"the bias of token {token} must be a number in [-100, 100] or false (banned), "
                         f"not {value!r}")
    return float(value)


def parse(value: Any) -> dict[int, float]:
    """{token id: bias}; ValueError naming the entry that is wrong."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = []
        for i, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"entry {i} must be a pair [token id, bias]")
            pairs.append((pair[0], pair[1]))
    else:
        raise ValueError("must be an object {\"<token id>\": bias} or a list of [token id, bias] pairs")
    if len(pairs) > MAX_ENTRIES:
        raise ValueError(f"at most {MAX_ENTRIES} entries")
    out: dict[int, float] = {}
    for key, bias in pairs:
        token = _token_id(key)
        out[token] = _bias(token, bias)
    return out
