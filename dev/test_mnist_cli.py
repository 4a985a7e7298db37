"""Command-line and data-file tests of ./train_mnist: the real binary through subprocess, no GPU needed.

Bad flags, missing / wrong-magic / truncated / mismatched MNIST files and bad checkpoints must each give a clear
message and a non-zero exit; then the CPU fallback trains on a small subset (the loss falls, the accuracy rises),
a checkpoint reloads with --eval_only, and a NaN loss stops training keeping the last good checkpoint.
Issue 26 (each check failed before its fix): special paths as inputs (a directory, a device, a FIFO: one clear
error, no std::bad_alloc, no hang), header sizes bounded by the file before allocating, the gzip CRC-32 and length
trailer, outputs checked at start-up and written through a temporary file (devices and FIFOs refused, symlinks
written through, nothing left behind on a full disk), checkpoint contents validated, --resume refusing a changed
setting unless --allow_change names it, and a finite but diverging loss stopping the run.
Issue 21: Muon's, Shampoo's and K-FAC's flags (bad values refused), their CPU training, resume (Shampoo's and
K-FAC's factors and roots in the checkpoint), a changed optimizer refused unless --allow_change optimizer, version 2
checkpoints refused; --clip_per_sample, --noise_multiplier and --precond fisher_diag: bad values and combinations
refused (K-FAC with either), CPU training, resume (the noise's stream, the Fisher average in the checkpoint);
--eval_every: bad values refused, evaluations at the schedule's steps (also after --resume), --stop_at_accuracy
stopping at the first evaluation that reaches it, and the same weights with and without evaluations inside epochs
(on the CPU; on the GPU too where there is one, graphs cut at an evaluation).
Run from the repo root: python3 dev/test_mnist_cli.py   (last line: N passed, N failed, N skipped)
"""
import concurrent.futures
import gzip
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "train_mnist")
DATA = os.path.join(ROOT, "data", "mnist")
results = {"passed": 0, "failed": 0, "skipped": 0}
# main() runs four groups of checks at once (their own folders); a group's lines are kept and printed after it ends
_local = threading.local()
_lock = threading.Lock()


def emit(line, counter):
    with _lock:
        results[counter] += 1
    lines = getattr(_local, "lines", None)
    if lines is None:
        print(line, flush=True)
    else:
        lines.append(line)


