"""Runs every benchmark against PyTorch (GPU machine only) and leaves tables, CSV/JSON and charts in --out.

  python3 dev/run_benchmarks.py [--out bench_results] [name ...]
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = [  # (name, script in dev/)
    ("linreg", "bench_linreg.py"),
    ("mnist", "bench_mnist.py"),
    ("unet", "bench_unet.py"),
    ("softmax", "softmax.py"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    failures = []
    for name, script in BENCHMARKS:
        if args.names and name not in args.names:
            continue
        path = os.path.join(ROOT, "dev", script)
        if not os.path.exists(path):
            print(f"---- {name}: {script} not present, skipped")
            continue
        print(f"---- {name}: python3 dev/{script} --out {args.out}", flush=True)
        if subprocess.run([sys.executable, path, "--out", args.out], cwd=ROOT).returncode != 0:
            failures.append(name)
    if failures:
        print(f"benchmarks failed: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
