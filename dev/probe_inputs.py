"""A probe of bad inputs, independent of dev/test_fuzz.py (issue 26): what a new user or an attacker types.

dev/test_fuzz.py mutates the bytes of every file format (header fields, truncations, table bit flips) and tries
special paths on every reader. This probe asks other questions, through the same programs (./train_linreg,
./train_mnist, ./train_unet and every script of scripts/):
  flags        missing values, repeated and unknown flags, empty strings, huge / negative / NaN / inf numbers,
               trailing garbage ("12abc"), hex, overflowing integers, Unicode digits, a value that is a flag's name
  combinations flags that contradict each other or that the chosen mode ignores
  paths        a trailing slash, very long names and paths, a folder that is read-only or on a full (tmpfs) or
               read-only file system, symlink loops, /proc files (regular, size 0, yet not empty), an output that
               would replace the program's own input
  contents     files valid in their header but wrong inside: a consistent wrong dtype, duplicated or permuted
               tensors, labels out of range, NaN in the middle of the data, weights finite but huge, a 16-bit image
  environment  no HOME, LANG=C / LC_ALL=C with a non-ASCII path, stdin closed, stdout closed or on a full device
Each case runs under a timeout with an expectation: "reject" (exit 1 and one line starting with `error:` naming
the problem), "accept" (exit 0; train_unet: its no-GPU line after the checks passed), or "either" (no crash; a
refusal must still be clean). A case ends in one of
  ok, crash (a signal, an exit code > 1 that is not documented), traceback, hang (the timeout),
  garbage (a bad input accepted, or an output that is silently wrong), unclear (a refusal without exactly one
  `error:` line naming the problem), refused (a valid input refused).

  python3 dev/probe_inputs.py [-v] [substring ...]     from the repository root, after `make`
Prints every case that is not ok, a table of cases per group and category, and the closing line
`N passed, N failed, N skipped` (a case is failed unless ok). Needs no GPU (CUDA_VISIBLE_DEVICES="" everywhere).
The disk-full and read-only cases mount a 64 KiB tmpfs and are skipped where mounting is not allowed.
"""
import concurrent.futures
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)
import binio  # noqa: E402
from generate import ModelConfig  # noqa: E402

PY = sys.executable
LINREG, MNIST, UNET = (os.path.join(ROOT, t) for t in ("train_linreg", "train_mnist", "train_unet"))
TIMEOUT_S = 60
MEM_LIMIT_KB = 4 * 1024 * 1024  # the C++ programs run under 4 GB of address space: a huge allocation fails cleanly
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg")
CRASH_WORDS = ["terminate called", "Segmentation fault", "core dumped", "std::bad_alloc", "Aborted", "Killed",
               "MemoryError"]
NO_GPU = "no CUDA GPU found"  # train_unet's line once its flags and files passed, on a machine without a GPU
CATEGORIES = ["ok", "crash", "traceback", "hang", "garbage", "unclear", "refused", "skipped"]


class Case:
    """argv: the command; expect: "reject" | "accept" | "either"; words: one of them must be in the error line;
    env: variables to set (None: unset); stdin: "null" | "closed"; stdout: None | "closed" | "full";
    post(res, work) -> None or why an accepted run is garbage; codes: extra exit codes that are a clean refusal."""

    def __init__(self, group, name, argv, expect, words=(), env=None, stdin="null", stdout=None, post=None,
                 codes=(), timeout=TIMEOUT_S, skip=None):
        self.group, self.name, self.argv, self.expect, self.words = group, name, argv, expect, list(words)
        self.env, self.stdin, self.stdout, self.post, self.codes = env or {}, stdin, stdout, post, codes
        self.timeout, self.skip = timeout, skip


class Res:
    def __init__(self, code, out, timed_out=False):
        self.code, self.out, self.timed_out = code, out, timed_out


def run(case):
    env = dict(ENV)
    for k, v in case.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    shell = "" if case.argv[0] == PY else f"ulimit -v {MEM_LIMIT_KB}; "
    if case.stdin == "closed":
        shell += "exec 0<&-; "
    if case.stdout == "closed":
        shell += "exec 1>&-; "
    elif case.stdout == "full":
        shell += "exec 1>/dev/full; "
    argv = ["bash", "-c", shell + 'exec "$@"', "probe"] + case.argv
    stdout = subprocess.PIPE if case.stdout is None else None
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE, timeout=case.timeout,
                           stdin=subprocess.DEVNULL)
        out = (p.stdout or b"").decode(errors="replace") + p.stderr.decode(errors="replace")
        return Res(p.returncode, out)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return Res(None, out, True)


def error_lines(out):
    return [line for line in out.splitlines() if line.startswith("error:")]


def tail(out, n=240):
    out = out.strip()
    return (out[-n:] if out else "(no output)").replace("\n", " | ")


def judge(case, res, work):
    """-> (category, detail)."""
    if res.timed_out:
        return "hang", f"no answer after {case.timeout} s: {tail(res.out)}"
    if "Traceback (most recent call last)" in res.out:
        return "traceback", tail(res.out, 400)
    for w in CRASH_WORDS:
        if w in res.out:
            return "crash", f"{w!r}, exit {res.code}: {tail(res.out)}"
    errors = error_lines(res.out)
    clean_codes = (1,) + tuple(case.codes)
    if res.code < 0 or (res.code not in (0,) + clean_codes):
        return "crash", f"exit {res.code}: {tail(res.out)}"
    accepted = res.code == 0 or (res.code == 1 and len(errors) == 1 and NO_GPU in errors[0])
    if accepted:
        if case.expect == "reject":
            return "garbage", f"accepted (exit {res.code}), expected a clean error: {tail(res.out)}"
        why = case.post(res, work) if case.post else None
        return ("garbage", why) if why else ("ok", "")
    if case.expect == "accept":
        return "refused", tail(res.out)
    if len(errors) != 1:
        return "unclear", f"exit {res.code} with {len(errors)} 'error:' lines: {tail(res.out)}"
    if case.words and not any(w in errors[0] for w in case.words):
        return "unclear", f"the error names none of {case.words}: {errors[0][:300]}"
    return "ok", ""


# ----------------------------------------------------------------------------------------------------------------
# small valid inputs


TINY = dict(image_size=8, in_channels=3, model_channels=32, out_channels=3, num_res_blocks=1, n_levels=1,
            mult0=1, mult1=0, mult2=0, mult3=0, attn_ds_mask=1, num_head_channels=32, diffusion_steps=20,
            beta_start=1e-4, beta_end=0.02)
TINY_FLAGS = ["--image_size", "8", "--model_channels", "32", "--channel_mult", "1", "--num_res_blocks", "1",
              "--attn_ds", "1", "--num_head_channels", "32", "--diffusion_steps", "20"]


def unet_checkpoint(path, scale=0.2, dtype_swap=None, duplicate=None, permute=False, optimizer=True):
    rng = np.random.default_rng(0)
    params = {n: rng.uniform(-scale, scale, s).astype(np.float32) for n, s in ModelConfig(TINY).param_shapes().items()}
    tensors = dict(params)
    tensors.update({"ema." + n: v * np.float32(0.5) for n, v in params.items()})
    if optimizer:
        tensors.update({"adam_m." + n: v * np.float32(0.01) for n, v in params.items()})
        tensors.update({"adam_v." + n: v * v * np.float32(1e-4) for n, v in params.items()})
        tensors["rng_state"] = np.array([7, 5, 5, 0], dtype=np.int32)
    if dtype_swap:  # the same bytes, declared int32: the length and the shape still agree
        tensors[dtype_swap] = tensors[dtype_swap].view(np.int32)
    if permute:
        tensors = dict(reversed(list(tensors.items())))
    cfg = dict(TINY, step=5, batch_size=4, seed=7, lr=2e-4, ema_rate=0.999, has_ema=1, has_optimizer=int(optimizer))
    binio.write(path, binio.UNET_CHECKPOINT, cfg, tensors)
    if duplicate:  # rename the tensor after `duplicate` to `duplicate` (same shape): two entries, one name
        raw = bytearray(open(path, "rb").read())
        names = list(tensors)
        i = names.index(duplicate) + 1
        assert tensors[names[i]].shape == tensors[duplicate].shape, (names[i], duplicate)
        off = 1024 + 128 * i
        raw[off:off + 96] = duplicate.encode().ljust(96, b"\0")
        open(path, "wb").write(bytes(raw))


def unet_dataset(path, n=6, size=8, images=None, channels=3):
    if images is None:
        images = np.random.default_rng(1).integers(0, 256, (n, size, size, channels), dtype=np.uint8)
    binio.write(path, binio.UNET_DATASET, dict(n_images=images.shape[0], height=images.shape[1],
                                               width=images.shape[2], channels=images.shape[3]), {"images": images})


def linreg_dataset(path, x=None, y=None, n_train=30):
    rng = np.random.default_rng(2)
    if x is None:
        x = rng.uniform(-1, 1, (40, 2)).astype(np.float32)
    if y is None:
        y = (x @ np.arange(1, x.shape[1] + 1, dtype=np.float32) + 0.5).astype(np.float32)
    binio.write(path, binio.LINREG_DATASET, dict(n_points=len(x), n_features=x.shape[1], n_train=n_train, seed=3,
                                                 w_true=0.7, b_true=0.3, noise_std=0.1, x_min=-1.0, x_max=1.0),
                {"x": x, "y": y})


def idx_gz(path, count, images, labels=None):
    rng = np.random.default_rng(4 if images else 5)
    if images:
        raw = np.array([2051, count, 28, 28], ">u4").tobytes() + rng.integers(0, 256, count * 784,
                                                                                dtype=np.uint8).tobytes()
    else:
        lab = (np.arange(count) % 10).astype(np.uint8) if labels is None else labels
        raw = np.array([2049, count], ">u4").tobytes() + lab.tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(raw, mtime=0))


