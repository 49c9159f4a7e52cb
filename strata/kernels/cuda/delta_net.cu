// Gated DeltaNet on the device (strata/kernels/cuda/delta_net.py): the causal conv and the gated
// delta rule of every sequence of a window in one launch each, reading and writing the recurrent
// state pool in place (no host round trip, no per-token launch).
//
// The pool holds, per recurrent layer, copies of the state; a sequence owns two (the state at the
// window's start and the one the window writes) or, without a rollback copy, one that the window
// updates in place (strata/model/recurrent_state.py):
//   conv  [layer][copy][K-1][C]        the last K-1 conv inputs, oldest first
//   state [layer][copy][H][dk][dv]     the delta rule's matrix, dv fastest
// The window table has one row of TABLE_COLS int64 per sequence: the copy read, the copy written
// (the same copy in place), first row, row count, replay row (-1: none). It is read on the device
// only, so a CUDA graph of a window replays for any copies.
// In place is safe because each thread reads every state element it writes, and only those, into
// registers before the first write (conv: channel c's K-1 taps; delta: column j of its head).

#define MAX_CONV 8
#define TABLE_COLS 5

extern "C" __global__ void causal_conv(const float* __restrict__ x, long long x_stride,
                                       const float* __restrict__ w, int C, int K,
                                       float* __restrict__ pool, long long copies, int layer,
                                       const long long* __restrict__ table, float* __restrict__ y) {
    const int s = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const long long* row_s = table + TABLE_COLS * s;
    const int read = (int)row_s[0], write = (int)row_s[1], r0 = (int)row_s[2], cnt = (int)row_s[3];
    const size_t per_copy = (size_t)(K - 1) * C;
    const float* st_in = pool + ((size_t)layer * copies + read) * per_copy;
    float* st_out = pool + ((size_t)layer * copies + write) * per_copy;
    float buf[MAX_CONV], wk[MAX_CONV];
    for (int j = 0; j < K - 1; ++j) buf[j] = st_in[(size_t)j * C + c];
    for (int j = 0; j < K; ++j) wk[j] = w[(size_t)c * K + j];
    for (int t = 0; t < cnt; ++t) {
        const long long row = r0 + t;
        const float xt = x[row * x_stride + c];
        float acc = xt * wk[K - 1];
        for (int j = 0; j < K - 1; ++j) acc += buf[j] * wk[j];
        for (int j = 0; j + 1 < K - 1; ++j) buf[j] = buf[j + 1];
        buf[K - 2] = xt;
        if (y) y[row * C + c] = acc / (1.0f + expf(-acc));
    }
    for (int j = 0; j < K - 1; ++j) st_out[(size_t)j * C + c] = buf[j];
}

// The rows of a window's input projection that a rollback inside it replays, kept in the pool:
// replay [layer][replay row][R][W], for each sequence with a replay row and at most R rows (a
// decode window).
extern "C" __global__ void keep_rows(const float* __restrict__ proj, long long P, int W,
                                     float* __restrict__ replay, long long rows, int R, int layer,
                                     const long long* __restrict__ table) {
    const int s = blockIdx.y, t = blockIdx.z;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const long long* row_s = table + TABLE_COLS * s;
    const int r0 = (int)row_s[2], cnt = (int)row_s[3], kept = (int)row_s[4];
    if (c >= W || kept < 0 || cnt > R || t >= cnt) return;
    replay[(((size_t)layer * rows + kept) * R + t) * W + c] = proj[(long long)(r0 + t) * P + c];
}

// sum over the block's S threads (S a multiple of 32, at most 1024)
template <int S>
__device__ float block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    constexpr int W = S / 32;
    if (W == 1) return v;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < W; ++i) t += red[i];
    return t;
}

