"""A sequence's state in a hybrid model: the KV cache of its attention layers and the recurrent
state of its linear-attention (Gated DeltaNet) layers, rolled back together.

The scheduler treats a sequence's cache as something with a length that windows advance and
`truncate(n)` cuts back (rejected drafts, failed windows). A KV cache forgets entries past n for
free; a recurrent state cannot un-apply a token. So each layer keeps two copies of its state
(conv window and delta-rule matrix): a window reads copy `active` and writes the other, and the
cache flips `active` once the window's forward is done. Until the next window begins, the state
as it was at the window's start is still there:

- truncate to the window's start: flip back (nothing is recomputed);
- truncate inside the window (the verifier accepted some drafts): flip back and replay the
  accepted tokens from the kept per-token inputs of each layer (the rows of its input
  projection: a few KiB per token, no matrix products through the weights);
- a window that fails half way never flipped, so nothing of it remains.

Replay inputs are kept for windows of up to `replay_tokens` tokens (decode windows: 1 + drafts);
a longer window (a prompt chunk) can be cut back to its start only, which is all a prompt needs.
Memory per sequence: 2 x (conv + delta state) per recurrent layer, plus the replay inputs.

The states of all sequences live in one pool per model (RecurrentPool), a cell per sequence, so a
device kernel updates every sequence of a window in one launch from a small table of
(cell, active copy, first row, row count).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any


from strata.errors import StrataError
from strata.model.kv_cache import KVCache


@dataclass(frozen=True)
class RecurrentShape:
    """One recurrent layer's state: conv window (d_conv - 1, channels), delta state (heads, dv, dk)."""

    n_layer: int  # recurrent layers
    conv_rows: int  # d_conv - 1
    channels: int  # q, k and v channels into the conv
    heads: int  # value heads
    head_v: int
    head_k: int
    replay_width: int  # floats kept per token and layer for replay (its input projection's row)

    @property
    def state_floats(self) -> int:
        return self.conv_rows * self.channels + self.heads * self.head_v * self.head_k


class RecurrentPool:
    """Every sequence's recurrent state, one cell each:
    conv (layers, cells, 2, d_conv - 1, channels) and ssm (layers, cells, 2, heads, dk, dv), the
    second axis of size 2 the two copies. Cells are added as caches are made (the arrays are
    regrown then, so a cache indexes the pool, never keeps views) and freed with their cache."""

    def __init__(self, xp: Any, shape: RecurrentShape, replay_tokens: int):
        self.xp, self.shape = xp, shape
        self.replay_tokens = replay_tokens
        self.cells = 0
        self.free: list[int] = []
        self.conv = self.ssm = self.replay = None
        self._alloc(0)

    def _alloc(self, cells: int) -> None:
        """conv and ssm as in the class doc; replay (layers, cells, replay_tokens, width): the
        input-projection rows of each cell's last window, when it was short enough."""
        s, xp = self.shape, self.xp
        conv = xp.zeros((s.n_layer, cells, 2, s.conv_rows, s.channels), xp.float32)
        ssm = xp.zeros((s.n_layer, cells, 2, s.heads, s.head_k, s.head_v), xp.float32)
        replay = xp.zeros((s.n_layer, cells, self.replay_tokens, s.replay_width), xp.float32)
        if self.cells:
            conv[:, : self.cells] = self.conv
            ssm[:, : self.cells] = self.ssm
            replay[:, : self.cells] = self.replay
        self.conv, self.ssm, self.replay, self.cells = conv, ssm, replay, cells

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self._alloc(self.cells + 1)
        return self.cells - 1

    def give_back(self, cell: int) -> None:
        self.free.append(cell)


