"""A sequence's state in a model with recurrent layers: the KV cache of its attention layers and
the recurrent state of its linear-attention (Gated DeltaNet) layers, rolled back together.

The scheduler treats a sequence's cache as something with a length that windows advance and
`truncate(n)` cuts back (rejected drafts, failed windows). A KV cache forgets entries past n for
free; a recurrent state cannot un-apply a token. So a sequence with a **checkpoint** keeps two
copies of each layer's state (conv window and delta-rule matrix): a window reads copy `active`
and writes the other, and the cache flips `active` once the window's forward is done. Until the
next window begins, the state as it was at the window's start is still there:

- truncate to the window's start: flip back (nothing is recomputed);
- truncate inside the window (the verifier accepted some drafts): flip back and replay the
  accepted tokens from the kept per-token inputs of each layer (the rows of its input
  projection: a few KiB per token, no matrix products through the weights);
- a window that fails half way never flipped, so nothing of it remains.

Replay inputs are kept for windows of up to `replay_tokens` tokens (decode windows: 1 + drafts);
a longer window (a prompt chunk) can be cut back to its start only, which is all a prompt needs.
Memory per sequence: 2 x (conv + delta state) per recurrent layer, plus the replay inputs; the
checkpoint is the second copy and the replay inputs (`checkpoint_bytes`).

A sequence without a checkpoint (the engine found no room for one: strata/engine/checkpoints.py)
keeps one copy, which every window reads and writes in place (each element is read before it is
written, by the same thread on the GPU), and no replay inputs. It can go back to position 0 only
(a new request); any other cut raises StateLost, and so does a cut after a window that failed
half way (its layers may have written the state already): that sequence never drafts, and a
failed window ends its request instead of rerunning it.

The states of all sequences live in one pool per model (RecurrentPool): copies of the state, a
sequence owning one or two, and replay rows, one per sequence with a checkpoint. A device kernel
updates every sequence of a window in one launch from a small table of (copy read, copy
written, first row, row count, replay row).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any


from strata.errors import StrataError
from strata.model.kv_cache import KVCache
from strata.model.layers.delta_net import DeltaNet
from strata.model.layers.hparams import ModelConfig
from strata.model.state import Snapshot, StateLost

# decode windows (1 + drafts) up to this many tokens can be cut back inside; --spec beyond raises it
REPLAY_TOKENS = 16


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


def recurrent_shape(cfg: ModelConfig) -> RecurrentShape:
    """A sequence's recurrent state, from the config alone (`strata probe` sizes it unloaded)."""
    h = cfg.hybrid
    return RecurrentShape(n_layer=h.n_recurrent, conv_rows=h.d_conv - 1, channels=h.conv_dim,
                          heads=h.n_v_heads, head_v=h.d_state, head_k=h.d_state,
                          replay_width=DeltaNet.replay_width(cfg))


class RecurrentPool:
    """Every sequence's recurrent state: conv (layers, copies, d_conv - 1, channels) and ssm
    (layers, copies, heads, dk, dv), a sequence owning one copy or two; replay (layers, rows,
    replay_tokens, width), a row per sequence with a checkpoint (the input-projection rows of its
    last window, when it was short enough). Copies and rows are added as caches are made (the
    arrays are regrown then, so a cache indexes the pool, never keeps views) and freed with it."""

    def __init__(self, xp: Any, shape: RecurrentShape, replay_tokens: int):
        self.xp, self.shape = xp, shape
        self.replay_tokens = replay_tokens
        self.copies = self.rows = 0
        self.free_copies: list[int] = []
        self.free_rows: list[int] = []
        self.conv = self.ssm = self.replay = None
        self._alloc(0, 0)

    def _alloc(self, copies: int, rows: int) -> None:
        s, xp = self.shape, self.xp
        conv = xp.zeros((s.n_layer, copies, s.conv_rows, s.channels), xp.float32)
        ssm = xp.zeros((s.n_layer, copies, s.heads, s.head_k, s.head_v), xp.float32)
        replay = xp.zeros((s.n_layer, rows, self.replay_tokens, s.replay_width), xp.float32)
        if self.conv is not None:
            conv[:, : self.copies] = self.conv
            ssm[:, : self.copies] = self.ssm
            replay[:, : self.rows] = self.replay
        self.conv, self.ssm, self.replay = conv, ssm, replay
        self.copies, self.rows = copies, rows

    def take(self, checkpoint: bool) -> tuple[list[int], int | None]:
        """A new sequence's (state copies, replay row): two copies and a row with a checkpoint,
        one copy and no row without."""
        want = 2 if checkpoint else 1
        copies = [self.free_copies.pop() for _ in range(min(want, len(self.free_copies)))]
        row = self.free_rows.pop() if checkpoint and self.free_rows else None
        grow_copies = want - len(copies)
        grow_rows = int(checkpoint and row is None)
        if grow_copies or grow_rows:
            first, row_at = self.copies, self.rows
            self._alloc(self.copies + grow_copies, self.rows + grow_rows)
            copies += range(first, first + grow_copies)
            row = row_at if grow_rows else row
        return copies, row

    def give_back(self, copies: tuple[int, ...], row: int | None) -> None:
        self.free_copies.extend(copies)
        if row is not None:
            self.free_rows.append(row)


