// Fused element-wise and attention kernels for the CUDA backend: one launch per op instead of
// the 5-20 small CuPy launches of the generic array code (decode is launch-bound, not
// bandwidth-bound: a 135M model's layer moves ~1 MB).
//
// Compiled WITHOUT --use_fast_math and with explicit _rn intrinsics where the generic CuPy code
// does separate multiplies and adds, so rope and swiglu give the same bits as the generic path
// (no FMA contraction); rms_norm and attention differ only by summation order.

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
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int n, float eps) {
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
extern "C" __global__ void rope_f32(const float* __restrict__ x, float* __restrict__ y,
                                    const long long* __restrict__ pos, int n_tok, int n_head, int hd,
                                    int dim, long long tok_stride, long long head_stride, double base,
                                    double scale, int neox) {
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
extern "C" __global__ void swiglu_f32(const float* __restrict__ g, const float* __restrict__ u,
                                      float* __restrict__ y, int rows, int cols, long long gs, long long us) {
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
extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, const long long* __restrict__ qpos,
                                         float* __restrict__ out, int n_head, int n_kv, int L, int d,
                                         float scale) {
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
