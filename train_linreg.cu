/*
Linear regression y = X.w + b trained by full-batch gradient descent on the mean squared error, on the GPU.

The loss and gradient are exactly those of PyTorch's nn.MSELoss with torch.optim.SGD (dev/linreg.py is the
reference): loss = mean((X.w + b - y)^2), dL/dw = 2/n sum(r x), dL/db = 2/n sum(r), w -= lr dL/dw.

Four kernel versions, chosen with --kernel (dev/linreg.cu checks and benchmarks them):
  1 unfused: forward, loss, gradient and update as four kernels per epoch
  2 fused forward + loss + gradient in one kernel with block reductions, then the update kernel
  3 version 2 split over several CUDA streams, joined with events before the update
  4 one persistent cooperative kernel for all epochs: the training points stay on chip (registers and shared
    memory) and the grid synchronises once per epoch
Every version reduces block partial sums in double, in a fixed order, so each run is deterministic.

Build: make train_linreg          Run: ./train_linreg [--help]
*/
#include <cerrno>
#include <cstdarg>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cuda_runtime.h>
#include <curand.h>

// ----------------------------------------------------------------------------------------------------------------
// error checking: the same family and message shape in the three trainers. A library failure prints
// "[<LIBRARY> ERROR] <what>", then "  in <call> at <file>:<line>", then a "  hint:" line where the usual cause is
// known.

static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "[CUDA ERROR] %s\n  in %s at %s:%d\n", cudaGetErrorString(err), call, file, line);
        if (err == cudaErrorMemoryAllocation)
            fprintf(stderr, "  hint: the dataset does not fit in GPU memory; try fewer --points\n");
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)

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
static void curand_check(curandStatus_t st, const char* call, const char* file, int line) {
    if (st != CURAND_STATUS_SUCCESS) {
        fprintf(stderr, "[cuRAND ERROR] status %d (%s)\n  in %s at %s:%d\n", (int)st, curand_status_name(st), call,
                file, line);
        exit(EXIT_FAILURE);
    }
}
#define curandCheck(call) curand_check((call), #call, __FILE__, __LINE__)

static void* malloc_check(size_t n, const char* file, int line) {
    void* p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "error: malloc of %zu bytes failed at %s:%d\n", n, file, line);
        exit(EXIT_FAILURE);
    }
    return p;
}
#define mallocCheck(n) malloc_check((n), __FILE__, __LINE__)

// Number of usable CUDA devices; 0 when there is no GPU or no driver (the error is cleared, not fatal, and its text
// goes to *why when given).
static int cuda_device_count(const char** why = NULL) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (why) *why = err == cudaSuccess ? "no device" : cudaGetErrorString(err);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

// ----------------------------------------------------------------------------------------------------------------
// files. A reader opens a regular file or says what the path is (a directory, a device, a FIFO: refused from its
// stat before any read, so nothing hangs). A writer checks its output at start-up (output_check), then writes a
// temporary file in the same folder, fsyncs and renames it over the path (write_atomic): a directory, device or
// FIFO is never replaced, a symlink is written through (its target replaced, the link kept) and the temporary file
// never stays behind.

static const char* file_kind(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
}

