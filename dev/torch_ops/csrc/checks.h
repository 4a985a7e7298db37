// Input checks shared by the CPU (ops.cpp) and CUDA (cuda_ops.cpp) kernels of every op. Each failure raises a
// Python error whose message starts "torch_ops.<op>: argument <name>" and says what was expected and what was found:
// TypeError for a dtype, ValueError for a shape or layout, RuntimeError for a device, NotImplementedError for a
// dtype that has no kernel of ours on that device.
#pragma once
#include <ATen/ATen.h>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <sstream>
#include <string>

namespace torch_ops {

constexpr int GROUPS = 32;      // the UNet's GroupNorm32
constexpr double GN_EPS = 1e-5;
constexpr double NS_A = 3.4445, NS_B = -4.7750, NS_C = 2.0315;  // Muon's quintic (dev/matrix_roots.cu)

inline std::string dtype_list(std::initializer_list<at::ScalarType> ok) {
    std::ostringstream s;
    bool first = true;
    for (at::ScalarType t : ok) {
        s << (first ? "" : ", ") << t;
        first = false;
    }
    return s.str();
}

// a shape or strides as "[2, 5, 5, 4]". The messages format numbers with std::to_string, never through an ostream:
// on the GPU machine's PyTorch 2.11 a number streamed into an error message crashed the process (a strings-only
// message did not)
inline std::string dims(at::IntArrayRef d) {
    std::string s = "[";
    for (size_t i = 0; i < d.size(); i++) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + "]";
}

// dtype among `ok` on this device (where: "on the CPU" / "on CUDA"); a floating dtype outside it has no kernel of ours
inline void check_dtype(const char* op, const char* arg, const at::Tensor& t, std::initializer_list<at::ScalarType> ok,
                        const char* where) {
    for (at::ScalarType s : ok)
        if (t.scalar_type() == s) return;
    TORCH_CHECK_NOT_IMPLEMENTED(!at::isFloatingType(t.scalar_type()), "torch_ops.", op, ": argument ", arg,
                                " has dtype ", t.scalar_type(), "; ", where, " this op has kernels for ",
                                dtype_list(ok), " only");
    TORCH_CHECK_TYPE(false, "torch_ops.", op, ": argument ", arg, " has dtype ", t.scalar_type(), "; ", where,
                     " this op takes ", dtype_list(ok));
}

// the same dtype as the reference argument
inline void check_same_dtype(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                             const at::Tensor& ref) {
    TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "torch_ops.", op, ": argument ", arg, " has dtype ",
                     t.scalar_type(), ", expected ", ref.scalar_type(), " like ", ref_arg);
}

inline void check_same_device(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                              const at::Tensor& ref) {
    TORCH_CHECK(t.device() == ref.device(), "torch_ops.", op, ": argument ", arg, " is on ", t.device(),
                ", expected ", ref.device(), " like ", ref_arg);
}

// exactly `dim` dimensions; layout names them, e.g. "(B, H, W, C)"
inline void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim, const char* layout) {
    TORCH_CHECK_VALUE(t.dim() == dim, "torch_ops.", op, ": argument ", arg, " must be ", std::to_string(dim), "-D ",
                      layout,
                      ", found shape ", dims(t.sizes()));
}

inline void check_contiguous(const char* op, const char* arg, const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.is_contiguous(), "torch_ops.", op, ": argument ", arg,
                      " must be contiguous (call .contiguous()), found shape ", dims(t.sizes()), " with strides ",
                      dims(t.strides()));
}

inline void check_shape(const char* op, const char* arg, const at::Tensor& t, at::IntArrayRef expected,
                        const char* layout) {
    TORCH_CHECK_VALUE(t.sizes() == expected, "torch_ops.", op, ": argument ", arg, " must have shape ", dims(expected),
                      " ", layout, ", found ", dims(t.sizes()));
}

