// Causal attention of a long prompt's rows over their cache, on f16 tensor cores (mma.sync
// m16n8k16, sm_80+), in the manner of FlashAttention-2. Compiled by
// strata/kernels/cuda/attention_prefill.py through NVRTC; no headers.
//
// One launch per prompt span: its m rows (tokens p0 .. p0 + m - 1 of one sequence) attend to
// keys 0 .. p0 + t of their cache (f16, or int8 rows times their scale). A thread block takes
// one KV head and FA_ROWS consecutive (token, query head) rows of its group, row r = token * G +
// head-in-group, so every K and V tile loaded serves all of the group's query heads; each warp
// takes 16 of the rows. Per 64-key tile: S = Q K^T (Q pre-scaled by log2(e) / sqrt(d), fp32
// accumulation), causal mask, online softmax in base 2, O += P V with P rounded to f16. K and
// V tiles are staged in shared memory as f16 (int8 rows converted on the way), rows padded by
// 8 halves so ldmatrix reads of 8 rows hit 8 different bank groups.
//
// The decode kernel (attention_kv in fused.cu) rounds differently (fp32 throughout, 256-key
// chunks); the backend takes this path for a request's prompt rows when the prompt is long
// (the same rule that sends its projections through the f16 GEMM path), whatever else shares
// the window, so a row's bits never depend on its neighbours.

typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

#define FA_WARPS 4
#define FA_ROWS (16 * FA_WARPS)  // (token, head) rows per block
#define FA_KEYS 64               // keys per tile
#define FA_PAD 8                 // halves of padding per staged row
#define FA_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ u32 half2_bits(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // upper half: first source
    return r;
}
__device__ __forceinline__ u16 half_bits(float x) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// D (16 x 8, fp32) += A (16 x 16, f16, row) * B (16 x 8, f16, col)
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8 x 8 f16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Stage keys [j0, j0 + FA_KEYS) of one KV head (rows of D elements) as f16; keys at or past
// `limit` are zeros (never read from the cache: it may end there).
template <int D, bool INT8>
__device__ __forceinline__ void stage_tile(u16* dst, const void* src, const float* scales, size_t row0, long long j0,
                                           long long limit) {
    constexpr int STRIDE = D + FA_PAD;
    constexpr int PIECES = D / 8;  // 8 elements (16 bytes of f16) per piece
    for (int i = threadIdx.x; i < FA_KEYS * PIECES; i += FA_WARPS * 32) {
        const int key = i / PIECES, e0 = (i % PIECES) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (j0 + key < limit) {
            const size_t row = row0 + (size_t)(j0 + key);
            if (INT8) {
                const uint2 raw = *(const uint2*)((const i8*)src + row * D + e0);
                const float s = scales[row];
                const u32 w[2] = {raw.x, raw.y};
                u32 h[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const u32 word = w[p >> 1], sh = 16 * (p & 1);
                    const float lo = (float)(i8)((word >> sh) & 0xFF) * s;
                    const float hi = (float)(i8)((word >> (sh + 8)) & 0xFF) * s;
                    h[p] = half2_bits(lo, hi);
                }
                v = make_uint4(h[0], h[1], h[2], h[3]);
            } else {
                v = *(const uint4*)((const u16*)src + row * D + e0);
            }
        }
        *(uint4*)(dst + key * STRIDE + e0) = v;
    }
}

