// Strata's MMVQ kernels: quantized weight rows (GGUF block layout, uploaded as is) times
// 1..8 activation columns quantized to Q8_1-style blocks (int8 codes + float32 d, s).
//
// Work split: one warp per output row. The warp streams its row through a private pair of
// shared-memory tiles with 16-byte cp.async copies (sm_80+), so global loads are wide and
// coalesced whatever the block size (17, 18, 50, 110 ... bytes); lanes then decode 32-weight
// chunks out of shared memory and take dp4a dot products with the activations (L1/L2-resident).
// The next tile's copy is in flight while the current one is decoded.

#define WARPS 4
#define RPW 4  // rows a warp works on together (activation loads shared among them)

// Pipeline geometry per type. A tile is one "round" of a row: the blocks holding 32 chunks of
// 32 weights, one per lane. An item is the tiles of RPW rows at the same position; STAGES
// items live in shared memory per warp, STAGES - 1 of them in flight, so each warp keeps
// about IN_FLIGHT bytes of weights on their way from HBM (Little's law: ~64 KB per SM).
#ifndef IN_FLIGHT  // (bench/bench_mmvq.py tries others through STRATA_MMVQ_IN_FLIGHT)
#define IN_FLIGHT 3072
#endif
#ifndef TILE_MAX  // bytes of one row's tile: rounds are doubled (up to CPL_MAX) while they fit.
#define TILE_MAX 1408  //: Q4_1's 1280-byte doubled round measured 5% faster than single;
#endif                 // 4 chunks per lane (CPL_MAX 4) measured slower on Q2_0 / Q2_K
#ifndef SIGN_RAW  // up to this many columns the sign types decode RAW (stream_rows)
#define SIGN_RAW 1
#endif
#ifndef PLANES_RAW  // and Q2_0 (RAW_PLANES: two shifts per column replace six per row)
#define PLANES_RAW 1
#endif
#ifndef CPL_MAX
#define CPL_MAX 2
#endif
// R: rows a warp works on together. LEAN: the lean instances' geometry (one chunk per lane per
// row tile and LEAN_STAGES stages: small stages, more blocks per SM; mmvq below).
#ifndef LEAN_STAGES
#define LEAN_STAGES 2
#endif
template <class T, int R = RPW, bool LEAN = false> struct Geometry {
    static constexpr int CMAX = LEAN ? 1 : CPL_MAX;  // the most chunks per lane per row tile
    static constexpr int CPB = T::BS / 32;  // chunks per block
    static constexpr int ROUND = (32 / CPB) * T::TS;  // bytes of 32 chunks
    // chunks per lane per row per item: 2 or 4 where a round is small, to spread the per-item
    // overhead (copies, addressing, loop) over more work
    static constexpr int CPL = CMAX >= 4 && 4 * ROUND <= TILE_MAX ? 4 : CMAX >= 2 && 2 * ROUND <= TILE_MAX ? 2 : 1;
    static constexpr int TB = 32 * CPL / CPB;                      // blocks per tile
    static constexpr int TBUF = (TB * T::TS + 16 + 15) / 16 * 16;  // + alignment slack
    static constexpr int ITEM = R * TB * T::TS;
    static constexpr int S0 = 1 + (IN_FLIGHT + ITEM - 1) / ITEM;
    static constexpr int STAGES = LEAN ? LEAN_STAGES : S0 < 2 ? 2 : S0 > 8 ? 8 : S0;
    static constexpr int WARP_SMEM = STAGES * R * TBUF;
    static constexpr int MAXP = (TB * T::TS + 15) / 16 + 1;  // 16-byte pieces per row tile
    static_assert(WARPS * WARP_SMEM <= 46 * 1024, "MMVQ tiles past the 48 KB of static shared memory");
};

