"""Write the greedy-token record that tests/test_greedy_record.py compares with.

For every case of tests/support/greedy_record.py (a tiny synthetic pack of each architecture,
seed-moe with its draft, the test model with its shipped draft): two fixed prompts, 16 greedy
tokens in each mode (plain, plain with top_logprobs=2, two slots batched, --spec 2 with and
without --batch-mtp where there is a draft), the plain run's per-step top-1/top-2 margins, the
largest |logit| of the plain sequence (the margin threshold's scale) and a digest of the pack.

    python3 bench/record_greedy.py --device cpu --out tests/data/greedy_record_cpu.json
    python3 bench/record_greedy.py --device cuda --out tests/data/greedy_record_cuda.json

--logits-out FILE.npz also saves every case's plain-sequence logits: recordings made under
different BLAS settings (OPENBLAS_CORETYPE, OPENBLAS_NUM_THREADS) are compared with
--compare A.npz B.npz, which prints the largest logit difference per case against the
margin threshold (how the threshold in tests/support/greedy_record.py was checked).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import greedy_record as gr  # noqa: E402


def record(device: str, only: list[str] | None, logits_out: Path | None) -> dict:
    import numpy as np

    cases = {}
    dumps: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="greedy-record-") as tmp:
        for case in gr.CASES:
            if (only and case.name not in only) or device not in case.devices:
                continue
            if case.pack == "model" and not have_test_model():
                print(f"{case.name:18s} skipped: the test model is not on this machine", flush=True)
                continue
            t0 = time.perf_counter()
            pack_dir = gr.build_pack(case, Path(tmp))
            prompts = gr.model_prompts() if case.pack == "model" else [list(p) for p in gr.SYNTH_PROMPTS]
            got = gr.run_case(case, prompts, pack_dir, device)
            core = gr.load_engine_for(case, pack_dir, device)
            try:
                rows = [gr.sequence_logits(core, p, t) for p, t in zip(prompts, got["tokens"]["plain"])]
                n_embd, n_layer = int(core.model.cfg.n_embd), int(core.model.cfg.n_layer)
            finally:
                gr.close_engine(core)
            absmax = max(float(np.abs(r).max()) for r in rows)
            for i, r in enumerate(rows):
                dumps[f"{case.name}/{i}"] = r
            threshold = gr.margin_threshold(n_layer, n_embd, absmax)
            cases[case.name] = {
                "pack": case.pack, "pack_sha256": gr.pack_digest(pack_dir), "n_layer": n_layer, "n_embd": n_embd,
                "logit_absmax": absmax, "prompts": prompts, **got,
            }
            check = gr.compare(cases[case.name], got, threshold)  # batching / speculation lossless
            low = min(min(m) for m in got["margins"] if m)
            print(f"{case.name:18s} {time.perf_counter() - t0:5.1f} s  |logit| max {absmax:7.3f}  threshold "
                  f"{threshold:.2e}  smallest margin {low:.2e}  trusted {check.compared}/{check.recorded} steps"
                  + ("" if not check.mismatches else "  MODES DIFFER: " + "; ".join(check.mismatches)), flush=True)
    if logits_out is not None:
        np.savez(logits_out, **dumps)
    return {"format": gr.FORMAT, "device": device, "max_tokens": gr.MAX_TOKENS, "spec": gr.SPEC, "cases": cases}


def have_test_model() -> bool:
    from strata.defaults import find_default_model

    return find_default_model() is not None


def compare_logits(a: Path, b: Path, rec: Path | None) -> None:
    import numpy as np

    x, y = np.load(a), np.load(b)
    cases = json.loads(rec.read_text())["cases"] if rec else {}
    for key in x.files:
        if key not in y.files:
            continue
        u, v = x[key], y[key]
        n = min(len(u), len(v))  # sequences may diverge after a near-tie: compare the common rows
        d = float(np.abs(u[:n] - v[:n]).max()) if n else 0.0
        name = key.split("/")[0]
        extra = ""
        if name in cases:
            c = cases[name]
            extra = f"  threshold {gr.margin_threshold(c['n_layer'], c['n_embd'], c['logit_absmax']):.2e}"
        print(f"{key:22s} max |dlogit| {d:.2e}  (|logit| max {float(np.abs(u).max()):.3f}){extra}")


def to_json(data: dict) -> str:
    """Indented JSON with each list of numbers on one line (a readable diff per sequence)."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[[^\[\]{}\"]*\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(0)[1:-1].split(",")) + "]"
                  if m.group(0).strip("[] \n") else "[]", text) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, help="the record (JSON) to write")
    p.add_argument("--case", action="append", help="only this case (repeatable)")
    p.add_argument("--logits-out", type=Path, help="also save the plain sequences' logits (.npz)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A.npz", "B.npz"),
                   help="print the largest logit difference per case between two --logits-out files")
    p.add_argument("--record", type=Path, help="with --compare: a record, to print each case's threshold")
    args = p.parse_args()
    if args.compare:
        compare_logits(*args.compare, args.record)
        return 0
    data = record(args.device, args.case, args.logits_out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(to_json(data))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