class HybridCache:
    """KV cache of the attention layers plus the recurrent state: double-buffered with a
    checkpoint, one copy updated in place without (module doc)."""

    def __init__(self, xp: Any, kv: KVCache, pool: RecurrentPool, checkpoint: bool = True):
        self.xp = xp
        self.kv = kv
        self.pool = pool
        self.shape = pool.shape
        self.replay_tokens = pool.replay_tokens
        self.copies, self.replay_row = pool.take(checkpoint)
        weakref.finalize(self, pool.give_back, tuple(self.copies), self.replay_row)
        self.active = 0  # index into self.copies: the state as of `length`
        # a window began and has not committed: a one-copy state may be half written
        self.in_window = False
        self.reset()
        # the last window: where it began, how many tokens (its rows for a replay are in the pool)
        self.window_start = 0
        self.window_count = 0
        self.replayer = None  # the model's function that replays kept inputs (set by the model)

    @property
    def checkpointed(self) -> bool:
        """Whether this sequence can be cut back inside or to the start of its last window."""
        return len(self.copies) == 2

    @property
    def conv(self) -> list[Any]:
        """Per layer, (copies, rows, channels): this sequence's copies of the conv window (a
        snapshot of the pool; index it with `active`)."""
        return [self.pool.conv[i, self.copies] for i in range(self.shape.n_layer)]

    @property
    def ssm(self) -> list[Any]:
        return [self.pool.ssm[i, self.copies] for i in range(self.shape.n_layer)]

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
        return self.kv.nbytes + self.state_bytes(self.shape, self.replay_tokens, self.checkpointed)

    @property
    def bytes_per_position(self) -> int:
        return self.kv.bytes_per_position

    @staticmethod
    def state_bytes(shape: RecurrentShape, replay_tokens: int, checkpoint: bool = True) -> int:
        """Private bytes per sequence besides the KV cache: one state copy, plus the checkpoint."""
        one_copy = 4 * shape.n_layer * shape.state_floats
        return one_copy + (HybridCache.checkpoint_bytes(shape, replay_tokens) if checkpoint else 0)

    @staticmethod
    def checkpoint_bytes(shape: RecurrentShape, replay_tokens: int) -> int:
        """What a checkpoint costs a sequence: the second state copy and the replay inputs."""
        return 4 * shape.n_layer * (shape.state_floats + replay_tokens * shape.replay_width)

    # --- windows ---------------------------------------------------------------------------
    def begin(self, start: int, count: int) -> None:
        """A window of `count` tokens from `start` is about to run (start == length)."""
        self.window_start, self.window_count = start, count
        self.in_window = True

    def _write_copy(self) -> int:
        """The copy a window writes: the other one with a checkpoint, else the one it reads."""
        return self.copies[1 - self.active] if self.checkpointed else self.copies[self.active]

    def read(self, layer: int) -> tuple[Any, Any]:
        """The layer's state at the window's start: (conv (rows, C), delta (H, dk, dv))."""
        p, c = self.pool, self.copies[self.active]
        return p.conv[layer, c], p.ssm[layer, c]

    def target(self, layer: int) -> tuple[Any, Any]:
        """Where the window writes the layer's state after its tokens (read's arrays without a
        checkpoint: the generic ops read the whole state before they write it)."""
        p, c = self.pool, self._write_copy()
        return p.conv[layer, c], p.ssm[layer, c]

    def table_row(self, first_row: int, count: int) -> list[int]:
        """This sequence's row of a window table (the device kernels' layout, module doc); no
        replay row is -1."""
        row = -1 if self.replay_row is None else self.replay_row
        return [self.copies[self.active], self._write_copy(), first_row, count, row]

    def keeps_replay(self) -> bool:
        """Whether this window's rows are kept (short enough to be cut back inside): the layers
        write them to the pool (Backend.keep_replay_rows) under the same rule."""
        return self.replay_row is not None and self.window_count <= self.replay_tokens

    def commit(self) -> None:
        """The window's forward is done: its states become the current ones."""
        if self.checkpointed:
            self.active = 1 - self.active
        self.in_window = False

    def truncate(self, n: int) -> None:
        if n == 0:
            self.reset()
            return
        if not self.checkpointed:
            self._truncate_in_place(n)
            return
        if n >= self.length:
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
            rows = [self.pool.replay[layer, self.replay_row, :keep] for layer in range(self.shape.n_layer)]
            self.replayer(self, rows)  # reads the start state, writes the other copy
            self.commit()
        self.window_count = keep
        self.kv.truncate(n)

    def _truncate_in_place(self, n: int) -> None:
        """One copy: nothing to go back to. A cut at the end is a no-op unless a window failed
        half way (it may have written some layers already)."""
        if n >= self.length and not self.in_window:
            return
        why = "a window failed after it may have updated it" if self.in_window else \
            f"it holds position {self.length}, not {n}"
        raise StateLost(f"recurrent state without a rollback copy: cannot go back to position {n} ({why})")

    def snapshot(self) -> Snapshot:
        """The sequence as it is: the KV cache's positions and a copy of the current state copy
        (state.SequenceState; a window's own rollback uses the checkpoint instead, no copy)."""
        c = self.copies[self.active]
        return Snapshot(self.length, self.kv.snapshot().cuts, (self.pool.conv[:, c].copy(), self.pool.ssm[:, c].copy()))

    def restore(self, snap: Snapshot) -> None:
        """Back to `snap`: its state copied into the current copy, the KV cache cut back to it.
        The last window can no longer be cut back inside (its replay rows are of other states)."""
        self.kv.restore(snap)
        c = self.copies[self.active]
        self.pool.conv[:, c], self.pool.ssm[:, c] = snap.recurrent
        self.window_start, self.window_count = snap.length, 0
        self.in_window = False

    def reset(self) -> None:
        """An empty sequence: no positions, zero state."""
        c = self.copies[self.active]
        self.pool.conv[:, c] = 0
        self.pool.ssm[:, c] = 0
        self.window_start = self.window_count = 0
        self.in_window = False
        self.kv.length = 0
