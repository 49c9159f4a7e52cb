"""The numpy backend.

Quantized weights are dequantized once, at load, into float32 matrices that BLAS reads
(cpu_layout.py): on a 2-core CPU the mat-vec is bound by memory bandwidth either way, and BLAS
over float32 beats any numpy re-implementation of blockwise integer dots by a wide margin. The
exception is the routed experts an expert cache pools (--expert-cache; cpu_experts.py): they stay
quantized in the pack's map and only a pool of them is float32, so a MoE whose float32 experts
exceed the RAM still runs. The numpy mirrors of the native MMVQ kernels (strata.kernels.mmvq_numpy)
compute what the CUDA kernels compute and are used to test them, not for speed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import numpy as np

from strata.backend.base import Backend, ExpertTier, TensorSource
from strata.backend.cpu_experts import CpuExpertStore, DenseExperts
from strata.backend.cpu_layout import dequantize_source, transposed
from strata.errors import StrataError
from strata.gguf.row_source import HOST_ROW_TENSORS
from strata.host_memory import available_host_bytes


@dataclass
class DenseWeight:
    wt: np.ndarray  # (in, out) float32, C-contiguous (cpu_layout.py says why)
    names: tuple[str, ...]
    type_ids: tuple[int, ...]


ENV_THREADS = "STRATA_CPU_THREADS"  # the default of --threads, for every engine a process starts


def machine_cores() -> int:
    """The cores of this machine: the most BLAS threads worth asking for (more only wait on
    each other), the bound of --threads and STRATA_CPU_THREADS."""
    return os.cpu_count() or 1


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's or taskset's share)
    where the OS tells it, else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1  # Linux and most POSIX systems
    except AttributeError:
        pass
    count = getattr(os, "process_cpu_count", None)  # Python 3.13+: the affinity on every OS
    return (count() if count else None) or machine_cores()


def load_average() -> float | None:
    """The 1-minute load average (runnable tasks, ours included), or None where the OS keeps
    none (Windows has no os.getloadavg)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def default_threads(cores: int, load: float | None) -> int:
    """BLAS threads for an engine given no --threads: the cores that other work leaves free,
    cores minus the 1-minute load average, rounded half up, at least 1 and at most cores.

    A BLAS thread that shares its core with other work stalls every matmul it takes part in
    (its siblings spin at the barrier): on a 2-core machine at load 6.7, 2 threads decoded at
    0.55 tok/s against 8.6 with 1; on a quiet one 2 threads beat 1 (34 vs 28 tok/s). Without a
    load average (Windows) nothing says the cores are busy: every usable core, as on a quiet machine."""
    if load is None:
        return max(1, cores)
    return max(1, min(cores, int(cores - load + 0.5)))


def threads_from_env() -> int | None:
    """STRATA_CPU_THREADS as a thread count (None when unset). Set where several engines share
    the cores (parallel test workers, several servers): each then keeps to its share instead of
    spinning a BLAS thread per core against the others."""
    raw = os.environ.get(ENV_THREADS, "").strip()
    if not raw:
        return None
    cores = machine_cores()
    if not raw.isdigit() or not 1 <= int(raw) <= cores:
        raise StrataError(f"{ENV_THREADS}={raw!r}: expected a whole number in [1, {cores}] (this machine's cores)")
    return int(raw)


def choose_threads(flag: int | None) -> tuple[int, str]:
    """(BLAS threads, why): --threads, else STRATA_CPU_THREADS, else default_threads of now."""
    if flag is not None:
        return flag, f"--threads {flag}"
    env = threads_from_env()
    if env is not None:
        return env, f"{ENV_THREADS}={env}"
    cores, load = usable_cores(), load_average()
    n = default_threads(cores, load)
    if load is None:
        return n, f"{cores} usable cores; no load average on this OS; --threads N sets it"
    return n, f"{cores} usable cores, 1-minute load average {load:.2f}; --threads N sets it"


