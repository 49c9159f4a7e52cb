"""Drafts against each other and plain decoding, interleaved: every engine runs the same prompts
in turn, ROUNDS times, so a shared machine's drift hits them all alike (bench_mtp.py measures
plain once, then each setting minutes later). Prints tok/s (median) and the ratio to plain.

  python bench/probes/bench_draft_ab.py --drafts full=strata/mtp/data/smollm2-135m-instruct.mtp.gguf,narrow=/tmp/v.gguf \
      [--configs 1:0.0,3:0.5] [--rounds 3] [--per-kind 3] [--max-tokens 48] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata.mtp.train.measure import chat_ids, load_core, run_prompts  # noqa: E402
from strata.mtp.train.prompts import HELD_OUT  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", required=True, help="name=path,... (draft GGUFs to compare)")
    ap.add_argument("--configs", default="1:0.0,3:0.5", help="--spec:--spec-min-p settings")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-kind", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pack", default=None)
    a = ap.parse_args()
    drafts = dict(d.split("=", 1) for d in a.drafts.split(","))
    configs = [(int(c.split(":")[0]), float(c.split(":")[1])) for c in a.configs.split(",")]
    plain = load_core(a.pack, None, 0, device=a.device)
    prompts = [chat_ids(plain, t) for k in HELD_OUT for t in HELD_OUT[k][: a.per_kind]]
    engines = {"plain": plain}
    for name, path in drafts.items():
        for spec, mp in configs:
            engines[f"{name} --spec {spec} --spec-min-p {mp}"] = load_core(a.pack, path, spec, min_p=mp, device=a.device)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    per_window: dict[str, float] = {}
    same = True
    want = None
    for _ in range(a.rounds):
        for name, core in engines.items():
            r = run_prompts(core, prompts, a.max_tokens)
            rates[name].append(r.tokens / r.seconds)
            per_window[name] = r.tokens_per_window if core.draft is not None else 1.0
            want = r.outputs if name == "plain" else want
            same &= r.outputs == want
    base = statistics.median(rates["plain"])
    print(f"{len(prompts)} held-out prompts x {a.max_tokens} tokens, greedy, {a.device}, {a.rounds} rounds interleaved\n")
    print("| engine | tok/s (median) | vs plain | runs | tokens/window |")
    print("|---|---:|---:|---|---:|")
    for name in engines:
        med = statistics.median(rates[name])
        runs = " ".join(f"{x:.1f}" for x in rates[name])
        print(f"| {name} | {med:.1f} | {med / base:.2f}x | {runs} | {per_window[name]:.2f} |")
    print(f"\ngreedy outputs equal to plain decoding everywhere: {'yes' if same else 'NO (near ties: see bench_mtp.py)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
