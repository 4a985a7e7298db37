"""CI tests of the UNet's Python side: scripts/prepare_data.py, scripts/generate.py (CPU path), scripts/plot_loss.py,
the unet formats of scripts/binio.py, and the NumPy forward of generate.py against dev/unet.py's committed fixture.
Needs NumPy, Pillow and matplotlib only; with torch importable (GPU machine) it also compares the NumPy forward
with dev/unet.py directly at the full 64x64 configuration (SKIP otherwise).

  python3 dev/test_unet_scripts.py        # from the repo root; last line: N passed, N failed, N skipped
"""
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import binio  # noqa: E402
import generate  # noqa: E402

FIXTURE = os.path.join(ROOT, "dev", "fixtures", "unet_forward_small.bin")
TMP = tempfile.mkdtemp(prefix="test_unet_scripts_")


class Skip(Exception):
    pass


def run(script, *args):
    """Runs a script of scripts/ as a user would; -> (returncode, stdout + stderr)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script)] + [str(a) for a in args],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    return r.returncode, r.stdout + r.stderr


def expect_fail(code_out, *needles):
    code, out = code_out
    assert code != 0, f"exit code 0, expected a failure; output: {out.strip()[-300:]}"
    for n in needles:
        assert n in out, f"message lacks {n!r}: {out.strip()[-300:]}"
    return f"exit {code}: {out.strip().splitlines()[-1][:110]}"


def folder(name, images):
    """images: dict file name -> PIL image or raw bytes."""
    d = os.path.join(TMP, name)
    os.makedirs(d)
    for fname, im in images.items():
        if isinstance(im, bytes):
            with open(os.path.join(d, fname), "wb") as f:
                f.write(im)
        else:
            im.save(os.path.join(d, fname))
    return d


def stripes(width, height, axis, side):
    """An RGB image: red before the centred square of side `side` along `axis` (0 rows, 1 columns), green inside
    it, blue after; the split follows prepare_data's rule (margin (n - side) // 2 before)."""
    a = np.zeros((height, width, 3), np.uint8)
    n = width if axis == 1 else height
    lo = (n - side) // 2
    idx = np.arange(n)
    colour = np.where(idx < lo, 0, np.where(idx < lo + side, 1, 2))
    for c in range(3):
        band = (colour == c).astype(np.uint8) * 255
        a[..., c] = band[None, :] if axis == 1 else band[:, None]
    return Image.fromarray(a)


# ----------------------------------------------------------------------------------------------------------------
# prepare_data


def test_prepare_data_shapes_and_crop():
    rng = np.random.default_rng(0)
    d = folder("crop", {
        "a_wide.png": stripes(41, 20, axis=1, side=20),   # odd margin: 10 columns left, 11 right
        "b_tall.png": stripes(15, 33, axis=0, side=15),   # 9 rows top, 9 bottom
        "c_gray.png": Image.fromarray(rng.integers(0, 256, (13, 29), dtype=np.uint8), "L"),
        "d_rgba.png": Image.fromarray(rng.integers(0, 256, (10, 10, 4), dtype=np.uint8), "RGBA"),
        "notes.txt": b"not an image, ignored by extension",
    })
    out = os.path.join(TMP, "crop.bin")
    code, log = run("prepare_data.py", "--input_dir", d, "--output", out, "--image_size", 8)
    assert code == 0, log
    _, cfg, t = binio.read(out, binio.UNET_DATASET)
    assert (cfg["n_images"], cfg["height"], cfg["width"], cfg["channels"]) == (4, 8, 8, 3), cfg
    images = binio.expect(out, t, "images", (4, 8, 8, 3), np.uint8)
    # the crop keeps exactly the green square (a constant image resizes to itself up to rounding)
    for i in (0, 1):
        err = np.abs(images[i].astype(int) - [0, 255, 0]).max()
        assert err <= 1, f"image {i}: centre crop is not the green square (max deviation {err})"
    return "4 images (41x20, 15x33, gray 29x13, RGBA 10x10) -> (4, 8, 8, 3); crops green within 1/255"


