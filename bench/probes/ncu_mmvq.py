"""Launch a few MMVQ kernels once each (1 column, 14336 x 4096 unless --rows / --k) for Nsight
Compute, through mmvq.mmvq (the launch the engine makes):

    ncu --clock-control none -k regex:_Z4mmvq --section SpeedOfLight ... python3 bench/probes/ncu_mmvq.py Q1_0 Q4_K
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402

from strata.kernels.cuda import mmvq as gpu  # noqa: E402
from strata.kernels.cuda import mmvq_build  # noqa: E402
from strata.kernels.ggml_types import type_by_id, type_by_name  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402


def main(argv):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("names", nargs="*", default=["Q1_0", "Q4_K"])
    p.add_argument("--rows", type=int, default=14336)
    p.add_argument("--k", type=int, default=4096)
    a = p.parse_args(argv)
    names, rows, k = a.names, a.rows, a.k
    rng = np.random.default_rng(0)
    for name in names:
        tid = type_by_name(name).id
        host = random_blocks(tid, 512, k, rng)
        w = cp.ascontiguousarray(cp.tile(cp.asarray(host), (rows // 512, 1)))
        act = gpu.quantize_q8_1(cp.asarray(rng.standard_normal((1, k)).astype(np.float32)))
        out = cp.empty((1, rows), dtype=cp.float32)
        gpu.mmvq(tid, w, rows, k, act, out=out)
        cp.cuda.get_current_stream().synchronize()
        (ln,) = gpu.column_launches(tid, rows, 1, aligned=gpu.rows_aligned(w, type_by_id(tid).row_bytes(k)), k=k)
        print(name, ln.name, "rows_per_warp", ln.rpw, "grid", ln.grid, "block", ln.block, "dynamic smem", ln.smem,
              "regs", mmvq_build.function(tid, ln.name).num_regs)


if __name__ == "__main__":
    main(sys.argv[1:])