// the kernels index with 32-bit ints
inline void check_int32(const char* op, const char* arg, const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.numel() <= INT_MAX, "torch_ops.", op, ": argument ", arg, " has ", std::to_string(t.numel()),
                      " elements, more than the kernels' 32-bit indices take (", std::to_string(INT_MAX), ")");
}

// ---------------------------------------------------------------------------------------------------------------
// per-op checks (the dtype is checked by each device's kernel: the two devices take different dtypes)

// a (M, K) and b (K, N), each row-major or a transposed view of a row-major matrix (see matmul_operand)
struct MatmulOperand {
    bool trans;  // stored transposed: the tensor is the transpose of a row-major matrix
    int64_t ld;  // row stride of the stored matrix
};

// t (rows x cols) as the lab's GEMM takes it: row-major (unit column step, rows >= cols apart) or a transposed
// view of a row-major matrix (unit row step, columns >= rows apart). The stride of a size-1 dimension is free.
inline bool matmul_operand(const at::Tensor& t, MatmulOperand& o) {
    const int64_t r = t.size(0), c = t.size(1), s0 = t.stride(0), s1 = t.stride(1);
    if ((c == 1 || s1 == 1) && (r == 1 || s0 >= c)) {
        o = {false, r == 1 ? std::max<int64_t>(c, 1) : s0};
        return true;
    }
    if ((r == 1 || s0 == 1) && (c == 1 || s1 >= r)) {
        o = {true, c == 1 ? std::max<int64_t>(r, 1) : s1};
        return true;
    }
    return false;
}

inline void check_matmul(const at::Tensor& a, const at::Tensor& b) {
    check_dim("matmul", "a", a, 2, "(M, K)");
    check_dim("matmul", "b", b, 2, "(K, N)");
    check_same_device("matmul", "b", b, "a", a);
    check_same_dtype("matmul", "b", b, "a", a);
    TORCH_CHECK_VALUE(a.size(1) == b.size(0), "torch_ops.matmul: argument b has ", std::to_string(b.size(0)),
                      " rows, expected a.shape[1] = ", std::to_string(a.size(1)), " (a ", dims(a.sizes()), ", b ",
                      dims(b.sizes()),
                      ")");
    for (auto [arg, t] : {std::pair<const char*, const at::Tensor&>{"a", a}, {"b", b}}) {
        MatmulOperand o;
        TORCH_CHECK_VALUE(matmul_operand(t, o), "torch_ops.matmul: argument ", arg,
                          " must be row-major or the transpose of a row-major matrix (a unit stride in one "
                          "dimension), found shape ", dims(t.sizes()), " with strides ", dims(t.strides()),
                          " (call .contiguous())");
        TORCH_CHECK_VALUE(o.ld <= INT_MAX && t.size(0) <= INT_MAX && t.size(1) <= INT_MAX, "torch_ops.matmul: ",
                          "argument ", arg, " has shape ", dims(t.sizes()), " with strides ", dims(t.strides()),
                          ": over the kernels' 32-bit sizes");
    }
}

// x (..., cols), softmax over the last dimension
inline void check_softmax(const char* op, const char* arg, const at::Tensor& x) {
    TORCH_CHECK_VALUE(x.dim() >= 1, "torch_ops.", op, ": argument ", arg,
                      " must have at least 1 dimension (softmax over the last), found a 0-D tensor");
    check_contiguous(op, arg, x);
    TORCH_CHECK_VALUE(x.size(-1) <= INT_MAX && (x.size(-1) == 0 || x.numel() / x.size(-1) <= INT_MAX), "torch_ops.",
                      op, ": argument ", arg, " has shape ", dims(x.sizes()),
                      ": rows and columns must each fit 32 bits");
}

inline void check_softmax_backward(const at::Tensor& grad_y, const at::Tensor& y) {
    check_softmax("softmax_backward", "y", y);
    check_same_device("softmax_backward", "grad_y", grad_y, "y", y);
    check_same_dtype("softmax_backward", "grad_y", grad_y, "y", y);
    check_shape("softmax_backward", "grad_y", grad_y, y.sizes(), "(the shape of y)");
    check_contiguous("softmax_backward", "grad_y", grad_y);
}

