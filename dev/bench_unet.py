"""A UNet training step, ours against PyTorch at its best settings, in one run (GPU machine; needs torch).

  python3 dev/bench_unet.py [--out bench_results] [--batch_sizes 32,128] [--modes eager,compile,reduce-overhead,best]
                            [--precisions bf16,tf32] [--steps 20]

Same work on both sides: the default model of dev/unet.py (64 channels, mult 1,2,3,4, 2 res blocks, attention at
16x16 and 8x8), 64x64 images, q_sample + forward + MSE + backward + AdamW (lr 1e-4), at each batch size.
PyTorch modes, each on a fresh model, warmed up, then --steps steps timed one by one with CUDA events (median):
  eager, compile, reduce-overhead   TF32 allowed (cudnn and matmul), fp32 weights and activations, foreach AdamW
  best                              torch.compile(mode="reduce-overhead") + torch.autocast(bfloat16) + channels_last
                                    + attention through F.scaled_dot_product_attention + AdamW(fused=True): PyTorch's
                                    fastest settings for this model
Ours: ./train_unet on data/sunflowers64.bin at each --precisions value, its per-window ms/step (CUDA events over 10
steps, first window dropped), median. Peak memory: PyTorch's torch.cuda.max_memory_reserved() (its allocator's peak,
CUDA context excluded); ours: what the trainer reports it took from the device (everything is allocated up front).
Prints a table per batch size with each row's ratio to PyTorch's best; writes bench_unet.csv and bench_unet.json.
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


def bench_ours(binary, steps, batch, precision):
    window = 10
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [binary, "--steps", str(window * (steps // window + 2)), "--log_every", str(window), "--save_every", "0",
               "--batch_size", str(batch), "--output_dir", tmp, "--precision", precision]
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
        ms = [float(m.group(1)) for m in re.finditer(r"\|\s*([0-9.]+) ms/step", r.stdout)]
        mem = re.search(r"GPU memory: ([0-9.]+) MiB used", r.stdout)
    if len(ms) < 2:
        raise RuntimeError(f"no ms/step lines in: {r.stdout[-2000:]}")
    return statistics.median(ms[1:]), ms, time.time() - t0, float(mem.group(1)) if mem else float("nan")


def bench_torch(mode, steps, batch, warmup):
    import torch
    import torch.nn.functional as F
    import unet
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    dev = torch.device("cuda")
    best = mode == "best"
    model = unet.UNetModel(sdpa=best).to(dev)
    if best:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            fused=True if best else None)
    diffusion = unet.Diffusion(1000, 1e-4, 0.02)
    fwd = model
    if mode == "compile":
        fwd = torch.compile(model)
    elif mode in ("reduce-overhead", "best"):
        fwd = torch.compile(model, mode="reduce-overhead")
    x0 = torch.rand(batch, 3, 64, 64, device=dev) * 2 - 1
    if best:
        x0 = x0.contiguous(memory_format=torch.channels_last)

    def step():
        if mode in ("reduce-overhead", "best"):
            torch.compiler.cudagraph_mark_step_begin()
        t = torch.randint(0, 1000, (batch,), device=dev)
        noise = torch.randn_like(x0)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=best):
            loss = F.mse_loss(fwd(diffusion.q_sample(x0, t, noise), t), noise)
        loss.backward()
        opt.step()
        return loss

    torch.cuda.reset_peak_memory_stats()
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
    peak = torch.cuda.max_memory_reserved() / 2**20
    del model, opt, fwd
    torch.compiler.reset()
    torch.cuda.empty_cache()
    return statistics.median(times), times, warm_s, peak


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results")
    p.add_argument("--modes", default="eager,compile,reduce-overhead,best")
    p.add_argument("--precisions", default="bf16,tf32", help="train_unet --precision values to time")
    p.add_argument("--batch_sizes", default="32,128")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--binary", default=os.path.join(ROOT, "train_unet"))
    args = p.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("no GPU")
    except ImportError as e:
        print(f"SKIP bench_unet: needs torch with a GPU ({e})")
        return 0
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        p.error("--batch_sizes: comma-separated integers")
    precisions = [q for q in args.precisions.split(",") if q]
    if any(q not in ("bf16", "tf32", "fp32") for q in precisions):
        p.error("--precisions: a comma-separated list of bf16, tf32, fp32")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name(0)
    rows = []
    for batch in batches:
        for q in precisions:
            ms, ms_all, wall_s, mem = bench_ours(args.binary, args.steps, batch, q)
            rows.append(dict(batch=batch, impl=f"train_unet --precision {q}", ms=ms, peak_mib=mem, wall_s=wall_s))
            print(f"batch {batch} ours {q}: {ms:.2f} ms/step, {mem:.0f} MiB (windows "
                  f"{['%.2f' % v for v in ms_all]})", flush=True)
        for mode in [m for m in args.modes.split(",") if m]:
            try:
                ms, all_ms, warm_s, peak = bench_torch(mode, args.steps, batch, args.warmup)
                rows.append(dict(batch=batch, impl=f"pytorch {mode}", ms=ms, peak_mib=peak, wall_s=warm_s))
                print(f"batch {batch} pytorch {mode}: {ms:.2f} ms/step, peak {peak:.0f} MiB (warm-up {warm_s:.1f} s)",
                      flush=True)
            except Exception as e:  # report the mode and go on with the others
                rows.append(dict(batch=batch, impl=f"pytorch {mode}", ms=float("nan"), peak_mib=float("nan"),
                                 wall_s=0.0, error=str(e)[:300]))
                print(f"batch {batch} pytorch {mode}: failed: {e}", flush=True)
    print(f"\nUNet training step, 64x64, {dev}, torch {torch.__version__} (medians; best = reduce-overhead + bf16 "
          f"autocast + channels_last + SDPA + fused AdamW)")
    for batch in batches:
        best = [r["ms"] for r in rows if r["batch"] == batch and r["impl"] == "pytorch best"]
        ref = best[0] if best and best[0] == best[0] else None
        print(f"batch {batch}")
        print(f"  {'implementation':32s} {'ms/step':>9s} {'img/s':>8s} {'peak MiB':>9s} {'best/this':>10s}")
        for r in rows:
            if r["batch"] != batch:
                continue
            speed = f"{ref / r['ms']:9.2f}x" if ref else "        -"
            print(f"  {r['impl']:32s} {r['ms']:9.2f} {1000 * batch / r['ms']:8.0f} {r['peak_mib']:9.0f} {speed}")
    with open(os.path.join(args.out, "bench_unet.csv"), "w") as f:
        f.write("batch,impl,ms_per_step,peak_mib\n")
        for r in rows:
            f.write(f"{r['batch']},{r['impl']},{r['ms']:.3f},{r['peak_mib']:.0f}\n")
    with open(os.path.join(args.out, "bench_unet.json"), "w") as f:
        json.dump(dict(device=dev, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
