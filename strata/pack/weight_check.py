"""NaN and Inf in a pack's weights, found at load instead of as garbage output (what llama.cpp's
--check-tensors looks for), at a small cost.

What is read of a tensor (SCALE_FIELDS tells where a block type keeps its scales, as the
dequantizers in strata/kernels read them):
- float tensors (F32, F16, BF16, F64): the values;
- block types: the f16 (Q8_K: f32) scale fields of the blocks, which multiply every weight of
  their block: one bad scale spoils 32 to 256 weights, while a bad code cannot be NaN;
- types without a plain float scale field (IQ1_M packs its scale into its sub-block bits,
  NVFP4 and MXFP4 use 8-bit exponent codes with no NaN, integer tensors): nothing.
A tensor of at most FULL_CHECK_BYTES is read whole; a larger one in SAMPLE_ROWS rows spread
over it (the first and the last among them), so the check reads a few MB of a big pack
and its time stays a small part of the load (docs/ARCHITECTURE.md gives the numbers).
"""

from __future__ import annotations

import numpy as np

from strata.errors import StrataError
from strata.kernels.ggml_types import GGMLType

FULL_CHECK_BYTES = 1 << 20
SAMPLE_ROWS = 64

# block type -> (byte offset, dtype) of each float scale field in its block
_F16 = "<f2"
SCALE_FIELDS: dict[str, tuple[tuple[int, str], ...]] = {
    "Q4_0": ((0, _F16),), "Q4_1": ((0, _F16), (2, _F16)), "Q5_0": ((0, _F16),), "Q5_1": ((0, _F16), (2, _F16)),
    "Q8_0": ((0, _F16),), "Q8_1": ((0, _F16), (2, _F16)), "Q1_0": ((0, _F16),), "Q2_0": ((0, _F16),),
    "TQ1_0": ((52, _F16),), "TQ2_0": ((64, _F16),),
    "Q2_K": ((80, _F16), (82, _F16)), "Q3_K": ((108, _F16),), "Q4_K": ((0, _F16), (2, _F16)),
    "Q5_K": ((0, _F16), (2, _F16)), "Q6_K": ((208, _F16),), "Q8_K": ((0, "<f4"),),
    "IQ2_XXS": ((0, _F16),), "IQ2_XS": ((0, _F16),), "IQ2_S": ((0, _F16),), "IQ3_XXS": ((0, _F16),),
    "IQ3_S": ((0, _F16),), "IQ1_S": ((0, _F16),), "IQ4_NL": ((0, _F16),), "IQ4_XS": ((0, _F16),),
}
# plain float storage -> its dtype
FLOAT_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": None, "F64": "<f8"}


def _rows_to_read(n_rows: int, row_bytes: int) -> np.ndarray:
    if n_rows * row_bytes <= FULL_CHECK_BYTES or n_rows <= SAMPLE_ROWS:
        return np.arange(n_rows)
    return np.unique(np.linspace(0, n_rows - 1, SAMPLE_ROWS).round().astype(np.int64))


# storage width -> (unsigned view, exponent bits): a float is NaN or Inf when they are all set
_EXPONENT = {2: ("<u2", 0x7C00), 4: ("<u4", 0x7F800000), 8: ("<u8", 0x7FF0000000000000)}
_BF16_EXPONENT = ("<u2", 0x7F80)  # bf16 is the high half of an f32


def _not_finite(words: np.ndarray, exponent: tuple[str, int]) -> np.ndarray:
    """words: unsigned ints of the float's width. Bit tests, no conversion to float."""
    view, bits = exponent
    return (words & np.asarray(bits, view)) == np.asarray(bits, view)


def _bad_row(gtype: GGMLType, rows: np.ndarray) -> tuple[int, str] | None:
    """(index into rows, what) of the first row with a non-finite value, rows (n, row_bytes)."""
    name = gtype.name
    n = rows.shape[0]
    if name in FLOAT_DTYPES:
        dtype = FLOAT_DTYPES[name]
        exponent = _BF16_EXPONENT if dtype is None else _EXPONENT[np.dtype(dtype).itemsize]
        flags = [_not_finite(rows.view(exponent[0]), exponent)]
        what = "a value"
    else:
        flags = []
        for offset, dtype in SCALE_FIELDS[name]:
            width = np.dtype(dtype).itemsize
            exponent = _EXPONENT[width]
            # the blocks as words of the scale's width: the scale is one column of them
            words = rows.view(exponent[0]).reshape(n, -1, gtype.type_size // width)[:, :, offset // width]
            flags.append(_not_finite(words, exponent))
        what = "a block scale"
    for f in flags:
        if np.count_nonzero(f):  # (a flat count is far cheaper than a per-row any; rows only on a hit)
            return int(np.flatnonzero(f.any(axis=1))[0]), what
    return None


def checked(name: str) -> bool:
    """Whether tensors of this type are looked at."""
    return name in SCALE_FIELDS or name in FLOAT_DTYPES


def check_tensor_values(info, label: str) -> None:
    """StrataError naming the tensor (and a row) when the read part of it holds NaN or Inf."""
    gtype = info.type
    if gtype is None or not checked(gtype.name) or info.nbytes == 0 or not info.shape:
        return
    row_bytes = gtype.row_bytes(int(info.shape[0]))
    if row_bytes <= 0 or info.nbytes % row_bytes:
        return  # (a shape the shape checks refuse)
    n_rows = info.nbytes // row_bytes
    data = info.data()
    which = _rows_to_read(n_rows, row_bytes)
    rows = data.reshape(n_rows, row_bytes)[which] if which.size < n_rows else data.reshape(n_rows, row_bytes)
    found = _bad_row(gtype, rows)
    if found is not None:
        i, what = found
        raise StrataError(f"pack {label}: tensor {info.name} ({gtype.name}) holds NaN or Inf ({what} in row "
                          f"{int(which[i])}); the file is damaged or was written wrong")


def check_weights(pack) -> None:
    """Every tensor of the pack, in file order (the check_tensor_values of each)."""
    for info in pack.tensors.values():
        check_tensor_values(info, pack.label)
