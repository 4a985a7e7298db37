"""Per-kernel account of one train_unet step under Nsight Compute: where the step's GPU time goes.

  python3 dev/ncu_account.py [--batch_size 32] [--precision bf16] [--optimizer adamw|muon] [--top 25] [--csv FILE]
                             [--save_csv FILE]

Runs `ncu --cache-control none --metrics gpu__time_duration.sum` on two eager steps of ./train_unet
(UNET_NO_GRAPH=1: ncu profiles launches, not graph replays; UNET_MUON_OVERLAP=0), keeps one step's kernels (from
after the first optimizer prologue through the second), and prints them grouped
by kernel (template arguments dropped) and by the groups of dev/unet_NOTES.md, in ms per step. ncu serialises kernels
and locks clocks, so the sum exceeds the graph's step time; the shares are what to read.
"""
import argparse
import csv
import io
import os
import re
import subprocess
import sys
from collections import defaultdict

GROUPS = [
    ("GroupNorm forward", r"gn_stats_finalize|gn_apply|chan_reduce_kernel<0"),
    ("GroupNorm backward", r"gn_bwd|chan_reduce_kernel<1"),
    ("bias / embedding gradient sums", r"chan_reduce_kernel<2|sums_finalize"),
    ("3x3 conv forward + backward-data (wgmma)", r"conv_wgmma_kernel<0"),
    ("3x3 conv weight gradient (wgmma)", r"conv_wgmma_kernel<1"),
    ("split-K sums", r"wgrad_reduce|conv_splitk_epilogue"),
    ("thin convolutions", r"conv_thin"),
    ("attention", r"attn_|softmax"),
    ("Muon (momentum, norms, polynomial; its products are library kernels)", r"muon_"),
    ("AdamW + bf16 weight copies", r"adam|weights_to_bf16"),
    ("time embedding", r"emb_layers|timestep_embedding|silu_kernel|silu_backward"),
    ("elementwise (add, concat, split, upsample, dilate)", r"add_kernel|add_bias|concat|split_backward|upsample|dilate"),
    ("cuBLAS and other library kernels", r"gemm|Kernel|cublas|cutlass|sm90_|splitKreduce"),
]


def short(name):
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        if depth == 0 or (depth == 1 and ch == "<"):
            out.append(ch)
        if ch == ">":
            depth -= 1
    s = "".join(out).split("(")[0]
    return re.sub(r"^void ", "", s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--optimizer", default="adamw", help="muon: its Newton-Schulz products land in the library group")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--csv", help="read this ncu CSV instead of running ncu")
    ap.add_argument("--save_csv", help="also write ncu's CSV here")
    a = ap.parse_args()
    if a.csv:
        text = open(a.csv).read()
    else:
        cmd = ["ncu", "--cache-control", "none", "--metrics", "gpu__time_duration.sum", "--csv", "./train_unet",
               "--steps", "2", "--batch_size", str(a.batch_size), "--precision", a.precision, "--optimizer", a.optimizer,
               "--log_every", "1",
               "--save_every", "0", "--output_dir", "/tmp/ncu_account"]
        env = dict(os.environ, UNET_NO_GRAPH="1", UNET_MUON_OVERLAP="0")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: ncu exited {proc.returncode}:\n{proc.stdout[-2000:]}")
        text = proc.stdout
        if a.save_csv:
            with open(a.save_csv, "w") as f:
                f.write(text)
    rows = [r for r in csv.DictReader(io.StringIO(text[text.find('"ID"'):])) if r.get("Metric Name") ==
            "gpu__time_duration.sum"]
    if not rows:
        sys.exit("error: no kernel rows in the ncu output")
    # one step: the kernels after the first step's optimizer prologue (adam_prep, which AdamW and Muon both launch
    # first) up to and including the second's: the first step's update, then the second's forward and backward
    ids = [int(r["ID"]) for r in rows]
    adam = [i for i, r in enumerate(rows) if "adam_prep_kernel" in r["Kernel Name"]]
    if len(adam) < 2:
        sys.exit("error: fewer than two optimizer steps (adam_prep_kernel) in the ncu output")
    half = adam[0] + 1
    step = rows[half:adam[1] + 1]
    unit = step[0]["Metric Unit"]
    scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}[unit]
    per_kernel = defaultdict(lambda: [0.0, 0])
    for r in step:
        k = short(r["Kernel Name"])
        per_kernel[k][0] += float(r["Metric Value"].replace(",", "")) * scale
        per_kernel[k][1] += 1
    total = sum(v[0] for v in per_kernel.values())
    print(f"train_unet --batch_size {a.batch_size} --precision {a.precision} --optimizer {a.optimizer}: {len(step)} kernels, {total:.2f} ms "
          f"per step under ncu (ncu ids {ids[half]}..{ids[adam[1]]})")
    print(f"{'kernel':60s} {'launches':>8s} {'ms':>8s} {'share':>6s}")
    for k, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{k[:60]:60s} {n:8d} {ms:8.3f} {100 * ms / total:5.1f}%")
    groups = defaultdict(lambda: [0.0, 0])
    for r in step:
        name = r["Kernel Name"]
        g = next((g for g, pat in GROUPS if re.search(pat, name)), "other")
        groups[g][0] += float(r["Metric Value"].replace(",", "")) * scale
        groups[g][1] += 1
    print(f"\n{'group':60s} {'launches':>8s} {'ms':>8s} {'share':>6s}")
    for g, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{g[:60]:60s} {n:8d} {ms:8.3f} {100 * ms / total:5.1f}%")


if __name__ == "__main__":
    main()
