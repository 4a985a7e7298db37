"""Inverse roots and Newton-Schulz on the GPU machine: PyTorch's torch.linalg.eigh-based inverse 4th roots, a
PyTorch coupled Newton iteration (the algorithm of dev/matrix_roots.cu's versions 1 to 4, with the same scaling and
stopping rule) and Muon's Newton-Schulz in bf16, beside ./dev/matrix_roots --bench (every version, a column each:
--quick's table holds issue 21's two targets, 64 x 128^2 and 1024^2) in ONE run on the same GPU, printed as one
table of milliseconds.

  make -C dev matrix_roots && python3 dev/matrix_roots.py [--quick] [--out DIR] [--skip_binary]

Inputs as the binary's: A = G G^T / (2n) with G an n x 2n Gaussian matrix (torch's generator: the same distribution,
not the same numbers), eps = 1e-6, p = 4; single matrices n = 64 .. 4096 and batches of blocks. fp32 with TF32 off
(the project's reference precision); Newton-Schulz in bf16 as Muon runs it. Timing: CUDA events around one call
after a warm-up call, median of as many calls as fit 0.3 s (1 to 20), as the binary does. Each PyTorch result is
checked: ||X^4 (A + eps I) - I||_F / sqrt(n) of the first matrix, in float64.
Without PyTorch or a CUDA GPU it prints one SKIP line and exits 0.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, EPS = 4, 1e-6
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def shapes(quick):
    singles = [128, 1024] if quick else [64, 128, 256, 512, 1024, 2048, 4096]
    batches = [(64, 128)] if quick else [(1024, 32), (256, 64), (64, 128), (16, 512)]
    ns = [(1024, 1024, 1), (64, 128, 128)] + ([] if quick else [(4096, 4096, 1), (4096, 1024, 1), (256, 2304, 1)])
    return singles, batches, ns


def eigh_root(torch, A, eps, p):
    eye = torch.eye(A.shape[-1], device=A.device, dtype=A.dtype)
    lam, Q = torch.linalg.eigh(A + eps * eye)
    return (Q * lam.clamp_min(eps).pow(-1.0 / p).unsqueeze(-2)) @ Q.mT


def newton_root(torch, A, eps, p):
    """Coupled Newton: z = (p + 1) / (2 ||A||_F), X0 = z^(1/p) I, M0 = z A; T = ((p + 1) I - M) / p, X <- X T,
    M <- T^p M; ||M - I||_F (the largest over the batch) read on the host before each step: at <= 1e-3, or stalled
    below 0.2, one last X step ends it (dev/matrix_roots.cu's newton_decide)."""
    eye = torch.eye(A.shape[-1], device=A.device, dtype=A.dtype)
    Areg = A + eps * eye
    z = (p + 1) / (2 * torch.linalg.matrix_norm(Areg))
    M = z[..., None, None] * Areg
    X = z.pow(1.0 / p)[..., None, None] * eye
    r_prev, steps = math.inf, 0
    for _ in range(200):
        r = torch.linalg.matrix_norm(M - eye).max().item()
        T = ((p + 1) * eye - M) / p
        X = X @ T
        if not math.isfinite(r) or r <= 1e-3 or (r < 0.2 and r > 0.5 * r_prev):
            break
        r_prev = r
        Tp = T if p == 1 else T @ T
        if p == 4:
            Tp = Tp @ Tp
        M = Tp @ M
        steps += 1
    return X, steps


def newton_schulz(torch, G, steps=5):
    a, b, c = NS_COEFFS
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if tall else X


def time_ms(torch, fn):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def once():
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    times = [once()]
    reps = int(min(20, max(1, math.floor(300.0 / max(times[0], 1e-3)))))
    times += [once() for _ in range(reps - 1)]
    times.sort()
    return times[len(times) // 2]


def residual(torch, X, A, eps, p):
    n = A.shape[-1]
    x, a = X[0].double(), A[0].double() + eps * torch.eye(n, device=A.device, dtype=torch.float64)
    return (torch.linalg.matrix_power(x, p) @ a - torch.eye(n, device=A.device, dtype=torch.float64)).norm().item() \
        / math.sqrt(n)


def torch_rows(torch, quick):
    singles, batches, ns = shapes(quick)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    rows = []
    for batch, n in [(1, n) for n in singles] + batches:
        G = torch.randn(batch, n, 2 * n, device="cuda", generator=gen)
        A = G @ G.mT / (2 * n)
        A = (A + A.mT) / 2
        shape = f"{batch} x {n}^2" if batch > 1 else f"{n}^2"
        out = {}
        ms = time_ms(torch, lambda: out.__setitem__("x", eigh_root(torch, A, EPS, P)))
        rows.append(("inv 4th root", shape, "torch eigh", ms, 0, residual(torch, out["x"], A, EPS, P)))
        ms = time_ms(torch, lambda: out.__setitem__("x", newton_root(torch, A, EPS, P)))
        rows.append(("inv 4th root", shape, "torch newton", ms, out["x"][1], residual(torch, out["x"][0], A, EPS, P)))
        for r in rows[-2:]:
            print(f"  {r[0]:14s} {r[1]:12s} {r[2]:18s} {r[3]:10.3f} ms {r[4]:4d} steps  residual {r[5]:.1e}",
                  flush=True)
        del G, A, out
    for m, n, batch in ns:
        G = torch.randn(batch, m, n, device="cuda", generator=gen)
        shape = f"{batch} x {m}x{n}" if batch > 1 else f"{m}x{n}"
        out = {}
        ms = time_ms(torch, lambda: out.__setitem__("x", newton_schulz(torch, G)))
        s = out["x"][0].float().pow(2).sum().item() / min(m, n)
        rows.append(("newton-schulz", shape, "torch bf16", ms, 5, s))
        print(f"  {'newton-schulz':14s} {shape:12s} {'torch bf16':18s} {ms:10.3f} ms"
              f"            mean sigma^2 {s:.3f}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes (as ./dev/matrix_roots --bench --quick)")
    ap.add_argument("--out", default=None, help="also write DIR/matrix_roots_bench.json (every row) [none]")
    ap.add_argument("--skip_binary", action="store_true", help="PyTorch only (no ./dev/matrix_roots run)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("SKIP dev/matrix_roots.py: PyTorch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("SKIP dev/matrix_roots.py: no CUDA GPU")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")

    ours = []
    if not args.skip_binary:
        binary = os.path.join(ROOT, "dev", "matrix_roots")
        if not os.path.exists(binary):
            print(f"error: {binary} not found: run make -C dev matrix_roots (or pass --skip_binary)")
            return 1
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ours.json")
            cmd = [binary, "--bench", "--json", path] + (["--quick"] if args.quick else [])
            print("$ " + " ".join(cmd), flush=True)
            p = subprocess.run(cmd, cwd=ROOT, timeout=900)
            if p.returncode != 0:
                print(f"warning: {' '.join(cmd)} exited {p.returncode} (a row failed its check, or it crashed)")
            if os.path.exists(path):
                with open(path) as f:
                    ours = [json.loads(line) for line in f if line.strip()]
    print("PyTorch:", flush=True)
    theirs = torch_rows(torch, args.quick)

    # one table: a row per (op, shape), a column per implementation
    table, columns = {}, []
    for r in ours:
        key = (r["op"], r["shape"])
        table.setdefault(key, {})[r["version"]] = r["ms"]
        if r["version"] not in columns:
            columns.append(r["version"])
    for op, shape, impl, ms, _, _ in theirs:
        table.setdefault((op, shape), {})[impl] = ms
        if impl not in columns:
            columns.append(impl)
    print("\nms per call (median); 'best/torch' = fastest of ours / fastest of PyTorch's (< 1: ours faster)")
    head = f"{'op':14s} {'shape':13s}" + "".join(f" {c[:18]:>18s}" for c in columns) + f" {'best/torch':>10s}"
    print(head)
    for (op, shape), cells in table.items():
        mine = [v for k, v in cells.items() if not k.startswith("torch")]
        torch_ms = [v for k, v in cells.items() if k.startswith("torch")]
        ratio = f"{min(mine) / min(torch_ms):10.3f}" if mine and torch_ms else f"{'-':>10s}"
        print(f"{op:14s} {shape:13s}" + "".join(f" {cells[c]:18.3f}" if c in cells else f" {'-':>18s}"
                                             for c in columns) + f" {ratio}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "matrix_roots_bench.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "ours": ours,
                       "torch_rows": [dict(zip(("op", "shape", "impl", "ms", "steps", "check"), r)) for r in theirs]},
                      f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
