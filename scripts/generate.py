"""Samples images from a saved UNET_CHECKPOINT and writes them as a PNG grid.

  python3 scripts/generate.py --checkpoint out/unet/model.bin --out samples.png --num_samples 16 \
      [--sampler ddpm | --sampler ddim --steps 50] [--weights ema|raw] [--device auto|cuda|cpu] [--seed 0]

Samplers (the model predicts epsilon; linear betas from the checkpoint header, float64 schedule as dev/unet.py):
  ddpm  all diffusion_steps steps, t = T-1 .. 0: x0_hat = clip(x_t/sqrt(acp_t) - sqrt(1/acp_t - 1) eps, -1, 1),
        x_{t-1} = c1_t x0_hat + c2_t x_t + sigma_t z (z = 0 at t = 0), the posterior mean coefficients and the
        posterior variance sigma_t^2 = beta_t (1 - acp_{t-1}) / (1 - acp_t) ("fixed small"), log-variance clipped
        at t = 0 to that of t = 1, as guided-diffusion.
  ddim  eta 0 over --steps S timesteps tau_i = floor(i*T/S), i = S-1 .. 0: x0_hat as above (clipped), eps recomputed
        from the clipped x0_hat, x_prev = sqrt(acp_prev) x0_hat + sqrt(1 - acp_prev) eps (acp_prev = 1 after tau_0).
Devices (--device, the trainers' values):
  cuda  runs `BINARY --sample FILE --load CKPT --num_samples N --sampler S --use_ema 0|1 --seed N --device cuda`
        (and `--sample_steps K` for ddim; train_unet writes the samples as a UNET_DATASET) and reads FILE back.
  cpu   a NumPy implementation of dev/unet.py's forward (NHWC, 3x3 convolutions as im2col + one matmul): slow but
        dependency-free (about a second per image per step for the 64x64 default model on a few cores).
Default (auto): cuda when the binary exists and nvidia-smi lists a GPU, else cpu; the choice is printed in one line.
Weights: the EMA weights when the checkpoint has them (--weights ema), else the raw ones; --weights forces one.
Checkpoints written by train_unet before its EMA warm-up (2026-11-22) hold an EMA that still carries ema_rate^step
of the zero-initialised output layers: DDPM is fine with it, DDIM gives saturated noise; use --weights raw there.
"""
import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import binio  # noqa: E402

GROUPS, GN_EPS = 32, 1e-5


# ----------------------------------------------------------------------------------------------------------------
# the model's structure, read from a header (UNET_MODEL_FIELDS)


# Bounds on what a header may claim (the ranges of train_unet's flags): a corrupt header never sizes an allocation.
MAX_IMAGE_SIZE, MAX_CHANNELS, MAX_RES_BLOCKS, MAX_DIFFUSION_STEPS, MAX_STEP = 4096, 65536, 16, 100000, 10**9


