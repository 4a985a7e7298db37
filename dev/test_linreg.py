"""Tests of train_linreg through its real binary: bad inputs, the CPU path and every GPU kernel version against
PyTorch (dev/linreg.py), the CSV converter, and dataset files.

CI (no GPU, no torch) runs the command-line checks and the CPU path against a committed PyTorch fixture
(dev/fixtures/linreg_small*.): made by `python3 dev/test_linreg.py --make_fixture` on a machine with torch.
On a GPU machine with torch it also trains 5M points with every version and compares with PyTorch on the same file.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import binio  # noqa: E402

BIN = os.path.join(ROOT, "train_linreg")
FIXTURE_DATA = os.path.join(ROOT, "dev", "fixtures", "linreg_small.bin")
FIXTURE_TORCH = os.path.join(ROOT, "dev", "fixtures", "linreg_small_torch.json")
# Relative bound of w, b and every epoch's loss against PyTorch, as the issue asks. Both sides are fp32; their sums
# differ in order only (PyTorch's tree reduction against our blocks + double), a few 1e-7 at 4M points.
RTOL = 1e-5
ATOL = 1e-7  # for values that sit at ~0, where a relative bound means nothing

passed = failed = skipped = 0


def report(ok, name, detail=""):
    global passed, failed
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if ok:
        passed += 1
    else:
        failed += 1


def skip(name, why):
    global skipped
    print(f"SKIP {name}: {why}", flush=True)
    skipped += 1


def run(args, timeout=600):
    return subprocess.run([BIN] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def have_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def gpu_name():
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def have_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def compare(name, got, want):
    """Reports the worst relative error over w, b and every epoch's training loss."""
    pairs = [(f"w[{i}]", g, w) for i, (g, w) in enumerate(zip(got["w"], want["w"]))]
    pairs.append(("b", got["b"], want["b"]))
    pairs += [(f"loss[{e}]", g, w) for e, (g, w) in enumerate(zip(got["train_losses"], want["train_losses"]))]
    if len(got["train_losses"]) != len(want["train_losses"]) or len(got["w"]) != len(want["w"]):
        return report(False, name, "different numbers of epochs or weights")
    worst, where = 0.0, ""
    for label, g, w in pairs:
        err = float("inf") if g is None or w is None else abs(g - w) / (ATOL / RTOL + abs(w))
        if not err <= worst:
            worst, where = err, f"{label} {g!r} vs {w!r}"
    report(worst <= RTOL, name, f"max rel err {worst:.3g} at {where} (bound {RTOL})")


