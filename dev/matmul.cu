/*
SGEMM kernels: C = alpha * op(A) op(B) + beta * C, fp32 in and out (version 8: bf16 A and B), row-major, op = N (as
stored) or T (transposed).
op(A) is M x K, op(B) is K x N. A is stored M x K (lda >= K) or, transposed, K x M (lda >= M); B is stored K x N
(ldb >= N) or, transposed, N x K (ldb >= K). beta == 0 never reads C (C may hold NaN). Any M, N, K >= 0.
A numbered progression after siboehm/SGEMM_CUDA; every version handles every size, transpose and leading dimension.

Build:  make -C dev matmul        (nvcc -O3 -std=c++17 -lineinfo <gencode> -o matmul matmul.cu -lcublas; on a 9.0
                                  GPU the gencode is compute_90a/sm_90a, needed by versions 7 and 8)
Test:   ./dev/matmul --test       every version x every transpose vs the CPU oracle (double accumulation) at awkward
                                  sizes, fresh random inputs, C poisoned with NaN; CPU-only checks run without a GPU
Bench:  ./dev/matmul [all | VERSION] [--square] [--repeat R] [--out DIR]   validate vs cuBLAS, then time 4096^3 and
                                  the MNIST layer shapes (--square: 4096^3 only; --repeat: R rounds, medians)
PyTorch: dev/torch_ops includes this file with DEV_KERNELS_ONLY (versions 1-8; no cuBLAS, tests or main) and calls
versions 5 and 7 (fp32) and 8 (bf16, where the GPU runs sm_90a code) from its matmul operator.

version 0: cuBLAS. Strict fp32 (CUBLAS_DEFAULT_MATH: TF32 off) is the baseline of the fp32 versions;
           CUBLAS_TF32_TENSOR_OP_MATH is the baseline of the TF32 versions, cublasGemmEx bf16 (CUBLAS_COMPUTE_32F) that
           of version 8.
version 1: naive: one thread per output, A and B read straight from global memory.
version 2: the write-up's 32x32 shared-memory tile (one output per thread, __syncthreads between tiles), made correct
           for any M, N, K, both transposes and any leading dimension (zero-filled edge tiles, coalesced loads).
version 3: 2D register blocking: 128x128 block tile, BK = 8, each thread accumulates an 8x8 patch in registers
           (the 1D-blocktiling step of siboehm's series is skipped); scalar global loads.
version 4: version 3 with 16-byte vectorised global loads (float4 where the chunk is in bounds and the leading
           dimension and pointer are 16-byte aligned, scalar otherwise) and float4 shared-memory reads.
version 5: warptiling + double buffering: lanes in a 4x8 grid, each thread owning RMxRN strided 4x4 sub-tiles
           (float4 shared reads without bank conflicts); the next k-tile is fetched into registers while the current
           one is computed (one __syncthreads per k-tile); grouped block order for L2 reuse; tile shape chosen per
           problem (128x128, 128x64, 128x32, 64x64, 32x32) and deterministic split-K for few tiles with long K.
           Big problems (>= 2 waves of 256x128 tiles, e.g. 4096^3) run its asynchronous-pipeline form instead:
           256x128x16 tiles, 8x16 outputs per thread, both tiles copied by cp.async 3 k-tiles deep (A transposed
           by the copy), fragments double-buffered in registers (the register-staged 256x128 kernel it replaced
           is kept as a benchmark variant). THE TRAINER'S fp32 KERNEL: matmul_sgemm_v5().
version 6: TF32 tensor cores: mma.sync.m16n8k8 (inputs rounded to nearest TF32 by adding half a TF32 ulp to the
           bits, fp32 accumulation), cp.async 3-stage pipeline (tiles copied in their global layout, padded so
           fragment reads are conflict-free), 64x64 warp tiles, per-problem tiles and split-K as in version 5.
           matmul_sgemm_tf32_v6().
version 7: Hopper TF32 wgmma (sm_90a only): a producer warpgroup issues TMA box copies (128-byte swizzle) into a
           4-stage mbarrier pipeline, two consumer warpgroups run wgmma.m64n256k8 on 128x256 tiles with A fed from
           registers (rounded to nearest TF32) and B from shared memory; B is staged K-major and rounded by a
           transpose/copy pass inside the call (TF32 wgmma reads only K-major operands). matmul_sgemm_tf32_v7();
           runs version 6 without sm_90a code, for N <= 32 and where version 6 splits K. Built for sm_90a by the
           matmul line of dev/Makefile; elsewhere the tests and benchmark report version 7 as SKIP.
version 8: bf16 GEMM (A, B bf16, fp32 accumulation, fp32 C with alpha / beta) on Hopper wgmma m64nNk16, sm_90a: a
           producer warpgroup issues TMA box copies (128-byte swizzle) into a 4-stage mbarrier ring, two consumer
           warpgroups (setmaxnreg 232 / producer 40) each run 64 x 256 of a 128 x 256 tile with one wgmma group in
           flight; persistent blocks walk the tiles in grouped order. All four transposes go straight to TMA (an
           operand that is not K-major is read MN-major with wgmma's transpose bit). matmul_bf16_v8(); a CUDA-core
           fallback (64 x 64 tiles, fp32 FMAs) without sm_90a code, for K = 0 and for operands TMA cannot read
           (row stride not a multiple of 16 bytes, base not 16-byte aligned). Baseline: cuBLAS bf16 (cublasGemmEx,
           CUBLAS_COMPUTE_32F). Tested on operands rounded to bf16 first, at the fp32-accumulation bound.
*/
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <cerrno>
#include <cfenv>
#include <sys/stat.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>

// ----------------------------------------------------------------------------------------------------------------
// error checking

static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
#ifdef CUDA_CHECK_THROWS  // inside PyTorch (dev/torch_ops): an exception the caller turns into a Python error
        throw std::runtime_error(std::string("[CUDA ERROR] ") + call + " failed at " + file + ":" +
                                 std::to_string(line) + ": " + cudaGetErrorString(err));
#endif
        fprintf(stderr, "[CUDA ERROR] %s failed at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)

static void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "[cuBLAS ERROR] %s failed at %s:%d: status %d\n", call, file, line, (int)status);
        exit(EXIT_FAILURE);
    }
}
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)

static FILE* fopen_check(const char* path, const char* mode, const char* file, int line) {
    FILE* f = fopen(path, mode);
    if (f == nullptr) {
        fprintf(stderr, "[FOPEN ERROR] cannot open %s (mode %s) at %s:%d: %s\n", path, mode, file, line,
                strerror(errno));
        exit(EXIT_FAILURE);
    }
    return f;
}
#define fopenCheck(path, mode) fopen_check((path), (mode), __FILE__, __LINE__)

__host__ __device__ static inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ----------------------------------------------------------------------------------------------------------------
// host-side argument checks and shared launcher state (used by every version)

static void matmul_check_args(const char* fn, bool trans_a, bool trans_b, int M, int N, int K, const void* A,
                              int lda, const void* B, int ldb, const void* C, int ldc) {
    const char* bad = nullptr;
    long long expected = 0, found = 0;
    if (M < 0) { bad = "M"; expected = 0; found = M; }
    else if (N < 0) { bad = "N"; expected = 0; found = N; }
    else if (K < 0) { bad = "K"; expected = 0; found = K; }
    else if (lda < std::max(1, trans_a ? M : K)) { bad = "lda"; expected = std::max(1, trans_a ? M : K); found = lda; }
    else if (ldb < std::max(1, trans_b ? K : N)) { bad = "ldb"; expected = std::max(1, trans_b ? K : N); found = ldb; }
    else if (ldc < std::max(1, N)) { bad = "ldc"; expected = std::max(1, N); found = ldc; }
    if (bad) {
        fprintf(stderr, "%s: argument %s = %lld, expected >= %lld (M=%d N=%d K=%d trans_a=%d trans_b=%d)\n", fn, bad,
                found, expected, M, N, K, (int)trans_a, (int)trans_b);
        exit(EXIT_FAILURE);
    }
    if ((long long)M * N > 0 && C == nullptr) { fprintf(stderr, "%s: argument C is null\n", fn); exit(EXIT_FAILURE); }
    if ((long long)M * N * K > 0 && (A == nullptr || B == nullptr)) {
        fprintf(stderr, "%s: argument %s is null\n", fn, A == nullptr ? "A" : "B");
        exit(EXIT_FAILURE);
    }
}

static int matmul_num_sms() {
    static int sms = 0;
    if (sms == 0) {
        int device;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    }
    return sms;
}

// 16-byte vector access to a row-major operand is safe when its base and every row start are 16-byte aligned.
static bool matmul_vec_ok(const float* p, int ld) { return ((uintptr_t)p % 16 == 0) && (ld % 4 == 0); }

// Split-K partial sums (splits x M x N) live in one device buffer that grows on demand and is kept (cudaFree and
// cudaMalloc synchronise, so this happens only on the first calls of a new largest shape). One stream only.
static float* matmul_workspace = nullptr;
static size_t matmul_workspace_floats = 0;
static float* matmul_get_workspace(size_t floats) {
    if (floats > matmul_workspace_floats) {
        if (matmul_workspace) cudaCheck(cudaFree(matmul_workspace));
        cudaCheck(cudaMalloc(&matmul_workspace, floats * sizeof(float)));
        matmul_workspace_floats = floats;
    }
    return matmul_workspace;
}
static void matmul_free_workspace() {
    if (matmul_workspace) cudaCheck(cudaFree(matmul_workspace));
    matmul_workspace = nullptr;
    matmul_workspace_floats = 0;
}

// Splits K when the M x N tiles cannot fill the GPU (conv2 dW at batch 64 has 5 tiles of 64x64 and K = 36864):
// aim at 1024 threads per SM (at least 2 blocks), keep >= max(128, 4*BK) of K per split, cap the workspace at 32M
// floats. k_per_split is a multiple of BK (so every split starts 16-byte aligned) and no split is empty.
static long long matmul_split_target_blocks(int threads_per_block) {
    return (long long)matmul_num_sms() * std::max(2, 1024 / threads_per_block);
}
static void matmul_choose_splits(int M, int N, int K, int BM, int BN, int BK, int threads_per_block, int* splits_out,
                                 int* k_per_split_out) {
    long long tiles = (long long)ceil_div(M, BM) * ceil_div(N, BN);
    int sms = matmul_num_sms();
    const int min_k = std::max(128, 4 * BK);
    long long splits = 1;
    if (tiles < sms && K >= 2 * min_k) {
        long long target = matmul_split_target_blocks(threads_per_block);
        long long want = (target + tiles - 1) / tiles;
        long long by_k = K / min_k;
        long long by_workspace = (32LL << 20) / std::max(1LL, (long long)M * N);
        splits = std::max(1LL, std::min(want, std::min(by_k, by_workspace)));
    }
    int k_per_split = K;
    if (splits > 1) {
        k_per_split = ceil_div(ceil_div(K, (int)splits), BK) * BK;
        splits = ceil_div(K, k_per_split);
    }
    *splits_out = (int)splits;
    *k_per_split_out = k_per_split;
}

// ----------------------------------------------------------------------------------------------------------------
// CPU oracle: double accumulation. Also returns c_abs = |alpha| sum_k |a_mk b_kn| + |beta c_mn|, the scale of the
// rounding error any correct fp32 / TF32 implementation may make (see tolerance_rtol).

static void matmul_cpu_oracle(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                              const float* B, int ldb, float beta, const float* C0, int ldc, double* ref,
                              double* c_abs) {
    // op(A) as M x K and op(B)^T as N x K, both contiguous in k, so the inner loop streams
    std::vector<double> a((size_t)M * K), bt((size_t)N * K);
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) a[(size_t)m * K + k] = trans_a ? A[(size_t)k * lda + m] : A[(size_t)m * lda + k];
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) bt[(size_t)n * K + k] = trans_b ? B[(size_t)n * ldb + k] : B[(size_t)k * ldb + n];
    for (int m = 0; m < M; m++) {
        const double* ar = &a[(size_t)m * K];
        for (int n = 0; n < N; n++) {
            const double* br = &bt[(size_t)n * K];
            double s = 0.0, sa = 0.0;
            for (int k = 0; k < K; k++) {
                double p = ar[k] * br[k];
                s += p;
                sa += fabs(p);
            }
            double r = (double)alpha * s, ra = fabs((double)alpha) * sa;
            if (beta != 0.0f) {
                double c = C0[(size_t)m * ldc + n];
                r += (double)beta * c;
                ra += fabs((double)beta * c);
            }
            ref[(size_t)m * N + n] = r;
            c_abs[(size_t)m * N + n] = ra;
        }
    }
}

// Tolerance |c - ref| <= ATOL + rtol * c_abs (c_abs as above, which unlike |ref| does not vanish under cancellation).
// fp32: every product and add rounds once (u = 2^-24). Higham's bound |err| <= gamma_K * sum|a b| with
//   gamma_K = K u / (1 - K u) holds for ANY summation order (tiles, split-K, FMA), so it never fails a correct
//   kernel; a missed or doubled k term is an error of a whole |a_k b_k| (~ c_abs / K), far above it while K*K*u << 1
//   (K <= 9216 here: K*K*u <= 5). +3u for alpha*acc + beta*c.
// TF32 (version 6, cvt.rna): each input is rounded to a 10-bit mantissa (u_t = 2^-11), so each product is off by
//   <= 2 u_t + u_t^2 relative, whatever K: 2^-10 (1 + 2^-12) c_abs; plus the fp32 accumulation bound, doubled
//   because the tensor core's internal adds are not documented to round to nearest.
// cuBLAS TF32 does not document how it rounds inputs to TF32: allow truncation (u_t = 2^-10, 2^-9 per product).
// bf16 (version 8, cuBLAS bf16): the operands are bf16 and the oracle runs on those exact values (the test rounds
//   its fp32 draws to bf16 first), so no input rounding enters. A product of two bf16 (8-bit significands) has at
//   most 16 significant bits: exact in fp32 and in the tensor core. What is left is the fp32 accumulation, gamma_K
//   as above (+3u for alpha, beta), doubled like the TF32 bounds' share because the tensor core's adds are not
//   documented to round to nearest (each add errs by at most 2u of what it adds: truncation). No allowance for
//   operand rounding: a kernel that rounded the operands again, or not at all, fails at small K (CPU test 3).
// ATOL only matters where every product is ~0 (inputs are uniform in [-1, 1], so products never underflow).
static const double ATOL = 1e-12;
enum Precision { PREC_FP32 = 0, PREC_TF32_RN = 1, PREC_TF32_ANY = 2, PREC_BF16 = 3 };
static double tolerance_rtol(Precision prec, int K) {
    const double u = ldexp(1.0, -24);
    double gamma = (K + 3) * u / (1.0 - (K + 3) * u);
    if (prec == PREC_FP32) return gamma;
    if (prec == PREC_BF16) return 2.0 * gamma;
    if (prec == PREC_TF32_RN) return ldexp(1.0, -10) * (1.0 + ldexp(1.0, -12)) + 2.0 * gamma;
    return ldexp(1.0, -9) * (1.0 + ldexp(1.0, -11)) + 2.0 * gamma;
}

struct CheckResult {
    bool ok;
    double max_err, worst_ratio;  // max |c - ref|, max |c - ref| / tol
    long long worst_index;        // index (m * N + n) of worst_ratio, or of the first NaN
    int nan_count;
};
// c: M x N with leading dimension ldc; ref, c_abs: M x N contiguous.
static CheckResult check_result(const float* c, int ldc, const double* ref, const double* c_abs, int M, int N,
                                double rtol) {
    CheckResult r = {true, 0.0, 0.0, -1, 0};
    long long first_nan = -1;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            size_t i = (size_t)m * N + n;
            double v = c[(size_t)m * ldc + n];
            if (std::isnan(v)) {  // an unwritten (poisoned) element, or a NaN the kernel made
                r.ok = false;
                if (r.nan_count++ == 0) first_nan = (long long)i;
                continue;
            }
            double err = fabs(v - ref[i]);
            double tol = ATOL + rtol * c_abs[i];
            if (!(err <= tol)) r.ok = false;
            if (err > r.max_err) r.max_err = err;
            if (err / tol > r.worst_ratio) { r.worst_ratio = err / tol; r.worst_index = (long long)i; }
        }
    if (r.nan_count > 0) r.worst_index = first_nan;
    return r;
}

// ----------------------------------------------------------------------------------------------------------------
// device helpers

// C[m, n] = alpha * acc + beta * C[m, n]; beta == 0 never reads C (BLAS semantics: C may be uninitialised).
__device__ __forceinline__ void store_out(float* C, int ldc, int m, int n, float acc, float alpha, float beta) {
    float* p = C + (size_t)m * ldc + n;
    float v = alpha * acc;
    if (beta != 0.0f) v = fmaf(beta, *p, v);
    *p = v;
}

// element (r, c) of op(X), X row-major with leading dimension ld
__device__ __forceinline__ float load_op(const float* X, int ld, bool trans, int r, int c) {
    return trans ? X[(size_t)c * ld + r] : X[(size_t)r * ld + c];
}

// Block (bm, bn) of block number pid, in groups of GROUP block-rows so that consecutive blocks share A rows and a
// narrow band of B columns in L2 (the order Triton's matmul tutorial uses).
__device__ __forceinline__ void grouped_tile(int pid, int tiles_m, int tiles_n, int& bm, int& bn, int GROUP = 8) {
    int per_group = GROUP * tiles_n;
    int first_m = (pid / per_group) * GROUP;
    int group_rows = min(tiles_m - first_m, GROUP);
    int in_group = pid % per_group;
    bm = first_m + in_group % group_rows;
    bn = in_group / group_rows;
}

// ----------------------------------------------------------------------------------------------------------------
// version 1: naive

__global__ void matmul_naive_kernel(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                                    int lda, const float* B, int ldb, float beta, float* C, int ldc) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;  // threadIdx.x along n: B (not transposed) and C coalesced
    int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc = fmaf(load_op(A, lda, trans_a, m, k), load_op(B, ldb, trans_b, k, n), acc);
    store_out(C, ldc, m, n, acc, alpha, beta);
}

static void matmul_naive_v1(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                            const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_naive_v1", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    dim3 block(32, 8);
    dim3 grid(ceil_div(N, 32), ceil_div(M, 8));
    matmul_naive_kernel<<<grid, block, 0, stream>>>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------------
// version 2: 32x32 shared-memory tile, one output per thread

#define SMEM_TILE 32
__global__ void matmul_smem_tile_kernel(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                                        const float* A, int lda, const float* B, int ldb, float beta, float* C,
                                        int ldc) {
    // +1 column: the transposed stores (As[tx][ty]) hit 32 different banks
    __shared__ float As[SMEM_TILE][SMEM_TILE + 1];  // As[m][k]
    __shared__ float Bs[SMEM_TILE][SMEM_TILE + 1];  // Bs[k][n]
    int tx = threadIdx.x, ty = threadIdx.y;
    int m0 = blockIdx.y * SMEM_TILE, n0 = blockIdx.x * SMEM_TILE;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += SMEM_TILE) {
        // consecutive tx read consecutive addresses of the stored matrix, transposed or not; out of range -> 0
        if (!trans_a) { int r = m0 + ty, c = k0 + tx; As[ty][tx] = (r < M && c < K) ? A[(size_t)r * lda + c] : 0.0f; }
        else          { int k = k0 + ty, r = m0 + tx; As[tx][ty] = (k < K && r < M) ? A[(size_t)k * lda + r] : 0.0f; }
        if (!trans_b) { int k = k0 + ty, c = n0 + tx; Bs[ty][tx] = (k < K && c < N) ? B[(size_t)k * ldb + c] : 0.0f; }
        else          { int c = n0 + ty, k = k0 + tx; Bs[tx][ty] = (c < N && k < K) ? B[(size_t)c * ldb + k] : 0.0f; }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < SMEM_TILE; k++) acc = fmaf(As[ty][k], Bs[k][tx], acc);
        __syncthreads();
    }
    int m = m0 + ty, n = n0 + tx;
    if (m < M && n < N) store_out(C, ldc, m, n, acc, alpha, beta);
}