// x (B, *, C) channels last; weight, bias (C); C % 32 == 0
inline void check_groupnorm(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
    TORCH_CHECK_VALUE(x.dim() >= 2, "torch_ops.", op, ": argument x must be (B, ..., C) (channels last, at least ",
                      "2-D), found shape ", dims(x.sizes()));
    check_contiguous(op, "x", x);
    check_int32(op, "x", x);
    const int64_t C = x.size(-1);
    TORCH_CHECK_VALUE(C % GROUPS == 0 && C > 0, "torch_ops.", op, ": argument x has ", std::to_string(C),
                      " channels (its last dimension), expected a positive multiple of the ", std::to_string(GROUPS),
                      " groups");
    for (auto [arg, t] : {std::pair<const char*, const at::Tensor&>{"weight", weight}, {"bias", bias}}) {
        check_same_device(op, arg, t, "x", x);
        check_same_dtype(op, arg, t, "x", x);
        check_shape(op, arg, t, {C}, "(C, the last dimension of x)");
    }
}

inline void check_groupnorm_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd) {
    const char* op = "groupnorm_backward";
    check_groupnorm(op, x, weight, bias);
    check_same_device(op, "grad_y", grad_y, "x", x);
    check_same_dtype(op, "grad_y", grad_y, "x", x);
    check_shape(op, "grad_y", grad_y, x.sizes(), "(the shape of x)");
    check_contiguous(op, "grad_y", grad_y);
    for (auto [arg, t] : {std::pair<const char*, const at::Tensor&>{"mean", mean}, {"rstd", rstd}}) {
        check_same_device(op, arg, t, "x", x);
        check_same_dtype(op, arg, t, "x", x);
        check_shape(op, arg, t, {x.size(0), GROUPS}, "(B, 32): the forward's statistics");
        check_contiguous(op, arg, t);
    }
}

// x (B, H, W, Cin), weight (3, 3, Cin, Cout), bias (Cout) or None, stride 1 or 2
inline void check_conv3x3(const char* op, const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, int64_t stride) {
    check_dim(op, "x", x, 4, "(B, H, W, Cin) (channels last)");
    check_contiguous(op, "x", x);
    check_int32(op, "x", x);
    check_same_device(op, "weight", weight, "x", x);
    check_same_dtype(op, "weight", weight, "x", x);
    check_dim(op, "weight", weight, 4, "(3, 3, Cin, Cout)");
    TORCH_CHECK_VALUE(weight.size(0) == 3 && weight.size(1) == 3 && weight.size(2) == x.size(3), "torch_ops.", op,
                      ": argument weight must have shape (3, 3, ", std::to_string(x.size(3)),
                      ", Cout) (taps, Cin of x, Cout), found ",
                      dims(weight.sizes()),
                      " (from PyTorch's (Cout, Cin, 3, 3): weight.permute(2, 3, 1, 0).contiguous())");
    TORCH_CHECK_VALUE(weight.size(3) >= 1, "torch_ops.", op, ": argument weight has no output channels");
    check_contiguous(op, "weight", weight);
    if (bias.has_value()) {
        check_same_device(op, "bias", *bias, "x", x);
        check_same_dtype(op, "bias", *bias, "x", x);
        check_shape(op, "bias", *bias, {weight.size(3)}, "(Cout)");
    }
    TORCH_CHECK_VALUE(stride == 1 || stride == 2, "torch_ops.", op, ": argument stride must be 1 or 2, found ",
                      std::to_string(stride));
}

inline std::vector<int64_t> conv3x3_out_shape(const at::Tensor& x, const at::Tensor& weight, int64_t stride) {
    return {x.size(0), (x.size(1) - 1) / stride + 1, (x.size(2) - 1) / stride + 1, weight.size(3)};
}

