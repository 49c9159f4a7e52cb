"""Numpy mirrors of the native quantized mat-vec (MMVQ) kernels: the "cpu" rows of the native
kernel table, and the reference the CUDA kernels are checked against.

A mirror computes what the kernel computes, in the kernel's arithmetic:
  1. activations quantized per 32 values to int8 with a float32 scale d and sum s
     (strata.kernels.activation_quant);
  2. weights read as integer codes + per-group scales (+ mins) (strata.kernels.mmvq_codes*);
  3. per group of G weights an exact integer dot sum(code * q), times the group's weight scale
     and the activation d, plus min/offset terms as minc * s (or minc * d * sum(q) over the
     min group when it is not 32 wide); everything accumulated in float32.
The integer dots run as float32 matmuls: every |partial sum| stays below 2^24 (|code| <= 127,
|q| <= 127, 32 terms), so they are exact.

Plain float types (F32, F16, BF16) are mirrored as float32 dots of the unquantized activations.

    mmvq(type_id, w uint8 (rows, row_bytes), x float32 (ncols, k)) -> float32 (ncols, rows)
    mmvq_experts(type_id, w uint8 (n_expert, rows, row_bytes), expert_ids int (ncols, n_used),
                 x float32 (ncols, k)) -> float32 (ncols, n_used, rows)
"""

from __future__ import annotations

import numpy as np

from strata.kernels import mmvq_codes_basic, mmvq_codes_iq, mmvq_codes_k
from strata.kernels.activation_quant import QK8_1, QuantizedActivations, quantize_activations
from strata.kernels.dequant import DEQUANTIZERS
from strata.kernels.ggml_types import BY_NAME, type_by_id
from strata.kernels.mmvq_codes import Codes

# type id -> decoder (n_blocks, type_size) uint8 -> Codes
CODE_DECODERS = {BY_NAME[name].id: fn
                 for family in (mmvq_codes_basic.CODES, mmvq_codes_k.CODES, mmvq_codes_iq.CODES)
                 for name, fn in family.items()}
FLOAT_TYPES = frozenset(BY_NAME[n].id for n in ("F32", "F16", "BF16"))
MIRRORED_TYPES: tuple[int, ...] = tuple(sorted(FLOAT_TYPES | CODE_DECODERS.keys()))

# rows decoded at a time: bounds the float32 code copy and the (groups, rows, ncols) partial sums
_ROW_CHUNK = 4096


def _check(type_id: int, w: np.ndarray, k: int):
    t = type_by_id(type_id)
    if t is None or type_id not in MIRRORED_TYPES:
        raise ValueError(f"mmvq: no native mirror for GGML type {t.name if t else type_id}")
    if w.dtype != np.uint8 or w.ndim != 2:
        raise ValueError(f"mmvq: weights must be uint8 (rows, row_bytes), got {w.dtype} {w.shape}")
    if k % t.block_size or t.row_bytes(k) != w.shape[1]:
        raise ValueError(f"mmvq: {t.name} rows of {k} weights need {t.row_bytes(k)} bytes, "
                         f"got {w.shape[1]}")
    return t