class ModelConfig:
    def __init__(self, cfg, path="checkpoint"):
        def bad(field, expected):
            raise binio.FormatError(f"{path}: header field {field} is {cfg[field]}, expected {expected}")

        def bounded(field, lo, hi):
            if not lo <= cfg[field] <= hi:
                bad(field, f"{lo}..{hi}")

        self.image_size, self.model_channels = cfg["image_size"], cfg["model_channels"]
        self.in_channels, self.out_channels = cfg["in_channels"], cfg["out_channels"]
        self.num_res_blocks, self.num_head_channels = cfg["num_res_blocks"], cfg["num_head_channels"]
        self.diffusion_steps = cfg["diffusion_steps"]
        self.beta_start, self.beta_end = cfg["beta_start"], cfg["beta_end"]
        bounded("image_size", 1, MAX_IMAGE_SIZE)
        bounded("model_channels", 1, MAX_CHANNELS)
        bounded("num_res_blocks", 1, MAX_RES_BLOCKS)
        bounded("num_head_channels", 1, MAX_CHANNELS)
        bounded("diffusion_steps", 1, MAX_DIFFUSION_STEPS)
        for field in ["in_channels", "out_channels"]:
            if cfg[field] != 3:
                bad(field, 3)
        if not 1 <= cfg["n_levels"] <= 4:
            bad("n_levels", "1..4")
        self.channel_mult = [cfg[f"mult{i}"] for i in range(cfg["n_levels"])]
        for i, m in enumerate(self.channel_mult):
            ch = m * self.model_channels
            if m < 1 or ch > MAX_CHANNELS or ch % GROUPS or ch % self.num_head_channels:
                bad(f"mult{i}", f">= 1 with model_channels*mult a multiple of {GROUPS} and of num_head_channels, "
                    f"at most {MAX_CHANNELS}")
        for i in range(cfg["n_levels"], 4):
            if cfg[f"mult{i}"] != 0:
                bad(f"mult{i}", f"0 (the model has {cfg['n_levels']} levels)")
        if self.image_size % (2 ** (len(self.channel_mult) - 1)):
            bad("image_size", f"a multiple of 2^(n_levels-1) = {2 ** (len(self.channel_mult) - 1)}")
        mask = cfg["attn_ds_mask"]
        if mask < 0 or mask >= 1 << len(self.channel_mult):
            bad("attn_ds_mask", f"0..{(1 << len(self.channel_mult)) - 1} (bit k = attention at ds 2^k)")
        self.attention_ds = [1 << k for k in range(len(self.channel_mult)) if mask >> k & 1]
        if not 0 < self.beta_start <= self.beta_end < 1:  # NaN fails too
            bad("beta_start", f"0 < beta_start <= beta_end < 1 (beta_end {self.beta_end})")

    def blocks(self):
        """(prefix, [layer specs]) in execution order; a spec is ("conv", cin, cout), ("res", cin, cout),
        ("attn", ch), ("down", ch) or ("up", ch). The structure of dev/unet.py's UNetModel, step for step."""
        C = self.model_channels
        ch = self.channel_mult[0] * C
        inputs = [[("conv", self.in_channels, ch)]]
        chans, ds = [ch], 1
        for level, mult in enumerate(self.channel_mult):
            for _ in range(self.num_res_blocks):
                layers = [("res", ch, mult * C)]
                ch = mult * C
                if ds in self.attention_ds:
                    layers.append(("attn", ch))
                inputs.append(layers)
                chans.append(ch)
            if level != len(self.channel_mult) - 1:
                inputs.append([("down", ch)])
                chans.append(ch)
                ds *= 2
        middle = [("res", ch, ch), ("attn", ch), ("res", ch, ch)]
        outputs = []
        for level, mult in list(enumerate(self.channel_mult))[::-1]:
            for i in range(self.num_res_blocks + 1):
                layers = [("res", ch + chans.pop(), mult * C)]
                ch = mult * C
                if ds in self.attention_ds:
                    layers.append(("attn", ch))
                if level and i == self.num_res_blocks:
                    layers.append(("up", ch))
                    ds //= 2
                outputs.append(layers)
        return inputs, middle, outputs

    def param_shapes(self):
        """dict state_dict name -> shape, as dev/unet.py's UNetModel.state_dict()."""
        C, E = self.model_channels, 4 * self.model_channels
        shapes = {"time_embed.0.weight": (E, C), "time_embed.0.bias": (E,),
                  "time_embed.2.weight": (E, E), "time_embed.2.bias": (E,)}

        def add(prefix, spec):
            kind = spec[0]
            if kind == "conv":
                shapes.update({prefix + ".weight": (spec[2], spec[1], 3, 3), prefix + ".bias": (spec[2],)})
            elif kind == "res":
                cin, cout = spec[1], spec[2]
                shapes.update({
                    prefix + ".in_layers.0.weight": (cin,), prefix + ".in_layers.0.bias": (cin,),
                    prefix + ".in_layers.2.weight": (cout, cin, 3, 3), prefix + ".in_layers.2.bias": (cout,),
                    prefix + ".emb_layers.1.weight": (cout, E), prefix + ".emb_layers.1.bias": (cout,),
                    prefix + ".out_layers.0.weight": (cout,), prefix + ".out_layers.0.bias": (cout,),
                    prefix + ".out_layers.3.weight": (cout, cout, 3, 3), prefix + ".out_layers.3.bias": (cout,)})
                if cin != cout:
                    shapes.update({prefix + ".skip_connection.weight": (cout, cin, 1, 1),
                                   prefix + ".skip_connection.bias": (cout,)})
            elif kind == "attn":
                ch = spec[1]
                shapes.update({prefix + ".norm.weight": (ch,), prefix + ".norm.bias": (ch,),
                               prefix + ".qkv.weight": (3 * ch, ch, 1), prefix + ".qkv.bias": (3 * ch,),
                               prefix + ".proj_out.weight": (ch, ch, 1), prefix + ".proj_out.bias": (ch,)})
            elif kind in ("down", "up"):
                name = ".op" if kind == "down" else ".conv"
                shapes.update({prefix + name + ".weight": (spec[1], spec[1], 3, 3),
                               prefix + name + ".bias": (spec[1],)})

        inputs, middle, outputs = self.blocks()
        for i, layers in enumerate(inputs):
            for j, spec in enumerate(layers):
                add(f"input_blocks.{i}.{j}", spec)
        for j, spec in enumerate(middle):
            add(f"middle_block.{j}", spec)
        for i, layers in enumerate(outputs):
            for j, spec in enumerate(layers):
                add(f"output_blocks.{i}.{j}", spec)
        ch = self.channel_mult[0] * C
        shapes.update({"out.0.weight": (ch,), "out.0.bias": (ch,),
                       "out.2.weight": (self.out_channels, ch, 3, 3), "out.2.bias": (self.out_channels,)})
        return shapes


