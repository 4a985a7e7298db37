#!/usr/bin/env bash
# Issue 23 on N GPUs of one machine (N = 2 or 4, the first argument; default 2), from the repository root; logs in
# $OUT (default /tmp/nccl_out). Ranks are started by hand with torchrun's variables (OpenMPI's for the ZeRO-1 run,
# which also passes the NCCL id through a file), as background processes. About 4-6 minutes.
#   A  50 steps at a global batch of 32*N, --precision fp32: 1 GPU vs N GPUs (per-step losses), and N GPUs twice
#      (bit-identical losses and step-50 checkpoints)
#   B  --zero 1 (OpenMPI variables, --nccl_id_file): the same losses as A's N-GPU run, and the memory lines
#   C  throughput at --batch_size 32 per GPU (bf16, the default): 1 GPU, N GPUs (buckets), N GPUs UNET_BUCKET_MB=0
#   D  kill one rank (SIGKILL) mid-run: the others end with an error within --nccl_timeout 20 s (limit 60 s); the
#      last checkpoint resumes on 1 GPU and on N/2 GPUs (other worlds) and continues to the uninterrupted N-GPU
#      run's losses
set -o pipefail
N=${1:-2}
OUT=${OUT:-/tmp/nccl_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*"; }
date -u
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
make nccl-info
make train_unet > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
# E (at the end): one GPU, this build against the trainer before issue 23 (commit 28654bf, or BASE_CU=file):
# the same checkpoint bit for bit. Its build runs on the CPU while the GPU runs A-D.
BASE_CU=${BASE_CU:-/tmp/nc_base.cu}
[ -f "$BASE_CU" ] || git show 28654bf:train_unet.cu > "$BASE_CU" 2> /dev/null || rm -f "$BASE_CU"
if [ -s "$BASE_CU" ]; then
    nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90a,code=sm_90a -o /tmp/nc_base "$BASE_CU" -lcublas \
        -lcurand > "$OUT/build_base.log" 2>&1 &
    BASE_PID=$!
fi
el "build ok; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
PORT=$((29500 + RANDOM % 2000))

# run NAME NPROC ARGS...: NPROC ranks (torchrun's variables; NPROC 1: a plain single-GPU run), waits for all,
# prints each rank's exit code and the closing lines of rank 0
run() {
    local name=$1 n=$2 r
    shift 2
    local pids=()
    PORT=$((PORT + 1))
    if [ "$n" = 1 ]; then
        ./train_unet "$@" > "$OUT/$name.r0.log" 2>&1 &
        pids+=($!)
    else
        for r in $(seq 0 $((n - 1))); do
            RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
                ./train_unet "$@" > "$OUT/$name.r$r.log" 2>&1 &
            pids+=($!)
        done
    fi
    local codes=""
    for r in "${!pids[@]}"; do
        wait "${pids[$r]}"
        codes="$codes r$r=$?"
    done
    el "$name: exit$codes"
    grep -E "^error|GPU memory|^final|state per GPU|gradients  " "$OUT/$name.r0.log" | sed 's/^/    /'
    for r in $(seq 1 $((n - 1))); do grep -E "^error" "$OUT/$name.r$r.log" | sed "s/^/    r$r: /"; done
}
# losses A B: per-step loss columns of two log.csv files
losses() {
    python3 - "$1" "$2" "$3" << 'EOF'
import csv, sys
def read(p):
    return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(p))}
a, b = read(sys.argv[1]), read(sys.argv[2])
steps = sorted(set(a) & set(b))
rel = [abs(a[s] - b[s]) / abs(a[s]) for s in steps]
worst = max(range(len(steps)), key=lambda i: rel[i]) if steps else 0
ident = all(a[s] == b[s] for s in steps)
print(f"    {sys.argv[3]}: {len(steps)} steps; identical: {ident}; max rel diff {max(rel) if rel else 0:.3e} at step "
      f"{steps[worst] if steps else '-'}; step {steps[0] if steps else '-'}: {a.get(steps[0]) if steps else ''} vs "
      f"{b.get(steps[0]) if steps else ''}; last: {a[steps[-1]] if steps else ''} vs {b[steps[-1]] if steps else ''}")
EOF
}

