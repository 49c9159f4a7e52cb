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
    """A float32 lookup table: table[codes] widens small integer codes in one gather."""
    return np.asarray(values, dtype=np.float32)


def scaled(table: np.ndarray, codes: np.ndarray, scale: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """float32 table[codes] * scale, computed as C does (one float32 product per weight).

    `scale` broadcasts against table[codes]; the result is reshaped to out_shape.
    """
    out = table[codes]
    np.multiply(out, scale, out=out)
    return out.reshape(out_shape)


def scaled_minus(table, codes, scale, offset, out_shape):
    """float32 (table[codes] * scale) - offset: two roundings, like `d * q - m` in C."""
    out = table[codes]
    np.multiply(out, scale, out=out)
    np.subtract(out, offset, out=out)
    return out.reshape(out_shape)


def scaled_plus(table, codes, scale, offset, out_shape):
    """float32 (table[codes] * scale) + offset, like `q * d + m` in C."""
    out = table[codes]
    np.multiply(out, scale, out=out)
    np.add(out, offset, out=out)
    return out.reshape(out_shape)