// Opens path for reading; NULL with *err naming the path when it is missing, unreadable or not a regular file.
static FILE* open_regular(const char* path, const char* what, long long* size, std::string* err) {
    struct stat st;
    if (stat(path, &st) != 0) {
        *err = std::string(path) + ": cannot open " + what + " (" + strerror(errno) + ")";
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        *err = std::string(path) + ": is " + file_kind(st.st_mode) + ", not a regular file (expected a " + what + ")";
        return NULL;
    }
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        *err = std::string(path) + ": cannot open " + what + " (" + strerror(errno) + ")";
        return NULL;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {  // what was opened, in case the path changed meanwhile
        *err = std::string(path) + ": is not a regular file (expected a " + what + ")";
        close(fd);
        return NULL;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    FILE* f = fdopen(fd, "rb");
    if (f == NULL) {
        *err = std::string(path) + ": cannot open " + what + " (" + strerror(errno) + ")";
        close(fd);
        return NULL;
    }
    *size = (long long)st.st_size;
    return f;
}

static std::string folder_of(const std::string& path) {
    size_t slash = path.find_last_of('/');
    return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// Checks, before any work, that path can be written: "" and the path to write (a symlink's target) in *real, or
// a message naming the path: a missing folder, a folder that takes no new file, a directory, device or FIFO.
static std::string output_check(const char* path, const char* what, std::string* real) {
    struct stat st;
    *real = path;
    if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
        char buf[PATH_MAX];
        if (realpath(path, buf) != NULL) {
            *real = buf;
        } else {  // a symlink to a file still to be made: write it where the link points
            if (errno != ENOENT)  // a loop, or a folder on the way that cannot be searched: nothing to write through
                return std::string(path) + ": " + what + " is a symlink that cannot be followed (" +
                       strerror(errno) + ")";
            ssize_t n = readlink(path, buf, sizeof buf - 1);
            if (n <= 0)
                return std::string(path) + ": " + what + " is a symlink that cannot be followed (" +
                       strerror(errno) + ")";
            buf[n] = 0;
            *real = buf[0] == '/' ? std::string(buf) : folder_of(path) + "/" + buf;
        }
    }
    std::string folder = folder_of(*real);
    if (stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
        return std::string(path) + ": " + what + ": folder " + folder + " does not exist";
    if (stat(real->c_str(), &st) == 0 && !S_ISREG(st.st_mode))
        return std::string(path) + ": " + what + " is " + file_kind(st.st_mode) + ", not a regular file: refusing to "
               "replace it";
    std::string probe = *real + ".XXXXXX";  // the folder takes the real write's temporary file (and its long name)
    int fd = mkstemp(&probe[0]);
    if (fd < 0)
        return std::string(path) + ": " + what + ": cannot write in folder " + folder + " (" + strerror(errno) + ")";
    close(fd);
    unlink(probe.c_str());
    return "";
}

// Writes path through a temporary file in its folder, fsync and rename; body writes the content and returns false
// on a failed write. Returns 0, or -1 after printing an error (the old file kept, no temporary file left).
static int write_atomic(const char* path, const char* what, const std::function<bool(FILE*)>& body) {
    std::string real;
    std::string e = output_check(path, what, &real);
    if (!e.empty()) {
        fprintf(stderr, "error: %s\n", e.c_str());
        return -1;
    }
    if (real != path) printf("note: %s is a symlink: writing through to %s\n", path, real.c_str());
    std::string tmp = real + ".XXXXXX";
    int fd = mkstemp(&tmp[0]);
    FILE* f = fd < 0 ? NULL : fdopen(fd, "wb");
    if (f == NULL) {
        fprintf(stderr, "error: %s: cannot write %s (%s)\n", path, what, strerror(errno));
        if (fd >= 0) {
            close(fd);
            unlink(tmp.c_str());
        }
        return -1;
    }
    mode_t mask = umask(0);
    umask(mask);
    fchmod(fd, 0666 & ~mask);
    bool ok = body(f);
    ok = fflush(f) == 0 && ok;
    ok = fsync(fd) == 0 && ok;
    int saved = errno;
    ok = fclose(f) == 0 && ok;
    if (ok && rename(tmp.c_str(), real.c_str()) != 0) {
        ok = false;
        saved = errno;
    }
    if (!ok) {
        fprintf(stderr, "error: %s: cannot write %s (%s)\n", path, what, strerror(saved ? saved : errno));
        unlink(tmp.c_str());
        return -1;
    }
    int dfd = open(folder_of(real).c_str(), O_RDONLY);  // the rename itself reaches the disk
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return 0;
}

// ----------------------------------------------------------------------------------------------------------------
// the project's binary file layout (data/README.md): 256 int32 header, 128-byte tensor table entries, data

#define HEADER_INTS 256
#define ENTRY_BYTES 128
#define NAME_BYTES 96
#define DTYPE_F32 0
#define LINREG_DATASET_MAGIC 20260101
#define LINREG_DATASET_VERSION 1
#define MAX_FEATURES 32

typedef struct {
    char name[NAME_BYTES];
    int32_t dtype;
    int32_t ndim;
    int32_t shape[4];
    int32_t reserved[2];
} TensorEntry;
static_assert(sizeof(TensorEntry) == ENTRY_BYTES, "tensor table entries are 128 bytes on disk");

static float int_bits_to_float(int32_t v) { float f; memcpy(&f, &v, 4); return f; }
static int32_t float_to_int_bits(float f) { int32_t v; memcpy(&v, &f, 4); return v; }

// A dataset in host memory: x is (N, D) row-major, y is (N,); the first n_train rows are the training split.
typedef struct {
    int n_points, n_features, n_train;
    int seed;                                          // generation settings, NaN/0 for user data
    float w_true, b_true, noise_std, x_min, x_max;
    float* x;
    float* y;
} LinregData;

static void linreg_data_free(LinregData* d) {
    free(d->x);
    free(d->y);
    d->x = d->y = NULL;
}

// Reads a linreg dataset, checking magic, version, every field, both tensors and the file length before
// trusting a byte. Returns 0 on success; on failure prints which field is wrong and returns -1.
static int linreg_read_dataset(const char* path, LinregData* out) {
    memset(out, 0, sizeof(*out));
    long long size = 0;
    std::string err;
    FILE* f = open_regular(path, "data file", &size, &err);
    if (f == NULL) {
        fprintf(stderr, "error: %s\n", err.c_str());
        return -1;
    }
    int32_t header[HEADER_INTS];
    if (size < (long long)sizeof(header) || fread(header, sizeof(header), 1, f) != 1) {
        fprintf(stderr, "error: %s: file is %lld bytes, shorter than the %zu-byte header\n", path, size,
                sizeof(header));
        fclose(f);
        return -1;
    }
#define FAIL(...) \
    do { \
        fprintf(stderr, "error: %s: ", path); \
        fprintf(stderr, __VA_ARGS__); \
        fprintf(stderr, "\n"); \
        fclose(f); \
        return -1; \
    } while (0)
    if (header[0] != LINREG_DATASET_MAGIC)
        FAIL("header[0] magic is %d, expected %d (a linreg dataset; write one with --save_data or "
             "scripts/csv_to_linreg.py)", header[0], LINREG_DATASET_MAGIC);
    if (header[1] != LINREG_DATASET_VERSION)
        FAIL("header[1] version is %d, expected %d", header[1], LINREG_DATASET_VERSION);
    if (header[2] != 2) FAIL("header[2] tensor count is %d, expected 2 (x and y)", header[2]);
    int n = header[3], d = header[4], n_train = header[5];
    if (n < 2) FAIL("header[3] n_points is %d, expected at least 2", n);
    if (d < 1 || d > MAX_FEATURES) FAIL("header[4] n_features is %d, expected 1 to %d", d, MAX_FEATURES);
    if (n_train < 1 || n_train >= n) FAIL("header[5] n_train is %d, expected 1 to n_points-1 = %d", n_train, n - 1);
    TensorEntry table[2];
    if (fread(table, sizeof(table), 1, f) != 1) FAIL("file ends inside the tensor table");
    const char* names[2] = {"x", "y"};
    int ndims[2] = {2, 1};
    int shapes[2][2] = {{n, d}, {n, 0}};
    for (int i = 0; i < 2; i++) {
        TensorEntry* e = &table[i];
        e->name[NAME_BYTES - 1] = 0;
        if (strcmp(e->name, names[i]) != 0) FAIL("tensor %d is named '%s', expected '%s'", i, e->name, names[i]);
        if (e->dtype != DTYPE_F32) FAIL("tensor %s has dtype code %d, expected 0 (float32)", names[i], e->dtype);
        if (e->ndim != ndims[i]) FAIL("tensor %s has %d dims, expected %d", names[i], e->ndim, ndims[i]);
        for (int k = 0; k < ndims[i]; k++) {
            if (e->shape[k] != shapes[i][k])
                FAIL("tensor %s has shape[%d] = %d, expected %d", names[i], k, e->shape[k], shapes[i][k]);
        }
    }
    long long expected = (long long)sizeof(header) + sizeof(table) + 4LL * n * d + 4LL * n;
    if (size != expected)
        FAIL("file length is %lld bytes, the header says %lld (n_points %d, n_features %d)", size, expected, n, d);
    out->n_points = n;
    out->n_features = d;
    out->n_train = n_train;
    out->seed = header[6];
    out->w_true = int_bits_to_float(header[7]);
    out->b_true = int_bits_to_float(header[8]);
    out->noise_std = int_bits_to_float(header[9]);
    out->x_min = int_bits_to_float(header[10]);
    out->x_max = int_bits_to_float(header[11]);
    out->x = (float*)mallocCheck(sizeof(float) * (size_t)n * d);
    out->y = (float*)mallocCheck(sizeof(float) * (size_t)n);
    if (fread(out->x, sizeof(float), (size_t)n * d, f) != (size_t)n * d ||
        fread(out->y, sizeof(float), n, f) != (size_t)n) {
        linreg_data_free(out);
        FAIL("short read of the tensor data");
    }
#undef FAIL
    fclose(f);
    for (long long i = 0; i < (long long)n * d; i++) {
        if (!std::isfinite(out->x[i])) {
            fprintf(stderr, "error: %s: x[%lld][%lld] is %g, expected a finite number\n", path, i / d, i % d,
                    out->x[i]);
            linreg_data_free(out);
            return -1;
        }
    }
    for (int i = 0; i < n; i++) {
        if (!std::isfinite(out->y[i])) {
            fprintf(stderr, "error: %s: y[%d] is %g, expected a finite number\n", path, i, out->y[i]);
            linreg_data_free(out);
            return -1;
        }
    }
    return 0;
}

// Writes the dataset through write_atomic, so a crash never leaves a torn file.
static int linreg_write_dataset(const char* path, const LinregData* d) {
    int32_t header[HEADER_INTS] = {0};
    header[0] = LINREG_DATASET_MAGIC;
    header[1] = LINREG_DATASET_VERSION;
    header[2] = 2;
    header[3] = d->n_points;
    header[4] = d->n_features;
    header[5] = d->n_train;
    header[6] = d->seed;
    header[7] = float_to_int_bits(d->w_true);
    header[8] = float_to_int_bits(d->b_true);
    header[9] = float_to_int_bits(d->noise_std);
    header[10] = float_to_int_bits(d->x_min);
    header[11] = float_to_int_bits(d->x_max);
    TensorEntry table[2];
    memset(table, 0, sizeof(table));
    strcpy(table[0].name, "x");
    table[0].ndim = 2;
    table[0].shape[0] = d->n_points;
    table[0].shape[1] = d->n_features;
    strcpy(table[1].name, "y");
    table[1].ndim = 1;
    table[1].shape[0] = d->n_points;
    size_t nx = (size_t)d->n_points * d->n_features;
    return write_atomic(path, "--save_data", [&](FILE* f) {
        return fwrite(header, sizeof(header), 1, f) == 1 && fwrite(table, sizeof(table), 1, f) == 1 &&
               fwrite(d->x, sizeof(float), nx, f) == nx &&
               fwrite(d->y, sizeof(float), d->n_points, f) == (size_t)d->n_points;
    });
}

// ----------------------------------------------------------------------------------------------------------------
// synthetic data: x ~ U[x_min, x_max), y = w_true x + b_true + N(0, noise_std^2), drawn with cuRAND's Philox
// generator. Points are drawn independently, so the first n_train rows are a random training split.

__global__ void linreg_make_data_kernel(float* x, float* y, const float* noise, int n, float x_min, float x_max,
                                        float w_true, float b_true, float noise_std) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float xi = x_min + x[i] * (x_max - x_min);  // x holds U(0, 1] draws on entry
        x[i] = xi;
        y[i] = w_true * xi + b_true + noise_std * noise[i];
    }
}

