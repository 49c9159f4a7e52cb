"""Where each field of a (well-formed) GGUF file lies, so mutants can hit one field exactly.

Deliberately independent of strata.gguf.reader: the fuzzer must not inherit the reader's idea
of the format it is testing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

HEADER_END = 24  # magic, version, tensor count, kv count
N_TENSORS_AT = 8
N_KV_AT = 16

# value type id -> byte size of one scalar (8 = string, 9 = array are handled apart)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass
class KVRecord:
    key: str
    start: int  # the key's length field
    vtype_at: int
    vtype: int
    value_at: int  # scalar bytes, a string's length field, or an array's element type
    end: int
    count_at: int | None = None  # arrays: where the element count lies
    string_len_at: list[int] = field(default_factory=list)  # string values / string array elements


@dataclass
class TensorRecord:
    name: str
    start: int  # the name's length field
    n_dims_at: int
    dims_at: list[int]
    type_at: int
    offset_at: int
    end: int
    dims: tuple[int, ...]
    type_id: int
    rel_offset: int


@dataclass
class Layout:
    size: int
    kvs: list[KVRecord]
    tensors: list[TensorRecord]
    info_end: int  # end of the last tensor info record
    data_start: int

    def kv(self, key: str) -> KVRecord:
        return next(r for r in self.kvs if r.key == key)

    def regions(self) -> dict[str, tuple[int, int]]:
        """Byte ranges mutations aim at: header, metadata, tensor infos, tensor data."""
        return {
            "header": (0, HEADER_END),
            "metadata": (HEADER_END, self.kvs[-1].end if self.kvs else HEADER_END),
            "tensor_info": (self.tensors[0].start, self.info_end) if self.tensors else (HEADER_END, HEADER_END),
            "data": (self.data_start, self.size),
        }


def _u32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _u64(buf: bytes, at: int) -> int:
    return struct.unpack_from("<Q", buf, at)[0]


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    """A GGUF string at pos (u64 length, bytes) and the position after it."""
    n = _u64(buf, pos)
    return buf[pos + 8 : pos + 8 + n].decode(), pos + 8 + n


def scan(buf: bytes, alignment: int = 32) -> Layout:
    n_tensors, n_kv = _u64(buf, N_TENSORS_AT), _u64(buf, N_KV_AT)
    pos = HEADER_END
    kvs = []
    for _ in range(n_kv):
        start = pos
        key, pos = _string(buf, pos)
        vtype_at, vtype = pos, _u32(buf, pos)
        pos += 4
        rec = KVRecord(key, start, vtype_at, vtype, pos, 0)
        if vtype == STRING:
            rec.string_len_at.append(pos)
            pos += 8 + _u64(buf, pos)
        elif vtype == ARRAY:
            etype, count = _u32(buf, pos), _u64(buf, pos + 4)
            rec.count_at = pos + 4
            pos += 12
            if etype == STRING:
                for _ in range(count):
                    rec.string_len_at.append(pos)
                    pos += 8 + _u64(buf, pos)
            else:
                pos += count * _SCALAR_SIZES[etype]
        else:
            pos += _SCALAR_SIZES[vtype]
        rec.end = pos
        kvs.append(rec)
        if key == "general.alignment":
            alignment = _u32(buf, rec.value_at)
    tensors = []
    for _ in range(n_tensors):
        start = pos
        name, pos = _string(buf, pos)
        n_dims_at, n_dims = pos, _u32(buf, pos)
        pos += 4
        dims_at = [pos + 8 * i for i in range(n_dims)]
        dims = tuple(_u64(buf, a) for a in dims_at)
        pos += 8 * n_dims
        type_at, type_id = pos, _u32(buf, pos)
        offset_at, rel = pos + 4, _u64(buf, pos + 4)
        pos += 12
        tensors.append(TensorRecord(name, start, n_dims_at, dims_at, type_at, offset_at, pos, dims, type_id, rel))
    data_start = pos + (-pos) % alignment
    return Layout(len(buf), kvs, tensors, pos, data_start)
