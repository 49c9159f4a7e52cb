"""Where a decode step's time goes on the GPU (B=1): the model window (graph replay or eager),
the logits head, the host copy + argmax, and the scheduler around them.

  python bench/probes/gpu_step_profile.py --pack P [--steps 64]

Prints medians over the steps: wall time of forward() (host: the graph launch and input
copies, or every eager launch), GPU time of the window and of the head (CUDA events), the
host copy of the logits and argmax, and the scheduler's whole step (run_until_idle / tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.protocol import GenerationRequest, SamplingParams  # noqa: E402
from strata.model.transformer import Span  # noqa: E402


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    core = EngineCore.load(parse_engine_args(["--pack", a.pack, "--device", "cuda"], serving=False), log=lambda s: None)
    m = core.model
    rng = np.random.default_rng(1)
    ids = rng.integers(100, m.n_vocab - 100, 16)
    c = m.new_cache(4096, "f16")
    m.forward(ids, [Span(c, 0, len(ids))])
    tok = int(ids[-1])
    rows = {k: [] for k in ("forward wall", "window gpu", "head gpu", "head wall", "copy+argmax wall", "step wall")}
    for i in range(a.steps + 8):
        cp.cuda.Device().synchronize()
        e0, e1, e2 = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        e0.record()
        h = m.forward(np.asarray([tok]), [Span(c, c.length, 1)])
        t1 = time.perf_counter()
        e1.record()
        lg = m.logits(h)
        e2.record()
        t2 = time.perf_counter()
        host = m.b.to_host(lg)
        tok = int(np.argmax(host[0]))
        t3 = time.perf_counter()
        if i >= 8:
            rows["forward wall"].append(t1 - t0)
            rows["head wall"].append(t2 - t1)
            rows["copy+argmax wall"].append(t3 - t2)
            rows["step wall"].append(t3 - t0)
            rows["window gpu"].append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
            rows["head gpu"].append(cp.cuda.get_elapsed_time(e1, e2) / 1e3)
    h = core.submit(GenerationRequest(ids.tolist(), SamplingParams(max_tokens=a.steps + 1, temperature=0.0, ignore_eos=True)))
    core.scheduler.run_until_idle()
    h.collect()
    h = core.submit(GenerationRequest(ids.tolist(), SamplingParams(max_tokens=a.steps + 1, temperature=0.0, ignore_eos=True)))
    t0 = time.perf_counter()
    core.scheduler.run_until_idle()
    sched = (time.perf_counter() - t0) / (a.steps + 1)
    h.collect()
    print(f"pack: {a.pack}")
    print("| part (B=1 decode step) | ms |")
    print("|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {statistics.median(v) * 1e3:.3f} |")
    print(f"| scheduler step (run_until_idle / tokens, incl. prefill) | {sched * 1e3:.3f} |")
    op_profile(m, tok, c, a.steps)
    return 0


def op_profile(m, tok, cache, steps, width: int = 1, long_prompt: bool = False):
    """GPU time per backend op over eager decode steps (CUDA events around each call, each op
    launched behind a 0.6 ms spin kernel so host launch time is not counted), and the achieved
    bandwidth of each linear (its weight bytes / its time). long_prompt: a prefill window's rows
    are marked as a long prompt's (the GEMM projections and tensor-core attention, where on)."""
    import collections

    import cupy as cp

    b = m.b
    saved_graphs, b.graphs = b.graphs, None
    events = []

    def label_of(name, args):
        if name in ("linear", "linear_experts", "linear_experts_pair"):
            w = args[0]
            tag = w.names[0].split(".")[-2] if hasattr(w, "names") else "experts"
            nbytes = sum(p.blocks.nbytes for p in w.parts) if hasattr(w, "parts") else 0
            return f"{name} {tag}", nbytes
        return name, 0

    spin = cp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""", "spin")
    cycles = np.int64(cp.cuda.Device().attributes["ClockRate"] * 1000 * 6e-4)  # ~0.6 ms

    def wrap(name, owner=b):
        f = getattr(owner, name)

        def w(*args, **kw):
            # the GPU spins while the host launches the op, so the events time the GPU alone
            spin((1,), (1,), (cycles,))
            e0 = cp.cuda.Event()
            e0.record()
            r = f(*args, **kw)
            e1 = cp.cuda.Event()
            e1.record()
            events.append((*label_of(name, args), e0, e1))
            return r

        setattr(owner, name, w)
        return f

    names = ("linear", "linear_experts", "linear_experts_pair", "add_rms_norm", "swiglu", "route", "combine_experts",
             "embed")
    originals = {n: wrap(n) for n in names}
    kernels = ("rope_kv_write", "attention_kv")  # attend's two launches, apart
    from strata.kernels.cuda import attention_prefill

    fk_originals = {n: wrap(n, b.fk) for n in kernels}
    fa_original = wrap("attention_prefill", attention_prefill)
    per = collections.defaultdict(list)
    nbytes = {}
    calls = collections.Counter()
    for i in range(min(steps, 8)):
        events.clear()
        if width == 1:
            h = m.forward(np.asarray([tok]), [Span(cache, cache.length, 1)])
        else:  # one prefill window of `width` tokens on a fresh cache
            fresh = m.new_cache(4096, "f16")
            # distinct tokens: an MoE routes them to many experts, as real text does
            ids = np.random.default_rng(i).integers(100, m.n_vocab - 100, width)
            h = m.forward(ids, [Span(fresh, 0, width, long_prompt=long_prompt)])[-1:]
        m.logits(h)
        cp.cuda.Device().synchronize()
        step = collections.defaultdict(float)
        for label, nb, e0, e1 in events:
            step[label] += cp.cuda.get_elapsed_time(e0, e1) / 1e3
            nbytes[label] = nb
            if i == 0:
                calls[label] += 1
        for k, v in step.items():
            per[k].append(v)
    for n, f in originals.items():
        setattr(b, n, f)
    for n, f in fk_originals.items():
        setattr(b.fk, n, f)
    attention_prefill.attention_prefill = fa_original
    b.graphs = saved_graphs
    total = sum(statistics.median(v) for v in per.values())
    print()
    what = f"one window of {width} token(s)" + (", a long prompt's" if long_prompt else "")
    print(f"| op (eager, {what}) | calls | GPU us / step | share | GB/s (weights) |")
    print("|---|---:|---:|---:|---:|")
    for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
        t = statistics.median(v)
        bw = f"{nbytes[k] * calls[k] / t / 1e9:.0f}" if nbytes.get(k) else ""
        print(f"| {k} | {calls[k]} | {t * 1e6:.1f} | {t / total:.0%} | {bw} |")
    print(f"| total of ops | | {total * 1e6:.1f} | | |")


if __name__ == "__main__":
    raise SystemExit(main())
