"""Time to first token with prompt reuse: requests sharing a long prefix (a system prompt or a
document), through the real scheduler.

  python bench/prefix_ttft.py --pack P [--device cuda] [--prefix 4096] [--runs 3]

Per engine (--prefix-cache 1024 MiB, and 0 for the baseline): a cold request (prefix + question
A), then a second one sharing the prefix (prefix + question B), each generating one token;
TTFT = submit to first token, median of --runs fresh prefixes (a new random prefix per run, so
the first request of each run is cold). Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.protocol import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402


def ttft(core: EngineCore, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    h = core.submit(GenerationRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    first = None
    while True:
        ev = h.events.get(timeout=600)
        if isinstance(ev, TokenEvent) and first is None:
            first = time.perf_counter() - t0
        if not isinstance(ev, TokenEvent):
            return (first if first is not None else time.perf_counter() - t0), ev.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--extra", default="")
    a = ap.parse_args()
    rows = []
    for budget in (1024, 0):
        core = EngineCore.load(parse_engine_args(["--pack", a.pack, "--device", a.device, "--max-context",
                                                   str(a.prefix + 256), "--prefix-cache", str(budget)]
                                                  + a.extra.split(), serving=False), log=lambda s: None)
        core.start()
        vocab = core.cfg.vocab_size
        rng = np.random.default_rng(0)
        ttft(core, rng.integers(100, vocab - 100, 64).tolist())  # warm-up (kernels, graphs)
        cold, warm, cached = [], [], []
        for _ in range(a.runs):
            prefix = rng.integers(100, vocab - 100, a.prefix).tolist()
            t1, _ = ttft(core, prefix + rng.integers(100, vocab - 100, 16).tolist())
            t2, c = ttft(core, prefix + rng.integers(100, vocab - 100, 16).tolist())
            cold.append(t1)
            warm.append(t2)
            cached.append(c)
        core.stop()
        rows.append((budget, statistics.median(cold), statistics.median(warm), statistics.median(cached)))
        print(f"prefix cache {budget} MiB: cold {rows[-1][1] * 1e3:.1f} ms, second {rows[-1][2] * 1e3:.1f} ms", flush=True)
    print(f"\n| device | prefix tokens | prefix cache | TTFT first (ms) | TTFT second (ms) | cached tokens | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for budget, c, w, n in rows:
        print(f"| {a.device} | {a.prefix} | {'on' if budget else 'off'} | {c * 1e3:.1f} | {w * 1e3:.1f} | {n} | {c / w:.1f}x |")


if __name__ == "__main__":
    main()
