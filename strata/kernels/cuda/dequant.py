"""Device dequantization of GGUF weight rows (CuPy + NVRTC), for prefill GEMMs and embeddings.

Every type of mmvq_build.supported_types() (the native quantized types through the MMVQ chunk
decoders of mmvq_decode.cuh, and F32/F16/BF16). Float32 results equal
strata.kernels.dequant.dequantize bit for bit (compiled without fast math and without FMA
contraction); float16 results are those values rounded to nearest.

    dequantize_rows(type_id, blocks, rows, k, out=None, dtype=float16) -> (rows, k)
    dequantize_rows_f16(type_id, blocks, rows, k, out=None)             -> float16 (rows, k)
    get_rows(type_id, blocks, ids, k, out=None, dtype=float32)          -> (len(ids), k)
    to_f16(type_id, x, n_live, out)   prefill activations to float16 (+ zero padding rows)
    compile_all(type_ids=None, threads=8)

blocks: uint8 (rows, row_bytes) on the device, as the CUDA backend uploads weights (any
contiguous array of those bytes). get_rows takes int32 or int64 ids on the device and is
capturable in a CUDA graph when `out` is given (no host sync, no allocation): an id out of
range gives a NaN row. k must be a multiple of 32 (every quantized type's rows are).
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from strata.kernels.ggml_types import type_by_id

THREADS = 128  # DQ_THREADS of dequant.cu: chunks (of 32 weights) per thread block
_HERE = Path(__file__).parent
# No --use_fast_math (it flushes subnormal scales) and no FMA contraction: bit-exact float32.
_OPTIONS = ("-std=c++17", "--fmad=false")
_OUT_TYPES = {"float32": "float", "float16": "unsigned short"}
_ID_TYPES = {"int32": "int", "int64": "long long"}
_lock = threading.Lock()
_modules: dict[int, object] = {}


def _cp():
    import cupy

    return cupy


@functools.cache
def supported_types() -> tuple[int, ...]:
    from strata.kernels.cuda import mmvq_build

    return mmvq_build.supported_types()


@functools.cache
def _source() -> str:
    from strata.kernels.cuda.tables import table_source

    common, decode, chunk, kernel = (
        (_HERE / f).read_text() for f in ("mmvq_common.cuh", "mmvq_decode.cuh", "dequant_chunk.cuh", "dequant.cu"))
    return common + table_source() + decode + chunk + kernel


def _name(type_id: int, out_dtype: str, id_dtype: str) -> str:
    return f"dequant_rows<{type_id}, {_OUT_TYPES[out_dtype]}, {_ID_TYPES[id_dtype]}>"


def _names(type_id: int) -> list[str]:
    return [_name(type_id, o, i) for o in _OUT_TYPES for i in _ID_TYPES]


def _module(type_id: int):
    mod = _modules.get(type_id)
    if mod is None:
        mod = _cp().RawModule(code=_source(), options=_OPTIONS, name_expressions=_names(type_id))
        mod.compile()
        with _lock:
            _modules[type_id] = mod
    return mod


@functools.cache
def _function(type_id: int, out_dtype: str, id_dtype: str):
    return _module(type_id).get_function(_name(type_id, out_dtype, id_dtype))


def compile_all(type_ids=None, threads: int = 8) -> None:
    """Compile several types' modules at once (NVRTC runs outside the GIL)."""
    ids = [t for t in (type_ids or supported_types()) if t not in _modules]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(_module, ids))


def _table(type_id: int, blocks, k: int):
    """(GGMLType, uint8 device array of whole rows, row_bytes, number of rows)."""
    cp = _cp()
    t = type_by_id(type_id)
    if t is None or type_id not in supported_types():
        raise ValueError(f"dequant: no CUDA dequantizer for GGML type {t.name if t else type_id}")
    if k <= 0 or k % 32 or k % t.block_size:
        raise ValueError(f"dequant: {t.name} rows of {k} weights are not whole 32-weight chunks")
    w = blocks if isinstance(blocks, cp.ndarray) else cp.asarray(blocks)
    if w.dtype != cp.uint8:
        w = w.view(cp.uint8) if w.flags.c_contiguous else cp.ascontiguousarray(w).view(cp.uint8)
    if not w.flags.c_contiguous or w.data.ptr % 16:
        w = cp.ascontiguousarray(w).copy()  # decoders read aligned 4- and 16-byte fields
    row_bytes = t.row_bytes(k)
    if w.size % row_bytes:
        raise ValueError(f"dequant: {w.size} bytes are not whole {t.name} rows of {row_bytes} bytes")
    return t, w, row_bytes, w.size // row_bytes


