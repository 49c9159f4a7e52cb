"""What a chain of launches that only read their bytes reaches, with and without PDL.

    python3 bench/probes/bench_launch_ceiling.py [--mb 16.5,25.2,33.0,132.1] [--share 4608]

bench_mmvq.py's "read" column is a read-only kernel launched plainly: each launch in its graph
starts when the one before has ended, so every launch pays its ramp and tail. The MMVQ kernels
are launched with programmatic dependent launch (PDL) in decode graphs and in that benchmark,
so their ceiling is another. This times, the same way (graphs of LAUNCHES launches rotating over
buffers past the L2, median of REPLAYS replays / LAUNCHES), kernels that read N bytes and fold
them into a value that is (almost) never written:

  plain     grid-stride 16-byte loads, 2048 threads per SM, launched plainly (bench_mmvq's read)
  pdl_pre   the same, launched with PDL: allows its successor at once, reads, then waits for
            its predecessor before its (never taken) write. Launches overlap freely.
  pdl_post  the same, but it waits before it reads (a kernel that needs its input first)
  tiles     MMVQ's shape: each warp copies a contiguous share of the bytes into shared memory
            (cp.async, all of it before the wait, as the one-column MMVQ does at 14336 x 4096),
            waits for its predecessor, then folds its share. Launched with PDL.
  tiles24   tiles with its shared memory padded so that 24 warps fit an SM (the one-column Q2_0
            MMVQ's residency): the next launch's blocks cannot come in until these leave
  wN0       tiles with N rounds of 3 integer instructions per 4-byte word after the wait (a
            mat-vec's decode: Q2_0 ~70 instructions per 16 bytes is N ~ 6)
  wN1, wN2  wN0, and the next launch's share asked into L2 once this warp's bytes have landed
            (1) or after its arithmetic (2)
  wN_nowait wN0 with no wait at all (launches overlap freely: what the dependency costs)
  r*        (RINGS) each warp streams several pieces through a ring of stages, folding each with
            RING_WORK rounds: fewer warps per launch, so that the next launch can be resident
            and fetching while this one computes; "p" padded so that nothing else fits an SM,
            "post" fetching only after the wait (both measured slower: the overlap loses)
  s*        (SEQS) a copying warp per block fetches the 4 folding warps' shares piece by piece
            in order, `inflight` pieces in flight, each piece's arrival marked on an mbarrier;
            the folding warps fold each piece as it lands (measured at most ~9% better)

Prints a table: us per launch and % of a 1 GiB device-to-device copy (read + write).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: bench_mmvq

import cupy as cp  # noqa: E402

from bench_mmvq import L2_FLUSH_BYTES, copy_bandwidth, graph_seconds  # noqa: E402  (same method)
from strata.kernels.cuda import launch as pdl  # noqa: E402

WORKS = (6, 12)  # rounds of arithmetic per word in the tiles_work rows
VARIANTS = ("0", "1", "2", "_nowait")  # tiles_work kernels (suffixes)
# tiles_ring rows, name: (bytes per piece, pieces per warp, stages), each folded with RING_WORK
# rounds: r1 is w6's shape (one piece per warp, all of it before the wait); r2 and r4 give each
# warp 2 or 4 pieces (a half or a quarter of the warps), through 1 or 2 stages
RING_WORK = 6
# ("p": shared memory padded to 32 KB a block, so that 7 blocks, 28 warps, fit an SM: the one-column
# Q2_0 MMVQ's residency, set there by its registers)
# ("post": the first pieces issued only after the wait, as a kernel whose early blocks sit idle)
RINGS = {"r1": (4608, 1, 1, 0, 0), "r2s1": (4608, 2, 1, 0, 0), "r2s2": (2304, 4, 2, 0, 0), "r4s1": (4608, 4, 1, 0, 0),
         "r4s2": (4608, 4, 2, 0, 0), "r2x2": (2304, 2, 2, 0, 0), "r1p": (4608, 1, 1, 32768, 0),
         "r2s1p": (4608, 2, 1, 32768, 0), "r2s2p": (2304, 4, 2, 32768, 0), "r4s2p": (4608, 4, 2, 32768, 0),
         "r1post": (4608, 1, 1, 0, 1), "r1ppost": (4608, 1, 1, 32768, 1)}

# tiles_seq rows, name: (pieces per warp share, pieces in flight, padded shared
# memory per block), each folded with RING_WORK rounds (w6's arithmetic; "s1" is w6's shape
# through the copying warp)
SEQS = {"s1": (1, 1, 0), "s2i1": (2, 1, 0), "s4i1": (4, 1, 0), "s4i2": (4, 2, 0), "s8i2": (8, 2, 0), "s8i3": (8, 3, 0),
        "s1p": (1, 1, 32768), "s4i2p": (4, 2, 32768), "s8i2p": (8, 2, 32768), "s8i3p": (8, 3, 32768)}

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned char u8;
// MODE 0: plain (no PDL instructions); 1: allows its successor, reads, then waits; 2: waits, then reads
template <int MODE>
__device__ __forceinline__ void read_body(const uint4* __restrict__ p, unsigned long long n16, unsigned* out) {
    if (MODE) allow_dependents();
    if (MODE == 2) wait_prior_grids();
    unsigned acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {  // four loads in flight per thread
        const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (MODE == 1) wait_prior_grids();
    if (acc == 0x9e3779b9u) out[0] = acc;
}
extern "C" __global__ void plain(const uint4* __restrict__ p, unsigned long long n16, unsigned* out) { read_body<0>(p, n16, out); }
extern "C" __global__ void pdl_pre(const uint4* __restrict__ p, unsigned long long n16, unsigned* out) { read_body<1>(p, n16, out); }
extern "C" __global__ void pdl_post(const uint4* __restrict__ p, unsigned long long n16, unsigned* out) { read_body<2>(p, n16, out); }
// A warp's fold of `bytes` bytes of shared memory, 16 per lane at a time, with `work` rounds of
// 3 integer instructions per word on each (the tiles and ring rows' arithmetic after the wait).
__device__ __forceinline__ unsigned fold(const u8* buf, unsigned bytes, unsigned lane, int work) {
    unsigned acc = 0;
    for (unsigned j = 16 * lane; j < bytes; j += 512) {
        uint4 v = *(const uint4*)(buf + j);
        for (int w = 0; w < work; ++w) {
            v.x = (v.x ^ (v.x >> 7)) * 0x9E3779B1u;
            v.y = (v.y ^ (v.y >> 7)) * 0x9E3779B1u;
            v.z = (v.z ^ (v.z >> 7)) * 0x9E3779B1u;
            v.w = (v.w ^ (v.w >> 7)) * 0x9E3779B1u;
        }
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    return acc;
}
// 4 warps per block; warp w copies bytes [w * share, (w + 1) * share) into its part of shared
// memory before the wait, then folds them after it, with WORK rounds of 3 integer instructions
// per word (0 for "tiles"; the order of a mat-vec's decode: Q2_0 takes ~40 instructions per 32
// weights and row, ~70 per 16 bytes), and optionally asks L2 for the next launch's share of its
// bytes (PF 1: once this warp's own bytes have landed, before its arithmetic; PF 2: after it).
template <int PF, bool WAIT = true>  // WAIT false: no wait at all (what the dependency costs)
__device__ __forceinline__ void tiles_work_body(const u8* __restrict__ p, unsigned share, unsigned long long nbytes,
                                                unsigned* out, int work, const u8* __restrict__ next) {
    extern __shared__ __align__(16) u8 sm[];
    allow_dependents();
    const unsigned lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const unsigned long long base = ((unsigned long long)blockIdx.x * 4 + wib) * share;
    u8* mine = sm + wib * share;
    const u32 sb = (u32)__cvta_generic_to_shared(mine);
    for (unsigned j = 16 * lane; j < share; j += 512)
        if (base + j < nbytes) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sb + j), "l"(p + base + j));
    asm volatile("cp.async.commit_group;\n" ::);
    if (WAIT) wait_prior_grids();
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncwarp();
    const unsigned long long mine_bytes = base < nbytes ? min((unsigned long long)share, nbytes - base) : 0ull;
    if (PF == 1) prefetch_l2(next + base, mine_bytes, lane, 32);
    const unsigned acc = fold(mine, share, lane, work);
    if (PF == 2) prefetch_l2(next + base, mine_bytes, lane, 32);
    if (acc == 0x9e3779b9u) out[0] = acc;
}
// A warp streams `pieces` pieces of `piece` bytes through a ring of `stages` shared-memory
// stages, the first `stages` issued before the wait (a one-column MMVQ's stream_rows with more
// than one item per warp), folding each with WORK rounds after the wait. With fewer warps per
// launch (pieces x piece bytes each), a launch takes a smaller part of each SM, and the next
// launch's warps can be resident, fetching, while this one's arithmetic runs.
__device__ __forceinline__ void ring_body(const u8* __restrict__ p, unsigned piece, int pieces, int stages,
                                          unsigned long long nbytes, unsigned* out, int work, int post) {
    extern __shared__ __align__(16) u8 sm[];
    allow_dependents();
    const unsigned lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const unsigned long long base = ((unsigned long long)blockIdx.x * 4 + wib) * piece * pieces;
    u8* mine = sm + wib * piece * stages;
    const u32 sb = (u32)__cvta_generic_to_shared(mine);
    auto issue = [&](int i) {  // piece i into stage i % stages (an empty group past the end)
        if (i < pieces) {
            const unsigned long long g = base + (unsigned long long)i * piece;
            const u32 s = sb + (u32)(i % stages) * piece;
            for (unsigned j = 16 * lane; j < piece; j += 512)
                if (g + j < nbytes) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s + j), "l"(p + g + j));
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    if (!post)
        for (int i = 0; i < stages; ++i) issue(i);
    wait_prior_grids();
    if (post)
        for (int i = 0; i < stages; ++i) issue(i);
    unsigned acc = 0;
    for (int i = 0; i < pieces; ++i) {
        if (stages == 1) asm volatile("cp.async.wait_group 0;\n" ::);
        else if (stages == 2) asm volatile("cp.async.wait_group 1;\n" ::);
        else asm volatile("cp.async.wait_group 2;\n" ::);
        __syncwarp();
        acc ^= fold(mine + (i % stages) * piece, piece, lane, work);
        __syncwarp();
        issue(i + stages);
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
// SEQ rows: a block is 4 folding warps and 1 copying warp. The copying warp
// fetches the 4 warps' shares piece by piece in piece order (piece i of every warp, then piece
// i + 1), with `inflight` pieces in flight, and marks each piece's arrival on an mbarrier; the
// folding warps wait for the predecessor, then fold each piece as soon as it has landed. When
// every copy is issued at once (the tiles rows) the pieces land together at the stream's end
// and the arithmetic starts only then; in order, the first pieces' arithmetic runs while the
// later ones stream.
__device__ __forceinline__ void mbar_init(u32 a, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared.b64 st, [%0]; }" ::"r"(a) : "memory");
}
__device__ __forceinline__ bool mbar_done(u32 a) {  // phase 0 complete
    u32 ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(a) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void cp_wait_upto(int n) {  // at most n groups still pending
    if (n <= 0) asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    else if (n == 1) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    else if (n == 2) asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    else asm volatile("cp.async.wait_group 3;\n" ::: "memory");
}
extern "C" __global__ void tiles_seq(const u8* __restrict__ p, unsigned share, int pieces, int inflight,
                                     unsigned long long nbytes, unsigned* out, int work) {
    extern __shared__ __align__(16) u8 sm[];
    __shared__ __align__(8) unsigned long long bars[16];
    allow_dependents();
    const unsigned lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const unsigned piece = share / pieces;
    const unsigned long long bbase = (unsigned long long)blockIdx.x * 4 * share;
    const u32 bar0 = (u32)__cvta_generic_to_shared(bars);
    if (threadIdx.x == 0)
        for (int i = 0; i < pieces; ++i) mbar_init(bar0 + 8 * i, 32);
    __syncthreads();
    if (wib == 4) {
        const u32 sb = (u32)__cvta_generic_to_shared(sm);
        for (int i = 0; i < pieces; ++i) {
            for (int w = 0; w < 4; ++w) {
                const unsigned long long g = bbase + (unsigned long long)w * share + (unsigned long long)i * piece;
                const u32 s = sb + w * share + i * piece;
                for (unsigned j = 16 * lane; j < piece; j += 512)
                    if (g + j < nbytes) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s + j), "l"(p + g + j));
            }
            asm volatile("cp.async.commit_group;\n" ::);
            if (i >= inflight - 1) {
                cp_wait_upto(inflight - 1);
                mbar_arrive(bar0 + 8 * (i - inflight + 1));
            }
        }
        cp_wait_upto(0);
        for (int i = max(0, pieces - inflight + 1); i < pieces; ++i) mbar_arrive(bar0 + 8 * i);
        return;
    }
    wait_prior_grids();
    unsigned acc = 0;
    const u8* mine = sm + wib * share;
    for (int i = 0; i < pieces; ++i) {
        while (!mbar_done(bar0 + 8 * i)) {}
        acc ^= fold(mine + i * piece, piece, lane, work);
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
extern "C" __global__ void tiles_ring(const u8* p, unsigned piece, int pieces, int stages, unsigned long long nbytes,
                                      unsigned* out, int work, int post) { ring_body(p, piece, pieces, stages, nbytes, out, work, post); }
extern "C" __global__ void tiles(const u8* p, unsigned share, unsigned long long nbytes, unsigned* out) { tiles_work_body<0>(p, share, nbytes, out, 0, nullptr); }
extern "C" __global__ void tiles_work0(const u8* p, unsigned share, unsigned long long nbytes, unsigned* out, int work, const u8* next) { tiles_work_body<0>(p, share, nbytes, out, work, next); }
extern "C" __global__ void tiles_work1(const u8* p, unsigned share, unsigned long long nbytes, unsigned* out, int work, const u8* next) { tiles_work_body<1>(p, share, nbytes, out, work, next); }
extern "C" __global__ void tiles_work_nowait(const u8* p, unsigned share, unsigned long long nbytes, unsigned* out, int work, const u8* next) { tiles_work_body<0, false>(p, share, nbytes, out, work, next); }
extern "C" __global__ void tiles_work2(const u8* p, unsigned share, unsigned long long nbytes, unsigned* out, int work, const u8* next) { tiles_work_body<2>(p, share, nbytes, out, work, next); }
"""


