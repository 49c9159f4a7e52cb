"""The numpy backend.

Quantized weights are dequantized once, at load, into float32 matrices that BLAS reads:
on a 2-core CPU the mat-vec is bound by memory bandwidth either way, and BLAS over float32
beats any numpy re-implementation of blockwise integer dots by a wide margin. The numpy
mirrors of the native MMVQ kernels (strata.kernels.mmvq_numpy) compute what the CUDA
kernels compute and are used to test them, not for speed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, TensorSource
from strata.backend.cpu_experts import CpuExpertStore, DenseExperts  # noqa: F401  (DenseExperts: bench_cpu reads it here)
from strata.errors import StrataError
from strata.host_memory import available_host_bytes
from strata.kernels.dequant import dequantize


@dataclass
class DenseWeight:
    # Stored transposed, (in, out) C-contiguous: OpenBLAS's mat-vec streams this layout at
    # ~1.75x the bandwidth of the (out, in) one (23.8 vs 13.6 GB/s measured, one thread).
    wt: np.ndarray
    names: tuple[str, ...]
    type_ids: tuple[int, ...]


# Rows copied per step when a weight is transposed: a block of rows (and its columns of the
# result) stays in cache, where numpy's one-pass transposed copy strides through all of memory
# (the 49152 x 576 head: 135 vs 392 ms; the model loads ~0.5 s sooner).
TRANSPOSE_ROWS = 128


def transposed(mats: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """The rows of mats stacked, transposed, as one C-contiguous float32 array (in, sum of outs),
    written into `out` when given."""
    n_in = mats[0].shape[1]
    if out is None:
        out = np.empty((n_in, sum(m.shape[0] for m in mats)), np.float32)
    col = 0
    for m in mats:
        for r in range(0, m.shape[0], TRANSPOSE_ROWS):
            block = m[r : r + TRANSPOSE_ROWS]
            out[:, col + r : col + r + block.shape[0]] = block.T
        col += m.shape[0]
    return out


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


def dequantize_source(src: TensorSource) -> np.ndarray:
    """Dequantize a tensor to float32 shaped numpy-style (reverse of ggml's ne order)."""
    n = int(np.prod(src.shape))
    flat = dequantize(src.ggml_type, src.data(), n)
    return flat.reshape(tuple(reversed(src.shape)))


class CpuBackend(Backend):
    name = "cpu"
    xp = np
    expert_pool = "emulated"  # cpu_experts.py: the pool runs the cache's logic; it saves no memory

    def __init__(self, threads: int | None = None) -> None:
        self._cache: dict[str, np.ndarray] = {}
        self.experts = CpuExpertStore()  # host copies of the experts, and the slot pool when one is planned
        # decided once, at start-up, and said in start_line (default_threads: the free cores)
        self._threads, self._threads_why = choose_threads(threads)
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

    def free_bytes(self) -> int | None:
        return available_host_bytes()

    def linear_weight(self, sources: Sequence[TensorSource]) -> DenseWeight:
        mats = [self._dense(s) for s in sources]
        wt = transposed(mats)
        for s in sources:  # the transposed copy is what we keep; the embedding stays for lookups
            if not s.name.startswith("token_embd"):
                self._cache.pop(s.name, None)
        return DenseWeight(wt, tuple(s.name for s in sources), tuple(s.ggml_type for s in sources))

    # The draft's head over its vocabulary only: the 49k-row head is ~20% of a step here, and a
    # verification window runs it once per drafted token.
    def head_columns(self, w: DenseWeight, ids: np.ndarray) -> DenseWeight:
        return DenseWeight(np.ascontiguousarray(w.wt[:, ids]), w.names, w.type_ids)

    def expert_weight(self, source: TensorSource) -> DenseExperts:
        w = dequantize_source(source)  # (n_expert, out, in)
        wt = np.empty((w.shape[0], w.shape[2], w.shape[1]), np.float32)
        for e in range(w.shape[0]):
            transposed([w[e]], out=wt[e])
        return self.experts.add(wt, source.name, source.ggml_type)

    def expert_bytes(self, ggml_type: int, shape: tuple[int, ...]) -> int:
        return int(shape[0]) * int(shape[1]) * 4  # float32, dequantized at load

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
        return np.ascontiguousarray(dequantize_source(source).reshape(-1), dtype=np.float32)

    def embedding(self, source: TensorSource) -> np.ndarray:
        return self._dense(source)

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
        out = np.empty((n * k, w.wt.shape[2]), dtype=np.float32)
        flat = expert_ids.reshape(-1)
        mats = self.experts.matrices(w, expert_ids)  # the host copies, or this window's slots
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