inline void check_conv3x3_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                   int64_t stride) {
    const char* op = "conv3x3_backward";
    check_conv3x3(op, x, weight, c10::nullopt, stride);
    check_same_device(op, "grad_y", grad_y, "x", x);
    check_same_dtype(op, "grad_y", grad_y, "x", x);
    check_shape(op, "grad_y", grad_y, conv3x3_out_shape(x, weight, stride), "(B, Ho, Wo, Cout): the output's shape");
    check_contiguous(op, "grad_y", grad_y);
    check_int32(op, "grad_y", grad_y);
}

// ---------------------------------------------------------------------------------------------------------------
// the second-order ops (dev/matrix_roots.cu): batches of matrices, (..., rows, cols), contiguous

// at least 2-D, contiguous, each matrix dimension within the kernels' 32-bit sizes; layout names the dimensions
inline void check_matrices(const char* op, const char* arg, const at::Tensor& t, const char* layout) {
    TORCH_CHECK_VALUE(t.dim() >= 2, "torch_ops.", op, ": argument ", arg, " must be ", layout,
                      " (a matrix or a batch of them, at least 2-D), found shape ", dims(t.sizes()));
    check_contiguous(op, arg, t);
    TORCH_CHECK_VALUE(t.size(-1) <= INT_MAX && t.size(-2) <= INT_MAX, "torch_ops.", op, ": argument ", arg,
                      " has shape ", dims(t.sizes()), ": each matrix dimension must fit 32 bits");
}

// A (..., n, n) symmetric positive semi-definite (symmetry is not checked), p 1, 2 or 4, eps finite and > 0
inline void check_inverse_root(const at::Tensor& A, int64_t p, double eps) {
    check_matrices("inverse_root", "A", A, "(..., n, n)");
    TORCH_CHECK_VALUE(A.size(-1) == A.size(-2), "torch_ops.inverse_root: argument A must hold square matrices ",
                      "(..., n, n), found shape ", dims(A.sizes()));
    TORCH_CHECK_VALUE(p == 1 || p == 2 || p == 4, "torch_ops.inverse_root: argument p must be 1, 2 or 4, found ",
                      std::to_string(p));
    TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0.0, "torch_ops.inverse_root: argument eps must be finite and > 0 ",
                      "(it is added to the diagonal), found ", std::to_string(eps));
}

inline void check_newton_schulz(const at::Tensor& G, int64_t steps) {
    check_matrices("newton_schulz", "G", G, "(..., m, n)");
    TORCH_CHECK_VALUE(steps >= 0 && steps <= 1000, "torch_ops.newton_schulz: argument steps must be in [0, 1000], ",
                      "found ", std::to_string(steps));
}

// the statistic's side: "left" L = G G^T (m x m) or "right" R = G^T G (n x n); returns whether it is left
inline bool check_kron_side(c10::string_view side) {
    TORCH_CHECK_VALUE(side == "left" || side == "right", "torch_ops.kron_stats: argument side must be \"left\" ",
                      "(G G^T) or \"right\" (G^T G), found \"", std::string(side), "\"");
    return side == "left";
}

// G (..., m, n); C (..., N, N) with G's leading dimensions, N = m (left) or n (right), or None; alpha, beta finite
inline void check_kron_stats(const at::Tensor& G, c10::string_view side, const c10::optional<at::Tensor>& C,
                             double alpha, double beta) {
    const char* op = "kron_stats";
    check_matrices(op, "G", G, "(..., m, n)");
    const bool left = check_kron_side(side);
    TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(beta), "torch_ops.kron_stats: arguments alpha and beta ",
                      "must be finite, found ", std::to_string(alpha), " and ", std::to_string(beta));
    if (!C.has_value()) return;
    check_same_device(op, "C", *C, "G", G);
    check_same_dtype(op, "C", *C, "G", G);
    std::vector<int64_t> expected(G.sizes().begin(), G.sizes().end());
    const int64_t N = left ? G.size(-2) : G.size(-1);
    expected.back() = N;
    expected[expected.size() - 2] = N;
    check_shape(op, "C", *C, expected, left ? "(..., m, m) for side \"left\"" : "(..., n, n) for side \"right\"");
}

}  // namespace torch_ops
