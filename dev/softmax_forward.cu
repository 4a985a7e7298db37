/*
Kernels for the softmax forward pass over the last dim of a row-major fp32 matrix:
  y[r, :] = softmax(x[r, :]),  x, y: (rows, cols), any rows >= 1, cols >= 1.

Compile (or `make -C dev softmax_forward`):
  nvcc -O3 -std=c++17 -lineinfo -gencode arch=compute_90,code=sm_90 softmax_forward.cu -o softmax_forward
No --use_fast_math: results are compared with PyTorch fp32 (expf, IEEE division).
The error checks, the launch templates, the --test / benchmark harness and the command line shared with
softmax_backward.cu are in dev/softmax_common.cuh (included below); this file holds the op itself: CPU reference,
kernels, launchers, dispatcher, its test suite and its benchmark loop. dev/torch_ops (the PyTorch operator) includes
this file with DEV_KERNELS_ONLY (no tests, benchmark or main) and calls version 14 on PyTorch's stream (g_stream).

Run (from the repo root):
  ./dev/softmax_forward --test       correctness suite: every version and block size vs the CPU oracle at awkward
                                     shapes; the CPU oracle vs a PyTorch fixture (runs without a GPU too)
  ./dev/softmax_forward              validate + benchmark every version on the five issue shapes
  ./dev/softmax_forward 5            the same for version 5 only
  ./dev/softmax_forward --bench_json FILE --shapes 4096x1024,65536x128 --versions 4,7
                                     machine-readable timings for dev/softmax.py
  ./dev/softmax_forward --help       every flag with its default

version 1: naive, one thread per row, three passes over the row: max, sum of exp (in blocks of 256), write exp/sum
version 2: online softmax, one thread per row: max and sum in one pass (the sum is rescaled when the max grows),
           then the write pass: two passes instead of three
version 3: one warp per row: lanes read coalesced, online (max, sum) per lane combined by warp shuffles; the
           write pass reads the row a second time
version 4: a group of 4..32 lanes per row with the row held in registers and 16-byte loads: one read, one write
           (rows up to ~1000 floats); max and sum as two plain shuffle reductions (exp once per element)
version 5: one block per row with the row held in registers and 16-byte loads, (max, sum) pairs combined by a
           block reduction: one read, one write (rows up to 32768 floats)
version 6: split row: a thread-block cluster (sm_90) per row, each block holds a slice in registers; the blocks'
           (max, sum) pairs are exchanged through distributed shared memory (long rows, e.g. 65536)
version 7: version 4 made persistent (one wave of blocks looping over rows), the next rows loaded into registers
           while the current ones are reduced and written
version 8: version 6 made persistent (one wave of clusters looping over rows), the next row's slice loaded before
           the cluster barrier of the current one; a cluster of 1 is a persistent block per row. Measured slower
           than 5 and 6 at every shape on the H100 (dev/softmax_NOTES.md), unlike its backward twin; kept as a step
version 9: the dispatcher the trainers should call: on the first call for a shape it times the applicable versions
           and block sizes (short rows 4/7, medium 5/6/8, long 6/8, always 3) and keeps the fastest
version 10: version 6 with fatter slices: up to 8 float4 per thread (a 65536-float row is a cluster of 8 blocks of
           256 threads instead of 16), a block per row when the row fits one block (no cluster barrier then),
           streaming cache hints (ld.global.nc.L1::no_allocate, st.global.cs)
version 11: version 4 with the streaming cache hints and the PDL hooks (griddepcontrol: trigger at entry, wait
           before the first global access; no-ops without the launch attribute)
version 12: version 11 launched with Programmatic Dependent Launch: its blocks become resident while the previous
           kernel of the stream finishes and start reading the moment it completes (they still wait for it)
version 13: version 10 launched with Programmatic Dependent Launch
version 14: the dispatcher of version 9 with versions 10-13 among the candidates
version 15: experiment: version 10 with the accesses of versions 4-8 (C++ float4; nvcc turns the stores into 4-byte
           STG), no cache hints
version 16: experiment: version 10 with 16-byte accesses through inline PTX but no cache hints

Semantics (as torch.softmax): a row whose max is -inf (all -inf), or that holds +inf or NaN, gives a NaN row;
-inf entries of any other row give exact zeros. Rows need not be 16-byte aligned (cols % 4 != 0): the 16-byte
loads run over the row's aligned 16-byte chunks and the first and last chunk fall back to scalar accesses.
*/
#include "softmax_common.cuh"  // error checking, launch templates, test/benchmark harness and CLI (shared with softmax_backward.cu)
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

// ----------------------------------------------------------------------------------------------------------------
// CPU reference (the oracle): float64 arithmetic, rounded to float once at the end.

void softmax_forward_cpu(float* y, const float* x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (size_t)r * cols;
        float* yr = y + (size_t)r * cols;
        double m = -INFINITY;
        bool bad = false;  // NaN or +inf in the row: torch gives a NaN row
        for (int c = 0; c < cols; c++) {
            if (std::isnan(xr[c]) || xr[c] == INFINITY) bad = true;
            m = std::max(m, (double)xr[c]);
        }
        if (bad || m == -INFINITY) {  // all -inf: torch gives NaN (exp(-inf - -inf))
            for (int c = 0; c < cols; c++) yr[c] = NAN;
            continue;
        }
        double s = 0.0;
        for (int c = 0; c < cols; c++) s += std::exp((double)xr[c] - m);
        for (int c = 0; c < cols; c++) yr[c] = (float)(std::exp((double)xr[c] - m) / s);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// device helpers

#define FULL_MASK 0xffffffffu

// Combines two partial softmax statistics (max m, sum s of exp(x - m)). A side with s == 0 holds no mass (all its
// elements are -inf, or it saw none) and is skipped: its exp(m - mn) would be exp(-inf - -inf) = NaN. A NaN s
// (NaN or +inf in the row) is not 0 and propagates, as in torch.
__device__ __forceinline__ void ms_combine(float& m, float& s, float m2, float s2) {
    float mn = fmaxf(m, m2);
    float a = (s == 0.0f) ? 0.0f : s * expf(m - mn);
    float b = (s2 == 0.0f) ? 0.0f : s2 * expf(m2 - mn);
    m = mn;
    s = a + b;
}

// Butterfly over groups of GROUP consecutive lanes: every lane of the group ends with the group's (m, s). The
// whole warp must call it (full-mask shuffles).
template <int GROUP>
__device__ __forceinline__ void group_reduce_ms(float& m, float& s) {
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, o);
        float s2 = __shfl_xor_sync(FULL_MASK, s, o);
        ms_combine(m, s, m2, s2);
    }
}

// Plain max and sum reductions: 1-2 instructions per butterfly level, against ~30 for a (max, sum) pair combine
// (two expf): with a few elements per thread the pair combine made the kernels instruction bound (measured on the
// H100: 82% of copy bandwidth at 65536x128 with pairs). The pair combine stays only across the blocks of a cluster.
template <int GROUP>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

template <int GROUP>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Every thread of the block ends with the block's max (IS_MAX) or sum. Each instantiation has its own shared array;
// callers in a loop separate two uses by at least one block-wide barrier.
template <int THREADS, bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32 of them");
    constexpr int WARPS = THREADS / 32;
    __shared__ float shared[WARPS];
    v = IS_MAX ? group_max<32>(v) : group_sum<32>(v);
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float w = lane < WARPS ? shared[lane] : (IS_MAX ? -INFINITY : 0.0f);
    return IS_MAX ? group_max<32>(w) : group_sum<32>(w);
}

