"""Achieved weight bandwidth of the CUDA MMVQ kernels, per type, vs a device-to-device copy.

    python3 bench/bench_mmvq.py [--rows 14336] [--k 4096] [--types Q4_K,IQ3_S] [--cols 1,4,8]

Method: weights of each type (random valid blocks) in several buffers whose total is well
past the L2 (so each launch reads its weights from HBM); activations pre-quantized; a CUDA
graph of LAUNCHES mat-vecs that rotate over the buffers is replayed REPLAYS times, each replay
timed with CUDA events; time per launch = median replay time / LAUNCHES (graph replay keeps
Python launch overhead out; on sm_90+ the launches are programmatic dependent ones, each
fetching its first weights while the one before it ends, as in decode windows, unless
STRATA_CUDA_PDL=0). Bandwidth = weight bytes / time per launch. The copy reference
moves a 1 GiB buffer (bytes read + bytes written over time, median of 20). The "read" column:
a kernel that only reads each type's weight bytes, launched plainly and timed the same way (what
a plain launch of that size reaches; under PDL more is reachable: bench/probes/bench_launch_ceiling.py).
Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from strata.kernels.cuda import launch as pdl  # noqa: E402
from strata.kernels.cuda import mmvq as gpu  # noqa: E402
from strata.kernels.ggml_types import type_by_id, type_by_name  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402

L2_FLUSH_BYTES = 400 << 20  # weight bytes cycled through per graph: several L2 sizes (60 MB)
LAUNCHES = 40
REPLAYS = 15


def event_ms(fn, stream) -> float:
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    src = cp.random.randint(0, 255, nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    stream = cp.cuda.get_current_stream()
    for _ in range(3):
        dst[...] = src
    times = [event_ms(lambda: dst.__setitem__(Ellipsis, src), stream) for _ in range(20)]
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def random_weight_buffer(type_id: int, rows: int, k: int, rng) -> cp.ndarray:
    """Random valid blocks on the device; built from a tile of host rows repeated (fast)."""
    base_rows = min(rows, 512)
    host = random_blocks(type_id, base_rows, k, rng)
    reps = -(-rows // base_rows)
    dev = cp.tile(cp.asarray(host), (reps, 1))[:rows]
    return cp.ascontiguousarray(dev)


def graph_seconds(launch, stream) -> float:
    """Seconds per launch: launch(0..LAUNCHES-1) captured in one CUDA graph, replayed REPLAYS
    times (median), so Python launch overhead stays out."""
    with stream:
        for i in range(2):  # compile, load, warm
            launch(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(LAUNCHES):
            launch(i)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    times = [event_ms(lambda: graph.launch(stream), stream) for _ in range(REPLAYS)]
    return statistics.median(times) * 1e-3 / LAUNCHES


def time_type(type_id: int, rows: int, k: int, col_counts, rng) -> dict[int, float]:
    t = type_by_id(type_id)
    nbytes = rows * t.row_bytes(k)
    nbuf = max(3, -(-L2_FLUSH_BYTES // nbytes))
    first = random_weight_buffer(type_id, rows, k, rng)
    bufs = [first] + [cp.roll(first, 7 * (i + 1), axis=0) for i in range(nbuf - 1)]
    stream = cp.cuda.Stream(non_blocking=True)
    result = {}
    for ncols in col_counts:
        x = cp.asarray(rng.standard_normal((ncols, k)).astype(np.float32))
        act = x if type_id in gpu.FLOAT_TYPES else gpu.quantize_q8_1(x)
        out = cp.empty((ncols, rows), dtype=cp.float32)
        result[ncols] = graph_seconds(lambda i: gpu.mmvq(type_id, bufs[i % nbuf], rows, k, act, out=out), stream)
    bufs.clear()  # the weight copies go back to the pool before the next type's
    cp.get_default_memory_pool().free_all_blocks()
    return result


# What a plain launch that only reads `nbytes` achieves here: every thread streams 16-byte loads
# and folds them into a value that is (almost) never written. Timed like the MMVQ kernels
# (graphs of LAUNCHES, rotating over buffers past the L2), but launched plainly, so each launch
# pays its ramp and tail; under PDL, as the MMVQ kernels run, a launch of 14336 x 4096's size
# reaches the copy rate (bench/probes/bench_launch_ceiling.py).
_READ_SOURCE = r"""
extern "C" __global__ void read_only(const uint4* __restrict__ p, unsigned long long n16, unsigned* out) {
    unsigned acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {  // four loads in flight per thread
        const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
                    d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def read_only_seconds(nbytes: int) -> float:
    kernel = cp.RawKernel(_READ_SOURCE, "read_only")
    n16 = nbytes // 16
    nbuf = max(3, -(-L2_FLUSH_BYTES // nbytes))
    bufs = [cp.random.randint(0, 2**31 - 1, n16 * 4, dtype=cp.uint32) for _ in range(nbuf)]
    out = cp.zeros(1, dtype=cp.uint32)
    blocks = cp.cuda.Device().attributes["MultiProcessorCount"] * 8  # 2048 threads per SM: full occupancy
    stream = cp.cuda.Stream(non_blocking=True)
    secs = graph_seconds(lambda i: kernel((blocks,), (256,), (bufs[i % nbuf], np.uint64(n16), out)), stream)
    bufs.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return secs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=14336)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--types", default="", help="comma-separated type names (default: all)")
    p.add_argument("--cols", default="1,4,8")
    args = p.parse_args(argv)
    col_counts = [int(c) for c in args.cols.split(",")]
    ids = [type_by_name(n).id for n in args.types.split(",") if n] or list(gpu.supported_types())
    t0 = time.perf_counter()
    gpu.compile_all(ids)
    print(f"compiled {len(ids)} types in {time.perf_counter() - t0:.1f} s")
    dev = cp.cuda.runtime.getDeviceProperties(0)
    copy_gbs = copy_bandwidth()
    print(f"device: {dev['name'].decode()}  copy (read+write): {copy_gbs:.0f} GB/s  "
          f"PDL in the graphs: {'on' if pdl.enabled() else 'off'} ({pdl.PDL_ENV})")
    print(f"W {args.rows} x {args.k}; time per launch (us) and weight GB/s; % = of copy bandwidth; "
          "read = a kernel that only reads the same bytes, launched plainly, us and % of copy")
    hdr = f"{'type':8s} {'MB':>7s} | read us    % " + "".join(f" | {c}col us   GB/s    %" for c in col_counts)
    print(hdr)
    print("-" * len(hdr))
    rng = np.random.default_rng(0)
    for tid in ids:
        t = type_by_id(tid)
        nbytes = args.rows * t.row_bytes(args.k)
        res = time_type(tid, args.rows, args.k, col_counts, rng)
        read_s = read_only_seconds(nbytes)
        line = f"{t.name:8s} {nbytes / 1e6:7.1f} | {read_s * 1e6:7.1f} {100 * nbytes / read_s / 1e9 / copy_gbs:4.0f}"
        for c in col_counts:
            s = res[c]
            gbs = nbytes / s / 1e9
            line += f" | {s * 1e6:7.1f} {gbs:6.0f} {100 * gbs / copy_gbs:4.0f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
