"""Bad inputs on the real ./train_unet binary: flags, data files and weight files. Needs no GPU (the trainer
validates every input before it looks for one) and runs in CI.

  python3 dev/test_unet_cli.py        (from the repository root, after `make train_unet`)

Each check runs the binary in a subprocess and requires a non-zero exit code AND the expected words in the
message. Prints PASS/FAIL/SKIP lines and the closing `N passed, N failed, N skipped`.
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
from generate import ModelConfig  # noqa: E402  (the parameter names and shapes of dev/unet.py)

BINARY = os.path.join(ROOT, "train_unet")
counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}

# a small model: every flag that sets its shape
SMALL = dict(image_size=16, in_channels=3, model_channels=32, out_channels=3, num_res_blocks=1, n_levels=2,
             mult0=1, mult1=2, mult2=0, mult3=0, attn_ds_mask=2, num_head_channels=16, diffusion_steps=1000,
             beta_start=1e-4, beta_end=0.02)
SMALL_FLAGS = ["--image_size", "16", "--model_channels", "32", "--channel_mult", "1,2", "--num_res_blocks", "1",
               "--attn_ds", "2", "--num_head_channels", "16"]
NO_GPU = "no CUDA GPU found"

FLAGS = ["data_file", "output_dir", "device", "batch_size", "lr", "beta1", "beta2", "adam_eps", "weight_decay", "steps",
         "log_every", "save_every", "seed", "ema_rate", "resume", "load", "precision", "image_size", "model_channels",
         "channel_mult", "num_res_blocks", "attn_ds", "num_head_channels", "diffusion_steps", "beta_start",
         "beta_end", "sample", "num_samples", "sampler", "sample_steps", "use_ema", "allow_change", "eval_loss",
         "optimizer", "muon_lr", "muon_momentum", "muon_nesterov", "ns_steps"]


def report(status, name, detail):
    counts[status] += 1
    print(f"{status} {name}: {detail}", flush=True)


def run(args, timeout=120):
    r = subprocess.run([BINARY] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    return r.returncode, r.stdout + r.stderr


def expect_error(name, args, *words):
    """A bad input: non-zero exit and every word in the output."""
    code, out = run(args)
    missing = [w for w in words if w not in out]
    last = out.strip().splitlines()[-1] if out.strip() else "(no output)"
    if code != 0 and not missing:
        report("PASS", name, f"exit {code}: {last}")
    else:
        report("FAIL", name, f"exit {code}, missing {missing} in: {out.strip()[-400:]}")


def expect_valid(name, args):
    """A good input: it gets past validation (exit 0 with a GPU, or the no-GPU message without one)."""
    code, out = run(args, timeout=600)
    if code == 0 or (NO_GPU in out and "error: " + NO_GPU in out):
        report("PASS", name, f"exit {code}: {out.strip().splitlines()[-1] if out.strip() else ''}")
    else:
        report("FAIL", name, f"exit {code}: {out.strip()[-400:]}")


def small_params(cfg=SMALL, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ModelConfig(cfg).param_shapes()
    return {n: rng.uniform(-0.1, 0.1, s).astype(np.float32) for n, s in shapes.items()}


def write_checkpoint(path, cfg=SMALL, params=None, ema=True, optimizer=True, step=0):
    params = small_params(cfg) if params is None else params
    tensors = dict(params)
    if ema:
        tensors.update({"ema." + n: v for n, v in params.items()})
    if optimizer:
        tensors.update({"adam_m." + n: np.zeros_like(v) for n, v in params.items()})
        tensors.update({"adam_v." + n: np.zeros_like(v) for n, v in params.items()})
        tensors["rng_state"] = np.array([0, step, step, 0], dtype=np.int32)
    config = dict(cfg, step=step, batch_size=4, seed=0, lr=1e-4, ema_rate=0.999, has_ema=int(ema),
                  has_optimizer=int(optimizer))
    binio.write(path, binio.UNET_CHECKPOINT, config, tensors)


def write_dataset(path, n=8, size=16, channels=3):
    images = np.random.default_rng(1).integers(0, 256, (n, size, size, channels), dtype=np.uint8)
    binio.write(path, binio.UNET_DATASET, dict(n_images=n, height=size, width=size, channels=channels),
                {"images": images})


def patch(path, out, offset, value):
    """A copy of path with the int32 at byte offset replaced."""
    data = bytearray(open(path, "rb").read())
    data[offset:offset + 4] = np.array([value], dtype="<i4").tobytes()
    open(out, "wb").write(bytes(data))


def main():
    if not os.path.isfile(BINARY):
        report("FAIL", "binary", f"{BINARY} not found: run `make train_unet` first")
        print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
        return 1
    # --help lists every flag with its default, in the three trainers' layout: "  --name  help [default]"
    code, out = run(["--help"])
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  --([a-z0-9_]+) +(.*)$", out, flags=re.M)}
    missing = [f for f in FLAGS if not re.search(r"\[[^\]]*\]", lines.get(f, ""))]
    if code == 0 and not missing and "help" in lines and "Flags (default in brackets):" in out:
        report("PASS", "help", f"exit 0, {len(FLAGS)} flags each with its default in brackets")
    else:
        report("FAIL", "help", f"exit {code}, flags missing or without a default: {missing}")
    device = lines.get("device", "")
    report("PASS" if device.endswith("[auto]  one of: auto,cuda,cpu") else "FAIL", "help: --device",
           device or "no --device line")

    # bad flags
    expect_error("unknown flag", ["--bogus", "1"], "error: unknown flag --bogus (see --help)")
    expect_error("not a flag", ["stray"], "error: expected a flag like --name, found 'stray' (see --help)")
    expect_error("missing value", ["--steps"], "error: flag --steps expects a value, found none")
    expect_error("non-numeric int", ["--batch_size", "abc"], "error: flag --batch_size expects an integer, found 'abc'")
    expect_error("int with trailing junk", ["--steps", "10x"], "flag --steps expects an integer, found '10x'")
    expect_error("zero batch", ["--batch_size", "0"],
                 "error: flag --batch_size expects an integer in [1, 4096], found 0")
    expect_error("negative lr", ["--lr", "-1"], "flag --lr expects a number in [1e-12, 1], found -1")
    expect_error("nan lr", ["--lr", "nan"], "error: flag --lr expects a number, found 'nan'")
    expect_error("unknown precision", ["--precision", "fp16"],
                 "error: flag --precision expects one of bf16,tf32,fp32, found 'fp16'")
    expect_error("the old --tf32 flag", ["--tf32", "1"], "unknown flag --tf32")
    expect_error("--device gpu", ["--device", "gpu"], "error: flag --device expects one of auto,cuda,cpu, found 'gpu'")
    expect_error("--device cpu points to generate.py", ["--device", "cpu"],
                 "error: --device cpu: train_unet trains, samples and evaluates on a CUDA GPU only",
                 "scripts/generate.py --checkpoint CKPT --device cpu")
    expect_error("eval_loss without a checkpoint", ["--eval_loss", "64"], "error: --eval_loss needs --load FILE")
    expect_error("eval_loss and sample", ["--eval_loss", "64", "--load", "x.bin", "--sample", "y.bin"],
                 "--eval_loss and --sample exclude each other")
    expect_error("negative eval_loss", ["--eval_loss", "-1"], "flag --eval_loss expects an integer in", "found -1")
    expect_error("bad channel_mult", ["--channel_mult", "1,x"], "--channel_mult", "1,x")
    expect_error("five levels", ["--channel_mult", "1,1,1,1,1"], "--channel_mult")
    expect_error("attn_ds not a power of 2", ["--attn_ds", "3"], "--attn_ds", "powers of 2")
    expect_error("channels not a multiple of 32", ["--model_channels", "48"], "multiple of 32")
    expect_error("heads do not divide channels", ["--num_head_channels", "48"], "num_head_channels")
    expect_error("image size not divisible", ["--image_size", "20"], "image_size 20")
    expect_error("sample without load", ["--sample", "x.bin"], "--sample needs --load")
    expect_error("resume and load", ["--resume", "a.bin", "--load", "b.bin"],
                 "error: --resume and --load exclude each other, found both")

    with tempfile.TemporaryDirectory() as tmp:
        good_data = os.path.join(tmp, "data16.bin")
        write_dataset(good_data)
        out_dir = os.path.join(tmp, "out")
        base = SMALL_FLAGS + ["--data_file", good_data, "--output_dir", out_dir, "--batch_size", "4",
                              "--steps", "0", "--save_every", "0"]
        expect_valid("valid data file", base)

        # data files
        def data_case(name, path, *words):
            expect_error(name, SMALL_FLAGS + ["--data_file", path, "--output_dir", out_dir, "--steps", "0"], *words)

        data_case("data: missing file", os.path.join(tmp, "nope.bin"), "nope.bin", "cannot open")
        bad = os.path.join(tmp, "magic.bin")
        patch(good_data, bad, 0, 20260302)
        data_case("data: wrong magic", bad, "magic is 20260302, expected 20260301")
        bad = os.path.join(tmp, "version.bin")
        patch(good_data, bad, 4, 7)
        data_case("data: wrong version", bad, "version is 7, expected 1")
        bad = os.path.join(tmp, "short.bin")
        open(bad, "wb").write(open(good_data, "rb").read()[:-5])
        data_case("data: truncated", bad, "file length", "tensor table say")
        bad = os.path.join(tmp, "long.bin")
        open(bad, "wb").write(open(good_data, "rb").read() + b"\0" * 3)
        data_case("data: trailing bytes", bad, "file length")
        bad = os.path.join(tmp, "tiny.bin")
        open(bad, "wb").write(b"\0" * 100)
        data_case("data: shorter than a header", bad, "shorter than the 1024-byte header")
        bad = os.path.join(tmp, "count.bin")
        patch(good_data, bad, 8, 1000000)
        data_case("data: tensor count", bad, "tensor count 1000000")
        bad = os.path.join(tmp, "chan.bin")
        patch(good_data, bad, 24, 4)
        data_case("data: channels field", bad, "channels is 4, expected 3")
        bad = os.path.join(tmp, "shape.bin")
        patch(good_data, bad, 12, 9)  # header n_images 9, tensor holds 8
        data_case("data: header/tensor shape mismatch", bad, "tensor images has shape (8, 16, 16, 3)",
                  "expected (9, 16, 16, 3)")
        bad = os.path.join(tmp, "dtype.bin")
        images = np.zeros((8, 16, 16, 3), dtype=np.float32)
        binio.write(bad, binio.UNET_DATASET, dict(n_images=8, height=16, width=16, channels=3), {"images": images})
        data_case("data: float images", bad, "dtype float32, expected uint8")
        bad = os.path.join(tmp, "data32.bin")
        write_dataset(bad, size=32)
        data_case("data: image size does not match the model", bad, "images are 32x32", "image_size is 16")
        expect_error("data: default model vs 16px data", ["--data_file", good_data, "--steps", "0"],
                     "images are 16x16", "image_size is 64")

        # weight files (--load, --resume, --sample)
        ckpt = os.path.join(tmp, "ckpt.bin")
        write_checkpoint(ckpt)
        expect_valid("valid checkpoint (--load)", ["--load", ckpt, "--data_file", good_data, "--output_dir", out_dir,
                                                   "--batch_size", "4", "--steps", "0", "--save_every", "0"])
        expect_valid("valid checkpoint (--resume)", ["--resume", ckpt, "--data_file", good_data, "--output_dir",
                                                     out_dir, "--steps", "1", "--save_every", "0"])

        def load_case(name, path, *words, extra=()):
            expect_error(name, ["--load", path, "--data_file", good_data, "--output_dir", out_dir, "--steps", "0"]
                         + list(extra), *words)

        load_case("weights: missing file", os.path.join(tmp, "none.bin"), "none.bin", "cannot open")
        bad = os.path.join(tmp, "wmagic.bin")
        patch(ckpt, bad, 0, 20260301)
        load_case("weights: wrong magic", bad, "magic is 20260301, expected 20260302")
        bad = os.path.join(tmp, "wversion.bin")
        patch(ckpt, bad, 4, 3)
        load_case("weights: wrong version", bad, "version is 3, expected 1")
        bad = os.path.join(tmp, "wshort.bin")
        open(bad, "wb").write(open(ckpt, "rb").read()[:-4])
        load_case("weights: truncated", bad, "file length")
        bad = os.path.join(tmp, "wlevels.bin")
        patch(ckpt, bad, 4 * 8, 9)  # n_levels 9
        load_case("weights: impossible model in header", bad, "n_levels must be 1..4")
        load_case("weights: model flags disagree", ckpt, "model_channels is 64, expected 32",
                  extra=["--model_channels", "64"])
        params = small_params()
        del params["middle_block.1.qkv.weight"]
        bad = os.path.join(tmp, "wmissing.bin")
        write_checkpoint(bad, params=params, ema=False, optimizer=False)
        load_case("weights: missing tensor", bad, "tensor middle_block.1.qkv.weight is missing")
        params = small_params()
        params["input_blocks.0.0.weight"] = np.zeros((32, 3, 3, 2), dtype=np.float32)
        bad = os.path.join(tmp, "wshape.bin")
        write_checkpoint(bad, params=params, ema=False, optimizer=False)
        load_case("weights: wrong shape", bad, "input_blocks.0.0.weight has shape (32, 3, 3, 2)",
                  "expected (32, 3, 3, 3)")
        bad = os.path.join(tmp, "wnoopt.bin")
        write_checkpoint(bad, ema=True, optimizer=False)
        expect_error("resume: checkpoint without optimizer state",
                     ["--resume", bad, "--data_file", good_data, "--output_dir", out_dir, "--steps", "1"],
                     "has_optimizer is 0, expected 1")
        big = os.path.join(tmp, "w32.bin")
        write_checkpoint(big, cfg=dict(SMALL, image_size=32))
        load_case("weights: image size does not match the data", big, "images are 16x16", "image_size is 32")
        expect_error("sample: checkpoint without EMA, --use_ema 1",
                     ["--sample", os.path.join(tmp, "s.bin"), "--load", bad.replace("wnoopt", "wmissing"),
                      "--use_ema", "1"], "tensor middle_block.1.qkv.weight is missing")
        noema = os.path.join(tmp, "wnoema.bin")
        write_checkpoint(noema, ema=False, optimizer=False)
        expect_error("sample: --use_ema 1 without EMA", ["--sample", os.path.join(tmp, "s.bin"), "--load", noema],
                     "has_ema is 0, expected 1")
        expect_error("sample: bad sampler", ["--sample", os.path.join(tmp, "s.bin"), "--load", ckpt, "--sampler",
                                             "euler"], "flag --sampler expects one of ddpm,ddim, found 'euler'")
        expect_error("sample: too many ddim steps", ["--sample", os.path.join(tmp, "s.bin"), "--load", ckpt,
                                                     "--sample_steps", "2000"], "--sample_steps 2000")
        expect_error("sample: wrong magic", ["--sample", os.path.join(tmp, "s.bin"), "--load", good_data],
                     "magic is 20260301, expected 20260302")

        resume_and_paths(tmp, good_data)
        muon_flags(tmp, good_data)
        table_and_log_lines(base)

    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


def resume_and_paths(tmp, good_data):
    """Issue 26: a resumed run keeps the stored trajectory (item 3 of its build list); paths that are not regular files
    (item 1); outputs checked at start-up (item 2); checkpoint contents (item 5). All before the GPU is needed."""
    out_dir = os.path.join(tmp, "out_resume")
    ckpt = os.path.join(tmp, "traj.bin")  # stored: step 5, seed 7, lr 2e-4, batch_size 4, ema_rate 0.999
    params = small_params()
    tensors = dict(params)
    tensors.update({"ema." + n: v for n, v in params.items()})
    tensors.update({"adam_m." + n: np.zeros_like(v) for n, v in params.items()})
    tensors.update({"adam_v." + n: np.zeros_like(v) for n, v in params.items()})
    tensors["rng_state"] = np.array([7, 5, 5, 0], dtype=np.int32)
    stored = dict(SMALL, step=5, batch_size=4, seed=7, lr=2e-4, ema_rate=0.999, has_ema=1, has_optimizer=1)
    binio.write(ckpt, binio.UNET_CHECKPOINT, stored, tensors)
    base = ["--resume", ckpt, "--data_file", good_data, "--output_dir", out_dir, "--steps", "10"]
    for flag, value, shown in (("lr", "0.001", "0.0002"), ("seed", "8", "7"), ("batch_size", "8", "4"),
                               ("ema_rate", "0.99", "0.999")):
        expect_error(f"resume: a changed --{flag} is refused", base + [f"--{flag}", value],
                     f"--{flag} {value}", f"{flag} {shown} stored in {ckpt}", f"--allow_change {flag}")
        expect_valid(f"resume: --{flag} changed knowingly (--allow_change {flag})",
                     base + [f"--{flag}", value, "--allow_change", flag])
    expect_valid("resume: the stored value given again", base + ["--lr", "2e-4", "--seed", "7", "--batch_size", "4"])
    code, out = run(base)
    ok = "resuming" in out and "lr 0.0002, seed 7, batch_size 4, ema_rate 0.999" in out
    report("PASS" if ok else "FAIL", "resume: flags not given take the stored values",
           out.strip().splitlines()[0] if out.strip() else "(no output)")
    expect_error("resume: --steps not beyond the stored step", base[:-2] + ["--steps", "5"], "at step 5",
                 "nothing left to train")
    expect_error("resume: --allow_change of an unknown flag", base + ["--allow_change", "lr,bogus"],
                 "--allow_change", "bogus")
    expect_error("--allow_change without --resume", ["--allow_change", "lr"], "--allow_change", "--resume")
    # checkpoint contents
    for name, patch_fn, words in (
            ("a negative step", lambda c, t: c.update(step=-1), ["step is -1"]),
            ("a NaN weight", lambda c, t: t["ema.out.2.bias"].__setitem__(0, np.nan), ["ema.out.2.bias", "finite"]),
            ("rng_state of another step", lambda c, t: t["rng_state"].__setitem__(1, 6), ["rng_state"])):
        cfg, ts = dict(stored), {k: v.copy() for k, v in tensors.items()}
        patch_fn(cfg, ts)
        bad = os.path.join(tmp, "bad_contents.bin")
        binio.write(bad, binio.UNET_CHECKPOINT, cfg, ts)
        expect_error(f"checkpoint contents: {name} (--resume)", ["--resume", bad] + base[2:], bad, *words)
        expect_error(f"checkpoint contents: {name} (--sample)", ["--sample", os.path.join(tmp, "s.bin"), "--load",
                                                                  bad], bad, *words)
    # paths that are not regular files: a directory must not abort (std::bad_alloc, exit 134)
    folder = os.path.join(tmp, "a_folder")
    os.makedirs(folder, exist_ok=True)
    for flag, args in (("--data_file", ["--data_file", folder] + SMALL_FLAGS), ("--load", ["--load", folder]),
                       ("--resume", ["--resume", folder]), ("--sample --load", ["--sample", "s.bin", "--load", folder])):
        expect_error(f"{flag} DIR is named a directory", args + ["--output_dir", out_dir], folder, "is a directory")
    # outputs at start-up, before the GPU is needed
    expect_error("--sample DIR is refused at start-up", ["--sample", folder, "--load", ckpt], folder, "directory")
    afile = os.path.join(tmp, "a_file")
    open(afile, "w").close()
    expect_error("--output_dir a file is refused at start-up", ["--data_file", good_data, "--output_dir", afile]
                 + SMALL_FLAGS, afile, "not a directory")
    os.makedirs(os.path.join(folder, "model.bin"), exist_ok=True)
    expect_error("--output_dir with model.bin a directory is refused at start-up",
                 ["--data_file", good_data, "--output_dir", folder] + SMALL_FLAGS, "model.bin", "directory")


def muon_flags(tmp, good_data):
    """--optimizer muon (issue 21): bad values of its flags, --zero 1 refused, the checkpoint's optimizer fields and
    tensors, and --resume keeping the stored optimizer and Muon settings unless --allow_change names them."""
    out_dir = os.path.join(tmp, "out_muon")
    run_flags = ["--data_file", good_data, "--output_dir", out_dir] + SMALL_FLAGS
    for flag, value, words in (("optimizer", "sgd", ["one of adamw,muon", "'sgd'"]),
                               ("muon_lr", "0", ["--muon_lr", "[1e-09, 1e+09]"]),
                               ("muon_momentum", "1", ["--muon_momentum", "[0, 0.999999]"]),
                               ("muon_nesterov", "2", ["--muon_nesterov", "[0, 1]"]),
                               ("ns_steps", "0", ["--ns_steps", "[1, 99]"]), ("ns_steps", "100", ["[1, 99]"])):
        expect_error(f"--{flag} {value}", run_flags + ["--optimizer", "muon", f"--{flag}", value], *words)
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    r = subprocess.run([BINARY] + run_flags + ["--optimizer", "muon", "--zero", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)
    out = r.stdout + r.stderr
    ok = r.returncode != 0 and "--optimizer muon with --zero 1" in out and "--zero 0" in out
    report("PASS" if ok else "FAIL", "--optimizer muon --zero 1 over 2 ranks is refused",
           f"exit {r.returncode}: {out.strip().splitlines()[-1] if out.strip() else '(no output)'}")
    for var, value, words in (("UNET_MUON_GROUPS", "two", ["UNET_MUON_GROUPS=two", "auto, shape or one"]),
                              ("UNET_MUON_OVERLAP", "yes", ["UNET_MUON_OVERLAP=yes", "1 (on) or 0 (off)"])):
        r = subprocess.run([BINARY] + run_flags + ["--optimizer", "muon"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL, env=dict(os.environ, **{var: value}))
        out = r.stdout + r.stderr
        missing = [w for w in words if w not in out]
        report("PASS" if r.returncode == 1 and not missing else "FAIL", f"{var}={value} is refused",
               f"exit {r.returncode}, missing {missing}: {out.strip().splitlines()[-1] if out.strip() else ''}")
    expect_valid("--optimizer muon with valid flags", run_flags + ["--optimizer", "muon", "--muon_lr", "0.01",
                                                                   "--ns_steps", "3", "--muon_nesterov", "0"])
    # a Muon checkpoint: muon_m.* instead of adam_m.*, the settings in slots 25..29
    params = small_params()
    tensors = dict(params)
    tensors.update({"ema." + n: v for n, v in params.items()})
    tensors.update({"muon_m." + n: np.zeros_like(v) for n, v in params.items()})
    tensors.update({"adam_v." + n: np.zeros_like(v) for n, v in params.items()})
    tensors["rng_state"] = np.array([7, 5, 5, 0], dtype=np.int32)
    stored = dict(SMALL, step=5, batch_size=4, seed=7, lr=2e-4, ema_rate=0.999, has_ema=1, has_optimizer=1,
                  optimizer=1, muon_lr=0.03, muon_momentum=0.9, muon_nesterov=1, ns_steps=4)
    ckpt = os.path.join(tmp, "muon.bin")
    binio.write(ckpt, binio.UNET_CHECKPOINT, stored, tensors)
    base = ["--resume", ckpt, "--data_file", good_data, "--output_dir", out_dir, "--steps", "10"]
    expect_valid("resume: a Muon checkpoint", base)
    code, out = run(base)
    report("PASS" if "optimizer muon" in out else "FAIL", "resume: the stored optimizer without --optimizer",
           out.strip().splitlines()[0] if out.strip() else "(no output)")
    for flag, value, shown in (("optimizer", "adamw", "muon"), ("muon_lr", "0.02", "0.03"),
                               ("muon_momentum", "0.95", "0.9"), ("muon_nesterov", "0", "1"), ("ns_steps", "5", "4")):
        expect_error(f"resume: a changed --{flag} is refused (Muon checkpoint)", base + [f"--{flag}", value],
                     f"--{flag} {value}", f"{flag} {shown} stored in {ckpt}", f"--allow_change {flag}")
        expect_valid(f"resume: --{flag} changed knowingly (--allow_change {flag})",
                     base + [f"--{flag}", value, "--allow_change", flag])
    adamw_ckpt = os.path.join(tmp, "adamw.bin")
    write_checkpoint(adamw_ckpt, step=5)
    expect_error("resume: --optimizer muon on an AdamW checkpoint is refused",
                 ["--resume", adamw_ckpt] + base[2:] + ["--optimizer", "muon"], "optimizer adamw stored",
                 "--allow_change optimizer")
    # checkpoint contents
    for name, patch_fn, words in (
            ("optimizer 2", lambda c, t: c.update(optimizer=2), ["optimizer is 2", "0 (adamw) or 1 (muon)"]),
            ("Muon with ns_steps 0", lambda c, t: c.update(ns_steps=0), ["ns_steps is 0", "1..99"]),
            ("AdamW with a Muon lr", lambda c, t: c.update(optimizer=0), ["muon_lr is 0.03", "unused"]),
            ("Muon holding adam_m.*", lambda c, t: t.update({"adam_m." + k[7:]: t.pop(k) for k in list(t)
                                                             if k.startswith("muon_m.")}), ["muon_m."])):
        cfg, ts = dict(stored), {k: v.copy() for k, v in tensors.items()}
        patch_fn(cfg, ts)
        bad = os.path.join(tmp, "bad_muon.bin")
        binio.write(bad, binio.UNET_CHECKPOINT, cfg, ts)
        expect_error(f"checkpoint: {name} (--resume)", ["--resume", bad] + base[2:], bad, *words)
        expect_error(f"checkpoint: {name} (--sample)", ["--sample", os.path.join(tmp, "s.bin"), "--load", bad], bad,
                     *words)


def have_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def table_and_log_lines(base):
    """The three trainers' dialect: --device cuda without a GPU (no GPU), or a short run's boxed start-up table (the
    device, then every flag) and its log lines 'step N/TOTAL | train loss X | Y ms/step | Z images/s' (GPU)."""
    if not have_gpu():
        expect_error("--device cuda without a GPU", base + ["--device", "cuda"],
                     "error: --device cuda but no CUDA device is available")
        report("SKIP", "start-up table and log lines", "no GPU")
        return
    i = base.index("--steps")
    args = base[:i] + base[i + 2:] + ["--steps", "20", "--log_every", "10"]
    code, out = run(args, timeout=600)
    lines = out.splitlines()
    rule = "+" + "-" * 23 + "+" + "-" * 46 + "+"
    rules = [i for i, line in enumerate(lines) if line == rule]
    rows = lines[rules[0] + 1:rules[1]] if len(rules) >= 2 else []
    keys = [r[2:23].strip() for r in rows]
    ok = (code == 0 and rows and all(re.fullmatch(r"\| .{21} \| .{44,} \|", r) for r in rows) and
          rows[0].startswith("| device                | cuda (") and set(FLAGS) - {"device"} <= set(keys[1:]))
    report("PASS" if ok else "FAIL", "start-up table: boxed, the device, then every flag",
           f"exit {code}, {len(rows)} rows: {keys[:4]}...")
    steps = re.findall(r"^step +(\d+)/20 \| train loss [0-9.]+ \| +[0-9.]+ ms/step \| +[0-9.]+ images/s$", out, re.M)
    final = re.search(r"^final \| step 20 \| train_loss [0-9.]+ \| train_ms [0-9.]+$", out, re.M)
    report("PASS" if steps == ["10", "20"] and final else "FAIL",
           "log lines: step N/TOTAL | train loss | ms/step | images/s, then final |", f"steps {steps}")


if __name__ == "__main__":
    sys.exit(main())
