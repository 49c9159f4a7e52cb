// Fused element-wise and attention kernels for the CUDA backend: one launch per op instead of
// the 5-20 small CuPy launches of the generic array code (decode is launch-bound, not
// bandwidth-bound: a 135M model's layer moves ~1 MB).
//
// Compiled WITHOUT --use_fast_math and with explicit _rn intrinsics where the generic CuPy code
// does separate multiplies and adds, so rope and swiglu give the same bits as the generic path
// (no FMA contraction); rms_norm and attention differ only by summation order.
//
// Programmatic dependent launch (pdl.cuh, prepended by fused.py; launch.py): in a captured
// graph these kernels start while the kernel before them runs. Each calls wait_prior_grids()
// before it reads anything an earlier kernel writes, then allow_dependents() (the next kernel
// may start: a mat-vec fetches its first weight tiles; allowed before the wait, launched-early
// kernels cascaded and held SM slots). What no kernel writes (norm weights, the window and
// cache tables, cache rows older than the window) a few read before the wait, where its latency
// hides behind the kernel before. No pointer here is __restrict__ and no load goes
// through the read-only path (__ldg): what an earlier kernel writes is not read-only for the
// lifetime of a kernel started early, and restrict-qualified loads may be hoisted above the
// wait.

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h INFINITY

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide reductions (blockDim.x a multiple of 32). Every thread gets the result. The
// leading barrier lets the scratch be reused by consecutive calls.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < nw ? scratch[lane] : 0.f);
}

__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < nw ? scratch[lane] : NEG_INF);
}

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w   (one block per row, rows contiguous)
extern "C" __global__ void rms_norm_f32(const float* x, const float* w,
                                        float* y, int n, float eps) {
    wait_prior_grids();
    allow_dependents();
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i];
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    const float denom = __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)n), eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = __fmul_rn(__fdiv_rn(xr[i], denom), w[i]);
}

// Rotary embedding of the first `dim` features of each head; features past dim are copied.
// x (n_tok, n_head, hd) with element strides tok_stride / head_stride (last dim contiguous);
// y contiguous (n_tok, n_head, hd). Angles in float64 as the generic path computes them:
// pos / scale * base^(-2i/dim), cos/sin in float64 rounded to float32.
extern "C" __global__ void rope_f32(const float* x, float* y,
                                    const long long* pos, int n_tok, int n_head, int hd,
                                    int dim, long long tok_stride, long long head_stride, double base,
                                    double scale, int neox) {
    wait_prior_grids();
    allow_dependents();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_tok * n_head * hd) return;
    const int e = (int)(idx % hd);
    const long long th = idx / hd;
    const int h = (int)(th % n_head);
    const int t = (int)(th / n_head);
    const float* xr = x + t * tok_stride + h * head_stride;
    float out;
    if (e >= dim) {
        out = xr[e];
    } else {
        const int half = dim / 2;
        int i;
        bool first;
        float a, b;
        if (neox) {  // pairs (i, i + half)
            first = e < half;
            i = first ? e : e - half;
            a = xr[i];
            b = xr[i + half];
        } else {  // pairs (2i, 2i + 1)
            first = (e & 1) == 0;
            i = e >> 1;
            a = xr[2 * i];
            b = xr[2 * i + 1];
        }
        const double inv = pow(base, (-(double)i * 2.0) / (double)dim);
        const double ang = ((double)pos[t] / scale) * inv;
        const float c = (float)cos(ang), s = (float)sin(ang);
        out = first ? __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)) : __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
    y[idx] = out;
}

// y (rows, cols) = g / (1 + exp(-g)) * u, g and u with row strides gs / us (elements).
extern "C" __global__ void swiglu_f32(const float* g, const float* u,
                                      float* y, int rows, int cols, long long gs, long long us) {
    wait_prior_grids();
    allow_dependents();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * cols) return;
    const long long r = idx / cols, c = idx % cols;
    const float gv = g[r * gs + c], uv = u[r * us + c];
    y[idx] = __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv))), uv);
}

