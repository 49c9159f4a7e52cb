"""GPU engine throughput: decode (B parallel sequences) and prefill, through the real scheduler.

  python bench/bench_gpu_engine.py --pack P [--batches 1,2,4,8] [--tokens 128] [--modes graphs,eager]
        [--ref 945,1488,2598,4530,49000] [--extra "--mtp D --spec 3 --batch-mtp"]

Measured like llama-batched-bench: B requests of a 16-token prompt at once; generation tok/s =
B x tokens / (time of a run generating 1 + tokens minus a run generating 1), greedy, EOS
ignored; prefill tok/s = 512 / time of one 512-token prompt generating 1 token. Median of 3
after a warm-up run (which also captures the CUDA graphs of each window shape). Modes:
graphs (default: CUDA graphs of decode windows), mmvqprefill (graphs, but long prompts' rows
through MMVQ instead of dequant + GEMM), tile64 / tile128 / tile256 (graphs, GEMM row tiles of 64 / 128 /
256 rows), ungrouped (graphs, but MoE prefill runs one
weight pass per (token, expert) pair instead of grouping pairs by expert), nosplit (graphs, but
a small matrix's columns looped by one warp instead of a grid row per column), headblocks (graphs,
but attention one block per query head in every window), gqadecode (graphs, one attention block
per KV group's heads in decode windows too), eager (STRATA_CUDA_GRAPHS=0: the same fused
kernels launched one by one), generic (STRATA_CUDA_FUSED=0), hostsample (graphs, but sampled rows
copied to the host and drawn by strata.sampling instead of on the device). --ref: llama.cpp's
numbers on the same machine (tg B=1, B=2, ... then pp512), printed as ratios. --sample
"temperature=0.8,top_p=0.95": sampled decoding (seeded) instead of greedy.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.backend.cuda import PROMPT_GEMM_ROWS  # noqa: E402
from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.protocol import GenerationRequest, SamplingParams  # noqa: E402

GRAPHS = {"STRATA_CUDA_GRAPHS": "1", "STRATA_CUDA_FUSED": "1", "STRATA_CUDA_GROUPED": "1", "STRATA_CUDA_ATT_GQA_MIN": "16",
          "STRATA_CUDA_PREFILL": "1", "STRATA_CUDA_PROMPT_TILE": str(PROMPT_GEMM_ROWS),
          "STRATA_CUDA_SPLIT_COLUMNS": "1"}
MODES = {"graphs": GRAPHS,
         "mmvqprefill": {**GRAPHS, "STRATA_CUDA_PREFILL": "0"},
         "tile64": {**GRAPHS, "STRATA_CUDA_PROMPT_TILE": "64"},
         "tile128": {**GRAPHS, "STRATA_CUDA_PROMPT_TILE": "128"},
         "tile256": {**GRAPHS, "STRATA_CUDA_PROMPT_TILE": "256"},
         "ungrouped": {**GRAPHS, "STRATA_CUDA_GROUPED": "0"},
         "nosplit": {**GRAPHS, "STRATA_CUDA_SPLIT_COLUMNS": "0"},
         "headblocks": {**GRAPHS, "STRATA_CUDA_ATT_GQA_MIN": str(1 << 30)},
         "gqadecode": {**GRAPHS, "STRATA_CUDA_ATT_GQA_MIN": "1"},
         "hostsample": {"STRATA_CUDA_GRAPHS": "1", "STRATA_CUDA_FUSED": "1"},
         "eager": {"STRATA_CUDA_GRAPHS": "0", "STRATA_CUDA_FUSED": "1"},
         "generic": {"STRATA_CUDA_GRAPHS": "0", "STRATA_CUDA_FUSED": "0"}}


SAMPLING: dict = {"temperature": 0.0}  # --sample replaces it


def timed(core, prompts, n):
    hs = [core.submit(GenerationRequest(list(p), SamplingParams(max_tokens=n, ignore_eos=True, seed=7, **SAMPLING)))
          for p in prompts]
    t0 = time.perf_counter()
    core.scheduler.run_until_idle()
    dt = time.perf_counter() - t0
    outs = [h.collect()[0] for h in hs]
    return dt, outs


def median_time(core, prompts, n, runs):
    return statistics.median(timed(core, prompts, n)[0] for _ in range(runs))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="graphs,eager")
    ap.add_argument("--ref", default="")
    ap.add_argument("--extra", default="")
    ap.add_argument("--sample", default="", help='e.g. "temperature=0.8,top_p=0.95" (default: greedy)')
    a = ap.parse_args()
    if a.sample:
        SAMPLING.clear()
        for kv in a.sample.split(","):
            k, v = kv.split("=")
            SAMPLING[k.strip()] = int(v) if k.strip() == "top_k" else float(v)
    batches = [int(b) for b in a.batches.split(",")]
    ref = [float(r) for r in a.ref.split(",")] if a.ref else []
    rng = np.random.default_rng(0)
    prompts = long = None  # drawn once: every mode gets the same prompts
    table = {}
    tokens_by_mode = {}
    for mode in a.modes.split(","):
        os.environ.update(MODES[mode])
        args = ["--pack", a.pack, "--device", "cuda", "--parallel", str(max(batches)), "--max-context", "4096",
                "--prefill", "512", *shlex.split(a.extra)]
        t0 = time.perf_counter()
        core = EngineCore.load(parse_engine_args(args, serving=False), log=lambda s: None)
        print(f"[{mode}] loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        if mode == "hostsample":
            core.model.b.samples_on_device = False
        vocab = core.model.n_vocab
        if prompts is None:
            prompts = [rng.integers(100, vocab - 100, 16).tolist() for _ in range(max(batches))]
            long = rng.integers(100, vocab - 100, a.prompt).tolist()
        for b in batches:
            ps = prompts[:b]
            timed(core, ps, 1 + a.tokens)  # warm-up: compiles, captures every window shape
            t1 = median_time(core, ps, 1, a.runs)
            tn = median_time(core, ps, 1 + a.tokens, a.runs)
            table[(mode, f"tg B={b}")] = b * a.tokens / max(tn - t1, 1e-9)
            print(f"[{mode}] B={b}: {table[(mode, f'tg B={b}')]:.1f} tok/s", flush=True)
        _, outs = timed(core, prompts[:1], 33)
        tokens_by_mode[mode] = outs[0]
        timed(core, [long], 1)
        tp = median_time(core, [long], 1, a.runs)
        table[(mode, f"pp{a.prompt}")] = a.prompt / tp
        print(f"[{mode}] pp{a.prompt}: {table[(mode, f'pp{a.prompt}')]:.1f} tok/s", flush=True)
        g = getattr(core.model.b, "graphs", None)
        if g is not None:
            print(f"[{mode}] graphs captured: {len(g.graphs)}, replays: {g.replays}", flush=True)
        core.close() if hasattr(core, "close") else None
        del core
    cols = [f"tg B={b}" for b in batches] + [f"pp{a.prompt}"]
    modes = a.modes.split(",")
    print()
    print(f"pack: {a.pack}  {a.extra}  sampling: {SAMPLING}")
    print("| mode | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for mode in modes:
        print(f"| {mode} | " + " | ".join(f"{table[(mode, c)]:.1f}" for c in cols) + " |")
    if ref:
        print("| llama.cpp | " + " | ".join(f"{r:.0f}" for r in ref) + " |")
        for mode in modes:
            print(f"| {mode} / llama.cpp | " + " | ".join(f"{table[(mode, c)] / r:.2f}" for c, r in zip(cols, ref)) + " |")
    if len(tokens_by_mode) > 1:
        first = next(iter(tokens_by_mode.values()))
        print("33 tokens (seeded) equal across modes:", all(t == first for t in tokens_by_mode.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
