"""PyTorch reference of the diffusion UNet: the DEFINITION of the model train_unet.cu must match.

The model is guided-diffusion's UNetModel (openai/guided-diffusion, guided_diffusion/unet.py) with
conv_resample=True, resblock_updown=False, use_scale_shift_norm=False, dropout 0, legacy QKV attention order,
learn_sigma=False (out_channels 3), written here from scratch with the same module names, so state_dict names
(input_blocks.1.0.in_layers.2.weight, ...) match that codebase. Diffusion: linear betas beta_start..beta_end
over diffusion_steps (float64 schedule, cast to float32 when indexed, as guided-diffusion does), t uniform,
epsilon-prediction MSE loss (mean over every element). Optimizer: torch.optim.AdamW, or with --optimizer muon
torch.optim.Muon for every conv and linear weight (as its 2-D view (out, in*kh*kw), a view of the same storage) and
torch.optim.AdamW for the rest (biases, GroupNorm), both with --weight_decay; the debug state's fp32 steps replace
torch's bf16 Newton-Schulz by the same iteration in fp32 (dev/mnist_optimizers.py's ns_fp32), the autocast ones
keep torch's own.

Layers (C = model_channels, E = 4C, ch = C*mult of the level; every conv 3x3 has padding 1):
  time_embed.0 Linear(C,E), .1 SiLU, .2 Linear(E,E)      on timestep_embedding(t, C): cat[cos, sin]
  input_blocks.0.0            Conv2d(3, C*mult0, 3x3)
  input_blocks.N.0            ResBlock(ch_in -> ch)       N.1 AttentionBlock(ch) if ds in attn_ds
  input_blocks.N.0.op         Conv2d(ch, ch, 3x3, stride 2) (Downsample, after each level but the last)
  middle_block.0 ResBlock, .1 AttentionBlock, .2 ResBlock
  output_blocks.N.0           ResBlock(ch + skip -> ch)   N.1 AttentionBlock if ds in attn_ds,
  output_blocks.N.{1|2}.conv  Upsample: nearest x2 then Conv2d(ch, ch, 3x3) (last block of each level but 0)
  out.0 GroupNorm, out.1 SiLU, out.2 Conv2d(C*mult0, 3, 3x3)   (zero-initialised)
ResBlock(cin -> cout): in_layers.0 GroupNorm(cin), .1 SiLU, .2 Conv2d(cin, cout, 3x3);
  emb_layers.0 SiLU, .1 Linear(E, cout) added per channel; out_layers.0 GroupNorm(cout), .1 SiLU, .2 Dropout(0),
  .3 Conv2d(cout, cout, 3x3) (zero-initialised); skip_connection Conv2d(cin, cout, 1x1) only when cin != cout.
AttentionBlock(ch): norm GroupNorm(ch); qkv Conv1d(ch, 3ch, 1) (weight (3ch, ch, 1)); heads = ch/num_head_channels;
  legacy order: qkv channel h*3d + [0,d) is q of head h, [d,2d) k, [2d,3d) v (d = head channels); weights
  softmax_s((q*d^-1/4) . (k*d^-1/4)); a = weights @ v, output channel h*d + c; proj_out Conv1d(ch, ch, 1)
  (zero-initialised); returns x + proj_out(a).
GroupNorm: 32 groups, eps 1e-5, computed in float32. Skips: every input block's output is pushed, each output
block concatenates [h, pop()] along channels before its ResBlock.

Initialisation: PyTorch's defaults (conv/linear weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)), GroupNorm
weight 1 bias 0), then zeros for out_layers.3, proj_out and out.2 (--zero_init 0 keeps the defaults there too:
with the zero-inits the initial output is exactly 0 and only out.2 has a non-zero gradient, so a debug state
made with --zero_init 0 checks every gradient of a backward pass; use both).

Usage (GPU machine: torch is there only):
  python3 dev/unet.py --debug_state OUT.bin [--batch_size 32 --n_steps 10 --data_file data/sunflowers64.bin]
  python3 dev/unet.py --init_checkpoint CKPT.bin    # the initial weights as a UNET_CHECKPOINT (step 0)
  python3 dev/unet.py --forward_fixture F.bin       # weights, x_t, t, out = model(x_t, t) (UNET_FIXTURE)
  python3 dev/unet.py --list_params                 # every parameter name and shape
The debug state (scripts/binio.py UNET_DEBUG_STATE, data/README.md): weights, x0, t, noise, x_t, out, loss,
grad.<name>, then n_steps optimizer steps on the same x0, step i drawing step_t[i] (B,) and step_noise[i*B:(i+1)*B]
(stored as (S*B, 3, H, W)) fresh; step_losses[i]
is the loss of step i's forward, with the weights after i updates (so before update i+1); final.<name> the
parameters after the n_steps updates; fixed_grad.<name> the initial parameters after n_fixed optimizer steps that
each take grad.* as the gradient (dev/test_unet.cu checks those on the CPU).
"""
import argparse
import copy
import math
import os
import sys
import time

