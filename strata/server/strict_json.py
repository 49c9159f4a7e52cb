"""Request bodies as strict JSON: what Python's json module accepts but JSON does not, or
what would take a handler down, is one 400 naming the place.

Python's json accepts NaN, Infinity and -Infinity (not JSON), raises RecursionError on deep
nesting and ValueError on integers of more than 4300 digits, and lets lone UTF-16
surrogates (`"\\ud800"`) through as strings that cannot be encoded again (the tokenizer and
the template then fail). Each of these is refused here, before the request models see it.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from strata.server.errors import invalid

MAX_DEPTH = 32  # nesting of arrays and objects; the deepest request field is 4 levels down

# only a \uD800-\uDFFF escape can put a surrogate in a parsed string: raw UTF-8 cannot carry one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_constant(name: str):
    raise invalid(f"the request body is not valid JSON: {name} is not a JSON number")


def _path(parts: list) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + p
    return out or "body"


def check_tree(data: Any, *, with_strings: bool) -> None:
    """Refuse nesting deeper than MAX_DEPTH and (with_strings) strings or keys holding a lone
    surrogate, naming where (`messages[0].content`). Iterative: depth cannot hurt it."""
    stack: list[tuple[Any, list, int]] = [(data, [], 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise invalid(f"{_path(path)}: nested more than {MAX_DEPTH} levels deep", param=_path(path))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if with_strings and isinstance(key, str) and _SURROGATE.search(key):
                raise invalid(f"{_path(path)}: a key holds a lone UTF-16 surrogate (not valid Unicode)",
                              param=_path(path))
            if isinstance(value, (dict, list)):
                stack.append((value, [*path, key], depth + 1))
            elif with_strings and isinstance(value, str) and _SURROGATE.search(value):
                where = _path([*path, key])
                raise invalid(f"{where}: the text holds a lone UTF-16 surrogate (not valid Unicode)", param=where)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body: 400 for bad or non-strict JSON, a non-object, deep nesting, huge
    integers or lone surrogates."""
    if not raw.strip():
        raise invalid("the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")  # bytes would let json guess UTF-16/32
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError:  # int() past sys.get_int_max_str_digits(); smaller ones meet the fields' bounds
        raise invalid(f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise invalid(f"body: nested more than {MAX_DEPTH} levels deep", param="body") from None
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, not {type(data).__name__}")
    check_tree(data, with_strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return data
