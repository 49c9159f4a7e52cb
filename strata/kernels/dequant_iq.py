"""Dequantizers for the IQ ("importance") types: codebook grids + sign patterns.

Same contract as strata.kernels.dequant_basic. The codebooks live in strata.kernels.iq_tables
(generated from ggml-common.h) and are decoded here once, at import, into float32 arrays so
each block decodes by gathers: grid[index] * sign * scale.
"""

from __future__ import annotations

import base64

import numpy as np

from strata.kernels.blockfields import bits_lsb, f16_scale, field, lut, nibbles, scaled
from strata.kernels.iq_tables import GRIDS, KVALUES_IQ4NL


def decode_grid(name: str) -> np.ndarray:
    """Codebook `name` of iq_tables.GRIDS as float32 (count, width) (the byte values ggml reads)."""
    spec = GRIDS[name]
    packed = np.frombuffer(base64.b64decode("".join(spec["data"])), dtype=np.uint8)
    n_codes = spec["count"] * spec["width"]
    bits = np.unpackbits(packed, bitorder="little")[: n_codes * spec["bits"]]
    index = (bits.reshape(n_codes, spec["bits"]) << np.arange(spec["bits"], dtype=np.uint8)).sum(axis=1)
    return lut(spec["levels"])[index].reshape(spec["count"], spec["width"])


GRID_IQ2XXS = decode_grid("IQ2XXS")
GRID_IQ2XS = decode_grid("IQ2XS")
GRID_IQ2S = decode_grid("IQ2S")
GRID_IQ3XXS = decode_grid("IQ3XXS")
GRID_IQ3S = decode_grid("IQ3S")
GRID_IQ1S = decode_grid("IQ1S")


def _sign_table() -> np.ndarray:
    # ksigns_iq2xs: a 7-bit index stores 7 signs; the 8th sign makes the count of minus
    # signs even (bit 7 = parity of the index). Returned as (128, 8) float32 of +-1.
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1).astype(np.uint8) & 1
    byte = (i | (parity << 7)).astype(np.uint8)
    return lut(1 - 2 * np.unpackbits(byte[:, None], axis=1, bitorder="little").astype(np.int8))


SIGNS7 = _sign_table()
_SIGN_BIT = lut([1, -1])  # an explicit sign bit: set -> negative
_KV_IQ4NL = lut(KVALUES_IQ4NL)

# the byte of 8 signs a 7-bit sign index stands for (bit 7: the parity of the index), as an index
_SIGN_BYTE7 = np.packbits(SIGNS7 < 0, axis=1, bitorder="little").reshape(128).astype(np.intp)
_SIGN_NIBBLES = np.where((np.arange(16)[:, None] >> np.arange(4)) & 1, -1, 1).astype(np.float32)  # (16, 4)


def _signed_quads(grid: np.ndarray) -> np.ndarray:
    """A 4-wide codebook with every sign pattern applied: entry (code << 4 | signs) is the code's
    4 values, value i negated where bit i of signs is set. One gather then replaces a grid gather,
    a sign gather and their product (exact: a sign flip), IQ3_S and IQ3_XXS at 1.8-2.1x. Each
    entry is one 16-byte item (complex128), so the gather moves whole entries."""
    table = grid[:, None, :] * _SIGN_NIBBLES[None, :, :]
    return np.ascontiguousarray(table.reshape(-1, 4)).view(np.complex128).reshape(-1)


def _quads(table: np.ndarray, codes: np.ndarray, sign_bytes: np.ndarray, n: int) -> np.ndarray:
    """codes (n, 2m) of 4 weights each, sign_bytes (n, m) one sign bit per weight (bit i: weight
    i of the pair's 8) -> the signed values (n, 8m) float32."""
    idx = np.empty((n, sign_bytes.shape[1], 2), np.intp)
    idx[:, :, 0] = sign_bytes & 15
    idx[:, :, 1] = sign_bytes >> 4
    idx |= codes.reshape(idx.shape).astype(np.intp) << 4
    return np.take(table, idx.reshape(n, -1)).view(np.float32).reshape(n, -1)


