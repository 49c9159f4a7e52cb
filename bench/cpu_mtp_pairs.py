"""Plain decoding against the default MTP (`--spec 1`, the shipped draft) on the CPU, two engines
in one process taking turns prompt by prompt (which goes first alternates), so that both see the
same load: tokens per second of wall time and of the process's CPU time (with one BLAS thread the
CPU time is the work itself, which other load changes far less than the wall time). A table; no
assertions.

    python3 bench/cpu_mtp_pairs.py [--threads 1] [--rounds 2] [--tokens 64]

Also counts the prompts whose greedy continuations differ and, for each, the top-2 log-prob gap
of plain decoding where they part (float32 sums in another order pick the other of two tokens
that nearly tie: MTP's verification window is a matrix product where plain decoding is a vector
product).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from strata.engine.core import EngineCore
from strata.engine.options import parse_engine_args
from strata.protocol import FinishEvent, GenerationRequest, SamplingParams
from strata.mtp.train.prompts import HELD_OUT


def _run(core, prompt: list[int], tokens: int, logprobs: bool = False):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=logprobs, top_logprobs=2 if logprobs else 0)
    wall, cpu = time.perf_counter(), time.process_time()
    handle = core.submit(GenerationRequest(list(prompt), params))
    core.scheduler.run_until_idle()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ids, tops = [], []
    while not isinstance(ev := handle.events.get(), FinishEvent):
        ids.append(ev.token_id)
        tops.append(ev.top_logprobs)
    return ids, tops, wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1", help="BLAS threads of both engines")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    base = ["--device", "cpu", "--max-context", "2048", "--threads", a.threads, "--prefix-cache", "0"]
    quiet = lambda line: None  # noqa: E731
    plain = EngineCore.load(parse_engine_args(base + ["--spec", "0"], serving=False), log=quiet)
    mtp = EngineCore.load(parse_engine_args(base, serving=False), log=quiet)  # the default: --spec 1
    if mtp.draft is None:
        raise SystemExit("the default engine has no draft: nothing to compare")
    texts = [p for kind in HELD_OUT.values() for p in kind[:2]]
    prompts = [plain.tokenizer.encode(plain.chat.render([{"role": "user", "content": t}]), add_special=True)
               for t in texts]
    _run(plain, prompts[0], 8), _run(mtp, prompts[0], 8)  # warm
    rows = {"plain": [], "mtp": []}
    parted: list[float] = []  # plain's top-2 gap where the two outputs part
    differ = 0
    for r in range(a.rounds):
        for i, prompt in enumerate(prompts):
            order = [("plain", plain), ("mtp", mtp)] if (r + i) % 2 == 0 else [("mtp", mtp), ("plain", plain)]
            out = {}
            for name, core in order:
                ids, tops, wall, cpu = _run(core, prompt, a.tokens, logprobs=name == "plain")
                rows[name].append((len(ids), wall, cpu))
                out[name] = (ids, tops)
            (p_ids, p_tops), (m_ids, _) = out["plain"], out["mtp"]
            if p_ids != m_ids:
                differ += 1
                at = next((k for k in range(min(len(p_ids), len(m_ids))) if p_ids[k] != m_ids[k]), None)
                if at is not None and len(p_tops[at]) >= 2:
                    parted.append(p_tops[at][0].logprob - p_tops[at][1].logprob)

    def rate(name: str, k: int) -> float:
        return sum(r[0] for r in rows[name]) / sum(r[k] for r in rows[name])

    pairs = [(m[0] / m[1]) / (p[0] / p[1]) for p, m in zip(rows["plain"], rows["mtp"])]
    n = len(rows["plain"])
    m = mtp.metrics()["slots"][0]
    print(f"threads {a.threads}: {len(prompts)} prompts x {a.rounds} rounds x {a.tokens} tokens; "
          f"1-minute load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "")
    print("| | plain tok/s | MTP tok/s | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| wall | {rate('plain', 1):.1f} | {rate('mtp', 1):.1f} | {rate('mtp', 1) / rate('plain', 1):.2f}x "
          f"(median pair {statistics.median(pairs):.2f}x) |")
    print(f"| CPU time | {rate('plain', 2):.1f} | {rate('mtp', 2):.1f} | {rate('mtp', 2) / rate('plain', 2):.2f}x |")
    print(f"MTP windows {m['mtp_windows']}, drafted {m['mtp_drafted']}, accepted {m['mtp_accepted']}; "
          f"same greedy output {n - differ}/{n}" +
          (f"; where they part, plain's top-2 gap {', '.join(f'{g:.1e}' for g in parted)} nats" if parted else ""))


if __name__ == "__main__":
    main()