// A row seen as 16-byte chunks of the aligned address frame: chunk c holds row elements [4c - off, 4c - off + 4),
// off = (row address / 4) % 4. Full chunks move as one float4 when vec (the pointer has the frame's alignment);
// the first and last chunk (partial) use scalar accesses of their valid elements only: no access leaves the row.
__device__ __forceinline__ int row_offset(const float* p) { return (int)(((uintptr_t)p >> 2) & 3); }

__device__ __forceinline__ float4 load_chunk(const float* row, int n, int off, int c, bool vec) {
    int lo = 4 * c - off;
    if (vec && lo >= 0 && lo + 4 <= n) return *reinterpret_cast<const float4*>(row + lo);
    float4 v;
    v.x = (unsigned)(lo + 0) < (unsigned)n ? row[lo + 0] : -INFINITY;
    v.y = (unsigned)(lo + 1) < (unsigned)n ? row[lo + 1] : -INFINITY;
    v.z = (unsigned)(lo + 2) < (unsigned)n ? row[lo + 2] : -INFINITY;
    v.w = (unsigned)(lo + 3) < (unsigned)n ? row[lo + 3] : -INFINITY;
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
__device__ __forceinline__ float thread_max(const float4 (&v)[N]) {
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < N; k++) m = fmaxf(m, fmaxf(fmaxf(v[k].x, v[k].y), fmaxf(v[k].z, v[k].w)));
    return m;
}

// v = exp(v - m), returns the sum. m = -inf (nothing finite) is taken as 0 so that -inf gives exact zeros and sum 0;
// an all -inf row then ends as 0 * (1 / 0) = NaN, as torch.
template <int N>
__device__ __forceinline__ float exp_sum(float4 (&v)[N], float m) {
    float ms = (m == -INFINITY) ? 0.0f : m;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < N; k++) {
        v[k].x = expf(v[k].x - ms); v[k].y = expf(v[k].y - ms);
        v[k].z = expf(v[k].z - ms); v[k].w = expf(v[k].w - ms);
        s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    }
    return s;
}

// Cluster versions: a block holds exp(x - m_block); y = exp(x - m_block) * (exp(m_block - M) / S). All -inf row:
// M = -inf, so the factor is exp(NaN) = NaN, the torch result; a block whose elements are all -inf in a finite row
// gets factor 0.
__device__ __forceinline__ float output_scale(float m_thread, float m_row, float s_row) {
    return expf(m_thread - m_row) / s_row;
}

template <int N>
__device__ __forceinline__ void scale_chunks(float4 (&v)[N], float f) {
#pragma unroll
    for (int k = 0; k < N; k++) { v[k].x *= f; v[k].y *= f; v[k].z *= f; v[k].w *= f; }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Cluster versions: every block has published its (m, s) in block_stats (a shared variable, the same in each block).
// After a cluster barrier warp 0 reads every block's pair through distributed shared memory and combines them into
// *row_stats; on return (block barrier) the whole block can read it.
__device__ __forceinline__ void cluster_row_stats(cg::cluster_group& cluster, int csize, float2* block_stats, float2* row_stats) {
    cluster.sync();
    if (threadIdx.x < 32) {
        float cm = -INFINITY, cs = 0.0f;
        if ((int)threadIdx.x < csize) {
            float2 p = *cluster.map_shared_rank(block_stats, (int)threadIdx.x);
            cm = p.x; cs = p.y;
        }
        group_reduce_ms<32>(cm, cs);
        if (threadIdx.x == 0) *row_stats = make_float2(cm, cs);
    }
    __syncthreads();
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// GPU kernels

// version 1: one thread per row, three passes: max, sum of exp, write.
__global__ void softmax_forward_kernel1(float* y, const float* x, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    float m = -INFINITY;
    for (int c = 0; c < cols; c++) m = fmaxf(m, xr[c]);
    // Summed in blocks of 256: one fp32 accumulator over a whole long row drops the terms under half an ulp of the
    // growing sum (measured on the H100: 7e-5 relative error at 65537 columns, 3e-4 at 131073).
    float s = 0.0f;
    for (int c0 = 0; c0 < cols; c0 += 256) {
        float part = 0.0f;
        for (int c = c0; c < min(c0 + 256, cols); c++) part += expf(xr[c] - m);
        s += part;
    }
    for (int c = 0; c < cols; c++) yr[c] = expf(xr[c] - m) / s;
}

// Online update of (m, s) with one element; -inf elements carry no mass and are skipped (exp(-inf - -inf)).
__device__ __forceinline__ void online_update(float& m, float& s, float v) {
    if (v == -INFINITY) return;
    float mn = fmaxf(m, v);
    s = s * expf(m - mn) + expf(v - mn);
    m = mn;
}

// version 2: one thread per row, online softmax: max and sum in one pass, then the write pass.
__global__ void softmax_forward_kernel2(float* y, const float* x, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    // (m, s) of blocks of 256 elements combined into the row's: one running sum over a long row loses precision
    // as in version 1
    float m = -INFINITY, s = 0.0f;
    for (int c0 = 0; c0 < cols; c0 += 256) {
        float bm = -INFINITY, bs = 0.0f;
        for (int c = c0; c < min(c0 + 256, cols); c++) online_update(bm, bs, xr[c]);
        ms_combine(m, s, bm, bs);
    }
    float inv = 1.0f / s;
    for (int c = 0; c < cols; c++) yr[c] = expf(xr[c] - m) * inv;
}

// version 3: one warp per row; coalesced scalar loads, online (m, s) per lane, warp butterfly, second read to write.
__global__ void softmax_forward_kernel3(float* y, const float* x, int rows, int cols) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows) return;  // whole warps leave together: the warp's row index is uniform
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    float m = -INFINITY, s = 0.0f;
    for (int c = lane; c < cols; c += 32) online_update(m, s, xr[c]);
    group_reduce_ms<32>(m, s);
    float inv = 1.0f / s;
    for (int c = lane; c < cols; c += 32) yr[c] = expf(xr[c] - m) * inv;
}

// version 4: GROUP lanes per row (GROUP in 4..32), CHUNKS float4 per lane held in registers: one read, one write.
template <int GROUP, int CHUNKS>
__global__ void __launch_bounds__(1024) softmax_forward_kernel4(float* y, const float* x, int rows, int cols) {
    static_assert(GROUP >= 1 && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0, "a group is a power-of-2 part of a warp");
    int r = blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
    int g = threadIdx.x % GROUP;
    // No early return: every lane of the warp takes part in the shuffles; rows past the end see n = 0.
    int n = r < rows ? cols : 0;
    const float* xr = x + (size_t)(r < rows ? r : 0) * cols;
    float* yr = y + (size_t)(r < rows ? r : 0) * cols;
    int off = row_offset(xr);
    bool vec_y = row_offset(yr) == off;
    float4 v[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) v[k] = load_chunk(xr, n, off, g + GROUP * k, true);
    float m = group_max<GROUP>(thread_max(v));
    float s = group_sum<GROUP>(exp_sum(v, m));
    scale_chunks(v, 1.0f / s);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) store_chunk(yr, n, off, g + GROUP * k, vec_y, v[k]);
}

// version 5: one block of THREADS per row, CHUNKS float4 per thread in registers, block reduction of (m, s).
template <int THREADS, int CHUNKS>
__global__ void __launch_bounds__(THREADS) softmax_forward_kernel5(float* y, const float* x, int rows, int cols) {
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* yr = y + (size_t)blockIdx.x * cols;
    int off = row_offset(xr);
    bool vec_y = row_offset(yr) == off;
    float4 v[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) v[k] = load_chunk(xr, cols, off, threadIdx.x + THREADS * k, true);
    float m = block_reduce<THREADS, true>(thread_max(v));
    float s = block_reduce<THREADS, false>(exp_sum(v, m));
    scale_chunks(v, 1.0f / s);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) store_chunk(yr, cols, off, threadIdx.x + THREADS * k, vec_y, v[k]);
}