def test_prepare_data_exact_values():
    """No resampling when the crop is already image_size: the output must be the crop's pixels exactly."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (12, 17, 3), dtype=np.uint8)   # side 12, left margin (17 - 12) // 2 = 2
    b = rng.integers(0, 256, (19, 12, 3), dtype=np.uint8)   # top margin 3
    d = folder("exact", {"a.png": Image.fromarray(a), "b.png": Image.fromarray(b)})
    out = os.path.join(TMP, "exact.bin")
    code, log = run("prepare_data.py", "--input_dir", d, "--output", out, "--image_size", 12)
    assert code == 0, log
    images = binio.read(out, binio.UNET_DATASET)[2]["images"]
    assert np.array_equal(images[0], a[:, 2:14]), "17x12 image: wrong columns kept"
    assert np.array_equal(images[1], b[3:15, :]), "12x19 image: wrong rows kept"
    return "17x12 -> columns 2..13, 12x19 -> rows 3..14, bit-exact"


def test_prepare_data_bad_inputs():
    details = []
    details.append(expect_fail(run("prepare_data.py", "--input_dir", os.path.join(TMP, "nowhere"),
                                   "--output", os.path.join(TMP, "x.bin")), "no such folder", "nowhere"))
    empty = folder("empty", {"readme.txt": b"hello"})
    details.append(expect_fail(run("prepare_data.py", "--input_dir", empty, "--output", os.path.join(TMP, "x.bin")),
                               "no image files"))
    broken = folder("broken", {"bad.jpg": b"\xff\xd8 this is not a jpeg"})
    details.append(expect_fail(run("prepare_data.py", "--input_dir", broken, "--output", os.path.join(TMP, "x.bin")),
                               "none of the 1 image files could be read", "bad.jpg"))
    mixed = folder("mixed", {"bad.jpg": b"garbage", "good.png": Image.new("RGB", (9, 7), (10, 20, 30))})
    details.append(expect_fail(run("prepare_data.py", "--input_dir", mixed, "--output", os.path.join(TMP, "x.bin"),
                                   "--on_error", "fail"), "cannot read image", "bad.jpg"))
    out = os.path.join(TMP, "mixed.bin")
    code, log = run("prepare_data.py", "--input_dir", mixed, "--output", out, "--image_size", 4)
    assert code == 0 and "warning: skipping unreadable image" in log and "bad.jpg" in log, log
    images = binio.read(out, binio.UNET_DATASET)[2]["images"]
    assert images.shape == (1, 4, 4, 3) and np.all(images == [10, 20, 30]), images.shape
    details.append(expect_fail(run("prepare_data.py", "--input_dir", mixed, "--output", out, "--image_size", 0),
                               "--image_size"))
    return (f"{len(details)} rejected with exit 1 and a message (missing folder, no images, all unreadable, "
            f"--on_error fail, --image_size 0); the default skips an unreadable file with a warning")


# ----------------------------------------------------------------------------------------------------------------
# binio errors


def small_dataset(path):
    images = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    binio.write(path, binio.UNET_DATASET, dict(n_images=2, height=4, width=4, channels=3), {"images": images})
    with open(path, "rb") as f:
        return bytearray(f.read())


def expect_format_error(path, fmt, *needles):
    try:
        binio.read(path, fmt)
    except binio.FormatError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"message lacks {n!r}: {msg}"
        return msg
    raise AssertionError(f"{path}: read without error, expected one naming {needles}")


def patched(name, raw, offset=None, value=None, length=None):
    raw = bytearray(raw)
    if offset is not None:
        raw[offset:offset + 4] = np.array([value], dtype="<i4").tobytes()
    if length is not None:
        raw = raw[:length] if length <= len(raw) else raw + b"\0" * (length - len(raw))
    path = os.path.join(TMP, name)
    with open(path, "wb") as f:
        f.write(raw)
    return path


def test_binio_errors():
    good = os.path.join(TMP, "good.bin")
    raw = small_dataset(good)
    _, cfg, t = binio.read(good, binio.UNET_DATASET)
    assert cfg == dict(n_images=2, height=4, width=4, channels=3) and t["images"].shape == (2, 4, 4, 3)
    expect_format_error(patched("magic.bin", raw, 0, 20260302), binio.UNET_DATASET, "magic", "20260302", "20260301")
    expect_format_error(patched("version.bin", raw, 4, 7), binio.UNET_DATASET, "version", "7")
    expect_format_error(patched("count.bin", raw, 8, 1000), binio.UNET_DATASET, "tensor count", "1000")
    expect_format_error(patched("trunc.bin", raw, length=len(raw) - 1), binio.UNET_DATASET, "file length")
    expect_format_error(patched("long.bin", raw, length=len(raw) + 4), binio.UNET_DATASET, "file length")
    expect_format_error(patched("short.bin", raw, length=100), binio.UNET_DATASET, "shorter")
    # a shape that no longer matches the data (dim 0 = 3 images for 2 images of bytes)
    expect_format_error(patched("shape.bin", raw, 1024 + 96 + 8, 3), binio.UNET_DATASET, "file length")
    expect_format_error(patched("dtype.bin", raw, 1024 + 96, 9), binio.UNET_DATASET, "dtype code 9")
    expect_format_error(good, binio.UNET_CHECKPOINT, "magic")
    expect_format_error(os.path.join(TMP, "missing.bin"), binio.UNET_DATASET, "cannot open")
    try:
        binio.expect(good, t, "images", (2, 4, 4, 4), np.uint8)
        raise AssertionError("expect() accepted a wrong shape")
    except binio.FormatError as e:
        assert "shape" in str(e) and "(2, 4, 4, 3)" in str(e), e
    return "magic, version, tensor count, truncated, extra bytes, short header, shape/length, dtype, kind, missing"


# ----------------------------------------------------------------------------------------------------------------
# generate.py


def load_fixture():
    if not os.path.exists(FIXTURE):
        raise AssertionError(f"{FIXTURE} is missing: make it with dev/unet.py --forward_fixture (see its header)")
    _, cfg, tensors = binio.read(FIXTURE, binio.UNET_FIXTURE)
    config = generate.ModelConfig(cfg, FIXTURE)
    shapes = config.param_shapes()
    weights = {n: binio.expect(FIXTURE, tensors, n, s, np.float32) for n, s in shapes.items()}
    return cfg, config, tensors, weights


def test_param_names_match_reference():
    cfg, config, tensors, weights = load_fixture()
    params = [n for n in tensors if n not in ("x_t", "t", "out")]
    extra = sorted(set(params) - set(weights))
    assert not extra, f"dev/unet.py has parameters generate.py does not know: {extra[:5]}"
    return f"{len(params)} parameter names and shapes of dev/unet.py's state_dict == generate.ModelConfig's"


def compare(name, got, ref, atol, rtol):
    err = np.abs(got.astype(np.float64) - ref)
    bound = atol + rtol * np.abs(ref)
    idx = np.unravel_index(np.argmax(err - bound), err.shape)
    worst = np.unravel_index(np.argmax(err), err.shape)
    detail = (f"{name}: max abs err {err.max():.3g} at {tuple(int(i) for i in worst)} (ref {ref[worst]:.4f}), "
              f"ref std {ref.std():.3f}, tol {atol:g} + {rtol:g}*|ref|")
    assert np.all(err <= bound), f"{detail}; worst vs tolerance at {tuple(int(i) for i in idx)}"
    return detail


# NumPy (float32 BLAS, float64 GroupNorm statistics) against PyTorch fp32 with TF32 off: both are fp32 with
# different summation orders over up to 9*256 terms per conv, ~50 layers deep, and the timestep embedding's
# arguments reach ~1000, where one ulp of a frequency moves cos/sin by ~1e-4 before the MLP. Measured on the H100
# machine (2026-11-22): max abs error 1.5e-6 on this fixture (outputs std 0.33), 2.0e-6 against torch CPU and
# 3.5e-6 against torch GPU at the full 64x64 model. The bound is ~10x that, for other BLAS libraries; a wrong
# layer moves outputs by O(0.1).
FWD_ATOL, FWD_RTOL = 3e-5, 3e-4


def test_numpy_forward_vs_fixture():
    cfg, config, tensors, weights = load_fixture()
    model = generate.NumpyUNet(config, weights)
    t0 = time.time()
    out = model.forward(tensors["x_t"], tensors["t"])
    ms = (time.time() - t0) * 1000
    return compare("out", out, tensors["out"].astype(np.float64), FWD_ATOL, FWD_RTOL) + \
        f"; config {config.image_size}px ch {config.model_channels} mult {config.channel_mult} " \
        f"attn ds {config.attention_ds} heads of {config.num_head_channels}, B={cfg['batch_size']}, {ms:.0f} ms"


def fixture_checkpoint(path, ema, diffusion_steps=None):
    cfg, config, tensors, weights = load_fixture()
    fields = {n: cfg[n] for n, _ in binio.UNET_MODEL_FIELDS}
    if diffusion_steps:
        fields["diffusion_steps"] = diffusion_steps
    t = dict(weights)
    if ema:
        t.update({"ema." + n: w * np.float32(0.5) for n, w in weights.items()})
    binio.write(path, binio.UNET_CHECKPOINT, dict(fields, step=123, batch_size=4, seed=0, lr=1e-4, ema_rate=0.999,
                                                  has_ema=int(ema), has_optimizer=0), t)
    return config


def test_generate_cpu_runs():
    ckpt = os.path.join(TMP, "ckpt_ema.bin")
    config = fixture_checkpoint(ckpt, ema=True)
    png, bin1, bin2 = (os.path.join(TMP, n) for n in ("s.png", "s1.bin", "s2.bin"))
    t0 = time.time()
    code, log = run("generate.py", "--checkpoint", ckpt, "--out", png, "--out_bin", bin1, "--num_samples", 5,
                    "--sampler", "ddim", "--steps", 4, "--device", "cpu", "--batch_size", 2, "--seed", 3)
    secs = time.time() - t0
    assert code == 0, log
    assert "ema weights" in log, log
    s = config.image_size
    with Image.open(png) as im:  # 5 samples -> 3 columns, 2 rows, 2 px padding
        assert im.size == (3 * (s + 2) + 2, 2 * (s + 2) + 2) and im.mode == "RGB", (im.size, im.mode)
    a = binio.read(bin1, binio.UNET_DATASET)[2]["images"]
    assert a.shape == (5, s, s, 3), a.shape
    code, log = run("generate.py", "--checkpoint", ckpt, "--out", png, "--out_bin", bin2, "--num_samples", 5,
                    "--sampler", "ddim", "--steps", 4, "--device", "cpu", "--seed", 3, "--weights", "raw")
    assert code == 0 and "raw weights" in log, log
    b = binio.read(bin2, binio.UNET_DATASET)[2]["images"]
    assert not np.array_equal(a, b), "--weights raw gave the same samples as the (different) EMA weights"
    return f"ddim 4 steps, 5 samples of {s}px: PNG {3 * (s + 2) + 2}x{2 * (s + 2) + 2}, {secs:.1f} s; ema != raw"


def test_generate_ddpm_and_seed():
    ckpt = os.path.join(TMP, "ckpt_t20.bin")
    fixture_checkpoint(ckpt, ema=False, diffusion_steps=20)  # ddpm walks every step: keep T small for CI
    outs = []
    for seed, name in ((7, "d1.bin"), (7, "d2.bin"), (8, "d3.bin")):
        path = os.path.join(TMP, name)
        code, log = run("generate.py", "--checkpoint", ckpt, "--out", os.path.join(TMP, "d.png"), "--out_bin", path,
                        "--num_samples", 2, "--sampler", "ddpm", "--device", "cpu", "--seed", seed)
        assert code == 0 and "ddpm 20 steps" in log, log
        outs.append(binio.read(path, binio.UNET_DATASET)[2]["images"])
    assert np.array_equal(outs[0], outs[1]), "same seed, different samples"
    assert not np.array_equal(outs[0], outs[2]), "different seeds, same samples"
    return "ddpm over T=20: same seed -> identical samples, another seed -> different"


class OracleModel:
    """The exact epsilon predictor for data that is one image x_star: eps = (x_t - sqrt(acp) x_star) / sqrt(1 - acp).
    With it DDIM (eta 0) must land on x_star and DDPM's posterior mean must converge to it: this checks the
    samplers' algebra apart from the network."""

    def __init__(self, x_star, schedule):
        self.x_star, self.schedule = x_star, schedule
        self.config = type("Cfg", (), {"image_size": x_star.shape[-1]})

        self.eps_seen = []  # per call: the standardised noise in the x_t the sampler passed in

    def forward(self, x, t):
        acp = self.schedule.acp[int(t[0])]
        eps = ((x - np.sqrt(acp) * self.x_star) / np.sqrt(1.0 - acp)).astype(np.float32)
        self.eps_seen.append(eps)
        return eps