def train_json(args, tmp, tag):
    out = os.path.join(tmp, f"{tag}.json")
    proc = run(args + ["--result_file", out, "--log_every", "0"])
    if proc.returncode != 0:
        report(False, tag, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
        return None
    with open(out) as f:
        return json.load(f)


def write_dataset(path, x, y, n_train, header_patch=None, truncate=0):
    nan = float("nan")
    binio.write(path, binio.LINREG_DATASET, {"n_points": len(y), "n_features": x.shape[1], "n_train": n_train,
                "seed": 0, "w_true": nan, "b_true": nan, "noise_std": nan, "x_min": nan, "x_max": nan},
                {"x": x.astype(np.float32), "y": y.astype(np.float32)})
    if header_patch or truncate:
        raw = bytearray(open(path, "rb").read())
        for slot, value in (header_patch or {}).items():
            raw[4 * slot:4 * slot + 4] = np.int32(value).tobytes()
        if truncate:
            raw = raw[:-truncate]
        open(path, "wb").write(bytes(raw))


def test_command_line(tmp):
    cases = [
        (["--bogus", "1"], "error: unknown flag --bogus (see --help)"),
        (["--epochs"], "error: flag --epochs expects a value, found none"),
        (["--lr", "--epochs", "5"], "error: flag --lr expects a number, found '--epochs'"),
        (["--points", "abc"], "error: flag --points expects an integer, found 'abc'"),
        (["--points", "0"], "error: flag --points expects an integer in [2, 2000000000], found 0"),
        (["--points", "-5"], "flag --points expects an integer in [2, 2000000000], found -5"),
        (["--points", "1e3"], "flag --points expects an integer, found '1e3'"),
        (["--lr", "0"], "error: flag --lr expects a number > 0, found 0"),
        (["--lr", "-0.1"], "flag --lr expects a number in [0, 3e+38], found -0.1"),
        (["--lr", "nan"], "error: flag --lr expects a number, found 'nan'"),
        (["--lr", "inf"], "flag --lr expects a number, found 'inf'"),
        (["--lr", "1e39"], "flag --lr expects a number in [0, 3e+38], found 1e39"),
        (["--epochs", "-1"], "flag --epochs expects an integer in [0, 100000000], found -1"),
        (["--epochs", "2.5"], "flag --epochs expects an integer, found '2.5'"),
        (["--split", "0"], "flag --split expects a number in (0, 1), found 0"),
        (["--split", "1"], "flag --split expects a number in (0, 1), found 1"),
        (["--split", "1.5"], "flag --split expects a number in [0, 1], found 1.5"),
        (["--split", "-0.2"], "flag --split expects a number in [0, 1], found -0.2"),
        (["--kernel", "5"], "flag --kernel expects an integer in [1, 4], found 5"),
        (["--device", "tpu"], "error: flag --device expects one of auto,cuda,cpu, found 'tpu'"),
        (["--device", "gpu"], "error: flag --device expects one of auto,cuda,cpu, found 'gpu'"),
        (["--noise_std", "-1"], "flag --noise_std expects a number in [0, 3e+38], found -1"),
        (["--x_min", "5", "--x_max", "1"], "flag --x_max expects a value > --x_min (5), found 1"),
        (["--points", "3", "--split", "0.1"], "empty training or test split"),
        (["stray"], "error: expected a flag like --name, found 'stray' (see --help)"),
    ]
    for args, needle in cases:
        p = run(args)
        report(p.returncode == 1 and needle in p.stderr, f"bad flags {' '.join(args)}",
               f"exit {p.returncode}, stderr: {p.stderr.strip()[:160]}")
    p = run(["--help"])
    source = open(os.path.join(ROOT, "train_linreg.cu")).read()
    flags = sorted(set(re.findall(r'\{"([a-z_]+)", \'[ifcs]\', &a\.', source)))
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  --([a-z_]+) +(.*)$", p.stdout, flags=re.M)}
    missing = [f for f in flags if not re.search(r"\[[^\]]*\]", lines.get(f, ""))]
    report(p.returncode == 0 and len(flags) > 15 and not missing and "help" in lines,
           "--help lists every flag with its default in brackets", f"{len(flags)} flags, missing {missing}")
    report("[auto]  one of: auto,cuda,cpu" in lines.get("device", ""), "--help: --device auto|cuda|cpu, default auto",
           lines.get("device", "(no --device line)"))
    if not have_gpu():
        p = run(["--device", "cuda", "--points", "1000"])
        report(p.returncode == 1 and "error: --device cuda but no CUDA device is available" in p.stderr,
               "--device cuda without a GPU is an error", p.stderr.strip()[:160])
        p = run(["--points", "1000", "--epochs", "3"])
        report(p.returncode == 0 and p.stdout.startswith("no CUDA device found (") and
               "training on the CPU (--device cpu)" in p.stdout, "--device auto without a GPU trains on the CPU",
               p.stdout.splitlines()[0] if p.stdout else p.stderr.strip()[:160])
    else:
        skip("--device cuda without a GPU is an error", "a GPU is present")
        skip("--device auto without a GPU trains on the CPU", "a GPU is present")
    start_table_and_log_lines()

    # bad data files
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, (100, 1))
    y = 0.7 * x[:, 0] + 0.3
    files = {}
    files["missing"] = (os.path.join(tmp, "does_not_exist.bin"), "cannot open data file")
    path = os.path.join(tmp, "magic.bin"); write_dataset(path, x, y, 80, {0: 12345})
    files["wrong magic"] = (path, "header[0] magic is 12345, expected 20260101")
    path = os.path.join(tmp, "version.bin"); write_dataset(path, x, y, 80, {1: 7})
    files["wrong version"] = (path, "header[1] version is 7, expected 1")
    path = os.path.join(tmp, "trunc.bin"); write_dataset(path, x, y, 80, truncate=10)
    files["truncated"] = (path, "file length is")
    path = os.path.join(tmp, "short.bin"); open(path, "wb").write(b"\0" * 100)
    files["shorter than a header"] = (path, "shorter than the 1024-byte header")
    path = os.path.join(tmp, "length.bin"); write_dataset(path, x, y, 80, {3: 101})
    files["header n_points disagrees with the length"] = (path, "tensor x has shape[0] = 100, expected 101")
    path = os.path.join(tmp, "ntrain.bin"); write_dataset(path, x, y, 80, {5: 100})
    files["n_train outside [1, n)"] = (path, "header[5] n_train is 100")
    path = os.path.join(tmp, "nan.bin"); xx = x.copy(); xx[5, 0] = np.nan; write_dataset(path, xx, y, 80)
    files["NaN in x"] = (path, "x[5][0] is nan")
    for name, (path, needle) in files.items():
        p = run(["--data_file", path])
        report(p.returncode != 0 and needle in p.stderr, f"bad data file: {name}",
               f"exit {p.returncode}, stderr: {p.stderr.strip()[:160]}")
    p = run(["--data_file", os.path.join(tmp, "magic.bin"), "--split", "0.5"])
    report(p.returncode != 0 and "--split applies to generated data" in p.stderr, "--split with --data_file is refused")
    p = run(["--device", "cpu", "--points", "1000", "--lr", "5", "--log_every", "0"])
    report(p.returncode != 0 and "training loss became" in p.stderr, "divergence stops with a message",
           p.stderr.strip()[:160])
    # issue 26: a loss that grows but stays finite (2 epochs at lr 1e9) is divergence too, not exit 0
    p = run(["--device", "cpu", "--points", "1000", "--lr", "1e9", "--epochs", "2", "--log_every", "0"])
    report(p.returncode == 1 and "training loss rose from" in p.stderr and "--lr" in p.stderr,
           "a finite but growing loss is divergence", p.stderr.strip()[:160])
    # issue 26: a directory is reported as such, and bad outputs are refused before training
    p = run(["--data_file", tmp])
    report(p.returncode == 1 and "is a directory" in p.stderr, "--data_file DIR is reported as a directory",
           p.stderr.strip()[:160])
    for flag in ("--save_data", "--result_file"):
        p = run(["--device", "cpu", "--points", "1000", flag, tmp])
        report(p.returncode == 1 and "is a directory" in p.stderr and "epoch" not in p.stdout,
               f"{flag} DIR is refused before training", p.stderr.strip()[:160])


