// The torch_ops operator library: every op's schema and its CPU kernel (PyTorch expressions in the op's own
// dtype: float64 for gradcheck, float32 as on the GPU). The CUDA kernels are in cuda_ops.cpp (built only with a
// CUDA-enabled PyTorch); the fake kernels and the autograd formulas are registered from Python (torch_ops/__init__.py).
// Layouts are the project's: channels last (NHWC), 3x3 weights as (3, 3, Cin, Cout).
#include <torch/library.h>
#include "checks.h"

namespace torch_ops {

static const char* ON_CPU = "on the CPU";

// ---------------------------------------------------------------------------------------------------------------
// matmul: a (M, K) @ b (K, N). bf16 and fp16 are computed in fp32 and rounded once, as on the GPU.

static at::Tensor matmul_cpu(const at::Tensor& a, const at::Tensor& b, bool tf32) {
    (void)tf32;  // the CPU computes in the dtype's own precision
    check_dtype("matmul", "a", a, {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, ON_CPU);
    check_matmul(a, b);
    if (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf)
        return at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
    return at::mm(a, b);
}

// ---------------------------------------------------------------------------------------------------------------
// softmax over the last dimension, and its backward: dx = y * (dy - sum(y * dy))

static at::Tensor softmax_cpu(const at::Tensor& x) {
    check_dtype("softmax", "x", x, {at::kFloat, at::kDouble}, ON_CPU);
    check_softmax("softmax", "x", x);
    return at::_softmax(x, -1, false);
}

static at::Tensor softmax_backward_cpu(const at::Tensor& grad_y, const at::Tensor& y) {
    check_dtype("softmax_backward", "y", y, {at::kFloat, at::kDouble}, ON_CPU);
    check_softmax_backward(grad_y, y);
    return at::_softmax_backward_data(grad_y, y, -1, y.scalar_type());
}

// ---------------------------------------------------------------------------------------------------------------
// GroupNorm(32 groups, eps 1e-5) over x (B, *, C), SiLU after it when silu. mean, rstd: (B, 32).

// x as (B, P, G, C / G) and the statistics as (B, 1, G, 1)
static at::Tensor group_view(const at::Tensor& x) {
    return x.reshape({x.size(0), -1, GROUPS, x.size(-1) / GROUPS});
}
static at::Tensor stat_view(const at::Tensor& s) { return s.view({s.size(0), 1, GROUPS, 1}); }

static std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                                    const at::Tensor& bias, bool silu) {
    check_dtype("groupnorm", "x", x, {at::kFloat, at::kDouble}, ON_CPU);
    check_groupnorm("groupnorm", x, weight, bias);
    at::Tensor xg = group_view(x);
    at::Tensor mean = xg.mean({1, 3});
    at::Tensor var = (xg - stat_view(mean)).square().mean({1, 3});
    at::Tensor rstd = (var + GN_EPS).rsqrt();
    at::Tensor z = ((xg - stat_view(mean)) * stat_view(rstd)).view(x.sizes()) * weight + bias;
    at::Tensor y = silu ? z * at::sigmoid(z) : z;
    return {y.contiguous(), mean.contiguous(), rstd.contiguous()};
}

// With xhat the normalized x, z = xhat * gamma + beta and dz = dL/dz (through SiLU: dy * s * (1 + z * (1 - s)),
// s = sigmoid(z)): dgamma = sum dz * xhat, dbeta = sum dz over (B, P); per (b, group), with the means m1 of
// dz * gamma and m2 of dz * gamma * xhat, dx = rstd * (dz * gamma - m1 - xhat * m2).
static std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, bool silu) {
    check_dtype("groupnorm_backward", "x", x, {at::kFloat, at::kDouble}, ON_CPU);
    check_groupnorm_backward(grad_y, x, weight, bias, mean, rstd);
    at::Tensor xhat = ((group_view(x) - stat_view(mean)) * stat_view(rstd)).view(x.sizes());
    at::Tensor dz = grad_y;
    if (silu) {
        at::Tensor z = xhat * weight + bias, s = at::sigmoid(z);
        dz = grad_y * s * (1 + z * (1 - s));
    }
    const int64_t C = x.size(-1);
    at::Tensor dbeta = dz.reshape({-1, C}).sum(0);
    at::Tensor dgamma = (dz * xhat).reshape({-1, C}).sum(0);
    at::Tensor dzg = group_view(dz * weight), xg = group_view(xhat);
    at::Tensor m1 = dzg.mean({1, 3}, true), m2 = (dzg * xg).mean({1, 3}, true);
    at::Tensor dx = (stat_view(rstd) * (dzg - m1 - xg * m2)).view(x.sizes());
    return {dx.contiguous(), dgamma, dbeta};
}

// ---------------------------------------------------------------------------------------------------------------
// 3x3 convolution, padding 1, stride 1 or 2: x (B, H, W, Cin), weight (3, 3, Cin, Cout) -> y (B, Ho, Wo, Cout),
// through PyTorch's NCHW convolution on permuted views

static at::Tensor nchw(const at::Tensor& t) { return t.permute({0, 3, 1, 2}); }
static at::Tensor nhwc(const at::Tensor& t) { return t.permute({0, 2, 3, 1}).contiguous(); }
static at::Tensor oihw(const at::Tensor& w) { return w.permute({3, 2, 0, 1}); }