// s: a shared-memory address (the caller converts its buffer once: a conversion per copy costs
// three instructions).
__device__ __forceinline__ void cp_async16(u32 s, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 4x4 byte transpose of 16 activation bytes, for types whose codes come out in bit-plane
// order (code int s holds weights s, 4+s, 8+s, 12+s): permuting the activations once per
// column serves all RPW rows, where permuting codes would cost per row.
__device__ __forceinline__ int4 transpose4x4(const int4 v) {
    const u32 t0 = __byte_perm(v.x, v.y, 0x5140), t1 = __byte_perm(v.z, v.w, 0x5140);
    const u32 t2 = __byte_perm(v.x, v.y, 0x7362), t3 = __byte_perm(v.z, v.w, 0x7362);
    return make_int4(__byte_perm(t0, t1, 0x5410), __byte_perm(t0, t1, 0x7632),
                     __byte_perm(t2, t3, 0x5410), __byte_perm(t2, t3, 0x7632));
}

// Activation metadata per 32-block (8 bytes): d, and the two 16-value integer sums of q
// (low half in bits 0..15, high half in bits 16..31, each as int16). s = d * sum(q) is kept
// in a separate array for callers; the kernels rebuild offsets/mins from the exact sums.
struct QMeta {
    float d;
    int sums;
};
// One block's metadata, loaded as the activations are (ld_global, pdl.cuh says why).
__device__ __forceinline__ QMeta ld_meta(const QMeta* p) {
    const int2 v = ld_global((const int2*)p);
    QMeta m;
    m.d = __int_as_float(v.x);
    m.sums = v.y;
    return m;
}

// The activations of a chunk in the order of the type's codes (code_weight): a = weights
// 0..15, c = 16..31 on entry. Done once per column and chunk, for all RPW rows.
template <int ORDER>
__device__ __forceinline__ void activation_order(int4& a, int4& c) {
    if (ORDER == PLANE_ORDER) {
        a = transpose4x4(a);
        c = transpose4x4(c);
    } else if (ORDER == PAIR_ORDER) {  // (w0 w16 w1 w17) (w2 w18 w3 w19) ...
        const int4 x = a, y = c;
        a = make_int4(__byte_perm(x.x, y.x, 0x5140), __byte_perm(x.x, y.x, 0x7362), __byte_perm(x.y, y.y, 0x5140),
                      __byte_perm(x.y, y.y, 0x7362));
        c = make_int4(__byte_perm(x.z, y.z, 0x5140), __byte_perm(x.z, y.z, 0x7362), __byte_perm(x.w, y.w, 0x5140),
                      __byte_perm(x.w, y.w, 0x7362));
    }
}

// dp4a of unsigned weight bytes with signed activation bytes (RAW_NIBBLE codes reach 240).
__device__ __forceinline__ int dp4a_us(int a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The integer dot product of code words q[K0..K0+4) with activation words a, for a chunk in
// the raw form RAWF (RAW_NONE: plain; mmvq_decode.cuh): the exact sum of code * activation
// (less that of the unapplied sign masks for RAW_SIGNS; the scale holds RAW_NIBBLE's 1 / 16).
template <int RAWF, int K0>
__device__ __forceinline__ int dot4(const Chunk& r, const int4& a, int i) {
    if (RAWF == RAW_NIBBLE) {
        i = dp4a_us(r.q[K0], a.x, i);
        i = dp4a_us(r.q[K0 + 1], a.y, i);
        i = dp4a_us(r.q[K0 + 2], a.z, i);
        return dp4a_us(r.q[K0 + 3], a.w, i);
    }
    i = __dp4a(r.q[K0], a.x, i);
    i = __dp4a(r.q[K0 + 1], a.y, i);
    i = __dp4a(r.q[K0 + 2], a.z, i);
    i = __dp4a(r.q[K0 + 3], a.w, i);
    if (RAWF == RAW_SIGNS) {
        int n = __dp4a(r.neg[K0], a.x, 0);
        n = __dp4a(r.neg[K0 + 1], a.y, n);
        n = __dp4a(r.neg[K0 + 2], a.z, n);
        n = __dp4a(r.neg[K0 + 3], a.w, n);
        i -= n;
    }
    return i;
}

// RAW_PLANES (mmvq_decode.cuh): code word 4h + p holds plane p of activation word p of a (h 0)
// or c (h 1) at 4^p times its codes; the running sum is shifted by 2 between planes, so it ends
// at 64 times the dot product. It starts at `init`, which the three shifts also scale by 64.
__device__ __forceinline__ int planes_dot(const Chunk& r, const int4& a, const int4& c, int init) {
    int t = dp4a_us(r.q[4], c.x, dp4a_us(r.q[0], a.x, init));
    t = dp4a_us(r.q[5], c.y, dp4a_us(r.q[1], a.y, t * 4));
    t = dp4a_us(r.q[6], c.z, dp4a_us(r.q[2], a.z, t * 4));
    return dp4a_us(r.q[7], c.w, dp4a_us(r.q[3], a.w, t * 4));
}

// acc + d * (a chunk's dot product with one column), from the chunk's integer dot products
// (i: codes 0..15 with activation words a, then codes 16..31 with c; a one-scale type's i0 is
// the whole sum and i1 is 0), its scales and mins (sc, mn: Chunk's) and the column's block m.
// Every rounding step is spelled out (no contraction left to the compiler): the instances for
// 1..8 columns would otherwise fuse multiply-adds differently (seen on Q2_K: 8 columns vs 1),
// and a row's bits must not depend on how many columns share its launch. mmq_grouped (prompt
// rows on tensor cores) scales its chunks through the same function.
template <class T>
__device__ __forceinline__ float chunk_float(float acc, int i0, int i1, const float (&sc)[2], const float (&mn)[2],
                                             const QMeta& m) {
    const int s0 = (int)(short)(m.sums & 0xFFFF), s1 = m.sums >> 16;
    if constexpr (OneScale<T::ID>::YES) {
        // one scale for the 32 weights: one integer sum (codes in any order the activations
        // share), converted and scaled once
        int i = i0 + i1;
        const int s = s0 + s1;
        if (T::IOFF != 0) i += T::IOFF * s;
        float f = __fmul_rn(sc[0], (float)i);
        if (T::MIN) f = __fmaf_rn(mn[0], (float)s, f);
        return __fmaf_rn(m.d, f, acc);
    } else {
        if (T::IOFF != 0) {
            i0 += T::IOFF * s0;
            i1 += T::IOFF * s1;
        }
        float f = __fmaf_rn(sc[1], (float)i1, __fmul_rn(sc[0], (float)i0));
        if (T::MIN) f = __fmaf_rn(mn[1], (float)s1, __fmaf_rn(mn[0], (float)s0, f));
        return __fmaf_rn(m.d, f, acc);
    }
}

// acc + d * (the chunk's dot product with one column), by dp4a (the MMVQ kernels).
template <class T, int RAWF = RAW_NONE>
__device__ __forceinline__ float chunk_acc(float acc, const Chunk& r, const int4& a, const int4& c, const QMeta& m) {
    if constexpr (RAWF == RAW_PLANES) {
        static_assert(OneScale<T::ID>::YES && !T::MIN, "RAW_PLANES: one scale, no min");
        const int s0 = (int)(short)(m.sums & 0xFFFF), s1 = m.sums >> 16;
        // the offset enters as the chain's start (times 64 with the rest): 64 (dot + IOFF s)
        const int i = planes_dot(r, a, c, T::IOFF * (s0 + s1));
        return __fmaf_rn(m.d, __fmul_rn(r.sc[0], (float)i), acc);
    } else if constexpr (OneScale<T::ID>::YES) {
        return chunk_float<T>(acc, dot4<RAWF, 4>(r, c, dot4<RAWF, 0>(r, a, 0)), 0, r.sc, r.mn, m);
    } else {
        return chunk_float<T>(acc, dot4<RAWF, 0>(r, a, 0), dot4<RAWF, 4>(r, c, 0), r.sc, r.mn, m);
    }
}

// The warp sums of P values per lane (P a power of two, <= 32; v[0..P)), P - 1 + 5 - log2(P) shuffles
// instead of 5 P: at each step a lane keeps half of its values and receives its partner's
// partial sums of them, so the values spread over the lanes while they are summed. Lane l ends
// with the sum of value l >> (5 - log2 P). Each sum is formed over the same tree of lanes as
// warp_sum's butterfly (xor 16, 8, 4, 2, 1; float addition commutes), so the bits are the same.
template <int N, int O>  // one step: N values per lane, partner lane ^ O
__device__ __forceinline__ void transposed_step(float (&v)[32], int lane) {
    if constexpr (N > 1) {
        const bool up = (lane & O) != 0;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const float send = up ? v[i] : v[i + N / 2];
            const float keep = up ? v[i + N / 2] : v[i];
            v[i] = keep + __shfl_xor_sync(FULL_MASK, send, O);
        }
    } else {
        v[0] += __shfl_xor_sync(FULL_MASK, v[0], O);
    }
    if constexpr (O > 1) transposed_step<(N > 1 ? N / 2 : 1), O / 2>(v, lane);
}
template <int P>
__device__ __forceinline__ float transposed_sum(float (&v)[32]) {
    transposed_step<P, 16>(v, threadIdx.x & 31);
    return v[0];
}

template <int NC>
__device__ __forceinline__ void warp_sum(float (&acc)[NC]) {
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(FULL_MASK, acc[j], o);
}

// LUT16<ID>::YES: the types decoded through lut16x8, generated by mmvq_build.py from LOOKUP_4BIT.

// Codebook of the type (IQ grids) copied into shared memory once per thread block: random
// per-lane lookups are far cheaper there than through L1. The IQ3 codebooks (4-byte words, 8
// random lookups per 32 weights) are kept in Banks<T, NC>::N = 8 interleaved copies, word i of copy
// c at i * 8 + c, and lane l reads copy l % 8: its lookups then fall in banks 8 (i % 4) + l % 8,
// so only the 4 lanes of a copy can collide (2-3 wavefronts per lookup instead of ~3.5 for 32
// lanes over one copy; ncu: 58% of IQ3_S's shared wavefronts were such conflicts).
// Up to 4 columns (decode windows,: +5%); the wider kernels, the grouped MoE one among
// them, sit at their 128-register cap and keep one copy (not measured with more).
// WIDE (mmvq_wide below): a copy per lane, so no lookup conflicts at all.
template <class T, int NC, bool WIDE = false> struct Banks {
    static constexpr int N = WIDE ? 32 : (T::ID == 18 || T::ID == 21) && NC <= 4 ? 8 : 1;  // IQ3_XXS, IQ3_S
    static constexpr int WORDS = T::TAB_WORDS * N;
};
template <class T, int NC, bool WIDE = false>
__device__ __forceinline__ void load_table(u32* tab) {
    if (T::TAB_WORDS > 1) {
        constexpr int N = Banks<T, NC, WIDE>::N;
        for (int i = threadIdx.x; i < T::TAB_WORDS; i += blockDim.x) {
            const u32 w = __ldg(T::table() + i);
            if constexpr (N % 4 == 0) {  // 16-byte stores
#pragma unroll
                for (int c = 0; c < N; c += 4) *(uint4*)(tab + i * N + c) = make_uint4(w, w, w, w);
            } else {
#pragma unroll
                for (int c = 0; c < N; ++c) tab[i * N + c] = w;
            }
        }
    }
    __syncthreads();
}

// One warp streams rows [r0, r1) of one matrix, R rows at a time (RPW; 2 or 1 for a matrix of
// few long rows, so that more warps share it: mmvq_policy.py, group_rows): items are (row group,
// tile) pairs in order; the copies of item i+1 are in flight while item i is decoded, across
// row groups too. Each lane decodes the same chunk of the group's rows, so one activation
// load serves R rows. A row's sum is the same whatever R (each row has its own accumulators
// and the same reduction tree). out_col_stride: distance between columns in out; only the first
// `written` columns are stored (the rest are padding a caller may read past its columns).
//
// A16: every row starts on a 16-byte boundary (row_bytes % 16 == 0, w 16-aligned): when a tile
// is a multiple of 16 bytes, the copies need no alignment arithmetic and each row's tile starts
// at a known offset of its stage (5-10% fewer instructions on Q2_0, Q4_K, IQ4_NL).
// Lane l takes chunks l, l + 32, l + 64 ... of every row, in order, whatever the tile
// geometry: a row's sum (and its bits) depends on the type alone. Addresses are kept
// incrementally (row pointers set once per row group, advanced a tile at a time; stage
// indices counted, not divided): S6's per-item recomputation cost ~12 instructions per chunk
// and row on Q2_0 (SASS).
template <class T, int NC, bool A16 = false, int R = RPW, bool WIDE = false, bool LEAN = false>
__device__ __forceinline__ void stream_rows(const u8* __restrict__ w, int r0, int r1, int row_bytes, int k,
                                            const i8* __restrict__ q8, const QMeta* __restrict__ meta,
                                            float* __restrict__ out, size_t out_col_stride, u8* sbuf,
                                            const u32* tab, int written = NC) {
    typedef Geometry<T, R, LEAN> G;
    constexpr int CPB = G::CPB, TB = G::TB, S = G::STAGES;
    constexpr int TILE = TB * T::TS;  // bytes of a full tile of one row
    constexpr int NJ = (G::MAXP + 31) / 32;
    // aligned rows keep their tiles aligned only when a tile is a multiple of 16 bytes (not
    // Q6_K's 840): such a type takes the general path in its A16 instance too
    constexpr bool AL = A16 && TILE % 16 == 0;
    const int lane = threadIdx.x & 31;
    const int kb = k / 32;
    const int nblk = k / T::BS;
    const int ntiles = (nblk + TB - 1) / TB;
    const int last_bytes = (nblk - (ntiles - 1) * TB) * T::TS;  // of the last tile of a row
    const int groups = (r1 - r0 + R - 1) / R;
    const int items = groups * ntiles;
    if (items <= 0) return;
    // Rows past r1 in the last group re-read row r1 - 1 (never the case when rows_per_warp is
    // a multiple of R and rows a multiple of it); their results are not written. Offsets
    // from w are 32-bit (the host keeps a matrix under 4 GiB) and rebuilt per row from the
    // group's first row: per-row pointer state cost 12 more registers (fewer resident warps).
    auto group_rows = [&](int g) { return min(R, r1 - r0 - g * R); };  // rows actually there
    auto row_off = [&](u32 first, int valid, int rr) { return first + (u32)(min(rr, valid - 1) * row_bytes); };
    const u32 lane16 = 16u * (u32)lane;
    const u32 sb = (u32)__cvta_generic_to_shared(sbuf);
    // this lane's copy of the codebook (Banks); the offset is hidden from the compiler, which
    // otherwise folds it into every lookup's index (2 more instructions per lookup)
    constexpr int NB = Banks<T, NC, WIDE>::N;
    u32 bank = (u32)lane % NB;
    if (NB > 1) asm volatile("mov.b32 %0, %0;" : "+r"(bank));
    const u32* btab = tab + bank;
    // issuing side: the next item's group and tile, its first row's tile offset, its stage
    int ig = 0, itile = 0, istage = 0, ivalid = group_rows(0);
    u32 ioff = (u32)r0 * (u32)row_bytes;
    auto issue = [&](int i) {
        if (i < items) {
            const u32 nbytes = itile + 1 == ntiles ? last_bytes : TILE;
            const u32 buf = sb + (u32)(istage * R * G::TBUF) + lane16;
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
                // whole aligned 16-byte pieces never cross a page: reading the few bytes
                // outside the row cannot fault
                const size_t g0 = (size_t)w + row_off(ioff, ivalid, rr);
                const u32 mis = AL ? 0u : (u32)g0 & 15u;
                const size_t a0 = g0 - mis + lane16;
                const u32 n16 = (mis + nbytes + 15u) >> 4;
#pragma unroll
                for (int j = 0; j < NJ; ++j)
                    if ((u32)(lane + 32 * j) < n16) cp_async16(buf + (u32)(rr * G::TBUF + 512 * j), (const void*)(a0 + 512 * j));
            }
            ioff += TILE;
            if (++itile == ntiles) {
                itile = 0;
                ++ig;
                ioff = (u32)(r0 + ig * R) * (u32)row_bytes;
                ivalid = group_rows(ig);
            }
            if (++istage == S) istage = 0;
        }
        cp_async_commit();  // empty groups keep the count uniform
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i);
    // launched early (pdl.cuh), the weights' first tiles are on their way while the kernel
    // before this one finishes; the activations are its output
    wait_prior_grids();
    q8 = after_wait(q8);
    meta = after_wait(meta);
    float acc[R][NC];
#pragma unroll
    for (int rr = 0; rr < R; ++rr)
#pragma unroll
        for (int j = 0; j < NC; ++j) acc[rr][j] = 0.0f;
    // consuming side: the current tile's offset (its first row), for where each row's bytes
    // sit in the stage (their address modulo 16)
    const u32 wlo = (u32)(size_t)w;
    u32 coff = (u32)r0 * (u32)row_bytes;
    int cvalid = group_rows(0);
    // Few columns: the item's activation blocks are loaded before the wait for its tiles, so
    // their latency (L1/L2) hides behind it; loaded after the decode they were the largest stall
    // (ncu,: 38% of a warp's cycles waiting on L1TEX at 1 column).: Q4_1 +5%, Q4_K
    // +2%, Q6_K / Q8_0 +3-4% at 2 columns; the 4-bit lookup types lost 3% (their lookups hold
    // more registers), so they keep loading after the decode. More columns would not fit.
    constexpr bool PRE = NC <= 2 && !LUT16<T::ID>::YES;
    // The raw chunk form (mmvq_decode.cuh) where it pays: RAW_NIBBLE always (a cheaper decode,
    // the same dot product); RAW_SIGNS at one column (8 dp4a per chunk replace 16 instructions
    // of the decode; from 2 columns on, the dp4a would repeat per column).
    constexpr bool RAW = T::RAWF == RAW_NIBBLE || (T::RAWF == RAW_PLANES && NC <= PLANES_RAW) ||
                        (T::RAWF == RAW_SIGNS && NC <= SIGN_RAW);
    constexpr int RAWF = RAW ? T::RAWF : RAW_NONE;
    constexpr int PU = PRE ? G::CPL : 1, PJ = PRE ? NC : 1;
    int g = 0, t = 0, cstage = 0;  // current item's group, tile and stage
    for (int it = 0; it < items; ++it) {
        const int b0 = t * TB;
        const int nb = min(nblk - b0, TB);
        int4 pa[PU][PJ], pb[PU][PJ];
        QMeta pm[PU][PJ];
        if constexpr (PRE) {
#pragma unroll
            for (int u = 0; u < PU; ++u) {
                const int c = lane + 32 * u;
                const u32 gc = (u32)(b0 * CPB + min(c, nb * CPB - 1));  // lanes past the tile load a valid block
#pragma unroll
                for (int j = 0; j < PJ; ++j) {
                    const int4* qp = (const int4*)(q8 + (size_t)j * k) + 2 * gc;
                    pa[u][j] = ld_global(qp);
                    pb[u][j] = ld_global(qp + 1);
                    pm[u][j] = ld_meta(meta + (size_t)j * kb + gc);
                }
            }
        }
        issue(it + S - 1);
        cp_async_wait<S - 1>();  // item it's copies have landed
        __syncwarp();
        const u8* base[R];
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
            base[rr] = sbuf + (cstage * R + rr) * G::TBUF + (AL ? 0u : ((wlo + row_off(coff, cvalid, rr)) & 15u));
#pragma unroll
        for (int u = 0; u < G::CPL; ++u) {
          const int c = lane + 32 * u;  // CPL chunks per lane per row: a tile is 32 * CPL chunks
          if (c < nb * CPB) {
            Chunk ch[R];
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
                const u8* b = base[rr] + (c / CPB) * T::TS;
                if constexpr (AL)  // the block's offset in a 16-aligned tile: the same for every row
                    T::template decode<NB, RAW>(TilePtr{b, (u32)((c / CPB) * T::TS)}, c % CPB, ch[rr], btab);
                else
                    T::template decode<NB, RAW>(b, c % CPB, ch[rr], btab);
            }
            const u32 gc = (u32)(b0 * CPB + c);  // chunk index along the row = activation block
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                int4 a, b;
                QMeta m;
                if constexpr (PRE) {
                    a = pa[u][j];
                    b = pb[u][j];
                    m = pm[u][j];
                } else {
                    const int4* qp = (const int4*)(q8 + (size_t)j * k) + 2 * gc;
                    a = ld_global(qp);
                    b = ld_global(qp + 1);
                    m = ld_meta(meta + (size_t)j * kb + gc);
                }
                activation_order<T::ORDER>(a, b);
#pragma unroll
                for (int rr = 0; rr < R; ++rr) acc[rr][j] = chunk_acc<T, RAWF>(acc[rr][j], ch[rr], a, b, m);
            }
          }
        }
        __syncwarp();  // this stage is reused by the issue at the top of the next iteration
        if (++cstage == S) cstage = 0;
        coff += TILE;
        if (++t == ntiles) {  // row group done: every (row, column) sum over the 32 lanes
            constexpr int V = R * NC, P = V <= 4 ? 4 : V <= 8 ? 8 : V <= 16 ? 16 : 32;
            static_assert(V <= 32, "more sums per warp than lanes");
            float v[32];  // the first P used
#pragma unroll
            for (int i = 0; i < P; ++i) v[i] = i < V ? acc[i / NC][i % NC] : 0.0f;
            const float sum = transposed_sum<P>(v);
            constexpr int SHIFT = P == 4 ? 3 : P == 8 ? 2 : P == 16 ? 1 : 0;  // 5 - log2(P)
            const int i = lane >> SHIFT, rr = i / NC, j = i % NC;             // the sum this lane holds
            const int row = r0 + g * R + rr;
            if ((lane & ((1 << SHIFT) - 1)) == 0 && i < V && row < r1 && j < written)
                out[(size_t)j * out_col_stride + row] = sum;
#pragma unroll
            for (int rr2 = 0; rr2 < R; ++rr2)
#pragma unroll
                for (int j2 = 0; j2 < NC; ++j2) acc[rr2][j2] = 0.0f;
            t = 0;
            ++g;
            coff = (u32)(r0 + g * R) * (u32)row_bytes;
            cvalid = group_rows(g);
        }
    }
}

