/*
Test and benchmark harness shared by dev/softmax_forward.cu and dev/softmax_backward.cu: error checking, the
templates their launchers pick kernel instantiations with (by row length, by block size, cluster launch config),
the --test helpers (RNG, input patterns, comparison with the CPU oracle, PASS/FAIL/SKIP tally, the PyTorch fixture
reader), the benchmark helpers (device fill, median timing, copy bandwidth, table and JSON rows) and the command
line both binaries share. No softmax code lives here: each .cu holds its CPU reference, kernels, launchers, dispatcher, its
tests and benchmark, and includes this file at its top.
*/
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#include <sys/stat.h>

// ----------------------------------------------------------------------------------------------------------------
// error checking

#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)
static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
#ifdef CUDA_CHECK_THROWS  // inside PyTorch (dev/torch_ops): an exception the caller turns into a Python error
        throw std::runtime_error(std::string("[CUDA ERROR] ") + call + " at " + file + ":" + std::to_string(line) +
                                 ": " + cudaGetErrorString(err));
#endif
        fprintf(stderr, "[CUDA ERROR] %s at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
}
#define mallocCheck(ptr) do { if ((ptr) == nullptr) { \
    fprintf(stderr, "[malloc ERROR] %s at %s:%d: out of host memory\n", #ptr, __FILE__, __LINE__); exit(EXIT_FAILURE); } } while (0)

// ----------------------------------------------------------------------------------------------------------------
// launch helpers: templates the launchers of both files pick kernel instantiations with (no kernel lives here)

// The stream every launcher of both files launches on: the default stream in the lab binaries, PyTorch's current
// stream when dev/torch_ops calls them.
static cudaStream_t g_stream = 0;

static int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }
static int next_pow2(int v) { int p = 1; while (p < v) p *= 2; return p; }

template <int V> using Int = std::integral_constant<int, V>;

// Calls launch(Int<GROUP>{}, Int<CHUNKS>{}) with the smallest group of lanes (4..32) and float4 per lane that hold a
// row of need 16-byte chunks (the short-row versions: forward 4 and 7, backward 3 and 6); too_long for rows over 256
// chunks.
template <typename F>
static const char* by_row_chunks(int need, const char* too_long, F launch) {
    if (need <= 4) return launch(Int<4>{}, Int<1>{});
    if (need <= 8) return launch(Int<8>{}, Int<1>{});
    if (need <= 16) return launch(Int<16>{}, Int<1>{});
    if (need <= 32) return launch(Int<32>{}, Int<1>{});
    if (need <= 64) return launch(Int<32>{}, Int<2>{});
    if (need <= 128) return launch(Int<32>{}, Int<4>{});
    if (need <= 256) return launch(Int<32>{}, Int<8>{});
    return too_long;
}

// Calls launch(Int<THREADS>{}) for a block size of 128, 256, 512 or 1024 (block and cluster versions); bad_size
// otherwise.
template <typename F>
static const char* by_block_size(int block_size, const char* bad_size, F launch) {
    switch (block_size) {
        case 128: return launch(Int<128>{});
        case 256: return launch(Int<256>{});
        case 512: return launch(Int<512>{});
        case 1024: return launch(Int<1024>{});
        default: return bad_size;
    }
}

