"""Why is a 512-token window slow? Wall time of one prefill window (synchronised) with the
long-prompt GEMM path off/on (STRATA_CUDA_PREFILL=0/1), and for each a cProfile of the host side
of one window and the GPU time per op (gpu_step_profile.op_profile).

  python bench/probes/gpu_prefill_probe.py --pack P [--tokens 512]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.model.transformer import Span  # noqa: E402


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args()
    for prefill in ("0", "1"):
        os.environ["STRATA_CUDA_PREFILL"] = prefill
        core = EngineCore.load(parse_engine_args(["--pack", a.pack, "--device", "cuda"], serving=False), log=lambda s: None)
        m = core.model
        ids = np.random.default_rng(0).integers(100, 40000, a.tokens)

        def window():
            c = m.new_cache(4096, "f16")
            # a prompt's rows, marked as the scheduler marks long prompts (STRATA_CUDA_PREFILL=1: GEMM)
            m.forward(ids, [Span(c, 0, len(ids), long_prompt=len(ids) >= (m.b.long_prompt_tokens or 1 << 62))])
            cp.cuda.Device().synchronize()

        window()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            window()
            ts.append(time.perf_counter() - t0)
        print(f"STRATA_CUDA_PREFILL={prefill}: {a.tokens}-token window {min(ts) * 1e3:.1f} ms "
              f"({a.tokens / min(ts):.0f} tok/s)", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        window()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(8)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(r"strata/(backend|kernels)", 14)
        from gpu_step_profile import op_profile

        op_profile(m, 1000, None, 3, width=a.tokens, long_prompt=m.b.long_prompt_tokens is not None)
        core = m = None  # the model's weights go back to the pool before the next load
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