static void matmul_smem_tile_v2(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                                int lda, const float* B, int ldb, float beta, float* C, int ldc,
                                cudaStream_t stream) {
    matmul_check_args("matmul_smem_tile_v2", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    dim3 block(SMEM_TILE, SMEM_TILE);
    dim3 grid(ceil_div(N, SMEM_TILE), ceil_div(M, SMEM_TILE));
    matmul_smem_tile_kernel<<<grid, block, 0, stream>>>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C,
                                                        ldc);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------------
// Register-staged tile loader (versions 3, 4, 5): a BO x BK tile of op(X) (BO along M for A or N for B, BK along K)
// is fetched from global memory into registers, then stored k-major into shared memory S[BK][BO + 4], so the
// compute loop reads BO-contiguous float4s. KCONTIG: X is stored with k contiguous (A as stored, B transposed) and
// the store transposes; otherwise rows of S are copied as float4s. Out-of-range elements are zero.

template <int BO, int BK, int NT, bool KCONTIG>
struct TileLoader {
    static_assert(BO % 4 == 0 && BK % 4 == 0, "tiles move in float4 chunks along the contiguous dimension");
    static constexpr int LD = BO + 4;  // +4: transposed stores of the KCONTIG case spread over the banks, and rows
                                       // stay 16-byte aligned for float4 reads
    static constexpr int TOTAL = BO * BK / 4;
    static constexpr int CHUNKS = (TOTAL + NT - 1) / NT;
    float r[CHUNKS][4];

    __device__ __forceinline__ static void chunk_pos(int idx, int& o, int& k) {
        if (KCONTIG) { o = idx / (BK / 4); k = (idx % (BK / 4)) * 4; }
        else         { k = idx / (BO / 4); o = (idx % (BO / 4)) * 4; }
    }

    // tile rows [o0, o0 + BO) of op(X) below olim, k in [k0, k0 + BK) below klim; vec: 16-byte loads allowed
    __device__ __forceinline__ void fetch(const float* X, int ld, int o0, int olim, int k0, int klim, bool vec) {
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            int idx = threadIdx.x + c * NT;
            bool in_tile = (TOTAL % NT == 0) || idx < TOTAL;
            int o, k;
            chunk_pos(idx, o, k);
            int go = o0 + o, gk = k0 + k;
            int s = KCONTIG ? go : gk, slim = KCONTIG ? olim : klim;  // strided (row) index of X
            int p = KCONTIG ? gk : go, plim = KCONTIG ? klim : olim;  // contiguous index of X: p .. p+3
            bool row_ok = in_tile && s < slim;
            const float* src = X + (size_t)s * ld + p;
            if (row_ok && vec && p + 3 < plim) {
                float4 v = __ldg(reinterpret_cast<const float4*>(src));
                r[c][0] = v.x; r[c][1] = v.y; r[c][2] = v.z; r[c][3] = v.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) r[c][i] = (row_ok && p + i < plim) ? __ldg(src + i) : 0.0f;
            }
        }
    }

    __device__ __forceinline__ void store(float* S) const {
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            int idx = threadIdx.x + c * NT;
            if (!((TOTAL % NT == 0) || idx < TOTAL)) continue;
            int o, k;
            chunk_pos(idx, o, k);
            if (KCONTIG) {
#pragma unroll
                for (int i = 0; i < 4; i++) S[(k + i) * LD + o] = r[c][i];
            } else {
                *reinterpret_cast<float4*>(&S[k * LD + o]) = make_float4(r[c][0], r[c][1], r[c][2], r[c][3]);
            }
        }
    }
};

// ----------------------------------------------------------------------------------------------------------------
// versions 3 and 4: 2D block tiling (VEC = false: scalar global loads; VEC = true: float4 global loads)

template <int BM, int BN, int BK, int TM, int TN, bool TA, bool TB, bool VEC>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
matmul_blocktile_kernel(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                        float beta, float* C, int ldc, bool vec_a, bool vec_b) {
    constexpr int NT = (BM / TM) * (BN / TN);
    static_assert(BM % TM == 0 && BN % TN == 0, "the thread grid must cover the block tile exactly");
    static_assert(TM % 4 == 0 && TN % 4 == 0, "a thread's patch is read from shared memory as float4s");
    using LoadA = TileLoader<BM, BK, NT, !TA>;
    using LoadB = TileLoader<BN, BK, NT, TB>;
    __shared__ __align__(16) float sA[BK * LoadA::LD];
    __shared__ __align__(16) float sB[BK * LoadB::LD];
    LoadA la;
    LoadB lb;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tr = threadIdx.x / (BN / TN), tc = threadIdx.x % (BN / TN);
    float acc[TM][TN] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        la.fetch(A, lda, m0, M, k0, K, VEC && vec_a);
        lb.fetch(B, ldb, n0, N, k0, K, VEC && vec_b);
        la.store(sA);
        lb.store(sB);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; k++) {
            float a[TM], b[TN];
            if (VEC) {
#pragma unroll
                for (int i = 0; i < TM; i += 4) {
                    float4 v = *reinterpret_cast<const float4*>(&sA[k * LoadA::LD + tr * TM + i]);
                    a[i] = v.x; a[i + 1] = v.y; a[i + 2] = v.z; a[i + 3] = v.w;
                }
#pragma unroll
                for (int j = 0; j < TN; j += 4) {
                    float4 v = *reinterpret_cast<const float4*>(&sB[k * LoadB::LD + tc * TN + j]);
                    b[j] = v.x; b[j + 1] = v.y; b[j + 2] = v.z; b[j + 3] = v.w;
                }
            } else {
#pragma unroll
                for (int i = 0; i < TM; i++) a[i] = sA[k * LoadA::LD + tr * TM + i];
#pragma unroll
                for (int j = 0; j < TN; j++) b[j] = sB[k * LoadB::LD + tc * TN + j];
            }
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; i++) {
        int m = m0 + tr * TM + i;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            int n = n0 + tc * TN + j;
            if (n < N) store_out(C, ldc, m, n, acc[i][j], alpha, beta);
        }
    }
}

// Calls launch(TA, TB) with TA, TB the compile-time std::bool_constant of the runtime (trans_a, trans_b), so each
// launcher names its kernel once. NN_ONLY (benchmark tile variants): only A and B as stored are compiled.
template <bool NN_ONLY = false, typename Launch>
static void matmul_dispatch_trans(const char* fn, bool trans_a, bool trans_b, Launch&& launch) {
    using F = std::false_type;
    using T = std::true_type;
    if constexpr (NN_ONLY) {
        if (trans_a || trans_b) { fprintf(stderr, "%s: this tile variant is built for NN only\n", fn); exit(EXIT_FAILURE); }
        launch(F{}, F{});
    } else {
        if (!trans_a && !trans_b) launch(F{}, F{});
        else if (!trans_a && trans_b) launch(F{}, T{});
        else if (trans_a && !trans_b) launch(T{}, F{});
        else launch(T{}, T{});
    }
}

template <bool VEC>
static void matmul_blocktile(const char* fn, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                             const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc,
                             cudaStream_t stream) {
    matmul_check_args(fn, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    constexpr int BM = 128, BN = 128, BK = 8, TM = 8, TN = 8;
    dim3 grid(ceil_div(N, BN), ceil_div(M, BM));
    dim3 block((BM / TM) * (BN / TN));
    bool va = matmul_vec_ok(A, lda), vb = matmul_vec_ok(B, ldb);
    matmul_dispatch_trans(fn, trans_a, trans_b, [&](auto ta, auto tb) {
        matmul_blocktile_kernel<BM, BN, BK, TM, TN, decltype(ta)::value, decltype(tb)::value, VEC>
            <<<grid, block, 0, stream>>>(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, va, vb);
    });
    cudaCheck(cudaGetLastError());
}

static void matmul_blocktile_v3(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                                int lda, const float* B, int ldb, float beta, float* C, int ldc,
                                cudaStream_t stream) {
    matmul_blocktile<false>("matmul_blocktile_v3", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                            stream);
}
static void matmul_vectorized_v4(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                                 int lda, const float* B, int ldb, float beta, float* C, int ldc,
                                 cudaStream_t stream) {
    matmul_blocktile<true>("matmul_vectorized_v4", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                           stream);
}

// ----------------------------------------------------------------------------------------------------------------
// split-K reduction (versions 5 and 6): C = alpha * sum_z ws[z] + beta * C, summed in a fixed order (deterministic)

// Block (32, 8): lanes take 32 consecutive outputs (coalesced), threadIdx.y takes splits y, y+8, ... (hundreds of
// splits for conv1 dW must not be summed by one thread); the 8 partial sums are added in a fixed order.
#define REDUCE_ROWS 8
__global__ void matmul_splitk_reduce_kernel(const float* ws, int splits, int M, int N, float alpha, float beta,
                                            float* C, int ldc) {
    __shared__ float part[REDUCE_ROWS][32];
    size_t total = (size_t)M * N;
    size_t i = (size_t)blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (i < total)
        for (int z = threadIdx.y; z < splits; z += REDUCE_ROWS) s += ws[(size_t)z * total + i];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && i < total) {
        float r = 0.0f;
#pragma unroll
        for (int y = 0; y < REDUCE_ROWS; y++) r += part[y][threadIdx.x];
        store_out(C, ldc, (int)(i / N), (int)(i % N), r, alpha, beta);
    }
}

static void matmul_splitk_reduce(const float* ws, int splits, int M, int N, float alpha, float beta, float* C,
                                 int ldc, cudaStream_t stream) {
    size_t total = (size_t)M * N;
    dim3 block(32, REDUCE_ROWS);
    dim3 grid((unsigned)((total + 31) / 32));
    matmul_splitk_reduce_kernel<<<grid, block, 0, stream>>>(ws, splits, M, N, alpha, beta, C, ldc);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------------------
// cp.async tile copies (sm_80 and newer; version 6, and version 5's asynchronous B variant)

// 16-byte copy; the bytes past src_bytes are zero-filled (edge tiles)
__device__ __forceinline__ void cp_async_16(float* dst, const float* src, int src_bytes) {
    uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_4(float* dst, const float* src, int src_bytes) {
    uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
// the same without the source size (the whole chunk in range): no size register in the unpredicated copy paths
__device__ __forceinline__ void cp_async_16_full(float* dst, const float* src) {
    uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_4_full(float* dst, const float* src) {
    uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N_PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N_PENDING)); }

// A BO x BK tile of op(X) copied asynchronously in X's own layout (cp.async cannot transpose):
// KCONTIG (k contiguous in X): S[BO][BK + 4]; otherwise S[BK][BO + 8]. The pads make the mma fragment reads
// conflict-free: the 32 lanes read (o = g, k = t), g < 8, t < 4: bank (g * LD + t) % 32 when KCONTIG, else
// (t * LD + g) % 32; fragment_banks_distinct checks all 32 differ.
constexpr bool fragment_banks_distinct(int ld, bool kcontig) {
    for (int x = 0; x < 32; x++)
        for (int y = x + 1; y < 32; y++) {
            int bx = kcontig ? ((x / 4) * ld + x % 4) % 32 : ((x % 4) * ld + x / 4) % 32;
            int by = kcontig ? ((y / 4) * ld + y % 4) % 32 : ((y % 4) * ld + y / 4) % 32;
            if (bx == by) return false;
        }
    return true;
}
// PERM (fragment k order permuted, see load_fragments): lane (g, t) reads k = 2t and 2t+1 of a k-step instead of t
// and t+4: one 8-byte read per row where k is contiguous (half-warp phases: banks (g*LD + 2t) % 32 must differ in
// each half), two 4-byte reads of rows 2t, 2t+1 otherwise (banks ((2t+e)*LD + g) % 32 must differ).
constexpr bool fragment_banks_distinct_perm(int ld, bool kcontig) {
    for (int x = 0; x < 32; x++)
        for (int y = x + 1; y < 32; y++) {
            if (kcontig) {
                if (x / 16 != y / 16) continue;
                if (((x / 4) * ld + 2 * (x % 4)) % 32 == ((y / 4) * ld + 2 * (y % 4)) % 32) return false;
            } else {
                for (int e = 0; e < 2; e++)
                    if (((2 * (x % 4) + e) * ld + x / 4) % 32 == ((2 * (y % 4) + e) * ld + y / 4) % 32) return false;
            }
        }
    return true;
}
template <int BO, int BK, int NT, bool KCONTIG, bool PERM = false>
struct AsyncTile {
    static_assert(BO % 4 == 0 && BK % 4 == 0, "tiles move in 16-byte chunks");
    static constexpr int LD = PERM ? (KCONTIG ? BK + 8 : BO + 4) : (KCONTIG ? BK + 4 : BO + 8);
    static_assert(PERM ? fragment_banks_distinct_perm(LD, KCONTIG) : fragment_banks_distinct(LD, KCONTIG),
                  "padding must make the fragment reads conflict-free");
    static constexpr int SIZE = KCONTIG ? BO * LD : BK * LD;  // floats per stage
    static constexpr int TOTAL = BO * BK / 4;
    static constexpr int CHUNKS = (TOTAL + NT - 1) / NT;

    __device__ __forceinline__ static void load(float* S, const float* X, int ld, int o0, int olim, int k0, int klim,
                                                bool vec) {
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            int idx = threadIdx.x + c * NT;
            if (TOTAL % NT != 0 && idx >= TOTAL) break;
            int srow, spos, grow, rowlim, gpos, poslim;  // tile row / position, and in X
            if (KCONTIG) { srow = idx / (BK / 4); spos = (idx % (BK / 4)) * 4; grow = o0 + srow; rowlim = olim; gpos = k0 + spos; poslim = klim; }
            else         { srow = idx / (BO / 4); spos = (idx % (BO / 4)) * 4; grow = k0 + srow; rowlim = klim; gpos = o0 + spos; poslim = olim; }
            int nvalid = grow < rowlim ? max(0, min(4, poslim - gpos)) : 0;
            float* dst = S + srow * LD + spos;
            const float* src = X + (size_t)grow * ld + gpos;
            if (vec) {
                cp_async_16(dst, nvalid > 0 ? src : X, nvalid * 4);
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) cp_async_4(dst + i, i < nvalid ? src + i : X, i < nvalid ? 4 : 0);
            }
        }
    }
    // element (o, k) of the tile
    __device__ __forceinline__ static float at(const float* S, int o, int k) {
        return KCONTIG ? S[o * LD + k] : S[k * LD + o];
    }
    // elements (o, k) and (o, k+1), k even: one 8-byte read where k is contiguous (LD and k even: aligned)
    __device__ __forceinline__ static float2 at2(const float* S, int o, int k) {
        if (KCONTIG) return *reinterpret_cast<const float2*>(&S[o * LD + k]);
        return make_float2(S[k * LD + o], S[(k + 1) * LD + o]);
    }
};

// ----------------------------------------------------------------------------------------------------------------
// version 5: warptiling + register-staged double buffering + per-shape tiles + split-K (the trainer's fp32 kernel)
// A warp is a 4 x 8 grid of lanes; lane (ly, lx) owns RM x RN sub-tiles of 4x4 outputs at rows ly*4 + i*16 and
// columns lx*4 + j*32 of the warp's WM x WN = 16RM x 32RN patch. A warp's float4 reads of one k row then cover 64
// contiguous bytes of A (4 addresses, broadcast) and 128 of B: one shared-memory wavefront each.
// gridDim.z > 1: blockIdx.z computes k in [z * k_per_split, (z+1) * k_per_split) into ws[z] (M x N, raw sums).

// Shared-memory layout of the warptile kernel: 2 buffers of A (k-major, TileLoader) and of B. ASYNC_B (B not
// transposed only, where its tile rows are rows of B): B is copied by cp.async straight into shared memory
// (AsyncTile's k-major layout) instead of through registers, which frees the staging registers and the stores.
template <int BM, int BN, int BK, int NT, bool TA, bool TB, bool ASYNC_B>
struct WarptileSmem {
    static constexpr bool B_ASYNC = ASYNC_B && !TB;
    static constexpr int A_LD = TileLoader<BM, BK, NT, !TA>::LD;
    static constexpr int B_LD = B_ASYNC ? AsyncTile<BN, BK, NT, false>::LD : TileLoader<BN, BK, NT, TB>::LD;
    static constexpr int A_SZ = BK * A_LD, B_SZ = BK * B_LD;
    static constexpr int BYTES = 2 * (A_SZ + B_SZ) * (int)sizeof(float);
};

// The warptile kernels' epilogue: acc[4i + r][4j + c] is output (m0 + row0 + 16i + r, n0 + col0 + 32j + c).
// gridDim.z == 1: C = alpha acc + beta C (float4 stores where C allows); else the raw sums go to ws[blockIdx.z].
template <int RM, int RN>
__device__ __forceinline__ void warptile_epilogue(const float (&acc)[RM * 4][RN * 4], int M, int N, int m0, int n0,
                                                  int row0, int col0, float alpha, float beta, float* C, int ldc,
                                                  float* ws, bool vec_c) {
    const bool direct = gridDim.z == 1;
    float* out = direct ? C : ws + (size_t)blockIdx.z * M * N;
    const int ldo = direct ? ldc : N;
    const bool vec_o = direct ? vec_c : (N % 4 == 0);  // ws comes from cudaMalloc (256-byte aligned)
#pragma unroll
    for (int i = 0; i < RM; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int m = m0 + row0 + i * 16 + r;
            if (m >= M) continue;
#pragma unroll
            for (int j = 0; j < RN; j++) {
                int n = n0 + col0 + j * 32;
                const float* v = acc[i * 4 + r] + j * 4;
                float* p = out + (size_t)m * ldo + n;
                if (vec_o && n + 3 < N) {
                    float4 o = make_float4(v[0], v[1], v[2], v[3]);
                    if (direct) {
                        o.x *= alpha; o.y *= alpha; o.z *= alpha; o.w *= alpha;
                        if (beta != 0.0f) {
                            float4 old = *reinterpret_cast<const float4*>(p);
                            o.x = fmaf(beta, old.x, o.x); o.y = fmaf(beta, old.y, o.y);
                            o.z = fmaf(beta, old.z, o.z); o.w = fmaf(beta, old.w, o.w);
                        }
                    }
                    *reinterpret_cast<float4*>(p) = o;
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        if (n + c >= N) break;
                        if (direct) store_out(out, ldo, m, n + c, v[c], alpha, beta);
                        else p[c] = v[c];
                    }
                }
            }
        }
}

