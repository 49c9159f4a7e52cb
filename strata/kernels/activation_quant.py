"""Activation quantization for the native mat-vec kernels (llama.cpp's MMVQ style, Q8_1).

Before a quantized mat-vec, each activation column is cut into blocks of 32 values and each
block is quantized to int8 with one scale:

    d = amax / 127          (amax = max |x| over the block; d = 0 for an all-zero block)
    q = round(x / d)        (round half away from zero, as C's roundf; q = 0 when d = 0)
    s = d * sum(q)          (lets a kernel add a weight format's min/offset term as m * s)

Strata keeps d and s as float32 (llama.cpp packs them into a half2; the int8 codes are the
same). Keeping them in float32 means a mat-vec on these activations equals
dequant(W) @ (q * d) to float32 rounding, which is what the mirrors are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK8_1 = 32  # activation block length


@dataclass(frozen=True)
class QuantizedActivations:
    q: np.ndarray  # int8 (ncols, k)
    d: np.ndarray  # float32 (ncols, k // 32): per-block scale
    s: np.ndarray  # float32 (ncols, k // 32): d * sum(q) per block

    @property
    def ncols(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    def take(self, cols: np.ndarray) -> "QuantizedActivations":
        """The activations of a subset of columns (for per-expert dispatch)."""
        return QuantizedActivations(self.q[cols], self.d[cols], self.s[cols])

    def dequantize(self) -> np.ndarray:
        """float32 (ncols, k): q * d, the values the kernels actually multiply."""
        n, k = self.q.shape
        return (self.q.reshape(n, k // QK8_1, QK8_1).astype(np.float32) * self.d[:, :, None]).reshape(n, k)


def quantize_activations(x: np.ndarray) -> QuantizedActivations:
    """float (ncols, k) -> QuantizedActivations; k must be a multiple of 32."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    n, k = x.shape
    if k % QK8_1:
        raise ValueError(f"activation length {k} is not a multiple of {QK8_1}")
    blocks = x.reshape(n, k // QK8_1, QK8_1)
    amax = np.abs(blocks).max(axis=2)
    d = (amax / np.float32(127.0)).astype(np.float32)
    safe = np.where(d == 0, np.float32(1.0), d)
    ratio = blocks / safe[:, :, None]
    # roundf: half away from zero (np.round rounds half to even; trunc(r + 0.5) misrounds
    # 0.49999997 because the sum rounds up). r - trunc(r) is exact in float32.
    q = np.trunc(ratio)
    q += np.where(np.abs(ratio - q) >= 0.5, np.sign(ratio), np.float32(0.0))
    q = np.where(d[:, :, None] == 0, 0, q).astype(np.int8)
    s = (d * q.sum(axis=2, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return QuantizedActivations(q.reshape(n, k), d, s)
