"""The CUDA backend's state of one window, and the window table its kernels read.

`CudaBackend.begin_window` makes a `WindowState` for each window (main model or draft step): its
rows, its table on the device, its attention splits and which rows belong to long prompts. What
the window's ops hand each other (the Q8_1 blocks a fused kernel made along with its output, the
experts' plans that gate, up and down share, the attention table of the rows before the prompts)
is kept there too, keyed by the arrays it belongs to, so it never outlives its window and a later
op reads only what an earlier op of the same window made.

The window table (fused.cu): positions (n), each token's span (n), then per span (start, end,
address of its cache's table: KVCache.device_table). A graph runner fills its own buffer with the
tables of the windows it captures (`TableFeed`); begin_window then takes the next one from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from strata.backend.base import window_positions

MAX_SPLITS = 64  # attention key splits per (head, token)


@dataclass
class TableFeed:
    """Set by the graph runner: the buffer a graph reads, [(offset, length, splits)] of each
    window the captured function begins, in order, and how many have begun."""

    buffer: Any
    parts: list[tuple[int, int, int]]
    next: int = 0

    def take(self) -> tuple[Any, int]:
        """The next window's table (a view of the buffer) and its attention splits."""
        if self.next >= len(self.parts):
            raise RuntimeError(f"a graphed function began more than the {len(self.parts)} window(s) it declared")
        off, length, splits = self.parts[self.next]
        self.next += 1
        return self.buffer[off : off + length], splits


@dataclass
class Capture:
    """What the graph runner tells the backend while it warms up and captures a window, and what
    the backend tells it back: `blockers` names what made the window uncapturable (cuBLAS, a host
    upload, a plan by CuPy's sort); the runner then keeps that shape eager."""

    active: bool = False
    blockers: set[str] = field(default_factory=set)
    feed: TableFeed | None = None

    def block(self, why: str) -> None:
        if self.active:
            self.blockers.add(why)


@dataclass
class WindowState:
    """One window's rows and what its ops share. The window outside any begin_window (tests,
    single ops) is an empty one: no table, no prompt rows."""

    n: int = 0  # the window's rows
    table: Any = None  # the window table on the device (fused path), None: generic attention
    splits: int = 1  # attention key splits
    prompt_spans: list[tuple[int, int, Any, int]] = field(default_factory=list)  # (first row, end row, span, index)
    blocks_done: bool = False  # end_blocks was called: linears now take chosen rows (the head)
    head_attention: tuple[Any, int] | None = None  # (table, splits) of the rows before the prompts
    _q8: tuple[Any, Any] | None = None  # (activations, their Q8Buffer)
    _plans: tuple[Any, dict] | None = None  # (expert ids, {key: (plan, {per_pair: (q8, rows)})})

    @property
    def prompt_rows(self) -> list[tuple[int, int]]:
        """(first row, end row) of the long prompts' spans while the blocks run; [] for the head
        (a selection of the window's rows: never the prompt path, even when as many are chosen)."""
        return [] if self.blocks_done else [(a, b) for a, b, _, _ in self.prompt_spans]

    def takes_rows(self, x: Any) -> bool:
        """Whether x (rows first) is the window's rows one to one."""
        return int(x.shape[0]) == self.n

    def q8_of(self, x: Any) -> Any:
        """The Q8_1 blocks a kernel made along with x (norm, swiglu, attention), if x is that array."""
        return self._q8[1] if self._q8 is not None and self._q8[0] is x else None

    def keep_q8(self, x: Any, q8: Any) -> None:
        """x's Q8_1 blocks, for the linear that reads x next (None: forget)."""
        self._q8 = (x, q8) if q8 is not None else None

    def plans(self, ids: Any) -> dict:
        """The experts' plans of these ids (gate, up and down share them): filled by the caller."""
        if self._plans is None or self._plans[0] is not ids:
            self._plans = (ids, {})
        return self._plans[1]

    def drop_shared(self) -> None:
        """Forget what the ops shared (a graph runner's pool must not stay pinned by it)."""
        self._q8 = self._plans = None


def prompt_layout(spans: Sequence[Any], prefill: bool) -> tuple[tuple[int, int, int], ...]:
    """(first row, end row, span index) of each long prompt's span in the window: which rows take
    the prompt paths (part of a window graph's shape); none where the prompt paths are off."""
    out, off = [], 0
    for i, sp in enumerate(spans):
        if prefill and sp.long_prompt:
            out.append((off, off + int(sp.count), i))
        off += int(sp.count)
    return tuple(out)


def window_table(spans: Sequence[Any]) -> np.ndarray:
    """The window table (see fused.cu) of these spans, on the host."""
    counts = [int(sp.count) for sp in spans]
    n, ns = sum(counts), len(spans)
    tab = np.empty(2 * n + 3 * ns, dtype=np.int64)
    tab[:n] = window_positions(spans)
    tab[n : 2 * n] = np.repeat(np.arange(ns), counts)
    for i, sp in enumerate(spans):
        tab[2 * n + 3 * i : 2 * n + 3 * i + 3] = (sp.start, sp.start + sp.count, int(sp.cache.device_table().data.ptr))
    return tab


def splits_for(spans: Sequence[Any], chunk: int) -> int:
    """Attention key splits: one thread block per `chunk`-key chunk of the longest span (a power
    of two, at most MAX_SPLITS: graph keys stay few). A span's chunks then never share a block,
    so its attention rounds the same whatever else is in the window (batch invariance), up to
    MAX_SPLITS chunks."""
    longest = max(int(sp.start + sp.count) for sp in spans)
    chunks = min(-(-longest // chunk), MAX_SPLITS)
    return 1 << max(0, (chunks - 1).bit_length())


def row_ranges(n: int, prompt_rows: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """The rows [0, n) of a call cut at the long prompts' rows, in order: (first, end, whether
    they are a prompt's). The linears and the experts route each range to its own kernel."""
    out, a = [], 0
    for r0, r1 in list(prompt_rows) + [(n, n)]:
        if a < r0:
            out.append((a, r0, False))
        if r0 < r1:
            out.append((r0, r1, True))
        a = r1
    return out


def head_spans(spans: Sequence[Any], first: int) -> list[Any]:
    """The spans of rows [0, first): those before the window's first long prompt."""
    out, off = [], 0
    for sp in spans:
        if off >= first:
            break
        out.append(sp)
        off += int(sp.count)
    return out
