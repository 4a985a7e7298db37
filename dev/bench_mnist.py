"""Benchmark of train_mnist against PyTorch on the same network, same GPU, one run (GPU machine only).

  python3 dev/bench_mnist.py [--out bench_results] [--quick] [--skip_compile] [--compile_only] [--skip_torch]
                             [--time_to_99_only] [--t99_candidates 1,5] [--bin path/to/train_mnist]

1. One epoch (60000 images, the last partial batch included) at batch 64 and 512: ./train_mnist with our matmul,
   with --matmul cublas, PyTorch eager and torch.compile (model compiled, default mode). Our figure is the median of
   epochs 2..E (CUDA events around the epoch, printed by the trainer); PyTorch's the median of 3 timed epochs after
   warm-up (CUDA events). Data GPU-resident on both sides (PyTorch indexes a GPU tensor with a GPU permutation; no
   DataLoader), SGD momentum 0.9, weight decay 5e-4. TF32 on in all four (the trainer's default --tf32 1; PyTorch
   allow_tf32 for matmul and cuDNN), so the arithmetic is the same.
2. Test accuracy of the default ./train_mnist over 3 seeds.
3. Time to 99% test accuracy: candidate flag sets with --stop_at_accuracy 99 (training time only, CUDA events, the
   evaluation after each epoch excluded), each on seeds 1-3; the best is the set whose slowest seed is fastest among
   those reaching 99% on all three (--time_to_99_only runs this part alone; --t99_candidates limits the candidates
   to the given indices of FAST_CONFIGS).
--bin times another build of the trainer (e.g. the previous commit's, for before/after figures from one run).
Writes bench_mnist.csv and bench_mnist.json into --out.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import mnist as ref  # noqa: E402

BIN = os.path.join(ROOT, "train_mnist")
FAST_CONFIGS = [  # flag sets tried for the time to 99% (must fit 0.25 s on the H100)
    "--batch_size 128 --epochs 2 --lr 0.05 --lr_schedule linear --warmup_steps 100",
    "--batch_size 128 --epochs 2 --lr 0.08 --lr_schedule linear --warmup_steps 100",
    "--batch_size 128 --epochs 2 --lr 0.05 --lr_schedule cosine --warmup_steps 100",
    "--batch_size 128 --epochs 2 --lr 0.05 --momentum 0.95 --lr_schedule linear --warmup_steps 100",
    "--batch_size 160 --epochs 2 --lr 0.06 --lr_schedule linear --warmup_steps 80",
    "--batch_size 128 --epochs 2 --optimizer adamw --lr 0.002 --weight_decay 0.01 --lr_schedule linear --warmup_steps 50",
    "--batch_size 128 --epochs 2 --optimizer adamw --lr 0.003 --weight_decay 0.01 --lr_schedule linear --warmup_steps 50",
    "--batch_size 128 --epochs 2 --optimizer adamw --lr 0.0015 --weight_decay 0.01 --lr_schedule linear --warmup_steps 50",
    "--batch_size 128 --epochs 2 --optimizer adamw --lr 0.002 --weight_decay 0.05 --lr_schedule cosine --warmup_steps 50",
    "--batch_size 192 --epochs 2 --optimizer adamw --lr 0.0025 --weight_decay 0.01 --lr_schedule linear --warmup_steps 40",
    # one epoch at batch 64 / 128 (a faster trainer makes these cheaper than two epochs at batch 128)
    "--batch_size 64 --epochs 1 --lr 0.05 --lr_schedule linear --warmup_steps 100",
    "--batch_size 64 --epochs 1 --optimizer adamw --lr 0.002 --weight_decay 0.01 --lr_schedule linear --warmup_steps 100",
    "--batch_size 128 --epochs 1 --optimizer adamw --lr 0.003 --weight_decay 0.01 --lr_schedule linear --warmup_steps 50",
]


def run_ours(args, timeout=120):
    cmd = [os.path.abspath(BIN), "--confusion", "0"] + args.split()
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-2000:]}")
    epochs = [(float(a), float(ms), float(tot)) for a, ms, tot in
              re.findall(r"test acc ([\d.]+)% \| train ([\d.]+) ms \(total ([\d.]+) ms\)", out)]
    return epochs, out, time.time() - t0


def torch_epoch_ms(torch, B, compiled, n_epochs=3):
    F = torch.nn.functional
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    images, labels = ref.load_idx(os.path.join(ROOT, "data", "mnist"), "train", 60000)
    X = torch.from_numpy(ref.normalize(images)).cuda()
    Y = torch.from_numpy(labels.astype(np.int64)).cuda()
    torch.manual_seed(0)
    net = ref.build_net(torch)().cuda()
    model = torch.compile(net) if compiled else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    n = X.shape[0]
    t0 = time.time()
    perm = torch.randperm(n, device="cuda")
    for i in range(10):  # warm-up, including the last partial batch's shape (a recompile for torch.compile)
        idx = perm[i * B:(i + 1) * B]
        step(X[idx], Y[idx])
    idx = perm[n - n % B:] if n % B else perm[:B]
    step(X[idx], Y[idx])
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    times = []
    for _ in range(n_epochs):
        perm = torch.randperm(n, device="cuda")
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for i in range(0, n, B):
            idx = perm[i:i + B]
            step(X[idx], Y[idx])
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times), times, warm_s


def torch_row(torch, rows, B, compiled):
    name = "pytorch compile" if compiled else "pytorch eager"
    ms, times, warm = torch_epoch_ms(torch, B, compiled)
    rows.append(dict(batch=B, impl=name, epoch_ms=ms, detail=f"epochs ms {[round(t, 1) for t in times]}, warm-up {warm:.1f} s"))
    print(f"B={B:4d} {name:22s} {ms:9.1f} ms/epoch  (epochs: {[round(t, 1) for t in times]}, warm-up {warm:.1f} s)", flush=True)


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--epochs", type=int, default=4, help="epochs of our runs (the first is not counted)")
    ap.add_argument("--skip_compile", action="store_true", help="leave out torch.compile")
    ap.add_argument("--quick", action="store_true", help="only our epoch times")
    ap.add_argument("--skip_torch", action="store_true", help="leave out PyTorch (our epoch times, accuracy, time to 99%%)")
    ap.add_argument("--compile_only", action="store_true", help="only the torch.compile epochs (the slow part, run apart)")
    ap.add_argument("--time_to_99_only", action="store_true", help="only the time-to-99%% search (every candidate, 3 seeds)")
    ap.add_argument("--t99_candidates", default="", help="comma-separated indices of FAST_CONFIGS to try (default: all)")
    ap.add_argument("--bin", default=BIN, help="the trainer binary to time (default: ./train_mnist)")
    args = ap.parse_args()
    BIN = args.bin
    configs = FAST_CONFIGS if not args.t99_candidates else [FAST_CONFIGS[int(i)] for i in args.t99_candidates.split(",")]
    os.makedirs(args.out, exist_ok=True)
    import torch
    dev = torch.cuda.get_device_name(0)
    rows = []
    print(f"device: {dev}, trainer: {args.bin}")
    if args.compile_only:
        for B in (64, 512):
            torch_row(torch, rows, B, True)
        with open(os.path.join(args.out, "bench_mnist_compile.json"), "w") as f:
            json.dump({"device": dev, "epoch": rows}, f, indent=1)
        return
    for B in (() if args.time_to_99_only else (64, 512)):
        for name, flags in (("ours", "--matmul ours"), ("ours --matmul cublas", "--matmul cublas")):
            ep, out, _ = run_ours(f"{flags} --batch_size {B} --epochs {args.epochs} --lr 0.01 --warmup_steps 0")
            ms = statistics.median([e[1] for e in ep[1:]])
            rows.append(dict(batch=B, impl=name, epoch_ms=ms, detail=f"epochs ms {[e[1] for e in ep]}"))
            print(f"B={B:4d} {name:22s} {ms:9.1f} ms/epoch  (all epochs: {[e[1] for e in ep]})", flush=True)
        if not args.quick and not args.skip_torch:
            torch_row(torch, rows, B, False)
    result = {"device": dev, "epoch": rows}

    if not args.quick:
        accs = []
        for seed in (() if args.time_to_99_only else (1, 2, 3)):
            ep, out, wall = run_ours(f"--seed {seed}")
            accs.append(ep[-1][0])
            print(f"default ./train_mnist --seed {seed}: test acc {ep[-1][0]:.2f}%, training {ep[-1][2]:.0f} ms "
                  f"({len(ep)} epochs), wall {wall:.1f} s", flush=True)
        if accs:
            print(f"default: mean test accuracy over 3 seeds {statistics.mean(accs):.3f}% ({accs})")
            result["default_accuracy"] = dict(seeds=[1, 2, 3], accuracy=accs, mean=statistics.mean(accs))

        # every candidate on the three seeds; the best is the one whose slowest seed is fastest, among those that
        # reach 99% on all three (a flag set that reaches it on one seed only is not a configuration that does)
        fast = []
        for cfg in configs:
            seeds = []
            for seed in (1, 2, 3):
                ep, out, _ = run_ours(f"{cfg} --seed {seed} --stop_at_accuracy 99")
                hit = next((e for e in ep if e[0] >= 99.0), None)
                seeds.append(dict(seed=seed, reached=hit is not None, train_ms=hit[2] if hit else None,
                                  final_acc=ep[-1][0], epochs=len(ep)))
            ok = all(x["reached"] for x in seeds)
            worst = max(x["train_ms"] for x in seeds) if ok else None
            fast.append(dict(flags=cfg, reached=ok, worst_ms=worst, seeds=seeds))
            detail = ", ".join(f"seed {x['seed']}: " + (f"{x['train_ms']:.1f} ms ({x['final_acc']:.2f}%)" if x["reached"]
                                                        else f"not reached ({x['final_acc']:.2f}%)") for x in seeds)
            print(f"time to 99%: {cfg}: " + (f"all seeds, slowest {worst:.1f} ms" if ok else "not on every seed")
                  + f" [{detail}]", flush=True)
        best = min((f for f in fast if f["reached"]), key=lambda f: f["worst_ms"], default=None)
        print("time to 99%, best on all 3 seeds: " + (f"{best['flags']}: slowest seed {best['worst_ms']:.1f} ms"
                                                     if best else "none"), flush=True)
        result["time_to_99"] = dict(candidates=fast, best=best)

    if not args.quick and not args.skip_compile and not args.skip_torch and not args.time_to_99_only:  # last: the slowest part (compilation)
        for B in (64, 512):
            torch_row(torch, rows, B, True)
    print("\n| batch | implementation | ms / epoch | vs ours |\n|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["batch"]):
        ours = next(x["epoch_ms"] for x in rows if x["batch"] == r["batch"] and x["impl"] == "ours")
        print(f"| {r['batch']} | {r['impl']} | {r['epoch_ms']:.1f} | {r['epoch_ms'] / ours:.2f}x |")
    with open(os.path.join(args.out, "bench_mnist.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "bench_mnist.csv"), "w") as f:
        f.write("batch,impl,epoch_ms\n")
        for r in rows:
            f.write(f"{r['batch']},{r['impl']},{r['epoch_ms']:.2f}\n")
    print(f"wrote {args.out}/bench_mnist.json and .csv")


if __name__ == "__main__":
    main()
