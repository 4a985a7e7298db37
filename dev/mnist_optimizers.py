"""PyTorch references of train_mnist's matrix optimizers (issue 21), written plainly, and the CI fixture that
dev/test_mnist.cu checks the trainer's CPU path (and, on a GPU, its GPU path) against.

  python3 dev/mnist_optimizers.py        # writes dev/fixtures/mnist_optimizers_fixture.bin (CPU, fp32, seconds)

The fixture: dev/mnist.py's CI fixture batch (the first 8 test images) and hash_init weights; from them n_steps
optimizer steps on that batch for each run below: the loss before every step (<run>_losses) and the final
parameters (<run>.<name>; of fc1.weight only the first 4 rows, <run>.fc1.weight.rows).
  muon:         torch.optim.Muon for the weight matrices (a convolution's weight as out x in*3*3: a view of the same
                storage), torch.optim.AdamW for the biases. One change: its Newton-Schulz iteration runs in fp32
                (torch casts it to bf16, whose 2^-8 rounding would drown a comparison in fp32): torch's
                _zeropower_via_newtonschulz replaced by the same iteration without the cast (ns_fp32).
  muon_bf16:    unmodified torch.optim.Muon (bf16 Newton-Schulz): losses only, a sanity check of the same trajectory.
  shampoo_sgd, shampoo_adam: the Shampoo of train_mnist.cu (part 4, the matrix optimizers) in plain PyTorch: blocked
                factors L += G G^T, R += G^T G, inverse 4th roots (float64 eigendecomposition) every precond_every
                steps from precond_start, the step grafted onto SGD-momentum or AdamW; the biases take
                torch.optim.SGD or torch.optim.AdamW.
  kfac_sgd, kfac_adam: the K-FAC of train_mnist.cu in plain PyTorch: per layer the weight with its bias as one more
                column; A = the mean of [a; 1][a; 1]^T over the layer's input rows (F.unfold patches for a
                convolution), G = the mean of (B g)(B g)^T over the output gradient's rows (module hooks), running
                averages (kfac_stat_decay), diagonal blocks of max_precond_dim, damped inverses (float64
                torch.linalg.inv) on Shampoo's schedule, P = Ginv U Ainv per block grafted as Shampoo's. Their
                damping is kfac_damping (the trainer's --precond_damping): an inverse moves by up to kappa times the
                fp32 rounding of its factor (the factors of 8 samples are near singular, kappa up to about 1 + n /
                damping; a convolution's factor sums 4608 or 5408 rows), so the comparison in fp32 needs a small
                kappa: at damping 1e-3 (kappa <= 3.2e4) fc1 differs by 7x its tolerance, at 0.1 conv1 by 1.07x in
                norm; at 1 (kappa <= 33) everything is within 0.25 (dev/test_mnist.cu).
  shampoo_sgd_delay1, kfac_sgd_delay1: shampoo_sgd and kfac_sgd with train_mnist's --precond_delay 1: the roots due
                at step s (computed from step s's factors) are used from step s + 1 (swap_in); with precond_start 1,
                precond_every 2 and 4 steps, step 1 still takes the graft's step and steps 2, 3 step 1's roots.
Everything in fp32 on the CPU (TF32 does not exist there). Format: scripts/binio.py MNIST_OPT_FIXTURE.

  python3 dev/mnist_optimizers.py --per_sample_out dev/fixtures/mnist_per_sample_fixture.bin   # (also written by
                                                                                               # default)
The per-sample fixture (train_mnist's --clip_per_sample and --precond fisher_diag): per-sample gradients by
torch.func.vmap(grad) of each sample's loss, then plainly: every sample's gradient norm per parameter tensor and of the
whole model; the clipped mean gradient (1/B) sum_i min(1, C / ||g_i||) g_i at C = the median norm rounded to fp32 (so
some samples are clipped, some not); n_steps of torch.optim.SGD on it (clip run); n_steps of torch.optim.SGD on the
gradient divided by (F^ + eps + damping mean(F^))^power, F^ the bias-corrected running average of the empirical-Fisher
diagonal (1/B) sum_i g_i^2 (fisher run). Format: scripts/binio.py MNIST_PER_SAMPLE_FIXTURE.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import binio  # noqa: E402
import mnist  # noqa: E402  (dev/mnist.py: the network, the data, hash_init)

CFG = dict(batch_size=8, n_steps=4, init_seed=7, lr=0.05, momentum=0.9, weight_decay=5e-4, adam_lr=1e-3, beta1=0.9,
           beta2=0.999, eps=1e-8, adam_weight_decay=0.01, muon_lr=0.02, muon_momentum=0.95, muon_nesterov=1,
           ns_steps=5, precond_every=2, precond_start=1, max_precond_dim=32, precond_eps=1e-12,
           precond_damping=1e-3, kfac_stat_decay=0.9, kfac_damping=1.0)
WEIGHTS = ["conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight"]
PS_CFG = dict(batch_size=8, n_steps=4, init_seed=7, lr=0.05, momentum=0.9, weight_decay=5e-4, fisher_lr=1e-3,
              beta2=0.99, precond_eps=1e-10, precond_damping=1e-3, fisher_power=0.5)


def f32(v):
    """A setting as the trainer holds it (a float32 in the fixture's header)."""
    return float(np.float32(v))


def ns_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz without the cast to bfloat16."""
    import torch
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def matrix(p):
    """A weight as the rows x cols matrix the optimizers see (a view: updates go to the parameter)."""
    return p.view(p.shape[0], -1)


def run_muon(torch, net, x, y, cfg, fp32):
    import torch.optim._muon as muon_module
    original = muon_module._zeropower_via_newtonschulz
    if fp32:
        muon_module._zeropower_via_newtonschulz = ns_fp32
    try:
        params = dict(net.named_parameters())
        mats = {n: torch.nn.Parameter(matrix(params[n].data)) for n in WEIGHTS}
        muon = torch.optim.Muon(list(mats.values()), lr=f32(cfg["muon_lr"]), weight_decay=f32(cfg["adam_weight_decay"]),
                                momentum=f32(cfg["muon_momentum"]), nesterov=bool(cfg["muon_nesterov"]),
                                ns_steps=cfg["ns_steps"])
        biases = [p for n, p in params.items() if n not in WEIGHTS]
        adamw = torch.optim.AdamW(biases, lr=f32(cfg["adam_lr"]), betas=(f32(cfg["beta1"]), f32(cfg["beta2"])),
                                  eps=f32(cfg["eps"]), weight_decay=f32(cfg["adam_weight_decay"]), foreach=False)
        losses = []
        for _ in range(cfg["n_steps"]):
            net.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            losses.append(loss.item())
            loss.backward()
            for n in WEIGHTS:
                mats[n].grad = matrix(params[n].grad)
            muon.step()
            adamw.step()
        return losses
    finally:
        muon_module._zeropower_via_newtonschulz = original


def blocks_of(rows, cols, d):
    return [(r0, c0, min(d, rows - r0), min(d, cols - c0)) for r0 in range(0, rows, d) for c0 in range(0, cols, d)]


def inverse_root4(torch, a, cfg):
    """(A + e I)^(-1/4), e = precond_eps + precond_damping * trace(A) / n, by a float64 eigendecomposition."""
    a = a.double()
    n = a.shape[0]
    e = f32(cfg["precond_eps"]) + f32(cfg["precond_damping"]) * a.diagonal().sum().item() / n
    w, v = torch.linalg.eigh(a + e * torch.eye(n, dtype=torch.float64))
    return ((v * w.clamp(min=1e-300) ** -0.25) @ v.T).float()


def graft_operands(st, g, w, step, sgd, wd, b1, b2, eps):
    """U (the preconditioner's operand) and D (the graft's direction): SGD's G + wd W twice, or AdamW's m_hat and
    m_hat / (sqrt(v_hat) + eps) (st's m and v updated)."""
    if sgd:
        d = g + wd * w
        return d, d
    st["m"].mul_(b1).add_(g, alpha=1 - b1)
    st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
    u = st["m"] / (1 - b1 ** (step + 1))
    return u, u / ((st["v"] / (1 - b2 ** (step + 1))).sqrt() + eps)


def grafted(torch, p, d):
    """P with D's Frobenius norm (zero when P is)."""
    pn = p.norm()
    return p * (d.norm() / pn) if pn > 0 else torch.zeros_like(p)


def graft_step(st, w, s, sgd, lr, wd, mom):
    """w after the graft's step with direction s: SGD-momentum (st's buf) or AdamW's decoupled decay."""
    if sgd:
        st["buf"].mul_(mom).add_(s)
        return w - lr * st["buf"]
    return w * (1 - lr * wd) - lr * s


def swap_in(holder, keys, step, due, delay, compute):
    """--precond_delay's schedule for one block's roots (holder[keys]): a pending set whose switch step has come
    becomes the live one, then the roots due at this step are computed from this step's factors and are live at
    once (delay 0) or from step + delay."""
    if holder.get("pending") is not None and step >= holder["switch"]:
        for k, v in zip(keys, holder.pop("pending")):
            holder[k] = v
    if due:
        roots = compute()
        if delay == 0:
            for k, v in zip(keys, roots):
                holder[k] = v
        else:
            holder["pending"], holder["switch"] = roots, step + delay


def run_shampoo(torch, net, x, y, cfg, graft, delay=0):
    params = dict(net.named_parameters())
    sgd = graft == "sgd"
    lr, wd = (f32(cfg["lr"]), f32(cfg["weight_decay"])) if sgd else (f32(cfg["adam_lr"]), f32(cfg["adam_weight_decay"]))
    b1, b2, eps, mom = f32(cfg["beta1"]), f32(cfg["beta2"]), f32(cfg["eps"]), f32(cfg["momentum"])
    state = {}
    for n in WEIGHTS:
        w = matrix(params[n].data)
        blocks = []
        for r0, c0, r, c in blocks_of(w.shape[0], w.shape[1], cfg["max_precond_dim"]):
            blocks.append(dict(r0=r0, c0=c0, r=r, c=c, L=torch.zeros(r, r), R=torch.zeros(c, c), Linv=None, Rinv=None))
        state[n] = dict(blocks=blocks, buf=torch.zeros_like(w), m=torch.zeros_like(w), v=torch.zeros_like(w))
    biases = [p for n, p in params.items() if n not in WEIGHTS]
    if sgd:
        bias_opt = torch.optim.SGD(biases, lr=lr, momentum=mom, weight_decay=wd)
    else:
        bias_opt = torch.optim.AdamW(biases, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
    losses = []
    for step in range(cfg["n_steps"]):
        net.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        losses.append(loss.item())
        loss.backward()
        due = step >= cfg["precond_start"] and (step - cfg["precond_start"]) % cfg["precond_every"] == 0
        with torch.no_grad():
            for n in WEIGHTS:
                st, w, g = state[n], matrix(params[n].data), matrix(params[n].grad)
                u, d = graft_operands(st, g, w, step, sgd, wd, b1, b2, eps)
                s = torch.empty_like(w)
                for bl in st["blocks"]:
                    rs, cs = slice(bl["r0"], bl["r0"] + bl["r"]), slice(bl["c0"], bl["c0"] + bl["c"])
                    gb = g[rs, cs]
                    bl["L"] += gb @ gb.T
                    bl["R"] += gb.T @ gb
                    swap_in(bl, ("Linv", "Rinv"), step, due, delay,
                            lambda: (inverse_root4(torch, bl["L"], cfg), inverse_root4(torch, bl["R"], cfg)))
                    if bl["Linv"] is None:
                        s[rs, cs] = d[rs, cs]
                        continue
                    s[rs, cs] = grafted(torch, bl["Linv"] @ u[rs, cs] @ bl["Rinv"], d[rs, cs])
                w.copy_(graft_step(st, w, s, sgd, lr, wd, mom))
        bias_opt.step()
    return losses


def damped(torch, f, cfg):
    """F + e I in float64, e = precond_eps + kfac_damping * trace(F) / n (train_mnist.cu's root_shift)."""
    f = f.double()
    n = f.shape[0]
    e = f32(cfg["precond_eps"]) + f32(cfg["kfac_damping"]) * f.diagonal().sum().item() / n
    return f + e * torch.eye(n, dtype=torch.float64)


def run_kfac(torch, net, x, y, cfg, graft, delay=0):
    F = torch.nn.functional
    params = dict(net.named_parameters())
    sgd = graft == "sgd"
    lr, wd = (f32(cfg["lr"]), f32(cfg["weight_decay"])) if sgd else (f32(cfg["adam_lr"]), f32(cfg["adam_weight_decay"]))
    b1, b2, eps, mom = f32(cfg["beta1"]), f32(cfg["beta2"]), f32(cfg["eps"]), f32(cfg["momentum"])
    decay = f32(cfg["kfac_stat_decay"])
    d = cfg["max_precond_dim"]
    B = x.shape[0]
    layers = ["conv1", "conv2", "fc1", "fc2"]
    saved = {}

    def keep(name):
        def hook(module, inputs, output):
            saved[name + ".a"] = inputs[0].detach()
            output.register_hook(lambda g: saved.__setitem__(name + ".g", g.detach()))
        return hook

    handles = [getattr(net, name).register_forward_hook(keep(name)) for name in layers]
    state = {}
    for name in layers:
        w = params[name + ".weight"]
        out, cols = w.shape[0], w[0].numel() + 1
        state[name] = dict(
            G=[dict(i0=i0, F=None, inv=None) for i0 in range(0, out, d)],
            A=[dict(i0=i0, F=None, inv=None) for i0 in range(0, cols, d)],
            buf=torch.zeros(out, cols), m=torch.zeros(out, cols), v=torch.zeros(out, cols))
    losses = []
    for step in range(cfg["n_steps"]):
        net.zero_grad()
        loss = F.cross_entropy(net(x), y)
        losses.append(loss.item())
        loss.backward()
        due = step >= cfg["precond_start"] and (step - cfg["precond_start"]) % cfg["precond_every"] == 0
        with torch.no_grad():
            for name in layers:
                st, wp, bp = state[name], params[name + ".weight"], params[name + ".bias"]
                a, g = saved[name + ".a"], saved[name + ".g"]
                if a.dim() == 4:  # a convolution: its im2col patches, the output positions as rows
                    a = F.unfold(a, 3).transpose(1, 2).reshape(-1, a.shape[1] * 9)
                    g = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
                rows = a.shape[0]
                a = torch.cat([a, torch.ones(rows, 1)], 1)
                new = {"A": f32(1.0 / rows) * (a.T @ a), "G": f32(B / (rows // B)) * (g.T @ g)}
                for side in ("G", "A"):
                    for fb in st[side]:
                        sl = slice(fb["i0"], fb["i0"] + d)
                        f_new = new[side][sl, sl]
                        fb["F"] = f_new if fb["F"] is None else fb["F"] * decay + f_new * f32(1 - decay)
                        swap_in(fb, ("inv",), step, due, delay,
                                lambda: (torch.linalg.inv(damped(torch, fb["F"], cfg)).float(),))
                w = torch.cat([matrix(wp.data), bp.data.view(-1, 1)], 1)
                gw = torch.cat([matrix(wp.grad), bp.grad.view(-1, 1)], 1)
                u, dir_ = graft_operands(st, gw, w, step, sgd, wd, b1, b2, eps)
                s = torch.empty_like(w)
                for gb in st["G"]:
                    for ab in st["A"]:
                        rs, cs = slice(gb["i0"], gb["i0"] + d), slice(ab["i0"], ab["i0"] + d)
                        if gb["inv"] is None or ab["inv"] is None:
                            s[rs, cs] = dir_[rs, cs]
                            continue
                        s[rs, cs] = grafted(torch, gb["inv"] @ u[rs, cs] @ ab["inv"], dir_[rs, cs])
                w = graft_step(st, w, s, sgd, lr, wd, mom)
                wp.data.copy_(w[:, :-1].reshape(wp.shape))
                bp.data.copy_(w[:, -1])
    for h in handles:
        h.remove()
    return losses


def per_sample_grads(torch, net, x, y):
    """{name: (B, *shape)}: the gradient of each sample's loss (not divided by B), by torch.func.vmap(grad)."""
    from torch.func import functional_call, grad, vmap
    params = {n: p.detach() for n, p in net.named_parameters()}

    def loss_one(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(net, p, (xi[None],)), yi[None])

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def norms_of(torch, g):
    """(B, 8) per-tensor norms in the state_dict's order and (B,) whole-model norms of per-sample gradients g, summed
    in float64: torch's fp32 norm of fc1.weight's 1.2M elements is itself off by up to 2e-5 relative (measured against
    float64 on the fixture), more than the 1e-5 the trainer's norms are held to."""
    per = torch.stack([g[n].double().flatten(1).norm(dim=1) for n in g], dim=1)
    return per.float(), per.pow(2).sum(dim=1).sqrt().float()


def clipped_mean(torch, g, clip):
    """(1/B) sum_i min(1, C / ||g_i||) g_i, per tensor."""
    _, total = norms_of(torch, g)
    scale = torch.clamp(clip / total, max=1.0)
    return {n: (v * scale.view(-1, *[1] * (v.dim() - 1))).mean(dim=0) for n, v in g.items()}


def run_per_sample(torch, net, x, y, cfg, clip, fisher):
    """n_steps of torch.optim.SGD on the clipped mean gradient (fisher=False) or on the Fisher-preconditioned mean
    gradient (fisher=True); the loss before every step."""
    lr = f32(cfg["fisher_lr"] if fisher else cfg["lr"])
    sgd = torch.optim.SGD(net.parameters(), lr=lr, momentum=f32(cfg["momentum"]),
                          weight_decay=f32(cfg["weight_decay"]))
    b2, eps, damping, power = (f32(cfg[k]) for k in ("beta2", "precond_eps", "precond_damping", "fisher_power"))
    avg = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    losses = []
    for step in range(cfg["n_steps"]):
        with torch.no_grad():
            losses.append(torch.nn.functional.cross_entropy(net(x), y).item())
        g = per_sample_grads(torch, net, x, y)
        if fisher:
            mean = {n: v.mean(dim=0) for n, v in g.items()}
            bc = 1 - b2 ** (step + 1)
            for n, v in g.items():
                avg[n] = b2 * avg[n] + (1 - b2) * (v * v).mean(dim=0)
                fhat = avg[n] / bc
                mean[n] = mean[n] / (fhat + eps + damping * fhat.mean()) ** power
        else:
            mean = clipped_mean(torch, g, clip)
        for n, p in net.named_parameters():
            p.grad = mean[n].clone()
        sgd.step()
    return losses


def write_per_sample_fixture(torch, Net, init, x, y, out):
    cfg = dict(PS_CFG)
    net = Net()
    net.load_state_dict(init)
    g = per_sample_grads(torch, net, x, y)
    per, total = norms_of(torch, g)
    cfg["clip"] = float(np.float32(total.quantile(0.5).item()))  # between the two middle norms
    tensors = {"x": x.numpy(), "y": y.numpy().astype(np.int32), "norms": per.numpy(), "total": total.numpy()}

    def put(prefix, named):
        for n, v in named.items():
            v = v.detach().numpy()
            if n == "fc1.weight":
                tensors[f"{prefix}.fc1.weight.rows"] = v[:4].copy()
            else:
                tensors[f"{prefix}.{n}"] = v.copy()

    put("clip_grad", clipped_mean(torch, g, cfg["clip"]))
    for name, fisher in (("clip", False), ("fisher", True)):
        net = Net()
        net.load_state_dict(init)
        tensors[name + "_losses"] = np.array(run_per_sample(torch, net, x, y, cfg, cfg["clip"], fisher),
                                             dtype=np.float32)
        put(name, dict(net.state_dict()))
        print(f"{name}: losses {tensors[name + '_losses']}")
    print(f"per-sample norms: {total.numpy()}, clip {cfg['clip']}")
    binio.write(out, binio.MNIST_PER_SAMPLE_FIXTURE, cfg, tensors)
    print(f"wrote {out} ({os.path.getsize(out)} bytes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", default="data/mnist")
    ap.add_argument("--out", default="dev/fixtures/mnist_optimizers_fixture.bin")
    ap.add_argument("--per_sample_out", default="dev/fixtures/mnist_per_sample_fixture.bin",
                    help="the per-sample fixture (empty: not written)")
    args = ap.parse_args()
    try:
        images, labels = mnist.load_idx(args.data_dir, "t10k", CFG["batch_size"])
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    try:
        import torch
    except ImportError:
        sys.exit("error: dev/mnist_optimizers.py needs PyTorch (pip install torch)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    Net = mnist.build_net(torch)
    init = {n: torch.from_numpy(v) for n, v in mnist.hash_init(CFG["init_seed"]).items()}
    x = torch.from_numpy(mnist.normalize(images))
    y = torch.from_numpy(labels.astype(np.int64))
    tensors = {"x": x.numpy(), "y": labels.astype(np.int32)}
    runs = [("muon", lambda net: run_muon(torch, net, x, y, CFG, True)),
            ("muon_bf16", lambda net: run_muon(torch, net, x, y, CFG, False)),
            ("shampoo_sgd", lambda net: run_shampoo(torch, net, x, y, CFG, "sgd")),
            ("shampoo_adam", lambda net: run_shampoo(torch, net, x, y, CFG, "adam")),
            ("kfac_sgd", lambda net: run_kfac(torch, net, x, y, CFG, "sgd")),
            ("kfac_adam", lambda net: run_kfac(torch, net, x, y, CFG, "adam")),
            ("shampoo_sgd_delay1", lambda net: run_shampoo(torch, net, x, y, CFG, "sgd", delay=1)),
            ("kfac_sgd_delay1", lambda net: run_kfac(torch, net, x, y, CFG, "sgd", delay=1))]
    for name, fn in runs:
        net = Net()
        net.load_state_dict(init)
        tensors[name + "_losses"] = np.array(fn(net), dtype=np.float32)
        if name == "muon_bf16":
            continue
        for n, p in net.state_dict().items():
            v = p.detach().numpy()
            if n == "fc1.weight":
                tensors[f"{name}.fc1.weight.rows"] = v[:4].copy()
            else:
                tensors[f"{name}.{n}"] = v.copy()
        print(f"{name}: losses {tensors[name + '_losses']}")
    binio.write(args.out, binio.MNIST_OPT_FIXTURE, CFG, tensors)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    if args.per_sample_out:
        write_per_sample_fixture(torch, Net, init, x, y, args.per_sample_out)


if __name__ == "__main__":
    main()
