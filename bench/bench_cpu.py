"""CPU (numpy backend) speed of the test model: prefill and decode tokens/s, and the
memory-bandwidth floor that bounds decode (a table; no assertions).

    python bench/bench_cpu.py [--pack FILE] [--runs 3] [--decode 128] [--prefill 128,512] [--threads 1,2]

Each BLAS thread count runs in its own child process (OpenBLAS reads OPENBLAS_NUM_THREADS
once, at import): on a shared 2-core machine two BLAS threads can be 10x slower than one,
because its threads spin while other processes hold the cores.

Decode reads every float32 weight of the model once per token (the numpy backend keeps a
dequantized float32 copy of each matrix), so its ceiling is copy bandwidth / weight bytes.
Both are measured in the same run because the machine is shared and its bandwidth varies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from strata.backend.cpu import CpuBackend
from strata.defaults import default_model_path
from strata.model.config import config_from_metadata
from strata.model.transformer import Span, Transformer
from strata.pack.loader import open_pack
from strata.text.tokenizer import Tokenizer

TEXT = ("The history of the river towns is a story of water and trade. Boats carried grain, "
        "timber and salt downstream, and the towns grew rich on tolls, bridges and markets. ")


def load(path: str) -> tuple[Transformer, Tokenizer]:
    pack = open_pack(pack=path, native=None, ple_gguf=[])
    cfg = config_from_metadata(pack.metadata)
    threads = os.environ.get("STRATA_BENCH_THREADS", "auto")
    backend = CpuBackend(threads=None if threads == "auto" else int(threads))
    model = Transformer(backend, cfg, lambda name: pack.tensors.get(name))
    return model, Tokenizer.from_metadata(pack.metadata)


def weight_bytes_per_token(model: Transformer) -> int:
    """float32 bytes a one-token forward reads: every matrix once (the embedding row aside)."""
    from strata.backend.cpu import DenseWeight
    from strata.backend.cpu_experts import DenseExperts

    total = int(model.output.wt.nbytes)
    share = model.cfg.n_expert_used / max(1, model.cfg.n_expert)  # routed experts: only n_expert_used per token
    for layer in model.layers:
        for part in (layer.mixer, layer.ffn):
            for w in vars(part).values():
                if isinstance(w, DenseWeight):
                    total += int(w.wt.nbytes)
                elif isinstance(w, DenseExperts):
                    total += int(share * w.wt.nbytes)
    return total


def copy_bandwidth(nbytes: int = 256 << 20, runs: int = 5) -> float:
    """Bytes/s moved by np.copyto (read + write) on arrays far larger than the caches."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def prefill_tps(model: Transformer, tokens: np.ndarray) -> float:
    cache = model.new_cache(len(tokens) + 1, "f16")
    t0 = time.perf_counter()
    hidden = model.forward(tokens, [Span(cache, 0, len(tokens))])
    model.logits(hidden[-1:])  # what a request needs after its prompt
    return len(tokens) / (time.perf_counter() - t0)


def decode_tps(model: Transformer, prompt: np.ndarray, n: int) -> float:
    """Greedy decode of n tokens after a prompt: one-token windows, logits, argmax."""
    cache = model.new_cache(len(prompt) + n + 1, "f16")
    hidden = model.forward(prompt, [Span(cache, 0, len(prompt))])
    tok = int(np.argmax(model.logits(hidden[-1:])[0]))
    t0 = time.perf_counter()
    for _ in range(n):
        hidden = model.forward(np.asarray([tok]), [Span(cache, cache.length, 1)])
        tok = int(np.argmax(model.logits(hidden)[0]))
    return n / (time.perf_counter() - t0)


def measure(a) -> dict:
    model, tok = load(a.pack)
    ids = tok.encode(TEXT * 40, add_special=False)
    lengths = [int(n) for n in a.prefill.split(",")]
    ids = np.asarray((ids * (max(lengths) // len(ids) + 1))[: max(lengths)], dtype=np.int64)
    prefill_tps(model, ids[:16])  # warm up BLAS and the allocator
    rows = [(f"prefill {n} tokens", statistics.median(prefill_tps(model, ids[:n]) for _ in range(a.runs)))
            for n in lengths]
    rows.append((f"decode {a.decode} tokens (greedy)",
                 statistics.median(decode_tps(model, ids[:32], a.decode) for _ in range(a.runs))))
    cfg = model.cfg
    return {"model": f"{cfg.name} ({cfg.arch}, {cfg.n_layer} layers)", "rows": rows,
            "weight_bytes": weight_bytes_per_token(model), "bandwidth": copy_bandwidth()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", default=None, help="GGUF file (default: the test model)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--threads", default="auto,1,2",
                    help="BLAS thread policies to compare: auto (the engine's default: 1 thread for "
                         "decode windows, all cores for prefill) or a fixed count")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.pack = a.pack or str(default_model_path())
    if a.child:
        print(json.dumps(measure(a)))
        return

    results = {}
    for t in a.threads.split(","):
        env = {**os.environ, "STRATA_BENCH_THREADS": t}
        if t != "auto":
            env.update(OPENBLAS_NUM_THREADS=t, OMP_NUM_THREADS=t, MKL_NUM_THREADS=t)
        argv = [sys.executable, __file__, "--child", "--pack", a.pack, "--runs", str(a.runs),
                "--decode", str(a.decode), "--prefill", a.prefill]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        results[t] = json.loads(done.stdout.strip().splitlines()[-1])
    first = next(iter(results.values()))
    print(f"model: {first['model']}, numpy CPU backend, median of {a.runs} runs, {os.cpu_count()} CPUs")
    print(f"{'tok/s':32s} " + " ".join(f"{t + ' BLAS thr':>12s}" for t in results))
    for i, (what, _) in enumerate(first["rows"]):
        print(f"{what:32s} " + " ".join(f"{r['rows'][i][1]:12.1f}" for r in results.values()))
    wbytes = first["weight_bytes"]
    print(f"float32 weights read per decode token: {wbytes / 2**20:.1f} MiB")
    for t, r in results.items():
        floor_ms = 1e3 * wbytes / r["bandwidth"]
        decode = r["rows"][-1][1]
        print(f"{t} BLAS thr: numpy copy bandwidth (read+write) {r['bandwidth'] / 1e9:.2f} GB/s -> "
              f"floor {floor_ms:.1f} ms/token, at most {1e3 / floor_ms:.1f} tok/s; decode reaches "
              f"{decode * floor_ms / 1e3:.0%} of it")


if __name__ == "__main__":
    main()