def test_samplers_recover_point_mass():
    schedule = generate.Schedule(1000, float(np.float32(1e-4)), float(np.float32(0.02)))
    x_star = np.random.default_rng(0).uniform(-0.9, 0.9, (1, 3, 8, 8)).astype(np.float32)
    oracle = OracleModel(x_star, schedule)
    details = []
    # fp32 arithmetic: each step rounds at ~1e-7 relative; the final x0 estimate is exact up to that
    for sampler, steps, tol in (("ddim", 50, 1e-4), ("ddim", 7, 1e-4), ("ddpm", 1000, 1e-4)):
        oracle.eps_seen = []
        x = generate.sample_cpu(oracle, schedule, 4, sampler, steps, seed=1, batch_size=4, log=None)
        err = np.abs(x - x_star).max()
        assert err < tol, f"{sampler} {steps} steps: max |x - x_star| = {err:.3g}, expected < {tol:g}"
        seen = np.stack(oracle.eps_seen)  # (steps, 4, 3, 8, 8)
        if sampler == "ddim":  # eta 0: the noise direction is kept exactly from step to step
            drift = np.abs(seen - seen[0]).max()
            assert drift < 1e-3, f"ddim {steps}: the noise in x_t drifts by {drift:.3g} along the trajectory"
            details.append(f"ddim {steps}: {err:.2g}, noise drift {drift:.2g}")
        else:  # every x_t must hold unit-variance noise: the right sigma_t at every step (768 values a step)
            stds = seen.reshape(len(seen), -1).std(axis=1)
            assert np.all(np.abs(stds - 1) < 0.15), f"ddpm: noise std in x_t ranges {stds.min():.3f}..{stds.max():.3f}"
            details.append(f"ddpm: {err:.2g}, noise std in x_t {stds.min():.2f}..{stds.max():.2f}")
    assert generate.ddim_timesteps(1000, 50)[:3] == [0, 20, 40] and generate.ddim_timesteps(1000, 7)[-1] == 857
    return "exact-epsilon oracle lands on the data point (max abs error): " + "; ".join(details)


