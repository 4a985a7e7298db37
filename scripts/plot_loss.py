"""Draws the loss curve of a train_unet run from its log: <output_dir>/log.csv with the header
`step,loss,ms,images_per_s` (one row per logged step); several runs side by side with --log A --log B [--label ...].

  python3 scripts/plot_loss.py --log out/unet/log.csv --out loss.png [--smooth 0.9] [--title "..."]
  python3 scripts/plot_loss.py --log bf16/log.csv --log tf32/log.csv --label bf16 --label tf32 --out both.png

The PNG shows the logged losses (thin) and an exponential moving average (debiased as in Adam; --smooth -1, the
default, picks a time constant of 1/25 of the points, so a short log is not smeared; 0 = none), log-scaled y; the title gives the last step, the last smoothed loss and the median ms/step. Exits 1 with a message
naming the file and line on a missing file, a wrong header, a bad row or an empty log.
"""
import argparse
import csv
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import binio  # noqa: E402

HEADER = ["step", "loss", "ms", "images_per_s"]


def read_log(path):
    """-> dict column -> list of floats. Raises ValueError naming the file and line."""
    if os.path.isdir(path):
        path = os.path.join(path, "log.csv")
    try:
        text = binio.read_text(path, "log")
    except binio.FormatError as e:
        raise ValueError(str(e)) from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        rows = list(reader)
    except csv.Error as e:
        raise ValueError(f"{path}: line {reader.line_num}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: empty file, expected the header {','.join(HEADER)}")
    header = [h.strip() for h in rows[0]]
    if header != HEADER:
        raise ValueError(f"{path}: line 1: header is {','.join(header)}, expected {','.join(HEADER)}")
    cols = {h: [] for h in HEADER}
    for lineno, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(HEADER):
            raise ValueError(f"{path}: line {lineno}: {len(row)} fields, expected {len(HEADER)}")
        for h, c in zip(HEADER, row):
            try:
                cols[h].append(float(c))
            except ValueError:
                raise ValueError(f"{path}: line {lineno}: {h} is {c.strip()!r}, expected a number") from None
    if not cols["step"]:
        raise ValueError(f"{path}: no rows after the header")
    return cols


def smooth(values, beta):
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i) if beta > 0 else v)
    return out


def main(argv=None):
    p = binio.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--log", action="append", help="the trainer's log.csv (or its output_dir); repeat for several runs "
                   "(default: out/unet/log.csv)")
    p.add_argument("--label", action="append", help="a name per --log for the legend (default: the paths)")
    p.add_argument("--out", default="loss.png", help="PNG to write")
    p.add_argument("--smooth", type=float, default=-1, help="EMA factor in [0, 1); -1: auto, 1 - 25/points")
    p.add_argument("--title", default="", help="title prefix (default: the log's path)")
    args = p.parse_args(argv)
    if not (0 <= args.smooth < 1 or args.smooth == -1):  # NaN fails too
        sys.exit(f"error: --smooth must be in [0, 1) or -1 (auto), found {args.smooth}")
    logs = args.log or ["out/unet/log.csv"]
    if args.label and len(args.label) != len(logs):
        sys.exit(f"error: --label given {len(args.label)} times for {len(logs)} --log files")
    labels = args.label or logs
    try:
        sources = [os.path.join(p, "log.csv") if os.path.isdir(p) else p for p in logs]
        binio.check_output(args.out, "--out", inputs=sources)  # before the logs are read and drawn
        runs = [read_log(path) for path in logs]
    except ValueError as e:  # binio.FormatError is a ValueError
        sys.exit(f"error: {e}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    summary = []
    for k, (cols, label) in enumerate(zip(runs, labels)):
        steps, loss = cols["step"], cols["loss"]
        beta = args.smooth if args.smooth >= 0 else max(0.0, 1.0 - 25.0 / len(loss))
        smoothed = smooth(loss, beta)
        ms = sorted(cols["ms"])
        color = colors[k % len(colors)]
        name = label if len(runs) > 1 else "loss"
        ax.plot(steps, loss, lw=0.6, alpha=0.4, color=color, label=name)
        if beta > 0:
            ax.plot(steps, smoothed, lw=1.6, color=color, label=f"{name + ', ' if len(runs) > 1 else ''}EMA {beta:.3g}")
        summary.append(f"{label if len(runs) > 1 else args.title or label}: step {int(steps[-1])}, "
                       f"loss {smoothed[-1]:.4f}, median {ms[len(ms) // 2]:.1f} ms/step")
    if all(v > 0 for cols in runs for v in cols["loss"]):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss (epsilon)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    title = "\n".join(summary) if len(runs) > 1 else summary[0]
    ax.set_title((args.title + "\n" if args.title and len(runs) > 1 else "") + title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    try:
        real = binio.write_file(args.out, buf.getvalue(), "--out")
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}{binio.written_note(args.out, real)} ("
          + "; ".join(f"{len(c['step'])} points, steps {int(c['step'][0])}..{int(c['step'][-1])}" for c in runs) + ")")


if __name__ == "__main__":
    binio.run_script(main)
