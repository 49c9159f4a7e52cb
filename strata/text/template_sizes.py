"""Sizes of what a chat template is about to make, from the operands, before anything is made.

Each function gives an upper bound of a value's length (characters, or items) without building
it, for the limited environment (template_limits.py) to charge to the render's Budget first:
`text_size` for any value, `OPERATOR_CHECKS` for the operators that can make a large value,
`STR_METHOD_SIZES` for string methods that can make more than they were given, `FILTER_SIZES`
for filters.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from jinja2.utils import Namespace

from strata.text.template_budget import Budget, active

_SCALAR_CHARS = 24  # a float, None, a bool; also anything else str() might print


def text_size(value: Any, limit: int | None = None) -> int:
    """About len(str(value)) (a little more for containers), counted without building it;
    stops counting once past `limit` (default: what the render may make at once, since
    anything larger is refused anyway). Iterative, so a deeply nested value cannot overflow."""
    if limit is None:
        budget = active()
        limit = 1 << 62 if budget is None else budget.max_text
    total, stack, steps = 0, [value], 0
    while stack and total <= limit:
        v = stack.pop()
        steps += 1
        if not steps & 4095 and (budget := active()) is not None:
            budget.check_time()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, bool) or v is None or isinstance(v, float):
            total += _SCALAR_CHARS
        elif isinstance(v, int):
            total += v.bit_length() * 3 // 10 + 2
        elif isinstance(v, (bytes, bytearray)):
            total += 4 * len(v) + 3
        elif isinstance(v, Mapping):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, Namespace):
            attrs = object.__getattribute__(v, "_Namespace__attrs")
            total += 16 + 4 * len(attrs)
            stack.extend(attrs.values())
        else:
            total += _SCALAR_CHARS
    return total


def _length(value: Any) -> int:
    try:
        return len(value)
    except TypeError:
        return 0


# printf-style conversions: '%-10.3f', '%*d', '%(name)s'
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _printf_size(fmt: str, args: Any) -> int:
    """Upper bound of len(fmt % args): the format, the arguments' text, and every width and
    precision it asks for (a '*' takes the largest integer argument)."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    widest = max((abs(v) for v in values if isinstance(v, int)), default=0)
    pads = 0
    for m in _PRINTF.finditer(fmt):
        for spec in m.groups():
            if spec == "*":
                pads += widest
            elif spec:
                pads += int(spec)
    return len(fmt) + text_size(values) + pads


def format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """Upper bound of len(fmt.format(*args, **kwargs)): as for printf, widths and precisions
    from each field's spec; a nested '{...}' in a spec may name the largest integer argument."""
    values = [*args, *kwargs.values()]
    widest = max((abs(v) for v in values if isinstance(v, int)), default=0)
    pads = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        fields = []  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if spec:
            pads += sum(int(n) for n in re.findall(r"\d+", spec)) + (widest if "{" in spec else 0)
    return len(fmt) + text_size(values) + pads


def _repeat_size(left: Any, right: Any) -> int | None:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
            return len(seq) * max(n, 0)
    return None


def _check_mul(budget: Budget, left: Any, right: Any) -> None:
    size = _repeat_size(left, right)
    if size is not None:
        budget.text(size)
    elif isinstance(left, int) and isinstance(right, int):
        budget.int_result(left.bit_length() + right.bit_length())


def _check_add(budget: Budget, left: Any, right: Any) -> None:
    if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
        budget.text(len(left) + len(right))


def _check_mod(budget: Budget, left: Any, right: Any) -> None:
    if isinstance(left, (str, bytes)):
        budget.text(_printf_size(left if isinstance(left, str) else left.decode("latin-1"), right))


