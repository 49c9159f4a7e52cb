// One 32-weight chunk of a weight row -> 32 float32 values in weight order.
//
// Compiled after mmvq_common.cuh, the generated tables and mmvq_decode.cuh (by
// strata/kernels/cuda/dequant.py through NVRTC), and on the CPU under host_emulation.h by
// tests/test_cuda_prefill.py. Quantized types reuse the MMVQ chunk decoders (TypeOf<ID>::decode),
// so the weights a prefill GEMM sees are the ones the mat-vec kernels multiply:
//     value = sc[half] * (code + IOFF)  (+ mn[half] for MIN types)
// with codes in the type's order (code_weight in mmvq_decode.cuh). The two operations are spelled __fmul_rn / __fadd_rn so no
// compiler contraction to FMA changes the rounding: the results equal strata.kernels.dequant
// bit for bit (its numpy code multiplies, then adds, in float32).

template <int ID> struct Dequant {
    typedef TypeOf<ID> T;
    static constexpr int TAB_WORDS = T::TAB_WORDS;
    __device__ static __forceinline__ const u32* table() { return T::table(); }
    // row: the first byte of a weight row; cr: chunk index along the row; dst[0..31].
    __device__ static __forceinline__ void chunk(const u8* row, int cr, const u32* tab, float* dst) {
        constexpr int CPB = T::BS / 32;  // chunks per block
        Chunk r;
        r.mn[0] = r.mn[1] = 0.0f;
        T::decode(row + (size_t)(cr / CPB) * T::TS, cr % CPB, r, tab);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int h = i >> 2;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int code = (int)(i8)((r.q[i] >> (8 * j)) & 0xFF);
                const int w = code_weight(T::ORDER, i, j);
                float v = __fmul_rn(r.sc[h], (float)(code + T::IOFF));
                if (T::MIN) v = __fadd_rn(v, r.mn[h]);
                dst[w] = v;
            }
        }
    }
};

// Plain float rows: 32 consecutive elements (rows are 2- or 4-byte aligned).
template <int ES, float (*GET)(const u8*)> struct PlainDequant {
    static constexpr int TAB_WORDS = 1;
    __device__ static __forceinline__ const u32* table() { return nullptr; }
    __device__ static __forceinline__ void chunk(const u8* row, int cr, const u32*, float* dst) {
        const u8* p = row + (size_t)cr * 32 * ES;
#pragma unroll
        for (int i = 0; i < 32; ++i) dst[i] = GET(p + ES * i);
    }
};
__device__ __forceinline__ float get_f32(const u8* p) { return __uint_as_float(ld32a(p)); }
__device__ __forceinline__ float get_f16(const u8* p) { return h2f((u16)ld16(p)); }
__device__ __forceinline__ float get_bf16(const u8* p) { return bf2f((u16)ld16(p)); }
template <> struct Dequant<0> : PlainDequant<4, get_f32> {};
template <> struct Dequant<1> : PlainDequant<2, get_f16> {};
template <> struct Dequant<30> : PlainDequant<2, get_bf16> {};