// Causal attention of t queries over one sequence's cache, one block per (head, query).
// q (t, n_head, d) contiguous; k, v (n_kv, L, d) contiguous float32; qpos (t,) absolute
// positions (key j is masked when j > qpos); out (t, n_head * d). Query head h reads kv head
// h / (n_head / n_kv) (GQA). Dynamic shared memory: (L + 32 + blockDim.x) floats.
extern "C" __global__ void attention_f32(const float* q, const float* k,
                                         const float* v, const long long* qpos,
                                         float* out, int n_head, int n_kv, int L, int d,
                                         float scale) {
    wait_prior_grids();
    allow_dependents();
    extern __shared__ float sm[];
    float* sc = sm;              // L scores, then probabilities
    float* scratch = sm + L;     // 32 floats for reductions
    float* partial = scratch + 32;  // blockDim.x partial output sums
    const int h = blockIdx.x, t = blockIdx.y;
    const int kvh = h / (n_head / n_kv);
    const float* qr = q + ((long long)t * n_head + h) * d;
    const float* kb = k + (long long)kvh * L * d;
    const float* vb = v + (long long)kvh * L * d;
    const long long p = qpos[t];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;

    // scores: one warp per key, lanes over the head dimension (coalesced rows of k)
    for (int j = warp; j < L; j += nw) {
        const float* kr = kb + (long long)j * d;
        float acc = 0.f;
        for (int i = lane; i < d; i += 32) acc = fmaf(qr[i], kr[i], acc);
        acc = warp_sum(acc);
        if (lane == 0) sc[j] = ((long long)j > p) ? NEG_INF : __fmul_rn(acc, scale);
    }
    __syncthreads();
    float m = NEG_INF;
    for (int j = threadIdx.x; j < L; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, scratch);
    float s = 0.f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        const float e = expf(__fsub_rn(sc[j], m));
        sc[j] = e;
        s += e;
    }
    s = block_sum(s, scratch);  // its barriers also publish the sc writes above
    for (int j = threadIdx.x; j < L; j += blockDim.x) sc[j] = __fdiv_rn(sc[j], s);
    __syncthreads();

    // out = p @ v: `parts` groups of d threads split the keys, then one sum per dimension
    float* orow = out + ((long long)t * n_head + h) * d;
    const int parts = blockDim.x / d;
    if (parts >= 2) {
        const int dim = threadIdx.x % d, part = threadIdx.x / d;
        float acc = 0.f;
        if (part < parts)
            for (int j = part; j < L; j += parts) acc = fmaf(sc[j], vb[(long long)j * d + dim], acc);
        partial[threadIdx.x] = acc;
        __syncthreads();
        if (threadIdx.x < d) {
            float r = 0.f;
            for (int pp = 0; pp < parts; ++pp) r += partial[pp * d + threadIdx.x];
            orow[threadIdx.x] = r;
        }
    } else {
        for (int dim = threadIdx.x; dim < d; dim += blockDim.x) {
            float acc = 0.f;
            for (int j = 0; j < L; ++j) acc = fmaf(sc[j], vb[(long long)j * d + dim], acc);
            orow[dim] = acc;
        }
    }
}

// ================================================================ decode-window kernels
// Kernels that read everything a window changes (positions, which cache a token belongs to,
// cache lengths and addresses) from one int64 device array, the window table, so that one
// captured CUDA graph serves every window of the same shape (FACTS.md: per-step scalars go
// through device buffers, not kernel arguments).
//
// Window table `win` for n tokens in S spans:
//   win[t]            position of token t               (t < n)
//   win[n + t]        span of token t
//   win[2n + 3s + 0]  first position the window writes in span s
//   win[2n + 3s + 1]  end: positions [0, end) hold keys once the window's keys are written
//   win[2n + 3s + 2]  address of the span's cache table (int64):
//                       tab[0] = capacity (positions per head row);
//                       tab[1 + 4 * layer + {0,1,2,3}] = addresses of k, v (n_kv, cap, d)
//                       f16 or int8, and of the int8 scales ks, vs (n_kv, cap) float32.

typedef signed char i8;
typedef unsigned short u16;
typedef long long i64;

__device__ __forceinline__ u16 f2h_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// One warp quantizes 32 consecutive values (lane = value) to a Q8_1 block, exactly as
// quantize_q8_1 in mmvq_kernels.cuh: d = amax / 127, q = round(v / d), packed 16-value sums.
__device__ __forceinline__ void quant_block32(float v, int blk, i8* q8, int* meta, float* s_out) {
    const int lane = threadIdx.x & 31;
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    const float d = __fdiv_rn(amax, 127.0f);
    const int q = d == 0.0f ? 0 : (int)roundf(__fdiv_rn(v, d));
    int lo = lane < 16 ? q : 0, hi = lane < 16 ? 0 : q;
    for (int o = 16; o > 0; o >>= 1) {
        lo += __shfl_xor_sync(FULL_MASK, lo, o);
        hi += __shfl_xor_sync(FULL_MASK, hi, o);
    }
    q8[(size_t)blk * 32 + lane] = (i8)q;
    if (lane == 0) {
        meta[2 * (size_t)blk] = __float_as_int(d);
        meta[2 * (size_t)blk + 1] = (lo & 0xFFFF) | (hi << 16);
        s_out[blk] = __fmul_rn(d, (float)(lo + hi));
    }
}