// The configuration of a launch of clusters of `cluster` blocks of `threads` threads along x (the cluster versions);
// the caller sets config.gridDim. Not copyable: config.attrs points into the object.
struct ClusterLaunch {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr[1];
    ClusterLaunch(int threads, int cluster) {
        config.blockDim = dim3(threads);
        config.stream = g_stream;
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = cluster;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        config.attrs = attr;
        config.numAttrs = 1;
    }
    ClusterLaunch(const ClusterLaunch&) = delete;
    ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// The configuration of a launch through cudaLaunchKernelEx with optional attributes: a cluster of `cluster` blocks
// along x (0: no cluster attribute) and Programmatic Dependent Launch (pdl: the launch may begin while the previous
// kernel of the stream runs; the kernel must call pdl_wait() before it reads anything that kernel wrote). The caller
// sets config.gridDim. Not copyable: config.attrs points into the object.
struct ExLaunch {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr[2];
    ExLaunch(int threads, int cluster, bool pdl) {
        config.blockDim = dim3(threads);
        config.stream = g_stream;
        config.attrs = attr;
        if (cluster > 0) {
            attr[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
            attr[config.numAttrs].val.clusterDim.x = cluster;
            attr[config.numAttrs].val.clusterDim.y = 1;
            attr[config.numAttrs].val.clusterDim.z = 1;
            config.numAttrs++;
        }
        if (pdl) {
            attr[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr[config.numAttrs].val.programmaticStreamSerializationAllowed = 1;
            config.numAttrs++;
        }
    }
    ExLaunch(const ExLaunch&) = delete;
    ExLaunch& operator=(const ExLaunch&) = delete;
};

// Programmatic Dependent Launch, device side (sm_90; no-ops before, and no-ops for a kernel launched without the
// attribute). pdl_trigger: this block no longer holds back the launch of the next kernel of the stream (its blocks
// may become resident and wait); pdl_wait: blocks until the previous kernel of the stream has completed and its
// writes are visible. A kernel calls pdl_wait() before its first global read and write, so it stays correct after
// any producer, including one that triggers at its very start.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Streaming 16-byte accesses: the input is read once (no L1 allocation, read-only path), the output written once
// (evict-first in L2). p must be 16-byte aligned.
__device__ __forceinline__ float4 ld_stream(const float* p) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void st_stream(float* p, float4 v) {
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
// The same 16-byte accesses without cache hints (forward version 16: the hints' share of version 10's gain).
__device__ __forceinline__ float4 ld_v4(const float* p) {
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void st_v4(float* p, float4 v) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

// Cluster versions (forward and backward): the 16-byte chunks [c0, c1) of a row (off: the row's offset in its
// 16-byte frame) that block `rank` of a cluster of csize blocks holds, equal contiguous slices.
__device__ __forceinline__ void cluster_slice(int off, int cols, int csize, int rank, int& c0, int& c1) {
    int nchunks = (off + cols + 3) / 4;
    int per_block = (nchunks + csize - 1) / csize;
    c0 = rank * per_block;
    c1 = min(c0 + per_block, nchunks);
}

// Allows kernel clusters above the portable 8 blocks; how many clusters of config's shape fit on the device at once.
template <typename K>
static int max_active_clusters(K kernel, const cudaLaunchConfig_t& config) {
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int max_clusters = 0;
    cudaCheck(cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config));
    return max_clusters;
}

#ifndef DEV_KERNELS_ONLY  // dev/torch_ops takes the launch helpers above; the test and benchmark harness and the
                          // command line stay out

// ----------------------------------------------------------------------------------------------------------------
// test and benchmark support

struct Rng {  // splitmix64: fresh streams from a printed seed
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    float uniform() { return (float)((next() >> 40) * (1.0 / 16777216.0)); }  // [0, 1)
    float normal() {
        double u1 = ((next() >> 11) + 1.0) * (1.0 / 9007199254740993.0), u2 = (next() >> 11) * (1.0 / 9007199254740992.0);
        return (float)(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
    }
};

// Input patterns of the tests. Each has a reason to exist:
enum Pattern { RANDN, WIDE, LARGE, NEG_INF, SPECIAL, NUM_PATTERNS };
static const char* pattern_name[] = {"randn*3", "uniform(-80,80)", "large(1e4+randn, -3e38)", "neg_inf", "inf_nan"};

static void fill_input(float* x, int rows, int cols, Pattern p, Rng& rng) {
    size_t n = (size_t)rows * cols;
    for (size_t i = 0; i < n; i++) {
        switch (p) {
            case RANDN: x[i] = 3.0f * rng.normal(); break;                      // typical logits
            case WIDE: x[i] = 160.0f * rng.uniform() - 80.0f; break;            // exp under/overflows without the max shift
            case LARGE: x[i] = rng.uniform() < 0.1f ? -3e38f : 1e4f + rng.normal(); break;  // huge offsets both ways
            case NEG_INF: x[i] = rng.uniform() < 0.3f ? -INFINITY : rng.normal(); break;    // masked attention
            case SPECIAL: x[i] = rng.normal(); break;
            default: break;
        }
    }
    if (p == NEG_INF) {
        for (int c = 0; c < cols; c++) x[c] = -INFINITY;                       // row 0: all -inf (NaN row, as torch)
        if (rows > 2) { for (int c = 0; c < cols; c++) x[(size_t)2 * cols + c] = -INFINITY; x[(size_t)3 * cols - 1] = 1.0f; }  // row 2: one finite
    }
    if (p == SPECIAL) {
        x[rng.next() % cols] = INFINITY;                                        // row 0: +inf -> NaN row (torch)
        if (rows > 1) x[(size_t)cols + rng.next() % cols] = NAN;                 // row 1: NaN -> NaN row
    }
}


// Per element: |out - ref| <= atol + rtol * |ref| (each .cu defines and justifies its tolerances); NaN references
// (NaN rows) must give NaN, and NaN where a number is expected fails (an unwritten, poisoned element). With x (the
// forward pass), -inf inputs must give exactly 0.
struct CompareResult { bool ok; double max_err; size_t max_at; size_t bad_at; const char* why; };

static CompareResult compare(const float* out, const float* ref, size_t n, double atol, double rtol, const float* x = nullptr) {
    CompareResult res = {true, 0.0, 0, 0, ""};
    for (size_t i = 0; i < n; i++) {
        float o = out[i], e = ref[i];
        const char* why = nullptr;
        if (std::isnan(e)) { if (!std::isnan(o)) why = "expected NaN (NaN row)"; }
        else if (std::isnan(o)) why = "NaN where a number was expected (unwritten?)";
        else if (x && x[i] == -INFINITY && o != 0.0f) why = "-inf input must give exact 0";
        else {
            double err = std::fabs((double)o - (double)e);
            if (err > res.max_err) { res.max_err = err; res.max_at = i; }
            if (err > atol + rtol * std::fabs((double)e)) why = "outside atol + rtol*|ref|";
        }
        if (why && res.ok) { res.ok = false; res.bad_at = i; res.why = why; }
    }
    return res;
}

static bool has_gpu(std::string& why) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        why = std::string("no GPU (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ")";
        cudaGetLastError();  // clear the sticky error
        return false;
    }
    if (n == 0) { why = "no GPU (0 CUDA devices)"; return false; }
    return true;
}

// The current device's compute capability (major) and SM count; both stay 0 without a GPU.
static void device_info(int& cc_major, int& num_sms) {
    std::string no_gpu;
    if (has_gpu(no_gpu)) {
        cudaCheck(cudaSetDevice(0));
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        cc_major = prop.major;
        num_sms = prop.multiProcessorCount;
    }
}

// ----------------------------------------------------------------------------------------------------------------
// fixture made by PyTorch (dev/softmax.py --make_fixture): the oracle is checked against torch even without a GPU.
// Layout: the project's binary format (data/README.md, '## softmax fixture'); magic 20260504, version 1.

constexpr int FIXTURE_MAGIC = 20260504, FIXTURE_VERSION = 1;

struct FixtureTensor { std::string name; int dtype; int ndim; int shape[4]; std::vector<float> data; };

// Reads every tensor after checking the header, the table and the file length; on a mismatch returns false with
// the wrong field, the expected and the found value in err.
static bool read_fixture(const char* path, int& n_cases, std::vector<FixtureTensor>& tensors, std::string& err) {
    struct stat st;  // a regular file only: a FIFO would block fopen, a directory would give ftell a huge size
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) { err = std::string(path) + ": not a regular file"; return false; }
    FILE* f = fopen(path, "rb");
    if (!f) { err = std::string("cannot open ") + path; return false; }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char buf[512];
    int32_t header[256];
    if (size < 1024 || fread(header, 4, 256, f) != 256) {
        snprintf(buf, sizeof buf, "%s: file is %ld bytes, shorter than the 1024-byte header", path, size);
        err = buf; fclose(f); return false;
    }
    if (header[0] != FIXTURE_MAGIC || header[1] != FIXTURE_VERSION) {
        snprintf(buf, sizeof buf, "%s: header magic/version %d/%d, expected %d/%d (re-run python3 dev/softmax.py --make_fixture)",
                 path, header[0], header[1], FIXTURE_MAGIC, FIXTURE_VERSION);
        err = buf; fclose(f); return false;
    }
    int count = header[2];
    n_cases = header[3];
    if (count < 0 || count > 1000 || 1024L + 128L * count > size || n_cases < 0 || count != 4 * n_cases) {
        snprintf(buf, sizeof buf, "%s: header[2] tensor count %d / header[3] n_cases %d: expected 4 tensors per case",
                 path, count, n_cases);
        err = buf; fclose(f); return false;
    }
    long total = 1024L + 128L * count;
    tensors.resize(count);
    for (int i = 0; i < count; i++) {
        char entry[128];
        if (fread(entry, 1, 128, f) != 128) { err = "short tensor table"; fclose(f); return false; }
        FixtureTensor& t = tensors[i];
        t.name.assign(entry, strnlen(entry, 96));
        int32_t meta[8];
        memcpy(meta, entry + 96, 32);
        t.dtype = meta[0]; t.ndim = meta[1];
        if (t.dtype != 0 || t.ndim != 2 || meta[2] <= 0 || meta[3] <= 0) {
            snprintf(buf, sizeof buf, "%s: tensor %d (%s): dtype %d ndim %d shape %dx%d, expected float32 (0), 2 dims > 0",
                     path, i, t.name.c_str(), t.dtype, t.ndim, meta[2], meta[3]);
            err = buf; fclose(f); return false;
        }
        t.shape[0] = meta[2]; t.shape[1] = meta[3];
        total += 4L * meta[2] * meta[3];
    }
    if (total != size) {
        snprintf(buf, sizeof buf, "%s: file length %ld bytes, the header and table say %ld", path, size, total);
        err = buf; fclose(f); return false;
    }
    for (int i = 0; i < count; i++) {
        FixtureTensor& t = tensors[i];
        t.data.resize((size_t)t.shape[0] * t.shape[1]);
        if (fread(t.data.data(), 4, t.data.size(), f) != t.data.size()) { err = "short read"; fclose(f); return false; }
    }
    fclose(f);
    // names: case<k>.x, case<k>.y, case<k>.dy, case<k>.dx, all of one shape
    const char* suffix[4] = {"x", "y", "dy", "dx"};
    for (int k = 0; k < n_cases; k++)
        for (int j = 0; j < 4; j++) {
            const FixtureTensor& t = tensors[4 * k + j];
            std::string want = "case" + std::to_string(k) + "." + suffix[j];
            if (t.name != want || t.shape[0] != tensors[4 * k].shape[0] || t.shape[1] != tensors[4 * k].shape[1]) {
                snprintf(buf, sizeof buf, "%s: tensor %d is %s %dx%d, expected %s %dx%d", path, 4 * k + j, t.name.c_str(),
                         t.shape[0], t.shape[1], want.c_str(), tensors[4 * k].shape[0], tensors[4 * k].shape[1]);
                err = buf; return false;
            }
        }
    return true;
}

// ----------------------------------------------------------------------------------------------------------------
// the --test suite

struct Tally { int passed = 0, failed = 0, skipped = 0; };

static void report(Tally& t, bool ok, const std::string& name, const std::string& detail) {
    printf("%s %s: %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
    (ok ? t.passed : t.failed)++;
}
static void skip(Tally& t, const std::string& name, const std::string& why) {
    printf("SKIP %s: %s\n", name.c_str(), why.c_str());
    t.skipped++;
}

// The suite's last line; its exit code (non-zero iff a check failed).
static int tally_end(const Tally& tally) {
    printf("%d passed, %d failed, %d skipped\n", tally.passed, tally.failed, tally.skipped);
    return tally.failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

static std::string describe(const CompareResult& c, int cols, const float* out, const float* ref) {
    char buf[256];
    if (c.ok)
        snprintf(buf, sizeof buf, "max abs err %.3g at (%zu,%zu)", c.max_err, c.max_at / cols, c.max_at % cols);
    else
        snprintf(buf, sizeof buf, "%s at (%zu,%zu): got %.9g expected %.9g (max abs err %.3g)", c.why,
                 c.bad_at / cols, c.bad_at % cols, out[c.bad_at], ref[c.bad_at], c.max_err);
    return buf;
}

// Reads the fixture for the "cpu oracle vs torch fixture" checks; a missing or malformed file is one FAIL.
static bool load_fixture(Tally& tally, const char* path, int& n_cases, std::vector<FixtureTensor>& t) {
    std::string err;
    struct stat st;  // only whether it exists: opening a FIFO would block
    if (stat(path, &st) != 0) { report(tally, false, "cpu oracle vs torch fixture", std::string(path) + " is missing (it is committed; regenerate with python3 dev/softmax.py --make_fixture PATH on the GPU machine)"); return false; }
    if (!read_fixture(path, n_cases, t, err)) { report(tally, false, "cpu oracle vs torch fixture", err); return false; }
    return true;
}

// The shapes of the GPU checks in --test.
struct Shape { int rows, cols; };
// awkward shapes: odd row counts, row lengths 1, 3, not multiples of 4, just past powers of 2, long rows
static const Shape test_shapes[] = {{1, 1}, {7, 1}, {5, 3}, {33, 10}, {17, 31}, {9, 100}, {13, 129}, {11, 1000}, {5, 1023},
                                    {3, 1025}, {7, 4097}, {3, 16385}, {3, 32768}, {5, 65537}, {2, 131073}, {1023, 128}, {4099, 64}};

// ----------------------------------------------------------------------------------------------------------------
// benchmark

// Deterministic device-side fill (no 256 MB host transfer): scale * u + shift, u in [-2, 2] roughly normal.
__global__ void fill_kernel(float* x, size_t n, uint64_t seed, float scale, float shift) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint64_t z = seed + i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // sum of 4 uniform 16-bit values (Irwin-Hall, roughly normal): enough for timing
    float u = ((z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + ((z >> 48) & 0xffff)) / 65536.0f - 2.0f;
    x[i] = scale * u + shift;
}

// Keeps the GPU busy ~2 ms while the host queues a batch of launches, so that host launch overhead is not timed.
__global__ void spin_kernel(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}

// Median time of one launch. After warm-up, each sample times a batch of K launches (K ~ 1 ms of work, at most
// 50) queued behind spin_kernel, between two events; launch(i) must rotate buffers so that data is not in L2.
template <typename F>
static float median_ms(F launch, int& reps_out) {
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    int it = 0;
    for (int w = 0; w < 2; w++) launch(it++);  // warm-up
    cudaCheck(cudaEventRecord(start));
    launch(it++);
    cudaCheck(cudaEventRecord(stop));
    cudaCheck(cudaEventSynchronize(stop));
    float est;
    cudaCheck(cudaEventElapsedTime(&est, start, stop));
    int batch = std::max(1, std::min(50, (int)(1.0f / std::max(est, 1e-3f))));
    std::vector<float> times;
    float total = 0.0f;
    while ((int)times.size() < 7 || (total < 150.0f && times.size() < 30)) {
        if (batch > 1) { spin_kernel<<<1, 1>>>(4000000); cudaCheck(cudaGetLastError()); }
        cudaCheck(cudaEventRecord(start));
        for (int k = 0; k < batch; k++) launch(it++);
        cudaCheck(cudaEventRecord(stop));
        cudaCheck(cudaEventSynchronize(stop));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms / batch);
        total += ms;
        if (times.size() >= 3 && total > 1500.0f) break;  // hopeless versions (v1 on long rows): 3 samples are enough
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    std::sort(times.begin(), times.end());
    reps_out = (int)times.size() * batch;
    return times[times.size() / 2];
}

// Reference line of the benchmark: a plain copy kernel moving the bytes of one tensor of the shape (read n floats,
// write n), shaped as our kernels: 256 threads, 4 float4 per thread with every load issued before the first store,
// streaming hints, the PDL hooks. What a kernel that only moves these bytes reaches at this size.
__global__ void __launch_bounds__(256) copy_kernel(float4* dst, const float4* src, size_t n4) {
    pdl_trigger();
    pdl_wait();
    size_t base = (size_t)blockIdx.x * 1024 + threadIdx.x;
    float4 v[4];
#pragma unroll
    for (int k = 0; k < 4; k++) if (base + 256 * k < n4) v[k] = ld_stream((const float*)(src + base + 256 * k));
#pragma unroll
    for (int k = 0; k < 4; k++) if (base + 256 * k < n4) st_stream((float*)(dst + base + 256 * k), v[k]);
}

// Device copy bandwidth: cudaMemcpy D2D of 512 MiB, bytes read + written, median of the timed copies.
static double copy_gbps() {
    size_t bytes = 512ull << 20;
    void *a, *b;
    cudaCheck(cudaMalloc(&a, bytes));
    cudaCheck(cudaMalloc(&b, bytes));
    cudaCheck(cudaMemset(a, 0, bytes));
    int reps;
    float ms = median_ms([&](int) { cudaCheck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, reps);
    cudaCheck(cudaFree(a));
    cudaCheck(cudaFree(b));
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

struct BenchShape { int rows, cols; };

static bool parse_shapes(const char* s, std::vector<BenchShape>& out) {
    out.clear();
    std::string str(s);
    size_t pos = 0;
    while (pos <= str.size()) {
        size_t comma = str.find(',', pos);
        std::string item = str.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        long long r, c;
        char extra;
        if (sscanf(item.c_str(), "%lldx%lld%c", &r, &c, &extra) != 2 || r < 1 || c < 1 || r > 0x7fffffff || c > 0x7fffffff ||
            r * c > (1ll << 31))
            return false;
        out.push_back({(int)r, (int)c});
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    return !out.empty();
}

// How many buffer sets of set_bytes the benchmark rotates through so that each launch finds its data out of L2.
static int bench_sets(const cudaDeviceProp& prop, size_t set_bytes) {
    return (int)std::min<size_t>(64, std::max<size_t>(1, (4 * (size_t)prop.l2CacheSize + set_bytes - 1) / set_bytes));
}

// The benchmark's output: a table on stdout and, with --bench_json, the same rows as JSON.
struct BenchOutput {
    cudaDeviceProp prop;
    double copy = 0.0;
    FILE* json = nullptr;
    bool first = true;
    double copy_kernel = 0.0, copy_kernel_pdl = 0.0;  // the current shape's copy-kernel reference (bench_copy_refs)
};

// Checks for a GPU, measures the device copy bandwidth, prints the table's header and opens the JSON file. False
// (after a message on stderr) without a GPU or when the file cannot be written.
static bool bench_begin(BenchOutput& b, const char* prog, const char* op, const char* json_path) {
    std::string no_gpu;
    if (!has_gpu(no_gpu)) { fprintf(stderr, "benchmark needs a GPU: %s\n", no_gpu.c_str()); return false; }
    cudaCheck(cudaGetDeviceProperties(&b.prop, 0));
    b.copy = copy_gbps();
    printf("+-----------------------------------------------+\n");
    printf("| %-45s |\n", (std::string(prog) + " benchmark").c_str());
    printf("| device     %-34s |\n", b.prop.name);
    printf("| SMs %-4d  L2 %-5.1f MB  copy BW %7.1f GB/s    |\n", b.prop.multiProcessorCount, b.prop.l2CacheSize / 1e6, b.copy);
    printf("+-----------------------------------------------+\n");
    printf("%-13s %3s %6s %10s %9s %7s  %s\n", "shape", "ver", "block", "time(ms)", "GB/s", "%copy", "check");
    if (json_path) {
        b.json = fopen(json_path, "w");
        if (!b.json) { fprintf(stderr, "cannot open --bench_json %s for writing\n", json_path); return false; }
        fprintf(b.json, "{\"op\": \"%s\", \"device\": \"%s\", \"copy_gbps\": %.1f, \"results\": [\n", op, b.prop.name, b.copy);
    }
    return true;
}

// The same-size references of one shape (a tensor of n floats, nsets rotating buffer pairs; set i: src(i) -> dst(i)):
// cudaMemcpy D2D, and copy_kernel launched plainly and with PDL; printed, kept in b for the JSON rows. Returns the
// cudaMemcpy figure. Bytes: 2 * n * 4 (the copy kernel moves the n / 4 whole float4: 2 * (n / 4) * 16).
template <typename Src, typename Dst>
static double bench_copy_refs(BenchOutput& b, const BenchShape& sh, size_t n, Src src, Dst dst) {
    int reps = 0;
    float ms = median_ms([&](int i) { cudaCheck(cudaMemcpyAsync(dst(i), src(i), n * sizeof(float), cudaMemcpyDeviceToDevice)); }, reps);
    double copy_same = 2.0 * n * sizeof(float) / (ms * 1e-3) / 1e9;
    size_t n4 = n / 4;
    double kernel_gbps[2] = {0.0, 0.0};
    if (n4 > 0) {
        for (int pdl = 0; pdl < 2; pdl++) {
            ExLaunch launch(256, 0, pdl == 1 && b.prop.major >= 9);
            launch.config.gridDim = dim3((unsigned)ceil_div(n4, 1024));
            float kms = median_ms([&](int i) {
                cudaCheck(cudaLaunchKernelEx(&launch.config, copy_kernel, (float4*)dst(i), (const float4*)src(i), n4));
                cudaCheck(cudaGetLastError());
            }, reps);
            kernel_gbps[pdl] = 2.0 * n4 * 16 / (kms * 1e-3) / 1e9;
        }
    }
    b.copy_kernel = kernel_gbps[0];
    b.copy_kernel_pdl = kernel_gbps[1];
    printf("%dx%d: same %zu MB moved by cudaMemcpy D2D %.1f GB/s, copy kernel %.1f GB/s, copy kernel with PDL %.1f GB/s\n",
           sh.rows, sh.cols, n * sizeof(float) >> 20, copy_same, kernel_gbps[0], kernel_gbps[1]);
    return copy_same;
}

static std::string shape_string(const BenchShape& sh) {
    char s[32];
    snprintf(s, sizeof s, "%dx%d", sh.rows, sh.cols);
    return s;
}

static void bench_unsupported(const BenchShape& sh, int v, int bs, const char* why) {
    printf("%-13s %3d %6d  unsupported: %s\n", shape_string(sh).c_str(), v, bs, why);
}

// One timed version and block size: a table row and a JSON record. out and ref are the validated rows (c).
static void bench_row(BenchOutput& b, const BenchShape& sh, int v, int bs, float ms, double gbps, double copy_same, int reps,
                      const CompareResult& c, const float* out, const float* ref, const std::string& choice) {
    printf("%-13s %3d %6d %10.4f %9.1f %6.1f%%  %s%s%s\n", shape_string(sh).c_str(), v, bs, ms, gbps, 100.0 * gbps / b.copy,
           c.ok ? "ok" : describe(c, sh.cols, out, ref).c_str(), choice.empty() ? "" : ", dispatched to ",
           choice.c_str());
    if (b.json) {
        fprintf(b.json, "%s  {\"version\": %d, \"block_size\": %d, \"rows\": %d, \"cols\": %d, \"ms\": %.6f, \"gbps\": %.2f, "
                "\"pct_copy\": %.2f, \"copy_same_size_gbps\": %.1f, \"copy_kernel_gbps\": %.1f, \"copy_kernel_pdl_gbps\": %.1f, "
                "\"reps\": %d, \"valid\": %s, \"dispatched_to\": \"%s\"}",
                b.first ? "" : ",\n", v, bs, sh.rows, sh.cols, ms, gbps, 100.0 * gbps / b.copy, copy_same, b.copy_kernel,
                b.copy_kernel_pdl, reps,
                c.ok ? "true" : "false", choice.c_str());
        b.first = false;
    }
}

// Copies the validation rows of a device matrix: check_rows rows spread evenly over the sh.rows rows.
static void copy_check_rows(float* host, const float* dev, const BenchShape& sh, int check_rows) {
    for (int i = 0; i < check_rows; i++) {
        size_t r = (size_t)((long long)i * sh.rows / check_rows) * sh.cols;
        cudaCheck(cudaMemcpy(&host[(size_t)i * sh.cols], dev + r, sh.cols * sizeof(float), cudaMemcpyDeviceToHost));
    }
}

// Validates and times every version of versions at each of its block sizes (block_sizes_of(v), or the one given by
// --block_size when >= 0) on one shape. launch(v, bs, i) launches on buffer set i and returns why the version does not
// apply, or nullptr; set 0 is validated: poison() fills its output with NaN before the launch, validate() compares
// the output rows it copies into out with ref. bytes: what one launch reads and writes; choice(v): the dispatcher's
// pick for the table ("" for the other versions). Returns whether every validation passed.
template <typename Poison, typename Launch, typename Validate, typename Choice>
static bool bench_versions(BenchOutput& b, const BenchShape& sh, const std::vector<int>& versions, int block_size_flag,
                           std::vector<int> (*block_sizes_of)(int), double bytes, double copy_same, const float* out,
                           const float* ref, Poison poison, Launch launch, Validate validate, Choice choice) {
    bool all_ok = true;
    for (int v : versions) {
        std::vector<int> sizes = block_size_flag >= 0 ? std::vector<int>{block_size_flag} : block_sizes_of(v);
        for (int bs : sizes) {
            poison();
            const char* why = launch(v, bs, 0);
            if (why) { bench_unsupported(sh, v, bs, why); continue; }
            cudaCheck(cudaDeviceSynchronize());
            CompareResult c = validate();
            all_ok = all_ok && c.ok;
            int reps = 0;
            float ms = median_ms([&](int i) { launch(v, bs, i); }, reps);
            double gbps = bytes / (ms * 1e-3) / 1e9;
            bench_row(b, sh, v, bs, ms, gbps, copy_same, reps, c, out, ref, choice(v));
        }
    }
    return all_ok;
}

// Closes the JSON file; the exit code of the benchmark.
static int bench_end(BenchOutput& b, bool all_ok) {
    if (b.json) { fprintf(b.json, "\n]}\n"); fclose(b.json); }
    if (!all_ok) { fprintf(stderr, "validation FAILED for at least one version (see the check column)\n"); return EXIT_FAILURE; }
    return EXIT_SUCCESS;
}

// ----------------------------------------------------------------------------------------------------------------
// command line (the same flags for both binaries; prog is "softmax_forward" or "softmax_backward")

static void usage(const char* prog, int num_versions) {
    printf("usage: ./dev/%s [version] [flags]\n"
           "  version              1..%d: validate and benchmark that version only (default: all)\n"
           "  --test               correctness suite (no benchmarking); GPU checks SKIP without a GPU\n"
           "  --fixture PATH       PyTorch fixture for --test (default dev/fixtures/softmax_fixture.bin)\n"
           "  --seed N             RNG seed of --test inputs (default: from the clock, printed)\n"
           "  --shapes LIST        benchmark shapes RxC,... (default 4096x1024,4096x4096,4096x16384,1024x65536,65536x128)\n"
           "  --versions LIST      benchmark versions, comma separated (default: all, or the positional version)\n"
           "  --block_size N       benchmark one block size (default -1: every block size of the version; 0: its default)\n"
           "  --bench_json FILE    also write the benchmark results as JSON to FILE (default: none)\n"
           "  --help               this text\n", prog, num_versions);
}

static bool parse_int(const char* s, long long lo, long long hi, long long& out) {
    char* end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi) return false;
    out = v;
    return true;
}

static bool parse_versions(const char* s, int num_versions, std::vector<int>& out) {
    out.clear();
    std::string str(s);
    size_t pos = 0;
    while (true) {
        size_t comma = str.find(',', pos);
        std::string item = str.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        long long v;
        if (!parse_int(item.c_str(), 1, num_versions, v)) return false;
        out.push_back((int)v);
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    return true;
}

struct Options {
    bool test = false;
    const char* fixture = "dev/fixtures/softmax_fixture.bin";
    const char* json_path = nullptr;
    uint64_t seed = 0;
    std::vector<int> versions;
    std::vector<BenchShape> shapes = {{4096, 1024}, {4096, 4096}, {4096, 16384}, {1024, 65536}, {65536, 128}};
    int block_size = -1;
};

// Parses the command line; --help prints the usage and exits 0, a bad flag or value exits 1 with a message naming it.
static Options parse_args(int argc, char** argv, const char* prog, int num_versions) {
    Options o;
    o.seed = (uint64_t)std::chrono::high_resolution_clock::now().time_since_epoch().count();
    for (int v = 1; v <= num_versions; v++) o.versions.push_back(v);
    const std::string version_list = "a comma separated list of 1.." + std::to_string(num_versions);
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto value = [&](const char* expected) -> const char* {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: flag %s needs a value (%s)\n", a.c_str(), expected);
                exit(EXIT_FAILURE);
            }
            return argv[++i];
        };
        long long v;
        if (a == "--help" || a == "-h") { usage(prog, num_versions); exit(EXIT_SUCCESS); }
        else if (a == "--test") o.test = true;
        else if (a == "--fixture") o.fixture = value("a file path");
        else if (a == "--bench_json") o.json_path = value("a file path");
        else if (a == "--seed") {
            const char* s = value("an integer >= 0");
            if (!parse_int(s, 0, LLONG_MAX, v)) { fprintf(stderr, "error: --seed expects an integer >= 0, found '%s'\n", s); exit(EXIT_FAILURE); }
            o.seed = (uint64_t)v;
        } else if (a == "--shapes") {
            const char* s = value("RxC,RxC,...");
            if (!parse_shapes(s, o.shapes)) { fprintf(stderr, "error: --shapes expects RxC,... with R, C >= 1 and R*C <= 2^31, found '%s'\n", s); exit(EXIT_FAILURE); }
        } else if (a == "--versions") {
            const char* s = value(version_list.c_str());
            if (!parse_versions(s, num_versions, o.versions)) { fprintf(stderr, "error: --versions expects %s, found '%s'\n", version_list.c_str(), s); exit(EXIT_FAILURE); }
        } else if (a == "--block_size") {
            const char* s = value("-1, 0, or a block size 32..1024");
            if (!parse_int(s, -1, 1024, v) || (v > 0 && v % 32 != 0)) {
                fprintf(stderr, "error: --block_size expects -1, 0 or a multiple of 32 up to 1024, found '%s'\n", s);
                exit(EXIT_FAILURE);
            }
            o.block_size = (int)v;
        } else if (a.size() && a[0] != '-') {
            if (!parse_int(a.c_str(), 1, num_versions, v)) {
                fprintf(stderr, "error: version expects an integer 1..%d, found '%s'\n", num_versions, a.c_str());
                exit(EXIT_FAILURE);
            }
            o.versions = {(int)v};
        } else {
            fprintf(stderr, "error: unknown flag '%s' (see --help)\n", a.c_str());
            exit(EXIT_FAILURE);
        }
    }
    return o;
}
#endif  // DEV_KERNELS_ONLY
