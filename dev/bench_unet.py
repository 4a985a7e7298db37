"""A UNet training step at batch 32, ours against PyTorch, in one run (GPU machine; needs torch).

  python3 dev/bench_unet.py [--out bench_results] [--modes eager,compile,reduce-overhead] [--steps 20]
                            [--conv_versions 5,6]

Same work on both sides: the default model of dev/unet.py (64 channels, mult 1,2,3,4, 2 res blocks, attention at
16x16 and 8x8), 64x64 images, batch 32, q_sample + forward + MSE + backward + AdamW (lr 1e-4). TF32 allowed on both
sides (torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32 True; train_unet --tf32 1).
PyTorch: eager, torch.compile(model), torch.compile(model, mode="reduce-overhead") (CUDA graphs), each on a fresh
model, warmed up, then --steps steps timed one by one with CUDA events; median ms. Ours: ./train_unet on
data/sunflowers64.bin, its per-window ms/step (CUDA events over --log_every steps, first window dropped), median;
--conv_versions times it once per TF32 convolution version (UNET_CONV_V: 6 mma.sync, the default; 5 the previous
wmma kernels), so old and new kernels and PyTorch are measured in the same run. A mode listed twice
(--modes eager,eager) runs twice on fresh models (PyTorch eager's step time varies from run to run).
Prints a table, writes bench_unet.csv and bench_unet.json into --out.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))


def bench_ours(binary, steps, batch, conv_v):
    window = 10
    env = dict(os.environ, UNET_CONV_V=str(conv_v))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [binary, "--steps", str(window * (steps // window + 1)), "--log_every", str(window), "--save_every", "0",
               "--batch_size", str(batch), "--output_dir", tmp, "--tf32", "1"]
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
        ms = [float(m.group(1)) for m in re.finditer(r"\|\s*([0-9.]+) ms/step", r.stdout)]
    if len(ms) < 2:
        raise RuntimeError(f"no ms/step lines in: {r.stdout[-2000:]}")
    return statistics.median(ms[1:]), ms, time.time() - t0


def bench_torch(mode, steps, batch, warmup):
    import torch
    import torch.nn.functional as F
    import unet
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = unet.UNetModel().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    diffusion = unet.Diffusion(1000, 1e-4, 0.02)
    fwd = model
    if mode == "compile":
        fwd = torch.compile(model)
    elif mode == "reduce-overhead":
        fwd = torch.compile(model, mode="reduce-overhead")
    x0 = torch.rand(batch, 3, 64, 64, device=dev) * 2 - 1

    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        t = torch.randint(0, 1000, (batch,), device=dev)
        noise = torch.randn_like(x0)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(fwd(diffusion.q_sample(x0, t, noise), t), noise)
        loss.backward()
        opt.step()
        return loss

    t0 = time.time()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del model, opt, fwd
    torch.cuda.empty_cache()
    return statistics.median(times), times, warm_s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results")
    p.add_argument("--modes", default="eager,compile,reduce-overhead")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--binary", default=os.path.join(ROOT, "train_unet"))
    p.add_argument("--conv_versions", default="6", help="UNET_CONV_V values to time ours with, e.g. 5,6")
    args = p.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("no GPU")
    except ImportError as e:
        print(f"SKIP bench_unet: needs torch with a GPU ({e})")
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = []
    conv_versions = [int(v) for v in args.conv_versions.split(",") if v]
    if not conv_versions or any(v not in (5, 6) for v in conv_versions):
        p.error("--conv_versions: a comma-separated list of 5 and 6")
    ours_ms = None
    for cv in conv_versions:
        ms, ms_all, wall_s = bench_ours(args.binary, args.steps, args.batch_size, cv)
        rows.append(dict(impl=f"train_unet (ours, --tf32 1, conv v{cv})", ms=ms, wall_s=wall_s))
        print(f"ours, conv v{cv}: {ms:.2f} ms/step (windows {['%.2f' % v for v in ms_all]})", flush=True)
        if ours_ms is None or cv == 6:
            ours_ms = ms  # the "vs ours" column: the default kernels when timed
    for mode in [m for m in args.modes.split(",") if m]:
        try:
            ms, all_ms, warm_s = bench_torch(mode, args.steps, args.batch_size, 3)
            rows.append(dict(impl=f"pytorch {mode}", ms=ms, wall_s=warm_s))
            print(f"pytorch {mode}: {ms:.2f} ms/step (warm-up {warm_s:.1f} s)", flush=True)
        except Exception as e:  # report the mode and go on with the others
            rows.append(dict(impl=f"pytorch {mode}", ms=float("nan"), wall_s=0.0, error=str(e)[:300]))
            print(f"pytorch {mode}: failed: {e}", flush=True)
    import torch
    dev = torch.cuda.get_device_name(0)
    print(f"\nUNet training step, batch {args.batch_size}, 64x64, TF32 allowed, {dev}, torch {torch.__version__}")
    print(f"{'implementation':32s} {'ms/step':>9s} {'vs ours':>8s}")
    for r in rows:
        print(f"{r['impl']:32s} {r['ms']:9.2f} {r['ms'] / ours_ms:8.2f}x")
    with open(os.path.join(args.out, "bench_unet.csv"), "w") as f:
        f.write("impl,ms_per_step\n")
        for r in rows:
            f.write(f"{r['impl']},{r['ms']:.3f}\n")
    with open(os.path.join(args.out, "bench_unet.json"), "w") as f:
        json.dump(dict(device=dev, torch=torch.__version__, batch_size=args.batch_size, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
