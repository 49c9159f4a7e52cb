// Per-type chunk decoders for Strata's MMVQ kernels.
//
// Each type is a struct specialising TypeOf<id> with:
//   BS, TS    weights and bytes per block (as strata.kernels.ggml_types);
//   IOFF      integer offset added to every code (value = code + IOFF), applied exactly
//             through the activations' integer sums;
//   MIN       whether Chunk::mn holds min coefficients (times the activation sums);
//   decode(b, sub, r)  fills chunk `sub` (32 weights) of the block at b (shared memory; a
//             plain pointer, or a TilePtr that also carries b's alignment: mmvq_common.cuh).
//             Word loads go through ldwords / ld32u, which read either.
// Layouts follow ggml-common.h; the codes match strata.kernels.mmvq_codes* up to exact
// integer rewrites (e.g. IQ1 codes are 8 * grid + 16 +- 1 with IOFF -16, scale / 8).
// Tables (IQ grids, E8M0 / UE4M3 scales) are generated from strata's Python tables.

template <int ID> struct TypeOf;

// Order of a chunk's codes (Chunk::q): which weight of the chunk byte j of int i holds.
//   WEIGHT_ORDER  4i + j
//   PLANE_ORDER   16h + 4j + s for int 4h + s (2-bit fields: a mask per plane, no shuffle)
//   PAIR_ORDER    16 (j & 1) + 4m + 2p + (j >> 1) for int 2m + p (4-bit lookups: lut16_pairs)
// The kernels permute the activations to the same order, once per column for all rows.
enum { WEIGHT_ORDER = 0, PLANE_ORDER = 1, PAIR_ORDER = 2 };
__host__ __device__ __forceinline__ constexpr int code_weight(int order, int i, int j) {
    return order == PLANE_ORDER  ? 16 * (i >> 2) + 4 * j + (i & 3)
           : order == PAIR_ORDER ? 16 * (j & 1) + 4 * (i >> 1) + 2 * (i & 1) + (j >> 1)
                                 : 4 * i + j;
}

// The 8 nibbles of w (byte j: low nibble = weight j, high nibble = weight j + 16 of a run)
// looked up in a 16-entry int8 table, in nibble-pair order: ra = weights 0 16 1 17, rb =
// weights 2 18 3 19 (PAIR_ORDER below). The nibble pairs of w serve directly as prmt
// selectors (bit 3 of each chooses the table half), so no byte shuffle follows the lookup;
// the kernel interleaves the activations to match, once per column for all rows.
__device__ __forceinline__ void lut16_pairs(u32 w, u32 t0, u32 t1, u32 t2, u32 t3, int& ra, int& rb) {
    const u32 s7 = w & 0x77777777u;
    const u32 s8 = ((w >> 1) & 0x44444444u) | 0x32103210u;
    ra = __byte_perm(__byte_perm(t0, t1, s7), __byte_perm(t2, t3, s7), s8);
    rb = __byte_perm(__byte_perm(t0, t1, s7 >> 16), __byte_perm(t2, t3, s7 >> 16), s8 >> 16);
}
// The same lookup in weight order: lo = weights 0..3, hi = weights 16..19.
__device__ __forceinline__ void lut16x8(u32 w, u32 t0, u32 t1, u32 t2, u32 t3, int& lo, int& hi) {
    int ra, rb;
    lut16_pairs(w, t0, t1, t2, t3, ra, rb);
    lo = __byte_perm(ra, rb, 0x6420u);
    hi = __byte_perm(ra, rb, 0x7531u);
}

// kvalues as little-endian words, from strata.kernels.iq_tables (generated).
// KV_IQ4NL_0..3 and KV_FP4_0..3 are #defined by the generated table header, and the same words
// are the arrays KV_IQ4NL_W and KV_FP4_W.