template <int BM, int BN, int BK, int RM, int RN, int MINB, bool TA, bool TB, int GROUP = 8, bool ASYNC_B = false>
__global__ void __launch_bounds__((BM / (16 * RM)) * (BN / (32 * RN)) * 32, MINB)
matmul_warptile_kernel(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                       float beta, float* C, int ldc, float* ws, int k_per_split, bool vec_a, bool vec_b,
                       bool vec_c) {
    constexpr int WM = 16 * RM, WN = 32 * RN;
    static_assert(BM % WM == 0 && BN % WN == 0, "warps must tile the block tile exactly");
    constexpr int WARPS_N = BN / WN;
    constexpr int NT = (BM / WM) * WARPS_N * 32;
    using LoadA = TileLoader<BM, BK, NT, !TA>;
    using LoadB = TileLoader<BN, BK, NT, TB>;
    using Smem = WarptileSmem<BM, BN, BK, NT, TA, TB, ASYNC_B>;
    using AsyncB = AsyncTile<BN, BK, NT, false>;
    constexpr bool B_ASYNC = Smem::B_ASYNC;
    // dynamic shared memory (2 buffers of each tile): 256x128 tiles with BK = 16 need 50 KB, over the static 48 KB
    extern __shared__ __align__(16) float wt_smem[];
    // buffer b of A at sA + b * A_SZ, of B at sB + b * B_SZ (arithmetic, not a pointer array: that went to the stack)
    constexpr int A_SZ = Smem::A_SZ, B_SZ = Smem::B_SZ, B_LD = Smem::B_LD;
    float* sA = wt_smem;
    float* sB = wt_smem + 2 * A_SZ;

    int bm, bn;
    grouped_tile(blockIdx.x, ceil_div(M, BM), ceil_div(N, BN), bm, bn, GROUP);
    const int m0 = bm * BM, n0 = bn * BN;
    const int kb = blockIdx.z * k_per_split, ke = min(K, kb + k_per_split);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (warp / WARPS_N) * WM + (lane / 8) * 4;  // + i*16
    const int col0 = (warp % WARPS_N) * WN + (lane % 8) * 4;  // + j*32

    float acc[RM * 4][RN * 4] = {};
    LoadA la;
    LoadB lb;
    const int ntiles = ke > kb ? ceil_div(ke - kb, BK) : 0;
    if (ntiles > 0) {
        la.fetch(A, lda, m0, M, kb, ke, vec_a);
        if constexpr (B_ASYNC) {
            AsyncB::load(sB, B, ldb, n0, N, kb, ke, vec_b);
            cp_async_commit();
        } else {
            lb.fetch(B, ldb, n0, N, kb, ke, vec_b);
        }
        la.store(sA);
        if constexpr (B_ASYNC) cp_async_wait<0>();
        else lb.store(sB);
        __syncthreads();
    }
    for (int t = 0; t < ntiles; t++) {
        const int cur = t & 1;
        const bool more = t + 1 < ntiles;
        if (more) {  // global loads of the next tile are in flight during the FMAs below
            la.fetch(A, lda, m0, M, kb + (t + 1) * BK, ke, vec_a);
            if constexpr (B_ASYNC) {  // straight into the other buffer, last read before the previous barrier
                AsyncB::load(sB + (cur ^ 1) * B_SZ, B, ldb, n0, N, kb + (t + 1) * BK, ke, vec_b);
                cp_async_commit();
            } else {
                lb.fetch(B, ldb, n0, N, kb + (t + 1) * BK, ke, vec_b);
            }
        }
        const float* a_s = sA + cur * A_SZ;
        const float* b_s = sB + cur * B_SZ;
#pragma unroll
        for (int k = 0; k < BK; k++) {
            float a[RM * 4], b[RN * 4];
#pragma unroll
            for (int i = 0; i < RM; i++) {
                float4 v = *reinterpret_cast<const float4*>(&a_s[k * LoadA::LD + row0 + i * 16]);
                a[i * 4 + 0] = v.x; a[i * 4 + 1] = v.y; a[i * 4 + 2] = v.z; a[i * 4 + 3] = v.w;
            }
#pragma unroll
            for (int j = 0; j < RN; j++) {
                float4 v = *reinterpret_cast<const float4*>(&b_s[k * B_LD + col0 + j * 32]);
                b[j * 4 + 0] = v.x; b[j * 4 + 1] = v.y; b[j * 4 + 2] = v.z; b[j * 4 + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < RM * 4; i++)
#pragma unroll
                for (int j = 0; j < RN * 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        // the other buffer was last read in iteration t-1, which every thread finished before the barrier below
        // of iteration t-1: one barrier per k-tile is enough
        if (more) {
            la.store(sA + (cur ^ 1) * A_SZ);
            if constexpr (B_ASYNC) cp_async_wait<0>();
            else lb.store(sB + (cur ^ 1) * B_SZ);
        }
        __syncthreads();
    }

    warptile_epilogue<RM, RN>(acc, M, N, m0, n0, row0, col0, alpha, beta, C, ldc, ws, vec_c);
}

// Lets KERNEL launch with `bytes` of dynamic shared memory: beyond the default 48 KB a kernel must opt in, once.
template <auto KERNEL>
static void matmul_smem_opt_in(int bytes) {
    static bool done = false;  // one per kernel instantiation
    if (!done && bytes > 48 * 1024) {
        cudaCheck(cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        done = true;
    }
}

// The version-5 launchers' shared body: split-K choice and workspace, grid, 16-byte-access flags, the transpose
// dispatch, the launch and the split-K reduction. pick(ta, tb) opts the (TA, TB) kernel into its shared memory and
// returns {kernel, shared-memory bytes}; NT threads per block.
template <int BM, int BN, int BK, int NT, bool NN_ONLY, typename Pick>
static void launch_warptile_common(const char* fn, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                                   const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc,
                                   cudaStream_t stream, Pick pick) {
    int splits, k_per_split;
    matmul_choose_splits(M, N, K, BM, BN, BK, NT, &splits, &k_per_split);
    float* ws = splits > 1 ? matmul_get_workspace((size_t)splits * M * N) : nullptr;
    dim3 grid(ceil_div(M, BM) * ceil_div(N, BN), 1, splits);
    bool va = matmul_vec_ok(A, lda), vb = matmul_vec_ok(B, ldb), vc = matmul_vec_ok(C, ldc);
    matmul_dispatch_trans<NN_ONLY>(fn, trans_a, trans_b, [&](auto ta, auto tb) {
        auto [kernel, smem_bytes] = pick(ta, tb);
        kernel<<<grid, NT, smem_bytes, stream>>>(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ws, k_per_split, va, vb,
                                                 vc);
    });
    cudaCheck(cudaGetLastError());
    if (splits > 1) matmul_splitk_reduce(ws, splits, M, N, alpha, beta, C, ldc, stream);
}

template <int BM, int BN, int BK, int RM, int RN, int MINB, bool NN_ONLY = false, int GROUP = 8, bool ASYNC_B = false>
static void launch_warptile(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                            const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    constexpr int NT = (BM / (16 * RM)) * (BN / (32 * RN)) * 32;
    launch_warptile_common<BM, BN, BK, NT, NN_ONLY>(
        "launch_warptile", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream, [](auto ta, auto tb) {
            constexpr bool TA = decltype(ta)::value, TB = decltype(tb)::value;
            constexpr int SMEM_BYTES = WarptileSmem<BM, BN, BK, NT, TA, TB, ASYNC_B>::BYTES;
            constexpr auto kernel = &matmul_warptile_kernel<BM, BN, BK, RM, RN, MINB, TA, TB, GROUP, ASYNC_B>;
            matmul_smem_opt_in<kernel>(SMEM_BYTES);
            return std::make_pair(kernel, SMEM_BYTES);
        });
}

// ----------------------------------------------------------------------------------------------------------------
// version 5, asynchronous pipeline (matmul_sgemm_v5's kernel for big problems, 4096^3 included; the "async"
// variants): the warptile kernel's thread layout, fragments and epilogue, but both tiles go from global to shared
// memory by cp.async, STAGES k-tiles in flight, with no staging registers and no shared-memory stores in the loop;
// the fragments are double-buffered in registers, and the one barrier per k-tile sits before the tile's last
// k-step, so the first fragments of the next tile are read behind that step's FMAs instead of after the barrier.
// 4096^3 NN on the H100: 91-93% of cuBLAS fp32 at 256x128x16, 8x16 per thread, 3 stages, against 82-83% for the
// register-staged kernel at 256x128. One difference the SASS shows (not profiled side by side): the register-staged
// loop issues 1230 instructions per k-tile of 8 for its 1024 FFMAs (83% FFMA), most of the rest in the per-chunk
// bounds checks and vec/scalar branches of its global loads; here interior tiles take an unpredicated copy path and
// a k-tile of 16 issues about 2240 for 2048 FFMAs (92%). cuBLAS fp32 runs an sm80 FFMA kernel with the same
// 256x128x8 tile, 3 stages and 8 warps (ncu: 0.90 instructions issued per scheduler per cycle; 0.77-0.79 for the
// async variants profiled, the default 256x128x16 8x16 not among them).
//
// A BO x BK tile of op(X) is copied into the k-major layout S[BK][BO + 4] that the warptile kernel reads (o
// contiguous, so every fragment read is one float4), whatever X's layout:
// - o contiguous in X (A transposed, B as stored): 16-byte copies of 4 o's at one k (4-byte copies where X is not
//   16-byte aligned); chunk e = c * NT + tid at k = e / (BO/4), o = 4 (e % (BO/4)).
// - k contiguous in X (A as stored, B transposed): the copy transposes, one 4-byte cp.async per element. Lane l of
//   a warp instruction takes k = l % 8 (+ 8 per k-group of 8) and o = l / 8 (+ 4 per warp slot): the warp reads
//   four 32-byte row segments of X (whole sectors) and writes banks (4 k + o) % 32 (LD % 32 == 4): 32 distinct.
template <int BO, int BK, int NT, bool KCONTIG>
struct KmajorAsyncTile {
    static_assert(BO % 32 == 0 && BK % 8 == 0 && NT % 32 == 0, "tile sizes for the copy layouts below");
    static constexpr int LD = BO + 4;  // % 32 == 4: conflict-free transposing copies; rows stay 16-byte aligned
    static constexpr int SIZE = BK * LD;  // floats per stage
    static constexpr int KGROUPS = BK / 8;
    // copies per thread (4-byte elements when KCONTIG, else 16-byte chunks); copy c sits at o + c * O_STEP
    // (KCONTIG) or k + c * K_STEP (o contiguous) from copy 0
    static constexpr int COPIES = KCONTIG ? BO * BK / NT : BO * BK / 4 / NT;
    static_assert(KCONTIG ? ((BO * BK) % NT == 0 && (NT / 32) % KGROUPS == 0)
                          : ((BO * BK / 4) % NT == 0 && NT % (BO / 4) == 0),
                  "every thread makes the same number of copies at constant strides");
    static constexpr int O_STEP = KCONTIG ? 4 * (NT / 32) / KGROUPS : 0;
    static constexpr int K_STEP = KCONTIG ? 0 : NT / (BO / 4);

    __device__ __forceinline__ static void first_copy(int& o, int& k) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        if (KCONTIG) { k = lane % 8 + 8 * (warp % KGROUPS); o = lane / 8 + 4 * (warp / KGROUPS); }
        else         { k = threadIdx.x / (BO / 4); o = 4 * (threadIdx.x % (BO / 4)); }
    }

    // tile rows [o0, o0 + BO) of op(X) below olim, k in [k0, k0 + BK) below klim. full: the whole tile is in range
    // (and X 16-byte aligned where the copies are 16 bytes): no predicates. vec: 16-byte copies allowed.
    __device__ __forceinline__ static void load(float* S, const float* X, int ld, int o0, int olim, int k0, int klim,
                                                bool full, bool vec) {
        int o, k;
        first_copy(o, k);
        float* dst = S + k * LD + o;
        if (full) {
            if (KCONTIG) {
                const float* src = X + (size_t)(o0 + o) * ld + (k0 + k);
#pragma unroll
                for (int c = 0; c < COPIES; c++)
                    cp_async_4_full(dst + c * O_STEP, src + (size_t)c * O_STEP * ld);
            } else {
                const float* src = X + (size_t)(k0 + k) * ld + (o0 + o);
#pragma unroll
                for (int c = 0; c < COPIES; c++)
                    cp_async_16_full(dst + c * K_STEP * LD, src + (size_t)c * K_STEP * ld);
            }
            return;
        }
#pragma unroll
        for (int c = 0; c < COPIES; c++) {
            if (KCONTIG) {
                int go = o0 + o + c * O_STEP, gk = k0 + k;
                bool ok = go < olim && gk < klim;
                cp_async_4(dst + c * O_STEP, ok ? X + (size_t)go * ld + gk : X, ok ? 4 : 0);
            } else {
                int gk = k0 + k + c * K_STEP, go = o0 + o;
                int nvalid = gk < klim ? max(0, min(4, olim - go)) : 0;
                const float* src = X + (size_t)gk * ld + go;
                float* d = dst + c * K_STEP * LD;
                if (vec) {
                    cp_async_16(d, nvalid > 0 ? src : X, nvalid * 4);
                } else {
#pragma unroll
                    for (int i = 0; i < 4; i++) cp_async_4(d + i, i < nvalid ? src + i : X, i < nvalid ? 4 : 0);
                }
            }
        }
    }
};

template <int BM, int BN, int BK, int RM, int RN, int MINB, int STAGES, bool TA, bool TB>
__global__ void __launch_bounds__((BM / (16 * RM)) * (BN / (32 * RN)) * 32, MINB)
matmul_warptile_async_kernel(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                             float beta, float* C, int ldc, float* ws, int k_per_split, bool vec_a, bool vec_b,
                             bool vec_c) {
    constexpr int WM = 16 * RM, WN = 32 * RN;
    static_assert(BM % WM == 0 && BN % WN == 0, "warps must tile the block tile exactly");
    static_assert(STAGES >= 2, "at least double buffering");
    static_assert(BK % 2 == 0, "k-step 0 of a tile uses fragment buffer 0 (BK % 2 == 0)");
    constexpr int WARPS_N = BN / WN;
    constexpr int NT = (BM / WM) * WARPS_N * 32;
    using TileA = KmajorAsyncTile<BM, BK, NT, !TA>;
    using TileB = KmajorAsyncTile<BN, BK, NT, TB>;
    extern __shared__ __align__(16) float wt_smem[];
    float* sA = wt_smem;                          // stage s of A at sA + s * TileA::SIZE
    float* sB = wt_smem + STAGES * TileA::SIZE;   // stage s of B at sB + s * TileB::SIZE

    int bm, bn;
    grouped_tile(blockIdx.x, ceil_div(M, BM), ceil_div(N, BN), bm, bn);
    const int m0 = bm * BM, n0 = bn * BN;
    const int kb = blockIdx.z * k_per_split, ke = min(K, kb + k_per_split);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (warp / WARPS_N) * WM + (lane / 8) * 4;  // + i*16
    const int col0 = (warp % WARPS_N) * WN + (lane % 8) * 4;  // + j*32
    // interior blocks copy without predicates (all but the last k-tile; 16-byte copies need alignment)
    const bool full_a = m0 + BM <= M && (!TA || vec_a), full_b = n0 + BN <= N && (TB || vec_b);
    const int ntiles = ke > kb ? ceil_div(ke - kb, BK) : 0;
    auto load_tile = [&](int t, int stage) {
        const int k0 = kb + t * BK;
        const bool kfull = k0 + BK <= ke;
        TileA::load(sA + stage * TileA::SIZE, A, lda, m0, M, k0, ke, full_a && kfull, vec_a);
        TileB::load(sB + stage * TileB::SIZE, B, ldb, n0, N, k0, ke, full_b && kfull, vec_b);
    };

    // prologue: k-tiles 0 .. STAGES-2 in flight (one commit group each, empty past the last tile)
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ntiles) load_tile(s, s);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();

    float acc[RM * 4][RN * 4] = {};
    float a[2][RM * 4], b[2][RN * 4];
    auto load_frags = [&](float* fa, float* fb, const float* a_s, const float* b_s, int k) {
#pragma unroll
        for (int i = 0; i < RM; i++) {
            float4 v = *reinterpret_cast<const float4*>(&a_s[k * TileA::LD + row0 + i * 16]);
            fa[i * 4 + 0] = v.x; fa[i * 4 + 1] = v.y; fa[i * 4 + 2] = v.z; fa[i * 4 + 3] = v.w;
        }
#pragma unroll
        for (int j = 0; j < RN; j++) {
            float4 v = *reinterpret_cast<const float4*>(&b_s[k * TileB::LD + col0 + j * 32]);
            fb[j * 4 + 0] = v.x; fb[j * 4 + 1] = v.y; fb[j * 4 + 2] = v.z; fb[j * 4 + 3] = v.w;
        }
    };
    load_frags(a[0], b[0], sA, sB, 0);
    int read_stage = 0, write_stage = STAGES - 1;
    for (int t = 0; t < ntiles; t++) {
        // refill the stage that k-tile t-1 used: every thread finished reading it before the barrier of step t-1
        if (t + STAGES - 1 < ntiles) load_tile(t + STAGES - 1, write_stage);
        cp_async_commit();
        write_stage = write_stage + 1 == STAGES ? 0 : write_stage + 1;
        const int next_stage = read_stage + 1 == STAGES ? 0 : read_stage + 1;
        const float* a_s = sA + read_stage * TileA::SIZE;
        const float* b_s = sB + read_stage * TileB::SIZE;
#pragma unroll
        for (int k = 0; k < BK; k++) {
            if (k == BK - 1) {
                // k-tile t+1 landed (groups up to t+1 of the t+STAGES committed) and is visible to all threads;
                // all fragment reads of this stage are done (the last, k = BK-1, happened at k = BK-2)
                cp_async_wait<STAGES - 2>();
                __syncthreads();
                a_s = sA + next_stage * TileA::SIZE;  // past the last k-tile: read but never used
                b_s = sB + next_stage * TileB::SIZE;
            }
            load_frags(a[(k + 1) % 2], b[(k + 1) % 2], a_s, b_s, (k + 1) % BK);
#pragma unroll
            for (int i = 0; i < RM * 4; i++)
#pragma unroll
                for (int j = 0; j < RN * 4; j++) acc[i][j] = fmaf(a[k % 2][i], b[k % 2][j], acc[i][j]);
        }
        read_stage = next_stage;
    }
    cp_async_wait<0>();  // no copy may still be writing shared memory when the block exits (empty groups only)

    warptile_epilogue<RM, RN>(acc, M, N, m0, n0, row0, col0, alpha, beta, C, ldc, ws, vec_c);
}

template <int BM, int BN, int BK, int RM, int RN, int MINB, int STAGES, bool NN_ONLY = false>
static void launch_warptile_async(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                                  int lda, const float* B, int ldb, float beta, float* C, int ldc,
                                  cudaStream_t stream) {
    constexpr int NT = (BM / (16 * RM)) * (BN / (32 * RN)) * 32;
    launch_warptile_common<BM, BN, BK, NT, NN_ONLY>(
        "launch_warptile_async", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream,
        [](auto ta, auto tb) {
            constexpr bool TA = decltype(ta)::value, TB = decltype(tb)::value;
            constexpr int SMEM_BYTES = STAGES * (int)sizeof(float) *
                                       (KmajorAsyncTile<BM, BK, NT, !TA>::SIZE + KmajorAsyncTile<BN, BK, NT, TB>::SIZE);
            constexpr auto kernel = &matmul_warptile_async_kernel<BM, BN, BK, RM, RN, MINB, STAGES, TA, TB>;
            matmul_smem_opt_in<kernel>(SMEM_BYTES);
            return std::make_pair(kernel, SMEM_BYTES);
        });
}

// The trainer's fp32 GEMM. C (M x N, ldc) = alpha * op(A) op(B) + beta * C, row-major; see the header for layouts.
// Tile per problem (MNIST uses each): M, N <= 32 -> 32x32, one warp (conv1 dW, split-K); N <= 32 -> 128x32 (conv1
// forward, fc2); N <= 64 with enough tiles -> 128x64 (conv2 forward); two waves of 256x128 tiles -> the
// asynchronous pipeline at 256x128x16, 8x16 per thread, 3 stages (4096^3, conv2 dX; at 4096^3 NN 91-93%
// of cuBLAS fp32 against 82-83% for the register-staged 256x128 kernel, see matmul_NOTES.md); one wave of 128x128
// tiles -> 128x128 with 8x8 per thread; few tiles but long K -> 64x64 with 8x8 per thread and split-K (conv2 dW);
// else 64x64 with 4x4 per thread, 256 threads (fc1).
void matmul_sgemm_v5(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                     const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_sgemm_v5", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    const long long sms = matmul_num_sms();
    auto tiles = [&](int bm, int bn) { return (long long)ceil_div(M, bm) * ceil_div(N, bn); };
    if (M <= 32 && N <= 32)
        launch_warptile<32, 32, 16, 2, 1, 12>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else if (N <= 32)
        launch_warptile<128, 32, 16, 2, 1, 4>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else if (N <= 64 && tiles(128, 64) >= sms)
        launch_warptile<128, 64, 8, 2, 2, 3>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else if (tiles(256, 128) >= 2 * sms)
        launch_warptile_async<256, 128, 16, 2, 4, 1, 3>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                                        stream);
    else if (tiles(128, 128) >= sms)
        launch_warptile<128, 128, 8, 2, 2, 2>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else if (tiles(64, 64) * (K / 128) >= 4 * sms)
        launch_warptile<64, 64, 8, 2, 2, 6>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else
        launch_warptile<64, 64, 16, 1, 1, 2>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}

// ----------------------------------------------------------------------------------------------------------------
// version 6: TF32 tensor cores (mma.sync.m16n8k8), cp.async multi-stage pipeline (sm_80 and newer)

// fp32 -> TF32 operand. The tensor core reads only the top 19 bits (sign, exponent, 10 mantissa bits) of a .tf32
// operand, so the low 13 bits may stay. TF32_ROUND_ADD: add half a TF32 ulp to the bits (one integer add; the
// hardware's truncation then rounds to nearest, ties away from zero, like cvt.rna; +-Inf inputs become NaN).
// TF32_ROUND_CVT: cvt.rna.tf32.f32. TF32_TRUNC: nothing (truncation toward zero, twice the rounding error).
enum Tf32Round { TF32_TRUNC = 0, TF32_ROUND_CVT = 1, TF32_ROUND_ADD = 2 };
template <int ROUND>
__device__ __forceinline__ uint32_t f32_to_tf32(float x) {
    if (ROUND == TF32_TRUNC) return __float_as_uint(x);
    if (ROUND == TF32_ROUND_ADD) return __float_as_uint(x) + 0x1000u;
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// c += a b: a 16x8 (row), b 8x8 (col), c 16x8. Fragments (g = lane / 4, t = lane % 4):
// a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4); b0 (k=t, n=g) b1 (k=t+4, n=g);
// c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1).
__device__ __forceinline__ void mma_tf32_16x8x8(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB, bool PERM = false>
struct Tf32Config {
    static constexpr int WARPS_N = BN / WN;
    static constexpr int NT = (BM / WM) * WARPS_N * 32;
    using TileA = AsyncTile<BM, BK, NT, !TA, PERM>;
    using TileB = AsyncTile<BN, BK, NT, TB, PERM>;
    static constexpr int SMEM_BYTES = STAGES * (TileA::SIZE + TileB::SIZE) * (int)sizeof(float);
};

// A warp's fragments for one k-step of 8 (see mma_tf32_16x8x8 for the layout), from one pipeline stage
// PERM: the mma sums over its 8 k in any order as long as A and B agree, so lane t's "k = t" and "k = t + 4" are
// mapped to physical k = 2t and 2t + 1 (adjacent: one 8-byte read where k is contiguous in shared memory).
template <typename TileA, typename TileB, int MI, int NI, int ROUND, bool PERM = false>
__device__ __forceinline__ void load_fragments(uint32_t (&af)[MI][4], uint32_t (&bf)[NI][2], const float* a_s,
                                               const float* b_s, int wm0, int wn0, int g, int t, int kk) {
    if constexpr (PERM) {
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            int r = wm0 + mi * 16 + g;
            float2 lo = TileA::at2(a_s, r, kk + 2 * t), hi = TileA::at2(a_s, r + 8, kk + 2 * t);
            af[mi][0] = f32_to_tf32<ROUND>(lo.x);
            af[mi][1] = f32_to_tf32<ROUND>(hi.x);
            af[mi][2] = f32_to_tf32<ROUND>(lo.y);
            af[mi][3] = f32_to_tf32<ROUND>(hi.y);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            float2 v = TileB::at2(b_s, wn0 + ni * 8 + g, kk + 2 * t);
            bf[ni][0] = f32_to_tf32<ROUND>(v.x);
            bf[ni][1] = f32_to_tf32<ROUND>(v.y);
        }
    } else {
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            int r = wm0 + mi * 16 + g;
            af[mi][0] = f32_to_tf32<ROUND>(TileA::at(a_s, r, kk + t));
            af[mi][1] = f32_to_tf32<ROUND>(TileA::at(a_s, r + 8, kk + t));
            af[mi][2] = f32_to_tf32<ROUND>(TileA::at(a_s, r, kk + t + 4));
            af[mi][3] = f32_to_tf32<ROUND>(TileA::at(a_s, r + 8, kk + t + 4));
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            int c = wn0 + ni * 8 + g;
            bf[ni][0] = f32_to_tf32<ROUND>(TileB::at(b_s, c, kk + t));
            bf[ni][1] = f32_to_tf32<ROUND>(TileB::at(b_s, c, kk + t + 4));
        }
    }
}

// ROUND: a Tf32Round (see f32_to_tf32). FDB: double-buffer the fragments in registers across the k-steps of a
// stage (measured: +1-4% at 4096^3, within noise; off).
template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB, int ROUND = TF32_ROUND_ADD,
          bool FDB = false, bool PERM = false>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)