def report(ok, name, detail):
    emit(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", "passed" if ok else "failed")


HAVE_GPU = shutil.which("nvidia-smi") is not None
VMEM_KB = 3 * 1024 * 1024  # "no allocation beyond a bound" (where no GPU: the CUDA runtime maps more than this)


def run(args, timeout=300, vmem_kb=None, fsize_kb=None):
    """Runs the binary (no stdin); vmem_kb: an address-space limit; fsize_kb: a full disk after that many KB (writes
    fail with EFBIG, SIGXFSZ ignored). A hang is exit code None with what was printed."""
    cmd = [BIN] + args
    shell = (f"ulimit -v {vmem_kb}; " if vmem_kb else "") + (f"ulimit -f {fsize_kb}; trap '' XFSZ; "
                                                              if fsize_kb is not None else "")
    if shell:
        cmd = ["bash", "-c", shell + 'exec "$@"', "run"] + cmd
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, errors="replace", timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out + f"\n(no answer after {timeout} s: a hang)"
    return p.returncode, p.stdout + p.stderr


def expect_error(name, args, *needles, code=None, timeout=300, vmem_kb=None, fsize_kb=None):
    """The binary must exit non-zero (or with `code`) and its output must contain every needle."""
    rc, out = run(args, timeout=timeout, vmem_kb=vmem_kb, fsize_kb=fsize_kb)
    missing = [n for n in needles if n not in out]
    last = out.strip().splitlines()[-1] if out.strip() else "(no output)"
    ok = rc is not None and rc != 0 and (code is None or rc == code) and not missing
    report(ok, name, f"exit {rc}, message: {last[:200]}" + (f"; missing {missing}" if missing else ""))
    return out


def idx_images(count, rows=28, cols=28, magic=2051, pixels=None):
    body = pixels if pixels is not None else bytes((i * 7) % 256 for i in range(count * rows * cols))
    return struct.pack(">IIII", magic, count, rows, cols) + body


def idx_labels(count, magic=2049, labels=None):
    body = labels if labels is not None else bytes(i % 10 for i in range(count))
    return struct.pack(">II", magic, count) + body


def make_dir(tmp, name, train_images, train_labels, test_images=None, test_labels=None):
    """A data folder with the given decompressed train files (gzipped); the test split defaults to a valid one."""
    d = os.path.join(tmp, name)
    os.makedirs(d)
    files = {"train-images-idx3-ubyte.gz": train_images, "train-labels-idx1-ubyte.gz": train_labels,
             "t10k-images-idx3-ubyte.gz": test_images if test_images is not None else idx_images(20),
             "t10k-labels-idx1-ubyte.gz": test_labels if test_labels is not None else idx_labels(20)}
    for fname, data in files.items():
        with gzip.open(os.path.join(d, fname), "wb") as f:
            f.write(data)
    return d


def epochs_of(out):
    """[(train_loss, test_loss, test_acc)] from the per-epoch lines."""
    pat = r"epoch +\d+/\d+ \| train loss ([\d.]+) \| test loss ([\d.]+) \| test acc ([\d.]+)%"
    return [tuple(float(v) for v in m) for m in re.findall(pat, out)]


# ----------------------------------------------------------------------------------------------------------------
# issue 26: every check below failed on the trainer before its fix


def ck_table(raw):
    """{tensor name: (table entry offset, data offset, bytes)} of a checkpoint written by the trainer."""
    count = struct.unpack_from("<i", raw, 8)[0]
    out, data = {}, 1024 + 128 * count
    for i in range(count):
        off = 1024 + 128 * i
        name = raw[off:off + 96].split(b"\0", 1)[0].decode()
        dtype, ndim, *shape = struct.unpack_from("<6i", raw, off + 96)
        n = 1
        for d in shape[:ndim]:
            n *= d
        out[name] = (off, data, n * (1 if dtype == 2 else 4))
        data += out[name][2]
    return out


def patched(raw, offset, fmt, *values):
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


def with_extra_tensor(raw, name):
    """raw with one more float32 tensor `name` of shape (3,) at the end of the table and of the data."""
    count = struct.unpack_from("<i", raw, 8)[0]
    end = 1024 + 128 * count
    entry = name.encode().ljust(96, b"\0") + struct.pack("<8i", 0, 1, 3, 0, 0, 0, 0, 0)
    return patched(raw[:end], 8, "<i", count + 1) + entry + raw[end:] + struct.pack("<3f", 1, 2, 3)


def gz_stored(data):
    """gzip with stored (uncompressed) deflate blocks: a flipped data byte changes the data, never the stream."""
    return gzip.compress(data, compresslevel=0, mtime=0)


def write_data_dir(tmp, name, train_images_gz=None, train_labels_gz=None):
    """A valid small data folder (30 training, 20 test images), gzipped; the train files replaceable by raw bytes."""
    d = make_dir(tmp, name, idx_images(30), idx_labels(30))
    for fname, raw in (("train-images-idx3-ubyte.gz", train_images_gz),
                       ("train-labels-idx1-ubyte.gz", train_labels_gz)):
        if raw is not None:
            with open(os.path.join(d, fname), "wb") as f:
                f.write(raw)
    return d


def issue26(tmp, common):
    vmem = None if HAVE_GPU else VMEM_KB
    small = ["--device", "cpu", "--data_dir", DATA, "--train_limit", "32", "--test_limit", "50", "--batch_size", "16",
             "--lr", "0.05", "--warmup_steps", "2", "--seed", "5", "--confusion", "0"]
    folder = os.path.join(tmp, "a_folder")
    os.makedirs(folder)
    fifo = os.path.join(tmp, "a_fifo")
    os.mkfifo(fifo)

    # 1. special paths as inputs: one clear error naming the path and what it is; no std::bad_alloc, no hang
    expect_error("--load DIR is named a directory", ["--device", "cpu", "--eval_only", "1", "--load", folder],
                 folder, "is a directory", code=1)
    expect_error("--resume DIR is named a directory", small + ["--resume", folder], folder, "is a directory", code=1)
    expect_error("--load /dev/zero is named a device", ["--device", "cpu", "--eval_only", "1", "--load", "/dev/zero"],
                 "/dev/zero", "character device", code=1)
    expect_error("--load FIFO: no hang", ["--device", "cpu", "--eval_only", "1", "--load", fifo], fifo, "FIFO",
                 code=1, timeout=30)
    d = write_data_dir(tmp, "images_dir")
    os.unlink(os.path.join(d, "train-images-idx3-ubyte.gz"))
    os.mkdir(os.path.join(d, "train-images-idx3-ubyte.gz"))
    expect_error("an MNIST file that is a directory", ["--device", "cpu", "--data_dir", d],
                 "train-images-idx3-ubyte.gz", "is a directory", code=1)
    d = write_data_dir(tmp, "labels_fifo")
    os.unlink(os.path.join(d, "train-labels-idx1-ubyte.gz"))
    os.mkfifo(os.path.join(d, "train-labels-idx1-ubyte.gz"))
    expect_error("an MNIST file that is a FIFO: no hang", ["--device", "cpu", "--data_dir", d],
                 "train-labels-idx1-ubyte.gz", "FIFO", code=1, timeout=30)
    d = write_data_dir(tmp, "images_zero")
    os.unlink(os.path.join(d, "train-images-idx3-ubyte.gz"))
    os.symlink("/dev/zero", os.path.join(d, "train-images-idx3-ubyte.gz"))
    expect_error("an MNIST file that is /dev/zero", ["--device", "cpu", "--data_dir", d],
                 "train-images-idx3-ubyte.gz", "character device", code=1, timeout=30)
    a_file = os.path.join(tmp, "a_file")
    open(a_file, "wb").write(b"x")
    expect_error("--data_dir a file", ["--device", "cpu", "--data_dir", a_file], a_file, "--data_dir",
                 "not a directory", code=1)
    d = write_data_dir(tmp, "count_huge", train_images_gz=gzip.compress(idx_images(30)[:4] + struct.pack(
        ">I", 10_000_000) + idx_images(30)[8:]))
    expect_error("an image count the file cannot hold is refused before allocating", ["--device", "cpu",
                 "--data_dir", d], "train-images-idx3-ubyte.gz", "10000000", code=1, vmem_kb=vmem)

    # 2. the gzip trailer (CRC-32, length) and stream
    good = gz_stored(idx_images(30))
    cases = [("the last 8 bytes (CRC-32 and length) missing", good[:-8], "truncated"),
             ("the last 4 bytes (length) missing", good[:-4], "truncated"),
             ("the CRC-32 flipped", patched(good, len(good) - 6, "<B", good[-6] ^ 0x10), "CRC"),
             ("a data byte flipped", patched(good, 400, "<B", good[400] ^ 0x01), "CRC"),
             ("the length field off by one", patched(good, len(good) - 4, "<I", len(idx_images(30)) + 1),
              "length field"),
             ("garbage after the gzip stream", good + b"garbage!", "after the gzip stream"),
             ("an uncompressed IDX file", idx_images(30), "not a gzip file")]
    for i, (label, raw, word) in enumerate(cases):
        d = write_data_dir(tmp, f"gz_case{i}", train_images_gz=raw)
        expect_error(f"gzip: {label}", ["--device", "cpu", "--data_dir", d, "--epochs", "1", "--batch_size", "10"],
                     "train-images-idx3-ubyte.gz", word, code=1)

    # 3. outputs: checked at start-up, written through a temporary file, never replacing a device or FIFO
    out = expect_error("--checkpoint DIR is refused at start-up", small + ["--epochs", "1", "--checkpoint", folder],
                       folder, "is a directory", code=1)
    report("epoch " not in out, "--checkpoint DIR: refused before any training", "no epoch line printed")
    out = expect_error("--checkpoint FIFO is refused at start-up", small + ["--epochs", "1", "--checkpoint", fifo],
                       fifo, "FIFO", code=1, timeout=60)
    report(stat.S_ISFIFO(os.lstat(fifo).st_mode) and "epoch " not in out, "--checkpoint FIFO: kept, no training",
           "the FIFO is still a FIFO")
    target = os.path.join(tmp, "target.bin")
    open(target, "wb").write(b"old")
    link = os.path.join(tmp, "link.bin")
    os.symlink(target, link)
    rc, out = run(small + ["--epochs", "1", "--checkpoint", link])
    raw = open(target, "rb").read()
    report(rc == 0 and os.path.islink(link) and raw[:4] == struct.pack("<i", 20260202) and "symlink" in out
           and target in out, "--checkpoint SYMLINK is written through to its target",
           f"exit {rc}, link kept: {os.path.islink(link)}, target {len(raw)} bytes, said: {'symlink' in out}")
    full = os.path.join(tmp, "full")
    os.makedirs(full)
    ckf = os.path.join(full, "ck.bin")
    open(ckf, "wb").write(b"old")
    rc, out = run(small + ["--epochs", "1", "--checkpoint", ckf], fsize_kb=1)
    left = sorted(set(os.listdir(full)) - {"ck.bin"})
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    report(rc == 1 and len(errors) == 1 and ckf in errors[0] and open(ckf, "rb").read() == b"old" and not left,
           "a full disk: one error, the previous checkpoint kept, no temporary file left",
           f"exit {rc}, left behind: {left}: {errors}")

    # checkpoints of two short runs (SGD and AdamW), stopped after epoch 1 of 3 to be resumed
    ck_sgd, ck_adam = os.path.join(tmp, "ck_sgd.bin"), os.path.join(tmp, "ck_adam.bin")
    rc1, _ = run(small + ["--epochs", "3", "--checkpoint", ck_sgd, "--stop_at_accuracy", "0.001"])
    rc2, _ = run(small + ["--epochs", "3", "--checkpoint", ck_adam, "--stop_at_accuracy", "0.001", "--optimizer",
                          "adamw", "--lr", "0.001"])
    if rc1 != 0 or rc2 != 0 or not os.path.exists(ck_sgd) or not os.path.exists(ck_adam):
        report(False, "issue 26 checkpoints", f"the short runs failed (exit {rc1}, {rc2})")
        return
    sgd, adam = open(ck_sgd, "rb").read(), open(ck_adam, "rb").read()
    ts, ta = ck_table(sgd), ck_table(adam)

    # 4. checkpoint contents
    def bad_ck(name, raw, args, *words):
        path = os.path.join(tmp, f"bad_ck{len(os.listdir(tmp))}.bin")  # a name without the words looked for
        open(path, "wb").write(raw)
        expect_error(f"checkpoint: {name}", [a if a != "CK" else path for a in args], path, *words, code=1)

    load = ["--device", "cpu", "--data_dir", DATA, "--test_limit", "50", "--eval_only", "1", "--load", "CK"]
    resume = small + ["--resume", "CK"]
    bad_ck("NaN in conv1.weight (--load)", patched(sgd, ts["conv1.weight"][1], "<f", float("nan")), load,
           "conv1.weight", "finite")
    bad_ck("inf in momentum_buffer.fc2.bias (--resume)", patched(sgd, ts["momentum_buffer.fc2.bias"][1] + 12, "<f",
           float("inf")), resume, "momentum_buffer.fc2.bias", "finite")
    bad_ck("a negative adam_v (--resume)", patched(adam, ta["adam_v.conv1.bias"][1], "<f", -1.0),
           small + ["--optimizer", "adamw", "--lr", "0.001", "--resume", "CK"], "adam_v.conv1.bias", "negative")
    bad_ck("epoch -1", patched(sgd, 12, "<i", -1), resume, "epoch", "-1")
    bad_ck("step 999 (epoch 1 is 2 steps)", patched(sgd, 16, "<i", 999), resume, "step", "999")
    bad_ck("epochs 0 (--load)", patched(sgd, 36, "<i", 0), load, "epochs", "0")
    bad_ck("lr NaN (--load)", patched(sgd, 40, "<f", float("nan")), load, "lr", "nan")
    bad_ck("an extra tensor", with_extra_tensor(sgd, "bogus.weight"), load, "bogus.weight")
    bad_ck("a shape whose product overflows", patched(sgd, 1024 + 104, "<4i", *[2**31 - 1] * 4), load,
           "conv1.weight", "runs past the end")

    # 5. --resume continues the stored trajectory: a changed setting is an error unless --allow_change names it
    straight = epochs_of(run(small + ["--epochs", "3"])[1])
    rc, out = run(["--device", "cpu", "--data_dir", DATA, "--test_limit", "50", "--confusion", "0", "--resume",
                   ck_sgd])
    ep = epochs_of(out)
    report(rc == 0 and len(ep) == 2 and ep == straight[1:], "--resume without the flags takes the stored settings",
           f"exit {rc}; resumed {ep} vs straight {straight[1:]}: {out.strip().splitlines()[-1][:150]}")
    changes = [("lr", "0.1", "0.05"), ("seed", "6", "5"), ("epochs", "4", "3"), ("lr_schedule", "linear", "cosine"),
               ("batch_size", "8", "16"), ("warmup_steps", "3", "2"), ("momentum", "0.8", "0.9"),
               ("weight_decay", "0.001", "0.0005"), ("train_limit", "48", "32")]
    for flag, value, stored in changes:
        expect_error(f"--resume with a changed --{flag}", small + ["--resume", ck_sgd, f"--{flag}", value],
                     f"--{flag} {value}", stored, ck_sgd, f"--allow_change {flag}", code=1)
    for flag, value, stored in (("beta2", "0.99", "0.999"), ("eps", "1e-06", "1e-08")):
        expect_error(f"--resume with a changed --{flag} (AdamW)", small + ["--optimizer", "adamw", "--lr", "0.001",
                     "--resume", ck_adam, f"--{flag}", value], f"--{flag} {value}", stored, f"--allow_change {flag}",
                     code=1)
    expect_error("--resume with another --optimizer", small + ["--resume", ck_sgd, "--optimizer", "adamw"],
                 "--optimizer adamw", "sgd", "--load", code=1)
    rc, out = run(small + ["--resume", ck_sgd, "--lr", "0.1", "--epochs", "4", "--allow_change", "lr,epochs"])
    report(rc == 0 and len(epochs_of(out)) == 3 and "--allow_change" in out and "0.05" in out,
           "--allow_change lr,epochs: the changes are taken and named",
           f"exit {rc}: {[line for line in out.splitlines() if line.startswith('note:')]}")
    expect_error("--allow_change without --resume", small + ["--allow_change", "lr"], "--allow_change", "--resume",
                 code=1)
    expect_error("--allow_change with an unknown name", small + ["--resume", ck_sgd, "--allow_change", "lr,bogus"],
                 "--allow_change", "bogus", code=1)

    # 6. a finite but diverging loss stops the run (exit 1), writing no checkpoint
    ckd = os.path.join(tmp, "ck_lr10.bin")
    out = expect_error("a finite but diverging loss (--lr 10) stops the run", common + ["--epochs", "1", "--lr", "10",
                       "--checkpoint", ckd], "diverg", "--lr", code=1)
    report(not os.path.exists(ckd) and "training loss is nan" not in out, "a diverging loss: no checkpoint written",
           f"{ckd} exists: {os.path.exists(ckd)}")


# ----------------------------------------------------------------------------------------------------------------
# issue 21: Muon and Shampoo (the CPU path; their steps against PyTorch are dev/test_mnist.cu's)


def optimizers(tmp):
    base = ["--device", "cpu", "--data_dir", DATA, "--train_limit", "32", "--test_limit", "100", "--batch_size", "16",
            "--warmup_steps", "2", "--seed", "4", "--confusion", "0"]
    shampoo = ["--optimizer", "shampoo", "--max_precond_dim", "32", "--precond_start", "1", "--precond_every", "2",
               "--lr", "0.05"]
    muon = ["--optimizer", "muon", "--lr", "0.003"]
    kfac = ["--optimizer", "kfac", "--max_precond_dim", "32", "--precond_start", "1", "--precond_every", "2",
            "--precond_damping", "0.1", "--lr", "0.05"]
    for args, words in [(["--precond_damping", "-1"], ["--precond_damping", "found -1"]),
                        (["--precond_eps", "-1e-6"], ["--precond_eps", "found -1e-06"]),
                        (["--precond_every", "0"], ["--precond_every", "found 0"]),
                        (["--max_precond_dim", "0"], ["--max_precond_dim", "found 0"]),
                        (["--ns_steps", "0"], ["--ns_steps", "found 0"]),
                        (["--optimizer", "lion"], ["--optimizer", "sgd,adamw,muon,shampoo,kfac", "lion"]),
                        (kfac + ["--precond_damping", "-0.5"], ["--precond_damping", "found -0.5"]),
                        (kfac + ["--precond_eps", "-1"], ["--precond_eps", "found -1"]),
                        (kfac + ["--precond_every", "0"], ["--precond_every", "found 0"]),
                        (kfac + ["--max_precond_dim", "0"], ["--max_precond_dim", "found 0"]),
                        (kfac + ["--kfac_stat_decay", "-0.1"], ["--kfac_stat_decay", "found -0.1"]),
                        (kfac + ["--kfac_stat_decay", "1"], ["--kfac_stat_decay", "found 1"]),
                        (["--graft", "rmsprop"], ["--graft", "sgd,adam", "rmsprop"])]:
        expect_error(f"bad flag {' '.join(args)}", base + args, *words, code=1)

    # training learns; 1 epoch + checkpoint + resume == 2 straight epochs (optimizer state incl. Shampoo's factors)
    for name, extra in (("muon", muon), ("shampoo", shampoo), ("shampoo graft adam", shampoo[:-2] + ["--graft", "adam",
                                                                                                     "--lr", "0.002"]),
                        ("kfac", kfac), ("kfac graft adam", kfac[:-2] + ["--graft", "adam", "--lr", "0.002"])):
        rc, out = run(base + extra + ["--epochs", "3", "--train_limit", "64"])
        ep = epochs_of(out)
        report(rc == 0 and len(ep) == 3 and ep[2][0] < ep[0][0], f"cpu {name}: the training loss falls",
               f"exit {rc}; epochs (train loss, test loss, test acc): {ep}")
        ck = os.path.join(tmp, f"ck_{name.replace(' ', '_')}.bin")
        straight = epochs_of(run(base + extra + ["--epochs", "2"])[1])
        run(base + extra + ["--epochs", "2", "--checkpoint", ck, "--stop_at_accuracy", "0.001"])
        rc, out = run(base + ["--epochs", "2", "--resume", ck])
        ep = epochs_of(out)
        report(rc == 0 and len(ep) == 1 and len(straight) == 2 and ep[0] == straight[1],
               f"cpu {name}: --resume continues the same trajectory", f"exit {rc}; resumed {ep} vs straight "
               f"{straight[1:]}: {out.strip().splitlines()[-1][:150] if out.strip() else ''}")

    ck = os.path.join(tmp, "ck_shampoo.bin")
    expect_error("--resume shampoo with --optimizer muon", base + ["--resume", ck, "--optimizer", "muon"],
                 "--optimizer muon", "shampoo", "--allow_change optimizer", code=1)
    expect_error("--resume shampoo with another --graft", base + ["--resume", ck, "--graft", "adam"], "--graft adam",
                 "sgd", "--allow_change optimizer", code=1)
    expect_error("--resume shampoo with another --max_precond_dim", base + ["--resume", ck, "--max_precond_dim", "64"],
                 "--max_precond_dim 64", "32", "--allow_change optimizer", code=1)
    expect_error("--resume shampoo with another --precond_every", base + ["--resume", ck, "--precond_every", "3"],
                 "--precond_every 3", "2", "--allow_change precond_every", code=1)
    expect_error("--resume muon with another --muon_lr", base + ["--resume", os.path.join(tmp, "ck_muon.bin"),
                 "--muon_lr", "0.05"], "--muon_lr 0.05", "0.02", "--allow_change muon_lr", code=1)
    rc, out = run(base + ["--resume", ck, "--optimizer", "muon", "--allow_change", "optimizer"])
    report(rc == 0 and len(epochs_of(out)) == 1 and "new optimizer state" in out,
           "--allow_change optimizer: shampoo's weights continue under muon with a new optimizer state",
           f"exit {rc}: {[line for line in out.splitlines() if line.startswith('note:')]}")
    raw = open(ck, "rb").read()
    old = os.path.join(tmp, "version2.bin")
    open(old, "wb").write(raw[:4] + struct.pack("<i", 2) + raw[8:])
    expect_error("a version 2 checkpoint is refused", ["--device", "cpu", "--data_dir", DATA, "--test_limit", "50",
                 "--eval_only", "1", "--load", old], old, "version is 2, expected 3", code=1)
    t = ck_table(raw)
    off = t["shampoo_Rinv.fc1.weight.0.32"][1]
    bad = os.path.join(tmp, "shampoo_nan.bin")
    open(bad, "wb").write(patched(raw, off + 8, "<f", float("nan")))
    expect_error("a NaN in a Shampoo root is refused", base + ["--resume", bad], bad, "shampoo_Rinv.fc1.weight.0.32",
                 "finite", code=1)

    ck = os.path.join(tmp, "ck_kfac.bin")  # K-FAC's state: its factor blocks, their inverses and has_inv flags
    raw = open(ck, "rb").read()
    t = ck_table(raw)
    want = ["kfac_G.conv1.weight.0", "kfac_A.conv2.weight.288", "kfac_Ainv.fc1.weight.9216", "kfac_Ginv.fc2.weight.0"]
    report(all(n in t for n in want) and "kfac_has_inv" in t and struct.unpack_from("<i", raw, 4)[0] == 3,
           "kfac checkpoint: factors, inverses and flags by name (version 3)", f"missing {[n for n in want if n not in t]}")
    bad = os.path.join(tmp, "kfac_nan.bin")
    open(bad, "wb").write(patched(raw, t["kfac_Ainv.fc1.weight.9216"][1], "<f", float("nan")))
    expect_error("a NaN in a K-FAC inverse is refused", base + ["--resume", bad], bad, "kfac_Ainv.fc1.weight.9216",
                 "finite", code=1)
    bad = os.path.join(tmp, "kfac_flag.bin")
    open(bad, "wb").write(patched(raw, t["kfac_has_inv"][1], "<i", 2))
    expect_error("a K-FAC has_inv flag of 2 is refused", base + ["--resume", bad], bad, "kfac_has_inv[0]", "0 or 1",
                 code=1)
    bad = os.path.join(tmp, "kfac_decay.bin")
    open(bad, "wb").write(patched(open(os.path.join(tmp, "ck_shampoo.bin"), "rb").read(), 4 * 35, "<f", 0.5))
    expect_error("kfac_stat_decay set in a Shampoo checkpoint is refused", base + ["--resume", bad], bad,
                 "kfac_stat_decay", "0 (not kfac)", code=1)
    expect_error("--resume kfac with another --kfac_stat_decay", base + ["--resume", ck, "--kfac_stat_decay", "0.5"],
                 "--kfac_stat_decay 0.5", "0.95", "--allow_change kfac_stat_decay", code=1)
    expect_error("--resume kfac with --optimizer shampoo", base + ["--resume", ck, "--optimizer", "shampoo"],
                 "--optimizer shampoo", "kfac", "--allow_change optimizer", code=1)


# ----------------------------------------------------------------------------------------------------------------
# issue 21: --precond_delay D (Shampoo, K-FAC): the roots due at step s are used from step s + D. A checkpoint at an
# epoch end between s and s + D stores the roots in flight (pending.*), and --resume swaps them in at the same step:
# the resumed run's final checkpoint is byte-identical to the uninterrupted run's.


def precond_delay(tmp):
    base = ["--device", "cpu", "--data_dir", DATA, "--train_limit", "32", "--test_limit", "100", "--batch_size", "16",
            "--warmup_steps", "2", "--seed", "4", "--confusion", "0", "--precond_start", "1", "--precond_every", "2",
            "--max_precond_dim", "32"]
    kfac = ["--optimizer", "kfac", "--precond_damping", "0.1", "--lr", "0.05"]
    shampoo = ["--optimizer", "shampoo", "--lr", "0.05"]
    for args, words in [(kfac + ["--precond_delay", "3"], ["--precond_delay 3", "--precond_every 2"]),
                        (shampoo + ["--precond_delay", "-1"], ["--precond_delay", "found -1"])]:
        expect_error(f"bad flag {' '.join(args[-2:])} ({args[1]})", base + args, *words, code=1)
    # 2 steps per epoch, roots due at steps 1, 3, 5: the checkpoint after epoch 1 (step 2) falls before the switch
    # at 1 + D for D = 1 (switch_in 0: the resumed run's first step) and D = 2 (switch_in 1)
    params = ["conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight"]
    for name, extra, d in (("kfac", kfac, 2), ("shampoo", shampoo, 1), ("kfac", kfac, 1)):
        tag = f"{name} --precond_delay {d}"
        ck = {k: os.path.join(tmp, f"delay_{name}_{d}_{k}.bin") for k in ("straight", "part", "resumed", "sync")}
        run(base + extra + ["--precond_delay", str(d), "--epochs", "3", "--checkpoint", ck["straight"]])
        run(base + extra + ["--precond_delay", "0", "--epochs", "3", "--checkpoint", ck["sync"]])
        run(base + extra + ["--precond_delay", str(d), "--epochs", "3", "--checkpoint", ck["part"],
                            "--stop_at_accuracy", "0.001"])
        rc, out = run(base + ["--resume", ck["part"], "--checkpoint", ck["resumed"]])
        raw = {k: open(p, "rb").read() if os.path.exists(p) else b"" for k, p in ck.items()}
        part = ck_table(raw["part"]) if raw["part"] else {}
        roots = [n for n in part if n.startswith("pending.kfac_") or n.startswith("pending.shampoo_")]
        switch_in = struct.unpack_from("<i", raw["part"], part["pending.switch_in"][1])[0] \
            if "pending.switch_in" in part else None
        report(len(roots) > 0 and "pending.root_ok" in part and switch_in == d - 1 and
               struct.unpack_from("<i", raw["part"], 4 * 36)[0] == d,
               f"cpu {tag}: the epoch-1 checkpoint holds the roots in flight and their switch",
               f"{len(roots)} pending roots, switch_in {switch_in} (expected {d - 1}), slot 36 "
               f"{struct.unpack_from('<i', raw['part'], 4 * 36)[0] if raw['part'] else None}")
        report(rc == 0 and raw["resumed"] != b"" and raw["resumed"] == raw["straight"],
               f"cpu {tag}: checkpoint + --resume gives the uninterrupted run's final checkpoint byte for byte",
               f"exit {rc}; {len(raw['resumed'])} vs {len(raw['straight'])} bytes, equal: "
               f"{raw['resumed'] == raw['straight']}")

        def param_bytes(r):
            t = ck_table(r)
            return b"".join(r[t[n][1]:t[n][1] + t[n][2]] for n in params)
        report(raw["sync"] != b"" and raw["straight"] != b"" and param_bytes(raw["sync"]) != param_bytes(
               raw["straight"]), f"cpu {tag}: the delay changes the trajectory (its weights differ from D = 0's)",
               f"weights differ: {param_bytes(raw['sync']) != param_bytes(raw['straight'])}"
               if raw["sync"] and raw["straight"] else "a run failed")
    # the stored setting: a resume keeps it, a change needs --allow_change, the header and the pending state checked
    part = os.path.join(tmp, "delay_kfac_2_part.bin")
    raw = open(part, "rb").read()
    expect_error("--resume with another --precond_delay", base + ["--resume", part, "--precond_delay", "1"],
                 "--precond_delay 1", "2", "--allow_change precond_delay", code=1)
    rc, out = run(base + ["--resume", part, "--precond_delay", "0", "--allow_change", "precond_delay"])
    report(rc == 0 and len(epochs_of(out)) == 2 and "--allow_change" in out,
           "--allow_change precond_delay: the pending roots switch in at once, the run goes on synchronously",
           f"exit {rc}: {out.strip().splitlines()[-1][:150] if out.strip() else ''}")
    t = ck_table(raw)
    for what, data, words in [
            ("precond_delay above precond_every in the header", patched(raw, 4 * 36, "<i", 3),
             ["precond_delay is 3", "0..precond_every"]),
            ("precond_delay set in an SGD checkpoint", patched(open(os.path.join(tmp, "delay_shampoo_1_straight.bin"),
             "rb").read(), 4 * 7, "<i", 0), ["precond_delay is 1", "0 (not shampoo or kfac)"]),
            ("pending.switch_in at precond_delay", patched(raw, t["pending.switch_in"][1], "<i", 2),
             ["pending.switch_in[0] is 2", "precond_delay is 2"]),
            ("a NaN in a pending root", patched(raw, t["pending.kfac_Ainv.fc1.weight.9216"][1], "<f", float("nan")),
             ["pending.kfac_Ainv.fc1.weight.9216", "finite"]),
            ("a pending root_ok flag of 2", patched(raw, t["pending.root_ok"][1], "<i", 2),
             ["pending.root_ok[0] is 2", "0 or 1"])]:
        bad = os.path.join(tmp, "delay_bad.bin")
        open(bad, "wb").write(data)
        expect_error(f"{what} is refused", base + ["--resume", bad], bad, *words, code=1)


# ----------------------------------------------------------------------------------------------------------------
# issue 21 item 4: --clip_per_sample, --noise_multiplier, --precond fisher_diag (the CPU path; their values against
# torch.func.vmap are dev/test_mnist.cu's)


def per_sample(tmp, kfac_ck, kfac_ready):
    """kfac_ck: optimizers()'s K-FAC checkpoint, written once kfac_ready is set (the two run at once)."""
    base = ["--device", "cpu", "--data_dir", DATA, "--train_limit", "64", "--test_limit", "100", "--batch_size", "16",
            "--warmup_steps", "2", "--seed", "4", "--confusion", "0"]
    for args, words in [(["--clip_per_sample", "-1"], ["--clip_per_sample", "found -1"]),
                        (["--noise_multiplier", "-0.5"], ["--noise_multiplier", "found -0.5"]),
                        (["--noise_multiplier", "1"], ["--noise_multiplier 1", "needs --clip_per_sample"]),
                        (["--precond", "fisher"], ["--precond", "none,fisher_diag", "fisher"]),
                        (["--precond", "fisher_diag", "--optimizer", "adamw"], ["--precond fisher_diag",
                                                                                 "--optimizer adamw"]),
                        (["--precond", "fisher_diag", "--clip_per_sample", "1", "--noise_multiplier", "1"],
                         ["--precond fisher_diag", "--noise_multiplier 1", "not"]),
                        (["--precond", "fisher_diag", "--fisher_power", "0.1"], ["--fisher_power", "[0.25, 1]",
                                                                                 "found 0.1"]),
                        (["--fisher_power", "2"], ["--fisher_power", "found 2"]),
                        (["--optimizer", "kfac", "--clip_per_sample", "1"], ["--clip_per_sample 1",
                                                                             "--optimizer kfac", "unclipped"]),
                        (["--optimizer", "kfac", "--clip_per_sample", "1", "--noise_multiplier", "1"],
                         ["--clip_per_sample 1", "--optimizer kfac"]),
                        (["--optimizer", "kfac", "--precond", "fisher_diag"], ["--precond fisher_diag",
                                                                               "--optimizer kfac"])]:
        expect_error(f"bad flag {' '.join(args)}", base + args, *words, code=1)

    clip = ["--clip_per_sample", "5", "--lr", "0.05"]
    dp = clip + ["--noise_multiplier", "0.5"]
    fisher = ["--precond", "fisher_diag", "--lr", "0.002", "--beta2", "0.99"]
    for name, extra in (("clip", clip), ("dp", dp), ("fisher_diag", fisher)):
        rc, out = run(base + extra + ["--epochs", "3"])
        ep = epochs_of(out)
        report(rc == 0 and len(ep) == 3 and ep[2][0] < ep[0][0] and "ms/step" in out,
               f"cpu {name}: the training loss falls", f"exit {rc}; epochs (train loss, test loss, test acc): {ep}")
        ck = os.path.join(tmp, f"ck_ps_{name}.bin")
        straight = epochs_of(run(base + extra + ["--epochs", "2"])[1])
        run(base + extra + ["--epochs", "2", "--checkpoint", ck, "--stop_at_accuracy", "0.001"])
        rc, out = run(base + ["--epochs", "2", "--resume", ck])
        ep = epochs_of(out)
        report(rc == 0 and len(ep) == 1 and len(straight) == 2 and ep[0] == straight[1],
               f"cpu {name}: --resume continues the same trajectory (the noise's stream, the Fisher average)",
               f"exit {rc}; resumed {ep} vs straight {straight[1:]}")
    ck = os.path.join(tmp, "ck_ps_dp.bin")
    expect_error("--resume dp with another --noise_multiplier", base + ["--resume", ck, "--noise_multiplier", "2"],
                 "--noise_multiplier 2", "0.5", "--allow_change noise_multiplier", code=1)
    expect_error("--resume dp with another --clip_per_sample", base + ["--resume", ck, "--clip_per_sample", "1"],
                 "--clip_per_sample 1", "5", "--allow_change clip_per_sample", code=1)
    expect_error("--resume clip with --precond fisher_diag", base + ["--resume", os.path.join(tmp, "ck_ps_clip.bin"),
                 "--precond", "fisher_diag"], "--precond fisher_diag", "none", "--allow_change optimizer", code=1)
    expect_error("--resume fisher_diag with another --precond_eps",
                 base + ["--resume", os.path.join(tmp, "ck_ps_fisher_diag.bin"), "--precond_eps", "0.1"],
                 "--precond_eps 0.1", "1e-12", "--allow_change precond_eps", code=1)
    raw = open(os.path.join(tmp, "ck_ps_fisher_diag.bin"), "rb").read()
    off = ck_table(raw)["fisher_diag.fc2.bias"][1]
    bad = os.path.join(tmp, "fisher_negative.bin")
    open(bad, "wb").write(patched(raw, off + 4, "<f", -1.0))
    expect_error("a negative Fisher average is refused", base + ["--resume", bad], bad, "fisher_diag.fc2.bias[1]",
                 ">= 0", code=1)
    bad = os.path.join(tmp, "noise_without_clip.bin")
    open(bad, "wb").write(patched(open(ck, "rb").read(), 4 * 31, "<f", 0.0))  # slot 31: clip_per_sample
    expect_error("a checkpoint with noise but no clip norm is refused", base + ["--resume", bad], bad,
                 "needs --clip_per_sample", code=1)
    bad = os.path.join(tmp, "kfac_clip.bin")
    kfac_ready.wait(timeout=1800)
    open(bad, "wb").write(patched(open(kfac_ck, "rb").read(), 4 * 31, "<f", 1.0))
    expect_error("a K-FAC checkpoint with a clip norm is refused", base + ["--resume", bad], bad, "header[31..34]",
                 "--optimizer kfac", code=1)


# ----------------------------------------------------------------------------------------------------------------
# --eval_every (issue 21's steps to 99%): evaluations inside epochs, the stop at the first one reaching
# --stop_at_accuracy, and a run that evaluates trains the same weights as one that does not


def skip(name, why):
    emit(f"SKIP {name}: {why}", "skipped")


def in_group(name, checks):
    """Runs checks() with its lines kept; an exception is a failure of the group. -> the lines."""
    _local.lines = []
    t0 = time.time()
    try:
        checks()
    except Exception:  # noqa: BLE001 - any crash of a check is reported as its failure
        report(False, f"{name}: the checks raised", traceback.format_exc()[-1500:])
    _local.lines.append(f"---- group {name}: {time.time() - t0:.1f} s")
    return _local.lines


def eval_lines(out):
    """[(step, epoch, test_acc, train_total_ms)] from the --eval_every lines."""
    pat = r"^step +(\d+) \| epoch +(\d+)/\d+ \| test loss [\d.]+ \| test acc ([\d.]+)% \| train total ([\d.]+) ms$"
    return [(int(s), int(e), float(a), float(t)) for s, e, a, t in re.findall(pat, out, re.M)]


def same_run(tmp, name, args, every, extra_check=None):
    """args trained with and without --eval_every `every`: the checkpoints (weights, optimizer state, header) and
    the closing lines must be identical byte for byte."""
    cks = [os.path.join(tmp, f"ev_{name.replace(' ', '_')}_{i}.bin") for i in range(2)]
    rc0, out0 = run(args + ["--checkpoint", cks[0]])
    rc1, out1 = run(args + ["--checkpoint", cks[1], "--eval_every", str(every)])
    final = [[line for line in o.splitlines() if line.startswith("final |")] for o in (out0, out1)]
    raw = [open(c, "rb").read() if os.path.exists(c) else None for c in cks]
    same = raw[0] is not None and raw[0] == raw[1]
    # the train_ms field differs run to run: compare the accuracy and loss of the closing line
    same_final = bool(final[0]) and [f.split("| train_ms")[0] for f in final[0]] == [f.split("| train_ms")[0]
                                                                                      for f in final[1]]
    n = len(eval_lines(out1))
    report(rc0 == 0 and rc1 == 0 and same and same_final and n > 0,
           f"{name}: --eval_every {every} trains the same weights as no evaluation inside epochs",
           f"exit {rc0}, {rc1}; {n} evaluations; checkpoints identical: {same}; closing lines {final}")


def eval_every(tmp):
    base = ["--device", "cpu", "--data_dir", DATA, "--train_limit", "96", "--test_limit", "50", "--batch_size", "16",
            "--lr", "0.05", "--warmup_steps", "2", "--seed", "4", "--confusion", "0"]
    expect_error("--eval_every -1", base + ["--eval_every", "-1"], "--eval_every", "[0, ", "found -1", code=1)
    expect_error("--eval_every abc", base + ["--eval_every", "abc"], "--eval_every", "expects an integer", "abc",
                 code=1)
    expect_error("--eval_every 2.5", base + ["--eval_every", "2.5"], "--eval_every", "expects an integer", code=1)
    ck = os.path.join(tmp, "ev_load.bin")
    run(base + ["--epochs", "1", "--checkpoint", ck])
    expect_error("--eval_every with --eval_only", ["--device", "cpu", "--data_dir", DATA, "--test_limit", "50",
                 "--eval_only", "1", "--load", ck, "--eval_every", "5"], "--eval_only 1", "--eval_every 5", code=1)

    # 96 images of batch 16: 6 steps an epoch; every 4 steps and at each epoch's end, numbered by the schedule's step
    rc, out = run(base + ["--epochs", "3", "--eval_every", "4"])
    ev = eval_lines(out)
    want = [(4, 1), (6, 1), (8, 2), (12, 2), (16, 3), (18, 3)]
    ep = epochs_of(out)
    times = [e[3] for e in ev]
    report(rc == 0 and [(e[0], e[1]) for e in ev] == want and times == sorted(times) and len(ep) == 3
           and [e[2] for e in ev if e[0] % 6 == 0] == [e[2] for e in ep],
           "--eval_every 4: evaluations at steps 4, 6 (epoch end), 8, 12, 16, 18, the epoch ends' as the epoch lines",
           f"exit {rc}; (step, epoch): {[(e[0], e[1]) for e in ev]}, times {times}")
    rc0, out0 = run(base + ["--epochs", "3"])
    report(rc0 == 0 and not eval_lines(out0) and epochs_of(out0) == ep, "without --eval_every: no step lines",
           f"exit {rc0}; {len(eval_lines(out0))} step lines; epoch lines equal: {epochs_of(out0) == ep}")
    # a non-finite evaluation stops the run there (exit 2), not at the epoch's end
    rc, out = run(base + ["--epochs", "1", "--eval_every", "2", "--lr", "1e6", "--lr_schedule", "constant",
                          "--warmup_steps", "0"])
    m = re.search(r"^error: test loss is (nan|inf|-inf) at step (\d+) \(epoch 1\); stopping", out, re.M)
    report(rc == 2 and m is not None and int(m.group(2)) < 6 and not epochs_of(out),
           "a NaN evaluation inside an epoch stops the run (exit 2) before the epoch's end",
           f"exit {rc}: {m.group(0) if m else out.strip().splitlines()[-1][:150] if out.strip() else ''}")

    # the stop: at the first evaluation whose accuracy reaches the threshold, inside an epoch
    rc, out = run(base + ["--epochs", "3", "--eval_every", "1"])
    ev = eval_lines(out)
    firsts = [i for i in range(1, len(ev)) if ev[i][0] % 6 and ev[i][2] > max(e[2] for e in ev[:i])]
    if rc != 0 or not firsts:
        report(False, "--stop_at_accuracy inside an epoch", f"exit {rc}; no evaluation inside an epoch beats the "
               f"ones before it: {ev}")
    else:
        target = ev[firsts[-1]]
        rc, out = run(base + ["--epochs", "3", "--eval_every", "1", "--stop_at_accuracy", f"{target[2]:.2f}"])
        got = eval_lines(out)
        m = re.search(r"^reached ([\d.]+)% \(--stop_at_accuracy [\d.]+\) at step (\d+) \(epoch (\d+)\) after "
                      r"([\d.]+) ms of training$", out, re.M)
        fin = re.search(r"^final \| test_acc ([\d.]+)", out, re.M)
        ok = (rc == 0 and m is not None and (int(m.group(2)), int(m.group(3))) == target[:2] and got
              and got[-1][0] == target[0] and [e[:3] for e in got] == [e[:3] for e in ev[:len(got)]]
              and float(m.group(1)) == target[2] and fin is not None and float(fin.group(1)) == target[2]
              and float(m.group(4)) == got[-1][3] and "did not reach" not in out)
        report(ok, f"--stop_at_accuracy {target[2]:.2f}: stops at step {target[0]} (epoch {target[1]}), the first "
               "evaluation reaching it", f"exit {rc}; {m.group(0) if m else 'no reached line'}; "
               f"evaluations {[e[:3] for e in got]}")
    rc, out = run(base + ["--epochs", "1", "--eval_every", "4", "--stop_at_accuracy", "100"])
    m = re.search(r"^did not reach --stop_at_accuracy 100: best ([\d.]+)% at step (\d+) \(epoch 1\)", out, re.M)
    ev = eval_lines(out)
    best = max(ev, key=lambda e: e[2]) if ev else None
    report(rc == 0 and m is not None and best is not None and float(m.group(1)) == best[2]
           and int(m.group(2)) == best[0] and "reached" not in out.replace("did not reach", ""),
           "--stop_at_accuracy never reached: said, with the best evaluation",
           f"exit {rc}; {m.group(0) if m else 'no line'}; evaluations {[e[:3] for e in ev]}")

    # the same weights with and without evaluations inside epochs, and across --resume
    same_run(tmp, "cpu sgd", base + ["--epochs", "2"], 5)
    same_run(tmp, "cpu adamw", base + ["--epochs", "2", "--optimizer", "adamw", "--lr", "0.002"], 1)
    same_run(tmp, "cpu shampoo", ["--device", "cpu", "--data_dir", DATA, "--train_limit", "48", "--test_limit", "20",
                                  "--batch_size", "16", "--warmup_steps", "2", "--seed", "4", "--confusion", "0",
                                  "--epochs", "2", "--optimizer", "shampoo", "--max_precond_dim", "32",
                                  "--precond_start", "1", "--precond_every", "2", "--lr", "0.05"], 2)
    ck1, ck2, ck3 = (os.path.join(tmp, f"ev_resume{i}.bin") for i in range(3))
    run(base + ["--epochs", "3", "--checkpoint", ck1, "--stop_at_accuracy", "0.001"])  # stops after epoch 1
    rc, out = run(base + ["--epochs", "3", "--resume", ck1, "--eval_every", "5", "--checkpoint", ck2])
    run(base + ["--epochs", "3", "--checkpoint", ck3])
    ev = eval_lines(out)
    same = os.path.exists(ck2) and os.path.exists(ck3) and open(ck2, "rb").read() == open(ck3, "rb").read()
    report(rc == 0 and [(e[0], e[1]) for e in ev] == [(10, 2), (12, 2), (15, 3), (18, 3)] and same,
           "--resume with --eval_every: the schedule's step numbers go on, the weights are the straight run's",
           f"exit {rc}; (step, epoch): {[(e[0], e[1]) for e in ev]}; checkpoint as the straight run's: {same}")

    # the GPU: an evaluation cuts a 32-step graph (or a graph of the rest); the weights must not change
    names = ["gpu sgd (fast path, graphs)", "gpu sgd --cuda_graph 0", "gpu muon (graphs)", "gpu adamw --matmul cublas"]
    if not HAVE_GPU:
        for n in names:
            skip(f"{n}: --eval_every trains the same weights", "no GPU (nvidia-smi not found)")
        return
    gpu = ["--device", "cuda", "--data_dir", DATA, "--train_limit", "5000", "--test_limit", "1000", "--batch_size",
           "128", "--warmup_steps", "20", "--seed", "2", "--confusion", "0", "--epochs", "2"]  # 39 steps + a tail
    extras = (["--lr", "0.05"], ["--lr", "0.05", "--cuda_graph", "0"], ["--optimizer", "muon", "--lr", "0.003"],
              ["--optimizer", "adamw", "--lr", "0.002", "--matmul", "cublas"])
    for n, extra, every in zip(names, extras, (7, 7, 20, 33)):
        same_run(tmp, n, gpu + extra, every)


def main():
    if not os.path.exists(BIN):
        report(False, "binary", f"{BIN} is missing: run make train_mnist")
        print(f"{results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped")
        return 1
    tmp = tempfile.mkdtemp(prefix="test_mnist_cli_")
    t_main = time.time()
    try:
        # flags
        rc, out = run(["--help"])
        flags = re.findall(r"^  --(\w+)", out, re.M)
        no_default = [f for f in flags if f != "help" and not re.search(rf"--{f} .*\[.*\]", out)]
        report(rc == 0 and len(flags) >= 25 and not no_default, "--help",
               f"exit {rc}, {len(flags)} flags listed, without a default: {no_default}")
        expect_error("unknown flag", ["--bogus", "1"], "unknown flag --bogus")
        expect_error("missing value", ["--epochs"], "--epochs", "expects a value")
        expect_error("non-numeric float", ["--lr", "abc"], "--lr", "expects a number", "abc")
        expect_error("non-numeric int", ["--batch_size", "6x4"], "--batch_size", "expects an integer", "6x4")
        expect_error("out of range", ["--batch_size", "0"], "--batch_size", "[1, 2048]", "found 0")
        expect_error("bad choice", ["--matmul", "magic"], "--matmul", "ours,cublas", "magic")
        expect_error("positional argument", ["train"], "expected a flag")
        expect_error("eval_only without load", ["--eval_only", "1"], "--eval_only 1 needs --load")
        expect_error("lr_min above lr", ["--lr", "0.01", "--lr_min", "0.1"], "--lr_min")

        # MNIST files
        expect_error("missing data folder", ["--data_dir", os.path.join(tmp, "nowhere")], "cannot open MNIST file",
                     "train-images-idx3-ubyte.gz")
        d = make_dir(tmp, "magic_images", idx_images(30, magic=2052), idx_labels(30))
        expect_error("wrong magic (images)", ["--data_dir", d], "train-images-idx3-ubyte.gz", "magic number is 2052",
                     "expected 2051")
        d = make_dir(tmp, "magic_labels", idx_images(30), idx_labels(30, magic=2051))
        expect_error("wrong magic (labels)", ["--data_dir", d], "train-labels-idx1-ubyte.gz", "magic number is 2051",
                     "expected 2049")
        d = make_dir(tmp, "truncated_images", idx_images(30)[:16 + 784 * 20], idx_labels(30))
        expect_error("truncated images", ["--data_dir", d], "train-images-idx3-ubyte.gz", "truncated",
                     f"needs {30 * 784} bytes, found {20 * 784}")
        d = make_dir(tmp, "truncated_header", idx_images(30)[:10], idx_labels(30))
        expect_error("truncated header", ["--data_dir", d], "train-images-idx3-ubyte.gz", "truncated", "header")
        d = make_dir(tmp, "truncated_labels", idx_images(30), idx_labels(30)[:8 + 12])
        expect_error("truncated labels", ["--data_dir", d], "train-labels-idx1-ubyte.gz", "truncated",
                     "needs 30 bytes, found 12")
        d = make_dir(tmp, "count_mismatch", idx_images(30), idx_labels(29))
        expect_error("image and label counts disagree", ["--data_dir", d], "30 images", "29 labels", "disagree")
        d = make_dir(tmp, "rows", idx_images(30, rows=27), idx_labels(30))
        expect_error("wrong image rows", ["--data_dir", d], "rows is 27, expected 28")
        d = make_dir(tmp, "trailing", idx_images(30) + b"\0" * 5, idx_labels(30))
        expect_error("trailing bytes", ["--data_dir", d], "train-images-idx3-ubyte.gz", "trailing bytes")
        d = make_dir(tmp, "bad_label", idx_images(30), idx_labels(30, labels=bytes([3] * 29 + [12])))
        expect_error("label out of range", ["--data_dir", d], "label 29 is 12, expected 0..9")
        d = make_dir(tmp, "corrupt_gzip", idx_images(30), idx_labels(30))
        path = os.path.join(d, "train-images-idx3-ubyte.gz")
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[: len(raw) // 2])  # a gzip stream cut in the middle
        expect_error("gzip cut in the middle", ["--data_dir", d], "train-images-idx3-ubyte.gz")
        d = make_dir(tmp, "test_mismatch", idx_images(30), idx_labels(30), idx_images(20), idx_labels(21))
        expect_error("test split counts disagree", ["--data_dir", d], "t10k-images-idx3-ubyte.gz", "20 images",
                     "21 labels")

        # checkpoints
        bad = os.path.join(tmp, "bad.bin")
        open(bad, "wb").write(struct.pack("<256i", 12345, 1, 0, *([0] * 253)))
        expect_error("checkpoint wrong magic", ["--device", "cpu", "--eval_only", "1", "--load", bad], bad,
                     "magic is 12345", "expected 20260202")
        expect_error("checkpoint missing", ["--device", "cpu", "--eval_only", "1", "--load", bad + ".none"],
                     "cannot open", bad + ".none")

        # CPU fallback: train on a small subset (first 192 training images, 200 test images)
        ck = os.path.join(tmp, "ck.bin")
        common = ["--device", "cpu", "--data_dir", DATA, "--train_limit", "192", "--test_limit", "200",
                  "--batch_size", "16", "--lr", "0.05", "--warmup_steps", "4", "--seed", "3"]
        rc, out = run(common + ["--epochs", "3", "--checkpoint", ck])
        ep = epochs_of(out)
        ok = rc == 0 and len(ep) == 3 and ep[2][0] < ep[0][0] and ep[2][2] > ep[0][2] and ep[2][2] >= 50.0
        report(ok, "cpu training: loss falls, accuracy rises",
               f"exit {rc}; epochs (train loss, test loss, test acc): {ep}")
        report("confusion matrix" in out, "cpu training: confusion matrix", "printed at the end")
        left = [f for f in os.listdir(tmp) if ".tmp" in f]
        report(os.path.exists(ck) and not left, "cpu checkpoint written atomically",
               f"{ck} exists, left behind: {left}")
        rc, out2 = run(["--device", "cpu", "--data_dir", DATA, "--test_limit", "200", "--eval_only", "1", "--load", ck])
        m = re.search(r"final \| test_acc ([\d.]+)", out2)
        acc = float(m.group(1)) if m else None
        report(rc == 0 and ep and acc is not None and abs(acc - ep[-1][2]) < 1e-6, "--eval_only --load",
               f"exit {rc}, accuracy {acc} vs {ep[-1][2] if ep else None} at the end of training")
        # the run configuration's rows of the start-up table (issue 25): which kernels the run takes
        rc, out4 = run(["--device", "cpu", "--data_dir", DATA, "--test_limit", "100", "--eval_only", "1", "--load", ck,
                        "--cpu_threads", "3"])
        rows = dict((r[2:23].rstrip(), r[26:-2].rstrip()) for r in out4.splitlines()
                    if re.fullmatch(r"\| .{21} \| .{44,} \|", r))
        want = {"matrix products": "CPU, 3 threads", "precision": "fp32", "fast path": "off (CPU)"}
        got = {k: rows.get(k) for k in want}
        report(rc == 0 and got == want, "start-up table: the run configuration", f"exit {rc}, rows {got}")

        # resume: 2 epochs + resume to 3 == 3 straight (same trajectory)
        ck2 = os.path.join(tmp, "ck2.bin")
        run(common + ["--epochs", "3", "--checkpoint", ck2, "--stop_at_accuracy", "0.001"])  # stops after epoch 1
        rc, out3 = run(common + ["--epochs", "3", "--resume", ck2])
        ep3 = epochs_of(out3)
        report(rc == 0 and len(ep3) == 2 and ep and ep3[-1] == ep[-1], "--resume continues the same trajectory",
               f"exit {rc}; resumed epochs 2-3 {ep3} vs straight {ep[1:] if ep else None}")

        expect_error("resume with nothing left to train", common + ["--epochs", "3", "--resume", ck], "epoch is 3",
                     "--epochs is 3")
        expect_error("checkpoint folder missing", common + ["--epochs", "1", "--checkpoint",
                     os.path.join(tmp, "no_such_dir", "ck.bin")], "--checkpoint", "does not exist")

        # NaN: resume with an absurd learning rate; the last good checkpoint stays as it was
        before = open(ck, "rb").read()
        rc, out4 = run(common + ["--epochs", "5", "--resume", ck, "--lr", "1e9", "--lr_schedule", "constant",
                                 "--checkpoint", ck, "--allow_change", "epochs,lr,lr_schedule"])
        after = open(ck, "rb").read()
        report(rc != 0 and "training loss is" in out4 and "kept" in out4 and before == after,
               "nan loss stops training, checkpoint kept",
               f"exit {rc}: {out4.strip().splitlines()[-1][:150] if out4.strip() else ''}; checkpoint unchanged: {before == after}")

        # the slow groups beside each other (per_sample waits for optimizers' K-FAC checkpoint at its last check)
        dirs = [os.path.join(tmp, d) for d in ("g_opt", "g_delay", "g_eval", "g_sample")]
        for d in dirs:
            os.makedirs(d)
        kfac_ready = threading.Event()

        def optimizers_then_signal():
            try:
                optimizers(dirs[0])
            finally:
                kfac_ready.set()
        groups = [("optimizers", optimizers_then_signal),
                  ("per-sample", lambda: per_sample(dirs[3], os.path.join(dirs[0], "ck_kfac.bin"), kfac_ready)),
                  ("precond_delay", lambda: precond_delay(dirs[1])), ("eval_every", lambda: eval_every(dirs[2]))]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(groups)) as pool:
            futures = [pool.submit(in_group, name, checks) for name, checks in groups]
            t0 = time.time()
            issue26(tmp, common)
            print(f"---- the checks above and issue26's: {time.time() - t_main:.1f} s (issue26 {time.time() - t0:.1f} s)")
            for f in futures:
                print("\n".join(f.result()), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