import numpy as np
try:
    import torch
except ImportError:  # a reference tool of the GPU machine: one line, not a traceback, elsewhere
    sys.exit("error: dev/unet.py needs PyTorch (the GPU machine has it; pip install torch)")
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import binio  # noqa: E402

MAX_LEVELS = 4  # the header has mult0..mult3


# ----------------------------------------------------------------------------------------------------------------
# the network


class GroupNorm32(nn.GroupNorm):
    """GroupNorm computed in float32 whatever the input dtype (as guided-diffusion)."""

    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


def normalization(channels):
    return GroupNorm32(32, channels, eps=1e-5)


def zero_module(module):
    for p in module.parameters():
        p.detach().zero_()
    return module


def timestep_embedding(t, dim, max_period=10000):
    """t: (B,) timesteps -> (B, dim) = cat[cos(t*f), sin(t*f)], f_i = max_period^(-i/half), i < half.
    Per sample: t[:, None] * freqs[None] (the predecessor's t * freqs broadcast wrongly)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepBlock(nn.Module):
    """A module whose forward takes the timestep embedding as a second argument."""


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):
    def forward(self, x, emb):
        for layer in self:
            x = layer(x, emb) if isinstance(layer, TimestepBlock) else layer(x)
        return x


class Upsample(nn.Module):
    def __init__(self, channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, out_channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, channels, out_channels):
        super().__init__()
        self.op = nn.Conv2d(channels, out_channels, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class ResBlock(TimestepBlock):
    def __init__(self, channels, emb_channels, out_channels, zero_init=True):
        super().__init__()
        self.in_layers = nn.Sequential(normalization(channels), nn.SiLU(),
                                       nn.Conv2d(channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, out_channels))
        last = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.out_layers = nn.Sequential(normalization(out_channels), nn.SiLU(), nn.Dropout(p=0.0),
                                        zero_module(last) if zero_init else last)
        self.skip_connection = (nn.Identity() if out_channels == channels
                                else nn.Conv2d(channels, out_channels, 1))

    def forward(self, x, emb):  # x (B, cin, H, W), emb (B, E) -> (B, cout, H, W)
        h = self.in_layers(x)
        h = h + self.emb_layers(emb).type(h.dtype)[:, :, None, None]
        h = self.out_layers(h)
        return self.skip_connection(x) + h


class QKVAttentionLegacy(nn.Module):
    def __init__(self, n_heads, sdpa=False):
        super().__init__()
        self.n_heads, self.sdpa = n_heads, sdpa

    def forward(self, qkv):  # (B, 3*H*d, T) -> (B, H*d, T)
        bs, width, length = qkv.shape
        d = width // (3 * self.n_heads)
        q, k, v = qkv.reshape(bs * self.n_heads, 3 * d, length).split(d, dim=1)
        if self.sdpa:  # the same function through F.scaled_dot_product_attention (scale 1/sqrt(d)), for benchmarks
            q, k, v = (t.reshape(bs, self.n_heads, d, length).transpose(-1, -2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, d)
            return a.transpose(-1, -2).reshape(bs, -1, length)
        scale = 1.0 / math.sqrt(math.sqrt(d))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)  # (B*H, T, T)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        a = torch.einsum("bts,bcs->bct", weight, v)
        return a.reshape(bs, -1, length)


class AttentionBlock(nn.Module):
    def __init__(self, channels, num_head_channels, zero_init=True, sdpa=False):
        super().__init__()
        assert channels % num_head_channels == 0, (channels, num_head_channels)
        self.num_heads = channels // num_head_channels
        self.norm = normalization(channels)
        self.qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.attention = QKVAttentionLegacy(self.num_heads, sdpa)
        proj = nn.Conv1d(channels, channels, 1)
        self.proj_out = zero_module(proj) if zero_init else proj

    def forward(self, x):  # (B, C, H, W)
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        h = self.proj_out(self.attention(self.qkv(self.norm(x))))
        return (x + h).reshape(b, c, *spatial)


class UNetModel(nn.Module):
    def __init__(self, image_size=64, in_channels=3, model_channels=64, out_channels=3, num_res_blocks=2,
                 attention_ds=(4, 8), channel_mult=(1, 2, 3, 4), num_head_channels=32, zero_init=True, sdpa=False):
        super().__init__()
        self.image_size, self.in_channels, self.model_channels = image_size, in_channels, model_channels
        self.out_channels, self.num_res_blocks, self.channel_mult = out_channels, num_res_blocks, tuple(channel_mult)
        self.attention_ds, self.num_head_channels = tuple(attention_ds), num_head_channels
        emb_dim = 4 * model_channels
        self.time_embed = nn.Sequential(nn.Linear(model_channels, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))

        ch = input_ch = int(channel_mult[0] * model_channels)
        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(nn.Conv2d(in_channels, ch, 3, padding=1))])
        input_block_chans = [ch]
        ds = 1
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers = [ResBlock(ch, emb_dim, int(mult * model_channels), zero_init)]
                ch = int(mult * model_channels)
                if ds in attention_ds:
                    layers.append(AttentionBlock(ch, num_head_channels, zero_init, sdpa))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                input_block_chans.append(ch)
            if level != len(channel_mult) - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch, ch)))
                input_block_chans.append(ch)
                ds *= 2

        self.middle_block = TimestepEmbedSequential(
            ResBlock(ch, emb_dim, ch, zero_init), AttentionBlock(ch, num_head_channels, zero_init, sdpa),
            ResBlock(ch, emb_dim, ch, zero_init))

        self.output_blocks = nn.ModuleList([])
        for level, mult in list(enumerate(channel_mult))[::-1]:
            for i in range(num_res_blocks + 1):
                ich = input_block_chans.pop()
                layers = [ResBlock(ch + ich, emb_dim, int(model_channels * mult), zero_init)]
                ch = int(model_channels * mult)
                if ds in attention_ds:
                    layers.append(AttentionBlock(ch, num_head_channels, zero_init, sdpa))
                if level and i == num_res_blocks:
                    layers.append(Upsample(ch, ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        last = nn.Conv2d(input_ch, out_channels, 3, padding=1)
        self.out = nn.Sequential(normalization(ch), nn.SiLU(), zero_module(last) if zero_init else last)

    def forward(self, x, t):  # x (B, 3, H, W), t (B,) -> epsilon prediction (B, 3, H, W)
        emb = self.time_embed(timestep_embedding(t, self.model_channels))
        hs = []
        h = x
        for module in self.input_blocks:
            h = module(h, emb)
            hs.append(h)
        h = self.middle_block(h, emb)
        for module in self.output_blocks:
            h = module(torch.cat([h, hs.pop()], dim=1), emb)
        return self.out(h)


# ----------------------------------------------------------------------------------------------------------------
# diffusion


def linear_betas(steps, beta_start, beta_end):
    """float64, as guided-diffusion (beta_start/beta_end used as given, no rescaling by 1000/steps). numpy's
    linspace: beta_i = beta_start + i * ((beta_end - beta_start) / (steps - 1)), the last one set to beta_end."""
    return np.linspace(beta_start, beta_end, steps, dtype=np.float64)


class Diffusion:
    def __init__(self, steps=1000, beta_start=1e-4, beta_end=0.02):
        betas = linear_betas(steps, beta_start, beta_end)
        acp = np.cumprod(1.0 - betas)
        self.steps = steps
        self.sqrt_acp = np.sqrt(acp)
        self.sqrt_one_minus_acp = np.sqrt(1.0 - acp)

    def q_sample(self, x0, t, noise):
        """x_t = sqrt(acp[t]) x0 + sqrt(1 - acp[t]) noise, the coefficients float64 -> float32 per sample."""
        a = torch.from_numpy(self.sqrt_acp).to(x0.device)[t.long()].float()[:, None, None, None]
        b = torch.from_numpy(self.sqrt_one_minus_acp).to(x0.device)[t.long()].float()[:, None, None, None]
        return a * x0 + b * noise


# ----------------------------------------------------------------------------------------------------------------
# files


def attn_mask(attention_ds):
    mask = 0
    for ds in attention_ds:
        k = int(round(math.log2(ds)))
        assert 2 ** k == ds, f"attention ds {ds} is not a power of 2"
        mask |= 1 << k
    return mask


def model_fields(model, diffusion_steps, beta_start, beta_end):
    """The header's UNET_MODEL_FIELDS for this model."""
    mult = list(model.channel_mult) + [0] * (MAX_LEVELS - len(model.channel_mult))
    return dict(image_size=model.image_size, in_channels=model.in_channels, model_channels=model.model_channels,
                out_channels=model.out_channels, num_res_blocks=model.num_res_blocks,
                n_levels=len(model.channel_mult), mult0=mult[0], mult1=mult[1], mult2=mult[2], mult3=mult[3],
                attn_ds_mask=attn_mask(model.attention_ds), num_head_channels=model.num_head_channels,
                diffusion_steps=diffusion_steps, beta_start=beta_start, beta_end=beta_end)