def _output(out, shape, dtype, what: str):
    cp = _cp()
    if out is None:
        return cp.empty(shape, dtype=dtype)
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous or out.data.ptr % 16:
        raise ValueError(f"{what}: out must be a C-contiguous 16-byte aligned {np.dtype(dtype).name} "
                         f"array of shape {shape}, got {out.dtype} {out.shape}")
    return out


def _launch(type_id: int, w, row_bytes: int, k: int, n: int, ids, n_table: int, out) -> None:
    nchunks = n * (k // 32)
    if nchunks == 0:
        return
    id_dtype = "int32" if ids is None else np.dtype(ids.dtype).name
    fn = _function(type_id, np.dtype(out.dtype).name, id_dtype)
    grid = (-(-nchunks // THREADS),)
    fn(grid, (THREADS,), (w, np.int64(row_bytes), np.int32(k), np.int64(nchunks),
                          ids if ids is not None else np.uintp(0), np.int64(n_table), out))


def to_f16(type_id: int, x, n_live: int, out) -> None:
    """x float32 (>= n_live, k) on the device -> out float16 (m, k): rows < n_live rounded to
    nearest, the rest zero (the prefill GEMMs' activations and their padding). type_id: the
    weight whose module (already compiled) holds the kernel. k % 8 == 0, both 16-byte aligned."""
    total = int(out.size)
    live = n_live * int(out.shape[1])
    fn = _cast_function(type_id)
    fn((-(-total // (8 * THREADS)),), (THREADS,), (x, np.int64(live), np.int64(total), out))


@functools.cache
def _cast_function(type_id: int):
    return _module(type_id).get_function("f32_to_f16")


def dequantize_rows(type_id: int, blocks, rows: int, k: int, out=None, dtype=np.float16):
    """Weights (rows, k) of GGML type `type_id` from their blocks -> float16 or float32 (rows, k)."""
    dtype = np.dtype(dtype)
    if dtype.name not in _OUT_TYPES:
        raise ValueError(f"dequantize_rows: dtype must be float16 or float32, got {dtype}")
    t, w, row_bytes, n_table = _table(type_id, blocks, k)
    if n_table != rows:
        raise ValueError(f"dequantize_rows: {t.name} {rows} x {k} needs {rows * row_bytes} bytes, got {w.size}")
    out = _output(out, (rows, k), dtype, "dequantize_rows")
    _launch(type_id, w, row_bytes, k, rows, None, n_table, out)
    return out


def dequantize_rows_f16(type_id: int, blocks, rows: int, k: int, out=None):
    return dequantize_rows(type_id, blocks, rows, k, out=out, dtype=np.float16)


def get_rows(type_id: int, blocks, ids, k: int, out=None, dtype=np.float32):
    """Embedding lookup on the device: rows ids (int32/int64 device array, any shape) of the
    table `blocks` -> (ids.size, k) float32 (or float16). No host round trip."""
    cp = _cp()
    dtype = np.dtype(dtype)
    if dtype.name not in _OUT_TYPES:
        raise ValueError(f"get_rows: dtype must be float16 or float32, got {dtype}")
    _t, w, row_bytes, n_table = _table(type_id, blocks, k)
    if not isinstance(ids, cp.ndarray) or np.dtype(ids.dtype).name not in _ID_TYPES:
        raise ValueError("get_rows: ids must be an int32 or int64 cupy array")
    if not ids.flags.c_contiguous:
        ids = cp.ascontiguousarray(ids)
    n = int(ids.size)
    out = _output(out, (n, k), dtype, "get_rows")
    _launch(type_id, w, row_bytes, k, n, ids, n_table, out)
    return out
