"""The write-up's MNIST CNN in PyTorch with every matrix product on our matmul (dev/torch_ops), trained beside the
same model on stock PyTorch in one run: accuracy and time per epoch.

  python3 dev/cnn_custom.py [--epochs 3] [--batch_size 64] [--modes torch,ours,ours_compile] [--tf32 1]
                            [--device cuda|cpu] [--train_limit N] [--test_limit N] [--out bench_results]

Network (dev/mnist.py's): conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max-pool 2, fc 9216->128, ReLU, fc 128->10,
cross-entropy. Modes, each from the same initial weights (PyTorch's init, seed 0) and the same batches:
  torch         stock PyTorch: nn.Conv2d (cuDNN), nn.Linear (cuBLAS)
  ours          every product on torch_ops.matmul: the fully connected layers, and the convolutions as F.unfold
                (im2col) then matmul; forward and backward (the op's autograd runs the gradients on matmul too)
  ours_compile  "ours" under torch.compile(fullgraph=True): a graph break would be an error
  torch_compile stock PyTorch under torch.compile
SGD, lr 0.01, momentum 0.9, weight decay 5e-4 (dev/bench_mnist.py's). --tf32 1 (default, as the trainers and
dev/bench_mnist.py): our matmul's TF32 kernel (dev/matmul.cu version 7) and PyTorch's TF32 (cuBLAS, cuDNN);
--tf32 0: strict fp32 on both sides. Time per epoch: CUDA events around the epoch's steps (time.perf_counter on the
CPU), data resident on the device, batches drawn from one seeded permutation per epoch; the table gives the first
epoch (compilation, the softmax/matmul first calls) apart and the median of the others. Test accuracy after the
last epoch. Writes cnn_custom.json and cnn_custom.csv into --out.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["torch", "ours", "ours_compile", "torch_compile"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3, help="epochs per mode, >= 1 (default 3)")
    ap.add_argument("--batch_size", type=int, default=64, help="batch size, >= 1 (default 64)")
    ap.add_argument("--modes", default="torch,ours,ours_compile",
                    help=f"comma-separated, of {','.join(MODES)} (default torch,ours,ours_compile)")
    ap.add_argument("--tf32", type=int, default=1, choices=[0, 1], help="TF32 on both sides (default 1)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="default cuda")
    ap.add_argument("--train_limit", type=int, default=0, help="first N training images (default 0: all 60000)")
    ap.add_argument("--test_limit", type=int, default=0, help="first N test images (default 0: all 10000)")
    ap.add_argument("--data_dir", default=os.path.join(ROOT, "data", "mnist"), help="MNIST IDX .gz files")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and batch order (default 0)")
    ap.add_argument("--out", default="bench_results", help="folder for cnn_custom.json and .csv")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: unknown mode {', '.join(bad) or '(none)'}; expected some of {', '.join(MODES)}")
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, found {getattr(args, name)}")
    for name in ("train_limit", "test_limit"):
        if getattr(args, name) < 0:
            ap.error(f"--{name} must be >= 0, found {getattr(args, name)}")
    args.modes = modes
    return args


def custom_forward(torch, torch_ops, net, x, tf32):
    """dev/mnist.py's Net, its products on torch_ops.matmul. x (B, 1, 28, 28) -> logits (B, 10)."""
    F = torch.nn.functional

    def linear(h, layer):  # h (N, in) @ weight^T (in, out): a transposed view, no copy
        return torch_ops.matmul(h, layer.weight.t(), tf32) + layer.bias

    def conv(h, layer):  # 3x3, stride 1, no padding, as im2col: (B*L, C*9) @ (C*9, Cout)
        B, C, H, W = h.shape
        cout = layer.weight.shape[0]
        cols = F.unfold(h, 3).transpose(1, 2).reshape(B * (H - 2) * (W - 2), C * 9)
        y = torch_ops.matmul(cols, layer.weight.reshape(cout, C * 9).t(), tf32) + layer.bias
        return y.view(B, H - 2, W - 2, cout).permute(0, 3, 1, 2)  # NCHW view of the NHWC result

    h = F.relu(conv(x, net.conv1))
    h = F.relu(conv(h, net.conv2))
    h = torch.flatten(F.max_pool2d(h, 2), 1)
    h = F.relu(linear(h, net.fc1))
    return linear(h, net.fc2)


