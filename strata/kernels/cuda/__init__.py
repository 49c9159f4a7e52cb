"""CUDA kernels for Strata (CuPy + NVRTC). Importing this package does not import CuPy;
the kernels compile at first use. See mmvq.py for the native quantized mat-vec."""

from __future__ import annotations


def register_native(table) -> None:
    """Fill a strata.kernels.native_table.NativeTable with the "cuda" rows (see native_table)."""
    from strata.kernels.cuda import mmvq

    mmvq.register(table)
