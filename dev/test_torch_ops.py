"""dev/torch_ops: the project's kernels as PyTorch custom operators, checked as PyTorch checks its own.

  python3 dev/test_torch_ops.py        (from the repository root; last line: N passed, N failed, N skipped)

On the CPU (CI): the library builds (JIT, CPU kernels where PyTorch or nvcc lacks CUDA) and a second import does not
rebuild; torch.library.opcheck (schema, fake kernel, autograd registration, AOT dispatch) and gradcheck in float64
for every op; the CPU kernels against PyTorch's own ops; a bad input to each op raises an error that names the
argument; torch.compile(fullgraph=True) of a small model on the ops compiles with no graph break and matches eager;
dev/cnn_custom.py's CNN on our matmul trains as stock PyTorch on a slice of MNIST.
On a GPU (when torch.cuda.is_available()): opcheck on CUDA, gradcheck in float32, our kernels against a float64
reference with each tolerance of the lab files (the same bound PyTorch's kernels are held to), the current stream,
CUDA-only errors, torch.compile on CUDA. Without PyTorch every check is a SKIP.
"""
import os
import subprocess
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = os.path.join(ROOT, "dev", "torch_ops")
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
GROUPS = ["build and import", "opcheck (CPU)", "gradcheck float64 (CPU)", "CPU kernels vs PyTorch",
          "bad inputs name the argument", "torch_ops.Shampoo (CPU)", "torch.compile fullgraph (CPU)",
          "dev/cnn_custom.py (CPU)", "dev/shampoo_bench.py --quick (CPU)", "CUDA checks"]


def report(status, name, detail=""):
    counts[status] += 1
    print(f"{status} {name}" + (f": {detail}" if detail else ""), flush=True)


def run(name, fn):
    """Runs one check: fn() returns a detail string (PASS) or raises (FAIL, with the last lines of the traceback)."""
    try:
        report("PASS", name, fn() or "")
    except Exception as e:  # a failed check, whatever raised it
        tb = traceback.format_exc().strip().splitlines()
        report("FAIL", name, f"{type(e).__name__}: {e}".splitlines()[0][:400] + " | " + " / ".join(tb[-3:])[:400])


def closing():
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


# ---------------------------------------------------------------------------------------------------------------
# helpers

def close(name, got, ref, atol, rtol, mag=None):
    """|got - ref| <= atol + rtol * (mag if given else |ref|) elementwise, NaN where ref is NaN; raises with the max
    error and where it is."""
    import torch
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    nan_ref = torch.isnan(ref)
    if not torch.equal(torch.isnan(got), nan_ref):
        raise AssertionError(f"{name}: NaN pattern differs ({int(torch.isnan(got).sum())} NaN, expected "
                             f"{int(nan_ref.sum())})")
    scale = (mag.detach().double().cpu() if mag is not None else ref.abs()).masked_fill(nan_ref, 0)
    err = (got - ref).abs().masked_fill(nan_ref, 0)
    tol = atol + rtol * scale
    worst = int(torch.argmax(err / tol)) if err.numel() else 0
    if err.numel() and not bool((err <= tol).all()):
        i = tuple(int(v) for v in torch.unravel_index(torch.tensor(worst), err.shape)) if err.dim() else ()
        raise AssertionError(f"{name}: |err| {float(err.flatten()[worst]):.3e} > tol {float(tol.flatten()[worst]):.3e} "
                             f"at {i} (got {float(got.flatten()[worst]):.8g}, ref {float(ref.flatten()[worst]):.8g})")
    return f"max |err| {float(err.max()) if err.numel() else 0.0:.2e}"


def expect_error(call, exc_types, must_contain):
    """call() must raise one of exc_types with every string of must_contain in its message."""
    try:
        call()
    except exc_types as e:
        msg = str(e)
        missing = [s for s in must_contain if s not in msg]
        if missing:
            raise AssertionError(f"message lacks {missing}: {msg.splitlines()[0][:300]}")
        return msg.splitlines()[0][:160]
    except Exception as e:
        raise AssertionError(f"raised {type(e).__name__}, expected {[t.__name__ for t in exc_types]}: "
                             f"{str(e).splitlines()[0][:300]}")
    raise AssertionError(f"no error raised, expected {[t.__name__ for t in exc_types]}")


def gn_reference(x, weight, bias, silu):
    """torch.nn.functional.group_norm (+ SiLU) on channels-last x (B, ..., C)."""
    import torch
    import torch.nn.functional as F
    xc = x.movedim(-1, 1)
    y = F.group_norm(xc, 32, weight, bias, eps=1e-5)
    return (F.silu(y) if silu else y).movedim(1, -1)


def conv_reference(x, weight, bias, stride):
    """torch.nn.functional.conv2d on channels-last x (B, H, W, Cin), our weight layout (3, 3, Cin, Cout)."""
    import torch.nn.functional as F
    y = F.conv2d(x.permute(0, 3, 1, 2), weight.permute(3, 2, 0, 1), bias, stride=stride, padding=1)
    return y.permute(0, 2, 3, 1)


# ---------------------------------------------------------------------------------------------------------------
# samples: awkward sizes (not multiples of any tile), every layout and flag of each op

def samples(device, dtype, grad):
    """{op name: [(args, kwargs), ...]} for torch.library.opcheck; tensors require grad when grad."""
    import torch
    g = torch.Generator().manual_seed(1)

    def t(*shape, scale=1.0, shift=0.0, dt=None):
        v = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dt or dtype).to(device)
        return v.requires_grad_(grad and (dt or dtype).is_floating_point)

    def leaf_t(v):  # a transposed view that is still a leaf for autograd
        return v.detach().t().requires_grad_(v.requires_grad)

    out = {}
    out["matmul"] = [((t(37, 19), t(19, 23)), {}), ((leaf_t(t(19, 37)), t(19, 5)), {}),
                     ((t(3, 70), leaf_t(t(9, 70))), {"tf32": False}), ((t(1, 1), t(1, 6)), {})]
    out["softmax"] = [((t(5, 37, scale=3.0),), {}), ((t(2, 3, 129, scale=3.0),), {}), ((t(4, 1),), {})]
    y = torch.softmax(t(6, 45, scale=3.0).detach(), -1)
    out["softmax_backward"] = [((t(6, 45), y.requires_grad_(grad)), {})]
    gn = []
    for shape, silu in (((3, 5, 7, 64), True), ((2, 9, 32), False), ((2, 4, 96), True)):
        C = shape[-1]
        gn.append(((t(*shape, shift=0.5), t(C, scale=0.3, shift=1.0), t(C, scale=0.3)), {"silu": silu}))
    out["groupnorm"] = gn
    x, w, b = (v.detach() for v in gn[0][0])
    y, mean, rstd = torch.ops.torch_ops.groupnorm(x, w, b, True)
    # without requires_grad: its double backward raises NotImplementedError (checked by itself below)
    out["groupnorm_backward"] = [((t(*x.shape).detach(), x, w, b, mean, rstd, True), {})]
    conv = []
    for (B, H, W, cin, cout), stride, bias in (((2, 7, 5, 3, 8), 1, True), ((2, 9, 6, 5, 4), 2, True),
                                               ((1, 4, 4, 4, 3), 1, False)):
        scale = (9 * cin) ** -0.5
        conv.append(((t(B, H, W, cin), t(3, 3, cin, cout, scale=scale), t(cout) if bias else None),
                     {"stride": stride}))
    out["conv3x3"] = conv
    x, w = conv[1][0][0].detach(), conv[1][0][1].detach()
    dy = t(2, 5, 3, 4)
    out["conv3x3_backward"] = [((dy, x, w, 2, False), {})]
    # the second-order ops; inverse_root and newton_schulz are not differentiable (their inputs never require grad)
    out["inverse_root"] = [((spd(5, g, dtype, device), 4, 1e-6), {}),
                           ((spd(7, g, dtype, device, batch=(2, 3)), 2, 1e-4), {}),
                           ((spd(1, g, dtype, device), 1, 1e-6), {})]
    out["newton_schulz"] = [((t(5, 9).detach(),), {}), ((t(2, 11, 6).detach(),), {"steps": 3}),
                            ((t(1, 17).detach(),), {"steps": 0})]
    c = t(2, 3, 4, 4)
    out["kron_stats"] = [((t(7, 5), "left"), {}), ((t(2, 3, 6, 4), "right"), {"C": c, "alpha": 0.5, "beta": 0.9}),
                         ((t(9, 4), "left"), {"C": t(9, 9), "beta": 0.0})]
    return out


