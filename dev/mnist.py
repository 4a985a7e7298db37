"""PyTorch reference of train_mnist.cu's network: the definition of the model that dev/test_mnist.cu checks against.

Network (the write-up's, no dropout): conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max-pool 2, fc 9216->128, ReLU,
fc 128->10, log-softmax + NLL (F.cross_entropy, mean over the batch).

  python3 dev/mnist.py                     # debug state dev/mnist_debug_state.bin (B=64, PyTorch init, real batch)
                                           # and the CI fixture dev/fixtures/mnist_fixture.bin (B=8, hash init)
  python3 dev/mnist.py --eval_checkpoint FILE   # loads a ./train_mnist checkpoint into this model, test accuracy

Everything in true fp32: TF32 off for matmul and cuDNN. Formats: scripts/binio.py (MNIST_*), data/README.md.
"""
import argparse
import copy
import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import binio  # noqa: E402

MEAN, STD = np.float32(0.1307), np.float32(0.3081)
FAN_IN = {"conv1": 9, "conv2": 288, "fc1": 9216, "fc2": 128}


IDX_MAX_COUNT = 10_000_000  # as ./train_mnist
DEFLATE_MAX_RATIO = 1032    # deflate expands data at most 1032 times


class GzStream:
    """A gzip file's bytes inflated on demand, member after member, as ./train_mnist reads them: zlib checks each
    member's CRC-32 and length trailer at its end; anything after the last member, or a stream that stops early, is
    an error. Raises binio.FormatError naming the file."""

    def __init__(self, path, raw):
        self.path, self.rest, self.ended = path, raw, False
        self.z = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def read(self, n):
        out = bytearray()
        while len(out) < n and not self.ended:
            try:
                chunk = self.z.decompress(self.rest, n - len(out))
            except zlib.error as e:
                if "incorrect data check" in str(e):
                    raise binio.FormatError(f"{self.path}: the gzip CRC-32 does not match the data (a corrupt file)")\
                        from None
                if "incorrect length check" in str(e):
                    raise binio.FormatError(f"{self.path}: the gzip length field does not match the data's length (a "
                                            "corrupt file)") from None
                raise binio.FormatError(f"{self.path}: corrupt gzip data (zlib: {e})") from None
            out += chunk
            self.rest = self.z.unconsumed_tail
            if self.z.eof:  # this member's CRC-32 and length matched its data
                after = self.z.unused_data
                if not after:
                    self.ended = True
                elif after[:2] == b"\x1f\x8b":
                    self.z, self.rest = zlib.decompressobj(16 + zlib.MAX_WBITS), after
                else:
                    raise binio.FormatError(f"{self.path}: {len(after)} bytes after the gzip stream that are not a "
                                            "gzip member (a corrupt file)")
            elif not chunk and not self.rest:
                raise binio.FormatError(f"{self.path}: truncated: the gzip stream stops before its end (the file is "
                                        "cut short: deflate data or the 8-byte CRC-32 and length trailer is missing)")
        return bytes(out)


def read_idx(path, images):
    """The items of one IDX .gz file, checked as ./train_mnist checks them (a regular file, gzip with every CRC-32 and
    length, magic 2051 or 2049, count 1..10^7 within what the file can hold, rows and cols 28, nothing short, nothing
    after the data, labels 0..9): uint8 (N,28,28) or (N,). Raises binio.FormatError naming the file and the field."""
    raw = binio.read_bytes(path, "MNIST file", max_bytes=1 << 31)
    if raw[:2] != b"\x1f\x8b":
        found = f"it starts with bytes {raw[:2].hex(' ')}" if len(raw) >= 2 else "shorter than the 2-byte gzip magic"
        raise binio.FormatError(f"{path}: not a gzip file ({found}, not 1f 8b; an uncompressed IDX file must be "
                                "gzipped)")
    gz = GzStream(path, raw)
    hdr_bytes = 16 if images else 8
    hdr = gz.read(hdr_bytes)
    if len(hdr) < hdr_bytes:
        raise binio.FormatError(f"{path}: truncated: the IDX header needs {hdr_bytes} bytes, found {len(hdr)}")
    magic, count = int.from_bytes(hdr[0:4], "big"), int.from_bytes(hdr[4:8], "big")
    want = 2051 if images else 2049
    if magic != want:
        raise binio.FormatError(f"{path}: magic number is {magic}, expected {want} "
                                f"({'an images' if images else 'a labels'} IDX file)")
    if not 1 <= count <= IDX_MAX_COUNT:
        raise binio.FormatError(f"{path}: item count is {count}, expected 1..{IDX_MAX_COUNT}")
    if images:
        for name, value in (("rows", hdr[8:12]), ("cols", hdr[12:16])):
            if int.from_bytes(value, "big") != 28:
                raise binio.FormatError(f"{path}: {name} is {int.from_bytes(value, 'big')}, expected 28")
    n = count * (28 * 28 if images else 1)
    if n > len(raw) * DEFLATE_MAX_RATIO:  # the header's size against the file's, before allocating
        raise binio.FormatError(f"{path}: item count is {count}: {n} bytes of {'pixels' if images else 'labels'}, "
                                f"more than a gzip file of {len(raw)} bytes can hold (deflate expands at most "
                                f"{DEFLATE_MAX_RATIO}x): the count is wrong or the file truncated")
    data = gz.read(n)
    if len(data) < n:
        raise binio.FormatError(f"{path}: truncated: {'the pixels' if images else 'the labels'} needs {n} bytes, "
                                f"found {len(data)}")
    if gz.read(1):  # also reaches the trailer: CRC-32 and length checked
        raise binio.FormatError(f"{path}: trailing bytes after the {count} items the header announces (file longer "
                                "than expected)")
    items = np.frombuffer(data, dtype=np.uint8)
    if not images and items.size and items.max() > 9:
        i = int(np.argmax(items > 9))
        raise binio.FormatError(f"{path}: label {i} is {items[i]}, expected 0..9")
    return items.reshape(count, 28, 28) if images else items


