"""Fused element-wise and attention kernels (fused.cu) for the CUDA backend, through CuPy.

Each function computes exactly what the generic array code of strata.backend.base.Backend
computes, in one launch; it returns None for a layout it does not handle (the caller then
takes the generic path). rope and swiglu give the same bits as the generic CuPy code; rms_norm
and attention differ only in summation order (float rounding).

    rms_norm(x, w, eps) -> y            x (..., n) float32
    rope(x, positions, base, dim, scale, neox) -> y   x (t, heads, head_dim)
    swiglu(gate, up) -> y               (rows, cols) views with contiguous rows, or any contiguous shape
    attention(q, k, v, q_positions) -> (t, n_head * d)
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from strata.kernels.cuda.launch import launch

_SOURCE = Path(__file__).with_name("fused.cu")
_THREADS = 256
ATTN_THREADS = 256
# scores live in shared memory: keep (L + 32 + threads) floats under the 48 KB default
ATTN_MAX_KEYS = 48 * 1024 // 4 - 32 - ATTN_THREADS


def _cp():
    import cupy

    return cupy


# no --use_fast_math: IEEE division/exp/sqrt keep the results next to the generic path's
OPTIONS = ("-std=c++17",)


def module_source() -> tuple[str, list[str]]:
    """The module's code and its template instances (also compiled for older GPUs by
    tests/test_cuda_archs.py). Every kernel waits for the kernels before (wait_prior_grids)
    before it reads their output, then lets the next start (allow_dependents): pdl.cuh, fused.cu."""
    pdl = _SOURCE.with_name("pdl.cuh").read_text()
    return pdl + _SOURCE.read_text(), [_add_norm_name(p) for p in ADD_NORM_PER]


@functools.cache
def _module():
    code, names = module_source()
    return _cp().RawModule(code=code, options=OPTIONS, name_expressions=names)


@functools.cache
def _fn(name: str):
    """Kernel `name`, called as a CuPy kernel is; launched with PDL while a graph is captured."""
    kernel = _module().get_function(name)
    return lambda grid, block, args, shared_mem=0: launch(kernel, grid, block, args, shared_mem)


def _blocks(total: int) -> tuple[int]:
    return ((total + _THREADS - 1) // _THREADS,)


def _f32_contiguous(a):
    cp = _cp()
    return cp.ascontiguousarray(a, dtype=cp.float32)


def rms_norm(x, w, eps: float):
    cp = _cp()
    n = int(x.shape[-1])
    if x.dtype != cp.float32 or w.dtype != cp.float32 or w.size != n or n == 0:
        return None
    x = cp.ascontiguousarray(x)
    w = cp.ascontiguousarray(w)
    y = cp.empty(x.shape, dtype=cp.float32)
    rows = x.size // n
    if rows:
        threads = 32 if n <= 128 else (128 if n <= 2048 else 256)
        _fn("rms_norm_f32")((rows,), (threads,), (x, w, y, np.int32(n), np.float32(eps)))
    return y


def _positions(positions, n: int):
    cp = _cp()
    p = cp.ascontiguousarray(cp.asarray(positions, dtype=cp.int64))
    return p if p.shape == (n,) else None


def rope(x, positions, *, base: float, dim: int, scale: float, neox: bool):
    cp = _cp()
    if x.ndim != 3 or x.dtype != cp.float32 or dim % 2 or dim > x.shape[2]:
        return None
    t, heads, hd = (int(s) for s in x.shape)
    if x.strides[2] != 4:
        x = cp.ascontiguousarray(x)
    pos = _positions(positions, t)
    if pos is None:
        return None
    y = cp.empty((t, heads, hd), dtype=cp.float32)
    total = t * heads * hd
    if total:
        _fn("rope_f32")(_blocks(total), (_THREADS,), (
            x, y, pos, np.int32(t), np.int32(heads), np.int32(hd), np.int32(dim),
            np.int64(x.strides[0] // 4), np.int64(x.strides[1] // 4),
            np.float64(base), np.float64(scale), np.int32(bool(neox))))
    return y


def _rows_view(a):
    """(rows, cols, row stride in elements) of a float32 array whose last axis is contiguous:
    a 2-D view with any row stride, or a contiguous array of any rank."""
    cp = _cp()
    if a.dtype != cp.float32 or a.ndim == 0 or a.strides[-1] != 4:
        return None
    cols = int(a.shape[-1])
    if a.ndim == 2:
        return a, int(a.shape[0]), cols, int(a.strides[0] // 4)
    if a.flags.c_contiguous:
        return a, a.size // max(cols, 1), cols, cols
    return None


def swiglu(gate, up):
    cp = _cp()
    if gate.shape != up.shape:
        return None
    g, u = _rows_view(gate), _rows_view(up)
    if g is None or u is None:
        return None
    (ga, rows, cols, gs), (ua, _, _, us) = g, u
    y = cp.empty(gate.shape, dtype=cp.float32)
    if rows * cols:
        _fn("swiglu_f32")(_blocks(rows * cols), (_THREADS,), (
            ga, ua, y, np.int32(rows), np.int32(cols), np.int64(gs), np.int64(us)))
    return y


def attention(q, k, v, q_positions):
    cp = _cp()
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        return None
    t, n_head, d = (int(s) for s in q.shape)
    n_kv, L, dk = (int(s) for s in k.shape)
    if dk != d or n_kv == 0 or n_head % n_kv or L == 0 or L > ATTN_MAX_KEYS or t == 0:
        return None
    q, k, v = _f32_contiguous(q), _f32_contiguous(k), _f32_contiguous(v)
    pos = _positions(q_positions, t)
    if pos is None:
        return None
    out = cp.empty((t, n_head * d), dtype=cp.float32)
    smem = (L + 32 + ATTN_THREADS) * 4
    _fn("attention_f32")((n_head, t), (ATTN_THREADS,), (
        q, k, v, pos, out, np.int32(n_head), np.int32(n_kv), np.int32(L), np.int32(d),
        np.float32(1.0 / float(d) ** 0.5)), shared_mem=smem)
    return out


# ---------------------------------------------------------------- decode-window kernels
# (fused.cu's second half: graph-capturable, everything per window read from the window table)
KV_MAX_HEAD_DIM = 256
KV_HEAD_DIM_STEP = 8  # attention_kv loads 8 cache elements at once: head_dim % 8 == 0
ATT_CHUNK = 256  # keys per thread block per step of attention_kv (fused.cu ATT_CHUNK)
ATT_THREADS = 256  # fused.cu ATT_THREADS
ROPE_WARPS = 4  # fused.cu ROPE_WARPS


ADD_NORM_PER = (1, 2, 4, 8, 16)  # values per thread of the add_rms_norm_q8 instances (fused.cu)
ADD_NORM_MAX_N = ADD_NORM_PER[-1] * 1024  # at most 1024 threads


def _add_norm_name(per: int) -> str:
    return f"add_rms_norm_q8<{per}>"


def add_rms_norm_q8(x, y, w, eps: float, q8=None):
    """(x + y, rms_norm(x + y) * w), and the normed rows quantized into `q8` (an
    mmvq.Q8Buffer of (rows, n)) when given. x, y contiguous float32 (rows, n); y may be None.
    Returns (x_out, h); x_out is x itself when y is None. None for rows longer than
    ADD_NORM_MAX_N (the kernel holds a row in registers)."""
    cp = _cp()
    n = int(x.shape[-1])
    if n > ADD_NORM_MAX_N:
        return None
    rows = x.size // max(n, 1)
    x_out = x if y is None else cp.empty(x.shape, dtype=cp.float32)
    h = cp.empty(x.shape, dtype=cp.float32)
    if rows:
        threads = min(1024, -(-n // 32) * 32)  # a warp per 32 values: short serial chains
        qargs = (q8.q, q8.meta, q8.s) if q8 is not None else (np.uint64(0),) * 3
        per = next(p for p in ADD_NORM_PER if p * threads >= n)
        _fn(_add_norm_name(per))((rows,), (threads,), (
            x, y if y is not None else np.uint64(0), w, x_out, h, np.int32(n), np.float32(eps)) + qargs)
    return x_out, h


def swiglu_q8(gate, up, q8):
    """swiglu(gate, up) and its Q8_1 blocks into q8 (cols a multiple of 32). Same layouts as
    swiglu(); None when it does not take them."""
    cp = _cp()
    if gate.shape != up.shape:
        return None
    g, u = _rows_view(gate), _rows_view(up)
    if g is None or u is None or g[2] % 32:
        return None
    (ga, rows, cols, gs), (ua, _, _, us) = g, u
    y = cp.empty(gate.shape, dtype=cp.float32)
    blocks = rows * cols // 32
    if blocks:
        _fn("swiglu_q8")(((blocks * 32 + _THREADS - 1) // _THREADS,), (_THREADS,), (
            ga, ua, y, np.int32(rows), np.int32(cols), np.int64(gs), np.int64(us), q8.q, q8.meta, q8.s))
    return y


def _strides(a):
    """(array, token stride, head stride) in elements of a float32 (t, heads, d) view whose
    last axis is contiguous."""
    cp = _cp()
    if a.dtype != cp.float32 or a.ndim != 3 or a.strides[2] != 4:
        a = cp.ascontiguousarray(a, dtype=cp.float32)
    return a, np.int64(a.strides[0] // 4), np.int64(a.strides[1] // 4)


def rope_kv_write(q, k, v, win, layer: int, int8_cache: bool, *, base: float, dim: int, scale: float, neox: bool,
                  q_norm=None, k_norm=None, eps: float = 0.0):
    """RoPE of q and k (after per-head RMSNorm with q_norm / k_norm (d,) when given); k and v
    appended to the caches the window table names (layer `layer`). q (n, n_head, d), k and v
    (n, n_kv, d) float32 views. -> rotated q contiguous."""
    cp = _cp()
    n, n_head, d = (int(s) for s in q.shape)
    n_kv = int(k.shape[1])
    qa, qt, qh = _strides(q)
    ka, kt, kh = _strides(k)
    va, vt, vh = _strides(v)
    out = cp.empty((n, n_head, d), dtype=cp.float32)
    heads = n_head + 2 * n_kv  # one warp per head row, ROPE_WARPS per block
    _fn("rope_kv_write")((n, -(-heads // ROPE_WARPS)), (32 * ROPE_WARPS,), (
        qa, qt, qh, ka, kt, kh, va, vt, vh, out, win, np.int32(n), np.int32(n_head), np.int32(n_kv),
        np.int32(d), np.int32(layer), np.int32(bool(int8_cache)), np.int32(dim), np.float64(base),
        np.float64(scale), np.int32(bool(neox)),
        q_norm if q_norm is not None else np.uint64(0), k_norm if k_norm is not None else np.uint64(0),
        np.float32(eps)))
    return out


ATT_GQA_MAX = 8  # query heads one block of the *_gqa kernels may take (fused.cu ATT_GQA_MAX)


def heads_per_block(n_head: int, n_kv: int) -> int:
    """Query heads of one KV group that one attention block takes with gqa=True: the largest
    divisor of the group size up to ATT_GQA_MAX."""
    g = n_head // n_kv
    return max(h for h in range(1, min(g, ATT_GQA_MAX) + 1) if g % h == 0)


def attention_kv(q, win, layer: int, n_kv: int, int8_cache: bool, splits: int, q8=None, counters=None,
                 gqa: bool = False, out=None):
    """Attention of the window's rotated queries q (n, n_head, d) contiguous over their spans'
    caches, key chunks spread over `splits` thread blocks per (head, token). -> (n, n_head * d).
    q8: an mmvq.Q8Buffer (n, n_head * d) to receive the output's Q8_1 blocks too (d % 32 == 0).
    counters: zeroed int32 device scratch of at least n * n_head entries (left zeroed): the
    last split block of each (token, head) merges the partials itself; without it (or when too
    small) a second launch, attention_kv_merge, does. gqa: one block takes several query heads
    of a KV group (heads_per_block), sharing the K/V loads: the same bits, less cache traffic
    (prefill windows). out: a float32 (n, n_head * d) C-contiguous array to write into (else new)."""
    cp = _cp()
    n, n_head, d = (int(s) for s in q.shape)
    hpb = heads_per_block(n_head, n_kv) if gqa else 1
    if out is None:
        out = cp.empty((n, n_head * d), dtype=cp.float32)
    part = cp.empty((n, n_head, splits, d + 2), dtype=cp.float32) if splits > 1 else out
    qargs = (q8.q, q8.meta, q8.s) if q8 is not None and d % 32 == 0 else (np.uint64(0),) * 3
    fuse_merge = splits > 1 and counters is not None and counters.size >= n * n_head
    args = (q, win, np.int32(n), np.int32(n_head), np.int32(n_kv), np.int32(d), np.int32(layer),
            np.float32(1.0 / float(d) ** 0.5), out, part, counters if fuse_merge else np.uint64(0))
    kernel = _fn(("attention_kv_gqa" if hpb > 1 else "attention_kv") + ("_i8" if int8_cache else "_f16"))
    kernel((n_head // hpb, n, splits), (ATT_THREADS,),
           args + (qargs if splits == 1 or fuse_merge else (np.uint64(0),) * 3) + (np.int32(hpb),))
    if splits > 1 and not fuse_merge:
        _fn("attention_kv_merge")((n_head, n), (128,), (part, np.int32(n_head), np.int32(d), np.int32(splits), out) + qargs)
    return out


def moe_route(logits, k: int, normalize: bool):
    """logits (n, n_expert) float32 contiguous -> ids (n, k) int32, weights (n, k) float32."""
    cp = _cp()
    n, n_expert = (int(s) for s in logits.shape)
    if logits.dtype != cp.float32 or n_expert > 1024 or not 0 < k <= min(32, n_expert):
        return None
    logits = cp.ascontiguousarray(logits)
    ids = cp.empty((n, k), dtype=cp.int32)
    w = cp.empty((n, k), dtype=cp.float32)
    if n:
        _fn("moe_route")((n,), (32,), (logits, np.int32(n_expert), np.int32(k), np.int32(bool(normalize)), ids, w))
    return ids, w


def moe_combine(d, w):
    """d (n, k, e) float32, w (n, k) float32 -> (n, e): sum over k of d * w."""
    cp = _cp()
    if d.dtype != cp.float32 or w.dtype != cp.float32 or d.ndim != 3:
        return None
    n, k, e = (int(s) for s in d.shape)
    d, w = cp.ascontiguousarray(d), cp.ascontiguousarray(w)
    y = cp.empty((n, e), dtype=cp.float32)
    if n * e:
        _fn("moe_combine")(_blocks(n * e), (_THREADS,), (d, w, np.int32(n), np.int32(k), np.int32(e), y))
    return y
