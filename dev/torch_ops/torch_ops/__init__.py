"""The project's kernels as PyTorch custom operators: torch.ops.torch_ops.{matmul, softmax, softmax_backward,
groupnorm, groupnorm_backward, conv3x3, conv3x3_backward, inverse_root, newton_schulz, kron_stats}, each with a schema,
a CPU and a CUDA kernel (csrc/), a fake kernel for torch.compile and an autograd formula or a clear error (both
below). The functions of this module call them; torch_ops.Shampoo (shampoo.py) is an optimizer on the last three.

Importing loads the library: the build that `pip install dev/torch_ops` put next to this file, or else a JIT build
of csrc/ (torch.utils.cpp_extension) cached in dev/torch_ops/build/<cpu|cuda>/ (TORCH_OPS_BUILD_DIR overrides the
folder); an unchanged source tree is not rebuilt. dev/torch_ops/README.md lists what each op takes on each device.

Layouts are the project's: images channels last (B, H, W, C); 3x3 weights (3, 3, Cin, Cout) (from PyTorch's
(Cout, Cin, 3, 3): conv_weight_from_torch).
"""
import glob
import os
import sys

import torch

from . import _build

__all__ = ["matmul", "softmax", "groupnorm", "conv3x3", "conv_weight_from_torch", "conv_weight_to_torch",
           "inverse_root", "newton_schulz", "kron_stats", "Shampoo", "BUILD_INFO"]

GROUPS = 32  # GroupNorm's groups (the UNet's GroupNorm32)


def _load_library():
    """Loads the operator library; returns how it was found (a dict: variant, why, path)."""
    prebuilt = sorted(glob.glob(os.path.join(_build.PACKAGE_DIR, "_C*.so")))
    if prebuilt:
        torch.ops.load_library(prebuilt[0])
        return {"variant": "prebuilt", "why": "installed with pip", "path": prebuilt[0]}
    from torch.utils import cpp_extension
    with_cuda, why = _build.cuda_wanted()
    variant = "cuda" if with_cuda else "cpu"
    build_dir = os.path.join(os.environ.get("TORCH_OPS_BUILD_DIR") or os.path.join(_build.PROJECT_DIR, "build"),
                             variant)
    os.makedirs(build_dir, exist_ok=True)
    name = f"torch_ops_{variant}"
    if not os.path.exists(os.path.join(build_dir, name + ".so")):
        kernels = "CPU and CUDA kernels" if with_cuda else "CPU kernels only"
        print(f"torch_ops: building the operator library ({kernels}: {why}) in {build_dir}; later imports reuse it",
              file=sys.stderr, flush=True)
    path = cpp_extension.load(name=name, sources=_build.sources(with_cuda), extra_cflags=_build.CXX_FLAGS,
                              extra_cuda_cflags=_build.nvcc_flags() if with_cuda else None,
                              extra_ldflags=_build.cuda_ldflags() if with_cuda else None,
                              build_directory=build_dir, with_cuda=with_cuda, is_python_module=False,
                              verbose=os.environ.get("TORCH_OPS_VERBOSE") == "1")
    return {"variant": variant, "why": why, "path": path}


BUILD_INFO = _load_library()
_ops = torch.ops.torch_ops


# ---------------------------------------------------------------------------------------------------------------
# fake kernels: the output's shape, dtype and strides (always contiguous) without running anything

@torch.library.register_fake("torch_ops::matmul")
def _matmul_fake(a, b, tf32=False):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.register_fake("torch_ops::softmax")
def _softmax_fake(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("torch_ops::softmax_backward")
def _softmax_backward_fake(grad_y, y):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


@torch.library.register_fake("torch_ops::groupnorm")
def _groupnorm_fake(x, weight, bias, silu=False):
    stats = (x.shape[0], GROUPS)
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(stats), x.new_empty(stats)


@torch.library.register_fake("torch_ops::groupnorm_backward")
def _groupnorm_backward_fake(grad_y, x, weight, bias, mean, rstd, silu):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape))


