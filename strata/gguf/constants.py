"""Facts of the GGUF container format shared by the reader and the writer.

GGUF layout (little-endian): magic "GGUF", uint32 version, uint64 tensor count, uint64
metadata count, then the metadata key/value pairs, then one info record per tensor
(name, dims, ne[], ggml type, data offset relative to the data section), padding to the
alignment, then the tensor data.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
WRITE_VERSION = 3
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

# Keys llama.cpp's gguf-split writes into every shard of a split model.
SPLIT_NO_KEY = "split.no"
SPLIT_COUNT_KEY = "split.count"
SPLIT_TENSORS_COUNT_KEY = "split.tensors.count"


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size scalar types: struct code and numpy dtype (little-endian).
SCALAR_FORMATS: dict[ValueType, tuple[str, np.dtype]] = {
    ValueType.UINT8: ("<B", np.dtype("<u1")),
    ValueType.INT8: ("<b", np.dtype("<i1")),
    ValueType.UINT16: ("<H", np.dtype("<u2")),
    ValueType.INT16: ("<h", np.dtype("<i2")),
    ValueType.UINT32: ("<I", np.dtype("<u4")),
    ValueType.INT32: ("<i", np.dtype("<i4")),
    ValueType.FLOAT32: ("<f", np.dtype("<f4")),
    ValueType.BOOL: ("<?", np.dtype("?")),
    ValueType.UINT64: ("<Q", np.dtype("<u8")),
    ValueType.INT64: ("<q", np.dtype("<i8")),
    ValueType.FLOAT64: ("<d", np.dtype("<f8")),
}

# Numeric arrays longer than this come back as numpy arrays (token scores, token types);
# shorter ones as plain lists, which are friendlier for small settings.
NUMPY_ARRAY_MIN_LEN = 64


def align_up(offset: int, alignment: int) -> int:
    return offset + (-offset) % alignment
