"""CI tests of scripts/convert.py: the trainers' weights to and from PyTorch (.pt) and safetensors.

- Round trips: a checkpoint of each trainer (train_mnist and train_linreg trained here on the CPU for a moment; a
  train_unet checkpoint written through binio in the trainer's layout, from the committed forward fixture's weights
  plus EMA, AdamW moments and rng_state) to safetensors and .pt and back is byte-identical to the original.
- The converted weights in plain PyTorch give what the trainer gave: train_mnist's test accuracy (stored in its
  checkpoint) from dev/mnist.py's Net; train_linreg's test loss (in its result file) from nn.Linear; for the UNet,
  which trains on the GPU only, dev/unet.py's model loaded with strict=True against the fixture's output (what
  dev/test_unet.cu holds the trainer's forward to on the GPU) and against generate.py's NumPy forward of the
  original .bin (an implementation that shares no code with PyTorch or with convert.py).
- Our safetensors reader and writer against the `safetensors` package (SKIP where it is absent).
- Bad inputs (truncated files, headers that lie, wrong names and shapes, special paths, missing PyTorch): exit 1,
  one `error:` line naming the file, no traceback; a failed conversion leaves the output untouched.
Torch-only checks SKIP where PyTorch is absent.

  python3 dev/test_convert.py [substring ...]   # from the repo root, after make; last line: N passed, N failed,
                                                # N skipped
"""
import importlib.util
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import binio  # noqa: E402
import convert  # noqa: E402
import generate  # noqa: E402

FIXTURE = os.path.join(ROOT, "dev", "fixtures", "unet_forward_small.bin")
CONVERT = os.path.join(ROOT, "scripts", "convert.py")
TMP = tempfile.mkdtemp(prefix="test_convert_")
MNIST_TEST = 2000  # test images train_mnist evaluates (--test_limit) and PyTorch classifies again
try:
    import torch
except ImportError:
    torch = None
try:
    import safetensors.numpy as st_numpy
except ImportError:
    st_numpy = None


class Skip(Exception):
    pass


def need_torch():
    if torch is None:
        raise Skip("no PyTorch here")


def tmp(name):
    return os.path.join(TMP, name)


def run(*args, env=None):
    r = subprocess.run([sys.executable, CONVERT] + [str(a) for a in args], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, stdin=subprocess.DEVNULL, env=env)
    return r.returncode, r.stdout + r.stderr


def conv(src, dst, *extra):
    code, out = run("--input", src, "--output", dst, *extra)
    assert code == 0, f"convert {os.path.basename(src)} -> {os.path.basename(dst)} exited {code}: {out.strip()[-400:]}"
    return dst


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        da, db = fa.read(), fb.read()
    if da != db:
        at = next((i for i in range(min(len(da), len(db))) if da[i] != db[i]), min(len(da), len(db)))
        raise AssertionError(f"{b} differs from {a} at byte {at} ({len(db)} vs {len(da)} bytes)")
    return len(da)


def load_module(name, rel):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------------------------------
# the three trainers' files


def unet_checkpoint():
    """A full train_unet checkpoint (what unet_save_checkpoint writes: weights, ema., adam_m., adam_v. in the
    parameter order, then rng_state), from the fixture's weights; -> (path, fixture tensors)."""
    path = tmp("unet.bin")
    _, cfg, fx = binio.read(FIXTURE, binio.UNET_FIXTURE)
    if os.path.exists(path):
        return path, fx
    weights = {n: v for n, v in fx.items() if n not in ("x_t", "t", "out")}
    rng = np.random.default_rng(1)
    tensors = dict(weights)
    for prefix in ("ema.", "adam_m.", "adam_v."):
        for n, w in weights.items():
            t = rng.standard_normal(w.shape).astype(np.float32)
            tensors[prefix + n] = np.abs(t) if prefix == "adam_v." else w + np.float32(0.01) * t
    tensors["rng_state"] = np.array([5, 300, 300, 0], np.int32)
    fields = {n: cfg[n] for n, _ in binio.UNET_MODEL_FIELDS}
    binio.write(path, binio.UNET_CHECKPOINT, dict(fields, step=300, batch_size=4, seed=5, lr=2e-4, ema_rate=0.999,
                                                  has_ema=1, has_optimizer=1), tensors)
    return path, fx