def _conv_out_shape(x, weight, stride):
    return (x.shape[0], (x.shape[1] - 1) // stride + 1, (x.shape[2] - 1) // stride + 1, weight.shape[3])


@torch.library.register_fake("torch_ops::conv3x3")
def _conv3x3_fake(x, weight, bias=None, stride=1, tf32=False):
    return x.new_empty(_conv_out_shape(x, weight, stride))


@torch.library.register_fake("torch_ops::conv3x3_backward")
def _conv3x3_backward_fake(grad_y, x, weight, stride, tf32):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape),
            weight.new_empty((weight.shape[3],)))


@torch.library.register_fake("torch_ops::inverse_root")
def _inverse_root_fake(A, p, eps):
    return torch.empty_like(A, memory_format=torch.contiguous_format)


@torch.library.register_fake("torch_ops::newton_schulz")
def _newton_schulz_fake(G, steps=5):
    return torch.empty_like(G, memory_format=torch.contiguous_format)


@torch.library.register_fake("torch_ops::kron_stats")
def _kron_stats_fake(G, side, C=None, alpha=1.0, beta=1.0):
    N = G.shape[-2] if side == "left" else G.shape[-1]
    return G.new_empty((*G.shape[:-2], N, N))


# ---------------------------------------------------------------------------------------------------------------
# autograd: each backward runs on the ops too. Incoming gradients can be expanded views (the gradient of a sum):
# the ops take contiguous tensors, so they are made contiguous first.

def _matmul_setup(ctx, inputs, output):
    a, b, tf32 = inputs
    ctx.save_for_backward(a, b)
    ctx.tf32 = tf32


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = _ops.matmul(grad, b.t(), ctx.tf32) if ctx.needs_input_grad[0] else None  # (M, N) (N, K)
    grad_b = _ops.matmul(a.t(), grad, ctx.tf32) if ctx.needs_input_grad[1] else None  # (K, M) (M, N)
    return grad_a, grad_b, None


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return _ops.softmax_backward(grad.contiguous(), y)


def _groupnorm_setup(ctx, inputs, output):
    x, weight, bias, silu = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.silu = silu
    ctx.mark_non_differentiable(mean, rstd)


