"""Prefill experts: mmq_grouped (int8 tensor cores, long prompts' rows) against mmvq_grouped
(dp4a, the MMVQ bits) on the seed-moe pack's expert shapes, one 512-token window's pairs.

  python bench/bench_mmq.py [--tokens 512] [--experts 128] [--used 8] [--runs 20]

Each row: one expert matrix of the layer (gate and up read a token's row, down a row per pair),
the plan of random top-k ids and the quantized activations made once; each kernel launched
--runs times after a warm-up, timed with CUDA events, median. ms per call, their ratio, and the
largest relative difference of a pair's row between the two (float summation order only).
Knobs of mmvq_build (STRATA_MMVQ_*) apply, so two runs compare a change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.ggml_types import BY_NAME  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402

# (matrix, type, rows, k, a row per pair): seed-moe's gate, up and the two downs
SHAPES = [("gate", "IQ3_S", 640, 2048, False), ("up", "IQ3_XXS", 640, 2048, False),
          ("down", "Q2_0", 2048, 640, True), ("down", "IQ4_NL", 2048, 640, True)]


def timed(cp, fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def main() -> int:
    import cupy as cp

    from strata.kernels.cuda import experts as ex
    from strata.kernels.cuda import mmvq as mm

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(a.experts, a.used, replace=False) for _ in range(a.tokens)]).astype(np.int32)
    plan = ex.expert_plan(cp.asarray(ids), a.experts)  # tiles of GROUP_COLS (mmvq_grouped)
    wide = ex.expert_plan(cp.asarray(ids), a.experts, cols=ex.MMQ_COLS)  # of MMQ_COLS (mmq_grouped)
    print(f"{a.tokens} tokens x top-{a.used} of {a.experts} experts: {ids.size} pairs")
    print("| matrix | type | rows x k | mmvq_grouped ms | mmq_grouped ms | speed-up | max row diff |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, tname, rows, k, per_pair in SHAPES:
        t = BY_NAME[tname].id
        # the experts and their address table, made once (the table is what the kernels read)
        w = ex.resident_matrices(cp.asarray(random_blocks(t, a.experts * rows, k, rng).reshape(a.experts, rows, -1)))
        x = cp.asarray(rng.standard_normal((ids.size if per_pair else a.tokens, k)).astype(np.float32))
        q8 = mm.quantize_q8_1(x)
        plan.gathered = wide.gathered = None
        ref = ex.mmvq_experts_grouped(t, w, plan, q8, per_pair=per_pair)
        got = ex.mmq_experts_grouped(t, w, wide, q8, per_pair=per_pair)
        diff = float(cp.max(cp.linalg.norm(got - ref, axis=1) / cp.linalg.norm(ref, axis=1)))
        t_v = timed(cp, lambda: ex.mmvq_experts_grouped(t, w, plan, q8, per_pair=per_pair), a.runs)
        t_q = timed(cp, lambda: ex.mmq_experts_grouped(t, w, wide, q8, per_pair=per_pair), a.runs)
        print(f"| {name} | {tname} | {rows} x {k} | {t_v:.3f} | {t_q:.3f} | {t_v / t_q:.2f}x | {diff:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