// Rows [x, y) of a matrix that this thread's warp of block bx (bw warps) takes, rows_per_warp per warp.
__device__ __forceinline__ int2 warp_rows(int bx, int rows_per_warp, int rows, int bw = WARPS) {
    const int r0 = (bx * bw + (int)(threadIdx.x >> 5)) * rows_per_warp;
    return make_int2(r0, min(rows, r0 + rows_per_warp));
}

// out (NC, rows) = W (rows, k) . Q8(x) (NC, k). Each warp takes rows_per_warp consecutive rows
// (the host sizes the grid to what stays resident, so all warps finish together). blockIdx.y
// picks a group of NC columns: a wide window is one launch of many groups (each column's
// arithmetic is the same whatever the grid, so results do not depend on the window's width).
// Many-column instances are held to 128 registers (WIDE_MIN_BLOCKS blocks per SM): left alone,
// the compiler took 168 on several types once their decode got cheaper, and the lost occupancy
// cost 5-10% at 4 and 8 columns. The IQ grid types at 5-8 columns keep their
// registers: held to 128 they spill (IQ3_S 172 bytes at 8) and measured 1-3% slower.
#ifndef WIDE_MIN_BLOCKS
#define WIDE_MIN_BLOCKS 4
#endif
#ifndef NARROW_MIN_BLOCKS
#define NARROW_MIN_BLOCKS 1
#endif
template <int ID, int NC> struct MinBlocks {
    static constexpr int N = NC >= 4 && !(NC >= 5 && TypeOf<ID>::TAB_WORDS > 1) ? WIDE_MIN_BLOCKS
                             : NC == 1 ? NARROW_MIN_BLOCKS : 1;
};
// LEAN (one column; mmvq_policy.py, takes_lean): one chunk per lane per row tile, LEAN_STAGES stages
// (Geometry) and the registers held for LEAN_MIN_BLOCKS blocks per SM. Q4_K then keeps 7 blocks
// (28 warps) resident per SM instead of 5 (its registers and 38 KB of tiles per block), and 14336
// rows in groups of 4 (3584 warps) run in one wave instead of 1.36: 11.0 -> 10.5 us, IQ4_NL 14.6
// -> 13.6. With 2 stages instead of the 3 that IN_FLIGHT gives (19 KB of tiles a block,
// one item in flight before the PDL wait): 10.6 -> 9.8 us and 13.7 -> 12.2, and
// IQ3_S fits one wave too (31 KB, 64 registers). On more rows the default's larger tiles win
// (57344 x 8192: Q4_K 64.3 -> 65.9).
#ifndef LEAN_MIN_BLOCKS
#define LEAN_MIN_BLOCKS 7
#endif
template <int ID, int NC, bool A16 = false, int R = RPW, bool LEAN = false>
__global__ void __launch_bounds__(WARPS * 32, LEAN ? LEAN_MIN_BLOCKS : MinBlocks<ID, NC>::N) mmvq(
    const u8* __restrict__ w, int rows, int row_bytes, int k, int rows_per_warp, const i8* __restrict__ q8,
    const QMeta* __restrict__ meta, float* __restrict__ out) {
    typedef TypeOf<ID> T;
    __shared__ __align__(16) u8 smem[WARPS][Geometry<T, R, LEAN>::WARP_SMEM];
    __shared__ __align__(16) u32 tab[Banks<T, NC>::WORDS];
    allow_dependents();
    load_table<T, NC>(tab);
    const int2 r = warp_rows(blockIdx.x, rows_per_warp, rows);
    const size_t g = blockIdx.y;
    stream_rows<T, NC, A16, R, false, LEAN>(w, r.x, r.y, row_bytes, k, q8 + g * NC * k, meta + g * NC * (k / 32), out + g * NC * rows, rows,
                       smem[threadIdx.x >> 5], tab);
}

