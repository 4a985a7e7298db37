"""Draws the softmax row-length sweep written by dev/softmax.py: GB/s against row length, forward and backward,
one line per implementation, the device copy bandwidth as a dashed line.

  python3 scripts/plot_softmax.py [--csv bench_results/softmax_sweep.csv] [--copy_gbps 2900] [--out FILE.png]
"""
import argparse
import csv
import io
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import binio  # noqa: E402


def main():
    ap = binio.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default="bench_results/softmax_sweep.csv", help="sweep CSV (default bench_results/softmax_sweep.csv)")
    ap.add_argument("--copy_gbps", type=float, default=0.0, help="copy bandwidth to draw, GB/s (default 0: none)")
    ap.add_argument("--out", default="bench_results/softmax_sweep.png", help="PNG to write (default bench_results/softmax_sweep.png)")
    args = ap.parse_args()
    if not (math.isfinite(args.copy_gbps) and args.copy_gbps >= 0):
        print(f"error: --copy_gbps must be a bandwidth >= 0, got {args.copy_gbps}", file=sys.stderr)
        return 1
    try:
        binio.check_output(args.out, "--out")
        text = binio.read_text(args.csv, "--csv")
    except binio.FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        rows = list(reader)
    except csv.Error as e:
        print(f"error: {args.csv}: line {reader.line_num}: {e}", file=sys.stderr)
        return 1
    need = {"op", "cols", "impl", "gbps"}
    if not rows or not need <= set(rows[0]):
        print(f"error: {args.csv} needs columns {sorted(need)} and at least one row", file=sys.stderr)
        return 1
    series = defaultdict(list)  # (op, impl) -> [(cols, gbps)]
    for line, r in enumerate(rows, start=2):
        try:
            cols, gbps = int(r["cols"]), float(r["gbps"])
        except (TypeError, ValueError):
            print(f"error: {args.csv}: line {line}: cols {r['cols']!r} and gbps {r['gbps']!r} must be numbers",
                  file=sys.stderr)
            return 1
        if cols < 1 or not (math.isfinite(gbps) and gbps >= 0):  # a log axis drops them without a word
            print(f"error: {args.csv}: line {line}: cols {cols} must be >= 1 and gbps {gbps} a bandwidth >= 0",
                  file=sys.stderr)
            return 1
        series[(r["op"], r["impl"])].append((cols, gbps))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, op in zip(axes, ("forward", "backward")):
        for (o, impl), pts in sorted(series.items()):
            if o != op:
                continue
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        if args.copy_gbps > 0:
            ax.axhline(args.copy_gbps, ls="--", color="gray", label=f"copy {args.copy_gbps:.0f} GB/s")
            ax.axhline(0.9 * args.copy_gbps, ls=":", color="gray", label="90% of copy")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("row length (floats); rows = 2^25 / row length")
        ax.set_title(f"softmax {op} (fp32)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("GB/s (forward 2*N*4 bytes, backward 3*N*4)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    try:
        real = binio.write_file(args.out, buf.getvalue(), "--out")
    except binio.FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}{binio.written_note(args.out, real)}")
    return 0


if __name__ == "__main__":
    binio.run_script(main)
