"""Kernel codes (see strata.kernels.mmvq_codes) for the K-quants Q2_K..Q6_K.

Unpacking is shared with strata.kernels.dequant_k. Scales per 16 weights (Q2_K, Q3_K, Q6_K) or
32 (Q4_K, Q5_K); mins (Q2_K, Q4_K, Q5_K) enter as -dmin*m times the activation sum of their group.
"""

from __future__ import annotations

import numpy as np

from strata.kernels import dequant_k as dk
from strata.kernels.blockfields import f16_scale, field, nibbles
from strata.kernels.mmvq_codes import Codes, as_int8


def codes_q2_k(blocks):
    n = len(blocks)
    sc = field(blocks, 0, 16)
    scale = f16_scale(blocks, 80) * (sc & 0xF).astype(np.float32)
    minc = -(f16_scale(blocks, 82) * (sc >> 4).astype(np.float32))
    return Codes(as_int8(dk._two_bit_planes(field(blocks, 16, 64)), n, 256), 16, scale, 16, minc)


def codes_q3_k(blocks):
    n = len(blocks)
    low = dk._two_bit_planes(field(blocks, 32, 64))
    high = (field(blocks, 0, 32).reshape(n, 1, 1, 32) >> dk._HMASK_SHIFTS) & 1
    q = (low | (high << 2)).astype(np.int8) - 4
    scale = f16_scale(blocks, 108) * (dk._q3_k_scales(field(blocks, 96, 12)) - 32).astype(np.float32)
    return Codes(as_int8(q, n, 256), 16, scale)


def _k_scales(blocks):
    sc, m = dk.k4_scales_mins(field(blocks, 4, 12))
    scale = f16_scale(blocks, 0) * sc.astype(np.float32)
    minc = -(f16_scale(blocks, 2) * m.astype(np.float32))
    return scale, minc


def codes_q4_k(blocks):
    n = len(blocks)
    scale, minc = _k_scales(blocks)
    return Codes(as_int8(dk._four_bit_runs(field(blocks, 16, 128)), n, 256), 32, scale, 32, minc)


def codes_q5_k(blocks):
    n = len(blocks)
    scale, minc = _k_scales(blocks)
    high = (field(blocks, 16, 32).reshape(n, 1, 32) >> dk._SUB_BITS) & 1
    q = dk._four_bit_runs(field(blocks, 48, 128)) | (high << 4)
    return Codes(as_int8(q, n, 256), 32, scale, 32, minc)


def codes_q6_k(blocks):
    n = len(blocks)
    ql = field(blocks, 0, 128).reshape(n, 2, 64)
    qh = field(blocks, 128, 64).reshape(n, 2, 1, 32)
    low = nibbles(ql).reshape(n, 2, 4, 32)
    q = (low | (((qh >> dk._PLANE_SHIFTS) & 3) << 4)).astype(np.int8) - 32
    scale = f16_scale(blocks, 208) * field(blocks, 192, 16, "i1").astype(np.float32)
    return Codes(as_int8(q, n, 256), 16, scale)


CODES = {
    "Q2_K": codes_q2_k,
    "Q3_K": codes_q3_k,
    "Q4_K": codes_q4_k,
    "Q5_K": codes_q5_k,
    "Q6_K": codes_q6_k,
}
