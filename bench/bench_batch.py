"""Batch / MTP throughput on the CPU: tokens/s and mean tokens per window.

For 1, 2 and 4 concurrent requests, three engine modes on the same pack:
  plain      no MTP (every slot one token per window)
  mtp        --spec K without --batch-mtp (MTP only while one slot is busy)
  batch-mtp  --spec K --batch-mtp (every slot verifies its own proposal in the window)
Prints one table. Default pack: the seed-moe preset (synthetic, random draft: acceptance is
near zero, so this measures the cost of verification); --pack/--mtp take any pack + draft.

    python bench/bench_batch.py [--pack DIR --mtp DIR] [--spec 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.protocol import GenerationRequest, SamplingParams  # noqa: E402

PROMPTS = ["Hello there, how are you today?", "Write a haiku about rain.", "List three colors.",
           "Explain what a hash map is.", "What is the capital of France?", "Give me a recipe for soup.",
           "Count from one to ten.", "Describe the sea."]


def run_mode(pack: str, mtp: str | None, extra: list[str], clients: int, spec: int, tokens: int, min_p: float):
    args = ["--pack", pack, "--device", "cpu", "--parallel", str(max(clients, 1))]
    if mtp and spec:
        args += ["--mtp", mtp, "--spec", str(spec), "--spec-min-p", str(min_p)]
    core = EngineCore.load(parse_engine_args(args + extra, serving=False), log=lambda s: None)
    prompts = [core.tokenizer.encode(core.chat.render([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]),
                                     add_special=True) for i in range(clients)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    # warm-up (first-touch of caches, BLAS threads)
    core.submit(GenerationRequest(prompts[0], SamplingParams(max_tokens=2, temperature=0.0)))
    core.scheduler.run_until_idle()
    w0 = core.scheduler.windows
    handles = [core.submit(GenerationRequest(p, params)) for p in prompts]
    t0 = time.perf_counter()
    core.scheduler.run_until_idle()
    dt = time.perf_counter() - t0
    n = sum(h.collect()[2].completion_tokens for h in handles)
    m = core.metrics()
    windows = sum(s["mtp_windows"] for s in m["slots"])
    drafted = sum(s["mtp_drafted"] for s in m["slots"])
    accepted = sum(s["mtp_accepted"] for s in m["slots"])
    per_window = (accepted + windows) / windows if windows else 1.0
    return n / dt, per_window, drafted, accepted, core.scheduler.windows - w0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack")
    ap.add_argument("--mtp")
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--spec-min-p", type=float, default=0.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--clients", default="1,2,4")
    a = ap.parse_args()
    pack, mtp = a.pack, a.mtp
    if pack is None:
        from strata.pack.presets import PRESETS
        from strata.pack.synth import synth_pack

        tmp = Path(tempfile.mkdtemp(prefix="strata-bench-"))
        synth_pack(PRESETS["seed-moe"], tmp, mtp_dir=tmp / "mtp", progress=lambda *x, **k: None)
        pack, mtp = str(tmp), str(tmp / "mtp")
    print(f"pack {pack}  draft {mtp}  spec {a.spec}  spec-min-p {a.spec_min_p}  {a.tokens} tokens per request")
    print(f"{'clients':>7} {'mode':>10} {'tok/s':>8} {'vs plain':>8} {'tok/window':>10} {'drafted':>8} {'accepted':>8} {'windows':>8}")
    for c in (int(x) for x in a.clients.split(",")):
        base = None
        for mode, extra, spec in (("plain", [], 0), ("mtp", [], a.spec), ("batch-mtp", ["--batch-mtp"], a.spec)):
            tps, pw, dr, ac, win = run_mode(pack, mtp, extra, c, spec, a.tokens, a.spec_min_p)
            base = base or tps
            print(f"{c:>7} {mode:>10} {tps:>8.1f} {tps / base:>8.2f} {pw:>10.2f} {dr:>8} {ac:>8} {win:>8}", flush=True)


if __name__ == "__main__":
    main()