def _check_pow(budget: Budget, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        budget.int_result(left.bit_length() * right)


# The operators that can make a large value, and how to size it first.
OPERATOR_CHECKS = {"*": _check_mul, "+": _check_add, "%": _check_mod, "**": _check_pow}


# str (and bytes) methods that can make more than they were given: (self, args, kwargs) -> size.
def _arg(args: tuple, kwargs: Mapping, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


def _chars(value: Any) -> int:
    """len(str(value)) without making it (a filter turns its input to text first)."""
    return len(value) if isinstance(value, (str, bytes)) else text_size(value)


def _width_or_len(s: str, args: tuple, kwargs: Mapping) -> int:
    return max(len(s), _int_or(_arg(args, kwargs, 0, "width", 0), 0))


def _expanded_size(s: str, args: tuple, kwargs: Mapping) -> int:
    return len(s) * max(_int_or(_arg(args, kwargs, 0, "tabsize", 8), 8), 1)


def _replaced_size(chars: int, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, (str, bytes)) or not isinstance(new, (str, bytes)):
        return chars
    hits = chars + 1 if not old else chars // len(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return chars + hits * len(new)


def _translated_size(s: str, args: tuple, kwargs: Mapping) -> int:
    table = _arg(args, kwargs, 0, "table")
    values = table.values() if isinstance(table, Mapping) else ()
    return len(s) * max([1, *(len(v) for v in values if isinstance(v, (str, bytes)))])


def _join_size(sep: Any, items: list) -> int:
    return text_size(items) + _length(sep) * max(len(items) - 1, 0)


STR_METHOD_SIZES = {
    "center": _width_or_len,
    "ljust": _width_or_len,
    "rjust": _width_or_len,
    "zfill": _width_or_len,
    "expandtabs": _expanded_size,
    "translate": _translated_size,
    "replace": lambda s, a, k: _replaced_size(len(s), _arg(a, k, 0, "old"), _arg(a, k, 1, "new"),
                                              _arg(a, k, 2, "count")),
    "join": lambda s, a, k: _join_size(s, a[0]) if a and isinstance(a[0], (list, tuple)) else 0,
}


# --- Filters: what each makes, sized before it runs -----------------------------------------

def _indent_size(s: Any, width: Any = 4, *rest: Any, **kw: Any) -> int:
    width = kw.get("width", width)
    pad = len(width) if isinstance(width, str) else max(_int_or(width, 0), 0)
    lines = s.count("\n") + 1 if isinstance(s, str) else _chars(s)
    return _chars(s) + lines * pad


def _wordwrap_size(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None, *a, **kw) -> int:
    wrap = kw.get("wrapstring", wrapstring)
    return _chars(s) + (_chars(s) + 1) * (len(wrap) if isinstance(wrap, str) else 1)


def _tojson_size(value: Any, indent: Any = None, *a: Any, **kw: Any) -> int:
    indent = kw.get("indent", indent)
    step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    chars = text_size(value)
    # every value may start a line indented by its depth; depth <= number of values <= chars
    return chars + (chars * max(step, 0) if step else 0)


def _sum_size(value: Any, attribute: Any = None, start: Any = 0, **kw: Any) -> int:
    """A sum that concatenates (a list or text start): the lengths of what it adds."""
    if not isinstance(start, (str, list, tuple)):
        return 0
    items = value if attribute is None else (_item(v, attribute) for v in value)
    return _length(start) + sum(_length(v) for v in items if isinstance(v, (str, list, tuple)))


def _item(value: Any, attribute: Any) -> Any:
    """`value.a.b` as the sum filter reads attribute 'a.b' (items first, then attributes)."""
    for part in str(attribute).split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        else:
            value = getattr(value, part, None) if not part.startswith("_") else None
    return value


def _as_format(value: Any) -> str:
    """The text the format filter formats (str(value)); made only when it is small enough
    that the render could make it anyway."""
    if isinstance(value, str):
        return value
    budget = active()
    if budget is not None:
        budget.text(text_size(value))
    return str(value)


FILTER_SIZES = {
    "center": lambda s, width=80, *a, **k: max(_chars(s), _int_or(k.get("width", width), 0)),
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "replace": lambda s, old="", new="", count=None, *a, **k: _replaced_size(_chars(s), old, new, count),
    "format": lambda s, *a, **k: _printf_size(_as_format(s), k or tuple(a)),
    "join": lambda v, d="", *a, **k: _join_size(k.get("d", d), v),
    "tojson": _tojson_size,
    "string": lambda v, *a, **k: text_size(v),
    "pprint": lambda v, *a, **k: 2 * text_size(v),
    "sum": _sum_size,
    "batch": lambda v, linecount=1, *a, **k: _length(v) + (linecount if isinstance(linecount, int) else 0),
    "slice": lambda v, slices=1, *a, **k: _length(v) + (slices if isinstance(slices, int) else 0),
}
# Filters whose first argument is consumed: an iterator is made a list first, so its size
# can be known (the filter gives the same result on the list).
MATERIALIZED = {"join", "sum", "batch", "slice"}


def made_size(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return len(value)
    return 0

