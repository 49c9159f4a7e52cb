"""GPU time of each kind of window graph in a real MTP run (events around every replay).

  python bench/probes/mtp_window_gpu_time.py --pack P [--draft D] [--parallel N]

Runs the held-out prompts once to capture the graphs, then again with CUDA events around every
WindowGraphs.run_fn call (they sit on the graph stream right before and after the replay) and
host clocks around each scheduler step and its forward call. Prints, per graph owner ("model",
"draft", "model+next-draft", ...), calls and mean GPU us per call, the wall time of steps and
forward calls (the gap is the scheduler's own host work); then the same
pieces of a fused window timed eagerly one by one (argmax, top_rows) on 2 rows.
Set STRATA_MTP_FUSED=1 to see fused windows.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import strata.batch.runner as runner_mod  # noqa: E402
from strata.mtp.defaults import default_draft_path  # noqa: E402
from strata.mtp.train.measure import chat_ids, load_core, run_prompts  # noqa: E402
from strata.mtp.train.prompts import HELD_OUT  # noqa: E402


def timed(cp, fn, reps=50):
    fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) * 1e3 / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    import cupy as cp

    n = a.parallel
    draft = str(a.draft or default_draft_path())
    for name, spec in (("plain", 0), ("mtp --spec 1", 1)):
        core = load_core(a.pack, draft if spec else None, spec, min_p=0.0, device="cuda", parallel=n, batch_mtp=n > 1 and spec > 0)
        prompts = [chat_ids(core, t) for kind in HELD_OUT for t in HELD_OUT[kind][:2]]
        run_prompts(core, prompts, a.max_tokens, concurrent=n)
        graphs = core.backend.graphs
        stats: dict[str, list[float]] = collections.defaultdict(list)
        orig = graphs.run_fn

        def run_fn(owner, *args, **kw):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(graphs.stream)
            out = orig(owner, *args, **kw)
            e.record(graphs.stream)
            e.synchronize()
            stats[str(owner[0])].append(cp.cuda.get_elapsed_time(s, e) * 1e3)
            return out

        # wall time of scheduler steps, and of their forward calls (launch to results on the host)
        sched = core.scheduler
        walls: dict[str, list[float]] = collections.defaultdict(list)

        def clocked(key, fn):
            def f(*args, **kw):
                t = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    walls[key].append((time.perf_counter() - t) * 1e6)
            return f

        step, fwd, fused = sched.step, sched.model.forward, runner_mod.forward_with_next_drafts
        sched.step = clocked("scheduler step", step)
        sched.model.forward = clocked("model.forward", fwd)
        runner_mod.forward_with_next_drafts = clocked("forward_with_next_drafts", fused)
        graphs.run_fn = run_fn
        r = run_prompts(core, prompts, a.max_tokens, concurrent=n)
        graphs.run_fn = orig
        sched.step, sched.model.forward, runner_mod.forward_with_next_drafts = step, fwd, fused
        print(f"== {name}, {n} at a time: {r.tokens} tokens, {r.decode_windows} decode windows, {r.tokens / r.seconds:.0f} tok/s, "
              f"{r.seconds / max(1, len(walls['scheduler step'])) * 1e6:.0f} us wall per step")
        print("| graph / call | calls | us per call (mean) | min |")
        print("|---|---:|---:|---:|")
        for k, v in stats.items():
            print(f"| GPU: {k} | {len(v)} | {sum(v) / len(v):.1f} | {min(v):.1f} |")
        for k, v in walls.items():
            print(f"| wall: {k} | {len(v)} | {sum(v) / len(v):.1f} | {min(v):.1f} |")
    b = core.backend
    z = cp.random.standard_normal((2, core.model.n_vocab), dtype=cp.float32)
    print(f"eager on (2, {z.shape[1]}): argmax_rows {timed(cp, lambda: b.argmax_rows(z)):.1f} us, "
          f"top_rows {timed(cp, lambda: b.top_rows(z)):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
