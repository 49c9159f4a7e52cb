"""Dequantizers for the plain storage types and the simple 32/64/128-weight block formats.

Each function maps (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32 and follows
ggml's reference `dequantize_row_*` (ggml-quants.c) operation by operation, in float32, so
results are bit-identical to ggml's scalar CPU path (which does not fuse multiply-adds).
Layouts: ggml-common.h. Type ids: strata.kernels.ggml_types.
"""

from __future__ import annotations

import numpy as np

from strata.kernels.blockfields import (
    as_f32,
    bits_lsb,
    f16_scale,
    field,
    lut,
    nibbles,
    nibbles_f32,
    scaled,
)
from strata.kernels.iq_tables import KVALUES_FP4

# ---- plain storage: one value per "block" --------------------------------------------------


def _plain(dtype: str):
    def dequant(blocks: np.ndarray) -> np.ndarray:
        return blocks.view(dtype).astype(np.float32)

    dequant.__name__ = f"dequant_{np.dtype(dtype).name}"
    return dequant


def dequant_bf16(blocks: np.ndarray) -> np.ndarray:
    # bf16 is the top half of a float32: widen by shifting the 16 bits up (exact).
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


# ---- 32-weight blocks with an f16 scale ---------------------------------------------------


def dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[16]: weight j = low nibble of qs[j], weight j+16 = high nibble; (q - 8) * d
    out = nibbles_f32(field(blocks, 2, 16), -8)
    out *= f16_scale(blocks, 0)
    return out


def dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    # half d, half m; u8 qs[16]; q * d + m
    out = nibbles_f32(field(blocks, 4, 16))
    out *= f16_scale(blocks, 0)
    out += f16_scale(blocks, 2)
    return out


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # qh is a little-endian uint32 whose bit i is the 5th bit of weight i.
    return nibbles(qs) | (bits_lsb(qh) << 4)


def dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qh[4]; u8 qs[16]; (q - 16) * d
    out = as_f32(_five_bit(field(blocks, 2, 4), field(blocks, 6, 16)), -16)
    out *= f16_scale(blocks, 0)
    return out


def dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    # half d, half m; u8 qh[4]; u8 qs[16]; q * d + m
    out = as_f32(_five_bit(field(blocks, 4, 4), field(blocks, 8, 16)))
    out *= f16_scale(blocks, 0)
    out += f16_scale(blocks, 2)
    return out


def dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    # half d; i8 qs[32]; q * d
    out = field(blocks, 2, 32, "i1").astype(np.float32)
    out *= f16_scale(blocks, 0)
    return out


def dequant_q8_1(blocks: np.ndarray) -> np.ndarray:
    # half d; half s (= d * sum(qs), only used by dot products); i8 qs[32]; q * d
    out = field(blocks, 4, 32, "i1").astype(np.float32)
    out *= f16_scale(blocks, 0)
    return out


# ---- 1- and 2-bit mainline formats ----------------------------------------------------------

