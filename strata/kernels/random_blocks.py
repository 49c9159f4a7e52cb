"""Random valid GGML blocks for synthetic packs and benchmarks at real tensor sizes.

    random_blocks(type_id, n_rows, row_len, rng, scale=0.02) -> uint8 (n_rows, row_bytes)

Quant bits are uniform random; every scale field is finite and chosen so the dequantized
weights have an RMS of about `scale` (per-block scales jitter by +-30% so blocks differ).
How: each type has a writer that fills random codes and sets its scale fields from a
per-block "super-scale" d. The RMS a type produces at d = 1 is measured once (by
dequantizing a fixed sample) and d is set to scale / that RMS. Every value in these blocks
is linear in d, so the calibration holds at any scale.
Plain types: F32/F16/BF16/F64 are normal(0, scale); integer types are uniform in [-8, 8].
"""

from __future__ import annotations

from functools import cache
import numpy as np

from strata.errors import StrataError
from strata.kernels.dequant import DEQUANTIZERS
from strata.kernels.dequant_basic import UE4M3_HALF
from strata.kernels.ggml_types import GGMLType, type_by_id

_JITTER = 0.3
_CALIBRATION_BLOCKS = 512


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = values.astype("<f2").reshape(-1, 1).view(np.uint8)


def _put_f32(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 4] = values.astype("<f4").reshape(-1, 1).view(np.uint8)


def _no_minus_128(region: np.ndarray) -> None:
    """int8 quants as ggml writes them: symmetric range [-127, 127]."""
    np.maximum(region.view(np.int8), -127, out=region.view(np.int8))


def _small(rng, n, lo, hi, shape=()):
    """Random integers in [lo, hi] as uint8, shape (n, *shape)."""
    return rng.integers(lo, hi + 1, size=(n, *shape), dtype=np.uint8)


# ---- writers: (blocks with random bytes, rng, d float32 (n,)) -> None, in place ------------


def _w_d_at(offset: int):
    """Types whose only scale is one f16 d at `offset` and whose codes are any bytes."""

    def write(blocks, rng, d):
        _put_f16(blocks, offset, d)

    return write


def _w_d_and_min(center: float):
    """Q4_1/Q5_1: half d, half m; m = -center * d puts the code range around zero."""

    def write(blocks, rng, d):
        _put_f16(blocks, 0, d)
        _put_f16(blocks, 2, -center * d)

    return write


def _w_q8_0(blocks, rng, d):
    _put_f16(blocks, 0, d)
    _no_minus_128(blocks[:, 2:34])


def _w_q8_1(blocks, rng, d):
    d16 = d.astype(np.float16)
    qs = blocks[:, 4:36]
    _no_minus_128(qs)
    total = qs.view(np.int8).sum(axis=1, dtype=np.int32).astype(np.float32)
    _put_f16(blocks, 0, d16)
    _put_f16(blocks, 2, d16.astype(np.float32) * total)  # s = d * sum(q), as ggml stores it


def _w_q8_k(blocks, rng, d):
    qs = blocks[:, 4:260]
    _no_minus_128(qs)
    bsums = qs.view(np.int8).reshape(len(blocks), 16, 16).sum(axis=2, dtype=np.int16)
    _put_f32(blocks, 0, d)
    blocks[:, 260:292] = bsums.astype("<i2").view(np.uint8)


def _w_ternary_2bit(codes_at: int, n_bytes: int, d_at: int):
    """Q2_0-like codes restricted to the ternary set {0, 1, 2} (TQ2_0 never stores 3)."""

    def write(blocks, rng, d):
        n = len(blocks)
        codes = _small(rng, n, 0, 2, (4, n_bytes))
        packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
        blocks[:, codes_at : codes_at + n_bytes] = packed
        _put_f16(blocks, d_at, d)

    return write