// Same arithmetic as linreg_make_data_kernel, for the CPU path (cuRAND's host generator gives the same draws).
static void linreg_make_data_cpu(float* x, float* y, const float* noise, int n, float x_min, float x_max,
                                 float w_true, float b_true, float noise_std) {
    for (int i = 0; i < n; i++) {
        float xi = x_min + x[i] * (x_max - x_min);
        x[i] = xi;
        y[i] = w_true * xi + b_true + noise_std * noise[i];
    }
}

// Generates the dataset into host memory (out->x, out->y allocated here). With use_gpu the draws and the
// arithmetic run on the GPU (timed into *gen_ms); otherwise through cuRAND's host generator on the CPU.
static void linreg_generate(LinregData* out, int n, float split, int seed, float x_min, float x_max, float w_true,
                            float b_true, float noise_std, bool use_gpu, float* gen_ms, float** d_x_out,
                            float** d_y_out) {
    out->n_points = n;
    out->n_features = 1;
    out->n_train = (int)llround((double)split * n);
    out->seed = seed;
    out->w_true = w_true;
    out->b_true = b_true;
    out->noise_std = noise_std;
    out->x_min = x_min;
    out->x_max = x_max;
    out->x = (float*)mallocCheck(sizeof(float) * n);
    out->y = (float*)mallocCheck(sizeof(float) * n);
    size_t n_even = (size_t)n + (n & 1);  // curandGenerateNormal draws pairs
    if (use_gpu) {
        float *d_x, *d_y, *d_noise;
        cudaCheck(cudaMalloc(&d_x, sizeof(float) * n));
        cudaCheck(cudaMalloc(&d_y, sizeof(float) * n));
        cudaCheck(cudaMalloc(&d_noise, sizeof(float) * n_even));
        cudaEvent_t start, stop;
        cudaCheck(cudaEventCreate(&start));
        cudaCheck(cudaEventCreate(&stop));
        curandGenerator_t gen;
        curandCheck(curandCreateGenerator(&gen, CURAND_RNG_PSEUDO_PHILOX4_32_10));
        cudaCheck(cudaEventRecord(start));
        curandCheck(curandSetPseudoRandomGeneratorSeed(gen, (unsigned long long)seed));
        curandCheck(curandGenerateUniform(gen, d_x, n));
        curandCheck(curandGenerateNormal(gen, d_noise, n_even, 0.0f, 1.0f));
        linreg_make_data_kernel<<<(n + 255) / 256, 256>>>(d_x, d_y, d_noise, n, x_min, x_max, w_true, b_true,
                                                          noise_std);
        cudaCheck(cudaGetLastError());
        cudaCheck(cudaEventRecord(stop));
        cudaCheck(cudaEventSynchronize(stop));
        cudaCheck(cudaEventElapsedTime(gen_ms, start, stop));
        curandCheck(curandDestroyGenerator(gen));
        cudaCheck(cudaMemcpy(out->x, d_x, sizeof(float) * n, cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(out->y, d_y, sizeof(float) * n, cudaMemcpyDeviceToHost));
        cudaCheck(cudaFree(d_noise));
        cudaCheck(cudaEventDestroy(start));
        cudaCheck(cudaEventDestroy(stop));
        *d_x_out = d_x;  // the caller trains on these directly: no round trip through the host
        *d_y_out = d_y;
    } else {
        float* noise = (float*)mallocCheck(sizeof(float) * n_even);
        curandGenerator_t gen;
        curandCheck(curandCreateGeneratorHost(&gen, CURAND_RNG_PSEUDO_PHILOX4_32_10));
        curandCheck(curandSetPseudoRandomGeneratorSeed(gen, (unsigned long long)seed));
        curandCheck(curandGenerateUniform(gen, out->x, n));
        curandCheck(curandGenerateNormal(gen, noise, n_even, 0.0f, 1.0f));
        curandCheck(curandDestroyGenerator(gen));
        linreg_make_data_cpu(out->x, out->y, noise, n, x_min, x_max, w_true, b_true, noise_std);
        free(noise);
        *gen_ms = 0.0f;
    }
}

// ----------------------------------------------------------------------------------------------------------------
// reductions. Every version ends an epoch with NV = 2 + D block partial sums per block row:
// [0] sum r^2, [1] sum r, [2 + d] sum r x_d, with r = x.w + b - y.

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = WARP / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
    for (int offset = WARP / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sums acc[0..NV) over the block; the result is valid in thread 0. scratch holds 32*NV floats.
template <int NV>
__device__ void block_sum(float (&acc)[NV], float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
#pragma unroll
    for (int j = 0; j < NV; j++) acc[j] = warp_sum(acc[j]);
    __syncthreads();  // scratch may still be read from the previous call
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < NV; j++) scratch[warp * NV + j] = acc[j];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < NV; j++) acc[j] = warp_sum(lane < n_warps ? scratch[lane * NV + j] : 0.0f);
    }
}

// Kernel-side parameters live in a register array: w[0..NV-2) (zero past D) and b at slot NV-2, so every index
// is a compile-time constant and nothing spills to local memory.
template <int NV>
__device__ __forceinline__ void load_params(float (&params)[NV - 1], const float* src, int D) {
#pragma unroll
    for (int j = 0; j < NV - 2; j++) params[j] = j < D ? src[j] : 0.0f;
    params[NV - 2] = src[D];
}

// Adds one point's terms to the accumulators. DT = D at compile time (1), or 0 for any D <= MAX_FEATURES.
template <int DT, int NV>
__device__ __forceinline__ void accumulate_point(float (&acc)[NV], const float (&params)[NV - 1], const float* xi,
                                                 float yi, int D) {
    float pred = params[NV - 2];
#pragma unroll
    for (int d = 0; d < NV - 2; d++) {
        if (DT || d < D) pred += params[d] * xi[d];
    }
    float r = pred - yi;
    acc[0] += r * r;
    acc[1] += r;
#pragma unroll
    for (int d = 0; d < NV - 2; d++) {
        if (DT || d < D) acc[2 + d] += r * xi[d];
    }
}

#define LINREG_THREADS 256
#define LINREG_POINTS_PER_THREAD 16  // grid sizing of versions 1-3: enough work per thread to hide latency
static int linreg_grid_size(long long n) {
    long long blocks = (n + (long long)LINREG_THREADS * LINREG_POINTS_PER_THREAD - 1) /
                       ((long long)LINREG_THREADS * LINREG_POINTS_PER_THREAD);
    return (int)(blocks < 1 ? 1 : blocks);
}

// The update step shared by versions 1-3: one block reduces the partial rows in double, in a fixed order, writes
// the epoch's loss and takes the SGD step. With apply == 0 it only writes the loss (test-loss evaluation).
__global__ void linreg_update_kernel(const float* partials, int n_rows, int D, int n, float lr, float* params,
                                     float* loss_out, int apply) {
    __shared__ double sums[2 + MAX_FEATURES][LINREG_THREADS / WARP];
    int nv = 2 + D;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (int j = 0; j < nv; j++) {
        double s = 0.0;
        for (int row = threadIdx.x; row < n_rows; row += blockDim.x) s += (double)partials[(size_t)row * nv + j];
        s = warp_sum(s);
        if (lane == 0) sums[j][warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double total[2 + MAX_FEATURES];
        for (int j = 0; j < nv; j++) {
            total[j] = 0.0;
            for (int w = 0; w < LINREG_THREADS / WARP; w++) total[j] += sums[j][w];
        }
        float loss = (float)(total[0] / n);
        *loss_out = loss;
        if (apply) {
            for (int d = 0; d < D; d++) params[d] -= lr * (float)(2.0 * total[2 + d] / n);
            params[D] -= lr * (float)(2.0 * total[1] / n);
        }
    }
}

// ----------------------------------------------------------------------------------------------------------------
// version 1: unfused. forward writes pred; loss and gradient kernels reduce into the partial rows.

template <int DT>
__global__ void linreg_forward_kernel(const float* x, const float* params, int n, int D, float* pred) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float* xi = x + i * (DT ? DT : D);
        float p = params[DT ? DT : D];
#pragma unroll
        for (int d = 0; d < (DT ? DT : MAX_FEATURES); d++) {
            if (DT || d < D) p += params[d] * xi[d];
        }
        pred[i] = p;
    }
}