def params_numpy(model, prefix=""):  # copies: on the CPU .numpy() would share the storage the steps then change
    return {prefix + n: p.detach().float().cpu().numpy().copy() for n, p in model.state_dict().items()}


def load_batch(data_file, batch_size, image_size):
    """The first batch_size images of a UNET_DATASET, normalised to [-1, 1] (x / 127.5 - 1), NCHW float32."""
    _, cfg, tensors = binio.read(data_file, binio.UNET_DATASET)
    n, h, w, c = cfg["n_images"], cfg["height"], cfg["width"], cfg["channels"]
    images = binio.expect(data_file, tensors, "images", (n, h, w, c), np.uint8)
    if (h, w, c) != (image_size, image_size, 3):
        sys.exit(f"error: {data_file} holds {h}x{w}x{c} images, the model expects {image_size}x{image_size}x3")
    if n < batch_size:
        sys.exit(f"error: {data_file} holds {n} images, fewer than --batch_size {batch_size}")
    x = images[:batch_size].astype(np.float32) / np.float32(127.5) - np.float32(1.0)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def parse_ints(flag, text, min_value=1):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sys.exit(f"error: {flag} expects comma-separated integers, found {text!r}")
    if any(v < min_value for v in values):
        sys.exit(f"error: {flag} values must be >= {min_value}, found {text!r}")
    return values