def spd(n, g, dtype, device, batch=(), kappa=1e2):
    """Symmetric positive definite Q diag(d) Q^T, (*batch, n, n), eigenvalues log-spaced from 1 to 1 / kappa."""
    import torch
    q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=g, dtype=torch.float64))
    d = torch.logspace(0, -torch.log10(torch.tensor(kappa)).item(), n, dtype=torch.float64)
    return ((q * d) @ q.mT).to(dtype).to(device).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# CPU checks

def check_build():
    import torch_ops
    info = torch_ops.BUILD_INFO
    # a fresh interpreter imports the same build: ninja finds nothing to do, the library file is not rewritten
    before = os.path.getmtime(info["path"])
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=PROJECT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", "import torch_ops; print(torch_ops.BUILD_INFO['path'])"], env=env,
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    secs = time.time() - t0
    if p.returncode != 0:
        raise AssertionError(f"second import failed: {p.stderr.strip()[-300:]}")
    if "building" in p.stderr or os.path.getmtime(info["path"]) != before:
        raise AssertionError(f"second import rebuilt the library: {p.stderr.strip()[-300:]}")
    return f"{info['variant']} ({info['why']}), {info['path']}; a second import took {secs:.1f} s, no rebuild"


def check_cpu_only_build():
    """TORCH_OPS_CUDA=0 builds the CPU kernels alone (C++ only, no nvcc), as a CPU-only PyTorch does."""
    env = dict(os.environ, TORCH_OPS_CUDA="0",
               PYTHONPATH=PROJECT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import torch, torch_ops; x = torch.randn(3, 5); "
            "assert torch.allclose(torch_ops.softmax(x), torch.softmax(x, -1)); "
            "assert not torch._C._dispatch_has_kernel_for_dispatch_key('torch_ops::softmax', 'CUDA'); "
            "print(torch_ops.BUILD_INFO['variant'], torch_ops.BUILD_INFO['path'])")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise AssertionError(p.stderr.strip()[-600:])
    return f"{p.stdout.strip()} in {time.time() - t0:.1f} s, no CUDA kernel registered"


def check_opcheck(device, dtype):
    import torch
    for op_name, cases in samples(device, dtype, grad=True).items():
        op = getattr(torch.ops.torch_ops, op_name)
        for i, (args, kwargs) in enumerate(cases):
            def one(args=args, kwargs=kwargs, op=op):
                torch.library.opcheck(op, args, kwargs)
                shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
                kw = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                return f"{shapes} {kw}"
            run(f"opcheck {op_name} {device} {str(dtype).replace('torch.', '')} case {i}", one)


def check_gradcheck_cpu():
    """float64 on the CPU: torch.autograd.gradcheck's default tolerances (eps 1e-6, atol 1e-5, rtol 1e-3)."""
    import torch
    import torch_ops
    g = torch.Generator().manual_seed(2)

    def t(*shape, shift=0.0, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).requires_grad_()

    run("gradcheck matmul float64 CPU", lambda: str(torch.autograd.gradcheck(torch_ops.matmul, (t(7, 5), t(5, 3)))))
    run("gradcheck matmul float64 CPU, a transposed",
        lambda: str(torch.autograd.gradcheck(lambda a, b: torch_ops.matmul(a.t(), b), (t(5, 7), t(5, 3)))))
    run("gradcheck softmax float64 CPU", lambda: str(torch.autograd.gradcheck(torch_ops.softmax, (t(3, 4, 9),))))
    for silu in (False, True):
        run(f"gradcheck groupnorm silu={silu} float64 CPU", lambda silu=silu: str(torch.autograd.gradcheck(
            lambda x, w, b: torch_ops.groupnorm(x, w, b, silu), (t(2, 3, 2, 64, shift=0.5), t(64, shift=1.0),
                                                                 t(64)))))
    run("gradgradcheck softmax float64 CPU (softmax_backward's autograd)",
        lambda: str(torch.autograd.gradgradcheck(torch_ops.softmax, (t(3, 7),))))
    run("gradgradcheck conv3x3 stride 2 float64 CPU (conv3x3_backward's autograd)",
        lambda: str(torch.autograd.gradgradcheck(lambda x, w, b: torch_ops.conv3x3(x, w, b, 2),
                                                 (t(1, 5, 4, 2), t(3, 3, 2, 3, scale=0.2), t(3)))))

    def gn_double_backward():
        x, w, b = t(1, 2, 32), t(32), t(32)
        (gx,) = torch.autograd.grad(torch_ops.groupnorm(x, w, b).sum(), x, create_graph=True)
        return expect_error(lambda: gx.sum().backward(), (NotImplementedError,), ["double backward"])

    run("groupnorm double backward says it is not implemented", gn_double_backward)
    # C need not be symmetric here: the op mirrors its lower triangle, and gradcheck perturbs every element
    for side in ("left", "right"):
        run(f"gradcheck kron_stats {side} float64 CPU (G and a non-symmetric C)",
            lambda side=side: str(torch.autograd.gradcheck(
                lambda G, C: torch_ops.kron_stats(G, side, C, 0.7, 0.9),
                (t(2, 5, 3), t(2, 5, 5) if side == "left" else t(2, 3, 3)))))

    def not_differentiable(name, call):
        x = t(4, 4)
        y = call((x @ x.t() + torch.eye(4, dtype=torch.float64)))
        return expect_error(lambda: y.sum().backward(), (NotImplementedError,), [name, "not differentiable"])

    run("inverse_root says it is not differentiable",
        lambda: not_differentiable("inverse_root", lambda a: torch_ops.inverse_root(a, 4, 1e-6)))
    run("newton_schulz says it is not differentiable",
        lambda: not_differentiable("newton_schulz", torch_ops.newton_schulz))
    for stride, bias in ((1, True), (2, True), (2, False)):
        run(f"gradcheck conv3x3 stride {stride} bias={bias} float64 CPU",
            lambda stride=stride, bias=bias: str(torch.autograd.gradcheck(
                lambda x, w, *b: torch_ops.conv3x3(x, w, b[0] if b else None, stride),
                (t(2, 5, 4, 3), t(3, 3, 3, 4, scale=0.2)) + ((t(4),) if bias else ()))))