__global__ void linreg_loss_kernel(const float* pred, const float* y, int n, int D, float* partials) {
    __shared__ float scratch[WARP];
    float acc[1] = {0.0f};
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float r = pred[i] - y[i];
        acc[0] += r * r;
    }
    block_sum<1>(acc, scratch);
    if (threadIdx.x == 0) partials[(size_t)blockIdx.x * (2 + D)] = acc[0];
}

template <int DT>
__global__ void linreg_gradient_kernel(const float* x, const float* y, const float* pred, int n, int D,
                                       float* partials) {
    constexpr int NV = 1 + (DT ? DT : MAX_FEATURES);  // sum r, sum r x_d
    __shared__ float scratch[WARP * NV];
    float acc[NV] = {0.0f};
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float* xi = x + i * (DT ? DT : D);
        float r = pred[i] - y[i];
        acc[0] += r;
#pragma unroll
        for (int d = 0; d < NV - 1; d++) {
            if (DT || d < D) acc[1 + d] += r * xi[d];
        }
    }
    block_sum<NV>(acc, scratch);
    if (threadIdx.x == 0) {
        for (int j = 0; j < 1 + D; j++) partials[(size_t)blockIdx.x * (2 + D) + 1 + j] = acc[j];
    }
}

// ----------------------------------------------------------------------------------------------------------------
// version 2: forward + loss + gradient fused, one read of the data per epoch. Also versions 3's per-stream kernel.

template <int DT>
__global__ void linreg_fused_kernel(const float* x, const float* y, const float* params_g, int n, int D,
                                    float* partials) {
    constexpr int NV = 2 + (DT ? DT : MAX_FEATURES);
    __shared__ float scratch[WARP * NV];
    float params[NV - 1];
    load_params<NV>(params, params_g, D);
    float acc[NV] = {0.0f};
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        accumulate_point<DT, NV>(acc, params, x + i * (DT ? DT : D), y[i], D);
    }
    block_sum<NV>(acc, scratch);
    if (threadIdx.x == 0) {
        for (int j = 0; j < 2 + D; j++) partials[(size_t)blockIdx.x * (2 + D) + j] = acc[j];
    }
}

// ----------------------------------------------------------------------------------------------------------------
// version 4: one persistent cooperative kernel for all epochs. Block b owns a contiguous range of points: the
// first PERSIST_REGS*blockDim of them live in registers, the next smem_points in shared memory, and any rest is
// read from global memory (L2) every epoch. Each epoch: every block writes its partial sums to rows[epoch % 2],
// the grid synchronises once (grid_barrier below), and in every block thread t reads row t (all rows in one L2 round
// trip), the warps' sums meet in shared memory and every thread adds them in the same order in double and takes the
// SGD step itself, so all threads of all blocks hold bit-identical w and b. Rows alternate between two buffers: a
// row of parity p is rewritten two epochs later, after the next grid sync, when every block has read it.
// Measured on an H100 (2026-11-22, 200 epochs, per epoch at 500 points): cooperative groups' grid.sync() with warp
// 0 reading the 132 rows in a loop 4.4 us, with thread t reading row t 4.1 us; blocks exchanging tagged words
// polled in L2 instead of a barrier 7.8 to 8.7 us (polling the same lines from every SM is slow). At 5M points
// 1024 threads x 8 register points took 1.08 ms for 200 epochs, the rest of the time in shared-memory reads.

// A grid barrier for co-resident blocks (cooperative launch). Thread 0 of each block adds 1 to a counter with
// release semantics (no round trip: it does not wait for the old value) and polls it with acquire loads until
// every block of this round has arrived; the block barriers pass the ordering on to the block's other threads.
// The counter only grows (it is zeroed before each launch), so no reset can race with a late poller; rounds are
// compared modulo 2^32. Measured against grid.sync() in the same runs (H100, 500 points): 3.95 to 4.2 us per epoch
// against 4.1 to 4.4; the epoch's floor is the L2 round trips, not the barrier's code.
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        } while ((int)(seen - target) < 0);
    }
    __syncthreads();
}

#define PERSIST_THREADS 512
#define PERSIST_THREADS_ANY_D 256  // D > 1 keeps 34 accumulators per thread: fewer, fatter threads
#define PERSIST_REGS 40  // points per thread in registers: 80 registers under the 128 that 512 threads allow; fewer
                         // points left in shared memory, whose bandwidth bounded an epoch with 1024 threads x 8
static int persist_threads(int D) { return D == 1 ? PERSIST_THREADS : PERSIST_THREADS_ANY_D; }

// One point of a one-feature model, from registers or shared memory (same arithmetic as accumulate_point).
template <int NV>
__device__ __forceinline__ void accumulate_scalar(float (&acc)[NV], float w, float b, float xi, float yi) {
    float pred = b;
    pred += w * xi;
    float r = pred - yi;
    acc[0] += r * r;
    acc[1] += r;
    acc[2] += r * xi;
}

template <int DT>
__global__ void __launch_bounds__(DT == 1 ? PERSIST_THREADS : PERSIST_THREADS_ANY_D, 1)
linreg_persistent_kernel(const float* x, const float* y, int n, int D, int epochs, float lr, float* params_g,
                         float* exchange, unsigned* barrier_counter, float* losses, int smem_points) {
    constexpr int NV = 2 + (DT ? DT : MAX_FEATURES);
    constexpr int R = DT == 1 ? PERSIST_REGS : 0;
    extern __shared__ float2 cache[];  // (x, y) of this block's shared-memory points (DT == 1 only)
    __shared__ float scratch[WARP * NV];
    __shared__ double totals[WARP][NV];  // per-warp sums of the rows, added in a fixed order

    long long per_block = ((long long)n + gridDim.x - 1) / gridDim.x;
    long long begin = (long long)blockIdx.x * per_block;
    long long end = begin + per_block < n ? begin + per_block : n;
    long long reg_end = begin, smem_end = begin;
    float rx[R > 0 ? R : 1], ry[R > 0 ? R : 1];
    int n_reg = 0;
    if (DT == 1) {
        reg_end = begin + (long long)R * blockDim.x < end ? begin + (long long)R * blockDim.x : end;
#pragma unroll
        for (int k = 0; k < R; k++) {
            long long i = begin + threadIdx.x + (long long)k * blockDim.x;
            rx[k] = i < reg_end ? x[i] : 0.0f;
            ry[k] = i < reg_end ? y[i] : 0.0f;
            n_reg += i < reg_end;
        }
        smem_end = reg_end + smem_points < end ? reg_end + smem_points : end;
        for (long long i = reg_end + threadIdx.x; i < smem_end; i += blockDim.x)
            cache[i - reg_end] = make_float2(x[i], y[i]);
    }
    int n_smem = (int)(smem_end - reg_end);
    float params[NV - 1];
    load_params<NV>(params, params_g, D);
    __syncthreads();

    int row_words = 2 + D;
    int n_reading_warps = ((int)gridDim.x + WARP - 1) / WARP;
    for (int epoch = 0; epoch < epochs; epoch++) {
        float acc[NV] = {0.0f};
        if (DT == 1) {
#pragma unroll
            for (int k = 0; k < R; k++) {
                if (k < n_reg) accumulate_scalar<NV>(acc, params[0], params[NV - 2], rx[k], ry[k]);
            }
            for (int j = threadIdx.x; j < n_smem; j += blockDim.x) {
                float2 p = cache[j];
                accumulate_scalar<NV>(acc, params[0], params[NV - 2], p.x, p.y);
            }
        }
        for (long long i = smem_end + threadIdx.x; i < end; i += blockDim.x) {
            accumulate_point<DT, NV>(acc, params, x + i * (DT ? DT : D), y[i], D);
        }
        block_sum<NV>(acc, scratch);
        float* rows = exchange + (size_t)(epoch & 1) * gridDim.x * row_words;
        if (threadIdx.x == 0) {
#pragma unroll
            for (int j = 0; j < NV; j++) {
                if (j < row_words) rows[(size_t)blockIdx.x * row_words + j] = acc[j];
            }
        }
        grid_barrier(barrier_counter, (unsigned)(epoch + 1) * gridDim.x);
        if (threadIdx.x < n_reading_warps * WARP) {
            bool mine = threadIdx.x < gridDim.x;
            float row[NV];
#pragma unroll
            for (int j = 0; j < NV; j++) {
                // L2: other SMs wrote it
                row[j] = (mine && j < row_words) ? __ldcg(&rows[(size_t)threadIdx.x * row_words + j]) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < NV; j++) {
                double v = warp_sum((double)row[j]);
                if (threadIdx.x % WARP == 0) totals[threadIdx.x / WARP][j] = v;
            }
        }
        __syncthreads();
        double total[NV];
#pragma unroll
        for (int j = 0; j < NV; j++) {
            total[j] = 0.0;
            if (j < row_words) {
                for (int w = 0; w < n_reading_warps; w++) total[j] += totals[w][j];
            }
        }
        float loss = (float)(total[0] / n);
        if (blockIdx.x == 0 && threadIdx.x == 0) losses[epoch] = loss;
#pragma unroll
        for (int d = 0; d < NV - 2; d++) {
            if (d < D) params[d] -= lr * (float)(2.0 * total[2 + d] / n);
        }
        params[NV - 2] -= lr * (float)(2.0 * total[1] / n);
        if (!isfinite(loss)) break;  // every block sees the same loss, so all stop together
        // totals is rewritten next epoch only after block_sum's barriers, which every thread reaches after reading it
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        for (int d = 0; d < D; d++) params_g[d] = params[d < NV - 2 ? d : 0];
        params_g[D] = params[NV - 2];
    }
}

