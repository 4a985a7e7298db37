/*
train_unet.cu: an unconditional DDPM diffusion UNet (guided-diffusion's UNetModel, as defined by dev/unet.py)
trained in CUDA C++: data loader, forward and backward kernels, AdamW, EMA, checkpoints, sampling.

  make train_unet && ./train_unet                      # trains on data/sunflowers64.bin
  ./train_unet --help                                  # every flag with its default
  ./train_unet --sample s.bin --load out/unet/model.bin --num_samples 16 --sampler ddim --sample_steps 50

Layout: activations NHWC (B, H, W, C), allocated once in unet_allocate (the activations' gradients share one arena
by liveness). --precision bf16 (the default; compute capability >= 8.0): bf16 activations and compute copies of the
weights, fp32 master weights, AdamW state, EMA and accumulation; 3x3 convolutions on warpgroup MMA (wgmma) fed by
TMA (conv_wgmma_kernel, dev/conv2d.cu version 7; without sm_90a on mma.sync: conv_mma_bf16_kernel, version 8),
fused attention (attn_*_kernel, dev/attention.cu version 2), cuBLAS
bf16 for the linear layers. --precision tf32: fp32 activations, convolutions on TF32 mma.sync (conv_mma_kernel,
version 6; strict fp32 for the 3-channel passes), cuBLAS in TF32. --precision fp32: strict fp32 everywhere
(conv_igemm_kernel, version 2), the mode dev/test_unet.cu compares with PyTorch tensor for tensor. Reductions
(GroupNorm statistics, bias gradients, split-K partial sums, the loss) run in a fixed order, so a run is
reproducible bit for bit and --resume continues the identical trajectory; from the second step on, a training step
is one CUDA graph.
Sections: utilities and file reader | kernels | model (build, forward, backward, update) | training and sampling
| CLI (main, inside #ifndef TESTING so that dev/test_unet.cu includes this file).
*/
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cublas_v2.h>
#include <cublasLt.h>
#include <cuda.h>  // CUtensorMap (TMA views); the driver entry point is reached through the runtime, no -lcuda
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <curand.h>
#ifdef UNET_NCCL  // the Makefile's define where it finds NCCL: data parallelism over several GPUs
#include <nccl.h>
#endif

// ----------------------------------------------------------------------------------------------------------------
// error checking: the same family and message shape in the three trainers. A library failure prints
// "[<LIBRARY> ERROR] <what>", then "  in <call> at <file>:<line>", then a "  hint:" line where the usual cause is
// known.

static void cuda_check(cudaError_t e, const char* call, const char* file, int line) {
    if (e != cudaSuccess) {
#ifdef CUDA_CHECK_THROWS  // inside PyTorch (dev/torch_ops): an exception the caller turns into a Python error
        throw std::runtime_error(std::string("[CUDA ERROR] ") + cudaGetErrorString(e) + " in " + call + " at " +
                                 file + ":" + std::to_string(line));
#endif
        fprintf(stderr, "[CUDA ERROR] %s\n  in %s at %s:%d\n", cudaGetErrorString(e), call, file, line);
        if (e == cudaErrorMemoryAllocation) fprintf(stderr, "  hint: lower --batch_size\n");
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)

static void cublas_check(cublasStatus_t s, const char* call, const char* file, int line) {
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "[cuBLAS ERROR] status %d (%s)\n  in %s at %s:%d\n", (int)s, cublasGetStatusString(s), call,
                file, line);
        exit(EXIT_FAILURE);
    }
}
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)

static const char* curand_status_name(curandStatus_t s) {
    switch (s) {
        case CURAND_STATUS_VERSION_MISMATCH: return "version mismatch";
        case CURAND_STATUS_NOT_INITIALIZED: return "not initialized";
        case CURAND_STATUS_ALLOCATION_FAILED: return "allocation failed";
        case CURAND_STATUS_TYPE_ERROR: return "type error";
        case CURAND_STATUS_OUT_OF_RANGE: return "out of range";
        case CURAND_STATUS_LENGTH_NOT_MULTIPLE: return "length not a multiple of the dimension";
        case CURAND_STATUS_DOUBLE_PRECISION_REQUIRED: return "double precision required";
        case CURAND_STATUS_LAUNCH_FAILURE: return "kernel launch failure";
        case CURAND_STATUS_PREEXISTING_FAILURE: return "pre-existing failure";
        case CURAND_STATUS_INITIALIZATION_FAILED: return "initialization failed";
        case CURAND_STATUS_ARCH_MISMATCH: return "architecture mismatch";
        case CURAND_STATUS_INTERNAL_ERROR: return "internal error";
        default: return "unknown status";
    }
}
static void curand_check(curandStatus_t s, const char* call, const char* file, int line) {
    if (s != CURAND_STATUS_SUCCESS) {
        fprintf(stderr, "[cuRAND ERROR] status %d (%s)\n  in %s at %s:%d\n", (int)s, curand_status_name(s), call,
                file, line);
        exit(EXIT_FAILURE);
    }
}
#define curandCheck(call) curand_check((call), #call, __FILE__, __LINE__)

#ifdef UNET_NCCL
static void nccl_check(ncclResult_t r, const char* call, const char* file, int line) {
    if (r != ncclSuccess && r != ncclInProgress) {  // ncclInProgress: a non-blocking call under way (the watchdog)
        fprintf(stderr, "[NCCL ERROR] %s (%s)\n  in %s at %s:%d\n", ncclGetErrorString(r), ncclGetLastError(nullptr),
                call, file, line);
        fprintf(stderr, "  hint: NCCL_DEBUG=WARN (or INFO) says more; every rank must run the same binary and flags\n");
        exit(EXIT_FAILURE);
    }
}
#define ncclCheck(call) nccl_check((call), #call, __FILE__, __LINE__)
#endif

[[maybe_unused]] static void* malloc_check(size_t n, const char* file, int line) {
    void* p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "error: malloc of %zu bytes failed at %s:%d\n", n, file, line);
        exit(EXIT_FAILURE);
    }
    return p;
}
#define mallocCheck(n) malloc_check((n), __FILE__, __LINE__)

// Number of CUDA devices; 0 (with the error cleared) on a machine without a GPU or driver; the error's text goes to
// *why when given.
static int cuda_device_count(const char** why = nullptr) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (why) *why = e == cudaSuccess ? "no device" : cudaGetErrorString(e);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

// ----------------------------------------------------------------------------------------------------------------
// counter-based random numbers (splitmix64): every draw is a function of (seed, stream, index), so a resumed run
// draws exactly what the uninterrupted run would have.

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}
static inline uint64_t rng_hash(uint64_t seed, uint64_t stream, uint64_t index) {
    return splitmix64(splitmix64(splitmix64(seed) ^ stream) ^ index);
}
// uniform in [0, 1) with 24 bits
static inline float rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    return (float)(rng_hash(seed, stream, index) >> 40) * (1.0f / 16777216.0f);
}
enum RngStream : uint64_t { RNG_INIT = 1, RNG_SHUFFLE = 2, RNG_FLIP = 3, RNG_TIMESTEP = 4 };

// ----------------------------------------------------------------------------------------------------------------
// the project's binary file layout (data/README.md): 1024-byte header of int32, a 128-byte entry per tensor,
// the data. BinFile reads a whole file and validates it before anything is trusted.

enum { DT_F32 = 0, DT_I32 = 1, DT_U8 = 2 };
[[maybe_unused]] static const int UNET_DATASET_MAGIC = 20260301, UNET_CHECKPOINT_MAGIC = 20260302,
                                   UNET_DEBUG_MAGIC = 20260303;
static const int UNET_FORMAT_VERSION = 1;
static const int HDR_INTS = 256, ENTRY_BYTES = 128, NAME_BYTES = 96;

struct BinEntry {
    std::string name;
    int dtype, ndim;
    int shape[4];
    size_t offset, nbytes;
};
struct BinFile {
    std::string path;
    std::vector<char> data;
    int32_t hdr[HDR_INTS];
    std::vector<BinEntry> entries;
};

static size_t dtype_size(int dt) { return dt == DT_U8 ? 1 : 4; }
static const char* dtype_name(int dt) { return dt == DT_F32 ? "float32" : dt == DT_I32 ? "int32" : "uint8"; }

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

// printf into a string of any length (a message naming a path keeps its reason however long the path)
static std::string strfmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static std::string strfmt(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(nullptr, 0, fmt, ap);
    va_end(ap);
    std::string s(n > 0 ? n : 0, '\0');
    va_start(ap, fmt);
    if (n > 0) vsnprintf(&s[0], n + 1, fmt, ap);
    va_end(ap);
    return s;
}
// Returns "" on success, else a message naming the file and the wrong field. Only a regular file is read: a
// directory, device or FIFO is refused from its stat, before any read (no hang, no size taken from a directory).
static std::string bin_open(BinFile* f, const char* path, int magic, int version, const char* kind) {
    std::string msg;
    f->path = path;
    struct stat st;
    int fd = stat(path, &st) != 0 ? -2 : S_ISREG(st.st_mode) ? open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC) : -3;
    if (fd == -2 || fd == -1) {  // missing, or no permission
        msg = strfmt("%s: cannot open %s (%s)", path, kind, strerror(errno));
        return msg;
    }
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {  // also what was opened, if the path changed
        if (fd >= 0) close(fd);
        msg = strfmt("%s: is %s, not a regular file (expected a %s)", path, file_kind(st.st_mode), kind);
        return msg;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    FILE* fp = fdopen(fd, "rb");
    if (!fp) {
        close(fd);
        msg = strfmt("%s: cannot open %s (%s)", path, kind, strerror(errno));
        return msg;
    }
    long long size = (long long)st.st_size;
    if (size < HDR_INTS * 4) {
        fclose(fp);
        msg = strfmt("%s: file is %lld bytes, shorter than the 1024-byte header", path, size);
        return msg;
    }
    f->data.resize((size_t)size);
    size_t got = fread(f->data.data(), 1, (size_t)size, fp);
    fclose(fp);
    if (got != (size_t)size) {
        msg = strfmt("%s: read %zu of %lld bytes", path, got, size);
        return msg;
    }
    memcpy(f->hdr, f->data.data(), sizeof f->hdr);
    if (f->hdr[0] != magic) {
        msg = strfmt("%s: header[0] magic is %d, expected %d (%s)", path, f->hdr[0], magic, kind);
        return msg;
    }
    if (f->hdr[1] != version) {
        msg = strfmt("%s: header[1] version is %d, expected %d (%s)", path, f->hdr[1], version, kind);
        return msg;
    }
    long long count = f->hdr[2];
    if (count < 0 || HDR_INTS * 4 + ENTRY_BYTES * count > size) {
        msg = strfmt("%s: header[2] tensor count %lld does not fit a file of %lld bytes", path, count, size);
        return msg;
    }
    size_t offset = HDR_INTS * 4 + ENTRY_BYTES * (size_t)count;
    f->entries.clear();
    for (long long i = 0; i < count; i++) {
        const char* raw = f->data.data() + HDR_INTS * 4 + ENTRY_BYTES * i;
        BinEntry e;
        e.name = std::string(raw, strnlen(raw, NAME_BYTES));
        std::string shown;  // a corrupt table holds any bytes: shown escaped
        for (unsigned char c : e.name) {
            char hex[8];
            snprintf(hex, sizeof hex, "\\x%02x", c);
            shown += c >= 32 && c < 127 ? std::string(1, (char)c) : std::string(hex);
        }
        int32_t meta[8];
        memcpy(meta, raw + NAME_BYTES, sizeof meta);
        e.dtype = meta[0];
        e.ndim = meta[1];
        if (e.dtype < 0 || e.dtype > 2) {
            msg = strfmt("%s: tensor %lld (%s) has dtype code %d, expected 0, 1 or 2", path, i, shown.c_str(), e.dtype);
            return msg;
        }
        if (e.ndim < 0 || e.ndim > 4) {
            msg = strfmt("%s: tensor %lld (%s) has ndim %d, expected 0..4", path, i, shown.c_str(), e.ndim);
            return msg;
        }
        size_t n = 1;  // elements; bounded by the file length at every factor, so it never overflows
        for (int d = 0; d < 4; d++) {
            e.shape[d] = d < e.ndim ? meta[2 + d] : 0;
            if (d < e.ndim) {
                if (e.shape[d] < 0) {
                    msg = strfmt("%s: tensor %lld (%s) has a negative dimension", path, i, shown.c_str());
                    return msg;
                }
                n = e.shape[d] == 0 || n <= (size_t)size / (size_t)e.shape[d] ? n * (size_t)e.shape[d]
                                                                                : (size_t)size + 1;
            }
        }
        e.offset = offset;
        e.nbytes = n * dtype_size(e.dtype);
        if (n > (size_t)size || e.nbytes > (size_t)size - offset) {
            msg = strfmt("%s: file length is %lld bytes, the header and tensor table say more (tensor "
                         "%lld, %s, runs past the end)",
                         path, size, i, shown.c_str());
            return msg;
        }
        offset += e.nbytes;
        f->entries.push_back(e);
    }
    if (offset != (size_t)size) {
        msg = strfmt("%s: file length is %lld bytes, the header and tensor table say %zu", path, size, offset);
        return msg;
    }
    return "";
}

static const BinEntry* bin_find(const BinFile* f, const std::string& name) {
    for (const BinEntry& e : f->entries)
        if (e.name == name) return &e;
    return nullptr;
}

// Checks that tensor `name` exists with this dtype and shape; returns its data, or nullptr and a message.
static const void* bin_expect(const BinFile* f, const std::string& name, int dtype, int ndim, const int* shape,
                              std::string* err) {
    std::string msg;
    const BinEntry* e = bin_find(f, name);
    auto shape_str = [](int nd, const int* s) {
        std::string r = "(";
        for (int d = 0; d < nd; d++) r += std::to_string(s[d]) + (d + 1 < nd ? ", " : nd == 1 ? "," : "");
        return r + ")";
    };
    if (!e) {
        msg = strfmt("%s: tensor %s is missing", f->path.c_str(), name.c_str());
        *err = msg;
        return nullptr;
    }
    bool same = e->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = e->shape[d] == shape[d];
    if (!same) {
        msg = strfmt("%s: tensor %s has shape %s, expected %s", f->path.c_str(), name.c_str(),
                     shape_str(e->ndim, e->shape).c_str(), shape_str(ndim, shape).c_str());
        *err = msg;
        return nullptr;
    }
    if (e->dtype != dtype) {
        msg = strfmt("%s: tensor %s has dtype %s, expected %s", f->path.c_str(), name.c_str(), dtype_name(e->dtype),
                     dtype_name(dtype));
        *err = msg;
        return nullptr;
    }
    return f->data.data() + e->offset;
}

static float hdr_float(const int32_t* hdr, int slot) {
    float v;
    memcpy(&v, &hdr[slot], 4);
    return v;
}
static int32_t float_bits(float v) {
    int32_t r;
    memcpy(&r, &v, 4);
    return r;
}

// A file being written: tensors appended in order, then written by binw_write (a temporary file and a rename).
struct BinWriter {
    int32_t hdr[HDR_INTS];
    std::vector<BinEntry> entries;
    std::vector<const void*> ptrs;
};
static void binw_init(BinWriter* w, int magic) {
    memset(w->hdr, 0, sizeof w->hdr);
    w->hdr[0] = magic;
    w->hdr[1] = UNET_FORMAT_VERSION;
    w->entries.clear();
    w->ptrs.clear();
}
static void binw_add(BinWriter* w, const std::string& name, int dtype, int ndim, const int* shape, const void* p) {
    BinEntry e;
    e.name = name;
    e.dtype = dtype;
    e.ndim = ndim;
    size_t n = 1;
    for (int d = 0; d < 4; d++) {
        e.shape[d] = d < ndim ? shape[d] : 0;
        if (d < ndim) n *= (size_t)shape[d];
    }
    e.nbytes = n * dtype_size(dtype);
    e.offset = 0;
    w->entries.push_back(e);
    w->ptrs.push_back(p);
}
// Checks, before any work, that path can be written: "" and the path to write (a symlink's target: written through,
// the link kept) in *real, or a message naming the path: a missing folder, a folder that takes no new file, or a
// directory, device or FIFO (never replaced).
static std::string output_check(const std::string& path, const char* what, std::string* real) {
    struct stat st;
    *real = path;
    if (lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
        char buf[PATH_MAX];
        if (realpath(path.c_str(), buf) != NULL) {
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
        return path + ": " + what + ": folder " + folder + " does not exist";
    if (stat(real->c_str(), &st) == 0 && !S_ISREG(st.st_mode))
        return path + ": " + what + " is " + file_kind(st.st_mode) + ", not a regular file: refusing to replace it";
    std::string probe = *real + ".XXXXXX";  // the folder takes the real write's temporary file (and its long name)
    int fd = mkstemp(&probe[0]);
    if (fd < 0) return path + ": " + what + ": cannot write in folder " + folder + " (" + strerror(errno) + ")";
    close(fd);
    unlink(probe.c_str());
    return "";
}

// Writes through a temporary file in the path's folder, fsync, rename (and an fsync of the folder); the temporary
// file never stays behind and the old file is kept on failure. Returns "" or an error message.
static std::string binw_write(BinWriter* w, const std::string& path) {
    w->hdr[2] = (int32_t)w->entries.size();
    std::string real;
    std::string e = output_check(path, "output", &real);
    if (!e.empty()) return e;
    if (real != path) printf("note: %s is a symlink: writing through to %s\n", path.c_str(), real.c_str());
    std::string tmp = real + ".XXXXXX";
    int fd = mkstemp(&tmp[0]);
    FILE* fp = fd < 0 ? nullptr : fdopen(fd, "wb");
    if (!fp) {
        std::string why = strerror(errno);
        if (fd >= 0) {
            close(fd);
            unlink(tmp.c_str());
        }
        return path + ": cannot open for writing (" + why + ")";
    }
    mode_t mask = umask(0);
    umask(mask);
    fchmod(fd, 0666 & ~mask);
    bool ok = fwrite(w->hdr, 4, HDR_INTS, fp) == (size_t)HDR_INTS;
    for (const BinEntry& e : w->entries) {
        char raw[ENTRY_BYTES];
        memset(raw, 0, sizeof raw);
        strncpy(raw, e.name.c_str(), NAME_BYTES - 1);
        int32_t meta[8] = {e.dtype, e.ndim, e.shape[0], e.shape[1], e.shape[2], e.shape[3], 0, 0};
        memcpy(raw + NAME_BYTES, meta, sizeof meta);
        ok = ok && fwrite(raw, 1, ENTRY_BYTES, fp) == (size_t)ENTRY_BYTES;
    }
    for (size_t i = 0; i < w->entries.size(); i++)
        ok = ok && fwrite(w->ptrs[i], 1, w->entries[i].nbytes, fp) == w->entries[i].nbytes;
    ok = (fflush(fp) == 0) && ok;
    ok = (fsync(fd) == 0) && ok;
    std::string why = strerror(errno);
    ok = (fclose(fp) == 0) && ok;
    if (ok && rename(tmp.c_str(), real.c_str()) != 0) {
        ok = false;
        why = strerror(errno);
    }
    if (!ok) {
        unlink(tmp.c_str());
        return path + ": write failed (" + why + "); the previous file is kept";
    }
    int dfd = open(folder_of(real).c_str(), O_RDONLY);  // the rename itself reaches the disk
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return "";
}

// ----------------------------------------------------------------------------------------------------------------
// the model's shape (scripts/binio.py UNET_MODEL_FIELDS, header slots 3..17)

struct UNetConfig {
    int image_size = 64, in_channels = 3, model_channels = 64, out_channels = 3, num_res_blocks = 2;
    int n_levels = 4, mult[4] = {1, 2, 3, 4};
    int attn_ds_mask = 12;  // bit k: attention at downsample factor 2^k (ds 4 and 8 = 16x16 and 8x8 at 64)
    int num_head_channels = 32, diffusion_steps = 1000;
    float beta_start = 1e-4f, beta_end = 0.02f;
};
static const int HDR_MODEL_FIRST = 3, HDR_MODEL_END = 18;  // slots of UNET_MODEL_FIELDS

static void config_to_header(const UNetConfig& c, int32_t* h) {
    int i = HDR_MODEL_FIRST;
    h[i++] = c.image_size; h[i++] = c.in_channels; h[i++] = c.model_channels; h[i++] = c.out_channels;
    h[i++] = c.num_res_blocks; h[i++] = c.n_levels;
    for (int l = 0; l < 4; l++) h[i++] = l < c.n_levels ? c.mult[l] : 0;
    h[i++] = c.attn_ds_mask; h[i++] = c.num_head_channels; h[i++] = c.diffusion_steps;
    h[i++] = float_bits(c.beta_start); h[i++] = float_bits(c.beta_end);
}
static UNetConfig config_from_header(const int32_t* h) {
    UNetConfig c;
    int i = HDR_MODEL_FIRST;
    c.image_size = h[i++]; c.in_channels = h[i++]; c.model_channels = h[i++]; c.out_channels = h[i++];
    c.num_res_blocks = h[i++]; c.n_levels = h[i++];
    for (int l = 0; l < 4; l++) c.mult[l] = h[i++];
    c.attn_ds_mask = h[i++]; c.num_head_channels = h[i++]; c.diffusion_steps = h[i++];
    c.beta_start = hdr_float(h, i++); c.beta_end = hdr_float(h, i++);
    return c;
}
// "" when the configuration is one this trainer can build, else the reason.
static std::string config_check(const UNetConfig& c) {
    std::string msg;
    if (c.in_channels != 3 || c.out_channels != 3) return "in_channels and out_channels must be 3";
    if (c.n_levels < 1 || c.n_levels > 4) return "n_levels must be 1..4, found " + std::to_string(c.n_levels);
    // bounds (the flags' ranges) before any size is computed from them: a corrupt header never sizes an allocation
    if (c.num_res_blocks < 1 || c.num_res_blocks > 16)
        return "num_res_blocks must be 1..16, found " + std::to_string(c.num_res_blocks);
    if (c.model_channels < 1 || c.model_channels > 4096 || c.num_head_channels < 1 || c.num_head_channels > 65536)
        return "model_channels must be 1..4096 and num_head_channels 1..65536, found " +
               std::to_string(c.model_channels) + " and " + std::to_string(c.num_head_channels);
    if (c.image_size > 4096) return "image_size must be at most 4096, found " + std::to_string(c.image_size);
    for (int l = c.n_levels; l < 4; l++)
        if (c.mult[l] != 0)
            return "mult" + std::to_string(l) + " must be 0 (unused level), found " + std::to_string(c.mult[l]);
    for (int l = 0; l < c.n_levels; l++)
        if (c.mult[l] < 1 || (long long)c.model_channels * c.mult[l] > 65536)
            return "mult" + std::to_string(l) + " must be >= 1 with model_channels x mult at most 65536, found " +
                   std::to_string(c.mult[l]);
    if (c.attn_ds_mask < 0 || c.attn_ds_mask >= 1 << c.n_levels)
        return "attn_ds_mask must be 0.." + std::to_string((1 << c.n_levels) - 1) +
               " (bit k: attention at ds 2^k), found " + std::to_string(c.attn_ds_mask);
    if (c.image_size < 1 || c.image_size % (1 << (c.n_levels - 1))) {
        msg = strfmt("image_size %d is not a positive multiple of 2^(levels-1) = %d", c.image_size,
                     1 << (c.n_levels - 1));
        return msg;
    }
    for (int l = 0; l < c.n_levels; l++) {
        int ch = c.model_channels * c.mult[l];
        if (c.mult[l] < 1 || ch % 32) {
            msg = strfmt("channels %d (model_channels x mult%d) must be a positive multiple of 32 "
                         "(GroupNorm groups)",
                         ch, l);
            return msg;
        }
        if (ch % c.num_head_channels) {
            msg = strfmt("channels %d must be a multiple of num_head_channels %d", ch, c.num_head_channels);
            return msg;
        }
    }
    if (c.diffusion_steps < 1 || c.diffusion_steps > 100000)
        return "diffusion_steps must be 1..100000, found " + std::to_string(c.diffusion_steps);
    if (!(c.beta_start > 0.f && c.beta_end < 1.f && c.beta_start <= c.beta_end))
        return "need 0 < beta_start <= beta_end < 1";
    return "";
}
// "" if a and b describe the same model, else the first field that differs.
static std::string config_diff(const UNetConfig& a, const UNetConfig& b) {
    int32_t ha[HDR_INTS] = {0}, hb[HDR_INTS] = {0};
    config_to_header(a, ha);
    config_to_header(b, hb);
    static const char* names[] = {"image_size", "in_channels", "model_channels", "out_channels", "num_res_blocks",
                                  "n_levels", "mult0", "mult1", "mult2", "mult3", "attn_ds_mask",
                                  "num_head_channels", "diffusion_steps", "beta_start", "beta_end"};
    for (int i = HDR_MODEL_FIRST; i < HDR_MODEL_END; i++)
        if (ha[i] != hb[i]) {
            std::string msg;
            bool f = i >= HDR_MODEL_END - 2;
            if (f) msg = strfmt("%s is %g, expected %g", names[i - 3], hdr_float(ha, i), hdr_float(hb, i));
            else msg = strfmt("%s is %d, expected %d", names[i - 3], ha[i], hb[i]);
            return msg;
        }
    return "";
}

// ================================================================================================================
// kernels
// ================================================================================================================

static inline int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }

// Activations are float (--precision fp32, tf32) or bf16 (--precision bf16): kernels that touch them are templates
// on the type T; loads widen to float, stores round to nearest.
using bf16 = __nv_bfloat16;
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16_rn(v); }

// 16-byte vectors of activations (8 bf16 or 4 float), widened to float. The launchers take V = VEC<T> where the
// channel counts allow it (16-byte aligned pixel rows) and V = 1 otherwise (the 3-channel input and output).
template <typename T>
constexpr int VEC = (int)(16 / sizeof(T));
// a parameter of type Same<T>::type takes no part in deducing T (so it can be passed a plain nullptr)
template <typename T>
struct Same {
    using type = T;
};
template <typename T, int V>
__device__ __forceinline__ void vload(const T* p, float (&v)[V]) {
    if constexpr (V == 1) {
        v[0] = to_float(p[0]);
    } else if constexpr (std::is_same<T, float>::value) {
        const float4 u = *reinterpret_cast<const float4*>(p);
        v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
    } else {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __bfloat1622float2(h[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
    }
}
template <typename T, int V>
__device__ __forceinline__ void vstore(T* p, const float (&v)[V]) {
    if constexpr (V == 1) {
        p[0] = from_float<T>(v[0]);
    } else if constexpr (std::is_same<T, float>::value) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        uint4 u;
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        *reinterpret_cast<uint4*>(p) = u;
    }
}

__device__ __forceinline__ float silu_f(float z) { return z / (1.0f + expf(-z)); }
__device__ __forceinline__ float silu_grad(float z) {
    float s = 1.0f / (1.0f + expf(-z));
    return s * (1.0f + z * (1.0f - s));
}

// ---------------------------------------------------------------------------------------------------------------
// 3x3 convolution (padding 1) as an implicit GEMM over NHWC. From dev/conv2d.cu, version 2.
// MODE 0 (forward, and backward-data as a convolution of dY with flipped weights):
//   Y[m, n] = sum_k A[m, k] W[k, n]: m = output pixel (b, oy, ox), k = (tap, c) = tap*C + c, n = output channel;
//   A[m, k] = X[b, iy, ix, c], iy from oy: ny = oy*fs - 1 + ky, valid iff ny % ts == 0, iy = ny / ts (ts > 1 is
//   the backward of a stride-ts convolution); W is (9*C, N) row-major ("[tap][c][n]" layout).
// MODE 1 (weight gradient): dW[m, n] = sum_p A[m, p] dY[p, n] with m = (tap, c), p = output pixel, split over p
//   in gridDim.z chunks written to a workspace and summed by wgrad_reduce_kernel (deterministic).
// Tiles 128x64x32, 256 threads, 8x4 outputs per thread in fp32 FMAs: the strict fp32 path (--precision fp32), and
// the TF32 passes version 6 cannot take (3-channel input or output).
// VEC: channels fit the tile (MODE 0: C % 32 == 0; MODE 1: C % 4 == 0) and N % 4 == 0, so loads are float4.

constexpr int CONV_BM = 128, CONV_BN = 64, CONV_BK = 32, CONV_THREADS = 256;
constexpr int AS_LD = CONV_BK + 4;  // A tile (m, k), k contiguous (MODE 0)
constexpr int AT_LD = CONV_BM + 4;  // A tile (k, m), m contiguous (MODE 1)
constexpr int BS_LD = CONV_BN + 4;  // B tile (k, n)
constexpr int CS_LD = CONV_BN + 4;  // output tile (m, n)
constexpr int CONV_A_FLOATS = CONV_BM * AS_LD;  // >= CONV_BK * AT_LD
constexpr int CONV_SMEM_FLOATS = CONV_BM * CS_LD;  // >= A + B tiles
static_assert(CONV_BM * AS_LD >= CONV_BK * AT_LD, "A tile of MODE 1 must fit the A area");
static_assert(CONV_A_FLOATS + CONV_BK * BS_LD <= CONV_SMEM_FLOATS, "A and B tiles must fit the output tile area");
static_assert(CONV_THREADS == 256 && CONV_BM == 128 && CONV_BN == 64 && CONV_BK == 32, "loaders assume these");

struct ConvGeom {
    int B, H, W, C;  // gathered input (NHWC)
    int Ho, Wo, N;   // output pixels and channels
    int fs, ts;      // forward stride, transposed stride (see above)
    int M, K;        // GEMM sizes
    // version 6 only: the row stride of Bm (N, or 8 where N <= 8 was padded), and n / (Ho*Wo), n / Wo as
    // multiply-shift (fastdiv)
    int ldb;
    uint32_t hwo_mul, wo_mul;
    int hwo_shift, wo_shift;
};

// n / d for 0 <= n < 2^31 as (umulhi(n, mul) + n) >> shift, shift = ceil(log2 d), mul = 2^32 (2^shift - d) / d + 1
// (exact for every such n: the sum stays below 2^32); the weight gradient's gather divides twice per 16 bytes
static void fastdiv_make(int d, uint32_t* mul, int* shift) {
    int s = 0;
    while ((1LL << s) < d) s++;
    *mul = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << s) - d)) / d + 1);
    *shift = s;
}
__device__ __forceinline__ int fastdiv(int n, uint32_t mul, int shift) {
    return (int)((__umulhi((unsigned)n, mul) + (unsigned)n) >> shift);
}

// pixel index (b*H + iy)*W + ix of the input under output pixel (b, oy, ox) and tap, or -1 (padding)
__device__ __forceinline__ int conv_gather(const ConvGeom& g, int b, int oy, int ox, int tap) {
    int ky = tap / 3, kx = tap - 3 * ky;
    int ny = oy * g.fs - 1 + ky, nx = ox * g.fs - 1 + kx;
    if (g.ts > 1) {
        if (ny < 0 || nx < 0 || ny % g.ts || nx % g.ts) return -1;
        ny /= g.ts;
        nx /= g.ts;
    }
    if (ny < 0 || ny >= g.H || nx < 0 || nx >= g.W) return -1;
    return (b * g.H + ny) * g.W + nx;
}

// MODE 0 with VEC loads: (b, oy, ox) of the 4 output pixels (rows m0 + tid/8 + 32*i) this thread loads A for
__device__ __forceinline__ void conv_rows_setup(const ConvGeom& g, int m0, int tid, int HWo, int (&rowb)[4],
                                                int (&rowy)[4], int (&rowx)[4], bool (&rowv)[4]) {
    for (int i = 0; i < 4; i++) {
        int m = m0 + (tid >> 3) + 32 * i;
        rowv[i] = m < g.M;
        int mm = rowv[i] ? m : 0;
        rowb[i] = mm / HWo;
        int r = mm - rowb[i] * HWo;
        rowy[i] = r / g.Wo;
        rowx[i] = r - rowy[i] * g.Wo;
    }
}

// accs (+)= A tile x B tile over one CONV_BK slice, fp32 FMAs in k order. As: (m, k) with AS_LD (MODE 0) or
// (k, m) with AT_LD (MODE 1); Bs: (k, n) with BS_LD. Thread (ty, tx) owns rows ty*8 + i, columns tx + 16*j.
template <int MODE>
__device__ __forceinline__ void conv_fma_tile(const float* As, const float* Bs, float (&accs)[8][4], int ty, int tx) {
#pragma unroll 4
    for (int kk = 0; kk < CONV_BK; kk++) {
        float a[8], b[4];
        for (int i = 0; i < 8; i++) a[i] = MODE == 0 ? As[(ty * 8 + i) * AS_LD + kk] : As[kk * AT_LD + ty * 8 + i];
        for (int j = 0; j < 4; j++) b[j] = Bs[kk * BS_LD + tx + 16 * j];
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 4; j++) accs[i][j] = fmaf(a[i], b[j], accs[i][j]);
    }
}

// the accumulators into the (CONV_BM, CONV_BN) output tile Cs (row stride CS_LD), same ownership as above
__device__ __forceinline__ void conv_acc_store(float* Cs, const float (&accs)[8][4], int ty, int tx) {
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) Cs[(ty * 8 + i) * CS_LD + tx + 16 * j] = accs[i][j];
}

template <int MODE, bool VEC>
__global__ void __launch_bounds__(CONV_THREADS)
conv_igemm_kernel(const float* __restrict__ X, const float* __restrict__ Bm, float* __restrict__ out,
                  const float* __restrict__ bias, const float* __restrict__ emb, int accumulate, ConvGeom g,
                  int kchunk) {
    __shared__ __align__(128) float smem[CONV_SMEM_FLOATS];
    float* As = smem;
    float* Bs = smem + CONV_A_FLOATS;
    const int tid = threadIdx.x;
    const int m0 = blockIdx.x * CONV_BM, n0 = blockIdx.y * CONV_BN;
    const int kbeg = MODE == 1 ? blockIdx.z * kchunk : 0;
    const int kend = MODE == 1 ? min(g.K, kbeg + kchunk) : g.K;
    const int HWo = g.Ho * g.Wo;
    const int nk = (kend - kbeg + CONV_BK - 1) / CONV_BK;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);

    // per-thread loader state
    float4 ra[4], rb[2];  // VEC staging
    float sa[16], sb[8];  // scalar staging
    int rowb[4], rowy[4], rowx[4];
    bool rowv[4];
    int mtap = 0, mc = 0;
    bool mval = false;
    if (VEC && MODE == 0) conv_rows_setup(g, m0, tid, HWo, rowb, rowy, rowx, rowv);
    if (VEC && MODE == 1) {
        int m = m0 + (tid & 31) * 4;
        mval = m < g.M;
        mtap = m / g.C;
        mc = m - mtap * g.C;
    }

    auto load_tiles = [&](int k0) {
        if (VEC) {
            if (MODE == 0) {
                int tap = k0 / g.C, c0 = k0 - tap * g.C + (tid & 7) * 4;
                for (int i = 0; i < 4; i++) {
                    int pix = rowv[i] ? conv_gather(g, rowb[i], rowy[i], rowx[i], tap) : -1;
                    ra[i] = pix >= 0 ? *reinterpret_cast<const float4*>(X + (size_t)pix * g.C + c0) : zero4;
                }
            } else {
                for (int i = 0; i < 4; i++) {
                    int p = k0 + (tid >> 5) + 8 * i;
                    int pix = -1;
                    if (mval && p < kend) {
                        int b = p / HWo, r = p - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                        pix = conv_gather(g, b, oy, ox, mtap);
                    }
                    ra[i] = pix >= 0 ? *reinterpret_cast<const float4*>(X + (size_t)pix * g.C + mc) : zero4;
                }
            }
            for (int i = 0; i < 2; i++) {
                int k = k0 + (tid >> 4) + 16 * i, n = n0 + (tid & 15) * 4;
                rb[i] = (k < kend && n < g.N) ? *reinterpret_cast<const float4*>(Bm + (size_t)k * g.N + n) : zero4;
            }
        } else {
            for (int i = 0; i < 16; i++) {
                int e = tid + CONV_THREADS * i;
                float v = 0.f;
                if (MODE == 0) {
                    int m = m0 + (e >> 5), k = k0 + (e & 31);
                    if (m < g.M && k < kend) {
                        int tap = k / g.C, c = k - tap * g.C;
                        int b = m / HWo, r = m - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                        int pix = conv_gather(g, b, oy, ox, tap);
                        if (pix >= 0) v = X[(size_t)pix * g.C + c];
                    }
                } else {
                    int k = k0 + (e >> 7), m = m0 + (e & 127);
                    if (m < g.M && k < kend) {
                        int tap = m / g.C, c = m - tap * g.C;
                        int b = k / HWo, r = k - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                        int pix = conv_gather(g, b, oy, ox, tap);
                        if (pix >= 0) v = X[(size_t)pix * g.C + c];
                    }
                }
                sa[i] = v;
            }
            for (int i = 0; i < 8; i++) {
                int e = tid + CONV_THREADS * i;
                int k = k0 + (e >> 6), n = n0 + (e & 63);
                sb[i] = (k < kend && n < g.N) ? Bm[(size_t)k * g.N + n] : 0.f;
            }
        }
    };
    auto store_tiles = [&]() {
        if (VEC) {
            for (int i = 0; i < 4; i++) {
                if (MODE == 0)
                    *reinterpret_cast<float4*>(As + ((tid >> 3) + 32 * i) * AS_LD + (tid & 7) * 4) = ra[i];
                else
                    *reinterpret_cast<float4*>(As + ((tid >> 5) + 8 * i) * AT_LD + (tid & 31) * 4) = ra[i];
            }
            for (int i = 0; i < 2; i++)
                *reinterpret_cast<float4*>(Bs + ((tid >> 4) + 16 * i) * BS_LD + (tid & 15) * 4) = rb[i];
        } else {
            for (int i = 0; i < 16; i++) {
                int e = tid + CONV_THREADS * i;
                if (MODE == 0) As[(e >> 5) * AS_LD + (e & 31)] = sa[i];
                else As[(e >> 7) * AT_LD + (e & 127)] = sa[i];
            }
            for (int i = 0; i < 8; i++) {
                int e = tid + CONV_THREADS * i;
                Bs[(e >> 6) * BS_LD + (e & 63)] = sb[i];
            }
        }
    };

    const int ty = tid >> 4, tx = tid & 15;  // this thread's 8x4 outputs
    float accs[8][4];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) accs[i][j] = 0.f;

    if (nk > 0) {
        load_tiles(kbeg);
        store_tiles();
    }
    __syncthreads();
    for (int kt = 0; kt < nk; kt++) {
        if (kt + 1 < nk) load_tiles(kbeg + (kt + 1) * CONV_BK);  // global loads in flight during the MMAs
        conv_fma_tile<MODE>(As, Bs, accs, ty, tx);
        __syncthreads();
        if (kt + 1 < nk) {
            store_tiles();
            __syncthreads();
        }
    }

    // epilogue through shared memory: coalesced writes with bias, time embedding and accumulation fused
    float* Cs = smem;
    conv_acc_store(Cs, accs, ty, tx);
    __syncthreads();
    for (int e = tid; e < CONV_BM * CONV_BN; e += CONV_THREADS) {
        int row = e >> 6, col = e & 63;
        int m = m0 + row, n = n0 + col;
        if (m >= g.M || n >= g.N) continue;
        float v = Cs[row * CS_LD + col];
        if (MODE == 0) {
            if (bias) v += bias[n];
            if (emb) v += emb[(size_t)(m / HWo) * g.N + n];
            size_t idx = (size_t)m * g.N + n;
            if (accumulate) v += out[idx];
            out[idx] = v;
        } else {
            out[((size_t)blockIdx.z * g.M + m) * g.N + n] = v;
        }
    }
}

// dW[i] (+)= sum_z ws[z][i], in a fixed order; 4 elements per thread (n % 4 == 0, wgrad_reduce launches it)
__global__ void wgrad_reduce4_kernel(const float4* ws, float4* dw, size_t n4, int splits, int accumulate) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int z = 0; z < splits; z++) {
        const float4 w = ws[(size_t)z * n4 + i];
        s.x += w.x; s.y += w.y; s.z += w.z; s.w += w.w;
    }
    if (accumulate) {
        const float4 d = dw[i];
        s.x += d.x; s.y += d.y; s.z += d.z; s.w += d.w;
    }
    dw[i] = s;
}
__global__ void wgrad_reduce_kernel(const float* ws, float* dw, size_t n, int splits, int accumulate) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.f;
    for (int z = 0; z < splits; z++) s += ws[(size_t)z * n + i];
    dw[i] = accumulate ? dw[i] + s : s;
}

// Wbd[tap'][co][ci] = W[8 - tap'][ci][co]: the weights of the backward-data convolution (flipped, transposed)
__global__ void conv_flip_weights_kernel(const float* w, float* wbd, int cin, int cout) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int n = 9 * cin * cout;
    if (i >= n) return;
    int ci = i % cin, co = (i / cin) % cout, tap = i / (cin * cout);
    wbd[i] = w[((size_t)(8 - tap) * cin + ci) * cout + co];
}

// ---------------------------------------------------------------------------------------------------------------
// Version 6 of dev/conv2d.cu, the TF32 path for layers whose channels fit the tile (the others take version 2,
// strict fp32): the same implicit GEMM (conv_gather, MODE 0/1, split-K) on mma.sync m16n8k8 TF32 through inline
// PTX. What changed against version 5, and why (v5 was bound by its fragment loads and per-fragment conversions):
//  - each operand is rounded to TF32 (cvt.rna) once: after cp.async.wait_group a thread rounds, in place, the
//    16-byte chunks its own cp.async brought in (they are visible to it then), before the barrier that publishes
//    the tile; v5 converted every fragment element in every warp that loaded it;
//  - fragments: A of MODE 0 ((m, k), k contiguous, row stride BK + 4: 8 rows fall 4 banks apart) with one
//    ldmatrix.x4 per 16x8 tile; A of MODE 1 and B ((k, m|n), m|n contiguous, row stride + 8: the 4 k-rows of a
//    fragment fall 8 banks apart) with 32-bit loads; both conflict-free;
//  - the tile is chosen per layer (conv6_plan): 128x128 (8 warps of 64x32), 64x64 (4 warps of 32x32), 128x8 (4
//    warps of 32x8, for N <= 8: the output conv); a layer with too few output tiles (8x8 and 16x16 at batch 32)
//    splits K over blocks, and conv_splitk_epilogue_kernel adds the partial sums in a fixed order (deterministic)
//    and applies the epilogue;
//  - the weight gradient's gather divides pixel indices by multiply-shift (fastdiv), not integer division;
//  - the epilogue adds bias, time embedding and residual straight from the accumulators (float2 per thread: a quad
//    of lanes writes 32 contiguous bytes of a row).
// Each output sums its k-tiles in order and each tile's four k8 steps in order whatever the tile shape, so every
// tile variant gives the same bits (dev/conv2d.cu checks it); only a K split changes the summation order.
//
// mma.m16n8k8 TF32 fragments (PTX ISA), lane = 4*gq + tq:
//   A (16x8, row major): a0 (gq, tq), a1 (gq+8, tq), a2 (gq, tq+4), a3 (gq+8, tq+4)
//   B (8x8, "col"):      b0 (k = tq, n = gq), b1 (k = tq+4, n = gq)
//   C (16x8):            c0 (gq, 2tq), c1 (gq, 2tq+1), c2 (gq+8, 2tq), c3 (gq+8, 2tq+1)
// ldmatrix.x4 (b16) hands lane L word L%4 of row L/4 of matrix i in register i; matrix i's rows are addressed by
// lanes 8i..8i+7. With lane L pointing at row (L % 16), column 4*(L / 16) of the 16x8 A tile, matrices 0..3 are
// rows 0-7/8-15 x columns 0-3/4-7 and the registers come out as a0..a3.
constexpr int C6_BK = 32, C6_STAGES = 3;

__device__ __forceinline__ void cp_async16(float* smem_dst, const float* gmem_src, bool valid) {
    unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    int n = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int MODE, int BM, int BN, int WM, int WN>
struct Conv6 {
    static constexpr int WARPS_M = BM / WM, WARPS_N = BN / WN, THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int MI = WM / 16, NI = WN / 8;                   // mma tiles per warp
    static constexpr int A_LD = MODE == 0 ? C6_BK + 4 : BM + 8;       // MODE 0: (m, k); MODE 1: (k, m)
    static constexpr int A_FLOATS = MODE == 0 ? BM * A_LD : C6_BK * A_LD;
    static constexpr int B_LD = BN + ((8 - BN) % 32 + 32) % 32;       // (k, n), B_LD % 32 == 8
    static constexpr int STAGE_FLOATS = A_FLOATS + C6_BK * B_LD;
    static constexpr size_t SMEM = (size_t)C6_STAGES * STAGE_FLOATS * sizeof(float);
    // 16-byte chunks a thread copies per stage (B of the thin tile: fewer chunks than threads); rows of k-major
    // tiles ((k, m) and (k, n)) one pass of threads covers
    static constexpr int A_CHUNKS = BM * C6_BK / 4 / THREADS;
    static constexpr int B_TOTAL = BN * C6_BK / 4, B_CHUNKS = (B_TOTAL + THREADS - 1) / THREADS;
    static constexpr int A_ROWS_PER_PASS = MODE == 0 ? THREADS / (C6_BK / 4) : THREADS / (BM / 4);
    static constexpr int B_ROWS_PER_PASS = THREADS / (BN / 4);
    static constexpr int MIN_BLOCKS = (int)((227 * 1024) / (SMEM + 1024)) < 4 ? (int)((227 * 1024) / (SMEM + 1024)) : 4;
    static_assert(WM % 16 == 0 && WN % 8 == 0 && BM % WM == 0 && BN % WN == 0, "warp tiles of whole mma tiles");
    static_assert(A_CHUNKS * THREADS * 4 == BM * C6_BK, "whole A chunks per thread");
    static_assert(B_TOTAL % THREADS == 0 || B_CHUNKS == 1, "B: whole chunks per thread, or at most one");
    static_assert(MODE == 0 || THREADS % (BM / 4) == 0, "MODE 1: a thread's A chunks share their (tap, c) column");
    static_assert(THREADS % (BN / 4) == 0, "a thread's B chunks share their n column");
    static_assert(A_LD % 32 == (MODE == 0 ? 4 : 8) && B_LD % 32 == 8, "strides for conflict-free fragment loads");
    static_assert(MIN_BLOCKS >= 1, "the stages must fit shared memory");
};

__device__ __forceinline__ uint32_t tf32_rna(float x) {  // round to nearest (ties away), 10 mantissa bits
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float4 tf32_rna4(float4 v) {
    return make_float4(__uint_as_float(tf32_rna(v.x)), __uint_as_float(tf32_rna(v.y)), __uint_as_float(tf32_rna(v.z)),
                       __uint_as_float(tf32_rna(v.w)));
}
__device__ __forceinline__ float4 tf32_add_mask4(float4 v) {  // (bits + 2^12) & ~(2^13 - 1): NaN may become Inf
    auto r = [](float x) { return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u); };
    return make_float4(r(v.x), r(v.y), r(v.z), r(v.w));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const float* p) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// cp.async.wait_group that the compiler may not move loads of shared memory across (the rounding pass reads what
// the copies wrote)
template <int N>
__device__ __forceinline__ void cp_async_wait_mem() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// RND: 1 rounds each operand to TF32 once in shared memory (the default); lab variants of dev/conv2d.cu, timed
// there, never used by the trainer: 0 hands the tensor cores the fp32 bits (they ignore the low 13: truncation),
// 2 rounds every fragment after loading it, 3 is 1 with the integer form of the rounding (wrong for NaN).
template <int MODE, int BM, int BN, int WM, int WN, int RND>
__global__ void __launch_bounds__(Conv6<MODE, BM, BN, WM, WN>::THREADS, Conv6<MODE, BM, BN, WM, WN>::MIN_BLOCKS)
conv_mma_kernel(const float* __restrict__ X, const float* __restrict__ Bm, float* __restrict__ out,
                const float* __restrict__ bias, const float* __restrict__ emb, int accumulate, ConvGeom g,
                int kchunk) {
    using T = Conv6<MODE, BM, BN, WM, WN>;
    extern __shared__ __align__(128) float smem6[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int kbeg = blockIdx.z * kchunk, kend = min(g.K, kbeg + kchunk);
    const int nk = (kend - kbeg + C6_BK - 1) / C6_BK;
    const int HWo = g.Ho * g.Wo;

    // loader: this thread's 16-byte chunks of a stage. MODE 0 A (m, k): rows tid/8 + (THREADS/8)*i, k chunk tid%8
    // (K % 32 == 0 here: a k-tile is one tap). MODE 1 A (k = pixel, m = (tap, c)): k-rows tid/(BM/4) + RPP*i,
    // columns fixed. B (k, n): k-rows tid/(BN/4) + RPP*i, columns fixed.
    constexpr int AR = MODE == 0 ? T::A_CHUNKS : 1;
    int rowb[AR], rowyx[AR];  // MODE 0: per A row, the sample (-1: row past M) and (oy << 16 | ox)
    int mtap = 0, mc = 0;
    bool mval = false;
    if (MODE == 0) {
#pragma unroll
        for (int i = 0; i < AR; i++) {
            int m = m0 + (tid >> 3) + T::A_ROWS_PER_PASS * i;
            int b = m / HWo, r = m - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
            rowb[i] = m < g.M ? b : -1;
            rowyx[i] = (oy << 16) | ox;
        }
    } else {
        int m = m0 + (tid % (BM / 4)) * 4;
        mval = m < g.M;
        mtap = mval ? m / g.C : 0;
        mc = mval ? m - mtap * g.C : 0;
    }
    auto a_chunk = [&](int stage, int i) -> float* {
        float* As = smem6 + stage * T::STAGE_FLOATS;
        if (MODE == 0) return As + ((tid >> 3) + T::A_ROWS_PER_PASS * i) * T::A_LD + (tid & 7) * 4;
        return As + (tid / (BM / 4) + T::A_ROWS_PER_PASS * i) * T::A_LD + (tid % (BM / 4)) * 4;
    };
    auto b_chunk = [&](int stage, int i) -> float* {
        float* Bs = smem6 + stage * T::STAGE_FLOATS + T::A_FLOATS;
        return Bs + (tid / (BN / 4) + T::B_ROWS_PER_PASS * i) * T::B_LD + (tid % (BN / 4)) * 4;
    };
    auto b_mine = [&](int i) { return T::B_TOTAL % T::THREADS == 0 || tid + T::THREADS * i < T::B_TOTAL; };
    auto load_stage = [&](int stage, int k0) {
        if (MODE == 0) {
            int tap = k0 / g.C, c0 = k0 - tap * g.C + (tid & 7) * 4;
#pragma unroll
            for (int i = 0; i < T::A_CHUNKS; i++) {
                int pix = rowb[i] >= 0 ? conv_gather(g, rowb[i], rowyx[i] >> 16, rowyx[i] & 0xffff, tap) : -1;
                cp_async16(a_chunk(stage, i), pix >= 0 ? X + (size_t)pix * g.C + c0 : X, pix >= 0);
            }
        } else {
#pragma unroll
            for (int i = 0; i < T::A_CHUNKS; i++) {
                int p = k0 + tid / (BM / 4) + T::A_ROWS_PER_PASS * i;
                int pix = -1;
                if (mval && p < kend) {
                    int b = fastdiv(p, g.hwo_mul, g.hwo_shift), r = p - b * HWo;
                    int oy = fastdiv(r, g.wo_mul, g.wo_shift), ox = r - oy * g.Wo;
                    pix = conv_gather(g, b, oy, ox, mtap);
                }
                cp_async16(a_chunk(stage, i), pix >= 0 ? X + (size_t)pix * g.C + mc : X, pix >= 0);
            }
        }
#pragma unroll
        for (int i = 0; i < T::B_CHUNKS; i++) {
            if (!b_mine(i)) continue;
            int k = k0 + tid / (BN / 4) + T::B_ROWS_PER_PASS * i, n = n0 + (tid % (BN / 4)) * 4;
            bool v = k < kend && n < g.N;  // n < N: the 16 bytes are inside the row (N % 4 == 0, or padded to ldb)
            cp_async16(b_chunk(stage, i), v ? Bm + (size_t)k * g.ldb + n : Bm, v);
        }
    };
    auto round_stage = [&](int stage) {  // RND 1 (3): this thread's own chunks, in place
        auto rnd4 = [](float4 v) { return RND == 3 ? tf32_add_mask4(v) : tf32_rna4(v); };
#pragma unroll
        for (int i = 0; i < T::A_CHUNKS; i++) {
            float4* p = reinterpret_cast<float4*>(a_chunk(stage, i));
            *p = rnd4(*p);
        }
#pragma unroll
        for (int i = 0; i < T::B_CHUNKS; i++) {
            if (!b_mine(i)) continue;
            float4* p = reinterpret_cast<float4*>(b_chunk(stage, i));
            *p = rnd4(*p);
        }
    };

    // this warp's WM x WN tile: MI x NI mma tiles
    const int wm = warp % T::WARPS_M, wn = warp / T::WARPS_M;
    const int gq = lane >> 2, tq = lane & 3;
    float acc[T::MI][T::NI][4];
#pragma unroll
    for (int i = 0; i < T::MI; i++)
#pragma unroll
        for (int j = 0; j < T::NI; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[i][j][r] = 0.f;
    auto mma_stage = [&](int stage) {
        const float* As = smem6 + stage * T::STAGE_FLOATS;
        const float* Bs = As + T::A_FLOATS;
#pragma unroll
        for (int kk = 0; kk < C6_BK; kk += 8) {
            uint32_t a[T::MI][4], b[T::NI][2];
#pragma unroll
            for (int i = 0; i < T::MI; i++) {
                if (MODE == 0) {
                    ldmatrix_x4(a[i], As + (wm * WM + i * 16 + (lane & 15)) * T::A_LD + kk + (lane >> 4) * 4);
                } else {
                    const float* p = As + (kk + tq) * T::A_LD + wm * WM + i * 16 + gq;
                    a[i][0] = __float_as_uint(p[0]);
                    a[i][1] = __float_as_uint(p[8]);
                    a[i][2] = __float_as_uint(p[4 * T::A_LD]);
                    a[i][3] = __float_as_uint(p[4 * T::A_LD + 8]);
                }
                if (RND == 2)
#pragma unroll
                    for (int r = 0; r < 4; r++) a[i][r] = tf32_rna(__uint_as_float(a[i][r]));
            }
#pragma unroll
            for (int j = 0; j < T::NI; j++) {
                const float* p = Bs + (kk + tq) * T::B_LD + wn * WN + j * 8 + gq;
                b[j][0] = __float_as_uint(p[0]);
                b[j][1] = __float_as_uint(p[4 * T::B_LD]);
                if (RND == 2) {
                    b[j][0] = tf32_rna(__uint_as_float(b[j][0]));
                    b[j][1] = tf32_rna(__uint_as_float(b[j][1]));
                }
            }
#pragma unroll
            for (int i = 0; i < T::MI; i++)
#pragma unroll
                for (int j = 0; j < T::NI; j++) mma_tf32(acc[i][j], a[i], b[j]);
        }
    };

    // C6_STAGES-deep pipeline, one barrier per k-tile (as version 4)
#pragma unroll
    for (int s = 0; s < C6_STAGES - 1; s++) {
        if (s < nk) load_stage(s, kbeg + s * C6_BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait_mem<C6_STAGES - 2>();  // this thread's copies of tile kt have landed
        if (RND == 1 || RND == 3) round_stage(kt % C6_STAGES);
        __syncthreads();  // tile kt is in (rounded) for everyone; everyone is done with tile kt-1's stage
        int next = kt + C6_STAGES - 1;
        if (next < nk) load_stage(next % C6_STAGES, kbeg + next * C6_BK);
        cp_async_commit();
        mma_stage(kt % C6_STAGES);
    }
    cp_async_wait_mem<0>();

    // epilogue from the accumulators: MODE 0 whole K: out (+)= acc + bias + emb; otherwise the raw partial sums
    // into the workspace slice of this K chunk. Even N: float2 (n < N implies n + 1 < N); odd N (<= 8): scalars.
    const bool raw = MODE == 1 || gridDim.z > 1;
    const bool pairs = (g.N & 1) == 0;
#pragma unroll
    for (int i = 0; i < T::MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int m = m0 + wm * WM + i * 16 + gq + 8 * h;
            if (m >= g.M) continue;
            float* orow = out + ((raw ? (size_t)blockIdx.z * g.M : 0) + m) * g.N;
            const float* erow = (!raw && emb) ? emb + (size_t)(m / HWo) * g.N : nullptr;
#pragma unroll
            for (int j = 0; j < T::NI; j++) {
                int n = n0 + wn * WN + j * 8 + 2 * tq;
                if (n >= g.N) continue;
                if (!pairs) {
                    for (int e = 0; e < 2 && n + e < g.N; e++) {
                        float v = acc[i][j][2 * h + e];
                        if (!raw) {
                            if (bias) v += bias[n + e];
                            if (erow) v += erow[n + e];
                            if (accumulate) v += orow[n + e];
                        }
                        orow[n + e] = v;
                    }
                    continue;
                }
                float2 v = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                if (!raw) {
                    if (bias) {
                        float2 bb = *reinterpret_cast<const float2*>(bias + n);
                        v.x += bb.x; v.y += bb.y;
                    }
                    if (erow) {
                        float2 ee = *reinterpret_cast<const float2*>(erow + n);
                        v.x += ee.x; v.y += ee.y;
                    }
                    if (accumulate) {
                        float2 o = *reinterpret_cast<const float2*>(orow + n);
                        v.x += o.x; v.y += o.y;
                    }
                }
                *reinterpret_cast<float2*>(orow + n) = v;
            }
        }
}

// MODE 0 split over K (version 6): out[m, n] (+)= sum_z ws[z][m][n] in a fixed order, + bias[n] + emb[m / HWo][n]
// (V = 4 elements per thread when N % 4 == 0)
template <typename T, int V>
__global__ void conv_splitk_epilogue_kernel(const float* __restrict__ ws, T* out,
                                            const float* __restrict__ bias, const float* __restrict__ emb,
                                            const T* res, int M, int N, int HWo, int splits) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * V, MN = (size_t)M * N;
    if (i >= MN) return;
    const int n = (int)(i % N), m = (int)(i / N);
    float v[V];
#pragma unroll
    for (int k = 0; k < V; k++) v[k] = 0.f;
    for (int z = 0; z < splits; z++) {
        if (V == 4) {
            const float4 w = *reinterpret_cast<const float4*>(ws + (size_t)z * MN + i);
            v[0] += w.x; v[1] += w.y; v[2 % V] += w.z; v[3 % V] += w.w;
        } else {
            v[0] += ws[(size_t)z * MN + i];
        }
    }
#pragma unroll
    for (int k = 0; k < V; k++) {
        if (bias) v[k] += bias[n + k];
        if (emb) v[k] += emb[(size_t)(m / HWo) * N + n + k];
        if (res) v[k] += to_float(res[i + k]);
        out[i + k] = from_float<T>(v[k]);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// bf16 3x3 convolution on Hopper (--precision bf16): dev/conv2d.cu version 7. The implicit GEMM of version 6 on
// warpgroup MMA (wgmma, sm_90a) fed by TMA box copies through an mbarrier pipeline; fp32 accumulation.
//  - Pixels are tiled in boxes of 64 (bw x bh x bb along x, y and images; powers of 2, masked at the edges). The
//    input under a box shifted by one tap is one TMA copy whose out-of-image part reads as zeros: the padding.
//    Stride 2 reads the input through 4 parity views (every other row and column), where every tap is a shift too.
//  - MODE 0 (forward; backward-data is the forward of dY with the flipped, transposed weights): a block computes 2
//    pixel boxes (one per consumer warpgroup, 64 rows each) x BN output channels over k-tiles (tap, 64 channels).
//    A [pixel][channel] and B = weights [n][tap][channel] are K-major.
//  - MODE 1 (weight gradient): dW[(tap, channel)][n] over k-tiles of one pixel box; consumer warpgroup w owns the
//    64 rows of one (tap, 64-channel) slab. A = input [pixel][channel], B = dY [pixel][n]: both MN-major.
//  - Block: a producer warpgroup (one thread issues the copies) and 2 consumer warpgroups; STAGES-deep ring of
//    (A 16 KB, B BN x 128 B) stages, full[s] completing on the copies' bytes, empty[s] on the 8 consumer warps.
//    Blocks are persistent: each walks output tiles blockIdx.x, + gridDim.x, ... (n-tiles of one m-tile next to
//    each other), so the producer fills the next tile's stages while the consumers run the epilogue. The narrowest
//    tile (BN = 64) runs 2 blocks per SM.
//  - Split-K over blockIdx.z writes fp32 partial sums that a second kernel adds in a fixed order (deterministic).
// Without sm_90a (other GPUs) the same three products run on mma.sync (conv_mma_bf16_kernel, version 8, below).

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define UNET_SM90A 1
#else
#define UNET_SM90A 0
#endif

constexpr int CW_BOX = 64;        // pixels per box = rows of a consumer warpgroup
constexpr int CW_BK = 64;         // bf16 per k-tile row: one 128-byte swizzle row
constexpr int CW_THREADS = 384;   // producer warpgroup + 2 consumer warpgroups
constexpr int CW_SLAB = CW_BOX * CW_BK * 2;  // bytes of one 64 x 64 bf16 tile (8 KB)

template <int BN>
struct ConvWg {
    static_assert(BN % 64 == 0 && BN <= 256, "B tiles are whole 64-channel slabs, wgmma N <= 256");
    static constexpr int A_BYTES = 2 * CW_SLAB, B_BYTES = BN * CW_BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int MINB = BN == 64 ? 2 : 1;  // blocks per SM (the 80 registers of 2 fit no wider wgmma)
    static constexpr int STAGES = (MINB == 2 ? 96 * 1024 : 192 * 1024) / STAGE_BYTES;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + 1024;  // + barriers, + alignment
    static constexpr int NR = BN / 2;  // fp32 accumulators per consumer thread
    // setmaxnreg: the producer drops to 40 registers and the consumers take what it frees; the pool is the block's
    // own (the registers it was launched with: 65536 / (384 MINB), a multiple of 8), so more would wait forever
    static constexpr int LAUNCH_REGS = 65536 / (CW_THREADS * MINB) / 8 * 8;
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = (3 * LAUNCH_REGS - PRODUCER_REGS) / 2 / 8 * 8;
    static_assert(STAGES >= 3, "a pipeline of at least 3 stages");
    static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= CW_THREADS * LAUNCH_REGS, "the block's registers");
};

// Geometry of one pass, computed on the host (conv_wg_geom)
struct ConvWgGeom {
    int B, C, N;          // images; channels of the gathered input; output channels (MODE 1: of dY)
    int Ho, Wo;           // pixels of the output (MODE 1: of dY)
    int stride;           // of the gather: 1, or 2 (parity views)
    int kc;               // 64-channel chunks per tap, ceil(C / 64)
    int bw, bh, bb;       // pixel box extent along x, y, images (bw * bh * bb = 64)
    int nbx, nby, nbox;   // boxes along x, y, in all
    int ktiles, kchunk;   // k-tiles in all, per blockIdx.z
    int M;                // MODE 0: output pixels B*Ho*Wo; MODE 1: rows 9*C of dW
    int tiles;            // output tiles (m-tiles x n-tiles): the persistent blocks' work
};
// the TMA views: the gathered input (a[0]; stride 2: a[2 * row parity + column parity]) and B (weights / dY)
struct ConvWgMaps {
    CUtensorMap a[4];
    CUtensorMap b;
};
// epilogue of MODE 0 without a K split: out (+)= acc + bias[n] + emb[image][n]
struct ConvWgOut {
    __nv_bfloat16* out;
    const float* bias;
    const float* emb;
    const __nv_bfloat16* res;  // added when not null (may be out itself)
    float* ws;                 // split K (and MODE 1): partial sums [z][M][N]
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#if UNET_SM90A
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
#endif
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#if UNET_SM90A
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if UNET_SM90A
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
#endif
}
// waits for the phase of this parity to complete (a fresh barrier counts "parity 1" as complete)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if UNET_SM90A
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}
// TMA box loads (coordinates innermost first) completing on bar's transaction count
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
#if UNET_SM90A
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4}], [%5];\n" ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1),
                 "r"(c2), "r"(smem_u32(bar))
                 : "memory");
#endif
}
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
#if UNET_SM90A
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4, %5}], [%6];\n" ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1),
                 "r"(c2), "r"(c3), "r"(smem_u32(bar))
                 : "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if UNET_SM90A
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if UNET_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N_PENDING>
__device__ __forceinline__ void wgmma_wait() {
#if UNET_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N_PENDING) : "memory");
#endif
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
#if UNET_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
#if UNET_SM90A
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
// keeps the compiler from moving accumulator accesses across the asynchronous wgmma
template <int NR>
__device__ __forceinline__ void acc_fence(float (&d)[NR]) {
#pragma unroll
    for (int i = 0; i < NR; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory matrix descriptors, 128-byte swizzle (bits 62-63 = 1), tiles 1024-byte aligned. Fields: start
// address / 16 (bits 0-13), leading byte offset / 16 (16-29), stride byte offset / 16 (32-45).
// K-major: 8-row groups 1024 bytes apart (stride); a k16 step starts 32 bytes further (the swizzle is applied to
// the address). MN-major: 64 MN-elements per 128-byte row, 8 K-rows per 1024-byte group (stride 1024), the next 64
// MN-elements `lead` bytes further; a k16 step starts 2048 bytes (two groups) further.
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lead) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(lead >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
// m64n64k16; T = __half: fp16 operands (Muon's gram iteration)
#define UNET_WGMMA_N64(TY) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(a_desc), "l"(b_desc), "n"(1), "n"(TA), "n"(TB))
template <int TA, int TB, typename T = bf16>
__device__ __forceinline__ void wgmma_bf16(float (&d)[32], uint64_t a_desc, uint64_t b_desc) {
#if UNET_SM90A
    if constexpr (std::is_same<T, __half>::value) UNET_WGMMA_N64("f16");
    else UNET_WGMMA_N64("bf16");
#endif
}
#undef UNET_WGMMA_N64
template <int TA, int TB>
__device__ __forceinline__ void wgmma_bf16(float (&d)[64], uint64_t a_desc, uint64_t b_desc) {
#if UNET_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "l"(a_desc), "l"(b_desc), "n"(1), "n"(TA), "n"(TB));
#endif
}
template <int TA, int TB>
__device__ __forceinline__ void wgmma_bf16(float (&d)[96], uint64_t a_desc, uint64_t b_desc) {
#if UNET_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
        "}, %96, %97, p, 1, 1, %99, %100;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(a_desc), "l"(b_desc), "n"(1), "n"(TA), "n"(TB));
#endif
}
template <int TA, int TB>
__device__ __forceinline__ void wgmma_bf16(float (&d)[128], uint64_t a_desc, uint64_t b_desc) {
#if UNET_SM90A
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),
          "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),
          "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "l"(a_desc), "l"(b_desc), "n"(1), "n"(TA), "n"(TB));
#endif
}

// origin (image, y, x) of pixel box i
__device__ __forceinline__ void cw_box_origin(const ConvWgGeom& g, int i, int& b0, int& y0, int& x0) {
    const int bx = i % g.nbx, r = i / g.nbx, by = r % g.nby;
    x0 = bx * g.bw;
    y0 = by * g.bh;
    b0 = (r / g.nby) * g.bb;
}
// the output pixel (b * Ho + y) * Wo + x of row r of the box at (b0, y0, x0), or -1 outside the images
__device__ __forceinline__ int cw_row_pixel(const ConvWgGeom& g, int b0, int y0, int x0, int r) {
    const int x = x0 + r % g.bw, y = y0 + (r / g.bw) % g.bh, b = b0 + r / (g.bw * g.bh);
    return (b < g.B && y < g.Ho && x < g.Wo) ? (b * g.Ho + y) * g.Wo + x : -1;
}
// copies channels c0..c0+63 of the input under the box at (b0, y0, x0) shifted by tap (64 rows of 128 bytes)
__device__ __forceinline__ void cw_load_input(const ConvWgMaps& maps, const ConvWgGeom& g, void* dst, int tap, int c0,
                                              int b0, int y0, int x0, uint64_t* bar) {
    const int ky = tap / 3, kx = tap - 3 * ky;
    if (g.stride == 1) tma_load_4d(dst, &maps.a[0], c0, x0 + kx - 1, y0 + ky - 1, b0, bar);
    else tma_load_4d(dst, &maps.a[2 * (ky != 1) + (kx != 1)], c0, x0 - (kx == 0), y0 - (ky == 0), b0, bar);
}

// producer (one thread): the k-tiles [kbeg, kend) of each of this block's tiles into the ring of stages (`it`
// counts k-tiles over the tiles: stage it % STAGES, phase (it / STAGES) & 1)
template <int MODE, int BN>
__device__ __forceinline__ void conv_wg_produce(const ConvWgMaps& maps, const ConvWgGeom& g, uint8_t* smem,
                                                uint64_t* full, uint64_t* empty, int kbeg, int kend) {
    using Cfg = ConvWg<BN>;
    const int ntiles = (g.N + BN - 1) / BN;
    uint32_t it = 0;
    for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
        const int mb = tile / ntiles, n0 = (tile - mb * ntiles) * BN;
        int b0[2], y0[2], x0[2], tap[2], c0[2];  // MODE 0: each warpgroup's pixel box; MODE 1: (tap, channels)
        for (int w = 0; w < 2; w++) {
            const int r = 2 * mb + w;
            if (MODE == 0) cw_box_origin(g, r, b0[w], y0[w], x0[w]);
            tap[w] = min(r / g.kc, 8);  // MODE 1: the rows of a warpgroup past the last tap load tap 8, unused
            c0[w] = (r % g.kc) * CW_BK;
        }
        for (int kt = kbeg; kt < kend; kt++, it++) {
            const int s = it % Cfg::STAGES;
            mbar_wait(&empty[s], ((it / Cfg::STAGES) & 1) ^ 1);
            mbar_expect_tx(&full[s], Cfg::STAGE_BYTES);  // out-of-range box elements count too (zeros)
            uint8_t* a = smem + s * Cfg::STAGE_BYTES;
            uint8_t* b = a + Cfg::A_BYTES;
            if (MODE == 0) {
                const int t = kt / g.kc, c = (kt - t * g.kc) * CW_BK;
                for (int w = 0; w < 2; w++)
                    cw_load_input(maps, g, a + w * CW_SLAB, t, c, b0[w], y0[w], x0[w], &full[s]);
                tma_load_3d(b, &maps.b, c, t, n0, &full[s]);  // weights [n][tap][c]: BN rows of 64 channels
            } else {
                int pb, py, px;
                cw_box_origin(g, kt, pb, py, px);
                for (int w = 0; w < 2; w++)
                    cw_load_input(maps, g, a + w * CW_SLAB, tap[w], c0[w], pb, py, px, &full[s]);
                for (int j = 0; j < BN / 64; j++)
                    tma_load_4d(b + j * CW_SLAB, &maps.b, n0 + 64 * j, px, py, pb, &full[s]);
            }
        }
    }
}

// consumer warpgroup c: acc (its 64 rows x BN) over one tile's k-tiles; one wgmma group stays in flight, and the
// last stage is released once the group is done (`it` runs on over the block's tiles)
template <int MODE, int BN>
__device__ __forceinline__ void conv_wg_consume(uint8_t* smem, uint64_t* full, uint64_t* empty, int kbeg, int kend,
                                                int c, uint32_t& it, float (&acc)[ConvWg<BN>::NR]) {
    using Cfg = ConvWg<BN>;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < Cfg::NR; i++) acc[i] = 0.0f;
    acc_fence(acc);
    for (int kt = kbeg; kt < kend; kt++, it++) {
        const int s = it % Cfg::STAGES;
        mbar_wait(&full[s], (it / Cfg::STAGES) & 1);
        const uint32_t a = smem_u32(smem + s * Cfg::STAGE_BYTES) + c * CW_SLAB, b = a - c * CW_SLAB + Cfg::A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < CW_BK / 16; ks++) {
            if (MODE == 0) wgmma_bf16<0, 0>(acc, wg_desc(a + 32 * ks, 16), wg_desc(b + 32 * ks, 16));
            else wgmma_bf16<1, 1>(acc, wg_desc(a + 2048 * ks, CW_SLAB), wg_desc(b + 2048 * ks, CW_SLAB));
        }
        wgmma_commit();
        wgmma_wait<1>();  // the previous k-tile's group is done: release its stage
        __syncwarp();
        if (lane == 0 && kt > kbeg) mbar_arrive(&empty[(it + Cfg::STAGES - 1) % Cfg::STAGES]);
    }
    wgmma_wait<0>();
    acc_fence(acc);
    __syncwarp();
    if (lane == 0 && kend > kbeg) mbar_arrive(&empty[(it + Cfg::STAGES - 1) % Cfg::STAGES]);
}

// Accumulator fragment of m64nNk16 (warp w of the warpgroup, gq = lane / 4, tq = lane % 4): acc[4j + 2h + e] is row
// 16w + gq + 8h, column 8j + 2tq + e. MODE 0 without a split: out (+)= acc + bias + emb as bf16 pairs; otherwise
// the fp32 partial sums into ws[z][row][n] (MODE 1 rows: tap * C + channel, the layout of dW).
template <int MODE, int BN>
__device__ __forceinline__ void conv_wg_epilogue(const ConvWgGeom& g, const ConvWgOut& o,
                                                 const float (&acc)[ConvWg<BN>::NR], int c, int mb, int n0) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const int r0 = 2 * mb + c;
    int b0 = 0, y0 = 0, x0 = 0;
    if (MODE == 0) cw_box_origin(g, r0, b0, y0, x0);
    const int tap = r0 / g.kc, ch0 = (r0 % g.kc) * CW_BK;
    const bool partial = MODE == 1 || gridDim.z > 1;
    float* ws = o.ws + (size_t)blockIdx.z * g.M * g.N;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = warp * 16 + gq + 8 * h;
        int row;
        if (MODE == 0) row = cw_row_pixel(g, b0, y0, x0, r);
        else row = (tap < 9 && ch0 + r < g.C) ? tap * g.C + ch0 + r : -1;
        if (row < 0) continue;
        const int img = MODE == 0 ? row / (g.Ho * g.Wo) : 0;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            const int n = n0 + 8 * j + 2 * tq;
            if (n >= g.N) continue;
            float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
            if (partial) {
                *reinterpret_cast<float2*>(ws + (size_t)row * g.N + n) = make_float2(v0, v1);
                continue;
            }
            if (o.bias) {
                v0 += o.bias[n];
                v1 += o.bias[n + 1];
            }
            if (o.emb) {
                v0 += o.emb[(size_t)img * g.N + n];
                v1 += o.emb[(size_t)img * g.N + n + 1];
            }
            if (o.res) {
                const __nv_bfloat162 r2 = *reinterpret_cast<const __nv_bfloat162*>(o.res + (size_t)row * g.N + n);
                const float2 r = __bfloat1622float2(r2);
                v0 += r.x;
                v1 += r.y;
            }
            *reinterpret_cast<__nv_bfloat162*>(o.out + (size_t)row * g.N + n) = __floats2bfloat162_rn(v0, v1);
        }
    }
}

template <int MODE, int BN>
__global__ void __launch_bounds__(CW_THREADS, ConvWg<BN>::MINB)
conv_wgmma_kernel(const __grid_constant__ ConvWgMaps maps, const ConvWgGeom g, const ConvWgOut o) {
#if UNET_SM90A
    using Cfg = ConvWg<BN>;
    extern __shared__ uint8_t cw_smem_raw[];
    uint8_t* smem = cw_smem_raw + ((1024 - (smem_u32(cw_smem_raw) & 1023)) & 1023);  // swizzled tiles: 1024-aligned
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::STAGES * Cfg::STAGE_BYTES);
    uint64_t* empty = full + Cfg::STAGES;
    const int wg = threadIdx.x / 128, ntiles = (g.N + BN - 1) / BN;
    const int kbeg = blockIdx.z * g.kchunk, kend = min(g.ktiles, kbeg + g.kchunk);
    if (threadIdx.x == 0) {
        for (int s = 0; s < Cfg::STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);  // one arrive per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<Cfg::PRODUCER_REGS>();
        if (threadIdx.x == 0) conv_wg_produce<MODE, BN>(maps, g, smem, full, empty, kbeg, kend);
    } else {
        setmaxnreg_inc<Cfg::CONSUMER_REGS>();
        float acc[Cfg::NR];
        uint32_t it = 0;
        for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
            const int mb = tile / ntiles;
            conv_wg_consume<MODE, BN>(smem, full, empty, kbeg, kend, wg - 1, it, acc);
            conv_wg_epilogue<MODE, BN>(g, o, acc, wg - 1, mb, (tile - mb * ntiles) * BN);
        }
    }
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// bf16 3x3 convolution on mma.sync (--precision bf16 on GPUs without sm_90a, compute capability >= 8.0): dev/conv2d.cu
// version 8. Version 6's implicit GEMM (conv_gather, 3-stage cp.async pipeline, tile per layer, split-K) on
// mma.sync m16n8k16 bf16 with fp32 accumulation, for the three products of the wgmma path and its contract
// (ConvWgOut; channels % 8 == 0 on both sides, conv_wg_ok):
//  - MODE 0 (forward; backward-data is the forward of dY with the flipped, transposed weights wd, on the
//    zero-inserted dY for stride 2): A = gathered input [m = pixel][k = channel], B = weights [n][tap][channel],
//    both K-major, so ldmatrix hands out their fragments as they lie. A k-tile is C8_BK channels of one tap; the
//    channels past C read as zeros (C % 8 == 0: a 16-byte chunk is wholly inside or outside).
//  - MODE 1 (weight gradient): dW[m = (tap, channel)][n] over k = output pixels; A = gathered input [k][m] and
//    B = dY [k][n] are MN-major: ldmatrix.trans. fp32 partial sums per K chunk into the workspace, added in a fixed
//    order by wgrad_reduce.
//  - shared tiles: K-major [row][C8_BK + 8], MN-major [k][BM or BN + 8]; a row is an odd number of 16-byte units,
//    so the 8 rows of an ldmatrix phase fall in 8 different bank groups (conflict-free).
// Each output sums its k-tiles in order and each k-tile's four k16 steps in order whatever the tile, so every tile
// gives the same bits with K whole (dev/conv2d.cu checks it).
//
// mma.m16n8k16 bf16 (PTX ISA), lane = 4*gq + tq; a register holds 2 bf16, the lower k (column) in the low half:
//   A (16x16): a0 (row gq, k 2tq, 2tq+1), a1 (row gq+8, same k), a2 (row gq, k 2tq+8, 2tq+9), a3 (row gq+8, ...)
//   B (16x8):  b0 (k 2tq, 2tq+1, n gq), b1 (k 2tq+8, 2tq+9, n gq)
//   C (16x8):  c0, c1 (row gq, n 2tq, 2tq+1), c2, c3 (row gq+8, n 2tq, 2tq+1)
// ldmatrix.x4 (b16): lanes 8i..8i+7 address the 8 rows (16 bytes) of matrix i; lane L receives in register i the
// elements (L/4, 2(L%4)) and (L/4, 2(L%4)+1) of matrix i, with .trans (2(L%4), L/4) and (2(L%4)+1, L/4).
constexpr int C8_BK = 64, C8_STAGES = 3;

template <int MODE, int BM, int BN, int WM, int WN>
struct Conv8 {
    static constexpr int WARPS_M = BM / WM, WARPS_N = BN / WN, THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int WM_ = WM, WN_ = WN, MI = WM / 16, NI = WN / 8;  // a warp's tile; its mma tiles
    static constexpr int A_LD = MODE == 0 ? C8_BK + 8 : BM + 8, B_LD = MODE == 0 ? C8_BK + 8 : BN + 8;  // bf16
    static constexpr int A_ELEMS = (MODE == 0 ? BM : C8_BK) * A_LD, B_ELEMS = (MODE == 0 ? BN : C8_BK) * B_LD;
    static constexpr int STAGE_ELEMS = A_ELEMS + B_ELEMS;
    static constexpr size_t SMEM = (size_t)C8_STAGES * STAGE_ELEMS * sizeof(bf16);
    // 16-byte chunks in a tile row, rows one pass of the threads covers, chunks a thread copies per stage
    static constexpr int A_ROW_CHUNKS = (MODE == 0 ? C8_BK : BM) / 8, B_ROW_CHUNKS = (MODE == 0 ? C8_BK : BN) / 8;
    static constexpr int A_RPP = THREADS / A_ROW_CHUNKS, B_RPP = THREADS / B_ROW_CHUNKS;
    static constexpr int A_CHUNKS = BM * C8_BK / 8 / THREADS, B_CHUNKS = BN * C8_BK / 8 / THREADS;
    static constexpr int MIN_BLOCKS = (int)((227 * 1024) / (SMEM + 1024)) < 4 ? (int)((227 * 1024) / (SMEM + 1024)) : 4;
    static_assert(WM % 16 == 0 && WN % 16 == 0 && BM % WM == 0 && BN % WN == 0, "warp tiles of whole n16 pairs");
    static_assert(THREADS % A_ROW_CHUNKS == 0 && THREADS % B_ROW_CHUNKS == 0, "a thread keeps its chunk column");
    static_assert(A_CHUNKS * THREADS * 8 == BM * C8_BK && B_CHUNKS * THREADS * 8 == BN * C8_BK, "whole chunks");
    static_assert((A_LD * 2 / 16) % 2 == 1 && (B_LD * 2 / 16) % 2 == 1, "rows of an odd number of 16-byte units");
    static_assert(MIN_BLOCKS >= 1, "the stages must fit shared memory");
};

// Element offset, in a stage's A or B tile, of the 16-byte row that lane `lane` hands ldmatrix.x4: for the A
// fragment (a0..a3) of rows (m) r0..r0+15 at k-step kk, and for the B fragments of columns (n) c0..c0+15 (registers:
// b0, b1 of n c0..c0+7, then b0, b1 of c0+8..c0+15). MODE 0 K-major tiles, MODE 1 MN-major (read with .trans).
// Host and device: dev/conv2d.cu runs them on an emulated warp.
template <int MODE>
__host__ __device__ __forceinline__ int conv8_a_lds(int lane, int ld, int r0, int kk) {
    return MODE == 0 ? (r0 + (lane & 15)) * ld + kk + (lane >> 4) * 8
                     : (kk + (lane >> 4) * 8 + (lane & 7)) * ld + r0 + ((lane >> 3) & 1) * 8;
}
template <int MODE>
__host__ __device__ __forceinline__ int conv8_b_lds(int lane, int ld, int c0, int kk) {
    return MODE == 0 ? (c0 + (lane >> 4) * 8 + (lane & 7)) * ld + kk + ((lane >> 3) & 1) * 8
                     : (kk + ((lane >> 3) & 1) * 8 + (lane & 7)) * ld + c0 + (lane >> 4) * 8;
}
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4_b16(uint32_t (&r)[4], const bf16* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
}
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void cp_async16_b16(bf16* smem_dst, const bf16* gmem_src, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    const int n = valid ? 16 : 0;  // 0 source bytes: the 16 destination bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(n));
}

// The loader of conv_mma_bf16_kernel. MODE 0: A rows (pixels) tid/8 + A_RPP*i, channel chunk tid%8 of the k-tile;
// B rows (n) likewise. MODE 1: A and B rows (pixels) tid/ROW_CHUNKS + RPP*i, the thread's column chunk (m or n)
// fixed. What a thread precomputes once: MODE 0 per A row the image (-1: row past M) and (oy << 16 | ox); MODE 1 its
// A column's tap and channel.
template <int MODE, class T>
struct Conv8Loader {
    static constexpr int AR = MODE == 0 ? T::A_CHUNKS : 1;
    int rowb[AR], rowyx[AR];
    int mtap = 0, mc = 0, bcol = 0;
    bool mval = false;

    __device__ __forceinline__ void init(const ConvGeom& g, int tid, int m0, int n0) {
        const int HWo = g.Ho * g.Wo;
        if (MODE == 0) {
#pragma unroll
            for (int i = 0; i < AR; i++) {
                const int m = m0 + tid / T::A_ROW_CHUNKS + T::A_RPP * i;
                const int b = m / HWo, r = m - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                rowb[i] = m < g.M ? b : -1;
                rowyx[i] = (oy << 16) | ox;
            }
        } else {
            const int m = m0 + (tid % T::A_ROW_CHUNKS) * 8;  // 8 rows (tap, c..c+7) of one tap: C % 8 == 0
            mval = m < g.M;
            mtap = mval ? m / g.C : 0;
            mc = mval ? m - mtap * g.C : 0;
        }
        bcol = n0 + (tid % T::B_ROW_CHUNKS) * 8;  // MODE 1: the thread's n chunk
    }
    // k-tile kt of A and B into stage buffer `st` (cp.async, zero-filled outside the tensors)
    __device__ __forceinline__ void load(bf16* st, const bf16* __restrict__ X, const bf16* __restrict__ Bm,
                                         const ConvGeom& g, int tid, int n0, int kc, int kt) const {
        auto a_dst = [&](int i) {
            return st + (tid / T::A_ROW_CHUNKS + T::A_RPP * i) * T::A_LD + (tid % T::A_ROW_CHUNKS) * 8;
        };
        auto b_dst = [&](int i) {
            return st + T::A_ELEMS + (tid / T::B_ROW_CHUNKS + T::B_RPP * i) * T::B_LD + (tid % T::B_ROW_CHUNKS) * 8;
        };
        if (MODE == 0) {
            const int tap = kt / kc, c = (kt - tap * kc) * C8_BK + (tid % T::A_ROW_CHUNKS) * 8;
            const bool cok = c < g.C;
#pragma unroll
            for (int i = 0; i < T::A_CHUNKS; i++) {
                const int pix = rowb[i] >= 0 && cok ? conv_gather(g, rowb[i], rowyx[i] >> 16, rowyx[i] & 0xffff, tap)
                                                    : -1;
                cp_async16_b16(a_dst(i), pix >= 0 ? X + (size_t)pix * g.C + c : X, pix >= 0);
            }
#pragma unroll
            for (int i = 0; i < T::B_CHUNKS; i++) {
                const int n = n0 + tid / T::B_ROW_CHUNKS + T::B_RPP * i;
                const bool v = cok && n < g.N;
                cp_async16_b16(b_dst(i), v ? Bm + ((size_t)n * 9 + tap) * g.C + c : Bm, v);
            }
        } else {
            const int p0 = kt * C8_BK, HWo = g.Ho * g.Wo;
#pragma unroll
            for (int i = 0; i < T::A_CHUNKS; i++) {
                const int p = p0 + tid / T::A_ROW_CHUNKS + T::A_RPP * i;
                int pix = -1;
                if (mval && p < g.K) {
                    const int b = fastdiv(p, g.hwo_mul, g.hwo_shift), r = p - b * HWo;
                    const int oy = fastdiv(r, g.wo_mul, g.wo_shift), ox = r - oy * g.Wo;
                    pix = conv_gather(g, b, oy, ox, mtap);
                }
                cp_async16_b16(a_dst(i), pix >= 0 ? X + (size_t)pix * g.C + mc : X, pix >= 0);
            }
#pragma unroll
            for (int i = 0; i < T::B_CHUNKS; i++) {
                const int p = p0 + tid / T::B_ROW_CHUNKS + T::B_RPP * i;
                const bool v = p < g.K && bcol < g.N;
                cp_async16_b16(b_dst(i), v ? Bm + (size_t)p * g.N + bcol : Bm, v);
            }
        }
    }
};

// One stage's k-tile into the warp's WM x WN accumulators (MI x NI mma tiles at warp position (wm, wn))
template <int MODE, class T>
__device__ __forceinline__ void conv8_mma_stage(const bf16* As, int lane, int wm, int wn,
                                                float (&acc)[T::MI][T::NI][4]) {
    const bf16* Bs = As + T::A_ELEMS;
#pragma unroll
    for (int kk = 0; kk < C8_BK; kk += 16) {
        uint32_t a[T::MI][4], b[T::NI][2];
#pragma unroll
        for (int i = 0; i < T::MI; i++)
            ldmatrix_x4_b16<MODE == 1>(a[i], As + conv8_a_lds<MODE>(lane, T::A_LD, wm * T::WM_ + i * 16, kk));
#pragma unroll
        for (int j = 0; j < T::NI; j += 2) {
            uint32_t r[4];
            ldmatrix_x4_b16<MODE == 1>(r, Bs + conv8_b_lds<MODE>(lane, T::B_LD, wn * T::WN_ + j * 8, kk));
            b[j][0] = r[0];
            b[j][1] = r[1];
            b[j + 1][0] = r[2];
            b[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < T::MI; i++)
#pragma unroll
            for (int j = 0; j < T::NI; j++) mma_bf16_16816(acc[i][j], a[i], b[j]);
    }
}

// The accumulators out (N % 8 == 0: n < N implies n + 1 < N): raw fp32 partials to o.ws[z] (MODE 1 or a split),
// else bf16 out = acc + bias + emb + res
template <int MODE, class T>
__device__ __forceinline__ void conv8_epilogue(const float (&acc)[T::MI][T::NI][4], const ConvWgOut& o,
                                               const ConvGeom& g, int m0, int n0, int lane, int wm, int wn) {
    const bool raw = MODE == 1 || gridDim.z > 1;
    const int gq = lane >> 2, tq = lane & 3, HWo = g.Ho * g.Wo;
#pragma unroll
    for (int i = 0; i < T::MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = m0 + wm * T::WM_ + i * 16 + gq + 8 * h;
            if (m >= g.M) continue;
            const float* erow = (!raw && o.emb) ? o.emb + (size_t)(m / HWo) * g.N : nullptr;
#pragma unroll
            for (int j = 0; j < T::NI; j++) {
                const int n = n0 + wn * T::WN_ + j * 8 + 2 * tq;
                if (n >= g.N) continue;
                float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                if (raw) {
                    *reinterpret_cast<float2*>(o.ws + ((size_t)blockIdx.z * g.M + m) * g.N + n) = make_float2(v0, v1);
                    continue;
                }
                if (o.bias) {
                    const float2 bb = *reinterpret_cast<const float2*>(o.bias + n);
                    v0 += bb.x;
                    v1 += bb.y;
                }
                if (erow) {
                    const float2 ee = *reinterpret_cast<const float2*>(erow + n);
                    v0 += ee.x;
                    v1 += ee.y;
                }
                if (o.res) {
                    const __nv_bfloat162 r2 = *reinterpret_cast<const __nv_bfloat162*>(o.res + (size_t)m * g.N + n);
                    const float2 r = __bfloat1622float2(r2);
                    v0 += r.x;
                    v1 += r.y;
                }
                *reinterpret_cast<__nv_bfloat162*>(o.out + (size_t)m * g.N + n) = __floats2bfloat162_rn(v0, v1);
            }
        }
}

// Block (blockIdx.x, blockIdx.y) computes the BM x BN output tile over the k-tiles [z * kchunk, (z + 1) * kchunk) of
// `ktiles` (z = blockIdx.z). MODE 0: kc k-tiles per tap (ceil(C / C8_BK)); g is the ConvGeom of the forward gather
// (ts = 1), M = pixels, N = output channels. MODE 1: g as conv_geom_weight (M = 9*C, K = pixels), k-tile = C8_BK
// pixels. Without a split, MODE 0 writes bf16 out = acc + bias + emb + res; otherwise the fp32 partial sums go to
// o.ws[z][M][N]. A C8_STAGES-deep cp.async pipeline, one barrier per k-tile (as version 6).
template <int MODE, int BM, int BN, int WM, int WN>
__global__ void __launch_bounds__(Conv8<MODE, BM, BN, WM, WN>::THREADS, Conv8<MODE, BM, BN, WM, WN>::MIN_BLOCKS)
conv_mma_bf16_kernel(const bf16* __restrict__ X, const bf16* __restrict__ Bm, const ConvWgOut o,
                     const ConvGeom g, int kc, int ktiles, int kchunk) {
    using T = Conv8<MODE, BM, BN, WM, WN>;
    extern __shared__ __align__(128) bf16 smem8[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int kbeg = blockIdx.z * kchunk, nk = min(ktiles, kbeg + kchunk) - kbeg;
    Conv8Loader<MODE, T> ld;
    ld.init(g, tid, m0, n0);
    const int wm = warp % T::WARPS_M, wn = warp / T::WARPS_M;
    float acc[T::MI][T::NI][4];
#pragma unroll
    for (int i = 0; i < T::MI; i++)
#pragma unroll
        for (int j = 0; j < T::NI; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[i][j][r] = 0.f;
#pragma unroll
    for (int s = 0; s < C8_STAGES - 1; s++) {
        if (s < nk) ld.load(smem8 + s * T::STAGE_ELEMS, X, Bm, g, tid, n0, kc, kbeg + s);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait_mem<C8_STAGES - 2>();  // this thread's copies of tile kt have landed
        __syncthreads();  // tile kt is in for everyone; everyone is done with tile kt-1's stage
        const int next = kt + C8_STAGES - 1;
        if (next < nk) ld.load(smem8 + (next % C8_STAGES) * T::STAGE_ELEMS, X, Bm, g, tid, n0, kc, kbeg + next);
        cp_async_commit();
        conv8_mma_stage<MODE, T>(smem8 + (kt % C8_STAGES) * T::STAGE_ELEMS, lane, wm, wn, acc);
    }
    cp_async_wait_mem<0>();
    conv8_epilogue<MODE, T>(acc, o, g, m0, n0, lane, wm, wn);
}

// ---------------------------------------------------------------------------------------------------------------
// bf16 3x3 convolutions too thin for the TMA path (channels % 8 != 0 on a side: the 3-channel input and output
// convolutions): CUDA cores, fp32 weights and accumulation.

// y (+)= conv + bias over the MODE 0 gather of ConvGeom (so backward-data runs here too): one thread per output
// pixel and group of NT output channels (blockIdx.y). The weights w (K x N) are staged in shared memory `taps` taps
// at a time (all 9 where they fit); inputs are read 8 channels at a time where C % 8 == 0 (V = 8).
template <int NT, int V>
__global__ void conv_thin_kernel(const bf16* __restrict__ x, const float* __restrict__ w, bf16* __restrict__ y,
                                 const float* __restrict__ bias, ConvGeom g, int taps, int accumulate) {
    extern __shared__ __align__(16) float thin_w[];  // (taps * C) x NT
    const int n0 = blockIdx.y * NT, nn = min(NT, g.N - n0);
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    const int HWo = g.Ho * g.Wo, pc = min(p, g.M - 1), b = pc / HWo, r = pc - b * HWo, oy = r / g.Wo;
    const int ox = r - oy * g.Wo;
    float acc[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j] = 0.f;
    for (int t0 = 0; t0 < 9; t0 += taps) {
        const int t1 = min(9, t0 + taps);
        if (t0 > 0) __syncthreads();  // the previous taps' weights are no longer read
        for (int i = threadIdx.x; i < (t1 - t0) * g.C * NT; i += blockDim.x) {
            const int kc = i / NT, j = i - kc * NT;
            thin_w[i] = j < nn ? w[((size_t)t0 * g.C + kc) * g.N + n0 + j] : 0.f;
        }
        __syncthreads();
        for (int tap = t0; tap < t1; tap++) {
            const int pix = conv_gather(g, b, oy, ox, tap);
            if (pix < 0) continue;
            const bf16* xp = x + (size_t)pix * g.C;
            const float* wt = thin_w + (size_t)(tap - t0) * g.C * NT;
            for (int c = 0; c < g.C; c += V) {
                float v[V];
                vload<bf16, V>(xp + c, v);
#pragma unroll
                for (int e = 0; e < V; e++)
#pragma unroll
                    for (int j = 0; j < NT; j += 4) {  // 4 weights per shared-memory load
                        const float4 w4 = *reinterpret_cast<const float4*>(wt + (c + e) * NT + j);
                        acc[j] = fmaf(v[e], w4.x, acc[j]);
                        acc[j + 1] = fmaf(v[e], w4.y, acc[j + 1]);
                        acc[j + 2] = fmaf(v[e], w4.z, acc[j + 2]);
                        acc[j + 3] = fmaf(v[e], w4.w, acc[j + 3]);
                    }
            }
        }
    }
    if (p >= g.M) return;
    bf16* yp = y + (size_t)p * g.N + n0;
    if (NT % 8 == 0 && g.N % 8 == 0 && nn == NT) {  // 16-byte stores
#pragma unroll
        for (int j = 0; j < NT; j += 8) {
            float v[8], o[8];
            if (accumulate) vload<bf16, 8>(yp + j, o);
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = acc[j + e] + (bias ? bias[n0 + j + e] : 0.f) + (accumulate ? o[e] : 0.f);
            vstore<bf16, 8>(yp + j, v);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
        if (j >= nn) break;
        float v = acc[j] + (bias ? bias[n0 + j] : 0.f);
        if (accumulate) v += __bfloat162float(yp[j]);
        yp[j] = __float2bfloat16_rn(v);
    }
}

// Weight gradient of a thin convolution, MODE 1 of ConvGeom (M = 9*C rows, N, K = pixels): each block stages
// THIN_PIX pixels at a time (their gathered inputs, THIN_PIX x M, and dY, THIN_PIX x N4 with N4 = N rounded up to 4,
// as fp32); a task is (row, 4 columns) and each thread accumulates TPT tasks (q0 + tid + k * blockDim.x, q0 =
// blockIdx.y * TPT * blockDim.x) over the block's pixels; ws[blockIdx.x][M][N] receives the sums, added in a fixed
// order by wgrad_reduce. Inputs are gathered 8 channels at a time where C % 8 == 0 (V = 8).
constexpr int THIN_PIX = 32, THIN_TPT = 2;
template <int TPT, int V>
__global__ void conv_thin_wgrad_kernel(const bf16* __restrict__ x, const bf16* __restrict__ dy, float* __restrict__ ws,
                                       ConvGeom g) {
    extern __shared__ float thin_s[];
    const int N4 = (g.N + 3) / 4 * 4, tasks = g.M * (N4 / 4), HWo = g.Ho * g.Wo;
    float* xs = thin_s;                   // THIN_PIX x M
    float* ds = thin_s + THIN_PIX * g.M;  // THIN_PIX x N4
    const int q0 = blockIdx.y * TPT * blockDim.x;
    float4 acc[TPT];
#pragma unroll
    for (int q = 0; q < TPT; q++) acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p0 = blockIdx.x * THIN_PIX; p0 < g.K; p0 += gridDim.x * THIN_PIX) {
        for (int i = threadIdx.x; i < THIN_PIX * (g.M / V); i += blockDim.x) {  // V consecutive (tap, c) rows
            const int pp = i / (g.M / V), row = (i - pp * (g.M / V)) * V, p = p0 + pp;
            float v[V];
#pragma unroll
            for (int e = 0; e < V; e++) v[e] = 0.f;
            if (p < g.K) {
                const int tap = row / g.C, c = row - tap * g.C;
                const int b = p / HWo, r = p - b * HWo, oy = r / g.Wo, ox = r - oy * g.Wo;
                const int pix = conv_gather(g, b, oy, ox, tap);
                if (pix >= 0) vload<bf16, V>(x + (size_t)pix * g.C + c, v);
            }
#pragma unroll
            for (int e = 0; e < V; e++) xs[pp * g.M + row + e] = v[e];
        }
        for (int i = threadIdx.x; i < THIN_PIX * N4; i += blockDim.x) {
            const int pp = i / N4, n = i - pp * N4, p = p0 + pp;
            ds[i] = p < g.K && n < g.N ? __bfloat162float(dy[(size_t)p * g.N + n]) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < TPT; q++) {
            const int task = q0 + threadIdx.x + q * blockDim.x;
            if (task >= tasks) break;
            const int row = task / (N4 / 4), n4 = (task - row * (N4 / 4)) * 4;
            for (int pp = 0; pp < THIN_PIX; pp++) {
                const float xv = xs[pp * g.M + row];
                const float4 d = *reinterpret_cast<const float4*>(ds + pp * N4 + n4);
                acc[q].x = fmaf(xv, d.x, acc[q].x);
                acc[q].y = fmaf(xv, d.y, acc[q].y);
                acc[q].z = fmaf(xv, d.z, acc[q].z);
                acc[q].w = fmaf(xv, d.w, acc[q].w);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < TPT; q++) {
        const int task = q0 + threadIdx.x + q * blockDim.x;
        if (task >= tasks) break;
        const int row = task / (N4 / 4), n4 = (task - row * (N4 / 4)) * 4;
        float* o = ws + (size_t)blockIdx.x * g.M * g.N + (size_t)row * g.N;
        const float a[4] = {acc[q].x, acc[q].y, acc[q].z, acc[q].w};
        for (int e = 0; e < 4 && n4 + e < g.N; e++) o[n4 + e] = a[e];
    }
}

// Weight gradient of a stride-1 convolution with at most 4 output channels and C % 8 == 0 (the output conv):
// dW[tap][c][n] = sum over input pixels q of x[q][c] dY[q - shift(tap)][n], so a block stages THIN_PIX2 input pixels
// of x once (no gather of the wide operand) and, for each tap, the 4-channel dY rows they meet; a task is one (tap,
// c) row of 4 products, TPT tasks per thread; ws[blockIdx.x][9*C][N] as conv_thin_wgrad_kernel.
constexpr int THIN_PIX2 = 64;
template <int TPT>
__global__ void conv_thin_wgrad_dy_kernel(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                                          float* __restrict__ ws, ConvGeom g) {
    extern __shared__ __align__(16) float thin_s[];
    float* xs = thin_s;                                    // THIN_PIX2 x C
    float4* ds = reinterpret_cast<float4*>(xs + THIN_PIX2 * g.C);  // 9 x THIN_PIX2
    const int HW = g.H * g.W, npix = g.B * HW, rows = 9 * g.C;
    float4 acc[TPT];
#pragma unroll
    for (int q = 0; q < TPT; q++) acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q0 = blockIdx.x * THIN_PIX2; q0 < npix; q0 += gridDim.x * THIN_PIX2) {
        for (int i = threadIdx.x; i < THIN_PIX2 * (g.C / 8); i += blockDim.x) {
            const int qq = i / (g.C / 8), c = (i - qq * (g.C / 8)) * 8;
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = 0.f;
            if (q0 + qq < npix) vload<bf16, 8>(x + (size_t)(q0 + qq) * g.C + c, v);
#pragma unroll
            for (int e = 0; e < 8; e++) xs[qq * g.C + c + e] = v[e];
        }
        for (int i = threadIdx.x; i < 9 * THIN_PIX2; i += blockDim.x) {
            const int tap = i / THIN_PIX2, qq = i - tap * THIN_PIX2, q = q0 + qq;
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            if (q < npix) {
                const int b = q / HW, r = q - b * HW, iy = r / g.W, ix = r - iy * g.W;
                const int oy = iy - tap / 3 + 1, ox = ix - tap % 3 + 1;
                if (oy >= 0 && oy < g.H && ox >= 0 && ox < g.W)
                    for (int n = 0; n < g.N; n++)
                        d[n] = __bfloat162float(dy[((size_t)(b * g.H + oy) * g.W + ox) * g.N + n]);
            }
            ds[i] = make_float4(d[0], d[1], d[2], d[3]);
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < TPT; q++) {
            const int row = threadIdx.x + q * blockDim.x;
            if (row >= rows) break;
            const int tap = row / g.C, c = row - tap * g.C;
            for (int qq = 0; qq < THIN_PIX2; qq++) {
                const float xv = xs[qq * g.C + c];
                const float4 d = ds[tap * THIN_PIX2 + qq];
                acc[q].x = fmaf(xv, d.x, acc[q].x);
                acc[q].y = fmaf(xv, d.y, acc[q].y);
                acc[q].z = fmaf(xv, d.z, acc[q].z);
                acc[q].w = fmaf(xv, d.w, acc[q].w);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < TPT; q++) {
        const int row = threadIdx.x + q * blockDim.x;
        if (row >= rows) break;
        float* o = ws + ((size_t)blockIdx.x * rows + row) * g.N;
        const float a[4] = {acc[q].x, acc[q].y, acc[q].z, acc[q].w};
        for (int n = 0; n < g.N; n++) o[n] = a[n];
    }
}

// up (B, H, W, C) = dY (B, Ho, Wo, C) at the even pixels, zeros between: backward-data of a stride-2 convolution is
// then the stride-1 one (the wgmma path's gather has no transposed stride)
__global__ void dilate2_kernel(const bf16* __restrict__ dy, bf16* __restrict__ up, int B, int H, int W, int C) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * H * W * C) return;
    const int c = (int)(i % C);
    const size_t p = i / C;
    const int x = (int)(p % W), y = (int)((p / W) % H), b = (int)(p / ((size_t)H * W));
    const int Ho = (H + 1) / 2, Wo = (W + 1) / 2;
    up[i] = (x % 2 || y % 2) ? __float2bfloat16_rn(0.f) : dy[(((size_t)b * Ho + y / 2) * Wo + x / 2) * C + c];
}

// The bf16 compute copy of the weights (--precision bf16), refreshed after every update: pw = every parameter in
// bf16, 3x3 convolution weights transposed to the wgmma forward's B operand [cout][tap][cin]; wd = 3x3 convolution
// weights in the backward-data layout [cin][8 - tap][cout] (flipped, transposed). One launch for all parameters:
// block i works on tile i - tile0 of the table entry found by binary search (32 x 32 (cin, cout) tiles of one tap
// for convolutions, 1024 elements otherwise). Block (32, 8).
struct CastEntry {
    int tile0, conv, cin, cout;
    long long off, n;
};
__global__ void weights_to_bf16_kernel(const float* __restrict__ p, bf16* __restrict__ pw, bf16* __restrict__ wd,
                                       const CastEntry* __restrict__ table, int entries) {
    __shared__ float tile[32][33];
    int lo = 0, hi = entries - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table[mid].tile0 <= (int)blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    const CastEntry e = table[lo];
    const int t = blockIdx.x - e.tile0, tx = threadIdx.x, ty = threadIdx.y;
    if (!e.conv) {
        const long long end = min(e.n, (long long)(t + 1) * 1024);
        for (long long i = (long long)t * 1024 + ty * 32 + tx; i < end; i += 256)
            pw[e.off + i] = __float2bfloat16_rn(p[e.off + i]);
        return;
    }
    const int tco = (e.cout + 31) / 32, tci = (e.cin + 31) / 32;
    const int tap = t / (tci * tco), r = t - tap * tci * tco, ci0 = (r / tco) * 32, co0 = (r - (r / tco) * tco) * 32;
    for (int i = ty; i < 32; i += 8) {  // read [tap][ci][co] along co; wd along co
        const int ci = ci0 + i, co = co0 + tx;
        const bool in = ci < e.cin && co < e.cout;
        const float v = in ? p[e.off + ((size_t)tap * e.cin + ci) * e.cout + co] : 0.f;
        tile[i][tx] = v;
        if (in) wd[e.off + ((size_t)ci * 9 + (8 - tap)) * e.cout + co] = __float2bfloat16_rn(v);
    }
    __syncthreads();
    for (int i = ty; i < 32; i += 8) {  // pw along ci
        const int co = co0 + i, ci = ci0 + tx;
        if (ci < e.cin && co < e.cout)
            pw[e.off + ((size_t)co * 9 + tap) * e.cin + ci] = __float2bfloat16_rn(tile[tx][i]);
    }
}

// sum over the 32 lanes of a warp in a fixed order (deterministic)
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------------------------
// per-(b, channel) sums over pixels: x (Bq, P, C) -> partial (Bq, S, C) of double2, S pixel chunks per sample
// (blockIdx.y). A thread owns V channels (one 16-byte vector) and a pixel lane: blockDim.x / (C / V) lanes walk the
// chunk's pixels (a few dozen at most per lane: float sums), and the lanes are added in order, in double, through
// shared memory (lanes x C double2).
// MODE 0: (x, x^2) (GroupNorm statistics). MODE 1: GroupNorm backward (dz, dz * xhat) with dz = dy * silu'(z) when
// silu, z = xhat*gamma + beta. MODE 2: (x, 0) (bias and time-embedding gradients). From dev/groupnorm.cu.
template <int MODE, typename T, int V>
__global__ void __launch_bounds__(256, 3) chan_reduce_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                   const float* __restrict__ mean, const float* __restrict__ rstd,
                                   const float* __restrict__ gamma, const float* __restrict__ beta, int P, int C,
                                   int G, int silu, double2* __restrict__ partial) {
    extern __shared__ double2 red[];
    const int b = blockIdx.x, s = blockIdx.y, S = gridDim.y;
    const int p0 = (int)((long long)P * s / S), p1 = (int)((long long)P * (s + 1) / S);
    const int VC = C / V, lanes = blockDim.x / VC, lane = threadIdx.x / VC, c0 = (threadIdx.x - lane * VC) * V;
    const int cg = C / max(G, 1);
    if (lane < lanes) {
        float ax[V], ay[V], mu[V], rs[V], ga[V], be[V];
#pragma unroll
        for (int v = 0; v < V; v++) {
            ax[v] = ay[v] = 0.f;
            if (MODE == 1) {
                const int c = c0 + v, bg = b * G + c / cg;
                mu[v] = mean[bg];
                rs[v] = rstd[bg];
                ga[v] = gamma[c];
                be[v] = beta[c];
            }
        }
        for (int p = p0 + lane; p < p1; p += lanes) {
            const size_t idx = ((size_t)b * P + p) * C + c0;
            float xv[V], dv[V];
            vload<T, V>(x + idx, xv);
            if (MODE == 1) vload<T, V>(dy + idx, dv);
#pragma unroll
            for (int v = 0; v < V; v++) {
                if (MODE == 0) {
                    ax[v] += xv[v];
                    ay[v] = fmaf(xv[v], xv[v], ay[v]);
                } else if (MODE == 1) {
                    const float xh = (xv[v] - mu[v]) * rs[v];
                    float d = dv[v];
                    if (silu) d *= silu_grad(xh * ga[v] + be[v]);
                    ax[v] += d;
                    ay[v] = fmaf(d, xh, ay[v]);
                } else {
                    ax[v] += xv[v];
                }
            }
        }
#pragma unroll
        for (int v = 0; v < V; v++) red[lane * C + c0 + v] = make_double2((double)ax[v], (double)ay[v]);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        double2 t = make_double2(0.0, 0.0);
        for (int l = 0; l < lanes; l++) {
            t.x += red[l * C + c].x;
            t.y += red[l * C + c].y;
        }
        partial[((size_t)b * S + s) * C + c] = t;
    }
}

// One warp per (b, group) (the reductions below: a warp per output, lanes over the partials, warp_sum): mean and
// 1/sqrt(var + eps) from MODE 0 partials, and the apply's per-(b, channel) coefficients (rstd*gamma, beta -
// mean*rstd*gamma)
__global__ void gn_stats_finalize_kernel(const double2* __restrict__ partial, const float* __restrict__ gamma,
                                         const float* __restrict__ beta, float* mean, float* rstd, float2* coef,
                                         int Bq, int S, int C, int G, int P, float eps) {
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (w >= Bq * G) return;
    const int b = w / G, g = w % G, cg = C / G;
    double sx = 0.0, sxx = 0.0;
    for (int i = lane; i < S * cg; i += 32) {
        const int s = i / cg, c = g * cg + i % cg;
        const double2 t = partial[((size_t)b * S + s) * C + c];
        sx += t.x;
        sxx += t.y;
    }
    sx = warp_sum(sx);
    sxx = warp_sum(sxx);
    const double n = (double)P * cg, mu = sx / n, var = fmax(sxx / n - mu * mu, 0.0);
    const float m = (float)mu, r = (float)(1.0 / sqrt(var + (double)eps));
    if (lane == 0) {
        mean[w] = m;
        rstd[w] = r;
    }
    for (int c = g * cg + lane; c < (g + 1) * cg; c += 32) {
        const float a = r * gamma[c];
        coef[(size_t)b * C + c] = make_float2(a, beta[c] - m * a);
    }
}

// The apply kernels walk pixels: a block covers the pixels [p0, p1) of sample blockIdx.x (chunk blockIdx.y of
// gridDim.y); a thread owns V channels (one 16-byte vector) and a pixel lane, so its per-(b, channel) coefficients
// stay in registers and the walk needs no index division (an index per element made them ALU-bound at ~1 TB/s).
struct PixelWalk {
    int p0, p1, lanes, lane, c0;
    bool active;  // threads past lanes * (C / V) idle
};
__device__ __forceinline__ PixelWalk pixel_walk(int P, int C, int V) {
    PixelWalk t;
    t.p0 = (int)((long long)P * blockIdx.y / gridDim.y);
    t.p1 = (int)((long long)P * (blockIdx.y + 1) / gridDim.y);
    const int VC = C / V;
    t.lanes = blockDim.x / VC;
    t.lane = threadIdx.x / VC;
    t.c0 = (threadIdx.x - t.lane * VC) * V;
    t.active = t.lane < t.lanes;
    return t;
}

// y = x * coef.x + coef.y per (b, channel) (= (x - mean) * rstd * gamma + beta), then SiLU when silu; 4 pixels in
// flight a thread
template <typename T, int V>
__global__ void __launch_bounds__(256) gn_apply_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                       const float2* __restrict__ coef, int P, int C, int silu) {
    constexpr int U = 4;
    const PixelWalk t = pixel_walk(P, C, V);
    if (!t.active) return;
    float2 a[V];
#pragma unroll
    for (int k = 0; k < V; k++) a[k] = coef[(size_t)blockIdx.x * C + t.c0 + k];
    const size_t base = (size_t)blockIdx.x * P * C + t.c0;
    for (int p = t.p0 + t.lane; p < t.p1; p += U * t.lanes) {
        float v[U][V];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (p + u * t.lanes < t.p1) vload<T, V>(x + base + (size_t)(p + u * t.lanes) * C, v[u]);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (p + u * t.lanes >= t.p1) break;
#pragma unroll
            for (int k = 0; k < V; k++) {
                const float z = fmaf(v[u][k], a[k].x, a[k].y);
                v[u][k] = silu ? silu_f(z) : z;
            }
            vstore<T, V>(y + base + (size_t)(p + u * t.lanes) * C, v[u]);
        }
    }
}

// From MODE 1 partials: warps 0..C-1 dbeta, dgamma of channel c (sums over b and chunks); warps C.. per (b, g) the
// two means of the backward, k = (mean over the group of dxhat, mean of dxhat * xhat), dxhat = dz * gamma, folded
// into the apply's per-(b, channel) coefficients coef = (rstd gamma, beta, rstd^2 k.y, rstd k.x):
// z = (x - mean) coef.x + coef.y, dx = coef.x dz - coef.z (x - mean) - coef.w.
__global__ void gn_bwd_finalize_kernel(const double2* __restrict__ partial, const float* __restrict__ gamma,
                                       const float* __restrict__ beta, const float* __restrict__ rstd, float* dgamma,
                                       float* dbeta, float4* coef, int Bq, int S, int C, int G, int P) {
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (w < C) {
        double s1 = 0.0, s2 = 0.0;
        for (int i = lane; i < Bq * S; i += 32) {
            const double2 t = partial[(size_t)i * C + w];
            s1 += t.x;
            s2 += t.y;
        }
        s1 = warp_sum(s1);
        s2 = warp_sum(s2);
        if (lane == 0) {
            dbeta[w] = (float)s1;
            dgamma[w] = (float)s2;
        }
        return;
    }
    const int bg = w - C;
    if (bg >= Bq * G) return;
    const int b = bg / G, g = bg % G, cg = C / G;
    double a1 = 0.0, a2 = 0.0;
    for (int i = lane; i < S * cg; i += 32) {
        const int s = i / cg, c = g * cg + i % cg;
        const double2 t = partial[((size_t)b * S + s) * C + c];
        a1 += (double)gamma[c] * t.x;
        a2 += (double)gamma[c] * t.y;
    }
    a1 = warp_sum(a1);
    a2 = warp_sum(a2);
    const double n = (double)P * cg;
    const float kx = (float)(a1 / n), ky = (float)(a2 / n), rs = rstd[bg];
    for (int c = g * cg + lane; c < (g + 1) * cg; c += 32)
        coef[(size_t)b * C + c] = make_float4(rs * gamma[c], beta[c], rs * rs * ky, rs * kx);
}

// dx (+)= rstd * (dz*gamma - k.x - xhat * k.y) through the per-(b, channel) coefficients of gn_bwd_finalize_kernel;
// walks pixels as gn_apply_kernel does, 2 pixels in flight (three vectors each)
template <typename T, int V>
__global__ void __launch_bounds__(256) gn_bwd_apply_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                                           T* __restrict__ dx, const float* __restrict__ mean,
                                                           const float4* __restrict__ coef, int P, int C, int G,
                                                           int silu, int accumulate) {
    constexpr int U = 2;
    const PixelWalk t = pixel_walk(P, C, V);
    if (!t.active) return;
    const int b = blockIdx.x, cg = C / G;
    float4 q[V];
    float mu[V];
#pragma unroll
    for (int k = 0; k < V; k++) {
        q[k] = coef[(size_t)b * C + t.c0 + k];
        mu[k] = mean[b * G + (t.c0 + k) / cg];
    }
    const size_t base = (size_t)b * P * C + t.c0;
    for (int p = t.p0 + t.lane; p < t.p1; p += U * t.lanes) {
        float xv[U][V], dv[U][V], out[U][V];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const size_t i = base + (size_t)(p + u * t.lanes) * C;
            if (p + u * t.lanes < t.p1) {
                vload<T, V>(x + i, xv[u]);
                vload<T, V>(dy + i, dv[u]);
                if (accumulate) vload<T, V>(dx + i, out[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (p + u * t.lanes >= t.p1) break;
#pragma unroll
            for (int k = 0; k < V; k++) {
                const float xc = xv[u][k] - mu[k];
                float d = dv[u][k];
                if (silu) d *= silu_grad(fmaf(xc, q[k].x, q[k].y));
                const float v = q[k].x * d - q[k].z * xc - q[k].w;
                out[u][k] = accumulate ? out[u][k] + v : v;
            }
            vstore<T, V>(dx + base + (size_t)(p + u * t.lanes) * C, out[u]);
        }
    }
}

// out[c] (+)= sum over b and chunks (per_b = 0), or out[b*C + c] (+)= sum over chunks (per_b = 1): a warp per output
__global__ void sums_finalize_kernel(const double2* __restrict__ partial, float* out, int Bq, int S, int C, int per_b,
                                     int accumulate) {
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (w >= (per_b ? Bq * C : C)) return;
    double t = 0.0;
    if (per_b) {
        const int b = w / C, c = w % C;
        for (int s = lane; s < S; s += 32) t += partial[((size_t)b * S + s) * C + c].x;
    } else {
        for (int i = lane; i < Bq * S; i += 32) t += partial[(size_t)i * C + w].x;
    }
    t = warp_sum(t);
    if (lane == 0) out[w] = accumulate ? out[w] + (float)t : (float)t;
}

// ---------------------------------------------------------------------------------------------------------------
// elementwise kernels (V elements per thread: V channels of one pixel)

// out[m, n] += bias[n] (+ res[m, n])
template <typename T, int V>
__global__ void add_bias_kernel(T* out, const float* __restrict__ bias, const T* __restrict__ res, size_t n, int N) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= n) return;
    const int c = (int)(i % N);
    float v[V], r[V];
    vload<T, V>(out + i, v);
    if (res) vload<T, V>(res + i, r);
#pragma unroll
    for (int k = 0; k < V; k++) v[k] += bias[c + k] + (res ? r[k] : 0.f);
    vstore<T, V>(out + i, v);
}

__global__ void silu_kernel(const float* x, float* y, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = silu_f(x[i]);
}
// dx = dy * silu'(x)
__global__ void silu_backward_kernel(const float* x, const float* dy, float* dx, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dx[i] = dy[i] * silu_grad(x[i]);
}
// y (+)= x
template <typename T, int V>
__global__ void add_kernel(const T* __restrict__ x, T* __restrict__ y, size_t n, int accumulate) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= n) return;
    float v[V], o[V];
    vload<T, V>(x + i, v);
    if (accumulate) {
        vload<T, V>(y + i, o);
#pragma unroll
        for (int k = 0; k < V; k++) v[k] += o[k];
    }
    vstore<T, V>(y + i, v);
}
// y = x converted (float <-> bf16)
template <typename Tin, typename Tout>
__global__ void convert_kernel(const Tin* x, Tout* y, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_float<Tout>(to_float(x[i]));
}

// The resblocks' emb_layers (Linear(E, cout) on silu(emb), fp32 in every precision) of all layers at once: they
// read the same emb_s, so one launch each way replaces a GEMM, a bias and two reductions per layer. Row r of the
// layers' concatenated outputs belongs to the table entry whose [row0, row0 + cout) holds it.
struct EmbRow {
    int row0, cout;
    long long w, b;   // parameter offsets
    float *out, *dout;  // (B, cout) of the layer: embo, d_embo
};
__device__ __forceinline__ int emb_entry(const EmbRow* tab, int n, int r) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tab[mid].row0 <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
// out_l[b][o] = emb_s[b] . W_l[o] + bias_l[o]: a warp per concatenated row (l, o), lanes over E, all B samples
__global__ void emb_layers_forward_kernel(const float* __restrict__ p, const float* __restrict__ emb_s,
                                          const EmbRow* __restrict__ tab, int n, int rows, int B, int E) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const EmbRow e = tab[emb_entry(tab, n, r)];
    const int o = r - e.row0;
    const float* w = p + e.w + (size_t)o * E;
    for (int b = 0; b < B; b++) {
        float acc = 0.f;
        for (int k = lane; k < E; k += 32) acc = fmaf(emb_s[(size_t)b * E + k], w[k], acc);
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
        if (lane == 0) e.out[(size_t)b * e.cout + o] = acc + p[e.b + o];
    }
}
// dW_l[o][k] = sum_b dout_l[b][o] emb_s[b][k], db_l[o] = sum_b dout_l[b][o]: a warp per row (l, o) of rows
// [row0, rows), lanes over E
__global__ void emb_layers_weight_grad_kernel(float* __restrict__ g, const float* __restrict__ emb_s,
                                              const EmbRow* __restrict__ tab, int n, int row0, int rows, int B,
                                              int E) {
    const int r = row0 + (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const EmbRow e = tab[emb_entry(tab, n, r)];
    const int o = r - e.row0;
    for (int k = lane; k < E; k += 32) {
        float acc = 0.f;
        for (int b = 0; b < B; b++) acc = fmaf(e.dout[(size_t)b * e.cout + o], emb_s[(size_t)b * E + k], acc);
        g[e.w + (size_t)o * E + k] = acc;
    }
    if (lane == 0) {
        float acc = 0.f;
        for (int b = 0; b < B; b++) acc += e.dout[(size_t)b * e.cout + o];
        g[e.b + o] = acc;
    }
}
// d_emb_s[b][k] = sum over every layer l and row o of dout_l[b][o] W_l[o][k]: block (sample b, 32 columns k), its
// 8 warps take every 8th row of each layer (independent loads in flight), and the warps' sums are added in order
__global__ void emb_layers_input_grad_kernel(const float* __restrict__ p, float* __restrict__ d_emb_s,
                                             const EmbRow* __restrict__ tab, int n, int E) {
    __shared__ float part[8][32];
    const int b = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, k = blockIdx.x * 32 + lane;
    float acc = 0.f;
    if (k < E)
        for (int l = 0; l < n; l++) {
            const EmbRow e = tab[l];
            const float* d = e.dout + (size_t)b * e.cout;
            const float* w = p + e.w + k;
#pragma unroll 4
            for (int o = warp; o < e.cout; o += 8) acc = fmaf(d[o], w[(size_t)o * E], acc);
        }
    part[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && k < E) {
        float t = 0.f;
        for (int w = 0; w < 8; w++) t += part[w][lane];
        d_emb_s[(size_t)b * E + k] = t;
    }
}

// emb (B, dim) = cat[cos(t*f), sin(t*f)], f_k = exp(-ln(10000) * k / half), as dev/unet.py timestep_embedding
__global__ void timestep_embedding_kernel(const int* t, float* emb, int B, int dim) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B * dim) return;
    int b = i / dim, j = i % dim, half = dim / 2;
    float v = 0.f;
    if (j < 2 * half) {
        int k = j < half ? j : j - half;
        float e = (-9.210340371976184f * (float)k) / (float)half;  // -ln(10000) in float, as PyTorch
        float arg = (float)t[b] * expf(e);
        v = j < half ? cosf(arg) : sinf(arg);
    }
    emb[i] = v;
}

// cat (B, P, C1+C2) = [a (B, P, C1), b (B, P, C2)]; V divides C1 and C2
template <typename T, int V>
__global__ void concat_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, size_t BP,
                              int C1, int C2) {
    const int C = C1 + C2;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= BP * C) return;
    const size_t p = i / C;
    const int c = (int)(i % C);
    float v[V];
    vload<T, V>(c < C1 ? a + p * C1 + c : b + p * C2 + c - C1, v);
    vstore<T, V>(out + i, v);
}
// da (+)= dcat[:, :C1], db (+)= dcat[:, C1:]; V divides C1 and C2
template <typename T, int V>
__global__ void split_backward_kernel(const T* __restrict__ dcat, T* __restrict__ da, T* __restrict__ db, size_t BP,
                                      int C1, int C2, int acc_a, int acc_b) {
    const int C = C1 + C2;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= BP * C) return;
    const size_t p = i / C;
    const int c = (int)(i % C);
    T* dst = c < C1 ? da + p * C1 + c : db + p * C2 + c - C1;
    const int acc = c < C1 ? acc_a : acc_b;
    float v[V], o[V];
    vload<T, V>(dcat + i, v);
    if (acc) {
        vload<T, V>(dst, o);
#pragma unroll
        for (int k = 0; k < V; k++) v[k] += o[k];
    }
    vstore<T, V>(dst, v);
}
// nearest x2: out (B, 2H, 2W, C) from x (B, H, W, C); V divides C
template <typename T, int V>
__global__ void upsample_kernel(const T* __restrict__ x, T* __restrict__ out, int B, int H, int W, int C) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= (size_t)B * 4 * H * W * C) return;
    const int c = (int)(i % C);
    const size_t p = i / C;
    const int ox = (int)(p % (2 * W)), oy = (int)((p / (2 * W)) % (2 * H)), b = (int)(p / (4 * (size_t)H * W));
    float v[V];
    vload<T, V>(x + (((size_t)b * H + oy / 2) * W + ox / 2) * C + c, v);
    vstore<T, V>(out + i, v);
}
// dx (+)= sum of the 2x2 block of dout; V divides C
template <typename T, int V>
__global__ void upsample_backward_kernel(const T* __restrict__ dout, T* __restrict__ dx, int B, int H, int W, int C,
                                         int accumulate) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * V;
    if (i >= (size_t)B * H * W * C) return;
    const int c = (int)(i % C);
    const size_t p = i / C;
    const int x = (int)(p % W), y = (int)((p / W) % H), b = (int)(p / ((size_t)H * W));
    const T* d = dout + (((size_t)b * 2 * H + 2 * y) * 2 * W + 2 * x) * C + c;
    const size_t row = (size_t)2 * W * C;
    float d0[V], d1[V], d2[V], d3[V], o[V];
    vload<T, V>(d, d0);
    vload<T, V>(d + C, d1);
    vload<T, V>(d + row, d2);
    vload<T, V>(d + row + C, d3);
    if (accumulate) vload<T, V>(dx + i, o);
#pragma unroll
    for (int k = 0; k < V; k++) {
        const float v = (d0[k] + d1[k]) + (d2[k] + d3[k]);
        o[k] = accumulate ? o[k] + v : v;
    }
    vstore<T, V>(dx + i, o);
}

// Attention softmax and its backward: the softmax lab's short-row kernels (promoted from dev/softmax_forward.cu
// version 4 and dev/softmax_backward.cu version 3, unchanged): GROUP lanes per row, the row held in registers as
// CHUNKS float4 per lane, one read and one write. Rows run in the 16-byte frame of their address: full chunks move
// as float4, the first and last (partial) chunks element by element, so any L and alignment work. In place is
// safe (each row is read entirely into registers before it is written).
#define SOFTMAX_FULL_MASK 0xffffffffu
template <int GROUP>
__device__ __forceinline__ float softmax_group_max(float v) {
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SOFTMAX_FULL_MASK, v, o));
    return v;
}
template <int GROUP>
__device__ __forceinline__ float softmax_group_sum(float v) {
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(SOFTMAX_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ int softmax_row_offset(const float* p) { return (int)(((uintptr_t)p >> 2) & 3); }
// chunk c of a row: elements [4c - off, 4c - off + 4); elements outside the row read as pad
__device__ __forceinline__ float4 softmax_load_chunk(const float* row, int n, int off, int c, bool vec, float pad) {
    int lo = 4 * c - off;
    if (vec && lo >= 0 && lo + 4 <= n) return *reinterpret_cast<const float4*>(row + lo);
    float4 v;
    v.x = (unsigned)(lo + 0) < (unsigned)n ? row[lo + 0] : pad;
    v.y = (unsigned)(lo + 1) < (unsigned)n ? row[lo + 1] : pad;
    v.z = (unsigned)(lo + 2) < (unsigned)n ? row[lo + 2] : pad;
    v.w = (unsigned)(lo + 3) < (unsigned)n ? row[lo + 3] : pad;
    return v;
}
__device__ __forceinline__ void softmax_store_chunk(float* row, int n, int off, int c, bool vec, float4 v) {
    int lo = 4 * c - off;
    if (vec && lo >= 0 && lo + 4 <= n) { *reinterpret_cast<float4*>(row + lo) = v; return; }
    if ((unsigned)(lo + 0) < (unsigned)n) row[lo + 0] = v.x;
    if ((unsigned)(lo + 1) < (unsigned)n) row[lo + 1] = v.y;
    if ((unsigned)(lo + 2) < (unsigned)n) row[lo + 2] = v.z;
    if ((unsigned)(lo + 3) < (unsigned)n) row[lo + 3] = v.w;
}

// softmax over rows: y (rows, cols) = softmax(x) (dev/softmax_forward.cu version 4). -inf entries give exact zeros.
template <int GROUP, int CHUNKS>
__global__ void __launch_bounds__(1024) softmax_forward_kernel4(float* y, const float* x, int rows, int cols) {
    static_assert(GROUP >= 1 && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0, "a group is a power-of-2 part of a warp");
    int r = blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
    int g = threadIdx.x % GROUP;
    int n = r < rows ? cols : 0;  // no early return: the whole warp takes part in the shuffles
    const float* xr = x + (size_t)(r < rows ? r : 0) * cols;
    float* yr = y + (size_t)(r < rows ? r : 0) * cols;
    int off = softmax_row_offset(xr);
    bool vec_y = softmax_row_offset(yr) == off;
    float4 v[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) v[k] = softmax_load_chunk(xr, n, off, g + GROUP * k, true, -INFINITY);
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) m = fmaxf(m, fmaxf(fmaxf(v[k].x, v[k].y), fmaxf(v[k].z, v[k].w)));
    m = softmax_group_max<GROUP>(m);
    float ms = (m == -INFINITY) ? 0.0f : m, s = 0.0f;
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        v[k].x = expf(v[k].x - ms); v[k].y = expf(v[k].y - ms);
        v[k].z = expf(v[k].z - ms); v[k].w = expf(v[k].w - ms);
        s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    }
    s = softmax_group_sum<GROUP>(s);
    float f = 1.0f / s;
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        v[k].x *= f; v[k].y *= f; v[k].z *= f; v[k].w *= f;
        softmax_store_chunk(yr, n, off, g + GROUP * k, vec_y, v[k]);
    }
}
// dx = y * (dy - sum(y * dy)) over rows (dev/softmax_backward.cu version 3)
template <int GROUP, int CHUNKS>
__global__ void softmax_backward_kernel3(float* dx, const float* y, const float* dy, int rows, int cols) {
    static_assert(GROUP >= 1 && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0, "a group is a power-of-2 part of a warp");
    int r = blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
    int g = threadIdx.x % GROUP;
    int n = r < rows ? cols : 0;  // no early return: the whole warp takes part in the shuffles
    size_t base = (size_t)(r < rows ? r : 0) * cols;
    int off = softmax_row_offset(y + base);
    bool vec_dy = softmax_row_offset(dy + base) == off, vec_dx = softmax_row_offset(dx + base) == off;
    float4 a[CHUNKS], b[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        a[k] = softmax_load_chunk(y + base, n, off, g + GROUP * k, true, 0.0f);
        b[k] = softmax_load_chunk(dy + base, n, off, g + GROUP * k, vec_dy, 0.0f);
    }
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) dot += (a[k].x * b[k].x + a[k].y * b[k].y) + (a[k].z * b[k].z + a[k].w * b[k].w);
    dot = softmax_group_sum<GROUP>(dot);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        b[k].x = a[k].x * (b[k].x - dot); b[k].y = a[k].y * (b[k].y - dot);
        b[k].z = a[k].z * (b[k].z - dot); b[k].w = a[k].w * (b[k].w - dot);
        softmax_store_chunk(dx + base, n, off, g + GROUP * k, vec_dx, b[k]);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Fused attention core (--precision bf16; dev/attention.cu version 2): a = softmax(Q K^T / sqrt(D)) V per (sample,
// head) over qkv (B, L, 3C) in the legacy channel order (head h: q, k, v at channels 3Dh, 3Dh + D, 3Dh + 2D), for
// L <= ATT_LMAX tokens and head width D = 16, 32 or 64. Tensor cores through mma.sync m16n8k16 (bf16 operands,
// fp32 accumulation); a warp owns 16 rows and keeps their scores in registers, where an accumulator tile of S is
// already an operand tile of P (flash attention's register reuse); the pair's K and V (and Q, dO in the backward)
// sit in shared memory with rows padded to D + 8 elements, so the ldmatrix row reads hit distinct banks. The
// forward keeps each row's log-sum-exp; the backward recomputes P from it without atomics: attn_bwd_dq_kernel over
// query rows (D_i = rowsum(dO O), dQ), then attn_bwd_dkv_kernel over key rows (dK, dV). Probabilities and dS are
// rounded to bf16 as operands, as in flash attention and PyTorch's bf16 paths.
constexpr int ATT_LMAX = 256, ATT_ROWS = 64;  // tokens at most; rows per block (4 warps x 16)

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ldmatrix x4: lane l addresses row l % 8 of matrix l / 8; register i holds matrix i (transposed with .trans)
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
// Fragment addressing (g = lane / 4, t = lane % 4, i = lane / 8): an A tile (16 rows x 16 k) from row-major rows:
// row + lane % 8 + 8 (i % 2), k + 8 (i / 2). B tiles of two n8 blocks from rows holding n (K for S = Q K^T):
// n + lane % 8 + 8 (i / 2), k + 8 (i % 2) -> b0, b1 of block 0, b0, b1 of block 1. B tiles from rows holding k
// (V for P V), with .trans: k + lane % 8 + 8 (i % 2), n + 8 (i / 2). Accumulator: c0, c1 row g, columns 2t, 2t+1;
// c2, c3 row g + 8. An A operand from two accumulator blocks (j, j+1 over k): {c0c1 of j, c2c3 of j, c0c1 of j+1,
// c2c3 of j+1}.
template <int LD>
__device__ __forceinline__ const bf16* frag_a(const bf16* s, int row, int k, int lane) {
    return s + (row + lane % 8 + 8 * ((lane / 8) % 2)) * LD + k + 8 * (lane / 16);
}
template <int LD>
__device__ __forceinline__ const bf16* frag_b_nrows(const bf16* s, int n, int k, int lane) {
    return s + (n + lane % 8 + 8 * (lane / 16)) * LD + k + 8 * ((lane / 8) % 2);
}
template <int LD>
__device__ __forceinline__ const bf16* frag_b_krows(const bf16* s, int k, int n, int lane) {
    return s + (k + lane % 8 + 8 * ((lane / 8) % 2)) * LD + n + 8 * (lane / 16);
}
// rows [r0, r0 + n) of one head's D channels (row stride `stride` elements) into shared rows of LD, zeros past L
template <int D, int LD>
__device__ __forceinline__ void att_stage(bf16* dst, const bf16* src, size_t stride, int r0, int n, int L) {
    for (int i = threadIdx.x; i < n * (D / 8); i += blockDim.x) {
        const int r = i / (D / 8), c = (i % (D / 8)) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r0 + r < L) v = *reinterpret_cast<const uint4*>(src + (size_t)(r0 + r) * stride + c);
        *reinterpret_cast<uint4*>(dst + r * LD + c) = v;
    }
}

// out (B, L, C) = softmax(Q K^T scale) V for rows blockIdx.y * 64.. of pair blockIdx.x; lse (B*heads, L)
template <int D>
__global__ void __launch_bounds__(128) attn_fwd_kernel(const bf16* __restrict__ qkv, bf16* __restrict__ out,
                                                       float* __restrict__ lse, int L, int heads, float scale) {
    constexpr int LD = D + 8, NT = ATT_LMAX / 8;
    extern __shared__ __align__(16) bf16 att_smem[];
    const int Lp = (L + 15) / 16 * 16, C = heads * D, bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int q0 = blockIdx.y * ATT_ROWS;
    bf16 *Ks = att_smem, *Vs = Ks + Lp * LD, *Qs = Vs + Lp * LD;
    const bf16* base = qkv + (size_t)b * L * 3 * C + h * 3 * D;
    att_stage<D, LD>(Ks, base + D, 3 * C, 0, Lp, L);
    att_stage<D, LD>(Vs, base + 2 * D, 3 * C, 0, Lp, L);
    att_stage<D, LD>(Qs, base, 3 * C, q0, ATT_ROWS, L);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = warp * 16;
    if (q0 + r0 >= L) return;
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) ldsm_x4(qa[ks], frag_a<LD>(Qs, r0, 16 * ks, lane));
    float s[NT][4];
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {  // S = Q K^T scale, keys past L at -inf
        if (nt * 8 >= Lp) break;
#pragma unroll
        for (int e = 0; e < 4; e++) s[nt][e] = s[nt + 1][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            uint32_t kb[4];
            ldsm_x4(kb, frag_b_nrows<LD>(Ks, nt * 8, 16 * ks, lane));
            mma_16816(s[nt], qa[ks], kb[0], kb[1]);
            mma_16816(s[nt + 1], qa[ks], kb[2], kb[3]);
        }
#pragma unroll
        for (int j = nt; j < nt + 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const bool in = j * 8 + 2 * t + (e & 1) < L;
                s[j][e] = in ? s[j][e] * scale : -INFINITY;
                if (e < 2) mx0 = fmaxf(mx0, s[j][e]);
                else mx1 = fmaxf(mx1, s[j][e]);
            }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    float sum0 = 0.f, sum1 = 0.f, o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[nd][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {  // P = exp(S - max), O += P V over 16 keys at a time
        if (nt * 8 >= Lp) break;
#pragma unroll
        for (int j = nt; j < nt + 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[j][e] = __expf(s[j][e] - (e < 2 ? mx0 : mx1));
                if (e < 2) sum0 += s[j][e];
                else sum1 += s[j][e];
            }
        const uint32_t pa[4] = {pack_bf16(s[nt][0], s[nt][1]), pack_bf16(s[nt][2], s[nt][3]),
                                pack_bf16(s[nt + 1][0], s[nt + 1][1]), pack_bf16(s[nt + 1][2], s[nt + 1][3])};
#pragma unroll
        for (int nd = 0; nd < D / 8; nd += 2) {
            uint32_t vb[4];
            ldsm_x4_t(vb, frag_b_krows<LD>(Vs, nt * 8, nd * 8, lane));
            mma_16816(o[nd], pa, vb[0], vb[1]);
            mma_16816(o[nd + 1], pa, vb[2], vb[3]);
        }
    }
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int q = q0 + r0 + g + 8 * hr;
        if (q >= L) continue;
        const float inv = 1.f / (hr ? sum1 : sum0);
        bf16* orow = out + ((size_t)b * L + q) * C + h * D;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++)
            *reinterpret_cast<uint32_t*>(orow + nd * 8 + 2 * t) =
                pack_bf16(o[nd][2 * hr] * inv, o[nd][2 * hr + 1] * inv);
        if (t == 0) lse[(size_t)bh * L + q] = (hr ? mx1 : mx0) + logf(hr ? sum1 : sum0);
    }
}

// Backward over query rows: Di = rowsum(dO O) (stored for attn_bwd_dkv_kernel), dQ = scale dS K with
// dS = P (dO V^T - Di), P recomputed from lse, 16 keys at a time
template <int D>
__global__ void __launch_bounds__(128) attn_bwd_dq_kernel(const bf16* __restrict__ qkv, const bf16* __restrict__ out,
                                                          const bf16* __restrict__ dout, const float* __restrict__ lse,
                                                          float* __restrict__ Di, bf16* __restrict__ dqkv, int L,
                                                          int heads, float scale) {
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) bf16 att_smem[];
    const int Lp = (L + 15) / 16 * 16, C = heads * D, bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int q0 = blockIdx.y * ATT_ROWS;
    bf16 *Ks = att_smem, *Vs = Ks + Lp * LD, *Qs = Vs + Lp * LD, *dOs = Qs + ATT_ROWS * LD;
    const bf16* base = qkv + (size_t)b * L * 3 * C + h * 3 * D;
    att_stage<D, LD>(Ks, base + D, 3 * C, 0, Lp, L);
    att_stage<D, LD>(Vs, base + 2 * D, 3 * C, 0, Lp, L);
    att_stage<D, LD>(Qs, base, 3 * C, q0, ATT_ROWS, L);
    att_stage<D, LD>(dOs, dout + (size_t)b * L * C + h * D, C, q0, ATT_ROWS, L);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = warp * 16;
    if (q0 + r0 >= L) return;
    float di[2], ls[2];
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {  // Di from the rows' O and dO (each lane of a quad: D / 4 channels)
        const int q = min(q0 + r0 + g + 8 * hr, L - 1);
        const bf16* orow = out + ((size_t)b * L + q) * C + h * D;
        const bf16* drow = dOs + (r0 + g + 8 * hr) * LD;
        float acc = 0.f;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            const float2 ov = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(orow + nd * 8 + 2 * t));
            const float2 dv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(drow + nd * 8 + 2 * t));
            acc += ov.x * dv.x + ov.y * dv.y;
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        di[hr] = acc;
        ls[hr] = lse[(size_t)bh * L + q];
        if (t == 0 && q0 + r0 + g + 8 * hr < L) Di[(size_t)bh * L + q] = acc;
    }
    uint32_t qa[D / 16][4], da[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        ldsm_x4(qa[ks], frag_a<LD>(Qs, r0, 16 * ks, lane));
        ldsm_x4(da[ks], frag_a<LD>(dOs, r0, 16 * ks, lane));
    }
    float dq[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq[nd][e] = 0.f;
    for (int k0 = 0; k0 < Lp; k0 += 16) {
        float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            uint32_t kb[4], vb[4];
            ldsm_x4(kb, frag_b_nrows<LD>(Ks, k0, 16 * ks, lane));
            ldsm_x4(vb, frag_b_nrows<LD>(Vs, k0, 16 * ks, lane));
            mma_16816(s[0], qa[ks], kb[0], kb[1]);
            mma_16816(s[1], qa[ks], kb[2], kb[3]);
            mma_16816(dp[0], da[ks], vb[0], vb[1]);
            mma_16816(dp[1], da[ks], vb[2], vb[3]);
        }
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {  // dS = P (dP - Di), keys past L give P = 0
                const bool in = k0 + 8 * j + 2 * t + (e & 1) < L;
                const float p = in ? __expf(s[j][e] * scale - ls[e / 2]) : 0.f;
                s[j][e] = p * (dp[j][e] - di[e / 2]);
            }
        const uint32_t sa[4] = {pack_bf16(s[0][0], s[0][1]), pack_bf16(s[0][2], s[0][3]), pack_bf16(s[1][0], s[1][1]),
                                pack_bf16(s[1][2], s[1][3])};
#pragma unroll
        for (int nd = 0; nd < D / 8; nd += 2) {
            uint32_t kb[4];
            ldsm_x4_t(kb, frag_b_krows<LD>(Ks, k0, nd * 8, lane));
            mma_16816(dq[nd], sa, kb[0], kb[1]);
            mma_16816(dq[nd + 1], sa, kb[2], kb[3]);
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int q = q0 + r0 + g + 8 * hr;
        if (q >= L) continue;
        bf16* row = dqkv + ((size_t)b * L + q) * 3 * C + h * 3 * D;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++)
            *reinterpret_cast<uint32_t*>(row + nd * 8 + 2 * t) = pack_bf16(dq[nd][2 * hr] * scale,
                                                                            dq[nd][2 * hr + 1] * scale);
    }
}

// Backward over key rows: dV = P^T dO, dK = scale dS^T Q, P^T and dS^T recomputed from lse and Di, 16 queries at a
// time
template <int D>
__global__ void __launch_bounds__(128) attn_bwd_dkv_kernel(const bf16* __restrict__ qkv,
                                                           const bf16* __restrict__ dout, const float* __restrict__ lse,
                                                           const float* __restrict__ Di, bf16* __restrict__ dqkv,
                                                           int L, int heads, float scale) {
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) bf16 att_smem[];
    const int Lp = (L + 15) / 16 * 16, C = heads * D, bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int k0b = blockIdx.y * ATT_ROWS;
    bf16 *Qs = att_smem, *dOs = Qs + Lp * LD, *Ks = dOs + Lp * LD, *Vs = Ks + ATT_ROWS * LD;
    float* lse_s = reinterpret_cast<float*>(Vs + ATT_ROWS * LD);
    float* di_s = lse_s + Lp;
    const bf16* base = qkv + (size_t)b * L * 3 * C + h * 3 * D;
    att_stage<D, LD>(Qs, base, 3 * C, 0, Lp, L);
    att_stage<D, LD>(dOs, dout + (size_t)b * L * C + h * D, C, 0, Lp, L);
    att_stage<D, LD>(Ks, base + D, 3 * C, k0b, ATT_ROWS, L);
    att_stage<D, LD>(Vs, base + 2 * D, 3 * C, k0b, ATT_ROWS, L);
    for (int i = threadIdx.x; i < Lp; i += blockDim.x) {
        lse_s[i] = i < L ? lse[(size_t)bh * L + i] : 0.f;
        di_s[i] = i < L ? Di[(size_t)bh * L + i] : 0.f;
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = warp * 16;
    if (k0b + r0 >= L) return;
    uint32_t ka[D / 16][4], va[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        ldsm_x4(ka[ks], frag_a<LD>(Ks, r0, 16 * ks, lane));
        ldsm_x4(va[ks], frag_a<LD>(Vs, r0, 16 * ks, lane));
    }
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[nd][e] = dv[nd][e] = 0.f;
    for (int qb = 0; qb < Lp; qb += 16) {
        float st[2][4] = {}, dpt[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            uint32_t qbf[4], db[4];
            ldsm_x4(qbf, frag_b_nrows<LD>(Qs, qb, 16 * ks, lane));
            ldsm_x4(db, frag_b_nrows<LD>(dOs, qb, 16 * ks, lane));
            mma_16816(st[0], ka[ks], qbf[0], qbf[1]);
            mma_16816(st[1], ka[ks], qbf[2], qbf[3]);
            mma_16816(dpt[0], va[ks], db[0], db[1]);
            mma_16816(dpt[1], va[ks], db[2], db[3]);
        }
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {  // P^T (queries past L: 0) and dS^T = P^T (dP^T - Di)
                const int q = qb + 8 * j + 2 * t + (e & 1);
                const float p = q < L ? __expf(st[j][e] * scale - lse_s[q]) : 0.f;
                st[j][e] = p;
                dpt[j][e] = p * (dpt[j][e] - di_s[q]);
            }
        const uint32_t pa[4] = {pack_bf16(st[0][0], st[0][1]), pack_bf16(st[0][2], st[0][3]),
                                pack_bf16(st[1][0], st[1][1]), pack_bf16(st[1][2], st[1][3])};
        const uint32_t sa[4] = {pack_bf16(dpt[0][0], dpt[0][1]), pack_bf16(dpt[0][2], dpt[0][3]),
                                pack_bf16(dpt[1][0], dpt[1][1]), pack_bf16(dpt[1][2], dpt[1][3])};
#pragma unroll
        for (int nd = 0; nd < D / 8; nd += 2) {
            uint32_t db[4], qbf[4];
            ldsm_x4_t(db, frag_b_krows<LD>(dOs, qb, nd * 8, lane));
            ldsm_x4_t(qbf, frag_b_krows<LD>(Qs, qb, nd * 8, lane));
            mma_16816(dv[nd], pa, db[0], db[1]);
            mma_16816(dv[nd + 1], pa, db[2], db[3]);
            mma_16816(dk[nd], sa, qbf[0], qbf[1]);
            mma_16816(dk[nd + 1], sa, qbf[2], qbf[3]);
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int k = k0b + r0 + g + 8 * hr;
        if (k >= L) continue;
        bf16* row = dqkv + ((size_t)b * L + k) * 3 * C + h * 3 * D;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            *reinterpret_cast<uint32_t*>(row + D + nd * 8 + 2 * t) = pack_bf16(dk[nd][2 * hr] * scale,
                                                                                dk[nd][2 * hr + 1] * scale);
            *reinterpret_cast<uint32_t*>(row + 2 * D + nd * 8 + 2 * t) = pack_bf16(dv[nd][2 * hr], dv[nd][2 * hr + 1]);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// diffusion, loss, data

// x0 (B, H, W, 3) in [-1, 1] from uint8 images; code[b] = image index * 2 + horizontal flip
__global__ void load_batch_kernel(const uint8_t* images, const int* code, float* x0, int B, int H, int W) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * H * W * 3) return;
    int c = (int)(i % 3);
    size_t p = i / 3;
    int x = (int)(p % W), y = (int)((p / W) % H), b = (int)(p / ((size_t)H * W));
    int img = code[b] >> 1, flip = code[b] & 1;
    int sx = flip ? W - 1 - x : x;
    x0[i] = (float)images[(((size_t)img * H + y) * W + sx) * 3 + c] / 127.5f - 1.0f;
}
// x_t = sqrt(acp[t]) x0 + sqrt(1 - acp[t]) noise, rounded as PyTorch's two products and a sum
template <typename T>
__global__ void q_sample_kernel(const float* x0, const float* noise, const int* t, const float* sa, const float* sb,
                                T* xt, int B, int per) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * per) return;
    int ti = t[i / per];
    xt[i] = from_float<T>(__fadd_rn(__fmul_rn(sa[ti], x0[i]), __fmul_rn(sb[ti], noise[i])));
}
// per-block partial sums of (out - target)^2, and dout = 2 (out - target) / n
template <typename T>
__global__ void mse_kernel(const T* out, const float* target, T* dout, double* partial, size_t n) {
    __shared__ double red[256];
    double s = 0.0;
    float scale = 2.0f / (float)n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float d = to_float(out[i]) - target[i];
        s += (double)d * d;
        dout[i] = from_float<T>(scale * d);
    }
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o /= 2) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = red[0];
}
// per_sample[b] = mean over the sample's per elements of (out - target)^2 (the evaluation loss); a block per sample
template <typename T>
__global__ void sample_mse_kernel(const T* out, const float* target, float* per_sample, int per) {
    __shared__ double red[256];
    double s = 0.0;
    for (int i = threadIdx.x; i < per; i += blockDim.x) {
        const size_t j = (size_t)blockIdx.x * per + i;
        const float d = to_float(out[j]) - target[j];
        s += (double)d * d;
    }
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o /= 2) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) per_sample[blockIdx.x] = (float)(red[0] / per);
}
__global__ void loss_finalize_kernel(const double* partial, int nblocks, size_t n, float* loss) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double s = 0.0;
    for (int i = 0; i < nblocks; i++) s += partial[i];
    *loss = (float)(s / (double)n);
}

// AdamW's per-step scalars on the device (so a captured CUDA graph replays correctly): t += 1, then
// hyper = (lr / (1 - beta1^t), sqrt(1 - beta2^t)) in double, as PyTorch computes them on the host, and the EMA
// decay of step t: min(ema_rate, (1 + t) / (10 + t)) (the warm-up of TensorFlow's ExponentialMovingAverage with
// num_updates and of diffusers' EMAModel). Without it the EMA keeps ema_rate^t of the initial weights, in which
// the output layers are zero: the EMA model's epsilon came out scaled by ~(1 - 0.999^t) (0.92 at step 2500, 0.98 at
// 4000), harmless to DDPM but fatal to DDIM, whose x0 = (x - sqrt(1 - acp) eps) / sqrt(acp) turns a 2% shortfall at
// t = 980 (sqrt(acp) = 0.009) into |x0| ~ 2|x|: clipped, saturated noise (dev/unet_NOTES.md, "DDIM").
__host__ __device__ inline void adam_hyper(int step, float* hyper, float lr, float beta1, float beta2,
                                           float ema_rate) {
    double bc1 = 1.0 - pow((double)beta1, (double)step), bc2 = 1.0 - pow((double)beta2, (double)step);
    hyper[0] = (float)((double)lr / bc1);
    hyper[1] = (float)sqrt(bc2);
    hyper[2] = (float)fmin((double)ema_rate, (1.0 + step) / (10.0 + step));
}
__global__ void adam_prep_kernel(int* t, float* hyper, float lr, float beta1, float beta2, float ema_rate) {
    if (threadIdx.x == 0 && blockIdx.x == 0) adam_hyper(++t[0], hyper, lr, beta1, beta2, ema_rate);
}

// torch.optim.AdamW (foreach form): m.lerp_(g, 1-b1); v = b2 v + (1-b2) g^2; p *= 1 - lr wd;
// p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps), step_size = lr / bc1; then ema = d ema + (1-d) p, d = hyper[2]
// (element i; also the AdamW part of --optimizer muon, on either side)
__host__ __device__ inline void adamw_elem(float* p, const float* g, float* m, float* v, float* ema, size_t i,
                                           float beta1, float beta2, float lr_wd, float eps, const float* hyper) {
    const float step_size = hyper[0], bc2_sqrt = hyper[1];
    float gi = g[i];
    float mi = m[i] + (1.0f - beta1) * (gi - m[i]);
    float vi = v[i] * beta2 + (1.0f - beta2) * gi * gi;
    float pi = p[i];
    if (lr_wd != 0.f) pi *= 1.0f - lr_wd;
    pi -= step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (ema) {
        const float d = hyper[2];
        ema[i] = d * ema[i] + (1.0f - d) * pi;
    }
}
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, float* ema, size_t n, float beta1,
                             float beta2, float lr_wd, float eps, const float* hyper) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) adamw_elem(p, g, m, v, ema, i, beta1, beta2, lr_wd, eps, hyper);
}

// ---------------------------------------------------------------------------------------------------------------
// Muon (--optimizer muon): torch.optim.Muon (PyTorch 2.11) for every convolution and linear weight, taken as
// PyTorch's 2-D view rows x cols = (out, in*kh*kw); AdamW (above) for the biases and GroupNorm. Per weight:
//   buf = lerp(buf, g, 1 - mu); u = lerp(g, buf, mu) (Nesterov) or buf; X = u / max(||u||_F, 1e-7);
//   ns_steps of X <- a X + (b A + c A^2) X, A = X X^T, (a, b, c) = (3.4445, -4.7750, 2.0315), on the wide
//   orientation (torch transposes a tall matrix); w <- w (1 - lr wd) - lr sqrt(max(1, rows / cols)) X.
// Each step is three products as torch computes it: A = X X^T, B = c A A + b A, X' = B X + a X (the sums ride on the
// product's beta with a separate output, so no elementwise pass). The matrices of a group sit side by side in the group
// buffers, each zero-padded to the group's m_pad x M_pad (the wide orientation, column-major). bf16: groups are shapes,
// and each product of a phase (consecutive groups) is one muon_mm_kernel over all its matrices (the m x m ones on
// muon_sq_wgmma_kernel with sm_90a); fp32: a group is one strided-batched cuBLASLt product per step. With the overlap
// on, a phase's Newton-Schulz runs on a side stream as soon as the backward pass has finished its members' gradients
// (muon_grads_ready). Zero rows and columns are exact: they leave A's other entries, the norm and the result's other
// entries unchanged. A 3x3 conv weight, stored [tap][cin][cout], is read as the column-major (cout, 9 cin) matrix whose
// columns are PyTorch's in another order; Newton-Schulz commutes with a permutation of the columns (A = X X^T does not
// see it), so the update comes out in the same permuted order and goes back to where it was read from. Each elementwise
// pass is a functor that muon_each runs on the GPU, or as a loop on the CPU (dev/test_unet.cu checks the step there in
// CI).
// --muon_ns gram: the same polynomial on the m x m Gram matrix (the Gram Newton-Schulz of Dao-AILab, 2026):
// R = X X^T; per step Z = a I + b R + c R^2, Q <- Z Q, R <- Z R Z; X <- Q X only where R is rebuilt from X (a
// restart, before steps 2, 5, 8, ..., which keeps the half-precision error from compounding) and at the end. Equal to
// the standard form in exact arithmetic; the products on X (the M-long dimension) drop from 2 per step to 2 per
// restart. In fp16 with --precision bf16 (more mantissa than bf16: closer to the fp32 iteration than torch's bf16).
constexpr float MUON_A = 3.4445f, MUON_B = -4.7750f, MUON_C = 2.0315f, MUON_EPS = 1e-7f;
struct MuonMat {      // one weight matrix
    size_t p_off;     // its first float in the parameters (our layout)
    size_t w_off;     // its first element in the group buffers (m_pad * M_pad of them)
    int rows, cols;   // PyTorch's 2-D view (out, in*kh*kw)
    int m_pad, conv;  // the group's padded small dimension (the leading dimension); conv: stored as a 3x3 conv
    int M_pad;        // the group's padded large dimension
    size_t s_off;     // its first element in the m_pad x m_pad scratch
    float step;       // lr * sqrt(max(1, rows / cols)), rounded once (torch's adjusted lr)
};
struct MuonGroup {    // matrices of one padded shape: one strided batch
    int m_pad, M_pad, count;
    size_t w_off, s_off;  // the first matrix in the group buffers and in the m_pad x m_pad scratch
    int first_mat;        // its matrices are mats[first_mat .. first_mat + count - 1]
    int ready;            // the backward stage (muon_plan) after which all their gradients are final
    int phase;            // the phase it runs in: consecutive groups started together (muon_plan)
};
// The parameter index that element e of matrix k's padded wide matrix (column-major, m_pad rows) comes from, or -1
// for padding. PyTorch's (r, c): wide (rows <= cols) r = i, c = j; tall: transposed. Ours: a plain weight is
// PyTorch's layout (r * cols + c); a conv's column c is our (tap, cin) order, column-major: c * rows + r.
__host__ __device__ inline long long muon_src_ij(const MuonMat& k, int i, int j) {
    const bool wide = k.rows <= k.cols;
    const int m = wide ? k.rows : k.cols, M = wide ? k.cols : k.rows;
    if (i >= m || j >= M) return -1;
    const long long r = wide ? i : j, c = wide ? j : i;
    return (long long)k.p_off + (k.conv ? c * k.rows + r : r * k.cols + c);
}
__host__ __device__ inline long long muon_src(const MuonMat& k, size_t e) {
    return muon_src_ij(k, (int)(e % (size_t)k.m_pad), (int)(e / (size_t)k.m_pad));
}
// the matrix that group-buffer element e belongs to (mats ordered by w_off; binary search)
__host__ __device__ inline int muon_mat_of(const MuonMat* mats, int n, size_t e) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (mats[mid].w_off <= e) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
__host__ __device__ inline float muon_to_float(float v) { return v; }
__host__ __device__ inline float muon_to_float(bf16 v) { return __bfloat162float(v); }
__host__ __device__ inline float muon_to_float(__half v) { return __half2float(v); }
template <typename T>
__host__ __device__ inline T muon_from_float(float v) {
    if constexpr (std::is_same<T, float>::value) return v;
    else if constexpr (std::is_same<T, __half>::value) return __float2half_rn(v);
    else return __float2bfloat16_rn(v);
}

template <class F>
__global__ void muon_each_kernel(F f, size_t base, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) f(base + i);
}

// over the group buffers: the momentum (PyTorch's two lerps, as train_mnist's MuonMomentum) and the update u
// rounded to the buffers' type (torch: grad.bfloat16()); padding 0
__host__ __device__ inline float muon_momentum_elem(const float* g, float* buf, long long s, float w, float mu,
                                                     int nesterov) {
    if (s < 0) return 0.f;
    const float gi = g[s];
    const float b = buf[s] + w * (gi - buf[s]);  // torch.lerp, weight w = 1 - mu < 0.5
    buf[s] = b;
    return nesterov ? b - (b - gi) * (1.0f - mu) : b;  // torch.lerp(g, b, mu)
}
template <typename T>
struct MuonMomentum {
    const MuonMat* mats; int n_mats; const float* g; float* buf; T* x; float w, mu; int nesterov;
    __host__ __device__ void operator()(size_t e) const {
        const MuonMat& k = mats[muon_mat_of(mats, n_mats, e)];
        x[e] = muon_from_float<T>(muon_momentum_elem(g, buf, muon_src(k, e - k.w_off), w, mu, nesterov));
    }
};
template <typename T, typename S>
struct MuonNormalize {  // y = X / max(||X||_F, eps) (sumsq[k]: the sum of squares of matrix k); y may be x
    const MuonMat* mats; int n_mats; const float* sumsq; const T* x; S* y;
    __host__ __device__ void operator()(size_t e) const {
        const int k = muon_mat_of(mats, n_mats, e);
        y[e] = muon_from_float<S>(muon_to_float(x[e]) / fmaxf(sqrtf(sumsq[k]), MUON_EPS));
    }
};
// w <- w decay - step X (torch: param.mul_(1 - lr wd); param.add_(X, alpha=-adjusted lr)), then the EMA as AdamW's
__host__ __device__ inline void muon_apply_elem(float* p, float* ema, long long s, float step, float xe,
                                                 const float* hyper, float decay) {
    if (s < 0) return;
    float pi = p[s];
    if (decay != 1.f) pi *= decay;
    pi -= step * xe;
    p[s] = pi;
    if (ema) {
        const float d = hyper[2];
        ema[s] = d * ema[s] + (1.0f - d) * pi;
    }
}
template <typename T>
struct MuonApply {
    const MuonMat* mats; int n_mats; const T* x; float* p; float* ema; const float* hyper; float decay;
    __host__ __device__ void operator()(size_t e) const {
        const MuonMat& k = mats[muon_mat_of(mats, n_mats, e)];
        muon_apply_elem(p, ema, muon_src(k, e - k.w_off), k.step, muon_to_float(x[e]), hyper, decay);
    }
};
// The GPU's form of the three passes above (the CPU runs the functors): a block per 32 x 32 tile (i0, j0) of one
// matrix's padded wide matrix, the parameters read along the axis in which they are contiguous (j for a plain wide
// or a conv tall matrix) and the group buffer along i, through shared memory: coalesced on both sides, no search for
// the matrix and no 64-bit division per element. The same arithmetic per element: the same bits.
struct MuonTile { int mat, i0, j0, M_pad; };  // M_pad: the group's padded large dimension
enum { MUON_TILE_MOMENTUM, MUON_TILE_NORMALIZE, MUON_TILE_APPLY };
constexpr int MUON_TILE = 32, MUON_TILE_ROWS = 8;
// T: the momentum's buffer x; S: the Newton-Schulz's xs (the normalisation's output, the update's input; may be x)
template <int MODE, typename T, typename S>
__global__ void __launch_bounds__(MUON_TILE * MUON_TILE_ROWS)
    muon_tile_kernel(const MuonTile* tiles, const MuonMat* mats, T* x, S* xs, const float* g, float* buf, float* p,
                     float* ema, const float* sumsq, const float* hyper, float w, float mu, int nesterov, float decay) {
    __shared__ float tile[MUON_TILE][MUON_TILE + 1];  // [i - i0][j - j0]
    const MuonTile t = tiles[blockIdx.x];
    const MuonMat& k = mats[t.mat];
    const bool along_j = (k.conv == 0) == (k.rows <= k.cols);  // the parameters are contiguous along j
    const int lane = threadIdx.x, m_pad = k.m_pad;
    T* xk = x + k.w_off;
    S* sk = xs + k.w_off;
    if (MODE == MUON_TILE_NORMALIZE) {  // the group buffers alone, along i
        const float n = fmaxf(sqrtf(sumsq[t.mat]), MUON_EPS);
        for (int r = threadIdx.y; r < MUON_TILE; r += MUON_TILE_ROWS) {
            const int i = t.i0 + lane, j = t.j0 + r;
            if (i < m_pad && j < t.M_pad) sk[(size_t)j * m_pad + i] = muon_from_float<S>(
                muon_to_float(xk[(size_t)j * m_pad + i]) / n);
        }
        return;
    }
    if (MODE == MUON_TILE_APPLY) {  // X into shared memory along i
        for (int r = threadIdx.y; r < MUON_TILE; r += MUON_TILE_ROWS) {
            const int i = t.i0 + lane, j = t.j0 + r;
            if (i < m_pad && j < t.M_pad) tile[lane][r] = muon_to_float(sk[(size_t)j * m_pad + i]);
        }
        __syncthreads();
    }
    for (int r = threadIdx.y; r < MUON_TILE; r += MUON_TILE_ROWS) {  // the parameters along their contiguous axis
        const int ii = along_j ? r : lane, jj = along_j ? lane : r;
        const long long s = muon_src_ij(k, t.i0 + ii, t.j0 + jj);  // -1 past the matrix (padding)
        if (MODE == MUON_TILE_MOMENTUM) tile[ii][jj] = muon_momentum_elem(g, buf, s, w, mu, nesterov);
        else muon_apply_elem(p, ema, s, k.step, tile[ii][jj], hyper, decay);
    }
    if (MODE == MUON_TILE_MOMENTUM) {  // u rounded into the group buffer along i (padding: 0)
        __syncthreads();
        for (int r = threadIdx.y; r < MUON_TILE; r += MUON_TILE_ROWS) {
            const int i = t.i0 + lane, j = t.j0 + r;
            if (i < m_pad && j < t.M_pad) xk[(size_t)j * m_pad + i] = muon_from_float<T>(tile[lane][r]);
        }
    }
}
// --muon_ns gram: Z += a I over a batch of m x m matrices (stride ss; element e: matrix e / m, diagonal entry e % m)
template <typename S>
struct MuonDiag {
    S* z; int m; long long ss; float a;
    __host__ __device__ void operator()(size_t e) const {
        S* d = z + (long long)(e / m) * ss + (long long)(e % m) * (m + 1);
        *d = muon_from_float<S>(muon_to_float(*d) + a);
    }
};
// AdamW on the parameters Muon leaves (their element indices idx[])
struct MuonAdamW {
    const int* idx; float *p, *m, *v, *ema; const float* g; float beta1, beta2, lr_wd, eps; const float* hyper;
    __host__ __device__ void operator()(size_t k) const {
        const int i = idx[k];
        adamw_elem(p, g, m, v, ema, i, beta1, beta2, lr_wd, eps, hyper);
    }
};

// sum of squares of each matrix of the group buffers, in a fixed order: partial[c] for chunk c (MUON_CHUNK elements of
// one matrix, a block), then sumsq[k] over matrix k's chunks first_chunk[k] .. first_chunk[k + 1] - 1
static const int MUON_CHUNK = 4096, MUON_BLOCK = 256;
template <typename T>
__global__ void muon_sumsq_kernel(const T* x, const size_t* chunk_start, const size_t* chunk_end, float* partial) {
    __shared__ float red[MUON_BLOCK];
    float s = 0.f;
    for (size_t e = chunk_start[blockIdx.x] + threadIdx.x; e < chunk_end[blockIdx.x]; e += blockDim.x) {
        const float v = muon_to_float(x[e]);
        s += v * v;
    }
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o /= 2) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = red[0];
}
__global__ void muon_sumsq_finalize_kernel(const float* partial, const int* first_chunk, int n_mats, float* sumsq) {
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n_mats) return;
    double s = 0.0;
    for (int c = first_chunk[k]; c < first_chunk[k + 1]; c++) s += partial[c];
    sumsq[k] = (float)s;
}

// Muon's Newton-Schulz products for every matrix of a phase in one launch (--precision bf16; mma.sync m16n8k16,
// fp32 accumulation, S = bf16 or fp16 operands). Per matrix (m = m_pad rows, M = M_pad, column-major, ld m):
//   MUON_MM_GRAM: D = alpha X X^T + beta C + gamma I (m x m, K = M; P = X, Q(k, j) = X(j, k))
//   MUON_MM_SQ:   D = alpha P Q + beta C + gamma I (m x m, K = m; Q symmetric, read as Q(j, k))
//   MUON_MM_LEFT: D = alpha P X + beta C (m x M, K = m)
// Block = one BT x BT output tile (MuonMMTile), 2 x BT/32 warps of BT/2 x 32. GRAM and SQ outputs are symmetric, so
// only tiles ti >= tj are computed and one below the diagonal also writes its transpose. The tile lists put the
// longest K first, so the long X X^T tiles of the wide matrices start in the first wave. P and GRAM's Q are MN-major
// in shared memory (read with ldmatrix.trans), LEFT's X K-major (as conv_mma_bf16_kernel's two modes).
// MUON_MM_SQW: the m x m products on muon_sq_wgmma_kernel (sm_90a, below), their own tile lists
enum { MUON_MM_GRAM = 0, MUON_MM_SQ = 1, MUON_MM_LEFT = 2, MUON_MM_SQW = 3, MUON_MM_KINDS = 4 };
// per kind: the BT x BT output tile (LEFT's wide outputs amortise their loads over more columns), the k-tile BK
// and the pipeline's depth (dev/unet_NOTES.md, sessions 23 and 24)
constexpr int MUON_MM_BT[4] = {64, 64, 128, 64}, MUON_MM_BK[4] = {64, 64, 64, 64}, MUON_MM_STAGES[4] = {3, 2, 3, 3};
template <int KIND>
struct MuonMMCfg {
    static constexpr int BT = MUON_MM_BT[KIND], BK = MUON_MM_BK[KIND], STAGES = MUON_MM_STAGES[KIND];
    static constexpr int THREADS = 2 * BT, MI = BT / 32;  // warps 2 x BT/32, each BT/2 x 32: MI x 4 mma tiles
    static constexpr int MN_LD = BT + 8, K_LD = BK + 8;  // rows of an odd number of 16-byte units (conflict-free)
    static constexpr int A_ELEMS = BK * MN_LD, B_ELEMS = KIND == MUON_MM_LEFT ? BT * K_LD : BK * MN_LD;
    static constexpr int STAGE = A_ELEMS + B_ELEMS, C_LD = BT + 4;  // C_LD: the epilogue's fp32 tile [j][i]
    static constexpr size_t SMEM = (size_t)STAGES * STAGE * 2;
    static constexpr int CH = BK * BT / 8 / THREADS;  // 16-byte chunks per thread, operand and k-tile
    static_assert((size_t)BT * C_LD * 4 <= SMEM, "the epilogue's tile reuses the stages");
    static_assert(CH * THREADS * 8 == BK * BT && THREADS % (BT / 8) == 0 && THREADS % (BK / 8) == 0, "whole chunks");
};
// output rows ti*BT.., columns tj*BT.. of matrix mat over k-tiles k0 .. k1 - 1: split `split` of nsplit; a split
// tile's partial sums go to workspace slot slot0 + split and the last of its blocks to finish (counter ctr) adds them
struct MuonMMTile { int mat, ti, tj, k0, k1, split, nsplit, slot0, ctr; };

template <typename S>
__device__ __forceinline__ void muon_mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    if constexpr (std::is_same<S, bf16>::value) mma_bf16_16816(c, a, b);
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The loader: k-tile kt of P (MN-major [k][i]) and Q (GRAM, SQ: MN-major [k][j]; LEFT: K-major [j][k]) into a stage,
// zero-filled past the matrix (every dimension is a multiple of 8: a 16-byte chunk is wholly inside or outside). A
// thread's CH chunks of each operand keep their row and column, so their addresses are set up once (ld: m).
template <int KIND>
struct MuonMMLoader {
    using C = MuonMMCfg<KIND>;
    static constexpr int RC = C::BT / 8, KC = C::BK / 8;  // 16-byte chunks per MN-major and per K-major row
    const bf16 *p[C::CH], *q[C::CH];
    int kp[C::CH], kq[C::CH], sp[C::CH], sq[C::CH];  // k of the chunk within a k-tile (never valid past K), shared
    size_t step_p, step_q;                           // elements from one k-tile to the next
    int K;
    __device__ __forceinline__ MuonMMLoader(const bf16* P, const bf16* Q, int ld, int cols, int K_, int i0, int j0,
                                            int tid) : K(K_) {
#pragma unroll
        for (int c = 0; c < C::CH; c++) {
            const int r = tid / RC + (C::THREADS / RC) * c, col = (tid % RC) * 8;
            p[c] = P + (size_t)r * ld + i0 + col;
            kp[c] = i0 + col < ld ? r : INT_MAX / 2;
            sp[c] = r * C::MN_LD + col;
            if (KIND == MUON_MM_LEFT) {
                const int j = tid / KC + (C::THREADS / KC) * c, kc = (tid % KC) * 8;
                q[c] = Q + (size_t)(j0 + j) * ld + kc;
                kq[c] = j0 + j < cols ? kc : INT_MAX / 2;
                sq[c] = C::A_ELEMS + j * C::K_LD + kc;
            } else {
                q[c] = Q + (size_t)r * ld + j0 + col;
                kq[c] = j0 + col < cols ? r : INT_MAX / 2;
                sq[c] = C::A_ELEMS + r * C::MN_LD + col;
            }
        }
        step_p = (size_t)C::BK * ld;
        step_q = KIND == MUON_MM_LEFT ? C::BK : step_p;
    }
    __device__ __forceinline__ void load(bf16* st, int kt) const {
        const int k0 = kt * C::BK;
#pragma unroll
        for (int c = 0; c < C::CH; c++) {
            const bool vp = k0 + kp[c] < K, vq = k0 + kq[c] < K;
            cp_async16_b16(st + sp[c], vp ? p[c] + kt * step_p : p[c], vp);
            cp_async16_b16(st + sq[c], vq ? q[c] + kt * step_q : q[c], vq);
        }
    }
};
// one stage into the warp's BT/2 x 32 accumulators (warp (wm, wn))
template <int KIND, typename S>
__device__ __forceinline__ void muon_mm_stage(const bf16* As, int lane, int wm, int wn,
                                              float (&acc)[MuonMMCfg<KIND>::MI][4][4]) {
    using C = MuonMMCfg<KIND>;
    constexpr int BT = C::BT;
    const bf16* Bs = As + C::A_ELEMS;
#pragma unroll
    for (int kk = 0; kk < C::BK; kk += 16) {
        uint32_t a[C::MI][4], b[4][2];
#pragma unroll
        for (int i = 0; i < C::MI; i++)
            ldmatrix_x4_b16<true>(a[i], As + conv8_a_lds<1>(lane, C::MN_LD, wm * (BT / 2) + i * 16, kk));
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
            uint32_t r[4];
            if (KIND == MUON_MM_LEFT)
                ldmatrix_x4_b16<false>(r, Bs + conv8_b_lds<0>(lane, C::K_LD, wn * 32 + j * 8, kk));
            else
                ldmatrix_x4_b16<true>(r, Bs + conv8_b_lds<1>(lane, C::MN_LD, wn * 32 + j * 8, kk));
            b[j][0] = r[0];
            b[j][1] = r[1];
            b[j + 1][0] = r[2];
            b[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < C::MI; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) muon_mma<S>(acc[i][j], a[i], b[j]);
    }
}
// A BT x BT fp32 tile in shared memory (Cs[j][i], row length C_LD) out: D = alpha Cs + beta C + gamma I in 16-byte
// runs along the column, then (below the diagonal of a symmetric output) its transpose at (j, i)
template <int BT, int THREADS, int C_LD, typename S>
__device__ __forceinline__ void muon_mm_store(const float* Cs, const S* C, S* D, int ld, int cols, int i0, int j0,
                                              bool mirror, float alpha, float beta, float gamma, int tid) {
    for (int pass = 0; pass < (mirror ? 2 : 1); pass++)
        for (int c = tid; c < BT * BT / 8; c += THREADS) {
            const int u = c / (BT / 8), v8 = (c % (BT / 8)) * 8;  // pass 0: column j = u, rows i = v8..; pass 1: i, j
            const int row = (pass ? j0 : i0) + v8, col = (pass ? i0 : j0) + u;
            if (row >= ld || col >= (pass ? ld : cols)) continue;
            const size_t e = (size_t)col * ld + row;
            alignas(16) S in[8], out[8];
            if (beta != 0.f) *reinterpret_cast<uint4*>(in) = *reinterpret_cast<const uint4*>(C + e);
#pragma unroll
            for (int q = 0; q < 8; q++) {
                float y = alpha * (pass ? Cs[(v8 + q) * C_LD + u] : Cs[u * C_LD + v8 + q]);
                if (beta != 0.f) y += beta * muon_to_float(in[q]);
                if (row + q == col) y += gamma;
                out[q] = muon_from_float<S>(y);
            }
            *reinterpret_cast<uint4*>(D + e) = *reinterpret_cast<const uint4*>(out);
        }
}
// The warps' accumulators into shared memory, then muon_mm_store
template <int KIND, typename S>
__device__ __forceinline__ void muon_mm_epilogue(float* Cs, const float (&acc)[MuonMMCfg<KIND>::MI][4][4],
                                                 const S* C, S* D, int ld, int cols, int i0, int j0, bool mirror,
                                                 float alpha, float beta, float gamma, int tid) {
    using G = MuonMMCfg<KIND>;
    constexpr int BT = G::BT;
    const int lane = tid & 31, wm = (tid >> 5) & 1, wn = tid >> 6, gq = lane >> 2, tq = lane & 3;
    __syncthreads();  // every warp is done with the stages
#pragma unroll
    for (int i = 0; i < G::MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int r = 0; r < 4; r++)
                Cs[(wn * 32 + j * 8 + 2 * tq + (r & 1)) * G::C_LD + wm * (BT / 2) + i * 16 + gq + 8 * (r >> 1)] =
                    acc[i][j][r];
    __syncthreads();
    muon_mm_store<BT, G::THREADS, G::C_LD, S>(Cs, C, D, ld, cols, i0, j0, mirror, alpha, beta, gamma, tid);
}
// A split's partial sums into its workspace slot (register r of thread tid at r * THREADS + tid); false unless this
// block is the tile's last, which then holds the sum of all slots, added in split order (the same bits whichever
// block finishes last) and resets the tile's counter for the next launch
template <int KIND>
__device__ __forceinline__ bool muon_mm_split_done(float (&acc)[MuonMMCfg<KIND>::MI][4][4], float* ws, int* ctr,
                                                   const MuonMMTile& t, int tid) {
    using G = MuonMMCfg<KIND>;
    constexpr int BT = G::BT;
    constexpr int R = G::MI * 16;
    __shared__ int last;
    float* mine = ws + (size_t)(t.slot0 + t.split) * BT * BT;
#pragma unroll
    for (int r = 0; r < R; r++) mine[r * G::THREADS + tid] = (&acc[0][0][0])[r];
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(ctr + t.ctr, 1) == t.nsplit - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
#pragma unroll
    for (int r = 0; r < R; r++) (&acc[0][0][0])[r] = 0.f;
    for (int q = 0; q < t.nsplit; q++) {
        const float* part = ws + (size_t)(t.slot0 + q) * BT * BT;
#pragma unroll
        for (int r = 0; r < R; r++) (&acc[0][0][0])[r] += __ldcg(part + r * G::THREADS + tid);
    }
    if (tid == 0) ctr[t.ctr] = 0;
    return true;
}
template <int KIND, typename S>
__global__ void __launch_bounds__(MuonMMCfg<KIND>::THREADS)
    muon_mm_kernel(const MuonMMTile* tiles, const MuonMat* mats, const S* P, const S* Q, const S* C, S* D,
                   float alpha, float beta, float gamma, float* ws, int* ctr) {
    using G = MuonMMCfg<KIND>;
    constexpr int BT = G::BT, STAGES = G::STAGES;
    extern __shared__ __align__(128) bf16 smm[];
    const MuonMMTile t = tiles[blockIdx.x];  // the tables are written once: readable before the previous launch ends
    const MuonMat& k = mats[t.mat];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Programmatic Dependent Launch (muon_prod): let the next product's blocks become resident now, and wait for the
    // previous launch to finish (its outputs flushed) before touching the buffers
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    const int m = k.m_pad, tid = threadIdx.x, lane = tid & 31, wm = (tid >> 5) & 1, wn = tid >> 6;
    const int K = KIND == MUON_MM_GRAM ? k.M_pad : m, cols = KIND == MUON_MM_LEFT ? k.M_pad : m;
    const size_t ps = KIND == MUON_MM_GRAM ? k.w_off : k.s_off, qs = KIND == MUON_MM_SQ ? k.s_off : k.w_off;
    const size_t ds = KIND == MUON_MM_LEFT ? k.w_off : k.s_off;
    const bf16 *Pb = reinterpret_cast<const bf16*>(P + ps), *Qb = reinterpret_cast<const bf16*>(Q + qs);
    const int i0 = t.ti * BT, j0 = t.tj * BT;
    const MuonMMLoader<KIND> ld(Pb, Qb, m, cols, K, i0, j0, tid);
    float acc[G::MI][4][4] = {};
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (t.k0 + s < t.k1) ld.load(smm + s * G::STAGE, t.k0 + s);
        cp_async_commit();
    }
    for (int kt = t.k0; kt < t.k1; kt++) {
        cp_async_wait_mem<STAGES - 2>();
        __syncthreads();
        const int next = kt + STAGES - 1;
        if (next < t.k1) ld.load(smm + ((next - t.k0) % STAGES) * G::STAGE, next);
        cp_async_commit();
        muon_mm_stage<KIND, S>(smm + ((kt - t.k0) % STAGES) * G::STAGE, lane, wm, wn, acc);
    }
    cp_async_wait_mem<0>();
    if (t.nsplit > 1 && !muon_mm_split_done<KIND>(acc, ws, ctr, t, tid)) return;
    muon_mm_epilogue<KIND, S>(reinterpret_cast<float*>(smm), acc, C + ds, D + ds, m, cols, i0, j0,
                              KIND != MUON_MM_LEFT && t.ti > t.tj, alpha, beta, gamma, tid);
}

// The m x m products (MUON_MM_SQ) on warpgroup MMA (sm_90a; elsewhere muon_mm_kernel). A block is one BT x BT
// output tile (lower triangle, mirrored as muon_mm_kernel does), a warpgroup per 64 rows (one, at BT 64), K = m in
// k-tiles of 64 copied with cp.async into the 128-byte-swizzled layouts wgmma reads (wg_desc): P MN-major (P(i, k)
// runs along i), Q K-major (Q(k, j) runs along k: no symmetry assumed).
constexpr int MUON_WG_BT = 64, MUON_WG_BK = 64, MUON_WG_STAGES = 3, MUON_WG_THREADS = 2 * MUON_WG_BT;
constexpr int MUON_WG_A = MUON_WG_BT * MUON_WG_BK * 2, MUON_WG_STAGE = 2 * MUON_WG_A;  // bytes: A (8 KB a wg), B
constexpr int MUON_WG_C_LD = MUON_WG_BT + 4;
constexpr size_t MUON_WG_SMEM = (size_t)MUON_WG_STAGES * MUON_WG_STAGE + 1024;  // + the 1024-byte alignment
static_assert(MUON_WG_BT * MUON_WG_C_LD * 4 <= MUON_WG_STAGES * MUON_WG_STAGE, "the epilogue's tile in the stages");
static_assert(MUON_MM_BT[MUON_MM_SQW] == MUON_WG_BT && MUON_MM_BK[MUON_MM_SQW] == MUON_WG_BK, "its tile lists");
static_assert(MUON_WG_BT == 64, "m64n64 wgmma: the fp16 form exists for N = 64 only (BT 128 measured slower)");
template <typename S>
__global__ void __launch_bounds__(MUON_WG_THREADS)
    muon_sq_wgmma_kernel(const MuonMMTile* tiles, const MuonMat* mats, const S* P, const S* Q, const S* C, S* D,
                         float alpha, float beta, float gamma) {
#if UNET_SM90A
    extern __shared__ __align__(128) uint8_t smw_raw[];
    uint8_t* sm = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smw_raw) + 1023) & ~(uintptr_t)1023);
    const MuonMMTile t = tiles[blockIdx.x];
    const MuonMat& k = mats[t.mat];
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // as muon_mm_kernel
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    const int m = k.m_pad, tid = threadIdx.x, wg = tid >> 7, i0 = t.ti * MUON_WG_BT, j0 = t.tj * MUON_WG_BT;
    const bf16 *Pb = reinterpret_cast<const bf16*>(P + k.s_off), *Qb = reinterpret_cast<const bf16*>(Q + k.s_off);
    // this thread's 4 chunks of A (k-row r, 16-byte unit c of BT / 8) and of B (row j, unit c of 8) in every k-tile
    const bf16 *pa[4], *qb[4];
    int ra[4], cb[4], da[4], db[4];
    bool va[4], vb[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int e = tid + u * MUON_WG_THREADS, r = e / (MUON_WG_BT / 8), c = e % (MUON_WG_BT / 8), j = e >> 3;
        const int c8 = e & 7;
        pa[u] = Pb + (size_t)r * m + i0 + 8 * c;
        ra[u] = r;
        va[u] = i0 + 8 * c < m;
        da[u] = (c >> 3) * 8192 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        qb[u] = Qb + (size_t)(j0 + j) * m + 8 * c8;
        cb[u] = 8 * c8;
        vb[u] = j0 + j < m;
        db[u] = MUON_WG_A + j * 128 + ((c8 ^ (j & 7)) << 4);
    }
    auto load = [&](int kt) {
        uint8_t* st = sm + (kt % MUON_WG_STAGES) * MUON_WG_STAGE;
        const int k0 = kt * MUON_WG_BK;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const bool v = va[u] && k0 + ra[u] < m, w = vb[u] && k0 + cb[u] < m;
            cp_async16_b16(reinterpret_cast<bf16*>(st + da[u]), v ? pa[u] + (size_t)k0 * m : Pb, v);
            cp_async16_b16(reinterpret_cast<bf16*>(st + db[u]), w ? qb[u] + k0 : Qb, w);
        }
    };
    float acc[MUON_WG_BT / 2];
#pragma unroll
    for (int i = 0; i < MUON_WG_BT / 2; i++) acc[i] = 0.f;
    const int nk = t.k1;
#pragma unroll
    for (int s = 0; s < MUON_WG_STAGES - 1; s++) {
        if (s < nk) load(s);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait_mem<MUON_WG_STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes, seen by wgmma
        __syncthreads();
        if (kt + MUON_WG_STAGES - 1 < nk) load(kt + MUON_WG_STAGES - 1);
        cp_async_commit();
        const uint32_t a = smem_u32(sm + (kt % MUON_WG_STAGES) * MUON_WG_STAGE) + wg * 8192;
        const uint32_t b = smem_u32(sm + (kt % MUON_WG_STAGES) * MUON_WG_STAGE + MUON_WG_A);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < MUON_WG_BK / 16; ks++)
            wgmma_bf16<1, 0, S>(acc, wg_desc(a + 2048 * ks, 8192), wg_desc(b + 32 * ks, 16));
        wgmma_commit();
        wgmma_wait<0>();  // (the next k-tile's copies overwrite the stage read two k-tiles ago)
        acc_fence(acc);
    }
    cp_async_wait_mem<0>();
    __syncthreads();
    float* Cs = reinterpret_cast<float*>(sm);  // [j][i]; warp q of the warpgroup: its rows 16 q .., as mma.sync's
    const int lane = tid & 31, row = 64 * wg + 16 * ((tid & 127) >> 5) + (lane >> 2), col = 2 * (lane & 3);
#pragma unroll
    for (int n = 0; n < MUON_WG_BT / 8; n++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            Cs[(8 * n + col) * MUON_WG_C_LD + row + 8 * h] = acc[4 * n + 2 * h];
            Cs[(8 * n + col + 1) * MUON_WG_C_LD + row + 8 * h] = acc[4 * n + 2 * h + 1];
        }
    __syncthreads();
    muon_mm_store<MUON_WG_BT, MUON_WG_THREADS, MUON_WG_C_LD, S>(Cs, C + k.s_off, D + k.s_off, m, m, i0, j0,
                                                                 t.ti > t.tj, alpha, beta, gamma, tid);
#endif
}

// one reverse step for every sample; x (B, H, W, 3) in place, eps the model output, z fresh N(0, 1).
// x0 = clip(x/sqrt(acp) - sqrt(1/acp - 1) eps, -1, 1); ddpm: x = c1 x0 + c2 x + sigma z (sigma 0 at t = 0);
// ddim (eta 0): eps' = (x/sqrt(acp) - x0) / sqrt(1/acp - 1); x = sqrt(acp_prev) x0 + sqrt(1 - acp_prev) eps'.
// k: a = sqrt(1/acp), b = sqrt(1/acp - 1), c1/sqrt(acp_prev), c2/sqrt(1-acp_prev), sigma
template <typename T>
__global__ void sample_step_kernel(float* x, const T* eps, const float* z, size_t n, int ddim, float a, float b,
                                   float c1, float c2, float sigma) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float xi = x[i];
    float x0 = fminf(fmaxf(a * xi - b * to_float(eps[i]), -1.f), 1.f);
    if (ddim) {
        float e = (a * xi - x0) / b;
        x[i] = c1 * x0 + c2 * e;
    } else {
        float v = c1 * x0 + c2 * xi;
        if (sigma > 0.f) v += sigma * z[i];
        x[i] = v;
    }
}
__global__ void to_uint8_kernel(const float* x, uint8_t* out, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = rintf((x[i] + 1.0f) * 127.5f);
    out[i] = (uint8_t)fminf(fmaxf(v, 0.f), 255.f);
}

// ================================================================================================================
// model
// ================================================================================================================

// --precision: bf16 activations and compute weights (fp32 master weights, optimizer state and accumulation), TF32
// tensor cores on fp32 activations, or strict fp32 (the mode dev/test_unet.cu compares with PyTorch tensor for tensor)
enum Precision { PREC_FP32 = 0, PREC_TF32 = 1, PREC_BF16 = 2 };
static const char* PREC_NAME[3] = {"fp32", "tf32", "bf16"};

static cublasHandle_t g_cublas;
static cudaStream_t g_stream = 0;  // every launch of the model goes here (a capturable stream: CUDA graphs)
static int g_num_sms = 132;
static bool g_tf32 = true;  // TF32 tensor cores for the fp32 convolutions and cuBLAS products
static const int EW = 256;  // elementwise block size

static void* g_cublas_ws = nullptr;
// cuBLAS handle on a fresh stream with a fixed workspace (nothing allocated while a CUDA graph is captured); the
// fp32 products that remain in a bf16 run (time embedding, attention core) use TF32
static void gpu_init(Precision prec, bool high_priority = false) {
    const bool tf32 = prec != PREC_FP32;
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    g_num_sms = prop.multiProcessorCount;
    int least = 0, greatest = 0;  // high_priority: Muon's side stream (the lowest) fills what the step leaves idle
    cudaCheck(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaCheck(cudaStreamCreateWithPriority(&g_stream, cudaStreamDefault, high_priority ? greatest : least));
    cublasCheck(cublasCreate(&g_cublas));
    cublasCheck(cublasSetStream(g_cublas, g_stream));
    const size_t ws = 32 << 20;
    cudaCheck(cudaMalloc(&g_cublas_ws, ws));
    cublasCheck(cublasSetWorkspace(g_cublas, g_cublas_ws, ws));
    g_tf32 = tf32;
    cublasCheck(cublasSetMathMode(g_cublas, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
}
static void gpu_free() {
    cudaCheck(cudaStreamSynchronize(g_stream));
    cublasCheck(cublasDestroy(g_cublas));
    cudaCheck(cudaFree(g_cublas_ws));
    cudaCheck(cudaStreamDestroy(g_stream));
    g_stream = 0;
    g_cublas_ws = nullptr;
}
[[maybe_unused]] static void set_tf32(bool on) {  // (dev/test_unet.cu's strict mode)
    g_tf32 = on;
    cublasCheck(cublasSetMathMode(g_cublas, on ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
}

enum ParamKind { PK_PLAIN = 0, PK_CONV3 = 1 };
struct Param {
    std::string name;
    int kind;       // PK_CONV3: stored [tap][cin][cout], PyTorch (cout, cin, 3, 3)
    int ndim, shape[4];
    size_t off, n;
};

// an activation and its gradient, float (x, g) or bf16 (xb, gb) as the run's precision says (the other pair stays
// null); g_written tracks whether the gradient holds a value in this backward pass
struct Buf {
    float* x = nullptr;
    float* g = nullptr;
    bf16* xb = nullptr;
    bf16* gb = nullptr;
    size_t n = 0;
    int H = 0, W = 0, C = 0;
    bool g_written = false;
};

template <typename T>
static T* act(const Buf* b);
template <>
float* act<float>(const Buf* b) { return b->x; }
template <>
bf16* act<bf16>(const Buf* b) { return b->xb; }
template <typename T>
static T* grad(const Buf* b);
template <>
float* grad<float>(const Buf* b) { return b->g; }
template <>
bf16* grad<bf16>(const Buf* b) { return b->gb; }

struct ConvP { int cin = 0, cout = 0, stride = 1; size_t w = 0, b = 0; };  // 3x3, padding 1
struct LinP { int in = 0, out = 0; size_t w = 0, b = 0; };                // (out, in): Linear, 1x1 conv, conv1d
struct NormP { int C = 0; size_t w = 0, b = 0; };                        // GroupNorm(32)

enum OpKind { OP_CONV_IN, OP_RES, OP_ATTN, OP_DOWN, OP_UP, OP_CAT, OP_OUT };
struct Op {
    OpKind kind;
    Buf *in = nullptr, *in2 = nullptr, *out = nullptr;
    int H = 0, W = 0;  // input spatial size
    ConvP c1, c2;
    NormP n1, n2;
    LinP emb, skip, qkv, proj;
    bool has_skip = false;
    Buf *a1 = nullptr, *h1 = nullptr, *a2 = nullptr, *up = nullptr;  // resblock / upsample / out intermediates
    Buf *xn = nullptr, *qkvb = nullptr, *att = nullptr;             // attention
    float *mean1 = nullptr, *rstd1 = nullptr, *mean2 = nullptr, *rstd2 = nullptr;
    float *embo = nullptr, *d_embo = nullptr;  // (B, cout)
    int heads = 0, L = 0;
    float* P = nullptr;    // softmax (B*heads, L, L) of the fp32 attention core
    float* lse = nullptr;  // bf16 fused attention: the rows' log-sum-exp (B*heads, L)
    const float** ptrs = nullptr;  // device pointer arrays for the batched attention products, 10 x B*heads
};

struct MuonPlan;  // --optimizer muon's tables and buffers (the update section)
static void muon_destroy(MuonPlan* mp);
struct UNet {
    UNetConfig cfg;
    Precision prec = PREC_TF32;
    int B = 0, E = 0;  // batch, time embedding width 4C
    std::vector<Param> params;
    size_t n_params = 0;
    float *p = nullptr, *g = nullptr, *m = nullptr, *v = nullptr, *ema = nullptr;
    // ZeRO-1 over several GPUs: p and g hold n_alloc floats (n_params padded to whole shards), the AdamW moments
    // and EMA only this rank's n_state of them, from state_off. 0: one GPU (n_params, 0, n_params).
    size_t n_alloc = 0, state_off = 0, n_state = 0;
    // bf16: the compute copy of the weights (weights_to_bf16_kernel), refreshed after every update
    bf16 *pw = nullptr, *wd = nullptr;
    CastEntry* cast_table = nullptr;
    int cast_entries = 0, cast_tiles = 0;
    std::vector<Op> ops;
    std::vector<Buf*> bufs;
    void* grad_arena = nullptr;  // every activation gradient (unet_plan_grads places them)
    LinP te0, te2;
    // inputs and time embedding
    float *x0 = nullptr, *noise = nullptr;
    Buf* xt = nullptr;
    int* t = nullptr;
    float *temb = nullptr, *te_h = nullptr, *te_a = nullptr, *emb = nullptr, *emb_s = nullptr;  // (B, C|E)
    float *d_te = nullptr, *d_emb = nullptr, *d_emb_s = nullptr;
    EmbRow* emb_rows = nullptr;  // the resblocks' emb_layers (emb_layers_*_kernel)
    int emb_layers = 0, emb_total = 0;
    int emb_grad_from = 0;  // in a backward pass: the rows from here on have their weight gradients (emb_weight_grads)
    Buf* out = nullptr;  // model output (B, H, W, 3)
    float* loss = nullptr;
    double* loss_partial = nullptr;
    int loss_blocks = 0;
    float *sqrt_acp = nullptr, *sqrt_1m_acp = nullptr;  // device (T,)
    std::vector<double> acp;                               // host (T,)
    // workspaces
    float* conv_ws = nullptr;  // split-K partials of weight gradients
    size_t conv_ws_floats = 0;
    float* wflip = nullptr;  // flipped weights for backward-data, or an operand padded to 8 channels (conv v6)
    size_t wflip_floats = 0;
    double2* red_ws = nullptr;  // the channel reductions' partial sums (unet_alloc_chan)
    size_t red_ws_items = 0;
    float4* gn_coef = nullptr;   // GroupNorm backward: per (b, channel)
    float2* gn_scale = nullptr;  // GroupNorm forward: per (b, channel) (rstd*gamma, beta - mean*rstd*gamma)
    float* dS = nullptr;  // attention score gradients (max over layers)
    size_t dS_floats = 0;
    bf16* dy_up = nullptr;  // bf16: dY of a stride-2 convolution with zeros inserted (backward-data)
    size_t dy_up_elems = 0;
    float* attn32 = nullptr;  // bf16: fp32 scratch of the attention core: qkv, dqkv, a, da (attn32_part floats each)
    size_t attn32_part = 0;
    float* attn_di = nullptr;  // bf16 fused attention backward: rowsum(dO O) (B*heads, L), max over layers
    MuonPlan* muon = nullptr;  // --optimizer muon (unet_muon_setup); null: AdamW for every parameter
    int adam_t = 0;  // completed AdamW steps
    int* adam_dev = nullptr;       // the same count on the device
    float* adam_hyper = nullptr;   // (step size, sqrt of bias correction 2, EMA decay) of the current step
};

// ---------------------------------------------------------------------------------------------------------------
// build

static size_t add_param(UNet* m, const std::string& name, int kind, std::vector<int> shape) {
    Param p;
    p.name = name;
    p.kind = kind;
    p.ndim = (int)shape.size();
    p.n = 1;
    for (int d = 0; d < 4; d++) {
        p.shape[d] = d < p.ndim ? shape[d] : 0;
        if (d < p.ndim) p.n *= (size_t)shape[d];
    }
    p.off = m->n_params;
    m->n_params += (p.n + 7) / 8 * 8;  // every parameter 32-byte aligned: float4 loads, 16-byte aligned bf16 copies
    m->params.push_back(p);
    return p.off;
}
// Version 6 (conv_mma_kernel): the tile variants, the geometry of each pass and the plan that picks a tile and a K
// split per layer and pass
enum Conv6Tile { C6_128x128 = 0, C6_64x64, C6_128x8, C6_NTILES };
static const int C6_TILE_BM[C6_NTILES] = {128, 64, 128}, C6_TILE_BN[C6_NTILES] = {128, 64, 8};
[[maybe_unused]] static const char* C6_TILE_NAME[C6_NTILES] = {"128x128 8 warps 64x32", "64x64 4 warps 32x32",
                                                                "128x8 4 warps 32x8"};
static int g_conv6_tile = -1, g_conv6_splits = 0;  // dev/conv2d.cu forces a tile / a K split (-1, 0: the plan's)
// the passes version 6 runs (TF32): the (m, k) tile of MODE 0 is one tap (C % 32 == 0), 16-byte loads need
// channels % 4 == 0; N <= 8 channels that are not (the 3-channel output conv) are padded to 8 in a scratch copy
static bool conv6_n_ok(int n) { return n % 4 == 0 || n <= 8; }
static bool conv6_forward_ok(const ConvP& c) { return c.cin % 32 == 0 && conv6_n_ok(c.cout); }
static bool conv6_backward_data_ok(const ConvP& c) { return c.cout % 32 == 0 && c.cin % 4 == 0; }
static bool conv6_weight_ok(const ConvP& c) { return c.cin % 4 == 0 && conv6_n_ok(c.cout); }

// GEMM geometry of the three passes of a 3x3 conv on B images of H x W (see conv_igemm_kernel's comment)
static ConvGeom conv_geom(int B, int H, int W, int C, int Ho, int Wo, int N, int fs, int ts, int M, int K) {
    ConvGeom g;
    g.B = B; g.H = H; g.W = W; g.C = C; g.Ho = Ho; g.Wo = Wo; g.N = N; g.fs = fs; g.ts = ts; g.M = M; g.K = K;
    g.ldb = N;
    fastdiv_make(Ho * Wo, &g.hwo_mul, &g.hwo_shift);
    fastdiv_make(Wo, &g.wo_mul, &g.wo_shift);
    return g;
}
static ConvGeom conv_geom_forward(int B, const ConvP& c, int H, int W) {
    int Ho = (H - 1) / c.stride + 1, Wo = (W - 1) / c.stride + 1;
    return conv_geom(B, H, W, c.cin, Ho, Wo, c.cout, c.stride, 1, B * Ho * Wo, 9 * c.cin);
}
static ConvGeom conv_geom_backward_data(int B, const ConvP& c, int H, int W) {  // H, W: the forward's input
    int Ho = (H - 1) / c.stride + 1, Wo = (W - 1) / c.stride + 1;
    return conv_geom(B, Ho, Wo, c.cout, H, W, c.cin, 1, c.stride, B * H * W, 9 * c.cout);
}
static ConvGeom conv_geom_weight(int B, const ConvP& c, int H, int W) {
    int Ho = (H - 1) / c.stride + 1, Wo = (W - 1) / c.stride + 1;
    return conv_geom(B, H, W, c.cin, Ho, Wo, c.cout, c.stride, 1, 9 * c.cin, B * Ho * Wo);
}

struct Conv6Plan { int tile, splits, kchunk; };
// blocks of each tile one SM holds (shared memory), MODE 0
static const int C6_TILE_RES[C6_NTILES] = {Conv6<0, 128, 128, 64, 32>::MIN_BLOCKS, Conv6<0, 64, 64, 32, 32>::MIN_BLOCKS,
                                           Conv6<0, 128, 8, 32, 8>::MIN_BLOCKS};
// Measured on the H100 (dev/unet_NOTES.md): the 128x128 tile (8 warps) is the fastest wherever N >= 128 gives it
// enough blocks, the 64x64 tile for N = 64, the thin one for N <= 8. MODE 0 splits K when the tile leaves SMs
// idle (8x8 and 16x16 layers at batch 32) into as many chunks as fill one wave of resident blocks (a partial
// second wave measured slower), each >= 8 k-tiles; MODE 1 (K = pixels) splits as version 2 does.
static Conv6Plan conv6_plan(int mode, int M, int N, int K) {
    auto blocks = [&](int t) { return ceil_div(M, C6_TILE_BM[t]) * ceil_div(N, C6_TILE_BN[t]); };
    Conv6Plan p;
    if (g_conv6_tile >= 0) p.tile = g_conv6_tile;
    else if (N <= 8) p.tile = C6_128x8;
    else if (N >= 128 && (mode == 1 || blocks(C6_128x128) >= g_num_sms / 4)) p.tile = C6_128x128;
    else p.tile = C6_64x64;
    int nb = blocks(p.tile), splits;
    if (mode == 0)
        splits = nb >= g_num_sms ? 1 : std::max(1, std::min(C6_TILE_RES[p.tile] * g_num_sms / nb, K / (8 * C6_BK)));
    else splits = std::max(1, std::min(ceil_div(2 * g_num_sms, nb), std::max(1, K / 256)));
    if (g_conv6_splits > 0) splits = g_conv6_splits;
    p.kchunk = ceil_div(ceil_div(K, splits), C6_BK) * C6_BK;
    p.splits = ceil_div(K, p.kchunk);
    return p;
}
// Workspace (floats) of the split-K partial sums a 3x3 conv (B images of H x W) needs in any of its passes, for
// version 2 and for every version-6 tile (dev/conv2d.cu forces each)
static size_t conv_ws_floats_need(int B, const ConvP& c, int H, int W) {
    int Ho = (H - 1) / c.stride + 1, Wo = (W - 1) / c.stride + 1;
    size_t Mw = 9 * (size_t)c.cin, Kw = (size_t)B * Ho * Wo;
    int tiles = ceil_div(Mw, CONV_BM) * ceil_div(c.cout, CONV_BN);
    int splits = std::max(1, std::min(ceil_div(2 * g_num_sms, tiles), (int)std::max<size_t>(1, Kw / 256)));
    size_t need = (size_t)splits * Mw * c.cout;
    int saved = g_conv6_tile;
    for (int t = 0; t < C6_NTILES; t++) {
        g_conv6_tile = t;
        ConvGeom gf = conv_geom_forward(B, c, H, W), gd = conv_geom_backward_data(B, c, H, W),
                 gw = conv_geom_weight(B, c, H, W);
        Conv6Plan f = conv6_plan(0, gf.M, gf.N, gf.K), d = conv6_plan(0, gd.M, gd.N, gd.K),
                  w = conv6_plan(1, gw.M, gw.N, gw.K);
        if (f.splits > 1) need = std::max(need, (size_t)f.splits * gf.M * gf.N);
        if (d.splits > 1) need = std::max(need, (size_t)d.splits * gd.M * gd.N);
        need = std::max(need, (size_t)w.splits * gw.M * gw.N);
    }
    g_conv6_tile = saved;
    return need;
}
// Scratch (floats, UNet::wflip): the flipped weights of backward-data, or the operand padded to 8 channels of a
// version-6 pass with N <= 8 (the weights of the forward, dY of the weight gradient)
static size_t conv_scratch_floats_need(int B, const ConvP& c, int H, int W) {
    int Ho = (H - 1) / c.stride + 1, Wo = (W - 1) / c.stride + 1;
    size_t need = 9 * (size_t)c.cin * c.cout;
    if (c.cout % 4) need = std::max({need, 9 * (size_t)c.cin * 8, (size_t)B * Ho * Wo * 8});
    return need;
}

// bf16 convolutions on wgmma: the TMA views, the geometry and the plan of each pass (launched below)

// true when this binary carries sm_90a code and the GPU is compute capability 9.0 (the wgmma path can run)
__global__ void sm90a_probe_kernel(int* flag) { *flag = UNET_SM90A; }
static bool have_sm90a() {
    static int cached = -1;
    if (cached >= 0) return cached == 1;
    cached = 0;
    int dev, major, minor;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major != 9 || minor != 0) return false;
    int* d_flag;
    cudaCheck(cudaMalloc(&d_flag, sizeof(int)));
    sm90a_probe_kernel<<<1, 1>>>(d_flag);
    cudaCheck(cudaGetLastError());
    int flag = 0;
    cudaCheck(cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_flag));
    cached = flag;
    return cached == 1;
}

// true when the GPU has bf16 tensor cores (mma.sync, compute capability >= 8.0): --precision bf16 runs there
static bool have_bf16_mma() {
    int dev, major;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    return major >= 8;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda)
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (fn == nullptr) {
        cudaDriverEntryPointQueryResult q;
        void* p = nullptr;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || p == nullptr) {
            fprintf(stderr, "error: cuTensorMapEncodeTiled: driver entry point not found (query result %d)\n", (int)q);
            exit(EXIT_FAILURE);
        }
        fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    return fn;
}
// A bf16 TMA view: dims innermost first, strides (bytes) of dims 1.., box extents; 128-byte swizzle, zero fill
static CUtensorMap tensor_map_bf16(const void* base, int rank, const uint64_t* dims, const uint64_t* strides,
                                   const uint32_t* box) {
    CUtensorMap map;
    cuuint64_t d[5], s[4];
    cuuint32_t bx[5], es[5];
    for (int i = 0; i < rank; i++) {
        d[i] = dims[i];
        bx[i] = box[i];
        es[i] = 1;
        if (i + 1 < rank) s[i] = strides[i];
    }
    CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), d, s, bx,
                                      es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "internal error: cuTensorMapEncodeTiled failed (%d): rank %d, dims %llu %llu %llu, box %u %u "
                "%u, base %p\n", (int)r, rank, (unsigned long long)dims[0], (unsigned long long)dims[1],
                (unsigned long long)dims[2], box[0], box[1], box[2], base);
        exit(EXIT_FAILURE);
    }
    return map;
}

// Geometry of a pass gathering input (B, H, W, C) with `stride` into Ho x Wo pixels of N channels: pixel boxes of
// 64 (powers of 2 along x, then y, then images) and the k-tiles of the mode (0: taps x channel chunks, 1: boxes).
static ConvWgGeom conv_wg_geom(int mode, int B, int H, int W, int C, int N, int stride) {
    ConvWgGeom g;
    g.B = B; g.C = C; g.N = N; g.stride = stride;
    g.Ho = (H - 1) / stride + 1; g.Wo = (W - 1) / stride + 1;
    g.kc = ceil_div(C, CW_BK);
    g.bw = 1;
    while (g.bw < g.Wo && g.bw < CW_BOX) g.bw *= 2;
    g.bh = 1;
    while (g.bh < g.Ho && g.bw * g.bh < CW_BOX) g.bh *= 2;
    g.bb = CW_BOX / (g.bw * g.bh);
    g.nbx = ceil_div(g.Wo, g.bw);
    g.nby = ceil_div(g.Ho, g.bh);
    g.nbox = g.nbx * g.nby * ceil_div(B, g.bb);
    g.ktiles = mode == 0 ? 9 * g.kc : g.nbox;
    g.M = mode == 0 ? B * g.Ho * g.Wo : 9 * C;
    g.kchunk = g.ktiles;
    return g;
}
// The TMA views of a pass: the gathered input x (stride 2: its 4 parity views) and B (mode 0: the weights
// [N][9][C], boxes of bn rows; mode 1: dY (B, Ho, Wo, N)), every box 64 channels wide.
static ConvWgMaps conv_wg_maps(int mode, const ConvWgGeom& g, int H, int W, const __nv_bfloat16* x,
                               const __nv_bfloat16* bm, int bn) {
    ConvWgMaps maps;
    const uint64_t e = sizeof(__nv_bfloat16), C = g.C;
    const uint32_t box_px[4] = {CW_BK, (uint32_t)g.bw, (uint32_t)g.bh, (uint32_t)g.bb};
    for (int v = 0; v < (g.stride == 1 ? 1 : 4); v++) {
        const int py = v / 2, px = v % 2, s = g.stride;
        const uint64_t dims[4] = {C, (uint64_t)(W - px + s - 1) / s, (uint64_t)(H - py + s - 1) / s, (uint64_t)g.B};
        const uint64_t strides[3] = {s * C * e, s * W * C * e, (uint64_t)H * W * C * e};
        maps.a[v] = tensor_map_bf16(x + ((size_t)py * W + px) * C, 4, dims, strides, box_px);
    }
    for (int v = g.stride == 1 ? 1 : 4; v < 4; v++) maps.a[v] = maps.a[0];
    if (mode == 0) {  // box: bn rows (output channels) of one tap's 64 channels
        const uint64_t dims[3] = {C, 9, (uint64_t)g.N}, strides[2] = {C * e, 9 * C * e};
        const uint32_t box[3] = {CW_BK, 1, (uint32_t)bn};
        maps.b = tensor_map_bf16(bm, 3, dims, strides, box);
    } else {
        const uint64_t N = g.N;
        const uint64_t dims[4] = {N, (uint64_t)g.Wo, (uint64_t)g.Ho, (uint64_t)g.B};
        const uint64_t strides[3] = {N * e, (uint64_t)g.Wo * N * e, (uint64_t)g.Ho * g.Wo * N * e};
        maps.b = tensor_map_bf16(bm, 4, dims, strides, box_px);
    }
    return maps;
}

// dev/conv2d.cu forces a B tile width / a K split (0: the plan's)
static int g_cw_bn = 0, g_cw_splits = 0;
// The B tile width for N channels over images of `pixels` output pixels: the fewest n-tiles x (width + 64), the 64
// standing for the A tile that every n-tile loads again (64 -> 64, 128 -> 128, 192 -> 192, 256 -> 256, 320 -> 192,
// 448 and 512 -> 256); but 128 for N = 256 on 16x16 and 8x8 images, whose few pixel tiles fill the GPU better as
// two n-tiles than through a K split (`./dev/conv2d 7`, H100: 8x8 256->256 forward 131 -> 162 TFLOP/s).
static int conv_wg_bn(int N, int pixels) {
    if (g_cw_bn > 0) return g_cw_bn;
    if (N == 256 && pixels <= 256) return 128;
    int best = 64;
    long long best_cost = LLONG_MAX;
    for (int bn : {256, 192, 128, 64}) {
        long long cost = (long long)ceil_div(N, bn) * (bn + 64);
        if (cost < best_cost) {
            best_cost = cost;
            best = bn;
        }
    }
    return best;
}
// K split of a pass with few output tiles: mode 0 fills the resident blocks once, mode 1 (the weight gradient,
// long K) twice; every part keeps >= 4 k-tiles. Sets g->kchunk, returns the number of parts.
static int conv_wg_split(int mode, ConvWgGeom* g, int bn) {
    const int blocks = (mode == 0 ? ceil_div(g->nbox, 2) : ceil_div(9 * g->kc, 2)) * ceil_div(g->N, bn);
    const int slots = (bn == 64 ? 2 : 1) * g_num_sms;  // resident blocks (ConvWg<BN>::MINB per SM)
    int want = mode == 0 ? (blocks >= slots ? 1 : slots / blocks) : 2 * slots / blocks;
    if (g_cw_splits > 0) want = g_cw_splits;
    const int splits = std::max(1, std::min(want, std::max(1, g->ktiles / 4)));
    g->kchunk = ceil_div(g->ktiles, splits);
    return ceil_div(g->ktiles, g->kchunk);
}
// fp32 workspace (floats) of the split-K partial sums a bf16 3x3 conv needs in any pass (forced widths and splits
// of dev/conv2d.cu included when set)
static size_t conv_wg_ws_floats(int B, const ConvP& c, int H, int W) {
    size_t need = 0;
    for (int mode = 0; mode < 3; mode++) {  // forward, backward-data (on stride 1 geometry), weight gradient
        int Ci = mode == 1 ? c.cout : c.cin, N = mode == 1 ? c.cin : c.cout, s = mode == 1 ? 1 : c.stride;
        ConvWgGeom g = conv_wg_geom(mode == 2 ? 1 : 0, B, H, W, Ci, N, s);
        int splits = conv_wg_split(mode == 2 ? 1 : 0, &g, conv_wg_bn(N, g.Ho * g.Wo));
        if (mode == 2 || splits > 1) need = std::max(need, (size_t)splits * g.M * g.N);
    }
    return need;
}

template <int MODE, int BN>
static void conv_wg_launch_bn(const ConvWgMaps& maps, const ConvWgGeom& g, const ConvWgOut& o, int splits) {
    using Cfg = ConvWg<BN>;
    static bool attr_set = false;  // > 48 KB of dynamic shared memory needs an opt-in, once per instantiation
    if (!attr_set) {
        cudaCheck(cudaFuncSetAttribute(conv_wgmma_kernel<MODE, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       Cfg::SMEM_BYTES));
        attr_set = true;
    }
    ConvWgGeom gt = g;
    gt.tiles = (MODE == 0 ? ceil_div(g.nbox, 2) : ceil_div(9 * g.kc, 2)) * ceil_div(g.N, BN);
    dim3 grid(std::min(gt.tiles, Cfg::MINB * g_num_sms), 1, splits);
    conv_wgmma_kernel<MODE, BN><<<grid, CW_THREADS, Cfg::SMEM_BYTES, g_stream>>>(maps, gt, o);
    cudaCheck(cudaGetLastError());
}
template <int MODE>
static void conv_wg_launch(int bn, const ConvWgMaps& maps, const ConvWgGeom& g, const ConvWgOut& o, int splits) {
    switch (bn) {
    case 64: conv_wg_launch_bn<MODE, 64>(maps, g, o, splits); break;
    case 128: conv_wg_launch_bn<MODE, 128>(maps, g, o, splits); break;
    case 192: conv_wg_launch_bn<MODE, 192>(maps, g, o, splits); break;
    case 256: conv_wg_launch_bn<MODE, 256>(maps, g, o, splits); break;
    default: fprintf(stderr, "internal error: conv B tile width %d\n", bn); exit(EXIT_FAILURE);
    }
}

// bf16 convolutions on mma.sync (version 8, conv_mma_bf16_kernel): where they run, the tiles, the plan of a pass

// testing: dev files set it (and dev/Makefile's train_unet_mma build, -DUNET_CONV8_FORCE) to run the bf16
// convolutions on mma.sync on a Hopper GPU too
#ifdef UNET_CONV8_FORCE
static bool g_conv8_force = true;
#else
static bool g_conv8_force = false;
#endif
// the bf16 convolutions with channels % 8 == 0 run on wgmma with the sm_90a build on a 9.0 GPU, else on mma.sync
static bool conv_bf16_wgmma() { return !g_conv8_force && have_sm90a(); }

enum Conv8Tile { C8_128x128 = 0, C8_64x64, C8_NTILES };
static const int C8_TILE_BM[C8_NTILES] = {128, 64}, C8_TILE_BN[C8_NTILES] = {128, 64};
[[maybe_unused]] static const char* C8_TILE_NAME[C8_NTILES] = {"128x128 8 warps 64x32", "64x64 4 warps 32x32"};
// blocks of each tile one SM holds (shared memory), MODE 0
static const int C8_TILE_RES[C8_NTILES] = {Conv8<0, 128, 128, 64, 32>::MIN_BLOCKS,
                                           Conv8<0, 64, 64, 32, 32>::MIN_BLOCKS};
static int g_conv8_tile = -1, g_conv8_splits = 0;  // dev/conv2d.cu forces a tile / a K split (-1, 0: the plan's)
struct Conv8Plan { int tile, splits, kchunk; };  // kchunk: k-tiles per part
// whether the 128x128 tile's stages (108 KB, MODE 0) fit a block's shared memory (not on sm_86 / sm_89: 99 KB)
static bool conv8_big_tile_fits() {
    static int optin = -1;
    if (optin < 0) {
        int dev;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    }
    return Conv8<0, 128, 128, 64, 32>::SMEM <= (size_t)optin && Conv8<1, 128, 128, 64, 32>::SMEM <= (size_t)optin;
}
// Version 6's rules (conv6_plan) in k-tiles of 64: the 128x128 tile where N >= 128 gives it enough blocks (and it
// fits), else 64x64; MODE 0 splits K when the tiles leave SMs idle, into as many parts as fill one wave of resident
// blocks, each >= 4 k-tiles; MODE 1 (K = pixels) into enough parts for 2 blocks per SM, each >= 4 k-tiles.
static Conv8Plan conv8_plan(int mode, int M, int N, int ktiles) {
    auto blocks = [&](int t) { return ceil_div(M, C8_TILE_BM[t]) * ceil_div(N, C8_TILE_BN[t]); };
    Conv8Plan p;
    if (g_conv8_tile >= 0) p.tile = g_conv8_tile;
    else if (N >= 128 && conv8_big_tile_fits() && (mode == 1 || blocks(C8_128x128) >= g_num_sms / 4))
        p.tile = C8_128x128;
    else p.tile = C8_64x64;
    const int nb = blocks(p.tile);
    int splits;
    if (mode == 0)
        splits = nb >= g_num_sms ? 1 : std::max(1, std::min(C8_TILE_RES[p.tile] * g_num_sms / nb, ktiles / 4));
    else splits = std::max(1, std::min(ceil_div(2 * g_num_sms, nb), std::max(1, ktiles / 4)));
    if (g_conv8_splits > 0) splits = g_conv8_splits;
    p.kchunk = ceil_div(ktiles, std::max(1, std::min(splits, ktiles)));
    p.splits = ceil_div(ktiles, p.kchunk);
    return p;
}
// The GEMM of a version-8 pass over x (B, H, W, C) with `stride`: mode 0 the forward gather (N output channels; k-tiles
// 9 taps x kc channel chunks), mode 1 the weight gradient (k-tiles of C8_BK output pixels)
static ConvGeom conv8_geom(int mode, int B, int H, int W, int C, int N, int stride, int* kc, int* ktiles) {
    const int Ho = (H - 1) / stride + 1, Wo = (W - 1) / stride + 1;
    const ConvGeom g = mode == 0 ? conv_geom(B, H, W, C, Ho, Wo, N, stride, 1, B * Ho * Wo, 9 * C)
                                 : conv_geom(B, H, W, C, Ho, Wo, N, stride, 1, 9 * C, B * Ho * Wo);
    *kc = ceil_div(C, C8_BK);
    *ktiles = mode == 0 ? 9 * *kc : ceil_div(g.K, C8_BK);
    return g;
}
// fp32 workspace (floats) of the split-K partial sums a bf16 3x3 conv needs on version 8 in any pass, with any tile
// (and the K split dev/conv2d.cu forces, when set)
static size_t conv8_ws_floats(int B, const ConvP& c, int H, int W) {
    size_t need = 0;
    const int saved = g_conv8_tile;
    for (int t = 0; t < C8_NTILES; t++) {
        g_conv8_tile = t;
        for (int pass = 0; pass < 3; pass++) {  // forward, backward-data (stride 1 on the dilated dY), weight gradient
            const int mode = pass == 2 ? 1 : 0, C = pass == 1 ? c.cout : c.cin, N = pass == 1 ? c.cin : c.cout;
            int kc, kt;
            const ConvGeom g = conv8_geom(mode, B, H, W, C, N, pass == 1 ? 1 : c.stride, &kc, &kt);
            const Conv8Plan p = conv8_plan(mode, g.M, g.N, kt);
            if (mode == 1 || p.splits > 1) need = std::max(need, (size_t)p.splits * g.M * g.N);
        }
    }
    g_conv8_tile = saved;
    return need;
}

static ConvP add_conv(UNet* m, const std::string& name, int cin, int cout, int stride) {
    ConvP c;
    c.cin = cin; c.cout = cout; c.stride = stride;
    c.w = add_param(m, name + ".weight", PK_CONV3, {cout, cin, 3, 3});
    c.b = add_param(m, name + ".bias", PK_PLAIN, {cout});
    return c;
}
static LinP add_lin(UNet* m, const std::string& name, int in, int out, int conv_dims) {
    LinP l;
    l.in = in; l.out = out;
    std::vector<int> shape = {out, in};
    for (int d = 0; d < conv_dims; d++) shape.push_back(1);  // Conv1d (out, in, 1), Conv2d 1x1 (out, in, 1, 1)
    l.w = add_param(m, name + ".weight", PK_PLAIN, shape);
    l.b = add_param(m, name + ".bias", PK_PLAIN, {out});
    return l;
}
static NormP add_norm(UNet* m, const std::string& name, int C) {
    NormP n;
    n.C = C;
    n.w = add_param(m, name + ".weight", PK_PLAIN, {C});
    n.b = add_param(m, name + ".bias", PK_PLAIN, {C});
    return n;
}

static Buf* new_buf(UNet* m, int H, int W, int C) {
    Buf* b = new Buf();
    b->H = H; b->W = W; b->C = C;
    b->n = (size_t)m->B * H * W * C;
    m->bufs.push_back(b);
    return b;
}
static float* dev_alloc(size_t n) {
    float* p;
    cudaCheck(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(float)));
    return p;
}

static Op make_res(UNet* m, const std::string& name, Buf* in, int cout) {
    Op o;
    o.kind = OP_RES;
    o.in = in;
    o.H = in->H; o.W = in->W;
    int cin = in->C;
    o.n1 = add_norm(m, name + ".in_layers.0", cin);
    o.c1 = add_conv(m, name + ".in_layers.2", cin, cout, 1);
    o.emb = add_lin(m, name + ".emb_layers.1", m->E, cout, 0);
    o.n2 = add_norm(m, name + ".out_layers.0", cout);
    o.c2 = add_conv(m, name + ".out_layers.3", cout, cout, 1);
    o.has_skip = cin != cout;
    if (o.has_skip) o.skip = add_lin(m, name + ".skip_connection", cin, cout, 2);
    o.a1 = new_buf(m, o.H, o.W, cin);
    o.h1 = new_buf(m, o.H, o.W, cout);
    o.a2 = new_buf(m, o.H, o.W, cout);
    o.out = new_buf(m, o.H, o.W, cout);
    return o;
}
static Op make_attn(UNet* m, const std::string& name, Buf* in) {
    Op o;
    o.kind = OP_ATTN;
    o.in = in;
    o.H = in->H; o.W = in->W;
    int C = in->C;
    o.heads = C / m->cfg.num_head_channels;
    o.L = o.H * o.W;
    o.n1 = add_norm(m, name + ".norm", C);
    o.qkv = add_lin(m, name + ".qkv", C, 3 * C, 1);
    o.proj = add_lin(m, name + ".proj_out", C, C, 1);
    o.xn = new_buf(m, o.H, o.W, C);
    o.qkvb = new_buf(m, o.H, o.W, 3 * C);
    o.att = new_buf(m, o.H, o.W, C);
    o.out = new_buf(m, o.H, o.W, C);
    return o;
}

// Defines the model of cfg for batch B (as dev/unet.py UNetModel.__init__): parameters, layers and activation
// sizes, on the host only (so files can be validated without a GPU); unet_allocate then allocates everything once.
static void unet_define(UNet* m, const UNetConfig& cfg, int B) {
    m->cfg = cfg;
    m->B = B;
    const int MC = cfg.model_channels, S = cfg.image_size;
    m->E = 4 * MC;
    m->te0 = add_lin(m, "time_embed.0", MC, m->E, 0);
    m->te2 = add_lin(m, "time_embed.2", m->E, m->E, 0);
    m->xt = new_buf(m, S, S, cfg.in_channels);

    int ch = cfg.mult[0] * MC;
    std::vector<Buf*> hs;
    {
        Op o;
        o.kind = OP_CONV_IN;
        o.in = m->xt;
        o.H = S; o.W = S;
        o.c1 = add_conv(m, "input_blocks.0.0", cfg.in_channels, ch, 1);
        o.out = new_buf(m, S, S, ch);
        m->ops.push_back(o);
        hs.push_back(o.out);
    }
    Buf* h = hs.back();
    int ds = 1, block = 1;
    for (int level = 0; level < cfg.n_levels; level++) {
        for (int r = 0; r < cfg.num_res_blocks; r++) {
            std::string name = "input_blocks." + std::to_string(block);
            m->ops.push_back(make_res(m, name + ".0", h, cfg.mult[level] * MC));
            h = m->ops.back().out;
            if (cfg.attn_ds_mask & ds) {
                m->ops.push_back(make_attn(m, name + ".1", h));
                h = m->ops.back().out;
            }
            hs.push_back(h);
            block++;
        }
        if (level != cfg.n_levels - 1) {
            Op o;
            o.kind = OP_DOWN;
            o.in = h;
            o.H = h->H; o.W = h->W;
            o.c1 = add_conv(m, "input_blocks." + std::to_string(block) + ".0.op", h->C, h->C, 2);
            o.out = new_buf(m, h->H / 2, h->W / 2, h->C);
            m->ops.push_back(o);
            h = o.out;
            hs.push_back(h);
            block++;
            ds *= 2;
        }
    }
    m->ops.push_back(make_res(m, "middle_block.0", h, h->C));
    h = m->ops.back().out;
    m->ops.push_back(make_attn(m, "middle_block.1", h));
    h = m->ops.back().out;
    m->ops.push_back(make_res(m, "middle_block.2", h, h->C));
    h = m->ops.back().out;
    block = 0;
    for (int level = cfg.n_levels - 1; level >= 0; level--) {
        for (int i = 0; i <= cfg.num_res_blocks; i++) {
            Buf* skip = hs.back();
            hs.pop_back();
            Op cat;
            cat.kind = OP_CAT;
            cat.in = h;
            cat.in2 = skip;
            cat.H = h->H; cat.W = h->W;
            cat.out = new_buf(m, h->H, h->W, h->C + skip->C);
            m->ops.push_back(cat);
            h = cat.out;
            std::string name = "output_blocks." + std::to_string(block);
            int j = 0;
            m->ops.push_back(make_res(m, name + "." + std::to_string(j++), h, cfg.mult[level] * MC));
            h = m->ops.back().out;
            if (cfg.attn_ds_mask & ds) {
                m->ops.push_back(make_attn(m, name + "." + std::to_string(j++), h));
                h = m->ops.back().out;
            }
            if (level && i == cfg.num_res_blocks) {
                Op o;
                o.kind = OP_UP;
                o.in = h;
                o.H = h->H; o.W = h->W;
                o.c1 = add_conv(m, name + "." + std::to_string(j++) + ".conv", h->C, h->C, 1);
                o.up = new_buf(m, 2 * h->H, 2 * h->W, h->C);
                o.out = new_buf(m, 2 * h->H, 2 * h->W, h->C);
                m->ops.push_back(o);
                h = o.out;
                ds /= 2;
            }
            block++;
        }
    }
    {
        Op o;
        o.kind = OP_OUT;
        o.in = h;
        o.H = h->H; o.W = h->W;
        o.n1 = add_norm(m, "out.0", h->C);
        o.c1 = add_conv(m, "out.2", h->C, cfg.out_channels, 1);
        o.a1 = new_buf(m, h->H, h->W, h->C);
        o.out = new_buf(m, h->H, h->W, cfg.out_channels);
        m->ops.push_back(o);
        m->out = o.out;
    }
}

// the bf16 attention layers the fused kernels take (the others run the fp32 core on converted operands)
static bool attn_fused_ok(const Op& o) {
    const int d = o.in->C / o.heads;
    return o.L <= ATT_LMAX && (d == 16 || d == 32 || d == 64);
}

// bf16: the compute copies of the weights (pw, wd) and the table weights_to_bf16_kernel walks (one entry per
// parameter of m->params)
static void unet_allocate_bf16_weights(UNet* m) {
    const size_t np = m->n_params;
    cudaCheck(cudaMalloc(&m->pw, np * sizeof(bf16)));
    cudaCheck(cudaMalloc(&m->wd, np * sizeof(bf16)));
    cudaCheck(cudaMemset(m->pw, 0, np * sizeof(bf16)));
    cudaCheck(cudaMemset(m->wd, 0, np * sizeof(bf16)));
    std::vector<CastEntry> table;
    int tiles = 0;
    for (const Param& p : m->params) {
        CastEntry e;
        e.tile0 = tiles;
        e.conv = p.kind == PK_CONV3;
        e.cout = p.shape[0];
        e.cin = e.conv ? p.shape[1] : 0;
        e.off = (long long)p.off;
        e.n = (long long)p.n;
        tiles += e.conv ? 9 * ceil_div(e.cin, 32) * ceil_div(e.cout, 32) : ceil_div(p.n, 1024);
        table.push_back(e);
    }
    m->cast_entries = (int)table.size();
    m->cast_tiles = tiles;
    cudaCheck(cudaMalloc(&m->cast_table, table.size() * sizeof(CastEntry)));
    cudaCheck(cudaMemcpy(m->cast_table, table.data(), table.size() * sizeof(CastEntry), cudaMemcpyHostToDevice));
}

// Byte offsets of the activation gradients in one arena. In the backward pass the gradient of an activation is live
// from the backward of the last op that reads it to the backward of the op that made it (an op's intermediates:
// within its own backward); gradients never live at the same time share bytes (first fit, largest first). The
// first write of a gradient in a backward pass overwrites (take_flag), so what an earlier tenant left is harmless.
static size_t unet_plan_grads(const UNet* m, size_t elem, std::vector<size_t>* offsets) {
    const int nb = (int)m->bufs.size(), nops = (int)m->ops.size();
    std::vector<int> lo(nb, INT_MAX), hi(nb, INT_MIN);  // op indices between which the gradient is live
    auto idx = [&](const Buf* b) { return (int)(std::find(m->bufs.begin(), m->bufs.end(), b) - m->bufs.begin()); };
    auto touch = [&](const Buf* b, int i) {
        if (!b) return;
        const int k = idx(b);
        lo[k] = std::min(lo[k], i);
        hi[k] = std::max(hi[k], i);
    };
    for (int i = 0; i < nops; i++) {
        const Op& o = m->ops[i];
        const Buf* own[] = {o.out, o.a1, o.h1, o.a2, o.up, o.xn, o.qkvb, o.att, o.in, o.in2};
        for (const Buf* b : own) touch(b, i);
    }
    touch(m->out, nops);  // written by the loss before the backward
    std::vector<int> order(nb);
    for (int k = 0; k < nb; k++) order[k] = k;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return m->bufs[a]->n > m->bufs[b]->n; });
    offsets->assign(nb, 0);
    std::vector<int> placed;
    size_t total = 0;
    for (int k : order) {
        const size_t bytes = (m->bufs[k]->n * elem + 255) / 256 * 256;
        size_t off = 0;
        for (bool moved = true; moved;) {  // lowest offset clear of every placed gradient live at the same time
            moved = false;
            for (int j : placed) {
                const bool together = lo[j] <= hi[k] && lo[k] <= hi[j];
                const size_t bj = (m->bufs[j]->n * elem + 255) / 256 * 256;
                if (together && off < (*offsets)[j] + bj && (*offsets)[j] < off + bytes) {
                    off = (*offsets)[j] + bj;
                    moved = true;
                }
            }
        }
        (*offsets)[k] = off;
        placed.push_back(k);
        total = std::max(total, off + bytes);
    }
    return total;
}

// The channel reductions' workspace (partial sums for Bq * S <= 1024 blocks of C <= 2048 channels, checked at
// launch) and the GroupNorm coefficients per (b, channel), channels <= cmax
static void unet_alloc_chan(UNet* m, int B, int cmax) {
    m->red_ws_items = (size_t)1024 * 2048;
    cudaCheck(cudaMalloc(&m->red_ws, m->red_ws_items * sizeof(double2)));
    cudaCheck(cudaMalloc(&m->gn_scale, std::max<size_t>(1, (size_t)B * cmax) * sizeof(float2)));
    cudaCheck(cudaMalloc(&m->gn_coef, std::max<size_t>(1, (size_t)B * cmax) * sizeof(float4)));
}
static void unet_free_chan(UNet* m) {
    cudaCheck(cudaFree(m->red_ws));
    cudaCheck(cudaFree(m->gn_scale));
    cudaCheck(cudaFree(m->gn_coef));
}

// Allocates every device buffer of a defined model, once.
static void unet_allocate(UNet* m) {
    const int B = m->B, MC = m->cfg.model_channels;
    const UNetConfig& cfg = m->cfg;
    // parameters, gradients, optimizer state, EMA
    size_t np = m->n_params;
    if (!m->n_alloc) m->n_alloc = m->n_state = np;
    const size_t na = m->n_alloc, ns = m->n_state;
    m->p = dev_alloc(na);
    m->g = dev_alloc(na);
    m->m = dev_alloc(ns);
    m->v = dev_alloc(ns);
    m->ema = dev_alloc(ns);
    cudaCheck(cudaMemset(m->m, 0, ns * 4));
    cudaCheck(cudaMemset(m->v, 0, ns * 4));
    cudaCheck(cudaMemset(m->g, 0, na * 4));
    if (na > np) cudaCheck(cudaMemset(m->p + np, 0, (na - np) * 4));  // the last shard's padding
    // activations, and their gradients in one arena (unet_plan_grads), in the run's precision
    const size_t elem = m->prec == PREC_BF16 ? sizeof(bf16) : sizeof(float);
    std::vector<size_t> goff;
    const size_t arena = unet_plan_grads(m, elem, &goff);
    cudaCheck(cudaMalloc(&m->grad_arena, std::max<size_t>(arena, 256)));
    for (size_t k = 0; k < m->bufs.size(); k++) {
        Buf* b = m->bufs[k];
        uint8_t* g = (uint8_t*)m->grad_arena + goff[k];
        if (m->prec == PREC_BF16) {
            cudaCheck(cudaMalloc(&b->xb, std::max<size_t>(b->n, 1) * sizeof(bf16)));
            b->gb = (bf16*)g;
        } else {
            b->x = dev_alloc(b->n);
            b->g = (float*)g;
        }
    }
    m->x0 = dev_alloc(m->xt->n);
    m->noise = dev_alloc(m->xt->n);
    cudaCheck(cudaMalloc(&m->t, B * sizeof(int)));
    m->temb = dev_alloc((size_t)B * MC);
    m->te_h = dev_alloc((size_t)B * m->E);
    m->te_a = dev_alloc((size_t)B * m->E);
    m->emb = dev_alloc((size_t)B * m->E);
    m->emb_s = dev_alloc((size_t)B * m->E);
    m->d_te = dev_alloc((size_t)B * m->E);
    m->d_emb = dev_alloc((size_t)B * m->E);
    m->d_emb_s = dev_alloc((size_t)B * m->E);
    m->loss_blocks = 264;
    cudaCheck(cudaMalloc(&m->loss_partial, m->loss_blocks * sizeof(double)));
    m->loss = dev_alloc(1);
    cudaCheck(cudaMalloc(&m->adam_dev, sizeof(int)));
    cudaCheck(cudaMemset(m->adam_dev, 0, sizeof(int)));
    m->adam_hyper = dev_alloc(3);

    // per-op state and workspace sizes
    size_t ws = 0, wf = 0, dS = 0, di = 0;
    int G = 32;
    size_t dy_up = 0;
    auto conv_ws_need = [&](const ConvP& c, int H, int W) {  // H, W: the conv's input
        ws = std::max(ws, conv_ws_floats_need(B, c, H, W));
        wf = std::max(wf, conv_scratch_floats_need(B, c, H, W));
        if (m->prec == PREC_BF16) {
            ws = std::max(ws, conv_wg_ws_floats(B, c, H, W));
            if (!conv_bf16_wgmma()) ws = std::max(ws, conv8_ws_floats(B, c, H, W));  // g_conv8_force: set before
            if (c.stride == 2) dy_up = std::max(dy_up, (size_t)B * H * W * c.cout);
        }
    };
    for (Op& o : m->ops) {
        switch (o.kind) {
        case OP_CONV_IN: conv_ws_need(o.c1, o.H, o.W); break;
        case OP_DOWN: conv_ws_need(o.c1, o.H, o.W); break;
        case OP_UP: conv_ws_need(o.c1, 2 * o.H, 2 * o.W); break;
        case OP_OUT:
            conv_ws_need(o.c1, o.H, o.W);
            o.mean1 = dev_alloc((size_t)B * G);
            o.rstd1 = dev_alloc((size_t)B * G);
            break;
        case OP_RES:
            conv_ws_need(o.c1, o.H, o.W);
            conv_ws_need(o.c2, o.H, o.W);
            o.mean1 = dev_alloc((size_t)B * G);
            o.rstd1 = dev_alloc((size_t)B * G);
            o.mean2 = dev_alloc((size_t)B * G);
            o.rstd2 = dev_alloc((size_t)B * G);
            o.embo = dev_alloc((size_t)B * o.c1.cout);
            o.d_embo = dev_alloc((size_t)B * o.c1.cout);
            break;
        case OP_ATTN: {
            o.mean1 = dev_alloc((size_t)B * G);
            o.rstd1 = dev_alloc((size_t)B * G);
            if (m->prec == PREC_BF16 && attn_fused_ok(o)) {
                o.lse = dev_alloc((size_t)B * o.heads * o.L);
                di = std::max(di, (size_t)B * o.heads * o.L);
                break;
            }
            size_t nS = (size_t)B * o.heads * o.L * o.L;
            o.P = dev_alloc(nS);
            dS = std::max(dS, nS);
            break;
        }
        default: break;
        }
    }
    int cmax = 0;
    for (Op& o : m->ops)
        if (o.kind == OP_RES || o.kind == OP_ATTN || o.kind == OP_OUT) cmax = std::max({cmax, o.n1.C, o.n2.C});
    m->conv_ws_floats = ws;
    m->conv_ws = dev_alloc(ws);
    m->wflip_floats = wf;
    m->wflip = dev_alloc(wf);
    unet_alloc_chan(m, B, cmax);
    m->dS_floats = dS;
    m->dS = dev_alloc(dS);
    if (m->prec == PREC_BF16) {
        m->dy_up_elems = dy_up;
        cudaCheck(cudaMalloc(&m->dy_up, std::max<size_t>(dy_up, 1) * sizeof(bf16)));
        for (Op& o : m->ops)
            if (o.kind == OP_ATTN && !o.lse) m->attn32_part = std::max(m->attn32_part, o.qkvb->n);
        if (m->attn32_part) m->attn32 = dev_alloc(4 * m->attn32_part);
        if (di) m->attn_di = dev_alloc(di);
        unet_allocate_bf16_weights(m);
    }
    std::vector<EmbRow> rows;
    for (Op& o : m->ops)
        if (o.kind == OP_RES) {
            rows.push_back({m->emb_total, o.emb.out, (long long)o.emb.w, (long long)o.emb.b, o.embo, o.d_embo});
            m->emb_total += o.emb.out;
        }
    m->emb_layers = (int)rows.size();
    if (!rows.empty()) {
        cudaCheck(cudaMalloc(&m->emb_rows, rows.size() * sizeof(EmbRow)));
        cudaCheck(cudaMemcpy(m->emb_rows, rows.data(), rows.size() * sizeof(EmbRow), cudaMemcpyHostToDevice));
    }
    // attention pointer arrays: Q, K, V, P, O, dQ, dK, dV, dO, dS for each (b, head); the core runs in fp32, on
    // the activations themselves or (bf16) on the fp32 scratch m->attn32
    for (Op& o : m->ops) {
        if (o.kind != OP_ATTN || o.lse) continue;
        int C = o.in->C, d = C / o.heads, nb = B * o.heads, L = o.L;
        const size_t part = m->attn32_part;
        float* qkv = m->prec == PREC_BF16 ? m->attn32 : o.qkvb->x;
        float* dqkv = m->prec == PREC_BF16 ? m->attn32 + part : o.qkvb->g;
        float* a = m->prec == PREC_BF16 ? m->attn32 + 2 * part : o.att->x;
        float* da = m->prec == PREC_BF16 ? m->attn32 + 3 * part : o.att->g;
        std::vector<const float*> h_ptrs(10 * (size_t)nb);
        for (int b = 0; b < B; b++)
            for (int hd = 0; hd < o.heads; hd++) {
                int i = b * o.heads + hd;
                size_t tok = (size_t)b * L;
                h_ptrs[0 * nb + i] = qkv + tok * 3 * C + hd * 3 * d;
                h_ptrs[1 * nb + i] = qkv + tok * 3 * C + hd * 3 * d + d;
                h_ptrs[2 * nb + i] = qkv + tok * 3 * C + hd * 3 * d + 2 * d;
                h_ptrs[3 * nb + i] = o.P + (size_t)i * L * L;
                h_ptrs[4 * nb + i] = a + tok * C + hd * d;
                h_ptrs[5 * nb + i] = dqkv + tok * 3 * C + hd * 3 * d;
                h_ptrs[6 * nb + i] = dqkv + tok * 3 * C + hd * 3 * d + d;
                h_ptrs[7 * nb + i] = dqkv + tok * 3 * C + hd * 3 * d + 2 * d;
                h_ptrs[8 * nb + i] = da + tok * C + hd * d;
                h_ptrs[9 * nb + i] = m->dS + (size_t)i * L * L;
            }
        cudaCheck(cudaMalloc(&o.ptrs, h_ptrs.size() * sizeof(float*)));
        cudaCheck(cudaMemcpy(o.ptrs, h_ptrs.data(), h_ptrs.size() * sizeof(float*), cudaMemcpyHostToDevice));
    }
    // diffusion schedule: float64 as dev/unet.py, cast to float32 when used
    int T = cfg.diffusion_steps;
    m->acp.resize(T);
    std::vector<float> sa(T), sb(T);
    double acp = 1.0;
    for (int i = 0; i < T; i++) {
        double beta = T == 1 ? (double)cfg.beta_start
                             : (double)cfg.beta_start + ((double)cfg.beta_end - cfg.beta_start) * i / (T - 1);
        acp *= 1.0 - beta;
        m->acp[i] = acp;
        sa[i] = (float)sqrt(acp);
        sb[i] = (float)sqrt(1.0 - acp);
    }
    m->sqrt_acp = dev_alloc(T);
    m->sqrt_1m_acp = dev_alloc(T);
    cudaCheck(cudaMemcpy(m->sqrt_acp, sa.data(), T * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(m->sqrt_1m_acp, sb.data(), T * 4, cudaMemcpyHostToDevice));
}

static void unet_free(UNet* m) {
    for (Buf* b : m->bufs) {
        void* ps[2] = {b->x, b->xb};
        for (void* p : ps)
            if (p) cudaCheck(cudaFree(p));
        delete b;
    }
    if (m->grad_arena) cudaCheck(cudaFree(m->grad_arena));
    m->grad_arena = nullptr;
    m->bufs.clear();
    for (Op& o : m->ops) {
        float* fs[] = {o.mean1, o.rstd1, o.mean2, o.rstd2, o.embo, o.d_embo, o.P, o.lse};
        for (float* f : fs)
            if (f) cudaCheck(cudaFree(f));
        if (o.ptrs) cudaCheck(cudaFree(o.ptrs));
    }
    m->ops.clear();
    void* fs[] = {m->p, m->g, m->m, m->v, m->ema, m->x0, m->noise, m->temb, m->te_h, m->te_a, m->emb, m->emb_s,
                  m->d_te, m->d_emb, m->d_emb_s, m->loss, m->sqrt_acp, m->sqrt_1m_acp, m->conv_ws, m->wflip, m->dS,
                  m->pw, m->wd, m->cast_table, m->dy_up, m->attn32, m->attn_di, m->emb_rows};
    for (void* f : fs)
        if (f) cudaCheck(cudaFree(f));
    m->pw = m->wd = m->dy_up = nullptr;
    m->cast_table = nullptr;
    m->attn32 = m->attn_di = nullptr;
    m->emb_rows = nullptr;
    m->emb_layers = m->emb_total = 0;
    cudaCheck(cudaFree(m->t));
    cudaCheck(cudaFree(m->adam_dev));
    cudaCheck(cudaFree(m->adam_hyper));
    cudaCheck(cudaFree(m->loss_partial));
    if (m->muon) muon_destroy(m->muon);
    m->muon = nullptr;
    unet_free_chan(m);
    m->params.clear();
    m->n_params = 0;
}

[[maybe_unused]] static const Param* unet_param(const UNet* m, const std::string& name) {
    for (const Param& p : m->params)
        if (p.name == name) return &p;
    return nullptr;
}

// PyTorch layout <-> ours (conv 3x3: (cout, cin, 3, 3) <-> [tap][cin][cout]; everything else identical)
static void param_relayout(const Param& p, const float* src, float* dst, bool to_torch) {
    if (p.kind != PK_CONV3) {
        memcpy(dst, src, p.n * 4);
        return;
    }
    int co_n = p.shape[0], ci_n = p.shape[1];
    for (int co = 0; co < co_n; co++)
        for (int ci = 0; ci < ci_n; ci++)
            for (int tap = 0; tap < 9; tap++) {
                size_t torch_i = ((size_t)co * ci_n + ci) * 9 + tap, ours_i = ((size_t)tap * ci_n + ci) * co_n + co;
                if (to_torch) dst[torch_i] = src[ours_i];
                else dst[ours_i] = src[torch_i];
            }
}
static void param_from_torch(const Param& p, const float* src, float* dst) { param_relayout(p, src, dst, false); }
static void param_to_torch(const Param& p, const float* src, float* dst) { param_relayout(p, src, dst, true); }

// PyTorch's default initialisation (U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for conv/linear weights and biases,
// GroupNorm 1 and 0) and guided-diffusion's zero_module for out_layers.3, proj_out and out.2.
// Returns the initial parameters in our layout (host only).
static std::vector<float> unet_init_host(const UNet* m, uint64_t seed) {
    std::vector<float> h(m->n_params);
    uint64_t counter = 0;
    for (size_t pi = 0; pi < m->params.size(); pi++) {
        const Param& p = m->params[pi];
        const std::string& n = p.name;
        auto ends_with = [&](const char* s) {
            size_t l = strlen(s);
            return n.size() >= l && n.compare(n.size() - l, l, s) == 0;
        };
        bool is_norm = n.find("in_layers.0.") != std::string::npos || n.find("out_layers.0.") != std::string::npos ||
                       n.find(".norm.") != std::string::npos || n.rfind("out.0.", 0) == 0;
        bool zero = n.find("out_layers.3.") != std::string::npos || n.find("proj_out.") != std::string::npos ||
                    n.rfind("out.2.", 0) == 0;
        float* dst = h.data() + p.off;
        if (is_norm) {
            float v = ends_with(".weight") ? 1.f : 0.f;
            for (size_t i = 0; i < p.n; i++) dst[i] = v;
        } else if (zero) {
            for (size_t i = 0; i < p.n; i++) dst[i] = 0.f;
        } else {
            // fan_in of the weight of this layer: bias entries follow their weight in the table
            const Param& w = ends_with(".bias") ? m->params[pi - 1] : p;
            size_t fan_in = w.n / (size_t)w.shape[0];
            float bound = 1.0f / sqrtf((float)fan_in);
            for (size_t i = 0; i < p.n; i++) dst[i] = (2.f * rng_uniform(seed, RNG_INIT, counter++) - 1.f) * bound;
        }
    }
    // generated in PyTorch layout, stored in ours
    std::vector<float> ours(m->n_params, 0.f);
    for (const Param& p : m->params) param_from_torch(p, h.data() + p.off, ours.data() + p.off);
    return ours;
}
// bf16: the compute copy of the weights from m->p; to be called after anything writes m->p (load, init, update)
static void unet_weights_changed(UNet* m) {
    if (m->prec != PREC_BF16) return;
    weights_to_bf16_kernel<<<m->cast_tiles, dim3(32, 8), 0, g_stream>>>(m->p, m->pw, m->wd, m->cast_table,
                                                                         m->cast_entries);
    cudaCheck(cudaGetLastError());
}
static void unet_init_weights(UNet* m, uint64_t seed) {
    std::vector<float> ours = unet_init_host(m, seed);
    cudaCheck(cudaMemcpy(m->p, ours.data(), m->n_params * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(m->ema, m->p + m->state_off, m->n_state * 4, cudaMemcpyDeviceToDevice));
    unet_weights_changed(m);
}
// bf16 attention operands in and out of the fp32 scratch of the attention core
static void attn_to_fp32(const bf16* x, size_t n, float* y) {
    convert_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(x, y, n);
    cudaCheck(cudaGetLastError());
}
static void attn_from_fp32(const float* x, bf16* y, size_t n) {
    convert_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(x, y, n);
    cudaCheck(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------------------------
// layer launchers

static void gemm_rm(bool tA, bool tB, int M, int N, int K, const float* A, int lda, const float* Bm, int ldb,
                    float* C, int ldc, float alpha, float beta) {
    // row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
    cublasCheck(cublasSgemm(g_cublas, tB ? CUBLAS_OP_T : CUBLAS_OP_N, tA ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                            &alpha, Bm, ldb, A, lda, &beta, C, ldc));
}
static void gemm_rm_batched(bool tA, bool tB, int M, int N, int K, const float* const* A, int lda,
                            const float* const* Bm, int ldb, float* const* C, int ldc, float alpha, float beta,
                            int batch) {
    cublasCheck(cublasSgemmBatched(g_cublas, tB ? CUBLAS_OP_T : CUBLAS_OP_N, tA ? CUBLAS_OP_T : CUBLAS_OP_N, N, M,
                                   K, &alpha, Bm, ldb, A, lda, &beta, C, ldc, batch));
}

// version 2 (conv_igemm_kernel), strict fp32; vec: 16-byte loads (channels fit the tile)
template <int MODE>
static void launch_conv_igemm(dim3 grid, bool vec, const float* X, const float* Bm, float* out, const float* bias,
                              const float* emb, int accumulate, const ConvGeom& g, int kchunk) {
    if (vec)
        conv_igemm_kernel<MODE, true><<<grid, CONV_THREADS, 0, g_stream>>>(X, Bm, out, bias, emb, accumulate, g,
                                                                          kchunk);
    else
        conv_igemm_kernel<MODE, false><<<grid, CONV_THREADS, 0, g_stream>>>(X, Bm, out, bias, emb, accumulate, g,
                                                                           kchunk);
    cudaCheck(cudaGetLastError());
}

template <int MODE, int BM, int BN, int WM, int WN, int RND>
static void launch_conv6_tile(int splits, const float* X, const float* Bm, float* out, const float* bias,
                              const float* emb, int accumulate, const ConvGeom& g, int kchunk) {
    using T = Conv6<MODE, BM, BN, WM, WN>;
    static bool attr_set = false;  // > 48 KB of dynamic shared memory needs an opt-in, once per instantiation
    if (!attr_set) {
        cudaCheck(cudaFuncSetAttribute(conv_mma_kernel<MODE, BM, BN, WM, WN, RND>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)T::SMEM));
        attr_set = true;
    }
    dim3 grid(ceil_div(g.M, BM), ceil_div(g.N, BN), splits);
    conv_mma_kernel<MODE, BM, BN, WM, WN, RND><<<grid, T::THREADS, T::SMEM, g_stream>>>(X, Bm, out, bias, emb,
                                                                                        accumulate, g, kchunk);
    cudaCheck(cudaGetLastError());
}
template <int MODE, int RND>
static void launch_conv6(const Conv6Plan& p, const float* X, const float* Bm, float* out, const float* bias,
                         const float* emb, int accumulate, const ConvGeom& g) {
    switch (p.tile) {
    case C6_128x128:
        launch_conv6_tile<MODE, 128, 128, 64, 32, RND>(p.splits, X, Bm, out, bias, emb, accumulate, g, p.kchunk);
        break;
    case C6_64x64:
        launch_conv6_tile<MODE, 64, 64, 32, 32, RND>(p.splits, X, Bm, out, bias, emb, accumulate, g, p.kchunk);
        break;
    case C6_128x8:
        launch_conv6_tile<MODE, 128, 8, 32, 8, RND>(p.splits, X, Bm, out, bias, emb, accumulate, g, p.kchunk);
        break;
    default: fprintf(stderr, "internal error: conv tile %d\n", p.tile); exit(EXIT_FAILURE);
    }
}
// dw (+)= the K chunks' partial sums ws[splits][n], added in a fixed order
static void wgrad_reduce(const float* ws, float* dw, size_t n, int splits, bool accumulate) {
    if (n % 4 == 0 && (uintptr_t)dw % 16 == 0)
        wgrad_reduce4_kernel<<<ceil_div(n / 4, EW), EW, 0, g_stream>>>((const float4*)ws, (float4*)dw, n / 4, splits,
                                                                        accumulate);
    else wgrad_reduce_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(ws, dw, n, splits, accumulate);
    cudaCheck(cudaGetLastError());
}
// out = the K chunks' partial sums + bias + emb (+ res, which may be out) (MODE 0 with K split)
template <typename T>
static void splitk_epilogue(const float* ws, T* out, const float* bias, const float* emb, const T* res, int M, int N,
                            int HWo, int splits) {
    const size_t n = (size_t)M * N;
    if (N % 4 == 0)
        conv_splitk_epilogue_kernel<T, 4><<<ceil_div(n / 4, EW), EW, 0, g_stream>>>(ws, out, bias, emb, res, M, N,
                                                                                     HWo, splits);
    else conv_splitk_epilogue_kernel<T, 1><<<ceil_div(n, EW), EW, 0, g_stream>>>(ws, out, bias, emb, res, M, N, HWo,
                                                                                  splits);
    cudaCheck(cudaGetLastError());
}
static void conv_ws_check(size_t have, size_t need, const char* what) {
    if (need > have) {
        fprintf(stderr, "internal error: conv %s too small (%zu floats, %zu needed)\n", what, have, need);
        exit(EXIT_FAILURE);
    }
}
// dst (rows, 8) = src (rows, n) with zero columns n..7 (n < 8): 16-byte rows for version 6's B operand
__global__ void pad_cols8_kernel(const float* __restrict__ src, float* __restrict__ dst, int rows, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * 8) return;
    int r = i >> 3, c = i & 7;
    dst[i] = c < n ? src[(size_t)r * n + c] : 0.f;
}
// B (K, N) of a version-6 pass as the kernel reads it: itself (g->ldb = N), or padded to 8 columns in scratch
static const float* conv6_b_operand(const UNet* m, ConvGeom* g, const float* Bm, int rows) {
    if (g->N % 4 == 0) return Bm;
    conv_ws_check(m->wflip_floats, (size_t)rows * 8, "scratch");
    pad_cols8_kernel<<<ceil_div((size_t)rows * 8, EW), EW, 0, g_stream>>>(Bm, m->wflip, rows, g->N);
    cudaCheck(cudaGetLastError());
    g->ldb = 8;
    return m->wflip;
}
constexpr int CONV6_RND = 1;  // operands rounded once in shared memory (dev/conv2d.cu times variants 0, 2, 3)
// MODE 0 on version 6: out (+)= conv + bias + emb, through the workspace and conv_splitk_epilogue_kernel when the
// plan splits K
template <int RND = CONV6_RND>
static void conv6_forward_mode(const UNet* m, ConvGeom g, const float* X, const float* Wt, float* out,
                               const float* bias, const float* emb, bool accumulate) {
    Conv6Plan p = conv6_plan(0, g.M, g.N, g.K);
    Wt = conv6_b_operand(m, &g, Wt, g.K);
    if (p.splits == 1) {
        launch_conv6<0, RND>(p, X, Wt, out, bias, emb, accumulate, g);
        return;
    }
    conv_ws_check(m->conv_ws_floats, (size_t)p.splits * g.M * g.N, "workspace");
    launch_conv6<0, RND>(p, X, Wt, m->conv_ws, nullptr, nullptr, 0, g);
    splitk_epilogue(m->conv_ws, out, bias, emb, accumulate ? (const float*)out : nullptr, g.M, g.N, g.Ho * g.Wo,
                    p.splits);
}
// MODE 1 on version 6: dW = the K chunks' partial sums, added in a fixed order
template <int RND = CONV6_RND>
static void conv6_weight_grad(const UNet* m, ConvGeom g, const float* x, const float* dy, float* dw) {
    Conv6Plan p = conv6_plan(1, g.M, g.N, g.K);
    dy = conv6_b_operand(m, &g, dy, g.K);
    conv_ws_check(m->conv_ws_floats, (size_t)p.splits * g.M * g.N, "workspace");
    launch_conv6<1, RND>(p, x, dy, m->conv_ws, nullptr, nullptr, 0, g);
    size_t n = (size_t)g.M * g.N;
    wgrad_reduce(m->conv_ws, dw, n, p.splits, false);
}

// version 8 (bf16 mma.sync): the launch of a tile, the forward (MODE 0, also backward-data) and the weight gradient
template <int MODE, int BM, int BN, int WM, int WN>
static void launch_conv8_tile(const Conv8Plan& p, const bf16* X, const bf16* Bm, const ConvWgOut& o,
                              const ConvGeom& g, int kc, int ktiles) {
    using T = Conv8<MODE, BM, BN, WM, WN>;
    static bool attr_set = false;  // > 48 KB of dynamic shared memory needs an opt-in, once per instantiation
    if (!attr_set) {
        cudaCheck(cudaFuncSetAttribute(conv_mma_bf16_kernel<MODE, BM, BN, WM, WN>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)T::SMEM));
        attr_set = true;
    }
    dim3 grid(ceil_div(g.M, BM), ceil_div(g.N, BN), p.splits);
    conv_mma_bf16_kernel<MODE, BM, BN, WM, WN><<<grid, T::THREADS, T::SMEM, g_stream>>>(X, Bm, o, g, kc, ktiles,
                                                                                        p.kchunk);
    cudaCheck(cudaGetLastError());
}
template <int MODE>
static void launch_conv8(const Conv8Plan& p, const bf16* X, const bf16* Bm, const ConvWgOut& o, const ConvGeom& g,
                         int kc, int ktiles) {
    switch (p.tile) {
    case C8_128x128: launch_conv8_tile<MODE, 128, 128, 64, 32>(p, X, Bm, o, g, kc, ktiles); break;
    case C8_64x64: launch_conv8_tile<MODE, 64, 64, 32, 32>(p, X, Bm, o, g, kc, ktiles); break;
    default: fprintf(stderr, "internal error: conv tile %d\n", p.tile); exit(EXIT_FAILURE);
    }
}
// out (B, Ho, Wo, N) = conv(x (B, H, W, C), w [N][9][C]) + bias (+ emb (B, N)) (+ res, which may be out) on
// mma.sync; a K split goes through the workspace and conv_splitk_epilogue_kernel
static void conv8_forward(const UNet* m, int H, int W, int C, int N, int stride, const bf16* x, const bf16* w,
                          bf16* out, const float* bias, const float* emb, const bf16* res) {
    int kc, ktiles;
    const ConvGeom g = conv8_geom(0, m->B, H, W, C, N, stride, &kc, &ktiles);
    const Conv8Plan p = conv8_plan(0, g.M, g.N, ktiles);
    const ConvWgOut o = {out, bias, emb, res, m->conv_ws};
    if (p.splits > 1) conv_ws_check(m->conv_ws_floats, (size_t)p.splits * g.M * g.N, "workspace");
    launch_conv8<0>(p, x, w, o, g, kc, ktiles);
    if (p.splits > 1) splitk_epilogue(m->conv_ws, out, bias, emb, res, g.M, g.N, g.Ho * g.Wo, p.splits);
}
// dw [9][C][N] (fp32) = weight gradient from x (B, H, W, C) and dy (B, Ho, Wo, N) on mma.sync (MODE 1)
static void conv8_weight_grad(const UNet* m, int H, int W, int C, int N, int stride, const bf16* x, const bf16* dy,
                              float* dw) {
    int kc, ktiles;
    const ConvGeom g = conv8_geom(1, m->B, H, W, C, N, stride, &kc, &ktiles);
    const Conv8Plan p = conv8_plan(1, g.M, g.N, ktiles);
    const ConvWgOut o = {nullptr, nullptr, nullptr, nullptr, m->conv_ws};
    conv_ws_check(m->conv_ws_floats, (size_t)p.splits * g.M * g.N, "workspace");
    launch_conv8<1>(p, x, dy, o, g, kc, ktiles);
    wgrad_reduce(m->conv_ws, dw, (size_t)g.M * g.N, p.splits, false);
}

// bf16 3x3 convolutions: the TMA and mma.sync paths need 16-byte pixel rows (channels % 8 == 0) on both sides; the
// others (the 3-channel input and output convolutions) take the thin kernels
static bool conv_wg_ok(const ConvP& c) { return c.cin % 8 == 0 && c.cout % 8 == 0; }

// out (B, Ho, Wo, N) = conv(x (B, H, W, C), w [N][9][C]) + bias (+ emb (B, N)) (+ res, which may be out) on wgmma
// (on mma.sync where !conv_bf16_wgmma())
static void conv_wg_forward(const UNet* m, int H, int W, int C, int N, int stride, const bf16* x, const bf16* w,
                            bf16* out, const float* bias, const float* emb, const bf16* res) {
    if (!conv_bf16_wgmma()) return conv8_forward(m, H, W, C, N, stride, x, w, out, bias, emb, res);
    ConvWgGeom g = conv_wg_geom(0, m->B, H, W, C, N, stride);
    const int bn = conv_wg_bn(N, g.Ho * g.Wo), splits = conv_wg_split(0, &g, bn);
    const ConvWgMaps maps = conv_wg_maps(0, g, H, W, x, w, bn);
    ConvWgOut o = {out, bias, emb, res, m->conv_ws};
    if (splits > 1) conv_ws_check(m->conv_ws_floats, (size_t)splits * g.M * g.N, "workspace");
    conv_wg_launch<0>(bn, maps, g, o, splits);
    if (splits == 1) return;
    splitk_epilogue(m->conv_ws, out, bias, emb, res, g.M, g.N, g.Ho * g.Wo, splits);
}
// dw [9][C][N] (fp32) = weight gradient from x (B, H, W, C) and dy (B, Ho, Wo, N) on wgmma (mode 1; on mma.sync
// where !conv_bf16_wgmma())
static void conv_wg_weight_grad(const UNet* m, int H, int W, int C, int N, int stride, const bf16* x,
                                const bf16* dy, float* dw) {
    if (!conv_bf16_wgmma()) return conv8_weight_grad(m, H, W, C, N, stride, x, dy, dw);
    ConvWgGeom g = conv_wg_geom(1, m->B, H, W, C, N, stride);
    const int bn = conv_wg_bn(N, g.Ho * g.Wo), splits = conv_wg_split(1, &g, bn);
    const ConvWgMaps maps = conv_wg_maps(1, g, H, W, x, dy, bn);
    ConvWgOut o = {nullptr, nullptr, nullptr, 0, m->conv_ws};
    conv_ws_check(m->conv_ws_floats, (size_t)splits * g.M * g.N, "workspace");
    conv_wg_launch<1>(bn, maps, g, o, splits);
    const size_t n = (size_t)g.M * g.N;
    wgrad_reduce(m->conv_ws, dw, n, splits, false);
}
// thin bf16 convolutions (conv_thin_kernel): w (K x N) fp32, any ConvGeom of MODE 0
template <int NT, int V>
static void conv_thin_launch(ConvGeom g, const bf16* x, const float* w, bf16* y, const float* bias, bool accumulate) {
    const int taps = std::max(1, std::min(9, (48 * 1024) / (g.C * NT * (int)sizeof(float))));
    const size_t smem = (size_t)taps * g.C * NT * sizeof(float);
    static size_t attr = 48 * 1024;
    if (smem > attr) {  // more than 48 KB only where one tap's slice needs it (C > 192 at NT = 64)
        cudaCheck(cudaFuncSetAttribute(conv_thin_kernel<NT, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem));
        attr = smem;
    }
    dim3 grid(ceil_div(g.M, 128), ceil_div(g.N, NT));
    conv_thin_kernel<NT, V><<<grid, 128, smem, g_stream>>>(x, w, y, bias, g, taps, accumulate);
    cudaCheck(cudaGetLastError());
}
static void conv_thin(ConvGeom g, const bf16* x, const float* w, bf16* y, const float* bias, bool accumulate) {
    const bool v8 = g.C % 8 == 0;
    auto launch = [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        if (v8) conv_thin_launch<NT, 8>(g, x, w, y, bias, accumulate);
        else conv_thin_launch<NT, 1>(g, x, w, y, bias, accumulate);
    };
    if (g.N <= 4) launch(std::integral_constant<int, 4>{});
    else if (g.N <= 8) launch(std::integral_constant<int, 8>{});
    else launch(std::integral_constant<int, 64>{});
}
// dW (9*C x N, fp32) of a thin bf16 convolution: per-block partial sums, then added in a fixed order
template <int V>
static void conv_thin_wgrad_launch(const UNet* m, ConvGeom g, const bf16* x, const bf16* dy, float* dw) {
    const int N4 = (g.N + 3) / 4 * 4, tasks = g.M * (N4 / 4);
    const int blocks = std::min(ceil_div(g.K, THIN_PIX), 2 * g_num_sms);
    const size_t smem = (size_t)THIN_PIX * (g.M + N4) * sizeof(float);
    static size_t attr = 48 * 1024;
    if (smem > attr) {
        cudaCheck(cudaFuncSetAttribute(conv_thin_wgrad_kernel<THIN_TPT, V>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        attr = smem;
    }
    conv_ws_check(m->conv_ws_floats, (size_t)blocks * g.M * g.N, "workspace");
    dim3 grid(blocks, ceil_div(tasks, THIN_TPT * 256));
    conv_thin_wgrad_kernel<THIN_TPT, V><<<grid, 256, smem, g_stream>>>(x, dy, m->conv_ws, g);
    cudaCheck(cudaGetLastError());
    wgrad_reduce(m->conv_ws, dw, (size_t)g.M * g.N, blocks, false);
}
static void conv_thin_weight_grad(const UNet* m, ConvGeom g, const bf16* x, const bf16* dy, float* dw) {
    if (g.fs == 1 && g.ts == 1 && g.N <= 4 && g.C % 8 == 0 && 9 * g.C <= 4 * 256) {  // the output conv
        const int blocks = std::min(ceil_div((long long)g.B * g.H * g.W, THIN_PIX2), 2 * g_num_sms);
        const size_t smem = (size_t)THIN_PIX2 * g.C * sizeof(float) + 9 * THIN_PIX2 * sizeof(float4);
        static size_t attr = 48 * 1024;
        if (smem > attr) {
            cudaCheck(cudaFuncSetAttribute(conv_thin_wgrad_dy_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem));
            attr = smem;
        }
        conv_ws_check(m->conv_ws_floats, (size_t)blocks * g.M * g.N, "workspace");
        conv_thin_wgrad_dy_kernel<4><<<blocks, 256, smem, g_stream>>>(x, dy, m->conv_ws, g);
        cudaCheck(cudaGetLastError());
        wgrad_reduce(m->conv_ws, dw, (size_t)g.M * g.N, blocks, false);
        return;
    }
    if (g.C % 8 == 0) conv_thin_wgrad_launch<8>(m, g, x, dy, dw);
    else conv_thin_wgrad_launch<1>(m, g, x, dy, dw);
}

// y (B, Ho, Wo, cout) = conv3x3(x (B, H, W, cin)) + bias (+ emb[b, cout]) (+ res, the residual, which may be y)
template <typename T>
static void conv3x3_forward(const UNet* m, const ConvP& c, const T* x, T* y, int H, int W, const float* emb,
                            const typename Same<T>::type* res) {
    ConvGeom g = conv_geom_forward(m->B, c, H, W);
    if constexpr (std::is_same<T, bf16>::value) {
        if (conv_wg_ok(c)) {
            conv_wg_forward(m, H, W, c.cin, c.cout, c.stride, x, m->pw + c.w, y, m->p + c.b, emb, res);
            return;
        }
    }
    const bool accumulate = res != nullptr;  // the other kernels add in place: a residual held elsewhere is copied
    if (res && res != y)
        cudaCheck(cudaMemcpyAsync(y, res, (size_t)g.M * g.N * sizeof(T), cudaMemcpyDeviceToDevice, g_stream));
    if constexpr (std::is_same<T, bf16>::value) {
        if (!emb) conv_thin(g, x, m->p + c.w, y, m->p + c.b, accumulate);
        else {
            fprintf(stderr, "internal error: a thin bf16 convolution with a time embedding\n");
            exit(EXIT_FAILURE);
        }
        return;
    } else {
        if (g_tf32 && conv6_forward_ok(c)) {
            conv6_forward_mode(m, g, x, m->p + c.w, y, m->p + c.b, emb, accumulate);
            return;
        }
        dim3 grid(ceil_div(g.M, CONV_BM), ceil_div(g.N, CONV_BN));
        bool vec = c.cin % CONV_BK == 0 && c.cout % 4 == 0;
        launch_conv_igemm<0>(grid, vec, x, m->p + c.w, y, m->p + c.b, emb, accumulate, g, 0);
    }
}
// dx (B, H, W, cin) (+)= conv3x3 backward-data of dy (B, Ho, Wo, cout)
template <typename T>
static void conv3x3_backward_data(const UNet* m, const ConvP& c, const T* dy, T* dx, int H, int W, bool accumulate) {
    if constexpr (std::is_same<T, bf16>::value) {
        if (conv_wg_ok(c)) {
            const bf16* d = dy;
            if (c.stride == 2) {  // zero-inserted dY: the stride-1 backward-data
                const size_t n = (size_t)m->B * H * W * c.cout;
                conv_ws_check(m->dy_up_elems, n, "stride-2 scratch");
                dilate2_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(dy, m->dy_up, m->B, H, W, c.cout);
                cudaCheck(cudaGetLastError());
                d = m->dy_up;
            }
            conv_wg_forward(m, H, W, c.cout, c.cin, 1, d, m->wd + c.w, dx, nullptr, nullptr, accumulate ? dx : nullptr);
            return;
        }
    }
    int n = 9 * c.cin * c.cout;
    conv_flip_weights_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(m->p + c.w, m->wflip, c.cin, c.cout);
    cudaCheck(cudaGetLastError());
    ConvGeom g = conv_geom_backward_data(m->B, c, H, W);
    if constexpr (std::is_same<T, bf16>::value) {
        conv_thin(g, dy, m->wflip, dx, nullptr, accumulate);
    } else {
        if (g_tf32 && conv6_backward_data_ok(c)) {
            conv6_forward_mode(m, g, dy, m->wflip, dx, nullptr, nullptr, accumulate);
            return;
        }
        dim3 grid(ceil_div(g.M, CONV_BM), ceil_div(g.N, CONV_BN));
        bool vec = c.cout % CONV_BK == 0 && c.cin % 4 == 0;
        launch_conv_igemm<0>(grid, vec, dy, m->wflip, dx, nullptr, nullptr, accumulate, g, 0);
    }
}
// dW = conv3x3 weight gradient from x (B, H, W, cin) and dy (B, Ho, Wo, cout)
template <typename T>
static void conv3x3_backward_weight(const UNet* m, const ConvP& c, const T* x, const T* dy, int H, int W) {
    ConvGeom g = conv_geom_weight(m->B, c, H, W);
    if constexpr (std::is_same<T, bf16>::value) {
        if (conv_wg_ok(c)) conv_wg_weight_grad(m, H, W, c.cin, c.cout, c.stride, x, dy, m->g + c.w);
        else conv_thin_weight_grad(m, g, x, dy, m->g + c.w);
        return;
    } else {
        if (g_tf32 && conv6_weight_ok(c)) {
            conv6_weight_grad(m, g, x, dy, m->g + c.w);
            return;
        }
        int tiles = ceil_div(g.M, CONV_BM) * ceil_div(g.N, CONV_BN);
        int splits = std::max(1, std::min(ceil_div(2 * g_num_sms, tiles), std::max(1, g.K / 256)));
        int kchunk = ceil_div(ceil_div(g.K, splits), CONV_BK) * CONV_BK;
        splits = ceil_div(g.K, kchunk);
        conv_ws_check(m->conv_ws_floats, (size_t)splits * g.M * g.N, "workspace");
        dim3 grid(ceil_div(g.M, CONV_BM), ceil_div(g.N, CONV_BN), splits);
        bool vec = c.cin % 4 == 0 && c.cout % 4 == 0;
        launch_conv_igemm<1>(grid, vec, x, dy, m->conv_ws, nullptr, nullptr, 0, g, kchunk);
        size_t n = (size_t)g.M * g.N;
        wgrad_reduce(m->conv_ws, m->g + c.w, n, splits, false);
    }
}

// per-(b, c) partial sums of x (Bq, P, C); returns the number of chunks S
template <int MODE, typename T>
static int chan_reduce(const UNet* m, const T* x, const T* dy, const float* mean, const float* rstd,
                       const float* gamma, const float* beta, int Bq, int P, int C, int G, int silu) {
    const int lanes_hint = std::max(1, 256 / std::max(1, C / VEC<T>));  // pixel lanes of a block
    int S = std::max(1, std::min(std::max(1, P / 32), ceil_div(4 * g_num_sms, Bq)));
    S = std::max(S, ceil_div(P, 64 * lanes_hint));  // float sums of at most 64 pixels per lane
    S = std::min(S, std::max(1, 1024 / Bq));
    if ((size_t)Bq * S * C > m->red_ws_items) {
        fprintf(stderr, "internal error: reduction workspace too small\n");
        exit(EXIT_FAILURE);
    }
    const int threads = 256;
    const bool vec = C % VEC<T> == 0 && C / VEC<T> <= threads;
    const int v = vec ? VEC<T> : 1, lanes = std::max(1, threads / (C / v));
    const size_t smem = (size_t)lanes * C * sizeof(double2);
    if (C / v > threads || smem > 48 * 1024) {
        fprintf(stderr, "internal error: channel reduction over %d channels\n", C);
        exit(EXIT_FAILURE);
    }
    dim3 grid(Bq, S);
    if (vec)
        chan_reduce_kernel<MODE, T, VEC<T>><<<grid, threads, smem, g_stream>>>(x, dy, mean, rstd, gamma, beta, P, C, G,
                                                                              silu, m->red_ws);
    else
        chan_reduce_kernel<MODE, T, 1><<<grid, threads, smem, g_stream>>>(x, dy, mean, rstd, gamma, beta, P, C, G,
                                                                         silu, m->red_ws);
    cudaCheck(cudaGetLastError());
    return S;
}
// blocks of EW threads for `warps` warps (the reductions' finalize kernels: a warp per output)
static int warp_blocks(int warps) { return ceil_div((long long)warps * 32, EW); }
// out[c] = sum over (b, p) of x (Bq, P, C) (per_b = 0) or out[b, c] = sum over p (per_b = 1)
template <typename T>
static void channel_sums(const UNet* m, const T* x, float* out, int Bq, int P, int C, int per_b, int accumulate) {
    int S = chan_reduce<2, T>(m, x, nullptr, nullptr, nullptr, nullptr, nullptr, Bq, P, C, 1, 0);
    sums_finalize_kernel<<<warp_blocks(per_b ? Bq * C : C), EW, 0, g_stream>>>(m->red_ws, out, Bq, S, C, per_b,
                                                                                accumulate);
    cudaCheck(cudaGetLastError());
}

// V channels a thread for C channels of type T (16-byte vectors where C allows)
template <typename T>
static int chan_vec(int C) { return C % VEC<T> == 0 ? VEC<T> : 1; }
// The pixel-walking kernels' grid for 256 threads: Bq samples x S pixel chunks, S filling one wave of resident
// blocks (a partial second wave would cost as much as a full one), at least one pixel a lane
static dim3 pixel_walk_grid(const void* kernel, int Bq, int P, int C, int V) {
    if (C / V > 256) {
        fprintf(stderr, "internal error: %d channels for a pixel walk of 256 threads\n", C);
        exit(EXIT_FAILURE);
    }
    int per_sm = 0;
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0));
    const int lanes = 256 / (C / V);
    return dim3(Bq, std::max(1, std::min(ceil_div(P, lanes), std::max(1, per_sm) * g_num_sms / Bq)));
}
template <typename T>
static void groupnorm_forward(const UNet* m, const NormP& n, const T* x, T* y, float* mean, float* rstd, int P,
                              int silu) {
    const int G = 32, B = m->B;
    int S = chan_reduce<0, T>(m, x, nullptr, nullptr, nullptr, nullptr, nullptr, B, P, n.C, G, 0);
    gn_stats_finalize_kernel<<<warp_blocks(B * G), EW, 0, g_stream>>>(m->red_ws, m->p + n.w, m->p + n.b, mean, rstd,
                                                                       m->gn_scale, B, S, n.C, G, P, 1e-5f);
    cudaCheck(cudaGetLastError());
    const int V = chan_vec<T>(n.C);
    auto k = V > 1 ? gn_apply_kernel<T, VEC<T>> : gn_apply_kernel<T, 1>;
    k<<<pixel_walk_grid((const void*)k, B, P, n.C, V), 256, 0, g_stream>>>(x, y, m->gn_scale, P, n.C, silu);
    cudaCheck(cudaGetLastError());
}
template <typename T>
static void groupnorm_backward(const UNet* m, const NormP& n, const T* x, const T* dy, T* dx, const float* mean,
                               const float* rstd, int P, int silu, bool accumulate) {
    const int G = 32, B = m->B;
    const float *gamma = m->p + n.w, *beta = m->p + n.b;
    int S = chan_reduce<1, T>(m, x, dy, mean, rstd, gamma, beta, B, P, n.C, G, silu);
    gn_bwd_finalize_kernel<<<warp_blocks(n.C + B * G), EW, 0, g_stream>>>(m->red_ws, gamma, beta, rstd, m->g + n.w,
                                                                           m->g + n.b, m->gn_coef, B, S, n.C, G, P);
    cudaCheck(cudaGetLastError());
    const int V = chan_vec<T>(n.C);
    auto k = V > 1 ? gn_bwd_apply_kernel<T, VEC<T>> : gn_bwd_apply_kernel<T, 1>;
    k<<<pixel_walk_grid((const void*)k, B, P, n.C, V), 256, 0, g_stream>>>(x, dy, dx, mean, m->gn_coef, P, n.C, G, silu,
                                                                         accumulate);
    cudaCheck(cudaGetLastError());
}

// elementwise launchers: 16-byte vectors where the channel counts allow (C: the innermost extent)
template <typename T>
static void add_act(const T* x, T* y, size_t n, int C, bool accumulate) {
    if (C % VEC<T> == 0) add_kernel<T, VEC<T>><<<ceil_div(n / VEC<T>, EW), EW, 0, g_stream>>>(x, y, n, accumulate);
    else add_kernel<T, 1><<<ceil_div(n, EW), EW, 0, g_stream>>>(x, y, n, accumulate);
    cudaCheck(cudaGetLastError());
}
template <typename T>
static void add_bias(T* out, const float* bias, const T* res, size_t rows, int N) {
    const size_t n = rows * N;
    if (N % VEC<T> == 0)
        add_bias_kernel<T, VEC<T>><<<ceil_div(n / VEC<T>, EW), EW, 0, g_stream>>>(out, bias, res, n, N);
    else add_bias_kernel<T, 1><<<ceil_div(n, EW), EW, 0, g_stream>>>(out, bias, res, n, N);
    cudaCheck(cudaGetLastError());
}
template <typename T>
static void concat_act(const T* a, const T* b, T* out, size_t BP, int C1, int C2) {
    const size_t n = BP * (C1 + C2);
    if (C1 % VEC<T> == 0 && C2 % VEC<T> == 0)
        concat_kernel<T, VEC<T>><<<ceil_div(n / VEC<T>, EW), EW, 0, g_stream>>>(a, b, out, BP, C1, C2);
    else concat_kernel<T, 1><<<ceil_div(n, EW), EW, 0, g_stream>>>(a, b, out, BP, C1, C2);
    cudaCheck(cudaGetLastError());
}
template <typename T>
static void split_backward_act(const T* dcat, T* da, T* db, size_t BP, int C1, int C2, bool acc_a, bool acc_b) {
    const size_t n = BP * (C1 + C2);
    if (C1 % VEC<T> == 0 && C2 % VEC<T> == 0)
        split_backward_kernel<T, VEC<T>><<<ceil_div(n / VEC<T>, EW), EW, 0, g_stream>>>(dcat, da, db, BP, C1, C2,
                                                                                       acc_a, acc_b);
    else split_backward_kernel<T, 1><<<ceil_div(n, EW), EW, 0, g_stream>>>(dcat, da, db, BP, C1, C2, acc_a, acc_b);
    cudaCheck(cudaGetLastError());
}
template <typename T>
static void upsample_act(const T* x, T* out, int B, int H, int W, int C) {
    const size_t n = (size_t)B * 4 * H * W * C;
    if (C % VEC<T> == 0) upsample_kernel<T, VEC<T>><<<ceil_div(n / VEC<T>, EW), EW, 0, g_stream>>>(x, out, B, H, W, C);
    else upsample_kernel<T, 1><<<ceil_div(n, EW), EW, 0, g_stream>>>(x, out, B, H, W, C);
    cudaCheck(cudaGetLastError());
}
template <typename T>
static void upsample_backward_act(const T* dout, T* dx, int B, int H, int W, int C, bool accumulate) {
    const size_t n = (size_t)B * H * W * C;
    if (C % VEC<T> == 0)
        upsample_backward_kernel<T, VEC<T>><<<ceil_div(n / VEC<T>, EW), EW, 0, g_stream>>>(dout, dx, B, H, W, C,
                                                                                           accumulate);
    else upsample_backward_kernel<T, 1><<<ceil_div(n, EW), EW, 0, g_stream>>>(dout, dx, B, H, W, C, accumulate);
    cudaCheck(cudaGetLastError());
}

// row-major C (M x N) = alpha op(A) op(B) + beta C for bf16 A and B, fp32 accumulation; C bf16 or fp32 (ctype)
static void gemm_rm_bf16(bool tA, bool tB, int M, int N, int K, const bf16* A, int lda, const bf16* Bm, int ldb,
                         void* C, cudaDataType ctype, int ldc, float alpha, float beta) {
    cublasCheck(cublasGemmEx(g_cublas, tB ? CUBLAS_OP_T : CUBLAS_OP_N, tA ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha,
                             Bm, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C, ctype, ldc, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
}
// y (rows, out) = x (rows, in) W^T + b (+ res)
template <typename T>
static void linear_forward(const UNet* m, const LinP& l, const T* x, T* y, int rows, const T* res) {
    if constexpr (std::is_same<T, bf16>::value)
        gemm_rm_bf16(false, true, rows, l.out, l.in, x, l.in, m->pw + l.w, l.in, y, CUDA_R_16BF, l.out, 1.f, 0.f);
    else gemm_rm(false, true, rows, l.out, l.in, x, l.in, m->p + l.w, l.in, y, l.out, 1.f, 0.f);
    add_bias(y, m->p + l.b, res, rows, l.out);
}
// dW = dy^T x, db = column sums of dy (rows = Bq * P; `db_from`: the same sums already made for another layer),
// dx (+)= dy W (skipped when dx is null)
template <typename T>
static void linear_backward(const UNet* m, const LinP& l, const T* x, const T* dy, T* dx, int Bq, int P,
                            bool accumulate, const float* db_from = nullptr) {
    int rows = Bq * P;
    if constexpr (std::is_same<T, bf16>::value) {
        gemm_rm_bf16(true, false, l.out, l.in, rows, dy, l.out, x, l.in, m->g + l.w, CUDA_R_32F, l.in, 1.f, 0.f);
        if (dx) gemm_rm_bf16(false, false, rows, l.in, l.out, dy, l.out, m->pw + l.w, l.in, dx, CUDA_R_16BF, l.in,
                             1.f, accumulate ? 1.f : 0.f);
    } else {
        gemm_rm(true, false, l.out, l.in, rows, dy, l.out, x, l.in, m->g + l.w, l.in, 1.f, 0.f);
        if (dx) gemm_rm(false, false, rows, l.in, l.out, dy, l.out, m->p + l.w, l.in, dx, l.in, 1.f,
                        accumulate ? 1.f : 0.f);
    }
    if (db_from)
        cudaCheck(cudaMemcpyAsync(m->g + l.b, db_from, l.out * sizeof(float), cudaMemcpyDeviceToDevice, g_stream));
    else channel_sums(m, dy, m->g + l.b, Bq, P, l.out, 0, 0);
}

static bool take_flag(Buf* b) {  // true if b's gradient already holds a value (so accumulate), then marks it
    bool w = b->g_written;
    b->g_written = true;
    return w;
}

// ---------------------------------------------------------------------------------------------------------------
// per-layer timing (UNET_PROFILE=1: events around every op, synchronising, so only for looking, not for speed)

static bool g_profile = false;
static double g_prof_ms[2][8];
static cudaEvent_t g_pe0, g_pe1;
static const char* OP_NAMES[8] = {"conv_in", "resblock", "attention", "downsample", "upsample", "concat", "out",
                                  "rest (time embed, loss, AdamW)"};
static void prof_begin() {
    if (g_profile) cudaCheck(cudaEventRecord(g_pe0, g_stream));
}
static void prof_end(int dir, int kind) {
    if (!g_profile) return;
    cudaCheck(cudaEventRecord(g_pe1, g_stream));
    cudaCheck(cudaEventSynchronize(g_pe1));
    float ms;
    cudaCheck(cudaEventElapsedTime(&ms, g_pe0, g_pe1));
    g_prof_ms[dir][kind] += ms;
}
static void profile_report(int steps) {
    if (steps < 1) return;
    double tot[2] = {0, 0};
    printf("per-step GPU time by layer kind (UNET_PROFILE, %d steps, synchronised per op):\n", steps);
    printf("  %-32s %10s %10s\n", "kind", "forward", "backward");
    for (int k = 0; k < 8; k++) {
        printf("  %-32s %7.2f ms %7.2f ms\n", OP_NAMES[k], g_prof_ms[0][k] / steps, g_prof_ms[1][k] / steps);
        tot[0] += g_prof_ms[0][k] / steps;
        tot[1] += g_prof_ms[1][k] / steps;
    }
    printf("  %-32s %7.2f ms %7.2f ms\n", "total", tot[0], tot[1]);
}

// ---------------------------------------------------------------------------------------------------------------
// forward

template <typename T>
static void res_forward(UNet* m, Op& o) {
    int P = o.H * o.W, B = m->B;
    groupnorm_forward(m, o.n1, act<T>(o.in), act<T>(o.a1), o.mean1, o.rstd1, P, 1);
    conv3x3_forward(m, o.c1, act<T>(o.a1), act<T>(o.h1), o.H, o.W, o.embo, nullptr);  // embo: emb_layers_forward
    groupnorm_forward(m, o.n2, act<T>(o.h1), act<T>(o.a2), o.mean2, o.rstd2, P, 1);
    if (o.has_skip) linear_forward(m, o.skip, act<T>(o.in), act<T>(o.out), B * P, (const T*)nullptr);
    const T* res = o.has_skip ? act<T>(o.out) : act<T>(o.in);
    conv3x3_forward(m, o.c2, act<T>(o.a2), act<T>(o.out), o.H, o.W, nullptr, res);  // out = skip(x) + h
}

// The softmax lab's choice of (GROUP, CHUNKS) for a row of `need` 16-byte chunks (its by_row_chunks): 256 columns
// -> <32, 2>, 64 -> <16, 1>. need counts the row's offset in its 16-byte frame (rows of any other length or
// alignment can start anywhere in it). 256 threads per block.
template <typename F>
static void softmax_dispatch(const float* base, int cols, F launch) {
    int off = cols % 4 == 0 ? (int)(((uintptr_t)base >> 2) & 3) : 3;
    int need = (off + cols + 3) / 4;
    if (need <= 4) launch(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
    else if (need <= 8) launch(std::integral_constant<int, 8>{}, std::integral_constant<int, 1>{});
    else if (need <= 16) launch(std::integral_constant<int, 16>{}, std::integral_constant<int, 1>{});
    else if (need <= 32) launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 1>{});
    else if (need <= 64) launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 2>{});
    else if (need <= 128) launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 4>{});
    else if (need <= 256) launch(std::integral_constant<int, 32>{}, std::integral_constant<int, 8>{});
    else {
        fprintf(stderr, "internal error: attention rows of %d keys are longer than the softmax kernels hold\n", cols);
        exit(EXIT_FAILURE);
    }
}
// S (rows, L) = softmax(S) in place
static void softmax_forward(float* S, int rows, int L) {
    softmax_dispatch(S, L, [&](auto group, auto chunks) {
        constexpr int G = decltype(group)::value, K = decltype(chunks)::value;
        softmax_forward_kernel4<G, K><<<ceil_div(rows, 256 / G), 256, 0, g_stream>>>(S, S, rows, L);
        cudaCheck(cudaGetLastError());
    });
}
// dP (rows, L) = P * (dP - sum(P * dP)) in place
static void softmax_backward(const float* P, float* dP, int rows, int L) {
    softmax_dispatch(P, L, [&](auto group, auto chunks) {
        constexpr int G = decltype(group)::value, K = decltype(chunks)::value;
        softmax_backward_kernel3<G, K><<<ceil_div(rows, 256 / G), 256, 0, g_stream>>>(dP, P, dP, rows, L);
        cudaCheck(cudaGetLastError());
    });
}

// bf16 fused attention (attn_fwd_kernel, attn_bwd_dq_kernel, attn_bwd_dkv_kernel) of one layer: grids of (pair,
// 64-row blocks), the pair's keys and values in shared memory
template <int D>
static size_t attn_smem(int L, int kind) {  // kind 0 forward, 1 dQ, 2 dK dV
    const int Lp = (L + 15) / 16 * 16;
    return (size_t)(2 * Lp + (kind == 0 ? 1 : 2) * ATT_ROWS) * (D + 8) * sizeof(bf16) + (kind == 2 ? 2 * Lp * 4 : 0);
}
template <int D>
static void attn_fused_launch(const UNet* m, const Op& o, bool forward) {
    static bool attr_set = false;  // up to 94 KB of shared memory (D = 64, L = 256): an opt-in, once per D
    if (!attr_set) {
        cudaCheck(cudaFuncSetAttribute(attn_fwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)attn_smem<D>(ATT_LMAX, 0)));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_dq_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)attn_smem<D>(ATT_LMAX, 1)));
        cudaCheck(cudaFuncSetAttribute(attn_bwd_dkv_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)attn_smem<D>(ATT_LMAX, 2)));
        attr_set = true;
    }
    const int L = o.L;
    const float scale = (float)(1.0 / sqrt((double)D));
    dim3 grid(m->B * o.heads, ceil_div(L, ATT_ROWS));
    if (forward) {
        attn_fwd_kernel<D><<<grid, 128, attn_smem<D>(L, 0), g_stream>>>(o.qkvb->xb, o.att->xb, o.lse, L, o.heads,
                                                                         scale);
        cudaCheck(cudaGetLastError());
        return;
    }
    attn_bwd_dq_kernel<D><<<grid, 128, attn_smem<D>(L, 1), g_stream>>>(o.qkvb->xb, o.att->xb, o.att->gb, o.lse,
                                                                        m->attn_di, o.qkvb->gb, L, o.heads, scale);
    cudaCheck(cudaGetLastError());
    attn_bwd_dkv_kernel<D><<<grid, 128, attn_smem<D>(L, 2), g_stream>>>(o.qkvb->xb, o.att->gb, o.lse, m->attn_di,
                                                                         o.qkvb->gb, L, o.heads, scale);
    cudaCheck(cudaGetLastError());
}
static void attn_fused(const UNet* m, const Op& o, bool forward) {
    switch (o.in->C / o.heads) {
    case 16: attn_fused_launch<16>(m, o, forward); break;
    case 32: attn_fused_launch<32>(m, o, forward); break;
    default: attn_fused_launch<64>(m, o, forward); break;
    }
}

// the attention core: fused (bf16, attn_fused_ok) or fp32 (cuBLAS, TF32 unless strict); a bf16 layer the fused
// kernels cannot take converts its operands in and out of m->attn32 (qkv, a and their gradients)
template <typename T>
static void attn_forward(UNet* m, Op& o) {
    int B = m->B, L = o.L, C = o.in->C, d = C / o.heads, nb = B * o.heads;
    groupnorm_forward(m, o.n1, act<T>(o.in), act<T>(o.xn), o.mean1, o.rstd1, L, 0);
    linear_forward(m, o.qkv, act<T>(o.xn), act<T>(o.qkvb), B * L, (const T*)nullptr);
    if constexpr (std::is_same<T, bf16>::value) {
        if (o.lse) {
            attn_fused(m, o, true);
            linear_forward(m, o.proj, act<T>(o.att), act<T>(o.out), B * L, (const T*)act<T>(o.in));
            return;
        }
        attn_to_fp32(o.qkvb->xb, o.qkvb->n, m->attn32);
    }
    const float* const* pp = o.ptrs;
    float scale2 = (float)(1.0 / sqrt((double)d));  // (q d^-1/4) . (k d^-1/4)
    // S = Q K^T scale2 (L x L per (b, head)), softmax over keys, O = P V
    gemm_rm_batched(false, true, L, L, d, pp + 0 * nb, 3 * C, pp + 1 * nb, 3 * C, (float* const*)(pp + 3 * nb), L,
                    scale2, 0.f, nb);
    int rows = nb * L;
    softmax_forward(o.P, rows, L);
    gemm_rm_batched(false, false, L, d, L, pp + 3 * nb, L, pp + 2 * nb, 3 * C, (float* const*)(pp + 4 * nb), C, 1.f,
                    0.f, nb);
    if constexpr (std::is_same<T, bf16>::value) attn_from_fp32(m->attn32 + 2 * m->attn32_part, o.att->xb, o.att->n);
    linear_forward(m, o.proj, act<T>(o.att), act<T>(o.out), B * L, (const T*)act<T>(o.in));  // x + proj_out(a)
}

template <typename T>
static void unet_forward_t(UNet* m) {
    int B = m->B, MC = m->cfg.model_channels;
    prof_begin();
    timestep_embedding_kernel<<<ceil_div(B * MC, EW), EW, 0, g_stream>>>(m->t, m->temb, B, MC);
    cudaCheck(cudaGetLastError());
    linear_forward<float>(m, m->te0, m->temb, m->te_h, B, nullptr);
    size_t ne = (size_t)B * m->E;
    silu_kernel<<<ceil_div(ne, EW), EW, 0, g_stream>>>(m->te_h, m->te_a, ne);
    cudaCheck(cudaGetLastError());
    linear_forward<float>(m, m->te2, m->te_a, m->emb, B, nullptr);
    silu_kernel<<<ceil_div(ne, EW), EW, 0, g_stream>>>(m->emb, m->emb_s, ne);
    cudaCheck(cudaGetLastError());
    if (m->emb_layers) {  // every resblock's emb_layers output (embo), added in its first conv's epilogue
        emb_layers_forward_kernel<<<warp_blocks(m->emb_total), EW, 0, g_stream>>>(m->p, m->emb_s, m->emb_rows,
                                                                                  m->emb_layers, m->emb_total, B,
                                                                                  m->E);
        cudaCheck(cudaGetLastError());
    }
    prof_end(0, 7);
    for (Op& o : m->ops) {
        prof_begin();
        switch (o.kind) {
        case OP_CONV_IN:
        case OP_DOWN: conv3x3_forward(m, o.c1, act<T>(o.in), act<T>(o.out), o.H, o.W, nullptr, nullptr); break;
        case OP_RES: res_forward<T>(m, o); break;
        case OP_ATTN: attn_forward<T>(m, o); break;
        case OP_UP:
            upsample_act(act<T>(o.in), act<T>(o.up), B, o.H, o.W, o.in->C);
            conv3x3_forward(m, o.c1, act<T>(o.up), act<T>(o.out), 2 * o.H, 2 * o.W, nullptr, nullptr);
            break;
        case OP_CAT:
            concat_act(act<T>(o.in), act<T>(o.in2), act<T>(o.out), (size_t)B * o.H * o.W, o.in->C, o.in2->C);
            break;
        case OP_OUT:
            groupnorm_forward(m, o.n1, act<T>(o.in), act<T>(o.a1), o.mean1, o.rstd1, o.H * o.W, 1);
            conv3x3_forward(m, o.c1, act<T>(o.a1), act<T>(o.out), o.H, o.W, nullptr, nullptr);
            break;
        }
        prof_end(0, (int)o.kind);
    }
}
// m->out = model(m->xt, m->t) in the model's precision
static void unet_forward(UNet* m) {
    if (m->prec == PREC_BF16) unet_forward_t<bf16>(m);
    else unet_forward_t<float>(m);
}

// loss = mean((out - noise)^2) into m->loss (device), and out's gradient
template <typename T>
static void unet_loss_t(UNet* m) {
    size_t n = m->out->n;
    mse_kernel<<<m->loss_blocks, 256, 0, g_stream>>>(act<T>(m->out), m->noise, grad<T>(m->out), m->loss_partial, n);
    cudaCheck(cudaGetLastError());
    loss_finalize_kernel<<<1, 32, 0, g_stream>>>(m->loss_partial, m->loss_blocks, n, m->loss);
    cudaCheck(cudaGetLastError());
}
static void unet_loss(UNet* m) {
    if (m->prec == PREC_BF16) unet_loss_t<bf16>(m);
    else unet_loss_t<float>(m);
}
// per_sample (B, device) = each sample's loss
static void unet_loss_per_sample(UNet* m, float* per_sample) {
    const int per = (int)(m->out->n / m->B);
    if (m->prec == PREC_BF16) sample_mse_kernel<<<m->B, 256, 0, g_stream>>>(m->out->xb, m->noise, per_sample, per);
    else sample_mse_kernel<<<m->B, 256, 0, g_stream>>>(m->out->x, m->noise, per_sample, per);
    cudaCheck(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------------------------
// backward (every parameter gradient is written, not accumulated: no zeroing needed)

template <typename T>
static void res_backward(UNet* m, Op& o) {
    int P = o.H * o.W, B = m->B;
    T* dout = grad<T>(o.out);
    // out = skip(x) + conv2(a2)
    conv3x3_backward_weight(m, o.c2, act<T>(o.a2), (const T*)dout, o.H, o.W);
    channel_sums(m, dout, m->g + o.c2.b, B, P, o.c2.cout, 0, 0);
    conv3x3_backward_data(m, o.c2, (const T*)dout, grad<T>(o.a2), o.H, o.W, false);
    bool acc = take_flag(o.in);
    if (o.has_skip)  // its bias gradient: the column sums of dout, as conv2's
        linear_backward(m, o.skip, act<T>(o.in), (const T*)dout, grad<T>(o.in), B, P, acc, m->g + o.c2.b);
    else {
        add_act((const T*)dout, grad<T>(o.in), o.in->n, o.in->C, acc);
    }
    // a2 = silu(gn2(h1))
    groupnorm_backward(m, o.n2, act<T>(o.h1), grad<T>(o.a2), grad<T>(o.h1), o.mean2, o.rstd2, P, 1, false);
    // h1 = conv1(a1) + bias + embo[b]
    int S = chan_reduce<2, T>(m, grad<T>(o.h1), nullptr, nullptr, nullptr, nullptr, nullptr, B, P, o.c1.cout, 1, 0);
    sums_finalize_kernel<<<warp_blocks(B * o.c1.cout), EW, 0, g_stream>>>(m->red_ws, o.d_embo, B, S, o.c1.cout, 1, 0);
    cudaCheck(cudaGetLastError());
    sums_finalize_kernel<<<warp_blocks(o.c1.cout), EW, 0, g_stream>>>(m->red_ws, m->g + o.c1.b, B, S, o.c1.cout, 0, 0);
    cudaCheck(cudaGetLastError());
    conv3x3_backward_weight(m, o.c1, act<T>(o.a1), (const T*)grad<T>(o.h1), o.H, o.W);
    conv3x3_backward_data(m, o.c1, (const T*)grad<T>(o.h1), grad<T>(o.a1), o.H, o.W, false);
    // a1 = silu(gn1(x))
    acc = take_flag(o.in);
    groupnorm_backward(m, o.n1, act<T>(o.in), grad<T>(o.a1), grad<T>(o.in), o.mean1, o.rstd1, P, 1, acc);
}

// the fp32 core's backward (cuBLAS batched products, the softmax lab's backward)
template <typename T>
static void attn_core_backward(UNet* m, Op& o) {
    int B = m->B, L = o.L, C = o.in->C, d = C / o.heads, nb = B * o.heads;
    const float* const* pp = o.ptrs;
    // O = P V: dV = P^T dO, dP = dO V^T; softmax backward; dQ = scale2 dS K, dK = scale2 dS^T Q
    float scale2 = (float)(1.0 / sqrt((double)d));
    gemm_rm_batched(true, false, L, d, L, pp + 3 * nb, L, pp + 8 * nb, C, (float* const*)(pp + 7 * nb), 3 * C, 1.f,
                    0.f, nb);
    gemm_rm_batched(false, true, L, L, d, pp + 8 * nb, C, pp + 2 * nb, 3 * C, (float* const*)(pp + 9 * nb), L, 1.f,
                    0.f, nb);
    int rows = nb * L;
    softmax_backward(o.P, m->dS, rows, L);
    gemm_rm_batched(false, false, L, d, L, pp + 9 * nb, L, pp + 1 * nb, 3 * C, (float* const*)(pp + 5 * nb), 3 * C,
                    scale2, 0.f, nb);
    gemm_rm_batched(true, false, L, d, L, pp + 9 * nb, L, pp + 0 * nb, 3 * C, (float* const*)(pp + 6 * nb), 3 * C,
                    scale2, 0.f, nb);
    if constexpr (std::is_same<T, bf16>::value) attn_from_fp32(m->attn32 + m->attn32_part, o.qkvb->gb, o.qkvb->n);
}

template <typename T>
static void attn_backward(UNet* m, Op& o) {
    int B = m->B, L = o.L;
    T* dout = grad<T>(o.out);
    // out = x + att W^T + b
    bool acc = take_flag(o.in);
    add_act((const T*)dout, grad<T>(o.in), o.in->n, o.in->C, acc);
    linear_backward(m, o.proj, act<T>(o.att), (const T*)dout, grad<T>(o.att), B, L, false);
    bool core = true;
    if constexpr (std::is_same<T, bf16>::value) {
        if (o.lse) {
            attn_fused(m, o, false);
            core = false;
        } else {  // the core's fp32 operands: q, k, v again (shared scratch), dO
            attn_to_fp32(o.qkvb->xb, o.qkvb->n, m->attn32);
            attn_to_fp32(o.att->gb, o.att->n, m->attn32 + 3 * m->attn32_part);
        }
    }
    if (core) attn_core_backward<T>(m, o);
    // qkv = xn W^T + b; xn = gn(x)
    linear_backward(m, o.qkv, act<T>(o.xn), (const T*)grad<T>(o.qkvb), grad<T>(o.xn), B, L, false);
    acc = take_flag(o.in);
    groupnorm_backward(m, o.n1, act<T>(o.in), grad<T>(o.xn), grad<T>(o.in), o.mean1, o.rstd1, L, 0, acc);
}

// The parameters (their offsets, to f) whose gradients the backward pass finishes with op i (ops run from the last);
// i = -1: those finished at its end, the time embedding and every resblock's emb_layers (unet_backward_t)
template <class F>
static void op_grad_params(const UNet* m, int i, F f) {
    auto lin = [&](const LinP& l) { f(l.w); f(l.b); };
    auto conv = [&](const ConvP& c) { f(c.w); f(c.b); };
    auto norm = [&](const NormP& n) { f(n.w); f(n.b); };
    if (i < 0) {
        lin(m->te0);
        lin(m->te2);
        for (const Op& o : m->ops)
            if (o.kind == OP_RES) lin(o.emb);
        return;
    }
    const Op& o = m->ops[i];
    switch (o.kind) {
    case OP_CONV_IN: case OP_DOWN: case OP_UP: conv(o.c1); break;
    case OP_RES:
        norm(o.n1); conv(o.c1); norm(o.n2); conv(o.c2);
        if (o.has_skip) lin(o.skip);
        break;
    case OP_ATTN: norm(o.n1); lin(o.qkv); lin(o.proj); break;
    case OP_OUT: norm(o.n1); conv(o.c1); break;
    case OP_CAT: break;
    }
}

// Several GPUs: called after the backward of each op (its index) and once at the end (-1), so that the gradient
// all-reduce of a bucket starts as soon as its gradients are written (dist_grad_ready). Null on one GPU.
static void (*g_grad_ready)(UNet* m, int op) = nullptr;
// --optimizer muon with the overlap on: the same points start the Newton-Schulz of the weights they finish
static void muon_grads_ready(UNet* m, int op);

// The emb_layers weight and bias gradients of table rows [row0, m->emb_grad_from) (the resblocks' d_embo final)
static void emb_weight_grads(UNet* m, int row0) {
    if (row0 >= m->emb_grad_from) return;
    emb_layers_weight_grad_kernel<<<warp_blocks(m->emb_grad_from - row0), EW, 0, g_stream>>>(
        m->g, m->emb_s, m->emb_rows, m->emb_layers, row0, m->emb_grad_from, m->B, m->E);
    cudaCheck(cudaGetLastError());
    m->emb_grad_from = row0;
}

template <typename T>
static void unet_backward_t(UNet* m) {
    int B = m->B;
    m->emb_grad_from = m->emb_total;
    for (Buf* b : m->bufs) b->g_written = false;
    m->out->g_written = true;  // written by unet_loss
    for (int i = (int)m->ops.size() - 1; i >= 0; i--) {
        Op& o = m->ops[i];
        prof_begin();
        switch (o.kind) {
        case OP_CONV_IN:  // the input needs no gradient
            conv3x3_backward_weight(m, o.c1, act<T>(o.in), (const T*)grad<T>(o.out), o.H, o.W);
            channel_sums(m, grad<T>(o.out), m->g + o.c1.b, B, o.H * o.W, o.c1.cout, 0, 0);
            break;
        case OP_DOWN: {
            int P = (o.H / 2) * (o.W / 2);
            conv3x3_backward_weight(m, o.c1, act<T>(o.in), (const T*)grad<T>(o.out), o.H, o.W);
            channel_sums(m, grad<T>(o.out), m->g + o.c1.b, B, P, o.c1.cout, 0, 0);
            conv3x3_backward_data(m, o.c1, (const T*)grad<T>(o.out), grad<T>(o.in), o.H, o.W, take_flag(o.in));
            break;
        }
        case OP_RES: res_backward<T>(m, o); break;
        case OP_ATTN: attn_backward<T>(m, o); break;
        case OP_UP: {
            int H2 = 2 * o.H, W2 = 2 * o.W;
            conv3x3_backward_weight(m, o.c1, act<T>(o.up), (const T*)grad<T>(o.out), H2, W2);
            channel_sums(m, grad<T>(o.out), m->g + o.c1.b, B, H2 * W2, o.c1.cout, 0, 0);
            conv3x3_backward_data(m, o.c1, (const T*)grad<T>(o.out), grad<T>(o.up), H2, W2, false);
            bool acc = take_flag(o.in);
            upsample_backward_act(grad<T>(o.up), grad<T>(o.in), B, o.H, o.W, o.in->C, acc);
            break;
        }
        case OP_CAT: {
            bool acc_a = take_flag(o.in), acc_b = take_flag(o.in2);
            split_backward_act(grad<T>(o.out), grad<T>(o.in), grad<T>(o.in2), (size_t)B * o.H * o.W, o.in->C,
                               o.in2->C, acc_a, acc_b);
            break;
        }
        case OP_OUT: {
            int P = o.H * o.W;
            conv3x3_backward_weight(m, o.c1, act<T>(o.a1), (const T*)grad<T>(o.out), o.H, o.W);
            channel_sums(m, grad<T>(o.out), m->g + o.c1.b, B, P, o.c1.cout, 0, 0);
            conv3x3_backward_data(m, o.c1, (const T*)grad<T>(o.out), grad<T>(o.a1), o.H, o.W, false);
            groupnorm_backward(m, o.n1, act<T>(o.in), grad<T>(o.a1), grad<T>(o.in), o.mean1, o.rstd1, P, 1,
                               take_flag(o.in));
            break;
        }
        }
        prof_end(1, (int)o.kind);
        if (g_grad_ready) g_grad_ready(m, i);
        if (m->muon) muon_grads_ready(m, i);
    }
    prof_begin();
    // the resblocks' emb_layers (their d_embo from res_backward): weight gradients (those not written yet) and d_emb_s
    if (m->emb_layers) {
        emb_weight_grads(m, 0);
        emb_layers_input_grad_kernel<<<dim3(ceil_div(m->E, 32), B), 256, 0, g_stream>>>(m->p, m->d_emb_s,
                                                                                        m->emb_rows, m->emb_layers,
                                                                                        m->E);
        cudaCheck(cudaGetLastError());
    } else {
        cudaCheck(cudaMemsetAsync(m->d_emb_s, 0, (size_t)B * m->E * sizeof(float), g_stream));
    }
    // time embedding: emb_s = silu(emb), emb = te2(silu(te0(temb)))
    size_t ne = (size_t)B * m->E;
    silu_backward_kernel<<<ceil_div(ne, EW), EW, 0, g_stream>>>(m->emb, m->d_emb_s, m->d_emb, ne);
    cudaCheck(cudaGetLastError());
    linear_backward<float>(m, m->te2, m->te_a, m->d_emb, m->d_te, B, 1, false);
    silu_backward_kernel<<<ceil_div(ne, EW), EW, 0, g_stream>>>(m->te_h, m->d_te, m->d_te, ne);
    cudaCheck(cudaGetLastError());
    linear_backward<float>(m, m->te0, m->temb, m->d_te, nullptr, B, 1, false);
    prof_end(1, 7);
    if (g_grad_ready) g_grad_ready(m, -1);
    if (m->muon) muon_grads_ready(m, -1);
}
// every parameter gradient into m->g from out's gradient (unet_loss)
static void unet_backward(UNet* m) {
    if (m->prec == PREC_BF16) unet_backward_t<bf16>(m);
    else unet_backward_t<float>(m);
}

// ---------------------------------------------------------------------------------------------------------------
// --optimizer muon: the plan of the group buffers (host), their allocation and the step (kernels: "Muon" above)

enum Optimizer { OPT_ADAMW = 0, OPT_MUON = 1 };  // the checkpoint header's field optimizer
static const char* OPTIMIZER_NAME[2] = {"adamw", "muon"};
// how matrices of different shapes share a group: auto (the cost model of muon_plan_groups), shape (one group per
// distinct shape), one (a single group). UNET_MUON_GROUPS sets it (measurements; dev/test_unet.cu checks all three).
enum MuonGrouping { MG_AUTO = 0, MG_SHAPE = 1, MG_ONE = 2 };
static const char* MUON_GROUPING_NAME[3] = {"auto", "shape", "one"};
enum MuonNs { MUON_NS_STANDARD = 0, MUON_NS_GRAM = 1 };  // --muon_ns: the form of the Newton-Schulz iteration
static const char* MUON_NS_NAME[2] = {"standard", "gram"};

struct MuonLtCall;  // one cached cuBLASLt product (muon_gemm)
struct MuonPlan {
    float lr = 0.02f, momentum = 0.95f;
    int nesterov = 1, ns_steps = 5, grouping = MG_AUTO, ns = MUON_NS_STANDARD;
    bool cpu = false;   // the tables and buffers are host arrays (dev/test_unet.cu runs the step on the CPU)
    bool half = false;  // bf16 group buffers and products (--precision bf16: torch's Muon iterates in bf16)
    // each group's momentum, normalisation and Newton-Schulz on the side stream from the point of the backward pass
    // that finishes its gradients (muon_grads_ready), joined before the update; off: all of it after the backward on
    // g_stream. The same kernels on the same buffers in the same order: the same bits. Only a caller that runs the
    // update after every backward may set it (the trainer, one rank: UNET_MUON_OVERLAP).
    bool overlap = false;
    // the bf16 path on the GPU (half, not cpu): a phase's products each one muon_mm_kernel over all its matrices,
    // whatever their shapes; else each group's a strided batch (muon_gemm)
    bool grouped = false;
    bool pdl = false;  // grouped on compute capability 9.0+: muon_mm_kernel with Programmatic Dependent Launch
    bool wg = false;   // grouped, an sm_90a build on a 9.0 GPU: the m x m products on muon_sq_wgmma_kernel
    std::vector<MuonMat> mats;      // ordered by w_off
    std::vector<MuonGroup> groups;  // ordered by ready (then w_off)
    // phase p: groups phase_first[p] .. phase_first[p + 1] - 1, started once the backward has finished stage
    // phase_ready[p]; grouped: the phases of muon_plan's cost model, each group a shape; else a group each
    std::vector<int> phase_first, phase_ready;
    std::vector<int> first_chunk, adam_idx;  // chunks of matrix k (+ the end); AdamW's elements
    std::vector<size_t> chunk_start, chunk_end;
    std::vector<MuonTile> tiles;  // the GPU's 32 x 32 tiles of every matrix, group by group
    std::vector<int> tile_first;  // group k's tiles: tile_first[k] .. tile_first[k + 1] - 1
    size_t w_elems = 0, s_elems = 0;
    int n_stages = 1;    // the backward's stages (muon_stages): op i of n finishes stage n - 1 - i, its end stage n
    double gflop = 0.0;  // Newton-Schulz work per step, padding included
    int launches = 0;    // kernels and products per step (the AdamW step counter and the bf16 weight copy included)
    double est_us = 0.0, est_exposed_us = 0.0;  // the cost model's Optimizer time, and what of it outlasts the backward
    // on the side that runs the step
    MuonMat* t_mats = nullptr;
    MuonTile* t_tiles = nullptr;
    int *t_adam_idx = nullptr, *t_first_chunk = nullptr;
    size_t *t_chunk_start = nullptr, *t_chunk_end = nullptr;
    void* x[2] = {nullptr, nullptr};  // the group buffers (the iteration alternates between them)
    // m_pad x m_pad per matrix: standard A = X X^T and B = b A + c A^2 (sq[0], sq[1]); gram R, then Z, Q and a
    // product's output in turn (all four)
    void* sq[4] = {nullptr, nullptr, nullptr, nullptr};
    float *partial = nullptr, *sumsq = nullptr;
    std::vector<char> started;  // per phase: its work is queued in this step (muon_step clears it)
    cudaStream_t side = nullptr;
    std::vector<cudaEvent_t> fork;  // per phase: its gradients are final (recorded on g_stream)
    // grouped: muon_mm_kernel's tiles per phase and kind (MUON_MM_KINDS p + kind), their counts; GRAM's split-K
    // workspace and counters (phases run one after another on one stream, so they share them)
    std::vector<MuonMMTile*> t_mm;
    std::vector<int> n_mm;
    float* mm_ws = nullptr;
    int* mm_ctr = nullptr;
    cudaEvent_t join = nullptr;     // the side stream's work of the step is done
    cublasLtHandle_t lt = nullptr;  // the products (own workspace: the side stream runs beside g_cublas)
    void* lt_ws = nullptr;
    std::vector<MuonLtCall*> lt_calls;  // per group and kind of product (MUON_LT_CALLS each), made on first use
};
static const size_t MUON_LT_WS = 16 << 20;
static const int MUON_LT_CALLS = 4;  // standard: A, B, X'; gram: X X^T, Z, an m x m product, Q X

// --muon_ns gram rebuilds R from X before steps 2, 5, 8, ... (of 0 .. steps - 1)
static bool muon_gram_restart(int s, int steps) { return s >= 2 && s < steps && (s - 2) % 3 == 0; }
// A group's Newton-Schulz work in products on X (m x M: X X^T and X's update, 2 m^2 M FLOPs each), products of
// m x m matrices (2 m^3 each) and elementwise launches (gram: Z's diagonal); muon_group runs this schedule
struct MuonNsWork { int on_x, square, diag; };
static MuonNsWork muon_ns_work(int steps, int ns) {
    if (ns == MUON_NS_STANDARD) return {2 * steps, steps, 0};
    MuonNsWork w{2, 0, steps};  // R = X X^T first, X <- Q X last
    bool have_q = false;
    for (int s = 0; s < steps; s++) {
        if (muon_gram_restart(s, steps)) {  // X <- Q X, R = X X^T
            w.on_x += 2;
            have_q = false;
        }
        w.square += have_q ? 2 : 1;  // Z = c R R + b R (+ a I); Q <- Z Q (the first step's Q is Z)
        have_q = true;
        if (s + 1 < steps && !muon_gram_restart(s + 1, steps)) w.square += 2;  // R <- Z R Z
    }
    return w;
}

static bool muon_param(const Param& p) { return p.ndim >= 2; }  // conv and linear weights (2-D view out x rest)
// testing: dev/test_unet.cu clears it to run the bf16 path's products through cuBLASLt (muon_gemm), as torch does
static bool g_muon_mm = true;
static bool g_muon_pdl = true;  // testing: off launches muon_mm_kernel without Programmatic Dependent Launch
static bool g_muon_wgmma = true;  // testing: off runs the m x m products on muon_mm_kernel where wgmma could run
static int round8(int v) { return (v + 7) / 8 * 8; }  // 16-byte aligned bf16 columns for the tensor cores

// The cost model (microseconds; bf16 / fp32 rates): per group the momentum and normalisation passes (4 launches),
// then the Newton-Schulz's launches (muon_ns_work) at ~4 us of launch and latency each (a small product does not
// fill the GPU) plus the padded FLOPs at a sustained rate. The backward's own time per stage is its products' FLOPs at
// the whole step's measured rate (1.24 TFLOP in 11.78 ms, bf16, H100: ~105 TFLOP/s; a third of it in TF32). A group
// hidden beside the backward is taken to cost it MUON_SHARE of its time (the two compete for the SMs): a guess until
// the GPU measures it (dev/unet_NOTES.md).
static const double MUON_LAUNCH_US = 4.0, MUON_SHARE = 0.5;
static double muon_group_gflop(int m_pad, int M_pad, double count, int steps, int ns) {
    const MuonNsWork w = muon_ns_work(steps, ns);
    return count * (2.0 * w.on_x * m_pad * m_pad * M_pad + 2.0 * w.square * m_pad * m_pad * m_pad) / 1e9;
}
// a group's (grouped: a phase's) launches per step: momentum, two for the sums of squares, normalisation, then the
// products (and, ungrouped, Z's diagonal passes; muon_mm_kernel adds gamma I itself)
static int muon_launches(int steps, int ns, bool grouped) {
    const MuonNsWork w = muon_ns_work(steps, ns);
    return 4 + w.on_x + w.square + (grouped ? 0 : w.diag);
}
static double muon_group_us(int m_pad, int M_pad, double count, int steps, int ns, bool half) {
    return muon_launches(steps, ns, false) * MUON_LAUNCH_US +
           muon_group_gflop(m_pad, M_pad, count, steps, ns) * 1e9 / (half ? 3e8 : 1e8);
}

// The groups of one phase: its distinct wide shapes (m <= M) sorted by (m, M) and cut into runs, each padded to its
// largest m and M; auto picks the cut of least modelled time (muon_group_us; grouped: a group per shape, the launches
// do not grow with them), shape gives each shape its own group, one puts all in one. Returns, per sorted shape, its
// group index. shapes: (m, M, count).
static std::vector<int> muon_plan_groups(const std::vector<std::array<int, 3>>& shapes, int grouping, int steps,
                                         int ns, bool half, bool grouped) {
    const int n = (int)shapes.size();
    std::vector<int> of(n, 0);
    if (grouping == MG_SHAPE || (grouping == MG_AUTO && grouped))
        for (int i = 0; i < n; i++) of[i] = i;
    if (grouping != MG_AUTO || grouped) return of;
    auto cost = [&](int i, int j) {  // shapes i .. j-1 as one group
        int mp = 0, Mp = 0;
        double cnt = 0;
        for (int k = i; k < j; k++) {
            mp = std::max(mp, round8(shapes[k][0]));
            Mp = std::max(Mp, round8(shapes[k][1]));
            cnt += shapes[k][2];
        }
        return muon_group_us(mp, Mp, cnt, steps, ns, half);
    };
    std::vector<double> best(n + 1, 0.0);
    std::vector<int> cut(n + 1, 0);
    for (int j = 1; j <= n; j++) {
        best[j] = INFINITY;
        for (int i = 0; i < j; i++)
            if (best[i] + cost(i, j) < best[j]) {
                best[j] = best[i] + cost(i, j);
                cut[j] = i;
            }
    }
    std::vector<int> starts;
    for (int j = n; j > 0; j = cut[j]) starts.push_back(cut[j]);
    std::reverse(starts.begin(), starts.end());
    for (int g = 0; g < (int)starts.size(); g++)
        for (int k = starts[g]; k < (g + 1 < (int)starts.size() ? starts[g + 1] : n); k++) of[k] = g;
    return of;
}

// When each weight's gradient is final: stage[pi] of parameter pi (ops run backward from the last: op i of n finishes
// stage n - 1 - i, a resblock's emb_layers with it; the time embedding stage n, the end), and us[s], the modelled
// backward time of stage s (its weights' products: 2 for the data and weight gradients, 2 B pixels FLOPs per weight
// each).
struct MuonStages {
    std::vector<int> stage;
    std::vector<double> us;
};
static MuonStages muon_stages(const UNet* m, bool half) {
    MuonStages st;
    const int n_ops = (int)m->ops.size();
    st.stage.assign(m->params.size(), n_ops);
    st.us.assign(n_ops + 1, 0.0);
    std::vector<size_t> offs(m->params.size());
    for (size_t pi = 0; pi < m->params.size(); pi++) offs[pi] = m->params[pi].off;
    for (int i = n_ops - 1; i >= -1; i--) {
        const int s = i < 0 ? n_ops : n_ops - 1 - i;
        double pixels = 1.0;  // per sample, of the op's weighted layers (the embeddings: one row)
        if (i >= 0) {
            const Op& o = m->ops[i];
            pixels = (double)o.H * o.W * (o.kind == OP_UP ? 4.0 : o.kind == OP_DOWN ? 0.25 : 1.0);
        }
        auto final_here = [&](size_t off, double px) {
            const size_t pi = std::lower_bound(offs.begin(), offs.end(), off) - offs.begin();
            if (i < 0 && st.stage[pi] < n_ops) return;  // a resblock's emb_layers: at its own stage (below)
            st.stage[pi] = s;
            if (muon_param(m->params[pi])) st.us[s] += 4.0 * m->B * px * m->params[pi].n / (half ? 1.05e8 : 3.5e7);
        };
        op_grad_params(m, i, [&](size_t off) { final_here(off, pixels); });
        // with the overlap muon_grads_ready writes the emb_layers gradients of the resblocks done so far before it
        // starts a phase (emb_weight_grads), so a resblock's are final at its own stage
        if (i >= 0 && m->ops[i].kind == OP_RES) {
            final_here(m->ops[i].emb.w, 1.0);
            final_here(m->ops[i].emb.b, 1.0);
        }
    }
    return st;
}

static void muon_plan_tables(MuonPlan* mp);
// A group of a plan being drafted (muon_plan): its padded shape, count, ready stage, phase (those that hold matrices,
// numbered in order) and members
struct MuonDraft { int m_pad, M_pad, count, ready, phase; std::vector<int> members; };
// The modelled cost of a draft (done[s]: the modelled end of backward stage s): the side stream's time past the end
// of the backward, plus MUON_SHARE of the rest (grouped: a phase's launches once, then its groups' FLOPs; the phase
// starts after its last group's stage)
static double muon_plan_cost(const MuonPlan* mp, const std::vector<MuonDraft>& ds, const std::vector<double>& done,
                             double* total, double* exposed) {
    double t = 0.0;
    *total = 0.0;
    for (size_t i = 0; i < ds.size();) {
        size_t j = i;
        double us = 0.0;
        int ready = 0;
        for (; j < ds.size() && (j == i || (mp->grouped && ds[j].phase == ds[i].phase)); j++) {
            const MuonDraft& d = ds[j];
            us += mp->grouped ? muon_group_gflop(d.m_pad, d.M_pad, d.count, mp->ns_steps, mp->ns) * 1e9 / 3e8
                              : muon_group_us(d.m_pad, d.M_pad, d.count, mp->ns_steps, mp->ns, mp->half);
            ready = std::max(ready, d.ready);
        }
        if (mp->grouped) us += muon_launches(mp->ns_steps, mp->ns, true) * MUON_LAUNCH_US;
        t = std::max(t, done[ready]) + us;
        *total += us;
        i = j;
    }
    *exposed = std::max(0.0, t - done[mp->n_stages - 1]);
    return *exposed + MUON_SHARE * (*total - *exposed);
}
// Fills mp's host tables for the parameters (mp->lr, ns_steps, grouping, half set); nothing allocated. Matrices are
// cut into phases of consecutive backward stages, each phase grouped by muon_plan_groups (auto: the phase cuts that
// minimise the modelled time the optimizer adds to the step, greedily; shape and one: a single phase); the groups
// are then ordered by the stage that finishes their last gradient, the order the overlap starts them in.
static void muon_plan(MuonPlan* mp, const std::vector<Param>& params, const MuonStages& st) {
    struct Mat { int m, M, stage, pi; };
    std::vector<Mat> ms;
    mp->grouped = mp->half && !mp->cpu && g_muon_mm;
    for (int pi = 0; pi < (int)params.size(); pi++) {
        const Param& p = params[pi];
        if (!muon_param(p)) {
            for (size_t i = 0; i < p.n; i++) mp->adam_idx.push_back((int)(p.off + i));
            continue;
        }
        const int rows = p.shape[0], cols = (int)(p.n / (size_t)rows);
        ms.push_back({std::min(rows, cols), std::max(rows, cols), st.stage.empty() ? 0 : st.stage[pi], pi});
    }
    std::sort(ms.begin(), ms.end(), [](const Mat& a, const Mat& b) {
        return std::make_tuple(a.m, a.M, a.stage, a.pi) < std::make_tuple(b.m, b.M, b.stage, b.pi);
    });
    mp->n_stages = st.us.empty() ? 1 : (int)st.us.size();
    std::vector<double> done(mp->n_stages, 0.0);  // modelled end of each backward stage
    for (int s = 0; s < mp->n_stages; s++) done[s] = (s ? done[s - 1] : 0.0) + (st.us.empty() ? 0.0 : st.us[s]);
    // the groups of phases cut before the stages in cuts
    auto draft = [&](const std::vector<int>& cuts) {
        std::vector<MuonDraft> out;
        int phases = 0;
        for (size_t ph = 0; ph <= cuts.size(); ph++) {
            const int lo = ph ? cuts[ph - 1] : 0, hi = ph < cuts.size() ? cuts[ph] : mp->n_stages;
            std::vector<std::array<int, 3>> shapes;
            std::vector<int> idx;
            for (int k = 0; k < (int)ms.size(); k++) {
                if (ms[k].stage < lo || ms[k].stage >= hi) continue;
                if (shapes.empty() || shapes.back()[0] != ms[k].m || shapes.back()[1] != ms[k].M)
                    shapes.push_back({ms[k].m, ms[k].M, 0});
                shapes.back()[2]++;
                idx.push_back(k);
            }
            if (shapes.empty()) continue;
            const std::vector<int> of = muon_plan_groups(shapes, mp->grouping, mp->ns_steps, mp->ns, mp->half,
                                                         mp->grouped);
            const size_t first = out.size();
            out.resize(first + of.back() + 1, MuonDraft{0, 0, 0, 0, phases++, {}});
            size_t s = 0;
            for (int k : idx) {
                while (shapes[s][0] != ms[k].m || shapes[s][1] != ms[k].M) s++;
                MuonDraft& d = out[first + of[s]];
                d.m_pad = std::max(d.m_pad, round8(ms[k].m));
                d.M_pad = std::max(d.M_pad, round8(ms[k].M));
                d.count++;
                d.ready = std::max(d.ready, ms[k].stage);
                d.members.push_back(k);
            }
        }
        std::stable_sort(out.begin(), out.end(),
                         [](const MuonDraft& a, const MuonDraft& b) { return a.ready < b.ready; });
        return out;
    };
    auto cost = [&](const std::vector<MuonDraft>& ds, double* total, double* exposed) {
        return muon_plan_cost(mp, ds, done, total, exposed);
    };
    std::vector<int> cuts;
    double total, exposed, best = cost(draft(cuts), &total, &exposed);
    while (mp->grouping == MG_AUTO) {  // add the phase cut that helps most, while one does
        int best_cut = -1;
        for (int c = 1; c < mp->n_stages; c++) {
            if (std::find(cuts.begin(), cuts.end(), c) != cuts.end()) continue;
            std::vector<int> trial = cuts;
            trial.insert(std::upper_bound(trial.begin(), trial.end(), c), c);
            const double v = cost(draft(trial), &total, &exposed);
            if (v < best - 1e-9) {
                best = v;
                best_cut = c;
            }
        }
        if (best_cut < 0) break;
        cuts.insert(std::upper_bound(cuts.begin(), cuts.end(), best_cut), best_cut);
    }
    const std::vector<MuonDraft> ds = draft(cuts);
    cost(ds, &mp->est_us, &mp->est_exposed_us);
    size_t w = 0, s_off = 0;
    for (const MuonDraft& d : ds) {
        const int phase = mp->grouped ? d.phase : (int)mp->groups.size();
        if (mp->phase_first.empty() || phase != mp->groups.back().phase) {
            mp->phase_first.push_back((int)mp->groups.size());
            mp->phase_ready.push_back(d.ready);
        }
        mp->phase_ready.back() = std::max(mp->phase_ready.back(), d.ready);
        MuonGroup g{d.m_pad, d.M_pad, d.count, w, s_off, (int)mp->mats.size(), d.ready, phase};
        for (int k : d.members) {
            const Param& p = params[ms[k].pi];
            MuonMat q;
            q.p_off = p.off;
            q.w_off = w;
            w += (size_t)g.m_pad * g.M_pad;
            q.rows = p.shape[0];
            q.cols = (int)(p.n / (size_t)q.rows);
            q.m_pad = g.m_pad;
            q.M_pad = g.M_pad;
            q.s_off = s_off;
            s_off += (size_t)g.m_pad * g.m_pad;
            q.conv = p.kind == PK_CONV3;
            q.step = (float)((double)mp->lr * sqrt(std::max(1.0, (double)q.rows / q.cols)));
            mp->mats.push_back(q);
        }
        mp->gflop += muon_group_gflop(g.m_pad, g.M_pad, g.count, mp->ns_steps, mp->ns);
        mp->groups.push_back(g);
    }
    mp->phase_first.push_back((int)mp->groups.size());
    mp->w_elems = w;
    mp->s_elems = s_off;
    muon_plan_tables(mp);
}
// The plan's index tables: each matrix's chunks (the sums of squares) and tiles (the GPU's elementwise passes), and
// the launches per step
static void muon_plan_tables(MuonPlan* mp) {
    for (size_t i = 0; i < mp->mats.size(); i++) {
        const MuonMat& k = mp->mats[i];
        const size_t end = i + 1 < mp->mats.size() ? mp->mats[i + 1].w_off : mp->w_elems;
        mp->first_chunk.push_back((int)mp->chunk_start.size());
        for (size_t c = k.w_off; c < end; c += MUON_CHUNK) {
            mp->chunk_start.push_back(c);
            mp->chunk_end.push_back(std::min(end, c + MUON_CHUNK));
        }
    }
    mp->first_chunk.push_back((int)mp->chunk_start.size());
    for (const MuonGroup& gr : mp->groups) {  // groups hold consecutive matrices
        mp->tile_first.push_back((int)mp->tiles.size());
        for (int q = gr.first_mat; q < gr.first_mat + gr.count; q++)
            for (int j0 = 0; j0 < gr.M_pad; j0 += MUON_TILE)
                for (int i0 = 0; i0 < gr.m_pad; i0 += MUON_TILE) mp->tiles.push_back({q, i0, j0, gr.M_pad});
    }
    mp->tile_first.push_back((int)mp->tiles.size());
    // per step: the AdamW counter and AdamW; per phase momentum, sum of squares (2), normalisation and the
    // Newton-Schulz; the update, and the bf16 weight copy
    const int phases = (int)mp->phase_first.size() - 1;
    mp->launches = 2 + phases * muon_launches(mp->ns_steps, mp->ns, mp->grouped) + 1 + (mp->half ? 1 : 0);
}

// The BT x BT output tiles of one muon_mm_kernel launch over mats[first .. first + count - 1] (GRAM and SQ: the lower
// triangle), longest first. GRAM's K (the wide dimension, up to 4608) is cut into splits of at most `cap` k-tiles,
// cap about the launch's average work per resident block, so no tile outlasts the rest (slots, ctrs: the workspace
// slots and counters used, added to)
static std::vector<MuonMMTile> muon_mm_tiles(const std::vector<MuonMat>& mats, int first, int count, int kind,
                                             int* slots, int* ctrs) {
    const int bt = MUON_MM_BT[kind];
    std::vector<MuonMMTile> out;
    long long work = 0;
    for (int q = first; q < first + count; q++) {
        const MuonMat& k = mats[q];
        const int nt = ceil_div(k.m_pad, bt), nc = kind == MUON_MM_LEFT ? ceil_div(k.M_pad, bt) : nt;
        const int kt = ceil_div(kind == MUON_MM_GRAM ? k.M_pad : k.m_pad, MUON_MM_BK[kind]);
        for (int i = 0; i < nt; i++)
            for (int j = 0; j < (kind == MUON_MM_LEFT ? nc : i + 1); j++) {
                out.push_back({q, i, j, 0, kt, 0, 1, -1, -1});
                work += kt;
            }
    }
    const int resident = g_num_sms * 4;  // GRAM's blocks per SM (shared memory); only GRAM is split
    const int cap = std::max(16, (int)(work / resident));
    std::vector<MuonMMTile> split;
    for (const MuonMMTile& t : out) {
        const int n = kind == MUON_MM_GRAM ? ceil_div(t.k1, cap) : 1;
        for (int s = 0; s < n; s++) {
            MuonMMTile u = t;
            u.k0 = (int)((long long)t.k1 * s / n);
            u.k1 = (int)((long long)t.k1 * (s + 1) / n);
            u.split = s;
            u.nsplit = n;
            u.slot0 = n > 1 ? *slots : -1;
            u.ctr = n > 1 ? *ctrs : -1;
            split.push_back(u);
        }
        if (n > 1) {
            *slots += n;
            *ctrs += 1;
        }
    }
    std::stable_sort(split.begin(), split.end(),
                     [](const MuonMMTile& a, const MuonMMTile& b) { return a.k1 - a.k0 > b.k1 - b.k0; });
    return split;
}

// f(i) for base <= i < base + n: a kernel on stream st, or a loop on the CPU (f's pointers on that side)
template <class F>
static void muon_each(bool cpu, cudaStream_t st, size_t base, size_t n, F f) {
    if (cpu) {
        for (size_t i = base; i < base + n; i++) f(i);
        return;
    }
    if (!n) return;
    muon_each_kernel<<<(unsigned)((n + EW - 1) / EW), EW, 0, st>>>(f, base, n);
    cudaCheck(cudaGetLastError());
}
// memory on the side that runs the step (zeroed), and a copy of a host table into it
static void* muon_alloc(const MuonPlan* mp, size_t bytes) {
    bytes = std::max<size_t>(bytes, 16);
    if (mp->cpu) {
        void* h = calloc(bytes, 1);
        if (!h) {
            fprintf(stderr, "error: out of host memory (%zu bytes for --optimizer muon)\n", bytes);
            exit(EXIT_FAILURE);
        }
        return h;
    }
    void* d;
    cudaCheck(cudaMalloc(&d, bytes));
    cudaCheck(cudaMemset(d, 0, bytes));
    return d;
}
template <typename V>
static V* muon_table(const MuonPlan* mp, const std::vector<V>& host) {
    V* t = (V*)muon_alloc(mp, host.size() * sizeof(V));
    if (host.empty()) return t;
    if (mp->cpu) memcpy(t, host.data(), host.size() * sizeof(V));
    else cudaCheck(cudaMemcpy(t, host.data(), host.size() * sizeof(V), cudaMemcpyHostToDevice));
    return t;
}
// A plan for m's parameters with its tables and buffers on the GPU (cpu: on the host; overlap off)
static MuonPlan* muon_create(const UNet* m, float lr, float momentum, int nesterov, int ns_steps, int grouping,
                             int ns, bool half, bool cpu) {
    MuonPlan* mp = new MuonPlan();
    mp->lr = lr;
    mp->momentum = momentum;
    mp->nesterov = nesterov;
    mp->ns_steps = ns_steps;
    mp->grouping = grouping;
    mp->ns = ns;
    mp->half = half && !cpu;
    mp->cpu = cpu;
    muon_plan(mp, m->params, muon_stages(m, mp->half));
    mp->t_mats = muon_table(mp, mp->mats);
    mp->t_tiles = muon_table(mp, mp->tiles);
    mp->t_adam_idx = muon_table(mp, mp->adam_idx);
    mp->t_first_chunk = muon_table(mp, mp->first_chunk);
    mp->t_chunk_start = muon_table(mp, mp->chunk_start);
    mp->t_chunk_end = muon_table(mp, mp->chunk_end);
    const size_t elem = mp->half ? sizeof(bf16) : sizeof(float);
    for (void*& x : mp->x) x = muon_alloc(mp, mp->w_elems * elem);
    for (int k = 0; k < (ns == MUON_NS_GRAM ? 4 : 2); k++) mp->sq[k] = muon_alloc(mp, mp->s_elems * elem);
    mp->partial = (float*)muon_alloc(mp, mp->chunk_start.size() * sizeof(float));
    mp->sumsq = (float*)muon_alloc(mp, mp->mats.size() * sizeof(float));
    const int phases = (int)mp->phase_first.size() - 1;
    mp->started.assign(phases, 0);
    mp->lt_calls.assign(MUON_LT_CALLS * mp->groups.size(), nullptr);
    if (mp->grouped) {
        int dev, major;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        mp->pdl = major >= 9 && g_muon_pdl;
        int max_slots = 0, max_ctrs = 0;
        for (int p = 0; p < phases; p++) {
            const int k0 = mp->groups[mp->phase_first[p]].first_mat;
            const MuonGroup& last = mp->groups[mp->phase_first[p + 1] - 1];
            for (int kind = 0; kind < MUON_MM_KINDS; kind++) {
                int slots = 0, ctrs = 0;
                const std::vector<MuonMMTile> t = muon_mm_tiles(mp->mats, k0, last.first_mat + last.count - k0, kind,
                                                                &slots, &ctrs);
                mp->t_mm.push_back(muon_table(mp, t));
                mp->n_mm.push_back((int)t.size());
                max_slots = std::max(max_slots, slots);
                max_ctrs = std::max(max_ctrs, ctrs);
            }
        }
        mp->mm_ws = (float*)muon_alloc(mp, (size_t)max_slots * MUON_MM_BT[MUON_MM_GRAM] * MUON_MM_BT[MUON_MM_GRAM] *
                                               sizeof(float));
        mp->mm_ctr = (int*)muon_alloc(mp, (size_t)max_ctrs * sizeof(int));  // zero: each last block resets its own
        auto smem = [&](auto kernel, size_t bytes) {
            cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        };
        smem(muon_mm_kernel<MUON_MM_GRAM, bf16>, MuonMMCfg<MUON_MM_GRAM>::SMEM);
        smem(muon_mm_kernel<MUON_MM_GRAM, __half>, MuonMMCfg<MUON_MM_GRAM>::SMEM);
        smem(muon_mm_kernel<MUON_MM_SQ, bf16>, MuonMMCfg<MUON_MM_SQ>::SMEM);
        smem(muon_mm_kernel<MUON_MM_SQ, __half>, MuonMMCfg<MUON_MM_SQ>::SMEM);
        smem(muon_mm_kernel<MUON_MM_LEFT, bf16>, MuonMMCfg<MUON_MM_LEFT>::SMEM);
        smem(muon_mm_kernel<MUON_MM_LEFT, __half>, MuonMMCfg<MUON_MM_LEFT>::SMEM);
        mp->wg = g_muon_wgmma && have_sm90a();
        smem(muon_sq_wgmma_kernel<bf16>, MUON_WG_SMEM);
        smem(muon_sq_wgmma_kernel<__half>, MUON_WG_SMEM);
    }
    if (!cpu) {
        cudaCheck(cudaStreamCreateWithFlags(&mp->side, cudaStreamNonBlocking));  // the lowest priority
        mp->fork.resize(phases);
        for (cudaEvent_t& e : mp->fork) cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        cudaCheck(cudaEventCreateWithFlags(&mp->join, cudaEventDisableTiming));
        cublasCheck(cublasLtCreate(&mp->lt));
        cudaCheck(cudaMalloc(&mp->lt_ws, MUON_LT_WS));
    }
    return mp;
}

// One product's cuBLASLt descriptors and the algorithm its heuristic chose (for the compute type it was made with)
struct MuonLtCall {
    cublasComputeType_t ct;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t lay[4] = {nullptr, nullptr, nullptr, nullptr};  // A, B, C, D
    cublasLtMatmulAlgo_t algo;
};
static void muon_lt_free(MuonLtCall* c) {
    if (!c) return;
    for (cublasLtMatrixLayout_t l : c->lay)
        if (l) cublasCheck(cublasLtMatrixLayoutDestroy(l));
    if (c->op) cublasCheck(cublasLtMatmulDescDestroy(c->op));
    delete c;
}
static void muon_destroy(MuonPlan* mp) {
    void* ps[] = {mp->t_mats, mp->t_tiles, mp->t_adam_idx, mp->t_first_chunk, mp->t_chunk_start, mp->t_chunk_end,
                  mp->x[0], mp->x[1], mp->sq[0], mp->sq[1], mp->sq[2], mp->sq[3], mp->partial, mp->sumsq};
    for (void* p : ps) {
        if (mp->cpu) free(p);
        else if (p) cudaCheck(cudaFree(p));
    }
    for (MuonLtCall* c : mp->lt_calls) muon_lt_free(c);
    for (MuonMMTile* t : mp->t_mm) cudaCheck(cudaFree(t));
    if (mp->mm_ws) cudaCheck(cudaFree(mp->mm_ws));
    if (mp->mm_ctr) cudaCheck(cudaFree(mp->mm_ctr));
    if (!mp->cpu) {
        cudaCheck(cudaStreamSynchronize(mp->side));
        for (cudaEvent_t e : mp->fork) cudaCheck(cudaEventDestroy(e));
        cudaCheck(cudaEventDestroy(mp->join));
        cudaCheck(cudaStreamDestroy(mp->side));
        cublasCheck(cublasLtDestroy(mp->lt));
        cudaCheck(cudaFree(mp->lt_ws));
    }
    delete mp;
}

// the largest power of two up to 256 that divides the address and the batch stride in bytes (the heuristic may
// otherwise pick a kernel that assumes 256-byte alignment)
static uint32_t muon_align(const void* ptr, long long stride_bytes) {
    uint32_t a = 256;
    while (a > 1 && (((uintptr_t)ptr % a) != 0 || stride_bytes % a != 0)) a /= 2;
    return a;
}
// D = alpha A op(B) + beta C for a strided batch of column-major matrices (C and D may be the same; B as tb):
// cuBLASLt on stream st (fp32 in g_tf32's mode, strict or TF32; bf16 with fp32 accumulation; call: the slot whose
// descriptors and algorithm are kept), loops on the CPU with double accumulation
template <typename T>
static void muon_gemm(MuonPlan* mp, cudaStream_t st, int call, bool tb, int M, int N, int K, float alpha, const T* A,
                      int lda, long long sa, const T* B, int ldb, long long sb, float beta, const T* C, T* D, int ldc,
                      long long sc, int batch) {
    if (mp->cpu) {
        for (int b = 0; b < batch; b++)
            for (int j = 0; j < N; j++)
                for (int i = 0; i < M; i++) {
                    double acc = 0.0;
                    for (int k = 0; k < K; k++)
                        acc += (double)muon_to_float(A[b * sa + i + (long long)k * lda]) *
                               muon_to_float(B[b * sb + (tb ? j + (long long)k * ldb : k + (long long)j * ldb)]);
                    const long long e = b * sc + i + (long long)j * ldc;
                    const double c = beta != 0.f ? beta * (double)muon_to_float(C[e]) : 0.0;
                    D[e] = muon_from_float<T>((float)(alpha * acc + c));
                }
        return;
    }
    const bool bf = std::is_same<T, bf16>::value, fp16 = std::is_same<T, __half>::value;
    const cudaDataType_t dt = bf ? CUDA_R_16BF : fp16 ? CUDA_R_16F : CUDA_R_32F;
    // gram in fp32 stays strict: its Q carries TF32's rounding ~20x further than the standard form (dev/unet_NOTES.md)
    const bool strict = bf || fp16 || !g_tf32 || mp->ns == MUON_NS_GRAM;
    const cublasComputeType_t ct = strict ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
    MuonLtCall*& c = mp->lt_calls[call];
    if (c && c->ct != ct) {  // dev/test_unet.cu switches TF32 off and on
        muon_lt_free(c);
        c = nullptr;
    }
    if (!c) {
        c = new MuonLtCall();
        c->ct = ct;
        cublasCheck(cublasLtMatmulDescCreate(&c->op, ct, CUDA_R_32F));
        const cublasOperation_t opa = CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        cublasCheck(cublasLtMatmulDescSetAttribute(c->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
        cublasCheck(cublasLtMatmulDescSetAttribute(c->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
        const int rows[4] = {M, tb ? N : K, M, M}, cols[4] = {K, tb ? K : N, N, N}, ld[4] = {lda, ldb, ldc, ldc};
        const long long stride[4] = {sa, sb, sc, sc};
        const int32_t nb = batch;
        for (int k = 0; k < 4; k++) {
            cublasCheck(cublasLtMatrixLayoutCreate(&c->lay[k], dt, rows[k], cols[k], ld[k]));
            cublasCheck(cublasLtMatrixLayoutSetAttribute(c->lay[k], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb,
                                                         sizeof nb));
            cublasCheck(cublasLtMatrixLayoutSetAttribute(c->lay[k], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                         &stride[k], sizeof stride[k]));
        }
        cublasLtMatmulPreference_t pref;
        cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
        const uint64_t ws = MUON_LT_WS;
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                         sizeof ws));
        const void* ptr[4] = {A, B, C, D};
        const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
        for (int k = 0; k < 4; k++) {
            const uint32_t al = muon_align(ptr[k], stride[k] * (long long)sizeof(T));
            cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[k], &al, sizeof al));
        }
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(mp->lt, c->op, c->lay[0], c->lay[1], c->lay[2], c->lay[3], pref, 1,
                                                   &res, &found));
        cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
        if (found < 1) {
            fprintf(stderr, "error: cuBLASLt has no algorithm for Muon's %d x %d x %d product (batch %d)\n", M, N, K,
                    batch);
            exit(EXIT_FAILURE);
        }
        c->algo = res.algo;
    }
    cublasCheck(cublasLtMatmul(mp->lt, c->op, &alpha, A, c->lay[0], B, c->lay[1], &beta, C, c->lay[2], D, c->lay[3],
                               &c->algo, mp->lt_ws, MUON_LT_WS, st));
}

// the stream a group's work goes to
static cudaStream_t muon_stream(const MuonPlan* mp) { return mp->overlap ? mp->side : g_stream; }
// The group buffer that holds the orthogonalised update: standard alternates from x[0] every step; gram normalises
// x[0] into x[1] and alternates at each restart and at the end
static int muon_final_x(const MuonPlan* mp) {
    if (mp->ns == MUON_NS_STANDARD) return mp->ns_steps % 2;
    const int restarts = (muon_ns_work(mp->ns_steps, MUON_NS_GRAM).on_x - 2) / 2;  // X <- Q X at each, and the end
    return (1 + restarts + 1) % 2;
}
// The element types as f(T(), S()): T the momentum's group buffer (bf16 with --precision bf16: torch's Muon rounds
// the update to bf16, else fp32), S the Newton-Schulz's (T; gram in half precision: fp16)
template <class F>
static void muon_types(const MuonPlan* mp, F f) {
    if (!mp->half) f(float(), float());
    else if (mp->ns == MUON_NS_GRAM) f(bf16(), __half());
    else f(bf16(), bf16());
}
// muon_tile_kernel over the tiles of groups g0 .. g1 - 1; the momentum on x[0], the normalisation from x[0] into the
// Newton-Schulz's first buffer, the update from its last (muon_final_x)
template <int MODE, typename T, typename S>
static void muon_tiles(MuonPlan* mp, cudaStream_t st, int g0, int g1, const float* g, float* buf, float* p,
                       float* ema, const float* hyper, float w, float decay) {
    const int t0 = mp->tile_first[g0], t1 = mp->tile_first[g1];
    if (t1 <= t0) return;
    const int xs = MODE == MUON_TILE_APPLY ? muon_final_x(mp) : mp->ns == MUON_NS_GRAM ? 1 : 0;
    muon_tile_kernel<MODE, T, S><<<t1 - t0, dim3(MUON_TILE, MUON_TILE_ROWS), 0, st>>>(
        mp->t_tiles + t0, mp->t_mats, (T*)mp->x[0], (S*)mp->x[xs], g, buf, p, ema, mp->sumsq, hyper, w,
        mp->momentum, mp->nesterov, decay);
    cudaCheck(cudaGetLastError());
}

// A Newton-Schulz product's kernel on st; with Programmatic Dependent Launch on compute capability 9.0+ (the chain of
// dependent products is latency-bound: each launch is staged while the one before it runs)
template <typename... P, typename... A>
static void muon_launch(const MuonPlan* mp, cudaStream_t st, void (*kernel)(P...), int blocks, int threads,
                        size_t smem, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = mp->pdl ? 1 : 0;
    cudaCheck(cudaLaunchKernelEx(&cfg, kernel, args...));
}
// muon_mm_kernel of kind KIND (MUON_MM_SQW: muon_sq_wgmma_kernel) over phase ph's tiles
template <int KIND, typename S>
static void muon_mm_launch(const MuonPlan* mp, int ph, cudaStream_t st, const S* P, const S* Q, const S* C, S* D,
                           float alpha, float beta, float gamma) {
    const int i = MUON_MM_KINDS * ph + KIND;
    if (!mp->n_mm[i]) return;
    const MuonMMTile* t = mp->t_mm[i];
    if constexpr (KIND == MUON_MM_SQW)
        muon_launch(mp, st, muon_sq_wgmma_kernel<S>, mp->n_mm[i], MUON_WG_THREADS, MUON_WG_SMEM, t,
                    (const MuonMat*)mp->t_mats, P, Q, C, D, alpha, beta, gamma);
    else
        muon_launch(mp, st, muon_mm_kernel<KIND, S>, mp->n_mm[i], MuonMMCfg<KIND>::THREADS, MuonMMCfg<KIND>::SMEM, t,
                    (const MuonMat*)mp->t_mats, P, Q, C, D, alpha, beta, gamma, mp->mm_ws, mp->mm_ctr);
}
// One Newton-Schulz product over phase ph, every matrix at its own offsets into whole buffers (the x or sq ones):
// D = alpha P Q + beta C + gamma I for kind MUON_MM_GRAM (P = Q = X: X X^T), MUON_MM_SQ (m x m, Q symmetric) or
// MUON_MM_LEFT (P X, no gamma). Grouped: one muon_mm_kernel; else per group a strided batch through muon_gemm
// (slot: its cached call; C = D where beta is 0) and gamma as its own pass.
template <typename S>
static void muon_prod(MuonPlan* mp, int ph, cudaStream_t st, int kind, int slot, const S* P, const S* Q, const S* C,
                      S* D, float alpha, float beta, float gamma) {
    if (mp->grouped) {
        if (kind == MUON_MM_GRAM) muon_mm_launch<MUON_MM_GRAM, S>(mp, ph, st, P, Q, C, D, alpha, beta, gamma);
        else if (kind == MUON_MM_SQ && mp->wg)
            muon_mm_launch<MUON_MM_SQW, S>(mp, ph, st, P, Q, C, D, alpha, beta, gamma);
        else if (kind == MUON_MM_SQ) muon_mm_launch<MUON_MM_SQ, S>(mp, ph, st, P, Q, C, D, alpha, beta, gamma);
        else muon_mm_launch<MUON_MM_LEFT, S>(mp, ph, st, P, Q, C, D, alpha, beta, gamma);
        return;
    }
    for (int k = mp->phase_first[ph]; k < mp->phase_first[ph + 1]; k++) {
        const MuonGroup& gr = mp->groups[k];
        const int m = gr.m_pad, M = gr.M_pad, c = MUON_LT_CALLS * k + slot;
        const long long xs = (long long)m * M, ss = (long long)m * m;
        if (kind == MUON_MM_GRAM)
            muon_gemm(mp, st, c, true, m, m, M, alpha, P + gr.w_off, m, xs, P + gr.w_off, m, xs, beta, C + gr.s_off,
                      D + gr.s_off, m, ss, gr.count);
        else if (kind == MUON_MM_SQ)
            muon_gemm(mp, st, c, false, m, m, m, alpha, P + gr.s_off, m, ss, Q + gr.s_off, m, ss, beta, C + gr.s_off,
                      D + gr.s_off, m, ss, gr.count);
        else
            muon_gemm(mp, st, c, false, m, M, m, alpha, P + gr.s_off, m, ss, Q + gr.w_off, m, xs, beta, C + gr.w_off,
                      D + gr.w_off, m, xs, gr.count);
        if (gamma != 0.f) muon_each(mp->cpu, st, 0, (size_t)m * gr.count, MuonDiag<S>{D + gr.s_off, m, ss, gamma});
    }
}

// Standard Newton-Schulz of phase ph from X in x[0] (in place normalised): ns_steps of A = X X^T, B = c A A + b A,
// X' = B X + a X, alternating between the group buffers
template <typename S>
static void muon_ns_standard(MuonPlan* mp, int ph, cudaStream_t st) {
    S *a = (S*)mp->sq[0], *p = (S*)mp->sq[1];
    for (int s = 0; s < mp->ns_steps; s++) {
        const S* x = (const S*)mp->x[s % 2];
        S* y = (S*)mp->x[(s + 1) % 2];
        muon_prod<S>(mp, ph, st, MUON_MM_GRAM, 0, x, x, a, a, 1.f, 0.f, 0.f);
        muon_prod<S>(mp, ph, st, MUON_MM_SQ, 1, a, a, a, p, MUON_C, MUON_B, 0.f);
        muon_prod<S>(mp, ph, st, MUON_MM_LEFT, 2, p, x, x, y, 1.f, MUON_A, 0.f);
    }
}
// Gram Newton-Schulz of phase ph from X in x[1] (the schedule of muon_ns_work): R in sq[0]; Z, Q and a product's
// output take turns in sq[1..3]
template <typename S>
static void muon_ns_gram(MuonPlan* mp, int ph, cudaStream_t st) {
    const int steps = mp->ns_steps;
    auto sq = [&](int i) { return (S*)mp->sq[i]; };
    auto x = [&](int i) { return (S*)mp->x[i]; };
    auto square = [&](const S* a, const S* b, S* d) {  // d = a b
        muon_prod<S>(mp, ph, st, MUON_MM_SQ, 2, a, b, d, d, 1.f, 0.f, 0.f);
    };
    auto gram = [&](const S* X) {  // R = X X^T
        muon_prod<S>(mp, ph, st, MUON_MM_GRAM, 0, X, X, sq(0), sq(0), 1.f, 0.f, 0.f);
    };
    auto left = [&](int qi, int xi) {  // X' = Q X into the other buffer
        muon_prod<S>(mp, ph, st, MUON_MM_LEFT, 3, sq(qi), x(xi), x(1 - xi), x(1 - xi), 1.f, 0.f, 0.f);
    };
    int xi = 1, qi = -1;  // X's buffer; Q's (-1: Q = I)
    gram(x(xi));
    for (int s = 0; s < steps; s++) {
        if (muon_gram_restart(s, steps)) {  // X <- Q X, R = X X^T, Q = I
            left(qi, xi);
            xi = 1 - xi;
            gram(x(xi));
            qi = -1;
        }
        const int zi = qi == 1 ? 2 : 1;  // Z = c R R + b R + a I
        muon_prod<S>(mp, ph, st, MUON_MM_SQ, 1, sq(0), sq(0), sq(0), sq(zi), MUON_C, MUON_B, MUON_A);
        if (qi < 0) qi = zi;  // Q = Z (Z stays there for this step)
        else {                // Q <- Z Q into the third buffer
            const int ni = 6 - qi - zi;
            square(sq(zi), sq(qi), sq(ni));
            qi = ni;
        }
        if (s + 1 < steps && !muon_gram_restart(s + 1, steps)) {  // R <- (Z R) Z, Z R into a buffer not Q's or Z's
            const int ti = qi != zi ? 6 - qi - zi : zi == 1 ? 2 : 1;
            square(sq(zi), sq(0), sq(ti));
            square(sq(ti), sq(zi), sq(0));
        }
    }
    left(qi, xi);
}

// Phase ph from the gradient g to its orthogonalised update in mp->x[muon_final_x]: the momentum (buf) and the
// update u rounded into x[0], each matrix's sum of squares (fixed order on either side), the normalisation (in
// place, or into x[1] as S for gram), then the Newton-Schulz
template <typename T, typename S>
static void muon_phase(MuonPlan* mp, int ph, const float* g, float* buf) {
    const int g0 = mp->phase_first[ph], g1 = mp->phase_first[ph + 1];
    const MuonGroup &first = mp->groups[g0], &last = mp->groups[g1 - 1];
    const bool cpu = mp->cpu;
    const cudaStream_t st = cpu ? nullptr : muon_stream(mp);
    const int nm = (int)mp->mats.size(), k0 = first.first_mat, k1 = last.first_mat + last.count;
    const size_t n = last.w_off + (size_t)last.count * last.m_pad * last.M_pad - first.w_off;
    const float w = (float)(1.0 - (double)mp->momentum);
    T* x0 = (T*)mp->x[0];
    if (cpu) muon_each(cpu, st, first.w_off, n, MuonMomentum<T>{mp->t_mats, nm, g, buf, x0, w, mp->momentum,
                                                                   mp->nesterov});
    else muon_tiles<MUON_TILE_MOMENTUM, T, S>(mp, st, g0, g1, g, buf, nullptr, nullptr, nullptr, w, 1.f);
    if (cpu) {
        for (int q = k0; q < k1; q++) {
            double s = 0.0;
            const size_t end = q + 1 < nm ? mp->mats[q + 1].w_off : mp->w_elems;
            for (size_t e = mp->mats[q].w_off; e < end; e++) s += (double)muon_to_float(x0[e]) * muon_to_float(x0[e]);
            mp->sumsq[q] = (float)s;
        }
    } else {
        const int c0 = mp->first_chunk[k0], c1 = mp->first_chunk[k1];
        muon_sumsq_kernel<<<c1 - c0, MUON_BLOCK, 0, st>>>(x0, mp->t_chunk_start + c0, mp->t_chunk_end + c0,
                                                          mp->partial + c0);
        cudaCheck(cudaGetLastError());
        muon_sumsq_finalize_kernel<<<ceil_div(k1 - k0, EW), EW, 0, st>>>(mp->partial, mp->t_first_chunk + k0, k1 - k0,
                                                                          mp->sumsq + k0);
        cudaCheck(cudaGetLastError());
    }
    S* xn = (S*)mp->x[mp->ns == MUON_NS_GRAM ? 1 : 0];
    if (cpu) muon_each(cpu, st, first.w_off, n, MuonNormalize<T, S>{mp->t_mats, nm, mp->sumsq, x0, xn});
    else muon_tiles<MUON_TILE_NORMALIZE, T, S>(mp, st, g0, g1, nullptr, nullptr, nullptr, nullptr, nullptr, 0.f, 1.f);
    if (mp->ns == MUON_NS_GRAM) muon_ns_gram<S>(mp, ph, st);
    else muon_ns_standard<S>(mp, ph, st);
}
// Queues phase ph's work unless it is queued already this step; with the overlap, on the side stream once g_stream
// has written the gradients (everything before this point on g_stream)
template <typename T, typename S>
static void muon_start(MuonPlan* mp, int ph, const float* g, float* buf) {
    if (mp->started[ph]) return;
    mp->started[ph] = 1;
    if (mp->overlap) {
        cudaCheck(cudaEventRecord(mp->fork[ph], g_stream));
        cudaCheck(cudaStreamWaitEvent(mp->side, mp->fork[ph], 0));
    }
    muon_phase<T, S>(mp, ph, g, buf);
}
// (declared before the backward pass) the phases whose last gradient the backward has just finished with op (-1:
// its end), started on the side stream when the overlap is on
static void muon_grads_ready(UNet* m, int op) {
    MuonPlan* mp = m->muon;
    if (!mp->overlap) return;
    const int stage = op < 0 ? mp->n_stages - 1 : mp->n_stages - 2 - op;
    for (int ph = 0; ph < (int)mp->started.size(); ph++) {
        if (mp->phase_ready[ph] != stage) continue;
        if (op >= 0) {  // the emb_layers of the resblocks done so far (ops op ..: the table's last rows), as
            int row0 = 0;   // muon_stages has it
            for (int i = 0; i < op; i++)
                if (m->ops[i].kind == OP_RES) row0 += m->ops[i].emb.out;
            emb_weight_grads(m, row0);
        }
        if (mp->started[ph]) {
            fprintf(stderr, "error: Muon's overlap: a second backward pass before the update (the caller must update "
                            "after every backward pass with the overlap on)\n");
            exit(EXIT_FAILURE);
        }
        muon_types(mp, [&](auto t, auto s) { muon_start<decltype(t), decltype(s)>(mp, ph, m->g, m->m); });
    }
}

// One step after the AdamW counter (hyper: this step's AdamW scalars and EMA decay, on the step's side): AdamW on the
// parameters Muon leaves, Muon on the weights (buf: their momentum, kept in AdamW's first-moment array; the phases
// the backward pass has not started yet start here), the EMA of both when ema is given. Every array on the side mp
// runs on.
template <typename T, typename S>
static void muon_step_t(MuonPlan* mp, float* p, const float* g, float* buf, float* v, float* ema, const float* hyper,
                        float beta1, float beta2, float eps, float lr, float weight_decay) {
    const bool cpu = mp->cpu;
    const int nm = (int)mp->mats.size();
    muon_each(cpu, g_stream, 0, mp->adam_idx.size(),
              MuonAdamW{mp->t_adam_idx, p, buf, v, ema, g, beta1, beta2, lr * weight_decay, eps, hyper});
    for (int ph = 0; ph < (int)mp->started.size(); ph++) muon_start<T, S>(mp, ph, g, buf);
    if (mp->overlap) {
        cudaCheck(cudaEventRecord(mp->join, mp->side));
        cudaCheck(cudaStreamWaitEvent(g_stream, mp->join, 0));
    }
    std::fill(mp->started.begin(), mp->started.end(), 0);
    const float decay = (float)(1.0 - (double)mp->lr * weight_decay);
    if (cpu) muon_each(cpu, g_stream, 0, mp->w_elems,
                       MuonApply<S>{mp->t_mats, nm, (const S*)mp->x[muon_final_x(mp)], p, ema, hyper, decay});
    else muon_tiles<MUON_TILE_APPLY, T, S>(mp, g_stream, 0, (int)mp->groups.size(), nullptr, nullptr, p, ema, hyper,
                                           0.f, decay);
}
static void muon_step(MuonPlan* mp, float* p, const float* g, float* buf, float* v, float* ema, const float* hyper,
                      float beta1, float beta2, float eps, float lr, float weight_decay) {
    muon_types(mp, [&](auto t, auto s) {
        muon_step_t<decltype(t), decltype(s)>(mp, p, g, buf, v, ema, hyper, beta1, beta2, eps, lr, weight_decay);
    });
}

// one AdamW step (PyTorch's formula with bias correction), then the EMA update (warmed up) when ema_rate >= 0, of
// the parameters this process keeps state for (all of them on one GPU; ZeRO-1: its shard; m->adam_t, the host's
// count, is kept in step with the device's m->adam_dev[0])
static void unet_adamw(UNet* m, float lr, float beta1, float beta2, float eps, float weight_decay, float ema_rate) {
    m->adam_t++;
    adam_prep_kernel<<<1, 1, 0, g_stream>>>(m->adam_dev, m->adam_hyper, lr, beta1, beta2, ema_rate);
    cudaCheck(cudaGetLastError());
    const size_t o = m->state_off;
    adamw_kernel<<<ceil_div(m->n_state, EW), EW, 0, g_stream>>>(m->p + o, m->g + o, m->m, m->v,
                                                                ema_rate >= 0.f ? m->ema : nullptr, m->n_state, beta1,
                                                                beta2, lr * weight_decay, eps, m->adam_hyper);
    cudaCheck(cudaGetLastError());
}
// --optimizer muon (m->muon set): the AdamW counter, then muon_step (AdamW for the rest, EMA of everything)
static void unet_muon(UNet* m, float lr, float beta1, float beta2, float eps, float weight_decay, float ema_rate) {
    m->adam_t++;
    adam_prep_kernel<<<1, 1, 0, g_stream>>>(m->adam_dev, m->adam_hyper, lr, beta1, beta2, ema_rate);
    cudaCheck(cudaGetLastError());
    muon_step(m->muon, m->p, m->g, m->m, m->v, ema_rate >= 0.f ? m->ema : nullptr, m->adam_hyper, beta1, beta2, eps,
              lr, weight_decay);
}
static void unet_update(UNet* m, float lr, float beta1, float beta2, float eps, float weight_decay, float ema_rate) {
    if (m->muon) unet_muon(m, lr, beta1, beta2, eps, weight_decay, ema_rate);
    else unet_adamw(m, lr, beta1, beta2, eps, weight_decay, ema_rate);
    unet_weights_changed(m);
}
// sets the optimizer's step count on both sides (fresh model: 0; resumed: the checkpoint's step)
static void unet_set_adam_step(UNet* m, int t) {
    m->adam_t = t;
    cudaCheck(cudaMemcpy(m->adam_dev, &t, sizeof(int), cudaMemcpyHostToDevice));
}

// x_t from m->x0, m->noise, m->t
static void unet_q_sample(UNet* m) {
    int per = m->cfg.image_size * m->cfg.image_size * m->cfg.in_channels;
    dim3 grid(ceil_div((size_t)m->B * per, EW));
    if (m->prec == PREC_BF16)
        q_sample_kernel<<<grid, EW, 0, g_stream>>>(m->x0, m->noise, m->t, m->sqrt_acp, m->sqrt_1m_acp, m->xt->xb, m->B,
                                                   per);
    else
        q_sample_kernel<<<grid, EW, 0, g_stream>>>(m->x0, m->noise, m->t, m->sqrt_acp, m->sqrt_1m_acp, m->xt->x, m->B,
                                                   per);
    cudaCheck(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------------------------
// weights in and out (PyTorch layout in files, by dev/unet.py state_dict name)

// Copies the host arrays of ours-layout parameters of every name prefix+param into dst (device). "" or an error.
static std::string unet_load_tensors(UNet* m, const BinFile* f, const std::string& prefix, float* dst) {
    std::vector<float> host(m->n_params);
    for (const Param& p : m->params) {
        std::string err;
        const void* src = bin_expect(f, prefix + p.name, DT_F32, p.ndim, p.shape, &err);
        if (!src) return err;
        std::vector<float> tmp(p.n);
        memcpy(tmp.data(), src, p.n * 4);
        param_from_torch(p, tmp.data(), host.data() + p.off);
    }
    if (dst) cudaCheck(cudaMemcpy(dst, host.data(), m->n_params * 4, cudaMemcpyHostToDevice));
    return "";
}

// The optimizer fields (slots 25..29; 0 in files from before them: AdamW): optimizer 0 (adamw) or 1 (muon), Muon's
// settings in the ranges of their flags, or 0 with AdamW. "" or an error.
static std::string checkpoint_optimizer_check(const BinFile* f) {
    const int32_t* h = f->hdr;
    if (h[25] != OPT_ADAMW && h[25] != OPT_MUON)
        return strfmt("%s: header field optimizer is %d, expected 0 (adamw) or 1 (muon)", f->path.c_str(), h[25]);
    const bool muon = h[25] == OPT_MUON;
    const float lr = hdr_float(h, 26), mu = hdr_float(h, 27);
    const char* name[4] = {"muon_lr", "muon_momentum", "muon_nesterov", "ns_steps"};
    const bool ok[4] = {muon ? lr >= 1e-9f && lr <= 1e9f : h[26] == 0, muon ? mu >= 0.f && mu <= 0.999999f : h[27] == 0,
                        muon ? h[28] == 0 || h[28] == 1 : h[28] == 0, muon ? h[29] >= 1 && h[29] <= 99 : h[29] == 0};
    const char* range[4] = {"1e-9..1e9", "0..0.999999", "0 or 1", "1..99"};
    for (int k = 0; k < 4; k++) {
        if (ok[k]) continue;
        const std::string v = k < 2 ? strfmt("%g", hdr_float(h, 26 + k)) : std::to_string(h[26 + k]);
        return strfmt("%s: header field %s is %s, expected %s", f->path.c_str(), name[k], v.c_str(),
                      muon ? strfmt("%s (optimizer 1, muon)", range[k]).c_str() : "0 (unused by optimizer 0, adamw)");
    }
    return "";
}
// The training fields of a checkpoint header (slots 18..24) in the ranges train_unet writes. "" or an error.
static std::string checkpoint_fields_check(const BinFile* f) {
    const int32_t* h = f->hdr;
    auto bad = [&](const char* field, const std::string& found, const char* expected) {
        return f->path + ": header field " + field + " is " + found + ", expected " + expected;
    };
    float lr = hdr_float(h, 21), ema_rate = hdr_float(h, 22);
    char buf[64];
    if (h[18] < 0 || h[18] > 1000000000) return bad("step", std::to_string(h[18]), "0..1000000000");
    if (h[19] < 1 || h[19] > 4096) return bad("batch_size", std::to_string(h[19]), "1..4096");
    if (h[20] < 0) return bad("seed", std::to_string(h[20]), "0..2147483647");
    snprintf(buf, sizeof buf, "%g", lr);
    if (!(lr > 0.f && lr <= 1.f)) return bad("lr", buf, "a learning rate in (0, 1]");
    snprintf(buf, sizeof buf, "%g", ema_rate);
    if (!(ema_rate >= 0.f && ema_rate <= 1.f)) return bad("ema_rate", buf, "a rate in [0, 1]");
    if (h[23] != 0 && h[23] != 1) return bad("has_ema", std::to_string(h[23]), "0 or 1");
    if (h[24] != 0 && h[24] != 1) return bad("has_optimizer", std::to_string(h[24]), "0 or 1");
    return checkpoint_optimizer_check(f);
}

// Checks everything a checkpoint claims before a byte of it is used (host only; nothing allocated beyond the file
// already read): the model of its header, its training fields, exactly the tensors this model and its has_ema /
// has_optimizer flags call for with their dtypes and shapes, every float finite, AdamW's second moments >= 0, and
// rng_state = {seed, step, ...} of the header. need_ema / need_optimizer: what the caller will load. "" or an error.
static std::string checkpoint_validate(UNet* m, const BinFile* f, bool need_ema, bool need_optimizer) {
    std::string d = config_diff(config_from_header(f->hdr), m->cfg);
    if (!d.empty()) return f->path + ": header field " + d + " (the model)";
    std::string e = checkpoint_fields_check(f);
    if (!e.empty()) return e;
    const int32_t* h = f->hdr;
    const char* prefixes[4] = {"", "ema.", h[25] == OPT_MUON ? "muon_m." : "adam_m.", "adam_v."};
    const bool stored[4] = {true, h[23] == 1, h[24] == 1, h[24] == 1};
    std::set<std::string> names;
    std::string msg;
    for (int k = 0; k < 4; k++) {
        if (!stored[k]) continue;
        for (const Param& p : m->params) {
            std::string name = prefixes[k] + p.name;
            const char* x = (const char*)bin_expect(f, name, DT_F32, p.ndim, p.shape, &e);
            if (!x) return e;
            for (size_t i = 0; i < p.n; i++) {
                float v;
                memcpy(&v, x + 4 * i, 4);
                if (!std::isfinite(v) || (k == 3 && v < 0.f)) {
                    msg = strfmt("%s: tensor %s[%zu] is %g, expected %s", f->path.c_str(), name.c_str(), i, v,
                                 k == 3 ? "a finite second moment >= 0 (not negative)" : "a finite number");
                    return msg;
                }
            }
            names.insert(name);
        }
    }
    if (h[24] == 1) {
        int shape[1] = {4};
        const char* r = (const char*)bin_expect(f, "rng_state", DT_I32, 1, shape, &e);
        if (!r) return e;
        int32_t rng[4];
        memcpy(rng, r, sizeof rng);
        if (rng[0] != h[20] || rng[1] != h[18] || rng[2] < 0 || rng[2] > rng[1]) {
            msg = strfmt("%s: tensor rng_state is {%d, %d, %d, ...}, expected {seed %d, step %d, optimizer steps "
                         "0..%d, ...} as the header",
                         f->path.c_str(), rng[0], rng[1], rng[2], h[20], h[18], h[18]);
            return msg;
        }
        names.insert("rng_state");
    }
    for (const BinEntry& be : f->entries)
        if (!names.count(be.name))
            return f->path + ": tensor " + be.name + " is not one of this model's (has_ema " + std::to_string(h[23]) +
                   ", has_optimizer " + std::to_string(h[24]) + ")";
    if (f->entries.size() != names.size())
        return f->path + ": holds " + std::to_string(f->entries.size()) + " tensors, this model " +
               std::to_string(names.size()) + " (a tensor appears twice)";
    if (need_ema && !h[23]) return f->path + ": header field has_ema is 0, expected 1";
    if (need_optimizer && !h[24]) return f->path + ": header field has_optimizer is 0, expected 1";
    return "";
}

struct TrainState {
    int step = 0, batch_size = 32, seed = 0;
    float lr = 1e-4f, ema_rate = 0.999f;
    int optimizer = OPT_ADAMW, muon_nesterov = 0, ns_steps = 0;  // header slots 25..29 (Muon's: 0 with AdamW)
    float muon_lr = 0.f, muon_momentum = 0.f;
};

// Writes weights, EMA, AdamW moments (ours[0..3]: n_params floats each in our layout, turned into PyTorch's here),
// step and RNG state atomically (binw_write). "" or an error.
static std::string unet_write_checkpoint(UNet* m, const std::string& path, const TrainState& st,
                                         std::vector<float>* ours) {
    std::vector<float> tmp(m->n_params);
    std::vector<float>* host = ours;
    for (int k = 0; k < 4; k++) {
        for (const Param& p : m->params) param_to_torch(p, ours[k].data() + p.off, tmp.data() + p.off);
        ours[k].swap(tmp);
    }
    BinWriter w;
    binw_init(&w, UNET_CHECKPOINT_MAGIC);
    config_to_header(m->cfg, w.hdr);
    w.hdr[18] = st.step; w.hdr[19] = st.batch_size; w.hdr[20] = st.seed;
    w.hdr[21] = float_bits(st.lr); w.hdr[22] = float_bits(st.ema_rate);
    w.hdr[23] = 1; w.hdr[24] = 1;
    const bool muon = st.optimizer == OPT_MUON;
    w.hdr[25] = st.optimizer;
    w.hdr[26] = muon ? float_bits(st.muon_lr) : 0; w.hdr[27] = muon ? float_bits(st.muon_momentum) : 0;
    w.hdr[28] = muon ? st.muon_nesterov : 0; w.hdr[29] = muon ? st.ns_steps : 0;
    const char* prefixes[4] = {"", "ema.", muon ? "muon_m." : "adam_m.", "adam_v."};
    std::vector<std::string> names;
    names.reserve(4 * m->params.size());
    for (int k = 0; k < 4; k++)
        for (const Param& p : m->params) {
            names.push_back(prefixes[k] + p.name);
            binw_add(&w, names.back(), DT_F32, p.ndim, p.shape, host[k].data() + p.off);
        }
    // the loader's random draws are functions of (seed, step): that pair is the whole RNG state
    int32_t rng_state[4] = {st.seed, st.step, m->adam_t, 0};
    int shape[1] = {4};
    binw_add(&w, "rng_state", DT_I32, 1, shape, rng_state);
    return binw_write(&w, path);
}
// The checkpoint of one GPU's model (or of a rank whose AdamW state is whole: no ZeRO-1)
static std::string unet_save_checkpoint(UNet* m, const std::string& path, const TrainState& st) {
    std::vector<float> ours[4];
    float* srcs[4] = {m->p, m->ema, m->m, m->v};
    for (int k = 0; k < 4; k++) {
        ours[k].resize(m->n_params);
        cudaCheck(cudaMemcpy(ours[k].data(), srcs[k], m->n_params * 4, cudaMemcpyDeviceToHost));
    }
    return unet_write_checkpoint(m, path, st, ours);
}

// ---------------------------------------------------------------------------------------------------------------
// several GPUs, host side: where this process stands among the ranks (the launcher's variables), its GPU, and the
// exchange of NCCL's unique id from rank 0 over TCP or through a file on a shared path. No CUDA or NCCL call here:
// dev/test_unet_dist.cu runs all of it on machines without either.

struct DistEnv {
    int rank = 0, world = 1, local_rank = 0;
    std::string launcher = "none";  // whose variables gave them
};

// A non-negative decimal integer from the environment: "" (*v set, *found true), "" with *found false when the
// variable is absent, or why it cannot be read.
static std::string env_int(const char* name, int* v, bool* found) {
    const char* s = getenv(name);
    *found = s != nullptr;
    if (!s) return "";
    char* end = nullptr;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (!*s || *end || errno || x < 0 || x > INT_MAX)
        return std::string(name) + "='" + s + "' is not a non-negative integer";
    *v = (int)x;
    return "";
}

// Rank, world size and local rank from the first launcher whose world-size variable is set, in this order:
// OpenMPI's mpirun and torchrun first (either may run inside a Slurm allocation, whose variables then describe the
// allocation, not the processes), then PMI (MPICH, Intel MPI), then Slurm's srun. None set: one process. "" or an
// error naming the variables.
static std::string dist_env_parse(DistEnv* d) {
    struct Launcher { const char *name, *rank, *world, *local[2]; };
    static const Launcher launchers[] = {
        {"OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", {"OMPI_COMM_WORLD_LOCAL_RANK", nullptr}},
        {"torchrun", "RANK", "WORLD_SIZE", {"LOCAL_RANK", nullptr}},
        {"PMI", "PMI_RANK", "PMI_SIZE", {"MPI_LOCALRANKID", "PMI_LOCAL_RANK"}},
        {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", {"SLURM_LOCALID", nullptr}},
    };
    *d = DistEnv();
    for (const Launcher& l : launchers) {
        if (!getenv(l.world)) continue;
        const std::string who = std::string(" (") + l.name + " variables)";
        bool found = false;
        std::string e = env_int(l.world, &d->world, &found);
        if (e.empty() && d->world < 1) e = std::string(l.world) + "=0: a world of no processes";
        if (e.empty()) e = env_int(l.rank, &d->rank, &found);
        if (e.empty() && !found) e = std::string(l.world) + " is set but " + l.rank + " is not";
        found = false;
        for (int k = 0; k < 2 && l.local[k] && e.empty() && !found; k++)
            e = env_int(l.local[k], &d->local_rank, &found);
        if (e.empty() && !found)
            e = std::string(l.world) + " is set but " + l.local[0] + (l.local[1] ? std::string(" (or ") +
                l.local[1] + ")" : std::string()) + " is not";
        if (e.empty() && d->rank >= d->world)
            e = std::string(l.rank) + "=" + std::to_string(d->rank) + " is not below " + l.world + "=" +
                std::to_string(d->world);
        if (e.empty() && d->local_rank > d->rank)
            e = std::string("local rank ") + std::to_string(d->local_rank) + " is above " + l.rank + "=" +
                std::to_string(d->rank) + ": a node's ranks are numbered from 0 within the global ranks";
        if (!e.empty()) {
            *d = DistEnv();
            return e + who;
        }
        d->launcher = l.name;
        return "";
    }
    return "";
}

// The GPU this rank takes: its local rank among the visible GPUs; a launcher that binds one GPU per process
// (CUDA_VISIBLE_DEVICES naming a single device) leaves device 0. -1 with *err when the node has too few.
static int dist_device(const DistEnv& d, int n_gpus, std::string* err) {
    const char* vis = getenv("CUDA_VISIBLE_DEVICES");
    if (n_gpus == 1 && vis && *vis && !strchr(vis, ',')) return 0;
    if (d.local_rank < n_gpus) return d.local_rank;
    *err = "rank " + std::to_string(d.rank) + " has local rank " + std::to_string(d.local_rank) + " but this node "
           "shows " + std::to_string(n_gpus) + " GPU" + (n_gpus == 1 ? "" : "s") + (vis ? std::string(
           " (CUDA_VISIBLE_DEVICES=") + vis + ")" : std::string()) + ": start at most one process per GPU";
    return -1;
}

// Rank r's share of a global batch of world * B samples: samples r*B .. r*B+B-1 of every step, exactly those a
// single GPU with the global batch takes (all: nsteps x world*B, step-major); and the offset of its noise in the
// step's Philox stream (n_local noise values per rank, the single GPU's stream cut into world pieces).
static std::vector<int> dist_share(const std::vector<int>& all, int nsteps, int B, int world, int rank) {
    std::vector<int> mine((size_t)nsteps * B);
    for (int s = 0; s < nsteps; s++)
        for (int b = 0; b < B; b++) mine[(size_t)s * B + b] = all[((size_t)s * world + rank) * B + b];
    return mine;
}
static unsigned long long dist_noise_offset(long long step, size_t n_local, int world, int rank) {
    return (unsigned long long)step * n_local * world + (unsigned long long)rank * n_local;
}
// ZeRO-1: every rank owns one contiguous shard of the parameter arena, 64 floats aligned (NCCL's 256-byte
// chunks); the arena is padded to world shards
[[maybe_unused]] static size_t dist_shard_floats(size_t n_params, int world) {
    size_t per = (n_params + world - 1) / world;
    return (per + 63) / 64 * 64;
}

struct DistOpts {
    std::string master_addr, id_file;  // --master_addr (else MASTER_ADDR, else 127.0.0.1), --nccl_id_file
    int master_port = 0;               // --master_port (else MASTER_PORT, else 29500)
    double timeout_s = 120;            // --dist_timeout: every wait for another rank at start-up
    uint64_t config = 0;               // a hash of the run's flags: every rank must run the same command
};
// The address rank 0 serves the id on, from the flags, then torchrun's variables, then one node's defaults.
static std::string dist_resolve_master(DistOpts* o) {
    if (o->master_addr.empty()) {
        const char* a = getenv("MASTER_ADDR");
        o->master_addr = a && *a ? a : "127.0.0.1";
    }
    if (o->master_port == 0) {
        bool found = false;
        int port = 29500;
        std::string e = env_int("MASTER_PORT", &port, &found);
        if (!e.empty()) return e;
        if (port < 1 || port > 65535) return "MASTER_PORT=" + std::to_string(port) + " is not a port (1..65535)";
        o->master_port = port;
    }
    return "";
}

static const int DIST_ID_BYTES = 128;  // sizeof(ncclUniqueId), checked where NCCL is built in
struct DistId { unsigned char b[DIST_ID_BYTES]; };
static const int32_t DIST_MAGIC = 0x554e4349;  // "UNCI": train_unet's NCCL id, asked for or served
static const int32_t DIST_VERSION = 1;

static double dist_now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static uint64_t dist_hash(const std::string& s) {  // FNV-1a
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
}
static std::string dist_list(const std::vector<int>& ranks) {  // "2, 3, 5" (the first 16)
    std::string s;
    for (size_t i = 0; i < ranks.size() && i < 16; i++) s += (i ? ", " : "") + std::to_string(ranks[i]);
    return ranks.size() > 16 ? s + ", ... (" + std::to_string(ranks.size()) + " in all)" : s;
}

// Exactly n bytes through a non-blocking socket before the deadline; false on timeout, error or a closed peer.
static bool dist_sock_io(int fd, void* buf, size_t n, bool out, double deadline) {
    char* p = (char*)buf;
    while (n > 0) {
        ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
        int ms = (int)((deadline - dist_now()) * 1000);
        if (ms <= 0) return false;
        struct pollfd pf = {fd, (short)(out ? POLLOUT : POLLIN), 0};
        poll(&pf, 1, std::min(ms, 1000));
    }
    return true;
}

// The request a rank sends and the reply rank 0 gives (status 0: the id follows)
struct DistHello { int32_t magic, version, rank, world; uint64_t config; };
struct DistReply { int32_t magic, status; DistId id; };
enum { DIST_OK = 0, DIST_BAD_WORLD = 1, DIST_BAD_RANK = 2, DIST_BAD_CONFIG = 3 };

// Rank 0: serves the id to every other rank on the port, then returns. "" or an error.
static std::string dist_serve_id(const DistEnv& d, const DistOpts& o, const DistId& id) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return std::string("rank 0 cannot open a socket (") + strerror(errno) + ")";
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons((uint16_t)o.master_port);
    if (bind(fd, (struct sockaddr*)&sa, sizeof sa) != 0 || listen(fd, 128) != 0) {
        std::string e = "rank 0 cannot listen on port " + std::to_string(o.master_port) + " (" + strerror(errno) +
                        "): another job may hold it; pick another with --master_port or MASTER_PORT";
        close(fd);
        return e;
    }
    const double deadline = dist_now() + o.timeout_s;
    std::vector<char> served(d.world, 0);
    served[0] = 1;
    int left = d.world - 1;
    std::string err;
    while (left > 0 && err.empty()) {
        int ms = (int)((deadline - dist_now()) * 1000);
        if (ms <= 0) {
            std::vector<int> missing;
            for (int r = 1; r < d.world; r++)
                if (!served[r]) missing.push_back(r);
            char t[32];
            snprintf(t, sizeof t, "%g", o.timeout_s);
            err = std::string("rank 0 waited ") + t + " s (--dist_timeout) on port " + std::to_string(o.master_port) +
                  " for rank" + (missing.size() > 1 ? "s " : " ") + dist_list(missing) + " of world " +
                  std::to_string(d.world) + " to fetch the NCCL id: never connected (not started, failed, or "
                  "pointed elsewhere: MASTER_ADDR must name this host, MASTER_PORT this port)";
            break;
        }
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, std::min(ms, 1000)) <= 0) continue;
        int c = accept4(fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) continue;
        DistHello h;
        // a stranger, or a rank that died while asking: not one of ours, keep serving the others
        if (!dist_sock_io(c, &h, sizeof h, false, std::min(deadline, dist_now() + 5.0)) || h.magic != DIST_MAGIC ||
            h.version != DIST_VERSION) {
            close(c);
            continue;
        }
        DistReply rep;
        memset(&rep, 0, sizeof rep);
        rep.magic = DIST_MAGIC;
        rep.status = h.world != d.world                            ? DIST_BAD_WORLD
                     : h.rank < 1 || h.rank >= d.world || served[h.rank] ? DIST_BAD_RANK
                     : h.config != o.config                        ? DIST_BAD_CONFIG
                                                                   : DIST_OK;
        if (rep.status == DIST_OK) rep.id = id;
        bool sent = dist_sock_io(c, &rep, sizeof rep, true, std::min(deadline, dist_now() + 5.0));
        close(c);
        if (rep.status == DIST_BAD_WORLD)
            err = "rank " + std::to_string(h.rank) + " asked for the NCCL id with world size " +
                  std::to_string(h.world) + ", rank 0 has " + std::to_string(d.world) +
                  ": every rank must be launched with the same world size";
        else if (rep.status == DIST_BAD_RANK)
            err = "two processes claim rank " + std::to_string(h.rank) + " (or it is out of 1.." +
                  std::to_string(d.world - 1) + "): every rank must be unique";
        else if (rep.status == DIST_BAD_CONFIG)
            err = "rank " + std::to_string(h.rank) + " runs with other flags than rank 0: every rank must run the "
                  "same command";
        else if (sent) {
            served[h.rank] = 1;
            left--;
        }
    }
    close(fd);
    return err;
}

// Every rank but 0: connects to rank 0 (retrying while it is not up yet) and receives the id. "" or an error.
static std::string dist_fetch_id(const DistEnv& d, const DistOpts& o, DistId* id) {
    const std::string where = o.master_addr + ":" + std::to_string(o.master_port);
    struct addrinfo hints, *res = nullptr;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int g = getaddrinfo(o.master_addr.c_str(), std::to_string(o.master_port).c_str(), &hints, &res);
    if (g != 0 || !res)
        return "rank " + std::to_string(d.rank) + ": cannot resolve rank 0's address " + o.master_addr + " (" +
               gai_strerror(g) + "): set MASTER_ADDR or --master_addr to rank 0's host";
    const double deadline = dist_now() + o.timeout_s;
    std::string last = "no answer";
    std::string err;
    bool done = false;
    while (!done && err.empty() && dist_now() < deadline) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            err = std::string("cannot open a socket (") + strerror(errno) + ")";
            break;
        }
        bool up = connect(fd, res->ai_addr, res->ai_addrlen) == 0;
        if (!up && errno == EINPROGRESS) {
            struct pollfd pf = {fd, POLLOUT, 0};
            int ms = std::max(1, std::min(1000, (int)((deadline - dist_now()) * 1000)));
            int soerr = 0;
            socklen_t len = sizeof soerr;
            if (poll(&pf, 1, ms) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0) {
                up = soerr == 0;
                if (soerr) last = strerror(soerr);
            } else {
                last = "connection timed out";
            }
        } else if (!up) {
            last = strerror(errno);
        }
        if (up) {
            DistHello h = {DIST_MAGIC, DIST_VERSION, d.rank, d.world, o.config};
            DistReply rep;
            if (dist_sock_io(fd, &h, sizeof h, true, deadline) && dist_sock_io(fd, &rep, sizeof rep, false, deadline) &&
                rep.magic == DIST_MAGIC) {
                if (rep.status == DIST_OK) {
                    *id = rep.id;
                    done = true;
                } else {
                    err = rep.status == DIST_BAD_WORLD ? "rank 0 has another world size (WORLD_SIZE " +
                                                             std::to_string(d.world) + " here)"
                          : rep.status == DIST_BAD_RANK ? "rank 0 already served a process with this rank"
                                                        : "rank 0 runs with other flags: every rank must run the same "
                                                          "command";
                }
            } else {
                last = "the process at " + where + " did not answer as train_unet's rank 0";
            }
        }
        close(fd);
        if (!done && err.empty()) usleep(100 * 1000);  // rank 0 not up yet
    }
    freeaddrinfo(res);
    if (done) return "";
    if (!err.empty()) return "rank " + std::to_string(d.rank) + ": " + err;
    char t[32];
    snprintf(t, sizeof t, "%g", o.timeout_s);
    return "rank " + std::to_string(d.rank) + " waited " + t + " s (--dist_timeout) for rank 0's NCCL id at " + where +
           " (" + last + "): is rank 0 running, and are MASTER_ADDR / MASTER_PORT (--master_addr / --master_port) "
           "its host and port?";
}

// The file form: rank 0 writes {magic, version, world, config, job, id} to a temporary name and renames it (never a
// torn file); the others poll until a file of this job and world is there. The job (the launcher's job id where it
// has one) and the world tell a stale file of an earlier run from this one's; rank 0 removes it once NCCL is up.
struct DistIdFile { int32_t magic, version, world, pad; uint64_t config; char job[64]; DistId id; };
static void dist_job_key(char job[64]) {
    memset(job, 0, 64);
    for (const char* v : {"SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", "PMI_JOBID"}) {
        const char* s = getenv(v);
        if (s && *s) {
            snprintf(job, 64, "%s=%s", v, s);
            return;
        }
    }
}
static std::string dist_write_id_file(const DistEnv& d, const DistOpts& o, const DistId& id) {
    DistIdFile f;
    memset(&f, 0, sizeof f);
    f.magic = DIST_MAGIC;
    f.version = DIST_VERSION;
    f.world = d.world;
    f.config = o.config;
    dist_job_key(f.job);
    f.id = id;
    const std::string tmp = o.id_file + ".tmp." + std::to_string((long)getpid());
    int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    bool ok = fd >= 0 && write(fd, &f, sizeof f) == (ssize_t)sizeof f && fsync(fd) == 0;
    int saved = errno;
    if (fd >= 0) close(fd);
    if (ok && rename(tmp.c_str(), o.id_file.c_str()) != 0) {
        ok = false;
        saved = errno;
    }
    if (!ok) {
        unlink(tmp.c_str());
        return "rank 0 cannot write --nccl_id_file " + o.id_file + " (" + strerror(saved) + ")";
    }
    return "";
}
static std::string dist_read_id_file(const DistEnv& d, const DistOpts& o, DistId* id) {
    const double deadline = dist_now() + o.timeout_s;
    char job[64];
    dist_job_key(job);
    std::string seen = "no such file";
    while (true) {
        DistIdFile f;
        int fd = open(o.id_file.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t n = read(fd, &f, sizeof f);
            char extra;
            bool whole = n == (ssize_t)sizeof f && read(fd, &extra, 1) == 0;
            close(fd);
            if (!whole || f.magic != DIST_MAGIC || f.version != DIST_VERSION) {
                seen = "a file that is not train_unet's NCCL id";
            } else if (f.world != d.world || memcmp(f.job, job, 64) != 0) {
                f.job[63] = 0;
                seen = "the id of another run (world " + std::to_string(f.world) + (f.job[0] ? std::string(", ") +
                       f.job : std::string()) + "): a stale file from an earlier run?";
            } else if (f.config != o.config) {
                return "rank " + std::to_string(d.rank) + ": --nccl_id_file " + o.id_file + " comes from a rank 0 "
                       "that runs with other flags: every rank must run the same command";
            } else {
                *id = f.id;
                return "";
            }
        }
        if (dist_now() >= deadline) break;
        usleep(50 * 1000);
    }
    char t[32];
    snprintf(t, sizeof t, "%g", o.timeout_s);
    return "rank " + std::to_string(d.rank) + " waited " + t + " s (--dist_timeout) for rank 0 to write the NCCL id "
           "to --nccl_id_file " + o.id_file + " (found: " + seen + "): is rank 0 running, and is the path on a file "
           "system every node shares?";
}

// Rank 0 hands *id to every other rank, by --nccl_id_file or over TCP; the others receive it. "" or an error.
[[maybe_unused]] static std::string dist_share_id(const DistEnv& d, const DistOpts& o, DistId* id) {
    if (d.world == 1) return "";
    if (!o.id_file.empty())
        return d.rank == 0 ? dist_write_id_file(d, o, *id) : dist_read_id_file(d, o, id);
    return d.rank == 0 ? dist_serve_id(d, o, *id) : dist_fetch_id(d, o, id);
}

// Gradient buckets: each a set of parameter ranges (offset, floats) of the arena whose gradients are final once the
// backward pass has run op after_op (ops run backward from the last), all-reduced together while the backward goes
// on. A resblock's emb_layers and the time embedding get their gradients after the last op (unet_backward_t), so
// they form the last bucket (after_op -1) with whatever the cap left. cap_floats 0: one bucket, no overlap.
struct GradBucket {
    int after_op = -1;
    std::vector<std::pair<size_t, size_t>> ranges;
    size_t floats = 0;
};
[[maybe_unused]] static std::vector<GradBucket> dist_plan_buckets(const UNet* m, size_t cap_floats) {
    auto padded = [&](size_t off) {  // the parameter at off with its alignment padding (add_param)
        for (const Param& p : m->params)
            if (p.off == off) return (p.n + 7) / 8 * 8;
        fprintf(stderr, "error: dist_plan_buckets: no parameter at offset %zu\n", off);
        exit(EXIT_FAILURE);
    };
    std::vector<GradBucket> out;
    GradBucket cur;
    auto add = [&](size_t off) {
        cur.ranges.push_back({off, padded(off)});
        cur.floats += cur.ranges.back().second;
    };
    for (int i = (int)m->ops.size() - 1; i >= 0; i--) {
        op_grad_params(m, i, add);
        if (cap_floats > 0 && cur.floats >= cap_floats) {
            cur.after_op = i;
            out.push_back(cur);
            cur = GradBucket();
        }
    }
    op_grad_params(m, -1, add);
    cur.after_op = -1;
    out.push_back(cur);
    for (GradBucket& b : out) {  // neighbours in the arena become one range: fewer, larger all-reduces
        std::sort(b.ranges.begin(), b.ranges.end());
        std::vector<std::pair<size_t, size_t>> merged;
        for (const auto& r : b.ranges) {
            if (!merged.empty() && merged.back().first + merged.back().second == r.first)
                merged.back().second += r.second;
            else
                merged.push_back(r);
        }
        b.ranges = merged;
    }
    return out;
}

#ifdef UNET_NCCL
// ---------------------------------------------------------------------------------------------------------------
// several GPUs over NCCL: the communicator, its watchdog, the gradient all-reduce (bucketed, overlapped with the
// backward pass, inside the step's CUDA graph) and ZeRO-1 (reduce-scatter, a shard's AdamW, all-gather)
static_assert(sizeof(ncclUniqueId) == DIST_ID_BYTES, "DIST_ID_BYTES must be the size of NCCL's unique id");

// A thread that ends the process when NCCL reports an error on the communicator, or when the main thread has waited
// on work that involves the other ranks for longer than its limit: a dead peer leaves the others' collectives
// spinning (on NVLink with no error at all). It prints what this rank waited for, calls ncclCommAbort (which frees
// the stuck kernels) and exits 1; if the abort itself hangs, exit 1 comes 10 s later regardless. The freed kernels
// let the main thread go on with garbage, so it halts at its next check (wd_halt_if_failed) and saves nothing.
struct Watchdog {
    std::thread* thread = nullptr;  // never a static std::thread: an error's exit must not find it joinable
    std::atomic<bool> stop{false}, failed{false};
    std::atomic<double> armed_at{0.0}, limit{0.0};  // dist_now() when the current wait began (0: none), seconds
    std::atomic<const char*> what{""};              // the wait, a string literal
    std::atomic<int> step{-1};
    std::atomic<ncclComm_t> comm{nullptr};
    int rank = 0;
};
static Watchdog g_wd;

[[noreturn]] static void wd_fail(const std::string& why) {
    g_wd.failed = true;  // before the abort: whatever the GPU finishes after it was computed without the peers
    std::thread([] {
        sleep(10);
        _exit(EXIT_FAILURE);
    }).detach();
    fprintf(stderr, "error: rank %d: %s; aborting NCCL, exit 1\n", g_wd.rank, why.c_str());
    fflush(stderr);
    fflush(stdout);
    ncclComm_t c = g_wd.comm.load();
    if (c) {
        ncclResult_t r = ncclCommAbort(c);
        if (r != ncclSuccess) fprintf(stderr, "[NCCL ERROR] %s in ncclCommAbort\n", ncclGetErrorString(r));
    }
    _exit(EXIT_FAILURE);
}
static void wd_loop() {
    while (!g_wd.stop.load()) {
        usleep(100 * 1000);
        ncclComm_t c = g_wd.comm.load();
        if (c) {
            ncclResult_t async = ncclSuccess, r = ncclCommGetAsyncError(c, &async);
            if (r != ncclSuccess) wd_fail(std::string("ncclCommGetAsyncError: ") + ncclGetErrorString(r));
            if (async != ncclSuccess && async != ncclInProgress)
                wd_fail(std::string("NCCL reports ") + ncclGetErrorString(async) + " (" + ncclGetLastError(c) +
                        "): a peer rank failed or the network broke");
        }
        const double t0 = g_wd.armed_at.load(), lim = g_wd.limit.load();
        if (t0 > 0 && dist_now() - t0 > lim) {
            std::string msg;
            const int step = g_wd.step.load();
            msg = strfmt("%s%s made no progress in %g s: a peer rank died or hangs (the limit: %s)", g_wd.what.load(),
                         step >= 0 ? (" at step " + std::to_string(step)).c_str() : "", lim,
                         step >= 0 ? "--nccl_timeout" : "--dist_timeout");
            wd_fail(msg);
        }
    }
}
static void wd_arm(const char* what, double limit_s, int step = -1) {
    g_wd.what = what;
    g_wd.step = step;
    g_wd.limit = limit_s;
    g_wd.armed_at = dist_now();
}
static void wd_disarm() { g_wd.armed_at = 0.0; }
// The main thread after each wait on the GPU: once the watchdog has aborted NCCL, nothing more is logged or saved
static void wd_halt_if_failed() {
    while (g_wd.failed.load()) sleep(1);  // the watchdog's _exit ends the process
}

struct Dist {
    DistEnv env;
    DistOpts opts;
    double nccl_timeout = 30;  // --nccl_timeout: the watchdog's limit on a training step's wait
    int zero = 0;              // --zero 1: AdamW moments and EMA sharded (ZeRO-1)
    size_t shard = 0;          // ZeRO-1: floats per rank
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;  // the bucketed all-reduces
    std::vector<GradBucket> buckets;
    std::vector<int> bucket_of_op;   // op index -> the bucket that closes after its backward, or -1
    std::vector<cudaEvent_t> ready;  // per bucket: its gradients are written (recorded on g_stream)
    cudaEvent_t reduced = nullptr;   // every all-reduce of the step has finished (recorded on stream)
};
static Dist* g_dist = nullptr;

// The communicator: rank 0's id to every rank (dist_share_id), then ncclCommInitRank under the watchdog. Call after
// cudaSetDevice. "" or an error.
static std::string dist_init(Dist* d) {
    DistId id;
    memset(&id, 0, sizeof id);
    if (d->env.rank == 0) {
        ncclUniqueId nid;
        ncclCheck(ncclGetUniqueId(&nid));
        memcpy(id.b, &nid, sizeof nid);
    }
    std::string e = dist_share_id(d->env, d->opts, &id);
    if (!e.empty()) return e;
    g_wd.rank = d->env.rank;
    g_wd.thread = new std::thread(wd_loop);
    wd_arm("setting up the NCCL communicator (ncclCommInitRank)", d->opts.timeout_s);
    ncclUniqueId nid;
    memcpy(&nid, id.b, sizeof nid);
    ncclCheck(ncclCommInitRank(&d->comm, d->env.world, nid, d->env.rank));
    wd_disarm();
    g_wd.comm = d->comm;
    if (d->env.rank == 0 && !d->opts.id_file.empty()) unlink(d->opts.id_file.c_str());  // every rank has joined
    return "";
}

// Before unet_allocate: ZeRO-1's shard of the arena for this rank.
static void dist_shard_model(Dist* d, UNet* m) {
    if (!d->zero) return;
    d->shard = dist_shard_floats(m->n_params, d->env.world);
    m->n_alloc = d->shard * d->env.world;
    m->n_state = d->shard;
    m->state_off = d->shard * d->env.rank;
}

// The gradient all-reduce of bucket k on the communication stream once g_stream has written its gradients; the
// last one also averages the loss and makes g_stream wait for every all-reduce (the update reads the gradients).
static void dist_grad_ready(UNet* m, int op) {
    Dist* d = g_dist;
    const int k = op < 0 ? (int)d->buckets.size() - 1 : d->bucket_of_op[op];
    if (k < 0) return;
    cudaCheck(cudaEventRecord(d->ready[k], g_stream));
    cudaCheck(cudaStreamWaitEvent(d->stream, d->ready[k], 0));
    ncclCheck(ncclGroupStart());
    for (const auto& r : d->buckets[k].ranges)
        ncclCheck(ncclAllReduce(m->g + r.first, m->g + r.first, r.second, ncclFloat, ncclAvg, d->comm, d->stream));
    if (op < 0) ncclCheck(ncclAllReduce(m->loss, m->loss, 1, ncclFloat, ncclAvg, d->comm, d->stream));
    ncclCheck(ncclGroupEnd());
    if (op < 0) {
        cudaCheck(cudaEventRecord(d->reduced, d->stream));
        cudaCheck(cudaStreamWaitEvent(g_stream, d->reduced, 0));
    }
}

// After unet_allocate: the buckets (UNET_BUCKET_MB, default 16; 0: one all-reduce after the backward) and their
// stream and events, or nothing with ZeRO-1 (one reduce-scatter after the backward). "" or an error.
static std::string dist_setup_grads(Dist* d, UNet* m) {
    if (d->zero) return "";
    double mb = 16;
    const char* env = getenv("UNET_BUCKET_MB");
    if (env && *env) {
        char* end;
        mb = strtod(env, &end);
        if (*end || !(mb >= 0 && mb <= 1e6)) return std::string("UNET_BUCKET_MB=") + env + ": expected MiB >= 0";
    }
    d->buckets = dist_plan_buckets(m, (size_t)(mb * (1 << 20) / 4));
    size_t covered = 0;
    d->bucket_of_op.assign(m->ops.size(), -1);
    for (size_t k = 0; k < d->buckets.size(); k++) {
        for (const auto& r : d->buckets[k].ranges) covered += r.second;
        if (d->buckets[k].after_op >= 0) d->bucket_of_op[d->buckets[k].after_op] = (int)k;
    }
    if (covered != m->n_params)
        return "the gradient buckets cover " + std::to_string(covered) + " of " + std::to_string(m->n_params) +
               " parameter floats (dist_plan_buckets misses a layer)";
    int lo = 0, hi = 0;
    cudaCheck(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaCheck(cudaStreamCreateWithPriority(&d->stream, cudaStreamNonBlocking, hi));  // NCCL first, then compute
    d->ready.resize(d->buckets.size());
    for (cudaEvent_t& e : d->ready) cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&d->reduced, cudaEventDisableTiming));
    g_dist = d;
    g_grad_ready = dist_grad_ready;
    return "";
}

// The update after the backward: with buckets the all-reduces already ran (dist_grad_ready), so the usual update;
// with ZeRO-1 the reduce-scatter of the gradients (each rank gets the average of its shard) and of the loss, AdamW
// and EMA on the shard, the all-gather of the weights.
static void dist_update(Dist* d, UNet* m, float lr, float beta1, float beta2, float eps, float weight_decay,
                        float ema_rate) {
    if (!d->zero) {
        unet_update(m, lr, beta1, beta2, eps, weight_decay, ema_rate);
        return;
    }
    ncclCheck(ncclGroupStart());
    ncclCheck(ncclReduceScatter(m->g, m->g + m->state_off, d->shard, ncclFloat, ncclAvg, d->comm, g_stream));
    ncclCheck(ncclAllReduce(m->loss, m->loss, 1, ncclFloat, ncclAvg, d->comm, g_stream));
    ncclCheck(ncclGroupEnd());
    unet_adamw(m, lr, beta1, beta2, eps, weight_decay, ema_rate);
    ncclCheck(ncclAllGather(m->p + m->state_off, m->p, d->shard, ncclFloat, d->comm, g_stream));
    unet_weights_changed(m);
}

// ZeRO-1: a full array (n_params floats, our layout) of the sharded state into dst (host, rank 0 only), gathered
// through the gradient arena, which is free between steps. Every rank must call it (a collective).
static void dist_gather_state(Dist* d, UNet* m, const float* shard, std::vector<float>* dst) {
    ncclCheck(ncclAllGather(shard, m->g, d->shard, ncclFloat, d->comm, g_stream));
    if (d->env.rank == 0) {
        dst->resize(m->n_params);
        cudaCheck(cudaMemcpyAsync(dst->data(), m->g, m->n_params * 4, cudaMemcpyDeviceToHost, g_stream));
    }
    cudaCheck(cudaStreamSynchronize(g_stream));
}

// The checkpoint of a run over several GPUs, the same file one GPU writes: rank 0 writes it (after gathering the
// sharded state with ZeRO-1, in which every rank takes part). "" or an error (rank 0).
static std::string dist_save_checkpoint(Dist* d, UNet* m, const std::string& path, const TrainState& st) {
    std::vector<float> ours[4];
    float* srcs[4] = {m->p, m->ema, m->m, m->v};
    for (int k = 0; k < 4; k++) {
        if (d->zero && k > 0) {
            dist_gather_state(d, m, srcs[k], &ours[k]);
        } else if (d->env.rank == 0) {
            ours[k].resize(m->n_params);
            cudaCheck(cudaMemcpy(ours[k].data(), srcs[k], m->n_params * 4, cudaMemcpyDeviceToHost));
        }
    }
    wd_halt_if_failed();
    if (d->env.rank != 0) return "";
    wd_disarm();  // writing the file is this rank's own work, however slow the disk (the next step re-arms)
    return unet_write_checkpoint(m, path, st, ours);
}

// ZeRO-1 resume: the checkpoint's full array under prefix through the gradient arena, this rank's shard into dst
static void dist_load_state(Dist* d, UNet* m, const BinFile* f, const std::string& prefix, float* dst) {
    if (!d->zero) {
        unet_load_tensors(m, f, prefix, dst);
        return;
    }
    unet_load_tensors(m, f, prefix, m->g);
    cudaCheck(cudaMemcpy(dst, m->g + m->state_off, m->n_state * 4, cudaMemcpyDeviceToDevice));
    cudaCheck(cudaMemset(m->g, 0, m->n_alloc * 4));
}

// The end of a run: the communicator finalized (it flushes outstanding work with the peers) and freed under the
// watchdog, then the watchdog stopped.
static void dist_free(Dist* d) {
    if (d->comm) {
        wd_arm("closing the NCCL communicator", d->opts.timeout_s);
        ncclCheck(ncclCommFinalize(d->comm));
        g_wd.comm = nullptr;
        ncclCheck(ncclCommDestroy(d->comm));
        wd_disarm();
        d->comm = nullptr;
    }
    g_wd.stop = true;
    if (g_wd.thread) {
        g_wd.thread->join();
        delete g_wd.thread;
        g_wd.thread = nullptr;
    }
    for (cudaEvent_t e : d->ready) cudaCheck(cudaEventDestroy(e));
    d->ready.clear();
    if (d->reduced) cudaCheck(cudaEventDestroy(d->reduced));
    if (d->stream) cudaCheck(cudaStreamDestroy(d->stream));
    d->reduced = nullptr;
    d->stream = nullptr;
    g_grad_ready = nullptr;
    g_dist = nullptr;
}
#else
// Without NCCL a run has one rank (main refuses more): what unet_train calls for several ranks does nothing.
struct Dist {
    DistEnv env;
    DistOpts opts;
    double nccl_timeout = 30;
    int zero = 0;
    std::vector<GradBucket> buckets;
};
[[maybe_unused]] static std::string dist_init(Dist*) { return "this train_unet was built without NCCL"; }
[[maybe_unused]] static void dist_shard_model(Dist*, UNet*) {}
[[maybe_unused]] static std::string dist_setup_grads(Dist*, UNet*) { return ""; }
[[maybe_unused]] static void dist_update(Dist*, UNet*, float, float, float, float, float, float) {}
[[maybe_unused]] static std::string dist_save_checkpoint(Dist*, UNet*, const std::string&, const TrainState&) {
    return "";
}
[[maybe_unused]] static void dist_load_state(Dist*, UNet*, const BinFile*, const std::string&, float*) {}
[[maybe_unused]] static void dist_free(Dist*) {}
[[maybe_unused]] static void wd_arm(const char*, double, int = -1) {}
[[maybe_unused]] static void wd_disarm() {}
[[maybe_unused]] static void wd_halt_if_failed() {}
#endif  // UNET_NCCL
// The training loop's waits on the GPU (an event, or the whole device): afterwards the results may be used, unless
// the watchdog has given up on the other ranks meanwhile
static void wait_gpu(cudaEvent_t e) {
    if (e) cudaCheck(cudaEventSynchronize(e));
    else cudaCheck(cudaDeviceSynchronize());
    wd_halt_if_failed();
}

// ---------------------------------------------------------------------------------------------------------------
// training and sampling

struct Dataset {
    BinFile file;
    const uint8_t* images = nullptr;  // (N, H, W, 3)
    int n = 0, H = 0, W = 0;
};
// Opens and validates a UNET_DATASET for images of image_size. "" or an error.
static std::string dataset_open(Dataset* d, const char* path, int image_size) {
    std::string e = bin_open(&d->file, path, UNET_DATASET_MAGIC, UNET_FORMAT_VERSION, "unet dataset");
    if (!e.empty()) return e;
    const int32_t* h = d->file.hdr;
    int n = h[3], H = h[4], W = h[5], C = h[6];
    std::string msg;
    if (n < 1 || H < 1 || W < 1) {
        msg = strfmt("%s: header n_images %d, height %d, width %d must be >= 1", path, n, H, W);
        return msg;
    }
    if (C != 3) {
        msg = strfmt("%s: header field channels is %d, expected 3", path, C);
        return msg;
    }
    int shape[4] = {n, H, W, 3};
    const void* p = bin_expect(&d->file, "images", DT_U8, 4, shape, &e);
    if (!p) return e;
    if (H != image_size || W != image_size) {
        msg = strfmt("%s: images are %dx%d, the model's image_size is %d (use --image_size %d or "
                     "prepare the data at %d)",
                     path, H, W, image_size, H, image_size);
        return msg;
    }
    d->images = (const uint8_t*)p;
    d->n = n; d->H = H; d->W = W;
    return "";
}

// The loader's draws for global sample index gi = step*B + b: image perm_epoch[gi % N] (a fresh shuffle every
// epoch), a horizontal flip, a timestep. All functions of (seed, gi): resuming at any step draws the same.
static void batch_draws(int seed, int N, int T, long long step0, int nsteps, int B, std::vector<int>* codes,
                        std::vector<int>* ts) {
    codes->resize((size_t)nsteps * B);
    ts->resize((size_t)nsteps * B);
    long long cached_epoch = -1;
    std::vector<int> perm(N);
    for (long long s = 0; s < nsteps; s++)
        for (int b = 0; b < B; b++) {
            long long gi = (step0 + s) * B + b;
            long long epoch = gi / N;
            if (epoch != cached_epoch) {
                for (int i = 0; i < N; i++) perm[i] = i;
                for (int i = N - 1; i > 0; i--) {  // Fisher-Yates
                    int j = (int)(rng_hash((uint64_t)seed, RNG_SHUFFLE, ((uint64_t)epoch << 32) | (uint64_t)i) %
                                  (uint64_t)(i + 1));
                    std::swap(perm[i], perm[j]);
                }
                cached_epoch = epoch;
            }
            int img = perm[gi % N];
            int flip = (int)(rng_hash((uint64_t)seed, RNG_FLIP, (uint64_t)gi) & 1);
            (*codes)[s * B + b] = img * 2 + flip;
            (*ts)[s * B + b] = (int)(rng_hash((uint64_t)seed, RNG_TIMESTEP, (uint64_t)gi) % (uint64_t)T);
        }
}

// The precision a run gets. bf16, the default, needs bf16 tensor cores (mma.sync, compute capability 8.0 or newer);
// its convolutions run on Hopper's wgmma where the GPU is 9.0 and the build has sm_90a (make builds it where
// nvidia-smi reports 9.0), on mma.sync elsewhere. Below 8.0 the default falls back to tf32 and says so (*note); an
// explicit --precision bf16 is an error (false, after the message).
static bool precision_resolve(Precision* p, bool given, std::string* note) {
    if (*p != PREC_BF16 || have_bf16_mma()) return true;
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    char why[256];
    snprintf(why, sizeof why, "bf16 runs on bf16 tensor cores: it needs a GPU of compute capability 8.0 or newer "
             "(this is %s, %d.%d)", prop.name, prop.major, prop.minor);
    if (given) {
        fprintf(stderr, "error: --precision %s; use --precision tf32\n", why);
        return false;
    }
    *p = PREC_TF32;
    *note = std::string(" (the default bf16 is not available: ") + why + ")";
    return true;
}

// Whether a GPU is there for a mode that needs one; else false after the error: with --device cuda the three
// trainers' message, with auto "no CUDA GPU found: <what>". (--device cpu is refused when the flags are read.)
static bool gpu_for(const std::string& device, const char* what) {
    const char* why = nullptr;
    if (cuda_device_count(&why) > 0) return true;
    if (device == "cuda") fprintf(stderr, "error: --device cuda but no CUDA device is available (%s)\n", why);
    else fprintf(stderr, "error: no CUDA GPU found: %s\n", what);
    return false;
}

struct TrainArgs {
    std::string data_file = "data/sunflowers64.bin", output_dir = "out/unet", resume, load, device = "auto";
    // the start-up table's rows after the device: every flag with the value this run uses (filled by main)
    std::vector<std::pair<std::string, std::string>> settings;
    int batch_size = 32, steps = 4000, log_every = 10, save_every = 1000, seed = 1337;
    Precision precision = PREC_BF16;
    bool precision_given = false;  // an explicit --precision (no fallback from bf16)
    float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.999f, adam_eps = 1e-8f, weight_decay = 0.f, ema_rate = 0.999f;
    // --optimizer muon: Muon for the conv and linear weights (AdamW above for the rest)
    int optimizer = OPT_ADAMW, muon_nesterov = 1, ns_steps = 5, muon_grouping = MG_AUTO, muon_ns = MUON_NS_STANDARD;
    bool muon_overlap = true;  // UNET_MUON_OVERLAP (one rank only)
    float muon_lr = 0.02f, muon_momentum = 0.95f;
    UNetConfig cfg;
    bool quiet = false;
    // several GPUs: this process among the ranks (main: dist_env_parse), how they meet, --zero, --nccl_timeout
    DistEnv dist;
    DistOpts dist_opts;
    std::string master_addr, nccl_id_file;
    int master_port = 0, zero = 0;
    float dist_timeout = 120.f, nccl_timeout = 30.f;
};

static bool make_dirs(const std::string& path) {
    std::string cur;
    for (size_t i = 0; i <= path.size(); i++) {
        if (i == path.size() || path[i] == '/') {
            if (!cur.empty() && mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) return false;
        }
        if (i < path.size()) cur += path[i];
    }
    return true;
}

// Trains per args (GPU required). losses, when given, receives every step's loss. Returns a process exit code.
// The optimizer (Muon's plan for --optimizer muon) and the run's starting state: the checkpoint's weights,
// EMA, optimizer state and step (--resume), its weights (--load) or our initialisation; st gets the run's settings.
static void unet_start(UNet* m, Dist* dp, const BinFile* ck, const TrainArgs& a, TrainState* st) {
    st->batch_size = a.batch_size * a.dist.world;  // checkpoints keep the global batch: they resume on any GPUs
    st->seed = a.seed;
    st->lr = a.lr;
    st->ema_rate = a.ema_rate;
    st->optimizer = a.optimizer;
    st->muon_lr = a.muon_lr;
    st->muon_momentum = a.muon_momentum;
    st->muon_nesterov = a.muon_nesterov;
    st->ns_steps = a.ns_steps;
    if (a.optimizer == OPT_MUON) {
        m->muon = muon_create(m, a.muon_lr, a.muon_momentum, a.muon_nesterov, a.ns_steps, a.muon_grouping,
                              a.muon_ns, m->prec == PREC_BF16, false);
        m->muon->overlap = a.muon_overlap && !dp;  // several ranks: a gradient is final after the all-reduce
    }
    if (!a.resume.empty()) {
        unet_load_tensors(m, ck, "", m->p);
        // the stored optimizer's state, unless --allow_change optimizer switched it: then it starts afresh (zero
        // moments, the optimizer's step count 0, which rng_state[2] keeps for later resumes)
        const bool fresh = a.optimizer != ck->hdr[25];
        const char* first = a.optimizer == OPT_MUON ? "muon_m." : "adam_m.";
        if (dp) {  // ZeRO-1: this rank's shard of each
            dist_load_state(dp, m, ck, "ema.", m->ema);
            if (!fresh) dist_load_state(dp, m, ck, first, m->m);
            if (!fresh) dist_load_state(dp, m, ck, "adam_v.", m->v);
        } else {
            unet_load_tensors(m, ck, "ema.", m->ema);
            if (!fresh) unet_load_tensors(m, ck, first, m->m);
            if (!fresh) unet_load_tensors(m, ck, "adam_v.", m->v);
        }
        st->step = ck->hdr[18];  // seed, lr, batch size, optimizer: the stored ones unless --allow_change (main)
        int shape[1] = {4};
        std::string e;
        const int32_t* rng = (const int32_t*)bin_expect(ck, "rng_state", DT_I32, 1, shape, &e);  // (validated)
        unet_set_adam_step(m, fresh ? 0 : rng[2]);
        unet_weights_changed(m);
    } else if (!a.load.empty()) {
        unet_load_tensors(m, ck, "", m->p);
        cudaCheck(cudaMemcpy(m->ema, m->p + m->state_off, m->n_state * 4, cudaMemcpyDeviceToDevice));
        unet_weights_changed(m);
    } else {
        unet_init_weights(m, (uint64_t)a.seed);
    }
}

// Muon's switches for measurements, into a: UNET_MUON_GROUPS=auto|shape|one (unset: auto), how Muon groups its
// matrices; UNET_MUON_OVERLAP=1|0 (unset: 1), its Newton-Schulz beside the backward pass or after it; else exit 1
static void muon_env(TrainArgs* a) {
    const char* env = getenv("UNET_MUON_GROUPS");
    a->muon_grouping = -1;
    for (int k = 0; k < 3; k++)
        if (!env || !*env ? k == MG_AUTO : !strcmp(env, MUON_GROUPING_NAME[k])) a->muon_grouping = k;
    if (a->muon_grouping < 0) {
        fprintf(stderr, "error: UNET_MUON_GROUPS=%s: expected auto, shape or one\n", env);
        exit(EXIT_FAILURE);
    }
    env = getenv("UNET_MUON_OVERLAP");
    a->muon_overlap = !env || !*env || !strcmp(env, "1");
    if (!a->muon_overlap && strcmp(env, "0")) {
        fprintf(stderr, "error: UNET_MUON_OVERLAP=%s: expected 1 (on) or 0 (off)\n", env);
        exit(EXIT_FAILURE);
    }
}
// the boxed table's rows on Muon: matrices, groups (UNET_MUON_GROUPS), FLOPs and launches per step; the overlap
template <class Row>
static void muon_rows(const MuonPlan* mp, bool several_ranks, Row row) {
    row("muon", strfmt("%zu weights in %zu groups, %zu phases, %s Newton-Schulz, %.0f GFLOP, %d launches",
                       mp->mats.size(), mp->groups.size(), mp->started.size(), MUON_NS_NAME[mp->ns], mp->gflop,
                       mp->launches));
    const std::string off = several_ranks ? "off (several ranks)" : "off (UNET_MUON_OVERLAP=0)";
    row("muon overlap",
        mp->overlap ? strfmt("on (model: %.0f of %.0f us after backward)", mp->est_exposed_us, mp->est_us) : off);
}

static int unet_train(const TrainArgs& a, std::vector<float>* losses) {
    Dataset data;
    std::string e = dataset_open(&data, a.data_file.c_str(), a.cfg.image_size);
    if (!e.empty()) {
        fprintf(stderr, "error: %s\n", e.c_str());
        return 1;
    }
    UNet model;
    UNet* m = &model;
    unet_define(m, a.cfg, a.batch_size);
    BinFile ck;
    const std::string& ckpath = !a.resume.empty() ? a.resume : a.load;
    if (!ckpath.empty()) {
        e = bin_open(&ck, ckpath.c_str(), UNET_CHECKPOINT_MAGIC, UNET_FORMAT_VERSION, "unet checkpoint");
        if (e.empty()) e = checkpoint_validate(m, &ck, !a.resume.empty(), !a.resume.empty());
        if (!e.empty()) {
            fprintf(stderr, "error: %s\n", e.c_str());
            return 1;
        }
    }
    if (!gpu_for(a.device, "train_unet trains on the GPU")) return 1;
    // several GPUs: one process per GPU, the GPU of its local rank, before anything makes a CUDA context
    const int world = a.dist.world, rank = a.dist.rank;
    Dist dist;
    Dist* dp = world > 1 ? &dist : nullptr;
    if (dp) {
        int dev = dist_device(a.dist, cuda_device_count(), &e);
        if (dev < 0) {
            fprintf(stderr, "error: %s\n", e.c_str());
            return 1;
        }
        cudaCheck(cudaSetDevice(dev));
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    Precision prec = a.precision;
    std::string prec_note;
    if (!precision_resolve(&prec, a.precision_given, &prec_note)) return 1;
    size_t mem_free0, mem_total;
    cudaCheck(cudaMemGetInfo(&mem_free0, &mem_total));
    if (dp) {
        dist.env = a.dist;
        dist.opts = a.dist_opts;
        dist.zero = a.zero;
        dist.nccl_timeout = a.nccl_timeout;
        e = dist_init(dp);
        if (!e.empty()) {
            fprintf(stderr, "error: %s\n", e.c_str());
            return 1;
        }
    }
    gpu_init(prec, !dp);  // one GPU: the step's stream above Muon's side stream (several: NCCL's stream is the highest)
    m->prec = prec;
    const char* env_prof = getenv("UNET_PROFILE");
    g_profile = env_prof && env_prof[0] == '1';
    if (g_profile) {
        cudaCheck(cudaEventCreate(&g_pe0));
        cudaCheck(cudaEventCreate(&g_pe1));
        memset(g_prof_ms, 0, sizeof g_prof_ms);
    }
    if (dp) dist_shard_model(dp, m);
    unet_allocate(m);
    if (dp) {
        e = dist_setup_grads(dp, m);
        if (!e.empty()) {
            fprintf(stderr, "error: %s\n", e.c_str());
            return 1;
        }
    }
    TrainState st;
    unet_start(m, dp, &ck, a, &st);
    std::string ckpt_path = a.output_dir + "/model.bin", log_path = a.output_dir + "/log.csv";
    FILE* logf = nullptr;  // rank 0 alone writes the log and the checkpoints
    if (rank == 0) {
        if (!make_dirs(a.output_dir)) {
            fprintf(stderr, "error: cannot create --output_dir %s (%s)\n", a.output_dir.c_str(), strerror(errno));
            return 1;
        }
        bool log_exists = access(log_path.c_str(), F_OK) == 0;
        logf = fopen(log_path.c_str(), (!a.resume.empty() && log_exists) ? "a" : "w");
        if (!logf) {
            fprintf(stderr, "error: cannot open %s for writing (%s)\n", log_path.c_str(), strerror(errno));
            return 1;
        }
        if (a.resume.empty() || !log_exists) fprintf(logf, "step,loss,ms,images_per_s\n");
    }

    if (!a.quiet) {  // the boxed table of the run's settings: the device, every flag, then what the run found
        auto rule = []() { printf("+-----------------------+----------------------------------------------+\n"); };
        auto row = [](const char* k, const std::string& v) { printf("| %-21s | %-44s |\n", k, v.c_str()); };
        if (!prec_note.empty()) printf("note: precision tf32%s\n", prec_note.c_str());
        rule();
        row("device", std::string("cuda (") + prop.name + ")");
        for (const auto& s : a.settings) row(s.first.c_str(), s.first == "precision" ? PREC_NAME[prec] : s.second);
        row("convolutions", prec == PREC_BF16 ? (conv_bf16_wgmma() ? "bf16 wgmma + TMA (fp32 master weights)"
                                                                   : "bf16 mma.sync (fp32 master weights)")
                            : prec == PREC_FP32 ? "fp32 implicit GEMM (strict)"
                                                : "tf32 mma.sync (3-channel passes fp32)");
        row("images", std::to_string(data.n) + " in " + a.data_file);
        row("parameters", std::to_string(m->n_params));
        row("GPU memory free/total", strfmt("%.0f / %.0f MiB", mem_free0 / 1048576.0, mem_total / 1048576.0));
        if (m->muon) muon_rows(m->muon, dp != nullptr, row);
        if (dp) {  // the ranks, how the gradients travel, and the model state each GPU holds
            row("ranks", std::to_string(world) + " (" + a.dist.launcher + "), global batch " +
                             std::to_string(a.batch_size * world));
            row("gradients", dist.zero ? "ZeRO-1: reduce-scatter, all-gather"
                                       : "all-reduce, " + std::to_string(dist.buckets.size()) + " buckets");
            row("state per GPU", strfmt("w+g %.0f MiB, AdamW+EMA %.0f MiB", 2.0 * m->n_alloc * 4 / (1 << 20),
                                        3.0 * m->n_state * 4 / (1 << 20)));
        }
        row("start step", std::to_string(st.step));
        row("init", !a.resume.empty() ? "resume " + a.resume
                    : !a.load.empty() ? "load " + a.load
                                      : "own (PyTorch defaults)");
        row("checkpoint", ckpt_path);
        rule();
        fflush(stdout);
    }

    // data on the device once; the loader's draws for every remaining step computed up front
    uint8_t* d_images;
    size_t img_bytes = (size_t)data.n * data.H * data.W * 3;
    cudaCheck(cudaMalloc(&d_images, img_bytes));
    cudaCheck(cudaMemcpy(d_images, data.images, img_bytes, cudaMemcpyHostToDevice));
    int nsteps = std::max(0, a.steps - st.step), B = a.batch_size;
    std::vector<int> codes, ts;
    batch_draws(st.seed, data.n, a.cfg.diffusion_steps, st.step, nsteps, B * world, &codes, &ts);
    if (dp) {  // this rank's share of each step's global batch
        codes = dist_share(codes, nsteps, B, world, rank);
        ts = dist_share(ts, nsteps, B, world, rank);
    }
    int *d_codes, *d_ts;
    cudaCheck(cudaMalloc(&d_codes, std::max<size_t>(1, codes.size()) * sizeof(int)));
    cudaCheck(cudaMalloc(&d_ts, std::max<size_t>(1, ts.size()) * sizeof(int)));
    if (nsteps > 0) {
        cudaCheck(cudaMemcpy(d_codes, codes.data(), codes.size() * sizeof(int), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_ts, ts.data(), ts.size() * sizeof(int), cudaMemcpyHostToDevice));
    }
    curandGenerator_t gen;
    curandCheck(curandCreateGenerator(&gen, CURAND_RNG_PSEUDO_PHILOX4_32_10));
    curandCheck(curandSetPseudoRandomGeneratorSeed(gen, (unsigned long long)st.seed));
    curandCheck(curandSetStream(gen, g_stream));
    size_t n_noise = m->xt->n;
    // the step from q_sample to the AdamW update is captured once as a CUDA graph and replayed: ~1500 launches
    // become one, and nothing in it changes between steps (the loader's draws are copied in before it)
    const char* env_graph = getenv("UNET_NO_GRAPH");
    bool use_graph = !(env_graph && env_graph[0] == '1') && !g_profile;
    cudaGraphExec_t graph_exec = nullptr;
    int window = std::max(1, a.log_every);
    float* h_losses;
    cudaCheck(cudaMallocHost(&h_losses, window * sizeof(float)));
    cudaEvent_t ev0, ev1;
    cudaCheck(cudaEventCreate(&ev0));
    cudaCheck(cudaEventCreate(&ev1));
    cudaCheck(cudaEventRecord(ev0, g_stream));
    int in_window = 0, last_logged = st.step;
    double train_ms = 0.0;  // the logged windows' time: training steps only, saves excluded
    float last_loss = NAN;
    const int first_step = st.step;
    int rc = 0;
    for (int step = st.step; step < a.steps; step++) {
        if (dp) wd_arm("training step", dp->nccl_timeout, step + 1);
        size_t off = (size_t)(step - (a.steps - nsteps)) * B;
        load_batch_kernel<<<ceil_div(n_noise, EW), EW, 0, g_stream>>>(d_images, d_codes + off, m->x0, B, data.H,
                                                                      data.W);
        cudaCheck(cudaGetLastError());
        cudaCheck(cudaMemcpyAsync(m->t, d_ts + off, B * sizeof(int), cudaMemcpyDeviceToDevice, g_stream));
        // noise of step s: the Philox stream at offset s * n, so a resumed run draws the same numbers (rank r of
        // several: its piece of the single GPU's s * n * world .. (s+1) * n * world)
        curandCheck(curandSetGeneratorOffset(gen, dist_noise_offset(step, n_noise, world, rank)));
        curandCheck(curandGenerateNormal(gen, m->noise, n_noise, 0.f, 1.f));
        auto train_step = [&]() {
            unet_q_sample(m);
            unet_forward(m);
            unet_loss(m);
            unet_backward(m);
            if (dp) dist_update(dp, m, a.lr, a.beta1, a.beta2, a.adam_eps, a.weight_decay, a.ema_rate);
            else unet_update(m, a.lr, a.beta1, a.beta2, a.adam_eps, a.weight_decay, a.ema_rate);
        };
        if (use_graph && step > first_step) {  // the first step runs eagerly: lazy module loading, cuBLAS setup
            if (!graph_exec) {
                cudaGraph_t graph;
                cudaCheck(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
                train_step();
                cudaCheck(cudaStreamEndCapture(g_stream, &graph));
                cudaCheck(cudaGraphInstantiate(&graph_exec, graph, m->muon && m->muon->overlap ?
                                                   cudaGraphInstantiateFlagUseNodePriority : 0));
                cudaCheck(cudaGraphDestroy(graph));
            } else {
                m->adam_t++;  // the graph's adam_prep_kernel counts on the device; the host keeps in step
            }
            cudaCheck(cudaGraphLaunch(graph_exec, g_stream));
        } else {
            train_step();
        }
        cudaCheck(cudaMemcpyAsync(&h_losses[in_window], m->loss, sizeof(float), cudaMemcpyDeviceToHost, g_stream));
        in_window++;
        int done = step + 1;
        bool last = done == a.steps;
        if (done % window == 0 || last) {
            cudaCheck(cudaEventRecord(ev1, g_stream));
            wait_gpu(ev1);
            float ms = 0.f;
            cudaCheck(cudaEventElapsedTime(&ms, ev0, ev1));
            double sum = 0.0;
            bool finite = true;
            for (int i = 0; i < in_window; i++) {
                if (!std::isfinite(h_losses[i])) {
                    fprintf(stderr, "error: step %d: loss is %f; stopping (the last good checkpoint is %s)\n",
                            done - in_window + i + 1, h_losses[i], ckpt_path.c_str());
                    finite = false;
                    break;
                }
                sum += h_losses[i];
                if (losses) losses->push_back(h_losses[i]);
            }
            if (!finite) {
                rc = 1;
                break;
            }
            double per = ms / (done - last_logged);
            float mean_loss = (float)(sum / in_window);
            const int Bg = B * world;  // images per step over every rank
            if (!a.quiet)
                printf("step %6d/%d | train loss %.6f | %8.2f ms/step | %8.1f images/s\n", done, a.steps, mean_loss,
                       per, 1000.0 * Bg / per);
            train_ms += ms;
            last_loss = mean_loss;
            if (logf) {
                fprintf(logf, "%d,%.6f,%.3f,%.1f\n", done, mean_loss, per, 1000.0 * Bg / per);
                fflush(logf);
            }
            fflush(stdout);
            in_window = 0;
            last_logged = done;
            cudaCheck(cudaEventRecord(ev0, g_stream));
        }
        if (a.save_every > 0 && (done % a.save_every == 0 || last)) {
            if (in_window > 0) {  // a save between log steps: check the pending losses first
                cudaCheck(cudaStreamSynchronize(g_stream));
                bool bad = false;
                for (int i = 0; i < in_window; i++) bad = bad || !std::isfinite(h_losses[i]);
                if (bad) {
                    fprintf(stderr, "error: a loss before step %d is not finite; stopping (the last good "
                            "checkpoint is %s)\n", done, ckpt_path.c_str());
                    rc = 1;
                    break;
                }
            }
            st.step = done;
            std::string we = dp ? dist_save_checkpoint(dp, m, ckpt_path, st) : unet_save_checkpoint(m, ckpt_path, st);
            if (!we.empty()) {
                fprintf(stderr, "error: %s\n", we.c_str());
                rc = 1;
                break;
            }
            if (!a.quiet) printf("saved %s (step %d)\n", ckpt_path.c_str(), done);
            if (dp) wd_arm("training step", dp->nccl_timeout, done);
            cudaCheck(cudaEventRecord(ev0, g_stream));  // the save is not a training step
            last_logged = done - in_window;
        }
    }
    if (dp) wd_arm("finishing the last step", dp->nccl_timeout);
    wait_gpu(nullptr);
    if (dp) wd_disarm();
    if (!a.quiet && rc == 0) {  // everything is allocated up front: what the device has lost since start is the peak
        size_t mem_free1;
        cudaCheck(cudaMemGetInfo(&mem_free1, &mem_total));
        printf("GPU memory: %.0f MiB used by this run (of %.0f MiB; CUDA context excluded)\n",
               (double)(mem_free0 - mem_free1) / (1 << 20), (double)mem_total / (1 << 20));
        printf("final | step %d | train_loss %.6f | train_ms %.1f\n", std::max(a.steps, first_step), last_loss,
               train_ms);
    }
    if (graph_exec) cudaCheck(cudaGraphExecDestroy(graph_exec));
    if (dp) dist_free(dp);
    if (g_profile) profile_report(a.steps - (a.steps - nsteps));
    if (logf) fclose(logf);
    curandCheck(curandDestroyGenerator(gen));
    cudaCheck(cudaFreeHost(h_losses));
    cudaCheck(cudaFree(d_images));
    cudaCheck(cudaFree(d_codes));
    cudaCheck(cudaFree(d_ts));
    cudaCheck(cudaEventDestroy(ev0));
    cudaCheck(cudaEventDestroy(ev1));
    unet_free(m);
    gpu_free();
    return rc;
}

struct SampleArgs {
    std::string out_file, load, sampler = "ddim", device = "auto";
    int num_samples = 16, sample_steps = 50, use_ema = 1, batch_size = 32, seed = 1337;
    Precision precision = PREC_BF16;
    bool precision_given = false;
};

// Samples with the checkpoint's model (DDPM over all steps or DDIM eta 0, as scripts/generate.py) and writes a
// UNET_DATASET of uint8 NHWC images. Returns a process exit code.
static int unet_sample(const SampleArgs& a) {
    BinFile ck;
    std::string e = bin_open(&ck, a.load.c_str(), UNET_CHECKPOINT_MAGIC, UNET_FORMAT_VERSION, "unet checkpoint");
    UNetConfig cfg = config_from_header(ck.hdr);
    if (e.empty()) {
        std::string c = config_check(cfg);
        if (!c.empty()) e = a.load + ": header describes a model this trainer cannot build: " + c;
    }
    UNet model;
    UNet* m = &model;
    int B = std::min(a.batch_size, a.num_samples);
    if (e.empty()) {
        unet_define(m, cfg, B);
        e = checkpoint_validate(m, &ck, a.use_ema != 0, false);
    }
    if (e.empty() && a.sampler == "ddim" && a.sample_steps > cfg.diffusion_steps)
        e = "--sample_steps " + std::to_string(a.sample_steps) + " is more than the checkpoint's diffusion_steps " +
            std::to_string(cfg.diffusion_steps);
    if (!e.empty()) {
        fprintf(stderr, "error: %s\n", e.c_str());
        return 1;
    }
    if (!gpu_for(a.device, "train_unet --sample runs on the GPU (scripts/generate.py --device cpu samples on "
                 "the CPU)"))
        return 1;
    Precision prec = a.precision;
    std::string prec_note;
    if (!precision_resolve(&prec, a.precision_given, &prec_note)) return 1;
    if (!prec_note.empty()) printf("note: sampling in tf32%s\n", prec_note.c_str());
    gpu_init(prec);
    m->prec = prec;
    unet_allocate(m);
    unet_load_tensors(m, &ck, a.use_ema ? "ema." : "", m->p);
    unet_weights_changed(m);

    int T = cfg.diffusion_steps, S = cfg.image_size;
    std::vector<int> taus;
    if (a.sampler == "ddpm") {
        for (int i = 0; i < T; i++) taus.push_back(i);
    } else {
        for (int i = 0; i < a.sample_steps; i++) taus.push_back((int)(((long long)i * T) / a.sample_steps));
    }
    std::vector<double> betas(T), acp_prev(T), post_var(T);
    for (int i = 0; i < T; i++) {
        betas[i] = T == 1 ? (double)cfg.beta_start
                          : (double)cfg.beta_start + ((double)cfg.beta_end - cfg.beta_start) * i / (T - 1);
        acp_prev[i] = i == 0 ? 1.0 : m->acp[i - 1];
        post_var[i] = betas[i] * (1.0 - acp_prev[i]) / (1.0 - m->acp[i]);
    }
    size_t per = (size_t)S * S * 3;
    std::vector<uint8_t> images((size_t)a.num_samples * per);
    uint8_t* d_u8;
    cudaCheck(cudaMalloc(&d_u8, (size_t)B * per));
    float* z = dev_alloc((size_t)B * per);
    float* xs = dev_alloc((size_t)B * per);  // the sampler's state x, fp32 whatever the model's precision
    curandGenerator_t gen;
    curandCheck(curandCreateGenerator(&gen, CURAND_RNG_PSEUDO_PHILOX4_32_10));
    curandCheck(curandSetPseudoRandomGeneratorSeed(gen, (unsigned long long)a.seed));
    curandCheck(curandSetStream(gen, g_stream));
    std::vector<int> tvec(B);
    // dev hooks for dev/unet_sample_ref.py (a step-by-step comparison with a PyTorch sampler): UNET_SAMPLE_INIT=F
    // takes the first batch's initial noise from F (tensor x_init float32 (N >= B, H, W, 3), magic 20260303), and
    // UNET_SAMPLE_TRACE=F writes x after every step of the first batch to F (x_steps float32 (steps*B, H, W, 3)).
    const char* init_path = getenv("UNET_SAMPLE_INIT");
    const char* trace_path = getenv("UNET_SAMPLE_TRACE");
    std::vector<float> trace;
    auto t0 = std::chrono::steady_clock::now();
    for (int start = 0; start < a.num_samples; start += B) {
        size_t n = (size_t)B * per;
        curandCheck(curandGenerateNormal(gen, xs, n, 0.f, 1.f));
        if (init_path && start == 0) {
            BinFile fi;
            std::string err = bin_open(&fi, init_path, UNET_DEBUG_MAGIC, UNET_FORMAT_VERSION, "sample init");
            const BinEntry* e = err.empty() ? bin_find(&fi, "x_init") : nullptr;
            if (!e || e->dtype != DT_F32 || e->ndim != 4 || e->shape[0] < B || e->shape[1] != S || e->shape[2] != S ||
                e->shape[3] != 3) {
                fprintf(stderr, "error: UNET_SAMPLE_INIT %s: %s\n", init_path,
                        err.empty() ? "expected x_init float32 (N >= batch, H, W, 3)" : err.c_str());
                return 1;
            }
            cudaCheck(cudaMemcpy(xs, fi.data.data() + e->offset, n * 4, cudaMemcpyHostToDevice));
        }
        for (int k = (int)taus.size() - 1; k >= 0; k--) {
            int tau = taus[k];
            std::fill(tvec.begin(), tvec.end(), tau);
            cudaCheck(cudaMemcpyAsync(m->t, tvec.data(), B * sizeof(int), cudaMemcpyHostToDevice, g_stream));
            cudaCheck(cudaStreamSynchronize(g_stream));  // tvec is reused next step
            if (m->prec == PREC_BF16) convert_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(xs, m->xt->xb, n);
            else convert_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(xs, m->xt->x, n);
            cudaCheck(cudaGetLastError());
            unet_forward(m);
            double acp = m->acp[tau];
            float a_ = (float)sqrt(1.0 / acp), b_ = (float)sqrt(1.0 / acp - 1.0), c1, c2, sigma = 0.f;
            int ddim = a.sampler == "ddim";
            if (ddim) {
                double ap = k > 0 ? m->acp[taus[k - 1]] : 1.0;
                c1 = (float)sqrt(ap);
                c2 = (float)sqrt(1.0 - ap);
            } else {
                c1 = (float)(betas[tau] * sqrt(acp_prev[tau]) / (1.0 - acp));
                c2 = (float)((1.0 - acp_prev[tau]) * sqrt(1.0 - betas[tau]) / (1.0 - acp));
                if (tau > 0) {
                    sigma = (float)sqrt(post_var[tau]);
                    curandCheck(curandGenerateNormal(gen, z, n, 0.f, 1.f));
                }
            }
            if (m->prec == PREC_BF16)
                sample_step_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(xs, m->out->xb, z, n, ddim, a_, b_, c1, c2,
                                                                          sigma);
            else
                sample_step_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(xs, m->out->x, z, n, ddim, a_, b_, c1, c2,
                                                                          sigma);
            cudaCheck(cudaGetLastError());
            if (trace_path && start == 0) {
                trace.resize(trace.size() + n);
                cudaCheck(cudaMemcpy(trace.data() + trace.size() - n, xs, n * 4, cudaMemcpyDeviceToHost));
            }
        }
        if (trace_path && start == 0) {
            BinWriter tw;
            binw_init(&tw, UNET_DEBUG_MAGIC);
            int tshape[4] = {(int)(trace.size() / per), S, S, 3};
            binw_add(&tw, "x_steps", DT_F32, 4, tshape, trace.data());
            std::string err = binw_write(&tw, trace_path);
            if (!err.empty()) fprintf(stderr, "warning: UNET_SAMPLE_TRACE: %s\n", err.c_str());
        }
        to_uint8_kernel<<<ceil_div(n, EW), EW, 0, g_stream>>>(xs, d_u8, n);
        cudaCheck(cudaGetLastError());
        int take = std::min(B, a.num_samples - start);
        cudaCheck(cudaMemcpy(images.data() + (size_t)start * per, d_u8, (size_t)take * per, cudaMemcpyDeviceToHost));
        double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("sampled %d/%d images (%s, %zu steps) in %.1f s\n", start + take, a.num_samples, a.sampler.c_str(),
               taus.size(), el);
        fflush(stdout);
    }
    BinWriter w;
    binw_init(&w, UNET_DATASET_MAGIC);
    w.hdr[3] = a.num_samples; w.hdr[4] = S; w.hdr[5] = S; w.hdr[6] = 3;
    int shape[4] = {a.num_samples, S, S, 3};
    binw_add(&w, "images", DT_U8, 4, shape, images.data());
    e = binw_write(&w, a.out_file);
    curandCheck(curandDestroyGenerator(gen));
    cudaCheck(cudaFree(d_u8));
    cudaCheck(cudaFree(z));
    cudaCheck(cudaFree(xs));
    unet_free(m);
    gpu_free();
    if (!e.empty()) {
        fprintf(stderr, "error: %s\n", e.c_str());
        return 1;
    }
    printf("wrote %s (%d images)\n", a.out_file.c_str(), a.num_samples);
    return 0;
}

struct EvalArgs {
    std::string load, data_file = "data/sunflowers64.bin", device = "auto";
    int n = 1024, use_ema = 1, batch_size = 32;
    Precision precision = PREC_BF16;
    bool precision_given = false;
};
// The evaluation loss of a checkpoint: the mean epsilon-prediction MSE over n fixed (image, timestep, noise)
// triples, the same for every checkpoint and run: image i % N of the dataset (flipped for odd i / N), timestep and
// noise from EVAL_SEED, a stream no training run draws from. Prints one line; returns a process exit code.
static const uint64_t EVAL_SEED = 20261126;
static int unet_eval(const EvalArgs& a) {
    BinFile ck;
    std::string e = bin_open(&ck, a.load.c_str(), UNET_CHECKPOINT_MAGIC, UNET_FORMAT_VERSION, "unet checkpoint");
    UNetConfig cfg = config_from_header(ck.hdr);
    if (e.empty()) {
        std::string c = config_check(cfg);
        if (!c.empty()) e = a.load + ": header describes a model this trainer cannot build: " + c;
    }
    UNet model;
    UNet* m = &model;
    const int B = std::min(a.batch_size, a.n);
    if (e.empty()) {
        unet_define(m, cfg, B);
        e = checkpoint_validate(m, &ck, a.use_ema != 0, false);
    }
    Dataset data;
    if (e.empty()) e = dataset_open(&data, a.data_file.c_str(), cfg.image_size);
    if (!e.empty()) {
        fprintf(stderr, "error: %s\n", e.c_str());
        return 1;
    }
    if (!gpu_for(a.device, "train_unet --eval_loss runs on the GPU")) return 1;
    Precision prec = a.precision;
    std::string prec_note;
    if (!precision_resolve(&prec, a.precision_given, &prec_note)) return 1;
    gpu_init(prec);
    m->prec = prec;
    unet_allocate(m);
    unet_load_tensors(m, &ck, a.use_ema ? "ema." : "", m->p);
    unet_weights_changed(m);
    uint8_t* d_images;
    const size_t img_bytes = (size_t)data.n * data.H * data.W * 3, per = (size_t)data.H * data.W * 3;
    cudaCheck(cudaMalloc(&d_images, img_bytes));
    cudaCheck(cudaMemcpy(d_images, data.images, img_bytes, cudaMemcpyHostToDevice));
    int* d_codes;
    cudaCheck(cudaMalloc(&d_codes, B * sizeof(int)));
    float* d_loss = dev_alloc(B);
    curandGenerator_t gen;
    curandCheck(curandCreateGenerator(&gen, CURAND_RNG_PSEUDO_PHILOX4_32_10));
    curandCheck(curandSetPseudoRandomGeneratorSeed(gen, (unsigned long long)EVAL_SEED));
    curandCheck(curandSetStream(gen, g_stream));
    std::vector<int> codes(B), ts(B);
    double sum = 0.0;
    int done = 0;
    for (int start = 0; start < a.n; start += B) {
        const int take = std::min(B, a.n - start);
        for (int b = 0; b < B; b++) {  // a short last batch repeats its last triple; only `take` count
            const int i = start + std::min(b, take - 1);
            codes[b] = (i % data.n) * 2 + (i / data.n) % 2;
            ts[b] = (int)(rng_hash(EVAL_SEED, RNG_TIMESTEP, (uint64_t)i) % (uint64_t)cfg.diffusion_steps);
        }
        cudaCheck(cudaMemcpy(d_codes, codes.data(), B * sizeof(int), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(m->t, ts.data(), B * sizeof(int), cudaMemcpyHostToDevice));
        load_batch_kernel<<<ceil_div((size_t)B * per, EW), EW, 0, g_stream>>>(d_images, d_codes, m->x0, B, data.H,
                                                                              data.W);
        cudaCheck(cudaGetLastError());
        curandCheck(curandSetGeneratorOffset(gen, (unsigned long long)start * per));
        curandCheck(curandGenerateNormal(gen, m->noise, (size_t)B * per, 0.f, 1.f));
        unet_q_sample(m);
        unet_forward(m);
        unet_loss_per_sample(m, d_loss);
        std::vector<float> ls(B);
        cudaCheck(cudaMemcpy(ls.data(), d_loss, B * sizeof(float), cudaMemcpyDeviceToHost));
        for (int b = 0; b < take; b++) sum += ls[b];
        done += take;
    }
    printf("eval loss %.6f over %d fixed (image, timestep, noise) triples (%s weights, --precision %s%s)\n",
           sum / done, done, a.use_ema ? "EMA" : "raw", PREC_NAME[prec], prec_note.c_str());
    curandCheck(curandDestroyGenerator(gen));
    cudaCheck(cudaFree(d_images));
    cudaCheck(cudaFree(d_codes));
    cudaCheck(cudaFree(d_loss));
    unet_free(m);
    gpu_free();
    return 0;
}

// ================================================================================================================
// command line: the conventions of the three trainers. Flags are --name value; every flag is one row of the table
// below, which drives the parser, --help ("  --name  help [default]  one of: ...") and the start-up table. A bad
// value is "error: flag --name expects <what>, found '<value>'" and exit 1.
// ================================================================================================================
#ifndef TESTING

// Every flag's value: a TrainArgs, and the model, sampling and evaluation flags main turns into the other modes' args.
struct Args {
    TrainArgs t;
    std::string device = "auto", precision = PREC_NAME[PREC_BF16], allow_change, optimizer = "adamw";
    std::string muon_ns = MUON_NS_NAME[MUON_NS_STANDARD];
    std::string channel_mult = "1,2,3,4", attn_ds = "4,8", sample_file, sampler = "ddim";
    int image_size = 64, model_channels = 64, num_res_blocks = 2, num_head_channels = 32, diffusion_steps = 1000;
    float beta_start = 1e-4f, beta_end = 0.02f;
    int num_samples = 16, sample_steps = 50, use_ema = 1, eval_loss = 0;
    std::set<std::string> given;  // the flags on the command line
};
// type: 'i' int, 'f' float, 'c' one of the comma-separated choices, 's' string; numbers must lie in [lo, hi]
struct FlagSpec { const char* name; char type; void* ptr; double lo, hi; const char* choices; const char* help; };

static std::vector<FlagSpec> flag_specs(Args& a) {
    TrainArgs& t = a.t;
    return {
        {"data_file", 's', &t.data_file, 0, 0, nullptr, "UNET_DATASET of uint8 images (scripts/prepare_data.py)"},
        {"output_dir", 's', &t.output_dir, 0, 0, nullptr, "checkpoint model.bin and log.csv go here"},
        {"device", 'c', &a.device, 0, 0, "auto,cuda,cpu",
         "auto or cuda: the GPU, which every mode needs; cpu: refused (see scripts/generate.py --device cpu)"},
        {"batch_size", 'i', &t.batch_size, 1, 4096, nullptr, "images per step (also the sampling batch)"},
        {"lr", 'f', &t.lr, 1e-12, 1.0, nullptr, "AdamW learning rate"},
        {"beta1", 'f', &t.beta1, 0.0, 0.999999, nullptr, "AdamW beta1"},
        {"beta2", 'f', &t.beta2, 0.0, 0.999999, nullptr, "AdamW beta2"},
        {"adam_eps", 'f', &t.adam_eps, 1e-30, 1.0, nullptr, "AdamW epsilon"},
        {"weight_decay", 'f', &t.weight_decay, 0.0, 1.0, nullptr, "decoupled weight decay (AdamW's and Muon's)"},
        {"optimizer", 'c', &a.optimizer, 0, 0, "adamw,muon",
         "AdamW, or Muon for the conv and linear weights with AdamW for the rest (biases, GroupNorm)"},
        {"muon_lr", 'f', &t.muon_lr, 1e-9, 1e9, nullptr, "Muon: the weights' learning rate (--lr is AdamW's)"},
        {"muon_momentum", 'f', &t.muon_momentum, 0, 0.999999, nullptr, "Muon momentum"},
        {"muon_nesterov", 'i', &t.muon_nesterov, 0, 1, nullptr, "Muon: 1 Nesterov momentum, 0 plain"},
        {"ns_steps", 'i', &t.ns_steps, 1, 99, nullptr, "Muon: Newton-Schulz steps"},
        {"muon_ns", 'c', &a.muon_ns, 0, 0, "standard,gram",
         "Muon: Newton-Schulz as torch.optim.Muon iterates it, or in its Gram form (the same polynomial on X X^T: "
         "fewer FLOPs; fp16 with --precision bf16)"},
        {"steps", 'i', &t.steps, 0, 1e9, nullptr, "total training steps (a resumed run continues to this step)"},
        {"log_every", 'i', &t.log_every, 1, 1e9, nullptr, "steps per log line (loss averaged over them)"},
        {"save_every", 'i', &t.save_every, 0, 1e9, nullptr, "steps per checkpoint, and one at the end (0: never)"},
        {"seed", 'i', &t.seed, 0, 2147483647.0, nullptr, "weights init, shuffling, flips, timesteps, noise"},
        {"ema_rate", 'f', &t.ema_rate, 0.0, 1.0, nullptr,
         "EMA of the weights: ema = d*ema + (1-d)*w, d = min(rate, (1+t)/(10+t)) at step t"},
        {"resume", 's', &t.resume, 0, 0, nullptr, "checkpoint to continue (weights, EMA, AdamW, step, RNG)"},
        {"allow_change", 's', &a.allow_change, 0, 0, nullptr, "with --resume: stored settings this run may change "
         "knowingly (comma list of lr, seed, batch_size, ema_rate, optimizer, muon_lr, muon_momentum, "
         "muon_nesterov, ns_steps); without it a differing one is an error"},
        {"load", 's', &t.load, 0, 0, nullptr, "checkpoint to take the initial weights from (or to sample)"},
        {"precision", 'c', &a.precision, 0, 0, "bf16,tf32,fp32", "bf16 (compute capability >= 8.0: wgmma on Hopper, "
         "mma.sync elsewhere; the default falls back to tf32 below), tf32 (tensor cores on fp32) or fp32 (strict)"},
        {"image_size", 'i', &a.image_size, 8, 4096, nullptr, "model image size (the data must match)"},
        {"model_channels", 'i', &a.model_channels, 32, 4096, nullptr, "base channels C"},
        {"channel_mult", 's', &a.channel_mult, 0, 0, nullptr, "channel multipliers per level (1 to 4 levels)"},
        {"num_res_blocks", 'i', &a.num_res_blocks, 1, 16, nullptr, "residual blocks per level"},
        {"attn_ds", 's', &a.attn_ds, 0, 0, nullptr, "downsample factors with attention (64px: 4,8 = 16x16, 8x8)"},
        {"num_head_channels", 'i', &a.num_head_channels, 1, 4096, nullptr, "channels per attention head"},
        {"diffusion_steps", 'i', &a.diffusion_steps, 1, 100000, nullptr, "diffusion steps T"},
        {"beta_start", 'f', &a.beta_start, 1e-12, 0.999, nullptr, "first beta of the linear schedule"},
        {"beta_end", 'f', &a.beta_end, 1e-12, 0.999, nullptr, "last beta of the linear schedule"},
        {"sample", 's', &a.sample_file, 0, 0, nullptr, "sampling mode: write generated images (UNET_DATASET) here"},
        {"num_samples", 'i', &a.num_samples, 1, 1000000, nullptr, "sampling: number of images"},
        {"sampler", 'c', &a.sampler, 0, 0, "ddpm,ddim", "sampling: ddpm (all steps) or ddim (eta 0)"},
        {"sample_steps", 'i', &a.sample_steps, 1, 100000, nullptr, "sampling: ddim steps"},
        {"use_ema", 'i', &a.use_ema, 0, 1, nullptr, "sampling and --eval_loss: 1 the EMA weights, 0 the raw weights"},
        {"eval_loss", 'i', &a.eval_loss, 0, 10000000, nullptr, "evaluation mode: the mean loss of --load over this "
         "many fixed (image, timestep, noise) triples of --data_file (0: train)"},
        {"zero", 'i', &t.zero, 0, 1, nullptr,
         "several GPUs: 1 shards the AdamW moments and EMA over the ranks (ZeRO-1)"},
        {"master_addr", 's', &t.master_addr, 0, 0, nullptr,
         "several GPUs: rank 0's host, which serves the NCCL id over TCP (\"\": MASTER_ADDR, else 127.0.0.1)"},
        {"master_port", 'i', &t.master_port, 0, 65535, nullptr, "several GPUs: its port (0: MASTER_PORT, else 29500)"},
        {"nccl_id_file", 's', &t.nccl_id_file, 0, 0, nullptr,
         "several GPUs: pass the NCCL id through this file on a shared path instead of TCP (a fresh path per job)"},
        {"dist_timeout", 'f', &t.dist_timeout, 1, 86400, nullptr,
         "several GPUs: seconds any rank waits for the others at start-up before it stops with an error"},
        {"nccl_timeout", 'f', &t.nccl_timeout, 1, 86400, nullptr,
         "several GPUs: seconds a training step may wait on the other ranks before the watchdog ends the run"},
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
    printf("usage: ./train_unet [--flag value ...]\n"
           "       ./train_unet --sample FILE.bin --load CKPT [--num_samples N --sampler ddpm|ddim ...]\n"
           "       ./train_unet --eval_loss N --load CKPT\n\n"
           "Trains a diffusion UNet (guided-diffusion's UNetModel) on the GPU. Flags (default in brackets):\n");
    for (auto& f : flag_specs(a)) {
        std::string d = flag_value_str(f);
        printf("  --%-18s %s [%s]%s%s\n", f.name, f.help, d.c_str(), f.choices ? "  one of: " : "",
               f.choices ? f.choices : "");
    }
    printf("  --%-18s this help\n", "help");
}

[[noreturn]] static void die(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(EXIT_FAILURE);
}

static void parse_args(int argc, char** argv, Args& a) {
    std::vector<FlagSpec> specs = flag_specs(a);
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { print_help(a); exit(EXIT_SUCCESS); }
    for (int i = 1; i < argc; i += 2) {
        const char* arg = argv[i];
        if (strncmp(arg, "--", 2) != 0) die("expected a flag like --name, found '%s' (see --help)", arg);
        const FlagSpec* f = nullptr;
        for (auto& s : specs) if (!strcmp(s.name, arg + 2)) f = &s;
        if (!f) die("unknown flag %s (see --help)", arg);
        if (i + 1 >= argc) die("flag %s expects a value, found none", arg);
        const char* v = argv[i + 1];
        for (auto& s : specs)  // a path's value missing ("--load --steps"): the next flag took its place
            if (f->type == 's' && !strncmp(v, "--", 2) && !strcmp(s.name, v + 2))
                die("flag %s expects a value, found the flag %s", arg, v);
        char* end = nullptr;
        errno = 0;
        if (f->type == 'i') {
            long long x = strtoll(v, &end, 10);
            if (!*v || *end || errno) die("flag %s expects an integer, found '%s'", arg, v);
            if (x < f->lo || x > f->hi)
                die("flag %s expects an integer in [%.0f, %.0f], found %s", arg, f->lo, f->hi, v);
            *(int*)f->ptr = (int)x;
        } else if (f->type == 'f') {
            double x = strtod(v, &end);
            if (!*v || *end || errno || !std::isfinite(x)) die("flag %s expects a number, found '%s'", arg, v);
            if (x < f->lo || x > f->hi)
                die("flag %s expects a number in [%g, %g], found %s", arg, f->lo, f->hi, v);
            *(float*)f->ptr = (float)x;
        } else if (f->type == 'c') {
            std::string choices = std::string(",") + f->choices + ",";
            if (!*v || choices.find(std::string(",") + v + ",") == std::string::npos)
                die("flag %s expects one of %s, found '%s'", arg, f->choices, v);
            *(std::string*)f->ptr = v;
        } else {
            *(std::string*)f->ptr = v;
        }
        a.given.insert(f->name);
    }
}

// --output_dir before any work: an existing path must be a folder whose model.bin and log.csv can be written (not a
// directory, device or FIFO); a missing one is made later, under its nearest existing folder, which must take files.
static std::string output_dir_check(const std::string& dir) {
    struct stat st;
    std::string real;
    if (stat(dir.c_str(), &st) != 0 && errno != ENOENT)  // a name too long, a loop: it could never be made
        return dir + ": --output_dir cannot be used (" + strerror(errno) + ")";
    if (stat(dir.c_str(), &st) == 0) {
        if (!S_ISDIR(st.st_mode)) return dir + ": --output_dir is " + file_kind(st.st_mode) + ", not a directory";
        for (const char* name : {"model.bin", "log.csv"}) {
            std::string e = output_check(dir + "/" + name, "--output_dir file", &real);
            if (!e.empty()) return e;
        }
        return "";
    }
    std::string up = dir;
    do up = folder_of(up);
    while (stat(up.c_str(), &st) != 0 && up != "." && up != "/");
    if (stat(up.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
        return dir + ": --output_dir cannot be made: " + up + " is not a directory";
    std::string e = output_check(up + "/.unet_output_dir", "--output_dir", &real);
    return e.empty() ? "" : dir + ": --output_dir cannot be made in " + up + " (" + e + ")";
}

// "1,2,3,4" -> values (1..4 entries, each >= 1); false on a bad list
static bool parse_int_list(const std::string& s, std::vector<int>* out) {
    out->clear();
    size_t i = 0;
    while (i <= s.size()) {
        size_t j = s.find(',', i);
        if (j == std::string::npos) j = s.size();
        std::string item = s.substr(i, j - i);
        char* end;
        errno = 0;
        long v = strtol(item.c_str(), &end, 10);
        if (item.empty() || *end || errno || v < 1 || v > 1 << 20) return false;
        out->push_back((int)v);
        i = j + 1;
    }
    return !out->empty();
}

// --resume: a resumed run continues the stored trajectory: a flag that would change it is an error unless the user
// names it in --allow_change; one not given takes the stored value (the checkpoint's fields already validated).
static void resume_settings(Args& args, const BinFile& ck, const std::string& ckpath) {
    TrainArgs& a = args.t;
    const int world = a.dist.world, rank = a.dist.rank;
    auto is_set = [&](const char* name) { return args.given.count(name) > 0; };
    // a resumed run continues the stored trajectory: a flag that would change it is an error unless the
    // user names it in --allow_change; one not given takes the stored value
    std::string fe = checkpoint_fields_check(&ck);
    if (!fe.empty()) die("%s", fe.c_str());
    std::vector<std::string> allowed;
    for (size_t i = 0; i <= args.allow_change.size() && !args.allow_change.empty();) {
        size_t j = std::min(args.allow_change.find(',', i), args.allow_change.size());
        allowed.push_back(args.allow_change.substr(i, j - i));
        static const std::set<std::string> names = {"lr",     "seed",          "batch_size", "ema_rate",
                                                    "optimizer", "muon_lr", "muon_momentum", "muon_nesterov",
                                                    "ns_steps"};
        if (!names.count(allowed.back()))
            die("flag --allow_change expects a comma list of lr, seed, batch_size, ema_rate, optimizer, muon_lr, "
                "muon_momentum, muon_nesterov, ns_steps, found '%s'", args.allow_change.c_str());
        i = j + 1;
    }
    auto keep = [&](const char* flag, bool differs, const std::string& given, const std::string& stored) {
        if (!is_set(flag) || !differs) return true;  // the stored value
        if (std::find(allowed.begin(), allowed.end(), flag) != allowed.end()) {
            if (rank == 0)
                printf("note: --%s %s replaces the %s stored in %s (--allow_change)\n", flag, given.c_str(),
                       stored.c_str(), ckpath.c_str());
            return false;
        }
        std::string msg = "--" + std::string(flag) + " " + given + " differs from the " + flag + " " + stored +
                          " stored in " + ckpath + ": a resumed run continues the stored trajectory (drop --" +
                          flag + ", or add --allow_change " + flag + " to change it knowingly)";
        die("%s", msg.c_str());
    };
    float lr0 = hdr_float(ck.hdr, 21), ema0 = hdr_float(ck.hdr, 22);
    char g[32], st[32];
    snprintf(g, sizeof g, "%g", a.lr);
    snprintf(st, sizeof st, "%g", lr0);
    if (keep("lr", a.lr != lr0, g, st)) a.lr = lr0;
    if (keep("seed", a.seed != ck.hdr[20], std::to_string(a.seed), std::to_string(ck.hdr[20])))
        a.seed = ck.hdr[20];
    // the stored batch is the global one (every rank's --batch_size together): it splits over the ranks
    if (keep("batch_size", a.batch_size * world != ck.hdr[19], std::to_string(a.batch_size * world) +
             (world > 1 ? " (" + std::to_string(a.batch_size) + " x " + std::to_string(world) + " ranks)" : ""),
             std::to_string(ck.hdr[19]))) {
        if (ck.hdr[19] % world != 0)
            die("%s stores the global batch_size %d, which does not split over %d ranks: run on a divisor of "
                "it, or give --batch_size N --allow_change batch_size", ckpath.c_str(), ck.hdr[19], world);
        a.batch_size = ck.hdr[19] / world;
    }
    snprintf(g, sizeof g, "%g", a.ema_rate);
    snprintf(st, sizeof st, "%g", ema0);
    if (keep("ema_rate", a.ema_rate != ema0, g, st)) a.ema_rate = ema0;
    // the optimizer (a checkpoint from before the field: adamw); Muon's settings when it stays Muon (a switch to it
    // takes the flags'; under AdamW they have no effect and stay as given)
    const int opt0 = ck.hdr[25];
    if (keep("optimizer", a.optimizer != opt0, OPTIMIZER_NAME[a.optimizer], OPTIMIZER_NAME[opt0])) a.optimizer = opt0;
    if (a.optimizer == OPT_MUON && opt0 == OPT_MUON) {
        const float mlr0 = hdr_float(ck.hdr, 26), mu0 = hdr_float(ck.hdr, 27);
        snprintf(g, sizeof g, "%g", a.muon_lr);
        snprintf(st, sizeof st, "%g", mlr0);
        if (keep("muon_lr", a.muon_lr != mlr0, g, st)) a.muon_lr = mlr0;
        snprintf(g, sizeof g, "%g", a.muon_momentum);
        snprintf(st, sizeof st, "%g", mu0);
        if (keep("muon_momentum", a.muon_momentum != mu0, g, st)) a.muon_momentum = mu0;
        if (keep("muon_nesterov", a.muon_nesterov != ck.hdr[28], std::to_string(a.muon_nesterov),
                 std::to_string(ck.hdr[28])))
            a.muon_nesterov = ck.hdr[28];
        if (keep("ns_steps", a.ns_steps != ck.hdr[29], std::to_string(a.ns_steps), std::to_string(ck.hdr[29])))
            a.ns_steps = ck.hdr[29];
    }
    if (a.steps <= ck.hdr[18]) {
        std::string msg = ckpath + " is at step " + std::to_string(ck.hdr[18]) + ", --steps is " +
                          std::to_string(a.steps) + ": nothing left to train (--steps is the total; raise it)";
        die("%s", msg.c_str());
    }
    if (rank == 0)
        printf("resuming %s at step %d of %d: lr %g, seed %d, batch_size %d, ema_rate %g, optimizer %s%s\n",
               ckpath.c_str(), ck.hdr[18], a.steps, a.lr, a.seed, a.batch_size * world, a.ema_rate,
               OPTIMIZER_NAME[a.optimizer], a.optimizer != opt0 ? " (its state starts afresh)" : "");
    fflush(stdout);
}

// --optimizer and --muon_ns into a, then Muon's switches from the environment (muon_env)
static void optimizer_from_flags(const Args& args, TrainArgs* a) {
    a->optimizer = args.optimizer == "muon" ? OPT_MUON : OPT_ADAMW;
    a->muon_ns = args.muon_ns == "gram" ? MUON_NS_GRAM : MUON_NS_STANDARD;
    muon_env(a);
}

int main(int argc, char** argv) {
    Args args;
    parse_args(argc, argv, args);
    TrainArgs& a = args.t;
    SampleArgs sa;
    auto is_set = [&](const char* name) { return args.given.count(name) > 0; };
    // several GPUs: the launcher's variables say this process's rank (none: one process)
    std::string de = dist_env_parse(&a.dist);
    if (!de.empty()) die("%s", de.c_str());
    const int world = a.dist.world, rank = a.dist.rank;
    if (world > 1) {
#ifndef UNET_NCCL
        die("%s says %d processes, but this train_unet was built without NCCL and runs on one GPU: build it where "
            "NCCL is (make nccl-info; make train_unet NCCL_HOME=DIR)", a.dist.launcher.c_str(), world);
#endif
        if (args.eval_loss > 0 || !args.sample_file.empty())
            die("--sample and --eval_loss run on one GPU: start one process, found %d (%s)", world,
                a.dist.launcher.c_str());
        a.quiet = rank != 0;  // rank 0 prints; every rank reports its own errors
    }
    if (args.device == "cpu")
        die("--device cpu: train_unet trains, samples and evaluates on a CUDA GPU only (to sample on the CPU: "
            "python3 scripts/generate.py --checkpoint CKPT --device cpu)");
    a.device = args.device;
    optimizer_from_flags(args, &a);
    a.precision = args.precision == "bf16" ? PREC_BF16 : args.precision == "tf32" ? PREC_TF32 : PREC_FP32;
    a.precision_given = is_set("precision");
    // the model from the flags
    UNetConfig cfg;
    std::vector<int> mult, ds;
    if (!parse_int_list(args.channel_mult, &mult) || mult.size() > 4)
        die("flag --channel_mult expects 1 to 4 comma-separated integers >= 1, found '%s'", args.channel_mult.c_str());
    if (!parse_int_list(args.attn_ds, &ds))
        die("flag --attn_ds expects comma-separated powers of 2, found '%s'", args.attn_ds.c_str());
    cfg.image_size = args.image_size;
    cfg.model_channels = args.model_channels;
    cfg.n_levels = (int)mult.size();
    for (int l = 0; l < 4; l++) cfg.mult[l] = l < cfg.n_levels ? mult[l] : 0;
    cfg.attn_ds_mask = 0;
    for (int d : ds) {
        if (d & (d - 1) || d > (1 << 30)) die("flag --attn_ds expects powers of 2, found '%s'", args.attn_ds.c_str());
        int k = 0;
        while ((1 << k) != d) k++;
        cfg.attn_ds_mask |= 1 << k;
    }
    cfg.num_res_blocks = args.num_res_blocks;
    cfg.num_head_channels = args.num_head_channels;
    cfg.diffusion_steps = args.diffusion_steps;
    cfg.beta_start = args.beta_start;
    cfg.beta_end = args.beta_end;
    std::string ce = config_check(cfg);
    if (!ce.empty()) die("model flags: %s", ce.c_str());

    if (args.eval_loss > 0) {
        if (a.load.empty()) die("--eval_loss needs --load FILE, found none");
        if (!args.sample_file.empty()) die("--eval_loss and --sample exclude each other, found both");
        EvalArgs ea;
        ea.device = a.device;
        ea.load = a.load;
        ea.data_file = a.data_file;
        ea.n = args.eval_loss;
        ea.use_ema = args.use_ema;
        ea.batch_size = a.batch_size;
        ea.precision = a.precision;
        ea.precision_given = a.precision_given;
        return unet_eval(ea);
    }
    std::string real;
    if (!args.sample_file.empty()) {
        if (a.load.empty()) die("--sample needs --load FILE, found none");
        if (args.sampler == "ddpm" && is_set("sample_steps"))
            die("--sample_steps applies to --sampler ddim, found it with ddpm (which takes every diffusion step)");
        std::string oe = output_check(args.sample_file, "--sample", &real);  // before the sampling, not after it
        if (!oe.empty()) die("%s", oe.c_str());
        sa.device = a.device;
        sa.out_file = args.sample_file;
        sa.load = a.load;
        sa.sampler = args.sampler;
        sa.num_samples = args.num_samples;
        sa.sample_steps = args.sample_steps;
        sa.use_ema = args.use_ema;
        sa.batch_size = a.batch_size;
        sa.seed = a.seed;
        sa.precision = a.precision;
        sa.precision_given = a.precision_given;
        return unet_sample(sa);
    }
    if (!a.resume.empty() && !a.load.empty()) die("--resume and --load exclude each other, found both");
    if (!args.allow_change.empty() && a.resume.empty()) die("--allow_change needs --resume FILE, found none");
    std::string oe = output_dir_check(a.output_dir);  // before any work: a bad path must not cost the training
    if (!oe.empty()) die("%s", oe.c_str());
    // a checkpoint brings its own model shape: explicit model flags must agree with it
    const std::string& ckpath = !a.resume.empty() ? a.resume : a.load;
    if (!ckpath.empty()) {
        BinFile ck;
        std::string e = bin_open(&ck, ckpath.c_str(), UNET_CHECKPOINT_MAGIC, UNET_FORMAT_VERSION, "unet checkpoint");
        if (!e.empty()) die("%s", e.c_str());
        UNetConfig ccfg = config_from_header(ck.hdr);
        std::string c = config_check(ccfg);
        if (!c.empty()) die("%s: header describes a model this trainer cannot build: %s", ckpath.c_str(), c.c_str());
        UNetConfig asked = ccfg;  // the checkpoint's model with every explicitly given model flag applied
        if (is_set("image_size")) asked.image_size = cfg.image_size;
        if (is_set("model_channels")) asked.model_channels = cfg.model_channels;
        if (is_set("channel_mult")) {
            asked.n_levels = cfg.n_levels;
            for (int l = 0; l < 4; l++) asked.mult[l] = cfg.mult[l];
        }
        if (is_set("num_res_blocks")) asked.num_res_blocks = cfg.num_res_blocks;
        if (is_set("attn_ds")) asked.attn_ds_mask = cfg.attn_ds_mask;
        if (is_set("num_head_channels")) asked.num_head_channels = cfg.num_head_channels;
        if (is_set("diffusion_steps")) asked.diffusion_steps = cfg.diffusion_steps;
        if (is_set("beta_start")) asked.beta_start = cfg.beta_start;
        if (is_set("beta_end")) asked.beta_end = cfg.beta_end;
        std::string d = config_diff(asked, ccfg);
        if (!d.empty()) die("model flags disagree with %s: %s", ckpath.c_str(), d.c_str());
        cfg = ccfg;
        if (!a.resume.empty()) resume_settings(args, ck, ckpath);
    }
    a.cfg = cfg;
    if (a.optimizer == OPT_MUON && a.zero && world > 1)
        die("--optimizer muon with --zero 1: Muon's update needs each weight matrix whole, ZeRO-1 shards the "
            "optimizer state over the ranks; use --zero 0 (plain data parallel: every rank computes the same update)");
    args.optimizer = OPTIMIZER_NAME[a.optimizer];
    // the start-up table: every flag but --device (its own row) with the value the run uses, the model's from a
    // checkpoint when one is given
    args.image_size = cfg.image_size;
    args.model_channels = cfg.model_channels;
    args.channel_mult.clear();
    for (int l = 0; l < cfg.n_levels; l++) args.channel_mult += (l ? "," : "") + std::to_string(cfg.mult[l]);
    args.attn_ds.clear();
    for (int k = 0; k < 31; k++)
        if (cfg.attn_ds_mask >> k & 1) args.attn_ds += (args.attn_ds.empty() ? "" : ",") + std::to_string(1 << k);
    args.num_res_blocks = cfg.num_res_blocks;
    args.num_head_channels = cfg.num_head_channels;
    args.diffusion_steps = cfg.diffusion_steps;
    args.beta_start = cfg.beta_start;
    args.beta_end = cfg.beta_end;
    for (auto& f : flag_specs(args))
        if (strcmp(f.name, "device") != 0) a.settings.push_back({f.name, flag_value_str(f)});
    // how the ranks meet; the flags' hash lets rank 0 refuse a rank started with another command
    a.dist_opts.master_addr = a.master_addr;
    a.dist_opts.master_port = a.master_port;
    a.dist_opts.id_file = a.nccl_id_file;
    a.dist_opts.timeout_s = a.dist_timeout;
    std::string all;
    for (const auto& kv : a.settings) all += kv.first + "=" + kv.second + "\n";
    a.dist_opts.config = dist_hash(all);
    if (world > 1) {
        std::string me = dist_resolve_master(&a.dist_opts);
        if (!me.empty()) die("%s", me.c_str());
    }
    return unet_train(a, nullptr);
}
#endif  // TESTING
