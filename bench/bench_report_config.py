"""The report's config through `strata serve`, against plain decoding of the same pack.

  python bench/bench_report_config.py --pack DIR --mtp DIR [--device cuda] [--clients 1,2,4]
        [--tokens 64] [--extra "--kv int8"]

Two servers run one after the other on the same pack, `parallel` 4, with the report's flags
(`--expert-cache auto --prefill auto:32768 --max-context 262144`, plus --extra):
- plain: `--spec 0`, no draft;
- report: `--mtp DIR --spec 4 --spec-min-p 0.5 --batch-mtp`.
At each client count N, N concurrent greedy /v1/completions requests (distinct prompts, max_tokens
--tokens, temperature 0) go to each server. One row per N: aggregate tok/s of each, their ratio,
and whether every report answer equals the plain answer token for token (the texts, and the
completion token counts). The lines in which the server says what it decided (the probe's MTP
decision per slot, the recurrent state per slot) are printed before the table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench_served import Child  # (this folder is on sys.path when the script runs)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello there", "Write a haiku about rain.", "List three colors.", "What is 2+2?"]
REPORT = ["--spec", "4", "--spec-min-p", "0.5", "--batch-mtp"]
# the lines that say what the engine decided for its slots
DECISIONS = ("strata probe:", "strata: recurrent state", "strata mtp:", "strata: expert cache")


def start(args: list[str], device: str, workdir: Path) -> tuple[Child, str]:
    cfg = {"parallel": 4, "args": [*args, "--device", device, "--expert-cache", "auto",
                                   "--prefill", "auto:32768", "--max-context", "262144"]}
    path = workdir / f"serve-{len(list(workdir.iterdir()))}.json"
    path.write_text(json.dumps(cfg))
    child = Child(ROOT, "serve", ["--config", str(path), "--port", "0"])
    port = child.wait_ready(900)
    return child, f"http://127.0.0.1:{port}"


def round_of(url: str, n: int, tokens: int) -> tuple[float, list[tuple[str, int]]]:
    def ask(i: int) -> tuple[str, int]:
        r = httpx.post(url + "/v1/completions", timeout=600,
                       json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0})
        r.raise_for_status()
        body = r.json()
        return body["choices"][0]["text"], body["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(ask, range(n)))
    return sum(c for _, c in outs) / (time.perf_counter() - t0), outs


def measure(args: list[str], device: str, workdir: Path, clients: list[int], tokens: int):
    child, url = start(args, device, workdir)
    try:
        round_of(url, max(clients), min(tokens, 8))  # warm-up: window shapes captured once
        results = {n: round_of(url, n, tokens) for n in clients}
        decided = [line for line in child.lines if any(k in line for k in DECISIONS)]
        return results, decided
    finally:
        child.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--mtp", required=True, help="the MTP-only GGUF (file or folder)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--extra", default="", help="more engine flags for both servers")
    a = ap.parse_args()
    clients = [int(c) for c in a.clients.split(",")]
    base = ["--pack", a.pack, *shlex.split(a.extra)]
    with tempfile.TemporaryDirectory() as d:
        plain, _ = measure([*base, "--spec", "0"], a.device, Path(d), clients, a.tokens)
        report, decided = measure([*base, "--mtp", a.mtp, *REPORT], a.device, Path(d), clients, a.tokens)
    print("\n".join(decided))
    print("| clients | plain tok/s | report config tok/s | report / plain | tokens equal plain |")
    print("|---:|---:|---:|---:|---|")
    all_equal = True
    for n in clients:
        (p_rate, p_out), (r_rate, r_out) = plain[n], report[n]
        equal = p_out == r_out
        all_equal &= equal
        print(f"| {n} | {p_rate:.1f} | {r_rate:.1f} | {r_rate / p_rate:.2f} | {'yes' if equal else 'NO'} |")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