// x_out = x + y (y may be null: no add), h = rms_norm(x_out) * w, and h quantized to Q8_1
// blocks (q8 may be null; n must then be anything, else a multiple of 32). One block per row,
// up to one warp per 32-block (latency, not bandwidth, limits a decode row). Thread t holds
// values t, t + blockDim, ... (at most PER: fused.py picks the instance, n <= PER * blockDim)
// in registers from the loads to the quantization, so the row is read once, every load of it
// in flight at once; the norm weights (no earlier kernel writes them) are read before the wait,
// behind the previous kernel. Each value meets the same operations in the same order as when
// the row was re-read per phase (same bits), and block b's 32 values are warp b % warps' lanes.
// Registers grow with PER: an instance only as large as the row needs, since a block launched
// early (PDL) holds its registers while it waits.
template <int PER>
__global__ void add_rms_norm_q8(const float* x, const float* y, const float* w, float* x_out, float* h, int n,
                                float eps, i8* q8, int* meta, float* s_out) {
    __shared__ float scratch[32];
    const int t = threadIdx.x, nt = blockDim.x;
    float wv[PER], v[PER];
#pragma unroll
    for (int it = 0; it < PER; ++it) wv[it] = t + it * nt < n ? w[t + it * nt] : 0.f;
    wait_prior_grids();
    allow_dependents();
    const size_t row = blockIdx.x;
    const float* xr = x + row * n;
    const float* yr = y ? y + row * n : nullptr;
#pragma unroll
    for (int it = 0; it < PER; ++it) {
        const int i = t + it * nt;
        if (i < n) v[it] = yr ? __fadd_rn(xr[i], yr[i]) : xr[i];
    }
    float ss = 0.f;
#pragma unroll
    for (int it = 0; it < PER; ++it) {
        const int i = t + it * nt;
        if (i < n) {
            if (yr) x_out[row * n + i] = v[it];
            ss = fmaf(v[it], v[it], ss);
        }
    }
    ss = block_sum(ss, scratch);
    const float denom = __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)n), eps));
    const int nb = n / 32;
#pragma unroll
    for (int it = 0; it < PER; ++it) {
        const int i = t + it * nt;
        if (i < n) {  // uniform per warp when q8 is given (n and blockDim multiples of 32)
            const float hv = __fmul_rn(__fdiv_rn(v[it], denom), wv[it]);
            h[row * n + i] = hv;
            if (q8) quant_block32(hv, (int)(row * nb + (i >> 5)), q8, meta, s_out);
        }
    }
}

// swiglu_f32 plus the Q8_1 blocks of its output (cols a multiple of 32): one warp per block.
extern "C" __global__ void swiglu_q8(const float* g, const float* u,
                                     float* y, int rows, int cols, long long gs, long long us,
                                     i8* q8, int* meta, float* s_out) {
    wait_prior_grids();
    allow_dependents();
    const long long blk = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (blk >= (long long)rows * cols / 32) return;
    const long long idx = blk * 32 + (threadIdx.x & 31);
    const long long r = idx / cols, c = idx % cols;
    const float gv = g[r * gs + c], uv = u[r * us + c];
    const float v = __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv))), uv);
    y[idx] = v;
    quant_block32(v, (int)blk, q8, meta, s_out);
}

// Element e of a head row xr after RoPE, with cos/sin of pair i in c[i], s[i]; rope_f32's
// formula, same bits.
__device__ __forceinline__ float rope_elem(const float* xr, int e, int dim, int neox, const float* c,
                                           const float* s) {
    if (e >= dim) return xr[e];
    const int half = dim / 2;
    int i;
    bool first;
    float a, b;
    if (neox) {
        first = e < half;
        i = first ? e : e - half;
        a = xr[i];
        b = xr[i + half];
    } else {
        first = (e & 1) == 0;
        i = e >> 1;
        a = xr[2 * i];
        b = xr[2 * i + 1];
    }
    return first ? __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i])) : __fadd_rn(__fmul_rn(a, s[i]), __fmul_rn(b, c[i]));
}

#define KV_MAX_PER_LANE 8  // head_dim <= 256

#define ROPE_WARPS 4  // head rows per rope_kv_write block

