// Programmatic dependent launch (sm_90+, strata/kernels/cuda/launch.py). A kernel launched
// with it may start while the kernel before it in the stream still runs: until it calls
// wait_prior_grids() it may read only what no earlier kernel writes (weights, code tables);
// afterwards every earlier kernel has finished and its writes are visible. allow_dependents()
// lets the next kernel, if launched that way, start now (by default it would wait for this
// one's end). Both compile to nothing before sm_90, and are no-ops for ordinary launches.
// Reads of what earlier kernels wrote go through after_wait(pointer) (below).
__device__ __forceinline__ void wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// p for the loads that must follow wait_prior_grids(): the compiler takes loads of const
// __restrict__ data for invariant and may hoist them above any barrier (it moved an expert id
// load above the wait), but not above the instruction that produces their address. The
// two asm statements are volatile, so this one stays after the wait.
template <class T>
__device__ __forceinline__ T* after_wait(T* p) {
    asm volatile("" : "+l"(p));
    return p;
}
// Those loads are ordinary (weak) global loads: griddepcontrol.wait makes the earlier kernels'
// writes visible to them, and they may be cached in L1, which the activations need (read by
// every warp of an SM: from L2 only, __ldcg, the mat-vecs took 1.6-2x as long). Never
// the read-only path (__ldg, ld.global.nc): it requires data that stays unchanged while the
// kernel lives, and a kernel launched early lives while the one before it writes. Read through
// it, expert ids came back stale on the H200 (graph replays with NaN rows).
__device__ __forceinline__ int4 ld_global(const int4* p) {
    int4 v;
    asm("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ int2 ld_global(const int2* p) {
    int2 v;
    asm("ld.global.v2.s32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ int ld_global(const int* p) {
    int v;
    asm("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned long long ld_global(const unsigned long long* p) {
    unsigned long long v;
    asm("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}
// Asks L2 for [p, p + bytes) without waiting (a hint: nothing is read into registers); thread
// i of the n that share the range (a warp, a block) takes its part. For data no earlier kernel
// of the stream writes (weights, an attention's older cache rows), issued before
// wait_prior_grids(): the loads after the wait then find it in L2 instead of HBM. L2 only,
// never L1: L2 is coherent, so a line that also holds bytes an earlier kernel writes (rows not
// aligned to lines) is never read stale.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned long long bytes, unsigned i, unsigned n) {
    if (bytes == 0) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (i == 0) {  // one bulk request (16-byte aligned start, a multiple of 16 bytes)
        const unsigned long long a = (unsigned long long)p & ~15ull;
        const unsigned long long e = ((unsigned long long)p + bytes + 15ull) & ~15ull;
        for (unsigned long long o = a; o < e; o += 1ull << 30)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(o), "r"((unsigned)min(e - o, 1ull << 30)) : "memory");
    }
#else
    const unsigned long long a = (unsigned long long)p & ~127ull, e = (unsigned long long)p + bytes;
    for (unsigned long long o = a + 128ull * i; o < e; o += 128ull * n) asm volatile("prefetch.global.L2 [%0];" ::"l"(o));
#endif
}
__device__ __forceinline__ void prefetch_l2_block(const void* p, unsigned long long bytes) {
    prefetch_l2(p, bytes, threadIdx.x, blockDim.x);
}
