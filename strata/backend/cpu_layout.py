"""How the CPU backend lays a weight out for BLAS: float32, transposed to (in, out), C-contiguous.

Every matrix the CPU backend multiplies is made here, from a tensor's GGUF blocks: a linear
weight whole, an expert tensor one expert at a time. Dequantization is blockwise (strata.kernels
.dequant: the same float32 operations per block whatever the blocks around it), and a transpose
is a copy, so one expert's matrix made from its own blocks is bit-identical to that expert's
part of the whole tensor made at once: the expert pool (cpu_experts.py) relies on this.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from strata.backend.base import TensorSource
from strata.kernels.dequant import dequantize

# Stored transposed, (in, out) C-contiguous: OpenBLAS's mat-vec streams this layout at ~1.75x the
# bandwidth of the (out, in) one (23.8 vs 13.6 GB/s measured, one thread).
# Rows copied per step when a weight is transposed: a block of rows (and its columns of the
# result) stays in cache, where numpy's one-pass transposed copy strides through all of memory
# (the 49152 x 576 head: 135 vs 392 ms; the model loads ~0.5 s sooner).
TRANSPOSE_ROWS = 128


def transposed(mats: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """The rows of mats stacked, transposed, as one C-contiguous float32 array (in, sum of outs),
    written into `out` when given."""
    n_in = mats[0].shape[1]
    if out is None:
        out = np.empty((n_in, sum(m.shape[0] for m in mats)), np.float32)
    col = 0
    for m in mats:
        for r in range(0, m.shape[0], TRANSPOSE_ROWS):
            block = m[r : r + TRANSPOSE_ROWS]
            out[:, col + r : col + r + block.shape[0]] = block.T
        col += m.shape[0]
    return out


def dequantize_source(src: TensorSource) -> np.ndarray:
    """Dequantize a tensor to float32 shaped numpy-style (reverse of ggml's ne order)."""
    n = int(np.prod(src.shape))
    flat = dequantize(src.ggml_type, src.data(), n)
    return flat.reshape(tuple(reversed(src.shape)))


def expert_blocks(src: TensorSource) -> np.ndarray:
    """An expert tensor's blocks (ne [in, out, n_expert]) as (n_expert, one expert's bytes) uint8:
    a view of what data() gives (the pack's file map), not a copy."""
    return np.asarray(src.data()).reshape(int(src.shape[2]), -1)


def expert_matrix(type_id: int, blocks: np.ndarray, n_in: int, n_out: int, out: np.ndarray) -> np.ndarray:
    """One expert's matrix from its blocks (one row of expert_blocks): float32 (in, out) into `out`
    (n_in * n_out float32s, any shape that reshapes so), returned as (in, out)."""
    rows = dequantize(type_id, blocks, n_in * n_out).reshape(n_out, n_in)
    return transposed([rows], out=out.reshape(n_in, n_out))


def expert_matrices(src: TensorSource) -> np.ndarray:
    """Every expert of a tensor as float32 (n_expert, in, out), each transposed. Made expert by
    expert: the load's peak is the result and one expert's temporaries, not a second copy."""
    n_in, n_out, n_exp = (int(x) for x in src.shape)
    blocks = expert_blocks(src)
    wt = np.empty((n_exp, n_in, n_out), np.float32)
    for e in range(n_exp):
        expert_matrix(src.ggml_type, blocks[e], n_in, n_out, wt[e])
    return wt
