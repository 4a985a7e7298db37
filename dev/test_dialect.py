"""The three trainers speak one dialect (issue 25, item 4): the same --device values, --help layout, flag errors,
no-GPU message, bad-file message, boxed start-up table, per-step log line and closing line.

  python3 dev/test_dialect.py        (from the repository root, after `make`; needs no GPU)

Each check runs the real binaries. The README's "Conventions" section describes what is checked here.
"""
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import binio  # noqa: E402

TRAINERS = ["train_linreg", "train_mnist", "train_unet"]
RULE = "+" + "-" * 23 + "+" + "-" * 46 + "+"
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}


def report(status, name, detail):
    counts[status] += 1
    print(f"{status} {name}: {detail}", flush=True)


def check(ok, name, detail):
    report("PASS" if ok else "FAIL", name, detail)


def run(trainer, args, timeout=300):
    p = subprocess.run([os.path.join(ROOT, trainer)] + args, cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout, p.stderr


def have_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def help_layout(trainer):
    code, out, _ = run(trainer, ["--help"])
    lines = out.splitlines()
    flags = [line for line in lines if line.startswith("  --")]
    bad = [line for line in flags if not (re.match(r"^  --help +this help$", line) or
                                          re.match(r"^  --[a-z0-9_]+ +\S.* \[[^\]]*\](  one of: [a-z0-9_,]+)?$", line))]
    check(code == 0 and lines[:1] == [f"usage: ./{trainer} [--flag value ...]"] and
          any(line.endswith("Flags (default in brackets):") for line in lines) and len(flags) > 10 and not bad,
          f"{trainer} --help layout", f"{len(flags)} flag lines" + (f", not in the layout: {bad[:2]}" if bad else ""))
    device = [line for line in flags if line.startswith("  --device ")]
    check(len(device) == 1 and device[0].endswith(" [auto]  one of: auto,cuda,cpu"), f"{trainer} --device in --help",
          device[0].strip() if device else "no --device line")


def flag_errors(trainer):
    cases = [
        (["--device", "gpu"], "error: flag --device expects one of auto,cuda,cpu, found 'gpu'"),
        (["--bogus", "1"], "error: unknown flag --bogus (see --help)"),
        (["stray"], "error: expected a flag like --name, found 'stray' (see --help)"),
        (["--seed"], "error: flag --seed expects a value, found none"),
        (["--seed", "abc"], "error: flag --seed expects an integer, found 'abc'"),
        (["--seed", "-1"], "error: flag --seed expects an integer in [0, "),
    ]
    for args, want in cases:
        code, out, err = run(trainer, args)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        check(code == 1 and len(lines) == 1 and lines[0].startswith(want), f"{trainer} {' '.join(args)}",
              f"exit {code}: {err.strip()[:150]}")


def no_gpu(trainer, tmp):
    """--device cuda on a machine without a GPU: one error line, the same in the three trainers."""
    extra = {"train_unet": ["--steps", "0", "--output_dir", os.path.join(tmp, "out")]}.get(trainer, [])
    if have_gpu():
        report("SKIP", f"{trainer} --device cuda without a GPU", "a GPU is present")
        return
    code, out, err = run(trainer, ["--device", "cuda"] + extra)
    check(code == 1 and re.match(r"^error: --device cuda but no CUDA device is available \(.+\)$", err.strip()),
          f"{trainer} --device cuda without a GPU", f"exit {code}: {err.strip()[:150]}")


def bad_magic(tmp):
    """A file of the wrong kind: 'error: <file>: header[0] magic is X, expected Y' from each trainer's reader."""
    path = os.path.join(tmp, "not_mine.bin")
    binio.write(path, binio.UNET_DATASET, dict(n_images=1, height=8, width=8, channels=3),
                {"images": np.zeros((1, 8, 8, 3), dtype=np.uint8)})
    runs = {
        "train_linreg": ["--device", "cpu", "--data_file", path],
        "train_mnist": ["--device", "cpu", "--eval_only", "1", "--load", path, "--test_limit", "10"],
        "train_unet": ["--load", path, "--steps", "0", "--output_dir", os.path.join(tmp, "out")],
    }
    for trainer, args in runs.items():
        code, out, err = run(trainer, args)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        ok = code == 1 and len(lines) == 1 and re.match(
            rf"^error: {re.escape(path)}: header\[0\] magic is 20260301, expected \d+", lines[0])
        check(bool(ok), f"{trainer}: a file of another kind", f"exit {code}: {err.strip()[:150]}")


def table_and_log(trainer, args, unit):
    """A short CPU run: the boxed table opens with the device row; log lines '<unit> N/TOTAL | train loss X | ...'
    and a closing 'final | ...' line."""
    code, out, err = run(trainer, args, timeout=600)
    lines = out.splitlines()
    rules = [i for i, line in enumerate(lines) if line == RULE]
    rows = lines[rules[0] + 1:rules[1]] if len(rules) >= 2 else []
    check(code == 0 and len(rows) > 5 and all(re.fullmatch(r"\| .{21} \| .{44,} \|", r) for r in rows) and
          rows[0].startswith("| device "), f"{trainer} start-up table", f"exit {code}, {len(rows)} rows"
          + (f", first: {rows[0]}" if rows else f": {err.strip()[:150]}"))
    logged = [line for line in lines if re.match(rf"^{unit} +\d+/\d+ \| train loss [0-9.]+( \||$)", line)]
    check(len(logged) > 0, f"{trainer} log line '{unit} N/TOTAL | train loss X | ...'",
          logged[-1] if logged else "no such line")
    check(bool(lines) and lines[-1].startswith("final | "), f"{trainer} closing line 'final | ...'",
          lines[-1] if lines else "no output")


def gpu_memory(tmp):
    """Each trainer's GPU memory on a GPU (issue 21, item 6): free / total in the start-up table, its use at the end."""
    if not have_gpu():
        report("SKIP", "GPU memory in the start-up table and at the end", "no GPU")
        return
    runs = {"train_linreg": ["--points", "2000", "--epochs", "30"],
            "train_mnist": ["--train_limit", "256", "--test_limit", "100", "--epochs", "1", "--confusion", "0"],
            "train_unet": ["--steps", "3", "--log_every", "1", "--save_every", "0", "--output_dir",
                           os.path.join(tmp, "unet_mem")]}
    for trainer, args in runs.items():
        code, out, err = run(trainer, args, timeout=600)
        row = re.search(r"^\| GPU memory free/total +\| (\d+) / (\d+) MiB +\|$", out, re.M)
        end = re.search(r"^GPU memory: (peak )?(\d+) MiB (used by this run|in use)", out, re.M)
        ok = code == 0 and row and end and 0 < int(row.group(1)) <= int(row.group(2)) and 0 < int(end.group(2))
        check(bool(ok), f"{trainer}: GPU memory free/total at start, its use at the end",
              f"exit {code}: {row.group(0) if row else 'no table row'}; {end.group(0) if end else 'no end line'}")


def main():
    missing = [t for t in TRAINERS if not os.path.isfile(os.path.join(ROOT, t))]
    if missing:
        report("FAIL", "binaries", f"{missing} not found (run make first)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for t in TRAINERS:
                help_layout(t)
                flag_errors(t)
                no_gpu(t, tmp)
            bad_magic(tmp)
            table_and_log("train_linreg", ["--device", "cpu", "--points", "2000", "--epochs", "30"], "epoch")
            table_and_log("train_mnist", ["--device", "cpu", "--train_limit", "256", "--test_limit", "100", "--epochs",
                                          "1", "--confusion", "0"], "epoch")
            code, out, err = run("train_unet", ["--device", "cpu"])
            check(code == 1 and err.startswith("error: --device cpu: ") and "scripts/generate.py" in err,
                  "train_unet --device cpu points to scripts/generate.py --device cpu", err.strip()[:150])
            report("SKIP", "train_unet start-up table and log line", "checked on a GPU by dev/test_unet_cli.py")
            gpu_memory(tmp)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
