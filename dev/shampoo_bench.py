"""Shampoo on the MNIST CNN: the write-up's style against torch_ops.Shampoo (our ops), same model, weights, batches.

  python3 dev/shampoo_bench.py [--steps 500] [--batch_size 64] [--device cuda|cpu] [--modes writeup,ours,sgd]
                               [--model cnn|mlp] [--quick] [--out bench_results]

Modes, each from the same initial weights (PyTorch's init, --seed) on the same batches:
  writeup  the second-order write-up's Shampoo: L += G G^T and R += G^T G for every matrix every step (a weight of
           any shape as out x in*k*k; no blocks: fc1's R is 9216 x 9216), inverse 4th roots by torch.linalg.eigh
           every --writeup_every steps (100) and the preconditioned gradient on those steps only, the raw gradient
           (plain SGD) on all others and for the biases; no grafting, no momentum
  ours     torch_ops.Shampoo: blocks of at most --max_preconditioner_dim (1024), statistics every step
           (kron_stats), roots every --precondition_frequency steps (20; inverse_root: our Newton kernels on the
           GPU, eigh on the CPU), grafted onto SGD with momentum 0.9 (dev/torch_ops/torch_ops/shampoo.py)
  sgd      torch.optim.SGD, momentum 0.9: the baseline both are grafted onto or fall back to
Every mode: lr --lr (0.01), weight decay 0, --epsilon (1e-6) on the diagonal before a root. Time per step: CUDA
events around each step (forward, backward, optimizer; time.perf_counter on the CPU), after a 5-step warm-up of the
same optimizer on a copy of the model (roots at each of its steps); the table gives the mean (root steps included)
and the median. Test accuracy after --steps steps.
--quick: CI-sized, on the CPU unless --device cuda: --model mlp (784 -> 64 -> 10, whose write-up R is 784 x 784),
30 steps, 2048 training and 500 test images, roots every 10 steps for both Shampoos. Writes shampoo_bench.json and
.csv into --out.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
MODES = ["writeup", "ours", "sgd"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="training steps per mode, >= 1 (default 500)")
    ap.add_argument("--batch_size", type=int, default=64, help="batch size, >= 1 (default 64)")
    ap.add_argument("--modes", default="writeup,ours,sgd", help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--model", default="cnn", choices=["cnn", "mlp"], help="dev/mnist.py's CNN (default) or a "
                    "784-64-10 MLP")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default cuda where available")
    ap.add_argument("--lr", type=float, default=0.01, help="learning rate of every mode (default 0.01)")
    ap.add_argument("--epsilon", type=float, default=1e-6, help="added to L and R before a root (default 1e-6)")
    ap.add_argument("--writeup_every", type=int, default=100, help="write-up style: steps between roots (100)")
    ap.add_argument("--precondition_frequency", type=int, default=20, help="ours: steps between roots (20)")
    ap.add_argument("--max_preconditioner_dim", type=int, default=1024, help="ours: block size (1024)")
    ap.add_argument("--train_limit", type=int, default=0, help="first N training images (default 0: all 60000)")
    ap.add_argument("--test_limit", type=int, default=0, help="first N test images (default 0: all 10000)")
    ap.add_argument("--data_dir", default=os.path.join(os.path.dirname(ROOT), "data", "mnist"))
    ap.add_argument("--seed", type=int, default=0, help="initial weights and batch order (default 0)")
    ap.add_argument("--quick", action="store_true", help="CI-sized run, on the CPU by default (see above)")
    ap.add_argument("--out", default="bench_results", help="folder for shampoo_bench.json and .csv")
    args = ap.parse_args()
    if args.quick:
        args.model, args.steps, args.writeup_every, args.precondition_frequency = "mlp", 30, 10, 10
        args.train_limit, args.test_limit = args.train_limit or 2048, args.test_limit or 500
        args.device = args.device or "cpu"
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: unknown mode {', '.join(bad) or '(none)'}; expected some of {', '.join(MODES)}")
    args.modes = modes
    for name in ("steps", "batch_size", "writeup_every", "precondition_frequency", "max_preconditioner_dim"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, found {getattr(args, name)}")
    for name in ("train_limit", "test_limit"):
        if getattr(args, name) < 0:
            ap.error(f"--{name} must be >= 0, found {getattr(args, name)}")
    if not (args.lr > 0 and args.epsilon > 0):
        ap.error(f"--lr and --epsilon must be > 0, found {args.lr} and {args.epsilon}")
    return args


class WriteupShampoo:
    """The write-up's Shampoo as issue 21 describes it: full (unblocked) factors of every weight matrix, eigh-based
    inverse 4th roots every `every` steps, the preconditioned gradient on those steps and the raw one otherwise."""

    def __init__(self, torch, params, lr, epsilon, every):
        self.torch, self.params, self.lr, self.eps, self.every = torch, list(params), lr, epsilon, every
        self.t = 0
        self.state = {}

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def root(self, M):
        torch = self.torch
        lam, V = torch.linalg.eigh(M + self.eps * torch.eye(M.shape[0], device=M.device, dtype=M.dtype))
        return (V * lam.clamp_min(self.eps) ** -0.25) @ V.T

    def step(self):
        torch = self.torch
        self.t += 1
        precondition = self.t % self.every == 0
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                if p.dim() < 2:
                    p.sub_(self.lr * p.grad)
                    continue
                G = p.grad.reshape(p.shape[0], -1)
                st = self.state.setdefault(p, {"L": torch.zeros(G.shape[0], G.shape[0], device=p.device),
                                               "R": torch.zeros(G.shape[1], G.shape[1], device=p.device)})
                st["L"] += G @ G.T
                st["R"] += G.T @ G
                if precondition:
                    p.sub_(self.lr * (self.root(st["L"]) @ G @ self.root(st["R"])).reshape(p.shape))
                else:
                    p.sub_(self.lr * p.grad)


def build_mlp(torch):
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(784, 64), torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x.flatten(1))))
    return MLP


def main():
    args = parse_args()
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(f"error: dev/shampoo_bench.py needs PyTorch and NumPy ({e})", file=sys.stderr)
        return 1
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is available; use --device cpu", file=sys.stderr)
        return 1
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(os.path.dirname(ROOT), "scripts"))
    sys.path.insert(0, os.path.join(ROOT, "torch_ops"))
    import binio
    import mnist as ref
    try:
        import torch_ops
    except Exception as e:  # a failed build: its compiler output is in the message
        print(f"error: import torch_ops (dev/torch_ops) failed: {type(e).__name__}: {str(e).strip()[-2000:]}",
              file=sys.stderr)
        return 1
    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # strict fp32 for every mode: the optimizers differ, not the math
    torch.backends.cudnn.allow_tf32 = False
    try:
        train_x, train_y = ref.load_idx(args.data_dir, "train", args.train_limit or 60000)
        test_x, test_y = ref.load_idx(args.data_dir, "t10k", args.test_limit or 10000)
    except (binio.FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    X, Y = torch.from_numpy(ref.normalize(train_x)).to(dev), torch.from_numpy(train_y.astype(np.int64)).to(dev)
    TX, TY = torch.from_numpy(ref.normalize(test_x)).to(dev), torch.from_numpy(test_y.astype(np.int64)).to(dev)
    torch.manual_seed(args.seed)
    Net = ref.build_net(torch) if args.model == "cnn" else build_mlp(torch)
    init = Net().state_dict()
    name = torch.cuda.get_device_name(dev) if on_gpu else "CPU"
    print(f"device {name}, torch {torch.__version__}, torch_ops {torch_ops.BUILD_INFO['variant']} build; model "
          f"{args.model}, {len(X)} training images, {len(TX)} test images, batch {args.batch_size}, {args.steps} "
          f"steps, lr {args.lr}", flush=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    order = torch.cat([torch.randperm(len(X), generator=gen)
                       for _ in range((args.steps + 5) * args.batch_size // len(X) + 1)]).to(dev)
    batches = [order[i * args.batch_size:(i + 1) * args.batch_size] for i in range(args.steps + 5)]

    rows = []
    for mode in args.modes:
        def make_opt(params, every=None):  # every: roots at every step (the warm-up reaches each code path)
            if mode == "writeup":
                return WriteupShampoo(torch, params, args.lr, args.epsilon, every or args.writeup_every)
            if mode == "ours":
                return torch_ops.Shampoo(params, lr=args.lr, momentum=0.9, epsilon=args.epsilon,
                                         max_preconditioner_dim=args.max_preconditioner_dim,
                                         precondition_frequency=every or args.precondition_frequency)
            return torch.optim.SGD(params, lr=args.lr, momentum=0.9)

        # warm-up: 5 steps on a copy, roots at every step, on the batches after the timed ones (first-call costs:
        # handles, workspaces, autotuning, out of the timed run)
        warm = Net().to(dev)
        warm.load_state_dict(init)
        warm_opt = make_opt(warm.parameters(), every=1)
        for idx in batches[args.steps:]:
            warm_opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(warm(X[idx]), Y[idx]).backward()
            warm_opt.step()
        del warm, warm_opt
        net = Net().to(dev)
        net.load_state_dict(init)
        opt = make_opt(net.parameters())
        ms, losses = [], []
        for step, idx in enumerate(batches[:args.steps]):
            if on_gpu:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(X[idx]), Y[idx])
            loss.backward()
            opt.step()
            if on_gpu:
                e1.record()
                e1.synchronize()
                ms.append(e0.elapsed_time(e1))
            else:
                ms.append(1000 * (time.perf_counter() - t0))
            losses.append(float(loss.detach()))
            if not np.isfinite(losses[-1]):
                print(f"{mode}: the loss is {losses[-1]} at step {step + 1}; stopping this mode", flush=True)
                break
        with torch.no_grad():
            correct = sum(int((net(TX[i:i + 1000]).argmax(1) == TY[i:i + 1000]).sum()) for i in range(0, len(TX),
                                                                                                     1000))
        acc = 100.0 * correct / len(TX)
        tail = losses[-min(20, len(losses)):]
        rows.append({"mode": mode, "ms_mean": statistics.fmean(ms), "ms_median": statistics.median(ms),
                     "steps": len(losses), "final_loss": statistics.fmean(tail), "test_accuracy": acc,
                     "losses": losses})
        print(f"{mode:8s} {len(losses)} steps | {rows[-1]['ms_mean']:.2f} ms/step mean, {rows[-1]['ms_median']:.2f} "
              f"median | loss (last 20) {rows[-1]['final_loss']:.4f} | test accuracy {acc:.2f}%", flush=True)

    print("\n| mode | ms / step, mean (median) | test accuracy | train loss, last 20 steps |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ms_mean']:.2f} ({r['ms_median']:.2f}) | {r['test_accuracy']:.2f}% | "
              f"{r['final_loss']:.4f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "shampoo_bench.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "model": args.model, "steps": args.steps,
                   "batch_size": args.batch_size, "lr": args.lr, "epsilon": args.epsilon,
                   "writeup_every": args.writeup_every, "precondition_frequency": args.precondition_frequency,
                   "max_preconditioner_dim": args.max_preconditioner_dim, "train_images": len(X),
                   "test_images": len(TX), "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "shampoo_bench.csv"), "w") as f:
        f.write("mode,ms_mean,ms_median,test_accuracy,final_loss,steps\n")
        for r in rows:
            f.write(f"{r['mode']},{r['ms_mean']:.3f},{r['ms_median']:.3f},{r['test_accuracy']:.2f},"
                    f"{r['final_loss']:.5f},{r['steps']}\n")
    print(f"wrote {args.out}/shampoo_bench.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
