"""What a qwen4exp sequence carries (strata/model/archs/qwen4exp.py), rolled back as one:

- the KV cache of its sparse-attention layers and the Gated DeltaNet states (HybridCache,
  recurrent_state.py: double-buffered, replayed after a cut inside the last window);
- the indexer's raw keys, one row per position and attention layer: like the KV cache, a cut
  only forgets positions;
- the token ids of every position (the n-gram context reads the two before a token): the same;
- the PLE history, the last (K-1) N rows the n-gram layer's dilated conv reads. It follows the
  recurrent states' rule: the history at the last window's start is kept, with the window's
  own rows when the window is short enough to be cut inside (HybridCache.keeps_replay), so a
  cut back to any position of that window rebuilds it exactly; a new history becomes current
  only when the whole window has run (commit).

Snapshots carry the recurrent states and the PLE history (state.Snapshot.recurrent).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from strata.model.kv_cache import KVCache
from strata.model.recurrent_state import HybridCache, RecurrentPool
from strata.model.state import Snapshot


class PerPosition:
    """Rows of `width` values per position for `n_layer` layers, grown by doubling (the KV
    cache's way); positions past the sequence's length are ignored, never cleared."""

    def __init__(self, xp: Any, n_layer: int, width: int, dtype: Any, initial: int = 64):
        self.xp, self.width, self.dtype = xp, width, dtype
        self.arrays = [xp.zeros((initial, width), dtype) for _ in range(n_layer)]

    def ensure(self, end: int) -> None:
        cap = self.arrays[0].shape[0] if self.arrays else end
        if end <= cap:
            return
        new = max(end, 2 * cap)
        for i, a in enumerate(self.arrays):
            b = self.xp.zeros((new, self.width), self.dtype)
            b[:cap] = a
            self.arrays[i] = b

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


class Qwen4ExpCache(HybridCache):
    """A qwen4exp sequence's state (module doc). ple_rows: the PLE history's rows ((K-1) N),
    ple_width: its width (streams x n_embd), 0 without a PLE layer."""

    def __init__(self, xp: Any, kv: KVCache, pool: RecurrentPool, checkpoint: bool, *, n_index_layers: int,
                 index_dim: int, ple_rows: int, ple_width: int):
        self.index = PerPosition(xp, n_index_layers, index_dim, xp.float32)
        self.ids = PerPosition(np, 1, 1, np.int64)  # on the host: the n-gram hash runs there
        self.ple_rows, self.ple_width = ple_rows, ple_width
        self.ple_hist = xp.zeros((ple_rows, ple_width), xp.float32)  # as of `length`
        self.ple_start = self.ple_hist  # as of the last window's start
        self.ple_window: Any = None  # the last window's rows, kept when it is short enough
        self.ple_next: Any = None  # the history after the running window, until it commits
        super().__init__(xp, kv, pool, checkpoint)

    # --- what the layers read and write --------------------------------------------------
    @property
    def tokens(self) -> Any:
        """Every position's token id (host array; valid below the window's end)."""
        return self.ids.arrays[0][:, 0]

    def write_tokens(self, start: int, ids: Any) -> None:
        self.ids.ensure(start + len(ids))
        self.ids.arrays[0][start : start + len(ids), 0] = ids

    def write_index_keys(self, layer: int, start: int, keys: Any) -> None:
        self.index.ensure(start + keys.shape[0])
        self.index.arrays[layer][start : start + keys.shape[0]] = keys

    def index_keys(self, layer: int, end: int) -> Any:
        return self.index.arrays[layer][:end]

    def ple_history(self) -> Any:
        return self.ple_hist

    def keep_ple_rows(self, rows: Any) -> None:
        """The running window's conv input rows: its next history, and the rows for a cut inside it."""
        xp = self.xp
        self.ple_next = xp.concatenate([self.ple_hist, rows], axis=0)[-self.ple_rows :] if self.ple_rows else \
            self.ple_hist
        self.ple_window = rows.copy() if rows.shape[0] <= self.replay_tokens else None

    # --- the window protocol (HybridCache's, with the pieces above) ------------------------
    def ensure(self, end: int) -> None:
        super().ensure(end)
        self.index.ensure(end)
        self.ids.ensure(end)

    def begin(self, start: int, count: int) -> None:
        super().begin(start, count)
        self.ple_start, self.ple_window, self.ple_next = self.ple_hist, None, None

    def commit(self) -> None:
        super().commit()
        if self.ple_next is not None:
            self.ple_hist, self.ple_next = self.ple_next, None

    def truncate(self, n: int) -> None:
        start, length = self.window_start, self.length
        super().truncate(n)  # refuses what it cannot roll back; KV, indexer keys and ids follow length
        if n == 0 or n >= length or not self.ple_rows:
            return
        keep = n - start
        if keep == 0:
            self.ple_hist = self.ple_start
        else:
            rows = self.xp.concatenate([self.ple_start, self.ple_window[:keep]], axis=0)
            self.ple_hist = rows[-self.ple_rows :] if self.ple_rows else self.ple_start
            self.ple_window = self.ple_window[:keep]
        self.ple_next = None

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        return dataclasses.replace(snap, recurrent=(snap.recurrent, self.ple_hist.copy()))

    def restore(self, snap: Snapshot) -> None:
        recurrent, ple = snap.recurrent
        super().restore(dataclasses.replace(snap, recurrent=recurrent))
        self.ple_hist = self.ple_start = ple.copy()
        self.ple_window = self.ple_next = None

    def reset(self) -> None:
        super().reset()
        self.ple_hist = self.ple_start = self.xp.zeros((self.ple_rows, self.ple_width), self.xp.float32)
        self.ple_window = self.ple_next = None

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.index.nbytes + self.ids.nbytes + 3 * int(self.ple_hist.nbytes)


class MtpState:
    """What the MTP layer (archs/qwen4exp.py MtpLayer) keeps per sequence: its one attention
    layer's KV cache and indexer keys, both rows per position, so a cut only forgets positions
    (no recurrent state, no n-gram layer). The draft's cache, as DraftState.cache holds it."""

    def __init__(self, xp: Any, kv: KVCache, index_dim: int):
        self.xp, self.kv = xp, kv
        self.index = PerPosition(xp, 1, index_dim, xp.float32)

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self.kv.length = n

    def ensure(self, end: int) -> None:
        self.kv.ensure(end)
        self.index.ensure(end)

    def write_index_keys(self, layer: int, start: int, keys: Any) -> None:
        self.index.ensure(start + keys.shape[0])
        self.index.arrays[layer][start : start + keys.shape[0]] = keys

    def index_keys(self, layer: int, end: int) -> Any:
        return self.index.arrays[layer][:end]

    def truncate(self, n: int) -> None:
        self.kv.truncate(n)

    def reset(self) -> None:
        self.kv.reset()

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.index.nbytes
