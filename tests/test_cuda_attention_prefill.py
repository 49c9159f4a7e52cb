"""The long-prompt attention kernel (strata/kernels/cuda/attention_prefill.cu) against a float64
numpy recomputation from the cache's own contents, on a GPU.

Fresh random queries and keys each run, f16 and int8 caches, head sizes 64 and 128, GQA groups
of 1, 3, 4 and 8 query heads, spans starting at 0 and past earlier context, row counts that
leave partial 64-row blocks and 64-key tiles. The output is poisoned with NaN first. Bound: the
kernel rounds Q and the softmax weights to f16 (fp32 accumulation), so ||gpu - ref|| / ||ref||
< 4e-3 (f16 carries 11 bits: ~5e-4 per rounding, averaged over hundreds of keys).
Skips cleanly without CuPy or a device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support.gpu import require_cuda

cp = require_cuda()

from strata.kernels.cuda import attention_prefill as fa  # noqa: E402
from strata.model.kv_cache import KVCache  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
REL_BOUND = 4e-3


def _reference(q, k, v, p0):
    """q (m, H, d); k, v (n_kv, L, d) float64 -> (m, H * d): row t sees keys 0 .. p0 + t."""
    m, n_head, d = q.shape
    n_kv = k.shape[0]
    out = np.empty((m, n_head, d))
    for t in range(m):
        end = p0 + t + 1
        for h in range(n_head):
            kv = h // (n_head // n_kv)
            s = k[kv, :end] @ q[t, h] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[kv, :end]
    return out.reshape(m, n_head * d)


@pytest.mark.parametrize("kind", ["f16", "int8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_head,n_kv,p0,m", [(8, 8, 0, 70), (9, 3, 37, 130), (32, 8, 0, 300), (16, 2, 200, 65),
                                               (4, 4, 5, 1)])
def test_matches_float64_attention(kind, d, n_head, n_kv, p0, m):
    rng = np.random.default_rng([SEED, d, n_head, p0, m, kind == "int8"])
    cache = KVCache(cp, 1, n_kv, d, 4096, kind)
    total = p0 + m
    k = rng.standard_normal((total, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((total, n_kv, d)).astype(np.float32)
    k[:, :, rng.integers(0, d, 3)] *= 6.0  # a few large channels, as rotated keys have
    cache.write(0, 0, cp.asarray(k), cp.asarray(v))
    q = (rng.standard_normal((m, n_head, d)) * 1.5).astype(np.float32)
    out = cp.full((m, n_head * d), cp.nan, dtype=cp.float32)
    fa.attention_prefill(cp.asarray(q), cache, 0, p0, out)
    got = cp.asnumpy(out)
    kr, vr = (cp.asnumpy(a).astype(np.float64) for a in cache.read(0, total))
    ref = _reference(q.astype(np.float64), kr, vr, p0)
    assert np.isfinite(got).all(), f"unwritten or non-finite outputs (seed {SEED})"
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < REL_BOUND, f"relative error {rel:.3g} (seed {SEED})"


def test_rejects_what_it_has_no_kernel_for():
    cache = KVCache(cp, 1, 2, 96, 64, "f16")
    assert not fa.supported(96)
    with pytest.raises(ValueError, match="unsupported"):
        fa.attention_prefill(cp.zeros((4, 4, 96), dtype=cp.float32), cache, 0, 0, cp.zeros((4, 384), dtype=cp.float32))


@pytest.mark.parametrize("kind", ["f16", "int8"])
@pytest.mark.parametrize("d", [64, 128])
def test_window_form_reads_start_and_cache_from_the_table(kind, d):
    """attention_prefill_window (what a graphed prompt window launches) takes the span's start
    and its cache's addresses from the window table: the same bits as the direct form, for a
    span that is not the window's first, on the cache's second layer."""
    from strata.backend.cuda import CudaBackend
    from strata.model.transformer import Span

    rng = np.random.default_rng([SEED, d, kind == "int8", 1])
    n_head, n_kv, p0, m = 8, 2, 45, 140
    other, cache = (KVCache(cp, 2, n_kv, d, 1024, kind) for _ in range(2))
    for c, total in ((other, 5), (cache, p0 + m)):
        for layer in range(2):
            k = rng.standard_normal((total, n_kv, d)).astype(np.float32)
            v = rng.standard_normal((total, n_kv, d)).astype(np.float32)
            c.write(layer, 0, cp.asarray(k), cp.asarray(v))
    spans = [Span(other, 3, 2), Span(cache, p0, m)]
    win = cp.asarray(CudaBackend(fused=True).window_table(spans))
    q = cp.asarray((rng.standard_normal((m, n_head, d)) * 1.5).astype(np.float32))
    direct = cp.full((m, n_head * d), cp.nan, dtype=cp.float32)
    windowed = cp.full((m, n_head * d), cp.nan, dtype=cp.float32)
    fa.attention_prefill(q, cache, 1, p0, direct)
    fa.attention_prefill_window(q, win, 2 + m, 1, 1, cache, p0, windowed)
    assert np.isfinite(cp.asnumpy(direct)).all()
    assert np.array_equal(cp.asnumpy(direct), cp.asnumpy(windowed)), f"seed {SEED}"
