"""CUDA source for the lookup tables the MMVQ kernels read, generated from Strata's Python tables.

One source of truth: the IQ grids come from strata.kernels.dequant_iq (decoded from iq_tables),
the FP4 / IQ4_NL kvalues from iq_tables, the E8M0 / UE4M3 scale tables from dequant_basic.
The kernels index the grids per codeword, so each grid becomes an array of 4-byte words (IQ3)
or 8-byte words as uint2 (IQ2, IQ1). IQ1S bytes are stored as 8 * g + 16 (see mmvq_decode.cuh).
"""

from __future__ import annotations

import functools

import numpy as np


def _words(grid: np.ndarray, signed_bias: int = 0, mult: int = 1) -> np.ndarray:
    """(count, width) small integers -> uint32 words, byte 0 of each codeword lowest."""
    b = (grid.astype(np.int64) * mult + signed_bias).astype(np.int64)
    if b.min() < 0 or b.max() > 255:
        raise ValueError("grid bytes out of range")
    return np.ascontiguousarray(b.astype(np.uint8)).view("<u4").reshape(len(grid), -1)


def _c_uint2(name: str, words: np.ndarray) -> str:
    items = ",".join(f"{{0x{int(a):08x}u,0x{int(b):08x}u}}" for a, b in words)
    return f"__device__ const uint2 {name}[{len(words)}] = {{{items}}};\n"


def _c_u32(name: str, words: np.ndarray) -> str:
    items = ",".join(f"0x{int(a):08x}u" for a in words.reshape(-1))
    return f"__device__ const u32 {name}[{words.size}] = {{{items}}};\n"


def _c_f32_bits(name: str, values: np.ndarray) -> str:
    """float32 table as its bit patterns (exact, subnormals included); read with __uint_as_float."""
    return _c_u32(name, np.asarray(values, dtype=np.float32).view(np.uint32))


def _kv_defines(prefix: str, values) -> str:
    """The 16 kvalues as 4 words, both as #defines (NVFP4's lookups take them as constants) and
    as an array PREFIX_W the kernels copy to shared memory (IQ4_NL, IQ4_XS, MXFP4: read from
    there, the words stay in registers; as constants ptxas re-materialized them before every
    lookup)."""
    words = np.asarray(values, dtype=np.int8).view("<u4")
    return "".join(f"#define {prefix}_{i} 0x{int(w):08x}u\n" for i, w in enumerate(words)) + _c_u32(f"{prefix}_W", words)


@functools.cache
def table_source() -> str:
    from strata.kernels import dequant_basic as db
    from strata.kernels import dequant_iq as di
    from strata.kernels.iq_tables import KVALUES_FP4, KVALUES_IQ4NL

    parts = [
        _kv_defines("KV_IQ4NL", KVALUES_IQ4NL),
        _kv_defines("KV_FP4", KVALUES_FP4),
        _c_u32("GRID_IQ2XXS_W", _words(di.GRID_IQ2XXS)),
        _c_u32("GRID_IQ2XS_W", _words(di.GRID_IQ2XS)),
        _c_u32("GRID_IQ2S_W", _words(di.GRID_IQ2S)),
        _c_u32("GRID_IQ3XXS_W", _words(di.GRID_IQ3XXS)),
        _c_u32("GRID_IQ3S_W", _words(di.GRID_IQ3S)),
        _c_uint2("GRID_IQ1S", _words(di.GRID_IQ1S, signed_bias=16, mult=8)),
        _c_f32_bits("E8M0_HALF_BITS", db.E8M0_HALF),
        _c_f32_bits("UE4M3_HALF_BITS", db.UE4M3_HALF),
    ]
    return "".join(parts)