template <int D, bool INT8>
__device__ __forceinline__ void attention_prefill_impl(const float* __restrict__ q, float* __restrict__ out,
                                                       const void* __restrict__ K, const void* __restrict__ V,
                                                       const float* __restrict__ KS, const float* __restrict__ VS,
                                                       long long cap, long long p0, int m, int n_head, int n_kv,
                                                       float qscale) {
    constexpr int STRIDE = D + FA_PAD;
    constexpr int KD = D / 16;  // k-steps over the head dimension
    constexpr int ND = D / 8;   // n-tiles of the output
    __shared__ __align__(16) u16 ks[FA_KEYS * STRIDE];
    __shared__ __align__(16) u16 vs[FA_KEYS * STRIDE];
    const int G = n_head / n_kv;
    const int kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;  // fragment row group and column pair
    const int rows = m * G;
    const int rb = blockIdx.x * FA_ROWS;              // the block's first row
    const int r_a = rb + warp * 16 + g, r_b = r_a + 8;  // this thread's two rows
    // a row past the span repeats the last one (its results are not written)
    const int ta = min(r_a, rows - 1) / G, tb = min(r_b, rows - 1) / G;
    const long long lim_a = p0 + ta, lim_b = p0 + tb;  // last key each row sees
    const size_t qa_off = ((size_t)ta * n_head + kvh * G + min(r_a, rows - 1) % G) * D;
    const size_t qb_off = ((size_t)tb * n_head + kvh * G + min(r_b, rows - 1) % G) * D;

    // Q fragments (A operand, rows g and g + 8 of the warp, 16 dims per k-step)
    u32 qf[KD][4];
#pragma unroll
    for (int k = 0; k < KD; ++k) {
        const int e = k * 16 + 2 * c;
        const float2 a0 = *(const float2*)(q + qa_off + e), a1 = *(const float2*)(q + qb_off + e);
        const float2 a2 = *(const float2*)(q + qa_off + e + 8), a3 = *(const float2*)(q + qb_off + e + 8);
        qf[k][0] = half2_bits(a0.x * qscale, a0.y * qscale);
        qf[k][1] = half2_bits(a1.x * qscale, a1.y * qscale);
        qf[k][2] = half2_bits(a2.x * qscale, a2.y * qscale);
        qf[k][3] = half2_bits(a3.x * qscale, a3.y * qscale);
    }
    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = FA_NEG_INF, m_b = FA_NEG_INF, l_a = 0.f, l_b = 0.f;

    // keys the block needs: up to its last row's token
    const long long kend = p0 + min(rb + FA_ROWS - 1, rows - 1) / G + 1;
    const size_t row0 = (size_t)kvh * (size_t)cap;
    const u32 ks_addr = (u32)__cvta_generic_to_shared(ks), vs_addr = (u32)__cvta_generic_to_shared(vs);
    // ldmatrix row addresses: lane l -> matrix l / 8, row l % 8
    const int mi = lane >> 3, mr = lane & 7;
    for (long long j0 = 0; j0 < kend; j0 += FA_KEYS) {
        __syncthreads();  // the previous tile is consumed
        stage_tile<D, INT8>(ks, K, KS, row0, j0, kend);
        stage_tile<D, INT8>(vs, V, VS, row0, j0, kend);
        __syncthreads();
        // S = Q K^T for 16 rows x 64 keys: n-tiles of 8 keys, two per ldmatrix_x4
        float s[FA_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < FA_KEYS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int k = 0; k < KD; ++k) {
#pragma unroll
            for (int n = 0; n < FA_KEYS / 8; n += 2) {
                // matrices: (keys n, dims lo), (keys n, dims hi), (keys n+1, dims lo), (keys n+1, dims hi)
                const int key = (n + (mi >> 1)) * 8 + mr, dim = k * 16 + (mi & 1) * 8;
                u32 b[4];
                ldmatrix_x4(b, ks_addr + 2u * (u32)(key * STRIDE + dim));
                mma16816(s[n], qf[k], b[0], b[1]);
                mma16816(s[n + 1], qf[k], b[2], b[3]);
            }
        }
        // causal mask and the online softmax (base 2: Q carries log2(e))
        float mx_a = FA_NEG_INF, mx_b = FA_NEG_INF;
#pragma unroll
        for (int n = 0; n < FA_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const long long key = j0 + n * 8 + 2 * c + e;
                if (key > lim_a) s[n][e] = FA_NEG_INF;
                if (key > lim_b) s[n][2 + e] = FA_NEG_INF;
                mx_a = fmaxf(mx_a, s[n][e]);
                mx_b = fmaxf(mx_b, s[n][2 + e]);
            }
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {  // the 4 threads of a row
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
        }
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);  // finite: key 0 is in every row's first tile
        const float corr_a = exp2f(m_a - mn_a), corr_b = exp2f(m_b - mn_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int n = 0; n < FA_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[n][e] = exp2f(s[n][e] - mn_a);
                s[n][2 + e] = exp2f(s[n][2 + e] - mn_b);
                sum_a += s[n][e];
                sum_b += s[n][2 + e];
            }
        }
        l_a = l_a * corr_a + sum_a;  // per thread; the row's 4 threads add up at the end
        l_b = l_b * corr_b + sum_b;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[n][0] *= corr_a;
            o[n][1] *= corr_a;
            o[n][2] *= corr_b;
            o[n][3] *= corr_b;
        }
        // O += P V: P's accumulator layout is the A fragment of 16 keys per k-step