// (qwen3) q_norm / k_norm: per-head RMSNorm weights applied before RoPE (null: none). The warp
// works out denom in rms_norm_f32's order and each value as rms_norm_f32 does, x / denom * w,
// so the normed row has rms_norm_f32's bits for head_dim <= 128.
// RoPE of q and k, and k, v appended to the caches. Grid (n tokens, ceil(heads / ROPE_WARPS))
// over the n_head query heads, then the n_kv key heads, then the n_kv value heads; one warp
// per head row. A warp that rotates works out the dim / 2 cos/sin pairs of its token's
// position itself (float64, as rope_f32: pos / scale * base^(-2i/dim), rounded to float32;
// one or two pairs per lane), so no block-wide barrier and no serial pass over heads keeps
// the latency of a decode step up. q/k/v rows are given with element strides per token and
// per head (views into the qkv output). q_out (n, n_head, d) contiguous. int8 caches: one
// scale per (head, position), amax / 127, q = rint(v / scale) clipped to +-127
// (strata.model.kv_cache's math).
extern "C" __global__ void __launch_bounds__(32 * ROPE_WARPS) rope_kv_write(const float* q, long long q_ts, long long q_hs,
                                         const float* k, long long k_ts, long long k_hs,
                                         const float* v, long long v_ts, long long v_hs,
                                         float* q_out, const long long* win,
                                         int n, int n_head, int n_kv, int d, int layer, int int8_cache,
                                         int dim, double base, double scale, int neox,
                                         const float* q_norm, const float* k_norm,
                                         float eps) {
    __shared__ float cs_all[ROPE_WARPS][KV_MAX_PER_LANE * 16], sn_all[ROPE_WARPS][KV_MAX_PER_LANE * 16];
    __shared__ float row_all[ROPE_WARPS][KV_MAX_PER_LANE * 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x;
    const int hh = blockIdx.y * ROPE_WARPS + warp;
    const bool is_q = hh < n_head, is_k = !is_q && hh < n_head + n_kv, live = hh < n_head + 2 * n_kv;
    const int h = is_q ? hh : is_k ? hh - n_head : hh - n_head - n_kv;
    // Before the wait, what no kernel writes: the window table and the cache table (host-written
    // for the whole graph), and the float64 cos/sin of the position. Under PDL they are ready when
    // the q/k/v rows (the projection's output, read after the wait) arrive.
    const long long pos = win[t];
    const long long* tab = is_q || !live ? nullptr : (const long long*)win[2 * n + 3 * win[n + t] + 2];
    const long long cap = tab ? tab[0] : 0;
    const int which = is_k ? 0 : 1;
    void* dst_base = tab ? (void*)tab[1 + 4 * layer + which] : nullptr;
    float* dst_scale = tab && int8_cache ? (float*)tab[1 + 4 * layer + 2 + which] : nullptr;
    float* cs = cs_all[warp];
    float* sn = sn_all[warp];
    // the head's norm weights too (qwen3; constant): after the wait they would be one more
    // dependent HBM read between the row's arrival and its rotation
    const float* nw = !live ? nullptr : is_q ? q_norm : is_k ? k_norm : nullptr;
    float wv[KV_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < KV_MAX_PER_LANE; ++j) wv[j] = nw && lane + 32 * j < d ? nw[lane + 32 * j] : 0.f;
    if (live && (is_q || is_k)) {  // q and k rows rotate
        for (int i = lane; i < dim / 2; i += 32) {
            const double inv = pow(base, (-(double)i * 2.0) / (double)dim);
            const double ang = ((double)pos / scale) * inv;
            cs[i] = (float)cos(ang);
            sn[i] = (float)sin(ang);
        }
    }
    wait_prior_grids();
    allow_dependents();
    if (!live) return;
    const float* x = is_q ? q + t * q_ts + h * q_hs : is_k ? k + t * k_ts + h * k_hs : v + t * v_ts + h * v_hs;
    float raw[KV_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < KV_MAX_PER_LANE; ++j) raw[j] = lane + 32 * j < d ? x[lane + 32 * j] : 0.f;
    // the row (normed: rms_norm(row) * w, each element once) through shared memory: RoPE
    // pairs elements across lanes
    float* xs = row_all[warp];
    if (nw) {  // head_denom's order: lane sums its elements, then the warp
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < KV_MAX_PER_LANE; ++j)
            if (lane + 32 * j < d) ss = fmaf(raw[j], raw[j], ss);
        ss = warp_sum(ss);
        const float denom = __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)d), eps));
#pragma unroll
        for (int j = 0; j < KV_MAX_PER_LANE; ++j) raw[j] = __fmul_rn(__fdiv_rn(raw[j], denom), wv[j]);
    }
#pragma unroll
    for (int j = 0; j < KV_MAX_PER_LANE; ++j)
        if (lane + 32 * j < d) xs[lane + 32 * j] = raw[j];
    __syncwarp();
    if (is_q) {
        float* o = q_out + ((size_t)t * n_head + h) * d;
        for (int e = lane; e < d; e += 32) o[e] = rope_elem(xs, e, dim, neox, cs, sn);
        return;
    }
    const size_t at = ((size_t)h * cap + pos) * d;
    float vals[KV_MAX_PER_LANE];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < KV_MAX_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        vals[j] = 0.f;
        if (e < d) vals[j] = is_k ? rope_elem(xs, e, dim, neox, cs, sn) : raw[j];
        amax = fmaxf(amax, fabsf(vals[j]));
    }
    if (!int8_cache) {
        u16* dst = (u16*)dst_base + at;
#pragma unroll
        for (int j = 0; j < KV_MAX_PER_LANE; ++j)
            if (lane + 32 * j < d) dst[lane + 32 * j] = f2h_rn(vals[j]);
        return;
    }
    amax = warp_max(amax);
    const float sc = amax > 0.f ? __fdiv_rn(amax, 127.0f) : 1.0f;
    i8* dst = (i8*)dst_base + at;
