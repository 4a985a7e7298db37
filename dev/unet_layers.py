"""PyTorch per-layer fixtures of the UNet (dev/unet.py's modules), for the dev/<layer>.cu checks.

For each layer: inputs, parameters, the output y, a random upstream gradient dy, and the gradients of
sum(y * dy) with respect to every input and parameter, computed by torch autograd in true fp32 (TF32 off).
Sizes are small and awkward (odd spatial sizes, channels off any tile). Each file is a UNET_LAYER_FIXTURE
(scripts/binio.py, data/README.md): header slot 3 layer (its code below), 4 seed, 5 aux (a layer-specific
integer: attention's num_head_channels); tensors in PyTorch layouts (NCHW activations, (Cout, Cin, kh, kw)
convolution weights, (out, in) linear weights), gradients named grad.<name>.

  python3 dev/unet_layers.py [--out_dir dev/fixtures] [--device cuda|cpu] [--seed 0]   # writes every fixture

Layers (file dev/fixtures/unet_layer_<name>.bin, code, checked by):
  conv3x3 1001 dev/conv2d.cu     conv1x1 1002 dev/linear.cu       linear 1003 dev/linear.cu
  groupnorm 1004, groupnorm_silu 1005 dev/groupnorm.cu            silu 1006 dev/elementwise.cu
  attention 1007 dev/attention.cu  upsample 1008, downsample 1009 dev/resample.cu
  concat 1010 dev/elementwise.cu   timestep_embedding 1011 dev/timestep_embedding.cu   mse 1012 dev/elementwise.cu
"""
import argparse
import os
import sys

import numpy as np
try:
    import torch
except ImportError:  # a reference tool of the GPU machine: one line, not a traceback, elsewhere
    sys.exit("error: dev/unet_layers.py needs PyTorch (the GPU machine has it; pip install torch)")
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
sys.path.insert(0, HERE)
import binio  # noqa: E402
import unet  # noqa: E402  (dev/unet.py: the definition of every module)

LAYER_CODES = {"conv3x3": 1001, "conv1x1": 1002, "linear": 1003, "groupnorm": 1004, "groupnorm_silu": 1005,
               "silu": 1006, "attention": 1007, "upsample": 1008, "downsample": 1009, "concat": 1010,
               "timestep_embedding": 1011, "mse": 1012}


def randomize(module, gen):
    """Every parameter drawn afresh (no zero-init; GroupNorm weight in [0.5, 1.5), bias N(0, 0.25)), so every
    gradient path is exercised with O(1) values."""
    with torch.no_grad():
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False):
                if isinstance(sub, nn.GroupNorm):
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen) if name == "weight"
                            else 0.5 * torch.randn(p.shape, generator=gen))
                else:
                    fan_in = p[0].numel() if p.dim() > 1 else 1
                    p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)


def run(fn, inputs, params, gen, device):
    """y = fn(*inputs); dy random; autograd of sum(y*dy) -> dict of numpy tensors."""
    ins = [t.to(device).requires_grad_(t.dtype.is_floating_point) for t in inputs]
    y = fn(*ins)
    dy = torch.randn(y.shape, generator=gen).to(device)
    leaves = [t for t in ins if t.requires_grad] + [p for _, p in params]
    grads = torch.autograd.grad((y * dy).sum(), leaves)
    return y, dy, grads


def np32(t):
    return t.detach().cpu().numpy().astype(np.float32)


def write(out_dir, name, seed, tensors, aux=0):
    path = os.path.join(out_dir, f"unet_layer_{name}.bin")
    binio.write(path, binio.UNET_LAYER_FIXTURE, dict(layer=LAYER_CODES[name], seed=seed, aux=aux), tensors)
    size = os.path.getsize(path)
    assert size < 2 << 20, f"{path}: {size} bytes, fixtures must stay under 2 MB"
    print(f"wrote {path}: {', '.join(f'{k}{tuple(v.shape)}' for k, v in tensors.items())} ({size} bytes)")


