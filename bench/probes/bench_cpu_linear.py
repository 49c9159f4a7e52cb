"""Small windows' mat-vecs on the CPU: one mat-vec per row over the whole weight (what the CPU backend does) vs
the weight walked in column blocks, every row's mat-vec per block (the block read from memory
once for all rows). Prints ms per call and the ratio to one row, for the test model's shapes.

  python bench/probes/bench_cpu_linear.py [--rows 1,2,3,4] [--blocks 64,128,256,512,1024] [--repeats 30]

Also checks that every way gives each row the bits of a lone row's mat-vec.
"""

from __future__ import annotations

import argparse
import time

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata.backend.cpu import CpuBackend, DenseWeight  # noqa: E402

_CPU = CpuBackend()

# (in, out) of SmolLM2-135M: q / o, k / v, gate+up (fused), down, the output head
SHAPES = [(576, 576), (576, 192), (576, 3072), (1536, 576), (576, 49152)]


def rowwise(x, wt):
    """What the CPU backend does for a window of up to ROWWISE_MAX rows."""
    return _CPU.linear(DenseWeight(wt, ("w",), (0,)), x)


def blocked(x, wt, width):
    out = np.empty((x.shape[0], wt.shape[1]), np.float32)
    for c in range(0, wt.shape[1], width):
        blk = wt[:, c : c + width]
        for j in range(x.shape[0]):
            np.matmul(x[j : j + 1], blk, out=out[j : j + 1, c : c + width])
    return out


def timed(fn, repeats):
    fn()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        best.append((time.perf_counter() - t0) / repeats)
    return min(best) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--blocks", default="128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    blocks = [int(b) for b in a.blocks.split(",")]
    rng = np.random.default_rng(0)
    print("| in x out | rows | rowwise ms | " + " | ".join(f"blocks of {b} ms" for b in blocks) + " | same bits |")
    print("|---|---:|---:|" + "---:|" * len(blocks) + "---|")
    for k, n in SHAPES:
        wt = rng.standard_normal((k, n)).astype(np.float32)
        x = rng.standard_normal((max(rows), k)).astype(np.float32)
        lone = rowwise(x, wt)
        for m in rows:
            xm = x[:m]
            same = all(np.array_equal(blocked(xm, wt, b), lone[:m]) for b in blocks)
            cells = [timed(lambda: rowwise(xm, wt), a.repeats)] + [timed(lambda b=b: blocked(xm, wt, b), a.repeats)
                                                                   for b in blocks]
            print(f"| {k} x {n} | {m} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