// TAB_WORDS / table(): the codebook a type reads (copied to shared memory per thread block;
// decode gets it as `tab`); 1 / nullptr for types without one. TSTRIDE: word i of the codebook
// is tab[i * TSTRIDE] (the kernels keep TSTRIDE copies interleaved for the IQ3 types: see
// Banks in mmvq_kernels.cuh; the dequantizer and the host check use one copy).
// RAWF: a cheaper form of the chunk that only the MMVQ dot product takes (decode's second
// parameter RAW; chunk_acc undoes it exactly, the dequantizer and the host check read the plain
// form; raw_code below gives a raw chunk's codes):
//   RAW_SIGNS   grid words times per-weight signs (IQ2, IQ3_XXS): q = g ^ m, neg = m (Chunk);
//   RAW_NIBBLE  4-bit codes that sit in the high nibbles stay there (q = 16 x code as unsigned
//               bytes) and the scales take the 1 / 16 (a power of two: the same bits).
//   RAW_PLANES  2-bit codes masked in place, no shift (code int 4h + p holds 4^p x code as
//               unsigned bytes); the dot product weighs plane p by 4^(3 - p) (a shift of its
//               running sum between planes), so every code counts 64 times and the scale takes
//               the 1 / 64.
enum { RAW_NONE = 0, RAW_SIGNS = 1, RAW_NIBBLE = 2, RAW_PLANES = 3 };
#define TYPE_HEAD_S(ID_, BS_, TS_, IOFF_, MIN_, TABW_, TAB_, ORDER_, RAWF_)      \
    template <> struct TypeOf<ID_> {                                             \
        static constexpr int ID = ID_, BS = BS_, TS = TS_, IOFF = IOFF_, TAB_WORDS = TABW_; \
        static constexpr int ORDER = ORDER_, RAWF = RAWF_;                       \
        static constexpr bool MIN = MIN_;                                        \
        __device__ static __forceinline__ const u32* table() { return TAB_; }     \
        template <int TSTRIDE = 1, bool RAW = false, class P = const u8*>        \
        __device__ static __forceinline__ void decode(P b, int sub, Chunk& r, const u32* tab)
#define TYPE_HEAD_X(ID_, BS_, TS_, IOFF_, MIN_, TABW_, TAB_, ORDER_) TYPE_HEAD_S(ID_, BS_, TS_, IOFF_, MIN_, TABW_, TAB_, ORDER_, RAW_NONE)
#define TYPE_HEAD_TAB(ID_, BS_, TS_, IOFF_, MIN_, TABW_, TAB_) TYPE_HEAD_S(ID_, BS_, TS_, IOFF_, MIN_, TABW_, TAB_, WEIGHT_ORDER, RAW_SIGNS)
#define TYPE_HEAD(ID_, BS_, TS_, IOFF_, MIN_) TYPE_HEAD_X(ID_, BS_, TS_, IOFF_, MIN_, 1, nullptr, WEIGHT_ORDER)
// ORDER: the order of the chunk's codes (code_weight above).

// Code j of word i of a chunk decoded RAW (RAWF above); of a plain chunk, the int8 byte.
template <int RAWF>
__host__ __device__ __forceinline__ int raw_code(const Chunk& r, int i, int j) {
    const int q = (int)((r.q[i] >> (8 * j)) & 0xFF);
    if (RAWF == RAW_NIBBLE) return q;
    if (RAWF == RAW_PLANES) return q << (2 * (3 - (i & 3)));
    const int c = (int)(i8)q;
    return RAWF == RAW_SIGNS ? c - (int)(i8)((r.neg[i] >> (8 * j)) & 0xFF) : c;
}

#define TYPE_TAIL };

// ---------------------------------------------------------------- 32-weight formats
// Q4_0: half d; qs[16]: low nibbles weights 0..15, high nibbles 16..31; value d * (q - 8).
TYPE_HEAD(2, 32, 18, -8, false) {
    u32 w[4];
    ldwords(b + 2, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        r.q[i] = w[i] & 0x0F0F0F0F;
        r.q[4 + i] = (w[i] >> 4) & 0x0F0F0F0F;
    }
    r.sc[0] = r.sc[1] = ldh(b);
}
TYPE_TAIL

// Q4_1: half d, half m; qs[16]; value d * q + m.
TYPE_HEAD(3, 32, 20, 0, true) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 w = ld32a(b + 4 + 4 * i);
        r.q[i] = w & 0x0F0F0F0F;
        r.q[4 + i] = (w >> 4) & 0x0F0F0F0F;
    }
    r.sc[0] = r.sc[1] = ldh(b);
    r.mn[0] = r.mn[1] = ldh(b + 2);
}
TYPE_TAIL

// Q5_0: half d; u32 qh (bit j = 5th bit of weight j); qs[16]; value d * (q - 16).
TYPE_HEAD(6, 32, 22, -16, false) {
    u32 v[5];  // qh, then qs
    ldwords(b + 2, v);
    const u32 qh = v[0];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 w = v[1 + i];
        r.q[i] = (w & 0x0F0F0F0F) | (spread4((qh >> (4 * i)) & 15) << 4);
        r.q[4 + i] = ((w >> 4) & 0x0F0F0F0F) | (spread4((qh >> (16 + 4 * i)) & 15) << 4);
    }
    r.sc[0] = r.sc[1] = ldh(b);
}
TYPE_TAIL