def _u32(blocks: np.ndarray, offset: int, count: int) -> np.ndarray:
    return field(blocks, offset, count, "<u4").astype(np.uint32)


def dequant_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    # half d; then per 32 weights two u32: four grid indices (bytes), and 4 x 7 sign bits +
    # a 4-bit scale s in the top bits; db = d * (0.5 + s) * 0.25
    n = len(blocks)
    words = _u32(blocks, 2, 16).reshape(n, 8, 2)
    grid_index = field(blocks, 2, 64).reshape(n, 8, 2, 4)[:, :, 0, :]
    aux = words[:, :, 1]
    sign_index = (aux[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127
    db = (f16_scale(blocks, 0) * (0.5 + (aux >> 28).astype(np.float32))) * np.float32(0.25)
    signed = GRID_IQ2XXS[grid_index] * SIGNS7[sign_index]
    return _scale_groups(signed, db, n)


def _scale_groups(values: np.ndarray, db: np.ndarray, n: int) -> np.ndarray:
    """values (n, groups, ...) * db (n, groups) -> (n, 256) float32."""
    values = values.reshape(n, db.shape[1], -1)
    np.multiply(values, db[:, :, None], out=values)
    return values.reshape(n, 256)


def _half_scales(scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """IQ2_XS/IQ2_S: byte ib holds two 4-bit scales (low for weights 0-15 of the 32, high for
    16-31); db = d * (0.5 + s) * 0.25 -> (n, 16)."""
    s = nibbles(scales[:, :, None]).reshape(len(scales), 16).astype(np.float32)
    return (d * (0.5 + s)) * np.float32(0.25)


def dequant_iq2_xs(blocks: np.ndarray) -> np.ndarray:
    # half d; u16 qs[32] (9-bit grid index | 7-bit sign index << 9); u8 scales[8]
    n = len(blocks)
    qs = field(blocks, 2, 32, "<u2")
    signed = GRID_IQ2XS[qs & 511] * SIGNS7[qs >> 9]
    db = _half_scales(field(blocks, 66, 8), f16_scale(blocks, 0))
    return _scale_groups(signed, db, n)


_QH_PAIR_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def dequant_iq2_s(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[32] grid index low bits; u8 signs[32] (one explicit sign bit per weight);
    # u8 qh[8] (2 high index bits per 8 weights); u8 scales[8]
    n = len(blocks)
    high = (field(blocks, 66, 8)[:, :, None] >> _QH_PAIR_SHIFTS) & 3
    index = field(blocks, 2, 32).astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << 8)
    signs = _SIGN_BIT[bits_lsb(field(blocks, 34, 32))].reshape(n, 32, 8)
    signed = GRID_IQ2S[index] * signs
    db = _half_scales(field(blocks, 74, 8), f16_scale(blocks, 0))
    return _scale_groups(signed, db, n)


_IQ3XXS_SIGNED = _signed_quads(GRID_IQ3XXS)
_IQ3S_SIGNED = _signed_quads(GRID_IQ3S)


def dequant_iq3_xxs(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[64] (one grid index per 4 weights); then per 32 weights a u32 with
    # 4 x 7 sign bits and a 4-bit scale s: db = d * (0.5 + s) * 0.5
    n = len(blocks)
    aux = _u32(blocks, 66, 8)
    sign_index = (aux[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127
    signed = _quads(_IQ3XXS_SIGNED, field(blocks, 2, 64), _SIGN_BYTE7[sign_index].reshape(n, 32), n)
    db = (f16_scale(blocks, 0) * (0.5 + (aux >> 28).astype(np.float32))) * np.float32(0.5)
    return _scale_groups(signed, db, n)


def dequant_iq3_s(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[64] (index low bits per 4 weights); u8 qh[8] (bit m of qh[k]: 9th index
    # bit of group 8k+m); u8 signs[32] (explicit sign bit per weight); u8 scales[4] (nibbles)
    n = len(blocks)
    index = field(blocks, 2, 64).astype(np.uint16) | (bits_lsb(field(blocks, 66, 8)).astype(np.uint16) << 8)
    signed = _quads(_IQ3S_SIGNED, index, field(blocks, 74, 32), n)
    s = nibbles(field(blocks, 106, 4)[:, :, None]).reshape(n, 8).astype(np.int32)
    db = f16_scale(blocks, 0) * (1 + 2 * s).astype(np.float32)
    return _scale_groups(signed, db, n)


_IQ1_DELTA = lut([0.125, -0.125])
_QH3_SHIFTS = np.array([0, 3, 6, 9], dtype=np.uint16)


def dequant_iq1_s(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[32]; u16 qh[8]: per 32 weights, 4 x 3 high index bits, a 3-bit scale
    # (bits 12-14) and the sign of the shared delta (bit 15); y = dl * (grid + delta)
    n = len(blocks)
    qh = field(blocks, 34, 8, "<u2")
    high = ((qh[:, :, None] >> _QH3_SHIFTS) & 7).reshape(n, 32)
    index = field(blocks, 2, 32).astype(np.uint16) | (high << 8)
    values = GRID_IQ1S[index].reshape(n, 8, 32)
    values += _IQ1_DELTA[qh >> 15][:, :, None]
    dl = f16_scale(blocks, 0) * (2 * ((qh >> 12) & 7).astype(np.int32) + 1).astype(np.float32)
    return _scale_groups(values, dl, n)


def dequant_iq1_m(blocks: np.ndarray) -> np.ndarray:
    # u8 qs[32]; u8 qh[16] (per 8 weights a nibble: 3 high index bits + delta sign);
    # u16 scales[4]: 16 x 3-bit sub-scales, and the f16 super-scale in their top nibbles
    n = len(blocks)
    qh = nibbles(field(blocks, 32, 16)[:, :, None]).reshape(n, 32)
    index = field(blocks, 0, 32).astype(np.uint16) | ((qh & 7).astype(np.uint16) << 8)
    values = GRID_IQ1S[index]  # (n, 32 groups, 8)
    values += _IQ1_DELTA[qh >> 3][:, :, None]
    sc = field(blocks, 48, 4, "<u2")
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = d_bits.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]
    sub = (sc[:, :, None] >> _QH3_SHIFTS) & 7  # (n, 4, 4): sub-scale 4i+k
    dl = d * (2 * sub.reshape(n, 16).astype(np.int32) + 1).astype(np.float32)
    return _scale_groups(values, dl, n)


def dequant_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[16] (nibbles, low = weights 0-15); d * kvalues[q]
    n = len(blocks)
    return scaled(_KV_IQ4NL, nibbles(field(blocks, 2, 16)), f16_scale(blocks, 0), (n, 32))


def dequant_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    # half d; u16 scales_h (2 high bits per 32 weights); u8 scales_l[4] (nibbles); u8 qs[128]
    n = len(blocks)
    low = nibbles(field(blocks, 4, 4)[:, :, None]).reshape(n, 8).astype(np.int32)
    high = (field(blocks, 2, 1, "<u2").astype(np.int32) >> np.arange(0, 16, 2)) & 3
    dl = f16_scale(blocks, 0) * ((low | (high << 4)) - 32).astype(np.float32)
    codes = nibbles(field(blocks, 8, 128).reshape(n, 8, 16))
    return scaled(_KV_IQ4NL, codes, dl[:, :, None], (n, 256))


DEQUANTIZERS = {
    "IQ2_XXS": dequant_iq2_xxs,
    "IQ2_XS": dequant_iq2_xs,
    "IQ2_S": dequant_iq2_s,
    "IQ3_XXS": dequant_iq3_xxs,
    "IQ3_S": dequant_iq3_s,
    "IQ1_S": dequant_iq1_s,
    "IQ1_M": dequant_iq1_m,
    "IQ4_NL": dequant_iq4_nl,
    "IQ4_XS": dequant_iq4_xs,
}
