"""Gated DeltaNet kernels (delta_net.cu) over a whole window: every sequence's conv and delta
rule in one launch each, in place in the recurrent pool (strata/model/recurrent_state.py), each
sequence's copies and replay row named by its row of the window table (delta_net.cu: copy read,
copy written, first row, count, replay row).

    conv_window(x, w, pool_conv, layer, table) -> silu(conv) rows (n, C)
    keep_rows(proj, pool_replay, layer, table): the rows a cut inside the window replays
    delta_window(y, proj, p, pool_state, layer, table, out) -> out (n, H*S) or None
        p: strata.model.hybrid.layers.DeltaNet (its device constants); out None: the state only
        (a replay of kept rows)
supported(S, K) says whether a head size and conv length have a kernel (else the backend's
generic ops run).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

HEAD_SIZES = (32, 64, 128, 256)
MAX_CONV = 8
CONV_THREADS = 256
_SOURCE = Path(__file__).with_name("delta_net.cu")
OPTIONS = ("-std=c++17",)


def supported(head: int, conv: int) -> bool:
    return head in HEAD_SIZES and 2 <= conv <= MAX_CONV


@functools.cache
def _module():
    import cupy as cp

    return cp.RawModule(code=_SOURCE.read_text(), options=OPTIONS)


def conv_window(x, w, pool, layer: int, table, n_spans: int):
    import cupy as cp

    n, C = int(x.shape[0]), int(w.shape[0])
    K = int(w.shape[1])
    if x.strides[1] != 4:
        x = cp.ascontiguousarray(x)
    y = cp.empty((n, C), dtype=cp.float32)
    grid = ((C + CONV_THREADS - 1) // CONV_THREADS, n_spans)
    _module().get_function("causal_conv")(
        grid, (CONV_THREADS,),
        (x, np.int64(x.strides[0] // 4), w, np.int32(C), np.int32(K), pool, np.int64(pool.shape[1]),
         np.int32(layer), table, y))
    return y


def keep_rows(proj, replay, layer: int, table, n_spans: int):
    """Copy each short sequence's rows of proj into the pool's replay rows (delta_net.cu)."""
    import cupy as cp

    W = int(replay.shape[3])
    R = int(replay.shape[2])
    if proj.strides[1] != 4:
        proj = cp.ascontiguousarray(proj)
    grid = ((W + CONV_THREADS - 1) // CONV_THREADS, n_spans, R)
    _module().get_function("keep_rows")(
        grid, (CONV_THREADS,),
        (proj, np.int64(proj.strides[0] // 4), np.int32(W), replay, np.int64(replay.shape[1]), np.int32(R),
         np.int32(layer), table))


def delta_window(y, proj, p, pool, layer: int, table, n_spans: int, eps: float, write_out: bool):
    import cupy as cp

    h = p.h
    S, H = h.d_state, h.n_v_heads
    n = int(y.shape[0])
    out = cp.empty((n, H * S), dtype=cp.float32) if write_out else None
    proj = proj if proj.strides[1] == 4 else cp.ascontiguousarray(proj)
    _module().get_function(f"gated_delta_{S}")(
        (H, n_spans), (S,),
        (y, np.int32(h.conv_dim), np.int32(h.key_dim), proj, np.int64(proj.strides[0] // 4),
         p.beta_cols, p.alpha_cols, p.dt_bias, p.a, p.key_head, p.norm, np.float32(eps),
         pool, np.int64(pool.shape[1]), np.int32(layer), np.int32(H), table,
         out if out is not None else np.uint64(0)))
    return out