def mnist_dir(path, n_train=64, n_test=32, train_labels=None):
    os.makedirs(path, exist_ok=True)
    idx_gz(os.path.join(path, "train-images-idx3-ubyte.gz"), n_train, True)
    idx_gz(os.path.join(path, "train-labels-idx1-ubyte.gz"), n_train, False, train_labels)
    idx_gz(os.path.join(path, "t10k-images-idx3-ubyte.gz"), n_test, True)
    idx_gz(os.path.join(path, "t10k-labels-idx1-ubyte.gz"), n_test, False)
    return path


def text(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return path


# ----------------------------------------------------------------------------------------------------------------
# post checks of accepted runs


def file_unchanged(path, before):
    def post(res, work):
        if not os.path.isfile(path) or open(path, "rb").read() != before:
            return f"{path} (an input of the run) was overwritten"
        return None
    return post


def no_runtime_warning(res, work):
    if "RuntimeWarning" in res.out:
        return f"accepted with a NumPy warning (NaN or overflow hidden in the output): {tail(res.out)}"
    return None


def table_has(flag, value):
    def post(res, work):
        rows = [line for line in res.out.splitlines() if line.startswith(f"| {flag} ")]
        if not rows or f" {value} " not in rows[0]:
            return f"the start-up table does not show --{flag} {value} (the last value given): {rows[:1]}"
        return None
    return post


# ----------------------------------------------------------------------------------------------------------------
# the cases


INT_BAD = [("empty", ""), ("trailing garbage", "12abc"), ("hex", "0x10"), ("exponent", "1e3"), ("fraction", "1.5"),
           ("overflow int64", "99999999999999999999"), ("2^31", "2147483648"), ("-2^31-1", "-2147483649"),
           ("nan", "nan"), ("inf", "inf"), ("fullwidth digits", "\uff11\uff12"), ("arabic-indic digit", "\u0663"),
           ("underscore", "1_000"), ("trailing space", "7 "), ("two numbers", "1 2"), ("a flag", "--seed")]
FLOAT_BAD = [("empty", ""), ("nan", "nan"), ("NaN", "NaN"), ("inf", "inf"), ("-inf", "-inf"), ("1e400", "1e400"),
             ("-1e400", "-1e400"), ("trailing garbage", "0.1abc"), ("comma decimal", "0,1"), ("two dots", "0.1.2"),
             ("a dot", "."), ("a minus", "-"), ("exponent only", "e5"), ("nan payload", "nan(0x1)"),
             ("infinity", "infinity"), ("fullwidth", "\uff10.\uff11")]
CHOICE_BAD = [("empty", ""), ("upper case", "CPU"), ("trailing space", "cpu "), ("cuda:0", "cuda:0"),
              ("two choices", "auto,cpu"), ("unicode", "c\u0440u")]  # the last has a Cyrillic r


def flag_cases(tmp):
    cases = []
    lin_base = [LINREG, "--device", "cpu", "--points", "300", "--epochs", "2", "--log_every", "0"]
    mdir = os.path.join(tmp, "mnist")
    mn_base = [MNIST, "--device", "cpu", "--data_dir", mdir, "--epochs", "1", "--batch_size", "16", "--confusion",
               "0"]
    ds = os.path.join(tmp, "tiny_ds.bin")
    un_base = [UNET, "--data_file", ds, "--output_dir", os.path.join(tmp, "un_out"), "--steps", "10",
               "--batch_size", "4"] + TINY_FLAGS
    trainers = [("train_linreg", lin_base, "epochs", "lr", "device"),
                ("train_mnist", mn_base, "seed", "lr", "matmul"),
                ("train_unet", un_base, "log_every", "lr", "precision")]
    for name, base, iflag, fflag, cflag in trainers:
        g = f"flags {name}"
        for label, v in INT_BAD:
            cases.append(Case(g, f"--{iflag} {label} ({v!r})", base + [f"--{iflag}", v], "reject", [f"--{iflag}"]))
        for label, v in FLOAT_BAD:
            cases.append(Case(g, f"--{fflag} {label} ({v!r})", base + [f"--{fflag}", v], "reject", [f"--{fflag}"]))
        for label, v in CHOICE_BAD:
            cases.append(Case(g, f"--{cflag} {label} ({v!r})", base + [f"--{cflag}", v], "reject", [f"--{cflag}"]))
        cases += [
            Case(g, "a flag without its value at the end", base + [f"--{iflag}"], "reject", [f"--{iflag}"]),
            Case(g, "a flag whose value is the next flag", base + [f"--{fflag}", f"--{iflag}", "3"], "reject",
                 [f"--{fflag}"]),
            Case(g, "a misspelt flag", base + [f"--{iflag}s", "3"], "reject", [f"--{iflag}s"]),
            Case(g, "a single-dash flag", base + [f"-{iflag}", "3"], "reject", [f"-{iflag}"]),
            Case(g, "--flag=value", base + [f"--{iflag}=3"], "reject", [f"--{iflag}=3"]),
            Case(g, "kebab-case flag", base + ["--batch-size", "3"], "reject", ["--batch-size"]),
            Case(g, "upper-case flag", base + [f"--{iflag.upper()}", "3"], "reject", [f"--{iflag.upper()}"]),
            Case(g, "a bare --", base + ["--"], "reject", ["--"]),
            Case(g, "a positional argument", base + ["extra"], "reject", ["extra"]),
            Case(g, "an empty argument", base + [""], "reject", ["''", "flag"]),
            Case(g, "--help with other flags", base + ["--help"], "accept"),
            Case(g, "a repeated flag: the last value wins", base + [f"--{fflag}", "0.5", f"--{fflag}", "0.0002"],
                 "either", post=None if name == "train_unet" else table_has(fflag, "0.0002")),
        ]
    # a string flag whose value is another flag's name, at the end of the line (the value swallowed the flag)
    cases += [
        Case("flags train_linreg", "--result_file --save_data (a flag's name as a path)",
             [LINREG, "--device", "cpu", "--points", "300", "--epochs", "2", "--result_file", "--save_data"],
             "reject", ["--result_file"]),
        Case("flags train_mnist", "--checkpoint --resume (a flag's name as a path)",
             mn_base + ["--train_limit", "16", "--checkpoint", "--resume"], "reject", ["--checkpoint"]),
        Case("flags train_unet", "--output_dir --resume (a flag's name as a path)",
             [UNET, "--data_file", ds, "--steps", "10", "--batch_size", "4"] + TINY_FLAGS + ["--output_dir",
                                                                                              "--resume"],
             "reject", ["--output_dir"]),
    ]
    # numbers at and past their ranges, through the float-to-float32 conversion
    lin = "flags train_linreg"
    cases += [
        Case(lin, "--lr 1e-50 (a double > 0 that is 0 in float32)", lin_base + ["--lr", "1e-50"], "reject", ["--lr"]),
        Case(lin, "--x_min -3e38 --x_max 3e38 (the range overflows float32)",
             lin_base + ["--x_min", "-3e38", "--x_max", "3e38"], "reject", ["--x_max", "--x_min", "range", "loss"]),
        Case(lin, "--w_true 3e38 (y overflows)", lin_base + ["--w_true", "3e38", "--x_max", "10"], "reject",
             ["--w_true", "loss", "finite"]),
        Case(lin, "--noise_std 1e30", lin_base + ["--noise_std", "1e30"], "reject", ["loss", "--noise_std", "finite"]),
        Case(lin, "--points 2000000000 on the CPU (memory)", [LINREG, "--device", "cpu", "--points", "2000000000",
                                                              "--epochs", "1"], "either", ["memory", "alloc", "GB"]),
        Case(lin, "--epochs 0", lin_base + ["--epochs", "0"], "either"),
        Case(lin, "--split 1e-9 of 300 points", lin_base + ["--split", "1e-9"], "reject", ["--split"]),
        Case(lin, "--streams 0", lin_base + ["--streams", "0"], "reject", ["--streams"]),
        Case(lin, "--kernel 5", lin_base + ["--kernel", "5"], "reject", ["--kernel"]),
    ]
    mn = "flags train_mnist"
    cases += [
        Case(mn, "--lr 1e9 (diverges)", mn_base + ["--lr", "1e9"], "reject", ["loss", "diverge"], codes=(2,)),
        Case(mn, "--eps 1e-45 (0 in float32)", mn_base + ["--optimizer", "adamw", "--eps", "1e-45"], "reject",
             ["--eps"]),
        Case(mn, "--cpu_threads 1024 on 64 images", mn_base + ["--cpu_threads", "1024"], "either"),
        Case(mn, "--batch_size 2048 over 64 images", mn_base + ["--batch_size", "2048"], "either"),
        Case(mn, "--stop_at_accuracy 1e-30", mn_base + ["--stop_at_accuracy", "1e-30"], "either"),
        Case(mn, "--train_limit 60001", mn_base + ["--train_limit", "60001"], "reject", ["--train_limit"]),
        Case(mn, "--train_limit 1000 of 64 images", mn_base + ["--train_limit", "1000"], "either",
             ["--train_limit", "images"]),
    ]
    un = "flags train_unet"
    for label, v in [("empty", ""), ("5 levels", "1,2,3,4,5"), ("a zero", "1,0"), ("negative", "-1"),
                     ("empty item", "1,,2"), ("trailing comma", "1,"), ("huge", "1048577"),
                     ("overflow", "99999999999999999999"), ("hex", "0x2")]:
        cases.append(Case(un, f"--channel_mult {label} ({v!r})", un_base + ["--channel_mult", v], "reject",
                          ["--channel_mult", "model"]))
    cases.append(Case(un, "--channel_mult '1, 2' (spaces)", un_base + ["--channel_mult", "1, 2"], "either",
                      ["--channel_mult"]))
    for label, v, words in [("3", "3", ["--attn_ds"]), ("0", "0", ["--attn_ds"]), ("2^31", "2147483648", ["--attn_ds"]),
                            ("64 (no such level)", "64", ["--attn_ds", "attn", "level"]),
                            ("empty", "", ["--attn_ds"]), ("1,1 (repeated)", "1,1", ["--attn_ds"])]:
        expect = "either" if v == "1,1" else "reject"
        cases.append(Case(un, f"--attn_ds {label}", un_base + ["--attn_ds", v], expect, words))
    cases += [
        Case(un, "--num_head_channels 48 of 32 channels", un_base + ["--num_head_channels", "48"], "reject",
             ["head", "channels"]),
        Case(un, "--beta_start 0.5 --beta_end 0.1 (a decreasing schedule)", un_base + ["--beta_start", "0.5",
                                                                                    "--beta_end", "0.1"],
             "reject", ["beta"]),
        Case(un, "--image_size 12 of 8x8 data", un_base + ["--image_size", "12"], "reject", ["image", "size"]),
        Case(un, "--image_size 7 (odd)", un_base + ["--image_size", "7"], "reject", ["image_size"]),
        Case(un, "--log_every 0", un_base + ["--log_every", "0"], "reject", ["--log_every"]),
        Case(un, "--steps 0", un_base + ["--steps", "0"], "either", ["--steps"]),
        Case(un, "--batch_size 4096 of 6 images", un_base + ["--batch_size", "4096"], "either", ["batch"]),
        Case(un, "--model_channels 4096 (memory)", un_base + ["--model_channels", "4096", "--num_head_channels",
                                                              "4096"], "either", ["memory", "GB", "model"]),
        Case(un, "--ema_rate 1 (the EMA never moves)", un_base + ["--ema_rate", "1"], "either", ["--ema_rate"]),
        Case(un, "--diffusion_steps 100000 --beta_end 0.999", un_base + ["--diffusion_steps", "100000", "--beta_end",
                                                                         "0.999"], "either", ["beta", "alpha"]),
    ]
    return cases


def combination_cases(tmp):
    cases = []
    lr_ds = os.path.join(tmp, "lr.bin")
    g = "combinations train_linreg"
    base = [LINREG, "--device", "cpu", "--data_file", lr_ds, "--epochs", "2", "--log_every", "0"]
    for flag, v in [("points", "100"), ("seed", "5"), ("x_min", "-5"), ("x_max", "5"), ("w_true", "2"),
                    ("b_true", "1"), ("noise_std", "1")]:  # generation flags: --data_file brings its own data
        cases.append(Case(g, f"--data_file with --{flag} (a generation flag)", base + [f"--{flag}", v], "reject",
                          [f"--{flag}"]))
    cases += [
        Case(g, "--x_min 5 --x_max 5", [LINREG, "--device", "cpu", "--x_min", "5", "--x_max", "5"], "reject",
             ["--x_max"]),
        Case(g, "--data_file F --save_data F (the same file)", base + ["--save_data", lr_ds], "either"),
        Case(g, "--save_data F --result_file F (one path for both outputs)",
             [LINREG, "--device", "cpu", "--points", "300", "--epochs", "2", "--save_data",
              os.path.join(tmp, "both.out"), "--result_file", os.path.join(tmp, "both.out")], "reject",
             ["--save_data", "--result_file", "same"]),
    ]
    mdir = os.path.join(tmp, "mnist")
    ck = os.path.join(tmp, "mnist_ck.bin")
    g = "combinations train_mnist"
    mb = [MNIST, "--device", "cpu", "--data_dir", mdir, "--epochs", "1", "--batch_size", "16", "--confusion", "0"]
    cases += [
        Case(g, "--eval_only 1 --checkpoint X (nothing would be written)",
             mb + ["--eval_only", "1", "--load", ck, "--checkpoint", os.path.join(tmp, "never.bin")], "reject",
             ["--checkpoint", "--eval_only"]),
        Case(g, "--eval_only 1 --resume X", mb + ["--eval_only", "1", "--resume", ck], "reject",
             ["--eval_only", "--resume", "--load"]),
        Case(g, "--eval_only 1 without --load", mb + ["--eval_only", "1"], "reject", ["--load"]),
        Case(g, "--resume and --load", mb + ["--resume", ck, "--load", ck], "reject", ["--resume"]),
        Case(g, "--allow_change without --resume", mb + ["--allow_change", "lr"], "reject", ["--allow_change"]),
        Case(g, "--allow_change 'lr,,seed'", mb + ["--resume", ck, "--allow_change", "lr,,seed"], "reject",
             ["--allow_change"]),
        Case(g, "--allow_change LR (case)", mb + ["--resume", ck, "--allow_change", "LR"], "reject",
             ["--allow_change"]),
        Case(g, "--allow_change '' with --resume", mb + ["--resume", ck, "--allow_change", ""], "either",
             ["--allow_change"]),
        Case(g, "--resume with another --optimizer", mb + ["--resume", ck, "--optimizer", "adamw"], "reject",
             ["--optimizer"]),
        Case(g, "--resume with another --lr", mb + ["--resume", ck, "--lr", "0.5"], "reject", ["--lr"]),
        Case(g, "--lr_min above --lr", mb + ["--lr", "0.01", "--lr_min", "0.02"], "reject", ["--lr_min"]),
        Case(g, "--load X --checkpoint X (continue in place)", mb + ["--load", ck, "--checkpoint",
                                                                     os.path.join(tmp, "mnist_ck_copy.bin")],
             "accept"),
        Case(g, "--device cpu --matmul cublas", mb + ["--matmul", "cublas", "--train_limit", "16"], "either",
             ["--matmul"]),
    ]
    ds = os.path.join(tmp, "tiny_ds.bin")
    uck = os.path.join(tmp, "unet_ck.bin")
    g = "combinations train_unet"
    ub = [UNET, "--data_file", ds, "--output_dir", os.path.join(tmp, "un_out2"), "--steps", "10", "--batch_size",
          "4"] + TINY_FLAGS
    sample = os.path.join(tmp, "s.bin")
    cases += [
        Case(g, "--sample without --load", [UNET, "--sample", sample], "reject", ["--load"]),
        Case(g, "--eval_loss without --load", [UNET, "--eval_loss", "4"], "reject", ["--load"]),
        Case(g, "--sample and --eval_loss", [UNET, "--sample", sample, "--load", uck, "--eval_loss", "4"], "reject",
             ["--eval_loss"]),
        Case(g, "--resume and --load", ub + ["--resume", uck, "--load", uck], "reject", ["--resume", "--load"]),
        Case(g, "--sample X --load X (the output is the checkpoint)", [UNET, "--sample", uck, "--load", uck],
             "reject", ["--sample", "--load", "same"]),
        Case(g, "--device cpu --sample", [UNET, "--device", "cpu", "--sample", sample, "--load", uck], "reject",
             ["--device cpu"]),
        Case(g, "--resume with --steps below the stored step", [UNET, "--resume", uck, "--data_file", ds,
                                                                "--output_dir", os.path.join(tmp, "o3"), "--steps",
                                                                "3"], "reject", ["--steps", "step"]),
        Case(g, "--resume with another --seed", [UNET, "--resume", uck, "--data_file", ds, "--output_dir",
                                                 os.path.join(tmp, "o4"), "--steps", "10", "--seed", "8"], "reject",
             ["--seed"]),
        Case(g, "--allow_change ema_rate,bogus", [UNET, "--resume", uck, "--data_file", ds, "--output_dir",
                                                  os.path.join(tmp, "o5"), "--steps", "10", "--allow_change",
                                                  "ema_rate,bogus"], "reject", ["--allow_change", "bogus"]),
        Case(g, "--allow_change without --resume", ub + ["--allow_change", "lr"], "reject", ["--allow_change"]),
        Case(g, "--sampler ddpm --sample_steps 10 (ddpm takes every step)",
             [UNET, "--sample", sample, "--load", uck, "--sampler", "ddpm", "--sample_steps", "10"], "reject",
             ["--sample_steps", "ddpm"]),
        Case(g, "--sample_steps 50 of 20 diffusion steps", [UNET, "--sample", sample, "--load", uck,
                                                            "--sample_steps", "50"], "reject",
             ["--sample_steps", "diffusion_steps"]),
    ]
    gen = os.path.join(SCRIPTS, "generate.py")
    g = "combinations generate.py"
    gb = [PY, gen, "--checkpoint", uck, "--device", "cpu", "--num_samples", "1", "--sampler", "ddim", "--steps", "1"]
    png = os.path.join(tmp, "g.png")
    own = os.path.join(tmp, "unet_ck_own.bin")  # this case's own copy: a run that overwrites it spoils no other case
    shutil.copy(uck, own)
    before = open(own, "rb").read()
    cases += [
        Case(g, "--out_bin is the checkpoint", gb[:2] + ["--checkpoint", own] + gb[4:] + ["--out", png, "--out_bin",
                                                                                        own], "reject",
             ["--out_bin", "--checkpoint", "same"], post=file_unchanged(own, before)),
        Case(g, "--out and --out_bin the same file", gb + ["--out", png, "--out_bin", png], "reject",
             ["--out", "same"]),
        Case(g, "--sampler ddpm --steps 5", gb[:-4] + ["--sampler", "ddpm", "--steps", "5", "--out", png], "reject",
             ["--steps"]),
        Case(g, "--weights ema of a checkpoint without EMA", [PY, gen, "--checkpoint",
                                                               os.path.join(tmp, "unet_noema.bin"), "--device",
                                                               "cpu", "--weights", "ema", "--out", png], "reject",
             ["ema", "EMA"]),
        Case(g, "--device cuda without a GPU", gb + ["--device", "cuda", "--out", png], "reject", ["--device cuda"]),
        Case(g, "--num_samples 1000001", gb[:-6] + ["--num_samples", "1000001", "--out", png], "reject",
             ["--num_samples"]),
    ]
    csv = shutil.copy(os.path.join(tmp, "ok.csv"), os.path.join(tmp, "ok_own.csv"))
    log = shutil.copy(os.path.join(tmp, "log.csv"), os.path.join(tmp, "log_own.csv"))
    c2l = os.path.join(SCRIPTS, "csv_to_linreg.py")
    g = "combinations scripts"
    csv_before, log_before = open(csv, "rb").read(), open(log, "rb").read()
    imgs = os.path.join(tmp, "images")
    cases += [
        Case(g, "csv_to_linreg.py: the output is the CSV itself", [PY, c2l, csv, csv], "reject", [csv, "same"],
             post=file_unchanged(csv, csv_before)),
        Case(g, "plot_loss.py: --out is the log itself", [PY, os.path.join(SCRIPTS, "plot_loss.py"), "--log", log,
                                                          "--out", log], "reject", ["--out", "same", ".png"],
             post=file_unchanged(log, log_before)),
        Case(g, "plot_loss.py: --label without --log (the default log)", [PY, os.path.join(SCRIPTS, "plot_loss.py"),
                                                                          "--label", "x", "--out",
                                                                          os.path.join(tmp, "l.png")], "reject",
             ["--log", "--label", "out/unet/log.csv"]),
        Case(g, "prepare_data.py: --output inside --input_dir as .png", [PY, os.path.join(SCRIPTS, "prepare_data.py"),
                                                                        "--input_dir", imgs, "--output",
                                                                        os.path.join(imgs, "out.png"),
                                                                        "--image_size", "8"], "either"),
    ]
    return cases


def path_cases(tmp):
    cases = []
    ds = os.path.join(tmp, "tiny_ds.bin")
    lr_ds = os.path.join(tmp, "lr.bin")
    mdir = os.path.join(tmp, "mnist")
    ck = os.path.join(tmp, "mnist_ck.bin")
    uck = os.path.join(tmp, "unet_ck.bin")
    csv = os.path.join(tmp, "ok.csv")
    log = os.path.join(tmp, "log.csv")
    gen, c2l = os.path.join(SCRIPTS, "generate.py"), os.path.join(SCRIPTS, "csv_to_linreg.py")
    long_path = os.path.join(tmp, *(["d" * 200] * 25), "x.bin")  # 5000 characters: over PATH_MAX
    long_name = os.path.join(tmp, "n" * 256 + ".bin")  # over NAME_MAX
    near_max = os.path.join(tmp, "m" * 250)  # a valid name whose temporary file name is not
    inputs = [  # (reader, argv(path) -> list, path words)
        ("train_linreg --data_file", lambda p: [LINREG, "--device", "cpu", "--data_file", p, "--epochs", "2"]),
        ("train_unet --data_file", lambda p: [UNET, "--data_file", p, "--output_dir", os.path.join(tmp, "po"),
                                              "--steps", "10", "--batch_size", "4"] + TINY_FLAGS),
        ("train_unet --load", lambda p: [UNET, "--load", p, "--data_file", ds, "--output_dir",
                                         os.path.join(tmp, "po"), "--steps", "10", "--batch_size", "4"]),
        ("train_mnist --load", lambda p: [MNIST, "--device", "cpu", "--data_dir", mdir, "--eval_only", "1",
                                          "--load", p]),
        ("train_mnist --data_dir", lambda p: [MNIST, "--device", "cpu", "--data_dir", p, "--epochs", "1"]),
        ("generate.py --checkpoint", lambda p: [PY, gen, "--checkpoint", p, "--device", "cpu", "--out",
                                                os.path.join(tmp, "pg.png")]),
        ("csv_to_linreg.py", lambda p: [PY, c2l, p, os.path.join(tmp, "pc.bin")]),
        ("plot_loss.py --log", lambda p: [PY, os.path.join(SCRIPTS, "plot_loss.py"), "--log", p, "--out",
                                          os.path.join(tmp, "pl.png")]),
        ("prepare_data.py --input_dir", lambda p: [PY, os.path.join(SCRIPTS, "prepare_data.py"), "--input_dir", p,
                                                   "--output", os.path.join(tmp, "pp.bin")]),
    ]
    good = {"train_linreg --data_file": lr_ds, "train_unet --data_file": ds, "train_unet --load": uck,
            "train_mnist --load": ck, "train_mnist --data_dir": None, "generate.py --checkpoint": uck,
            "csv_to_linreg.py": csv, "plot_loss.py --log": log, "prepare_data.py --input_dir": None}
    for reader, argv in inputs:
        g = "paths (inputs)"
        f = good[reader]
        if f:
            cases.append(Case(g, f"{reader}: a regular file with a trailing slash", argv(f + "/"), "reject",
                              [f, "directory", "Not a directory"]))
            cases.append(Case(g, f"{reader}: /proc/self/status (regular, size 0, not empty)",
                              argv("/proc/self/status"), "reject", ["/proc/self/status"]))
        else:
            cases.append(Case(g, f"{reader}: a folder with a trailing slash", argv(os.path.join(tmp, "images") + "/"
                                                                                   if "prepare" in reader else
                                                                                   mdir + "/"),
                              "either" if "prepare" in reader else "accept"))
            cases.append(Case(g, f"{reader}: /proc/self (a folder of another kind)", argv("/proc/self"), "reject",
                              ["/proc/self"]))
        cases += [
            Case(g, f"{reader}: a symlink loop", argv(symlink_loop(tmp)), "reject", ["symbolic links", "loop"]),
            Case(g, f"{reader}: a 5000-character path", argv(long_path), "reject", ["too long", "No such"]),
            Case(g, f"{reader}: a 260-character file name", argv(long_name), "reject", ["too long", "No such"]),
            Case(g, f"{reader}: an empty path", argv(""), "either" if reader == "train_linreg --data_file" else
                 "reject", ["''", "empty", "No such", "directory", "--"]),  # train_linreg: "" is its default
        ]
    # outputs: a trailing slash, long names, a symlink loop, the temporary file's name over NAME_MAX
    outputs = [
        ("train_linreg --result_file", lambda p: [LINREG, "--device", "cpu", "--points", "300", "--epochs", "2",
                                                  "--log_every", "1", "--result_file", p], "epoch"),
        ("train_linreg --save_data", lambda p: [LINREG, "--device", "cpu", "--points", "300", "--epochs", "2",
                                                "--log_every", "1", "--save_data", p], "epoch"),
        ("train_mnist --checkpoint", lambda p: [MNIST, "--device", "cpu", "--data_dir", mdir, "--epochs", "1",
                                                "--batch_size", "16", "--confusion", "0", "--checkpoint", p],
         "epoch "),
        ("train_unet --output_dir", lambda p: [UNET, "--data_file", ds, "--output_dir", p, "--steps", "10",
                                               "--batch_size", "4"] + TINY_FLAGS, None),
        ("train_unet --sample", lambda p: [UNET, "--sample", p, "--load", uck], None),
        ("generate.py --out_bin", lambda p: [PY, gen, "--checkpoint", uck, "--device", "cpu", "--num_samples", "1",
                                             "--sampler", "ddim", "--steps", "1", "--out",
                                             os.path.join(tmp, "go.png"), "--out_bin", p], "step 1/"),
        ("csv_to_linreg.py", lambda p: [PY, c2l, csv, p], None),
        ("prepare_data.py --output", lambda p: [PY, os.path.join(SCRIPTS, "prepare_data.py"), "--input_dir",
                                                os.path.join(tmp, "images"), "--output", p, "--image_size", "8"],
         None),
        ("plot_loss.py --out", lambda p: [PY, os.path.join(SCRIPTS, "plot_loss.py"), "--log", log, "--out", p],
         None),
    ]
    for writer, argv, work_word in outputs:
        g = "paths (outputs)"
        is_dir = writer == "train_unet --output_dir"
        ext = ".png" if writer == "plot_loss.py --out" else ""

        slash = os.path.join(tmp, "slash_" + writer.split()[0].replace(".", "_") + ext) + "/"
        cases += [
            Case(g, f"{writer}: a new file with a trailing slash", argv(slash),
                 "accept" if is_dir else "reject", [slash.rstrip("/"), "directory", "folder"],
                 post=None if is_dir else lambda res, work: "accepted"),
            Case(g, f"{writer}: a symlink loop", argv(symlink_loop(tmp, ext)), "reject", ["symbolic links", "loop"],
                 post=None if is_dir else lambda res, work: "accepted"),
            Case(g, f"{writer}: a 260-character file name", argv(long_name + ext), "reject",
                 ["too long", "cannot write"]),
            Case(g, f"{writer}: a 5000-character path", argv(long_path + ext), "reject",
                 ["too long", "does not exist", "No such"]),
        ]
        if not is_dir:
            target = near_max + ("_" + writer.split()[0].replace(".", "_"))[:5] + ext
            cases.append(Case(g, f"{writer}: a 255-character file name (its temporary file's name is longer)",
                              argv(target), "either", ["too long", "cannot write"],
                              post=lambda res, work, target=target: None if os.path.isfile(target) else
                              f"exit 0 but {target} was not written"))
            if work_word:
                cases[-1].post = late_refusal_post(target, work_word)
                cases[-1].expect = "either_late"
                cases[-1].work_word = work_word
    return cases


def symlink_loop(tmp, ext=""):
    """A fresh pair a -> b -> a (a run that replaces a link must not spoil another case's loop) -> a."""
    SYMLINK_LOOPS[0] += 1
    a, b = (os.path.join(tmp, f"loop{SYMLINK_LOOPS[0]}_{x}{ext}") for x in "ab")
    os.symlink(b, a)
    os.symlink(a, b)
    return a


SYMLINK_LOOPS = [0]


def late_refusal_post(target, work_word):
    """An output refused only after the work it should have been checked before (a start-up check that passed a
    path the real write then refused)."""
    def post(res, work):
        if res.code == 0 and not os.path.isfile(target):
            return f"exit 0 but {target} was not written"
        return None
    return post


def tmpfs_cases(tmp):
    """A 64 KiB tmpfs (disk full) and the same remounted read-only, as the folder of every writer's output."""
    cases = []
    full = os.path.join(tmp, "full")
    os.makedirs(full)
    ro = os.path.join(tmp, "ro")
    os.makedirs(ro)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", full], capture_output=True).returncode == 0
    ok = ok and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", ro],
                               capture_output=True).returncode == 0
    MOUNTS.extend(p for p in (full, ro) if os.path.ismount(p))
    skip = None if ok else "cannot mount a tmpfs here (not root, or no mount permission)"
    if ok:
        text(os.path.join(full, "filler"), b"\0" * 56 * 1024)  # leaves ~8 KiB: no output of these runs fits
    ds, uck, mdir = os.path.join(tmp, "tiny_ds.bin"), os.path.join(tmp, "unet_ck.bin"), os.path.join(tmp, "mnist")
    csv, log = os.path.join(tmp, "ok.csv"), os.path.join(tmp, "log.csv")
    gen = os.path.join(SCRIPTS, "generate.py")
    writers = [
        ("train_linreg --save_data", lambda d: [LINREG, "--device", "cpu", "--points", "20000", "--epochs", "2",
                                                "--save_data", os.path.join(d, "lr.bin")], "lr.bin"),
        ("train_mnist --checkpoint", lambda d: [MNIST, "--device", "cpu", "--data_dir", mdir, "--epochs", "1",
                                                "--batch_size", "16", "--confusion", "0", "--checkpoint",
                                                os.path.join(d, "ck.bin")], "ck.bin"),
        ("train_unet --output_dir", lambda d: [UNET, "--data_file", ds, "--output_dir", os.path.join(d, "run"),
                                               "--steps", "10", "--batch_size", "4"] + TINY_FLAGS, None),
        ("generate.py --out_bin", lambda d: [PY, gen, "--checkpoint", uck, "--device", "cpu", "--num_samples", "64",
                                             "--batch_size", "64", "--sampler", "ddim", "--steps", "1", "--out",
                                             os.path.join(tmp, "t.png"), "--out_bin", os.path.join(d, "s.bin")],
         "s.bin"),
        ("csv_to_linreg.py", lambda d: [PY, os.path.join(SCRIPTS, "csv_to_linreg.py"), os.path.join(tmp, "big.csv"),
                                        os.path.join(d, "o.bin")], "o.bin"),
        ("prepare_data.py", lambda d: [PY, os.path.join(SCRIPTS, "prepare_data.py"), "--input_dir",
                                       os.path.join(tmp, "images"), "--output", os.path.join(d, "p.bin"),
                                       "--image_size", "64"], "p.bin"),
        ("plot_loss.py", lambda d: [PY, os.path.join(SCRIPTS, "plot_loss.py"), "--log", log, "--out",
                                    os.path.join(d, "l.png")], "l.png"),
    ]
    for name, argv, fname in writers:
        for label, d, words in (("a full disk (tmpfs)", full, ["No space", "cannot write", "File too large"]),
                                ("a read-only file system", ro, ["Read-only", "cannot write", "cannot be made"])):
            def post(res, work, d=d, fname=fname):
                left = [f for f in os.listdir(d) if ".tmp" in f or f.startswith(".")] if os.path.isdir(d) else []
                return f"left {left} in {d}" if left else None
            # train_unet writes on the GPU: a folder that takes an empty file passes its start-up check
            expect = "either" if name == "train_unet --output_dir" and d == full else "reject"
            c = Case("paths (full / read-only disk)", f"{name}: {label}", argv(d), expect, words, skip=skip)
            c.post_always = post
            cases.append(c)
    return cases


