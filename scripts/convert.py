"""Moves the trainers' weights to and from PyTorch: a train_unet or train_mnist checkpoint (.bin), or a
train_linreg result file (.json, its only weights file), to and from a PyTorch file (.pt) or safetensors.

  python3 scripts/convert.py --input out/unet/model.bin --output model.safetensors      # to PyTorch
  python3 scripts/convert.py --input model.safetensors --output model.bin               # and back
  python3 scripts/convert.py --input mnist.bin --output mnist.pt --weights raw          # the weights only

The input's kind comes from its bytes, the output's from its extension (.bin, .json, .pt or .pth, .safetensors).
Names and layouts are those of the dev/ references: dev/unet.py's, dev/mnist.py's and dev/linreg.py's
state_dict names, PyTorch layouts (a conv weight (Cout, Cin, kh, kw), a linear weight (out, in)), which the
checkpoints already hold (the trainers relayout on save and load). Nothing is recomputed: every tensor is copied
bit for bit, and every header field travels as a string in the metadata, so a conversion there and back gives a
file byte-identical to the original.

safetensors (written and read here with NumPy only): an 8-byte little-endian header length N, N bytes of JSON
{"__metadata__": {str: str}, name: {"dtype": "F32" | "I32" | "U8", "shape": [...], "data_offsets": [begin, end]}}
(offsets into the data that follows; they tile it without a hole), the header padded with spaces to a multiple
of 8 bytes, then the tensors, little-endian, C order. Every tensor of the checkpoint is in it by its own name:
the parameters under their state_dict names, ema.<name>, adam_m.<name>, adam_v.<name>,
momentum_buffer.<name>, rng_state. With --weights raw or ema it holds the model's parameters only (the raw
or the EMA weights under the state_dict names), so that `model.load_state_dict(safetensors.torch.load_file(F))`
takes it with strict=True.
.pt (torch.save; needs PyTorch, read with weights_only=True): {"state_dict": the parameters (strict=True ready),
"extra": every other tensor by name (empty with --weights raw or ema), "metadata": the same str -> str dict}.
Metadata: kind (the format's name), magic, version, every header field (an f32 field as its shortest exact
decimal, or as 0x + its bit pattern where no decimal keeps the bits), tensor_order (JSON list: the tensors'
order in the original file); a train_linreg result keeps its whole JSON text in result_json.

Every input is a regular file read after its sizes are checked; every output is written through a temporary
file, fsync and rename (never replacing a directory, device or FIFO); a bad input is one `error:` line naming the
file and the field, exit 1.
"""
import argparse
import io
import json
import math
import os
import re
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import binio  # noqa: E402
from generate import ModelConfig  # noqa: E402

MAX_INPUT_BYTES = 1 << 36  # 64 GiB: far past any model here; the size is checked before anything is allocated
MAX_JSON_BYTES = 1 << 30  # a result file of 100 million epochs' losses is about 1.6 GB: train_linreg's limit
MAX_ST_HEADER = 100 << 20  # safetensors header cap, the reference implementation's
ST_DTYPES = {"F32": np.dtype("<f4"), "I32": np.dtype("<i4"), "U8": np.dtype("u1")}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
CHECKPOINTS = {f.magic: f for f in (binio.UNET_CHECKPOINT, binio.MNIST_CHECKPOINT)}
LINREG_KIND = "train_linreg result"
OUTPUT_KINDS = {".bin": "bin", ".json": "json", ".pt": "pt", ".pth": "pt", ".safetensors": "safetensors"}
Error = binio.FormatError


class Checkpoint:
    """A trainer's weights in one form for every file kind: kind (a format name or LINREG_KIND), meta (str -> str),
    tensors (name -> array, in file order) and params (the model's state_dict names, in order)."""

    def __init__(self, kind, meta, tensors, params):
        self.kind, self.meta, self.tensors, self.params = kind, meta, tensors, params


# ---------------------------------------------------------------------------------------------------------------
# what each trainer's file holds