def load_idx(data_dir, prefix, limit):
    """Returns (images uint8 (N,28,28), labels uint8 (N,)) from the original IDX .gz files, the first `limit`.
    Raises binio.FormatError naming the file."""
    ip = os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz")
    lp = os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz")
    images, labels = read_idx(ip, True), read_idx(lp, False)
    if len(images) != len(labels):
        raise binio.FormatError(f"image and label counts disagree: {ip} has {len(images)} images, {lp} has "
                                f"{len(labels)} labels")
    return images[:limit], labels[:limit]


def normalize(images):
    """As torchvision ToTensor + Normalize and as train_mnist.cu: ((p / 255) - mean) / std in fp32. (N,1,28,28)"""
    x = images.astype(np.float32) / np.float32(255.0)
    return ((x - MEAN) / STD)[:, None, :, :].astype(np.float32)


def hash_init(init_seed):
    """Weights for the CI fixture from an integer hash, bit-exact in NumPy and C (dev/test_mnist.cu):
    x = i*0x9E3779B1 + (tensor_index+1)*0x85EBCA77 + init_seed*0xC2B2AE3D (mod 2^32), then the murmur3-style finalizer
    below; u = (x >> 8) / 2^24; w = bound * (2u - 1), bound = float32(1/sqrt(fan_in)). i: flat index, PyTorch layout."""
    out = {}
    for ti, (name, shape) in enumerate(binio.MNIST_PARAM_SHAPES):
        n = int(np.prod(shape))
        add = np.uint32(((ti + 1) * 0x85EBCA77 + init_seed * 0xC2B2AE3D) & 0xFFFFFFFF)
        with np.errstate(over="ignore"):
            x = np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B1) + add
            x ^= x >> np.uint32(16)
            x *= np.uint32(0x7FEB352D)
            x ^= x >> np.uint32(15)
            x *= np.uint32(0x846CA68B)
            x ^= x >> np.uint32(16)
        u = (x >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)
        bound = np.float32(1.0 / np.sqrt(FAN_IN[name.split(".")[0]]))
        out[name] = (bound * (np.float32(2.0) * u - np.float32(1.0))).astype(np.float32).reshape(shape)
    return out


def build_net(torch):
    nn, F = torch.nn, torch.nn.functional

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x):  # (B,1,28,28) -> logits (B,10)
            x = F.relu(self.conv1(x))
            x = F.relu(self.conv2(x))
            x = F.max_pool2d(x, 2)
            x = torch.flatten(x, 1)
            x = F.relu(self.fc1(x))
            return self.fc2(x)

    return Net


def reference(torch, net, x, y, cfg, n_steps):
    """Outputs, loss, gradients at the given weights, then the losses of n_steps SGD and AdamW steps on (x, y)."""
    F = torch.nn.functional
    init = copy.deepcopy(net.state_dict())
    out = net(x)
    loss = F.cross_entropy(out, y)
    net.zero_grad()
    loss.backward()
    res = {"out": out.detach().cpu().numpy(), "loss": np.array(loss.item(), dtype=np.float32)}
    for name, p in net.named_parameters():
        res["grad." + name] = p.grad.detach().cpu().numpy()
    for kind in ("sgd", "adamw"):
        net.load_state_dict(init)
        if kind == "sgd":
            opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=cfg["adam_lr"], betas=(cfg["beta1"], cfg["beta2"]),
                                    eps=cfg["eps"], weight_decay=cfg["adam_weight_decay"], foreach=False)
        losses = []
        for _ in range(n_steps):
            opt.zero_grad()
            l = F.cross_entropy(net(x), y)
            losses.append(l.item())
            l.backward()
            opt.step()
        res[kind + "_losses"] = np.array(losses, dtype=np.float32)
    net.load_state_dict(init)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", default="data/mnist")
    ap.add_argument("--out", default="dev/mnist_debug_state.bin", help="debug state (B=batch_size, PyTorch init)")
    ap.add_argument("--fixture", default="dev/fixtures/mnist_fixture.bin", help="CI fixture (empty: skip)")
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--fixture_batch_size", type=int, default=8)
    ap.add_argument("--n_steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--init_seed", type=int, default=7)
    ap.add_argument("--device", default="cuda", help="cuda (when present) or cpu")
    ap.add_argument("--eval_checkpoint", default="", help="evaluate a ./train_mnist checkpoint on the test set and exit")
    args = ap.parse_args()
    try:
        run(args)
    except binio.FormatError as e:  # a bad file or path: one line, not a traceback
        sys.exit(f"error: {e}")


