"""GPU time of every kernel of a decode window as the CUDA graph runs it.

  python bench/probes/gpu_kernel_profile.py --pack P [--width B] [--context N]

Records the kernel launches of one eager window of B tokens (one per sequence, each sequence
holding N tokens of context), then times each launch alone: a CUDA graph of 20 back-to-back
copies of it, replayed, timed with events (the per-launch gap inside a graph is counted, as in
the real window graph; every launch with PDL, as the engine captures it). Prints one row per kernel name (calls per window,
median us per call, us per window, share) and the sum against the whole window replayed as
one graph. Kernels are found by wrapping the launchers of strata.kernels.cuda.fused and .mmvq.
bench/probes/gpu_chain_profile.py gives what each kernel costs the chain instead.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.model.transformer import Span  # noqa: E402

REPEATS = 20


class Recorder:
    def __init__(self):
        self.on = False
        self.launches: list[tuple[str, object, tuple, tuple, tuple, dict]] = []

    def wrap(self, fn, name: str):
        rec = self

        class Launch:
            def __call__(self, grid, block, args, **kw):
                if rec.on:
                    rec.launches.append((name, fn, grid, block, args, kw))
                return fn(grid, block, args, **kw)

            def __getattr__(self, a):
                return getattr(fn, a)

        return Launch()


def install(rec: Recorder) -> None:
    from strata.kernels.cuda import experts, fused, mmvq_build

    fused_fn, mmvq_fn, quant_fn, pair_fn = fused._fn, mmvq_build.function, mmvq_build.quant_kernel, experts.pair_function
    fused._fn = lambda name: rec.wrap(fused_fn(name), name)
    mmvq_build.function = lambda tid, name: rec.wrap(mmvq_fn(tid, name), name)
    mmvq_build.quant_kernel = lambda: rec.wrap(quant_fn(), "quantize_q8_1")
    experts.pair_function = lambda a, b, aligned=False: rec.wrap(pair_fn(a, b, aligned), f"mmvq_ids_pair<{a}, {b}>")


def relaunch(fn, grid, block, args, kw) -> None:
    """One recorded launch again, as the engine makes it: with PDL while a graph is captured
    (mmvq_build's compiled functions through strata.kernels.cuda.launch; fused.py's launchers
    take that path themselves)."""
    from strata.kernels.cuda import launch

    if hasattr(fn, "kernel") or hasattr(fn, "ptr"):
        launch.launch(fn, grid, block, args, **kw)
    else:
        fn(grid, block, args, **kw)


def graph_time(cp, body, repeats: int = 5) -> float:
    """Median seconds of one replay of a graph captured from body()."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        body()
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
        times = []
        for _ in range(repeats):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            g.launch(s)
            e1.record(s)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return statistics.median(times)


def window_wall(cp, window, repeats: int) -> float:
    """Median seconds of window() (the engine's graph replay with its copies), wall."""
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    window()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        e0.record()
        window()
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return statistics.median(times)


def record_window(pack: str, width: int, context: int):
    """Load the pack on the GPU, give `width` sequences `context` tokens of cache, and record the
    kernel launches of one eager decode window (one token per sequence). Returns (window, the
    launches); window() runs that decode window again (graph replay) with the caches unchanged."""
    import cupy as cp

    rec = Recorder()
    install(rec)
    core = EngineCore.load(parse_engine_args(["--pack", pack, "--device", "cuda"], serving=False), log=lambda s: None)
    m = core.model
    rng = np.random.default_rng(1)
    caches = []
    for _ in range(width):
        c = m.new_cache(context + 64, "f16")
        m.forward(rng.integers(100, m.n_vocab - 100, context), [Span(c, 0, context)])
        caches.append(c)
    toks = rng.integers(100, m.n_vocab - 100, width)

    def window():
        spans = [Span(c, c.length, 1) for c in caches]
        h = m.forward(toks, spans, logit_rows=np.arange(width))
        for c in caches:
            c.length -= 1  # the next window writes the same positions again
        return h

    window()  # graph captured (whole-window timing below)
    saved, m.b.graphs = m.b.graphs, None
    window()  # compile everything the eager path needs
    rec.on = True
    window()
    rec.on = False
    m.b.graphs = saved
    cp.cuda.Device().synchronize()
    return window, list(rec.launches)


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--width", type=int, default=1, help="sequences in the window, one token each")
    ap.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache")
    a = ap.parse_args()
    window, launches = record_window(a.pack, a.width, a.context)

    def replay_all():
        for _, fn, grid, block, args, kw in launches:
            relaunch(fn, grid, block, args, kw)

    whole_kernels = graph_time(cp, replay_all)
    whole_window = window_wall(cp, window, 10)

    per = collections.defaultdict(list)
    for name, fn, grid, block, args, kw in launches:
        def body(fn=fn, grid=grid, block=block, args=args, kw=kw):
            for _ in range(REPEATS):
                relaunch(fn, grid, block, args, kw)
        label = f"{name} grid={tuple(grid)}" if name.startswith("mmv") else name
        per[label].append(graph_time(cp, body) / REPEATS)
    total = sum(sum(v) for v in per.values())
    print(f"pack {a.pack}: window of {a.width} token(s), context {a.context}, {len(launches)} launches")
    print("| kernel | calls | us / call | us / window | share |")
    print("|---|---:|---:|---:|---:|")
    for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {k} | {len(v)} | {statistics.median(v) * 1e6:.2f} | {sum(v) * 1e6:.1f} | {sum(v) / total:.0%} |")
    print(f"| sum of kernels timed alone | {len(launches)} | | {total * 1e6:.1f} | |")
    print(f"| the recorded launches as one graph | | | {whole_kernels * 1e6:.1f} | |")
    print(f"| the engine's window (graph replay + copies), wall | | | {whole_window * 1e6:.1f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