static at::Tensor conv3x3_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              int64_t stride, bool tf32) {
    (void)tf32;
    check_dtype("conv3x3", "x", x, {at::kFloat, at::kDouble}, ON_CPU);
    check_conv3x3("conv3x3", x, weight, bias, stride);
    return nhwc(at::conv2d(nchw(x), oihw(weight), bias, {stride, stride}, {1, 1}));
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3x3_backward_cpu(const at::Tensor& grad_y,
                                                                         const at::Tensor& x,
                                                                         const at::Tensor& weight, int64_t stride,
                                                                         bool tf32) {
    (void)tf32;
    check_dtype("conv3x3_backward", "x", x, {at::kFloat, at::kDouble}, ON_CPU);
    check_conv3x3_backward(grad_y, x, weight, stride);
    const int64_t cout = weight.size(3);
    auto [dx, dw, db] = at::convolution_backward(nchw(grad_y), nchw(x), oihw(weight), at::IntArrayRef{cout},
                                                 {stride, stride}, {1, 1}, {1, 1}, false, {0, 0}, 1,
                                                 {true, true, true});
    return {nhwc(dx), dw.permute({2, 3, 1, 0}).contiguous(), db};
}

// ---------------------------------------------------------------------------------------------------------------
// the second-order ops: what dev/matrix_roots.cu computes, in PyTorch expressions (the dtype's own precision)

// X = (A + eps I)^(-1/p) by the eigendecomposition, eigenvalues clamped at eps: version 0's formula. eigh reads the
// lower triangle.
static at::Tensor inverse_root_cpu(const at::Tensor& A, int64_t p, double eps) {
    check_dtype("inverse_root", "A", A, {at::kFloat, at::kDouble}, ON_CPU);
    check_inverse_root(A, p, eps);
    if (A.numel() == 0) return at::empty_like(A, at::MemoryFormat::Contiguous);
    const int64_t n = A.size(-1);
    at::Tensor shifted = A + eps * at::eye(n, A.options());
    auto [lambda, V] = at::linalg_eigh(shifted, "L");
    at::Tensor f = lambda.clamp_min(eps).pow(-1.0 / (double)p);
    return at::matmul(V * f.unsqueeze(-2), V.mT()).contiguous();
}

// Muon's quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, from X0 = G / (||G||_F + 1e-7) per matrix; a tall
// G is transposed (the smaller Gram matrix), as the lab does
static at::Tensor newton_schulz_cpu(const at::Tensor& G, int64_t steps) {
    check_dtype("newton_schulz", "G", G, {at::kFloat, at::kDouble}, ON_CPU);
    check_newton_schulz(G, steps);
    if (G.numel() == 0) return at::empty_like(G, at::MemoryFormat::Contiguous);
    const bool tall = G.size(-2) > G.size(-1);
    at::Tensor X = tall ? G.mT() : G;
    X = X / (at::linalg_vector_norm(X, 2, {-2, -1}, true) + 1e-7);
    for (int64_t k = 0; k < steps; k++) {
        at::Tensor A = at::matmul(X, X.mT());
        at::Tensor B = NS_B * A + NS_C * at::matmul(A, A);
        X = NS_A * X + at::matmul(B, X);
    }
    return (tall ? X.mT() : X).contiguous();
}

// beta C + alpha G G^T (left) or alpha G^T G (right), C symmetric: its lower triangle read and mirrored, as the
// GPU kernel reads it
static at::Tensor kron_stats_cpu(const at::Tensor& G, c10::string_view side, const c10::optional<at::Tensor>& C,
                                 double alpha, double beta) {
    check_dtype("kron_stats", "G", G, {at::kFloat, at::kDouble}, ON_CPU);
    check_kron_stats(G, side, C, alpha, beta);
    const bool left = side == "left";
    at::Tensor out = alpha * (left ? at::matmul(G, G.mT()) : at::matmul(G.mT(), G));
    if (C.has_value() && beta != 0.0) out = out + beta * (C->tril() + C->tril(-1).mT());
    return out.contiguous();
}

}  // namespace torch_ops

// Schemas. Tensors are channels last; see dev/torch_ops/README.md for the dtypes and shapes of each device.
TORCH_LIBRARY(torch_ops, m) {
    m.def("matmul(Tensor a, Tensor b, bool tf32=False) -> Tensor");
    m.def("softmax(Tensor x) -> Tensor");
    m.def("softmax_backward(Tensor grad_y, Tensor y) -> Tensor");
    m.def("groupnorm(Tensor x, Tensor weight, Tensor bias, bool silu=False) -> (Tensor, Tensor, Tensor)");
    m.def("groupnorm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd, "
          "bool silu) -> (Tensor, Tensor, Tensor)");
    m.def("conv3x3(Tensor x, Tensor weight, Tensor? bias=None, int stride=1, bool tf32=False) -> Tensor");
    m.def("conv3x3_backward(Tensor grad_y, Tensor x, Tensor weight, int stride, bool tf32) -> (Tensor, Tensor, "
          "Tensor)");
    m.def("inverse_root(Tensor A, int p, float eps) -> Tensor");
    m.def("newton_schulz(Tensor G, int steps=5) -> Tensor");
    m.def("kron_stats(Tensor G, str side, Tensor? C=None, float alpha=1.0, float beta=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_ops, CPU, m) {
    m.impl("matmul", &torch_ops::matmul_cpu);
    m.impl("softmax", &torch_ops::softmax_cpu);
    m.impl("softmax_backward", &torch_ops::softmax_backward_cpu);
    m.impl("groupnorm", &torch_ops::groupnorm_cpu);
    m.impl("groupnorm_backward", &torch_ops::groupnorm_backward_cpu);
    m.impl("conv3x3", &torch_ops::conv3x3_cpu);
    m.impl("conv3x3_backward", &torch_ops::conv3x3_backward_cpu);
    m.impl("inverse_root", &torch_ops::inverse_root_cpu);
    m.impl("newton_schulz", &torch_ops::newton_schulz_cpu);
    m.impl("kron_stats", &torch_ops::kron_stats_cpu);
}
