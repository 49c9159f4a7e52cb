"""quantize_q8_0 / _q8_1 / _q8_k against scalar transcriptions of ggml's reference quantizers,
and round trips through dequantize."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from strata.errors import StrataError
from strata.kernels.dequant import dequantize
from strata.kernels.ggml_types import BY_NAME
from strata.kernels.quantize import quantize_q8_0, quantize_q8_1, quantize_q8_k

F32 = np.float32


def _roundf(v: F32) -> int:  # C roundf: halves away from zero
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def _f16_bytes(v) -> bytes:
    return np.array([v], dtype="<f2").tobytes()


def scalar_q8_0_or_1(x: np.ndarray, with_sum: bool) -> bytes:
    out = b""
    for i in range(0, len(x), 32):
        amax = F32(0)
        for v in x[i : i + 32]:
            amax = max(amax, F32(abs(v)))
        d = F32(amax / F32(127))
        inv = F32(F32(1) / d) if d else F32(0)
        qs = [_roundf(F32(v * inv)) for v in x[i : i + 32]]
        out += _f16_bytes(d)
        if with_sum:
            out += _f16_bytes(F32(F32(sum(qs)) * d))
        out += struct.pack("<32b", *qs)
    return out


def scalar_q8_k(x: np.ndarray) -> bytes:
    out = b""
    for i in range(0, len(x), 256):
        amax, peak = F32(0), F32(0)
        for v in x[i : i + 256]:
            if abs(v) > amax:
                amax, peak = F32(abs(v)), v
        if not amax:
            out += bytes(292)
            continue
        iscale = F32(F32(-127) / peak)
        qs = [min(127, int(np.rint(F32(iscale * v)))) for v in x[i : i + 256]]
        bsums = [sum(qs[j : j + 16]) for j in range(0, 256, 16)]
        out += struct.pack("<f", F32(F32(1) / iscale)) + struct.pack("<256b", *qs) + struct.pack("<16h", *bsums)
    return out


def _inputs(rng, n):
    x = rng.standard_normal(n).astype(np.float32) * F32(3)
    halves = np.arange(-15, 16, dtype=np.float32) + F32(0.5)
    x[:32] = 0  # an all-zero block
    x[32:64] = np.concatenate(([127], halves))  # d = 1: exact halves (roundf rounds them away from 0)
    x[64:96] = np.float32(0.5) * (np.arange(32) % 3 - 1).astype(np.float32)  # ties of +-amax
    x[256:512] = np.resize(halves, 256)  # Q8_K with iscale = -1: halves round to even
    x[256 + 5], x[256 + 9] = 127.0, -127.0  # Q8_K: +peak first
    x[512 + 3], x[512 + 4] = -20.0, 20.0  # Q8_K: -peak first
    return x


@pytest.mark.parametrize(
    "quantize, reference",
    [
        (quantize_q8_0, lambda x: scalar_q8_0_or_1(x, False)),
        (quantize_q8_1, lambda x: scalar_q8_0_or_1(x, True)),
        (quantize_q8_k, scalar_q8_k),
    ],
)
def test_matches_scalar_reference(quantize, reference):
    x = _inputs(np.random.default_rng(1), 1024)
    assert quantize(x).tobytes() == reference(x)


@pytest.mark.parametrize("quantize, name", [(quantize_q8_0, "Q8_0"), (quantize_q8_1, "Q8_1"), (quantize_q8_k, "Q8_K")])
def test_round_trip_and_shapes(quantize, name):
    gtype = BY_NAME[name]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 512)).astype(np.float32)
    q = quantize(x)
    assert q.dtype == np.uint8 and q.shape == (3, 2, gtype.row_bytes(512))
    y = dequantize(gtype.id, q, x.size).reshape(x.shape)
    blocks = x.reshape(-1, gtype.block_size)
    d_exact = np.abs(blocks).max(axis=1, keepdims=True) / 127
    # Rounding to the nearest code costs d/2; storing d as f16 (not Q8_K) moves each value by
    # at most 127 * |d_f16 - d| <= 127 * d * 2**-11.
    f16_slack = 0 if name == "Q8_K" else 127 * d_exact * 2.0**-11
    bound = d_exact * 0.5 * (1 + 1e-5) + f16_slack
    assert (np.abs(y.reshape(blocks.shape) - blocks) <= bound).all()
    # A second pass over the dequantized values is (nearly) a fixed point.
    assert np.abs(dequantize(gtype.id, quantize(y), x.size) - y.reshape(-1)).max() <= bound.max()


def test_bad_length_is_a_strata_error():
    with pytest.raises(StrataError, match="multiple of 32"):
        quantize_q8_0(np.zeros(40, np.float32))
    with pytest.raises(StrataError, match="multiple of 256"):
        quantize_q8_k(np.zeros(128, np.float32))