#pragma unroll
        for (int kk = 0; kk < FA_KEYS / 16; ++kk) {
            const u32 pf[4] = {half2_bits(s[2 * kk][0], s[2 * kk][1]), half2_bits(s[2 * kk][2], s[2 * kk][3]),
                               half2_bits(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               half2_bits(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < ND; n += 2) {
                // matrices (transposed): (keys lo, dims n), (keys hi, dims n), (keys lo, dims n+1), (keys hi, dims n+1)
                const int key = kk * 16 + (mi & 1) * 8 + mr, dim = (n + (mi >> 1)) * 8;
                u32 b[4];
                ldmatrix_x4_trans(b, vs_addr + 2u * (u32)(key * STRIDE + dim));
                mma16816(o[n], pf, b[0], b[1]);
                mma16816(o[n + 1], pf, b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
    }
    const float inv_a = 1.f / l_a, inv_b = 1.f / l_b;
    const size_t row_len = (size_t)n_head * D;
    if (r_a < rows) {
        float* dst = out + (size_t)ta * row_len + (size_t)(kvh * G + r_a % G) * D + 2 * c;
#pragma unroll
        for (int n = 0; n < ND; ++n) *(float2*)(dst + n * 8) = make_float2(o[n][0] * inv_a, o[n][1] * inv_a);
    }
    if (r_b < rows) {
        float* dst = out + (size_t)tb * row_len + (size_t)(kvh * G + r_b % G) * D + 2 * c;
#pragma unroll
        for (int n = 0; n < ND; ++n) *(float2*)(dst + n * 8) = make_float2(o[n][2] * inv_b, o[n][3] * inv_b);
    }
}

#define ATTENTION_PREFILL(NAME, D, INT8)                                                                     \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                            \
        NAME(const float* __restrict__ q, float* __restrict__ out, const void* __restrict__ K,              \
             const void* __restrict__ V, const float* __restrict__ KS, const float* __restrict__ VS,        \
             long long cap, long long p0, int m, int n_head, int n_kv, float qscale) {                     \
        attention_prefill_impl<D, INT8>(q, out, K, V, KS, VS, cap, p0, m, n_head, n_kv, qscale);          \
    }
// The same for span `span` of a window table (fused.cu has its layout: win[2n + 3s] is the span's
// first position, win[2n + 3s + 2] its cache table): what differs between two windows of one
// shape (where the prompt starts, which sequence's cache) is read on the device, so a CUDA
// graph of a prompt's window replays for any start and any slot. The span's rows are q's m.
#define ATTENTION_PREFILL_WINDOW(NAME, D, INT8)                                                              \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                            \
        NAME(const float* __restrict__ q, float* __restrict__ out, const long long* __restrict__ win,       \
             int n, int span, int layer, int m, int n_head, int n_kv, float qscale) {                       \
        const long long* tab = (const long long*)win[2 * n + 3 * span + 2];                                \
        attention_prefill_impl<D, INT8>(q, out, (const void*)tab[1 + 4 * layer], (const void*)tab[2 + 4 * layer], \
                                        (const float*)tab[3 + 4 * layer], (const float*)tab[4 + 4 * layer],  \
                                        tab[0], win[2 * n + 3 * span], m, n_head, n_kv, qscale);             \
    }
ATTENTION_PREFILL(attention_prefill_f16_64, 64, false)
ATTENTION_PREFILL(attention_prefill_i8_64, 64, true)
ATTENTION_PREFILL(attention_prefill_f16_128, 128, false)
ATTENTION_PREFILL(attention_prefill_i8_128, 128, true)
ATTENTION_PREFILL_WINDOW(attention_prefill_window_f16_64, 64, false)
ATTENTION_PREFILL_WINDOW(attention_prefill_window_i8_64, 64, true)
ATTENTION_PREFILL_WINDOW(attention_prefill_window_f16_128, 128, false)
ATTENTION_PREFILL_WINDOW(attention_prefill_window_i8_128, 128, true)