MOUNTS = []


def content_cases(tmp):
    """Files valid in their header but wrong inside."""
    cases = []
    g = "contents"
    ds = os.path.join(tmp, "tiny_ds.bin")
    uck = os.path.join(tmp, "unet_ck.bin")
    gen = os.path.join(SCRIPTS, "generate.py")
    names = list(ModelConfig(TINY).param_shapes())
    shapes = ModelConfig(TINY).param_shapes()
    first = names[0]
    same_shape = next(n for i, n in enumerate(names[:-1]) if shapes[names[i + 1]] == shapes[n])

    def ck(name, **kw):
        p = os.path.join(tmp, f"ck_{name}.bin")
        unet_checkpoint(p, **kw)
        return p

    variants = [
        ("a weight declared int32 (same bytes)", ck("dtype", dtype_swap=first), "reject", ["dtype", "int32", first]),
        (f"two entries named {same_shape}", ck("dup", duplicate=same_shape), "reject", [same_shape, "twice",
                                                                                        "duplicate", "missing"]),
        ("tensors in reverse order", ck("perm", permute=True), "accept", []),
        ("weights of 1e30 (finite, the samples are not)", ck("huge", scale=1e30), "reject",
         ["finite", "NaN", "inf", "overflow"]),
    ]
    for label, path, expect, words in variants:
        cases.append(Case(g, f"unet checkpoint, {label}: generate.py",
                          [PY, gen, "--checkpoint", path, "--device", "cpu", "--num_samples", "2", "--sampler",
                           "ddim", "--steps", "2", "--out", os.path.join(tmp, "c.png")], expect, words,
                          post=no_runtime_warning))
        cases.append(Case(g, f"unet checkpoint, {label}: train_unet --load",
                          [UNET, "--load", path, "--data_file", ds, "--output_dir", os.path.join(tmp, "co"),
                           "--steps", "10", "--batch_size", "4"],
                          "either" if "1e30" in label else expect, words))
        cases.append(Case(g, f"unet checkpoint, {label}: train_unet --resume",
                          [UNET, "--resume", path, "--data_file", ds, "--output_dir", os.path.join(tmp, "co"),
                           "--steps", "10"], "either" if "1e30" in label else expect, words))
    # datasets
    dsets = []
    p = os.path.join(tmp, "ds_int32.bin")  # images declared int32: consistent length
    imgs = np.random.default_rng(1).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    binio.write(p, binio.UNET_DATASET, dict(n_images=6, height=8, width=8, channels=3),
                {"images": imgs.astype(np.int32)})
    dsets.append(("images as int32 (4 bytes each, consistent)", p, "reject", ["dtype", "uint8", "int32"]))
    p = os.path.join(tmp, "ds_gray.bin")
    unet_dataset(p, images=imgs[..., :1].copy())
    dsets.append(("one channel (grayscale), consistent", p, "reject", ["channels"]))
    p = os.path.join(tmp, "ds_rect.bin")
    unet_dataset(p, images=imgs[:, :, :4].copy())
    dsets.append(("8x4 images (not square), consistent", p, "reject", ["width", "height", "square", "image"]))
    p = os.path.join(tmp, "ds_one.bin")
    unet_dataset(p, images=imgs[:1].copy())
    dsets.append(("one image, batch 4", p, "either", ["batch", "images"]))
    p = os.path.join(tmp, "ds_const.bin")
    unet_dataset(p, images=np.full((6, 8, 8, 3), 255, np.uint8))
    dsets.append(("every pixel 255", p, "accept", []))
    for label, path, expect, words in dsets:
        cases.append(Case(g, f"unet dataset, {label}: train_unet", [UNET, "--data_file", path, "--output_dir",
                                                                     os.path.join(tmp, "do"), "--steps", "10",
                                                                     "--batch_size", "4"] + TINY_FLAGS, expect,
                          words))
    # linreg
    lin = []
    x = np.random.default_rng(3).uniform(-1, 1, (40, 2)).astype(np.float32)
    for label, xx, yy, n_train, expect, words in [
            ("NaN in the middle of y", x, None, 30, "reject", ["finite", "nan", "NaN"]),
            ("x of 1e30 (finite; the loss is not)", x * np.float32(1e30), None, 30, "reject", ["loss", "finite"]),
            ("every x equal (a singular design)", np.ones_like(x), None, 30, "accept", []),
            ("n_train = n_points (no test split)", x, None, 40, "reject", ["n_train", "test"]),
            ("x as int32 (same bytes)", x.view(np.int32), None, 30, "reject", ["dtype", "int32", "float32"]),
            ("one feature, x and y swapped", x[:, :1].copy(), x[:, 0].copy() * 2, 30, "accept", [])]:
        p = os.path.join(tmp, f"lr_{len(lin)}.bin")
        y = yy
        if label.startswith("NaN"):
            y = (x @ np.array([1, 2], np.float32)).astype(np.float32)
            y[20] = np.nan
        if y is None and xx.dtype == np.float32:
            y = np.nan_to_num(xx @ np.arange(1, xx.shape[1] + 1, dtype=np.float32), posinf=3e38)
        if y is None:
            y = np.zeros(len(xx), np.float32)
        linreg_dataset(p, xx, y.astype(np.float32), n_train)
        lin.append((label, p, expect, words))
    for label, path, expect, words in lin:
        cases.append(Case(g, f"linreg dataset, {label}: train_linreg", [LINREG, "--device", "cpu", "--data_file",
                                                                         path, "--epochs", "3"], expect, words))
    # mnist
    mn = os.path.join(tmp, "mnist_bad")
    for label, build, expect, words in [
            ("a label of 200 in the middle", lambda d: mnist_dir(d, train_labels=np.array(
                [i % 10 if i != 31 else 200 for i in range(64)], np.uint8)), "reject", ["label"]),
            ("train and test images swapped (sizes differ)", lambda d: swap(d, "train-images-idx3-ubyte.gz",
                                                                           "t10k-images-idx3-ubyte.gz"),
             "reject", ["count", "images", "labels"]),
            ("labels file in the images slot", lambda d: swap(d, "train-images-idx3-ubyte.gz",
                                                              "train-labels-idx1-ubyte.gz"), "reject",
             ["magic"]),
            ("zero images (a valid empty file)", lambda d: (mnist_dir(d), idx_gz(
                os.path.join(d, "train-images-idx3-ubyte.gz"), 0, True), idx_gz(
                os.path.join(d, "train-labels-idx1-ubyte.gz"), 0, False)), "reject", ["count", "images", "empty"])]:
        d = os.path.join(mn, str(len(cases)))
        mnist_dir(d)
        build(d)
        cases.append(Case(g, f"mnist data, {label}: train_mnist", [MNIST, "--device", "cpu", "--data_dir", d,
                                                                    "--epochs", "1", "--confusion", "0"], expect,
                          words))
    # mnist checkpoint with a duplicated tensor and one declared int32
    ck = os.path.join(tmp, "mnist_ck.bin")
    _, cfg, tensors = binio.read(ck, binio.MNIST_CHECKPOINT)
    items = list(tensors.items())
    p = os.path.join(tmp, "mck_int.bin")
    binio.write(p, binio.MNIST_CHECKPOINT, cfg, dict((n, v.view(np.int32) if n == "fc2.bias" else v)
                                                     for n, v in items))
    p2 = os.path.join(tmp, "mck_perm.bin")
    binio.write(p2, binio.MNIST_CHECKPOINT, cfg, dict(reversed(items)))
    for label, path, expect, words in [("fc2.bias declared int32", p, "reject", ["fc2.bias", "dtype", "int32"]),
                                       ("tensors in reverse order", p2, "accept", [])]:
        cases.append(Case(g, f"mnist checkpoint, {label}: train_mnist --load",
                          [MNIST, "--device", "cpu", "--data_dir", os.path.join(tmp, "mnist"), "--eval_only", "1",
                           "--load", path], expect, words))
    return cases


