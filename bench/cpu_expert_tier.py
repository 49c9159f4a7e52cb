"""The CPU expert tier (strata/backend/cpu_experts.py): decode tokens/s, load time and peak RSS of
a synthetic MoE with its experts all resident (float32, dequantized at load) and behind pools of
25 / 50 / 75 / 100% of them (float32 slots, the rest quantized in the pack file, a miss
dequantized into its slot). A table; no assertions.

    python bench/cpu_expert_tier.py [--dir DIR] [--tokens 32] [--threads 1] [--pools 25,50,75,100]

The pack is the seed-moe preset (qwen3moe: IQ3_S gate, IQ3_XXS up, Q2_0 / IQ4_NL downs) widened to
--layers x --experts experts of --embd x --expert-ff (written once into DIR). Each configuration
runs in its own process, so its peak RSS (ru_maxrss) is its own: load the engine, prefill a
prompt, then decode greedily as `strata generate` does (the scheduler's thread, tokens as they
stream); tokens/s counts from the first token to the last. A second request (another prompt)
follows on the same engine: the first fills an empty pool, the second finds it as the first
left it. Hit rate and dequantized experts are the two requests' together. How concentrated the
routing is depends on the random router: on this pack a quarter of the experts took 92% of the
lookups (docs/MEMORY.md); uniform routing, where a pool of p% hits about p%, is the tier's worst case.
A pool of 100% is no pool (every expert loads resident, as without the flag).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's strata, not an installed one

# token ids of the synthetic vocabulary
PROMPT = [(i * 37 + 11) % 4000 + 50 for i in range(32)]
PROMPT_2 = [(i * 53 + 7) % 4000 + 50 for i in range(32)]


def peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows: no ru_maxrss
        return None
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024


def decode(core, prompt: list[int], n: int) -> float:
    """Greedy decode of n tokens after `prompt`, as `strata generate` streams them: tokens/s from
    the first token to the last."""
    from strata.protocol import FinishEvent, GenerationRequest, SamplingParams

    h = core.submit(GenerationRequest(list(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    stamps = []
    while True:
        ev = h.events.get(timeout=3600)
        if isinstance(ev, FinishEvent):
            return (len(stamps) - 1) / (stamps[-1] - stamps[0])
        stamps.append(time.perf_counter())


def child(a) -> dict:
    from strata.engine.core import EngineCore
    from strata.engine.options import parse_engine_args

    lines: list[str] = []
    t0 = time.perf_counter()
    opts = parse_engine_args(["--pack", a.dir, "--device", "cpu", "--threads", str(a.threads), "--prefix-cache", "0",
                              "--expert-cache", a.cache], serving=False)
    core = EngineCore.load(opts, log=lines.append)
    load_s = time.perf_counter() - t0
    core.start()
    try:
        first = decode(core, PROMPT, a.tokens)  # the pool starts empty: every first use misses
        again = decode(core, PROMPT_2, a.tokens)  # another prompt, the pool as the first left it
    finally:
        core.stop()
    stats = core.expert_cache() or {}
    return {"load_s": load_s, "tok_s": first, "tok_s_2": again, "rss": peak_rss_bytes(),
            "hit_rate": stats.get("hit_rate"), "uploads": stats.get("uploads", 0),
            "host_served": stats.get("host_served", 0), "host_s": stats.get("host_seconds", 0.0),
            "pool_bytes": stats.get("pool_bytes", 0),
            "line": next((ln for ln in lines if ln.startswith("strata: experts:")), "")}


def build(a) -> None:
    from strata.pack.presets import PRESETS
    from strata.pack.synth import synth_pack

    if (Path(a.dir) / "model.gguf").exists():
        return
    spec = replace(PRESETS["seed-moe"], n_layer=a.layers, n_embd=a.embd, n_expert=a.experts,
                   n_expert_used=a.used, expert_ff=a.expert_ff, vocab=4096)
    synth_pack(spec, a.dir, progress=lambda *x, **k: None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/strata-cpu-expert-tier")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pools", default="25,50,75,100")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--expert-ff", type=int, default=512)
    ap.add_argument("--cache", default="off", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    build(a)
    gguf = Path(a.dir) / "model.gguf"
    print(f"pack {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB): seed-moe widened to {a.layers} layers x "
          f"{a.experts} experts ({a.used} used) of {a.embd} x {a.expert_ff}; {a.threads} BLAS thread(s), "
          f"{a.tokens} tokens greedy, {os.cpu_count()} CPUs")
    print(f"{'--expert-cache':16s} {'pool MiB':>9s} {'load s':>7s} {'peak RSS MiB':>13s} {'tok/s 1st':>10s} {'tok/s 2nd':>10s} "
          f"{'hit rate':>9s} {'dequantized':>12s} {'host-served':>12s} {'host s':>7s}")
    for cache in ["off"] + [f"{p}%" for p in a.pools.split(",")]:
        argv = [sys.executable, __file__, "--child", "--dir", a.dir, "--tokens", str(a.tokens),
                "--threads", str(a.threads), "--cache", cache]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rate = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        rss = "-" if r["rss"] is None else f"{r['rss'] / 2**20:.0f}"
        print(f"{cache + (' (resident)' if cache == 'off' else ''):16s} {r['pool_bytes'] / 2**20:9.0f} "
              f"{r['load_s']:7.1f} {rss:>13s} {r['tok_s']:10.2f} {r['tok_s_2']:10.2f} {rate:>9s} {r['uploads']:12d} {r['host_served']:12d} "
              f"{r['host_s']:7.2f}")


if __name__ == "__main__":
    main()
