"""Sampling on the device (sample.cu): the token strata.sampling draws on the host from the
same uniform, one thread block per logits row, so a sampled decode step copies one id per row
to the host instead of a row of floats (and no host code walks the vocabulary).

    sample_rows(logits, params) -> int64 ids (n,) on the device
        logits (n, V) float32 on the device; params (n, 5) float64 on the host, one
        strata.sampling.sampler_row per row: temperature, top_k, top_p, min_p, u (greedy rows:
        temperature 0 -> argmax)
    top_rows(logits) -> (int64 ids (n,), float32 top probabilities (n,)) on the device
        each row's first argmax and its softmax probability 1 / sum(exp(z - max)): greedy
        tokens and a draft's confidence in one launch (CuPy's reductions are slow on a few
        long rows)
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

THREADS = 1024  # sample.cu SAMPLE_THREADS


@functools.cache
def _kernel(name: str = "sample_rows"):
    return _module().get_function(name)


_SOURCE = Path(__file__).with_name("sample.cu")
OPTIONS = ("-std=c++17",)


@functools.cache
def _module():
    import cupy as cp

    return cp.RawModule(code=_SOURCE.read_text(), options=OPTIONS)


def sample_rows(logits, params: np.ndarray):
    import cupy as cp

    n, V = (int(s) for s in logits.shape)
    if logits.dtype != cp.float32 or params.shape != (n, 5):
        raise ValueError("sample_rows: float32 (n, V) logits and (n, 5) params")
    logits = cp.ascontiguousarray(logits)
    out = cp.empty(n, dtype=cp.int64)
    if n:
        _kernel()((n,), (THREADS,), (logits, np.int32(V), cp.asarray(np.ascontiguousarray(params, np.float64)), out))
    return out


def top_rows(logits):
    import cupy as cp

    if logits.dtype != cp.float32 or logits.ndim != 2:
        raise ValueError("top_rows: float32 (n, V) logits")
    logits = cp.ascontiguousarray(logits)
    n, V = (int(s) for s in logits.shape)
    ids = cp.empty(n, dtype=cp.int64)
    top = cp.empty(n, dtype=cp.float32)
    if n and V:
        _kernel("top_rows")((n,), (THREADS,), (logits, np.int32(V), ids, top))
    return ids, top
