"""Compares a trainer's device code between two git revisions, kernel by kernel: SASS and ptxas's resource report.

For a change that should not alter what runs on the GPU (code moved, a kernel split into inlined phases), this says
whether it did. Each revision's file is compiled on its own (nvcc -cubin, the Makefile's flags, one target at a time)
and disassembled with cuobjdump; functions are matched by their mangled name (the order in the cubin follows the
order in the source, so it is ignored), instruction addresses and encodings dropped (--strict keeps the encodings:
the scheduling bits too). The ptxas report (-Xptxas -v: registers, barriers, shared memory, stack, spills) is
compared per function as well. Needs no GPU; cuobjdump and nvdisasm from the CUDA toolkit (or the PyPI packages
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm: point CUOBJDUMP at the binary, or put it on PATH).

Usage (from anywhere in the repository):
  python3 dev/sass_compare.py REV_A REV_B [--file train_mnist.cu] [--arch sm_90a] [--arch sm_80]
                              [--variant plain] [--variant MNIST_TRACE] [--strict] [--keep DIR] [--cache DIR] [-j N]
  REV: a git revision, or WORKTREE for the file as it is on disk.
  --arch: default sm_90a and sm_80 (the targets the Makefile builds train_mnist for where no GPU is present).
  --variant: plain, or a macro NAME for a build with -DNAME (default: plain and MNIST_TRACE, dev/trace_mnist's).
  --cache: reuse the SASS and report of a build with the same source, command and nvcc (one compiled side instead of
           two when comparing a series of edits against one revision).
Prints one line per target and variant, the functions that differ with the first lines of their diff, and exits 1
if anything differs (0 when every function's SASS and report are identical).
"""
import argparse
import concurrent.futures
import difflib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=os.path.dirname(os.path.abspath(__file__)),
                      stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
NVCCFLAGS = ["-O3", "-std=c++17", "-lineinfo"]  # as the Makefile's NVCCFLAGS
FUNC = re.compile(r"^\s*Function : (\S+)")
INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*(/\* (0x[0-9a-f]{16}) \*/)?\s*$")
ENCODING = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
PTXAS_FUNC = re.compile(r"ptxas info\s*: (?:Compiling entry function '([^']+)'|Function properties for (\S+))")


def find_tool(name, env):
    path = os.environ.get(env) or shutil.which(name)
    for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if not path and d and os.path.exists(os.path.join(d, "bin", name)):
            path = os.path.join(d, "bin", name)
    if not path:
        sys.exit(f"error: {name} not found (set {env}, or put it on PATH; without the full CUDA toolkit: "
                 f"pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return path


def source_at(rev, path, dst):
    if rev == "WORKTREE":
        shutil.copyfile(os.path.join(ROOT, path), dst)
        return
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        sys.exit(f"error: git show {rev}:{path}: {proc.stderr.decode().strip()}")
    with open(dst, "wb") as f:
        f.write(proc.stdout)


def compile_and_disassemble(src, arch, define, out_dir, cuobjdump, cache):
    """nvcc -cubin (with the ptxas report) and cuobjdump -sass; returns (report text, SASS text)."""
    os.makedirs(out_dir, exist_ok=True)
    cubin = os.path.join(out_dir, "out.cubin")
    virt = arch.replace("sm_", "compute_")
    cmd = ["nvcc", *NVCCFLAGS, "-gencode", f"arch={virt},code={arch}", "-cubin", "-Xptxas", "-v", "-o", cubin, src]
    if define:
        cmd.insert(1, f"-D{define}")
    key = None
    if cache:
        nvcc = subprocess.run(["nvcc", "--version"], stdout=subprocess.PIPE, text=True).stdout
        with open(src, "rb") as f:
            key = hashlib.sha256(f.read() + " ".join(cmd[:-3]).encode() + nvcc.encode()).hexdigest()[:24]
        hit = os.path.join(cache, key)
        if os.path.exists(os.path.join(hit, "out.sass")):
            for name in ("ptxas.txt", "out.sass"):
                shutil.copyfile(os.path.join(hit, name), os.path.join(out_dir, name))
            with open(os.path.join(hit, "ptxas.txt")) as f, open(os.path.join(hit, "out.sass")) as g:
                return f.read(), g.read()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stdout[-3000:]}")
    sass = subprocess.run([cuobjdump, "-sass", cubin], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if sass.returncode != 0:
        sys.exit(f"error: cuobjdump -sass {cubin}: {sass.stderr.strip()}")
    for d in [out_dir] + ([os.path.join(cache, key)] if key else []):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "ptxas.txt"), "w") as f, open(os.path.join(d, "out.sass"), "w") as g:
            f.write(proc.stdout)
            g.write(sass.stdout)
    return proc.stdout, sass.stdout