def _groupnorm_backward(ctx, grad_y, grad_mean, grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = _ops.groupnorm_backward(grad_y.contiguous(), x, weight, bias, mean, rstd, ctx.silu)
    return dx, dweight, dbias, None


def _conv3x3_setup(ctx, inputs, output):
    x, weight, bias, stride, tf32 = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.stride = stride
    ctx.tf32 = tf32


def _conv3x3_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dweight, dbias = _ops.conv3x3_backward(grad.contiguous(), x, weight, ctx.stride, ctx.tf32)
    return dx, dweight, dbias if ctx.has_bias else None, None, None


# The backward ops: softmax's and the convolution's are differentiable again (double backward, on the ops);
# GroupNorm's says it is not.

def _softmax_backward_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _softmax_backward_backward(ctx, grad):
    # dx = y * (dy - s), s = sum(y * dy) over the last dimension: linear in dy (the same op), and
    # d/dy = g * (dy - s) - dy * sum(g * y)
    dy, y = ctx.saved_tensors
    grad_dy = _ops.softmax_backward(grad.contiguous(), y) if ctx.needs_input_grad[0] else None
    grad_y = None
    if ctx.needs_input_grad[1]:
        grad_y = grad * (dy - (y * dy).sum(-1, keepdim=True)) - dy * (grad * y).sum(-1, keepdim=True)
    return grad_dy, grad_y


def _groupnorm_backward_setup(ctx, inputs, output):
    pass


def _groupnorm_backward_backward(ctx, *grads):
    raise NotImplementedError("torch_ops.groupnorm: double backward (a gradient of the gradient) is not implemented")


def _conv3x3_backward_setup(ctx, inputs, output):
    dy, x, weight, stride, tf32 = inputs
    ctx.save_for_backward(dy, x, weight)
    ctx.stride = stride
    ctx.tf32 = tf32


def _conv3x3_backward_backward(ctx, g_dx, g_dweight, g_dbias):
    # With y = conv(x, w): dx = conv(., w)^T dy, dweight = conv(x, .)^T dy, dbias = sum dy. Each output is linear in
    # dy and in one of x, w: the gradient for dy is conv(g_dx, w) + conv(x, g_dweight) + g_dbias; for x, the
    # transposed conv of dy with the weights g_dweight; for w, the weight gradient of dy against the input g_dx.
    dy, x, weight = ctx.saved_tensors
    s, tf32 = ctx.stride, ctx.tf32
    g_dx, g_dweight = g_dx.contiguous(), g_dweight.contiguous()
    grad_dy = grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_dy = _ops.conv3x3(g_dx, weight, g_dbias, s, tf32) + _ops.conv3x3(x, g_dweight, None, s, tf32)
    if ctx.needs_input_grad[1]:
        grad_x = _ops.conv3x3_backward(dy, x, g_dweight, s, tf32)[0]
    if ctx.needs_input_grad[2]:
        grad_w = _ops.conv3x3_backward(dy, g_dx, weight, s, tf32)[1]
    return grad_dy, grad_x, grad_w, None, None


# The second-order ops: kron_stats is differentiable (on PyTorch's matmul); inverse_root and newton_schulz are
# preconditioner arithmetic, not layers, and say so when differentiated.

def _kron_stats_setup(ctx, inputs, output):
    G, side, C, alpha, beta = inputs
    ctx.save_for_backward(G)
    ctx.left, ctx.alpha, ctx.beta = side == "left", alpha, beta
    ctx.has_c = C is not None


def _kron_stats_backward(ctx, grad):
    # out = alpha G G^T (left) or alpha G^T G (right), + beta sym(C) where sym(C) mirrors C's lower triangle:
    # d/dG = alpha (grad + grad^T) G or alpha G (grad + grad^T); C_ij (i > j) reaches out_ij and out_ji, C_ii once,
    # C_ij (i < j) nowhere
    (G,) = ctx.saved_tensors
    s = grad + grad.mT
    grad_g = grad_c = None
    if ctx.needs_input_grad[0]:
        grad_g = ctx.alpha * (s @ G if ctx.left else G @ s)
    if ctx.has_c and ctx.needs_input_grad[2]:
        grad_c = ctx.beta * (s.tril(-1) + torch.diag_embed(grad.diagonal(dim1=-2, dim2=-1)))
    return grad_g, None, grad_c, None, None


def _not_differentiable(name):
    def setup(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise NotImplementedError(f"torch_ops.{name} is not differentiable (an optimizer's preconditioner "
                                  f"arithmetic, not a layer): call it on detached tensors")
    return setup, backward


torch.library.register_autograd("torch_ops::matmul", _matmul_backward, setup_context=_matmul_setup)
torch.library.register_autograd("torch_ops::softmax", _softmax_backward, setup_context=_softmax_setup)
torch.library.register_autograd("torch_ops::groupnorm", _groupnorm_backward, setup_context=_groupnorm_setup)
torch.library.register_autograd("torch_ops::conv3x3", _conv3x3_backward, setup_context=_conv3x3_setup)
torch.library.register_autograd("torch_ops::softmax_backward", _softmax_backward_backward,
                                setup_context=_softmax_backward_setup)
torch.library.register_autograd("torch_ops::groupnorm_backward", _groupnorm_backward_backward,
                                setup_context=_groupnorm_backward_setup)
torch.library.register_autograd("torch_ops::conv3x3_backward", _conv3x3_backward_backward,
                                setup_context=_conv3x3_backward_setup)
torch.library.register_autograd("torch_ops::kron_stats", _kron_stats_backward, setup_context=_kron_stats_setup)
for _name in ("inverse_root", "newton_schulz"):
    _setup, _backward = _not_differentiable(_name)
    torch.library.register_autograd(f"torch_ops::{_name}", _backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------------------------
# the functions a model calls

def matmul(a, b, tf32=False):
    """a (M, K) @ b (K, N) -> (M, N), any M, N, K. a and b are row-major or transposed views of row-major matrices
    (a.t() costs nothing). CUDA: float32 on dev/matmul.cu version 5 (strict fp32) or, tf32=True, version 7 (TF32
    tensor cores); bfloat16 and float16 have no kernel of ours: they run exactly on the TF32 kernel after a widening
    to float32, the result rounded once. CPU: float32, float64, bfloat16, float16 (tf32 ignored)."""
    return _ops.matmul(a, b, tf32)


def softmax(x):
    """Softmax over the last dimension of a contiguous x (any leading shape). CUDA: float32 (dev/softmax_forward.cu
    version 14, the tuned dispatcher: the first call for a shape times the candidates); CPU: float32, float64."""
    return _ops.softmax(x)


def groupnorm(x, weight, bias, silu=False):
    """GroupNorm with 32 groups and eps 1e-5 over channels-last x (B, ..., C), C a multiple of 32, affine weight and
    bias (C); SiLU after it when silu. CUDA: float32, C <= 1024 (train_unet.cu's kernels); CPU: float32, float64."""
    return _ops.groupnorm(x, weight, bias, silu)[0]


def conv3x3(x, weight, bias=None, stride=1, tf32=False):
    """3x3 convolution, padding 1, stride 1 or 2: x (B, H, W, Cin), weight (3, 3, Cin, Cout), bias (Cout) or None
    -> (B, Ho, Wo, Cout). CUDA: float32, strict fp32 or, tf32=True, TF32 tensor cores (train_unet.cu's kernels);
    CPU: float32, float64 (tf32 ignored)."""
    return _ops.conv3x3(x, weight, bias, stride, tf32)


def conv_weight_from_torch(w):
    """PyTorch's conv weight (Cout, Cin, 3, 3) -> ours (3, 3, Cin, Cout), contiguous."""
    return w.permute(2, 3, 1, 0).contiguous()


def conv_weight_to_torch(w):
    """Ours (3, 3, Cin, Cout) -> PyTorch's (Cout, Cin, 3, 3), contiguous."""
    return w.permute(3, 2, 0, 1).contiguous()


def inverse_root(A, p, eps):
    """X = (A + eps I)^(-1/p) of a symmetric positive semi-definite A (..., n, n), a matrix or a batch, p 1, 2 or 4,
    eps > 0. CUDA, float32 (dev/matrix_roots.cu): version 3 (one fused Newton kernel per matrix, 3xTF32 on tensor
    cores; version 2's fp32 where it does not fit) for n <= 128, version 1 (coupled Newton on cuBLAS, 3xTF32-accurate
    products) above; a batch whose iteration fails falls back to version 0 (cuSOLVER's eigendecomposition). It
    synchronises the host. CPU: float32, float64, by torch.linalg.eigh (eigenvalues clamped at eps, as version 0).
    Symmetry is assumed, not checked. Not differentiable."""
    return _ops.inverse_root(A, p, eps)


def newton_schulz(G, steps=5):
    """Muon's quintic Newton-Schulz orthogonalisation of G (..., m, n): steps of X <- a X + (b A + c A^2) X, A = X X^T,
    from X0 = G / (||G||_F + 1e-7) per matrix. CUDA: float32 in and out, bf16 operands and fp32 accumulation
    (dev/matrix_roots.cu); CPU: float32, float64 in that dtype. Not differentiable."""
    return _ops.newton_schulz(G, steps)


def kron_stats(G, side, C=None, alpha=1.0, beta=1.0):
    """Shampoo's Kronecker statistics: beta C + alpha G G^T (side "left", (..., m, m)) or beta C + alpha G^T G
    ("right", (..., n, n)) for G (..., m, n); C symmetric (its lower triangle is read) or None. CUDA: float32, one
    triangle computed and mirrored (dev/matrix_roots.cu's SYRK-like kernel); CPU: float32, float64."""
    return _ops.kron_stats(G, side, C, alpha, beta)


from .shampoo import Shampoo  # noqa: E402  (it calls the ops above)
