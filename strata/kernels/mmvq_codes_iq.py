"""Kernel codes (see strata.kernels.mmvq_codes) for the IQ types.

Codes are the codebook grid values with their signs applied (int8, |v| <= 62), as the CUDA
kernels build them with a byte-wise XOR/subtract. Codebooks and sign tables come from
strata.kernels.dequant_iq. Differences from llama.cpp's CUDA MMVQ, on purpose:
  * IQ2_XXS/IQ2_XS/IQ2_S/IQ3_XXS: llama.cpp folds the sub-block scale into the integer sum with
    truncating integer division ((ls*sumi + sumi/2) / 4 and similar), which can lose up to one
    unit per sub-block; Strata applies the exact scale d*(0.5+ls)/4 in float32.
  * IQ1_S/IQ1_M: codes are grid + 1 (0..2) with the delta folded to (-1 +- 1/8), exactly as the
    CUDA kernels' iq1s_grid_gpu does; the delta enters through the activation sums.
"""

from __future__ import annotations

import numpy as np

from strata.kernels import dequant_iq as di
from strata.kernels.blockfields import bits_lsb, f16_scale, field, nibbles
from strata.kernels.iq_tables import KVALUES_IQ4NL
from strata.kernels.mmvq_codes import Codes, as_int8

_SIGNS7 = di.SIGNS7.astype(np.int8)  # (128, 8) +-1
_SIGN_BIT = np.array([1, -1], dtype=np.int8)
_KV = np.asarray(KVALUES_IQ4NL, dtype=np.int8)
_GRID = {name: getattr(di, f"GRID_{name}").astype(np.int8) for name in
         ("IQ2XXS", "IQ2XS", "IQ2S", "IQ3XXS", "IQ3S")}
_GRID_IQ1S_GPU = (di.GRID_IQ1S + 1).astype(np.int8)  # 0..2
_SEVEN_BIT_SHIFTS = np.array([0, 7, 14, 21], dtype=np.uint32)
_IQ1_DELTA_M1 = np.array([-1 + 0.125, -1 - 0.125], dtype=np.float32)  # delta - 1, by sign bit


def _u32(blocks, offset, count):
    return field(blocks, offset, count, "<u4").astype(np.uint32)


def _ls_quarter(d, ls):
    """d * (0.5 + ls) * 0.25 in float32 (the IQ2 sub-block scale)."""
    return (d * (np.float32(0.5) + ls.astype(np.float32))) * np.float32(0.25)


def codes_iq2_xxs(blocks):
    n = len(blocks)
    aux = _u32(blocks, 2, 16).reshape(n, 8, 2)[:, :, 1]
    grid_index = field(blocks, 2, 64).reshape(n, 8, 2, 4)[:, :, 0, :]
    sign_index = (aux[:, :, None] >> _SEVEN_BIT_SHIFTS) & 127
    q = _GRID["IQ2XXS"][grid_index] * _SIGNS7[sign_index]
    return Codes(as_int8(q, n, 256), 32, _ls_quarter(f16_scale(blocks, 0), aux >> 28))


def _half_scales(scales, d):
    # byte ib: low nibble scales weights 0-15 of the 32, high nibble 16-31
    return _ls_quarter(d, nibbles(scales[:, :, None]).reshape(len(scales), 16))


def codes_iq2_xs(blocks):
    n = len(blocks)
    qs = field(blocks, 2, 32, "<u2")
    q = _GRID["IQ2XS"][qs & 511] * _SIGNS7[qs >> 9]
    return Codes(as_int8(q, n, 256), 16, _half_scales(field(blocks, 66, 8), f16_scale(blocks, 0)))


def codes_iq2_s(blocks):
    n = len(blocks)
    high = (field(blocks, 66, 8)[:, :, None] >> di._QH_PAIR_SHIFTS) & 3
    index = field(blocks, 2, 32).astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << 8)
    signs = _SIGN_BIT[bits_lsb(field(blocks, 34, 32))].reshape(n, 32, 8)
    q = _GRID["IQ2S"][index] * signs
    return Codes(as_int8(q, n, 256), 16, _half_scales(field(blocks, 74, 8), f16_scale(blocks, 0)))


