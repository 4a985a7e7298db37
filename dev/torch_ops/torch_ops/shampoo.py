"""Shampoo as a torch.optim.Optimizer on the project's second-order ops (issue 21's Shampoo, issue 22 item 5).

Each parameter is seen as a matrix (m, n): its first dimension by the product of the others (a vector is (n, 1), a
scalar (1, 1)), cut into blocks of at most max_preconditioner_dim x max_preconditioner_dim. Per block G of the
gradient, every step:
    L <- beta2 L + (1 - beta2) G G^T,  R <- beta2 R + (1 - beta2) G^T G       (beta2 = 1: plain sums, L += G G^T)
on torch_ops.kron_stats (one triangle computed, mirrored), and every precondition_frequency steps (the first step
included) the inverse 4th roots (L + epsilon I)^(-1/4) and (R + epsilon I)^(-1/4) on torch_ops.inverse_root. The step
is grafted, block by block, onto SGD with momentum or Adam, as train_mnist's Shampoo does (dev/mnist_optimizers.py):
    "sgd":  d = g + weight_decay w; S = L^-1/4 G R^-1/4 scaled to d's Frobenius norm on the block;
            buf <- momentum buf + S (S itself when momentum = 0); w <- w - lr buf.
    "adam": m <- momentum m + (1 - momentum) g, v <- graft_beta2 v + (1 - graft_beta2) g^2 (momentum is Adam's
            beta1), u = m / (1 - momentum^t), d = u / (sqrt(v / (1 - graft_beta2^t)) + graft_eps);
            S = L^-1/4 u R^-1/4 scaled to d's norm on the block; w <- w (1 - lr weight_decay) - lr S (decoupled).
A block whose preconditioned direction vanishes takes no step. Blocks of the same shape in one parameter go to the
ops as one batch. On the CPU the same ops run their CPU kernels (eigh-based roots), so the optimizer runs wherever
the parameters are.
"""
import torch

from . import inverse_root, kron_stats

GRAFTS = ("sgd", "adam")


