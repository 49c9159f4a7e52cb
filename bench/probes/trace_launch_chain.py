"""When each block of a PDL chain of mat-vec-shaped launches starts, has its bytes, passes its
wait and ends: the timeline behind bench/probes/bench_launch_ceiling.py's numbers.

    python3 bench/probes/trace_launch_chain.py [--mb 16.5] [--share 4096] [--work 6]

The kernel is bench_launch_ceiling's "tiles" shape (each warp copies its share of the bytes into
shared memory before the wait, then folds them with `work` rounds of 3 integer instructions per
word); warp 0 of every block stamps the global timer at its start, when its bytes have landed,
when griddepcontrol.wait returns and at its end. A graph of LAUNCHES launches rotating over
buffers past the L2 is replayed a few times and the last replay's stamps are printed per launch
(us from the first block's start): whether the next launch's blocks come in and fetch while this
one folds, and what the wait costs.

Variants: "early" (allows its successor at its start, as every MMVQ does), "padded" (shared
memory padded so that no block of the next launch fits beside a running one), "late" (allows
its successor only at its end: no overlap at all), "flag" (early, but waits for its
predecessor's blocks to have counted themselves done instead of griddepcontrol.wait: what the
wait's own latency costs). --tiny times chains of launches that have nothing to do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: bench_mmvq

import cupy as cp  # noqa: E402

from bench_launch_ceiling import _SOURCE as CEILING_SOURCE  # noqa: E402  (its fold and typedefs)
from bench_mmvq import L2_FLUSH_BYTES  # noqa: E402
from strata.kernels.cuda import launch as pdl  # noqa: E402

LAUNCHES = 8
REPLAYS = 3

_SOURCE = r"""
__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
extern "C" __global__ void traced(const u8* __restrict__ p, unsigned share, unsigned long long nbytes, unsigned* out,
                                  int work, unsigned long long* trace, int launch_idx, int late, unsigned* done) {
    extern __shared__ __align__(16) u8 sm[];
    const unsigned long long t0 = gtime();
    if (!late) allow_dependents();
    const unsigned lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const unsigned long long base = ((unsigned long long)blockIdx.x * (blockDim.x >> 5) + wib) * share;
    u8* mine = sm + wib * share;
    const unsigned sb = (unsigned)__cvta_generic_to_shared(mine);
    for (unsigned j = 16 * lane; j < share; j += 512)
        if (base + j < nbytes)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sb + j), "l"(p + base + j));
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    const unsigned long long t1 = gtime();
    if (!done || launch_idx == 0) {  // the first also waits for the counters' zeroing
        wait_prior_grids();
    } else if (launch_idx > 0) {  // "flag": the predecessor's blocks counted done, not its grid's end
        if (threadIdx.x == 0) {
            unsigned n = 0;
            do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(done + launch_idx - 1) : "memory");
            while (n < gridDim.x);
        }
        __syncthreads();
    }
    const unsigned long long t2 = gtime();
    __syncwarp();
    const unsigned acc = fold(mine, share, lane, work);  // bench_launch_ceiling's
    if (acc == 0x9e3779b9u) out[0] = acc;
    __syncthreads();
    const unsigned long long t3 = gtime();
    if (late) allow_dependents();
    if (done && threadIdx.x == 0)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(done + launch_idx) : "memory");
    if (threadIdx.x == 0) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        unsigned long long* r = trace + ((unsigned long long)launch_idx * gridDim.x + blockIdx.x) * 5;
        r[0] = t0; r[1] = t1; r[2] = t2; r[3] = t3; r[4] = smid;
    }
}
"""

# name: (padded, late, flag); "flag" waits for its predecessor's blocks to have counted themselves done
# (a release add each, an acquire load) instead of griddepcontrol.wait (the predecessor grid's end)
VARIANTS = {"early": (0, False, False), "padded": (1, False, False), "late": (0, True, False), "flag": (0, False, True)}


def trace(nbytes: int, share: int, work: int, padded: bool, late: bool, warps: int = 4,
          flag: bool = False) -> np.ndarray:
    pdl_h = (Path(__file__).resolve().parents[2] / "strata/kernels/cuda/pdl.cuh").read_text()
    fn = cp.RawModule(code=pdl_h + CEILING_SOURCE + _SOURCE, options=("-std=c++17",)).get_function("traced")
    fn.max_dynamic_shared_size_bytes = 200 * 1024
    nbytes = nbytes // 16 * 16
    nbuf = max(3, -(-L2_FLUSH_BYTES // nbytes))
    bufs = [cp.random.randint(0, 2**31 - 1, nbytes // 4, dtype=cp.uint32) for _ in range(nbuf)]
    blocks = -(-nbytes // (warps * share))
    smem = max(warps * share, 32768) if padded else warps * share
    out = cp.zeros(1, dtype=cp.uint32)
    stamps = cp.zeros((LAUNCHES, blocks, 5), dtype=cp.uint64)
    done = cp.zeros(LAUNCHES, dtype=cp.uint32)  # zeroed at the start of each replay (a memset node)
    stream = cp.cuda.Stream(non_blocking=True)

    def one(i):
        args = (bufs[i % nbuf], np.uint32(share), np.uint64(nbytes), out, np.int32(work), stamps, np.int32(i),
                np.int32(int(late)), done if flag else np.uint64(0))
        pdl.launch(fn, (blocks,), (32 * warps,), args, shared_mem=smem)

    with stream:
        one(0)
        stream.synchronize()
        stream.begin_capture()
        done.fill(0)
        for i in range(LAUNCHES):
            one(i)
        graph = stream.end_capture()
        for _ in range(REPLAYS):
            graph.launch(stream)
        stream.synchronize()
    return cp.asnumpy(stamps)


def report(name: str, st: np.ndarray) -> None:
    t = (st[:, :, :4].astype(np.int64) - int(st[0, :, 0].min())) / 1e3  # us
    print(f"\n{name}: us from the first block's start; per launch min / median / max over blocks")
    print("| launch | start | bytes landed | wait returns | end "
          "| blocks started before the previous launch's last end |")
    print("|---:|---|---|---|---|---:|")
    for i in range(t.shape[0]):
        cells = [f"{t[i, :, c].min():.1f} / {np.median(t[i, :, c]):.1f} / {t[i, :, c].max():.1f}" for c in range(4)]
        early = int((t[i, :, 0] < t[i - 1, :, 3].max()).sum()) if i else 0
        print(f"| {i} | " + " | ".join(cells) + f" | {early} of {t.shape[1]} |")
    per = (t[-1, :, 3].max() - t[0, :, 3].max()) / (t.shape[0] - 1)
    print(f"us per launch (last ends, launches 1..{t.shape[0] - 1}): {per:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=16.5)
    p.add_argument("--share", type=int, default=4096)
    p.add_argument("--work", default="6,0", help="comma-separated rounds of arithmetic per word")
    p.add_argument("--tiny", action="store_true", help="instead: chains of launches of one 16-byte piece a warp, "
                   "one block an SM (what a launch of the chain costs when it has nothing to do)")
    p.add_argument("--shapes", default="", help="instead: comma-separated WARPSxBLOCKS_PER_SM block shapes, each "
                   "launch sized to fill that many blocks of WARPS warps on every SM (early variant, first --work)")
    a = p.parse_args(argv)
    if a.tiny:
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        for name, (padded, late, flag) in VARIANTS.items():
            if not padded:
                report(f"tiny launches, {name}", trace(sms * 4 * 16, 16, 0, False, late, flag=flag))
        return 0
    if a.shapes:
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        work = int(a.work.split(",")[0])
        for shape in a.shapes.split(","):
            w, b = (int(v) for v in shape.split("x"))
            nbytes = sms * b * w * a.share
            report(f"{nbytes / 1e6:.1f} MB, {w} warps a block, {b} blocks an SM, share {a.share}, work {work}",
                   trace(nbytes, a.share, work, False, False, warps=w))
        return 0
    for work in (int(w) for w in a.work.split(",")):
        for name, (padded, late, flag) in VARIANTS.items():
            stamps = trace(int(a.mb * 1e6), a.share, work, bool(padded), late, flag=flag)
            report(f"{a.mb} MB, share {a.share}, work {work}, {name}", stamps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