matmul_tf32_kernel(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb, float beta,
                   float* C, int ldc, float* ws, int k_per_split, bool vec_a, bool vec_b) {
    using Cfg = Tf32Config<BM, BN, BK, WM, WN, STAGES, TA, TB, PERM>;
    using TileA = typename Cfg::TileA;
    using TileB = typename Cfg::TileB;
    static_assert(WM % 16 == 0 && WN % 8 == 0, "a warp tile is made of m16n8 mma tiles");
    static_assert(BK % 8 == 0, "the mma k step is 8");
    static_assert(BM % WM == 0 && BN % WN == 0, "warps must tile the block tile exactly");
    static_assert(STAGES >= 2, "the pipeline needs at least one tile in flight");
    constexpr int MI = WM / 16, NI = WN / 8;
    extern __shared__ __align__(16) float smem[];
    float* sA = smem;
    float* sB = smem + STAGES * TileA::SIZE;

    int bm, bn;
    grouped_tile(blockIdx.x, ceil_div(M, BM), ceil_div(N, BN), bm, bn);
    const int m0 = bm * BM, n0 = bn * BN;
    const int kb = blockIdx.z * k_per_split, ke = min(K, kb + k_per_split);
    const int ntiles = ke > kb ? ceil_div(ke - kb, BK) : 0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm0 = (warp / Cfg::WARPS_N) * WM, wn0 = (warp % Cfg::WARPS_N) * WN;
    const int g = lane / 4, t = lane % 4;

    float acc[MI][NI][4] = {};
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ntiles) {
            TileA::load(sA + s * TileA::SIZE, A, lda, m0, M, kb + s * BK, ke, vec_a);
            TileB::load(sB + s * TileB::SIZE, B, ldb, n0, N, kb + s * BK, ke, vec_b);
        }
        cp_async_commit();  // an empty group keeps the group count = tile count
    }
    for (int kt = 0; kt < ntiles; kt++) {
        cp_async_wait<STAGES - 2>();  // tile kt has landed (for this thread) ...
        __syncthreads();              // ... for every thread, and every warp is done with tile kt - 1
        const int next = kt + STAGES - 1;
        if (next < ntiles) {  // refill the stage tile kt - 1 used
            TileA::load(sA + (next % STAGES) * TileA::SIZE, A, lda, m0, M, kb + next * BK, ke, vec_a);
            TileB::load(sB + (next % STAGES) * TileB::SIZE, B, ldb, n0, N, kb + next * BK, ke, vec_b);
        }
        cp_async_commit();
        const float* a_s = sA + (kt % STAGES) * TileA::SIZE;
        const float* b_s = sB + (kt % STAGES) * TileB::SIZE;
        if (FDB) {  // fragments of k-step ks+1 are loaded while the mmas of k-step ks run
            uint32_t af[2][MI][4], bf[2][NI][2];
            load_fragments<TileA, TileB, MI, NI, ROUND, PERM>(af[0], bf[0], a_s, b_s, wm0, wn0, g, t, 0);
#pragma unroll
            for (int ks = 0; ks < BK / 8; ks++) {
                if (ks + 1 < BK / 8)
                    load_fragments<TileA, TileB, MI, NI, ROUND, PERM>(af[(ks + 1) & 1], bf[(ks + 1) & 1], a_s, b_s, wm0, wn0,
                                                              g, t, (ks + 1) * 8);
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
#pragma unroll
                    for (int ni = 0; ni < NI; ni++) mma_tf32_16x8x8(acc[mi][ni], af[ks & 1][mi], bf[ks & 1][ni]);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < BK; kk += 8) {
                uint32_t af[MI][4], bf[NI][2];
                load_fragments<TileA, TileB, MI, NI, ROUND, PERM>(af, bf, a_s, b_s, wm0, wn0, g, t, kk);
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
#pragma unroll
                    for (int ni = 0; ni < NI; ni++) mma_tf32_16x8x8(acc[mi][ni], af[mi], bf[ni]);
            }
        }
    }
    cp_async_wait<0>();

    const bool direct = gridDim.z == 1;
    float* out = direct ? C : ws + (size_t)blockIdx.z * M * N;
    const int ldo = direct ? ldc : N;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int m = m0 + wm0 + mi * 16 + g + h * 8;
            if (m >= M) continue;
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                int n = n0 + wn0 + ni * 8 + 2 * t;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    if (n + e >= N) break;
                    float v = acc[mi][ni][2 * h + e];
                    if (direct) store_out(out, ldo, m, n + e, v, alpha, beta);
                    else out[(size_t)m * ldo + n + e] = v;
                }
            }
        }
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB, int ROUND, bool FDB, bool PERM>
static void launch_tf32_one(dim3 grid, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                            int ldb, float beta, float* C, int ldc, float* ws, int k_per_split, bool va, bool vb,
                            cudaStream_t stream) {
    using Cfg = Tf32Config<BM, BN, BK, WM, WN, STAGES, TA, TB, PERM>;
    constexpr auto kernel = &matmul_tf32_kernel<BM, BN, BK, WM, WN, STAGES, TA, TB, ROUND, FDB, PERM>;
    matmul_smem_opt_in<kernel>(Cfg::SMEM_BYTES);
    kernel<<<grid, Cfg::NT, Cfg::SMEM_BYTES, stream>>>(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ws,
                                                       k_per_split, va, vb);
    cudaCheck(cudaGetLastError());
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool NN_ONLY = false, int ROUND = TF32_ROUND_ADD,
          bool FDB = false, bool PERM = false>
static void launch_tf32(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                        const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    int splits, k_per_split;
    matmul_choose_splits(M, N, K, BM, BN, BK, (BM / WM) * (BN / WN) * 32, &splits, &k_per_split);
    float* ws = splits > 1 ? matmul_get_workspace((size_t)splits * M * N) : nullptr;
    dim3 grid(ceil_div(M, BM) * ceil_div(N, BN), 1, splits);
    bool va = matmul_vec_ok(A, lda), vb = matmul_vec_ok(B, ldb);
    matmul_dispatch_trans<NN_ONLY>("launch_tf32", trans_a, trans_b, [&](auto ta, auto tb) {
        launch_tf32_one<BM, BN, BK, WM, WN, STAGES, decltype(ta)::value, decltype(tb)::value, ROUND, FDB, PERM>(
            grid, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ws, k_per_split, va, vb, stream);
    });
    if (splits > 1) matmul_splitk_reduce(ws, splits, M, N, alpha, beta, C, ldc, stream);
}

// TF32 GEMM with the same contract and tile choice as matmul_sgemm_v5 (results within TF32 rounding, not fp32).
void matmul_sgemm_tf32_v6(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                          const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_sgemm_tf32_v6", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    if (N <= 32)
        launch_tf32<128, 32, 32, 32, 32, 3>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else if ((long long)ceil_div(M, 128) * ceil_div(N, 128) >= matmul_num_sms())
        launch_tf32<128, 128, 32, 64, 64, 3>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else
        launch_tf32<64, 64, 32, 32, 32, 3>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}

// ----------------------------------------------------------------------------------------------------------------
// version 7: Hopper warpgroup MMA (wgmma.mma_async m64nNk8 tf32) fed by TMA (cp.async.bulk.tensor) through a
// multi-stage mbarrier pipeline. sm_90a only: the kernel bodies exist only in an sm_90a build; elsewhere
// matmul_sgemm_tf32_v7 runs version 6 and the tests / benchmark report v7 as SKIP.
//
// Block: 3 warpgroups. Warpgroup 0 is the producer (one thread issues the TMA copies of each k-tile and gives its
//   registers back with setmaxnreg); warpgroups 1 and 2 are consumers, each owning 64 rows of the 128 x BN block
//   tile and issuing m64nBNk8 wgmmas (BN = 256: 128 fp32 accumulators per thread).
// Shared memory: STAGES x (A tile 128 x 32 + B tile BN x 32), fp32, both K-major (TF32 wgmma reads only K-major
//   operands), one 128-byte row per tile row, 128-byte swizzle (16-byte chunk c of row r stored at chunk c ^ (r % 8),
//   which TMA writes and the wgmma descriptor reads). mbarriers: full[s] (TMA bytes landed; tx-count) and empty[s]
//   (8 consumer warps done with stage s).
// Operands: A as stored (M x K, lda % 4 == 0, 16-byte aligned) goes straight to TMA; otherwise (transposed or
//   misaligned) it is first staged into a K-major scratch copy. B is always staged into a K-major scratch copy
//   (N x K: a transpose for B as stored, a copy for B transposed), rounded to TF32 on the way. The staging passes
//   are part of every call and of its measured time (4096^3 NN: 64 MB read + 64 MB written for B).
// Rounding (round to nearest TF32, ties away from zero, as version 6): B is rounded while staged; A is read from
//   shared memory into registers (the wgmma "A in registers" form), rounded there with the half-ulp add, and
//   the tensor core ignores the low 13 bits. Variant "ss trunc A" feeds A straight from shared memory instead
//   (A truncated to TF32, twice the rounding error: checked with cuBLAS TF32's truncation tolerance).
// K tails and M, N edges: TMA fills out-of-range elements of a box with zeros; the epilogue masks the stores.

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MATMUL_SM90A 1
#else
#define MATMUL_SM90A 0
#endif

__global__ void matmul_sm90a_probe_kernel(int* has_sm90a) { *has_sm90a = MATMUL_SM90A; }

// true when a GPU is present, it is compute capability 9.0 and this binary carries sm_90a code for it
static bool matmul_have_sm90a() {
    static int cached = -1;
    if (cached >= 0) return cached == 1;
    cached = 0;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) { cudaGetLastError(); return false; }
    int dev, major, minor;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9 || minor != 0) return false;
    int* d_flag;
    cudaCheck(cudaMalloc(&d_flag, sizeof(int)));
    matmul_sm90a_probe_kernel<<<1, 1>>>(d_flag);
    cudaError_t err = cudaGetLastError();  // no kernel image for this GPU: not an sm_90a build
    int flag = 0;
    if (err == cudaSuccess) cudaCheck(cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_flag));
    cached = flag == 1 ? 1 : 0;
    return cached == 1;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#if MATMUL_SM90A
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
#endif
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#if MATMUL_SM90A
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if MATMUL_SM90A
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
#endif
}
// waits for the completion of the barrier's phase with this parity (a fresh barrier counts its phase "parity 1"
// as complete, so the producer's first wait on empty[s] with parity 1 passes at once)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if MATMUL_SM90A
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}
// 2D TMA box load: coordinates (c0 along the contiguous dimension, c1 along rows); completes on bar's tx-count
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
#if MATMUL_SM90A
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
        : "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if MATMUL_SM90A
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if MATMUL_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N_PENDING>
__device__ __forceinline__ void wgmma_wait() {
#if MATMUL_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N_PENDING) : "memory");
#endif
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
#if MATMUL_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
#if MATMUL_SM90A
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
// keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma (the registers are
// written by the tensor core until wgmma.wait_group returns)
template <int NR>
__device__ __forceinline__ void acc_fence(float (&d)[NR]) {
#pragma unroll
    for (int i = 0; i < NR; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle layout: bits 0-13 start address / 16,
// 16-29 leading byte offset / 16 (unused for swizzled K-major; 1), 32-45 stride byte offset / 16 (1024 bytes
// between 8-row groups), 62-63 layout (1 = 128-byte swizzle). The tile base is 1024-byte aligned (base offset 0);
// the k-step s of 8 tf32 (32 bytes) starts at base + 32 s, and the hardware applies the swizzle to the full address.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// d (64 x N per warpgroup) += a (64 x 8) b (8 x N). Accumulator fragment (warp w of the warpgroup, g = lane / 4,
// t = lane % 4): d[4j + 0..1] = rows 16w + g, columns 8j + 2t, +1; d[4j + 2..3] = row 16w + g + 8, same columns.
// A in registers (rs): a[0] (16w + g, t), a[1] (16w + g + 8, t), a[2] (16w + g, t + 4), a[3] (16w + g + 8, t + 4).
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "{%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(1));
#endif
}
__device__ __forceinline__ void wgmma_tf32_ss(float (&d)[128], uint64_t a_desc, uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a_desc), "l"(b_desc), "n"(1));
#endif
}

__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(1));
#endif
}
__device__ __forceinline__ void wgmma_tf32_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a_desc), "l"(b_desc), "n"(1));
#endif
}

__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(1));
#endif
}
__device__ __forceinline__ void wgmma_tf32_ss(float (&d)[32], uint64_t a_desc, uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a_desc), "l"(b_desc), "n"(1));
#endif
}

template <int BN, int STAGES, int MINB>
struct WgmmaConfig {
    static constexpr int BM = 128, BK = 32;  // BK: 32 fp32 = one 128-byte swizzle row
    static constexpr int THREADS = 384;      // producer warpgroup + 2 consumer warpgroups
    static constexpr int A_BYTES = BM * BK * 4, B_BYTES = BN * BK * 4, STAGE_BYTES = A_BYTES + B_BYTES;
    static_assert(A_BYTES % 1024 == 0 && B_BYTES % 1024 == 0, "128-byte swizzled tiles start 1024-byte aligned");
    static_assert(BN % 8 == 0 && BN <= 256, "wgmma N is a multiple of 8 up to 256 (and a TMA box is <= 256 rows)");
    // + barriers, + 1024 so the stages can be aligned to 1024 bytes
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + 1024;
    // setmaxnreg: the producer drops to 40 registers, the consumers take what is left of the 64K-register file
    // shared by MINB blocks (multiples of 8; the sum must not exceed what the block holds at launch)
    static constexpr int LAUNCH_REGS = (65536 / (THREADS * MINB)) / 8 * 8;
    static constexpr int PRODUCER_REGS = 40;
    static constexpr int CONSUMER_REGS = ((LAUNCH_REGS * 3 - PRODUCER_REGS) / 2) / 8 * 8 > 256
                                             ? 256 : ((LAUNCH_REGS * 3 - PRODUCER_REGS) / 2) / 8 * 8;
};

// A_REGS: A via registers (rounded), else straight from shared memory (truncated). PIPE (A_REGS = false only): 1
// keeps one k-tile's wgmma group in flight while the next is issued (stage kt - 1 is released after wait_group 1);
// 0 waits for each k-tile's group before releasing its stage. With A in registers the fragments of the group in
// flight must stay untouched, so that path always waits for 0.
// PERSIST: one block per SM walks over the output tiles (the producer loads the next tile's stages during the
// epilogue of the current one); otherwise one block per tile.
template <int BN, int STAGES, int MINB, bool A_REGS, int PIPE = 0, bool PERSIST = false>
__global__ void __launch_bounds__(384, MINB)
matmul_wgmma_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b, int M,
                    int N, int K, float alpha, float beta, float* C, int ldc, bool vec_c) {
#if MATMUL_SM90A
    using Cfg = WgmmaConfig<BN, STAGES, MINB>;
    constexpr int NR = BN / 2;  // accumulators per consumer thread
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * Cfg::STAGE_BYTES);
    uint64_t* empty = full + STAGES;

    const int tiles_m = ceil_div(M, Cfg::BM), tiles_n = ceil_div(N, BN), tiles = tiles_m * tiles_n;
    const int tile_step = PERSIST ? gridDim.x : tiles;  // persistent: block b takes tiles b, b + grid, ...
    const int ntiles = ceil_div(K, Cfg::BK);            // k-tiles per output tile
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);  // one arrive per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // it counts k-tiles over all of this block's output tiles: stage it % STAGES, phase parity (it / STAGES) & 1
    if (wg == 0) {  // producer
        setmaxnreg_dec<Cfg::PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            uint32_t it = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += tile_step) {
                int bm, bn;
                grouped_tile(tile, tiles_m, tiles_n, bm, bn);
                for (int kt = 0; kt < ntiles; kt++, it++) {
                    const int s = it % STAGES;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    mbar_expect_tx(&full[s], Cfg::STAGE_BYTES);  // out-of-range box elements count too (zeros)
                    uint8_t* st = smem + s * Cfg::STAGE_BYTES;
                    tma_load_2d(st, &tmap_a, kt * Cfg::BK, bm * Cfg::BM, &full[s]);
                    tma_load_2d(st + Cfg::A_BYTES, &tmap_b, kt * Cfg::BK, bn * BN, &full[s]);
                }
            }
        }
    } else {  // consumers
        setmaxnreg_inc<Cfg::CONSUMER_REGS>();
        const int c = wg - 1;  // rows 64c .. 64c + 63 of the block tile
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        uint32_t it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += tile_step) {
            int bm, bn;
            grouped_tile(tile, tiles_m, tiles_n, bm, bn);
            const int m0 = bm * Cfg::BM, n0 = bn * BN;
            float acc[NR];
#pragma unroll
            for (int i = 0; i < NR; i++) acc[i] = 0.0f;
            acc_fence(acc);
            for (int kt = 0; kt < ntiles; kt++, it++) {
                const int s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                const uint8_t* st = smem + s * Cfg::STAGE_BYTES;
                const uint32_t a_addr = smem_u32(st) + c * 64 * 128, b_addr = smem_u32(st + Cfg::A_BYTES);
                if constexpr (A_REGS) {
                    // row r = 16 warp + g (+8) of this warpgroup's 64: r % 8 == g, so chunk q of it sits at q ^ g
                    const float* a_s = reinterpret_cast<const float*>(st) + (c * 64 + warp * 16 + g) * 32 + t;
                    uint32_t af[4][4];
#pragma unroll
                    for (int ks = 0; ks < 4; ks++) {
                        const int lo = ((2 * ks) ^ g) * 4, hi = ((2 * ks + 1) ^ g) * 4;
                        af[ks][0] = f32_to_tf32<TF32_ROUND_ADD>(a_s[lo]);
                        af[ks][1] = f32_to_tf32<TF32_ROUND_ADD>(a_s[8 * 32 + lo]);
                        af[ks][2] = f32_to_tf32<TF32_ROUND_ADD>(a_s[hi]);
                        af[ks][3] = f32_to_tf32<TF32_ROUND_ADD>(a_s[8 * 32 + hi]);
                    }
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < 4; ks++) wgmma_tf32_rs(acc, af[ks], wgmma_desc_sw128(b_addr + 32 * ks));
                } else {
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < 4; ks++)
                        wgmma_tf32_ss(acc, wgmma_desc_sw128(a_addr + 32 * ks), wgmma_desc_sw128(b_addr + 32 * ks));
                }
                wgmma_commit();
                if constexpr (A_REGS || PIPE == 0) {
                    wgmma_wait<0>();  // this warpgroup's reads of stage s are done (and af may be overwritten)
                    acc_fence(acc);
                    __syncwarp();
                    if (lane == 0) mbar_arrive(&empty[s]);
                } else {
                    wgmma_wait<1>();  // the group of the previous k-tile is done: release its stage
                    __syncwarp();
                    if (lane == 0 && kt > 0) mbar_arrive(&empty[(it + STAGES - 1) % STAGES]);
                }
            }
            wgmma_wait<0>();
            acc_fence(acc);
            if constexpr (!A_REGS && PIPE == 1) {  // release the last k-tile's stage
                __syncwarp();
                if (lane == 0 && ntiles > 0) mbar_arrive(&empty[(it + STAGES - 1) % STAGES]);
            }

            // epilogue: C = alpha acc + beta C straight from the accumulator fragments (8-byte stores where
            // possible); in a persistent block the producer is meanwhile loading the next tile's first stages
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int m = m0 + c * 64 + warp * 16 + g + 8 * h;
                if (m >= M) continue;
                float* crow = C + (size_t)m * ldc;
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    const int n = n0 + 8 * j + 2 * t;
                    float v0 = alpha * acc[4 * j + 2 * h], v1 = alpha * acc[4 * j + 2 * h + 1];
                    if (vec_c && n + 1 < N) {
                        float2* p = reinterpret_cast<float2*>(crow + n);
                        if (beta != 0.0f) {
                            float2 old = *p;
                            v0 = fmaf(beta, old.x, v0);
                            v1 = fmaf(beta, old.y, v1);
                        }
                        *p = make_float2(v0, v1);
                    } else {
                        if (n < N) crow[n] = beta != 0.0f ? fmaf(beta, crow[n], v0) : v0;
                        if (n + 1 < N) crow[n + 1] = beta != 0.0f ? fmaf(beta, crow[n + 1], v1) : v1;
                    }
                }
            }
        }
    }
#endif
}

