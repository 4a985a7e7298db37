"""Fuzz suite (issue 26): bad inputs through every reader and writer of the project's files. Runs in CI (no GPU).

For every binary format the project reads (UNet datasets and checkpoints, linreg datasets, MNIST checkpoints, the
committed fixtures) a small valid file is written, then mutated: every header field set to 0, -1, INT32_MAX,
INT32_MIN and its value +-1 (float fields to NaN, inf, 0, -1, 2 and 1.5x), truncations at many points, trailing
bytes, bit flips in the tensor table (names, dtype, ndim, shape, reserved), NaN and inf in the data; the MNIST IDX
.gz files get their header fields (magic, count, rows, cols) and the gzip stream's faults (truncations, appended
bytes, flips in the gzip header, the deflate data and the CRC-32 / length trailer); and special paths (a directory,
a character device, a FIFO, /dev/zero, symlinks, an unreadable file, a missing folder). Each file goes through every
program that reads it: ./train_unet (--data_file, --load, --resume, --sample), ./train_linreg --data_file,
./train_mnist (--data_dir, --load, --resume), ./dev/softmax_forward --fixture, scripts/generate.py, dev/mnist.py
(its IDX reader in process, --eval_checkpoint), scripts/convert.py (checkpoints, in process) and scripts/binio.py's
read in process. Every writer's output path
gets the same treatment (directory, device node, FIFO, symlink, missing folder, a full disk), and the scripts' text
inputs their own (non-UTF-8, NUL bytes, /dev/zero, a negative seed).

A case passes when the program accepts a valid input, or refuses a bad one cleanly: exit 1 with exactly one
`error:` line that names the file (and, for a mutation that must be refused, the field); never a signal, exit
134/139, a hang (timeout), a Python traceback or an allocation past a bound (Python runs under a 3 GB address space
limit, plus what `import torch` maps where PyTorch is installed; the C++ readers under 3 GB where no GPU is present). Trainers run with CUDA_VISIBLE_DEVICES="" so that they stop
right after validation on every machine (train_mnist trains on the CPU on 8 images: a run that starts and stops on
its loss accepted the file).

  python3 dev/test_fuzz.py [-v] [substring ...]     from the repository root, after `make` and `make -C dev`
"""
import concurrent.futures
import gzip
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import binio  # noqa: E402
import convert  # noqa: E402
from generate import ModelConfig  # noqa: E402

UNET = os.path.join(ROOT, "train_unet")
LINREG = os.path.join(ROOT, "train_linreg")
MNIST = os.path.join(ROOT, "train_mnist")
SOFTMAX = os.path.join(ROOT, "dev", "softmax_forward")
PY = sys.executable
SCRIPTS = os.path.join(ROOT, "scripts")
FIXTURES = os.path.join(ROOT, "dev", "fixtures")
TIMEOUT_S = 60
INT_MAX, INT_MIN = 2**31 - 1, -2**31
HAVE_GPU = shutil.which("nvidia-smi") is not None
MEM_LIMIT_KB = 3 * 1024 * 1024  # "no allocation beyond a bound": every run fits in 3 GB of address space


def import_torch_kb():
    """The address space `import torch` maps by itself where PyTorch is installed (0 elsewhere): PyPI's CUDA wheel
    maps about 3.1 GB of libraries before allocating anything. Python runs get it on top of the 3 GB bound, so that a
    tool importing torch is judged by what it allocates, not by the libraries it maps."""
    code = "import torch; print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmPeak')][0])"
    try:
        p = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        return int(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


PY_MEM_LIMIT_KB = MEM_LIMIT_KB + import_torch_kb()
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg")
CRASH_WORDS = ["Traceback (most recent call last)", "terminate called", "Segmentation fault", "core dumped",
               "std::bad_alloc", "Aborted", "MemoryError", "Killed"]
NO_GPU_WORDS = ["no CUDA GPU found"]  # train_unet's line after a validation that passed, on a machine without GPU
VERBOSE = False

# A process that must meet Unix permissions although we may be root: CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH are
# dropped from the bounding set before exec (a root process keeps only what that set allows).
DROP_DAC = ("import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for cap in (1, 2):\n    if libc.prctl(24, cap, 0, 0, 0) != 0: sys.exit(97)\n"
            "os.execvp(sys.argv[1], sys.argv[1:])\n")


# ----------------------------------------------------------------------------------------------------------------
# running a program and judging its answer


class Res:
    def __init__(self, code, out, secs, timed_out=False):
        self.code, self.out, self.secs, self.timed_out = code, out, secs, timed_out


def run(argv, timeout=TIMEOUT_S, fsize_kb=None, no_dac=False, cwd=ROOT):
    """Runs argv (no stdin) under the address-space limit; fsize_kb: a full disk after that many KB (writes fail
    with EFBIG, SIGXFSZ ignored); no_dac: file permissions apply even to root."""
    limit = PY_MEM_LIMIT_KB if argv[0] == PY else (MEM_LIMIT_KB if not HAVE_GPU else None)
    shell = ""
    if limit:
        shell += f"ulimit -v {limit}; "
    if fsize_kb is not None:
        shell += f"ulimit -f {fsize_kb}; trap '' XFSZ; "
    cmd = list(argv)
    if no_dac and os.geteuid() == 0:
        cmd = [PY, "-c", DROP_DAC] + cmd
    if shell:
        cmd = ["bash", "-c", shell + 'exec "$@"', "fuzz"] + cmd
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, errors="replace", timeout=timeout,
                           stdin=subprocess.DEVNULL)
        return Res(p.returncode, p.stdout + p.stderr, time.time() - t0)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Res(None, out, timeout, True)


def error_lines(out):
    return [line for line in out.splitlines() if line.startswith("error:")]


def judge(res, expect, path=None, words=()):
    """None when the answer is right, else why not. expect: "accept" (a valid input: exit 0, or train_unet's no-GPU
    line after validation), "reject" (exit 1, one error line naming path and one of words) or "either" (no crash;
    a refusal must still be clean and name the path)."""
    if res.timed_out:
        return f"no answer after {TIMEOUT_S} s (a hang)"
    for w in CRASH_WORDS:
        if w in res.out:
            return f"crash ({w!r}), exit {res.code}: {tail(res.out)}"
    if res.code not in (0, 1):
        return f"exit {res.code} (a crash or signal): {tail(res.out)}"
    errors = error_lines(res.out)
    accepted = res.code == 0 or (len(errors) == 1 and any(w in errors[0] for w in NO_GPU_WORDS))
    if accepted:
        if expect == "reject":
            return f"accepted (exit {res.code}), expected a clean error: {tail(res.out)}"
        return None
    if expect == "accept":
        return f"refused a valid input: {tail(res.out)}"
    if len(errors) != 1:
        return f"{len(errors)} 'error:' lines, expected one: {tail(res.out)}"
    paths = [path] if isinstance(path, str) else path
    if paths and not any(p in errors[0] for p in paths):
        return f"the error does not name {' or '.join(paths)}: {errors[0][:300]}"
    if expect == "reject" and words and not any(w in errors[0] for w in words):
        return f"the error names none of {list(words)}: {errors[0][:300]}"
    return None


def tail(out, n=300):
    out = out.strip()
    return (out[-n:] if out else "(no output)").replace("\n", " | ")


def judge_inproc(fn, expect, path=None, words=()):
    """The same verdict for a call of binio in this process: FormatError is a clean refusal, anything else a crash."""
    try:
        fn()
    except binio.FormatError as e:
        msg = str(e)
        if expect == "accept":
            return f"refused a valid input: {msg[:300]}"
        if "\n" in msg.strip():
            return f"a message of several lines: {msg[:300]}"
        if path is not None and path not in msg:
            return f"the error does not name {path}: {msg[:300]}"
        if expect == "reject" and words and not any(w in msg for w in words):
            return f"the error names none of {list(words)}: {msg[:300]}"
        return None
    except BaseException as e:  # noqa: BLE001 - any other exception is the crash this suite looks for
        return f"{type(e).__name__} (not a FormatError): {str(e)[:300]}"
    if expect == "reject":
        return "accepted, expected a FormatError"
    return None


# ----------------------------------------------------------------------------------------------------------------
# results


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.groups = {}  # group -> [passed, failed, skipped]
        self.order = []

    def add(self, group, case, status, detail=""):
        with self.lock:
            if group not in self.groups:
                self.groups[group] = [0, 0, 0]
                self.order.append(group)
            self.groups[group][("PASS", "FAIL", "SKIP").index(status)] += 1
            if status != "PASS" or VERBOSE:
                print(f"{status} {group}: {case}{': ' + detail if detail else ''}", flush=True)

    def totals(self):
        return [sum(g[i] for g in self.groups.values()) for i in range(3)]


TALLY = Tally()


def record(group, case, reason, known=None):
    """reason None = PASS; known: a defect that is fixed elsewhere later, reported as SKIP while it still fails."""
    if reason is None:
        TALLY.add(group, case, "PASS")
    elif known:
        TALLY.add(group, case, "SKIP", f"known defect ({known}): {reason}")
    else:
        TALLY.add(group, case, "FAIL", reason)


# ----------------------------------------------------------------------------------------------------------------
# valid base files


TINY = dict(image_size=8, in_channels=3, model_channels=32, out_channels=3, num_res_blocks=1, n_levels=1,
            mult0=1, mult1=0, mult2=0, mult3=0, attn_ds_mask=1, num_head_channels=32, diffusion_steps=1000,
            beta_start=1e-4, beta_end=0.02)
TINY_FLAGS = ["--image_size", "8", "--model_channels", "32", "--channel_mult", "1", "--num_res_blocks", "1",
              "--attn_ds", "1", "--num_head_channels", "32"]
CKPT_META = dict(step=5, batch_size=4, seed=7, lr=2e-4, ema_rate=0.999, has_ema=1, has_optimizer=1)


def tiny_checkpoint(path, ema=True, optimizer=True, **over):
    rng = np.random.default_rng(0)
    params = {n: rng.uniform(-0.2, 0.2, s).astype(np.float32) for n, s in ModelConfig(TINY).param_shapes().items()}
    tensors = dict(params)
    if ema:
        tensors.update({"ema." + n: v * np.float32(0.5) for n, v in params.items()})
    if optimizer:
        tensors.update({"adam_m." + n: v * np.float32(0.01) for n, v in params.items()})
        tensors.update({"adam_v." + n: v * v * np.float32(1e-4) for n, v in params.items()})
        tensors["rng_state"] = np.array([7, 5, 5, 0], dtype=np.int32)
    cfg = dict(TINY, **CKPT_META)
    cfg.update(has_ema=int(ema), has_optimizer=int(optimizer))
    cfg.update(over)
    binio.write(path, binio.UNET_CHECKPOINT, cfg, tensors)


def tiny_dataset(path, n=6, size=8):
    images = np.random.default_rng(1).integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    binio.write(path, binio.UNET_DATASET, dict(n_images=n, height=size, width=size, channels=3), {"images": images})


def tiny_linreg(path, n=40, d=2, n_train=30):
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (n, d)).astype(np.float32)
    y = (x @ np.arange(1, d + 1, dtype=np.float32) + 0.5).astype(np.float32)
    binio.write(path, binio.LINREG_DATASET, dict(n_points=n, n_features=d, n_train=n_train, seed=3, w_true=0.7,
                                                 b_true=0.3, noise_std=0.1, x_min=-1.0, x_max=1.0),
                {"x": x, "y": y})


# ----------------------------------------------------------------------------------------------------------------
# mutations of a file: each returns the mutated bytes


def i32(v):
    return np.array([v], dtype="<i4").tobytes()


def f32(v):
    return np.array([v], dtype="<f4").tobytes()


def set_bytes(raw, offset, b):
    out = bytearray(raw)
    out[offset:offset + len(b)] = b
    return bytes(out)