def start_table_and_log_lines():
    """The dialect of the three trainers: a boxed table of every flag's value after the device row, then one line per
    logged epoch, 'epoch N/TOTAL | train loss X | Y ms/epoch | Z points/s', and a closing 'final | ...' line."""
    p = run(["--device", "cpu", "--points", "2000", "--epochs", "45", "--log_every", "20"])
    out = p.stdout.splitlines()
    rule = "+" + "-" * 23 + "+" + "-" * 46 + "+"
    rules = [i for i, line in enumerate(out) if line == rule]
    rows = out[rules[0] + 1:rules[1]] if len(rules) == 2 else []
    keys = [r[2:23].strip() for r in rows]
    shaped = all(re.fullmatch(r"\| .{21} \| .{44,} \|", r) for r in rows)
    source = open(os.path.join(ROOT, "train_linreg.cu")).read()
    flags = [f for f in re.findall(r'\{"([a-z_]+)", \'[ifcs]\', &a\.', source) if f != "device"]
    device_row = rows[0].startswith("| device" + " " * 16 + "| cpu ") if rows else False
    report(p.returncode == 0 and shaped and keys[:1] == ["device"] and device_row and keys[1:1 + len(flags)] == flags,
           "start-up table: boxed, the device, then every flag", f"{len(rows)} rows: {keys[:4]}...")
    logged = [m.groups() for m in re.finditer(
        r"^epoch +(\d+)/45 \| train loss ([0-9.]+) \| ([0-9.]+) ms/epoch \| ([0-9.e+]+) points/s$", p.stdout, re.M)]
    report([int(g[0]) for g in logged] == [1, 20, 40, 45],
           "log lines: epoch N/TOTAL | train loss | ms/epoch | points/s", f"epochs {[g[0] for g in logged]}")
    report(re.search(r"^final \| train_loss [0-9.]+ \| test_loss [0-9.]+ \| train_ms [0-9.]+$", p.stdout, re.M)
           is not None, "closing line: final | train_loss | test_loss | train_ms", out[-1] if out else "")