def build_model(args):
    mult = parse_ints("--channel_mult", args.channel_mult)
    attn = parse_ints("--attn_ds", args.attn_ds)
    if not 1 <= len(mult) <= MAX_LEVELS:
        sys.exit(f"error: --channel_mult needs 1..{MAX_LEVELS} levels, found {len(mult)}")
    if args.image_size % (2 ** (len(mult) - 1)):
        sys.exit(f"error: --image_size {args.image_size} is not divisible by 2^(levels-1) = {2 ** (len(mult) - 1)}")
    for ch in [args.model_channels * m for m in mult]:
        if ch % 32:
            sys.exit(f"error: channels {ch} (model_channels x mult) must be a multiple of 32 (GroupNorm groups)")
        if ch % args.num_head_channels:
            sys.exit(f"error: channels {ch} must be a multiple of --num_head_channels {args.num_head_channels}")
    return UNetModel(args.image_size, 3, args.model_channels, 3, args.num_res_blocks, attn, mult,
                     args.num_head_channels, zero_init=bool(args.zero_init))


def make_optimizer(model, args):
    """-> (optimizers, Muon's 2-D views by parameter name): AdamW for everything, or (--optimizer muon)
    torch.optim.Muon for the weights of ndim >= 2 as (out, in*kh*kw) views and AdamW for the rest."""
    adamw = dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, weight_decay=args.weight_decay)
    if args.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), **adamw)], {}
    named = dict(model.named_parameters())
    mats = {n: nn.Parameter(p.data.view(p.shape[0], -1)) for n, p in named.items() if p.ndim >= 2}
    muon = torch.optim.Muon(list(mats.values()), lr=args.muon_lr, weight_decay=args.weight_decay,
                            momentum=args.muon_momentum, nesterov=bool(args.muon_nesterov), ns_steps=args.ns_steps)
    return [muon, torch.optim.AdamW([p for n, p in named.items() if n not in mats], **adamw)], mats