def test_generate_bad_inputs():
    details = []
    ckpt = os.path.join(TMP, "ckpt_raw.bin")
    fixture_checkpoint(ckpt, ema=False)
    png = os.path.join(TMP, "bad.png")
    details.append(expect_fail(run("generate.py", "--checkpoint", ckpt, "--out", png, "--weights", "ema",
                                   "--device", "cpu"), "has_ema 0"))
    ds = os.path.join(TMP, "good.bin")
    small_dataset(ds)
    details.append(expect_fail(run("generate.py", "--checkpoint", ds, "--out", png, "--device", "cpu"),
                               "magic", "20260301", "20260302"))
    details.append(expect_fail(run("generate.py", "--checkpoint", os.path.join(TMP, "nope.bin"), "--out", png),
                               "cannot open"))
    with open(ckpt, "rb") as f:
        raw = f.read()
    details.append(expect_fail(run("generate.py", "--checkpoint", patched("ck_trunc.bin", raw, length=len(raw) - 8),
                                   "--out", png, "--device", "cpu"), "file length"))
    # a checkpoint of another shape: drop a tensor / change the model width in the header
    _, cfg, tensors = binio.read(ckpt, binio.UNET_CHECKPOINT)
    t2 = dict(tensors)
    del t2["middle_block.1.qkv.weight"]
    binio.write(os.path.join(TMP, "ck_missing.bin"), binio.UNET_CHECKPOINT, cfg, t2)
    details.append(expect_fail(run("generate.py", "--checkpoint", os.path.join(TMP, "ck_missing.bin"), "--out", png,
                                   "--device", "cpu"), "middle_block.1.qkv.weight", "missing"))
    binio.write(os.path.join(TMP, "ck_width.bin"), binio.UNET_CHECKPOINT, dict(cfg, model_channels=64), tensors)
    details.append(expect_fail(run("generate.py", "--checkpoint", os.path.join(TMP, "ck_width.bin"), "--out", png,
                                   "--device", "cpu"), "shape"))
    binio.write(os.path.join(TMP, "ck_levels.bin"), binio.UNET_CHECKPOINT, dict(cfg, n_levels=5), tensors)
    details.append(expect_fail(run("generate.py", "--checkpoint", os.path.join(TMP, "ck_levels.bin"), "--out", png,
                                   "--device", "cpu"), "n_levels", "5"))
    details.append(expect_fail(run("generate.py", "--checkpoint", ckpt, "--out", png, "--sampler", "ddpm",
                                   "--steps", 50, "--device", "cpu"), "--steps"))
    details.append(expect_fail(run("generate.py", "--checkpoint", ckpt, "--out", png, "--num_samples", 0),
                               "--num_samples"))
    details.append(expect_fail(run("generate.py", "--checkpoint", ckpt, "--out", png, "--bogus", 1), "--bogus"))
    details.append(expect_fail(run("generate.py", "--checkpoint", ckpt, "--out", png, "--device", "cuda",
                                   "--binary", os.path.join(TMP, "no_train_unet")), "--device cuda"))
    details.append(expect_fail(run("generate.py", "--checkpoint", ckpt, "--out", png, "--device", "gpu"),
                               "--device", "'gpu'", "'cuda'"))
    return f"{len(details)} bad inputs rejected (no ema, wrong magic, missing file, truncated, missing tensor, " \
           f"wrong width, bad n_levels, ddpm --steps, --num_samples 0, unknown flag, cuda without binary, " \
           f"--device gpu)"