// ----------------------------------------------------------------------------------------------------------------
// GPU state and the training driver

typedef struct {
    int epochs;
    float lr;
    float w_init, b_init;
    int kernel;   // 1..4
    int streams;  // version 3
} TrainConfig;

typedef struct {
    std::vector<float> w;
    float b;
    std::vector<float> train_losses;  // one per epoch: the loss before that epoch's update (as PyTorch logs it)
    float test_loss;
    float train_ms;  // GPU time of all epochs (CUDA events), or CPU wall time
    float eval_ms;
    int diverged_epoch;  // first epoch with a non-finite loss, -1 if none
} TrainResult;

#define MAX_STREAMS 64

typedef struct {
    const float* x;  // (N, D) on the device; the first n_train rows train
    const float* y;
    int n_points, n_features, n_train;
    float* params;    // w[0..D), b
    float* losses;    // per epoch
    float* test_loss;
    float* pred;      // version 1
    float* partials;  // [max rows][2 + D]
    int max_rows;
    float* exchange;  // version 4: see exchange_bytes
    cudaStream_t streams[MAX_STREAMS];
    cudaEvent_t stream_done[MAX_STREAMS];
    cudaEvent_t update_done;
    int n_streams;
    int persist_blocks, persist_smem_points;
    const char* persist_unavailable;  // why version 4 cannot run here, NULL when it can
} LinregGpu;

// Version 4's exchange buffer: partial-sum rows [2][blocks][2 + D], then the barrier counter.
static size_t exchange_bytes(int blocks, int D) { return sizeof(float) * (2 * (size_t)blocks * (2 + D) + 1); }

// Sets up device buffers for training on (x, y) already on the device.
static void linreg_gpu_build(LinregGpu* g, const float* d_x, const float* d_y, int n_points, int n_features,
                             int n_train, int epochs, int n_streams) {
    memset(g, 0, sizeof(*g));
    g->x = d_x;
    g->y = d_y;
    g->n_points = n_points;
    g->n_features = n_features;
    g->n_train = n_train;
    int nv = 2 + n_features;
    cudaCheck(cudaMalloc(&g->params, sizeof(float) * (n_features + 1)));
    cudaCheck(cudaMalloc(&g->losses, sizeof(float) * (epochs > 0 ? epochs : 1)));
    cudaCheck(cudaMalloc(&g->test_loss, sizeof(float)));
    cudaCheck(cudaMalloc(&g->pred, sizeof(float) * n_points));
    // partial rows: versions 1-2 use linreg_grid_size(n) rows, version 3 at most that plus one per stream
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, dev));
    g->max_rows = linreg_grid_size(n_points) + n_streams;
    cudaCheck(cudaMalloc(&g->partials, sizeof(float) * (size_t)g->max_rows * nv));
    g->n_streams = n_streams;
    for (int s = 0; s < n_streams; s++) {
        cudaCheck(cudaStreamCreateWithFlags(&g->streams[s], cudaStreamNonBlocking));
        cudaCheck(cudaEventCreateWithFlags(&g->stream_done[s], cudaEventDisableTiming));
    }
    cudaCheck(cudaEventCreateWithFlags(&g->update_done, cudaEventDisableTiming));
    // version 4: one block per SM; shared memory holds what the registers cannot. A GPU that cannot run it still
    // runs versions 1-3: the reason is kept and reported only if version 4 is asked for.
    if (prop.cooperativeLaunch == 0) {
        g->persist_unavailable = "this GPU does not support cooperative launches";
        return;
    }
    cudaFuncAttributes attr;
    bool one_feature = n_features == 1;
    const void* kernel =
        one_feature ? (const void*)linreg_persistent_kernel<1> : (const void*)linreg_persistent_kernel<0>;
    cudaCheck(cudaFuncGetAttributes(&attr, kernel));
    size_t smem_bytes = 0;
    if (one_feature) {
        size_t avail = prop.sharedMemPerBlockOptin - attr.sharedSizeBytes - 1024;  // 1 KB of headroom for the runtime
        long long per_block = ((long long)n_train + prop.multiProcessorCount - 1) / prop.multiProcessorCount;
        long long want = per_block - (long long)PERSIST_REGS * persist_threads(1);
        if (want < 0) want = 0;
        if ((size_t)want * sizeof(float2) > avail) want = avail / sizeof(float2);
        g->persist_smem_points = (int)want;
        smem_bytes = (size_t)want * sizeof(float2);
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
    }
    int per_sm = 0;
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, persist_threads(n_features), smem_bytes));
    if (per_sm < 1) {
        g->persist_unavailable = "the persistent kernel does not fit on one SM of this GPU";
        return;
    }
    g->persist_blocks = prop.multiProcessorCount;
    cudaCheck(cudaMalloc(&g->exchange, exchange_bytes(g->persist_blocks, n_features)));
}

static void linreg_gpu_free(LinregGpu* g) {
    cudaCheck(cudaFree(g->params));
    cudaCheck(cudaFree(g->losses));
    cudaCheck(cudaFree(g->test_loss));
    cudaCheck(cudaFree(g->pred));
    cudaCheck(cudaFree(g->partials));
    if (g->exchange != NULL) cudaCheck(cudaFree(g->exchange));
    for (int s = 0; s < g->n_streams; s++) {
        cudaCheck(cudaStreamDestroy(g->streams[s]));
        cudaCheck(cudaEventDestroy(g->stream_done[s]));
    }
    cudaCheck(cudaEventDestroy(g->update_done));
}

// Launches version 2's fused kernel over rows [0, n) of (x, y) on a stream, writing `rows` partial rows.
static void linreg_launch_fused(const float* x, const float* y, const float* params, int n, int D, float* partials,
                                int rows, cudaStream_t stream) {
    if (D == 1) linreg_fused_kernel<1><<<rows, LINREG_THREADS, 0, stream>>>(x, y, params, n, D, partials);
    else linreg_fused_kernel<0><<<rows, LINREG_THREADS, 0, stream>>>(x, y, params, n, D, partials);
    cudaCheck(cudaGetLastError());
}