#pragma unroll
    for (int j = 0; j < KV_MAX_PER_LANE; ++j)
        if (lane + 32 * j < d) dst[lane + 32 * j] = (i8)fminf(127.f, fmaxf(-127.f, rintf(__fdiv_rn(vals[j], sc))));
    if (lane == 0) dst_scale[(size_t)h * cap + pos] = sc;
}

#define ATT_CHUNK 256  // keys per chunk: one thread block scores a chunk, one key per thread
#define ATT_THREADS 256
#define ATT_VEC 8  // cache elements a thread loads at once: 16 bytes of f16, 8 of int8
#define ATT_LOADS 8  // loads a thread keeps in flight (16 cost 228 registers and measured no faster)

// Eight consecutive elements of a cache row (f16 or int8 times the row's scale) as float32,
// in one 16- or 8-byte load (d % 8 == 0, so every row start is aligned).
template <bool INT8> struct KV8;
template <> struct KV8<false> {
    uint4 r;
    __device__ __forceinline__ void load(const void* base, const float*, size_t row, int d, int e0) {
        r = *(const uint4*)((const u16*)base + row * d + e0);
    }
    __device__ __forceinline__ void unpack(float* f) const {
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = h2f((u16)(w[i] & 0xFFFFu));
            f[2 * i + 1] = h2f((u16)(w[i] >> 16));
        }
    }
};
template <> struct KV8<true> {
    uint2 r;
    float s;
    __device__ __forceinline__ void load(const void* base, const float* scales, size_t row, int d, int e0) {
        r = *(const uint2*)((const i8*)base + row * d + e0);
        s = scales[row];
    }
    __device__ __forceinline__ void unpack(float* f) const {
        const unsigned w[2] = {r.x, r.y};
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = (float)(i8)((w[i >> 2] >> (8 * (i & 3))) & 0xFF) * s;
    }
};