def table(raw):
    """[(index, name, entry offset, dtype, ndim, shape, data offset, nbytes)] of a valid file."""
    count = int(np.frombuffer(raw[8:12], "<i4")[0])
    rows, data = [], 1024 + 128 * count
    for i in range(count):
        off = 1024 + 128 * i
        name = raw[off:off + 96].split(b"\0", 1)[0].decode()
        meta = np.frombuffer(raw[off + 96:off + 128], "<i4")
        dtype, ndim, shape = int(meta[0]), int(meta[1]), [int(s) for s in meta[2:2 + int(meta[1])]]
        nbytes = int(np.prod(shape, dtype=np.int64)) * (1 if dtype == 2 else 4)
        rows.append((i, name, off, dtype, ndim, shape, data, nbytes))
        data += nbytes
    return rows


def int_values(v):
    """0, -1, INT32_MAX, INT32_MIN, v+1, v-1 without repeats or v itself: (label, value, near) near = v+-1."""
    out = []
    for label, value in (("0", 0), ("-1", -1), ("INT32_MAX", INT_MAX), ("INT32_MIN", INT_MIN),
                         ("v+1", v + 1), ("v-1", v - 1)):
        if value != v and INT_MIN <= value <= INT_MAX and value not in [o[1] for o in out]:
            out.append((label, value, label.startswith("v")))
    return out


def float_values(v):
    out = [("nan", float("nan"), False), ("inf", float("inf"), False), ("-inf", float("-inf"), False),
           ("0.0", 0.0, False), ("-1.0", -1.0, False), ("2.0", 2.0, False), ("1.5v", 1.5 * v, True)]
    return [o for o in out if not (o[1] == v)]


class Mutant:
    """A mutated file and what each reader must do with it: expect[reader] = ("accept"|"reject"|"either", words)."""

    def __init__(self, group, name, data, expect, path_kind="file"):
        self.group, self.name, self.data, self.expect, self.path_kind = group, name, data, expect, path_kind


def header_mutants(group, raw, fmt, policy):
    """Every header field of fmt (magic, version, tensor count, config fields) set to the awkward values.
    policy(field, label, value, near) -> expect dict for the readers."""
    out = []
    hdr = np.frombuffer(raw[:1024], "<i4")
    fields = [("magic", "i"), ("version", "i"), ("tensor count", "i")] + fmt.fields
    for slot, (field, kind) in enumerate(fields):
        if kind == "i":
            values = [(lab, val, near, i32(val)) for lab, val, near in int_values(int(hdr[slot]))]
        else:
            cur = float(hdr[slot:slot + 1].view("<f4")[0])
            values = [(lab, val, near, f32(val)) for lab, val, near in float_values(cur)]
        for label, value, near, b in values:
            out.append(Mutant(group, f"header[{slot}] {field} = {label}", set_bytes(raw, 4 * slot, b),
                              policy(field, label, value, near)))
    return out