def expected_tensors(fmt, cfg, path):
    """-> (dict name -> (shape, dtype) in the trainer's write order, parameter names) for a checkpoint's header
    fields. Raises Error naming a header field out of range."""
    def flag(field, hi=1):
        if not 0 <= cfg[field] <= hi:
            raise Error(f"{path}: header field {field} is {cfg[field]}, expected 0..{hi}")
        return cfg[field]

    if fmt is binio.UNET_CHECKPOINT:
        shapes = ModelConfig(cfg, path).param_shapes()  # dev/unet.py's state_dict, in its order
        moments = ["muon_m." if flag("optimizer") == 1 else "adam_m.", "adam_v."]  # 1: Muon
        prefixes = [""] + ["ema."] * flag("has_ema") + moments * flag("has_optimizer")
    else:
        shapes = dict(binio.MNIST_PARAM_SHAPES)
        optimizer = flag("optimizer")
        moments = ["momentum_buffer."] if optimizer == 0 else ["adam_m.", "adam_v."]
        prefixes = [""] + moments * flag("has_optimizer")
    want = {p + n: (tuple(s), np.dtype("<f4")) for p in prefixes for n, s in shapes.items()}
    if fmt is binio.UNET_CHECKPOINT and cfg["has_optimizer"]:
        want["rng_state"] = ((4,), np.dtype("<i4"))  # (seed, step, adam_t, 0): train_unet's whole RNG state
    return want, list(shapes)


def check_tensors(path, what, tensors, want):
    for name, (shape, dtype) in want.items():
        if name not in tensors:
            raise Error(f"{path}: tensor {name} is missing ({what})")
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise Error(f"{path}: tensor {name} is {ST_NAMES.get(t.dtype, t.dtype)} {tuple(t.shape)}, expected "
                        f"{ST_NAMES[dtype]} {shape}")
    for name in tensors:
        if name not in want:
            raise Error(f"{path}: tensor {name} is not one of a {what}'s")


def describe(fmt, cfg):
    unet = fmt is binio.UNET_CHECKPOINT
    flags = ["has_ema", "has_optimizer", "optimizer"] if unet else ["optimizer", "has_optimizer"]
    return f"{fmt.name} with " + ", ".join(f"{f} {cfg[f]}" for f in flags)


def float_text(value):
    """An f32 header field as text that gives back its bits: the shortest decimal, else 0x + the bit pattern."""
    text = str(np.float32(value))
    bits = np.float32(value).view("<u4")
    return text if np.float32(text).view("<u4") == bits else f"0x{int(bits):08x}"


def header_meta(fmt, header):
    meta = {"kind": fmt.name, "magic": str(fmt.magic), "version": str(fmt.version)}
    for slot, (name, kind) in enumerate(fmt.fields, start=binio.FIRST_FIELD):
        value = header[slot:slot + 1].view("<f4")[0] if kind == "f" else int(header[slot])
        meta[name] = float_text(value) if kind == "f" else str(value)
    return meta


def meta_value(path, meta, key):
    if key not in meta:
        raise Error(f"{path}: metadata has no {key} (written by scripts/convert.py from a trainer's file)")
    return meta[key]


def meta_int(path, meta, key):
    text = meta_value(path, meta, key)
    if not re.fullmatch(r"-?[0-9]{1,10}", text) or not -2**31 <= int(text) < 2**31:
        raise Error(f"{path}: metadata {key} is {text!r}, expected an int32")
    return int(text)


def meta_float(path, meta, key):
    text = meta_value(path, meta, key)
    if re.fullmatch(r"0x[0-9a-f]{8}", text):
        return np.array([int(text, 16)], dtype="<u4").view("<f4")[0]
    try:
        if re.fullmatch(r"[-+0-9.eE]+|-?inf|nan", text):
            return np.float32(text)
    except ValueError:
        pass
    raise Error(f"{path}: metadata {key} is {text!r}, expected a float32 (a decimal or 0x + 8 hex digits)")


