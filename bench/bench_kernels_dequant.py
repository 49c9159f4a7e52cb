"""Dequantization and random-block speed per GGML type (single thread, numpy).

    python bench/bench_kernels_dequant.py [--rows 49152 --cols 576] [--types Q4_0,Q6_K]

Prints M weights/s for `dequantize` (chunked) and for one whole-tensor call of the type's
DEQUANTIZERS entry, on one tensor of random valid blocks per type, and the time
`random_blocks` took to make it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from strata.kernels.dequant import DEQUANTIZERS, dequantize
from strata.kernels.ggml_types import ALL_TYPES, type_by_name
from strata.kernels.random_blocks import random_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=49152)
    ap.add_argument("--cols", type=int, default=576, help="row length (weights); rounded up to a block")
    ap.add_argument("--types", default="", help="comma-separated type names (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    types = [type_by_name(n) for n in args.types.split(",")] if args.types else list(ALL_TYPES)
    rng = np.random.default_rng(0)
    print(f"{'type':8s} {'cols':>6s} {'dequant M w/s':>14s} {'one pass M w/s':>15s} {'random_blocks s':>16s}")
    for gtype in types:
        cols = -(-args.cols // gtype.block_size) * gtype.block_size
        t0 = time.perf_counter()
        data = random_blocks(gtype.id, args.rows, cols, rng)
        t_rand = time.perf_counter() - t0
        n = args.rows * cols
        chunked = _best(lambda: dequantize(gtype.id, data, n), args.repeat)
        whole = _best(lambda: DEQUANTIZERS[gtype.id](data.reshape(-1, gtype.type_size)), args.repeat)
        print(f"{gtype.name:8s} {cols:6d} {n / chunked / 1e6:14.1f} {n / whole / 1e6:15.1f} {t_rand:16.3f}")


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best

if __name__ == "__main__":
    main()