// One column of an IQ3 type (IQ3_XXS, IQ3_S) with its codebook in 32 copies, one per lane
// (Banks<T, 1, true>): every lookup a single shared-memory wavefront. With 8 copies a lookup
// takes 2-3 (the 4 lanes of a copy collide), and the shared pipe, not the instruction count,
// bound these types (14 fewer instructions per chunk and row gained 1%). The copies
// take 64 KB (IQ3_S), so the kernel runs up to WideWarps warps per block (blockDim: mmvq_policy.py
// picks how many) on WIDE_SMEM_MAX bytes of dynamic shared memory (one block per SM, as many
// warps as 4 blocks of mmvq's 46 KB had) and is used only where a block may have that much
// (mmvq_policy.py, wide_ok: sm_90's 227 KB; not the 99 KB of an sm_89 card).
// WideWarps<ID>::N, the most warps per block, and WIDE_SMEM_MAX, the dynamic shared memory, are
// generated by mmvq_build.py from WIDE_WARPS and WIDE_SMEM (the 1 KB of static shared memory the module
// reports stays under sm_90's 227 KB).
template <int ID, bool A16, int R>
__global__ void __launch_bounds__(WideWarps<ID>::N * 32, 1) mmvq_wide(const u8* __restrict__ w, int rows, int row_bytes, int k,
                                                            int rows_per_warp, const i8* __restrict__ q8,
                                                            const QMeta* __restrict__ meta, float* __restrict__ out) {
    typedef TypeOf<ID> T;
    constexpr int TAB_BYTES = Banks<T, 1, true>::WORDS * 4, WS = Geometry<T, R>::WARP_SMEM;
    static_assert(T::TAB_WORDS > 1 && TAB_BYTES + WideWarps<ID>::N * WS <= WIDE_SMEM_MAX, "mmvq_wide: shared memory");
    extern __shared__ __align__(16) u8 dyn[];
    allow_dependents();
    load_table<T, 1, true>((u32*)dyn);
    const int2 r = warp_rows(blockIdx.x, rows_per_warp, rows, blockDim.x >> 5);
    stream_rows<T, 1, A16, R, true>(w, r.x, r.y, row_bytes, k, q8, meta, out, rows,
                                    dyn + TAB_BYTES + (threadIdx.x >> 5) * WS, (const u32*)dyn);
}