# ----------------------------------------------------------------------------------------------------------------
# NumPy forward (NHWC float32)


def silu(x):
    return x * (np.float32(0.5) * (np.float32(1) + np.tanh(np.float32(0.5) * x)))  # = x*sigmoid(x), no overflow


def group_norm(x, gamma, beta):  # x (B, H, W, C) or (B, T, C); statistics in float64, 32 groups
    shape = x.shape
    g = x.reshape(shape[0], -1, GROUPS, shape[-1] // GROUPS)
    mean = g.mean(axis=(1, 3), keepdims=True, dtype=np.float64)
    var = np.square(g - mean).mean(axis=(1, 3), keepdims=True)
    y = ((g - mean) / np.sqrt(var + GN_EPS)).astype(np.float32).reshape(shape)
    return y * gamma + beta


def timestep_embedding(t, dim, max_period=10000):
    """float32 throughout in the same order as dev/unet.py, so the arguments (up to ~1000) round the same way."""
    half = dim // 2
    freqs = np.exp(np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half))
    args = np.asarray(t, dtype=np.float32)[:, None] * freqs[None].astype(np.float32)
    emb = np.concatenate([np.cos(args), np.sin(args)], axis=-1)
    if dim % 2:
        emb = np.concatenate([emb, np.zeros_like(emb[:, :1])], axis=-1)
    return emb.astype(np.float32)


