"""Draws the softmax row-length sweep written by dev/softmax.py: GB/s against row length, forward and backward,
one line per implementation, the device copy bandwidth as a dashed line.

  python3 scripts/plot_softmax.py [--csv bench_results/softmax_sweep.csv] [--copy_gbps 2900] [--out FILE.png]
"""
import argparse
import csv
import sys
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default="bench_results/softmax_sweep.csv", help="sweep CSV (default bench_results/softmax_sweep.csv)")
    ap.add_argument("--copy_gbps", type=float, default=0.0, help="copy bandwidth to draw, GB/s (default 0: none)")
    ap.add_argument("--out", default="bench_results/softmax_sweep.png", help="PNG to write (default bench_results/softmax_sweep.png)")
    args = ap.parse_args()
    try:
        with open(args.csv, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        print(f"error: cannot read --csv {args.csv}: {e.strerror}", file=sys.stderr)
        return 1
    need = {"op", "cols", "impl", "gbps"}
    if not rows or not need <= set(rows[0]):
        print(f"error: {args.csv} needs columns {sorted(need)} and at least one row", file=sys.stderr)
        return 1
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(list)  # (op, impl) -> [(cols, gbps)]
    for r in rows:
        series[(r["op"], r["impl"])].append((int(r["cols"]), float(r["gbps"])))
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
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
