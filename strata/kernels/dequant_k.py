"""Dequantizers for the K-quants (256-weight super-blocks): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.

Same contract and arithmetic order as strata.kernels.dequant_basic: (n, type_size) uint8 ->
(n, 256) float32, float32 operations in the order of ggml's dequantize_row_* so results are
bit-identical. Reading guide: in every K-quant the per-sub-block scales come out in weight
order, so after decoding codes into (n, n_sub, sub_len) a broadcast multiply applies them.
"""

from __future__ import annotations

import numpy as np

from strata.kernels.blockfields import as_f32, f16_scale, f32_scale, field, nibbles, nibbles_f32
_PLANE_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 2, 4, 32) codes: two runs of 32 bytes, bit-pair plane j of each run
    gives 32 consecutive weights (the Q2_K / Q3_K order)."""
    return (qs.reshape(len(qs), 2, 1, 32) >> _PLANE_SHIFTS) & 3


def dequant_q2_k(blocks: np.ndarray) -> np.ndarray:
    # u8 scales[16] (low nibble: scale, high nibble: min); u8 qs[64]; half d; half dmin
    n = len(blocks)
    sc = field(blocks, 0, 16)
    dl = f16_scale(blocks, 80) * (sc & 0xF).astype(np.float32)
    ml = f16_scale(blocks, 82) * (sc >> 4).astype(np.float32)
    out = as_f32(_two_bit_planes(field(blocks, 16, 64)).reshape(n, 16, 16))
    out *= dl[:, :, None]
    out -= ml[:, :, None]
    return out.reshape(n, 256)


_HMASK_SHIFTS = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)


def _q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 six-bit scales (as int, before the -32): scale 4g+k has low nibble
    (raw[k + 4*(g%2)] >> 4*(g//2)) and high bits (raw[8+k] >> 2g) & 3."""
    n = len(raw)
    low = np.concatenate((raw[:, 0:8] & 0xF, raw[:, 0:8] >> 4), axis=1)  # groups g = 0,1 | 2,3
    high = (raw[:, None, 8:12] >> _PLANE_SHIFTS[0]) & 3  # (n, 4 groups, 4)
    return low.astype(np.int32) | (high.reshape(n, 16).astype(np.int32) << 4)


def dequant_q3_k(blocks: np.ndarray) -> np.ndarray:
    # u8 hmask[32]; u8 qs[64]; u8 scales[12] (16 x 6 bits); half d
    n = len(blocks)
    low = _two_bit_planes(field(blocks, 32, 64))
    # High bit of weight (run r, plane j, byte l) is bit 4r+j of hmask[l]; hmask is shared by
    # both runs (ggml keeps one pointer and shifts the mask across all 8 planes).
    high = (field(blocks, 0, 32).reshape(n, 1, 1, 32) >> _HMASK_SHIFTS) & 1
    out = as_f32((low | (high << 2)).reshape(n, 16, 16), -4)  # low bits + 4 * high bit - 4
    out *= (f16_scale(blocks, 108) * (_q3_k_scales(field(blocks, 96, 12)) - 32).astype(np.float32))[:, :, None]
    return out.reshape(n, 256)


def k4_scales_mins(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed scales (12 bytes) -> (scales, mins), each (n, 8) uint8 of 6 bits.

    Sub-blocks 0-3 keep 6 bits in raw[j] / raw[j+4]; sub-blocks 4-7 take a nibble from
    raw[j+4] and their top two bits from the spare top bits of raw[j-4] / raw[j].
    """
    lo, mid, hi = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    scales = np.concatenate((lo & 63, (hi & 0xF) | ((lo >> 6) << 4)), axis=1)
    mins = np.concatenate((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), axis=1)
    return scales, mins


def _k_scale_pair(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # half d, half dmin, scales[12] at offset 4 -> per-sub-block float32 (d*sc, dmin*m), (n, 8, 1)
    sc, m = k4_scales_mins(field(blocks, 4, 12))
    d1 = f16_scale(blocks, 0) * sc.astype(np.float32)
    m1 = f16_scale(blocks, 2) * m.astype(np.float32)
    return d1[:, :, None], m1[:, :, None]


def _four_bit_runs(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32): 4 runs of 32 bytes, low nibbles then high nibbles."""
    return nibbles(qs.reshape(len(qs), 4, 32)).reshape(len(qs), 8, 32)


def dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    # half d; half dmin; u8 scales[12]; u8 qs[128] (4 runs of 32 bytes: low nibbles are
    # sub-block 2r, high nibbles 2r+1); (d*sc) * q - (dmin*m)
    n = len(blocks)
    d1, m1 = _k_scale_pair(blocks)
    out = nibbles_f32(field(blocks, 16, 128).reshape(n, 4, 32)).reshape(n, 8, 32)
    out *= d1
    out -= m1
    return out.reshape(n, 256)


_SUB_BITS = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


def dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    # half d; half dmin; u8 scales[12]; u8 qh[32] (bit s of qh[l]: 5th bit of weight l of
    # sub-block s); u8 qs[128]
    n = len(blocks)
    d1, m1 = _k_scale_pair(blocks)
    high = (field(blocks, 16, 32).reshape(n, 1, 32) >> _SUB_BITS) & 1
    out = as_f32(_four_bit_runs(field(blocks, 48, 128)) | (high << 4))
    out *= d1
    out -= m1
    return out.reshape(n, 256)


def dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    # u8 ql[128]; u8 qh[64]; i8 scales[16]; half d. Two halves of 128 weights; in half h,
    # weights 32g+l take nibble (ql run g%2, low if g<2 else high) and bits 2g of qh[l].
    n = len(blocks)
    ql = field(blocks, 0, 128).reshape(n, 2, 64)
    qh = field(blocks, 128, 64).reshape(n, 2, 1, 32)
    low = nibbles(ql).reshape(n, 2, 4, 32)
    out = as_f32((low | (((qh >> _PLANE_SHIFTS) & 3) << 4)).reshape(n, 16, 16), -32)
    out *= (f16_scale(blocks, 208) * field(blocks, 192, 16, "i1").astype(np.float32))[:, :, None]
    return out.reshape(n, 256)


def dequant_q8_k(blocks: np.ndarray) -> np.ndarray:
    # float d; i8 qs[256]; i16 bsums[16] (dot-product helper, not needed here)
    out = field(blocks, 4, 256, "i1").astype(np.float32)
    out *= f32_scale(blocks, 0)
    return out


DEQUANTIZERS = {
    "Q2_K": dequant_q2_k,
    "Q3_K": dequant_q3_k,
    "Q4_K": dequant_q4_k,
    "Q5_K": dequant_q5_k,
    "Q6_K": dequant_q6_k,
    "Q8_K": dequant_q8_k,
}
