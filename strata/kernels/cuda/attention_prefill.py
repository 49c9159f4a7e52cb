"""Causal attention of a long prompt's rows on f16 tensor cores (attention_prefill.cu).

    attention_prefill(q, cache, layer, p0, out) -> out
    attention_prefill_window(q, win, n, span, layer, cache, p0, out) -> out  # p0, cache from the window table

q (m, n_head, d) float32 contiguous: one sequence's rows at positions p0 .. p0 + m - 1, rotated
and already written to `cache` (a strata.model.kv_cache.KVCache on the device, f16 or int8).
out (m, n_head * d) float32, C-contiguous (a row slice of a window's output): receives the
attention of each row over keys 0 .. its position. supported(d) says which head sizes have a
kernel (the others keep the decode kernel, fused.attention_kv).

Why a second kernel: fused.attention_kv takes one token per thread block and scores with fp32
FMAs, which suits decode (a few tokens over a long cache) and keeps every row's bits independent
of the window; for a 512-token prompt it spent ~1 ms per layer (dense-8b, 32 heads). Here a block
takes 64 (token, head) rows of one KV group and streams 64-key tiles through mma.sync, so each
K / V tile serves 64 rows. It rounds differently (f16 Q and P, fp32 accumulation), so the
backend uses it only for rows of long prompts (the same per-request rule as the prompt GEMM
path), never per window.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

_SOURCE = Path(__file__).with_name("attention_prefill.cu")
HEAD_DIMS = (64, 128)  # the instances compiled (registers: o and Q fragments grow with d)
ROWS_PER_BLOCK = 64  # (token, head) rows per thread block: attention_prefill.cu FA_ROWS
THREADS = 128  # FA_WARPS * 32


def supported(d: int) -> bool:
    return d in HEAD_DIMS


def _cp():
    import cupy

    return cupy


OPTIONS = ("-std=c++17",)


@functools.cache
def _module():
    return _cp().RawModule(code=_SOURCE.read_text(), options=OPTIONS)


@functools.cache
def _fn(name: str):
    return _module().get_function(name)


def _checked(q, cache, p0: int, out) -> tuple[int, int, int, int]:
    """(m, n_head, d, n_kv) of a call the kernels take; ValueError naming what they do not."""
    cp = _cp()
    m, n_head, d = (int(s) for s in q.shape)
    n_kv = int(cache.n_kv)
    if not supported(d) or d != cache.d or n_head % n_kv or q.dtype != cp.float32 or not q.flags.c_contiguous:
        raise ValueError(f"attention_prefill: unsupported q {q.shape} {q.dtype} for a cache of {n_kv} x {cache.d}")
    if out.shape != (m, n_head * d) or out.dtype != cp.float32 or not out.flags.c_contiguous:
        raise ValueError(f"attention_prefill: out must be float32 ({m}, {n_head * d}) contiguous")
    if p0 + m > cache._cap:
        raise ValueError(f"attention_prefill: rows up to position {p0 + m} past the cache's {cache._cap}")
    return m, n_head, d, n_kv


def _geometry(m: int, n_head: int, n_kv: int, d: int) -> tuple[tuple[int, int], np.float32]:
    rows = m * (n_head // n_kv)
    return (-(-rows // ROWS_PER_BLOCK), n_kv), np.float32(math.log2(math.e) / math.sqrt(d))


def attention_prefill(q, cache, layer: int, p0: int, out):
    m, n_head, d, n_kv = _checked(q, cache, p0, out)
    if m == 0:
        return out
    int8 = cache.kind == "int8"
    k, v = cache._k[layer], cache._v[layer]
    ks, vs = (cache._ks[layer], cache._vs[layer]) if int8 else (np.uint64(0), np.uint64(0))
    grid, qscale = _geometry(m, n_head, n_kv, d)
    _fn(f"attention_prefill_{'i8' if int8 else 'f16'}_{d}")(grid, (THREADS,), (
        q, out, k, v, ks, vs, np.int64(cache._cap), np.int64(p0), np.int32(m), np.int32(n_head), np.int32(n_kv), qscale))
    return out


def attention_prefill_window(q, win, n: int, span: int, layer: int, cache, p0: int, out):
    """attention_prefill for span `span` of the window table `win` (n tokens; fused.cu's
    layout): the kernel reads the span's first position and its cache's addresses from the
    table, so a captured graph replays for any start and cache. cache and p0 (the span's
    current ones) are only checked here, on the host."""
    m, n_head, d, n_kv = _checked(q, cache, p0, out)
    if m == 0:
        return out
    grid, qscale = _geometry(m, n_head, n_kv, d)
    _fn(f"attention_prefill_window_{'i8' if cache.kind == 'int8' else 'f16'}_{d}")(grid, (THREADS,), (
        q, out, win, np.int32(n), np.int32(span), np.int32(layer), np.int32(m), np.int32(n_head), np.int32(n_kv), qscale))
    return out
