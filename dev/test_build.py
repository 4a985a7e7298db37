"""The Makefiles' architecture lists, without building (make -n): train_mnist (and dev/test_mnist, dev/trace_mnist,
dev/matmul) keep the architecture-specific sm_90a target that their wgmma code needs whatever GENCODE the user
passes on the command line, or make says plainly that it cannot (issue 26, item 3); the other binaries keep sm_90.

  python3 dev/test_build.py        (from the repository root; needs make, not nvcc: nothing is compiled)
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}


def report(status, name, detail):
    counts[status] += 1
    print(f"{status} {name}: {detail}", flush=True)


def dry_run(folder, target, gencode=None):
    """-> (nvcc line for target, make's stderr)."""
    cmd = ["make", "-n", "-B", "-C", os.path.join(ROOT, folder), target]
    if gencode is not None:
        cmd.append(f"GENCODE={gencode}")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    lines = [line for line in p.stdout.splitlines() if line.startswith("nvcc") and f"-o {target} " in line]
    return (lines[0] if lines else f"(no nvcc line; exit {p.returncode}: {p.stderr.strip()[-200:]})"), p.stderr


def targets(line):
    """The real architectures an nvcc line builds: sm_XX names (-gencode code=..., -arch=sm_XX)."""
    return sorted(set(re.findall(r"sm_\d+a?", line)))


def check(name, folder, target, gencode, want, unwanted=(), warn=None):
    line, err = dry_run(folder, target, gencode)
    got = targets(line)
    missing = [w for w in want if w not in got]
    bad = [u for u in unwanted if u in got] + (["90aa"] if "90aa" in line else [])
    if warn and warn not in err:
        report("FAIL", name, f"make did not warn ({warn!r}) for GENCODE={gencode!r}: {err.strip()[-200:]}")
    elif missing or bad:
        report("FAIL", name, f"GENCODE={gencode!r}: {target} builds {got}, missing {missing}, unexpected {bad}: {line}")
    else:
        report("PASS", name, f"GENCODE={gencode!r}: {target} builds {got}" + (f"; warns: {warn}" if warn else ""))


def main():
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        report("SKIP", "make", "no make")
    else:
        default = None
        check("default list: train_mnist", ".", "train_mnist", default, [], ["sm_90"])
        check("command-line sm_90: train_mnist", ".", "train_mnist", "-gencode arch=compute_90,code=sm_90",
              ["sm_90a"], ["sm_90"])
        check("command-line sm_90 and sm_80: train_mnist", ".", "train_mnist",
              "-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90", ["sm_80", "sm_90a"],
              ["sm_90"])
        check("command-line sm_90a: train_mnist", ".", "train_mnist", "-gencode arch=compute_90a,code=sm_90a",
              ["sm_90a"], ["sm_90"])
        check("command-line -arch=sm_90: train_mnist", ".", "train_mnist", "-arch=sm_90", ["sm_90a"], ["sm_90"])
        check("command-line code=[sm_90,compute_90]: train_mnist", ".", "train_mnist",
              "-gencode arch=compute_90,code=[sm_90,compute_90]", ["sm_90a"], ["sm_90"])
        check("command-line sm_80 only: train_mnist", ".", "train_mnist", "-gencode arch=compute_80,code=sm_80",
              ["sm_80"], ["sm_90", "sm_90a"])
        check("command-line -arch=native: a plain warning", ".", "train_mnist", "-arch=native", [], [],
              warn="sm_90a")
        check("command-line sm_90: train_unet (bf16 on wgmma)", ".", "train_unet",
              "-gencode arch=compute_90,code=sm_90", ["sm_90a"], ["sm_90"])
        for target in ("test_mnist", "trace_mnist", "matmul", "conv2d", "test_unet"):
            check(f"command-line sm_90: dev/{target}", "dev", target, "-gencode arch=compute_90,code=sm_90",
                  ["sm_90a"], ["sm_90"])
        check("command-line sm_90: dev/softmax_forward keeps sm_90", "dev", "softmax_forward",
              "-gencode arch=compute_90,code=sm_90", ["sm_90"], ["sm_90a"])
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