def decode_codes(type_id: int, w: np.ndarray) -> Codes:
    """Codes of a (rows, row_bytes) weight matrix, one row of codes/scales per matrix row."""
    t = type_by_id(type_id)
    rows = w.shape[0]
    c = CODE_DECODERS[type_id](np.ascontiguousarray(w).reshape(-1, t.type_size))
    k = w.shape[1] // t.type_size * t.block_size
    minc = None if c.minc is None else c.minc.reshape(rows, k // c.min_group)
    return Codes(c.codes.reshape(rows, k), c.group, c.scale.reshape(rows, k // c.group), c.min_group, minc)


def _min_sums(act: QuantizedActivations, min_group: int) -> np.ndarray:
    """(ncols, k // Gm) float32: d * sum(q) per min group (s itself when Gm == 32)."""
    if min_group == QK8_1:
        return act.s
    n, k = act.q.shape
    sums = act.q.reshape(n, k // min_group, min_group).sum(axis=2, dtype=np.int32).astype(np.float32)
    return sums * np.repeat(act.d, QK8_1 // min_group, axis=1)


def _matvec_codes(c: Codes, act: QuantizedActivations) -> np.ndarray:
    """float32 (ncols, rows) from decoded codes and quantized activations."""
    rows, k = c.codes.shape
    ncols = act.ncols
    g = c.group
    ng = k // g
    # exact integer dots per group: (ng, rows, g) @ (ng, g, ncols) -> (ng, rows, ncols)
    wq = c.codes.reshape(rows, ng, g).transpose(1, 0, 2).astype(np.float32)
    aq = act.q.reshape(ncols, ng, g).transpose(1, 2, 0).astype(np.float32)
    sumi = np.matmul(wq, aq)
    # weight scale per (group, row), activation d per (group, col): the 32-block holding the group
    d_act = np.repeat(act.d, QK8_1 // g, axis=1) if g < QK8_1 else act.d
    sumi *= c.scale.T[:, :, None]
    sumi *= d_act.T[:, None, :]
    y = sumi.sum(axis=0, dtype=np.float32).T
    if c.minc is not None:
        y += _min_sums(act, c.min_group) @ c.minc.T
    return np.ascontiguousarray(y, dtype=np.float32)


def mmvq_quantized(type_id: int, w: np.ndarray, act: QuantizedActivations) -> np.ndarray:
    """Mat-vec on already-quantized activations (what one kernel launch receives)."""
    _check(type_id, w, act.k)
    rows = w.shape[0]
    out = np.empty((act.ncols, rows), dtype=np.float32)
    for r0 in range(0, rows, _ROW_CHUNK):
        r1 = min(rows, r0 + _ROW_CHUNK)
        out[:, r0:r1] = _matvec_codes(decode_codes(type_id, w[r0:r1]), act)
    return out


def _float_matvec(type_id: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    for r0 in range(0, rows, _ROW_CHUNK):
        r1 = min(rows, r0 + _ROW_CHUNK)
        blocks = np.ascontiguousarray(w[r0:r1]).reshape(-1, type_by_id(type_id).type_size)
        out[:, r0:r1] = x @ DEQUANTIZERS[type_id](blocks).reshape(r1 - r0, -1).T
    return out


def _as_x(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x[None, :] if x.ndim == 1 else x


def mmvq(type_id: int, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y[c, r] = sum_i W[r, i] * x[c, i] as the native kernel computes it. float32 (ncols, rows)."""
    x = _as_x(x)
    _check(type_id, w, x.shape[1])
    if type_id in FLOAT_TYPES:
        return _float_matvec(type_id, w, x)
    return mmvq_quantized(type_id, w, quantize_activations(x))


def mmvq_experts(type_id: int, w: np.ndarray, expert_ids: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per column c and used slot u: expert expert_ids[c, u]'s matrix times x[c].

    Activations are quantized once for all experts (as the kernel's shared Q8_1 buffer is);
    each expert then runs one mat-vec over the columns that picked it.
    """
    x = _as_x(x)
    ids = np.asarray(expert_ids)
    if w.ndim != 3:
        raise ValueError(f"mmvq_experts: weights must be (n_expert, rows, row_bytes), got {w.shape}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"mmvq_experts: expert_ids must be (ncols={x.shape[0]}, n_used), got {ids.shape}")
    n_expert, rows, _ = w.shape
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(f"mmvq_experts: expert id out of range 0..{n_expert - 1}")
    _check(type_id, w[0], x.shape[1])
    act = None if type_id in FLOAT_TYPES else quantize_activations(x)
    out = np.empty((x.shape[0], ids.shape[1], rows), dtype=np.float32)
    for e in np.unique(ids):
        cols, used = np.nonzero(ids == e)
        if act is None:
            y = _float_matvec(type_id, w[e], x[cols])
        else:
            y = mmvq_quantized(type_id, w[e], act.take(cols))
        out[cols, used] = y
    return out
