"""The one error constrained decoding raises for what a request asked for."""

from __future__ import annotations

from strata.errors import StrataError


class GrammarError(StrataError):
    """A constraint that cannot be used: an unknown kind, a schema that is not JSON or names a
    feature the grammar library lacks, a Lark grammar that does not parse, or one that accepts
    no output at all. One line naming the kind and what is wrong (the server answers 400)."""


def one_line(message: str, limit: int = 300) -> str:
    """The library's message as one line: its first non-blank line (Lark errors go on with a
    source excerpt and a caret, which say nothing once flattened), cut at `limit`."""
    first = next((line.strip() for line in str(message).splitlines() if line.strip()), "")
    first = first or "rejected by the grammar library"
    return first if len(first) <= limit else first[: limit - 3] + "..."