// One epoch of versions 1-3 on the default stream (version 3 forks and joins its streams around it).
static void linreg_gpu_epoch(LinregGpu* g, int version, int epoch, float lr) {
    int n = g->n_train, D = g->n_features;
    int rows = linreg_grid_size(n);
    if (version == 1) {
        if (D == 1) linreg_forward_kernel<1><<<rows, LINREG_THREADS>>>(g->x, g->params, n, D, g->pred);
        else linreg_forward_kernel<0><<<rows, LINREG_THREADS>>>(g->x, g->params, n, D, g->pred);
        cudaCheck(cudaGetLastError());
        linreg_loss_kernel<<<rows, LINREG_THREADS>>>(g->pred, g->y, n, D, g->partials);
        cudaCheck(cudaGetLastError());
        if (D == 1) linreg_gradient_kernel<1><<<rows, LINREG_THREADS>>>(g->x, g->y, g->pred, n, D, g->partials);
        else linreg_gradient_kernel<0><<<rows, LINREG_THREADS>>>(g->x, g->y, g->pred, n, D, g->partials);
        cudaCheck(cudaGetLastError());
    } else if (version == 2) {
        linreg_launch_fused(g->x, g->y, g->params, n, D, g->partials, rows, 0);
    } else {
        // version 3: each stream waits for the previous update, reduces its chunk into its own partial rows,
        // and records an event; the update waits for every stream. No stream touches params while another reads.
        cudaCheck(cudaEventRecord(g->update_done, 0));
        int chunk = (n + g->n_streams - 1) / g->n_streams;
        rows = 0;
        for (int s = 0; s < g->n_streams; s++) {
            int lo = s * chunk, hi = lo + chunk < n ? lo + chunk : n;
            if (hi <= lo) continue;
            int r = linreg_grid_size(hi - lo);
            cudaCheck(cudaStreamWaitEvent(g->streams[s], g->update_done, 0));
            linreg_launch_fused(g->x + (size_t)lo * D, g->y + lo, g->params, hi - lo, D,
                                g->partials + (size_t)rows * (2 + D), r, g->streams[s]);
            cudaCheck(cudaEventRecord(g->stream_done[s], g->streams[s]));
            cudaCheck(cudaStreamWaitEvent(0, g->stream_done[s], 0));
            rows += r;
        }
    }
    linreg_update_kernel<<<1, LINREG_THREADS>>>(g->partials, rows, D, n, lr, g->params, g->losses + epoch, 1);
    cudaCheck(cudaGetLastError());
}

// Runs every epoch of the chosen version on the default stream (no host synchronisation inside).
static void linreg_gpu_train_epochs(LinregGpu* g, int version, int epochs, float lr) {
    if (version == 4) {
        if (g->persist_unavailable != NULL) {
            fprintf(stderr, "error: --kernel 4: %s; use --kernel 1, 2 or 3\n", g->persist_unavailable);
            exit(EXIT_FAILURE);
        }
        int n = g->n_train, D = g->n_features;
        float* params = g->params;
        float* exchange = g->exchange;
        unsigned* barrier_counter = (unsigned*)(exchange + 2 * (size_t)g->persist_blocks * (2 + D));
        float* losses = g->losses;
        int smem_points = g->persist_smem_points;
        const float* x = g->x;
        const float* y = g->y;
        void* args[] = {(void*)&x, (void*)&y, (void*)&n, (void*)&D, (void*)&epochs, (void*)&lr,
                        (void*)&params, (void*)&exchange, (void*)&barrier_counter, (void*)&losses, (void*)&smem_points};
        cudaCheck(cudaMemsetAsync(barrier_counter, 0, sizeof(unsigned), 0));
        size_t smem = D == 1 ? (size_t)smem_points * sizeof(float2) : 0;
        const void* kernel =
            D == 1 ? (const void*)linreg_persistent_kernel<1> : (const void*)linreg_persistent_kernel<0>;
        cudaCheck(cudaLaunchCooperativeKernel(kernel, g->persist_blocks, persist_threads(D), args, smem, 0));
        cudaCheck(cudaGetLastError());
        return;
    }
    for (int e = 0; e < epochs; e++) linreg_gpu_epoch(g, version, e, lr);
}

// Loss on the held-out rows [n_train, n_points) with the current parameters.
static void linreg_gpu_test_loss(LinregGpu* g) {
    int D = g->n_features, n = g->n_points - g->n_train;
    int rows = linreg_grid_size(n);
    linreg_launch_fused(g->x + (size_t)g->n_train * D, g->y + g->n_train, g->params, n, D, g->partials, rows, 0);
    linreg_update_kernel<<<1, LINREG_THREADS>>>(g->partials, rows, D, n, 0.0f, g->params, g->test_loss, 0);
    cudaCheck(cudaGetLastError());
}

static int first_nonfinite(const std::vector<float>& v) {
    for (size_t i = 0; i < v.size(); i++) {
        if (!std::isfinite(v[i])) return (int)i;
    }
    return -1;
}