def check_cpu_vs_torch():
    """The CPU kernels in float64 against PyTorch's own ops: what is checked is the layout (channels last, weights
    (3, 3, Cin, Cout)) and the formulas (GroupNorm's backward is ours); float64 sums of <= 200 O(1) terms agree to
    ~1e-14, so atol = rtol = 1e-10."""
    import torch
    import torch_ops
    g = torch.Generator().manual_seed(3)

    def t(*shape, shift=0.0, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).requires_grad_()

    def both(fn_ours, fn_ref, inputs):
        a = [v.detach().clone().requires_grad_() for v in inputs]
        r = [v.detach().clone().requires_grad_() for v in inputs]
        ya, yr = fn_ours(*a), fn_ref(*r)
        dy = torch.randn(ya.shape, generator=g, dtype=torch.float64)
        ya.backward(dy)
        yr.backward(dy)
        out = [close("y", ya, yr, 1e-10, 1e-10)]
        out += [close(f"grad {i}", u.grad, v.grad, 1e-10, 1e-10) for i, (u, v) in enumerate(zip(a, r))]
        return "; ".join(out)

    run("matmul float64 CPU vs torch.mm (y, grad a, grad b)",
        lambda: both(torch_ops.matmul, torch.mm, [t(37, 19), t(19, 23)]))
    run("softmax float64 CPU vs torch.softmax (y, grad)",
        lambda: both(torch_ops.softmax, lambda x: torch.softmax(x, -1), [t(5, 3, 33, scale=3.0)]))
    for silu in (False, True):
        run(f"groupnorm silu={silu} float64 CPU vs F.group_norm (y, grad x, weight, bias)",
            lambda silu=silu: both(lambda x, w, b: torch_ops.groupnorm(x, w, b, silu),
                                   lambda x, w, b: gn_reference(x, w, b, silu),
                                   [t(3, 5, 7, 96, shift=0.5), t(96, shift=1.0), t(96)]))
    for stride in (1, 2):
        run(f"conv3x3 stride {stride} float64 CPU vs F.conv2d (y, grad x, weight, bias)",
            lambda stride=stride: both(lambda x, w, b: torch_ops.conv3x3(x, w, b, stride),
                                       lambda x, w, b: conv_reference(x, w, b, stride),
                                       [t(2, 9, 7, 5), t(3, 3, 5, 6, scale=0.2), t(6)]))
    def float32():
        x = torch.randn(7, 300, generator=g) * 4
        xg, b = torch.randn(2, 4, 4, 64, generator=g), torch.randn(64, generator=g)
        w = torch.rand(64, generator=g) + 0.5
        return "; ".join([close("softmax", torch_ops.softmax(x), torch.softmax(x, -1), 1e-6, 1e-5),
                          close("groupnorm", torch_ops.groupnorm(xg, w, b, True), gn_reference(xg, w, b, True), 1e-5,
                                1e-5)])

    run("float32 CPU: softmax and groupnorm as PyTorch in float32 (atol 1e-5, rtol 1e-5)", float32)

    # the second-order ops in float64 against what they must satisfy, not against their own formula: X^p (A + eps I)
    # = I; Newton-Schulz maps each singular value s of G / (||G||_F + 1e-7) through the quintic phi (singular vectors
    # kept); the statistics are G G^T and G^T G plus beta times C's lower triangle mirrored. Well-conditioned inputs
    # (kappa 1e2) in float64: 1e-10 leaves room for kappa * 1e-16 rounding
    def roots():
        out = []
        for n, p, batch in ((1, 4, ()), (6, 1, ()), (37, 2, (3,)), (20, 4, (2, 2))):
            A = spd(n, g, torch.float64, "cpu", batch)
            X = torch_ops.inverse_root(A, p, 1e-6)
            eye = torch.eye(n, dtype=torch.float64)
            out.append(close(f"n {n} p {p}", torch.linalg.matrix_power(X, p) @ (A + 1e-6 * eye), eye.expand_as(A),
                             1e-10, 0))
            out.append(close(f"symmetric n {n}", X, X.mT, 1e-12, 0))
        return "; ".join(out)

    def ns():
        def phi(v, steps):
            for _ in range(steps):
                v = 3.4445 * v - 4.7750 * v ** 3 + 2.0315 * v ** 5
            return v
        out = []
        for shape, steps in (((5, 9), 5), ((2, 11, 6), 3), ((1, 17), 5), ((4, 4), 0)):
            G = torch.randn(*shape, generator=g, dtype=torch.float64)
            U, S, Vh = torch.linalg.svd(G, full_matrices=False)
            scale = torch.linalg.matrix_norm(G, keepdim=True) + 1e-7
            ref = (U * phi(S / scale[..., 0], steps).unsqueeze(-2)) @ Vh
            out.append(close(f"{shape} steps {steps}", torch_ops.newton_schulz(G, steps), ref, 1e-10, 1e-10))
        return "; ".join(out)

    def stats():
        G, C = torch.randn(3, 7, 5, generator=g, dtype=torch.float64), torch.randn(3, 7, 7, generator=g,
                                                                                  dtype=torch.float64)
        sym = C.tril() + C.tril(-1).mT
        return "; ".join([close("left", torch_ops.kron_stats(G, "left", C, 0.5, 0.9), 0.5 * G @ G.mT + 0.9 * sym,
                                1e-12, 1e-12),
                          close("right", torch_ops.kron_stats(G, "right"), G.mT @ G, 1e-12, 1e-12),
                          close("beta 0 ignores C", torch_ops.kron_stats(G, "left", C.fill_(float("nan")), 1.0, 0.0),
                                G @ G.mT, 1e-12, 1e-12)])

    run("inverse_root float64 CPU: X^p (A + eps I) = I, X symmetric (p 1, 2, 4; batches; n = 1)", roots)
    run("newton_schulz float64 CPU: singular values through the quintic, singular vectors kept", ns)
    run("kron_stats float64 CPU: G G^T, G^T G, beta C mirrored from its lower triangle, beta 0 never reads C", stats)


