"""Draws the linear-regression benchmark (dev/bench_linreg.py's linreg.json) as two PNG charts:
linreg_sweep.png (time of 200 epochs against the number of points, log-log) and linreg_breakdown.png (one epoch
at 5M points, per operation, fused against unfused).

  python3 scripts/plot_linreg.py bench_results/linreg.json [--out bench_results]
"""
import argparse
import io
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import binio  # noqa: E402



def main():
    ap = binio.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json_file")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not os.path.isdir(args.out):
        what = "not a directory" if os.path.exists(args.out) else "does not exist"
        sys.exit(f"error: --out {args.out}: {what} (the folder for linreg_sweep.png and linreg_breakdown.png)")
    outs = [os.path.join(args.out, n) for n in ("linreg_sweep.png", "linreg_breakdown.png")]
    try:
        for o in outs:
            binio.check_output(o, "--out")
        text = binio.read_text(args.json_file, "JSON file")
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    try:
        r = json.loads(text)
        draw(r, outs)
    except json.JSONDecodeError as e:
        sys.exit(f"error: {args.json_file}: not JSON: {e}")
    except binio.FormatError as e:  # writing a chart (a ValueError too: caught first)
        sys.exit(f"error: {e}")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        sys.exit(f"error: {args.json_file}: not a bench_linreg.py result ({type(e).__name__}: {e}; expected "
                 "keys rows, epochs, gpu, date, breakdown_us)")
    print(f"wrote {outs[0]} and linreg_breakdown.png")


def save(fig, path):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    binio.write_file(path, buf.getvalue(), "--out")


def draw(r, outs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = r["rows"]
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"rows is {rows!r}, expected a non-empty list")
    n = [row["points"] for row in rows]
    series = [("torch_cpu_ms", "PyTorch CPU"), ("torch_eager_ms", "PyTorch eager (GPU)"),
              ("torch_compile_ms", "torch.compile (GPU)"), ("ours_v1_ms", "ours v1 unfused"),
              ("ours_v2_ms", "ours v2 fused"), ("ours_v3_ms", "ours v3 streams"), ("ours_v4_ms", "ours v4 persistent")]
    for i, row in enumerate(rows):  # log axes drop a point <= 0 or NaN without a word: refuse it instead
        for key in ["points"] + [k for k, _ in series if row.get(k) is not None]:
            v = row[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"rows[{i}].{key} is {v!r}, expected a number > 0")
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, label in series:
        pts = [(a, row[key]) for a, row in zip(n, rows) if row.get(key)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("points (80% train)")
    ax.set_ylabel(f"ms for {r['epochs']} epochs")
    ax.set_title(f"Linear regression, full-batch GD: {r['gpu']}, {r['date']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, outs[0])

    b = r["breakdown_us"]
    fig, ax = plt.subplots(figsize=(7, 4))
    parts = [("forward", b["forward"]), ("loss", b["loss"]), ("gradient", b["gradient"]), ("update", b["update"])]
    left = 0.0
    for name, t in parts:
        ax.barh(["unfused (v1)"], [t], left=left, label=name)
        left += t
    ax.barh(["fused (v2)"], [b["fused"]], label="forward+loss+gradient fused")
    ax.barh(["fused (v2)"], [b["update"]], left=b["fused"], label="update (v2)")
    ax.set_xlabel("us per epoch at 5M points (4M train)")
    ax.set_title("One epoch, per operation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, outs[1])


if __name__ == "__main__":
    binio.run_script(main)
