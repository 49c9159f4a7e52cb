"""The CPU backend's expert store: every expert dequantized in host memory and, where the engine
plans an expert cache (strata.experts), a pool of slots the experts matmuls read instead.

On the CPU the pool is an emulation of the device tier: it saves no memory (the host copies stay)
and costs a copy per miss, but it runs the cache's logic (hits, misses, evictions, windows sharing
uploads, profiles) exactly where the tests and `strata experts profile` can see it, and its results
are bit-equal to the resident path: a slot holds the same float32 matrix as the host copy, read by
the same matmul. Without a plan every expert is read from its host copy, as ever.

The store also counts, per layer, the tokens routed to each expert (the profile's counts), once
per window: a layer's tensors share one routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.experts.budget import CachePlan, split_expert_name
from strata.experts.cache import HOST, ExpertCache, Resolution


@dataclass
class DenseExperts:
    wt: np.ndarray  # (n_expert, in, out) float32, each expert transposed (cpu.py's layout): the host copy
    name: str
    type_id: int
    group: str = ""  # the layer's tensor prefix (strata.experts.budget.split_expert_name)
    role: str = ""  # ffn_gate_exps, ffn_up_exps, ffn_gate_up_exps or ffn_down_exps
    pooled: int = -1  # the layer's index in the cache (-1: read from the host copy)


class _Slots:
    """Expert id -> the matrix to read this window: its slot's, or the host copy's."""

    def __init__(self, w: DenseExperts, res: Resolution, pool: np.ndarray) -> None:
        self.w, self.res, self.pool = w, res, pool

    def __getitem__(self, e: int) -> np.ndarray:
        slot = self.res.slot_of(int(e))
        if slot == HOST:
            return self.w.wt[e]
        return self.pool[slot].reshape(self.w.wt.shape[1:])


class CpuExpertStore:
    """The CPU backend's expert tensors: `add` at load, `configure` before (the engine's plan),
    `begin_window` per window, `matrices` per experts matmul."""

    def __init__(self) -> None:
        self.cache: ExpertCache | None = None
        self.plan: CachePlan | None = None
        self._members: dict[int, list[DenseExperts]] = {}  # cached layer -> its tensors
        self._pools: dict[tuple[int, str], np.ndarray] = {}  # (pool, role) -> (slots, in * out) float32
        self._preload: dict[int, list[tuple[int, int]]] = {}  # layer -> (expert, slot) to fill at load
        self.counts: dict[str, np.ndarray] = {}  # layer -> tokens routed per expert
        self.tokens: dict[str, int] = {}  # layer -> token positions counted
        self._window = 0
        self._counted: dict[str, tuple[int, Any]] = {}

    def configure(self, plan: CachePlan | None, policy: str, policy_args: dict, rates) -> None:
        """The engine's cache plan (None: every expert from its host copy); rates(layer name):
        a profile's tokens per position for each expert, or None."""
        self.plan = plan
        if plan is None:
            self.cache = None
            return
        self.cache = ExpertCache(plan.pools, plan.groups, policy, policy_args)
        placed = self.cache.preload(lambda gi: rates(plan.groups[gi].name))
        for gi, e, slot in placed:
            self._preload.setdefault(gi, []).append((e, slot))

    def add(self, wt: np.ndarray, name: str, type_id: int) -> DenseExperts:
        parts = split_expert_name(name)
        group, role = parts if parts is not None else (name, "")
        w = DenseExperts(wt, name, type_id, group, role)
        gi = self.cache.index.get(group) if self.cache is not None else None
        members = self._members.get(gi, []) if gi is not None else []
        if gi is None or any(m.role == role for m in members):
            return w  # not planned (a draft's), or a second tensor of a role (another file's layer): resident
        w.pooled = gi
        self._members.setdefault(gi, []).append(w)
        pool = self._pool(gi, role, wt)
        for e, slot in self._preload.get(gi, ()):
            pool[slot] = wt[e].reshape(-1)
        return w

    def _pool(self, gi: int, role: str, wt: np.ndarray) -> np.ndarray:
        p = self.plan.groups[gi].pool
        arr = self._pools.get((p, role))
        if arr is None:
            arr = np.zeros((self.plan.pools[p].n_slots, wt[0].size), np.float32)
            self._pools[(p, role)] = arr
        return arr

    def begin_window(self) -> None:
        self._window += 1
        if self.cache is not None:
            self.cache.begin_window()

    def _count(self, w: DenseExperts, ids: np.ndarray) -> None:
        seen = self._counted.get(w.group)
        if seen is not None and seen[0] == self._window and (seen[1] is ids or np.array_equal(seen[1], ids)):
            return
        self._counted[w.group] = (self._window, ids)
        c = self.counts.get(w.group)
        n = w.wt.shape[0]
        if c is None:
            c = self.counts[w.group] = np.zeros(n, np.int64)
        c += np.bincount(np.asarray(ids).reshape(-1), minlength=n)[:n]
        self.tokens[w.group] = self.tokens.get(w.group, 0) + int(np.asarray(ids).shape[0])

    def matrices(self, w: DenseExperts, ids: np.ndarray) -> Any:
        """What `linear_experts` indexes by expert id for this window: the host copies, or the
        slots after this window's misses of the layer are copied in (once per window)."""
        self._count(w, ids)
        if w.pooled < 0:
            return w.wt
        res = self.cache.resolve(w.pooled, ids)
        p = self.plan.groups[w.pooled].pool
        if not res.copied:
            for m in self._members[w.pooled]:
                pool = self._pools[(p, m.role)]
                for e, slot in res.uploads:
                    pool[slot] = m.wt[e].reshape(-1)
            res.copied = True
        return _Slots(w, res, self._pools[(p, w.role)])

    def stats(self) -> dict | None:
        return None if self.cache is None else self.cache.stats.as_dict() | {
            "slots": self.cache.n_slots, "experts": self.cache.n_units,
            "pool_bytes": self.plan.pool_bytes, "policy": self.cache.policy}