// version 6: a cluster of blocks per row (sm_90). The row's chunks are split into equal contiguous slices, one per
// block; each block reduces its slice to (m, s), publishes it in shared memory, and after a cluster barrier warp 0
// reads every block's pair through distributed shared memory. A second (split) barrier keeps each block's shared
// memory alive until all blocks of the cluster have read it.
template <int THREADS, int CHUNKS>
__global__ void __launch_bounds__(THREADS) softmax_forward_kernel6(float* y, const float* x, int rows, int cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    int csize = (int)cluster.num_blocks();
    int rank = (int)cluster.block_rank();
    int r = blockIdx.x / csize;
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    int off = row_offset(xr);
    bool vec_y = row_offset(yr) == off;
    int c0, c1;
    cluster_slice(off, cols, csize, rank, c0, c1);
    float4 v[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        int c = c0 + threadIdx.x + THREADS * k;
        v[k] = c < c1 ? load_chunk(xr, cols, off, c, true) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    }
    float m = block_reduce<THREADS, true>(thread_max(v));  // the block's max; exp is taken against it
    float s = block_reduce<THREADS, false>(exp_sum(v, m));
    __shared__ float2 block_stats, row_stats;
    if (threadIdx.x == 0) block_stats = make_float2(m, s);
    cluster_row_stats(cluster, csize, &block_stats, &row_stats);
    auto token = cluster.barrier_arrive();  // this block is done reading the others' shared memory
    float2 rs = row_stats;
    scale_chunks(v, output_scale(m, rs.x, rs.y));
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        int c = c0 + threadIdx.x + THREADS * k;
        if (c < c1) store_chunk(yr, cols, off, c, vec_y, v[k]);
    }
    cluster.barrier_wait(std::move(token));  // others may still read block_stats
#else
    __trap();  // the host launches version 6 only on sm_90+
#endif
}

// version 7: version 4 made persistent: one wave of blocks, each warp loops over rows and loads its next rows into
// a second set of registers before it reduces and writes the current ones, so loads stay in flight across the
// shuffles and the stores, and no block is launched per handful of rows.
template <int GROUP, int CHUNKS>
__global__ void __launch_bounds__(256) softmax_forward_kernel7(float* y, const float* x, int rows, int cols) {
    constexpr int ROWS_PER_WARP = 32 / GROUP;
    int lane = threadIdx.x % 32, g = lane % GROUP, sub = lane / GROUP;
    int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int step = gridDim.x * (blockDim.x / 32) * ROWS_PER_WARP;
    float4 cur[CHUNKS], nxt[CHUNKS];
    auto load_rows = [&](float4 (&v)[CHUNKS], int r) {  // rows past the end load nothing (-inf)
        int n = r < rows ? cols : 0;
        const float* xr = x + (size_t)(r < rows ? r : 0) * cols;
        int off = row_offset(xr);
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) v[k] = load_chunk(xr, n, off, g + GROUP * k, true);
    };
    int base = warp * ROWS_PER_WARP;  // the warp's first row; the loop count is uniform across the warp
    load_rows(cur, base + sub);
    for (; base < rows; base += step) {
        if (base + step < rows) load_rows(nxt, base + step + sub);
        int r = base + sub;
        int n = r < rows ? cols : 0;
        const float* xr = x + (size_t)(r < rows ? r : 0) * cols;
        float* yr = y + (size_t)(r < rows ? r : 0) * cols;
        int off = row_offset(xr);
        bool vec_y = row_offset(yr) == off;
        float m = group_max<GROUP>(thread_max(cur));
        float s = group_sum<GROUP>(exp_sum(cur, m));
        scale_chunks(cur, 1.0f / s);
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) store_chunk(yr, n, off, g + GROUP * k, vec_y, cur[k]);
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) cur[k] = nxt[k];
    }
}

// version 8: version 6 made persistent (sm_90): one wave of clusters, each loops over rows; the next row's slice is
// loaded into a second set of registers before the cluster barrier of the current row, so the barrier's latency is
// covered by loads in flight. The blocks' (m, s) pairs alternate between two shared slots, so a block never
// overwrites a pair another block may still be reading (it writes a slot again only two barriers later).
// A cluster of 1 is a persistent block per row.
template <int THREADS, int CHUNKS>
__global__ void __launch_bounds__(THREADS) softmax_forward_kernel8(float* y, const float* x, int rows, int cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    int csize = (int)cluster.num_blocks();
    int rank = (int)cluster.block_rank();
    int n_clusters = gridDim.x / csize;
    __shared__ float2 block_stats[2];
    __shared__ float2 row_stats;
    float4 cur[CHUNKS], nxt[CHUNKS];
    auto slice = [&](int r, int& off, int& c0, int& c1) {
        off = row_offset(x + (size_t)r * cols);
        cluster_slice(off, cols, csize, rank, c0, c1);
    };
    auto load_slice = [&](float4 (&v)[CHUNKS], int r) {
        int off, c0, c1;
        slice(r, off, c0, c1);
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) {
            int c = c0 + threadIdx.x + THREADS * k;
            v[k] = c < c1 ? load_chunk(x + (size_t)r * cols, cols, off, c, true)
                          : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        }
    };
    int r = blockIdx.x / csize;  // every block of a cluster walks the same rows: the barrier counts match
    if (r < rows) load_slice(cur, r);
    for (int parity = 0; r < rows; r += n_clusters, parity ^= 1) {
        if (r + n_clusters < rows) load_slice(nxt, r + n_clusters);
        float m = block_reduce<THREADS, true>(thread_max(cur));  // the block's max; exp is taken against it
        float s = block_reduce<THREADS, false>(exp_sum(cur, m));
        if (threadIdx.x == 0) block_stats[parity] = make_float2(m, s);
        cluster_row_stats(cluster, csize, &block_stats[parity], &row_stats);
        float2 rs = row_stats;
        scale_chunks(cur, output_scale(m, rs.x, rs.y));
        int off, c0, c1;
        slice(r, off, c0, c1);
        float* yr = y + (size_t)r * cols;
        bool vec_y = row_offset(yr) == off;
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) {
            int c = c0 + threadIdx.x + THREADS * k;
            if (c < c1) store_chunk(yr, cols, off, c, vec_y, cur[k]);
        }
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) cur[k] = nxt[k];
    }
    cluster.sync();  // keep this block's shared memory alive until every block of the cluster has read it
#else
    __trap();  // the host launches version 8 only on sm_90+
#endif
}

// How versions 10-16 access a row's full 16-byte chunks. STREAM (10-13): ld.global.nc.L1::no_allocate and
// st.global.cs through inline PTX. V4 (16): plain 16-byte ld/st through inline PTX. PLAIN (15): load_chunk /
// store_chunk as versions 4-8, whose float4 store nvcc 13.0 merges with the scalar fallback of partial chunks: the
// SASS of versions 4-8 holds (almost) only 4-byte STG; inline PTX keeps the 16-byte STG.
enum Access { PLAIN, V4, STREAM };

template <int ACCESS>
__device__ __forceinline__ float4 load_chunk_acc(const float* row, int n, int off, int c) {
    int lo = 4 * c - off;
    if (ACCESS != PLAIN && lo >= 0 && lo + 4 <= n) return ACCESS == STREAM ? ld_stream(row + lo) : ld_v4(row + lo);
    return load_chunk(row, n, off, c, ACCESS == PLAIN);
}

