"""The GGML type table: one row per type, the single source of truth for block layouts.

Every other part of Strata (the GGUF reader's size checks, dequantization, the native
kernel table, the probe, the pack writer) looks types up here instead of branching on ids.
Code per type lives elsewhere, keyed by these ids, so importing the table stays cheap:
`strata.kernels.dequant.DEQUANTIZERS[id]` (vectorized numpy reference dequantization) and
`strata.kernels.random_blocks.random_blocks(id, ...)` (random valid blocks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block
    quantized: bool  # False for plain float / integer storage

    def row_bytes(self, n_weights: int) -> int:
        """Bytes of one row of n_weights (n_weights must be a multiple of block_size)."""
        return (n_weights // self.block_size) * self.type_size

    def nbytes(self, n_elements: int) -> int:
        return (n_elements // self.block_size) * self.type_size


def _t(id_, name, block, size, quantized=True):
    return GGMLType(id_, name, block, size, quantized)


# Layouts as in ggml's ggml-common.h (mainline, 2026): ids are fixed by the GGUF format.
_ROWS = [
    _t(0, "F32", 1, 4, False),
    _t(1, "F16", 1, 2, False),
    _t(2, "Q4_0", 32, 18),
    _t(3, "Q4_1", 32, 20),
    _t(6, "Q5_0", 32, 22),
    _t(7, "Q5_1", 32, 24),
    _t(8, "Q8_0", 32, 34),
    _t(9, "Q8_1", 32, 36),
    _t(10, "Q2_K", 256, 84),
    _t(11, "Q3_K", 256, 110),
    _t(12, "Q4_K", 256, 144),
    _t(13, "Q5_K", 256, 176),
    _t(14, "Q6_K", 256, 210),
    _t(15, "Q8_K", 256, 292),
    _t(16, "IQ2_XXS", 256, 66),
    _t(17, "IQ2_XS", 256, 74),
    _t(18, "IQ3_XXS", 256, 98),
    _t(19, "IQ1_S", 256, 50),
    _t(20, "IQ4_NL", 32, 18),
    _t(21, "IQ3_S", 256, 110),
    _t(22, "IQ2_S", 256, 82),
    _t(23, "IQ4_XS", 256, 136),
    _t(24, "I8", 1, 1, False),
    _t(25, "I16", 1, 2, False),
    _t(26, "I32", 1, 4, False),
    _t(27, "I64", 1, 8, False),
    _t(28, "F64", 1, 8, False),
    _t(29, "IQ1_M", 256, 56),
    _t(30, "BF16", 1, 2, False),
    _t(34, "TQ1_0", 256, 54),
    _t(35, "TQ2_0", 256, 66),
    _t(39, "MXFP4", 32, 17),
    _t(40, "NVFP4", 64, 36),
    _t(41, "Q1_0", 128, 18),
    _t(42, "Q2_0", 64, 18),
]

BY_ID: dict[int, GGMLType] = {r.id: r for r in _ROWS}
BY_NAME: dict[str, GGMLType] = {r.name: r for r in _ROWS}
ALL_TYPES: tuple[GGMLType, ...] = tuple(_ROWS)


def type_by_id(type_id: int) -> GGMLType | None:
    return BY_ID.get(type_id)


def type_by_name(name: str) -> GGMLType:
    """Look a type up by name (case-insensitive); KeyError if unknown."""
    return BY_NAME[name.upper()]
