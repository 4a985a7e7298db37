"""Turns a CSV file into a linreg dataset (.bin, data/README.md) for ./train_linreg --data_file.

Every column but the target is a feature (at most 32). The rows are shuffled with --seed (unless --no_shuffle) and
the first --split of them become the training split.

  python3 scripts/csv_to_linreg.py data.csv out.bin [--target y] [--split 0.8] [--seed 0] [--no_shuffle]
"""
import argparse
import csv
import io
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import binio  # noqa: E402

MAX_FEATURES = 32
# a decimal number as a CSV holds it (float() alone also takes "1_000" and non-ASCII digits)
NUMBER = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*|\s*[+-]?(nan|inf|infinity)\s*", re.IGNORECASE | re.ASCII)


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    ap = binio.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv_file")
    ap.add_argument("out_file")
    ap.add_argument("--target", default=None, help="name of the target column (default: the last column)")
    ap.add_argument("--split", type=float, default=0.8, help="training fraction, in (0, 1) (default 0.8)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    ap.add_argument("--no_shuffle", action="store_true", help="keep the file's row order")
    args = ap.parse_args()
    if not 0.0 < args.split < 1.0:
        fail(f"--split must be in (0, 1), got {args.split}")
    if not 0 <= args.seed <= 2**31 - 1:
        fail(f"--seed must be in 0..2147483647, got {args.seed}")
    try:
        binio.check_output(args.out_file, "output file", inputs=[args.csv_file])
        text = binio.read_text(args.csv_file, "CSV file")
    except binio.FormatError as e:
        fail(str(e))
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        rows = list(reader)
    except csv.Error as e:
        fail(f"{args.csv_file}: line {reader.line_num}: {e}")
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if len(rows) < 3:
        fail(f"{args.csv_file}: expected a header line and at least 2 data rows, found {len(rows)} lines")
    header = [h.strip() for h in rows[0]]
    if len(header) < 2:
        fail(f"{args.csv_file}: expected at least 2 columns (features and target), found {len(header)}")
    target = header[-1] if args.target is None else args.target
    if target not in header:
        fail(f"{args.csv_file}: no column named {target!r} (columns: {', '.join(header)})")
    t = header.index(target)
    if len(header) - 1 > MAX_FEATURES:
        fail(f"{args.csv_file}: {len(header) - 1} features, at most {MAX_FEATURES} are supported")
    data = np.empty((len(rows) - 1, len(header)), dtype=np.float64)
    for i, r in enumerate(rows[1:]):
        if len(r) != len(header):
            fail(f"{args.csv_file}: line {i + 2} has {len(r)} fields, the header has {len(header)}")
        for j, cell in enumerate(r):
            try:
                if not NUMBER.fullmatch(cell):
                    raise ValueError(cell)
                v = float(cell)
            except ValueError:
                fail(f"{args.csv_file}: line {i + 2}, column {header[j]!r}: {cell!r} is not a number")
            if not math.isfinite(v) or abs(v) > 3.0e38:
                fail(f"{args.csv_file}: line {i + 2}, column {header[j]!r}: {cell!r} is not a finite float32")
            data[i, j] = v
    if not args.no_shuffle:
        data = data[np.random.default_rng(args.seed).permutation(len(data))]
    n = len(data)
    n_train = int(round(args.split * n))
    if not 1 <= n_train < n:
        fail(f"--split {args.split} of {n} rows leaves an empty training or test split")
    x = np.delete(data, t, axis=1).astype(np.float32)
    y = data[:, t].astype(np.float32)
    nan = float("nan")
    try:
        real = binio.write(args.out_file, binio.LINREG_DATASET,
                           {"n_points": n, "n_features": x.shape[1], "n_train": n_train, "seed": 0,
                            "w_true": nan, "b_true": nan, "noise_std": nan, "x_min": nan, "x_max": nan},
                           {"x": x, "y": y})
    except binio.FormatError as e:
        fail(str(e))
    print(f"wrote {args.out_file}{binio.written_note(args.out_file, real)}: {n} rows ({n_train} train), "
          f"{x.shape[1]} features, target {target!r}")

if __name__ == "__main__":
    binio.run_script(main)
