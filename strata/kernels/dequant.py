"""Reference dequantization for every GGML type Strata knows (vectorized numpy, CPU).

    dequantize(type_id, raw, n_elements) -> float32[n_elements]
    DEQUANTIZERS[type_id](blocks uint8 (n_blocks, type_size)) -> float32 (n_blocks, block_size)

Results are bit-identical to ggml's scalar reference (`dequantize_row_*` in ggml-quants.c):
each family module does the same float32 operations in the same order. The type table
(strata.kernels.ggml_types) stays import-light; this module is where its rows meet code.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata.errors import StrataError
from strata.kernels import dequant_basic, dequant_iq, dequant_k
from strata.kernels.ggml_types import BY_ID, BY_NAME, GGMLType, type_by_id

Dequantizer = Callable[[np.ndarray], np.ndarray]

# Weights decoded per step by dequantize(): 1 MiB of float32 output, so temporaries fit in L2.
CHUNK_WEIGHTS = 1 << 18


def _by_id(*families: dict[str, Dequantizer]) -> dict[int, Dequantizer]:
    table: dict[int, Dequantizer] = {}
    for family in families:
        for name, fn in family.items():
            table[BY_NAME[name].id] = fn
    return table


DEQUANTIZERS: dict[int, Dequantizer] = _by_id(
    dequant_basic.DEQUANTIZERS, dequant_k.DEQUANTIZERS, dequant_iq.DEQUANTIZERS
)


def _ggml_type(type_id: int) -> GGMLType:
    gtype = type_by_id(type_id)
    if gtype is None or type_id not in DEQUANTIZERS:
        raise StrataError(f"GGML type id {type_id}: no dequantizer for this type")
    return gtype


def as_blocks(type_id: int, raw: np.ndarray | bytes | bytearray | memoryview, n_elements: int) -> np.ndarray:
    """View `raw` as (n_blocks, type_size) uint8 blocks holding exactly n_elements weights."""
    gtype = _ggml_type(type_id)
    if n_elements < 0 or n_elements % gtype.block_size:
        raise StrataError(
            f"{gtype.name}: {n_elements} elements is not a whole number of {gtype.block_size}-weight blocks"
        )
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8:
            raise StrataError(f"{gtype.name}: raw data must be uint8 bytes, got {raw.dtype}")
        data = np.ascontiguousarray(raw).reshape(-1)
    else:
        data = np.frombuffer(raw, dtype=np.uint8)
    expected = gtype.nbytes(n_elements)
    if data.size != expected:
        raise StrataError(
            f"{gtype.name}: {n_elements} elements need {expected} bytes, got {data.size}"
        )
    return data.reshape(-1, gtype.type_size)


def dequantize(type_id: int, raw: np.ndarray | bytes | bytearray | memoryview, n_elements: int) -> np.ndarray:
    """Decode n_elements weights of GGML type `type_id` from `raw` into a new float32 1-D array."""
    blocks = as_blocks(type_id, raw, n_elements)
    fn = DEQUANTIZERS[type_id]
    per_chunk = max(1, CHUNK_WEIGHTS // BY_ID[type_id].block_size)
    if not BY_ID[type_id].quantized or len(blocks) <= per_chunk:
        # Every dequantizer allocates its result, so this is the caller's own writable array.
        return fn(blocks).reshape(-1)
    # Large quantized tensors go chunk by chunk so the uint8/float32 temporaries stay in cache:
    # up to 1.3-2x faster than one pass over a 28M-weight tensor (bench/bench_kernels_dequant.py).
    # Plain types have no temporaries to save, so they take the single pass above.
    out = np.empty((len(blocks), BY_ID[type_id].block_size), dtype=np.float32)
    for start in range(0, len(blocks), per_chunk):
        out[start : start + per_chunk] = fn(blocks[start : start + per_chunk])
    return out.reshape(-1)


def dequantize_rows(type_id: int, rows: np.ndarray) -> np.ndarray:
    """(n_rows, row_bytes) uint8 tensor data -> (n_rows, row_len) float32 weights."""
    gtype = _ggml_type(type_id)
    if rows.ndim != 2 or rows.shape[1] % gtype.type_size:
        raise StrataError(f"{gtype.name}: rows of {rows.shape[-1]} bytes are not whole {gtype.type_size}-byte blocks")
    row_len = rows.shape[1] // gtype.type_size * gtype.block_size
    return dequantize(type_id, rows, rows.shape[0] * row_len).reshape(rows.shape[0], row_len)
