"""What a native mat-vec kernel reads out of a weight block: integer codes and their scales.

A quantized mat-vec never widens weights to float. Per group of G weights (the format's
sub-block) it takes the integer dot of the weight codes (the stored integers, or codebook grid
values with their signs applied) with the int8 activations, and scales that integer sum once:

    weight[i] = scale[i // G] * code[i] + minc[i // Gm]          (minc only where the format has
                                                                 mins/offsets/deltas)
    y += scale[g] * d_act * sum(code * q_act)  +  minc[g'] * d_act * sum(q_act over g')

`Codes` carries that decomposition in weight order (so code i meets activation i, as in the
CUDA kernels' dp4a pairing). For Gm == 32 the min term uses the activation block's s = d*sum(q).
Each family module (mmvq_codes_basic, _k, _iq) maps a type name to a decoder
(n_blocks, type_size) uint8 -> Codes; tests check scale*code + minc against strata.kernels.dequant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Codes:
    codes: np.ndarray  # int8 (n_blocks, block_size), weight order
    group: int  # G: weights per scale
    scale: np.ndarray  # float32 (n_blocks, block_size // G)
    min_group: int = 32  # Gm: weights per min/offset coefficient
    minc: np.ndarray | None = None  # float32 (n_blocks, block_size // Gm) or None

    def weights(self) -> np.ndarray:
        """float32 (n_blocks, block_size): the weights these codes stand for (for tests)."""
        n, bs = self.codes.shape
        w = (self.codes.reshape(n, bs // self.group, self.group).astype(np.float32)
             * self.scale[:, :, None]).reshape(n, bs)
        if self.minc is not None:
            w = (w.reshape(n, bs // self.min_group, self.min_group) + self.minc[:, :, None]).reshape(n, bs)
        return w


def as_int8(values: np.ndarray, n: int, block_size: int) -> np.ndarray:
    """Small integer values (any dtype, exact) -> int8 (n, block_size)."""
    return np.ascontiguousarray(values.reshape(n, block_size)).astype(np.int8)
