"""Runs every benchmark against PyTorch (GPU machine only) and leaves tables, CSV/JSON and charts in --out.

  python3 dev/run_benchmarks.py [--out bench_results] [--quick] [name ...]

--quick (used by `make gpu-check`) passes each benchmark its lighter flags so the whole GPU round stays within
10 minutes: fewer sizes, no sweeps, PyTorch eager only where torch.compile's compilation dominates, the UNet step of
ours alone (`make bench` runs PyTorch's modes beside it).
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = [  # (name, script in dev/, flags under --quick)
    ("linreg", "bench_linreg.py", ["--quick"]),
    ("mnist", "bench_mnist.py", ["--quick", "--epochs", "2"]),
    # ours only under --quick: PyTorch's first eager steps (cuDNN's autotuning) take about 50 s of the round
    ("unet", "bench_unet.py", ["--modes", "", "--batch_sizes", "32", "--precisions", "bf16", "--steps", "10"]),
    ("softmax", "softmax.py", ["--quick", "--no_sweep", "--no_compile"]),
    ("cnn_custom", "cnn_custom.py", ["--epochs", "1", "--modes", "torch,ours"]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--quick", action="store_true", help="each benchmark's lighter flags (make gpu-check)")
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    failures = []
    for name, script, quick_flags in BENCHMARKS:
        if args.names and name not in args.names:
            continue
        path = os.path.join(ROOT, "dev", script)
        if not os.path.exists(path):
            print(f"---- {name}: {script} not present, skipped")
            continue
        cmd = [sys.executable, path, "--out", args.out] + (quick_flags if args.quick else [])
        print(f"---- {name}: python3 dev/{script} {' '.join(cmd[2:])}", flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failures.append(name)
    if failures:
        print(f"benchmarks failed: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