# ckdiff A B LABEL: two checkpoints tensor by tensor (weights, EMA, AdamW moments), where cmp says they differ
ckdiff() {
    python3 - "$1" "$2" "$3" << 'EOF'
import sys
sys.path.insert(0, "scripts")
import numpy as np
import convert
a, b = (convert.read_checkpoint_bin(p) for p in sys.argv[1:3])
groups = {}
for name, x in a.tensors.items():
    y = b.tensors[name]
    g = next((p for p in ("ema.", "adam_m.", "adam_v.", "rng_state") if name.startswith(p)), "weights")
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    d = float(np.abs(x64 - y64).max()) if x64.size else 0.0
    s = float(np.abs(x64).max()) if x64.size else 0.0
    n = int((x64 != y64).sum())
    o = groups.setdefault(g, [0.0, 0.0, 0, 0])
    o[0], o[1], o[2], o[3] = max(o[0], d), max(o[1], d / s if s else 0.0), o[2] + n, o[3] + x64.size
print(f"    {sys.argv[3]}: " + "; ".join(f"{g}: {n} of {t} differ, max abs {d:.2e}, max rel (to the tensor's largest) "
                                       f"{r:.2e}" for g, (d, r, n, t) in groups.items()))
EOF
}

G=$((32 * N))
A="--steps 50 --log_every 1 --save_every 50 --precision fp32"
run A1 1 $A --batch_size $G --output_dir /tmp/nc_A1
run AN $N $A --batch_size 32 --output_dir /tmp/nc_AN
run AN2 $N $A --batch_size 32 --output_dir /tmp/nc_AN2
losses /tmp/nc_A1/log.csv /tmp/nc_AN/log.csv "A: 1 GPU at batch $G vs $N GPUs at 32 each"
losses /tmp/nc_AN/log.csv /tmp/nc_AN2/log.csv "A: $N GPUs, run 1 vs run 2 (expect identical: True)"
# log.csv has 6 decimals: the checkpoints (weights, EMA, AdamW moments after step 50) say bit for bit
cmp /tmp/nc_AN/model.bin /tmp/nc_AN2/model.bin && echo "    A: $N GPUs, run 1 and run 2 checkpoints: identical"

# B: ZeRO-1 with OpenMPI's variables and the id through a file
rm -f /tmp/nc_id
pids=()
for r in $(seq 0 $((N - 1))); do
    OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=$N OMPI_COMM_WORLD_LOCAL_RANK=$r \
        ./train_unet $A --batch_size 32 --zero 1 --nccl_id_file /tmp/nc_id --output_dir /tmp/nc_Z \
        > "$OUT/Z.r$r.log" 2>&1 &
    pids+=($!)
done
codes=""
for r in "${!pids[@]}"; do wait "${pids[$r]}"; codes="$codes r$r=$?"; done
el "Z (--zero 1, OpenMPI variables, --nccl_id_file): exit$codes; id file left: $(ls /tmp/nc_id 2> /dev/null || echo no)"
grep -E "^error|GPU memory|state per GPU|gradients  " "$OUT/Z.r0.log" | sed 's/^/    /'
losses /tmp/nc_AN/log.csv /tmp/nc_Z/log.csv "B: $N GPUs without vs with --zero 1"
cmp /tmp/nc_AN/model.bin /tmp/nc_Z/model.bin && echo "    B: checkpoints without and with --zero 1: identical" ||
    ckdiff /tmp/nc_AN/model.bin /tmp/nc_Z/model.bin "B: step-50 checkpoints without vs with --zero 1"

# C: throughput, batch 32 per GPU, bf16; the last log line (steps 51-100) is the steady state
C="--steps 100 --log_every 50 --save_every 0 --batch_size 32"
run C1 1 $C --output_dir /tmp/nc_C1
run CN $N $C --output_dir /tmp/nc_CN
export UNET_BUCKET_MB=0
run CN0 $N $C --output_dir /tmp/nc_CN0
unset UNET_BUCKET_MB
python3 - "$OUT" "$N" << 'EOF'
import re, sys
out, n = sys.argv[1], int(sys.argv[2])
def ips(name):
    lines = [l for l in open(f"{out}/{name}.r0.log") if l.startswith("step ")]
    return float(re.search(r"([\d.]+) images/s", lines[-1]).group(1)) if lines else float("nan")
