"""The range of every sampling parameter, in one table: the HTTP request schema
(strata/server/schemas.py) and `strata generate`'s flags both read it, so a value one of them
refuses the other refuses too, with the same bounds in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 1 << 30  # engine contexts are capped at 2**30 tokens
MAX_TOP_K = 1 << 31


@dataclass(frozen=True)
class Bound:
    low: float
    high: float
    low_open: bool = False  # the low end itself is outside (top_p > 0)
    whole: bool = False  # a whole number (top_k, max_tokens)

    def holds(self, v: float) -> bool:
        # (written so NaN, which compares false with everything, is outside)
        above = v > self.low if self.low_open else v >= self.low
        return bool(above and v <= self.high)

    def field(self) -> dict[str, Any]:
        """pydantic Field constraints for this range."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}

    def describe(self) -> str:
        """'[0, 2]', '(0, 1]', 'a whole number in [1, 2**30]'."""
        show = {MAX_TOKENS: "2**30", MAX_TOP_K: "2**31"}
        lo, hi = (show.get(x, f"{x:g}") for x in (self.low, self.high))
        span = f"{'(' if self.low_open else '['}{lo}, {hi}]"
        return f"a whole number in {span}" if self.whole else f"a number in {span}"


# request field / flag -> its range (docs/SERVER.md, "Validation and limits")
SAMPLING_BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, 2.0),
    "top_p": Bound(0.0, 1.0, low_open=True),
    "min_p": Bound(0.0, 1.0),
    "top_k": Bound(0, MAX_TOP_K, whole=True),
    "max_tokens": Bound(1, MAX_TOKENS, whole=True),
}