// Q5_1: half d, half m; u32 qh; qs[16]; value d * q + m.
TYPE_HEAD(7, 32, 24, 0, true) {
    const u32 qh = ld32a(b + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 w = ld32a(b + 8 + 4 * i);
        r.q[i] = (w & 0x0F0F0F0F) | (spread4((qh >> (4 * i)) & 15) << 4);
        r.q[4 + i] = ((w >> 4) & 0x0F0F0F0F) | (spread4((qh >> (16 + 4 * i)) & 15) << 4);
    }
    r.sc[0] = r.sc[1] = ldh(b);
    r.mn[0] = r.mn[1] = ldh(b + 2);
}
TYPE_TAIL

// Q8_0: half d; int8 qs[32].
TYPE_HEAD(8, 32, 34, 0, false) {
    u32 w[8];
    ldwords(b + 2, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = w[i];
    r.sc[0] = r.sc[1] = ldh(b);
}
TYPE_TAIL

// IQ4_NL: half d; qs[16] nibbles indexing kvalues_iq4nl. Codes in PAIR_ORDER.
TYPE_HEAD_X(20, 32, 18, 0, false, 4, KV_IQ4NL_W, PAIR_ORDER) {
    u32 w[4];
    ldwords(b + 2, w);
    const u32 t0 = tab[0], t1 = tab[1], t2 = tab[2], t3 = tab[3];
#pragma unroll
    for (int i = 0; i < 4; ++i) lut16_pairs(w[i], t0, t1, t2, t3, r.q[2 * i], r.q[2 * i + 1]);
    r.sc[0] = r.sc[1] = ldh(b);
}
TYPE_TAIL

// MXFP4: u8 e (E8M0); qs[16] nibbles indexing the doubled E2M1 values; scale 2^(e-128).
// Codes in PAIR_ORDER.
TYPE_HEAD_X(39, 32, 17, 0, false, 4, KV_FP4_W, PAIR_ORDER) {
    u32 w[4];
    ldwords(b + 1, w);
    const u32 t0 = tab[0], t1 = tab[1], t2 = tab[2], t3 = tab[3];
#pragma unroll
    for (int i = 0; i < 4; ++i) lut16_pairs(w[i], t0, t1, t2, t3, r.q[2 * i], r.q[2 * i + 1]);
    r.sc[0] = r.sc[1] = __uint_as_float(__ldg(&E8M0_HALF_BITS[ld8(b)]));
}
TYPE_TAIL

// NVFP4 (64 weights): u8 d[4] (UE4M3 per 16 weights); qs[32]: 8 bytes per 16-weight
// sub-block, low nibbles its weights 0..7, high nibbles 8..15.
TYPE_HEAD(40, 64, 36, 0, false) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int s = 2 * sub + h;
        const u32 w0 = ld32a(b + 4 + 8 * s), w1 = ld32a(b + 8 + 8 * s);
        lut16x8(w0, KV_FP4_0, KV_FP4_1, KV_FP4_2, KV_FP4_3, r.q[4 * h + 0], r.q[4 * h + 2]);
        lut16x8(w1, KV_FP4_0, KV_FP4_1, KV_FP4_2, KV_FP4_3, r.q[4 * h + 1], r.q[4 * h + 3]);
        r.sc[h] = __uint_as_float(__ldg(&UE4M3_HALF_BITS[ld8(b + s)]));
    }
}
TYPE_TAIL

// Q1_0 (128 weights): half d; 128 sign bits (set: +d, clear: -d). Code 2*bit, IOFF -1.
TYPE_HEAD(41, 128, 18, -1, false) {
    const u32 w = ld32u(b + 2 + 4 * sub);
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = spread4((w >> (4 * i)) & 15) << 1;
    r.sc[0] = r.sc[1] = ldh(b);
}
TYPE_TAIL

// Q2_0 (64 weights): half d; 16 bytes of 2-bit codes, LSB first; value (c - 1) * d.
// A byte holds 4 consecutive weights, so masks give bit planes (code int 4h+s = weights
// 16h + 4k + s, k = 0..3): PLANE_ORDER. RAW (RAW_PLANES): one mask per plane, no shift.
TYPE_HEAD_S(42, 64, 18, -1, false, 1, nullptr, PLANE_ORDER, RAW_PLANES) {
    u32 w[2];  // weights 16h .. 16h+15 of the chunk in w[h]
    ldwords(b + 2 + 8 * sub, w);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int p = 0; p < 4; ++p)
            r.q[4 * h + p] = RAW ? w[h] & (0x03030303u << (2 * p)) : (w[h] >> (2 * p)) & 0x03030303u;
    }
    r.sc[0] = r.sc[1] = RAW ? ldh(b) * 0.015625f : ldh(b);
}
TYPE_TAIL