def swap(d, a, b):
    pa, pb = os.path.join(d, a), os.path.join(d, b)
    tmpn = pa + ".swap"
    os.rename(pa, tmpn)
    os.rename(pb, pa)
    os.rename(tmpn, pb)


def script_cases(tmp):
    """The scripts' own text and image inputs, and their flags."""
    cases = []
    d = os.path.join(tmp, "texts")
    os.makedirs(d)
    c2l = os.path.join(SCRIPTS, "csv_to_linreg.py")
    out = os.path.join(d, "o.bin")
    g = "csv_to_linreg.py"
    for label, data, expect, words in [
            ("'nan' in the middle", "a,y\n1,2\nnan,3\n4,5\n", "reject", ["nan", "line 3"]),
            ("'inf'", "a,y\n1,2\n3,inf\n4,5\n", "reject", ["inf", "line 3"]),
            ("1e39 (over float32)", "a,y\n1,2\n3,1e39\n4,5\n", "reject", ["1e39", "float32"]),
            ("1e-50 (a float32 0)", "a,y\n1,2\n3,1e-50\n4,5\n", "accept", []),
            ("hex numbers", "a,y\n0x1,2\n3,4\n4,5\n", "reject", ["0x1"]),
            ("1_000 (a Python literal, not a CSV number)", "a,y\n1_000,2\n3,4\n4,5\n", "reject", ["1_000"]),
            ("fullwidth digits", "a,y\n\uff11,2\n3,4\n4,5\n", "reject", ["line 2"]),
            ("a UTF-8 BOM", "\ufeffa,y\n1,2\n3,4\n4,5\n", "accept", []),
            ("CRLF lines", "a,y\r\n1,2\r\n3,4\r\n4,5\r\n", "accept", []),
            ("semicolons", "a;y\n1;2\n3;4\n4;5\n", "reject", ["column"]),
            ("tabs", "a\ty\n1\t2\n3\t4\n4\t5\n", "reject", ["column"]),
            ("a trailing comma", "a,y\n1,2,\n3,4\n4,5\n", "reject", ["line 2", "fields"]),
            ("an empty cell", "a,y\n1,\n3,4\n4,5\n", "reject", ["line 2"]),
            ("an unclosed quote", 'a,y\n1,"2\n3,4\n', "reject", ["line", "quote", "fields"]),
            ("a quoted number", 'a,y\n"1",2\n3,4\n4,5\n', "accept", []),
            ("only the header", "a,y\n", "reject", ["rows", "lines"]),
            ("33 features", ",".join(f"c{i}" for i in range(34)) + "\n" + ("1," * 33 + "1\n") * 3, "reject",
             ["features"]),
            ("duplicate column names", "a,a,y\n1,2,3\n3,4,5\n4,5,6\n", "either", ["a"]),
            ("a 1 MB line", "a,y\n" + "1" * 1000000 + ",2\n3,4\n4,5\n", "reject", ["line 2", "float32", "number"]),
            ("only blank lines", "\n\n\n", "reject", ["rows", "lines", "header"])]:
        p = text(os.path.join(d, f"c{len(cases)}.csv"), data)
        cases.append(Case(g, label, [PY, c2l, p, out], expect, words))
    good = text(os.path.join(d, "good.csv"), "a,y\n1,2\n3,4\n4,5\n6,7\n")
    for label, extra, expect, words in [
            ("--target missing", ["--target", "zz"], "reject", ["zz"]), ("--target ''", ["--target", ""], "reject",
                                                                         ["''", "column"]),
            ("--split 1", ["--split", "1"], "reject", ["--split"]), ("--split inf", ["--split", "inf"], "reject",
                                                                    ["--split"]),
            ("--split 12abc", ["--split", "12abc"], "reject", ["--split"]),
            ("--seed 0x10", ["--seed", "0x10"], "reject", ["--seed"]),
            ("--seed 2**31", ["--seed", str(2**31)], "reject", ["--seed"]),
            ("an unknown flag", ["--shuffle"], "reject", ["--shuffle"]),
            ("--split with no value", ["--split"], "reject", ["--split"]),
            ("a third positional", ["extra"], "reject", ["extra"]),
            ("--no_shuffle twice", ["--no_shuffle", "--no_shuffle"], "accept", [])]:
        cases.append(Case(g, label, [PY, c2l, good, out] + extra, expect, words))
    cases.append(Case(g, "no arguments", [PY, c2l], "reject", ["csv_file", "required"]))
    # plot_loss.py
    pl = os.path.join(SCRIPTS, "plot_loss.py")
    png = os.path.join(d, "p.png")
    g = "plot_loss.py"
    head = "step,loss,ms,images_per_s\n"
    for label, data, expect, words in [
            ("NaN losses", head + "1,nan,60,5\n2,nan,60,5\n", "either", ["loss", "nan", "finite"]),
            ("inf loss in the middle", head + "1,0.5,60,5\n2,inf,60,5\n3,0.4,60,5\n", "either",
             ["loss", "inf", "finite"]),
            ("a negative loss (log axis)", head + "1,0.5,60,5\n2,-0.1,60,5\n", "either", ["loss", "line 3"]),
            ("steps out of order", head + "3,0.5,60,5\n1,0.4,60,5\n2,0.3,60,5\n", "either", ["step"]),
            ("one row", head + "1,0.5,60,5\n", "either", ["rows"]),
            ("a 1e308 loss", head + "1,1e308,60,5\n2,1e308,60,5\n", "either", ["loss"]),
            ("a header in another order", "loss,step,ms,images_per_s\n0.5,1,60,5\n", "reject", ["header"]),
            ("a '$' in the title text", head + "1,0.5,60,5\n2,0.4,60,5\n", "accept", [])]:
        p = text(os.path.join(d, f"l{len(cases)}.csv"), data)
        extra = ["--title", "$x^"] if "$" in label else []
        cases.append(Case(g, label, [PY, pl, "--log", p, "--out", png] + extra, expect, words))
    dollar = os.path.join(d, "run$1")
    os.makedirs(dollar)
    text(os.path.join(dollar, "log.csv"), head + "1,0.5,60,5\n2,0.4,60,5\n")
    cases += [
        Case(g, "a log in a folder named run$1 (mathtext in the default title)", [PY, pl, "--log", dollar,
                                                                                  "--out", png], "accept"),
        Case(g, "--label with a lone $", [PY, pl, "--log", dollar, "--label", "cost in $", "--out", png], "accept"),
        Case(g, "--smooth 12abc", [PY, pl, "--log", dollar, "--out", png, "--smooth", "12abc"], "reject",
             ["--smooth"]),
        Case(g, "--smooth 1", [PY, pl, "--log", dollar, "--out", png, "--smooth", "1"], "reject", ["--smooth"]),
        Case(g, "--out with no extension", [PY, pl, "--log", dollar, "--out", os.path.join(d, "noext")], "either",
             ["--out", "png"]),
        Case(g, "--out .jpg", [PY, pl, "--log", dollar, "--out", os.path.join(d, "x.jpg")], "either",
             ["--out", "png"]),
        Case(g, "--out .xyz", [PY, pl, "--log", dollar, "--out", os.path.join(d, "x.xyz")], "either",
             ["--out", "xyz", "format"]),
        Case(g, "no --log (the default log is missing)", [PY, pl, "--out", png], "reject",
             ["--log", "out/unet/log.csv"]),
    ]
    # plot_softmax.py
    ps = os.path.join(SCRIPTS, "plot_softmax.py")
    g = "plot_softmax.py"
    sh = "op,cols,impl,gbps\n"
    for label, data, expect, words in [
            ("a '$' in an impl name (mathtext)", sh + "forward,128,$x^,100\nforward,256,$x^,200\n", "accept", []),
            ("gbps nan", sh + "forward,128,ours,nan\n", "reject", ["gbps", "nan", "finite"]),
            ("cols 0 (log axis)", sh + "forward,0,ours,100\n", "reject", ["cols"]),
            ("cols -5", sh + "forward,-5,ours,100\n", "reject", ["cols"]),
            ("an unknown op", sh + "sideways,128,ours,100\n", "either", ["op"]),
            ("only the header", sh, "reject", ["row"]),
            ("missing column", "op,cols,gbps\nforward,128,100\n", "reject", ["header", "impl", "column"])]:
        p = text(os.path.join(d, f"s{len(cases)}.csv"), data)
        cases.append(Case(g, label, [PY, ps, "--csv", p, "--out", png], expect, words))
    cases.append(Case(g, "--copy_gbps -1", [PY, ps, "--csv", p, "--out", png, "--copy_gbps", "-1"], "reject",
                      ["--copy_gbps"]))
    # plot_linreg.py
    pj = os.path.join(SCRIPTS, "plot_linreg.py")
    g = "plot_linreg.py"
    good_js = {"rows": [{"points": 500, "torch_cpu_ms": 1.0, "ours_v4_ms": 0.5},
                        {"points": 5000, "torch_cpu_ms": 2.0, "ours_v4_ms": 0.6}], "epochs": 200, "gpu": "none",
               "date": "today", "breakdown_us": {"forward": 1, "loss": 1, "gradient": 1, "update": 1, "fused": 2}}
    for label, js, expect, words in [
            ("NaN times (JSON's NaN literal)", dict(good_js, rows=[{"points": 500, "torch_cpu_ms": float("nan"),
                                                                    "ours_v4_ms": 0.5}]), "reject",
             ["NaN", "nan", "finite", "torch_cpu_ms"]),
            ("a negative time (log axis)", dict(good_js, rows=[{"points": 500, "torch_cpu_ms": -1.0,
                                                                "ours_v4_ms": 0.5}]), "reject",
             ["torch_cpu_ms", "negative", "> 0", "positive"]),
            ("points as a string", dict(good_js, rows=[{"points": "abc", "torch_cpu_ms": 1.0, "ours_v4_ms": 0.5}]),
             "reject", ["points"]),
            ("rows not a list", dict(good_js, rows={"points": 1}), "reject", ["rows"]),
            ("no rows", dict(good_js, rows=[]), "reject", ["rows"]),
            ("a gpu name with $", dict(good_js, gpu="$x^"), "accept", []),
            ("a JSON list", [1, 2], "reject", ["rows", "object", "not a bench_linreg.py result"])]:
        p = text(os.path.join(d, f"j{len(cases)}.json"), json.dumps(js))
        cases.append(Case(g, label, [PY, pj, p, "--out", d], expect, words))
    # prepare_data.py: images
    from PIL import Image
    g = "prepare_data.py"
    pd = os.path.join(SCRIPTS, "prepare_data.py")
    for label, make, expect, words in [
            ("a 16-bit grayscale PNG", lambda p: Image.fromarray(np.full((16, 16), 30000, np.uint16)).save(p),
             "either", [], ),
            ("a truncated PNG (--on_error fail)", lambda p: open(p, "wb").write(png_bytes()[:60]), "reject",
             ["cannot read image"]),
            ("a zero-byte .png (--on_error fail)", lambda p: open(p, "wb").close(), "reject", ["cannot read image"]),
            ("a text file named .jpg (--on_error fail)", lambda p: open(p, "w").write("hello"), "reject",
             ["cannot read image"]),
            ("a PNG claiming 100000x100000 pixels", lambda p: open(p, "wb").write(bomb_png()), "reject",
             ["cannot read image", "pixels", "bomb", "too large", "could be read"]),
            ("a 1x1 image", lambda p: Image.fromarray(np.zeros((1, 1, 3), np.uint8)).save(p), "accept", []),
            ("an RGBA image with transparency", lambda p: Image.fromarray(np.zeros((8, 8, 4), np.uint8)).save(p),
             "either", []),
            ("a CMYK JPEG", lambda p: Image.new("CMYK", (8, 8), (0, 0, 0, 0)).save(p), "accept", []),
            ("an unreadable image (--on_error fail)", None, "reject", ["cannot read image", "Permission"])]:
        folder = os.path.join(tmp, f"img_{len(cases)}")
        os.makedirs(folder)
        ext = ".jpg" if "JPEG" in label or ".jpg" in label else ".png"
        p = os.path.join(folder, "a" + ext)
        if make is None:
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(p)
            os.chmod(p, 0)
            if os.geteuid() == 0:
                continue  # root reads it anyway (dev/test_fuzz.py covers unreadable files without CAP_DAC)
        else:
            make(p)
        post = None
        if "16-bit" in label:
            post = sixteen_bit_post(os.path.join(folder, "o.bin"))
        argv = [PY, pd, "--input_dir", folder, "--output", os.path.join(folder, "o.bin"), "--image_size", "8"]
        if "fail" in label:
            argv += ["--on_error", "fail"]
        cases.append(Case(g, label, argv, expect, words, post=post))
    for label, extra, expect, words in [("--image_size 0", ["--image_size", "0"], "reject", ["--image_size"]),
                                        ("--image_size 64px", ["--image_size", "64px"], "reject", ["--image_size"]),
                                        ("--image_size 99999999999999999999", ["--image_size", "9" * 20], "reject",
                                         ["--image_size"]),
                                        ("--on_error ignore", ["--on_error", "ignore"], "reject", ["--on_error"]),
                                        ("no --input_dir", None, "reject", ["--input_dir"])]:
        argv = [PY, pd, "--output", os.path.join(tmp, "pd.bin")]
        argv += (["--input_dir", os.path.join(tmp, "images")] + extra) if extra else []
        cases.append(Case(g, label, argv, expect, words))
    # generate.py flags
    gen = os.path.join(SCRIPTS, "generate.py")
    uck = os.path.join(tmp, "unet_ck.bin")
    g = "generate.py"
    gb = [PY, gen, "--checkpoint", uck, "--device", "cpu", "--out", os.path.join(d, "g.png")]
    for label, extra, expect, words in [
            ("--num_samples 12abc", ["--num_samples", "12abc"], "reject", ["--num_samples"]),
            ("--num_samples 0", ["--num_samples", "0"], "reject", ["--num_samples"]),
            ("--batch_size -1", ["--batch_size", "-1"], "reject", ["--batch_size"]),
            ("--steps 1e3", ["--sampler", "ddim", "--steps", "1e3"], "reject", ["--steps"]),
            ("--sampler DDIM", ["--sampler", "DDIM"], "reject", ["--sampler"]),
            ("--weights bogus", ["--weights", "bogus"], "reject", ["--weights"]),
            ("--out ''", ["--out", ""], "reject", ["--out"]),
            ("--out .png (a hidden file named .png)", ["--out", os.path.join(d, ".png"), "--num_samples", "1",
                                                       "--sampler", "ddim", "--steps", "1"], "either", ["--out"]),
            ("--out X.PNG", ["--out", os.path.join(d, "X.PNG"), "--num_samples", "1", "--sampler", "ddim", "--steps",
                             "1"], "accept", []),
            ("no --checkpoint", None, "reject", ["--checkpoint"]),
            ("--checkpoint of a linreg dataset", ["--checkpoint", os.path.join(tmp, "lr.bin")], "reject",
             ["magic"]),
            ("--binary not executable with --device cuda", ["--device", "cuda", "--binary", uck], "reject",
             ["--device cuda", "executable"])]:
        argv = list(gb) + (extra or []) if extra is not None else [PY, gen, "--out", os.path.join(d, "g.png")]
        cases.append(Case(g, label, argv, expect, words))
    # binio.py is a module: run as a script it must not do anything surprising
    cases.append(Case("binio.py", "run as a script with arguments", [PY, os.path.join(SCRIPTS, "binio.py"),
                                                                    "--help"], "either"))
    cases.append(Case("binio.py", "read() of a file with two entries of one name (in process)",
                      [PY, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import binio\n"
                       "try:\n    binio.read(sys.argv[2], binio.UNET_CHECKPOINT)\nexcept binio.FormatError as e:\n"
                       "    sys.exit(f'error: {e}')", SCRIPTS, os.path.join(tmp, "ck_dup.bin")], "reject",
                      ["twice", "duplicate"]))
    return cases


