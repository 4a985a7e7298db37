"""Benchmark of train_linreg against PyTorch on the same work, in one run on one GPU.

Ours: ./dev/linreg --bench_json (CUDA events, medians): the per-operation breakdown of one epoch, every kernel
version over 200 epochs at sizes from 500 to 100M points. PyTorch, in this same run: eager on the GPU,
torch.compile on the GPU, and the CPU, each a full-batch nn.Linear + MSELoss + SGD loop over 200 epochs on data of
the same size and distribution (80/20 split). Prints tables, writes linreg.json and linreg.csv into --out, and the
charts through scripts/plot_linreg.py.

  python3 dev/bench_linreg.py [--out bench_results] [--quick]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError:  # a reference tool of the GPU machine: one line, not a traceback, elsewhere
    sys.exit("error: dev/bench_linreg.py needs PyTorch (the GPU machine has it; pip install torch)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [500, 5000, 50000, 500000, 5000000, 50000000, 100000000]
EPOCHS = 200


def make_data(n, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.rand(n, 1, device=device, generator=g) * 10
    y = 0.7 * x + 0.3 + 0.1 * torch.randn(n, 1, device=device, generator=g)
    n_train = int(round(0.8 * n))
    return x[:n_train].contiguous(), y[:n_train].contiguous()


def make_step(x, y, compiled):
    model = torch.nn.Linear(1, 1).to(x.device)
    with torch.no_grad():
        model.weight.fill_(0.83)
        model.bias.fill_(0.7645)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.MSELoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return torch.compile(step) if compiled else step


def time_gpu(step, epochs, reps):
    for _ in range(3):
        step()  # warm-up (and compilation)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(epochs):
            step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_cpu(step, epochs):
    step()
    t0 = time.perf_counter()
    for _ in range(epochs):
        step()
    return 1e3 * (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    sizes = [50000, 5000000] if args.quick else SIZES
    ours_path = os.path.join(args.out, "linreg_ours.json")
    subprocess.run([os.path.join(ROOT, "dev", "linreg"), "--bench_json", ours_path], cwd=ROOT, check=True)
    ours = json.load(open(ours_path))
    ours_by_n = {row["points"]: row for row in ours["sweep"]}
    rows = []
    for n in sizes:
        x, y = make_data(n, "cuda")
        eager = time_gpu(make_step(x, y, False), EPOCHS, 3)
        torch._dynamo.reset()
        compiled = time_gpu(make_step(x, y, True), EPOCHS, 3)
        xc, yc = x.cpu(), y.cpu()
        # the CPU is slow at large sizes: time fewer epochs there and scale to 200 (said in the table)
        cpu_epochs = EPOCHS if n <= 5000000 else 10
        if args.quick and n >= 5000000:
            cpu_epochs = 5
        cpu = time_cpu(make_step(xc, yc, False), cpu_epochs) * EPOCHS / cpu_epochs
        o = ours_by_n.get(n, {})
        rows.append({"points": n, "torch_cpu_ms": cpu, "torch_cpu_epochs_timed": cpu_epochs, "torch_eager_ms": eager,
                     "torch_compile_ms": compiled, **{f"ours_v{v}_ms": o.get(f"v{v}") for v in range(1, 5)}})
        del x, y, xc, yc
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    print(f"\ntrain_linreg against PyTorch, 200 epochs, ms (medians; CUDA events), {gpu}, {time.strftime('%Y-%m-%d')}")
    print("| points | torch CPU | torch eager | torch.compile | v1 unfused | v2 fused | v3 streams | v4 persistent | eager / v4 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cpu = f"{r['torch_cpu_ms']:.1f}" + ("" if r["torch_cpu_epochs_timed"] == EPOCHS else f" ({r['torch_cpu_epochs_timed']} ep. x{EPOCHS // r['torch_cpu_epochs_timed']})")
        v = [r[f"ours_v{k}_ms"] for k in range(1, 5)]
        vs = " | ".join("-" if t is None else f"{t:.3f}" for t in v)
        ratio = f"{r['torch_eager_ms'] / v[3]:.0f}x" if v[3] else "-"
        print(f"| {r['points']} | {cpu} | {r['torch_eager_ms']:.2f} | {r['torch_compile_ms']:.2f} | {vs} | {ratio} |")
    b = ours["breakdown_us"]
    print(f"\none epoch at 5M points (4M train), us: forward {b['forward']:.2f}, loss {b['loss']:.2f}, gradient "
          f"{b['gradient']:.2f}, update {b['update']:.2f}; fused forward+loss+gradient {b['fused']:.2f}")
    result = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "epochs": EPOCHS, "rows": rows,
              "breakdown_us": b, "datagen_ms_5M": ours.get("datagen_ms_5M")}
    with open(os.path.join(args.out, "linreg.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "linreg.csv"), "w") as f:
        keys = list(rows[0].keys())
        f.write(",".join(keys) + "\n")
        for r in rows:
            f.write(",".join("" if r[k] is None else str(r[k]) for k in keys) + "\n")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_linreg.py"), os.path.join(args.out, "linreg.json"),
                    "--out", args.out], check=True)


if __name__ == "__main__":
    main()