// Expert e's matrix: the address the experts' table holds for it (one per expert, made by the
// backend's expert store), so the experts of a tensor need not share one allocation and a
// graph captures the table, not the matrices. Read after the wait like the ids: a store may
// rewrite its table between windows.
__device__ __forceinline__ const u8* expert_matrix(const u64* experts, int e) {
    return (const u8*)ld_global(after_wait(experts) + e);
}

// Experts: out (ncols, n_used, rows); pair p = col * n_used + slot (blockIdx.y) uses expert
// ids[p]'s matrix and activation column col; a warp of block `bx` takes its rows_per_warp
// rows. An id out of range writes NaN rows (the ids stay on the device, so the host cannot
// check them without a sync).
template <class T, bool A16>
__device__ __forceinline__ void expert_rows(const u64* __restrict__ experts, int n_expert,
                                            const int* __restrict__ ids, int n_used, int rows, int row_bytes,
                                            int k, int rows_per_warp, int bx, const i8* __restrict__ q8,
                                            const QMeta* __restrict__ meta, float* __restrict__ out, u8* sbuf,
                                            const u32* tab) {
    const int2 r = warp_rows(bx, rows_per_warp, rows);
    const int r0 = r.x, r1 = r.y;
    const int p = blockIdx.y;
    wait_prior_grids();  // the ids are the routing kernel's output (pdl.cuh)
    const int e = ld_global(after_wait(ids) + p);
    const int col = p / n_used;
    float* o = out + (size_t)p * rows;
    if (e < 0 || e >= n_expert) {
        if ((threadIdx.x & 31) == 0)
            for (int r = r0; r < r1; ++r) o[r] = __int_as_float(0x7fc00000);
        return;
    }
    stream_rows<T, 1, A16>(expert_matrix(experts, e), r0, r1, row_bytes, k, q8 + (size_t)col * k,
                      meta + (size_t)col * (k / 32), o, 0, sbuf, tab);
}

template <int ID, bool A16 = false>
__global__ void __launch_bounds__(WARPS * 32) mmvq_ids(const u64* __restrict__ experts,
                                                       int n_expert, const int* __restrict__ ids, int n_used,
                                                       int rows, int row_bytes, int k,
                                                       int rows_per_warp, const i8* __restrict__ q8,
                                                       const QMeta* __restrict__ meta, float* __restrict__ out) {
    typedef TypeOf<ID> T;
    __shared__ __align__(16) u8 smem[WARPS][Geometry<T>::WARP_SMEM];
    __shared__ __align__(16) u32 tab[Banks<T, 1>::WORDS];
    allow_dependents();
    load_table<T, 1>(tab);
    expert_rows<T, A16>(experts, n_expert, ids, n_used, rows, row_bytes, k, rows_per_warp, blockIdx.x, q8, meta,
                   out, smem[threadIdx.x >> 5], tab);
}

// Two expert matrices over the same activations (an MoE's gate and up, which may differ in
// type) in one launch: blocks [0, nb1) along x take the first, the rest the second. Decode is
// latency-bound, so one launch instead of two saves a kernel's start and tail per layer.
template <int ID1, int ID2, bool A16 = false>
__global__ void __launch_bounds__(WARPS * 32) mmvq_ids_pair(
    const u64* __restrict__ e1, int rows1, int row_bytes1, int rpw1, int nb1, float* __restrict__ out1,
    const u64* __restrict__ e2, int rows2, int row_bytes2, int rpw2, float* __restrict__ out2,
    int n_expert, const int* __restrict__ ids, int n_used, int k, const i8* __restrict__ q8,
    const QMeta* __restrict__ meta) {
    typedef TypeOf<ID1> T1;
    typedef TypeOf<ID2> T2;
    constexpr int S1 = Geometry<T1>::WARP_SMEM, S2 = Geometry<T2>::WARP_SMEM;
    constexpr int TW = Banks<T1, 1>::WORDS > Banks<T2, 1>::WORDS ? Banks<T1, 1>::WORDS : Banks<T2, 1>::WORDS;
    __shared__ __align__(16) u8 smem[WARPS][S1 > S2 ? S1 : S2];
    __shared__ __align__(16) u32 tab[TW];
    u8* sbuf = smem[threadIdx.x >> 5];
    allow_dependents();
    if ((int)blockIdx.x < nb1) {  // uniform per block: load_table's barrier is safe
        load_table<T1, 1>(tab);
        expert_rows<T1, A16>(e1, n_expert, ids, n_used, rows1, row_bytes1, k, rpw1, blockIdx.x, q8, meta, out1, sbuf, tab);
    } else {
        load_table<T2, 1>(tab);
        expert_rows<T2, A16>(e2, n_expert, ids, n_used, rows2, row_bytes2, k, rpw2, blockIdx.x - nb1, q8, meta, out2,
                        sbuf, tab);
    }
}

// Experts over columns grouped by expert (prefill: many tokens, each expert used by several).
// The host sorts the (token, expert) pairs by expert and gathers their activations in that
// order; tile t = blockIdx.y is (expert, first sorted column, columns <= GROUP_COLS), and a
// warp streams its rows of that expert once for all the tile's columns instead of once per
// pair. Tiles past *n_tiles (the grid is sized for the most tiles the pairs can make) exit.
// Every column's arithmetic is stream_rows' per-column sum, as in mmvq_ids: the results are
// bitwise those of the decode path. Expert n_expert is the bucket of out-of-range ids: NaN.
#define GROUP_COLS 8
#ifndef GROUP_MIN_BLOCKS  // resident blocks per SM the compiler must allow (registers)
#define GROUP_MIN_BLOCKS 4  // 128 registers, no spills (183 unbounded: 2 blocks per SM)
#endif
template <int ID>
__global__ void __launch_bounds__(WARPS * 32, GROUP_MIN_BLOCKS) mmvq_grouped(const u64* __restrict__ experts,
                                                           int n_expert, const int4* __restrict__ tiles,
                                                           const int* __restrict__ n_tiles, int rows, int row_bytes,
                                                           int k, int rows_per_warp, const i8* __restrict__ q8,
                                                           const QMeta* __restrict__ meta, float* __restrict__ out) {
    typedef TypeOf<ID> T;
    __shared__ __align__(16) u8 smem[WARPS][Geometry<T>::WARP_SMEM];
    __shared__ __align__(16) u32 tab[Banks<T, GROUP_COLS>::WORDS];
    allow_dependents();
    wait_prior_grids();  // the tiles are a sort's output (pdl.cuh)
    if ((int)blockIdx.y >= ld_global(after_wait(n_tiles))) return;  // uniform per block, before load_table's barrier
    const int4 tile = ld_global(after_wait(tiles) + blockIdx.y);  // (expert, first column, columns, -)
    load_table<T, GROUP_COLS>(tab);
    const int2 r = warp_rows(blockIdx.x, rows_per_warp, rows);
    float* o = out + (size_t)tile.y * rows;
    if (tile.x < 0 || tile.x >= n_expert) {
        if ((threadIdx.x & 31) == 0)
            for (int j = 0; j < tile.z; ++j)
                for (int row = r.x; row < r.y; ++row) o[(size_t)j * rows + row] = __int_as_float(0x7fc00000);
        return;
    }
    stream_rows<T, GROUP_COLS>(expert_matrix(experts, tile.x), r.x, r.y, row_bytes, k, q8 + (size_t)tile.y * k,
                               meta + (size_t)tile.y * (k / 32), o, rows, smem[threadIdx.x >> 5], tab, tile.z);
}

