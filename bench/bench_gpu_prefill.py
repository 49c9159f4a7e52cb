"""Prefill on the GPU: today's MMVQ split (ceil(n/8) launches) vs dequantize-to-f16 + cuBLAS GEMM.

    python3 bench/bench_gpu_prefill.py [--types Q4_K,Q8_0] [--ns 16,32,64,128,512] [--json out.json]

For every type x weight shape (rows x k: 576x1536 small, 4096x14336, 14336x4096) x window n:
- mmvq: what strata/backend/cuda.py's _run does for n > 8 today: quantize the activations to
  Q8_1 once, then mmvq.mmvq over the columns, 8 per launch;
- gemm: strata.backend.cuda_prefill.PrefillPath.linear (x to f16, weight dequantized to f16 in
  tiles of the scratch size, cublasGemmEx with float32 accumulation).
Each is timed two ways: eager (a loop of REPS calls between CUDA events: max of GPU time and
Python launch time, what an eager engine sees) and gpu (the same loop queued behind a spin
kernel that outlasts its submission: GPU time alone). Weights rotate over enough copies to pass 200 MB
per loop, so they come from HBM as in a real forward pass. TFLOP/s = 2 n rows k / time.
The crossover per type = smallest measured n from which gemm wins (eager) at that n and every
larger measured n; "small" from 576x1536, "large" the max over the two large shapes. Also:
tile-size study, dequantization alone (GB/s of f16 written + blocks read), host cost per piece,
and what cupy.matmul does with float16 operands.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp  # noqa: E402

from strata.backend.cuda_prefill import PrefillPath  # noqa: E402
from strata.kernels.cuda import dequant, mmvq  # noqa: E402
from strata.kernels.ggml_types import type_by_id, type_by_name  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402
from bench_mmvq import event_ms as timed  # noqa: E402

SHAPES = {"small": [(576, 1536)], "large": [(4096, 14336), (14336, 4096)]}
ROTATE_BYTES = 200 << 20
REPS = 4
REPLAYS = 3
NEVER = 1 << 30


def weight_copies(tid: int, rows: int, k: int, rng) -> list:
    """Device copies of one random valid weight (host rows tiled: fast at real sizes)."""
    base = random_blocks(tid, min(rows, 256), k, rng)
    host = np.ascontiguousarray(np.tile(base, (-(-rows // base.shape[0]), 1))[:rows])
    one = cp.asarray(host)
    copies = max(2, min(32, -(-ROTATE_BYTES // max(1, host.nbytes))))
    return [one] + [one.copy() for _ in range(copies - 1)]


_SPIN = None


def _spin(ms: float, stream) -> None:
    """Keep the GPU busy ~ms so the calls queued behind it are timed on the GPU alone."""
    global _SPIN
    if _SPIN is None:
        _SPIN = cp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
            const long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""", "spin")
    clock_khz = cp.cuda.Device().attributes["ClockRate"]
    _SPIN((1,), (1,), (np.int64(ms * clock_khz),), stream=stream)


def measure(step, stream) -> tuple[float, float]:
    """(eager ms, gpu ms) per call of step(i) (i = rep index), median over REPLAYS.
    eager: the loop between two events (max of GPU time and Python submission time);
    gpu: the same loop queued behind a spin kernel that outlasts its submission, so the events
    around it time the GPU work alone. (CUDA graphs would do, but CuPy refuses cuBLAS calls
    during stream capture.)"""
    def loop():
        for i in range(REPS):
            step(i)

    with stream:
        loop()  # warm: compiled, scratch grown
        t0 = time.perf_counter()
        loop()
        submit_ms = (time.perf_counter() - t0) * 1e3
        stream.synchronize()
        eager = statistics.median(timed(loop, stream) for _ in range(REPLAYS)) / REPS
        gpu = []
        for _ in range(REPLAYS):
            _spin(2.0 + 2.0 * submit_ms, stream)
            gpu.append(timed(loop, stream))
        return eager, statistics.median(gpu) / REPS


def bench_pair(tid, ws, rows, k, n, path, stream):
    x = cp.asarray(np.random.default_rng(n).standard_normal((n, k)).astype(np.float32))
    out = cp.empty((n, rows), dtype=cp.float32)
    float_w = tid in mmvq.FLOAT_TYPES
    q8 = None if float_w else mmvq.empty_q8(n, k)

    def split(i):
        w = ws[i % len(ws)]
        if float_w:
            mmvq.mmvq(tid, w, rows, k, x, out=out)
        else:
            mmvq.quantize_q8_1(x, q8)
            mmvq.mmvq(tid, w, rows, k, q8, out=out)

    def gemm(i):
        path.linear(tid, ws[i % len(ws)], rows, k, x, out=out)

    return measure(split, stream), measure(gemm, stream)