def _w_tq1_0(blocks, rng, d):
    # 5 trits per qs byte (value v in 0..242), 4 trits per qh byte (v in 0..80, scaled by 3);
    # stored as ceil(v * 256 / 243) so ggml's multiply-and-shift digit extraction recovers them.
    n = len(blocks)
    v = rng.integers(0, 243, size=(n, 48), dtype=np.uint16)
    blocks[:, 0:48] = ((v * 256 + 242) // 243).astype(np.uint8)
    vh = rng.integers(0, 81, size=(n, 4), dtype=np.uint16) * 3
    blocks[:, 48:52] = ((vh * 256 + 242) // 243).astype(np.uint8)
    _put_f16(blocks, 52, d)


def _w_mxfp4(blocks, rng, d):
    # E8M0 block scale (ggml halves it): 2**(e - 128) closest to d in log terms.
    e = np.clip(np.rint(np.log2(d)) + 128, 2, 254).astype(np.uint8)
    blocks[:, 0] = e


_UE4M3_CODES = np.arange(1, 0x7F)  # positive finite codes, increasing in value


def _w_nvfp4(blocks, rng, d):
    # Four UE4M3 sub-block scales per block, each the code nearest to d (times jitter).
    n = len(blocks)
    target = d[:, None] * rng.uniform(1 - _JITTER, 1 + _JITTER, size=(n, 4)).astype(np.float32)
    values = UE4M3_HALF[_UE4M3_CODES]
    pos = np.clip(np.searchsorted(values, target), 1, len(values) - 1)
    nearer_low = (target - values[pos - 1]) < (values[pos] - target)
    blocks[:, 0:4] = _UE4M3_CODES[pos - nearer_low].astype(np.uint8)


def _w_q2_k(blocks, rng, d):
    # scales[16]: low nibble = scale sc (8..15), high nibble = min m. With dmin = 2d,
    # m = round(0.75 sc) centres the codes 0..3 around 1.5.
    n = len(blocks)
    sc = _small(rng, n, 8, 15, (16,))
    m = np.rint(0.75 * sc).astype(np.uint8)
    blocks[:, 0:16] = sc | (m << 4)
    _put_f16(blocks, 80, d)
    _put_f16(blocks, 82, 2 * d)


def _pack_q3_k_scales(s: np.ndarray) -> np.ndarray:
    """16 six-bit scales (n, 16) -> the 12-byte Q3_K layout (inverse of dequant_k's unpacking)."""
    n = len(s)
    out = np.empty((n, 12), dtype=np.uint8)
    out[:, 0:8] = (s[:, 0:8] & 0xF) | ((s[:, 8:16] & 0xF) << 4)
    high = (s >> 4).reshape(n, 4, 4)  # [group g, k] -> bits 2g of byte 8 + k
    out[:, 8:12] = (high << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    return out


def _w_q3_k(blocks, rng, d):
    # Signed 6-bit scales (stored + 32), magnitude 16..31, random sign.
    n = len(blocks)
    mag = _small(rng, n, 16, 31, (16,)).astype(np.int16)
    sign = rng.integers(0, 2, size=(n, 16), dtype=np.int16) * 2 - 1
    blocks[:, 96:108] = _pack_q3_k_scales((mag * sign + 32).astype(np.uint8))
    _put_f16(blocks, 108, d)


def pack_k4_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(n, 8) six-bit scales and mins -> the 12-byte Q4_K/Q5_K layout."""
    out = np.empty((len(sc), 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _w_k4(center: float, min_ratio: int):
    """Q4_K/Q5_K: 6-bit scales 32..63; dmin = min_ratio * d and m = round(sc * center /
    min_ratio) centre the unsigned codes (0..15 or 0..31) around zero."""

    def write(blocks, rng, d):
        n = len(blocks)
        sc = _small(rng, n, 32, 63, (8,))
        m = np.rint(sc * (center / min_ratio)).astype(np.uint8)
        _put_f16(blocks, 0, d)
        _put_f16(blocks, 2, min_ratio * d)
        blocks[:, 4:16] = pack_k4_scales_mins(sc, m)

    return write


def _w_q6_k(blocks, rng, d):
    n = len(blocks)
    mag = rng.integers(32, 128, size=(n, 16), dtype=np.int16)
    sign = rng.integers(0, 2, size=(n, 16), dtype=np.int16) * 2 - 1
    blocks[:, 192:208] = (mag * sign).astype(np.int8).view(np.uint8)
    _put_f16(blocks, 208, d)


def _w_iq1_m(blocks, rng, d):
    # The f16 super-scale is spread over the top nibbles of the four u16 sub-scale words.
    bits = d.astype("<f2").view(np.uint16).astype(np.uint16)
    words = blocks[:, 48:56].copy().view("<u2") & np.uint16(0x0FFF)
    words |= ((bits[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & 0xF) << 12
    blocks[:, 48:56] = words.view(np.uint8)


# Quantized types: name -> writer. Everything not written stays uniform random bytes.
WRITERS = {
    "Q4_0": _w_d_at(0),
    "Q4_1": _w_d_and_min(7.5),
    "Q5_0": _w_d_at(0),
    "Q5_1": _w_d_and_min(15.5),
    "Q8_0": _w_q8_0,
    "Q8_1": _w_q8_1,
    "Q1_0": _w_d_at(0),
    "Q2_0": _w_d_at(0),
    "TQ1_0": _w_tq1_0,
    "TQ2_0": _w_ternary_2bit(0, 64, 64),
    "MXFP4": _w_mxfp4,
    "NVFP4": _w_nvfp4,
    "Q2_K": _w_q2_k,
    "Q3_K": _w_q3_k,
    "Q4_K": _w_k4(7.5, 8),
    "Q5_K": _w_k4(15.5, 16),
    "Q6_K": _w_q6_k,
    "Q8_K": _w_q8_k,
    "IQ2_XXS": _w_d_at(0),
    "IQ2_XS": _w_d_at(0),
    "IQ2_S": _w_d_at(0),
    "IQ3_XXS": _w_d_at(0),
    "IQ3_S": _w_d_at(0),
    "IQ1_S": _w_d_at(0),
    "IQ1_M": _w_iq1_m,
    "IQ4_NL": _w_d_at(0),
    "IQ4_XS": _w_d_at(0),
}


def _blocks_with_scale(gtype: GGMLType, n_blocks: int, rng: np.random.Generator, d: np.ndarray) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n_blocks, gtype.type_size), dtype=np.uint8)
    WRITERS[gtype.name](blocks, rng, d.astype(np.float32))
    return blocks


@cache
def unit_rms(type_id: int) -> float:
    """RMS of the dequantized weights of random blocks of this type at super-scale d = 1."""
    gtype = type_by_id(type_id)
    rng = np.random.default_rng(0x5EED)
    blocks = _blocks_with_scale(gtype, _CALIBRATION_BLOCKS, rng, np.ones(_CALIBRATION_BLOCKS))
    values = DEQUANTIZERS[type_id](blocks).astype(np.float64)
    return float(np.sqrt(np.mean(values * values)))


def _plain(gtype: GGMLType, n: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    if gtype.name.startswith("I"):
        return rng.integers(-8, 9, size=n, dtype=np.int8).astype(f"<i{gtype.type_size}").view(np.uint8)
    x = rng.standard_normal(size=n, dtype=np.float32)  # float32 draws: 2x faster than float64
    x *= np.float32(scale)
    if gtype.name == "F32":
        return x.view(np.uint8)
    if gtype.name == "F64":
        return x.astype("<f8").view(np.uint8)
    if gtype.name == "F16":
        return x.astype("<f2").view(np.uint8)
    # BF16: round the float32 to nearest-even on its top 16 bits (in place, one temporary).
    bits = x.view(np.uint32)
    carry = bits >> 16
    carry &= 1
    carry += np.uint32(0x7FFF)
    carry += bits
    carry >>= 16
    return carry.astype("<u2").view(np.uint8)


def random_blocks(
    type_id: int, n_rows: int, row_len: int, rng: np.random.Generator, scale: float = 0.02
) -> np.ndarray:
    """Random valid data of GGML type `type_id` for an (n_rows, row_len) weight matrix."""
    gtype = type_by_id(type_id)
    if gtype is None or (gtype.quantized and gtype.name not in WRITERS):
        raise StrataError(f"GGML type id {type_id}: random blocks not supported")
    if row_len % gtype.block_size:
        raise StrataError(f"{gtype.name}: row length {row_len} is not a multiple of {gtype.block_size}")
    row_bytes = gtype.row_bytes(row_len)
    n_blocks = n_rows * (row_len // gtype.block_size)
    if not gtype.quantized:
        return _plain(gtype, n_rows * row_len, rng, scale).reshape(n_rows, row_bytes)
    jitter = rng.uniform(1 - _JITTER, 1 + _JITTER, size=n_blocks).astype(np.float32)
    d = jitter * np.float32(scale / unit_rms(type_id))
    return _blocks_with_scale(gtype, n_blocks, rng, d).reshape(n_rows, row_bytes)

