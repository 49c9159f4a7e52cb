"""Download progress: one updating line on a terminal; elsewhere (a log, a pipe) one line per
event: the start, every 25 %, the end."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

MiB = 2**20


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


class Progress:
    """Reports one download. `write_line` (a logger) forces the line-per-event form; else the
    form follows `stream.isatty()` (stream: standard error unless given)."""

    def __init__(self, stream: TextIO | None = None, write_line: Callable[[str], None] | None = None,
                 label: str = "strata pull", clock: Callable[[], float] = time.monotonic,
                 interval_s: float = 0.1):
        self.stream = stream
        self.write_line = write_line
        self.label = label
        self.clock = clock
        self.interval_s = interval_s
        self.total: int | None = None
        self.name = ""
        self._t0 = 0.0
        self._first = 0  # bytes already there when this transfer began (a resumed download)
        self._quarter = 0
        self._shown_at = float("-inf")
        self._width = 0  # of the terminal line last drawn

    @property
    def tty(self) -> bool:
        if self.write_line is not None:
            return False
        isatty = getattr(self._out(), "isatty", None)
        return bool(isatty and isatty())

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def line(self, text: str) -> None:
        """A line of its own (an event), after the terminal line if one is drawn."""
        if self.write_line is not None:
            self.write_line(f"{self.label}: {text}")
            return
        out = self._out()
        if self._width:
            out.write("\n")
            self._width = 0
        out.write(f"{self.label}: {text}\n")
        out.flush()

    def start(self, name: str, total: int | None, have: int = 0, source: str = "") -> None:
        self.name, self.total, self._first = name, total, have
        self._t0 = self.clock()
        self._quarter = self._quarters(have)
        size = f" ({_mib(total)})" if total else ""
        resumed = f", resuming at {_mib(have)}" if have else ""
        self.line(f"downloading {name}{size}{' from ' + source if source else ''}{resumed}")

    def _quarters(self, done: int) -> int:
        return 4 * done // self.total if self.total else 0

    def _rate(self, done: int) -> float:
        elapsed = self.clock() - self._t0
        return (done - self._first) / elapsed if elapsed > 0 else 0.0

    def update(self, done: int) -> None:
        if self.tty:
            now = self.clock()
            if now - self._shown_at >= self.interval_s or (self.total and done >= self.total):
                self._shown_at = now
                self._draw(done)
            return
        quarter = self._quarters(done)
        if quarter > self._quarter:
            self._quarter = quarter
            if quarter < 4:  # 100 % is the end's line
                self.line(f"{25 * quarter}% of {_mib(self.total or 0)} ({_mib(done)}, {_mib(self._rate(done))}/s)")

    def _draw(self, done: int) -> None:
        pct = f"{100 * done // self.total:3d}%  " if self.total else ""
        amount = f"{done / MiB:.1f}/{_mib(self.total)}" if self.total else _mib(done)
        text = f"\r{self.label}: {self.name}  {pct}{amount}  {_mib(self._rate(done))}/s"
        width = len(text) - 1
        out = self._out()
        out.write(text + " " * max(0, self._width - width))
        out.flush()
        self._width = width

    def done(self, done: int) -> None:
        if self.tty:
            self._draw(done)
        elapsed = self.clock() - self._t0
        self.line(f"downloaded {_mib(done - self._first)} in {elapsed:.1f} s ({_mib(self._rate(done))}/s)")