def check_errors(device):
    """A bad input to each op: the error type and a message that names the argument."""
    import torch
    import torch_ops
    ops = torch.ops.torch_ops
    f = dict(device=device)
    x4, w33 = torch.randn(2, 5, 5, 4, **f), torch.randn(3, 3, 4, 8, **f)
    gx, gw, gb = torch.randn(2, 3, 64, **f), torch.randn(64, **f), torch.randn(64, **f)
    V, T = ValueError, TypeError
    cases = [
        ("matmul a 1-D", lambda: ops.matmul(torch.randn(3, **f), torch.randn(3, 2, **f)), (V,), ["argument a", "2-D"]),
        ("matmul inner sizes", lambda: ops.matmul(torch.randn(3, 4, **f), torch.randn(5, 2, **f)), (V,),
         ["argument b", "a.shape[1] = 4"]),
        ("matmul int dtype", lambda: ops.matmul(torch.ones(3, 4, dtype=torch.int32, **f), torch.ones(4, 2, **f)),
         (T,), ["argument a", "Int"]),
        ("matmul b dtype differs", lambda: ops.matmul(torch.randn(3, 4, **f), torch.randn(4, 2, **f).double()), (T,),
         ["argument b", "like a"]),
        ("matmul strided b", lambda: ops.matmul(torch.randn(3, 4, **f), torch.randn(4, 6, **f)[:, ::2]), (V,),
         ["argument b", "row-major"]),
        ("softmax 0-D", lambda: ops.softmax(torch.tensor(1.0, **f)), (V,), ["argument x", "0-D"]),
        ("softmax non-contiguous", lambda: ops.softmax(torch.randn(4, 6, **f).t()), (V,),
         ["argument x", "contiguous"]),
        ("softmax int", lambda: ops.softmax(torch.ones(3, dtype=torch.int64, **f)), (T,), ["argument x", "Long"]),
        ("softmax float16: no kernel of ours", lambda: ops.softmax(torch.randn(3, 4, **f).half()),
         (NotImplementedError,), ["argument x", "Half", "kernels for"]),
        ("softmax_backward shapes", lambda: ops.softmax_backward(torch.randn(3, 5, **f), torch.randn(3, 4, **f)),
         (V,), ["argument grad_y", "shape"]),
        ("groupnorm channels", lambda: ops.groupnorm(torch.randn(2, 3, 48, **f), torch.ones(48, **f),
                                                     torch.zeros(48, **f)), (V,), ["argument x", "48 channels"]),
        ("groupnorm weight shape", lambda: ops.groupnorm(gx, torch.ones(32, **f), gb), (V,),
         ["argument weight", "[64]"]),
        ("groupnorm bias dtype", lambda: ops.groupnorm(gx, gw, gb.double()), (T,), ["argument bias", "like x"]),
        ("groupnorm 1-D x", lambda: ops.groupnorm(torch.randn(64, **f), gw, gb), (V,), ["argument x", "(B, ..., C)"]),
        ("groupnorm_backward mean shape", lambda: ops.groupnorm_backward(gx, gx, gw, gb, torch.zeros(2, 16, **f),
                                                                         torch.ones(2, 32, **f), False), (V,),
         ["argument mean", "(B, 32)"]),
        ("conv3x3 x 3-D", lambda: ops.conv3x3(torch.randn(5, 5, 4, **f), w33), (V,), ["argument x", "4-D"]),
        ("conv3x3 weight layout", lambda: ops.conv3x3(x4, torch.randn(8, 4, 3, 3, **f)), (V,),
         ["argument weight", "(3, 3, 4, Cout)", "permute"]),
        ("conv3x3 bias shape", lambda: ops.conv3x3(x4, w33, torch.randn(7, **f)), (V,), ["argument bias", "[8]"]),
        ("conv3x3 stride 3", lambda: ops.conv3x3(x4, w33, None, 3), (V,), ["argument stride", "1 or 2", "3"]),
        ("conv3x3 NCHW channels-last view", lambda: ops.conv3x3(torch.randn(2, 4, 5, 5, **f).permute(0, 2, 3, 1),
                                                                 w33), (V,), ["argument x", "contiguous"]),
        ("conv3x3_backward grad_y shape", lambda: ops.conv3x3_backward(torch.randn(2, 5, 5, 7, **f), x4, w33, 1,
                                                                       False),
         (V,), ["argument grad_y", "[2, 5, 5, 8]"]),
        ("inverse_root A 1-D", lambda: ops.inverse_root(torch.ones(4, **f), 4, 1e-6), (V,),
         ["argument A", "(..., n, n)"]),
        ("inverse_root A not square", lambda: ops.inverse_root(torch.ones(3, 4, **f), 4, 1e-6), (V,),
         ["argument A", "square", "[3, 4]"]),
        ("inverse_root p 3", lambda: ops.inverse_root(torch.eye(3, **f), 3, 1e-6), (V,), ["argument p", "1, 2 or 4"]),
        ("inverse_root eps 0", lambda: ops.inverse_root(torch.eye(3, **f), 4, 0.0), (V,), ["argument eps", "> 0"]),
        ("inverse_root eps NaN", lambda: ops.inverse_root(torch.eye(3, **f), 4, float("nan")), (V,),
         ["argument eps", "finite"]),
        ("inverse_root int", lambda: ops.inverse_root(torch.ones(3, 3, dtype=torch.int32, **f), 4, 1e-6), (T,),
         ["argument A", "Int"]),
        ("inverse_root float16: no kernel of ours", lambda: ops.inverse_root(torch.eye(3, **f).half(), 4, 1e-6),
         (NotImplementedError,), ["argument A", "Half"]),
        ("inverse_root transposed batch", lambda: ops.inverse_root(torch.eye(3, **f).expand(2, 3, 3).mT, 4, 1e-6),
         (V,), ["argument A", "contiguous"]),
        ("newton_schulz G 1-D", lambda: ops.newton_schulz(torch.ones(5, **f)), (V,), ["argument G", "(..., m, n)"]),
        ("newton_schulz steps -1", lambda: ops.newton_schulz(torch.ones(2, 5, **f), -1), (V,),
         ["argument steps", "-1"]),
        ("kron_stats side", lambda: ops.kron_stats(torch.ones(2, 5, **f), "up"), (V,), ["argument side", "up"]),
        ("kron_stats C shape", lambda: ops.kron_stats(torch.ones(2, 5, **f), "right", torch.zeros(2, 2, **f)), (V,),
         ["argument C", "[5, 5]", "right"]),
        ("kron_stats C dtype", lambda: ops.kron_stats(torch.ones(2, 5, **f), "left", torch.zeros(2, 2, **f).double()),
         (T,), ["argument C", "like G"]),
        ("kron_stats G 1-D", lambda: ops.kron_stats(torch.ones(5, **f), "left"), (V,), ["argument G"]),
    ]
    if device == "cuda":
        cpu = torch.randn(4, 2)
        cases += [
            ("matmul b on the CPU", lambda: ops.matmul(torch.randn(3, 4, **f), cpu), (RuntimeError,),
             ["argument b", "cpu", "like a"]),
            ("softmax float64 on CUDA: no kernel of ours", lambda: ops.softmax(torch.randn(3, 4, **f).double()),
             (NotImplementedError,), ["argument x", "Double", "on CUDA"]),
            ("groupnorm 2048 channels on CUDA", lambda: ops.groupnorm(torch.randn(1, 2, 2048, **f),
                                                                      torch.ones(2048, **f), torch.zeros(2048, **f)),
             (V,), ["argument x", "1024"]),
            ("inverse_root float64 on CUDA: no kernel of ours", lambda: ops.inverse_root(
                torch.eye(3, **f).double(), 4, 1e-6), (NotImplementedError,), ["argument A", "Double", "on CUDA"]),
            ("kron_stats C on the CPU", lambda: ops.kron_stats(torch.ones(2, 5, **f), "left", torch.zeros(2, 2)),
             (RuntimeError,), ["argument C", "cpu", "like G"]),
        ]
    for name, call, types, words in cases:
        run(f"bad input ({device}): {name}", lambda call=call, types=types, words=words: expect_error(call, types,
                                                                                                        words))
    run(f"bad input ({device}): torch_ops.groupnorm wrapper passes errors through",
        lambda: expect_error(lambda: torch_ops.groupnorm(gx, gw[:32], gb), (V,), ["argument weight"]))


# ---------------------------------------------------------------------------------------------------------------
# torch_ops.Shampoo against a plain Shampoo written out here: float64, one block at a time by slicing, statistics
# by @, roots by torch.linalg.eigh, then the grafting of torch_ops/shampoo.py (train_mnist's, dev/mnist_optimizers.py)

def plain_shampoo(params, grads_per_step, lr, momentum, weight_decay, epsilon, beta2, block, freq, graft,
                  graft_beta2=0.999, graft_eps=1e-8):
    """The parameters after len(grads_per_step) steps, and the largest condition number of a (L or R) + eps I."""
    import torch
    params = [p.detach().double().clone() for p in params]
    state = [{"L": {}, "R": {}, "Lr": {}, "Rr": {}, "buf": torch.zeros_like(p), "m": torch.zeros_like(p),
              "v": torch.zeros_like(p)} for p in params]
    kappa = 1.0

    def inv_4th_root(M):
        nonlocal kappa
        lam, V = torch.linalg.eigh(M + epsilon * torch.eye(M.shape[0], dtype=M.dtype))
        lam = lam.clamp_min(epsilon)
        kappa = max(kappa, float(lam.max() / lam.min()))
        return (V * lam ** -0.25) @ V.T

    for t, grads in enumerate(grads_per_step, 1):
        for w, g, st in zip(params, grads, state):
            g = g.double()
            if graft == "adam":
                st["m"] = momentum * st["m"] + (1 - momentum) * g
                st["v"] = graft_beta2 * st["v"] + (1 - graft_beta2) * g * g
                u = st["m"] / (1 - momentum ** t)
                d = u / ((st["v"] / (1 - graft_beta2 ** t)).sqrt() + graft_eps)
            else:
                u, d = g, g + weight_decay * w
            rows = w.shape[0] if w.dim() else 1
            G, U, D = g.reshape(rows, -1), u.reshape(rows, -1), d.reshape(rows, -1)
            S = torch.zeros_like(G)
            for i in range(0, G.shape[0], block):
                for j in range(0, G.shape[1], block):
                    rs, cs, k = slice(i, i + block), slice(j, j + block), (i, j)
                    b = G[rs, cs]
                    if beta2 == 1.0:
                        st["L"][k] = st["L"].get(k, 0) + b @ b.T
                        st["R"][k] = st["R"].get(k, 0) + b.T @ b
                    else:
                        st["L"][k] = beta2 * st["L"].get(k, 0) + (1 - beta2) * b @ b.T
                        st["R"][k] = beta2 * st["R"].get(k, 0) + (1 - beta2) * b.T @ b
                    if (t - 1) % freq == 0:
                        st["Lr"][k], st["Rr"][k] = inv_4th_root(st["L"][k]), inv_4th_root(st["R"][k])
                    s = st["Lr"][k] @ U[rs, cs] @ st["Rr"][k]
                    S[rs, cs] = s * (D[rs, cs].norm() / s.norm())
            S = S.reshape(w.shape)
            if graft == "adam":
                w.mul_(1 - lr * weight_decay).sub_(lr * S)
            else:
                st["buf"] = momentum * st["buf"] + S
                w.sub_(lr * st["buf"])
    return params, kappa


