// Common pieces of Strata's MMVQ kernels (compiled through NVRTC by strata/kernels/cuda/mmvq_build.py).
// No system headers: NVRTC builds this without an include path, so the few types and
// conversions we need are spelled out here.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// f16 bits -> f32 (exact).
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// bf16 bits -> f32 (exact: bf16 is the top half of an f32).
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// PTX prmt in its default mode: each selector nibble picks a byte of {b, a} (bits 0-2) and,
// when its bit 3 is set, replicates that byte's sign bit instead. __byte_perm is documented
// with 3-bit selectors only, so the sign-replicating form goes through inline PTX.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// Loads from a weight tile in shared memory. Tiles keep the global alignment modulo 16, so
// a field is 4-aligned exactly when it is 4-aligned in device memory.
__device__ __forceinline__ u32 ld8(const u8* p) { return *p; }
__device__ __forceinline__ u32 ld16(const u8* p) { return *(const u16*)p; }  // 2-aligned fields only
__device__ __forceinline__ u32 ld32a(const u8* p) { return *(const u32*)p; }  // 4-aligned fields only
// A pointer into a row tile whose address modulo 4 the kernel knows without looking at the
// address: mis is any integer congruent to it. For aligned rows (stream_rows' A16 path) a block's
// offset in its 16-aligned tile is one per lane and row-invariant, so the alignment arithmetic
// of the word loads below is formed once for all of a warp's rows, and each row's loads differ
// by an immediate; from the address, every row needed its own (the compiler does not see that
// they agree). Measured: the item loop of mmvq<Q2_0, 1, aligned> 523 -> 471 instructions, 57344 x
// 8192 Q2_0 38.8-39.4 -> 36.8-37.6 us, IQ4_NL 79.8-82.2 -> 76.4-77.9. Converts to the plain
// pointer for every other use.
struct TilePtr {
    const u8* p;
    u32 mis;
    __device__ __forceinline__ TilePtr operator+(int n) const { return TilePtr{p + n, mis + (u32)n}; }
    __device__ __forceinline__ operator const u8*() const { return p; }
};
__device__ __forceinline__ u32 mis4(const u8* p) { return (u32)(size_t)p & 3u; }
__device__ __forceinline__ u32 mis4(const TilePtr& t) { return t.mis & 3u; }

template <class P>
__device__ __forceinline__ u32 ld32u(P p) {  // any alignment (reads up to 7 bytes past)
    // Step back from p itself rather than masking its integer value: the compiler then still
    // knows the pointer is into shared memory and emits LDS, not generic loads (LD.E), which
    // cost 64-bit address arithmetic and the generic path's latency.
    const u32 off = mis4(p);
    const u32* w = (const u32*)((const u8*)p - off);
    return __funnelshift_r(w[0], w[1], off * 8);
}
__device__ __forceinline__ float ldh(const u8* p) { return h2f((u16)ld16(p)); }
// N consecutive words from any alignment: one alignment computation, N + 1 aligned loads and N
// funnel shifts (N x ld32u would cost 2N loads and N address computations).
template <int N, class P>
__device__ __forceinline__ void ldwords(P p, u32 (&w)[N]) {
    const u32 off = mis4(p);
    const u32* a = (const u32*)((const u8*)p - off);
    u32 prev = a[0];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const u32 next = a[i + 1];
        w[i] = __funnelshift_r(prev, next, off * 8);
        prev = next;
    }
}
// Two runs of words whose offsets differ by a multiple of 4 (dist bytes from p to the second):
// they share one alignment computation (the compiler does not see that the two are equal).
template <int N, int M, class P>
__device__ __forceinline__ void ldwords2(P p, int dist, u32 (&w)[N], u32 (&v)[M]) {
    const u32 off = mis4(p);
    const u32* a = (const u32*)((const u8*)p - off);
    const u32* c = a + dist / 4;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __funnelshift_r(a[i], a[i + 1], off * 8);
#pragma unroll
    for (int i = 0; i < M; ++i) v[i] = __funnelshift_r(c[i], c[i + 1], off * 8);
}


// 4 bits -> bytes 0x00/0xFF (bit i of s4 -> byte i). The multiply places bit i at bit 8i+7
// (all 16 partial-product bits land on distinct positions, so no carries); prmt's sign mode
// then widens each byte's top bit. (3 ALU ops: cheaper than a shared-memory mask table,
// whose random 8-byte reads conflict on banks.)
__device__ __forceinline__ u32 sign_mask4(u32 s4) { return prmt(s4 * 0x10204080u, 0u, 0xBA98u); }

// 4 bits -> bytes 0x00/0x01 (bit i of b4 -> byte i), same carry-free multiply.
__device__ __forceinline__ u32 spread4(u32 b4) { return (b4 * 0x00204081u) & 0x01010101u; }

// Negate the bytes of g whose mask byte is 0xFF. Needs every byte of g in 1..127: then
// (g ^ 0xFF) + 1 = 256 - g stays inside its byte.
__device__ __forceinline__ u32 apply_signs(u32 g, u32 m) { return (g ^ m) + (m & 0x01010101u); }

// 8 sign bits of a 7-bit ksigns index: bit 7 makes the count of minus signs even.
__device__ __forceinline__ u32 ksigns(u32 s7) { return s7 | ((__popc(s7) & 1u) << 7); }

// One 32-weight chunk of a weight row as the dot product consumes it: int8 codes in weight
// order (q[0..3]: weights 0..15, q[4..7]: weights 16..31), a float scale per 16-weight half
// and (types with mins) a float min coefficient per half, multiplying the activation sum.
// Integer offsets (Q4_0's -8 and the like) are the type's IOFF, applied to the integer dot.
//
// neg: sign masks a RAW decode left unapplied (TYPE_HEAD_S): q byte = g ^ m, neg byte = m (0 or
// -1), so the code is q - neg (for m = -1: ~g + 1 = -g). The dot product then subtracts
// dp4a(neg, a) once per word instead of the decoder negating bytes (exact integer sums).
struct Chunk {
    int q[8];
    float sc[2];
    float mn[2];
    int neg[8];
};
