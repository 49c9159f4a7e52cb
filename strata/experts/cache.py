"""The slot pool's bookkeeping: which expert is in which slot, and what a window's layer costs.

A unit is one layer's expert: all of its tensors (gate, up, down, or gate_up and down) share a
slot, since a routed token reads all of them. Layers whose experts take the same bytes share one
pool of uniform slots, global over those layers: a layer whose routing is concentrated leaves slots
to one whose routing is flat (bench/expert_cache_policy.py measures this against a pool per layer).
Experts of different sizes (a quantization mix that types the downs by layer) get a pool per size,
each caching the same share of its experts, so no slot is sized for a larger expert than it holds.

`resolve(group, ids)` runs before a layer's experts: every expert the window's tokens route to
(all slots' tokens and all draft positions: one resolution per layer per window) is found in its
slot, or takes a free slot, or evicts the policy's victim among the units this window does not
need; when every slot is needed by the window itself (a prompt chunk touching more experts than
the pool holds) the rest are served from host memory for this window (`HOST`) and stay out. Each
missing expert is uploaded once per window, however many of its tokens need it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from strata.experts.policy import POLICIES

HOST = -1  # a resolution's slot for an expert served from host memory this window


@dataclass(frozen=True)
class PoolSpec:
    n_slots: int
    slot_bytes: int  # one unit: all of its tensors


@dataclass(frozen=True)
class GroupSpec:
    name: str  # the layer's tensor prefix ("blk.3.")
    n_expert: int
    pool: int  # index into the pools


@dataclass
class Resolution:
    """One layer's experts for one window: `experts` (sorted, distinct), each one's slot (or
    HOST), and the (expert, slot) pairs to upload before the experts run."""

    experts: np.ndarray
    slots: np.ndarray
    uploads: list[tuple[int, int]]
    copied: bool = False  # set by the store once the uploads are done (the layer's later tensors reuse it)

    def slot_of(self, expert: int) -> int:
        return int(self.slots[int(np.searchsorted(self.experts, expert))])


@dataclass
class CacheStats:
    """Counters since start (`window_*`: the last window). A lookup is one expert a window's layer
    needs; it hits when the expert was in its slot before the window."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    host_served: int = 0  # misses served from host memory (no slot free of the window's own)
    uploads: int = 0
    bytes_uploaded: int = 0
    windows: int = 0
    window_uploads: int = 0
    window_bytes: int = 0
    host_seconds: float = 0.0  # time serving HOST experts (the CPU store: dequantizing them for the window)

    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["hit_rate"] = self.hit_rate()
        return d


