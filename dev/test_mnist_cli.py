"""Command-line and data-file tests of ./train_mnist: the real binary through subprocess, no GPU needed.

Bad flags, missing / wrong-magic / truncated / mismatched MNIST files and bad checkpoints must each give a clear
message and a non-zero exit; then the CPU fallback trains on a small subset (the loss falls, the accuracy rises),
a checkpoint reloads with --eval_only, and a NaN loss stops training keeping the last good checkpoint.
Run from the repo root: python3 dev/test_mnist_cli.py   (last line: N passed, N failed, N skipped)
"""
import gzip
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "train_mnist")
DATA = os.path.join(ROOT, "data", "mnist")
results = {"passed": 0, "failed": 0, "skipped": 0}


def report(ok, name, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    results["passed" if ok else "failed"] += 1


def run(args, timeout=300):
    p = subprocess.run([BIN] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def expect_error(name, args, *needles):
    """The binary must exit non-zero and its output must contain every needle."""
    rc, out = run(args)
    missing = [n for n in needles if n not in out]
    last = out.strip().splitlines()[-1] if out.strip() else "(no output)"
    report(rc != 0 and not missing, name, f"exit {rc}, message: {last[:160]}" + (f"; missing {missing}" if missing else ""))


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


def main():
    if not os.path.exists(BIN):
        report(False, "binary", f"{BIN} is missing: run make train_mnist")
        print(f"{results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped")
        return 1
    tmp = tempfile.mkdtemp(prefix="test_mnist_cli_")
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
        report(os.path.exists(ck) and not os.path.exists(ck + ".tmp"), "cpu checkpoint written atomically",
               f"{ck} exists, no .tmp left")
        rc, out2 = run(["--device", "cpu", "--data_dir", DATA, "--test_limit", "200", "--eval_only", "1", "--load", ck])
        m = re.search(r"final \| test_acc ([\d.]+)", out2)
        acc = float(m.group(1)) if m else None
        report(rc == 0 and ep and acc is not None and abs(acc - ep[-1][2]) < 1e-6, "--eval_only --load",
               f"exit {rc}, accuracy {acc} vs {ep[-1][2] if ep else None} at the end of training")

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
                     os.path.join(tmp, "no_such_dir", "ck.bin")], "--checkpoint", "cannot write")

        # NaN: resume with an absurd learning rate; the last good checkpoint stays as it was
        before = open(ck, "rb").read()
        rc, out4 = run(common + ["--epochs", "5", "--resume", ck, "--lr", "1e9", "--lr_schedule", "constant",
                                 "--checkpoint", ck])
        after = open(ck, "rb").read()
        report(rc != 0 and "training loss is" in out4 and "kept" in out4 and before == after,
               "nan loss stops training, checkpoint kept",
               f"exit {rc}: {out4.strip().splitlines()[-1][:150] if out4.strip() else ''}; checkpoint unchanged: {before == after}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