def check_shampoo_cpu():
    """Five steps of torch_ops.Shampoo in float32 on the CPU against plain_shampoo in float64, for shapes that make
    all four block classes (37 x 23 in blocks of 16), a conv weight (6, 3, 3, 3) -> (6, 27), a bias (n, 1) and a
    scalar; roots at steps 1, 3, 5. fp32 tolerance: a root of a matrix of condition number kappa is off by about
    u kappa / 4 (u = 2^-24) in float32, and each step moves a weight by lr |D| <= lr |grad| (grafting): |err| <=
    steps * lr * 8 u kappa * max|grad| (2x margin over u kappa / 4 in D, and D's own fp32 products), + 1e-6 for
    the float32 sums of the weights."""
    import torch
    import torch_ops
    g = torch.Generator().manual_seed(11)
    shapes = [(37, 23), (6, 3, 3, 3), (5,), ()]
    out = []
    for graft, momentum, wd, beta2 in (("sgd", 0.9, 0.0, 1.0), ("adam", 0.5, 0.1, 0.95), ("sgd", 0.0, 0.01, 1.0)):
        params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
        init = [p.detach().clone() for p in params]
        grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]
        lr, eps = 0.1, 1e-1
        opt = torch_ops.Shampoo(params, lr=lr, momentum=momentum, weight_decay=wd, epsilon=eps, beta2=beta2,
                                max_preconditioner_dim=16, precondition_frequency=2, graft=graft)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            opt.step()
        ref, kappa = plain_shampoo(init, grads, lr, momentum, wd, eps, beta2, 16, 2, graft)
        gmax = max(float(gr.abs().max()) for step_grads in grads for gr in step_grads)
        atol = 1e-6 + 5 * lr * 8 * 2.0 ** -24 * kappa * gmax
        for i, (p, r) in enumerate(zip(params, ref)):
            out.append(close(f"{graft} param {i}", p, r, atol, 0))
        out.append(f"{graft}: kappa {kappa:.0f}, atol {atol:.1e}")
    return "; ".join(out)


def check_shampoo_args():
    import torch
    import torch_ops
    w = [torch.zeros(3, 3, requires_grad=True)]
    for name, value, words in (("precondition_frequency", 0, ["precondition_frequency", ">= 1"]),
                               ("max_preconditioner_dim", 0, ["max_preconditioner_dim", "0"]),
                               ("epsilon", -1e-6, ["epsilon", "> 0"]), ("graft", "sdg", ["graft", "sgd or adam"]),
                               ("momentum", 1.0, ["momentum", "[0, 1)"]), ("beta2", 0.0, ["beta2", "(0, 1]"]),
                               ("lr", -0.1, ["lr", ">= 0"])):
        run(f"torch_ops.Shampoo {name}={value!r} is refused, naming the argument",
            lambda name=name, value=value, words=words: expect_error(
                lambda: torch_ops.Shampoo(w, **{name: value}), (ValueError,), ["torch_ops.Shampoo"] + words))


class SmallNet:
    """conv3x3 -> groupnorm+SiLU -> conv3x3 stride 2 -> flatten -> matmul -> softmax, all on torch_ops."""

    def __init__(self, device, dtype, seed=4):
        import torch
        g = torch.Generator().manual_seed(seed)

        def p(*shape, scale):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype).requires_grad_()

        self.w1, self.b1 = p(3, 3, 3, 32, scale=27 ** -0.5), p(32, scale=0.1)
        self.g1, self.n1 = p(32, scale=0.1), p(32, scale=0.1)
        self.w2, self.b2 = p(3, 3, 32, 32, scale=288 ** -0.5), p(32, scale=0.1)
        self.fc = p(4 * 4 * 32, 10, scale=512 ** -0.5)
        self.params = [self.w1, self.b1, self.g1, self.n1, self.w2, self.b2, self.fc]

    def __call__(self, x):
        import torch_ops
        h = torch_ops.conv3x3(x, self.w1, self.b1)
        h = torch_ops.groupnorm(h, self.g1 + 1.0, self.n1, silu=True)
        h = torch_ops.conv3x3(h, self.w2, self.b2, stride=2)
        return torch_ops.softmax(torch_ops.matmul(h.reshape(h.shape[0], -1), self.fc))


def check_compile(device):
    """torch.compile(fullgraph=True): a graph break would raise. The compiled loss and gradients must match eager
    (float32; the same kernels run, only their order and PyTorch's glue may change: atol 1e-5, rtol 1e-4)."""
    import torch
    net = SmallNet(device, torch.float32)
    x = torch.randn(3, 8, 8, 3, generator=torch.Generator().manual_seed(5)).to(device)
    target = torch.randn(3, 10, generator=torch.Generator().manual_seed(6)).to(device)

    def loss_fn(x):
        return ((net(x) - target) ** 2).sum()

    def loss_and_grads(fn):
        for p in net.params:
            p.grad = None
        loss = fn(x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in net.params]

    torch._dynamo.reset()
    t0 = time.time()
    compiled = torch.compile(loss_fn, fullgraph=True)
    loss_c, grads_c = loss_and_grads(compiled)
    secs = time.time() - t0
    loss_e, grads_e = loss_and_grads(loss_fn)
    out = [close("loss", loss_c, loss_e, 1e-5, 1e-4)]
    out += [close(f"grad {i}", a, b, 1e-5, 1e-4) for i, (a, b) in enumerate(zip(grads_c, grads_e))]
    return f"compiled forward + backward in {secs:.1f} s, no graph break; loss {out[0]}"


def check_cnn_custom(device):
    """dev/cnn_custom.py on a slice of MNIST: the CNN on our matmul (convolutions through unfold) trains as the stock
    PyTorch one from the same weights on the same batches. Strict fp32 on both sides; 4 steps of float32 sums in
    another order leave the mean training loss within 1e-4 relative."""
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.join(ROOT, "dev", "cnn_custom.py"), "--device", device, "--train_limit", "256",
               "--test_limit", "200", "--epochs", "1", "--modes", "torch,ours", "--tf32", "0", "--out", tmp]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise AssertionError(f"exit {p.returncode}: {(p.stdout + p.stderr).strip()[-500:]}")
        rows = {r["mode"]: r for r in json.load(open(os.path.join(tmp, "cnn_custom.json")))["rows"]}
    lt, lo = rows["torch"]["train_loss"][-1], rows["ours"]["train_loss"][-1]
    at, ao = rows["torch"]["test_accuracy"], rows["ours"]["test_accuracy"]
    if abs(lo - lt) > 1e-4 * abs(lt) or abs(ao - at) > 1.0:
        raise AssertionError(f"ours: loss {lo:.6f}, accuracy {ao:.1f}%; torch: loss {lt:.6f}, accuracy {at:.1f}%")
    return f"train loss {lo:.6f} (torch {lt:.6f}), test accuracy {ao:.1f}% (torch {at:.1f}%)"