class _Pool:
    """Uniform slots: who holds each, its policy key, and the pin that keeps a layer's own experts
    from evicting each other in a window. Victims come from a queue of the lowest keys, built by
    one partial sort when needed (at most once per window, or again when it runs dry): a queued
    slot whose key changed since (used again) or that the resolution pins is skipped. A unit
    placed this window is queued only from the next one, which a window's resolutions never need."""

    QUEUE_SHARE = 16  # a queue holds 1/16 of the slots (at least 64): one partial sort per ~that many evictions

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        n = spec.n_slots
        self.key = np.full(n, np.inf)
        self.group = np.full(n, -1, np.int64)
        self.expert = np.full(n, -1, np.int64)
        self.pin = np.zeros(n, np.int64)
        self.free = list(range(n - 1, -1, -1))  # pop() gives slot 0 first
        self.clear_queue()

    def clear_queue(self) -> None:
        self.q_slot, self.q_key, self.q_at = np.zeros(0, np.int64), np.zeros(0), 0

    def _refill(self, serial: int) -> None:
        keys = np.where(self.pin == serial, np.inf, self.key)
        n = min(len(keys), max(64, len(keys) // self.QUEUE_SHARE))
        idx = np.argpartition(keys, n - 1)[:n] if n < len(keys) else np.arange(len(keys))
        idx = idx[np.isfinite(keys[idx])]
        idx = idx[np.lexsort((idx, keys[idx]))]  # lowest key first, the lower slot on ties
        self.q_slot, self.q_key, self.q_at = idx, self.key[idx], 0

    def take(self, n: int, serial: int) -> np.ndarray:
        """Up to n slots, pinned to this resolution: free ones, then the lowest keys it does not pin."""
        out = [self.free.pop() for _ in range(min(n, len(self.free)))]
        for attempt in range(2):
            need = n - len(out)
            if need == 0:
                break
            if attempt:
                self.pin[np.asarray(out, np.int64)] = serial
                self._refill(serial)
            qs, qk = self.q_slot[self.q_at:], self.q_key[self.q_at:]
            pos = np.nonzero((self.key[qs] == qk) & (self.pin[qs] != serial))[0][:need]
            out.extend(qs[pos].tolist())
            self.q_at += int(pos[-1]) + 1 if len(pos) == need else len(qs)
        got = np.asarray(out, np.int64)
        self.pin[got] = serial
        return got


class PoolSizes:
    """Totals of a set of pools and the layers behind them (the plan's and the cache's)."""

    pools: Sequence[PoolSpec]
    groups: Sequence[GroupSpec]

    @property
    def n_slots(self) -> int:
        return sum(p.n_slots for p in self.pools)

    @property
    def n_units(self) -> int:
        return sum(g.n_expert for g in self.groups)


@dataclass
class _Layer:
    """One layer's units: slot (or -1), and the policy's count and last use, of each expert."""

    slot: np.ndarray
    count: np.ndarray
    last: np.ndarray


@dataclass
class ExpertCache(PoolSizes):
    """The pools, the layers (groups) that use them, and the counters. `policy`: a name of
    POLICIES; `policy_args`: its keyword arguments (FrequencyLRU's half_life)."""

    pools: Sequence[PoolSpec]
    groups: Sequence[GroupSpec]
    policy: str = "frequency"
    policy_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown expert cache policy {self.policy!r} (known: {', '.join(POLICIES)})")
        self.rank = POLICIES[self.policy](**self.policy_args)
        self._pools = [_Pool(p) for p in self.pools]
        self._layers = [_Layer(np.full(g.n_expert, -1, np.int64), np.zeros(g.n_expert), np.zeros(g.n_expert))
                        for g in self.groups]
        self.index = {g.name: i for i, g in enumerate(self.groups)}
        self.now = 0
        self.stats = CacheStats()
        self._serial = 0
        self._memo: dict[int, tuple[int, np.ndarray, Resolution]] = {}

    # ---- windows ----------------------------------------------------------------------------
    def begin_window(self) -> None:
        self.now += 1
        self.stats.windows += 1
        self.stats.window_uploads = self.stats.window_bytes = 0
        for p in self._pools:
            p.clear_queue()  # keys moved last window: the next eviction sorts afresh

    def resolve(self, group: int, ids: np.ndarray) -> Resolution:
        """The slots of the experts `ids` (any shape) of layer `group` for this window; a second
        call for the same layer and ids in the same window (the layer's next expert tensor)
        returns the first's resolution without counting again."""
        memo = self._memo.get(group)
        if memo is not None and memo[0] == self.now and (memo[1] is ids or np.array_equal(memo[1], ids)):
            return memo[2]
        experts, tokens = np.unique(np.asarray(ids).reshape(-1), return_counts=True)
        layer, pool = self._layers[group], self._pools[self.groups[group].pool]
        count, last, key = self.rank.use(layer.count[experts], layer.last[experts], tokens, self.now)
        layer.count[experts], layer.last[experts] = count, last
        self._serial += 1
        serial = self._serial
        slots = layer.slot[experts]  # (a copy: fancy indexing)
        hit = slots >= 0
        pool.key[slots[hit]] = key[hit]
        pool.pin[slots[hit]] = serial
        st = self.stats
        n_hit = int(hit.sum())
        st.lookups += len(experts)
        st.hits += n_hit
        st.misses += len(experts) - n_hit
        miss = np.nonzero(~hit)[0]
        got = pool.take(len(miss), serial) if len(miss) else np.zeros(0, np.int64)
        placed, left = miss[: len(got)], miss[len(got):]
        slots[left] = HOST  # every slot is the window's own: these are served from host memory
        st.host_served += len(left)
        gone_g, gone_e = pool.group[got], pool.expert[got]
        gone = gone_g >= 0
        st.evictions += int(gone.sum())
        for g in np.unique(gone_g[gone]):
            self._layers[g].slot[gone_e[gone & (gone_g == g)]] = -1
        e = experts[placed]
        pool.group[got], pool.expert[got], pool.key[got] = group, e, key[placed]
        layer.slot[e] = got
        slots[placed] = got
        uploads = list(zip(e.tolist(), got.tolist()))
        n_up, nbytes = len(uploads), len(uploads) * pool.spec.slot_bytes
        st.uploads += n_up
        st.window_uploads += n_up
        st.bytes_uploaded += nbytes
        st.window_bytes += nbytes
        res = Resolution(experts, slots, uploads)
        self._memo[group] = (self.now, ids, res)
        return res

    # ---- seeding from a profile -----------------------------------------------------------
    def preload(self, rates: Callable[[int], np.ndarray | None]) -> list[tuple[int, int, int]]:
        """Fill each pool with its hottest units and seed the policy's counts. rates(group): the
        layer's expected tokens per window for each expert (None: no profile for it). Returns
        (group, expert, slot) for each preloaded unit (the store copies their weights)."""
        placed = []
        for p, pool in enumerate(self._pools):
            ranked: list[tuple[float, int, int, float]] = []
            for gi, g in enumerate(self.groups):
                r = rates(gi) if g.pool == p else None
                if r is None:
                    continue
                r = np.asarray(r, np.float64)
                layer = self._layers[gi]
                layer.count[:], layer.last[:], key = self.rank.seed(r)
                ranked += [(float(r[e]), gi, e, float(key[e])) for e in np.nonzero(r > 0)[0]]
            ranked.sort(key=lambda t: (-t[0], t[1], t[2]))
            for rate, gi, e, key in ranked[: len(pool.free)]:
                slot = pool.free.pop()
                pool.group[slot], pool.expert[slot], pool.key[slot] = gi, e, key
                self._layers[gi].slot[e] = slot
                placed.append((gi, int(e), slot))
        return placed

    def resident(self, group: int) -> dict[int, int]:
        """expert -> slot of one layer's resident experts."""
        s = self._layers[group].slot
        return {int(e): int(s[e]) for e in np.nonzero(s >= 0)[0]}
