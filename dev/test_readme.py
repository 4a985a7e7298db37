"""Keeps the README true to the binaries: every flag that `./train_<model> --help` prints is in the flag table of
that trainer's README section with the same default, and every flag the table names is one the binary knows; the
same for scripts/convert.py's flags and its section.

  python3 dev/test_readme.py        (from the repository root, after `make`; needs no GPU)

A trainer that is not built is a failure (CI builds them all before running the tests).
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ["train_linreg", "train_mnist", "train_unet"]

results = []


def check(name, ok, detail):
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")


def help_flags(binary):
    """flag -> default string ('' when the help shows none) from `binary --help`."""
    p = subprocess.run([binary, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"--help exited {p.returncode}: {(p.stdout + p.stderr)[-500:]}")
    flags = {}
    for line in p.stdout.splitlines():
        m = re.match(r"\s+--([a-z0-9_]+)\s+(.*)$", line)
        if not m:
            continue
        d = re.search(r"\[([^\]]*)\]", m.group(2))
        value = d.group(1).strip() if d else ""
        flags[m.group(1)] = "" if value == '""' else value  # an empty string default printed as ""
    return flags


def readme_section(text, trainer):
    """The README text from '## <trainer>' to the next '## ' heading."""
    m = re.search(rf"^## {trainer}\b.*?(?=^## )", text, flags=re.S | re.M)
    return m.group(0) if m else ""


def table_rows(section):
    """flag -> (row text, default cell) for every row of the section's flag table that starts with a flag."""
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`--([a-z0-9_]+)", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")] if len(cells) > 1 else []
        for i, n in enumerate(names):
            # a row naming several flags lists their defaults in the same order, comma-separated
            rows[n] = (line, defaults[i] if len(defaults) == len(names) else cells[1] if len(cells) > 1 else "")
    return rows


def same_default(help_default, readme_default):
    if help_default == readme_default:
        return True
    try:  # 0.0005 vs 5e-4, 1 vs 1.0
        return float(help_default) == float(readme_default)
    except ValueError:
        return False


def check_convert(text):
    """scripts/convert.py: every flag of its parser in the flag table of its README section, with the default."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import convert
    flags = {a.option_strings[0][2:]: "" if a.default is None else str(a.default)
             for a in convert.build_parser()._actions if a.option_strings and a.option_strings[0] != "-h"}
    m = re.search(r"^## Weights to and from PyTorch \(`scripts/convert.py`\).*?(?=^## )", text, flags=re.S | re.M)
    check("convert.py README section", bool(m), "found" if m else "no '## Weights to and from PyTorch' heading")
    rows = table_rows(m.group(0) if m else "")
    missing = [f for f in flags if f not in rows]
    stale = [f for f in rows if f not in flags]
    wrong = [f"--{f} parser [{d}] README [{rows[f][1]}]" for f, d in flags.items()
             if f in rows and not same_default(d, rows[f][1])]
    check("convert.py flags in README", not missing and not stale and not wrong,
          f"all {len(flags)} flags with their defaults" if not (missing or stale or wrong) else
          f"missing {missing}, unknown {stale}, defaults {wrong}")


def main():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    check_convert(text)
    for trainer in TRAINERS:
        binary = os.path.join(ROOT, trainer)
        if not os.path.exists(binary):
            check(f"{trainer} built", False, f"{binary} not found (run make first)")
            continue
        try:
            flags = help_flags(binary)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            check(f"{trainer} --help", False, str(e))
            continue
        check(f"{trainer} --help", len(flags) > 0, f"{len(flags)} flags")
        section = readme_section(text, trainer)
        check(f"{trainer} README section", bool(section), f"'## {trainer}' heading found" if section else "no heading")
        rows = table_rows(section)
        missing = [f for f in flags if f not in rows]
        check(f"{trainer} flags in README", not missing,
              f"all {len(flags)} in the flag table" if not missing else f"missing: {', '.join('--' + f for f in missing)}")
        stale = [f for f in rows if f not in flags]
        check(f"{trainer} README flags known", not stale,
              f"all {len(rows)} table flags known to --help" if not stale else f"unknown: {', '.join('--' + f for f in stale)}")
        wrong = []
        for f, d in flags.items():
            if f in rows and d and not same_default(d, rows[f][1]):
                wrong.append(f"--{f} help [{d}] README [{rows[f][1]}]")
        check(f"{trainer} defaults", not wrong, "every default matches" if not wrong else "; ".join(wrong))
    n_fail = results.count(False)
    print(f"{results.count(True)} passed, {n_fail} failed, 0 skipped")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