def png_bytes():
    import io
    from PIL import Image
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


def bomb_png():
    """A PNG header claiming 100000 x 100000 pixels (no data to match)."""
    import struct
    import zlib
    ihdr = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))


def sixteen_bit_post(out):
    def post(res, work):
        _, _, t = binio.read(out, binio.UNET_DATASET)
        v = int(t["images"].reshape(-1)[0])
        # 30000 / 65535 of full scale is 117 in 8 bits; a clipped conversion gives 255
        if abs(v - 117) > 2:
            return f"a 16-bit pixel of 30000 became {v}, expected about 117 (30000 / 257): the image was clipped"
        return None
    return post


def env_cases(tmp):
    cases = []
    g = "environment"
    uni = os.path.join(tmp, "d\u00e9j\u00e0 vu")
    os.makedirs(uni, exist_ok=True)
    shutil.copy(os.path.join(tmp, "lr.bin"), os.path.join(uni, "lr.bin"))
    shutil.copy(os.path.join(tmp, "log.csv"), os.path.join(uni, "log.csv"))
    lr_uni = os.path.join(uni, "lr.bin")
    gen = os.path.join(SCRIPTS, "generate.py")
    uck = os.path.join(tmp, "unet_ck.bin")
    progs = [
        ("train_linreg", [LINREG, "--device", "cpu", "--data_file", lr_uni, "--epochs", "2",
                          "--result_file", os.path.join(uni, "r.json")]),
        ("train_mnist", [MNIST, "--device", "cpu", "--data_dir", os.path.join(tmp, "mnist"), "--epochs", "1",
                         "--confusion", "0", "--checkpoint", os.path.join(uni, "m.bin")]),
        ("train_unet", [UNET, "--data_file", os.path.join(tmp, "tiny_ds.bin"), "--output_dir",
                        os.path.join(uni, "u"), "--steps", "10", "--batch_size", "4"] + TINY_FLAGS),
        ("generate.py", [PY, gen, "--checkpoint", uck, "--device", "cpu", "--num_samples", "1", "--sampler", "ddim",
                         "--steps", "1", "--out", os.path.join(uni, "g.png")]),
        ("csv_to_linreg.py", [PY, os.path.join(SCRIPTS, "csv_to_linreg.py"), os.path.join(tmp, "ok.csv"),
                              os.path.join(uni, "c.bin")]),
        ("plot_loss.py", [PY, os.path.join(SCRIPTS, "plot_loss.py"), "--log", os.path.join(uni, "log.csv"), "--out",
                          os.path.join(uni, "l.png")]),
        ("prepare_data.py", [PY, os.path.join(SCRIPTS, "prepare_data.py"), "--input_dir",
                             os.path.join(tmp, "images"), "--output", os.path.join(uni, "p.bin"), "--image_size",
                             "8"]),
    ]
    bad = {  # the same programs, with an input that is refused: the error line must survive the environment
        "train_linreg": [LINREG, "--device", "cpu", "--data_file", os.path.join(uni, "missing.bin")],
        "csv_to_linreg.py": [PY, os.path.join(SCRIPTS, "csv_to_linreg.py"), os.path.join(uni, "missing.csv"),
                             os.path.join(uni, "c.bin")],
        "generate.py": [PY, gen, "--checkpoint", os.path.join(uni, "missing.bin"), "--out",
                        os.path.join(uni, "g.png")],
    }
    envs = [("no HOME", {"HOME": None}, "null", None), ("HOME a missing folder", {"HOME": "/nonexistent/home"},
                                                        "null", None),
            ("LANG=C LC_ALL=C (a non-ASCII path)", {"LANG": "C", "LC_ALL": "C"}, "null", None),
            ("stdin closed", {}, "closed", None),
            ("MPLCONFIGDIR unwritable, no HOME", {"MPLCONFIGDIR": "/proc/mpl", "HOME": None}, "null", None),
            ("TMPDIR a missing folder", {"TMPDIR": "/nonexistent/tmp"}, "null", None),
            ("PYTHONIOENCODING=ascii (a non-ASCII path printed)", {"PYTHONIOENCODING": "ascii"}, "null", None)]
    for label, env, stdin, stdout in envs:
        for name, argv in progs:
            if label.startswith(("MPLCONFIGDIR", "PYTHONIOENCODING", "TMPDIR")) and argv[0] != PY:
                continue
            cases.append(Case(g, f"{name}: {label}", argv, "accept", env=env, stdin=stdin, stdout=stdout))
        for name, argv in bad.items():
            cases.append(Case(g, f"{name} (a missing input): {label}", argv, "reject", ["missing"], env=env,
                              stdin=stdin))
    # stdout closed or full: the run's report is lost; the program must not crash, and say so on stderr or exit 1
    for name, argv in progs:
        for label, stdout in (("stdout closed", "closed"), ("stdout on /dev/full", "full")):
            cases.append(Case(g, f"{name}: {label}", argv, "either", stdout=stdout))
    return cases