// ---------------------------------------------------------------- ternary
// TQ2_0: qs[64] (two runs of 32 bytes, 4 planes of 2 bits each), half d at 64; value (c-1)*d.
TYPE_HEAD(35, 256, 66, -1, false) {
    const u8* q = b + 32 * (sub >> 2);
    const int sh = 2 * (sub & 3);
    u32 w[8];
    ldwords(q, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = (w[i] >> sh) & 0x03030303;
    r.sc[0] = r.sc[1] = ldh(b + 64);
}
TYPE_TAIL

// Base-3 digit of each byte of w, p = 3^n for digit n: ((u8)(byte * p) * 3) >> 8, in 0..2.
// Even and odd bytes go to 16-bit lanes so one multiply serves two bytes (byte * 81 < 2^16);
// ~11 operations per word (byte at a time: 28).
__device__ __forceinline__ u32 tern4(u32 w, u32 p) {
    const u32 e = (__byte_perm(w, 0, 0x4240) * p) & 0x00FF00FFu;  // bytes 0, 2: (byte * p) mod 256
    const u32 o = (__byte_perm(w, 0, 0x4341) * p) & 0x00FF00FFu;  // bytes 1, 3
    return (((e * 3u) >> 8) & 0x00030003u) | ((o * 3u) & 0x03000300u);
}
__device__ __forceinline__ u32 pow3(int n) { return __byte_perm(0x1B090301u, 0x51u, 0x5550u | (u32)n); }  // n in 0..4

// TQ1_0: qs[48] (a 32-byte run of 5 base-3 digits per byte, then a 16-byte run of 5), qh[4]
// (4 digits per byte), half d at 52. A chunk is two halves of 16 weights, each 4 words and a
// digit; branch-free, since the lanes of a warp decode different chunks (branches ran both
// sides: 6% of copy bandwidth):
//   sub < 5    half h: bytes 16h .. 16h + 15 of the 32-byte run, digit sub
//   sub 5, 6   half h: the 16-byte run, digit 2 (sub - 5) + h
//   sub 7      half 0: the 16-byte run, digit 4; half 1: word i = qh, digit i
TYPE_HEAD(34, 256, 54, -1, false) {
    const bool run32 = sub < 5;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool qh = sub == 7 && h == 1;
        const u8* q = b + (run32 ? 16 * h : qh ? 48 : 32);
        const u32 p = pow3(run32 ? sub : 2 * (sub - 5) + h);
#pragma unroll
        for (int i = 0; i < 4; ++i) r.q[4 * h + i] = tern4(ld32u(q + (qh ? 0 : 4 * i)), qh ? pow3(i) : p);
    }
    r.sc[0] = r.sc[1] = ldh(b + 52);
}
TYPE_TAIL

// ---------------------------------------------------------------- K-quants
// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], half d, half dmin.
TYPE_HEAD(10, 256, 84, 0, true) {
    const u8* q = b + 16 + 32 * (sub >> 2);
    const int sh = 2 * (sub & 3);
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = (ld32a(q + 4 * i) >> sh) & 0x03030303;
    const float d = ldh(b + 80), dmin = ldh(b + 82);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 s = ld8(b + 2 * sub + h);
        r.sc[h] = d * (float)(s & 15);
        r.mn[h] = -(dmin * (float)(s >> 4));
    }
}
TYPE_TAIL

// Q3_K: hmask[32], qs[64], scales[12] (16 x 6 bits), half d; value d * (sc - 32) * (code - 4).
TYPE_HEAD(11, 256, 110, -4, false) {
    const u8* q = b + 32 + 32 * (sub >> 2);
    const int sh = 2 * (sub & 3);
    u32 lw[8], hw[8];
    ldwords(q, lw);
    ldwords(b, hw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 low = (lw[i] >> sh) & 0x03030303;
        const u32 hb = (hw[i] >> sub) & 0x01010101;
        r.q[i] = low | (hb << 2);
    }
    const float d = ldh(b + 108);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int s = 2 * sub + h;
        const u32 lo = s < 8 ? (ld8(b + 96 + s) & 15) : (ld8(b + 96 + s - 8) >> 4);
        const u32 hi = (ld8(b + 96 + 8 + (s & 3)) >> (2 * (s >> 2))) & 3;
        r.sc[h] = d * (float)((int)(lo | (hi << 4)) - 32);
    }
}
TYPE_TAIL

// get_scale_min_k4 of ggml: 8 (scale, min) pairs of 6 bits packed in 12 bytes.
// Branch-free: lanes of a warp decode different j, so a branch would run both sides.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, u32& sc, u32& m) {
    const u32 x = ld8(s + j), y = ld8(s + j + 4), z = ld8(s + (j & 3));  // z = s[j - 4] for j >= 4
    const bool lo = j < 4;
    sc = lo ? (x & 63) : ((y & 15) | ((z >> 6) << 4));
    m = lo ? (y & 63) : ((y >> 4) | ((x >> 6) << 4));
}

