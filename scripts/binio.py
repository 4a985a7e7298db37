"""The one reader and writer of the project's binary files (datasets, checkpoints, debug states, fixtures), and the
one way every script opens a file: a regular file or a clear error (PathError), never a traceback, never a hang.

Layout (data/README.md documents every format field by field):
  bytes [0, 1024)     header: 256 little-endian int32: [0] magic, [1] version, [2] tensor count T,
                      [3..] the format's config fields (int32, or float32 bit patterns), the rest zero
  next 128*T bytes    tensor table: char name[96] (NUL-padded ASCII), int32 dtype (0 f32, 1 i32, 2 u8),
                      int32 ndim (0..4), int32 shape[4] (unused dims 0), int32 reserved[2] (0)
  then                each tensor's data in table order, C order, little-endian, no padding
The file length must equal 1024 + 128*T + the tensors' bytes. Only NumPy is needed.

Files in and out (every script uses these):
  open_input(path)      a regular file opened for reading (a directory, device, FIFO or socket is refused before
                        it is read, so /dev/zero or a FIFO never hangs); read_text(path) its UTF-8 text
  check_output(path)    at start-up, before any long work: the folder exists and takes a new file; an existing path
                        is a regular file, or a symlink to one (written through: its target is replaced, the link kept)
  write_file(path, b)   bytes through a temporary file in the same folder, fsync, rename, fsync of the folder; the
                        temporary file never stays behind; -> the path written (a symlink's target)
And the scripts' command line: ArgumentParser (a bad flag is one `error:` line and exit 1, as in the trainers) and
run_script(main) (a full or closed stdout is one error line, not a traceback).
"""
import argparse
import math
import os
import stat
import sys
import tempfile
from collections import OrderedDict

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
ENTRY_BYTES = 128
NAME_BYTES = 96
MAX_NDIM = 4
FIRST_FIELD = 3  # header slot of the first config field
DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<i4"), 2: np.dtype("u1")}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
DTYPE_NAMES = {0: "float32", 1: "int32", 2: "uint8"}
_UMASK = os.umask(0)  # read once, at import (single-threaded): a new file gets 0666 & ~umask, as open() gives it
os.umask(_UMASK)


class FormatError(ValueError):
    """A file that does not match its format; the message names the file and the field."""


class PathError(FormatError):
    """A path that cannot be read or written as asked: missing, a directory, a device, no permission, a full disk."""


class Format:
    """A file kind: magic, version, and the config fields stored in header slots 3, 4, ... in order.
    fields: list of (name, "i" | "f"). defaults: values of fields added after files of the format existed, 0 (what
    those files hold in the slot) meaning the old behaviour; a writer may leave them out."""

    def __init__(self, name, magic, version, fields, defaults=None):
        assert FIRST_FIELD + len(fields) <= HEADER_INTS, name
        self.name, self.magic, self.version, self.fields = name, magic, version, list(fields)
        self.defaults = dict(defaults or {})
        assert all(n in dict(self.fields) and v == 0 for n, v in self.defaults.items()), name


def _kind(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path, mode, doing):
    if stat.S_ISDIR(mode):
        return PathError(f"{path}: is a directory, not a regular file ({doing})")
    return PathError(f"{path}: is {_kind(mode)}, not a regular file ({doing})")


