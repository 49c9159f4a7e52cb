"""Reference quantization from float32 for the 8-bit activation/weight formats.

    quantize_q8_0(x) -> uint8 (..., n/32 * 34)    Q8_0 blocks, row-major like a GGUF row
    quantize_q8_1(x) -> uint8 (..., n/32 * 36)    Q8_1 blocks (d and s = d * sum(q))
    quantize_q8_k(x) -> uint8 (..., n/256 * 292)  Q8_K blocks (f32 d, i8 qs, i16 bsums)

x is float32 (..., n) with n a multiple of the block size; every leading axis is kept and the
last becomes the row's bytes. Rounding follows ggml's reference quantizers
(quantize_row_q8_0_ref / _q8_1_ref / _q8_K_ref in ggml-quants.c): float32 arithmetic,
roundf (ties away from zero) for Q8_0/Q8_1, nearest_int (ties to even) for Q8_K, and
round-to-nearest-even float32 -> f16 for the stored scales.
"""

from __future__ import annotations

import numpy as np

from strata.errors import StrataError


def _blocks(x: np.ndarray, block: int, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block:
        raise StrataError(f"quantize {name}: last axis {x.shape[-1:]} is not a multiple of {block}")
    return x.reshape(-1, block)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf on float32 values: nearest integer, halves away from zero. Done in float64,
    where |v| + 0.5 is exact, so values just below a half do not round up."""
    a = np.floor(np.abs(v).astype(np.float64) + 0.5)
    return np.copysign(a, v)


def _q8_symmetric(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0/Q8_1 core: (blocks of 32 floats) -> (float32 d (n,), int8 q (n, 32))."""
    amax = np.max(np.abs(x), axis=1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = _roundf(x * inv[:, None]).astype(np.int8)
    return d.astype(np.float32), q


def _rows(blocks: np.ndarray, x_shape: tuple[int, ...], block: int, type_size: int) -> np.ndarray:
    return blocks.reshape(*x_shape[:-1], x_shape[-1] // block * type_size)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    shape = np.shape(x)
    xb = _blocks(x, 32, "Q8_0")
    d, q = _q8_symmetric(xb)
    out = np.empty((len(xb), 34), dtype=np.uint8)
    out[:, 0:2] = d.astype("<f2").reshape(-1, 1).view(np.uint8)
    out[:, 2:34] = q.view(np.uint8)
    return _rows(out, shape, 32, 34)


def quantize_q8_1(x: np.ndarray) -> np.ndarray:
    shape = np.shape(x)
    xb = _blocks(x, 32, "Q8_1")
    d, q = _q8_symmetric(xb)
    total = q.sum(axis=1, dtype=np.int32).astype(np.float32)
    out = np.empty((len(xb), 36), dtype=np.uint8)
    out[:, 0:2] = d.astype("<f2").reshape(-1, 1).view(np.uint8)
    # ggml: s = fp16(sum * d) with the float32 d, before d itself was rounded to f16.
    out[:, 2:4] = (total * d).astype("<f2").reshape(-1, 1).view(np.uint8)
    out[:, 4:36] = q.view(np.uint8)
    return _rows(out, shape, 32, 36)


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    shape = np.shape(x)
    xb = _blocks(x, 256, "Q8_K")
    n = len(xb)
    # The signed value of largest magnitude (first one on ties, like ggml's strict > scan).
    peak = xb[np.arange(n), np.argmax(np.abs(xb), axis=1)]
    nonzero = peak != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(nonzero, np.float32(-127) / peak, np.float32(0)).astype(np.float32)
    # nearest_int: float32 product rounded half-to-even, then clamped to 127 from above.
    q = np.minimum(np.rint(xb * iscale[:, None]), 127).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(nonzero, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    bsums = q.reshape(n, 16, 16).sum(axis=2, dtype=np.int16)
    out = np.empty((n, 292), dtype=np.uint8)
    out[:, 0:4] = d.astype("<f4").reshape(-1, 1).view(np.uint8)
    out[:, 4:260] = q.view(np.uint8)
    out[:, 260:292] = bsums.astype("<i2").view(np.uint8)
    return _rows(out, shape, 256, 292)
