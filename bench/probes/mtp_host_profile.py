"""Where an MTP decode window's wall time goes on the host (cProfile), against plain decoding.

  python bench/probes/mtp_host_profile.py --pack P [--draft D] [--spec 1] [--device cuda] [--parallel N]

Runs the held-out prompts once untimed (CUDA graphs captured), then once under cProfile for
plain decoding and for MTP at --spec K (greedy, min-p 0); prints wall time per generated token
of each and the functions with the most own time (tottime) and cumulative time in the MTP run.
--parallel N (> 1): N prompts at a time, plain batching against batch-MTP.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata.mtp.defaults import default_draft_path  # noqa: E402
from strata.mtp.train.measure import chat_ids, load_core, run_prompts  # noqa: E402
from strata.mtp.train.prompts import HELD_OUT  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--spec", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--parallel", type=int, default=1)
    a = ap.parse_args()
    draft = str(a.draft or default_draft_path())
    n = a.parallel
    plain = load_core(a.pack, None, 0, device=a.device, parallel=n)
    mtp = load_core(a.pack, draft, a.spec, min_p=0.0, device=a.device, parallel=n, batch_mtp=n > 1)
    prompts = [chat_ids(plain, t) for kind in HELD_OUT for t in HELD_OUT[kind][:2]]
    for core in (plain, mtp):
        run_prompts(core, prompts, a.max_tokens, concurrent=n)  # graphs captured here
    for name, core in (("plain", plain), (f"mtp --spec {a.spec}", mtp)):
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        r = run_prompts(core, prompts, a.max_tokens, concurrent=n)
        prof.disable()
        wall = time.perf_counter() - t0
        print(f"\n== {name} ({n} at a time): {r.tokens} tokens, {r.decode_windows} decode windows, {wall / r.tokens * 1e3:.3f} ms per token under cProfile "
              f"({r.tokens / r.seconds:.0f} tok/s as timed by run_prompts)")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
            lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
            start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
            print(f"-- by {key}")
            print("\n".join(lines[start : start + a.top + 1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
