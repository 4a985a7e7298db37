"""Keeps the trainers' lines (and those of scripts/convert.py and its test) at most 120 columns (the ColumnLimit of the repository's .clang-format).

  python3 dev/test_style.py        (from anywhere; needs no build and no GPU)

Only these files are checked: several dev/ files still have longer lines.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["train_linreg.cu", "train_mnist.cu", "train_unet.cu", "scripts/convert.py", "dev/test_convert.py"]
LIMIT = 120


def main():
    passed = failed = 0
    for name in FILES:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            long_lines = [(i, len(l)) for i, l in enumerate(f.read().split("\n"), 1) if len(l) > LIMIT]
        if long_lines:
            failed += 1
            shown = ", ".join(f"{i} ({n} columns)" for i, n in long_lines[:10])
            more = f" and {len(long_lines) - 10} more" if len(long_lines) > 10 else ""
            print(f"FAIL {name}: {len(long_lines)} lines over {LIMIT} columns: line {shown}{more}")
        else:
            passed += 1
            print(f"PASS {name}: every line at most {LIMIT} columns")
    print(f"{passed} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
