"""Speed of the numpy MMVQ mirrors per type (a table; no assertions).

    python bench/bench_mmvq_numpy.py [--rows 1536] [--k 576] [--ncols 1,8]

Columns: ms per call of mmvq (decode codes + quantize activations + grouped integer dots) and,
for scale, of dequantize + float32 matmul on the same matrix.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from strata.kernels.dequant import DEQUANTIZERS
from strata.kernels.ggml_types import type_by_id
from strata.kernels.mmvq_numpy import MIRRORED_TYPES, mmvq
from strata.kernels.random_blocks import random_blocks


def best_ms(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--k", type=int, default=768, help="row length (multiple of 256)")
    ap.add_argument("--ncols", default="1,8")
    a = ap.parse_args()
    ncols = [int(c) for c in a.ncols.split(",")]
    rng = np.random.default_rng(0)
    print(f"rows {a.rows}, k {a.k}")
    print(f"{'type':8s} " + " ".join(f"{'mmvq n=' + str(n):>12s}" for n in ncols) + f" {'deq+matmul':>11s}")
    for tid in MIRRORED_TYPES:
        t = type_by_id(tid)
        w = random_blocks(tid, a.rows, a.k, rng)
        cells = []
        for n in ncols:
            x = rng.standard_normal((n, a.k)).astype(np.float32)
            cells.append(f"{best_ms(lambda: mmvq(tid, w, x)):10.2f}ms")
        x1 = rng.standard_normal((1, a.k)).astype(np.float32)
        ref = best_ms(lambda: x1 @ DEQUANTIZERS[tid](w.reshape(-1, t.type_size)).reshape(a.rows, a.k).T)
        print(f"{t.name:8s} " + " ".join(f"{c:>12s}" for c in cells) + f" {ref:9.2f}ms")


if __name__ == "__main__":
    main()
