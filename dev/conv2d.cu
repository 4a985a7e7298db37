/*
dev/conv2d.cu: the 3x3 convolution (padding 1, stride 1 or 2) of train_unet.cu over NHWC, forward, backward-data
and weight gradient, checked against a CPU oracle (dev/unet_layers.cuh) and a PyTorch fixture
(dev/fixtures/unet_layer_conv3x3.bin, dev/unet_layers.py; the oracle against it runs in CI), and timed.

  make -C dev conv2d && ./dev/conv2d --test      # every version, awkward sizes, poisoned outputs, vs the CPU
  ./dev/conv2d [version]                          # validate + benchmark the UNet's 3x3 layer shapes at batch 32
                                                  # (default 6; 6 also times every tile and rounding variant, 7
                                                  # every tile width, 8 every tile beside version 7)

version 1: naive direct convolution, one thread per output element (reference on the GPU)
version 2: implicit GEMM, 128x64x32 tiles through shared memory, fp32 FMAs (train_unet.cu conv_igemm_kernel): the
           strict fp32 path (--precision fp32, what the UNet test uses) and the TF32 passes version 6 cannot take
version 3: the same implicit GEMM on TF32 tensor cores (wmma m16n16k8; conv_igemm_wmma_kernel, below)
version 4: version 2 with a 3-stage cp.async pipeline (conv_igemm_pipe_kernel, below, TF32 = false) for layers
           whose channels fit the tile (the others take version 2); the same bits as version 2 (--test checks it)
version 5: version 4 on TF32 tensor cores (the others take version 3): the TF32 path before version 6
version 6: mma.sync m16n8k8 TF32 through inline PTX (train_unet.cu conv_mma_kernel), operands rounded to TF32
           once in shared memory, conflict-free fragment loads (ldmatrix for the (m, k) tiles), a 3-stage cp.async
           pipeline, the tile picked per layer (conv6_plan: 128x128, 64x64, 128x8 for N <= 8), K split over
           blocks for layers with few output tiles: the training default for layers whose channels fit the tile
           (N <= 8 output channels padded to 8; the others take version 2, strict fp32)
version 7: bf16 (--precision bf16) on Hopper wgmma fed by TMA box copies through an mbarrier ring (train_unet.cu
           conv_wgmma_kernel, sm_90a): 64-pixel boxes, the padding read as TMA's out-of-bounds zeros, stride 2
           through 4 parity views, weight gradient with both operands MN-major; thin layers (channels % 8 != 0)
           on CUDA cores (conv_thin_kernel). `./dev/conv2d 7` times it beside version 6 and every tile width.
version 8: bf16 on mma.sync m16n8k16 (train_unet.cu conv_mma_bf16_kernel, any GPU of compute capability >= 8.0;
           --precision bf16 without sm_90a, g_conv8_force on a Hopper): version 6's cp.async pipeline, tiles and
           K split on bf16 tiles, ldmatrix (.trans for the weight gradient's MN-major operands); the same contract
           and thin layers as version 7. `./dev/conv2d 8` times it beside version 7.
Versions 3-5 live only here (train_unet.cu runs 2, 6 and 7); they reuse version 2's tiles, gather and fp32 product.
Backward-data runs the forward kernel on dY with flipped, transposed weights (stride 2: a gather that skips odd
positions); the weight gradient is the GEMM (9*Cin x Cout) over B*Ho*Wo pixels split in chunks (split-K) and
summed in a fixed order.
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"  // counters, checks, PyTorch fixtures, the CPU oracle, the ConvLab shell
#include <mma.h>

// ---------------------------------------------------------------------------------------------------------------
// version 1: naive direct convolution
__global__ void conv_naive_forward_kernel(const float* x, const float* w, const float* bias, float* y, int B, int H,
                                          int W, int Cin, int Cout, int s, int Ho, int Wo) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * Ho * Wo * Cout) return;
    int co = (int)(i % Cout);
    size_t p = i / Cout;
    int ox = (int)(p % Wo), oy = (int)((p / Wo) % Ho), b = (int)(p / ((size_t)Ho * Wo));
    float acc = bias ? bias[co] : 0.f;
    for (int tap = 0; tap < 9; tap++) {
        int iy = oy * s - 1 + tap / 3, ix = ox * s - 1 + tap % 3;
        if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
        for (int ci = 0; ci < Cin; ci++)
            acc = fmaf(x[(((size_t)b * H + iy) * W + ix) * Cin + ci], w[((size_t)tap * Cin + ci) * Cout + co], acc);
    }
    y[i] = acc;
}

// ---------------------------------------------------------------------------------------------------------------
// versions 3-5: version 2's 128x64x32 tiles (train_unet.cu: CONV_*, conv_gather, conv_rows_setup, and
// conv_fma_tile for the fp32 product of version 4) with the product on TF32 wmma (3, 5) or the tiles brought in by
// a cp.async pipeline (4, 5)

using ConvFrag = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float>;

// acc (+)= A tile x B tile over one CONV_BK slice on wmma m16n16k8 TF32 (operands rounded per fragment); warp
// (wm, wn) owns a 32x32 tile of the 128x64 output. As, Bs as for conv_fma_tile.
template <int MODE>
__device__ __forceinline__ void conv_wmma_tile(const float* As, const float* Bs, ConvFrag (&acc)[2][2], int wm,
                                               int wn) {
    using namespace nvcuda;
    using ALayout = typename std::conditional<MODE == 0, wmma::row_major, wmma::col_major>::type;
#pragma unroll
    for (int kk = 0; kk < CONV_BK; kk += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, ALayout> a[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b[2];
        for (int i = 0; i < 2; i++) {
            if (MODE == 0) wmma::load_matrix_sync(a[i], As + (wm * 32 + i * 16) * AS_LD + kk, AS_LD);
            else wmma::load_matrix_sync(a[i], As + kk * AT_LD + wm * 32 + i * 16, AT_LD);
            for (int t = 0; t < a[i].num_elements; t++) a[i].x[t] = wmma::__float_to_tf32(a[i].x[t]);
        }
        for (int j = 0; j < 2; j++) {
            wmma::load_matrix_sync(b[j], Bs + kk * BS_LD + wn * 32 + j * 16, BS_LD);
            for (int t = 0; t < b[j].num_elements; t++) b[j].x[t] = wmma::__float_to_tf32(b[j].x[t]);
        }
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
}

// the accumulators of either product: TF32 in wmma fragments (warp tiles), fp32 in registers (8x4 per thread)
template <bool TF32>
struct LabAcc {
    ConvFrag acc[2][2];
    float accs[8][4];
    int wm, wn, ty, tx;
    __device__ __forceinline__ void zero(int tid) {
        const int warp = tid >> 5;
        wm = warp & 3;
        wn = warp >> 2;
        ty = tid >> 4;
        tx = tid & 15;
        if (TF32) {
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++) nvcuda::wmma::fill_fragment(acc[i][j], 0.f);
        } else {
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < 4; j++) accs[i][j] = 0.f;
        }
    }
    template <int MODE>
    __device__ __forceinline__ void tile(const float* As, const float* Bs) {
        if (TF32) conv_wmma_tile<MODE>(As, Bs, acc, wm, wn);
        else conv_fma_tile<MODE>(As, Bs, accs, ty, tx);
    }
    __device__ __forceinline__ void store(float* Cs) {  // into the (CONV_BM, CONV_BN) tile, row stride CS_LD
        if (TF32) {
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++)
                    nvcuda::wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * CS_LD + wn * 32 + j * 16, acc[i][j],
                                                    CS_LD, nvcuda::wmma::mem_row_major);
        } else {
            conv_acc_store(Cs, accs, ty, tx);
        }
    }
};

// version 3: version 2 (train_unet.cu conv_igemm_kernel: tiles staged through registers, the next tile's global
// loads in flight during the products) with the products on wmma TF32
template <int MODE, bool VEC>
__global__ void __launch_bounds__(CONV_THREADS)
conv_igemm_wmma_kernel(const float* __restrict__ X, const float* __restrict__ Bm, float* __restrict__ out,
                       const float* __restrict__ bias, const float* __restrict__ emb, int accumulate, ConvGeom g,
                       int kchunk) {
    __shared__ __align__(128) float smem[CONV_SMEM_FLOATS];
    float* As = smem;
    float* Bs = smem + CONV_A_FLOATS;
    const int tid = threadIdx.x;
    const int m0 = blockIdx.x * CONV_BM, n0 = blockIdx.y * CONV_BN;
    const int kbeg = MODE == 1 ? blockIdx.z * kchunk : 0;
    const int kend = MODE == 1 ? min(g.K, kbeg + kchunk) : g.K;
    const int HWo = g.Ho * g.Wo;
    const int nk = (kend - kbeg + CONV_BK - 1) / CONV_BK;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);

    // per-thread loader state
    float4 ra[4], rb[2];  // VEC staging
    float sa[16], sb[8];  // scalar staging
    int rowb[4], rowy[4], rowx[4];
    bool rowv[4];
    int mtap = 0, mc = 0;
    bool mval = false;
    if (VEC && MODE == 0) conv_rows_setup(g, m0, tid, HWo, rowb, rowy, rowx, rowv);
    if (VEC && MODE == 1) {
        int m = m0 + (tid & 31) * 4;
        mval = m < g.M;
        mtap = m / g.C;
        mc = m - mtap * g.C;
    }

    auto load_tiles = [&](int k0) {
        if (VEC) {
            if (MODE == 0) {
                int tap = k0 / g.C, c0 = k0 - tap * g.C + (tid & 7) * 4;
                for (int i = 0; i < 4; i++) {
                    int pix = rowv[i] ? conv_gather(g, rowb[i], rowy[i], rowx[i], tap) : -1;
                    ra[i] = pix >= 0 ? *reinterpret_cast<const float4*>(X + (size_t)pix * g.C + c0) : zero4;
                }
            } else {
                for (int i = 0; i < 4; i++) {
                    int p = k0 + (tid >> 5) + 8 * i;
                    int pix = -1;
                    if (mval && p < kend) {
                        int b = p / HWo, r = p - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                        pix = conv_gather(g, b, oy, ox, mtap);
                    }
                    ra[i] = pix >= 0 ? *reinterpret_cast<const float4*>(X + (size_t)pix * g.C + mc) : zero4;
                }
            }
            for (int i = 0; i < 2; i++) {
                int k = k0 + (tid >> 4) + 16 * i, n = n0 + (tid & 15) * 4;
                rb[i] = (k < kend && n < g.N) ? *reinterpret_cast<const float4*>(Bm + (size_t)k * g.N + n) : zero4;
            }
        } else {
            for (int i = 0; i < 16; i++) {
                int e = tid + CONV_THREADS * i;
                float v = 0.f;
                if (MODE == 0) {
                    int m = m0 + (e >> 5), k = k0 + (e & 31);
                    if (m < g.M && k < kend) {
                        int tap = k / g.C, c = k - tap * g.C;
                        int b = m / HWo, r = m - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                        int pix = conv_gather(g, b, oy, ox, tap);
                        if (pix >= 0) v = X[(size_t)pix * g.C + c];
                    }
                } else {
                    int k = k0 + (e >> 7), m = m0 + (e & 127);
                    if (m < g.M && k < kend) {
                        int tap = m / g.C, c = m - tap * g.C;
                        int b = k / HWo, r = k - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                        int pix = conv_gather(g, b, oy, ox, tap);
                        if (pix >= 0) v = X[(size_t)pix * g.C + c];
                    }
                }
                sa[i] = v;
            }
            for (int i = 0; i < 8; i++) {
                int e = tid + CONV_THREADS * i;
                int k = k0 + (e >> 6), n = n0 + (e & 63);
                sb[i] = (k < kend && n < g.N) ? Bm[(size_t)k * g.N + n] : 0.f;
            }
        }
    };
    auto store_tiles = [&]() {
        if (VEC) {
            for (int i = 0; i < 4; i++) {
                if (MODE == 0)
                    *reinterpret_cast<float4*>(As + ((tid >> 3) + 32 * i) * AS_LD + (tid & 7) * 4) = ra[i];
                else
                    *reinterpret_cast<float4*>(As + ((tid >> 5) + 8 * i) * AT_LD + (tid & 31) * 4) = ra[i];
            }
            for (int i = 0; i < 2; i++)
                *reinterpret_cast<float4*>(Bs + ((tid >> 4) + 16 * i) * BS_LD + (tid & 15) * 4) = rb[i];
        } else {
            for (int i = 0; i < 16; i++) {
                int e = tid + CONV_THREADS * i;
                if (MODE == 0) As[(e >> 5) * AS_LD + (e & 31)] = sa[i];
                else As[(e >> 7) * AT_LD + (e & 127)] = sa[i];
            }
            for (int i = 0; i < 8; i++) {
                int e = tid + CONV_THREADS * i;
                Bs[(e >> 6) * BS_LD + (e & 63)] = sb[i];
            }
        }
    };

    LabAcc<true> acc;
    acc.zero(tid);
    if (nk > 0) {
        load_tiles(kbeg);
        store_tiles();
    }
    __syncthreads();
    for (int kt = 0; kt < nk; kt++) {
        if (kt + 1 < nk) load_tiles(kbeg + (kt + 1) * CONV_BK);  // global loads in flight during the MMAs
        acc.tile<MODE>(As, Bs);
        __syncthreads();
        if (kt + 1 < nk) {
            store_tiles();
            __syncthreads();
        }
    }

    // epilogue through shared memory: coalesced writes with bias, time embedding and accumulation fused
    float* Cs = smem;
    acc.store(Cs);
    __syncthreads();
    for (int e = tid; e < CONV_BM * CONV_BN; e += CONV_THREADS) {
        int row = e >> 6, col = e & 63;
        int m = m0 + row, n = n0 + col;
        if (m >= g.M || n >= g.N) continue;
        float v = Cs[row * CS_LD + col];
        if (MODE == 0) {
            if (bias) v += bias[n];
            if (emb) v += emb[(size_t)(m / HWo) * g.N + n];
            size_t idx = (size_t)m * g.N + n;
            if (accumulate) v += out[idx];
            out[idx] = v;
        } else {
            out[((size_t)blockIdx.z * g.M + m) * g.N + n] = v;
        }
    }
}

// versions 4 (fp32) and 5 (TF32): the same implicit GEMM with a CONV_STAGES-deep cp.async pipeline (16-byte copies
// straight to shared memory, zero-filled at the padding), so the loads of tiles k+1, k+2 overlap the products of
// tile k, and one __syncthreads per tile. Channels must fit the tile (VEC); the others take version 2 / 3.
constexpr int CONV_STAGES = 3;
constexpr int CONV_STAGE_FLOATS = CONV_A_FLOATS + CONV_BK * BS_LD;
constexpr size_t CONV_PIPE_SMEM = (size_t)CONV_STAGES * CONV_STAGE_FLOATS * sizeof(float);
static_assert(CONV_STAGES * CONV_STAGE_FLOATS >= CONV_SMEM_FLOATS, "the output tile reuses the stages");

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int MODE, bool TF32>
__global__ void __launch_bounds__(CONV_THREADS)
conv_igemm_pipe_kernel(const float* __restrict__ X, const float* __restrict__ Bm, float* __restrict__ out,
                       const float* __restrict__ bias, const float* __restrict__ emb, int accumulate, ConvGeom g,
                       int kchunk) {
    extern __shared__ __align__(128) float psmem[];
    const int tid = threadIdx.x;
    const int m0 = blockIdx.x * CONV_BM, n0 = blockIdx.y * CONV_BN;
    const int kbeg = MODE == 1 ? blockIdx.z * kchunk : 0;
    const int kend = MODE == 1 ? min(g.K, kbeg + kchunk) : g.K;
    const int HWo = g.Ho * g.Wo;
    const int nk = (kend - kbeg + CONV_BK - 1) / CONV_BK;

    int rowb[4], rowy[4], rowx[4];
    bool rowv[4];
    int mtap = 0, mc = 0;
    bool mval = false;
    if (MODE == 0) {
        conv_rows_setup(g, m0, tid, HWo, rowb, rowy, rowx, rowv);
    } else {
        int m = m0 + (tid & 31) * 4;
        mval = m < g.M;
        mtap = mval ? m / g.C : 0;
        mc = mval ? m - mtap * g.C : 0;
    }
    auto load_stage = [&](int stage, int k0) {
        float* As = psmem + stage * CONV_STAGE_FLOATS;
        float* Bs = As + CONV_A_FLOATS;
        if (MODE == 0) {
            int tap = k0 / g.C, c0 = k0 - tap * g.C + (tid & 7) * 4;
            for (int i = 0; i < 4; i++) {
                int pix = rowv[i] ? conv_gather(g, rowb[i], rowy[i], rowx[i], tap) : -1;
                cp_async16(As + ((tid >> 3) + 32 * i) * AS_LD + (tid & 7) * 4,
                           pix >= 0 ? X + (size_t)pix * g.C + c0 : X, pix >= 0);
            }
        } else {
            for (int i = 0; i < 4; i++) {
                int p = k0 + (tid >> 5) + 8 * i;
                int pix = -1;
                if (mval && p < kend) {
                    int b = p / HWo, r = p - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                    pix = conv_gather(g, b, oy, ox, mtap);
                }
                cp_async16(As + ((tid >> 5) + 8 * i) * AT_LD + (tid & 31) * 4,
                           pix >= 0 ? X + (size_t)pix * g.C + mc : X, pix >= 0);
            }
        }
        for (int i = 0; i < 2; i++) {
            int k = k0 + (tid >> 4) + 16 * i, n = n0 + (tid & 15) * 4;
            bool v = k < kend && n < g.N;
            cp_async16(Bs + ((tid >> 4) + 16 * i) * BS_LD + (tid & 15) * 4, v ? Bm + (size_t)k * g.N + n : Bm, v);
        }
    };

    LabAcc<TF32> acc;
    acc.zero(tid);
    for (int s = 0; s < CONV_STAGES - 1; s++) {
        if (s < nk) load_stage(s, kbeg + s * CONV_BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<CONV_STAGES - 2>();
        __syncthreads();  // tile kt is in; every thread is done with tile kt-1, whose stage is refilled next
        int next = kt + CONV_STAGES - 1;
        if (next < nk) load_stage(next % CONV_STAGES, kbeg + next * CONV_BK);
        cp_async_commit();
        const float* As = psmem + (kt % CONV_STAGES) * CONV_STAGE_FLOATS;
        const float* Bs = As + CONV_A_FLOATS;
        acc.template tile<MODE>(As, Bs);
    }
    cp_async_wait<0>();
    __syncthreads();
    float* Cs = psmem;
    acc.store(Cs);
    __syncthreads();
    // float4 epilogue: N % 4 == 0 here
    for (int e = tid; e < CONV_BM * CONV_BN / 4; e += CONV_THREADS) {
        int row = e >> 4, col = (e & 15) * 4;
        int m = m0 + row, n = n0 + col;
        if (m >= g.M || n >= g.N) continue;
        float4 v = *reinterpret_cast<const float4*>(Cs + row * CS_LD + col);
        if (MODE == 0) {
            if (bias) {
                float4 bb = *reinterpret_cast<const float4*>(bias + n);
                v.x += bb.x; v.y += bb.y; v.z += bb.z; v.w += bb.w;
            }
            if (emb) {
                float4 ee = *reinterpret_cast<const float4*>(emb + (size_t)(m / HWo) * g.N + n);
                v.x += ee.x; v.y += ee.y; v.z += ee.z; v.w += ee.w;
            }
            float4* o = reinterpret_cast<float4*>(out + (size_t)m * g.N + n);
            if (accumulate) {
                float4 p = *o;
                v.x += p.x; v.y += p.y; v.z += p.z; v.w += p.w;
            }
            *o = v;
        } else {
            *reinterpret_cast<float4*>(out + ((size_t)blockIdx.z * g.M + m) * g.N + n) = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// the three passes of the version select_version() chose: 2 and 6 through train_unet.cu's launchers (what the
// trainer runs, 6 falling back to 2 where its channels do not fit), 3-5 launched here with version 2's grid,
// K split and workspace

static int g_lab_version = 6;

template <int MODE, bool TF32>
static void launch_conv_pipe(dim3 grid, const float* X, const float* Bm, float* out, const float* bias,
                             const float* emb, int accumulate, const ConvGeom& g, int kchunk) {
    static bool attr_set = false;  // > 48 KB of dynamic shared memory needs an opt-in, once per instantiation
    if (!attr_set) {
        cudaCheck(cudaFuncSetAttribute(conv_igemm_pipe_kernel<MODE, TF32>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)CONV_PIPE_SMEM));
        attr_set = true;
    }
    conv_igemm_pipe_kernel<MODE, TF32><<<grid, CONV_THREADS, CONV_PIPE_SMEM, g_stream>>>(X, Bm, out, bias, emb,
                                                                                        accumulate, g, kchunk);
    cudaCheck(cudaGetLastError());
}
// versions 3-5; vec: the channels fit the tile (16-byte loads), else version 4 runs 2 and version 5 runs 3
template <int MODE>
static void launch_lab_igemm(dim3 grid, bool vec, const float* X, const float* Bm, float* out, const float* bias,
                             const float* emb, int accumulate, const ConvGeom& g, int kchunk) {
    const int v = g_lab_version;
    if (vec && v == 4) launch_conv_pipe<MODE, false>(grid, X, Bm, out, bias, emb, accumulate, g, kchunk);
    else if (vec && v == 5) launch_conv_pipe<MODE, true>(grid, X, Bm, out, bias, emb, accumulate, g, kchunk);
    else if (v == 4) launch_conv_igemm<MODE>(grid, false, X, Bm, out, bias, emb, accumulate, g, kchunk);
    else if (vec) {
        conv_igemm_wmma_kernel<MODE, true><<<grid, CONV_THREADS, 0, g_stream>>>(X, Bm, out, bias, emb, accumulate,
                                                                               g, kchunk);
        cudaCheck(cudaGetLastError());
    } else {
        conv_igemm_wmma_kernel<MODE, false><<<grid, CONV_THREADS, 0, g_stream>>>(X, Bm, out, bias, emb, accumulate,
                                                                                g, kchunk);
        cudaCheck(cudaGetLastError());
    }
}
static bool lab_in_trainer() { return g_lab_version == 2 || g_lab_version == 6; }
// y (B, Ho, Wo, cout) = conv3x3(x) + bias
static void lab_forward(const UNet* m, const ConvP& c, const float* x, float* y, int H, int W) {
    if (lab_in_trainer()) {
        conv3x3_forward(m, c, x, y, H, W, nullptr, nullptr);
        return;
    }
    ConvGeom g = conv_geom_forward(m->B, c, H, W);
    dim3 grid(ceil_div(g.M, CONV_BM), ceil_div(g.N, CONV_BN));
    bool vec = c.cin % CONV_BK == 0 && c.cout % 4 == 0;
    launch_lab_igemm<0>(grid, vec, x, m->p + c.w, y, m->p + c.b, nullptr, 0, g, 0);
}
// dx (B, H, W, cin) = backward-data of dy (B, Ho, Wo, cout)
static void lab_backward_data(const UNet* m, const ConvP& c, const float* dy, float* dx, int H, int W) {
    if (lab_in_trainer()) {
        conv3x3_backward_data(m, c, dy, dx, H, W, false);
        return;
    }
    int n = 9 * c.cin * c.cout;
    conv_flip_weights_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(m->p + c.w, m->wflip, c.cin, c.cout);
    cudaCheck(cudaGetLastError());
    ConvGeom g = conv_geom_backward_data(m->B, c, H, W);
    dim3 grid(ceil_div(g.M, CONV_BM), ceil_div(g.N, CONV_BN));
    bool vec = c.cout % CONV_BK == 0 && c.cin % 4 == 0;
    launch_lab_igemm<0>(grid, vec, dy, m->wflip, dx, nullptr, nullptr, 0, g, 0);
}
// m->g + c.w = the weight gradient from x (B, H, W, cin) and dy (B, Ho, Wo, cout)
static void lab_backward_weight(const UNet* m, const ConvP& c, const float* x, const float* dy, int H, int W) {
    if (lab_in_trainer()) {
        conv3x3_backward_weight(m, c, x, dy, H, W);
        return;
    }
    ConvGeom g = conv_geom_weight(m->B, c, H, W);
    int tiles = ceil_div(g.M, CONV_BM) * ceil_div(g.N, CONV_BN);
    int splits = std::max(1, std::min(ceil_div(2 * g_num_sms, tiles), std::max(1, g.K / 256)));
    int kchunk = ceil_div(ceil_div(g.K, splits), CONV_BK) * CONV_BK;
    splits = ceil_div(g.K, kchunk);
    conv_ws_check(m->conv_ws_floats, (size_t)splits * g.M * g.N, "workspace");
    dim3 grid(ceil_div(g.M, CONV_BM), ceil_div(g.N, CONV_BN), splits);
    bool vec = c.cin % 4 == 0 && c.cout % 4 == 0;
    launch_lab_igemm<1>(grid, vec, x, dy, m->conv_ws, nullptr, nullptr, 0, g, kchunk);
    wgrad_reduce(m->conv_ws, m->g + c.w, (size_t)g.M * g.N, splits, false);
}

static void fill_nan(float* d, size_t n) { poison(d, n); }

// |got - ref| <= rtol_mag * sum|products| per element (the CPU oracle's magnitudes)
static void check(const std::string& name, const float* d_got, const float* ref, const float* mag, size_t n,
                  double rtol_mag) {
    std::vector<float> got = to_host(d_got, n);
    double max_err = 0.0;
    size_t max_i = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - ref[i]);
        if (!(err == err)) err = INFINITY;
        double tol = rtol_mag * mag[i] + 1e-30;
        if (!(err <= tol)) bad++;
        if (err > max_err || (bad == 1 && !(err <= tol))) { max_err = err; max_i = i; }
    }
    char line[512];
    snprintf(line, sizeof line, "%s: max |err| %.3e at [%zu] (got %.7g, ref %.7g), %zu of %zu above %.0e * sum|products|",
             name.c_str(), max_err, max_i, got[max_i], ref[max_i], bad, n, rtol_mag);
    report(bad == 0, line);
}

// fp32 (versions 1, 2, 4): error of a length-K sum in any order <= ~K * 2^-24 * sum|products|; K <= 9*Cin here, so
// 1e-5 of sum|products| has margin. TF32 (versions 3, 5, 6) rounds both operands to 10-bit mantissas: <= ~2^-10
// relative per product, so 2e-3 of sum|products|.
static bool version_tf32(int v) { return v == 3 || v == 5 || v == 6; }
static double version_rtol(int v) { return version_tf32(v) ? 2e-3 : 1e-5; }
static void select_version(int v) {
    g_lab_version = v;
    g_tf32 = v == 6;  // the trainer's launchers: version 6 where it applies, else 2
    g_conv6_tile = -1;
    g_conv6_splits = 0;
}
// version 6's variants the tests run: the plan, then every tile with K whole (splits 1) and split in 3 (the
// 128x64 and 128x128-with-4-warps tiles of the first H100 run lost everywhere and were removed: dev/unet_NOTES.md)
struct V6Variant { int tile, splits; };
static std::vector<V6Variant> v6_variants() {
    std::vector<V6Variant> v = {{-1, 0}};
    for (int t = 0; t < C6_NTILES; t++) v.push_back({t, 1});
    for (int t = 0; t < C6_NTILES; t++) v.push_back({t, 3});
    return v;
}
static std::string v6_variant_name(const V6Variant& v) {
    if (v.tile < 0) return "plan";
    return std::string(C6_TILE_NAME[v.tile]) + " splits " + std::to_string(v.splits);
}
// the passes of a (cin, cout) layer that version 6 runs (the others fall back to version 2)
static ConvP conv_p(int cin, int cout) {
    ConvP c;
    c.cin = cin;
    c.cout = cout;
    return c;
}
static bool v6_forward(int cin, int cout) { return conv6_forward_ok(conv_p(cin, cout)); }
static bool v6_backward_data(int cin, int cout) { return conv6_backward_data_ok(conv_p(cin, cout)); }
static bool v6_weight(int cin, int cout) { return conv6_weight_ok(conv_p(cin, cout)); }
static bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

static void run_case(int version, int B, int H, int W, int cin, int cout, int s, uint64_t seed) {
    ConvLab L;
    lab_init(&L, B, H, W, cin, cout, s);
    size_t nx = (size_t)B * H * W * cin, ny = (size_t)B * L.Ho * L.Wo * cout, nw = 9 * (size_t)cin * cout;
    std::vector<float> x(nx), w(nw), bias(cout), dy(ny);
    uint64_t k = 0;
    for (auto& v : x) v = 2.f * rng_uniform(seed, 7, k++) - 1.f;
    for (auto& v : w) v = (2.f * rng_uniform(seed, 8, k++) - 1.f) / sqrtf(9.f * cin);
    for (auto& v : bias) v = 2.f * rng_uniform(seed, 9, k++) - 1.f;
    for (auto& v : dy) v = 2.f * rng_uniform(seed, 10, k++) - 1.f;
    std::vector<float> y(ny), ymag(ny), dx(nx), dxmag(nx), dw(nw), dwmag(nw);
    conv3x3_cpu_forward(x.data(), w.data(), bias.data(), y.data(), ymag.data(), B, H, W, cin, cout, s);
    conv3x3_cpu_backward(x.data(), w.data(), dy.data(), dx.data(), dxmag.data(), dw.data(), dwmag.data(), nullptr, B, H, W, cin, cout, s);
    float *d_x = dev_alloc(nx), *d_y = dev_alloc(ny), *d_dy = dev_alloc(ny), *d_dx = dev_alloc(nx);
    cudaCheck(cudaMemcpy(d_x, x.data(), nx * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_dy, dy.data(), ny * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p, w.data(), nw * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p + L.c.b, bias.data(), cout * 4, cudaMemcpyHostToDevice));
    char name[160];
    snprintf(name, sizeof name, "v%d B%d %dx%d cin %d cout %d stride %d", version, B, H, W, cin, cout, s);
    double rt = version_rtol(version);
    fill_nan(d_y, ny);
    if (version == 1) {
        conv_naive_forward_kernel<<<ceil_div(ny, 256), 256>>>(d_x, L.m.p, L.m.p + L.c.b, d_y, B, H, W, cin, cout, s,
                                                              L.Ho, L.Wo);
        cudaCheck(cudaGetLastError());
        check(std::string(name) + " forward", d_y, y.data(), ymag.data(), ny, rt);
    } else {
        select_version(version);
        // version 6: every variant where a pass runs it; results of the unsplit variants must agree bit for bit
        bool any6 = v6_forward(cin, cout) || v6_backward_data(cin, cout) || v6_weight(cin, cout);
        std::vector<V6Variant> vars = version == 6 && any6 ? v6_variants() : std::vector<V6Variant>{{-1, 0}};
        std::vector<float> y1, dx1, dw1;  // the first unsplit variant's outputs
        bool agree = true;
        for (const V6Variant& var : vars) {
            g_conv6_tile = var.tile;
            g_conv6_splits = var.splits;
            std::string nm = std::string(name) + (version == 6 && any6 ? " [" + v6_variant_name(var) + "]" : "");
            fill_nan(d_y, ny);
            lab_forward(&L.m, L.c, d_x, d_y, H, W);
            check(nm + " forward", d_y, y.data(), ymag.data(), ny, rt);
            fill_nan(d_dx, nx);
            lab_backward_data(&L.m, L.c, d_dy, d_dx, H, W);
            check(nm + " backward-data", d_dx, dx.data(), dxmag.data(), nx, rt);
            fill_nan(L.m.g, nw);
            lab_backward_weight(&L.m, L.c, d_x, d_dy, H, W);
            check(nm + " weight-grad", L.m.g, dw.data(), dwmag.data(), nw, rt);
            if (var.splits == 1) {
                std::vector<float> gy = to_host(d_y, ny), gdx = to_host(d_dx, nx), gdw = to_host(L.m.g, nw);
                if (y1.empty()) {
                    y1 = gy; dx1 = gdx; dw1 = gdw;
                } else {
                    agree = agree && bits_equal(gy, y1) && bits_equal(gdx, dx1) && bits_equal(gdw, dw1);
                }
            }
        }
        if (vars.size() > 1)
            report(agree, std::string(name) + ": every tile with K whole gives the same bits (forward, backward-data, "
                                              "weight-grad)");
        if (version == 4) {  // the same tiles, k order, FMAs and epilogue order as version 2: the same bits
            std::vector<float> gy = to_host(d_y, ny), gdx = to_host(d_dx, nx), gdw = to_host(L.m.g, nw);
            select_version(2);
            fill_nan(d_y, ny);
            fill_nan(d_dx, nx);
            fill_nan(L.m.g, nw);
            lab_forward(&L.m, L.c, d_x, d_y, H, W);
            lab_backward_data(&L.m, L.c, d_dy, d_dx, H, W);
            lab_backward_weight(&L.m, L.c, d_x, d_dy, H, W);
            report(bits_equal(gy, to_host(d_y, ny)) && bits_equal(gdx, to_host(d_dx, nx)) &&
                       bits_equal(gdw, to_host(L.m.g, nw)),
                   std::string(name) + ": the same bits as version 2 (forward, backward-data, weight-grad)");
        }
        select_version(version);
    }
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_y));
    cudaCheck(cudaFree(d_dy));
    cudaCheck(cudaFree(d_dx));
    lab_free(&L);
}

// ---------------------------------------------------------------------------------------------------------------
// PyTorch fixture (dev/fixtures/unet_layer_conv3x3.bin: nn.Conv2d(5, 7, 3, padding=1) on (2, 5, 9, 6), fp32)

// Tolerances against PyTorch fp32: its sums have <= 9*Cin = 45 (y), 9*Cout = 63 (dx) or B*H*W = 108 (dw, db)
// terms of O(1) values, rounding <= K * 2^-24 * sum|terms| ~ 1e-5 of the tensor's scale at worst: atol 2e-5 of the
// scale, rtol 1e-5. TF32 versions round each operand to 10 mantissa bits (~5e-4 relative per product): 4e-3, 4e-3.
static void fixture_tolerance(bool tf32, double* atol, double* rtol) {
    *atol = tf32 ? 4e-3 : 2e-5;
    *rtol = tf32 ? 4e-3 : 1e-5;
}
// CPU oracle on the fixture's input against PyTorch's y, dx, dw, db
static void fixture_cpu(const ConvFixture& f, const std::string& name, int s) {
    size_t ny = f.y.size();
    std::vector<float> y(ny), dx(f.x.size()), dw(f.w.size()), db(f.Cout);
    conv3x3_cpu_forward(f.x.data(), f.w.data(), f.bias.data(), y.data(), nullptr, f.B, f.H, f.W, f.Cin, f.Cout, s);
    conv3x3_cpu_backward(f.x.data(), f.w.data(), f.dy.data(), dx.data(), nullptr, dw.data(), nullptr, db.data(), f.B,
                         f.H, f.W, f.Cin, f.Cout, s);
    double at, rt;
    fixture_tolerance(false, &at, &rt);
    check_scaled("cpu oracle vs torch " + name + " y", y, f.y, at, rt);
    check_scaled("cpu oracle vs torch " + name + " dx", dx, f.dx, at, rt);
    check_scaled("cpu oracle vs torch " + name + " grad weight", dw, f.dw, at, rt);
    check_scaled("cpu oracle vs torch " + name + " grad bias", db, f.db, at, rt);
}
// GPU version (1: forward only; 2..6) on the fixture's input against PyTorch's y, dx, dw, db (outputs poisoned first)
static void fixture_gpu(const ConvFixture& f, const std::string& name, int s, int version) {
    ConvLab L;
    lab_init(&L, f.B, f.H, f.W, f.Cin, f.Cout, s);
    select_version(version);
    float *d_x = to_device(f.x), *d_dy = to_device(f.dy), *d_y = dev_alloc(f.y.size()), *d_dx = dev_alloc(f.x.size());
    cudaCheck(cudaMemcpy(L.m.p, f.w.data(), f.w.size() * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p + L.c.b, f.bias.data(), f.Cout * 4, cudaMemcpyHostToDevice));
    poison(d_y, f.y.size());
    poison(d_dx, f.x.size());
    poison(L.m.g, L.m.n_params);
    double at, rt;
    fixture_tolerance(version_tf32(version), &at, &rt);
    std::string v = "v" + std::to_string(version) + " vs torch " + name;
    if (version == 1) {  // the naive kernel: forward only
        conv_naive_forward_kernel<<<ceil_div(f.y.size(), 256), 256>>>(d_x, L.m.p, L.m.p + L.c.b, d_y, f.B, f.H, f.W,
                                                                      f.Cin, f.Cout, s, f.Ho, f.Wo);
        cudaCheck(cudaGetLastError());
        check_scaled(v + " y", to_host(d_y, f.y.size()), f.y, at, rt);
    } else {
        lab_forward(&L.m, L.c, d_x, d_y, f.H, f.W);
        lab_backward_data(&L.m, L.c, d_dy, d_dx, f.H, f.W);
        lab_backward_weight(&L.m, L.c, d_x, d_dy, f.H, f.W);
        channel_sums(&L.m, d_dy, L.m.g + L.c.b, f.B, f.Ho * f.Wo, f.Cout, 0, 0);
        check_scaled(v + " y", to_host(d_y, f.y.size()), f.y, at, rt);
        check_scaled(v + " dx", to_host(d_dx, f.x.size()), f.dx, at, rt);
        check_scaled(v + " grad weight", to_host(L.m.g, f.w.size()), f.dw, at, rt);
        check_scaled(v + " grad bias", to_host(L.m.g + L.c.b, f.Cout), f.db, at, rt);
    }
    float* fs[] = {d_x, d_dy, d_y, d_dx};
    for (float* q : fs) cudaCheck(cudaFree(q));
    lab_free(&L);
    select_version(6);
}
// Version 6 on the fixture: its 5 -> 7 channels are off the tile (version 2 would run), so the layer is run with
// zero channels appended (cin -> 32; cout -> 32, or kept at 7: version 6's path for N <= 8, which pads the
// operand itself, and backward-data then takes version 2): the appended channels add exact zeros, the real
// channels must match PyTorch within the TF32 tolerance and the appended ones must come out exactly 0. Every tile.
static void fixture_gpu_padded(const ConvFixture& f, const std::string& name, int s, bool pad_cout) {
    const int CI = ceil_div(f.Cin, 32) * 32, CO = pad_cout ? ceil_div(f.Cout, 32) * 32 : f.Cout;
    size_t P = (size_t)f.B * f.H * f.W, Po = (size_t)f.B * f.Ho * f.Wo;
    std::vector<float> x(P * CI, 0.f), w(9 * (size_t)CI * CO, 0.f), bias(CO, 0.f), dy(Po * CO, 0.f);
    for (size_t p = 0; p < P; p++)
        for (int c = 0; c < f.Cin; c++) x[p * CI + c] = f.x[p * f.Cin + c];
    for (int tap = 0; tap < 9; tap++)
        for (int ci = 0; ci < f.Cin; ci++)
            for (int co = 0; co < f.Cout; co++)
                w[((size_t)tap * CI + ci) * CO + co] = f.w[((size_t)tap * f.Cin + ci) * f.Cout + co];
    for (int co = 0; co < f.Cout; co++) bias[co] = f.bias[co];
    for (size_t p = 0; p < Po; p++)
        for (int co = 0; co < f.Cout; co++) dy[p * CO + co] = f.dy[p * f.Cout + co];
    ConvLab L;
    lab_init(&L, f.B, f.H, f.W, CI, CO, s);
    float *d_x = to_device(x), *d_dy = to_device(dy), *d_y = dev_alloc(Po * CO), *d_dx = dev_alloc(P * CI);
    cudaCheck(cudaMemcpy(L.m.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p + L.c.b, bias.data(), CO * 4, cudaMemcpyHostToDevice));
    double at, rt;
    fixture_tolerance(true, &at, &rt);
    std::vector<V6Variant> vars = v6_variants();
    for (const V6Variant& var : vars) {
        if (var.splits > 1) continue;
        select_version(6);
        g_conv6_tile = var.tile;
        g_conv6_splits = var.splits;
        poison(d_y, Po * CO);
        poison(d_dx, P * CI);
        poison(L.m.g, L.m.n_params);
        conv3x3_forward(&L.m, L.c, d_x, d_y, f.H, f.W, nullptr, nullptr);
        conv3x3_backward_data(&L.m, L.c, d_dy, d_dx, f.H, f.W, false);
        conv3x3_backward_weight(&L.m, L.c, d_x, d_dy, f.H, f.W);
        channel_sums(&L.m, d_dy, L.m.g + L.c.b, f.B, f.Ho * f.Wo, CO, 0, 0);
        std::vector<float> gy = to_host(d_y, Po * CO), gdx = to_host(d_dx, P * CI), gw = to_host(L.m.g, w.size()),
                           gb = to_host(L.m.g + L.c.b, CO);
        std::vector<float> y(f.y.size()), dx(f.x.size()), dw(f.w.size()), db(f.Cout);
        bool pad_zero = true;  // every appended channel exactly 0 (NaN-poisoned before)
        for (size_t p = 0; p < Po; p++)
            for (int c = 0; c < CO; c++) {
                if (c < f.Cout) y[p * f.Cout + c] = gy[p * CO + c];
                else pad_zero = pad_zero && gy[p * CO + c] == 0.f;
            }
        for (size_t p = 0; p < P; p++)
            for (int c = 0; c < CI; c++) {
                if (c < f.Cin) dx[p * f.Cin + c] = gdx[p * CI + c];
                else pad_zero = pad_zero && gdx[p * CI + c] == 0.f;
            }
        for (int tap = 0; tap < 9; tap++)
            for (int ci = 0; ci < CI; ci++)
                for (int co = 0; co < CO; co++) {
                    float v = gw[((size_t)tap * CI + ci) * CO + co];
                    if (ci < f.Cin && co < f.Cout) dw[((size_t)tap * f.Cin + ci) * f.Cout + co] = v;
                    else pad_zero = pad_zero && v == 0.f;
                }
        for (int co = 0; co < f.Cout; co++) db[co] = gb[co];
        std::string v = "v6 [" + v6_variant_name(var) + "] vs torch " + name + " (channels zero-padded to " +
                        std::to_string(CI) + ", " + std::to_string(CO) + ")";
        check_scaled(v + " y", y, f.y, at, rt);
        check_scaled(v + " dx", dx, f.dx, at, rt);
        check_scaled(v + " grad weight", dw, f.dw, at, rt);
        check_scaled(v + " grad bias", db, f.db, at, rt);
        report(pad_zero, v + ": appended channels of y, dx, grad weight exactly 0");
    }
    float* fs[] = {d_x, d_dy, d_y, d_dx};
    for (float* q : fs) cudaCheck(cudaFree(q));
    lab_free(&L);
    select_version(6);
}

// ---------------------------------------------------------------------------------------------------------------
// benchmark: every 3x3 layer shape of the default UNet (dev/unet.py) at batch 32, with its count in the model
// (FLOPs = 2 * B*Ho*Wo * 9*Cin * Cout per pass); the weighted sum is the convolutions' share of a training step
// (the input conv needs no backward-data)
struct BenchShape { int H, cin, cout, s, count; };
static const BenchShape UNET_SHAPES[] = {
    {64, 3, 64, 1, 1},    {64, 64, 3, 1, 1},    {64, 64, 64, 1, 7},    {64, 64, 64, 2, 1},    {64, 128, 64, 1, 2},
    {64, 128, 128, 1, 1}, {64, 192, 64, 1, 1},  {32, 64, 128, 1, 1},   {32, 128, 128, 1, 6},  {32, 128, 128, 2, 1},
    {32, 192, 128, 1, 1}, {32, 192, 192, 1, 1}, {32, 256, 128, 1, 1},  {32, 320, 128, 1, 1},  {16, 128, 192, 1, 1},
    {16, 192, 192, 1, 6}, {16, 192, 192, 2, 1}, {16, 256, 256, 1, 1},  {16, 320, 192, 1, 1},  {16, 384, 192, 1, 1},
    {16, 448, 192, 1, 1}, {8, 192, 256, 1, 1},  {8, 256, 256, 1, 10},  {8, 448, 256, 1, 1},   {8, 512, 256, 1, 2}};
const int BENCH_B = 32;

struct BenchLayer {
    ConvLab L;
    BenchShape sh;
    float *x, *y, *dx;
    double flops;
};
static void bench_layer_init(BenchLayer* b, const BenchShape& sh) {
    b->sh = sh;
    lab_init(&b->L, BENCH_B, sh.H, sh.H, sh.cin, sh.cout, sh.s);
    size_t nx = (size_t)BENCH_B * sh.H * sh.H * sh.cin, ny = (size_t)BENCH_B * b->L.Ho * b->L.Wo * sh.cout;
    b->x = dev_alloc(nx);
    b->y = dev_alloc(ny);
    b->dx = dev_alloc(nx);
    cudaCheck(cudaMemset(b->x, 0, nx * 4));
    cudaCheck(cudaMemset(b->y, 0, ny * 4));
    cudaCheck(cudaMemset(b->L.m.p, 0, b->L.m.n_params * 4));
    b->flops = 2.0 * BENCH_B * b->L.Ho * b->L.Wo * 9.0 * sh.cin * sh.cout;
}
static void bench_layer_free(BenchLayer* b) {
    cudaCheck(cudaFree(b->x));
    cudaCheck(cudaFree(b->y));
    cudaCheck(cudaFree(b->dx));
    lab_free(&b->L);
}
// ms per call of launch(), 3 warm-up calls then the mean of 20
template <typename F>
static float time_ms(F launch) {
    static cudaEvent_t e0 = nullptr, e1 = nullptr;
    if (!e0) {
        cudaCheck(cudaEventCreate(&e0));
        cudaCheck(cudaEventCreate(&e1));
    }
    for (int i = 0; i < 3; i++) launch();
    cudaCheck(cudaEventRecord(e0));
    const int reps = 20;
    for (int i = 0; i < reps; i++) launch();
    cudaCheck(cudaEventRecord(e1));
    cudaCheck(cudaEventSynchronize(e1));
    float ms;
    cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
    return ms / reps;
}
// pass 0 forward, 1 backward-data, 2 weight gradient, of the version selected
static void bench_pass(BenchLayer* b, int pass) {
    const BenchShape& sh = b->sh;
    if (pass == 0) lab_forward(&b->L.m, b->L.c, b->x, b->y, sh.H, sh.H);
    else if (pass == 1) lab_backward_data(&b->L.m, b->L.c, b->y, b->dx, sh.H, sh.H);
    else lab_backward_weight(&b->L.m, b->L.c, b->x, b->y, sh.H, sh.H);
}
// the same pass on version 6 with rounding variant RND (the trainer's launchers fix CONV6_RND)
template <int RND>
static void bench_pass_rnd(BenchLayer* b, int pass) {
    const BenchShape& sh = b->sh;
    const ConvP& c = b->L.c;
    if (pass == 0) {
        conv6_forward_mode<RND>(&b->L.m, conv_geom_forward(BENCH_B, c, sh.H, sh.H), b->x, b->L.m.p + c.w, b->y,
                                b->L.m.p + c.b, nullptr, false);
    } else if (pass == 1) {
        int n = 9 * c.cin * c.cout;
        conv_flip_weights_kernel<<<ceil_div(n, EW), EW>>>(b->L.m.p + c.w, b->L.m.wflip, c.cin, c.cout);
        cudaCheck(cudaGetLastError());
        conv6_forward_mode<RND>(&b->L.m, conv_geom_backward_data(BENCH_B, c, sh.H, sh.H), b->y, b->L.m.wflip, b->dx,
                                nullptr, nullptr, false);
    } else {
        conv6_weight_grad<RND>(&b->L.m, conv_geom_weight(BENCH_B, c, sh.H, sh.H), b->x, b->y, b->L.m.g + c.w);
    }
}
static bool bench_pass_v6(const BenchShape& sh, int pass) {
    return pass == 0 ? v6_forward(sh.cin, sh.cout) : pass == 1 ? v6_backward_data(sh.cin, sh.cout) : v6_weight(sh.cin, sh.cout);
}
static const char* PASS_NAME[3] = {"forward", "backward-data", "weight-grad"};

static void bench(int version) {
    // version 6 is printed next to version 5 (the previous TF32 kernels), timed in the same run
    bool vs5 = version == 6;
    printf("version %d (%s), batch %d; ms per pass, TFLOP/s%s; x n: the layer's count in the UNet\n", version,
           version_tf32(version) ? "TF32" : "fp32", BENCH_B, vs5 ? " (and version 5's TFLOP/s)" : "");
    printf("%-24s %*s %*s %*s\n", "shape", vs5 ? 27 : 17, "forward", vs5 ? 27 : 17, "backward-data", vs5 ? 27 : 17,
           "weight-grad");
    double total_ms = 0, total_ms5 = 0, total_flops = 0;
    for (const BenchShape& sh : UNET_SHAPES) {
        BenchLayer b;
        bench_layer_init(&b, sh);
        float ms[3], ms5[3];
        for (int pass = 0; pass < 3; pass++) {
            if (version == 1 && pass > 0) { ms[pass] = NAN; continue; }
            select_version(version);
            if (version == 1)
                ms[pass] = time_ms([&]() {
                    size_t ny = (size_t)BENCH_B * b.L.Ho * b.L.Wo * sh.cout;
                    conv_naive_forward_kernel<<<ceil_div(ny, 256), 256>>>(b.x, b.L.m.p, nullptr, b.y, BENCH_B, sh.H,
                                                                          sh.H, sh.cin, sh.cout, sh.s, b.L.Ho, b.L.Wo);
                });
            else ms[pass] = time_ms([&]() { bench_pass(&b, pass); });
            if (vs5) {
                select_version(5);
                ms5[pass] = time_ms([&]() { bench_pass(&b, pass); });
            }
            bool counted = !(pass == 1 && sh.cin == 3);
            if (counted) {
                total_ms += sh.count * ms[pass];
                if (vs5) total_ms5 += sh.count * ms5[pass];
                total_flops += sh.count * b.flops;
            }
        }
        char name[64];
        snprintf(name, sizeof name, "%dx%d %d->%d s%d x%d", sh.H, sh.H, sh.cin, sh.cout, sh.s, sh.count);
        printf("%-24s", name);
        for (int pass = 0; pass < 3; pass++) {
            printf("  %7.3f ms %5.1f", ms[pass], b.flops / (ms[pass] * 1e-3) / 1e12);
            if (vs5) printf(" (v5 %5.1f)", b.flops / (ms5[pass] * 1e-3) / 1e12);
        }
        printf("\n");
        bench_layer_free(&b);
    }
    select_version(version);
    if (version > 1)
        printf("version %d: every 3x3 convolution of a training step (weighted by count): %.2f ms, %.1f TFLOP/s\n",
               version, total_ms, total_flops / (total_ms * 1e-3) / 1e12);
    if (vs5)
        printf("version 5 (same run): %.2f ms, %.1f TFLOP/s\n", total_ms5, total_flops / (total_ms5 * 1e-3) / 1e12);
    if (version != 6) return;

    // version 6's variants at each shape (TFLOP/s): the plan, every tile (with its own K split), rounding variants
    printf("\nversion 6 variants, TFLOP/s (plan = what the trainer runs: tile/splits; t0..t2: forced tiles, each\n"
           "with the plan's split rule; plan's tile with rnd0: no rounding (tensor cores truncate), rnd2: rounding\n"
           "per fragment, rnd3: rounding in shared memory by integer add and mask)\n");
    for (int t = 0; t < C6_NTILES; t++) printf("  t%d = %s\n", t, C6_TILE_NAME[t]);
    printf("%-24s %-14s %-10s %6s %6s %6s %6s %6s %6s %6s\n", "shape", "pass", "plan", "TF/s", "t0", "t1", "t2", "rnd0",
           "rnd2", "rnd3");
    for (const BenchShape& sh : UNET_SHAPES) {
        BenchLayer b;
        bench_layer_init(&b, sh);
        for (int pass = 0; pass < 3; pass++) {
            if (!bench_pass_v6(sh, pass) || (pass == 1 && sh.cin == 3)) continue;
            select_version(6);
            const ConvP& c = b.L.c;
            ConvGeom g = pass == 0   ? conv_geom_forward(BENCH_B, c, sh.H, sh.H)
                         : pass == 1 ? conv_geom_backward_data(BENCH_B, c, sh.H, sh.H)
                                     : conv_geom_weight(BENCH_B, c, sh.H, sh.H);
            Conv6Plan p = conv6_plan(pass == 2 ? 1 : 0, g.M, g.N, g.K);
            auto tf = [&](float ms) { return b.flops / (ms * 1e-3) / 1e12; };
            double plan_tf = tf(time_ms([&]() { bench_pass(&b, pass); }));
            double tile_tf[C6_NTILES];
            for (int t = 0; t < C6_NTILES; t++) {
                g_conv6_tile = t;
                tile_tf[t] = tf(time_ms([&]() { bench_pass(&b, pass); }));
            }
            g_conv6_tile = -1;
            double r0 = tf(time_ms([&]() { bench_pass_rnd<0>(&b, pass); }));
            double r2 = tf(time_ms([&]() { bench_pass_rnd<2>(&b, pass); }));
            double r3 = tf(time_ms([&]() { bench_pass_rnd<3>(&b, pass); }));
            char name[64], plan[32];
            snprintf(name, sizeof name, "%dx%d %d->%d s%d x%d", sh.H, sh.H, sh.cin, sh.cout, sh.s, sh.count);
            snprintf(plan, sizeof plan, "t%d/%d", p.tile, p.splits);
            printf("%-24s %-14s %-10s %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f %6.1f\n", name, PASS_NAME[pass], plan,
                   plan_tf, tile_tf[0], tile_tf[1], tile_tf[2], r0, r2, r3);
        }
        bench_layer_free(&b);
    }
    // K split of MODE 0 on the small layers: the 128x128 and 64x64 tiles with K whole, split 2, 3, 4
    printf("\nversion 6, forward / backward-data with a forced tile and K split (TFLOP/s)\n");
    for (const BenchShape& sh : UNET_SHAPES) {
        if (sh.H > 16 || !v6_forward(sh.cin, sh.cout)) continue;
        BenchLayer b;
        bench_layer_init(&b, sh);
        for (int pass = 0; pass < 2; pass++) {
            for (int t = 0; t <= 1; t++) {
                char name[96];
                snprintf(name, sizeof name, "%dx%d %d->%d s%d %s t%d", sh.H, sh.H, sh.cin, sh.cout, sh.s,
                         PASS_NAME[pass], t);
                printf("%-42s", name);
                for (int sp = 1; sp <= 4; sp++) {
                    select_version(6);
                    g_conv6_tile = t;
                    g_conv6_splits = sp;
                    printf("  split %d %6.1f", sp, b.flops / (time_ms([&]() { bench_pass(&b, pass); }) * 1e-3) / 1e12);
                }
                printf("\n");
            }
        }
        bench_layer_free(&b);
    }
    select_version(6);
}

// ---------------------------------------------------------------------------------------------------------------
// version 7: bf16 on Hopper wgmma fed by TMA (train_unet.cu conv_wgmma_kernel, --precision bf16), thin layers on
// CUDA cores (conv_thin_kernel, conv_thin_wgrad_kernel). Inputs and weights are bf16 values (rounded on the host),
// so the CPU oracle sees the operands the GPU multiplies: the products are exact and the only errors are the
// fp32 accumulation (<= ~1e-4 of sum|products| for K <= 4608 terms, tensor-core adds included) and, for the
// forward and backward-data outputs, the rounding to bf16 (half an ulp: <= 2^-8 of |ref|).
// Version 8 (mma.sync, g_conv8_force) is checked the same way: the same exact products, fp32 accumulation over
// k16 steps (at most 4608 / 16 = 288 fp32 adds in a row: <= ~3.5e-5 of sum|products|), the same bf16 rounding.

static const int CW_BNS[4] = {64, 128, 192, 256};
// the bf16 shell: the weights as a parameter table (for weights_to_bf16_kernel), their bf16 copies, the zero-
// inserted dY of stride 2 and a workspace for every forced tile width (version 7), tile (version 8) and split of
// the variants below
static void lab_init_bf16(ConvLab* L, int B, int H, int W, int cin, int cout, int s) {
    lab_init(L, B, H, W, cin, cout, s);
    UNet& m = L->m;
    m.prec = PREC_BF16;
    Param pw_{"w", PK_CONV3, 4, {cout, cin, 3, 3}, 0, (size_t)9 * cin * cout};
    Param pb_{"b", PK_PLAIN, 1, {cout, 0, 0, 0}, L->c.b, (size_t)cout};
    m.params = {pw_, pb_};
    unet_allocate_bf16_weights(&m);
    size_t ws = m.conv_ws_floats;
    for (int bn : CW_BNS)
        for (int sp : {0, 1, 3}) {
            g_cw_bn = bn;
            g_cw_splits = sp;
            ws = std::max(ws, conv_wg_ws_floats(B, L->c, H, W));
        }
    g_cw_bn = g_cw_splits = 0;
    for (int sp : {0, 1, 3}) {
        g_conv8_splits = sp;
        ws = std::max(ws, conv8_ws_floats(B, L->c, H, W));  // every tile
    }
    g_conv8_splits = 0;
    ws = std::max(ws, (size_t)2 * g_num_sms * 9 * (cin + cout) * 64);  // thin weight gradients: per-block sums
    cudaCheck(cudaFree(m.conv_ws));
    m.conv_ws_floats = ws;
    m.conv_ws = dev_alloc(ws);
    m.dy_up_elems = (size_t)B * H * W * cout;
    cudaCheck(cudaMalloc(&m.dy_up, m.dy_up_elems * sizeof(bf16)));
}
static void lab_free_bf16(ConvLab* L) {
    cudaCheck(cudaFree(L->m.pw));
    cudaCheck(cudaFree(L->m.wd));
    cudaCheck(cudaFree(L->m.cast_table));
    cudaCheck(cudaFree(L->m.dy_up));
    L->m.pw = L->m.wd = L->m.dy_up = nullptr;
    L->m.cast_table = nullptr;
    lab_free(L);
}
static float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
static bf16* to_device_bf16(const std::vector<float>& h) {
    std::vector<bf16> b(h.size());
    for (size_t i = 0; i < h.size(); i++) b[i] = __float2bfloat16_rn(h[i]);
    bf16* d;
    cudaCheck(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(bf16)));
    cudaCheck(cudaMemcpy(d, b.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    return d;
}
static std::vector<float> to_host_bf16(const bf16* d, size_t n) {
    std::vector<bf16> b(n);
    cudaCheck(cudaMemcpy(b.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<float> h(n);
    for (size_t i = 0; i < n; i++) h[i] = __bfloat162float(b[i]);
    return h;
}
static void poison_bf16(bf16* d, size_t n) { cudaCheck(cudaMemset(d, 0xFF, n * sizeof(bf16))); }  // NaN
// |got - ref| <= rtol_ref * |ref| + rtol_mag * sum|products| elementwise (NaN fails)
static void check_bf16(const std::string& name, const std::vector<float>& got, const std::vector<float>& ref,
                       const std::vector<float>& mag, double rtol_ref, double rtol_mag) {
    double max_err = 0.0;
    size_t max_i = 0, bad = 0;
    for (size_t i = 0; i < got.size(); i++) {
        double err = fabs((double)got[i] - ref[i]);
        if (!(err == err)) err = INFINITY;
        const double tol = rtol_ref * fabs((double)ref[i]) + rtol_mag * mag[i] + 1e-30;
        if (!(err <= tol)) bad++;
        if (err > max_err || (bad == 1 && !(err <= tol))) {
            max_err = err;
            max_i = i;
        }
    }
    char line[512];
    snprintf(line, sizeof line, "%s: max |err| %.3e at [%zu] (got %.7g, ref %.7g), %zu of %zu above %.1e*|ref| + "
             "%.0e*sum|products|", name.c_str(), max_err, max_i, got.empty() ? 0.f : got[max_i],
             ref.empty() ? 0.f : ref[max_i], bad, got.size(), rtol_ref, rtol_mag);
    report(bad == 0, line);
}
static const double V7_RTOL_OUT = 1.0 / 256, V7_RTOL_MAG = 1e-4;

// a variant of the bf16 versions: version 7 forces the B tile width `shape` (0: the plan's), version 8 the tile
// `shape` (-1: the plan's); splits 0: the plan's
struct BfVariant { int shape, splits; };
static void bf16_variant_set(int version, const BfVariant& v) {
    g_conv8_force = version == 8;
    g_cw_bn = version == 7 ? v.shape : 0;
    g_cw_splits = version == 7 ? v.splits : 0;
    g_conv8_tile = version == 8 ? v.shape : -1;
    g_conv8_splits = version == 8 ? v.splits : 0;
}
static std::string bf16_variant_name(int version, const BfVariant& v) {
    if (v.splits == 0) return "plan";
    return (version == 7 ? "bn " + std::to_string(v.shape) : std::string(C8_TILE_NAME[v.shape])) + " splits " +
           std::to_string(v.splits);
}
static void run_case_bf16(int version, int B, int H, int W, int cin, int cout, int s, uint64_t seed) {
    ConvLab L;
    lab_init_bf16(&L, B, H, W, cin, cout, s);
    size_t nx = (size_t)B * H * W * cin, ny = (size_t)B * L.Ho * L.Wo * cout, nw = 9 * (size_t)cin * cout;
    std::vector<float> x(nx), w(nw), bias(cout), dy(ny);
    uint64_t k = 0;
    for (auto& v : x) v = bf16_round(2.f * rng_uniform(seed, 7, k++) - 1.f);
    for (auto& v : w) v = bf16_round((2.f * rng_uniform(seed, 8, k++) - 1.f) / sqrtf(9.f * cin));
    for (auto& v : bias) v = 2.f * rng_uniform(seed, 9, k++) - 1.f;
    for (auto& v : dy) v = bf16_round(2.f * rng_uniform(seed, 10, k++) - 1.f);
    std::vector<float> y(ny), ymag(ny), dx(nx), dxmag(nx), dw(nw), dwmag(nw);
    conv3x3_cpu_forward(x.data(), w.data(), bias.data(), y.data(), ymag.data(), B, H, W, cin, cout, s);
    conv3x3_cpu_backward(x.data(), w.data(), dy.data(), dx.data(), dxmag.data(), dw.data(), dwmag.data(), nullptr, B,
                         H, W, cin, cout, s);
    bf16 *d_x = to_device_bf16(x), *d_dy = to_device_bf16(dy), *d_y, *d_dx;
    cudaCheck(cudaMalloc(&d_y, ny * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_dx, nx * sizeof(bf16)));
    cudaCheck(cudaMemcpy(L.m.p, w.data(), nw * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p + L.c.b, bias.data(), cout * 4, cudaMemcpyHostToDevice));
    unet_weights_changed(&L.m);
    char name[160];
    snprintf(name, sizeof name, "v%d B%d %dx%d cin %d cout %d stride %d", version, B, H, W, cin, cout, s);
    const bool wg = conv_wg_ok(L.c);
    std::vector<BfVariant> vars = {{version == 7 ? 0 : -1, 0}};
    if (wg) {
        std::vector<int> shapes(CW_BNS, CW_BNS + 4);  // version 7: the widths; 8: the tiles
        if (version == 8) shapes = {C8_64x64};
        if (version == 8 && conv8_big_tile_fits()) shapes.insert(shapes.begin(), C8_128x128);
        for (int sh : shapes)
            for (int sp : {1, 3}) vars.push_back({sh, sp});
    }
    std::vector<std::vector<float>> first(3);
    bool agree = true;
    for (const BfVariant& v : vars) {
        bf16_variant_set(version, v);
        std::string nm = std::string(name) + " [" + (wg ? bf16_variant_name(version, v) : "thin") + "]";
        poison_bf16(d_y, ny);
        conv3x3_forward(&L.m, L.c, (const bf16*)d_x, d_y, H, W, nullptr, nullptr);
        std::vector<float> gy = to_host_bf16(d_y, ny);
        check_bf16(nm + " forward", gy, y, ymag, V7_RTOL_OUT, V7_RTOL_MAG);
        poison_bf16(d_dx, nx);
        conv3x3_backward_data(&L.m, L.c, (const bf16*)d_dy, d_dx, H, W, false);
        std::vector<float> gdx = to_host_bf16(d_dx, nx);
        check_bf16(nm + " backward-data", gdx, dx, dxmag, V7_RTOL_OUT, V7_RTOL_MAG);
        fill_nan(L.m.g, nw);
        conv3x3_backward_weight(&L.m, L.c, (const bf16*)d_x, (const bf16*)d_dy, H, W);
        std::vector<float> gdw = to_host(L.m.g, nw);
        check_bf16(nm + " weight-grad", gdw, dw, dwmag, 0.0, V7_RTOL_MAG);
        if (v.splits == 1) {
            if (first[0].empty()) first = {gy, gdx, gdw};
            else agree = agree && bits_equal(gy, first[0]) && bits_equal(gdx, first[1]) && bits_equal(gdw, first[2]);
        }
    }
    bf16_variant_set(7, {0, 0});  // back to the plan, version 8 no longer forced
    // version 8: every tile sums each output's k-tiles and k16 steps in the same order (version 7's widths differ
    // in how wgmma splits a k-tile, so there it is information)
    if (wg && version == 8)
        report(agree, std::string(name) + ": every tile with K whole gives the same bits (forward, backward-data, "
                                          "weight-grad)");
    else if (wg) printf("info %s: the tile widths with K whole give %s bits\n", name, agree ? "the same" : "different");
    bf16* fs[] = {d_x, d_dy, d_y, d_dx};
    for (bf16* q : fs) cudaCheck(cudaFree(q));
    lab_free_bf16(&L);
}

// version 7 timings at every UNet layer shape (batch 32), the plan and each forced tile width; version 6 (TF32)
// timed in the same run for the ratio
static void bench7() {
    printf("version 7 (bf16 wgmma), batch %d; ms per pass and TFLOP/s (v6 TF32 beside it, same run)\n", BENCH_B);
    printf("%-24s %29s %29s %29s\n", "shape", "forward", "backward-data", "weight-grad");
    double total7 = 0, total6 = 0, total_flops = 0;
    for (const BenchShape& sh : UNET_SHAPES) {
        ConvLab L;
        lab_init_bf16(&L, BENCH_B, sh.H, sh.H, sh.cin, sh.cout, sh.s);
        size_t nx = (size_t)BENCH_B * sh.H * sh.H * sh.cin, ny = (size_t)BENCH_B * L.Ho * L.Wo * sh.cout;
        std::vector<float> hx(nx), hy(ny);
        uint64_t k = 0;
        for (auto& v : hx) v = 2.f * rng_uniform(5, 1, k++) - 1.f;  // random data: zeros run faster than real data
        for (auto& v : hy) v = 2.f * rng_uniform(5, 2, k++) - 1.f;
        bf16 *x = to_device_bf16(hx), *y = to_device_bf16(hy), *dx;
        cudaCheck(cudaMalloc(&dx, nx * sizeof(bf16)));
        std::vector<float> hw(L.m.n_params);
        for (auto& v : hw) v = 0.05f * (2.f * rng_uniform(5, 3, k++) - 1.f);
        cudaCheck(cudaMemcpy(L.m.p, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
        unet_weights_changed(&L.m);
        float *x6 = dev_alloc(nx), *y6 = dev_alloc(ny), *dx6 = dev_alloc(nx);
        cudaCheck(cudaMemcpy(x6, hx.data(), nx * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(y6, hy.data(), ny * 4, cudaMemcpyHostToDevice));
        const double flops = 2.0 * BENCH_B * L.Ho * L.Wo * 9.0 * sh.cin * sh.cout;
        char name[64];
        snprintf(name, sizeof name, "%dx%d %d->%d s%d x%d", sh.H, sh.H, sh.cin, sh.cout, sh.s, sh.count);
        printf("%-24s", name);
        for (int pass = 0; pass < 3; pass++) {
            auto run7 = [&]() {
                if (pass == 0) conv3x3_forward(&L.m, L.c, (const bf16*)x, y, sh.H, sh.H, nullptr, nullptr);
                else if (pass == 1) conv3x3_backward_data(&L.m, L.c, (const bf16*)y, dx, sh.H, sh.H, false);
                else conv3x3_backward_weight(&L.m, L.c, (const bf16*)x, (const bf16*)y, sh.H, sh.H);
            };
            auto run6 = [&]() {
                if (pass == 0) conv3x3_forward(&L.m, L.c, (const float*)x6, y6, sh.H, sh.H, nullptr, nullptr);
                else if (pass == 1) conv3x3_backward_data(&L.m, L.c, (const float*)y6, dx6, sh.H, sh.H, false);
                else conv3x3_backward_weight(&L.m, L.c, (const float*)x6, (const float*)y6, sh.H, sh.H);
            };
            float ms7 = time_ms(run7);
            select_version(6);
            float ms6 = time_ms(run6);
            printf("  %7.3f ms %5.1f (v6 %5.1f)", ms7, flops / (ms7 * 1e-3) / 1e12, flops / (ms6 * 1e-3) / 1e12);
            if (!(pass == 1 && sh.cin == 3)) {
                total7 += sh.count * ms7;
                total6 += sh.count * ms6;
                total_flops += sh.count * flops;
            }
        }
        printf("\n");
        if (conv_wg_ok(L.c)) {  // each tile width, the plan's K split
            printf("%-24s", "  widths 64/128/192/256");
            for (int pass = 0; pass < 3; pass++) {
                printf("  ");
                for (int bn : CW_BNS) {
                    g_cw_bn = bn;
                    float ms = time_ms([&]() {
                        if (pass == 0) conv3x3_forward(&L.m, L.c, (const bf16*)x, y, sh.H, sh.H, nullptr, nullptr);
                        else if (pass == 1) conv3x3_backward_data(&L.m, L.c, (const bf16*)y, dx, sh.H, sh.H, false);
                        else conv3x3_backward_weight(&L.m, L.c, (const bf16*)x, (const bf16*)y, sh.H, sh.H);
                    });
                    printf(" %5.0f", flops / (ms * 1e-3) / 1e12);
                }
                g_cw_bn = 0;
            }
            printf("\n");
        }
        bf16* fs[] = {x, y, dx};
        for (bf16* q : fs) cudaCheck(cudaFree(q));
        float* f6[] = {x6, y6, dx6};
        for (float* q : f6) cudaCheck(cudaFree(q));
        lab_free_bf16(&L);
    }
    printf("version 7: every 3x3 convolution of a training step (weighted by count): %.2f ms, %.1f TFLOP/s\n", total7,
           total_flops / (total7 * 1e-3) / 1e12);
    printf("version 6 (same run): %.2f ms, %.1f TFLOP/s\n", total6, total_flops / (total6 * 1e-3) / 1e12);
}

// version 8 timings at every UNet layer shape (batch 32): the plan and each forced tile; version 7 (wgmma) timed
// beside it in the same run where the binary and the GPU have sm_90a
static void bench8() {
    const bool v7 = have_sm90a();
    printf("version 8 (bf16 mma.sync), batch %d; ms per pass and TFLOP/s%s\n", BENCH_B,
           v7 ? " (v7 wgmma beside it, same run)" : " (no sm_90a here: version 7 not timed)");
    printf("%-24s %29s %29s %29s\n", "shape", "forward", "backward-data", "weight-grad");
    double total8 = 0, total7 = 0, total_flops = 0;
    for (const BenchShape& sh : UNET_SHAPES) {
        ConvLab L;
        lab_init_bf16(&L, BENCH_B, sh.H, sh.H, sh.cin, sh.cout, sh.s);
        size_t nx = (size_t)BENCH_B * sh.H * sh.H * sh.cin, ny = (size_t)BENCH_B * L.Ho * L.Wo * sh.cout;
        std::vector<float> hx(nx), hy(ny);
        uint64_t k = 0;
        for (auto& v : hx) v = 2.f * rng_uniform(5, 1, k++) - 1.f;  // random data: zeros run faster than real data
        for (auto& v : hy) v = 2.f * rng_uniform(5, 2, k++) - 1.f;
        bf16 *x = to_device_bf16(hx), *y = to_device_bf16(hy), *dx;
        cudaCheck(cudaMalloc(&dx, nx * sizeof(bf16)));
        std::vector<float> hw(L.m.n_params);
        for (auto& v : hw) v = 0.05f * (2.f * rng_uniform(5, 3, k++) - 1.f);
        cudaCheck(cudaMemcpy(L.m.p, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
        unet_weights_changed(&L.m);
        const double flops = 2.0 * BENCH_B * L.Ho * L.Wo * 9.0 * sh.cin * sh.cout;
        auto run = [&](int pass) {
            if (pass == 0) conv3x3_forward(&L.m, L.c, (const bf16*)x, y, sh.H, sh.H, nullptr, nullptr);
            else if (pass == 1) conv3x3_backward_data(&L.m, L.c, (const bf16*)y, dx, sh.H, sh.H, false);
            else conv3x3_backward_weight(&L.m, L.c, (const bf16*)x, (const bf16*)y, sh.H, sh.H);
        };
        auto tf = [&](float ms) { return flops / (ms * 1e-3) / 1e12; };
        char name[64];
        snprintf(name, sizeof name, "%dx%d %d->%d s%d x%d", sh.H, sh.H, sh.cin, sh.cout, sh.s, sh.count);
        printf("%-24s", name);
        for (int pass = 0; pass < 3; pass++) {
            bf16_variant_set(8, {-1, 0});
            const float ms8 = time_ms([&]() { run(pass); });
            float ms7 = NAN;
            if (v7) {
                bf16_variant_set(7, {0, 0});
                ms7 = time_ms([&]() { run(pass); });
            }
            printf("  %7.3f ms %5.1f (v7 %5.1f)", ms8, tf(ms8), tf(ms7));
            if (!(pass == 1 && sh.cin == 3)) {
                total8 += sh.count * ms8;
                total7 += sh.count * ms7;
                total_flops += sh.count * flops;
            }
        }
        printf("\n");
        if (conv_wg_ok(L.c)) {  // each tile, with its own K split
            printf("%-24s", "  tiles t0/t1");
            for (int pass = 0; pass < 3; pass++) {
                printf("  ");
                for (int t = 0; t < C8_NTILES; t++) {
                    if (t == C8_128x128 && !conv8_big_tile_fits()) {
                        printf("     -");
                        continue;
                    }
                    bf16_variant_set(8, {t, 0});
                    printf(" %5.0f", tf(time_ms([&]() { run(pass); })));
                }
            }
            printf("\n");
        }
        bf16_variant_set(7, {0, 0});
        bf16* fs[] = {x, y, dx};
        for (bf16* q : fs) cudaCheck(cudaFree(q));
        lab_free_bf16(&L);
    }
    for (int t = 0; t < C8_NTILES; t++) printf("  t%d = %s\n", t, C8_TILE_NAME[t]);
    printf("version 8: every 3x3 convolution of a training step (weighted by count): %.2f ms, %.1f TFLOP/s\n", total8,
           total_flops / (total8 * 1e-3) / 1e12);
    if (v7)
        printf("version 7 (same run): %.2f ms, %.1f TFLOP/s\n", total7, total_flops / (total7 * 1e-3) / 1e12);
}

// ---------------------------------------------------------------------------------------------------------------
// CPU (runs in CI): version 8's fragment addressing (conv8_a_lds, conv8_b_lds: the kernel's own functions) on an
// emulated warp. ldmatrix.x4 (.trans in MODE 1) and mma.m16n8k16 as the PTX ISA defines them (train_unet.cu's
// comment above Conv8), over a k-tile laid out as the kernel lays a stage out (its row strides, the padding NaN);
// every warp of the tile computes its block, mapped back to (m, n) as the kernel's epilogue maps it, and must equal
// the plain product (small integers: exact) with every output written once. Every ldmatrix phase (8 lanes) must
// also read 16-byte aligned rows in 8 different 16-byte bank groups (conflict-free).
struct EmuReg { float lo, hi; };  // a 32-bit register: two bf16, the lower index in the low half
// r[lane][i], lanes handing in the element offsets off[lane] of their rows
static void emu_ldmatrix_x4(const std::vector<float>& sm, const int (&off)[32], bool trans, EmuReg* r /* [32][4] */) {
    for (int L = 0; L < 32; L++)
        for (int i = 0; i < 4; i++) {
            const int row = L / 4, col = 2 * (L % 4);  // lane L's elements of matrix i (transposed with .trans)
            if (!trans) r[4 * L + i] = {sm[off[8 * i + row] + col], sm[off[8 * i + row] + col + 1]};
            else r[4 * L + i] = {sm[off[8 * i + col] + row], sm[off[8 * i + col + 1] + row]};
        }
}
// d (+)= A B: register i of A is row gq + 8 (i & 1), k 2tq + 8 (i >> 1); b_i is k 2tq + 8i, n gq; d_i is row
// gq + 8 (i >> 1), n 2tq + (i & 1)
static void emu_mma_16816(const EmuReg* a /* [32][4] */, const EmuReg* b /* [32][2] */, float* d /* [32][4] */) {
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        const int gq = L / 4, tq = L % 4;
        for (int i = 0; i < 4; i++) {
            const int r = gq + 8 * (i & 1), c = 2 * tq + 8 * (i >> 1);
            A[r][c] = a[4 * L + i].lo;
            A[r][c + 1] = a[4 * L + i].hi;
        }
        for (int i = 0; i < 2; i++) {
            B[2 * tq + 8 * i][gq] = b[2 * L + i].lo;
            B[2 * tq + 8 * i + 1][gq] = b[2 * L + i].hi;
        }
    }
    for (int L = 0; L < 32; L++)
        for (int i = 0; i < 4; i++) {
            const int r = L / 4 + 8 * (i >> 1), c = 2 * (L % 4) + (i & 1);
            double s = d[4 * L + i];
            for (int k = 0; k < 16; k++) s += (double)A[r][k] * B[k][c];
            d[4 * L + i] = (float)s;
        }
}
// the 8 lanes of each ldmatrix phase: 16-byte aligned rows in 8 different bank groups
static bool emu_conflict_free(const int (&off)[32]) {
    for (int q = 0; q < 4; q++) {
        int seen = 0;
        for (int r = 0; r < 8; r++) {
            const int e = off[8 * q + r];
            if (e % 8) return false;
            seen |= 1 << ((e * 2 / 16) % 8);
        }
        if (seen != 0xff) return false;
    }
    return true;
}
template <int MODE, int BM, int BN, int WM, int WN>
static void conv8_fragments_cpu(uint64_t seed) {
    using T = Conv8<MODE, BM, BN, WM, WN>;
    std::vector<float> Am((size_t)BM * C8_BK), Bm((size_t)C8_BK * BN);  // A (m, k), B (k, n): integers in [-3, 3]
    uint64_t q = 0;
    for (auto& v : Am) v = floorf(7.f * rng_uniform(seed, 1, q++)) - 3.f;
    for (auto& v : Bm) v = floorf(7.f * rng_uniform(seed, 2, q++)) - 3.f;
    std::vector<float> As(T::A_ELEMS, NAN), Bs(T::B_ELEMS, NAN);  // the stage, padding NaN
    for (int m = 0; m < BM; m++)
        for (int k = 0; k < C8_BK; k++) As[MODE == 0 ? m * T::A_LD + k : k * T::A_LD + m] = Am[m * C8_BK + k];
    for (int n = 0; n < BN; n++)
        for (int k = 0; k < C8_BK; k++) Bs[MODE == 0 ? n * T::B_LD + k : k * T::B_LD + n] = Bm[k * BN + n];
    std::vector<int> written((size_t)BM * BN, 0);
    size_t bad = 0;
    bool conflict_free = true;
    for (int warp = 0; warp < T::THREADS / 32; warp++) {
        const int wm = warp % T::WARPS_M, wn = warp / T::WARPS_M;
        std::vector<float> acc((size_t)T::MI * T::NI * 32 * 4, 0.f);  // [i][j][lane][4]
        for (int kk = 0; kk < C8_BK; kk += 16) {
            std::vector<EmuReg> a((size_t)T::MI * 32 * 4), b((size_t)T::NI * 32 * 2);  // [i][lane][4], [j][lane][2]
            EmuReg r[32 * 4];
            int off[32];
            for (int i = 0; i < T::MI; i++) {
                for (int L = 0; L < 32; L++) off[L] = conv8_a_lds<MODE>(L, T::A_LD, wm * WM + i * 16, kk);
                conflict_free = conflict_free && emu_conflict_free(off);
                emu_ldmatrix_x4(As, off, MODE == 1, a.data() + (size_t)i * 128);
            }
            for (int j = 0; j < T::NI; j += 2) {
                for (int L = 0; L < 32; L++) off[L] = conv8_b_lds<MODE>(L, T::B_LD, wn * WN + j * 8, kk);
                conflict_free = conflict_free && emu_conflict_free(off);
                emu_ldmatrix_x4(Bs, off, MODE == 1, r);
                for (int L = 0; L < 32; L++) {  // the kernel's assignment: b[j] = r0, r1; b[j + 1] = r2, r3
                    b[((size_t)j * 32 + L) * 2] = r[4 * L];
                    b[((size_t)j * 32 + L) * 2 + 1] = r[4 * L + 1];
                    b[((size_t)(j + 1) * 32 + L) * 2] = r[4 * L + 2];
                    b[((size_t)(j + 1) * 32 + L) * 2 + 1] = r[4 * L + 3];
                }
            }
            for (int i = 0; i < T::MI; i++)
                for (int j = 0; j < T::NI; j++)
                    emu_mma_16816(a.data() + (size_t)i * 128, b.data() + (size_t)j * 64,
                                  acc.data() + ((size_t)i * T::NI + j) * 128);
        }
        for (int i = 0; i < T::MI; i++)  // the kernel's epilogue: acc[i][j][2h + e] is (m, n) below
            for (int j = 0; j < T::NI; j++)
                for (int L = 0; L < 32; L++)
                    for (int h = 0; h < 2; h++)
                        for (int e = 0; e < 2; e++) {
                            const int m = wm * WM + i * 16 + L / 4 + 8 * h, n = wn * WN + j * 8 + 2 * (L % 4) + e;
                            double ref = 0;
                            for (int k = 0; k < C8_BK; k++) ref += (double)Am[m * C8_BK + k] * Bm[k * BN + n];
                            if (!(acc[(((size_t)i * T::NI + j) * 32 + L) * 4 + 2 * h + e] == (float)ref)) bad++;
                            written[(size_t)m * BN + n]++;
                        }
    }
    size_t once = 0;
    for (int c : written) once += c == 1;
    char line[256];
    snprintf(line, sizeof line, "cpu: version 8 fragments, MODE %d, tile %dx%d (warps %dx%d): %zu of %d outputs wrong, "
             "%zu written exactly once, ldmatrix conflict-free: %s", MODE, BM, BN, WM, WN, bad, BM * BN, once,
             conflict_free ? "yes" : "NO");
    report(bad == 0 && once == (size_t)BM * BN && conflict_free, line);
}
// the kernel's four configurations
static void conv8_fragments_cpu_all() {
    conv8_fragments_cpu<0, 128, 128, 64, 32>(11);
    conv8_fragments_cpu<0, 64, 64, 32, 32>(12);
    conv8_fragments_cpu<1, 128, 128, 64, 32>(13);
    conv8_fragments_cpu<1, 64, 64, 32, 32>(14);
}

