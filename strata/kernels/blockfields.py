"""Read typed fields out of a (n_blocks, type_size) uint8 array of GGML blocks.

Every dequantizer starts by slicing its block struct apart; these helpers do the slicing
with little-endian views (GGUF is little-endian) so the per-type code reads like the
struct definitions in ggml-common.h. Views need only the last axis contiguous, which a
column slice of a C-contiguous block array always is.
"""

from __future__ import annotations

import numpy as np


def field(blocks: np.ndarray, offset: int, count: int, dtype: str = "u1") -> np.ndarray:
    """`count` consecutive values of `dtype` at byte `offset` of every block: (n_blocks, count)."""
    width = np.dtype(dtype).itemsize
    return blocks[:, offset : offset + count * width].view(dtype)


def f16_scale(blocks: np.ndarray, offset: int) -> np.ndarray:
    """One ggml_half per block widened to float32, shaped (n_blocks, 1) for broadcasting."""
    return field(blocks, offset, 1, "<f2").astype(np.float32)


def f32_scale(blocks: np.ndarray, offset: int) -> np.ndarray:
    return field(blocks, offset, 1, "<f4").astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., k) packed bytes -> (..., 2k) uint8: the k low nibbles, then the k high nibbles.

    This is the ggml order for 4-bit quants: byte j holds weights j and j + k.
    """
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def bits_lsb(packed: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 8k) uint8 of 0/1, bit 0 of byte 0 first."""
    return np.unpackbits(packed, axis=-1, bitorder="little")


def lut(values) -> np.ndarray:
    """A float32 lookup table, for codes whose values are not an affine function of the code
    (IQ4_NL kvalues, FP4, grids): table[codes] widens them in one gather."""
    return np.asarray(values, dtype=np.float32)


# Codes whose value is code + bias (most formats) are widened by a float32 conversion instead
# of a table gather: numpy converts uint8 -> float32 with SIMD, about 2x faster than a gather.
# Adding a small integer bias in float32 is exact, so (code + bias) * d rounds exactly like
# ggml's int (code + bias) times float d.


def as_f32(codes: np.ndarray, bias: int = 0) -> np.ndarray:
    """codes (small non-negative integers) + bias, as a new float32 array."""
    out = codes.astype(np.float32)
    if bias:
        out += np.float32(bias)
    return out


def nibbles_f32(qs: np.ndarray, bias: int = 0) -> np.ndarray:
    """Like nibbles(qs) + bias, but widened straight into float32 (no uint8 temporary):
    (..., k) bytes -> (..., 2k) float32, low nibbles first."""
    k = qs.shape[-1]
    out = np.empty(qs.shape[:-1] + (2, k), dtype=np.float32)
    np.bitwise_and(qs, 0x0F, out=out[..., 0, :], casting="unsafe")
    np.right_shift(qs, 4, out=out[..., 1, :], casting="unsafe")
    if bias:
        out += np.float32(bias)
    return out.reshape(qs.shape[:-1] + (2 * k,))


def scaled(table: np.ndarray, codes: np.ndarray, scale: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """float32 table[codes] * scale, computed as C does (one float32 product per weight).

    `scale` broadcasts against table[codes]; the result is reshaped to out_shape.
    """
    out = table[codes]
    np.multiply(out, scale, out=out)
    return out.reshape(out_shape)
