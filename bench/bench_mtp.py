"""MTP with a trained draft: acceptance, tokens per window, speed, losslessness.

    python bench/bench_mtp.py [--pack P] [--draft D] [--max-tokens 48] [--per-kind 3] [--repeats 3] [--quick]

Prompts are the held-out set of strata.mtp.train.prompts (never trained on), several kinds
(chat, code, lists, prose). Everything runs through the real engine (EngineCore, greedy):
1. acceptance rate per draft position and mean tokens per verifying window, per kind, at
   --spec 1..4 x --spec-min-p 0, 0.5, 0.8;
2. tokens/s at 1 slot: MTP against plain decoding (--device cpu or cuda);
3. tokens/s with batch-MTP against plain batching at 2 and 4 slots;
4. losslessness: every greedy output equals plain decoding, prompt by prompt.
Speeds on shared machines are noisy: each time is the median of --repeats runs (default 3).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.mtp.defaults import default_draft_path  # noqa: E402
from strata.mtp.train.measure import chat_ids, divergence, load_core, run_prompts  # noqa: E402
from strata.mtp.train.prompts import HELD_OUT  # noqa: E402


TIE = 1e-2  # a first difference where the target's own top-2 logits are this close is rounding


def verdict(plain, prompts, want, got) -> tuple[str, bool]:
    """'yes' if equal; else 'tie@i (gap)' for near-ties of the target's logits, 'NO' otherwise."""
    if got == want:
        return "yes", True
    marks, real = [], False
    for p, w, g in zip(prompts, want, got):
        d = divergence(plain, p, w, g)
        if d is not None:
            i, gap = d
            real |= abs(gap) >= TIE
            marks.append(f"{'NO' if abs(gap) >= TIE else 'tie'}@{i} (gap {abs(gap):.0e})")
    return ", ".join(marks), not real


