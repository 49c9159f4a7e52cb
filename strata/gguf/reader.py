"""Our own GGUF reader: struct parsing straight off a read-only mmap.

Opening a file parses only the header (metadata and tensor infos); tensor data stays in
the page cache until someone asks for it through `TensorInfo.data()`. The gguf package's
reader builds a numpy view per metadata array element, which costs ~2 s on a 49k-token
vocabulary; parsing strings in a tight struct loop costs a few tens of milliseconds.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from strata.errors import StrataError
from strata.gguf.constants import (
    ALIGNMENT_KEY,
    DEFAULT_ALIGNMENT,
    MAGIC,
    NUMPY_ARRAY_MIN_LEN,
    SCALAR_FORMATS,
    SUPPORTED_VERSIONS,
    ValueType,
    align_up,
)
from strata.kernels.ggml_types import GGMLType, type_by_id

MAX_DIMS = 4  # GGML_MAX_DIMS
MADV_RANDOM = getattr(mmap, "MADV_RANDOM", None)  # POSIX; Windows' maps take no such advice
MAX_ALIGNMENT = 1 << 16
MAX_ELEMENTS = 1 << 62  # far past any real tensor, and still safe for numpy's int64 sizes
# The fewest bytes one record can take: a metadata pair (empty key, type, one-byte value) and a
# tensor info (empty name, n_dims, type, offset). Counts are bounded by these before any loop.
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_INTEGER_TYPES = frozenset({ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
                            ValueType.INT32, ValueType.UINT64, ValueType.INT64})

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")


class _Truncated(Exception):
    """Raised inside the parser when a read would run past the end of the file."""


def shown(text, limit: int = 80) -> str:
    """A name or value from a file as it may appear in a one-line message: printable, bounded
    (a corrupt file's names can hold newlines, control bytes or megabytes)."""
    if isinstance(text, str) and text.isprintable() and len(text) <= limit:
        return text
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogateescape")
    if isinstance(text, (bytes, bytearray)):
        return repr(bytes(text[:limit])) + ("..." if len(text) > limit else "")
    if isinstance(text, (list, tuple, np.ndarray)) and len(text) > 4:
        return f"an array of {len(text)}"
    return shown(repr(list(text) if isinstance(text, np.ndarray) else text), limit)


@dataclass(frozen=True, eq=False)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order: ne0 (row length) first
    offset: int  # absolute byte offset in `path`
    nbytes: int
    path: Path
    _source: "GGUFFile" = field(repr=False, compare=False)

    @property
    def type(self) -> GGMLType:
        return type_by_id(self.ggml_type)

    @property
    def n_elements(self) -> int:
        return prod(self.shape)

    def data(self) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view of the file map (no copy)."""
        return self._source._view(self.offset, self.nbytes)

    def advise_random(self) -> bool:
        """Have the OS read this tensor's pages one at a time when first touched, without the
        read-around it gives a mapped file (a table read at random rows: otherwise each miss
        reads the device's read-ahead window, 128 KiB or more, for the page it needs). False
        where the OS takes no advice."""
        return self._source._advise_random(self.offset, self.nbytes)


class _Cursor:
    """Sequential little-endian reads over a buffer, raising _Truncated past its end."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf, pos: int = 0):
        self.buf = buf
        self.pos = pos
        self.end = len(buf)

    def take(self, n: int) -> int:
        start = self.pos
        if start + n > self.end:
            raise _Truncated
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", "surrogateescape")

    def strings(self, count: int) -> list[str]:
        # The hot loop of opening a model (vocabulary + merges): keep it flat.
        buf, pos, end = self.buf, self.pos, self.end
        unpack = _U64.unpack_from
        if count * 8 > end - pos:  # a corrupt count must not allocate a huge list
            raise _Truncated
        out = [None] * count
        for i in range(count):
            if pos + 8 > end:
                raise _Truncated
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > end:
                raise _Truncated
            out[i] = buf[pos : pos + n].decode("utf-8", "surrogateescape")
            pos += n
        self.pos = pos
        return out


class GGUFFile:
    """One GGUF file: `.metadata`, `.metadata_types`, `.tensors`, lazy tensor data."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise StrataError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise StrataError(f"{self.path}: is a directory, expected a .gguf file") from None
        except OSError as e:
            raise StrataError(f"{self.path}: cannot open ({e.strerror})") from None
        self.file_size = os.fstat(self._file.fileno()).st_size
        if self.file_size == 0:
            self._file.close()
            raise StrataError(f"{self.path}: not a GGUF file (empty)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._array: np.ndarray | None = None
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, ValueType | tuple[ValueType, ValueType]] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except _Truncated:
            raise StrataError(f"{self.path}: truncated file (header ends early)") from None

    # ----------------------------------------------------------------- parsing
    def _parse(self) -> None:
        buf = self._map
        if len(buf) < 4 or buf[:4] != MAGIC:
            raise StrataError(f"{self.path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf)
        cur.take(4)
        self.version = cur.u32()
        if self.version not in SUPPORTED_VERSIONS:
            hint = ""
            if self.version & 0xFFFF == 0 and (self.version >> 24) in SUPPORTED_VERSIONS:
                hint = " (big-endian GGUF is not supported)"
            raise StrataError(
                f"{self.path}: unsupported GGUF version {self.version}{hint}; "
                f"Strata reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        n_tensors = cur.u64()
        n_kv = cur.u64()
        # a corrupt count must be refused before it is looped over, not after
        room = self.file_size - cur.pos
        if n_kv * MIN_KV_BYTES > room:
            raise StrataError(f"{self.path}: metadata count {n_kv} is more than a file of {self.file_size} bytes holds")
        if n_tensors * MIN_TENSOR_INFO_BYTES > room:
            raise StrataError(f"{self.path}: tensor count {n_tensors} is more than a file of {self.file_size} bytes holds")
        for _ in range(n_kv):
            key = self._name(cur, "metadata key")
            if key in self.metadata:
                raise StrataError(f"{self.path}: metadata key {shown(key)} appears twice")
            vtype = self._value_type(cur.u32(), key)
            value, full_type = self._read_value(cur, vtype, key)
            self.metadata[key] = value
            self.metadata_types[key] = full_type
        self.alignment = self._alignment()

        infos = []
        for _ in range(n_tensors):
            name = self._name(cur, "tensor name")
            n_dims = cur.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise StrataError(f"{self.path}: tensor {shown(name)} has {n_dims} dimensions (1 to {MAX_DIMS} expected)")
            shape = tuple(cur.u64() for _ in range(n_dims))
            infos.append((name, shape, cur.u32(), cur.u64()))
        self.data_offset = align_up(cur.pos, self.alignment)
        for name, shape, type_id, rel_offset in infos:
            self._add_tensor(name, shape, type_id, rel_offset)
        self._check_overlaps()

    def _name(self, cur: _Cursor, what: str) -> str:
        """A key or tensor name: UTF-8 text (values may keep other bytes, names are what messages
        and listings print)."""
        name = cur.string()
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise StrataError(f"{self.path}: {what} {shown(name)} is not valid UTF-8") from None
        return name

    def _alignment(self) -> int:
        """general.alignment, needed to find the tensor data, so checked here and not later."""
        if ALIGNMENT_KEY not in self.metadata:
            return DEFAULT_ALIGNMENT
        value, vtype = self.metadata[ALIGNMENT_KEY], self.metadata_types[ALIGNMENT_KEY]
        where = f"{self.path}: metadata key {ALIGNMENT_KEY}"
        if vtype not in _INTEGER_TYPES:
            kind = f"an array of {vtype[1].name}" if isinstance(vtype, tuple) else vtype.name
            raise StrataError(f"{where}: must be an integer, found {kind} ({shown(value)})")
        if not 8 <= value <= MAX_ALIGNMENT or value & (value - 1):
            raise StrataError(f"{where}: must be a power of two from 8 to {MAX_ALIGNMENT}, found {value}")
        return int(value)

    def _check_overlaps(self) -> None:
        """Each tensor's bytes are its own: none starts inside the one laid out before it."""
        ordered = sorted(self.tensors.values(), key=lambda t: t.offset)
        for before, t in zip(ordered, ordered[1:]):
            if t.offset < before.offset + before.nbytes:
                raise StrataError(f"{self.path}: tensor {shown(t.name)}: its data (from byte {t.offset}) overlaps "
                                  f"tensor {shown(before.name)}'s (bytes {before.offset}..{before.offset + before.nbytes})")

    def _value_type(self, raw: int, key: str) -> ValueType:
        try:
            return ValueType(raw)
        except ValueError:
            raise StrataError(f"{self.path}: metadata key {shown(key)} has unknown value type {raw}") from None

    def _read_value(self, cur: _Cursor, vtype: ValueType, key: str):
        if vtype == ValueType.STRING:
            return cur.string(), vtype
        if vtype != ValueType.ARRAY:
            fmt, dtype = SCALAR_FORMATS[vtype]
            value = struct.unpack_from(fmt, cur.buf, cur.take(dtype.itemsize))[0]
            return value, vtype
        etype = self._value_type(cur.u32(), key)
        count = cur.u64()
        if etype == ValueType.ARRAY:
            raise StrataError(f"{self.path}: metadata key {shown(key)} is a nested array (not supported)")
        if etype == ValueType.STRING:
            return cur.strings(count), (ValueType.ARRAY, etype)
        _, dtype = SCALAR_FORMATS[etype]
        start = cur.take(count * dtype.itemsize)
        arr = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=start).copy()
        value = arr if count >= NUMPY_ARRAY_MIN_LEN else arr.tolist()
        return value, (ValueType.ARRAY, etype)

    def _add_tensor(self, name: str, shape: tuple[int, ...], type_id: int, rel_offset: int) -> None:
        where = f"{self.path}: tensor {shown(name)}"
        if name in self.tensors:
            raise StrataError(f"{where}: duplicate tensor name")
        gtype = type_by_id(type_id)
        if gtype is None:
            raise StrataError(f"{where}: unknown ggml type id {type_id}")
        if min(shape) < 1:
            raise StrataError(f"{where}: dimension ne{shape.index(min(shape))} is 0 (each must be >= 1)")
        if prod(shape) > MAX_ELEMENTS:
            raise StrataError(f"{where}: shape {list(shape)} has more elements than any file holds")
        ne0 = shape[0]
        if ne0 % gtype.block_size:
            raise StrataError(
                f"{where}: type {gtype.name} has blocks of {gtype.block_size} weights "
                f"but ne0 = {ne0} is not a multiple of it"
            )
        if rel_offset % self.alignment:
            raise StrataError(f"{where}: data offset {rel_offset} is not aligned to {self.alignment}")
        nbytes = gtype.nbytes(prod(shape))
        offset = self.data_offset + rel_offset
        if offset + nbytes > self.file_size:
            raise StrataError(
                f"{where}: truncated file (data ends at byte {offset + nbytes}, "
                f"file has {self.file_size})"
            )
        self.tensors[name] = TensorInfo(name, type_id, shape, offset, nbytes, self.path, self)

    # ------------------------------------------------------------------- data
    def _view(self, offset: int, nbytes: int) -> np.ndarray:
        if self._array is None:
            self._array = np.frombuffer(self._map, dtype=np.uint8)
        return self._array[offset : offset + nbytes]

    def _advise_random(self, offset: int, nbytes: int) -> bool:
        if MADV_RANDOM is None or nbytes == 0:
            return False
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes page-aligned starts
        self._map.madvise(MADV_RANDOM, start, offset + nbytes - start)
        return True

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")

    def close(self) -> None:
        """Release the map; fails quietly if tensor views are still alive (they keep it)."""
        self._array = None
        try:
            self._map.close()
        except BufferError:
            pass
        self._file.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"
