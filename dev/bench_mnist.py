"""Benchmark of train_mnist against PyTorch on the same network, same GPU, one run (GPU machine only).

  python3 dev/bench_mnist.py [--out bench_results] [--quick] [--skip_compile] [--compile_only] [--skip_torch]
                             [--time_to_99_only] [--t99_candidates 1,5] [--bin path/to/train_mnist]
                             [--second_order | --second_order_only] [--so_optimizers sgd,adamw,shampoo,kfac,muon]
                             [--so_quick] [--so_dry_run]

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
4. (--second_order, or --second_order_only alone) Steps to 99% (issue 21): for each optimizer of --so_optimizers
   (sgd, adamw, shampoo, kfac, muon) the candidates of SO_SWEEP (batch 128; learning rates around each optimizer's
   known-good value; linear decay over 1 and 2 epochs), each on seeds 1-3 with --eval_every 20
   --stop_at_accuracy 99 --confusion 0. A candidate's steps to 99% is the step of the first evaluation (every 20
   steps and at each epoch's end) reaching it; the best per optimizer is the candidate whose worst seed needs the
   fewest steps, among those reaching 99% on all three (the first of equals). Seed 1 runs first; a candidate is
   dropped (its other seeds not run, the run stopped there) as soon as a seed has not reached 99% before the best
   worst-seed step count found so far for that optimizer: it cannot be the best. Cost per step = the run's
   training time to 99% / its steps (CUDA events, evaluations excluded; with --eval_every 20 the graphed optimizers
   run 20-step graphs), the median over the best candidate's seeds, against SGD's. Where the candidates come from:
   - sgd, adamw: FAST_CONFIGS above (dev/mnist_NOTES.md "Time to 99% on every seed": SGD lr 0.08 linear warm-up 100,
     AdamW lr 0.002 weight decay 0.01 warm-up 50 are the best of that search), lr one step either side, and on
     the side where the H100 found the best (SGD 0.05, AdamW 0.003 in session 20) one or two steps further, so
     that no baseline's best sits at the edge of its grid;
   - muon: the trainer's defaults (muon_lr 0.02, momentum 0.95, PyTorch's torch.optim.Muon values; README), which
     reached 99.14% in 2 epochs at batch 64 (dev/mnist_NOTES.md, session 17), muon_lr halved and doubled; the
     biases take AdamW's known-good lr 0.002 and weight decay 0.01 (--lr, --weight_decay also Muon's decay);
   - shampoo: grafted on SGD-momentum (the trainer's default --graft sgd, so --lr is an SGD step size) with the
     default roots every 20 steps from step 20 and damping 1e-3, which reached 99.16% (2 epochs at batch 64,
     dev/mnist_NOTES.md); lr 0.03 (the default), 0.05 and 0.08 (SGD's);
   - kfac: with Shampoo's settings every learning rate failed on the H100 (session 20: SGD graft, damping 1e-3:
     lr 0.05 and 0.08 diverged, 0.03 reached 98.46% in 2 epochs; damping 0.01-0.3 at lr 0.03-0.08: at most 98.97%,
     0.1 and 0.3 diverged), so the candidates are AdamW's graft (as distributed_shampoo's usual setting) around
     AdamW's best lr with damping 0.01-0.1, and the SGD graft with inverses every 5 steps.
   --so_quick keeps the first value of each list (2 candidates per optimizer); --so_dry_run lists the candidates and
   exits (no GPU needed). About 4-5 minutes on an H100 for all five (K-FAC and Shampoo run about 5 ms a step).
--bin times another build of the trainer (e.g. the previous commit's, for before/after figures from one run).
Writes bench_mnist.csv and bench_mnist.json into --out (part 4: bench_mnist_second_order.json and .csv).
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

# part 4 (steps to 99%): per optimizer, (shared flags, flag name of the swept learning rate, its three values, the
# middle one first: --so_quick keeps it); each with --epochs 1 and 2 of a linear schedule at batch 128
SO_SWEEP = {
    "sgd": ("--warmup_steps 100", "--lr", ["0.08", "0.05", "0.12", "0.03"]),
    "adamw": ("--optimizer adamw --weight_decay 0.01 --warmup_steps 50", "--lr",
              ["0.002", "0.0015", "0.003", "0.004", "0.006"]),
    "shampoo": ("--optimizer shampoo --warmup_steps 100", "--lr", ["0.05", "0.03", "0.08"]),
    # K-FAC: the graft, the damping (relative to each factor's mean eigenvalue), the learning rate and the inverses'
    # interval together; each value holds its flags
    "kfac": ("--optimizer kfac", "", [
        "--graft adam --weight_decay 0.01 --warmup_steps 50 --lr 0.003 --precond_damping 0.03",
        "--graft adam --weight_decay 0.01 --warmup_steps 50 --lr 0.003 --precond_damping 0.01",
        "--graft adam --weight_decay 0.01 --warmup_steps 50 --lr 0.002 --precond_damping 0.03",
        "--graft adam --weight_decay 0.01 --warmup_steps 50 --lr 0.004 --precond_damping 0.1",
        "--warmup_steps 100 --lr 0.03 --precond_damping 0.03 --precond_every 5 --precond_start 5",
        "--warmup_steps 100 --lr 0.05 --precond_damping 0.01 --precond_every 5 --precond_start 5"]),
    "muon": ("--optimizer muon --lr 0.002 --weight_decay 0.01 --warmup_steps 50", "--muon_lr",
             ["0.02", "0.01", "0.04"]),
}
SO_EVERY = 20  # evaluation interval in steps: the steps-to-99% resolution


def so_candidates(name, quick):
    shared, flag, values = SO_SWEEP[name]
    return [f"--batch_size 128 --lr_schedule linear --epochs {e} {shared} {flag + ' ' if flag else ''}{v}"
            for v in values[:1 if quick else len(values)] for e in (1, 2)]


SO_EVAL = re.compile(r"^step +(\d+) \| epoch +(\d+)/\d+ \| test loss [\d.]+ \| test acc ([\d.]+)% \| "
                     r"train total ([\d.]+) ms$")
SO_NAN = re.compile(r"^step +(\d+) \| epoch +\d+/\d+ \| test loss (nan|inf|-inf) ")  # the run diverged there
SO_REACHED = re.compile(r"^reached ([\d.]+)% \(--stop_at_accuracy [\d.]+\) at step (\d+) \(epoch (\d+)\) after "
                        r"([\d.]+) ms of training$")


def run_to_99(flags, seed, bound, timeout=300):
    """One run of flags on seed to 99% (or its end). bound: stop it once an evaluation at or past this step has not
    reached 99% (None: never): it cannot beat a candidate that reached it there. Returns dict(seed, reached, steps,
    train_ms, best_acc, last_step, cut, diverged). A run that diverges (a NaN evaluation, or the trainer's exit on a
    NaN or diverging loss) is a result, stopped there; any other trainer error raises."""
    cmd = [os.path.abspath(BIN), "--confusion", "0", "--seed", str(seed), "--eval_every", str(SO_EVERY),
           "--stop_at_accuracy", "99"] + flags.split()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0, lines, evals, hit, cut, diverged = time.time(), [], [], None, False, None
    for line in p.stdout:
        lines.append(line)
        m = SO_NAN.match(line)
        if m and hit is None:
            diverged = int(m.group(1))
            p.terminate()
            break
        m = SO_EVAL.match(line.rstrip("\n"))
        if m:
            evals.append((int(m.group(1)), float(m.group(3)), float(m.group(4))))
        m = SO_REACHED.match(line.rstrip("\n"))
        if m:
            hit = dict(steps=int(m.group(2)), train_ms=float(m.group(4)), acc=float(m.group(1)))
        if hit is None and evals and bound is not None and evals[-1][0] >= bound and evals[-1][1] < 99.0:
            cut = True  # it cannot be the best any more: stopped here, not an error
            p.terminate()
            break
        if time.time() - t0 > timeout:
            p.kill()
            raise RuntimeError(f"{' '.join(cmd)}: no end after {timeout} s")
    p.stdout.close()
    rc = p.wait()
    out = "".join(lines)
    if diverged is None and rc != 0 and re.search(r"training loss (is nan|is inf|diverges)", out):
        diverged = evals[-1][0] if evals else 0
    if diverged is not None:
        return dict(seed=seed, reached=False, steps=None, train_ms=None,
                    best_acc=max((e[1] for e in evals), default=0.0), last_step=diverged, cut=False, diverged=True)
    if not cut and (rc != 0 or not evals):
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}):\n{out[-2000:]}")
    if not cut and hit is None and "did not reach --stop_at_accuracy 99" not in out:
        raise RuntimeError(f"{' '.join(cmd)}: neither a 'reached' nor a 'did not reach' line:\n{out[-2000:]}")
    return dict(seed=seed, reached=hit is not None, steps=hit["steps"] if hit else None,
                train_ms=hit["train_ms"] if hit else None, best_acc=max(e[1] for e in evals),
                last_step=evals[-1][0], cut=cut, diverged=False)


def second_order(args):
    """Part 4: the best candidate of each optimizer by its worst seed's steps to 99%, its time and cost per step."""
    names = [n for n in args.so_optimizers.split(",") if n]
    for n in names:
        if n not in SO_SWEEP:
            raise SystemExit(f"error: --so_optimizers expects names from {','.join(SO_SWEEP)}, found '{n}'")
    if args.so_dry_run:
        for n in names:
            for c in so_candidates(n, args.so_quick):
                print(f"{n:8s} {c} --eval_every {SO_EVERY} --stop_at_accuracy 99 --confusion 0 --seed 1|2|3")
        return None
    t_start = time.time()
    best, tried = {}, {}
    for n in names:
        tried[n] = []
        for flags in so_candidates(n, args.so_quick):
            bound = best[n]["worst_steps"] if n in best else None
            seeds = []
            for seed in (1, 2, 3):
                r = run_to_99(flags, seed, bound)
                seeds.append(r)
                if not r["reached"] or (bound is not None and r["steps"] >= bound):
                    break  # cannot be the best: its other seeds are not run
            ok = len(seeds) == 3 and all(r["reached"] for r in seeds)
            c = dict(flags=flags, seeds=seeds, all_reached=ok)
            if ok:
                c["worst_steps"] = max(r["steps"] for r in seeds)
                c["ms_per_step"] = statistics.median(r["train_ms"] / r["steps"] for r in seeds)
                if n not in best or c["worst_steps"] < best[n]["worst_steps"]:
                    best[n] = c
            tried[n].append(c)
            detail = ", ".join(f"seed {r['seed']}: " + (f"{r['steps']} steps {r['train_ms']:.1f} ms" if r["reached"]
                               else f"{'diverged at' if r['diverged'] else 'stopped at' if r['cut'] else 'not by'} "
                               f"step {r['last_step']} "
                               f"(best {r['best_acc']:.2f}%)") for r in seeds)
            print(f"steps to 99%: {n:8s} {flags}: " + (f"worst seed {c['worst_steps']} steps" if ok else "dropped")
                  + f" [{detail}]", flush=True)
    sgd_ms = best["sgd"]["ms_per_step"] if "sgd" in best else None
    print(f"\nsteps to 99% (evaluations every {SO_EVERY} steps, seeds 1-3; {time.time() - t_start:.0f} s of runs)")
    print("| optimizer | flags | steps to 99% (seeds 1, 2, 3) | max | training ms to 99% | ms/step | vs SGD |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for n in names:
        c = best.get(n)
        if c is None:
            print(f"| {n} | none of {len(tried[n])} candidates reached 99% on all 3 seeds | | | | | |")
            rows.append(dict(optimizer=n, flags=None))
            continue
        rel = c["ms_per_step"] / sgd_ms if sgd_ms else None
        steps = [r["steps"] for r in c["seeds"]]
        ms = [r["train_ms"] for r in c["seeds"]]
        print(f"| {n} | `{c['flags']}` | {', '.join(map(str, steps))} | {c['worst_steps']} | "
              f"{', '.join(f'{x:.1f}' for x in ms)} | {c['ms_per_step']:.3f} | "
              + (f"{rel:.2f}x |" if rel else "n/a |"))
        rows.append(dict(optimizer=n, flags=c["flags"], steps=steps, worst_steps=c["worst_steps"], train_ms=ms,
                         ms_per_step=c["ms_per_step"], cost_vs_sgd=rel))
    verdict = {}
    for n in ("shampoo", "kfac", "muon"):
        if n not in names:
            continue
        base = {b: best[b]["worst_steps"] if b in best else None for b in ("sgd", "adamw") if b in names}
        if n not in best or len(base) < 2:
            why = "not every baseline ran" if len(base) < 2 else "reached 99% on all seeds with no candidate"
            print(f"{n}: fewer steps than both best SGD and best AdamW: n/a ({why})")
            verdict[n] = None
            continue
        # a baseline with no candidate reaching 99% on all seeds is beaten by any that does
        fewer = all(v is None or best[n]["worst_steps"] < v for v in base.values())
        print(f"{n}: fewer steps than both best SGD and best AdamW: {'yes' if fewer else 'no'} "
              f"({best[n]['worst_steps']} vs " + ", ".join(f"{b} {v if v is not None else 'none reached'}"
                                                            for b, v in base.items()) + ")")
        verdict[n] = fewer
    result = dict(eval_every=SO_EVERY, seeds=[1, 2, 3], quick=args.so_quick, best=rows, verdict=verdict,
                  candidates=tried, seconds=time.time() - t_start)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_mnist_second_order.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "bench_mnist_second_order.csv"), "w") as f:
        f.write("optimizer,flags,steps_seed1,steps_seed2,steps_seed3,worst_steps,ms_seed1,ms_seed2,ms_seed3,"
                "ms_per_step,cost_vs_sgd\n")
        for r in rows:
            if r["flags"] is None:
                f.write(f"{r['optimizer']},,,,,,,,,,\n")
                continue
            rel = f"{r['cost_vs_sgd']:.3f}" if r["cost_vs_sgd"] else ""
            f.write(f"{r['optimizer']},{r['flags']}," + ",".join(map(str, r["steps"])) + f",{r['worst_steps']},"
                    + ",".join(f"{x:.2f}" for x in r["train_ms"]) + f",{r['ms_per_step']:.4f},{rel}\n")
    print(f"wrote {args.out}/bench_mnist_second_order.json and .csv")
    return result


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


def gpu_name():
    p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else "unknown GPU"


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
    ap.add_argument("--second_order", action="store_true", help="also part 4: steps to 99%% of every optimizer")
    ap.add_argument("--second_order_only", action="store_true", help="only part 4")
    ap.add_argument("--so_optimizers", default=",".join(SO_SWEEP), help="part 4's optimizers (comma list)")
    ap.add_argument("--so_quick", action="store_true", help="part 4 with the middle learning rate only")
    ap.add_argument("--so_dry_run", action="store_true", help="list part 4's candidate runs and exit (no GPU)")
    args = ap.parse_args()
    BIN = args.bin
    if args.second_order_only or args.so_dry_run:
        if not args.so_dry_run:
            print(f"device: {gpu_name()}, trainer: {args.bin}")
        second_order(args)
        return
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
    if args.second_order:
        second_order(args)


if __name__ == "__main__":
    main()