def main():
    args = parse_args()
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(f"error: dev/cnn_custom.py needs PyTorch and NumPy ({e})", file=sys.stderr)
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is available (torch.cuda.is_available() is False); "
              "use --device cpu", file=sys.stderr)
        return 1
    sys.path.insert(0, os.path.join(ROOT, "dev"))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    sys.path.insert(0, os.path.join(ROOT, "dev", "torch_ops"))
    import binio
    import mnist as ref
    try:
        import torch_ops
    except Exception as e:  # a failed build: its compiler output is in the message
        print(f"error: import torch_ops (dev/torch_ops) failed: {type(e).__name__}: {str(e).strip()[-2000:]}",
              file=sys.stderr)
        return 1
    F = torch.nn.functional
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.tf32)
    try:
        train_x, train_y = ref.load_idx(args.data_dir, "train", args.train_limit or 60000)
        test_x, test_y = ref.load_idx(args.data_dir, "t10k", args.test_limit or 10000)
    except (binio.FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    X, Y = torch.from_numpy(ref.normalize(train_x)).to(dev), torch.from_numpy(train_y.astype(np.int64)).to(dev)
    TX, TY = torch.from_numpy(ref.normalize(test_x)).to(dev), torch.from_numpy(test_y.astype(np.int64)).to(dev)
    torch.manual_seed(args.seed)
    Net = ref.build_net(torch)
    init = Net().state_dict()
    on_gpu = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if on_gpu else "CPU"
    print(f"device {name}, torch {torch.__version__}, torch_ops {torch_ops.BUILD_INFO['variant']} build; "
          f"{len(X)} training images, {len(TX)} test images, batch {args.batch_size}, {args.epochs} epochs, "
          f"tf32 {args.tf32}", flush=True)

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    rows = []
    for mode in args.modes:
        net = Net().to(dev)
        net.load_state_dict(init)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        if mode.startswith("ours"):
            def fwd(x, net=net):
                return custom_forward(torch, torch_ops, net, x, bool(args.tf32))
        else:
            fwd = net

        def loss_fn(x, y, fwd=fwd):
            return F.cross_entropy(fwd(x), y)

        if mode.endswith("compile"):
            torch._dynamo.reset()
            loss_fn = torch.compile(loss_fn, fullgraph=True)
        gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
        epoch_ms, losses = [], []
        for epoch in range(args.epochs):
            perm = torch.randperm(len(X), generator=gen).to(dev)
            sync()
            if on_gpu:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            total = torch.zeros((), device=dev)
            for i in range(0, len(X), args.batch_size):
                idx = perm[i:i + args.batch_size]
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(X[idx], Y[idx])
                loss.backward()
                opt.step()
                total += loss.detach() * len(idx)
            if on_gpu:
                e1.record()
                e1.synchronize()
                epoch_ms.append(e0.elapsed_time(e1))
            else:
                epoch_ms.append(1000 * (time.perf_counter() - t0))
            losses.append(float(total) / len(X))
            print(f"{mode:14s} epoch {epoch + 1}/{args.epochs} | train loss {losses[-1]:.4f} | "
                  f"{epoch_ms[-1]:.1f} ms", flush=True)
        with torch.no_grad():
            correct = 0
            for i in range(0, len(TX), 1000):
                logits = fwd(TX[i:i + 1000])
                correct += int((logits.argmax(1) == TY[i:i + 1000]).sum())
        acc = 100.0 * correct / len(TX)
        steady = statistics.median(epoch_ms[1:]) if len(epoch_ms) > 1 else epoch_ms[0]
        rows.append({"mode": mode, "first_epoch_ms": epoch_ms[0], "epoch_ms": steady, "epochs_ms": epoch_ms,
                     "train_loss": losses, "test_accuracy": acc})
        print(f"{mode:14s} test accuracy {acc:.2f}%, {steady:.1f} ms/epoch (first epoch {epoch_ms[0]:.1f} ms)",
              flush=True)

    base = next((r for r in rows if r["mode"] == "torch"), None)
    print(f"\n| mode | ms / epoch (first) | vs torch | test accuracy | final train loss |\n|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['epoch_ms'] / base['epoch_ms']:.2f}x" if base else "-"
        print(f"| {r['mode']} | {r['epoch_ms']:.1f} ({r['first_epoch_ms']:.1f}) | {ratio} | "
              f"{r['test_accuracy']:.2f}% | {r['train_loss'][-1]:.4f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cnn_custom.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "batch_size": args.batch_size, "epochs": args.epochs,
                   "tf32": args.tf32, "train_images": len(X), "test_images": len(TX), "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "cnn_custom.csv"), "w") as f:
        f.write("mode,epoch_ms,first_epoch_ms,test_accuracy,final_train_loss\n")
        for r in rows:
            f.write(f"{r['mode']},{r['epoch_ms']:.2f},{r['first_epoch_ms']:.2f},{r['test_accuracy']:.2f},"
                    f"{r['train_loss'][-1]:.5f}\n")
    print(f"wrote {args.out}/cnn_custom.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