def optimizer_step(model, optimizers, mats):
    named = dict(model.named_parameters())
    for n, q in mats.items():
        q.grad = named[n].grad.view(q.shape)
    for opt in optimizers:
        opt.step()


class MuonFp32:
    """Within it torch.optim.Muon runs its Newton-Schulz iteration in fp32 (the fp32 reference), not in bf16."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        import torch.optim._muon as muon_module
        from mnist_optimizers import ns_fp32
        self.module, self.original = muon_module, muon_module._zeropower_via_newtonschulz
        if self.on:
            muon_module._zeropower_via_newtonschulz = ns_fp32

    def __exit__(self, *exc):
        self.module._zeropower_via_newtonschulz = self.original


def fixed_grad_reference(model, grads, args):
    """fixed_grad.<name>: a copy of the model after args.n_fixed optimizer steps that each take grads as the gradient."""
    m = copy.deepcopy(model)
    optimizers, mats = make_optimizer(m, args)
    with MuonFp32(True):
        for _ in range(args.n_fixed):
            for n, p in m.named_parameters():
                p.grad = torch.from_numpy(grads["grad." + n]).to(p.device).clone()
            optimizer_step(m, optimizers, mats)
    return {"fixed_grad." + n: p.detach().cpu().numpy().copy() for n, p in m.named_parameters()}


def autocast_reference(model, diffusion, x0, t, noise, step_t, step_noise, args):
    """The debug state's step under torch.autocast(bfloat16) from the same initial weights (a copy of the model,
    before any update): autocast.out (float32 of the bf16 output), autocast.loss, autocast.grad.<name>, and
    autocast.step_losses of the same n_steps AdamW steps (fp32 master weights and optimizer, as PyTorch's AMP).
    dev/test_unet.cu measures --precision bf16 against the fp32 reference with PyTorch's own bf16 error as the
    yardstick."""
    if x0.device.type != "cuda":
        sys.exit("error: --autocast_bf16 needs --device cuda (bf16 autocast on the GPU is the yardstick)")
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(diffusion.q_sample(x0, t, noise), t)
        loss = F.mse_loss(out, noise)
    loss.backward()
    res = {"autocast.out": out.detach().float().cpu().numpy(),
           "autocast.loss": np.array(loss.item(), dtype=np.float32)}
    res.update({"autocast.grad." + n: p.grad.detach().float().cpu().numpy().copy() for n, p in m.named_parameters()})
    print(f"autocast bf16 loss {loss.item():.6f}")
    optimizers, mats = make_optimizer(m, args)  # Muon: torch's own bf16 Newton-Schulz
    losses = []
    for i in range(args.n_steps):
        m.zero_grad(set_to_none=True)
        ti, ni = step_t[i].to(x0.device), step_noise[i].to(x0.device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            li = F.mse_loss(m(diffusion.q_sample(x0, ti, ni), ti), ni)
        li.backward()
        optimizer_step(m, optimizers, mats)
        losses.append(li.item())
    res["autocast.step_losses"] = np.array(losses, dtype=np.float32).reshape(args.n_steps)
    return res


# ----------------------------------------------------------------------------------------------------------------
# main


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--debug_state", default="", help="write a UNET_DEBUG_STATE to this path")
    p.add_argument("--init_checkpoint", default="", help="write the initial weights as a UNET_CHECKPOINT here")
    p.add_argument("--forward_fixture", default="", help="write a UNET_FIXTURE (weights, x_t, t, out) here")
    p.add_argument("--list_params", action="store_true", help="print every parameter name and shape, then exit")
    p.add_argument("--batch_size", type=int, default=32, help="B of the debug state / fixture")
    p.add_argument("--n_steps", type=int, default=10, help="AdamW steps recorded in the debug state")
    p.add_argument("--image_size", type=int, default=64, help="H = W of the images")
    p.add_argument("--model_channels", type=int, default=64, help="C, channels of the first level")
    p.add_argument("--channel_mult", default="1,2,3,4", help="channel multiplier per level (1 to 4 levels)")
    p.add_argument("--num_res_blocks", type=int, default=2, help="residual blocks per level")
    p.add_argument("--attn_ds", default="4,8", help="downsample factors with attention (64px: 4,8 = 16x16, 8x8)")
    p.add_argument("--num_head_channels", type=int, default=32, help="channels per attention head")
    p.add_argument("--zero_init", type=int, default=1, choices=[0, 1],
                   help="zero-init out_layers.3, proj_out, out.2 (0: PyTorch defaults everywhere)")
    p.add_argument("--diffusion_steps", type=int, default=1000, help="T")
    p.add_argument("--beta_start", type=float, default=1e-4, help="first beta of the linear schedule")
    p.add_argument("--beta_end", type=float, default=0.02, help="last beta of the linear schedule")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1")
    p.add_argument("--beta2", type=float, default=0.999, help="AdamW beta2")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument("--weight_decay", type=float, default=0.0, help="decoupled weight decay (AdamW and Muon)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="the debug state's optimizer (muon: Muon for conv and linear weights, AdamW for the rest)")
    p.add_argument("--muon_lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--muon_momentum", type=float, default=0.95, help="Muon momentum")
    p.add_argument("--muon_nesterov", type=int, default=1, choices=[0, 1], help="Muon: 1 Nesterov momentum, 0 plain")
    p.add_argument("--ns_steps", type=int, default=5, help="Muon: Newton-Schulz steps")
    p.add_argument("--n_fixed", type=int, default=3, help="steps on the fixed gradient grad.* (fixed_grad.*)")
    p.add_argument("--ema_rate", type=float, default=0.9999, help="stored in the init checkpoint's header")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed of the init; draws use seed+1")
    p.add_argument("--data_file", default="", help="UNET_DATASET to take x0 from (default: uniform random in [-1,1])")
    p.add_argument("--autocast_bf16", type=int, default=0, choices=[0, 1],
                   help="also record the same step under torch.autocast(bfloat16) (autocast.* tensors; GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"],
                   help="where the debug state is computed (weights are made on the CPU either way)")
    args = p.parse_args()
    for name in ["batch_size", "image_size", "model_channels", "num_res_blocks", "num_head_channels",
                 "diffusion_steps"]:
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name} must be >= 1, found {getattr(args, name)}")
    if args.n_steps < 0 or args.n_fixed < 0:
        sys.exit(f"error: --n_steps and --n_fixed must be >= 0, found {args.n_steps} and {args.n_fixed}")
    if not 1 <= args.ns_steps <= 99:
        sys.exit(f"error: --ns_steps must be 1..99, found {args.ns_steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU")
    # The headers store these as float32: run with exactly the stored values, so that a reader rebuilding the
    # schedule (float64 linspace of the float32 betas) or the AdamW step from the header gets the same numbers.
    for name in ["beta_start", "beta_end", "lr", "beta1", "beta2", "eps", "weight_decay", "ema_rate", "muon_lr",
                 "muon_momentum"]:
        setattr(args, name, float(np.float32(getattr(args, name))))

    # true fp32 everywhere: the C++ side is compared with this in fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    torch.manual_seed(args.seed)
    model = build_model(args)  # built on the CPU so the weights do not depend on the device
    n_params = sum(p.numel() for p in model.parameters())
    if args.list_params:
        for name, t in model.state_dict().items():
            print(f"{name:60s} {tuple(t.shape)}")
        print(f"{n_params} parameters in {len(model.state_dict())} tensors")
        return
    if not (args.debug_state or args.init_checkpoint or args.forward_fixture):
        sys.exit("error: nothing to do: give --debug_state, --init_checkpoint and/or --forward_fixture PATH "
                 "(or --list_params)")
    fields = model_fields(model, args.diffusion_steps, args.beta_start, args.beta_end)
    init_weights = params_numpy(model)
    print(f"model: {n_params} parameters, image {args.image_size}, channels {args.model_channels} x "
          f"{args.channel_mult}, {args.num_res_blocks} res blocks, attention at ds {args.attn_ds}, seed {args.seed}")

    if args.init_checkpoint:
        config = dict(fields, step=0, batch_size=args.batch_size, seed=args.seed, lr=args.lr,
                      ema_rate=args.ema_rate, has_ema=0, has_optimizer=0)
        binio.write(args.init_checkpoint, binio.UNET_CHECKPOINT, config, init_weights)
        print(f"wrote {args.init_checkpoint} ({os.path.getsize(args.init_checkpoint)} bytes)")
    device = torch.device(args.device)
    model = model.to(device)
    B, S, H = args.batch_size, args.n_steps, args.image_size

    if args.forward_fixture:
        # x_t spread over [-3, 3] and t over [0, T) so the embedding and every layer see varied inputs
        g = torch.Generator().manual_seed(args.seed + 2)
        x_t = torch.randn(B, 3, H, H, generator=g) * 1.5
        t = torch.randint(0, args.diffusion_steps, (B,), generator=g, dtype=torch.int64)
        with torch.no_grad():
            out = model(x_t.to(device), t.to(device)).cpu()
        tensors = dict(init_weights)
        tensors.update(x_t=x_t.numpy(), t=t.numpy().astype(np.int32), out=out.numpy())
        binio.write(args.forward_fixture, binio.UNET_FIXTURE, dict(fields, batch_size=B), tensors)
        print(f"wrote {args.forward_fixture} ({os.path.getsize(args.forward_fixture)} bytes), out std "
              f"{out.std().item():.4f}")
    if not args.debug_state:
        return
    diffusion = Diffusion(args.diffusion_steps, args.beta_start, args.beta_end)
    gen = torch.Generator().manual_seed(args.seed + 1)  # CPU draws: the same numbers on any device
    if args.data_file:
        x0 = load_batch(args.data_file, B, H)
    else:
        x0 = torch.rand(B, 3, H, H, generator=gen) * 2 - 1
    t = torch.randint(0, args.diffusion_steps, (B,), generator=gen, dtype=torch.int64)
    noise = torch.randn(B, 3, H, H, generator=gen)
    step_t = torch.randint(0, args.diffusion_steps, (S, B), generator=gen, dtype=torch.int64)
    step_noise = torch.randn(S, B, 3, H, H, generator=gen)

    x0_d, t_d, noise_d = x0.to(device), t.to(device), noise.to(device)
    x_t = diffusion.q_sample(x0_d, t_d, noise_d)
    out = model(x_t, t_d)
    loss = F.mse_loss(out, noise_d)
    model.zero_grad(set_to_none=False)
    loss.backward()
    grads = {"grad." + n: p.grad.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
    print(f"loss {loss.item():.6f}")
    autocast = {}
    if args.autocast_bf16:
        autocast = autocast_reference(model, diffusion, x0_d, t_d, noise_d, step_t, step_noise, args)

    fixed = fixed_grad_reference(model, grads, args)
    optimizers, mats = make_optimizer(model, args)
    step_losses = []
    with MuonFp32(True):
        for i in range(S):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
            model.zero_grad(set_to_none=True)
            ti, ni = step_t[i].to(device), step_noise[i].to(device)
            li = F.mse_loss(model(diffusion.q_sample(x0_d, ti, ni), ti), ni)
            li.backward()
            optimizer_step(model, optimizers, mats)
            step_losses.append(li.item())
            print(f"step {i:3d} loss {step_losses[-1]:.6f} ({(time.time() - t0) * 1000:.1f} ms)")

    muon = args.optimizer == "muon"
    config = dict(fields, batch_size=B, n_steps=S, lr=args.lr, beta1=args.beta1, beta2=args.beta2, eps=args.eps,
                  weight_decay=args.weight_decay, optimizer=int(muon), muon_lr=args.muon_lr if muon else 0.0,
                  muon_momentum=args.muon_momentum if muon else 0.0, muon_nesterov=args.muon_nesterov if muon else 0,
                  ns_steps=args.ns_steps if muon else 0, n_fixed=args.n_fixed)
    tensors = dict(init_weights)
    tensors.update(x0=x0.numpy(), t=t.numpy().astype(np.int32), noise=noise.numpy(),
                   x_t=x_t.detach().cpu().numpy(), out=out.detach().cpu().numpy(),
                   loss=np.array(loss.item(), dtype=np.float32))
    tensors.update(grads)
    tensors.update(step_t=step_t.numpy().astype(np.int32),
                   step_noise=step_noise.numpy().reshape(S * B, 3, H, H),  # 5 dims do not fit the table
                   step_losses=np.array(step_losses, dtype=np.float32).reshape(S))
    tensors.update({"final." + n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()})
    tensors.update(fixed)
    tensors.update(autocast)
    binio.write(args.debug_state, binio.UNET_DEBUG_STATE, config, tensors)
    print(f"wrote {args.debug_state} ({os.path.getsize(args.debug_state)} bytes, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