// Q4_K: half d, half dmin, scales[12], qs[128] (32-byte runs: low nibbles then high).
// RAW: the high nibbles stay in place (one mask per word instead of a shift and a mask).
TYPE_HEAD_S(12, 256, 144, 0, true, 1, nullptr, WEIGHT_ORDER, RAW_NIBBLE) {
    // 144-byte blocks in 16-aligned rows: qs runs are 16-byte aligned
    const uint4* q = (const uint4*)((const u8*)b + 16 + 32 * (sub >> 1));
    const int sh = 4 * (sub & 1);
    const uint4 v0 = q[0], v1 = q[1];
    const u32 v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = RAW ? v[i] & (0x0F0F0F0Fu << sh) : (v[i] >> sh) & 0x0F0F0F0Fu;
    u32 sc, m;
    k4_scale_min(b + 4, sub, sc, m);
    r.sc[0] = r.sc[1] = ldh(b) * (float)sc;
    if (RAW && sh) r.sc[0] = r.sc[1] = r.sc[0] * 0.0625f;
    r.mn[0] = r.mn[1] = -(ldh(b + 2) * (float)m);
}
TYPE_TAIL

// Q5_K: half d, half dmin, scales[12], qh[32] (bit `sub` = 5th bit), qs[128].
TYPE_HEAD(13, 256, 176, 0, true) {
    const u8* q = b + 48 + 32 * (sub >> 1);
    const int sh = 4 * (sub & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 hb = (ld32a(b + 16 + 4 * i) >> sub) & 0x01010101;
        r.q[i] = ((ld32a(q + 4 * i) >> sh) & 0x0F0F0F0F) | (hb << 4);
    }
    u32 sc, m;
    k4_scale_min(b + 4, sub, sc, m);
    r.sc[0] = r.sc[1] = ldh(b) * (float)sc;
    r.mn[0] = r.mn[1] = -(ldh(b + 2) * (float)m);
}
TYPE_TAIL

// Q6_K: ql[128], qh[64], int8 scales[16], half d; value d * sc * (code - 32).
TYPE_HEAD(14, 256, 210, -32, false) {
    const int half = sub >> 2, j = sub & 3;
    const u8* ql = b + 64 * half + 32 * (j & 1);
    const u8* qh = b + 128 + 32 * half;
    const int nsh = 4 * (j >> 1), hsh = 2 * j;
    u32 lw[8], hw[8];
    ldwords(ql, lw);
    ldwords(qh, hw);
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = ((lw[i] >> nsh) & 0x0F0F0F0F) | (((hw[i] >> hsh) & 0x03030303) << 4);
    const float d = ldh(b + 208);
    r.sc[0] = d * (float)(i8)ld8(b + 192 + 8 * half + 2 * j);
    r.sc[1] = d * (float)(i8)ld8(b + 192 + 8 * half + 2 * j + 1);
}
TYPE_TAIL

