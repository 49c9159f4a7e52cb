"""random_blocks: valid blocks of every type whose weights have about the requested RMS."""

from __future__ import annotations

import numpy as np
import pytest

from strata.errors import StrataError
from strata.kernels.dequant import dequantize
from strata.kernels.ggml_types import ALL_TYPES, BY_NAME
from strata.kernels.random_blocks import random_blocks

QUANTIZED = [t.name for t in ALL_TYPES if t.quantized]
FLOATS = ["F32", "F16", "BF16", "F64"]


def _make(name, rows, blocks_per_row, scale, seed=0):
    gtype = BY_NAME[name]
    cols = gtype.block_size * blocks_per_row
    data = random_blocks(gtype.id, rows, cols, np.random.default_rng(seed), scale)
    return gtype, cols, data


@pytest.mark.parametrize("name", QUANTIZED + FLOATS)
@pytest.mark.parametrize("scale", [0.02, 0.5])
def test_finite_with_requested_magnitude(name, scale):
    gtype, cols, data = _make(name, 16, max(4, 1024 // BY_NAME[name].block_size), scale)
    assert data.dtype == np.uint8 and data.shape == (16, gtype.row_bytes(cols))
    values = dequantize(gtype.id, data, 16 * cols).astype(np.float64)
    assert np.isfinite(values).all()
    rms = np.sqrt(np.mean(values**2))
    # Within a factor 1.5 of the target: block scales jitter by 30% and some formats round
    # their scales to powers of two (MXFP4) or 3-bit mantissas (NVFP4).
    assert scale / 1.5 < rms < scale * 1.5, rms
    assert np.abs(values).max() < 20 * scale
    assert values.std() > scale / 4  # not constant: quant bits are random


def test_integer_types_are_small_integers():
    for name in ("I8", "I16", "I32", "I64"):
        gtype, cols, data = _make(name, 4, 64, 0.02)
        values = dequantize(gtype.id, data, 4 * cols)
        assert values.min() >= -8 and values.max() <= 8 and len(np.unique(values)) > 5


def test_same_seed_same_blocks_and_rows_differ():
    a = _make("Q4_K", 3, 4, 0.02, seed=7)[2]
    b = _make("Q4_K", 3, 4, 0.02, seed=7)[2]
    assert np.array_equal(a, b)
    assert not np.array_equal(a[0], a[1])


def test_derived_fields_are_consistent():
    # Q8_1: s = d * sum(q) in f16; no -128 in any int8 quant.
    _, _, data = _make("Q8_1", 8, 4, 0.02)
    blocks = data.reshape(-1, 36)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)[:, 0]
    s = blocks[:, 2:4].copy().view("<f2")[:, 0]
    q = blocks[:, 4:].view(np.int8)
    assert q.min() >= -127
    assert np.array_equal(s, (d * q.sum(axis=1).astype(np.float32)).astype(np.float16))
    # Q8_K: bsums are the sums of 16 consecutive quants.
    _, _, data = _make("Q8_K", 4, 2, 0.02)
    blocks = data.reshape(-1, 292)
    q = blocks[:, 4:260].view(np.int8).astype(np.int32)
    bsums = blocks[:, 260:].copy().view("<i2")
    assert q.min() >= -127 and np.array_equal(bsums, q.reshape(-1, 16, 16).sum(axis=2))


def test_ternary_types_hold_only_ternary_codes():
    _, _, data = _make("TQ2_0", 4, 4, 0.02)
    qs = data.reshape(-1, 66)[:, :64]
    codes = (qs[:, :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    assert codes.max() == 2
    # TQ1_0 bytes must be the canonical ceil(v * 256 / 243) encodings ggml writes.
    _, _, data = _make("TQ1_0", 4, 4, 0.02)
    qs = data.reshape(-1, 54)[:, :52].astype(np.int64)
    canonical = (np.arange(243) * 256 + 242) // 243
    assert np.isin(qs[:, :48], canonical).all()
    assert np.isin(qs[:, 48:], canonical[::3][:81]).all()


def test_bad_arguments():
    rng = np.random.default_rng(0)
    with pytest.raises(StrataError, match="row length 100"):
        random_blocks(BY_NAME["Q4_0"].id, 2, 100, rng)
    with pytest.raises(StrataError, match="type id 4"):
        random_blocks(4, 2, 32, rng)