// Full training on the GPU: initial parameters, all epochs (timed with CUDA events), then the test loss.
static TrainResult linreg_train_gpu(LinregGpu* g, const TrainConfig* cfg) {
    int D = g->n_features;
    std::vector<float> init(D + 1, cfg->w_init);
    init[D] = cfg->b_init;
    cudaCheck(cudaMemcpy(g->params, init.data(), sizeof(float) * (D + 1), cudaMemcpyHostToDevice));
    // NaN: unwritten shows
    cudaCheck(cudaMemset(g->losses, 0xff, sizeof(float) * (cfg->epochs > 0 ? cfg->epochs : 1)));
    cudaEvent_t start, stop, evaluated;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    cudaCheck(cudaEventCreate(&evaluated));
    cudaCheck(cudaEventRecord(start, 0));
    linreg_gpu_train_epochs(g, cfg->kernel, cfg->epochs, cfg->lr);
    cudaCheck(cudaEventRecord(stop, 0));
    linreg_gpu_test_loss(g);
    cudaCheck(cudaEventRecord(evaluated, 0));
    cudaCheck(cudaEventSynchronize(evaluated));
    TrainResult res;
    cudaCheck(cudaEventElapsedTime(&res.train_ms, start, stop));
    cudaCheck(cudaEventElapsedTime(&res.eval_ms, stop, evaluated));
    res.train_losses.resize(cfg->epochs);
    if (cfg->epochs > 0) {
        cudaCheck(cudaMemcpy(res.train_losses.data(), g->losses, sizeof(float) * cfg->epochs, cudaMemcpyDeviceToHost));
    }
    std::vector<float> params(D + 1);
    cudaCheck(cudaMemcpy(params.data(), g->params, sizeof(float) * (D + 1), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(&res.test_loss, g->test_loss, sizeof(float), cudaMemcpyDeviceToHost));
    res.w.assign(params.begin(), params.begin() + D);
    res.b = params[D];
    res.diverged_epoch = first_nonfinite(res.train_losses);
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    cudaCheck(cudaEventDestroy(evaluated));
    return res;
}

// ----------------------------------------------------------------------------------------------------------------
// CPU path: the same model, loss and update, sums in double (so it agrees with the GPU within fp32 rounding)

static double linreg_cpu_sums(const float* x, const float* y, int n, int D, const float* params, double* sums) {
    for (int j = 0; j < 2 + D; j++) sums[j] = 0.0;
    for (int i = 0; i < n; i++) {
        const float* xi = x + (size_t)i * D;
        float pred = params[D];
        for (int d = 0; d < D; d++) pred += params[d] * xi[d];
        float r = pred - y[i];
        sums[0] += (double)r * r;
        sums[1] += r;
        for (int d = 0; d < D; d++) sums[2 + d] += (double)r * xi[d];
    }
    return sums[0] / n;
}

static TrainResult linreg_train_cpu(const LinregData* data, const TrainConfig* cfg) {
    int D = data->n_features, n = data->n_train;
    std::vector<float> params(D + 1, cfg->w_init);
    params[D] = cfg->b_init;
    std::vector<double> sums(2 + D);
    TrainResult res;
    res.diverged_epoch = -1;
    struct timespec t0, t1, t2;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int e = 0; e < cfg->epochs; e++) {
        float loss = (float)linreg_cpu_sums(data->x, data->y, n, D, params.data(), sums.data());
        res.train_losses.push_back(loss);
        if (!std::isfinite(loss)) {
            res.diverged_epoch = e;
            break;
        }
        for (int d = 0; d < D; d++) params[d] -= cfg->lr * (float)(2.0 * sums[2 + d] / n);
        params[D] -= cfg->lr * (float)(2.0 * sums[1] / n);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    res.test_loss =
        (float)linreg_cpu_sums(data->x + (size_t)n * D, data->y + n, data->n_points - n, D, params.data(), sums.data());
    clock_gettime(CLOCK_MONOTONIC, &t2);
    res.train_ms = (float)((t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6);
    res.eval_ms = (float)((t2.tv_sec - t1.tv_sec) * 1e3 + (t2.tv_nsec - t1.tv_nsec) * 1e-6);
    res.train_losses.resize(cfg->epochs, NAN);
    res.w.assign(params.begin(), params.begin() + D);
    res.b = params[D];
    return res;
}

// ----------------------------------------------------------------------------------------------------------------
// command line: the conventions of the three trainers. Flags are --name value; every flag is one row of the table
// below, which drives the parser, --help ("  --name  help [default]  one of: ...") and the start-up table. A bad
// value is "error: flag --name expects <what>, found '<value>'" and exit 1.
#ifndef TESTING

struct Args {
    std::string data_file, save_data, device = "auto", result_file;
    int points = 5000000, seed = 1337, epochs = 200, kernel = 4, streams = 4, log_every = 20;
    float x_min = 0.0f, x_max = 10.0f, w_true = 0.7f, b_true = 0.3f, noise_std = 0.1f, split = 0.8f;
    float lr = 0.01f, w_init = 0.83f, b_init = 0.7645f;
    std::string generation_flag;  // the last flag given that only generated data uses (--data_file refuses it)
};
// type: 'i' int, 'f' float, 'c' one of the comma-separated choices, 's' string; numbers must lie in [lo, hi]
struct FlagSpec { const char* name; char type; void* ptr; double lo, hi; const char* choices; const char* help; };

static std::vector<FlagSpec> flag_specs(Args& a) {
    const double BIG = 3.0e38;  // a finite float
    return {
        {"data_file", 's', &a.data_file, 0, 0, nullptr,
         "train on this linreg dataset (data/README.md; empty: generate)"},
        {"save_data", 's', &a.save_data, 0, 0, nullptr, "write the generated dataset here, then train on it"},
        {"points", 'i', &a.points, 2, 2000000000, nullptr, "generated points, train + test"},
        {"x_min", 'f', &a.x_min, -BIG, BIG, nullptr, "lower end of the uniform x range of generated data"},
        {"x_max", 'f', &a.x_max, -BIG, BIG, nullptr, "upper end of the x range"},
        {"w_true", 'f', &a.w_true, -BIG, BIG, nullptr, "slope of the generated data"},
        {"b_true", 'f', &a.b_true, -BIG, BIG, nullptr, "intercept of the generated data"},
        {"noise_std", 'f', &a.noise_std, 0, BIG, nullptr, "standard deviation of the Gaussian noise on y"},
        {"split", 'f', &a.split, 0, 1, nullptr, "training fraction of generated points, strictly between 0 and 1"},
        {"seed", 'i', &a.seed, 0, 2147483647, nullptr, "cuRAND seed of the generated data"},
        {"epochs", 'i', &a.epochs, 0, 100000000, nullptr, "full-batch gradient steps"},
        {"lr", 'f', &a.lr, 0, BIG, nullptr, "learning rate, > 0"},
        {"w_init", 'f', &a.w_init, -BIG, BIG, nullptr, "initial value of every weight"},
        {"b_init", 'f', &a.b_init, -BIG, BIG, nullptr, "initial bias"},
        {"kernel", 'i', &a.kernel, 1, 4, nullptr, "GPU kernel version: 1 unfused, 2 fused, 3 streams, 4 persistent"},
        {"streams", 'i', &a.streams, 1, MAX_STREAMS, nullptr, "CUDA streams of version 3"},
        {"device", 'c', &a.device, 0, 0, "auto,cuda,cpu", "auto: CUDA when a device is present, else the CPU"},
        {"log_every", 'i', &a.log_every, 0, 2147483647, nullptr, "print the training loss every N epochs (0: none)"},
        {"result_file", 's', &a.result_file, 0, 0, nullptr,
         "write w, b, every epoch's loss, test loss and timings as JSON"},
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
    printf("usage: ./train_linreg [--flag value ...]\n\nLinear regression by full-batch gradient descent (MSE, SGD), "
           "on the GPU or the CPU. Flags (default in brackets):\n");
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

static Args parse_args(int argc, char** argv) {
    Args a;
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
        for (const char* g : {"points", "x_min", "x_max", "w_true", "b_true", "noise_std", "split", "seed"})
            if (!strcmp(f->name, g)) a.generation_flag = arg;
    }
    if (!(a.lr > 0.0f)) die("flag --lr expects a number > 0, found %g", a.lr);
    if (!(a.split > 0.0f && a.split < 1.0f)) die("flag --split expects a number in (0, 1), found %g", a.split);
    if (!(a.x_max > a.x_min)) die("flag --x_max expects a value > --x_min (%g), found %g", a.x_min, a.x_max);
    if (!a.data_file.empty() && a.generation_flag == "--split")
        die("flag --split applies to generated data only, found it with --data_file (whose header[5] n_train "
                   "sets the split)");
    if (!a.data_file.empty() && !a.generation_flag.empty())
        die("flag %s applies to generated data only, found it with --data_file (the file holds its own points)",
            a.generation_flag.c_str());
    if (a.data_file.empty()) {
        long long n_train = llround((double)a.split * a.points);
        if (n_train < 1 || n_train >= a.points)
            die("flag --split %g of --points %d leaves an empty training or test split", a.split, a.points);
    }
    return a;
}

static int write_result_json(const char* path, const Args* a, const LinregData* d, const TrainResult* r,
                             const char* device, float gen_ms) {
    return write_atomic(path, "--result_file", [&](FILE* f) {
        fprintf(f, "{\n  \"device\": \"%s\",\n  \"kernel\": %d,\n  \"n_points\": %d,\n  \"n_features\": %d,\n"
                "  \"n_train\": %d,\n", device, strcmp(device, "cuda") == 0 ? a->kernel : 0, d->n_points,
                d->n_features, d->n_train);
        fprintf(f, "  \"epochs\": %d,\n  \"lr\": %.9g,\n  \"w\": [", (int)r->train_losses.size(), a->lr);
        for (size_t i = 0; i < r->w.size(); i++) fprintf(f, "%s%.9g", i ? ", " : "", r->w[i]);
        fprintf(f, "],\n  \"b\": %.9g,\n  \"test_loss\": %.9g,\n  \"train_ms\": %.6f,\n  \"eval_ms\": %.6f,\n"
                "  \"datagen_ms\": %.6f,\n",
                r->b, r->test_loss, r->train_ms, r->eval_ms, gen_ms);
        fprintf(f, "  \"diverged_epoch\": %d,\n  \"train_losses\": [", r->diverged_epoch);
        for (size_t i = 0; i < r->train_losses.size(); i++) {
            if (std::isfinite(r->train_losses[i])) fprintf(f, "%s%.9g", i ? ", " : "", r->train_losses[i]);
            else fprintf(f, "%snull", i ? ", " : "");
        }
        return fprintf(f, "]\n}\n") > 0;
    });
}

static void table_rule() { printf("+-----------------------+----------------------------------------------+\n"); }
static void table_row(const char* key, const std::string& value) { printf("| %-21s | %-44s |\n", key, value.c_str()); }

// The outputs before any work: a bad path must not cost the training
static void check_outputs(const Args& a) {
    const std::string* outputs[2] = {&a.save_data, &a.result_file};
    const char* output_flags[2] = {"--save_data", "--result_file"};
    std::string reals[2];
    for (int i = 0; i < 2; i++) {
        std::string e = outputs[i]->empty() ? "" : output_check(outputs[i]->c_str(), output_flags[i], &reals[i]);
        if (!e.empty()) die("%s", e.c_str());
    }
    if (!a.save_data.empty() && !a.result_file.empty() && reals[0] == reals[1])  // the JSON would replace the data
        die("%s: --result_file is the same file as --save_data", a.result_file.c_str());
}

int main(int argc, char** argv) {
    Args a = parse_args(argc, argv);
    check_outputs(a);
    const char* why = NULL;
    int n_devices = cuda_device_count(&why);
    if (a.device == "cuda" && n_devices == 0) {
        fprintf(stderr, "error: --device cuda but no CUDA device is available (%s)\n", why);
        return EXIT_FAILURE;
    }
    if (a.device == "auto" && n_devices == 0)
        printf("no CUDA device found (%s): training on the CPU (--device cpu)\n", why);
    bool use_gpu = a.device != "cpu" && n_devices > 0;
    size_t mem_free0 = 0, mem_total = 0;  // before any allocation: what the run takes is the drop from here
    if (use_gpu) cudaCheck(cudaMemGetInfo(&mem_free0, &mem_total));

    LinregData data;
    float gen_ms = 0.0f;
    float *d_x = NULL, *d_y = NULL;
    if (!a.data_file.empty()) {
        if (linreg_read_dataset(a.data_file.c_str(), &data) != 0) return EXIT_FAILURE;
    } else {
        linreg_generate(&data, a.points, a.split, a.seed, a.x_min, a.x_max, a.w_true, a.b_true, a.noise_std, use_gpu,
                        &gen_ms, &d_x, &d_y);
    }
    if (!a.save_data.empty()) {
        if (linreg_write_dataset(a.save_data.c_str(), &data) != 0) return EXIT_FAILURE;
    }
    TrainConfig cfg = {a.epochs, a.lr, a.w_init, a.b_init, a.kernel, a.streams};

    // the boxed table of the run's settings: the device, every flag, then what the data brought
    std::string device = "cpu";
    if (use_gpu) {
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        device = std::string("cuda (") + prop.name + ")";
    }
    table_rule();
    table_row("device", device);
    for (auto& f : flag_specs(a))
        if (strcmp(f.name, "device") != 0) table_row(f.name, flag_value_str(f));
    table_row("data", a.data_file.empty() ? "generated (cuRAND Philox)" : a.data_file);
    int n_test = data.n_points - data.n_train;
    table_row("train / test points", std::to_string(data.n_train) + " / " + std::to_string(n_test));
    table_row("features", std::to_string(data.n_features));
    if (use_gpu)  // MiB, rounded down
        table_row("GPU memory free/total",
                  std::to_string(mem_free0 >> 20) + " / " + std::to_string(mem_total >> 20) + " MiB");
    table_rule();

    TrainResult res;
    double mem_used = 0;
    if (use_gpu) {
        if (d_x == NULL) {
            size_t nx = (size_t)data.n_points * data.n_features;
            cudaCheck(cudaMalloc(&d_x, sizeof(float) * nx));
            cudaCheck(cudaMalloc(&d_y, sizeof(float) * data.n_points));
            cudaCheck(cudaMemcpy(d_x, data.x, sizeof(float) * nx, cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(d_y, data.y, sizeof(float) * data.n_points, cudaMemcpyHostToDevice));
        }
        LinregGpu g;
        linreg_gpu_build(&g, d_x, d_y, data.n_points, data.n_features, data.n_train, a.epochs, a.streams);
        res = linreg_train_gpu(&g, &cfg);
        size_t mem_free1 = 0;  // everything is still allocated: the run's peak
        cudaCheck(cudaMemGetInfo(&mem_free1, &mem_total));
        mem_used = mem_free1 < mem_free0 ? (double)(mem_free0 - mem_free1) : 0.0;
        linreg_gpu_free(&g);
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_y));
    } else {
        res = linreg_train_cpu(&data, &cfg);
    }

    // The per-epoch lines come from the losses recorded during training: the timed loop never waits on the host,
    // so an epoch's own time is not measured and each line gives the timed run's mean (epochs numbered from 1).
    if (a.log_every > 0 && a.epochs > 0) {
        double ms = res.train_ms / a.epochs, points_per_s = res.train_ms > 0 ? data.n_train / (ms * 1e-3) : 0.0;
        printf("note: the epochs run without waiting on the host: ms/epoch and points/s are the means of the run\n");
        for (int e = 0; e < a.epochs; e++) {
            int n = e + 1;  // the first epoch, every log_every-th and the last
            if (n == 1 || n % a.log_every == 0 || n == a.epochs)
                printf("epoch %6d/%d | train loss %.7f | %.4f ms/epoch | %.4g points/s\n", n, a.epochs,
                       res.train_losses[e], ms, points_per_s);
            if (e == res.diverged_epoch) break;
        }
    }
    int status = EXIT_SUCCESS;
    int last = a.epochs - 1;
    if (res.diverged_epoch >= 0) {
        fprintf(stderr, "error: the training loss became %g in epoch %d; training stopped (try a smaller --lr)\n",
                res.train_losses[res.diverged_epoch], res.diverged_epoch + 1);
        status = EXIT_FAILURE;
    } else if (last >= 1 && res.train_losses[last] > 2.0f * res.train_losses[0]) {
        // gradient descent on the MSE with a stable lr never raises the loss: a rise is divergence, even while finite
        fprintf(stderr, "error: the training loss rose from %g (epoch 1) to %g (epoch %d): gradient descent diverges "
                "at --lr %g (try a smaller --lr)\n", res.train_losses[0], res.train_losses[last], last + 1, a.lr);
        status = EXIT_FAILURE;
    } else if (!std::isfinite(res.test_loss)) {
        fprintf(stderr, "error: the test loss is %g after the last update (try a smaller --lr)\n", res.test_loss);
        status = EXIT_FAILURE;
    }
    printf("w =");
    for (size_t d = 0; d < res.w.size(); d++) printf(" %.7f", res.w[d]);
    printf("\nb = %.7f\n", res.b);
    if (use_gpu && a.data_file.empty()) printf("data generation %.3f ms (GPU, CUDA events)\n", gen_ms);
    printf("training %.3f ms for %d epochs (%.2f us/epoch, %s); test evaluation %.3f ms\n", res.train_ms, a.epochs,
           a.epochs ? 1000.0f * res.train_ms / a.epochs : 0.0f, use_gpu ? "GPU, CUDA events" : "CPU wall clock",
           res.eval_ms);
    if (use_gpu)
        printf("GPU memory: %.0f MiB used by this run (of %.0f MiB; CUDA context excluded)\n", mem_used / 1048576.0,
               mem_total / 1048576.0);
    // the train loss is that of the last epoch's forward pass, before its update
    printf("final | train_loss %.7f | test_loss %.7f | train_ms %.3f\n", a.epochs > 0 ? res.train_losses[last] : NAN,
           res.test_loss, res.train_ms);
    if (!a.result_file.empty() &&
        write_result_json(a.result_file.c_str(), &a, &data, &res, use_gpu ? "cuda" : "cpu", gen_ms) != 0) {
        status = EXIT_FAILURE;
    }
    linreg_data_free(&data);
    return status;
}
#endif  // TESTING