// Causal attention of each window token over its span's cache, straight from the f16 or int8
// storage. Grid (n_head / hpb, n, splits); block ATT_THREADS; a block takes hpb query heads
// of one KV group (GMAX >= hpb; hpb = 1 for decode). Block z takes the key chunks z,
// z + splits, ... of [0, pos + 1) with an online softmax. With one split it writes the
// normalised output; else it writes (m, l, acc[d]) partials, and the last block of its
// (token, heads) to finish (a counter in `counters`, reset by that block) merges them, in split
// order, as attention_kv_merge does (counters null: the host launches attention_kv_merge).
// Decode is latency-bound, so each phase is one round of independent loads: thread j scores
// key j of the chunk over the whole head (16-byte loads); for p @ v, d / 8 threads cover a
// row, 8 elements each, and the 256 / (d / 8) row groups sum their keys 8 loads at a time,
// then add up through shared memory in group order. The order of every sum depends only on
// the chunk, never on the grid, so results are batch-invariant.
// Several heads per block (prefill: many tokens) share each K and V load; every head's sums
// are the same operations in the same order as with one head per block, so the two give the
// same bits and the host may pick either per window.
template <bool INT8, int GMAX>
__device__ __forceinline__ void attention_kv_impl(const float* q, const long long* win,
                                                  int n, int n_head, int n_kv, int d, int layer, float scale,
                                                  float* out, float* partials,
                                                  int* counters, i8* q8,
                                                  int* meta, float* s_out, int hpb) {
    __shared__ float sc[GMAX][ATT_CHUNK];
    __shared__ float qs[GMAX][KV_MAX_PER_LANE * 32];
    __shared__ float scratch[32];
    __shared__ float red[ATT_THREADS * ATT_VEC];
    __shared__ int last;
    const int G = GMAX == 1 ? 1 : hpb;
    const int h0 = blockIdx.x * G, t = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const int kvh = h0 / (n_head / n_kv);
    // Before the wait, what no kernel of this graph writes: the window and cache tables, and
    // the cache rows older than this window's first (written by earlier windows), asked into L2
    // so the loads after the wait do not go to HBM (a token's weights stream through L2 between
    // two visits of a layer's cache). The rows this window writes come from the kernel before.
    const long long span = win[n + t];
    const long long pos = win[t], first = win[2 * n + 3 * span];
    const long long* tab = (const long long*)win[2 * n + 3 * span + 2];
    const long long cap = tab[0];
    const void* K = (const void*)tab[1 + 4 * layer + 0];
    const void* V = (const void*)tab[1 + 4 * layer + 1];
    const float* KS = (const float*)tab[1 + 4 * layer + 2];  // null for f16 caches (never read)
    const float* VS = (const float*)tab[1 + 4 * layer + 3];
    const size_t row0 = (size_t)kvh * cap;
    const long long L = pos + 1;
    {
        // only the block's first chunk: up to 16k keys a block has one (splits_for), and large
        // bulk requests from one SM lost elsewhere; longer caches were not measured
        const int esize = INT8 ? 1 : 2;
        const long long j0 = (long long)z * ATT_CHUNK;
        if (j0 < min(L, first)) {
            const long long nk = min((long long)ATT_CHUNK, min(L, first) - j0);
            prefetch_l2_block((const char*)K + (row0 + j0) * d * esize, (unsigned long long)nk * d * esize);
            prefetch_l2_block((const char*)V + (row0 + j0) * d * esize, (unsigned long long)nk * d * esize);
            if (INT8) {
                prefetch_l2_block(KS + row0 + j0, (unsigned long long)nk * 4);
                prefetch_l2_block(VS + row0 + j0, (unsigned long long)nk * 4);
            }
        }
    }
    wait_prior_grids();
    allow_dependents();
    const size_t o0 = ((size_t)t * n_head + h0) * d;  // head h0 + g's output starts at o0 + g * d
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
        if (g < G)
            for (int e = threadIdx.x; e < d; e += blockDim.x) qs[g][e] = q[o0 + (size_t)g * d + e];
    // p @ v layout: group grp of row threads (tpr of them, 8 elements each) takes keys grp,
    // grp + groups, ... of a chunk
    const int tpr = d / ATT_VEC, groups = ATT_THREADS / tpr;
    const int grp = threadIdx.x / tpr, e0 = (threadIdx.x % tpr) * ATT_VEC;
    const bool active = grp < groups;
    float acc[GMAX][ATT_VEC], m[GMAX], l[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < ATT_VEC; ++i) acc[g][i] = 0.f;
    }
    __syncthreads();  // qs
    for (long long j0 = (long long)z * ATT_CHUNK; j0 < L; j0 += (long long)splits * ATT_CHUNK) {
        const int nk = (int)min((long long)ATT_CHUNK, L - j0);
        // scores: thread j takes key j0 + j, 8 row pieces in flight at a time
        float a[GMAX];
#pragma unroll
        for (int g = 0; g < GMAX; ++g) a[g] = 0.f;
        if ((int)threadIdx.x < nk) {
            const size_t row = row0 + j0 + threadIdx.x;
            for (int b0 = 0; b0 < d; b0 += ATT_LOADS * ATT_VEC) {
                KV8<INT8> kv[ATT_LOADS];
#pragma unroll
                for (int u = 0; u < ATT_LOADS; ++u)
                    if (b0 + u * ATT_VEC < d) kv[u].load(K, KS, row, d, b0 + u * ATT_VEC);
#pragma unroll
                for (int u = 0; u < ATT_LOADS; ++u) {
                    if (b0 + u * ATT_VEC < d) {
                        float f[ATT_VEC];
                        kv[u].unpack(f);
#pragma unroll
                        for (int g = 0; g < GMAX; ++g)
                            if (g < G)
#pragma unroll
                                for (int i = 0; i < ATT_VEC; ++i) a[g] = fmaf(qs[g][b0 + u * ATT_VEC + i], f[i], a[g]);
                    }
                }
            }
        }
        float corr[GMAX];
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g < G) {
                const float s = (int)threadIdx.x < nk ? __fmul_rn(a[g], scale) : NEG_INF;
                const float cm = block_max(s, scratch);
                const float mn = fmaxf(m[g], cm);
                corr[g] = expf(m[g] - mn);  // 0 on the first chunk (m = -inf)
                const float e = (int)threadIdx.x < nk ? expf(__fsub_rn(s, mn)) : 0.f;
                sc[g][threadIdx.x] = e;
                const float ps = block_sum(e, scratch);  // its barriers publish sc
                l[g] = l[g] * corr[g] + ps;
                m[g] = mn;
#pragma unroll
                for (int i = 0; i < ATT_VEC; ++i) acc[g][i] *= corr[g];
            }
        }
        if (active) {
            for (int jb = grp; jb < nk; jb += ATT_LOADS * groups) {
                KV8<INT8> kv[ATT_LOADS];
#pragma unroll
                for (int u = 0; u < ATT_LOADS; ++u)
                    if (jb + u * groups < nk) kv[u].load(V, VS, row0 + j0 + jb + u * groups, d, e0);
#pragma unroll
                for (int u = 0; u < ATT_LOADS; ++u) {
                    if (jb + u * groups < nk) {
                        float f[ATT_VEC];
                        kv[u].unpack(f);
#pragma unroll
                        for (int g = 0; g < GMAX; ++g) {
                            if (g < G) {
                                const float p = sc[g][jb + u * groups];
#pragma unroll
                                for (int i = 0; i < ATT_VEC; ++i) acc[g][i] = fmaf(p, f[i], acc[g][i]);
                            }
                        }
                    }
                }
            }
        }
        __syncthreads();  // sc is rewritten by the next chunk
    }
    // per head: sum the groups of each dimension, in group order
    float r0[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        r0[g] = 0.f;
        if (g < G) {
            if (active) {
#pragma unroll
                for (int i = 0; i < ATT_VEC; ++i) red[grp * d + e0 + i] = acc[g][i];
            }
            __syncthreads();
            if ((int)threadIdx.x < d)
                for (int gg = 0; gg < groups; ++gg) r0[g] += red[gg * d + threadIdx.x];
            __syncthreads();  // red is rewritten for the next head
        }
    }
    if (splits == 1) {
        if ((int)threadIdx.x < d) {
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                if (g < G) {
                    const size_t o = o0 + (size_t)g * d;
                    const float val = __fdiv_rn(r0[g], l[g]);
                    out[o + threadIdx.x] = val;
                    // the Q8_1 blocks of the output for the projection that follows (d % 32 == 0:
                    // whole warps, blocks inside one head)
                    if (q8) quant_block32(val, (int)((o + threadIdx.x) >> 5), q8, meta, s_out);
                }
            }
        }
        return;
    }
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (g < G) {
            float* pr = partials + (((size_t)t * n_head + h0 + g) * splits + z) * (d + 2);
            if ((int)threadIdx.x < d) pr[2 + threadIdx.x] = r0[g];
            if (threadIdx.x == 0) {
                pr[0] = m[g];
                pr[1] = l[g];
            }
        }
    }
    if (!counters) return;
    __threadfence();  // partials visible device-wide before the count says so
    __syncthreads();
    if (threadIdx.x == 0) {
        int* c = counters + (size_t)t * n_head + h0;  // the blocks of (t, h0) hold all G heads
        last = atomicAdd(c, 1) == splits - 1;
        if (last) *c = 0;  // ready for the next launch (graph replays included)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (g < G) {
            const float* pb = partials + ((size_t)t * n_head + h0 + g) * splits * (d + 2);
            float M = NEG_INF;
            for (int zz = 0; zz < splits; ++zz) M = fmaxf(M, __ldcg(pb + zz * (d + 2)));
            float Lsum = 0.f;
            for (int zz = 0; zz < splits; ++zz) {
                const float mz = __ldcg(pb + zz * (d + 2));
                if (mz != NEG_INF) Lsum += __ldcg(pb + zz * (d + 2) + 1) * expf(mz - M);
            }
            if ((int)threadIdx.x < d) {
                float acc_d = 0.f;
                for (int zz = 0; zz < splits; ++zz) {
                    const float mz = __ldcg(pb + zz * (d + 2));
                    if (mz != NEG_INF) acc_d += __ldcg(pb + zz * (d + 2) + 2 + threadIdx.x) * expf(mz - M);
                }
                const size_t o = o0 + (size_t)g * d;
                const float val = __fdiv_rn(acc_d, Lsum);
                out[o + threadIdx.x] = val;
                if (q8) quant_block32(val, (int)((o + threadIdx.x) >> 5), q8, meta, s_out);
            }
        }
    }
}

