"""Limits a chat template renders under, so that a model file's template cannot hang the
engine or grow its memory without bound.

A template is a program that came with the model file. Jinja's sandbox keeps it away from
Python's internals but not from our time and memory: `{{ 'a' * 10**9 }}` makes 1 GB in one
C call, nested loops spin for hours. Each render therefore gets a `Budget`:

- loops: every `{% for %}` iterates through a counter (the compiled code is changed to do
  so), at most `loop_items` steps per render; `range()` is at most `range_items` long
  (jinja's own sandbox limit);
- wall time: checked at every loop step, template call, operator and filter. Jinja has no
  other way to repeat work (no while, no comprehensions), so a template cannot run long
  between two checks except inside one bounded operation;
- text: every value an operator (`*`, `+`, `%`, `~`, `**`), a string method, a filter or an
  output makes is sized *before* it is made, from its operands (a size, never an allocation),
  and refused when it would pass the output limit (a few times the input's text plus an
  allowance, with an absolute cap); all text made in one render, kept or not, has a larger
  budget, which also bounds what lists of fresh strings can hold;
- nesting: template calls (macros, `loop(...)`, `caller()`) nest at most `call_depth` deep.

A breach is one `TemplateLimitError` naming the limit. The budget lives in a thread-local,
so one environment serves renders on several threads at once.

(A trace function, sys.settrace, would also catch the deadline, but made renders 5-9x slower
than plain jinja; these checks cost ~1.5-2x.)
"""

from __future__ import annotations

import functools
import re
import string
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum, pass_context, pass_environment, pass_eval_context

from strata.errors import StrataError


class ChatTemplateError(StrataError):
    """A chat template failed on a render: its own raise_exception(), a name it lacks, a
    type error in its code, or a limit (TemplateLimitError)."""