def truncation_mutants(group, raw, expect):
    """Cut at many points (inside the header, the table, each tensor's data) and with bytes appended."""
    rows = table(raw)
    cuts = {0, 1, 4, 511, 1023, 1024, 1025, 1024 + 64, 1024 + 128 * len(rows) - 1, 1024 + 128 * len(rows),
            len(raw) - 1, len(raw) - 4, len(raw) // 2}
    for r in rows[:3] + rows[-2:]:
        cuts.update({r[6] + r[7] // 2, r[6] + r[7] - 1})
    out = [Mutant(group, f"truncated to {c} of {len(raw)} bytes", raw[:c], expect) for c in sorted(cuts)
           if 0 <= c < len(raw)]
    out.append(Mutant(group, "1 byte appended", raw + b"\0", expect))
    out.append(Mutant(group, "4096 bytes appended", raw + b"\x7f" * 4096, expect))
    return out


def table_mutants(group, raw, entries, strict, loose):
    """Bit flips in the tensor table entries `entries` (indexes): name[0], dtype, ndim, each used shape dim
    (bits 0, 3, 16, 31), an unused dim and a reserved word. strict: expect of a flip a reader must refuse; loose:
    of a flip that may be harmless (unused dims, reserved words, and everything for a generic reader)."""
    out = []
    rows = table(raw)
    for idx in entries:
        i, name, off, dtype, ndim, shape, _, _ = rows[idx]

        def flip(byte_off, bit, label, expect):
            data = bytearray(raw)
            data[off + byte_off + bit // 8] ^= 1 << (bit % 8)
            out.append(Mutant(group, f"tensor {i} ({name}) {label} bit {bit} flipped", bytes(data), expect))

        flip(0, 1, "name[0]", strict)
        for bit in (0, 1, 31):
            flip(96, bit, "dtype", strict)
            flip(100, bit, "ndim", strict)
        for d in range(ndim):
            for bit in (0, 3, 16, 31):
                flip(104 + 4 * d, bit, f"shape[{d}]", strict)
        if ndim < 4:
            flip(104 + 4 * ndim, 4, f"shape[{ndim}] (unused)", loose)
        flip(120, 2, "reserved[0]", loose)
    return out


def data_mutants(group, raw, cases):
    """cases: [(tensor name, element index, value bytes, label, expect)] -> mutants with that element changed."""
    rows = {r[1]: r for r in table(raw)}
    out = []
    for name, index, b, label, expect in cases:
        r = rows[name]
        out.append(Mutant(group, f"{name}[{index}] = {label}", set_bytes(raw, r[6] + 4 * index, b), expect))
    return out


# ----------------------------------------------------------------------------------------------------------------
# readers: name -> function(path, work dir) returning a verdict (None = right) for an expectation


def cli_reader(argv_fn):
    def read(path, work, expect, words):
        res = run(argv_fn(path, work))
        if words and words[-1] == TINY_DS_MARK:  # a mismatch between two files: naming either is right
            return judge(res, expect, [path, TINY_DS], words[:-1])
        return judge(res, expect, path, words)
    return read


TINY_DS_MARK = "(or the data file)"


def inproc_reader(fmt):
    def read(path, work, expect, words):
        return judge_inproc(lambda: binio.read(path, fmt), expect, path, words)
    return read


def convert_reader(path, work, expect, words):
    """scripts/convert.py, in process: the checkpoint to safetensors (the reading is what is judged)."""
    return judge_inproc(lambda: convert.convert(path, os.path.join(work, "converted.safetensors")), expect, path,
                        words)


def add_convert(mutants):
    """scripts/convert.py reads every checkpoint binio.read reads: it answers each mutant as binio does, except a
    tensor the model does not have, which it refuses (it checks the tensor set, as the trainers)."""
    for m in mutants:
        for bio in ("binio.read unet checkpoint", "binio.read mnist checkpoint"):
            if bio in m.expect:
                verdict = ("reject", ["bogus.weight"]) if "bogus.weight" in m.name else m.expect[bio]
                m.expect = dict(m.expect, **{"convert.py": verdict})


def setup_common(tmp):
    """Valid files the readers need besides the mutated one."""
    global TINY_DS
    TINY_DS = os.path.join(tmp, "tiny_ds.bin")
    tiny_dataset(TINY_DS)


READERS = {
    "train_unet --data_file": cli_reader(lambda p, w: [UNET, "--data_file", p, "--output_dir", os.path.join(w, "out"),
                                                       "--steps", "10", "--batch_size", "4"] + TINY_FLAGS),
    "train_unet --load": cli_reader(lambda p, w: [UNET, "--load", p, "--data_file", TINY_DS, "--output_dir",
                                                  os.path.join(w, "out"), "--steps", "10", "--batch_size", "4"]),
    "train_unet --resume": cli_reader(lambda p, w: [UNET, "--resume", p, "--data_file", TINY_DS, "--output_dir",
                                                    os.path.join(w, "out"), "--steps", "10"]),
    "train_unet --sample": cli_reader(lambda p, w: [UNET, "--sample", os.path.join(w, "s.bin"), "--load", p,
                                                    "--num_samples", "1", "--sample_steps", "1"]),
    "generate.py": cli_reader(lambda p, w: [PY, os.path.join(SCRIPTS, "generate.py"), "--checkpoint", p, "--out",
                                            os.path.join(w, "g.png"), "--device", "cpu", "--num_samples", "1",
                                            "--sampler", "ddim", "--steps", "1"]),
    "train_linreg --data_file": cli_reader(lambda p, w: [LINREG, "--device", "cpu", "--data_file", p, "--epochs",
                                                         "2", "--log_every", "0"]),
    "binio.read unet dataset": inproc_reader(binio.UNET_DATASET),
    "binio.read unet checkpoint": inproc_reader(binio.UNET_CHECKPOINT),
    "binio.read linreg dataset": inproc_reader(binio.LINREG_DATASET),
    "convert.py": convert_reader,
}


def softmax_reader(path, work, expect, words, no_dac=False):
    res = run([SOFTMAX, "--test", "--fixture", path], no_dac=no_dac)
    if res.code == 97 and no_dac:
        raise SkipCase("cannot drop CAP_DAC_OVERRIDE here")
    if res.timed_out:
        return "a hang"
    for w in CRASH_WORDS:
        if w in res.out:
            return f"crash ({w!r}): {tail(res.out)}"
    if res.code not in (0, 1):
        return f"exit {res.code}: {tail(res.out)}"
    if res.code == 0:
        return "accepted, expected a refusal" if expect == "reject" else None
    fails = [line for line in res.out.splitlines() if line.startswith("FAIL") and "fixture" in line]
    if expect == "accept":
        return f"refused a valid fixture: {tail(res.out)}"
    if len(fails) != 1 or path not in fails[0]:
        return f"expected one FAIL line about the fixture naming {path}: {tail(res.out)}"
    return None


READERS["softmax_forward --fixture"] = softmax_reader  # a test program: its refusals are FAIL lines, not error:


def fixture_reader(fmt):
    return inproc_reader(fmt)


# ----------------------------------------------------------------------------------------------------------------
# the formats: base file, readers, and what each mutation must do


def unet_dataset_mutants(tmp):
    base = os.path.join(tmp, "base_ds.bin")
    tiny_dataset(base)
    raw = open(base, "rb").read()
    g = "unet dataset"
    cli, gen = "train_unet --data_file", "binio.read unet dataset"
    words = {"magic": ["magic"], "version": ["version"], "tensor count": ["tensor count", "file length", "tensor"],
             "n_images": ["n_images", "images"], "height": ["height", "images"], "width": ["width", "images"],
             "channels": ["channels"]}

    def policy(field, label, value, near):
        structural = field in ("magic", "version", "tensor count")
        return {cli: ("reject", words[field]), gen: ("reject" if structural else "either", words[field])}

    reject_all = {cli: ("reject", []), gen: ("reject", [])}
    strict = {cli: ("reject", []), gen: ("either", [])}
    loose = {cli: ("either", []), gen: ("either", [])}
    out = header_mutants(g, raw, binio.UNET_DATASET, policy)
    out += truncation_mutants(g, raw, reject_all)
    out += table_mutants(g, raw, [0], strict, loose)
    return out


def unet_checkpoint_mutants(tmp):
    base = os.path.join(tmp, "base_ck.bin")
    tiny_checkpoint(base)
    raw = open(base, "rb").read()
    g = "unet checkpoint"
    load, resume, sample, gen, bio = ("train_unet --load", "train_unet --resume", "train_unet --sample", "generate.py",
                                      "binio.read unet checkpoint")
    semantic = [load, resume, sample, gen]
    model = {f for f, _ in binio.UNET_MODEL_FIELDS}
    optimizer_fields = {f for f, _ in binio.UNET_OPTIMIZER_FIELDS}

    def policy(field, label, value, near):
        w = [field, "shape", "missing", "tensor"]
        e = {bio: ("reject" if field in ("magic", "version", "tensor count") else "either", [field, "tensor count",
                                                                                           "file length"])}
        if field in ("magic", "version"):
            return dict(e, **{r: ("reject", [field]) for r in semantic})
        if field == "tensor count":
            return dict(e, **{r: ("reject", ["tensor count", "file length", "tensor"]) for r in semantic})
        bad = not near  # 0, -1, INT32_MAX, INT32_MIN, NaN, inf, -1.0, 2.0: out of every field's range but a few
        if field in model:
            if field == "image_size" and near:  # any size fits a 1-level model: only the data can tell
                return dict(e, **{load: ("reject", ["image_size", "images are", TINY_DS_MARK]),
                                  resume: ("reject", ["image_size", "images are", TINY_DS_MARK]),
                                  sample: ("either", w), gen: ("either", w)})
            if field == "diffusion_steps" and near:
                return dict(e, **{r: ("either", w) for r in semantic})
            if field in ("beta_start", "beta_end") and near:  # 1.5x is still a valid schedule
                return dict(e, **{r: ("either", w) for r in semantic})
            return dict(e, **{r: ("reject", w + ["model", "beta", "mult", "attn", "channels"]) for r in semantic})
        if field == "step":  # 0..1e9; rng_state must agree when resuming
            ok = near or value == 0
            return dict(e, **{r: ("either" if ok else "reject", ["step"]) for r in (load, sample, gen)},
                        **{resume: ("reject", ["step", "rng_state"])})
        if field == "batch_size":
            return dict(e, **{r: ("either" if near else "reject", ["batch_size"]) for r in semantic})
        if field == "seed":  # 0..INT32_MAX; rng_state must agree when resuming
            ok = value >= 0
            return dict(e, **{r: ("either" if ok else "reject", ["seed"]) for r in (load, sample, gen)},
                        **{resume: ("reject", ["seed", "rng_state"])})
        if field == "lr":
            return dict(e, **{r: ("either" if near else "reject", ["lr"]) for r in semantic})
        if field == "ema_rate":
            ok = near or value == 0.0
            return dict(e, **{r: ("either" if ok else "reject", ["ema_rate"]) for r in semantic})
        if field == "has_ema":  # 0: no EMA is fine where the EMA is not needed
            if value == 0:
                return dict(e, **{load: ("either", ["has_ema"]), gen: ("either", ["has_ema"]),
                                  resume: ("reject", ["has_ema"]), sample: ("reject", ["has_ema"])})
            return dict(e, **{r: ("reject", ["has_ema"]) for r in semantic})
        if field == "has_optimizer":
            if value == 0:
                return dict(e, **{load: ("either", []), gen: ("either", []), sample: ("either", []),
                                  resume: ("reject", ["has_optimizer"])})
            return dict(e, **{r: ("reject", ["has_optimizer"]) for r in semantic})
        if field in optimizer_fields:  # the base is AdamW's: Muon's settings must be 0, optimizer 1 needs them
            if value == 0:
                return dict(e, **{r: ("either", [field]) for r in semantic})
            return dict(e, **{r: ("reject", [field, "muon_lr", "optimizer"]) for r in semantic})
        raise AssertionError(field)

    reject_all = {r: ("reject", []) for r in semantic + [bio]}
    strict = dict({r: ("reject", []) for r in semantic}, **{bio: ("either", [])})
    loose = {r: ("either", []) for r in semantic + [bio]}
    out = header_mutants(g, raw, binio.UNET_CHECKPOINT, policy)
    out += truncation_mutants(g, raw, reject_all)
    rows = table(raw)
    names = [r[1] for r in rows]
    out += table_mutants(g, raw, [0, len(rows) // 2, len(rows) - 1], strict, loose)
    first = names[0]
    nan, inf = f32(float("nan")), f32(float("inf"))
    finite_words = ["finite", "nan", "inf", "NaN"]
    bad_data = dict({r: ("reject", finite_words) for r in semantic}, **{bio: ("either", [])})
    cases = [(first, 0, nan, "NaN", bad_data), (first, 3, inf, "inf", bad_data),
             ("ema." + first, 1, nan, "NaN", bad_data), ("adam_m." + first, 2, f32(float("-inf")), "-inf", bad_data),
             ("adam_v." + first, 0, nan, "NaN", bad_data),
             ("adam_v." + first, 1, f32(-1.0), "-1 (a negative second moment)",
              dict({resume: ("reject", ["adam_v", "negative"])}, **{r: ("either", []) for r in (load, sample, gen, bio)})),
             ("rng_state", 1, i32(6), "6 (step is 5)",
              dict({resume: ("reject", ["rng_state", "step"])}, **{r: ("either", []) for r in (load, sample, gen, bio)})),
             ("rng_state", 0, i32(8), "8 (seed is 7)",
              dict({resume: ("reject", ["rng_state", "seed"])}, **{r: ("either", []) for r in (load, sample, gen, bio)}))]
    out += data_mutants(g, raw, cases)
    # a tensor the model does not have, and a checkpoint of a model without attention that keeps its tensors
    _, cfg, tensors = binio.read(base, binio.UNET_CHECKPOINT)
    extra = os.path.join(tmp, "extra.bin")
    binio.write(extra, binio.UNET_CHECKPOINT, cfg, dict(tensors, **{"bogus.weight": np.zeros(3, np.float32)}))
    out.append(Mutant(g, "an extra tensor bogus.weight", open(extra, "rb").read(),
                      dict({r: ("reject", ["bogus.weight"]) for r in semantic}, **{bio: ("accept", [])})))
    os.unlink(extra)
    return out


def linreg_mutants(tmp):
    base = os.path.join(tmp, "base_lr.bin")
    tiny_linreg(base)
    raw = open(base, "rb").read()
    g = "linreg dataset"
    cli, bio = "train_linreg --data_file", "binio.read linreg dataset"

    def policy(field, label, value, near):
        structural = field in ("magic", "version", "tensor count")
        e = {bio: ("reject" if structural else "either", [field, "tensor count", "file length"])}
        if structural:
            return dict(e, **{cli: ("reject", [field, "tensor count"])})
        if field in ("n_points", "n_features"):
            return dict(e, **{cli: ("reject", [field, "shape", "file length"])})
        if field == "n_train":
            return dict(e, **{cli: ("either" if near else "reject", ["n_train"])})
        return dict(e, **{cli: ("accept", [])})  # seed, w_true .. x_max describe how the data was made

    reject_all = {cli: ("reject", []), bio: ("reject", [])}
    strict = {cli: ("reject", []), bio: ("either", [])}
    loose = {cli: ("either", []), bio: ("either", [])}
    out = header_mutants(g, raw, binio.LINREG_DATASET, policy)
    out += truncation_mutants(g, raw, reject_all)
    out += table_mutants(g, raw, [0, 1], strict, loose)
    bad = {cli: ("reject", ["finite", "nan", "inf"]), bio: ("either", [])}
    out += data_mutants(g, raw, [("x", 0, f32(float("nan")), "NaN", bad), ("x", 79, f32(float("inf")), "inf", bad),
                                 ("y", 39, f32(float("-inf")), "-inf", bad)])
    return out


FIXTURE_FORMATS = {
    "linreg_small.bin": binio.LINREG_DATASET, "mnist_fixture.bin": binio.MNIST_FIXTURE,
    "mnist_optimizers_fixture.bin": binio.MNIST_OPT_FIXTURE,
    "softmax_fixture.bin": binio.SOFTMAX_FIXTURE, "unet_debug_small.bin": binio.UNET_DEBUG_STATE,
    "unet_forward_small.bin": binio.UNET_FIXTURE, "unet_layer_attention.bin": binio.UNET_LAYER_FIXTURE,
    "unet_layer_conv3x3.bin": binio.UNET_LAYER_FIXTURE, "unet_layer_mse.bin": binio.UNET_LAYER_FIXTURE,
}


def fixture_mutants():
    """The committed fixtures through binio (every Python test reads them so) and the softmax fixture through the C++
    reader of dev/softmax_forward: structural mutations, truncations and table flips."""
    out = []
    for fname, fmt in FIXTURE_FORMATS.items():
        raw = open(os.path.join(FIXTURES, fname), "rb").read()
        g = f"fixture {fname}"
        reader = f"binio.read {fname}"
        READERS[reader] = fixture_reader(fmt)
        readers = [reader] + (["softmax_forward --fixture"] if fname == "softmax_fixture.bin" else [])

        def policy(field, label, value, near, readers=readers):
            if field in ("magic", "version", "tensor count"):
                return {r: ("reject", [field, "tensor count", "file length"]) for r in readers}
            return {r: ("either", []) for r in readers}

        out += [m for m in header_mutants(g, raw, fmt, policy) if m.name.split()[0] in
                ("header[0]", "header[1]", "header[2]")]
        out += truncation_mutants(g, raw, {r: ("reject", []) for r in readers})
        out += table_mutants(g, raw, [0, len(table(raw)) - 1], {r: ("either", []) for r in readers},
                             {r: ("either", []) for r in readers})
    return out


# ----------------------------------------------------------------------------------------------------------------
# special paths as inputs


def make_device_node(path):
    """A character device of our own (as /dev/null) where mknod is allowed, else a FIFO; -> what it is."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        return "character device"
    except (PermissionError, OSError):
        os.mkfifo(path)
        return "FIFO"


def is_node(path):
    try:
        m = os.lstat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(m) or stat.S_ISFIFO(m)


def special_inputs(tmp, good):
    """(label, path, expect, words, no_dac) for every reader: a good file's special forms and bad paths."""
    d = os.path.join(tmp, "special_" + os.path.basename(good))
    os.makedirs(d, exist_ok=True)
    fifo = os.path.join(d, "fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    link = os.path.join(d, "link_to_good.bin")
    if not os.path.lexists(link):
        os.symlink(good, link)
    link_dir = os.path.join(d, "link_to_dir.bin")
    if not os.path.lexists(link_dir):
        os.symlink(d, link_dir)
    dangling = os.path.join(d, "dangling.bin")
    if not os.path.lexists(dangling):
        os.symlink(os.path.join(d, "nowhere.bin"), dangling)
    locked = os.path.join(d, "unreadable.bin")
    shutil.copyfile(good, locked)
    os.chmod(locked, 0)
    missing = ["No such file", "no such file", "does not exist", "not found"]
    not_regular = ["not a regular file"]
    return [
        ("a directory", d, "reject", ["directory"], False),
        ("/dev/null (empty character device)", "/dev/null", "reject", not_regular, False),
        ("/dev/zero (endless character device)", "/dev/zero", "reject", not_regular, False),
        ("a FIFO with no writer", fifo, "reject", not_regular, False),
        ("a symlink to a valid file", link, "accept", [], False),
        ("a symlink to a directory", link_dir, "reject", ["directory"], False),
        ("a dangling symlink", dangling, "reject", missing, False),
        ("a file in a missing folder", os.path.join(d, "no_folder", "x.bin"), "reject", missing, False),
        ("an unreadable file", locked, "reject", ["Permission denied", "permission denied"], True),
    ]


def special_input_cases(tmp):
    """(group, case, fn) for the special paths through every reader of a binary file."""
    base_ck, base_lr = os.path.join(tmp, "base_ck.bin"), os.path.join(tmp, "base_lr.bin")
    cases = []
    readers = {TINY_DS: ["train_unet --data_file", "binio.read unet dataset"],
               base_ck: ["train_unet --load", "train_unet --resume", "train_unet --sample", "generate.py",
                         "binio.read unet checkpoint"],
               base_lr: ["train_linreg --data_file", "binio.read linreg dataset"],
               MNIST_CK: ["train_mnist --load", "train_mnist --resume", "dev/mnist.py --eval_checkpoint",
                          "binio.read mnist checkpoint"],
               os.path.join(FIXTURES, "softmax_fixture.bin"): ["softmax_forward --fixture"]}
    for good, names in readers.items():
        for label, path, expect, words, no_dac in special_inputs(tmp, good):
            for reader in names:
                def fn(reader=reader, path=path, expect=expect, words=words, no_dac=no_dac):
                    work = tempfile.mkdtemp(dir=tmp)
                    try:
                        if no_dac:
                            return special_no_dac(reader, path, work, expect, words)
                        return READERS[reader](path, work, expect, words)
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
                cases.append(("special input paths", f"{reader}: {label}", fn))
    return cases


def special_no_dac(reader, path, work, expect, words):
    """The unreadable file: the reader runs without the override of file permissions (root's CAP_DAC_*)."""
    if reader == "softmax_forward --fixture":
        return softmax_reader(path, work, expect, words, no_dac=True)
    if reader.startswith("binio.read"):
        argv = [PY, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import binio\n"
                "try:\n    binio.read(sys.argv[2], binio.UNET_DATASET)\nexcept binio.FormatError as e:\n"
                "    sys.exit(f'error: {e}')", SCRIPTS, path]
        res = run(argv, no_dac=True)
    else:
        res = run(NO_DAC_ARGV[reader](path, work), no_dac=True)
    if res.code == 97:
        raise SkipCase("cannot drop CAP_DAC_OVERRIDE here")
    return judge(res, expect, path, words)


class SkipCase(Exception):
    pass


NO_DAC_ARGV = {
    "train_unet --data_file": lambda p, w: [UNET, "--data_file", p, "--output_dir", os.path.join(w, "o")] + TINY_FLAGS,
    "train_unet --load": lambda p, w: [UNET, "--load", p, "--data_file", TINY_DS, "--output_dir", os.path.join(w, "o")],
    "train_unet --resume": lambda p, w: [UNET, "--resume", p, "--data_file", TINY_DS, "--output_dir",
                                         os.path.join(w, "o"), "--steps", "10"],
    "train_unet --sample": lambda p, w: [UNET, "--sample", os.path.join(w, "s.bin"), "--load", p],
    "generate.py": lambda p, w: [PY, os.path.join(SCRIPTS, "generate.py"), "--checkpoint", p, "--out",
                                 os.path.join(w, "g.png"), "--device", "cpu"],
    "train_linreg --data_file": lambda p, w: [LINREG, "--device", "cpu", "--data_file", p],
}


# ----------------------------------------------------------------------------------------------------------------
# outputs: every writer, every bad output path


def output_cases(tmp):
    """(group, case, fn): each writer with its output a directory, a device node, a FIFO, in a missing folder,
    a symlink (written through, the link kept) and on a full disk; and a refusal before any long work."""
    ck = os.path.join(tmp, "out_ck.bin")  # a checkpoint of the tiny model without optimizer state, for generate
    tiny_checkpoint(ck, optimizer=False)
    csv_path = os.path.join(tmp, "ok.csv")
    with open(csv_path, "w") as f:
        f.write("a,b,y\n" + "".join(f"{i},{i % 7},{2 * i + 1}\n" for i in range(20)))
    img_dir = os.path.join(tmp, "images")
    os.makedirs(img_dir, exist_ok=True)
    from PIL import Image
    for i in range(3):
        Image.fromarray(np.full((12, 10, 3), 40 * i, np.uint8)).save(os.path.join(img_dir, f"{i}.png"))
    log_csv = os.path.join(tmp, "log.csv")
    with open(log_csv, "w") as f:
        f.write("step,loss,ms,images_per_s\n" + "".join(f"{i},{1.0 / i:.4f},60,500\n" for i in range(1, 30)))
    sm_csv = os.path.join(tmp, "sweep.csv")
    with open(sm_csv, "w") as f:
        f.write("op,cols,impl,gbps\nforward,128,ours,100\nforward,256,ours,200\nbackward,128,ours,90\n")
    lin_json = os.path.join(tmp, "linreg.json")
    with open(lin_json, "w") as f:
        json.dump({"rows": [{"points": 500, "torch_cpu_ms": 1.0, "ours_v4_ms": 0.5},
                            {"points": 5000, "torch_cpu_ms": 2.0, "ours_v4_ms": 0.6}], "epochs": 200, "gpu": "none",
                   "date": "today", "breakdown_us": {"forward": 1, "loss": 1, "gradient": 1, "update": 1,
                                                     "fused": 2}}, f)

    gen = os.path.join(SCRIPTS, "generate.py")
    # writer: (name, argv(out) -> list, kind ("file" or "dir"), needs_work: words a refusal must come before)
    writers = [
        ("train_linreg --save_data", lambda o: [LINREG, "--device", "cpu", "--points", "300", "--epochs", "3",
                                                "--log_every", "1", "--save_data", o], "epoch"),
        ("train_linreg --result_file", lambda o: [LINREG, "--device", "cpu", "--points", "300", "--epochs", "3",
                                                  "--log_every", "1", "--result_file", o], "epoch"),
        ("generate.py --out", lambda o: [PY, gen, "--checkpoint", ck, "--out", o, "--device", "cpu",
                                         "--num_samples", "2", "--sampler", "ddim", "--steps", "2"], "step 1/"),
        ("generate.py --out_bin", lambda o: [PY, gen, "--checkpoint", ck, "--out", os.path.join(
            tempfile.mkdtemp(dir=tmp), "grid.png"), "--out_bin", o, "--device", "cpu", "--num_samples", "2",
            "--sampler", "ddim", "--steps", "2"], "step 1/"),
        ("csv_to_linreg.py", lambda o: [PY, os.path.join(SCRIPTS, "csv_to_linreg.py"), csv_path, o], None),
        ("convert.py --output", lambda o: [PY, os.path.join(SCRIPTS, "convert.py"), "--input", ck, "--output", o],
         None),
        ("prepare_data.py --output", lambda o: [PY, os.path.join(SCRIPTS, "prepare_data.py"), "--input_dir", img_dir,
                                                "--output", o, "--image_size", "8"], None),
        ("plot_loss.py --out", lambda o: [PY, os.path.join(SCRIPTS, "plot_loss.py"), "--log", log_csv, "--out", o],
         None),
        ("plot_softmax.py --out", lambda o: [PY, os.path.join(SCRIPTS, "plot_softmax.py"), "--csv", sm_csv, "--out",
                                             o], None),
        ("train_unet --sample", lambda o: [UNET, "--sample", o, "--load", ck, "--use_ema", "1", "--num_samples",
                                           "1"], None),
        ("train_mnist --checkpoint", lambda o: [MNIST, "--device", "cpu", "--data_dir", MNIST_DATA, "--epochs", "1",
                                                "--batch_size", "4", "--confusion", "0", "--checkpoint", o],
         "epoch "),
    ]
    cases = []
    for name, argv, work_word in writers:
        ext = ".png" if "png" in name or "plot" in name or name == "generate.py --out" else ".bin"
        if "result_file" in name:
            ext = ".json"
        for label in ("a directory", "a device node", "a FIFO", "a missing folder", "a symlink", "a full disk",
                      "an unwritable folder"):
            if name == "train_unet --sample" and label in ("a symlink", "a full disk"):
                continue  # writes only after sampling on a GPU
            cases.append(("output paths", f"{name}: {label}",
                          lambda name=name, argv=argv, label=label, ext=ext, work_word=work_word:
                          output_case(tmp, name, argv, label, ext, work_word)))
    # plot_linreg writes two PNGs into --out (a folder)
    for label in ("a file as the folder", "a missing folder"):
        cases.append(("output paths", f"plot_linreg.py --out: {label}",
                      lambda label=label: plot_linreg_case(tmp, lin_json, label)))
    # train_unet --output_dir: checked at start-up, before the GPU is needed
    for label in ("a file as the folder", "model.bin a directory", "model.bin a device node", "log.csv a directory",
                  "an unwritable folder"):
        cases.append(("output paths", f"train_unet --output_dir: {label}",
                      lambda label=label: unet_output_dir_case(tmp, label)))
    # binio.write in process
    for label in ("a directory", "a device node", "a symlink", "a full disk", "a missing folder"):
        cases.append(("output paths", f"binio.write: {label}", lambda label=label: binio_write_case(tmp, label)))
    return cases


def leftovers(folder, before):
    return sorted(set(os.listdir(folder)) - set(before))


def output_case(tmp, name, argv_fn, label, ext, work_word):
    work = tempfile.mkdtemp(dir=tmp)
    os.chmod(work, 0o777)
    try:
        out = os.path.join(work, "out" + ext)
        fsize, no_dac, expect, words = None, False, "reject", []
        if label == "a directory":
            os.mkdir(out)
            words = ["directory"]
        elif label == "a device node":
            kind = make_device_node(out)
            words = ["not a regular file"]
        elif label == "a FIFO":
            os.mkfifo(out)
            words = ["not a regular file"]
        elif label == "a missing folder":
            out = os.path.join(work, "missing", "out" + ext)
            words = ["does not exist", "No such file", "no such"]
        elif label == "a symlink":
            target = os.path.join(work, "target" + ext)
            with open(target, "wb") as f:
                f.write(b"old")
            os.symlink(target, out)
            expect = "accept"
        elif label == "a full disk":
            with open(out, "wb") as f:
                f.write(b"old")
            # 0 KB: not even a small PNG or JSON fits; 1 KB: generate's grid fits, its --out_bin not
            fsize, words = (1 if ext == ".bin" else 0), ["File too large", "No space", "write"]
        elif label == "an unwritable folder":
            sub = os.path.join(work, "locked")
            os.mkdir(sub)
            out = os.path.join(sub, "out" + ext)
            os.chmod(sub, 0o555)
            no_dac, words = True, ["Permission denied", "permission denied", "not writable", "cannot write"]
        folder = os.path.dirname(out)
        before = os.listdir(folder) if os.path.isdir(folder) else []
        res = run(argv_fn(out), fsize_kb=fsize, no_dac=no_dac)
        if res.code == 97 and no_dac:
            raise SkipCase("cannot drop CAP_DAC_OVERRIDE here")
        reason = judge(res, expect, out, words)
        if reason:
            return reason
        if os.path.isdir(folder):
            extra = [f for f in leftovers(folder, before) if f.endswith(".tmp") or ".tmp" in f]
            if extra:
                return f"left {extra} behind"
        if label in ("a device node", "a FIFO") and not is_node(out):
            return f"replaced the {label[2:]} {out} (it is no longer a device node or FIFO)"
        if label == "a directory" and not os.path.isdir(out):
            return "replaced the directory"
        if label == "a symlink":
            if not os.path.islink(out):
                return "replaced the symlink by a file (its target left stale)"
            if open(target, "rb").read() == b"old":
                return "the symlink's target was not written"
            if "symlink" not in res.out or target not in res.out:
                return f"did not say that it wrote through the symlink to {target}: {tail(res.out)}"
        if label == "a full disk" and open(out, "rb").read() != b"old":
            return "the previous file was replaced by a partial one"
        if work_word and work_word in res.out and label not in ("a symlink", "a full disk"):
            return f"refused {label} only after the work ('{work_word}' printed)"
        return None
    finally:
        for root, dirs, _ in os.walk(work):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777)
        shutil.rmtree(work, ignore_errors=True)


def plot_linreg_case(tmp, lin_json, label):
    work = tempfile.mkdtemp(dir=tmp)
    try:
        out = os.path.join(work, "charts")
        if label == "a file as the folder":
            open(out, "w").close()
            words = ["not a directory", "directory"]
        else:
            out = os.path.join(work, "missing", "charts")
            words = ["does not exist", "No such"]
        res = run([PY, os.path.join(SCRIPTS, "plot_linreg.py"), lin_json, "--out", out])
        return judge(res, "reject", out, words)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def unet_output_dir_case(tmp, label):
    work = tempfile.mkdtemp(dir=tmp)
    os.chmod(work, 0o777)
    try:
        out = os.path.join(work, "run")
        no_dac = False
        if label == "a file as the folder":
            open(out, "w").close()
            bad, words = out, ["not a directory", "directory"]
        elif label == "model.bin a directory":
            os.makedirs(os.path.join(out, "model.bin"))
            bad, words = os.path.join(out, "model.bin"), ["directory"]
        elif label == "model.bin a device node":
            os.makedirs(out)
            make_device_node(os.path.join(out, "model.bin"))
            bad, words = os.path.join(out, "model.bin"), ["not a regular file"]
        elif label == "log.csv a directory":
            os.makedirs(os.path.join(out, "log.csv"))
            bad, words = os.path.join(out, "log.csv"), ["directory"]
        else:
            os.makedirs(out)
            os.chmod(out, 0o555)
            bad, words, no_dac = out, ["Permission denied", "not writable"], True
        res = run([UNET, "--data_file", TINY_DS, "--output_dir", out, "--steps", "10", "--batch_size", "4"]
                  + TINY_FLAGS, no_dac=no_dac)
        if res.code == 97 and no_dac:
            raise SkipCase("cannot drop CAP_DAC_OVERRIDE here")
        reason = judge(res, "reject", bad, words)
        if reason is None and label == "model.bin a device node" and not is_node(bad):
            reason = "replaced the device node"
        return reason
    finally:
        for root, dirs, _ in os.walk(work):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777)
        shutil.rmtree(work, ignore_errors=True)


def binio_write_case(tmp, label):
    work = tempfile.mkdtemp(dir=tmp)
    try:
        out = os.path.join(work, "w.bin")
        expect, words = "reject", []
        if label == "a directory":
            os.mkdir(out)
            words = ["directory"]
        elif label == "a device node":
            make_device_node(out)
            words = ["not a regular file"]
        elif label == "a missing folder":
            out = os.path.join(work, "missing", "w.bin")
            words = ["does not exist", "No such"]
        elif label == "a symlink":
            target = os.path.join(work, "target.bin")
            open(target, "wb").write(b"old")
            os.symlink(target, out)
            expect = "accept"
        elif label == "a full disk":
            open(out, "wb").write(b"old")
            words = ["File too large", "No space"]
        data = np.arange(4096, dtype=np.float32)

        def write():
            binio.write(out, binio.SOFTMAX_FIXTURE, {"n_cases": 1, "seed": 0}, {"case0.x": data})

        if label == "a full disk":  # RLIMIT_FSIZE is per process: in a child, not in this threaded one
            prog = ("import sys, numpy as np; sys.path.insert(0, sys.argv[1]); import binio\n"
                    "try:\n    binio.write(sys.argv[2], binio.SOFTMAX_FIXTURE, {'n_cases': 1, 'seed': 0},"
                    " {'case0.x': np.arange(4096, dtype=np.float32)})\n"
                    "except binio.FormatError as e:\n    sys.exit(f'error: {e}')\n")
            reason = judge(run([PY, "-c", prog, SCRIPTS, out], fsize_kb=2), "reject", out, words)
            if reason:
                return reason
            write = None
        folder = os.path.dirname(out)
        before = os.listdir(folder) if os.path.isdir(folder) else []
        reason = judge_inproc(write, expect, out, words) if write else None
        if reason:
            return reason
        if os.path.isdir(folder) and [f for f in leftovers(folder, before) if ".tmp" in f]:
            return f"left {leftovers(folder, before)} behind"
        if label == "a device node" and not is_node(out):
            return "replaced the device node"
        if label == "a symlink" and not (os.path.islink(out) and open(target, "rb").read() != b"old"):
            return "did not write through the symlink to its target"
        if label == "a full disk" and open(out, "rb").read() != b"old":
            return "the previous file was replaced by a partial one"
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# the scripts' own inputs (text files, flags)


def script_input_cases(tmp):
    d = os.path.join(tmp, "text")
    os.makedirs(d, exist_ok=True)

    def text(name, data):
        p = os.path.join(d, name)
        with open(p, "wb") as f:
            f.write(data)
        return p

    fifo = os.path.join(d, "fifo")
    os.mkfifo(fifo)
    latin = text("latin1.csv", "a,y\n1,2\n3,caf\xe9\n5,6\n".encode("latin-1"))
    nul = text("nul.csv", b"a,y\n1,2\n3,\x004\n5,6\n")
    huge_field = text("huge_field.csv", b"a,y\n1,2\n3," + b"9" * 200000 + b"\n5,6\n")
    empty = text("empty.csv", b"")
    good_csv = text("good.csv", b"a,y\n1,2\n3,4\n5,6\n7,8\n")
    out = os.path.join(d, "o.bin")
    c2l = os.path.join(SCRIPTS, "csv_to_linreg.py")
    logs = os.path.join(SCRIPTS, "plot_loss.py")
    smx = os.path.join(SCRIPTS, "plot_softmax.py")
    pl = os.path.join(SCRIPTS, "plot_linreg.py")
    gen = os.path.join(SCRIPTS, "generate.py")
    ck = os.path.join(tmp, "out_ck.bin")
    png = os.path.join(d, "o.png")
    log_latin = text("log_latin.csv", "step,loss,ms,images_per_s\n1,0.5,60,5\xe9\n".encode("latin-1"))
    log_nul = text("log_nul.csv", b"step,loss,ms,images_per_s\n1,0.5,\x0060,5\n")
    sm_bad = text("sm_bad.csv", b"op,cols,impl,gbps\nforward,abc,ours,1\n")
    sm_latin = text("sm_latin.csv", "op,cols,impl,gbps\nforward,1,\xe9,1\n".encode("latin-1"))
    js_bad = text("bad.json", b"{not json")
    js_keys = text("keys.json", b'{"rows": []}')
    js_latin = text("latin.json", b'{"rows": "\xe9"}')
    cases = [
        ("csv_to_linreg.py: a Latin-1 CSV", [PY, c2l, latin, out], latin, ["UTF-8"]),
        ("csv_to_linreg.py: a NUL byte", [PY, c2l, nul, out], nul, ["NUL", "line 3"]),
        ("csv_to_linreg.py: a 200 kB field", [PY, c2l, huge_field, out], huge_field, ["line 3", "field"]),
        ("csv_to_linreg.py: an empty file", [PY, c2l, empty, out], empty, ["header", "lines"]),
        ("csv_to_linreg.py: /dev/zero", [PY, c2l, "/dev/zero", out], "/dev/zero", ["not a regular file"]),
        ("csv_to_linreg.py: a FIFO", [PY, c2l, fifo, out], fifo, ["not a regular file"]),
        ("csv_to_linreg.py: a directory", [PY, c2l, d, out], d, ["directory"]),
        ("csv_to_linreg.py: a missing file", [PY, c2l, os.path.join(d, "none.csv"), out],
         os.path.join(d, "none.csv"), ["No such file"]),
        ("csv_to_linreg.py: --seed -1", [PY, c2l, good_csv, out, "--seed", "-1"], None, ["--seed"]),
        ("csv_to_linreg.py: --split nan", [PY, c2l, good_csv, out, "--split", "nan"], None, ["--split"]),
        ("plot_loss.py: /dev/zero", [PY, logs, "--log", "/dev/zero", "--out", png], "/dev/zero",
         ["not a regular file"]),
        ("plot_loss.py: a FIFO", [PY, logs, "--log", fifo, "--out", png], fifo, ["not a regular file"]),
        ("plot_loss.py: a Latin-1 log", [PY, logs, "--log", log_latin, "--out", png], log_latin, ["UTF-8"]),
        ("plot_loss.py: a NUL byte", [PY, logs, "--log", log_nul, "--out", png], log_nul, ["NUL", "line 2"]),
        ("plot_loss.py: --smooth nan", [PY, logs, "--log", log_nul, "--out", png, "--smooth", "nan"], None,
         ["--smooth"]),
        ("plot_softmax.py: a bad number", [PY, smx, "--csv", sm_bad, "--out", png], sm_bad, ["cols", "line 2"]),
        ("plot_softmax.py: a Latin-1 CSV", [PY, smx, "--csv", sm_latin, "--out", png], sm_latin, ["UTF-8"]),
        ("plot_softmax.py: /dev/zero", [PY, smx, "--csv", "/dev/zero", "--out", png], "/dev/zero",
         ["not a regular file"]),
        ("plot_softmax.py: --copy_gbps nan", [PY, smx, "--csv", sm_bad, "--out", png, "--copy_gbps", "nan"], None,
         ["--copy_gbps"]),
        ("plot_linreg.py: not JSON", [PY, pl, js_bad, "--out", d], js_bad, ["JSON"]),
        ("plot_linreg.py: missing keys", [PY, pl, js_keys, "--out", d], js_keys, ["epochs", "key", "rows"]),
        ("plot_linreg.py: Latin-1", [PY, pl, js_latin, "--out", d], js_latin, ["UTF-8"]),
        ("plot_linreg.py: /dev/zero", [PY, pl, "/dev/zero", "--out", d], "/dev/zero", ["not a regular file"]),
        ("plot_linreg.py: a directory", [PY, pl, d, "--out", d], d, ["directory"]),
        ("generate.py: --seed -1", [PY, gen, "--checkpoint", ck, "--out", png, "--device", "cpu", "--seed", "-1"],
         None, ["--seed"]),
        ("generate.py: --seed 2**64", [PY, gen, "--checkpoint", ck, "--out", png, "--device", "cpu", "--seed",
                                       str(2**64)], None, ["--seed"]),
        ("generate.py: --num_samples 10**9", [PY, gen, "--checkpoint", ck, "--out", png, "--device", "cpu",
                                              "--num_samples", str(10**9)], None, ["--num_samples"]),
        ("generate.py: --steps 10**9", [PY, gen, "--checkpoint", ck, "--out", png, "--device", "cpu", "--sampler",
                                        "ddim", "--steps", str(10**9)], None, ["--steps"]),
        ("generate.py: --out without .png", [PY, gen, "--checkpoint", ck, "--out", os.path.join(d, "x.jpg")],
         os.path.join(d, "x.jpg"), [".png"]),
        ("prepare_data.py: --input_dir a file", [PY, os.path.join(SCRIPTS, "prepare_data.py"), "--input_dir",
                                                 good_csv, "--output", out], good_csv, ["folder", "directory"]),
        ("prepare_data.py: --input_dir /dev/zero", [PY, os.path.join(SCRIPTS, "prepare_data.py"), "--input_dir",
                                                    "/dev/zero", "--output", out], "/dev/zero", ["folder", "directory"]),
    ]
    result = []
    for name, argv, path, words in cases:
        result.append(("script inputs", name, lambda argv=argv, path=path, words=words:
                       judge(run(argv), "reject", path, words)))
    return result


def dev_tool_cases():
    """The dev/*.py tools a user runs: --help needs neither a GPU nor PyTorch, and a missing PyTorch is a one-line
    error, not a traceback."""
    tools = ["unet.py", "linreg.py", "mnist.py", "softmax.py", "unet_layers.py", "unet_sample_ref.py",
             "bench_linreg.py", "bench_mnist.py", "bench_unet.py", "run_benchmarks.py", "mnist_dgrad_model.py",
             "cnn_custom.py"]
    out = []
    for t in tools:
        def fn(t=t):
            res = run([PY, os.path.join(ROOT, "dev", t), "--help"])
            if res.timed_out or res.code not in (0, 1) or any(w in res.out for w in CRASH_WORDS):
                return f"--help: exit {res.code}: {tail(res.out)}"
            if res.code == 1 and len(error_lines(res.out)) != 1:
                return f"--help failed without one error line: {tail(res.out)}"
            return None
        out.append(("dev tools", f"dev/{t} --help", fn))
    return out


# ----------------------------------------------------------------------------------------------------------------
# the defects dev/probe_inputs.py found (2026-11-26), one case each: flags, contradicting flags, output paths, stdout


def probe_regression_cases(tmp):
    """(group, case, fn) for what the independent probe found: argparse's exit 2 and usage block, outputs whose
    temporary file name is too long or that are a symlink loop (refused only after the work, or the link replaced),
    an output that replaces the program's input, flags that --data_file / --eval_only / ddpm ignore, a path flag
    that swallowed the next flag's name, too many CPU threads, duplicate tensor names, Python-only number syntax
    in a CSV, 16-bit images clipped, and a full or ASCII-only stdout."""
    d = os.path.join(tmp, "probe")
    os.makedirs(d, exist_ok=True)
    g = "probe regressions"
    cases = []

    def add(name, fn):
        cases.append((g, name, fn))

    def rejects(name, argv, path=None, words=(), work_word=None):
        def fn():
            res = run(argv, cwd=d)  # a run that takes a flag's name as a path writes it here, not in the repository
            reason = judge(res, "reject", path, words)
            if reason is None and work_word and work_word in res.out:
                return f"refused only after the work ('{work_word}' printed): {tail(res.out)}"
            return reason
        add(name, fn)

    csv_path = os.path.join(d, "ok.csv")
    with open(csv_path, "w") as f:
        f.write("a,b,y\n" + "".join(f"{i},{i % 7},{2 * i + 1}\n" for i in range(20)))
    log_csv = os.path.join(d, "log.csv")
    with open(log_csv, "w") as f:
        f.write("step,loss,ms,images_per_s\n" + "".join(f"{i},{1.0 / i:.4f},60,500\n" for i in range(1, 30)))
    ck = os.path.join(d, "ck.bin")
    tiny_checkpoint(ck, optimizer=False)
    gen, c2l = os.path.join(SCRIPTS, "generate.py"), os.path.join(SCRIPTS, "csv_to_linreg.py")
    plot_loss, prep = os.path.join(SCRIPTS, "plot_loss.py"), os.path.join(SCRIPTS, "prepare_data.py")
    # argparse's own errors: exit 2 and a usage block before them; the project's: one error line, exit 1
    for script, argv, flag in [
            ("csv_to_linreg.py", [c2l, csv_path, os.path.join(d, "o.bin"), "--seed", "12abc"], "--seed"),
            ("generate.py", [gen, "--checkpoint", ck, "--num_samples", "12abc"], "--num_samples"),
            ("plot_loss.py", [plot_loss, "--smooth", "x"], "--smooth"),
            ("plot_softmax.py", [os.path.join(SCRIPTS, "plot_softmax.py"), "--copy_gbps", "1,5"], "--copy_gbps"),
            ("plot_linreg.py", [os.path.join(SCRIPTS, "plot_linreg.py"), log_csv, "--bogus"], "--bogus"),
            ("prepare_data.py", [prep, "--input_dir", d, "--image_size", "64px"], "--image_size")]:
        rejects(f"{script}: a bad flag value is one error line and exit 1", [PY] + argv, None, [flag])
    # an output whose name is valid but whose temporary file's name (name + 7 or more characters) is not
    long_name = os.path.join(d, "m" * 250)
    rejects("train_linreg --result_file: a 250-character name", [LINREG, "--device", "cpu", "--points", "300",
                                                                 "--epochs", "2", "--log_every", "1",
                                                                 "--result_file", long_name],
            long_name, ["too long"], "epoch")
    rejects("train_mnist --checkpoint: a 250-character name", [MNIST, "--device", "cpu", "--data_dir", MNIST_DATA,
                                                               "--epochs", "1", "--batch_size", "4", "--confusion",
                                                               "0", "--checkpoint", long_name],
            long_name, ["too long"], "epoch ")
    rejects("train_unet --sample: a 250-character name", [UNET, "--sample", long_name, "--load", ck], long_name,
            ["too long"])
    too_long = os.path.join(d, "n" * 260)
    rejects("train_unet --output_dir: a 260-character name", [UNET, "--data_file", TINY_DS, "--output_dir",
                                                              too_long, "--steps", "10", "--batch_size", "4"]
            + TINY_FLAGS, too_long, ["too long"])
    # a symlink loop as an output: refused, the links left as they were

    def loop_case(name, argv_fn, work_word):
        def fn():
            a, b = os.path.join(d, f"loop_{len(name)}_{abs(hash(name)) % 10**6}_a"), None
            b = a[:-1] + "b"
            os.symlink(b, a)
            os.symlink(a, b)
            res = run(argv_fn(a))
            reason = judge(res, "reject", a, ["symbolic links"])
            if reason is None and not (os.path.islink(a) and os.path.islink(b)):
                return "a link of the loop was replaced"
            if reason is None and work_word and work_word in res.out:
                return f"refused only after the work: {tail(res.out)}"
            return reason
        add(name, fn)

    loop_case("train_linreg --result_file: a symlink loop", lambda p: [LINREG, "--device", "cpu", "--points", "300",
                                                                       "--epochs", "2", "--log_every", "1",
                                                                       "--result_file", p], "epoch")
    loop_case("train_mnist --checkpoint: a symlink loop", lambda p: [MNIST, "--device", "cpu", "--data_dir",
                                                                     MNIST_DATA, "--epochs", "1", "--batch_size", "4",
                                                                     "--confusion", "0", "--checkpoint", p], "epoch ")
    loop_case("train_unet --sample: a symlink loop", lambda p: [UNET, "--sample", p, "--load", ck], None)
    # flags a mode ignores, or that contradict another
    lr_ds = os.path.join(d, "lr.bin")
    tiny_linreg(lr_ds)
    for flag, v in [("points", "100"), ("seed", "5"), ("x_min", "-5"), ("x_max", "5"), ("w_true", "2"),
                    ("b_true", "1"), ("noise_std", "1")]:
        rejects(f"train_linreg --data_file with --{flag}", [LINREG, "--device", "cpu", "--data_file", lr_ds,
                                                             "--epochs", "2", f"--{flag}", v], None, [f"--{flag}"])
    both = os.path.join(d, "both.out")
    rejects("train_linreg --save_data and --result_file one path", [LINREG, "--device", "cpu", "--points", "300",
                                                                     "--epochs", "2", "--save_data", both,
                                                                     "--result_file", both], both, ["--result_file"])
    rejects("train_mnist --eval_only 1 with --checkpoint", [MNIST, "--device", "cpu", "--data_dir", MNIST_DATA,
                                                            "--eval_only", "1", "--load", MNIST_CK, "--checkpoint",
                                                            os.path.join(d, "never.bin")], None, ["--checkpoint"])
    rejects("train_unet --sampler ddpm with --sample_steps", [UNET, "--sample", os.path.join(d, "s.bin"), "--load",
                                                              ck, "--sampler", "ddpm", "--sample_steps", "10"],
            None, ["--sample_steps"])
    # a path flag that swallowed the next flag's name
    rejects("train_linreg --result_file --save_data", [LINREG, "--device", "cpu", "--points", "300", "--epochs", "2",
                                                       "--result_file", "--save_data"], None, ["--result_file"])
    rejects("train_mnist --checkpoint --resume", [MNIST, "--device", "cpu", "--data_dir", MNIST_DATA, "--epochs",
                                                  "1", "--batch_size", "4", "--checkpoint", "--resume"], None,
            ["--checkpoint"])
    rejects("train_unet --output_dir --resume", [UNET, "--data_file", TINY_DS, "--steps", "10", "--batch_size", "4"]
            + TINY_FLAGS + ["--output_dir", "--resume"], None, ["--output_dir"])
    # more CPU threads than the address space bound lets start: a clean error or fewer threads, never an abort
    add("train_mnist --cpu_threads 1024", lambda: judge(run([MNIST, "--device", "cpu", "--data_dir", MNIST_DATA,
                                                             "--epochs", "1", "--batch_size", "4", "--confusion", "0",
                                                             "--cpu_threads", "1024"]), "either", None,
                                                        ["--cpu_threads", "thread"]))
    # an output that would replace the program's own input

    def self_overwrite(name, argv_fn, src):
        def fn():
            own = os.path.join(tempfile.mkdtemp(dir=d), os.path.basename(src))
            shutil.copy(src, own)
            before = open(own, "rb").read()
            reason = judge(run(argv_fn(own)), "reject", own, ["same file"])
            if reason is None and open(own, "rb").read() != before:
                return f"{own} (the input) was changed"
            return reason
        add(name, fn)

    self_overwrite("csv_to_linreg.py: the output is the CSV", lambda p: [PY, c2l, p, p], csv_path)
    self_overwrite("plot_loss.py: --out is the log", lambda p: [PY, plot_loss, "--log", p, "--out", p], log_csv)
    self_overwrite("generate.py: --out_bin is the checkpoint", lambda p: [
        PY, gen, "--checkpoint", p, "--device", "cpu", "--num_samples", "1", "--sampler", "ddim", "--steps", "1",
        "--out", os.path.join(d, "g.png"), "--out_bin", p], ck)
    png = os.path.join(d, "same.png")
    rejects("generate.py: --out and --out_bin one path", [PY, gen, "--checkpoint", ck, "--device", "cpu",
                                                          "--num_samples", "1", "--sampler", "ddim", "--steps", "1",
                                                          "--out", png, "--out_bin", png], png, ["same file"])
    # chart data a log axis would drop without a word
    base_js = {"epochs": 200, "gpu": "none", "date": "today", "breakdown_us": {"forward": 1, "loss": 1,
                                                                               "gradient": 1, "update": 1, "fused": 2}}
    for label, rows, word in (("no rows", [], "rows"), ("a NaN time", [{"points": 500, "torch_cpu_ms": float("nan")}],
                                                         "torch_cpu_ms"),
                              ("points a string", [{"points": "abc", "torch_cpu_ms": 1.0}], "points")):
        p = os.path.join(d, f"plot_{len(label)}.json")
        with open(p, "w") as f:
            json.dump(dict(base_js, rows=rows), f)
        rejects(f"plot_linreg.py: {label}", [PY, os.path.join(SCRIPTS, "plot_linreg.py"), p, "--out", d], p, [word])
    for label, line in (("cols 0", "forward,0,ours,100"), ("gbps nan", "forward,128,ours,nan")):
        p = os.path.join(d, f"sm_{len(label)}.csv")
        with open(p, "w") as f:
            f.write(f"op,cols,impl,gbps\n{line}\n")
        rejects(f"plot_softmax.py: {label}", [PY, os.path.join(SCRIPTS, "plot_softmax.py"), "--csv", p, "--out",
                                              os.path.join(d, "sm.png")], p, ["line 2"])
    # a table with two entries of one name: the reader must not keep one silently
    dup = os.path.join(d, "dup.bin")
    binio.write(dup, binio.LINREG_DATASET, dict(n_points=3, n_features=1, n_train=2, seed=0, w_true=0.0, b_true=0.0,
                                                noise_std=0.0, x_min=0.0, x_max=0.0),
                {"x": np.zeros((3, 1), np.float32), "y": np.zeros(3, np.float32)})
    raw = bytearray(open(dup, "rb").read())
    raw[1024 + 128:1024 + 128 + 2] = b"x\0"  # entry 1 "y" renamed "x": same dtype, shape (3,) against (3, 1)
    open(dup, "wb").write(bytes(raw))
    add("binio.read: two entries named x", lambda: judge_inproc(lambda: binio.read(dup, binio.LINREG_DATASET),
                                                                "reject", dup, ["twice"]))
    # numbers only Python's float() reads
    for label, cell in (("1_000", "1_000"), ("fullwidth digits", "\uff11\uff12")):
        p = os.path.join(d, f"num_{len(cell)}.csv")
        with open(p, "w", encoding="utf-8") as f:
            f.write(f"a,y\n1,2\n{cell},4\n5,6\n")
        rejects(f"csv_to_linreg.py: {label}", [PY, c2l, p, os.path.join(d, "o.bin")], p, ["line 3"])
    # a 16-bit grayscale PNG: scaled to 8 bits, not clipped to white
    from PIL import Image
    img16 = os.path.join(d, "img16")
    os.makedirs(img16, exist_ok=True)
    Image.fromarray(np.full((16, 16), 30000, np.uint16)).save(os.path.join(img16, "a.png"))
    out16 = os.path.join(d, "img16.bin")

    def sixteen_bit():
        reason = judge(run([PY, prep, "--input_dir", img16, "--output", out16, "--image_size", "8"]), "accept")
        if reason:
            return reason
        v = int(binio.read(out16, binio.UNET_DATASET)[2]["images"].reshape(-1)[0])
        return None if abs(v - 117) <= 1 else f"a 16-bit value of 30000 became {v}, expected 117 (30000 / 257)"
    add("prepare_data.py: a 16-bit grayscale PNG", sixteen_bit)
    # stdout full, or ASCII only with a non-ASCII path: a line on stderr and exit 1, or a clean exit; no traceback
    uni = os.path.join(d, "d\u00e9j\u00e0")
    os.makedirs(uni, exist_ok=True)
    for label, shell, env in (("stdout on /dev/full", "exec 1>/dev/full; ", {}),
                              ("PYTHONIOENCODING=ascii", "", {"PYTHONIOENCODING": "ascii"})):
        for script, argv in (("plot_loss.py", [plot_loss, "--log", log_csv, "--out", os.path.join(uni, "l.png")]),
                             ("csv_to_linreg.py", [c2l, csv_path, os.path.join(uni, "o.bin")])):
            def fn(shell=shell, env=env, argv=argv):
                p = subprocess.run(["bash", "-c", shell + 'exec "$@"', "fuzz", PY] + argv, cwd=ROOT,
                                   env=dict(ENV, **env), capture_output=True, text=True, errors="replace",
                                   timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
                return judge(Res(p.returncode, p.stdout + p.stderr, 0), "either", None, ["stdout"])
            add(f"{script}: {label}", fn)
    return cases


# ----------------------------------------------------------------------------------------------------------------
# train_mnist: its checkpoints and the MNIST IDX .gz files through ./train_mnist and dev/mnist.py, special paths,
# its --checkpoint output (with the output cases above)

MNIST_PY = os.path.join(ROOT, "dev", "mnist.py")
MNIST_CK_META = dict(epoch=1, step=2, batch_size=4, seed=7, optimizer=0, has_optimizer=1, epochs=2, lr=0.05,
                     test_accuracy=50.0, lr_schedule=1, warmup_steps=2, lr_min=0.0, momentum=0.9, weight_decay=5e-4,
                     beta1=0.9, beta2=0.999, eps=1e-8, train_images=8,  # epoch 1 of 2: 2 steps of 4 over 8 images
                     muon_lr=0.02, muon_momentum=0.95, muon_nesterov=1, ns_steps=5, graft=0, precond_every=20,
                     precond_start=20, max_precond_dim=1024, precond_eps=1e-12, precond_damping=1e-3,
                     clip_per_sample=0.0, noise_multiplier=0.0, precond=0, fisher_power=0.5, kfac_stat_decay=0.0,
                     precond_delay=0)
# every field a checkpoint header may hold, as data/README.md documents (inclusive); lr_min: up to lr
MNIST_CK_RANGES = {"epochs": (1, 10000), "batch_size": (1, 2048), "seed": (0, INT_MAX), "lr_schedule": (0, 2),
                   "warmup_steps": (0, 10**8), "lr": (1e-9, 1e9), "test_accuracy": (0.0, 100.0),
                   "lr_min": (0.0, 0.05), "momentum": (0.0, 0.999999), "weight_decay": (0.0, 10.0),
                   "beta1": (0.0, 0.999999), "beta2": (0.0, 0.999999), "eps": (1e-30, 1.0),
                   "muon_lr": (1e-9, 1e9), "muon_momentum": (0.0, 0.999999), "muon_nesterov": (0, 1),
                   "ns_steps": (1, 99), "graft": (0, 1), "precond_every": (1, 10**8), "precond_start": (0, 10**8),
                   "max_precond_dim": (1, 16384), "precond_eps": (0.0, 1.0), "precond_damping": (0.0, 10.0),
                   # in range: accepted, or refused as a combination (noise without a clip norm, fisher_diag without
                   # its tensors); kfac_stat_decay is 0 for every optimizer but K-FAC, precond_delay for every
                   # optimizer but Shampoo and K-FAC
                   "clip_per_sample": (0.0, 1e9), "noise_multiplier": (0.0, 1e9), "precond": (0, 1),
                   "fisher_power": (0.0, 1.0), "kfac_stat_decay": (0.0, 0.0),
                   "precond_delay": (0, 0)}
TRAINING_STOPS = ["error: training loss is", "error: the training loss diverges"]  # a run that started: accepted
NO_TORCH = "needs PyTorch"  # dev/mnist.py after its inputs passed, where PyTorch is missing


def mnist_idx(count, images, seed=4):
    rng = np.random.default_rng(seed)
    if images:
        return (np.array([2051, count, 28, 28], ">u4").tobytes()
                + rng.integers(0, 256, count * 784, dtype=np.uint8).tobytes())
    return np.array([2049, count], ">u4").tobytes() + (np.arange(count) % 10).astype(np.uint8).tobytes()


MNIST_FILES = {"train-images-idx3-ubyte.gz": (8, True), "train-labels-idx1-ubyte.gz": (8, False),
               "t10k-images-idx3-ubyte.gz": (8, True), "t10k-labels-idx1-ubyte.gz": (8, False)}


def mnist_data_dir(path, replace=None):
    """A data folder of 8 training and 8 test images (gzip, stored blocks so that a flipped byte changes data, not
    the stream); replace: {file name: raw bytes to write instead} (None: leave the file out)."""
    os.makedirs(path, exist_ok=True)
    for name, (count, images) in MNIST_FILES.items():
        raw = gzip.compress(mnist_idx(count, images), compresslevel=0, mtime=0)
        if replace and name in replace:
            raw = replace[name]
        if raw is not None:
            with open(os.path.join(path, name), "wb") as f:
                f.write(raw)
    return path


def mnist_checkpoint(path, optimizer=0, **over):
    rng = np.random.default_rng(5)
    tensors = {n: rng.uniform(-0.05, 0.05, s).astype(np.float32) for n, s in binio.MNIST_PARAM_SHAPES}
    first = ["momentum_buffer."] if optimizer == 0 else ["adam_m.", "adam_v."]
    for prefix in first:
        tensors.update({prefix + n: np.abs(tensors[n]) * np.float32(0.01) for n, _ in binio.MNIST_PARAM_SHAPES})
    cfg = dict(MNIST_CK_META, optimizer=optimizer, **over)
    binio.write(path, binio.MNIST_CHECKPOINT, cfg, tensors)


def mnist_judge(res, expect, path, words):
    """judge, with a run that passed validation and stopped on its loss (NaN: exit 2) or found no PyTorch counted as
    an acceptance of the file: what the file said was valid, the training it asked for was not."""
    errors = error_lines(res.out)
    if len(errors) == 1 and (any(errors[0].startswith(w) for w in TRAINING_STOPS) or NO_TORCH in errors[0]):
        res = Res(0, res.out, res.secs)
    return judge(res, expect, path, words)


def mnist_reader(argv_fn):
    def read(path, work, expect, words):
        return mnist_judge(run(argv_fn(path, work)), expect, path, words)
    return read


def mnist_idx_reader(fname, argv_fn):
    """A reader of one MNIST file: the mutant is put in a data folder of valid others."""
    def read(path, work, expect, words):
        d = mnist_data_dir(os.path.join(work, "data"), {fname: None})
        os.symlink(path, os.path.join(d, fname))
        return mnist_judge(run(argv_fn(d, work)), expect, [path, os.path.join(d, fname)], words)
    return read


def mnist_read_idx(images):
    def read(path, work, expect, words):
        import mnist  # dev/mnist.py (its readers need no PyTorch)
        return judge_inproc(lambda: mnist.read_idx(path, images), expect, path, words)
    return read


def setup_mnist(tmp):
    global MNIST_DATA, MNIST_CK
    MNIST_DATA = mnist_data_dir(os.path.join(tmp, "mnist_data"))
    MNIST_CK = os.path.join(tmp, "mnist_ck.bin")
    mnist_checkpoint(MNIST_CK)
    sys.path.insert(0, os.path.join(ROOT, "dev"))
    base = [MNIST, "--device", "cpu", "--confusion", "0"]
    READERS.update({
        "train_mnist --load": mnist_reader(lambda p, w: base + ["--data_dir", MNIST_DATA, "--eval_only", "1",
                                                                "--load", p]),
        "train_mnist --resume": mnist_reader(lambda p, w: base + ["--data_dir", MNIST_DATA, "--resume", p]),
        "dev/mnist.py --eval_checkpoint": mnist_reader(lambda p, w: [PY, MNIST_PY, "--device", "cpu", "--data_dir",
                                                                     MNIST_DATA, "--eval_checkpoint", p]),
        "binio.read mnist checkpoint": inproc_reader(binio.MNIST_CHECKPOINT),
        "mnist.py read_idx images": mnist_read_idx(True),
        "mnist.py read_idx labels": mnist_read_idx(False),
    })
    for fname in MNIST_FILES:
        if fname.startswith("train"):
            READERS[f"train_mnist --data_dir ({fname})"] = mnist_idx_reader(fname, lambda d, w: base + [
                "--data_dir", d, "--epochs", "1", "--batch_size", "4"])
        else:
            READERS[f"train_mnist --eval_only ({fname})"] = mnist_idx_reader(fname, lambda d, w: base + [
                "--data_dir", d, "--eval_only", "1", "--load", MNIST_CK])
    NO_DAC_ARGV.update({
        "train_mnist --load": lambda p, w: base + ["--data_dir", MNIST_DATA, "--eval_only", "1", "--load", p],
        "train_mnist --resume": lambda p, w: base + ["--data_dir", MNIST_DATA, "--resume", p],
        "dev/mnist.py --eval_checkpoint": lambda p, w: [PY, MNIST_PY, "--device", "cpu", "--data_dir", MNIST_DATA,
                                                        "--eval_checkpoint", p],
    })


def mnist_checkpoint_mutants(tmp):
    raw = open(MNIST_CK, "rb").read()
    g = "mnist checkpoint"
    load, resume, py, bio = ("train_mnist --load", "train_mnist --resume", "dev/mnist.py --eval_checkpoint",
                             "binio.read mnist checkpoint")
    trainer = [load, resume]

    structural = {"magic": ["magic"], "version": ["version"], "tensor count": ["tensor count", "file length", "tensor"]}

    def policy(field, label, value, near):
        if field in structural:  # dev/mnist.py reads through binio: the structure only (and PyTorch loads slowly)
            return {r: ("reject", structural[field]) for r in trainer + [bio, py]}
        e = {bio: ("either", [])}
        if field in MNIST_CK_RANGES:
            lo, hi = MNIST_CK_RANGES[field]
            ok = lo <= np.float32(value) <= hi if isinstance(lo, float) else lo <= value <= hi
            if ok and field in ("epochs", "batch_size"):  # may disagree with epoch and step: refused by the step
                return dict(e, **{r: ("either", [field, "step", "epoch", "nothing left"]) for r in trainer})
            return dict(e, **{r: ("either" if ok else "reject", [field]) for r in trainer})
        if field == "train_images" and near:  # 7 images are 2 steps of 4 too
            return dict(e, **{r: ("either", [field, "step"]) for r in trainer})
        # epoch, step, optimizer, has_optimizer, train_images: every other value contradicts the file
        return dict(e, **{r: ("reject", [field, "step", "tensor", "missing"]) for r in trainer})

    reject_all = {r: ("reject", []) for r in trainer + [bio, py]}
    strict = dict({r: ("reject", []) for r in trainer}, **{bio: ("either", [])})
    loose = {r: ("either", []) for r in trainer + [bio]}
    out = header_mutants(g, raw, binio.MNIST_CHECKPOINT, policy)
    out += truncation_mutants(g, raw, reject_all)
    rows = table(raw)
    out += table_mutants(g, raw, [0, 4, len(rows) - 1], strict, loose)
    nan, inf = f32(float("nan")), f32(float("inf"))
    bad_data = dict({r: ("reject", ["finite"]) for r in trainer}, **{bio: ("either", [])})
    out += data_mutants(g, raw, [("conv1.weight", 0, nan, "NaN", bad_data), ("fc1.weight", 9215, inf, "inf", bad_data),
                                 ("momentum_buffer.fc2.bias", 9, f32(float("-inf")), "-inf", bad_data)])
    _, cfg, tensors = binio.read(MNIST_CK, binio.MNIST_CHECKPOINT)
    extra = os.path.join(tmp, "mnist_extra.bin")
    binio.write(extra, binio.MNIST_CHECKPOINT, cfg, dict(tensors, **{"bogus.weight": np.zeros(3, np.float32)}))
    out.append(Mutant(g, "an extra tensor bogus.weight", open(extra, "rb").read(),
                      dict({r: ("reject", ["bogus.weight"]) for r in trainer}, **{bio: ("accept", [])})))
    adam = os.path.join(tmp, "mnist_adam.bin")
    mnist_checkpoint(adam, optimizer=1)
    adam_raw = open(adam, "rb").read()
    out += data_mutants(g + " (adamw)", adam_raw, [
        ("adam_v.conv1.bias", 3, f32(-1.0), "-1 (a negative second moment)",
         dict({r: ("reject", ["adam_v", "negative"]) for r in trainer}, **{bio: ("either", [])})),
        ("adam_m.fc2.weight", 0, nan, "NaN", bad_data)])
    out.append(Mutant(g + " (adamw)", "the adamw checkpoint as written", adam_raw,
                      {load: ("accept", []), resume: ("accept", []), bio: ("accept", [])}))
    for p in (extra, adam):
        os.unlink(p)
    return out


def mnist_idx_mutants():
    """The IDX files: every header field, then the gzip stream: truncations, appended bytes, flips in the gzip header,
    the deflate data and the CRC-32 / length trailer; through ./train_mnist and dev/mnist.py."""
    out = []
    for fname, (count, images) in MNIST_FILES.items():
        if fname.startswith("t10k-labels"):
            continue
        g = f"mnist {fname}"
        cli = f"train_mnist --data_dir ({fname})" if fname.startswith("train") else f"train_mnist --eval_only ({fname})"
        py = f"mnist.py read_idx {'images' if images else 'labels'}"
        raw = mnist_idx(count, images)
        gz = gzip.compress(raw, compresslevel=0, mtime=0)

        def rj(*words):
            return {cli: ("reject", list(words)), py: ("reject", list(words))}

        accept = {cli: ("accept", []), py: ("accept", [])}
        fields = ["magic", "count"] + (["rows", "cols"] if images else [])
        for slot, field in enumerate(fields):
            v = int.from_bytes(raw[4 * slot:4 * slot + 4], "big")
            for label, value in (("0", 0), ("0xffffffff", 2**32 - 1), ("INT32_MAX", INT_MAX), ("2^31", 2**31),
                                 ("v+1", v + 1), ("v-1", v - 1)):
                if value == v or value < 0:
                    continue
                words = {"magic": ["magic"], "rows": ["rows"], "cols": ["cols"]}.get(field)
                if words is None:  # the count: out of range, or more or fewer items than the data holds
                    words = ["count"] if label not in ("v+1", "v-1") else ["truncated", "trailing"]
                mutated = set_bytes(raw, 4 * slot, int(value).to_bytes(4, "big"))
                out.append(Mutant(g, f"{field} = {label}", gzip.compress(mutated, compresslevel=0, mtime=0),
                                  rj(*words)))
        if not images:
            out.append(Mutant(g, "a label of 10", gzip.compress(raw[:-1] + b"\x0a", mtime=0), rj("label")))
        out.append(Mutant(g, "uncompressed", raw, rj("not a gzip file")))
        out.append(Mutant(g, "compressed (level 9)", gzip.compress(raw, compresslevel=9), accept))
        out.append(Mutant(g, "two gzip members", gzip.compress(raw[:10], mtime=0) + gzip.compress(raw[10:], mtime=0),
                          accept))
        out.append(Mutant(g, "an empty gzip member appended", gz + gzip.compress(b"", mtime=0), accept))
        out.append(Mutant(g, "a member with more data appended", gz + gzip.compress(b"\x01\x02", mtime=0),
                          rj("trailing bytes")))
        for label, tail_bytes in (("1 zero byte", b"\0"), ("8 bytes of garbage", b"garbage!"),
                                  ("a gzip magic alone", b"\x1f\x8b")):
            out.append(Mutant(g, f"{label} appended", gz + tail_bytes, rj("gzip", "truncated")))
        cuts = {0, 1, 2, 9, 10, 11, 15, len(gz) // 2, len(gz) - 9, len(gz) - 8, len(gz) - 5, len(gz) - 4, len(gz) - 1}
        for c in sorted(cuts):
            out.append(Mutant(g, f"truncated to {c} of {len(gz)} bytes", gz[:c],
                              rj("truncated", "not a gzip file", "gzip")))
        for i in range(8):  # the trailer: CRC-32 (4 bytes), then the length mod 2^32
            flipped = set_bytes(gz, len(gz) - 8 + i, bytes([gz[len(gz) - 8 + i] ^ 0x04]))
            out.append(Mutant(g, f"trailer byte {i} flipped", flipped, rj("CRC-32" if i < 4 else "length field")))
        first = 15 + (16 if images else 8)  # gzip header 10 + stored block header 5, then the IDX header
        for label, pos in (("the first item's byte", first), ("a middle data byte", 15 + len(raw) // 2),
                           ("the last data byte", len(gz) - 9)):
            out.append(Mutant(g, f"{label} flipped", set_bytes(gz, pos, bytes([gz[pos] ^ 0x80])), rj("CRC-32")))
        for label, pos, bit, expect in (("magic byte 0", 0, 0x01, rj("not a gzip file")),
                                        ("the method byte", 2, 0x01, rj("gzip")),
                                        ("FHCRC in the flags", 3, 0x02, rj("gzip", "truncated")),
                                        ("the mtime", 5, 0x10, accept),
                                        ("a stored block's length", 11, 0x01, rj("gzip", "truncated", "CRC-32"))):
            out.append(Mutant(g, f"{label} flipped", set_bytes(gz, pos, bytes([gz[pos] ^ bit])), expect))
    return out


def mnist_special_cases(tmp):
    """(group, case, fn): special paths as an MNIST file, as --data_dir, as a checkpoint (through every reader);
    the cases that were train_mnist's known defects before issue 26's fix are among them."""
    cases = []
    good = os.path.join(tmp, "mnist_good_images.gz")
    with open(good, "wb") as f:
        f.write(gzip.compress(mnist_idx(8, True), mtime=0))
    for label, path, expect, words, no_dac in special_inputs(tmp, good):
        for reader in ("train_mnist --data_dir (train-images-idx3-ubyte.gz)", "mnist.py read_idx images"):
            def fn(reader=reader, path=path, expect=expect, words=words, no_dac=no_dac):
                work = tempfile.mkdtemp(dir=tmp)
                try:
                    if no_dac and reader.startswith("train_mnist"):
                        d = mnist_data_dir(os.path.join(work, "data"), {"train-images-idx3-ubyte.gz": None})
                        os.symlink(path, os.path.join(d, "train-images-idx3-ubyte.gz"))
                        res = run([MNIST, "--device", "cpu", "--data_dir", d, "--epochs", "1", "--batch_size", "4"],
                                  no_dac=True)
                        if res.code == 97:
                            raise SkipCase("cannot drop CAP_DAC_OVERRIDE here")
                        return judge(res, expect, [path, os.path.join(d, "train-images-idx3-ubyte.gz")], words)
                    if no_dac:
                        argv = [PY, "-c", "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])"
                                "\nimport binio, mnist\ntry:\n    mnist.read_idx(sys.argv[3], True)\n"
                                "except binio.FormatError as e:\n    sys.exit(f'error: {e}')", SCRIPTS,
                                os.path.join(ROOT, "dev"), path]
                        res = run(argv, no_dac=True)
                        if res.code == 97:
                            raise SkipCase("cannot drop CAP_DAC_OVERRIDE here")
                        return judge(res, expect, path, words)
                    return READERS[reader](path, work, expect, words)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            cases.append(("special input paths", f"{reader}: {label}", fn))
    fifo = os.path.join(tmp, "mnist_special_fifo")
    os.mkfifo(fifo)
    a_file = os.path.join(tmp, "mnist_special_file")
    open(a_file, "w").close()
    for label, path, words in (("a regular file", a_file, ["not a directory"]),
                               ("/dev/zero", "/dev/zero", ["not a directory"]), ("a FIFO", fifo, ["not a directory"]),
                               ("a missing folder", os.path.join(tmp, "mnist_nowhere"), ["No such file"])):
        cases.append(("special input paths", f"train_mnist --data_dir: {label}",
                      lambda path=path, words=words: judge(run([MNIST, "--device", "cpu", "--data_dir", path]),
                                                           "reject", path, words)))
    d = os.path.join(tmp, "mnist_special")
    os.makedirs(d, exist_ok=True)
    for name, argv, path, words in [  # the known defects of train_mnist before issue 26's fix
        ("--eval_only 1 --load DIR", [MNIST, "--device", "cpu", "--eval_only", "1", "--load", d], d, ["directory"]),
        ("--resume DIR", [MNIST, "--device", "cpu", "--resume", d, "--train_limit", "64", "--epochs", "1"], d,
         ["directory"]),
        ("--checkpoint DIR", [MNIST, "--device", "cpu", "--checkpoint", d, "--train_limit", "64", "--test_limit",
                              "64", "--epochs", "1"], d, ["directory"]),
        ("--load /dev/zero", [MNIST, "--device", "cpu", "--eval_only", "1", "--load", "/dev/zero"], "/dev/zero",
         ["not a regular file"])]:
        cases.append(("train_mnist paths", name, lambda argv=argv, path=path, words=words:
                      judge(run(argv), "reject", path, words)))
    return cases


# ----------------------------------------------------------------------------------------------------------------


def mutant_cases(tmp, mutants):
    """One case per (mutant, reader): the file is written once, read by every reader, deleted."""
    cases = []
    for m in mutants:
        def fn(m=m):
            work = tempfile.mkdtemp(dir=tmp)
            path = os.path.join(work, "mutant.bin")
            with open(path, "wb") as f:
                f.write(m.data)
            try:
                out = []
                for reader, (expect, words) in m.expect.items():
                    try:
                        out.append((reader, READERS[reader](path, work, expect, words)))
                    except SkipCase as e:
                        out.append((reader, SkipCase(str(e))))
                return out
            finally:
                shutil.rmtree(work, ignore_errors=True)
        cases.append((m.group, m.name, fn))
    return cases


def main(argv):
    global VERBOSE
    VERBOSE = "-v" in argv
    wanted = [a for a in argv if a != "-v"]
    missing = [p for p in (UNET, LINREG, MNIST, SOFTMAX) if not os.path.isfile(p)]
    if missing:
        print(f"FAIL binaries: {missing} not found (run make and make -C dev first)")
        print("0 passed, 1 failed, 0 skipped")
        return 1
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="test_fuzz_")
    os.chmod(tmp, 0o755)
    try:
        setup_common(tmp)
        setup_mnist(tmp)
        mutants = (unet_dataset_mutants(tmp) + unet_checkpoint_mutants(tmp) + linreg_mutants(tmp)
                   + fixture_mutants() + mnist_checkpoint_mutants(tmp) + mnist_idx_mutants())
        add_convert(mutants)
        cases = mutant_cases(tmp, mutants)
        cases += special_input_cases(tmp) + output_cases(tmp) + script_input_cases(tmp) + dev_tool_cases()
        cases += mnist_special_cases(tmp) + probe_regression_cases(tmp)
        if wanted:
            cases = [c for c in cases if any(w in f"{c[0]}: {c[1]}" for w in wanted)]
        workers = max(4, min(8, 2 * (os.cpu_count() or 2)))  # mostly waiting on child processes
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(fn): (group, name) for group, name, fn in cases}
            for fut in concurrent.futures.as_completed(futures):
                group, name = futures[fut]
                try:
                    result = fut.result()
                except SkipCase as e:
                    TALLY.add(group, name, "SKIP", str(e))
                    continue
                except Exception as e:  # noqa: BLE001 - a bug of the suite itself counts as a failure
                    TALLY.add(group, name, "FAIL", f"the suite raised {type(e).__name__}: {e}")
                    continue
                if isinstance(result, list):  # a mutant: one verdict per reader
                    for reader, reason in result:
                        if isinstance(reason, SkipCase):
                            TALLY.add(f"{group} -> {reader}", name, "SKIP", str(reason))
                        else:
                            record(f"{group} -> {reader}", name, reason)
                elif isinstance(result, tuple):
                    record(group, name, result[0], known=result[1])
                else:
                    record(group, name, result)
    finally:
        for root, dirs, files in os.walk(tmp):
            for x in dirs + files:
                try:
                    os.chmod(os.path.join(root, x), 0o777, follow_symlinks=False)
                except (OSError, NotImplementedError):
                    pass
        shutil.rmtree(tmp, ignore_errors=True)
    for group in TALLY.order:
        p, f, s = TALLY.groups[group]
        print(f"{'FAIL' if f else 'PASS' if p else 'SKIP'} {group}: {p} passed, {f} failed, {s} skipped")
    p, f, s = TALLY.totals()
    print(f"fuzz: {p + f + s} cases in {time.time() - t0:.0f} s")
    print(f"{p} passed, {f} failed, {s} skipped")
    return 1 if f else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