def run(args):
    # the inputs first: a bad file is reported without PyTorch
    if args.eval_checkpoint:
        _, cfg, tensors = binio.read(args.eval_checkpoint, binio.MNIST_CHECKPOINT)
        weights = {n: binio.expect(args.eval_checkpoint, tensors, n, s, np.float32)
                   for n, s in binio.MNIST_PARAM_SHAPES}
        images, labels = load_idx(args.data_dir, "t10k", 10000)
    else:
        images, labels = load_idx(args.data_dir, "train", max(args.batch_size, args.fixture_batch_size))
        if args.fixture:
            timg, tlab = load_idx(args.data_dir, "t10k", args.fixture_batch_size)
    try:
        import torch
    except ImportError:  # a reference tool of the GPU machine: one line, not a traceback, elsewhere
        sys.exit("error: dev/mnist.py needs PyTorch (the GPU machine has it; pip install torch)")
    torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    device = args.device if (args.device == "cpu" or torch.cuda.is_available()) else "cpu"
    Net = build_net(torch)

    if args.eval_checkpoint:
        net = Net().to(device)
        net.load_state_dict({n: torch.from_numpy(w) for n, w in weights.items()})
        x = torch.from_numpy(normalize(images)).to(device)
        y = torch.from_numpy(labels.astype(np.int64)).to(device)
        with torch.no_grad():
            out = net(x)
            loss = torch.nn.functional.cross_entropy(out, y).item()
            acc = 100.0 * (out.argmax(1) == y).float().mean().item()
        print(f"PyTorch on {args.eval_checkpoint}: test loss {loss:.4f}, test acc {acc:.2f}% "
              f"(the trainer recorded {cfg['test_accuracy']:.2f}% after epoch {cfg['epoch']})")
        return

    cfg = dict(lr=0.05, momentum=0.9, weight_decay=5e-4, adam_lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
               adam_weight_decay=0.01)

    # the debug state: PyTorch's own init (seeded), the first batch_size training images
    torch.manual_seed(args.seed)
    net = Net().to(device)
    B = args.batch_size
    x = torch.from_numpy(normalize(images[:B])).to(device)
    y = torch.from_numpy(labels[:B].astype(np.int64)).to(device)
    tensors = {n: p.detach().cpu().numpy() for n, p in net.state_dict().items()}
    tensors["x"] = x.cpu().numpy()
    tensors["y"] = labels[:B].astype(np.int32)
    tensors.update(reference(torch, net, x, y, cfg, args.n_steps))
    binio.write(args.out, binio.MNIST_DEBUG_STATE, dict(cfg, batch_size=B, n_steps=args.n_steps), tensors)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes) on {device}: loss {tensors['loss']:.6f}, "
          f"sgd losses {tensors['sgd_losses']}, adamw losses {tensors['adamw_losses']}")

    if args.fixture:
        # the CI fixture: hash weights, a few test images, computed on the CPU in fp32
        Bf = args.fixture_batch_size
        net = Net()
        w = hash_init(args.init_seed)
        net.load_state_dict({n: torch.from_numpy(v) for n, v in w.items()})
        x = torch.from_numpy(normalize(timg))
        y = torch.from_numpy(tlab.astype(np.int64))
        res = reference(torch, net, x, y, cfg, args.n_steps)
        res["grad.fc1.weight.rows"] = res.pop("grad.fc1.weight")[:4].copy()
        fx = {"x": x.numpy(), "y": tlab.astype(np.int32)}
        fx.update(res)
        binio.write(args.fixture, binio.MNIST_FIXTURE,
                    dict(cfg, batch_size=Bf, n_steps=args.n_steps, init_seed=args.init_seed), fx)
        print(f"wrote {args.fixture} ({os.path.getsize(args.fixture)} bytes): loss {res['loss']:.6f}")


if __name__ == "__main__":
    main()
