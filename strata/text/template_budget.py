"""A chat template render's budget (time, text, loop steps, nesting) and the errors a template raises.

`Budget` is one render's allowance; `applied(budget)` makes it the budget of the render on this
thread (`current.budget`), which the limited environment (template_limits.py) and the sizes
(template_sizes.py) read. Outside a render `current.budget` is None and nothing is checked.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

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


class _Current(threading.local):
    """The budget of the render running on this thread (None outside a render, e.g. while
    jinja folds constants at compile time)."""

    budget: Budget | None = None


current = _Current()


def active() -> Budget | None:
    """The budget of the render running on this thread (current.budget)."""
    return current.budget


class applied:
    """`with applied(budget):` the render on this thread runs under `budget`."""

    def __init__(self, budget: Budget):
        self.budget = budget

    def __enter__(self) -> Budget:
        self._outer = current.budget
        current.budget = self.budget
        return self.budget

    def __exit__(self, *exc) -> None:
        current.budget = self._outer