def module_fixture(out_dir, name, module, x_inputs, input_names, gen, device, seed, aux=0, fn=None):
    module = module.to(device)
    randomize(module, gen)
    params = list(module.named_parameters())
    y, dy, grads = run(fn or module, x_inputs, params, gen, device)
    tensors = {n: np32(t) for n, t in zip(input_names, x_inputs)}
    tensors.update({n: np32(p) for n, p in params})
    tensors["y"], tensors["dy"] = np32(y), np32(dy)
    k = 0
    for n, t in zip(input_names, x_inputs):
        if t.dtype.is_floating_point:
            tensors["d" + n] = np32(grads[k])
            k += 1
    for (n, _), g in zip(params, grads[k:]):
        tensors["grad." + n] = np32(g)
    write(out_dir, name, seed, tensors, aux)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", default=os.path.join(HERE, "fixtures"), help="directory of the fixtures")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=0, help="torch.Generator seed of every draw")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.makedirs(args.out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    dev, s = args.device, args.seed

    def randn(*shape, offset=0.0):
        return torch.randn(shape, generator=gen) + offset

    # 3x3 convolution, padding 1: odd sizes, channels off every tile
    module_fixture(args.out_dir, "conv3x3", nn.Conv2d(5, 7, 3, padding=1), [randn(2, 5, 9, 6)], ["x"], gen, dev, s)
    # 1x1 convolution (ResBlock skip_connection) and linear (time embedding, emb_layers)
    module_fixture(args.out_dir, "conv1x1", nn.Conv2d(12, 20, 1), [randn(2, 12, 5, 7)], ["x"], gen, dev, s)
    module_fixture(args.out_dir, "linear", nn.Linear(40, 24), [randn(6, 40)], ["x"], gen, dev, s)
    # GroupNorm(32) alone (AttentionBlock.norm) and + SiLU (ResBlock, out): x with a non-zero mean
    module_fixture(args.out_dir, "groupnorm", unet.normalization(64), [randn(3, 64, 5, 7, offset=0.5)], ["x"], gen,
                   dev, s)
    module_fixture(args.out_dir, "groupnorm_silu", nn.Sequential(unet.normalization(96), nn.SiLU()),
                   [randn(2, 96, 3, 5, offset=0.5)], ["x"], gen, dev, s)
    module_fixture(args.out_dir, "silu", nn.SiLU(), [3 * randn(3, 5, 7, 11)], ["x"], gen, dev, s)
    # the whole AttentionBlock: 64 channels, 16-channel heads (4 heads), 5x5 tokens
    module_fixture(args.out_dir, "attention", unet.AttentionBlock(64, 16, zero_init=False), [randn(2, 64, 5, 5)],
                   ["x"], gen, dev, s, aux=16)
    # Upsample (nearest x2 + conv 3x3) and Downsample (conv 3x3 stride 2, odd input)
    module_fixture(args.out_dir, "upsample", unet.Upsample(6, 6), [randn(2, 6, 5, 4)], ["x"], gen, dev, s)
    module_fixture(args.out_dir, "downsample", unet.Downsample(6, 6), [randn(2, 6, 9, 7)], ["x"], gen, dev, s)
    # concatenation along channels (an output block's [h, skip])
    module_fixture(args.out_dir, "concat", nn.Identity(), [randn(2, 5, 4, 3), randn(2, 3, 4, 3)], ["a", "b"], gen,
                   dev, s, fn=lambda a, b: torch.cat([a, b], dim=1))
    # timestep embedding (sinusoidal, 21 channels: odd, so the zero pad column is there) + time_embed MLP
    C = 21
    t = torch.tensor([0, 1, 999, 980, 537, 20, 250], dtype=torch.int32)
    mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.SiLU(), nn.Linear(4 * C, 4 * C)).to(dev)
    randomize(mlp, gen)
    params = list(mlp.named_parameters())
    emb = unet.timestep_embedding(t.to(dev), C)
    y, dy, grads = run(lambda e: mlp(e), [emb.detach().cpu()], params, gen, dev)
    tensors = {"t": t.numpy().astype(np.int32), "emb": np32(emb)}
    tensors.update({"time_embed." + n: np32(q) for n, q in params})
    tensors.update({"y": np32(y), "dy": np32(dy), "demb": np32(grads[0])})
    tensors.update({"grad.time_embed." + n: np32(g) for (n, _), g in zip(params, grads[1:])})
    write(args.out_dir, "timestep_embedding", s, tensors)
    # MSE loss (mean over every element), its gradient with respect to the prediction
    out, target = randn(3, 3, 7, 5).to(dev).requires_grad_(True), randn(3, 3, 7, 5).to(dev)
    loss = F.mse_loss(out, target)
    (dout,) = torch.autograd.grad(loss, [out])
    write(args.out_dir, "mse", s, {"out": np32(out), "target": np32(target), "loss": np32(loss),
                                   "dout": np32(dout)})


if __name__ == "__main__":
    main()
