"""PyTorch reference of train_linreg: the same data file, initial values and hyperparameters.

Trains nn.Linear(D, 1) with nn.MSELoss and torch.optim.SGD, full batch, in true fp32 (TF32 off), and writes the
same JSON as ./train_linreg --result_file: w, b, every epoch's training loss (before that epoch's update), the test
loss. dev/test_linreg.py compares the two.

  python3 dev/linreg.py --data_file data.bin --out torch.json [--epochs 200 --lr 0.01 --w_init 0.83 --b_init 0.7645]
                        [--device cuda|cpu]
"""
import argparse
import json
import os
import sys
import time

import numpy as np
try:
    import torch
except ImportError:  # a reference tool of the GPU machine: one line, not a traceback, elsewhere
    sys.exit("error: dev/linreg.py needs PyTorch (the GPU machine has it; pip install torch)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import binio  # noqa: E402


def train(x, y, n_train, epochs, lr, w_init, b_init, device):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    D = x.shape[1]
    xt = torch.from_numpy(x).to(device)
    yt = torch.from_numpy(y).to(device).view(-1, 1)
    x_train, y_train, x_test, y_test = xt[:n_train], yt[:n_train], xt[n_train:], yt[n_train:]
    model = torch.nn.Linear(D, 1).to(device)
    with torch.no_grad():
        model.weight.fill_(w_init)
        model.bias.fill_(b_init)
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = torch.empty(epochs, device=device)  # kept on the device: no sync per epoch
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for epoch in range(epochs):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x_train), y_train)
        loss.backward()
        opt.step()
        losses[epoch] = loss.detach()
    if device == "cuda":
        torch.cuda.synchronize()
    train_ms = 1e3 * (time.perf_counter() - t0)
    with torch.no_grad():
        test_loss = loss_fn(model(x_test), y_test).item()
    return {
        "device": device, "n_points": int(x.shape[0]), "n_features": D, "n_train": int(n_train), "epochs": epochs,
        "lr": lr, "w": model.weight.detach().cpu().view(-1).tolist(), "b": model.bias.item(), "test_loss": test_loss,
        "train_ms": train_ms, "train_losses": losses.cpu().tolist(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_file", required=True)
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--w_init", type=float, default=0.83)
    ap.add_argument("--b_init", type=float, default=0.7645)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    try:  # the file contract of binio: a clear error, the output checked before the training
        binio.check_output(args.out, "--out")
        _, cfg, tensors = binio.read(args.data_file, binio.LINREG_DATASET)
        x = binio.expect(args.data_file, tensors, "x", (cfg["n_points"], cfg["n_features"]), np.float32)
        y = binio.expect(args.data_file, tensors, "y", (cfg["n_points"],), np.float32)
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    result = train(x, y, cfg["n_train"], args.epochs, args.lr, args.w_init, args.b_init, args.device)
    try:
        binio.write_file(args.out, json.dumps(result, indent=1).encode(), "--out")
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    print(f"torch ({args.device}): w {result['w']} b {result['b']:.7f} final loss {result['train_losses'][-1]:.7f} "
          f"test loss {result['test_loss']:.7f} ({result['train_ms']:.1f} ms)")


if __name__ == "__main__":
    main()
