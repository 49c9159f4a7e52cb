"""The CPU backend's expert store: its two tiers of expert memory.

Without a plan every expert is resident: dequantized at load to float32, each expert transposed
(cpu_layout.py), which takes about 8x a 3-4 bit expert's blocks. Where the engine plans an expert
cache (strata.experts), the tensors it pools keep no float32 copy at all: their host copy is the
pack's quantized blocks, a view of the file map (the OS pages them in as they are read, and may
drop them again: they take no memory of their own), and a pool of slots holds float32 experts,
dequantized from those blocks when they miss:

- a hit reads its slot;
- a miss dequantizes the expert (every tensor of its layer: gate, up and down, or gate_up and
  down) into the slot the cache gives it, once per window whatever its tokens (`uploads`);
- an expert served from host (`HOST`: every slot is needed by the window itself, a prompt chunk
  touching more experts than the pool holds) is dequantized for this window only, into one
  scratch matrix that the next such expert reuses (`host_seconds` is the time spent so).

One expert dequantized from its own blocks is bit-identical to its part of the whole tensor
(cpu_layout.py), and it is read by the same matmul, so tokens are the all-resident tokens
whatever the pool's size. The float32 the experts take is the slots' (plus one scratch matrix),
which `expert_bytes` and the cache plan count, and `nbytes` reports.

The store also counts, per layer, the tokens routed to each expert (the profile's counts), once
per window: a layer's tensors share one routing.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.backend.base import TensorSource
from strata.backend.cpu_layout import expert_blocks, expert_matrices, expert_matrix
from strata.experts.budget import CachePlan, split_expert_name
from strata.experts.cache import HOST, ExpertCache, Resolution


@dataclass
class DenseExperts:
    """One expert tensor. Resident: `wt`, float32 (n_expert, in, out), each expert transposed.
    Pooled: `wt` is None and `blocks` (n_expert, one expert's bytes) uint8 is a view of the pack's
    map; the pool's slots hold its experts as (in, out) float32."""

    name: str
    type_id: int
    n_expert: int
    n_in: int
    n_out: int
    wt: np.ndarray | None = None
    blocks: np.ndarray | None = None
    group: str = ""  # the layer's tensor prefix (strata.experts.budget.split_expert_name)
    role: str = ""  # ffn_gate_exps, ffn_up_exps, ffn_gate_up_exps or ffn_down_exps
    pooled: int = -1  # the layer's index in the cache (-1: resident)

    def dequantize_into(self, e: int, out: np.ndarray) -> np.ndarray:
        """Expert e of a pooled tensor as float32 (in, out), written into `out`."""
        return expert_matrix(self.type_id, self.blocks[e], self.n_in, self.n_out, out)


class _Slots:
    """Expert id -> the matrix to read this window: its slot's, or (served from host) one made
    now in the store's scratch, valid until the next expert is asked for."""

    def __init__(self, store: "CpuExpertStore", w: DenseExperts, res: Resolution, pool: np.ndarray) -> None:
        self.store, self.w, self.res, self.pool = store, w, res, pool

    def __getitem__(self, e: int) -> np.ndarray:
        slot = self.res.slot_of(int(e))
        if slot == HOST:
            return self.store.host_matrix(self.w, int(e))
        return self.pool[slot].reshape(self.w.n_in, self.w.n_out)


class CpuExpertStore:
    """The CPU backend's expert tensors: `configure` before they load (the engine's plan), `add`
    at load, `begin_window` per window, `matrices` per experts matmul."""

    def __init__(self, threads: int = 1) -> None:
        # a window's misses are dequantized side by side on this many threads (the backend's
        # thread count): the IQ dequantizers are many numpy passes that release the GIL, 1.3-1.9x
        # on 2 threads for IQ3_S / IQ3_XXS / Q2_0 experts on the test machine
        self.threads = threads
        self._workers: ThreadPoolExecutor | None = None
        self.cache: ExpertCache | None = None
        self.plan: CachePlan | None = None
        self._members: dict[int, list[DenseExperts]] = {}  # cached layer -> its tensors
        self._pools: dict[tuple[int, str], np.ndarray] = {}  # (pool, role) -> (slots, in * out) float32
        self._preload: dict[int, list[tuple[int, int]]] = {}  # layer -> (expert, slot) to fill at load
        self._scratch = np.zeros(0, np.float32)  # one expert served from host, any tensor's
        self._resident_bytes = 0
        self.counts: dict[str, np.ndarray] = {}  # layer -> tokens routed per expert
        self.tokens: dict[str, int] = {}  # layer -> token positions counted
        self._window = 0
        self._counted: dict[str, tuple[int, Any]] = {}

    def configure(self, plan: CachePlan | None, policy: str, policy_args: dict, rates) -> None:
        """The engine's cache plan (None: every expert resident); rates(layer name): a profile's
        tokens per position for each expert, or None."""
        self.plan = plan
        if plan is None:
            self.cache = None
            return
        self.cache = ExpertCache(plan.pools, plan.groups, policy, policy_args)
        placed = self.cache.preload(lambda gi: rates(plan.groups[gi].name))
        for gi, e, slot in placed:
            self._preload.setdefault(gi, []).append((e, slot))

    def add(self, source: TensorSource) -> DenseExperts:
        """An expert tensor (ne [in, out, n_expert]): its blocks behind the pool where the plan
        pools its layer, else every expert dequantized now."""
        n_in, n_out, n_exp = (int(x) for x in source.shape)
        parts = split_expert_name(source.name)
        group, role = parts if parts is not None else (source.name, "")
        w = DenseExperts(source.name, source.ggml_type, n_exp, n_in, n_out, group=group, role=role)
        gi = self.cache.index.get(group) if self.cache is not None else None
        members = self._members.get(gi, []) if gi is not None else []
        if gi is None or any(m.role == role for m in members):
            # not planned (a draft's), or a second tensor of a role (another file's layer): resident
            w.wt = expert_matrices(source)
            self._resident_bytes += w.wt.nbytes
            return w
        w.blocks, w.pooled = expert_blocks(source), gi
        self._members.setdefault(gi, []).append(w)
        pool = self._pool(gi, role, n_in * n_out)
        for e, slot in self._preload.get(gi, ()):
            w.dequantize_into(e, pool[slot])
        if self._scratch.size < n_in * n_out:
            self._scratch = np.empty(n_in * n_out, np.float32)
        return w

    def _pool(self, gi: int, role: str, size: int) -> np.ndarray:
        p = self.plan.groups[gi].pool
        arr = self._pools.get((p, role))
        if arr is None:
            arr = np.zeros((self.plan.pools[p].n_slots, size), np.float32)
            self._pools[(p, role)] = arr
        return arr

    def nbytes(self) -> int:
        """The float32 the experts take: resident tensors, the slots and the scratch matrix."""
        return self._resident_bytes + sum(a.nbytes for a in self._pools.values()) + self._scratch.nbytes

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
        n = w.n_expert
        if c is None:
            c = self.counts[w.group] = np.zeros(n, np.int64)
        c += np.bincount(np.asarray(ids).reshape(-1), minlength=n)[:n]
        self.tokens[w.group] = self.tokens.get(w.group, 0) + int(np.asarray(ids).shape[0])

    def matrices(self, w: DenseExperts, ids: np.ndarray) -> Any:
        """What `linear_experts` indexes by expert id for this window: the resident experts, or
        the slots once this window's misses of the layer are dequantized into them (once per
        window, every tensor of the layer at the first one's call)."""
        self._count(w, ids)
        if w.pooled < 0:
            return w.wt
        res = self.cache.resolve(w.pooled, ids)
        p = self.plan.groups[w.pooled].pool
        if not res.copied:
            jobs = [(m, e, self._pools[(p, m.role)][slot]) for m in self._members[w.pooled] for e, slot in res.uploads]
            if self.threads > 1 and len(jobs) > 1:
                list(self._pool_of_workers().map(lambda job: job[0].dequantize_into(job[1], job[2]), jobs))
            else:
                for m, e, out in jobs:
                    m.dequantize_into(e, out)
            res.copied = True
        return _Slots(self, w, res, self._pools[(p, w.role)])

    def _pool_of_workers(self) -> ThreadPoolExecutor:
        if self._workers is None:
            self._workers = ThreadPoolExecutor(self.threads, thread_name_prefix="strata-experts")
        return self._workers

    def host_matrix(self, w: DenseExperts, e: int) -> np.ndarray:
        """Expert e of w for this window only, in the scratch matrix (timed: host_seconds)."""
        t0 = time.perf_counter()
        m = w.dequantize_into(e, self._scratch[: w.n_in * w.n_out])
        self.cache.stats.host_seconds += time.perf_counter() - t0
        return m

    def stats(self) -> dict | None:
        return None if self.cache is None else self.cache.stats.as_dict() | {
            "slots": self.cache.n_slots, "experts": self.cache.n_units,
            "pool_bytes": self.plan.pool_bytes, "policy": self.cache.policy}