class NumpyUNet:
    """dev/unet.py's UNetModel forward in NumPy. weights: dict name -> float32 array (PyTorch layouts)."""

    def __init__(self, config, weights):
        self.config = config
        self.w = weights
        self.blocks = config.blocks()
        self.conv_mats = {}  # conv name -> (kh*kw*Cin, Cout) matrix, built once

    def _mat(self, name):
        if name not in self.conv_mats:
            w = self.w[name + ".weight"]
            if w.ndim == 3:  # Conv1d (Cout, Cin, 1)
                w = w[:, :, :, None]
            cout, cin, kh, kw = w.shape
            self.conv_mats[name] = np.ascontiguousarray(w.transpose(2, 3, 1, 0).reshape(kh * kw * cin, cout))
        return self.conv_mats[name]

    def conv(self, name, x, stride=1):  # x (B, H, W, Cin) -> (B, Ho, Wo, Cout); 3x3 pad 1 or 1x1
        m, b = self._mat(name), self.w[name + ".bias"]
        k = 3 if m.shape[0] != x.shape[-1] else 1
        if k == 1:
            return x @ m + b
        B, H, W, Cin = x.shape
        Ho, Wo = (H - 1) // stride + 1, (W - 1) // stride + 1
        xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        out = np.empty((B, Ho, Wo, m.shape[1]), dtype=np.float32)
        chunk = max(1, (1 << 27) // (Ho * Wo * 9 * Cin * 4))  # keep each im2col buffer under ~128 MB
        for s in range(0, B, chunk):
            cols = np.empty((min(chunk, B - s), Ho, Wo, 3, 3, Cin), dtype=np.float32)
            for ky in range(3):
                for kx in range(3):
                    cols[:, :, :, ky, kx, :] = xp[s:s + chunk, ky:ky + stride * (Ho - 1) + 1:stride,
                                                  kx:kx + stride * (Wo - 1) + 1:stride, :]
            out[s:s + chunk] = (cols.reshape(-1, 9 * Cin) @ m).reshape(-1, Ho, Wo, m.shape[1]) + b
        return out

    def linear(self, name, x):
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def norm(self, name, x):
        return group_norm(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def resblock(self, p, x, emb):
        h = self.conv(p + ".in_layers.2", silu(self.norm(p + ".in_layers.0", x)))
        h = h + self.linear(p + ".emb_layers.1", silu(emb))[:, None, None, :]
        h = self.conv(p + ".out_layers.3", silu(self.norm(p + ".out_layers.0", h)))
        skip = self.conv(p + ".skip_connection", x) if p + ".skip_connection.weight" in self.w else x
        return skip + h

    def attention(self, p, x):
        B, H, W, C = x.shape
        d = self.config.num_head_channels
        heads = C // d
        xs = x.reshape(B, H * W, C)
        qkv = self.conv(p + ".qkv", self.norm(p + ".norm", xs))  # (B, T, 3C), legacy order: per head [q k v]
        qkv = qkv.reshape(B, H * W, heads, 3, d).transpose(3, 0, 2, 1, 4)  # (3, B, heads, T, d)
        scale = np.float32(1.0 / math.sqrt(math.sqrt(d)))
        logits = (qkv[0] * scale) @ (qkv[1] * scale).transpose(0, 1, 3, 2)  # (B, heads, T, T)
        logits = logits - logits.max(axis=-1, keepdims=True)
        weights = np.exp(logits)
        weights /= weights.sum(axis=-1, keepdims=True)
        a = (weights @ qkv[2]).transpose(0, 2, 1, 3).reshape(B, H * W, C)  # channel h*d + c
        return (xs + self.conv(p + ".proj_out", a)).reshape(B, H, W, C)

    def run_layer(self, p, spec, h, emb):
        kind = spec[0]
        if kind == "conv":
            return self.conv(p, h)
        if kind == "res":
            return self.resblock(p, h, emb)
        if kind == "attn":
            return self.attention(p, h)
        if kind == "down":
            return self.conv(p + ".op", h, stride=2)
        return self.conv(p + ".conv", h.repeat(2, axis=1).repeat(2, axis=2))  # nearest x2 then conv

    def forward(self, x, t):
        """x (B, 3, H, W) float32 NCHW, t (B,) ints -> epsilon prediction (B, 3, H, W)."""
        emb = timestep_embedding(t, self.config.model_channels)
        emb = self.linear("time_embed.2", silu(self.linear("time_embed.0", emb)))
        h = np.ascontiguousarray(np.asarray(x, dtype=np.float32).transpose(0, 2, 3, 1))
        inputs, middle, outputs = self.blocks
        hs = []
        for i, layers in enumerate(inputs):
            for j, spec in enumerate(layers):
                h = self.run_layer(f"input_blocks.{i}.{j}", spec, h, emb)
            hs.append(h)
        for j, spec in enumerate(middle):
            h = self.run_layer(f"middle_block.{j}", spec, h, emb)
        for i, layers in enumerate(outputs):
            h = np.concatenate([h, hs.pop()], axis=-1)
            for j, spec in enumerate(layers):
                h = self.run_layer(f"output_blocks.{i}.{j}", spec, h, emb)
        h = self.conv("out.2", silu(self.norm("out.0", h)))
        return np.ascontiguousarray(h.transpose(0, 3, 1, 2))


# ----------------------------------------------------------------------------------------------------------------
# diffusion samplers


class Schedule:
    def __init__(self, steps, beta_start, beta_end):
        self.T = steps
        self.betas = np.linspace(beta_start, beta_end, steps, dtype=np.float64)
        self.acp = np.cumprod(1.0 - self.betas)
        self.acp_prev = np.append(1.0, self.acp[:-1])
        self.post_var = self.betas * (1.0 - self.acp_prev) / (1.0 - self.acp)
        self.post_log_var = np.log(np.append(self.post_var[1], self.post_var[1:])) if steps > 1 else np.zeros(1)
        self.coef1 = self.betas * np.sqrt(self.acp_prev) / (1.0 - self.acp)
        self.coef2 = (1.0 - self.acp_prev) * np.sqrt(1.0 - self.betas) / (1.0 - self.acp)


def ddim_timesteps(T, S):
    return [(i * T) // S for i in range(S)]


def sample_cpu(model, schedule, num, sampler, steps, seed, batch_size, log=print):
    rng = np.random.default_rng(seed)
    H = model.config.image_size
    x = rng.standard_normal((num, 3, H, H), dtype=np.float32)
    f32 = np.float32
    if sampler == "ddpm":
        taus = list(range(schedule.T))
    else:
        taus = ddim_timesteps(schedule.T, steps)
    t0, n_evals = time.time(), len(taus)
    for k, tau in enumerate(reversed(taus)):
        eps = np.concatenate([model.forward(x[s:s + batch_size], np.full(min(batch_size, num - s), tau))
                              for s in range(0, num, batch_size)])
        acp = schedule.acp[tau]
        x0 = np.clip(f32(np.sqrt(1.0 / acp)) * x - f32(np.sqrt(1.0 / acp - 1.0)) * eps, -1, 1)
        if sampler == "ddpm":
            mean = f32(schedule.coef1[tau]) * x0 + f32(schedule.coef2[tau]) * x
            if tau > 0:
                z = rng.standard_normal(x.shape, dtype=np.float32)
                x = mean + f32(np.exp(0.5 * schedule.post_log_var[tau])) * z
            else:
                x = mean
        else:
            eps = (f32(np.sqrt(1.0 / acp)) * x - x0) / f32(np.sqrt(1.0 / acp - 1.0))
            acp_prev = schedule.acp[taus[len(taus) - 2 - k]] if k < len(taus) - 1 else 1.0
            x = f32(np.sqrt(acp_prev)) * x0 + f32(np.sqrt(1.0 - acp_prev)) * eps
        x = x.astype(np.float32)
        if log and (k + 1) % max(1, n_evals // 10) == 0:
            el = time.time() - t0
            log(f"step {k + 1}/{n_evals} (t={tau}) {el:.1f} s, {el / (k + 1) * 1000:.0f} ms per step")
    return x


def to_uint8(x):
    """(N, 3, H, W) in [-1, 1] -> (N, H, W, 3) uint8, as train_unet's sampler writes them."""
    return np.clip(np.round((x.transpose(0, 2, 3, 1) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def save_grid(images, path, pad=2):
    """images (N, H, W, 3) uint8 -> a PNG grid of ceil(sqrt(N)) columns on a white background, written through
    binio.write_file (atomic; a symlink written through). -> the path written. Raises binio.PathError."""
    import io
    from PIL import Image
    n, h, w, _ = images.shape
    cols = int(math.ceil(math.sqrt(n)))
    rows = int(math.ceil(n / cols))
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        grid[pad + r * (h + pad):pad + r * (h + pad) + h, pad + c * (w + pad):pad + c * (w + pad) + w] = images[i]
    buf = io.BytesIO()
    Image.fromarray(grid).save(buf, format="PNG")
    return binio.write_file(path, buf.getvalue(), "PNG grid")


# ----------------------------------------------------------------------------------------------------------------
# main


def checkpoint_fields(path, cfg):
    """The training fields of a checkpoint header in the ranges train_unet writes; else FormatError naming one."""
    def bad(field, expected):
        raise binio.FormatError(f"{path}: header field {field} is {cfg[field]}, expected {expected}")

    if not 0 <= cfg["step"] <= MAX_STEP:
        bad("step", f"0..{MAX_STEP}")
    if not 1 <= cfg["batch_size"] <= 4096:
        bad("batch_size", "1..4096")
    if cfg["seed"] < 0:
        bad("seed", "0..2147483647")
    if not 0 < cfg["lr"] <= 1:  # NaN fails too
        bad("lr", "a learning rate in (0, 1]")
    if not 0 <= cfg["ema_rate"] <= 1:
        bad("ema_rate", "a rate in [0, 1]")
    for field in ("has_ema", "has_optimizer"):
        if cfg[field] not in (0, 1):
            bad(field, "0 or 1")
    if cfg["optimizer"] not in (0, 1):
        bad("optimizer", "0 (adamw) or 1 (muon)")
    muon = cfg["optimizer"] == 1  # train_unet --optimizer muon's settings (the ranges of its flags), else all 0
    ranges = [("muon_lr", 1e-9, 1e9), ("muon_momentum", 0, 0.999999), ("muon_nesterov", 0, 1), ("ns_steps", 1, 99)]
    for field, lo, hi in ranges:
        if muon and not lo <= cfg[field] <= hi:
            bad(field, f"{lo:g}..{hi:g} (optimizer 1, muon)")
        if not muon and cfg[field] != 0:
            bad(field, "0 (unused by optimizer 0, adamw)")


def load_checkpoint(path, weights_choice):
    """-> (ModelConfig, weights dict, 'ema'|'raw', header config). Raises FormatError on a bad file: every header
    field in range, exactly the tensors of the model it claims (with EMA, AdamW moments and rng_state as its
    header says), every float finite."""
    _, cfg, tensors = binio.read(path, binio.UNET_CHECKPOINT)
    config = ModelConfig(cfg, path)
    checkpoint_fields(path, cfg)
    shapes = config.param_shapes()
    expected = {n: (s, np.float32) for n, s in shapes.items()}
    if cfg["has_ema"]:
        expected.update({"ema." + n: (s, np.float32) for n, s in shapes.items()})
    if cfg["has_optimizer"]:
        for prefix in ("muon_m." if cfg["optimizer"] == 1 else "adam_m.", "adam_v."):
            expected.update({prefix + n: (s, np.float32) for n, s in shapes.items()})
        expected["rng_state"] = ((4,), np.int32)
    for name, (shape, dtype) in expected.items():
        binio.expect(path, tensors, name, shape, dtype)
    for name, t in tensors.items():
        if name not in expected:
            raise binio.FormatError(f"{path}: tensor {name} is not one of the model's (has_ema {cfg['has_ema']}, "
                                    f"has_optimizer {cfg['has_optimizer']})")
        if t.dtype == np.float32 and not np.isfinite(t).all():
            i = np.unravel_index(np.argmin(np.isfinite(t)), t.shape)
            raise binio.FormatError(f"{path}: tensor {name}{list(i)} is {t[i]}, expected a finite number")
    if weights_choice == "ema" and not cfg["has_ema"]:
        raise binio.FormatError(f"{path}: --weights ema but the checkpoint has no EMA weights (has_ema 0)")
    use = weights_choice if weights_choice != "auto" else ("ema" if cfg["has_ema"] else "raw")
    prefix = "ema." if use == "ema" else ""
    weights = {name: tensors[prefix + name] for name in shapes}
    return config, weights, use, cfg


def memory_check(config, num_samples, batch_size):
    """An error message when sampling would need more memory than the machine has, else ''."""
    S = config.image_size
    widest = max(config.channel_mult) * config.model_channels
    need = 4 * num_samples * 3 * S * S * 4 + 24 * min(batch_size, num_samples) * S * S * widest * 4
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return ""
    if need > have:
        return (f"sampling {num_samples} images of {S}x{S} (batch {batch_size}) needs about {need / 2**30:.1f} GB, "
                f"this machine has {have / 2**30:.1f} GB: lower --num_samples or --batch_size")
    return ""


def gpu_available(binary):
    """-> (bool, reason)."""
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        return False, f"no executable {binary}"
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False, "no nvidia-smi"
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"nvidia-smi failed ({e})"
    gpus = [line for line in r.stdout.splitlines() if line.startswith("GPU")]
    if r.returncode != 0 or not gpus:
        return False, "nvidia-smi lists no GPU"
    return True, gpus[0]


def sample_gpu(args, use, image_size):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.bin")
        cmd = [args.binary, "--sample", out, "--load", args.checkpoint, "--num_samples", str(args.num_samples),
               "--sampler", args.sampler, "--use_ema", "1" if use == "ema" else "0", "--seed", str(args.seed),
               "--device", "cuda"]
        if args.sampler == "ddim":  # ddpm takes every diffusion step: train_unet refuses --sample_steps with it
            cmd += ["--sample_steps", str(args.steps)]
        print("running: " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd)
        if r.returncode != 0:
            sys.exit(f"error: {args.binary} exited with code {r.returncode}")
        try:
            _, cfg, tensors = binio.read(out, binio.UNET_DATASET)
            shape = (args.num_samples, image_size, image_size, 3)
            return binio.expect(out, tensors, "images", shape, np.uint8)
        except binio.FormatError as e:
            sys.exit(f"error: {args.binary} wrote a bad sample file: {e}")


def main(argv=None):
    p = binio.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="UNET_CHECKPOINT written by train_unet or dev/unet.py (required)")
    p.add_argument("--out", default="samples.png", help="PNG grid to write")
    p.add_argument("--out_bin", default="", help="also write the samples as a UNET_DATASET here")
    p.add_argument("--num_samples", type=int, default=16, help="images to generate")
    p.add_argument("--sampler", default="ddpm", choices=["ddpm", "ddim"], help="ddpm: all diffusion steps; ddim: eta 0")
    p.add_argument("--steps", type=int, default=0, help="ddim steps (0: 50); ddpm always takes diffusion_steps")
    p.add_argument("--weights", default="auto", choices=["auto", "ema", "raw"], help="auto: ema when present")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: cuda when the binary and a GPU are present, else cpu")
    p.add_argument("--binary", default="./train_unet", help="the trainer, for --device cuda")
    p.add_argument("--batch_size", type=int, default=16, help="cpu: images per forward")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise and of the ddpm noise")
    args = p.parse_args(argv)
    if not 1 <= args.num_samples <= 1000000:
        sys.exit(f"error: --num_samples must be in 1..1000000, found {args.num_samples}")
    if not 1 <= args.batch_size <= 4096:
        sys.exit(f"error: --batch_size must be in 1..4096, found {args.batch_size}")
    if args.steps < 0:
        sys.exit(f"error: --steps must be >= 0, found {args.steps}")
    if not 0 <= args.seed <= 2**31 - 1:
        sys.exit(f"error: --seed must be in 0..2147483647, found {args.seed}")
    if not args.out.lower().endswith(".png"):
        sys.exit(f"error: --out {args.out}: expected a .png path")
    try:  # the outputs before any work: a bad --out must not cost the whole sampling
        binio.check_output(args.out, "--out", inputs=[args.checkpoint])
        if args.out_bin:
            binio.check_output(args.out_bin, "--out_bin", inputs=[args.checkpoint, args.out])
        config, weights, use, cfg = load_checkpoint(args.checkpoint, args.weights)
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    T = config.diffusion_steps
    if args.sampler == "ddpm":
        if args.steps not in (0, T):
            sys.exit(f"error: --steps {args.steps}: ddpm takes all diffusion_steps ({T}); use --sampler ddim")
        args.steps = T
    else:
        args.steps = args.steps or min(50, T)
        if args.steps > T:
            sys.exit(f"error: --steps {args.steps} is more than the checkpoint's diffusion_steps {T}")
    too_big = memory_check(config, args.num_samples, args.batch_size)
    if too_big:
        sys.exit(f"error: {too_big}")

    if args.device == "auto":
        ok, why = gpu_available(args.binary)
        args.device = "cuda" if ok else "cpu"
        print(f"device: {args.device} ({why})")
    elif args.device == "cuda":
        ok, why = gpu_available(args.binary)
        if not ok:
            sys.exit(f"error: --device cuda: {why}")
    print(f"checkpoint {args.checkpoint}: step {cfg['step']}, {use} weights, image {config.image_size}, "
          f"{args.sampler} {args.steps} steps, {args.num_samples} samples, seed {args.seed}", flush=True)

    t0 = time.time()
    if args.device == "cuda":
        images = sample_gpu(args, use, config.image_size)
    else:
        model = NumpyUNet(config, weights)
        schedule = Schedule(T, config.beta_start, config.beta_end)
        x = sample_cpu(model, schedule, args.num_samples, args.sampler, args.steps, args.seed, args.batch_size)
        images = to_uint8(x)
    try:
        real = save_grid(images, args.out)
        print(f"wrote {args.out}{binio.written_note(args.out, real)} ({images.shape[0]} samples, "
              f"{time.time() - t0:.1f} s)")
        if args.out_bin:
            n, s = images.shape[0], images.shape[1]
            real = binio.write(args.out_bin, binio.UNET_DATASET, dict(n_images=n, height=s, width=s, channels=3),
                               {"images": images})
            print(f"wrote {args.out_bin}{binio.written_note(args.out_bin, real)}")
    except binio.FormatError as e:
        sys.exit(f"error: {e}")

if __name__ == "__main__":
    binio.run_script(main)