def codes_iq3_xxs(blocks):
    n = len(blocks)
    aux = _u32(blocks, 66, 8)
    sign_index = (aux[:, :, None] >> _SEVEN_BIT_SHIFTS) & 127
    values = _GRID["IQ3XXS"][field(blocks, 2, 64)].reshape(n, 8, 4, 8)
    q = values * _SIGNS7[sign_index][:, :, :, :]
    scale = (f16_scale(blocks, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32))) * np.float32(0.5)
    return Codes(as_int8(q, n, 256), 32, scale)


def codes_iq3_s(blocks):
    n = len(blocks)
    index = field(blocks, 2, 64).astype(np.uint16) | (bits_lsb(field(blocks, 66, 8)).astype(np.uint16) << 8)
    signs = _SIGN_BIT[bits_lsb(field(blocks, 74, 32))].reshape(n, 64, 4)
    q = _GRID["IQ3S"][index] * signs
    s = nibbles(field(blocks, 106, 4)[:, :, None]).reshape(n, 8).astype(np.int32)
    scale = f16_scale(blocks, 0) * (1 + 2 * s).astype(np.float32)
    return Codes(as_int8(q, n, 256), 32, scale)


def codes_iq1_s(blocks):
    n = len(blocks)
    qh = field(blocks, 34, 8, "<u2")
    high = ((qh[:, :, None] >> di._QH3_SHIFTS) & 7).reshape(n, 32)
    index = field(blocks, 2, 32).astype(np.uint16) | (high << 8)
    scale = f16_scale(blocks, 0) * (2 * ((qh >> 12) & 7).astype(np.int32) + 1).astype(np.float32)
    minc = scale * _IQ1_DELTA_M1[qh >> 15]
    return Codes(as_int8(_GRID_IQ1S_GPU[index], n, 256), 32, scale, 32, minc)


def codes_iq1_m(blocks):
    n = len(blocks)
    qh = nibbles(field(blocks, 32, 16)[:, :, None]).reshape(n, 32)  # one nibble per 8 weights
    index = field(blocks, 0, 32).astype(np.uint16) | ((qh & 7).astype(np.uint16) << 8)
    sc = field(blocks, 48, 4, "<u2")
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = d_bits.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]
    sub = ((sc[:, :, None] >> di._QH3_SHIFTS) & 7).reshape(n, 16)
    scale = d * (2 * sub.astype(np.int32) + 1).astype(np.float32)  # per 16 weights
    minc = np.repeat(scale, 2, axis=1) * _IQ1_DELTA_M1[qh >> 3]  # per 8 weights
    return Codes(as_int8(_GRID_IQ1S_GPU[index], n, 256), 16, scale, 8, minc)


def codes_iq4_nl(blocks):
    n = len(blocks)
    return Codes(as_int8(_KV[nibbles(field(blocks, 2, 16))], n, 32), 32, f16_scale(blocks, 0))


def codes_iq4_xs(blocks):
    n = len(blocks)
    low = nibbles(field(blocks, 4, 4)[:, :, None]).reshape(n, 8).astype(np.int32)
    high = (field(blocks, 2, 1, "<u2").astype(np.int32) >> np.arange(0, 16, 2)) & 3
    scale = f16_scale(blocks, 0) * ((low | (high << 4)) - 32).astype(np.float32)
    q = _KV[nibbles(field(blocks, 8, 128).reshape(n, 8, 16))]
    return Codes(as_int8(q, n, 256), 32, scale)


CODES = {
    "IQ2_XXS": codes_iq2_xxs,
    "IQ2_XS": codes_iq2_xs,
    "IQ2_S": codes_iq2_s,
    "IQ3_XXS": codes_iq3_xxs,
    "IQ3_S": codes_iq3_s,
    "IQ1_S": codes_iq1_s,
    "IQ1_M": codes_iq1_m,
    "IQ4_NL": codes_iq4_nl,
    "IQ4_XS": codes_iq4_xs,
}
