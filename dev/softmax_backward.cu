/*
Kernels for the softmax backward pass over the last dim of a row-major fp32 matrix: with y = softmax(x) and the
incoming gradient dy, dx[r, :] = y[r, :] * (dy[r, :] - sum_c y[r, c] * dy[r, c]).  y, dy, dx: (rows, cols).
This is what torch._softmax_backward_data(dy, y, -1, float32) computes.

Compile (or `make -C dev softmax_backward`):
  nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 softmax_backward.cu -o softmax_backward
No --use_fast_math: results are compared with PyTorch fp32.

Run (from the repo root):
  ./dev/softmax_backward --test      correctness suite: every version and block size vs the CPU oracle at awkward
                                     shapes; the CPU oracle vs a PyTorch fixture (runs without a GPU too)
  ./dev/softmax_backward             validate + benchmark every version on the five issue shapes
  ./dev/softmax_backward 4           the same for version 4 only
  ./dev/softmax_backward --bench_json FILE --shapes 4096x1024 --versions 3,8    timings for dev/softmax.py
  ./dev/softmax_backward --help      every flag with its default

version 1: naive, one thread per row: a pass for the dot product <y, dy>, a pass to write dx (reads y, dy twice)
version 2: one warp per row: coalesced loads, dot product by warp shuffles, a second read of y and dy to write dx
version 3: a group of 4..32 lanes per row with y and dy held in registers, 16-byte loads: one read of each, one
           write (rows up to ~1000 floats)
version 4: one block per row with y and dy held in registers, 16-byte loads, block reduction of the dot product
           (rows up to 16384 floats)
version 5: split row: a thread-block cluster (sm_90) per row, each block holds a slice of y and dy in registers;
           the blocks' partial dot products are exchanged through distributed shared memory (long rows)
version 6: version 3 made persistent (one wave of blocks looping over rows), the next rows' y and dy loaded into
           registers while the current ones are reduced and written
version 7: version 5 made persistent (one wave of clusters looping over rows), the next row's slice loaded before
           the cluster barrier of the current one; a cluster of 1 is a persistent block per row
version 8: the dispatcher the trainers should call: on the first call for a shape it times the applicable versions
           and block sizes (short rows 3/6, medium 4/5/7, long 5/7, always 2) and keeps the fastest

NaN in y or dy (e.g. the NaN row of an all -inf forward row) gives a NaN row, as in torch; y = 0 gives dx = 0.
Rows need not be 16-byte aligned: the 16-byte accesses run over the row's aligned chunks (frame of y) and the first
and last chunk use scalar accesses; dy or dx with a different alignment than y use scalar accesses throughout.
*/
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace cg = cooperative_groups;

// ----------------------------------------------------------------------------------------------------------------
// error checking

#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)
static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "[CUDA ERROR] %s at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
}
#define mallocCheck(ptr) do { if ((ptr) == nullptr) { \
    fprintf(stderr, "[malloc ERROR] %s at %s:%d: out of host memory\n", #ptr, __FILE__, __LINE__); exit(EXIT_FAILURE); } } while (0)

// ----------------------------------------------------------------------------------------------------------------
// CPU reference (the oracle): float64 arithmetic, rounded to float once at the end.

void softmax_backward_cpu(float* dx, const float* y, const float* dy, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const float* yr = y + (size_t)r * cols;
        const float* dyr = dy + (size_t)r * cols;
        double dot = 0.0;
        for (int c = 0; c < cols; c++) dot += (double)yr[c] * dyr[c];
        for (int c = 0; c < cols; c++) dx[(size_t)r * cols + c] = (float)((double)yr[c] * ((double)dyr[c] - dot));
    }
}

// Test input only: y = softmax(x) (float64, as the forward oracle of dev/softmax_forward.cu).
static void softmax_forward_cpu(float* y, const float* x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (size_t)r * cols;
        double m = -INFINITY;
        bool bad = false;
        for (int c = 0; c < cols; c++) { bad = bad || std::isnan(xr[c]) || xr[c] == INFINITY; m = std::max(m, (double)xr[c]); }
        double s = 0.0;
        for (int c = 0; c < cols; c++) s += std::exp((double)xr[c] - m);
        for (int c = 0; c < cols; c++)
            y[(size_t)r * cols + c] = (bad || m == -INFINITY) ? NAN : (float)(std::exp((double)xr[c] - m) / s);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// device helpers

#define FULL_MASK 0xffffffffu

// Sum over groups of GROUP consecutive lanes; every lane ends with its group's sum. The whole warp must call it.
template <int GROUP>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Every thread of the block ends with the block's sum. Called once per kernel (static shared array).
template <int THREADS>
__device__ __forceinline__ float block_sum(float v) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32 of them");
    constexpr int WARPS = THREADS / 32;
    __shared__ float shared[WARPS];
    v = group_sum<32>(v);
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    return group_sum<32>(lane < WARPS ? shared[lane] : 0.0f);
}

// A row seen as 16-byte chunks of y's aligned address frame: chunk c holds row elements [4c - off, 4c - off + 4),
// off = (y row address / 4) % 4. Full chunks move as one float4 when vec (the pointer shares the frame's
// alignment); partial chunks use scalar accesses of their valid elements, so no access leaves the row. Elements
// outside the row load as 0 (no contribution to the dot product).
__device__ __forceinline__ int row_offset(const float* p) { return (int)(((uintptr_t)p >> 2) & 3); }

__device__ __forceinline__ float4 load_chunk(const float* row, int n, int off, int c, bool vec) {
    int lo = 4 * c - off;
    if (vec && lo >= 0 && lo + 4 <= n) return *reinterpret_cast<const float4*>(row + lo);
    float4 v;
    v.x = (unsigned)(lo + 0) < (unsigned)n ? row[lo + 0] : 0.0f;
    v.y = (unsigned)(lo + 1) < (unsigned)n ? row[lo + 1] : 0.0f;
    v.z = (unsigned)(lo + 2) < (unsigned)n ? row[lo + 2] : 0.0f;
    v.w = (unsigned)(lo + 3) < (unsigned)n ? row[lo + 3] : 0.0f;
    return v;
}

__device__ __forceinline__ void store_chunk(float* row, int n, int off, int c, bool vec, float4 v) {
    int lo = 4 * c - off;
    if (vec && lo >= 0 && lo + 4 <= n) { *reinterpret_cast<float4*>(row + lo) = v; return; }
    if ((unsigned)(lo + 0) < (unsigned)n) row[lo + 0] = v.x;
    if ((unsigned)(lo + 1) < (unsigned)n) row[lo + 1] = v.y;
    if ((unsigned)(lo + 2) < (unsigned)n) row[lo + 2] = v.z;
    if ((unsigned)(lo + 3) < (unsigned)n) row[lo + 3] = v.w;
}