// Long prompts' expert rows on int8 tensor cores (mma.sync, sm_80+), a GEMM over the tiles of
// an ExpertPlan made with MMQ_COLS columns a tile (an expert, <= 8 N8 sorted columns). A block
// is MMQ_WARPS warps of MMQ_ROWS rows; k is walked in steps of SCH chunks (MmqGeo), each step's
// weights (every warp its rows' bytes, aligned 16-byte pieces: such a piece never crosses a
// page, so the bytes read around a row cannot fault) and activations (the tile's columns, then
// permuted in place to the codes' order) copied by cp.async into one of two buffers while the
// step before is computed. Per chunk of 32 weights every lane decodes one row's chunk (the MMVQ
// decoders, plain codes) into a staged A tile; per 16 rows and 8 columns one m16n8k32 (one-scale
// types) or two m16n8k16 (a scale per 16 weights) take the integer dot products, and each (row,
// column) adds the chunk's chunk_float. The decode is paid once per 8 N8 columns where
// mmvq_grouped pays it once per 8. Chunks are summed in order (0, 1, 2 ...) where MMVQ sums 32
// interleaved chains and then its lanes: other bits, so the backend takes this kernel only for
// long prompts' rows (the per-request rule of the prompt GEMM path); a column's result depends
// only on its own activations, never on its tile or N8.
#define MMQ_WARPS 4
#define MMQ_ROWS 32  // rows per warp: two groups of 16 (mma's m), a lane decoding one row of one
#define MMQ_AST 12   // words per staged code row: 32 bytes + 16 of padding (conflict-free fragments)

__device__ __forceinline__ void mma_k32(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_k16(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// The step geometry of mmq_grouped<ID, N8>; experts.py's mmq_geometry mirrors BYTES.
template <class T, int N8> struct MmqGeo {
    static constexpr int CPB = T::BS / 32;
    static constexpr int SCH = CPB >= 4 ? CPB : 4;     // chunks a step (k must hold whole steps)
    static constexpr int WB = SCH / CPB * T::TS;       // a row's weight bytes a step
    static constexpr int SLOT = (WB + 15 + 16 + 15) / 16 * 16;  // + its offset in a piece + slack
    static constexpr int NCOL = 8 * N8;
    static constexpr int BSTW = 8 * SCH + 4;           // words a column a step: fragments conflict-free
    static constexpr int WST = MMQ_WARPS * MMQ_ROWS * SLOT;       // bytes of one buffer's weights
    static constexpr int BST = NCOL * BSTW * 4;                   // of its activations
    static constexpr int MST = NCOL * SCH * 8;                    // of their blocks (QMeta)
    static constexpr int BUF = WST + BST + MST;
    static constexpr int BYTES = 2 * BUF;                         // dynamic shared memory
};

template <int ID, int N8>
__global__ void __launch_bounds__(MMQ_WARPS * 32) mmq_grouped(const u64* __restrict__ experts,
                                                         int n_expert, const int4* __restrict__ tiles,
                                                         const int* __restrict__ n_tiles, int rows, int row_bytes,
                                                         int k, const i8* __restrict__ q8,
                                                         const QMeta* __restrict__ meta, float* __restrict__ out) {
    typedef TypeOf<ID> T;
    typedef MmqGeo<T, N8> G;
    constexpr int CPB = G::CPB, SCH = G::SCH;
    constexpr bool ONE = OneScale<ID>::YES;
    __shared__ __align__(16) u32 tab[Banks<T, 8 * N8>::WORDS];
    __shared__ __align__(16) u32 atile[MMQ_WARPS][2][16 * MMQ_AST];  // codes of a chunk: 2 groups x 16 rows
    __shared__ __align__(16) float4 ascale[MMQ_WARPS][2][16];        // their sc[0], sc[1], mn[0], mn[1]
    extern __shared__ __align__(16) u8 mmq_smem[];                    // 2 x (weights, activations, blocks)
    allow_dependents();
    wait_prior_grids();  // the tiles are a sort's output (pdl.cuh)
    if ((int)blockIdx.y >= ld_global(after_wait(n_tiles))) return;  // uniform per block, before the barriers
    const int4 tile = ld_global(after_wait(tiles) + blockIdx.y);  // (expert, first column, columns, -)
    load_table<T, 8 * N8>(tab);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * MMQ_WARPS + warp) * MMQ_ROWS;
    float* o = out + (size_t)tile.y * rows;
    if (tile.x < 0 || tile.x >= n_expert) {
        if (lane == 0 && r0 < rows)
            for (int j = 0; j < tile.z; ++j)
                for (int row = r0; row < min(rows, r0 + MMQ_ROWS); ++row) o[(size_t)j * rows + row] = __int_as_float(0x7fc00000);
        return;
    }
    const int nch = k / 32, nsteps = nch / SCH;
    const int ng = (tile.z + 7) >> 3;  // column groups in use (uniform per block)
    const u8* wexp = expert_matrix(experts, tile.x);
    const i8* qt = after_wait(q8) + (size_t)tile.y * k;
    const QMeta* mt = after_wait(meta) + (size_t)tile.y * nch;
    const u32 sbase = (u32)__cvta_generic_to_shared(mmq_smem);
    // step s's copies into buffer s & 1: this warp's rows (rows past the matrix repeat its last
    // row, not written), then the block's share of the columns and their blocks
    auto issue = [&](int s) {
        const u32 buf = sbase + (u32)((s & 1) * G::BUF);
        constexpr int NP = G::SLOT / 16;
        for (int i = lane; i < MMQ_ROWS * NP; i += 32) {
            const int rr = i / NP, piece = i % NP;
            const size_t g0 = (size_t)(wexp + (size_t)min(r0 + rr, rows - 1) * row_bytes) + (size_t)s * G::WB;
            const size_t a0 = g0 & ~(size_t)15;
            if (a0 + 16 * piece < g0 + G::WB)
                cp_async16(buf + (u32)((warp * MMQ_ROWS + rr) * G::SLOT + 16 * piece), (const void*)(a0 + 16 * piece));
        }
        const u32 bbuf = buf + G::WST, mbuf = bbuf + G::BST;
        constexpr int BP = SCH * 2, MP = SCH / 2;  // 16-byte pieces of a column's codes, of its blocks
        for (int i = threadIdx.x; i < 8 * ng * BP; i += blockDim.x) {
            const int j = i / BP, p = i % BP;
            cp_async16(bbuf + (u32)(j * G::BSTW * 4 + 16 * p), qt + (size_t)j * k + (size_t)s * SCH * 32 + 16 * p);
        }
        for (int i = threadIdx.x; i < 8 * ng * MP; i += blockDim.x) {
            const int j = i / MP, p = i % MP;
            cp_async16(mbuf + (u32)(j * SCH * 8 + 16 * p), mt + (size_t)j * nch + (size_t)s * SCH + 2 * p);
        }
        cp_async_commit();
    };
    // decoding side: lane -> (group, row); fragment side: mma's group and thread in group
    const int dg = lane >> 4, drow = lane & 15, myrow = 16 * dg + drow;
    const size_t mybase = (size_t)(wexp + (size_t)min(r0 + myrow, rows - 1) * row_bytes);
    const int g = lane >> 2, t = lane & 3;
    u32* at = atile[warp][0];
    float acc[2][N8][4];
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int n = 0; n < N8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[q][n][e] = 0.0f;
    issue(0);
    for (int s = 0; s < nsteps; ++s) {
        if (s + 1 < nsteps) {
            issue(s + 1);
            cp_async_wait<1>();  // step s has landed (this thread's copies)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // and every thread's
        u8* buf = mmq_smem + (s & 1) * G::BUF;
        if constexpr (T::ORDER != WEIGHT_ORDER) {  // the step's columns to the codes' order (activation_order)
            for (int i = threadIdx.x; i < 8 * ng * SCH; i += blockDim.x) {
                int4* p = (int4*)(buf + G::WST + (i / SCH) * G::BSTW * 4 + (i % SCH) * 32);
                int4 a = p[0], c = p[1];
                activation_order<T::ORDER>(a, c);
                p[0] = a;
                p[1] = c;
            }
            __syncthreads();
        }
        const u8* wrow = buf + (warp * MMQ_ROWS + myrow) * G::SLOT + ((mybase + (size_t)s * G::WB) & 15);
        const u32* bsm = (const u32*)(buf + G::WST);
        const QMeta* msm = (const QMeta*)(buf + G::WST + G::BST);
#pragma unroll 1
        for (int cc = 0; cc < SCH; ++cc) {
            Chunk ch;
            T::template decode<Banks<T, 8 * N8>::N, false>(wrow + (cc / CPB) * T::TS, cc % CPB, ch, tab);
            u32* dst = at + (dg * 16 + drow) * MMQ_AST;
            *(int4*)dst = make_int4(ch.q[0], ch.q[1], ch.q[2], ch.q[3]);
            *(int4*)(dst + 4) = make_int4(ch.q[4], ch.q[5], ch.q[6], ch.q[7]);
            ascale[warp][dg][drow] = make_float4(ch.sc[0], ch.sc[1], ch.mn[0], ch.mn[1]);
            __syncwarp();
            u32 af[2][4];
            float4 sr[2][2];  // scales of rows g and g + 8 of each group
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const u32* ar = at + q * 16 * MMQ_AST;
                af[q][0] = ar[g * MMQ_AST + t];
                af[q][1] = ar[(g + 8) * MMQ_AST + t];
                af[q][2] = ar[g * MMQ_AST + 4 + t];
                af[q][3] = ar[(g + 8) * MMQ_AST + 4 + t];
                sr[q][0] = ascale[warp][q][g];
                sr[q][1] = ascale[warp][q][g + 8];
            }
            __syncwarp();  // the staged tile is rewritten next chunk
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                if (n < ng) {
                    // B fragments (column 8n + g; codes 4t..4t+3 and 16 + 4t..), shared by both row groups
                    const u32* bc = bsm + (8 * n + g) * G::BSTW + 8 * cc;
                    const u32 b0 = bc[t], b1 = bc[4 + t];
                    const QMeta m0 = msm[(8 * n + 2 * t) * SCH + cc], m1 = msm[(8 * n + 2 * t + 1) * SCH + cc];
#pragma unroll
                    for (int q = 0; q < 2; ++q) {
                        int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                        if constexpr (ONE) {
                            mma_k32(lo, af[q][0], af[q][1], af[q][2], af[q][3], b0, b1);
                        } else {
                            mma_k16(lo, af[q][0], af[q][1], b0);
                            mma_k16(hi, af[q][2], af[q][3], b1);
                        }
                        // C: lo[0], lo[1] row g, columns 2t, 2t+1; lo[2], lo[3] row g + 8
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float4 s4 = sr[q][e >> 1];
                            const float sc[2] = {s4.x, s4.y}, mn[2] = {s4.z, s4.w};
                            acc[q][n][e] = chunk_float<T>(acc[q][n][e], lo[e], hi[e], sc, mn, (e & 1) ? m1 : m0);
                        }
                    }
                }
            }
        }
        __syncthreads();  // buffer s & 1 is refilled by step s + 2's copies
    }
    if (r0 >= rows) return;
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int n = 0; n < N8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r0 + 16 * q + g + 8 * (e >> 1), col = 8 * n + 2 * t + (e & 1);
                if (row < rows && col < tile.z) o[(size_t)col * rows + row] = acc[q][n][e];
            }
}