# Test-only: the host memory (bytes) the CPU backend may take, as if the machine had only that
# available; free_bytes then reports it less what the backend's weights hold (and never more than
# the host really has). Tests make a pack "larger than memory" with it; it is no user setting.
ENV_MEMORY = "STRATA_CPU_MEMORY"

# tensors the model reads by rows from the pack's file, never decoded whole (the n-gram table:
# strata/gguf/row_source.py): they take no memory of their own (--ple-io ram says its own copy)
_READ_BY_ROWS = HOST_ROW_TENSORS


def _memory_from_env() -> int | None:
    raw = os.environ.get(ENV_MEMORY, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise StrataError(f"{ENV_MEMORY}={raw!r}: expected a whole number of bytes (a test setting)")
    return int(raw)


class CpuBackend(Backend):
    name = "cpu"
    xp = np
    # cpu_experts.py: float32 slots in RAM, the pooled experts' blocks read from the pack's map
    expert_pool = ExpertTier(slots="as float32 in host RAM",
                             blocks="stay quantized in the pack file, mapped: a miss dequantizes its expert from there")

    def __init__(self, threads: int | None = None) -> None:
        self._cache: dict[str, np.ndarray] = {}
        # decided once, at start-up, and said in start_line (default_threads: the free cores)
        self._threads, self._threads_why = choose_threads(threads)
        # resident experts, or the pool's slots over the pack's blocks (its misses on as many threads)
        self.experts = CpuExpertStore(self._threads)
        self.memory_cap = _memory_from_env()  # (test-only: ENV_MEMORY)
        self._held = 0  # bytes of the weights made so far, experts aside (the store counts its own)
        self._current: int | None = None
        try:
            from threadpoolctl import ThreadpoolController

            self._ctl = ThreadpoolController()
        except Exception:  # no threadpoolctl: BLAS keeps its own default
            self._ctl = None

    @property
    def threads(self) -> int | None:
        """The BLAS threads every window runs with (None: BLAS's own default, no threadpoolctl)."""
        return None if self._ctl is None else self._threads

    def start_line(self) -> str:
        """The engine's start-up line about this backend: its BLAS thread count and why."""
        if self._ctl is None:
            return "strata: cpu: BLAS threads left at BLAS's own default (threadpoolctl is missing)"
        n = self._threads
        return f"strata: cpu: {n} BLAS thread{'s' if n != 1 else ''} ({self._threads_why})"

    def window(self, n_tokens: int) -> None:
        if self._ctl is None:
            return
        want = self._threads
        if want != self._current:
            self._ctl.limit(limits=want, user_api="blas")  # stays in force until changed
            self._current = want

    def _dense(self, src: TensorSource) -> np.ndarray:
        # Cached by name: the tied output head and the embedding are one tensor.
        a = self._cache.get(src.name)
        if a is None:
            a = np.ascontiguousarray(dequantize_source(src), dtype=np.float32)
            self._cache[src.name] = a
        return a

    def held_bytes(self) -> int:
        """The memory this backend's weights hold (float32 matrices, vectors, the experts)."""
        return self._held + self.experts.nbytes()

    def free_bytes(self) -> int | None:
        free = available_host_bytes()
        if self.memory_cap is None:
            return free
        left = max(0, self.memory_cap - self.held_bytes())
        return left if free is None else min(free, left)

    def weight_bytes(self, tensors: Sequence[Any], mapped: Collection[str] = ()) -> int | None:
        """Every tensor dequantized to float32, except those in `mapped` (pooled experts) and
        those read by rows from the map. A lower bound: a tied head's transposed copy is left out."""
        return sum(4 * math.prod(t.shape) for t in tensors
                   if t.name not in mapped and not t.name.startswith(_READ_BY_ROWS))

    def load_peak_bytes(self, tensors: Sequence[Any], mapped: Collection[str] = ()) -> int:
        """A matrix is dequantized whole, then its transposed copy made: the largest one's float32
        for a moment (an expert tensor is made expert by expert: one expert's)."""
        def peak(t: Any) -> int:
            n = math.prod(t.shape)
            return n // int(t.shape[2]) if len(t.shape) == 3 else n
        return 4 * max((peak(t) for t in tensors if t.name not in mapped and not t.name.startswith(_READ_BY_ROWS)),
                       default=0)

    def linear_weight(self, sources: Sequence[TensorSource]) -> DenseWeight:
        mats = [self._dense(s) for s in sources]
        wt = transposed(mats)
        for s in sources:  # the transposed copy is what we keep; the embedding stays for lookups
            if not s.name.startswith("token_embd"):
                self._cache.pop(s.name, None)
        self._held += wt.nbytes
        return DenseWeight(wt, tuple(s.name for s in sources), tuple(s.ggml_type for s in sources))

    # The draft's head over its vocabulary only: the 49k-row head is ~20% of a step here, and a
    # verification window runs it once per drafted token.
    def head_columns(self, w: DenseWeight, ids: np.ndarray) -> DenseWeight:
        wt = np.ascontiguousarray(w.wt[:, ids])
        self._held += wt.nbytes
        return DenseWeight(wt, w.names, w.type_ids)

    def expert_weight(self, source: TensorSource) -> DenseExperts:
        return self.experts.add(source)

    def expert_bytes(self, ggml_type: int, shape: tuple[int, ...]) -> int:
        return int(shape[0]) * int(shape[1]) * 4  # float32, resident or in a slot

    def configure_experts(self, plan: Any, policy: str, policy_args: dict, rates: Any) -> None:
        self.experts.configure(plan, policy, policy_args, rates)

    def expert_cache_stats(self) -> dict | None:
        return self.experts.stats()

    def expert_counts(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        return self.experts.counts, self.experts.tokens

    def begin_window(self, spans: Sequence[Any]) -> Any:
        self.experts.begin_window()
        return super().begin_window(spans)

    def vector(self, source: TensorSource) -> np.ndarray:
        v = np.ascontiguousarray(dequantize_source(source).reshape(-1), dtype=np.float32)
        self._held += v.nbytes
        return v

    def embedding(self, source: TensorSource) -> np.ndarray:
        kept = source.name in self._cache
        table = self._dense(source)
        self._held += 0 if kept else table.nbytes
        return table

    # OpenBLAS packs the whole weight for a GEMM, so a few rows cost 3-6x one row (the output
    # head, 2 threads: 3.2 ms for 1 row, ~15 ms for 2-12 rows); up to this many rows one mat-vec
    # per row is as fast or faster (head at 4 rows: 13.6 vs 14.9 ms; 576x3072: 0.20 vs 0.48 ms),
    # and each row then rounds exactly as a lone row does.
    ROWWISE_MAX = 4

    def linear(self, w: DenseWeight, x: np.ndarray) -> np.ndarray:
        m = x.shape[0]
        if 1 < m <= self.ROWWISE_MAX:
            out = np.empty((m, w.wt.shape[1]), dtype=np.float32)
            for j in range(m):
                np.matmul(x[j : j + 1], w.wt, out=out[j : j + 1])
            return out
        return np.matmul(x, w.wt)

    def linear_experts(self, w: DenseExperts, x: np.ndarray, expert_ids: np.ndarray) -> np.ndarray:
        n, k = expert_ids.shape
        out = np.empty((n * k, w.n_out), dtype=np.float32)
        flat = expert_ids.reshape(-1)
        mats = self.experts.matrices(w, expert_ids)  # the resident experts, or this window's slots
        # x is one row per token (shared by its k experts) or one row per (token, expert)
        xin = x.reshape(n * k, -1) if x.ndim == 3 else np.repeat(x, k, axis=0)
        for e in np.unique(flat):  # one matmul per expert used in this window
            sel = np.nonzero(flat == e)[0]
            if len(sel) <= self.ROWWISE_MAX:
                m = mats[e]
                for r in sel:
                    out[r] = xin[r] @ m
            else:
                out[sel] = np.matmul(xin[sel], mats[e])
        return out.reshape(n, k, -1)

    def embed(self, table: np.ndarray, token_ids) -> np.ndarray:
        return table[np.asarray(token_ids, dtype=np.int64)]
