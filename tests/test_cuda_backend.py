"""CUDA backend: the fused kernels (STRATA_CUDA_FUSED=1, the default) against the generic
array code (the same Backend with fused=False, i.e. base.Backend's ops with xp = cupy) and
against float64 numpy, on fresh random inputs each run; outputs land in memory poisoned with
NaN first (the kernels allocate their outputs from the pool that just held the poison), so an
unwritten element fails. Linear: merged q,k,v / gate,up weights and the shared Q8_1
activations against one launch per part. Skips cleanly without CuPy or a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

from tests.support.gpu import require_cuda  # noqa: E402

cp = require_cuda()

from strata.backend.cuda import CudaBackend  # noqa: E402
from strata.kernels.ggml_types import type_by_name  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
FUSED = CudaBackend(fused=True)
GENERIC = CudaBackend(fused=False)


def rel(a, b) -> float:
    a, b = np.asarray(cp.asnumpy(a), np.float64), np.asarray(cp.asnumpy(b), np.float64)
    assert a.shape == b.shape
    assert np.isfinite(a).all(), "non-finite output (unwritten element?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def poison(nbytes: int) -> None:
    """Fill pool memory with NaN and hand it back, so the next allocations start as NaN."""
    junk = cp.full(nbytes // 4 + 1024, np.nan, dtype=cp.float32)
    del junk


def rng_of(name: str):
    return np.random.default_rng([SEED, sum(map(ord, name))])


@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (3, 7, 64), (2, 3000)])
def test_rms_norm(shape):
    rng = rng_of(f"rms{shape}")
    x = cp.asarray(rng.standard_normal(shape).astype(np.float32) * 3)
    w = cp.asarray(rng.standard_normal(shape[-1]).astype(np.float32))
    poison(x.nbytes)
    y = FUSED.rms_norm(x, w, 1e-5)
    assert rel(y, GENERIC.rms_norm(x, w, 1e-5)) < 1e-6
    xh, wh = cp.asnumpy(x).astype(np.float64), cp.asnumpy(w).astype(np.float64)
    ref = xh / np.sqrt((xh * xh).mean(-1, keepdims=True) + 1e-5) * wh
    assert rel(y, ref) < 1e-6


def test_rms_norm_strided_input():
    rng = rng_of("rms-strided")
    big = cp.asarray(rng.standard_normal((4, 1152)).astype(np.float32))
    x = big[:, 576:]  # a column slice: rows not contiguous
    w = cp.asarray(rng.standard_normal(576).astype(np.float32))
    assert rel(FUSED.rms_norm(x, w, 1e-6), GENERIC.rms_norm(x, w, 1e-6)) < 1e-6


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("dim", [64, 32])
@pytest.mark.parametrize("t", [1, 5])
def test_rope(neox, dim, t):
    rng = rng_of(f"rope{neox}{dim}{t}")
    heads, hd = 9, 64
    qkv = cp.asarray(rng.standard_normal((t, (heads + 6) * hd)).astype(np.float32))
    x = qkv[:, : heads * hd].reshape(t, heads, hd)  # a view with the fused qkv's row stride
    pos = cp.asarray(rng.integers(0, 20000, size=t).astype(np.int64))
    kw = dict(base=10000.0, dim=dim, scale=1.0 if t == 1 else 4.0, neox=neox)
    poison(x.nbytes)
    y = FUSED.rope(x, pos, **kw)
    g = GENERIC.rope(x, pos, **kw)
    assert rel(y, g) < 1e-6
    # float64 reference
    xh, ph = cp.asnumpy(x).astype(np.float64), cp.asnumpy(pos).astype(np.float64)
    half = dim // 2
    ang = (ph[:, None] / kw["scale"]) * 10000.0 ** (-np.arange(half) * 2.0 / dim)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    ref = xh.copy()
    ia, ib = (np.arange(half), np.arange(half) + half) if neox else (np.arange(0, dim, 2), np.arange(1, dim, 2))
    a, b = xh[..., ia], xh[..., ib]
    ref[..., ia], ref[..., ib] = a * c - b * s, a * s + b * c
    assert rel(y, ref) < 1e-6


@pytest.mark.parametrize("n", [1, 4])
def test_swiglu_views_of_one_output(n):
    rng = rng_of(f"swiglu{n}")
    F = 1536
    gu = cp.asarray(rng.standard_normal((n, 2 * F)).astype(np.float32) * 4)
    gate, up = gu[:, :F], gu[:, F:]
    poison(gate.nbytes)
    y = FUSED.swiglu(gate, up)
    assert rel(y, GENERIC.swiglu(gate, up)) < 1e-7
    g, u = cp.asnumpy(gate).astype(np.float64), cp.asnumpy(up).astype(np.float64)
    assert rel(y, g / (1 + np.exp(-g)) * u) < 1e-6


def test_swiglu_experts_shape():
    rng = rng_of("swiglu3")
    g = cp.asarray(rng.standard_normal((3, 2, 256)).astype(np.float32))
    u = cp.asarray(rng.standard_normal((3, 2, 256)).astype(np.float32))
    assert rel(FUSED.swiglu(g, u), GENERIC.swiglu(g, u)) < 1e-7


def attention_ref(q, k, v, qpos):
    q, k, v = (np.asarray(cp.asnumpy(a), np.float64) for a in (q, k, v))
    t, H, d = q.shape
    n_kv, L, _ = k.shape
    out = np.zeros((t, H, d))
    for ti in range(t):
        for h in range(H):
            kv = h // (H // n_kv)
            s = k[kv] @ q[ti, h] / np.sqrt(d)
            s[np.arange(L) > int(qpos[ti])] = -np.inf
            p = np.exp(s - s.max())
            out[ti, h] = (p / p.sum()) @ v[kv]
    return out.reshape(t, H * d)


@pytest.mark.parametrize("t,H,n_kv,d,L", [(1, 9, 3, 64, 37), (4, 9, 3, 64, 40), (3, 8, 8, 128, 300),
                                          (2, 4, 2, 80, 17), (1, 2, 1, 256, 1000), (1, 4, 4, 32, 1)])
def test_attention(t, H, n_kv, d, L):
    rng = rng_of(f"attn{t}{H}{n_kv}{d}{L}")
    q = cp.asarray(rng.standard_normal((t, H, d)).astype(np.float32))
    k = cp.asarray(rng.standard_normal((n_kv, L, d)).astype(np.float32))
    v = cp.asarray(rng.standard_normal((n_kv, L, d)).astype(np.float32))
    qpos = cp.asarray(np.arange(L - t, L, dtype=np.int64))  # the window's last t positions: causal mask
    poison(t * H * d * 4)
    y = FUSED.attention(q, k, v, qpos)
    assert rel(y, GENERIC.attention(q, k, v, qpos)) < 1e-5
    assert rel(y, attention_ref(q, k, v, cp.asnumpy(qpos))) < 1e-5


@dataclass
class Source:
    name: str
    ggml_type: int
    shape: tuple
    raw: np.ndarray

    def data(self):
        return self.raw.reshape(-1)


def sources(types_rows, k, rng):
    out = []
    for i, (tname, rows) in enumerate(types_rows):
        tid = type_by_name(tname).id
        out.append(Source(f"w{i}", tid, (k, rows), random_blocks(tid, rows, k, rng)))
    return out


@pytest.mark.parametrize("parts", [
    (("Q4_0", 576), ("Q4_0", 192), ("Q4_0", 192)),  # q, k, v: one merged weight
    (("Q2_0", 1536), ("IQ4_NL", 1536)),  # gate, up of two types: two launches, one quantization
    (("Q8_0", 64), ("Q8_0", 32), ("Q4_K", 48), ("F32", 16)),  # a merged run, then others
])
@pytest.mark.parametrize("n", [1, 3, 11, 37])
def test_linear_merged_parts(parts, n):
    rng = rng_of(f"lin{parts}{n}")
    k = 576 if parts[0][0] != "Q8_0" else 512
    srcs = sources(parts, k, rng)
    wf, wg = FUSED.linear_weight(srcs), GENERIC.linear_weight(srcs)
    assert wf.rows == sum(r for _, r in parts)
    x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
    poison(n * wf.rows * 4)
    y = FUSED.linear(wf, x)
    assert y.shape == (n, wf.rows)
    # same Q8_1 activations and per-row dot products: equal up to float rounding
    assert rel(y, GENERIC.linear(wg, x)) < 1e-6