def open_input(path, what="file"):
    """Opens path for reading -> (binary file object, size in bytes). Raises PathError naming the path when it is
    missing, unreadable, or not a regular file (refused from its stat, before any read: no hang on a FIFO)."""
    path = str(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise PathError(f"{path}: cannot open {what} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode, f"expected a {what}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise PathError(f"{path}: cannot open {what} ({e.strerror})") from None
    st = os.fstat(fd)  # what was opened, in case the path changed in between
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, st.st_mode, f"expected a {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), st.st_size


def read_bytes(path, what="file", max_bytes=1 << 30):
    """The whole content of a regular file of at most max_bytes. Raises PathError."""
    f, size = open_input(path, what)
    with f:
        if size > max_bytes:
            raise PathError(f"{path}: {what} is {size} bytes, more than the {max_bytes} this reads")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise PathError(f"{path}: cannot read {what} ({e.strerror})") from None
    if len(data) > max_bytes:
        raise PathError(f"{path}: {what} grew past {max_bytes} bytes while it was read")
    return data


def read_text(path, what="text file", max_bytes=1 << 30):
    """The UTF-8 text of a regular file. Raises PathError, or FormatError naming the line of a byte that is not
    UTF-8 or of a NUL byte (not a text file)."""
    data = read_bytes(path, what, max_bytes)
    nul = data.find(b"\0")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise FormatError(f"{path}: line {line} holds a NUL byte: not a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise FormatError(f"{path}: line {line} is not UTF-8 (byte 0x{data[e.start]:02x}); save the file as UTF-8")\
            from None


def same_file(a, b):
    """True when paths a and b name one file (after symlinks), existing or not."""
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_output(path, what="output", inputs=()):
    """Checks that path can be written, before any long work: -> the path that will be written (a symlink's
    target). Raises PathError when the folder is missing or takes no new file, the path is one of inputs (the run
    would replace what it reads), or the path (or what a symlink names) exists and is not a regular file: a
    directory, a device or a FIFO is never replaced."""
    path = str(path)
    for source in inputs:
        if source and same_file(path, source):
            raise PathError(f"{path}: {what} is the same file as the input {source}: refusing to replace it")
    real = os.path.realpath(path) if os.path.islink(path) else path
    folder = os.path.dirname(os.path.abspath(real))
    if not os.path.isdir(folder):
        raise PathError(f"{path}: {what}: folder {folder} does not exist")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise PathError(f"{path}: {what}: cannot check it ({e.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode, f"{what}: refusing to replace it")
    try:  # the folder takes a new file (permissions, a read-only file system): the same test as the real write
        fd, probe = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(real) + ".", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PathError(f"{path}: {what}: cannot write in folder {folder} ({e.strerror})") from None
    return real


def written_note(path, real):
    """' (a symlink: written through to TARGET)' when path was a symlink, else ''."""
    return f" (a symlink: written through to {real})" if real != str(path) else ""


def write_file(path, data, what="output"):
    """Writes data (bytes, or a list of bytes objects) to path atomically: a temporary file in the same folder,
    fsync, rename over the path, fsync of the folder. A symlink is written through. On any failure (a full disk)
    the temporary file is removed and the old file kept. -> the path written. Raises PathError."""
    real = check_output(path, what)
    folder = os.path.dirname(os.path.abspath(real))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(real) + ".", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)
            with os.fdopen(fd, "wb") as f:
                fd = -1
                for chunk in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, real)
        finally:
            if fd >= 0:
                os.close(fd)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise PathError(f"{path}: cannot write {what} ({e.strerror})") from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # some file systems cannot fsync a folder; the file itself is synced
    return real


class ArgumentParser(argparse.ArgumentParser):
    """argparse in the trainers' dialect: a bad or missing flag is `error: <what> (see --help)` and exit 1 (argparse
    itself prints its usage block and exits 2)."""

    def error(self, message):
        sys.stderr.write(f"error: {message} (see --help)\n")
        sys.exit(1)


class _StdoutError(Exception):
    """A write to stdout failed: the script's report is lost, its work is not."""


class _GuardedStream:
    """sys.stdout whose write or flush failures are _StdoutError, told apart from the script's own OSErrors."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _StdoutError(e.strerror) from None

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as e:
            raise _StdoutError(e.strerror) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def run_script(main):
    """Runs a script's main(). Its report on a stdout that cannot take it (a full device, a closed pipe) is one
    error line and exit 1, not a traceback; characters the stdout encoding lacks are escaped, not fatal."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    if sys.stdout is not None:
        sys.stdout = _GuardedStream(sys.stdout)
    try:
        code = main()
        if sys.stdout is not None:
            sys.stdout.flush()
    except _StdoutError as e:
        sys.stderr.write(f"error: cannot write the report to stdout ({e})\n")
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: the interpreter's last flush of the same stdout would fail again
    sys.exit(code)


def magic_number(model, kind):
    """20260000 + 100*model + kind; model 1 linreg, 2 mnist, 3 unet, 4 matmul, 5 softmax;
    kind 1 dataset, 2 checkpoint, 3 debug state, 4 fixture."""
    return 20260000 + 100 * model + kind


def write(path, fmt, config, tensors):
    """Writes config (dict name -> value for every field of fmt) and tensors (dict name -> array) to path through
    write_file (a temporary file and a rename: a crash never leaves a torn file). -> the path written (a symlink's
    target). Raises FormatError (a bad config or tensor) or PathError (the path)."""
    return write_file(path, encode(fmt, config, tensors), fmt.name)


def encode(fmt, config, tensors):
    """The bytes write() writes, as a list of chunks (header, tensor table, each tensor's data). A float field's
    value may be a np.float32, whose bits are then kept exactly (a NaN's payload too). Raises FormatError."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = fmt.magic, fmt.version, len(tensors)
    config = dict(fmt.defaults, **config)
    missing = [n for n, _ in fmt.fields if n not in config]
    extra = [n for n in config if n not in dict(fmt.fields)]
    if missing or extra:
        raise FormatError(f"{fmt.name}: config missing {missing}, unknown {extra}")
    for slot, (name, kind) in enumerate(fmt.fields, start=FIRST_FIELD):
        if kind == "f":
            header[slot] = np.array([config[name]], dtype="<f4").view("<i4")[0]
        else:
            value = int(config[name])
            if value != config[name] or not -2**31 <= value < 2**31:
                raise FormatError(f"{fmt.name}: field {name} must be an int32, got {config[name]!r}")
            header[slot] = value
    table = bytearray()
    blobs = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes 0-d arrays 1-d
        dtype = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
        if dtype not in DTYPE_CODES:
            raise FormatError(f"{fmt.name}: tensor {name} has dtype {array.dtype}, expected float32, int32 or uint8")
        encoded = name.encode("ascii")
        if len(encoded) >= NAME_BYTES:
            raise FormatError(f"{fmt.name}: tensor name {name!r} is longer than {NAME_BYTES - 1} bytes")
        if array.ndim > MAX_NDIM:
            raise FormatError(f"{fmt.name}: tensor {name} has {array.ndim} dims, at most {MAX_NDIM}")
        entry = np.zeros(ENTRY_BYTES // 4, dtype="<i4")
        shape = list(array.shape) + [0] * (MAX_NDIM - array.ndim)
        entry[NAME_BYTES // 4:] = [DTYPE_CODES[dtype], array.ndim] + shape + [0, 0]
        raw = bytearray(entry.tobytes())
        raw[:len(encoded)] = encoded
        table += raw
        blobs.append(array.astype(dtype, copy=False).tobytes())
    return [header.tobytes(), bytes(table)] + blobs


def _printable(raw):
    """A tensor name from the table, shown safely whatever its bytes (a corrupt table holds anything)."""
    return "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" for c in raw.decode("latin-1"))


def read(path, fmt):
    """Returns (header int32 array, config dict, OrderedDict of tensors), after checking magic, version,
    the tensor table and the file length. Raises FormatError naming the file and the wrong field (PathError for
    a path that is not a readable regular file)."""
    path = str(path)
    f, size = open_input(path, fmt.name)
    with f:
        if size < HEADER_BYTES:
            raise FormatError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4").copy()
        if header.size != HEADER_INTS:
            raise FormatError(f"{path}: the file ends inside the header (it changed while it was read)")
        if header[0] != fmt.magic:
            raise FormatError(f"{path}: header[0] magic is {header[0]}, expected {fmt.magic} ({fmt.name})")
        if header[1] != fmt.version:
            raise FormatError(f"{path}: header[1] version is {header[1]}, expected {fmt.version} ({fmt.name})")
        count = int(header[2])
        if count < 0 or HEADER_BYTES + ENTRY_BYTES * count > size:
            raise FormatError(f"{path}: header[2] tensor count {count} does not fit a file of {size} bytes")
        table = f.read(ENTRY_BYTES * count)
        if len(table) != ENTRY_BYTES * count:
            raise FormatError(f"{path}: the file ends inside the tensor table (it changed while it was read)")
        entries = []
        total = HEADER_BYTES + ENTRY_BYTES * count
        for i in range(count):
            raw = table[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES]
            name = _printable(raw[:NAME_BYTES].split(b"\0", 1)[0])
            meta = np.frombuffer(raw[NAME_BYTES:], dtype="<i4")
            code, ndim = int(meta[0]), int(meta[1])
            if code not in DTYPES:
                raise FormatError(f"{path}: tensor {i} ({name}) has dtype code {code}, expected 0, 1 or 2")
            if not 0 <= ndim <= MAX_NDIM:
                raise FormatError(f"{path}: tensor {i} ({name}) has ndim {ndim}, expected 0..{MAX_NDIM}")
            shape = tuple(int(s) for s in meta[2:2 + ndim])
            if any(s < 0 for s in shape):
                raise FormatError(f"{path}: tensor {i} ({name}) has negative shape {shape}")
            nbytes = math.prod(shape) * DTYPES[code].itemsize  # Python ints: no int64 overflow
            if total + nbytes > size:
                raise FormatError(f"{path}: file length is {size} bytes, the header and tensor table say more "
                                  f"(tensor {i}, {name}, of shape {shape}, runs past the end)")
            if any(e[0] == name for e in entries):
                raise FormatError(f"{path}: tensor {i} is named {name}, as an earlier one: a name appears twice")
            entries.append((name, DTYPES[code], shape, nbytes))
            total += nbytes
        if total != size:
            raise FormatError(f"{path}: file length is {size} bytes, the header and tensor table say {total}")
        tensors = OrderedDict()
        for name, dtype, shape, nbytes in entries:
            data = f.read(nbytes)
            if len(data) != nbytes:
                raise FormatError(f"{path}: the file ends inside tensor {name} (it changed while it was read)")
            tensors[name] = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    config = {}
    for slot, (name, kind) in enumerate(fmt.fields, start=FIRST_FIELD):
        config[name] = float(header[slot:slot + 1].view("<f4")[0]) if kind == "f" else int(header[slot])
    return header, config, tensors


def expect(path, tensors, name, shape=None, dtype=None):
    """Returns tensors[name] after checking its shape and dtype, else raises FormatError naming them."""
    if name not in tensors:
        raise FormatError(f"{path}: tensor {name} is missing")
    t = tensors[name]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise FormatError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != np.dtype(dtype):
        raise FormatError(f"{path}: tensor {name} has dtype {t.dtype}, expected {np.dtype(dtype)}")
    return t


# ---------------------------------------------------------------------------------------------------------------
# linreg formats (owner: lead)
# ---------------------------------------------------------------------------------------------------------------
# tensors: x float32 (N, D), y float32 (N,); the first n_train rows are the training split.
LINREG_DATASET = Format("linreg dataset", magic_number(1, 1), 1, [
    ("n_points", "i"), ("n_features", "i"), ("n_train", "i"), ("seed", "i"),
    ("w_true", "f"), ("b_true", "f"), ("noise_std", "f"), ("x_min", "f"), ("x_max", "f"),
])

# ---------------------------------------------------------------------------------------------------------------
# mnist formats (owner: mnist helper)
# ---------------------------------------------------------------------------------------------------------------
# Parameters by PyTorch state_dict name in PyTorch layout: conv1.weight (32,1,3,3), conv1.bias (32,),
# conv2.weight (64,32,3,3), conv2.bias (64,), fc1.weight (128,9216), fc1.bias (128,), fc2.weight (10,128), fc2.bias (10,).
MNIST_PARAM_SHAPES = [
    ("conv1.weight", (32, 1, 3, 3)), ("conv1.bias", (32,)), ("conv2.weight", (64, 32, 3, 3)), ("conv2.bias", (64,)),
    ("fc1.weight", (128, 9216)), ("fc1.bias", (128,)), ("fc2.weight", (10, 128)), ("fc2.bias", (10,)),
]
# Written by ./train_mnist --checkpoint FILE. tensors: every parameter; when has_optimizer: optimizer 0 (SGD, and
# 3 Shampoo or 4 K-FAC with graft 0) momentum_buffer.<name>; 1 (AdamW, and Shampoo or K-FAC with graft 1)
# adam_m.<name> and adam_v.<name>; 2 (Muon) muon_m.<name> and adam_v.<name>; Shampoo also
# shampoo_{L,R,Linv,Rinv}.<weight>.<r0>.<c0> and shampoo_has_root; K-FAC kfac_{G,Ginv}.<weight>.<r0>,
# kfac_{A,Ainv}.<weight>.<c0> and kfac_has_inv; precond 1 (fisher_diag) also fisher_diag.<name>; with precond_delay
# > 0 and roots in flight, pending.<root>, pending.root_ok and pending.switch_in (data/README.md).
# epoch = epochs completed; version 2 added every setting the trajectory depends on (lr_schedule 0 constant,
# 1 cosine, 2 linear .. train_images), version 3 Muon's and Shampoo's, then the per-sample step's clip_per_sample ..
# fisher_power, K-FAC's kfac_stat_decay and Shampoo's and K-FAC's precond_delay (0 when unused, so older version 3
# files still read).
MNIST_CHECKPOINT = Format("mnist checkpoint", magic_number(2, 2), 3, [
    ("epoch", "i"), ("step", "i"), ("batch_size", "i"), ("seed", "i"), ("optimizer", "i"), ("has_optimizer", "i"),
    ("epochs", "i"), ("lr", "f"), ("test_accuracy", "f"), ("lr_schedule", "i"), ("warmup_steps", "i"),
    ("lr_min", "f"), ("momentum", "f"), ("weight_decay", "f"), ("beta1", "f"), ("beta2", "f"), ("eps", "f"),
    ("train_images", "i"), ("muon_lr", "f"), ("muon_momentum", "f"), ("muon_nesterov", "i"), ("ns_steps", "i"),
    ("graft", "i"), ("precond_every", "i"), ("precond_start", "i"), ("max_precond_dim", "i"), ("precond_eps", "f"),
    ("precond_damping", "f"), ("clip_per_sample", "f"), ("noise_multiplier", "f"), ("precond", "i"),
    ("fisher_power", "f"), ("kfac_stat_decay", "f"), ("precond_delay", "i"),
])
# Written by dev/mnist.py on the GPU machine. tensors: every parameter (initial weights); x float32 (B,1,28,28)
# normalized; y int32 (B,); out float32 (B,10) logits; loss float32 () mean NLL; grad.<name> for every parameter;
# sgd_losses float32 (S,), adamw_losses float32 (S,): the loss before each of S steps on the same batch from the
# initial weights (SGD lr/momentum/weight_decay; AdamW adam_lr/beta1/beta2/eps/adam_weight_decay).
MNIST_DEBUG_FIELDS = [
    ("batch_size", "i"), ("n_steps", "i"), ("lr", "f"), ("momentum", "f"), ("weight_decay", "f"),
    ("adam_lr", "f"), ("beta1", "f"), ("beta2", "f"), ("eps", "f"), ("adam_weight_decay", "f"),
]
MNIST_DEBUG_STATE = Format("mnist debug state", magic_number(2, 3), 1, MNIST_DEBUG_FIELDS)
# The small CI fixture (dev/fixtures/mnist_fixture.bin, < 2 MB): as the debug state, but the weights are not stored:
# they come from dev/mnist.py's hash_init(init_seed) (integer hash, bit-exact in C and NumPy); and of fc1.weight's
# gradient only the first 4 rows: grad.fc1.weight.rows (4, 9216).
MNIST_FIXTURE = Format("mnist fixture", magic_number(2, 4), 1, MNIST_DEBUG_FIELDS + [("init_seed", "i")])
# Written by dev/mnist_optimizers.py (dev/fixtures/mnist_optimizers_fixture.bin, committed): the Muon and Shampoo
# references. tensors: x (B,1,28,28), y int32 (B,); for each run muon, shampoo_sgd, shampoo_adam, kfac_sgd,
# kfac_adam, shampoo_sgd_delay1, kfac_sgd_delay1 (precond_delay 1): <run>_losses (S,)
# and the final parameters <run>.<name> (fc1.weight: its first 4 rows, <run>.fc1.weight.rows (4, 9216));
# muon_bf16_losses (S,) (torch.optim.Muon unmodified).
MNIST_OPT_FIXTURE = Format("mnist optimizer fixture", magic_number(2, 5), 2, [
    ("batch_size", "i"), ("n_steps", "i"), ("init_seed", "i"), ("lr", "f"), ("momentum", "f"), ("weight_decay", "f"),
    ("adam_lr", "f"), ("beta1", "f"), ("beta2", "f"), ("eps", "f"), ("adam_weight_decay", "f"), ("muon_lr", "f"),
    ("muon_momentum", "f"), ("muon_nesterov", "i"), ("ns_steps", "i"), ("precond_every", "i"),
    ("precond_start", "i"), ("max_precond_dim", "i"), ("precond_eps", "f"), ("precond_damping", "f"),
    ("kfac_stat_decay", "f"), ("kfac_damping", "f"),
])


# Written by dev/mnist_optimizers.py --per_sample_out (dev/fixtures/mnist_per_sample_fixture.bin, committed): the
# per-sample gradient references (torch.func.vmap(grad)). tensors: x, y as above; norms (B, 8) each sample's gradient
# norm per parameter tensor, total (B) the whole model's; clip_grad.<name> the clipped mean gradient (fc1.weight: its
# first 4 rows, .rows); for each run clip (SGD on the clipped gradient) and fisher (SGD on the Fisher-preconditioned
# gradient): <run>_losses (S,) and the final parameters <run>.<name> (fc1.weight: .rows).
MNIST_PER_SAMPLE_FIXTURE = Format("mnist per-sample fixture", magic_number(2, 7), 1, [
    ("batch_size", "i"), ("n_steps", "i"), ("init_seed", "i"), ("lr", "f"), ("momentum", "f"), ("weight_decay", "f"),
    ("clip", "f"), ("fisher_lr", "f"), ("beta2", "f"), ("precond_eps", "f"), ("precond_damping", "f"),
    ("fisher_power", "f"),
])


# ---------------------------------------------------------------------------------------------------------------
# unet formats (owner: unet helpers)
# ---------------------------------------------------------------------------------------------------------------
# The model's shape, shared by checkpoints and debug states. attn_ds_mask: bit k set = attention at
# downsample factor 2**k (image 64 with attention at 16 and 8 -> ds 4 and 8 -> mask 0b1100 = 12).
UNET_MODEL_FIELDS = [
    ("image_size", "i"), ("in_channels", "i"), ("model_channels", "i"), ("out_channels", "i"),
    ("num_res_blocks", "i"), ("n_levels", "i"), ("mult0", "i"), ("mult1", "i"), ("mult2", "i"), ("mult3", "i"),
    ("attn_ds_mask", "i"), ("num_head_channels", "i"), ("diffusion_steps", "i"),
    ("beta_start", "f"), ("beta_end", "f"),
]
# tensors: images uint8 (N, H, W, 3), RGB, NHWC; the loader normalises to [-1, 1].
UNET_DATASET = Format("unet dataset", magic_number(3, 1), 1, [
    ("n_images", "i"), ("height", "i"), ("width", "i"), ("channels", "i"),
])
# The optimizer of a unet checkpoint or debug state: optimizer 0 AdamW, 1 Muon (train_unet --optimizer muon: the conv
# and linear weights, AdamW the rest) with its settings; files written before these fields hold 0 there (AdamW).
UNET_OPTIMIZER_FIELDS = [("optimizer", "i"), ("muon_lr", "f"), ("muon_momentum", "f"), ("muon_nesterov", "i"),
                         ("ns_steps", "i")]
UNET_OPTIMIZER_DEFAULTS = {name: 0 for name, _ in UNET_OPTIMIZER_FIELDS}
UNET_OPTIMIZERS = ["adamw", "muon"]
# tensors: every parameter by its dev/unet.py state_dict name, in PyTorch layout (conv weight (Cout, Cin, kh, kw));
# when has_ema: ema.<name>; when has_optimizer: adam_m.<name> (optimizer 1: muon_m.<name>, Muon's momentum buffer of
# the weights and AdamW's first moment of the rest), adam_v.<name> (0 for Muon's weights); rng_state int32
# (trainer-defined).
UNET_CHECKPOINT = Format("unet checkpoint", magic_number(3, 2), 1, UNET_MODEL_FIELDS + [
    ("step", "i"), ("batch_size", "i"), ("seed", "i"), ("lr", "f"), ("ema_rate", "f"),
    ("has_ema", "i"), ("has_optimizer", "i"),
] + UNET_OPTIMIZER_FIELDS, UNET_OPTIMIZER_DEFAULTS)
# Written by dev/unet.py. tensors: every parameter (initial weights) by name; x0 float32 (B, 3, H, W) in [-1, 1]
# (NCHW, as PyTorch); t int32 (B,); noise float32 (B, 3, H, W); x_t float32 (B, 3, H, W) (the noised input);
# out float32 (B, 3, H, W) (the model's epsilon prediction on x_t); loss float32 (); grad.<name> for every parameter;
# then n_steps AdamW steps on the same x0: step_t int32 (S, B), step_noise float32 (S*B, 3, H, W) (row i*B + b is
# step i's sample b: 5 dims do not fit the table), step_losses float32 (S,) (loss of step i before its update).
# Written since the optimizer fields: final.<name> (the parameters after the n_steps steps) and fixed_grad.<name>
# (the initial parameters after n_fixed steps that each take grad.* as the gradient).
UNET_DEBUG_STATE = Format("unet debug state", magic_number(3, 3), 1, UNET_MODEL_FIELDS + [
    ("batch_size", "i"), ("n_steps", "i"), ("lr", "f"), ("beta1", "f"), ("beta2", "f"), ("eps", "f"),
    ("weight_decay", "f"),
] + UNET_OPTIMIZER_FIELDS + [("n_fixed", "i")], dict(UNET_OPTIMIZER_DEFAULTS, n_fixed=0))
# Written by dev/unet.py --forward_fixture (a CI fixture for the NumPy forward of scripts/generate.py): every
# parameter by name; x_t float32 (B, 3, H, W); t int32 (B,); out float32 (B, 3, H, W) = model(x_t, t).
UNET_FIXTURE = Format("unet forward fixture", magic_number(3, 4), 1, UNET_MODEL_FIELDS + [("batch_size", "i")])
# Written by dev/unet_layers.py (per-layer CI fixtures dev/fixtures/unet_layer_<name>.bin for dev/<layer>.cu): the
# same magic and version as the forward fixture, told apart by slot 3: layer = 1001..1012 (dev/unet_layers.py's
# LAYER_CODES; never a plausible image_size), seed, aux (attention: num_head_channels, else 0). Tensors in PyTorch
# layouts: inputs (x; concat a, b; timestep_embedding t int32 and emb), parameters by module name, y, dy (random
# upstream gradient), d<input> and grad.<param> = gradients of sum(y * dy); mse: out, target, loss (), dout.
UNET_LAYER_FIXTURE = Format("unet layer fixture", magic_number(3, 4), 1, [("layer", "i"), ("seed", "i"), ("aux", "i")])

# ---------------------------------------------------------------------------------------------------------------
# matmul / softmax fixture formats (owners: mnist helper / softmax helper)
# ---------------------------------------------------------------------------------------------------------------
# softmax (owner: softmax helper). Written by dev/softmax.py --make_fixture on the GPU machine (torch fp32, TF32 off).
# Slots 3 n_cases, 4 seed. Tensors, for k in 0..n_cases-1, all float32 (rows_k, cols_k): case<k>.x (logits, may hold
# -inf; an all -inf row gives a NaN row), case<k>.y = torch.softmax(x, -1), case<k>.dy (randn),
# case<k>.dx = torch._softmax_backward_data(dy, y, -1, float32).
SOFTMAX_FIXTURE = Format("softmax fixture", magic_number(5, 4), 1, [("n_cases", "i"), ("seed", "i")])