def test_generate_gpu_path():
    """generate.py --device cuda through ./train_unet --sample (GPU machine only)."""
    ok, why = generate.gpu_available(os.path.join(ROOT, "train_unet"))
    if not ok:
        raise Skip(f"{why} (needs a GPU and a built ./train_unet)")
    ckpt = os.path.join(TMP, "ckpt_gpu.bin")
    config = fixture_checkpoint(ckpt, ema=True)
    png, out = os.path.join(TMP, "gpu.png"), os.path.join(TMP, "gpu.bin")
    code, log = run("generate.py", "--checkpoint", ckpt, "--out", png, "--out_bin", out, "--num_samples", 5,
                    "--sampler", "ddim", "--steps", 10, "--device", "cuda", "--binary", "./train_unet")
    assert code == 0, log
    images = binio.read(out, binio.UNET_DATASET)[2]["images"]
    s = config.image_size
    assert images.shape == (5, s, s, 3), images.shape
    assert images.std() > 1, "all samples are one flat colour"
    return f"./train_unet --sample: 5 samples of {s}px, ddim 10 steps, EMA weights; PNG written"


# ----------------------------------------------------------------------------------------------------------------
# plot_loss.py


def test_plot_loss():
    log = os.path.join(TMP, "log.csv")
    with open(log, "w") as f:
        f.write("step,loss,ms,images_per_s\n")
        for i in range(1, 51):
            f.write(f"{i},{1.0 / i + 0.05:.5f},{60 + i % 3},{533.3}\n")
    png = os.path.join(TMP, "loss.png")
    code, out = run("plot_loss.py", "--log", log, "--out", png)
    assert code == 0, out
    with Image.open(png) as im:
        assert im.size[0] >= 400 and im.size[1] >= 300, im.size
    code, out = run("plot_loss.py", "--log", TMP, "--out", png)  # the output_dir works too
    assert code == 0, out
    bad_header = os.path.join(TMP, "bad_header.csv")
    with open(bad_header, "w") as f:
        f.write("step,loss\n1,0.5\n")
    bad_row = os.path.join(TMP, "bad_row.csv")
    with open(bad_row, "w") as f:
        f.write("step,loss,ms,images_per_s\n1,0.5,60,500\n2,nan?,60,500\n")
    empty = os.path.join(TMP, "empty.csv")
    with open(empty, "w") as f:
        f.write("step,loss,ms,images_per_s\n")
    expect_fail(run("plot_loss.py", "--log", bad_header, "--out", png), "header", "step,loss,ms,images_per_s")
    expect_fail(run("plot_loss.py", "--log", bad_row, "--out", png), "line 3", "loss")
    expect_fail(run("plot_loss.py", "--log", empty, "--out", png), "no rows")
    expect_fail(run("plot_loss.py", "--log", os.path.join(TMP, "none.csv"), "--out", png), "cannot open")
    return "50-row log -> PNG; wrong header, bad row (line 3), empty log, missing file rejected"


