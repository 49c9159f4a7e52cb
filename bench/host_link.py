"""How fast the GPU reaches host memory: the numbers behind the expert tier's choices (a table).

    python bench/host_link.py [--pin-gib 16] [--chunk-mib 1024] [--expert-mib 1.6] [--experts 10]

- pin: how much host memory can be page-locked in chunks of --chunk-mib (cudaHostAlloc), and how
  long each chunk takes; stops at --pin-gib or at the first refusal (Windows caps it near half of RAM).
- copy: host -> device bandwidth of one large copy and of a window's misses (--experts copies of
  one expert's bytes each), from pinned and from pageable memory.
- zero-copy: a kernel reading pinned host memory through its device-visible address (what an
  expert left in host RAM costs when the experts kernel reads it in place), against the same
  kernel reading device memory.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

READ_SOURCE = r"""
extern "C" __global__ void read_sum(const uint4* __restrict__ p, unsigned long long n, unsigned int* out) {
    unsigned int acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;  // keeps the loads; practically never taken
}
"""


def _timed(cp, fn, reps: int) -> float:
    fn()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t) / reps


def pin_probe(cp, limit_gib: float, chunk_mib: int) -> tuple[list, float, float]:
    chunks, seconds = [], []
    total = int(limit_gib * 1024) // chunk_mib
    for _ in range(total):
        t = time.perf_counter()
        try:
            mem = cp.cuda.alloc_pinned_memory(chunk_mib << 20)
        except Exception as e:  # the platform's limit
            print(f"| pin | refused after {len(chunks) * chunk_mib / 1024:.1f} GiB: {type(e).__name__} |")
            break
        seconds.append(time.perf_counter() - t)
        chunks.append(mem)
    got = len(chunks) * chunk_mib / 1024
    return chunks, got, sum(seconds)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pin-gib", type=float, default=16)
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--expert-mib", type=float, default=1.6, help="one expert's bytes (all its tensors)")
    ap.add_argument("--experts", type=int, default=10, help="misses per window layer")
    ap.add_argument("--big-mib", type=int, default=512)
    args = ap.parse_args()
    import cupy as cp

    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| measure | value |\n|---|---|")
    chunks, got, secs = pin_probe(cp, args.pin_gib, args.chunk_mib)
    print(f"| pinned (cudaHostAlloc) | {got:.1f} GiB in {secs:.2f} s ({got / max(secs, 1e-9):.1f} GiB/s) |")
    del chunks

    big = args.big_mib << 20
    dev = cp.empty(big, cp.uint8)
    pinned_mem = cp.cuda.alloc_pinned_memory(big)
    pinned = np.frombuffer(pinned_mem, np.uint8, big)
    pinned[:] = 1
    pageable = np.ones(big, np.uint8)
    for label, host in (("pinned", pinned), ("pageable", pageable)):
        s = _timed(cp, lambda: dev.set(host), 5)
        print(f"| copy {args.big_mib} MiB from {label} | {big / s / 1e9:.1f} GB/s |")
    one = int(args.expert_mib * (1 << 20)) // 16 * 16
    stream = cp.cuda.Stream(non_blocking=True)
    for label, host in (("pinned", pinned), ("pageable", pageable)):
        def misses(host=host):
            for e in range(args.experts):
                cp.cuda.runtime.memcpyAsync(dev.data.ptr + e * one, host.ctypes.data + e * one, one,
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            stream.synchronize()
        s = _timed(cp, misses, 20)
        print(f"| {args.experts} expert copies of {one / 2**20:.2f} MiB from {label} | {s * 1e3:.2f} ms "
              f"({args.experts * one / s / 1e9:.1f} GB/s) |")

    kern = cp.RawKernel(READ_SOURCE, "read_sum")
    out = cp.zeros(1, cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    n16 = big // 16
    for label, ptr in (("device memory", dev.data.ptr), ("pinned host memory (zero-copy)", pinned.ctypes.data)):
        s = _timed(cp, lambda ptr=ptr: kern((sms * 8,), (256,), (cp.uint64(ptr), cp.uint64(n16), out)), 5)
        print(f"| kernel reads {args.big_mib} MiB of {label} | {big / s / 1e9:.1f} GB/s |")
    part = args.experts * one // 16
    s = _timed(cp, lambda: kern((sms * 8,), (256,), (cp.uint64(pinned.ctypes.data), cp.uint64(part), out)), 20)
    print(f"| kernel reads {args.experts} experts in place (zero-copy) | {s * 1e3:.2f} ms "
          f"({part * 16 / s / 1e9:.1f} GB/s) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
