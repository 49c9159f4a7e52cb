"""The numpy MMVQ mirrors against float64 references, on fresh random valid blocks.

Bounds (stated, per output element, normalized by the sum of absolute terms so cancellation
cannot hide an error):
  * vs dequant(W) @ dequant(quant(x)) in float64: |err| <= 1e-5 * (|W| @ |xq|)  (float32 rounding
    of the group sums only: the integer dots are exact);
  * vs dequant(W) @ x in float64: |err| <= 0.5 * (|W| @ d_act) * (1 + 1e-3) + 1e-5 * (|W| @ |x|),
    the exact worst case of rounding each activation to its block's step d (about 1e-2 relative).
The weight side is checked against an independent oracle: the `gguf` package's dequantizers
(and a float64 transcription of the Q1_0 / Q2_0 layouts, which gguf 0.19 cannot read).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.kernels.activation_quant import QK8_1, quantize_activations
from strata.kernels.ggml_types import type_by_id
from strata.kernels.mmvq_numpy import FLOAT_TYPES, MIRRORED_TYPES, decode_codes, mmvq, mmvq_experts
from strata.kernels.random_blocks import random_blocks

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

ROWS, K = 40, 512
QUANTIZED = [t for t in MIRRORED_TYPES if t not in FLOAT_TYPES]
NAMES = {t: type_by_id(t).name for t in MIRRORED_TYPES}


def _oracle_q1_0(w: np.ndarray) -> np.ndarray:
    # f16 d + 128 sign bits (LSB first): bit set -> +d, clear -> -d
    b = w.reshape(-1, 18)
    d = b[:, :2].copy().view("<f2").astype(np.float64)
    bits = np.unpackbits(b[:, 2:], axis=1, bitorder="little").astype(np.float64)
    return (d * (2 * bits - 1)).reshape(w.shape[0], -1)


def _oracle_q2_0(w: np.ndarray) -> np.ndarray:
    # f16 d + 16 bytes of 2-bit codes, LSB first; value (c - 1) * d
    b = w.reshape(-1, 18)
    d = b[:, :2].copy().view("<f2").astype(np.float64)
    c = (b[:, 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    return (d * (c.reshape(len(b), 64).astype(np.float64) - 1)).reshape(w.shape[0], -1)


def dequant_oracle(type_id: int, w: np.ndarray) -> np.ndarray:
    """float64 (rows, k) from an implementation that is not Strata's."""
    name = NAMES[type_id]
    if name == "Q1_0":
        return _oracle_q1_0(w)
    if name == "Q2_0":
        return _oracle_q2_0(w)
    if name == "BF16":
        return (w.view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    out = gguf_dequantize(w, gguf.GGMLQuantizationType(type_id))
    return np.asarray(out, dtype=np.float64).reshape(w.shape[0], -1)


def _activations(rng, ncols: int, k: int = K) -> np.ndarray:
    # blocks of very different magnitudes, so per-block activation scales matter
    x = rng.standard_normal((ncols, k // QK8_1, QK8_1)) * rng.uniform(0.01, 3.0, (ncols, k // QK8_1, 1))
    return x.reshape(ncols, k).astype(np.float32)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(1234)
    return {t: random_blocks(t, ROWS, K, rng, 0.02) for t in MIRRORED_TYPES}


@pytest.mark.parametrize("type_id", QUANTIZED, ids=lambda t: NAMES[t])
def test_codes_match_independent_dequantizer(type_id, weights):
    w = weights[type_id]
    got = decode_codes(type_id, w).weights().astype(np.float64).reshape(ROWS, K)
    ref = dequant_oracle(type_id, w)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7 * np.abs(ref).max())


@pytest.mark.parametrize("ncols", [1, 2, 5, 8])
@pytest.mark.parametrize("type_id", MIRRORED_TYPES, ids=lambda t: NAMES[t])
def test_mirror_matches_float64_reference(type_id, ncols, weights):
    rng = np.random.default_rng(type_id * 100 + ncols)
    w = weights[type_id]
    x = _activations(rng, ncols)
    W = dequant_oracle(type_id, w)
    y = mmvq(type_id, w, x).astype(np.float64)
    assert y.shape == (ncols, ROWS) and np.isfinite(y).all()

    if type_id in FLOAT_TYPES:  # plain float dot of the unquantized activations
        xq = x.astype(np.float64)
        step = np.zeros_like(xq)
    else:
        act = quantize_activations(x)
        xq = act.dequantize().astype(np.float64)
        step = np.repeat(act.d, QK8_1, axis=1).astype(np.float64)
    tight = np.abs(y - xq @ W.T) / (np.abs(xq) @ np.abs(W).T)
    assert tight.max() <= 1e-5, f"{NAMES[type_id]}: {tight.max():.2e} vs dequant(W) @ dequant(quant(x))"

    err = np.abs(y - x.astype(np.float64) @ W.T)
    bound = 0.5 * (step @ np.abs(W).T) * (1 + 1e-3) + 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(W).T)
    assert (err <= bound).all(), f"{NAMES[type_id]}: activation-quantization bound exceeded"
    assert (err / (np.abs(x.astype(np.float64)) @ np.abs(W).T)).max() < 1e-2


@pytest.mark.parametrize("type_id", [t for t in MIRRORED_TYPES if NAMES[t] in
                                     ("Q4_0", "Q4_K", "IQ3_S", "IQ3_XXS", "IQ4_NL", "Q2_0", "IQ1_M", "F16")],
                         ids=lambda t: NAMES[t])
def test_experts_match_per_expert_mirror(type_id):
    rng = np.random.default_rng(7 + type_id)
    n_expert, ncols, n_used, rows = 5, 6, 3, 24
    w = np.stack([random_blocks(type_id, rows, K, rng, 0.02) for _ in range(n_expert)])
    ids = np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(ncols)])
    x = _activations(rng, ncols)
    y = mmvq_experts(type_id, w, ids, x)
    assert y.shape == (ncols, n_used, rows)
    for c in range(ncols):
        for u in range(n_used):
            # same math; BLAS may order float32 sums differently for 1 column than for several
            np.testing.assert_allclose(y[c, u], mmvq(type_id, w[ids[c, u]], x[c:c + 1])[0],
                                       rtol=1e-5, atol=1e-6 * np.abs(y).max())
    # and against float64, so the dispatch cannot pair the wrong expert with a column
    W = [dequant_oracle(type_id, w[e]) for e in range(n_expert)]
    xq = x.astype(np.float64) if type_id in FLOAT_TYPES else quantize_activations(x).dequantize().astype(np.float64)
    for c in range(ncols):
        for u in range(n_used):
            ref = W[ids[c, u]] @ xq[c]
            assert np.abs(y[c, u] - ref).max() <= 1e-5 * (np.abs(W[ids[c, u]]) @ np.abs(xq[c])).max()