class TemplateLimitError(ChatTemplateError):
    """A chat template broke one of its limits (time, text, loops, nesting); `reason` is the
    breach alone ("ran past its 2 s limit"), for callers that say where it happened."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = 2.0
    # The output may be output_factor times the input's text plus output_allowance (markup
    # around each message, a system prompt, tool schemas), and never more than output_cap.
    output_factor: int = 8
    output_allowance: int = 1 << 20
    output_cap: int = 16 << 20
    # All the text one render makes, kept or not, may be made_factor outputs' worth: room for
    # templates that rebuild a string a message at a time, not for a million fresh copies.
    made_factor: int = 16
    range_items: int = 100_000  # what jinja's own sandbox allows one range()
    loop_items: int = 4_000_000  # {% for %} steps of one render, all loops together
    call_depth: int = 64  # each level is ~6 Python frames; Python stops near 1000
    int_bits: int = 8192  # ~2,500 digits (Python prints at most 4,300); no template needs more
    source_chars: int = 1 << 20  # the largest templates shipped are ~30 KB

    def output_limit(self, input_chars: int) -> int:
        return min(self.output_cap, self.output_factor * input_chars + self.output_allowance)


def _seconds(s: float) -> str:
    return f"{s:g} s"


class Budget:
    """One render's allowance of time, text, loop steps and nesting."""

    def __init__(self, limits: TemplateLimits, origin: str, input_chars: int):
        self.limits = limits
        self.origin = origin
        self.deadline = time.monotonic() + limits.seconds
        self.max_text = limits.output_limit(input_chars)
        self.made_left = limits.made_factor * self.max_text
        self.loop_left = limits.loop_items
        self.depth = 0

    def error(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(f"the chat template ({self.origin}) {what}", what)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.error(f"ran past its {_seconds(self.limits.seconds)} limit")

    def text(self, chars: int) -> None:
        """Called before a value of about `chars` characters (or items) is made."""
        if chars > self.max_text:
            raise self.error(f"would make text of {chars} characters, past its limit of {self.max_text} "
                             f"for this conversation")
        self.made_left -= chars
        if self.made_left < 0:
            raise self.error(f"made more than its limit of {self.limits.made_factor * self.max_text} "
                             f"characters of text in all")

    def int_result(self, bits: int) -> None:
        if bits > self.limits.int_bits:
            raise self.error(f"would make a number of {bits} bits, past its limit of {self.limits.int_bits}")

    def range_size(self, n: int) -> None:
        if n > self.limits.range_items:
            raise self.error(f"asked for range() of {n} items, past its limit of {self.limits.range_items}")

    def loop_step(self) -> None:
        self.loop_left -= 1
        if self.loop_left < 0:
            raise self.error(f"ran past its limit of {self.limits.loop_items} loop steps")
        if not self.loop_left & 255:
            self.check_time()


_local = threading.local()


def active() -> Budget | None:
    """The budget of the render running on this thread (None outside a render, e.g. while
    jinja folds constants at compile time)."""
    return getattr(_local, "budget", None)


class applied:
    """`with applied(budget):` the render on this thread runs under `budget`."""

    def __init__(self, budget: Budget):
        self.budget = budget

    def __enter__(self) -> Budget:
        self._outer = active()
        _local.budget = self.budget
        return self.budget

    def __exit__(self, *exc) -> None:
        _local.budget = self._outer


# --- Sizes, from the operands, before anything is made ---------------------------------------

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


def _format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
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
_OPERATOR_CHECKS = {"*": _check_mul, "+": _check_add, "%": _check_mod, "**": _check_pow}


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


_STR_METHOD_SIZES = {
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


# --- Filters: each wrapped so that what it makes is sized first and counted after ------------

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


_FILTER_SIZES = {
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
_MATERIALIZED = {"join", "sum", "batch", "slice"}


def _made_size(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return len(value)
    return 0


# What a filter marked pass_context / pass_eval_context / pass_environment takes first.
_LEAD_ARGS = {
    pass_context(lambda: None).jinja_pass_arg: lambda context: (context,),
    pass_eval_context(lambda: None).jinja_pass_arg: lambda context: (context.eval_ctx,),
    pass_environment(lambda: None).jinja_pass_arg: lambda context: (context.environment,),
}


def _limited_filter(name: str, func):
    lead_args = _LEAD_ARGS.get(getattr(func, "jinja_pass_arg", None), lambda context: ())
    size = _FILTER_SIZES.get(name)

    @pass_context  # (also keeps jinja from folding it at compile time, outside any budget)
    @functools.wraps(func)
    def limited(context, value, *args, **kwargs):
        budget = active()
        if budget is not None:
            budget.check_time()
            if name in _MATERIALIZED and isinstance(value, Iterable) and not isinstance(
                    value, (str, list, tuple, Mapping)):
                value = list(value)
            if size is not None:
                budget.text(size(value, *args, **kwargs))
        result = func(*lead_args(context), value, *args, **kwargs)
        if budget is not None:
            budget.text(_made_size(result))
        return result

    return limited


# --- Globals ---------------------------------------------------------------------------------

def _limited_range(*args: int) -> range:
    r = range(*args)
    budget = active()
    if budget is not None:
        # len() itself fails past 2**63 items; the arithmetic does not
        budget.range_size(max(0, (r.stop - r.start + r.step - (1 if r.step > 0 else -1)) // r.step))
    return r  # a plain range, so templates print and test it as before; loops count its steps


def _counted(items: Any) -> Any:
    """What a {% for %} iterates: `items`, one loop step at a time."""
    budget = getattr(_local, "budget", None)
    return items if budget is None else _Steps(items, budget)


class _Steps:
    __slots__ = ("_items", "_budget")

    def __init__(self, items: Any, budget: Budget):
        self._items, self._budget = items, budget

    def __len__(self) -> int:  # loop.length and loop.last without reading ahead, when it has one
        return len(self._items)

    def __iter__(self):
        step = self._budget.loop_step
        for item in self._items:
            step()
            yield item


def _limited_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    budget = active()
    if budget is not None and isinstance(n, int) and isinstance(max, int):
        budget.text(n * max * 16)  # words are at most ~12 letters, plus markup
    return generate_lorem_ipsum(n, html, min, max)


# --- The environment ---------------------------------------------------------------------------

class _LoopStepsExtension(Extension):
    """Gives compiled code `environment.extensions[...].loop_steps`, the name a for loop's
    iterable is wrapped in (jinja allows no new node types, but extension attributes)."""

    loop_steps = staticmethod(_counted)


class _LimitedCode(CodeGenerator):
    """Two changes to the compiled code, each the same result through a hook:
    a for loop iterates through loop_steps (jinja has no hook on iteration), and `a ~ b`,
    compiled to a plain join no sandbox hook sees, goes through environment.join_text."""

    def visit_For(self, node, frame) -> None:
        if not _is_counted(node.iter):
            node.iter = nodes.Call(nodes.ExtensionAttribute(_LoopStepsExtension.identifier, "loop_steps"),
                                   [node.iter], [], None, None, lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            return super().visit_Concat(node, frame)
        self.write("environment.join_text((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _is_counted(node) -> bool:
    return (isinstance(node, nodes.Call) and isinstance(node.node, nodes.ExtensionAttribute)
            and node.node.identifier == _LoopStepsExtension.identifier)


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (an immutable sandbox, trim_blocks,
    lstrip_blocks, loop controls) whose operators, calls, filters, outputs and joins check
    the render's Budget. Outside a render (compile time) the checks are off."""

    code_generator_class = _LimitedCode
    intercepted_binops = frozenset(_OPERATOR_CHECKS)

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _LoopStepsExtension],
                         finalize=self._sized_output)
        self.globals["range"] = _limited_range
        self.globals["lipsum"] = _limited_lipsum

    def limit_filters(self) -> None:
        """Wrap every filter (after the caller has added its own)."""
        self.filters = {name: _limited_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = getattr(_local, "budget", None)
        if budget is not None:
            if time.monotonic() > budget.deadline:
                budget.check_time()
            if type(left) is str and type(right) is str and operator == "+":
                # the operator every template uses several times per message: sized inline
                size = len(left) + len(right)
                budget.made_left -= size
                if size > budget.max_text or budget.made_left < 0:
                    budget.text(size)
            else:
                _OPERATOR_CHECKS[operator](budget, left, right)
        return self.binop_table[operator](left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        budget = active()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.check_time()
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive for
            args = (_Steps(args[0], budget), *args[1:])
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)) and (size := _STR_METHOD_SIZES.get(getattr(__obj, "__name__", ""))):
            if args and __obj.__name__ == "join" and not isinstance(args[0], (list, tuple)):
                args = (list(args[0]), *args[1:])  # sized as a list: str.join makes one anyway
            budget.text(size(owner, args, kwargs))
        budget.depth += 1
        try:
            if budget.depth > budget.limits.call_depth:
                raise budget.error(f"nested calls past its limit of {budget.limits.call_depth} levels")
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        budget.text(_made_size(result))
        return result

    def wrap_str_format(self, value: Any):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def sized_format(*args: Any, **kwargs: Any) -> str:
            budget = active()
            if budget is not None:
                mapping = args[0] if is_map and args and isinstance(args[0], Mapping) else kwargs
                budget.text(_format_size(fmt, () if is_map else args, mapping))
            return wrapper(*args, **kwargs)

        return sized_format

    def join_text(self, parts: tuple) -> str:
        budget = active()
        if budget is not None:
            budget.text(text_size(parts))
        return str_join(parts)

    def concat(self, pieces: Iterable[str]) -> str:  # the output, and every {% set %}/macro capture
        budget = active()
        if budget is None:
            return "".join(pieces)
        kept, total = [], 0
        for n, piece in enumerate(pieces):
            total += len(piece)
            if not n & 1023:
                budget.check_time()
            if total > budget.max_text:
                raise budget.error(f"made output past its limit of {budget.max_text} characters "
                                   f"for this conversation")
            kept.append(piece)
        return "".join(kept)

    @staticmethod
    def _sized_output(value: Any) -> Any:
        if type(value) is str:  # already made, and counted by whatever made it
            return value
        budget = getattr(_local, "budget", None)
        if budget is not None:
            budget.text(text_size(value))
        return value