def check_shampoo_bench(device):
    """dev/shampoo_bench.py --quick: the write-up's Shampoo (eigh roots every 10 steps), ours and SGD train the small
    MLP for 30 steps from the same weights; each must finish with a finite loss below the first step's (2.3, ln 10)
    and write its row. The accuracies are the benchmark's output, not checked beyond that."""
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.join(ROOT, "dev", "shampoo_bench.py"), "--quick", "--out", tmp]
        if device == "cuda":
            cmd += ["--device", "cuda"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise AssertionError(f"exit {p.returncode}: {(p.stdout + p.stderr).strip()[-500:]}")
        rows = {r["mode"]: r for r in json.load(open(os.path.join(tmp, "shampoo_bench.json")))["rows"]}
    if sorted(rows) != ["ours", "sgd", "writeup"]:
        raise AssertionError(f"rows {sorted(rows)}, expected ours, sgd, writeup")
    for mode, r in rows.items():
        if r["steps"] != 30 or not r["final_loss"] < r["losses"][0]:
            raise AssertionError(f"{mode}: {r['steps']} steps, loss {r['losses'][0]:.4f} -> {r['final_loss']:.4f}")
    return "; ".join(f"{m} loss {r['losses'][0]:.3f} -> {r['final_loss']:.3f}, {r['test_accuracy']:.1f}%, "
                     f"{r['ms_median']:.1f} ms/step" for m, r in sorted(rows.items()))


# ---------------------------------------------------------------------------------------------------------------
# CUDA checks (a GPU, and the library built with its CUDA kernels)

def check_gradcheck_cuda():
    """float32 on the GPU (the kernels are fp32 only). Central differences with eps 1e-2 on O(1) inputs: the fp32
    rounding of f (a few ulp of |f| <= ~10, i.e. <= ~5e-6) divided by 2 eps gives <= ~3e-4; the truncation error
    eps^2 / 6 * |f'''| is <= ~2e-5 for these smooth ops (matmul and conv are linear: 0). atol 2e-3, rtol 1e-2 hold
    both with margin; strict fp32 (tf32=False) everywhere."""
    import torch
    import torch_ops
    g = torch.Generator().manual_seed(7)

    def t(*shape, shift=0.0, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale + shift).cuda().requires_grad_()

    def gc(fn, inputs):
        return str(torch.autograd.gradcheck(fn, inputs, eps=1e-2, atol=2e-3, rtol=1e-2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradcheck warns that the inputs are not float64: that is the point here
        run("gradcheck matmul float32 CUDA", lambda: gc(torch_ops.matmul, (t(7, 5), t(5, 3))))
        run("gradcheck softmax float32 CUDA", lambda: gc(torch_ops.softmax, (t(3, 9),)))
        for silu in (False, True):
            run(f"gradcheck groupnorm silu={silu} float32 CUDA",
                lambda silu=silu: gc(lambda x, w, b: torch_ops.groupnorm(x, w, b, silu),
                                     (t(2, 2, 64, shift=0.5), t(64, shift=1.0), t(64))))
        for stride in (1, 2):
            run(f"gradcheck conv3x3 stride {stride} float32 CUDA",
                lambda stride=stride: gc(lambda x, w, b: torch_ops.conv3x3(x, w, b, stride),
                                         (t(1, 5, 4, 3), t(3, 3, 3, 2, scale=0.2), t(2))))


def check_cuda_vs_reference():
    """Our CUDA kernels against a float64 reference computed by PyTorch, with the tolerance each lab file holds its
    kernels to (dev/matmul.cu, dev/softmax_forward.cu, dev/softmax_backward.cu, dev/groupnorm.cu, dev/conv2d.cu),
    and PyTorch's fp32 kernels (TF32 off) to the same bound."""
    import torch
    import torch_ops
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(8)
    u = 2.0 ** -24  # fp32 unit roundoff

    def t(*shape, shift=0.0, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale + shift).cuda()

    # matmul: a sum of K products in fp32 is off by <= K u sum|a b| (any order); TF32 rounds each operand to
    # 11 significant bits (2 * 2^-11 per product); bf16 results are rounded once (2^-8 of |ref|)
    # (64, 512, 96), (200, 264, 128) and (1024, 1024, 1024) reach version 8 in bf16 (TMA-ready row strides)
    for M, N, K in ((1, 1, 1), (37, 23, 19), (129, 65, 257), (300, 7, 1000), (64, 512, 96), (200, 264, 128),
                    (1024, 1024, 1024)):
        for ta, tb in ((False, False), (True, False), (False, True), (True, True)):
            def mm(M=M, N=N, K=K, ta=ta, tb=tb):
                a = t(K, M).t() if ta else t(M, K)
                b = t(N, K).t() if tb else t(K, N)
                ref = a.double() @ b.double()
                mag = a.double().abs() @ b.double().abs()
                out = [close("fp32", torch_ops.matmul(a, b), ref, 1e-30, 2 * K * u, mag),
                       close("torch fp32", a @ b, ref, 1e-30, 2 * K * u, mag),
                       close("tf32", torch_ops.matmul(a, b, tf32=True), ref, 1e-30, 2 * 2.0 ** -11 + 2 * K * u, mag)]
                ab, bb = a.bfloat16(), b.bfloat16()
                refb = ab.double() @ bb.double()
                magb = ab.double().abs() @ bb.double().abs()
                out.append(close("bf16", torch_ops.matmul(ab, bb), refb, 1e-30, 2.0 ** -8 + 2 * K * u, magb))
                return "; ".join(out)
            run(f"matmul CUDA {M}x{N}x{K} {'T' if ta else 'N'}{'T' if tb else 'N'} vs float64 (fp32, tf32, bf16)", mm)

    # softmax forward: atol 1e-10, rtol 8e-6 + 2 eps sqrt(cols) (dev/softmax_forward.cu); -inf gives exact 0, a row
    # of -inf or holding +inf/NaN gives NaN, as torch.softmax. Backward: atol 1e-6, rtol 2e-6.
    eps = 2.0 ** -23
    for rows, cols in ((1, 1), (7, 3), (33, 129), (5, 1000), (3, 4097), (2, 65537), (1000, 128), (257, 33)):
        def sm(rows=rows, cols=cols):
            x = t(rows, cols, scale=3.0)
            if rows >= 3:
                x[0] = -float("inf")
                x[1, ::3] = -float("inf")
                x[2, cols // 2] = float("nan")
            y = torch_ops.softmax(x)
            ref = torch.softmax(x.double(), -1)
            rtol = 8e-6 + 2 * eps * cols ** 0.5
            out = [close("ours", y, ref, 1e-10, rtol), close("torch.softmax", torch.softmax(x, -1), ref, 1e-10, rtol)]
            if rows >= 3 and not bool((y[1, ::3] == 0).all()):
                raise AssertionError("-inf inputs must give exact 0")
            dy = t(rows, cols)
            yk = torch.softmax(x, -1)
            dref = torch._softmax_backward_data(dy.double(), yk.double(), -1, torch.float64)
            out.append(close("backward", torch.ops.torch_ops.softmax_backward(dy, yk), dref, 1e-6, 2e-6))
            return "; ".join(out)
        run(f"softmax CUDA {rows}x{cols} vs float64 (forward with -inf, NaN rows; backward)", sm)

    # GroupNorm: |err| <= rel * (max|ref| + |ref|), rel 1e-5 for y, 1e-4 for dx, 1e-5 for dweight and dbias
    # (dev/groupnorm.cu: fp32 elementwise math on O(1) values with double sums)
    for shape, silu in (((3, 7, 7, 64), True), ((2, 37, 96), False), ((5, 8, 8, 448), True), ((1, 7, 32), True),
                        ((4, 10, 10, 320), False), ((2, 3, 1024), True)):
        def gn(shape=shape, silu=silu):
            C = shape[-1]
            x, w, b = t(*shape, shift=0.5), t(C, scale=0.3, shift=1.0), t(C, scale=0.3)
            dy = t(*shape)
            y, mean, rstd = torch.ops.torch_ops.groupnorm(x, w, b, silu)
            dx, dw, db = torch.ops.torch_ops.groupnorm_backward(dy, x, w, b, mean, rstd, silu)
            xr, wr, br = (v.double().requires_grad_() for v in (x, w, b))
            yr = gn_reference(xr, wr, br, silu)
            yr.backward(dy.double())
            out = []
            for name, got, ref, rel in (("y", y, yr, 1e-5), ("dx", dx, xr.grad, 1e-4), ("dweight", dw, wr.grad, 1e-5),
                                        ("dbias", db, br.grad, 1e-5)):
                out.append(close(name, got, ref, rel * float(ref.detach().abs().max()), rel))
            return "; ".join(out)
        run(f"groupnorm CUDA {shape} silu={silu} vs float64 F.group_norm (y, dx, dweight, dbias)", gn)

    # conv: |err| <= rtol * sum|products| per element, 1e-5 strict fp32, 2e-3 TF32 (dev/conv2d.cu)
    for B, H, W, cin, cout, s in ((3, 7, 5, 3, 37, 1), (2, 9, 9, 40, 3, 1), (3, 7, 7, 64, 96, 1), (2, 9, 11, 96, 64, 2),
                                  (2, 13, 6, 20, 12, 2), (3, 10, 10, 160, 36, 1), (2, 9, 7, 64, 3, 1),
                                  (2, 6, 5, 8, 1100, 1)):
        for tf32 in (False, True):
            def conv(B=B, H=H, W=W, cin=cin, cout=cout, s=s, tf32=tf32):
                x, w, b = t(B, H, W, cin), t(3, 3, cin, cout, scale=(9 * cin) ** -0.5), t(cout)
                y = torch_ops.conv3x3(x, w, b, s, tf32)
                dy = t(*y.shape)
                dx, dw, db = torch.ops.torch_ops.conv3x3_backward(dy, x, w, s, tf32)
                xr, wr, br = (v.double().requires_grad_() for v in (x, w, b))
                yr = conv_reference(xr, wr, br, s)
                yr.backward(dy.double())
                ymag = conv_reference(xr.detach().abs(), wr.detach().abs(), br.detach().abs(), s)
                xa, wa, dya = (v.detach().abs().requires_grad_() for v in (xr, wr, dy.double()))
                conv_reference(xa, wa, None, s).backward(dya)
                dbmag = dy.double().abs().sum((0, 1, 2))
                rt = 2e-3 if tf32 else 1e-5
                return "; ".join([close("y", y, yr, 1e-30, rt, ymag), close("dx", dx, xr.grad, 1e-30, rt, xa.grad),
                                  close("dweight", dw, wr.grad, 1e-30, rt, wa.grad),
                                  close("dbias", db, br.grad, 1e-30, 1e-5, dbmag)])
            run(f"conv3x3 CUDA B{B} {H}x{W} {cin}->{cout} stride {s} {'tf32' if tf32 else 'fp32'} vs float64 "
                "F.conv2d (y, dx, dweight, dbias)", conv)


def check_cuda_second_order():
    """inverse_root, newton_schulz and kron_stats on CUDA against float64 references, with dev/matrix_roots.cu's
    tolerances (root_tolerance, the Newton-Schulz and statistics checks of its --test); a side stream; Shampoo's
    GPU path against its CPU path."""
    import torch
    import torch_ops
    g = torch.Generator().manual_seed(12)
    u = 2.0 ** -24

    def root_ref(A, p, eps):
        lam, V = torch.linalg.eigh(A.double() + eps * torch.eye(A.shape[-1], dtype=torch.float64))
        return (V * lam.clamp_min(eps).pow(-1.0 / p).unsqueeze(-2)) @ V.mT, float((lam.max() / lam.min()))

    # relative Frobenius error per matrix <= the lab's Newton tolerance for the versions the op picks: 3xTF32 Newton
    # (version 3 for n <= 128, or version 2's fp32 where version 3 does not fit; version 1 above)
    # u (4 sqrt(n) + 0.06 n kappa / p)
    for n, batch, p, kappa in ((1, (), 4, 1.0), (37, (), 4, 1e2), (100, (5,), 1, 1e2), (128, (2, 3), 2, 1e2),
                               (129, (), 4, 1e2), (300, (2,), 2, 1e2), (24, (64,), 4, 35.0)):
        def one(n=n, batch=batch, p=p, kappa=kappa):
            A = spd(n, g, torch.float32, "cpu", batch, kappa)
            ref, kap = root_ref(A, p, 1e-6)
            X = torch_ops.inverse_root(A.cuda(), p, 1e-6).cpu().double()
            err = torch.linalg.matrix_norm(X - ref) / torch.linalg.matrix_norm(ref)
            sn = n ** 0.5
            tol = u * (4 * sn + 0.06 * n * kap / p)
            if n == 1:
                # the scalar iteration (dev/matrix_roots.cu's newton_scalar_tolerance): (2 + 8 p) u / p at the
                # start, (2 K + 1) u over K <= 8 steps, the stopping rule's truncation <= 1e-6: < 45 u; 2x margin
                tol = 90 * u
            if not bool((err <= tol).all()):
                raise AssertionError(f"relative error {float(err.max()):.3e} > {tol:.3e} (kappa {kap:.1f})")
            return f"max relative error {float(err.max()):.2e} <= {tol:.2e} (kappa {kap:.1f})"
        run(f"inverse_root CUDA n {n} batch {batch} p {p} vs float64 eigh", one)

    def singular():
        # rank-deficient A: eps regularises; the result is X for A + eps I within version 0's bound at kappa_eff
        n = 70
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        d = torch.cat([torch.logspace(0, -2, n - 10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)])
        A = ((q * d) @ q.T).float()
        ref, kap = root_ref(A, 4, 1e-3)
        X = torch_ops.inverse_root(A.cuda(), 4, 1e-3).cpu().double()
        err = float(torch.linalg.matrix_norm(X - ref) / torch.linalg.matrix_norm(ref))
        sn = n ** 0.5
        c_e = 1 + max(8, 2 * sn) + 2 * sn
        tol = max(2 ** 0.5 * c_e * u * kap / 4 + u * (4 * sn + 4), u * (4 * sn + 0.06 * n * kap / 4))
        if not err <= tol:
            raise AssertionError(f"relative error {err:.3e} > {tol:.3e} (kappa_eff {kap:.0f})")
        return f"relative error {err:.2e} <= {tol:.2e} (kappa_eff {kap:.0f})"

    run("inverse_root CUDA, singular A (10 zero eigenvalues) with eps 1e-3", singular)

    def ns_twin(G, steps):
        """Muon's iteration with the GPU's roundings: X, A, B stored in bf16, products and sums in fp32."""
        tall = G.shape[-2] > G.shape[-1]
        X = G.mT if tall else G
        X = (X / (torch.linalg.matrix_norm(X.double(), keepdim=True) + 1e-7).float()).bfloat16()
        for _ in range(steps):
            A = (X.float() @ X.float().mT).bfloat16()
            B = (2.0315 * (A.float() @ A.float()) - 4.7750 * A.float()).bfloat16()
            X = (B.float() @ X.float() + 3.4445 * X.float()).bfloat16()
        return (X.mT if tall else X).double()

    # within 3x the bf16 twin's error against the float64 run, at least 4 bf16 ulps (dev/matrix_roots.cu's check)
    for shape, steps in (((1024, 1024), 5), ((300, 77), 5), ((8, 64, 130), 5), ((1, 17), 5), ((33, 33), 2)):
        def ns(shape=shape, steps=steps):
            G = torch.randn(shape, generator=g)
            ref = torch_ops.newton_schulz(G.double(), steps)
            got = torch_ops.newton_schulz(G.cuda(), steps).cpu().double()

            def rel(x):
                return float((torch.linalg.matrix_norm(x - ref) / torch.linalg.matrix_norm(ref)).max())
            tol = max(3 * rel(ns_twin(G, steps)), 4 * 2.0 ** -8)
            if not rel(got) <= tol:
                raise AssertionError(f"relative error {rel(got):.3e} > {tol:.3e}")
            return f"relative error {rel(got):.2e} <= {tol:.2e}"
        run(f"newton_schulz CUDA {shape} steps {steps} vs float64 (bf16 twin bound)", ns)

    # |err| <= gamma_{K+4} (|alpha| |G| |G|^T + |beta C|) per element (any fp32 summation order), exact symmetry
    for shape, side, beta in (((37, 70), "left", 0.0), ((37, 70), "right", 0.9), ((5, 129, 64), "left", 1.0),
                              ((3, 2, 1, 100), "right", 0.5), ((200, 3), "left", 0.0)):
        def ks(shape=shape, side=side, beta=beta):
            G = torch.randn(shape, generator=g)
            N = shape[-2] if side == "left" else shape[-1]
            C0 = torch.randn(*shape[:-2], N, N, generator=g)
            C = C0 + C0.mT
            got = torch_ops.kron_stats(G.cuda(), side, C.cuda() if beta else None, 0.3, beta).cpu().double()
            Gd = G.double()
            P = Gd @ Gd.mT if side == "left" else Gd.mT @ Gd
            Pa = Gd.abs() @ Gd.abs().mT if side == "left" else Gd.abs().mT @ Gd.abs()
            ref, mag = 0.3 * P + beta * C.double(), 0.3 * Pa + abs(beta) * C.double().abs()
            K = shape[-1] if side == "left" else shape[-2]
            gamma = (K + 4) * u / (1 - (K + 4) * u)
            if not torch.equal(got, got.mT):
                raise AssertionError("not exactly symmetric")
            return close("kron_stats", got, ref, 1e-30, gamma, mag)
        run(f"kron_stats CUDA {shape} {side} beta {beta} vs float64, exactly symmetric", ks)

    def side_stream():
        s = torch.cuda.Stream()
        A = spd(64, g, torch.float32, "cpu", (3,)).cuda()
        G = torch.randn(3, 40, 64, generator=g).cuda()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            X = torch_ops.inverse_root(A, 4, 1e-6)
            L = torch_ops.kron_stats(G, "right")
            O = torch_ops.newton_schulz(G)
        s.synchronize()
        ref, _ = root_ref(A.cpu(), 4, 1e-6)
        err = float((torch.linalg.matrix_norm(X.cpu().double() - ref) / torch.linalg.matrix_norm(ref)).max())
        if not err < 1e-4:
            raise AssertionError(f"inverse_root on a side stream: relative error {err:.2e}")
        Gd = G.cpu().double()
        out = [close("kron_stats", L, Gd.mT @ Gd, 1e-3, 1e-4)]
        if not bool(torch.isfinite(O).all()):
            raise AssertionError("newton_schulz on a side stream: non-finite output")
        return f"inverse_root relative error {err:.1e}; " + "; ".join(out)

    run("inverse_root, kron_stats, newton_schulz on a side stream", side_stream)

    def shampoo_gpu_vs_cpu():
        # the GPU path (Newton roots, SYRK statistics) against the CPU path (eigh, PyTorch products) over 5 steps,
        # as check_shampoo_cpu: fp32 roots differ by about u kappa / 4 -> |err| <= steps lr 8 u kappa max|grad|
        shapes = [(37, 23), (6, 3, 3, 3), (5,), ()]
        out = []
        for graft in ("sgd", "adam"):
            params = [torch.randn(sh, generator=g) for sh in shapes]
            grads = [[torch.randn(sh, generator=g) for sh in shapes] for _ in range(5)]
            finals = []
            for dev in ("cpu", "cuda"):
                ps = [p.clone().to(dev).requires_grad_() for p in params]
                opt = torch_ops.Shampoo(ps, lr=0.1, epsilon=0.1, max_preconditioner_dim=16, precondition_frequency=2,
                                        graft=graft, weight_decay=0.01)
                for step_grads in grads:
                    for p, gr in zip(ps, step_grads):
                        p.grad = gr.to(dev)
                    opt.step()
                finals.append([p.detach().cpu() for p in ps])
            _, kappa = plain_shampoo(params, grads, 0.1, 0.9, 0.01, 0.1, 1.0, 16, 2, graft)
            gmax = max(float(gr.abs().max()) for step_grads in grads for gr in step_grads)
            atol = 1e-6 + 5 * 0.1 * 8 * u * kappa * gmax
            out += [close(f"{graft} param {i}", a, b, atol, 0) for i, (a, b) in enumerate(zip(finals[1], finals[0]))]
        return "; ".join(out)

    run("torch_ops.Shampoo CUDA vs CPU: 5 steps (sgd and adam grafting)", shampoo_gpu_vs_cpu)


def check_cuda_misc():
    import torch
    import torch_ops

    def side_stream():
        # the ops launch on the current stream: results written on a side stream are there after it syncs
        s = torch.cuda.Stream()
        x = torch.randn(513, 257, device="cuda")
        a, b = torch.randn(300, 200, device="cuda"), torch.randn(200, 100, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            y = torch_ops.softmax(x)
            c = torch_ops.matmul(a, b)
        s.synchronize()
        return "; ".join([close("softmax", y, torch.softmax(x.double(), -1), 1e-10, 3e-5),
                          close("matmul", c, a.double() @ b.double(), 1e-30, 400 * 2.0 ** -24,
                                a.double().abs() @ b.double().abs())])

    run("CUDA ops on a side stream (torch.cuda.stream)", side_stream)

    def unaligned():
        # a slice that starts 4 bytes off a 16-byte boundary: the UNet layers get an aligned copy
        base = torch.randn(1 + 2 * 5 * 5 * 32, device="cuda")
        x = base[1:].view(2, 5, 5, 32)
        w, b = torch.rand(32, device="cuda") + 0.5, torch.randn(32, device="cuda")
        y = torch_ops.groupnorm(x, w, b, True)
        return close("groupnorm", y, gn_reference(x.double(), w.double(), b.double(), True), 1e-5 * 4, 1e-5)

    run("groupnorm CUDA on an unaligned slice", unaligned)

    def empty():
        out = [tuple(torch_ops.softmax(torch.randn(0, 5, device="cuda")).shape),
               tuple(torch_ops.matmul(torch.randn(0, 5, device="cuda"), torch.randn(5, 3, device="cuda")).shape)]
        z = torch_ops.matmul(torch.randn(4, 0, device="cuda"), torch.randn(0, 3, device="cuda"))
        if not bool((z == 0).all()):
            raise AssertionError("K = 0 must give zeros")
        return f"shapes {out}, K = 0 gives zeros"

    run("CUDA empty inputs", empty)


def main():
    try:
        import torch
    except ImportError as e:
        for name in GROUPS:
            report("SKIP", name, f"PyTorch is not importable ({e}); pip install torch")
        return closing()
    sys.path.insert(0, PROJECT)
    t0 = time.time()
    try:
        import torch_ops  # noqa: F401  (builds on the first import)
    except Exception as e:
        report("FAIL", "build and import", f"{type(e).__name__}: {str(e).strip()[-1500:]}")
        return closing()
    print(f"torch {torch.__version__}, torch_ops {torch_ops.BUILD_INFO['variant']} library, import "
          f"{time.time() - t0:.1f} s", flush=True)
    run("build and import", check_build)
    if torch_ops.BUILD_INFO["variant"] == "cuda":
        run("CPU-only build (TORCH_OPS_CUDA=0)", check_cpu_only_build)
    for dtype in (torch.float64, torch.float32):
        check_opcheck("cpu", dtype)
    run("opcheck matmul cpu bfloat16", lambda: str(torch.library.opcheck(
        torch.ops.torch_ops.matmul, (torch.randn(5, 7).bfloat16(), torch.randn(7, 3).bfloat16()))))
    check_gradcheck_cpu()
    check_cpu_vs_torch()
    check_errors("cpu")
    run("torch_ops.Shampoo (CPU, float32): 5 steps equal a plain float64 Shampoo (blocks, grafting sgd/adam, "
        "momentum, weight decay, beta2)", check_shampoo_cpu)
    check_shampoo_args()
    if torch.cuda.is_available() and os.environ.get("TORCH_OPS_CPU_COMPILE") != "1":
        # 80 s of C++ compilation on the GPU machine, where the round must stay within 10 minutes
        report("SKIP", "torch.compile fullgraph (CPU)", "a GPU is present: the CUDA compile runs below and CI (no "
               "GPU) runs this one; TORCH_OPS_CPU_COMPILE=1 runs it here too")
    else:
        run("torch.compile fullgraph (CPU): small model on the ops, forward + backward vs eager",
            lambda: check_compile("cpu"))
    run("dev/cnn_custom.py (CPU): the MNIST CNN on our matmul trains as stock PyTorch", lambda: check_cnn_custom("cpu"))
    run("dev/shampoo_bench.py --quick (CPU): the write-up's Shampoo, ours and SGD train",
        lambda: check_shampoo_bench("cpu"))
    if not torch.cuda.is_available():
        report("SKIP", "CUDA checks", "no CUDA GPU (torch.cuda.is_available() is False)")
        return closing()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("torch_ops::softmax", "CUDA"):
        report("FAIL", "CUDA checks", f"a GPU is present but the library has no CUDA kernels "
                                      f"({torch_ops.BUILD_INFO['why']})")
        return closing()
    check_opcheck("cuda", torch.float32)
    run("opcheck matmul cuda bfloat16", lambda: str(torch.library.opcheck(
        torch.ops.torch_ops.matmul, (torch.randn(5, 7).bfloat16().cuda(), torch.randn(7, 3).bfloat16().cuda()))))
    check_gradcheck_cuda()
    check_cuda_vs_reference()
    check_cuda_second_order()
    check_cuda_misc()
    check_errors("cuda")
    run("torch.compile fullgraph (CUDA): small model on the ops, forward + backward vs eager",
        lambda: check_compile("cuda"))
    run("dev/cnn_custom.py (CUDA): the MNIST CNN on our matmul trains as stock PyTorch",
        lambda: check_cnn_custom("cuda"))
    run("dev/shampoo_bench.py --quick --device cuda: the write-up's Shampoo, ours and SGD train",
        lambda: check_shampoo_bench("cuda"))
    return closing()


if __name__ == "__main__":
    sys.exit(main())