def given_previous(acc) -> list[float]:
    """P(draft j accepted | drafts 1..j-1 accepted): accepted at j over accepted at j-1 (drafted, for j=1)."""
    out, prev = [], None
    for d, a in zip(acc.drafted_per_pos, acc.accepted_per_pos):
        base = d if prev is None else min(prev, d)
        out.append(a / base if base else 0.0)
        prev = a
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--per-kind", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="only --spec 3 at min-p 0 and 0.5")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the engine's --device)")
    ap.add_argument("--batch-configs", default="",
                    help='batch-MTP settings to compare at 2 and 4 slots, e.g. "1:0.0,1:0.8,2:0.5" '
                         '(--spec:--spec-min-p; default: the best 1-slot setting)')
    ap.add_argument("--only-batch", action="store_true", help="skip the 1-slot table (plain 1-slot run only)")
    ap.add_argument("--min-ps", default="", help='--spec-min-p values of the 1-slot table (default "0,0.5,0.8")')
    ap.add_argument("--batch-slots", default="2,4", help='slot counts of the batch-MTP table ("": no batch table)')
    ap.add_argument("--specs", default="", help='--spec values of the 1-slot table, e.g. "1,3" (default 1..4)')
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of every measurement; tok/s from the median time (shared, noisy machines)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time the first pass (on cuda it then includes capturing every window shape's graph)")
    a = ap.parse_args()
    draft = a.draft or default_draft_path()
    if draft is None:
        print("no draft: pass --draft (the shipped one is missing)")
        return 2
    kinds = list(HELD_OUT)
    dev = dict(device=a.device)
    plain = load_core(a.pack, None, 0, **dev)

    def warm(core, prompts, concurrent=1):
        """One untimed pass: CUDA graphs of every window shape are captured here, not timed."""
        if a.device == "cuda" and not a.no_warmup:
            run_prompts(core, prompts, a.max_tokens, concurrent=concurrent)

    def timed(core, prompts, concurrent=1):
        """run_prompts --repeats times: the first run's result with the median time."""
        runs = [run_prompts(core, prompts, a.max_tokens, concurrent=concurrent) for _ in range(max(1, a.repeats))]
        runs[0].seconds = statistics.median(r.seconds for r in runs)
        return runs[0]

    prompts = {k: [chat_ids(plain, t) for t in HELD_OUT[k][: a.per_kind]] for k in kinds}
    allp = [p for k in kinds for p in prompts[k]]
    print(f"draft {draft}; {len(allp)} held-out prompts ({a.per_kind} per kind: {', '.join(kinds)}), "
          f"{a.max_tokens} tokens each, greedy, {a.device}\n")

    warm(plain, allp)
    base = {k: timed(plain, prompts[k]) for k in kinds}
    want = {k: base[k].outputs for k in kinds}
    plain_tps = sum(b.tokens for b in base.values()) / sum(b.seconds for b in base.values())

    specs = [] if a.only_batch else [int(k) for k in a.specs.split(",")] if a.specs else [3] if a.quick else [1, 2, 3, 4]
    min_ps = [float(m) for m in a.min_ps.split(",")] if a.min_ps else [0.0, 0.5] if a.quick else [0.0, 0.5, 0.8]
    print("acceptance, per position: over windows that drafted (position j counts a window when drafts 1..j "
          "were all accepted); given previous: position j's rate among windows whose drafts 1..j-1 were "
          "accepted; tokens/window: drafting windows (all decode windows in brackets)\n")
    print("| spec | min-p | kind | windows | acceptance | per position | given previous | tokens/window | tok/s (plain) | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    lossless = exact = True
    best = None
    for k_spec in specs:
        for mp in min_ps:
            core = load_core(a.pack, str(draft), k_spec, min_p=mp, **dev)
            warm(core, allp)
            tot_tok = tot_s = 0.0
            tot_win = tot_acc = 0
            for kind in kinds:
                acc = timed(core, prompts[kind])
                mark, ok = verdict(plain, prompts[kind], want[kind], acc.outputs)
                exact &= acc.outputs == want[kind]
                lossless &= ok
                tot_tok += acc.tokens
                tot_win += acc.windows
                tot_acc += acc.accepted
                tot_s += acc.seconds
                per = " ".join(f"{r:.2f}" for r in acc.per_pos())
                cond = " ".join(f"{r:.2f}" for r in given_previous(acc))
                print(f"| {k_spec} | {mp} | {kind} | {acc.windows} | {acc.rate:.2f} | {per} | {cond} | "
                      f"{acc.tokens_per_window:.2f} ({acc.tokens_per_decode_window:.2f}) | {acc.tokens / acc.seconds:.1f} ({base[kind].tokens / base[kind].seconds:.1f}) "
                      f"| {mark} |", flush=True)
            tps = tot_tok / tot_s
            tpw = 1 + tot_acc / tot_win if tot_win else 1.0
            print(f"| {k_spec} | {mp} | all | {tot_win} | | | | {tpw:.2f} | {tps:.1f} ({plain_tps:.1f}) = {tps / plain_tps:.2f}x | |", flush=True)
            if best is None or tps > best[0]:
                best = (tps, k_spec, mp)

    if best is not None:
        print(f"\n1 slot, {a.device}: plain {plain_tps:.1f} tok/s; best MTP {best[0]:.1f} tok/s at --spec {best[1]} "
              f"--spec-min-p {best[2]} ({best[0] / plain_tps:.2f}x).")
    configs = [(int(c.split(":")[0]), float(c.split(":")[1])) for c in a.batch_configs.split(",") if c]
    configs = configs or ([best[1:]] if best is not None else [(1, 0.0)])
    print("\n| slots | --spec | min-p | plain batching tok/s | batch-MTP tok/s | speed-up | tokens/window | lossless |")
    print("|---|---|---|---|---|---|---|---|")
    for n in [int(n) for n in a.batch_slots.split(",") if n]:
        pl = load_core(a.pack, None, 0, parallel=n, **dev)
        warm(pl, allp, n)
        r0 = timed(pl, allp, n)
        for k_spec, mp in configs:
            mt = load_core(a.pack, str(draft), k_spec, min_p=mp, parallel=n, batch_mtp=True, **dev)
            warm(mt, allp, n)
            r1 = timed(mt, allp, n)
            flat = [o for k in kinds for o in want[k]]
            m0, ok0 = verdict(plain, allp, flat, r0.outputs)
            m1, ok1 = verdict(plain, allp, flat, r1.outputs)
            exact &= r0.outputs == flat and r1.outputs == flat
            lossless &= ok0 and ok1
            t0, t1 = r0.tokens / r0.seconds, r1.tokens / r1.seconds
            print(f"| {n} | {k_spec} | {mp} | {t0:.1f} | {t1:.1f} | {t1 / t0:.2f}x | {r1.tokens_per_window:.2f} | "
                  f"plain batching: {m0}; batch-MTP: {m1} |", flush=True)
    print(f"\ngreedy outputs equal to plain decoding on every prompt and config: {'yes' if exact else 'NO'}; "
          f"every difference at a near-tie of the target's logits (gap < {TIE}): {'yes' if lossless else 'NO'}")
    return 0 if lossless else 1


if __name__ == "__main__":
    t = time.perf_counter()
    rc = main()
    print(f"(bench took {time.perf_counter() - t:.0f} s)")
    sys.exit(rc)
