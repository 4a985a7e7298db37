/*
Kernels for the softmax backward pass over the last dim of a row-major fp32 matrix: with y = softmax(x) and the
incoming gradient dy, dx[r, :] = y[r, :] * (dy[r, :] - sum_c y[r, c] * dy[r, c]).  y, dy, dx: (rows, cols).
This is what torch._softmax_backward_data(dy, y, -1, float32) computes.

Compile (or `make -C dev softmax_backward`):
  nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 softmax_backward.cu -o softmax_backward
No --use_fast_math: results are compared with PyTorch fp32.
The error checks, the launch templates, the --test / benchmark harness and the command line shared with
softmax_forward.cu are in dev/softmax_common.cuh (included below); this file holds the op itself: CPU reference,
kernels, launchers, dispatcher, its test suite and its benchmark loop. dev/torch_ops (the PyTorch operator) includes
this file with DEV_KERNELS_ONLY (no tests, benchmark or main) and calls version 11 on PyTorch's stream (g_stream).

Run (from the repo root):
  ./dev/softmax_backward --test      correctness suite: every version and block size vs the CPU oracle at awkward
                                     shapes; the CPU oracle vs a PyTorch fixture (runs without a GPU too)
  ./dev/softmax_backward             validate + benchmark every version on the five issue shapes
  ./dev/softmax_backward 4           the same for version 4 only
  ./dev/softmax_backward --bench_json FILE --shapes 4096x1024 --versions 3,8    timings for dev/softmax.py
  ./dev/softmax_backward --help      every flag with its default

version 1: naive, one thread per row: a pass for the dot product <y, dy> (compensated sum), a pass to write dx
           (reads y, dy twice)
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
version 9: version 3 with 16-byte accesses through inline PTX with streaming hints (ld.global.nc.L1::no_allocate,
           st.global.cs) and the PDL hooks (griddepcontrol: trigger at entry, wait before the first global access)
version 10: version 9 launched with Programmatic Dependent Launch (its blocks become resident while the previous
           kernel of the stream finishes; they still wait for it before reading)
version 11: the dispatcher of version 8 with versions 9 and 10 among the short-row candidates

NaN in y or dy (e.g. the NaN row of an all -inf forward row) gives a NaN row, as in torch; y = 0 gives dx = 0.
Rows need not be 16-byte aligned: the 16-byte accesses run over the row's aligned chunks (frame of y) and the first
and last chunk use scalar accesses; dy or dx with a different alignment than y use scalar accesses throughout.
*/
#include "softmax_common.cuh"  // error checking, launch templates, test/benchmark harness and CLI (shared with softmax_forward.cu)
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Cluster versions: every block has published its partial dot product in block_partial (a shared variable, the
// same in each block). After a cluster barrier warp 0 sums every block's partial through distributed shared memory
// into *row_dot; on return (block barrier) the whole block can read it.
__device__ __forceinline__ void cluster_row_dot(cg::cluster_group& cluster, int csize, float* block_partial, float* row_dot) {
    cluster.sync();
    if (threadIdx.x < 32) {
        float p = (int)threadIdx.x < csize ? *cluster.map_shared_rank(block_partial, (int)threadIdx.x) : 0.0f;
        p = group_sum<32>(p);
        if (threadIdx.x == 0) *row_dot = p;
    }
    __syncthreads();
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// GPU kernels

// version 1: one thread per row: dot product pass, then the write pass.
__global__ void softmax_backward_kernel1(float* dx, const float* y, const float* dy, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* yr = y + (size_t)r * cols;
    const float* dyr = dy + (size_t)r * cols;
    // Compensated (Kahan) sum: one plain fp32 accumulator over a row drifts by a random walk of half-ulp roundings of
    // the partial sums (measured on the H100, 2026-11-22: dx off by 2.1e-6 at 1023x128 where the tolerance allows
    // 1.4e-6); the compensation keeps the error near one rounding. No fast-math, so the compiler keeps it as written.
    float dot = 0.0f, comp = 0.0f;
    for (int c = 0; c < cols; c++) {
        float t = yr[c] * dyr[c] - comp;
        float sum = dot + t;
        comp = (sum - dot) - t;
        dot = sum;
    }
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
    int c0, c1;
    cluster_slice(off, cols, csize, rank, c0, c1);
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
    cluster_row_dot(cluster, csize, &block_partial, &row_dot);
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
        cluster_slice(off, cols, csize, rank, c0, c1);
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
        cluster_row_dot(cluster, csize, &block_partial[parity], &row_dot);
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

// Versions 9 and 10: full 16-byte chunks through inline PTX with streaming hints (ld.global.nc.L1::no_allocate,
// st.global.cs); partial chunks and rows with another alignment than y's (vec false) as load_chunk / store_chunk.
// Inline PTX also keeps the stores 16 bytes wide: nvcc 13.0 merges the float4 store of store_chunk with its scalar
// fallback (the forward's versions 4-8 compile to 4-byte STG only, dev/softmax_NOTES.md).
__device__ __forceinline__ float4 load_chunk_stream(const float* row, int n, int off, int c, bool vec) {
    int lo = 4 * c - off;
    if (vec && lo >= 0 && lo + 4 <= n) return ld_stream(row + lo);
    return load_chunk(row, n, off, c, false);
}

__device__ __forceinline__ void store_chunk_stream(float* row, int n, int off, int c, bool vec, float4 v) {
    int lo = 4 * c - off;
    if (vec && lo >= 0 && lo + 4 <= n) { st_stream(row + lo, v); return; }
    store_chunk(row, n, off, c, false, v);
}

// versions 9 and 10: version 3 (GROUP lanes per row, y and dy in registers) with 16-byte streaming accesses and the
// PDL hooks: trigger at entry, wait before the first global access (no-ops unless launched with the attribute,
// version 10).
template <int GROUP, int CHUNKS>
__global__ void softmax_backward_kernel9(float* dx, const float* y, const float* dy, int rows, int cols) {
    static_assert(GROUP >= 1 && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0, "a group is a power-of-2 part of a warp");
    pdl_trigger();
    int r = blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
    int g = threadIdx.x % GROUP;
    int n = r < rows ? cols : 0;  // no early return: the whole warp takes part in the shuffles
    size_t base = (size_t)(r < rows ? r : 0) * cols;
    int off = row_offset(y + base);
    bool vec_dy = row_offset(dy + base) == off, vec_dx = row_offset(dx + base) == off;
    pdl_wait();
    float4 a[CHUNKS], b[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        a[k] = load_chunk_stream(y + base, n, off, g + GROUP * k, true);
        b[k] = load_chunk_stream(dy + base, n, off, g + GROUP * k, vec_dy);
    }
    float dot = group_sum<GROUP>(thread_dot(a, b));
    apply_grad(a, b, dot);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) store_chunk_stream(dx + base, n, off, g + GROUP * k, vec_dx, b[k]);
}

// ----------------------------------------------------------------------------------------------------------------
// launchers. Each returns nullptr on success, or why the version does not handle this shape / device.

static int g_cc_major = 0;  // compute capability of the current device, set in main
static int g_num_sms = 0;   // set in main

// Number of 16-byte chunks a row of y spans in the worst case (rows start at 4-byte offsets 0..3 within 16 bytes
// unless y is 16-byte aligned and cols % 4 == 0).
static int max_row_chunks(const float* y, int cols) {
    int max_off = ((uintptr_t)y % 16 == 0 && cols % 4 == 0) ? 0 : 3;
    return (max_off + cols + 3) / 4;
}

static const char* launch_backward1(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    softmax_backward_kernel1<<<ceil_div(rows, block_size), block_size, 0, g_stream>>>(dx, y, dy, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward2(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    softmax_backward_kernel2<<<ceil_div((long long)rows * 32, block_size), block_size, 0, g_stream>>>(dx, y, dy, rows,
                                                                                                      cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

template <int GROUP, int CHUNKS>
static const char* launch3(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    // 8 chunks of y and dy per lane take ~93 registers: 1024 threads would exceed the 64K register file
    if (CHUNKS == 8 && block_size > 512) return "the 8-chunk variant runs at most 512 threads per block";
    softmax_backward_kernel3<GROUP, CHUNKS><<<ceil_div(rows, block_size / GROUP), block_size, 0, g_stream>>>(dx, y, dy,
                                                                                                             rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward3(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    return by_row_chunks(max_row_chunks(y, cols), "row longer than 256 chunks of 16 bytes (version 3 is for short rows)",
                         [&](auto group, auto chunks) {
                             return launch3<decltype(group)::value, decltype(chunks)::value>(dx, y, dy, rows, cols, block_size);
                         });
}

template <int THREADS>
static const char* launch4_threads(float* dx, const float* y, const float* dy, int rows, int cols) {
    int per_thread = next_pow2(ceil_div(max_row_chunks(y, cols), THREADS));
    switch (per_thread) {
        case 1: softmax_backward_kernel4<THREADS, 1><<<rows, THREADS, 0, g_stream>>>(dx, y, dy, rows, cols); break;
        case 2: softmax_backward_kernel4<THREADS, 2><<<rows, THREADS, 0, g_stream>>>(dx, y, dy, rows, cols); break;
        case 4: softmax_backward_kernel4<THREADS, 4><<<rows, THREADS, 0, g_stream>>>(dx, y, dy, rows, cols); break;
        default: return "row does not fit in the registers of one block at this block size (max 4 float4 of y and dy per thread)";
    }
    cudaCheck(cudaGetLastError());
    return nullptr;
}

// block_size 0 picks the smallest block that holds the row in at most 2 float4 (of y and of dy) per thread.
static const char* launch_backward4(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    if (block_size == 0) block_size = std::min(1024, std::max(128, next_pow2(ceil_div(max_row_chunks(y, cols), 2))));
    return by_block_size(block_size, "version 4 block size must be 128, 256, 512 or 1024",
                         [&](auto threads) { return launch4_threads<decltype(threads)::value>(dx, y, dy, rows, cols); });
}

constexpr int CHUNKS5 = 2;       // float4 of y and of dy per thread in version 5: 16 floats of registers
constexpr int MAX_CLUSTER = 16;  // H100 allows 16 with the non-portable attribute (8 is portable)

// The cluster size (a power of 2) whose blocks hold a row of y at block_chunks float4 each, or why there is none.
static const char* cluster_size(const float* y, int cols, int block_chunks, int& cluster) {
    if (g_cc_major < 9) return "thread-block clusters need sm_90";
    cluster = next_pow2(ceil_div(max_row_chunks(y, cols), block_chunks));
    if (cluster > MAX_CLUSTER) return "row longer than 16 blocks of registers at this block size";
    return nullptr;
}

template <int THREADS>
static const char* launch5_threads(float* dx, const float* y, const float* dy, int rows, int cols) {
    int cluster = 0;
    if (const char* why = cluster_size(y, cols, THREADS * CHUNKS5, cluster)) return why;
    if ((long long)rows * cluster > 0x7fffffffLL) return "grid too large";
    auto kernel = softmax_backward_kernel5<THREADS, CHUNKS5>;
    static int checked_cluster = 0, schedulable = 0;  // the attribute and occupancy query once per cluster size
    ClusterLaunch launch(THREADS, cluster);
    launch.config.gridDim = dim3((unsigned)(rows * cluster));
    if (checked_cluster != cluster) {
        schedulable = max_active_clusters(kernel, launch.config) > 0;
        checked_cluster = cluster;
    }
    if (!schedulable) return "this cluster size cannot be scheduled on the device";
    cudaCheck(cudaLaunchKernelEx(&launch.config, kernel, dx, y, dy, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward5(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    return by_block_size(block_size ? block_size : 512, "version 5 block size must be 128, 256, 512 or 1024",
                         [&](auto threads) { return launch5_threads<decltype(threads)::value>(dx, y, dy, rows, cols); });
}

template <int GROUP, int CHUNKS>
static const char* launch6(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    auto kernel = softmax_backward_kernel6<GROUP, CHUNKS>;
    static int per_sm[1025] = {0};  // occupancy, queried once per block size
    if (per_sm[block_size] == 0) cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm[block_size], kernel, block_size, 0));
    if (per_sm[block_size] == 0) return "no block of this size fits on an SM";
    int grid = std::max(1, std::min(ceil_div(rows, block_size / GROUP), per_sm[block_size] * g_num_sms));
    kernel<<<grid, block_size, 0, g_stream>>>(dx, y, dy, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward6(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    if (block_size > 256) return "version 6 runs at most 256 threads per block";
    return by_row_chunks(max_row_chunks(y, cols), "row longer than 256 chunks of 16 bytes (version 6 is for short rows)",
                         [&](auto group, auto chunks) {
                             return launch6<decltype(group)::value, decltype(chunks)::value>(dx, y, dy, rows, cols, block_size);
                         });
}

constexpr int CHUNKS7 = 2;  // float4 of y and of dy per thread and row in version 7 (twice that with the prefetch)

template <int THREADS>
static const char* launch7_threads(float* dx, const float* y, const float* dy, int rows, int cols) {
    int cluster = 0;
    if (const char* why = cluster_size(y, cols, THREADS * CHUNKS7, cluster)) return why;
    auto kernel = softmax_backward_kernel7<THREADS, CHUNKS7>;
    static int max_clusters[MAX_CLUSTER + 1] = {0};  // clusters resident at once, queried once per cluster size
    ClusterLaunch launch(THREADS, cluster);
    if (max_clusters[cluster] == 0) {
        launch.config.gridDim = dim3((unsigned)(cluster * 1024));
        max_clusters[cluster] = max_active_clusters(kernel, launch.config);
        if (max_clusters[cluster] == 0) max_clusters[cluster] = -1;
    }
    if (max_clusters[cluster] < 0) return "this cluster size cannot be scheduled on the device";
    launch.config.gridDim = dim3((unsigned)(std::min(rows, max_clusters[cluster]) * cluster));
    cudaCheck(cudaLaunchKernelEx(&launch.config, kernel, dx, y, dy, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward7(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    return by_block_size(block_size ? block_size : 512, "version 7 block size must be 128, 256, 512 or 1024",
                         [&](auto threads) { return launch7_threads<decltype(threads)::value>(dx, y, dy, rows, cols); });
}

static const char* softmax_backward(int version, float* dx, const float* y, const float* dy, int rows, int cols, int block_size);

template <int GROUP, int CHUNKS>
static const char* launch9(float* dx, const float* y, const float* dy, int rows, int cols, int block_size, bool pdl) {
    if (CHUNKS == 8 && block_size > 512) return "the 8-chunk variant runs at most 512 threads per block";  // as version 3
    ExLaunch launch(block_size, 0, pdl);
    launch.config.gridDim = dim3((unsigned)ceil_div(rows, block_size / GROUP));
    cudaCheck(cudaLaunchKernelEx(&launch.config, softmax_backward_kernel9<GROUP, CHUNKS>, dx, y, dy, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_backward9(float* dx, const float* y, const float* dy, int rows, int cols, int block_size, bool pdl) {
    if (pdl && g_cc_major < 9) return "Programmatic Dependent Launch needs sm_90";
    return by_row_chunks(max_row_chunks(y, cols), "row longer than 256 chunks of 16 bytes (versions 9 and 10 are for short rows)",
                         [&](auto group, auto chunks) {
                             return launch9<decltype(group)::value, decltype(chunks)::value>(dx, y, dy, rows, cols, block_size, pdl);
                         });
}

// The autotuning dispatchers (versions 8 and 11): on the first call for a (rows, cols, alignment) each candidate
// (version, block size) is launched once (warm-up, skipped if it does not apply) and timed over three launches on the
// caller's buffers (version 11: ten; every candidate writes the full output, the chosen one runs last); the fastest is
// cached and later calls launch it directly. Version 2 is always a candidate (it applies everywhere).
struct BackwardChoice { int rows, cols, align, version, block_size; };

static const char* tuned_launch(std::vector<BackwardChoice>& cache, std::vector<std::pair<int, int>> candidates, float* dx,
                                const float* y, const float* dy, int rows, int cols, int timed_launches = 3) {
    int align = (int)((uintptr_t)y % 16) * 256 + (int)((uintptr_t)dy % 16) * 16 + (int)((uintptr_t)dx % 16);
    for (const BackwardChoice& c : cache)
        if (c.rows == rows && c.cols == cols && c.align == align) return softmax_backward(c.version, dx, y, dy, rows, cols, c.block_size);
    candidates.push_back({2, 256});
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    BackwardChoice best = {rows, cols, align, 2, 256};
    float best_ms = INFINITY;
    for (auto [version, bs] : candidates) {
        if (softmax_backward(version, dx, y, dy, rows, cols, bs)) continue;  // does not apply (shape, device)
        cudaCheck(cudaEventRecord(start, g_stream));
        for (int k = 0; k < timed_launches; k++) softmax_backward(version, dx, y, dy, rows, cols, bs);
        cudaCheck(cudaEventRecord(stop, g_stream));
        cudaCheck(cudaEventSynchronize(stop));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        if (ms < best_ms) { best_ms = ms; best.version = version; best.block_size = bs; }
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    cache.push_back(best);
    return softmax_backward(best.version, dx, y, dy, rows, cols, best.block_size);
}

// Which version and block size a dispatcher picked for a shape (for the benchmark's report); "" if not tuned yet.
static std::string tuned_choice(const std::vector<BackwardChoice>& cache, int rows, int cols) {
    for (const BackwardChoice& c : cache)
        if (c.rows == rows && c.cols == cols) return "v" + std::to_string(c.version) + " b" + std::to_string(c.block_size);
    return "";
}

// version 8: the dispatcher. Candidates by row length: short rows (<= 256 chunks) 3, 6; medium (<= 4096) 4, 5, 7;
// long 5, 7; version 2 where none applies.
static std::vector<BackwardChoice> g_backward8_cache;

static const char* launch_backward8(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    (void)block_size;
    int need = max_row_chunks(y, cols);
    std::vector<std::pair<int, int>> candidates;
    if (need <= 256) candidates = {{3, 64}, {3, 256}, {6, 128}, {6, 256}};
    else if (need <= 4096) candidates = {{4, 128}, {4, 256}, {4, 512}, {4, 1024}, {5, 256}, {5, 512}, {7, 128}, {7, 256}, {7, 512}};
    else candidates = {{5, 256}, {5, 512}, {7, 128}, {7, 256}, {7, 512}, {7, 1024}};
    return tuned_launch(g_backward8_cache, candidates, dx, y, dy, rows, cols);
}

// version 11: the dispatcher of version 8 with versions 9 and 10 (PDL) among the short-row candidates, and version
// 4 at 128 threads (the best at 49152x256 on the H100), ten timed launches per candidate.
static std::vector<BackwardChoice> g_backward11_cache;

static const char* launch_backward11(float* dx, const float* y, const float* dy, int rows, int cols, int block_size) {
    (void)block_size;
    int need = max_row_chunks(y, cols);
    std::vector<std::pair<int, int>> candidates;
    if (need <= 256) candidates = {{3, 64}, {3, 256}, {6, 128}, {6, 256}, {4, 128}, {9, 64}, {9, 256}, {10, 64}, {10, 256}};
    else if (need <= 4096) candidates = {{4, 128}, {4, 256}, {4, 512}, {4, 1024}, {5, 256}, {5, 512}, {7, 128}, {7, 256}, {7, 512}};
    else candidates = {{5, 256}, {5, 512}, {7, 128}, {7, 256}, {7, 512}, {7, 1024}};
    return tuned_launch(g_backward11_cache, candidates, dx, y, dy, rows, cols, 10);
}

constexpr int NUM_VERSIONS = 11;

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
        case 9: return launch_backward9(dx, y, dy, rows, cols, block_size ? block_size : 256, false);
        case 10: return launch_backward9(dx, y, dy, rows, cols, block_size ? block_size : 256, true);
        case 11: return launch_backward11(dx, y, dy, rows, cols, block_size);
        default:
            fprintf(stderr, "Invalid version %d: expected 1..%d\n", version, NUM_VERSIONS);
            exit(EXIT_FAILURE);
    }
}

// Block sizes checked in --test and timed in the benchmark (0 = the version's default).
static std::vector<int> block_sizes_of(int version) {
    switch (version) {
        case 3: case 9: case 10: return {64, 256, 512};
        case 4: case 5: case 7: return {128, 256, 512, 1024};
        case 6: return {128, 256};
        default: return {0};
    }
}

#ifndef DEV_KERNELS_ONLY  // dev/torch_ops includes this file for its kernels and launchers: the test suite,
                          // the benchmark and main stay out

// ----------------------------------------------------------------------------------------------------------------
// test and benchmark support

// Tolerance of a float32 backward against the float64 oracle, per element: |dx - ref| <= ATOL + RTOL * |ref|.
//  ATOL 1e-6: dx_i = y_i * (dy_i - <y, dy>) cancels when dy_i is close to <y, dy>; there the error is
//  y_i * (error of <y, dy> + eps * |dy_i|), with y_i <= 1, |dy_i| <= ~5 (randn) and the fp32 dot product's error
//  well under 1e-6 at our sizes: at most ~6e-7 + 2e-7.
//  RTOL 2e-6: without cancellation, a few roundings (product, difference, product: ~3 eps = 3.6e-7), 5x margin.
// NaN references (NaN rows of y) must give NaN.
constexpr double ATOL = 1e-6, RTOL = 2e-6;

// The test suite's and the benchmark's check of an output against the oracle.
static CompareResult compare_backward(const float* out, const float* ref, size_t n) {
    return compare(out, ref, n, ATOL, RTOL);
}

// ----------------------------------------------------------------------------------------------------------------
// the --test suite

static void test_fixture(Tally& tally, const char* path) {
    int n_cases = 0;
    std::vector<FixtureTensor> t;
    if (!load_fixture(tally, path, n_cases, t)) return;
    for (int k = 0; k < n_cases; k++) {
        const FixtureTensor& y = t[4 * k + 1];
        const FixtureTensor& dy = t[4 * k + 2];
        const FixtureTensor& dx = t[4 * k + 3];
        int rows = y.shape[0], cols = y.shape[1];
        std::vector<float> out(y.data.size());
        softmax_backward_cpu(out.data(), y.data.data(), dy.data.data(), rows, cols);
        CompareResult c = compare_backward(out.data(), dx.data.data(), out.size());
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
    CompareResult c = compare_backward(dx2.data(), dx.data(), dx.size());
    report(tally, c.ok, "cpu oracle: dy + 8 gives the same dx", describe(c, cols, dx2.data(), dx.data()));
}

// The PDL version only proves that it waits for its producer in a chain: dx1 = backward(y, dy) by version 9 or 10
// (both trigger their dependents at entry), then dx2 = backward(y, dx1) by version 10, launched at once with PDL, dx1
// poisoned beforehand. A read of dx1 before the producer finished would see NaN or stale rows. dx2 is compared with
// the oracle applied to the dx1 the GPU wrote.
static void test_pdl_chains(Tally& tally, Rng& rng) {
    const Shape chain_shapes[] = {{4099, 64}, {1023, 1000}, {8192, 1024}};
    for (const Shape& sh : chain_shapes) {
        size_t n = (size_t)sh.rows * sh.cols;
        std::vector<float> x(n), y(n), dy(n), dx1(n), ref(n), out(n);
        float *d_y, *d_dy, *d_dx1, *d_dx2;
        cudaCheck(cudaMalloc(&d_y, n * sizeof(float)));
        cudaCheck(cudaMalloc(&d_dy, n * sizeof(float)));
        cudaCheck(cudaMalloc(&d_dx1, n * sizeof(float)));
        cudaCheck(cudaMalloc(&d_dx2, n * sizeof(float)));
        for (int producer : {9, 10}) {
            char name[160];
            snprintf(name, sizeof name, "backward PDL chain v%d -> v10 %dx%d", producer, sh.rows, sh.cols);
            fill_input(x.data(), sh.rows, sh.cols, RANDN, rng);
            softmax_forward_cpu(y.data(), x.data(), sh.rows, sh.cols);
            for (size_t i = 0; i < n; i++) dy[i] = rng.normal();
            cudaCheck(cudaMemcpy(d_y, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(d_dy, dy.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            cudaCheck(cudaMemset(d_dx1, 0xff, n * sizeof(float)));
            cudaCheck(cudaMemset(d_dx2, 0xff, n * sizeof(float)));
            cudaCheck(cudaDeviceSynchronize());
            const char* why = softmax_backward(producer, d_dx1, d_y, d_dy, sh.rows, sh.cols, 0);
            if (!why) why = softmax_backward(10, d_dx2, d_y, d_dx1, sh.rows, sh.cols, 0);
            if (why) { cudaCheck(cudaDeviceSynchronize()); skip(tally, name, why); continue; }
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaMemcpy(dx1.data(), d_dx1, n * sizeof(float), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(out.data(), d_dx2, n * sizeof(float), cudaMemcpyDeviceToHost));
            softmax_backward_cpu(ref.data(), y.data(), dx1.data(), sh.rows, sh.cols);
            CompareResult c = compare_backward(out.data(), ref.data(), n);
            report(tally, c.ok, name, describe(c, sh.cols, out.data(), ref.data()));
        }
        cudaCheck(cudaFree(d_y));
        cudaCheck(cudaFree(d_dy));
        cudaCheck(cudaFree(d_dx1));
        cudaCheck(cudaFree(d_dx2));
    }
}

static int run_tests(const char* fixture_path, uint64_t seed) {
    Tally tally;
    Rng rng{seed};
    printf("softmax_backward --test (seed %llu)\n", (unsigned long long)seed);
    test_oracle_properties(tally, rng);
    test_fixture(tally, fixture_path);

    std::string no_gpu;
    if (!has_gpu(no_gpu)) {
        for (int v = 1; v <= NUM_VERSIONS; v++) skip(tally, "gpu backward version " + std::to_string(v), no_gpu);
    } else {
        for (const Shape& sh : test_shapes) {
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
                        CompareResult c = compare_backward(out.data(), ref.data(), n);
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
                        CompareResult c = compare_backward(guard.data() + dxoff, ref.data(), n);
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
        test_pdl_chains(tally, rng);
    }
    return tally_end(tally);
}

// ----------------------------------------------------------------------------------------------------------------
// benchmark

static int run_benchmark(const std::vector<int>& versions, const std::vector<BenchShape>& shapes, int block_size_flag,
                         const char* json_path) {
    BenchOutput b;
    if (!bench_begin(b, "softmax_backward", "backward", json_path)) return EXIT_FAILURE;
    bool all_ok = true;
    for (const BenchShape& sh : shapes) {
        size_t n = (size_t)sh.rows * sh.cols;
        size_t set_bytes = 3 * n * sizeof(float);
        // rotate through enough (y, dy, dx) triples that each launch finds its data out of L2
        int nsets = bench_sets(b.prop, set_bytes);
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
        copy_check_rows(yr.data(), ys[0], sh, check_rows);
        copy_check_rows(dyr.data(), dys[0], sh, check_rows);
        softmax_backward_cpu(ref.data(), yr.data(), dyr.data(), check_rows, sh.cols);
        // copy of the same bytes moved (y -> dx: 2/3 of the traffic, same rate): the memory system at this size
        double copy_same = bench_copy_refs(b, sh, n, [&](int i) { return ys[i % nsets]; }, [&](int i) { return dxs[i % nsets]; });
        // bytes moved: read y and dy once, write dx once, 4 bytes each: 3 * rows * cols * 4
        all_ok = bench_versions(
            b, sh, versions, block_size_flag, block_sizes_of, 3.0 * n * sizeof(float), copy_same, out.data(), ref.data(),
            [&]() { cudaCheck(cudaMemset(dxs[0], 0xff, n * sizeof(float))); },
            [&](int v, int bs, int i) {
                return softmax_backward(v, dxs[i % nsets], ys[i % nsets], dys[i % nsets], sh.rows, sh.cols, bs);
            },
            [&]() {
                copy_check_rows(out.data(), dxs[0], sh, check_rows);
                return compare_backward(out.data(), ref.data(), out.size());
            },
            [&](int v) {
                return v == 8 ? tuned_choice(g_backward8_cache, sh.rows, sh.cols)
                              : v == 11 ? tuned_choice(g_backward11_cache, sh.rows, sh.cols) : std::string();
            }) && all_ok;
        for (int i = 0; i < nsets; i++) { cudaCheck(cudaFree(ys[i])); cudaCheck(cudaFree(dys[i])); cudaCheck(cudaFree(dxs[i])); }
    }
    return bench_end(b, all_ok);
}

// ----------------------------------------------------------------------------------------------------------------

int main(int argc, char** argv) {
    Options opt = parse_args(argc, argv, "softmax_backward", NUM_VERSIONS);
    device_info(g_cc_major, g_num_sms);
    if (opt.test) return run_tests(opt.fixture, opt.seed);
    return run_benchmark(opt.versions, opt.shapes, opt.block_size, opt.json_path);
}
#endif  // DEV_KERNELS_ONLY
