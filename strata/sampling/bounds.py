"""The range of every sampling parameter: the knobs' own (strata/protocol.py, KNOBS) and
max_tokens'. The HTTP request schema (strata/server/schemas.py) reads REQUEST_BOUNDS and
`strata generate`'s flags SAMPLING_BOUNDS, so a value one of them refuses the other refuses
too, with the same bounds in the message.
"""

from __future__ import annotations

from strata.protocol import KNOBS, MAX_TOKENS, MAX_TOP_K, Bound

__all__ = ["Bound", "MAX_TOKENS", "MAX_TOP_K", "MAX_TOKENS_BOUND", "REQUEST_BOUNDS", "SAMPLING_BOUNDS"]

MAX_TOKENS_BOUND = Bound(1, MAX_TOKENS, whole=True)

# request field -> its range (docs/SERVER.md, "Validation and limits")
REQUEST_BOUNDS: dict[str, Bound] = {**{name: k.bound for name, k in KNOBS.items()}, "max_tokens": MAX_TOKENS_BOUND}
# the fields `strata generate` has flags for -> their range
SAMPLING_BOUNDS: dict[str, Bound] = {
    **{name: k.bound for name, k in KNOBS.items() if k.flag_help is not None}, "max_tokens": MAX_TOKENS_BOUND}