template <int ACCESS>
__device__ __forceinline__ void store_chunk_acc(float* row, int n, int off, int c, bool vec, float4 v) {
    int lo = 4 * c - off;
    if (ACCESS != PLAIN && vec && lo >= 0 && lo + 4 <= n) {
        if (ACCESS == STREAM) st_stream(row + lo, v);
        else st_v4(row + lo, v);
        return;
    }
    store_chunk(row, n, off, c, ACCESS == PLAIN && vec, v);
}

// versions 10, 13, 15, 16: split row, non-persistent, fat slices (sm_90). As version 6, but CHUNKS (up to 8 float4, 32
// floats) per thread instead of 4, so a block keeps twice the bytes in flight and a 65536-float row needs a cluster of
// 8 blocks of 256 threads (portable) instead of 16; a cluster of 1 (rows up to 8 * THREADS chunks) skips the cluster
// barrier: a block per row. ACCESS: how full chunks are read and written (STREAM for 10 and 13, PLAIN for 15, V4 for
// 16). The PDL hooks: trigger at entry, wait before the first read (no-ops unless launched with the attribute, version
// 13). At most 64 registers (the minimum blocks per SM of the launch
// bounds): without the cap <256, 8> took 70, 3 blocks per SM instead of 4.
template <int THREADS, int CHUNKS, int ACCESS>
__global__ void __launch_bounds__(THREADS, 65536 / (THREADS * 64)) softmax_forward_kernel10(float* y, const float* x, int rows, int cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    pdl_trigger();
    cg::cluster_group cluster = cg::this_cluster();
    int csize = (int)cluster.num_blocks();
    int rank = (int)cluster.block_rank();
    int r = blockIdx.x / csize;
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    int off = row_offset(xr);
    bool vec_y = row_offset(yr) == off;
    int c0, c1;
    cluster_slice(off, cols, csize, rank, c0, c1);
    pdl_wait();
    float4 v[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) {
        int c = c0 + threadIdx.x + THREADS * k;
        v[k] = c < c1 ? load_chunk_acc<ACCESS>(xr, cols, off, c) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    }
    float m = block_reduce<THREADS, true>(thread_max(v));  // the block's max; exp is taken against it
    float s = block_reduce<THREADS, false>(exp_sum(v, m));
    auto scale_store = [&](float f) {
        scale_chunks(v, f);
#pragma unroll
        for (int k = 0; k < CHUNKS; k++) {
            int c = c0 + threadIdx.x + THREADS * k;
            if (c < c1) store_chunk_acc<ACCESS>(yr, cols, off, c, vec_y, v[k]);
        }
    };
    if (csize == 1) {
        scale_store(1.0f / s);  // as version 5: the block holds the whole row
    } else {
        __shared__ float2 block_stats, row_stats;
        if (threadIdx.x == 0) block_stats = make_float2(m, s);
        cluster_row_stats(cluster, csize, &block_stats, &row_stats);
        auto token = cluster.barrier_arrive();  // this block is done reading the others' shared memory
        float2 rs = row_stats;
        scale_store(output_scale(m, rs.x, rs.y));
        cluster.barrier_wait(std::move(token));  // others may still read block_stats
    }
#else
    __trap();  // the host launches versions 10, 13, 15 and 16 only on sm_90+
#endif
}

// versions 11 and 12: version 4 (GROUP lanes per row, the row in registers) with streaming hints and the PDL hooks:
// trigger at entry, wait before the first read (no-ops unless launched with the attribute, version 12).
template <int GROUP, int CHUNKS>
__global__ void __launch_bounds__(1024) softmax_forward_kernel11(float* y, const float* x, int rows, int cols) {
    static_assert(GROUP >= 1 && GROUP <= 32 && (GROUP & (GROUP - 1)) == 0, "a group is a power-of-2 part of a warp");
    pdl_trigger();
    int r = blockIdx.x * (blockDim.x / GROUP) + threadIdx.x / GROUP;
    int g = threadIdx.x % GROUP;
    int n = r < rows ? cols : 0;  // no early return: the whole warp takes part in the shuffles
    const float* xr = x + (size_t)(r < rows ? r : 0) * cols;
    float* yr = y + (size_t)(r < rows ? r : 0) * cols;
    int off = row_offset(xr);
    bool vec_y = row_offset(yr) == off;
    pdl_wait();
    float4 v[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) v[k] = load_chunk_acc<STREAM>(xr, n, off, g + GROUP * k);
    float m = group_max<GROUP>(thread_max(v));
    float s = group_sum<GROUP>(exp_sum(v, m));
    scale_chunks(v, 1.0f / s);
#pragma unroll
    for (int k = 0; k < CHUNKS; k++) store_chunk_acc<STREAM>(yr, n, off, g + GROUP * k, vec_y, v[k]);
}

// ----------------------------------------------------------------------------------------------------------------
// launchers. Each returns nullptr on success, or why the version does not handle this shape / device.

static int g_cc_major = 0;  // compute capability of the current device, set in main
static int g_num_sms = 0;   // set in main

// Number of 16-byte chunks a row spans in the worst case: rows start at 4-byte offsets 0..3 within 16 bytes unless
// x is 16-byte aligned and cols % 4 == 0.
static int max_row_chunks(const float* x, int cols) {
    int max_off = ((uintptr_t)x % 16 == 0 && cols % 4 == 0) ? 0 : 3;
    return (max_off + cols + 3) / 4;
}