_TWO_BIT_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def dequant_q1_0(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[16] = 128 sign bits, LSB first; set bit -> +d, clear bit -> -d
    out = as_f32(bits_lsb(field(blocks, 2, 16)))
    out *= 2
    out -= 1  # 2 * bit - 1 = +-1 exactly, so the product below is exactly +-d
    out *= f16_scale(blocks, 0)
    return out


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., k, 4) 2-bit codes, bits 0-1 first."""
    return (qs[..., None] >> _TWO_BIT_SHIFTS) & 3


def dequant_q2_0(blocks: np.ndarray) -> np.ndarray:
    # half d; u8 qs[16]: weight j in bits 2*(j%4) of qs[j/4]; (c - 1) * d
    n = len(blocks)
    out = as_f32(_crumbs(field(blocks, 2, 16)).reshape(n, 64), -1)
    out *= f16_scale(blocks, 0)
    return out


def dequant_tq2_0(blocks: np.ndarray) -> np.ndarray:
    # u8 qs[64]; half d. Two runs of 32 bytes; within a run, 2-bit plane l (bits 2l..2l+1)
    # of the 32 bytes gives 32 consecutive weights.
    n = len(blocks)
    qs = field(blocks, 0, 64).reshape(n, 2, 32)
    out = as_f32(np.swapaxes(_crumbs(qs), 2, 3).reshape(n, 256), -1)  # (run, plane, byte)
    out *= f16_scale(blocks, 64)
    return out


# Base-3 digits as TQ1_0 stores them: byte b holds digits so that digit n is
# ((uint8)(b * 3**n) * 3) >> 8. Table (256, 5) of (digit - 1) as float32.
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint32)
_TQ1_DIGITS = lut(((((np.arange(256, dtype=np.uint32)[:, None] * _POW3) & 0xFF) * 3) >> 8).astype(np.int32) - 1)


def dequant_tq1_0(blocks: np.ndarray) -> np.ndarray:
    # u8 qs[48]; u8 qh[4]; half d. qs[0:32] -> 5 digit planes of 32 weights, qs[32:48] -> 5
    # planes of 16, qh -> 4 planes of 4 (digit planes outer, bytes inner).
    n = len(blocks)
    d = f16_scale(blocks, 52)
    parts = (
        np.swapaxes(_TQ1_DIGITS[field(blocks, 0, 32)], 1, 2).reshape(n, 160),
        np.swapaxes(_TQ1_DIGITS[field(blocks, 32, 16)], 1, 2).reshape(n, 80),
        np.swapaxes(_TQ1_DIGITS[field(blocks, 48, 4)][:, :, :4], 1, 2).reshape(n, 16),
    )
    out = np.concatenate(parts, axis=1)
    out *= d
    return out


# ---- microscaling FP4 ------------------------------------------------------------------------

_FP4 = lut(KVALUES_FP4)  # E2M1 values doubled; the scale tables below carry the matching 1/2


def _e8m0_half_table() -> np.ndarray:
    # ggml_e8m0_to_fp32_half: 2**(e - 128), with e = 0, 1 as float32 subnormals.
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32)
    return bits.view(np.float32)


def _ue4m3_half_table() -> np.ndarray:
    # ggml_ue4m3_to_fp32: unsigned E4M3 (bias 7, bit 7 ignored), 0x00 and 0x7F -> 0, times 1/2.
    x = np.arange(256)
    exp, man = (x >> 3) & 0xF, x & 7
    raw = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(1 + man / 8, exp - 7))
    raw[(x == 0) | (x == 0x7F)] = 0
    return (raw * 0.5).astype(np.float32)


E8M0_HALF = _e8m0_half_table()
UE4M3_HALF = _ue4m3_half_table()


def dequant_mxfp4(blocks: np.ndarray) -> np.ndarray:
    # u8 e (E8M0); u8 qs[16]: low nibbles weights 0..15, high nibbles 16..31
    n = len(blocks)
    d = E8M0_HALF[field(blocks, 0, 1)]
    return scaled(_FP4, nibbles(field(blocks, 1, 16)), d, (n, 32))


def dequant_nvfp4(blocks: np.ndarray) -> np.ndarray:
    # u8 d[4] (UE4M3, one per 16 weights); u8 qs[32]: 8 bytes per 16-weight sub-block
    n = len(blocks)
    d = UE4M3_HALF[field(blocks, 0, 4)].reshape(n, 4, 1)
    codes = nibbles(field(blocks, 4, 32).reshape(n, 4, 8))
    return scaled(_FP4, codes, d, (n, 64))


# GGML type name -> dequantizer (strata.kernels.dequant maps names to ids via ggml_types).
DEQUANTIZERS = {
    "F32": _plain("<f4"),
    "F16": _plain("<f2"),
    "BF16": dequant_bf16,
    "F64": _plain("<f8"),
    "I8": _plain("i1"),
    "I16": _plain("<i2"),
    "I32": _plain("<i4"),
    "I64": _plain("<i8"),
    "Q4_0": dequant_q4_0,
    "Q4_1": dequant_q4_1,
    "Q5_0": dequant_q5_0,
    "Q5_1": dequant_q5_1,
    "Q8_0": dequant_q8_0,
    "Q8_1": dequant_q8_1,
    "Q1_0": dequant_q1_0,
    "Q2_0": dequant_q2_0,
    "TQ1_0": dequant_tq1_0,
    "TQ2_0": dequant_tq2_0,
    "MXFP4": dequant_mxfp4,
    "NVFP4": dequant_nvfp4,
}