def meta_config(path, meta):
    """-> (format, header fields) from a metadata dict; float fields as np.float32 (their bits kept)."""
    kind = meta_value(path, meta, "kind")
    if kind == LINREG_KIND:
        return None, None
    magic = meta_int(path, meta, "magic")
    if magic not in CHECKPOINTS:
        known = ", ".join(f"{m} ({f.name})" for m, f in CHECKPOINTS.items())
        raise Error(f"{path}: metadata magic is {magic}, expected one of {known}")
    fmt = CHECKPOINTS[magic]
    version = meta_int(path, meta, "version")
    if version != fmt.version:
        raise Error(f"{path}: metadata version is {version}, expected {fmt.version} ({fmt.name})")
    cfg = {n: fmt.defaults[n] if n in fmt.defaults and n not in meta  # (converted before the field existed)
           else meta_float(path, meta, n) if k == "f" else meta_int(path, meta, n) for n, k in fmt.fields}
    return fmt, cfg


def tensor_order(path, meta, tensors, default):
    """The original file's tensor order from the metadata (the trainer's write order when it is absent)."""
    if "tensor_order" not in meta:
        return [n for n in default if n in tensors]
    try:
        order = json.loads(meta["tensor_order"])
    except ValueError:
        order = None
    if not isinstance(order, list) or sorted(map(str, order)) != sorted(tensors) or len(set(order)) != len(order):
        raise Error(f"{path}: metadata tensor_order does not list the file's {len(tensors)} tensors once each")
    return order


# ---------------------------------------------------------------------------------------------------------------
# the trainers' own files


def read_checkpoint_bin(path):
    data_f, size = binio.open_input(path, "checkpoint")
    with data_f:
        head = data_f.read(4)
    magic = struct.unpack("<i", head)[0] if len(head) == 4 else None
    if magic not in CHECKPOINTS:
        raise Error(f"{path}: header[0] magic is {magic}, expected " +
                    " or ".join(f"{m} ({f.name})" for m, f in CHECKPOINTS.items()))
    fmt = CHECKPOINTS[magic]
    header, _, tensors = binio.read(path, fmt)
    if int(header[2]) != len(tensors):
        raise Error(f"{path}: header[2] says {header[2]} tensors, the table names {len(tensors)} different ones "
                    f"(a name appears twice)")
    meta = header_meta(fmt, header)
    _, cfg = meta_config(path, meta)
    want, params = expected_tensors(fmt, cfg, path)
    check_tensors(path, describe(fmt, cfg), tensors, want)
    # Every byte must come back from what is kept: the unused header slots and the table's padding are zero.
    offset = 0
    with binio.open_input(path, "checkpoint")[0] as f:
        for chunk in binio.encode(fmt, cfg, tensors):
            got = f.read(len(chunk))
            if got != chunk:
                at = offset + next((i for i in range(min(len(got), len(chunk))) if got[i] != chunk[i]), len(got))
                where = (f"header slot {at // 4}" if at < binio.HEADER_BYTES else
                         f"tensor table entry {(at - binio.HEADER_BYTES) // binio.ENTRY_BYTES}")
                raise Error(f"{path}: byte {at} ({where}) is not what the format writes there (unused header slots, "
                            f"name padding and reserved words are 0): the file changed, or no trainer wrote it")
            offset += len(chunk)
    meta["tensor_order"] = json.dumps(list(tensors))
    return Checkpoint(fmt.name, meta, tensors, params)


def encode_checkpoint_bin(path, ck):
    if ck.kind == LINREG_KIND:
        raise Error(f"{path}: train_linreg writes no binary checkpoint; its weights go to a .json result file")
    fmt, cfg = meta_config(path, ck.meta)
    want, _ = expected_tensors(fmt, cfg, path)
    check_tensors(path, describe(fmt, cfg), ck.tensors, want)
    order = tensor_order(path, ck.meta, ck.tensors, want)
    return binio.encode(fmt, cfg, {n: ck.tensors[n] for n in order})


