// The CUDA kernels of the torch_ops operators: checks, output and workspace allocation through PyTorch's caching
// allocator, and a call into the lab kernels (labs.h) on PyTorch's current stream of the inputs' device. Built only
// with a CUDA-enabled PyTorch (torch_ops/_build.py).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include "checks.h"
#include "labs.h"

namespace torch_ops {

static const char* ON_CUDA = "on CUDA";

static cudaStream_t current_stream(const at::Tensor& t) {
    return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// The UNet layers read and write 16-byte vectors from the start of each tensor: a view that starts off a 16-byte
// boundary (a slice) is copied to a fresh, aligned tensor.
static at::Tensor aligned16(const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}

static at::Tensor workspace(size_t bytes, const at::Tensor& like) {
    return at::empty({(int64_t)std::max<size_t>(bytes, 1)}, like.options().dtype(at::kByte));
}

// ---------------------------------------------------------------------------------------------------------------
// matmul: fp32 on version 5 (strict) or 7 (tf32=True). bf16 on version 8 (bf16 wgmma, fp32 accumulation) where the
// GPU runs sm_90a code and TMA can read the operands. Elsewhere bf16, and fp16 always, are widened to fp32 (exactly)
// and run on the TF32 kernel, which is exact on them (their 8 and 11 significant bits fit TF32's 11; products
// accumulate in fp32). Either way the fp32 result is rounded once to the input dtype.

static at::Tensor matmul_cuda(const at::Tensor& a_in, const at::Tensor& b_in, bool tf32) {
    check_dtype("matmul", "a", a_in, {at::kFloat, at::kBFloat16, at::kHalf}, ON_CUDA);
    check_matmul(a_in, b_in);
    c10::cuda::CUDAGuard guard(a_in.device());
    const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(1);
    at::Tensor c = at::empty({M, N}, a_in.options().dtype(at::kFloat));
    if (M == 0 || N == 0) return c.to(a_in.scalar_type());
    if (K == 0) return c.zero_().to(a_in.scalar_type());
    if (a_in.scalar_type() == at::kBFloat16) {
        MatmulOperand oa, ob;
        matmul_operand(a_in, oa);
        matmul_operand(b_in, ob);
        if (dev_lab::matmul_bf16(oa.trans, ob.trans, (int)M, (int)N, (int)K, a_in.data_ptr(), (int)oa.ld,
                                 b_in.data_ptr(), (int)ob.ld, c.data_ptr<float>(), (int)N, current_stream(a_in)))
            return c.to(at::kBFloat16);
    }
    const bool narrow = a_in.scalar_type() != at::kFloat;
    // .to keeps the strides of a dense transposed view, so its layout (and the op it maps to) stays
    at::Tensor a = narrow ? a_in.to(at::kFloat) : a_in, b = narrow ? b_in.to(at::kFloat) : b_in;
    MatmulOperand oa, ob;
    matmul_operand(a, oa);
    matmul_operand(b, ob);
    dev_lab::matmul(oa.trans, ob.trans, (int)M, (int)N, (int)K, a.data_ptr<float>(), (int)oa.ld, b.data_ptr<float>(),
                    (int)ob.ld, c.data_ptr<float>(), (int)N, tf32 || narrow, current_stream(a));
    return narrow ? c.to(a_in.scalar_type()) : c;
}

// ---------------------------------------------------------------------------------------------------------------
// softmax: dev/softmax_forward.cu version 14 and dev/softmax_backward.cu version 11 (the tuned dispatchers)

static at::Tensor softmax_cuda(const at::Tensor& x) {
    check_dtype("softmax", "x", x, {at::kFloat}, ON_CUDA);
    check_softmax("softmax", "x", x);
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    if (x.numel() == 0) return y;
    const int64_t cols = x.size(-1);
    dev_lab::softmax_forward(y.data_ptr<float>(), x.data_ptr<float>(), (int)(x.numel() / cols), (int)cols,
                             current_stream(x));
    return y;
}

static at::Tensor softmax_backward_cuda(const at::Tensor& grad_y, const at::Tensor& y) {
    check_dtype("softmax_backward", "y", y, {at::kFloat}, ON_CUDA);
    check_softmax_backward(grad_y, y);
    c10::cuda::CUDAGuard guard(y.device());
    at::Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
    if (y.numel() == 0) return dx;
    const int64_t cols = y.size(-1);
    dev_lab::softmax_backward(dx.data_ptr<float>(), y.data_ptr<float>(), grad_y.data_ptr<float>(),
                              (int)(y.numel() / cols), (int)cols, current_stream(y));
    return dx;
}

// ---------------------------------------------------------------------------------------------------------------
// GroupNorm(+SiLU): train_unet.cu's (dev/groupnorm.cu version 1). Its channel reduction takes at most 1024 channels.

static void check_groupnorm_cuda(const char* op, const at::Tensor& x) {
    check_dtype(op, "x", x, {at::kFloat}, ON_CUDA);
    TORCH_CHECK_VALUE(x.size(-1) <= 1024, "torch_ops.", op, ": argument x has ", std::to_string(x.size(-1)),
                      " channels; the CUDA kernel's channel reduction takes at most 1024");
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_cuda(const at::Tensor& x_in, const at::Tensor& weight,
                                                                     const at::Tensor& bias, bool silu) {
    check_groupnorm("groupnorm", x_in, weight, bias);
    check_groupnorm_cuda("groupnorm", x_in);
    c10::cuda::CUDAGuard guard(x_in.device());
    const int64_t B = x_in.size(0), C = x_in.size(-1);
    at::Tensor y = at::empty_like(x_in, at::MemoryFormat::Contiguous);
    at::Tensor mean = at::empty({B, GROUPS}, x_in.options()), rstd = at::empty({B, GROUPS}, x_in.options());
    if (x_in.numel() == 0) return {y, mean.fill_(NAN), rstd.fill_(NAN)};  // as the CPU: the mean of no values
    const at::Tensor x = aligned16(x_in);
    const at::Tensor gamma_beta = at::cat({weight, bias});
    at::Tensor ws = workspace(dev_lab::groupnorm_workspace_bytes((int)B, (int)C), x);
    dev_lab::groupnorm_forward(x.data_ptr<float>(), gamma_beta.data_ptr<float>(), y.data_ptr<float>(),
                               mean.data_ptr<float>(), rstd.data_ptr<float>(), (int)B, (int)(x.numel() / (B * C)),
                               (int)C, silu, ws.data_ptr(), current_stream(x));
    return {y, mean, rstd};
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> groupnorm_backward_cuda(
    const at::Tensor& grad_y_in, const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, bool silu) {
    check_groupnorm_backward(grad_y_in, x_in, weight, bias, mean, rstd);
    check_groupnorm_cuda("groupnorm_backward", x_in);
    c10::cuda::CUDAGuard guard(x_in.device());
    const int64_t B = x_in.size(0), C = x_in.size(-1);
    at::Tensor dx = at::empty_like(x_in, at::MemoryFormat::Contiguous);
    at::Tensor grads = at::empty({2 * C}, x_in.options());  // dweight then dbias, as the trainer keeps them
    if (x_in.numel() == 0) {
        grads.zero_();
        return {dx, grads.narrow(0, 0, C), grads.narrow(0, C, C).clone()};
    }
    const at::Tensor x = aligned16(x_in), grad_y = aligned16(grad_y_in);
    const at::Tensor gamma_beta = at::cat({weight, bias});
    at::Tensor ws = workspace(dev_lab::groupnorm_workspace_bytes((int)B, (int)C), x);
    dev_lab::groupnorm_backward(grad_y.data_ptr<float>(), x.data_ptr<float>(), gamma_beta.data_ptr<float>(),
                                mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr<float>(),
                                grads.data_ptr<float>(), (int)B, (int)(x.numel() / (B * C)), (int)C, silu,
                                ws.data_ptr(), current_stream(x));
    // dbias is cloned so that no two outputs share storage
    return {dx, grads.narrow(0, 0, C), grads.narrow(0, C, C).clone()};
}

// ---------------------------------------------------------------------------------------------------------------
// 3x3 convolution: train_unet.cu's (dev/conv2d.cu versions 2/4 strict fp32, 3/6 with tf32=True)

// the weights and the bias (zeros without one) in one buffer, the trainer's parameter layout
static at::Tensor pack_weights(const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    const int64_t cin = weight.size(2), cout = weight.size(3), n = weight.numel();
    const int64_t off = (int64_t)dev_lab::conv3x3_bias_offset((int)cin, (int)cout);
    at::Tensor p = at::zeros({off + cout}, weight.options());
    p.narrow(0, 0, n).copy_(weight.reshape({n}));
    if (bias.has_value()) p.narrow(0, off, cout).copy_(*bias);
    return p;
}

static at::Tensor conv3x3_cuda(const at::Tensor& x_in, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias, int64_t stride, bool tf32) {
    check_dtype("conv3x3", "x", x_in, {at::kFloat}, ON_CUDA);
    check_conv3x3("conv3x3", x_in, weight, bias, stride);
    c10::cuda::CUDAGuard guard(x_in.device());
    at::Tensor y = at::empty(conv3x3_out_shape(x_in, weight, stride), x_in.options());
    check_int32("conv3x3", "the output", y);
    const int B = (int)x_in.size(0), H = (int)x_in.size(1), W = (int)x_in.size(2);
    const int cin = (int)weight.size(2), cout = (int)weight.size(3);
    if (y.numel() == 0) return y;
    if (cin == 0) return bias.has_value() ? y.copy_(bias->expand_as(y)) : y.zero_();
    const at::Tensor x = aligned16(x_in), w_bias = pack_weights(weight, bias);
    at::Tensor ws = workspace(dev_lab::conv3x3_workspace_bytes(B, H, W, cin, cout, (int)stride), x);
    dev_lab::conv3x3_forward(x.data_ptr<float>(), w_bias.data_ptr<float>(), y.data_ptr<float>(), B, H, W, cin, cout,
                             (int)stride, tf32, ws.data_ptr(), current_stream(x));
    return y;
}

static std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3x3_backward_cuda(const at::Tensor& grad_y_in,
                                                                          const at::Tensor& x_in,
                                                                          const at::Tensor& weight, int64_t stride,
                                                                          bool tf32) {
    check_dtype("conv3x3_backward", "x", x_in, {at::kFloat}, ON_CUDA);
    check_conv3x3_backward(grad_y_in, x_in, weight, stride);
    c10::cuda::CUDAGuard guard(x_in.device());
    const int B = (int)x_in.size(0), H = (int)x_in.size(1), W = (int)x_in.size(2);
    const int cin = (int)weight.size(2), cout = (int)weight.size(3);
    at::Tensor dx = at::empty_like(x_in, at::MemoryFormat::Contiguous);
    const int64_t off = (int64_t)dev_lab::conv3x3_bias_offset(cin, cout);
    at::Tensor grads = at::empty({off + cout}, x_in.options());  // dweight then dbias, as the trainer keeps them
    auto result = [&](const at::Tensor& db) {
        return std::make_tuple(dx, grads.narrow(0, 0, weight.numel()).view(weight.sizes()), db);
    };
    if (grad_y_in.numel() == 0 || cin == 0) {  // nothing flows back
        dx.zero_();
        grads.zero_();
        return result(grads.narrow(0, off, cout).clone());
    }
    const at::Tensor x = aligned16(x_in), grad_y = aligned16(grad_y_in), w_bias = pack_weights(weight, c10::nullopt);
    at::Tensor ws = workspace(dev_lab::conv3x3_workspace_bytes(B, H, W, cin, cout, (int)stride), x);
    dev_lab::conv3x3_backward(grad_y.data_ptr<float>(), x.data_ptr<float>(), w_bias.data_ptr<float>(),
                              dx.data_ptr<float>(), grads.data_ptr<float>(), B, H, W, cin, cout, (int)stride, tf32,
                              ws.data_ptr(), current_stream(x));
    // the lab's channel reduction takes up to 1024 channels (256 when cout % 4 != 0); PyTorch sums the others
    if (!dev_lab::conv3x3_channel_sums_ok(cout)) return result(grad_y.sum({0, 1, 2}));
    return result(grads.narrow(0, off, cout).clone());  // cloned: no two outputs share storage
}

// ---------------------------------------------------------------------------------------------------------------
// the second-order ops: dev/matrix_roots.cu (inverse roots versions 0-2, Newton-Schulz, the SYRK-like statistics)

static at::Tensor inverse_root_cuda(const at::Tensor& A, int64_t p, double eps) {
    check_dtype("inverse_root", "A", A, {at::kFloat}, ON_CUDA);
    check_inverse_root(A, p, eps);
    c10::cuda::CUDAGuard guard(A.device());
    at::Tensor X = at::empty_like(A, at::MemoryFormat::Contiguous);
    if (A.numel() == 0) return X;
    const int64_t n = A.size(-1);
    dev_lab::inverse_root(A.data_ptr<float>(), X.data_ptr<float>(), A.numel() / (n * n), (int)n, (int)p, (float)eps,
                          current_stream(A));
    return X;
}

static at::Tensor newton_schulz_cuda(const at::Tensor& G, int64_t steps) {
    check_dtype("newton_schulz", "G", G, {at::kFloat}, ON_CUDA);
    check_newton_schulz(G, steps);
    c10::cuda::CUDAGuard guard(G.device());
    at::Tensor out = at::empty_like(G, at::MemoryFormat::Contiguous);
    if (G.numel() == 0) return out;
    const int64_t m = G.size(-2), n = G.size(-1);
    dev_lab::newton_schulz(G.data_ptr<float>(), out.data_ptr<float>(), G.numel() / (m * n), (int)m, (int)n,
                           (int)steps, current_stream(G));
    return out;
}

static at::Tensor kron_stats_cuda(const at::Tensor& G, c10::string_view side, const c10::optional<at::Tensor>& C,
                                  double alpha, double beta) {
    check_dtype("kron_stats", "G", G, {at::kFloat}, ON_CUDA);
    check_kron_stats(G, side, C, alpha, beta);
    c10::cuda::CUDAGuard guard(G.device());
    const bool left = side == "left";
    const int64_t m = G.size(-2), n = G.size(-1), N = left ? m : n;
    std::vector<int64_t> shape(G.sizes().begin(), G.sizes().end());
    shape.back() = N;
    shape[shape.size() - 2] = N;
    // the kernel updates C in place: a contiguous copy of C, or a fresh output that beta = 0 never reads
    const bool accumulate = C.has_value() && beta != 0.0;
    at::Tensor out = accumulate ? C->clone(at::MemoryFormat::Contiguous) : at::empty(shape, G.options());
    if (out.numel() == 0) return out;
    const int64_t batch = out.numel() / (N * N);
    dev_lab::kron_stats(G.data_ptr<float>(), out.data_ptr<float>(), batch, (int)m, (int)n, left, (float)alpha,
                        accumulate ? (float)beta : 0.0f, current_stream(G));
    return out;
}

}  // namespace torch_ops

TORCH_LIBRARY_IMPL(torch_ops, CUDA, m) {
    m.impl("matmul", &torch_ops::matmul_cuda);
    m.impl("softmax", &torch_ops::softmax_cuda);
    m.impl("softmax_backward", &torch_ops::softmax_backward_cuda);
    m.impl("groupnorm", &torch_ops::groupnorm_cuda);
    m.impl("groupnorm_backward", &torch_ops::groupnorm_backward_cuda);
    m.impl("conv3x3", &torch_ops::conv3x3_cuda);
    m.impl("conv3x3_backward", &torch_ops::conv3x3_backward_cuda);
    m.impl("inverse_root", &torch_ops::inverse_root_cuda);
    m.impl("newton_schulz", &torch_ops::newton_schulz_cuda);
    m.impl("kron_stats", &torch_ops::kron_stats_cuda);
}
