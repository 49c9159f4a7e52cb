"""JSON schemas as constrained decoding reads them: strict objects and bounded whitespace.

Two changes are made to a schema before the grammar library sees it, both pure functions
over plain dicts:

- **Strict objects.** JSON Schema lets an object carry any property it does not list unless it
  says `"additionalProperties": false`; a model held to such a schema may invent fields, and
  OpenAI's structured outputs do not. `strict_schema` closes every object that lists
  `properties` and says nothing about other keys (`additionalProperties`, `patternProperties`,
  `unevaluatedProperties`). An object that lists no properties (`{"type": "object"}`) stays
  open: it is a free-form object, not an empty one. Objects joined by `allOf` are left open,
  since closing each branch would refuse the properties its siblings add.
- **Bounded whitespace.** Any amount of whitespace is valid JSON, and a small model can loop on
  newlines inside an object until max_tokens. Each run of whitespace between tokens is
  allowed up to WHITESPACE_RUN characters (a newline and indentation seven levels deep at four
  spaces), which pretty-printed output never needs more than. A schema's own top-level
  `x-guidance` options (llguidance's dialect) still win.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from strata.grammar.errors import GrammarError

WHITESPACE_RUN = 32
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,%d}" % WHITESPACE_RUN}
MAX_DEPTH = 128  # nesting of subschemas; deeper is refused in one line, not a RecursionError

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("prefixItems", "anyOf", "oneOf", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def parse_schema(source: Any, where: str) -> dict:
    """The schema object from JSON text (or an already parsed dict); GrammarError otherwise."""
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, str):
        raise GrammarError(f"{where}: the schema must be JSON text, not {type(source).__name__}")
    try:
        value = json.loads(source)
    except (ValueError, RecursionError) as e:
        raise GrammarError(f"{where}: the schema is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise GrammarError(f"{where}: the schema must be a JSON object, not {type(value).__name__}")
    return value


def strict_schema(schema: Mapping, where: str = "json_schema") -> dict:
    """A copy of `schema` whose objects that list properties refuse unlisted ones (see above)."""
    return _strict(schema, where, depth=0, joined=False)


def _strict(node: Any, where: str, depth: int, joined: bool) -> Any:
    if depth > MAX_DEPTH:
        raise GrammarError(f"{where}: the schema nests deeper than {MAX_DEPTH} levels")
    if not isinstance(node, Mapping):
        return node  # true / false schemas, and values of non-schema keywords
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), Mapping):
            out[key] = _strict(out[key], where, depth + 1, False)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s, where, depth + 1, False) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _strict(s, where, depth + 1, False) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_strict(s, where, depth + 1, True) for s in out["allOf"]]
    closes = (isinstance(out.get("properties"), Mapping) and not joined and "allOf" not in out
              and not any(k in out for k in _OPEN_KEYS))
    if closes:
        out["additionalProperties"] = False
    return out


def lark_json_rule(schema: Mapping, where: str = "json_schema", lenient: bool = False) -> str:
    """`%json {...}`: the schema inlined in a Lark grammar, strict and with bounded whitespace
    (inside Lark, a %json block reads its own top-level x-guidance). `lenient`: keywords and
    formats the library does not implement are ignored instead of refused."""
    strict = strict_schema(schema, where)
    own = strict.get("x-guidance")
    options = {**JSON_OPTIONS, **({"lenient": True} if lenient else {})}
    strict["x-guidance"] = {**options, **(own if isinstance(own, Mapping) else {})}
    return "%json " + json.dumps(strict, ensure_ascii=False)