def read_linreg_json(path):
    text = binio.read_text(path, "train_linreg result file", MAX_JSON_BYTES)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise Error(f"{path}: not JSON ({e})") from None
    w, b = linreg_wb(path, obj)
    meta = {"kind": LINREG_KIND, "result_json": text, "tensor_order": json.dumps(["weight", "bias"])}
    tensors = {"weight": np.array([w], dtype="<f4"), "bias": np.array([b], dtype="<f4")}
    return Checkpoint(LINREG_KIND, meta, tensors, ["weight", "bias"])


def linreg_wb(path, obj):
    """w (list) and b of a train_linreg result (what dev/linreg.py's nn.Linear(D, 1) holds as weight and bias)."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(obj, dict):
        raise Error(f"{path}: expected a JSON object (./train_linreg --result_file), found {type(obj).__name__}")
    w, b, d = obj.get("w"), obj.get("b"), obj.get("n_features")
    if not isinstance(w, list) or not w or not all(number(v) for v in w):
        raise Error(f"{path}: field w is {str(w)[:40]}, expected a non-empty list of numbers")
    if not number(b):
        raise Error(f"{path}: field b is {str(b)[:40]}, expected a number")
    if d != len(w):
        raise Error(f"{path}: field n_features is {str(d)[:40]}, expected {len(w)} (the length of w)")
    return w, b


def linreg_check(path, meta, tensors):
    """-> (the stored result text, its w, its b) after checking the tensors against it: weight (1, D), bias (1,)."""
    text = meta_value(path, meta, "result_json")
    try:
        w, b = linreg_wb(path, json.loads(text))
    except ValueError as e:
        raise Error(f"{path}: metadata result_json is not JSON ({e})") from None
    want = {"weight": ((1, len(w)), np.dtype("<f4")), "bias": ((1,), np.dtype("<f4"))}
    check_tensors(path, f"{LINREG_KIND} with n_features {len(w)}", tensors, want)
    return text, w, b


def encode_linreg_json(path, ck):
    """The stored result file, with w and b rewritten (as %.9g, the trainer's format) only when they changed."""
    if ck.kind != LINREG_KIND:
        raise Error(f"{path}: a .json output holds a train_linreg result; a {ck.kind} goes to a .bin file")
    text, w, b = linreg_check(path, ck.meta, ck.tensors)
    weight, bias = ck.tensors["weight"], ck.tensors["bias"]
    if np.array_equal(np.array([w], "<f4").view("<u4"), weight.view("<u4")) and \
            np.array_equal(np.array([b], "<f4").view("<u4"), bias.view("<u4")):
        return [text.encode()]
    fmt = lambda v: "%.9g" % float(v)  # noqa: E731
    new, n_w = re.subn(r'^(  "w": \[)[^\n]*(\],)$', lambda m: m.group(1) + ", ".join(map(fmt, weight[0])) +
                       m.group(2), text, flags=re.M)
    new, n_b = re.subn(r'^(  "b": )[^\n]*(,)$', lambda m: m.group(1) + fmt(bias[0]) + m.group(2), new, flags=re.M)
    if n_w != 1 or n_b != 1:
        raise Error(f"{path}: metadata result_json lacks the trainer's one-line \"w\" and \"b\" entries, "
                    f"so the new weights have no place in it")
    return [new.encode()]


# ---------------------------------------------------------------------------------------------------------------
# safetensors


def encode_safetensors(ck):
    header = {"__metadata__": ck.meta}
    offset = 0
    for name, t in ck.tensors.items():
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned (8 + a multiple of 8)
    return [struct.pack("<Q", len(text)), text] + [t.tobytes() for t in ck.tensors.values()]


def unique_keys(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"key {k!r} appears twice")
        seen[k] = v
    return seen


def read_safetensors(path):
    """-> (metadata dict or None, dict name -> array in header order). Checks the header length against the file,
    the JSON, every entry's dtype, shape and offsets against each other and the data size before reading data."""
    f, size = binio.open_input(path, "safetensors file")
    with f:
        if size < 8:
            raise Error(f"{path}: file is {size} bytes, shorter than the 8-byte header length")
        n = struct.unpack("<Q", f.read(8))[0]
        if n > size - 8 or n > MAX_ST_HEADER:
            raise Error(f"{path}: header length is {n} bytes, more than the {min(size - 8, MAX_ST_HEADER)} "
                        f"{'the file holds' if n > size - 8 else 'a header may take'}")
        raw = f.read(n)
        if len(raw) != n:
            raise Error(f"{path}: the file ends inside the header (it changed while it was read)")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys) if raw[:1] == b"{" else None
        except ValueError as e:
            raise Error(f"{path}: the header is not JSON ({str(e)[:100]})") from None
        if not isinstance(header, dict):
            raise Error(f"{path}: the header is not a JSON object starting with '{{'")
        meta = header.pop("__metadata__", None)
        if meta is not None and (not isinstance(meta, dict) or
                                 not all(isinstance(v, str) for v in meta.values())):
            raise Error(f"{path}: __metadata__ is not an object of strings")
        entries = []
        for name, e in header.items():
            if not isinstance(e, dict) or sorted(e) != ["data_offsets", "dtype", "shape"]:
                raise Error(f"{path}: tensor {name}: expected dtype, shape and data_offsets, found {str(e)[:60]}")
            dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
            if dtype not in ST_DTYPES:
                raise Error(f"{path}: tensor {name} has dtype {str(dtype)[:20]}, expected F32, I32 or U8 (the "
                            f"trainers' types: convert other dtypes in PyTorch first)")
            ints = lambda v, k: isinstance(v, list) and len(v) <= k and all(  # noqa: E731
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
            if not ints(shape, 8):
                raise Error(f"{path}: tensor {name} has shape {str(shape)[:60]}, expected up to 8 sizes >= 0")
            if not ints(offs, 2) or len(offs) != 2:
                raise Error(f"{path}: tensor {name} has data_offsets {str(offs)[:60]}, expected [begin, end]")
            nbytes = math.prod(shape) * ST_DTYPES[dtype].itemsize
            if offs[1] - offs[0] != nbytes:
                raise Error(f"{path}: tensor {name}: data_offsets {offs} span {offs[1] - offs[0]} bytes, its dtype "
                            f"and shape {shape} take {nbytes}")
            entries.append((offs[0], offs[1], name, ST_DTYPES[dtype], tuple(shape)))
        data_size, end = size - 8 - n, 0
        for begin, stop, name, _, _ in sorted(entries):
            if begin != end:
                raise Error(f"{path}: tensor {name} starts at data offset {begin}, expected {end} (the tensors must "
                            f"tile the data without a hole or an overlap)")
            end = stop
        if end != data_size:
            raise Error(f"{path}: the tensors take {end} bytes of data, the file holds {data_size} after the header")
        arrays = {}
        for begin, stop, name, dtype, shape in sorted(entries):
            data = f.read(stop - begin)
            if len(data) != stop - begin:
                raise Error(f"{path}: the file ends inside tensor {name} (it changed while it was read)")
            arrays[name] = np.frombuffer(data, dtype=dtype).reshape(shape)
    return meta, {name: arrays[name] for _, _, name, _, _ in entries}


def from_tensor_file(path, meta, tensors):
    """A Checkpoint from what a .pt or safetensors file held, checked against the header its metadata keeps."""
    if meta is None:
        raise Error(f"{path}: holds no metadata: convert.py needs the header fields it keeps there (convert the "
                    f"trainer's own file, or save with metadata=...)")
    fmt, cfg = meta_config(path, meta)
    if fmt is None:
        linreg_check(path, meta, tensors)
        order = tensor_order(path, meta, tensors, ["weight", "bias"])
        return Checkpoint(LINREG_KIND, meta, {n: tensors[n] for n in order}, ["weight", "bias"])
    want, params = expected_tensors(fmt, cfg, path)
    check_tensors(path, describe(fmt, cfg), tensors, want)
    order = tensor_order(path, meta, tensors, want)
    return Checkpoint(fmt.name, meta, {n: tensors[n] for n in order}, params)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch files


def need_torch(path):
    try:
        import torch
    except ImportError:
        raise Error(f"{path}: a .pt file needs PyTorch (pip install torch); safetensors needs only NumPy") from None
    return torch


def encode_pt(path, ck):
    torch = need_torch(path)
    as_torch = lambda names: {n: torch.from_numpy(ck.tensors[n].copy()) for n in names}  # noqa: E731
    obj = {"state_dict": as_torch(ck.params), "extra": as_torch([n for n in ck.tensors if n not in ck.params]),
           "metadata": dict(ck.meta)}
    buf = io.BytesIO()
    torch.save(obj, buf)
    return [buf.getvalue()]


def read_pt(path):
    torch = need_torch(path)
    f, _ = binio.open_input(path, "PyTorch file")
    with f:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch.load raises many kinds; any of them is a bad file
            reason = (str(e).strip().splitlines() or [""])[0][:160]
            raise Error(f"{path}: torch.load cannot read it ({type(e).__name__}: {reason})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("state_dict"), dict):
        raise Error(f"{path}: expected a dict with state_dict, extra and metadata (as convert.py writes), found "
                    f"{type(obj).__name__}" + (f" with keys {list(obj)[:4]}" if isinstance(obj, dict) else ""))
    meta, extra = obj.get("metadata"), obj.get("extra", {})
    if not isinstance(extra, dict):
        raise Error(f"{path}: extra is {type(extra).__name__}, expected a dict of tensors")
    if meta is not None and (not isinstance(meta, dict) or
                             not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise Error(f"{path}: metadata is not a dict of strings")
    tensors = {}
    for part, d in (("state_dict", obj["state_dict"]), ("extra", extra)):
        for name, t in d.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise Error(f"{path}: {part} entry {str(name)[:60]} is {type(t).__name__}, expected a tensor")
            if name in tensors:
                raise Error(f"{path}: tensor {name} is in both state_dict and extra")
            dtypes = {torch.float32: "<f4", torch.int32: "<i4", torch.uint8: "u1"}
            if t.dtype not in dtypes or t.layout != torch.strided:
                raise Error(f"{path}: tensor {name} is {t.dtype} ({t.layout}), expected float32, int32 or uint8 "
                            f"(dense)")
            tensors[name] = np.ascontiguousarray(t.detach().cpu().numpy()).astype(dtypes[t.dtype], copy=False)
    return from_tensor_file(path, meta, tensors)


# ---------------------------------------------------------------------------------------------------------------
# conversion


def read_any(path):
    """A Checkpoint from any file kind, told apart by its first bytes."""
    f, size = binio.open_input(path, "input")
    with f:
        head = f.read(9)
    if len(head) >= 4 and struct.unpack("<i", head[:4])[0] in CHECKPOINTS:
        return read_checkpoint_bin(path)
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save's zip, or its legacy pickle
        return read_pt(path)
    # a safetensors header starts with '{' at byte 8; a JSON file starts with it at byte 0 (its length there
    # would be far past the file's end)
    if len(head) == 9 and head[8:9] == b"{" and (head[:1] != b"{" or struct.unpack("<Q", head[:8])[0] <= size):
        meta, tensors = read_safetensors(path)
        return from_tensor_file(path, meta, tensors)
    if head.lstrip()[:1] == b"{":
        return read_linreg_json(path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".safetensors":  # nothing told the kind: the extension gets the precise error
        read_safetensors(path)
    if ext in (".pt", ".pth"):
        read_pt(path)
    if len(head) < 4:
        raise Error(f"{path}: file is {len(head)} bytes: not a trainer checkpoint, a train_linreg result, a .pt or a "
                    f"safetensors file")
    magic = struct.unpack("<i", head[:4])[0]
    if 20260100 < magic < 20260600:
        raise Error(f"{path}: header[0] magic is {magic}, a project file that holds no trained model (convert.py "
                    f"takes train_unet and train_mnist checkpoints, magic 20260302 and 20260202)")
    raise Error(f"{path}: header[0] magic is {magic}, expected 20260302 (unet checkpoint) or 20260202 (mnist "
                f"checkpoint), and it is no train_linreg result, .pt or safetensors file either")


def select(path, ck, weights):
    """The parameters only (raw, or EMA under the parameters' names) for a file that loads with strict=True."""
    if weights == "all":
        return ck
    if weights == "ema":
        missing = [n for n in ck.params if "ema." + n not in ck.tensors]
        if missing:
            raise Error(f"{path}: --weights ema but the {ck.kind} holds no EMA weights (ema.{missing[0]} is missing)")
    tensors = {n: ck.tensors[("ema." if weights == "ema" else "") + n] for n in ck.params}
    meta = dict(ck.meta, tensor_order=json.dumps(ck.params))
    for field in ("has_ema", "has_optimizer"):
        if field in meta:
            meta[field] = "0"
    return Checkpoint(ck.kind, meta, tensors, ck.params)


def output_kind(path):
    ext = os.path.splitext(path)[1].lower()
    if ext not in OUTPUT_KINDS:
        raise Error(f"{path}: --output extension is {ext or 'missing'}, expected one of {', '.join(OUTPUT_KINDS)}")
    return OUTPUT_KINDS[ext]


def convert(input_path, output_path, weights="all"):
    """Converts input_path to output_path (kind from its extension). -> (Checkpoint written, path written)."""
    kind = output_kind(output_path)
    binio.check_output(output_path, "--output")
    if kind == "pt":
        need_torch(output_path)  # before the reading, not after it
    ck = select(input_path, read_any(input_path), weights)
    if kind == "bin":
        chunks = encode_checkpoint_bin(output_path, ck)
    elif kind == "json":
        chunks = encode_linreg_json(output_path, ck)
    elif kind == "pt":
        chunks = encode_pt(output_path, ck)
    else:
        chunks = encode_safetensors(ck)
    return ck, binio.write_file(output_path, chunks, "--output")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 1, as every other bad input
        sys.exit(f"error: {message} (see --help)")


def build_parser():
    p = Parser(description="\n\n".join(__doc__.split("\n\n")[:2]),
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="What each file holds: the header of scripts/convert.py; README.md, 'Weights to and from "
                      "PyTorch'.")
    p.add_argument("--input", required=True, metavar="FILE",
                   help="a train_unet or train_mnist checkpoint (.bin), a train_linreg --result_file (.json), or a "
                        ".pt or .safetensors file written by convert.py")
    p.add_argument("--output", required=True, metavar="FILE", help="the file to write; .bin, .json, .pt or .pth, "
                   ".safetensors (its kind comes from the extension)")
    p.add_argument("--weights", default="all", choices=["all", "raw", "ema"],
                   help="all: every tensor and field (a round trip gives the original bytes); raw or ema: the "
                        "model's parameters only (the EMA ones under the parameters' names) [all]")
    return p


def main():
    args = build_parser().parse_args()
    try:
        ck, written = convert(args.input, args.output, args.weights)
    except binio.FormatError as e:
        sys.exit(f"error: {e}")
    except MemoryError:
        sys.exit(f"error: {args.input}: not enough memory to convert it")
    n_values = sum(t.size for t in ck.tensors.values())
    print(f"wrote {args.output}{binio.written_note(args.output, written)}: {ck.kind}, {len(ck.tensors)} tensors "
          f"({n_values} values), {len(ck.params)} of them the model's parameters")


if __name__ == "__main__":
    main()