// Staging pass: out (O rows x ldo, k contiguous) = op(X) rounded to TF32 (nearest, ties away: + half ulp, then the
// low 13 bits cleared). KCONTIG: X stored O x K (X[o * ld + k]); otherwise stored K x O (X[k * ld + o]) and
// transposed through a 32 x 33 shared tile so both the reads and the writes are coalesced. Block (32, 8).
__device__ __forceinline__ float round_to_tf32(float x) { return __uint_as_float((__float_as_uint(x) + 0x1000u) & ~0x1FFFu); }
template <bool KCONTIG>
__global__ void matmul_stage_kmajor_kernel(const float* X, int ld, int O, int K, float* out, int ldo) {
    __shared__ float tile[32][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int k0 = blockIdx.x * 32;
    for (int o0 = blockIdx.y * 32; o0 < O; o0 += gridDim.y * 32) {  // gridDim.y is capped at 65535
        if (KCONTIG) {
#pragma unroll
            for (int i = ty; i < 32; i += 8) {
                int o = o0 + i, k = k0 + tx;
                if (o < O && k < K) out[(size_t)o * ldo + k] = round_to_tf32(X[(size_t)o * ld + k]);
            }
        } else {
#pragma unroll
            for (int i = ty; i < 32; i += 8) {  // tile[k][o], coalesced along o
                int k = k0 + i, o = o0 + tx;
                tile[i][tx] = (k < K && o < O) ? X[(size_t)k * ld + o] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int i = ty; i < 32; i += 8) {  // out[o][k], coalesced along k
                int o = o0 + i, k = k0 + tx;
                if (o < O && k < K) out[(size_t)o * ldo + k] = round_to_tf32(tile[tx][i]);
            }
            __syncthreads();  // the next o-tile overwrites the tile
        }
    }
}

// K-major scratch copies of the operands (grow on demand, kept; one stream, like the split-K workspace)
static float* matmul_stage_buf[2] = {nullptr, nullptr};
static size_t matmul_stage_floats[2] = {0, 0};
static float* matmul_stage_kmajor(int which, const float* X, int ld, bool kcontig, int O, int K, int ldo,
                                  cudaStream_t stream) {
    size_t need = (size_t)O * ldo;
    if (need > matmul_stage_floats[which]) {
        if (matmul_stage_buf[which]) cudaCheck(cudaFree(matmul_stage_buf[which]));
        cudaCheck(cudaMalloc(&matmul_stage_buf[which], need * sizeof(float)));
        matmul_stage_floats[which] = need;
    }
    float* out = matmul_stage_buf[which];
    dim3 block(32, 8), grid(ceil_div(K, 32), std::min(ceil_div(O, 32), 65535));
    if (kcontig) matmul_stage_kmajor_kernel<true><<<grid, block, 0, stream>>>(X, ld, O, K, out, ldo);
    else matmul_stage_kmajor_kernel<false><<<grid, block, 0, stream>>>(X, ld, O, K, out, ldo);
    cudaCheck(cudaGetLastError());
    return out;
}
static void matmul_free_stage_bufs() {
    for (int i = 0; i < 2; i++) {
        if (matmul_stage_buf[i]) cudaCheck(cudaFree(matmul_stage_buf[i]));
        matmul_stage_buf[i] = nullptr;
        matmul_stage_floats[i] = 0;
    }
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda)
static PFN_cuTensorMapEncodeTiled_v12000 matmul_tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (fn == nullptr) {
        cudaDriverEntryPointQueryResult q;
        void* p = nullptr;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || p == nullptr) {
            fprintf(stderr, "cuTensorMapEncodeTiled: driver entry point not found (query result %d)\n", (int)q);
            exit(EXIT_FAILURE);
        }
        fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    return fn;
}
// rows x K fp32, k contiguous, row stride ld floats (ld % 4 == 0, X 16-byte aligned); box = box_rows x 32.
// The last 8 maps are kept: a map holds only the address, sizes and box, so a hit is the same map, and repeated
// calls (the MNIST shapes take ~30 us on the GPU) skip two encodes on the host.
static CUtensorMap matmul_tensor_map_kmajor(const float* X, int rows, int K, int ld, int box_rows) {
    struct Entry { const float* X; int rows, K, ld, box_rows; CUtensorMap map; };
    static Entry cache[8];
    static int n_cached = 0, next_slot = 0;
    for (int i = 0; i < n_cached; i++) {
        const Entry& e = cache[i];
        if (e.X == X && e.rows == rows && e.K == K && e.ld == ld && e.box_rows == box_rows) return e.map;
    }
    CUtensorMap map;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)ld * sizeof(float)};
    cuuint32_t box[2] = {32, (cuuint32_t)box_rows};
    cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = matmul_tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(X), dims,
                                             strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled failed (%d): rows=%d K=%d ld=%d box_rows=%d ptr=%p\n", (int)r, rows,
                K, ld, box_rows, (const void*)X);
        exit(EXIT_FAILURE);
    }
    cache[next_slot] = {X, rows, K, ld, box_rows, map};
    next_slot = (next_slot + 1) % 8;
    n_cached = std::min(n_cached + 1, 8);
    return map;
}

// Requires K > 0 and an sm_90a build on a 9.0 GPU (matmul_sgemm_tf32_v7 checks both).
template <int BN, int STAGES, int MINB, bool A_REGS, int PIPE = 0, bool PERSIST = false>
static void launch_wgmma(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                         const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    using Cfg = WgmmaConfig<BN, STAGES, MINB>;
    const int kpad = ceil_div(K, 4) * 4;  // staged copies: rows 16-byte aligned for TMA
    const float* a_km = A;
    int a_ld = lda;
    if (trans_a || !matmul_vec_ok(A, lda)) {
        a_km = matmul_stage_kmajor(0, A, lda, !trans_a, M, K, kpad, stream);
        a_ld = kpad;
    }
    const float* b_km = matmul_stage_kmajor(1, B, ldb, trans_b, N, K, kpad, stream);
    CUtensorMap map_a = matmul_tensor_map_kmajor(a_km, M, K, a_ld, Cfg::BM);
    CUtensorMap map_b = matmul_tensor_map_kmajor(b_km, N, K, kpad, BN);
    constexpr auto kernel = &matmul_wgmma_kernel<BN, STAGES, MINB, A_REGS, PIPE, PERSIST>;
    matmul_smem_opt_in<kernel>(Cfg::SMEM_BYTES);
    const bool vec_c = ((uintptr_t)C % 8 == 0) && (ldc % 2 == 0);
    const int tiles = ceil_div(M, Cfg::BM) * ceil_div(N, BN);
    dim3 grid(PERSIST ? std::min(tiles, matmul_num_sms() * MINB) : tiles);
    kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(map_a, map_b, M, N, K, alpha, beta, C, ldc, vec_c);
    cudaCheck(cudaGetLastError());
}

// TF32 GEMM on Hopper wgmma, same contract as matmul_sgemm_v5 / v6 (results within TF32 rounding). Runs version 6
// where the binary has no sm_90a code (or the GPU is not 9.0), for K = 0, N <= 32, and where version 6 splits K.
// Tiles: 128 x 256 (4 stages, 192 KB) when they fill the GPU, else 128 x 128 (6 stages), else 128 x 64 (8 stages).
void matmul_sgemm_tf32_v7(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                          const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_sgemm_tf32_v7", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    // version 7 has no split-K: where version 6 would split K (few tiles, long K: the dW GEMMs, fc1 forward) or
    // N <= 32 (a 64-wide wgmma half empty, and two staging passes for K = 9), version 6 is faster
    const long long sms = matmul_num_sms();
    int v6_splits = 1, v6_kps;
    if ((long long)ceil_div(M, 128) * ceil_div(N, 128) < sms)
        matmul_choose_splits(M, N, K, 64, 64, 32, 128, &v6_splits, &v6_kps);  // version 6's 64x64 configuration
    if (K == 0 || !matmul_have_sm90a() || N <= 32 || v6_splits > 1) {
        matmul_sgemm_tf32_v6(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
        return;
    }
    auto tiles = [&](int bn) { return (long long)ceil_div(M, 128) * ceil_div(N, bn); };
    if (N > 128 && tiles(256) >= sms)
        launch_wgmma<256, 4, 1, true>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else if (N > 64)
        launch_wgmma<128, 6, 1, true>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else
        launch_wgmma<64, 8, 1, true>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}

// ----------------------------------------------------------------------------------------------------------------
// version 8: bf16 GEMM on Hopper warpgroup MMA (wgmma.mma_async m64nNk16 .f32.bf16.bf16) fed by TMA
// (cp.async.bulk.tensor, 128-byte swizzle) through a STAGES-deep mbarrier ring; bf16 A and B, fp32 accumulation,
// fp32 C = alpha op(A) op(B) + beta C (the lab's contract, C in fp32). sm_90a only; elsewhere, and where TMA cannot
// read an operand (a row stride not a multiple of 16 bytes, a base not 16-byte aligned) or K = 0, it runs the
// CUDA-core fallback below.
//
// Block: 3 warpgroups. Warpgroup 0 is the producer: setmaxnreg.dec to 40 registers, one thread issues the TMA copies
//   of each k-tile. Warpgroups 1 and 2 are consumers (setmaxnreg.inc to 232): consumer c owns rows 64c..64c+63 of
//   the 128 x BN block tile, BN/2 fp32 accumulators a thread, 4 wgmma m64nBNk16 per k-tile of 64.
// Persistent (PERSIST): one block per SM walks the output tiles blockIdx.x, + gridDim.x, ... in grouped order (8
//   block-rows at a time, for L2 reuse); the producer fills the next tile's stages during the current epilogue.
// Shared memory: STAGES x (A 128 x 64 + B BN x 64) bf16, 1024-byte aligned, each operand in 128-byte swizzled
//   rows (16-byte chunk c of row r at chunk c ^ (r % 8)) that TMA writes and the wgmma descriptors read:
//   - K-major operand (A as stored, M x K; B transposed, N x K): one TMA box of 64 k x rows; a tile row is 64 k
//     (128 bytes), 8-row groups 1024 bytes apart; the k16 step s starts 32 s bytes in.
//   - MN-major operand (A transposed, K x M; B as stored, K x N): boxes of 64 m|n x 64 k, one 8 KB slab per 64
//     rows|columns; a slab row is one k (128 bytes), 8 k-rows per 1024-byte group, the next slab 8 KB further
//     (leading byte offset); the k16 step s starts 2048 s bytes in; wgmma's transpose bit is set for that operand.
//   These are the two layouts of train_unet.cu's conv_wgmma_kernel (MODE 0: both K-major; MODE 1: both MN-major).
// mbarriers: full[s] (1 arrive.expect_tx by the producer + the copies' bytes) and empty[s] (8 consumer warps).
//   k-tile `it` (counted over all of the block's tiles) uses stage it % STAGES with phase parity (it / STAGES) & 1;
//   the producer waits on empty with the opposite parity (a fresh barrier's "previous" phase counts as complete).
//   Each consumer keeps one wgmma group in flight: after committing k-tile it it waits for group it - 1 and then
//   releases stage (it - 1) % STAGES; the tile's last stage is released after wait_group 0.
// Edges: TMA fills the out-of-range part of a box with zeros and counts the whole box's bytes. An MN-major slab
//   wholly outside M or N is not copied (and not counted): its stale rows|columns reach only outputs that the
//   epilogue does not store. Rows beyond M, columns beyond N are masked in the epilogue.
// No proxy fence is needed: shared memory is written only by TMA and read only by wgmma (both the async proxy),
//   ordered by the mbarriers.

// CUDA-core fallback: 64 x 64 tiles, BK 16, 256 threads each owning 4 x 4 outputs (rows ty + 16 i, columns
// tx + 16 j); operands widened to fp32 in shared memory, sequential fp32 FMAs over k (products of bf16 are exact).
__global__ void __launch_bounds__(256)
matmul_bf16_fallback_kernel(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                            int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc) {
    __shared__ float As[16][64 + 1];  // As[k][m]
    __shared__ float Bs[16][64 + 1];  // Bs[k][n]
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 16) {
        for (int e = threadIdx.x; e < 64 * 16; e += 256) {
            // consecutive e walk the stored matrix's contiguous dimension, so the loads coalesce
            int m = trans_a ? e % 64 : e / 16, k = trans_a ? e / 64 : e % 16;
            int gm = m0 + m, gk = k0 + k;
            As[k][m] = (gm < M && gk < K)
                           ? __bfloat162float(trans_a ? A[(size_t)gk * lda + gm] : A[(size_t)gm * lda + gk]) : 0.0f;
            int n = trans_b ? e / 16 : e % 64;
            k = trans_b ? e % 16 : e / 64;
            int gn = n0 + n;
            gk = k0 + k;
            Bs[k][n] = (gn < N && gk < K)
                           ? __bfloat162float(trans_b ? B[(size_t)gn * ldb + gk] : B[(size_t)gk * ldb + gn]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 16; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = As[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = Bs[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
            if (m < M && n < N) store_out(C, ldc, m, n, acc[i][j], alpha, beta);
        }
}

static void matmul_bf16_fallback(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                                 int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc,
                                 cudaStream_t stream) {
    matmul_check_args("matmul_bf16_fallback", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    dim3 grid(ceil_div(N, 64), ceil_div(M, 64));
    if (grid.y > 65535) {
        fprintf(stderr, "matmul_bf16_fallback: M = %d needs %u block rows, more than 65535\n", M, grid.y);
        exit(EXIT_FAILURE);
    }
    matmul_bf16_fallback_kernel<<<grid, 256, 0, stream>>>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C,
                                                          ldc);
    cudaCheck(cudaGetLastError());
}

// Shared-memory matrix descriptor, 128-byte swizzle (bits 62-63 = 1), tile 1024-byte aligned (base offset 0).
// Fields: start address / 16 (bits 0-13), leading byte offset / 16 (16-29; K-major swizzled: unused, 1; MN-major:
// the distance between 64-element slabs), stride byte offset / 16 (32-45: 1024 bytes between 8-row groups).
__device__ __forceinline__ uint64_t wgmma_desc_bf16(uint32_t saddr, uint32_t lead) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(lead >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// d (64 x N per warpgroup) += a (64 x 16) b (16 x N), bf16 operands from shared memory, fp32 accumulators. TA / TB:
// the operand is MN-major (wgmma's transpose bit). Accumulator fragment (warp w, g = lane / 4, t = lane % 4):
// d[4j + 2h + e] is row 16w + g + 8h, column 8j + 2t + e.
template <int TA, int TB>
__device__ __forceinline__ void wgmma_bf16(float (&d)[128], uint64_t a_desc, uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
        "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, "
        "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, "
        "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
          "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
          "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
          "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
          "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),
          "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),
          "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
          "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),
          "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]),
          "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]),
          "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]),
          "+f"(d[127])
        : "l"(a_desc), "l"(b_desc), "n"(1), "n"(TA), "n"(TB));
#endif
}
template <int TA, int TB>
__device__ __forceinline__ void wgmma_bf16(float (&d)[64], uint64_t a_desc, uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
          "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
          "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
          "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
          "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
          "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a_desc), "l"(b_desc), "n"(1), "n"(TA), "n"(TB));
#endif
}
template <int TA, int TB>
__device__ __forceinline__ void wgmma_bf16(float (&d)[32], uint64_t a_desc, uint64_t b_desc) {
#if MATMUL_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
          "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
          "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
          "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a_desc), "l"(b_desc), "n"(1), "n"(TA), "n"(TB));
#endif
}

template <int BN, int STAGES>
struct Bf16WgmmaConfig {
    static constexpr int BM = 128, BK = 64;  // BK: 64 bf16 = one 128-byte swizzle row
    static constexpr int THREADS = 384;      // producer warpgroup + 2 consumer warpgroups
    static constexpr int SLAB = 64 * BK * 2;  // 8 KB: 64 rows of 128 bytes (one consumer's A; one MN-major box)
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    static_assert(BN % 64 == 0 && BN <= 256, "MN-major B comes in 64-column slabs; wgmma N and a TMA box <= 256");
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + 1024;  // + barriers, + alignment
    static_assert(SMEM_BYTES <= 227 * 1024, "the H100's shared memory per block");
    static_assert(STAGES >= 2, "a ring of at least 2 stages");
    // setmaxnreg moves registers inside the block's own pool (what it was launched with, 65536 / 384 rounded down to
    // a multiple of 8 = 168 a thread): the producer gives back down to 40 and the consumers take at most what that
    // frees, or setmaxnreg.inc waits forever (dev/unet_NOTES.md, "Call 3's hang")
    static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = (3 * LAUNCH_REGS - PRODUCER_REGS) / 2 / 8 * 8;
    static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= THREADS * LAUNCH_REGS, "the block's registers");
    static_assert(CONSUMER_REGS <= 256 && CONSUMER_REGS >= BN / 2 + 40, "accumulators + addressing fit");
};

// TA: A stored K x M (MN-major); TB: B stored N x K (K-major). See the section comment for the layouts.
template <int BN, int STAGES, bool TA, bool TB, bool PERSIST>
__global__ void __launch_bounds__(384, 1)
matmul_bf16_wgmma_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                         int M, int N, int K, float alpha, float beta, float* C, int ldc, bool vec_c) {
#if MATMUL_SM90A
    using Cfg = Bf16WgmmaConfig<BN, STAGES>;
    constexpr int NR = BN / 2;  // accumulators per consumer thread
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * Cfg::STAGE_BYTES);
    uint64_t* empty = full + STAGES;

    const int tiles_m = ceil_div(M, Cfg::BM), tiles_n = ceil_div(N, BN), tiles = tiles_m * tiles_n;
    const int tile_step = PERSIST ? gridDim.x : tiles;
    const int ktiles = ceil_div(K, Cfg::BK);  // k-tiles per output tile (K > 0)
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);  // one arrive per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<Cfg::PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            uint32_t it = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += tile_step) {
                int bm, bn;
                grouped_tile(tile, tiles_m, tiles_n, bm, bn);
                const int m0 = bm * Cfg::BM, n0 = bn * BN;
                // MN-major slabs that hold at least one row (column) inside M (N); K-major boxes always do
                const int a_slabs = TA ? min(2, ceil_div(M - m0, 64)) : 0;
                const int b_slabs = TB ? 0 : min(BN / 64, ceil_div(N - n0, 64));
                const uint32_t bytes =
                    (TA ? a_slabs * Cfg::SLAB : Cfg::A_BYTES) + (TB ? Cfg::B_BYTES : b_slabs * Cfg::SLAB);
                for (int kt = 0; kt < ktiles; kt++, it++) {
                    const int s = it % STAGES, k0 = kt * Cfg::BK;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    mbar_expect_tx(&full[s], bytes);
                    uint8_t* a = smem + s * Cfg::STAGE_BYTES;
                    uint8_t* b = a + Cfg::A_BYTES;
                    if (TA) {
                        for (int j = 0; j < a_slabs; j++)
                            tma_load_2d(a + j * Cfg::SLAB, &tmap_a, m0 + 64 * j, k0, &full[s]);
                    } else {
                        tma_load_2d(a, &tmap_a, k0, m0, &full[s]);
                    }
                    if (TB) {
                        tma_load_2d(b, &tmap_b, k0, n0, &full[s]);
                    } else {
                        for (int j = 0; j < b_slabs; j++)
                            tma_load_2d(b + j * Cfg::SLAB, &tmap_b, n0 + 64 * j, k0, &full[s]);
                    }
                }
            }
        }
    } else {  // consumers
        setmaxnreg_inc<Cfg::CONSUMER_REGS>();
        const int c = wg - 1;  // rows 64c .. 64c + 63 of the block tile
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        uint32_t it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += tile_step) {
            int bm, bn;
            grouped_tile(tile, tiles_m, tiles_n, bm, bn);
            const int m0 = bm * Cfg::BM, n0 = bn * BN;
            float acc[NR];
#pragma unroll
            for (int i = 0; i < NR; i++) acc[i] = 0.0f;
            acc_fence(acc);
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                // consumer c's 64 rows of A are slab c in both layouts (K-major: 64 rows x 128 bytes)
                const uint32_t a = smem_u32(smem + s * Cfg::STAGE_BYTES) + c * Cfg::SLAB;
                const uint32_t b = smem_u32(smem + s * Cfg::STAGE_BYTES) + Cfg::A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < Cfg::BK / 16; ks++) {
                    // K-major: the k16 step is 32 bytes along the row; MN-major: 16 k-rows = 2048 bytes
                    const uint64_t da =
                        TA ? wgmma_desc_bf16(a + 2048 * ks, Cfg::SLAB) : wgmma_desc_bf16(a + 32 * ks, 16);
                    const uint64_t db =
                        TB ? wgmma_desc_bf16(b + 32 * ks, 16) : wgmma_desc_bf16(b + 2048 * ks, Cfg::SLAB);
                    wgmma_bf16<TA ? 1 : 0, TB ? 0 : 1>(acc, da, db);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous k-tile's group is done: release its stage
                __syncwarp();
                if (lane == 0 && kt > 0) mbar_arrive(&empty[(it + STAGES - 1) % STAGES]);
            }
            wgmma_wait<0>();
            acc_fence(acc);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[(it + STAGES - 1) % STAGES]);  // the tile's last stage (ktiles > 0)

            // epilogue: C = alpha acc + beta C from the fragments (8-byte stores where C allows); beta = 0 never
            // reads C. Meanwhile the producer loads the next tile's first stages.
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int m = m0 + c * 64 + warp * 16 + g + 8 * h;
                if (m >= M) continue;
                float* crow = C + (size_t)m * ldc;
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    const int n = n0 + 8 * j + 2 * t;
                    float v0 = alpha * acc[4 * j + 2 * h], v1 = alpha * acc[4 * j + 2 * h + 1];
                    if (vec_c && n + 1 < N) {
                        float2* p = reinterpret_cast<float2*>(crow + n);
                        if (beta != 0.0f) {
                            float2 old = *p;
                            v0 = fmaf(beta, old.x, v0);
                            v1 = fmaf(beta, old.y, v1);
                        }
                        *p = make_float2(v0, v1);
                    } else {
                        if (n < N) crow[n] = beta != 0.0f ? fmaf(beta, crow[n], v0) : v0;
                        if (n + 1 < N) crow[n + 1] = beta != 0.0f ? fmaf(beta, crow[n + 1], v1) : v1;
                    }
                }
            }
        }
    }
