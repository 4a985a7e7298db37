// dev/matmul.cu for dev/torch_ops: the lab file itself (versions 1-8 and their launchers, without cuBLAS, the
// benchmark variants, the tests and main), its failed CUDA calls raised as exceptions, behind dev_lab::matmul and
// dev_lab::matmul_bf16.
#define DEV_KERNELS_ONLY
#define CUDA_CHECK_THROWS
#include "../../matmul.cu"
#include "labs.h"
#include <mutex>

namespace dev_lab {

// The split-K workspace and the TF32 staging buffers of the lab are globals that grow on demand: one call at a time
static std::mutex g_lock;

void matmul(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
            float* C, int ldc, bool tf32, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    if (tf32) matmul_sgemm_tf32_v7(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, stream);
    else matmul_sgemm_v5(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, stream);
}

bool matmul_bf16(bool trans_a, bool trans_b, int M, int N, int K, const void* A, int lda, const void* B, int ldb,
                 float* C, int ldc, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    // version 8's CUDA-core fallback is slower than the caller's other path (TF32 tensor cores, exact on bf16)
    if (K == 0 || !matmul_have_sm90a() || !matmul_bf16_tma_ok(A, lda) || !matmul_bf16_tma_ok(B, ldb)) return false;
    matmul_bf16_v8(trans_a, trans_b, M, N, K, 1.0f, static_cast<const __nv_bfloat16*>(A), lda,
                   static_cast<const __nv_bfloat16*>(B), ldb, 0.0f, C, ldc, stream);
    return true;
}

}  // namespace dev_lab