int main(int argc, char** argv) {
    int version = lab_version(argc, argv, 8, 6,
                              "1 naive, 2/3 implicit GEMM fp32/TF32, 4/5 pipelined fp32/TF32, 6 mma.sync TF32, "
                              "7 bf16 wgmma, 8 bf16 mma.sync");
    bool test = version == 0;
    ConvFixture fx;
    bool have_fx = conv_fixture_load(&fx, "conv3x3", 1001, "", 1, false);
    if (have_fx) fixture_cpu(fx, "conv3x3", 1);  // CPU: runs in CI
    conv8_fragments_cpu_all();                    // CPU too
    if (!gpu_setup()) {
        skip("conv2d GPU versions: no CUDA GPU");
        return finish();
    }
    // awkward sizes: odd spatial sizes, channels off the tile (scalar loader) and on it (float4 loader), stride 2
    // version 6 also: M and N off every tile (N = 36, 160, 200), stride 2 with odd sizes in both directions,
    // N <= 8 (3 and 5 padded to 8; 8)
    struct Case { int B, H, W, cin, cout, s; } cases[] = {
        {3, 7, 5, 3, 37, 1}, {2, 9, 9, 40, 3, 1}, {3, 7, 7, 64, 96, 1}, {2, 9, 11, 96, 64, 2}, {1, 8, 8, 32, 32, 2},
        {2, 13, 6, 20, 12, 2}, {5, 16, 16, 64, 128, 1}, {3, 10, 10, 160, 36, 1}, {2, 11, 7, 32, 200, 2},
        {2, 9, 7, 64, 32, 2}, {4, 12, 12, 96, 160, 1}, {2, 9, 7, 64, 3, 1}, {3, 8, 8, 32, 5, 2}, {2, 6, 10, 32, 8, 1}};
    std::vector<int> versions = test ? std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8} : std::vector<int>{version};
    uint64_t seed = 1;
    for (int v : versions) {
        if (v == 7 || v == 8) {  // bf16: wgmma needs an sm_90a build on a 9.0 GPU, mma.sync compute capability 8.0
            if (v == 7 && !have_sm90a()) {
                skip("conv2d version 7: needs the sm_90a build on a compute capability 9.0 GPU");
                continue;
            }
            if (v == 8 && !have_bf16_mma()) {
                skip("conv2d version 8: needs a GPU of compute capability 8.0 or newer");
                continue;
            }
            for (const Case& c : cases) run_case_bf16(v, c.B, c.H, c.W, c.cin, c.cout, c.s, seed++);
            // model-like layers: 64-channel multiples, the 8x8 boxes of two images, 32 channels (boxes half empty)
            run_case_bf16(v, 3, 8, 8, 256, 256, 1, seed++);
            run_case_bf16(v, 2, 16, 16, 192, 192, 2, seed++);
            run_case_bf16(v, 1, 32, 32, 128, 64, 1, seed++);
            run_case_bf16(v, 2, 64, 64, 64, 64, 1, seed++);
            run_case_bf16(v, 7, 8, 8, 512, 256, 1, seed++);
            continue;
        }
        for (const Case& c : cases) run_case(v, c.B, c.H, c.W, c.cin, c.cout, c.s, seed++);
        if (have_fx) fixture_gpu(fx, "conv3x3", 1, v);
        if (have_fx && v == 6) {
            fixture_gpu_padded(fx, "conv3x3", 1, true);
            fixture_gpu_padded(fx, "conv3x3", 1, false);
        }
    }
    if (!test) {
        if (version == 7) bench7();
        else if (version == 8) bench8();
        else bench(version);
    }
    gpu_teardown();
    return finish();
}
