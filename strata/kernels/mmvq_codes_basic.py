"""Kernel codes (see strata.kernels.mmvq_codes) for the 32/64/128-weight formats, the ternary
TQ formats and the FP4 formats. Bit unpacking is shared with strata.kernels.dequant_basic.

Offsets follow the CUDA kernels: Q4_0 / Q5_0 keep the unsigned nibble as the code and subtract
8 / 16 through the activation sum (minc = -8d / -16d times s), Q4_1 / Q5_1 add m * s.
"""

from __future__ import annotations

import numpy as np

from strata.kernels import dequant_basic as db
from strata.kernels.blockfields import bits_lsb, f16_scale, field, nibbles
from strata.kernels.iq_tables import KVALUES_FP4
from strata.kernels.mmvq_codes import Codes, as_int8

_FP4 = np.asarray(KVALUES_FP4, dtype=np.int8)
_TQ1_DIGITS = db._TQ1_DIGITS.astype(np.int8)  # (256, 5): base-3 digit - 1


def codes_q4_0(blocks):
    n, d = len(blocks), f16_scale(blocks, 0)
    return Codes(as_int8(nibbles(field(blocks, 2, 16)), n, 32), 32, d, 32, np.float32(-8.0) * d)


def codes_q4_1(blocks):
    n = len(blocks)
    return Codes(as_int8(nibbles(field(blocks, 4, 16)), n, 32), 32, f16_scale(blocks, 0), 32,
                 f16_scale(blocks, 2))


def codes_q5_0(blocks):
    n, d = len(blocks), f16_scale(blocks, 0)
    q = db._five_bit(field(blocks, 2, 4), field(blocks, 6, 16))
    return Codes(as_int8(q, n, 32), 32, d, 32, np.float32(-16.0) * d)


def codes_q5_1(blocks):
    n = len(blocks)
    q = db._five_bit(field(blocks, 4, 4), field(blocks, 8, 16))
    return Codes(as_int8(q, n, 32), 32, f16_scale(blocks, 0), 32, f16_scale(blocks, 2))


def codes_q8_0(blocks):
    return Codes(np.ascontiguousarray(field(blocks, 2, 32, "i1")), 32, f16_scale(blocks, 0))


def _per_32(d: np.ndarray, block_size: int) -> np.ndarray:
    """One scale per block -> the same scale for each of its 32-weight groups."""
    return np.repeat(d, block_size // 32, axis=1)


def codes_q1_0(blocks):
    # sign bits: set -> +1, clear -> -1; one f16 scale for 128 weights
    n = len(blocks)
    q = bits_lsb(field(blocks, 2, 16)).astype(np.int8) * 2 - 1
    return Codes(as_int8(q, n, 128), 32, _per_32(f16_scale(blocks, 0), 128))


def codes_q2_0(blocks):
    # 2-bit codes c, value (c - 1) * d
    n = len(blocks)
    q = db._crumbs(field(blocks, 2, 16)).astype(np.int8) - 1
    return Codes(as_int8(q, n, 64), 32, _per_32(f16_scale(blocks, 0), 64))


def codes_tq2_0(blocks):
    n = len(blocks)
    qs = field(blocks, 0, 64).reshape(n, 2, 32)
    q = np.swapaxes(db._crumbs(qs), 2, 3).astype(np.int8) - 1  # (n, run, plane, byte)
    return Codes(as_int8(q, n, 256), 32, _per_32(f16_scale(blocks, 64), 256))


def codes_tq1_0(blocks):
    # digit planes as in dequant_basic.dequant_tq1_0: 32-byte run, 16-byte run, 4 qh bytes
    n = len(blocks)
    parts = (
        np.swapaxes(_TQ1_DIGITS[field(blocks, 0, 32)], 1, 2).reshape(n, 160),
        np.swapaxes(_TQ1_DIGITS[field(blocks, 32, 16)], 1, 2).reshape(n, 80),
        np.swapaxes(_TQ1_DIGITS[field(blocks, 48, 4)][:, :, :4], 1, 2).reshape(n, 16),
    )
    return Codes(np.concatenate(parts, axis=1), 32, _per_32(f16_scale(blocks, 52), 256))


def codes_mxfp4(blocks):
    # E2M1 values doubled as int8 codes; the E8M0 scale table carries the 1/2
    n = len(blocks)
    d = db.E8M0_HALF[field(blocks, 0, 1)]
    return Codes(as_int8(_FP4[nibbles(field(blocks, 1, 16))], n, 32), 32, d)


def codes_nvfp4(blocks):
    # four 16-weight sub-blocks, each with a UE4M3 scale (table carries the 1/2)
    n = len(blocks)
    d = db.UE4M3_HALF[field(blocks, 0, 4)]
    q = _FP4[nibbles(field(blocks, 4, 32).reshape(n, 4, 8))]
    return Codes(as_int8(q, n, 64), 16, d)


CODES = {
    "Q4_0": codes_q4_0,
    "Q4_1": codes_q4_1,
    "Q5_0": codes_q5_0,
    "Q5_1": codes_q5_1,
    "Q8_0": codes_q8_0,
    "Q1_0": codes_q1_0,
    "Q2_0": codes_q2_0,
    "TQ1_0": codes_tq1_0,
    "TQ2_0": codes_tq2_0,
    "MXFP4": codes_mxfp4,
    "NVFP4": codes_nvfp4,
}