def test_files_and_cpu(tmp):
    # generated data saved to a file trains to the same numbers as the in-memory data
    f = os.path.join(tmp, "gen.bin")
    a = train_json(["--device", "cpu", "--points", "5001", "--save_data", f], tmp, "generated")
    b = train_json(["--device", "cpu", "--data_file", f], tmp, "from file")
    if a and b:
        report(a["w"] == b["w"] and a["b"] == b["b"] and a["train_losses"] == b["train_losses"],
               "--save_data then --data_file trains to identical numbers")
        _, cfg, tensors = binio.read(f, binio.LINREG_DATASET)
        x, y = tensors["x"][:, 0], tensors["y"]
        ok = cfg["n_train"] == 4001 and x.min() >= 0 and x.max() < 10 and abs(np.std(y - 0.7 * x - 0.3) - 0.1) < 0.01
        report(ok, "generated data: 80/20 split, x in [0, 10), noise std 0.1",
               f"n_train {cfg['n_train']}, x [{x.min():.3f}, {x.max():.3f}], noise std {np.std(y - 0.7 * x - 0.3):.4f}")
    # CSV converter: several features, exact values, then a CPU run against a float64 NumPy oracle
    rng = np.random.default_rng(3)
    xs = rng.uniform(-1, 1, (400, 3))
    ys = xs @ np.array([0.5, -1.0, 2.0]) + 0.25 + 0.01 * rng.standard_normal(400)
    csv_path = os.path.join(tmp, "data.csv")
    with open(csv_path, "w") as fh:
        fh.write("a,b,c,target\n")
        for row, t in zip(xs, ys):
            fh.write(",".join(f"{v:.9g}" for v in row) + f",{t:.9g}\n")
    out = os.path.join(tmp, "csv.bin")
    p = subprocess.run([sys.executable, "scripts/csv_to_linreg.py", csv_path, out, "--no_shuffle"], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        report(False, "csv_to_linreg converts a CSV", p.stderr.strip())
    else:
        _, cfg, tensors = binio.read(out, binio.LINREG_DATASET)
        ok = cfg["n_features"] == 3 and cfg["n_train"] == 320 and np.allclose(tensors["x"], xs, rtol=1e-7, atol=0)
        report(ok, "csv_to_linreg converts a CSV", f"features {cfg['n_features']}, n_train {cfg['n_train']}")
        res = train_json(["--device", "cpu", "--data_file", out, "--epochs", "50", "--lr", "0.1"], tmp, "csv train")
        if res:
            xt, yt = tensors["x"][:320].astype(np.float64), tensors["y"][:320].astype(np.float64)
            w, b, losses = np.full(3, 0.83), 0.7645, []
            for _ in range(50):
                r = xt @ w + b - yt
                losses.append(np.mean(r * r))
                w, b = w - 0.1 * 2 * (xt.T @ r) / 320, b - 0.1 * 2 * r.mean()
            compare("CPU path with 3 features against a float64 oracle", res,
                    {"w": list(w), "b": b, "train_losses": losses})
    for content, needle in [("a,y\n1,2\nx,3\n4,5\n", "'x' is not a number"), ("a,y\n1,2\n", "at least 2 data rows"),
                            ("a,b\n1,2\n3\n4,5\n", "has 1 fields")]:
        with open(csv_path, "w") as fh:
            fh.write(content)
        p = subprocess.run([sys.executable, "scripts/csv_to_linreg.py", csv_path, out], cwd=ROOT, capture_output=True, text=True)
        report(p.returncode != 0 and needle in p.stderr, f"csv_to_linreg rejects bad CSV ({needle})", p.stderr.strip()[:120])
    # the CPU path against PyTorch on the committed fixture
    if not (os.path.exists(FIXTURE_DATA) and os.path.exists(FIXTURE_TORCH)):
        report(False, "CPU path against PyTorch", f"fixture missing: run python3 dev/test_linreg.py --make_fixture")
        return
    want = json.load(open(FIXTURE_TORCH))
    got = train_json(["--device", "cpu", "--data_file", FIXTURE_DATA], tmp, "cpu vs torch")
    if got:
        compare("CPU path against PyTorch (fixture, 20000 points, 200 epochs)", got, want)


def test_gpu(tmp):
    if not have_gpu():
        for v in range(1, 5):
            skip(f"version {v} against PyTorch on the fixture", "no GPU")
        skip("every version and the CPU path against PyTorch at 5M points", "no GPU")
        return
    want = json.load(open(FIXTURE_TORCH))
    for v in range(1, 5):
        got = train_json(["--device", "cuda", "--kernel", str(v), "--data_file", FIXTURE_DATA], tmp, f"v{v} fixture")
        if got:
            compare(f"version {v} against PyTorch (fixture, 20000 points)", got, want)
    if not have_torch():
        skip("every version and the CPU path against PyTorch at 5M points", "torch is not installed")
        return
    big = os.path.join(tmp, "big.bin")
    gen = train_json(["--device", "cuda", "--save_data", big], tmp, "generate 5M")
    ref_path = os.path.join(tmp, "torch_5m.json")
    p = subprocess.run([sys.executable, "dev/linreg.py", "--data_file", big, "--out", ref_path, "--device", "cuda"],
                       cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0 or gen is None:
        report(False, "PyTorch reference at 5M points", p.stderr.strip()[-300:])
        return
    want = json.load(open(ref_path))
    compare("version 4 on generated data (in memory) against PyTorch, 5M points", gen, want)
    for v in range(1, 5):
        got = train_json(["--device", "cuda", "--kernel", str(v), "--data_file", big], tmp, f"v{v} 5M")
        if got:
            compare(f"version {v} against PyTorch, 5M points (4M train), 200 epochs", got, want)
            if v == 4:
                # the speed target is an H100 figure; on another GPU the time is reported, not judged
                name = "version 4 trains 200 epochs over 4M points in at most 1 ms on an H100"
                if "H100" in gpu_name():
                    report(got["train_ms"] <= 1.0, name, f"{got['train_ms']:.3f} ms")
                else:
                    skip(name, f"not an H100 ({gpu_name() or 'unknown GPU'}): {got['train_ms']:.3f} ms")
    got = train_json(["--device", "cpu", "--data_file", big], tmp, "cpu 5M")
    if got:
        compare("CPU path against PyTorch, 5M points", got, want)


def make_fixture():
    """Writes the committed fixture: a 20000-point dataset and PyTorch's results on it (needs torch)."""
    os.makedirs(os.path.dirname(FIXTURE_DATA), exist_ok=True)
    p = run(["--device", "cpu", "--points", "20000", "--seed", "7", "--save_data", FIXTURE_DATA, "--log_every", "0"])
    assert p.returncode == 0, p.stderr
    subprocess.run([sys.executable, "dev/linreg.py", "--data_file", FIXTURE_DATA, "--out", FIXTURE_TORCH,
                    "--device", "cpu"], cwd=ROOT, check=True)


def main():
    if "--make_fixture" in sys.argv:
        make_fixture()
        return 0
    if not os.path.exists(BIN):
        report(False, "train_linreg is built", f"{BIN} not found: run make")
    else:
        tmp = tempfile.mkdtemp(prefix="test_linreg_")
        try:
            test_command_line(tmp)
            test_files_and_cpu(tmp)
            test_gpu(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
