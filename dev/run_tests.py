"""Runs every test suite of the project and prints one closing line: N passed, N failed, N skipped.

Suites are discovered (run from the repository root):
  dev/test_*.cu  -> ./dev/test_X            (a trainer test: includes the trainer with TESTING)
  dev/<op>.cu    -> ./dev/<op> --test       (a kernel lab file: every version against its CPU oracle)
  dev/test_*.py  -> python3 dev/test_X.py   (scripts, command lines, bad inputs, references)
Each suite prints PASS/FAIL/SKIP lines and, last, its own "N passed, N failed, N skipped"; a suite that exits
non-zero or prints no such line counts as one failure. GPU checks skip themselves where there is no GPU.
Usage: python3 dev/run_tests.py [-j N] [substring ...]   (only suites whose name contains a substring)
  -j N: N suites at a time (default 1); each suite's output is printed whole when it ends, under a line with its
        time. `make gpu-check` runs 8 at a time to stay within 10 minutes (suites write to their own temporary folders).
"""
import concurrent.futures
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOSING = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped$")
TIMEOUT_S = 900
# Started first under -j N so that the longest suites (on the H100: 150-305 s each) do not begin last
SLOW_FIRST = ["dev/test_fuzz.py", "dev/test_unet.cu", "dev/test_torch_ops.py", "dev/test_mnist.cu",
              "dev/test_unet_cli.py", "dev/test_mnist_cli.py", "dev/conv2d.cu", "dev/matmul.cu"]


def discover():
    suites = []
    for name in sorted(os.listdir(os.path.join(ROOT, "dev"))):
        stem, ext = os.path.splitext(name)
        if ext == ".cu":
            cmd = [f"./dev/{stem}"] if stem.startswith("test_") else [f"./dev/{stem}", "--test"]
            suites.append((f"dev/{name}", cmd))
        elif ext == ".py" and stem.startswith("test_"):
            suites.append((f"dev/{name}", [sys.executable, f"dev/{name}"]))
    return suites


def run_suite(name, cmd):
    """-> (output, exit code, seconds)."""
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
        output, code = proc.stdout, proc.returncode
    except FileNotFoundError:
        output, code = f"FAIL {name}: {cmd[0]} not found (run make first)\n", 127
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output, code = out + f"\nFAIL {name}: timed out after {TIMEOUT_S} s\n", -1
    return output, code, time.time() - t0


def main():
    args = sys.argv[1:]
    jobs = 1
    if args[:1] == ["-j"] and len(args) > 1 and args[1].isdigit() and int(args[1]) > 0:
        jobs, args = int(args[1]), args[2:]
    elif args[:1] == ["-j"]:
        print("error: -j takes a positive number of suites to run at a time")
        return 2
    wanted = args
    suites = [s for s in discover() if not wanted or any(w in s[0] for w in wanted)]
    suites.sort(key=lambda s: SLOW_FIRST.index(s[0]) if s[0] in SLOW_FIRST else len(SLOW_FIRST))
    totals = [0, 0, 0]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_suite, name, cmd): (name, cmd) for name, cmd in suites}
        for fut in concurrent.futures.as_completed(futures):
            name, cmd = futures[fut]
            output, code, secs = fut.result()
            print(f"==== {name}: {' '.join(cmd)} ({secs:.1f} s)", flush=True)
            sys.stdout.write(output if output.endswith("\n") or not output else output + "\n")
            lines = [l.strip() for l in output.strip().splitlines()]
            match = CLOSING.match(lines[-1]) if lines else None
            counts = [int(g) for g in match.groups()] if match else [0, 0, 0]
            if code != 0 and counts[1] == 0:
                counts[1] += 1  # a crash, or a failure the suite did not count
                print(f"FAIL {name}: exit code {code} with no failed check counted")
            elif not match:
                counts[1] += 1
                print(f"FAIL {name}: no closing 'N passed, N failed, N skipped' line")
            for i in range(3):
                totals[i] += counts[i]
            results[name] = (counts, secs)
    rows = [(name,) + results[name] for name, _ in suites]
    print("\n==== summary")
    for name, (p, f, s), secs in rows:
        print(f"{'FAIL' if f else 'ok  '} {name:32s} {p:4d} passed {f:4d} failed {s:4d} skipped  {secs:7.1f} s")
    if not suites:
        print("FAIL no test suites found")
        totals[1] += 1
    print(f"{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
    return 1 if totals[1] else 0


if __name__ == "__main__":
    sys.exit(main())