def _module():
    pdl_h = (Path(__file__).resolve().parents[2] / "strata/kernels/cuda/pdl.cuh").read_text()
    return cp.RawModule(code=pdl_h + _SOURCE, options=("-std=c++17",))


def time_variants(mod, nbytes: int, share: int) -> dict[str, float]:
    n16 = nbytes // 16
    nbytes = n16 * 16
    nbuf = max(3, -(-L2_FLUSH_BYTES // nbytes))
    bufs = [cp.random.randint(0, 2**31 - 1, n16 * 4, dtype=cp.uint32) for _ in range(nbuf)]
    out = cp.zeros(1, dtype=cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    stream = cp.cuda.Stream(non_blocking=True)
    res = {}
    plain = mod.get_function("plain")
    res["plain"] = graph_seconds(lambda i: plain((sms * 8,), (256,), (bufs[i % nbuf], np.uint64(n16), out)), stream)
    for name in ("pdl_pre", "pdl_post"):
        fn = mod.get_function(name)
        res[name] = graph_seconds(
            lambda i, fn=fn: pdl.launch(fn, (sms * 8,), (256,), (bufs[i % nbuf], np.uint64(n16), out)), stream)
    tiles = mod.get_function("tiles")
    blocks = -(-nbytes // (4 * share))
    res["tiles"] = graph_seconds(
        lambda i: pdl.launch(tiles, (blocks,), (128,), (bufs[i % nbuf], np.uint32(share), np.uint64(nbytes), out),
                             shared_mem=4 * share), stream)
    # the same with shared memory padded so that only 6 blocks (24 warps) fit an SM, as many as
    # the one-column Q2_0 MMVQ keeps resident (its registers): no room for the next launch's
    # blocks until this one's leave
    res["tiles24"] = graph_seconds(
        lambda i: pdl.launch(tiles, (blocks,), (128,), (bufs[i % nbuf], np.uint32(share), np.uint64(nbytes), out),
                             shared_mem=max(4 * share, 37 * 1024)), stream)
    for work in WORKS:
        for pf in VARIANTS:
            fn = mod.get_function(f"tiles_work{pf}")
            res[f"w{work}{pf}"] = graph_seconds(
                lambda i, fn=fn, work=work: pdl.launch(
                    fn, (blocks,), (128,), (bufs[i % nbuf], np.uint32(share), np.uint64(nbytes), out, np.int32(work),
                                            bufs[(i + 1) % nbuf]), shared_mem=4 * share), stream)
    ring = mod.get_function("tiles_ring")
    ring.max_dynamic_shared_size_bytes = 48 * 1024
    for name, (piece, pieces, stages, pad, post) in RINGS.items():
        nb = -(-nbytes // (4 * piece * pieces))
        res[name] = graph_seconds(
            lambda i, piece=piece, pieces=pieces, stages=stages, nb=nb, smem=max(pad, 4 * piece * stages), post=post:
            pdl.launch(ring, (nb,), (128,), (bufs[i % nbuf], np.uint32(piece), np.int32(pieces), np.int32(stages),
                                             np.uint64(nbytes), out, np.int32(RING_WORK), np.int32(post)),
                       shared_mem=smem), stream)
    seq = mod.get_function("tiles_seq")
    seq.max_dynamic_shared_size_bytes = 48 * 1024
    for name, (pieces, inflight, pad) in SEQS.items():
        res[name] = graph_seconds(
            lambda i, pieces=pieces, inflight=inflight, smem=max(pad, 4 * share):
            pdl.launch(seq, (blocks,), (160,), (bufs[i % nbuf], np.uint32(share), np.int32(pieces), np.int32(inflight),
                                             np.uint64(nbytes), out, np.int32(RING_WORK)), shared_mem=smem), stream)
    bufs.clear()  # the graphs are done with them
    cp.get_default_memory_pool().free_all_blocks()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", default="16.5,25.2,33.0,132.1", help="comma-separated sizes, MB (1e6 bytes)")
    p.add_argument("--share", type=int, default=4608, help="bytes per warp of the tiles kernel (a multiple of 16)")
    a = p.parse_args(argv)
    mod = _module()
    copy_gbs = copy_bandwidth()
    print(f"copy (read+write) {copy_gbs:.0f} GB/s; PDL {'on' if pdl.enabled() else 'off (the pdl_* rows launch plainly)'}; "
          f"tiles: {a.share} bytes per warp")
    names = (("plain", "pdl_pre", "pdl_post", "tiles", "tiles24") + tuple(f"w{w}{v}" for w in WORKS for v in VARIANTS)
             + tuple(RINGS) + tuple(SEQS))
    print("| MB | " + " | ".join(f"{n} us (%)" for n in names) + " |")
    print("|---:|" + "---:|" * len(names))
    for mb in (float(x) for x in a.mb.split(",")):
        nbytes = int(mb * 1e6)
        res = time_variants(mod, nbytes, a.share)
        cells = [f"{res[n] * 1e6:.1f} ({100 * nbytes / res[n] / 1e9 / copy_gbs:.0f})" for n in names]
        print(f"| {mb:.1f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