template <int N>
__device__ __forceinline__ float thread_dot(const float4 (&a)[N], const float4 (&b)[N]) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < N; k++) s += (a[k].x * b[k].x + a[k].y * b[k].y) + (a[k].z * b[k].z + a[k].w * b[k].w);
    return s;
}

// dx = y * (dy - dot), written into b (dy's registers)
template <int N>
__device__ __forceinline__ void apply_grad(const float4 (&a)[N], float4 (&b)[N], float dot) {
#pragma unroll
    for (int k = 0; k < N; k++) {
        b[k].x = a[k].x * (b[k].x - dot); b[k].y = a[k].y * (b[k].y - dot);
        b[k].z = a[k].z * (b[k].z - dot); b[k].w = a[k].w * (b[k].w - dot);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// GPU kernels

// version 1: one thread per row: dot product pass, then the write pass.
__global__ void softmax_backward_kernel1(float* dx, const float* y, const float* dy, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* yr = y + (size_t)r * cols;
    const float* dyr = dy + (size_t)r * cols;
    float dot = 0.0f;
    for (int c = 0; c < cols; c++) dot += yr[c] * dyr[c];
    for (int c = 0; c < cols; c++) dx[(size_t)r * cols + c] = yr[c] * (dyr[c] - dot);
}

// version 2: one warp per row: coalesced loads, warp-shuffle dot product, second read to write.
__global__ void softmax_backward_kernel2(float* dx, const float* y, const float* dy, int rows, int cols) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows) return;  // the warp's row index is uniform: whole warps leave
    const float* yr = y + (size_t)r * cols;
    const float* dyr = dy + (size_t)r * cols;
    float dot = 0.0f;
    for (int c = lane; c < cols; c += 32) dot += yr[c] * dyr[c];
    dot = group_sum<32>(dot);
    for (int c = lane; c < cols; c += 32) dx[(size_t)r * cols + c] = yr[c] * (dyr[c] - dot);
}

// version 3: GROUP lanes per row, CHUNKS float4 of y and of dy per lane in registers: one read each, one write.
template <int GROUP, int CHUNKS>
__global__ void softmax_backward_kernel3(float* dx, const float* y, const float* dy, int rows, int cols) {
    static_assert(GROUP >= 1 && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0, "a group is a power-of-2 part of a warp");
    int r = blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
    int g = threadIdx.x % GROUP;
    int n = r < rows ? cols : 0;  // no early return: the whole warp takes part in the shuffles
    size_t base = (size_t)(r < rows ? r : 0) * cols;
    int off = row_offset(y + base);
    bool vec_dy = row_offset(dy + base) == off, vec_dx = row_offset(dx + base) == off;
    float4 a[CHUNKS], b[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        a[k] = load_chunk(y + base, n, off, g + GROUP * k, true);
        b[k] = load_chunk(dy + base, n, off, g + GROUP * k, vec_dy);
    }
    float dot = group_sum<GROUP>(thread_dot(a, b));
    apply_grad(a, b, dot);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) store_chunk(dx + base, n, off, g + GROUP * k, vec_dx, b[k]);
}

// version 4: one block of THREADS per row, CHUNKS float4 of y and dy per thread in registers, block reduction.
template <int THREADS, int CHUNKS>
__global__ void __launch_bounds__(THREADS) softmax_backward_kernel4(float* dx, const float* y, const float* dy, int rows, int cols) {
    size_t base = (size_t)blockIdx.x * cols;
    int off = row_offset(y + base);
    bool vec_dy = row_offset(dy + base) == off, vec_dx = row_offset(dx + base) == off;
    float4 a[CHUNKS], b[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        a[k] = load_chunk(y + base, cols, off, threadIdx.x + THREADS * k, true);
        b[k] = load_chunk(dy + base, cols, off, threadIdx.x + THREADS * k, vec_dy);
    }
    float dot = block_sum<THREADS>(thread_dot(a, b));
    apply_grad(a, b, dot);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) store_chunk(dx + base, cols, off, threadIdx.x + THREADS * k, vec_dx, b[k]);
}

// version 5: a cluster of blocks per row (sm_90): each block holds one contiguous slice of the row's chunks, reduces
// its partial dot product, publishes it in shared memory; after a cluster barrier warp 0 sums every block's partial
// through distributed shared memory. A split barrier keeps shared memory alive until all blocks have read it.
template <int THREADS, int CHUNKS>
__global__ void __launch_bounds__(THREADS) softmax_backward_kernel5(float* dx, const float* y, const float* dy, int rows, int cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    int csize = (int)cluster.num_blocks();
    int rank = (int)cluster.block_rank();
    size_t base = (size_t)(blockIdx.x / csize) * cols;
    int off = row_offset(y + base);
    bool vec_dy = row_offset(dy + base) == off, vec_dx = row_offset(dx + base) == off;
    int nchunks = (off + cols + 3) / 4;
    int per_block = (nchunks + csize - 1) / csize;
    int c0 = rank * per_block, c1 = min(c0 + per_block, nchunks);
    float4 a[CHUNKS], b[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        int c = c0 + threadIdx.x + THREADS * k;
        a[k] = c < c1 ? load_chunk(y + base, cols, off, c, true) : make_float4(0.f, 0.f, 0.f, 0.f);
        b[k] = c < c1 ? load_chunk(dy + base, cols, off, c, vec_dy) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float partial = block_sum<THREADS>(thread_dot(a, b));
    __shared__ float block_partial, row_dot;
    if (threadIdx.x == 0) block_partial = partial;
    cluster.sync();
    if (threadIdx.x < 32) {
        float p = (int)threadIdx.x < csize ? *cluster.map_shared_rank(&block_partial, (int)threadIdx.x) : 0.0f;
        p = group_sum<32>(p);
        if (threadIdx.x == 0) row_dot = p;
    }
    __syncthreads();
    auto token = cluster.barrier_arrive();  // this block is done reading the others' shared memory
    apply_grad(a, b, row_dot);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        int c = c0 + threadIdx.x + THREADS * k;
        if (c < c1) store_chunk(dx + base, cols, off, c, vec_dx, b[k]);
    }
    cluster.barrier_wait(std::move(token));  // others may still read block_partial
#else
    __trap();  // the host launches version 5 only on sm_90+
#endif
}