#endif
}

// TMA needs a 16-byte aligned base and row strides that are multiples of 16 bytes (8 bf16)
static bool matmul_bf16_tma_ok(const void* p, int ld) { return (uintptr_t)p % 16 == 0 && ld % 8 == 0; }

// bf16 matrix of `outer` rows of `inner` contiguous elements, row stride ld elements; box 64 x box_outer, 128-byte
// swizzle, out-of-range elements read as zero. The last 8 maps are kept (as matmul_tensor_map_kmajor does).
static CUtensorMap matmul_tensor_map_bf16(const __nv_bfloat16* X, int inner, int outer, int ld, int box_outer) {
    struct Entry { const __nv_bfloat16* X; int inner, outer, ld, box_outer; CUtensorMap map; };
    static Entry cache[8];
    static int n_cached = 0, next_slot = 0;
    for (int i = 0; i < n_cached; i++) {
        const Entry& e = cache[i];
        if (e.X == X && e.inner == inner && e.outer == outer && e.ld == ld && e.box_outer == box_outer) return e.map;
    }
    CUtensorMap map;
    cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    cuuint64_t strides[1] = {(cuuint64_t)ld * sizeof(__nv_bfloat16)};
    cuuint32_t box[2] = {64, (cuuint32_t)box_outer};
    cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = matmul_tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(X),
                                             dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled (bf16) failed (%d): inner=%d outer=%d ld=%d box_outer=%d ptr=%p\n",
                (int)r, inner, outer, ld, box_outer, (const void*)X);
        exit(EXIT_FAILURE);
    }
    cache[next_slot] = {X, inner, outer, ld, box_outer, map};
    next_slot = (next_slot + 1) % 8;
    n_cached = std::min(n_cached + 1, 8);
    return map;
}

// Requires K > 0, TMA-ready operands (matmul_bf16_tma_ok) and an sm_90a build on a 9.0 GPU (matmul_bf16_v8 checks).
template <int BN, int STAGES, bool PERSIST>
static void launch_bf16_wgmma(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                              int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc,
                              cudaStream_t stream) {
    using Cfg = Bf16WgmmaConfig<BN, STAGES>;
    // A: K-major box 64 k x 128 rows, or MN-major boxes 64 m x 64 k; B: K-major 64 k x BN rows, or 64 n x 64 k
    CUtensorMap map_a =
        trans_a ? matmul_tensor_map_bf16(A, M, K, lda, 64) : matmul_tensor_map_bf16(A, K, M, lda, Cfg::BM);
    CUtensorMap map_b = trans_b ? matmul_tensor_map_bf16(B, K, N, ldb, BN) : matmul_tensor_map_bf16(B, N, K, ldb, 64);
    const bool vec_c = ((uintptr_t)C % 8 == 0) && (ldc % 2 == 0);
    const int tiles = ceil_div(M, Cfg::BM) * ceil_div(N, BN);
    dim3 grid(PERSIST ? std::min(tiles, matmul_num_sms()) : tiles);
    matmul_dispatch_trans("launch_bf16_wgmma", trans_a, trans_b, [&](auto TA, auto TB) {
        constexpr auto kernel =
            &matmul_bf16_wgmma_kernel<BN, STAGES, decltype(TA)::value, decltype(TB)::value, PERSIST>;
        matmul_smem_opt_in<kernel>(Cfg::SMEM_BYTES);
        kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(map_a, map_b, M, N, K, alpha, beta, C, ldc, vec_c);
    });
    cudaCheck(cudaGetLastError());
}

// bf16 GEMM on Hopper wgmma: C (fp32, M x N, ldc) = alpha op(A) op(B) + beta C with A, B bf16 (same layouts as the
// fp32 versions), fp32 accumulation. Persistent 128 x 256 tiles (4 stages, 192 KB) when N > 128 and they fill the
// GPU, else 128 x 128 (6 stages), else 128 x 64 (8 stages); no split-K. Runs the CUDA-core fallback where the binary
// has no sm_90a code (or the GPU is not 9.0), for K = 0, and where an operand is not TMA-ready.
void matmul_bf16_v8(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const __nv_bfloat16* A, int lda,
                    const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_bf16_v8", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    if (K == 0 || !matmul_have_sm90a() || !matmul_bf16_tma_ok(A, lda) || !matmul_bf16_tma_ok(B, ldb)) {
        matmul_bf16_fallback(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
        return;
    }
    const long long sms = matmul_num_sms();
    if (N > 128 && (long long)ceil_div(M, 128) * ceil_div(N, 256) >= sms)
        launch_bf16_wgmma<256, 4, true>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else if (N > 64)
        launch_bf16_wgmma<128, 6, true>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
    else
        launch_bf16_wgmma<64, 8, true>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}

#ifndef DEV_KERNELS_ONLY  // dev/torch_ops includes this file for versions 5-8: cuBLAS, the benchmark variants, the
                          // tests, the benchmark and main stay out

// ----------------------------------------------------------------------------------------------------------------
// version 0: cuBLAS (row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands)

