/*
dev/groupnorm.cu: GroupNorm(32 groups, eps 1e-5) over NHWC with the optional fused SiLU, forward and backward, as
train_unet.cu runs it, checked against a CPU oracle (double), PyTorch fixtures (dev/fixtures/unet_layer_groupnorm.bin,
unet_layer_groupnorm_silu.bin, dev/unet_layers.py; the oracle against them runs in CI) and timed.

  make -C dev groupnorm && ./dev/groupnorm --test     # oracle vs PyTorch; GPU vs PyTorch and the oracle at
                                                       # awkward sizes, poisoned outputs
  ./dev/groupnorm                                      # validate + benchmark both versions, batch 32 and 128

version 1 (train_unet.cu): statistics as per-(sample, channel) partial sums over pixel chunks (double across lanes
and blocks), a grid of finalize warps, then the apply (a thread owns a 16-byte channel vector and walks pixels,
its coefficients in registers); backward: per-(sample, channel) sums of dz and dz*xhat, a finalize giving dgamma,
dbeta and the two group means, then dx by the same pixel walk. Every reduction has a fixed order (deterministic).
version 2 (tried, not promoted): the same arithmetic, a thread owning a channel vector and walking pixels (constants
in registers, several pixels in flight), each finalize run by the last block to finish (per sample, then over
samples): two launches each way; the backward's apply can also produce the channel sums of dx (the bias and
time-embedding gradients of the layer before), checked here. Faster than version 1 alone on the large backward
shapes, slower in the training step (dev/unet_NOTES.md, "Channel kernels, version 2").
Next: the statistics from the producing convolution's epilogue, the apply in the next convolution's loader.
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"  // counters, checks, PyTorch fixtures

// ---------------------------------------------------------------------------------------------------------------
// version 2 (tried 2026-11-26, slower in the training step: dev/unet_NOTES.md): a thread owns a channel vector and
// walks pixels; each reduction's finalize runs in the last block to finish (per sample, then over samples); the
// backward apply can also produce the channel sums of dx (the bias and time-embedding gradients of the layer before)
namespace v2 {
// version 2's workspaces beyond train_unet's: per-sample sums, Bq + 1 zeroed counters
struct Extra {
    double2* pb = nullptr;
    size_t pb_items = 0;
    unsigned* count = nullptr;
    int count_n = 0;
};
static Extra g_extra;
static void extra_alloc(int B) {
    g_extra.pb_items = (size_t)B * 2048;
    cudaCheck(cudaMalloc(&g_extra.pb, g_extra.pb_items * sizeof(double2)));
    g_extra.count_n = B + 1;
    cudaCheck(cudaMalloc(&g_extra.count, g_extra.count_n * sizeof(unsigned)));
    cudaCheck(cudaMemset(g_extra.count, 0, g_extra.count_n * sizeof(unsigned)));
}
static void extra_free() {
    cudaCheck(cudaFree(g_extra.pb));
    cudaCheck(cudaFree(g_extra.count));
    g_extra = Extra();
}

// ---------------------------------------------------------------------------------------------------------------
// Channel kernels: GroupNorm and the bias / time-embedding gradients. A block covers the pixels [p0, p1) of one
// sample (blockIdx.x; chunk blockIdx.y of gridDim.y); a thread owns V consecutive channels (one 16-byte vector) and
// a pixel lane, so its per-channel constants stay in registers and the pixel loop needs no index division. A
// reduction's finalize runs in the last block to finish (per sample, then over samples): one launch, fixed order.
struct ChanLane {
    int b, s, S, p0, p1, lanes, lane, c0;
    bool active;  // threads past lanes * (C / V) idle
};
__device__ __forceinline__ ChanLane chan_lane(int P, int C, int V) {
    ChanLane t;
    t.b = blockIdx.x;
    t.s = blockIdx.y;
    t.S = gridDim.y;
    t.p0 = (int)((long long)P * t.s / t.S);
    t.p1 = (int)((long long)P * (t.s + 1) / t.S);
    const int VC = C / V;
    t.lanes = blockDim.x / VC;
    t.lane = threadIdx.x / VC;
    t.c0 = (threadIdx.x - t.lane * VC) * V;
    t.active = t.lane < t.lanes;
    return t;
}
// CH_UNROLL pixels in flight per thread (2 where a pixel needs two or three loads: registers for 2 blocks per SM)
constexpr int CH_THREADS = 256, CH_UNROLL = 4;

// What the channel kernels read and write; (Bq, S, C) block sums and (Bq, C) per-sample sums in double2.
struct ChanArgs {
    const void *x, *dy;  // activations (Bq, P, C) of type T
    const float *mean, *rstd, *gamma, *beta;
    int P, C, G, silu;
    float eps;
    double2 *partial, *per_sample;
    unsigned* count;    // Bq + 1 counters, zero between launches
    float *mean_out, *rstd_out;  // GroupNorm statistics (Bq, G)
    float2* scale;      // forward apply: (rstd gamma, beta - mean rstd gamma) per (b, c)
    float4* coef;       // backward apply: (rstd gamma, beta, rstd^2 k.y, rstd k.x) per (b, c)
    float *d_gamma, *d_beta;
    float *sum_c, *sum_bc;  // channel sums over (b, p) and per sample (either may be null)
};

// True in the last of n blocks to arrive at *count (reset for the next launch); what the others wrote before
// arriving is visible to it (read it with __ldcg: L1 is not coherent). One fence a block: the barrier orders the
// block's writes before thread 0's fence, which is cumulative.
__device__ bool chan_last_block(unsigned* count, unsigned n) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(count, 1u) == n - 1;
        if (last) *count = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// The block's per-channel sums over its lanes (pairwise, a fixed order) into out[0, C); red: lanes * C double2
template <int V>
__device__ void chan_block_sum(const ChanLane& t, int C, const float (&ax)[V], const float (&ay)[V], double2* red,
                               double2* out) {
    if (t.active)
#pragma unroll
        for (int v = 0; v < V; v++) red[t.lane * C + t.c0 + v] = make_double2((double)ax[v], (double)ay[v]);
    __syncthreads();
    for (int h = 1; h < t.lanes; h *= 2) {
        if (t.active && t.lane % (2 * h) == 0 && t.lane + h < t.lanes)
#pragma unroll
            for (int v = 0; v < V; v++) {
                double2& r = red[t.lane * C + t.c0 + v];
                const double2 o = red[(t.lane + h) * C + t.c0 + v];
                r.x += o.x;
                r.y += o.y;
            }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < C; c += blockDim.x) out[c] = red[c];
}

// For c < C, f(c, sum over rows r < R of src[r * C + c]) (double2, read with __ldcg), in a fixed order: threads
// (c, slice) walk rows slice, slice + slices, ... with several loads in flight; the slices are added in order
// through red (blockDim.x double2). Every thread of the block must call it.
template <typename F>
__device__ void chan_rows_sum(const double2* src, int R, int C, double2* red, F f) {
    if (C > (int)blockDim.x) {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            double2 t = make_double2(0.0, 0.0);
#pragma unroll 8
            for (int r = 0; r < R; r++) {
                const double2 u = __ldcg(&src[(size_t)r * C + c]);
                t.x += u.x;
                t.y += u.y;
            }
            f(c, t);
        }
        __syncthreads();
        return;
    }
    const int slices = blockDim.x / C, c = threadIdx.x % C, sl = threadIdx.x / C;
    if (sl < slices) {
        double2 t = make_double2(0.0, 0.0);
#pragma unroll 4
        for (int r = sl; r < R; r += slices) {
            const double2 u = __ldcg(&src[(size_t)r * C + c]);
            t.x += u.x;
            t.y += u.y;
        }
        red[sl * C + c] = t;
    }
    __syncthreads();
    if (threadIdx.x < C) {
        double2 t = red[c];
        for (int s = 1; s < slices; s++) {
            t.x += red[s * C + c].x;
            t.y += red[s * C + c].y;
        }
        f(c, t);
    }
    __syncthreads();
}

// Sample b's GroupNorm statistics from its S block sums of (x, x^2): per channel, then a thread per group
__device__ void gn_stats_finish(const ChanArgs& a, int b, int S, double2* red, double2* cs) {
    chan_rows_sum(a.partial + (size_t)b * S * a.C, S, a.C, red, [&](int c, double2 t) { cs[c] = t; });
    __shared__ float2 stats[32];  // (mean, rstd) per group
    const int cg = a.C / a.G;
    for (int g = threadIdx.x; g < a.G; g += blockDim.x) {
        double sx = 0.0, sxx = 0.0;
        for (int c = g * cg; c < (g + 1) * cg; c++) {
            sx += cs[c].x;
            sxx += cs[c].y;
        }
        const double n = (double)a.P * cg, mu = sx / n, var = fmax(sxx / n - mu * mu, 0.0);
        stats[g] = make_float2((float)mu, (float)(1.0 / sqrt(var + (double)a.eps)));
        a.mean_out[b * a.G + g] = stats[g].x;
        a.rstd_out[b * a.G + g] = stats[g].y;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < a.C; c += blockDim.x) {
        const float2 st = stats[c / cg];
        const float s = st.y * a.gamma[c];
        a.scale[(size_t)b * a.C + c] = make_float2(s, a.beta[c] - st.x * s);
    }
}

// Sample b's GroupNorm backward coefficients from its block sums of (dz, dz xhat): per group the means
// k = (mean of dxhat, mean of dxhat xhat) with dxhat = dz gamma; its (dbeta, dgamma) share into per_sample
__device__ void gn_bwd_finish(const ChanArgs& a, int b, int S, double2* red, double2* cs) {
    chan_rows_sum(a.partial + (size_t)b * S * a.C, S, a.C, red, [&](int c, double2 t) {
        cs[c] = t;
        a.per_sample[(size_t)b * a.C + c] = t;
    });
    __shared__ float2 k[32];
    const int cg = a.C / a.G;
    for (int g = threadIdx.x; g < a.G; g += blockDim.x) {
        double a1 = 0.0, a2 = 0.0;
        for (int c = g * cg; c < (g + 1) * cg; c++) {
            a1 += (double)a.gamma[c] * cs[c].x;
            a2 += (double)a.gamma[c] * cs[c].y;
        }
        const double n = (double)a.P * cg;
        k[g] = make_float2((float)(a1 / n), (float)(a2 / n));
    }
    __syncthreads();
    for (int c = threadIdx.x; c < a.C; c += blockDim.x) {
        const float2 kg = k[c / cg];
        const float rs = a.rstd[b * a.G + c / cg];
        a.coef[(size_t)b * a.C + c] = make_float4(rs * a.gamma[c], a.beta[c], rs * rs * kg.y, rs * kg.x);
    }
}

// Sample b's channel sums (the .x of its block sums) into sum_bc and per_sample
__device__ void chan_sums_finish(const ChanArgs& a, int b, int S, double2* red) {
    chan_rows_sum(a.partial + (size_t)b * S * a.C, S, a.C, red, [&](int c, double2 t) {
        if (a.sum_bc) a.sum_bc[(size_t)b * a.C + c] = (float)t.x;
        a.per_sample[(size_t)b * a.C + c] = t;
    });
}

// Over the Bq samples' per_sample sums: (dbeta, dgamma) of the GroupNorm backward (MODE 1) or sum_c (MODE 2)
template <int MODE>
__device__ void chan_samples_finish(const ChanArgs& a, int Bq, double2* red) {
    chan_rows_sum(a.per_sample, Bq, a.C, red, [&](int c, double2 t) {
        if (MODE == 1) {
            a.d_beta[c] = (float)t.x;
            a.d_gamma[c] = (float)t.y;
        } else {
            a.sum_c[c] = (float)t.x;
        }
    });
}

// After a block's per-thread sums (ax, ay): the block sums, then the finalize in the last blocks to finish. Shared
// memory: lanes * C double2 (the block sums), then C more (a sample's channel sums).
template <int MODE, int V>
__device__ void chan_reduce_finish(const ChanArgs& a, const ChanLane& t, const float (&ax)[V], const float (&ay)[V]) {
    extern __shared__ double2 red[];
    chan_block_sum<V>(t, a.C, ax, ay, red, a.partial + ((size_t)t.b * t.S + t.s) * a.C);
    if (!chan_last_block(a.count + t.b, t.S)) return;
    double2* cs = red + (size_t)t.lanes * a.C;
    if (MODE == 0) {
        gn_stats_finish(a, t.b, t.S, red, cs);
        return;
    }
    if (MODE == 1) gn_bwd_finish(a, t.b, t.S, red, cs);
    else chan_sums_finish(a, t.b, t.S, red);
    if ((MODE == 1 || a.sum_c) && chan_last_block(a.count + gridDim.x, gridDim.x))
        chan_samples_finish<MODE>(a, gridDim.x, red);
}

// Per-(b, channel) sums over pixels, finalized. MODE 0: (x, x^2) -> GroupNorm statistics and the forward apply's
// scale. MODE 1: GroupNorm backward (dz, dz xhat), dz = dy silu'(z) when silu, z = xhat gamma + beta -> the
// backward apply's coefficients, dgamma, dbeta. MODE 2: (x, 0) -> sum_c, sum_bc.
template <int MODE, typename T, int V>
__global__ void __launch_bounds__(CH_THREADS, 2) chan_reduce_kernel(ChanArgs a) {
    constexpr int U = MODE == 1 ? 2 : CH_UNROLL;
    const ChanLane t = chan_lane(a.P, a.C, V);
    const T* x = (const T*)a.x;
    const T* dy = (const T*)a.dy;
    float ax[V], ay[V], mu[V], rs[V], ga[V], be[V];
#pragma unroll
    for (int v = 0; v < V; v++) {
        ax[v] = ay[v] = 0.f;
        if (MODE == 1 && t.active) {
            const int c = t.c0 + v, bg = t.b * a.G + c / (a.C / a.G);
            mu[v] = a.mean[bg];
            rs[v] = a.rstd[bg];
            ga[v] = a.gamma[c];
            be[v] = a.beta[c];
        }
    }
    const size_t base = (size_t)t.b * a.P * a.C + t.c0;
    for (int p = t.p0 + t.lane; t.active && p < t.p1; p += U * t.lanes) {
        float xv[U][V], dv[U][V];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = p + u * t.lanes;
            if (q < t.p1) {
                vload<T, V>(x + base + (size_t)q * a.C, xv[u]);
                if (MODE == 1) vload<T, V>(dy + base + (size_t)q * a.C, dv[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (p + u * t.lanes >= t.p1) break;
#pragma unroll
            for (int v = 0; v < V; v++) {
                if (MODE == 0) {
                    ax[v] += xv[u][v];
                    ay[v] = fmaf(xv[u][v], xv[u][v], ay[v]);
                } else if (MODE == 1) {
                    const float xh = (xv[u][v] - mu[v]) * rs[v];
                    float d = dv[u][v];
                    if (a.silu) d *= silu_grad(xh * ga[v] + be[v]);
                    ax[v] += d;
                    ay[v] = fmaf(d, xh, ay[v]);
                } else {
                    ax[v] += xv[u][v];
                }
            }
        }
    }
    chan_reduce_finish<MODE, V>(a, t, ax, ay);
}

// The forward apply is train_unet.cu's gn_apply_kernel (the same pixel walk, since session 17)

// dx (+)= rstd (dxhat - k.x - xhat k.y) = coef.x dz - coef.z (x - mean) - coef.w (gn_bwd_finish's coefficients).
// SUMS: also the channel sums of what it writes (the bias and time-embedding gradients of the layer that made x),
// finalized as MODE 2 of chan_reduce_kernel.
template <typename T, int V, bool SUMS>
__global__ void __launch_bounds__(CH_THREADS, 2) gn_bwd_apply_kernel(ChanArgs a, T* __restrict__ dx, int accumulate) {
    constexpr int U = 2;
    const ChanLane t = chan_lane(a.P, a.C, V);
    const T* x = (const T*)a.x;
    const T* dy = (const T*)a.dy;
    float4 q[V];
    float mu[V], ax[V], ay[V];
#pragma unroll
    for (int v = 0; v < V; v++) {
        ax[v] = ay[v] = 0.f;
        if (t.active) {
            const int c = t.c0 + v;
            q[v] = a.coef[(size_t)t.b * a.C + c];
            mu[v] = a.mean[t.b * a.G + c / (a.C / a.G)];
        }
    }
    const size_t base = (size_t)t.b * a.P * a.C + t.c0;
    for (int p = t.p0 + t.lane; t.active && p < t.p1; p += U * t.lanes) {
        float xv[U][V], dv[U][V], ov[U][V];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const size_t i = base + (size_t)(p + u * t.lanes) * a.C;
            if (p + u * t.lanes < t.p1) {
                vload<T, V>(x + i, xv[u]);
                vload<T, V>(dy + i, dv[u]);
                if (accumulate) vload<T, V>(dx + i, ov[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (p + u * t.lanes >= t.p1) break;
#pragma unroll
            for (int v = 0; v < V; v++) {
                const float xc = xv[u][v] - mu[v];
                float d = dv[u][v];
                if (a.silu) d *= silu_grad(fmaf(xc, q[v].x, q[v].y));
                const float g = q[v].x * d - q[v].z * xc - q[v].w;
                if (SUMS) ax[v] += g;
                ov[u][v] = accumulate ? ov[u][v] + g : g;
            }
            vstore<T, V>(dx + base + (size_t)(p + u * t.lanes) * a.C, ov[u]);
        }
    }
    if (SUMS) chan_reduce_finish<2, V>(a, t, ax, ay);
}


// The channel kernels: V channels a thread (chan_vec), shared memory of the reductions
static size_t chan_smem(int C, int V) { return (size_t)(CH_THREADS / (C / V) + 1) * C * sizeof(double2); }
// The launch: Bq samples x S pixel chunks, S filling one wave of resident blocks (a second, partial wave would
// double the time) within at least one and at most 64 pixels per lane (float sums stay short); sets a's workspaces
static dim3 chan_grid(const UNet* m, ChanArgs& a, int Bq, int V, const void* kernel, size_t smem) {
    const int VC = a.C / V;
    if (VC > CH_THREADS || a.G > 32 || smem > 48 * 1024 || (size_t)Bq * a.C > g_extra.pb_items ||
        Bq > g_extra.count_n - 1) {
        fprintf(stderr, "internal error: channel kernel over %d samples x %d channels\n", Bq, a.C);
        exit(EXIT_FAILURE);
    }
    int per_sm = 0;
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, CH_THREADS, smem));
    const int lanes = CH_THREADS / VC, most = ceil_div(a.P, lanes), least = ceil_div(a.P, 64 * lanes);
    int S = std::max(least, std::min(most, std::max(1, per_sm * g_num_sms / Bq)));
    if ((size_t)Bq * S * a.C > m->red_ws_items) {
        fprintf(stderr, "internal error: reduction workspace too small\n");
        exit(EXIT_FAILURE);
    }
    a.partial = m->red_ws;
    a.per_sample = g_extra.pb;
    a.count = g_extra.count;
    return dim3(Bq, S);
}
template <int MODE, typename T>
static void chan_reduce(const UNet* m, ChanArgs a, int Bq) {
    const int V = chan_vec<T>(a.C);
    const size_t smem = chan_smem(a.C, V);
    if (V > 1) {
        auto k = chan_reduce_kernel<MODE, T, VEC<T>>;
        k<<<chan_grid(m, a, Bq, V, (const void*)k, smem), CH_THREADS, smem, g_stream>>>(a);
    } else {
        auto k = chan_reduce_kernel<MODE, T, 1>;
        k<<<chan_grid(m, a, Bq, V, (const void*)k, smem), CH_THREADS, smem, g_stream>>>(a);
    }
    cudaCheck(cudaGetLastError());
}
// sum_c[c] = sum over (b, p) of x (Bq, P, C); sum_bc[b, c] = sum over p (either may be null)
template <typename T>
static void channel_sums(const UNet* m, const T* x, float* sum_c, float* sum_bc, int Bq, int P, int C) {
    ChanArgs a = {};
    a.x = x;
    a.P = P;
    a.C = C;
    a.G = 1;
    a.sum_c = sum_c;
    a.sum_bc = sum_bc;
    chan_reduce<2, T>(m, a, Bq);
}

template <typename T>
static void groupnorm_forward(const UNet* m, const NormP& n, const T* x, T* y, float* mean, float* rstd, int P,
                              int silu) {
    ChanArgs a = {};
    a.x = x;
    a.gamma = m->p + n.w;
    a.beta = m->p + n.b;
    a.P = P;
    a.C = n.C;
    a.G = 32;
    a.eps = 1e-5f;
    a.mean_out = mean;
    a.rstd_out = rstd;
    a.scale = m->gn_scale;
    chan_reduce<0, T>(m, a, m->B);
    const int V = chan_vec<T>(n.C);
    if (V > 1) {
        auto k = ::gn_apply_kernel<T, VEC<T>>;
        k<<<chan_grid(m, a, m->B, V, (const void*)k, 0), CH_THREADS, 0, g_stream>>>(x, y, m->gn_scale, P, n.C, silu);
    } else {
        auto k = ::gn_apply_kernel<T, 1>;
        k<<<chan_grid(m, a, m->B, V, (const void*)k, 0), CH_THREADS, 0, g_stream>>>(x, y, m->gn_scale, P, n.C, silu);
    }
    cudaCheck(cudaGetLastError());
}
// dx (+)= the GroupNorm(+SiLU) backward; bias_grad / emb_grad (optional): the channel sums of what it adds, over
// (b, p) and per sample (the gradients of the bias and time embedding added to x by the layer that made it)
template <typename T>
static void groupnorm_backward(const UNet* m, const NormP& n, const T* x, const T* dy, T* dx, const float* mean,
                               const float* rstd, int P, int silu, bool accumulate, float* bias_grad = nullptr,
                               float* emb_grad = nullptr) {
    ChanArgs a = {};
    a.x = x;
    a.dy = dy;
    a.mean = mean;
    a.rstd = rstd;
    a.gamma = m->p + n.w;
    a.beta = m->p + n.b;
    a.P = P;
    a.C = n.C;
    a.G = 32;
    a.silu = silu;
    a.coef = m->gn_coef;
    a.d_gamma = m->g + n.w;
    a.d_beta = m->g + n.b;
    chan_reduce<1, T>(m, a, m->B);
    a.sum_c = bias_grad;
    a.sum_bc = emb_grad;
    const int V = chan_vec<T>(n.C);
    const bool sums = bias_grad || emb_grad;
    const size_t smem = sums ? chan_smem(n.C, V) : 0;
    auto k = V > 1 ? (sums ? gn_bwd_apply_kernel<T, VEC<T>, true> : gn_bwd_apply_kernel<T, VEC<T>, false>)
                   : (sums ? gn_bwd_apply_kernel<T, 1, true> : gn_bwd_apply_kernel<T, 1, false>);
    k<<<chan_grid(m, a, m->B, V, (const void*)k, smem), CH_THREADS, smem, g_stream>>>(a, dx, accumulate);
    cudaCheck(cudaGetLastError());
}

}  // namespace v2

static void cpu_gn(const float* x, const float* gamma, const float* beta, const float* dy, float* y, float* dx,
                   float* dgamma, float* dbeta, int B, int P, int C, int silu) {
    const int G = 32, cg = C / G;
    for (int c = 0; c < C; c++) dgamma[c] = dbeta[c] = 0.f;
    std::vector<double> dg(C, 0.0), db(C, 0.0);
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) {
            double s = 0, ss = 0, n = (double)P * cg;
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) s += x[((size_t)b * P + p) * C + c];
            double mu = s / n;
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) {
                    double d = x[((size_t)b * P + p) * C + c] - mu;
                    ss += d * d;
                }
            double rs = 1.0 / sqrt(ss / n + 1e-5);
            double m1 = 0, m2 = 0;
            std::vector<double> dz((size_t)P * cg), xh((size_t)P * cg);
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) {
                    size_t i = ((size_t)b * P + p) * C + c, j = (size_t)p * cg + c - g * cg;
                    xh[j] = (x[i] - mu) * rs;
                    double z = xh[j] * gamma[c] + beta[c];
                    double sg = 1.0 / (1.0 + exp(-z));
                    y[i] = (float)(silu ? z * sg : z);
                    dz[j] = dy[i] * (silu ? sg * (1 + z * (1 - sg)) : 1.0);
                    dg[c] += dz[j] * xh[j];
                    db[c] += dz[j];
                    m1 += dz[j] * gamma[c];
                    m2 += dz[j] * gamma[c] * xh[j];
                }
            m1 /= n;
            m2 /= n;
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) {
                    size_t i = ((size_t)b * P + p) * C + c, j = (size_t)p * cg + c - g * cg;
                    dx[i] = (float)(rs * (dz[j] * gamma[c] - m1 - xh[j] * m2));
                }
        }
    for (int c = 0; c < C; c++) {
        dgamma[c] = (float)dg[c];
        dbeta[c] = (float)db[c];
    }
}

// |got - ref| <= rel * (max|ref| + |ref|): fp32 arithmetic on O(1) values with double sums
static void check(const std::string& name, const float* d_got, const float* ref, size_t n, double rel) {
    std::vector<float> got = to_host(d_got, n);
    double scale = 0;
    for (size_t i = 0; i < n; i++) scale = std::max(scale, (double)fabsf(ref[i]));
    check_close(name, got.data(), ref, n, rel * scale, rel);
}

template <typename T>
static void gn_fwd(int version, const UNet* m, const NormP& n, const T* x, T* y, float* mean, float* rstd, int P,
                   int silu) {
    if (version == 2) v2::groupnorm_forward(m, n, x, y, mean, rstd, P, silu);
    else groupnorm_forward(m, n, x, y, mean, rstd, P, silu);
}
template <typename T>
static void gn_bwd(int version, const UNet* m, const NormP& n, const T* x, const T* dy, T* dx, const float* mean,
                   const float* rstd, int P, int silu) {
    if (version == 2) v2::groupnorm_backward(m, n, x, dy, dx, mean, rstd, P, silu, false);
    else groupnorm_backward(m, n, x, dy, dx, mean, rstd, P, silu, false);
}

// forward and backward of one version in bf16 (train_unet's --precision bf16), ms per call
static void bench_bf16(int version, UNet* m, const NormP& n, const float* d_x, const float* d_dy, int P, int silu,
                       float* mean, float* rstd, float ms[2]) {
    const size_t N = (size_t)m->B * P * n.C;
    bf16 *x = nullptr, *dy = nullptr, *y = nullptr, *dx = nullptr;
    bf16** bufs[] = {&x, &dy, &y, &dx};
    for (bf16** b : bufs) cudaCheck(cudaMalloc(b, N * sizeof(bf16)));
    convert_kernel<float, bf16><<<ceil_div(N, EW), EW>>>(d_x, x, N);
    convert_kernel<float, bf16><<<ceil_div(N, EW), EW>>>(d_dy, dy, N);
    cudaCheck(cudaGetLastError());
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 23; i++) {
            if (i == 3) cudaCheck(cudaEventRecord(e0));
            if (pass == 0) gn_fwd(version, m, n, (const bf16*)x, y, mean, rstd, P, silu);
            else gn_bwd(version, m, n, (const bf16*)x, (const bf16*)dy, dx, mean, rstd, P, silu);
        }
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        cudaCheck(cudaEventElapsedTime(&ms[pass], e0, e1));
        ms[pass] /= 20;
    }
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    for (bf16** b : bufs) cudaCheck(cudaFree(*b));
}

static void run_case(int version, int B, int P, int C, int silu, uint64_t seed, bool bench) {
    UNet m;
    m.B = B;
    NormP n;
    n.C = C;
    n.w = 0;
    n.b = C;
    m.n_params = 2 * C;
    m.p = dev_alloc(2 * C);
    m.g = dev_alloc(2 * C);
    unet_alloc_chan(&m, B, C);
    v2::extra_alloc(B);
    size_t N = (size_t)B * P * C;
    std::vector<float> x(N), dy(N), gb(2 * C), y(N), dx(N), dg(C), db(C);
    uint64_t k = 0;
    for (auto& v : x) v = 3.f * rng_uniform(seed, 1, k++) - 1.f;  // mean 0.5: the one-pass variance must cope
    for (auto& v : dy) v = 2.f * rng_uniform(seed, 2, k++) - 1.f;
    for (int c = 0; c < C; c++) {
        gb[c] = 0.5f + rng_uniform(seed, 3, c);
        gb[C + c] = rng_uniform(seed, 4, c) - 0.5f;
    }
    cpu_gn(x.data(), gb.data(), gb.data() + C, dy.data(), y.data(), dx.data(), dg.data(), db.data(), B, P, C, silu);
    float *d_x = dev_alloc(N), *d_y = dev_alloc(N), *d_dy = dev_alloc(N), *d_dx = dev_alloc(N);
    float *mean = dev_alloc(B * 32), *rstd = dev_alloc(B * 32);
    cudaCheck(cudaMemcpy(d_x, x.data(), N * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_dy, dy.data(), N * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(m.p, gb.data(), 2 * C * 4, cudaMemcpyHostToDevice));
    poison(d_y, N);
    poison(d_dx, N);
    poison(m.g, 2 * C);
    gn_fwd(version, &m, n, (const float*)d_x, d_y, mean, rstd, P, silu);
    gn_bwd(version, &m, n, (const float*)d_x, (const float*)d_dy, d_dx, mean, rstd, P, silu);
    char name[96];
    snprintf(name, sizeof name, "v%d B%d P%d C%d silu%d", version, B, P, C, silu);
    // forward/dx: fp32 elementwise math on O(1) values: 1e-5; dgamma/dbeta: sums of B*P*C/32 terms kept in double
    check(std::string(name) + " y", d_y, y.data(), N, 1e-5);
    check(std::string(name) + " dx", d_dx, dx.data(), N, 1e-4);
    check(std::string(name) + " dgamma", m.g, dg.data(), C, 1e-5);
    check(std::string(name) + " dbeta", m.g + C, db.data(), C, 1e-5);
    if (version == 2) {  // accumulating into dx = dy, with the channel sums of what it adds (over (b, p) and per b)
        std::vector<double> sc(C, 0.0), sbc((size_t)B * C, 0.0), abs_c(C, 0.0);
        std::vector<float> acc(N), rc(C), rbc((size_t)B * C);
        for (size_t i = 0; i < N; i++) {
            const int c = (int)(i % C), b = (int)(i / ((size_t)P * C));
            acc[i] = dy[i] + dx[i];
            sc[c] += dx[i];
            sbc[(size_t)b * C + c] += dx[i];
            abs_c[c] += fabs(dx[i]);
        }
        double scale = 0;
        for (int c = 0; c < C; c++) {
            rc[c] = (float)sc[c];
            scale = std::max(scale, abs_c[c]);
        }
        for (size_t i = 0; i < (size_t)B * C; i++) rbc[i] = (float)sbc[i];
        float *d_sc = dev_alloc(C), *d_sbc = dev_alloc((size_t)B * C);
        poison(d_sc, C);
        poison(d_sbc, (size_t)B * C);
        cudaCheck(cudaMemcpy(d_dx, dy.data(), N * 4, cudaMemcpyHostToDevice));
        v2::groupnorm_backward(&m, n, (const float*)d_x, (const float*)d_dy, d_dx, mean, rstd, P, silu, true, d_sc,
                               d_sbc);
        check(std::string(name) + " dx accumulated", d_dx, acc.data(), N, 1e-4);
        // the sums: float lane sums of <= 64 fp32 values of dx (each within 1e-4 of max|dx|) then double
        check_close(std::string(name) + " channel sums of dx", to_host(d_sc, C).data(), rc.data(), C, 1e-5 * scale, 0);
        check_close(std::string(name) + " per-sample channel sums of dx", to_host(d_sbc, (size_t)B * C).data(),
                    rbc.data(), (size_t)B * C, 1e-5 * scale, 0);
        cudaCheck(cudaFree(d_sc));
        cudaCheck(cudaFree(d_sbc));
    }
    if (bench) {
        float ms[2];
        bench_bf16(version, &m, n, d_x, d_dy, P, silu, mean, rstd, ms);
        // bf16 traffic: forward reads x twice and writes y; backward reads x, dy twice and writes dx
        printf("     %s bf16: forward %.4f ms (%.0f GB/s), backward %.4f ms (%.0f GB/s)\n", name, ms[0],
               3.0 * N * 2 / (ms[0] * 1e6), ms[1], 5.0 * N * 2 / (ms[1] * 1e6));
    }
    float* fs[] = {d_x, d_y, d_dy, d_dx, mean, rstd, m.p, m.g};
    for (float* f : fs) cudaCheck(cudaFree(f));
    unet_free_chan(&m);
    v2::extra_free();
}

// ---------------------------------------------------------------------------------------------------------------
// PyTorch fixtures: unet_layer_groupnorm.bin (GroupNorm32(64) on (3, 64, 5, 7)) and unet_layer_groupnorm_silu.bin
// (GroupNorm32(96) + SiLU on (2, 96, 3, 5)), x with mean 0.5, fp32.
// Tolerances: y is elementwise after fp32 statistics over a group of n = P*C/32 <= 105 values (torch: Welford in
// fp32, relative error ~n*2^-24 ~ 6e-6): atol 2e-5 of the scale, rtol 1e-5; dx and dgamma/dbeta add fp32 sums of
// n or B*P <= 105 products: atol 5e-5 of the scale, rtol 1e-5.
static void fixture_case(const std::string& name, int code, int silu) {
    Fixture fx;
    if (!fixture_open(&fx, name, code)) return;
    std::string pre = silu ? "0." : "";
    std::vector<int> xs = fx_shape(&fx, "x");
    if (!fx.ok || xs.size() != 4) {
        if (fx.ok) report(false, "fixture " + name + ": x must have 4 dims");
        return;
    }
    int B = xs[0], C = xs[1], H = xs[2], W = xs[3], P = H * W;
    std::vector<float> x = fx_get(&fx, "x", xs), gamma = fx_get(&fx, pre + "weight", {C}),
                       beta = fx_get(&fx, pre + "bias", {C}), y = fx_get(&fx, "y", xs), dy = fx_get(&fx, "dy", xs),
                       dx = fx_get(&fx, "dx", xs), dg = fx_get(&fx, "grad." + pre + "weight", {C}),
                       db = fx_get(&fx, "grad." + pre + "bias", {C});
    if (!fx.ok) return;
    x = nchw_to_nhwc(x, B, C, H, W);
    dy = nchw_to_nhwc(dy, B, C, H, W);
    y = nchw_to_nhwc(y, B, C, H, W);
    dx = nchw_to_nhwc(dx, B, C, H, W);
    size_t N = x.size();
    std::vector<float> cy(N), cdx(N), cdg(C), cdb(C);
    cpu_gn(x.data(), gamma.data(), beta.data(), dy.data(), cy.data(), cdx.data(), cdg.data(), cdb.data(), B, P, C, silu);
    check_scaled("cpu oracle vs torch " + name + " y", cy, y, 2e-5, 1e-5);
    check_scaled("cpu oracle vs torch " + name + " dx", cdx, dx, 5e-5, 1e-5);
    check_scaled("cpu oracle vs torch " + name + " grad weight", cdg, dg, 5e-5, 1e-5);
    check_scaled("cpu oracle vs torch " + name + " grad bias", cdb, db, 5e-5, 1e-5);
    if (!g_have_gpu) {
        skip("v1 vs torch " + name + ": no CUDA GPU");
        return;
    }
    UNet m;
    m.B = B;
    NormP n;
    n.C = C; n.w = 0; n.b = C;
    m.n_params = 2 * C;
    std::vector<float> gb(gamma);
    gb.insert(gb.end(), beta.begin(), beta.end());
    m.p = to_device(gb);
    m.g = dev_alloc(2 * C);
    unet_alloc_chan(&m, B, C);
    float *d_x = to_device(x), *d_dy = to_device(dy), *d_y = dev_alloc(N), *d_dx = dev_alloc(N);
    float *mean = dev_alloc(B * 32), *rstd = dev_alloc(B * 32);
    poison(d_y, N);
    poison(d_dx, N);
    poison(m.g, 2 * C);
    groupnorm_forward(&m, n, d_x, d_y, mean, rstd, P, silu);
    groupnorm_backward(&m, n, d_x, d_dy, d_dx, mean, rstd, P, silu, false);
    check_scaled("v1 vs torch " + name + " y", to_host(d_y, N), y, 2e-5, 1e-5);
    check_scaled("v1 vs torch " + name + " dx", to_host(d_dx, N), dx, 5e-5, 1e-5);
    check_scaled("v1 vs torch " + name + " grad weight", to_host(m.g, C), dg, 5e-5, 1e-5);
    check_scaled("v1 vs torch " + name + " grad bias", to_host(m.g + C, C), db, 5e-5, 1e-5);
    float* fs[] = {d_x, d_y, d_dy, d_dx, mean, rstd, m.p, m.g};
    for (float* f : fs) cudaCheck(cudaFree(f));
    unet_free_chan(&m);
}

int main(int argc, char** argv) {
    const int version = lab_version(argc, argv, 2, 1, "1: train_unet.cu's; 2: channel-owning threads, last-block finalize");
    gpu_setup();
    fixture_case("groupnorm", 1004, 0);  // the CPU part runs in CI
    fixture_case("groupnorm_silu", 1005, 1);
    if (!g_have_gpu) {
        skip("groupnorm GPU versions vs the CPU oracle: no CUDA GPU");
        return finish();
    }
    int cases[][4] = {{3, 49, 64, 1}, {2, 37, 96, 0}, {5, 64, 448, 1}, {1, 7, 32, 1}, {4, 100, 320, 0},
                      {2, 4096, 64, 1}, {7, 300, 192, 1}};
    uint64_t seed = 1;
    for (int v = 1; v <= 2; v++)
        for (auto& c : cases) run_case(v, c[0], c[1], c[2], c[3], seed++, false);
    if (version) {  // the UNet's shapes at batch 32 and 128, both versions
        int shapes[][3] = {{4096, 64}, {4096, 128}, {1024, 128}, {1024, 256}, {256, 384}, {64, 512}};
        for (int B : {32, 128})
            for (auto& s : shapes)
                for (int v = 1; v <= 2; v++) run_case(v, B, s[0], s[1], 1, seed, true);
    }
    gpu_teardown();
    return finish();
}