one, buck, nob = ips("C1"), ips("CN"), ips("CN0")
print(f"    C: images/s at batch 32/GPU: 1 GPU {one:.0f}; {n} GPUs {buck:.0f} ({buck / one:.2f}x, buckets), "
      f"{nob:.0f} ({nob / one:.2f}x, one all-reduce after the backward); target {1.9 if n == 2 else 3.7}x")
EOF

# D: kill rank N-1 (then rank 0) mid-run; checkpoints every 20 steps
for victim in $((N - 1)) 0; do
    D=/tmp/nc_D$victim
    rm -rf $D
    PORT=$((PORT + 1))
    pids=()
    for r in $(seq 0 $((N - 1))); do
        RANK=$r WORLD_SIZE=$N LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT ./train_unet $A --steps 2000 \
            --batch_size 32 --save_every 20 --nccl_timeout 20 --output_dir $D > "$OUT/D$victim.r$r.log" 2>&1 &
        pids+=($!)
    done
    for _ in $(seq 600); do  # until the checkpoint of step 40 is written
        grep -q "saved .* (step 40)" "$OUT/D$victim.r0.log" 2>/dev/null && break
        sleep 0.1
    done
    sleep 1
    kill -9 "${pids[$victim]}"
    tk=$(date +%s.%N)
    codes=""
    for r in "${!pids[@]}"; do
        [ "$r" = "$victim" ] && continue
        wait "${pids[$r]}"
        c=$?
        codes="$codes r$r=$c after $(python3 -c "import time; print(round(time.time() - $tk, 1))") s"
    done
    wait "${pids[$victim]}" 2> /dev/null
    el "D: killed rank $victim; the others:$codes (limit 60 s)"
    for r in $(seq 0 $((N - 1))); do grep -hE "^error" "$OUT/D$victim.r$r.log" | sed "s/^/    r$r: /"; done
    grep "saved" "$OUT/D$victim.r0.log" | tail -1 | sed 's/^/    last: /'
done
# the last checkpoint of the run whose rank N-1 was killed, resumed on 1 GPU (the checkpoint's global batch G) and,
# with 4 or more, on N/2 GPUs: 10 more steps each, against an uninterrupted N-GPU run of the same flags to that step
# (the learning rate is constant, so --steps does not change the steps before it)
D=/tmp/nc_D$((N - 1))
last=$(grep -o "(step [0-9]*)" "$OUT/D$((N - 1)).r0.log" | tail -1 | tr -dc 0-9)
R="--steps $((last + 10)) --log_every 1 --save_every 0 --precision fp32"
run RU $N $A --batch_size 32 $R --output_dir /tmp/nc_RU
run R1 1 --resume $D/model.bin $R --output_dir /tmp/nc_R1
losses /tmp/nc_RU/log.csv /tmp/nc_R1/log.csv "D: the killed run's checkpoint (step $last) on 1 GPU vs uninterrupted"
if [ "$N" -ge 4 ]; then
    run RH $((N / 2)) --resume $D/model.bin $R --output_dir /tmp/nc_RH
    losses /tmp/nc_RU/log.csv /tmp/nc_RH/log.csv "D: the same checkpoint resumed on $((N / 2)) GPUs vs uninterrupted"
fi

# E: one GPU, bf16 (the default), 30 steps: this build vs the trainer before issue 23
if [ -n "$BASE_PID" ] && wait $BASE_PID; then
    E="--steps 30 --log_every 10 --save_every 30"
    ./train_unet $E --output_dir /tmp/nc_E1 > "$OUT/E1.log" 2>&1
    /tmp/nc_base $E --output_dir /tmp/nc_E0 > "$OUT/E0.log" 2>&1
    el "E: one GPU, checkpoint at step 30 identical to the pre-issue-23 trainer's: $(cmp -s /tmp/nc_E0/model.bin \
/tmp/nc_E1/model.bin && echo yes || echo NO); losses: $(diff <(cut -d, -f1-2 /tmp/nc_E0/log.csv) \
<(cut -d, -f1-2 /tmp/nc_E1/log.csv) > /dev/null && echo identical || echo DIFFER)"
else
    el "E: skipped (no baseline source: set BASE_CU to the pre-issue-23 train_unet.cu; $OUT/build_base.log)"
fi
el end
