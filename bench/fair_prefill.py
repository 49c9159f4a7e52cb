"""A long prompt beside short requests: time to first token of a short chat and the largest
gap between a decoding neighbour's tokens, alone and while a long prompt is prefilled.

  python bench/fair_prefill.py [--pack P] [--device cpu] [--long 4000] [--after 3]

One engine with 2 slots (--parallel 2, --prefill auto). Three measurements, each through the
real scheduler thread:
- alone: the short chat's TTFT with nothing else running (median of 3);
- beside: the long prompt is submitted, the short chat --after seconds later (its own slot is
  free); its TTFT, and how many windows ran between its submission and its first token;
- neighbour: a request decoding 48 tokens, the long prompt submitted once it has 8; the largest
  gap between two of its tokens while the long prompt is prefilled.
Both under the scheduler's sharing (strata/batch/budget.py) and, for comparison, under the
rule it replaced (`--rules index fair`): the whole budget to the prefilling slots in slot order.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.batch.budget import PrefillSharing  # noqa: E402
from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.protocol import GenerationRequest, SamplingParams, TokenEvent  # noqa: E402


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def token_times(core: EngineCore, prompt: list[int], n: int) -> tuple[float, list[float]]:
    """(submit time, the time of each token) of one request."""
    t0 = time.perf_counter()
    h = core.submit(GenerationRequest(prompt, greedy(n)))
    times = []
    while True:
        ev = h.events.get(timeout=900)
        if not isinstance(ev, TokenEvent):
            return t0, times
        times.append(time.perf_counter())


def in_thread(fn, *args):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    return t, out


class IndexOrder:
    """The rule the sharing replaced: the prefill budget to the prefilling slots in slot order."""

    def shares(self, needs, budget):
        out = {}
        for index, need in needs:
            if budget <= 0:
                break
            out[index] = min(budget, need)
            budget -= out[index]
        return out


RULES = {"index": IndexOrder, "fair": PrefillSharing}


def beside(core: EngineCore, short: list[int], long_prompt: list[int], after: float) -> tuple[float, int, list[float], int, float]:
    """(the short chat's TTFT beside the long prompt, windows until it, the neighbour's gaps,
    windows the long prompt ran for beside the neighbour, and its time to first token there)."""
    sch = core.scheduler
    t_long, _ = in_thread(token_times, core, long_prompt, 1)
    time.sleep(after)
    w0 = sch.windows
    t0, times = token_times(core, short, 1)
    ttft, windows = times[0] - t0, sch.windows - w0
    t_long.join()

    w0 = sch.windows
    t_n, out = in_thread(token_times, core, short, 48)
    while sch.windows < w0 + 8:  # (a few of its tokens alone first)
        time.sleep(0.01)
    wl = sch.windows
    t_long, lout = in_thread(token_times, core, long_prompt, 1)
    t_long.join()
    wl_end = sch.windows
    t_n.join()
    _, ntimes = out[0]
    l0, ltimes = lout[0]
    return ttft, windows, np.diff(ntimes).tolist(), wl_end - wl, ltimes[0] - l0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--long", type=int, default=4000)
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--rules", nargs="+", choices=sorted(RULES), default=["index", "fair"])
    a = ap.parse_args()
    args = ["--device", a.device, "--parallel", "2", "--max-context", str(a.long + 256), "--prefix-cache", "0"]
    core = EngineCore.load(parse_engine_args((["--pack", a.pack] if a.pack else []) + args, serving=False),
                           log=lambda s: None)
    core.start()
    text = core.chat.render([{"role": "user", "content": "Hi!"}])
    short = core.tokenizer.encode(text, add_special=True)
    rng = np.random.default_rng(0)
    vocab = core.cfg.vocab_size
    token_times(core, short, 1)  # warm-up
    alone = []
    for _ in range(3):
        t0, times = token_times(core, short, 1)
        alone.append(times[0] - t0)
    long_prompt = rng.integers(100, vocab - 100, a.long).tolist()
    t_alone = statistics.median(alone)
    print(f"short chat: {len(short)} prompt tokens; long prompt {a.long} tokens; --prefill auto (512), 2 slots")
    print(f"TTFT alone: {t_alone * 1e3:.0f} ms (median of 3)", flush=True)
    for rule in a.rules:
        core.scheduler.prefill = RULES[rule]()
        ttft, windows, gaps, wl, t_long = beside(core, short, long_prompt, a.after)
        print(f"[{rule}] TTFT beside the long prompt (sent {a.after:g} s after it): {ttft * 1e3:.0f} ms, "
              f"{windows} windows after its submission ({ttft / t_alone:.1f}x alone); "
              f"neighbour's gaps: median {np.median(gaps) * 1e3:.0f} ms, largest {max(gaps) * 1e3:.0f} ms "
              f"(the long prompt: {wl} windows in {t_long:.1f} s, {t_long / wl * 1e3:.0f} ms a window)", flush=True)
    core.stop()


if __name__ == "__main__":
    main()