// ---------------------------------------------------------------- IQ types
// tab (shared memory) = the grid's words. Sign masks (uint2: byte j = 0xFF when bit j of the
// sign byte is set) are computed, 3 ops per 4 bytes.
__device__ __forceinline__ uint2 sign_masks(u32 s8) { return make_uint2(sign_mask4(s8 & 15), sign_mask4(s8 >> 4)); }
// Code words k of a chunk from grid word g and its sign mask m: signed now, or (RAW) left as
// g ^ m with the mask in neg for the dot product (saves the add and the mask of apply_signs).
template <bool RAW>
__device__ __forceinline__ void set_signed(Chunk& r, int k, u32 g, u32 m) {
    if (RAW) {
        r.q[k] = g ^ m;
        r.neg[k] = m;
    } else {
        r.q[k] = apply_signs(g, m);
    }
}
template <bool RAW>
__device__ __forceinline__ void signed_pair(Chunk& r, int k, const uint2 g, const uint2 m) {
    set_signed<RAW>(r, k, g.x, m.x);
    set_signed<RAW>(r, k + 1, g.y, m.y);
}
// Sign masks of all 8 words of a chunk from its 32 sign bits s (bit 4k + j: byte j of word k)
// without isolating each word's nibble and widening it by a multiply (28 instructions for 8
// words): a 4 x 4 bit transpose of each 16-bit half (8 instructions) moves bit j of word k to
// bit 4j + (k & 3) (+ 16 for k >= 4), that is into selector nibble j; sign_mask_t then reads
// word k's mask with one prmt whose source bytes (0x00 / 0xFF) only that bit of a nibble
// tells apart, whatever the nibble's other bits (19 instructions for 8 words in all).
__device__ __forceinline__ u32 transpose_sign_nibbles(u32 s) {
    u32 t = (s ^ (s >> 6)) & 0x00CC00CCu;  // index bits 3 <-> 1 (within each 16-bit half)
    s ^= t ^ (t << 6);
    t = (s ^ (s >> 3)) & 0x0A0A0A0Au;  // index bits 2 <-> 0
    return s ^ t ^ (t << 3);
}
// Mask of word k (byte j = 0xFF when its sign bit is set) from transpose_sign_nibbles' word.
// Selector nibble bit 0 decides between bytes 0x00 / 0xFF of 0xFF00FF00, bit 1 of 0xFFFF0000,
// bit 2 between the two sources 0 and ~0; bit 3 (prmt's sign mode) cannot, so words 3 and 7
// take bit 2 after a shift. A byte of 0x00 or 0xFF is its own replicated sign: the other
// nibble bits never matter.
__device__ __forceinline__ u32 sign_mask_t(u32 t, int k) {
    const u32 x = t >> ((k >= 4 ? 16 : 0) + ((k & 3) == 3 ? 1 : 0));
    const int c = (k & 3) == 3 ? 2 : k & 3;
    return c == 0 ? prmt(0xFF00FF00u, 0xFF00FF00u, x) : c == 1 ? prmt(0xFFFF0000u, 0xFFFF0000u, x) : prmt(0u, ~0u, x);
}
// Word i of an IQ3 codebook kept in TSTRIDE interleaved copies, tab at this lane's copy. On the
// device the shared address is formed here (one shift-add per lookup): written as tab[i *
// TSTRIDE], the compiler folds the lane's copy into each index and spends two.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ u32 lds32(u32 shared_address) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(shared_address));
    return v;
}
#endif
template <int TSTRIDE>
__device__ __forceinline__ u32 grid_word(const u32* tab, u32 i) {
#ifdef __CUDA_ARCH__
    if (TSTRIDE > 1) return lds32((u32)__cvta_generic_to_shared(tab) + i * (4u * TSTRIDE));
#endif
    return tab[i * TSTRIDE];
}
// The codebook word of the index in 16-bit half H of x (two indices side by side, formed by one
// prmt). On the device dp2a forms its shared address, index * 4 * TSTRIDE + the table's, on the
// multiply-add pipe: a prmt per index (grid_word) runs on the integer pipe, which LOP3, PRMT and
// SHF keep as busy as the issue slots in IQ3_S (ncu). 4 fewer of those per chunk and
// row: 57344 x 8192 69.2 -> 66.5-66.8 us. (4 * TSTRIDE fits dp2a's byte up to 32.)
template <int TSTRIDE, int H>
__device__ __forceinline__ u32 grid_word_at(const u32* tab, u32 x) {
#ifdef __CUDA_ARCH__
    u32 a;
    asm("dp2a.lo.u32.u32 %0, %1, %2, %3;" : "=r"(a) : "r"(x), "r"((4u * TSTRIDE) << (8 * H)), "r"((u32)__cvta_generic_to_shared(tab)));
    return lds32(a);
#else
    return grid_word<TSTRIDE>(tab, (x >> (16 * H)) & 0xFFFFu);
#endif
}

// IQ2_XXS: half d; per 32 weights two u32: 4 grid indices (bytes); 4 x 7 sign bits + scale.
TYPE_HEAD_TAB(16, 256, 66, 0, false, 2 * 256, GRID_IQ2XXS_W) {
    u32 w[2];
    ldwords(b + 2 + 8 * sub, w);
    const u32 idx = w[0], aux = w[1];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const uint2 g = ((const uint2*)tab)[(idx >> (8 * l)) & 255];
        signed_pair<RAW>(r, 2 * l, g, sign_masks(ksigns((aux >> (7 * l)) & 127)));
    }
    r.sc[0] = r.sc[1] = (ldh(b) * (0.5f + (float)(aux >> 28))) * 0.25f;
}
TYPE_TAIL

// IQ2_XS: half d; u16 qs[32] (9-bit grid index, 7 sign bits); scales[8] (a nibble per 16).
TYPE_HEAD_TAB(17, 256, 74, 0, false, 2 * 512, GRID_IQ2XS_W) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 v = ld16(b + 2 + 2 * (4 * sub + l));
        const uint2 g = ((const uint2*)tab)[v & 511];
        signed_pair<RAW>(r, 2 * l, g, sign_masks(ksigns(v >> 9)));
    }
    const float d = ldh(b);
    const u32 s = ld8(b + 66 + sub);
    r.sc[0] = (d * (0.5f + (float)(s & 15))) * 0.25f;
    r.sc[1] = (d * (0.5f + (float)(s >> 4))) * 0.25f;
}
TYPE_TAIL

