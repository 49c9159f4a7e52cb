"""Byte counts in the words the start-up lines and refusals use."""

from __future__ import annotations


def size_text(n: int | float, gib_digits: int = 1) -> str:
    """1.5 GiB, 439.7 KiB, 12 B: the largest binary unit the count reaches (GiB with gib_digits)."""
    for unit, scale, digits in (("GiB", 1 << 30, gib_digits), ("MiB", 1 << 20, 1), ("KiB", 1 << 10, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{int(n)} B"