// The plan mmvq_grouped runs on (experts.py, ExpertPlan), in one launch of one block: the pairs
// (token, expert) sorted by expert by a stable counting sort, and tiles of at most `cols` pairs
// of one expert (experts.py: GROUP_COLS for mmvq_grouped, MMQ_COLS for mmq_grouped). CuPy's array
// code for it took ~15 launches and ~1 ms of host time per layer, which made a prefill window's
// host side slower than its GPU side. Bucket b < n_expert
// is expert b, bucket n_expert the out-of-range ids. Dynamic shared memory: (2 + PLAN_THREADS / 32)
// * (n_expert + 1) ints (experts.py checks that they fit).
#define PLAN_THREADS 256
extern "C" __global__ void __launch_bounds__(PLAN_THREADS) expert_plan_build(
    const int* __restrict__ ids, int pairs, int n_expert, int max_tiles, long long* __restrict__ order,
    int4* __restrict__ tiles, int* __restrict__ n_tiles, int cols) {
    constexpr int NW = PLAN_THREADS / 32;
    extern __shared__ int plan_smem[];
    const int B = n_expert + 1;
    int* cnt = plan_smem;            // pairs per bucket
    int* cursor = plan_smem + B;     // a bucket's next sorted position
    int* part = plan_smem + 2 * B;   // tile starts, then each warp's pairs per bucket in a chunk
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    auto bucket_of = [&](int p) {
        const int e = ids[p];
        return e >= 0 && e < n_expert ? e : n_expert;
    };
    for (int b = tid; b < B; b += PLAN_THREADS) cnt[b] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += PLAN_THREADS) atomicAdd(&cnt[bucket_of(p)], 1);
    __syncthreads();
    if (tid == 0) {  // exclusive scans of pairs and tiles per bucket (a few hundred buckets)
        int s = 0, t = 0;
        for (int b = 0; b < B; ++b) {
            cursor[b] = s;
            part[b] = t;
            s += cnt[b];
            t += (cnt[b] + cols - 1) / cols;
        }
        *n_tiles = t;
    }
    __syncthreads();
    for (int b = tid; b < B; b += PLAN_THREADS)
        for (int j = 0; j * cols < cnt[b]; ++j)
            tiles[part[b] + j] = make_int4(b, cursor[b] + j * cols, min(cols, cnt[b] - j * cols), 0);
    const int used = part[B - 1] + (cnt[B - 1] + cols - 1) / cols;
    for (int t = used + tid; t < max_tiles; t += PLAN_THREADS) tiles[t] = make_int4(0, 0, 0, 0);  // never run
    __syncthreads();
    // stable scatter, a chunk of PLAN_THREADS pairs at a time in pair order: a pair's place is its
    // bucket's cursor + the pairs of its bucket in earlier warps of the chunk + earlier lanes of its warp
    for (int c0 = 0; c0 < pairs; c0 += PLAN_THREADS) {
        const int p = c0 + tid;
        const int b = p < pairs ? bucket_of(p) : -1;
        const unsigned same = __match_any_sync(0xFFFFFFFFu, b);
        const int rank = __popc(same & ((1u << lane) - 1u));
        for (int i = tid; i < NW * B; i += PLAN_THREADS) part[i] = 0;
        __syncthreads();
        if (b >= 0 && rank == 0) part[warp * B + b] = __popc(same);
        __syncthreads();
        if (b >= 0) {
            int before = cursor[b] + rank;
            for (int w = 0; w < warp; ++w) before += part[w * B + b];
            order[before] = p;
        }
        __syncthreads();
        for (int bb = tid; bb < B; bb += PLAN_THREADS) {
            int s = 0;
            for (int w = 0; w < NW; ++w) s += part[w * B + bb];
            cursor[bb] += s;
        }
        __syncthreads();
    }
}

// Activation rows in a plan's sorted order for mmvq_grouped: row i of (qg, mg) is row order[i] /
// div of (q, meta) (div: n_used where a token's experts share its row, 1 for a row per pair);
// rows pairs..total are zero (a tile reads up to its width past its columns). One block
// per row; one launch where CuPy's indexing took four.
extern "C" __global__ void gather_q8_rows(const i8* __restrict__ q, const int2* __restrict__ meta,
                                          const long long* __restrict__ order, int div, int pairs, int k,
                                          i8* __restrict__ qg, int2* __restrict__ mg) {
    const int i = blockIdx.x;
    const bool live = i < pairs;
    const long long src = live ? order[i] / div : 0;
    const int4* qs = (const int4*)(q + src * k);
    int4* qd = (int4*)(qg + (size_t)i * k);
    for (int j = threadIdx.x; j < k / 16; j += blockDim.x) qd[j] = live ? qs[j] : make_int4(0, 0, 0, 0);
    const int kb = k / 32;
    for (int j = threadIdx.x; j < kb; j += blockDim.x) mg[(size_t)i * kb + j] = live ? meta[src * kb + j] : make_int2(0, 0);
}