def build(src, arch, define, out_dir, cuobjdump, cache):
    """Compiles src for one target; returns ({function: [instruction lines]}, {function: [report lines]})."""
    ptxas, sass = compile_and_disassemble(src, arch, define, out_dir, cuobjdump, cache)
    report, cur = {}, None
    for line in ptxas.splitlines():
        m = PTXAS_FUNC.search(line)
        if m:
            cur = m.group(1) or m.group(2)
            report.setdefault(cur, [])
            continue
        if cur and ("bytes stack frame" in line or "ptxas info    : Used" in line):
            report[cur].append(line.replace("ptxas info    :", "").strip())
    funcs, cur = {}, None
    for line in sass.splitlines():
        m = FUNC.match(line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        if cur is None:
            continue
        m = INSTR.match(line)
        if m:
            funcs[cur].append([m.group(1), m.group(3) or ""])
            continue
        m = ENCODING.match(line)
        if m and funcs[cur]:
            funcs[cur][-1][1] += " " + m.group(1)  # the instruction's second 64-bit word
    return funcs, report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--file", default="train_mnist.cu", help="the trainer, relative to the repository root")
    ap.add_argument("--arch", action="append", help="sm_XX target (repeatable; default sm_90a and sm_80)")
    ap.add_argument("--variant", action="append", help="plain, or NAME: built with -DNAME (repeatable)")
    ap.add_argument("--strict", action="store_true", help="also compare the instruction encodings (control bits)")
    ap.add_argument("--keep", help="keep the cubins, SASS and ptxas reports in this folder")
    ap.add_argument("--cache", help="reuse builds of identical sources from this folder (and add to it)")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1, help="parallel compilations")
    args = ap.parse_args()
    archs = args.arch or ["sm_90a", "sm_80"]
    variants = ["" if v == "plain" else v for v in (args.variant or ["plain", "MNIST_TRACE"])]
    cuobjdump = find_tool("cuobjdump", "CUOBJDUMP")
    work = args.keep or tempfile.mkdtemp(prefix="sass_compare_")
    srcs = {}
    for side, rev in (("a", args.rev_a), ("b", args.rev_b)):
        os.makedirs(os.path.join(work, side), exist_ok=True)
        srcs[side] = os.path.join(work, side, os.path.basename(args.file))
        source_at(rev, args.file, srcs[side])
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.j)) as pool:
        for arch in archs:
            for var in variants:
                for side in ("a", "b"):
                    out = os.path.join(work, side, f"{arch}{'-' + var if var else ''}")
                    jobs[(arch, var, side)] = pool.submit(build, srcs[side], arch, var, out, cuobjdump, args.cache)
    differ = 0
    for arch in archs:
        for var in variants:
            (fa, ra), (fb, rb) = jobs[(arch, var, "a")].result(), jobs[(arch, var, "b")].result()
            label = f"{arch}{' -D' + var if var else ''}"
            bad = []
            for name in sorted(set(fa) | set(fb)):
                if name not in fa or name not in fb:
                    bad.append((name, f"only in {args.rev_a if name in fa else args.rev_b}", []))
                    continue
                key = (lambda i: f"{i[0]}  {i[1]}") if args.strict else (lambda i: i[0])
                la, lb = [key(i) for i in fa[name]], [key(i) for i in fb[name]]
                if la != lb:
                    diff = list(difflib.unified_diff(la, lb, args.rev_a, args.rev_b, n=1, lineterm=""))
                    bad.append((name, f"SASS differs ({len(la)} vs {len(lb)} instructions)", diff[:24]))
            for name in sorted(set(ra) | set(rb)):
                if ra.get(name) != rb.get(name):
                    bad.append((name, "ptxas report differs", [f"- {l}" for l in ra.get(name, [])] +
                                [f"+ {l}" for l in rb.get(name, [])]))
            n_instr = sum(len(v) for v in fa.values())
            print(f"{'ok  ' if not bad else 'DIFF'} {label}: {len(fa)} vs {len(fb)} functions, {n_instr} instructions"
                  f"{' (with encodings)' if args.strict else ''}, {len(ra)} ptxas reports; {len(bad)} differing")
            for name, why, lines in bad:
                print(f"  {name}: {why}")
                for l in lines:
                    print(f"      {l}")
            differ += len(bad)
    if args.keep:
        print(f"cubins, SASS and ptxas reports kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print("identical" if not differ else f"{differ} differences")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