// IQ2_S: half d; qs[32] grid index low bytes, signs[32]; qh[8] (2 high bits per index); scales[8].
TYPE_HEAD_TAB(22, 256, 82, 0, false, 2 * 1024, GRID_IQ2S_W) {
    const u32 qh = ld8(b + 66 + sub);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 i = ld8(b + 2 + 4 * sub + l) | ((qh << (8 - 2 * l)) & 0x300);
        const uint2 g = ((const uint2*)tab)[i];
        signed_pair<RAW>(r, 2 * l, g, sign_masks(ld8(b + 34 + 4 * sub + l)));
    }
    const float d = ldh(b);
    const u32 s = ld8(b + 74 + sub);
    r.sc[0] = (d * (0.5f + (float)(s & 15))) * 0.25f;
    r.sc[1] = (d * (0.5f + (float)(s >> 4))) * 0.25f;
}
TYPE_TAIL

// IQ3_XXS: half d; qs[64] grid indices (4-byte codewords); 8 u32 of 4 x 7 sign bits + scale.
TYPE_HEAD_TAB(18, 256, 98, 0, false, 256, GRID_IQ3XXS_W) {
    u32 w[2], au[1];  // 8 grid indices; signs and scale (64 - 4 sub bytes further: same alignment)
    ldwords2(b + 2 + 8 * sub, 64 - 4 * sub, w, au);
    const u32 aux = au[0];
    const u32 q01 = w[0], q23 = w[1];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const uint2 m = sign_masks(ksigns((aux >> (7 * l)) & 127));
        const u32 idx = l < 2 ? q01 : q23;
        set_signed<RAW>(r, 2 * l, grid_word<TSTRIDE>(tab, __byte_perm(idx, 0, 0x4440 + 2 * (l & 1))), m.x);
        set_signed<RAW>(r, 2 * l + 1, grid_word<TSTRIDE>(tab, __byte_perm(idx, 0, 0x4441 + 2 * (l & 1))), m.y);
    }
    r.sc[0] = r.sc[1] = (ldh(b) * (0.5f + (float)(aux >> 28))) * 0.5f;
}
TYPE_TAIL

// IQ3_S: half d; qs[64] index low bytes; qh[8] (9th index bits); signs[32]; scales[4] nibbles.
// Its grid bytes are odd (1..15), so a negated byte -g = ~(g - 1) = g ^ 0xFE: q = g ^ (m & 0xFE
// per byte) signs a word in one instruction, exactly (no raw form needed).
TYPE_HEAD_X(21, 256, 110, 0, false, 512, GRID_IQ3S_W, WEIGHT_ORDER) {
    const u32 qh = ld8(b + 66 + sub);
    u32 w[2], sgn[1];  // index low bytes; 4 sign bytes (72 - 4 sub bytes further: same alignment)
    ldwords2(b + 2 + 8 * sub, 72 - 4 * sub, w, sgn);
    const u32 st = transpose_sign_nibbles(sgn[0]);
    // The 9th bits as bytes beside the low bytes (byte n of hi[h] = bit 4h + n of qh): one
    // prmt then forms two whole 9-bit indices as 16-bit halves, [low byte n, its 9th bit, low
    // byte n + 1, its 9th bit], and grid_word_at takes each to its address (S10: shifting and
    // masking qh per index took 4 instructions;: a prmt per index, 2).
    const u32 hi[2] = {spread4(qh & 15), spread4(qh >> 4)};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 idx = w[l >> 1], h = hi[l >> 1], n = 2 * (l & 1);
        // indices n and n + 1 as 16-bit halves: [low byte, its 9th bit] each
        const u32 x = prmt(idx, h, n | ((4 + n) << 4) | ((n + 1) << 8) | ((5 + n) << 12));
        r.q[2 * l] = grid_word_at<TSTRIDE, 0>(tab, x) ^ (sign_mask_t(st, 2 * l) & 0xFEFEFEFEu);
        r.q[2 * l + 1] = grid_word_at<TSTRIDE, 1>(tab, x) ^ (sign_mask_t(st, 2 * l + 1) & 0xFEFEFEFEu);
    }
    const u32 s = (ld8(b + 106 + (sub >> 1)) >> (4 * (sub & 1))) & 15;
    r.sc[0] = r.sc[1] = ldh(b) * (float)(1 + 2 * (int)s);
}
TYPE_TAIL

// IQ1 grids hold 8 * g + 16 per byte (g in -1..1); +-1 for the delta keeps every byte in
// 7..25, so one word add/subtract is exact; IOFF -16 and scale / 8 give dl * (g +- 1/8).
// (16 KB: read through L1 rather than copied to shared memory beside the row tiles.)
__device__ __forceinline__ void iq1_group(const u32* tab, u32 index, bool neg, int& a, int& c) {
    const uint2 g = __ldg(&GRID_IQ1S[index]);
    const u32 delta = 0x01010101u;
    a = neg ? g.x - delta : g.x + delta;
    c = neg ? g.y - delta : g.y + delta;
}

