// Sampling on the device: one thread block per logits row draws the token that
// strata.sampling would draw on the host from the same uniform u (temperature, then top-k,
// top-p and min-p, then the inverse CDF in token-id order), so a sampled decode step copies
// one id to the host instead of a vocabulary of floats, and no host code walks the vocabulary.
//
// Everything is float64 like the host code. Sums run in another order than numpy's, so the
// token can differ from the host's only where u, top_p or min_p falls within rounding
// (~1e-15 relative) of a cumulative boundary.
//
// Filters work on orderable 32-bit keys of the float32 logits: z = logit / T is monotonic in
// the logit, so "the k largest z" and "the most probable tokens first" are orders of keys
// (ties: lower token id first, as numpy's stable sorts). A radix select over the key's four
// bytes finds the k-th largest key (top-k: counts) and the key where the sorted cumulative
// mass reaches top_p (top-p: masses), one pass over the row per byte.

#define SAMPLE_THREADS 1024
#define CAND_LOG_W (-8.0)  // candidates: w >= exp(-8), the tokens within 8 temperatures of the best
#define NEG_INF_F __int_as_float(0xff800000)

typedef unsigned int u32;

__device__ __forceinline__ u32 key_of(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block-wide sum and exclusive scan, for SAMPLE_THREADS threads. Each begins with a barrier
// so its scratch may be reused by the next call.
template <class T>
__device__ T block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    T r = lane < (int)(blockDim.x >> 5) ? scratch[lane] : (T)0;
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    return r;
}

