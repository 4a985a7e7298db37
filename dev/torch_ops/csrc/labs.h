// The entry points of the lab kernels that cuda_ops.cpp calls: plain pointers, sizes and the stream to launch on,
// no PyTorch types, so that the *_lab.cu files compile the lab sources as they are (no torch headers in nvcc).
// Each call throws std::runtime_error on a failed CUDA call (the labs' checks, built with CUDA_CHECK_THROWS).
// Each takes a lock around the lab's globals (its stream, its device facts, its caches): calls from several host
// threads are safe. Inputs are validated by the caller (cuda_ops.cpp); these functions trust them.
#pragma once
#include <cstddef>
#include <cuda_runtime.h>

namespace dev_lab {

// dev/softmax_forward.cu version 14 (the autotuning dispatcher): y = softmax(x) over rows of cols floats.
// rows, cols >= 1. The first call for a (rows, cols, alignment) times the candidates on the stream and waits for
// them (host sync); later calls launch the pick.
void softmax_forward(float* y, const float* x, int rows, int cols, cudaStream_t stream);

// dev/softmax_backward.cu version 11 (the autotuning dispatcher): dx = y * (dy - <y, dy>) per row.
void softmax_backward(float* dx, const float* y, const float* dy, int rows, int cols, cudaStream_t stream);

// dev/matmul.cu: C (M x N, ldc) = op(A) op(B), row-major operands, op = T where trans_*. tf32: version 7 (TF32
// wgmma; version 6, mma.sync, where it does not apply), else version 5 (strict fp32). M, N, K >= 1.
void matmul(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
            float* C, int ldc, bool tf32, cudaStream_t stream);
// dev/matmul.cu version 8 (bf16 wgmma + TMA, sm_90a): C (fp32) = op(A) op(B) with A, B bf16 (__nv_bfloat16, passed
// as void*), fp32 accumulation. Returns false, launching nothing, where version 8's tensor-core path does not apply
// (no sm_90a code for this GPU, K = 0, an operand TMA cannot read: base not 16-byte aligned or a row stride not a
// multiple of 8 elements); the caller then takes another kernel.
bool matmul_bf16(bool trans_a, bool trans_b, int M, int N, int K, const void* A, int lda, const void* B, int ldb,
                 float* C, int ldc, cudaStream_t stream);

// train_unet.cu's GroupNorm(32 groups, eps 1e-5) over x (B, P, C) (NHWC, P pixels), with SiLU after it when silu
// (dev/groupnorm.cu version 1). gamma_beta: (2C) = weight then bias. mean, rstd: (B, 32). C % 32 == 0, C <= 1024.
// workspace: groupnorm_workspace_bytes(B, C) bytes, 256-byte aligned.
size_t groupnorm_workspace_bytes(int B, int C);
void groupnorm_forward(const float* x, const float* gamma_beta, float* y, float* mean, float* rstd, int B, int P,
                       int C, bool silu, void* workspace, cudaStream_t stream);
// dx (B, P, C), dgamma_dbeta (2C) from dy, x and the forward's mean and rstd.
void groupnorm_backward(const float* dy, const float* x, const float* gamma_beta, const float* mean,
                        const float* rstd, float* dx, float* dgamma_dbeta, int B, int P, int C, bool silu,
                        void* workspace, cudaStream_t stream);

// train_unet.cu's 3x3 convolution, padding 1, stride 1 or 2, over NHWC: x (B, H, W, cin), weights [tap][cin][cout]
// followed by the bias (cout) in w_bias (the bias at offset conv3x3_bias_offset(cin, cout)), y (B, Ho, Wo, cout).
// tf32: dev/conv2d.cu version 6 (mma.sync TF32) where the layer fits it, else version 3; strict fp32: version 4
// (cp.async pipeline) where the channels fit the tile, else version 2 (dev/conv2d.cu's numbering).
size_t conv3x3_bias_offset(int cin, int cout);
size_t conv3x3_workspace_bytes(int B, int H, int W, int cin, int cout, int stride);
void conv3x3_forward(const float* x, const float* w_bias, float* y, int B, int H, int W, int cin, int cout,
                     int stride, bool tf32, void* workspace, cudaStream_t stream);
// dx (B, H, W, cin), dw_db (the layout of w_bias: dW then dbias) from dy (B, Ho, Wo, cout). channel_sums_ok: whether
// the lab's channel reduction takes cout channels (else dbias is left to the caller).
bool conv3x3_channel_sums_ok(int cout);
void conv3x3_backward(const float* dy, const float* x, const float* w_bias, float* dx, float* dw_db, int B, int H,
                      int W, int cin, int cout, int stride, bool tf32, void* workspace, cudaStream_t stream);

// dev/matrix_roots.cu. Inverse p-th roots X = (A + eps I)^(-1/p) of a batch of symmetric positive semi-definite
// n x n matrices (p 1, 2 or 4, eps > 0): version 2 (the fused Newton kernel) for n <= 128, version 1 (coupled Newton
// on cuBLAS, 3xTF32 products) above; a batch whose Newton iteration fails or does not converge is redone by version 0
// (cuSOLVER's eigendecomposition), whose own failure throws. Synchronises the host with the stream (the iterations'
// decisions are taken on the host).
void inverse_root(const float* A, float* X, long long batch, int n, int p, float eps, cudaStream_t stream);
// Muon's quintic Newton-Schulz iteration (steps >= 0) on a batch of m x n matrices, bf16 operands, fp32 out.
void newton_schulz(const float* G, float* out, long long batch, int m, int n, int steps, cudaStream_t stream);
// C_b = beta C_b + alpha G_b G_b^T (left: m x m) or G_b^T G_b (right: n x n) for a batch of m x n G; C symmetric,
// only its lower triangle read (beta = 0: not read), both triangles written.
void kron_stats(const float* G, float* C, long long batch, int m, int n, bool left, float alpha, float beta,
                cudaStream_t stream);

}  // namespace dev_lab