// One block per (value head, sequence), one thread per value feature j: the thread keeps column j
// of the head's state (dk values) in registers across the sequence's tokens. Per token: q and k of
// the head's key head are l2-normed (block sums), beta = sigmoid(b), g = softplus(a + dt) * A;
//   S *= e^g;  d = beta (v - S^T k);  S += k d^T;  o = S^T q / sqrt(dk)
// and, with out given, the gated norm rms(o) * norm_w * silu(z) is written for the output projection.
template <int S>
__device__ void gated_delta(const float* __restrict__ y, int C, int Kd,
                            const float* __restrict__ proj, long long P,
                            const long long* __restrict__ beta_cols, const long long* __restrict__ alpha_cols,
                            const float* __restrict__ dt, const float* __restrict__ A,
                            const long long* __restrict__ key_head, const float* __restrict__ norm_w, float eps,
                            float* __restrict__ pool, long long copies, int layer, int H,
                            const long long* __restrict__ table, float* __restrict__ out) {
    const int h = blockIdx.x, s = blockIdx.y, j = threadIdx.x;
    const long long* row_s = table + TABLE_COLS * s;
    const int read = (int)row_s[0], write = (int)row_s[1], r0 = (int)row_s[2], cnt = (int)row_s[3];
    const size_t per_copy = (size_t)H * S * S;
    const float* st_in = pool + ((size_t)layer * copies + read) * per_copy + (size_t)h * S * S;
    float* st_out = pool + ((size_t)layer * copies + write) * per_copy + (size_t)h * S * S;
    __shared__ float qs[S], ks[S], red[32];
    float st[S];
#pragma unroll
    for (int i = 0; i < S; ++i) st[i] = st_in[(size_t)i * S + j];
    const int kh = (int)key_head[h];
    const float q_scale = rsqrtf((float)S);
    const float dth = dt[h], Ah = A[h];
    const long long bc = beta_cols[h], ac = alpha_cols[h];
    for (int t = 0; t < cnt; ++t) {
        const long long row = r0 + t;
        const float* yr = y + row * C;
        const float qv = yr[kh * S + j], kv = yr[Kd + kh * S + j];
        const float sq = block_sum<S>(qv * qv, red);
        const float sk = block_sum<S>(kv * kv, red);
        __syncthreads();  // the last token's qs/ks are read by every thread before they change
        qs[j] = qv * rsqrtf(sq + eps) * q_scale;
        ks[j] = kv * rsqrtf(sk + eps);
        __syncthreads();
        const float* pr = proj + row * P;
        const float beta = 1.0f / (1.0f + expf(-pr[bc]));
        const float xa = pr[ac] + dth;
        const float decay = expf((xa > 20.0f ? xa : log1pf(expf(xa))) * Ah);
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < S; ++i) { st[i] *= decay; acc += st[i] * ks[i]; }
        const float d = beta * (yr[2 * Kd + h * S + j] - acc);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < S; ++i) { st[i] += ks[i] * d; o += st[i] * qs[i]; }
        if (out) {
            const float ss = block_sum<S>(o * o, red);
            const float z = pr[C + h * S + j];
            out[row * H * S + h * S + j] = o * rsqrtf(ss / S + eps) * norm_w[j] * (z / (1.0f + expf(-z)));
        }
    }
#pragma unroll
    for (int i = 0; i < S; ++i) st_out[(size_t)i * S + j] = st[i];
}

#define GATED_DELTA(S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(S) gated_delta_##S(                                     \
        const float* y, int C, int Kd, const float* proj, long long P, const long long* beta_cols,       \
        const long long* alpha_cols, const float* dt, const float* A, const long long* key_head,          \
        const float* norm_w, float eps, float* pool, long long copies, int layer, int H, const long long* table, \
        float* out) {                                                                                    \
        gated_delta<S>(y, C, Kd, proj, P, beta_cols, alpha_cols, dt, A, key_head, norm_w, eps, pool,     \
                       copies, layer, H, table, out);                                                    \
    }
GATED_DELTA(32)
GATED_DELTA(64)
GATED_DELTA(128)
GATED_DELTA(256)
