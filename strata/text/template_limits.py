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

Three files: the budget and its errors (template_budget.py), the sizes of what a template is
about to make (template_sizes.py), and here the environment that charges them to the budget.

(A trace function, sys.settrace, would also catch the deadline, but made renders 5-9x slower
than plain jinja; these checks cost ~1.5-2x.)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum, pass_context, pass_environment, pass_eval_context

from strata.text.template_budget import Budget, active, current
from strata.text.template_sizes import (
    FILTER_SIZES,
    MATERIALIZED,
    OPERATOR_CHECKS,
    STR_METHOD_SIZES,
    format_size,
    made_size,
    text_size,
)

# What a filter marked pass_context / pass_eval_context / pass_environment takes first.
_LEAD_ARGS = {
    pass_context(lambda: None).jinja_pass_arg: lambda context: (context,),
    pass_eval_context(lambda: None).jinja_pass_arg: lambda context: (context.eval_ctx,),
    pass_environment(lambda: None).jinja_pass_arg: lambda context: (context.environment,),
}


def _limited_filter(name: str, func):
    lead_args = _LEAD_ARGS.get(getattr(func, "jinja_pass_arg", None), lambda context: ())
    size = FILTER_SIZES.get(name)

    @pass_context  # (also keeps jinja from folding it at compile time, outside any budget)
    @functools.wraps(func)
    def limited(context, value, *args, **kwargs):
        budget = active()
        if budget is not None:
            budget.check_time()
            if name in MATERIALIZED and isinstance(value, Iterable) and not isinstance(
                    value, (str, list, tuple, Mapping)):
                value = list(value)
            if size is not None:
                budget.text(size(value, *args, **kwargs))
        result = func(*lead_args(context), value, *args, **kwargs)
        if budget is not None:
            budget.text(made_size(result))
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
    budget = current.budget
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
    intercepted_binops = frozenset(OPERATOR_CHECKS)

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _LoopStepsExtension],
                         finalize=self._sized_output)
        self.globals["range"] = _limited_range
        self.globals["lipsum"] = _limited_lipsum

    def limit_filters(self) -> None:
        """Wrap every filter (after the caller has added its own)."""
        self.filters = {name: _limited_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = current.budget
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
                OPERATOR_CHECKS[operator](budget, left, right)
        return self.binop_table[operator](left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        budget = active()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.check_time()
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive for
            args = (_Steps(args[0], budget), *args[1:])
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)) and (size := STR_METHOD_SIZES.get(getattr(__obj, "__name__", ""))):
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
        budget.text(made_size(result))
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
                budget.text(format_size(fmt, () if is_map else args, mapping))
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
        budget = current.budget
        if budget is not None:
            budget.text(text_size(value))
        return value