def _matrix_shape(p):
    """The (m, n) matrix a parameter is preconditioned as."""
    if p.dim() == 0:
        return 1, 1
    return p.shape[0], (p.numel() // p.shape[0] if p.shape[0] else 0)


def _block_classes(m, n, d):
    """Blocks of at most d x d of an m x n matrix, grouped by shape: a list of (r0, r1, bh, c0, c1, bw), the row range
    [r0, r1) cut into rows of bh and the column range [c0, c1) into columns of bw (each range a whole number of
    blocks)."""
    def ranges(size):
        full = size // d * d
        out = [(0, full, d)] if full else []
        return out + ([(full, size, size - full)] if size > full else [])
    return [(r0, r1, bh, c0, c1, bw) for r0, r1, bh in ranges(m) for c0, c1, bw in ranges(n)]


def _blocks(x, cls):
    """The blocks of one class of the matrix x (m, n) as a contiguous batch (k, bh, bw), row-major block order."""
    r0, r1, bh, c0, c1, bw = cls
    nr, nc = (r1 - r0) // bh, (c1 - c0) // bw
    return x[r0:r1, c0:c1].reshape(nr, bh, nc, bw).transpose(1, 2).reshape(nr * nc, bh, bw)


def _unblock(b, cls, out):
    """Writes the batch b (k, bh, bw) back into its place in out (m, n)."""
    r0, r1, bh, c0, c1, bw = cls
    nr, nc = (r1 - r0) // bh, (c1 - c0) // bw
    out[r0:r1, c0:c1] = b.reshape(nr, nc, bh, bw).transpose(1, 2).reshape(r1 - r0, c1 - c0)


class Shampoo(torch.optim.Optimizer):
    """Shampoo with blocked preconditioners and grafting (module docstring). Arguments:
    lr (0.01), momentum (0.9, in [0, 1): SGD's momentum, or Adam's beta1 with graft "adam"), weight_decay (0: L2 on
    the gradient with "sgd", decoupled with "adam"), epsilon (1e-6, > 0: added to the diagonal of
    L and R before the roots), beta2 (1.0, in (0, 1]: 1 sums the statistics, less averages them),
    max_preconditioner_dim (1024, >= 1), precondition_frequency (20, >= 1: steps between root updates),
    graft ("sgd" or "adam"), graft_beta2 (0.999) and graft_eps (1e-8) for "adam"."""

    def __init__(self, params, lr=0.01, momentum=0.9, weight_decay=0.0, epsilon=1e-6, beta2=1.0,
                 max_preconditioner_dim=1024, precondition_frequency=20, graft="sgd", graft_beta2=0.999,
                 graft_eps=1e-8):
        checks = [("lr", lr, lr >= 0.0, ">= 0"), ("momentum", momentum, 0.0 <= momentum < 1.0, "in [0, 1)"),
                  ("weight_decay", weight_decay, weight_decay >= 0.0, ">= 0"),
                  ("epsilon", epsilon, epsilon > 0.0, "> 0"), ("beta2", beta2, 0.0 < beta2 <= 1.0, "in (0, 1]"),
                  ("max_preconditioner_dim", max_preconditioner_dim,
                   isinstance(max_preconditioner_dim, int) and max_preconditioner_dim >= 1, "an int >= 1"),
                  ("precondition_frequency", precondition_frequency,
                   isinstance(precondition_frequency, int) and precondition_frequency >= 1, "an int >= 1"),
                  ("graft", graft, graft in GRAFTS, " or ".join(GRAFTS)),
                  ("graft_beta2", graft_beta2, 0.0 <= graft_beta2 < 1.0, "in [0, 1)"),
                  ("graft_eps", graft_eps, graft_eps > 0.0, "> 0")]
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"torch_ops.Shampoo: argument {name} must be {expected}, found {value!r}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, epsilon=epsilon, beta2=beta2,
                        max_preconditioner_dim=max_preconditioner_dim, precondition_frequency=precondition_frequency,
                        graft=graft, graft_beta2=graft_beta2, graft_eps=graft_eps)
        super().__init__(params, defaults)

    def _init_state(self, p, group):
        state = self.state[p]
        m, n = _matrix_shape(p)
        classes = _block_classes(m, n, group["max_preconditioner_dim"])
        state["step"] = 0
        counts = [((r1 - r0) // bh * ((c1 - c0) // bw), bh, bw) for r0, r1, bh, c0, c1, bw in classes]
        state["L"] = [p.new_zeros(k, bh, bh) for k, bh, _ in counts]
        state["R"] = [p.new_zeros(k, bw, bw) for k, _, bw in counts]
        state["L_root"] = [torch.zeros_like(t) for t in state["L"]]
        state["R_root"] = [torch.zeros_like(t) for t in state["R"]]
        if group["graft"] == "adam":
            state["graft_m"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["graft_v"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif group["momentum"] > 0.0:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    def _direction(self, p, grad, state, group):
        """The preconditioned, grafted step S of one parameter (its shape), before lr."""
        m, n = _matrix_shape(p)
        t, mom = state["step"], group["momentum"]
        if group["graft"] == "adam":
            b2 = group["graft_beta2"]
            state["graft_m"].mul_(mom).add_(grad, alpha=1.0 - mom)
            state["graft_v"].mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
            u = state["graft_m"] / (1.0 - mom ** t)
            d = u / ((state["graft_v"] / (1.0 - b2 ** t)).sqrt() + group["graft_eps"])
        else:
            u = grad
            d = grad + group["weight_decay"] * p if group["weight_decay"] > 0.0 else grad
        g, u, d = grad.reshape(m, n), u.reshape(m, n), d.reshape(m, n)
        beta2 = group["beta2"]
        alpha, beta = (1.0, 1.0) if beta2 == 1.0 else (1.0 - beta2, beta2)
        update_roots = (t - 1) % group["precondition_frequency"] == 0
        out = torch.empty((m, n), dtype=p.dtype, device=p.device)
        for i, cls in enumerate(_block_classes(m, n, group["max_preconditioner_dim"])):
            G = _blocks(g, cls).contiguous()
            state["L"][i] = kron_stats(G, "left", state["L"][i], alpha, beta)
            state["R"][i] = kron_stats(G, "right", state["R"][i], alpha, beta)
            if update_roots:
                state["L_root"][i] = inverse_root(state["L"][i], 4, group["epsilon"])
                state["R_root"][i] = inverse_root(state["R"][i], 4, group["epsilon"])
            S = state["L_root"][i] @ _blocks(u, cls) @ state["R_root"][i]
            s_norm = torch.linalg.matrix_norm(S, keepdim=True)
            d_norm = torch.linalg.matrix_norm(_blocks(d, cls), keepdim=True)
            scale = torch.where(s_norm > 0, d_norm / s_norm.clamp_min(torch.finfo(S.dtype).tiny), 0.0)
            _unblock(S * scale, cls, out)
        return out.reshape(p.shape)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("torch_ops.Shampoo does not take sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p, group)
                state["step"] += 1
                S = self._direction(p, p.grad, state, group)
                if group["graft"] == "adam":
                    if group["weight_decay"] > 0.0:
                        p.mul_(1.0 - group["lr"] * group["weight_decay"])
                elif group["momentum"] > 0.0:
                    S = state["momentum_buffer"].mul_(group["momentum"]).add_(S)
                p.add_(S, alpha=-group["lr"])
        return loss