#define ATT_GQA_MAX 8  // query heads per block of the *_gqa kernels (fused.py: ATT_GQA_MAX)
#define ATTENTION_KV(NAME, INT8, GMAX)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                            \
        NAME(const float* q, const long long* win, int n, int n_head, int n_kv, \
             int d, int layer, float scale, float* out, float* partials,      \
             int* counters, i8* q8, int* meta,                     \
             float* s_out, int hpb) {                                                           \
        attention_kv_impl<INT8, GMAX>(q, win, n, n_head, n_kv, d, layer, scale, out, partials, counters, \
                                      q8, meta, s_out, hpb);                                             \
    }
ATTENTION_KV(attention_kv_f16, false, 1)
ATTENTION_KV(attention_kv_i8, true, 1)
ATTENTION_KV(attention_kv_gqa_f16, false, ATT_GQA_MAX)
ATTENTION_KV(attention_kv_gqa_i8, true, ATT_GQA_MAX)

// Combine attention_kv's split partials (when it had no counters): grid (n_head, n), block 128.
extern "C" __global__ void attention_kv_merge(const float* part, int n_head, int d, int splits,
                                              float* out, i8* q8, int* meta,
                                              float* s_out) {
    wait_prior_grids();
    allow_dependents();
    const int h = blockIdx.x, t = blockIdx.y;
    const float* pr = part + ((size_t)t * n_head + h) * splits * (d + 2);
    float M = NEG_INF;
    for (int z = 0; z < splits; ++z) M = fmaxf(M, pr[z * (d + 2)]);
    float L = 0.f;
    for (int z = 0; z < splits; ++z) {
        const float mz = pr[z * (d + 2)];
        if (mz != NEG_INF) L += pr[z * (d + 2) + 1] * expf(mz - M);
    }
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float a = 0.f;
        for (int z = 0; z < splits; ++z) {
            const float mz = pr[z * (d + 2)];
            if (mz != NEG_INF) a += pr[z * (d + 2) + 2 + e] * expf(mz - M);
        }
        const size_t o = ((size_t)t * n_head + h) * d + e;
        const float val = __fdiv_rn(a, L);
        out[o] = val;
        if (q8) quant_block32(val, (int)(o >> 5), q8, meta, s_out);  // d % 32 == 0: whole warps
    }
}

