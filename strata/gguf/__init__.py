"""GGUF container: our own reader (v2/v3, lazy, mmap) and writer (v3)."""

from strata.gguf.constants import ValueType
from strata.gguf.reader import GGUFFile, TensorInfo
from strata.gguf.writer import GGUFWriter, write_gguf

__all__ = ["GGUFFile", "GGUFWriter", "TensorInfo", "ValueType", "write_gguf"]
