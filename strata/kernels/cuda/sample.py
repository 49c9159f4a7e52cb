"""Sampling on the device (sample.cu): the token strata.sampling draws on the host from the
same uniform, one thread block per logits row, so a sampled decode step copies one id per row
to the host instead of a row of floats (and no host code walks the vocabulary).

    sample_rows(logits, params) -> int64 ids (n,) on the device
        logits (n, V) float32 on the device; params (n, 5) float64 on the host, one
        strata.sampling.sampler_row per row: temperature, top_k, top_p, min_p, u (greedy rows:
        temperature 0 -> argmax)
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

THREADS = 1024  # sample.cu SAMPLE_THREADS


@functools.cache
def _kernel():
    import cupy as cp

    src = Path(__file__).with_name("sample.cu").read_text()
    return cp.RawModule(code=src, options=("-std=c++17",)).get_function("sample_rows")


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