class HybridCache:
    """KV cache of the attention layers plus the double-buffered recurrent state (module doc)."""

    def __init__(self, xp: Any, kv: KVCache, pool: RecurrentPool):
        self.xp = xp
        self.kv = kv
        self.pool = pool
        self.shape = pool.shape
        self.replay_tokens = pool.replay_tokens
        self.cell = pool.take()
        weakref.finalize(self, pool.give_back, self.cell)
        self.active = 0
        self.reset()
        # the last window: where it began, how many tokens (its rows for a replay are in the pool)
        self.window_start = 0
        self.window_count = 0
        self.replayer = None  # the model's function that replays kept inputs (set by the model)

    @property
    def conv(self) -> list[Any]:
        """Per layer, (2, rows, channels): both copies of the conv window (a view of the pool)."""
        return [self.pool.conv[i, self.cell] for i in range(self.shape.n_layer)]

    @property
    def ssm(self) -> list[Any]:
        return [self.pool.ssm[i, self.cell] for i in range(self.shape.n_layer)]

    # --- what the scheduler and the KV paths read ------------------------------------------
    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self.kv.length = n

    @property
    def max_ctx(self) -> int:
        return self.kv.max_ctx

    @property
    def generation(self) -> int:
        return self.kv.generation

    def ensure(self, end: int) -> None:
        self.kv.ensure(end)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.state_bytes(self.shape, self.replay_tokens)

    @property
    def bytes_per_position(self) -> int:
        return self.kv.bytes_per_position

    @staticmethod
    def state_bytes(shape: RecurrentShape, replay_tokens: int) -> int:
        """Private bytes per sequence besides the KV cache: both state copies and replay inputs."""
        return 4 * shape.n_layer * (2 * shape.state_floats + replay_tokens * shape.replay_width)

    # --- windows ---------------------------------------------------------------------------
    def begin(self, start: int, count: int) -> None:
        """A window of `count` tokens from `start` is about to run (start == length)."""
        self.window_start, self.window_count = start, count

    def read(self, layer: int) -> tuple[Any, Any]:
        """The layer's state at the window's start: (conv (rows, C), delta (H, dk, dv))."""
        p = self.pool
        return p.conv[layer, self.cell, self.active], p.ssm[layer, self.cell, self.active]

    def target(self, layer: int) -> tuple[Any, Any]:
        """Where the window writes the layer's state after its tokens."""
        p = self.pool
        return p.conv[layer, self.cell, 1 - self.active], p.ssm[layer, self.cell, 1 - self.active]

    def table_row(self, first_row: int, count: int) -> list[int]:
        """This sequence's row of a window table (the device kernels' layout, module doc)."""
        return [self.cell, self.active, first_row, count]

    def keeps_replay(self) -> bool:
        """Whether this window's rows are kept (short enough to be cut back inside): the layers
        write them to the pool (Backend.keep_replay_rows) under the same rule."""
        return self.window_count <= self.replay_tokens

    def commit(self) -> None:
        """The window's forward is done: its states become the current ones."""
        self.active = 1 - self.active

    def truncate(self, n: int) -> None:
        if n >= self.length:
            return
        if n == 0:
            self.reset()
            return
        start, end = self.window_start, self.window_start + self.window_count
        if not (start <= n < end) or self.length != end:
            raise StrataError(f"recurrent state: cannot roll back to position {n} "
                              f"(the state is kept from position {start} only)")
        keep = n - start
        if keep and not self.keeps_replay():
            raise StrataError(f"recurrent state: a window of {self.window_count} tokens keeps no "
                              f"replay inputs (at most {self.replay_tokens}); cannot roll back to {n}")
        self.active = 1 - self.active  # the state at the window's start
        if keep:
            rows = [self.pool.replay[layer, self.cell, :keep] for layer in range(self.shape.n_layer)]
            self.replayer(self, rows)  # reads the start state, writes the other copy
            self.commit()
        self.window_count = keep
        self.kv.truncate(n)

    def reset(self) -> None:
        """An empty sequence: no positions, zero state."""
        self.pool.conv[:, self.cell, self.active] = 0
        self.pool.ssm[:, self.cell, self.active] = 0
        self.window_start = self.window_count = 0
        self.kv.length = 0