// mmvq_grouped's rows (sorted order) back to pair order: out row order[i] = row i of src.
extern "C" __global__ void scatter_rows(const float* __restrict__ src, const long long* __restrict__ order, int rows,
                                        float* __restrict__ out) {
    const int i = blockIdx.x;
    const float* s = src + (size_t)i * rows;
    float* d = out + (size_t)order[i] * rows;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) d[r] = s[r];
}

// ---------------------------------------------------------------- activation quantization
// One warp per 32-block: d = amax / 127, q = roundf(x / d) (IEEE division, as numpy),
// s = d * sum(q). Matches strata.kernels.activation_quant bit for bit.
// x is no __restrict__: launched early (pdl.cuh), it is not read-only while this kernel lives.
extern "C" __global__ void quantize_q8_1(const float* x, int nblocks, i8* __restrict__ q8,
                                         QMeta* __restrict__ meta, float* __restrict__ s_out) {
    wait_prior_grids();
    allow_dependents();  // the mat-vecs after it fetch their first weights meanwhile
    const int blk = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (blk >= nblocks) return;
    const float v = x[(size_t)blk * 32 + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    const float d = __fdiv_rn(amax, 127.0f);
    const int q = d == 0.0f ? 0 : (int)roundf(__fdiv_rn(v, d));
    int lo = lane < 16 ? q : 0, hi = lane < 16 ? 0 : q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo += __shfl_xor_sync(FULL_MASK, lo, o);
        hi += __shfl_xor_sync(FULL_MASK, hi, o);
    }
    q8[(size_t)blk * 32 + lane] = (i8)q;
    if (lane == 0) {
        QMeta m;
        m.d = d;
        m.sums = (lo & 0xFFFF) | (hi << 16);
        meta[blk] = m;
        s_out[blk] = __fmul_rn(d, (float)(lo + hi));
    }
}

// ---------------------------------------------------------------- plain float weights
// F32 / F16 / BF16 rows times float32 columns (no activation quantization), one warp per row,
// 16-byte loads when rows are 16-byte aligned and a whole number of vectors (VEC).
template <int ID> struct FloatOf;
template <> struct FloatOf<0> {
    static constexpr int ES = 4, PER16 = 4;
    __device__ static __forceinline__ float get(const u8* p, int i) { return ((const float*)p)[i]; }
    __device__ static __forceinline__ void unpack(uint4 v, float* f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
};
template <> struct FloatOf<1> {
    static constexpr int ES = 2, PER16 = 8;
    __device__ static __forceinline__ float get(const u8* p, int i) { return h2f(((const u16*)p)[i]); }
    __device__ static __forceinline__ void unpack(uint4 v, float* f) {
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { f[2 * i] = h2f((u16)(w[i] & 0xFFFF)); f[2 * i + 1] = h2f((u16)(w[i] >> 16)); }
    }
};
template <> struct FloatOf<30> {
    static constexpr int ES = 2, PER16 = 8;
    __device__ static __forceinline__ float get(const u8* p, int i) { return bf2f(((const u16*)p)[i]); }
    __device__ static __forceinline__ void unpack(uint4 v, float* f) {
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { f[2 * i] = bf2f((u16)(w[i] & 0xFFFF)); f[2 * i + 1] = bf2f((u16)(w[i] >> 16)); }
    }
};

// x (the kernel before's output) goes through weak loads, never the read-only path (pdl.cuh).
template <int ID, int NC>
__device__ __forceinline__ void float_row_dot(const u8* __restrict__ row, int k, const float* x,
                                              float (&acc)[NC], bool vec) {
    typedef FloatOf<ID> F;
    const int lane = threadIdx.x & 31;
    if (vec) {
        const int nv = k / F::PER16;
        // unrolled: a decode row is latency-bound, so several 16-byte loads go out at once
        // (the sum order stays the loop's)
#pragma unroll 8
        for (int v = lane; v < nv; v += 32) {
            float f[F::PER16];
            F::unpack(__ldg((const uint4*)row + v), f);
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                const int4* xp = (const int4*)(x + (size_t)j * k + (size_t)v * F::PER16);
#pragma unroll
                for (int u = 0; u < F::PER16 / 4; ++u) {
                    const int4 xi = ld_global(xp + u);
                    const float4 xv = make_float4(__int_as_float(xi.x), __int_as_float(xi.y), __int_as_float(xi.z),
                                                  __int_as_float(xi.w));
                    // rounding spelled out, as in chunk_acc: the same bits for 1..8 columns
                    const float d = __fmaf_rn(f[4 * u + 3], xv.w, __fmaf_rn(f[4 * u + 2], xv.z,
                                              __fmaf_rn(f[4 * u + 1], xv.y, __fmul_rn(f[4 * u], xv.x))));
                    acc[j] = __fadd_rn(acc[j], d);
                }
            }
        }
    } else {
#pragma unroll 4
        for (int i = lane; i < k; i += 32) {
            const float wv = F::get(row, i);
#pragma unroll
            for (int j = 0; j < NC; ++j) acc[j] = __fmaf_rn(wv, __int_as_float(ld_global((const int*)x + (size_t)j * k + i)), acc[j]);
        }
    }
}

// blockIdx.y picks a group of NC columns, as in mmvq: a wide window is one launch.
template <int ID, int NC>
__global__ void __launch_bounds__(WARPS * 32) mmvf(const u8* __restrict__ w, int rows, int row_bytes, int k,
                                                   const float* x, float* __restrict__ out, int vec) {
    const int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    // launched early (pdl.cuh), the warp's row is on its way to L2 while the kernel before
    // this one finishes (an MoE router: 1 MB of float weights per layer); x is its output
    if (r < rows && blockIdx.y == 0) prefetch_l2(w + (size_t)r * row_bytes, (unsigned)row_bytes, threadIdx.x & 31, 32);
    wait_prior_grids();
    allow_dependents();
    if (r >= rows) return;
    x = after_wait(x) + (size_t)blockIdx.y * NC * k;
    out += (size_t)blockIdx.y * NC * rows;
    float acc[NC];
#pragma unroll
    for (int j = 0; j < NC; ++j) acc[j] = 0.0f;
    float_row_dot<ID, NC>(w + (size_t)r * row_bytes, k, x, acc, vec != 0);
    warp_sum<NC>(acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int j = 0; j < NC; ++j) out[(size_t)j * rows + r] = acc[j];
    }
}

template <int ID>
__global__ void __launch_bounds__(WARPS * 32) mmvf_ids(const u64* __restrict__ experts,
                                                       int n_expert, const int* __restrict__ ids, int n_used,
                                                       int rows, int row_bytes, int k, const float* __restrict__ x,
                                                       float* __restrict__ out, int vec) {
    const int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int p = blockIdx.y;
    wait_prior_grids();  // the ids are the routing kernel's output, x the kernel before's
    allow_dependents();
    if (r >= rows) return;
    x = after_wait(x);
    const int e = ld_global(after_wait(ids) + p);
    if (e < 0 || e >= n_expert) {
        if ((threadIdx.x & 31) == 0) out[(size_t)p * rows + r] = __int_as_float(0x7fc00000);
        return;
    }
    float acc[1] = {0.0f};
    float_row_dot<ID, 1>(expert_matrix(experts, e) + (size_t)r * row_bytes, k, x + (size_t)(p / n_used) * k,
                         acc, vec != 0);
    warp_sum<1>(acc);
    if ((threadIdx.x & 31) == 0) out[(size_t)p * rows + r] = acc[0];
}