// Exclusive prefix sum over threads in thread order (thread 0 gets 0), and the total.
template <class T>
__device__ T block_exclusive_scan(T v, T* scratch, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    T inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        T w = lane < nw ? scratch[lane] : (T)0;
        for (int o = 1; o < 32; o <<= 1) {
            const T n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        if (lane < nw) scratch[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    *total = scratch[nw - 1];
    return (warp ? scratch[warp - 1] : (T)0) + inc - v;
}

// A row's largest logit, its first index (np.argmax; NaN ignored) and sum(exp(z - max)), for
// the greedy token, sampling's maximum and a draft's confidence (1 / sum). Each thread walks
// float4s strided by the block (coalesced) in ascending order, keeping its largest value (the
// first on ties) and a running sum of exp(z - its max), rescaled when the max grows; the block
// merges the (max, index, sum) triples. (CuPy's argmax and max/sum reductions took ~60 us each
// on a (2, 49152) logits pair: one small block per row and long serial loops.)
struct TopAcc {
    float m, s;
    int i;
};

__device__ __forceinline__ void top_take(TopAcc& a, float v, int i) {
    if (v > a.m) {
        a.s = (a.m == NEG_INF_F ? 0.0f : a.s * expf(a.m - v)) + 1.0f;
        a.m = v;
        a.i = i;
    } else if (v != NEG_INF_F) {
        a.s += expf(v - a.m);  // v == m adds 1; NaN makes the sum NaN (the argmax ignores it)
    }
}

__device__ __forceinline__ TopAcc top_merge(TopAcc a, TopAcc b) {
    const float m = fmaxf(a.m, b.m);
    TopAcc r;
    r.m = m;
    r.s = (a.m == NEG_INF_F ? 0.0f : a.s * expf(a.m - m)) + (b.m == NEG_INF_F ? 0.0f : b.s * expf(b.m - m));
    r.i = (b.m > a.m || (b.m == a.m && b.i < a.i)) ? b.i : a.i;
    return r;
}

__device__ __forceinline__ TopAcc top_shfl(TopAcc a) {
    for (int o = 16; o > 0; o >>= 1) {
        TopAcc b;
        b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
        b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
        b.i = __shfl_xor_sync(0xffffffffu, a.i, o);
        a = top_merge(a, b);
    }
    return a;
}

// The whole block's triple for row l of V logits, returned to every thread (index 0 for a row
// of NaN / -inf only, as numpy). scr: 32 entries of shared memory.
__device__ TopAcc block_top(const float* __restrict__ l, int V, TopAcc* scr) {
    TopAcc a = {NEG_INF_F, 0.0f, 0x7fffffff};
    if ((V & 3) == 0 && ((size_t)l & 15) == 0) {
        const float4* l4 = reinterpret_cast<const float4*>(l);
#pragma unroll 4
        for (int j = threadIdx.x; j < (V >> 2); j += blockDim.x) {
            const float4 v = __ldg(l4 + j);
            top_take(a, v.x, 4 * j);
            top_take(a, v.y, 4 * j + 1);
            top_take(a, v.z, 4 * j + 2);
            top_take(a, v.w, 4 * j + 3);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) top_take(a, __ldg(l + j), j);
    }
    a = top_shfl(a);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // scr may still be read from an earlier call
    if (lane == 0) scr[warp] = a;
    __syncthreads();
    if (warp == 0) {
        const TopAcc none = {NEG_INF_F, 0.0f, 0x7fffffff};
        a = top_shfl(lane < (int)(blockDim.x >> 5) ? scr[lane] : none);
        if (lane == 0) {
            if (a.i == 0x7fffffff) a.i = 0;
            scr[0] = a;
        }
    }
    __syncthreads();
    return scr[0];
}

// params per row (float64): temperature, top_k, top_p, min_p, u. Greedy (temperature <= 0 or
// top_k == 1): the argmax. out: int64 token per row.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(const float* __restrict__ logits, int V,
                                                                        const double* __restrict__ params,
                                                                        long long* __restrict__ out) {
    __shared__ double dscr[32];
    __shared__ unsigned uscr[32];
    __shared__ TopAcc tscr[32];
    __shared__ double hist_m[256];
    __shared__ unsigned hist_c[256];
    __shared__ u32 s_digit;
    __shared__ double s_above;
    __shared__ unsigned s_left;
    __shared__ int s_cut_index;
    const int row = blockIdx.x;
    const float* l = logits + (size_t)row * V;
    const double* pr = params + (size_t)row * 5;
    const double temp = pr[0], top_p = pr[2], min_p = pr[3], u = pr[4];
    const long long top_k = (long long)pr[1];
    // thread t owns the contiguous ids [c0, c1): scans run in token-id order
    const int per = (V + blockDim.x - 1) / blockDim.x;
    const int c0 = min(V, (int)threadIdx.x * per), c1 = min(V, c0 + per);
    const TopAcc best = block_top(l, V, tscr);
    const float lmax = best.m;
    const int imax = best.i;
    if (temp <= 0.0 || top_k == 1) {
        if (threadIdx.x == 0) out[row] = imax;
        return;
    }
    // Candidates: tokens with w = exp(z - max z) >= CAND_W. A radix pass over all V tokens
    // piles most of them onto a few histogram bins (shared-memory atomics serialise), so when
    // the candidates alone hold the k largest (top-k) or reach the top-p mass, the passes look
    // at candidates only: the same answer, since every token above the cut is a candidate.
    const double zmax = (double)lmax / temp;
    const u32 ckey = key_of((float)((zmax + CAND_LOG_W) * temp));
    unsigned ncand = 0u;
    for (int i = c0; i < c1; ++i) ncand += key_of(l[i]) >= ckey;
    ncand = block_sum<unsigned>(ncand, uscr);
    // ---- top-k: the k-th largest key (elements with a smaller key are dropped)
    u32 kmin = 0u;
    if (top_k > 0 && top_k < V) {
        const u32 floor_key = ncand >= (unsigned)top_k ? ckey : 0u;
        u32 prefix = 0u, mask = 0u;
        unsigned left = (unsigned)top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) hist_c[b] = 0u;
            __syncthreads();
            for (int i = c0; i < c1; ++i) {
                const u32 k = key_of(l[i]);
                if (k >= floor_key && (k & mask) == prefix) atomicAdd(&hist_c[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned cum = 0u;
                int d = 255;
                for (; d > 0; --d) {
                    if (cum + hist_c[d] >= left) break;
                    cum += hist_c[d];
                }
                s_digit = (u32)d;
                s_left = left - cum;
            }
            __syncthreads();
            prefix |= s_digit << shift;
            mask |= 255u << shift;
            left = s_left;
        }
        kmin = prefix;
    }
    // ---- unnormalised probabilities w = exp(z - max z) of the tokens top-k keeps
    double part = 0.0, part_c = 0.0;
    for (int i = c0; i < c1; ++i) {
        const float v = l[i];
        const u32 k = key_of(v);
        if (k >= kmin) {
            const double w = exp((double)v / temp - zmax);
            part += w;
            if (k >= ckey) part_c += w;
        }
    }
    const double S = block_sum<double>(part, dscr);
    const double S_cand = block_sum<double>(part_c, dscr);
    // ---- top-p: the key where the mass of the most probable tokens reaches top_p * S; among
    // tokens with exactly that key, the first ones by id until the mass is reached
    u32 pkey = kmin;  // tokens with key > pkey are kept, key == pkey up to id cut_index
    int cut_index = 0x7fffffff;
    if (top_p < 1.0) {
        const double M = top_p * S;
        const u32 floor_key = S_cand >= M ? max(ckey, kmin) : kmin;
        u32 prefix = 0u, mask = 0u;
        double above = 0.0;  // mass of tokens whose key is above the current prefix range
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) hist_m[b] = 0.0;
            __syncthreads();
            for (int i = c0; i < c1; ++i) {
                const float v = l[i];
                const u32 k = key_of(v);
                if (k >= floor_key && (k & mask) == prefix) atomicAdd(&hist_m[(k >> shift) & 255u], exp((double)v / temp - zmax));
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                double cum = above;
                int d = 255;
                for (; d > 0; --d) {
                    if (cum + hist_m[d] >= M) break;
                    cum += hist_m[d];
                }
                s_digit = (u32)d;
                s_above = cum;
            }
            __syncthreads();
            prefix |= s_digit << shift;
            mask |= 255u << shift;
            above = s_above;
        }
        pkey = prefix;
        // tokens with key == pkey all have the same w: the host's cumsum keeps the first m
        // of them (by id), m the fewest that reach M
        const double w_eq = exp((double)__uint_as_float((pkey & 0x80000000u) ? (pkey & 0x7fffffffu) : ~pkey) / temp - zmax);
        unsigned mine = 0u;
        for (int i = c0; i < c1; ++i) mine += key_of(l[i]) == pkey;
        unsigned total;
        const unsigned before = block_exclusive_scan<unsigned>(mine, uscr, &total);
        double need = ceil((M - above) / w_eq);
        const unsigned m = (unsigned)fmin(fmax(need, 1.0), (double)total);
        if (threadIdx.x == 0) s_cut_index = 0x7fffffff;
        __syncthreads();
        if (before < m && before + mine >= m) {  // this thread holds the m-th equal token
            unsigned seen = before;
            for (int i = c0; i < c1; ++i)
                if (key_of(l[i]) == pkey && ++seen == m) { s_cut_index = i; break; }
        }
        __syncthreads();
        cut_index = s_cut_index;
    }
    // ---- min-p (w >= min_p * max w, max w = 1), then the inverse CDF in id order
    auto kept_w = [&](int i) -> double {
        const float v = l[i];
        const u32 k = key_of(v);
        if (k < pkey || (k == pkey && i > cut_index)) return 0.0;
        const double w = exp((double)v / temp - zmax);
        return w >= min_p ? w : 0.0;
    };
    double mass = 0.0;
    for (int i = c0; i < c1; ++i) mass += kept_w(i);
    double W;
    const double before = block_exclusive_scan<double>(mass, dscr, &W);
    const double target = u * W;
    if (threadIdx.x == 0) s_cut_index = -1;
    __syncthreads();
    if (mass > 0.0 && before <= target && target < before + mass) {
        double run = before;
        int pick = -1;
        for (int i = c0; i < c1; ++i) {
            const double w = kept_w(i);
            if (w <= 0.0) continue;
            pick = i;
            run += w;
            if (run > target) break;
        }
        s_cut_index = pick;
    }
    __syncthreads();
    if (threadIdx.x == 0) out[row] = s_cut_index >= 0 ? s_cut_index : imax;  // rounding past the end: the argmax
}

// Per row: the first argmax and its softmax probability 1 / sum(exp(z - max)): the greedy token
// and the draft's confidence, a few bytes for the host. One 1024-thread block per row.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) top_rows(const float* __restrict__ logits, int V,
                                                                     long long* __restrict__ ids,
                                                                     float* __restrict__ top) {
    __shared__ TopAcc scr[32];
    const TopAcc t = block_top(logits + (size_t)blockIdx.x * V, V, scr);
    if (threadIdx.x == 0) {
        ids[blockIdx.x] = t.i;
        top[blockIdx.x] = 1.0f / t.s;
    }
}
