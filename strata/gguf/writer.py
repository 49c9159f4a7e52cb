"""GGUF v3 writer: metadata of every value type, tensors padded to the alignment.

Tensor data may be given whole (bytes / numpy array) or as a callable that yields chunks,
so a multi-gigabyte synthetic pack is streamed to disk without being held in memory.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Union

import numpy as np

from strata.gguf.constants import (
    ALIGNMENT_KEY,
    DEFAULT_ALIGNMENT,
    MAGIC,
    SCALAR_FORMATS,
    WRITE_VERSION,
    ValueType,
    align_up,
)
from strata.kernels.ggml_types import BY_ID

FullType = Union[ValueType, tuple[ValueType, ValueType]]
TensorData = Union[bytes, bytearray, memoryview, np.ndarray, Callable[[], Iterable[Any]]]

_DTYPE_TO_VTYPE = {dtype: vt for vt, (_, dtype) in SCALAR_FORMATS.items()}


def _int_type(values: Iterable[int]) -> ValueType:
    lo = min(values, default=0)
    hi = max(values, default=0)
    if -(2**31) <= lo and hi < 2**31:
        return ValueType.INT32
    if lo >= 0 and hi >= 2**63:
        return ValueType.UINT64
    return ValueType.INT64


def _scalar_type(values: list) -> ValueType:
    """The GGUF type of a homogeneous list of Python scalars (as the gguf package infers)."""
    if all(isinstance(v, str) for v in values):
        return ValueType.STRING
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return ValueType.BOOL
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return _int_type(int(v) for v in values)
    if all(isinstance(v, (int, float, np.integer, np.floating)) for v in values):
        return ValueType.FLOAT32
    raise TypeError(f"cannot store {values[:3]!r} in GGUF metadata")


def infer_type(value: Any) -> FullType:
    if isinstance(value, np.ndarray):
        return ValueType.ARRAY, _DTYPE_TO_VTYPE[value.dtype.newbyteorder("<")]
    if isinstance(value, np.generic):
        return _DTYPE_TO_VTYPE[value.dtype.newbyteorder("<")]
    if isinstance(value, (list, tuple)):
        return ValueType.ARRAY, (_scalar_type(list(value)) if value else ValueType.INT32)
    return _scalar_type([value])


def _pack_string(out: bytearray, s: str) -> None:
    raw = s.encode("utf-8", "surrogateescape")
    out += struct.pack("<Q", len(raw))
    out += raw


def _pack_value(out: bytearray, vtype: FullType, value: Any, key: str) -> None:
    if isinstance(vtype, tuple):
        _, etype = vtype
        out += struct.pack("<IIQ", ValueType.ARRAY, etype, len(value))
        if etype == ValueType.STRING:
            for s in value:
                _pack_string(out, s)
        else:
            out += np.asarray(value, dtype=SCALAR_FORMATS[etype][1]).tobytes()
        return
    out += struct.pack("<I", vtype)
    if vtype == ValueType.STRING:
        _pack_string(out, value)
    elif vtype == ValueType.ARRAY:
        raise ValueError(f"metadata {key}: array type needs its element type, (ARRAY, elem)")
    else:
        out += struct.pack(SCALAR_FORMATS[vtype][0], value)


@dataclass
class _PendingTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    nbytes: int
    data: TensorData


class GGUFWriter:
    """Collects metadata and tensors, then `write()`s one GGUF v3 file."""

    def __init__(self, path: str | Path, alignment: int = DEFAULT_ALIGNMENT):
        self.path = Path(path)
        self.alignment = alignment
        self.metadata: dict[str, tuple[FullType, Any]] = {}
        self.tensors: dict[str, _PendingTensor] = {}
        if alignment != DEFAULT_ALIGNMENT:
            self.add_metadata(ALIGNMENT_KEY, alignment, ValueType.UINT32)

    def add_metadata(self, key: str, value: Any, vtype: FullType | None = None) -> None:
        if vtype is None:
            vtype = infer_type(value)
        elif isinstance(vtype, tuple):
            vtype = (ValueType(vtype[0]), ValueType(vtype[1]))
        else:
            vtype = ValueType(vtype)
        self.metadata[key] = (vtype, value)
        if key == ALIGNMENT_KEY:
            self.alignment = int(value)

    def add_all_metadata(self, metadata: dict[str, Any], types: dict[str, FullType] | None = None) -> None:
        """Copy a reader's `.metadata` (with its `.metadata_types`, so the types survive)."""
        types = types or {}
        for key, value in metadata.items():
            self.add_metadata(key, value, types.get(key))

    def add_tensor(self, name: str, ggml_type: int, shape: Iterable[int], data: TensorData) -> None:
        """shape is in ggml order (ne0 = row length first); data holds exactly nbytes."""
        if name in self.tensors:
            raise ValueError(f"tensor {name} added twice")
        shape = tuple(int(d) for d in shape)
        gtype = BY_ID[ggml_type]
        if shape and shape[0] % gtype.block_size:
            raise ValueError(f"tensor {name}: ne0 {shape[0]} not a multiple of {gtype.name}'s block")
        nbytes = gtype.nbytes(prod(shape))
        if not callable(data) and memoryview(data).nbytes != nbytes:
            raise ValueError(f"tensor {name}: {memoryview(data).nbytes} bytes given, {nbytes} expected")
        self.tensors[name] = _PendingTensor(name, ggml_type, shape, nbytes, data)

    def _header(self) -> tuple[bytes, list[int]]:
        out = bytearray(MAGIC)
        out += struct.pack("<IQQ", WRITE_VERSION, len(self.tensors), len(self.metadata))
        for key, (vtype, value) in self.metadata.items():
            _pack_string(out, key)
            _pack_value(out, vtype, value, key)
        offsets, rel = [], 0
        for t in self.tensors.values():
            _pack_string(out, t.name)
            out += struct.pack("<I", len(t.shape))
            out += struct.pack(f"<{len(t.shape)}Q", *t.shape)
            out += struct.pack("<IQ", t.ggml_type, rel)
            offsets.append(rel)
            rel = align_up(rel + t.nbytes, self.alignment)
        out += bytes(align_up(len(out), self.alignment) - len(out))
        return bytes(out), offsets

    def file_size(self) -> int:
        """The bytes write() puts on disk (the header is built to count them)."""
        header, _ = self._header()
        return len(header) + sum(align_up(t.nbytes, self.alignment) for t in self.tensors.values())

    def write(self) -> Path:
        header, _ = self._header()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            f.write(header)
            for t in self.tensors.values():
                written = 0
                chunks = t.data() if callable(t.data) else (t.data,)
                for chunk in chunks:
                    view = memoryview(np.ascontiguousarray(chunk) if isinstance(chunk, np.ndarray) else chunk)
                    f.write(view)
                    written += view.nbytes
                if written != t.nbytes:
                    raise ValueError(f"tensor {t.name}: wrote {written} bytes, expected {t.nbytes}")
                f.write(bytes(align_up(written, self.alignment) - written))
        return self.path


def write_gguf(
    path: str | Path,
    metadata: dict[str, Any],
    tensors: Iterable[tuple[str, int, Iterable[int], TensorData]] = (),
    metadata_types: dict[str, FullType] | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> Path:
    """One-call form: tensors are (name, ggml_type, ne shape, data)."""
    w = GGUFWriter(path, alignment)
    w.add_all_metadata(metadata, metadata_types)
    for name, ggml_type, shape, data in tensors:
        w.add_tensor(name, ggml_type, shape, data)
    return w.write()
