"""PyTorch reference samplers for a UNET_CHECKPOINT, to tell a sampler bug from a model that samples badly.

Loads the checkpoint into dev/unet.py's UNetModel (EMA or raw weights) and samples from the same initial noise with
  ours       the update of scripts/generate.py / train_unet.cu (x0 clipped; DDIM eta 0 over tau_i = floor(i*T/S))
  gd         guided-diffusion's machinery written out literally: space_timesteps (section counts "S" or "ddimS"),
             the respaced betas from alphas_cumprod at the kept steps, _WrappedModel mapping the respaced index
             back to the ORIGINAL timestep, p_mean_variance + ddim_sample (eta) or p_sample
With --trace (train_unet's UNET_SAMPLE_TRACE of the same noise, UNET_SAMPLE_INIT) it compares x step by step with
our GPU sampler. Writes PNG grids and a summary (per run: saturation = fraction of |x| > 0.98 at the end; the
per-step max |x0_hat| and fraction of x0_hat clipped).

  python3 dev/unet_sample_ref.py --checkpoint CKPT --out_dir DIR [--num 16] [--seed 0] [--write_init F]
      [--trace F --trace_sampler ddim --trace_steps 50] [--weights ema|raw]
CKPT: a UNET_CHECKPOINT .bin, or its .safetensors from scripts/convert.py (--weights all: the EMA is in it).
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
try:
    import torch
except ImportError:  # a reference tool of the GPU machine: one line, not a traceback, elsewhere
    sys.exit("error: dev/unet_sample_ref.py needs PyTorch (the GPU machine has it; pip install torch)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
sys.path.insert(0, HERE)
import binio  # noqa: E402
import unet  # noqa: E402

TRACE = binio.Format("unet sample trace / init", binio.magic_number(3, 3), 1, [])


def load_model(path, weights, device):
    if path.endswith(".safetensors"):  # scripts/convert.py's copy of a checkpoint: the same tensors and fields
        import convert
        meta, tensors = convert.read_safetensors(path)
        _, cfg = convert.meta_config(path, meta)
        cfg = {k: float(v) if isinstance(v, np.floating) else v for k, v in cfg.items()}
    else:
        _, cfg, tensors = binio.read(path, binio.UNET_CHECKPOINT)
    mult = [cfg[f"mult{i}"] for i in range(cfg["n_levels"])]
    attn = [1 << k for k in range(cfg["n_levels"]) if cfg["attn_ds_mask"] >> k & 1]
    model = unet.UNetModel(cfg["image_size"], cfg["in_channels"], cfg["model_channels"], cfg["out_channels"],
                           cfg["num_res_blocks"], attn, mult, cfg["num_head_channels"])
    prefix = "ema." if weights == "ema" else ""
    sd = {n: torch.from_numpy(tensors[prefix + n]) for n in model.state_dict()}
    model.load_state_dict(sd)
    return model.to(device).eval(), cfg


# ----------------------------------------------------------------------------------------------------------------
# ours: the update of scripts/generate.py sample_cpu, in float32 on the device


def sample_ours(model, cfg, x, sampler, steps, seed, device, stats):
    T = cfg["diffusion_steps"]
    betas = np.linspace(cfg["beta_start"], cfg["beta_end"], T, dtype=np.float64)
    acp = np.cumprod(1.0 - betas)
    acp_prev = np.append(1.0, acp[:-1])
    post_var = betas * (1.0 - acp_prev) / (1.0 - acp)
    post_log_var = np.log(np.append(post_var[1], post_var[1:]))
    coef1 = betas * np.sqrt(acp_prev) / (1.0 - acp)
    coef2 = (1.0 - acp_prev) * np.sqrt(1.0 - betas) / (1.0 - acp)
    taus = list(range(T)) if sampler == "ddpm" else [(i * T) // steps for i in range(steps)]
    gen = torch.Generator(device=device).manual_seed(seed)
    xs = []
    for k, tau in enumerate(reversed(taus)):
        with torch.no_grad():
            eps = model(x, torch.full((x.shape[0],), tau, device=device, dtype=torch.int32))
        a = acp[tau]
        raw = float(np.sqrt(1.0 / a)) * x - float(np.sqrt(1.0 / a - 1.0)) * eps
        x0 = raw.clamp(-1, 1)
        stats.append((tau, float(raw.abs().max()), float((raw.abs() > 1).float().mean())))
        if sampler == "ddpm":
            mean = float(coef1[tau]) * x0 + float(coef2[tau]) * x
            x = mean + (float(np.exp(0.5 * post_log_var[tau])) * torch.randn(x.shape, generator=gen, device=device)
                        if tau > 0 else 0)
        else:
            e = (float(np.sqrt(1.0 / a)) * x - x0) / float(np.sqrt(1.0 / a - 1.0))
            ap = acp[taus[len(taus) - 2 - k]] if k < len(taus) - 1 else 1.0
            x = float(np.sqrt(ap)) * x0 + float(np.sqrt(1.0 - ap)) * e
        xs.append(x)
    return x, xs


# ----------------------------------------------------------------------------------------------------------------
# guided-diffusion, written out literally (gaussian_diffusion.py + respace.py), float64 schedule


def space_timesteps(num_timesteps, section_counts):
    """guided_diffusion.respace.space_timesteps."""
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            desired_count = int(section_counts[len("ddim"):])
            for i in range(1, num_timesteps):
                if len(range(0, num_timesteps, i)) == desired_count:
                    return set(range(0, num_timesteps, i))
            raise ValueError(f"cannot create exactly {num_timesteps} steps with an integer stride")
        section_counts = [int(x) for x in section_counts.split(",")]
    size_per = num_timesteps // len(section_counts)
    extra = num_timesteps % len(section_counts)
    start_idx = 0
    all_steps = []
    for i, section_count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if size < section_count:
            raise ValueError(f"cannot divide section of {size} steps into {section_count}")
        frac_stride = 1 if section_count <= 1 else (size - 1) / (section_count - 1)
        cur_idx = 0.0
        taken_steps = []
        for _ in range(section_count):
            taken_steps.append(start_idx + round(cur_idx))
            cur_idx += frac_stride
        all_steps += taken_steps
        start_idx += size
    return set(all_steps)


class GDDiffusion:
    """SpacedDiffusion: betas rebuilt from alphas_cumprod at the kept steps; timestep_map to the original t."""

    def __init__(self, base_betas, use_timesteps):
        base_acp = np.cumprod(1.0 - base_betas)
        last = 1.0
        new_betas, self.timestep_map = [], []
        for i, a in enumerate(base_acp):
            if i in use_timesteps:
                new_betas.append(1 - a / last)
                last = a
                self.timestep_map.append(i)
        b = np.array(new_betas, dtype=np.float64)
        self.num_timesteps = len(b)
        self.acp = np.cumprod(1.0 - b)
        self.acp_prev = np.append(1.0, self.acp[:-1])
        self.sqrt_recip_acp = np.sqrt(1.0 / self.acp)
        self.sqrt_recipm1_acp = np.sqrt(1.0 / self.acp - 1)
        self.post_var = b * (1.0 - self.acp_prev) / (1.0 - self.acp)
        self.post_log_var = np.log(np.append(self.post_var[1], self.post_var[1:]))
        self.c1 = b * np.sqrt(self.acp_prev) / (1.0 - self.acp)
        self.c2 = (1.0 - self.acp_prev) * np.sqrt(1.0 - b) / (1.0 - self.acp)

    def _ex(self, arr, t, x):  # _extract_into_tensor: float64 -> float32 per sample
        return torch.from_numpy(arr).to(x.device)[t].float()[:, None, None, None]

    def p_mean_variance(self, model, x, t, clip):
        with torch.no_grad():  # _WrappedModel: the model sees the ORIGINAL timestep
            mt = torch.tensor(self.timestep_map, device=x.device)[t]
            eps = model(x, mt)
        x0 = self._ex(self.sqrt_recip_acp, t, x) * x - self._ex(self.sqrt_recipm1_acp, t, x) * eps
        if clip:
            x0 = x0.clamp(-1, 1)
        mean = self._ex(self.c1, t, x) * x0 + self._ex(self.c2, t, x) * x
        return mean, self._ex(self.post_log_var, t, x), x0

    def eps_from_x0(self, x, t, x0):
        return (self._ex(self.sqrt_recip_acp, t, x) * x - x0) / self._ex(self.sqrt_recipm1_acp, t, x)

    def sample(self, model, x, kind, clip, eta, gen):
        xs = []
        for i in reversed(range(self.num_timesteps)):
            t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
            mean, log_var, x0 = self.p_mean_variance(model, x, t, clip)
            noise = torch.randn(x.shape, generator=gen, device=x.device)
            nonzero = float(i != 0)
            if kind == "ddpm":
                x = mean + nonzero * torch.exp(0.5 * log_var) * noise
            else:
                eps = self.eps_from_x0(x, t, x0)
                a, ap = self._ex(self.acp, t, x), self._ex(self.acp_prev, t, x)
                sigma = eta * torch.sqrt((1 - ap) / (1 - a)) * torch.sqrt(1 - a / ap)
                mean_pred = x0 * torch.sqrt(ap) + torch.sqrt(1 - ap - sigma ** 2) * eps
                x = mean_pred + nonzero * sigma * noise
            xs.append(x)
        return x, xs


# ----------------------------------------------------------------------------------------------------------------


def to_uint8(x):  # (N, 3, H, W) -> (N, H, W, 3) uint8, as train_unet's sampler
    x = x.detach().cpu().numpy()
    return np.clip(np.round((x.transpose(0, 2, 3, 1) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def save_grid(x, path):
    import generate  # scripts/generate.py's grid writer
    generate.save_grid(to_uint8(x), path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default="ema", choices=["ema", "raw"])
    p.add_argument("--write_init", default="", help="write the initial noise here (x_init NHWC) for UNET_SAMPLE_INIT")
    p.add_argument("--trace", default="", help="train_unet's UNET_SAMPLE_TRACE file of the same noise to compare")
    p.add_argument("--trace_sampler", default="ddim")
    p.add_argument("--trace_steps", type=int, default=50)
    p.add_argument("--runs", default="all", help="comma list of run names, or all")
    p.add_argument("--data_file", default="", help="UNET_DATASET: per-t epsilon MSE of the model on its images")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out_dir, exist_ok=True)
    model, cfg = load_model(args.checkpoint, args.weights, device)
    T, H = cfg["diffusion_steps"], cfg["image_size"]
    x_init = torch.from_numpy(np.random.default_rng(args.seed).standard_normal((args.num, 3, H, H),
                                                                               dtype=np.float32)).to(device)
    if args.write_init:
        binio.write(args.write_init, TRACE, {}, {"x_init": x_init.cpu().numpy().transpose(0, 2, 3, 1)})
        print(f"wrote {args.write_init}")
    summary = {"checkpoint_step": cfg.get("step"), "weights": args.weights}
    base_betas = np.linspace(cfg["beta_start"], cfg["beta_end"], T, dtype=np.float64)

    if args.data_file:  # how well the model predicts epsilon at each t (training images, fresh noise)
        x0 = unet.load_batch(args.data_file, 64, H).to(device)
        gen = torch.Generator(device=device).manual_seed(123)
        acp = np.cumprod(1.0 - base_betas)
        mse = {}
        for t in [0, 10, 50, 100, 200, 300, 400, 500, 600, 700, 800, 900, 960, 980, 999]:
            noise = torch.randn(x0.shape, generator=gen, device=device)
            xt = float(np.sqrt(acp[t])) * x0 + float(np.sqrt(1 - acp[t])) * noise
            with torch.no_grad():
                eps = model(xt, torch.full((x0.shape[0],), t, device=device, dtype=torch.int32))
            mse[t] = float(((eps - noise) ** 2).mean())
            # x0 error implied: |x0_hat - x0|^2 = (1/acp - 1) mse
            print(f"t={t}: eps mse {mse[t]:.4f}, implied x0 rmse {math.sqrt(mse[t] * (1 / acp[t] - 1)):.3f}, "
                  f"|eps_hat| rms {eps.pow(2).mean().sqrt().item():.3f}")
        summary["eps_mse_by_t"] = mse

    # ours vs our GPU sampler, step by step, same initial noise
    if args.trace:
        _, _, tt = binio.read(args.trace, TRACE)
        gpu = torch.from_numpy(tt["x_steps"]).to(device).permute(0, 3, 1, 2)
        stats = []
        _, xs = sample_ours(model, cfg, x_init, args.trace_sampler, args.trace_steps, args.seed, device, stats)
        B = gpu.shape[0] // len(xs)
        rows = []
        for k, x in enumerate(xs):
            d = (gpu[k * B:(k + 1) * B] - x[:B]).abs().max().item()
            rows.append(d)
            if k < 5 or k % 10 == 9 or k == len(xs) - 1:
                print(f"trace step {k} (t={stats[k][0]}): max |ours GPU - torch| {d:.3e}, torch max|x| "
                      f"{x[:B].abs().max().item():.3f}")
        summary["trace_max_diff_per_step"] = rows

    runs = {
        "ours_ddim50": lambda: sample_ours(model, cfg, x_init, "ddim", 50, args.seed, device, [])[0],
        "ours_ddpm1000": lambda: sample_ours(model, cfg, x_init, "ddpm", T, args.seed, device, [])[0],
    }

    def raw_ddim50():
        raw_model, _ = load_model(args.checkpoint, "raw" if args.weights == "ema" else "ema", device)
        return sample_ours(raw_model, cfg, x_init, "ddim", 50, args.seed, device, [])[0]

    def tf32_ddim50():  # TF32 in the model's convolutions and matmuls, as train_unet's default --tf32 1
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            return sample_ours(model, cfg, x_init, "ddim", 50, args.seed, device, [])[0]
        finally:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    runs["other_weights_ddim50"] = raw_ddim50
    runs["ours_ddim50_tf32"] = tf32_ddim50

    def gd(kind, spacing, clip=True, eta=0.0):
        def f():
            d = GDDiffusion(base_betas, space_timesteps(T, spacing))
            gen = torch.Generator(device=device).manual_seed(args.seed)
            return d.sample(model, x_init, kind, clip, eta, gen)[0]
        return f

    runs.update({
        "gd_ddim50_stride": gd("ddim", "ddim50"),           # timesteps 0, 20, ..., 980 (= ours)
        "gd_ddim50_uniform": gd("ddim", "50"),              # 0, 20, 41, ..., 999 (the default respacing)
        "gd_ddim50_noclip": gd("ddim", "ddim50", clip=False),
        "gd_ddim50_eta1": gd("ddim", "ddim50", eta=1.0),
        "gd_ddpm50_respaced": gd("ddpm", "50"),
        "gd_ddim250": gd("ddim", "250"),
        "gd_ddim1000": gd("ddim", str(T)),
        "gd_ddpm1000": gd("ddpm", str(T)),
    })
    wanted = list(runs) if args.runs == "all" else [r for r in args.runs.split(",") if r and r != "none"]
    for name in wanted:
        t0 = time.time()
        x = runs[name]()
        sat = float((x.abs() > 0.98).float().mean())
        summary[name] = {"saturated": sat, "std": float(x.std()), "mean": float(x.mean()),
                         "seconds": time.time() - t0}
        save_grid(x, os.path.join(args.out_dir, f"{name}.png"))
        print(f"{name}: saturated {sat:.3f}, std {x.std().item():.3f}, mean {x.mean().item():+.3f} "
              f"({time.time() - t0:.1f} s)", flush=True)
    # the x0 prediction along ours_ddim50 (how much clipping does)
    stats = []
    sample_ours(model, cfg, x_init, "ddim", 50, args.seed, device, stats)
    summary["ours_ddim50_x0_stats"] = stats
    for tau, mx, frac in stats[:6] + stats[-3:]:
        print(f"ddim50 t={tau}: max |x0_hat| {mx:.2f}, clipped fraction {frac:.3f}")
    with open(os.path.join(args.out_dir, "sample_ref.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