static cublasHandle_t cublas_handle(bool tf32) {
    static cublasHandle_t handles[2] = {nullptr, nullptr};
    cublasHandle_t& h = handles[tf32 ? 1 : 0];
    if (h == nullptr) {
        cublasCheck(cublasCreate(&h));
        cublasCheck(cublasSetMathMode(h, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    }
    return h;
}
static void matmul_cublas(bool tf32, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                          int lda, const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_cublas", trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    cublasHandle_t h = cublas_handle(tf32);
    cublasCheck(cublasSetStream(h, stream));
    cublasCheck(cublasSgemm(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                            &alpha, B, ldb, A, lda, &beta, C, ldc));
}
static void matmul_cublas_fp32_v0(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                  const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_cublas(false, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
static void matmul_cublas_tf32_v0(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                  const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_cublas(true, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
// cuBLAS bf16, the baseline of version 8: cublasGemmEx with bf16 A and B, fp32 C, CUBLAS_COMPUTE_32F (fp32
// accumulation on the tensor cores)
static void matmul_cublas_bf16_v0(bool ta, bool tb, int M, int N, int K, float alpha, const __nv_bfloat16* A, int lda,
                                  const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_cublas_bf16_v0", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    cublasHandle_t h = cublas_handle(false);
    cublasCheck(cublasSetStream(h, stream));
    cublasCheck(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B,
                             CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
}

// ----------------------------------------------------------------------------------------------------------------
// benchmark-only tile variants of versions 5 and 6 (A and B not transposed), to pick the 4096^3 configuration

static void matmul_v5_128x128x8(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v5_128x128x8", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_warptile<128, 128, 8, 2, 2, 2, true>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
static void matmul_v5_256x128_512t(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                   const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v5_256x128_512t", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_warptile<256, 128, 8, 2, 2, 1, true>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
static void matmul_v5_256x128x16(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                 const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v5_256x128x16", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_warptile<256, 128, 16, 4, 2, 1, true>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
template <int BM, int BN, int RM, int RN, bool ASYNC_B>
static void matmul_v5_variant(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                              const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v5_variant", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_warptile<BM, BN, 8, RM, RN, 1, true, 8, ASYNC_B>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                                           stream);
}
static void matmul_v5_256x128_8x16(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                   const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v5_256x128_8x16", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_warptile<256, 128, 8, 2, 4, 1, true>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
template <int GROUP>
static void matmul_v5_256x128_group(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                    const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v5_256x128_group", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_warptile<256, 128, 8, 4, 2, 1, true, GROUP>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
// version 5's asynchronous pipeline (matmul_warptile_async_kernel) at fixed tiles: BM x BN x BK, (4 RM) x (4 RN)
// outputs per thread, MINB blocks per SM, STAGES k-tiles in flight
template <int BM, int BN, int BK, int RM, int RN, int MINB, int STAGES, bool NN_ONLY>
static void matmul_v5_async(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                            const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v5_async", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_warptile_async<BM, BN, BK, RM, RN, MINB, STAGES, NN_ONLY>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C,
                                                                     ldc, stream);
}
static void matmul_v6_perm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                           const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v6_perm", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_tf32<128, 128, 32, 64, 64, 3, false, TF32_ROUND_ADD, false, true>(ta, tb, M, N, K, alpha, A, lda, B, ldb,
                                                                             beta, C, ldc, stream);
}
static void matmul_v6_128x256x32(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                 const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v6_128x256x32", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_tf32<128, 256, 32, 64, 64, 3, true>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
static void matmul_v6_cvt_rna(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                              const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v6_cvt_rna", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_tf32<128, 128, 32, 64, 64, 3, true, TF32_ROUND_CVT>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                                               stream);
}
static void matmul_v6_trunc(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                            const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args("matmul_v6_trunc", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    launch_tf32<128, 128, 32, 64, 64, 3, true, TF32_TRUNC>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                                           stream);
}

// version 7 variants: 128 x 128 tiles with 6 stages, and A fed from shared memory (truncated to TF32). (Two blocks
// per SM do not compile: ptxas sizes the whole kernel by the launch bound, 80 registers, not by setmaxnreg.)
template <int BN, int STAGES, int MINB, bool A_REGS, int PIPE = 0, bool PERSIST = false>
static void matmul_v7_fixed(const char* fn, bool ta, bool tb, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_check_args(fn, ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    if (K == 0 || !matmul_have_sm90a()) {
        matmul_sgemm_tf32_v6(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
        return;
    }
    launch_wgmma<BN, STAGES, MINB, A_REGS, PIPE, PERSIST>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                                          stream);
}
static void matmul_v7_128x128(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                              const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_v7_fixed<128, 6, 1, true>("matmul_v7_128x128", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                     stream);
}
static void matmul_v7_ss_trunc_pipe1(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                     const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_v7_fixed<256, 4, 1, false, 1>("matmul_v7_ss_trunc_pipe1", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C,
                                         ldc, stream);
}
static void matmul_v7_persistent(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                 const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_v7_fixed<256, 4, 1, true, 0, true>("matmul_v7_persistent", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta,
                                              C, ldc, stream);
}
static void matmul_v7_ss_pipe1_persistent(bool ta, bool tb, int M, int N, int K, float alpha, const float* A,
                                          int lda, const float* B, int ldb, float beta, float* C, int ldc,
                                          cudaStream_t stream) {
    matmul_v7_fixed<256, 4, 1, false, 1, true>("matmul_v7_ss_pipe1_persistent", ta, tb, M, N, K, alpha, A, lda, B,
                                               ldb, beta, C, ldc, stream);
}
static void matmul_v7_ss_trunc(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                               const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
    matmul_v7_fixed<256, 4, 1, false>("matmul_v7_ss_trunc", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                      stream);
}

// version 8 at fixed configurations (the wgmma kernel itself at every test shape and transpose; the fallback where
// an operand is not TMA-ready, K = 0 or there is no sm_90a code, as in matmul_bf16_v8)
template <int BN, int STAGES, bool PERSIST>
static void matmul_v8_fixed(const char* fn, bool ta, bool tb, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                            int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc,
                            cudaStream_t stream) {
    matmul_check_args(fn, ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (M == 0 || N == 0) return;
    if (K == 0 || !matmul_have_sm90a() || !matmul_bf16_tma_ok(A, lda) || !matmul_bf16_tma_ok(B, ldb)) {
        matmul_bf16_fallback(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
        return;
    }
    launch_bf16_wgmma<BN, STAGES, PERSIST>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}
static void matmul_v8_256_persistent(bool ta, bool tb, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                                     int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc,
                                     cudaStream_t stream) {
    matmul_v8_fixed<256, 4, true>("matmul_v8_256_persistent", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                  stream);
}
static void matmul_v8_256_per_tile(bool ta, bool tb, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                                   int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc,
                                   cudaStream_t stream) {
    matmul_v8_fixed<256, 4, false>("matmul_v8_256_per_tile", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                   stream);
}
static void matmul_v8_128_persistent(bool ta, bool tb, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                                     int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc,
                                     cudaStream_t stream) {
    matmul_v8_fixed<128, 6, true>("matmul_v8_128_persistent", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                  stream);
}
static void matmul_v8_64_persistent(bool ta, bool tb, int M, int N, int K, float alpha, const __nv_bfloat16* A,
                                    int lda, const __nv_bfloat16* B, int ldb, float beta, float* C, int ldc,
                                    cudaStream_t stream) {
    matmul_v8_fixed<64, 8, true>("matmul_v8_64_persistent", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                                 stream);
}

// ----------------------------------------------------------------------------------------------------------------
// the list of versions

typedef void (*MatmulFn)(bool, bool, int, int, int, float, const float*, int, const float*, int, float, float*, int,
                         cudaStream_t);
typedef void (*MatmulBf16Fn)(bool, bool, int, int, int, float, const __nv_bfloat16*, int, const __nv_bfloat16*, int,
                             float, float*, int, cudaStream_t);
struct Variant {
    const char* name;
    int version;
    Precision prec;
    bool nn_only;      // compiled for A and B as stored only (tested and benchmarked there only)
    bool square_only;  // a tile variant: benchmarked at 4096^3 only (tested everywhere it is compiled)
    bool sm90a;        // needs the sm_90a build on a 9.0 GPU (wgmma): SKIP elsewhere
    MatmulFn fn;       // fp32 operands, or
    MatmulBf16Fn fn_bf16 = nullptr;  // bf16 operands (prec PREC_BF16; fn is null)
};
static const Variant VARIANTS[] = {
    {"0 cuBLAS fp32", 0, PREC_FP32, false, false, false, matmul_cublas_fp32_v0},
    {"0 cuBLAS TF32", 0, PREC_TF32_ANY, false, false, false, matmul_cublas_tf32_v0},
    {"0 cuBLAS bf16", 0, PREC_BF16, false, false, false, nullptr, matmul_cublas_bf16_v0},
    {"1 naive", 1, PREC_FP32, false, false, false, matmul_naive_v1},
    {"2 smem 32x32", 2, PREC_FP32, false, false, false, matmul_smem_tile_v2},
    {"3 blocktile 8x8", 3, PREC_FP32, false, false, false, matmul_blocktile_v3},
    {"4 vectorized", 4, PREC_FP32, false, false, false, matmul_vectorized_v4},
    {"5 warptile+dbuf", 5, PREC_FP32, false, false, false, matmul_sgemm_v5},
    {"5 (128x128x8)", 5, PREC_FP32, true, true, false, matmul_v5_128x128x8},
    {"5 (256x128 8x8 512thr)", 5, PREC_FP32, true, true, false, matmul_v5_256x128_512t},
    {"5 (256x128x16 dyn smem)", 5, PREC_FP32, true, true, false, matmul_v5_256x128x16},
    {"5 (256x128 8x16/thread)", 5, PREC_FP32, true, true, false, matmul_v5_256x128_8x16},
    {"5 (256x128 group 4)", 5, PREC_FP32, true, true, false, matmul_v5_256x128_group<4>},
    {"5 (256x128 group 16)", 5, PREC_FP32, true, true, false, matmul_v5_256x128_group<16>},
    {"5 (256x128 async B)", 5, PREC_FP32, true, true, false, matmul_v5_variant<256, 128, 4, 2, true>},
    {"5 (256x128 8x16 async B)", 5, PREC_FP32, true, true, false, matmul_v5_variant<256, 128, 2, 4, true>},
    {"5 (128x256 16x8)", 5, PREC_FP32, true, true, false, matmul_v5_variant<128, 256, 4, 2, false>},
    {"5 (128x256 16x8 async B)", 5, PREC_FP32, true, true, false, matmul_v5_variant<128, 256, 4, 2, true>},
    {"5 (reg-staged 256x128 16x8)", 5, PREC_FP32, true, true, false, matmul_v5_variant<256, 128, 4, 2, false>},
    // the default's 256x128 path called directly, so that its exact kernels are checked at every test shape and
    // transpose (matmul_sgemm_v5 picks it only for large problems)
    {"5 (async 256x128x16 8x16 3st = default)", 5, PREC_FP32, false, true, false,
     matmul_v5_async<256, 128, 16, 2, 4, 1, 3, false>},
    {"5 (async 256x128 16x8 3st)", 5, PREC_FP32, false, true, false, matmul_v5_async<256, 128, 8, 4, 2, 1, 3, false>},
    {"5 (async 256x128 16x8 4st)", 5, PREC_FP32, true, true, false, matmul_v5_async<256, 128, 8, 4, 2, 1, 4, true>},
    {"5 (async 256x128 16x8 2st)", 5, PREC_FP32, true, true, false, matmul_v5_async<256, 128, 8, 4, 2, 1, 2, true>},
    {"5 (async 256x128 8x16 3st)", 5, PREC_FP32, false, true, false, matmul_v5_async<256, 128, 8, 2, 4, 1, 3, false>},
    {"5 (async 256x128 8x16 4st)", 5, PREC_FP32, true, true, false, matmul_v5_async<256, 128, 8, 2, 4, 1, 4, true>},
    {"5 (async 256x128x16 16x8 3st)", 5, PREC_FP32, true, true, false, matmul_v5_async<256, 128, 16, 4, 2, 1, 3, true>},
    {"5 (async 256x128x16 8x16 2st)", 5, PREC_FP32, true, true, false, matmul_v5_async<256, 128, 16, 2, 4, 1, 2, true>},
    {"5 (async 256x128x16 8x16 4st)", 5, PREC_FP32, true, true, false, matmul_v5_async<256, 128, 16, 2, 4, 1, 4, true>},
    {"5 (async 256x128x32 8x16 2st)", 5, PREC_FP32, true, true, false, matmul_v5_async<256, 128, 32, 2, 4, 1, 2, true>},
    {"5 (async 128x256x16 16x8 3st)", 5, PREC_FP32, true, true, false, matmul_v5_async<128, 256, 16, 4, 2, 1, 3, true>},
    {"5 (async 128x256 16x8 3st)", 5, PREC_FP32, true, true, false, matmul_v5_async<128, 256, 8, 4, 2, 1, 3, true>},
    {"5 (async 128x128 8x8 2blk 4st)", 5, PREC_FP32, true, true, false, matmul_v5_async<128, 128, 8, 2, 2, 2, 4, true>},
    {"6 tf32 mma", 6, PREC_TF32_RN, false, false, false, matmul_sgemm_tf32_v6},
    {"6 (perm lds64)", 6, PREC_TF32_RN, false, true, false, matmul_v6_perm},
    {"6 (128x256x32)", 6, PREC_TF32_RN, true, true, false, matmul_v6_128x256x32},
    {"6 (cvt.rna)", 6, PREC_TF32_RN, true, true, false, matmul_v6_cvt_rna},
    {"6 (trunc)", 6, PREC_TF32_ANY, true, true, false, matmul_v6_trunc},
    {"7 wgmma+TMA", 7, PREC_TF32_RN, false, false, true, matmul_sgemm_tf32_v7},
    {"7 (128x128 6 stages)", 7, PREC_TF32_RN, false, true, true, matmul_v7_128x128},
    {"7 (ss trunc A)", 7, PREC_TF32_ANY, false, true, true, matmul_v7_ss_trunc},
    {"7 (ss trunc A, 1 in flight)", 7, PREC_TF32_ANY, false, true, true, matmul_v7_ss_trunc_pipe1},
    {"7 (persistent)", 7, PREC_TF32_RN, false, true, true, matmul_v7_persistent},
    {"7 (ss, 1 in flight, persistent)", 7, PREC_TF32_ANY, false, true, true, matmul_v7_ss_pipe1_persistent},
    {"8 bf16 wgmma+TMA", 8, PREC_BF16, false, false, true, nullptr, matmul_bf16_v8},
    {"8 (128x256 persistent)", 8, PREC_BF16, false, true, true, nullptr, matmul_v8_256_persistent},
    {"8 (128x256 block per tile)", 8, PREC_BF16, false, true, true, nullptr, matmul_v8_256_per_tile},
    {"8 (128x128 6 stages)", 8, PREC_BF16, false, true, true, nullptr, matmul_v8_128_persistent},
    {"8 (128x64 8 stages)", 8, PREC_BF16, false, true, true, nullptr, matmul_v8_64_persistent},
    {"8 (CUDA-core fallback)", 8, PREC_BF16, false, true, false, nullptr, matmul_bf16_fallback},
};
static const int N_VARIANTS = (int)(sizeof(VARIANTS) / sizeof(VARIANTS[0]));
static const int MAX_VERSION = 8;

// precision classes: fp32, TF32 (either rounding), bf16; each has its cuBLAS baseline
static int prec_class(Precision p) { return p == PREC_FP32 ? 0 : p == PREC_BF16 ? 2 : 1; }
static const char* prec_name(Precision p) { return p == PREC_FP32 ? "fp32" : p == PREC_BF16 ? "bf16" : "tf32"; }
static int baseline_index(Precision p) {
    for (int v = 0; v < N_VARIANTS; v++)
        if (VARIANTS[v].version == 0 && prec_class(VARIANTS[v].prec) == prec_class(p)) return v;
    fprintf(stderr, "internal error: no cuBLAS baseline for precision %s\n", prec_name(p));
    exit(EXIT_FAILURE);
}

// ----------------------------------------------------------------------------------------------------------------
// test mode

struct Counters {
    int passed = 0, failed = 0, skipped = 0;
};
static void report(Counters& cnt, bool ok, const char* name, const char* detail) {
    printf("%s %s: %s\n", ok ? "PASS" : "FAIL", name, detail);
    if (ok) cnt.passed++; else cnt.failed++;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint64_t rng_next() {  // splitmix64
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static float rng_uniform() { return (float)((rng_next() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }  // [-1, 1)
static float rng_int(int lo, int hi) { return (float)(lo + (int)(rng_next() % (uint64_t)(hi - lo + 1))); }

static float round_tf32_rna(float x) {  // what cvt.rna.tf32.f32 does: keep 10 mantissa bits, ties away from zero
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x1000u) & ~0x1FFFu;
    memcpy(&x, &u, 4);
    return x;
}

// fp32 -> bf16 (round to nearest even) -> fp32: the value a bf16 operand holds
static float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

static const char* trans_name(bool ta, bool tb) { return ta ? (tb ? "TT" : "TN") : (tb ? "NT" : "NN"); }

// CPU-only checks: the oracle itself, and that the tolerances accept correct fp32 / TF32 arithmetic and reject a
// missing term. Run everywhere (CI has no GPU).
static void cpu_oracle_tests(Counters& cnt) {
    char name[128], detail[256];
    // 1. exact: small-integer inputs make every product and partial sum exact in double (and in int64)
    const int sizes[][3] = {{33, 7, 65}, {1, 1, 1}, {5, 17, 300}};
    for (auto& sz : sizes)
        for (int tr = 0; tr < 4; tr++)
            for (int ab = 0; ab < 2; ab++) {
                bool ta = tr & 2, tb = tr & 1;
                int M = sz[0], N = sz[1], K = sz[2];
                float alpha = ab ? 2.0f : 1.0f, beta = ab ? -3.0f : 0.0f;
                int lda = (ta ? M : K) + 1, ldb = (tb ? K : N) + 2, ldc = N + 3;  // padded leading dimensions
                std::vector<float> A((size_t)(ta ? K : M) * lda), B((size_t)(tb ? N : K) * ldb), C0((size_t)M * ldc);
                for (auto& x : A) x = rng_int(-8, 8);
                for (auto& x : B) x = rng_int(-8, 8);
                for (auto& x : C0) x = beta != 0.0f ? rng_int(-8, 8) : NAN;  // beta = 0 must not read C
                std::vector<double> ref((size_t)M * N), cabs((size_t)M * N);
                matmul_cpu_oracle(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C0.data(), ldc,
                                  ref.data(), cabs.data());
                long long bad = -1, nbad = 0;
                for (int m = 0; m < M; m++)
                    for (int n = 0; n < N; n++) {
                        long long s = 0, sa = 0;
                        for (int k = 0; k < K; k++) {
                            long long a = (long long)(ta ? A[(size_t)k * lda + m] : A[(size_t)m * lda + k]);
                            long long b = (long long)(tb ? B[(size_t)n * ldb + k] : B[(size_t)k * ldb + n]);
                            s += a * b;
                            sa += std::llabs(a * b);
                        }
                        long long c = beta != 0.0f ? (long long)C0[(size_t)m * ldc + n] : 0;
                        long long want = (long long)alpha * s + (long long)beta * c;
                        long long want_abs = std::llabs((long long)alpha) * sa + std::llabs((long long)beta * c);
                        size_t i = (size_t)m * N + n;
                        if (ref[i] != (double)want || cabs[i] != (double)want_abs) { nbad++; if (bad < 0) bad = (long long)i; }
                    }
                snprintf(name, sizeof(name), "cpu oracle exact %s %dx%dx%d alpha=%g beta=%g", trans_name(ta, tb), M, N,
                         K, alpha, beta);
                if (nbad == 0) snprintf(detail, sizeof(detail), "matches int64 arithmetic exactly, %d elements", M * N);
                else snprintf(detail, sizeof(detail), "%lld elements differ from int64 arithmetic, first at (%lld, %lld)",
                              nbad, bad / N, bad % N);
                report(cnt, nbad == 0, name, detail);
            }

    // 2. the tolerances accept a correct sequential fp32 GEMM and an emulated TF32 (cvt.rna) one, and reject a
    //    product with one k term missing
    const int tsizes[][3] = {{97, 105, 1025}, {33, 7, 65}, {40, 30, 9}};
    for (auto& sz : tsizes) {
        int M = sz[0], N = sz[1], K = sz[2];
        bool ta = (K % 2) == 1, tb = false;
        int lda = ta ? M : K, ldb = N;
        std::vector<float> A((size_t)(ta ? K : M) * lda), B((size_t)K * ldb), C0(1);
        for (auto& x : A) x = rng_uniform();
        for (auto& x : B) x = rng_uniform();
        std::vector<double> ref((size_t)M * N), cabs((size_t)M * N);
        matmul_cpu_oracle(ta, tb, M, N, K, 1.0f, A.data(), lda, B.data(), ldb, 0.0f, C0.data(), N, ref.data(),
                          cabs.data());
        std::vector<float> c32((size_t)M * N), ctf((size_t)M * N), cmiss((size_t)M * N);
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                float s = 0.0f, st = 0.0f;
                double sm = 0.0;
                for (int k = 0; k < K; k++) {
                    float a = ta ? A[(size_t)k * lda + m] : A[(size_t)m * lda + k];
                    float b = B[(size_t)k * ldb + n];
                    s = fmaf(a, b, s);
                    st = fmaf(round_tf32_rna(a), round_tf32_rna(b), st);
                    if (k != K / 2) sm += (double)a * b;
                }
                c32[(size_t)m * N + n] = s;
                ctf[(size_t)m * N + n] = st;
                cmiss[(size_t)m * N + n] = (float)sm;
            }
        CheckResult r32 = check_result(c32.data(), N, ref.data(), cabs.data(), M, N, tolerance_rtol(PREC_FP32, K));
        CheckResult rtf = check_result(ctf.data(), N, ref.data(), cabs.data(), M, N, tolerance_rtol(PREC_TF32_RN, K));
        CheckResult rm32 = check_result(cmiss.data(), N, ref.data(), cabs.data(), M, N, tolerance_rtol(PREC_FP32, K));
        CheckResult rmtf = check_result(cmiss.data(), N, ref.data(), cabs.data(), M, N,
                                        tolerance_rtol(PREC_TF32_RN, K));
        snprintf(name, sizeof(name), "cpu tolerance fp32 accepts sequential fp32 %dx%dx%d", M, N, K);
        snprintf(detail, sizeof(detail), "max err %.3g, worst err/tol %.3f", r32.max_err, r32.worst_ratio);
        report(cnt, r32.ok, name, detail);
        snprintf(name, sizeof(name), "cpu tolerance tf32 accepts emulated TF32 %dx%dx%d", M, N, K);
        snprintf(detail, sizeof(detail), "max err %.3g, worst err/tol %.3f", rtf.max_err, rtf.worst_ratio);
        report(cnt, rtf.ok, name, detail);
        snprintf(name, sizeof(name), "cpu tolerance fp32 rejects a missing k term %dx%dx%d", M, N, K);
        snprintf(detail, sizeof(detail), "worst err/tol %.1f", rm32.worst_ratio);
        report(cnt, !rm32.ok, name, detail);
        if (K <= 65) {  // at K ~ 1000 one missing term is within TF32 rounding; small K catches it
            snprintf(name, sizeof(name), "cpu tolerance tf32 rejects a missing k term %dx%dx%d", M, N, K);
            snprintf(detail, sizeof(detail), "worst err/tol %.1f", rmtf.worst_ratio);
            report(cnt, !rmtf.ok, name, detail);
        }
    }

    // 3. bf16: on operands rounded to bf16, the tolerance accepts fp32 accumulation of the (exact) products with
    //    round-to-nearest adds and with truncating adds, and rejects a sum with one k term missing and one of the
    //    unrounded fp32 operands' products (small K: at K ~ 1000 the accumulation bound covers either)
    for (auto& sz : tsizes) {
        int M = sz[0], N = sz[1], K = sz[2];
        std::vector<float> A((size_t)M * K), B((size_t)K * N), A32(A.size()), B32(B.size()), C0(1);
        for (size_t i = 0; i < A.size(); i++) { A32[i] = rng_uniform(); A[i] = round_bf16(A32[i]); }
        for (size_t i = 0; i < B.size(); i++) { B32[i] = rng_uniform(); B[i] = round_bf16(B32[i]); }
        std::vector<double> ref((size_t)M * N), cabs((size_t)M * N);
        matmul_cpu_oracle(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C0.data(), N, ref.data(),
                          cabs.data());
        std::vector<float> crn((size_t)M * N), crz((size_t)M * N), cmiss((size_t)M * N), c32((size_t)M * N);
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                float s = 0.0f;
                double sm = 0.0, s32 = 0.0;
                for (int k = 0; k < K; k++) {
                    s += A[(size_t)m * K + k] * B[(size_t)k * N + n];  // the product of two bf16 is exact in fp32
                    if (k != K / 2) sm += (double)A[(size_t)m * K + k] * B[(size_t)k * N + n];
                    s32 += (double)A32[(size_t)m * K + k] * B32[(size_t)k * N + n];
                }
                crn[(size_t)m * N + n] = s;
                cmiss[(size_t)m * N + n] = (float)sm;
                c32[(size_t)m * N + n] = (float)s32;
            }
        const int mode = fegetround();
        fesetround(FE_TOWARDZERO);  // volatile: every add is done at run time, in this rounding mode
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                volatile float s = 0.0f;
                for (int k = 0; k < K; k++) s = s + A[(size_t)m * K + k] * B[(size_t)k * N + n];
                crz[(size_t)m * N + n] = s;
            }
        fesetround(mode);
        long long differ = 0;  // truncation must have changed some sums, or the emulation did not happen
        for (size_t i = 0; i < crn.size(); i++) differ += crn[i] != crz[i];
        const double rtol = tolerance_rtol(PREC_BF16, K);
        CheckResult rrn = check_result(crn.data(), N, ref.data(), cabs.data(), M, N, rtol);
        CheckResult rrz = check_result(crz.data(), N, ref.data(), cabs.data(), M, N, rtol);
        CheckResult rmiss = check_result(cmiss.data(), N, ref.data(), cabs.data(), M, N, rtol);
        CheckResult r32 = check_result(c32.data(), N, ref.data(), cabs.data(), M, N, rtol);
        snprintf(name, sizeof(name), "cpu tolerance bf16 accepts fp32 accumulation, nearest %dx%dx%d", M, N, K);
        snprintf(detail, sizeof(detail), "max err %.3g, worst err/tol %.3f", rrn.max_err, rrn.worst_ratio);
        report(cnt, rrn.ok, name, detail);
        snprintf(name, sizeof(name), "cpu tolerance bf16 accepts fp32 accumulation, truncating %dx%dx%d", M, N, K);
        snprintf(detail, sizeof(detail), "max err %.3g, worst err/tol %.3f, %lld of %d sums differ from nearest",
                 rrz.max_err, rrz.worst_ratio, differ, M * N);
        report(cnt, rrz.ok && differ > 0, name, detail);
        snprintf(name, sizeof(name), "cpu tolerance bf16 rejects a missing k term %dx%dx%d", M, N, K);
        snprintf(detail, sizeof(detail), "worst err/tol %.1f", rmiss.worst_ratio);
        report(cnt, !rmiss.ok, name, detail);
        if (K <= 65) {
            snprintf(name, sizeof(name), "cpu tolerance bf16 rejects the unrounded operands' product %dx%dx%d", M, N,
                     K);
            snprintf(detail, sizeof(detail), "worst err/tol %.1f", r32.worst_ratio);
            report(cnt, !r32.ok, name, detail);
        }
    }
}

static int gpu_count() {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {  // no driver / no device: a CPU-only machine
        cudaGetLastError();
        return 0;
    }
    return n;
}

struct TestCase {
    int M, N, K;
    int pad;         // extra leading-dimension elements (0: tight); pad % 4 != 0 forces the scalar paths
    int a_offset;    // A starts this many floats into its allocation (1: misaligned, no 16-byte loads)
    float alpha, beta;
};

static void gpu_tests(Counters& cnt, int only_version) {
    // awkward sizes (M x N x K), the MNIST layer shapes at small batch, and shapes that pick each tile config and
    // split-K (N <= 32 -> 128x32; >= #SMs tiles of 128x128 -> 128x128; else 64x64; few tiles + long K -> split-K)
    std::vector<TestCase> cases = {
        {97, 1025, 257, 0, 0, 1.0f, 0.0f},   {1, 1, 1, 0, 0, 1.0f, 0.0f},     {33, 7, 65, 0, 0, 1.0f, 0.0f},
        {128, 96, 80, 0, 0, 1.0f, 0.0f},     {2 * 676, 32, 9, 0, 0, 1.0f, 0.0f}, {32, 9, 2 * 676, 0, 0, 1.0f, 0.0f},
        {64, 128, 9216, 0, 0, 1.0f, 0.0f},   {64, 10, 128, 0, 0, 1.0f, 0.0f}, {288, 64, 4000, 0, 0, 1.0f, 0.0f},
        {1537, 1550, 67, 0, 0, 1.0f, 0.0f},  {5, 300, 1000, 0, 0, 1.0f, 0.0f},
        {65, 70, 33, 3, 1, 1.0f, 0.0f},      {200, 20, 700, 5, 1, 1.0f, 0.0f}, // unaligned: scalar paths
        {77, 45, 100, 4, 0, 0.5f, -1.5f},    {64, 128, 3000, 0, 0, 1.0f, 1.0f}, // beta != 0 (accumulate), split-K
        {17000, 50, 40, 0, 0, 1.0f, 0.0f},   // v5 128x64 tiles
        {260, 260, 4100, 0, 0, 1.0f, 0.0f},  // v5 64x64 8x8-per-thread tiles with split-K
        {20, 30, 3000, 0, 0, 2.0f, 0.5f},    // v5 32x32 tiles, split-K, alpha and beta
        {2100, 3800, 20, 0, 0, 1.0f, 0.0f},  // v5 256x128 tiles (>= 2 waves of them)
        {700, 1500, 650, 0, 0, 1.0f, 0.0f},  // v8 128x64: persistent blocks with 2 tiles, the ring wraps across them
    };
    int n_sms = matmul_num_sms();
    char name[160], detail[256];
    const bool have_sm90a = matmul_have_sm90a();
    for (int v = 0; v < N_VARIANTS; v++)
        if (VARIANTS[v].sm90a && !have_sm90a && (only_version < 0 || VARIANTS[v].version == only_version)) {
            printf("SKIP v%s: needs an sm_90a build on a compute capability 9.0 GPU (wgmma)\n", VARIANTS[v].name);
            cnt.skipped++;
        }
    for (const TestCase& tc : cases)
        for (int tr = 0; tr < 4; tr++) {
            bool ta = tr & 2, tb = tr & 1;
            int M = tc.M, N = tc.N, K = tc.K;
            int lda = (ta ? M : K) + tc.pad, ldb = (tb ? K : N) + tc.pad, ldc = N + tc.pad;
            size_t a_elems = (size_t)(ta ? K : M) * lda + tc.a_offset, b_elems = (size_t)(tb ? N : K) * ldb;
            size_t c_elems = (size_t)M * ldc;
            std::vector<float> hA(a_elems), hB(b_elems), hC0(c_elems), hC(c_elems);
            for (auto& x : hA) x = rng_uniform();  // fresh inputs for every case
            for (auto& x : hB) x = rng_uniform();
            for (auto& x : hC0) x = rng_uniform();
            std::vector<double> ref((size_t)M * N), cabs((size_t)M * N);
            matmul_cpu_oracle(ta, tb, M, N, K, tc.alpha, hA.data() + tc.a_offset, lda, hB.data(), ldb, tc.beta,
                              hC0.data(), ldc, ref.data(), cabs.data());
            float *dA, *dB, *dC;
            cudaCheck(cudaMalloc(&dA, a_elems * sizeof(float)));
            cudaCheck(cudaMalloc(&dB, b_elems * sizeof(float)));
            cudaCheck(cudaMalloc(&dC, c_elems * sizeof(float)));
            cudaCheck(cudaMemcpy(dA, hA.data(), a_elems * sizeof(float), cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(dB, hB.data(), b_elems * sizeof(float), cudaMemcpyHostToDevice));
            // bf16 operands (cuBLAS bf16, version 8): fresh draws rounded to bf16, and the oracle on those exact
            // values. Leading dimensions are padded to a multiple of 8 elements (TMA reads 16-byte rows) unless the
            // case is about misalignment (pad % 4 != 0, a_offset): then they stay odd, A starts 2 bytes in, and
            // version 8 takes its fallback. M, N, K keep their awkward values either way.
            bool any_bf16 = false;
            for (int v = 0; v < N_VARIANTS; v++)
                any_bf16 |= VARIANTS[v].prec == PREC_BF16 && (only_version < 0 || VARIANTS[v].version == only_version);
            const bool misaligned = tc.pad % 4 != 0 || tc.a_offset != 0;
            auto ld16 = [&](int tight) { return misaligned ? tight + tc.pad : (tight + 7) / 8 * 8 + 2 * tc.pad; };
            const int lda16 = ld16(ta ? M : K), ldb16 = ld16(tb ? K : N);
            const size_t a16_elems = (size_t)(ta ? K : M) * lda16 + tc.a_offset;
            const size_t b16_elems = (size_t)(tb ? N : K) * ldb16;
            std::vector<double> ref16, cabs16;
            __nv_bfloat16 *dA16 = nullptr, *dB16 = nullptr;
            if (any_bf16) {
                std::vector<__nv_bfloat16> hA16(a16_elems), hB16(b16_elems);
                std::vector<float> hAr(a16_elems), hBr(b16_elems);
                for (size_t i = 0; i < a16_elems; i++) {
                    hA16[i] = __float2bfloat16_rn(rng_uniform());
                    hAr[i] = __bfloat162float(hA16[i]);
                }
                for (size_t i = 0; i < b16_elems; i++) {
                    hB16[i] = __float2bfloat16_rn(rng_uniform());
                    hBr[i] = __bfloat162float(hB16[i]);
                }
                ref16.resize((size_t)M * N);
                cabs16.resize((size_t)M * N);
                matmul_cpu_oracle(ta, tb, M, N, K, tc.alpha, hAr.data() + tc.a_offset, lda16, hBr.data(), ldb16,
                                  tc.beta, hC0.data(), ldc, ref16.data(), cabs16.data());
                cudaCheck(cudaMalloc(&dA16, a16_elems * sizeof(__nv_bfloat16)));
                cudaCheck(cudaMalloc(&dB16, b16_elems * sizeof(__nv_bfloat16)));
                cudaCheck(cudaMemcpy(dA16, hA16.data(), a16_elems * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
                cudaCheck(cudaMemcpy(dB16, hB16.data(), b16_elems * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
            }
            for (int v = 0; v < N_VARIANTS; v++) {
                const Variant& var = VARIANTS[v];
                if (var.nn_only && (ta || tb)) continue;  // benchmark tile variants exist for NN only
                if (only_version >= 0 && var.version != only_version) continue;
                if (var.sm90a && !have_sm90a) continue;
                const bool bf16 = var.prec == PREC_BF16;
                snprintf(name, sizeof(name), "v%s %s %dx%dx%d pad=%d a_off=%d alpha=%g beta=%g", var.name,
                         trans_name(ta, tb), M, N, K, tc.pad, tc.a_offset, tc.alpha, tc.beta);
                if (bf16) {
                    const size_t n = strlen(name);
                    snprintf(name + n, sizeof(name) - n, " lda=%d ldb=%d", lda16, ldb16);
                }
                if (tc.beta == 0.0f) {
                    // poison: an element the kernel does not write stays NaN and fails
                    cudaCheck(cudaMemset(dC, 0xFF, c_elems * sizeof(float)));
                } else {
                    cudaCheck(cudaMemcpy(dC, hC0.data(), c_elems * sizeof(float), cudaMemcpyHostToDevice));
                }
                if (bf16)
                    var.fn_bf16(ta, tb, M, N, K, tc.alpha, dA16 + tc.a_offset, lda16, dB16, ldb16, tc.beta, dC, ldc, 0);
                else
                    var.fn(ta, tb, M, N, K, tc.alpha, dA + tc.a_offset, lda, dB, ldb, tc.beta, dC, ldc, 0);
                cudaCheck(cudaDeviceSynchronize());
                cudaCheck(cudaMemcpy(hC.data(), dC, c_elems * sizeof(float), cudaMemcpyDeviceToHost));
                CheckResult r = check_result(hC.data(), ldc, bf16 ? ref16.data() : ref.data(),
                                             bf16 ? cabs16.data() : cabs.data(), M, N, tolerance_rtol(var.prec, K));
                long long wi = r.worst_index;
                if (r.nan_count > 0)
                    snprintf(detail, sizeof(detail), "%d NaN/unwritten elements, first at (%lld, %lld)", r.nan_count,
                             wi / N, wi % N);
                else
                    snprintf(detail, sizeof(detail), "max err %.3g, worst err/tol %.3f at (%lld, %lld)", r.max_err,
                             r.worst_ratio, wi < 0 ? 0 : wi / N, wi < 0 ? 0 : wi % N);
                report(cnt, r.ok, name, detail);
            }
            cudaCheck(cudaFree(dA));
            cudaCheck(cudaFree(dB));
            cudaCheck(cudaFree(dC));
            if (dA16) cudaCheck(cudaFree(dA16));
            if (dB16) cudaCheck(cudaFree(dB16));
        }
    (void)n_sms;
}

static int run_tests(int only_version) {
    Counters cnt;
    cpu_oracle_tests(cnt);
    if (gpu_count() == 0) {
        for (int v = 0; v < N_VARIANTS; v++) {
            printf("SKIP v%s: no CUDA device\n", VARIANTS[v].name);
            cnt.skipped++;
        }
    } else {
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        if (prop.major < 8) {
            printf("SKIP gpu tests: %s is sm_%d%d, this file needs sm_80 or newer (cp.async, TF32 mma)\n",
                   prop.name, prop.major, prop.minor);
            cnt.skipped++;
        } else {
            gpu_tests(cnt, only_version);
        }
    }
    matmul_free_workspace();
    matmul_free_stage_bufs();
    printf("%d passed, %d failed, %d skipped\n", cnt.passed, cnt.failed, cnt.skipped);
    return cnt.failed > 0 ? 1 : 0;
}

// ----------------------------------------------------------------------------------------------------------------
// benchmark mode

__global__ void fill_uniform_kernel(float* x, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ (seed * 0x9E3779B9u) ^ (uint32_t)(i >> 32) * 0x85EBCA6Bu;
        h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
        x[i] = (float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
}
// y = x rounded to bf16 (nearest even), and r = that value in fp32
__global__ void round_bf16_kernel(const float* x, __nv_bfloat16* y, float* r, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        y[i] = __float2bfloat16_rn(x[i]);
        r[i] = __bfloat162float(y[i]);
    }
}
__global__ void abs_kernel(const float* x, float* y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = fabsf(x[i]);
}

struct BenchShape {
    std::string name;
    bool ta, tb;
    int M, N, K;
};

// MNIST CNN (conv 1->32 3x3, conv 32->64 3x3, pool, fc 9216->128, fc 128->10) at batch Bt, convolutions as im2col
// GEMMs with PyTorch weight layouts (W (out, in)): forward Y = X W^T (NT), dX = dY W (NN), dW = dY^T X (TN).
static std::vector<BenchShape> mnist_shapes(int Bt) {
    std::string b = "B" + std::to_string(Bt) + " ";
    return {
        {b + "conv1 fwd", false, true, Bt * 676, 32, 9},
        {b + "conv1 dW", true, false, 32, 9, Bt * 676},
        {b + "conv2 fwd", false, true, Bt * 576, 64, 288},
        {b + "conv2 dX", false, false, Bt * 576, 288, 64},
        {b + "conv2 dW", true, false, 64, 288, Bt * 576},
        {b + "fc1 fwd", false, true, Bt, 128, 9216},
        {b + "fc1 dX", false, false, Bt, 9216, 128},
        {b + "fc1 dW", true, false, 128, 9216, Bt},
        {b + "fc2 fwd", false, true, Bt, 10, 128},
        {b + "fc2 dX", false, false, Bt, 128, 10},
        {b + "fc2 dW", true, false, 10, 128, Bt},
    };
}

struct BenchRow {
    std::string shape, variant, precision;
    bool ta, tb;
    int M, N, K, version;
    double ms, gflops, pct;
    bool valid;
    double worst_ratio;
};

// a benchmark shape's operands: fp32, and the same values rounded to bf16 (for the bf16 variants); tight leading
// dimensions
struct BenchOperands {
    const float* A;
    const float* B;
    const __nv_bfloat16* A16;
    const __nv_bfloat16* B16;
    int lda, ldb;
};
static void call_variant(const Variant& var, const BenchShape& s, const BenchOperands& o, float* C, int ldc) {
    if (var.fn_bf16) var.fn_bf16(s.ta, s.tb, s.M, s.N, s.K, 1.0f, o.A16, o.lda, o.B16, o.ldb, 0.0f, C, ldc, 0);
    else var.fn(s.ta, s.tb, s.M, s.N, s.K, 1.0f, o.A, o.lda, o.B, o.ldb, 0.0f, C, ldc, 0);
}

// median over 11 timed batches; a batch repeats the call enough times to last >= ~0.5 ms (small shapes)
static double time_ms(const Variant& var, const BenchShape& s, const BenchOperands& o, float* C, int ldc) {
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    auto call = [&]() { call_variant(var, s, o, C, ldc); };
    call();  // warm-up (also allocates the split-K workspace, sets smem attributes)
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaEventRecord(e0));
    call();
    cudaCheck(cudaEventRecord(e1));
    cudaCheck(cudaEventSynchronize(e1));
    float est;
    cudaCheck(cudaEventElapsedTime(&est, e0, e1));
    int reps = (int)std::min(200.0, std::max(1.0, ceil(0.5 / std::max(est, 1e-4f))));
    std::vector<double> t;
    for (int r = 0; r < 11; r++) {
        cudaCheck(cudaEventRecord(e0));
        for (int i = 0; i < reps; i++) call();
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms / reps);
    }
    std::sort(t.begin(), t.end());
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    return t[t.size() / 2];
}

static int run_benchmark(int only_version, const char* out_dir, bool square_only, int repeat) {
    if (gpu_count() == 0) {
        printf("no CUDA device: the benchmark needs a GPU (./dev/matmul --test runs the CPU checks)\n");
        return 0;
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    const bool have_sm90a = matmul_have_sm90a();
    printf("sm_90a code (wgmma, versions 7 and 8): %s\n",
           have_sm90a ? "yes" : "no: versions 7 and 8 skipped (build for sm_90a)");
    bool any_bf16 = false;  // bf16 operand copies are made only when a bf16 variant runs
    for (int v = 0; v < N_VARIANTS; v++)
        any_bf16 |= VARIANTS[v].prec == PREC_BF16 && (only_version < 0 || VARIANTS[v].version == only_version ||
                                                       VARIANTS[v].version == 0);
    std::vector<BenchShape> shapes = {{"square 4096", false, false, 4096, 4096, 4096}};
    if (!square_only)
        for (int Bt : {64, 512})
            for (auto& s : mnist_shapes(Bt)) shapes.push_back(s);

    std::vector<BenchRow> rows;
    int n_invalid = 0;
    printf("%-16s %-3s %-20s %-24s %10s %10s %8s %s\n", "shape", "op", "MxNxK", "version", "ms", "GFLOP/s",
           "%cuBLAS", "check (err/tol)");
    for (const BenchShape& s : shapes) {
        // A, B as stored: op(A) M x K, op(B) K x N; tight leading dimensions
        int a_rows = s.ta ? s.K : s.M, a_cols = s.ta ? s.M : s.K;
        int b_rows = s.tb ? s.N : s.K, b_cols = s.tb ? s.K : s.N;
        size_t na = (size_t)a_rows * a_cols, nb = (size_t)b_rows * b_cols, nc = (size_t)s.M * s.N;
        float *A, *B, *C, *Aabs, *Babs, *ref, *refabs;
        cudaCheck(cudaMalloc(&A, na * sizeof(float)));
        cudaCheck(cudaMalloc(&B, nb * sizeof(float)));
        cudaCheck(cudaMalloc(&Aabs, na * sizeof(float)));
        cudaCheck(cudaMalloc(&Babs, nb * sizeof(float)));
        cudaCheck(cudaMalloc(&C, nc * sizeof(float)));
        cudaCheck(cudaMalloc(&ref, nc * sizeof(float)));
        cudaCheck(cudaMalloc(&refabs, nc * sizeof(float)));
        fill_uniform_kernel<<<1024, 256>>>(A, na, 1234);
        cudaCheck(cudaGetLastError());
        fill_uniform_kernel<<<1024, 256>>>(B, nb, 5678);
        cudaCheck(cudaGetLastError());
        abs_kernel<<<1024, 256>>>(A, Aabs, na);
        cudaCheck(cudaGetLastError());
        abs_kernel<<<1024, 256>>>(B, Babs, nb);
        cudaCheck(cudaGetLastError());
        // reference: cuBLAS strict fp32; scale for the tolerance: |A| |B| (the c_abs of the CPU check)
        matmul_cublas(false, s.ta, s.tb, s.M, s.N, s.K, 1.0f, A, a_cols, B, b_cols, 0.0f, ref, s.N, 0);
        matmul_cublas(false, s.ta, s.tb, s.M, s.N, s.K, 1.0f, Aabs, a_cols, Babs, b_cols, 0.0f, refabs, s.N, 0);
        cudaCheck(cudaDeviceSynchronize());
        std::vector<float> h_ref(nc), h_abs(nc), h_c(nc);
        cudaCheck(cudaMemcpy(h_ref.data(), ref, nc * sizeof(float), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(h_abs.data(), refabs, nc * sizeof(float), cudaMemcpyDeviceToHost));
        std::vector<double> d_ref(h_ref.begin(), h_ref.end()), d_abs(h_abs.begin(), h_abs.end());
        // bf16 operands: A and B rounded to bf16; their reference is cuBLAS strict fp32 on the rounded values
        __nv_bfloat16 *A16 = nullptr, *B16 = nullptr;
        std::vector<double> d_ref16, d_abs16;
        if (any_bf16) {
            cudaCheck(cudaMalloc(&A16, na * sizeof(__nv_bfloat16)));
            cudaCheck(cudaMalloc(&B16, nb * sizeof(__nv_bfloat16)));
            round_bf16_kernel<<<1024, 256>>>(A, A16, Aabs, na);  // Aabs, Babs, ref, refabs are reused
            cudaCheck(cudaGetLastError());
            round_bf16_kernel<<<1024, 256>>>(B, B16, Babs, nb);
            cudaCheck(cudaGetLastError());
            matmul_cublas(false, s.ta, s.tb, s.M, s.N, s.K, 1.0f, Aabs, a_cols, Babs, b_cols, 0.0f, ref, s.N, 0);
            abs_kernel<<<1024, 256>>>(Aabs, Aabs, na);
            cudaCheck(cudaGetLastError());
            abs_kernel<<<1024, 256>>>(Babs, Babs, nb);
            cudaCheck(cudaGetLastError());
            matmul_cublas(false, s.ta, s.tb, s.M, s.N, s.K, 1.0f, Aabs, a_cols, Babs, b_cols, 0.0f, refabs, s.N, 0);
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaMemcpy(h_ref.data(), ref, nc * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(h_abs.data(), refabs, nc * sizeof(float), cudaMemcpyDeviceToHost));
            d_ref16.assign(h_ref.begin(), h_ref.end());
            d_abs16.assign(h_abs.begin(), h_abs.end());
        }
        const BenchOperands ops = {A, B, A16, B16, a_cols, b_cols};
        // 1. validate every selected variant once: poisoned C, compared with the cuBLAS fp32 result (whose own
        //    error adds an fp32 bound)
        std::vector<int> timed;       // VARIANTS index of each validated variant
        std::vector<size_t> row_of;   // its row in rows
        for (int v = 0; v < N_VARIANTS; v++) {
            const Variant& var = VARIANTS[v];
            if (var.nn_only && (s.ta || s.tb)) continue;
            if (var.square_only && s.M < 4096) continue;  // tile variants: for the 4096^3 configuration choice
            if (only_version >= 0 && var.version != only_version && var.version != 0) continue;
            if (var.sm90a && !have_sm90a) continue;  // said once at the start
            cudaCheck(cudaMemset(C, 0xFF, nc * sizeof(float)));
            call_variant(var, s, ops, C, s.N);
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaMemcpy(h_c.data(), C, nc * sizeof(float), cudaMemcpyDeviceToHost));
            double rtol = tolerance_rtol(var.prec, s.K) + tolerance_rtol(PREC_FP32, s.K);
            const bool bf16 = var.prec == PREC_BF16;
            CheckResult chk = check_result(h_c.data(), s.N, bf16 ? d_ref16.data() : d_ref.data(),
                                           bf16 ? d_abs16.data() : d_abs.data(), s.M, s.N, rtol);
            BenchRow row;
            row.shape = s.name; row.variant = var.name; row.ta = s.ta; row.tb = s.tb;
            row.M = s.M; row.N = s.N; row.K = s.K; row.version = var.version;
            row.precision = prec_name(var.prec);
            row.valid = chk.ok; row.worst_ratio = chk.ok ? chk.worst_ratio : NAN;
            row.ms = NAN; row.gflops = NAN; row.pct = NAN;
            if (!chk.ok) {
                n_invalid++;
                printf("%-16s %-3s %6dx%6dx%6d %-24s FAIL validation: %d NaN, worst err/tol %.3g at %lld\n",
                       s.name.c_str(), trans_name(s.ta, s.tb), s.M, s.N, s.K, var.name, chk.nan_count,
                       chk.worst_ratio, chk.worst_index);
            } else {
                timed.push_back(v);
                row_of.push_back(rows.size());
            }
            rows.push_back(row);
        }
        // 2. time them, `repeat` rounds over the list. Each variant other than a baseline is timed right after its
        //    baseline (cuBLAS of the same precision: fp32, TF32 or bf16), so that the pair sees the same clocks and
        //    temperature; "% of cuBLAS" is the median over the rounds of baseline / variant time, ms the median of
        //    the variant's times.
        std::vector<std::vector<double>> t_ms(timed.size()), ratio(timed.size());
        for (int r = 0; r < repeat; r++)
            for (size_t i = 0; i < timed.size(); i++) {
                const Variant& var = VARIANTS[timed[i]];
                double base = NAN;
                if (var.version != 0) base = time_ms(VARIANTS[baseline_index(var.prec)], s, ops, C, s.N);
                double ms = time_ms(var, s, ops, C, s.N);
                t_ms[i].push_back(ms);
                ratio[i].push_back(var.version == 0 ? 1.0 : base / ms);
                if (repeat > 1)
                    printf("  round %d %-16s %-36s %9.4f ms, cuBLAS %s %9.4f ms: %6.1f%%\n", r + 1, s.name.c_str(),
                           var.name, ms, prec_name(var.prec), var.version == 0 ? ms : base,
                           100.0 * ratio[i].back());
            }
        auto median = [](std::vector<double> x) {
            std::sort(x.begin(), x.end());
            size_t n = x.size();
            return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
        };
        for (size_t i = 0; i < timed.size(); i++) {
            const Variant& var = VARIANTS[timed[i]];
            BenchRow& row = rows[row_of[i]];
            row.ms = median(t_ms[i]);
            // FLOPs: one multiply and one add per (m, n, k)
            row.gflops = 2.0 * s.M * s.N * (double)s.K / (row.ms * 1e-3) / 1e9;
            row.pct = 100.0 * median(ratio[i]);
            auto [lo, hi] = std::minmax_element(ratio[i].begin(), ratio[i].end());
            printf("%-16s %-3s %6dx%6dx%6d %-24s %10.4f %10.1f %7.1f%% %.3f", s.name.c_str(),
                   trans_name(s.ta, s.tb), s.M, s.N, s.K, var.name, row.ms, row.gflops, row.pct, row.worst_ratio);
            if (repeat > 1) printf("  (%d rounds, %.1f-%.1f%%)", repeat, 100.0 * *lo, 100.0 * *hi);
            printf("\n");
            fflush(stdout);
        }
        if (have_sm90a && s.M >= 4096 && (only_version < 0 || only_version == 7)) {
            // the part of version 7's time that is its B staging pass (a transpose for NN), timed alone
            BenchShape st = s;
            Variant pass = {"7 B staging pass alone", 7, PREC_TF32_RN, false, false, true,
                            [](bool, bool tb, int, int N, int K, float, const float*, int, const float* B, int ldb,
                               float, float*, int, cudaStream_t stream) {
                                matmul_stage_kmajor(1, B, ldb, tb, N, K, ceil_div(K, 4) * 4, stream);
                            }};
            double ms = time_ms(pass, st, ops, C, s.N);
            printf("%-16s %-3s %6dx%6dx%6d %-24s %10.4f ms (%.0f GB/s read + written)\n", s.name.c_str(),
                   trans_name(s.ta, s.tb), s.M, s.N, s.K, pass.name, ms, 2.0 * s.N * (double)s.K * 4 / (ms * 1e6));
        }
        cudaCheck(cudaFree(A)); cudaCheck(cudaFree(B)); cudaCheck(cudaFree(C));
        cudaCheck(cudaFree(Aabs)); cudaCheck(cudaFree(Babs)); cudaCheck(cudaFree(ref)); cudaCheck(cudaFree(refabs));
        if (A16) cudaCheck(cudaFree(A16));
        if (B16) cudaCheck(cudaFree(B16));
    }
    // per version: total time over each batch's MNIST shapes (one training step's GEMMs, roughly)
    for (int Bt : {64, 512}) {
        std::string prefix = "B" + std::to_string(Bt) + " ";
        printf("sum over the 11 MNIST GEMMs at batch %d:\n", Bt);
        for (int v = 0; v < N_VARIANTS; v++) {
            double total = 0.0;
            int n = 0;
            for (auto& r : rows)
                if (r.variant == VARIANTS[v].name && r.shape.rfind(prefix, 0) == 0 && r.valid) { total += r.ms; n++; }
            if (n == 11) printf("  %-24s %8.1f us\n", VARIANTS[v].name, total * 1e3);
        }
    }
    if (out_dir) {
        if (mkdir(out_dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "--out %s: cannot create the directory: %s\n", out_dir, strerror(errno));
            exit(EXIT_FAILURE);
        }
        std::string path = std::string(out_dir) + "/matmul_bench.csv";
        std::string tmp = path + ".tmp";
        FILE* f = fopenCheck(tmp.c_str(), "w");
        fprintf(f, "device,shape,op,M,N,K,version,variant,precision,ms,gflops,pct_of_cublas,valid,worst_err_over_tol\n");
        for (auto& r : rows)
            fprintf(f, "\"%s\",\"%s\",%s,%d,%d,%d,%d,\"%s\",%s,%.6f,%.2f,%.2f,%d,%.4f\n", prop.name, r.shape.c_str(),
                    trans_name(r.ta, r.tb), r.M, r.N, r.K, r.version, r.variant.c_str(), r.precision.c_str(), r.ms,
                    r.gflops, r.pct, (int)r.valid, r.worst_ratio);
        fclose(f);
        if (rename(tmp.c_str(), path.c_str()) != 0) {
            fprintf(stderr, "cannot rename %s to %s: %s\n", tmp.c_str(), path.c_str(), strerror(errno));
            exit(EXIT_FAILURE);
        }
        printf("wrote %s\n", path.c_str());
    }
    matmul_free_workspace();
    matmul_free_stage_bufs();
    if (n_invalid > 0) printf("%d version/shape pairs failed validation\n", n_invalid);
    return n_invalid > 0 ? 1 : 0;
}

// ----------------------------------------------------------------------------------------------------------------

static void usage() {
    printf("usage: ./dev/matmul [--test] [all | VERSION] [--square] [--repeat R] [--out DIR]\n"
           "  --test      check every version (or VERSION) and transpose against the CPU oracle (no benchmark)\n"
           "  all         validate and benchmark every version (default)\n"
           "  VERSION     0..%d: validate and benchmark that version (and the cuBLAS baselines; 8: bf16)\n"
           "  --square    benchmark 4096 x 4096 x 4096 only (not the MNIST shapes)\n"
           "  --repeat R  time every variant and its cuBLAS baseline (timed just before it) in R rounds (default 1);\n"
           "              report the medians\n"
           "  --out DIR   also write DIR/matmul_bench.csv (default: none)\n"
           "  --help      this text\n",
           MAX_VERSION);
}

int main(int argc, char** argv) {
    bool test = false;
    int version = -1;  // -1: all
    const char* out_dir = nullptr;
    bool square_only = false;
    int repeat = 1;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--help" || a == "-h") { usage(); return 0; }
        else if (a == "--test") test = true;
        else if (a == "--out") {
            if (i + 1 >= argc) { fprintf(stderr, "--out: missing value (expected a directory)\n"); return 1; }
            out_dir = argv[++i];
        } else if (a == "--square") square_only = true;
        else if (a == "--repeat") {
            char* end = nullptr;
            long r = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : 0;
            if (i + 1 >= argc || *end != '\0' || r < 1 || r > 100) {
                fprintf(stderr, "--repeat: expected an integer in [1, 100], found '%s'\n", i + 1 < argc ? argv[i + 1] : "");
                return 1;
            }
            repeat = (int)r;
            i++;
        } else if (a == "all") version = -1;
        else if (!a.empty() && a[0] != '-') {
            char* end;
            long v = strtol(a.c_str(), &end, 10);
            if (*end != '\0' || v < 0 || v > MAX_VERSION) {
                fprintf(stderr, "version: expected 'all' or an integer in [0, %d], found '%s'\n", MAX_VERSION,
                        a.c_str());
                return 1;
            }
            version = (int)v;
        } else {
            fprintf(stderr, "unknown flag '%s' (expected --test, --square, --repeat R, --out DIR, --help, all or a version)\n",
                    a.c_str());
            return 1;
        }
    }
    if (test) return run_tests(version);
    return run_benchmark(version, out_dir, square_only, repeat);
}
#endif  // DEV_KERNELS_ONLY