# ----------------------------------------------------------------------------------------------------------------
# against PyTorch (GPU machine only)


def test_numpy_forward_vs_torch_full_size():
    try:
        import importlib.util
        import torch
    except ImportError:
        raise Skip("no torch (CI): the committed fixture covers the small configuration")
    spec = importlib.util.spec_from_file_location("unet_ref", os.path.join(ROOT, "dev", "unet.py"))
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = ref.UNetModel(64, 3, 64, 3, 2, (4, 8), (1, 2, 3, 4), 32, zero_init=False).eval()
    fields = ref.model_fields(model, 1000, 1e-4, 0.02)
    config = generate.ModelConfig(fields)
    shapes = config.param_shapes()
    sd = {n: p.detach().numpy() for n, p in model.state_dict().items()}
    assert {n: tuple(v.shape) for n, v in sd.items()} == shapes, "state_dict names/shapes differ from generate.py's"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 64, 64, generator=g)
    t = torch.tensor([0, 517, 999])
    with torch.no_grad():
        want = model(x, t).double().numpy()
    got = generate.NumpyUNet(config, sd).forward(x.numpy(), t.numpy())
    return compare("out 64px default model (torch cpu)", got, want, FWD_ATOL, FWD_RTOL) + f", {len(sd)} tensors"


# ----------------------------------------------------------------------------------------------------------------


def main():
    tests = [(name[5:], fn) for name, fn in globals().items() if name.startswith("test_") and callable(fn)]
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for name, fn in tests:
        try:
            detail = fn()
            status = "PASS"
        except Skip as e:
            status, detail = "SKIP", str(e)
        except Exception as e:  # noqa: BLE001 - any error is a failed check, reported with its cause
            status = "FAIL"
            detail = f"{type(e).__name__}: {e}"
            if not isinstance(e, AssertionError):
                detail += "\n" + traceback.format_exc(limit=3)
        counts[status] += 1
        print(f"{status} {name}: {detail}", flush=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