// version 6: version 3 made persistent: one wave of blocks, each warp loops over rows and loads its next rows of y
// and dy into a second set of registers before it reduces and writes the current ones.
template <int GROUP, int CHUNKS>
__global__ void __launch_bounds__(256) softmax_backward_kernel6(float* dx, const float* y, const float* dy, int rows, int cols) {
    constexpr int ROWS_PER_WARP = 32 / GROUP;
    int lane = threadIdx.x % 32, g = lane % GROUP, sub = lane / GROUP;
    int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int step = gridDim.x * (blockDim.x / 32) * ROWS_PER_WARP;
    float4 a[CHUNKS], b[CHUNKS], na[CHUNKS], nb[CHUNKS];
    auto load_rows = [&](float4 (&va)[CHUNKS], float4 (&vb)[CHUNKS], int r) {  // rows past the end load zeros
        int n = r < rows ? cols : 0;
        size_t base = (size_t)(r < rows ? r : 0) * cols;
        int off = row_offset(y + base);
        bool vec_dy = row_offset(dy + base) == off;
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) {
            va[k] = load_chunk(y + base, n, off, g + GROUP * k, true);
            vb[k] = load_chunk(dy + base, n, off, g + GROUP * k, vec_dy);
        }
    };
    int first = warp * ROWS_PER_WARP;  // the warp's first row; the loop count is uniform across the warp
    load_rows(a, b, first + sub);
    for (int base_row = first; base_row < rows; base_row += step) {
        if (base_row + step < rows) load_rows(na, nb, base_row + step + sub);
        int r = base_row + sub;
        int n = r < rows ? cols : 0;
        size_t base = (size_t)(r < rows ? r : 0) * cols;
        int off = row_offset(y + base);
        bool vec_dx = row_offset(dx + base) == off;
        float dot = group_sum<GROUP>(thread_dot(a, b));
        apply_grad(a, b, dot);
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) store_chunk(dx + base, n, off, g + GROUP * k, vec_dx, b[k]);
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) { a[k] = na[k]; b[k] = nb[k]; }
    }
}

// version 7: version 5 made persistent (sm_90): one wave of clusters looping over rows, the next row's slice of y
// and dy loaded before the cluster barrier of the current one; partial dot products alternate between two shared
// slots (a slot is written again only two barriers later, after every block has read it). A cluster of 1 is a
// persistent block per row.
template <int THREADS, int CHUNKS>
__global__ void __launch_bounds__(THREADS) softmax_backward_kernel7(float* dx, const float* y, const float* dy, int rows, int cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    int csize = (int)cluster.num_blocks();
    int rank = (int)cluster.block_rank();
    int n_clusters = gridDim.x / csize;
    __shared__ float block_partial[2];
    __shared__ float row_dot;
    float4 a[CHUNKS], b[CHUNKS], na[CHUNKS], nb[CHUNKS];
    auto slice = [&](int r, int& off, int& c0, int& c1) {
        off = row_offset(y + (size_t)r * cols);
        int nchunks = (off + cols + 3) / 4;
        int per_block = (nchunks + csize - 1) / csize;
        c0 = rank * per_block;
        c1 = min(c0 + per_block, nchunks);
    };
    auto load_slice = [&](float4 (&va)[CHUNKS], float4 (&vb)[CHUNKS], int r) {
        int off, c0, c1;
        slice(r, off, c0, c1);
        size_t base = (size_t)r * cols;
        bool vec_dy = row_offset(dy + base) == off;
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) {
            int c = c0 + threadIdx.x + THREADS * k;
            va[k] = c < c1 ? load_chunk(y + base, cols, off, c, true) : make_float4(0.f, 0.f, 0.f, 0.f);
            vb[k] = c < c1 ? load_chunk(dy + base, cols, off, c, vec_dy) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    int r = blockIdx.x / csize;  // every block of a cluster walks the same rows: the barrier counts match
    if (r < rows) load_slice(a, b, r);
    for (int parity = 0; r < rows; r += n_clusters, parity ^= 1) {
        if (r + n_clusters < rows) load_slice(na, nb, r + n_clusters);
        float partial = block_sum<THREADS>(thread_dot(a, b));
        if (threadIdx.x == 0) block_partial[parity] = partial;
        cluster.sync();
        if (threadIdx.x < 32) {
            float p = (int)threadIdx.x < csize ? *cluster.map_shared_rank(&block_partial[parity], (int)threadIdx.x) : 0.0f;
            p = group_sum<32>(p);
            if (threadIdx.x == 0) row_dot = p;
        }
        __syncthreads();
        apply_grad(a, b, row_dot);
        int off, c0, c1;
        slice(r, off, c0, c1);
        size_t base = (size_t)r * cols;
        bool vec_dx = row_offset(dx + base) == off;
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) {
            int c = c0 + threadIdx.x + THREADS * k;
            if (c < c1) store_chunk(dx + base, cols, off, c, vec_dx, b[k]);
        }
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) { a[k] = na[k]; b[k] = nb[k]; }
    }
    cluster.sync();  // keep this block's shared memory alive until every block of the cluster has read it
#else
    __trap();  // the host launches version 7 only on sm_90+
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// launchers. Each returns nullptr on success, or why the version does not handle this shape / device.

static int g_cc_major = 0;  // compute capability of the current device, set in main

static int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }
static int next_pow2(int v) { int p = 1; while (p < v) p *= 2; return p; }

// Number of 16-byte chunks a row of y spans in the worst case (rows start at 4-byte offsets 0..3 within 16 bytes
// unless y is 16-byte aligned and cols % 4 == 0).
static int max_row_chunks(const float* y, int cols) {
    int max_off = ((uintptr_t)y % 16 == 0 && cols % 4 == 0) ? 0 : 3;
    return (max_off + cols + 3) / 4;
}

