/*
train_mnist.cu: a CNN trained on MNIST whose every matrix product (the convolutions as implicit GEMM, the fully
connected layers, forward and backward) runs on our own kernels; `--matmul cublas` switches all of them to cuBLAS
(explicit im2col + cublasSgemm) so both are timed on the same work. CPU fallback with the same network.
Two paths of ours:
  - the default fast path (GPU, --matmul ours, --tf32 1): conv2's forward, input and weight gradient on specialised
    TF32 tensor-core kernels (wgmma on sm_90a, mma.sync elsewhere; weights and input patch in shared memory,
    persistent bands), conv1 forward (direct fp32) made inside conv2's forward kernel, fc1 on specialised TF32 kernels
    (split-K forward with a cluster reduction; one backward kernel for its input and weight gradient), fc2 in a fused
    head (fc2 + log-softmax/NLL + fc2's input gradient); in a training step at batch <= 64 conv2's forward kernel also
    runs fc1's forward and the head, after grid barriers (the fused forward); max-pool (with window codes instead of
    act2 and dact2), its backward and conv1's weight gradient fused into neighbouring kernels; fc1.weight's SGD step
    in the input gradient's idle warp, the other parameters' step in the last gradient reduction; programmatic
    dependent launch between the 4 kernels of a step at batch 64 (dev/mnist_NOTES.md).
  - the generic path (--tf32 0, what the PyTorch fp32 tests compare): every product on the generic tiled kernel.

Network (the write-up's): conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max-pool 2, fc 9216->128, ReLU, fc 128->10,
log-softmax + NLL (fused). Reads the original MNIST IDX .gz files with zlib.

Build: make train_mnist      (nvcc -O3 -std=c++17 ... -lcublas -lz)
Run:   ./train_mnist --help

Layouts inside the trainer (PyTorch layouts in every file, converted on load/save):
  activations NHWC: act1 (B,26,26,32), act2 (B,24,24,64), pooled (B,12,12,64)
  conv2.weight (64,3,3,32) = [co][ky][kx][ci] so that a K-tile of the implicit GEMM reads contiguous channels;
  fc1.weight (128, 12*12*64) with input order (y,x,c), matching the NHWC pooled tensor.
*/
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <curand_kernel.h>
#include <zlib.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

// The file reads top to bottom in seven parts, each opened by a banner of '=':
//   1. utilities and formats                  2. the generic kernels (every product of the --tf32 0 path)
//   3. the fast path's interface to the model  4. the model: forward, loss, backward, update
//   5. the training loop and checkpoints       6. the fast path: conv2 on tensor cores, fc1, the head, fused
//   7. the command line (main; left out of TESTING builds)

// ================================================================================================================
// 1. UTILITIES AND FORMATS
//   error checks, the network's shape and parameter layouts, files in and out, the binary file format, MNIST's IDX
//   files, the timeline tracing of dev/trace_mnist, programmatic dependent launch
// ================================================================================================================
// ----------------------------------------------------------------------------------------------------------------
// error checking
// The grid barriers' watchdog (grid_barrier_wait): a kernel whose barrier never opens writes its name's index here
// (mapped pinned host memory, still readable after the context has failed) before it traps, and cuda_check names the
// barrier.
// (No printf in those kernels: a function call in a kernel that runs wgmma serializes its wgmma instructions.)
static volatile int* g_watchdog = nullptr;
static const char* const WATCHDOG_NAMES[] = {"", "conv2_band_tf32_kernel (fused forward)", "conv2_wgrad_tf32_kernel"};
constexpr int WATCHDOG_IDS = sizeof(WATCHDOG_NAMES) / sizeof(WATCHDOG_NAMES[0]);
static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "[CUDA ERROR] %s\n  in %s at %s:%d\n", cudaGetErrorString(err), call, file, line);
        if (g_watchdog && *g_watchdog > 0 && *g_watchdog < WATCHDOG_IDS)
            fprintf(stderr, "  %s: grid barrier not reached by all blocks after 2 s (not co-resident? e.g. an SM limit "
                            "imposed from outside, such as MPS)\n", WATCHDOG_NAMES[*g_watchdog]);
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)
static void cublas_check(cublasStatus_t st, const char* call, const char* file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "[cuBLAS ERROR] status %d (%s)\n  in %s at %s:%d\n", (int)st, cublasGetStatusString(st), call,
                file, line);
        exit(EXIT_FAILURE);
    }
}
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)
static void* malloc_check(size_t n, const char* file, int line) {
    void* p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "error: malloc of %zu bytes failed at %s:%d\n", n, file, line);
        exit(EXIT_FAILURE);
    }
    return p;
}
#define mallocCheck(n) malloc_check(n, __FILE__, __LINE__)
// A bad input or output ends the run with one line naming it (issue 26: no crash, no hang, one clear error).
static void die(const std::string& msg) {
    fprintf(stderr, "error: %s\n", msg.c_str());
    exit(EXIT_FAILURE);
}

namespace cg = cooperative_groups;

// ----------------------------------------------------------------------------------------------------------------
// the network's shape
constexpr int IMG = 28, C1 = 32, H1 = 26, C2 = 64, H2 = 24, HP = 12;
constexpr int K1 = 9;                 // conv1 GEMM K: 1 channel x 3x3
constexpr int KC2 = 9 * C1;           // conv2 GEMM K: 3x3 x 32 channels = 288
constexpr int FC_IN = HP * HP * C2;   // 9216
constexpr int FC_H = 128, NCLS = 10;
constexpr float MNIST_MEAN = 0.1307f, MNIST_STD = 0.3081f;
// as torchvision: ToTensor (p / 255) then Normalize ((x - mean) / std), in fp32 (every path computes x this way)
__host__ __device__ __forceinline__ float mnist_normalize(uint8_t v) {
    return ((float)v / 255.0f - MNIST_MEAN) / MNIST_STD;
}

struct ParamInfo { const char* name; int ndim; int shape[4]; size_t numel; size_t offset; };
// PyTorch state_dict names and layouts; all parameters live in one flat buffer in this order.
static ParamInfo PARAMS[8] = {
    {"conv1.weight", 4, {C1, 1, 3, 3}, 0, 0}, {"conv1.bias", 1, {C1}, 0, 0},
    {"conv2.weight", 4, {C2, C1, 3, 3}, 0, 0}, {"conv2.bias", 1, {C2}, 0, 0},
    {"fc1.weight", 2, {FC_H, FC_IN}, 0, 0},    {"fc1.bias", 1, {FC_H}, 0, 0},
    {"fc2.weight", 2, {NCLS, FC_H}, 0, 0},     {"fc2.bias", 1, {NCLS}, 0, 0},
};
constexpr int N_PARAM_TENSORS = 8;
enum { P_W1, P_B1, P_W2, P_B2, P_WF1, P_BF1, P_WF2, P_BF2 };
static size_t params_setup() {
    size_t off = 0;
    for (auto& p : PARAMS) {
        p.numel = 1;
        for (int d = 0; d < p.ndim; d++) p.numel *= p.shape[d];
        p.offset = off;
        off += p.numel;
    }
    return off;
}

// PyTorch layout <-> internal layout (only conv2.weight and fc1.weight differ).
static void param_to_torch(int idx, const float* internal, float* torch_out) {
    const ParamInfo& p = PARAMS[idx];
    if (idx == P_W2) {
        for (int co = 0; co < C2; co++)
            for (int ci = 0; ci < C1; ci++)
                for (int kk = 0; kk < 9; kk++) torch_out[co * KC2 + ci * 9 + kk] = internal[co * KC2 + kk * C1 + ci];
    } else if (idx == P_WF1) {
        for (int j = 0; j < FC_H; j++)
            for (int c = 0; c < C2; c++)
                for (int s = 0; s < HP * HP; s++)
                    torch_out[(size_t)j * FC_IN + c * HP * HP + s] = internal[(size_t)j * FC_IN + s * C2 + c];
    } else {
        memcpy(torch_out, internal, p.numel * sizeof(float));
    }
}
static void param_from_torch(int idx, const float* torch_in, float* internal) {
    const ParamInfo& p = PARAMS[idx];
    if (idx == P_W2) {
        for (int co = 0; co < C2; co++)
            for (int ci = 0; ci < C1; ci++)
                for (int kk = 0; kk < 9; kk++) internal[co * KC2 + kk * C1 + ci] = torch_in[co * KC2 + ci * 9 + kk];
    } else if (idx == P_WF1) {
        for (int j = 0; j < FC_H; j++)
            for (int c = 0; c < C2; c++)
                for (int s = 0; s < HP * HP; s++)
                    internal[(size_t)j * FC_IN + s * C2 + c] = torch_in[(size_t)j * FC_IN + c * HP * HP + s];
    } else {
        memcpy(internal, torch_in, p.numel * sizeof(float));
    }
}

// ----------------------------------------------------------------------------------------------------------------
// files in and out (issue 26): every input is a regular file or one clear error naming the path and what it is (a
// directory, a device or a FIFO is refused from its stat, before a byte is read: no size taken from a directory, no
// hang on a FIFO); every output is checked at start-up and written through a temporary file in its folder, fsync and
// rename, so a crash never leaves a torn file and a failure keeps the old one and leaves no temporary file behind; a
// directory, device or FIFO is never replaced, and a symlink is written through to its target.
static const char* file_kind(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}
static std::string folder_of(const std::string& path) {
    size_t slash = path.find_last_of('/');
    return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// The whole content of the regular file `path` (what: its role, as "--load checkpoint", for the messages), at most
// max_bytes. "" or a message naming the path.
static std::string file_read_all(const std::string& path, const char* what, size_t max_bytes, std::vector<char>* out) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) return path + ": cannot open " + what + " (" + strerror(errno) + ")";
    if (!S_ISREG(st.st_mode)) return path + ": " + what + " is " + file_kind(st.st_mode) + ", not a regular file";
    int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // O_NONBLOCK: no hang if it became a FIFO
    if (fd < 0) return path + ": cannot open " + what + " (" + strerror(errno) + ")";
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {  // what was opened, in case the path changed in between
        close(fd);
        return path + ": " + what + " is " + file_kind(st.st_mode) + ", not a regular file";
    }
    if ((unsigned long long)st.st_size > max_bytes) {
        close(fd);
        return path + ": " + what + " is " + std::to_string((long long)st.st_size) + " bytes, more than the " +
               std::to_string(max_bytes) + " it can be";
    }
    out->resize((size_t)st.st_size);
    size_t done = 0;
    while (done < out->size()) {
        ssize_t got = read(fd, out->data() + done, std::min<size_t>(out->size() - done, 1u << 30));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        done += (size_t)got;
    }
    std::string why = strerror(errno);
    close(fd);
    if (done != out->size())
        return path + ": read " + std::to_string(done) + " of the " + std::to_string(out->size()) + " bytes of " +
               what + (done < out->size() ? " (" + why + ")" : "");
    return "";
}

// Checks, before any work, that `path` can be written: "" and in *real the file that will be written (a symlink's
// target: written through, the link kept), or a message naming the path: a missing folder, a folder that takes no
// new file, or a directory, device or FIFO (never replaced).
static std::string output_check(const std::string& path, const char* what, std::string* real) {
    struct stat st;
    *real = path;
    if (lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
        char buf[PATH_MAX];
        if (realpath(path.c_str(), buf) != nullptr) {
            *real = buf;
        } else {  // a symlink to a file still to be made: write it where the link points
            if (errno != ENOENT)  // a loop, or a folder on the way that cannot be searched: nothing to write through
                return path + ": " + what + " is a symlink that cannot be followed (" + strerror(errno) + ")";
            ssize_t n = readlink(path.c_str(), buf, sizeof buf - 1);
            if (n <= 0) return path + ": " + what + " is a symlink that cannot be followed (" + strerror(errno) + ")";
            buf[n] = 0;
            *real = buf[0] == '/' ? std::string(buf) : folder_of(path) + "/" + buf;
        }
    }
    std::string folder = folder_of(*real);
    if (stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
        return path + ": " + what + " cannot be written: folder " + folder + " does not exist";
    if (stat(real->c_str(), &st) == 0 && !S_ISREG(st.st_mode))
        return path + ": " + what + " is " + file_kind(st.st_mode) + ", not a regular file: refusing to replace it";
    std::string probe = *real + ".XXXXXX.tmp";  // the folder takes the real write's temporary file (its long name too)
    int fd = mkstemps(&probe[0], 4);
    if (fd < 0) return path + ": " + what + " cannot be written in folder " + folder + " (" + strerror(errno) + ")";
    close(fd);
    unlink(probe.c_str());
    return "";
}

// Writes the chunks to `path` through a temporary file in its folder (path.XXXXXX.tmp), fsync, rename and an fsync of
// the folder: the temporary file never stays behind and the old file is kept on failure. "" or a message.
struct WriteChunk { const void* p; size_t n; };
static std::string file_write_atomic(const std::string& path, const char* what, const std::vector<WriteChunk>& chunks) {
    std::string real;
    std::string e = output_check(path, what, &real);
    if (!e.empty()) return e;
    std::string tmp = real + ".XXXXXX.tmp";
    int fd = mkstemps(&tmp[0], 4);
    if (fd < 0) return path + ": cannot write " + what + " (" + strerror(errno) + ")";
    mode_t mask = umask(0);  // the permissions a plain open() would give, not mkstemp's 0600
    umask(mask);
    fchmod(fd, 0666 & ~mask);
    bool ok = true;
    std::string why;
    for (const WriteChunk& c : chunks) {
        for (size_t done = 0; ok && done < c.n;) {
            ssize_t put = write(fd, (const char*)c.p + done, std::min<size_t>(c.n - done, 1u << 30));
            if (put < 0 && errno == EINTR) continue;
            if (put <= 0) {
                ok = false;
                why = put < 0 ? strerror(errno) : "no space written";
            } else {
                done += (size_t)put;
            }
        }
    }
    if (ok && fsync(fd) != 0) ok = false, why = strerror(errno);
    if (close(fd) != 0 && ok) ok = false, why = strerror(errno);
    if (ok && rename(tmp.c_str(), real.c_str()) != 0) ok = false, why = strerror(errno);
    if (!ok) {
        unlink(tmp.c_str());
        return path + ": cannot write " + what + " (" + why + "); the previous file is kept";
    }
    int dfd = open(folder_of(real).c_str(), O_RDONLY);  // the rename itself reaches the disk
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return "";
}

// ----------------------------------------------------------------------------------------------------------------
// the project's binary file layout: 1024-byte header of 256 int32, a 128-byte table entry per tensor, then data
constexpr int MNIST_CHECKPOINT_MAGIC = 20260202, MNIST_CHECKPOINT_VERSION = 3;
constexpr size_t BIN_MAX_BYTES = size_t(1) << 30;  // a checkpoint is 14 MB, a debug state less: a bound, not a limit

struct BinTensor { std::string name; int dtype, ndim, shape[4]; size_t offset, nbytes; };
struct BinFile {
    std::string path;
    int32_t header[256];
    std::vector<BinTensor> tensors;
    std::vector<char> data;  // the whole file
};
static const int DTYPE_SIZE[3] = {4, 4, 1};
static const char* DTYPE_NAME[3] = {"float32", "int32", "uint8"};

// A tensor name from a table, shown escaped: a corrupt table holds any bytes.
static std::string printable(const std::string& name) {
    std::string shown;
    for (unsigned char c : name) {
        char hex[8];
        snprintf(hex, sizeof hex, "\\x%02x", c);
        shown += c >= 32 && c < 127 ? std::string(1, (char)c) : std::string(hex);
    }
    return shown;
}

// Reads the file and checks its layout (magic, version, table, every shape against the file length, the length)
// before a byte of it is trusted. what: its role for the messages. "" or a message naming the file and the field.
static std::string bin_open(BinFile* bf, const char* path, int magic, int version, const char* what) {
    char msg[512];
    bf->path = path;
    bf->tensors.clear();
    std::string e = file_read_all(path, what, BIN_MAX_BYTES, &bf->data);
    if (!e.empty()) return e;
    const size_t size = bf->data.size();
    if (size < 1024) {
        snprintf(msg, sizeof msg, "%s: file is %zu bytes, shorter than the 1024-byte header", path, size);
        return msg;
    }
    memcpy(bf->header, bf->data.data(), 1024);
    if (bf->header[0] != magic) {
        snprintf(msg, sizeof msg, "%s: header[0] magic is %d, expected %d (%s)", path, bf->header[0], magic, what);
        return msg;
    }
    if (bf->header[1] != version) {
        snprintf(msg, sizeof msg, "%s: header[1] version is %d, expected %d (re-create the file with this version of "
                 "the writer)", path, bf->header[1], version);
        return msg;
    }
    long long T = bf->header[2];
    if (T < 0 || 1024 + 128 * T > (long long)size) {
        snprintf(msg, sizeof msg, "%s: header[2] tensor count %lld does not fit a file of %zu bytes", path, T, size);
        return msg;
    }
    size_t total = 1024 + 128 * (size_t)T;
    for (long long i = 0; i < T; i++) {
        const char* raw = bf->data.data() + 1024 + 128 * i;
        BinTensor t;
        t.name = std::string(raw, strnlen(raw, 96));
        std::string shown = printable(t.name);
        int32_t meta[8];
        memcpy(meta, raw + 96, 32);
        t.dtype = meta[0];
        t.ndim = meta[1];
        if (t.dtype < 0 || t.dtype > 2) {
            snprintf(msg, sizeof msg, "%s: tensor %lld (%s) has dtype code %d, expected 0, 1 or 2", path, i,
                     shown.c_str(), t.dtype);
            return msg;
        }
        if (t.ndim < 0 || t.ndim > 4) {
            snprintf(msg, sizeof msg, "%s: tensor %lld (%s) has ndim %d, expected 0..4", path, i, shown.c_str(),
                     t.ndim);
            return msg;
        }
        size_t n = 1;  // elements; bounded by the file length at every factor, so it never overflows
        for (int d = 0; d < 4; d++) {
            t.shape[d] = d < t.ndim ? meta[2 + d] : 0;
            if (d >= t.ndim) continue;
            if (t.shape[d] < 0) {
                snprintf(msg, sizeof msg, "%s: tensor %lld (%s) has dimension %d of %d, expected >= 0", path, i,
                         shown.c_str(), d, t.shape[d]);
                return msg;
            }
            n = t.shape[d] == 0 || n <= size / (size_t)t.shape[d] ? n * (size_t)t.shape[d] : size + 1;
        }
        t.nbytes = n * DTYPE_SIZE[t.dtype];
        t.offset = total;
        if (n > size || t.nbytes > size - total) {
            snprintf(msg, sizeof msg, "%s: file length is %zu bytes, the header and tensor table say more (tensor "
                     "%lld, %s, runs past the end)", path, size, i, shown.c_str());
            return msg;
        }
        total += t.nbytes;
        bf->tensors.push_back(t);
    }
    if (total != size) {
        snprintf(msg, sizeof msg, "%s: file length is %zu bytes, the header and tensor table say %zu", path, size,
                 total);
        return msg;
    }
    return "";
}
static const char* bin_kind(int magic) {
    return magic == 20260202 ? "mnist checkpoint" : magic == 20260203 ? "mnist debug state" : "mnist fixture";
}
// bin_open, ending the run with its message on a bad file (dev/test_mnist.cu's fixtures).
[[maybe_unused]] static void bin_read(BinFile* bf, const char* path, int magic, int version) {
    std::string e = bin_open(bf, path, magic, version, bin_kind(magic));
    if (!e.empty()) die(e);
}
[[maybe_unused]] static bool bin_has(const BinFile* bf, const char* name) {
    for (auto& t : bf->tensors) if (t.name == name) return true;
    return false;
}
// The data of tensor `name` after checking its dtype and shape (ndim entries of shape; -1 = any); nullptr and *err
// naming the file and the tensor when it is missing or differs.
static const void* bin_find(const BinFile* bf, const std::string& name, int dtype, int ndim, const int* shape,
                            std::string* err) {
    for (auto& t : bf->tensors) {
        if (t.name != name) continue;
        if (t.dtype != dtype) {
            *err = bf->path + ": tensor " + name + " has dtype " + DTYPE_NAME[t.dtype] + ", expected " +
                   DTYPE_NAME[dtype];
            return nullptr;
        }
        bool ok = t.ndim == ndim;
        for (int d = 0; ok && d < ndim; d++) ok = shape[d] < 0 || shape[d] == t.shape[d];
        if (!ok) {
            std::string found, want;
            for (int d = 0; d < t.ndim; d++) found += (d ? "," : "") + std::to_string(t.shape[d]);
            for (int d = 0; d < ndim; d++) want += (d ? "," : "") + std::to_string(shape[d]);
            *err = bf->path + ": tensor " + name + " has shape (" + found + "), expected (" + want + ")";
            return nullptr;
        }
        return bf->data.data() + t.offset;
    }
    *err = bf->path + ": tensor " + name + " is missing";
    return nullptr;
}
// bin_find, ending the run with its message.
static const void* bin_expect(const BinFile* bf, const char* name, int dtype, int ndim, const int* shape) {
    std::string e;
    const void* p = bin_find(bf, name, dtype, ndim, shape, &e);
    if (!p) die(e);
    return p;
}
static float bin_field_f(const BinFile* bf, int slot) { float f; memcpy(&f, &bf->header[slot], 4); return f; }

struct BinWriterTensor { std::string name; int dtype, ndim, shape[4]; const void* data; };
// Writes the file through file_write_atomic (a crash never leaves a torn file). "" or a message naming the path.
static std::string bin_write(const char* path, const char* what, int magic, int version,
                             const std::vector<int32_t>& fields, const std::vector<BinWriterTensor>& ts) {
    int32_t header[256] = {0};
    header[0] = magic; header[1] = version; header[2] = (int)ts.size();
    for (size_t i = 0; i < fields.size(); i++) header[3 + i] = fields[i];
    std::vector<char> table(128 * ts.size(), 0);
    std::vector<WriteChunk> chunks = {{header, sizeof header}, {table.data(), table.size()}};
    for (size_t i = 0; i < ts.size(); i++) {
        const BinWriterTensor& t = ts[i];
        if (t.name.size() >= 96) return std::string(path) + ": tensor name " + t.name + " is too long";
        memcpy(&table[128 * i], t.name.c_str(), t.name.size());
        int32_t meta[8] = {t.dtype, t.ndim, 0, 0, 0, 0, 0, 0};
        size_t n = 1;
        for (int d = 0; d < t.ndim; d++) meta[2 + d] = t.shape[d], n *= t.shape[d];
        memcpy(&table[128 * i + 96], meta, 32);
        chunks.push_back({t.data, n * DTYPE_SIZE[t.dtype]});
    }
    return file_write_atomic(path, what, chunks);
}
static int32_t fbits(float f) { int32_t i; memcpy(&i, &f, 4); return i; }

// ----------------------------------------------------------------------------------------------------------------
// MNIST IDX reader (the original big-endian format inside gzip). Every check names the file, field, expected, found.
struct MnistSplit { int n = 0; std::vector<uint8_t> images; std::vector<uint8_t> labels; };

static uint32_t be32(const uint8_t* b) {
    return ((uint32_t)b[0] << 24) | ((uint32_t)b[1] << 16) | ((uint32_t)b[2] << 8) | b[3];
}

// A gzip file held in memory and inflated on demand by zlib's inflate with the gzip wrapper, which checks each
// member's CRC-32 and length (the 8-byte trailer) when it reaches the member's end. Members may follow each other
// (gzip allows it); anything else after the last one is an error, and so is a stream that ends early.
struct GzFile {
    std::string path;
    std::vector<char> raw;  // the compressed file
    z_stream zs;
    bool live = false, ended = false;
};
constexpr size_t GZ_MAX_BYTES = size_t(1) << 31;  // MNIST's training images are 9.9 MB compressed
constexpr size_t DEFLATE_MAX_RATIO = 1032;        // deflate expands data at most 1032 times (258 bytes per 2 bits)
static std::string gz_open(GzFile* g, const char* path) {
    g->path = path;
    std::string e = file_read_all(path, "MNIST file", GZ_MAX_BYTES, &g->raw);
    if (!e.empty()) return e;
    const uint8_t* b = (const uint8_t*)g->raw.data();
    if (g->raw.size() < 2 || b[0] != 0x1f || b[1] != 0x8b) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s: not a gzip file (%s, not 1f 8b; an uncompressed IDX file must be gzipped)",
                 path, g->raw.size() < 2 ? "shorter than the 2-byte gzip magic" : "it starts with bytes");
        std::string m = msg;
        if (g->raw.size() >= 2) {
            snprintf(msg, sizeof msg, " %02x %02x", b[0], b[1]);
            m.insert(m.find("bytes") + 5, msg);
        }
        return m;
    }
    memset(&g->zs, 0, sizeof g->zs);
    if (inflateInit2(&g->zs, 16 + MAX_WBITS) != Z_OK) return g->path + ": cannot start zlib's inflate";
    g->live = true;
    g->zs.next_in = (Bytef*)g->raw.data();
    g->zs.avail_in = (uInt)g->raw.size();  // < 2^31
    return "";
}
static void gz_close(GzFile* g) {
    if (g->live) inflateEnd(&g->zs);
    g->live = false;
}
// Inflates up to n bytes into dst; *got: how many (fewer only at the end of the last member). "" or a message.
static std::string gz_read(GzFile* g, void* dst, size_t n, size_t* got) {
    *got = 0;
    while (*got < n && !g->ended) {
        g->zs.next_out = (Bytef*)dst + *got;
        g->zs.avail_out = (uInt)std::min<size_t>(n - *got, 1u << 30);
        const uInt room = g->zs.avail_out;
        int r = inflate(&g->zs, Z_NO_FLUSH);
        *got += room - g->zs.avail_out;
        if (r == Z_STREAM_END) {  // this member's CRC-32 and length matched its data
            const uint8_t* next = g->zs.next_in;
            if (g->zs.avail_in == 0) {
                g->ended = true;
            } else if (g->zs.avail_in >= 2 && next[0] == 0x1f && next[1] == 0x8b) {
                inflateReset(&g->zs);  // another member
            } else {
                return g->path + ": " + std::to_string(g->zs.avail_in) + " bytes after the gzip stream that are not a "
                       "gzip member (a corrupt file)";
            }
        } else if (r == Z_BUF_ERROR && g->zs.avail_in == 0) {
            return g->path + ": truncated: the gzip stream stops before its end (the file is cut short: deflate data "
                   "or the 8-byte CRC-32 and length trailer is missing)";
        } else if (r == Z_DATA_ERROR) {
            std::string why = g->zs.msg ? g->zs.msg : "";
            if (why == "incorrect data check")
                return g->path + ": the gzip CRC-32 does not match the data (a corrupt file)";
            if (why == "incorrect length check")
                return g->path + ": the gzip length field does not match the data's length (a corrupt file)";
            return g->path + ": corrupt gzip data (zlib: " + why + ")";
        } else if (r != Z_OK) {
            return g->path + ": cannot decompress (zlib error " + std::to_string(r) + ")";
        }
    }
    return "";
}
// Reads one IDX file: magic 2051 (images, dims count,28,28) or 2049 (labels, dim count). Returns the count.
static int idx_read(const char* path, bool images, std::vector<uint8_t>* out) {
    GzFile g;
    char msg[512];
    auto fail = [&](const std::string& m) { gz_close(&g); die(m); };
    std::string e = gz_open(&g, path);
    if (!e.empty()) fail(e);
    uint8_t hdr[16];
    size_t hdr_bytes = images ? 16 : 8, got = 0;
    if (!(e = gz_read(&g, hdr, hdr_bytes, &got)).empty()) fail(e);
    if (got < hdr_bytes) {
        snprintf(msg, sizeof msg, "%s: truncated: the IDX header needs %zu bytes, found %zu", path, hdr_bytes, got);
        fail(msg);
    }
    uint32_t magic = be32(hdr), count = be32(hdr + 4);
    uint32_t want_magic = images ? 2051 : 2049;
    if (magic != want_magic) {
        snprintf(msg, sizeof msg, "%s: magic number is %u, expected %u (%s IDX file)", path, magic, want_magic,
                 images ? "an images" : "a labels");
        fail(msg);
    }
    if (count == 0 || count > 10000000) {
        snprintf(msg, sizeof msg, "%s: item count is %u, expected 1..10000000", path, count);
        fail(msg);
    }
    if (images) {
        uint32_t rows = be32(hdr + 8), cols = be32(hdr + 12);
        if (rows != IMG) { snprintf(msg, sizeof msg, "%s: rows is %u, expected %d", path, rows, IMG); fail(msg); }
        if (cols != IMG) { snprintf(msg, sizeof msg, "%s: cols is %u, expected %d", path, cols, IMG); fail(msg); }
    }
    size_t n = (size_t)count * (images ? IMG * IMG : 1);
    if (n > g.raw.size() * DEFLATE_MAX_RATIO) {  // the header's size against the file's, before allocating
        snprintf(msg, sizeof msg, "%s: item count is %u: %zu bytes of %s, more than a gzip file of %zu bytes can hold "
                 "(deflate expands at most %zux): the count is wrong or the file truncated", path, count, n,
                 images ? "pixels" : "labels", g.raw.size(), DEFLATE_MAX_RATIO);
        fail(msg);
    }
    out->resize(n);
    if (!(e = gz_read(&g, out->data(), n, &got)).empty()) fail(e);
    if (got < n) {
        snprintf(msg, sizeof msg, "%s: truncated: %s needs %zu bytes, found %zu", path,
                 images ? "the pixels" : "the labels", n, got);
        fail(msg);
    }
    char extra;
    if (!(e = gz_read(&g, &extra, 1, &got)).empty()) fail(e);  // also reaches the trailer: CRC-32 and length checked
    if (got != 0) {
        snprintf(msg, sizeof msg, "%s: trailing bytes after the %u items the header announces (file longer than "
                 "expected)", path, count);
        fail(msg);
    }
    gz_close(&g);
    if (!images)
        for (size_t i = 0; i < n; i++)
            if ((*out)[i] > 9) {
                snprintf(msg, sizeof msg, "%s: label %zu is %d, expected 0..9", path, i, (*out)[i]);
                die(msg);
            }
    return (int)count;
}
// The split's two files from dir; limit > 0: its first `limit` items only.
static MnistSplit mnist_load_split(const std::string& dir, const char* prefix, int limit) {
    MnistSplit s;
    std::string ip = dir + "/" + prefix + "-images-idx3-ubyte.gz", lp = dir + "/" + prefix + "-labels-idx1-ubyte.gz";
    int ni = idx_read(ip.c_str(), true, &s.images);
    int nl = idx_read(lp.c_str(), false, &s.labels);
    if (ni != nl) {
        die("image and label counts disagree: " + ip + " has " + std::to_string(ni) + " images, " + lp + " has " +
            std::to_string(nl) + " labels");
    }
    s.n = (limit > 0 && limit < ni) ? limit : ni;
    s.images.resize((size_t)s.n * IMG * IMG);
    s.labels.resize(s.n);
    return s;
}

// Timeline tracing, only for dev/trace_mnist.cu (built with -DMNIST_TRACE; the trainer's build has none of it): lane 0
// of every warp of each fast-path kernel stores %globaltimer when the warp starts (TRACE_SCOPE at the kernel's top),
// when its grid_dep_sync returns and when it leaves the kernel (the scope's destructor, also on an early return), and
// at the kernel's phase boundaries (TRACE_MARK(i), i < TRACE_MARKS; the trace tool names them).
#ifdef MNIST_TRACE
constexpr int TRACE_KERNELS = 6, TRACE_BLOCKS = 1024, TRACE_WARPS = 32, TRACE_MARKS = 8;
__device__ unsigned long long g_trace[TRACE_KERNELS][TRACE_BLOCKS][TRACE_WARPS][3];
__device__ unsigned long long g_trace_mark[TRACE_KERNELS][TRACE_BLOCKS][TRACE_WARPS][TRACE_MARKS];
__device__ __forceinline__ unsigned long long trace_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ int& trace_kernel_id() { __shared__ int id; return id; }
struct TraceScope {
    unsigned long long* slot = nullptr;
    __device__ explicit TraceScope(int k) {
        const int blk = blockIdx.x + blockIdx.y * gridDim.x, warp = threadIdx.x / 32;
        if (threadIdx.x % 32 == 0) trace_kernel_id() = k;  // each warp reads back its own write
        if (threadIdx.x % 32 == 0 && blk < TRACE_BLOCKS && warp < TRACE_WARPS) {
            slot = g_trace[k][blk][warp];
            slot[0] = trace_now();
        }
    }
    __device__ ~TraceScope() { if (slot) slot[2] = trace_now(); }
};
#define TRACE_SCOPE(k) TraceScope trace_scope_(k)
__device__ __forceinline__ void trace_mark(int i) {
    const int blk = blockIdx.x + blockIdx.y * gridDim.x, warp = threadIdx.x / 32, k = trace_kernel_id();
    if (threadIdx.x % 32 == 0 && k >= 0 && k < TRACE_KERNELS && blk < TRACE_BLOCKS && warp < TRACE_WARPS)
        g_trace_mark[k][blk][warp][i] = trace_now();
}
#define TRACE_MARK(i) trace_mark(i)
#else
#define TRACE_SCOPE(k)
#define TRACE_MARK(i)
#endif

// ----------------------------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+). The fast path's kernels are launched with it (launch_pdl below): kernel N+1
// of the stream may then be scheduled while kernel N still runs, and its launch latency and prologue overlap N's
// tail. Every such kernel calls grid_dep_sync() before it touches memory that an earlier kernel wrote or reads:
// griddepcontrol.wait returns once the previous grid has completed and its writes are visible; then
// launch_dependents lets the next kernel be scheduled. Because each kernel waits before it releases its successor,
// a kernel that starts knows the kernel two launches back is complete: a prologue before grid_dep_sync() may read
// what that one (and anything earlier) wrote, never what the immediately preceding kernel writes (the input gradient
// loads its weight image there). griddepcontrol.wait waits for every earlier grid still in flight, not only the one in
// front (dev/trace_mnist measured it), so a kernel cannot overlap the ones after it unless none of them waits.
// Elsewhere (sm_80, or launches without the attribute) both are no-ops.
// A kernel may also release its successor later than its wait (grid_dep_wait, then grid_dep_launch): the successor's
// blocks then take no SM before that point (the fused forward: not before its second grid barrier).
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef MNIST_TRACE
    const int blk = blockIdx.x + blockIdx.y * gridDim.x, warp = threadIdx.x / 32;
    const int k = trace_kernel_id();  // set by the kernel's TRACE_SCOPE before any thread reaches this
    if (threadIdx.x % 32 == 0 && k >= 0 && k < TRACE_KERNELS && blk < TRACE_BLOCKS && warp < TRACE_WARPS)
        g_trace[k][blk][warp][1] = trace_now();
#endif
}
__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_sync() {
    grid_dep_wait();
    grid_dep_launch();
}

// ================================================================================================================
// 2. THE GENERIC KERNELS
//   the matrix products through operand views (every product of the --tf32 0 path, which the PyTorch fp32 tests
//   compare; the same calls run cuBLAS or the CPU), the small kernels of a step, the optimizer
// ================================================================================================================
// ----------------------------------------------------------------------------------------------------------------
// Matrix views: every operand of every matrix product is a logical (rows x cols) matrix read through one of these,
// so the convolutions are implicit GEMMs (no im2col buffer on our path).
enum ViewKind {
    V_ROW = 0,        // [r][c] = p[r*ld + c]
    V_COL = 1,        // [r][c] = p[c*ld + r]   (a transposed row-major matrix)
    V_CONV1_IN = 2,   // im2col of x (B,28,28): r = (b,oy,ox) over 26x26, c = ky*3+kx
    V_CONV2_IN = 3,   // im2col of act1 (B,26,26,32): r = (b,oy,ox) over 24x24, c = (ky*3+kx)*32 + ci
    V_CONV2_DOUT = 4, // "full" im2col of dact2 (B,24,24,64): r = (b,y,x) over 26x26, c = (ky*3+kx)*64 + co ->
                      // dact2[b,y-ky,x-kx,co]
    V_CONV2_WT = 5,   // conv2 weight as the (ky,kx,co) x ci operand of the input gradient: r = (ky*3+kx)*64 + co,
                      // c = ci
};
struct MatView { int kind; const float* p; int ld; };

template <int KIND>
__host__ __device__ __forceinline__ float view_get(const float* p, int ld, int r, int c) {
    if constexpr (KIND == V_ROW) return p[(size_t)r * ld + c];
    else if constexpr (KIND == V_COL) return p[(size_t)c * ld + r];
    else if constexpr (KIND == V_CONV1_IN) {
        int b = r / (H1 * H1), pix = r % (H1 * H1), oy = pix / H1, ox = pix % H1, ky = c / 3, kx = c % 3;
        return p[(size_t)b * IMG * IMG + (oy + ky) * IMG + ox + kx];
    } else if constexpr (KIND == V_CONV2_IN) {
        int b = r / (H2 * H2), pix = r % (H2 * H2), oy = pix / H2, ox = pix % H2;
        int kk = c / C1, ci = c % C1, ky = kk / 3, kx = kk % 3;
        return p[(((size_t)b * H1 + oy + ky) * H1 + ox + kx) * C1 + ci];
    } else if constexpr (KIND == V_CONV2_DOUT) {
        int b = r / (H1 * H1), pix = r % (H1 * H1), y = pix / H1, x = pix % H1;
        int kk = c / C2, co = c % C2, yy = y - kk / 3, xx = x - kk % 3;
        if (yy < 0 || yy >= H2 || xx < 0 || xx >= H2) return 0.0f;
        return p[(((size_t)b * H2 + yy) * H2 + xx) * C2 + co];
    } else {  // V_CONV2_WT
        int kk = r / C2, co = r % C2;
        return p[co * KC2 + kk * C1 + c];
    }
}
static float view_get_host(const MatView& v, int r, int c) {
    switch (v.kind) {
        case V_ROW: return view_get<V_ROW>(v.p, v.ld, r, c);
        case V_COL: return view_get<V_COL>(v.p, v.ld, r, c);
        case V_CONV1_IN: return view_get<V_CONV1_IN>(v.p, v.ld, r, c);
        case V_CONV2_IN: return view_get<V_CONV2_IN>(v.p, v.ld, r, c);
        case V_CONV2_DOUT: return view_get<V_CONV2_DOUT>(v.p, v.ld, r, c);
        default: return view_get<V_CONV2_WT>(v.p, v.ld, r, c);
    }
}

// What happens to each output element C[r][c] = sum_k A[r][k] B[k][c]: + bias[c], ReLU, then zeroed where
// mask[r][c] <= 0 (ReLU backward; mask has C's layout). rowsum[r] = sum_k A[r][k] (bias gradients of dW = dY^T X).
// pool_act2 (our kernel only): C is the pooled gradient dpooled (B, 12*12*64) and is not stored; each element is
// routed through the max-pool backward instead: dact2 = pool_dact2 gets it at its window's first maximum of act2
// when that act2 > 0 (the ReLU before the pool), zeros at the three other positions (PyTorch's choice).
struct Epilogue { const float* bias = nullptr; int relu = 0; const float* mask = nullptr; float* rowsum = nullptr;
                  const float* pool_act2 = nullptr; float* pool_dact2 = nullptr; };

__device__ __forceinline__ void maxpool_backward_scatter(float* dact2, const float* act2, int b, int j, float d) {
    int ch = j % C2, px = (j / C2) % HP, py = j / (C2 * HP);
    size_t base = (((size_t)b * H2 + 2 * py) * H2 + 2 * px) * C2 + ch;
    const int offs[4] = {0, C2, H2 * C2, H2 * C2 + C2};
    float w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = act2[base + offs[i]];
    int arg = 0;
#pragma unroll
    for (int i = 1; i < 4; i++) if (w[i] > w[arg]) arg = i;
#pragma unroll
    for (int i = 0; i < 4; i++) dact2[base + offs[i]] = (i == arg && w[i] > 0.0f) ? d : 0.0f;
}

// ----------------------------------------------------------------------------------------------------------------
// Our matmul kernel: 64 x BN block tile (BN 64, or 32 for the N <= 32 products), K-tile 32, 4 warps in 2x2, register
// prefetch of the next K-tile while the current one is in shared memory (double buffering through registers).
// TF32: mma.sync m16n8k8 tensor cores with fp32 accumulation; FP32: the same thread-to-output map with FMAs (strict
// fp32, what the PyTorch tests use). Any M, N, K (bounds checked, zero fill); the operands' layouts come from the
// views; split-K over gridDim.z writes partial sums that matmul_splitk_reduce adds up (the weight gradients have
// K = B*576 but only 64x288 outputs).
// Shared memory keeps each operand in the orientation it is read from global memory ([m][k] when k is contiguous,
// [k][m] when m is), padded so that both the stores and the mma fragment reads are free of bank conflicts.
// A operands with contiguous k (row-major and the implicit-GEMM views) use separable addressing: address =
// row_offset(r) + col_offset(c), the row part computed once per thread, the column part once per K-tile.
// Kin of dev/matmul.cu version 6 (TF32 mma.sync m16n8k8, padded conflict-free fragment reads), written in parallel
// with it: this variant adds the implicit-GEMM operand views, register prefetch instead of cp.async, and a strict-fp32
// twin with the same thread-to-output map. (Names to be reconciled by the lead.)
constexpr int MM_BM = 64, MM_BK = 32, MM_THREADS = 128;
static_assert(MM_BM * MM_BK % MM_THREADS == 0, "tiles must split evenly over threads");
static_assert((MM_BK + 4) % 32 == 4 && (MM_BM + 8) % 32 == 8 && (32 + 8) % 32 == 8,
              "row strides of 4 (k-major) or 8 (m/n-major) mod 32 put a fragment's 32 reads on 32 distinct banks");

__device__ __forceinline__ uint32_t f32_to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// The phases of matmul_tiled_kernel (below). sA(m, k) and sB(k, n): the kernel's accessors of the K-tile in shared
// memory. One K-tile of the warp's 32 x BN/2 tile on tensor cores: mma.sync m16n8k8, operands rounded to TF32 as
// they are read (cvt.rna)
template <int NI, class SA, class SB>
__device__ __forceinline__ void mm_ktile_tf32(float (&acc)[2][NI][4], SA sA, SB sB, int wm, int wn, int g, int t) {
#pragma unroll
    for (int kk = 0; kk < MM_BK; kk += 8) {
        uint32_t af[2][4], bf[NI][2];
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
            int r = wm + mi * 16 + g;
            af[mi][0] = f32_to_tf32(sA(r, kk + t));
            af[mi][1] = f32_to_tf32(sA(r + 8, kk + t));
            af[mi][2] = f32_to_tf32(sA(r, kk + t + 4));
            af[mi][3] = f32_to_tf32(sA(r + 8, kk + t + 4));
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            int c = wn + ni * 8 + g;
            bf[ni][0] = f32_to_tf32(sB(kk + t, c));
            bf[ni][1] = f32_to_tf32(sB(kk + t + 4, c));
        }
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++)
                asm volatile(
                    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                    "{%0,%1,%2,%3};\n"
                    : "+f"(acc[mi][ni][0]), "+f"(acc[mi][ni][1]), "+f"(acc[mi][ni][2]), "+f"(acc[mi][ni][3])
                    : "r"(af[mi][0]), "r"(af[mi][1]), "r"(af[mi][2]), "r"(af[mi][3]), "r"(bf[ni][0]),
                      "r"(bf[ni][1]));
    }
}
// The epilogue of the warp's tile (rows m0 + wm .., columns n0 + wn ..): split-K partial sums out as they are, else
// bias, ReLU, mask and the store, or the max-pool backward's scatter (Epilogue). Element e of fragment (mi, ni) is
// row g (+8 for e >= 2), column 2t (+1 for odd e), as mma's C layout.
template <int NI>
__device__ __forceinline__ void mm_epilogue(const float (&acc)[2][NI][4], float* C, int ldc, float* partial, int M,
                                            int N, int m0, int n0, int wm, int wn, int g, int t, const float* bias,
                                            int relu, const float* mask, const float* pool_act2, float* pool_dact2) {
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = m0 + wm + mi * 16 + g + (e >= 2 ? 8 : 0), c = n0 + wn + ni * 8 + 2 * t + (e & 1);
                if (r >= M || c >= N) continue;
                float v = acc[mi][ni][e];
                if (partial) { partial[((size_t)blockIdx.z * M + r) * N + c] = v; continue; }
                if (bias) v += bias[c];
                if (relu) v = fmaxf(v, 0.0f);
                if (mask && !(mask[(size_t)r * ldc + c] > 0.0f)) v = 0.0f;
                if (pool_act2) { maxpool_backward_scatter(pool_dact2, pool_act2, r, c, v); continue; }
                C[(size_t)r * ldc + c] = v;
            }
}
// A with contiguous k: this thread always loads column tid % 32 of the K-tile, rows tid / 32 + 4 i. The row part of
// each row's address (roff), once per kernel; bit i of the result: row i is inside M. The input gradient's view
// (V_CONV2_DOUT) also keeps each row's (y, x) in ryx, for its bounds check per tap.
template <int AK, int LA, int NYX>
__device__ __forceinline__ uint32_t mm_a_row_offsets(int (&roff)[LA], int (&ryx)[NYX], int m0, int M, int lda,
                                                     int tid) {
    uint32_t row_ok = 0;
#pragma unroll
    for (int i = 0; i < LA; i++) {
        int r = m0 + tid / MM_BK + i * (MM_THREADS / MM_BK);
        if (r < M) row_ok |= 1u << i;
        if constexpr (AK == V_ROW) roff[i] = r * lda;
        else if constexpr (AK == V_CONV1_IN) {
            int b = r / (H1 * H1), p = r % (H1 * H1);
            roff[i] = b * IMG * IMG + (p / H1) * IMG + p % H1;
        } else if constexpr (AK == V_CONV2_IN) {
            int b = r / (H2 * H2), p = r % (H2 * H2);
            roff[i] = ((b * H1 + p / H2) * H1 + p % H2) * C1;
        } else {  // V_CONV2_DOUT: rows over 26x26, reading the 24x24 gradient at (y - ky, x - kx)
            int b = r / (H1 * H1), p = r % (H1 * H1), y = p / H1, x = p % H1;
            roff[i] = ((b * H2 + y) * H2 + x) * C2;
            ryx[i] = (y << 8) | x;
        }
    }
    return row_ok;
}
// The global loads of the K-tile at k0 into registers (ra: this thread's LA elements of A, rb: its LB of B), zero
// outside M, N and [.., kend); A with contiguous k through mm_a_row_offsets' row offsets plus a column offset
template <int AK, int BKIND, int BN, int LA, int LB, int NRO, int NYX>
__device__ __forceinline__ void mm_load_tile(float (&ra)[LA], float (&rb)[LB], const float* __restrict__ A, int lda,
                                             const float* __restrict__ Bm, int ldb, const int (&roff)[NRO],
                                             const int (&ryx)[NYX], uint32_t row_ok, int m0, int n0, int M, int N,
                                             int kend, int k0, int tid) {
    constexpr bool A_K_CONTIG = AK != V_COL, B_N_CONTIG = BKIND != V_COL;
    if constexpr (A_K_CONTIG) {
        int c = k0 + tid % MM_BK;
        bool cok = c < kend;
        int coff = 0, cy = 0, cx = 0;
        if constexpr (AK == V_ROW) coff = c;
        else if constexpr (AK == V_CONV1_IN) coff = (c / 3) * IMG + c % 3;
        else if constexpr (AK == V_CONV2_IN) { int kk = c / C1; coff = ((kk / 3) * H1 + kk % 3) * C1 + c % C1; }
        else { int kk = c / C2; cy = kk / 3; cx = kk % 3; coff = c % C2 - (cy * H2 + cx) * C2; }
#pragma unroll
        for (int i = 0; i < LA; i++) {
            bool ok = cok && ((row_ok >> i) & 1u);
            if constexpr (AK == V_CONV2_DOUT) {
                int y = (ryx[i] >> 8) - cy, x = (ryx[i] & 255) - cx;
                ok = ok && y >= 0 && y < H2 && x >= 0 && x < H2;
            }
            ra[i] = ok ? __ldg(A + roff[i] + coff) : 0.0f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < LA; i++) {
            int idx = tid + i * MM_THREADS, mm = idx % MM_BM, kk = idx / MM_BM;
            int r = m0 + mm, c = k0 + kk;
            ra[i] = (r < M && c < kend) ? view_get<AK>(A, lda, r, c) : 0.0f;
        }
    }
#pragma unroll
    for (int i = 0; i < LB; i++) {
        int idx = tid + i * MM_THREADS, kk, nn;
        if (B_N_CONTIG) { nn = idx % BN; kk = idx / BN; } else { kk = idx % MM_BK; nn = idx / MM_BK; }
        int r = k0 + kk, c = n0 + nn;
        rb[i] = (r < kend && c < N) ? view_get<BKIND>(Bm, ldb, r, c) : 0.0f;
    }
}
// The K-tile in registers (mm_load_tile) into shared memory, each operand in the orientation it was read in
template <bool A_K_CONTIG, bool B_N_CONTIG, int BN, int LA, int LB, class SA, class SB>
__device__ __forceinline__ void mm_store_tile(SA sA, SB sB, const float (&ra)[LA], const float (&rb)[LB], int tid) {
#pragma unroll
    for (int i = 0; i < LA; i++) {
        int idx = tid + i * MM_THREADS;
        if (A_K_CONTIG) sA(idx / MM_BK, idx % MM_BK) = ra[i]; else sA(idx % MM_BM, idx / MM_BM) = ra[i];
    }
#pragma unroll
    for (int i = 0; i < LB; i++) {
        int idx = tid + i * MM_THREADS;
        if (B_N_CONTIG) sB(idx / BN, idx % BN) = rb[i]; else sB(idx % MM_BK, idx / MM_BK) = rb[i];
    }
}
template <int AK, int BKIND, bool TF32, int BN>
__global__ void __launch_bounds__(MM_THREADS, 3)
matmul_tiled_kernel(float* C, int ldc, float* partial, const float* __restrict__ A, int lda,
                    const float* __restrict__ Bm, int ldb, int M, int N, int K, int k_per_split, const float* bias,
                    int relu, const float* mask, float* rowsum, const float* pool_act2, float* pool_dact2) {
    constexpr int NI = BN / 16;                    // 8-wide mma tiles per warp along n (warp tile 32 x BN/2)
    constexpr int LA = MM_BM * MM_BK / MM_THREADS, LB = BN * MM_BK / MM_THREADS;
    constexpr bool A_K_CONTIG = AK != V_COL;      // consecutive threads read consecutive k (else consecutive m)
    constexpr bool B_N_CONTIG = BKIND != V_COL;   // consecutive threads read consecutive n (else consecutive k)
    constexpr int A_LD = A_K_CONTIG ? MM_BK + 4 : MM_BM + 8;
    constexpr int B_LD = B_N_CONTIG ? BN + 8 : MM_BK + 4;
    __shared__ float As[A_K_CONTIG ? MM_BM * A_LD : MM_BK * A_LD];
    __shared__ float Bs[B_N_CONTIG ? MM_BK * B_LD : BN * B_LD];
    auto sA = [&](int m, int k) -> float& { return A_K_CONTIG ? As[m * A_LD + k] : As[k * A_LD + m]; };
    auto sB = [&](int k, int n) -> float& { return B_N_CONTIG ? Bs[k * B_LD + n] : Bs[n * B_LD + k]; };

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * BN;
    const int kbeg = blockIdx.z * k_per_split, kend = min(K, kbeg + k_per_split);
    const int wm = (warp / 2) * 32, wn = (warp % 2) * (BN / 2);
    const bool do_rowsum = rowsum != nullptr && blockIdx.x == 0;
    float acc[2][NI][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    float ra[LA], rb[LB];
    float rs = 0.0f;

    int roff[A_K_CONTIG ? LA : 1], ryx[AK == V_CONV2_DOUT ? LA : 1];
    uint32_t row_ok = 0;
    if constexpr (A_K_CONTIG) row_ok = mm_a_row_offsets<AK>(roff, ryx, m0, M, lda, tid);
    auto load = [&](int k0) {
        mm_load_tile<AK, BKIND, BN>(ra, rb, A, lda, Bm, ldb, roff, ryx, row_ok, m0, n0, M, N, kend, k0, tid);
    };
    if (kbeg < kend) load(kbeg);
    for (int k0 = kbeg; k0 < kend; k0 += MM_BK) {
        mm_store_tile<A_K_CONTIG, B_N_CONTIG, BN>(sA, sB, ra, rb, tid);
        __syncthreads();
        if (k0 + MM_BK < kend) load(k0 + MM_BK);  // the next tile's global loads overlap this tile's math
        if (do_rowsum && tid < MM_BM)
#pragma unroll 8
            for (int kk = 0; kk < MM_BK; kk++) rs += sA(tid, kk);
        if constexpr (TF32) {
            mm_ktile_tf32(acc, sA, sB, wm, wn, g, t);
        } else {  // strict fp32: FMAs, the same thread-to-output map (kept inline: as a function its SASS differed)
#pragma unroll 4
            for (int kk = 0; kk < MM_BK; kk++) {
                float a[2][2], b[NI][2];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    a[mi][0] = sA(wm + mi * 16 + g, kk);
                    a[mi][1] = sA(wm + mi * 16 + g + 8, kk);
                }
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    b[ni][0] = sB(kk, wn + ni * 8 + 2 * t);
                    b[ni][1] = sB(kk, wn + ni * 8 + 2 * t + 1);
                }
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
#pragma unroll
                    for (int ni = 0; ni < NI; ni++) {
                        acc[mi][ni][0] = fmaf(a[mi][0], b[ni][0], acc[mi][ni][0]);
                        acc[mi][ni][1] = fmaf(a[mi][0], b[ni][1], acc[mi][ni][1]);
                        acc[mi][ni][2] = fmaf(a[mi][1], b[ni][0], acc[mi][ni][2]);
                        acc[mi][ni][3] = fmaf(a[mi][1], b[ni][1], acc[mi][ni][3]);
                    }
            }
        }
        __syncthreads();
    }
    mm_epilogue(acc, C, ldc, partial, M, N, m0, n0, wm, wn, g, t, bias, relu, mask, pool_act2, pool_dact2);
    if (do_rowsum && tid < MM_BM && m0 + tid < M) rowsum[(partial ? (size_t)blockIdx.z * M : 0) + m0 + tid] = rs;
}

// Adds the split-K partial sums in split order (deterministic) and applies the epilogue.
__global__ void matmul_splitk_reduce(float* C, int ldc, const float* partial, int splits, int M, int N,
                                     const float* bias, int relu, const float* mask, float* rowsum,
                                     const float* rowsum_partial, const float* pool_act2, float* pool_dact2) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < M * N) {
        int r = idx / N, c = idx % N;
        float v = 0.0f;
        for (int s = 0; s < splits; s++) v += partial[(size_t)s * M * N + idx];
        if (bias) v += bias[c];
        if (relu) v = fmaxf(v, 0.0f);
        if (mask && !(mask[(size_t)r * ldc + c] > 0.0f)) v = 0.0f;
        if (pool_act2) maxpool_backward_scatter(pool_dact2, pool_act2, r, c, v);
        else C[(size_t)r * ldc + c] = v;
    }
    if (rowsum && idx < M) {
        float v = 0.0f;
        for (int s = 0; s < splits; s++) v += rowsum_partial[(size_t)s * M + idx];
        rowsum[idx] = v;
    }
}

// cuBLAS path helpers: an explicit im2col (any view -> dense row-major), and the epilogue as its own kernel.
template <int KIND>
__global__ void materialize_kernel(float* dst, const float* p, int ld, int rows, int cols) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < (size_t)rows * cols) dst[idx] = view_get<KIND>(p, ld, (int)(idx / cols), (int)(idx % cols));
}
__global__ void epilogue_kernel(float* C, int ldc, int M, int N, const float* bias, int relu, const float* mask) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= M * N) return;
    int r = idx / N, c = idx % N;
    float v = C[(size_t)r * ldc + c];
    if (bias) v += bias[c];
    if (relu) v = fmaxf(v, 0.0f);
    if (mask && !(mask[(size_t)r * ldc + c] > 0.0f)) v = 0.0f;
    C[(size_t)r * ldc + c] = v;
}

enum Backend { BACKEND_OURS = 0, BACKEND_CUBLAS = 1, BACKEND_CPU = 2 };
// Which kernels run: the command line's choices and what the GPU supports, decided once per process by
// run_config_decide (part 6) and printed in the start-up table (run_config_rows). The tests change backend, tf32 and
// fused_forward between their checks.
struct RunConfig {
    int backend = BACKEND_OURS;  // every matrix product on our kernels, on cuBLAS, or on the CPU (Backend)
    int tf32 = 1;                // TF32 tensor cores in our kernels and cuBLAS, else strict fp32
    int cpu_threads = 1;         // the CPU path's threads
    // from the GPU (gpu_known), for the fast path (a GPU, our kernels, TF32)
    bool gpu_known = false;
    bool pdl = false;                 // programmatic dependent launch between the step's kernels (sm_90+)
    bool fc1_cluster = false;         // fc1's forward on its own kernel in thread-block clusters (sm_90+)
    bool bulk_copy = false;           // conv2.weight's forward image by one bulk copy (ConvInput::wimg, sm_90+)
    bool wgmma = false;               // the binary's code for this GPU runs conv2's products on wgmma (sm_90a)
    bool fused_forward_fits = false;  // the fused forward's FC1F_SPLITS blocks are resident at once (one per SM)
    bool fused_forward = true;        // the fused forward where it applies (mnist_fused_forward); the tests turn it off
    bool cpu_roots_fp32 = false;      // the tests' twin: the CPU computes the inverse roots as the GPU does (fp32)
    int wgrad_cluster = 1;            // conv2's weight gradient adds its partial sums in clusters of 1, 2 or 4 blocks
};
// thread_local: the delayed roots' thread (--precond_delay) runs strict fp32 while the training step does not
static thread_local RunConfig g_run;

struct MatmulContext {
    cudaStream_t stream = 0;
    cublasHandle_t cublas = nullptr;
    float* ws_partial = nullptr; size_t ws_partial_size = 0;  // split-K partial sums (floats)
    float* ws_rowsum = nullptr; size_t ws_rowsum_size = 0;
    float* ws_a = nullptr; size_t ws_a_size = 0;              // cuBLAS path: materialized A / B
    float* ws_b = nullptr; size_t ws_b_size = 0;
    float* ones = nullptr; int ones_size = 0;                 // cuBLAS path: the vector for bias-gradient gemv
    std::vector<float> host_a, host_b, host_c;                // CPU path scratch
};
// thread_local: the delayed roots' thread has its own stream, split-K workspace and cuBLAS handle (RootThread)
static thread_local MatmulContext g_mm;

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static void launch_check() { cudaCheck(cudaGetLastError()); }

// Launches a kernel on g_mm.stream with programmatic dependent launch when g_run.pdl is set (sm_90+, the kernel must
// call grid_dep_sync() first thing) and, when cluster > 1, in thread-block clusters of `cluster` blocks along x.
template <typename... KArgs, typename... Args>
static void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, int cluster, Args&&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid; cfg.blockDim = block; cfg.dynamicSmemBytes = smem; cfg.stream = g_mm.stream;
    cudaLaunchAttribute attrs[2];
    int n = 0;
    if (g_run.pdl) {
        attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[n].val.programmaticStreamSerializationAllowed = 1;
        n++;
    }
    if (cluster > 1) {
        attrs[n].id = cudaLaunchAttributeClusterDimension;
        attrs[n].val.clusterDim.x = cluster; attrs[n].val.clusterDim.y = 1; attrs[n].val.clusterDim.z = 1;
        n++;
    }
    cfg.attrs = attrs; cfg.numAttrs = n;
    cudaCheck(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

static int matmul_bn(int N) { return N <= 32 ? 32 : 64; }  // the narrow tile for conv1 (N=32), dX (32), dW1 (9)

template <int AK, int BKIND>
static void launch_ours_t(float* C, int ldc, float* partial, MatView A, MatView B, int M, int N, int K, int kps,
                          int splits, const Epilogue& ep, float* rowsum) {
    int bn = matmul_bn(N);
    dim3 grid(ceil_div(N, bn), ceil_div(M, MM_BM), splits);
#define MM_LAUNCH(TF, BNV) \
    matmul_tiled_kernel<AK, BKIND, TF, BNV> \
        <<<grid, MM_THREADS, 0, g_mm.stream>>>(C, ldc, partial, A.p, A.ld, B.p, B.ld, M, N, K, kps, ep.bias, ep.relu, \
                                               ep.mask, rowsum, ep.pool_act2, ep.pool_dact2)
    if (g_run.tf32) { if (bn == 32) MM_LAUNCH(true, 32); else MM_LAUNCH(true, 64); }
    else { if (bn == 32) MM_LAUNCH(false, 32); else MM_LAUNCH(false, 64); }
#undef MM_LAUNCH
    launch_check();
}

// The operand combinations the network uses (plus COL x COL for tests); a new one is a compile-time instantiation.
static void launch_ours(float* C, int ldc, float* partial, MatView A, MatView B, int M, int N, int K, int kps,
                        int splits, const Epilogue& ep, float* rowsum) {
#define MM_CASE(a, b) \
    if (A.kind == a && B.kind == b) return launch_ours_t<a, b>(C, ldc, partial, A, B, M, N, K, kps, splits, ep, rowsum);
    MM_CASE(V_ROW, V_ROW) MM_CASE(V_ROW, V_COL) MM_CASE(V_COL, V_ROW) MM_CASE(V_COL, V_COL)
    MM_CASE(V_CONV1_IN, V_COL) MM_CASE(V_CONV2_IN, V_COL) MM_CASE(V_COL, V_CONV2_IN) MM_CASE(V_COL, V_CONV1_IN)
    MM_CASE(V_CONV2_DOUT, V_CONV2_WT)
#undef MM_CASE
    fprintf(stderr, "error: matmul: no kernel instantiated for views (%d, %d)\n", A.kind, B.kind);
    exit(EXIT_FAILURE);
}

static void materialize_gpu(float* dst, MatView v, int rows, int cols) {
    size_t n = (size_t)rows * cols;
    int blocks = (int)((n + 255) / 256);
#define MAT_CASE(k) case k: materialize_kernel<k><<<blocks, 256, 0, g_mm.stream>>>(dst, v.p, v.ld, rows, cols); break;
    switch (v.kind) {
        MAT_CASE(V_ROW) MAT_CASE(V_COL) MAT_CASE(V_CONV1_IN) MAT_CASE(V_CONV2_IN) MAT_CASE(V_CONV2_DOUT)
        MAT_CASE(V_CONV2_WT)
    }
#undef MAT_CASE
    launch_check();
}

// CPU: materialize both operands, then a row-parallel i-k-j loop (contiguous, vectorizable inner loop).
static void cpu_matmul(float* C, int ldc, MatView A, MatView B, int M, int N, int K, const Epilogue& ep) {
    std::vector<float>& a = g_mm.host_a; std::vector<float>& b = g_mm.host_b;
    a.resize((size_t)M * K); b.resize((size_t)K * N);
    for (int r = 0; r < M; r++) for (int k = 0; k < K; k++) a[(size_t)r * K + k] = view_get_host(A, r, k);
    for (int k = 0; k < K; k++) for (int c = 0; c < N; c++) b[(size_t)k * N + c] = view_get_host(B, k, c);
    auto work = [&](int r0, int r1) {
        std::vector<float> row(N);
        for (int r = r0; r < r1; r++) {
            std::fill(row.begin(), row.end(), 0.0f);
            const float* ar = &a[(size_t)r * K];
            for (int k = 0; k < K; k++) {
                float av = ar[k];
                const float* br = &b[(size_t)k * N];
                for (int c = 0; c < N; c++) row[c] += av * br[c];
            }
            for (int c = 0; c < N; c++) {
                float v = row[c];
                if (ep.bias) v += ep.bias[c];
                if (ep.relu) v = fmaxf(v, 0.0f);
                if (ep.mask && !(ep.mask[(size_t)r * ldc + c] > 0.0f)) v = 0.0f;
                C[(size_t)r * ldc + c] = v;
            }
            if (ep.rowsum) {
                float s = 0.0f;
                for (int k = 0; k < K; k++) s += ar[k];
                ep.rowsum[r] = s;
            }
        }
    };
    int nt = std::max(1, std::min(g_run.cpu_threads, M / 8));
    if (nt == 1) { work(0, M); return; }
    std::vector<std::thread> th;
    int started = 0;
    try {  // a thread the system cannot start (an address-space or process limit): this thread does its rows
        for (; started < nt; started++)
            th.emplace_back(work, (int)((long)M * started / nt), (int)((long)M * (started + 1) / nt));
    } catch (const std::system_error&) {
    }
    if (started < nt) work((int)((long)M * started / nt), M);
    for (auto& x : th) x.join();
}

// The one entry point for every matrix product of the network: C[M][N] (row stride ldc) = A (M x K) * B (K x N),
// operands read through views, then the epilogue. Runs our kernel, cuBLAS or the CPU according to g_run.
static void matmul_forward(float* C, int ldc, MatView A, MatView B, int M, int N, int K, const Epilogue& ep) {
    if (g_run.backend == BACKEND_CPU) { cpu_matmul(C, ldc, A, B, M, N, K, ep); return; }
    if (g_run.backend == BACKEND_OURS) {
        if ((size_t)M * K >= (1u << 31) || (size_t)K * N >= (1u << 31)) {  // the kernel's offsets are int32
            fprintf(stderr, "error: matmul: operands of %d x %d x %d exceed int32 offsets\n", M, N, K);
            exit(EXIT_FAILURE);
        }
        int tiles = ceil_div(M, MM_BM) * ceil_div(N, matmul_bn(N));
        int splits = 1;
        // ~2 waves of blocks
        if (tiles < 132 && K >= 512) splits = std::max(1, std::min(ceil_div(264, tiles), K / 128));
        int kps = ceil_div(ceil_div(K, splits), MM_BK) * MM_BK;
        splits = ceil_div(K, kps);
        if (splits == 1) { launch_ours(C, ldc, nullptr, A, B, M, N, K, kps, 1, ep, ep.rowsum); return; }
        if ((size_t)splits * M * N > g_mm.ws_partial_size || (size_t)splits * M > g_mm.ws_rowsum_size) {
            fprintf(stderr, "error: matmul: split-K workspace too small (%d x %d x %d)\n", splits, M, N);
            exit(EXIT_FAILURE);
        }
        launch_ours(C, ldc, g_mm.ws_partial, A, B, M, N, K, kps, splits, ep, ep.rowsum ? g_mm.ws_rowsum : nullptr);
        matmul_splitk_reduce<<<ceil_div(std::max(M * N, M), 256), 256, 0, g_mm.stream>>>(
            C, ldc, g_mm.ws_partial, splits, M, N, ep.bias, ep.relu, ep.mask, ep.rowsum, g_mm.ws_rowsum, ep.pool_act2,
            ep.pool_dact2);
        launch_check();
        return;
    }
    if (ep.pool_act2) {
        fprintf(stderr, "error: matmul: the max-pool epilogue exists on our kernel only\n");
        exit(EXIT_FAILURE);
    }
    // cuBLAS (column-major): C^T (N x M) = op(B)^T-ish: row-major X (rows x cols, ld) is col-major X^T, so
    // C^T = B^T A^T with op N for V_ROW operands and op T for V_COL ones; implicit views are materialized first.
    const float one = 1.0f, zero = 0.0f;
    const float* ap = A.p; int lda = A.ld; cublasOperation_t opa = CUBLAS_OP_N;
    const float* bp = B.p; int ldb = B.ld; cublasOperation_t opb = CUBLAS_OP_N;
    if (A.kind == V_COL) opa = CUBLAS_OP_T;
    else if (A.kind != V_ROW) {
        if ((size_t)M * K > g_mm.ws_a_size) {
            fprintf(stderr, "error: matmul: im2col workspace A too small\n");
            exit(EXIT_FAILURE);
        }
        materialize_gpu(g_mm.ws_a, A, M, K); ap = g_mm.ws_a; lda = K;
    }
    if (B.kind == V_COL) opb = CUBLAS_OP_T;
    else if (B.kind != V_ROW) {
        if ((size_t)K * N > g_mm.ws_b_size) {
            fprintf(stderr, "error: matmul: im2col workspace B too small\n");
            exit(EXIT_FAILURE);
        }
        materialize_gpu(g_mm.ws_b, B, K, N); bp = g_mm.ws_b; ldb = N;
    }
    cublasCheck(cublasSgemm(g_mm.cublas, opb, opa, N, M, K, &one, bp, ldb, ap, lda, &zero, C, ldc));
    if (ep.bias || ep.relu || ep.mask) {
        epilogue_kernel<<<ceil_div(M * N, 256), 256, 0, g_mm.stream>>>(C, ldc, M, N, ep.bias, ep.relu, ep.mask);
        launch_check();
    }
    if (ep.rowsum) {  // bias gradient = dY^T * ones: a gemv over the V_COL operand
        if (A.kind != V_COL || K > g_mm.ones_size) {
            fprintf(stderr, "error: matmul: rowsum needs a V_COL A with K <= %d\n", g_mm.ones_size);
            exit(EXIT_FAILURE);
        }
        cublasCheck(cublasSgemv(g_mm.cublas, CUBLAS_OP_N, M, K, &one, A.p, A.ld, g_mm.ones, 1, &zero, ep.rowsum, 1));
    }
}

// ----------------------------------------------------------------------------------------------------------------
// the other kernels of a step (each with a CPU twin below)
// (The fast path's training step has no gather: conv2's forward kernel reads the bytes itself, see ConvInput.)
__global__ void gather_batch_kernel(float* x, int* y, const uint8_t* images, const uint8_t* labels, const int* perm,
                                    const int* counters, int offset_const, int B) {
    grid_dep_sync();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * IMG * IMG) return;
    int b = idx / (IMG * IMG), p = idx % (IMG * IMG);
    int pos = (counters ? counters[1] : offset_const) + b;
    int s = perm ? perm[pos] : pos;
    x[idx] = mnist_normalize(images[(size_t)s * IMG * IMG + p]);
    if (p == 0) y[b] = labels[s];
}

__global__ void maxpool_forward_kernel(float* pooled, const float* act2, int B) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;  // over (b, py, px, c)
    if (idx >= B * FC_IN) return;
    int c = idx % C2, px = (idx / C2) % HP, py = (idx / (C2 * HP)) % HP, b = idx / FC_IN;
    const float* base = act2 + (((size_t)b * H2 + 2 * py) * H2 + 2 * px) * C2 + c;
    float m = base[0];
    m = fmaxf(m, base[C2]);
    m = fmaxf(m, base[H2 * C2]);
    m = fmaxf(m, base[H2 * C2 + C2]);
    pooled[idx] = m;
}
// dact2[b,y,x,c] = dpooled at its window iff (y,x) is the window's first maximum (PyTorch's choice) and act2 > 0
// (the ReLU in front of the pool). A gather: each element decides for itself, no atomics, no zero fill.
__host__ __device__ inline float maxpool_backward_elem(const float* dpooled, const float* act2, int b, int y, int x,
                                                       int c) {
    int py = y / 2, px = x / 2;
    const float* win = act2 + (((size_t)b * H2 + 2 * py) * H2 + 2 * px) * C2 + c;
    float best = win[0]; int arg = 0;
    const int offs[4] = {0, C2, H2 * C2, H2 * C2 + C2};
    for (int i = 1; i < 4; i++) if (win[offs[i]] > best) { best = win[offs[i]]; arg = i; }
    int me = (y % 2) * 2 + (x % 2);
    float v = act2[(((size_t)b * H2 + y) * H2 + x) * C2 + c];
    if (me != arg || !(v > 0.0f)) return 0.0f;
    return dpooled[(((size_t)b * HP + py) * HP + px) * C2 + c];
}
__global__ void maxpool_backward_kernel(float* dact2, const float* dpooled, const float* act2, int B) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * H2 * H2 * C2) return;
    int c = idx % C2, x = (idx / C2) % H2, y = (idx / (C2 * H2)) % H2, b = idx / (C2 * H2 * H2);
    dact2[idx] = maxpool_backward_elem(dpooled, act2, b, y, x, c);
}

// One warp holds one row of NCLS logits (lane j: logit j; lanes >= NCLS: -inf): log-softmax + NLL. Writes the row's
// loss and prediction (argmax, lowest index on ties) at its position in the epoch's arrays when those are given;
// returns through e, sum and label what the gradient (softmax - onehot) / B = (e / sum - [lane == label]) / B needs.
__device__ __forceinline__ void warp_log_softmax_nll(float v, int lane, const int* y, int row, const int* counters,
                                                     int offset_const, float* losses, int* preds, float& e, float& sum,
                                                     int& label) {
    float mx = v; int arg = lane;
    for (int o = 16; o > 0; o /= 2) {
        float om = __shfl_xor_sync(0xffffffff, mx, o); int oa = __shfl_xor_sync(0xffffffff, arg, o);
        if (om > mx || (om == mx && oa < arg)) { mx = om; arg = oa; }
    }
    e = lane < NCLS ? expf(v - mx) : 0.0f;
    sum = e;
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    label = y[row];
    float logp = v - mx - logf(sum);
    int pos = (counters ? counters[1] : offset_const) + row;
    if (lane == label && losses) losses[pos] = -logp;
    if (lane == 0 && preds) preds[pos] = arg;
}
// Fused log-softmax + NLL, one warp per row: per-sample loss, prediction, and dlogits = (softmax - onehot) / B.
__global__ void softmax_xent_kernel(float* dlogits, float* losses, int* preds, const float* logits, const int* y,
                                    const int* counters, int offset_const, int B) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= B) return;
    float v = lane < NCLS ? logits[row * NCLS + lane] : -INFINITY;
    float e, sum;
    int label;
    warp_log_softmax_nll(v, lane, y, row, counters, offset_const, losses, preds, e, sum, label);
    if (lane < NCLS && dlogits) dlogits[row * NCLS + lane] = (e / sum - (lane == label ? 1.0f : 0.0f)) / (float)B;
}

// ----------------------------------------------------------------------------------------------------------------
// optimizer and learning-rate schedule (computed on the device from the step counter, so a CUDA graph replays it)
enum { OPT_SGD = 0, OPT_ADAMW = 1, OPT_MUON = 2, OPT_SHAMPOO = 3, OPT_KFAC = 4 };
enum { SCHED_CONSTANT = 0, SCHED_COSINE = 1, SCHED_LINEAR = 2 };
enum { GRAFT_SGD = 0, GRAFT_ADAM = 1 };
struct OptConfig {
    int optimizer = OPT_SGD, schedule = SCHED_COSINE, warmup_steps = 0, total_steps = 1;
    float lr = 0.05f, lr_min = 0.0f, momentum = 0.9f, weight_decay = 5e-4f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
    // Muon, Shampoo and K-FAC (the matrix optimizers' section in part 4)
    int nesterov = 1, ns_steps = 5, graft = GRAFT_SGD, precond_every = 20, precond_start = 20, max_precond_dim = 1024;
    float muon_lr = 0.02f, muon_momentum = 0.95f, precond_eps = 1e-12f, precond_damping = 1e-3f;
    float kfac_stat_decay = 0.95f;
    int precond_delay = 0;  // roots due at step s first used at step s + precond_delay (0: at s)
    // per-sample gradients (part 4, after the matrix optimizers): clip norm (0: off), DP noise, Fisher preconditioner
    float clip = 0.0f, noise = 0.0f, fisher_power = 0.5f;
    int precond = 0;  // PRECOND_NONE or PRECOND_FISHER_DIAG
};
enum { PRECOND_NONE = 0, PRECOND_FISHER_DIAG = 1 };
// the per-sample step (mnist_train_step_per_sample) replaces the usual backward
__host__ __device__ inline bool per_sample_on(const OptConfig& c) { return c.clip > 0.0f || c.precond != PRECOND_NONE; }
// step: the number of updates done before this one. Warm-up: linear from lr/warmup to lr over warmup_steps; then
// cosine or linear decay to lr_min at total_steps (warm-up + decay = a one-cycle shape).
__host__ __device__ inline float lr_at(const OptConfig& c, int step) {
    if (c.warmup_steps > 0 && step < c.warmup_steps) return c.lr * (float)(step + 1) / (float)c.warmup_steps;
    if (c.schedule == SCHED_CONSTANT) return c.lr;
    float span = (float)max(1, c.total_steps - c.warmup_steps);
    float p = fminf(1.0f, (float)(step - c.warmup_steps) / span);
    if (c.schedule == SCHED_COSINE) return c.lr_min + 0.5f * (c.lr - c.lr_min) * (1.0f + cosf(3.14159265358979f * p));
    return c.lr + (c.lr_min - c.lr) * p;
}
// The scalars of one update, the same for every element: the learning rate, and AdamW's bias corrections at
// t = step + 1 (computed once per thread, not per element).
struct OptStep { float lr, bc1, bc2; };
__host__ __device__ inline OptStep opt_step(const OptConfig& c, int step) {
    OptStep s;
    s.lr = lr_at(c, step);
    s.bc1 = 1.0f - powf(c.beta1, (float)(step + 1));
    s.bc2 = 1.0f - powf(c.beta2, (float)(step + 1));
    return s;
}
// As torch.optim.SGD (momentum, dampening 0, weight decay added to the gradient) and torch.optim.AdamW, with every
// rounding written out: on the GPU __fmul_rn, __fadd_rn and __fsub_rn, which the compiler never contracts into an
// FMA, and fmaf where an FMA is meant. So every kernel that inlines these computes the same bits for the same inputs,
// which the fused updates (fc1_backward_kernel, the weight-gradient kernel's reduction) must, to match
// optimizer_kernel (with nvcc's default contraction the copies differed by an ulp in ~6% of the elements, and which
// ones moved with any change of the surrounding code). The CPU path runs the same operations (the default x86-64
// host build has no FMA instruction to contract them into).
__host__ __device__ inline float opt_mul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
__host__ __device__ inline float opt_add(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
__host__ __device__ inline float opt_sub(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
__host__ __device__ inline void sgd_update_elem(const OptConfig& c, const OptStep& s, float* p, float g, float* m) {
    g = opt_add(g, opt_mul(c.weight_decay, *p));
    float buf = opt_add(opt_mul(c.momentum, *m), g);  // first step: m = 0, so buf = g, as PyTorch's clone
    *m = buf;
    *p = opt_sub(*p, opt_mul(s.lr, buf));
}
__host__ __device__ inline void opt_update_elem(const OptConfig& c, const OptStep& s, float* p, float g, float* m,
                                                float* v) {
    if (c.optimizer == OPT_SGD) {
        sgd_update_elem(c, s, p, g, m);
    } else {
        *p = opt_mul(*p, opt_sub(1.0f, opt_mul(s.lr, c.weight_decay)));
        float mm = fmaf(c.beta1, *m, opt_mul(opt_sub(1.0f, c.beta1), g));
        float vv = fmaf(c.beta2, *v, opt_mul(opt_mul(opt_sub(1.0f, c.beta2), g), g));
        *m = mm; *v = vv;
        float denom = opt_add(sqrtf(vv) / sqrtf(s.bc2), c.eps);
        *p = opt_sub(*p, opt_mul(s.lr / s.bc1, mm) / denom);
    }
}
// ----------------------------------------------------------------------------------------------------------------
// the optimizer step over the flat parameter buffer
// One launch over every parameter; a thread updates 4 consecutive elements with 16-byte accesses (the buffers are
// cudaMalloc'd, so aligned), the last thread also the n % 4 tail. With advance_B >= 0 the kernel also advances the
// counters (as advance_counters_kernel, one launch less): the last block to finish does it, when every block has read
// counters[0] (a ticket in counters[2], reset by that block). (The fast path's training step does not use this
// kernel: its updates run in fc1_backward_kernel and conv2_wgrad_tf32_kernel.)
__global__ void optimizer_kernel(float* params, const float* grads, float* m, float* v, size_t n, OptConfig c,
                                 int* counters, int advance_B) {
    grid_dep_sync();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, n4 = n / 4;
    const OptStep st = opt_step(c, counters[0]);
    if (advance_B >= 0) {
        __syncthreads();  // every thread of the block has read counters[0]
        if (threadIdx.x == 0) {
            __threadfence();
            if (atomicAdd(&counters[2], 1) == (int)gridDim.x - 1) {
                counters[0] += 1;
                counters[1] += advance_B;
                counters[2] = 0;
            }
        }
    }
    if (i > n4) return;
    if (i < n4) {
        float4 p = ((float4*)params)[i], g = ((const float4*)grads)[i], mm = ((float4*)m)[i];
        float4 vv = c.optimizer == OPT_ADAMW ? ((float4*)v)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        opt_update_elem(c, st, &p.x, g.x, &mm.x, &vv.x);
        opt_update_elem(c, st, &p.y, g.y, &mm.y, &vv.y);
        opt_update_elem(c, st, &p.z, g.z, &mm.z, &vv.z);
        opt_update_elem(c, st, &p.w, g.w, &mm.w, &vv.w);
        ((float4*)params)[i] = p; ((float4*)m)[i] = mm;
        if (c.optimizer == OPT_ADAMW) ((float4*)v)[i] = vv;
    } else {
        for (size_t j = 4 * n4; j < n; j++) opt_update_elem(c, st, &params[j], grads[j], &m[j], &v[j]);
    }
}
// counters[0] = updates done, counters[1] = position in the epoch's permutation; advanced once per step.
__global__ void advance_counters_kernel(int* counters, int B) {
    grid_dep_sync();
    counters[0] += 1; counters[1] += B;
}

// ================================================================================================================
// 3. THE FAST PATH'S INTERFACE
//   the constants, types and entry points that the model (part 4) uses behind conv2_fast(m), the default GPU path
//   (--matmul ours --tf32 1); the kernels and their launchers are in part 6
// ================================================================================================================
// fc1's split of K on the fast path (fc1_forward_kernel below; the fused forward inside conv2's forward kernel)
constexpr int FC1F_KC = 72, FC1F_SPLITS = FC_IN / FC1F_KC, FC1F_CLUSTER = 8, FC1F_PARTS = FC1F_SPLITS / FC1F_CLUSTER;
constexpr int FC1F_LD = FC1F_KC + 4;  // 76 = 12 mod 32: a fragment's 8 rows x 4 k fall on 32 distinct banks
constexpr size_t FC1F_SMEM = ((size_t)(64 + FC_H) * FC1F_LD + 64 * FC_H) * sizeof(float);  // operands, then the inbox
static_assert(FC_IN % FC1F_KC == 0 && FC1F_SPLITS % FC1F_CLUSTER == 0 && FC1F_KC % 8 == 0 && FC1F_LD % 32 == 12,
              "fc1 split");
constexpr int FUSED_MAX_B = 64;  // the fused forward's batch limit: fc1's 64-row tile

// Where conv2's forward kernel takes the network's input from: x (B,28,28), normalized, written by an earlier kernel;
// or (images not null: the training step, no gather kernel) the dataset's bytes, sample perm[pos + b] (pos + b without
// perm) with pos = counters[1] (offset when counters is null), normalized by mnist_normalize; x_out and y_out then get
// the batch's x (conv1's weight gradient reads it) and labels. Those reads run before grid_dep_sync: the dataset and
// the permutation change only between epochs, and counters[1] was advanced by the previous step's
// fc1_backward_kernel, three launches back. Or (staged not null: a training step after another in the same sequence,
// see mnist_train_steps) the batch's bytes [B][784] and labels [B] that the previous step's weight-gradient kernel
// gathered (BatchPrefetch::xb): one load after grid_dep_sync instead of three dependent ones (position, permutation,
// image) before it; x_out and y_out as above.
struct ConvInput {
    const float* x = nullptr;
    const uint8_t *images = nullptr, *labels = nullptr;
    const int *perm = nullptr, *counters = nullptr;
    int offset = 0;
    const uint8_t* staged = nullptr;
    const int* staged_y = nullptr;
    // staged too: conv2.weight's forward image, by the previous step's update (SplitsJob::w2img)
    const float* wimg = nullptr;
    float* x_out = nullptr;
    int* y_out = nullptr;
};

// The training step's fc1 and head inside conv2's forward kernel (the fused forward; part not null): the grid is then
// FC1F_SPLITS blocks, all resident at once (one per SM), B <= 64, and the blocks past the batch's bands skip the
// convolutions. Block s loads fc1.weight's K slice s (columns 72 s .. 72 s + 71) by cp.async once conv2's weights have
// landed; after its bands and a grid barrier (every pooled row stored) it computes fc1's partial sum over that slice
// exactly as fc1_forward_kernel's block s does (the same rounded operands, the same products: the same bits) and stores
// it to part[s][B][128] (4 MB at batch 64, stored and loaded with streaming hints: read once; plain accesses kept them
// in L2 at the expense of what the backward reads next, measured on the H100: 0.8 ms per epoch); after a second
// barrier, which also releases fc1's backward (released at the wait, its blocks sat early on this kernel's first free
// SMs: 0.4 ms slower), block b < B adds row b's 128 partial sums in the order fc1_forward_kernel's clusters and
// head_kernel<FC1F_PARTS> add them (the 8 of a group in rank order, then the 16 groups), then fc1's bias and ReLU (h),
// and runs head_row. So the fused forward is bit-identical to conv2's forward + fc1_forward_kernel + head_kernel, with
// two grid barriers in place of two launches and their ramps.
struct FwdHead {
    const float *wf1 = nullptr, *bf1 = nullptr, *wf2 = nullptr, *bf2 = nullptr;
    float *part = nullptr, *h = nullptr, *logits = nullptr, *dlogits = nullptr, *dh = nullptr, *losses = nullptr;
    int* preds = nullptr;
    const int *y = nullptr, *counters = nullptr;
    int offset = 0;
    unsigned long long* bar = nullptr;
};

// fc1.weight's SGD step in the input-gradient kernel's idle warp (fc1_step_share, part 6)
struct Fc1Step {
    float *p = nullptr, *m1 = nullptr;
    const float* g = nullptr;
    const int* counters = nullptr;
    OptConfig c;
};

// The split reductions: conv2's weight gradient over the weight-gradient blocks' partial sums and conv1's over the
// input-gradient kernel's, both at the end of conv2_wgrad_tf32_kernel (after a grid-wide barrier). A SplitsJob is
// one of them: dst[i] = sum_{s < splits} src[s * stride + i] for i < n (i >= n_head goes to dst_tail[i - n_head]), or,
// with update_off >= 0, no store: the optimizer step with that sum applied to the parameters update_off + i of the
// flat buffers of an OptTarget (the same opt_update_elem as optimizer_kernel: the same result, bit for bit, as storing
// the gradient and running optimizer_kernel). The summation order is fixed (deterministic for a given split count):
// 32 lanes k = 0..31 each add the splits s = k, k + 32, k + 64, ... into four accumulators (a[u] gets s = k + 32 u
// + 128 j, in groups of four while s + 96 < splits, the remaining ones in a[0], a[1], ...), lane k's part is
// (a[0] + a[1]) + (a[2] + a[3]), and the sum is part_0 + part_1 + ... + part_31 in that order (lanes past the split
// count add +0). That is the order of the former splits_reduce_kernel (its warp k summed lane k's splits), so the
// gradients are bit-identical to it.
constexpr int SR_LANES = 32;
struct SplitsJob {
    float *dst = nullptr, *dst_tail = nullptr; int n_head = 0;
    const float* src = nullptr; size_t stride = 0; int splits = 0, n = 0;
    int update_off = -1;
    float* w2img = nullptr;  // conv2's update only: also each updated weight (i < n_head), see conv2_fwd_img_index
};
struct OptTarget {
    float *params = nullptr, *m1 = nullptr, *m2 = nullptr;
    int* counters = nullptr;
    int advance_B = -1;
    OptConfig c;
};

// The next step's batch, for conv2's forward kernel right after this kernel (ConvInput): the samples at the
// permutation's entries from counters[1] (advanced by fc1_backward_kernel, complete here); n: the dataset's size,
// positions past it are skipped. xb not null (the next step is in the same sequence, mnist_train_steps): their bytes
// and labels gathered into xb [B][784] and yb [B] (ConvInput::staged); else an L2 prefetch of the images' bytes (a
// hint: no effect on any value; the next forward gathers them itself).
// a sample's 49 16-byte image chunks, its label
constexpr int GATHER_CH = IMG * IMG / 16, GATHER_ITEMS = GATHER_CH + 1;
static_assert(IMG * IMG % 16 == 0, "16-byte chunks of an image (every image starts 16-byte aligned: 784 = 49 x 16)");
struct BatchPrefetch {
    const uint8_t *images = nullptr, *labels = nullptr;
    const int* perm = nullptr;
    const int* counters = nullptr;
    int n = 0, B = 0;
    uint8_t* xb = nullptr; int* yb = nullptr;
};

// fc1's backward kernel (fc1_backward_kernel, part 6)
struct Fc1BackwardArgs {
    float *dpooled, *gwf1, *gbf1, *gwf2, *gbf2;
    const float *wf1, *dh, *pooled, *dlogits, *h;
    int* counters;
    int B;
    int advance_pos = -1;  // >= 0: counters[1] += advance_pos (the next step's conv2 forward reads it before its wait)
};

// Launch configuration, set once per process by run_config_decide (persistent grids: as many blocks as fit at once),
// and the workspaces, allocated by conv2_tf32_setup.
struct Conv2Tf32 {
    bool ready = false;
    int fwd_ctas = 0, dgrad_ctas = 0, wgrad_ctas = 0;
    // the grid barrier of the weight gradient and the fused forward (see grid_barrier_arrive)
    unsigned long long* wgrad_bar = nullptr;
    float *ws = nullptr, *ws_w1 = nullptr, *wimg_dgrad = nullptr;
    // conv2.weight's forward image, written by the training step's update (SplitsJob::w2img)
    float* wimg_fwd = nullptr;
};
static Conv2Tf32 g_conv2;

// the fast path's kernels and launchers that the model calls (defined in part 6)
__global__ void __launch_bounds__(256) fc1_forward_kernel(float* hpart, const float* __restrict__ pooled,
                                                          const float* __restrict__ wf1, int B);
template <int NPARTS>
__global__ void head_kernel(float* logits, float* dlogits, float* dh, float* losses, int* preds, float* h,
                            const float* __restrict__ hpart, const float* __restrict__ bf1,
                            const float* __restrict__ wf2, const float* __restrict__ bf2, const int* y,
                            const int* counters, int offset_const, int B);
static void fast_path_setup();
static void conv2_forward_tf32(float* act2, float* pooled, uint8_t* codes, float* act1, uint32_t* act1_sign,
                               const ConvInput& in, const float* w1, const float* b1, const float* w2, const float* b2,
                               int B, const FwdHead& fh = FwdHead());
static SplitsJob conv2_dgrad_tf32(float* dact1, float* dw1, float* db1, const float* dpooled, const uint8_t* codes,
                                  const uint32_t* act1_sign, const float* x, int B, const Fc1Step& fc1 = Fc1Step());
static void conv2_wgrad_tf32(float* dw2, float* db2, const float* dpooled, const uint8_t* codes, const float* act1,
                             int B, const SplitsJob& dgrad, const SplitsJob& extra = SplitsJob(),
                             const OptTarget& opt = OptTarget(), int update_off = -1,
                             const BatchPrefetch& pf = BatchPrefetch());
static void fc1_backward(const Fc1BackwardArgs& a);

// ================================================================================================================
// 4. THE MODEL
//   parameters, activations, forward, loss, backward, update; in each the --tf32 0 path is the straight line of
//   matmul_forward calls, and the branch on conv2_fast(m) leads into the fast path (part 6)
// ================================================================================================================
struct MatrixOpt;  // Muon's, Shampoo's and K-FAC's buffers (the matrix optimizers, below)
struct PerSample;  // the per-sample gradients' buffers (below the matrix optimizers)
struct Mnist {
    bool cpu = false;
    int B = 0;           // largest batch of forward + backward
    int B_fwd = 0;       // largest forward-only batch (evaluation)
    size_t n_params = 0;
    float *params = nullptr, *grads = nullptr, *m1 = nullptr, *m2 = nullptr;  // flat, internal layout
    float *x = nullptr, *act1 = nullptr, *act2 = nullptr, *pooled = nullptr, *h = nullptr, *logits = nullptr;
    uint32_t* act1_sign = nullptr;  // act1's signs (a word per pixel), made by the TF32 forward for its input gradient
    int* y = nullptr;
    float *dlogits = nullptr, *dh = nullptr, *dpooled = nullptr, *dact2 = nullptr, *dact1 = nullptr;
    uint8_t* pool_codes = nullptr;  // fast path: the max-pool's window codes (B,12,12,64), instead of act2 and dact2
    float* hpart = nullptr;         // fast path on sm_90: fc1's 16 split-K partial sums (16,B,128)
    float* fpart = nullptr;         // the fused forward's 128 split-K partial sums (128,B,128), B <= FUSED_MAX_B
    uint8_t* xb = nullptr;          // GPU: the next training step's batch bytes (B,28,28) and labels (B), gathered by
    int* yb = nullptr;              // the weight-gradient kernel (BatchPrefetch::xb, ConvInput::staged)
    int* counters = nullptr;  // device (or host) [step, offset, the optimizer's ticket (GPU, 0 between launches)]
    OptConfig opt;
    MatrixOpt* mo = nullptr;  // --optimizer muon / shampoo / kfac only
    PerSample* ps = nullptr;  // --clip_per_sample / --precond fisher_diag only
};

static void matrix_opt_build(Mnist* m);
static void matrix_opt_free(Mnist* m);
static void per_sample_build(Mnist* m);
static void per_sample_free(Mnist* m);
static bool is_matrix_opt(int optimizer) { return optimizer >= OPT_MUON; }  // Muon, Shampoo, K-FAC
static float* mnist_alloc(const Mnist* m, size_t n) {
    float* p;
    if (m->cpu) {
        p = (float*)mallocCheck(n * sizeof(float));
        memset(p, 0, n * sizeof(float));
    } else {
        cudaCheck(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(float)));
        cudaCheck(cudaMemset(p, 0, n * sizeof(float)));
    }
    return p;
}
static void mnist_free_ptr(const Mnist* m, void* p) { if (m->cpu) free(p); else cudaCheck(cudaFree(p)); }

// Allocates parameters, optimizer state and activations for batches up to B (training) and B_fwd (evaluation).
static void mnist_build(Mnist* m, bool cpu, int B, int B_fwd) {
    m->cpu = cpu; m->B = B; m->B_fwd = std::max(B, B_fwd);
    m->n_params = params_setup();
    m->params = mnist_alloc(m, m->n_params); m->grads = mnist_alloc(m, m->n_params);
    m->m1 = mnist_alloc(m, m->n_params); m->m2 = mnist_alloc(m, m->n_params);
    size_t F = m->B_fwd;
    m->x = mnist_alloc(m, F * IMG * IMG);
    m->act1 = mnist_alloc(m, F * H1 * H1 * C1);
    m->act2 = mnist_alloc(m, F * H2 * H2 * C2);
    m->act1_sign = (uint32_t*)mnist_alloc(m, F * H1 * H1);
    m->pooled = mnist_alloc(m, F * FC_IN); m->h = mnist_alloc(m, F * FC_H); m->logits = mnist_alloc(m, F * NCLS);
    m->y = (int*)mnist_alloc(m, F);
    m->dlogits = mnist_alloc(m, F * NCLS);
    m->dh = mnist_alloc(m, (size_t)B * FC_H);
    m->dpooled = mnist_alloc(m, (size_t)B * FC_IN);
    m->dact2 = mnist_alloc(m, (size_t)B * H2 * H2 * C2); m->dact1 = mnist_alloc(m, (size_t)B * H1 * H1 * C1);
    m->counters = (int*)mnist_alloc(m, 3);
    m->pool_codes = (uint8_t*)mnist_alloc(m, ceil_div((int)(F * FC_IN), 4));
    m->hpart = mnist_alloc(m, (size_t)FC1F_PARTS * F * FC_H);
    if (!cpu) {
        m->fpart = mnist_alloc(m, (size_t)FC1F_SPLITS * std::min(B, FUSED_MAX_B) * FC_H);
        m->xb = (uint8_t*)mnist_alloc(m, (size_t)B * IMG * IMG / 4);
        m->yb = (int*)mnist_alloc(m, B);
    }
    if (!cpu) {
        if (!g_mm.ws_partial) {  // shared by every model of the process (the tests build several)
            g_mm.ws_partial_size = 4u << 20; g_mm.ws_rowsum_size = 1u << 16;
            cudaCheck(cudaMalloc(&g_mm.ws_partial, g_mm.ws_partial_size * sizeof(float)));
            cudaCheck(cudaMalloc(&g_mm.ws_rowsum, g_mm.ws_rowsum_size * sizeof(float)));
        }
        fast_path_setup();
        if (!g_mm.cublas) cublasCheck(cublasCreate(&g_mm.cublas));
        // TF32 only where --tf32 1 says so; CUBLAS_DEFAULT_MATH is strict fp32 (PyTorch's allow_tf32=False)
        cublasCheck(cublasSetMathMode(g_mm.cublas, g_run.tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
        cublasCheck(cublasSetStream(g_mm.cublas, g_mm.stream));
        if (g_run.backend == BACKEND_CUBLAS) {
            cudaCheck(cudaFree(g_mm.ws_a)); cudaCheck(cudaFree(g_mm.ws_b)); cudaCheck(cudaFree(g_mm.ones));
            // the largest im2col operands: conv2 input (F*576 x 288), the input gradient's (B*676 x 576)
            g_mm.ws_a_size = std::max({F * H2 * H2 * KC2, (size_t)B * H1 * H1 * 9 * C2, F * H1 * H1 * K1});
            g_mm.ws_b_size = std::max({(size_t)B * H2 * H2 * KC2, (size_t)B * H1 * H1 * K1, (size_t)9 * C2 * C1});
            cudaCheck(cudaMalloc(&g_mm.ws_a, g_mm.ws_a_size * sizeof(float)));
            cudaCheck(cudaMalloc(&g_mm.ws_b, g_mm.ws_b_size * sizeof(float)));
            g_mm.ones_size = B * H1 * H1;
            std::vector<float> ones(g_mm.ones_size, 1.0f);
            cudaCheck(cudaMalloc(&g_mm.ones, ones.size() * sizeof(float)));
            cudaCheck(cudaMemcpy(g_mm.ones, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
            static float* cublas_ws = nullptr;  // a fixed workspace so cuBLAS never allocates inside graph capture
            if (!cublas_ws) cudaCheck(cudaMalloc(&cublas_ws, 32u << 20));
            cublasCheck(cublasSetWorkspace(g_mm.cublas, cublas_ws, 32u << 20));
        }
    }
    if (is_matrix_opt(m->opt.optimizer)) matrix_opt_build(m);  // before any capture
    if (per_sample_on(m->opt)) per_sample_build(m);
}
static void mnist_free(Mnist* m) {
    void* ps[] = {m->params,  m->grads,  m->m1,    m->m2,       m->x,          m->act1,    m->act1_sign,
                  m->act2,    m->pooled, m->h,     m->logits,   m->y,          m->dlogits, m->dh,
                  m->dpooled, m->dact2,  m->dact1, m->counters, m->pool_codes, m->hpart};
    for (void* p : ps) mnist_free_ptr(m, p);
    for (void* p : {(void*)m->fpart, (void*)m->xb, (void*)m->yb}) if (p) mnist_free_ptr(m, p);
    matrix_opt_free(m);
    per_sample_free(m);
}
static float* param_of(const Mnist* m, int i) { return m->params + PARAMS[i].offset; }
static float* grad_of(const Mnist* m, int i) { return m->grads + PARAMS[i].offset; }

// PyTorch's default init for conv and linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias, drawn from
// splitmix64 (our own stream; the tests load PyTorch's weights instead of reproducing its generator).
static uint64_t splitmix64(uint64_t* s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rand_uniform(uint64_t* s) { return (float)(splitmix64(s) >> 40) * (1.0f / 16777216.0f); }
static void mnist_init_params(Mnist* m, uint64_t seed) {
    std::vector<float> host(m->n_params);
    uint64_t s = seed * 0x2545F4914F6CDD1Dull + 1;
    const int fan_in[8] = {9, 9, KC2, KC2, FC_IN, FC_IN, FC_H, FC_H};
    for (int i = 0; i < N_PARAM_TENSORS; i++) {
        float bound = (float)(1.0 / sqrt((double)fan_in[i]));
        for (size_t j = 0; j < PARAMS[i].numel; j++)
            host[PARAMS[i].offset + j] = bound * (2.0f * rand_uniform(&s) - 1.0f);
    }
    if (m->cpu) memcpy(m->params, host.data(), host.size() * sizeof(float));
    else cudaCheck(cudaMemcpy(m->params, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
}
// Copies between a host buffer in the internal layout and the model's buffer (device or host).
static void mnist_copy_out(const Mnist* m, const float* src, float* host_dst, size_t n) {
    if (m->cpu) memcpy(host_dst, src, n * sizeof(float));
    else cudaCheck(cudaMemcpy(host_dst, src, n * sizeof(float), cudaMemcpyDeviceToHost));
}
static void mnist_copy_in(const Mnist* m, float* dst, const float* host_src, size_t n) {
    if (m->cpu) memcpy(dst, host_src, n * sizeof(float));
    else cudaCheck(cudaMemcpy(dst, host_src, n * sizeof(float), cudaMemcpyHostToDevice));
}

// conv2 takes its specialised TF32 kernels on our GPU path with TF32 on (the default); the generic kernel otherwise,
// and always under the per-sample step and K-FAC: both need every layer's output gradient (the fast path keeps the
// max-pool's window codes instead of dact2, and no dact1)
static bool conv2_fast(const Mnist* m) {
    return !m->cpu && g_run.backend == BACKEND_OURS && g_run.tf32 && !per_sample_on(m->opt) &&
           m->opt.optimizer != OPT_KFAC;
}

// forward: x (B,28,28) normalized -> logits (B,10); on the fast path up to fc1's split-K partial sums (sm_90) or
// h, the rest comes from mnist_loss's head. gather (fast path only): conv2's forward kernel loads the batch from the
// dataset itself (ConvInput) and writes x and y, instead of reading x.
static void mnist_forward(Mnist* m, int B, const ConvInput* gather = nullptr) {
    // conv1 inside conv2's kernel, the pooling (and its window codes) in its epilogue, act2 not stored
    if (conv2_fast(m)) {
        ConvInput in;
        if (gather) { in = *gather; in.x_out = m->x; in.y_out = m->y; }
        else in.x = m->x;
        conv2_forward_tf32(nullptr, m->pooled, m->pool_codes, m->act1, m->act1_sign, in, param_of(m, P_W1),
                           param_of(m, P_B1), param_of(m, P_W2), param_of(m, P_B2), B);
        if (g_run.fc1_cluster) {
            launch_pdl(fc1_forward_kernel, dim3(FC1F_SPLITS, ceil_div(B, 64)), 256, FC1F_SMEM, FC1F_CLUSTER, m->hpart,
                       m->pooled, param_of(m, P_WF1), B);
            return;  // the head adds the partial sums, bias and ReLU, and does fc2
        }
    } else {
        Epilogue e1; e1.bias = param_of(m, P_B1); e1.relu = 1;
        matmul_forward(m->act1, C1, {V_CONV1_IN, m->x, 0}, {V_COL, param_of(m, P_W1), K1}, B * H1 * H1, C1, K1, e1);
        Epilogue e2; e2.bias = param_of(m, P_B2); e2.relu = 1;
        matmul_forward(m->act2, C2, {V_CONV2_IN, m->act1, 0}, {V_COL, param_of(m, P_W2), KC2}, B * H2 * H2, C2, KC2,
                       e2);
    }
    if (m->cpu) {
        for (int b = 0; b < B; b++)
            for (int py = 0; py < HP; py++)
                for (int px = 0; px < HP; px++)
                    for (int c = 0; c < C2; c++) {
                        const float* base = m->act2 + (((size_t)b * H2 + 2 * py) * H2 + 2 * px) * C2 + c;
                        m->pooled[(((size_t)b * HP + py) * HP + px) * C2 + c] =
                            fmaxf(fmaxf(base[0], base[C2]), fmaxf(base[H2 * C2], base[H2 * C2 + C2]));
                    }
    } else if (!conv2_fast(m)) {
        maxpool_forward_kernel<<<ceil_div(B * FC_IN, 256), 256, 0, g_mm.stream>>>(m->pooled, m->act2, B);
        launch_check();
    }
    Epilogue e3; e3.bias = param_of(m, P_BF1); e3.relu = 1;
    matmul_forward(m->h, FC_H, {V_ROW, m->pooled, FC_IN}, {V_COL, param_of(m, P_WF1), FC_IN}, B, FC_H, FC_IN, e3);
    if (conv2_fast(m)) return;  // fc2 is part of the fused head in mnist_loss
    Epilogue e4; e4.bias = param_of(m, P_BF2);
    matmul_forward(m->logits, NCLS, {V_ROW, m->h, FC_H}, {V_COL, param_of(m, P_WF2), FC_H}, B, NCLS, FC_H, e4);
}

// fused log-softmax + NLL: losses[offset + b], preds[offset + b] (either may be null), dlogits (null: no gradient)
static void mnist_loss(Mnist* m, int B, float* losses, int* preds, const int* counters, int offset, bool grad) {
    if (m->cpu) {
        int off = counters ? counters[1] : offset;
        for (int b = 0; b < B; b++) {
            const float* l = m->logits + b * NCLS;
            float mx = l[0]; int arg = 0;
            for (int j = 1; j < NCLS; j++) if (l[j] > mx) { mx = l[j]; arg = j; }
            float sum = 0.0f;
            for (int j = 0; j < NCLS; j++) sum += expf(l[j] - mx);
            int label = m->y[b];
            if (losses) losses[off + b] = -(l[label] - mx - logf(sum));
            if (preds) preds[off + b] = arg;
            if (grad)
                for (int j = 0; j < NCLS; j++)
                    m->dlogits[b * NCLS + j] = (expf(l[j] - mx) / sum - (j == label ? 1.0f : 0.0f)) / (float)B;
        }
        return;
    }
    if (conv2_fast(m)) {
        auto head = g_run.fc1_cluster ? head_kernel<FC1F_PARTS> : head_kernel<0>;
        launch_pdl(head, ceil_div(B, 8), 256, 0, 1, m->logits, grad ? m->dlogits : nullptr, m->dh, losses, preds, m->h,
                   m->hpart, param_of(m, P_BF1), param_of(m, P_WF2), param_of(m, P_BF2), m->y, counters, offset, B);
        return;
    }
    softmax_xent_kernel<<<ceil_div(B, 8), 256, 0, g_mm.stream>>>(grad ? m->dlogits : nullptr, losses, preds, m->logits,
                                                                 m->y, counters, offset, B);
    launch_check();
}

// forward + loss: mnist_forward then mnist_loss, or on the fast path (sm_90, a batch of at most FUSED_MAX_B within the
// training batch the model was built for, the GPU holding the fused grid at once) the fused forward, one launch:
// conv1, conv2, the pooling, fc1 and the head (FwdHead), bit-identical to the three launches. g_run.fused_forward =
// false (the tests) keeps the three launches.
static bool mnist_fused_forward(const Mnist* m, int B) {
    return conv2_fast(m) && g_run.fc1_cluster && g_run.fused_forward && g_run.fused_forward_fits &&
           B <= std::min(m->B, FUSED_MAX_B);
}
static void mnist_forward_loss(Mnist* m, int B, const ConvInput* gather, float* losses, int* preds, const int* counters,
                               int offset, bool grad) {
    if (!mnist_fused_forward(m, B)) {
        mnist_forward(m, B, gather);
        mnist_loss(m, B, losses, preds, counters, offset, grad);
        return;
    }
    ConvInput in;
    if (gather) { in = *gather; in.x_out = m->x; in.y_out = m->y; }
    else in.x = m->x;
    FwdHead fh;
    fh.wf1 = param_of(m, P_WF1); fh.bf1 = param_of(m, P_BF1); fh.wf2 = param_of(m, P_WF2); fh.bf2 = param_of(m, P_BF2);
    fh.part = m->fpart; fh.h = m->h; fh.logits = m->logits; fh.dlogits = grad ? m->dlogits : nullptr; fh.dh = m->dh;
    fh.losses = losses; fh.preds = preds; fh.y = m->y; fh.counters = counters; fh.offset = offset;
    conv2_forward_tf32(nullptr, m->pooled, m->pool_codes, m->act1, m->act1_sign, in, param_of(m, P_W1),
                       param_of(m, P_B1), param_of(m, P_W2), param_of(m, P_B2), B, fh);
}

// dact2 = the max-pool's backward of dpooled (the gradient to the argmax of each window), on the GPU or the CPU
static void maxpool_backward(Mnist* m, int B) {
    if (m->cpu) {
        for (int b = 0; b < B; b++)
            for (int y = 0; y < H2; y++)
                for (int x = 0; x < H2; x++)
                    for (int c = 0; c < C2; c++)
                        m->dact2[(((size_t)b * H2 + y) * H2 + x) * C2 + c] =
                            maxpool_backward_elem(m->dpooled, m->act2, b, y, x, c);
    } else {
        maxpool_backward_kernel<<<ceil_div(B * H2 * H2 * C2, 256), 256, 0, g_mm.stream>>>(m->dact2, m->dpooled, m->act2,
                                                                                          B);
        launch_check();
    }
}

// backward from dlogits (and, on the fast path, dh from the head): every parameter gradient, each written in full.
// With update_advance_B >= 0 on the fast path, the backward's kernels apply the optimizer step to every parameter
// instead of storing the gradients (fc1.weight in fc1_backward_kernel, the rest in conv2_wgrad_tf32_kernel's split
// reduction) and advance the counters by update_advance_B: mnist_update and mnist_advance in the same launches (not
// called then).
static void mnist_backward(Mnist* m, int B, int update_advance_B = -1, const BatchPrefetch& pf = BatchPrefetch()) {
    Epilogue e;
    if (conv2_fast(m)) {  // dh came out of the fused head
        const bool fuse = update_advance_B >= 0;
        Fc1BackwardArgs a;
        a.dpooled = m->dpooled; a.wf1 = param_of(m, P_WF1); a.gwf1 = grad_of(m, P_WF1);
        a.gbf1 = grad_of(m, P_BF1); a.gwf2 = grad_of(m, P_WF2); a.gbf2 = grad_of(m, P_BF2);
        a.dh = m->dh; a.pooled = m->pooled; a.dlogits = m->dlogits; a.h = m->h; a.counters = m->counters;
        a.B = B; a.advance_pos = fuse ? update_advance_B : -1;
        fc1_backward(a);
        // the input gradient first: the weight-gradient kernel after it adds up both kernels' partial sums (and its
        // bands, which need only dpooled, overlap the input gradient's last blocks); fused with SGD, its idle warp
        // applies fc1.weight's optimizer step (98% of the parameters). AdamW's step (a square root and a division per
        // element) is too slow for one warp per SM (measured on the H100: 2 epochs at batch 128 took 212 ms instead of
        // ~130): optimizer_kernel does it, launched here, before the weight-gradient kernel advances the step counter.
        Fc1Step f;
        if (fuse && m->opt.optimizer == OPT_SGD) {
            f.p = param_of(m, P_WF1); f.g = grad_of(m, P_WF1); f.m1 = m->m1 + PARAMS[P_WF1].offset;
            f.counters = m->counters; f.c = m->opt;
        } else if (fuse) {
            const size_t n = PARAMS[P_WF1].numel, off = PARAMS[P_WF1].offset;
            launch_pdl(optimizer_kernel, (unsigned)((n / 4 + 1 + 255) / 256), 256, 0, 1, param_of(m, P_WF1),
                       (const float*)grad_of(m, P_WF1), m->m1 + off, m->m2 + off, n, m->opt, m->counters, -1);
        }
        SplitsJob jd = conv2_dgrad_tf32(nullptr, grad_of(m, P_W1), grad_of(m, P_B1), m->dpooled, m->pool_codes,
                                        m->act1_sign, m->x, B, f);  // + conv1's dW, db
        if (!fuse) {
            conv2_wgrad_tf32(grad_of(m, P_W2), grad_of(m, P_B2), m->dpooled, m->pool_codes, m->act1, B, jd);
            return;
        }
        // conv2's and conv1's gradients (contiguous in the flat buffers: weight then bias) straight into their
        // optimizer step, and the small gradients fc1_backward_kernel stored (fc1.bias, fc2.weight, fc2.bias: the end
        // of the flat buffer) through the same reduction as a 1-way "split"
        jd.update_off = (int)PARAMS[P_W1].offset;
        SplitsJob jr;
        jr.src = grad_of(m, P_BF1); jr.stride = 0; jr.splits = 1; jr.n = (int)(m->n_params - PARAMS[P_BF1].offset);
        jr.update_off = (int)PARAMS[P_BF1].offset;
        OptTarget t;
        // the step counter advances after the barrier of the weight-gradient kernel (every block has read it), the
        // batch position in fc1_backward_kernel (a.advance_pos), three launches before the next step's forward reads it
        t.params = m->params; t.m1 = m->m1; t.m2 = m->m2; t.counters = m->counters; t.advance_B = 0; t.c = m->opt;
        conv2_wgrad_tf32(grad_of(m, P_W2), grad_of(m, P_B2), m->dpooled, m->pool_codes, m->act1, B, jd, jr, t,
                         (int)PARAMS[P_W2].offset, pf);
        return;
    }
    e = Epilogue(); e.rowsum = grad_of(m, P_BF2);
    matmul_forward(grad_of(m, P_WF2), FC_H, {V_COL, m->dlogits, NCLS}, {V_ROW, m->h, FC_H}, NCLS, FC_H, B, e);
    e = Epilogue(); e.mask = m->h;
    matmul_forward(m->dh, FC_H, {V_ROW, m->dlogits, NCLS}, {V_ROW, param_of(m, P_WF2), FC_H}, B, FC_H, NCLS, e);
    e = Epilogue(); e.rowsum = grad_of(m, P_BF1);
    matmul_forward(grad_of(m, P_WF1), FC_IN, {V_COL, m->dh, FC_H}, {V_ROW, m->pooled, FC_IN}, FC_H, FC_IN, B, e);
    e = Epilogue();
    matmul_forward(m->dpooled, FC_IN, {V_ROW, m->dh, FC_H}, {V_ROW, param_of(m, P_WF1), FC_IN}, B, FC_IN, FC_H, e);
    maxpool_backward(m, B);
    e = Epilogue(); e.rowsum = grad_of(m, P_B2);
    matmul_forward(grad_of(m, P_W2), KC2, {V_COL, m->dact2, C2}, {V_CONV2_IN, m->act1, 0}, C2, KC2, B * H2 * H2, e);
    e = Epilogue(); e.mask = m->act1;
    matmul_forward(m->dact1, C1, {V_CONV2_DOUT, m->dact2, 0}, {V_CONV2_WT, param_of(m, P_W2), 0}, B * H1 * H1, C1,
                   9 * C2, e);
    e = Epilogue(); e.rowsum = grad_of(m, P_B1);
    matmul_forward(grad_of(m, P_W1), K1, {V_COL, m->dact1, C1}, {V_CONV1_IN, m->x, 0}, C1, K1, B * H1 * H1, e);
}

// The optimizer step of every parameter; advance_B >= 0: then also mnist_advance(m, advance_B), in the same launch on
// the GPU.
static void mnist_advance(Mnist* m, int B);
static void mnist_update(Mnist* m, int advance_B = -1) {
    if (m->cpu) {
        const OptStep st = opt_step(m->opt, m->counters[0]);
        for (size_t i = 0; i < m->n_params; i++)
            opt_update_elem(m->opt, st, &m->params[i], m->grads[i], &m->m1[i], &m->m2[i]);
        if (advance_B >= 0) mnist_advance(m, advance_B);
        return;
    }
    size_t threads = m->n_params / 4 + 1;  // the last thread does the n % 4 tail
    launch_pdl(optimizer_kernel, (unsigned)((threads + 255) / 256), 256, 0, 1, m->params, m->grads, m->m1, m->m2,
               m->n_params, m->opt, m->counters, advance_B);
}
static void mnist_advance(Mnist* m, int B) {
    if (m->cpu) { m->counters[0] += 1; m->counters[1] += B; return; }
    launch_pdl(advance_counters_kernel, 1, 1, 0, 1, m->counters, B);
}
static void matrix_opt_set_step(Mnist* m, int step);
static void mnist_set_counters(Mnist* m, int step, int offset) {
    int c[2] = {step, offset};
    if (m->cpu) memcpy(m->counters, c, sizeof(c));
    else cudaCheck(cudaMemcpyAsync(m->counters, c, sizeof(c), cudaMemcpyHostToDevice, g_mm.stream));
    matrix_opt_set_step(m, step);
}

// ----------------------------------------------------------------------------------------------------------------
// the matrix optimizers: Muon, Shampoo and K-FAC (issue 21), on the CPU and the GPU through the same code
// Each weight is a matrix rows x cols in PyTorch's layout (a convolution's out x in*3*3); the optimizers work on a
// PyTorch-layout copy of it (torch_index maps PyTorch's flat index to the internal one), so that the blocks and
// factors are PyTorch's (dev/mnist_optimizers.py). K-FAC's matrix is the weight with its bias as one more column
// (aug_index). Otherwise the biases take AdamW (Muon) or the graft's optimizer (Shampoo): opt_update_elem, as
// --optimizer adamw / sgd. Every product runs on matmul_forward (our kernel, cuBLAS or the CPU, as the network's);
// the elementwise steps are functors run by mo_each on either side; the inverse roots (Shampoo's p = 4, K-FAC's
// inverse p = 1) are coupled Newton iterations, fp32 on the GPU and float64 on the CPU.
constexpr int N_MATRICES = 4;
static const int MATRIX_PARAMS[N_MATRICES] = {P_W1, P_W2, P_WF1, P_WF2};
static const int BIAS_PARAMS[4] = {P_B1, P_B2, P_BF1, P_BF2};
static int matrix_rows(int p) { return PARAMS[p].shape[0]; }
static int matrix_cols(int p) { return (int)(PARAMS[p].numel / PARAMS[p].shape[0]); }
static int matrix_aug_cols(int opt, int p) { return matrix_cols(p) + (opt == OPT_KFAC ? 1 : 0); }  // K-FAC: + bias

// One Shampoo block: rows r0.. and cols c0.. of matrix mat (dimensions above max_precond_dim split into blocks of
// max_precond_dim, the last one smaller, as distributed_shampoo blocks a tensor); L = sum G G^T (rows x rows),
// R = sum G^T G (cols x cols), running sums (distributed_shampoo's default beta2 = 1); Linv, Rinv their inverse 4th
// roots, recomputed every precond_every steps; has_root: the roots were computed (else the block takes the graft's
// step).
// K-FAC's blocks are the same (r0, c0) tiles of the matrix with its bias column; their L, Linv and R, Rinv point
// into the shared factors of their row chunk (G) and column chunk (A): KfacFactor.
struct PrecondBlock {
    int mat = 0, r0 = 0, c0 = 0, rows = 0, cols = 0;
    float *L = nullptr, *R = nullptr, *Linv = nullptr, *Rinv = nullptr;
    int has_root = 0;
    int fl = -1, fr = -1;  // K-FAC: the indices of its G and A factors
};
// One diagonal block of a K-FAC factor: G (side 0, the output gradients' rows i0 .. i0 + n) or A (side 1, the
// inputs' columns i0 .., the bias's 1 last); F the running average, Finv its damped inverse, has_inv: Finv computed.
struct KfacFactor {
    int mat = 0, side = 0, i0 = 0, n = 0;
    float *F = nullptr, *Finv = nullptr;
    int has_inv = 0;
};
// The fp32 Newton iteration's scratch: 6 n x n matrices, a scalar, mo_sumsq's scratch (one per stream)
struct RootWork { std::vector<float*> newton; float* scalar = nullptr; float* sum_scratch = nullptr; };
// --precond_delay D > 0: the roots due at step s are computed from the factors of step s into `roots` (on the GPU
// from a snapshot, on a second stream by a host thread: precond_roots_start) and replace the live ones at step
// s + D (switch_step); until then every step uses the previous roots. One entry per root (precond_root_jobs).
struct PrecondPending {
    int switch_step = -1;             // -1: nothing pending
    std::vector<float*> snap, roots;  // per root: the factor's snapshot (GPU), the new root
    std::vector<int> ok;              // per root: computed (else the live root stays, as in the synchronous case)
    bool gpu_ready = false;           // the second stream and its workspace exist
    cudaStream_t stream = nullptr;
    cudaEvent_t ev_snap = nullptr, ev_done = nullptr;
    cublasHandle_t cublas = nullptr;
    float *ws_partial = nullptr, *ws_rowsum = nullptr;
    RootWork work;
    std::thread th;
};
struct MatrixOpt {
    int step = 0;  // updates done (counters[0], mirrored on the host: the root schedule is a host decision)
    int optimizer = 0, max_dim = 0;  // what the buffers were built for
    int* torch_index[N_MATRICES] = {};  // [j] = internal flat index (within the parameter) of PyTorch's element j
    int* aug_index[N_MATRICES] = {};    // K-FAC: the same over rows x (cols + 1), the bias's elements last
    float *gt[N_MATRICES] = {}, *ut[N_MATRICES] = {}, *dt[N_MATRICES] = {}, *st[N_MATRICES] = {};
    float *s_a = nullptr, *s_b = nullptr, *s_c = nullptr, *s_y = nullptr;  // scratch (products)
    float* acts = nullptr;     // K-FAC: a layer's inputs (samples x (in + 1)), im2col patches for a convolution
    float* scalars = nullptr;  // norms and sums of squares, device or host
    float* sum_scratch = nullptr;  // mo_sumsq's scratch (the main stream's)
    std::vector<PrecondBlock> blocks;
    std::vector<KfacFactor> factors;  // K-FAC
    int kfac_seen = 0;                // K-FAC: the factors hold statistics (the first step's replace them)
    RootWork work;                    // the fp32 Newton iteration's scratch (the main stream's)
    PrecondPending pend;              // --precond_delay's roots in flight
    int root_failures = 0;
};

template <class F> __global__ void mo_each_kernel(F f, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) f(i);
}
// f(i) for i < n: a loop on the CPU, a kernel on the GPU (f's pointers on the model's side)
template <class F> static void mo_each(const Mnist* m, size_t n, F f) {
    if (m->cpu) { for (size_t i = 0; i < n; i++) f(i); return; }
    if (!n) return;
    mo_each_kernel<<<(unsigned)((n + 255) / 256), 256, 0, g_mm.stream>>>(f, n);
    launch_check();
}
// out[0] = sum of squares of a rows x cols matrix (row stride ld), of A - I with minus_identity (the Newton
// residual, without storing it). Block b sums rows b, b + grid, ...; the last block to finish (a ticket, reset by
// it) adds the blocks' sums. Every order is fixed by the shape alone, so the result is deterministic. (One block
// over the whole matrix, as before, took a single SM for 1024^2 elements: about 0.3 ms per Newton step.)
constexpr int SUMSQ_THREADS = 256, SUMSQ_MAX_BLOCKS = 128;
__device__ __forceinline__ float block_sum_256(float* part, float s) {  // every thread gets the block's sum
    part[threadIdx.x] = s;
    __syncthreads();
    for (int h = SUMSQ_THREADS / 2; h > 0; h /= 2) {
        if ((int)threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    const float total = part[0];
    __syncthreads();
    return total;
}
__global__ void __launch_bounds__(SUMSQ_THREADS) mo_sumsq_kernel(float* out, float* block_sums, unsigned* ticket,
                                                                  const float* p, int rows, int cols, int ld,
                                                                  int minus_identity) {
    __shared__ float part[SUMSQ_THREADS];
    __shared__ bool last;
    float s = 0.0f;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = p + (size_t)r * ld;
        for (int c = threadIdx.x; c < cols; c += SUMSQ_THREADS) {
            const float v = row[c] - (minus_identity && c == r ? 1.0f : 0.0f);
            s = fmaf(v, v, s);
        }
    }
    s = block_sum_256(part, s);
    if (threadIdx.x == 0) {
        block_sums[blockIdx.x] = s;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float v = (int)threadIdx.x < (int)gridDim.x ? __ldcg(block_sums + threadIdx.x) : 0.0f;
    s = block_sum_256(part, v);
    if (threadIdx.x == 0) { out[0] = s; *ticket = 0; }
}
// scratch: SUMSQ_MAX_BLOCKS + 1 floats of the caller's stream (the blocks' sums, the ticket last), zero at first
static void mo_sumsq(const Mnist* m, float* out, const float* p, int rows, int cols, int ld, float* scratch,
                     bool minus_identity = false) {
    if (m->cpu) {
        double s = 0;
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                const float v = p[(size_t)r * ld + c] - (minus_identity && c == r ? 1.0f : 0.0f);
                s += (double)v * v;
            }
        *out = (float)s;
        return;
    }
    static_assert(SUMSQ_MAX_BLOCKS <= SUMSQ_THREADS, "the last block adds one block sum per thread");
    const int blocks = std::max(1, std::min(rows, SUMSQ_MAX_BLOCKS));
    mo_sumsq_kernel<<<blocks, SUMSQ_THREADS, 0, g_mm.stream>>>(out, scratch, (unsigned*)(scratch + SUMSQ_MAX_BLOCKS),
                                                               p, rows, cols, ld, minus_identity ? 1 : 0);
    launch_check();
}
static float mo_read_scalar(const Mnist* m, const float* p) {
    if (m->cpu) return *p;
    float v;
    cudaCheck(cudaMemcpyAsync(&v, p, 4, cudaMemcpyDeviceToHost, g_mm.stream));
    cudaCheck(cudaStreamSynchronize(g_mm.stream));
    return v;
}

// The blocks of every matrix for max_dim (rows and cols each split into chunks of at most max_dim); K-FAC's matrices
// have the bias column, and each block names its factors (kfac_factors' order: per matrix G's chunks, then A's).
static std::vector<PrecondBlock> shampoo_blocks(int max_dim, int opt = OPT_SHAMPOO) {
    std::vector<PrecondBlock> out;
    int first = 0;  // K-FAC: the matrix's first factor
    for (int k = 0; k < N_MATRICES; k++) {
        const int rows = matrix_rows(MATRIX_PARAMS[k]), cols = matrix_aug_cols(opt, MATRIX_PARAMS[k]);
        const int nr = ceil_div(rows, max_dim), nc = ceil_div(cols, max_dim);
        for (int r0 = 0; r0 < rows; r0 += max_dim)
            for (int c0 = 0; c0 < cols; c0 += max_dim) {
                PrecondBlock b;
                b.mat = k; b.r0 = r0; b.c0 = c0;
                b.rows = std::min(max_dim, rows - r0); b.cols = std::min(max_dim, cols - c0);
                if (opt == OPT_KFAC) { b.fl = first + r0 / max_dim; b.fr = first + nr + c0 / max_dim; }
                out.push_back(b);
            }
        first += nr + nc;
    }
    return out;
}
// K-FAC's factor blocks: per matrix the chunks of G (its rows) then of A (its columns with the bias's)
static std::vector<KfacFactor> kfac_factors(int max_dim) {
    std::vector<KfacFactor> out;
    for (int k = 0; k < N_MATRICES; k++)
        for (int side = 0; side < 2; side++) {
            const int dim = side ? matrix_aug_cols(OPT_KFAC, MATRIX_PARAMS[k]) : matrix_rows(MATRIX_PARAMS[k]);
            for (int i0 = 0; i0 < dim; i0 += max_dim) {
                KfacFactor f;
                f.mat = k; f.side = side; f.i0 = i0; f.n = std::min(max_dim, dim - i0);
                out.push_back(f);
            }
        }
    return out;
}

// A layer's input rows for K-FAC's A (the samples, or for a convolution every sample's output positions)
static int kfac_input_rows(int k, int B) { return k == 0 ? B * H1 * H1 : k == 1 ? B * H2 * H2 : B; }
static int* mo_upload_index(const Mnist* m, const std::vector<int>& idx) {
    int* d = (int*)mnist_alloc(m, idx.size());
    if (m->cpu) memcpy(d, idx.data(), idx.size() * 4);
    else cudaCheck(cudaMemcpy(d, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
    return d;
}
// Allocates the buffers of m->opt's optimizer (Shampoo's and K-FAC's blocks for its max_precond_dim), all zero.
static void matrix_opt_build(Mnist* m) {
    matrix_opt_free(m);
    MatrixOpt* mo = new MatrixOpt();
    m->mo = mo;
    const int opt = m->opt.optimizer;
    mo->optimizer = opt;
    size_t most = 0, sq = 1;
    for (int k = 0; k < N_MATRICES; k++) {
        const int p = MATRIX_PARAMS[k], rows = matrix_rows(p), cols = matrix_cols(p);
        const size_t n = PARAMS[p].numel, na = (size_t)rows * matrix_aug_cols(opt, p);
        most = std::max(most, na);
        std::vector<float> torch_pos(n), internal(n);
        for (size_t j = 0; j < n; j++) torch_pos[j] = (float)j;  // exact: n < 2^24
        param_from_torch(p, torch_pos.data(), internal.data());
        std::vector<int> idx(n);
        for (size_t i = 0; i < n; i++) idx[(size_t)internal[i]] = (int)i;
        mo->torch_index[k] = mo_upload_index(m, idx);
        if (opt == OPT_KFAC) {  // the bias follows its weight in the flat buffer: element r at n + r
            std::vector<int> aug(na);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c <= cols; c++)
                    aug[(size_t)r * (cols + 1) + c] = c < cols ? idx[(size_t)r * cols + c] : (int)n + r;
            mo->aug_index[k] = mo_upload_index(m, aug);
        }
        mo->gt[k] = mnist_alloc(m, na); mo->ut[k] = mnist_alloc(m, na);
        mo->dt[k] = mnist_alloc(m, na); mo->st[k] = mnist_alloc(m, na);
        const size_t r = std::min(rows, cols);
        sq = std::max(sq, r * r);
    }
    if (opt == OPT_SHAMPOO || opt == OPT_KFAC) {
        mo->max_dim = m->opt.max_precond_dim;
        mo->blocks = shampoo_blocks(mo->max_dim, opt);
        size_t nn = 1;
        if (opt == OPT_SHAMPOO)
            for (PrecondBlock& b : mo->blocks) {
                b.L = mnist_alloc(m, (size_t)b.rows * b.rows); b.Linv = mnist_alloc(m, (size_t)b.rows * b.rows);
                b.R = mnist_alloc(m, (size_t)b.cols * b.cols); b.Rinv = mnist_alloc(m, (size_t)b.cols * b.cols);
                nn = std::max({nn, (size_t)b.rows * b.rows, (size_t)b.cols * b.cols});
            }
        if (opt == OPT_KFAC) {
            mo->factors = kfac_factors(mo->max_dim);
            for (KfacFactor& f : mo->factors) {
                f.F = mnist_alloc(m, (size_t)f.n * f.n); f.Finv = mnist_alloc(m, (size_t)f.n * f.n);
                nn = std::max(nn, (size_t)f.n * f.n);
            }
            for (PrecondBlock& b : mo->blocks) {
                b.L = mo->factors[b.fl].F; b.Linv = mo->factors[b.fl].Finv;
                b.R = mo->factors[b.fr].F; b.Rinv = mo->factors[b.fr].Finv;
            }
            size_t acts = 0;
            for (int k = 0; k < N_MATRICES; k++)
                acts = std::max(acts, (size_t)kfac_input_rows(k, m->B) * matrix_aug_cols(opt, MATRIX_PARAMS[k]));
            mo->acts = mnist_alloc(m, acts);
        }
        sq = std::max(sq, nn);
        for (int i = 0; i < 6; i++) mo->work.newton.push_back(mnist_alloc(m, nn));
    }
    mo->s_a = mnist_alloc(m, sq); mo->s_b = mnist_alloc(m, sq); mo->s_c = mnist_alloc(m, sq);
    mo->s_y = mnist_alloc(m, most);
    mo->scalars = mnist_alloc(m, 4 * (mo->blocks.size() + 1));
    mo->sum_scratch = mnist_alloc(m, SUMSQ_MAX_BLOCKS + 1);
    mo->work.scalar = mo->scalars; mo->work.sum_scratch = mo->sum_scratch;
}
static void precond_pending_free(Mnist* m);
static void matrix_opt_free(Mnist* m) {
    MatrixOpt* mo = m->mo;
    if (!mo) return;
    precond_pending_free(m);
    for (int k = 0; k < N_MATRICES; k++)
        for (void* p : {(void*)mo->torch_index[k], (void*)mo->gt[k], (void*)mo->ut[k], (void*)mo->dt[k],
                        (void*)mo->st[k]})
            mnist_free_ptr(m, p);
    for (int* p : mo->aug_index) if (p) mnist_free_ptr(m, p);
    if (mo->optimizer == OPT_SHAMPOO)
        for (PrecondBlock& b : mo->blocks)
            for (float* p : {b.L, b.R, b.Linv, b.Rinv}) mnist_free_ptr(m, p);
    for (KfacFactor& f : mo->factors) { mnist_free_ptr(m, f.F); mnist_free_ptr(m, f.Finv); }
    for (float* p : mo->work.newton) mnist_free_ptr(m, p);
    for (float* p : {mo->s_a, mo->s_b, mo->s_c, mo->s_y, mo->scalars, mo->sum_scratch}) mnist_free_ptr(m, p);
    if (mo->acts) mnist_free_ptr(m, mo->acts);
    delete mo;
    m->mo = nullptr;
}
// The buffers for m->opt, fresh: built when missing or built for another optimizer or block size.
static void matrix_opt_ensure(Mnist* m) {
    const bool blocked = m->opt.optimizer == OPT_SHAMPOO || m->opt.optimizer == OPT_KFAC;
    if (!m->mo || m->mo->optimizer != m->opt.optimizer || (blocked && m->mo->max_dim != m->opt.max_precond_dim))
        matrix_opt_build(m);
}

// ---- Muon: torch.optim.Muon (PyTorch 2.11) for the weight matrices -------------------------------------------------
// B = lerp(B, G, 1 - mu) (an EMA of the gradient), U = lerp(G, B, mu) with nesterov else B, X = U / max(||U||_F, 1e-7),
// ns_steps of X <- a X + (b A + c A^2) X with A = X X^T (X^T X and X B^T for a tall matrix, torch's transpose),
// (a, b, c) = (3.4445, -4.7750, 2.0315); W <- W (1 - lr wd) - lr sqrt(max(1, rows / cols)) X. lr = muon_lr times the
// schedule's factor (lr_at / lr). PyTorch runs the iteration in bf16; here every product is matmul_forward's: strict
// fp32 on the CPU and with --tf32 0, TF32 tensor cores with --tf32 1 (the training default). TF32 keeps 3 more
// mantissa bits than bf16 and the iteration is built to tolerate bf16 (it only has to push the singular values into
// about [0.7, 1.2]), so TF32 loses nothing Muon needs; fp32 makes the GPU comparable with the CPU and PyTorch.
constexpr float MUON_A = 3.4445f, MUON_B = -4.7750f, MUON_C = 2.0315f, MUON_EPS = 1e-7f;
struct MuonMomentum {  // over PyTorch's index j of one matrix
    const int* idx; const float* g; float* buf; float* x; float w, mu; int nesterov;
    __host__ __device__ void operator()(size_t j) const {
        const int i = idx[j];
        const float gi = g[i];
        const float b = buf[i] + w * (gi - buf[i]);  // torch.lerp, weight w = 1 - mu < 0.5
        buf[i] = b;
        x[j] = nesterov ? b - (b - gi) * (1.0f - mu) : b;  // torch.lerp(g, b, mu), weight >= 0.5
    }
};
struct MuonNormalize {
    float* x; const float* sumsq;
    __host__ __device__ void operator()(size_t j) const { x[j] = x[j] / fmaxf(sqrtf(sumsq[0]), MUON_EPS); }
};
struct MuonPoly {  // B = b A + c A^2 (A2 holds A^2 and gets B)
    const float* a; float* a2;
    __host__ __device__ void operator()(size_t k) const { a2[k] = MUON_B * a[k] + MUON_C * a2[k]; }
};
struct MuonAxpy {  // X = a X + Y
    float* x; const float* y;
    __host__ __device__ void operator()(size_t j) const { x[j] = MUON_A * x[j] + y[j]; }
};
struct MuonApply {
    const int* idx; const float* x; float* w; const int* counters; OptConfig c; float ratio;
    __host__ __device__ void operator()(size_t j) const {
        const float lr = c.muon_lr * (lr_at(c, counters[0]) / c.lr);
        const int i = idx[j];
        w[i] = w[i] * (1.0f - lr * c.weight_decay) - (lr * ratio) * x[j];
    }
};
struct BiasUpdate {  // a bias: opt_update_elem of c (SGD or AdamW)
    float *p, *m1, *m2; const float* g; const int* counters; OptConfig c;
    __host__ __device__ void operator()(size_t i) const {
        opt_update_elem(c, opt_step(c, counters[0]), &p[i], g[i], &m1[i], &m2[i]);
    }
};
static void update_biases(Mnist* m, int optimizer) {
    OptConfig c = m->opt;
    c.optimizer = optimizer;
    for (int p : BIAS_PARAMS) {
        const size_t o = PARAMS[p].offset;
        mo_each(m, PARAMS[p].numel, BiasUpdate{m->params + o, m->m1 + o, m->m2 + o, m->grads + o, m->counters, c});
    }
}

// X (rows x cols, PyTorch layout) <- the Newton-Schulz iteration of X / ||X||_F, in place (mo's scratch)
static void newton_schulz(Mnist* m, float* x, int rows, int cols, int steps) {
    MatrixOpt* mo = m->mo;
    const size_t n = (size_t)rows * cols;
    mo_sumsq(m, mo->scalars, x, rows, cols, cols, mo->sum_scratch);
    mo_each(m, n, MuonNormalize{x, mo->scalars});
    const bool wide = rows <= cols;  // A = X X^T (rows x rows); tall: A = X^T X (cols x cols), as torch's transpose
    const int r = wide ? rows : cols;
    for (int s = 0; s < steps; s++) {
        if (wide) matmul_forward(mo->s_a, r, {V_ROW, x, cols}, {V_COL, x, cols}, r, r, cols, Epilogue());
        else matmul_forward(mo->s_a, r, {V_COL, x, cols}, {V_ROW, x, cols}, r, r, rows, Epilogue());
        matmul_forward(mo->s_b, r, {V_ROW, mo->s_a, r}, {V_ROW, mo->s_a, r}, r, r, r, Epilogue());
        mo_each(m, (size_t)r * r, MuonPoly{mo->s_a, mo->s_b});
        if (wide) matmul_forward(mo->s_y, cols, {V_ROW, mo->s_b, r}, {V_ROW, x, cols}, rows, cols, rows, Epilogue());
        else matmul_forward(mo->s_y, cols, {V_ROW, x, cols}, {V_COL, mo->s_b, r}, rows, cols, cols, Epilogue());
        mo_each(m, n, MuonAxpy{x, mo->s_y});
    }
}
static void muon_update(Mnist* m) {
    MatrixOpt* mo = m->mo;
    const OptConfig& c = m->opt;
    const float w = (float)(1.0 - (double)c.muon_momentum);
    for (int k = 0; k < N_MATRICES; k++) {
        const int p = MATRIX_PARAMS[k], rows = matrix_rows(p), cols = matrix_cols(p);
        const size_t o = PARAMS[p].offset, n = PARAMS[p].numel;
        mo_each(m, n, MuonMomentum{mo->torch_index[k], m->grads + o, m->m1 + o, mo->gt[k], w, c.muon_momentum,
                                   c.nesterov});
        newton_schulz(m, mo->gt[k], rows, cols, c.ns_steps);
        const float ratio = (float)sqrt(std::max(1.0, (double)rows / cols));
        mo_each(m, n, MuonApply{mo->torch_index[k], mo->gt[k], m->params + o, m->counters, c, ratio});
    }
    update_biases(m, OPT_ADAMW);
}

// ---- Shampoo -------------------------------------------------------------------------------------------------------
// Per block of each weight matrix (PyTorch layout; G its gradient): L += G G^T, R += G^T G every step; at step s >=
// precond_start with (s - precond_start) % precond_every == 0 (after this step's statistics) the roots
// Linv = (L + e_L I)^(-1/4), Rinv = (R + e_R I)^(-1/4), e = precond_eps + precond_damping * trace / dim (damping
// relative to the factor's mean eigenvalue bounds the condition number by about dim / damping, which the fp32
// Newton iteration handles). The step is grafted (distributed_shampoo's grafting: Shampoo's direction with the
// graft's size, per block):
//   graft sgd:  D = G + wd W (SGD's direction); P = Linv D Rinv; S = P ||D||_F / ||P||_F; B = momentum B + S;
//               W -= lr B (--momentum, --weight_decay: SGD's)
//   graft adam: m, v as AdamW's (--beta1, --beta2, --eps); D = m_hat / (sqrt(v_hat) + eps) (AdamW's direction);
//               P = Linv m_hat Rinv; S = P ||D||_F / ||P||_F; W = W (1 - lr wd) - lr S
// A block without roots (before precond_start, or a failed first root) takes S = D: exactly SGD's or AdamW's step.
struct ShampooPrepare {  // over PyTorch's index j of one matrix: gt = G, ut = Shampoo's operand, dt = the graft's D
    const int* idx; const float *g, *w; float *m1, *m2, *gt, *ut, *dt; const int* counters; OptConfig c;
    __host__ __device__ void operator()(size_t j) const {
        const int i = idx[j];
        const float gi = g[i];
        gt[j] = gi;
        if (c.graft == GRAFT_SGD) {
            const float d = opt_add(gi, opt_mul(c.weight_decay, w[i]));
            ut[j] = d; dt[j] = d;
            return;
        }
        const OptStep s = opt_step(c, counters[0]);
        const float mm = fmaf(c.beta1, m1[i], opt_mul(opt_sub(1.0f, c.beta1), gi));
        const float vv = fmaf(c.beta2, m2[i], opt_mul(opt_mul(opt_sub(1.0f, c.beta2), gi), gi));
        m1[i] = mm; m2[i] = vv;
        const float mh = mm / s.bc1;
        ut[j] = mh;
        dt[j] = mh / opt_add(sqrtf(vv) / sqrtf(s.bc2), c.eps);
    }
};
struct MatAdd {  // a += b
    float* a; const float* b;
    __host__ __device__ void operator()(size_t k) const { a[k] += b[k]; }
};
struct ShampooGraft {  // over a block's elements k: S = P ||D|| / ||P||, or S = D without roots
    float* st; const float *pt, *dt; const float* sums; int ld, cols, has_root;
    __host__ __device__ void operator()(size_t k) const {
        const size_t j = (k / cols) * ld + k % cols;
        if (!has_root) { st[j] = dt[j]; return; }
        const float pn = sqrtf(sums[1]);
        st[j] = pn > 0.0f ? pt[j] * (sqrtf(sums[0]) / pn) : 0.0f;
    }
};
struct ShampooApply {
    const int* idx; const float* st; float *w, *m1; const int* counters; OptConfig c;
    __host__ __device__ void operator()(size_t j) const {
        const int i = idx[j];
        const float lr = lr_at(c, counters[0]);
        if (c.graft == GRAFT_SGD) {
            const float b = opt_add(opt_mul(c.momentum, m1[i]), st[j]);
            m1[i] = b;
            w[i] = opt_sub(w[i], opt_mul(lr, b));
        } else {
            w[i] = opt_sub(opt_mul(w[i], opt_sub(1.0f, opt_mul(lr, c.weight_decay))), opt_mul(lr, st[j]));
        }
    }
};

// The stopping rule of the coupled Newton iteration (dev/matrix_roots_NOTES.md), from r = ||M - I||_F before each
// step: 0 = take a step, 1 = done, -1 = failed (rounding pushed an eigenvalue out of the converging region).
struct NewtonRule {
    int n = 0, k = 0, final = 0;
    double prev = INFINITY;
    int decide(double r) {
        if (!(r <= 2.0 * sqrt((double)n) + 2.0)) return -1;
        if (final) return 1;
        if (k++ == 100) return r < 0.2 ? 1 : -1;
        if (r <= 1e-3 || (r < 0.2 && r > 0.5 * prev)) final = 1;  // converged, or the precision's floor
        prev = r;
        return 0;
    }
};
// The regularised factor's shift e = eps + damping * trace(A) / n.
static double root_shift(const OptConfig& c, double trace, int n) {
    return (double)c.precond_eps + (double)c.precond_damping * trace / n;
}
// out = (A + e I)^(-1/p) (p = 4: Shampoo's roots, p = 1: K-FAC's inverses) on the CPU in float64: X0 = z^(1/p) I,
// M0 = z (A + e I), z = (p + 1) / (2 ||A + e I||_F); T = ((p + 1) I - M) / p, X <- X T, M <- T^p M. false: the
// iteration failed (out unchanged).
static bool inverse_root_cpu(const OptConfig& c, float* out, const float* a, int n, int p) {
    const size_t nn = (size_t)n * n;
    std::vector<double> M(nn), X(nn, 0.0), T(nn), T2(nn), tmp(nn);
    double trace = 0, frob = 0;
    for (int i = 0; i < n; i++) trace += a[(size_t)i * n + i];
    const double e = root_shift(c, trace, n);
    for (size_t k = 0; k < nn; k++) M[k] = a[k] + (k % (n + 1) == 0 ? e : 0.0);
    for (double v : M) frob += v * v;
    if (!(frob > 0) || !std::isfinite(frob)) return false;
    const double z = (p + 1.0) / (2.0 * sqrt(frob)), xz = pow(z, 1.0 / p);
    for (size_t k = 0; k < nn; k++) { M[k] *= z; if (k % (n + 1) == 0) X[k] = xz; }
    auto mul = [n](std::vector<double>& C, const std::vector<double>& A, const std::vector<double>& B) {
        std::fill(C.begin(), C.end(), 0.0);
        for (int i = 0; i < n; i++)
            for (int k = 0; k < n; k++) {
                const double av = A[(size_t)i * n + k];
                for (int j = 0; j < n; j++) C[(size_t)i * n + j] += av * B[(size_t)k * n + j];
            }
    };
    NewtonRule rule; rule.n = n;
    for (;;) {
        double r = 0;
        for (size_t k = 0; k < nn; k++) { double d = M[k] - (k % (n + 1) == 0 ? 1.0 : 0.0); r += d * d; }
        const int act = rule.decide(sqrt(r));
        if (act < 0) return false;
        if (act > 0) break;
        for (size_t k = 0; k < nn; k++) T[k] = ((k % (n + 1) == 0 ? p + 1.0 : 0.0) - M[k]) / p;
        mul(tmp, X, T); X.swap(tmp);
        if (p == 1) { mul(T2, T, M); M.swap(T2); continue; }
        mul(T2, T, T); mul(tmp, T2, T2); mul(T2, tmp, M); M.swap(T2);
    }
    for (size_t k = 0; k < nn; k++) out[k] = (float)X[k];
    return true;
}
struct NewtonInit {  // M = z (A + e I), X = z^(1/4) I; diag gets A's diagonal first (trace)
    float *mm, *x; const float* a; int n; float e, z, xz;
    __host__ __device__ void operator()(size_t k) const {
        const bool d = k % (n + 1) == 0;
        mm[k] = z * (a[k] + (d ? e : 0.0f));
        x[k] = d ? xz : 0.0f;
    }
};
struct NewtonT {  // T = ((p + 1) I - M) / p
    float* t; const float* mm; int n; float p1, inv_p;
    __host__ __device__ void operator()(size_t k) const { t[k] = ((k % (n + 1) == 0 ? p1 : 0.0f) - mm[k]) * inv_p; }
};
struct DiagCopy {
    float* out; const float* a; int n;
    __host__ __device__ void operator()(size_t i) const { out[i] = a[i * (n + 1)]; }
};
// The same iteration in fp32 on matmul_forward (every product strict fp32: TF32 is not accurate enough for the
// coupled iteration, dev/matrix_roots_NOTES.md), one host decision per step: the GPU's roots, and on the CPU the
// tests' fp32 twin of them (g_run.cpu_roots_fp32). false: failed (out unchanged).
static bool inverse_root_fp32(Mnist* m, RootWork& w, float* out, const float* a, int n, int p) {
    float *M = w.newton[0], *X = w.newton[1], *T = w.newton[2], *T2 = w.newton[3], *tmp = w.newton[4];
    const size_t nn = (size_t)n * n;
    mo_each(m, n, DiagCopy{tmp, a, n});
    std::vector<float> diag(n);
    if (m->cpu) memcpy(diag.data(), tmp, n * 4);
    else {  // on this thread's stream (a plain cudaMemcpy would also wait for the training step's stream)
        cudaCheck(cudaMemcpyAsync(diag.data(), tmp, n * 4, cudaMemcpyDeviceToHost, g_mm.stream));
        cudaCheck(cudaStreamSynchronize(g_mm.stream));
    }
    mo_sumsq(m, w.scalar, a, n, n, n, w.sum_scratch);
    const double frob_a = mo_read_scalar(m, w.scalar);
    double trace = 0;
    for (float v : diag) trace += v;
    const double e = root_shift(m->opt, trace, n);
    // ||A + e I||_F^2 = ||A||_F^2 + 2 e trace + n e^2
    const double frob = sqrt(frob_a + 2.0 * e * trace + n * e * e);
    if (!(frob > 0) || !std::isfinite(frob)) return false;
    const double z = (p + 1.0) / (2.0 * frob);
    mo_each(m, nn, NewtonInit{M, X, a, n, (float)e, (float)z, (float)pow(z, 1.0 / p)});
    NewtonRule rule; rule.n = n;
    for (;;) {
        mo_sumsq(m, w.scalar, M, n, n, n, w.sum_scratch, true);  // ||M - I||_F^2
        const int act = rule.decide(sqrt((double)mo_read_scalar(m, w.scalar)));
        if (act < 0) return false;
        if (act > 0) break;
        mo_each(m, nn, NewtonT{T, M, n, p + 1.0f, 1.0f / p});
        matmul_forward(tmp, n, {V_ROW, X, n}, {V_ROW, T, n}, n, n, n, Epilogue()); std::swap(X, tmp);
        if (p == 1) {
            matmul_forward(T2, n, {V_ROW, T, n}, {V_ROW, M, n}, n, n, n, Epilogue()); std::swap(M, T2);
            continue;
        }
        matmul_forward(T2, n, {V_ROW, T, n}, {V_ROW, T, n}, n, n, n, Epilogue());
        matmul_forward(tmp, n, {V_ROW, T2, n}, {V_ROW, T2, n}, n, n, n, Epilogue());
        matmul_forward(T2, n, {V_ROW, tmp, n}, {V_ROW, M, n}, n, n, n, Epilogue()); std::swap(M, T2);
    }
    if (m->cpu) memcpy(out, X, nn * 4);
    else cudaCheck(cudaMemcpyAsync(out, X, nn * 4, cudaMemcpyDeviceToDevice, g_mm.stream));
    w.newton = {M, X, T, T2, tmp, w.newton[5]};  // the swapped pointers (the same six buffers)
    return true;
}
// out = (A + e I)^(-1/p) on the model's side: float64 on the CPU (unless the tests ask for the fp32 twin), fp32 on
// the GPU. false: failed (out unchanged).
static bool inverse_root(Mnist* m, RootWork& w, float* out, const float* a, int n, int p) {
    if (!m->cpu || g_run.cpu_roots_fp32) return inverse_root_fp32(m, w, out, a, n, p);
    std::vector<float> tmp((size_t)n * n);
    if (!inverse_root_cpu(m->opt, tmp.data(), a, n, p)) return false;
    memcpy(out, tmp.data(), tmp.size() * 4);
    return true;
}
// f() with every product in strict fp32 (our kernel's, and cuBLAS's math mode), for the roots
template <class F> static void strict_fp32(const Mnist* m, F f) {
    const int tf32 = g_run.tf32;
    g_run.tf32 = 0;
    if (!m->cpu && g_run.backend == BACKEND_CUBLAS) cublasCheck(cublasSetMathMode(g_mm.cublas, CUBLAS_DEFAULT_MATH));
    f();
    g_run.tf32 = tf32;
    if (!m->cpu && g_run.backend == BACKEND_CUBLAS)
        cublasCheck(cublasSetMathMode(g_mm.cublas, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
}
// The first failed root of a run, said once
static void root_failed(MatrixOpt* mo, const char* opt, const char* what, int mat, int r0, int c0, int step) {
    if (mo->root_failures++ == 0)
        fprintf(stderr, "warning: %s: the %s of %s's block at (%d, %d) failed at step %d; the block keeps its previous "
                "preconditioner (or its graft step); raise --precond_damping\n", opt, what,
                PARAMS[MATRIX_PARAMS[mat]].name, r0, c0, step);
}
// Every block's roots; a failed root keeps the block's previous one (or its graft step).
static void shampoo_roots(Mnist* m) {
    MatrixOpt* mo = m->mo;
    strict_fp32(m, [&] {
        for (PrecondBlock& b : mo->blocks) {
            bool ok = inverse_root(m, mo->work, b.Linv, b.L, b.rows, 4);
            ok = inverse_root(m, mo->work, b.Rinv, b.R, b.cols, 4) && ok;
            if (ok) b.has_root = 1;
            else root_failed(mo, "shampoo", "inverse root", b.mat, b.r0, b.c0, mo->step);
        }
    });
}
static bool shampoo_root_due(const OptConfig& c, int step) {
    return step >= c.precond_start && (step - c.precond_start) % c.precond_every == 0;
}
// The index map of matrix k (PyTorch's index j -> internal) and its elements: K-FAC's with the bias column
static const int* precond_index(const MatrixOpt* mo, int k) {
    return mo->optimizer == OPT_KFAC ? mo->aug_index[k] : mo->torch_index[k];
}
static size_t precond_numel(const MatrixOpt* mo, int k) {
    const int p = MATRIX_PARAMS[k];
    return (size_t)matrix_rows(p) * matrix_aug_cols(mo->optimizer, p);
}
// gt = G, ut = the preconditioner's operand, dt = the graft's direction D of every matrix (ShampooPrepare)
static void precond_prepare(Mnist* m) {
    MatrixOpt* mo = m->mo;
    for (int k = 0; k < N_MATRICES; k++) {
        const size_t o = PARAMS[MATRIX_PARAMS[k]].offset;
        mo_each(m, precond_numel(mo, k), ShampooPrepare{precond_index(mo, k), m->grads + o, m->params + o, m->m1 + o,
                                                        m->m2 + o, mo->gt[k], mo->ut[k], mo->dt[k], m->counters,
                                                        m->opt});
    }
}
// The grafted direction S of every block (P = Linv U Rinv with ||D||'s size, or D without roots), then the step of
// every element (ShampooApply)
static void precond_graft_apply(Mnist* m) {
    MatrixOpt* mo = m->mo;
    for (size_t bi = 0; bi < mo->blocks.size(); bi++) {
        const PrecondBlock& b = mo->blocks[bi];
        const int cols = matrix_aug_cols(mo->optimizer, MATRIX_PARAMS[b.mat]);
        const size_t off = (size_t)b.r0 * cols + b.c0;
        float* sums = mo->scalars + 4 * (bi + 1);
        if (b.has_root) {
            float* pt = mo->s_y + off;  // P's block, in place in a rows x cols PyTorch-layout buffer
            matmul_forward(mo->s_b, b.cols, {V_ROW, b.Linv, b.rows}, {V_ROW, mo->ut[b.mat] + off, cols}, b.rows,
                           b.cols, b.rows, Epilogue());
            matmul_forward(pt, cols, {V_ROW, mo->s_b, b.cols}, {V_ROW, b.Rinv, b.cols}, b.rows, b.cols, b.cols,
                           Epilogue());
            mo_sumsq(m, sums, mo->dt[b.mat] + off, b.rows, b.cols, cols, mo->sum_scratch);
            mo_sumsq(m, sums + 1, pt, b.rows, b.cols, cols, mo->sum_scratch);
        }
        mo_each(m, (size_t)b.rows * b.cols, ShampooGraft{mo->st[b.mat] + off, mo->s_y + off, mo->dt[b.mat] + off,
                                                         sums, cols, b.cols, b.has_root});
    }
    for (int k = 0; k < N_MATRICES; k++) {
        const size_t o = PARAMS[MATRIX_PARAMS[k]].offset;
        mo_each(m, precond_numel(mo, k), ShampooApply{precond_index(mo, k), mo->st[k], m->params + o, m->m1 + o,
                                                      m->counters, m->opt});
    }
}
// out (n x n) = X^T X of columns c0 .. c0 + n of a rows x ld row-major X (pass x + c0): Shampoo's R, K-FAC's factors
static void gram_cols(float* out, const float* x, int ld, int n, int rows) {
    matmul_forward(out, n, {V_COL, x, ld}, {V_ROW, x, ld}, n, n, rows, Epilogue());
}
static void precond_roots_update(Mnist* m);
static void shampoo_update(Mnist* m) {
    MatrixOpt* mo = m->mo;
    precond_prepare(m);
    for (PrecondBlock& b : mo->blocks) {  // the statistics
        const int cols = matrix_cols(MATRIX_PARAMS[b.mat]);
        const float* g = mo->gt[b.mat] + (size_t)b.r0 * cols + b.c0;
        matmul_forward(mo->s_a, b.rows, {V_ROW, g, cols}, {V_COL, g, cols}, b.rows, b.rows, b.cols, Epilogue());
        mo_each(m, (size_t)b.rows * b.rows, MatAdd{b.L, mo->s_a});
        gram_cols(mo->s_a, g, cols, b.cols, b.rows);
        mo_each(m, (size_t)b.cols * b.cols, MatAdd{b.R, mo->s_a});
    }
    precond_roots_update(m);
    precond_graft_apply(m);
    update_biases(m, m->opt.graft == GRAFT_SGD ? OPT_SGD : OPT_ADAMW);
}

// ---- K-FAC -----------------------------------------------------------------------------------------------------
// Per layer the matrix W~ = [W | b] (out x (in + 1), PyTorch layout, the bias as the last column) with the running
// averages of two Kronecker factors, every step:
//   A = mean of a~ a~^T over the B S rows of the layer's input a~ = [a; 1] (S = 1 for fc, the 676 or 576 output
//       positions of a convolution, whose rows are its im2col patches),
//   G = mean of d d^T over the same rows, d = B g the gradient of the sample's own loss at the layer's output
//       (before the ReLU; the backward's g is the batch mean's, hence G = (B / S) sum g g^T): for fc layers exactly
//       kfac-pytorch's batch_averaged=True factors. (Its convolutions divide A and G by other powers of S; a factor's
//       scale changes no step here: the damping is relative and the step size grafted.)
//   F = decay F + (1 - decay) F_new (--kfac_stat_decay; the first statistics replace F, as kfac-pytorch starts).
// Factors above max_precond_dim are split into diagonal blocks of it (a block-diagonal A or G). On the root schedule
// (shampoo_root_due) every factor block gets its damped inverse (F + e I)^-1, e = precond_eps + precond_damping *
// trace / n, by the coupled Newton iteration with p = 1 (Shampoo's code). The step: per (G chunk, A chunk) block
// the preconditioned gradient P = Ginv U Ainv (U: SGD's G + wd W or AdamW's m_hat, as Shampoo), its size grafted
// onto SGD-momentum or AdamW (--graft, Shampoo's grafting; no KL clipping: the graft fixes every block's step size).
// a~ of a layer: rows x (in + 1), PyTorch's column order, the 1 last. 32-bit index arithmetic (rows (in + 1) <
// 2^31 up to batch 2048: conv2's 1.2M x 289): the GPU has no 64-bit divider (it is emulated, per element).
template <int KIND> struct KfacInputs {
    float* out; const float* p; int ld; const int* col; int in;
    __host__ __device__ void operator()(size_t k) const {
        const unsigned w = (unsigned)in + 1u, ru = (unsigned)k / w;
        const int r = (int)ru, c = (int)((unsigned)k - ru * w);
        out[k] = c == in ? 1.0f : view_get<KIND>(p, ld, r, col[c]);
    }
};
struct FactorAverage {  // F = decay F + (1 - decay) scale S, or scale S at the first statistics
    float* f; const float* s; float scale, decay; int first;
    __host__ __device__ void operator()(size_t k) const {
        const float v = scale * s[k];
        f[k] = first ? v : opt_add(opt_mul(decay, f[k]), opt_mul(1.0f - decay, v));
    }
};
static void kfac_statistics(Mnist* m, int B) {
    MatrixOpt* mo = m->mo;
    for (int k = 0; k < N_MATRICES; k++) {
        const int p = MATRIX_PARAMS[k], in = matrix_cols(p), out = matrix_rows(p), rows = kfac_input_rows(k, B);
        const int S = rows / B;
        const size_t n = (size_t)rows * (in + 1);
        const int* col = mo->torch_index[k];  // row 0: PyTorch's column c -> the internal one
        if (k == 0) mo_each(m, n, KfacInputs<V_CONV1_IN>{mo->acts, m->x, 0, col, in});
        else if (k == 1) mo_each(m, n, KfacInputs<V_CONV2_IN>{mo->acts, m->act1, 0, col, in});
        else mo_each(m, n, KfacInputs<V_ROW>{mo->acts, k == 2 ? m->pooled : m->h, in, col, in});
        const float* dout = k == 0 ? m->dact1 : k == 1 ? m->dact2 : k == 2 ? m->dh : m->dlogits;  // rows x out
        for (KfacFactor& f : mo->factors) {
            if (f.mat != k) continue;
            if (f.side) gram_cols(mo->s_a, mo->acts + f.i0, in + 1, f.n, rows);
            else gram_cols(mo->s_a, dout + f.i0, out, f.n, rows);
            const float scale = f.side ? 1.0f / ((float)B * S) : (float)B / S;
            const FactorAverage avg{f.F, mo->s_a, scale, m->opt.kfac_stat_decay, !mo->kfac_seen};
            mo_each(m, (size_t)f.n * f.n, avg);
        }
    }
    mo->kfac_seen = 1;
}
// A block has its preconditioner when both its factors have inverses
static void kfac_block_roots(MatrixOpt* mo) {
    for (PrecondBlock& b : mo->blocks) b.has_root = mo->factors[b.fl].has_inv && mo->factors[b.fr].has_inv;
}
// Every factor block's damped inverse; a failed one keeps its previous inverse (or its blocks their graft step).
static void kfac_inverses(Mnist* m) {
    MatrixOpt* mo = m->mo;
    strict_fp32(m, [&] {
        for (KfacFactor& f : mo->factors) {
            if (inverse_root(m, mo->work, f.Finv, f.F, f.n, 1)) f.has_inv = 1;
            else root_failed(mo, "kfac", f.side ? "inverse of A" : "inverse of G", f.mat, f.side ? 0 : f.i0,
                             f.side ? f.i0 : 0, mo->step);
        }
    });
    kfac_block_roots(mo);
}

// ---- --precond_delay: the roots of step s live from step s + D, computed meanwhile on a second stream ------------
// As distributed Shampoo overlaps its root computation with training: at a due step s the factors are copied (on the
// training stream, after step s's statistics), a host thread runs the same fp32 Newton iterations on them on a
// second stream (its own split-K workspace, scratch and cuBLAS handle: thread_local g_mm) into the pending buffers,
// and at step s + D the training thread joins it, orders its stream after the roots' (an event) and swaps the new
// roots in, before that step's first use. The roots are those of the synchronous schedule bit for bit; only the step
// that first uses them moves. The CPU computes them at s (synchronously) and swaps them in at s + D alike.
struct RootJob { float* a; float** live; int n, p; };  // a root: its factor (n x n), the live root's pointer, p
static std::vector<RootJob> precond_root_jobs(MatrixOpt* mo) {
    std::vector<RootJob> jobs;
    if (mo->optimizer == OPT_SHAMPOO)
        for (PrecondBlock& b : mo->blocks) {
            jobs.push_back({b.L, &b.Linv, b.rows, 4});
            jobs.push_back({b.R, &b.Rinv, b.cols, 4});
        }
    else
        for (KfacFactor& f : mo->factors) jobs.push_back({f.F, &f.Finv, f.n, 1});
    return jobs;
}
// The pending roots of jobs from factors src (the jobs' own or their snapshots), with the synchronous warnings
static void precond_roots_compute(Mnist* m, RootWork& w, const std::vector<RootJob>& jobs,
                                  const std::vector<float*>& src, int due_step) {
    MatrixOpt* mo = m->mo;
    PrecondPending& pd = mo->pend;
    strict_fp32(m, [&] {
        for (size_t j = 0; j < jobs.size(); j++)
            pd.ok[j] = inverse_root(m, w, pd.roots[j], src[j], jobs[j].n, jobs[j].p);
    });
    if (mo->optimizer == OPT_SHAMPOO) {
        for (size_t i = 0; i < mo->blocks.size(); i++)
            if (!pd.ok[2 * i] || !pd.ok[2 * i + 1]) {
                const PrecondBlock& b = mo->blocks[i];
                root_failed(mo, "shampoo", "inverse root", b.mat, b.r0, b.c0, due_step);
            }
    } else {
        for (size_t i = 0; i < mo->factors.size(); i++)
            if (!pd.ok[i]) {
                const KfacFactor& f = mo->factors[i];
                root_failed(mo, "kfac", f.side ? "inverse of A" : "inverse of G", f.mat, f.side ? 0 : f.i0,
                            f.side ? f.i0 : 0, due_step);
            }
    }
}
// The second stream, its workspace and scratch (once per optimizer state)
static void precond_gpu_setup(Mnist* m, const std::vector<RootJob>& jobs) {
    PrecondPending& pd = m->mo->pend;
    if (pd.gpu_ready) return;
    // non-blocking: no implicit order with the legacy stream's copies of the training thread
    cudaCheck(cudaStreamCreateWithFlags(&pd.stream, cudaStreamNonBlocking));
    cudaCheck(cudaEventCreateWithFlags(&pd.ev_snap, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&pd.ev_done, cudaEventDisableTiming));
    if (g_run.backend == BACKEND_CUBLAS) {
        cublasCheck(cublasCreate(&pd.cublas));
        cublasCheck(cublasSetStream(pd.cublas, pd.stream));
    }
    pd.ws_partial = mnist_alloc(m, g_mm.ws_partial_size);
    pd.ws_rowsum = mnist_alloc(m, g_mm.ws_rowsum_size);
    size_t nn = 1;
    for (const RootJob& j : jobs) nn = std::max(nn, (size_t)j.n * j.n);
    for (int i = 0; i < 6; i++) pd.work.newton.push_back(mnist_alloc(m, nn));
    pd.work.scalar = mnist_alloc(m, 1);
    pd.work.sum_scratch = mnist_alloc(m, SUMSQ_MAX_BLOCKS + 1);
    pd.gpu_ready = true;
}
// The roots thread done, and the training stream ordered after its work
static void precond_pending_wait(Mnist* m) {
    PrecondPending& pd = m->mo->pend;
    if (pd.th.joinable()) pd.th.join();
    if (!m->cpu && pd.gpu_ready) cudaCheck(cudaStreamWaitEvent(g_mm.stream, pd.ev_done, 0));
}
// The pending roots become the live ones (a failed one leaves its live root, as the synchronous schedule does)
static void precond_roots_switch(Mnist* m) {
    MatrixOpt* mo = m->mo;
    PrecondPending& pd = mo->pend;
    precond_pending_wait(m);
    const std::vector<RootJob> jobs = precond_root_jobs(mo);
    for (size_t j = 0; j < jobs.size(); j++)
        if (pd.ok[j]) std::swap(*jobs[j].live, pd.roots[j]);
    if (mo->optimizer == OPT_SHAMPOO) {
        for (size_t i = 0; i < mo->blocks.size(); i++)
            if (pd.ok[2 * i] && pd.ok[2 * i + 1]) mo->blocks[i].has_root = 1;
    } else {
        for (size_t i = 0; i < mo->factors.size(); i++)
            if (pd.ok[i]) mo->factors[i].has_inv = 1;
        for (PrecondBlock& b : mo->blocks) { b.Linv = mo->factors[b.fl].Finv; b.Rinv = mo->factors[b.fr].Finv; }
        kfac_block_roots(mo);
    }
    pd.switch_step = -1;
}
// The pending roots' buffers (and on the GPU the factors' snapshots), once
static void precond_pending_alloc(Mnist* m) {
    PrecondPending& pd = m->mo->pend;
    if (!pd.roots.empty()) return;
    for (const RootJob& j : precond_root_jobs(m->mo)) {
        pd.roots.push_back(mnist_alloc(m, (size_t)j.n * j.n));
        if (!m->cpu) pd.snap.push_back(mnist_alloc(m, (size_t)j.n * j.n));
    }
}
// The due roots of this step, started for step + precond_delay
static void precond_roots_start(Mnist* m) {
    MatrixOpt* mo = m->mo;
    PrecondPending& pd = mo->pend;
    if (pd.switch_step >= 0) precond_roots_switch(m);  // (only where a resume changed the schedule)
    const std::vector<RootJob> jobs = precond_root_jobs(mo);
    precond_pending_alloc(m);
    pd.ok.assign(jobs.size(), 0);
    pd.switch_step = mo->step + m->opt.precond_delay;
    const int due = mo->step;
    if (m->cpu) {
        std::vector<float*> src;
        for (const RootJob& j : jobs) src.push_back(j.a);
        precond_roots_compute(m, mo->work, jobs, src, due);
        return;
    }
    precond_gpu_setup(m, jobs);
    for (size_t j = 0; j < jobs.size(); j++)
        cudaCheck(cudaMemcpyAsync(pd.snap[j], jobs[j].a, (size_t)jobs[j].n * jobs[j].n * 4, cudaMemcpyDeviceToDevice,
                                  g_mm.stream));
    cudaCheck(cudaEventRecord(pd.ev_snap, g_mm.stream));
    const RunConfig run = g_run;
    const size_t ws_partial_size = g_mm.ws_partial_size, ws_rowsum_size = g_mm.ws_rowsum_size;
    int dev = 0;
    cudaCheck(cudaGetDevice(&dev));
    pd.th = std::thread([m, jobs, due, run, dev, ws_partial_size, ws_rowsum_size] {
        PrecondPending& p = m->mo->pend;
        cudaCheck(cudaSetDevice(dev));
        g_run = run;  // this thread's: strict_fp32 switches its own
        g_mm.stream = p.stream; g_mm.cublas = p.cublas;
        g_mm.ws_partial = p.ws_partial; g_mm.ws_partial_size = ws_partial_size;
        g_mm.ws_rowsum = p.ws_rowsum; g_mm.ws_rowsum_size = ws_rowsum_size;
        cudaCheck(cudaStreamWaitEvent(p.stream, p.ev_snap, 0));
        precond_roots_compute(m, p.work, jobs, p.snap, due);
        cudaCheck(cudaEventRecord(p.ev_done, p.stream));
    });
}
static void precond_pending_free(Mnist* m) {
    PrecondPending& pd = m->mo->pend;
    if (pd.th.joinable()) pd.th.join();
    if (pd.gpu_ready) cudaCheck(cudaStreamSynchronize(pd.stream));  // its last copies into pd.roots done
    for (float* p : pd.roots) mnist_free_ptr(m, p);
    for (float* p : pd.snap) mnist_free_ptr(m, p);
    if (!pd.gpu_ready) return;
    for (float* p : pd.work.newton) mnist_free_ptr(m, p);
    for (float* p : {pd.work.scalar, pd.work.sum_scratch, pd.ws_partial, pd.ws_rowsum}) mnist_free_ptr(m, p);
    if (pd.cublas) cublasCheck(cublasDestroy(pd.cublas));
    cudaCheck(cudaEventDestroy(pd.ev_snap)); cudaCheck(cudaEventDestroy(pd.ev_done));
    cudaCheck(cudaStreamDestroy(pd.stream));
}
// The roots' schedule after a step's statistics, before the step's first use of them: the pending roots at their
// switch step, then the roots due at this step: synchronously with precond_delay 0, else started for a later step.
static void precond_roots_update(Mnist* m) {
    MatrixOpt* mo = m->mo;
    if (mo->pend.switch_step >= 0 && mo->step >= mo->pend.switch_step) precond_roots_switch(m);
    if (!shampoo_root_due(m->opt, mo->step)) return;
    if (m->opt.precond_delay == 0) {
        if (mo->optimizer == OPT_SHAMPOO) shampoo_roots(m);
        else kfac_inverses(m);
    } else {
        precond_roots_start(m);
    }
}

static void kfac_update(Mnist* m, int B) {
    precond_prepare(m);
    kfac_statistics(m, B);
    precond_roots_update(m);
    precond_graft_apply(m);
}

// The optimizer step of Muon, Shampoo or K-FAC (instead of mnist_update) after a backward of batch B, then the
// counters' advance by advance_B.
static void matrix_opt_update(Mnist* m, int B, int advance_B) {
    matrix_opt_ensure(m);
    if (m->opt.optimizer == OPT_MUON) muon_update(m);
    else if (m->opt.optimizer == OPT_KFAC) kfac_update(m, B);
    else shampoo_update(m);
    m->mo->step++;
    mnist_advance(m, advance_B);
}
static void matrix_opt_set_step(Mnist* m, int step) { if (m->mo) m->mo->step = step; }

// ----------------------------------------------------------------------------------------------------------------
// per-sample gradients (issue 21 item 4): every sample's gradient norm per parameter tensor, without the generic
// backward's detour through per-sample gradients where a layer allows it; --clip_per_sample (DP-SGD's clipping and
// Gaussian noise) and --precond fisher_diag (the empirical-Fisher diagonal) on the generic path, CPU and GPU.
// g_i below is the gradient of sample i's loss l_i; the backward's output gradients d carry the mean's 1/B, so a
// product of them is g_i / B. Per layer:
//  - fc1, fc2 (one position per sample): ||g_i(W)||^2 = ||a_i||^2 ||d_i||^2 and ||g_i(b)||^2 = ||d_i||^2 from row
//    norms, nothing materialised;
//  - conv1, conv2: per-sample weight gradients materialised, pw_i (M x N) = d_i^T (M x P) patches_i (P x N). The Gram
//    form sum_{p,q} (a_p.a_q)(d_p.d_q) costs P^2 (N + M) per sample against P N M here: 5.5x more for conv2 (P 576,
//    N 288, M 64) and 94x for conv1 (P 676, N 9, M 32); it only pays when P < N M / (N + M), never in this network.
//    On our kernel the materialisation is one launch: the split-K product over the batch with one split per sample
//    (k_per_split = P) leaves exactly the per-sample gradients in its partial sums.
// Clipping scales sample i's output gradients by s_i = min(1, C / ||g_i||) before the weight-gradient products (the
// backward is linear in them, so this is exact): the input gradients of every layer are computed first, unscaled.
// The empirical-Fisher diagonal (1/B) sum_i g_i^2 comes from the same pieces: (d^2)^T (a^2) for the linear layers,
// the squared per-sample gradients for the convolutions; of the clipped gradients when clipping is on.
struct ParamOffsets { size_t off[N_PARAM_TENSORS + 1]; };  // tensor t: [off[t], off[t + 1]) of the flat buffers
static ParamOffsets param_offsets() {
    ParamOffsets po;
    for (int t = 0; t < N_PARAM_TENSORS; t++) po.off[t] = PARAMS[t].offset;
    po.off[N_PARAM_TENSORS] = PARAMS[N_PARAM_TENSORS - 1].offset + PARAMS[N_PARAM_TENSORS - 1].numel;
    return po;
}
// per sample: ||pw1||^2 ||pb1||^2 ||pw2||^2 ||pb2||^2 ||pooled||^2 ||dh||^2 ||h||^2 ||dlogits||^2
constexpr int PS_TERMS = 8;
struct PerSample {
    uint64_t seed = 0;                                            // the noise's (main: from --seed)
    float *pw1 = nullptr, *pb1 = nullptr, *pw2 = nullptr, *pb2 = nullptr;  // (B,32,9) (B,32) (B,64,288) (B,64): g_i / B
    float* terms = nullptr;  // (B, PS_TERMS)
    float* norms = nullptr;  // (B, 8): ||g_i|| of each parameter tensor (PARAMS' order)
    float* total = nullptr;  // (B): ||g_i|| of the whole model
    float* scale = nullptr;  // (B): s_i (1 without clipping)
    float *fisher_batch = nullptr, *fisher = nullptr;  // (n_params, internal layout): the batch's Fisher, its average
    float *sq_dl = nullptr, *sq_h = nullptr, *sq_dh = nullptr, *sq_pooled = nullptr;  // B d^2 and a^2 (linear layers)
    float* sums = nullptr;  // (8): each tensor's sum of the averaged Fisher
};
static void per_sample_free(Mnist* m) {
    PerSample* ps = m->ps;
    if (!ps) return;
    for (float* p : {ps->pw1, ps->pb1, ps->pw2, ps->pb2, ps->terms, ps->norms, ps->total, ps->scale, ps->fisher_batch,
                     ps->fisher, ps->sq_dl, ps->sq_h, ps->sq_dh, ps->sq_pooled, ps->sums})
        mnist_free_ptr(m, p);
    delete ps;
    m->ps = nullptr;
}
// Allocates the per-sample buffers for the model's batch, all zero (the Fisher average too: a fresh state).
static void per_sample_build(Mnist* m) {
    per_sample_free(m);
    PerSample* ps = new PerSample();
    m->ps = ps;
    const size_t B = m->B;
    ps->pw1 = mnist_alloc(m, B * PARAMS[P_W1].numel); ps->pb1 = mnist_alloc(m, B * C1);
    ps->pw2 = mnist_alloc(m, B * PARAMS[P_W2].numel); ps->pb2 = mnist_alloc(m, B * C2);
    ps->terms = mnist_alloc(m, B * PS_TERMS); ps->norms = mnist_alloc(m, B * N_PARAM_TENSORS);
    ps->total = mnist_alloc(m, B); ps->scale = mnist_alloc(m, B);
    ps->fisher_batch = mnist_alloc(m, m->n_params); ps->fisher = mnist_alloc(m, m->n_params);
    ps->sq_dl = mnist_alloc(m, B * NCLS); ps->sq_h = mnist_alloc(m, B * FC_H); ps->sq_dh = mnist_alloc(m, B * FC_H);
    ps->sq_pooled = mnist_alloc(m, B * FC_IN);
    ps->sums = mnist_alloc(m, N_PARAM_TENSORS);
}

// out[i * out_ld] = sum_j x[i * ld + j]^2 for rows i < rows: one block per row, a fixed order (deterministic)
__global__ void ps_rowsq_kernel(float* out, int out_ld, const float* x, int cols, int ld) {
    __shared__ float part[256];
    const float* r = x + (size_t)blockIdx.x * ld;
    float s = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s = fmaf(r[j], r[j], s);
    part[threadIdx.x] = s;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h /= 2) {
        if ((int)threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[(size_t)blockIdx.x * out_ld] = part[0];
}
static void ps_rowsq(const Mnist* m, float* out, int out_ld, const float* x, int rows, int cols, int ld) {
    if (m->cpu) {
        for (int i = 0; i < rows; i++) {
            double s = 0;
            for (int j = 0; j < cols; j++) s += (double)x[(size_t)i * ld + j] * x[(size_t)i * ld + j];
            out[(size_t)i * out_ld] = (float)s;
        }
        return;
    }
    ps_rowsq_kernel<<<rows, 256, 0, g_mm.stream>>>(out, out_ld, x, cols, ld);
    launch_check();
}
// sums[t] = the sum of tensor t of x (flat, PARAMS' offsets): one block per tensor, a fixed order
__global__ void ps_tensor_sums_kernel(float* sums, const float* x, ParamOffsets po) {
    __shared__ float part[1024];
    const int t = blockIdx.x;
    float s = 0.0f;
    for (size_t j = po.off[t] + threadIdx.x; j < po.off[t + 1]; j += blockDim.x) s += x[j];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h /= 2) {
        if ((int)threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) sums[t] = part[0];
}

// Per-sample weight and bias gradients of a convolution over B samples of P positions (see above): pw[i] (M x N) =
// d_i^T patches_i, pb[i] (M) = d_i^T 1, with d (B*P, M) row-major and patches the implicit view `patch_kind` of src
// (sample i at src + i * src_stride). Our kernel: the per-sample split-K launch; cuBLAS: one strided batched GEMM on
// the materialised patches and one strided batched GEMV; CPU: a product per sample.
static void ps_conv_grads(float* pw, float* pb, const float* d, int patch_kind, const float* src, size_t src_stride,
                          int M, int N, int P, int B) {
    if (g_run.backend == BACKEND_CPU) {
        for (int i = 0; i < B; i++) {
            Epilogue e; e.rowsum = pb + (size_t)i * M;
            matmul_forward(pw + (size_t)i * M * N, N, {V_COL, d + (size_t)i * P * M, M},
                           {patch_kind, src + i * src_stride, 0}, M, N, P, e);
        }
        return;
    }
    if (g_run.backend == BACKEND_OURS) {
        launch_ours(nullptr, N, pw, {V_COL, d, M}, {patch_kind, src, 0}, M, N, B * P, P, B, Epilogue(), pb);
        return;
    }
    if ((size_t)B * P * N > g_mm.ws_b_size || P > g_mm.ones_size) die("ps_conv_grads: cuBLAS workspace too small");
    materialize_gpu(g_mm.ws_b, {patch_kind, src, 0}, B * P, N);
    const float one = 1.0f, zero = 0.0f;
    // column-major: pw_i^T (N x M) = patches_i^T (N x P, ld N) * d_i (P x M row-major = M x P col-major, op T)
    cublasCheck(cublasSgemmStridedBatched(g_mm.cublas, CUBLAS_OP_N, CUBLAS_OP_T, N, M, P, &one, g_mm.ws_b, N,
                                          (long long)P * N, d, M, (long long)P * M, &zero, pw, N, (long long)M * N, B));
    cublasCheck(cublasSgemvStridedBatched(g_mm.cublas, CUBLAS_OP_N, M, P, &one, d, M, (long long)P * M, g_mm.ones, 1,
                                          0, &zero, pb, 1, M, B));
}

// s_i and the norms from the per-sample terms (B multiplies g_i / B back to g_i)
struct PsNorms {
    const float* terms; float *norms, *total, *scale; float clip; int B;
    __host__ __device__ void operator()(size_t i) const {
        const float* t = terms + i * PS_TERMS;
        const float sq[N_PARAM_TENSORS] = {t[0], t[1], t[2], t[3], t[4] * t[5], t[5], t[6] * t[7], t[7]};
        float s = 0.0f;
        for (int k = 0; k < N_PARAM_TENSORS; k++) {
            s += sq[k];
            norms[i * N_PARAM_TENSORS + k] = (float)B * sqrtf(sq[k]);
        }
        total[i] = (float)B * sqrtf(s);
        scale[i] = clip > 0.0f ? fminf(1.0f, clip / total[i]) : 1.0f;  // a zero gradient: C / 0 = inf, s_i = 1
    }
};
struct PsScaleRows {  // x (rows, cols) row i times scale[i]
    float* x; const float* scale; int cols;
    __host__ __device__ void operator()(size_t k) const { x[k] *= scale[k / cols]; }
};
struct PsSquare {  // out = mul x^2
    float* out; const float* x; float mul;
    __host__ __device__ void operator()(size_t k) const { out[k] = mul * x[k] * x[k]; }
};
// a convolution's weight or bias: g = sum_i s_i per_i (the clipped mean), fisher = B sum_i (s_i per_i)^2
struct PsReduce {
    const float* per; const float* scale; float *g, *fisher; size_t n; int B;
    __host__ __device__ void operator()(size_t j) const {
        float s = 0.0f, f = 0.0f;
        for (int i = 0; i < B; i++) {
            const float v = scale[i] * per[(size_t)i * n + j];
            s += v;
            f = fmaf(v, v, f);
        }
        g[j] = s;
        if (fisher) fisher[j] = (float)B * f;
    }
};
// A standard normal draw for element j at step `step`: cuRAND's Philox (element j's subsequence, 4 draws per step) on
// the GPU, splitmix64 and Box-Muller on the CPU. Either depends on (seed, step, j) only: graphs and --resume replay
// the same noise.
__host__ __device__ inline float ps_gaussian(uint64_t seed, int step, size_t j) {
#ifdef __CUDA_ARCH__
    curandStatePhilox4_32_10_t st;
    curand_init(seed, j, 4ull * (unsigned)step, &st);
    return curand_normal(&st);
#else
    uint64_t s = seed ^ ((uint64_t)(unsigned)step * 0xD1B54A32D192ED03ull) ^ ((uint64_t)j * 0x9E3779B97F4A7C15ull);
    const float u1 = 1.0f - rand_uniform(&s), u2 = rand_uniform(&s);  // u1 in (0, 1]
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795865f * u2);
#endif
}
struct PsNoise {  // DP-SGD: g += sigma N(0, 1), sigma = noise_multiplier C / B
    float* g; float sigma; uint64_t seed; const int* counters;
    __host__ __device__ void operator()(size_t j) const { g[j] += sigma * ps_gaussian(seed, counters[0], j); }
};
struct PsFisherAverage {  // F = beta2 F + (1 - beta2) F_batch
    float* F; const float* fb; float beta2;
    __host__ __device__ void operator()(size_t j) const { F[j] = beta2 * F[j] + (1.0f - beta2) * fb[j]; }
};
// g / (F^ + precond_eps + precond_damping mean(F^))^fisher_power, F^ = F / (1 - beta2^t) (as Adam's bias correction),
// mean(F^) over the parameter tensor (as Shampoo's damping: times the mean eigenvalue)
struct PsPrecondition {
    float* g; const float* F; const float* sums; const int* counters; OptConfig c; ParamOffsets po;
    __host__ __device__ void operator()(size_t j) const {
        int t = 0;
        while (j >= po.off[t + 1]) t++;
        const float bc = 1.0f - powf(c.beta2, (float)(counters[0] + 1));
        const float mean = sums[t] / bc / (float)(po.off[t + 1] - po.off[t]);
        g[j] = g[j] / powf(F[j] / bc + c.precond_eps + c.precond_damping * mean, c.fisher_power);
    }
};

// The backward of the per-sample step (generic path, after mnist_forward_loss): every gradient, clipped per sample
// with --clip_per_sample, plus the noise, then preconditioned with --precond fisher_diag (whose average it updates).
// Leaves the per-sample norms in m->ps. No host sync (capturable).
static void mnist_backward_per_sample(Mnist* m, int B) {
    PerSample* ps = m->ps;
    const OptConfig& c = m->opt;
    const bool fisher = c.precond == PRECOND_FISHER_DIAG;
    // the input gradients, unscaled (as mnist_backward's)
    Epilogue e; e.mask = m->h;
    matmul_forward(m->dh, FC_H, {V_ROW, m->dlogits, NCLS}, {V_ROW, param_of(m, P_WF2), FC_H}, B, FC_H, NCLS, e);
    matmul_forward(m->dpooled, FC_IN, {V_ROW, m->dh, FC_H}, {V_ROW, param_of(m, P_WF1), FC_IN}, B, FC_IN, FC_H,
                   Epilogue());
    maxpool_backward(m, B);
    e = Epilogue(); e.mask = m->act1;
    matmul_forward(m->dact1, C1, {V_CONV2_DOUT, m->dact2, 0}, {V_CONV2_WT, param_of(m, P_W2), 0}, B * H1 * H1, C1,
                   9 * C2, e);
    // per-sample gradients of the convolutions, every per-sample term, the norms and s_i
    ps_conv_grads(ps->pw2, ps->pb2, m->dact2, V_CONV2_IN, m->act1, (size_t)H1 * H1 * C1, C2, KC2, H2 * H2, B);
    ps_conv_grads(ps->pw1, ps->pb1, m->dact1, V_CONV1_IN, m->x, (size_t)IMG * IMG, C1, K1, H1 * H1, B);
    ps_rowsq(m, ps->terms + 0, PS_TERMS, ps->pw1, B, (int)PARAMS[P_W1].numel, (int)PARAMS[P_W1].numel);
    ps_rowsq(m, ps->terms + 1, PS_TERMS, ps->pb1, B, C1, C1);
    ps_rowsq(m, ps->terms + 2, PS_TERMS, ps->pw2, B, (int)PARAMS[P_W2].numel, (int)PARAMS[P_W2].numel);
    ps_rowsq(m, ps->terms + 3, PS_TERMS, ps->pb2, B, C2, C2);
    ps_rowsq(m, ps->terms + 4, PS_TERMS, m->pooled, B, FC_IN, FC_IN);
    ps_rowsq(m, ps->terms + 5, PS_TERMS, m->dh, B, FC_H, FC_H);
    ps_rowsq(m, ps->terms + 6, PS_TERMS, m->h, B, FC_H, FC_H);
    ps_rowsq(m, ps->terms + 7, PS_TERMS, m->dlogits, B, NCLS, NCLS);
    mo_each(m, B, PsNorms{ps->terms, ps->norms, ps->total, ps->scale, c.clip, B});
    // the clipped mean gradient: the linear layers' products on the scaled output gradients, the convolutions'
    // per-sample gradients summed with their s_i (and squared for the Fisher)
    if (c.clip > 0.0f) {
        mo_each(m, (size_t)B * NCLS, PsScaleRows{m->dlogits, ps->scale, NCLS});
        mo_each(m, (size_t)B * FC_H, PsScaleRows{m->dh, ps->scale, FC_H});
    }
    e = Epilogue(); e.rowsum = grad_of(m, P_BF2);
    matmul_forward(grad_of(m, P_WF2), FC_H, {V_COL, m->dlogits, NCLS}, {V_ROW, m->h, FC_H}, NCLS, FC_H, B, e);
    e = Epilogue(); e.rowsum = grad_of(m, P_BF1);
    matmul_forward(grad_of(m, P_WF1), FC_IN, {V_COL, m->dh, FC_H}, {V_ROW, m->pooled, FC_IN}, FC_H, FC_IN, B, e);
    const int conv_params[4] = {P_W1, P_B1, P_W2, P_B2};
    const float* per[4] = {ps->pw1, ps->pb1, ps->pw2, ps->pb2};
    for (int k = 0; k < 4; k++) {
        const int p = conv_params[k];
        mo_each(m, PARAMS[p].numel, PsReduce{per[k], ps->scale, grad_of(m, p),
                                             fisher ? ps->fisher_batch + PARAMS[p].offset : nullptr, PARAMS[p].numel,
                                             B});
    }
    if (fisher) {  // the linear layers' Fisher: (B d^2)^T (a^2), its bias part the row sums of B d^2
        mo_each(m, (size_t)B * NCLS, PsSquare{ps->sq_dl, m->dlogits, (float)B});
        mo_each(m, (size_t)B * FC_H, PsSquare{ps->sq_h, m->h, 1.0f});
        mo_each(m, (size_t)B * FC_H, PsSquare{ps->sq_dh, m->dh, (float)B});
        mo_each(m, (size_t)B * FC_IN, PsSquare{ps->sq_pooled, m->pooled, 1.0f});
        float* fb = ps->fisher_batch;
        e = Epilogue(); e.rowsum = fb + PARAMS[P_BF2].offset;
        matmul_forward(fb + PARAMS[P_WF2].offset, FC_H, {V_COL, ps->sq_dl, NCLS}, {V_ROW, ps->sq_h, FC_H}, NCLS, FC_H,
                       B, e);
        e = Epilogue(); e.rowsum = fb + PARAMS[P_BF1].offset;
        matmul_forward(fb + PARAMS[P_WF1].offset, FC_IN, {V_COL, ps->sq_dh, FC_H}, {V_ROW, ps->sq_pooled, FC_IN}, FC_H,
                       FC_IN, B, e);
    }
    if (c.noise > 0.0f)
        mo_each(m, m->n_params, PsNoise{m->grads, c.noise * c.clip / (float)B, ps->seed, m->counters});
    if (!fisher) return;
    mo_each(m, m->n_params, PsFisherAverage{ps->fisher, ps->fisher_batch, c.beta2});
    const ParamOffsets po = param_offsets();
    if (m->cpu) {
        for (int t = 0; t < N_PARAM_TENSORS; t++) {
            double s = 0;
            for (size_t j = po.off[t]; j < po.off[t + 1]; j++) s += ps->fisher[j];
            ps->sums[t] = (float)s;
        }
    } else {
        ps_tensor_sums_kernel<<<N_PARAM_TENSORS, 1024, 0, g_mm.stream>>>(ps->sums, ps->fisher, po);
        launch_check();
    }
    mo_each(m, m->n_params, PsPrecondition{m->grads, ps->fisher, ps->sums, m->counters, c, po});
}

// ================================================================================================================
// 5. THE TRAINING LOOP AND CHECKPOINTS
//   a training step (gather, forward and loss, backward, update), steps captured in CUDA graphs, an epoch's order,
//   then the checkpoint files
// ================================================================================================================
// Loads a batch (positions counters[1].. of perm, or offset.. when counters is null) into x, y.
struct DeviceData { uint8_t* images = nullptr; uint8_t* labels = nullptr; int n = 0; };
static void mnist_gather(Mnist* m, const DeviceData& d, const int* perm, const int* counters, int offset, int B) {
    if (m->cpu) {
        int off = counters ? counters[1] : offset;
        for (int b = 0; b < B; b++) {
            int s = perm ? perm[off + b] : off + b;
            for (int p = 0; p < IMG * IMG; p++)
                m->x[b * IMG * IMG + p] = mnist_normalize(d.images[(size_t)s * IMG * IMG + p]);
            m->y[b] = d.labels[s];
        }
        return;
    }
    launch_pdl(gather_batch_kernel, ceil_div(B * IMG * IMG, 256), 256, 0, 1, m->x, m->y, d.images, d.labels, perm,
               counters, offset, B);
}
// One training step: gather, forward, loss, backward, update, advance. No host sync: capturable in a CUDA graph.
// The fast path has no gather launch: conv2's forward kernel loads the batch; at batch <= FUSED_MAX_B it also runs fc1
// and the head (the fused forward): 4 launches per step (5 with AdamW), 6 (7) at larger batches.
// staged: the previous step gathered this batch (it was called with next_B = B); next_B > 0: gather the next step's
// batch of next_B (at most the model's batch) for it, and return whether it was (the fast path only).
static bool mnist_train_step_matrix(Mnist* m, const DeviceData& d, const int* perm, float* losses, int B);
static bool mnist_train_step_per_sample(Mnist* m, const DeviceData& d, const int* perm, float* losses, int B);
static bool mnist_train_step(Mnist* m, const DeviceData& d, const int* perm, float* losses, int B, bool staged = false,
                             int next_B = 0) {
    if (per_sample_on(m->opt)) return mnist_train_step_per_sample(m, d, perm, losses, B);  // clipping, Fisher
    if (is_matrix_opt(m->opt.optimizer)) return mnist_train_step_matrix(m, d, perm, losses, B);  // Muon, Shampoo, K-FAC
    const bool fast = conv2_fast(m);
    if (next_B > m->B) {
        fprintf(stderr, "mnist_train_step: the next batch (%d) is larger than the model's (%d)\n", next_B, m->B);
        exit(EXIT_FAILURE);
    }
    if (fast) {
        ConvInput in;
        in.images = d.images; in.labels = d.labels; in.perm = perm; in.counters = m->counters;
        if (staged) { in.staged = m->xb; in.staged_y = m->yb; in.wimg = g_run.bulk_copy ? g_conv2.wimg_fwd : nullptr; }
        mnist_forward_loss(m, B, &in, losses, nullptr, m->counters, 0, true);
    } else {
        mnist_gather(m, d, perm, m->counters, 0, B);
        mnist_forward_loss(m, B, nullptr, losses, nullptr, m->counters, 0, true);
    }
    if (fast) {
        BatchPrefetch pf;  // the next step's batch: gathered for it, or into L2
        pf.images = d.images; pf.labels = d.labels; pf.perm = perm; pf.counters = m->counters; pf.n = d.n;
        pf.B = next_B > 0 ? next_B : B;
        if (next_B > 0) { pf.xb = m->xb; pf.yb = m->yb; }
        mnist_backward(m, B, B, pf);  // with the optimizer step of every parameter and the counters' advance
        return next_B > 0;
    }
    mnist_backward(m, B);
    mnist_update(m, B);       // and the counters' advance
    return false;
}
// nsteps training steps of batch B, then (tail_B > 0) one of batch tail_B; on the fast path each step gathers the
// next one's batch (BatchPrefetch::xb) and the next forward reads it from there (ConvInput::staged): the same values
// as steps that each gather their own batch.
static void mnist_train_steps(Mnist* m, const DeviceData& d, const int* perm, float* losses, int B, int nsteps,
                              int tail_B = 0) {
    const int total = nsteps + (tail_B > 0 ? 1 : 0);
    bool staged = false;
    for (int i = 0; i < total; i++)
        staged = mnist_train_step(m, d, perm, losses, i < nsteps ? B : tail_B, staged,
                                  i + 1 < total ? (i + 1 < nsteps ? B : tail_B) : 0);
}

// A training step of Muon, Shampoo or K-FAC: the batch gathered by its own kernel, forward and loss, the backward
// storing every gradient, then their update (the fast path's fused updates are SGD's and AdamW's). Returns false:
// nothing staged for the next step.
static bool mnist_train_step_matrix(Mnist* m, const DeviceData& d, const int* perm, float* losses, int B) {
    mnist_gather(m, d, perm, m->counters, 0, B);
    mnist_forward_loss(m, B, nullptr, losses, nullptr, m->counters, 0, true);
    mnist_backward(m, B);
    matrix_opt_update(m, B, B);
    return false;
}

// A training step with per-sample gradients: the batch gathered by its own kernel, the generic forward and loss,
// mnist_backward_per_sample, then the optimizer's update and the counters' advance. Returns false: nothing staged.
static bool mnist_train_step_per_sample(Mnist* m, const DeviceData& d, const int* perm, float* losses, int B) {
    mnist_gather(m, d, perm, m->counters, 0, B);
    mnist_forward_loss(m, B, nullptr, losses, nullptr, m->counters, 0, true);
    mnist_backward_per_sample(m, B);
    if (is_matrix_opt(m->opt.optimizer)) matrix_opt_update(m, B, B);
    else mnist_update(m, B);
    return false;
}

// Fisher-Yates from splitmix64 seeded by (seed, epoch): an epoch's order never depends on earlier epochs, so
// resuming at an epoch boundary replays the same trajectory.
static void epoch_permutation(std::vector<int>& perm, int n, int seed, int epoch) {
    perm.resize(n);
    for (int i = 0; i < n; i++) perm[i] = i;
    uint64_t s = (uint64_t)seed * 1000003ull + (uint64_t)epoch * 7919ull + 12345;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(splitmix64(&s) % (uint64_t)(i + 1));
        std::swap(perm[i], perm[j]);
    }
}

static DeviceData upload_split(const MnistSplit& s, bool cpu) {
    DeviceData d; d.n = s.n;
    if (cpu) { d.images = (uint8_t*)s.images.data(); d.labels = (uint8_t*)s.labels.data(); return d; }
    cudaCheck(cudaMalloc(&d.images, s.images.size()));
    cudaCheck(cudaMalloc(&d.labels, s.labels.size()));
    cudaCheck(cudaMemcpy(d.images, s.images.data(), s.images.size(), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d.labels, s.labels.data(), s.labels.size(), cudaMemcpyHostToDevice));
    return d;
}

// An epoch's training steps in CUDA graphs of mnist_train_steps: GRAPH_STEPS full batches in one (fewer graph
// launches, the steps' kernels overlap across step boundaries, and every step but the first has its batch gathered by
// the step before), and one graph for the rest: the remaining full batches and the last partial batch
constexpr int GRAPH_STEPS = 32;
// mnist_train_steps(m, d, perm, losses, B, nsteps, tail_B) captured in one graph, instantiated and uploaded. The
// host's mirror of the step (MatrixOpt::step) is kept: a capture inside an epoch (--eval_every) must not advance it.
static cudaGraphExec_t capture_train_steps(Mnist* m, const DeviceData& d, const int* perm, float* losses, int B,
                                           int nsteps, int tail_B = 0) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    const int host_step = m->mo ? m->mo->step : 0;
    cudaCheck(cudaStreamBeginCapture(g_mm.stream, cudaStreamCaptureModeThreadLocal));
    mnist_train_steps(m, d, perm, losses, B, nsteps, tail_B);
    cudaCheck(cudaStreamEndCapture(g_mm.stream, &g));
    matrix_opt_set_step(m, host_step);
    cudaCheck(cudaGraphInstantiate(&ge, g, 0));
    cudaCheck(cudaGraphUpload(ge, g_mm.stream));
    cudaCheck(cudaGraphDestroy(g));
    return ge;
}

// ----------------------------------------------------------------------------------------------------------------
// checkpoints: magic 20260202, version 3; parameters (and optimizer state) by PyTorch names in PyTorch layout; the
// header holds every setting the run's trajectory depends on, so that --resume can continue it (data/README.md).
// Version 3 added Muon's and Shampoo's settings (slots 21..30) and their state; the per-sample step added slots
// 31..34 (0: off) and K-FAC (optimizer 4) slot 35, kfac_stat_decay, written 0 by every other optimizer (so a version 3
// file of before still reads, and an older binary refuses a K-FAC file at that slot or at the optimizer's range);
// slot 36, precond_delay, likewise (0 unless Shampoo or K-FAC: an older binary refuses a delayed run's file).
enum {
    CK_EPOCH = 3, CK_STEP, CK_BATCH_SIZE, CK_SEED, CK_OPTIMIZER, CK_HAS_OPTIMIZER, CK_EPOCHS, CK_LR, CK_TEST_ACCURACY,
    CK_LR_SCHEDULE, CK_WARMUP_STEPS, CK_LR_MIN, CK_MOMENTUM, CK_WEIGHT_DECAY, CK_BETA1, CK_BETA2, CK_EPS,
    CK_TRAIN_IMAGES, CK_MUON_LR, CK_MUON_MOMENTUM, CK_NESTEROV, CK_NS_STEPS, CK_GRAFT, CK_PRECOND_EVERY,
    CK_PRECOND_START, CK_MAX_PRECOND_DIM, CK_PRECOND_EPS, CK_PRECOND_DAMPING,
    CK_CLIP_PER_SAMPLE, CK_NOISE_MULTIPLIER, CK_PRECOND, CK_FISHER_POWER,  // 0 in older files: per-sample step off
    CK_KFAC_STAT_DECAY,                                                    // 0 unless the optimizer is K-FAC
    CK_PRECOND_DELAY,                                                      // 0 unless Shampoo or K-FAC
    CK_FIELDS_END
};
static const char* const CK_FIELD_NAMES[CK_FIELDS_END] = {
    "magic", "version", "tensor count", "epoch", "step", "batch_size", "seed", "optimizer", "has_optimizer",
    "epochs", "lr", "test_accuracy", "lr_schedule", "warmup_steps", "lr_min", "momentum", "weight_decay", "beta1",
    "beta2", "eps", "train_images", "muon_lr", "muon_momentum", "muon_nesterov", "ns_steps", "graft",
    "precond_every", "precond_start", "max_precond_dim", "precond_eps", "precond_damping", "clip_per_sample",
    "noise_multiplier", "precond", "fisher_power", "kfac_stat_decay", "precond_delay"};
static const char* const OPTIMIZER_NAMES[5] = {"sgd", "adamw", "muon", "shampoo", "kfac"};
static const char* const GRAFT_NAMES[2] = {"sgd", "adam"};
static const char* const SCHEDULE_NAMES[3] = {"constant", "cosine", "linear"};
static const char* const PRECOND_NAMES[2] = {"none", "fisher_diag"};
// Shampoo and K-FAC: the preconditioner's roots (precond_delay and its checkpoint state); other optimizers ignore
// --precond_delay, as they do Shampoo's other flags, and store 0.
static bool is_matrix_precond(int optimizer) { return optimizer == OPT_SHAMPOO || optimizer == OPT_KFAC; }
static int precond_delay_stored(const OptConfig& o) { return is_matrix_precond(o.optimizer) ? o.precond_delay : 0; }
// "" or why --precond_delay does not fit: at most one set of roots is in flight, so D <= precond_every
static std::string precond_delay_error(const OptConfig& o) {
    if (!is_matrix_precond(o.optimizer) || o.precond_delay <= o.precond_every) return "";
    return "--precond_delay " + std::to_string(o.precond_delay) + " is above --precond_every " +
           std::to_string(o.precond_every) + ": the roots due every precond_every steps must be in use before the next "
           "are due (use --precond_delay 0.." + std::to_string(o.precond_every) + ")";
}
// The per-sample flags that do not go together, or "": noise needs a clip norm (its scale is C / B); K-FAC takes no
// clipping (its factors would mix clipped and unclipped output gradients, and are not privatised); the Fisher
// preconditioner feeds SGD-momentum only (AdamW's and the matrix optimizers' own preconditioners would stack on it)
// and takes no noise (its statistics of the raw per-sample gradients would not be private).
static std::string per_sample_flags_error(const OptConfig& o) {
    char buf[320];
    if (o.noise > 0.0f && !(o.clip > 0.0f)) {
        snprintf(buf, sizeof buf, "--noise_multiplier %g needs --clip_per_sample C > 0 (the noise is "
                 "noise_multiplier * C / batch_size), found --clip_per_sample 0", o.noise);
        return buf;
    }
    if (o.clip > 0.0f && o.optimizer == OPT_KFAC) {
        snprintf(buf, sizeof buf, "--clip_per_sample %g with --optimizer kfac: K-FAC's factors are statistics of the "
                 "unclipped inputs and output gradients (not private, and clipping rescales only some of the latter); "
                 "use clipping with sgd, adamw, muon or shampoo", o.clip);
        return buf;
    }
    if (o.precond == PRECOND_FISHER_DIAG && o.optimizer != OPT_SGD)
        return std::string("--precond fisher_diag preconditions SGD-momentum's gradient, found --optimizer ") +
               OPTIMIZER_NAMES[o.optimizer] + " (use --optimizer sgd)";
    if (o.precond == PRECOND_FISHER_DIAG && o.noise > 0.0f) {
        snprintf(buf, sizeof buf, "--precond fisher_diag with --noise_multiplier %g: the Fisher statistics are not "
                 "privatised, the run would not be DP-SGD (use one or the other)", o.noise);
        return buf;
    }
    if (o.precond == PRECOND_FISHER_DIAG && !(o.fisher_power >= 0.25f && o.fisher_power <= 1.0f)) {
        snprintf(buf, sizeof buf, "--fisher_power expects a number in [0.25, 1] with --precond fisher_diag, found %g",
                 o.fisher_power);
        return buf;
    }
    return "";
}
// epoch: epochs completed; step: optimizer steps done (epoch * ceil(train_images / batch_size)); opt: the optimizer
// and schedule (total_steps is not stored: it is epochs * steps per epoch); train_images: the training images used.
struct CheckpointMeta {
    int epoch = 0, step = 0, batch_size = 0, seed = 0, has_optimizer = 0, epochs = 0, train_images = 0;
    float test_accuracy = 0;
    OptConfig opt;
};
// The optimizer state's tensors: m1 under optimizer_prefix (SGD's momentum buffer, AdamW's first moment, Muon's
// momentum buffer of the weights and AdamW's first moment of the biases), m2 under "adam_v." where used (Muon: the
// biases' second moments, zeros for the weights); Shampoo and K-FAC also their factors and roots
// (precond_state_tensors).
static bool sgd_like(const OptConfig& o) {
    return o.optimizer == OPT_SGD || ((o.optimizer == OPT_SHAMPOO || o.optimizer == OPT_KFAC) && o.graft == GRAFT_SGD);
}
static const char* optimizer_prefix(const OptConfig& o) {
    return sgd_like(o) ? "momentum_buffer." : o.optimizer == OPT_MUON ? "muon_m." : "adam_m.";
}
static bool uses_m2(const OptConfig& o) { return !sgd_like(o); }
static const char* const FISHER_PREFIX = "fisher_diag.";  // --precond fisher_diag's average of the Fisher diagonal
// The optimizer state's square matrices by name (n x n each; ptr: the model's buffer, when mo is given) and its
// flags tensor (one int32 per entry of flags: Shampoo's has_root per block, K-FAC's has_inv per factor block):
//   shampoo_{L,R,Linv,Rinv}.<weight>.<r0>.<c0> (per block), shampoo_has_root;
//   kfac_{G,Ginv}.<weight>.<r0>, kfac_{A,Ainv}.<weight>.<c0> (per factor block), kfac_has_inv.
struct StateMatrix { std::string name; int n; float* ptr; };
struct PrecondState {
    std::vector<StateMatrix> mats;
    const char* flags_name = nullptr;
    std::vector<int*> flags;  // the model's flags (when mo is given), else null entries
};
static PrecondState precond_state_tensors(const OptConfig& o, MatrixOpt* mo) {
    PrecondState st;
    if (o.optimizer == OPT_SHAMPOO) {
        static const char* const kinds[4] = {"L", "R", "Linv", "Rinv"};
        std::vector<PrecondBlock> fresh = mo ? std::vector<PrecondBlock>() : shampoo_blocks(o.max_precond_dim);
        std::vector<PrecondBlock>& blocks = mo ? mo->blocks : fresh;
        for (PrecondBlock& b : blocks) {
            float* ptrs[4] = {b.L, b.R, b.Linv, b.Rinv};
            for (int kind = 0; kind < 4; kind++)
                st.mats.push_back({std::string("shampoo_") + kinds[kind] + "." + PARAMS[MATRIX_PARAMS[b.mat]].name +
                                   "." + std::to_string(b.r0) + "." + std::to_string(b.c0),
                                   kind % 2 ? b.cols : b.rows, ptrs[kind]});
            st.flags.push_back(mo ? &b.has_root : nullptr);
        }
        st.flags_name = "shampoo_has_root";
    } else if (o.optimizer == OPT_KFAC) {
        std::vector<KfacFactor> fresh = mo ? std::vector<KfacFactor>() : kfac_factors(o.max_precond_dim);
        std::vector<KfacFactor>& factors = mo ? mo->factors : fresh;
        for (KfacFactor& f : factors) {
            const std::string where = std::string(".") + PARAMS[MATRIX_PARAMS[f.mat]].name + "." + std::to_string(f.i0);
            st.mats.push_back({std::string("kfac_") + (f.side ? "A" : "G") + where, f.n, f.F});
            st.mats.push_back({std::string("kfac_") + (f.side ? "Ainv" : "Ginv") + where, f.n, f.Finv});
            st.flags.push_back(mo ? &f.has_inv : nullptr);
        }
        st.flags_name = "kfac_has_inv";
    }
    return st;
}

// --precond_delay's roots in flight at a checkpoint (an epoch end between a due step s and its switch s + D) are
// stored as pending.<the live root's name> (zeros where the root failed), pending.root_ok (int32, one per root: it was
// computed) and pending.switch_in (int32 (1): steps from the checkpoint's step to the switch, 0..precond_delay - 1),
// so that --resume swaps them in at the step where the uninterrupted run does.
static const char* const PENDING_PREFIX = "pending.";
static const char* const PENDING_OK = "pending.root_ok";
static const char* const PENDING_SWITCH = "pending.switch_in";
// The roots among the state's matrices (Shampoo's Linv and Rinv per block, K-FAC's inverses), in precond_root_jobs'
// order
static std::vector<StateMatrix> precond_root_mats(const PrecondState& st, int optimizer) {
    std::vector<StateMatrix> roots;
    for (size_t k = 0; k < st.mats.size(); k++)
        if (optimizer == OPT_SHAMPOO ? k % 4 >= 2 : k % 2 == 1) roots.push_back(st.mats[k]);
    return roots;
}

// Returns "" or a message naming the path. Joins --precond_delay's roots thread first.
static std::string mnist_save_checkpoint(Mnist* m, const char* path, const CheckpointMeta& meta) {
    std::vector<float> internal(m->n_params), p(m->n_params), s1(m->n_params), s2(m->n_params);
    mnist_copy_out(m, m->params, internal.data(), m->n_params);
    for (int i = 0; i < N_PARAM_TENSORS; i++)
        param_to_torch(i, internal.data() + PARAMS[i].offset, p.data() + PARAMS[i].offset);
    std::vector<BinWriterTensor> ts;
    for (int i = 0; i < N_PARAM_TENSORS; i++) {
        const ParamInfo& pi = PARAMS[i];
        ts.push_back({pi.name, 0, pi.ndim, {pi.shape[0], pi.shape[1], pi.shape[2], pi.shape[3]}, p.data() + pi.offset});
    }
    if (meta.has_optimizer) {
        mnist_copy_out(m, m->m1, internal.data(), m->n_params);
        for (int i = 0; i < N_PARAM_TENSORS; i++)
            param_to_torch(i, internal.data() + PARAMS[i].offset, s1.data() + PARAMS[i].offset);
        mnist_copy_out(m, m->m2, internal.data(), m->n_params);
        for (int i = 0; i < N_PARAM_TENSORS; i++)
            param_to_torch(i, internal.data() + PARAMS[i].offset, s2.data() + PARAMS[i].offset);
        const char* pre1 = optimizer_prefix(meta.opt);
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const ParamInfo& pi = PARAMS[i];
            ts.push_back({std::string(pre1) + pi.name, 0, pi.ndim, {pi.shape[0], pi.shape[1], pi.shape[2], pi.shape[3]},
                          s1.data() + pi.offset});
        }
        if (uses_m2(meta.opt))
            for (int i = 0; i < N_PARAM_TENSORS; i++) {
                const ParamInfo& pi = PARAMS[i];
                ts.push_back({std::string("adam_v.") + pi.name, 0, pi.ndim,
                              {pi.shape[0], pi.shape[1], pi.shape[2], pi.shape[3]}, s2.data() + pi.offset});
            }
    }
    // Shampoo's and K-FAC's factors and roots, and which have roots
    PrecondState st;
    if (meta.has_optimizer && m->mo && m->mo->optimizer == meta.opt.optimizer)
        st = precond_state_tensors(meta.opt, m->mo);
    std::vector<std::vector<float>> mats(st.mats.size());
    std::vector<int32_t> flags;
    for (size_t k = 0; k < st.mats.size(); k++) {
        const StateMatrix& sm = st.mats[k];
        mats[k].resize((size_t)sm.n * sm.n);
        mnist_copy_out(m, sm.ptr, mats[k].data(), mats[k].size());
        ts.push_back({sm.name, 0, 2, {sm.n, sm.n, 0, 0}, mats[k].data()});
    }
    for (int* f : st.flags) flags.push_back(*f);
    if (!flags.empty()) ts.push_back({st.flags_name, 1, 1, {(int)flags.size(), 0, 0, 0}, flags.data()});
    std::vector<std::vector<float>> pending;  // --precond_delay's roots in flight
    std::vector<int32_t> pending_ok, switch_in;
    if (!st.mats.empty() && m->mo->pend.switch_step >= 0) {
        PrecondPending& pd = m->mo->pend;
        precond_pending_wait(m);  // the thread's roots written (the copies below wait on the training stream)
        const std::vector<StateMatrix> roots = precond_root_mats(st, meta.opt.optimizer);
        pending.resize(roots.size());
        for (size_t j = 0; j < roots.size(); j++) {
            pending[j].assign((size_t)roots[j].n * roots[j].n, 0.0f);
            if (pd.ok[j]) mnist_copy_out(m, pd.roots[j], pending[j].data(), pending[j].size());
            ts.push_back({PENDING_PREFIX + roots[j].name, 0, 2, {roots[j].n, roots[j].n, 0, 0}, pending[j].data()});
            pending_ok.push_back(pd.ok[j]);
        }
        switch_in.push_back(pd.switch_step - m->mo->step);
        ts.push_back({PENDING_OK, 1, 1, {(int)pending_ok.size(), 0, 0, 0}, pending_ok.data()});
        ts.push_back({PENDING_SWITCH, 1, 1, {1, 0, 0, 0}, switch_in.data()});
    }
    std::vector<float> fisher(m->n_params);  // --precond fisher_diag's running average, PyTorch layout
    if (meta.has_optimizer && meta.opt.precond == PRECOND_FISHER_DIAG && m->ps) {
        mnist_copy_out(m, m->ps->fisher, internal.data(), m->n_params);
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const ParamInfo& pi = PARAMS[i];
            param_to_torch(i, internal.data() + pi.offset, fisher.data() + pi.offset);
            ts.push_back({std::string(FISHER_PREFIX) + pi.name, 0, pi.ndim,
                          {pi.shape[0], pi.shape[1], pi.shape[2], pi.shape[3]}, fisher.data() + pi.offset});
        }
    }
    const OptConfig& o = meta.opt;
    std::vector<int32_t> fields = {meta.epoch, meta.step, meta.batch_size, meta.seed, o.optimizer, meta.has_optimizer,
                                   meta.epochs, fbits(o.lr), fbits(meta.test_accuracy), o.schedule, o.warmup_steps,
                                   fbits(o.lr_min), fbits(o.momentum), fbits(o.weight_decay), fbits(o.beta1),
                                   fbits(o.beta2), fbits(o.eps), meta.train_images, fbits(o.muon_lr),
                                   fbits(o.muon_momentum), o.nesterov, o.ns_steps, o.graft, o.precond_every,
                                   o.precond_start, o.max_precond_dim, fbits(o.precond_eps), fbits(o.precond_damping),
                                   fbits(o.clip), fbits(o.noise), o.precond, fbits(o.fisher_power),
                                   o.optimizer == OPT_KFAC ? fbits(o.kfac_stat_decay) : 0,
                                   precond_delay_stored(o)};
    return bin_write(path, "checkpoint", MNIST_CHECKPOINT_MAGIC, MNIST_CHECKPOINT_VERSION, fields, ts);
}
static CheckpointMeta checkpoint_meta(const BinFile* bf) {
    const int32_t* h = bf->header;
    CheckpointMeta meta;
    meta.epoch = h[CK_EPOCH]; meta.step = h[CK_STEP]; meta.batch_size = h[CK_BATCH_SIZE]; meta.seed = h[CK_SEED];
    meta.has_optimizer = h[CK_HAS_OPTIMIZER]; meta.epochs = h[CK_EPOCHS]; meta.train_images = h[CK_TRAIN_IMAGES];
    meta.test_accuracy = bin_field_f(bf, CK_TEST_ACCURACY);
    OptConfig& o = meta.opt;
    o.optimizer = h[CK_OPTIMIZER]; o.schedule = h[CK_LR_SCHEDULE]; o.warmup_steps = h[CK_WARMUP_STEPS];
    o.lr = bin_field_f(bf, CK_LR); o.lr_min = bin_field_f(bf, CK_LR_MIN); o.momentum = bin_field_f(bf, CK_MOMENTUM);
    o.weight_decay = bin_field_f(bf, CK_WEIGHT_DECAY); o.beta1 = bin_field_f(bf, CK_BETA1);
    o.beta2 = bin_field_f(bf, CK_BETA2); o.eps = bin_field_f(bf, CK_EPS);
    o.muon_lr = bin_field_f(bf, CK_MUON_LR); o.muon_momentum = bin_field_f(bf, CK_MUON_MOMENTUM);
    o.nesterov = h[CK_NESTEROV]; o.ns_steps = h[CK_NS_STEPS]; o.graft = h[CK_GRAFT];
    o.precond_every = h[CK_PRECOND_EVERY]; o.precond_start = h[CK_PRECOND_START];
    o.max_precond_dim = h[CK_MAX_PRECOND_DIM]; o.precond_eps = bin_field_f(bf, CK_PRECOND_EPS);
    o.precond_damping = bin_field_f(bf, CK_PRECOND_DAMPING);
    o.clip = bin_field_f(bf, CK_CLIP_PER_SAMPLE); o.noise = bin_field_f(bf, CK_NOISE_MULTIPLIER);
    o.precond = h[CK_PRECOND]; o.fisher_power = bin_field_f(bf, CK_FISHER_POWER);
    if (o.optimizer == OPT_KFAC) o.kfac_stat_decay = bin_field_f(bf, CK_KFAC_STAT_DECAY);
    o.precond_delay = h[CK_PRECOND_DELAY];
    o.total_steps = 1;  // set by the run from epochs and its steps per epoch
    return meta;
}
// The header: unused fields zero, every setting within its flag's range, the step that of the epoch
static std::string checkpoint_header_error(const BinFile* bf) {
    const int32_t* h = bf->header;
    for (int k = CK_FIELDS_END; k < 256; k++)
        if (h[k] != 0) return bf->path + ": header[" + std::to_string(k) + "] is " + std::to_string(h[k]) +
                              ", expected 0 (unused)";
    auto bad = [&](int slot, const std::string& found, const char* expected) {
        return bf->path + ": header[" + std::to_string(slot) + "] " + CK_FIELD_NAMES[slot] + " is " + found +
               ", expected " + expected;
    };
    struct IntField { int slot; long long lo, hi; const char* expected; };
    const IntField ints[] = {
        {CK_EPOCHS, 1, 10000, "1..10000 (--epochs)"}, {CK_EPOCH, 1, h[CK_EPOCHS], "1..epochs (epochs completed)"},
        {CK_BATCH_SIZE, 1, 2048, "1..2048 (--batch_size)"}, {CK_SEED, 0, INT_MAX, "0..2147483647 (--seed)"},
        {CK_OPTIMIZER, 0, 4, "0 (sgd), 1 (adamw), 2 (muon), 3 (shampoo) or 4 (kfac)"},
        {CK_HAS_OPTIMIZER, 0, 1, "0 or 1"},
        {CK_LR_SCHEDULE, 0, 2, "0 (constant), 1 (cosine) or 2 (linear)"},
        {CK_WARMUP_STEPS, 0, 100000000, "0..100000000 (--warmup_steps)"},
        {CK_TRAIN_IMAGES, h[CK_BATCH_SIZE], 10000000, "batch_size..10000000 (the training images used)"},
        {CK_NESTEROV, 0, 1, "0 or 1 (--muon_nesterov)"}, {CK_NS_STEPS, 1, 99, "1..99 (--ns_steps)"},
        {CK_GRAFT, 0, 1, "0 (sgd) or 1 (adam) (--graft)"},
        {CK_PRECOND_EVERY, 1, 100000000, "1..100000000 (--precond_every)"},
        {CK_PRECOND_START, 0, 100000000, "0..100000000 (--precond_start)"},
        {CK_MAX_PRECOND_DIM, 1, 16384, "1..16384 (--max_precond_dim)"},
        {CK_PRECOND, 0, 1, "0 (none) or 1 (fisher_diag) (--precond)"},
        {CK_PRECOND_DELAY, 0, is_matrix_precond(h[CK_OPTIMIZER]) ? h[CK_PRECOND_EVERY] : 0,
         is_matrix_precond(h[CK_OPTIMIZER]) ? "0..precond_every (--precond_delay)" : "0 (not shampoo or kfac)"}};
    for (const IntField& f : ints)
        if (h[f.slot] < f.lo || h[f.slot] > f.hi) return bad(f.slot, std::to_string(h[f.slot]), f.expected);
    struct FloatField { int slot; float lo, hi; const char* expected; };
    const FloatField floats[] = {
        {CK_LR, 1e-9f, 1e9f, "a learning rate in [1e-9, 1e9] (--lr)"},
        {CK_LR_MIN, 0.f, bin_field_f(bf, CK_LR), "0..lr (--lr_min)"},
        {CK_MOMENTUM, 0.f, 0.999999f, "0..0.999999 (--momentum)"},
        {CK_WEIGHT_DECAY, 0.f, 10.f, "0..10 (--weight_decay)"},
        {CK_BETA1, 0.f, 0.999999f, "0..0.999999 (--beta1)"}, {CK_BETA2, 0.f, 0.999999f, "0..0.999999 (--beta2)"},
        {CK_EPS, 1e-30f, 1.f, "1e-30..1 (--eps)"}, {CK_TEST_ACCURACY, 0.f, 100.f, "a percentage 0..100"},
        {CK_MUON_LR, 1e-9f, 1e9f, "a learning rate in [1e-9, 1e9] (--muon_lr)"},
        {CK_MUON_MOMENTUM, 0.f, 0.999999f, "0..0.999999 (--muon_momentum)"},
        {CK_PRECOND_EPS, 0.f, 1.f, "0..1 (--precond_eps)"},
        {CK_PRECOND_DAMPING, 0.f, 10.f, "0..10 (--precond_damping)"},
        {CK_CLIP_PER_SAMPLE, 0.f, 1e9f, "0..1e9 (--clip_per_sample)"},
        {CK_NOISE_MULTIPLIER, 0.f, 1e9f, "0..1e9 (--noise_multiplier)"},
        {CK_FISHER_POWER, 0.f, 1.f, "0..1 (--fisher_power)"},
        {CK_KFAC_STAT_DECAY, 0.f, h[CK_OPTIMIZER] == OPT_KFAC ? 0.999999f : 0.f,
         h[CK_OPTIMIZER] == OPT_KFAC ? "0..0.999999 (--kfac_stat_decay)" : "0 (not kfac)"}};
    for (const FloatField& f : floats) {
        float v = bin_field_f(bf, f.slot);
        if (!(v >= f.lo && v <= f.hi)) {  // NaN fails too
            char buf[32];
            snprintf(buf, sizeof buf, "%g", v);
            return bad(f.slot, buf, f.expected);
        }
    }
    const std::string combo = per_sample_flags_error(checkpoint_meta(bf).opt);
    if (!combo.empty()) return bf->path + ": header[" + std::to_string(CK_CLIP_PER_SAMPLE) + ".." +
                               std::to_string(CK_FISHER_POWER) + "]: " + combo;
    const long long steps_per_epoch = (h[CK_TRAIN_IMAGES] + h[CK_BATCH_SIZE] - 1) / h[CK_BATCH_SIZE];
    if (h[CK_STEP] != h[CK_EPOCH] * steps_per_epoch)
        return bad(CK_STEP, std::to_string(h[CK_STEP]), (std::to_string(h[CK_EPOCH] * steps_per_epoch) + " (epoch " +
                   std::to_string(h[CK_EPOCH]) + " x " + std::to_string(steps_per_epoch) + " steps of batch_size " +
                   std::to_string(h[CK_BATCH_SIZE]) + " over train_images " + std::to_string(h[CK_TRAIN_IMAGES]) +
                   ")").c_str());
    return "";
}
// A checkpoint's n x n float tensor `name` (a factor or a root): present, of that shape and finite; "" or the error
static std::string ck_square_error(const BinFile* bf, const std::string& name, int n) {
    std::string e;
    const int shape[2] = {n, n};
    const char* x = (const char*)bin_find(bf, name, 0, 2, shape, &e);
    if (!x) return e;
    for (size_t j = 0; j < (size_t)n * n; j++) {
        float v;
        memcpy(&v, x + 4 * j, 4);
        if (!std::isfinite(v)) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s: tensor %s[%zu] is %g, expected a finite number", bf->path.c_str(),
                     name.c_str(), j, v);
            return msg;
        }
    }
    return "";
}
// A checkpoint's int32 flags `name` (count of them): present and each 0 or 1; "" or the error
static std::string ck_flags_error(const BinFile* bf, const std::string& name, size_t count) {
    std::string e;
    const int shape[1] = {(int)count};
    const int32_t* x = (const int32_t*)bin_find(bf, name, 1, 1, shape, &e);
    if (!x) return e;
    for (size_t j = 0; j < count; j++)
        if (x[j] != 0 && x[j] != 1)
            return bf->path + ": tensor " + name + "[" + std::to_string(j) + "] is " + std::to_string(x[j]) +
                   ", expected 0 or 1";
    return "";
}
// The tensors: the parameters and, with has_optimizer, the optimizer's state, each of its shape and finite (a second
// moment also >= 0; Shampoo's has_root flags 0 or 1), and no other tensor
static std::string checkpoint_tensors_error(const BinFile* bf) {
    const int32_t* h = bf->header;
    const int optimizer = h[CK_OPTIMIZER];
    const OptConfig stored = checkpoint_meta(bf).opt;
    std::vector<std::string> prefixes = {""};
    if (h[CK_HAS_OPTIMIZER]) prefixes.push_back(optimizer_prefix(stored));
    if (h[CK_HAS_OPTIMIZER] && uses_m2(stored)) prefixes.push_back("adam_v.");
    if (h[CK_HAS_OPTIMIZER] && stored.precond == PRECOND_FISHER_DIAG) prefixes.push_back(FISHER_PREFIX);
    std::set<std::string> names;
    std::string e;
    char msg[512];
    for (const std::string& prefix : prefixes)
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const ParamInfo& pi = PARAMS[i];
            std::string name = prefix + pi.name;
            const char* x = (const char*)bin_find(bf, name, 0, pi.ndim, pi.shape, &e);
            if (!x) return e;
            const bool second_moment = prefix == "adam_v." || prefix == FISHER_PREFIX;
            for (size_t j = 0; j < pi.numel; j++) {
                float v;
                memcpy(&v, x + 4 * j, 4);
                if (!std::isfinite(v) || (second_moment && v < 0.f)) {
                    snprintf(msg, sizeof msg, "%s: tensor %s[%zu] is %g, expected %s", bf->path.c_str(),
                             name.c_str(), j, v, second_moment ? "a finite second moment >= 0 (not negative)"
                                                              : "a finite number");
                    return msg;
                }
            }
            names.insert(name);
        }
    const PrecondState st = h[CK_HAS_OPTIMIZER] ? precond_state_tensors(stored, nullptr) : PrecondState();
    for (const StateMatrix& sm : st.mats) {  // Shampoo's or K-FAC's factors and roots, which have roots
        if (!(e = ck_square_error(bf, sm.name, sm.n)).empty()) return e;
        names.insert(sm.name);
    }
    if (st.flags_name) {
        if (!(e = ck_flags_error(bf, st.flags_name, st.flags.size())).empty()) return e;
        names.insert(st.flags_name);
    }
    if (st.flags_name && bin_has(bf, PENDING_SWITCH)) {  // --precond_delay's roots in flight, all of them
        const int one[1] = {1};
        const int32_t* in = (const int32_t*)bin_find(bf, PENDING_SWITCH, 1, 1, one, &e);
        if (!in) return e;
        if (in[0] < 0 || in[0] >= stored.precond_delay)
            return bf->path + ": tensor " + PENDING_SWITCH + "[0] is " + std::to_string(in[0]) + ", expected 0.." +
                   "precond_delay - 1 (the steps to the pending roots' switch; header[" +
                   std::to_string(CK_PRECOND_DELAY) + "] precond_delay is " + std::to_string(stored.precond_delay) +
                   ")";
        names.insert(PENDING_SWITCH);
        const std::vector<StateMatrix> roots = precond_root_mats(st, optimizer);
        for (const StateMatrix& sm : roots) {
            const std::string name = PENDING_PREFIX + sm.name;
            if (!(e = ck_square_error(bf, name, sm.n)).empty()) return e;
            names.insert(name);
        }
        if (!(e = ck_flags_error(bf, PENDING_OK, roots.size())).empty()) return e;
        names.insert(PENDING_OK);
    }
    for (const BinTensor& t : bf->tensors)
        if (!names.count(t.name))
            return bf->path + ": tensor " + printable(t.name) + " is not one of this checkpoint's (the model's "
                   "parameters" + (h[CK_HAS_OPTIMIZER] ? std::string(" and ") + OPTIMIZER_NAMES[optimizer] +
                   "'s state" : std::string("")) + ")";
    if (bf->tensors.size() != names.size())
        return bf->path + ": holds " + std::to_string(bf->tensors.size()) + " tensors, expected " +
               std::to_string(names.size()) + " (a tensor appears twice)";
    return "";
}
// Checks everything a checkpoint claims before a byte of it is used: every header field in the range of its flag
// (the ranges train_mnist can write), step = epoch x steps per epoch, exactly the tensors of the model and of the
// optimizer state the header announces with their shapes, every value finite and AdamW's second moments >= 0.
// "" or a message naming the file and the field or tensor.
static std::string checkpoint_validate(const BinFile* bf) {
    params_setup();  // the tensors' sizes (before any model is built)
    std::string e = checkpoint_header_error(bf);
    return e.empty() ? checkpoint_tensors_error(bf) : e;
}
// Reads and validates a checkpoint (what: its role, as "--load checkpoint"). "" or a message.
static std::string checkpoint_read(BinFile* bf, const char* path, const char* what) {
    std::string e = bin_open(bf, path, MNIST_CHECKPOINT_MAGIC, MNIST_CHECKPOINT_VERSION, what);
    return e.empty() ? checkpoint_validate(bf) : e;
}
// Loads a validated checkpoint's parameters and, when with_optimizer, its optimizer state into the model.
static void mnist_load_checkpoint_state(Mnist* m, const BinFile* bf, bool with_optimizer) {
    std::vector<float> internal(m->n_params);
    auto load_set = [&](const std::string& prefix, float* dst) {
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const float* src = (const float*)bin_expect(bf, (prefix + PARAMS[i].name).c_str(), 0, PARAMS[i].ndim,
                                                        PARAMS[i].shape);
            param_from_torch(i, src, internal.data() + PARAMS[i].offset);
        }
        mnist_copy_in(m, dst, internal.data(), m->n_params);
    };
    load_set("", m->params);
    if (with_optimizer) {
        const OptConfig stored = checkpoint_meta(bf).opt;
        load_set(optimizer_prefix(stored), m->m1);
        if (uses_m2(stored)) load_set("adam_v.", m->m2);
        if (stored.precond == PRECOND_FISHER_DIAG) {  // m->opt is the stored one (resume_settings)
            if (!m->ps) die(bf->path + ": holds the Fisher average of --precond fisher_diag, the model has none");
            load_set(FISHER_PREFIX, m->ps->fisher);
        }
        if (stored.optimizer == OPT_SHAMPOO || stored.optimizer == OPT_KFAC) {
            // m->opt is the stored one (resume_settings): the same blocks
            if (m->opt.optimizer != stored.optimizer || m->opt.max_precond_dim != stored.max_precond_dim)
                die(bf->path + ": " + OPTIMIZER_NAMES[stored.optimizer] + "'s state has blocks of max_precond_dim " +
                    std::to_string(stored.max_precond_dim) + ", the model is set up for " +
                    (m->opt.optimizer == stored.optimizer ? std::to_string(m->opt.max_precond_dim)
                                                          : "another optimizer"));
            matrix_opt_ensure(m);
            const PrecondState st = precond_state_tensors(stored, m->mo);
            for (const StateMatrix& sm : st.mats) {
                const int sh[2] = {sm.n, sm.n};
                const float* src = (const float*)bin_expect(bf, sm.name.c_str(), 0, 2, sh);
                mnist_copy_in(m, sm.ptr, src, (size_t)sm.n * sm.n);
            }
            const int shape[1] = {(int)st.flags.size()};
            const int32_t* flags = (const int32_t*)bin_expect(bf, st.flags_name, 1, 1, shape);
            for (size_t k = 0; k < st.flags.size(); k++) *st.flags[k] = flags[k];
            if (stored.optimizer == OPT_KFAC) { kfac_block_roots(m->mo); m->mo->kfac_seen = 1; }
            if (bin_has(bf, PENDING_SWITCH)) {  // --precond_delay's roots in flight: swapped in at the stored step
                PrecondPending& pd = m->mo->pend;
                precond_pending_alloc(m);
                const std::vector<StateMatrix> roots = precond_root_mats(st, stored.optimizer);
                const int n_roots[1] = {(int)roots.size()}, one[1] = {1};
                const int32_t* ok = (const int32_t*)bin_expect(bf, PENDING_OK, 1, 1, n_roots);
                for (size_t j = 0; j < roots.size(); j++) {
                    const int sh[2] = {roots[j].n, roots[j].n};
                    const std::string name = PENDING_PREFIX + roots[j].name;
                    mnist_copy_in(m, pd.roots[j], (const float*)bin_expect(bf, name.c_str(), 0, 2, sh),
                                  (size_t)roots[j].n * roots[j].n);
                }
                pd.ok.assign(ok, ok + roots.size());
                pd.switch_step = checkpoint_meta(bf).step + *(const int32_t*)bin_expect(bf, PENDING_SWITCH, 1, 1, one);
            }
        }
    }
}
// Reads, validates and loads a checkpoint (with_optimizer: its optimizer state too, which must be expect_optimizer's);
// ends the run with a message on a bad file (dev/test_mnist.cu).
[[maybe_unused]] static CheckpointMeta mnist_load_checkpoint(Mnist* m, const char* path, bool with_optimizer,
                                                             int expect_optimizer) {
    BinFile bf;
    std::string e = checkpoint_read(&bf, path, "checkpoint");
    if (!e.empty()) die(e);
    CheckpointMeta meta = checkpoint_meta(&bf);
    if (with_optimizer && !meta.has_optimizer)
        die(std::string(path) + ": header[8] has_optimizer is 0, expected 1 (the optimizer state is needed)");
    if (with_optimizer && meta.opt.optimizer != expect_optimizer)
        die(std::string(path) + ": header[7] optimizer is " + std::to_string(meta.opt.optimizer) + ", expected " +
            std::to_string(expect_optimizer) + " (" + OPTIMIZER_NAMES[expect_optimizer] + ")");
    mnist_load_checkpoint_state(m, &bf, with_optimizer);
    return meta;
}

// ================================================================================================================
// 6. THE FAST PATH
//   conv2's forward, input gradient and weight gradient on TF32 tensor cores (wgmma on sm_90a, mma.sync elsewhere)
//   with conv1 and the max-pool fused into them; fc1's forward and backward kernels; the head; the fused forward.
//   Forward: conv2_forward_tf32, fc1_forward_kernel, head_kernel (or the fused forward: conv2_forward_tf32 with a
//   FwdHead); backward: fc1_backward, conv2_dgrad_tf32, conv2_wgrad_tf32 (mnist_forward_loss, mnist_backward)
// ================================================================================================================
// ----------------------------------------------------------------------------------------------------------------
// conv2 on TF32 tensor cores (the default: --matmul ours --tf32 1). The same implicit GEMMs as above (forward
// 36864x64x288, input gradient 43264x32x576, weight gradient 64x288x36864 at batch 64), specialised to the layer
// so that no operand byte is fetched twice from L2 for one band of image rows:
//  - conv2_band_tf32_kernel (forward) and conv2_dgrad_tf32_kernel (input gradient): the 3x3 x C weights live in
//    shared memory for the whole (persistent) block; for each band of output rows (forward: R rows of one image;
//    input gradient: a run of consecutive pixels) the block loads the input patch once and reads the 9 taps' im2col
//    rows out of it (a GEMM row is a pixel, its k = (tap, channel)).
//  - conv2_wgrad_tf32_kernel: a block owns the whole 64 x 288 weight gradient for the bands it is given (GEMM k =
//    pixel), partial sums per block (pairs added through distributed shared memory), then, after a grid barrier in
//    the same kernel, added in a fixed order (deterministic) together with conv1's, and the optimizer step applied.
// Every operand is rounded once to TF32 when it lands in shared memory ((bits + 0x1000) & ~0x1fff: round to
// nearest, ties away, as cvt.rna), laid out in wgmma's K-major "no swizzle" core matrices; where the build has sm_90a
// code (MNIST_WGMMA) all three products run on wgmma (both operands from shared memory, fp32 accumulation), elsewhere
// on mma.sync m16n8k8 with plain 32-bit shared loads of the same layout. Strict fp32 (--tf32 0) keeps the generic
// kernel above.
__device__ __forceinline__ float tf32_round(float x) {
    return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u);
}
__device__ __forceinline__ float4 tf32_round4(float4 v) {
    return make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
}
__device__ __forceinline__ void mma_tf32_16x8x8(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A fragment of mma m16n8k8 (.row A, 16 x 8) from shared memory: p points at element (m = g, k = t) of the tile,
// ms and ks are the distances between consecutive m and consecutive k (row-major A: ld, 1; k-major A: 1, ld)
__device__ __forceinline__ void lds_a_frag(uint32_t (&a)[4], const float* p, int ms, int ks) {
    a[0] = __float_as_uint(p[0]);
    a[1] = __float_as_uint(p[8 * ms]);
    a[2] = __float_as_uint(p[4 * ks]);
    a[3] = __float_as_uint(p[8 * ms + 4 * ks]);
}
// One warp's tile of C += A B from shared memory on mma m16n8k8: acc[MI][NI] holds rows 0..16MI of A times columns
// 0..8NI of B (A and B point at the warp's first row / column), summed over k in [0, K) in steps of 8. A's element
// (m, k) is A[m * ams + k * aks], B's (k, n) is B[k * bks + n * bns]; both already rounded to TF32.
template <int MI, int NI, int K, int UNROLL>
__device__ __forceinline__ void warp_mma_smem(float (&acc)[MI][NI][4], const float* A, int ams, int aks,
                                              const float* B, int bks, int bns, int g, int t) {
#pragma unroll UNROLL
    for (int kk = 0; kk < K; kk += 8) {
        uint32_t a[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) lds_a_frag(a[mi], A + (mi * 16 + g) * ams + (kk + t) * aks, ams, aks);
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            const float* pb = B + (kk + t) * bks + (ni * 8 + g) * bns;
            uint32_t b0 = __float_as_uint(pb[0]), b1 = __float_as_uint(pb[4 * bks]);
#pragma unroll
            for (int mi = 0; mi < MI; mi++) mma_tf32_16x8x8(acc[mi][ni], a[mi], b0, b1);
        }
    }
}
template <int MI, int NI>
__device__ __forceinline__ void acc_zero(float (&acc)[MI][NI][4]) {
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.0f;
}
// Hopper warpgroup MMA (wgmma, sm_90a: the Makefile builds train_mnist for sm_90a where it builds sm_90; any other
// target takes the mma.sync code, MNIST_WGMMA 0). Operands from shared memory in the "no swizzle" K-major layout: a
// core matrix is 8 rows of 4 TF32 values, 16 contiguous bytes a row; a descriptor holds the start address, the byte
// distance between the 2 core matrices of a k-step (LBO, along K) and between consecutive 8-row groups (SBO, along M
// or N), each / 16 (bits 0-13, 16-29, 32-45; layout bits 62-63 = 0: no swizzle). A shared-memory offset of o bytes
// is added to a descriptor as o / 16 (the address field never carries over: shared addresses are < 2^18).
// The accumulators (fp32, N / 2 per thread): warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8, in
// d[4 i + 2 h + e] = D[16 w + g + 8 h][8 i + 2 t + e]. Stores into the operands go through the generic proxy:
// fence_proxy_async, then a barrier, before a wgmma reads them.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MNIST_WGMMA 1
#else
#define MNIST_WGMMA 0
#endif
__device__ __forceinline__ uint64_t wgmma_desc(const float* p, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
__device__ __forceinline__ void fence_proxy_async() {
#if MNIST_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if MNIST_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if MNIST_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N_PENDING>
__device__ __forceinline__ void wgmma_wait() {
#if MNIST_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N_PENDING) : "memory");
#endif
}
// keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma
template <int NR>
__device__ __forceinline__ void acc_fence(float (&d)[NR]) {
#pragma unroll
    for (int i = 0; i < NR; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// D (64 x N) += A (64 x 8) B (N x 8)^T, A and B by descriptor, TF32 in, fp32 accumulate
__device__ __forceinline__ void wgmma_m64n96k8_ss(float (&d)[48], uint64_t da, uint64_t db) {
#if MNIST_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
                 "%40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
                   "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
                   "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
                   "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "l"(da), "l"(db), "n"(1));
#endif
}
__device__ __forceinline__ void wgmma_m64n48k8_ss(float (&d)[24], uint64_t da, uint64_t db) {
#if MNIST_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                 "%21, %22, %23}, %24, %25, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
                   "+f"(d[23])
                 : "l"(da), "l"(db), "n"(1));
#endif
}
// 16-byte asynchronous copy global -> shared (cp.async, sm_80+), and its group bookkeeping
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
// A bulk copy global -> shared by the tensor memory accelerator (cp.async.bulk, sm_90): one instruction for `bytes`
// (a multiple of 16, both addresses 16-byte aligned), its completion counted on a shared-memory mbarrier. One thread
// initialises the barrier (arrival count 1; a __syncthreads must follow before any thread waits on it), one thread
// issues the expected byte count and the copy (any time after), and every thread that reads the data waits for phase
// 0 (which completes only once both the arrival and the bytes are in). Before sm_90 the three trap: the host uses
// them only where g_run.bulk_copy says the GPU has them.
__device__ __forceinline__ void bulk_copy_init(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                 "fence.mbarrier_init.release.cluster;\n"
                 "fence.proxy.async.shared::cta;\n" :: "r"((uint32_t)__cvta_generic_to_shared(bar)) : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void bulk_copy_issue(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(b), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes), "r"(b) : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void bulk_copy_wait(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred p;\nBULK_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
                 "@!p bra BULK_WAIT_%=;\n}\n" :: "r"((uint32_t)__cvta_generic_to_shared(bar)) : "memory");
#else
    __trap();
#endif
}

// The max-pool's window codes (fast path): the forward stores, next to each pooled value, which of its 2x2 window's
// act2 values it is (0..3 = (dy, dx) = (0,0), (0,1), (1,0), (1,1): the first maximum in that order, PyTorch's choice)
// or 4 when the pooled value is not > 0 (then the ReLU in front of the pool passes no gradient). The backward then
// never needs act2 (9.4 MB at batch 64) nor a materialised dact2: dact2 = the pooled gradient at the window's code
// position, 0 at the other three, rebuilt by the kernels that read it. A byte per pooled value (0.6 MB at batch 64).
constexpr uint8_t POOL_NO_GRAD = 4;
__device__ __forceinline__ uint8_t pool_window(float tl, float tr, float bl, float br, float& m) {
    uint8_t a = 0;
    m = tl;
    if (tr > m) { m = tr; a = 1; }
    if (bl > m) { m = bl; a = 2; }
    if (br > m) { m = br; a = 3; }
    return m > 0.0f ? a : POOL_NO_GRAD;
}
// dact2[b, y, x, c..c+3] from the pooled gradient dpooled (B,12,12,64) and the window codes (same layout): the index
// of the pooled chunk, the expansion of a loaded chunk d and its 4 codes k, and both in one
__device__ __forceinline__ size_t pooled_index(int b, int y, int x, int c) {
    return (((size_t)b * HP + (y >> 1)) * HP + (x >> 1)) * C2 + c;
}
__device__ __forceinline__ float4 dact2_expand(float4 d, uint32_t k, int y, int x) {
    const uint32_t me = ((y & 1) << 1) | (x & 1);
    return make_float4((k & 255u) == me ? d.x : 0.0f, ((k >> 8) & 255u) == me ? d.y : 0.0f,
                       ((k >> 16) & 255u) == me ? d.z : 0.0f, (k >> 24) == me ? d.w : 0.0f);
}
__device__ __forceinline__ float4 dact2_from_pooled(const float* __restrict__ dpooled,
                                                    const uint8_t* __restrict__ codes, int b, int y, int x, int c) {
    size_t i = pooled_index(b, y, x, c);
    return dact2_expand(__ldg((const float4*)(dpooled + i)), __ldg((const unsigned int*)(codes + i)), y, x);
}

// Grid-wide barrier, for a grid whose blocks are all resident at once: conv2_tf32_setup sizes the weight-gradient grid
// by the occupancy calculator (one block, or one cluster of blocks, per SM or SM group, nothing else of ours on the SM
// while it runs), and the fused forward only runs where its grid fits one block per SM; a successor launched with
// programmatic dependent launch cannot take an SM before every block of this grid has started (it is released by
// grid_dep_sync or grid_dep_launch, which every block executes). The kernels that use it (the weight gradient once, the
// fused forward twice) share one counter: they run one after the other in the stream. *bar only grows (64 bits: it
// never wraps): every barrier adds exactly GRID_BAR_K to it, whatever its grid size (block b adds K / G, plus 1 for the
// first K % G blocks), so a barrier starts at a multiple of K, a block's arrival (which returns the count before it)
// tells which, and the block spins (one thread, an L2 load per round trip) until the count reaches the next multiple.
// (A block can arrive at a kernel's second barrier only after every block arrived at its first: the count has passed
// the first's target by then, which its last waiters still see.) One atomic per block, no reset: nothing but the last
// arrival itself on the barrier's critical path. Writes before the barrier are visible to every block after it
// (__syncthreads + __threadfence, as cooperative groups' grid sync). Split in two: grid_barrier_arrive returns the
// block's arrival rank in this launch (the count before it, in units of K / G: 0 for the first block to arrive), so
// that the first blocks can do work that the barrier does not guard while the others are still coming;
// grid_barrier_wait then waits.
constexpr unsigned long long GRID_BAR_K = 1ull << 20;  // > any grid size
struct GridBarrier { unsigned long long target; int rank; };
__device__ GridBarrier grid_barrier_arrive(unsigned long long* bar) {
    __shared__ GridBarrier sb;
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned long long G = gridDim.x, add = GRID_BAR_K / G + (blockIdx.x < GRID_BAR_K % G ? 1 : 0);
        __threadfence();
        const unsigned long long old = atomicAdd(bar, add);
        sb.target = (old / GRID_BAR_K + 1) * GRID_BAR_K;
        // r arrivals added between r * (K / G) and r * (K / G + 1)
        sb.rank = (int)((old % GRID_BAR_K) / (GRID_BAR_K / G));
    }
    __syncthreads();
    return sb;
}
__device__ int* g_watchdog_dev = nullptr;  // g_watchdog's device address (set by conv2_tf32_setup)
__device__ void grid_barrier_wait(unsigned long long* bar, unsigned long long target, int watchdog_id) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long c, t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(bar) : "memory");
            if (c >= target) break;
            // a watchdog, not a timing: if the blocks were not all resident (e.g. an SM limit imposed from outside,
            // such as MPS), the barrier would never open; fail loudly instead of hanging
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t - t0 > 2000000000ull) {
                if (g_watchdog_dev) { *(volatile int*)g_watchdog_dev = watchdog_id; __threadfence_system(); }
                __trap();
            }
        }
        __threadfence();
    }
    __syncthreads();
}
// The head of one row, by one warp, from fc1's output h (lane l holds h[4l .. 4l + 3], ReLU applied): logits = h
// Wf2^T + bf2 (ws: Wf2 [10][128], bs: bf2, in shared memory; fp32 FMAs, a lane's 4 inputs then butterfly sums), the
// fused log-softmax + NLL (warp_log_softmax_nll), and when dlogits is given dlogits = (softmax - onehot) / B and fc2's
// input gradient dh = dlogits Wf2, zeroed where h <= 0 (fc1's ReLU). head_kernel and the fused forward run it.
__device__ __forceinline__ void head_row(float4 hv, int row, int lane, const float* ws, const float* bs, float* logits,
                                         float* dlogits, float* dh, float* losses, int* preds, const int* y,
                                         const int* counters, int offset_const, int B) {
    static_assert(FC_H == 128 && NCLS <= 32, "a lane holds 4 of fc1's 128 outputs; a class per lane");
    float v = -INFINITY;
#pragma unroll
    for (int j = 0; j < NCLS; j++) {
        float4 wv = *(const float4*)(ws + j * FC_H + 4 * lane);
        float d = hv.x * wv.x;
        d = fmaf(hv.y, wv.y, d); d = fmaf(hv.z, wv.z, d); d = fmaf(hv.w, wv.w, d);
        for (int o = 16; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffff, d, o);
        if (lane == j) v = d + bs[j];
    }
    if (lane < NCLS) logits[row * NCLS + lane] = v;
    float e, sum;
    int label;
    warp_log_softmax_nll(v, lane, y, row, counters, offset_const, losses, preds, e, sum, label);
    if (!dlogits) return;
    float gl = lane < NCLS ? (e / sum - (lane == label ? 1.0f : 0.0f)) / (float)B : 0.0f;
    if (lane < NCLS) dlogits[row * NCLS + lane] = gl;
    float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < NCLS; j++) {
        float gj = __shfl_sync(0xffffffff, gl, j);
        float4 wv = *(const float4*)(ws + j * FC_H + 4 * lane);
        d.x = fmaf(gj, wv.x, d.x); d.y = fmaf(gj, wv.y, d.y); d.z = fmaf(gj, wv.z, d.z); d.w = fmaf(gj, wv.w, d.w);
    }
    if (!(hv.x > 0.0f)) d.x = 0.0f;
    if (!(hv.y > 0.0f)) d.y = 0.0f;
    if (!(hv.z > 0.0f)) d.z = 0.0f;
    if (!(hv.w > 0.0f)) d.w = 0.0f;
    *(float4*)(dh + (size_t)row * FC_H + 4 * lane) = d;
}

// fc1's split-K partial sums are added by these two everywhere (fc1_forward_kernel's clusters, head_kernel, the fused
// forward), so every path adds them in the same order: v[0] + v[1] + ... left to right, per component; then fc1's
// bias and ReLU
template <int N> __device__ __forceinline__ float4 f4_sum_in_order(const float4 (&v)[N]) {
    float4 s = v[0];
#pragma unroll
    for (int i = 1; i < N; i++) { s.x += v[i].x; s.y += v[i].y; s.z += v[i].z; s.w += v[i].w; }
    return s;
}
__device__ __forceinline__ float4 f4_bias_relu(float4 h, float4 b) {
    return make_float4(fmaxf(h.x + b.x, 0.0f), fmaxf(h.y + b.y, 0.0f), fmaxf(h.z + b.z, 0.0f), fmaxf(h.w + b.w, 0.0f));
}

// The phases of conv2_band_tf32_kernel (below), in the order it runs them.
// conv2.weight into Ws, issued: from its forward image (use_img) by one bulk copy from thread 0, else raw
// [co][tap][ci] into [tap][ci / 4][co][ci % 4] by 16-byte cp.async
template <int CIN, int COUT, int NW, int NT>
__device__ __forceinline__ void band_weights_issue(float* Ws, const float* __restrict__ w, bool use_img,
                                                   const float* wimg, uint64_t* wbar, int tid) {
    if (use_img) {
        if (tid == 0) bulk_copy_issue(Ws, wimg, 9 * COUT * CIN * sizeof(float), wbar);
        return;
    }
#pragma unroll
    for (int i = 0; i < NW; i++) {
        const int ch = tid + i * NT, co = ch / (9 * CIN / 4), tap = (ch / (CIN / 4)) % 9, c4 = ch % (CIN / 4);
        cp_async16(Ws + ((tap * (CIN / 4) + c4) * COUT + co) * 4, w + 4 * ch);
    }
    cp_async_commit();
}
// conv2's weights landed: the bulk copy's image is already rounded; cp.async chunks are rounded by the thread that
// copied them
template <int CIN, int COUT, int NW, int NT>
__device__ __forceinline__ void band_weights_land(float* Ws, bool use_img, uint64_t* wbar, int tid) {
    if (use_img) { bulk_copy_wait(wbar); return; }
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < NW; i++) {
        const int ch = tid + i * NT, co = ch / (9 * CIN / 4), tap = (ch / (CIN / 4)) % 9, c4 = ch % (CIN / 4);
        float4* p = (float4*)(Ws + ((tap * (CIN / 4) + c4) * COUT + co) * 4);
        *p = tf32_round4(*p);
    }
}
// the fused forward: fc1.weight's K slice of this block into Wf (raw; rounded after the bands), by cp.async
template <int NT, int NWF, int FCH>
__device__ __forceinline__ void fused_wf1_issue(float* Wf, bool fused, const float* wf1, int tid) {
    if (!fused) return;
#pragma unroll 1
    for (int i = 0; i < NWF; i++) {
        const int ch = tid + i * NT, j = ch / FCH, c4 = ch % FCH;
        cp_async16(Wf + j * FC1F_LD + 4 * c4, wf1 + (size_t)j * FC_IN + blockIdx.x * FC1F_KC + 4 * c4);
    }
    cp_async_commit();
}
// this block's share of the input gradient's weight image (see conv2_dgrad_tf32_kernel) from the rounded Ws:
// [ky][co / 4][kx][ci][co % 4] for the flipped tap 8 - tap = 3 ky + kx
template <int CIN, int COUT, int NT>
__device__ __forceinline__ void band_write_dgrad_image(float* wimg_dgrad, const float* Ws, int tid) {
    if (wimg_dgrad)
        for (int i = blockIdx.x * NT + tid; i < COUT * 9 * CIN; i += gridDim.x * NT) {
            const int co = i / (9 * CIN), tap = (i / CIN) % 9, ci = i % CIN;
            wimg_dgrad[((((8 - tap) / 3 * (COUT / 4) + co / 4) * 3 + (8 - tap) % 3) * CIN + ci) * 4 + co % 4] =
                Ws[((tap * (CIN / 4) + ci / 4) * COUT + co) * 4 + ci % 4];
        }
}
// conv1 of the band's act1 rows y0 .. y0 + PR - 1 into the patch Ps (rounded to TF32), a pixel's 8 channels
// c0..c0+3 and c0+16..c0+19 per thread (strict fp32: per channel 9 fmaf in tap order from 0, then the bias and the
// ReLU); the patch rows [own_lo, own_hi) this band owns go to act1 unrounded, and their signs to act1_sign
template <int HIN, int PR, int PL, int NC1, int NT>
__device__ __forceinline__ void band_conv1(float* Ps, const float* Xs, const float* W1s, const float* B1s, float* act1,
                                           uint32_t* act1_sign, int b, int y0, int own_lo, int own_hi, int tid,
                                           int lane, int c0) {
    float4 w1r[2][9], b1r[2];  // this thread's 8 channels' weights and biases, read from shared memory once
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int k = 0; k < 9; k++) w1r[h][k] = *(const float4*)(W1s + k * C1 + c0 + h * (C1 / 2));
        b1r[h] = *(const float4*)(B1s + c0 + h * (C1 / 2));
    }
#pragma unroll
    for (int i = 0; i < NC1; i++) {
        const int pix = (tid + i * NT) / 4;  // patch pixel: row pix / HIN, column pix % HIN
        if (pix >= PR * HIN) break;
        const int r = pix / HIN, cx = pix % HIN;
        float xv[9];
#pragma unroll
        for (int k = 0; k < 9; k++) xv[k] = Xs[(r + k / 3) * IMG + cx + k % 3];
        float o[8];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int k = 0; k < 9; k++) {
                const float4 wv = w1r[h][k];
                sacc[0] = fmaf(xv[k], wv.x, sacc[0]); sacc[1] = fmaf(xv[k], wv.y, sacc[1]);
                sacc[2] = fmaf(xv[k], wv.z, sacc[2]); sacc[3] = fmaf(xv[k], wv.w, sacc[3]);
            }
            const float4 bv = b1r[h];
            o[4 * h + 0] = fmaxf(sacc[0] + bv.x, 0.0f); o[4 * h + 1] = fmaxf(sacc[1] + bv.y, 0.0f);
            o[4 * h + 2] = fmaxf(sacc[2] + bv.z, 0.0f); o[4 * h + 3] = fmaxf(sacc[3] + bv.w, 0.0f);
        }
        const float4 lo4 = make_float4(o[0], o[1], o[2], o[3]), hi4 = make_float4(o[4], o[5], o[6], o[7]);
        float* pp = Ps + ((c0 / 4) * PL + pix) * 4;  // pix = slot r * HIN + cx
        *(float4*)pp = tf32_round4(lo4);
        *(float4*)(pp + (C1 / 8) * PL * 4) = tf32_round4(hi4);
        // act1's signs for the input gradient, bit n = channel n: the pixel's 4 lanes (all present or all
        // past the patch) or their 8-channel parts together
        uint32_t sgn = 0;
#pragma unroll
        for (int j = 0; j < 4; j++)
            sgn |= (o[j] > 0.0f ? 1u : 0u) << (c0 + j) | (o[4 + j] > 0.0f ? 1u : 0u) << (c0 + C1 / 2 + j);
        const unsigned grp = 0xFu << (lane & 28);
        sgn |= __shfl_xor_sync(grp, sgn, 1);
        sgn |= __shfl_xor_sync(grp, sgn, 2);
        if (r >= own_lo && r < own_hi) {
            const size_t pi = ((size_t)b * HIN + y0 + r) * HIN + cx;
            float* dst = act1 + pi * C1 + c0;
            *(float4*)dst = lo4;
            *(float4*)(dst + C1 / 2) = hi4;
            if (act1_sign && (tid & 3) == 0) act1_sign[pi] = sgn;
        }
    }
}
// conv2's products of the band, one warpgroup's 96 pixels: D[co][n] = sum_(tap, ci) W[co][tap][ci] act1[pixel n +
// tap][ci]: m = co (64), n = the warpgroup's 96 pixels (8 columns x R rows; 8-pixel group i = row y0 + i), k = ci,
// per tap. Both operands K-major in the no-swizzle layout: A = Ws (a core matrix is 8 channels x 4 ci: SBO 128 bytes,
// LBO one plane of 4 ci), B = the patch (8 consecutive pixels of a row: SBO one patch row, LBO one plane); tap (ky,
// kx) moves B's start by ky rows and kx slots. d[4 i + 2 h + e] = D[co + 8 h][pixel (y0 + i, x0 + 2 t + e)].
template <int CIN, int COUT, int HIN, int PL>
__device__ __forceinline__ void band_conv2_products(float (&d)[48], const float* Ws, const float* Ps, int x0, int co,
                                                    int g, int t) {
#pragma unroll
    for (int i = 0; i < 48; i++) d[i] = 0.0f;
#if MNIST_WGMMA
    {
        const uint64_t da0 = wgmma_desc(Ws, COUT * 16, 128), db0 = wgmma_desc(Ps + x0 * 4, PL * 16, HIN * 16);
        wgmma_fence();
#pragma unroll
        for (int tap = 0; tap < 9; tap++)
#pragma unroll
            for (int ks = 0; ks < CIN / 8; ks++)
                wgmma_m64n96k8_ss(d, da0 + (uint64_t)((tap * (CIN / 4) + 2 * ks) * COUT),
                                  db0 + (uint64_t)(2 * ks * PL + (tap / 3) * HIN + tap % 3));
        wgmma_commit();
        wgmma_wait<0>();
        acc_fence(d);
    }
#else
    // mma.sync: this warp's channels 16 wq .. 16 wq + 15, the 12 n8 tiles (the same fragment layout)
#pragma unroll 1
    for (int tap = 0; tap < 9; tap++)
#pragma unroll
        for (int ks = 0; ks < CIN / 8; ks++) {
            const float* pa = Ws + ((tap * (CIN / 4) + 2 * ks) * COUT + co) * 4 + t;
            const float* pb = Ps + (2 * ks * PL + (tap / 3) * HIN + tap % 3 + x0 + g) * 4 + t;
            const uint32_t a[4] = {__float_as_uint(pa[0]), __float_as_uint(pa[32]), __float_as_uint(pa[COUT * 4]),
                                   __float_as_uint(pa[COUT * 4 + 32])};
#pragma unroll
            for (int i = 0; i < 12; i++)
                mma_tf32_16x8x8(*reinterpret_cast<float(*)[4]>(d + 4 * i), a, __float_as_uint(pb[i * HIN * 4]),
                                __float_as_uint(pb[(PL + i * HIN) * 4]));
        }
#endif
}
// The band's epilogue: bias and ReLU (act2 stored to out when not null: the tests); then the 2x2 max-pool into
// pooled and its window codes, all in this thread: the window of pooled (y0 / 2 + p, x0 / 2 + t) is pixels (rows 2p,
// 2p + 1) x (columns 2t, 2t + 1), d[8 p + 2 h + {0, 1, 4, 5}]
template <int COUT, int HOUT>
__device__ __forceinline__ void band_bias_relu_pool(float (&d)[48], const float (&bz)[2], float* out, float* pooled,
                                                    uint8_t* pool_codes, int b, int y0, int x0, int co, int t) {
#pragma unroll
    for (int i = 0; i < 12; i++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float& v = d[4 * i + 2 * h + e];
                v = fmaxf(v + bz[h], 0.0f);
                if (out) out[(((size_t)b * HOUT + y0 + i) * HOUT + x0 + 2 * t + e) * COUT + co + 8 * h] = v;
            }
#pragma unroll
    for (int p = 0; p < 6; p++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float m;
            const uint8_t code =
                pool_window(d[8 * p + 2 * h], d[8 * p + 2 * h + 1], d[8 * p + 4 + 2 * h], d[8 * p + 5 + 2 * h], m);
            const size_t pi = (((size_t)b * HP + y0 / 2 + p) * HP + x0 / 2 + t) * COUT + co + 8 * h;
            pooled[pi] = m;
            pool_codes[pi] = code;
        }
}
// The fused forward after the bands: fc1, this block's K slice s: the partial sum of all B rows over columns k0 ..
// k0 + 71, into fh.part (see FwdHead), after the first grid barrier (every block's pooled rows are stored)
template <int NT, int NWF, int FCH>
__device__ __forceinline__ void fused_fc1_slice(const FwdHead& fh, float* Ps, float* Wf, const float* pooled, int B,
                                                int tid, int warp, int g, int t) {
    const int s = blockIdx.x, k0 = s * FC1F_KC;
    float* Af = Ps;  // [64][FC1F_LD]: pooled's rows, columns k0 .. (the patch is free after the bands)
    GridBarrier gb = grid_barrier_arrive(fh.bar);  // this block's pooled rows are stored
    cp_async_wait<0>();  // the slice landed: each thread rounds what it copied
#pragma unroll
    for (int i = 0; i < NWF; i++) {
        const int ch = tid + i * NT;
        float4* q = (float4*)(Wf + (ch / FCH) * FC1F_LD + 4 * (ch % FCH));
        *q = tf32_round4(*q);
    }
    grid_barrier_wait(fh.bar, gb.target, 1);
    TRACE_MARK(5);
    for (int ch = tid; ch < 64 * FCH; ch += NT) {  // written by the other blocks before the barrier: L2 loads
        const int r = ch / FCH, c4 = ch % FCH;
        const float4 v = r < B ? __ldcg((const float4*)(pooled + (size_t)r * FC_IN + k0) + c4)
                               : make_float4(0.f, 0.f, 0.f, 0.f);
        *(float4*)(Af + r * FC1F_LD + 4 * c4) = tf32_round4(v);
    }
    __syncthreads();
    if (warp < 8) {  // fc1_forward_kernel's warp layout: 2 x 4 warps of 32 x 32
        const int wm2 = warp / 4, wn2 = warp % 4;
        float acc[2][4][4];
        acc_zero(acc);
        warp_mma_smem<2, 4, FC1F_KC, FC1F_KC / 8>(acc, Af + wm2 * 32 * FC1F_LD, FC1F_LD, 1, Wf + wn2 * 32 * FC1F_LD, 1,
                                                  FC1F_LD, g, t);
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int m = wm2 * 32 + mi * 16 + g + 8 * h;
                if (m >= B) continue;
                float* dst = fh.part + ((size_t)s * B + m) * FC_H + wn2 * 32 + 2 * t;
#pragma unroll
                for (int ni = 0; ni < 4; ni++)
                    __stcs((float2*)(dst + ni * 8), make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]));
            }
    }
    TRACE_MARK(6);
}
// The fused forward's end, block s < B: the head's parameters into Ws, then, once the second grid barrier (arrived at
// by the caller: every slice's partial sums are stored) opens, row s's partial sums added in fc1_forward_kernel's
// and head_kernel's order, fc1's bias and ReLU, and head_row
template <int NT>
__device__ __forceinline__ void fused_head_row(const FwdHead& fh, float* Ws, float* Ps, int B, int tid, int warp,
                                               int lane, unsigned long long bar_target) {
    const int s = blockIdx.x;
    // the head's parameters (written by the previous step's optimizer step, complete) into Ws, free after the bands
    float* W2s = Ws;            // [NCLS][FC_H]
    float* B2s = W2s + NCLS * FC_H;
    float* Bf1s = B2s + 32;     // [FC_H]
    for (int i = tid; i < NCLS * FC_H; i += NT) W2s[i] = __ldcg(fh.wf2 + i);
    if (tid < NCLS) B2s[tid] = __ldcg(fh.bf2 + tid);
    if (tid < FC_H) Bf1s[tid] = __ldcg(fh.bf1 + tid);
    grid_barrier_wait(fh.bar, bar_target, 1);
    // row s of h: warp k < 8 adds the groups 2k and 2k + 1 (8 slices each, in rank order, as a cluster of
    // fc1_forward_kernel), lane l columns 4l .. 4l + 3; then warp 0 adds the 16 groups in order (as head_kernel)
    float* gs = Ps;  // [FC1F_PARTS][FC_H]
    static_assert(FC1F_PARTS == 16 && FC1F_CLUSTER == 8 && FC_H == 128,
                  "8 warps of 2 groups of 8 slices; a float4 per lane");
    if (warp < 8) {
        float4 v[2][FC1F_CLUSTER];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int r = 0; r < FC1F_CLUSTER; r++)
                v[j][r] = __ldcs((const float4*)(fh.part + ((size_t)((2 * warp + j) * FC1F_CLUSTER + r) * B + s) * FC_H)
                                 + lane);
#pragma unroll
        for (int j = 0; j < 2; j++) *(float4*)(gs + (2 * warp + j) * FC_H + 4 * lane) = f4_sum_in_order(v[j]);
    }
    __syncthreads();
    if (warp == 0) {
        float4 p[FC1F_PARTS];
#pragma unroll
        for (int q = 0; q < FC1F_PARTS; q++) p[q] = *(const float4*)(gs + q * FC_H + 4 * lane);
        const float4 hv = f4_bias_relu(f4_sum_in_order(p), *(const float4*)(Bf1s + 4 * lane));
        *(float4*)(fh.h + (size_t)s * FC_H + 4 * lane) = hv;
        head_row(hv, s, lane, W2s, B2s, fh.logits, fh.dlogits, fh.dh, fh.losses, fh.preds, fh.y, fh.counters,
                 fh.offset, B);
    }
    TRACE_MARK(7);
}
// Chunk tid (4 pixels) of a band's x rows y0 .. y0 + R + 3: from x, or (gather) normalised from the dataset's bytes
// of sample s (staged: the batch's bytes, from the kernel in front: L2 loads); zero for threads past the XCH chunks
template <int NBAND, int R, int XCH>
__device__ __forceinline__ float4 band_load_x(const ConvInput& in, int band, int s, bool gather, bool staged, int tid) {
    const int b = band / NBAND, y0 = (band % NBAND) * R;
    if (tid >= XCH) return make_float4(0.f, 0.f, 0.f, 0.f);
    if (!gather) return __ldcg((const float4*)(in.x + ((size_t)b * IMG + y0) * IMG) + tid);
    const uchar4 u = staged ? __ldcg((const uchar4*)(in.staged + (size_t)s * IMG * IMG + y0 * IMG) + tid)
                            : ((const uchar4*)(in.images + (size_t)s * IMG * IMG + y0 * IMG))[tid];
    return make_float4(mnist_normalize(u.x), mnist_normalize(u.y), mnist_normalize(u.z), mnist_normalize(u.w));
}
// conv1 + conv2 forward: act1 = ReLU(conv1(x) + b1) (strict fp32: per channel a chain of 9 fmaf in tap order from 0,
// then the bias), then out[b, y, x, n] = ReLU(bias[n] + sum_{ky,kx,c} act1[b, y + ky, x + kx, c] * Wt[ky*3+kx][n][c]),
// NHWC, HOUT x HOUT outputs from HIN = HOUT + 2 inputs, and the 2x2 max-pool of out with its window codes; out itself
// is stored only when not null (the tests). act1 is made here, in shared memory, from the band's rows of x (a band of
// R output rows needs R + 2 act1 rows, made from R + 4 rows of x), and stored to
// global memory for the backward (each act1 row by exactly one band: the first band of an image stores rows 0..R,
// the others rows y0 + 1..y0 + R, the last up to HIN - 1), with its signs for the input gradient when act1_sign is
// not null (a 32-bit word per pixel, bit n: act1[.., n] > 0).
//   in: the input x, or the dataset to gather it from (ConvInput).
//   w: conv2.weight, internal layout [co][tap][ci]; the kernel makes Ws (below), rounded to TF32, from it, and
//   writes the input gradient's image of it to wimg_dgrad, a share per block: [ky][co / 4][kx][ci][co % 4] for the
//   flipped tap 8 - tap = 3 ky + kx (transposed, rounded to TF32; see conv2_dgrad_tf32_kernel).
// Block: 3 warpgroups; warpgroup w computes the band's 8 columns 8 w .. 8 w + 7 of all R rows (96 pixels) for all 64
// channels: D = W x patch^T, m = channel, n = pixel, k = (tap, ci): on sm_90a one wgmma m64n96k8 per tap and k-step,
// elsewhere mma.sync on the same layout. Shared memory, in wgmma's K-major "no swizzle" layout (core matrices of 8
// rows x 4 TF32 values, 16 contiguous bytes a row): Ws[9][CIN / 4][COUT][4] (the weights), Ps[CIN / 4][PL][4] (the
// band's act1 patch, slot = row * HIN + column, rounded to TF32 as it is written; tap (ky, kx) of pixel (y, x) reads
// slot (y + ky) * HIN + x + kx), Xs[R+4][IMG] (the band's x rows; the next band's are loaded into registers while
// this band is computed) and conv1's weights. The accumulator layout puts a 2x2 pooling window in one thread.
// Every parameter was written by the kernel in front (the previous step's weight-gradient kernel): they are loaded
// after grid_dep_sync: conv1's first, conv2.bias into registers for the epilogue, conv2.weight by cp.async once the x
// rows have arrived (9.4 MB over all blocks, which the x rows and conv1's weights would otherwise queue behind), in
// flight while conv1 is computed; or, staged (in.wimg), from its forward image by one bulk copy (TMA), issued by
// thread 0 once its x rows have arrived. Input gathered from the dataset is loaded before the wait, staged input (and
// x) after it. fh: the fused forward's fc1 and head (FwdHead), or part = null.
template <int CIN, int COUT, int HIN, int HOUT, int R>
__global__ void __launch_bounds__(384)
conv2_band_tf32_kernel(float* out, ConvInput in, const float* __restrict__ w1, const float* __restrict__ b1,
                       float* act1, uint32_t* act1_sign, const float* __restrict__ w, const float* __restrict__ bias,
                       float* pooled, uint8_t* pool_codes, float* wimg_dgrad, int B, FwdHead fh) {
    TRACE_SCOPE(0);
    constexpr int NT = 384, PR = R + 2, XR = R + 4, NBAND = (HOUT + R - 1) / R;
    // the patch's plane stride (slots): 2 or 6 mod 8, conv1's float4 stores conflict-free
    constexpr int PL = PR * HIN + 2;
    constexpr int XCH = XR * IMG / 4, NC1 = (PR * HIN * 4 + NT - 1) / NT;  // x chunks of a band; conv1 items per thread
    constexpr int WCH = COUT * 9 * CIN / 4, NW = WCH / NT;                   // conv2.weight's 16-byte chunks
    static_assert(COUT == 64 && HOUT == 3 * 8 && R == 12 && CIN % 8 == 0,
                  "3 warpgroups of m64 (channels) x n96 (8 columns x R rows)");
    static_assert(PL % 8 == 2 || PL % 8 == 6,
                  "conv1's stores: a quarter warp's 2 pixels x 4 planes on distinct 16-byte bank groups");
    static_assert((R + 1) * HIN + 2 * 8 + 2 + 7 < PR * HIN, "the products read only slots conv1 writes");
    static_assert(HOUT + 2 == HIN && HIN + 2 == IMG && CIN == C1 && HOUT % R == 0,
                  "conv1 then a valid 3x3 correlation");
    static_assert(NT % 4 == 0 && IMG % 4 == 0 && XCH <= NT,
                  "a thread's conv1 channel group is fixed; one x chunk per thread");
    static_assert(CIN == 32 && NT % 32 == 0,
                  "act1's sign bits: a pixel's 4 lanes (aligned in their warp) hold its 32 channels");
    static_assert(WCH % NT == 0, "conv2.weight's chunks split evenly");
    extern __shared__ __align__(16) float smem[];
    float* Ws = smem;                       // [9][CIN / 4][COUT][4]
    float* Ps = smem + 9 * COUT * CIN;      // [CIN / 4][PL][4]
    float* Xs = Ps + CIN * PL;              // [XR][IMG]
    float* W1s = Xs + XR * IMG;             // [9][C1]: conv1's weights by tap, channels contiguous
    float* B1s = W1s + 9 * C1;              // [C1]
    float* Wf = B1s + C1;                   // the fused forward: fc1.weight's K slice [FC_H][FC1F_LD]
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int wg = warp / 4, wq = warp % 4;  // warpgroup (the band's columns 8 wg .. 8 wg + 7), warp within it
    const bool staged = in.staged != nullptr, gather = in.images != nullptr || staged, fused = fh.part != nullptr;
    // the fc1.weight slice's 16-byte chunks per row, per thread
    constexpr int FCH = FC1F_KC / 4, NWF = FC_H * FCH / NT;
    static_assert(FC_H * FCH % NT == 0 && NT >= 9 * C1 && NT >= 256,
                  "fc1's slice splits evenly; a conv1 weight per thread");

    // the sample of a band (gather; staged: the sample is the batch row itself), its x rows and its label
    const int pos0 = gather && !staged ? (in.counters ? __ldcg(in.counters + 1) : in.offset) : 0;
    auto sample_of = [&](int band) {
        const int p = pos0 + band / NBAND;
        return staged || !in.perm ? p : __ldcg(in.perm + p);
    };
    auto load_x = [&](int band, int s) { return band_load_x<NBAND, R, XCH>(in, band, s, gather, staged, tid); };
    auto load_label = [&](int s) { return staged ? __ldcg(in.staged_y + s) : (int)__ldg(in.labels + s); };
    const bool any = (int)blockIdx.x < B * NBAND;
    int label = 0;
    float4 xin = make_float4(0.f, 0.f, 0.f, 0.f);
    auto load_first = [&] {
        const int s0 = sample_of(blockIdx.x);
        xin = load_x(blockIdx.x, s0);
        if (gather && tid == 0) label = load_label(s0);
    };
    const bool early = gather && !staged;  // the dataset's bytes: before the wait; x or the staged bytes: after it
    if (any && early) load_first();
    // conv2.weight from its forward image (staged): one bulk copy into Ws, already laid out and rounded, issued where
    // the cp.async would be (load_weights: after the x rows, which it would otherwise delay); its barrier initialised
    // here (the band loop's first __syncthreads, or the one before a bandless block's wait, orders it)
    __shared__ __align__(8) uint64_t wbar;
    const bool use_img = in.wimg != nullptr;
    if (use_img && tid == 0) bulk_copy_init(&wbar);
    grid_dep_wait();
    if (any && !early) load_first();
    if (!fused) grid_dep_launch();  // the fused forward releases its successor after its second grid barrier
    // conv1's weights and bias, conv2.bias (this thread's epilogue channels); L2 loads: no stale L1 line. conv2.weight
    // [co][tap][ci] raw into Ws[tap][co][ci] (16-byte cp.async, L2, rounded in place after conv1) is issued in the band
    // loop after the x rows are stored, so a thread that loads x rows issues its share once they have arrived: issued
    // here, all blocks' 9.4 MB of cp.async delayed those few bytes by ~1 us (measured on the H100, 0.45 ms per epoch;
    // dev/mnist_NOTES.md session 8)
    const float w1v = tid < 9 * C1 ? __ldcg(w1 + tid) : 0.0f, b1v = tid < C1 ? __ldcg(b1 + tid) : 0.0f;
    if (tid < 9 * C1) W1s[(tid % 9) * C1 + tid / 9] = w1v;
    if (tid < C1) B1s[tid] = b1v;
    auto load_weights = [&] { band_weights_issue<CIN, COUT, NW, NT>(Ws, w, use_img, in.wimg, &wbar, tid); };
    if (!any) load_weights();  // a block without a band (the fused forward at B < 64): its share of the weight image
    const int co = 16 * wq + g, x0 = 8 * wg;  // this thread's output channels co, co + 8; the warpgroup's first column
    const float bz[2] = {__ldcg(bias + co), __ldcg(bias + co + 8)};
    // conv1: this thread's channels are c0..c0+3 and c0+16..c0+19, so that each of a warp's two 16-byte act1 stores
    // writes whole 32-byte sectors (8 pixels x 64 contiguous bytes)
    const int c0 = (tid % 4) * 4;
    // conv2's weights landed (each thread rounds the chunks it copied), and this block's share of the input
    // gradient's weight image (after a barrier: from every thread's rounded chunks)
    auto round_weights = [&] { band_weights_land<CIN, COUT, NW, NT>(Ws, use_img, &wbar, tid); };
    // the fused forward: fc1.weight's K slice (raw; rounded after the bands), issued once conv2's weights have landed,
    // so that it does not delay them (it was written by the previous step's optimizer step, complete)
    auto load_wf = [&] { fused_wf1_issue<NT, NWF, FCH>(Wf, fused, fh.wf1, tid); };
    auto write_wimg = [&] { band_write_dgrad_image<CIN, COUT, NT>(wimg_dgrad, Ws, tid); };

    int it = 0;
    for (int band = blockIdx.x; band < B * NBAND; band += gridDim.x, it++) {
        const int b = band / NBAND, yb = band % NBAND, y0 = yb * R;
        // this band's x rows into Xs (the previous band's conv1 is done: the barrier after it); gathered: the x rows
        // this band owns (the first band of an image rows 0..R+1, the others from y0 + 2, the last up to IMG - 1) and
        // the label go to x_out, y_out
        if (tid < XCH) {
            *(float4*)(Xs + 4 * tid) = xin;
            const int r = 4 * tid / IMG;
            if (gather && in.x_out && r >= (yb == 0 ? 0 : 2) && r < (yb == NBAND - 1 ? XR : R + 2))
                *(float4*)(in.x_out + ((size_t)b * IMG + y0) * IMG + 4 * tid) = xin;
            if (gather && in.y_out && yb == 0 && tid == 0) in.y_out[b] = label;
        }
        // after this thread's x rows (if any) have arrived: the stores above wait for them
        if (it == 0) load_weights();
        const int next = band + (int)gridDim.x;
        const int s_next = gather && next < B * NBAND ? sample_of(next) : 0;  // its rows are loaded after conv1
        __syncthreads();     // Xs, W1s, B1s are written; Ps is free (the previous band's barrier)
        TRACE_MARK(0);
        // conv1 of act1 rows y0 .. y0 + R + 1 into Ps (rounded to TF32); the rows this band owns go to act1 unrounded
        const int own_lo = yb == 0 ? 0 : 1, own_hi = yb == NBAND - 1 ? PR : PR - 1;  // patch rows [lo, hi)
        band_conv1<HIN, PR, PL, NC1, NT>(Ps, Xs, W1s, B1s, act1, act1_sign, b, y0, own_lo, own_hi, tid, lane, c0);
        TRACE_MARK(4);
        if (it == 0) round_weights();
        fence_proxy_async();  // the patch and the rounded weights, before the tensor core's (async proxy) reads
        __syncthreads();
        TRACE_MARK(1);
        if (it == 0) { write_wimg(); load_wf(); }
        if (next < B * NBAND) {  // the next band's x rows, in flight during this band's products
            xin = load_x(next, s_next);
            if (gather && tid == 0) label = load_label(s_next);
        }
        float d[48];
        band_conv2_products<CIN, COUT, HIN, PL>(d, Ws, Ps, x0, co, g, t);
        TRACE_MARK(2);
        band_bias_relu_pool<COUT, HOUT>(d, bz, out, pooled, pool_codes, b, y0, x0, co, t);
        TRACE_MARK(3);
        __syncthreads();  // Ps is read by all warps before the next band's conv1 writes it
    }
    if (it == 0) {  // a block without a band (the fused forward's grid at B < 64) still makes its share of the image
        __syncthreads();  // (the bulk copy's barrier is initialised)
        round_weights();
        __syncthreads();
        write_wimg();
        load_wf();
    }
    if (!fused) return;

    fused_fc1_slice<NT, NWF, FCH>(fh, Ps, Wf, pooled, B, tid, warp, g, t);
    const GridBarrier gb = grid_barrier_arrive(fh.bar);  // every slice's partial sums are stored
    // fc1's backward may take SMs from here on (measured: released at the wait, its blocks sat on the SMs of this
    // kernel's first blocks to leave, and the step was 0.4 ms per epoch slower)
    grid_dep_launch();
    if ((int)blockIdx.x >= B) return;  // (after arriving: the barrier counts every block)
    fused_head_row<NT>(fh, Ws, Ps, B, tid, warp, lane, gb.target);
}
// R = 12 rows (half an image) = 288 pixels = 18 m16 tiles, 12 warps of 48 x 32 (6 row pairs x 2 channel halves; the
// weights read once per k-step for 3 m16 tiles), 140 KB of shared memory: one block per SM, 128 bands at batch 64 = a
// single round (H100, before conv1 was fused in: 14.0 us; R = 4 with 8 warps of 48 x 16, 2.9 rounds: 16.6 us).
#define CONV2_FWD_KERNEL conv2_band_tf32_kernel<C1, C2, H1, H2, 12>
constexpr int CONV2_FWD_THREADS = 384, CONV2_FWD_R = 12, CONV2_FWD_PS = C1 * ((CONV2_FWD_R + 2) * H1 + 2);
constexpr size_t CONV2_FWD_SMEM = (9 * C2 * C1 + CONV2_FWD_PS + (CONV2_FWD_R + 4) * IMG + 10 * C1) * sizeof(float);
constexpr int CONV2_FWD_BANDS = H2 / CONV2_FWD_R;
// the fused forward (FwdHead) adds fc1.weight's K slice; its fc1 operand, partial-sum groups and the head's
// parameters reuse the patch and the weight tile
constexpr size_t CONV2_FWD_SMEM_FUSED = CONV2_FWD_SMEM + (size_t)FC_H * FC1F_LD * sizeof(float);
static_assert(CONV2_FWD_PS >= 64 * FC1F_LD && CONV2_FWD_PS >= FC1F_PARTS * FC_H &&
              9 * C2 * C1 >= NCLS * FC_H + 32 + FC_H && CONV2_FWD_SMEM % 16 == 0, "the fused forward's shared memory");
static_assert(FUSED_MAX_B * CONV2_FWD_BANDS <= FC1F_SPLITS, "the fused forward's grid covers every band");

// fc1.weight's SGD step (p, m1: its slices of the flat buffers; g: its gradient, as fc1_backward_kernel stored it),
// `share` of `nshares` of its float4 units, by one warp: sgd_update_elem with the step optimizer_kernel would use, so
// the same bits. 12 units' p, g and m per lane are loaded before any is updated; g and m with streaming hints (read
// or written once per step: measured on the H100, 1.2 ms per epoch at batch 64 against plain accesses, which pushed
// the weight gradient's operands out of L2). Run by the input-gradient kernel's idle warp while the others compute:
// the gradient's kernel is complete, and fc1.weight is next read by the next step's fc1 forward, three launches
// later. (AdamW's step, with a square root and a division per element, is too slow for one warp per SM: the training
// step runs optimizer_kernel for it instead.)
__device__ void fc1_step_share(const Fc1Step& u, int share, int nshares, int lane) {
    constexpr size_t N4 = (size_t)FC_H * FC_IN / 4;
    constexpr int U = 12;
    const size_t lo = share * N4 / nshares, hi = (share + 1) * N4 / nshares;
    const OptStep st = opt_step(u.c, __ldcg(u.counters));
    for (size_t i0 = lo + lane; i0 < hi; i0 += 32 * U) {
        float4 p[U], g[U], m[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            const size_t i = i0 + 32 * k;
            if (i >= hi) break;
            p[k] = __ldcg((const float4*)u.p + i);
            g[k] = __ldcs((const float4*)u.g + i);
            m[k] = __ldcs((const float4*)u.m1 + i);
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            const size_t i = i0 + 32 * k;
            if (i >= hi) break;
            sgd_update_elem(u.c, st, &p[k].x, g[k].x, &m[k].x); sgd_update_elem(u.c, st, &p[k].y, g[k].y, &m[k].y);
            sgd_update_elem(u.c, st, &p[k].z, g[k].z, &m[k].z); sgd_update_elem(u.c, st, &p[k].w, g[k].w, &m[k].w);
            ((float4*)u.p)[i] = p[k]; __stcs((float4*)u.m1 + i, m[k]);
        }
    }
}

// conv2's input gradient: dact1[b, y, x, n] = sum_{ky,kx,c} dact2p[b, y + ky, x + kx, c] * conv2.weight[c][8 - (3 ky +
// kx)][n] where act1[b, y, x, n] > 0, else 0 (the ReLU in front of conv2); dact2p is dact2 zero-padded by 2, rebuilt
// while loading from dpooled and the window codes (dact2_expand). Fused: conv1's weight and bias gradient of the
// produced pixels (dact1 feeds nothing else, so it is stored only when dact1 is not null: the tests), one partial sum
// per block in w1_partial ([32][9] then [32]), added in a fixed order at the end of conv2_wgrad_tf32_kernel.
// The patch shares its zero padding between neighbours: padded rows of pitch 26 (2 zero columns, then the 24 of
// dact2; a row's 2 trailing zero columns are the next row's leading ones) and images of 26 such rows (2 zero rows, 24
// of dact2; the 2 trailing zero rows are the next image's leading ones). Padded pixel (b, py, px) is then slot
// b * 676 + py * 26 + px, and output pixel q = (b, y, x) (26 x 26 per image) reads slot q + 26 ky + kx for tap (ky,
// kx): a 1-D stencil over the output pixels in order, with no row of them wasted.
// Work split: the B * 676 output pixels in order, chunks of DG_CH consecutive pixels (one chunk per block at batch 64:
// 129 chunks on 132 SMs, a single pass); a chunk may cross an image boundary. Its patch is DG_NS consecutive slots,
// as DG_PS: [c / 4][slot][c % 4] (each slot 16 bytes: wgmma's K-major "no swizzle" core matrices, 8 slots x 4
// channels, 128 contiguous bytes, and a tap only moves the start by whole slots).
// GEMM per tile: A = 64 consecutive slots (rows) x (ky, c) (k = 192), B = the weight image's (ky, c) x (kx, n) (n =
// 96): D[r][32 kx + n] = sum_{ky, c} patch[r + 26 ky][c] W[ky][kx][c][n]. The three kx share A, which is therefore
// read once for three taps (an m64n96k8 wgmma, both operands from shared memory: 5 KB per 98 KFLOP; one tap per
// wgmma, m64n32k8, would read 3 KB per 33 KFLOP and be bound by shared memory), and output pixel r is
// D[r][n] + D[r + 1][32 + n] + D[r + 2][64 + n] (dgrad_combine: rows r + 1 and r + 2 are other lanes' accumulators,
// or the next warp's first rows, passed through shared memory). A tile's last 2 rows have no output: tiles are DG_TM
// = 62 pixels apart, DG_TILES per chunk, the two warpgroups taking alternate tiles. Without wgmma (other targets)
// each warp computes its 16 rows of the same D with mma.sync from the same layout.
// The weight image Wimg[ky][c / 4][kx * 32 + n][c % 4] (conv2.weight flipped and transposed, rounded to TF32) is
// written by the forward (conv2_band_tf32_kernel). Per block, before grid_dep_sync (written at least two launches
// earlier): the image (cp.async), the patch's zero padding, the image rows of x under conv1's windows (Xs: conv1's
// weight gradient) and act1's signs (Ms: the forward's 32-bit mask per pixel, bit n: act1[.., n] > 0).
// A 9th warp (the step warp) applies a share of fc1.weight's optimizer step meanwhile in an SGD training step
// (fc1_step_share); the compute warps synchronise on named barriers without it.
constexpr int DG_CW = 8, DG_CT = 32 * DG_CW, DG_THREADS = DG_CT + 32;  // 2 warpgroups of compute warps, the step warp
constexpr int DG_CH = 336, DG_TM = 62, DG_TILES = (DG_CH + DG_TM - 1) / DG_TM, DG_N = 3 * C1;
constexpr int DG_NS = (DG_TILES - 1) * DG_TM + 64 + 2 * H1, DG_PL = DG_NS | 1;  // slots; an odd plane stride (in slots)
constexpr int DG_WS = 9 * C1 * C2, DG_PS = C2 * DG_PL, DG_XROWS = (DG_CH - 1) / H1 + 6, DG_XS = DG_XROWS * IMG,
              DG_EX = 2 * 2 * 4 * 96;
static_assert(H1 * H1 == 676 && C2 == 64 && C1 == 32 && DG_N == 96,
              "the slot arithmetic and the weight image fit these sizes");
static_assert(DG_TILES * DG_TM >= DG_CH && DG_TILES % 2 == 0,
              "the tiles cover a chunk, evenly over the two warpgroups");
static_assert((DG_CH - 1) / H1 + 2 + 4 <= DG_XROWS && DG_CH < H1 * H1, "a chunk's x rows (at most one image boundary)");
constexpr size_t CONV2_DGRAD_SMEM = (size_t)(DG_WS + DG_PS + DG_XS + DG_CH + DG_EX) * sizeof(float);
static_assert(CONV2_DGRAD_SMEM <= 227 * 1024 && DG_CW * C1 * 10 <= DG_PS && (DG_WS + DG_PS + DG_XS) % 4 == 0,
              "shared memory");
// Output rows r = 16 wq + g + 8 h (this lane's d[4 i + 2 h + e], i < 4: channel 8 i + 2 t + e) get D1 (= d[16 + ..],
// kx = 1) of row r + 1 and D2 (d[32 + ..]) of row r + 2: from lane g + 1 (g + 2) of the same warp, where g = 0 (g < 2)
// passes its h = 1 value for h = 0 and, for h = 1, the next warp's row 0 (rows 0, 1) of D1 (D2) from x1 (x2): [t][8]
// ([g][t][8]) as the next warp left them in shared memory (not read where it does not exist: nx = false).
// Summed (D0 + D1) + D2, into d[0..15].
__device__ __forceinline__ void dgrad_combine(float (&d)[48], const float* x1, const float* x2, bool nx, int g, int t) {
    const int src1 = ((g + 1) & 7) * 4 + t, src2 = ((g + 2) & 7) * 4 + t;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float a0 = d[16 + 4 * i + e], a1 = d[16 + 4 * i + 2 + e], c0 = d[32 + 4 * i + e],
                        c1 = d[32 + 4 * i + 2 + e];
            const float s10 = __shfl_sync(0xffffffffu, g == 0 ? a1 : a0, src1);
            const float s11 = __shfl_sync(0xffffffffu, g == 0 ? (nx ? x1[t * 8 + 2 * i + e] : 0.0f) : a1, src1);
            const float s20 = __shfl_sync(0xffffffffu, g < 2 ? c1 : c0, src2);
            const float s21 =
                __shfl_sync(0xffffffffu, g < 2 ? (nx ? x2[(g * 4 + t) * 8 + 2 * i + e] : 0.0f) : c1, src2);
            d[4 * i + e] = (d[4 * i + e] + s10) + s20;
            d[4 * i + 2 + e] = (d[4 * i + 2 + e] + s11) + s21;
        }
}
// The phases of conv2_dgrad_tf32_kernel (below), in the order it runs them.
// x's stacked row (image b's rows counted from b * IMG) of the top of output pixel q's 3x3 window
__device__ __forceinline__ int dgrad_xrow(int q) { return (q / (H1 * H1)) * IMG + (q % (H1 * H1)) / H1; }
// What a chunk needs of nothing the kernel in front writes: the patch's zero padding (slots whose padded row or
// column is < 2, or past the batch), the x rows and act1's signs; the first chunk's before grid_dep_sync
__device__ __forceinline__ void dgrad_prepare(float* Ps, float* Xs, uint32_t* Ms, const float* ximg,
                                              const uint32_t* act1_sign, int chunk, int total, int tid) {
    const int q0 = chunk * DG_CH, npix = min(DG_CH, total - q0), xs_lo = dgrad_xrow(q0);
    const int nx = dgrad_xrow(q0 + npix - 1) + 3 - xs_lo;
    for (int i = tid; i < DG_NS * (C2 / 4); i += DG_CT) {
        const int s = i / (C2 / 4), c4 = i % (C2 / 4), L = q0 + s, r = L % (H1 * H1);
        if (L >= total || r < 2 * H1 || r % H1 < 2)
            *(float4*)(Ps + (c4 * DG_PL + s) * 4) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int i = tid; i < nx * IMG; i += DG_CT) Xs[i] = __ldg(ximg + (size_t)xs_lo * IMG + i);
    for (int p = tid; p < npix; p += DG_CT) Ms[p] = __ldg(act1_sign + q0 + p);
}
// The patch, rounded to TF32: its zero padding is in place (dgrad_prepare); then dact2, a pooled value (and its 4
// window codes) per thread and chunk of 4 channels: it is the 2x2 window's dact2 at its code's position, 0 at
// the other three (dact2_expand). Pooled rows are counted over the stacked images (tp = b * 12 + pooled row);
// tp_lo .. tp_lo + ntp - 1 touch the slots (the first and last may have pixels outside them: not stored).
__device__ __forceinline__ void dgrad_load_dact2(float* Ps, const float* dpooled, const uint8_t* codes, int q0, int B,
                                                 int tid) {
    auto pooled_row = [](int L, bool last) {  // the stacked pooled row of slot L's padded row (first / last one in)
        const int b = L / (H1 * H1), py = (L % (H1 * H1)) / H1;
        return py < 2 ? b * HP - (last ? 1 : 0) : b * HP + (py - 2) / 2;
    };
    const int tp_lo = pooled_row(q0, false), ntp = min(pooled_row(q0 + DG_NS - 1, true), B * HP - 1) + 1 - tp_lo;
    const int npc = ntp * HP * (C2 / 4);
    for (int i0 = 0; i0 < npc; i0 += 8 * DG_CT) {
        float4 dv[8];
        uint32_t kv[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int i = i0 + u * DG_CT + tid;
            // (tp, pooled column) = i / 16
            const size_t pi = ((size_t)tp_lo * HP + i / (C2 / 4)) * C2 + (i % (C2 / 4)) * 4;
            dv[u] = i < npc ? __ldg((const float4*)(dpooled + pi)) : make_float4(0.f, 0.f, 0.f, 0.f);
            kv[u] = i < npc ? __ldg((const unsigned int*)(codes + pi)) : 0u;
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int i = i0 + u * DG_CT + tid, tp = tp_lo + i / (HP * (C2 / 4)), pc = (i / (C2 / 4)) % HP;
            const int c4 = i % (C2 / 4);
            const int s0 = (tp / HP) * (H1 * H1) + (2 * (tp % HP) + 2) * H1 + 2 * pc + 2 - q0;  // window's top left
#pragma unroll
            for (int dy = 0; dy < 2; dy++)
#pragma unroll
                for (int dx = 0; dx < 2; dx++) {
                    const int s = s0 + dy * H1 + dx;
                    if (i < npc && s >= 0 && s < DG_NS)
                        *(float4*)(Ps + (c4 * DG_PL + s) * 4) = tf32_round4(dact2_expand(dv[u], kv[u], dy, dx));
                }
        }
    }
}
// A tile's products: D = 64 consecutive slots of the patch x the weight image, d as described above
__device__ __forceinline__ void dgrad_tile_products(float (&d)[48], const float* Ps, const float* Ws, int tile, int wq,
                                                    int g, int t) {
#pragma unroll
    for (int i = 0; i < 48; i++) d[i] = 0.0f;
#if MNIST_WGMMA
    // descriptors: a slot is 16 bytes, one unit of a descriptor's address; LBO = a plane (4 channels further
    // along k), SBO = 8 slots (A) or 8 rows of n (B)
    const uint64_t da0 = wgmma_desc(Ps + tile * DG_TM * 4, DG_PL * 16, 128);
    const uint64_t db0 = wgmma_desc(Ws, DG_N * 16, 128);
    wgmma_fence();
#pragma unroll
    for (int ky = 0; ky < 3; ky++)
#pragma unroll
        for (int ks = 0; ks < C2 / 8; ks++)
            wgmma_m64n96k8_ss(d, da0 + (uint64_t)(2 * ks * DG_PL + ky * H1),
                              db0 + (uint64_t)((ky * (C2 / 4) + 2 * ks) * DG_N));
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(d);
#else
    // mma.sync: this warp's rows 16 wq .. 16 wq + 15 of the tile, the 12 n8 tiles of D (same fragment layout)
#pragma unroll 1
    for (int ky = 0; ky < 3; ky++)
#pragma unroll 1
        for (int ks = 0; ks < C2 / 8; ks++) {
            const float* pa = Ps + (2 * ks * DG_PL + tile * DG_TM + ky * H1 + 16 * wq + g) * 4 + t;
            const float* pb = Ws + ((ky * (C2 / 4) + 2 * ks) * DG_N + g) * 4 + t;
            const uint32_t a[4] = {__float_as_uint(pa[0]), __float_as_uint(pa[32]),
                                   __float_as_uint(pa[DG_PL * 4]), __float_as_uint(pa[DG_PL * 4 + 32])};
#pragma unroll
            for (int i = 0; i < 12; i++)
                mma_tf32_16x8x8(*reinterpret_cast<float(*)[4]>(d + 4 * i), a, __float_as_uint(pb[32 * i]),
                                __float_as_uint(pb[DG_N * 4 + 32 * i]));
        }
#endif
}
// A tile's output rows from D (dgrad_combine), with the rows the next warp holds passed through shared memory
__device__ __forceinline__ void dgrad_exchange_combine(float (&d)[48], float* Ex, int parity, int wg, int wq, int g,
                                                       int t) {
    // the next warp's row 0 of D1 and rows 0, 1 of D2 for this warp's last rows (double-buffered by the
    // warpgroup's tile parity: a buffer is rewritten only after the warpgroup's next barrier)
    float* ex = Ex + (parity * 2 + wg) * 4 * 96;
    if (wq > 0 && g < 2)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (g == 0) ex[(wq - 1) * 96 + t * 8 + j] = d[16 + 4 * (j / 2) + j % 2];
            ex[(wq - 1) * 96 + 32 + (g * 4 + t) * 8 + j] = d[32 + 4 * (j / 2) + j % 2];
        }
    asm volatile("bar.sync %0, 128;" :: "r"(2 + wg) : "memory");
    dgrad_combine(d, ex + wq * 96, ex + wq * 96 + 32, wq < 3, g, t);
}
// A tile's epilogue: d[4 i + 2 h + e] is output row 16 wq + g + 8 h of the tile, channel 8 i + 2 t + e. Lanes g
// and g ^ 1 swap halves first: lane (g, t) keeps channels 8 i + 2 t + e for i = 2 (g & 1) + ii (ii < 2) of its own
// rows and takes them for lane g ^ 1's (rows 16 wq + (g ^ j) + 8 h, j < 2), so that it holds 4 channels of 4 rows
// and conv1's sums w1acc need 40 registers, not 80. Each output row (none for rows >= DG_TM) masked by act1's sign;
// conv1's gradient over the image pixels under its window.
__device__ __forceinline__ void dgrad_tile_epilogue(const float (&d)[48], float (&w1acc)[2][2][10], float* dact1,
                                                    const uint32_t* Ms, const float* Xs, int tile, int q0, int npix,
                                                    int xs_lo, int wq, int g, int t) {
    float o[2][2][2][2];  // [j][h][ii][e]
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int ii = 0; ii < 2; ii++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                // (static indices: d stays in registers)
                const float lo = d[4 * ii + 2 * h + e], hi = d[4 * (2 + ii) + 2 * h + e];
                const float keep = g & 1 ? hi : lo, give = g & 1 ? lo : hi;
                o[0][h][ii][e] = keep;
                o[1][h][ii][e] = __shfl_xor_sync(0xffffffffu, give, 4);
            }
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = 16 * wq + (g ^ j) + 8 * h, m = tile * DG_TM + r, q = q0 + m;
            const bool ok = r < DG_TM && m < npix;
            const uint32_t mask = ok ? Ms[m] : 0u;
            const float* xs = Xs + (dgrad_xrow(q) - xs_lo) * IMG + q % H1;
            float xv[9];
#pragma unroll
            for (int k = 0; k < 9; k++) xv[k] = ok ? xs[(k / 3) * IMG + k % 3] : 0.0f;
#pragma unroll
            for (int ii = 0; ii < 2; ii++) {
                const int n0 = 8 * (2 * (g & 1) + ii) + 2 * t;
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int n = n0 + e;
                    v[e] = (mask >> n) & 1u ? o[j][h][ii][e] : 0.0f;
                    w1acc[ii][e][9] += v[e];
#pragma unroll
                    for (int k = 0; k < 9; k++) w1acc[ii][e][k] = fmaf(v[e], xv[k], w1acc[ii][e][k]);
                }
                if (ok && dact1) *(float2*)(dact1 + (size_t)q * C1 + n0) = make_float2(v[0], v[1]);
            }
        }
}
// conv1's gradient sums of a compute warp (the butterfly described in the kernel) into red[warp]
__device__ __forceinline__ void dgrad_w1_warp_sums(float* red, const float (&w1acc)[2][2][10], int warp, int lane,
                                                   int g, int t) {
    float v20[20], v10[10];
#pragma unroll
    for (int i = 0; i < 20; i++) {
        const float lo = w1acc[0][i / 10][i % 10], hi = w1acc[1][i / 10][i % 10];
        const bool up = lane & 16;
        v20[i] = (up ? hi : lo) + __shfl_xor_sync(0xffffffffu, up ? lo : hi, 16);
    }
#pragma unroll
    for (int i = 0; i < 10; i++) {
        const bool up = lane & 8;
        v10[i] = (up ? v20[10 + i] : v20[i]) + __shfl_xor_sync(0xffffffffu, up ? v20[i] : v20[10 + i], 8);
    }
    const int c = 8 * (2 * (g & 1) + (g >> 2)) + 2 * t + ((g >> 1) & 1);
#pragma unroll
    for (int k = 0; k < 10; k++) red[warp * C1 * 10 + c * 10 + k] = v10[k];
}
__global__ void __launch_bounds__(DG_THREADS, 1)
conv2_dgrad_tf32_kernel(float* dact1, const float* __restrict__ dpooled, const uint8_t* __restrict__ codes,
                        const float* __restrict__ w, const uint32_t* __restrict__ act1_sign,
                        const float* __restrict__ ximg, float* w1_partial, int B, Fc1Step fc1) {
    TRACE_SCOPE(4);
    extern __shared__ __align__(16) float smem[];
    float* Ws = smem;                          // [3][C2 / 4][DG_N][4]
    float* Ps = Ws + DG_WS;                    // [C2 / 4][DG_PL][4]
    float* Xs = Ps + DG_PS;                    // [DG_XROWS][IMG]
    uint32_t* Ms = (uint32_t*)(Xs + DG_XS);    // [DG_CH]
    float* Ex = (float*)(Ms + DG_CH);          // [tile parity][warpgroup][warp][96]: the next warp's first rows
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int wg = warp / 4, wq = warp % 4;    // warpgroup, warp within it
    const int total = B * H1 * H1, nchunks = (total + DG_CH - 1) / DG_CH;
    auto sync_compute = [] { asm volatile("bar.sync 1, %0;" :: "n"(DG_CT) : "memory"); };
    // the weight image, once per block, before grid_dep_sync
    if (warp < DG_CW) {
        for (int i = tid; i < DG_WS / 4; i += DG_CT) cp_async16(Ws + 4 * i, w + 4 * i);
        cp_async_commit();
        if ((int)blockIdx.x < nchunks) dgrad_prepare(Ps, Xs, Ms, ximg, act1_sign, blockIdx.x, total, tid);
    }
    grid_dep_sync();
    float w1acc[2][2][10];  // conv1's weight (9) and bias gradient of this thread's 4 channels (see the epilogue)
    if (warp == DG_CW) {
        // the step warp: a share of fc1.weight's optimizer step while the others compute
        if (fc1.p) fc1_step_share(fc1, blockIdx.x, gridDim.x, lane);
        TRACE_MARK(3);
    } else {
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int e = 0; e < 2; e++)
#pragma unroll
                for (int k = 0; k < 10; k++) w1acc[i][e][k] = 0.0f;
        int parity = 0;
        for (int chunk = blockIdx.x; chunk < nchunks; chunk += gridDim.x) {
            const int q0 = chunk * DG_CH, npix = min(DG_CH, total - q0), xs_lo = dgrad_xrow(q0);
            if (chunk != (int)blockIdx.x) {
                sync_compute();  // the previous chunk's reads of Ps, Xs and Ms are done
                dgrad_prepare(Ps, Xs, Ms, ximg, act1_sign, chunk, total, tid);
            }
            dgrad_load_dact2(Ps, dpooled, codes, q0, B, tid);
            cp_async_wait<0>();  // the weights (first chunk)
            // the stores above, before the tensor core's (async proxy) reads (no-op without wgmma)
            fence_proxy_async();
            sync_compute();
            TRACE_MARK(0);
            const int ntiles = (npix + DG_TM - 1) / DG_TM;
            for (int tile = wg; tile < ntiles; tile += 2, parity ^= 1) {
                float d[48];
                dgrad_tile_products(d, Ps, Ws, tile, wq, g, t);
                if (tile == wg) TRACE_MARK(1);
                dgrad_exchange_combine(d, Ex, parity, wg, wq, g, t);
                dgrad_tile_epilogue(d, w1acc, dact1, Ms, Xs, tile, q0, npix, xs_lo, wq, g, t);
            }
        }
    }
    TRACE_MARK(2);
    // conv1's weight and bias gradient of this block's pixels. Within a compute warp, the 4 lanes with the same t and
    // g & 1 hold the same 4 channels: a butterfly over g's upper bits (lane bits 4, 3) that halves the values each
    // lane keeps leaves lane (g, t) with the warp's sums of w1acc[ii][e] for ii = g >> 2, e = (g >> 1) & 1: channel
    // 8 (2 (g & 1) + ii) + 2 t + e, k = 0..9. Then the warps' sums are added in warp order through shared memory.
    __syncthreads();  // every warp is done with shared memory (the step warp: its share of fc1's step)
    float* red = Ps;  // [DG_CW][C1 * 10]
    if (warp < DG_CW) dgrad_w1_warp_sums(red, w1acc, warp, lane, g, t);
    __syncthreads();
    // (the compute warps only, the same sums: racecheck reported the step warp's reads here as racing with the stores
    // above, 13205 reports at batch 512. 256 remain, in the block whose last chunk has an odd tile count, between
    // the two warpgroups, and stay with a second __syncthreads before the stores: racecheck appears to pair barrier
    // instances by count, and there one warpgroup has run one more of its named barriers (bar.sync 2 + wg) than the
    // other. dev/mnist_NOTES.md, session 14.)
    if (warp < DG_CW)
    for (int q = tid; q < C1 * 10; q += DG_CT) {
        const int c = q / 10, k = q % 10;
        float sum = red[q];
#pragma unroll
        for (int w = 1; w < DG_CW; w++) sum += red[w * C1 * 10 + q];
        w1_partial[(size_t)blockIdx.x * C1 * 10 + (k < 9 ? c * 9 + k : C1 * 9 + c)] = sum;  // [32][9] then [32]
    }
}

// conv2.weight's forward image: [tap][co][ci (+4 pad)], rounded to TF32, the layout of conv2's forward kernel's Ws, so
// that the next training step's forward copies it in one bulk copy (ConvInput::wimg) instead of 4608 16-byte
// cp.async per block and a rounding pass. i: the weight's internal index, [co][tap][ci].
constexpr int W2IMG_FLOATS = 9 * C2 * C1;
__host__ __device__ inline int conv2_fwd_img_index(int i) {
    return (((i / C1) % 9 * (C1 / 4) + i % C1 / 4) * C2 + i / KC2) * 4 + i % 4;
}
__device__ __forceinline__ float splits_add(float a, float b) { return a + b; }
__device__ __forceinline__ float4 splits_add(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
template <typename T> __device__ __forceinline__ T splits_zero() { T z; memset(&z, 0, sizeof z); return z; }
// lane k's part of unit i (T = float4: 4 elements, each with the scalar order) for any split count. (src is written
// by this kernel's other blocks before the grid barrier: plain coherent loads, never the read-only path.)
// Up to three groups of four are loaded before they are added (conv1's 264 splits: 8 of a lane's 8-9 loads at once).
template <typename T>
__device__ __forceinline__ T splits_part(const T* src, size_t stride, int splits, int k, size_t i) {
    T a[4] = {splits_zero<T>(), splits_zero<T>(), splits_zero<T>(), splits_zero<T>()};
    int s = k;
    while (s + 3 * SR_LANES < splits) {
        T x[3][4];
#pragma unroll
        for (int b = 0; b < 3; b++)
#pragma unroll
            for (int u = 0; u < 4; u++)
                x[b][u] = s + 4 * SR_LANES * b + 3 * SR_LANES < splits
                              ? src[(size_t)(s + 4 * SR_LANES * b + SR_LANES * u) * stride + i]
                              : splits_zero<T>();
#pragma unroll
        for (int b = 0; b < 3; b++)
            if (s + 3 * SR_LANES < splits) {  // the group at s (the condition of the plain loop)
#pragma unroll
                for (int u = 0; u < 4; u++) a[u] = splits_add(a[u], x[b][u]);
                s += 4 * SR_LANES;
            }
    }
#pragma unroll
    for (int u = 0; u < 3; u++)  // here s + 96 >= splits: at most three left
        if (s + SR_LANES * u < splits) a[u] = splits_add(a[u], src[(size_t)(s + SR_LANES * u) * stride + i]);
    return splits_add(splits_add(a[0], a[1]), splits_add(a[2], a[3]));
}
// A block's share of one job: units [lo, hi) (a unit is 4 elements when T = float4), in chunks of at most
// WGRAD_CHUNK_E elements: the lane parts of a chunk into shared memory (part[k * WGRAD_CHUNK_E + e], 256 threads, each
// item = (unit, lane)), then thread e adds element e's 32 parts in lane order and stores the sum or applies the
// optimizer step. With at most 96 splits (conv2's 66 pair sums) a thread loads all of its (up to WGRAD_IPT) items'
// splits before adding any: ~15 16-byte loads in flight instead of a dependent chain per item; the parameters and
// optimizer state of the update are loaded with them (one round trip to L2 per chunk, not two).
constexpr int WGRAD_CHUNK_E = 160, WGRAD_IPT = 5, WGRAD_ITEMS = 256 * WGRAD_IPT;
static_assert(WGRAD_CHUNK_E <= 256, "one element per thread in the final sums");
template <typename T>
__device__ void splits_reduce_job(const SplitsJob& j, int lo, int hi, float* part, const OptTarget& opt,
                              const OptStep& st) {
    constexpr int V = sizeof(T) / sizeof(float);
    const int nk = min(j.splits, SR_LANES), cu = min(WGRAD_CHUNK_E / V, WGRAD_ITEMS / nk), splits = j.splits;
    const T* src = (const T*)j.src;
    const size_t stride = j.stride / V;
    const bool adamw = opt.c.optimizer == OPT_ADAMW;
    for (int c0 = lo; c0 < hi; c0 += cu) {
        const int nu = min(cu, hi - c0), items = nu * nk, e = threadIdx.x, i = c0 * V + e;
        const bool mine = e < nu * V;
        float p = 0.0f, m = 0.0f, vv = 0.0f;
        if (mine && j.update_off >= 0) {
            const size_t o = (size_t)j.update_off + i;
            p = opt.params[o]; m = opt.m1[o];
            if (adamw) vv = opt.m2[o];
        }
        if (splits <= 3 * SR_LANES) {
            T x[WGRAD_IPT][3];
#pragma unroll
            for (int r = 0; r < WGRAD_IPT; r++) {
                const int it = threadIdx.x + 256 * r, u = it % nu, k = it / nu;
#pragma unroll
                for (int q = 0; q < 3; q++)
                    x[r][q] = it < items && k + SR_LANES * q < splits
                                  ? src[(size_t)(k + SR_LANES * q) * stride + c0 + u]
                                  : splits_zero<T>();
            }
#pragma unroll
            for (int r = 0; r < WGRAD_IPT; r++) {
                const int it = threadIdx.x + 256 * r, u = it % nu, k = it / nu;
                if (it >= items) break;
                T a[4] = {splits_zero<T>(), splits_zero<T>(), splits_zero<T>(), splits_zero<T>()};
#pragma unroll
                for (int q = 0; q < 3; q++)
                    if (k + SR_LANES * q < splits) a[q] = splits_add(a[q], x[r][q]);
                *(T*)(part + k * WGRAD_CHUNK_E + u * V) = splits_add(splits_add(a[0], a[1]), splits_add(a[2], a[3]));
            }
        } else {
            for (int it = threadIdx.x; it < items; it += 256) {
                const int u = it % nu, k = it / nu;
                *(T*)(part + k * WGRAD_CHUNK_E + u * V) = splits_part(src, stride, splits, k, (size_t)c0 + u);
            }
        }
        __syncthreads();
        if (mine) {
            float v = part[e];
#pragma unroll
            for (int k = 1; k < SR_LANES; k++) v += k < nk ? part[k * WGRAD_CHUNK_E + e] : 0.0f;
            if (j.update_off >= 0) {
                const size_t o = (size_t)j.update_off + i;
                opt_update_elem(opt.c, st, &p, v, &m, &vv);
                opt.params[o] = p; opt.m1[o] = m;
                if (j.w2img && i < j.n_head) j.w2img[conv2_fwd_img_index(i)] = tf32_round(p);
                if (adamw) opt.m2[o] = vv;
            } else if (i < j.n_head) {
                j.dst[i] = v;
            } else {
                j.dst_tail[i - j.n_head] = v;
            }
        }
        __syncthreads();  // part is rewritten by the next chunk
    }
}
// Share `share` of `nshares` of a job (the units split evenly), with float4 units when the job's layout allows. Which
// block does which share does not matter for the result: every element's summation order is the lane order above.
__device__ void splits_reduce_share(const SplitsJob& j, int share, int nshares, float* part, const OptTarget& opt,
                                const OptStep& st) {
    if (j.n <= 0) return;
    const bool vec = j.n % 4 == 0 && j.stride % 4 == 0 && ((size_t)j.src & 15) == 0;
    const long long units = vec ? j.n / 4 : j.n, G = nshares, b = share;
    const int lo = (int)(b * units / G), hi = (int)((b + 1) * units / G);
    if (vec) splits_reduce_job<float4>(j, lo, hi, part, opt, st);
    else splits_reduce_job<float>(j, lo, hi, part, opt, st);
}
// The jobs the barrier does not guard (`other`, `extra`) go to the first blocks to arrive: `other` in WGRAD_PRE_O
// shares, `extra` in WGRAD_PRE_X shares on the next ranks (on the same ranks when the grid is smaller than both), so
// the last blocks to finish their bands (the barrier's critical path) go straight to the wait.
constexpr int WGRAD_PRE_O = 40, WGRAD_PRE_X = 16, WGRAD_PRE_P = 8;
__device__ void batch_prefetch(const BatchPrefetch& pf, int share, int nshares) {
    if (!pf.images) return;
    if (pf.xb) {
        const int pos = __ldcg(pf.counters + 1);
        for (int i = share * (int)blockDim.x + (int)threadIdx.x; i < pf.B * GATHER_ITEMS;
             i += nshares * (int)blockDim.x) {
            const int b = i / GATHER_ITEMS, c = i % GATHER_ITEMS, p = pos + b;
            if (p >= pf.n) break;
            const int smp = pf.perm ? __ldcg(pf.perm + p) : p;
            if (c < GATHER_CH)
                ((uint4*)(pf.xb + (size_t)b * IMG * IMG))[c] =
                    __ldg((const uint4*)(pf.images + (size_t)smp * IMG * IMG) + c);
            else pf.yb[b] = pf.labels[smp];
        }
        return;
    }
    constexpr int LINES = (IMG * IMG + 127) / 128 + 1;  // 128-byte lines an image's 784 bytes can touch
    const int pos = __ldcg(pf.counters + 1);
    for (int i = share * (int)blockDim.x + (int)threadIdx.x; i < pf.B * LINES; i += nshares * (int)blockDim.x) {
        const int p = pos + i / LINES;
        if (p >= pf.n) break;
        const char* img = (const char*)(pf.images + (size_t)(pf.perm ? __ldcg(pf.perm + p) : p) * IMG * IMG);
        const char* a = (const char*)((uintptr_t)img & ~(uintptr_t)127) + 128 * (i % LINES);
        if (a < img + IMG * IMG) asm volatile("prefetch.global.L2 [%0];" :: "l"(a));
    }
}

// Weight gradient: dW[co][tap*32 + ci] = sum_pixels dact2[p][co] * act1[p + tap][ci] and db[co] = sum_p dact2[p][co],
// dact2 rebuilt while loading from the pooled gradient and the window codes (dact2_from_pooled).
// GEMM m = co (64), n = (tap, ci) (288), k = pixel. A block takes bands of R = 6 output rows (144 pixels = 18
// k-steps) of one image: dact2 and the act1 patch in shared memory in wgmma's K-major layout (Dt and Pt below). On
// sm_90a two warpgroups run wgmma (tensor-core TF32 at about twice mma.sync's rate on the H100); elsewhere 8 warps of
// 32 x 72 (2 m16 x 9 n8 tiles) run mma.sync on the same layout. Either way the block holds its 64 x 288 sums.
// The bias gradient is summed from the unrounded dact2 as it is loaded (each thread always loads the same 4 channels).
// After its bands the kernel also does the split reductions (see SplitsJob): `wgrad` (its own partial sums), `other`
// (conv1's, from the input-gradient kernel, which must be the launch right before this one) and `extra` (any other
// job, e.g. the small gradients fc1_backward_kernel stored, as a 1-way split), with the optimizer step when their
// update_off >= 0, and with opt.advance_B >= 0 advances the counters. Every operand of the bands was written at least
// two launches earlier, so the bands run before grid_dep_sync (with programmatic dependent launch they overlap the
// input-gradient kernel's last blocks); the wait comes before the reductions read `other`.
constexpr int WGRAD_R = 6, WGRAD_BANDS = H2 / WGRAD_R, WGRAD_NPIX = WGRAD_R * H2;
// The operands' shared-memory layout, one for both paths: K-major core matrices of 8 rows x 4 TF32 values (16 bytes a
// row, 128 bytes contiguous), the "no swizzle" layout wgmma reads. A band's k order is (py, px, j): pixel x = px + 6 j
// of row py (px < 6, j < 4), so a core matrix's 4 values are pixels px, px + 6, px + 12, px + 18, and tap dx only
// moves px to c = px + dx (c < 8): every row of every tap starts 16-byte aligned, no shifted copies (patch columns
// 6, 7, 12, 13, 18, 19 are stored twice). A k-step's 8 values are (py, px) and (py, px + 1), px even.
//   Dt[py][px][co / 8][co % 8][j] (dact2) and Pt[c][prow][ci / 8][ci % 8][j] (the act1 patch, prow < R + 2): the
//   8-row groups are WGRAD_GS = 36 floats apart, not 32: a warp's 32 scalar stores (8 consecutive groups of 4 channels
//   x 4 j) then hit 32 distinct banks, and so do the mma.sync path's fragment loads (g * 4 + t).
// Over Pt's rows (prow, ci) the groups are uniformly WGRAD_GS apart, so taps dy = 0, 1, 2 of one dx are one operand of
// 96 rows (n = dy * 32 + ci).
constexpr int WGRAD_XC = H2 / 4, WGRAD_GS = 36, WGRAD_DT_P = C2 / 8 * WGRAD_GS, WGRAD_PT_R = C1 / 8 * WGRAD_GS;
constexpr int WGRAD_PT_C = (WGRAD_R + 2) * WGRAD_PT_R, WGRAD_DT = WGRAD_R * WGRAD_XC * WGRAD_DT_P,
              WGRAD_PT = (WGRAD_XC + 2) * WGRAD_PT_C;
static_assert(C2 == 64 && C1 == 32 && WGRAD_R + 2 == 8 && WGRAD_XC + 2 == 8 && WGRAD_XC + 1 + 3 * WGRAD_XC == H1 - 1,
              "the weight gradient's load mapping (bit fields of the chunk index) fits these sizes");
constexpr int WGRAD_NOUT = C2 * KC2 + C2;  // a partial sum: the weight gradient, then the bias gradient
// Row stride of a block's 64 x 288 sums staged in shared memory for the cluster's addition: 296 = 8 mod 32 banks, so
// a half-warp's float2 stores (rows g = 0..3, columns 2t) hit 32 distinct banks (a stride of 288 put all 8 rows of
// a fragment on the same 8 banks: 4-way conflicts on every store)
constexpr int WGRAD_OS = KC2 + 8;
// the operands; or (after the bands) the staged partial sums, the bias reduction's 256 float4 and the lane parts of
// the jobs reduced before the grid barrier (past the staged sums, which the cluster's other blocks may still read)
constexpr int WGRAD_PART_PRE = C2 * WGRAD_OS + C2 + 4 * 256;  // float offset of those lane parts
constexpr size_t CONV2_WGRAD_SMEM =
    std::max(WGRAD_DT + WGRAD_PT, WGRAD_PART_PRE + SR_LANES * WGRAD_CHUNK_E) * sizeof(float);
static_assert(WGRAD_NOUT % 16 == 0 && WGRAD_BANDS % 4 == 0,
              "float4 slices over clusters of 2 or 4; B * WGRAD_BANDS a multiple of 4");
static_assert(WGRAD_NOUT / 4 / 2 <= 256 * 10,
              "one batch of distributed shared memory loads per thread (WGRAD_DSM_BATCH)");
static_assert(WGRAD_OS % 32 == 8 && (C2 * WGRAD_OS + C2) % 4 == 0,
              "conflict-free float2 staging; the bias reduction's float4 aligned");
// a loaded float4 (4 consecutive channels) into its 4 rows of a core-matrix layout, rounded to TF32
__device__ __forceinline__ void wgrad_put4(float* p, float4 v) {
    p[0] = tf32_round(v.x); p[4] = tf32_round(v.y); p[8] = tf32_round(v.z); p[12] = tf32_round(v.w);
}
// The phases of conv2_wgrad_tf32_kernel (below), in the order it runs them.
// A band's operands into registers, raw: the pooled gradient's chunks and their window codes, act1's chunks.
// Chunk ch (16 bytes) of a band: dact2 (ND per thread): channels 4 c4, c4 = bits 0-2 and 5 of ch (so a thread's
// c4 is fixed: tid's bits), j = bits 3-4, (py, px) = ch / 64; the patch (NP per thread): channels 4 (bits 0-2),
// j = bits 3-4, prow = bits 5-7, c = ch / 256; column c + 6 j
template <int ND, int NP>
__device__ __forceinline__ void wgrad_load_band(float4 (&vdp)[ND], uint32_t (&vcd)[ND], float4 (&vp)[NP],
                                                const float* dpooled, const uint8_t* codes, const float* act1,
                                                int band, int tid, int c4) {
    const int b = band / WGRAD_BANDS, y0 = (band % WGRAD_BANDS) * WGRAD_R;
#pragma unroll
    for (int i = 0; i < ND; i++) {
        const int ch = tid + i * 256, pp = ch >> 6, x = pp % WGRAD_XC + WGRAD_XC * ((ch >> 3) & 3);
        const size_t pi = pooled_index(b, y0 + pp / WGRAD_XC, x, c4 * 4);
        vdp[i] = *(const float4*)(dpooled + pi);
        vcd[i] = *(const unsigned int*)(codes + pi);
    }
#pragma unroll
    for (int i = 0; i < NP; i++) {
        const int ch = tid + i * 256, col = (ch >> 8) + WGRAD_XC * ((ch >> 3) & 3);
        vp[i] = *(const float4*)(act1 + (((size_t)b * H1 + y0 + ((ch >> 5) & 7)) * H1 + col) * C1 + (ch & 7) * 4);
    }
}
// A band's operands from the registers into Dt and Pt, rounded to TF32: dact2 rebuilt from the pooled gradient and
// the window codes (and summed unrounded into rs, this thread's 4 channels of the bias gradient), act1's patch
template <int ND, int NP>
__device__ __forceinline__ void wgrad_store_band(float* Dt, float* Pt, const float4 (&vdp)[ND],
                                                 const uint32_t (&vcd)[ND], const float4 (&vp)[NP], float4& rs, int y0,
                                                 int tid, int c4) {
#pragma unroll
    for (int i = 0; i < ND; i++) {
        const int ch = tid + i * 256, pp = ch >> 6, j = (ch >> 3) & 3;
        float4 vd = dact2_expand(vdp[i], vcd[i], y0 + pp / WGRAD_XC, pp % WGRAD_XC + WGRAD_XC * j);
        rs.x += vd.x; rs.y += vd.y; rs.z += vd.z; rs.w += vd.w;
        wgrad_put4(Dt + pp * WGRAD_DT_P + (c4 >> 1) * WGRAD_GS + (c4 & 1) * 16 + j, vd);
    }
#pragma unroll
    for (int i = 0; i < NP; i++) {
        const int ch = tid + i * 256;
        wgrad_put4(Pt + (ch >> 8) * WGRAD_PT_C + ((ch >> 5) & 7) * WGRAD_PT_R + ((ch & 7) >> 1) * WGRAD_GS +
                       (ch & 1) * 16 + ((ch >> 3) & 3),
                   vp[i]);
    }
}
// sm_90a: a band's products on wgmma, 18 k-steps of 8 pixels: per k-step an m64n96k8 (d96) and an m64n48k8 (d48)
// from the descriptors of Dt and of this warpgroup's taps in Pt
__device__ __forceinline__ void wgrad_band_wgmma(float (&d96)[48], float (&d48)[24], uint64_t da0, uint64_t db96,
                                                 uint64_t db48) {
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < WGRAD_R * 3; s++) {
        const int py = s / 3, px = 2 * (s % 3);
        const uint64_t da = da0 + (uint64_t)((py * WGRAD_XC + px) * WGRAD_DT_P * 4 / 16);
        const uint64_t dbo = (uint64_t)((px * WGRAD_PT_C + py * WGRAD_PT_R) * 4 / 16);
        wgmma_m64n96k8_ss(d96, da, db96 + dbo);
        wgmma_m64n48k8_ss(d48, da, db48 + dbo);
    }
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(d96);
    acc_fence(d48);
}
// elsewhere: a band's products on mma.sync, this warp's 32 x 72 tile (2 m16 x 9 n8) from the same layout
__device__ __forceinline__ void wgrad_band_mma_sync(float (&acc)[2][9][4], const float* Dt, const float* Pt,
                                                    const int (&boff)[9], int wm, int g, int t) {
#pragma unroll 2
    for (int s = 0; s < WGRAD_R * 3; s++) {
        const int py = s / 3, px = 2 * (s % 3);
        uint32_t a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
            const float* pa = Dt + (py * WGRAD_XC + px) * WGRAD_DT_P + (wm * 4 + mi * 2) * WGRAD_GS + g * 4 + t;
            a[mi][0] = __float_as_uint(pa[0]); a[mi][1] = __float_as_uint(pa[WGRAD_GS]);
            a[mi][2] = __float_as_uint(pa[WGRAD_DT_P]); a[mi][3] = __float_as_uint(pa[WGRAD_DT_P + WGRAD_GS]);
        }
        const float* pp = Pt + px * WGRAD_PT_C + py * WGRAD_PT_R;
#pragma unroll
        for (int ni = 0; ni < 9; ni++) {
            uint32_t b0 = __float_as_uint(pp[boff[ni]]), b1 = __float_as_uint(pp[WGRAD_PT_C + boff[ni]]);
#pragma unroll
            for (int mi = 0; mi < 2; mi++) mma_tf32_16x8x8(acc[mi][ni], a[mi], b0, b1);
        }
    }
}
// The block's partial sums of the weight gradient from the accumulators into pout (row stride os): wgmma's layout
__device__ __forceinline__ void wgrad_store_acc_wgmma(float* pout, int os, const float (&d96)[48],
                                                      const float (&d48)[24], int warp, int wg, int dxw, int g, int t) {
    const int m = (warp % 4) * 16 + g;  // the accumulator rows of this warp of the warpgroup: m and m + 8
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int i = 0; i < 12; i++) {
            const int n = 8 * i + 2 * t;  // dy = n / 32, ci = n % 32 of tap dx = dxw
            *(float2*)(pout + (m + 8 * h) * os + ((n / C1) * 3 + dxw) * C1 + n % C1) =
                make_float2(d96[4 * i + 2 * h], d96[4 * i + 2 * h + 1]);
        }
#pragma unroll
        for (int i = 0; i < 6; i++) {
            const int n = 48 * wg + 8 * i + 2 * t;  // of tap dx = 1
            *(float2*)(pout + (m + 8 * h) * os + ((n / C1) * 3 + 1) * C1 + n % C1) =
                make_float2(d48[4 * i + 2 * h], d48[4 * i + 2 * h + 1]);
        }
    }
}
// the same from mma.sync's accumulators
__device__ __forceinline__ void wgrad_store_acc_mma_sync(float* pout, int os, const float (&acc)[2][9][4], int wm,
                                                         int wn, int g, int t) {
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int ni = 0; ni < 9; ni++) {
                int m = wm * 32 + mi * 16 + g + 8 * h, n = wn * 72 + ni * 8 + 2 * t;
                *(float2*)(pout + m * os + n) = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
            }
}
// The bias gradient's partial sum into pout's last 64 floats: the 16 threads with c4 = q (tid bits 0-2 and 5 from q,
// bits 3-4 and 6-7 free) hold the same 4 channels; added in thread order
__device__ __forceinline__ void wgrad_bias_sum(float* smem, float4 rs, float* pout, int os, int tid) {
    float4* red = (float4*)(smem + C2 * WGRAD_OS + C2);
    red[tid] = rs;
    __syncthreads();
    if (tid < C2 / 4) {
        const int q = (tid & 7) | ((tid & 8) << 2);
        float4 s = red[q];
        for (int k = 1; k < 16; k++) {
            float4 o = red[q | ((k & 3) << 3) | ((k >> 2) << 6)];
            s.x += o.x; s.y += o.y; s.z += o.z; s.w += o.w;
        }
        *(float4*)(pout + C2 * os + tid * 4) = s;
    }
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// sm_90, clusters of 2 or 4: the cluster's partial sums (each block's in its shared memory, row stride WGRAD_OS) added
// through distributed shared memory in rank order, block q adding the q-th slice: one partial sum per cluster
__device__ __forceinline__ void wgrad_cluster_sum(float* smem, float* partial, int cluster, int tid) {
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();  // every block's partial sums are in its shared memory
    TRACE_MARK(1);
    // a thread's (up to) 10 float4 of two ranks' partial sums are loaded before the additions (a distributed
    // shared memory load takes ~a microsecond; one batch covers the slice at cluster 2, two rank pairs at 4); the
    // block's own rank through its local shared memory
    constexpr int WGRAD_DSM_BATCH = 10;
    const int q = (int)cl.block_rank(), per = WGRAD_NOUT / 4 / cluster;
    float4* dst = (float4*)(partial + (size_t)(blockIdx.x / cluster) * WGRAD_NOUT);
    for (int i0 = tid; i0 < per; i0 += 256 * WGRAD_DSM_BATCH) {
        float4 sum[WGRAD_DSM_BATCH];
        int off[WGRAD_DSM_BATCH];
#pragma unroll
        for (int b = 0; b < WGRAD_DSM_BATCH; b++) {
            const int e = q * per + i0 + 256 * b, row = e / (KC2 / 4);
            off[b] = row < C2 ? row * (WGRAD_OS / 4) + e % (KC2 / 4) : C2 * WGRAD_OS / 4 + (e - C2 * KC2 / 4);
        }
        for (int r0 = 0; r0 < cluster; r0 += 2) {
            const float4* s0 = r0 == q ? (const float4*)smem : (const float4*)cl.map_shared_rank(smem, r0);
            const float4* s1 = r0 + 1 == q ? (const float4*)smem : (const float4*)cl.map_shared_rank(smem, r0 + 1);
            float4 v[WGRAD_DSM_BATCH][2];
#pragma unroll
            for (int b = 0; b < WGRAD_DSM_BATCH; b++)
                if (i0 + 256 * b < per) { v[b][0] = s0[off[b]]; v[b][1] = s1[off[b]]; }
#pragma unroll
            for (int b = 0; b < WGRAD_DSM_BATCH; b++) {
                float4 s = r0 == 0 ? v[b][0] : sum[b];  // rank order: ((r0 + r1) + r2) + r3
                if (r0 > 0) { s.x += v[b][0].x; s.y += v[b][0].y; s.z += v[b][0].z; s.w += v[b][0].w; }
                s.x += v[b][1].x; s.y += v[b][1].y; s.z += v[b][1].z; s.w += v[b][1].w;
                sum[b] = s;
            }
        }
#pragma unroll
        for (int b = 0; b < WGRAD_DSM_BATCH; b++)
            if (i0 + 256 * b < per) dst[q * per + i0 + 256 * b] = sum[b];
    }
    // no cluster.sync here: no block leaves, nor reuses its shared memory, before the grid barrier below, which
    // every block reaches only after its reads of the others' shared memory. That order is also stated to the
    // hardware (and to compute-sanitizer, which cannot see the grid barrier): an arrival here, after the reads,
    // waited for after the grid barrier (so it never waits) before the block writes its partial sums' space
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
#endif
__global__ void __launch_bounds__(256)
conv2_wgrad_tf32_kernel(float* partial, const float* __restrict__ dpooled, const uint8_t* __restrict__ codes,
                        const float* __restrict__ act1, int B, int cluster, SplitsJob wgrad, SplitsJob other,
                        SplitsJob extra, OptTarget opt, unsigned long long* bar, BatchPrefetch pf) {
    TRACE_SCOPE(5);
    // (chunk ch of a band: see wgrad_load_band)
    constexpr int ND = WGRAD_NPIX * C2 / 4 / 256, NP = (WGRAD_XC + 2) * (WGRAD_R + 2) * 4 * (C1 / 4) / 256;
    static_assert(ND * 256 == WGRAD_NPIX * C2 / 4 && NP * 256 == (WGRAD_XC + 2) * (WGRAD_R + 2) * 4 * (C1 / 4),
                  "whole rounds of chunks");
    extern __shared__ __align__(16) float smem[];
    float* Dt = smem;
    float* Pt = smem + WGRAD_DT;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int c4 = (tid & 7) | ((tid >> 2) & 8);  // the thread's 4 dact2 channels
    float4 rs = make_float4(0.f, 0.f, 0.f, 0.f);
    // the next band's operands are loaded into registers (raw: pooled-gradient chunks, their codes, act1 chunks)
    // before this band's products and stored after them, so their latency hides behind the math
    float4 vdp[ND], vp[NP];
    uint32_t vcd[ND];
    if ((int)blockIdx.x < B * WGRAD_BANDS) wgrad_load_band(vdp, vcd, vp, dpooled, codes, act1, blockIdx.x, tid, c4);
    // the per-step scalars of the update (a load of the step counter, cosf, powf: ~0.5 us of dependent latency) while
    // the first band's loads are in flight, not on the way to the barrier. The counter was last written by the
    // previous step's launch of this kernel (block 0, after its barrier), many launches back; block 0 advances it
    // only after this launch's barrier, which every block reaches after this read.
    __shared__ OptStep st_s;
    if (tid == 0 && opt.params) st_s = opt_step(opt.c, opt.counters[0]);
#if MNIST_WGMMA
    // sm_90a: warpgroup 0 takes taps dx = 0 (96 columns: n = dy * 32 + ci) and the first 48 of dx = 1, warpgroup 1
    // dx = 2 and the other 48 of dx = 1; per k-step an m64n96k8 and an m64n48k8 wgmma, both operands from shared memory
    const int wg = tid / 128, dxw = 2 * wg;
    float d96[48], d48[24];
#pragma unroll
    for (int i = 0; i < 48; i++) d96[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < 24; i++) d48[i] = 0.0f;
    const uint64_t da0 = wgmma_desc(Dt, WGRAD_DT_P * 4, WGRAD_GS * 4);
    const uint64_t db96 = wgmma_desc(Pt + dxw * WGRAD_PT_C, WGRAD_PT_C * 4, WGRAD_GS * 4);
    const uint64_t db48 = wgmma_desc(Pt + WGRAD_PT_C + wg * 6 * WGRAD_GS, WGRAD_PT_C * 4, WGRAD_GS * 4);
#else
    // mma.sync: 8 warps of 32 x 72 (2 m16 x 9 n8 tiles; an n8 tile lies in one tap)
    const int wm = warp / 4, wn = warp % 4;
    int boff[9];
#pragma unroll
    for (int ni = 0; ni < 9; ni++) {
        const int n = wn * 72 + ni * 8, tap = n / C1;
        boff[ni] = (tap % 3) * WGRAD_PT_C + (tap / 3) * WGRAD_PT_R + (n % C1 / 8) * WGRAD_GS + g * 4 + t;
    }
    float acc[2][9][4];
    acc_zero(acc);
#endif
    for (int band = blockIdx.x; band < B * WGRAD_BANDS; band += gridDim.x) {
        const int y0 = (band % WGRAD_BANDS) * WGRAD_R;
        __syncthreads();  // the previous band's products are done with Dt and Pt
        wgrad_store_band(Dt, Pt, vdp, vcd, vp, rs, y0, tid, c4);
        fence_proxy_async();  // the stores above, before the tensor core's (async proxy) reads (no-op without wgmma)
        __syncthreads();
        if (band + (int)gridDim.x < B * WGRAD_BANDS)
            wgrad_load_band(vdp, vcd, vp, dpooled, codes, act1, band + gridDim.x, tid, c4);
#if MNIST_WGMMA
        wgrad_band_wgmma(d96, d48, da0, db96, db48);
#else
        wgrad_band_mma_sync(acc, Dt, Pt, boff, wm, g, t);
#endif
    }
    TRACE_MARK(0);
    // the block's partial sums, [64][288] then the bias's 64: to global memory, or (cluster > 1, sm_90) to shared
    // memory first (row stride WGRAD_OS), then added across the cluster's blocks through distributed shared memory in
    // rank order (block q adds the q-th slice of all of them): one partial sum per cluster
    __syncthreads();  // every warp is done with Dt and Pt
    const bool staged = cluster > 1;
    float* pout = staged ? smem : partial + (size_t)blockIdx.x * WGRAD_NOUT;
    const int os = staged ? WGRAD_OS : KC2;
#if MNIST_WGMMA
    wgrad_store_acc_wgmma(pout, os, d96, d48, warp, wg, dxw, g, t);
#else
    wgrad_store_acc_mma_sync(pout, os, acc, wm, wn, g, t);
#endif
    wgrad_bias_sum(smem, rs, pout, os, tid);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (staged) wgrad_cluster_sum(smem, partial, cluster, tid);
#endif
    // the split reductions. `other` and `extra` need only the earlier kernels (complete after grid_dep_sync), so
    // the first blocks to arrive at the grid barrier do them while the last ones finish their bands (WGRAD_PRE_O);
    // this kernel's own partial sums after the barrier, on every block. The step counter is read by every block at
    // its start and advanced by block 0 after the barrier.
    TRACE_MARK(2);
    grid_dep_sync();
    const OptStep st = st_s;  // (written before the bands, read after their barriers)
    const GridBarrier wb = grid_barrier_arrive(bar);
    {
        const int G = gridDim.x, no = min(G, WGRAD_PRE_O), nx = min(G, WGRAD_PRE_X), xo = G >= no + nx ? no : 0;
        if (wb.rank < no) splits_reduce_share(other, wb.rank, no, smem + WGRAD_PART_PRE, opt, st);
        if (wb.rank >= xo && wb.rank < xo + nx)
            splits_reduce_share(extra, wb.rank - xo, nx, smem + WGRAD_PART_PRE, opt, st);
        // (the gather of the next batch: up to 2 items per thread, on more ranks at larger batches)
        const int np = min(G, pf.xb ? max(WGRAD_PRE_P, (pf.B * GATHER_ITEMS + 511) / 512) : WGRAD_PRE_P),
                  po = G >= xo + nx + np ? xo + nx : 0;
        if (wb.rank >= po && wb.rank < po + np) batch_prefetch(pf, wb.rank - po, np);
    }
    TRACE_MARK(3);
    grid_barrier_wait(bar, wb.target, 2);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (staged) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");  // (see the arrival above)
#endif
    TRACE_MARK(4);
    if (opt.advance_B >= 0 && blockIdx.x == 0 && tid == 0) { opt.counters[0] += 1; opt.counters[1] += opt.advance_B; }
    splits_reduce_share(wgrad, blockIdx.x, gridDim.x, smem, opt, st);
}
// The conv2 kernels' launch configuration (persistent grids: as many blocks as fit at once), whether the fused
// forward's grid fits, and the weight gradient's cluster size (run_config_decide, once per process)
static void conv2_tf32_decide() {
    int dev, sms, occ_f, occ_ff, occ_d, occ_w;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaCheck(
        cudaFuncSetAttribute(CONV2_FWD_KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)CONV2_FWD_SMEM_FUSED));
    cudaCheck(cudaFuncSetAttribute(conv2_dgrad_tf32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)CONV2_DGRAD_SMEM));
    cudaCheck(cudaFuncSetAttribute(conv2_wgrad_tf32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)CONV2_WGRAD_SMEM));
    cudaCheck(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_f, CONV2_FWD_KERNEL, CONV2_FWD_THREADS, CONV2_FWD_SMEM));
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_ff, CONV2_FWD_KERNEL, CONV2_FWD_THREADS,
                                                            CONV2_FWD_SMEM_FUSED));
    cudaCheck(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_d, conv2_dgrad_tf32_kernel, DG_THREADS, CONV2_DGRAD_SMEM));
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_w, conv2_wgrad_tf32_kernel, 256, CONV2_WGRAD_SMEM));
    g_conv2.fwd_ctas = std::max(1, occ_f) * sms;
    g_run.fused_forward_fits = occ_ff * sms >= FC1F_SPLITS;
    g_conv2.dgrad_ctas = std::max(1, occ_d) * sms;
    g_conv2.wgrad_ctas = std::max(1, std::min(occ_w, 2)) * sms;  // fewer partial sums to add than a full occupancy
    int major;
    cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    // sm_90: clusters of 4 or 2 blocks add their partial sums (a quarter or half as many to reduce), where that keeps
    // (nearly) every SM busy: on an H100 only 30 clusters of 4 are co-resident (120 blocks: three rounds of bands for
    // some blocks, measured slower), 66 of 2.
    for (int cl = 4; major >= 9 && occ_w == 1 && cl >= 2; cl /= 2) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(sms / cl * cl); cfg.blockDim = dim3(256); cfg.dynamicSmemBytes = CONV2_WGRAD_SMEM;
        cudaLaunchAttribute at;
        at.id = cudaLaunchAttributeClusterDimension;
        at.val.clusterDim.x = cl; at.val.clusterDim.y = 1; at.val.clusterDim.z = 1;
        cfg.attrs = &at; cfg.numAttrs = 1;
        int nclusters = 0;
        cudaCheck(cudaOccupancyMaxActiveClusters(&nclusters, conv2_wgrad_tf32_kernel, &cfg));
        if (cl * std::min(nclusters, sms / cl) >= sms - 1) {
            g_run.wgrad_cluster = cl;
            g_conv2.wgrad_ctas = cl * std::min(nclusters, sms / cl);
            break;
        }
    }
    // grid_barrier_arrive's rank needs G - 1 < K / G
    if ((unsigned long long)g_conv2.wgrad_ctas * g_conv2.wgrad_ctas > GRID_BAR_K) {
        fprintf(stderr, "conv2_tf32_decide: weight-gradient grid of %d blocks too large for its barrier\n",
                g_conv2.wgrad_ctas);
        exit(EXIT_FAILURE);
    }
}
// The conv2 kernels' workspaces, the grid barrier and its watchdog (once per process, after conv2_tf32_decide)
static void conv2_tf32_setup() {
    if (g_conv2.ready) return;
    cudaCheck(cudaMalloc(&g_conv2.ws, (size_t)g_conv2.wgrad_ctas * (C2 * KC2 + C2) * sizeof(float)));
    int* wd;
    cudaCheck(cudaHostAlloc(&wd, sizeof(int), cudaHostAllocMapped));
    *wd = 0;
    g_watchdog = wd;
    int* wd_dev;
    cudaCheck(cudaHostGetDevicePointer(&wd_dev, wd, 0));
    cudaCheck(cudaMemcpyToSymbol(g_watchdog_dev, &wd_dev, sizeof(wd_dev)));
    cudaCheck(cudaMalloc(&g_conv2.wgrad_bar, sizeof(unsigned long long)));
    cudaCheck(cudaMemset(g_conv2.wgrad_bar, 0, sizeof(unsigned long long)));
    cudaCheck(cudaMalloc(&g_conv2.wimg_dgrad, DG_WS * sizeof(float)));
    cudaCheck(cudaMemset(g_conv2.wimg_dgrad, 0, DG_WS * sizeof(float)));
    cudaCheck(cudaMalloc(&g_conv2.ws_w1, (size_t)g_conv2.dgrad_ctas * C1 * 10 * sizeof(float)));
    cudaCheck(cudaMalloc(&g_conv2.wimg_fwd, W2IMG_FLOATS * sizeof(float)));
    cudaCheck(cudaMemset(g_conv2.wimg_fwd, 0, W2IMG_FLOATS * sizeof(float)));
    g_conv2.ready = true;
}
// act1 (B,26,26,32) = ReLU(conv1(x) + b1), pooled (B,12,12,64) = the 2x2 max-pool of act2 = ReLU(conv2(act1) + b2)
// and its window codes (B,12,12,64); act2 (B,24,24,64) itself is stored only when act2 is not null (the tests). x
// comes from `in` (ConvInput). Also makes the input gradient's image of conv2.weight (g_conv2.wimg_dgrad) and, when
// act1_sign is not null, act1's signs (B,26,26 words, bit n: channel n > 0), which conv2_dgrad_tf32 reads before its
// wait: launch at least one kernel between the two.
// With fh.part (the fused forward, B <= FUSED_MAX_B, g_run.fused_forward_fits) also fc1 and the head (see FwdHead).
static void conv2_forward_tf32(float* act2, float* pooled, uint8_t* codes, float* act1, uint32_t* act1_sign,
                               const ConvInput& in, const float* w1, const float* b1, const float* w2, const float* b2,
                               int B, const FwdHead& fh) {
    const bool fused = fh.part != nullptr;
    if (fused && (B > FUSED_MAX_B || !g_run.fused_forward_fits)) {
        fprintf(stderr, "conv2_forward_tf32: the fused forward takes batches up to %d on a GPU that holds %d of its "
                "blocks at once\n", FUSED_MAX_B, FC1F_SPLITS);
        exit(EXIT_FAILURE);
    }
    FwdHead f = fh;
    f.bar = g_conv2.wgrad_bar;
    const int grid = fused ? FC1F_SPLITS : std::min(B * CONV2_FWD_BANDS, g_conv2.fwd_ctas);
    launch_pdl(CONV2_FWD_KERNEL, grid, CONV2_FWD_THREADS, fused ? CONV2_FWD_SMEM_FUSED : CONV2_FWD_SMEM, 1, act2, in,
               w1, b1, act1, act1_sign, w2, b2, pooled, codes, g_conv2.wimg_dgrad, B, f);
}
// dact1 = conv2 input gradient of dact2 (from dpooled and the window codes), zeroed where act1 <= 0 (act1_sign: the
// forward's signs of act1; stored only when dact1 is not null), and from it conv1's gradients dw1 (32 x 9) and db1
// (32) with x the network's input.
// Returns the reduction of the blocks' partial sums of dw1, db1 still to do (conv2_wgrad_tf32, launched next).
static SplitsJob conv2_dgrad_tf32(float* dact1, float* dw1, float* db1, const float* dpooled, const uint8_t* codes,
                                  const uint32_t* act1_sign, const float* x, int B, const Fc1Step& fc1) {
    int grid = std::min(ceil_div(B * H1 * H1, DG_CH), g_conv2.dgrad_ctas);
    launch_pdl(conv2_dgrad_tf32_kernel, grid, DG_THREADS, CONV2_DGRAD_SMEM, 1, dact1, dpooled, codes,
               g_conv2.wimg_dgrad, act1_sign, x, g_conv2.ws_w1, B, fc1);
    SplitsJob j;
    j.dst = dw1; j.dst_tail = db1; j.n_head = C1 * 9;
    j.src = g_conv2.ws_w1; j.stride = C1 * 10; j.splits = grid; j.n = C1 * 10;
    return j;
}
// dw2 (64, 3,3,32 internal) and db2 (64) from dact2 (from dpooled and the window codes) and act1, and the split
// reduction `dgrad` that conv2_dgrad_tf32 returned. Launch it right after conv2_dgrad_tf32, with dpooled, codes and
// act1 written at least two launches earlier (the kernel reads them before grid_dep_sync). With update_off >= 0
// conv2's weight and bias (contiguous) get the optimizer step in `opt` at that flat offset instead of dw2/db2; `extra`
// is one more job for the same reduction (see conv2_wgrad_tf32_kernel).
static void conv2_wgrad_tf32(float* dw2, float* db2, const float* dpooled, const uint8_t* codes, const float* act1,
                             int B, const SplitsJob& dgrad, const SplitsJob& extra, const OptTarget& opt,
                             int update_off, const BatchPrefetch& pf) {
    const int cl = g_run.wgrad_cluster, grid = std::min(B * WGRAD_BANDS, g_conv2.wgrad_ctas);  // both multiples of cl
    SplitsJob j;
    j.dst = dw2; j.dst_tail = db2; j.n_head = C2 * KC2;
    j.src = g_conv2.ws; j.stride = WGRAD_NOUT; j.splits = grid / cl; j.n = WGRAD_NOUT;
    j.update_off = update_off;
    if (update_off >= 0) j.w2img = g_conv2.wimg_fwd;
    launch_pdl(conv2_wgrad_tf32_kernel, grid, 256, CONV2_WGRAD_SMEM, cl, g_conv2.ws, dpooled, codes, act1, B, cl, j,
               dgrad, extra, opt, g_conv2.wgrad_bar, pf);
}

// The network's head on the fast path, one warp per row (the one-warp-per-row layout of dev/softmax_forward.cu
// version 3; a 10-wide row is one element per lane, so no online rescaling): with NPARTS > 0, first fc1's output
// h = ReLU(sum of the NPARTS split-K partial sums hpart of fc1_forward_kernel, added in order, + bf1), stored; then
// head_row: logits, the fused log-softmax + NLL as softmax_xent_kernel, and when dh is given dlogits and fc2's input
// gradient dh. (The training step at batch <= 64 does all of this inside conv2's forward kernel instead.)
template <int NPARTS>
__global__ void head_kernel(float* logits, float* dlogits, float* dh, float* losses, int* preds, float* h,
                            const float* __restrict__ hpart, const float* __restrict__ bf1,
                            const float* __restrict__ wf2, const float* __restrict__ bf2, const int* y,
                            const int* counters, int offset_const, int B) {
    TRACE_SCOPE(2);
    __shared__ __align__(16) float ws[NCLS * FC_H];
    __shared__ float bs[NCLS];
    // the parameters before grid_dep_sync: the optimizer wrote them at least two launches earlier
    for (int i = threadIdx.x; i < NCLS * FC_H; i += blockDim.x) ws[i] = wf2[i];
    if (threadIdx.x < NCLS) bs[threadIdx.x] = bf2[threadIdx.x];
    grid_dep_sync();
    __syncthreads();
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= B) return;
    float4 hv;
    if constexpr (NPARTS > 0) {
        float4 p[NPARTS > 0 ? NPARTS : 1];  // all partial sums in flight, then added in order
#pragma unroll
        for (int q = 0; q < NPARTS; q++) p[q] = ((const float4*)(hpart + ((size_t)q * B + row) * FC_H))[lane];
        hv = f4_bias_relu(f4_sum_in_order(p), __ldg((const float4*)bf1 + lane));
        *(float4*)(h + (size_t)row * FC_H + 4 * lane) = hv;
        TRACE_MARK(0);
    } else {
        hv = *(const float4*)(h + (size_t)row * FC_H + 4 * lane);
    }
    head_row(hv, row, lane, ws, bs, logits, dlogits, dh, losses, preds, y, counters, offset_const, B);
}
// ----------------------------------------------------------------------------------------------------------------
// fc1 on the fast path (TF32 mma, operands rounded once as they land in shared memory, as the conv2 kernels)

// Forward (sm_90: thread-block clusters): h = ReLU(pooled Wf1^T + bf1) is 64 x 128 x 9216 at batch 64, too little
// output for 132 SMs, so K is split 128 ways: block (s, rt) computes rows rt*64.. of all 128 outputs over k in
// [72 s, 72 s + 72) (8 warps of 32 x 32). The 8 blocks of a cluster then add their partial sums through distributed
// shared memory, in rank order (block q adds rows 8q..8q+7 of all eight), and write one partial sum per cluster:
// hpart[16][B][128]. head_kernel adds the 16 in order, then the bias and the ReLU. Deterministic; 0.5 MB of partial
// sums at batch 64 instead of the 2.4 MB that the 72-way split of the generic kernel wrote and re-read.
// The fc1.weight loads are issued before grid_dep_sync (only pooled comes from the kernel in front, conv2's forward;
// the weight was last written by the previous step's optimizer step, three or more launches back), so with
// programmatic dependent launch they overlap conv2's tail.
static_assert(64 / FC1F_CLUSTER == 8 && (64 / FC1F_CLUSTER) * (FC_H / 4) == 256,
              "a rank adds 8 rows: a float4 per thread");
__global__ void __launch_bounds__(256)
    fc1_forward_kernel(float* hpart, const float* __restrict__ pooled, const float* __restrict__ wf1, int B) {
    TRACE_SCOPE(1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) float smem[];
    float* As = smem;                  // [64][76]: pooled rows r0.., columns k0..k0+71
    float* Ws = smem + 64 * FC1F_LD;   // [128][76]: fc1.weight rows, columns k0..k0+71
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int wm = warp / 4, wn = warp % 4, r0 = blockIdx.y * 64, k0 = blockIdx.x * FC1F_KC;
    // a block may write another's shared memory only once that block has started: this arrival, waited for just
    // before the stores below (the cluster's blocks are launched together, so the wait costs nothing in practice)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    {
        constexpr int CH = FC1F_KC / 4, NA = (64 * CH + 255) / 256, NW = FC_H * CH / 256;
        static_assert(FC_H * CH % 256 == 0, "fc1.weight chunks split evenly");
        float4 va[NA], vw[NW];
#pragma unroll
        for (int i = 0; i < NW; i++) {  // issued before the wait, in flight across it
            int ch = tid + i * 256, j = ch / CH, c4 = ch % CH;
            vw[i] = __ldg((const float4*)(wf1 + (size_t)j * FC_IN + k0) + c4);
        }
        grid_dep_sync();
#pragma unroll
        for (int i = 0; i < NA; i++) {
            int ch = tid + i * 256, r = ch / CH, c4 = ch % CH;
            va[i] = ch < 64 * CH && r0 + r < B ? __ldg((const float4*)(pooled + (size_t)(r0 + r) * FC_IN + k0) + c4)
                                               : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < NA; i++) {
            int ch = tid + i * 256, r = ch / CH, c4 = ch % CH;
            if (ch < 64 * CH) *(float4*)(As + r * FC1F_LD + 4 * c4) = tf32_round4(va[i]);
        }
#pragma unroll
        for (int i = 0; i < NW; i++) {
            int ch = tid + i * 256, j = ch / CH, c4 = ch % CH;
            *(float4*)(Ws + j * FC1F_LD + 4 * c4) = tf32_round4(vw[i]);
        }
    }
    __syncthreads();
    TRACE_MARK(0);
    float acc[2][4][4];
    acc_zero(acc);
    warp_mma_smem<2, 4, FC1F_KC, FC1F_KC / 8>(acc, As + wm * 32 * FC1F_LD, FC1F_LD, 1, Ws + wn * 32 * FC1F_LD, 1,
                                              FC1F_LD, g, t);
    TRACE_MARK(1);
    // each block sends rows 8q .. 8q + 7 of its partial sum to block q of the cluster (distributed shared memory
    // stores into q's inbox, slot = the sender's rank; the inbox lies past the operands, which q may still read);
    // after the cluster barrier block q adds its 8 slots in rank order, reading only its own shared memory, so no
    // second barrier has to keep a block alive for the others' reads
    cg::cluster_group cluster = cg::this_cluster();
    const int q = (int)cluster.block_rank();
    float* inbox = smem + (64 + FC_H) * FC1F_LD;  // [FC1F_CLUSTER][8][FC_H]
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every block of the cluster has started
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = wm * 32 + mi * 16 + g + 8 * h;
            float* dst = cluster.map_shared_rank(inbox, m / 8) + (q * 8 + m % 8) * FC_H + wn * 32 + 2 * t;
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
                *(float2*)(dst + ni * 8) = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
    cluster.sync();  // every block's rows are in their owners' inboxes
    TRACE_MARK(2);
    const int row = 8 * q + tid / 32, c4 = tid % 32;
    float4 v[FC1F_CLUSTER];
#pragma unroll
    for (int r = 0; r < FC1F_CLUSTER; r++) v[r] = *(const float4*)(inbox + (r * 8 + tid / 32) * FC_H + 4 * c4);
    if (r0 + row < B)
        *(float4*)(hpart + ((size_t)(blockIdx.x / FC1F_CLUSTER) * B + r0 + row) * FC_H + 4 * c4) = f4_sum_in_order(v);
    TRACE_MARK(3);
#endif
}

// Backward: block k < FC1B_BLOCKS (128) owns fc1's inputs k0 = 72k .. k0+71 (the forward's K slices):
//   dpooled[:, k0:k0+72] = dh Wf1[:, k0:k0+72]           (B x 72 x 128; dh is already zeroed where h <= 0)
//   dWf1[:, k0:k0+72]   = dh^T pooled[:, k0:k0+72]        (128 x 72 x B, the batch in chunks of 64 rows)
// 12 warps; warp w: dpooled rows 16 (w / 3) .. + 15 of a chunk and dWf1 rows 32 (w / 3) .. + 31, both in columns
// 24 (w % 3) .. + 23 of the slice. The weight gradient is stored (in a training step the input-gradient kernel's idle
// warp applies its optimizer step, fc1_step_share). The last FC1B_EXTRA blocks compute the small gradients: fc1's bias
// (sum over the batch of dh), fc2's weight and bias (a thread per output, fp32 FMAs over the batch in order).
// One block per SM (the shared memory asked for is more than half an SM's): the 132 blocks fill an H100 in one wave.
// (With 64-column slices, 8 warps and two blocks per SM, 150 blocks, the blocks that shared an SM finished their
// products up to 3.7 us after the median block; measured on the H100, dev/mnist_NOTES.md session 10.)
// The Wf1 slice is loaded before grid_dep_sync: the previous step's optimizer step wrote it, several launches back,
// and the kernels in front only read it; dh, pooled and the rest wait.
constexpr int FC1B_NC = FC1F_KC, FC1B_BLOCKS = FC_IN / FC1B_NC, FC1B_THREADS = 384;
constexpr int FC1B_WLD = FC1B_NC;       // Ws[128][72]: Wf1[j][k0 + c], read as B[k = j][n = c]: 8 mod 32, conflict-free
constexpr int FC1B_HLD = FC_H + 4;      // Hs[64][132]: dh [r][j], read as A[r][k = j] (conflict-free) and as
                                        // A[m = j][k = r] (two-way conflicts: one stride cannot serve both)
constexpr int FC1B_PLD = FC1B_NC;       // Ps[64][72]: pooled [r][c], read as B[k = r][n = c]: conflict-free
static_assert(FC1B_WLD % 32 == 8 && FC1B_PLD % 32 == 8,
              "conflict-free B fragments; the gradient's float2 stores into Gs");
static_assert(FC_IN % FC1B_NC == 0 && FC1B_NC == 72 && FC1B_THREADS == 384,
              "12 warps: 4 x 3 tiles of 16 x 24 and of 32 x 24");
constexpr size_t FC1B_SMEM_USED = (size_t)(FC_H * FC1B_WLD + 64 * FC1B_HLD + 64 * FC1B_PLD) * sizeof(float);
constexpr size_t FC1B_SMEM = FC1B_SMEM_USED > 116 * 1024 ? FC1B_SMEM_USED : 116 * 1024;  // one block per SM
constexpr int FC1B_SMALL = FC_H + NCLS * FC_H + NCLS, FC1B_EXTRA = (FC1B_SMALL + FC1B_THREADS - 1) / FC1B_THREADS;
// The phases of fc1_backward_kernel (below), in the order it runs them.
// The last FC1B_EXTRA blocks: fc1.bias's gradient (dh summed over the batch), fc2's weight and bias gradients (a
// thread per output, fp32 FMAs over the batch in order), and the counters' advance
__device__ __forceinline__ void fc1b_small_grads(const Fc1BackwardArgs& a, int tid) {
    const int B = a.B;
    // the batch's position: every reader of it in this step (conv2's forward, the head) is complete
    if (a.advance_pos >= 0 && blockIdx.x == FC1B_BLOCKS && tid == 0) a.counters[1] += a.advance_pos;
    int i = (blockIdx.x - FC1B_BLOCKS) * FC1B_THREADS + tid;
    if (i < FC_H) {
        float s = 0.0f;
#pragma unroll 16
        for (int b = 0; b < B; b++) s += a.dh[(size_t)b * FC_H + i];
        a.gbf1[i] = s;
    } else if (i < FC_H + NCLS * FC_H) {
        int j = (i - FC_H) / FC_H, k = (i - FC_H) % FC_H;
        float s = 0.0f;
#pragma unroll 16
        for (int b = 0; b < B; b++) s = fmaf(a.dlogits[b * NCLS + j], a.h[(size_t)b * FC_H + k], s);
        a.gwf2[j * FC_H + k] = s;
    } else if (i < FC1B_SMALL) {
        int j = i - FC_H - NCLS * FC_H;
        float s = 0.0f;
#pragma unroll 16
        for (int b = 0; b < B; b++) s += a.dlogits[b * NCLS + j];
        a.gbf2[j] = s;
    }
}
// A chunk of 64 batch rows from r0 into shared memory, rounded to TF32: dh into Hs, the pooled slice into Ps
// (zeros past the batch); all loads before any store
template <int NT, int CH>
__device__ __forceinline__ void fc1b_load_rows(float* Hs, float* Ps, const Fc1BackwardArgs& a, int r0, int k0,
                                               int tid) {
    const int B = a.B;
    constexpr int NH = (64 * FC_H / 4 + NT - 1) / NT, NP = 64 * CH / NT;
    float4 vh[NH], vp[NP];
#pragma unroll
    for (int i = 0; i < NH; i++) {
        int ch = tid + i * NT, r = ch / (FC_H / 4), c4 = ch % (FC_H / 4);
        vh[i] = r < 64 && r0 + r < B ? __ldg((const float4*)(a.dh + (size_t)(r0 + r) * FC_H) + c4)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < NP; i++) {
        int ch = tid + i * NT, r = ch / CH, c4 = ch % CH;
        vp[i] = r0 + r < B ? ((const float4*)(a.pooled + (size_t)(r0 + r) * FC_IN + k0))[c4]
                           : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < NH; i++) {
        int ch = tid + i * NT, r = ch / (FC_H / 4), c4 = ch % (FC_H / 4);
        if (r < 64) *(float4*)(Hs + r * FC1B_HLD + 4 * c4) = tf32_round4(vh[i]);
    }
#pragma unroll
    for (int i = 0; i < NP; i++) {
        int ch = tid + i * NT, r = ch / CH, c4 = ch % CH;
        *(float4*)(Ps + r * FC1B_PLD + 4 * c4) = tf32_round4(vp[i]);
    }
}
// dpooled rows r0.. of the slice (64 x 72, k = the 128 fc1 outputs): this warp's 16 x 24
__device__ __forceinline__ void fc1b_dpooled_rows(const Fc1BackwardArgs& a, const float* Hs, const float* Ws, int r0,
                                                  int k0, int wr, int wc, int g, int t) {
    const int B = a.B;
    float d[1][3][4];
    acc_zero(d);
    warp_mma_smem<1, 3, FC_H, 4>(d, Hs + 16 * wr * FC1B_HLD, FC1B_HLD, 1, Ws + wc, FC1B_WLD, 1, g, t);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r0 + 16 * wr + g + 8 * h;
        if (r >= B) continue;
#pragma unroll
        for (int ni = 0; ni < 3; ni++)
            *(float2*)(a.dpooled + (size_t)r * FC_IN + k0 + wc + ni * 8 + 2 * t) =
                make_float2(d[0][ni][2 * h], d[0][ni][2 * h + 1]);
    }
}
// The slice's weight gradient (the block's accumulators) out through shared memory (the operands are done with;
// Gs[128][72] takes Ws's place), so that it leaves in rows of 16-byte chunks
template <int NT, int CH>
__device__ __forceinline__ void fc1b_store_wgrad(float* smem, const Fc1BackwardArgs& a, const float (&acc)[2][3][4],
                                                 int k0, int tid, int wr, int wc, int g, int t) {
    __syncthreads();
    float* Gs = smem;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int ni = 0; ni < 3; ni++)
                *(float2*)(Gs + (32 * wr + mi * 16 + g + 8 * h) * FC1B_WLD + wc + ni * 8 + 2 * t) =
                    make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
    __syncthreads();
    TRACE_MARK(3);
#pragma unroll
    for (int i = 0; i < FC_H * CH / NT; i++) {
        int ch = tid + i * NT, j = ch / CH, c4 = ch % CH;
        *(float4*)(a.gwf1 + (size_t)j * FC_IN + k0 + 4 * c4) = *(const float4*)(Gs + j * FC1B_WLD + 4 * c4);
    }
}
__global__ void __launch_bounds__(FC1B_THREADS, 1) fc1_backward_kernel(Fc1BackwardArgs a) {
    TRACE_SCOPE(3);
    const int tid = threadIdx.x, B = a.B;
    if (blockIdx.x >= FC1B_BLOCKS) {
        grid_dep_sync();
        fc1b_small_grads(a, tid);
        TRACE_MARK(5);
        return;
    }
    extern __shared__ __align__(16) float smem[];
    float* Ws = smem;
    float* Hs = Ws + FC_H * FC1B_WLD;
    float* Ps = Hs + 64 * FC1B_HLD;
    constexpr int NT = FC1B_THREADS, CH = FC1B_NC / 4;  // the slice's 16-byte chunks per row
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3, k0 = blockIdx.x * FC1B_NC;
    const int wr = warp / 3, wc = 24 * (warp % 3);
    float acc[2][3][4];
    static_assert(FC_H * CH % NT == 0 && 64 * CH % NT == 0, "the Wf1 and pooled slices' chunks split evenly");
#pragma unroll
    for (int i = 0; i < FC_H * CH / NT; i++) {  // the Wf1 slice: 128 rows of 18 float4 (before the wait)
        int ch = tid + i * NT, j = ch / CH, c4 = ch % CH;
        *(float4*)(Ws + j * FC1B_WLD + 4 * c4) =
            tf32_round4(__ldg((const float4*)(a.wf1 + (size_t)j * FC_IN + k0) + c4));
    }
    grid_dep_sync();
    acc_zero(acc);
    for (int r0 = 0; r0 < B; r0 += 64) {
        __syncthreads();  // the previous chunk's fragment reads are done
        fc1b_load_rows<NT, CH>(Hs, Ps, a, r0, k0, tid);
        __syncthreads();
        TRACE_MARK(0);
        fc1b_dpooled_rows(a, Hs, Ws, r0, k0, wr, wc, g, t);
        TRACE_MARK(1);
        // dWf1 += dh^T pooled over this chunk's 64 rows (zero rows past B add nothing)
        warp_mma_smem<2, 3, 64, 8>(acc, Hs + 32 * wr, 1, FC1B_HLD, Ps + wc, FC1B_PLD, 1, g, t);
    }
    TRACE_MARK(2);
    fc1b_store_wgrad<NT, CH>(smem, a, acc, k0, tid, wr, wc, g, t);
}
// fc1's backward on the fast path (Fc1BackwardArgs): FC1B_BLOCKS + FC1B_EXTRA blocks of FC1B_THREADS
static void fc1_backward(const Fc1BackwardArgs& a) {
    launch_pdl(fc1_backward_kernel, FC1B_BLOCKS + FC1B_EXTRA, FC1B_THREADS, FC1B_SMEM, 1, a);
}

// Writes MNIST_WGMMA as compiled into the code this GPU loaded (run_config_decide). A kernel, not a __device__
// variable: a variable would move the kernels' addresses of the others (constant bank 4), changing their SASS.
__global__ void wgmma_probe_kernel(int* built) { *built = MNIST_WGMMA; }
// Once per process, after run_config_decide: the conv2 kernels' workspaces and the fc1 kernels' shared-memory limits.
static void fast_path_setup() {
    static bool done = false;
    if (done) return;
    if (!g_run.gpu_known) die("fast_path_setup: the run configuration has no GPU part (call run_config_decide first)");
    conv2_tf32_setup();
    if (g_run.fc1_cluster)
        cudaCheck(
            cudaFuncSetAttribute(fc1_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)FC1F_SMEM));
    cudaCheck(cudaFuncSetAttribute(fc1_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)FC1B_SMEM));
    done = true;
}
// The run configuration (RunConfig): the backend, precision and CPU threads given, and on the first call with a GPU
// backend what the GPU supports: programmatic dependent launch, thread-block clusters and bulk copies on sm_90+ (else
// fc1's forward stays on the generic kernel and every launch is an ordinary one), the code it loaded (wgmma or
// mma.sync), the conv2 kernels' launch configuration (conv2_tf32_decide).
static void run_config_decide(int backend, int tf32, int cpu_threads) {
    g_run.backend = backend; g_run.tf32 = tf32; g_run.cpu_threads = cpu_threads;
    if (backend == BACKEND_CPU || g_run.gpu_known) return;
    int dev, major, wgmma = 0;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    g_run.pdl = g_run.fc1_cluster = g_run.bulk_copy = major >= 9;
    int* built;
    cudaCheck(cudaMalloc(&built, sizeof(int)));
    wgmma_probe_kernel<<<1, 1>>>(built);
    launch_check();
    cudaCheck(cudaMemcpy(&wgmma, built, sizeof(int), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(built));
    g_run.wgmma = wgmma != 0;
    conv2_tf32_decide();
    g_run.gpu_known = true;
}

// ================================================================================================================
// 7. THE COMMAND LINE
//   arguments, evaluation, main; left out of TESTING builds (dev/test_mnist.cu includes this file)
// ================================================================================================================
#ifndef TESTING
// ----------------------------------------------------------------------------------------------------------------
// CLI
struct Args {
    std::string data_dir = "data/mnist", device = "auto", matmul = "ours", optimizer = "sgd", lr_schedule = "cosine";
    std::string checkpoint = "", resume = "", load = "", allow_change = "";
    int tf32 = 1, epochs = 20, batch_size = 64, warmup_steps = 300, seed = 1, train_limit = 0, test_limit = 0;
    int eval_batch_size = 1000, eval_only = 0, eval_every = 0, cuda_graph = 1, confusion = 1, cpu_threads = 0;
    float lr = 0.03f, lr_min = 0.0f, momentum = 0.9f, weight_decay = 5e-4f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
    float stop_at_accuracy = 0.0f;
    // Muon, Shampoo and K-FAC
    std::string graft = "sgd";
    int muon_nesterov = 1, ns_steps = 5, precond_every = 20, precond_start = 20, max_precond_dim = 1024;
    float muon_lr = 0.02f, muon_momentum = 0.95f, precond_eps = 1e-12f, precond_damping = 1e-3f;
    float kfac_stat_decay = 0.95f;
    int precond_delay = 0;
    // per-sample gradients
    std::string precond = "none";
    float clip_per_sample = 0.0f, noise_multiplier = 0.0f, fisher_power = 0.5f;
    bool fresh_optimizer = false;  // --resume with --allow_change optimizer: the stored weights, a new optimizer state
    std::set<std::string> given;  // the flags on the command line
};
struct FlagSpec { const char* name; char type; void* ptr; double lo, hi; const char* choices; const char* help; };

static std::vector<FlagSpec> flag_specs(Args& a) {
    return {
        {"data_dir", 's', &a.data_dir, 0, 0, nullptr, "folder with the four MNIST IDX .gz files"},
        {"device", 'c', &a.device, 0, 0, "auto,cuda,cpu", "auto: CUDA when a device is present, else the CPU"},
        {"matmul", 'c', &a.matmul, 0, 0, "ours,cublas", "every matrix product on our tiled kernel or on cuBLAS"},
        {"tf32", 'i', &a.tf32, 0, 1, nullptr,
         "1: TF32 tensor cores in both our kernel and cuBLAS; 0: strict fp32 in both"},
        {"epochs", 'i', &a.epochs, 1, 10000, nullptr, "training epochs"},
        {"batch_size", 'i', &a.batch_size, 1, 2048, nullptr, "training batch size"},
        {"optimizer", 'c', &a.optimizer, 0, 0, "sgd,adamw,muon,shampoo,kfac",
         "SGD with momentum and weight decay, AdamW, Muon (AdamW for the biases), Shampoo or K-FAC (both grafted on "
         "--graft)"},
        {"lr", 'f', &a.lr, 1e-9, 1e9, nullptr, "peak learning rate"},
        {"lr_schedule", 'c', &a.lr_schedule, 0, 0, "constant,cosine,linear",
         "after warm-up: constant, cosine or linear decay to lr_min"},
        {"warmup_steps", 'i', &a.warmup_steps, 0, 100000000, nullptr, "linear warm-up steps"},
        {"lr_min", 'f', &a.lr_min, 0, 1e9, nullptr, "learning rate at the end of the decay"},
        {"momentum", 'f', &a.momentum, 0, 0.999999, nullptr, "SGD momentum"},
        {"weight_decay", 'f', &a.weight_decay, 0, 10, nullptr,
         "weight decay (SGD: added to the gradient; AdamW: decoupled)"},
        {"beta1", 'f', &a.beta1, 0, 0.999999, nullptr, "AdamW beta1"},
        {"beta2", 'f', &a.beta2, 0, 0.999999, nullptr, "AdamW beta2; --precond fisher_diag's running average"},
        {"eps", 'f', &a.eps, 1e-30, 1, nullptr, "AdamW epsilon"},
        {"muon_lr", 'f', &a.muon_lr, 1e-9, 1e9, nullptr,
         "Muon: the weight matrices' peak learning rate (--lr is the biases' AdamW's; same schedule)"},
        {"muon_momentum", 'f', &a.muon_momentum, 0, 0.999999, nullptr, "Muon momentum"},
        {"muon_nesterov", 'i', &a.muon_nesterov, 0, 1, nullptr, "Muon: 1 Nesterov momentum, 0 plain"},
        {"ns_steps", 'i', &a.ns_steps, 1, 99, nullptr, "Muon: Newton-Schulz steps"},
        {"graft", 'c', &a.graft, 0, 0, "sgd,adam",
         "Shampoo, K-FAC: step size grafted onto SGD-momentum (--lr, --momentum) or AdamW (--lr, --beta1, --beta2, "
         "--eps)"},
        {"precond_every", 'i', &a.precond_every, 1, 100000000, nullptr,
         "Shampoo, K-FAC: recompute the inverse 4th roots (K-FAC: the inverses) every N steps"},
        {"precond_start", 'i', &a.precond_start, 0, 100000000, nullptr,
         "Shampoo, K-FAC: first step with roots (before it: the graft's step)"},
        {"max_precond_dim", 'i', &a.max_precond_dim, 1, 16384, nullptr,
         "Shampoo, K-FAC: dimensions above this are split into blocks of this size"},
        {"precond_eps", 'f', &a.precond_eps, 0, 1, nullptr,
         "Shampoo, K-FAC, fisher_diag: epsilon added to each factor's diagonal (to the Fisher)"},
        {"precond_damping", 'f', &a.precond_damping, 0, 10, nullptr,
         "Shampoo, K-FAC, fisher_diag: damping added to each factor's diagonal (to the Fisher), times its mean "
         "eigenvalue"},
        {"kfac_stat_decay", 'f', &a.kfac_stat_decay, 0, 0.999999, nullptr,
         "K-FAC: running-average decay of the factors A and G"},
        {"precond_delay", 'i', &a.precond_delay, 0, 100000000, nullptr,
         "Shampoo, K-FAC: the roots due at step s are computed meanwhile (GPU: on a second stream) and used from step "
         "s + N, N <= --precond_every (0: computed and used at s)"},
        {"clip_per_sample", 'f', &a.clip_per_sample, 0, 1e9, nullptr,
         "clip each sample's whole-model gradient to this norm before averaging (DP-SGD; 0: off; the generic path)"},
        {"noise_multiplier", 'f', &a.noise_multiplier, 0, 1e9, nullptr,
         "DP-SGD: Gaussian noise of std noise_multiplier * clip_per_sample / batch_size added to the mean gradient"},
        {"precond", 'c', &a.precond, 0, 0, "none,fisher_diag",
         "fisher_diag: SGD on the gradient divided by (F + precond_eps + precond_damping mean F)^fisher_power, F the "
         "empirical-Fisher diagonal's running average (--beta2, bias-corrected)"},
        {"fisher_power", 'f', &a.fisher_power, 0, 1, nullptr,
         "--precond fisher_diag: the power of the preconditioner (0.5 as Adam's, 1 the natural gradient's)"},
        {"seed", 'i', &a.seed, 0, 2147483647, nullptr,
         "seed of the initial weights, of every epoch's shuffle and of the DP noise"},
        {"train_limit", 'i', &a.train_limit, 0, 60000, nullptr, "use the first N training images (0: all)"},
        {"test_limit", 'i', &a.test_limit, 0, 10000, nullptr, "use the first N test images (0: all)"},
        {"eval_batch_size", 'i', &a.eval_batch_size, 1, 10000, nullptr,
         "evaluation batch size (the CPU uses at most 100)"},
        {"stop_at_accuracy", 'f', &a.stop_at_accuracy, 0, 100, nullptr,
         "stop at the first evaluation (each epoch's end, every --eval_every steps) whose test accuracy (%) reaches "
         "this (0: off)"},
        {"eval_every", 'i', &a.eval_every, 0, 100000000, nullptr,
         "also evaluate on the test set after every N training steps of the schedule (0: at epoch ends only)"},
        {"checkpoint", 's', &a.checkpoint, 0, 0, nullptr,
         "write a checkpoint here after every epoch (atomic; empty: none)"},
        {"resume", 's', &a.resume, 0, 0, nullptr,
         "continue training from this checkpoint (weights, optimizer state, epoch, step)"},
        {"allow_change", 's', &a.allow_change, 0, 0, nullptr,
         "with --resume: stored settings this run changes "
         "knowingly (comma list of lr, seed, batch_size, epochs, lr_schedule, warmup_steps, lr_min, momentum, "
         "weight_decay, beta1, beta2, eps, train_limit, muon_lr, muon_momentum, muon_nesterov, ns_steps, "
         "precond_every, precond_start, precond_eps, precond_damping, kfac_stat_decay, precond_delay; optimizer: a new "
         "optimizer state (also for --graft, --max_precond_dim)); without it a differing one is an error"},
        {"load", 's', &a.load, 0, 0, nullptr, "load weights from this checkpoint"},
        {"eval_only", 'i', &a.eval_only, 0, 1, nullptr, "1: evaluate the --load weights on the test set and exit"},
        {"cuda_graph", 'i', &a.cuda_graph, 0, 1, nullptr,
         "1: replay the training steps as CUDA graphs (32 steps each)"},
        {"confusion", 'i', &a.confusion, 0, 1, nullptr, "1: print the confusion matrix at the end"},
        {"cpu_threads", 'i', &a.cpu_threads, 0, 1024, nullptr, "CPU path threads (0: all cores)"},
    };
}
static std::string flag_value_str(const FlagSpec& f) {
    char buf[64];
    switch (f.type) {
        case 'i': snprintf(buf, sizeof buf, "%d", *(int*)f.ptr); return buf;
        case 'f': snprintf(buf, sizeof buf, "%g", *(float*)f.ptr); return buf;
        default: { std::string s = *(std::string*)f.ptr; return s.empty() ? "\"\"" : s; }
    }
}
static void print_help(Args& a) {
    printf("usage: ./train_mnist [--flag value ...]\n\n"
           "Trains conv32-conv64-maxpool-fc128-fc10 on MNIST. Flags (default in brackets):\n");
    for (auto& f : flag_specs(a)) {
        std::string d = flag_value_str(f);
        printf("  --%-18s %s [%s]%s%s\n", f.name, f.help, d.c_str(), f.choices ? "  one of: " : "",
               f.choices ? f.choices : "");
    }
    printf("  --%-18s this help\n", "help");
}
static void parse_args(int argc, char** argv, Args& a) {
    std::vector<FlagSpec> specs = flag_specs(a);
    for (int i = 1; i < argc; i++) if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { print_help(a); exit(0); }
    for (int i = 1; i < argc; i += 2) {
        const char* arg = argv[i];
        if (strncmp(arg, "--", 2) != 0) {
            fprintf(stderr, "error: expected a flag like --name, found '%s' (see --help)\n", arg);
            exit(1);
        }
        const FlagSpec* f = nullptr;
        for (auto& s : specs) if (!strcmp(s.name, arg + 2)) f = &s;
        if (!f) { fprintf(stderr, "error: unknown flag %s (see --help)\n", arg); exit(1); }
        if (i + 1 >= argc) { fprintf(stderr, "error: flag %s expects a value, found none\n", arg); exit(1); }
        a.given.insert(f->name);
        const char* v = argv[i + 1];
        for (auto& s : specs)  // a path's value missing ("--load --steps"): the next flag took its place
            if (f->type == 's' && !strncmp(v, "--", 2) && !strcmp(s.name, v + 2)) {
                fprintf(stderr, "error: flag %s expects a value, found the flag %s\n", arg, v);
                exit(1);
            }
        char* end = nullptr;
        if (f->type == 'i') {
            errno = 0;
            long x = strtol(v, &end, 10);
            if (!*v || *end || errno) {
                fprintf(stderr, "error: flag %s expects an integer, found '%s'\n", arg, v);
                exit(1);
            }
            if (x < f->lo || x > f->hi) {
                fprintf(stderr, "error: flag %s expects an integer in [%g, %g], found %ld\n", arg, f->lo, f->hi, x);
                exit(1);
            }
            *(int*)f->ptr = (int)x;
        } else if (f->type == 'f') {
            errno = 0;
            double x = strtod(v, &end);
            if (!*v || *end || errno || !std::isfinite(x)) {
                fprintf(stderr, "error: flag %s expects a number, found '%s'\n", arg, v);
                exit(1);
            }
            if (x < f->lo || x > f->hi) {
                fprintf(stderr, "error: flag %s expects a number in [%g, %g], found %g\n", arg, f->lo, f->hi, x);
                exit(1);
            }
            *(float*)f->ptr = (float)x;
        } else if (f->type == 'c') {
            std::string choices = std::string(",") + f->choices + ",";
            if (!*v || choices.find(std::string(",") + v + ",") == std::string::npos) {
                fprintf(stderr, "error: flag %s expects one of %s, found '%s'\n", arg, f->choices, v); exit(1);
            }
            *(std::string*)f->ptr = v;
        } else {
            *(std::string*)f->ptr = v;
        }
    }
    if (a.eval_only && a.load.empty()) {
        fprintf(stderr, "error: --eval_only 1 needs --load FILE, found none\n");
        exit(1);
    }
    if (!a.resume.empty() && !a.load.empty()) {
        fprintf(stderr, "error: --resume and --load exclude each other, found both\n");
        exit(1);
    }
    if (a.eval_only && !a.checkpoint.empty()) {  // it would not be written: no training, no checkpoint
        fprintf(stderr, "error: --eval_only 1 trains nothing and writes no checkpoint, found --checkpoint %s\n",
                a.checkpoint.c_str());
        exit(1);
    }
    if (a.eval_only && a.eval_every > 0)
        die("--eval_only 1 trains nothing: no step to evaluate after, found --eval_every " +
            std::to_string(a.eval_every));
    if (!a.allow_change.empty() && a.resume.empty()) die("--allow_change applies to --resume only, found no --resume");
    if (a.lr_min > a.lr) {
        fprintf(stderr, "error: flag --lr_min expects a value <= --lr (%g), found %g\n", a.lr, a.lr_min);
        exit(1);
    }
}

// GPU memory (issue 21 item 6): "free / total MiB" now; the largest total - free seen goes to g_gpu_peak_used (the
// whole device's use, so other processes count too; cudaMalloc has no peak counter of its own).
static double g_gpu_peak_used = 0;
static std::string gpu_memory_line() {
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    g_gpu_peak_used = std::max(g_gpu_peak_used, (double)(total_b - free_b));
    char buf[64];
    snprintf(buf, sizeof buf, "%.0f / %.0f MiB", free_b / 1048576.0, total_b / 1048576.0);
    return buf;
}

struct EvalResult { double loss = 0; double accuracy = 0; std::vector<int> confusion; };
// Evaluates on a split: forward in eval batches, per-sample losses and predictions stay on the device until one
// copy at the end.
static EvalResult evaluate(Mnist* m, const DeviceData& d, const std::vector<uint8_t>& host_labels, float* losses,
                           int* preds, int eval_batch) {
    for (int off = 0; off < d.n; off += eval_batch) {
        int B = std::min(eval_batch, d.n - off);
        mnist_gather(m, d, nullptr, nullptr, off, B);
        mnist_forward(m, B);
        mnist_loss(m, B, losses, preds, nullptr, off, false);
    }
    std::vector<float> l(d.n); std::vector<int> p(d.n);
    if (m->cpu) { memcpy(l.data(), losses, d.n * 4); memcpy(p.data(), preds, d.n * 4); }
    else {
        cudaCheck(cudaMemcpyAsync(l.data(), losses, d.n * 4, cudaMemcpyDeviceToHost, g_mm.stream));
        cudaCheck(cudaMemcpyAsync(p.data(), preds, d.n * 4, cudaMemcpyDeviceToHost, g_mm.stream));
        cudaCheck(cudaStreamSynchronize(g_mm.stream));
    }
    EvalResult r; r.confusion.assign(NCLS * NCLS, 0);
    int correct = 0;
    for (int i = 0; i < d.n; i++) {
        r.loss += l[i];
        correct += p[i] == host_labels[i];
        r.confusion[host_labels[i] * NCLS + p[i]]++;
    }
    r.loss /= d.n; r.accuracy = 100.0 * correct / d.n;
    return r;
}


// --resume continues the stored trajectory: every setting it depends on comes from the checkpoint. A flag not given
// takes the stored value; one given with another value is an error naming the flag and the stored value, unless
// --allow_change names it (then it is taken, and said). A setting without effect on this run is left as given
// (momentum under AdamW, beta1/beta2/eps under SGD, epochs and lr_min under a constant schedule). The optimizer
// cannot change (its state would not fit); the training images are checked once the data is loaded (main).
static const char* const ALLOW_CHANGE_NAMES[] = {"lr", "seed", "batch_size", "epochs", "lr_schedule", "warmup_steps",
                                                 "lr_min", "momentum", "weight_decay", "beta1", "beta2", "eps",
                                                 "train_limit", "muon_lr", "muon_momentum", "muon_nesterov",
                                                 "ns_steps", "precond_every", "precond_start", "precond_eps",
                                                 "precond_damping", "kfac_stat_decay", "optimizer", "clip_per_sample",
                                                 "noise_multiplier", "fisher_power", "precond_delay"};
static std::set<std::string> parse_allow_change(const std::string& list) {
    std::set<std::string> out;
    for (size_t i = 0; i < list.size();) {
        size_t j = std::min(list.find(',', i), list.size());
        std::string name = list.substr(i, j - i);
        bool known = false;
        for (const char* n : ALLOW_CHANGE_NAMES) known = known || name == n;
        if (!known) {
            std::string names;
            for (const char* n : ALLOW_CHANGE_NAMES) names += std::string(names.empty() ? "" : ", ") + n;
            die("--allow_change expects a comma list of " + names + ", found '" + name + "' in '" + list + "'");
        }
        out.insert(name);
        i = j + 1;
    }
    return out;
}
static void resume_settings(Args& a, const CheckpointMeta& s, const std::string& path,
                            const std::set<std::string>& allowed) {
    const OptConfig& o = s.opt;
    // the optimizer, Shampoo's graft and block size shape the optimizer state: a change restarts it (--allow_change
    // optimizer), or is an error
    const std::string stored_optimizer = OPTIMIZER_NAMES[o.optimizer], stored_graft = GRAFT_NAMES[o.graft];
    const std::string optimizer = a.given.count("optimizer") ? a.optimizer : stored_optimizer;
    struct Shape { const char* flag; bool differs; std::string given, stored; };
    const bool shampoo = optimizer == stored_optimizer && (o.optimizer == OPT_SHAMPOO || o.optimizer == OPT_KFAC);
    const std::string stored_precond = PRECOND_NAMES[o.precond];
    const Shape shapes[] = {
        {"optimizer", optimizer != stored_optimizer, optimizer, stored_optimizer},
        {"precond", a.given.count("precond") && a.precond != stored_precond, a.precond, stored_precond},
        {"graft", shampoo && a.given.count("graft") && a.graft != stored_graft, a.graft, stored_graft},
        {"max_precond_dim", shampoo && a.given.count("max_precond_dim") && a.max_precond_dim != o.max_precond_dim,
         std::to_string(a.max_precond_dim), std::to_string(o.max_precond_dim)}};
    for (const Shape& sh : shapes) {
        if (!sh.differs) continue;
        if (!allowed.count("optimizer"))
            die("--" + std::string(sh.flag) + " " + sh.given + " differs from the " + sh.flag + " " + sh.stored +
                " stored in " + path + ": its optimizer state cannot continue as " + sh.given + "'s (add "
                "--allow_change optimizer to continue the trajectory with a new optimizer state, or start a new run "
                "from its weights with --load)");
        printf("note: --%s %s replaces the %s %s stored in %s: a new optimizer state (--allow_change optimizer)\n",
               sh.flag, sh.given.c_str(), sh.flag, sh.stored.c_str(), path.c_str());
        a.fresh_optimizer = true;
    }
    a.optimizer = optimizer;
    if (!a.fresh_optimizer) {
        a.graft = stored_graft; a.max_precond_dim = o.max_precond_dim; a.precond = stored_precond;
    }
    // true: take the stored value
    auto keep = [&](const char* flag, bool matters, bool differs, const std::string& given, const std::string& stored) {
        if (!a.given.count(flag) || !differs) return true;
        if (!matters) return false;
        if (allowed.count(flag)) {
            printf("note: --%s %s replaces the %s %s stored in %s (--allow_change)\n", flag, given.c_str(), flag,
                   stored.c_str(), path.c_str());
            return false;
        }
        die("--" + std::string(flag) + " " + given + " differs from the " + flag + " " + stored + " stored in " + path +
            ": a resumed run continues the stored trajectory (drop --" + flag + ", or add --allow_change " + flag +
            " to change it knowingly)");
        return false;
    };
    auto str = [](float v) { char b[32]; snprintf(b, sizeof b, "%g", v); return std::string(b); };
    const std::string schedule = SCHEDULE_NAMES[o.schedule];
    if (keep("lr_schedule", true, a.lr_schedule != schedule, a.lr_schedule, schedule)) a.lr_schedule = schedule;
    const bool decays = a.lr_schedule != "constant";
    const bool muon = a.optimizer == "muon", kfac = a.optimizer == "kfac";
    const bool is_shampoo = a.optimizer == "shampoo" || kfac;  // the preconditioner's settings
    const bool sgd = a.optimizer == "sgd" || (is_shampoo && a.graft == "sgd");
    const bool fisher = a.precond == "fisher_diag";
    if (keep("lr", true, a.lr != o.lr, str(a.lr), str(o.lr))) a.lr = o.lr;
    if (keep("lr_min", decays, a.lr_min != o.lr_min, str(a.lr_min), str(o.lr_min))) a.lr_min = o.lr_min;
    if (keep("epochs", decays, a.epochs != s.epochs, std::to_string(a.epochs), std::to_string(s.epochs)))
        a.epochs = s.epochs;
    if (keep("warmup_steps", true, a.warmup_steps != o.warmup_steps, std::to_string(a.warmup_steps),
             std::to_string(o.warmup_steps)))
        a.warmup_steps = o.warmup_steps;
    if (keep("seed", true, a.seed != s.seed, std::to_string(a.seed), std::to_string(s.seed))) a.seed = s.seed;
    if (keep("batch_size", true, a.batch_size != s.batch_size, std::to_string(a.batch_size),
             std::to_string(s.batch_size)))
        a.batch_size = s.batch_size;
    if (keep("weight_decay", true, a.weight_decay != o.weight_decay, str(a.weight_decay), str(o.weight_decay)))
        a.weight_decay = o.weight_decay;
    if (keep("momentum", sgd, a.momentum != o.momentum, str(a.momentum), str(o.momentum))) a.momentum = o.momentum;
    if (keep("beta1", !sgd, a.beta1 != o.beta1, str(a.beta1), str(o.beta1))) a.beta1 = o.beta1;
    if (keep("beta2", !sgd || fisher, a.beta2 != o.beta2, str(a.beta2), str(o.beta2))) a.beta2 = o.beta2;
    if (keep("eps", !sgd, a.eps != o.eps, str(a.eps), str(o.eps))) a.eps = o.eps;
    if (keep("muon_lr", muon, a.muon_lr != o.muon_lr, str(a.muon_lr), str(o.muon_lr))) a.muon_lr = o.muon_lr;
    if (keep("muon_momentum", muon, a.muon_momentum != o.muon_momentum, str(a.muon_momentum), str(o.muon_momentum)))
        a.muon_momentum = o.muon_momentum;
    if (keep("muon_nesterov", muon, a.muon_nesterov != o.nesterov, std::to_string(a.muon_nesterov),
             std::to_string(o.nesterov)))
        a.muon_nesterov = o.nesterov;
    if (keep("ns_steps", muon, a.ns_steps != o.ns_steps, std::to_string(a.ns_steps), std::to_string(o.ns_steps)))
        a.ns_steps = o.ns_steps;
    if (keep("precond_every", is_shampoo, a.precond_every != o.precond_every, std::to_string(a.precond_every),
             std::to_string(o.precond_every)))
        a.precond_every = o.precond_every;
    if (keep("precond_start", is_shampoo, a.precond_start != o.precond_start, std::to_string(a.precond_start),
             std::to_string(o.precond_start)))
        a.precond_start = o.precond_start;
    if (keep("precond_eps", is_shampoo || fisher, a.precond_eps != o.precond_eps, str(a.precond_eps),
             str(o.precond_eps)))
        a.precond_eps = o.precond_eps;
    if (keep("precond_damping", is_shampoo || fisher, a.precond_damping != o.precond_damping, str(a.precond_damping),
             str(o.precond_damping)))
        a.precond_damping = o.precond_damping;
    if (keep("kfac_stat_decay", kfac, a.kfac_stat_decay != o.kfac_stat_decay, str(a.kfac_stat_decay),
             str(o.kfac_stat_decay)))
        a.kfac_stat_decay = o.kfac_stat_decay;
    if (keep("precond_delay", is_shampoo, a.precond_delay != o.precond_delay, std::to_string(a.precond_delay),
             std::to_string(o.precond_delay)))
        a.precond_delay = o.precond_delay;
    if (keep("clip_per_sample", true, a.clip_per_sample != o.clip, str(a.clip_per_sample), str(o.clip)))
        a.clip_per_sample = o.clip;
    if (keep("noise_multiplier", true, a.noise_multiplier != o.noise, str(a.noise_multiplier), str(o.noise)))
        a.noise_multiplier = o.noise;
    if (o.precond == PRECOND_FISHER_DIAG &&
        keep("fisher_power", fisher, a.fisher_power != o.fisher_power, str(a.fisher_power), str(o.fisher_power)))
        a.fisher_power = o.fisher_power;
    if (a.lr_min > a.lr) die("--lr_min " + str(a.lr_min) + " is above --lr " + str(a.lr) + " (with " + path + "'s)");
    if (s.epoch >= a.epochs)
        die(path + ": header[3] epoch is " + std::to_string(s.epoch) + ", --epochs is " + std::to_string(a.epochs) +
            ": nothing left to train (a larger --epochs" + (decays ? " with --allow_change epochs: the schedule's end "
            "moves)" : ")"));
}

// The run configuration's rows of the start-up table (RunConfig): which kernels a training step of batch B takes
static std::vector<std::pair<std::string, std::string>> run_config_rows(int B) {
    std::vector<std::pair<std::string, std::string>> rows;
    const bool cpu = g_run.backend == BACKEND_CPU, cublas = g_run.backend == BACKEND_CUBLAS;
    rows.push_back({"matrix products", cpu      ? "CPU, " + std::to_string(g_run.cpu_threads) + " threads"
                                       : cublas ? "cuBLAS (explicit im2col)"
                                                : "our kernels"});
    rows.push_back({"precision", cpu ? "fp32" : g_run.tf32 ? "TF32 tensor cores" : "strict fp32"});
    if (cpu || cublas || !g_run.tf32) {
        rows.push_back({"fast path", cpu ? "off (CPU)" : cublas ? "off (--matmul cublas)" : "off (--tf32 0)"});
        return rows;
    }
    rows.push_back({"fast path", std::string("on: conv2 on ") + (g_run.wgmma ? "wgmma (sm_90a)" : "mma.sync")});
    const std::string fused = !g_run.fc1_cluster          ? "off (needs sm_90+)"
                              : !g_run.fused_forward_fits ? "off (its grid does not fit at once)"
                              : B > FUSED_MAX_B           ? "off (batch over " + std::to_string(FUSED_MAX_B) + ")"
                                                          : "on (conv2's kernel runs fc1 and the head)";
    rows.push_back({"fused forward", g_run.fused_forward ? fused : "off"});
    rows.push_back({"fc1 forward", g_run.fc1_cluster ? "split-K in clusters of " + std::to_string(FC1F_CLUSTER)
                                                     : "the generic kernel"});
    rows.push_back({"conv2 wgrad partials", g_run.wgrad_cluster > 1
                                                ? "added in clusters of " + std::to_string(g_run.wgrad_cluster)
                                                : "one per block"});
    rows.push_back({"conv2 weight image", g_run.bulk_copy ? "one bulk copy (TMA)" : "cp.async"});
    rows.push_back({"launches", g_run.pdl ? "programmatic dependent launch" : "ordinary"});
    return rows;
}

// Every path before any work: a bad one costs no training (issue 26)
static void check_paths(const Args& a) {
    struct stat st;
    if (stat(a.data_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
        die(a.data_dir + ": --data_dir is " + (S_ISREG(st.st_mode) ? "a regular file" : file_kind(st.st_mode)) +
            ", not a directory (the folder of the four MNIST IDX .gz files)");
    if (!a.checkpoint.empty()) {
        std::string real, e = output_check(a.checkpoint, "--checkpoint", &real);
        if (!e.empty()) die(e);
        if (real != a.checkpoint)
            printf("note: --checkpoint %s is a symlink: writing through to %s\n", a.checkpoint.c_str(), real.c_str());
    }
}
// The checkpoint of --load or --resume into ck, read and validated before any work; --resume takes its settings
static CheckpointMeta read_start_checkpoint(Args& a, BinFile* ck, const std::set<std::string>& allowed) {
    const std::string& ckpath = a.resume.empty() ? a.load : a.resume;
    CheckpointMeta stored;
    if (!ckpath.empty()) {
        std::string e = checkpoint_read(ck, ckpath.c_str(),
                                        a.resume.empty() ? "--load checkpoint" : "--resume checkpoint");
        if (!e.empty()) die(e);
        stored = checkpoint_meta(ck);
    }
    if (!a.resume.empty()) {
        if (!stored.has_optimizer)
            die(a.resume + ": header[8] has_optimizer is 0, expected 1 (--resume needs the optimizer state; --load "
                "takes the weights alone)");
        resume_settings(a, stored, a.resume, allowed);
    }
    return stored;
}
// --device: true for the CPU path. A machine without a driver or GPU answers cudaGetDeviceCount with an error; that
// means zero devices.
static bool device_is_cpu(const Args& a) {
    int ndev = 0;
    cudaError_t derr = cudaGetDeviceCount(&ndev);
    if (derr != cudaSuccess) { (void)cudaGetLastError(); ndev = 0; }
    if (a.device == "cuda" && ndev == 0) {
        fprintf(stderr, "error: --device cuda but no CUDA device is available (%s)\n", cudaGetErrorString(derr));
        exit(1);
    }
    if (a.device == "auto" && ndev == 0) {
        printf("no CUDA device found (%s): training on the CPU (--device cpu)\n", cudaGetErrorString(derr));
        return true;
    }
    return a.device == "cpu";
}
// The training split (none for --eval_only) and the test split. A resumed run trains on the stored number of images
// unless --train_limit is given, and then on another number only with --allow_change train_limit.
static void load_splits(Args& a, const CheckpointMeta& stored, const std::set<std::string>& allowed,
                        MnistSplit* train, MnistSplit* test) {
    const bool resume = !a.resume.empty(), limit_given = a.given.count("train_limit") > 0;
    if (!a.eval_only)
        *train = mnist_load_split(a.data_dir, "train", resume && !limit_given ? stored.train_images : a.train_limit);
    *test = mnist_load_split(a.data_dir, "t10k", a.test_limit);
    if (resume && train->n != stored.train_images) {
        std::string n = std::to_string(train->n), sn = std::to_string(stored.train_images);
        if (!limit_given)
            die(a.resume + " was trained on " + sn + " images (train_images), --data_dir " + a.data_dir + " holds " +
                n);
        if (!allowed.count("train_limit"))
            die("--train_limit " + std::to_string(a.train_limit) + " gives " + n + " training images, not the " +
                "train_images " + sn + " stored in " + a.resume + ": a resumed run continues the stored trajectory "
                "(drop --train_limit, or add --allow_change train_limit to change it knowingly)");
        printf("note: --train_limit %d gives %s training images instead of the train_images %s stored in %s "
               "(--allow_change)\n", a.train_limit, n.c_str(), sn.c_str(), a.resume.c_str());
    }
    if (resume && !limit_given) a.train_limit = train->n;  // for the table: the images this run uses
}
static OptConfig opt_config_from_args(const Args& a, int steps_per_epoch) {
    OptConfig o;
    o.optimizer = a.optimizer == "sgd" ? OPT_SGD : a.optimizer == "adamw" ? OPT_ADAMW
                  : a.optimizer == "muon" ? OPT_MUON : a.optimizer == "shampoo" ? OPT_SHAMPOO : OPT_KFAC;
    o.schedule = a.lr_schedule == "constant" ? SCHED_CONSTANT
                 : a.lr_schedule == "cosine" ? SCHED_COSINE
                                             : SCHED_LINEAR;
    o.warmup_steps = a.warmup_steps; o.total_steps = std::max(1, a.epochs * steps_per_epoch);
    o.lr = a.lr;
    o.lr_min = a.lr_min;
    o.momentum = a.momentum;
    o.weight_decay = a.weight_decay;
    o.beta1 = a.beta1; o.beta2 = a.beta2; o.eps = a.eps;
    o.muon_lr = a.muon_lr; o.muon_momentum = a.muon_momentum; o.nesterov = a.muon_nesterov;
    o.ns_steps = a.ns_steps; o.graft = a.graft == "sgd" ? GRAFT_SGD : GRAFT_ADAM;
    o.precond_every = a.precond_every; o.precond_start = a.precond_start;
    o.max_precond_dim = a.max_precond_dim; o.precond_eps = a.precond_eps;
    o.precond_damping = a.precond_damping;
    o.kfac_stat_decay = a.kfac_stat_decay;
    o.precond_delay = a.precond_delay;
    o.clip = a.clip_per_sample; o.noise = a.noise_multiplier; o.fisher_power = a.fisher_power;
    o.precond = a.precond == "fisher_diag" ? PRECOND_FISHER_DIAG : PRECOND_NONE;
    return o;
}
// --load's weights, or --resume's weights and optimizer state; returns the first epoch to train and sets *step, the
// schedule's step at its start
static int restore_from_checkpoint(Mnist* model, BinFile* ck, const Args& a, const CheckpointMeta& stored,
                                   int steps_per_epoch, int train_n, int* step) {
    *step = 0;
    if (!a.load.empty()) mnist_load_checkpoint_state(model, ck, false);
    if (a.resume.empty()) return 0;
    mnist_load_checkpoint_state(model, ck, !a.fresh_optimizer);
    const int start_epoch = stored.epoch;
    *step = start_epoch * steps_per_epoch;  // the stored step, unless the batch size or the images changed
    if (*step != stored.step)
        printf("note: %d steps per epoch instead of %d: the schedule goes on from step %d (epoch %d), not %d\n",
               steps_per_epoch, (stored.train_images + stored.batch_size - 1) / stored.batch_size, *step, start_epoch,
               stored.step);
    if (model->mo && model->mo->pend.switch_step >= 0) {  // the pending roots' switch: as stored, within precond_delay
        PrecondPending& pd = model->mo->pend;
        pd.switch_step = *step + std::min(pd.switch_step - stored.step, std::max(model->opt.precond_delay - 1, 0));
    }
    printf("resuming %s at epoch %d of %d (step %d): %s, lr %g, %s schedule, seed %d, batch_size %d, %d training "
           "images\n", a.resume.c_str(), start_epoch, a.epochs, *step, a.optimizer.c_str(), a.lr,
           a.lr_schedule.c_str(), a.seed, a.batch_size, train_n);
    return start_epoch;
}
// The boxed table of the run's parameters: the device, the run configuration, every flag, the data and the model
static void print_run_table(Args& a, bool cpu, const MnistSplit& train, const MnistSplit& test, const Mnist& model,
                            int steps_per_epoch) {
    char devname[256] = "CPU";
    if (!cpu) {
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        snprintf(devname, sizeof devname, "%s", prop.name);
    }
    printf("+-----------------------+----------------------------------------------+\n");
    printf("| %-21s | %-44s |\n", "device", devname);
    for (auto& row : run_config_rows(a.batch_size))
        printf("| %-21s | %-44s |\n", row.first.c_str(), row.second.c_str());
    for (auto& f : flag_specs(a)) printf("| %-21s | %-44s |\n", f.name, flag_value_str(f).c_str());
    printf("| %-21s | %-44d |\n", "train / test images", train.n); printf("| %-21s | %-44d |\n", "", test.n);
    printf("| %-21s | %-44zu |\n", "parameters", model.n_params);
    printf("| %-21s | %-44d |\n", "steps per epoch", steps_per_epoch);
    if (!cpu) printf("| %-21s | %-44s |\n", "GPU memory free/total", gpu_memory_line().c_str());
    printf("+-----------------------+----------------------------------------------+\n");
}
static void print_confusion(const std::vector<int>& confusion) {
    printf("confusion matrix (rows: true digit, columns: predicted)\n     ");
    for (int j = 0; j < NCLS; j++) printf("%6d", j);
    printf("\n");
    for (int i = 0; i < NCLS; i++) {
        printf("  %d |", i);
        for (int j = 0; j < NCLS; j++) printf("%6d", confusion[i * NCLS + j]);
        printf("\n");
    }
}

// An epoch of training as main runs it: n_full steps of batch B and a tail step of the rest. On the GPU with
// --cuda_graph 1 its steps run as graphs of at most GRAPH_STEPS steps, one graph per length, captured at first use;
// an evaluation inside the epoch (--eval_every) ends a graph there: the same values, one more launch.
struct EpochRun {
    Mnist* model = nullptr;
    const DeviceData* train = nullptr;
    float* losses = nullptr;  // per-sample training losses (device, or host on the CPU)
    int* perm_dev = nullptr;  // the epoch's order, on the device
    int n = 0, B = 0, n_full = 0, tail = 0, steps = 0;
    bool graphs = false;
    std::map<std::pair<int, int>, cudaGraphExec_t> graph;  // (full steps, tail batch) -> its captured steps
    cudaEvent_t ev0 = nullptr, ev1 = nullptr;
};
static EpochRun epoch_run_setup(Mnist* model, const DeviceData* train, float* losses, int* perm_dev, int B,
                                const Args& a) {
    EpochRun r;
    r.model = model; r.train = train; r.losses = losses; r.perm_dev = perm_dev; r.n = train->n; r.B = B;
    r.n_full = r.n / B; r.tail = r.n % B; r.steps = r.n_full + (r.tail ? 1 : 0);
    if (model->cpu) return r;
    const bool host_schedule = model->opt.optimizer == OPT_SHAMPOO || model->opt.optimizer == OPT_KFAC;
    if (a.cuda_graph && host_schedule)
        printf("note: --optimizer %s runs its steps without CUDA graphs (its root schedule is a host decision)\n",
               a.optimizer.c_str());
    if (model->opt.optimizer == OPT_KFAC && g_run.backend == BACKEND_OURS && g_run.tf32)
        printf("note: --optimizer kfac runs every layer on the generic kernels (its statistics need the output "
               "gradients the fast path does not store)\n");
    r.graphs = a.cuda_graph && !host_schedule;
    cudaCheck(cudaEventCreate(&r.ev0)); cudaCheck(cudaEventCreate(&r.ev1));
    return r;
}
// Steps s0 .. s1 - 1 of an epoch in the order perm that starts at the schedule's step `step` (s0 = 0: the order
// and the counters are loaded first); returns their training time in ms (CUDA events on the GPU). They run in chunks
// of at most GRAPH_STEPS full steps, the tail step with a last chunk of fewer: an epoch in one call has the chunks
// (and graphs) it always had.
static double train_steps(EpochRun& r, const std::vector<int>& perm, int step, int s0, int s1) {
    Mnist* m = r.model;
    if (m->cpu) {
        auto t0 = std::chrono::steady_clock::now();
        if (s0 == 0) mnist_set_counters(m, step, 0);
        for (int s = s0; s < s1; s++) mnist_train_step(m, *r.train, perm.data(), r.losses, s < r.n_full ? r.B : r.tail);
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    std::vector<std::pair<int, int>> chunks;  // (full steps, tail batch or 0)
    for (int s = s0; s < s1;) {
        const int full = std::max(0, std::min({GRAPH_STEPS, s1 - s, r.n_full - s}));
        const int tail = full < GRAPH_STEPS && s + full == r.n_full && s1 == r.steps ? r.tail : 0;
        chunks.push_back({full, tail});
        s += full + (tail ? 1 : 0);
    }
    if (r.graphs)  // before the first event: a capture is no training time
        for (auto& c : chunks)
            if (!r.graph.count(c)) {
                r.graph[c] = capture_train_steps(m, *r.train, r.perm_dev, r.losses, r.B, c.first, c.second);
                cudaCheck(cudaStreamSynchronize(g_mm.stream));
            }
    cudaCheck(cudaEventRecord(r.ev0, g_mm.stream));
    if (s0 == 0) {
        cudaCheck(cudaMemcpyAsync(r.perm_dev, perm.data(), r.n * 4, cudaMemcpyHostToDevice, g_mm.stream));
        mnist_set_counters(m, step, 0);
    }
    for (auto& c : chunks) {
        if (r.graphs) cudaCheck(cudaGraphLaunch(r.graph[c], g_mm.stream));
        else mnist_train_steps(m, *r.train, r.perm_dev, r.losses, r.B, c.first, c.second);
    }
    cudaCheck(cudaEventRecord(r.ev1, g_mm.stream));
    cudaCheck(cudaEventSynchronize(r.ev1));
    float ms;
    cudaCheck(cudaEventElapsedTime(&ms, r.ev0, r.ev1));
    return ms;
}
// The epoch's mean per-sample training loss (after its last step)
static double epoch_train_loss(const EpochRun& r, std::vector<float>& host_losses) {
    if (r.model->cpu) memcpy(host_losses.data(), r.losses, r.n * 4);
    else cudaCheck(cudaMemcpy(host_losses.data(), r.losses, r.n * 4, cudaMemcpyDeviceToHost));
    double loss = 0;
    for (float l : host_losses) loss += l;
    return loss / r.n;
}
// What became of the checkpoint when a run stops on its loss
static std::string checkpoint_state(const Args& a) {
    struct stat cs;
    if (a.checkpoint.empty()) return "no checkpoint was requested (--checkpoint)";
    if (stat(a.checkpoint.c_str(), &cs) == 0)
        return "the last good checkpoint " + a.checkpoint + " is kept (not overwritten)";
    return "no good checkpoint was written yet";
}
// An evaluation's place in the run: after the schedule's step `step`, in epoch `epoch` (0-based), after train_ms of
// training
struct EvalPoint { int step = -1, epoch = 0; double accuracy = 0, train_ms = 0; };
// The run's evaluations on the test set (each epoch's end, every --eval_every steps), the best and the latest
struct Evaluations {
    const Args* a;
    Mnist* model;
    const DeviceData* test;
    const std::vector<uint8_t>* labels;
    float* losses;  // evaluation's own: an evaluation inside an epoch keeps the epoch's training losses
    int* preds;
    int batch;
    EvalResult last;
    EvalPoint best, here;
    // after the schedule's step `step` in epoch `epoch`: its line (with --eval_every), and whether
    // --stop_at_accuracy stops the run here
    bool at(int step, int epoch, double train_ms) {
        if (!model->cpu) gpu_memory_line();  // a sample for the peak
        last = evaluate(model, *test, *labels, losses, preds, batch);
        if (a->eval_every > 0)
            printf("step %6d | epoch %3d/%d | test loss %.4f | test acc %.2f%% | train total %.1f ms\n", step,
                   epoch + 1, a->epochs, last.loss, last.accuracy, train_ms);
        if (!std::isfinite(last.loss)) {  // the weights are no longer finite: the rest of the epoch would be wasted
            fprintf(stderr, "error: test loss is %f at step %d (epoch %d); stopping. %s\n", last.loss, step,
                    epoch + 1, checkpoint_state(*a).c_str());
            exit(2);
        }
        here = EvalPoint{step, epoch, last.accuracy, train_ms};
        if (best.step < 0 || here.accuracy > best.accuracy) best = here;
        return a->stop_at_accuracy > 0 && here.accuracy >= a->stop_at_accuracy;
    }
    void say_reached() const {
        printf("reached %.2f%% (--stop_at_accuracy %g) at step %d (epoch %d) after %.1f ms of training\n",
               here.accuracy, a->stop_at_accuracy, here.step, here.epoch + 1, here.train_ms);
    }
    void say_not_reached(double total_train_ms) const {
        if (a->stop_at_accuracy > 0)
            printf("did not reach --stop_at_accuracy %g: best %.2f%% at step %d (epoch %d) after %.1f ms of training; "
                   "%.1f ms in all\n", a->stop_at_accuracy, best.accuracy, best.step, best.epoch + 1, best.train_ms,
                   total_train_ms);
    }
};
// Stops the run on an epoch's training loss that is not finite (exit 2) or diverges (exit 1). A finite loss diverges
// too (--lr 10 reaches 1e30 in an epoch): an epoch's mean loss above 4x a uniform guess's, or above a uniform guess's
// again and twice this run's best epoch, means the weights blow up.
static void check_train_loss(double train_loss, double best_loss, int epoch, const Args& a) {
    const double chance_loss = std::log((double)NCLS);  // a uniform guess's loss, ln 10 = 2.30
    if (!std::isfinite(train_loss)) {
        fprintf(stderr, "error: training loss is %f in epoch %d; stopping. %s\n", train_loss, epoch + 1,
                checkpoint_state(a).c_str());
        exit(2);
    }
    if (train_loss > 4 * chance_loss || (train_loss > chance_loss && train_loss > 2 * best_loss)) {
        char best[64] = "";
        if (std::isfinite(best_loss)) snprintf(best, sizeof best, ", this run's best epoch %.4g", best_loss);
        fprintf(stderr, "error: the training loss diverges: %.4g in epoch %d (a uniform guess scores %.2f%s); "
                "stopping at --lr %g (try a smaller --lr). %s\n", train_loss, epoch + 1, chance_loss, best, a.lr,
                checkpoint_state(a).c_str());
        exit(1);
    }
}

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);  // load every kernel up front, never during graph capture or timing
    Args a;
    parse_args(argc, argv, a);
    check_paths(a);
    const std::set<std::string> allowed = parse_allow_change(a.allow_change);
    BinFile ck;
    const CheckpointMeta stored = read_start_checkpoint(a, &ck, allowed);
    const std::string combo = per_sample_flags_error(opt_config_from_args(a, 1));
    if (!combo.empty()) die(combo);
    const std::string delay = precond_delay_error(opt_config_from_args(a, 1));
    if (!delay.empty()) die(delay);
    const bool cpu = device_is_cpu(a);
    run_config_decide(cpu ? BACKEND_CPU : (a.matmul == "cublas" ? BACKEND_CUBLAS : BACKEND_OURS), a.tf32,
                      a.cpu_threads > 0 ? a.cpu_threads : std::max(1u, std::thread::hardware_concurrency()));
    if (!cpu) cudaCheck(cudaStreamCreate(&g_mm.stream));

    MnistSplit train, test;
    load_splits(a, stored, allowed, &train, &test);
    const int B = a.batch_size;
    if (!a.eval_only && B > train.n) {
        fprintf(stderr, "error: flag --batch_size expects at most the %d training images, found %d\n", train.n, B);
        exit(1);
    }
    const int eval_batch = cpu ? std::min(a.eval_batch_size, 100) : a.eval_batch_size;
    const int steps_per_epoch = a.eval_only ? 0 : ceil_div(train.n, B);
    Mnist model;
    model.opt = opt_config_from_args(a, steps_per_epoch);
    mnist_build(&model, cpu, B, eval_batch);
    mnist_init_params(&model, (uint64_t)a.seed);
    if (model.ps) model.ps->seed = (uint64_t)a.seed * 0x2545F4914F6CDD1Dull + 0xD9;  // the DP noise's stream
    int step = 0;
    const int start_epoch = restore_from_checkpoint(&model, &ck, a, stored, steps_per_epoch, train.n, &step);
    print_run_table(a, cpu, train, test, model, steps_per_epoch);

    DeviceData dtest = upload_split(test, cpu);
    DeviceData dtrain = a.eval_only ? DeviceData() : upload_split(train, cpu);
    // training's per-sample losses apart from evaluation's: an evaluation inside an epoch keeps the epoch's losses
    const size_t ntrain = std::max(train.n, 1) * sizeof(float), ntest = std::max(test.n, 1) * sizeof(float);
    float* losses = model.cpu ? (float*)mallocCheck(ntrain) : nullptr;
    float* eval_losses = model.cpu ? (float*)mallocCheck(ntest) : nullptr;
    int* preds = model.cpu ? (int*)mallocCheck(ntest) : nullptr;
    int* perm_dev = nullptr;
    if (!cpu) {
        cudaCheck(cudaMalloc(&losses, ntrain)); cudaCheck(cudaMalloc(&eval_losses, ntest));
        cudaCheck(cudaMalloc(&preds, ntest)); cudaCheck(cudaMalloc(&perm_dev, ntrain));
    }
    if (a.eval_only) {
        EvalResult r = evaluate(&model, dtest, test.labels, eval_losses, preds, eval_batch);
        printf("eval | test loss %.4f | test acc %.2f%%\n", r.loss, r.accuracy);
        if (a.confusion) print_confusion(r.confusion);
        printf("final | test_acc %.4f | test_loss %.6f\n", r.accuracy, r.loss);
        return 0;
    }

    EpochRun run = epoch_run_setup(&model, &dtrain, losses, perm_dev, B, a);
    std::vector<int> perm;
    std::vector<float> host_losses(train.n);
    double total_train_ms = 0;
    CheckpointMeta meta;
    meta.batch_size = B; meta.seed = a.seed; meta.has_optimizer = 1; meta.epochs = a.epochs; meta.opt = model.opt;
    meta.train_images = train.n;
    double best_loss = INFINITY;  // the lowest epoch loss of this run
    Evaluations ev{&a, &model, &dtest, &test.labels, eval_losses, preds, eval_batch};
    bool stopped = false;
    for (int epoch = start_epoch; epoch < a.epochs && !stopped; epoch++) {
        epoch_permutation(perm, train.n, a.seed, epoch);
        double ms = 0;
        for (int s = 0; s < run.steps && !stopped;) {
            int next = run.steps;  // the epoch's end, or the next step (of the schedule) that --eval_every names
            if (a.eval_every > 0)
                next = (int)std::min<long long>(next, ((long long)(step + s) / a.eval_every + 1) * a.eval_every - step);
            const double seg = train_steps(run, perm, step, s, next);
            ms += seg; total_train_ms += seg;
            s = next;
            if (s < run.steps && ev.at(step + s, epoch, total_train_ms)) {
                stopped = true;
                ev.say_reached();
                if (!a.checkpoint.empty())
                    printf("note: stopped inside epoch %d: %s holds the last epoch end written (checkpoints are "
                           "written at epoch ends)\n", epoch + 1, a.checkpoint.c_str());
            }
        }
        if (stopped) break;
        step += run.steps;
        const double train_loss = epoch_train_loss(run, host_losses);
        check_train_loss(train_loss, best_loss, epoch, a);
        best_loss = std::min(best_loss, train_loss);
        stopped = ev.at(step, epoch, total_train_ms);
        const EvalResult& last = ev.last;
        printf("epoch %3d/%d | train loss %.4f | test loss %.4f | test acc %.2f%% | train %.1f ms (total %.1f ms) | "
               "%.3f ms/step\n", epoch + 1, a.epochs, train_loss, last.loss, last.accuracy, ms, total_train_ms,
               ms / run.steps);
        if (!a.checkpoint.empty()) {
            meta.epoch = epoch + 1; meta.step = step; meta.test_accuracy = (float)last.accuracy;
            std::string e = mnist_save_checkpoint(&model, a.checkpoint.c_str(), meta);
            if (!e.empty()) die(e);
        }
        if (stopped) ev.say_reached();
    }
    if (!stopped) ev.say_not_reached(total_train_ms);
    const EvalResult& last = ev.last;
    if (a.confusion && !last.confusion.empty()) print_confusion(last.confusion);
    printf("final | test_acc %.4f | test_loss %.6f | train_ms %.1f\n", last.accuracy, last.loss, total_train_ms);
    if (!cpu) {
        gpu_memory_line();
        printf("GPU memory: peak %.0f MiB in use (total - free, sampled at start-up, at each evaluation and here)\n",
               g_gpu_peak_used / 1048576.0);
    }
    mnist_free(&model);
    return 0;
}
#endif