// IQ1_S: half d; qs[32] index low bytes; u16 qh[8]: 4 x 3 index bits, 3-bit scale, delta sign.
TYPE_HEAD(19, 256, 50, -16, false) {
    const u32 qh = ld16(b + 34 + 2 * sub);
    const bool neg = (qh & 0x8000) != 0;
#pragma unroll
    for (int l = 0; l < 4; ++l)
        iq1_group(tab, ld8(b + 2 + 4 * sub + l) | (((qh >> (3 * l)) & 7) << 8), neg, r.q[2 * l], r.q[2 * l + 1]);
    r.sc[0] = r.sc[1] = (ldh(b) * (float)(2 * ((qh >> 12) & 7) + 1)) * 0.125f;
}
TYPE_TAIL

// IQ1_M: qs[32]; qh[16] (per 8 weights: 3 index bits + delta sign); scales[8] as u16[4]:
// 3-bit scales per 16 weights, and the f16 super-scale in their top nibbles.
TYPE_HEAD(29, 256, 56, -16, false) {
    const u32 s0 = ld16(b + 48), s1 = ld16(b + 50), s2 = ld16(b + 52), s3 = ld16(b + 54);
    const float d = h2f((u16)((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000)));
    const u32 qh0 = ld8(b + 32 + 2 * sub), qh1 = ld8(b + 33 + 2 * sub);
    const u8* qs = b + 4 * sub;
    iq1_group(tab, ld8(qs + 0) | ((qh0 << 8) & 0x700), (qh0 & 0x08) != 0, r.q[0], r.q[1]);
    iq1_group(tab, ld8(qs + 1) | ((qh0 << 4) & 0x700), (qh0 & 0x80) != 0, r.q[2], r.q[3]);
    iq1_group(tab, ld8(qs + 2) | ((qh1 << 8) & 0x700), (qh1 & 0x08) != 0, r.q[4], r.q[5]);
    iq1_group(tab, ld8(qs + 3) | ((qh1 << 4) & 0x700), (qh1 & 0x80) != 0, r.q[6], r.q[7]);
    const u32 sc = ld16(b + 48 + 2 * (sub >> 1)) >> (6 * (sub & 1));
    r.sc[0] = (d * (float)(2 * (sc & 7) + 1)) * 0.125f;
    r.sc[1] = (d * (float)(2 * ((sc >> 3) & 7) + 1)) * 0.125f;
}
TYPE_TAIL

// IQ4_XS: half d; u16 scales_h; scales_l[4]; qs[128] (16 bytes per 32 weights). PAIR_ORDER.
TYPE_HEAD_X(23, 256, 136, 0, false, 4, KV_IQ4NL_W, PAIR_ORDER) {
    const u8* q = b + 8 + 16 * sub;
    const u32 t0 = tab[0], t1 = tab[1], t2 = tab[2], t3 = tab[3];
#pragma unroll
    for (int i = 0; i < 4; ++i) lut16_pairs(ld32a(q + 4 * i), t0, t1, t2, t3, r.q[2 * i], r.q[2 * i + 1]);
    const u32 ls = ((ld8(b + 4 + (sub >> 1)) >> (4 * (sub & 1))) & 15) | (((ld16(b + 2) >> (2 * sub)) & 3) << 4);
    r.sc[0] = r.sc[1] = ldh(b) * (float)((int)ls - 32);
}
TYPE_TAIL

// Types whose chunk has one scale (and one min) for all 32 weights (decode sets sc[0] == sc[1],
// mn[0] == mn[1]): their dot product runs the 8 dp4a as one integer sum and converts and
// scales it once (chunk_acc in mmvq_kernels.cuh). Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K IQ2_XXS IQ3_XXS IQ1_S IQ4_NL
// IQ3_S IQ4_XS TQ1_0 TQ2_0 MXFP4 Q1_0 Q2_0; not Q2_K Q3_K Q6_K IQ2_XS IQ2_S IQ1_M NVFP4 (a scale
// per 16 weights).
template <int ID> struct OneScale {
    static constexpr bool YES = ID == 2 || ID == 3 || ID == 6 || ID == 7 || ID == 8 || ID == 12 || ID == 13 ||
                                ID == 16 || ID == 18 || ID == 19 || ID == 20 || ID == 21 || ID == 23 || ID == 34 ||
                                ID == 35 || ID == 39 || ID == 41 || ID == 42;
};