def crossover(wins: dict[int, bool]) -> int:
    ns = sorted(wins)
    for i, n in enumerate(ns):
        if all(wins[m] for m in ns[i:]):
            return n
    return NEVER


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="")
    ap.add_argument("--ns", default="16,32,64,128,512")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tids = [type_by_name(s).id for s in args.types.split(",") if s] or list(mmvq.supported_types())
    ns = [int(s) for s in args.ns.split(",")]
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}  cupy {cp.__version__}", flush=True)
    mmvq.compile_all(tids, threads=16)
    dequant.compile_all(tids, threads=16)
    stream = cp.cuda.Stream(non_blocking=True)
    path = PrefillPath()
    rng = np.random.default_rng(0)
    results = []
    print("\n| type | rows x k | n | mmvq ms | TFLOP/s | gemm ms | TFLOP/s | gpu mmvq ms | gpu gemm ms | win |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for tid in tids:
        name = type_by_id(tid).name
        for cls, shapes in SHAPES.items():
            for rows, k in shapes:
                ws = weight_copies(tid, rows, k, rng)
                for n in ns:
                    (me, mg), (ge, gg) = bench_pair(tid, ws, rows, k, n, path, stream)
                    fl = 2.0 * n * rows * k
                    r = dict(type=name, cls=cls, rows=rows, k=k, n=n, mmvq_ms=me, gemm_ms=ge,
                             mmvq_gpu_ms=mg, gemm_gpu_ms=gg)
                    results.append(r)
                    print(f"| {name} | {rows}x{k} | {n} | {me:.4f} | {fl / me / 1e9:.2f} | {ge:.4f} | "
                          f"{fl / ge / 1e9:.2f} | {mg:.4f} | {gg:.4f} | {'gemm' if ge < me else 'mmvq'} |", flush=True)
                ws = None
                cp.get_default_memory_pool().free_all_blocks()

    table = {}
    for tid in tids:
        name = type_by_id(tid).name
        cx = {}
        for cls in SHAPES:
            per_shape = []
            for rows, k in SHAPES[cls]:
                rs = [r for r in results if r["type"] == name and r["rows"] == rows and r["k"] == k]
                per_shape.append(crossover({r["n"]: r["gemm_ms"] < r["mmvq_ms"] for r in rs}))
            cx[cls] = max(per_shape)
        table[name] = (cx["small"], cx["large"])
    print("\nCROSSOVER (smallest n where gemm wins, eager; 1<<30 = never in the measured range):")
    print("{" + ", ".join(f'"{k}": ({s}, {l})' for k, (s, l) in table.items()) + "}", flush=True)
    gpu_table = {}
    for name in table:
        cx = []
        for cls in SHAPES:
            cx.append(max(crossover({r["n"]: r["gemm_gpu_ms"] < r["mmvq_gpu_ms"] for r in results
                                     if r["type"] == name and r["rows"] == rows and r["k"] == k})
                          for rows, k in SHAPES[cls]))
        gpu_table[name] = tuple(cx)
    print("CROSSOVER on GPU time alone (no Python launch cost):")
    print("{" + ", ".join(f'"{k}": ({s}, {l})' for k, (s, l) in gpu_table.items()) + "}", flush=True)

    # tile size: how much scratch the widened weight needs
    print("\n| type | rows x k | n | scratch MiB | tiles | eager ms | gpu ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    tiles = []
    for name in ("Q4_K",):
        tid = type_by_name(name).id
        if tid not in tids:
            continue
        for rows, k in SHAPES["large"]:
            ws = weight_copies(tid, rows, k, rng)
            for n in (64, 512):
                for mib in (8, 32, 128):
                    p = PrefillPath(scratch_bytes=mib << 20)
                    x = cp.asarray(np.ones((n, k), dtype=np.float32))
                    out = cp.empty((n, rows), dtype=cp.float32)
                    e, g = measure(lambda i: p.linear(tid, ws[i % len(ws)], rows, k, x, out=out), stream)
                    nt = -(-rows // p.tile_rows(rows, k))
                    tiles.append(dict(type=name, rows=rows, k=k, n=n, mib=mib, tiles=nt, eager_ms=e, gpu_ms=g))
                    print(f"| {name} | {rows}x{k} | {n} | {mib} | {nt} | {e:.4f} | {g:.4f} |", flush=True)
                    p = None  # its scratch goes back to the pool
            ws = None
            cp.get_default_memory_pool().free_all_blocks()

    # dequantization alone, large shape, into a preallocated f16 buffer
    print("\n| type | 14336x4096 dequant us (gpu) | GB/s (blocks read + f16 written) |")
    print("|---|---:|---:|")
    deq = {}
    rows, k = 14336, 4096
    o16 = cp.empty((rows, k), dtype=cp.float16)
    for tid in tids:
        t = type_by_id(tid)
        ws = weight_copies(tid, rows, k, rng)
        e, g = measure(lambda i: dequant.dequantize_rows_f16(tid, ws[i % len(ws)], rows, k, out=o16), stream)
        gbs = (ws[0].nbytes + o16.nbytes) / (g * 1e-3) / 1e9
        deq[t.name] = g
        print(f"| {t.name} | {g * 1e3:.1f} | {gbs:.0f} |", flush=True)
        ws = None
        cp.get_default_memory_pool().free_all_blocks()

    # host (Python + driver) cost of each piece, small weight: where eager time goes
    print("\n| piece (576x1536 Q4_K, n=64) | host us per call |")
    print("|---|---:|")
    tid, rows, k, n = type_by_name("Q4_K").id, 576, 1536, 64
    w = weight_copies(tid, rows, k, rng)[0]
    x = cp.asarray(np.ones((n, k), dtype=np.float32))
    out = cp.empty((n, rows), dtype=cp.float32)
    x16 = cp.empty((n, k), dtype=cp.float16)
    w16 = cp.empty((rows, k), dtype=cp.float16)
    q8 = mmvq.empty_q8(n, k)
    pieces = {
        "cp.copyto f32->f16": lambda: cp.copyto(x16, x, casting="same_kind"),
        "dequant.dequantize_rows_f16": lambda: dequant.dequantize_rows_f16(tid, w, rows, k, out=w16),
        "dequant._launch": lambda: dequant._launch(tid, w, type_by_id(tid).row_bytes(k), k, rows, None, rows, w16),
        "PrefillPath._gemm": lambda: path._gemm(w16, x16, out, 0, rows, k),
        "PrefillPath.linear": lambda: path.linear(tid, w, rows, k, x, out=out),
        "mmvq.quantize_q8_1": lambda: mmvq.quantize_q8_1(x, q8),
        "mmvq.mmvq (8 launches)": lambda: mmvq.mmvq(tid, w, rows, k, q8, out=out),
    }
    host = {}
    with stream:
        for label, fn in pieces.items():
            fn()
            stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            host[label] = (time.perf_counter() - t0) / 50 * 1e6
            stream.synchronize()
            print(f"| {label} | {host[label]:.1f} |", flush=True)

    # what cupy.matmul does with float16 operands
    a = cp.asarray(np.random.default_rng(1).standard_normal((512, 4096)).astype(np.float16))
    b = cp.asarray(np.random.default_rng(2).standard_normal((4096, 1024)).astype(np.float16))
    ref = cp.asnumpy(a).astype(np.float64) @ cp.asnumpy(b).astype(np.float64)
    m16 = cp.matmul(a, b)
    rel16 = float(np.linalg.norm(cp.asnumpy(m16).astype(np.float64) - ref) / np.linalg.norm(ref))
    pp = PrefillPath()
    y = cp.empty((512, 1024), dtype=cp.float32)
    pp._gemm(cp.ascontiguousarray(b.T), a, y, 0, 1024, 4096)
    relg = float(np.linalg.norm(cp.asnumpy(y).astype(np.float64) - ref) / np.linalg.norm(ref))
    print(f"\ncupy.matmul(f16, f16) -> {m16.dtype}, rel err vs float64 {rel16:.2e}; "
          f"PrefillPath gemmEx (f32 out, compute 32F) rel err {relg:.2e}", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, crossover=table, tiles=tiles,
                                                   dequant_ms=deq, host_us=host, gpu_crossover=gpu_table, matmul_f16_rel=rel16,
                                                   gemmex_rel=relg), indent=1))


if __name__ == "__main__":
    main()