static const char* launch_backward1(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    softmax_backward_kernel1<<<ceil_div(rows, block_size), block_size>>>(dx, y, dy, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward2(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    softmax_backward_kernel2<<<ceil_div((long long)rows * 32, block_size), block_size>>>(dx, y, dy, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

template <int GROUP, int CHUNKS>
static const char* launch3(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    // 8 chunks of y and dy per lane take ~93 registers: 1024 threads would exceed the 64K register file
    if (CHUNKS == 8 && block_size > 512) return "the 8-chunk variant runs at most 512 threads per block";
    softmax_backward_kernel3<GROUP, CHUNKS><<<ceil_div(rows, block_size / GROUP), block_size>>>(dx, y, dy, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward3(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    int need = max_row_chunks(y, cols);
    if (need <= 4) return launch3<4, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 8) return launch3<8, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 16) return launch3<16, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 32) return launch3<32, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 64) return launch3<32, 2>(dx, y, dy, rows, cols, block_size);
    if (need <= 128) return launch3<32, 4>(dx, y, dy, rows, cols, block_size);
    if (need <= 256) return launch3<32, 8>(dx, y, dy, rows, cols, block_size);
    return "row longer than 256 chunks of 16 bytes (version 3 is for short rows)";
}

template <int THREADS>
static const char* launch4_threads(float* dx, const float* y, const float* dy, int rows, int cols) {
    int per_thread = next_pow2(ceil_div(max_row_chunks(y, cols), THREADS));
    switch (per_thread) {
        case 1: softmax_backward_kernel4<THREADS, 1><<<rows, THREADS>>>(dx, y, dy, rows, cols); break;
        case 2: softmax_backward_kernel4<THREADS, 2><<<rows, THREADS>>>(dx, y, dy, rows, cols); break;
        case 4: softmax_backward_kernel4<THREADS, 4><<<rows, THREADS>>>(dx, y, dy, rows, cols); break;
        default: return "row does not fit in the registers of one block at this block size (max 4 float4 of y and dy per thread)";
    }
    cudaCheck(cudaGetLastError());
    return nullptr;
}

// block_size 0 picks the smallest block that holds the row in at most 2 float4 (of y and of dy) per thread.
static const char* launch_backward4(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    if (block_size == 0) block_size = std::min(1024, std::max(128, next_pow2(ceil_div(max_row_chunks(y, cols), 2))));
    switch (block_size) {
        case 128: return launch4_threads<128>(dx, y, dy, rows, cols);
        case 256: return launch4_threads<256>(dx, y, dy, rows, cols);
        case 512: return launch4_threads<512>(dx, y, dy, rows, cols);
        case 1024: return launch4_threads<1024>(dx, y, dy, rows, cols);
        default: return "version 4 block size must be 128, 256, 512 or 1024";
    }
}

constexpr int CHUNKS5 = 2;       // float4 of y and of dy per thread in version 5: 16 floats of registers
constexpr int MAX_CLUSTER = 16;  // H100 allows 16 with the non-portable attribute (8 is portable)

template <int THREADS>
static const char* launch5_threads(float* dx, const float* y, const float* dy, int rows, int cols) {
    if (g_cc_major < 9) return "thread-block clusters need sm_90";
    int cluster = next_pow2(ceil_div(max_row_chunks(y, cols), THREADS * CHUNKS5));
    if (cluster > MAX_CLUSTER) return "row longer than 16 blocks of registers at this block size";
    if ((long long)rows * cluster > 0x7fffffffLL) return "grid too large";
    auto kernel = softmax_backward_kernel5<THREADS, CHUNKS5>;
    static int checked_cluster = 0, schedulable = 0;  // the attribute and occupancy query once per cluster size
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((unsigned)(rows * cluster));
    config.blockDim = dim3(THREADS);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    if (checked_cluster != cluster) {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        int max_clusters = 0;
        cudaCheck(cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config));
        checked_cluster = cluster;
        schedulable = max_clusters > 0;
    }
    if (!schedulable) return "this cluster size cannot be scheduled on the device";
    cudaCheck(cudaLaunchKernelEx(&config, kernel, dx, y, dy, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward5(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    if (block_size == 0) block_size = 512;
    switch (block_size) {
        case 128: return launch5_threads<128>(dx, y, dy, rows, cols);
        case 256: return launch5_threads<256>(dx, y, dy, rows, cols);
        case 512: return launch5_threads<512>(dx, y, dy, rows, cols);
        case 1024: return launch5_threads<1024>(dx, y, dy, rows, cols);
        default: return "version 5 block size must be 128, 256, 512 or 1024";
    }
}

static int g_num_sms = 0;  // set in main

template <int GROUP, int CHUNKS>
static const char* launch6(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    auto kernel = softmax_backward_kernel6<GROUP, CHUNKS>;
    static int per_sm[1025] = {0};  // occupancy, queried once per block size
    if (per_sm[block_size] == 0) cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm[block_size], kernel, block_size, 0));
    if (per_sm[block_size] == 0) return "no block of this size fits on an SM";
    int grid = std::max(1, std::min(ceil_div(rows, block_size / GROUP), per_sm[block_size] * g_num_sms));
    kernel<<<grid, block_size>>>(dx, y, dy, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward6(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    if (block_size > 256) return "version 6 runs at most 256 threads per block";
    int need = max_row_chunks(y, cols);
    if (need <= 4) return launch6<4, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 8) return launch6<8, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 16) return launch6<16, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 32) return launch6<32, 1>(dx, y, dy, rows, cols, block_size);
    if (need <= 64) return launch6<32, 2>(dx, y, dy, rows, cols, block_size);
    if (need <= 128) return launch6<32, 4>(dx, y, dy, rows, cols, block_size);
    if (need <= 256) return launch6<32, 8>(dx, y, dy, rows, cols, block_size);
    return "row longer than 256 chunks of 16 bytes (version 6 is for short rows)";
}

constexpr int CHUNKS7 = 2;  // float4 of y and of dy per thread and row in version 7 (twice that with the prefetch)

template <int THREADS>
static const char* launch7_threads(float* dx, const float* y, const float* dy, int rows, int cols) {
    if (g_cc_major < 9) return "thread-block clusters need sm_90";
    int cluster = next_pow2(ceil_div(max_row_chunks(y, cols), THREADS * CHUNKS7));
    if (cluster > MAX_CLUSTER) return "row longer than 16 blocks of registers at this block size";
    auto kernel = softmax_backward_kernel7<THREADS, CHUNKS7>;
    static int max_clusters[MAX_CLUSTER + 1] = {0};  // clusters resident at once, queried once per cluster size
    cudaLaunchConfig_t config = {};
    config.blockDim = dim3(THREADS);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    if (max_clusters[cluster] == 0) {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        config.gridDim = dim3((unsigned)(cluster * 1024));
        cudaCheck(cudaOccupancyMaxActiveClusters(&max_clusters[cluster], kernel, &config));
        if (max_clusters[cluster] == 0) max_clusters[cluster] = -1;
    }
    if (max_clusters[cluster] < 0) return "this cluster size cannot be scheduled on the device";
    config.gridDim = dim3((unsigned)(std::min(rows, max_clusters[cluster]) * cluster));
    cudaCheck(cudaLaunchKernelEx(&config, kernel, dx, y, dy, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward7(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    if (block_size == 0) block_size = 512;
    switch (block_size) {
        case 128: return launch7_threads<128>(dx, y, dy, rows, cols);
        case 256: return launch7_threads<256>(dx, y, dy, rows, cols);
        case 512: return launch7_threads<512>(dx, y, dy, rows, cols);
        case 1024: return launch7_threads<1024>(dx, y, dy, rows, cols);
        default: return "version 7 block size must be 128, 256, 512 or 1024";
    }
}

static const char* softmax_backward(int version, float* dx, const float* y, const float* dy, int rows, int cols, int block_size);

// version 8: the dispatcher. On the first call for a (rows, cols, alignment) it times the candidate versions and block
// sizes for that row length (one warm-up and three timed launches each, on the caller's buffers; every candidate
// writes the full output, the chosen one runs last) and caches the fastest; later calls launch it directly.
struct BackwardChoice { int rows, cols, align, version, block_size; };
static std::vector<BackwardChoice> g_backward8_cache;

static const char* launch_backward8(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    (void)block_size;
    int align = (int)((uintptr_t)y % 16) * 256 + (int)((uintptr_t)dy % 16) * 16 + (int)((uintptr_t)dx % 16);
    for (const BackwardChoice& c : g_backward8_cache)
        if (c.rows == rows && c.cols == cols && c.align == align) return softmax_backward(c.version, dx, y, dy, rows, cols, c.block_size);
    int need = max_row_chunks(y, cols);
    std::vector<std::pair<int, int>> candidates;
    if (need <= 256) candidates = {{3, 64}, {3, 256}, {6, 128}, {6, 256}};
    else if (need <= 4096) candidates = {{4, 128}, {4, 256}, {4, 512}, {4, 1024}, {5, 256}, {5, 512}, {7, 128}, {7, 256}, {7, 512}};
    else candidates = {{5, 256}, {5, 512}, {7, 128}, {7, 256}, {7, 512}, {7, 1024}};
    candidates.push_back({2, 256});  // always applies
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    BackwardChoice best = {rows, cols, align, 2, 256};
    float best_ms = INFINITY;
    for (auto [version, bs] : candidates) {
        if (softmax_backward(version, dx, y, dy, rows, cols, bs)) continue;  // does not apply (shape, device)
        cudaCheck(cudaEventRecord(start));
        for (int k = 0; k < 3; k++) softmax_backward(version, dx, y, dy, rows, cols, bs);
        cudaCheck(cudaEventRecord(stop));
        cudaCheck(cudaEventSynchronize(stop));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        if (ms < best_ms) { best_ms = ms; best.version = version; best.block_size = bs; }
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    g_backward8_cache.push_back(best);
    return softmax_backward(best.version, dx, y, dy, rows, cols, best.block_size);
}

// Which version and block size the dispatcher picked for a shape (for the benchmark's report); "" if not tuned yet.
static std::string backward8_choice(int rows, int cols) {
    for (const BackwardChoice& c : g_backward8_cache)
        if (c.rows == rows && c.cols == cols) return "v" + std::to_string(c.version) + " b" + std::to_string(c.block_size);
    return "";
}

constexpr int NUM_VERSIONS = 8;

// The dispatcher. block_size 0 = the version's default.
static const char* softmax_backward(int version, float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    switch (version) {
        case 1: return launch_backward1(dx, y, dy, rows, cols, block_size ? block_size : 128);
        case 2: return launch_backward2(dx, y, dy, rows, cols, block_size ? block_size : 256);
        case 3: return launch_backward3(dx, y, dy, rows, cols, block_size ? block_size : 256);
        case 4: return launch_backward4(dx, y, dy, rows, cols, block_size);
        case 5: return launch_backward5(dx, y, dy, rows, cols, block_size);
        case 6: return launch_backward6(dx, y, dy, rows, cols, block_size ? block_size : 256);
        case 7: return launch_backward7(dx, y, dy, rows, cols, block_size);
        case 8: return launch_backward8(dx, y, dy, rows, cols, block_size);
        default:
            fprintf(stderr, "Invalid version %d: expected 1..%d\n", version, NUM_VERSIONS);
            exit(EXIT_FAILURE);
    }
}

// Block sizes checked in --test and timed in the benchmark (0 = the version's default).
static std::vector<int> block_sizes_of(int version) {
    switch (version) {
        case 3: return {64, 256, 512};
        case 4: case 5: case 7: return {128, 256, 512, 1024};
        case 6: return {128, 256};
        default: return {0};
    }
}

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

// Tolerance of a float32 backward against the float64 oracle, per element: |dx - ref| <= ATOL + RTOL * |ref|.
//  ATOL 1e-6: dx_i = y_i * (dy_i - <y, dy>) cancels when dy_i is close to <y, dy>; there the error is
//  y_i * (error of <y, dy> + eps * |dy_i|), with y_i <= 1, |dy_i| <= ~5 (randn) and the fp32 dot product's error
//  well under 1e-6 at our sizes: at most ~6e-7 + 2e-7.
//  RTOL 2e-6: without cancellation, a few roundings (product, difference, product: ~3 eps = 3.6e-7), 5x margin.
// NaN references (NaN rows of y) must give NaN.
constexpr double ATOL = 1e-6, RTOL = 2e-6;

struct CompareResult { bool ok; double max_err; size_t max_at; size_t bad_at; const char* why; };

static CompareResult compare(const float* out, const float* ref, size_t n) {
    CompareResult res = {true, 0.0, 0, 0, ""};
    for (size_t i = 0; i < n; i++) {
        float o = out[i], e = ref[i];
        const char* why = nullptr;
        if (std::isnan(e)) { if (!std::isnan(o)) why = "expected NaN (NaN row)"; }
        else if (std::isnan(o)) why = "NaN where a number was expected (unwritten?)";
        else {
            double err = std::fabs((double)o - (double)e);
            if (err > res.max_err) { res.max_err = err; res.max_at = i; }
            if (err > ATOL + RTOL * std::fabs((double)e)) why = "outside atol + rtol*|ref|";
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

// ----------------------------------------------------------------------------------------------------------------
// fixture made by PyTorch (dev/softmax.py --make_fixture): the oracle is checked against torch even without a GPU.
// Layout: the project's binary format (data/README.md, '## softmax fixture'); magic 20260504, version 1.

constexpr int FIXTURE_MAGIC = 20260504, FIXTURE_VERSION = 1;

struct FixtureTensor { std::string name; int dtype; int ndim; int shape[4]; std::vector<float> data; };

// Reads every tensor after checking the header, the table and the file length; on a mismatch returns false with
// the wrong field, the expected and the found value in err.
static bool read_fixture(const char* path, int& n_cases, std::vector<FixtureTensor>& tensors, std::string& err) {
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

static std::string describe(const CompareResult& c, int cols, const float* out, const float* ref) {
    char buf[256];
    if (c.ok)
        snprintf(buf, sizeof buf, "max abs err %.3g at (%zu,%zu)", c.max_err, c.max_at / cols, c.max_at % cols);
    else
        snprintf(buf, sizeof buf, "%s at (%zu,%zu): got %.9g expected %.9g (max abs err %.3g)", c.why,
                 c.bad_at / cols, c.bad_at % cols, out[c.bad_at], ref[c.bad_at], c.max_err);
    return buf;
}

static void test_fixture(Tally& tally, const char* path) {
    int n_cases = 0;
    std::vector<FixtureTensor> t;
    std::string err;
    FILE* probe = fopen(path, "rb");
    if (!probe) { report(tally, false, "cpu oracle vs torch fixture", std::string(path) + " is missing (it is committed; regenerate with python3 dev/softmax.py --make_fixture PATH on the GPU machine)"); return; }
    fclose(probe);
    if (!read_fixture(path, n_cases, t, err)) { report(tally, false, "cpu oracle vs torch fixture", err); return; }
    for (int k = 0; k < n_cases; k++) {
        const FixtureTensor& y = t[4 * k + 1];
        const FixtureTensor& dy = t[4 * k + 2];
        const FixtureTensor& dx = t[4 * k + 3];
        int rows = y.shape[0], cols = y.shape[1];
        std::vector<float> out(y.data.size());
        softmax_backward_cpu(out.data(), y.data.data(), dy.data.data(), rows, cols);
        CompareResult c = compare(out.data(), dx.data.data(), out.size());
        char name[128];
        snprintf(name, sizeof name, "cpu oracle vs torch softmax backward fixture case%d %dx%d", k, rows, cols);
        report(tally, c.ok, name, describe(c, cols, out.data(), dx.data.data()));
    }
}

// Properties of the oracle itself (no GPU, no fixture): sum_c dx = 0 for a softmax y (the gradient is orthogonal to
// the all-ones direction), and dy + const gives the same dx.
static void test_oracle_properties(Tally& tally, Rng& rng) {
    int rows = 5, cols = 777;
    std::vector<float> x((size_t)rows * cols), y(x.size()), dy(x.size()), dy2(x.size()), dx(x.size()), dx2(x.size());
    fill_input(x.data(), rows, cols, RANDN, rng);
    softmax_forward_cpu(y.data(), x.data(), rows, cols);
    for (size_t i = 0; i < dy.size(); i++) {
        dy[i] = std::round(rng.normal() * 1024.0f) / 1024.0f;  // on a 2^-10 grid: dy + 8 is exact in fp32
        dy2[i] = dy[i] + 8.0f;
    }
    softmax_backward_cpu(dx.data(), y.data(), dy.data(), rows, cols);
    softmax_backward_cpu(dx2.data(), y.data(), dy2.data(), rows, cols);
    double worst = 0.0;
    for (int r = 0; r < rows; r++) {
        double s = 0.0;
        for (int c = 0; c < cols; c++) s += dx[(size_t)r * cols + c];
        worst = std::max(worst, std::fabs(s));
    }
    // sum y = 1 up to the float rounding of y (cols * eps/2 * max y), times |<y, dy>| <= 5: well under 1e-5
    report(tally, worst < 1e-5, "cpu oracle: dx sums to 0 over a row", "max |sum dx| = " + std::to_string(worst));
    // dx2 - dx = y * 8 * (1 - sum y): at most 8 * (rounding of sum y) per element
    CompareResult c = compare(dx2.data(), dx.data(), dx.size());
    report(tally, c.ok, "cpu oracle: dy + 8 gives the same dx", describe(c, cols, dx2.data(), dx.data()));
}

static int run_tests(const char* fixture_path, uint64_t seed) {
    Tally tally;
    Rng rng{seed};
    printf("softmax_backward --test (seed %llu)\n", (unsigned long long)seed);
    test_oracle_properties(tally, rng);
    test_fixture(tally, fixture_path);

    struct Shape { int rows, cols; };
    // awkward shapes: odd row counts, row lengths 1, 3, not multiples of 4, just past powers of 2, long rows
    const Shape shapes[] = {{1, 1}, {7, 1}, {5, 3}, {33, 10}, {17, 31}, {9, 100}, {13, 129}, {11, 1000}, {5, 1023},
                            {3, 1025}, {7, 4097}, {3, 16385}, {3, 32768}, {5, 65537}, {2, 131073}, {1023, 128}, {4099, 64}};
    std::string no_gpu;
    if (!has_gpu(no_gpu)) {
        for (int v = 1; v <= NUM_VERSIONS; v++) skip(tally, "gpu backward version " + std::to_string(v), no_gpu);
    } else {
        for (const Shape& sh : shapes) {
            size_t n = (size_t)sh.rows * sh.cols;
            std::vector<float> x(n), y(n), dy(n), ref(n), out(n);
            float *d_y, *d_dy, *d_dx;
            cudaCheck(cudaMalloc(&d_y, n * sizeof(float)));
            cudaCheck(cudaMalloc(&d_dy, n * sizeof(float)));
            cudaCheck(cudaMalloc(&d_dx, n * sizeof(float)));
            for (int p = 0; p < NUM_PATTERNS; p++) {
                if (n > 200000 && p != RANDN && p != NEG_INF) continue;  // keep the suite fast
                fill_input(x.data(), sh.rows, sh.cols, (Pattern)p, rng);
                softmax_forward_cpu(y.data(), x.data(), sh.rows, sh.cols);  // a real softmax output (0 at -inf, NaN rows)
                for (size_t i = 0; i < n; i++) dy[i] = rng.normal();
                softmax_backward_cpu(ref.data(), y.data(), dy.data(), sh.rows, sh.cols);
                cudaCheck(cudaMemcpy(d_y, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
                cudaCheck(cudaMemcpy(d_dy, dy.data(), n * sizeof(float), cudaMemcpyHostToDevice));
                for (int v = 1; v <= NUM_VERSIONS; v++) {
                    for (int bs : block_sizes_of(v)) {
                        char name[160];
                        snprintf(name, sizeof name, "backward v%d%s%s %dx%d y=softmax(%s)", v, bs ? " block " : "",
                                 bs ? std::to_string(bs).c_str() : "", sh.rows, sh.cols, pattern_name[p]);
                        cudaCheck(cudaMemset(d_dx, 0xff, n * sizeof(float)));  // poison: 0xffffffff is a NaN
                        const char* why = softmax_backward(v, d_dx, d_y, d_dy, sh.rows, sh.cols, bs);
                        if (why) { skip(tally, name, why); continue; }
                        cudaCheck(cudaDeviceSynchronize());
                        cudaCheck(cudaMemcpy(out.data(), d_dx, n * sizeof(float), cudaMemcpyDeviceToHost));
                        CompareResult c = compare(out.data(), ref.data(), n);
                        report(tally, c.ok, name, describe(c, sh.cols, out.data(), ref.data()));
                    }
                }
            }
            // unaligned rows: y 1 float past a 16-byte boundary, dy and dx with the same or another misalignment
            if (sh.cols >= 3 && n < 200000) {
                float* buf;
                cudaCheck(cudaMalloc(&buf, 3 * (n + 8) * sizeof(float)));
                float *y1 = buf + 1, *dy1 = buf + (n + 8) + 2, *dx_base = buf + 2 * (n + 8);
                fill_input(x.data(), sh.rows, sh.cols, RANDN, rng);
                softmax_forward_cpu(y.data(), x.data(), sh.rows, sh.cols);
                for (size_t i = 0; i < n; i++) dy[i] = rng.normal();
                softmax_backward_cpu(ref.data(), y.data(), dy.data(), sh.rows, sh.cols);
                cudaCheck(cudaMemcpy(y1, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
                cudaCheck(cudaMemcpy(dy1, dy.data(), n * sizeof(float), cudaMemcpyHostToDevice));
                for (int v = 3; v <= NUM_VERSIONS; v++) {
                    for (int dxoff : {1, 3}) {
                        char name[160];
                        snprintf(name, sizeof name, "backward v%d %dx%d y at +4 bytes, dy at +8, dx at +%d", v, sh.rows, sh.cols, 4 * dxoff);
                        cudaCheck(cudaMemset(dx_base, 0xff, (n + 8) * sizeof(float)));
                        const char* why = softmax_backward(v, dx_base + dxoff, y1, dy1, sh.rows, sh.cols, 0);
                        if (why) { skip(tally, name, why); continue; }
                        cudaCheck(cudaDeviceSynchronize());
                        std::vector<float> guard(n + 8);
                        cudaCheck(cudaMemcpy(guard.data(), dx_base, (n + 8) * sizeof(float), cudaMemcpyDeviceToHost));
                        CompareResult c = compare(guard.data() + dxoff, ref.data(), n);
                        // the floats just before and after the output must still hold the poison
                        if (c.ok && !(std::isnan(guard[dxoff - 1]) && std::isnan(guard[dxoff + n]))) { c.ok = false; c.why = "wrote outside the output"; }
                        report(tally, c.ok, name, describe(c, sh.cols, guard.data() + dxoff, ref.data()));
                    }
                }
                cudaCheck(cudaFree(buf));
            }
            cudaCheck(cudaFree(d_y));
            cudaCheck(cudaFree(d_dy));
            cudaCheck(cudaFree(d_dx));
        }
    }
    printf("%d passed, %d failed, %d skipped\n", tally.passed, tally.failed, tally.skipped);
    return tally.failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

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

static int run_benchmark(const std::vector<int>& versions, const std::vector<BenchShape>& shapes, int block_size_flag,
                         const char* json_path) {
    std::string no_gpu;
    if (!has_gpu(no_gpu)) { fprintf(stderr, "benchmark needs a GPU: %s\n", no_gpu.c_str()); return EXIT_FAILURE; }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    double copy = copy_gbps();
    printf("+-----------------------------------------------+\n");
    printf("| softmax_backward benchmark                    |\n");
    printf("| device     %-34s |\n", prop.name);
    printf("| SMs %-4d  L2 %-5.1f MB  copy BW %7.1f GB/s    |\n", prop.multiProcessorCount, prop.l2CacheSize / 1e6, copy);
    printf("+-----------------------------------------------+\n");
    printf("%-13s %3s %6s %10s %9s %7s  %s\n", "shape", "ver", "block", "time(ms)", "GB/s", "%copy", "check");
    FILE* json = nullptr;
    if (json_path) {
        json = fopen(json_path, "w");
        if (!json) { fprintf(stderr, "cannot open --bench_json %s for writing\n", json_path); return EXIT_FAILURE; }
        fprintf(json, "{\"op\": \"backward\", \"device\": \"%s\", \"copy_gbps\": %.1f, \"results\": [\n", prop.name, copy);
    }
    bool first = true, all_ok = true;
    for (const BenchShape& sh : shapes) {
        size_t n = (size_t)sh.rows * sh.cols;
        size_t set_bytes = 3 * n * sizeof(float);
        // rotate through enough (y, dy, dx) triples that each launch finds its data out of L2
        int nsets = (int)std::min<size_t>(64, std::max<size_t>(1, (4 * (size_t)prop.l2CacheSize + set_bytes - 1) / set_bytes));
        std::vector<float*> ys(nsets), dys(nsets), dxs(nsets);
        for (int i = 0; i < nsets; i++) {
            cudaCheck(cudaMalloc(&ys[i], n * sizeof(float)));
            cudaCheck(cudaMalloc(&dys[i], n * sizeof(float)));
            cudaCheck(cudaMalloc(&dxs[i], n * sizeof(float)));
            // y in [0, 2/cols] (mean 1/cols, like a softmax output), dy in [-2, 2]
            fill_kernel<<<ceil_div(n, 256), 256>>>(ys[i], n, 1234 + i, 0.5f / sh.cols, 1.0f / sh.cols);
            cudaCheck(cudaGetLastError());
            fill_kernel<<<ceil_div(n, 256), 256>>>(dys[i], n, 4321 + i, 1.0f, 0.0f);
            cudaCheck(cudaGetLastError());
        }
        // validation on up to 64 rows spread over the matrix
        int check_rows = std::min(sh.rows, 64);
        std::vector<float> yr((size_t)check_rows * sh.cols), dyr(yr.size()), out(yr.size()), ref(yr.size());
        for (int i = 0; i < check_rows; i++) {
            size_t r = (size_t)((long long)i * sh.rows / check_rows) * sh.cols;
            cudaCheck(cudaMemcpy(&yr[(size_t)i * sh.cols], ys[0] + r, sh.cols * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(&dyr[(size_t)i * sh.cols], dys[0] + r, sh.cols * sizeof(float), cudaMemcpyDeviceToHost));
        }
        softmax_backward_cpu(ref.data(), yr.data(), dyr.data(), check_rows, sh.cols);
        // copy of the same bytes moved (y -> dx: 2/3 of the traffic, same rate): the memory system at this size
        int copy_reps = 0;
        float copy_ms = median_ms([&](int i) { cudaCheck(cudaMemcpyAsync(dxs[i % nsets], ys[i % nsets], n * sizeof(float), cudaMemcpyDeviceToDevice)); }, copy_reps);
        double copy_same = 2.0 * n * sizeof(float) / (copy_ms * 1e-3) / 1e9;
        printf("%dx%d: cudaMemcpy D2D of %zu MB (y -> dx): %.1f GB/s\n", sh.rows, sh.cols, n * sizeof(float) >> 20, copy_same);
        for (int v : versions) {
            std::vector<int> sizes = block_size_flag >= 0 ? std::vector<int>{block_size_flag} : block_sizes_of(v);
            for (int bs : sizes) {
                cudaCheck(cudaMemset(dxs[0], 0xff, n * sizeof(float)));
                const char* why = softmax_backward(v, dxs[0], ys[0], dys[0], sh.rows, sh.cols, bs);
                char shape_str[32];
                snprintf(shape_str, sizeof shape_str, "%dx%d", sh.rows, sh.cols);
                if (why) { printf("%-13s %3d %6d  unsupported: %s\n", shape_str, v, bs, why); continue; }
                cudaCheck(cudaDeviceSynchronize());
                for (int i = 0; i < check_rows; i++) {
                    size_t r = (size_t)((long long)i * sh.rows / check_rows) * sh.cols;
                    cudaCheck(cudaMemcpy(&out[(size_t)i * sh.cols], dxs[0] + r, sh.cols * sizeof(float), cudaMemcpyDeviceToHost));
                }
                CompareResult c = compare(out.data(), ref.data(), out.size());
                all_ok = all_ok && c.ok;
                int reps = 0;
                float ms = median_ms([&](int i) { softmax_backward(v, dxs[i % nsets], ys[i % nsets], dys[i % nsets], sh.rows, sh.cols, bs); }, reps);
                // bytes moved: read y and dy once, write dx once, 4 bytes each: 3 * rows * cols * 4
                double gbps = 3.0 * n * sizeof(float) / (ms * 1e-3) / 1e9;
                std::string choice = v == NUM_VERSIONS ? backward8_choice(sh.rows, sh.cols) : "";
                printf("%-13s %3d %6d %10.4f %9.1f %6.1f%%  %s%s%s\n", shape_str, v, bs, ms, gbps, 100.0 * gbps / copy,
                       c.ok ? "ok" : describe(c, sh.cols, out.data(), ref.data()).c_str(), choice.empty() ? "" : ", dispatched to ",
                       choice.c_str());
                if (json) {
                    fprintf(json, "%s  {\"version\": %d, \"block_size\": %d, \"rows\": %d, \"cols\": %d, \"ms\": %.6f, \"gbps\": %.2f, "
                            "\"pct_copy\": %.2f, \"copy_same_size_gbps\": %.1f, \"reps\": %d, \"valid\": %s, \"dispatched_to\": \"%s\"}",
                            first ? "" : ",\n", v, bs, sh.rows, sh.cols, ms, gbps, 100.0 * gbps / copy, copy_same, reps,
                            c.ok ? "true" : "false", choice.c_str());
                    first = false;
                }
            }
        }
        for (int i = 0; i < nsets; i++) { cudaCheck(cudaFree(ys[i])); cudaCheck(cudaFree(dys[i])); cudaCheck(cudaFree(dxs[i])); }
    }
    if (json) { fprintf(json, "\n]}\n"); fclose(json); }
    if (!all_ok) { fprintf(stderr, "validation FAILED for at least one version (see the check column)\n"); return EXIT_FAILURE; }
    return EXIT_SUCCESS;
}

// ----------------------------------------------------------------------------------------------------------------

static void usage() {
    printf("usage: ./dev/softmax_backward [version] [flags]\n"
           "  version              1..%d: validate and benchmark that version only (default: all)\n"
           "  --test               correctness suite (no benchmarking); GPU checks SKIP without a GPU\n"
           "  --fixture PATH       PyTorch fixture for --test (default dev/fixtures/softmax_fixture.bin)\n"
           "  --seed N             RNG seed of --test inputs (default: from the clock, printed)\n"
           "  --shapes LIST        benchmark shapes RxC,... (default 4096x1024,4096x4096,4096x16384,1024x65536,65536x128)\n"
           "  --versions LIST      benchmark versions, comma separated (default: all, or the positional version)\n"
           "  --block_size N       benchmark one block size (default -1: every block size of the version; 0: its default)\n"
           "  --bench_json FILE    also write the benchmark results as JSON to FILE (default: none)\n"
           "  --help               this text\n", NUM_VERSIONS);
}

static bool parse_int(const char* s, long long lo, long long hi, long long& out) {
    char* end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi) return false;
    out = v;
    return true;
}

static bool parse_versions(const char* s, std::vector<int>& out) {
    out.clear();
    std::string str(s);
    size_t pos = 0;
    while (true) {
        size_t comma = str.find(',', pos);
        std::string item = str.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        long long v;
        if (!parse_int(item.c_str(), 1, NUM_VERSIONS, v)) return false;
        out.push_back((int)v);
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    return true;
}

int main(int argc, char** argv) {
    bool test = false;
    const char* fixture = "dev/fixtures/softmax_fixture.bin";
    const char* json_path = nullptr;
    uint64_t seed = (uint64_t)std::chrono::high_resolution_clock::now().time_since_epoch().count();
    std::vector<int> versions;
    for (int v = 1; v <= NUM_VERSIONS; v++) versions.push_back(v);
    std::vector<BenchShape> shapes = {{4096, 1024}, {4096, 4096}, {4096, 16384}, {1024, 65536}, {65536, 128}};
    int block_size = -1;
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
        if (a == "--help" || a == "-h") { usage(); return EXIT_SUCCESS; }
        else if (a == "--test") test = true;
        else if (a == "--fixture") fixture = value("a file path");
        else if (a == "--bench_json") json_path = value("a file path");
        else if (a == "--seed") {
            const char* s = value("an integer >= 0");
            if (!parse_int(s, 0, LLONG_MAX, v)) { fprintf(stderr, "error: --seed expects an integer >= 0, found '%s'\n", s); return EXIT_FAILURE; }
            seed = (uint64_t)v;
        } else if (a == "--shapes") {
            const char* s = value("RxC,RxC,...");
            if (!parse_shapes(s, shapes)) { fprintf(stderr, "error: --shapes expects RxC,... with R, C >= 1 and R*C <= 2^31, found '%s'\n", s); return EXIT_FAILURE; }
        } else if (a == "--versions") {
            const char* s = value("a comma separated list of 1..8");
            if (!parse_versions(s, versions)) { fprintf(stderr, "error: --versions expects a comma separated list of 1..%d, found '%s'\n", NUM_VERSIONS, s); return EXIT_FAILURE; }
        } else if (a == "--block_size") {
            const char* s = value("-1, 0, or a block size 32..1024");
            if (!parse_int(s, -1, 1024, v) || (v > 0 && v % 32 != 0)) {
                fprintf(stderr, "error: --block_size expects -1, 0 or a multiple of 32 up to 1024, found '%s'\n", s);
                return EXIT_FAILURE;
            }
            block_size = (int)v;
        } else if (a.size() && a[0] != '-') {
            if (!parse_int(a.c_str(), 1, NUM_VERSIONS, v)) {
                fprintf(stderr, "error: version expects an integer 1..%d, found '%s'\n", NUM_VERSIONS, a.c_str());
                return EXIT_FAILURE;
            }
            versions = {(int)v};
        } else {
            fprintf(stderr, "error: unknown flag '%s' (see --help)\n", a.c_str());
            return EXIT_FAILURE;
        }
    }
    std::string no_gpu;
    if (has_gpu(no_gpu)) {
        cudaCheck(cudaSetDevice(0));
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        g_cc_major = prop.major;
        g_num_sms = prop.multiProcessorCount;
    }
    if (test) return run_tests(fixture, seed);
    return run_benchmark(versions, shapes, block_size, json_path);
}