// MoE routing, one warp per token: softmax over n_expert logits, the k most probable experts
// (ties: lower id), their probabilities, renormalised when norm != 0. k <= 32, n_expert <= 1024.
// Each lane keeps the probabilities of experts lane, lane + 32, ... in registers (PER of them),
// so the k rounds of selection are warp arg-maxes with no memory traffic.
template <int PER>
__device__ __forceinline__ void moe_route_impl(const float* lr, int n_expert, int k, int norm,
                                               int* ids, float* wout) {
    const int lane = threadIdx.x & 31;
    float mx = NEG_INF;
#pragma unroll
    for (int m = 0; m < PER; ++m)
        if (lane + 32 * m < n_expert) mx = fmaxf(mx, lr[lane + 32 * m]);
    mx = warp_max(mx);
    float ex[PER];
    float s = 0.f;
    // the sum runs over i = lane, lane + 32, ... like the reference loop
#pragma unroll
    for (int m = 0; m < PER; ++m) {
        ex[m] = lane + 32 * m < n_expert ? expf(__fsub_rn(lr[lane + 32 * m], mx)) : 0.f;
        if (lane + 32 * m < n_expert) s += ex[m];
    }
    s = warp_sum(s);
    float p[PER];
#pragma unroll
    for (int m = 0; m < PER; ++m) p[m] = __fdiv_rn(ex[m], s);
    unsigned taken = 0u;  // bit m: expert lane + 32 m chosen
    float wsum = 0.f, mine = 0.f;
    for (int j = 0; j < k; ++j) {
        float best = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int m = 0; m < PER; ++m) {
            const int i = lane + 32 * m;
            if (i < n_expert && !(taken & (1u << m)) && (p[m] > best || (p[m] == best && i < bi))) {
                best = p[m];
                bi = i;
            }
        }
        // warp arg-max in two sm_80 reductions: probabilities are >= 0, so their bit patterns
        // order like the values; a lane with no candidate offers 0 with no id
        const unsigned key = bi != 0x7fffffff ? __float_as_uint(best) : 0u;
        const unsigned top = __reduce_max_sync(FULL_MASK, key);
        bi = (int)__reduce_min_sync(FULL_MASK, key == top ? (unsigned)bi : 0x7fffffffu);
        best = __uint_as_float(top);
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
        if (lane == j) {
            ids[j] = bi;
            mine = best;
        }
        wsum += best;
    }
    if (lane < k) wout[lane] = norm ? __fdiv_rn(mine, wsum) : mine;
}

extern "C" __global__ void moe_route(const float* logits, int n_expert, int k, int norm,
                                     int* ids, float* wout) {
    wait_prior_grids();
    allow_dependents();
    const size_t t = blockIdx.x;
    if (n_expert <= 256)
        moe_route_impl<8>(logits + t * n_expert, n_expert, k, norm, ids + t * k, wout + t * k);
    else
        moe_route_impl<32>(logits + t * n_expert, n_expert, k, norm, ids + t * k, wout + t * k);
}

// y (n, e) = sum over j of d (n, k, e) * w (n, k), j ascending.
extern "C" __global__ void moe_combine(const float* dd, const float* w, int n, int k,
                                       int e, float* y) {
    wait_prior_grids();
    allow_dependents();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * e) return;
    const long long t = idx / e, c = idx % e;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(dd[(t * k + j) * e + c], w[t * k + j]));
    y[idx] = acc;
}
