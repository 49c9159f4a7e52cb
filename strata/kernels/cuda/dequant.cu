// Device dequantization of GGUF weight rows (dequant.py compiles this after mmvq_common.cuh,
// the generated tables, mmvq_decode.cuh and dequant_chunk.cuh).
//
// The output of n rows of k weights is one flat run of n * k values, and chunk c (32 weights)
// of it is out[32c .. 32c+32): a thread decodes one chunk into shared memory (rows padded to
// 33 floats so both the per-thread writes and the wide reads below hit 32 distinct banks),
// then the block writes its 4096 values with coalesced 16-byte stores. Weights are read
// straight from global memory: neighbouring threads decode neighbouring chunks, so a warp's
// loads fall in a few consecutive blocks and L1 serves the rest.
//
// ids (optional, on the device): output row i is table row ids[i] (an embedding lookup);
// an id outside 0..n_table_rows-1 yields a NaN row (checking it on the host would need a sync).

#define DQ_THREADS 128
#define DQ_PAD 33

// f32 -> f16 bits, round to nearest even (subnormals kept).
__device__ __forceinline__ u32 f2h_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

template <class OutT> struct Store8;
template <> struct Store8<float> {  // 8 float32 values -> two 16-byte stores
    __device__ static __forceinline__ void put(float* dst, const float* s) {
        ((float4*)dst)[0] = make_float4(s[0], s[1], s[2], s[3]);
        ((float4*)dst)[1] = make_float4(s[4], s[5], s[6], s[7]);
    }
};
template <> struct Store8<unsigned short> {  // 8 values rounded to f16 -> one 16-byte store
    __device__ static __forceinline__ void put(unsigned short* dst, const float* s) {
        uint4 v;
        v.x = f2h_bits(s[0]) | (f2h_bits(s[1]) << 16);
        v.y = f2h_bits(s[2]) | (f2h_bits(s[3]) << 16);
        v.z = f2h_bits(s[4]) | (f2h_bits(s[5]) << 16);
        v.w = f2h_bits(s[6]) | (f2h_bits(s[7]) << 16);
        *(uint4*)dst = v;
    }
};

// w: table rows of row_bytes bytes; k weights per row (a multiple of 32); nchunks = n * k / 32;
// out: n * k values, 16-byte aligned. IdT int or long long; ids == nullptr means row i = i.
template <int ID, class OutT, class IdT>
__global__ void __launch_bounds__(DQ_THREADS) dequant_rows(const u8* __restrict__ w, long long row_bytes, int k,
                                                          long long nchunks, const IdT* __restrict__ ids,
                                                          long long n_table_rows, OutT* __restrict__ out) {
    typedef Dequant<ID> D;
    __shared__ float stage[DQ_THREADS * DQ_PAD];
    __shared__ __align__(16) u32 tab[D::TAB_WORDS];
    if (D::TAB_WORDS > 1) {  // IQ grids: random per-lane lookups are cheaper in shared memory
        for (int i = threadIdx.x; i < D::TAB_WORDS; i += DQ_THREADS) tab[i] = __ldg(D::table() + i);
        __syncthreads();
    }
    const int cpr = k / 32;
    const long long c = (long long)blockIdx.x * DQ_THREADS + threadIdx.x;
    float* dst = stage + threadIdx.x * DQ_PAD;
    if (c < nchunks) {
        const long long r = c / cpr;
        const int cr = (int)(c - r * cpr);
        const long long src = ids ? (long long)ids[r] : r;
        if (src < 0 || src >= n_table_rows) {
#pragma unroll
            for (int i = 0; i < 32; ++i) dst[i] = __int_as_float(0x7fc00000);
        } else {
            D::chunk(w + src * row_bytes, cr, tab, dst);
        }
    }
    __syncthreads();
    const long long base = (long long)blockIdx.x * DQ_THREADS * 32;
    const long long total = nchunks * 32;
#pragma unroll
    for (int p = threadIdx.x * 8; p < DQ_THREADS * 32; p += DQ_THREADS * 8) {
        if (base + p < total) Store8<OutT>::put(out + base + p, stage + (p >> 5) * DQ_PAD + (p & 31));
    }
}

// Prefill GEMMs' activations: float32 values to float16 (round to nearest, as a CuPy cast), 8 a
// thread; values [live, total) are written as zeros (the padding rows of a GEMM's last row tile).
// One launch where cupy.copyto and a fill cost ~100 us of host time per weight. live and
// total are multiples of 8; x and y 16-byte aligned.
extern "C" __global__ void __launch_bounds__(DQ_THREADS) f32_to_f16(const float* __restrict__ x, long long live,
                                                                     long long total, unsigned short* __restrict__ y) {
    const long long p = ((long long)blockIdx.x * DQ_THREADS + threadIdx.x) * 8;
    if (p >= total) return;
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (p < live) {
        const float4 a = *(const float4*)(x + p), b = *(const float4*)(x + p + 4);
        s[0] = a.x; s[1] = a.y; s[2] = a.z; s[3] = a.w; s[4] = b.x; s[5] = b.y; s[6] = b.z; s[7] = b.w;
    }
    Store8<unsigned short>::put(y + p, s);
}
