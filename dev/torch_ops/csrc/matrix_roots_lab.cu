// dev/matrix_roots.cu for dev/torch_ops: the lab file itself (inverse roots versions 0-2, Newton-Schulz, the SYRK-like
// Kronecker statistics; without its study, tests, benchmark and main), its failed CUDA calls raised as exceptions,
// behind dev_lab::inverse_root, newton_schulz and kron_stats.
#define DEV_KERNELS_ONLY
#define CUDA_CHECK_THROWS
#include "../../matrix_roots.cu"
#include "labs.h"
#include <mutex>

namespace dev_lab {

// The lab's handles, workspaces and stream are globals: one call at a time, on the device the handles were made for
static std::mutex g_lock;
static int g_device = -1;

static void enter(cudaStream_t stream) {
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    if (g_device >= 0 && dev != g_device)
        throw std::runtime_error("dev/matrix_roots.cu keeps one set of cuBLAS/cuSOLVER handles, made for CUDA device " +
                                 std::to_string(g_device) + "; this call is on device " + std::to_string(dev) +
                                 ": use these ops on one GPU per process");
    gpu_init();
    g_device = dev;
    g_stream = stream;
    cublasCheck(cublasSetStream(g_gpu.blas, stream));
    cusolverCheck(cusolverDnSetStream(g_gpu.solver, stream));
}

// Batches above the grid's 65535 blocks run in chunks
static constexpr int MAX_BATCH = 65535;

// Version 2 and the Newton iterations converge where version 1's rule says so: ||M - I||_F at most 1e-3, or stalled
// below 0.05 (newton_decide); a failed or unconverged batch is redone by version 0, the eigendecomposition.
static constexpr float NEWTON_OK_R = 0.05f;

static void inverse_root_chunk(const float* A, float* X, int batch, int n, int p, float eps) {
    if (n <= 128) {
        // version 3 (3xTF32 tensor cores, one block per matrix), else version 2 where its shared memory is short; a
        // non-null answer from both: too little shared memory here
        const char* why_not = inv_root_v3(A, X, batch, n, p, eps, 1);
        if (why_not) why_not = inv_root_v2(A, X, batch, n, p, eps);
        if (!why_not) {
            std::vector<int> steps;
            std::vector<float> r;
            newton_status(batch, steps, r);
            bool ok = true;
            for (int b = 0; b < batch; b++) ok = ok && steps[b] >= 0 && r[b] <= NEWTON_OK_R;
            if (ok) return;
        } else {
            NewtonState s = inv_root_v1(A, X, batch, n, p, eps, PREC_FP32);
            if (!s.failed && s.converged) return;
        }
    } else {
        NewtonState s = inv_root_v1(A, X, batch, n, p, eps, PREC_3XTF32);
        if (!s.failed && s.converged) return;
    }
    int bad = inv_root_v0(A, X, batch, n, p, eps);
    if (bad)
        throw std::runtime_error("inverse_root: cuSOLVER's eigendecomposition did not converge for " +
                                 std::to_string(bad) + " of " + std::to_string(batch) + " matrices of " +
                                 std::to_string(n) + "x" + std::to_string(n) + " (after the Newton iteration failed)");
}

void inverse_root(const float* A, float* X, long long batch, int n, int p, float eps, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    enter(stream);
    const long long nn = (long long)n * n;
    for (long long b0 = 0; b0 < batch; b0 += MAX_BATCH)
        inverse_root_chunk(A + b0 * nn, X + b0 * nn, (int)std::min<long long>(MAX_BATCH, batch - b0), n, p, eps);
    g_stream = 0;
}

void newton_schulz(const float* G, float* out, long long batch, int m, int n, int steps, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    enter(stream);
    const long long mn = (long long)m * n;
    for (long long b0 = 0; b0 < batch; b0 += MAX_BATCH)
        ::newton_schulz(G + b0 * mn, out + b0 * mn, (int)std::min<long long>(MAX_BATCH, batch - b0), m, n, steps);
    g_stream = 0;
}

void kron_stats(const float* G, float* C, long long batch, int m, int n, bool left, float alpha, float beta,
                cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    enter(stream);
    const long long mn = (long long)m * n, N = left ? m : n;
    for (long long b0 = 0; b0 < batch; b0 += MAX_BATCH) {
        const int chunk = (int)std::min<long long>(MAX_BATCH, batch - b0);
        float* c = C + b0 * N * N;
        if (left) syrk_lower(RowsLoader{G + b0 * mn, mn, n}, c, chunk, m, n, alpha, beta);  // G G^T: rows of G
        else syrk_lower(ColsLoader{G + b0 * mn, mn, n}, c, chunk, n, m, alpha, beta);       // G^T G: its columns
    }
    g_stream = 0;
}

}  // namespace dev_lab
