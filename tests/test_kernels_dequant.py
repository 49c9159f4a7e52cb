"""Dequantization of every GGML type against independent references.

References: the `gguf` package's dequantizers (numpy code written independently of ours) for
every type it implements, and per-weight scalar transcriptions of ggml's C reference
(dequantize_row_* in ggml-quants.c) for the types it lacks. The bound is exact equality:
every value must match bit for bit (NaN only where the reference has NaN), because both sides
do the same float32 operations in the same order.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import quants as gguf_quants

from strata.errors import StrataError
from strata.kernels.dequant import DEQUANTIZERS, dequantize
from strata.kernels.ggml_types import ALL_TYPES, BY_ID, BY_NAME
from strata.kernels.random_blocks import random_blocks


def _gguf_type(gtype):
    try:
        return gguf.GGMLQuantizationType(gtype.id)
    except ValueError:
        return None


# Types gguf's dequantize implements (checked: it raises NotImplementedError for the rest).
GGUF_ORACLE = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
]

# Scale fields to overwrite with finite values in fully random blocks: (offset, kind).
SCALE_FIELDS = {
    "F16": [], "F32": [], "BF16": [],
    "Q4_0": [(0, "f16")], "Q4_1": [(0, "f16"), (2, "f16")], "Q5_0": [(0, "f16")],
    "Q5_1": [(0, "f16"), (2, "f16")], "Q8_0": [(0, "f16")], "Q8_1": [(0, "f16"), (2, "f16")],
    "Q2_K": [(80, "f16"), (82, "f16")], "Q3_K": [(108, "f16")], "Q4_K": [(0, "f16"), (2, "f16")],
    "Q5_K": [(0, "f16"), (2, "f16")], "Q6_K": [(208, "f16")], "Q8_K": [(0, "f32")],
    "IQ2_XXS": [(0, "f16")], "IQ2_XS": [(0, "f16")], "IQ2_S": [(0, "f16")], "IQ3_XXS": [(0, "f16")],
    "IQ3_S": [(0, "f16")], "IQ1_S": [(0, "f16")], "IQ1_M": [(48, "iq1m")], "IQ4_NL": [(0, "f16")],
    "IQ4_XS": [(0, "f16")], "TQ1_0": [(52, "f16")], "TQ2_0": [(64, "f16")], "MXFP4": [(0, "e8m0")],
    "NVFP4": [], "Q1_0": [(0, "f16")], "Q2_0": [(0, "f16")],
}


def random_bytes_finite_scales(name: str, n_blocks: int, rng) -> np.ndarray:
    """Uniform random bytes, with every scale field replaced by a random finite value."""
    gtype = BY_NAME[name]
    blocks = rng.integers(0, 256, size=(n_blocks, gtype.type_size), dtype=np.uint8)
    for offset, kind in SCALE_FIELDS[name]:
        if kind == "f16":
            vals = rng.uniform(-2, 2, n_blocks).astype("<f2")
            blocks[:, offset : offset + 2] = vals.view(np.uint8).reshape(-1, 2)
        elif kind == "f32":
            vals = rng.uniform(-2, 2, n_blocks).astype("<f4")
            blocks[:, offset : offset + 4] = vals.view(np.uint8).reshape(-1, 4)
        elif kind == "e8m0":  # 2**(e-128) * 12 must stay finite
            blocks[:, offset] = rng.integers(0, 250, n_blocks, dtype=np.uint8)
        elif kind == "iq1m":  # f16 super-scale: nibble k in the top 4 bits of u16 word k
            bits = rng.uniform(-2, 2, n_blocks).astype("<f2").view(np.uint16)
            words = blocks[:, offset : offset + 8].copy().view("<u2")
            for k in range(4):
                words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
            blocks[:, offset : offset + 8] = words.view(np.uint8)
    if name in ("F16", "BF16", "F32"):  # plain floats: redraw NaN/Inf bit patterns as finite
        view = blocks.view({"F16": "<f2", "BF16": "<u2", "F32": "<f4"}[name])
        if name == "BF16":
            bad = (view & 0x7F80) == 0x7F80
            view[bad] &= 0xBFFF
        else:
            view[~np.isfinite(view)] = 1
    return blocks


def assert_bit_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    ref = ref.astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    mismatch = ours[~nan].view(np.uint32) != ref[~nan].view(np.uint32)
    assert not mismatch.any(), f"{mismatch.sum()} values differ, first at {np.flatnonzero(mismatch)[:5]}"


# Fully random bytes make NaN/Inf (and overflowing products) on purpose; the comparison handles them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ---- the type table ---------------------------------------------------------------------------


def test_table_matches_gguf_except_q8_1():
    for gtype in ALL_TYPES:
        qtype = _gguf_type(gtype)
        if qtype is None:
            assert gtype.name == "Q2_0"  # newer than gguf 0.19
            continue
        assert qtype.name == gtype.name
        if gtype.name == "Q8_1":
            # ggml-common.h: half d + half s + int8 qs[32] (static_assert 2*2 + 32); gguf says 40.
            assert (gtype.block_size, gtype.type_size) == (32, 36)
        else:
            assert gguf.GGML_QUANT_SIZES[qtype] == (gtype.block_size, gtype.type_size)


def test_every_type_has_a_dequantizer():
    assert set(DEQUANTIZERS) == set(BY_ID)
    rng = np.random.default_rng(0)
    for gtype in ALL_TYPES:
        blocks = rng.integers(0, 256, size=(3, gtype.type_size), dtype=np.uint8)
        out = DEQUANTIZERS[gtype.id](blocks)
        assert out.shape == (3, gtype.block_size) and out.dtype == np.float32


# ---- against the gguf package ------------------------------------------------------------------


@pytest.mark.parametrize("name", GGUF_ORACLE)
def test_matches_gguf(name):
    gtype = BY_NAME[name]
    qtype = _gguf_type(gtype)
    rng = np.random.default_rng(gtype.id)
    cols = gtype.block_size * 8 if gtype.block_size > 1 else 256
    tensors = [random_blocks(gtype.id, rows, cols, rng, scale) for rows, scale in ((1, 0.02), (37, 1.0), (5, 1e-3))]
    tensors.append(random_bytes_finite_scales(name, 300, rng).reshape(-1))
    tensors.append(rng.integers(0, 256, size=64 * gtype.type_size, dtype=np.uint8))  # any bytes at all
    for data in tensors:
        n = data.size // gtype.type_size * gtype.block_size
        ours = dequantize(gtype.id, data, n)
        ref = gguf_quants.dequantize(data.reshape(-1), qtype).reshape(-1)
        assert_bit_equal(ours, ref)


# ---- against scalar transcriptions of ggml's C reference --------------------------------------

F32 = np.float32


def _f16(b: bytes) -> F32:
    return F32(np.frombuffer(b, "<f2")[0])


def scalar_q1_0(block: bytes) -> list:
    d = _f16(block[0:2])
    return [d if (block[2 + j // 8] >> (j % 8)) & 1 else -d for j in range(128)]


def scalar_q2_0(block: bytes) -> list:
    d = _f16(block[0:2])
    return [F32(((block[2 + j // 4] >> (2 * (j % 4))) & 3) - 1) * d for j in range(64)]


def scalar_q8_1(block: bytes) -> list:
    d = _f16(block[0:2])
    return [F32(q) * d for q in struct.unpack("<32b", block[4:36])]


def scalar_q8_k(block: bytes) -> list:
    d = F32(struct.unpack("<f", block[0:4])[0])
    return [d * F32(q) for q in struct.unpack("<256b", block[4:260])]


def scalar_bf16(block: bytes) -> list:
    (bits,) = struct.unpack("<H", block)
    return [struct.unpack("<f", struct.pack("<I", bits << 16))[0]]


def scalar_int(fmt: str):
    return lambda block: [F32(struct.unpack(fmt, block)[0])]


SCALAR = {
    "Q1_0": scalar_q1_0,
    "Q2_0": scalar_q2_0,
    "Q8_1": scalar_q8_1,
    "Q8_K": scalar_q8_k,
    "BF16": scalar_bf16,
    "F64": scalar_int("<d"),
    "I8": scalar_int("<b"),
    "I16": scalar_int("<h"),
    "I32": scalar_int("<i"),
    "I64": scalar_int("<q"),
}


@pytest.mark.parametrize("name", sorted(SCALAR))
def test_matches_scalar_reference(name):
    gtype = BY_NAME[name]
    rng = np.random.default_rng(100 + gtype.id)
    n_blocks = 40 if gtype.block_size > 1 else 512
    cases = [random_blocks(gtype.id, 4, gtype.block_size * (n_blocks // 4), rng, 0.5).reshape(-1)]
    if name in SCALE_FIELDS:
        cases.append(random_bytes_finite_scales(name, n_blocks, rng).reshape(-1))
    cases.append(rng.integers(0, 256, size=n_blocks * gtype.type_size, dtype=np.uint8))
    for data in cases:
        raw = data.tobytes()
        ref = np.array(
            [v for i in range(0, len(raw), gtype.type_size) for v in SCALAR[name](raw[i : i + gtype.type_size])],
            dtype=np.float32,
        )
        assert_bit_equal(dequantize(gtype.id, data, ref.size), ref)


def test_q1_0_polarity_and_q2_0_levels():
    # Hand-made blocks: d = 0.5; Q1_0 bit j set for j = 0 and j = 9 only; Q2_0 codes 0,1,2,3,...
    q1 = bytes([0x00, 0x38, 0b00000001, 0b00000010]) + bytes(14)
    v = dequantize(BY_NAME["Q1_0"].id, q1, 128)
    assert v[0] == 0.5 and v[9] == 0.5 and v[1] == -0.5 and (v[10:] == -0.5).all()
    q2 = bytes([0x00, 0x38]) + bytes([0b11100100]) * 16
    assert dequantize(BY_NAME["Q2_0"].id, q2, 64)[:8].tolist() == [-0.5, 0, 0.5, 1.0] * 2


# ---- the public API ---------------------------------------------------------------------------


def test_dequantize_accepts_bytes_memoryview_and_arrays():
    gtype = BY_NAME["Q4_0"]
    data = random_blocks(gtype.id, 3, 64, np.random.default_rng(0))
    want = dequantize(gtype.id, data, 192)
    assert want.shape == (192,) and want.flags.writeable
    raw = data.tobytes()
    for form in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8)):
        got = dequantize(gtype.id, form, 192)
        assert np.array_equal(got, want) and got.flags.writeable
    f32 = np.arange(4, dtype=np.float32)
    out = dequantize(BY_NAME["F32"].id, memoryview(f32.tobytes()), 4)
    out[0] = 9  # the caller owns a writable copy even for read-only input
    assert out.tolist() == [9, 1, 2, 3]


@pytest.mark.parametrize(
    "type_id, raw, n, words",
    [
        (2, bytes(18), 31, "not a whole number"),
        (2, bytes(17), 32, "need 18 bytes, got 17"),
        (2, bytes(36), 32, "need 18 bytes, got 36"),
        (4, bytes(18), 32, "type id 4"),
        (99, bytes(18), 32, "type id 99"),
        (2, np.zeros(9, np.uint16), 32, "uint8"),
    ],
)
def test_bad_input_is_a_strata_error(type_id, raw, n, words):
    with pytest.raises(StrataError, match=words):
        dequantize(type_id, raw, n)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ3_S"])
def test_chunked_large_tensor_equals_one_pass(name):
    # dequantize() works through big tensors in CHUNK_WEIGHTS pieces; the last piece is partial.
    from strata.kernels.dequant import CHUNK_WEIGHTS

    gtype = BY_NAME[name]
    cols = 256 * 3
    rows = CHUNK_WEIGHTS // cols * 2 + 5
    data = random_blocks(gtype.id, rows, cols, np.random.default_rng(3))
    whole = DEQUANTIZERS[gtype.id](data.reshape(-1, gtype.type_size)).reshape(-1)
    assert_bit_equal(dequantize(gtype.id, data, rows * cols), whole)


def test_dequantize_rows_keeps_the_matrix_shape():
    from strata.kernels.dequant import dequantize_rows

    gtype = BY_NAME["Q6_K"]
    data = random_blocks(gtype.id, 3, 512, np.random.default_rng(4))
    out = dequantize_rows(gtype.id, data)
    assert out.shape == (3, 512)
    assert np.array_equal(out[1], dequantize(gtype.id, data[1], 512))
    with pytest.raises(StrataError, match="not whole 210-byte blocks"):
        dequantize_rows(gtype.id, data[:, :-1])