def test_activation_quantizer_rounds_like_roundf():
    x = np.zeros((1, 64), dtype=np.float32)
    x[0, 0] = 127.0  # d = 1 exactly
    x[0, 1:6] = [2.5, -2.5, 0.49999997, -0.5, 126.5]
    # second block all zero: d = 0, codes 0
    a = quantize_activations(x)
    assert a.d[0, 0] == 1.0 and a.d[0, 1] == 0.0
    assert a.q[0, :6].tolist() == [127, 3, -3, 0, -1, 127]
    assert not a.q[0, 32:].any() and a.s[0, 1] == 0.0
    assert a.s[0, 0] == np.float32(a.q[0, :32].astype(np.int32).sum())


def test_activation_quantizer_against_float64():
    rng = np.random.default_rng(5)
    x = _activations(rng, 3, 256)
    a = quantize_activations(x)
    blocks = x.astype(np.float64).reshape(3, 8, 32)
    d = np.abs(blocks).max(axis=2) / 127
    q = blocks / d[:, :, None]
    expect = np.sign(q) * np.floor(np.abs(q) + 0.5)
    assert np.abs(a.q.reshape(3, 8, 32) - expect).max() <= 1  # float32 vs float64 division at ties
    assert (np.abs(a.q.reshape(3, 8, 32) - expect) > 0).mean() < 1e-2
    np.testing.assert_allclose(a.d, d, rtol=1e-6)
    assert np.abs(a.q).max() == 127 and a.q.min() >= -127


def test_bad_shapes_raise():
    rng = np.random.default_rng(0)
    q40 = [t for t in MIRRORED_TYPES if NAMES[t] == "Q4_0"][0]
    w = random_blocks(q40, 4, 64, rng)
    with pytest.raises(ValueError, match="Q4_0"):
        mmvq(q40, w, np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="Q8_1"):
        mmvq(9, w, np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="expert id"):
        mmvq_experts(q40, w[None], np.array([[1]]), np.zeros((1, 64), np.float32))


def test_activation_codes_agree_with_ggml_reference_quantizer():
    # strata.kernels.quantize follows ggml's CPU reference (x * (1/d), f16 d and s); the kernels
    # divide (x / d) and keep d, s in float32. Codes may differ only where x/d sits on a rounding
    # boundary; d only by its f16 rounding.
    from strata.kernels.quantize import quantize_q8_1

    rng = np.random.default_rng(9)
    x = _activations(rng, 4, 1024)
    a = quantize_activations(x)
    ref = quantize_q8_1(x).reshape(4, 32, 36)
    ref_d = ref[:, :, 0:2].copy().view("<f2")[..., 0].astype(np.float32)
    ref_q = ref[:, :, 4:36].copy().view(np.int8).reshape(4, 1024)
    assert (a.q != ref_q).mean() < 1e-3 and np.abs(a.q.astype(int) - ref_q).max() <= 1
    np.testing.assert_allclose(a.d, ref_d, rtol=2 ** -11)