static const char* launch_forward1(float* y, const float* x, int rows, int cols, int block_size) {
    softmax_forward_kernel1<<<ceil_div(rows, block_size), block_size, 0, g_stream>>>(y, x, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_forward2(float* y, const float* x, int rows, int cols, int block_size) {
    softmax_forward_kernel2<<<ceil_div(rows, block_size), block_size, 0, g_stream>>>(y, x, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_forward3(float* y, const float* x, int rows, int cols, int block_size) {
    softmax_forward_kernel3<<<ceil_div((long long)rows * 32, block_size), block_size, 0, g_stream>>>(y, x, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

template <int GROUP, int CHUNKS>
static const char* launch4(float* y, const float* x, int rows, int cols, int block_size) {
    int rows_per_block = block_size / GROUP;
    softmax_forward_kernel4<GROUP, CHUNKS><<<ceil_div(rows, rows_per_block), block_size, 0, g_stream>>>(y, x, rows,
                                                                                                       cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_forward4(float* y, const float* x, int rows, int cols, int block_size) {
    return by_row_chunks(max_row_chunks(x, cols), "row longer than 256 chunks of 16 bytes (version 4 is for short rows)",
                         [&](auto group, auto chunks) {
                             return launch4<decltype(group)::value, decltype(chunks)::value>(y, x, rows, cols, block_size);
                         });
}

template <int THREADS>
static const char* launch5_threads(float* y, const float* x, int rows, int cols) {
    int per_thread = next_pow2(ceil_div(max_row_chunks(x, cols), THREADS));
    switch (per_thread) {
        case 1: softmax_forward_kernel5<THREADS, 1><<<rows, THREADS, 0, g_stream>>>(y, x, rows, cols); break;
        case 2: softmax_forward_kernel5<THREADS, 2><<<rows, THREADS, 0, g_stream>>>(y, x, rows, cols); break;
        case 4: softmax_forward_kernel5<THREADS, 4><<<rows, THREADS, 0, g_stream>>>(y, x, rows, cols); break;
        case 8: softmax_forward_kernel5<THREADS, 8><<<rows, THREADS, 0, g_stream>>>(y, x, rows, cols); break;
        default: return "row does not fit in the registers of one block at this block size (max 8 float4 per thread)";
    }
    cudaCheck(cudaGetLastError());
    return nullptr;
}

// block_size 0 picks the smallest block that holds the row in at most 4 float4 per thread.
static int default_block5(const float* x, int cols) {
    return std::min(1024, std::max(128, next_pow2(ceil_div(max_row_chunks(x, cols), 4))));
}

static const char* launch_forward5(float* y, const float* x, int rows, int cols, int block_size) {
    if (block_size == 0) block_size = default_block5(x, cols);
    return by_block_size(block_size, "version 5 block size must be 128, 256, 512 or 1024",
                         [&](auto threads) { return launch5_threads<decltype(threads)::value>(y, x, rows, cols); });
}

constexpr int CHUNKS6 = 4;  // float4 per thread in version 6: 16 floats of registers
constexpr int MAX_CLUSTER = 16;  // H100 allows 16 with the non-portable attribute (8 is portable)

// The cluster size (a power of 2) whose blocks hold a row at block_chunks float4 each, or why there is none.
static const char* cluster_size(const float* x, int cols, int block_chunks, int& cluster) {
    if (g_cc_major < 9) return "thread-block clusters need sm_90";
    cluster = next_pow2(ceil_div(max_row_chunks(x, cols), block_chunks));
    if (cluster > MAX_CLUSTER) return "row longer than 16 blocks of registers at this block size";
    return nullptr;
}

template <int THREADS>
static const char* launch6_threads(float* y, const float* x, int rows, int cols) {
    int cluster = 0;
    if (const char* why = cluster_size(x, cols, THREADS * CHUNKS6, cluster)) return why;
    if ((long long)rows * cluster > 0x7fffffffLL) return "grid too large";
    auto kernel = softmax_forward_kernel6<THREADS, CHUNKS6>;
    static int checked_cluster = 0, schedulable = 0;  // the attribute and occupancy query once per cluster size
    ClusterLaunch launch(THREADS, cluster);
    launch.config.gridDim = dim3((unsigned)(rows * cluster));
    if (checked_cluster != cluster) {
        schedulable = max_active_clusters(kernel, launch.config) > 0;
        checked_cluster = cluster;
    }
    if (!schedulable) return "this cluster size cannot be scheduled on the device";
    cudaCheck(cudaLaunchKernelEx(&launch.config, kernel, y, x, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_forward6(float* y, const float* x, int rows, int cols, int block_size) {
    return by_block_size(block_size ? block_size : 512, "version 6 block size must be 128, 256, 512 or 1024",
                         [&](auto threads) { return launch6_threads<decltype(threads)::value>(y, x, rows, cols); });
}

template <int GROUP, int CHUNKS>
static const char* launch7(float* y, const float* x, int rows, int cols, int block_size) {
    auto kernel = softmax_forward_kernel7<GROUP, CHUNKS>;
    static int per_sm[1025] = {0};  // occupancy, queried once per block size
    if (per_sm[block_size] == 0) cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm[block_size], kernel, block_size, 0));
    int rows_per_block = block_size / GROUP;
    int grid = std::max(1, std::min(ceil_div(rows, rows_per_block), per_sm[block_size] * g_num_sms));
    kernel<<<grid, block_size, 0, g_stream>>>(y, x, rows, cols);
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_forward7(float* y, const float* x, int rows, int cols, int block_size) {
    if (block_size > 256) return "version 7 runs at most 256 threads per block";
    return by_row_chunks(max_row_chunks(x, cols), "row longer than 256 chunks of 16 bytes (version 7 is for short rows)",
                         [&](auto group, auto chunks) {
                             return launch7<decltype(group)::value, decltype(chunks)::value>(y, x, rows, cols, block_size);
                         });
}

constexpr int CHUNKS8 = 4;  // float4 per thread and row in version 8 (twice that in registers with the prefetch)

template <int THREADS>
static const char* launch8_threads(float* y, const float* x, int rows, int cols) {
    int cluster = 0;
    if (const char* why = cluster_size(x, cols, THREADS * CHUNKS8, cluster)) return why;
    auto kernel = softmax_forward_kernel8<THREADS, CHUNKS8>;
    static int max_clusters[MAX_CLUSTER + 1] = {0};  // clusters resident at once, queried once per cluster size
    ClusterLaunch launch(THREADS, cluster);
    if (max_clusters[cluster] == 0) {
        launch.config.gridDim = dim3((unsigned)(cluster * 1024));
        max_clusters[cluster] = max_active_clusters(kernel, launch.config);
        if (max_clusters[cluster] == 0) max_clusters[cluster] = -1;
    }
    if (max_clusters[cluster] < 0) return "this cluster size cannot be scheduled on the device";
    launch.config.gridDim = dim3((unsigned)(std::min(rows, max_clusters[cluster]) * cluster));
    cudaCheck(cudaLaunchKernelEx(&launch.config, kernel, y, x, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_forward8(float* y, const float* x, int rows, int cols, int block_size) {
    return by_block_size(block_size ? block_size : 512, "version 8 block size must be 128, 256, 512 or 1024",
                         [&](auto threads) { return launch8_threads<decltype(threads)::value>(y, x, rows, cols); });
}

static const char* softmax_forward(int version, float* y, const float* x, int rows, int cols, int block_size);
// versions 10 and 13: CHUNKS float4 per thread, the smallest power of 2 that holds the row in one block, up to 8;
// longer rows take a cluster of the smallest power-of-2 size that holds them at 8.
constexpr int MAX_CHUNKS10 = 8;

template <int THREADS, int CHUNKS, int ACCESS>
static const char* launch10(float* y, const float* x, int rows, int cols, int cluster, bool pdl) {
    auto kernel = softmax_forward_kernel10<THREADS, CHUNKS, ACCESS>;
    static int schedulable[MAX_CLUSTER + 1] = {0};  // 1 yes, -1 no; the occupancy query once per cluster size
    if (schedulable[cluster] == 0) {
        ClusterLaunch probe(THREADS, cluster);
        probe.config.gridDim = dim3((unsigned)(rows * cluster));
        schedulable[cluster] = max_active_clusters(kernel, probe.config) > 0 ? 1 : -1;
    }
    if (schedulable[cluster] < 0) return "this cluster size cannot be scheduled on the device";
    ExLaunch launch(THREADS, cluster, pdl);
    launch.config.gridDim = dim3((unsigned)(rows * cluster));
    cudaCheck(cudaLaunchKernelEx(&launch.config, kernel, y, x, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

template <int THREADS, int ACCESS>
static const char* launch10_threads(float* y, const float* x, int rows, int cols, bool pdl) {
    if (g_cc_major < 9) return "thread-block clusters and PDL need sm_90";
    int need = max_row_chunks(x, cols);
    int cluster = 1, per_thread = next_pow2(ceil_div(need, THREADS));
    if (per_thread > MAX_CHUNKS10) {
        per_thread = MAX_CHUNKS10;
        cluster = next_pow2(ceil_div(need, THREADS * MAX_CHUNKS10));
    }
    if (cluster > MAX_CLUSTER) return "row longer than 16 blocks of 8 float4 per thread at this block size";
    if ((long long)rows * cluster > 0x7fffffffLL) return "grid too large";
    switch (per_thread) {
        case 1: return launch10<THREADS, 1, ACCESS>(y, x, rows, cols, cluster, pdl);
        case 2: return launch10<THREADS, 2, ACCESS>(y, x, rows, cols, cluster, pdl);
        case 4: return launch10<THREADS, 4, ACCESS>(y, x, rows, cols, cluster, pdl);
        default: return launch10<THREADS, 8, ACCESS>(y, x, rows, cols, cluster, pdl);
    }
}

template <int ACCESS>
static const char* launch_forward10(float* y, const float* x, int rows, int cols, int block_size, bool pdl) {
    return by_block_size(block_size ? block_size : 256, "versions 10, 13, 15, 16: block size must be 128, 256, 512 or 1024",
                         [&](auto threads) { return launch10_threads<decltype(threads)::value, ACCESS>(y, x, rows, cols, pdl); });
}

template <int GROUP, int CHUNKS>
static const char* launch11(float* y, const float* x, int rows, int cols, int block_size, bool pdl) {
    ExLaunch launch(block_size, 0, pdl);
    launch.config.gridDim = dim3((unsigned)ceil_div(rows, block_size / GROUP));
    cudaCheck(cudaLaunchKernelEx(&launch.config, softmax_forward_kernel11<GROUP, CHUNKS>, y, x, rows, cols));
    cudaCheck(cudaGetLastError());
    return nullptr;
}

static const char* launch_forward11(float* y, const float* x, int rows, int cols, int block_size, bool pdl) {
    if (pdl && g_cc_major < 9) return "Programmatic Dependent Launch needs sm_90";
    return by_row_chunks(max_row_chunks(x, cols), "row longer than 256 chunks of 16 bytes (versions 11 and 12 are for short rows)",
                         [&](auto group, auto chunks) {
                             return launch11<decltype(group)::value, decltype(chunks)::value>(y, x, rows, cols, block_size, pdl);
                         });
}

// The autotuning dispatchers (versions 9 and 14): on the first call for a (rows, cols, alignment) each candidate
// (version, block size) is launched once (warm-up, skipped if it does not apply) and timed over three launches on the
// caller's buffers (version 14: ten; every candidate writes the full output, the chosen one runs last); the fastest is
// cached and later calls launch it directly. Version 3 is always a candidate (it applies everywhere).
struct ForwardChoice { int rows, cols, align, version, block_size; };

static const char* tuned_launch(std::vector<ForwardChoice>& cache, std::vector<std::pair<int, int>> candidates, float* y,
                                const float* x, int rows, int cols, int timed_launches = 3) {
    int align = (int)((uintptr_t)x % 16) * 16 + (int)((uintptr_t)y % 16);
    for (const ForwardChoice& c : cache)
        if (c.rows == rows && c.cols == cols && c.align == align) return softmax_forward(c.version, y, x, rows, cols, c.block_size);
    candidates.push_back({3, 256});
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    ForwardChoice best = {rows, cols, align, 3, 256};
    float best_ms = INFINITY;
    for (auto [version, bs] : candidates) {
        if (softmax_forward(version, y, x, rows, cols, bs)) continue;  // does not apply (shape, device)
        cudaCheck(cudaEventRecord(start, g_stream));
        for (int k = 0; k < timed_launches; k++) softmax_forward(version, y, x, rows, cols, bs);
        cudaCheck(cudaEventRecord(stop, g_stream));
        cudaCheck(cudaEventSynchronize(stop));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        if (ms < best_ms) { best_ms = ms; best.version = version; best.block_size = bs; }
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    cache.push_back(best);
    return softmax_forward(best.version, y, x, rows, cols, best.block_size);
}

// Which version and block size a dispatcher picked for a shape (for the benchmark's report); "" if not tuned yet.
static std::string tuned_choice(const std::vector<ForwardChoice>& cache, int rows, int cols) {
    for (const ForwardChoice& c : cache)
        if (c.rows == rows && c.cols == cols) return "v" + std::to_string(c.version) + " b" + std::to_string(c.block_size);
    return "";
}


// version 9: the dispatcher (tuned_launch above). Candidates by row length: short rows (<= 256 chunks of 16 bytes) a
// group of lanes per row (4, 7); medium (<= 4096 chunks) a block (5) or cluster (6, 8) per row; long rows clusters
// (6, 8); version 3 where none applies.
static std::vector<ForwardChoice> g_forward9_cache;

static const char* launch_forward9(float* y, const float* x, int rows, int cols, int block_size) {
    (void)block_size;
    int need = max_row_chunks(x, cols);
    std::vector<std::pair<int, int>> candidates;
    if (need <= 256) candidates = {{4, 64}, {4, 256}, {7, 128}, {7, 256}};
    else if (need <= 4096) candidates = {{5, 128}, {5, 256}, {5, 512}, {5, 1024}, {6, 128}, {6, 256}, {6, 512}, {8, 128}, {8, 256}, {8, 512}};
    else candidates = {{6, 128}, {6, 256}, {6, 512}, {8, 128}, {8, 256}, {8, 512}, {8, 1024}};
    return tuned_launch(g_forward9_cache, candidates, y, x, rows, cols);
}

// version 14: the dispatcher of version 9 with the candidates of versions 10-13 added (the PDL versions 12 and 13
// among them: a pick of those launches with Programmatic Dependent Launch).
static std::vector<ForwardChoice> g_forward14_cache;

static const char* launch_forward14(float* y, const float* x, int rows, int cols, int block_size) {
    (void)block_size;
    int need = max_row_chunks(x, cols);
    std::vector<std::pair<int, int>> candidates;
    if (need <= 256)
        candidates = {{4, 64}, {4, 256}, {7, 128}, {7, 256}, {11, 64}, {11, 256}, {12, 64}, {12, 256}};
    else if (need <= 4096)
        candidates = {{5, 128}, {5, 256}, {5, 512}, {5, 1024}, {6, 256}, {6, 512}, {10, 128}, {10, 256}, {10, 512},
                      {13, 128}, {13, 256}, {13, 512}};
    else
        candidates = {{6, 128}, {6, 256}, {6, 512}, {8, 256}, {8, 512}, {10, 128}, {10, 256}, {10, 512}, {13, 128},
                      {13, 256}, {13, 512}};
    // 10 timed launches per candidate: with 3, picks between candidates within a few percent were noise (measured:
    // v12 b64 picked at 2692 GB/s at 4096x1024 where v12 b256 ran 2723)
    return tuned_launch(g_forward14_cache, candidates, y, x, rows, cols, 10);
}

constexpr int NUM_VERSIONS = 16;

// The dispatcher. block_size 0 = the version's default.
static const char* softmax_forward(int version, float* y, const float* x, int rows, int cols, int block_size) {
    switch (version) {
        case 1: return launch_forward1(y, x, rows, cols, block_size ? block_size : 128);
        case 2: return launch_forward2(y, x, rows, cols, block_size ? block_size : 128);
        case 3: return launch_forward3(y, x, rows, cols, block_size ? block_size : 256);
        case 4: return launch_forward4(y, x, rows, cols, block_size ? block_size : 256);
        case 5: return launch_forward5(y, x, rows, cols, block_size);
        case 6: return launch_forward6(y, x, rows, cols, block_size);
        case 7: return launch_forward7(y, x, rows, cols, block_size ? block_size : 256);
        case 8: return launch_forward8(y, x, rows, cols, block_size);
        case 9: return launch_forward9(y, x, rows, cols, block_size);
        case 10: return launch_forward10<STREAM>(y, x, rows, cols, block_size, false);
        case 11: return launch_forward11(y, x, rows, cols, block_size ? block_size : 256, false);
        case 12: return launch_forward11(y, x, rows, cols, block_size ? block_size : 256, true);
        case 13: return launch_forward10<STREAM>(y, x, rows, cols, block_size, true);
        case 14: return launch_forward14(y, x, rows, cols, block_size);
        case 15: return launch_forward10<PLAIN>(y, x, rows, cols, block_size, false);
        case 16: return launch_forward10<V4>(y, x, rows, cols, block_size, false);
        default:
            fprintf(stderr, "Invalid version %d: expected 1..%d\n", version, NUM_VERSIONS);
            exit(EXIT_FAILURE);
    }
}

// Block sizes checked in --test and timed in the benchmark (0 = the version's default).
static std::vector<int> block_sizes_of(int version) {
    switch (version) {
        case 4: case 11: case 12: return {64, 256, 1024};
        case 5: case 6: case 8: case 10: case 13: case 15: case 16: return {128, 256, 512, 1024};
        case 7: return {128, 256};
        default: return {0};
    }
}

#ifndef DEV_KERNELS_ONLY  // dev/torch_ops includes this file for its kernels and launchers: the test suite,
                          // the benchmark and main stay out

// ----------------------------------------------------------------------------------------------------------------
// test and benchmark support

// Tolerance of a float32 softmax against the float64 oracle, per element: |y - ref| <= ATOL + rtol(cols) * |ref|.
//  ATOL 1e-10: elements below it are under 1e-3 ulp of the row's sum (1.0), they cannot change any result.
//  rtol = 8e-6 + 2*eps*sqrt(cols): expf (<= 2 ulp), the rounding of x - max (|x - max| <= ~60 ulp-scaled: 60 * eps/2 =
//  3.6e-6 at our widest inputs), the final multiply/divide; plus the fp32 sum of cols positive terms, whose rounding
//  error grows like eps*sqrt(n) (2 sigma margin for one thread summing the whole row, versions 1 and 2).
// -inf inputs in a row with a finite max must give exactly 0; NaN references (NaN rows) must give NaN.
constexpr double ATOL = 1e-10;
static double rtol_for(int cols) { return 8e-6 + 2.0 * 1.1920929e-7 * std::sqrt((double)cols); }

// The test suite's and the benchmark's check of an output against the oracle (x: the input, for the -inf rule).
static CompareResult compare_forward(const float* out, const float* ref, const float* x, size_t n, int cols) {
    return compare(out, ref, n, ATOL, rtol_for(cols), x);
}

// ----------------------------------------------------------------------------------------------------------------
// the --test suite

static void test_fixture(Tally& tally, const char* path) {
    int n_cases = 0;
    std::vector<FixtureTensor> t;
    if (!load_fixture(tally, path, n_cases, t)) return;
    for (int k = 0; k < n_cases; k++) {
        const FixtureTensor& x = t[4 * k];
        const FixtureTensor& y = t[4 * k + 1];
        int rows = x.shape[0], cols = x.shape[1];
        std::vector<float> out(x.data.size());
        softmax_forward_cpu(out.data(), x.data.data(), rows, cols);
        CompareResult c = compare_forward(out.data(), y.data.data(), x.data.data(), out.size(), cols);
        char name[128];
        snprintf(name, sizeof name, "cpu oracle vs torch.softmax fixture case%d %dx%d", k, rows, cols);
        report(tally, c.ok, name, describe(c, cols, out.data(), y.data.data()));
    }
}

// Properties of the oracle itself (no GPU, no fixture): rows sum to 1, shift invariance, -inf gives 0.
static void test_oracle_properties(Tally& tally, Rng& rng) {
    int rows = 5, cols = 777;
    std::vector<float> x((size_t)rows * cols), x2(x.size()), y(x.size()), y2(x.size());
    fill_input(x.data(), rows, cols, RANDN, rng);
    // inputs on a 2^-10 grid within +-60: x + 64 is exact in fp32, so the shifted row must give bitwise the same y
    for (size_t i = 0; i < x.size(); i++) x[i] = std::round(std::min(60.0f, std::max(-60.0f, x[i])) * 1024.0f) / 1024.0f;
    x[5] = -INFINITY;
    for (size_t i = 0; i < x.size(); i++) x2[i] = x[i] + 64.0f;
    softmax_forward_cpu(y.data(), x.data(), rows, cols);
    softmax_forward_cpu(y2.data(), x2.data(), rows, cols);
    double worst = 0.0;
    for (int r = 0; r < rows; r++) {
        double s = 0.0;
        for (int c = 0; c < cols; c++) s += y[(size_t)r * cols + c];
        worst = std::max(worst, std::fabs(s - 1.0));
    }
    // each element is the double result rounded once: the row sum is 1 within cols * eps/2 * max(y) (<< 1e-6)
    report(tally, worst < 1e-6, "cpu oracle rows sum to 1", "max |sum - 1| = " + std::to_string(worst));
    bool same = memcmp(y.data(), y2.data(), y.size() * sizeof(float)) == 0;
    report(tally, same && y[5] == 0.0f, "cpu oracle shift invariance (bitwise) and -inf -> exact 0",
           same ? "softmax(x + 64) == softmax(x)" : "softmax(x + 64) differs from softmax(x)");
}

// A PDL version only proves that it waits for its producer in a chain: y1 = softmax(x) by a version that triggers
// its dependents at entry (12 or 13), then y2 = softmax(y1) by the version under test, launched at once with PDL,
// y1 poisoned beforehand. A read of y1 before the producer finished would see NaN or stale rows. y2 is compared with
// the oracle applied to the y1 the GPU wrote.
static void test_pdl_chains(Tally& tally, Rng& rng) {
    const Shape chain_shapes[] = {{4099, 64}, {1023, 1000}, {37, 65537}, {8192, 1024}};
    for (const Shape& sh : chain_shapes) {
        size_t n = (size_t)sh.rows * sh.cols;
        std::vector<float> x(n), y1(n), ref(n), out(n);
        float *d_x, *d_y1, *d_y2;
        cudaCheck(cudaMalloc(&d_x, n * sizeof(float)));
        cudaCheck(cudaMalloc(&d_y1, n * sizeof(float)));
        cudaCheck(cudaMalloc(&d_y2, n * sizeof(float)));
        for (int producer : {12, 13}) {
            for (int consumer : {12, 13}) {
                char name[160];
                snprintf(name, sizeof name, "forward PDL chain v%d -> v%d %dx%d", producer, consumer, sh.rows, sh.cols);
                fill_input(x.data(), sh.rows, sh.cols, RANDN, rng);
                cudaCheck(cudaMemcpy(d_x, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
                cudaCheck(cudaMemset(d_y1, 0xff, n * sizeof(float)));
                cudaCheck(cudaMemset(d_y2, 0xff, n * sizeof(float)));
                cudaCheck(cudaDeviceSynchronize());
                const char* why = softmax_forward(producer, d_y1, d_x, sh.rows, sh.cols, 0);
                if (!why) why = softmax_forward(consumer, d_y2, d_y1, sh.rows, sh.cols, 0);
                if (why) { cudaCheck(cudaDeviceSynchronize()); skip(tally, name, why); continue; }
                cudaCheck(cudaDeviceSynchronize());
                cudaCheck(cudaMemcpy(y1.data(), d_y1, n * sizeof(float), cudaMemcpyDeviceToHost));
                cudaCheck(cudaMemcpy(out.data(), d_y2, n * sizeof(float), cudaMemcpyDeviceToHost));
                softmax_forward_cpu(ref.data(), y1.data(), sh.rows, sh.cols);
                CompareResult c = compare_forward(out.data(), ref.data(), y1.data(), n, sh.cols);
                report(tally, c.ok, name, describe(c, sh.cols, out.data(), ref.data()));
            }
        }
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_y1));
        cudaCheck(cudaFree(d_y2));
    }
}

static int run_tests(const char* fixture_path, uint64_t seed) {
    Tally tally;
    Rng rng{seed};
    printf("softmax_forward --test (seed %llu)\n", (unsigned long long)seed);
    test_oracle_properties(tally, rng);
    test_fixture(tally, fixture_path);

    std::string no_gpu;
    if (!has_gpu(no_gpu)) {
        for (int v = 1; v <= NUM_VERSIONS; v++) skip(tally, "gpu forward version " + std::to_string(v), no_gpu);
    } else {
        for (const Shape& sh : test_shapes) {
            size_t n = (size_t)sh.rows * sh.cols;
            std::vector<float> x(n), ref(n), out(n);
            float *d_x, *d_y;
            cudaCheck(cudaMalloc(&d_x, n * sizeof(float)));
            cudaCheck(cudaMalloc(&d_y, n * sizeof(float)));
            for (int p = 0; p < NUM_PATTERNS; p++) {
                if (n > 200000 && p != RANDN && p != NEG_INF) continue;  // keep the suite fast; long rows get two patterns
                fill_input(x.data(), sh.rows, sh.cols, (Pattern)p, rng);
                softmax_forward_cpu(ref.data(), x.data(), sh.rows, sh.cols);
                cudaCheck(cudaMemcpy(d_x, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
                for (int v = 1; v <= NUM_VERSIONS; v++) {
                    for (int bs : block_sizes_of(v)) {
                        char name[160];
                        snprintf(name, sizeof name, "forward v%d%s%s %dx%d %s", v, bs ? " block " : "",
                                 bs ? std::to_string(bs).c_str() : "", sh.rows, sh.cols, pattern_name[p]);
                        cudaCheck(cudaMemset(d_y, 0xff, n * sizeof(float)));  // poison: 0xffffffff is a NaN
                        const char* why = softmax_forward(v, d_y, d_x, sh.rows, sh.cols, bs);
                        if (why) { skip(tally, name, why); continue; }
                        cudaCheck(cudaDeviceSynchronize());
                        cudaCheck(cudaMemcpy(out.data(), d_y, n * sizeof(float), cudaMemcpyDeviceToHost));
                        CompareResult c = compare_forward(out.data(), ref.data(), x.data(), n, sh.cols);
                        report(tally, c.ok, name, describe(c, sh.cols, out.data(), ref.data()));
                    }
                }
            }
            // unaligned rows: x and y start 1 float past a 16-byte boundary (a slice of a bigger tensor)
            if (sh.cols >= 3 && n < 200000) {
                float *d_x1, *d_y1;
                cudaCheck(cudaMalloc(&d_x1, (n + 4) * sizeof(float)));
                cudaCheck(cudaMalloc(&d_y1, (n + 4) * sizeof(float)));
                fill_input(x.data(), sh.rows, sh.cols, RANDN, rng);
                softmax_forward_cpu(ref.data(), x.data(), sh.rows, sh.cols);
                cudaCheck(cudaMemcpy(d_x1 + 1, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
                for (int v = 4; v <= NUM_VERSIONS; v++) {
                    for (int yoff : {1, 2}) {  // y with the same and with a different misalignment than x
                        char name[160];
                        snprintf(name, sizeof name, "forward v%d %dx%d x at +4 bytes, y at +%d bytes", v, sh.rows, sh.cols, 4 * yoff);
                        cudaCheck(cudaMemset(d_y1, 0xff, (n + 4) * sizeof(float)));
                        const char* why = softmax_forward(v, d_y1 + yoff, d_x1 + 1, sh.rows, sh.cols, 0);
                        if (why) { skip(tally, name, why); continue; }
                        cudaCheck(cudaDeviceSynchronize());
                        cudaCheck(cudaMemcpy(out.data(), d_y1 + yoff, n * sizeof(float), cudaMemcpyDeviceToHost));
                        CompareResult c = compare_forward(out.data(), ref.data(), x.data(), n, sh.cols);
                        // the floats just before and after the output must still hold the poison
                        std::vector<float> guard(n + 4);
                        cudaCheck(cudaMemcpy(guard.data(), d_y1, (n + 4) * sizeof(float), cudaMemcpyDeviceToHost));
                        bool fence = std::isnan(guard[yoff - 1]) && std::isnan(guard[yoff + n]);
                        if (c.ok && !fence) { c.ok = false; c.why = "wrote outside the output"; }
                        report(tally, c.ok, name, describe(c, sh.cols, out.data(), ref.data()));
                    }
                }
                cudaCheck(cudaFree(d_x1));
                cudaCheck(cudaFree(d_y1));
            }
            cudaCheck(cudaFree(d_x));
            cudaCheck(cudaFree(d_y));
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
    if (!bench_begin(b, "softmax_forward", "forward", json_path)) return EXIT_FAILURE;
    bool all_ok = true;
    for (const BenchShape& sh : shapes) {
        size_t n = (size_t)sh.rows * sh.cols;
        size_t set_bytes = 2 * n * sizeof(float);
        // rotate through enough input/output pairs that each launch finds its data out of L2
        int nsets = bench_sets(b.prop, set_bytes);
        std::vector<float*> xs(nsets), ys(nsets);
        for (int i = 0; i < nsets; i++) {
            cudaCheck(cudaMalloc(&xs[i], n * sizeof(float)));
            cudaCheck(cudaMalloc(&ys[i], n * sizeof(float)));
            fill_kernel<<<ceil_div(n, 256), 256>>>(xs[i], n, 1234 + i, 3.0f, 0.0f);
            cudaCheck(cudaGetLastError());
        }
        // validation on up to 64 rows spread over the matrix (the whole oracle on 67M elements would take seconds)
        int check_rows = std::min(sh.rows, 64);
        std::vector<float> xr((size_t)check_rows * sh.cols), out(xr.size()), ref(xr.size());
        copy_check_rows(xr.data(), xs[0], sh, check_rows);
        softmax_forward_cpu(ref.data(), xr.data(), check_rows, sh.cols);
        // copy of the same bytes (x -> y, rotating buffers): what the memory system gives a transfer of this size
        double copy_same = bench_copy_refs(b, sh, n, [&](int i) { return xs[i % nsets]; }, [&](int i) { return ys[i % nsets]; });
        // bytes moved: read x once and write y once, 4 bytes each: 2 * rows * cols * 4
        all_ok = bench_versions(
            b, sh, versions, block_size_flag, block_sizes_of, 2.0 * n * sizeof(float), copy_same, out.data(), ref.data(),
            [&]() { cudaCheck(cudaMemset(ys[0], 0xff, n * sizeof(float))); },
            [&](int v, int bs, int i) { return softmax_forward(v, ys[i % nsets], xs[i % nsets], sh.rows, sh.cols, bs); },
            [&]() {
                copy_check_rows(out.data(), ys[0], sh, check_rows);
                return compare_forward(out.data(), ref.data(), xr.data(), out.size(), sh.cols);
            },
            [&](int v) {
                return v == 9 ? tuned_choice(g_forward9_cache, sh.rows, sh.cols)
                              : v == 14 ? tuned_choice(g_forward14_cache, sh.rows, sh.cols) : std::string();
            }) && all_ok;
        for (int i = 0; i < nsets; i++) { cudaCheck(cudaFree(xs[i])); cudaCheck(cudaFree(ys[i])); }
    }
    return bench_end(b, all_ok);
}

// ----------------------------------------------------------------------------------------------------------------

int main(int argc, char** argv) {
    Options opt = parse_args(argc, argv, "softmax_forward", NUM_VERSIONS);
    device_info(g_cc_major, g_num_sms);
    if (opt.test) return run_tests(opt.fixture, opt.seed);
    return run_benchmark(opt.versions, opt.shapes, opt.block_size, opt.json_path);
}
#endif  // DEV_KERNELS_ONLY