# ----------------------------------------------------------------------------------------------------------------


def setup(tmp):
    unet_dataset(os.path.join(tmp, "tiny_ds.bin"))
    unet_checkpoint(os.path.join(tmp, "unet_ck.bin"))
    p = os.path.join(tmp, "unet_noema.bin")
    rng = np.random.default_rng(0)
    params = {n: rng.uniform(-0.2, 0.2, s).astype(np.float32) for n, s in ModelConfig(TINY).param_shapes().items()}
    binio.write(p, binio.UNET_CHECKPOINT, dict(TINY, step=5, batch_size=4, seed=7, lr=2e-4, ema_rate=0.999, has_ema=0,
                                               has_optimizer=0), params)
    linreg_dataset(os.path.join(tmp, "lr.bin"))
    mnist_dir(os.path.join(tmp, "mnist"))
    text(os.path.join(tmp, "ok.csv"), "a,b,y\n" + "".join(f"{i},{i % 7},{2 * i + 1}\n" for i in range(20)))
    text(os.path.join(tmp, "big.csv"), "a,b,y\n" + "".join(f"{i},{i % 7},{2 * i + 1}\n" for i in range(3000)))
    text(os.path.join(tmp, "log.csv"), "step,loss,ms,images_per_s\n" +
         "".join(f"{i},{1.0 / i:.4f},60,500\n" for i in range(1, 30)))
    from PIL import Image
    imgs = os.path.join(tmp, "images")
    os.makedirs(imgs)
    for i in range(3):
        Image.fromarray(np.full((12, 10, 3), 40 * i, np.uint8)).save(os.path.join(imgs, f"{i}.png"))
    ck = os.path.join(tmp, "mnist_ck.bin")  # a real checkpoint, written by the trainer
    r = subprocess.run([MNIST, "--device", "cpu", "--data_dir", os.path.join(tmp, "mnist"), "--epochs", "1",
                        "--batch_size", "16", "--confusion", "0", "--checkpoint", ck], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 or not os.path.isfile(ck):
        raise RuntimeError(f"setup: train_mnist could not write its checkpoint: {tail(r.stdout + r.stderr)}")


def main(argv):
    verbose = "-v" in argv
    wanted = [a for a in argv if a != "-v"]
    missing = [p for p in (LINREG, MNIST, UNET) if not os.path.isfile(p)]
    if missing:
        print(f"FAIL binaries: {missing} not found (run make first)")
        print("0 passed, 1 failed, 0 skipped")
        return 1
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="probe_inputs_")
    os.chmod(tmp, 0o755)
    tally = {}  # group -> {category: count}
    findings = []
    try:
        setup(tmp)
        cases = (flag_cases(tmp) + combination_cases(tmp) + path_cases(tmp) + tmpfs_cases(tmp)
                 + content_cases(tmp) + script_cases(tmp) + env_cases(tmp))
        if wanted:
            cases = [c for c in cases if any(w in f"{c.group}: {c.name}" for w in wanted)]

        def one(case):
            if case.skip:
                return "skipped", case.skip
            work = tempfile.mkdtemp(dir=tmp)
            try:
                res = run(case)
                expect = case.expect
                if expect == "either_late":  # a refusal is fine only when clean; said after the work: a finding
                    case.expect = "either"
                cat, detail = judge(case, res, work)
                if cat == "ok" and expect == "either_late" and res.code == 1 and case.work_word in res.out:
                    cat, detail = "garbage", f"refused only after the work: {tail(res.out)}"
                post = getattr(case, "post_always", None)
                if cat == "ok" and post:
                    why = post(res, work)
                    if why:
                        cat, detail = "garbage", why
                return cat, detail
            finally:
                shutil.rmtree(work, ignore_errors=True)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = {pool.submit(one, c): c for c in cases}
            for fut in concurrent.futures.as_completed(futures):
                c = futures[fut]
                try:
                    cat, detail = fut.result()
                except Exception as e:  # noqa: BLE001 - a bug of the probe itself is reported, not hidden
                    cat, detail = "crash", f"the probe raised {type(e).__name__}: {e}"
                tally.setdefault(c.group, {k: 0 for k in CATEGORIES})[cat] += 1
                if cat != "ok":
                    findings.append((c.group, c.name, cat, detail))
                    print(f"{'SKIP' if cat == 'skipped' else 'FAIL'} [{cat}] {c.group}: {c.name}: {detail}",
                          flush=True)
                elif verbose:
                    print(f"PASS {c.group}: {c.name}", flush=True)
    finally:
        for m in MOUNTS:
            subprocess.run(["umount", m], capture_output=True)
        for root, dirs, files in os.walk(tmp):
            for x in dirs + files:
                try:
                    os.chmod(os.path.join(root, x), 0o777, follow_symlinks=False)
                except (OSError, NotImplementedError):
                    pass
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'group':34s} " + " ".join(f"{c:>9s}" for c in CATEGORIES) + "    cases")
    for group, counts in tally.items():
        print(f"{group:34s} " + " ".join(f"{counts[c]:9d}" for c in CATEGORIES) + f"    {sum(counts.values()):5d}")
    totals = {c: sum(t[c] for t in tally.values()) for c in CATEGORIES}
    print(f"{'total':34s} " + " ".join(f"{totals[c]:9d}" for c in CATEGORIES) + f"    {sum(totals.values()):5d}")
    print(f"probe: {sum(totals.values())} cases in {time.time() - t0:.0f} s: {totals['crash']} crash, "
          f"{totals['traceback']} traceback, {totals['hang']} hang, {totals['garbage']} garbage, "
          f"{totals['unclear']} unclear, {totals['refused']} refused")
    failed = sum(totals[c] for c in CATEGORIES if c not in ("ok", "skipped"))
    print(f"{totals['ok']} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
