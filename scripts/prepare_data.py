"""Turns a folder of images of any size into a UNET_DATASET .bin (uint8 RGB, NHWC) for train_unet.

Each image (files sorted by name; .jpg .jpeg .png .bmp .gif .webp .tif .tiff, any case) is turned upright by its
EXIF orientation, converted to RGB, centre-cropped to a square of its shorter side (the extra pixels split evenly,
an odd one dropped at the right/bottom), and resized to --image_size with Pillow's LANCZOS filter (antialiased
when shrinking). Unreadable images are skipped with a warning on stderr by default (--on_error fail stops at the
first one); no readable image at all is an error. Exit code 1 on any error, with a message naming the path.

  python3 scripts/prepare_data.py --input_dir ../shared/data/images/tf_flowers_sunflowers/jpg \
      --output data/sunflowers64.bin --image_size 64
"""
import argparse
import errno
import os
import sys

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import binio  # noqa: E402

EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def centre_crop_box(width, height):
    """(left, top, right, bottom) of the centred square of side min(width, height)."""
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def load_image(path, image_size):
    """-> uint8 (image_size, image_size, 3). Raises OSError / UnidentifiedImageError / ValueError if unreadable."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit samples: convert("RGB") would clip them at 255
            im = Image.fromarray(np.round(np.asarray(im, dtype=np.float64) / 257.0).clip(0, 255).astype(np.uint8))
        im = im.convert("RGB")
        im = im.crop(centre_crop_box(*im.size))
        im = im.resize((image_size, image_size), Image.LANCZOS)
        return np.asarray(im, dtype=np.uint8).copy()


def list_images(input_dir):
    return sorted(f for f in os.listdir(input_dir)
                  if os.path.splitext(f)[1].lower() in EXTENSIONS and os.path.isfile(os.path.join(input_dir, f)))


def main(argv=None):
    p = binio.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input_dir", required=True, help="folder of images, not searched recursively (required)")
    p.add_argument("--output", default="data/images64.bin", help="UNET_DATASET file to write")
    p.add_argument("--image_size", type=int, default=64, help="side of the square output images")
    p.add_argument("--on_error", default="skip", choices=["skip", "fail"],
                   help="unreadable image: skip it with a warning, or stop with an error")
    args = p.parse_args(argv)
    if not 1 <= args.image_size <= 4096:
        sys.exit(f"error: --image_size must be in 1..4096, found {args.image_size}")
    try:
        what = "" if os.path.isdir(args.input_dir) else "not a folder" if os.stat(args.input_dir) else ""
    except OSError as e:
        what = "no such folder" if e.errno == errno.ENOENT else f"cannot open it ({e.strerror})"
    if what:
        sys.exit(f"error: --input_dir {args.input_dir}: {what}")
    try:  # before reading every image
        binio.check_output(args.output, "--output")
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    try:
        names = list_images(args.input_dir)
    except OSError as e:
        sys.exit(f"error: --input_dir {args.input_dir}: cannot list it ({e.strerror})")
    if not names:
        sys.exit(f"error: --input_dir {args.input_dir}: no image files (expected one of {sorted(EXTENSIONS)})")

    images, skipped = [], []
    for name in names:
        path = os.path.join(args.input_dir, name)
        try:
            images.append(load_image(path, args.image_size))
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
            if args.on_error == "fail":
                sys.exit(f"error: cannot read image {path}: {e}")
            print(f"warning: skipping unreadable image {path}: {e}", file=sys.stderr)
            skipped.append(name)
    if not images:
        sys.exit(f"error: --input_dir {args.input_dir}: none of the {len(names)} image files could be read")

    data = np.stack(images)  # (N, S, S, 3) uint8
    n, s = data.shape[0], args.image_size
    try:
        real = binio.write(args.output, binio.UNET_DATASET, dict(n_images=n, height=s, width=s, channels=3),
                           {"images": data})
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    mean = data.reshape(-1, 3).mean(axis=0)
    print(f"wrote {args.output}{binio.written_note(args.output, real)}: {n} images {s}x{s}x3 uint8 "
          f"({os.path.getsize(real)} bytes), {len(skipped)} skipped, mean RGB {mean[0]:.1f} {mean[1]:.1f} {mean[2]:.1f}")

if __name__ == "__main__":
    binio.run_script(main)
