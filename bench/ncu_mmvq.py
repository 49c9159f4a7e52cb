"""Launch a few MMVQ kernels once each (1 column, 14336 x 4096) for Nsight Compute:

    ncu --clock-control none -k regex:_Z4mmvq --section SpeedOfLight ... python3 bench/ncu_mmvq.py Q1_0 Q4_K
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from strata.kernels.cuda import mmvq as gpu  # noqa: E402
from strata.kernels.ggml_types import type_by_name  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402


def main(names):
    rows, k = 14336, 4096
    rng = np.random.default_rng(0)
    for name in names:
        tid = type_by_name(name).id
        host = random_blocks(tid, 512, k, rng)
        w = cp.ascontiguousarray(cp.tile(cp.asarray(host), (rows // 512, 1)))
        act = gpu.quantize_q8_1(cp.asarray(rng.standard_normal((1, k)).astype(np.float32)))
        out = cp.empty((1, rows), dtype=cp.float32)
        gpu.mmvq(tid, w, rows, k, act, out=out)
        cp.cuda.get_current_stream().synchronize()
        print(name, "rows_per_warp", gpu._rows_per_warp(tid, f"mmvq<{tid}, 1>", rows),
              "resident warps", gpu._resident_warps(tid, f"mmvq<{tid}, 1>"),
              "regs", gpu._function(tid, f"mmvq<{tid}, 1>").num_regs)


if __name__ == "__main__":
    main(sys.argv[1:] or ["Q1_0", "Q4_K"])
