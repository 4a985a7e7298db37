"""CPU checks of the softmax lab (no GPU, no torch needed): the committed PyTorch fixture against a NumPy float64
softmax and its backward, and the binaries' handling of bad command lines (exit code != 0 and a message naming the
flag). Run from the repo root: python3 dev/test_softmax.py. Last line: N passed, N failed, N skipped.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
FIXTURE = os.path.join(ROOT, "dev", "fixtures", "softmax_fixture.bin")
counts = [0, 0, 0]


def check(ok, name, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    counts[0 if ok else 1] += 1


def skip(name, why):
    print(f"SKIP {name}: {why}")
    counts[2] += 1


def numpy_checks():
    import numpy as np
    import binio
    if not os.path.exists(FIXTURE):
        check(False, "numpy vs torch fixture", f"{FIXTURE} missing (committed; regenerate with python3 dev/softmax.py --make_fixture PATH on the GPU machine)")
        return
    _, config, t = binio.read(FIXTURE, binio.SOFTMAX_FIXTURE)
    eps = np.finfo(np.float32).eps
    for k in range(config["n_cases"]):
        x = binio.expect(FIXTURE, t, f"case{k}.x", dtype=np.float32).astype(np.float64)
        shape = x.shape
        y = binio.expect(FIXTURE, t, f"case{k}.y", shape, np.float32)
        dy = binio.expect(FIXTURE, t, f"case{k}.dy", shape, np.float32)
        dx = binio.expect(FIXTURE, t, f"case{k}.dx", shape, np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            m = x.max(-1, keepdims=True)
            e = np.exp(x - m)  # all -inf row: -inf - -inf = NaN, as torch
            ref = e / e.sum(-1, keepdims=True)
            yd = y.astype(np.float64)
            dref = yd * (dy - (yd * dy).sum(-1, keepdims=True))
        # forward: the tolerance of dev/softmax_forward.cu (expf, x - max rounding, fp32 sum of cols terms)
        rtol = 8e-6 + 2 * eps * np.sqrt(shape[1])
        for name, out, r, atol, rt in (("forward", y, ref, 1e-10, rtol), ("backward", dx, dref, 1e-6, 2e-6)):
            nan_ok = np.array_equal(np.isnan(out), np.isnan(r))
            err = np.where(np.isnan(r), 0.0, np.abs(out - r))
            bad = err > atol + rt * np.abs(np.nan_to_num(r))
            worst = np.unravel_index(np.argmax(err), err.shape)
            check(nan_ok and not bad.any(), f"numpy float64 {name} vs torch fixture case{k} {shape[0]}x{shape[1]}",
                  f"max abs err {err.max():.3g} at {tuple(int(i) for i in worst)}, NaN pattern {'same' if nan_ok else 'DIFFERENT'}")
        neg = np.isneginf(x) & ~np.isnan(ref)
        check(bool((y[neg] == 0).all()), f"torch gives exact 0 at -inf, case{k}", f"{int(neg.sum())} -inf entries")


def cli_checks():
    for binary, nver in (("softmax_forward", 16), ("softmax_backward", 11)):
        path = os.path.join(ROOT, "dev", binary)
        if not os.path.exists(path):
            check(False, f"{binary} bad flags", f"{path} not built (make -C dev {binary})")
            continue
        cases = [(["--bogus"], "--bogus"), ([str(nver + 1)], "version"), (["--block_size", "33"], "--block_size"),
                 (["--block_size"], "needs a value"), (["--shapes", "12x"], "--shapes"), (["--versions", "0"], "--versions"),
                 (["--seed", "-3"], "--seed")]
        for argv, needle in cases:
            p = subprocess.run([path] + argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
            ok = p.returncode != 0 and needle in (p.stdout + p.stderr)
            check(ok, f"{binary} {' '.join(argv)}", f"exit {p.returncode}, message: {(p.stderr or p.stdout).strip()[:100]}")
        p = subprocess.run([path, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        check(p.returncode == 0 and "--bench_json" in p.stdout and "default" in p.stdout, f"{binary} --help", f"exit {p.returncode}")


if __name__ == "__main__":
    try:
        numpy_checks()
    except ImportError as e:
        skip("numpy vs torch fixture", f"needs numpy ({e})")
    cli_checks()
    print(f"{counts[0]} passed, {counts[1]} failed, {counts[2]} skipped")
    sys.exit(1 if counts[1] else 0)