def mnist_checkpoint(optimizer):
    """./train_mnist on the CPU, one epoch on 640 images (AdamW: about 66% test accuracy), evaluated on the first
    MNIST_TEST test images: a real checkpoint with its optimizer state, a few seconds each."""
    path = tmp(f"mnist_{optimizer}.bin")
    if not os.path.exists(path):
        binary = os.path.join(ROOT, "train_mnist")
        if not os.path.exists(binary):
            raise AssertionError(f"{binary} not found (run make train_mnist first)")
        r = subprocess.run([binary, "--device", "cpu", "--train_limit", "640", "--epochs", "1", "--batch_size", "64",
                            "--optimizer", optimizer, "--test_limit", str(MNIST_TEST), "--confusion", "0",
                            "--checkpoint", path], capture_output=True, text=True, cwd=ROOT,
                           timeout=600, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"train_mnist exited {r.returncode}: {(r.stdout + r.stderr).strip()[-400:]}"
    return path


def linreg_result():
    """./train_linreg on the CPU: 3000 generated points, 200 epochs; -> (result json, the dataset it trained on)."""
    path, data = tmp("linreg.json"), tmp("linreg_data.bin")
    if not os.path.exists(path):
        binary = os.path.join(ROOT, "train_linreg")
        if not os.path.exists(binary):
            raise AssertionError(f"{binary} not found (run make train_linreg first)")
        r = subprocess.run([binary, "--device", "cpu", "--points", "3000", "--epochs", "200",
                            "--save_data", data, "--result_file", path], capture_output=True, text=True, cwd=ROOT,
                           timeout=600, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"train_linreg exited {r.returncode}: {(r.stdout + r.stderr).strip()[-400:]}"
    return path, data


def round_trips(original, ext):
    """original -> safetensors -> ext, and original -> .pt -> ext (and .pt -> safetensors -> ext when torch is
    there): every result byte-identical to the original. -> a summary."""
    stem = os.path.splitext(os.path.basename(original))[0]
    st = conv(original, tmp(stem + ".safetensors"))
    n = same_bytes(original, conv(st, tmp(stem + "_st" + ext)))
    done = ["safetensors"]
    if torch is not None:
        pt = conv(original, tmp(stem + ".pt"))
        same_bytes(original, conv(pt, tmp(stem + "_pt" + ext)))
        st2 = conv(pt, tmp(stem + "_pt.safetensors"))
        same_bytes(original, conv(st2, tmp(stem + "_pt_st" + ext)))
        same_bytes(st, st2)
        done += [".pt", ".pt -> safetensors"]
    return f"{stem}{ext} ({n} bytes) back through {', '.join(done)}: byte-identical" + \
        ("" if torch is not None else " (.pt: SKIP, no PyTorch)")


def test_unet_round_trip():
    path, _ = unet_checkpoint()
    return round_trips(path, ".bin")


def test_mnist_sgd_round_trip():
    return round_trips(mnist_checkpoint("sgd"), ".bin")


def test_mnist_adamw_round_trip():
    return round_trips(mnist_checkpoint("adamw"), ".bin")


def test_linreg_round_trip():
    path, _ = linreg_result()
    return round_trips(path, ".json")


def test_metadata_keeps_every_field():
    path, _ = unet_checkpoint()
    header, cfg, tensors = binio.read(path, binio.UNET_CHECKPOINT)
    meta, st = convert.read_safetensors(conv(path, tmp("unet_meta.safetensors")))
    for name, kind in binio.UNET_CHECKPOINT.fields:
        got = np.float32(meta[name]) if kind == "f" else int(meta[name])
        assert got == cfg[name] or (kind == "f" and np.float32(got) == np.float32(cfg[name])), \
            f"metadata {name} is {meta[name]}, the header {cfg[name]}"
    assert meta["magic"] == str(binio.UNET_CHECKPOINT.magic) and meta["version"] == "1", meta
    assert json.loads(meta["tensor_order"]) == list(tensors), "tensor_order is not the file's order"
    assert list(st) == list(tensors), "the safetensors header lists the tensors in another order"
    for n, t in tensors.items():
        assert st[n].dtype == t.dtype and np.array_equal(st[n].view(np.uint8), t.view(np.uint8)), n
    odd = np.array([0x7fc01234], "<u4").view("<f4")[0]  # a NaN with a payload: no decimal keeps it
    assert convert.float_text(odd) == "0x7fc01234" and convert.meta_float("m", {"x": "0x7fc01234"}, "x").view(
        "<u4") == 0x7fc01234
    return f"{len(binio.UNET_CHECKPOINT.fields)} header fields, magic, version, tensor order and {len(tensors)} " \
        f"tensors bit for bit; a NaN payload kept as 0x7fc01234"


# ----------------------------------------------------------------------------------------------------------------
# the converted weights in plain PyTorch


def unet_model(meta):
    """dev/unet.py's UNetModel for the model fields in a metadata dict."""
    ref = load_module("unet_ref", "dev/unet.py")
    cfg = {n: int(meta[n]) for n, k in binio.UNET_MODEL_FIELDS if k == "i"}
    mult = [cfg[f"mult{i}"] for i in range(cfg["n_levels"])]
    attn = [1 << k for k in range(cfg["n_levels"]) if cfg["attn_ds_mask"] >> k & 1]
    return ref.UNetModel(cfg["image_size"], cfg["in_channels"], cfg["model_channels"], cfg["out_channels"],
                         cfg["num_res_blocks"], attn, mult, cfg["num_head_channels"]).eval()


def compare(name, got, ref, atol, rtol):
    err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    bound = atol + rtol * np.abs(ref.astype(np.float64))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    detail = f"{name}: max abs err {err.max():.3g} (tol {atol:g} + {rtol:g}*|ref|)"
    assert np.all(err <= bound), f"{detail}; worst at {tuple(int(i) for i in worst)}"
    return detail


# The same bound as dev/test_unet_scripts.py's NumPy forward against PyTorch, for the same reason: fp32 on both
# sides with different summation orders (torch CPU here, the fixture from dev/unet.py on the GPU machine) over ~50
# layers; measured there 1.5e-6 to 3.5e-6. A wrong name, layout or tensor moves outputs by O(0.1).
FWD_ATOL, FWD_RTOL = 3e-5, 3e-4


def test_unet_safetensors_in_pytorch():
    need_torch()
    path, fx = unet_checkpoint()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    details = []
    for weights in ("raw", "ema"):
        st = conv(path, tmp(f"unet_{weights}.safetensors"), "--weights", weights)
        if st_numpy is not None:  # the ecosystem's reader; ours is checked against it below
            sd = {n: torch.from_numpy(a) for n, a in st_numpy.load_file(st).items()}
            meta = convert.read_safetensors(st)[0]
        else:
            meta, arrays = convert.read_safetensors(st)
            sd = {n: torch.from_numpy(a.copy()) for n, a in arrays.items()}
        model = unet_model(meta)
        model.load_state_dict(sd, strict=True)
        x, t = torch.from_numpy(fx["x_t"]), torch.from_numpy(fx["t"].astype(np.int64))
        with torch.no_grad():
            out = model(x, t).numpy()
        _, _, tensors = binio.read(path, binio.UNET_CHECKPOINT)
        prefix = "ema." if weights == "ema" else ""
        config = generate.ModelConfig(binio.read(path, binio.UNET_CHECKPOINT)[1], path)
        numpy_out = generate.NumpyUNet(config, {n: tensors[prefix + n] for n in config.param_shapes()}).forward(
            fx["x_t"], fx["t"])
        details.append(compare(f"{weights}: torch vs generate.py's NumPy forward of the .bin", out, numpy_out,
                               FWD_ATOL, FWD_RTOL))
        if weights == "raw":  # the fixture's weights are the checkpoint's raw weights
            details.append(compare("raw: torch vs the fixture's out", out, fx["out"], FWD_ATOL, FWD_RTOL))
    return "load_state_dict(strict=True) into dev/unet.py's UNetModel; " + "; ".join(details)


def test_unet_pt_state_dict_strict():
    need_torch()
    path, _ = unet_checkpoint()
    ck = torch.load(conv(path, tmp("unet_all.pt")), weights_only=True)
    model = unet_model(ck["metadata"])
    model.load_state_dict(ck["state_dict"], strict=True)
    _, _, tensors = binio.read(path, binio.UNET_CHECKPOINT)
    for n, p in model.state_dict().items():
        assert np.array_equal(p.numpy().view(np.uint32), tensors[n].view(np.uint32)), n
    assert set(ck["extra"]) == set(tensors) - set(ck["state_dict"]), "extra does not hold every other tensor"
    return f"the full .pt's state_dict ({len(ck['state_dict'])} tensors) loads with strict=True, bit for bit; " \
        f"extra holds the other {len(ck['extra'])}"


def test_mnist_accuracy_in_pytorch():
    need_torch()
    path = mnist_checkpoint("adamw")  # far from chance after 640 images (SGD is not yet)
    _, cfg, _ = binio.read(path, binio.MNIST_CHECKPOINT)
    st = conv(path, tmp("mnist_raw.safetensors"), "--weights", "raw")
    meta, arrays = convert.read_safetensors(st)
    mnist = load_module("mnist_ref", "dev/mnist.py")
    torch.backends.cudnn.allow_tf32 = False
    net = mnist.build_net(torch)().eval()
    net.load_state_dict({n: torch.from_numpy(a.copy()) for n, a in arrays.items()}, strict=True)
    images, labels = mnist.load_idx(os.path.join(ROOT, "data", "mnist"), "t10k", MNIST_TEST)
    x = torch.from_numpy(mnist.normalize(images)).reshape(-1, 1, 28, 28)
    with torch.no_grad():
        pred = net(x).argmax(1).numpy()
    correct = int((pred == labels).sum())
    trainer = cfg["test_accuracy"] * len(labels) / 100.0
    # Both sides are fp32 with different summation orders: only an image whose two best logits tie to within a few
    # ulps can change its class. One such image is allowed; a wrong layout or name costs thousands.
    assert abs(correct - trainer) <= 1.0, f"PyTorch classifies {correct} of {len(labels)} test images right, the " \
        f"trainer {trainer:.1f} ({cfg['test_accuracy']:.2f}%)"
    return f"dev/mnist.py's Net (strict=True) on the converted weights: {correct}/{len(labels)} test images, the " \
        f"trainer's checkpoint says {cfg['test_accuracy']:.2f}%"


def test_linreg_test_loss_in_pytorch():
    need_torch()
    path, data = linreg_result()
    with open(path) as f:
        result = json.load(f)
    _, cfg, tensors = binio.read(data, binio.LINREG_DATASET)
    st = conv(path, tmp("linreg.safetensors"))
    model = torch.nn.Linear(cfg["n_features"], 1)  # dev/linreg.py's model
    model.load_state_dict({n: torch.from_numpy(a.copy()) for n, a in convert.read_safetensors(st)[1].items()},
                          strict=True)
    n = cfg["n_train"]
    with torch.no_grad():
        pred = model(torch.from_numpy(tensors["x"][n:])).view(-1)
        loss = torch.nn.functional.mse_loss(pred, torch.from_numpy(tensors["y"][n:])).item()
    # a mean of 600 squared errors in fp32 in two summation orders: a few ulps apart, far below 1e-5 relative
    assert abs(loss - result["test_loss"]) <= 1e-5 * abs(result["test_loss"]), \
        f"PyTorch's test loss {loss:.9g}, the trainer's {result['test_loss']:.9g}"
    return f"nn.Linear (strict=True) test loss {loss:.7g}, the trainer's {result['test_loss']:.7g}"


def test_linreg_new_weights_back():
    """Weights changed in PyTorch go back into the result file: w and b rewritten, every other line kept."""
    path, _ = linreg_result()
    meta, arrays = convert.read_safetensors(conv(path, tmp("linreg_edit.safetensors")))
    arrays = {"weight": arrays["weight"] * np.float32(2), "bias": arrays["bias"] + np.float32(1)}
    ck = convert.Checkpoint(convert.LINREG_KIND, meta, arrays, ["weight", "bias"])
    edited = tmp("linreg_edited.safetensors")
    binio.write_file(edited, convert.encode_safetensors(ck))
    out = conv(edited, tmp("linreg_edited.json"))
    with open(path) as f, open(out) as g:
        old, new = f.read().splitlines(), g.read().splitlines()
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    got = json.loads("\n".join(new))
    assert len(old) == len(new) and len(changed) == 2, f"lines changed: {changed}"
    assert np.float32(got["w"][0]) == arrays["weight"][0, 0] and np.float32(got["b"]) == arrays["bias"][0], got
    return f"w and b rewritten ({new[changed[0]].strip()[:40]} ...), the other {len(old) - 2} lines kept"


def test_weights_only_checkpoint():
    path, _ = unet_checkpoint()
    out = conv(conv(path, tmp("unet_w.safetensors"), "--weights", "ema"), tmp("unet_w.bin"))
    _, cfg, tensors = binio.read(out, binio.UNET_CHECKPOINT)
    _, cfg0, tensors0 = binio.read(path, binio.UNET_CHECKPOINT)
    assert cfg["has_ema"] == 0 and cfg["has_optimizer"] == 0 and cfg["step"] == cfg0["step"], cfg
    assert list(tensors) == [n for n in tensors0 if n in tensors] and len(tensors) == 126, len(tensors)
    for n, t in tensors.items():
        assert np.array_equal(t, tensors0["ema." + n]), n
    mn = conv(mnist_checkpoint("adamw"), tmp("mnist_w.bin"), "--weights", "raw")
    _, mcfg, mt = binio.read(mn, binio.MNIST_CHECKPOINT)
    assert mcfg["has_optimizer"] == 0 and sorted(mt) == sorted(n for n, _ in binio.MNIST_PARAM_SHAPES), sorted(mt)
    return f"--weights ema: a UNet checkpoint of the {len(tensors)} EMA tensors (has_ema 0, has_optimizer 0); " \
        f"--weights raw: an MNIST checkpoint of the 8 parameters"


# ----------------------------------------------------------------------------------------------------------------
# our safetensors against the safetensors package


def test_safetensors_package_cross_check():
    if st_numpy is None:
        raise Skip("the safetensors package is not installed (pip install safetensors)")
    from safetensors import safe_open
    path, _ = unet_checkpoint()
    ours = conv(path, tmp("unet_x.safetensors"))
    meta, arrays = convert.read_safetensors(ours)
    theirs = st_numpy.load_file(ours)
    with safe_open(ours, "np") as f:
        their_meta = f.metadata()
    assert their_meta == meta, "the package reads other metadata"
    assert sorted(theirs) == sorted(arrays), "the package reads other names"
    for n, a in arrays.items():
        assert theirs[n].dtype == a.dtype and np.array_equal(theirs[n].view(np.uint8), a.view(np.uint8)), n
    # a file the package writes (its own order and padding) converts back to the original bytes
    written = tmp("unet_pkg.safetensors")
    st_numpy.save_file({n: a.copy() for n, a in arrays.items()}, written, metadata=meta)
    same_bytes(path, conv(written, tmp("unet_pkg.bin")))
    lin, _ = linreg_result()
    lin_st = tmp("linreg_pkg.safetensors")
    m2, a2 = convert.read_safetensors(conv(lin, tmp("linreg_x.safetensors")))
    st_numpy.save_file(a2, lin_st, metadata=m2)
    same_bytes(lin, conv(lin_st, tmp("linreg_pkg.json")))
    return f"the package reads our file's {len(arrays)} tensors and metadata identically; files it writes convert " \
        f"back to the original .bin and .json byte for byte"


# ----------------------------------------------------------------------------------------------------------------
# bad inputs


def expect_error(args, *needles, env=None):
    code, out = run(*args, env=env)
    lines = out.strip().splitlines()
    assert code == 1, f"exit {code}, expected 1: {out.strip()[-300:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one error line, found: {out.strip()[-300:]}"
    assert "Traceback" not in out
    for n in needles:
        assert n in lines[0], f"message lacks {n!r}: {lines[0]}"
    return lines[0]


def write_bytes(name, data):
    path = tmp(name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def st_with_header(name, header, data=b""):
    text = json.dumps(header).encode()
    return write_bytes(name, struct.pack("<Q", len(text)) + text + data)


def test_bad_safetensors():
    path, _ = unet_checkpoint()
    st = conv(path, tmp("bad_src.safetensors"))
    with open(st, "rb") as f:
        good = f.read()
    n = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8:8 + n])
    meta = header["__metadata__"]
    out = tmp("bad_out.bin")
    cases = [
        ("trunc4", good[:4], ["shorter than the 8-byte header length"]),
        ("trunc_header", good[:8 + n // 2], ["header length is"]),
        ("trunc_data", good[:len(good) - 3], ["tensors take", "holds"]),
        ("extra_data", good + b"\0" * 4, ["tensors take"]),
        ("len_lies_big", struct.pack("<Q", 1 << 62) + good[8:], ["header length is"]),
        ("len_lies_small", struct.pack("<Q", n - 40) + good[8:], ["not JSON"]),
    ]
    for name, data, needles in cases:
        expect_error(["--input", write_bytes(name + ".safetensors", data), "--output", out], name + ".safetensors",
                     *needles)
    first = next(k for k in header if k != "__metadata__")

    def variant(name, change, *needles):
        h = json.loads(json.dumps(header))
        change(h)
        p = st_with_header(name + ".safetensors", h, good[8 + n:])
        return expect_error(["--input", p, "--output", out], name + ".safetensors", *needles)

    second = [k for k in header if k != "__metadata__"][1]
    variant("offsets_overlap", lambda h: h[second].update(data_offsets=[o - 4 for o in h[second]["data_offsets"]]),
            "starts at data offset")
    variant("offsets_hole", lambda h: [h[k].update(data_offsets=[o + 4 for o in h[k]["data_offsets"]])
                                       for k in h if k != "__metadata__"], "starts at data offset")
    variant("bf16", lambda h: h[first].update(dtype="BF16"), "dtype BF16")
    variant("shape_lies", lambda h: h[first].update(shape=[3, 3]), "span")
    variant("neg_shape", lambda h: h[first].update(shape=[-1]), "shape")
    variant("renamed", lambda h: h.update({first + "s": h.pop(first)}), f"tensor {first} is missing")
    variant("no_meta", lambda h: h.pop("__metadata__"), "holds no metadata")
    variant("bad_magic", lambda h: h["__metadata__"].update(magic="20260301"), "metadata magic is 20260301")
    variant("bad_field", lambda h: h["__metadata__"].update(step="12a"), "metadata step is '12a'")
    variant("missing_field", lambda h: h["__metadata__"].pop("lr"), "metadata has no lr")
    variant("bad_float", lambda h: h["__metadata__"].update(lr="fast"), "metadata lr")
    variant("bad_order", lambda h: h["__metadata__"].update(tensor_order='["x"]'), "tensor_order")
    variant("flag_lies", lambda h: h["__metadata__"].update(has_ema="0"), "ema.", "not one of")
    variant("bad_model", lambda h: h["__metadata__"].update(mult0="0"), "mult0")
    # duplicate keys: JSON parsers differ on which one wins, so the file is refused
    text = good[8:8 + n].decode().replace("{", '{"' + first + '":' + json.dumps(header[first]) + ",", 1)
    dup = write_bytes("dup.safetensors", struct.pack("<Q", len(text)) + text.encode() + good[8 + n:])
    expect_error(["--input", dup, "--output", out], "dup.safetensors", "appears twice")
    assert not os.path.exists(out), "a failed conversion left its output"
    return f"{len(cases) + 15} broken safetensors files: one error line each naming the file and the field"


def test_bad_bin_and_json():
    path, _ = unet_checkpoint()
    with open(path, "rb") as f:
        good = f.read()
    out = tmp("bad_out.safetensors")
    slot = binio.FIRST_FIELD + len(binio.UNET_CHECKPOINT.fields) + 3
    unused = bytearray(good)
    unused[4 * slot:4 * slot + 4] = struct.pack("<i", 7)
    renamed = bytearray(good)
    entry = binio.HEADER_BYTES  # the first table entry's name
    renamed[entry:entry + 4] = b"TIME"
    reserved = bytearray(good)
    reserved[entry + 124:entry + 128] = struct.pack("<i", 1)
    cases = [
        ("trunc.bin", good[:len(good) - 1], ["file length"]),
        ("trunc_header.bin", good[:600], ["shorter than the 1024-byte header"]),
        ("unused_slot.bin", bytes(unused), [f"header slot {slot}"]),
        ("renamed.bin", bytes(renamed), ["is missing"]),
        ("reserved.bin", bytes(reserved), ["tensor table entry 0"]),
        ("empty.bin", b"", ["file is 0 bytes"]),
        ("garbage.bin", b"\x01\x02\x03\x04" * 300, ["header[0] magic is 67305985"]),
    ]
    for name, data, needles in cases:
        expect_error(["--input", write_bytes(name, data), "--output", out], name, *needles)
    expect_error(["--input", os.path.join(ROOT, "dev", "fixtures", "linreg_small.bin"), "--output", out],
                 "linreg_small.bin", "holds no trained model")
    lin, _ = linreg_result()
    with open(lin) as f:
        text = f.read()
    expect_error(["--input", write_bytes("bad.json", text[:-5].encode()), "--output", out], "bad.json", "not JSON")
    expect_error(["--input", write_bytes("now.json", text.replace('"n_features": 1', '"n_features": 2').encode()),
                  "--output", out], "now.json", "n_features")
    expect_error(["--input", lin, "--output", tmp("lin.bin")], "lin.bin", "no binary checkpoint")
    expect_error(["--input", path, "--output", tmp("unet.json")], "unet.json", "train_linreg result")
    mn = mnist_checkpoint("sgd")
    expect_error(["--input", mn, "--output", tmp("m.safetensors"), "--weights", "ema"], "--weights ema",
                 "no EMA weights")
    return f"{len(cases) + 6} bad checkpoints, result files and kind mismatches: one error line each"


def test_bad_pt():
    need_torch()
    path, _ = unet_checkpoint()
    out = tmp("bad_pt_out.bin")
    pt = conv(path, tmp("bad_src.pt"))
    with open(pt, "rb") as f:
        good = f.read()
    expect_error(["--input", write_bytes("trunc.pt", good[:len(good) // 2]), "--output", out], "trunc.pt",
                 "torch.load cannot read it")
    expect_error(["--input", write_bytes("junk.pt", b"PK\x03\x04" + b"\xff" * 100), "--output", out], "junk.pt",
                 "torch.load cannot read it")
    ck = torch.load(pt, weights_only=True)
    plain = tmp("plain.pt")
    torch.save(ck["state_dict"], plain)  # a bare state_dict: no header fields to rebuild the checkpoint from
    expect_error(["--input", plain, "--output", out], "plain.pt", "expected a dict with state_dict")
    ck2 = dict(ck, state_dict=dict(ck["state_dict"]))
    name = next(iter(ck2["state_dict"]))
    ck2["state_dict"][name] = ck2["state_dict"][name].half()
    half = tmp("half.pt")
    torch.save(ck2, half)
    expect_error(["--input", half, "--output", out], "half.pt", f"tensor {name} is torch.float16")
    ck3 = dict(ck)
    del ck3["metadata"]
    nometa = tmp("nometa.pt")
    torch.save(ck3, nometa)
    expect_error(["--input", nometa, "--output", out], "nometa.pt", "holds no metadata")
    return "5 bad .pt files (truncated, not a zip, a bare state_dict, fp16, no metadata): one error line each"


def test_no_torch():
    """A .pt needs PyTorch: without it, one line that says so (torch hidden by a sitecustomize that blocks it)."""
    block = os.path.join(TMP, "no_torch")
    os.makedirs(block, exist_ok=True)
    with open(os.path.join(block, "sitecustomize.py"), "w") as f:
        f.write("import sys\nsys.modules['torch'] = None  # import torch raises ImportError\n")
    env = dict(os.environ, PYTHONPATH=block)
    path, _ = unet_checkpoint()
    line = expect_error(["--input", path, "--output", tmp("nt.pt")], "nt.pt", "needs PyTorch", env=env)
    expect_error(["--input", write_bytes("nt_in.pt", b"PK\x03\x04junk"), "--output", tmp("nt.bin")], "nt_in.pt",
                 "needs PyTorch", env=env)
    code, out = run("--input", path, "--output", tmp("nt.safetensors"), env=env)
    assert code == 0, f"safetensors without torch exited {code}: {out.strip()[-300:]}"
    return f"{line}; safetensors converts without it"


def test_special_paths():
    path, _ = unet_checkpoint()
    d = tmp("a_dir")
    os.makedirs(d, exist_ok=True)
    fifo = tmp("a_fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    st = tmp("ok.safetensors")
    n = 0
    for src, needles in [(d, ["is a directory"]), (fifo, ["is a FIFO"]), ("/dev/zero", ["character device"]),
                         (tmp("missing.bin"), ["cannot open"])]:
        expect_error(["--input", src, "--output", st], src, *needles)
        n += 1
    for dst, needles in [(d, ["a_dir"]), (fifo, ["a_fifo"]), ("/dev/null", ["/dev/null"]),
                         (tmp("no_folder/x.bin"), ["does not exist"]), (tmp("x.onnx"), ["extension is .onnx"])]:
        expect_error(["--input", path, "--output", dst], *needles)
        n += 1
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.path.isdir(d), "a special output path was replaced"
    # a failing conversion leaves an existing output as it was, and no temporary file behind
    keep = write_bytes("keep.bin", b"precious")
    expect_error(["--input", write_bytes("tr.bin", b"\x36\x2a\x35\x01" + b"\0" * 100), "--output", keep], "tr.bin")
    with open(keep, "rb") as f:
        assert f.read() == b"precious", "a failed conversion changed its output"
    assert not [f for f in os.listdir(TMP) if ".tmp" in f], "a temporary file stayed behind"
    expect_error(["--input", path, "--output", st, "--weights", "best"], "--weights")
    expect_error(["--input", path, "--output", st, "--bogus", "1"], "--bogus")
    return f"{n} special input and output paths, an untouched output after a failure, bad flags: one error line each"


# ----------------------------------------------------------------------------------------------------------------


def main():
    tests = [(name[5:], fn) for name, fn in globals().items() if name.startswith("test_") and callable(fn)
             and (len(sys.argv) < 2 or any(w in name for w in sys.argv[1:]))]
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for name, fn in tests:
        try:
            detail = fn()
            status = "PASS"
        except Skip as e:
            status, detail = "SKIP", str(e)
        except Exception as e:  # noqa: BLE001 - any error is a failed check, reported with its cause
            status = "FAIL"
            detail = f"{type(e).__name__}: {e}"
            if not isinstance(e, AssertionError):
                detail += "\n" + traceback.format_exc(limit=3)
        counts[status] += 1
        print(f"{status} {name}: {detail}", flush=True)
    shutil.rmtree(TMP, ignore_errors=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
