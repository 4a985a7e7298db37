/*
dev/matrix_roots.cu: matrix functions for second-order optimizers (issue 21, items 1 and 2).

Inverse p-th roots X = (A + eps I)^(-1/p), p = 1, 2, 4, of symmetric positive semi-definite fp32 matrices, one n x n
matrix or a batch of them (row-major, contiguous), as Shampoo uses them; Muon's Newton-Schulz orthogonalisation;
the Kronecker-factor statistics of Shampoo (L = G G^T, R = G^T G) and K-FAC (A = E[a a^T], G = E[g g^T]).

  make -C dev matrix_roots && ./dev/matrix_roots --test     the CPU oracle checks (run without a GPU, in CI), then
                                                            every GPU version against the oracle
  ./dev/matrix_roots --bench [--quick] [--json FILE]        time every version (n = 64 .. 4096 and batches), in ms
  ./dev/matrix_roots --study                                CPU only: fp32 / 3xTF32 / TF32 / bf16 emulations of the
                                                            iterations against the oracle (dev/matrix_roots_NOTES.md)
  python3 dev/matrix_roots.py                               PyTorch's eigh and coupled Newton in the same run
PyTorch: dev/torch_ops includes this file with DEV_KERNELS_ONLY (the kernels and their launchers; no tests, study,
benchmark or main) for its inverse_root, newton_schulz and kron_stats operators, on PyTorch's stream (g_stream).

Inverse roots (fp32 in and out, eps > 0 added to the diagonal):
version 0: cuSOLVER eigendecomposition: syevd per matrix (syevjBatched for batches of n <= 32), then
           X = V diag(max(lambda, eps)^(-1/p)) V^T by a scaled copy of V and one strict-fp32 GEMM.
version 1: coupled Newton iteration on cuBLAS, every product strict fp32 or 3xTF32 (operands split into two TF32
           parts, three products in one tensor-core GEMM): the iteration does not correct rounding errors, so TF32
           or bf16 products are not accurate enough (--study); one host decision per step from ||M - I||_F. One
           matrix takes scaled steps from a Lanczos estimate of its spectrum (one cooperative kernel); 3xTF32
           products either concatenated or split once per matrix, through cuBLAS or timed cuBLASLt algorithms,
           or (lower) only the lower-triangle blocks of each product in one batched GEMM, then mirrored.
version 2: one kernel runs the whole coupled Newton iteration of a matrix in shared memory (fp32 FMA, products in
           place through registers), one block per matrix, n <= 128 (n <= 64 where shared memory is short).
version 3: version 2 on tensor cores: 3xTF32 mma.sync (operands split in registers, the big and the small terms in
           two accumulators), a warp per 16 x 32 unit of each product's lower triangle (mirrored), and on sm_90
           a cluster of 2 blocks per matrix (each a full copy, half the units, results written to both); n <= 128.
           Versions 2 and 3 take scaled steps: 20 Lanczos steps in the block estimate the spectrum, each step's T is
           scaled to lift the small eigenvalues faster (5 + 1 steps instead of 8 + 1 at kappa ~ 35); if that fails or
           does not converge, the unscaled iteration reruns (the fallback). Version 1 does the same for one matrix
           (its Lanczos grid-wide); version 4 stays unscaled.
version 4: the whole iteration of one matrix of any size in one cooperative kernel (grid-wide barriers between the
           phases, the convergence decision on the device: no host round trip, no launch per product), 64 x 64
           lower-triangle tiles of 3xTF32 mma.sync, mirrored; a batch is one launch per matrix.
Newton-Schulz (Muon): the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, (a, b, c) = (3.4445, -4.7750,
           2.0315), 5 steps on X0 = G / (||G||_F + 1e-7), bf16 operands and fp32 accumulation (cuBLAS GemmEx), a
           batch of same-shape matrices, tall ones transposed.
Kronecker statistics: C = beta C + alpha P P^T computing only the lower triangle and mirroring it (a SYRK-like
           kernel): P = G (Shampoo L), G^T (Shampoo R), the layer inputs a (K-FAC A, optionally with a column of
           ones for the bias), the 3x3 im2col patches of an NHWC input (K-FAC A of a convolution, read in place), the
           output gradients (K-FAC G). beta = 0 never reads C. cuBLAS syrk is the baseline.
Measurements, tolerances and what remains: dev/matrix_roots_NOTES.md.
*/
#include <algorithm>
#include <cerrno>
#include <cstdarg>
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
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cublas_v2.h>
#include <cublasLt.h>
#include <cusolverDn.h>

namespace cg = cooperative_groups;

// ----------------------------------------------------------------------------------------------------------------
// error checking

// Inside PyTorch (dev/torch_ops, CUDA_CHECK_THROWS) a failure is an exception the caller turns into a Python error.
static void fail(const std::string& msg) {
#ifdef CUDA_CHECK_THROWS
    throw std::runtime_error(msg);
#endif
    fprintf(stderr, "%s\n", msg.c_str());
    exit(EXIT_FAILURE);
}

static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
#ifdef CUDA_CHECK_THROWS
        fail(std::string("[CUDA ERROR] ") + call + " failed at " + file + ":" + std::to_string(line) + ": " +
             cudaGetErrorString(err));
#endif
        fprintf(stderr, "[CUDA ERROR] %s failed at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)
// every kernel launch is followed by this
#define launchCheck() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

static void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
#ifdef CUDA_CHECK_THROWS
        fail(std::string("[cuBLAS ERROR] ") + call + " failed at " + file + ":" + std::to_string(line) + ": status " +
             std::to_string((int)status));
#endif
        fprintf(stderr, "[cuBLAS ERROR] %s failed at %s:%d: status %d\n", call, file, line, (int)status);
        exit(EXIT_FAILURE);
    }
}
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)

static void cusolver_check(cusolverStatus_t status, const char* call, const char* file, int line) {
    if (status != CUSOLVER_STATUS_SUCCESS) {
#ifdef CUDA_CHECK_THROWS
        fail(std::string("[cuSOLVER ERROR] ") + call + " failed at " + file + ":" + std::to_string(line) +
             ": status " + std::to_string((int)status));
#endif
        fprintf(stderr, "[cuSOLVER ERROR] %s failed at %s:%d: status %d (7 = internal error, 3 = invalid value: "
                "check n, lda and the workspace size)\n", call, file, line, (int)status);
        exit(EXIT_FAILURE);
    }
}
#define cusolverCheck(call) cusolver_check((call), #call, __FILE__, __LINE__)

static void fail_arg(const char* fn, const char* what, long long found, const char* expected) {
    fail(std::string(fn) + ": argument " + what + " = " + std::to_string(found) + ", expected " + expected);
}

// ----------------------------------------------------------------------------------------------------------------
// test tally and random numbers

static int g_passed = 0, g_failed = 0, g_skipped = 0;
static void report(bool ok, const std::string& name, const std::string& detail) {
    printf("%s %s: %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
    fflush(stdout);
    (ok ? g_passed : g_failed)++;
}
static void skip(const std::string& name, const std::string& why) {
    printf("SKIP %s: %s\n", name.c_str(), why.c_str());
    g_skipped++;
}
static int finish() {
    printf("%d passed, %d failed, %d skipped\n", g_passed, g_failed, g_skipped);
    return g_failed ? 1 : 0;
}
static std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
static std::string fmt(const char* f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

struct Rng {  // splitmix64: reproducible streams from a printed seed
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
    double normal() {
        double u1 = ((next() >> 11) + 1.0) * (1.0 / 9007199254740993.0), u2 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
};

// ----------------------------------------------------------------------------------------------------------------
// CPU oracle (float64): a cyclic Jacobi eigendecomposition and the exact inverse root. Matrices are row-major.

typedef std::vector<double> MatD;
typedef std::vector<float> MatF;

// C = A B (n x n, float64)
static void matmul_d(int n, const double* A, const double* B, double* C) {
    std::fill(C, C + (size_t)n * n, 0.0);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < n; k++) {
            double a = A[(size_t)i * n + k];
            const double* b = B + (size_t)k * n;
            double* c = C + (size_t)i * n;
            for (int j = 0; j < n; j++) c[j] += a * b[j];
        }
}

// Cyclic Jacobi: rotations zero a[p][q] in row order, sweep after sweep, until no off-diagonal element is above
// 1e-15 sqrt(|a_pp a_qq|) (a relative threshold: the small eigenvalues of a positive definite matrix keep their
// relative accuracy, which the inverse root of an ill-conditioned matrix needs). On return w holds the eigenvalues
// and column j of V (V[i * n + j]) the eigenvector of w[j]. Returns the number of sweeps, -1 if 100 did not converge.
static int jacobi_eigh(int n, MatD a, std::vector<double>& w, MatD& V) {
    V.assign((size_t)n * n, 0.0);
    for (int i = 0; i < n; i++) V[(size_t)i * n + i] = 1.0;
    for (int sweep = 1; sweep <= 100; sweep++) {
        int rotations = 0;
        for (int p = 0; p < n - 1; p++)
            for (int q = p + 1; q < n; q++) {
                double apq = a[(size_t)p * n + q], app = a[(size_t)p * n + p], aqq = a[(size_t)q * n + q];
                if (std::fabs(apq) <= 1e-15 * std::sqrt(std::fabs(app * aqq)) || apq == 0.0) continue;
                rotations++;
                // J^T A J with J = [[c, s], [-s, c]] on (p, q): t = tan(angle) is the smaller root of
                // t^2 + 2 theta t - 1 = 0, theta = (a_qq - a_pp) / (2 a_pq) (the stable choice, |angle| <= pi/4)
                double theta = (aqq - app) / (2.0 * apq);
                double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
                double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
                for (int k = 0; k < n; k++) {  // columns p, q: A J
                    double akp = a[(size_t)k * n + p], akq = a[(size_t)k * n + q];
                    a[(size_t)k * n + p] = c * akp - s * akq;
                    a[(size_t)k * n + q] = s * akp + c * akq;
                }
                for (int k = 0; k < n; k++) {  // rows p, q: J^T (A J)
                    double apk = a[(size_t)p * n + k], aqk = a[(size_t)q * n + k];
                    a[(size_t)p * n + k] = c * apk - s * aqk;
                    a[(size_t)q * n + k] = s * apk + c * aqk;
                }
                a[(size_t)p * n + q] = a[(size_t)q * n + p] = 0.0;
                for (int k = 0; k < n; k++) {
                    double vkp = V[(size_t)k * n + p], vkq = V[(size_t)k * n + q];
                    V[(size_t)k * n + p] = c * vkp - s * vkq;
                    V[(size_t)k * n + q] = s * vkp + c * vkq;
                }
            }
        if (rotations == 0) {
            w.resize(n);
            for (int i = 0; i < n; i++) w[i] = a[(size_t)i * n + i];
            return sweep;
        }
    }
    return -1;
}

// X = V diag(f(w)) V^T
static MatD eig_apply(int n, const std::vector<double>& w, const MatD& V, double (*f)(double, double), double arg) {
    MatD X((size_t)n * n, 0.0);
    std::vector<double> fw(n);
    for (int j = 0; j < n; j++) fw[j] = f(w[j], arg);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < n; k++) {
            double s = 0.0;
            for (int j = 0; j < n; j++) s += V[(size_t)i * n + j] * fw[j] * V[(size_t)k * n + j];
            X[(size_t)i * n + k] = s;
        }
    return X;
}

struct RootOracle {
    MatD X;               // (A + eps I)^(-1/p), float64
    double lmin, lmax;    // extreme eigenvalues of A + eps I
    int sweeps;
};

// The exact inverse root of the fp32 input: eigenvalues of A + eps I clamped at eps (they are >= eps when A is
// positive semi-definite; the clamp only acts where rounding made A indefinite by less than eps).
static double g_oracle_p = 1.0;
static double inv_root_scalar(double lambda, double eps) { return std::pow(std::max(lambda, eps), -1.0 / g_oracle_p); }
static RootOracle oracle_inv_root_d(int n, MatD a, double eps, int p) {
    for (int i = 0; i < n; i++) a[(size_t)i * n + i] += eps;
    std::vector<double> w;
    MatD V;
    RootOracle o;
    o.sweeps = jacobi_eigh(n, a, w, V);
    g_oracle_p = p;
    o.X = eig_apply(n, w, V, inv_root_scalar, eps);
    o.lmin = *std::min_element(w.begin(), w.end());
    o.lmax = *std::max_element(w.begin(), w.end());
    return o;
}
static RootOracle oracle_inv_root(int n, const float* A, float eps, int p) {
    return oracle_inv_root_d(n, MatD(A, A + (size_t)n * n), (double)eps, p);
}

// A random orthogonal matrix: modified Gram-Schmidt, twice, on a Gaussian matrix (rows orthonormal).
static MatD random_orthogonal(int n, Rng& rng) {
    MatD Q((size_t)n * n);
    for (auto& v : Q) v = rng.normal();
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            double* qi = &Q[(size_t)i * n];
            for (int j = 0; j < i; j++) {
                const double* qj = &Q[(size_t)j * n];
                double d = 0.0;
                for (int k = 0; k < n; k++) d += qi[k] * qj[k];
                for (int k = 0; k < n; k++) qi[k] -= d * qj[k];
            }
            double nrm = 0.0;
            for (int k = 0; k < n; k++) nrm += qi[k] * qi[k];
            nrm = std::sqrt(nrm);
            for (int k = 0; k < n; k++) qi[k] /= nrm;
        }
    return Q;
}

// A = Q^T diag(d) Q, rounded to fp32 (exactly symmetric): d log-spaced from 1 down to 1/kappa, the last `zeros`
// eigenvalues 0 (positive semi-definite, eps makes it definite). Optionally returns the float64 A, Q and d.
static MatF make_spd(int n, double kappa, int zeros, Rng& rng, MatD* exact = nullptr, MatD* q_out = nullptr,
                     std::vector<double>* d_out = nullptr) {
    MatD Q = random_orthogonal(n, rng);
    std::vector<double> d(n);
    for (int i = 0; i < n; i++) d[i] = n == 1 ? 1.0 : std::pow(kappa, -(double)i / (n - 1));
    for (int i = std::max(0, n - zeros); i < n; i++) d[i] = 0.0;
    MatD A((size_t)n * n);
    for (int i = 0; i < n; i++)
        for (int j = i; j < n; j++) {
            double s = 0.0;
            for (int k = 0; k < n; k++) s += Q[(size_t)k * n + i] * d[k] * Q[(size_t)k * n + j];
            A[(size_t)i * n + j] = A[(size_t)j * n + i] = s;
        }
    MatF Af(A.size());
    for (size_t i = 0; i < A.size(); i++) Af[i] = (float)A[i];
    if (exact) *exact = A;
    if (q_out) *q_out = Q;
    if (d_out) *d_out = d;
    return Af;
}

// ||X - ref||_F / ||ref||_F
template <typename T>
static double rel_err(size_t count, const T* X, const double* ref) {
    double e = 0.0, r = 0.0;
    for (size_t i = 0; i < count; i++) {
        double d = (double)X[i] - ref[i];
        e += d * d;
        r += ref[i] * ref[i];
    }
    return std::sqrt(e / r);
}

// ||X^p (A + eps I) - I||_F / sqrt(n), in float64 from the fp32 result
static double root_residual(int n, int p, const float* X, const float* A, float eps) {
    MatD x((size_t)n * n), a((size_t)n * n), t1((size_t)n * n), t2((size_t)n * n);
    for (size_t i = 0; i < x.size(); i++) { x[i] = X[i]; a[i] = A[i]; }
    for (int i = 0; i < n; i++) a[(size_t)i * n + i] += (double)eps;
    MatD xp = x;
    if (p >= 2) { matmul_d(n, x.data(), x.data(), t1.data()); xp = t1; }
    if (p == 4) { matmul_d(n, xp.data(), xp.data(), t2.data()); xp = t2; }
    matmul_d(n, xp.data(), a.data(), t1.data());
    double s = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double d = t1[(size_t)i * n + j] - (i == j ? 1.0 : 0.0);
            s += d * d;
        }
    return std::sqrt(s / n);
}

// ----------------------------------------------------------------------------------------------------------------
// The coupled Newton iteration for the inverse p-th root (Guo and Higham's form), shared by version 1, version 2
// and the CPU twin below:
//   z = (p + 1) / (2 ||A||_F),  X0 = z^(1/p) I,  M0 = z A;  then  T = ((p + 1) I - M) / p,  X <- X T,  M <- T^p M.
// M = X^p A at every step (all are polynomials in A), M -> I, so X -> A^(-1/p). ||A||_F >= lambda_max puts the
// eigenvalues of M0 in (0, (p + 1) / 2], inside (0, p + 1) where the scalar map m -> m ((p + 1 - m) / p)^p rises to
// 1: small eigenvalues grow by ((p + 1) / p)^p per step (2 for p = 1, 2.44 for p = 4), then converge quadratically.
// The coupled form is stable (errors are not amplified) but it does not correct them either: an error made in a
// product stays in X (the invariant M = X^p A is lost), so every product needs fp32 accuracy. Measured with --study
// (dev/matrix_roots_NOTES.md): TF32 or bf16 products leave errors of u_tf32 * kappa (2e-2 at kappa 1e2) that an
// fp32 restart (M = X^p A recomputed, fp32 steps) does not remove; products from TF32 operands split in two
// (3xTF32: a_hi b_hi + a_hi b_lo + a_lo b_hi) are as accurate as fp32 ones.

constexpr double NEWTON_LAST_R = 1e-3;  // ||M - I||_F below which one last X step ends the iteration: each eigenvalue
                                        // is then within 1e-3 of 1 and the step leaves a relative error of
                                        // (p + 1) / (2 p^2) * 1e-6 <= 1e-6 in X

enum NewtonAction { NEWTON_STEP, NEWTON_LAST, NEWTON_FAIL };
struct NewtonState {
    int n = 0, p = 1, max_iter = 0;
    int iters = 0;
    double r_prev = INFINITY, r = INFINITY;
    bool failed = false, converged = false;
    bool fell_back = false;  // the scaled iteration failed or did not converge: this is the unscaled rerun's state
    int discarded = 0;       // steps of that failed scaled attempt
    int delta_steps = 0;     // version 1's steps in the I + D form (V1Options::delta_below), the last X step too
};

// How versions 2 and 3 and their CPU twin start: scaled steps from a Lanczos estimate (the default, with the unscaled
// rerun as fallback), today's unscaled iteration only, or (tests only) the scaled one from an estimate of lambda_max
// NEWTON_BAD_HI_FACTOR times too small, which must fail and be rerun unscaled. NEWTON_SCALED_V1: the twin only,
// version 1's scaled steps (its grid-wide Lanczos, a narrowed by the step's r).
enum NewtonStart { NEWTON_SCALED, NEWTON_UNSCALED, NEWTON_SCALED_BAD_HI, NEWTON_SCALED_V1 };
constexpr double NEWTON_BAD_HI_FACTOR = 100.0;
constexpr int NEWTON_FELL_BACK = 1 << 16;  // versions 2 and 3: added to a matrix's status (steps) after a fallback

// Steps the scalar map needs from the smallest eigenvalue M0 can have (z eps: A positive semi-definite) and from
// the largest ((p + 1) / 2) to within 1e-4 of 1; every eigenvalue in between needs no more (the map is increasing
// on (0, 1] and decreasing on [1, p + 1)). Plus slack for rounding.
__host__ __device__ inline int newton_scalar_steps(int p, double m) {
    int k = 0;
    while (fabs(1.0 - m) > 1e-4 && k < 1000) {
        double t = (p + 1 - m) / p, tp = p == 1 ? t : p == 2 ? t * t : (t * t) * (t * t);
        m *= tp;
        k++;
    }
    return k;
}
__host__ __device__ inline int newton_max_iter(int p, double m_min) {
    int a = newton_scalar_steps(p, m_min > 1e-30 ? m_min : 1e-30), b = newton_scalar_steps(p, (p + 1) / 2.0);
    return (a > b ? a : b) + 8;
}

// Called with r = ||M - I||_F before each step (the largest over a batch); says what to do next.
__host__ __device__ inline NewtonAction newton_decide(NewtonState& s, double r) {
    s.r = r;
    // after the first step every eigenvalue of M is in (0, 1], so ||M - I||_F <= sqrt(n): far above it, rounding
    // has pushed an eigenvalue out of the convergence region (r != r: NaN)
    if (r != r || r > 2.0 * sqrt((double)s.n) + 2.0) { s.failed = true; return NEWTON_FAIL; }
    // below 0.2 quadratic convergence more than halves r at each step: less means the precision's floor
    bool stalled = r < 0.2 && r > 0.5 * s.r_prev;
    s.r_prev = r;
    if (r <= NEWTON_LAST_R || stalled || s.iters >= s.max_iter) {
        s.converged = r <= NEWTON_LAST_R || (stalled && r < 0.05);
        return NEWTON_LAST;
    }
    return NEWTON_STEP;
}

// ----------------------------------------------------------------------------------------------------------------
// Scaled steps: T = a^(1/p) ((p + 1) I - a M) / p maps each eigenvalue m of M to g(a m), g(m) = m ((p + 1 - m)/p)^p,
// instead of g(m). With the spectrum of M in [lo, hi], the a that balances g(a lo) = g(a hi) (a lo <= 1 <= a hi)
// multiplies the small eigenvalues by a ((p + 1) / p)^p per step instead of ((p + 1) / p)^p. lo and hi are estimates
// (Lanczos on A, then mapped step by step): a too large lo only makes a smaller (slower, never unsafe). Two caps on a:
// - safety: an eigenvalue up to NEWTON_HI_SLACK above hi stays below p + 1, where g is still positive (beyond it T has
//   a negative eigenvalue: for p = 1 M leaves (0, 1] and the iteration fails; for even p, X could converge to a root
//   that is not positive definite without any sign in M, so the slack matters);
// - accuracy: the spread of T^p's eigenvalues, ((p + 1) / (p + 1 - a hi))^p, at most NEWTON_T_SPREAD = 16, what the
//   unscaled start has at p = 4. An eigenvalue of T near 0 makes X T and T^p M lose the relative accuracy of those
//   components, and the coupled form never recovers it: with the safety cap alone (a hi up to 4.5 at p = 4) the CPU
//   twin's residuals exceeded the tolerances up to 150x at kappa >= 1e4 (dev/matrix_roots_NOTES.md, "Scaled steps").
// The caps are a hi <= 1.82, 2.25, 2.5 for p = 1, 2, 4. Steps (p = 4, full steps and the last X step, the scalar map
// from exact extremes): 5 instead of 8 from [1/35, 1], 11 instead of 19 from [1e-6, 1].

constexpr double NEWTON_HI_SLACK = 1.1, NEWTON_T_SPREAD = 16.0;

// The first scaled step's a is also held below (p + 1) / ||M0||_inf (Gershgorin: every eigenvalue of M0 is at most
// its largest absolute row sum, rowsum_max times z; 1e-4 covers the fp32 sums and z's rounding), so that no eigenvalue
// can pass p + 1 whatever the Lanczos estimate says; after that step every eigenvalue is in (0, 1] (g <= 1), so hi = 1
// is a bound, and the caps above keep the later steps safe. Costs 16 steps over --study's 60 cases, none on --bench's.
__host__ __device__ inline double newton_first_cap(int p, double z, double rowsum_max) {
    return (p + 1) / (z * rowsum_max * (1.0 + 1e-4));
}

// a^(1/p) for p = 1, 2, 4 by square roots (no pow call in the kernels)
__host__ __device__ inline double newton_root_p(double a, int p) {
    return p == 1 ? a : p == 2 ? sqrt(a) : sqrt(sqrt(a));
}

// g(m); inv_p = 1 / p, exact for p = 1, 2, 4: the kernels call it in loops, where a float64 division costs ~100 cycles
__host__ __device__ inline double newton_map(int p, double m, double inv_p) {
    double t = (p + 1 - m) * inv_p, t2 = t * t;
    return m * (p == 1 ? t : p == 2 ? t2 : t2 * t2);
}
__host__ __device__ inline double newton_map(int p, double m) { return newton_map(p, m, 1.0 / p); }

// The a in [1 / hi, cap] that maximises min(g(a lo), g(a hi)) for 0 < lo <= hi: where the rising g(a lo) meets the
// falling g(a hi), by bisection (g(a lo) - g(a hi) increases with a on that range).
__host__ __device__ inline double newton_alpha(int p, double lo, double hi) {
    double cap = fmin((p + 1) / (NEWTON_HI_SLACK * hi), (p + 1) * (1.0 - 1.0 / newton_root_p(NEWTON_T_SPREAD, p)) / hi);
    double a0 = 1.0 / hi, a1 = lo > 0.0 && 1.0 / lo < cap ? 1.0 / lo : cap;
    if (!(lo > 0.0) || !(hi >= lo) || a1 <= a0) return a0;
    double ip = 1.0 / p;
    if (newton_map(p, a1 * lo, ip) <= newton_map(p, a1 * hi, ip)) return a1;
    for (int i = 0; i < 40; i++) {  // a to 2^-40 of the bracket: far more than the step needs
        double a = 0.5 * (a0 + a1);
        if (newton_map(p, a * lo, ip) < newton_map(p, a * hi, ip)) a0 = a;
        else a1 = a;
    }
    return a0;
}

// newton_alpha's a in closed form (versions 2 and 3 and their twin): with a lo <= 1 and a hi < p + 1 both factors of
// g(a lo) = g(a hi) are positive, and its p-th root is linear in a: s (p + 1 - a lo) = p + 1 - a hi,
// s = (lo / hi)^(1/p), so a = (p + 1) (1 - s) / (hi - s lo), then the same bracket [1 / hi, min(1 / lo, cap)].
// Two square roots and a division instead of 40 bisection steps, which every thread of a block computed before each
// step (~2 us).
__host__ __device__ inline double newton_alpha_closed(int p, double lo, double hi) {
    double cap = fmin((p + 1) / (NEWTON_HI_SLACK * hi), (p + 1) * (1.0 - 1.0 / newton_root_p(NEWTON_T_SPREAD, p)) / hi);
    double a0 = 1.0 / hi, a1 = lo > 0.0 && 1.0 / lo < cap ? 1.0 / lo : cap;
    if (!(lo > 0.0) || !(hi >= lo) || a1 <= a0) return a0;
    double s = newton_root_p(lo / hi, p), a = (p + 1) * (1.0 - s) / (hi - s * lo);
    return a < a1 ? fmax(a, a0) : a1;
}

// The estimated interval of M's spectrum, carried through the scaled steps. r = ||M - I||_F bounds every |m - 1|.
struct NewtonScale {
    double lo = 1.0, hi = 1.0;
    // before a step: the a to take, from the interval narrowed by r
    __host__ __device__ double alpha(int p, double r) {
        if (r < 1.0) {
            lo = lo > 1.0 - r ? lo : 1.0 - r;
            hi = hi < 1.0 + r ? hi : 1.0 + r;
        }
        return newton_alpha(p, lo, hi);
    }
    // after a step taken with a: the image of [lo, hi] under m -> g(a m) (g rises to 1 at m = 1, then falls); after
    // the first step (capped by newton_first_cap) hi = 1 is a bound, even where the cap made a < 1
    __host__ __device__ void advance(int p, double a, bool first = false) {
        double glo = newton_map(p, a * lo), ghi = newton_map(p, a * hi);
        double mn = glo < ghi ? glo : ghi, mx = glo > ghi ? glo : ghi;
        hi = first || (a * lo <= 1.0 && 1.0 <= a * hi) ? 1.0 : mx;
        lo = mn;
    }
};

// A step's a, capped (newton_first_cap on the first step, else INFINITY). Versions 2 and 3 (and their twin) pass
// r = INFINITY, the carried interval alone: narrowing it by this step's r = ||M - I||_F would need r before T, a
// second pass over M, and over --study's 60 cases it changed no step count and no error. Version 1 knows r before T.
__host__ __device__ inline double newton_scale_a(NewtonScale& scale, int p, double r, double cap) {
    return fmin(scale.alpha(p, r), cap);
}
// Versions 2 and 3 (and their twin): the carried interval alone, newton_alpha_closed
__host__ __device__ inline double newton_scale_a23(const NewtonScale& scale, int p, double cap) {
    return fmin(newton_alpha_closed(p, scale.lo, scale.hi), cap);
}

// Named barriers (0 is __syncthreads; versions 2 and 3's start uses 1 and 2 between its Lanczos warp and the product
// warps, 3 among the warps of the multisection): bar.arrive does not wait, so the producer goes on; both order the
// shared-memory writes made before them among the barrier's threads.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync once v is formed: the compiler would otherwise sink v's arithmetic (a float64 division) past the wait
__device__ __forceinline__ void named_bar_sync_after(int id, int threads, float v) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads), "f"(v) : "memory");
}

// Extreme eigenvalues of the k x k symmetric tridiagonal (diagonal d, off-diagonal e[0..k-2]) that k Lanczos steps
// build: the Ritz values, inside the spectrum (lo overestimates lambda_min, hi underestimates lambda_max).
// Sturm counts without divisions (a division chain costs ~100 cycles a step in float64 on the GPU): the number of sign
// changes of q_i = det(T_i - x I), rescaled against overflow; an exact zero counts as a change, as q -> -0 would.
// The rescaling is a select of a power of two (exact), not a branch: the loop has no branch and its loads of d and e
// run ahead of the dependent chain.
__host__ __device__ inline int sturm_below(const double* d, const double* e, int k, double x) {
    int count = 0;
    double q0 = 0.0, q1 = 1.0;  // q_{i-2}, q_{i-1}
    for (int i = 0; i < k; i++) {
        double q2 = (d[i] - x) * q1 - (i > 0 ? e[i - 1] * e[i - 1] * q0 : 0.0);
        if (q2 == 0.0) q2 = -1e-30 * q1;
        count += (q2 < 0.0) != (q1 < 0.0);
        double m = fabs(q2);  // q2 != 0 here; both scaled alike keep every sign and ratio
        double sc = m > 1e150 ? 0x1p-500 : m < 1e-150 ? 0x1p+500 : 1.0;
        q0 = q1 * sc;
        q1 = q2 * sc;
    }
    return count;
}
// Multisection: each round tests M = 16 groups points inside each end's bracket and keeps the 1 / (M + 1) where the
// count changes. On the device a warp's 32 lanes count at once (every lane of the warp must call it with the same
// arguments; each warp computes the same result, so a block needs no broadcast); with groups > 1 (versions 2 and 3 at
// NP = 128: 8 warps, 128 points an end) warp `group` counts points 16 group + 1 .. 16 group + 16 of each end, and the
// warps swap their ballots through shared memory (2 groups words, alternating by round) at named barrier 3. The host
// loops over the points. The brackets end when lo is known to 1e-4 and hi to 1e-7 relative (at most 14 rounds); lo
// and hi are the brackets' upper ends (lo >= the Ritz value: safe, slower; hi >= the Ritz value).
constexpr int MULTISECTION_MAX_GROUPS = 8;
struct Multisection {
    int groups = 1;              // points per end and round: 16 groups
    unsigned* ballots = nullptr;  // device, groups > 1: 2 groups words of shared memory
    int group = 0;               // device: this warp's group
};
__host__ __device__ inline int first_set_bit(unsigned w) {  // 0-based index of the lowest set bit; w != 0
#ifdef __CUDA_ARCH__
    return __ffs(w) - 1;
#else
    return __builtin_ffs(w) - 1;
#endif
}
__host__ __device__ inline void tridiag_extremes(const double* d, const double* e, int k, double* lo, double* hi,
                                                 Multisection ms = Multisection()) {
    double a = d[0], b = d[0];  // Gershgorin bounds of the tridiagonal
    for (int i = 0; i < k; i++) {
        double r = (i > 0 ? fabs(e[i - 1]) : 0.0) + (i < k - 1 ? fabs(e[i]) : 0.0);
        a = fmin(a, d[i] - r);
        b = fmax(b, d[i] + r);
    }
    const int M = 16 * ms.groups;
    const double step = 1.0 / (M + 1);
    double l0 = a, l1 = b, h0 = a, h1 = b;
    for (int round = 0; round < 14; round++) {
        if (l1 - l0 <= 1e-4 * fabs(l1) && h1 - h0 <= 1e-7 * fabs(h1)) break;
        auto point = [&](int j, bool high) {  // point j (1 .. M) of an end's bracket
            double f = j * step;              // a multiplication: no float64 division per point
            return high ? h0 + (h1 - h0) * f : l0 + (l1 - l0) * f;
        };
        auto passes = [&](int g, int lane) {  // lanes 0-15: one eigenvalue below (lowest); 16-31: all k below (highest)
            int c = sturm_below(d, e, k, point(16 * g + lane % 16 + 1, lane >= 16));
            return lane < 16 ? c >= 1 : c >= k;
        };
        unsigned words[MULTISECTION_MAX_GROUPS];
#ifdef __CUDA_ARCH__
        unsigned w = __ballot_sync(0xffffffffu, passes(ms.group, threadIdx.x % 32));
        if (ms.groups > 1) {
            volatile unsigned* slot = ms.ballots + (round & 1) * ms.groups;
            if (threadIdx.x % 32 == 0) slot[ms.group] = w;
            named_bar_sync(3, 32 * ms.groups);
#pragma unroll
            for (int g = 0; g < MULTISECTION_MAX_GROUPS; g++) words[g] = g < ms.groups ? slot[g] : 0u;
        } else {
            words[0] = w;
        }
#else
        for (int g = 0; g < ms.groups; g++) {
            words[g] = 0;
            for (int lane = 0; lane < 32; lane++) words[g] |= (unsigned)passes(g, lane) << lane;
        }
#endif
        // the first passing point (counts rise with x) ends the bracket, the point before it starts it (M: none)
        int jl = M, jh = M;
        for (int g = ms.groups - 1; g >= 0; g--) {
            unsigned pl = words[g] & 0xFFFFu, ph = words[g] >> 16;
            if (pl) jl = 16 * g + first_set_bit(pl);
            if (ph) jh = 16 * g + first_set_bit(ph);
        }
        double nl0 = jl > 0 ? point(jl, false) : l0, nl1 = jl < M ? point(jl + 1, false) : l1;
        double nh0 = jh > 0 ? point(jh, true) : h0, nh1 = jh < M ? point(jh + 1, true) : h1;
        l0 = nl0;
        l1 = nl1;
        h0 = nh0;
        h1 = nh1;
    }
    *lo = l1;
    *hi = h1;
}

// The squared last component of the unit eigenvector of the tridiagonal for its eigenvalue x: the residue of
// ((x I - T)^-1)_kk = p_{k-1}(x) / p_k(x) at x, p_{k-1}(x) / p_k'(x) (p_i = det(x I - T_i)). With beta_k, the
// norm of Lanczos' next residual, beta_k sqrt(w) is ||A y - x y|| for the Ritz vector y: an eigenvalue of A lies
// within it of x. Rounding or a near-double eigenvalue can put it outside [0, 1]: then 1, the worst case.
__host__ __device__ inline double tridiag_last_weight(const double* d, const double* e, int k, double x) {
    double p0 = 1.0, p1 = x - d[0], dp0 = 0.0, dp1 = 1.0;  // p_{i-1}, p_i and their derivatives
    for (int i = 1; i < k; i++) {
        double e2 = e[i - 1] * e[i - 1];
        double p2 = (x - d[i]) * p1 - e2 * p0, dp2 = p1 + (x - d[i]) * dp1 - e2 * dp0;
        p0 = p1;
        p1 = p2;
        dp0 = dp1;
        dp1 = dp2;
        double m = fmax(fmax(fabs(p0), fabs(p1)), fmax(fabs(dp0), fabs(dp1)));
        double sc = m > 1e150 ? 0x1p-500 : m < 1e-150 && m > 0.0 ? 0x1p+500 : 1.0;  // one power of two for all four
        p0 *= sc;                                                                    // keeps p0 / dp1 exactly
        p1 *= sc;
        dp0 *= sc;
        dp1 *= sc;
    }
    double w = p0 / dp1;
    return w >= 0.0 && w <= 1.0 ? w : 1.0;
}

// Lanczos on A + eps I: LANCZOS_STEPS steps from the start vector below (1 + a hash of i in [-0.5, 0.5): the same on
// every run and every thread; a matrix whose top eigenvector is orthogonal to it would have to be built for it, and
// even then newton_first_cap keeps the steps safe), fp32 matvecs, float64 dot products and recurrence scalars, no
// reorthogonalisation (the extremes converge first; lost orthogonality only repeats them as ghost copies).
constexpr int LANCZOS_STEPS = 20;
__host__ __device__ inline float lanczos_start(int i) {
    uint32_t h = (uint32_t)i * 0x9E3779B9u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return 0.5f + (float)(h >> 8) * (1.0f / 16777216.0f);
}

// Row i of the Lanczos matvec, (A u)_i = sum_c a_ci u_c (A symmetric: column i, a[c * ld], read without bank
// conflicts in shared memory), fp32 FMA in four interleaved chains (c mod 4; a 128-long dependent chain would set the
// step's latency), then (y0 + y1) + (y2 + y3). lanczos_warp_cpu (versions 2 and 3's twin).
__host__ __device__ inline float lanczos_row(const float* a, int ld, const float* u, int n) {
    float y0 = 0.0f, y1 = 0.0f, y2 = 0.0f, y3 = 0.0f;
    int c = 0;
    for (; c + 4 <= n; c += 4) {
        y0 = fmaf(a[c * ld], u[c], y0);
        y1 = fmaf(a[(c + 1) * ld], u[c + 1], y1);
        y2 = fmaf(a[(c + 2) * ld], u[c + 2], y2);
        y3 = fmaf(a[(c + 3) * ld], u[c + 3], y3);
    }
    for (; c < n; c++) y0 = fmaf(a[c * ld], u[c], y0);
    return (y0 + y1) + (y2 + y3);
}

// The scaled iteration's start from k Lanczos steps on A + eps I (alpha[0..k-1]: T's diagonal; beta[0..k-2] its
// off-diagonal, beta[k-1] the norm of the next residual). hi_est = theta_max + ||A y - theta_max y||, an estimate of
// lambda_max from above unless the start vector missed the top of the spectrum, so M0 = z (A + eps I) with z =
// 1 / hi_est has its spectrum in about [lo, 1], lo = theta_min / hi_est. An underestimate of lambda_max is made safe
// by newton_first_cap; an iteration that fails or does not converge anyway is rerun unscaled (the fallback).
__host__ __device__ inline void lanczos_newton_start(const double* alpha, const double* beta, int k, double* z,
                                                     double* lo, Multisection ms = Multisection()) {
    if (k < 1) {  // not even one step (a NaN in A): the scaled iteration fails at once and is rerun unscaled
        *z = *lo = NAN;
        return;
    }
    double tmin, tmax;
    tridiag_extremes(alpha, beta, k, &tmin, &tmax, ms);
    double hi_est = tmax + beta[k - 1] * sqrt(tridiag_last_weight(alpha, beta, k, tmax));
    *z = 1.0 / hi_est;
    *lo = tmin / hi_est;
}

// Version 1's Lanczos (lanczos_kernel, one cooperative launch; lanczos_grid_cpu is its host twin) forms each step's
// w = (A + eps I) q - beta_prev q_prev and, in the same pass, the sums q.w, w.w and q.q; the coefficients follow from
// the sums alone, so a step needs one grid barrier. Same start vector (normalised), steps and start rule as above.
constexpr double LANCZOS_BREAKDOWN = 1e-5;  // beta / ||w|| below this: the Krylov space is invariant up to rounding

// alpha = q.w / q.q and beta = ||w - alpha q|| = sqrt(w.w - (q.w)^2 / q.q) from the step's sums (q.q, not 1: q is
// rounded to fp32); false at a breakdown (the tridiagonal so far then holds eigenvalues of A + eps I)
__host__ __device__ inline bool lanczos_coeffs(double qw, double ww, double qq, double* alpha, double* beta) {
    *alpha = qw / qq;
    double b2 = fma(-qw, *alpha, ww);  // explicit: nvcc would contract ww - qw alpha on the GPU side only
    *beta = b2 > 0.0 ? sqrt(b2) : 0.0;
    return *beta > LANCZOS_BREAKDOWN * sqrt(ww);
}

// What a Lanczos run gives the scaled iteration: its steps, z and lo (lanczos_newton_start) and the largest absolute
// row sum of A + eps I (newton_first_cap). Versions 1 to 3 and their twins.
struct LanczosStart { int k = 0; double z = NAN, lo = NAN, rowsum_max = NAN; };

// Versions 2 and 3 run their Lanczos on one warp of the block (fused_scaled_start; lanczos_warp_cpu is its twin, bit
// for bit): lane l owns rows R l .. R l + R - 1 of the NP-row padded matrix (R = NP / 32), float64 sums by the xor
// shuffle tree, so no block barrier inside. LANCZOS23_STEPS steps (version 1 keeps LANCZOS_STEPS).
constexpr int LANCZOS23_STEPS = LANCZOS_STEPS;
static_assert(LANCZOS23_STEPS <= LANCZOS_STEPS, "the twins' tridiagonal arrays hold LANCZOS_STEPS");
// the padded size versions 2 and 3 run n in (the twin uses it for the lanes' rows and the quarters: 128 for every
// n in 65 .. 128, as the kernels' NP; above 128, where only the twin runs, n rounded up to 32)
__host__ __device__ inline int lanczos23_np(int n) {
    return n <= 32 ? 32 : n <= 64 ? 64 : n <= 128 ? 128 : (n + 31) / 32 * 32;
}
// the multisection's groups (Multisection) at padded size np: at NP = 128 every shape has 8 warps free for it
// (warp 0 and 7 product warps), fewer warps at NP <= 64 keep the one-warp form
__host__ __device__ constexpr int lanczos23_groups(int np) { return np >= 128 ? 8 : 1; }
inline Multisection lanczos23_multisection_cpu(int n) { return Multisection{lanczos23_groups(lanczos23_np(n))}; }

// ----------------------------------------------------------------------------------------------------------------
// CPU twins of the GPU iterations in fp32, with the GPU's reduced-precision products emulated (operands rounded to
// TF32 or bf16, fp32 sums): they run in CI, where the GPU versions cannot, and --study measures with them.

// PREC_3XTF32_2ACC: 3xTF32 as versions 3 and 4 run it on mma.sync: a_hi b_hi into one accumulator, the two cross
// terms into a second, k-step by k-step, the two added at the end (the 3xTF32 of version 1 is one GEMM, K = 3n)
enum Prec { PREC_FP32, PREC_3XTF32, PREC_TF32, PREC_BF16, PREC_3XTF32_2ACC };
static const char* prec_name(Prec p) {
    return p == PREC_FP32 ? "fp32" : p == PREC_3XTF32 ? "3xtf32" : p == PREC_TF32 ? "tf32" : p == PREC_BF16 ? "bf16"
                                                                                                    : "3xtf32 2acc";
}

static float round_prec(float x, Prec p) {
    if (p == PREC_FP32 || p == PREC_3XTF32 || p == PREC_3XTF32_2ACC || !std::isfinite(x)) return x;
    uint32_t u;
    memcpy(&u, &x, 4);
    if (p == PREC_TF32) u = (u + 0x1000u) & ~0x1FFFu;           // 10 mantissa bits, ties away (cvt.rna.tf32)
    else u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;      // 7 mantissa bits, ties to even (bf16)
    memcpy(&x, &u, 4);
    return x;
}

// fp32 rounding toward zero of a double
static float round_toward_zero(double v) {
    float f = (float)v;
    if (std::fabs((double)f) > std::fabs(v)) f = std::nextafter(f, 0.0f);
    return f;
}

// C = A B (n x n), operands rounded to prec, fp32 sums in k order. 3xTF32: one sum over the concatenated k ranges
// of a_hi b_hi, a_hi b_lo and a_lo b_hi (hi = TF32 rounding, lo = TF32 rounding of the rest), as version 1 runs it
// (one GEMM with K = 3n), modelled as tensor cores are measured to add: 8 exact products at a time, added to the
// fp32 accumulator with truncation (round toward zero), not rounding: the error grows like K u, not sqrt(K) u.
// 3xTF32 2acc: the same groups of 8, a_hi b_hi into one accumulator and the cross terms into another (versions 3
// and 4). lower: only the lower triangle is computed and mirrored (versions 3 and 4; every iterate is a symmetric
// polynomial in A in exact arithmetic).
static void matmul_f(int n, const float* A, const float* B, float* C, Prec prec, bool lower = false) {
    size_t nn = (size_t)n * n;
    bool split = prec == PREC_3XTF32 || prec == PREC_3XTF32_2ACC;
    Prec r = split ? PREC_TF32 : prec;
    MatF ah(nn), bh(nn), al(split ? nn : 0), bl(split ? nn : 0);
    for (size_t i = 0; i < nn; i++) {
        ah[i] = round_prec(A[i], r);
        bh[i] = round_prec(B[i], r);
        if (split) {
            al[i] = round_prec(A[i] - ah[i], PREC_TF32);
            bl[i] = round_prec(B[i] - bh[i], PREC_TF32);
        }
    }
    std::fill(C, C + nn, 0.0f);
    auto group = [&](const MatF& a, const MatF& b, int i, int j, int k0) {
        double g = 0.0;  // products of 11-bit significands: exact in double
        for (int k = k0; k < std::min(n, k0 + 8); k++) g += (double)a[(size_t)i * n + k] * b[(size_t)k * n + j];
        return g;
    };
    if (prec == PREC_3XTF32) {
        const MatF* as[3] = {&ah, &ah, &al};
        const MatF* bs[3] = {&bh, &bl, &bh};
        for (int i = 0; i < n; i++)
            for (int j = 0; j <= (lower ? i : n - 1); j++) {
                float acc = 0.0f;
                for (int part = 0; part < 3; part++)
                    for (int k0 = 0; k0 < n; k0 += 8)
                        acc = round_toward_zero((double)acc + group(*as[part], *bs[part], i, j, k0));
                C[(size_t)i * n + j] = acc;
            }
    } else if (prec == PREC_3XTF32_2ACC) {
        for (int i = 0; i < n; i++)
            for (int j = 0; j <= (lower ? i : n - 1); j++) {
                float big = 0.0f, small = 0.0f;
                for (int k0 = 0; k0 < n; k0 += 8) {
                    small = round_toward_zero((double)small + group(al, bh, i, j, k0));
                    small = round_toward_zero((double)small + group(ah, bl, i, j, k0));
                    big = round_toward_zero((double)big + group(ah, bh, i, j, k0));
                }
                C[(size_t)i * n + j] = big + small;
            }
    } else {
        for (int i = 0; i < n; i++)
            for (int k = 0; k < n; k++) {
                float aik = ah[(size_t)i * n + k];
                const float* bk = &bh[(size_t)k * n];
                float* ci = C + (size_t)i * n;
                for (int j = 0; j < n; j++) ci[j] = fmaf(aik, bk[j], ci[j]);
            }
    }
    if (lower)
        for (int i = 0; i < n; i++)
            for (int j = i + 1; j < n; j++) C[(size_t)i * n + j] = C[(size_t)j * n + i];
}

static double frob_minus_identity(int n, const float* M) {
    double s = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double d = (double)M[(size_t)i * n + j] - (i == j ? 1.0 : 0.0);
            s += d * d;
        }
    return std::sqrt(s);
}

// P = Y^p (p = 1, 2, 4) by squaring
static void matpow_f(int n, int p, const float* Y, float* P, Prec prec, bool lower) {
    if (p == 1) { std::copy(Y, Y + (size_t)n * n, P); return; }
    matmul_f(n, Y, Y, P, prec, lower);
    if (p == 4) {
        MatF t(P, P + (size_t)n * n);
        matmul_f(n, t.data(), t.data(), P, prec, lower);
    }
}

// One step in the form T = I + D (D = (I - M) / p), products in TF32: X <- X + X D; unless last, E = T^p - I
// (p = 2: 2 D + D D; p = 4: E2 = 2 D + D D, E = 2 E2 + E2 E2) and M <- M + E M. D, E and W are scratch.
// --study: below ||M - I||_F = 0.1 within the 3xTF32 tolerance, below 0.2 not (dev/matrix_roots_NOTES.md).
static void newton_step_tf32_delta(int n, int p, float* X, MatF& M, MatF& D, MatF& E, MatF& W, bool lower,
                                   bool last) {
    size_t nn = (size_t)n * n;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) D[(size_t)i * n + j] = ((i == j ? 1.0f : 0.0f) - M[(size_t)i * n + j]) / (float)p;
    matmul_f(n, X, D.data(), W.data(), PREC_TF32, lower);
    for (size_t e = 0; e < nn; e++) X[e] += W[e];
    if (last) return;
    E = D;
    for (int q = 1; q < p; q *= 2) {  // E <- 2 E + E E: (I + E)^2 - I
        matmul_f(n, E.data(), E.data(), W.data(), PREC_TF32, lower);
        for (size_t e = 0; e < nn; e++) E[e] = 2.0f * E[e] + W[e];
    }
    matmul_f(n, E.data(), M.data(), W.data(), PREC_TF32, lower);
    for (size_t e = 0; e < nn; e++) M[e] += W[e];
}

// The largest absolute row sum of A + eps I (A symmetric: summed over a column), in fp32: ||M0||_inf / z for
// newton_first_cap. eps = 0 where A already holds eps I (versions 2 and 3); version 1 adds eps to each sum.
static double max_abs_rowsum(int n, const float* A, float eps) {
    double m = 0.0;
    for (int i = 0; i < n; i++) {
        float g = 0.0f;
        for (int c = 0; c < n; c++) g += std::fabs(A[(size_t)c * n + i]);
        m = std::max(m, (double)(g + eps));
    }
    return m;
}

// The warp's float64 sum as the xor shuffle tree forms it (every lane ends with the same bits): part[32] in, its
// sum out.
static double warp_sum_cpu(double* part) {
    for (int o = 16; o > 0; o >>= 1) {
        double t[32];
        for (int l = 0; l < 32; l++) t[l] = part[l] + part[l ^ o];
        std::copy(t, t + 32, part);
    }
    return part[0];
}

// Lanczos as versions 2 and 3 run it (warp_lanczos and its product warps), bit for bit: w = A u / ||u|| (each row's
// four quarters of the np padded columns in lanczos_row's four chains, added as (p0 + p1) + (p2 + p3); zero columns
// add nothing), a lane's rows summed in order, then the xor tree; u = y - a v - b v_prev by two explicit float64 FMAs.
// alpha[j], beta[j] as lanczos_newton_start takes them; returns the steps (fewer only where a residual is exactly 0,
// or NaN). *rowsum_max: the largest sum of |a_ij| over a column (= row), in fp32.
static int lanczos_warp_cpu(int n, const float* A, double* alpha, double* beta, double* rowsum_max) {
    *rowsum_max = max_abs_rowsum(n, A, 0.0f);
    int np = lanczos23_np(n), R = np / 32, qc = np / 4;
    std::vector<float> Ap((size_t)np * np, 0.0f), u(np, 0.0f), v(np, 0.0f), v_prev(np), y(np, 0.0f);
    for (int i = 0; i < n; i++) std::copy(A + (size_t)i * n, A + (size_t)(i + 1) * n, Ap.begin() + (size_t)i * np);
    double part[32];
    for (int l = 0; l < 32; l++) {
        part[l] = 0.0;
        for (int i = R * l; i < R * l + R; i++) {
            u[i] = i < n ? lanczos_start(i) : 0.0f;
            part[l] += (double)u[i] * u[i];
        }
    }
    double b = std::sqrt(warp_sum_cpu(part));
    int k = 0;
    while (k < LANCZOS23_STEPS && b > 0.0) {
        float inv = (float)(1.0 / b);
        for (int l = 0; l < 32; l++) {
            part[l] = 0.0;
            for (int i = R * l; i < R * l + R; i++) {
                v_prev[i] = v[i];
                v[i] = u[i] * inv;
                float p[4];
                for (int q = 0; q < 4; q++)
                    p[q] = lanczos_row(Ap.data() + (size_t)q * qc * np + i, np, u.data() + q * qc, qc);
                y[i] = ((p[0] + p[1]) + (p[2] + p[3])) * inv;
                part[l] += (double)v[i] * y[i];
            }
        }
        double a = warp_sum_cpu(part);
        for (int l = 0; l < 32; l++) {
            part[l] = 0.0;
            for (int i = R * l; i < R * l + R; i++) {
                u[i] = (float)std::fma(-b, (double)v_prev[i], std::fma(-a, (double)v[i], (double)y[i]));
                part[l] += (double)u[i] * u[i];
            }
        }
        alpha[k] = a;
        b = std::sqrt(warp_sum_cpu(part));
        beta[k++] = b;
    }
    return k;
}

// Version 1's Lanczos kernel for n <= LZT_COLS (lanczos_tile_kernel): block b holds rows 32 b .. 32 b + 31 in
// registers, lane = row, warp w = the 32 columns 32 w .. 32 w + 31 (zero beyond n). A row of (A + eps I) q is the 32
// slices' partials (lanczos_row's four chains over the slice) summed by this fixed tree; the float64 sums of a step are
// the xor tree over the block's 32 rows, then over the blocks (zeros past the last): no atomics, the same bits on
// every run.
constexpr int LZT_COLS = 1024, LZT_THREADS = 1024;
__host__ __device__ inline float lzt_slice_tree(float* v) {  // v[32] in (overwritten), v[0] + ... + v[31] out
    for (int h = 16; h >= 1; h >>= 1)
        for (int s = 0; s < h; s++) v[s] = v[s] + v[s + h];
    return v[0];
}

// Host twin of lanczos_tile_kernel, bit for bit (n <= LZT_COLS; the same operations in the same order)
static int lanczos_tile_cpu(int n, const float* A, float eps, double* alpha, double* beta, double* rowsum_max) {
    int k = std::min(LANCZOS_STEPS, n), G = (n + 31) / 32;
    std::vector<float> a((size_t)G * 32 * LZT_COLS, 0.0f), q(LZT_COLS, 0.0f), qp(LZT_COLS, 0.0f), w(G * 32, 0.0f);
    for (int i = 0; i < n; i++)  // row i as the kernel reads it: column i of A (the same where A is symmetric)
        for (int c = 0; c < n; c++) a[(size_t)i * LZT_COLS + c] = A[(size_t)c * n + i];
    double part[32], sums[3][32];
    float v[32];
    *rowsum_max = 0.0;
    for (int i = 0; i < n; i++) {  // each slice summed in order, then the tree; + eps after (as max_abs_rowsum)
        for (int s = 0; s < 32; s++) {
            float g = 0.0f;
            for (int t = 0; t < 32; t++) g += std::fabs(a[(size_t)i * LZT_COLS + 32 * s + t]);
            v[s] = g;
        }
        *rowsum_max = std::max(*rowsum_max, (double)(lzt_slice_tree(v) + eps));
    }
    for (int l = 0; l < 32; l++) {
        part[l] = 0.0;
        for (int i = l; i < n; i += 32) part[l] += (double)lanczos_start(i) * lanczos_start(i);
    }
    float inv = (float)(1.0 / std::sqrt(warp_sum_cpu(part)));  // the recurrence's beta_1 needs a unit q1
    for (int i = 0; i < n; i++) q[i] = lanczos_start(i) * inv;
    double beta_prev = 0.0;
    for (int j = 0; j < k; j++) {
        for (int b = 0; b < 32; b++) sums[0][b] = sums[1][b] = sums[2][b] = 0.0;
        for (int b = 0; b < G; b++) {
            double t[3][32];
            for (int l = 0; l < 32; l++) {
                int row = 32 * b + l;
                for (int s = 0; s < 32; s++) v[s] = lanczos_row(a.data() + (size_t)row * LZT_COLS + 32 * s, 1,
                                                                q.data() + 32 * s, 32);
                float y = lzt_slice_tree(v);
                w[row] = row < n ? fmaf(-(float)beta_prev, qp[row], fmaf(eps, q[row], y)) : 0.0f;
                t[0][l] = (double)q[row] * w[row];
                t[1][l] = (double)w[row] * w[row];
                t[2][l] = (double)q[row] * q[row];
            }
            for (int c = 0; c < 3; c++) sums[c][b] = warp_sum_cpu(t[c]);
        }
        double qw = warp_sum_cpu(sums[0]), ww = warp_sum_cpu(sums[1]), qq = warp_sum_cpu(sums[2]);
        bool more = lanczos_coeffs(qw, ww, qq, &alpha[j], &beta[j]);
        if (!more || j == k - 1) return j + 1;
        float fa = (float)alpha[j], fb = (float)(1.0 / beta[j]);
        for (int i = 0; i < n; i++) {
            qp[i] = q[i];
            q[i] = fmaf(-fa, q[i], w[i]) * fb;
        }
        beta_prev = beta[j];
    }
    return k;
}

// Host twin of version 1's Lanczos: lanczos_tile_cpu for n <= LZT_COLS (bit for bit); above, lanczos_kernel's
// arithmetic (fp32 w and q, float64 sums; the kernel adds w's rows in another order, by atomics).
// alpha, beta, *rowsum_max and the steps returned as lanczos_warp_cpu gives them (fewer steps at a breakdown, or n).
static int lanczos_grid_cpu(int n, const float* A, float eps, double* alpha, double* beta, double* rowsum_max) {
    if (n <= LZT_COLS) return lanczos_tile_cpu(n, A, eps, alpha, beta, rowsum_max);
    int k = std::min(LANCZOS_STEPS, n);
    *rowsum_max = max_abs_rowsum(n, A, eps);
    std::vector<float> q(n), qp(n, 0.0f), w(n);
    double qq1 = 0.0;
    for (int i = 0; i < n; i++) {
        q[i] = lanczos_start(i);
        qq1 += (double)q[i] * q[i];
    }
    float inv = (float)(1.0 / std::sqrt(qq1));  // the recurrence's beta_1 needs a unit q1
    for (int i = 0; i < n; i++) q[i] *= inv;
    double beta_prev = 0.0;
    for (int j = 0; j < k; j++) {
        double qw = 0.0, ww = 0.0, qq = 0.0;
        for (int i = 0; i < n; i++) {
            float s = 0.0f;
            for (int c = 0; c < n; c++) s += A[(size_t)i * n + c] * q[c];
            w[i] = s + eps * q[i] - (float)beta_prev * qp[i];
            qw += (double)q[i] * w[i];
            ww += (double)w[i] * w[i];
            qq += (double)q[i] * q[i];
        }
        bool more = lanczos_coeffs(qw, ww, qq, &alpha[j], &beta[j]);
        if (!more || j == k - 1) return j + 1;
        float fa = (float)alpha[j], fb = (float)(1.0 / beta[j]);
        for (int i = 0; i < n; i++) {
            qp[i] = q[i];
            q[i] = (w[i] - fa * q[i]) * fb;
        }
        beta_prev = beta[j];
    }
    return k;
}

// The coupled Newton iteration of versions 1 and 2 on the CPU, products in prec. extra: full steps taken after the
// stopping rule says stop, as version 1 does to the matrices of a batch that converge before the slowest one.
// lower: every product computes its lower triangle and mirrors it (versions 3 and 4).
// tf32_below > 0 (version 1's default, V1_DELTA_BELOW; other columns of --study): once ||M - I||_F < tf32_below,
// steps in the form T = I + D, X <- X + X D, M <- M + (T^p - I) M, every product in plain TF32: their rounding is
// relative to ||D||, not to ||X|| or ||M||. *tf32_steps counts them. (Those steps do not carry the scaled interval.)
// start: NEWTON_SCALED (versions 2 and 3; NEWTON_SCALED_V1 version 1's): z and the interval from Lanczos,
// T = a^(1/p) ((p + 1) I - a M) / p with a from NewtonScale; if that fails or does not converge, the unscaled iteration
// reruns (fell_back). NEWTON_UNSCALED (version 4, version 1's batches): z = (p + 1) / (2 ||A||_F), a = 1.
static NewtonState newton_cpu(int n, int p, float eps, const float* A, float* X, Prec prec, int extra = 0,
                              bool lower = false, double tf32_below = 0.0, int* tf32_steps = nullptr,
                              NewtonStart start = NEWTON_SCALED) {
    size_t nn = (size_t)n * n;
    MatF Areg(A, A + nn), M(nn), T(nn), Tp(nn), W(nn);
    for (int i = 0; i < n; i++) Areg[(size_t)i * n + i] += eps;
    double nrm = 0.0;
    for (float v : Areg) nrm += (double)v * v;
    NewtonState s;
    int discarded = 0, extra_left = extra;
    bool fell_back = false;
    for (int attempt = start == NEWTON_UNSCALED ? 1 : 0; attempt < 2; attempt++) {
        bool scaled = attempt == 0;
        NewtonScale scale;
        float z = (float)((p + 1) / (2.0 * std::sqrt(nrm)));
        double first_cap = INFINITY;
        if (scaled) {
            double alpha[LANCZOS_STEPS], beta[LANCZOS_STEPS], zd, lo, rowsum_max;
            bool v1 = start == NEWTON_SCALED_V1;
            int k = v1 ? lanczos_grid_cpu(n, A, eps, alpha, beta, &rowsum_max)
                       : lanczos_warp_cpu(n, Areg.data(), alpha, beta, &rowsum_max);
            lanczos_newton_start(alpha, beta, k, &zd, &lo, v1 ? Multisection() : lanczos23_multisection_cpu(n));
            if (start == NEWTON_SCALED_BAD_HI) {
                zd *= NEWTON_BAD_HI_FACTOR;
                lo *= NEWTON_BAD_HI_FACTOR;
            }
            z = (float)zd;
            scale.lo = lo;
            first_cap = newton_first_cap(p, z, rowsum_max);
        }
        s = NewtonState();
        s.n = n;
        s.p = p;
        s.max_iter = newton_max_iter(p, z * (double)eps);
        extra = extra_left;
        float x0 = std::pow(z, 1.0f / p);
        for (size_t i = 0; i < nn; i++) { M[i] = z * Areg[i]; X[i] = 0.0f; }
        for (int i = 0; i < n; i++) X[(size_t)i * n + i] = x0;
        for (;;) {
            NewtonAction act = newton_decide(s, frob_minus_identity(n, M.data()));
            if (act == NEWTON_FAIL) break;
            if (act == NEWTON_LAST && extra > 0) {
                act = NEWTON_STEP;
                extra--;
            }
            if (s.r < tf32_below) {
                newton_step_tf32_delta(n, p, X, M, T, Tp, W, lower, act == NEWTON_LAST);
                if (tf32_steps) ++*tf32_steps;
                if (act == NEWTON_LAST) break;
                s.iters++;
                continue;
            }
            // unscaled: the division of the GPU versions' history (bitwise as before); scaled: versions 2 and 3's
            // arithmetic, a and c = a^(1/p) / p rounded to fp32 (version 1's a also from this step's r)
            double r = start == NEWTON_SCALED_V1 ? s.r : INFINITY;
            double cap = s.iters == 0 ? first_cap : INFINITY;
            double a = !scaled ? 1.0
                       : start == NEWTON_SCALED_V1 ? newton_scale_a(scale, p, r, cap) : newton_scale_a23(scale, p, cap);
            float af = (float)a, cf = (float)(newton_root_p(a, p) / p);
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) {
                    float diag = i == j ? (float)(p + 1) : 0.0f, m = M[(size_t)i * n + j];
                    T[(size_t)i * n + j] = scaled ? (diag - af * m) * cf : (diag - m) / (float)p;
                }
            if (s.iters == 0) {  // X0 = x0 I: the GPU versions take x0 T for the first X T, no product
                for (size_t i = 0; i < nn; i++) X[i] = x0 * T[i];
            } else {
                matmul_f(n, X, T.data(), W.data(), prec, lower);
                std::copy(W.begin(), W.end(), X);
            }
            if (act == NEWTON_LAST) break;
            matpow_f(n, p, T.data(), Tp.data(), prec, lower);
            matmul_f(n, Tp.data(), M.data(), W.data(), prec, lower);
            M.swap(W);
            if (scaled) scale.advance(p, a, s.iters == 0);
            s.iters++;
        }
        if (!scaled || (!s.failed && s.converged)) break;
        fell_back = true;
        discarded = s.iters;
        if (tf32_steps) *tf32_steps = 0;
    }
    s.fell_back = fell_back;
    s.discarded = discarded;
    return s;
}

// Newton-Schulz (Muon's quintic): X <- a X + (b A + c A^2) X with A = X X^T, on X0 = G / (||G||_F + 1e-7), for a
// G of m x n, transposed when tall (m > n) so that A is the smaller Gram matrix. The map acts on each singular value:
// s -> a s + b s^3 + c s^5, which sends [2e-3, 1] into about [0.68, 1.21] in 5 steps, not to 1 (speed over accuracy).
constexpr double NS_A = 3.4445, NS_B = -4.7750, NS_C = 2.0315;
constexpr int NS_STEPS = 5;
static double ns_scalar(double s, int steps) {
    for (int k = 0; k < steps; k++) s = NS_A * s + NS_B * s * s * s + NS_C * s * s * s * s * s;
    return s;
}

// The iteration in float64 (EMU = false) or emulating the GPU's arithmetic (EMU = true: X, A and B stored in bf16,
// every product and the a/b/c combinations summed in fp32, as cuBLAS GemmEx with CUBLAS_COMPUTE_32F does).
// out: m x n, float64.
template <bool EMU>
static void ns_cpu(int m, int n, const float* G, std::vector<double>& out) {
    typedef typename std::conditional<EMU, float, double>::type Acc;
    auto store = [](Acc v) -> double { return EMU ? (double)round_prec((float)v, PREC_BF16) : (double)v; };
    bool tall = m > n;
    int r = tall ? n : m, c = tall ? m : n;  // X is r x c, r <= c
    double nrm = 0.0;
    for (size_t i = 0; i < (size_t)m * n; i++) nrm += (double)G[i] * G[i];
    Acc scale = (Acc)(1.0 / (std::sqrt(nrm) + 1e-7));
    std::vector<double> X((size_t)r * c), Xn((size_t)r * c), A((size_t)r * r), B((size_t)r * r);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            size_t at = tall ? (size_t)j * c + i : (size_t)i * c + j;
            X[at] = store((Acc)G[(size_t)i * n + j] * scale);
        }
    for (int step = 0; step < NS_STEPS; step++) {
        for (int i = 0; i < r; i++)
            for (int j = 0; j < r; j++) {
                Acc s = 0;
                for (int k = 0; k < c; k++) s += (Acc)X[(size_t)i * c + k] * (Acc)X[(size_t)j * c + k];
                A[(size_t)i * r + j] = store(s);
            }
        for (int i = 0; i < r; i++)
            for (int j = 0; j < r; j++) {
                Acc s = 0;
                for (int k = 0; k < r; k++) s += (Acc)A[(size_t)i * r + k] * (Acc)A[(size_t)k * r + j];
                B[(size_t)i * r + j] = store((Acc)NS_C * s + (Acc)NS_B * (Acc)A[(size_t)i * r + j]);
            }
        for (int i = 0; i < r; i++) {
            std::vector<Acc> row(c, (Acc)0);
            for (int k = 0; k < r; k++) {
                Acc b = (Acc)B[(size_t)i * r + k];
                for (int j = 0; j < c; j++) row[j] += b * (Acc)X[(size_t)k * c + j];
            }
            for (int j = 0; j < c; j++) Xn[(size_t)i * c + j] = store(row[j] + (Acc)NS_A * (Acc)X[(size_t)i * c + j]);
        }
        X.swap(Xn);
    }
    out.resize((size_t)m * n);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) out[(size_t)i * n + j] = tall ? X[(size_t)j * c + i] : X[(size_t)i * c + j];
}

// Singular values of an m x n matrix (float64): square roots of the eigenvalues of its smaller Gram matrix.
static std::vector<double> singular_values(int m, int n, const double* Y) {
    bool tall = m > n;
    int r = tall ? n : m, c = tall ? m : n;
    MatD g((size_t)r * r);
    for (int i = 0; i < r; i++)
        for (int j = 0; j < r; j++) {
            double s = 0.0;
            for (int k = 0; k < c; k++)
                s += tall ? Y[(size_t)k * n + i] * Y[(size_t)k * n + j] : Y[(size_t)i * n + k] * Y[(size_t)j * n + k];
            g[(size_t)i * r + j] = s;
        }
    std::vector<double> w;
    MatD V;
    jacobi_eigh(r, g, w, V);
    for (auto& v : w) v = std::sqrt(std::max(v, 0.0));
    std::sort(w.begin(), w.end());
    return w;
}

// G = U diag(sigma) V^T (m x n) with sigma log-spaced from 1 down to 1/kappa: controlled singular values.
static MatF make_with_singular_values(int m, int n, double kappa, Rng& rng) {
    int r = std::min(m, n);
    MatD U = random_orthogonal(m, rng), V = random_orthogonal(n, rng);
    MatF G((size_t)m * n);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0.0;
            for (int k = 0; k < r; k++) s += U[(size_t)k * m + i] * std::pow(kappa, -(double)k / std::max(1, r - 1)) *
                                              V[(size_t)k * n + j];
            G[(size_t)i * n + j] = (float)s;
        }
    return G;
}

// ----------------------------------------------------------------------------------------------------------------
// Kronecker statistics, CPU oracle: C = beta C0 + alpha P P^T (N x N) in float64, P(i, k) given as a function
// (K columns). scale[i, j] = |alpha| sum_k |P_ik P_jk| + |beta C0_ij|: the size of the rounding error any fp32
// summation order may make (the bound gamma_K * scale). beta = 0 never reads C0.
template <typename F>
static void syrk_oracle(int N, int K, F P, double alpha, double beta, const float* C0, MatD& ref, MatD& scale) {
    ref.assign((size_t)N * N, 0.0);
    scale.assign((size_t)N * N, 0.0);
    MatD p((size_t)N * K);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < K; k++) p[(size_t)i * K + k] = P(i, k);
    for (int i = 0; i < N; i++)
        for (int j = 0; j <= i; j++) {
            double s = 0.0, sa = 0.0;
            for (int k = 0; k < K; k++) {
                double v = p[(size_t)i * K + k] * p[(size_t)j * K + k];
                s += v;
                sa += std::fabs(v);
            }
            double r = alpha * s, ra = std::fabs(alpha) * sa;
            if (beta != 0.0) {
                r += beta * C0[(size_t)i * N + j];
                ra += std::fabs(beta * C0[(size_t)i * N + j]);
            }
            ref[(size_t)i * N + j] = ref[(size_t)j * N + i] = r;
            scale[(size_t)i * N + j] = scale[(size_t)j * N + i] = ra;
        }
}

// The feature index of a 3x3 patch entry, as train_mnist's im2col orders it: (ky * 3 + kx) * C + c. A patch of
// output position (b, oy, ox) reads x[b, oy + ky - pad, ox + kx - pad, c] (0 outside), stride 1.
static double im2col_value(const float* x, int H, int W, int C, int pad, int feature, int position) {
    int OH = H + 2 * pad - 2, OW = W + 2 * pad - 2;
    int b = position / (OH * OW), oy = position / OW % OH, ox = position % OW;
    int tap = feature / C, c = feature % C, iy = oy + tap / 3 - pad, ix = ox + tap % 3 - pad;
    if (iy < 0 || iy >= H || ix < 0 || ix >= W) return 0.0;
    return x[(((size_t)b * H + iy) * W + ix) * C + c];
}

// ----------------------------------------------------------------------------------------------------------------
// Tolerances of the inverse roots against the oracle. An fp32 method on an input of effective condition number
// kappa = lambda_max / lambda_min (of A + eps I) has a relative error of order u kappa / p: the fp32 input, and the
// fp32 A + eps I, already move lambda_min by u lambda_max.
//
// Eigendecomposition (version 0), from its backward error (not from measurements). cuSOLVER's syevd / syevjBatched
// return V, lambda with A + eps I + E = V diag(lambda) V^T (V orthogonal to working accuracy),
// ||E||_2 <= c_E u ||A||_2:
//   c_E = 1             forming A + eps I in fp32 (a diagonal perturbation <= u max |a_ii|)
//       + max(8, 2 sqrt(n))   the solver's stopping tolerance, whichever path ran: divide and conquer (syevd)
//                       deflates, as LAPACK's slaed2 does, a secular-equation component or two close poles below
//                       8 eps ||T|| (a perturbation of that size; assumed for cuSOLVER's stedc, which does not
//                       document it); Jacobi (syevjBatched) stops at ||off(A)||_F <= tol ||A||_F, tol = 2u (set in
//                       gpu_init), <= 2 sqrt(n) u ||A||_2
//       + 2 sqrt(n)     Householder tridiagonalisation and back-transformation (or the Jacobi rotations): n - 2
//                       sequential rank-2 updates of every element, the probabilistic model of Higham and Mary
//                       (independent rounding errors: sqrt(n) u growth, lambda = 2) instead of the worst case n u,
//                       which makes the bound vacuous (37 u at n = 37 is a relative error above 1 at kappa_eff 5e5)
// First order in E, f(t) = t^(-1/p) (Daleckii-Krein): in V's basis f(A + E) - f(A) has entries f[l_i, l_j] E_ij with
// |f[l_i, l_j]| <= |f'(min(l_i, l_j))| = max(f_i, f_j) / (p min(l_i, l_j)) <= max(f_i, f_j) kappa / (p lambda_max)
// (f convex, decreasing). Row i of E has 2-norm <= ||E||_2, so sum_ij E_ij^2 max(f_i, f_j)^2 <=
// sum_ij E_ij^2 (f_i^2 + f_j^2) <= 2 ||E||_2^2 ||X||_F^2:
//   rel err <= sqrt(2) (kappa / p) ||E||_2 / ||A||_2 + eta <= sqrt(2) c_E u kappa / p + eta
// eta, the reconstruction X = V^T diag(f) V in fp32: f(lambda) <= 2.5 u (two sqrt and a division), the scaled copy
// u, the GEMM's length-n sums 2 sqrt(n) u (same probabilistic model), V's departure from orthogonality (V^T V - I,
// of order sqrt(n) u, entering twice) 2 sqrt(n) u: eta = u (4 sqrt(n) + 4).
// Residual: with X = (A + E)^(-1/p) exactly, X^p A - I = -(A + E)^(-1) E, so ||.||_F / sqrt(n) <= ||E||_2 / lambda_min
// = c_E u kappa; a relative error eta in X adds p eta kappa (||X^(p-1)||_2 ||X||_2 ||A||_2 = kappa):
//   res <= kappa u (c_E + p (4 sqrt(n) + 4))
// No margin factor on top: the bound is the margin. On the first H100 run (2026-11-26, dev/matrix_roots_NOTES.md)
// the worst observed error / bound was 0.20 (relative error) and 0.21 (residual); the observed errors at kappa_eff
// 5e5 were 3.3-4.9 u kappa / p with syevd and 0.4-0.5 with syevjBatched (numpy's LAPACK syevd gave 0.05: the earlier
// tolerance, 0.2 u kappa / p fitted to it, was below what cuSOLVER's syevd guarantees or does).
// At kappa_eff 5e5 this tolerance (0.6-0.9 relative at n = 37 .. 100, p = 1) cannot tell eps from 2 eps: an fp32
// eigendecomposition does not determine lambda_min = 2e-6 better than c_E u ~ 1.2e-6 there.
//
// Coupled Newton (versions 1 and 2), n >= 2: measured constants (--study and the CPU twin at n = 32 .. 257),
// each tolerance about 3x the worst case measured:
//   coupled Newton fp32: rel err <= 0.08 u sqrt(n) kappa / p  -> u sqrt(n) (2 + 0.25 kappa / p)
//   coupled Newton 3xTF32, modelled with truncating tensor-core accumulation (matmul_f): the error grows like n,
//   rel err <= 0.02 u n kappa / p                            -> u (4 sqrt(n) + 0.06 n kappa / p)
//   residual ||X^p A - I||_F / sqrt(n): fp32 Newton <= 0.7 u sqrt(n) kappa -> u sqrt(n) (2 p + 2 kappa)
//                                       3xTF32 <= 0.37 u n kappa           -> u (4 p sqrt(n) + 1.2 n kappa)
// Coupled Newton, n = 1 (the fit above gives 2 u there, less than the roundings of 2K + 1 sequential products):
// newton_scalar_tolerance, a first-order analysis of the scalar iteration.
constexpr double U32 = 5.9604644775390625e-08;  // 2^-24, the unit roundoff of fp32
enum RootMethod { METHOD_EIG, METHOD_NEWTON_FP32, METHOD_NEWTON_3XTF32 };
struct RootTol { double rel, res; };

// The coupled iteration on a 1x1 matrix a (a + eps > 0). Let rho = M / (X^p (a + eps)) - 1, the broken invariant.
//   start: a + eps in fp32 (u), M0 = z (a + eps) (u), X0 = z^(1/p) (powf: <= 4 ulps = 8 u; version 1 rounds a double
//          pow and a double z separately: less), so |rho_0| <= (2 + 8 p) u;
//   a full step: X <- X T (one product, error <= u_prod) moves rho by p u_prod; M <- T^p M (p = 1: one product;
//          p = 2: T T, then M; p = 4: T T, its square, then M: relative error 1, 2, 4 u_prod = p u_prod) moves it
//          by p u_prod; T itself may carry any rounding: X and M use the same T;
//   the last step: X only, p u_prod.
// At the end X = (M / (a + eps))^(1/p) (1 + rho)^(-1/p), and M = 1 up to the stopping rule's truncation, so
//   rel err <= ((2 + 8 p) u + (2 K + 1) p u_prod) / p + trunc,  residual |X^p (a + eps) - 1| <= p rel err.
// u_prod: fp32, u (one multiplication); 3xTF32: hi = TF32 rounding (2^-11 relative), lo = TF32 rounding of the rest,
// so a = hi + lo + r with |r| <= 2^-22 |a| = 4 u; the GEMM drops lo lo, r b and a r (<= 12 u) and sums 3 terms into
// the fp32 accumulator (<= 2 u, truncating): 14 u.
// For n = 1, z = (p + 1) / (2 |a + eps|) makes M0 = (p + 1) / 2 whatever a is: the step count K and the truncation
// (X_K m^(-1/p) is the exact root, the last step gives X_K t(m): |t(m) m^(1/p) - 1|) come from running the scalar map
// and newton_decide in float64; K + 1 covers a step that rounding may add.
static RootTol newton_scalar_tolerance(bool split, int p) {
    NewtonState s;
    s.n = 1;
    s.p = p;
    s.max_iter = newton_max_iter(p, (p + 1) / 2.0);
    double m = (p + 1) / 2.0;
    for (;;) {
        NewtonAction act = newton_decide(s, std::fabs(m - 1.0));
        if (act != NEWTON_STEP) break;
        double t = (p + 1 - m) / p;
        m *= std::pow(t, p);
        s.iters++;
    }
    double t = (p + 1 - m) / p, trunc = std::fabs(t * std::pow(m, 1.0 / p) - 1.0);
    double u_prod = split ? 14.0 * U32 : U32;
    int K = s.iters + 1;
    double rel = ((2.0 + 8.0 * p) * U32 + (2.0 * K + 1.0) * p * u_prod) / p + trunc;
    return {rel, p * rel};
}

static RootTol root_tolerance(RootMethod m, int n, int p, double kappa) {
    double sn = std::sqrt((double)n);
    if (m == METHOD_EIG) {
        double c_e = 1.0 + std::max(8.0, 2.0 * sn) + 2.0 * sn, eta = U32 * (4.0 * sn + 4.0);
        return {std::sqrt(2.0) * c_e * U32 * kappa / p + eta, kappa * (c_e * U32 + p * eta)};
    }
    if (n == 1) return newton_scalar_tolerance(m == METHOD_NEWTON_3XTF32, p);
    if (m == METHOD_NEWTON_FP32) return {U32 * sn * (2.0 + 0.25 * kappa / p), U32 * sn * (2.0 * p + 2.0 * kappa)};
    return {U32 * (4.0 * sn + 0.06 * n * kappa / p), U32 * (4.0 * p * sn + 1.2 * n * kappa)};
}

// ----------------------------------------------------------------------------------------------------------------
// GPU context: handles, device limits, and workspaces that grow on demand and are kept (cudaMalloc and cudaFree
// synchronise: only the first call at a new largest size pays). Everything runs on g_stream: the default stream here,
// PyTorch's current stream inside dev/torch_ops (which also gives it to the cuBLAS and cuSOLVER handles).

// Version 1's choices (inv_root_v1; --bench times each as a row of its own): a scaled start from a Lanczos estimate
// of the spectrum (one matrix), and how the 3xTF32 products run: one K = 3n GEMM on copies split per product
// (concat), or three K = n GEMMs on operands split once per matrix (split); cuBLAS's default algorithm, or the
// fastest of it and cuBLASLt's candidates for the shape, timed once (lt). lower: concat operands, but only the
// lower-triangle blocks of a b x b blocking in one batched GEMM, then mirrored (every iterate is symmetric in exact
// arithmetic; half the FLOPs, 36 independent outputs at n = 1024, b = 128); cuBLAS's default only (lt is ignored).
// fp16: the concat form with fp16 parts (split3_f16_kernel): the same three terms at twice TF32's tensor-core rate.
// The environment variable MATRIX_ROOTS_V1 sets the defaults, e.g. MATRIX_ROOTS_V1=split,lt (dev/torch_ops uses the
// defaults).
enum V1Products { V1_CONCAT, V1_SPLIT, V1_LOWER, V1_F16 };
constexpr double V1_DELTA_BELOW = 0.1;  // `delta`: ||M - I||_F below which version 1 steps in the I + D form
struct V1Options {
    bool scaled = true;
    V1Products products = V1_F16;  // 3xTF32's accuracy at twice its tensor-core rate
    bool lt = false;
    int lower_block = 128;  // V1_LOWER's b: 64, 128 or 256
    double delta_below = V1_DELTA_BELOW;  // concat products: I + D steps in TF32 below this ||M - I||_F (0: never)
};
static V1Options g_v1;

// MATRIX_ROOTS_V1's value: words separated by commas from scaled, unscaled, concat, split, fp16, lower (b = 128),
// lower64, lower128, lower256, lt, cublas, delta, nodelta (a later word overrides an earlier one); false on any
// other word
static bool parse_v1_options(const char* text, V1Options* o) {
    std::string s(text);
    for (size_t at = 0;;) {
        size_t end = s.find(',', at);
        std::string w = s.substr(at, end == std::string::npos ? std::string::npos : end - at);
        if (w == "scaled") o->scaled = true;
        else if (w == "unscaled") o->scaled = false;
        else if (w == "concat") o->products = V1_CONCAT;
        else if (w == "split") o->products = V1_SPLIT;
        else if (w == "fp16") o->products = V1_F16;
        else if (w == "lower" || w == "lower64" || w == "lower128" || w == "lower256") {
            o->products = V1_LOWER;
            o->lower_block = w == "lower" ? 128 : std::atoi(w.c_str() + 5);
        }
        else if (w == "lt") o->lt = true;
        else if (w == "cublas") o->lt = false;
        else if (w == "delta") o->delta_below = V1_DELTA_BELOW;
        else if (w == "nodelta") o->delta_below = 0.0;
        else return false;
        if (end == std::string::npos) return true;
        at = end + 1;
    }
}

struct GpuContext {
    bool ready = false;
    cublasHandle_t blas = nullptr;
    cublasLtHandle_t lt = nullptr;  // version 1's timed GEMMs (lt_gemm)
    cusolverDnHandle_t solver = nullptr;
    syevjInfo_t syevj = nullptr;
    int sms = 0, cc_major = 0, cc_minor = 0;
    size_t smem_optin = 0;
    char name[256] = {};
};
static GpuContext g_gpu;

static cudaStream_t g_stream = 0;  // kernels, copies and host decisions; the handles' stream is set with it

// the current device's facts, handles and solver settings (the handles belong to that device)
static void gpu_init() {
    if (g_gpu.ready) return;
    cudaDeviceProp prop;
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaGetDeviceProperties(&prop, dev));
    g_gpu.sms = prop.multiProcessorCount;
    g_gpu.cc_major = prop.major;
    g_gpu.cc_minor = prop.minor;
    g_gpu.smem_optin = prop.sharedMemPerBlockOptin;
    snprintf(g_gpu.name, sizeof g_gpu.name, "%s", prop.name);
    cublasCheck(cublasCreate(&g_gpu.blas));
    cublasCheck(cublasLtCreate(&g_gpu.lt));
    const char* v1 = getenv("MATRIX_ROOTS_V1");
    if (v1 && !parse_v1_options(v1, &g_v1))
        fail(std::string("MATRIX_ROOTS_V1=") + v1 +
             ": expected words from scaled, unscaled, concat, split, fp16, lower, lower64, lower128, lower256, lt, "
             "cublas, delta, nodelta, separated by commas");
    // strict fp32 unless a call asks for TF32 through its compute type (CUBLAS_COMPUTE_32F_FAST_TF32)
    cublasCheck(cublasSetMathMode(g_gpu.blas, CUBLAS_DEFAULT_MATH));
    cusolverCheck(cusolverDnCreate(&g_gpu.solver));
    cusolverCheck(cusolverDnCreateSyevjInfo(&g_gpu.syevj));
    cusolverCheck(cusolverDnXsyevjSetSortEig(g_gpu.syevj, 1));
    // syevjBatched's stopping rule, explicit (both are cuSOLVER's defaults): off(A) <= tol ||A||_F with tol = 2u
    // (FLT_EPSILON, fp32's machine accuracy; the backward error root_tolerance assumes), at most 100 sweeps; a
    // matrix that does not get there returns info != 0, which inv_root_v0 counts and the callers report
    cusolverCheck(cusolverDnXsyevjSetTolerance(g_gpu.syevj, 2.0 * U32));
    cusolverCheck(cusolverDnXsyevjSetMaxSweeps(g_gpu.syevj, 100));
    g_gpu.ready = true;
}

// a device-to-host copy ordered after the work on g_stream (the host decisions of the Newton iterations)
static void copy_to_host(void* dst, const void* src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g_stream));
    cudaCheck(cudaStreamSynchronize(g_stream));
}

enum WsSlot { WS_M, WS_T, WS_T2, WS_W, WS_A3, WS_B3, WS_SUMS, WS_LAMBDA, WS_INFO, WS_WORK, WS_NS_X, WS_NS_XN,
              WS_NS_A, WS_NS_B, WS_STATUS, WS_COOP_SUMS, WS_SPLIT, WS_LT_WORK, WS_LT_SCRATCH, WS_LANCZOS,
              WS_LANCZOS_W, WS_LOWER_PTRS, WS_LOWER_C, WS_X0, WS_COUNT };
static void* g_ws[WS_COUNT] = {};
static size_t g_ws_bytes[WS_COUNT] = {};
static void* ws_get(WsSlot slot, size_t bytes) {
    if (bytes > g_ws_bytes[slot]) {
        if (g_ws[slot]) cudaCheck(cudaFree(g_ws[slot]));
        cudaCheck(cudaMalloc(&g_ws[slot], bytes));
        g_ws_bytes[slot] = bytes;
    }
    return g_ws[slot];
}
static void lt_free();
static void gpu_free() {
    for (int s = 0; s < WS_COUNT; s++) {
        if (g_ws[s]) cudaCheck(cudaFree(g_ws[s]));
        g_ws[s] = nullptr;
        g_ws_bytes[s] = 0;
    }
    if (!g_gpu.ready) return;
    cusolverCheck(cusolverDnDestroySyevjInfo(g_gpu.syevj));
    cusolverCheck(cusolverDnDestroy(g_gpu.solver));
    lt_free();
    cublasCheck(cublasLtDestroy(g_gpu.lt));
    cublasCheck(cublasDestroy(g_gpu.blas));
    g_gpu = GpuContext();
}

static long long ceil_div_ll(long long a, long long b) { return (a + b - 1) / b; }
static int grid_for(long long total, int threads, int max_blocks = 65535) {
    return (int)std::max(1LL, std::min((long long)max_blocks, (total + threads - 1) / threads));
}

// Shape checks shared by the inverse-root versions: every bad argument is a message naming it.
static void check_root_args(const char* fn, const float* A, const float* X, int batch, int n, int p, float eps) {
    if (n < 1) fail_arg(fn, "n", n, ">= 1");
    if (batch < 1 || batch > 65535) fail_arg(fn, "batch", batch, "in [1, 65535]");
    if (p != 1 && p != 2 && p != 4) fail_arg(fn, "p", p, "1, 2 or 4");
    if (!(eps > 0.0f) || !std::isfinite(eps)) {
        fprintf(stderr, "%s: argument eps = %g, expected a finite value > 0\n", fn, eps);
        exit(EXIT_FAILURE);
    }
    if (!A || !X) { fprintf(stderr, "%s: argument %s is null\n", fn, A ? "X" : "A"); exit(EXIT_FAILURE); }
    if (A == X) { fprintf(stderr, "%s: X must not alias A\n", fn); exit(EXIT_FAILURE); }
}

// ----------------------------------------------------------------------------------------------------------------
// small kernels shared by the versions (grid-stride loops, 64-bit indices; batch of row-major n x n matrices)

// out = A + eps I
__global__ void add_eps_kernel(const float* A, float* out, int n, long long total, float eps) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long e = idx % ((long long)n * n);
        out[idx] = A[idx] + (e / n == e % n ? eps : 0.0f);
    }
}

// Version 1's I + D steps (newton_step_tf32_delta is the twin): D = (I - M) / p; then y = c y + w after each TF32
// product w (c = 1: X + X D, M + E M; c = 2: E <- 2 E + E E)
__global__ void delta_kernel(const float* M, float* D, int n, int p, long long total) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long e = idx % ((long long)n * n);
        D[idx] = ((e / n == e % n ? 1.0f : 0.0f) - M[idx]) / (float)p;
    }
}
__global__ void scale_add_kernel(float* y, const float* w, float c, long long total) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x)
        y[idx] = c * y[idx] + w[idx];
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// sums[b] += sum over a chunk of matrix b (blockIdx.y) of (M - shift I)^2, in double (the matrix norms and the
// Newton residual ||M - I||_F^2). With T != nullptr it also writes the Newton step's T = ((p + 1) I - M) / p from
// the same read of M. sums must be zeroed first. Block size 256.
__global__ void sumsq_kernel(const float* M, double* sums, float* T, long long count, int n, int p, float shift) {
    long long base = blockIdx.y * count;  // count: elements per matrix (n x n when shift or T is used)
    double s = 0.0;
    float inv_p = 1.0f / (float)p, diag = (float)(p + 1);
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < count;
         e += (long long)gridDim.x * blockDim.x) {
        // e = i n + j is on the diagonal iff e is a multiple of n + 1 (one 32-bit remainder, not two 64-bit divisions)
        bool on_diag = count <= UINT32_MAX ? (uint32_t)e % (uint32_t)(n + 1) == 0 : e % (n + 1) == 0;
        float m = M[base + e];
        float d = m - (on_diag ? shift : 0.0f);
        s += (double)d * d;
        if (T) T[base + e] = ((on_diag ? diag : 0.0f) - m) * inv_p;
    }
    __shared__ double partial[8];
    s = warp_sum_d(s);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0;
        s = warp_sum_d(s);
        if (threadIdx.x == 0) atomicAdd(&sums[blockIdx.y], s);
    }
}

static void sumsq(const float* M, double* sums, float* T, int batch, long long count, int n, int p, float shift) {
    cudaCheck(cudaMemsetAsync(sums, 0, batch * sizeof(double), g_stream));
    dim3 grid(grid_for(count, 256 * 8, 512), batch);
    sumsq_kernel<<<grid, 256, 0, g_stream>>>(M, sums, T, count, n, p, shift);
    launchCheck();
}

// Coupled Newton start: M = z A in place, X = I and x0[b] = z^(1/p) (version 1 carries X / x0: see v1_iterate),
// z = (p + 1) / (2 ||A||_F) from sums[b] = ||A||_F^2.
__global__ void newton_init_kernel(float* M, float* X, float* x0, const double* sums, int n, int p, long long total) {
    long long nn = (long long)n * n;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long b = idx / nn, e = idx % nn;
        double z = (p + 1) / (2.0 * sqrt(sums[b]));
        M[idx] = (float)z * M[idx];
        X[idx] = e / n == e % n ? 1.0f : 0.0f;
        if (e == 0) x0[b] = (float)pow(z, 1.0 / p);
    }
}

// the bits of cvt.rna.tf32.f32 (10 mantissa bits, ties away from zero), as round_prec's PREC_TF32 on the host
__host__ __device__ __forceinline__ float tf32_rna(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x1000u) & ~0x1FFFu;
    memcpy(&x, &u, 4);
    return x;
}

// 3xTF32 operands of C = A B (n x n each): A3 = [A_hi | A_hi | A_lo] (n x 3n), B3 = [B_hi; B_lo; B_hi] (3n x n),
// so that one TF32 GEMM with K = 3n sums A_hi B_hi + A_hi B_lo + A_lo B_hi. hi = TF32 rounding, lo = TF32 rounding
// of the remainder (exact in fp32): both convert to TF32 exactly, whatever rounding cuBLAS applies.
__global__ void split3_kernel(const float* A, const float* B, float* A3, float* B3, int n, long long total) {
    long long nn = (long long)n * n;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long b = idx / nn, e = idx % nn, i = e / n, j = e % n;
        float a = A[idx], ah = tf32_rna(a), al = tf32_rna(a - ah);
        float* a3 = A3 + b * 3 * nn + i * 3 * n;
        a3[j] = ah;
        a3[n + j] = ah;
        a3[2 * n + j] = al;
        float v = B[idx], bh = tf32_rna(v), bl = tf32_rna(v - bh);
        float* b3 = B3 + b * 3 * nn;
        b3[i * n + j] = bh;
        b3[(n + i) * n + j] = bl;
        b3[(2 * n + i) * n + j] = bh;
    }
}

// hi = TF32 rounding of x, lo = TF32 rounding of the remainder, for the 3xTF32 products of operands split once
__global__ void split_kernel(const float* A, float* hi, float* lo, long long total) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        float a = A[idx], h = tf32_rna(a);
        hi[idx] = h;
        lo[idx] = tf32_rna(a - h);
    }
}

// The fp16 form of split3_kernel (V1_F16): hi = fp16(x), lo = fp16((x - hi) 2^11), A3 = [A_hi | A_hi | A_lo],
// B3 = [2^11 B_hi; B_lo; B_hi], so that 2^-11 A3 B3 = A_hi B_hi + 2^-11 (A_hi B_lo + A_lo B_hi) in one K = 3n GEMM.
// Both parts keep 11 bits, as TF32's do; the remainder is scaled by 2^11 to stay in fp16's normal range. B is a power
// of T or M (entries below ~7 while the iteration converges), so 2^11 B_hi stays finite; a diverging B overflows to
// inf, which the residual check sees. Rows by blockIdx.y (batch * n of them), no division per element.
constexpr float F16_LO_SCALE = 2048.0f;
// x's parts: hi, and the remainder times 2^11 (x = hi + lo 2^-11 up to fp16's rounding of lo); the host tests it
__host__ __device__ inline void f16_parts(float x, __half& hi, __half& lo) {
    hi = __float2half_rn(x);
    lo = __float2half_rn((x - __half2float(hi)) * F16_LO_SCALE);
}

__global__ void split3_f16_kernel(const float* A, const float* B, __half* A3, __half* B3, int n, long long rows) {
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        long long b = row / n, i = row - b * n, nn = (long long)n * n;
        const float *a = A + row * n, *v = B + row * n;
        __half* a3 = A3 + b * 3 * nn + i * 3 * n;
        __half* b3 = B3 + b * 3 * nn + i * n;
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
            __half hi, lo;
            f16_parts(a[j], hi, lo);
            a3[j] = hi;
            a3[n + j] = hi;
            a3[2 * n + j] = lo;
            f16_parts(v[j], hi, lo);
            b3[j] = __float2half_rn(__half2float(hi) * F16_LO_SCALE);  // exact unless it overflows
            b3[nn + j] = lo;
            b3[2 * nn + j] = hi;
        }
    }
}

// a grid over rows (y) and columns (x) of `rows` rows of n
static dim3 row_grid(long long rows, int n, int threads) {
    return dim3((unsigned)ceil_div_ll(n, threads), (unsigned)std::min(rows, 65535LL));
}

// cuBLASLt plans of version 1's TF32 GEMMs, one per shape (sizes, strides, batch, beta = 0 or 1, alignment): the
// algorithm is the fastest of cuBLAS's default and the candidates of cuBLASLt's heuristic (with split-K variants of
// those that allow it), each timed once on the first call of the shape. MATRIX_ROOTS_LT_VERBOSE=1 prints the timings.
constexpr size_t LT_WORKSPACE = 32ull << 20;
constexpr int LT_HEURISTICS = 12;
struct LtPlan {
    int n, K, lda, ldb, batch;
    long long sa, sb;
    bool accumulate;
    uint32_t align;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo = {};
    bool use_lt = false;  // false: cuBLAS's default algorithm was the fastest (or cuBLASLt had none)
};
static std::vector<LtPlan> g_lt_plans;

static void lt_free() {
    for (LtPlan& pl : g_lt_plans) {
        cublasCheck(cublasLtMatrixLayoutDestroy(pl.la));
        cublasCheck(cublasLtMatrixLayoutDestroy(pl.lb));
        cublasCheck(cublasLtMatrixLayoutDestroy(pl.lc));
        cublasCheck(cublasLtMatmulDescDestroy(pl.desc));
    }
    g_lt_plans.clear();
}

// an integer attribute of a cuBLASLt algorithm's configuration, -1 where cuBLASLt does not give it
static int lt_config(const cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
    int32_t v = -1;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &v, sizeof v, &written) != CUBLAS_STATUS_SUCCESS) return -1;
    return v;
}

static cublasLtMatrixLayout_t lt_layout(int rows, int cols, long long ld, int batch, long long stride) {
    cublasLtMatrixLayout_t l;
    cublasCheck(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, rows, cols, ld));
    if (batch > 1) {
        cublasCheck(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
        cublasCheck(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                     sizeof stride));
    }
    return l;
}

// the largest power of two <= 256 that divides the pointer and (batches) the stride in bytes
static uint32_t lt_align(const void* ptr, long long stride, int batch) {
    uint32_t a = 256;
    while (a > 4 && ((uintptr_t)ptr % a || (batch > 1 && stride * (long long)sizeof(float) % a))) a /= 2;
    return a;
}

static void cublas_tf32_gemm(const float* A, int lda, long long sa, const float* B, int ldb, long long sb, float* C,
                             int n, int K, int batch, float beta) {
    const float one = 1.0f;
    cublasCheck(cublasGemmStridedBatchedEx(g_gpu.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, K, &one, B, CUDA_R_32F, ldb, sb,
                                           A, CUDA_R_32F, lda, sa, &beta, C, CUDA_R_32F, n, (long long)n * n, batch,
                                           CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
}

// Times cuBLAS's default and every cuBLASLt candidate on the operands, into a scratch output, and keeps the fastest
static void lt_tune(LtPlan& pl, const float* A, const float* B) {
    const float one = 1.0f, beta = pl.accumulate ? 1.0f : 0.0f;
    long long nn = (long long)pl.n * pl.n;
    float* scratch = (float*)ws_get(WS_LT_SCRATCH, nn * pl.batch * sizeof(float));
    void* work = ws_get(WS_LT_WORK, LT_WORKSPACE);
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws_bytes = LT_WORKSPACE;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                     sizeof ws_bytes));
    for (cublasLtMatmulPreferenceAttributes_t at :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, at, &pl.align, sizeof pl.align));
    cublasLtMatmulHeuristicResult_t res[LT_HEURISTICS];
    int got = 0;
    if (cublasLtMatmulAlgoGetHeuristic(g_gpu.lt, pl.desc, pl.la, pl.lb, pl.lc, pl.lc, pref, LT_HEURISTICS, res, &got) !=
        CUBLAS_STATUS_SUCCESS)
        got = 0;
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    std::vector<cublasLtMatmulAlgo_t> cands;
    std::vector<int> splits;
    for (int i = 0; i < got; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        int32_t splitk = std::max(1, lt_config(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)), can_split = 0;
        uint32_t schemes = 0;
        size_t sz = 0;
        cands.push_back(res[i].algo);
        splits.push_back(splitk);
        // 1024^2 outputs are 32 to 64 tiles for 132 SMs: split-K variants of the heuristic's unsplit candidates
        if (splitk > 1 ||
            cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &can_split,
                                              sizeof can_split, &sz) != CUBLAS_STATUS_SUCCESS || !can_split ||
            cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &schemes,
                                              sizeof schemes, &sz) != CUBLAS_STATUS_SUCCESS)
            continue;
        uint32_t scheme = schemes & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                          : schemes & CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE ? CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE
                          : schemes & CUBLASLT_REDUCTION_SCHEME_INPLACE     ? CUBLASLT_REDUCTION_SCHEME_INPLACE
                                                                            : 0u;
        if (!scheme) continue;
        for (int32_t k : {2, 3, 4, 8}) {
            cublasLtMatmulAlgo_t a = res[i].algo;
            cublasLtMatmulHeuristicResult_t check;
            if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &k, sizeof k) !=
                    CUBLAS_STATUS_SUCCESS ||
                cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                     sizeof scheme) != CUBLAS_STATUS_SUCCESS ||
                cublasLtMatmulAlgoCheck(g_gpu.lt, pl.desc, pl.la, pl.lb, pl.lc, pl.lc, &a, &check) !=
                    CUBLAS_STATUS_SUCCESS ||
                check.workspaceSize > LT_WORKSPACE)
                continue;
            cands.push_back(a);
            splits.push_back(k);
        }
    }
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    // candidate -1: cuBLAS's default; a candidate that cuBLASLt refuses to run is left out
    auto run = [&](int c) {
        if (c < 0) {
            cublas_tf32_gemm(A, pl.lda, pl.sa, B, pl.ldb, pl.sb, scratch, pl.n, pl.K, pl.batch, beta);
            return true;
        }
        return cublasLtMatmul(g_gpu.lt, pl.desc, &one, B, pl.la, A, pl.lb, &beta, scratch, pl.lc, scratch, pl.lc,
                              &cands[c], work, LT_WORKSPACE, g_stream) == CUBLAS_STATUS_SUCCESS;
    };
    bool verbose = getenv("MATRIX_ROOTS_LT_VERBOSE") != nullptr;
    double best = INFINITY, cublas_ms = 0.0;
    int best_c = -1;
    for (int c = -1; c < (int)cands.size(); c++) {
        if (!run(c)) continue;
        const int reps = 5;
        cudaCheck(cudaEventRecord(e0, g_stream));
        for (int r = 0; r < reps; r++) run(c);
        cudaCheck(cudaEventRecord(e1, g_stream));
        cudaCheck(cudaEventSynchronize(e1));
        float ms = 0.0f;
        cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        double t = ms / reps;
        if (c < 0) cublas_ms = t;
        if (verbose) {
            int id = c < 0 ? -1 : lt_config(&cands[c], CUBLASLT_ALGO_CONFIG_ID);
            int tile = c < 0 ? -1 : lt_config(&cands[c], CUBLASLT_ALGO_CONFIG_TILE_ID);
            printf("    lt tune n=%d K=%d batch=%d beta=%d: %s algo %d tile %d split-K %d: %.4f ms\n", pl.n, pl.K,
                   pl.batch, pl.accumulate ? 1 : 0, c < 0 ? "cublas default" : "cublasLt", id, tile,
                   c < 0 ? 0 : splits[c], t);
        }
        if (t < best) { best = t; best_c = c; }
    }
    cudaCheck(cudaGetLastError());
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    pl.use_lt = best_c >= 0;
    if (pl.use_lt) pl.algo = cands[best_c];
    if (verbose)
        printf("    lt tune n=%d K=%d batch=%d beta=%d: %zu candidates, kept %s (%.4f ms; cublas default %.4f ms)\n",
               pl.n, pl.K, pl.batch, pl.accumulate ? 1 : 0, cands.size(), pl.use_lt ? "cublasLt" : "cublas default",
               best, cublas_ms);
}

// C = A B + beta C (beta 0 or 1) with TF32 tensor cores and fp32 accumulation; row-major A n x K (row stride lda),
// B K x n (row stride ldb), C n x n; batch strides sa, sb and n^2. lt: the algorithm timed for the shape (LtPlan).
static void tf32_gemm(const float* A, int lda, long long sa, const float* B, int ldb, long long sb, float* C, int n,
                      int K, int batch, float beta, bool lt) {
    if (!lt) { cublas_tf32_gemm(A, lda, sa, B, ldb, sb, C, n, K, batch, beta); return; }
    long long nn = (long long)n * n;
    uint32_t align = std::min(lt_align(A, sa, batch), std::min(lt_align(B, sb, batch), lt_align(C, nn, batch)));
    bool acc = beta != 0.0f;
    LtPlan* pl = nullptr;
    for (LtPlan& q : g_lt_plans)
        if (q.n == n && q.K == K && q.lda == lda && q.ldb == ldb && q.batch == batch && q.sa == sa && q.sb == sb &&
            q.accumulate == acc && q.align == align)
            pl = &q;
    if (!pl) {
        LtPlan q{n, K, lda, ldb, batch, sa, sb, acc, align};
        cublasCheck(cublasLtMatmulDescCreate(&q.desc, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F));
        // row-major C = A B is column-major C^T = B^T A^T: cuBLASLt's A is our B (n x K, column-major), its B our A
        q.la = lt_layout(n, K, ldb, batch, sb);
        q.lb = lt_layout(K, n, lda, batch, sa);
        q.lc = lt_layout(n, n, n, batch, nn);
        lt_tune(q, A, B);
        g_lt_plans.push_back(q);
        pl = &g_lt_plans.back();
    }
    if (!pl->use_lt) { cublas_tf32_gemm(A, lda, sa, B, ldb, sb, C, n, K, batch, beta); return; }
    const float one = 1.0f;
    cublasCheck(cublasLtMatmul(g_gpu.lt, pl->desc, &one, B, pl->la, A, pl->lb, &beta, C, pl->lc, C, pl->lc, &pl->algo,
                               ws_get(WS_LT_WORK, LT_WORKSPACE), LT_WORKSPACE, g_stream));
}

// C = A B for a batch of row-major n x n matrices, strict fp32 or 3xTF32 (C must not alias A or B). Row-major C = A B
// is column-major C^T = B^T A^T: cuBLAS gets the operands swapped. 3xTF32 here splits both operands into
// concatenated copies (split3_kernel) for one K = 3n GEMM; lt: through tf32_gemm's timed algorithm.
static void gemm_nn(const float* A, const float* B, float* C, int n, int batch, Prec prec, bool lt = false) {
    long long nn = (long long)n * n;
    const float one = 1.0f, zero = 0.0f;
    if (prec == PREC_FP32) {
        cublasCheck(cublasGemmStridedBatchedEx(g_gpu.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, B, CUDA_R_32F, n,
                                               nn, A, CUDA_R_32F, n, nn, &zero, C, CUDA_R_32F, n, nn, batch,
                                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return;
    }
    if (prec != PREC_3XTF32) { fprintf(stderr, "gemm_nn: precision %s not supported\n", prec_name(prec)); exit(1); }
    float* A3 = (float*)ws_get(WS_A3, 3 * nn * batch * sizeof(float));
    float* B3 = (float*)ws_get(WS_B3, 3 * nn * batch * sizeof(float));
    split3_kernel<<<grid_for(nn * batch, 256), 256, 0, g_stream>>>(A, B, A3, B3, n, nn * batch);
    launchCheck();
    tf32_gemm(A3, 3 * n, 3 * nn, B3, n, 3 * nn, C, n, 3 * n, batch, 0.0f, lt);
}

// C = A B for a batch of row-major n x n matrices from fp16 parts (V1_F16; split3_f16_kernel), accumulated in fp32
static void gemm_f16x3(const float* A, const float* B, float* C, int n, int batch) {
    long long nn = (long long)n * n;
    __half* A3 = (__half*)ws_get(WS_A3, 3 * nn * batch * sizeof(__half));
    __half* B3 = (__half*)ws_get(WS_B3, 3 * nn * batch * sizeof(__half));
    long long rows = (long long)n * batch;
    split3_f16_kernel<<<row_grid(rows, n, 256), 256, 0, g_stream>>>(A, B, A3, B3, n, rows);
    launchCheck();
    const float down = 1.0f / F16_LO_SCALE, zero = 0.0f;
    cublasCheck(cublasGemmStridedBatchedEx(g_gpu.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, 3 * n, &down, B3, CUDA_R_16F, n,
                                           3 * nn, A3, CUDA_R_16F, 3 * n, 3 * nn, &zero, C, CUDA_R_32F, n, nn, batch,
                                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// C = A B in 3xTF32 from operands split once (their hi and lo parts): the two small terms, then the big one added
// (three K = n GEMMs, fp32 results accumulated through beta = 1)
static void gemm_split(const float* Ah, const float* Al, const float* Bh, const float* Bl, float* C, int n, int batch,
                       bool lt) {
    long long nn = (long long)n * n;
    tf32_gemm(Ah, n, nn, Bl, n, nn, C, n, n, batch, 0.0f, lt);
    tf32_gemm(Al, n, nn, Bh, n, nn, C, n, n, batch, 1.0f, lt);
    tf32_gemm(Ah, n, nn, Bh, n, nn, C, n, n, batch, 1.0f, lt);
}

// Version 1's lower-triangle products (V1_LOWER). Block t of a lower triangle of blocks (row-major order: (0, 0),
// (1, 0), (1, 1), (2, 0), ...) is (I, J) with I (I + 1) / 2 <= t < (I + 1) (I + 2) / 2, J = t - I (I + 1) / 2.
__host__ __device__ inline void lower_block_coords(int t, int* I, int* J) {
    int i = (int)((sqrt(8.0 * t + 1.0) - 1.0) / 2.0);
    while (i * (i + 1) / 2 > t) i--;  // the square root's rounding, either way
    while ((i + 1) * (i + 2) / 2 <= t) i++;
    *I = i;
    *J = t - i * (i + 1) / 2;
}

// Entry e of the batched GEMM: matrix e / tri, lower block (I, J) of C = A3 B3 with A3 N x 3N and B3 3N x N (row-major,
// per matrix) and C N x N (row stride N). Row-major C = A B is column-major C^T = B^T A^T: cuBLAS's A is B3's column
// block J (bs x 3N, ld N), its B is A3's row block I (3N x bs, ld 3N), its C block (I, J) of C (bs x bs, ld N).
__host__ __device__ inline void lower_block_ptrs(int e, int tri, int N, int bs, const float* A3, const float* B3,
                                                 float* C, const float** pa, const float** pb, float** pc) {
    long long m = e / tri, NN = (long long)N * N;
    int I, J;
    lower_block_coords(e % tri, &I, &J);
    *pa = B3 + m * 3 * NN + (long long)J * bs;
    *pb = A3 + m * 3 * NN + (long long)I * bs * 3 * N;
    *pc = C + m * NN + (long long)I * bs * N + (long long)J * bs;
}

// split3_kernel's operands padded with zeros to N x N (N: n rounded up to the block size; A3 = [A_hi | A_hi | A_lo]
// N x 3N, B3 = [B_hi; B_lo; B_hi] 3N x N): the padding must be zero, not only unused (padded K columns of A3 meet
// padded rows of B3). The first threads also write the batched GEMM's pointer arrays (entries = batch x tri),
// which depend on C: writing them here costs no launch and no host copy.
__host__ __device__ inline void split3_lower_element(long long idx, const float* A, const float* B, float* A3,
                                                     float* B3, int n, int N) {
    long long nn = (long long)n * n, NN = (long long)N * N;
    long long b = idx / NN, e = idx % NN, i = e / N, j = e % N;
    bool in = i < n && j < n;
    float a = in ? A[b * nn + i * n + j] : 0.0f, ah = tf32_rna(a), al = tf32_rna(a - ah);
    float* a3 = A3 + b * 3 * NN + i * 3 * N;
    a3[j] = ah;
    a3[N + j] = ah;
    a3[2 * N + j] = al;
    float v = in ? B[b * nn + i * n + j] : 0.0f, bh = tf32_rna(v), bl = tf32_rna(v - bh);
    float* b3 = B3 + b * 3 * NN;
    b3[i * N + j] = bh;
    b3[(N + i) * N + j] = bl;
    b3[(2 * N + i) * N + j] = bh;
}
__global__ void split3_lower_kernel(const float* A, const float* B, float* A3, float* B3, int n, int N,
                                    long long total, int bs, int tri, int entries, float* C, const float** pa,
                                    const float** pb, float** pc) {
    long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    for (long long e = first; e < entries; e += stride)
        lower_block_ptrs((int)e, tri, N, bs, A3, B3, C, pa + e, pb + e, pc + e);
    for (long long idx = first; idx < total; idx += stride) split3_lower_element(idx, A, B, A3, B3, n, N);
}

// dst[i][j] = src[max(i, j)][min(i, j)] for i, j < n (dst n x n, src row stride lds; blockIdx.z the matrix): the
// lower triangle mirrored. In place (src == dst, lds == n) only the strict upper triangle is written. A 32 x 32
// tile of dst per block (32 x 8 threads), its source tile read by rows into shared memory (coalesced both ways).
constexpr int MIRROR_TILE = 32;
__global__ void mirror_tiles_kernel(const float* src, int lds, float* dst, int n) {
    __shared__ float s[MIRROR_TILE][MIRROR_TILE + 1];
    int ti = blockIdx.y, tj = blockIdx.x;  // dst tile row, column
    bool in_place = src == dst;
    src += blockIdx.z * (long long)lds * lds;
    dst += blockIdx.z * (long long)n * n;
    int x = threadIdx.x;
    if (ti > tj) {  // a lower tile: a copy (nothing to do in place)
        if (in_place) return;
        for (int y = threadIdx.y; y < MIRROR_TILE; y += blockDim.y) {
            int i = ti * MIRROR_TILE + y, j = tj * MIRROR_TILE + x;
            if (i < n && j < n) dst[(long long)i * n + j] = src[(long long)i * lds + j];
        }
        return;
    }
    // source tile: rows of tile tj, columns of tile ti (the diagonal tile itself when ti == tj)
    for (int y = threadIdx.y; y < MIRROR_TILE; y += blockDim.y) {
        int r = tj * MIRROR_TILE + y, c = ti * MIRROR_TILE + x;
        if (r < n && c < n) s[y][x] = src[(long long)r * lds + c];
    }
    __syncthreads();
    for (int y = threadIdx.y; y < MIRROR_TILE; y += blockDim.y) {
        int i = ti * MIRROR_TILE + y, j = tj * MIRROR_TILE + x;
        if (i >= n || j >= n) continue;
        // dst (i, j) above the diagonal is src (j, i) = s[x][y]; on or below it (diagonal tiles only) src (i, j)
        if (ti < tj || x > y) dst[(long long)i * n + j] = s[x][y];
        else if (!in_place) dst[(long long)i * n + j] = s[y][x];
    }
}

// C = A B in 3xTF32 (concatenated operands, one accumulator: gemm_nn's arithmetic) for products that are symmetric in
// exact arithmetic: only the lower blocks of a bs x bs blocking, in one batched GEMM (K = 3N), then mirrored into C.
// n not a multiple of bs: the blocks go to a padded scratch (N x N), and the mirror pass copies and unpads.
static void gemm_lower(const float* A, const float* B, float* C, int n, int batch, int bs) {
    int nb = (int)ceil_div_ll(n, bs), N = nb * bs, tri = nb * (nb + 1) / 2, entries = batch * tri;
    long long NN = (long long)N * N, total = NN * batch;
    float* A3 = (float*)ws_get(WS_A3, 3 * total * sizeof(float));
    float* B3 = (float*)ws_get(WS_B3, 3 * total * sizeof(float));
    float* Cp = N == n ? C : (float*)ws_get(WS_LOWER_C, total * sizeof(float));
    void** ptrs = (void**)ws_get(WS_LOWER_PTRS, 3 * (size_t)entries * sizeof(void*));
    const float** pa = (const float**)ptrs;
    const float** pb = pa + entries;
    float** pc = (float**)(ptrs + 2 * (size_t)entries);
    split3_lower_kernel<<<grid_for(total, 256), 256, 0, g_stream>>>(A, B, A3, B3, n, N, total, bs, tri, entries, Cp,
                                                                    pa, pb, pc);
    launchCheck();
    const float one = 1.0f, zero = 0.0f;
    cublasCheck(cublasGemmBatchedEx(g_gpu.blas, CUBLAS_OP_N, CUBLAS_OP_N, bs, bs, 3 * N, &one, (const void**)pa,
                                    CUDA_R_32F, N, (const void**)pb, CUDA_R_32F, 3 * N, &zero, (void**)pc, CUDA_R_32F,
                                    N, entries, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
    int tiles = (int)ceil_div_ll(n, MIRROR_TILE);
    mirror_tiles_kernel<<<dim3(tiles, tiles, batch), dim3(MIRROR_TILE, 8), 0, g_stream>>>(Cp, N, C, n);
    launchCheck();
}

// ----------------------------------------------------------------------------------------------------------------
// version 0: cuSOLVER eigendecomposition, X = V diag(max(lambda, eps)^(-1/p)) V^T

__device__ __forceinline__ float inv_root_f(float lambda, int p) {
    float s = p == 1 ? lambda : p == 2 ? sqrtf(lambda) : sqrtf(sqrtf(lambda));  // IEEE sqrt and division
    return 1.0f / s;
}

// W[b][j][:] = f(lambda_b[j]) V[b][j][:]: row j of the row-major view of cuSOLVER's column-major V is eigenvector j
__global__ void eig_scale_kernel(const float* V, const float* lambda, float* W, int n, int p, float eps,
                                 long long total) {
    long long nn = (long long)n * n;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long b = idx / nn, j = idx % nn / n;
        W[idx] = inv_root_f(fmaxf(lambda[b * n + j], eps), p) * V[idx];
    }
}

// Returns the number of matrices cuSOLVER reported as not converged (info != 0); X is then unusable for those.
static int inv_root_v0(const float* A, float* X, int batch, int n, int p, float eps) {
    check_root_args("inv_root_v0", A, X, batch, n, p, eps);
    long long nn = (long long)n * n, total = nn * batch;
    float* V = (float*)ws_get(WS_M, total * sizeof(float));
    float* W = (float*)ws_get(WS_W, total * sizeof(float));
    float* lambda = (float*)ws_get(WS_LAMBDA, (size_t)batch * n * sizeof(float));
    int* info = (int*)ws_get(WS_INFO, batch * sizeof(int));
    add_eps_kernel<<<grid_for(total, 256), 256, 0, g_stream>>>(A, V, n, total, eps);
    launchCheck();
    if (n <= 32 && batch > 1) {  // Jacobi, all matrices in one call (cuSOLVER's batched path is for n <= 32)
        int lwork = 0;
        cusolverCheck(cusolverDnSsyevjBatched_bufferSize(g_gpu.solver, CUSOLVER_EIG_MODE_VECTOR,
                                                         CUBLAS_FILL_MODE_LOWER, n, V, n, lambda, &lwork, g_gpu.syevj,
                                                         batch));
        float* work = (float*)ws_get(WS_WORK, std::max(1, lwork) * sizeof(float));
        cusolverCheck(cusolverDnSsyevjBatched(g_gpu.solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, V, n,
                                              lambda, work, lwork, info, g_gpu.syevj, batch));
    } else {  // divide and conquer, one matrix after the other
        int lwork = 0;
        cusolverCheck(cusolverDnSsyevd_bufferSize(g_gpu.solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, V,
                                                  n, lambda, &lwork));
        float* work = (float*)ws_get(WS_WORK, std::max(1, lwork) * sizeof(float));
        for (int b = 0; b < batch; b++)
            cusolverCheck(cusolverDnSsyevd(g_gpu.solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n,
                                           V + b * nn, n, lambda + (long long)b * n, work, lwork, info + b));
    }
    eig_scale_kernel<<<grid_for(total, 256), 256, 0, g_stream>>>(V, lambda, W, n, p, eps, total);
    launchCheck();
    // row-major X = V^T W (the sum over j of f_j v_j v_j^T): column-major X^T = W^T V, i.e. op(W) = N, op(V) = T
    const float one = 1.0f, zero = 0.0f;
    cublasCheck(cublasGemmStridedBatchedEx(g_gpu.blas, CUBLAS_OP_N, CUBLAS_OP_T, n, n, n, &one, W, CUDA_R_32F, n, nn,
                                           V, CUDA_R_32F, n, nn, &zero, X, CUDA_R_32F, n, nn, batch,
                                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    std::vector<int> h(batch);
    copy_to_host(h.data(), info, batch * sizeof(int));
    return (int)std::count_if(h.begin(), h.end(), [](int v) { return v != 0; });
}

// ----------------------------------------------------------------------------------------------------------------
// version 1: the coupled Newton iteration on cuBLAS, strict fp32 or 3xTF32 products; every matrix of a batch takes
// the same steps (until the largest ||M - I||_F is small). One host decision per step: a copy of batch residuals.
// One matrix (batch 1, g_v1.scaled) takes scaled steps from a Lanczos start as versions 2 and 3 do (z and lo from
// lanczos_newton_start, newton_first_cap on the first step), X0 = z^(1/p) I, M0 = z (A + eps I),
// T = a^(1/p) ((p + 1) I - a M) / p; unlike them its a also uses the step's r (scale.alpha(p, r)): T is written by a
// pass of its own after r is known. A batch, and a scaled run that fails or ends unconverged, take the unscaled steps
// from z = (p + 1) / (2 ||A||_F).

struct V1Info {
    bool scaled = false, fell_back = false;
    LanczosStart start;
    double start_ms = 0.0;
    int delta_steps = 0;
};
static V1Info g_v1_info;  // what the last inv_root_v1 call did (--test and --bench print it)

constexpr int LANCZOS_THREADS = 256;

// LANCZOS_STEPS steps (at most n) on A + eps I of one n x n matrix in one cooperative launch (lanczos_grid_cpu is its
// twin): a warp per row of w = (A + eps I) q - beta_prev q_prev, written to W (a row per step), and the sums q.w, w.w,
// q.q in slots of their own (out[3 j ..], zeroed before); one grid barrier; then every block forms the whole next q in
// its shared memory from W and its own q. All blocks read the same sums, so they take the same coefficients and stop
// at the same step. Each block normalises its own copy of q1 (two block barriers, once). Out: alpha_j at
// out[3 k + j], beta_j at out[4 k + j], the step count at out[5 k]; the first pass also leaves the largest absolute
// row sum of A + eps I at out[5 k + 1] (zeroed before; atomicMax on the bits: non-negative doubles order as integers).
__global__ void lanczos_kernel(const float* A, int n, float eps, int k, float* W, double* out) {
    extern __shared__ float lz_shared[];  // q and the previous q, n floats each
    __shared__ double partial[3][LANCZOS_THREADS / 32];
    cg::grid_group grid = cg::this_grid();
    float *q = lz_shared, *qp = lz_shared + n;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    double qq1 = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float u = lanczos_start(i);
        qq1 += (double)u * u;
        qp[i] = 0.0f;
    }
    for (int o = 16; o > 0; o >>= 1) qq1 += __shfl_xor_sync(0xffffffffu, qq1, o);
    if (lane == 0) partial[0][warp] = qq1;
    __syncthreads();
    qq1 = 0.0;
    for (int i = 0; i < warps; i++) qq1 += partial[0][i];
    float inv = (float)(1.0 / sqrt(qq1));  // the recurrence's beta_1 needs a unit q1
    for (int i = threadIdx.x; i < n; i += blockDim.x) q[i] = lanczos_start(i) * inv;
    __syncthreads();  // publishes q; partial is written again only after it
    double beta_prev = 0.0;
    for (int j = 0; j < k; j++) {
        double qw = 0.0, ww = 0.0, qq = 0.0;  // lane 0's rows
        for (int row = blockIdx.x * warps + warp; row < n; row += gridDim.x * warps) {
            const float* a = A + (size_t)row * n;
            float s = 0.0f, g = 0.0f;
            if (j == 0) {  // and the row's absolute sum, for newton_first_cap
#pragma unroll 8
                for (int c = lane; c < n; c += 32) {
                    s += a[c] * q[c];
                    g += fabsf(a[c]);
                }
                for (int o = 16; o > 0; o >>= 1) g += __shfl_xor_sync(0xffffffffu, g, o);
                if (lane == 0)
                    atomicMax((unsigned long long*)&out[5 * k + 1], (unsigned long long)__double_as_longlong(g + eps));
            } else {
#pragma unroll 8
                for (int c = lane; c < n; c += 32) s += a[c] * q[c];
            }
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            float w = s + eps * q[row] - (float)beta_prev * qp[row];
            if (lane == 0) {
                W[(size_t)j * n + row] = w;
                qw += (double)q[row] * w;
                ww += (double)w * w;
                qq += (double)q[row] * q[row];
            }
        }
        if (lane == 0) {
            partial[0][warp] = qw;
            partial[1][warp] = ww;
            partial[2][warp] = qq;
        }
        __syncthreads();
        if (threadIdx.x < 3) {
            double t = 0.0;
            for (int i = 0; i < warps; i++) t += partial[threadIdx.x][i];
            atomicAdd(&out[3 * j + threadIdx.x], t);
        }
        grid.sync();
        double alpha, beta;  // __ldcg: written by other SMs' atomics, past this SM's L1
        bool more = lanczos_coeffs(__ldcg(&out[3 * j]), __ldcg(&out[3 * j + 1]), __ldcg(&out[3 * j + 2]), &alpha,
                                   &beta);
        bool last = !more || j == k - 1;
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            out[3 * k + j] = alpha;
            out[4 * k + j] = beta;
            if (last) out[5 * k] = j + 1;
        }
        if (last) return;
        // the next q into the previous q's place (that one was read above, for this block's rows only)
        float fa = (float)alpha, fb = (float)(1.0 / beta);
        for (int i = threadIdx.x; i < n; i += blockDim.x) qp[i] = (__ldcg(&W[(size_t)j * n + i]) - fa * q[i]) * fb;
        __syncthreads();
        float* t = q;
        q = qp;
        qp = t;
        beta_prev = beta;
    }
}

// A block's step flag, stored with release semantics (its W rows and sums before it, by the warp's __syncwarp and
// the release's cumulativity) and polled with acquire semantics, at GPU scope
__device__ __forceinline__ void flag_store_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned flag_load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// lanczos_tile_kernel's warp 0 after step j's products (lane = row; qr, qpr: q and the previous q at the row, 0 past
// n): the row of w from the slices' partials P, into W; the block's three sums into part; then step j's barrier:
// publish this block's W rows and sums, wait for every block's (lane l polls block l's flag)
__device__ void lzt_rows_and_barrier(const float (*P)[32], float qr, float qpr, int row, int n, float eps,
                                     double beta_prev, int j, float* W, double* part, unsigned* flags) {
    const int lane = threadIdx.x % 32, G = gridDim.x;
    float v[32];
#pragma unroll
    for (int s = 0; s < 32; s++) v[s] = P[s][lane];
    float y = lzt_slice_tree(v);
    float w = row < n ? fmaf(-(float)beta_prev, qpr, fmaf(eps, qr, y)) : 0.0f;
    if (row < n) W[(size_t)j * n + row] = w;
    double s0 = warp_sum_d((double)qr * w), s1 = warp_sum_d((double)w * w), s2 = warp_sum_d((double)qr * qr);
    double* pb = part + ((size_t)j * G + blockIdx.x) * 3;
    if (lane == 0) {
        pb[0] = s0;
        pb[1] = s1;
        pb[2] = s2;
    }
    __syncwarp();
    if (lane == 0) flag_store_release(flags + blockIdx.x, j + 1);
    if (lane < G)
        while (flag_load_acquire(flags + lane) < (unsigned)(j + 1)) {
        }
    __syncwarp();
}
// lanczos_tile_kernel's warp 0 once every block's step-j sums are in part: their sum by the xor tree (lane l: block
// l; __ldcg, other SMs wrote them past L1), the coefficients into coef (alpha, beta, stop) and coef_f, and block 0
// writes out (after step 0 also the largest row sum: every block wrote its slot before the first barrier)
__device__ void lzt_coefficients(const double* part, int j, int k, double* coef, float* coef_f, double* out) {
    const int lane = threadIdx.x % 32, G = gridDim.x;
    double s0 = 0.0, s1 = 0.0, s2 = 0.0;
    if (lane < G) {
        const double* pl = part + ((size_t)j * G + lane) * 3;
        s0 = __ldcg(pl);
        s1 = __ldcg(pl + 1);
        s2 = __ldcg(pl + 2);
    }
    double alpha, beta;
    bool more = lanczos_coeffs(warp_sum_d(s0), warp_sum_d(s1), warp_sum_d(s2), &alpha, &beta);
    bool last = !more || j == k - 1;
    if (lane != 0) return;
    coef[0] = alpha;
    coef[1] = beta;
    coef[2] = last ? 1.0 : 0.0;
    coef_f[0] = (float)alpha;
    coef_f[1] = (float)(1.0 / beta);
    if (blockIdx.x != 0) return;
    out[3 * k + j] = alpha;
    out[4 * k + j] = beta;
    if (last) out[5 * k] = j + 1;
    if (j == 0) {
        double m = 0.0;
        for (int b = 0; b < G; b++) m = fmax(m, __ldcg(part + (size_t)3 * k * G + b));
        out[5 * k + 1] = m;
    }
}

// Version 1's Lanczos for n <= LZT_COLS (lanczos_tile_cpu is its twin, bit for bit): ceil(n / 32) blocks of 1024
// threads in one cooperative launch, 32 rows of A + eps I per block held in registers (lane = row, warp = 32 columns;
// loaded once). lanczos_kernel's 128 blocks paid ~19 us a step at n = 1024 (a grid barrier and float64 atomics to
// three adjacent slots from every block). Here each block writes its q.w, w.w, q.q to slots of its own and then its
// step flag; its warp 0 waits for every block's flag (lane l: block l), reads the blocks' sums and adds them by the
// same xor tree: every block takes the same coefficients, with the same bits on every run. One grid barrier in all
// (after each block zeroed its flag; the cooperative launch keeps every block resident for the waits). A step: the
// slices' partials (q broadcast from shared memory); warp 0 adds them, writes w's rows to W and the sums to part,
// flags and waits; every block reads W into its next q. Out as lanczos_kernel's; part: step j's sums of block b at
// 3 (j G + b), then each block's largest row sum; flags: one per block.
__global__ void __launch_bounds__(LZT_THREADS, 1)
lanczos_tile_kernel(const float* A, int n, float eps, int k, float* W, double* part, unsigned* flags, double* out) {
    __shared__ __align__(16) float qa[LZT_COLS], qb[LZT_COLS];
    __shared__ float P[32][32];  // [slice][row]: a slice's partial of each row
    __shared__ double coef[3];   // alpha, beta, stop
    __shared__ float coef_f[2];  // (float) alpha, (float) (1 / beta)
    cg::grid_group grid = cg::this_grid();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, G = gridDim.x, t = threadIdx.x;
    const int row = blockIdx.x * 32 + lane, c0 = warp * 32;
    float* q = qa;
    float* qp = qb;
    float a[32], g = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; c++) {
        a[c] = row < n && c0 + c < n ? A[(size_t)(c0 + c) * n + row] : 0.0f;  // A symmetric: coalesced by lane
        g += fabsf(a[c]);
    }
    P[warp][lane] = g;  // the row sums for newton_first_cap, as the twin adds them
    double qq1 = 0.0;   // every warp forms the same |q1|^2 (the twin's order)
    for (int i = lane; i < n; i += 32) qq1 += (double)lanczos_start(i) * lanczos_start(i);
    float inv = (float)(1.0 / sqrt(warp_sum_d(qq1)));
    q[t] = t < n ? lanczos_start(t) * inv : 0.0f;
    qp[t] = 0.0f;
    if (t == 0) flags[blockIdx.x] = 0;  // the last launch's count; every block's zero lands before the grid barrier
    __syncthreads();
    if (warp == 0) {
        float v[32];
#pragma unroll
        for (int s = 0; s < 32; s++) v[s] = P[s][lane];
        double m = row < n ? (double)(lzt_slice_tree(v) + eps) : 0.0;
        for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) part[(size_t)3 * k * G + blockIdx.x] = m;
    }
    grid.sync();  // the one grid barrier: the flags are zero (P is written again only after warp 0 read it)
    double beta_prev = 0.0;
    for (int j = 0; j < k; j++) {
        float y0 = 0.0f, y1 = 0.0f, y2 = 0.0f, y3 = 0.0f;  // lanczos_row's chains over the slice
#pragma unroll
        for (int c = 0; c < 32; c += 4) {
            float4 u = *reinterpret_cast<const float4*>(q + c0 + c);
            y0 = fmaf(a[c], u.x, y0);
            y1 = fmaf(a[c + 1], u.y, y1);
            y2 = fmaf(a[c + 2], u.z, y2);
            y3 = fmaf(a[c + 3], u.w, y3);
        }
        P[warp][lane] = (y0 + y1) + (y2 + y3);
        __syncthreads();
        if (warp == 0) lzt_rows_and_barrier(P, q[row], qp[row], row, n, eps, beta_prev, j, W, part, flags);
        __syncthreads();
        float wn = t < n ? __ldcg(&W[(size_t)j * n + t]) : 0.0f;  // in flight while warp 0 forms the coefficients
        if (warp == 0) lzt_coefficients(part, j, k, coef, coef_f, out);
        __syncthreads();
        if (coef[2] != 0.0) return;
        // the next q into the previous q's place (warp 0 read that one above, before the grid barrier)
        qp[t] = t < n ? fmaf(-coef_f[0], q[t], wn) * coef_f[1] : 0.0f;
        beta_prev = coef[1];
        __syncthreads();
        float* tmp = q;
        q = qp;
        qp = tmp;
    }
}

// z and lo from the kernel's tridiagonal (h: alpha[k], beta[k], the step count, the row sum); tri: a copy of h
static bool v1_lanczos_finish(const std::vector<double>& h, int k, LanczosStart& ls, std::vector<double>* tri) {
    if (tri) *tri = h;
    ls.k = (int)h[2 * k];
    ls.rowsum_max = h[2 * k + 1];
    if (ls.k < 1 || ls.k > k) return false;
    lanczos_newton_start(h.data(), h.data() + k, ls.k, &ls.z, &ls.lo);
    return std::isfinite(ls.z) && ls.z > 0.0 && ls.lo > 0.0 && ls.lo <= 1.0 && std::isfinite(ls.rowsum_max);
}

// Version 1's scaled start for one matrix (lanczos_newton_start on the kernel's tridiagonal: lanczos_tile_kernel for
// n <= LZT_COLS, lanczos_kernel above); false where the GPU cannot run the cooperative kernel (no cooperative launch,
// or 2 n floats of q beyond a block's shared memory) or the start is not finite and positive: version 1 then takes
// the unscaled start. tri (--test): the kernel's alpha, beta, step count and row sum as lanczos_grid_cpu gives them.
static bool v1_lanczos(const float* A, int n, float eps, LanczosStart& ls, std::vector<double>* tri = nullptr) {
    static int per_sm = -1, tile_per_sm = -1, coop = -1;
    static size_t per_sm_smem = 0;
    if (coop < 0) {
        int dev = 0;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&tile_per_sm, lanczos_tile_kernel, LZT_THREADS, 0));
    }
    int k = std::min(LANCZOS_STEPS, n);
    std::vector<double> h(2 * k + 2);  // alpha, beta, the step count, the row sum
    int tiles = (n + 31) / 32;
    if (coop && n <= LZT_COLS && tile_per_sm >= 1 && tiles <= tile_per_sm * g_gpu.sms) {
        float* W = (float*)ws_get(WS_LANCZOS_W, (size_t)k * n * sizeof(float));
        double* out = (double*)ws_get(WS_LANCZOS, (5 * k + 2 + (size_t)tiles * (3 * k + 2)) * sizeof(double));
        double* part = out + 5 * k + 2;
        unsigned* flags = reinterpret_cast<unsigned*>(part + (size_t)tiles * (3 * k + 1));
        void* args[] = {(void*)&A,    (void*)&n,    (void*)&eps,   (void*)&k,
                        (void*)&W,    (void*)&part, (void*)&flags, (void*)&out};
        cudaCheck(cudaLaunchCooperativeKernel((void*)lanczos_tile_kernel, tiles, LZT_THREADS, args, 0, g_stream));
        copy_to_host(h.data(), out + 3 * k, h.size() * sizeof(double));
        return v1_lanczos_finish(h, k, ls, tri);
    }
    size_t smem = 2 * (size_t)n * sizeof(float);
    if (!coop || smem > g_gpu.smem_optin) return false;
    if (per_sm < 0 || per_sm_smem != smem) {
        if (smem > 48 * 1024)
            cudaCheck(cudaFuncSetAttribute(lanczos_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, lanczos_kernel, LANCZOS_THREADS, smem));
        per_sm_smem = smem;
    }
    if (per_sm < 1) return false;
    int grid = (int)std::min<long long>((long long)per_sm * g_gpu.sms, ceil_div_ll(n, LANCZOS_THREADS / 32));
    float* W = (float*)ws_get(WS_LANCZOS_W, (size_t)k * n * sizeof(float));
    double* out = (double*)ws_get(WS_LANCZOS, (5 * k + 2) * sizeof(double));
    cudaCheck(cudaMemsetAsync(out, 0, (5 * k + 2) * sizeof(double), g_stream));
    void* args[] = {(void*)&A, (void*)&n, (void*)&eps, (void*)&k, (void*)&W, (void*)&out};
    cudaCheck(cudaLaunchCooperativeKernel((void*)lanczos_kernel, grid, LANCZOS_THREADS, args, smem, g_stream));
    copy_to_host(h.data(), out + 3 * k, h.size() * sizeof(double));
    return v1_lanczos_finish(h, k, ls, tri);
}

// The scaled start: M = z (A + eps I), X = I, x0[0] = zr (= z^(1/p)); one matrix
__global__ void newton_init_z_kernel(const float* A, float* M, float* X, float* x0, int n, float eps, float z,
                                     float zr, long long total) {
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        bool diag = idx / n == idx % n;
        M[idx] = z * (A[idx] + (diag ? eps : 0.0f));
        X[idx] = diag ? 1.0f : 0.0f;
        if (idx == 0) x0[0] = zr;
    }
}

// X = x0[b] Xc (Xc may be X): version 1's result from the X / x0 it carries
__global__ void newton_finish_x_kernel(const float* Xc, float* X, const float* x0, int n, long long rows) {
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        float s = x0[row / n];
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
            X[row * n + j] = s * Xc[row * n + j];
    }
}

// The step's T = ar ((p + 1) I - a M) / p, ar = a^(1/p) (a = ar = 1: bitwise the T of sumsq_kernel), into T and/or as
// TF32 hi and lo parts (Th, Tl); with Mh, also M's parts (for the product T^p M of operands split once). With X,
// also the first step's X <- I T = T (version 1 starts from X / x0 = I): no product. Rows by blockIdx.y (row_grid).
__global__ void newton_t_kernel(const float* M, float* T, float* Th, float* Tl, float* Mh, float* Ml, float* X, int n,
                                int p, float a, float ar, long long rows) {
    float diag = (float)(p + 1), scale = ar * (1.0f / (float)p);
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        long long i = row % n;
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
            long long idx = row * n + j;
            float m = M[idx], t = ((i == j ? diag : 0.0f) - a * m) * scale;
            if (T) T[idx] = t;
            if (X) X[idx] = t;
            if (Th) {
                float h = tf32_rna(t);
                Th[idx] = h;
                Tl[idx] = tf32_rna(t - h);
            }
            if (Mh) {
                float h = tf32_rna(m);
                Mh[idx] = h;
                Ml[idx] = tf32_rna(m - h);
            }
        }
    }
}

// The iteration from the scaled start (ls) or the unscaled one (ls == nullptr); products as g_v1 says
static NewtonState v1_iterate(const float* A, float* X, int batch, int n, int p, float eps, Prec prec,
                              const LanczosStart* ls) {
    long long nn = (long long)n * n, total = nn * batch;
    bool split = prec == PREC_3XTF32 && g_v1.products == V1_SPLIT, lt = prec == PREC_3XTF32 && g_v1.lt;
    bool lower = prec == PREC_3XTF32 && g_v1.products == V1_LOWER;
    bool f16 = prec == PREC_3XTF32 && g_v1.products == V1_F16;
    auto product = [&](const float* P, const float* Q, float* C) {  // C = P Q, on fp32 operands (not split)
        if (lower) gemm_lower(P, Q, C, n, batch, g_v1.lower_block);
        else if (f16) gemm_f16x3(P, Q, C, n, batch);
        else gemm_nn(P, Q, C, n, batch, prec, lt);
    };
    float* M = (float*)ws_get(WS_M, total * sizeof(float));
    float* T = (float*)ws_get(WS_T, total * sizeof(float));
    float* T2 = (float*)ws_get(WS_T2, total * sizeof(float));
    float* W = (float*)ws_get(WS_W, total * sizeof(float));
    double* sums = (double*)ws_get(WS_SUMS, batch * sizeof(double));
    // split: the hi and lo parts of X, T, T's powers (P) and M, each on a 256-byte boundary
    float *Xh = nullptr, *Xl = nullptr, *Th = nullptr, *Tl = nullptr, *Ph = nullptr, *Pl = nullptr, *Mh = nullptr,
          *Ml = nullptr;
    if (split) {
        long long part = ceil_div_ll(total, 64) * 64;
        float* parts = (float*)ws_get(WS_SPLIT, 8 * part * sizeof(float));
        float** each[] = {&Xh, &Xl, &Th, &Tl, &Ph, &Pl, &Mh, &Ml};
        for (int i = 0; i < 8; i++) *each[i] = parts + i * part;
    }
    int grid = grid_for(total, 256);
    auto split_into = [&](const float* src, float* hi, float* lo) {
        split_kernel<<<grid, 256, 0, g_stream>>>(src, hi, lo, total);
        launchCheck();
    };
    std::vector<double> h(batch);
    NewtonState s;
    s.n = n;
    s.p = p;
    NewtonScale scale;
    double first_cap = INFINITY;
    // X is carried as X / x0 (X0 = x0 I, x0 = z^(1/p) per matrix), times x0 at the end: whatever A's scale, the fp16
    // parts of V1_F16 then see entries within fp16's range (X / x0 grows from 1 to at most (z lambda_min)^(-1/p))
    float* x0 = (float*)ws_get(WS_X0, batch * sizeof(float));
    float* Xc = X;  // the current X; it alternates with W, and ends in X
    double z_min = 0.0;  // the smallest z of the batch
    if (ls) {
        z_min = ls->z;
        double z = ls->z;
        scale.lo = ls->lo;
        first_cap = newton_first_cap(p, z, ls->rowsum_max);
        s.max_iter = newton_max_iter(p, z * eps);  // the unscaled steps' count: an upper bound for scaled ones
        newton_init_z_kernel<<<grid, 256, 0, g_stream>>>(A, M, Xc, x0, n, eps, (float)z,
                                                         (float)std::pow(z, 1.0 / p), total);
        launchCheck();
    } else {
        add_eps_kernel<<<grid, 256, 0, g_stream>>>(A, M, n, total, eps);
        launchCheck();
        sumsq(M, sums, nullptr, batch, nn, n, p, 0.0f);
        copy_to_host(h.data(), sums, batch * sizeof(double));
        double max_norm = std::sqrt(*std::max_element(h.begin(), h.end()));
        z_min = (p + 1) / (2.0 * max_norm);
        s.max_iter = newton_max_iter(p, (p + 1) / (2.0 * max_norm) * eps);
        newton_init_kernel<<<grid, 256, 0, g_stream>>>(M, Xc, x0, sums, n, p, total);
        launchCheck();
    }
    if (split) split_into(Xc, Xh, Xl);
    // X / x0 grows to at most (z lambda_min)^(-1/p) <= (z eps)^(-1/p) (up to the scaled steps' overshoot): where that
    // passes 2^12 (p = 1 or 2 on ill-conditioned matrices), fp16 parts of X could overflow, and X T runs in TF32 concat
    bool f16_x = f16 && std::pow(z_min * eps, -1.0 / p) <= 4096.0;
    auto x_product = [&](const float* P, const float* Q, float* C) {
        if (f16 && !f16_x) gemm_nn(P, Q, C, n, batch, prec, lt);
        else product(P, Q, C);
    };
    // unscaled, products on fp32 operands: T comes from the residual pass, as it always did
    bool t_with_r = !ls && !split;
    // near convergence (concat or fp16 products): T = I + D, X <- X + X D, M <- M + (T^p - I) M, each product in
    // plain TF32, whose rounding is then relative to ||D||, not to ||X|| or ||M|| (the twin's tf32_below; --study)
    bool delta_ok = prec == PREC_3XTF32 && !split && !lower && g_v1.delta_below > 0.0;
    auto tf32_product = [&](const float* P, const float* Q, float* C) {
        tf32_gemm(P, n, nn, Q, n, nn, C, n, n, batch, 0.0f, lt);
    };
    auto scale_add = [&](float* y, const float* w, float c) {
        scale_add_kernel<<<grid, 256, 0, g_stream>>>(y, w, c, total);
        launchCheck();
    };
    for (;;) {
        sumsq(M, sums, t_with_r ? T : nullptr, batch, nn, n, p, 1.0f);  // r^2 per matrix (and T)
        copy_to_host(h.data(), sums, batch * sizeof(double));
        double r2 = 0.0;
        for (double v : h) r2 = std::isnan(v) ? v : std::max(r2, v);
        NewtonAction act = newton_decide(s, std::sqrt(r2));
        if (act == NEWTON_FAIL) break;
        if (delta_ok && s.r < g_v1.delta_below) {  // T2 holds D, then E = T^q - I; W each product
            delta_kernel<<<grid, 256, 0, g_stream>>>(M, T2, n, p, total);
            launchCheck();
            tf32_product(Xc, T2, W);
            scale_add(Xc, W, 1.0f);
            s.delta_steps++;
            if (act == NEWTON_LAST) break;
            for (int q = 1; q < p; q *= 2) {
                tf32_product(T2, T2, W);
                scale_add(T2, W, 2.0f);
            }
            tf32_product(T2, M, W);
            scale_add(M, W, 1.0f);
            s.iters++;
            continue;
        }
        double a = ls ? newton_scale_a(scale, p, s.r, s.iters == 0 ? first_cap : INFINITY) : 1.0;
        // the first step's X <- I T is T: written by newton_t_kernel beside T in fp32, or a copy of sumsq's T
        bool first_x = s.iters == 0 && !split;
        if (!t_with_r) {
            bool m_parts = split && act == NEWTON_STEP;
            newton_t_kernel<<<row_grid((long long)n * batch, n, 256), 256, 0, g_stream>>>(
                M, split ? nullptr : T, split ? Th : nullptr, split ? Tl : nullptr, m_parts ? Mh : nullptr,
                m_parts ? Ml : nullptr, first_x ? W : nullptr, n, p, (float)a,
                (float)std::pow(a, 1.0 / p), (long long)n * batch);
            launchCheck();
        }
        if (split) gemm_split(Xh, Xl, Th, Tl, W, n, batch, lt);  // X <- X T
        else if (first_x && t_with_r)
            cudaCheck(cudaMemcpyAsync(W, T, total * sizeof(float), cudaMemcpyDeviceToDevice, g_stream));
        else if (!first_x) x_product(Xc, T, W);
        std::swap(Xc, W);
        if (act == NEWTON_LAST) break;
        if (split) {  // M <- T^p M, every product's result split once
            split_into(Xc, Xh, Xl);
            const float *Qh = Th, *Ql = Tl;
            if (p >= 2) {
                gemm_split(Th, Tl, Th, Tl, T2, n, batch, lt);
                split_into(T2, Ph, Pl);
                Qh = Ph;
                Ql = Pl;
            }
            if (p == 4) {
                gemm_split(Ph, Pl, Ph, Pl, T2, n, batch, lt);
                split_into(T2, Ph, Pl);
            }
            gemm_split(Qh, Ql, Mh, Ml, W, n, batch, lt);
        } else {
            const float* Tp = T;
            if (p >= 2) { product(T, T, T2); Tp = T2; }
            if (p == 4) { product(T2, T2, T); Tp = T; }
            product(Tp, M, W);  // M <- T^p M
        }
        std::swap(M, W);
        if (ls) scale.advance(p, a, s.iters == 0);
        s.iters++;
    }
    // X, M and W permute three buffers (the output and two workspaces): the result may sit in a workspace
    newton_finish_x_kernel<<<row_grid((long long)n * batch, n, 256), 256, 0, g_stream>>>(Xc, X, x0, n,
                                                                                        (long long)n * batch);
    launchCheck();
    return s;
}

static NewtonState inv_root_v1(const float* A, float* X, int batch, int n, int p, float eps, Prec prec) {
    check_root_args("inv_root_v1", A, X, batch, n, p, eps);
    g_v1_info = V1Info();
    LanczosStart ls;
    const auto t0 = std::chrono::steady_clock::now();  // v1_lanczos ends on a host copy: its wall time
    const bool started = g_v1.scaled && batch == 1 && v1_lanczos(A, n, eps, ls);
    g_v1_info.start_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (started) {
        g_v1_info.scaled = true;
        g_v1_info.start = ls;
        NewtonState s = v1_iterate(A, X, batch, n, p, eps, prec, &ls);
        g_v1_info.delta_steps = s.delta_steps;
        if (!s.failed && s.converged) return s;
        g_v1_info.fell_back = true;  // the unscaled iteration from the start, as before scaling existed
    }
    return v1_iterate(A, X, batch, n, p, eps, prec, nullptr);
}

// ----------------------------------------------------------------------------------------------------------------
// version 2: the whole coupled Newton iteration of one matrix in one thread block. X, M and T live in shared memory
// (padded to NP x NP with zeros, row stride NP + 1 so the column reads of the left operand hit distinct banks);
// products run in place: each thread keeps its TM x TN outputs in registers until every thread has read its operands.
// fp32 FMA throughout (no restart needed, and the same arithmetic as the CPU twin's fp32 run).

template <int NP> struct V2Tile;
template <> struct V2Tile<32> { static constexpr int TM = 2, TN = 2; };   // 256 threads
template <> struct V2Tile<64> { static constexpr int TM = 4, TN = 4; };   // 256 threads
template <> struct V2Tile<128> { static constexpr int TM = 4, TN = 8; };  // 512 threads, 32 outputs each
template <int NP> __host__ __device__ constexpr int v2_threads() {
    return (NP / V2Tile<NP>::TM) * (NP / V2Tile<NP>::TN);
}
template <int NP> constexpr size_t v2_smem_bytes() { return 3ull * NP * (NP + 1) * sizeof(float); }

// Every thread gets the block's sum. red: 33 floats of shared memory. Contains barriers: the whole block calls it.
template <int THREADS>
__device__ float block_sum(float v, float* red) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < THREADS / 32 ? red[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) red[32] = v;
    }
    __syncthreads();
    return red[32];  // the next call writes red[32] only after a barrier every thread reaches after this read
}

// dst = A B (NP x NP in shared memory, only k < n summed: the padding is zero); dst may be A or B.
template <int NP>
__device__ void smem_matmul(const float* A, const float* B, float* dst, int n) {
    constexpr int TM = V2Tile<NP>::TM, TN = V2Tile<NP>::TN, LD = NP + 1, RS = NP / TM, CS = NP / TN;
    int tx = threadIdx.x % CS, ty = threadIdx.x / CS;  // rows ty + i RS, columns tx + j CS: consecutive lanes,
    float acc[TM][TN];                                   // consecutive columns (conflict-free B reads)
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
    for (int k = 0; k < n; k++) {
        float a[TM], b[TN];
#pragma unroll
        for (int i = 0; i < TM; i++) a[i] = A[(ty + i * RS) * LD + k];
#pragma unroll
        for (int j = 0; j < TN; j++) b[j] = B[k * LD + tx + j * CS];
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < TN; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();  // every operand read before dst (A or B) is overwritten
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) dst[(ty + i * RS) * LD + tx + j * CS] = acc[i][j];
    __syncthreads();
}

// Loads M = A + eps I into shared memory (row stride LD, zero padding), zeroes X, and returns ||M||_F^2 (block-wide).
// Versions 2 and 3.
template <int NP, int LD, int THREADS>
__device__ float fused_load(const float* Ab, float* Ms, float* Xs, int n, float eps, float* red) {
    // up to 16 global reads in flight per thread (a loop of one read each waited ~1 us per 4 at NP = 128)
    constexpr int ITER = (NP * NP + THREADS - 1) / THREADS, CHUNK = ITER < 16 ? ITER : 16;
    float sq = 0.0f;
    for (int it0 = 0; it0 < ITER; it0 += CHUNK) {
        float v[CHUNK];
#pragma unroll
        for (int c = 0; c < CHUNK; c++) {
            int e = threadIdx.x + (it0 + c) * THREADS, i = e / NP, j = e % NP;
            v[c] = (e < NP * NP && i < n && j < n) ? Ab[i * n + j] + (i == j ? eps : 0.0f) : 0.0f;
        }
#pragma unroll
        for (int c = 0; c < CHUNK; c++) {
            int e = threadIdx.x + (it0 + c) * THREADS, i = e / NP, j = e % NP;
            if (e < NP * NP) {
                Ms[i * LD + j] = v[c];
                Xs[i * LD + j] = 0.0f;
                sq = fmaf(v[c], v[c], sq);
            }
        }
    }
    return block_sum<THREADS>(sq, red);
}

// T = c ((p + 1) I - a M) (zero in the padding) and ||M - I||_F from the same read of M (block-wide; its barrier
// publishes T). a = 1, c = 1 / p: the unscaled step, bit for bit as before the scaled steps.
template <int NP, int LD, int THREADS>
__device__ float fused_residual_and_T(const float* Ms, float* Ts, int n, int p, float a, float c, float* red) {
    float r2 = 0.0f;
    for (int e = threadIdx.x; e < NP * NP; e += THREADS) {
        int i = e / NP, j = e % NP;
        float t = 0.0f;
        if (i < n && j < n) {
            float m = Ms[i * LD + j], d = m - (i == j ? 1.0f : 0.0f);
            r2 = fmaf(d, d, r2);
            t = ((i == j ? (float)(p + 1) : 0.0f) - a * m) * c;
        }
        Ts[i * LD + j] = t;
    }
    return sqrtf(block_sum<THREADS>(r2, red));
}

// A lane's R consecutive floats (warp 0 reads its rows' partials from P), vectorised where LD says the address allows
// (a multiple of 4 floats: one 16-byte read at R = 4; otherwise one by one).
template <int R, int LD>
__device__ __forceinline__ void lanczos_rows(const float* p, float (&a)[R]) {
    if constexpr (R == 4 && LD % 4 == 0) {
        float4 t = *reinterpret_cast<const float4*>(p);
        a[0] = t.x, a[1] = t.y, a[2] = t.z, a[3] = t.w;
    } else if constexpr (R == 2 && LD % 2 == 0) {
        float2 t = *reinterpret_cast<const float2*>(p);
        a[0] = t.x, a[1] = t.y;
    } else {
#pragma unroll
        for (int j = 0; j < R; j++) a[j] = p[j];
    }
}

// Versions 2 and 3's Lanczos matvec A u in units of 32 rows x one quarter of the NP columns (lanczos23_partial; the
// twin forms the same sums): lane = row, lanczos_row's four chains over the quarter, the result to P[quarter][row].
// Warp 0 adds a row's quarters as (p0 + p1) + (p2 + p3). a(t): the row's entry in column c0 + t.
template <int NP> struct Lz23 {
    static constexpr int R = NP / 32, QC = NP / 4, UNITS = 4 * R;  // rows per lane of warp 0; columns per quarter
};
template <int NP, typename Entry>
__device__ __forceinline__ float lanczos23_partial(const float* W, int c0, Entry a) {
    constexpr int QC = Lz23<NP>::QC;
    float4 uc[QC / 4];  // every read of u issued before the first FMA waits on one
#pragma unroll
    for (int t = 0; t < QC; t += 4) uc[t / 4] = *reinterpret_cast<const float4*>(W + c0 + t);
    float y0 = 0.0f, y1 = 0.0f, y2 = 0.0f, y3 = 0.0f;
#pragma unroll
    for (int t = 0; t < QC; t += 4) {
        y0 = fmaf(a(t), uc[t / 4].x, y0);
        y1 = fmaf(a(t + 1), uc[t / 4].y, y1);
        y2 = fmaf(a(t + 2), uc[t / 4].z, y2);
        y3 = fmaf(a(t + 3), uc[t / 4].w, y3);
    }
    return (y0 + y1) + (y2 + y3);
}
// Unit u's partial from shared memory (A symmetric: row i's entry in column c is M[c][i], conflict-free by lane)
template <int NP, int LD>
__device__ __forceinline__ void lanczos23_unit(const float* Ms, const float* W, float* P, int u) {
    constexpr int RG = NP / 32, QC = Lz23<NP>::QC;
    int i = u % RG * 32 + threadIdx.x % 32, c0 = u / RG * QC;
    P[u / RG * NP + i] = lanczos23_partial<NP>(W, c0, [&](int t) { return Ms[(c0 + t) * LD + i]; });
}

// A product warp (mw = 0 .. NMW - 1): units mw, mw + NMW, ...; with one unit each (CACHED) it holds its 32 x NP / 4
// entries in registers, read once. Each round: wait for warp 0's u (barrier 1), stop at *flag == 0, else form the
// partials and arrive at barrier 2 without waiting.
template <int NP, int LD, int NMW>
__device__ void lanczos23_product_warp(const float* Ms, const float* W, float* P, const volatile int* flag, int mw) {
    constexpr int RG = NP / 32, QC = Lz23<NP>::QC, UNITS = Lz23<NP>::UNITS, COUNT = (1 + NMW) * 32;
    constexpr bool CACHED = NMW == UNITS;
    float m[CACHED ? QC : 1];
    int i = mw % RG * 32 + threadIdx.x % 32, c0 = mw / RG * QC;
    if constexpr (CACHED) {
#pragma unroll
        for (int t = 0; t < QC; t++) m[t] = Ms[(c0 + t) * LD + i];
    }
    for (;;) {
        named_bar_sync(1, COUNT);
        if (*flag == 0) return;
        if constexpr (CACHED) {
            P[mw / RG * NP + i] = lanczos23_partial<NP>(W, c0, [&](int t) { return m[t]; });
        } else {
            for (int u = mw; u < UNITS; u += NMW) lanczos23_unit<NP, LD>(Ms, W, P, u);
        }
        named_bar_arrive(2, COUNT);
    }
}

// Lanczos on warp 0 (versions 2 and 3; lanczos_warp_cpu is its twin, bit for bit): lane l owns rows R l .. R l + R - 1
// (their u, v, v_prev in registers); u is broadcast through W (NP floats of shared memory) to NMW product warps (0:
// warp 0 forms the partials itself), which form A u while warp 0 forms ||u|| (its float64 shuffle tree, sqrt and
// division); warp 0 then adds each row's quarters from P, forms alpha (a shuffle tree) and the next u. Every published
// u is consumed (barrier 2) before the stop flag goes out. alpha[k], beta[k]: shared memory, written by lane 0.
template <int NP, int LD, int NMW>
__device__ int warp_lanczos(const float* Ms, float* W, float* P, volatile int* flag, int n, double* alpha,
                            double* beta) {
    constexpr int R = Lz23<NP>::R, COUNT = (1 + NMW) * 32;
    int lane = threadIdx.x % 32;
    float u[R], v[R], v_prev[R];
    double part = 0.0;
#pragma unroll
    for (int j = 0; j < R; j++) {
        int i = R * lane + j;
        u[j] = i < n ? lanczos_start(i) : 0.0f;
        v[j] = 0.0f;
        W[i] = u[j];
        part += (double)u[j] * u[j];
    }
    auto publish = [&](int go) {  // W (and the flag) to the product warps
        if (lane == 0) *flag = go;
        __syncwarp();
        named_bar_arrive(1, COUNT);
    };
    bool pending = false;  // a published u whose partials are not yet consumed
    if constexpr (NMW > 0) {
        publish(1);
        pending = true;
    }
    __syncwarp();
    double b = sqrt(warp_sum_d(part));
    int k = 0;
    while (k < LANCZOS23_STEPS && b > 0.0) {
        float inv = (float)(1.0 / b);
        if constexpr (NMW > 0) {
            named_bar_sync_after(2, COUNT, inv);  // 1 / ||u|| formed while the product warps work
            pending = false;
        } else {
            for (int un = 0; un < Lz23<NP>::UNITS; un++) lanczos23_unit<NP, LD>(Ms, W, P, un);
            __syncwarp();
        }
        float pq[4][R], y[R];
#pragma unroll
        for (int q = 0; q < 4; q++) lanczos_rows<R, 4>(P + q * NP + R * lane, pq[q]);
        part = 0.0;
#pragma unroll
        for (int j = 0; j < R; j++) {
            v_prev[j] = v[j];
            v[j] = u[j] * inv;
            y[j] = ((pq[0][j] + pq[1][j]) + (pq[2][j] + pq[3][j])) * inv;
            part += (double)v[j] * y[j];
        }
        double a = warp_sum_d(part);
        __syncwarp();  // every lane has read W and P before they are overwritten
        part = 0.0;
#pragma unroll
        for (int j = 0; j < R; j++) {
            u[j] = (float)fma(-b, (double)v_prev[j], fma(-a, (double)v[j], (double)y[j]));
            W[R * lane + j] = u[j];
            part += (double)u[j] * u[j];
        }
        if (NMW > 0 && k + 1 < LANCZOS23_STEPS) {
            publish(1);
            pending = true;
        }
        b = sqrt(warp_sum_d(part));
        if (lane == 0) {
            alpha[k] = a;
            beta[k] = b;
        }
        k++;
        __syncwarp();  // W (and alpha, beta) visible to the whole warp
    }
    if constexpr (NMW > 0) {
        if (pending) named_bar_sync(2, COUNT);  // a breakdown after the next u went out
        publish(0);
    }
    return k;
}

// Versions 2 and 3's scaled start (z, lo; the row sums for newton_first_cap) from their shared-memory layout (X, M, T
// of NP x LD floats; M = A + eps I loaded): warp 0 runs the Lanczos steps and the multisection, warps 1 .. NMW form
// the products, the last warp meanwhile takes the largest absolute row sum (lanczos_warp_cpu's max_abs_rowsum: each
// column summed in order by one lane, then a max); the others wait at the one barrier that publishes the result. T's
// space holds u, the tridiagonal, the result, the flag and the partials. Not inlined: its registers (float64
// multisection, a product warp's entries) would otherwise add to the product loops' and spill there.
template <int NP, int LD, int THREADS>
__device__ __noinline__ LanczosStart fused_scaled_start(int n) {
    static_assert(THREADS >= 64 && NP % 32 == 0, "a warp for Lanczos and one for the row sums");
    constexpr int WARPS = THREADS / 32, SPARE = WARPS - 2, UNITS = Lz23<NP>::UNITS;
    constexpr int NMW = SPARE < UNITS ? SPARE : UNITS;  // product warps
    extern __shared__ __align__(16) float lanczos_smem[];  // the kernel's dynamic shared memory: X, M, T
    const float* Ms = lanczos_smem + NP * LD;
    float* W = lanczos_smem + 2 * NP * LD;
    double *alpha = reinterpret_cast<double*>(W + NP), *beta = alpha + LANCZOS23_STEPS, *out = beta + LANCZOS23_STEPS;
    volatile int* flag = reinterpret_cast<volatile int*>(out + 4);
    volatile int* kslot = flag + 1;
    float* P = W + NP + 4 * LANCZOS23_STEPS + 12;  // 16-byte aligned: NP, 4 STEPS + 12 are multiples of 4
    unsigned* ballots = reinterpret_cast<unsigned*>(P + 4 * NP);
    static_assert((4 * LANCZOS23_STEPS + 12) % 4 == 0 &&
                      5 * NP + 4 * LANCZOS23_STEPS + 12 + 2 * MULTISECTION_MAX_GROUPS <= NP * (NP + 1),
                  "T's space holds u, the tridiagonal, the result, the flag, k, the partials and the ballots");
    constexpr int GROUPS = lanczos23_groups(NP);  // warps 0 .. GROUPS - 1 share the multisection
    static_assert(GROUPS == 1 || (GROUPS <= NMW + 1 && GROUPS <= MULTISECTION_MAX_GROUPS), "warps for the groups");
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    auto extremes = [&](int k) {  // z and lo, the same in every warp of the multisection
        double z, lo;
        lanczos_newton_start(alpha, beta, k, &z, &lo, Multisection{GROUPS, ballots, warp});
        if (warp == 0 && lane == 0) {
            out[0] = k;
            out[1] = z;
            out[2] = lo;
        }
    };
    if (warp == 0) {
        int k = warp_lanczos<NP, LD, NMW>(Ms, W, P, flag, n, alpha, beta);
        if constexpr (GROUPS > 1) {
            if (lane == 0) *kslot = k;
            named_bar_sync(3, 32 * GROUPS);  // k (and the tridiagonal) to the other warps of the multisection
        }
        extremes(k);
    } else if (warp == WARPS - 1) {
        float g = 0.0f;
        for (int i = lane; i < n; i += 32) {
            float s = 0.0f;
            for (int c = 0; c < n; c++) s += fabsf(Ms[c * LD + i]);
            g = fmaxf(g, s);
        }
        for (int o = 16; o > 0; o >>= 1) g = fmaxf(g, __shfl_xor_sync(0xffffffffu, g, o));
        if (lane == 0) out[3] = g;
    } else if (warp <= NMW) {
        lanczos23_product_warp<NP, LD, NMW>(Ms, W, P, flag, warp - 1);
        if (GROUPS > 1 && warp < GROUPS) {
            named_bar_sync(3, 32 * GROUPS);
            extremes(*kslot);
        }
    }
    __syncthreads();
    LanczosStart fs;
    fs.k = (int)out[0];
    fs.z = out[1];
    fs.lo = out[2];
    fs.rowsum_max = out[3];
    return fs;
}
// Where fused_scaled_start leaves the tridiagonal (alpha, then beta; LANCZOS23_STEPS each) in T's space
template <int NP, int LD> __device__ const double* lanczos23_tridiag(const float* Ts) {
    return reinterpret_cast<const double*>(Ts + NP);
}

// The coupled iteration of versions 2 and 3 on X, M and T in shared memory (Ab: the matrix in global memory): scaled
// steps from the Lanczos start (NEWTON_SCALED), and when they fail or do not converge the unscaled iteration from a
// fresh load (the fallback). mul(A, B, dst): dst = A B, the whole block (or cluster) calls it. Every thread takes the
// same decisions: they come from block-wide sums (and, in a cluster, from identical copies summed in the same order).
// the first step's X <- X0 T with X0 = x0 I: x0 T, the NP x NP padding included (T's is zero), no product
template <int NP, int LD, int THREADS> __device__ void fused_first_x(float* Xs, const float* Ts, float x0) {
    for (int e = threadIdx.x; e < NP * NP; e += THREADS) {  // by NP (a shift), not n
        int i = e / NP, j = e % NP;
        Xs[i * LD + j] = x0 * Ts[i * LD + j];
    }
    __syncthreads();
}

template <int NP, int LD, int THREADS, typename Mul, typename LastX>
__device__ NewtonState fused_newton(const float* Ab, float* Xs, float* Ms, float* Ts, int n, int p, float eps,
                                    int start, float* red, Mul mul, LastX last_x) {
    NewtonState s;
    int discarded = 0;
    bool fell_back = false;
    for (int attempt = start == NEWTON_UNSCALED ? 1 : 0; attempt < 2; attempt++) {
        bool scaled = attempt == 0;
        float nrm2 = fused_load<NP, LD, THREADS>(Ab, Ms, Xs, n, eps, red);
        float z = (p + 1) / (2.0f * sqrtf(nrm2));
        NewtonScale scale;
        double first_cap = INFINITY;
        if (scaled) {
            LanczosStart fs = fused_scaled_start<NP, LD, THREADS>(n);  // Ms and Ts: the layout it assumes
            if (start == NEWTON_SCALED_BAD_HI) {
                fs.z *= NEWTON_BAD_HI_FACTOR;
                fs.lo *= NEWTON_BAD_HI_FACTOR;
            }
            z = (float)fs.z;
            scale.lo = fs.lo;
            first_cap = newton_first_cap(p, z, fs.rowsum_max);
        }
        float x0 = powf(z, 1.0f / p);
        for (int e = threadIdx.x; e < NP * NP; e += THREADS) {  // by NP (a shift), not n (an integer division)
            int i = e / NP, j = e % NP;
            if (i < n && j < n) Ms[i * LD + j] *= z;
        }
        for (int i = threadIdx.x; i < n; i += THREADS) Xs[i * LD + i] = x0;
        __syncthreads();
        s = NewtonState();
        s.n = n;
        s.p = p;
        s.max_iter = newton_max_iter(p, (double)z * eps);
        for (;;) {
            // a from the carried interval alone (newton_scale_a), so that one pass gives the residual and T
            double a = scaled ? newton_scale_a23(scale, p, s.iters == 0 ? first_cap : INFINITY) : 1.0;
            float c = scaled ? (float)(newton_root_p(a, p) / p) : 1.0f / (float)p;
            NewtonAction act = newton_decide(s, fused_residual_and_T<NP, LD, THREADS>(Ms, Ts, n, p, (float)a, c, red));
            if (act == NEWTON_FAIL) break;
            if (s.iters == 0) fused_first_x<NP, LD, THREADS>(Xs, Ts, x0);  // X0 = x0 I: X0 T = x0 T
            else if (act == NEWTON_LAST) last_x();                          // X <- X T, as the version likes
            else mul(Xs, Ts, Xs);                                            // X <- X T
            if (act == NEWTON_LAST) break;
            if (p >= 2) mul(Ts, Ts, Ts);
            if (p == 4) mul(Ts, Ts, Ts);
            mul(Ts, Ms, Ms);  // M <- T^p M
            if (scaled) scale.advance(p, a, s.iters == 0);
            s.iters++;
        }
        if (!scaled || (!s.failed && s.converged)) break;
        fell_back = true;
        discarded = s.iters;
    }
    s.fell_back = fell_back;
    s.discarded = discarded;
    return s;
}

// status of a matrix: -1 failed, else the steps of both attempts, plus NEWTON_FELL_BACK after a fallback
__device__ inline int fused_status(const NewtonState& s) {
    return s.failed ? -1 : s.iters + s.discarded + (s.fell_back ? NEWTON_FELL_BACK : 0);
}

// One block per matrix (blockIdx.x); status[b] = steps taken, or -1 when the iteration left its convergence region.
template <int NP>
__global__ void __launch_bounds__(v2_threads<NP>())
newton_fused_kernel(const float* A, float* X, int n, int p, float eps, int start, int* status, float* residual) {
    constexpr int LD = NP + 1;
    extern __shared__ __align__(16) float smem[];  // 16: fused_scaled_start reads T's space by float4
    __shared__ float red[33];
    float *Xs = smem, *Ms = smem + NP * LD, *Ts = smem + 2 * NP * LD;
    long long nn = (long long)n * n;
    auto mul = [&](const float* P, const float* Q, float* dst) { smem_matmul<NP>(P, Q, dst, n); };
    NewtonState s = fused_newton<NP, LD, v2_threads<NP>()>(A + blockIdx.x * nn, Xs, Ms, Ts, n, p, eps, start, red, mul,
                                                           [&]() { mul(Xs, Ts, Xs); });
    for (int e = threadIdx.x; e < NP * NP; e += v2_threads<NP>()) {  // by NP: no integer division by n
        int i = e / NP, j = e % NP;
        if (i < n && j < n) X[blockIdx.x * nn + i * n + j] = Xs[i * LD + j];
    }
    if (threadIdx.x == 0) {
        status[blockIdx.x] = fused_status(s);
        residual[blockIdx.x] = (float)s.r;
    }
}

template <int NP>
static const char* launch_v2(const float* A, float* X, int batch, int n, int p, float eps, int start, int* status,
                             float* res) {
    static bool configured = false;
    static const char* why_not = nullptr;
    static char why_buf[200];
    if (!configured) {
        cudaFuncAttributes attr;
        cudaCheck(cudaFuncGetAttributes(&attr, newton_fused_kernel<NP>));
        size_t need = v2_smem_bytes<NP>() + attr.sharedSizeBytes;
        if (need > g_gpu.smem_optin) {
            snprintf(why_buf, sizeof why_buf, "n <= %d needs %zu bytes of shared memory per block, this GPU allows %zu",
                     NP, need, g_gpu.smem_optin);
            why_not = why_buf;
        } else {
            cudaCheck(cudaFuncSetAttribute(newton_fused_kernel<NP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)v2_smem_bytes<NP>()));
        }
        configured = true;
    }
    if (why_not) return why_not;
    newton_fused_kernel<NP><<<batch, v2_threads<NP>(), v2_smem_bytes<NP>(), g_stream>>>(A, X, n, p, eps, start, status,
                                                                                         res);
    launchCheck();
    return nullptr;
}

// Returns nullptr, or why this size cannot run here (n > 128, or the device's shared memory). The per-matrix
// status (steps, -1 = failed) and final ||M - I||_F stay on the device: newton_status() reads them. start: scaled
// with the unscaled fallback (default), unscaled only, or the tests' bad estimate (NewtonStart).
static const char* inv_root_v2(const float* A, float* X, int batch, int n, int p, float eps,
                               NewtonStart start = NEWTON_SCALED) {
    check_root_args("inv_root_v2", A, X, batch, n, p, eps);
    int* status = (int*)ws_get(WS_STATUS, batch * (sizeof(int) + sizeof(float)));
    float* res = (float*)(status + batch);
    if (n <= 32) return launch_v2<32>(A, X, batch, n, p, eps, start, status, res);
    if (n <= 64) return launch_v2<64>(A, X, batch, n, p, eps, start, status, res);
    if (n <= 128) return launch_v2<128>(A, X, batch, n, p, eps, start, status, res);
    return "version 2 runs n <= 128 only";
}
// versions 2, 3 and 4: the per-matrix steps (-1: left the convergence region; versions 2 and 3: both attempts'
// steps after a fallback) and final ||M - I||_F; fell_back (optional): 1 where versions 2 or 3 reran unscaled
static void newton_status(int batch, std::vector<int>& steps, std::vector<float>& r,
                          std::vector<int>* fell_back = nullptr) {
    std::vector<char> h(batch * (sizeof(int) + sizeof(float)));
    copy_to_host(h.data(), g_ws[WS_STATUS], h.size());
    steps.assign((int*)h.data(), (int*)h.data() + batch);
    r.assign((float*)(h.data() + batch * sizeof(int)), (float*)(h.data() + batch * sizeof(int)) + batch);
    if (fell_back) fell_back->assign(batch, 0);
    for (int b = 0; b < batch; b++)
        if (steps[b] >= NEWTON_FELL_BACK) {
            steps[b] -= NEWTON_FELL_BACK;
            if (fell_back) (*fell_back)[b] = 1;
        }
}

// ----------------------------------------------------------------------------------------------------------------
// 3xTF32 on mma.sync, shared by versions 3 and 4: a warp's 32 x 32 output tile, one k-step of 8 at a time, operands
// read in fp32 from shared memory and split in registers (hi = TF32 rounding, lo = TF32 rounding of the rest, as
// split3_kernel does); a_hi b_hi goes into one accumulator, a_lo b_hi + a_hi b_lo into a second (whose rounding is
// relative to the small terms), the two added at the end: the CPU twin's PREC_3XTF32_2ACC.
// mma.sync.m16n8k8 fragments (g = lane / 4, t = lane % 4; the table of dev/matmul.cu's mma_tf32_16x8x8):
// a0 (g, t) a1 (g + 8, t) a2 (g, t + 4) a3 (g + 8, t + 4); b0 (k = t, n = g) b1 (k = t + 4, n = g);
// c0 (g, 2t) c1 (g, 2t + 1) c2 (g + 8, 2t) c3 (g + 8, 2t + 1).

// a warp tile: MI x 4 mma tiles of 16 x 8 = (16 MI) x 32; version 3 uses MI = 1, version 4 MI = 2
constexpr int TC_NI = 4;

template <int MI> struct TcFrags {
    uint32_t ah[MI][4], al[MI][4], bh[TC_NI][2], bl[TC_NI][2];
};

__host__ __device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
    float h = tf32_rna(x), l = tf32_rna(x - h);
    memcpy(&hi, &h, 4);
    memcpy(&lo, &l, 4);
}

// One lane's fragments of the k-step k0 .. k0 + 7 of A (the warp tile's 16 MI rows) and B (its 32 columns):
// A(i, k) = As[i * lda + k], B(k, j) = Bs[k * ldb + j]. Host and device: --test emulates a warp with it.
template <int MI>
__host__ __device__ __forceinline__ void tc_load_frags(int lane, const float* As, int lda, const float* Bs, int ldb,
                                                       int k0, TcFrags<MI>& f) {
    int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mi = 0; mi < MI; mi++) {
        const float* a = As + (mi * 16 + g) * lda + k0 + t;
        tf32_split(a[0], f.ah[mi][0], f.al[mi][0]);
        tf32_split(a[8 * lda], f.ah[mi][1], f.al[mi][1]);
        tf32_split(a[4], f.ah[mi][2], f.al[mi][2]);
        tf32_split(a[8 * lda + 4], f.ah[mi][3], f.al[mi][3]);
    }
#pragma unroll
    for (int ni = 0; ni < TC_NI; ni++) {
        const float* b = Bs + (k0 + t) * ldb + ni * 8 + g;
        tf32_split(b[0], f.bh[ni][0], f.bl[ni][0]);
        tf32_split(b[4 * ldb], f.bh[ni][1], f.bl[ni][1]);
    }
}

// the warp tile's row and column of accumulator register r of mma tile (mi, ni) in lane
__host__ __device__ __forceinline__ void tc_acc_coords(int lane, int mi, int ni, int r, int& row, int& col) {
    row = mi * 16 + lane / 4 + (r >= 2 ? 8 : 0);
    col = ni * 8 + 2 * (lane % 4) + (r & 1);
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int MI> using TcAcc = float[MI][TC_NI][4];

// big, small += the warp tile's A B over k in [0, kn), kn a multiple of 8 (operands zero-padded to it). UNROLL 2
// overlaps a k-step's shared loads with the previous one's mma (version 3; version 4 has no registers to spare).
// PLAIN: big += A_hi B_hi alone, one TF32 product (version 3's last X step, X D with a small D).
template <int MI, int UNROLL, bool PLAIN = false>
__device__ __forceinline__ void tc_warp_tile(const float* As, int lda, const float* Bs, int ldb, int kn,
                                             TcAcc<MI>& big, TcAcc<MI>& small) {
    int lane = threadIdx.x % 32;
#pragma unroll UNROLL
    for (int k0 = 0; k0 < kn; k0 += 8) {
        TcFrags<MI> f;
        tc_load_frags<MI>(lane, As, lda, Bs, ldb, k0, f);
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int ni = 0; ni < TC_NI; ni++) {
                if constexpr (!PLAIN) {
                    mma_tf32(small[mi][ni], f.al[mi], f.bh[ni]);
                    mma_tf32(small[mi][ni], f.ah[mi], f.bl[ni]);
                }
                mma_tf32(big[mi][ni], f.ah[mi], f.bh[ni]);
            }
    }
}

// Tile t of the lower triangle (versions 3 and 4, syrk_lower), row by row: (0,0), (1,0), (1,1), (2,0), ...
__host__ __device__ inline void lower_tile(int t, int& bi, int& bj) {
    int i = (int)((sqrtf(8.0f * (float)t + 1.0f) - 1.0f) * 0.5f);
    while ((i + 1) * (i + 2) / 2 <= t) i++;  // float rounding of the square root, either way
    while (i * (i + 1) / 2 > t) i--;
    bi = i;
    bj = t - i * (i + 1) / 2;
}

// ----------------------------------------------------------------------------------------------------------------
// version 3: version 2's fused iteration on tensor cores. The same shared-memory matrices (row stride NP + 4: the A
// fragment reads hit 32 distinct banks, the B reads are two-way), 3xTF32 mma.sync, a warp per 16 x 32 unit of the
// lower triangle of each product, mirrored (every iterate is a symmetric polynomial in A: 20 units of 32 at
// NP = 128; the CPU twin measures what the mirroring costs, --study). 16-row units rather than 32 x 32 tiles: a
// block's warps share the SM's 4 sub-partitions, and the busiest one sets the time (10 units per block: 3 on the
// busiest, 1.5 tiles' work; 5 tiles of 32 x 32 would put 2 tiles on it). On sm_90 a cluster of CL = 2 blocks per
// matrix: each block keeps a full copy of X, M and T, computes half of the units of each product and writes them to
// its own and to its partner's shared memory (64 matrices fill 128 SMs). Both blocks compute the residual from
// identical copies in the same order, so they take the same decisions.
// FLOPs per step (p = 4, n = 128): 4 products of 20/32 x 2 n^3 = 10.5 MFLOP, 3 mma passes each.

template <int NP, int CL> struct V3Cfg {
    static_assert(NP % 32 == 0, "16 x 32 warp units");
    // row band r (16 rows) needs the column blocks c (32 columns) with 32 c <= 16 r + 15: r / 2 + 1 of them
    static constexpr int LD = NP + 4, BANDS = NP / 16, UNITS = BANDS / 2 * (BANDS / 2 + 1);
    static constexpr int WARPS = (UNITS + CL - 1) / CL, THREADS = WARPS * 32;  // a warp per unit of its block
    static constexpr size_t SMEM = 3ull * NP * LD * sizeof(float);
};

// unit u of the lower triangle, band by band: rows 16 r .. 16 r + 15, columns 32 c .. 32 c + 31
__host__ __device__ inline void v3_unit(int u, int& r, int& c) {
    r = 0;
    while (u >= r / 2 + 1) {
        u -= r / 2 + 1;
        r++;
    }
    c = u;
}

// a barrier over the blocks of one matrix: the block, or its cluster (sm_90; the host launches CL = 2 nowhere else)
template <int CL> __device__ __forceinline__ void v3_sync() {
    if constexpr (CL == 1) {
        __syncthreads();
    } else {
#if __CUDA_ARCH__ >= 900
        cg::this_cluster().sync();
#else
        __trap();
#endif
    }
}

// the partner block's address of this block's shared-memory pointer (CL = 2), else nullptr
template <int CL> __device__ __forceinline__ float* v3_partner(float* ptr, int rank) {
    if constexpr (CL == 1) {
        return nullptr;
    } else {
#if __CUDA_ARCH__ >= 900
        return cg::this_cluster().map_shared_rank(ptr, rank ^ 1);
#else
        __trap();
        return nullptr;
#endif
    }
}

// dst = A B (NP x NP in shared memory, k < kn summed: the padding is zero): this block's lower units, each element on
// or below the diagonal written to (i, j) and (j, i). dst may be A or B: every block of the matrix has read its
// operands (barrier) before anything is written. partner_dst: dst in the partner's shared memory (CL = 2).
template <int NP, int CL, bool DELTA = false>
__device__ void v3_matmul(const float* A, const float* B, float* dst, float* partner_dst, int n, int kn, int rank) {
    using C = V3Cfg<NP, CL>;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, unit = rank * C::WARPS + warp, br = 0, bc = 0;
    bool mine = unit < C::UNITS;
    if (mine) v3_unit(unit, br, bc);
    int row0 = br * 16, col0 = bc * 32;
    TcAcc<1> big = {}, small = {};
    if (mine && row0 < n) tc_warp_tile<1, 2, DELTA>(A + row0 * C::LD, C::LD, B + col0, C::LD, kn, big, small);
    v3_sync<CL>();
    if (mine) {
#pragma unroll
        for (int ni = 0; ni < TC_NI; ni++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                int i, j;
                tc_acc_coords(lane, 0, ni, r, i, j);
                i += row0;
                j += col0;
                if (i < j) continue;  // the upper element is its mirror's
                float v = DELTA ? dst[i * C::LD + j] + big[0][ni][r] : big[0][ni][r] + small[0][ni][r];
                dst[i * C::LD + j] = v;
                dst[j * C::LD + i] = v;
                if constexpr (CL > 1) {
                    partner_dst[i * C::LD + j] = v;
                    partner_dst[j * C::LD + i] = v;
                }
            }
    }
    v3_sync<CL>();
}

// One matrix per CL blocks (blockIdx.x / CL; rank blockIdx.x % CL: a 1-D grid's clusters are consecutive blocks).
// status[b] = steps taken, or -1 when the iteration left its convergence region.
template <int NP, int CL>
__global__ void __launch_bounds__(V3Cfg<NP, CL>::THREADS)
newton_tc_kernel(const float* A, float* X, int n, int p, float eps, int start, int* status, float* residual) {
    using C = V3Cfg<NP, CL>;
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[33];
    float *Xs = smem, *Ms = smem + NP * C::LD, *Ts = smem + 2 * NP * C::LD;
    int b = blockIdx.x / CL, rank = blockIdx.x % CL;
    float *pX = v3_partner<CL>(Xs, rank), *pM = v3_partner<CL>(Ms, rank), *pT = v3_partner<CL>(Ts, rank);
    long long nn = (long long)n * n;
    int kn = (n + 7) / 8 * 8;
    auto mul = [&](const float* P, const float* Q, float* dst) {  // dst: Xs, Ts or Ms, and the partner's copy
        v3_matmul<NP, CL>(P, Q, dst, dst == Xs ? pX : dst == Ts ? pT : pM, n, kn, rank);
    };
    auto last_x = [&]() {  // X <- X + X D, D = T - I, the product in plain TF32: its rounding is relative to ||D||
        for (int i = threadIdx.x; i < n; i += C::THREADS) Ts[i * C::LD + i] -= 1.0f;
        __syncthreads();
        v3_matmul<NP, CL, true>(Xs, Ts, Xs, pX, n, kn, rank);
    };
    NewtonState s = fused_newton<NP, C::LD, C::THREADS>(A + b * nn, Xs, Ms, Ts, n, p, eps, start, red, mul, last_x);
    for (int e = rank * C::THREADS + threadIdx.x; e < NP * NP; e += CL * C::THREADS) {  // the blocks share the store
        int i = e / NP, j = e % NP;                                                       // (by NP: no division by n)
        if (i < n && j < n) X[b * nn + i * n + j] = Xs[i * C::LD + j];
    }
    if (rank == 0 && threadIdx.x == 0) {
        status[b] = fused_status(s);
        residual[b] = (float)s.r;
    }
    v3_sync<CL>();  // no block leaves while its partner may still address its shared memory
}

template <int NP, int CL>
static const char* launch_v3(const float* A, float* X, int batch, int n, int p, float eps, int start, int* status,
                             float* res) {
    using C = V3Cfg<NP, CL>;
    static bool configured = false;
    static const char* why_not = nullptr;
    static char why_buf[200];
    auto kernel = newton_tc_kernel<NP, CL>;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CL;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(batch * CL);
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM;
    cfg.stream = g_stream;
    cfg.attrs = attr;
    cfg.numAttrs = CL > 1 ? 1 : 0;
    if (!configured) {
        cudaFuncAttributes fa;
        cudaCheck(cudaFuncGetAttributes(&fa, kernel));
        size_t need = C::SMEM + fa.sharedSizeBytes;
        if (CL > 1 && g_gpu.cc_major < 9) {
            why_not = "clusters of blocks need sm_90";
        } else if (need > g_gpu.smem_optin) {
            snprintf(why_buf, sizeof why_buf, "n <= %d needs %zu bytes of shared memory per block, this GPU allows %zu",
                     NP, need, g_gpu.smem_optin);
            why_not = why_buf;
        } else {
            cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
            int clusters = 1;
            if (CL > 1) cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
            if (clusters < 1) why_not = "no cluster of 2 blocks with this much shared memory fits this GPU";
        }
        configured = true;
    }
    if (why_not) return why_not;
    cudaCheck(cudaLaunchKernelEx(&cfg, kernel, A, X, n, p, eps, start, status, res));
    return nullptr;
}

// Returns nullptr, or why this size cannot run here. blocks_per_matrix: 0 = 2 where clusters exist (sm_90, n > 32),
// else 1; 1 = one block (the path of sm_80). Status and start as version 2's (newton_status, NewtonStart).
static const char* inv_root_v3(const float* A, float* X, int batch, int n, int p, float eps,
                               int blocks_per_matrix = 0, NewtonStart start = NEWTON_SCALED) {
    check_root_args("inv_root_v3", A, X, batch, n, p, eps);
    int* status = (int*)ws_get(WS_STATUS, batch * (sizeof(int) + sizeof(float)));
    float* res = (float*)(status + batch);
    bool pair = blocks_per_matrix != 1 && g_gpu.cc_major >= 9;
    if (n <= 32) return launch_v3<32, 1>(A, X, batch, n, p, eps, start, status, res);
    if (n <= 64) return pair ? launch_v3<64, 2>(A, X, batch, n, p, eps, start, status, res)
                             : launch_v3<64, 1>(A, X, batch, n, p, eps, start, status, res);
    if (n <= 128) return pair ? launch_v3<128, 2>(A, X, batch, n, p, eps, start, status, res)
                              : launch_v3<128, 1>(A, X, batch, n, p, eps, start, status, res);
    return "version 3 runs n <= 128 only";
}

// The scaled start alone, to time it (--bench's `v3 start`) and to check it against its twin (--test): one block per
// matrix loads A + eps I and runs fused_scaled_start in one of the shapes that run it (Lz23Shape: version 3's one
// block, the default; version 2's layout LD = NP + 1 and thread count; version 3's cluster thread count), so that
// every split of the products among the warps meets the twin. out: LANCZOS23_OUT doubles per matrix: k, z, lo,
// rowsum_max, then alpha[0 .. LANCZOS23_STEPS - 1] and beta[...] (entries from k on unset).
constexpr int LANCZOS23_OUT = 4 + 2 * LANCZOS23_STEPS;
enum Lz23Shape { LZ23_V3, LZ23_V2, LZ23_V3_PAIR };
template <int NP, int SHAPE> struct Lz23Cfg {
    static constexpr int LD = SHAPE == LZ23_V2 ? NP + 1 : V3Cfg<NP, 1>::LD;
    static constexpr int THREADS = SHAPE == LZ23_V2  ? v2_threads<NP>()
                                   : SHAPE == LZ23_V3 ? V3Cfg<NP, 1>::THREADS
                                                      : V3Cfg<NP, 2>::THREADS;
    static constexpr size_t SMEM = 3ull * NP * LD * sizeof(float);
};
template <int NP, int SHAPE>
__global__ void __launch_bounds__(Lz23Cfg<NP, SHAPE>::THREADS) lanczos23_start_kernel(const float* A, int n,
                                                                                      float eps, double* out) {
    using C = Lz23Cfg<NP, SHAPE>;
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[33];
    float *Xs = smem, *Ms = smem + NP * C::LD, *Ts = smem + 2 * NP * C::LD;
    fused_load<NP, C::LD, C::THREADS>(A + blockIdx.x * (long long)n * n, Ms, Xs, n, eps, red);
    LanczosStart fs = fused_scaled_start<NP, C::LD, C::THREADS>(n);
    double* o = out + blockIdx.x * LANCZOS23_OUT;
    const double* tri = lanczos23_tridiag<NP, C::LD>(Ts);
    if (threadIdx.x == 0) {
        o[0] = fs.k;
        o[1] = fs.z;
        o[2] = fs.lo;
        o[3] = fs.rowsum_max;
    }
    for (int j = threadIdx.x; j < fs.k; j += C::THREADS) {
        o[4 + j] = tri[j];
        o[4 + LANCZOS23_STEPS + j] = tri[LANCZOS23_STEPS + j];
    }
}

template <int NP, int SHAPE>
static const char* launch_lanczos23(const float* A, int batch, int n, float eps, double* out) {
    using C = Lz23Cfg<NP, SHAPE>;
    static bool configured = false;
    static const char* why_not = nullptr;
    static char why_buf[200];
    if (!configured) {
        cudaFuncAttributes fa;
        cudaCheck(cudaFuncGetAttributes(&fa, lanczos23_start_kernel<NP, SHAPE>));
        size_t need = C::SMEM + fa.sharedSizeBytes;
        if (need > g_gpu.smem_optin) {
            snprintf(why_buf, sizeof why_buf, "n <= %d needs %zu bytes of shared memory per block, this GPU allows %zu",
                     NP, need, g_gpu.smem_optin);
            why_not = why_buf;
        } else {
            cudaCheck(cudaFuncSetAttribute(lanczos23_start_kernel<NP, SHAPE>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
        }
        configured = true;
    }
    if (why_not) return why_not;
    lanczos23_start_kernel<NP, SHAPE><<<batch, C::THREADS, C::SMEM, g_stream>>>(A, n, eps, out);
    launchCheck();
    return nullptr;
}

// Versions 2 and 3's start for a batch (out: batch x LANCZOS23_OUT doubles on the device) in one of the shapes
// (--bench times LZ23_V3); nullptr or why not here.
static const char* lanczos23_start(const float* A, int batch, int n, float eps, double* out, int shape = LZ23_V3) {
    check_root_args("lanczos23_start", A, reinterpret_cast<float*>(out), batch, n, 1, eps);
    if (n > 128) return "versions 2 and 3 run n <= 128 only";
    if (shape == LZ23_V2) {
        if (n <= 32) return launch_lanczos23<32, LZ23_V2>(A, batch, n, eps, out);
        if (n <= 64) return launch_lanczos23<64, LZ23_V2>(A, batch, n, eps, out);
        return launch_lanczos23<128, LZ23_V2>(A, batch, n, eps, out);
    }
    if (shape == LZ23_V3_PAIR) {  // the cluster form runs n > 32 only (V3Cfg<32, 2> is one warp)
        if (n <= 32) return "version 3's 2-block cluster runs n > 32 only";
        if (n <= 64) return launch_lanczos23<64, LZ23_V3_PAIR>(A, batch, n, eps, out);
        return launch_lanczos23<128, LZ23_V3_PAIR>(A, batch, n, eps, out);
    }
    if (n <= 32) return launch_lanczos23<32, LZ23_V3>(A, batch, n, eps, out);
    if (n <= 64) return launch_lanczos23<64, LZ23_V3>(A, batch, n, eps, out);
    return launch_lanczos23<128, LZ23_V3>(A, batch, n, eps, out);
}

// ----------------------------------------------------------------------------------------------------------------
// version 4: the whole iteration of one matrix of any size in one cooperative kernel: blocks stay resident and meet
// at grid-wide barriers between the phases (the residual and T; the products), so no host decision and no launch
// per product. Each product computes only the 64 x 64 tiles of its lower triangle and mirrors them: every iterate is
// a symmetric polynomial in A (half the FLOPs; --study measures what the mirroring costs in accuracy). Products of a
// step that do not depend on each other share a phase (X T with T T); a phase of one product runs column halves of
// its tiles (as many work items). 3xTF32 mma.sync (above), 4 warps of 32 x 32 (16 x 32 for halves), 32-deep panels
// staged in shared memory through registers (the next panel's loads in flight during the mma).
// FLOPs per step (p = 4): 4 half products of 2 n^3 = 4.3 GFLOP at n = 1024, 3 mma passes each.

constexpr int V4_BT = 64, V4_BK = 32, V4_THREADS = 128, V4_LDA = V4_BK + 4, V4_LDB = V4_BT + 8, V4_SLOTS = 256;
static_assert(V4_BT * V4_BK % V4_THREADS == 0, "the panels split evenly over the threads");
static_assert(V4_LDA % 32 == 4 && V4_LDB % 32 == 8, "conflict-free A reads (g * lda + t) and B reads (t * ldb + g)");

struct V4Product { const float* A; const float* B; float* C; };

// ld.global.cg on the device (L2: other blocks wrote the operands during this kernel, and L1 is not coherent); the
// CPU emulation in --test runs the same index code with plain loads
__host__ __device__ __forceinline__ float load_cg(const float* p) {
#ifdef __CUDA_ARCH__
    return __ldcg(p);
#else
    return *p;
#endif
}

// One thread's share of a pair of panels: A rows row0 .. row0 + 63, B columns col0 .. col0 + COLS - 1, k0 .. k0 + 31
// (zero outside n). A: lanes along k, rows ai + q RA_STEP; B: lanes along the columns, rows bk + q RB_STEP.
template <int COLS> struct V4Panels {
    static constexpr int PER_A = V4_BT * V4_BK / V4_THREADS, PER_B = COLS * V4_BK / V4_THREADS;
    static constexpr int RA_STEP = V4_THREADS / V4_BK, RB_STEP = V4_THREADS / COLS;
    float ra[PER_A], rb[PER_B];
    __host__ __device__ __forceinline__ void fetch(const V4Product& pr, int n, int row0, int col0, int tid, int k0) {
        int ai = tid / V4_BK, ak = tid % V4_BK, bk = tid / COLS, cj = tid % COLS;
        const float* pa = pr.A + (long long)(row0 + ai) * n + k0 + ak;
        const float* pb = pr.B + (long long)(k0 + bk) * n + col0 + cj;
#pragma unroll
        for (int q = 0; q < PER_A; q++)
            ra[q] = row0 + ai + q * RA_STEP < n && k0 + ak < n ? load_cg(pa + (long long)q * RA_STEP * n) : 0.0f;
#pragma unroll
        for (int q = 0; q < PER_B; q++)
            rb[q] = k0 + bk + q * RB_STEP < n && col0 + cj < n ? load_cg(pb + (long long)q * RB_STEP * n) : 0.0f;
    }
    __host__ __device__ __forceinline__ void stash(int tid, float* As, float* Bs) const {
        int ai = tid / V4_BK, ak = tid % V4_BK, bk = tid / COLS, cj = tid % COLS;
#pragma unroll
        for (int q = 0; q < PER_A; q++) As[(ai + q * RA_STEP) * V4_LDA + ak] = ra[q];
#pragma unroll
        for (int q = 0; q < PER_B; q++) Bs[(bk + q * RB_STEP) * V4_LDB + cj] = rb[q];
    }
};

// warp's tile inside the block tile: COLS = 64, 2 x 2 warps of 32 x 32; COLS = 32, 4 stacked warps of 16 x 32.
// Returns false when it lies entirely above the diagonal (nothing to compute).
template <int COLS>
__host__ __device__ __forceinline__ bool v4_warp_tile(int warp, int row0, int col0, int& wr, int& wc) {
    constexpr int WM = COLS == 64 ? 32 : 16, WARPS_N = COLS / 32;
    wr = warp / WARPS_N * WM;
    wc = warp % WARPS_N * 32;
    return row0 + wr + WM - 1 >= col0 + wc;
}

// element (i, j) of the warp's tile (from tc_acc_coords) into C at (gi, gj) and (gj, gi), on and below the diagonal
__host__ __device__ __forceinline__ void v4_store(float* C, int n, int gi, int gj, float v) {
    if (gi >= n || gj >= n || gi < gj) return;  // the upper element is its mirror's
    C[(long long)gi * n + gj] = v;
    if (gi != gj) C[(long long)gj * n + gi] = v;
}

// Tile (bi, bj), bj <= bi, of C = A B (n x n, row-major), or (COLS = 32) its column half `half`: the elements on and
// below the diagonal, each written to (i, j) and (j, i). COLS = 64 for phases of two products; COLS = 32 for a
// single product (twice the work items, each element's arithmetic the same).
template <int COLS>
__device__ void v4_tile(const V4Product& pr, int n, int bi, int bj, int half, float* As, float* Bs) {
    static_assert(COLS == 64 || COLS == 32, "whole tiles or column halves");
    constexpr int MI = COLS == 64 ? 2 : 1;
    int row0 = bi * V4_BT, col0 = bj * V4_BT + half * COLS, warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr, wc;
    bool needed = v4_warp_tile<COLS>(warp, row0, col0, wr, wc);
    TcAcc<MI> big = {}, small = {};
    V4Panels<COLS> next;
    next.fetch(pr, n, row0, col0, threadIdx.x, 0);
    for (int k0 = 0; k0 < n; k0 += V4_BK) {
        __syncthreads();  // the previous panel is read
        next.stash(threadIdx.x, As, Bs);
        __syncthreads();
        if (k0 + V4_BK < n) next.fetch(pr, n, row0, col0, threadIdx.x, k0 + V4_BK);  // in flight during the mma
        int kn = min(V4_BK, (n - k0 + 7) / 8 * 8);
        if (needed) tc_warp_tile<MI, 1>(As + wr * V4_LDA, V4_LDA, Bs + wc, V4_LDB, kn, big, small);
    }
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < TC_NI; ni++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                int i, j;
                tc_acc_coords(lane, mi, ni, r, i, j);
                v4_store(pr.C, n, row0 + wr + i, col0 + wc + j, big[mi][ni][r] + small[mi][ni][r]);
            }
}

// The lower tiles of two products (whole tiles), or of one (second.C == nullptr: column halves), over the grid
__device__ void v4_phase(const V4Product& first, const V4Product& second, int n, float* As, float* Bs) {
    int tiles_1d = (n + V4_BT - 1) / V4_BT, tiles = tiles_1d * (tiles_1d + 1) / 2;
    for (int t = blockIdx.x; t < 2 * tiles; t += gridDim.x) {
        int bi, bj;
        lower_tile(t % tiles, bi, bj);
        if (second.C) v4_tile<64>(t < tiles ? first : second, n, bi, bj, 0, As, Bs);
        else v4_tile<32>(first, n, bi, bj, t / tiles, As, Bs);
    }
}

// *sum += the block's v (double)
__device__ void v4_block_add(double v, double* sum, double* red) {
    v = warp_sum_d(v);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int w = 0; w < V4_THREADS / 32; w++) s += red[w];
        atomicAdd(sum, s);
    }
    __syncthreads();
}

// One matrix (n x n). Buffers (n x n each): X (the output), Xb, M0, M1, T, P, Q; sums: V4_SLOTS zeros (slot 0
// ||A + eps I||_F^2, slot 1 + k the residual before step k). Every block takes the same decisions from the same sums.
__global__ void __launch_bounds__(V4_THREADS)
newton_coop_kernel(const float* A, float* X, float* Xb, float* M0, float* M1, float* T, float* P, float* Q,
                   double* sums, int n, int p, float eps, int* status, float* residual) {
    cg::grid_group grid = cg::this_grid();
    __shared__ __align__(16) float As[V4_BT * V4_LDA], Bs[V4_BK * V4_LDB];
    __shared__ double red[V4_THREADS / 32];
    long long nn = (long long)n * n, first = blockIdx.x * (long long)blockDim.x + threadIdx.x,
              stride = (long long)gridDim.x * blockDim.x;
    double sq = 0.0;
    for (long long e = first; e < nn; e += stride) {
        float v = A[e] + (e / n == e % n ? eps : 0.0f);
        sq += (double)v * v;
    }
    v4_block_add(sq, sums, red);
    grid.sync();
    double z = (p + 1) / (2.0 * sqrt(__ldcg(sums)));  // as version 1's newton_init_kernel
    for (long long e = first; e < nn; e += stride) {
        bool diag = e / n == e % n;
        M0[e] = (float)z * (A[e] + (diag ? eps : 0.0f));
        X[e] = diag ? (float)pow(z, 1.0 / p) : 0.0f;
    }
    NewtonState s;
    s.n = n;
    s.p = p;
    s.max_iter = min(newton_max_iter(p, z * eps), V4_SLOTS - 2);
    float *Xc = X, *Xn = Xb, *Mc = M0, *Mn = M1, inv_p = 1.0f / (float)p, diag_t = (float)(p + 1);
    for (;;) {
        grid.sync();  // M (and X) complete
        double r2 = 0.0;
        for (long long e = first; e < nn; e += stride) {
            bool diag = e / n == e % n;
            float m = __ldcg(Mc + e), d = m - (diag ? 1.0f : 0.0f);
            r2 += (double)d * d;
            T[e] = ((diag ? diag_t : 0.0f) - m) * inv_p;
        }
        v4_block_add(r2, sums + 1 + s.iters, red);
        grid.sync();
        NewtonAction act = newton_decide(s, sqrt(__ldcg(sums + 1 + s.iters)));
        if (act == NEWTON_FAIL) break;
        V4Product none{nullptr, nullptr, nullptr}, other = p == 1 ? V4Product{T, Mc, Mn} : V4Product{T, T, P};
        v4_phase(V4Product{Xc, T, Xn}, act == NEWTON_LAST ? none : other, n, As, Bs);  // X T; T M or T T
        float* tmp = Xc;
        Xc = Xn;
        Xn = tmp;
        if (act == NEWTON_LAST) break;
        if (p >= 2) {
            grid.sync();
            V4Product next = p == 2 ? V4Product{P, Mc, Mn} : V4Product{P, P, Q};  // T^2 M, or (T^2)^2
            v4_phase(next, V4Product{nullptr, nullptr, nullptr}, n, As, Bs);
        }
        if (p == 4) {
            grid.sync();
            v4_phase(V4Product{Q, Mc, Mn}, V4Product{nullptr, nullptr, nullptr}, n, As, Bs);  // T^4 M
        }
        tmp = Mc;
        Mc = Mn;
        Mn = tmp;
        s.iters++;
    }
    if (Xc != X) {  // the result sits in the workspace
        grid.sync();
        for (long long e = first; e < nn; e += stride) X[e] = __ldcg(Xc + e);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        status[0] = s.failed ? -1 : s.iters;
        residual[0] = (float)s.r;
    }
}

// Returns nullptr, or why it cannot run here. One cooperative launch per matrix of the batch; status as version 2's
// (newton_status).
static const char* inv_root_v4(const float* A, float* X, int batch, int n, int p, float eps) {
    check_root_args("inv_root_v4", A, X, batch, n, p, eps);
    static int blocks_per_sm = -1;
    int coop = 0, dev = 0;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    if (!coop) return "this GPU has no cooperative launch";
    if (blocks_per_sm < 0)
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, newton_coop_kernel, V4_THREADS, 0));
    if (blocks_per_sm < 1) return "version 4's block does not fit an SM";
    long long nn = (long long)n * n, bytes = nn * sizeof(float);
    float* Xb = (float*)ws_get(WS_W, bytes);
    float* M0 = (float*)ws_get(WS_M, bytes);
    float* M1 = (float*)ws_get(WS_A3, bytes);
    float* T = (float*)ws_get(WS_T, bytes);
    float* P = (float*)ws_get(WS_T2, bytes);
    float* Q = (float*)ws_get(WS_B3, bytes);
    double* sums = (double*)ws_get(WS_COOP_SUMS, (size_t)batch * V4_SLOTS * sizeof(double));
    int* status = (int*)ws_get(WS_STATUS, batch * (sizeof(int) + sizeof(float)));
    float* res = (float*)(status + batch);
    cudaCheck(cudaMemsetAsync(sums, 0, (size_t)batch * V4_SLOTS * sizeof(double), g_stream));
    // enough blocks for a phase of two products, at least one per SM, at most what stays resident
    long long tiles_1d = ceil_div_ll(n, V4_BT), tiles = tiles_1d * (tiles_1d + 1) / 2;
    int grid = (int)std::min<long long>((long long)blocks_per_sm * g_gpu.sms, std::max<long long>(2 * tiles,
                                                                                                  g_gpu.sms));
    for (int b = 0; b < batch; b++) {
        const float* Ab = A + b * nn;
        float* Xo = X + b * nn;
        double* sb = sums + (size_t)b * V4_SLOTS;
        int* st = status + b;
        float* rb = res + b;
        void* args[] = {(void*)&Ab, (void*)&Xo, (void*)&Xb, (void*)&M0, (void*)&M1, (void*)&T, (void*)&P, (void*)&Q,
                        (void*)&sb, (void*)&n, (void*)&p, (void*)&eps, (void*)&st, (void*)&rb};
        cudaCheck(cudaLaunchCooperativeKernel((void*)newton_coop_kernel, grid, V4_THREADS, args, 0, g_stream));
    }
    return nullptr;
}

// ----------------------------------------------------------------------------------------------------------------
// Newton-Schulz (Muon) on cuBLAS: X in bf16 (r x c, r = min(m, n)), every product with bf16 operands and fp32
// accumulation (GemmEx, CUBLAS_COMPUTE_32F), the b/c and a combinations folded into the GEMMs' alpha and beta.

__global__ void ns_prepare_kernel(const float* G, __nv_bfloat16* X, const double* sums, int m, int n, bool tall,
                                  long long total) {
    long long mn = (long long)m * n;
    int c = tall ? m : n;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long b = idx / mn, e = idx % mn, i = e / c, j = e % c;  // X[b][i][j]
        float g = tall ? G[b * mn + j * n + i] : G[b * mn + i * n + j];
        float scale = (float)(1.0 / (sqrt(sums[b]) + 1e-7));
        X[idx] = __float2bfloat16_rn(g * scale);
    }
}

__global__ void ns_finish_kernel(const __nv_bfloat16* X, float* out, int m, int n, bool tall, long long total) {
    long long mn = (long long)m * n;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long b = idx / mn, e = idx % mn, i = e / n, j = e % n;  // out[b][i][j]
        out[idx] = __bfloat162float(tall ? X[b * mn + j * m + i] : X[b * mn + i * n + j]);
    }
}

static void bf16_gemm(cublasOperation_t ta, int M, int N, int K, float alpha, const __nv_bfloat16* A, int lda,
                      long long sa, const __nv_bfloat16* B, int ldb, long long sb, float beta, __nv_bfloat16* C,
                      int ldc, long long sc, int batch) {
    cublasCheck(cublasGemmStridedBatchedEx(g_gpu.blas, ta, CUBLAS_OP_N, M, N, K, &alpha, A, CUDA_R_16BF, lda, sa, B,
                                           CUDA_R_16BF, ldb, sb, &beta, C, CUDA_R_16BF, ldc, sc, batch,
                                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// out_b = NS5(G_b) for a batch of m x n row-major fp32 matrices (out fp32, rounded from the bf16 iterate); steps
// other than Muon's 5 for dev/torch_ops's newton_schulz operator.
static void newton_schulz(const float* G, float* out, int batch, int m, int n, int steps = NS_STEPS) {
    if (m < 1 || n < 1) fail_arg("newton_schulz", m < 1 ? "m" : "n", m < 1 ? m : n, ">= 1");
    if (steps < 0) fail_arg("newton_schulz", "steps", steps, ">= 0");
    if (batch < 1 || batch > 65535) fail_arg("newton_schulz", "batch", batch, "in [1, 65535]");
    if (!G || !out || G == out) { fprintf(stderr, "newton_schulz: G and out must be distinct buffers\n"); exit(1); }
    bool tall = m > n;
    int r = tall ? n : m, c = tall ? m : n;
    long long rc = (long long)r * c, rr = (long long)r * r;
    __nv_bfloat16* X = (__nv_bfloat16*)ws_get(WS_NS_X, rc * batch * sizeof(__nv_bfloat16));
    __nv_bfloat16* Xn = (__nv_bfloat16*)ws_get(WS_NS_XN, rc * batch * sizeof(__nv_bfloat16));
    __nv_bfloat16* A = (__nv_bfloat16*)ws_get(WS_NS_A, rr * batch * sizeof(__nv_bfloat16));
    __nv_bfloat16* B = (__nv_bfloat16*)ws_get(WS_NS_B, rr * batch * sizeof(__nv_bfloat16));
    double* sums = (double*)ws_get(WS_SUMS, batch * sizeof(double));
    sumsq(G, sums, nullptr, batch, rc, n, 1, 0.0f);
    ns_prepare_kernel<<<grid_for(rc * batch, 256), 256, 0, g_stream>>>(G, X, sums, m, n, tall, rc * batch);
    launchCheck();
    // a row-major buffer read as column-major is the transpose, so a row-major P Q is the column-major Q^T P^T:
    // cuBLAS gets the operands swapped (A = X X^T: op_T(X^T) X^T; A A; B X: X^T B^T), alpha and beta fold in the
    // coefficients on copies (B starts as A: c A A + b A; Xn starts as X: B X + a X)
    for (int step = 0; step < steps; step++) {
        bf16_gemm(CUBLAS_OP_T, r, r, c, 1.0f, X, c, rc, X, c, rc, 0.0f, A, r, rr, batch);
        cudaCheck(cudaMemcpyAsync(B, A, rr * batch * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, g_stream));
        bf16_gemm(CUBLAS_OP_N, r, r, r, (float)NS_C, A, r, rr, A, r, rr, (float)NS_B, B, r, rr, batch);
        cudaCheck(cudaMemcpyAsync(Xn, X, rc * batch * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, g_stream));
        bf16_gemm(CUBLAS_OP_N, c, r, r, 1.0f, X, c, rc, B, r, rr, (float)NS_A, Xn, c, rc, batch);
        std::swap(X, Xn);
    }
    ns_finish_kernel<<<grid_for(rc * batch, 256), 256, 0, g_stream>>>(X, out, m, n, tall, rc * batch);
    launchCheck();
}

// ----------------------------------------------------------------------------------------------------------------
// Kronecker statistics: C_b = beta C_b + alpha P_b P_b^T (N x N, row-major, symmetric on entry: only its lower
// triangle is read; beta = 0 never reads it). A SYRK-like kernel: 64x64 output tiles of the lower triangle only (one
// block each, T (T + 1) / 2 for T = ceil(N / 64)), 16-deep k panels in shared memory, 4x4 outputs per thread in fp32
// FMA; each lower element is written to both (i, j) and (j, i). The loaders say what P is.

constexpr int SY_BT = 64, SY_BK = 16, SY_THREADS = 256, SY_LDS = SY_BT + 4;

// P[i][k] = p[b * batch_stride + i * ld + k]: the rows of a row-major matrix (Shampoo's L = G G^T)
struct RowsLoader {
    const float* p;
    long long batch_stride;
    int ld;
    static constexpr bool CONTIG_K = true;
    __device__ float operator()(int b, int i, int k) const { return p[b * batch_stride + (long long)i * ld + k]; }
};
// P[i][k] = p[b * batch_stride + k * ld + i]: the columns (Shampoo's R = G^T G; K-FAC's factors from a samples x
// features matrix). With bias, feature ld is a constant 1 (K-FAC's homogeneous coordinate for the bias).
struct ColsLoader {
    const float* p;
    long long batch_stride;
    int ld;
    static constexpr bool CONTIG_K = false;
    __device__ float operator()(int b, int i, int k) const {
        return i == ld ? 1.0f : p[b * batch_stride + (long long)k * ld + i];
    }
};
// P[f][pos]: the 3x3 patches of an NHWC input x (B, H, W, C), stride 1, zero padding pad, feature f = (ky * 3 + kx)
// * C + c (train_mnist's im2col order), position pos = (b * OH + oy) * OW + ox; feature 9 C is the bias's 1.
struct Im2colLoader {
    const float* x;
    int H, W, C, pad, OH, OW;
    static constexpr bool CONTIG_K = false;
    __device__ float operator()(int, int f, int pos) const {
        if (f == 9 * C) return 1.0f;
        int img = pos / (OH * OW), rem = pos % (OH * OW), oy = rem / OW, ox = rem % OW;
        int tap = f / C, c = f % C, iy = oy + tap / 3 - pad, ix = ox + tap % 3 - pad;
        if (iy < 0 || iy >= H || ix < 0 || ix >= W) return 0.0f;
        return x[(((long long)img * H + iy) * W + ix) * C + c];
    }
};

template <typename Loader>
__device__ void syrk_load_panels(const Loader& P, float* As, float* Bs, int b, int row0, int col0, int k0, int N,
                                 int K) {
#pragma unroll
    for (int r = 0; r < SY_BT * SY_BK / SY_THREADS; r++) {
        // coalesced along P's contiguous index: 16 lanes per row when k is contiguous, 64 rows otherwise
        int e = threadIdx.x + r * SY_THREADS;
        int ii = Loader::CONTIG_K ? e / SY_BK : e % SY_BT, kk = Loader::CONTIG_K ? e % SY_BK : e / SY_BT;
        int k = k0 + kk, ia = row0 + ii, ib = col0 + ii;
        As[kk * SY_LDS + ii] = (ia < N && k < K) ? P(b, ia, k) : 0.0f;
        Bs[kk * SY_LDS + ii] = (ib < N && k < K) ? P(b, ib, k) : 0.0f;
    }
}

template <typename Loader>
__global__ void __launch_bounds__(SY_THREADS)
syrk_lower_kernel(Loader P, float* C, long long c_stride, int N, int K, float alpha, float beta) {
    __shared__ float As[SY_BK * SY_LDS], Bs[SY_BK * SY_LDS];
    int bi, bj;
    lower_tile(blockIdx.x, bi, bj);
    int b = blockIdx.y, row0 = bi * SY_BT, col0 = bj * SY_BT;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // outputs (row0 + ty + 16 i, col0 + tx + 16 j)
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += SY_BK) {
        syrk_load_panels(P, As, Bs, b, row0, col0, k0, N, K);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < SY_BK; kk++) {
            float a[4], v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = As[kk * SY_LDS + ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = Bs[kk * SY_LDS + tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], v[j], acc[i][j]);
        }
        __syncthreads();
    }
    float* c = C + b * c_stride;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int gi = row0 + ty + 16 * i, gj = col0 + tx + 16 * j;
            if (gi >= N || gj >= N || gi < gj) continue;  // the upper element is its mirror's
            float val = alpha * acc[i][j];
            if (beta != 0.0f) val = fmaf(beta, c[(long long)gi * N + gj], val);
            c[(long long)gi * N + gj] = val;
            if (gi != gj) c[(long long)gj * N + gi] = val;
        }
}

template <typename Loader>
static void syrk_lower(const Loader& P, float* C, int batch, int N, int K, float alpha, float beta) {
    if (N < 1) fail_arg("syrk_lower", "N", N, ">= 1");
    if (K < 0) fail_arg("syrk_lower", "K", K, ">= 0");
    if (batch < 1 || batch > 65535) fail_arg("syrk_lower", "batch", batch, "in [1, 65535]");
    if (!C) { fprintf(stderr, "syrk_lower: argument C is null\n"); exit(EXIT_FAILURE); }
    long long tiles = (long long)ceil_div_ll(N, SY_BT) * (ceil_div_ll(N, SY_BT) + 1) / 2;
    if (tiles > INT32_MAX) fail_arg("syrk_lower", "N", N, "small enough for 2^31 tiles");
    syrk_lower_kernel<Loader><<<dim3((unsigned)tiles, batch), SY_THREADS, 0, g_stream>>>(P, C, (long long)N * N, N, K,
                                                                                       alpha, beta);
    launchCheck();
}

// Shampoo: L_b = beta L_b + alpha G_b G_b^T (m x m), R_b = beta R_b + alpha G_b^T G_b (n x n), G_b m x n row-major.
// Sums: alpha = beta = 1; running averages: beta = beta2, alpha = 1 - beta2.
static void shampoo_stats(const float* G, float* L, float* R, int batch, int m, int n, float alpha, float beta) {
    if (!G) { fprintf(stderr, "shampoo_stats: argument G is null\n"); exit(EXIT_FAILURE); }
    syrk_lower(RowsLoader{G, (long long)m * n, n}, L, batch, m, n, alpha, beta);
    syrk_lower(ColsLoader{G, (long long)m * n, n}, R, batch, n, m, alpha, beta);
}

static void check_decay(const char* fn, float decay) {
    if (!(decay >= 0.0f && decay < 1.0f)) {
        fprintf(stderr, "%s: argument decay = %g, expected in [0, 1)\n", fn, decay);
        exit(EXIT_FAILURE);
    }
}

// K-FAC, linear layer: A = decay A + (1 - decay) E[a a^T] over the B rows of a (B x d), a extended by a 1 when bias
// (A is (d + bias) x (d + bias)). decay = 0: the batch's estimate alone (A not read).
static void kfac_linear_stats(const float* a, float* A, int B, int d, bool bias, float decay) {
    check_decay("kfac_linear_stats", decay);
    if (B < 1 || d < 1 || !a) { fprintf(stderr, "kfac_linear_stats: B = %d, d = %d, a %s\n", B, d, a ? "" : "null");
                                exit(EXIT_FAILURE); }
    syrk_lower(ColsLoader{a, 0, d}, A, 1, d + (bias ? 1 : 0), B, (1.0f - decay) / B, decay);
}

// K-FAC, 3x3 convolution (stride 1, padding pad) on an NHWC input x (B, H, W, C): A = decay A + (1 - decay) E[a a^T]
// over the B * OH * OW patches a (9 C features, + 1 with bias), read from x in place (no im2col buffer).
static void kfac_conv_stats(const float* x, float* A, int B, int H, int W, int C, int pad, bool bias, float decay) {
    check_decay("kfac_conv_stats", decay);
    int OH = H + 2 * pad - 2, OW = W + 2 * pad - 2;
    if (B < 1 || C < 1 || (pad != 0 && pad != 1) || OH < 1 || OW < 1 || !x) {
        fprintf(stderr, "kfac_conv_stats: B = %d, H = %d, W = %d, C = %d, pad = %d: expected B, C >= 1, pad 0 or 1, "
                "an output of at least 1x1, x not null\n", B, H, W, C, pad);
        exit(EXIT_FAILURE);
    }
    long long positions = (long long)B * OH * OW;
    if (positions > INT32_MAX) fail_arg("kfac_conv_stats", "B * OH * OW", positions, "< 2^31");
    syrk_lower(Im2colLoader{x, H, W, C, pad, OH, OW}, A, 1, 9 * C + (bias ? 1 : 0), (int)positions,
               (float)((1.0 - decay) / positions), decay);
}

// K-FAC, output gradients: G = decay G + (1 - decay) E[g g^T] over the rows of g (rows x d): samples for a linear
// layer, samples x positions for a convolution (NHWC gradients). The scale between the two factors (K-FAC's
// convention for convolutions) is the optimizer's choice, not this kernel's.
static void kfac_grad_stats(const float* g, float* G, int rows, int d, float decay) {
    check_decay("kfac_grad_stats", decay);
    if (rows < 1 || d < 1 || !g) { fprintf(stderr, "kfac_grad_stats: rows = %d, d = %d\n", rows, d); exit(1); }
    syrk_lower(ColsLoader{g, 0, d}, G, 1, d, rows, (1.0f - decay) / rows, decay);
}

// row-major C[i][j] = C[j][i] for i < j: the upper triangle from the lower one
__global__ void mirror_lower_kernel(float* C, int N, long long total) {
    long long nn = (long long)N * N;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long b = idx / nn, e = idx % nn, i = e / N, j = e % N;
        if (i < j) C[idx] = C[b * nn + j * N + i];
    }
}

// cuBLAS baseline of shampoo_stats: strict-fp32 syrk of the row-major lower triangle (column-major upper), then the
// mirror; cuBLAS has no batched syrk, so one call per matrix.
static void shampoo_stats_cublas(const float* G, float* L, float* R, int batch, int m, int n, float alpha,
                                 float beta) {
    long long mn = (long long)m * n, mm = (long long)m * m, nn = (long long)n * n;
    for (int b = 0; b < batch; b++) {
        // the row-major G buffer is the column-major n x m matrix G^T: G G^T = op_T(G^T) op_T(G^T)^T
        cublasCheck(cublasSsyrk(g_gpu.blas, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_T, m, n, &alpha, G + b * mn, n, &beta,
                                L + b * mm, m));
        cublasCheck(cublasSsyrk(g_gpu.blas, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N, n, m, &alpha, G + b * mn, n, &beta,
                                R + b * nn, n));
    }
    mirror_lower_kernel<<<grid_for(mm * batch, 256), 256, 0, g_stream>>>(L, m, mm * batch);
    launchCheck();
    mirror_lower_kernel<<<grid_for(nn * batch, 256), 256, 0, g_stream>>>(R, n, nn * batch);
    launchCheck();
}

#ifndef DEV_KERNELS_ONLY  // dev/torch_ops includes this file for the kernels and launchers above: the study, the
                          // tests, the benchmark and main stay out

// ----------------------------------------------------------------------------------------------------------------
// --study (CPU only): how the iterations behave in each precision, against the oracle. Its output is the
// measurement behind the tolerances and the precision choices (dev/matrix_roots_NOTES.md).

struct SpdCase { const char* name; double kappa; int zeros_div; };  // zeros_div > 0: n / zeros_div zero eigenvalues
static const SpdCase SPD_CASES[] = {{"kappa 1", 1.0, 0}, {"kappa 1e2", 1e2, 0}, {"kappa 1e4", 1e4, 0},
                                    {"kappa 1e6", 1e6, 0}, {"singular", 1e2, 4}};

constexpr double STUDY_TF32_BELOW = 0.1;  // --study: ||M - I||_F below which the I + D form runs in TF32

// One --study cell: the CPU twin in prec on A, against the oracle o; prints "rel err, residual, steps, flag" and
// returns the ratios to the tolerance of method (a failed run's relative error counts as infinite)
struct StudyCell { NewtonState s; double rel, res; };
static StudyCell study_cell(int n, int p, float eps, const MatF& A, const RootOracle& o, Prec prec, bool lower,
                            NewtonStart start, RootMethod method, double tf32_below = 0.0, int* fast = nullptr,
                            bool print = true) {
    MatF X((size_t)n * n);
    NewtonState s = newton_cpu(n, p, eps, A.data(), X.data(), prec, 0, lower, tf32_below, fast, start);
    double e = rel_err(X.size(), X.data(), o.X.data());
    double res = root_residual(n, p, X.data(), A.data(), eps);
    if (print)
        printf(" | %7.1e %7.1e %3d%s", e, res, s.iters,
               s.failed ? "F" : s.fell_back ? "b" : s.converged ? " " : "s");
    RootTol t = root_tolerance(method, n, p, o.lmax / o.lmin);
    return {s, s.failed ? INFINITY : e / t.rel, res / t.res};
}
static void keep_worst(double worst[2], const StudyCell& c) {
    worst[0] = std::max(worst[0], c.rel);
    worst[1] = std::max(worst[1], c.res);
}

// Newton-Schulz on G in float64 (xd) and as the bf16 twin (xe), with the singular values of G, xd and xe (ascending)
// and ||G||_F^2: what --study prints and --test checks
struct NsPair { std::vector<double> xd, xe, sg, sd, se; double fro = 0.0; };
static NsPair ns_pair(int m, int n, const MatF& G) {
    NsPair r;
    std::vector<double> gd(G.begin(), G.end());
    ns_cpu<false>(m, n, G.data(), r.xd);
    ns_cpu<true>(m, n, G.data(), r.xe);
    r.sg = singular_values(m, n, gd.data());
    r.sd = singular_values(m, n, r.xd.data());
    r.se = singular_values(m, n, r.xe.data());
    for (double v : r.sg) r.fro += v * v;
    return r;
}

// --study's Newton-Schulz part: the bf16 twin against the float64 run, and where each maps the singular values
static void study_newton_schulz(Rng& rng) {
    printf("\nNewton-Schulz, bf16 emulation vs float64: rel err, singular values of both (min, max)\n");
    struct { int m, n; double kappa; } shapes[] = {{37, 53, 1e2}, {100, 30, 1e2}, {64, 64, 1e2}, {96, 96, 1e3},
                                                   {128, 64, 10}, {64, 64, 0}, {48, 160, 0}};
    for (auto& sh : shapes) {
        MatF G((size_t)sh.m * sh.n);
        if (sh.kappa > 0) G = make_with_singular_values(sh.m, sh.n, sh.kappa, rng);
        else for (auto& v : G) v = (float)rng.normal();
        NsPair r = ns_pair(sh.m, sh.n, G);
        const std::vector<double>&xd = r.xd, &xe = r.xe, &sg = r.sg, &sd = r.sd, &se = r.se;
        const double fro = r.fro;
        printf("%4dx%-4d kappa %-6.0e input s/||G|| [%.1e, %.2f]: rel err %.2e; float64 [%.3f, %.3f], bf16 [%.3f, "
               "%.3f]\n", sh.m, sh.n, sh.kappa, sg.front() / std::sqrt(fro), sg.back() / std::sqrt(fro),
               rel_err(xe.size(), xe.data(), xd.data()), sd.front(), sd.back(), se.front(), se.back());
    }
}

static int run_study(uint64_t seed) {
    printf("coupled Newton, CPU twin: rel err vs the float64 oracle / residual ||X^p A - I||_F / sqrt(n) / steps "
           "(fast-phase steps), A with lambda_max = 1\n");
    printf("(unscaled steps: version 4, version 1's batches; the scaled columns: versions 2 and 3, Lanczos start, "
           "'b' = fell back to the unscaled rerun)\n");
    printf("%-4s %-3s %-10s %-7s %-7s | %-23s | %-23s | %-23s | %-23s | %-23s | %-23s | %-23s | %-23s | %-23s | "
           "%-23s | %-23s\n", "n", "p", "case", "eps", "kap_eff", "fp32", "3xtf32", "tf32", "bf16", "fp32 lower",
           "3xtf32 2acc", "2acc lower (v4)", "fp32 scaled (v2)", "2acc lower scaled (v3)", "3xtf32 scaled (v1)",
           "3xtf32 lower scaled (v1)");
    Rng rng{seed};
    double worst[4][2] = {};  // fp32, 3xtf32: max rel err / tol and residual / tol
    double extra_worst[3][2] = {};  // fp32 lower, 3xtf32 2acc, 3xtf32 2acc lower
    double delta_worst[2] = {};     // 3xtf32 2acc lower with TF32 steps in the I + D form near convergence
    // fp32, 3xtf32 2acc lower, 3xtf32 (v1), 3xtf32 lower (v1) scaled: rel err / tol, residual / tol
    double scaled_worst[4][2] = {};
    int scaled_steps[4][2] = {};  // the same four: steps scaled, unscaled (summed over the cases)
    int delta_steps[2] = {};        // TF32 steps, all steps
    double v1_delta_worst[2] = {};  // version 1 (3xtf32, scaled) with its I + D steps below V1_DELTA_BELOW
    int v1_delta_steps[2] = {};
    for (int n : {32, 96})
        for (const SpdCase& c : SPD_CASES)
            for (float eps : {1e-6f, 1e-3f}) {
                MatF A = make_spd(n, c.kappa, c.zeros_div ? n / c.zeros_div : 0, rng);
                for (int p : {1, 2, 4}) {
                    RootOracle o = oracle_inv_root(n, A.data(), eps, p);
                    printf("%-4d %-3d %-10s %-7.0e %-7.1e", n, p, c.name, eps, o.lmax / o.lmin);
                    for (Prec prec : {PREC_FP32, PREC_3XTF32, PREC_TF32, PREC_BF16}) {
                        StudyCell r = study_cell(n, p, eps, A, o, prec, false, NEWTON_UNSCALED,
                                                 prec == PREC_FP32 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32);
                        keep_worst(worst[prec], r);
                        if (prec == PREC_FP32) scaled_steps[0][1] += r.s.iters + 1;
                        if (prec == PREC_3XTF32) scaled_steps[2][1] += r.s.iters + 1;
                        if (prec == PREC_3XTF32) scaled_steps[3][1] += r.s.iters + 1;
                    }
                    // versions 3 and 4's arithmetic: two accumulators, lower-triangle products mirrored
                    for (int x = 0; x < 3; x++) {
                        StudyCell r = study_cell(n, p, eps, A, o, x == 0 ? PREC_FP32 : PREC_3XTF32_2ACC, x != 1,
                                                 NEWTON_UNSCALED, x == 0 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32);
                        keep_worst(extra_worst[x], r);
                        if (x == 2) scaled_steps[1][1] += r.s.iters + 1;
                    }
                    // versions 2 (fp32), 3 (2acc lower) and 1 (3xtf32, its own Lanczos; full products and
                    // lower-triangle ones, V1_LOWER) since scaled steps
                    for (int x = 0; x < 4; x++) {
                        Prec prec = x == 0 ? PREC_FP32 : x == 1 ? PREC_3XTF32_2ACC : PREC_3XTF32;
                        StudyCell r = study_cell(n, p, eps, A, o, prec, x == 1 || x == 3,
                                                 x >= 2 ? NEWTON_SCALED_V1 : NEWTON_SCALED,
                                                 x == 0 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32);
                        keep_worst(scaled_worst[x], r);
                        scaled_steps[x][0] += r.s.iters + 1 + r.s.discarded;
                    }
                    int fast = 0;
                    StudyCell r = study_cell(n, p, eps, A, o, PREC_3XTF32_2ACC, true, NEWTON_UNSCALED,
                                             METHOD_NEWTON_3XTF32, STUDY_TF32_BELOW, &fast, false);
                    keep_worst(delta_worst, r);
                    delta_steps[0] += fast;
                    delta_steps[1] += r.s.iters + 1;
                    fast = 0;
                    r = study_cell(n, p, eps, A, o, PREC_3XTF32, false, NEWTON_SCALED_V1, METHOD_NEWTON_3XTF32,
                                   V1_DELTA_BELOW, &fast, false);
                    keep_worst(v1_delta_worst, r);
                    v1_delta_steps[0] += fast;
                    v1_delta_steps[1] += r.s.iters + 1 + r.s.discarded;
                    printf("\n");
                    fflush(stdout);
                }
            }
    for (Prec prec : {PREC_FP32, PREC_3XTF32})
        printf("worst over these cases, %s: rel err / tolerance %.3f, residual / tolerance %.3f\n", prec_name(prec),
               worst[prec][0], worst[prec][1]);
    printf("worst over these cases, 3xtf32 2acc lower, steps below ||M - I||_F = %g in TF32 as I + D: rel err / "
           "tolerance %.3f, residual / tolerance %.3f; %d of %d steps in TF32\n", STUDY_TF32_BELOW, delta_worst[0],
           delta_worst[1], delta_steps[0], delta_steps[1]);
    printf("worst over these cases, 3xtf32 scaled, version 1 with its I + D steps (MATRIX_ROOTS_V1=delta) below "
           "||M - I||_F = %g: rel err / tolerance %.3f, residual / tolerance %.3f; %d of %d steps as I + D\n",
           V1_DELTA_BELOW, v1_delta_worst[0], v1_delta_worst[1], v1_delta_steps[0], v1_delta_steps[1]);
    const char* extra_names[3] = {"fp32 lower (fp32 tol)", "3xtf32 2acc full products (3xtf32 tol)",
                                  "3xtf32 2acc lower, versions 3 and 4 (3xtf32 tol)"};
    for (int x = 0; x < 3; x++)
        printf("worst over these cases, %s: rel err / tolerance %.3f, residual / tolerance %.3f\n", extra_names[x],
               extra_worst[x][0], extra_worst[x][1]);
    const char* scaled_names[4] = {"fp32 scaled, version 2 (fp32 tol)",
                                   "3xtf32 2acc lower scaled, version 3 (3xtf32 tol)",
                                   "3xtf32 scaled, version 1 (3xtf32 tol)",
                                   "3xtf32 lower scaled, version 1 lower (3xtf32 tol)"};
    for (int x = 0; x < 4; x++)
        printf("worst over these cases, %s: rel err / tolerance %.3f, residual / tolerance %.3f; steps (incl. the "
               "last X step and a fallback's) %d scaled against %d unscaled\n", scaled_names[x], scaled_worst[x][0],
               scaled_worst[x][1], scaled_steps[x][0], scaled_steps[x][1]);
    study_newton_schulz(rng);
    return 0;
}

// ----------------------------------------------------------------------------------------------------------------
// --test, CPU part (runs everywhere, CI included): the oracle, the CPU twins with the GPU versions' tolerances, the
// Newton-Schulz references, the statistics oracle.

static void test_oracle(Rng& rng) {
    // Jacobi on a float64 matrix of known spectrum: eigenvalues to 1e-12 lambda_max (the float64 A already carries
    // 1e-16 relative rounding, which Jacobi does not amplify), the root to u_64 kappa (conditioning) with margin
    for (double kappa : {1e2, 1e6}) {
        int n = 40, p = 4;
        MatD A, Q;
        std::vector<double> d;
        make_spd(n, kappa, 0, rng, &A, &Q, &d);
        std::vector<double> w;
        MatD V;
        int sweeps = jacobi_eigh(n, A, w, V);
        std::vector<double> ds(d);
        std::sort(ds.begin(), ds.end());
        std::sort(w.begin(), w.end());
        double worst = 0.0;
        for (int i = 0; i < n; i++) worst = std::max(worst, std::fabs(w[i] - ds[i]));
        report(sweeps > 0 && worst <= 1e-12, fmt("oracle Jacobi eigenvalues n=%d kappa %.0e", n, kappa),
               fmt("%d sweeps, max |lambda - exact| = %.2e (bound 1e-12)", sweeps, worst));
        double eps = 1e-6;
        RootOracle o = oracle_inv_root_d(n, A, eps, p);
        MatD exact((size_t)n * n);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                double s = 0.0;
                for (int k = 0; k < n; k++)
                    s += Q[(size_t)k * n + i] * std::pow(d[k] + eps, -1.0 / p) * Q[(size_t)k * n + j];
                exact[(size_t)i * n + j] = s;
            }
        double e = rel_err(exact.size(), o.X.data(), exact.data()), bound = 1e-16 * 100.0 * (o.lmax / o.lmin);
        report(e <= bound, fmt("oracle inverse 4th root vs Q^T diag((d + eps)^(-1/4)) Q, kappa %.0e", kappa),
               fmt("rel err %.2e (bound 100 u_64 kappa_eff = %.1e)", e, bound));
    }
}

// The CPU twin of versions 1 and 2 against the oracle, with the tolerances the GPU versions get: shows in CI that the
// iteration, its stopping rule and the tolerances fit together. The fp32-rounded exact root must pass with a wide
// margin (the tolerance is not below the rounding of the answer) and the root for 2 eps must fail where the
// tolerance can see it (kappa_eff >= 1e4: the tolerance is not vacuous).
static void test_newton_twin(Rng& rng) {
    int n = 37;
    float eps = 1e-6f;
    for (const SpdCase& c : SPD_CASES) {
        MatF A = make_spd(n, c.kappa, c.zeros_div ? n / c.zeros_div : 0, rng);
        for (int p : {1, 2, 4}) {
            RootOracle o = oracle_inv_root(n, A.data(), eps, p);
            double kappa = o.lmax / o.lmin;
            // fp32, version 1's 3xTF32, versions 3 and 4's (two accumulators, lower-triangle products mirrored);
            // unscaled (version 4, version 1's batches), scaled (versions 2 and 3) and version 1's scaled (fp32 and
            // its 3xTF32), which must not need their fallback here; version 1's 3xTF32 with lower-triangle products
            // (V1_LOWER), unscaled (batches) and scaled; version 1's default, scaled 3xTF32 with its I + D steps
            const struct { Prec prec; bool lower; NewtonStart start; double delta; } twins[] = {
                {PREC_FP32, false, NEWTON_UNSCALED},        {PREC_3XTF32, false, NEWTON_UNSCALED},
                {PREC_3XTF32_2ACC, false, NEWTON_UNSCALED}, {PREC_3XTF32_2ACC, true, NEWTON_UNSCALED},
                {PREC_FP32, false, NEWTON_SCALED},          {PREC_3XTF32, false, NEWTON_SCALED},
                {PREC_3XTF32_2ACC, false, NEWTON_SCALED},   {PREC_3XTF32_2ACC, true, NEWTON_SCALED},
                {PREC_FP32, false, NEWTON_SCALED_V1},       {PREC_3XTF32, false, NEWTON_SCALED_V1},
                {PREC_3XTF32, true, NEWTON_UNSCALED},       {PREC_3XTF32, true, NEWTON_SCALED_V1},
                {PREC_3XTF32, false, NEWTON_SCALED_V1, V1_DELTA_BELOW}};
            for (const auto& tw : twins) {
                Prec prec = tw.prec;
                bool lower = tw.lower;
                NewtonStart start = tw.start;
                MatF X((size_t)n * n);
                int as_delta = 0;
                NewtonState st = newton_cpu(n, p, eps, A.data(), X.data(), prec, 0, lower, tw.delta, &as_delta, start);
                RootTol t = root_tolerance(prec == PREC_FP32 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32, n, p, kappa);
                double e = rel_err(X.size(), X.data(), o.X.data()), res = root_residual(n, p, X.data(), A.data(), eps);
                report(!st.failed && !st.fell_back && e <= t.rel && res <= t.res,
                       fmt("cpu twin Newton %s%s%s%s n=%d p=%d %s (kappa_eff %.1e)", prec_name(prec),
                           lower ? " lower" : "", start == NEWTON_SCALED ? " scaled"
                                                  : start == NEWTON_SCALED_V1 ? " scaled (version 1)" : "",
                           tw.delta > 0.0 ? " I + D" : "", n, p, c.name, kappa),
                       fmt("%d steps%s%s, rel err %.2e (tol %.2e), residual %.2e (tol %.2e)", st.iters,
                           tw.delta > 0.0 ? fmt(" (%d as I + D)", as_delta).c_str() : "",
                           st.fell_back ? " after a fallback" : "", e, t.rel, res, t.res));
            }
            {  // the fallback: an estimate of lambda_max 100x too small makes the scaled iteration fail, and the
               // unscaled rerun must give the root
                MatF X((size_t)n * n);
                NewtonState st = newton_cpu(n, p, eps, A.data(), X.data(), PREC_FP32, 0, false, 0.0, nullptr,
                                            NEWTON_SCALED_BAD_HI);
                RootTol t = root_tolerance(METHOD_NEWTON_FP32, n, p, kappa);
                double e = rel_err(X.size(), X.data(), o.X.data()), res = root_residual(n, p, X.data(), A.data(), eps);
                report(!st.failed && st.fell_back && e <= t.rel && res <= t.res,
                       fmt("cpu twin Newton fp32 n=%d p=%d %s, lambda_max estimate 100x low: unscaled rerun", n, p,
                           c.name),
                       fmt("%s, %d + %d steps, rel err %.2e (tol %.2e), residual %.2e (tol %.2e)",
                           st.fell_back ? "fell back" : "did NOT fall back", st.discarded, st.iters, e, t.rel, res,
                           t.res));
            }
            if (kappa <= 1e2) {  // a batch's fast matrices: 20 more steps once converged change nothing that matters
                MatF X((size_t)n * n);
                NewtonState st = newton_cpu(n, p, eps, A.data(), X.data(), PREC_FP32, 20, false, 0.0, nullptr,
                                            NEWTON_UNSCALED);
                RootTol t = root_tolerance(METHOD_NEWTON_FP32, n, p, kappa);
                double e = rel_err(X.size(), X.data(), o.X.data());
                report(!st.failed && e <= t.rel, fmt("cpu twin Newton fp32 n=%d p=%d %s, 20 steps past convergence",
                                                     n, p, c.name),
                       fmt("%d steps, rel err %.2e (tol %.2e)", st.iters, e, t.rel));
            }
            if (p != 4) continue;
            MatF Xr(o.X.begin(), o.X.end());
            double e_round = rel_err(Xr.size(), Xr.data(), o.X.data());
            RootTol t = root_tolerance(METHOD_EIG, n, p, kappa);
            report(e_round <= 0.1 * t.rel, fmt("tolerance above fp32 rounding of the exact root, %s", c.name),
                   fmt("rounding error %.2e <= 0.1 x tol %.2e", e_round, t.rel));
            if (kappa < 5e3) continue;
            RootOracle o2 = oracle_inv_root(n, A.data(), 2 * eps, p);
            double e_wrong = rel_err(o2.X.size(), o2.X.data(), o.X.data());
            double widest = root_tolerance(METHOD_NEWTON_3XTF32, n, p, kappa).rel;
            report(e_wrong > widest, fmt("tolerance rejects the root for 2 eps, %s", c.name),
                   fmt("rel err %.2e > widest tol %.2e", e_wrong, widest));
        }
    }
}

// 1x1 matrices: the CPU twin (fp32 and the 3xTF32 model) within newton_scalar_tolerance, in the step count that the
// tolerance's float64 run of the scalar map predicts (the GPU's 1x1 checks use the same tolerance).
static void test_newton_scalar() {
    float eps = 1e-6f;
    for (float a : {2.5f, 1e-3f, 0.0f})
        for (int p : {1, 2, 4})
            for (int x3 = 0; x3 < 6; x3++) {
                Prec prec = x3 % 3 == 0 ? PREC_FP32 : x3 % 3 == 1 ? PREC_3XTF32 : PREC_3XTF32_2ACC;
                NewtonStart start = x3 < 3 ? NEWTON_UNSCALED : NEWTON_SCALED;
                RootMethod m = prec == PREC_FP32 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32;
                RootOracle o = oracle_inv_root(1, &a, eps, p);
                float x = NAN;
                NewtonState st = newton_cpu(1, p, eps, &a, &x, prec, 0, false, 0.0, nullptr, start);
                RootTol t = root_tolerance(m, 1, p, 1.0);
                double e = rel_err(1, &x, o.X.data()), res = root_residual(1, p, &x, &a, eps);
                report(!st.failed && !st.fell_back && e <= t.rel && res <= t.res,
                       fmt("cpu twin Newton %s%s n=1 p=%d a=%g", prec_name(prec),
                           start == NEWTON_SCALED ? " scaled" : "", p, a),
                       fmt("%d steps, rel err %.2e (tol %.2e), residual %.2e (tol %.2e)", st.iters, e, t.rel, res,
                           t.res));
            }
}

// The scalar pieces of the scaled steps against known values: the Ritz extremes and the last eigenvector weight of
// tridiag(-1, 2, -1) (eigenvalues 2 - 2 cos(pi j / (k + 1)), eigenvectors sin(i j pi / (k + 1))) and of a diagonal
// with a spread of 3e6; NewtonScale on exact spectra (every eigenvalue inside the carried interval after every step)
// and the step counts of the scalar simulation; Lanczos on matrices of known spectrum.
static int scaled_sim_steps(int p, double kappa, bool scaled, double lo_factor, bool* inside) {
    std::vector<double> m(200);
    for (size_t i = 0; i < m.size(); i++) m[i] = std::pow(kappa, -(double)i / (m.size() - 1));  // 1 .. 1 / kappa
    NewtonScale scale;
    scale.lo = lo_factor / kappa;
    *inside = true;
    for (int step = 0; step < 100; step++) {
        double r = 0.0;
        for (double v : m) r = std::max(r, std::fabs(v - 1.0));
        if (r <= NEWTON_LAST_R) return step + 1;  // and the last X step
        double a = scaled ? scale.alpha(p, r) : 1.0;
        for (double& v : m) v = newton_map(p, a * v);
        if (scaled) scale.advance(p, a);
        for (double v : m) *inside = *inside && v >= scale.lo * (1 - 1e-9) && v <= scale.hi * (1 + 1e-9);
    }
    return 1000;
}

static void test_scaled_pieces(Rng& rng) {
    const double pi = 3.14159265358979323846;
    for (int groups : {1, 8})
    for (int k : {1, 2, 7, 20}) {
        std::vector<double> d(k, 2.0), e(k, -1.0);
        double lo, hi;
        tridiag_extremes(d.data(), e.data(), k, &lo, &hi, Multisection{groups});
        double elo = 2.0 - 2.0 * std::cos(pi / (k + 1)), ehi = 2.0 - 2.0 * std::cos(pi * k / (k + 1));
        double w = tridiag_last_weight(d.data(), e.data(), k, ehi), s = std::sin(pi * k * k / (k + 1));
        double ew = 2.0 / (k + 1) * s * s;
        report(lo >= elo - 1e-12 && lo <= elo + 1e-4 * lo + 1e-12 && hi >= ehi - 1e-12 &&
                   hi <= ehi + 1e-7 * hi + 1e-12 && std::fabs(w - ew) <= 1e-9 * ew,
               fmt("tridiag_extremes (%d points an end), tridiag_last_weight: tridiag(-1, 2, -1), k=%d", 16 * groups,
                   k),
               fmt("lo %.10f (exact %.10f), hi %.10f (exact %.10f), last weight %.3e (exact %.3e)", lo, elo, hi, ehi,
                   w, ew));
    }
    for (int groups : {1, 8}) {
        double d[4] = {3.0, 1e-6, 0.5, 2.0}, e[4] = {0.0, 0.0, 0.0, 0.0}, lo, hi;
        tridiag_extremes(d, e, 4, &lo, &hi, Multisection{groups});
        report(lo >= 1e-6 && lo <= 1e-6 * (1 + 1e-4) && hi >= 3.0 && hi <= 3.0 * (1 + 1e-7),
               fmt("tridiag_extremes (%d points an end): diagonal, spread 3e6 (lo to 1e-4 relative)", 16 * groups),
               fmt("lo %.6e, hi %.9f", lo, hi));
    }
    {  // p = 4: the spread cap (a hi <= 5 (1 - 16^(-1/4)) = 2.5); p = 1: the safety cap (a hi <= 2 / 1.1)
        double a_bal = newton_alpha(4, 0.2, 1.0), a4 = newton_alpha(4, 1e-9, 0.5), a1 = newton_alpha(1, 1e-9, 1.0);
        report(newton_alpha(4, 1.0, 1.0) == 1.0 && a_bal < 2.5 &&
                   std::fabs(newton_map(4, a_bal * 0.2) - newton_map(4, a_bal)) < 1e-9 &&
                   std::fabs(a4 - 5.0) < 1e-12 && std::fabs(a1 - 2.0 / NEWTON_HI_SLACK) < 1e-12,
               "newton_alpha: 1 at convergence, balanced g(a lo) = g(a hi), capped (spread of T^p, slack above hi)",
               fmt("a(0.2, 1) = %.6f, p = 4 a(1e-9, 0.5) = %.6f (cap 5), p = 1 a(1e-9, 1) = %.6f (cap 2 / 1.1)", a_bal,
                   a4, a1));
    }
    {  // versions 2 and 3's closed-form a against newton_alpha's bisection (to 2^-40 of its bracket), both caps
        double worst = 0.0;
        int count = 0;
        for (int p : {1, 2, 4})
            for (double hi : {0.3, 1.0, 1.7})
                for (double lo_frac : {1.0, 0.999, 0.5, 0.1, 1e-2, 1e-4, 1e-7, 0.0}) {
                    double lo = lo_frac * hi, ab = newton_alpha(p, lo, hi), ac = newton_alpha_closed(p, lo, hi);
                    worst = std::max(worst, std::fabs(ac - ab) / ab);
                    count++;
                }
        report(worst <= 1e-10, "newton_alpha_closed = newton_alpha (bisection)",
               fmt("%d intervals, p = 1, 2, 4: largest relative difference %.1e", count, worst));
    }
    // the scalar simulation (exact extremes; r = max |m - 1|): steps including the last X step, p = 4
    struct { double kappa, lo_factor; int most; } sims[] = {{35, 1.0, 6}, {35, 1.3, 6}, {1e6, 1.0, 11}};
    for (auto& sim : sims) {
        bool inside = true, inside_u = true;
        int k = scaled_sim_steps(4, sim.kappa, true, sim.lo_factor, &inside);
        int ku = scaled_sim_steps(4, sim.kappa, false, 1.0, &inside_u);
        bool exact = sim.lo_factor == 1.0;  // an overestimated lo does not contain the spectrum, by design
        report(k <= sim.most && k < ku && (inside || !exact),
               fmt("scaled steps, scalar simulation p=4 kappa %.0e, lo estimated %.1fx", sim.kappa, sim.lo_factor),
               fmt("%d steps (at most %d), unscaled from [1/kappa, 1] %d; spectrum inside the interval: %s", k,
                   sim.most, ku, exact ? (inside ? "yes" : "NO") : "not expected"));
    }
    // Lanczos (both twins: lanczos_warp_cpu of versions 2 and 3, lanczos_grid_cpu of version 1; lanczos_newton_start)
    // on known spectra: 1 / z = theta_max + residual, at or above lambda_max and within NEWTON_HI_SLACK of it;
    // lo / z = theta_min at or above lambda_min
    for (double kappa : {35.0, 1e4}) {
        int n = 96;
        MatD Ad, Q;
        std::vector<double> dd;
        MatF A = make_spd(n, kappa, 0, rng, &Ad, &Q, &dd);
        for (int twin = 0; twin < 2; twin++) {
            double alpha[LANCZOS_STEPS], beta[LANCZOS_STEPS], z, lo;
            double rowsum_max;
            int k = twin == 0 ? lanczos_warp_cpu(n, A.data(), alpha, beta, &rowsum_max)
                              : lanczos_grid_cpu(n, A.data(), 0.0f, alpha, beta, &rowsum_max);
            lanczos_newton_start(alpha, beta, k, &z, &lo, twin == 0 ? lanczos23_multisection_cpu(n) : Multisection());
            double lmax = *std::max_element(dd.begin(), dd.end()), lmin = *std::min_element(dd.begin(), dd.end());
            double hi_est = 1.0 / z, tmin = lo / z;
            report(k == (twin == 0 ? LANCZOS23_STEPS : LANCZOS_STEPS) && hi_est >= lmax * (1 - 1e-6) &&
                       hi_est <= NEWTON_HI_SLACK * lmax &&
                       tmin >= lmin * (1 - 1e-5),
                   fmt("Lanczos start (%s twin) n=%d kappa %.0e", twin == 0 ? "warp" : "grid", n, kappa),
                   fmt("%d steps: theta_max + residual = %.6f lambda_max, theta_min = %.3f lambda_min", k,
                       hi_est / lmax, tmin / lmin));
        }
    }
}

// --bench's matrix (G G^T / (2 n), G an n x 2n Gaussian, n = 128, kappa ~ 35, eps 1e-6, p = 4): the scaled twin's
// steps (full steps and the last X step) in versions 2 and 3's arithmetic, at most BENCH_SCALED_STEPS, fewer than
// unscaled, within the tolerance.
constexpr int BENCH_SCALED_STEPS = 6;
static void test_scaled_steps_bench(Rng& rng) {
    int n = 128, p = 4;
    float eps = 1e-6f;
    MatD G((size_t)n * 2 * n);
    for (double& g : G) g = rng.normal();
    MatF A((size_t)n * n);
    for (int i = 0; i < n; i++)
        for (int j = 0; j <= i; j++) {
            double s = 0.0;
            for (int k = 0; k < 2 * n; k++) s += G[(size_t)i * 2 * n + k] * G[(size_t)j * 2 * n + k];
            A[(size_t)i * n + j] = A[(size_t)j * n + i] = (float)(s / (2 * n));
        }
    RootOracle o = oracle_inv_root(n, A.data(), eps, p);
    for (int x = 0; x < 2; x++) {
        Prec prec = x == 0 ? PREC_FP32 : PREC_3XTF32_2ACC;
        MatF X((size_t)n * n), Xu((size_t)n * n);
        NewtonState s = newton_cpu(n, p, eps, A.data(), X.data(), prec, 0, x == 1);
        NewtonState su = newton_cpu(n, p, eps, A.data(), Xu.data(), prec, 0, x == 1, 0.0, nullptr, NEWTON_UNSCALED);
        RootTol t = root_tolerance(x == 0 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32, n, p, o.lmax / o.lmin);
        double e = rel_err(X.size(), X.data(), o.X.data()), eu = rel_err(Xu.size(), Xu.data(), o.X.data());
        report(!s.failed && !s.fell_back && s.converged && s.iters + 1 <= BENCH_SCALED_STEPS && s.iters < su.iters &&
                   e <= t.rel,
               fmt("scaled steps on --bench's matrix n=%d p=%d (kappa_eff %.1f), %s%s", n, p, o.lmax / o.lmin,
                   prec_name(prec), x == 1 ? " lower (version 3)" : " (version 2)"),
               fmt("%d + 1 steps (at most %d in all), unscaled %d + 1; rel err %.2e, unscaled %.2e (tol %.2e)",
                   s.iters, BENCH_SCALED_STEPS, su.iters, e, eu, t.rel));
    }
}

// Version 1's Lanczos (lanczos_grid_cpu, the kernel's twin) against known spectra: the Ritz extremes lie inside the
// spectrum of A + eps I (up to rounding), the largest within NEWTON_HI_SLACK of lambda_max (the scaled steps assume no
// eigenvalue of M0 above that), the start rule's 1 / z between theta_max and 1.1 lambda_max, the row sum of A + eps I
// for newton_first_cap, and, where the steps span the whole space (n <= LANCZOS_STEPS), lambda_max itself, and
// lambda_min at kappa <= 1e2 (at n = 20, kappa 1e4 fp32 Lanczos loses orthogonality and theta_min stays at 3x
// lambda_min: the safe side, fewer steps saved).
struct LanczosRitz { int k; double theta_min, theta_max, z, lo, rowsum_max; };
static LanczosRitz lanczos_grid_ritz(int n, const float* A, float eps) {
    double alpha[LANCZOS_STEPS], beta[LANCZOS_STEPS];
    LanczosRitz r;
    r.k = lanczos_grid_cpu(n, A, eps, alpha, beta, &r.rowsum_max);
    tridiag_extremes(alpha, beta, r.k, &r.theta_min, &r.theta_max);
    lanczos_newton_start(alpha, beta, r.k, &r.z, &r.lo);
    return r;
}

static void test_lanczos_twin(Rng& rng) {
    float eps = 1e-6f;
    struct { int n; double kappa; int zeros; } cases[] = {{1, 1, 0},     {5, 1e2, 0},    {16, 1e2, 4},
                                                          {20, 1e4, 0},  {37, 1e2, 0},   {37, 1e6, 0},
                                                          {100, 1e4, 0}, {100, 1e2, 25}, {300, 1e2, 0}};
    for (auto& c : cases) {
        std::vector<double> d;
        MatF A = make_spd(c.n, c.kappa, c.zeros, rng, nullptr, nullptr, &d);
        double lmin = *std::min_element(d.begin(), d.end()) + eps, lmax = *std::max_element(d.begin(), d.end()) + eps;
        LanczosRitz lz = lanczos_grid_ritz(c.n, A.data(), eps);
        double slack = 1e-5 * lmax;  // fp32 rounding of A and of the products: a few u sqrt(n) ||A||
        bool inside = lz.theta_min >= lmin - slack && lz.theta_max <= lmax + slack && lz.theta_min <= lz.theta_max;
        bool top = lmax <= NEWTON_HI_SLACK * lz.theta_max;
        bool exact = c.n > LANCZOS_STEPS || (std::fabs(lz.theta_max - lmax) <= slack &&
                                             (c.kappa > 1e2 || std::fabs(lz.theta_min - lmin) <= slack));
        // the start rule: 1 / z = theta_max + residual, no lower and not far above lambda_max; lo = theta_min z
        bool start = 1.0 / lz.z >= lz.theta_max && 1.0 / lz.z <= NEWTON_HI_SLACK * lmax &&
                     std::fabs(lz.lo - lz.theta_min * lz.z) <= 1e-12 * lz.lo;
        double rows = 0.0;  // newton_first_cap's row sum of A + eps I, in float64
        for (int i = 0; i < c.n; i++) {
            double g = eps;
            for (int j = 0; j < c.n; j++) g += std::fabs((double)A[(size_t)i * c.n + j]);
            rows = std::max(rows, g);
        }
        bool rowsum = std::fabs(lz.rowsum_max - rows) <= 1e-5 * rows;
        report(inside && top && exact && start && rowsum && lz.k >= 1 && lz.k <= std::min(c.n, LANCZOS_STEPS),
               fmt("lanczos grid twin (version 1) n=%d kappa %.0e zeros %d", c.n, c.kappa, c.zeros),
               fmt("%d steps, theta %.4e .. %.4e, spectrum %.4e .. %.4e, 1 / z %.4e, row sum %.6e (exact %.6e)", lz.k,
                   lz.theta_min, lz.theta_max, lmin, lmax, 1.0 / lz.z, lz.rowsum_max, rows));
    }
    // Shampoo-like statistics, as --bench makes them: G G^T / (2 n), G n x 2n Gaussian
    int n = 256;
    MatF G((size_t)n * 2 * n), A((size_t)n * n);
    for (float& g : G) g = (float)rng.normal();
    MatD Ad((size_t)n * n);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double t = 0.0;
            for (int k = 0; k < 2 * n; k++) t += (double)G[(size_t)i * 2 * n + k] * G[(size_t)j * 2 * n + k];
            A[(size_t)i * n + j] = (float)(t / (2 * n));
        }
    for (size_t i = 0; i < A.size(); i++) Ad[i] = A[i];
    std::vector<double> w;
    MatD V;
    jacobi_eigh(n, Ad, w, V);
    double lmin = *std::min_element(w.begin(), w.end()) + eps, lmax = *std::max_element(w.begin(), w.end()) + eps;
    LanczosRitz lz = lanczos_grid_ritz(n, A.data(), eps);
    report(lz.theta_min >= lmin * (1 - 1e-5) && lz.theta_max <= lmax * (1 + 1e-5) && lmax <= 1.02 * lz.theta_max,
           fmt("lanczos grid twin n=%d G G^T / (2n)", n),
           fmt("%d steps, theta %.4e .. %.4e, spectrum %.4e .. %.4e (lambda_max within 2%%)", lz.k, lz.theta_min,
               lz.theta_max, lmin, lmax));
    // A = c I: the first step finds the invariant space (breakdown), theta = c + eps
    MatF I((size_t)37 * 37, 0.0f);
    for (int i = 0; i < 37; i++) I[(size_t)i * 37 + i] = 0.5f;
    LanczosRitz li = lanczos_grid_ritz(37, I.data(), eps);
    report(li.k == 1 && std::fabs(li.theta_min - 0.500001) <= 1e-6 && std::fabs(li.theta_max - 0.500001) <= 1e-6,
           "lanczos grid twin 0.5 I (breakdown after one step)",
           fmt("%d steps, theta %.7f .. %.7f", li.k, li.theta_min, li.theta_max));
}

// MATRIX_ROOTS_V1's words (version 1's choices): each sets what it names, later words win, anything else is refused
static void test_v1_options() {
    struct { const char* text; bool ok, scaled; V1Products products; bool lt; int block; } cases[] = {
        {"scaled", true, true, V1_F16, false, 128},
        {"unscaled", true, false, V1_F16, false, 128},
        {"split,lt", true, true, V1_SPLIT, true, 128},
        {"split,concat,lt,cublas", true, true, V1_CONCAT, false, 128},
        {"unscaled,split", true, false, V1_SPLIT, false, 128},
        {"split,", false, true, V1_SPLIT, false, 128},
        {"", false, true, V1_F16, false, 128},
        {"Split", false, true, V1_F16, false, 128},
        {"lt,fast", false, true, V1_F16, true, 128},
        {"lower", true, true, V1_LOWER, false, 128},
        {"lower256,unscaled", true, false, V1_LOWER, false, 256},
        {"lower64,lower", true, true, V1_LOWER, false, 128},
        {"lower64,concat", true, true, V1_CONCAT, false, 64},
        {"lower32", false, true, V1_F16, false, 128},
        {"lower1024", false, true, V1_F16, false, 128},
        {"lower 128", false, true, V1_F16, false, 128},
        {"fp16", true, true, V1_F16, false, 128},
        {"split,fp16,unscaled", true, false, V1_F16, false, 128},
        {"fp16,concat", true, true, V1_CONCAT, false, 128},
        {"f16", false, true, V1_F16, false, 128}};
    for (auto& c : cases) {
        V1Options o;
        bool ok = parse_v1_options(c.text, &o);
        bool same = ok == c.ok && (!ok || (o.scaled == c.scaled && o.products == c.products && o.lt == c.lt &&
                                           o.lower_block == c.block));
        report(same, fmt("MATRIX_ROOTS_V1='%s'", c.text),
               fmt("%s: scaled %d, products %s, lt %d, lower block %d", ok ? "accepted" : "refused", o.scaled,
                   o.products == V1_SPLIT   ? "split"
                   : o.products == V1_LOWER ? "lower"
                   : o.products == V1_F16   ? "fp16"
                                            : "concat",
                   o.lt,
                   o.lower_block));
    }
}

// V1_F16's arithmetic on the CPU with the kernel's own f16_parts: 2^-11 A3 B3 summed in float64 from the parts
// must equal the float64 A B within 2^-20 sum |a| |b| (the dropped lo lo term and the two rounded lo parts, 2^-22
// each) for entries of 2^-6 .. 2^4 (the iterates' range: T's powers and M below ~7, X / x0 from 1 up); and a B entry
// of 32 or more must give inf (2^11 hi overflows), so that a diverging iteration fails visibly.
static void test_f16_parts_cpu(Rng& rng) {
    const int n = 40;
    auto part = [](float x, bool lo) {
        __half h, l;
        f16_parts(x, h, l);
        return (double)__half2float(lo ? l : h);
    };
    for (int ka : {-6, 0, 4})
        for (int kb : {-6, 0, 3}) {
            std::vector<float> A((size_t)n * n), B((size_t)n * n);
            for (auto& v : A) v = (float)(rng.normal() * std::ldexp(1.0, ka));
            for (auto& v : B) v = (float)std::max(-31.0, std::min(31.0, rng.normal() * std::ldexp(1.0, kb)));
            double worst = 0.0;
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) {
                    double exact = 0.0, sum3 = 0.0, bound = 0.0;
                    for (int k = 0; k < n; k++) {
                        float a = A[(size_t)i * n + k], b = B[(size_t)k * n + j];
                        double ah = part(a, false), al = part(a, true), bh = part(b, false), bl = part(b, true);
                        double bh_up = (double)__half2float(__float2half_rn((float)bh * F16_LO_SCALE));
                        sum3 += ah * bh_up + ah * bl + al * bh;  // A3 B3, as the K = 3n GEMM sums it
                        exact += (double)a * b;
                        bound += std::fabs((double)a * b);
                    }
                    worst = std::max(worst, std::fabs(sum3 / F16_LO_SCALE - exact) / (std::ldexp(1.0, -20) * bound));
                }
            report(worst <= 1.0, fmt("fp16 parts: A 2^%d, B 2^%d", ka, kb),
                   fmt("worst |error| / (2^-20 sum |a||b|) %.3f", worst));
        }
    __half h, l;
    f16_parts(32.0f, h, l);
    bool inf = std::isinf(__half2float(__float2half_rn(__half2float(h) * F16_LO_SCALE)));
    f16_parts(31.9f, h, l);
    bool finite = std::isfinite(__half2float(__float2half_rn(__half2float(h) * F16_LO_SCALE)));
    report(inf && finite, "fp16 parts: 2^11 B_hi overflows to inf from 32 on", fmt("32: inf %d, 31.9: finite %d", inf,
                                                                                   finite));
}

// Version 1's lower-triangle products (V1_LOWER) emulated on the CPU with the kernels' own index code
// (lower_block_coords, lower_block_ptrs, split3_lower_element): the batched GEMM entries computed as cuBLAS defines
// a column-major product (written out here, apart from that code), in float64, then the mirror. Every element must
// equal the float64 sum of the split operands' products, the lower triangle mirrored (a wrong block, offset or
// leading dimension is an O(1) error; the padding must contribute exact zeros). Small blocks (8, 16) give many of
// them at small n, with and without padding, and a batch.
static void test_lower_blocks_cpu(Rng& rng) {
    bool each_once = true;  // every block (I, J), J <= I, once, in order
    for (int nb = 1, t = 0; nb <= 300; nb++)
        for (int J = 0; J < nb; J++, t++) {
            int i, j;
            lower_block_coords(t, &i, &j);
            each_once &= i == nb - 1 && j == J;
        }
    report(each_once, "v1 lower: block numbering of a lower triangle (300 block rows)", "");
    struct { int n, bs, batch; } cases[] = {{37, 8, 1}, {40, 8, 2}, {70, 16, 3}, {33, 16, 1}, {5, 8, 2}, {1, 8, 1}};
    for (auto& c : cases) {
        int n = c.n, bs = c.bs, batch = c.batch, nb = (n + bs - 1) / bs, N = nb * bs, tri = nb * (nb + 1) / 2;
        size_t nn = (size_t)n * n, NN = (size_t)N * N;
        MatF A(nn * batch), B(nn * batch), A3(3 * NN * batch, NAN), B3(3 * NN * batch, NAN), Cp(NN * batch, NAN);
        for (auto& v : A) v = (float)rng.normal();
        for (auto& v : B) v = (float)rng.normal();
        for (size_t idx = 0; idx < NN * batch; idx++) split3_lower_element(idx, A.data(), B.data(), A3.data(),
                                                                            B3.data(), n, N);
        for (int e = 0; e < batch * tri; e++) {
            const float *pa, *pb;
            float* pc;
            lower_block_ptrs(e, tri, N, bs, A3.data(), B3.data(), Cp.data(), &pa, &pb, &pc);
            // cuBLAS: C(r, c) = sum_k A(r, k) B(k, c), column-major, m = n = bs, K = 3N, lda = N, ldb = 3N, ldc = N
            for (int r = 0; r < bs; r++)
                for (int col = 0; col < bs; col++) {
                    double acc = 0.0;
                    for (int k = 0; k < 3 * N; k++) acc += (double)pa[r + (size_t)k * N] * pb[k + (size_t)col * 3 * N];
                    pc[r + (size_t)col * N] = (float)acc;
                }
        }
        double worst = 0.0;
        for (int m = 0; m < batch; m++)
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) {
                    int li = std::max(i, j), lj = std::min(i, j);  // mirrored from the lower triangle
                    double ref = 0.0, scale = 0.0;
                    for (int k = 0; k < n; k++) {
                        float a = A[m * nn + (size_t)li * n + k], b = B[m * nn + (size_t)k * n + lj];
                        float ah = tf32_rna(a), al = tf32_rna(a - ah), bh = tf32_rna(b), bl = tf32_rna(b - bh);
                        ref += (double)ah * bh + (double)ah * bl + (double)al * bh;
                        scale += std::fabs((double)a * b);
                    }
                    double got = Cp[m * NN + (size_t)li * N + lj];
                    double d = std::fabs(got - ref) / (scale + 1e-30);
                    worst = std::isnan(got) ? INFINITY : std::max(worst, d);
                }
        // the emulated GEMM sums in float64 and rounds once to fp32: u relative to the sum, plus float64 sums
        report(worst <= 2.0 * U32, fmt("v1 lower: blocks, pointers and padding emulated, n=%d b=%d batch=%d", n, bs,
                                       batch),
               fmt("%d blocks per matrix, worst |got - ref| / sum |a b| = %.2e (tol %.2e)", tri, worst, 2.0 * U32));
    }
}

// Versions 3 and 4's warp tile, emulated on the CPU: the 32 lanes' fragments from tc_load_frags, an mma.sync
// m16n8k8 that places them by the PTX table (written out here, apart from the kernels' index code), the outputs
// where tc_acc_coords says. Every element of the warp tile must be written once and equal the float64 product of
// the split operands (a wrong index is an O(1) error), for both versions' tiles and operand layouts (version 3:
// 16 x 32, row stride 132 for A and B, K = 40; version 4: 32 x 32 and 16 x 32, panels of stride 36 and 72, K = 32).
static void emulate_mma_tf32(float c[32][4], const uint32_t a[32][4], const uint32_t b[32][2]) {
    auto f = [](uint32_t u) { float x; memcpy(&x, &u, 4); return (double)x; };
    double Am[16][8], Bm[8][8], Cm[16][8];
    for (int lane = 0; lane < 32; lane++) {
        int g = lane >> 2, t = lane & 3;
        Am[g][t] = f(a[lane][0]);
        Am[g + 8][t] = f(a[lane][1]);
        Am[g][t + 4] = f(a[lane][2]);
        Am[g + 8][t + 4] = f(a[lane][3]);
        Bm[t][g] = f(b[lane][0]);
        Bm[t + 4][g] = f(b[lane][1]);
        Cm[g][2 * t] = c[lane][0];
        Cm[g][2 * t + 1] = c[lane][1];
        Cm[g + 8][2 * t] = c[lane][2];
        Cm[g + 8][2 * t + 1] = c[lane][3];
    }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 8; j++)
            for (int k = 0; k < 8; k++) Cm[i][j] += Am[i][k] * Bm[k][j];
    for (int lane = 0; lane < 32; lane++) {
        int g = lane >> 2, t = lane & 3;
        c[lane][0] = (float)Cm[g][2 * t];
        c[lane][1] = (float)Cm[g][2 * t + 1];
        c[lane][2] = (float)Cm[g + 8][2 * t];
        c[lane][3] = (float)Cm[g + 8][2 * t + 1];
    }
}
// The 3xTF32 step of fragment (mi, ni) as the kernels issue it: the two small terms into small, the big one into big
template <int MI>
static void emulate_mma_3xtf32(const std::vector<TcFrags<MI>>& fr, int mi, int ni, float big[32][4],
                               float small[32][4]) {
    uint32_t ah[32][4], al[32][4], bh[32][2], bl[32][2];
    for (int lane = 0; lane < 32; lane++) {
        memcpy(ah[lane], fr[lane].ah[mi], sizeof ah[lane]);
        memcpy(al[lane], fr[lane].al[mi], sizeof al[lane]);
        memcpy(bh[lane], fr[lane].bh[ni], sizeof bh[lane]);
        memcpy(bl[lane], fr[lane].bl[ni], sizeof bl[lane]);
    }
    emulate_mma_tf32(small, al, bh);
    emulate_mma_tf32(small, ah, bl);
    emulate_mma_tf32(big, ah, bh);
}

template <int MI>
static void test_tc_fragments_at(Rng& rng, const char* name, int lda, int ldb, int K) {
    const int ROWS = 16 * MI;
    MatF As((size_t)ROWS * lda, NAN), Bs((size_t)K * ldb, NAN);  // NaN outside the tile: a stray read fails
    for (int i = 0; i < ROWS; i++)
        for (int k = 0; k < K; k++) As[(size_t)i * lda + k] = (float)rng.normal();
    for (int k = 0; k < K; k++)
        for (int j = 0; j < 32; j++) Bs[(size_t)k * ldb + j] = (float)rng.normal();
    std::vector<float> big(MI * TC_NI * 32 * 4, 0.0f), small(big.size(), 0.0f);
    auto acc = [&](std::vector<float>& v, int mi, int ni) { return (float(*)[4])&v[((mi * TC_NI + ni) * 32) * 4]; };
    for (int k0 = 0; k0 < K; k0 += 8) {
        std::vector<TcFrags<MI>> fr(32);
        for (int lane = 0; lane < 32; lane++) tc_load_frags<MI>(lane, As.data(), lda, Bs.data(), ldb, k0, fr[lane]);
        for (int mi = 0; mi < MI; mi++)
            for (int ni = 0; ni < TC_NI; ni++) {
                emulate_mma_3xtf32<MI>(fr, mi, ni, acc(big, mi, ni), acc(small, mi, ni));
            }
    }
    std::vector<int> writes(ROWS * 32, 0);
    double worst = 0.0;
    for (int lane = 0; lane < 32; lane++)
        for (int mi = 0; mi < MI; mi++)
            for (int ni = 0; ni < TC_NI; ni++)
                for (int r = 0; r < 4; r++) {
                    int i, j;
                    tc_acc_coords(lane, mi, ni, r, i, j);
                    if (i < 0 || i >= ROWS || j < 0 || j >= 32) { worst = INFINITY; continue; }
                    writes[i * 32 + j]++;
                    double ref = 0.0, mag = 0.0;  // the split product: hi hi + hi lo + lo hi
                    for (int k = 0; k < K; k++) {
                        float a = As[(size_t)i * lda + k], b = Bs[(size_t)k * ldb + j];
                        float ah = tf32_rna(a), bh = tf32_rna(b), al = tf32_rna(a - ah), bl = tf32_rna(b - bh);
                        ref += (double)ah * bh + (double)ah * bl + (double)al * bh;
                        mag += std::fabs((double)a * b);
                    }
                    double got = (double)acc(big, mi, ni)[lane][r] + acc(small, mi, ni)[lane][r];
                    double e = std::fabs(got - ref) / mag;
                    worst = std::isnan(e) ? INFINITY : std::max(worst, e);
                }
    bool once = std::all_of(writes.begin(), writes.end(), [](int w) { return w == 1; });
    report(once && worst <= 1e-6, fmt("3xTF32 warp tile %dx32, CPU emulation of the fragments, %s", ROWS, name),
           fmt("%s, max |got - split product| / sum |a b| = %.1e (bound 1e-6)",
               once ? "every element written once" : "an element written twice or never", worst));
}

static void test_tc_fragments(Rng& rng) {
    test_tc_fragments_at<1>(rng, "version 3 (stride 132, K = 40)", V3Cfg<128, 2>::LD, V3Cfg<128, 2>::LD, 40);
    test_tc_fragments_at<2>(rng, "version 4 (panels of strides 36 and 72, K = 32)", V4_LDA, V4_LDB, V4_BK);
    test_tc_fragments_at<1>(rng, "version 4's column halves (panels of strides 36 and 72, K = 32)", V4_LDA, V4_LDB,
                            V4_BK);
}

// Version 4's product on the CPU: the kernel's own panel, warp-tile and store code (V4Panels, v4_warp_tile,
// v4_store, tc_load_frags) for all 128 threads of one block, run over every work item of v4_phase in turn, the mma
// emulated. The lower triangle of A B, mirrored, must come out of whole tiles (COLS = 64) and of column halves
// (COLS = 32) at sizes that end inside a panel and inside a tile: every element written (C starts as NaN) and equal
// to the float64 split product.
template <int COLS>
static void test_v4_product_emulated(Rng& rng, int n) {
    constexpr int MI = COLS == 64 ? 2 : 1;
    MatF A((size_t)n * n), B((size_t)n * n), C((size_t)n * n, NAN);
    for (auto& v : A) v = (float)rng.normal();
    for (auto& v : B) v = (float)rng.normal();
    V4Product pr{A.data(), B.data(), C.data()};
    int tiles_1d = (n + V4_BT - 1) / V4_BT, tiles = tiles_1d * (tiles_1d + 1) / 2;
    MatF As(V4_BT * V4_LDA), Bs(V4_BK * V4_LDB);
    std::vector<V4Panels<COLS>> regs(V4_THREADS);
    std::vector<float> big(4 * MI * TC_NI * 32 * 4), small(big.size());
    auto acc = [&](std::vector<float>& v, int warp, int mi, int ni) {
        return (float(*)[4]) & v[(((warp * MI + mi) * TC_NI + ni) * 32) * 4];
    };
    for (int item = 0; item < (COLS == 64 ? 1 : 2) * tiles; item++) {
        int bi, bj;
        lower_tile(item % tiles, bi, bj);
        int row0 = bi * V4_BT, col0 = bj * V4_BT + item / tiles * COLS;
        std::fill(big.begin(), big.end(), 0.0f);
        std::fill(small.begin(), small.end(), 0.0f);
        for (int tid = 0; tid < V4_THREADS; tid++) regs[tid].fetch(pr, n, row0, col0, tid, 0);
        for (int k0 = 0; k0 < n; k0 += V4_BK) {
            for (int tid = 0; tid < V4_THREADS; tid++) regs[tid].stash(tid, As.data(), Bs.data());
            if (k0 + V4_BK < n)
                for (int tid = 0; tid < V4_THREADS; tid++) regs[tid].fetch(pr, n, row0, col0, tid, k0 + V4_BK);
            int kn = std::min(V4_BK, (n - k0 + 7) / 8 * 8);
            for (int warp = 0; warp < 4; warp++) {
                int wr, wc;
                if (!v4_warp_tile<COLS>(warp, row0, col0, wr, wc)) continue;
                for (int kk = 0; kk < kn; kk += 8) {
                    std::vector<TcFrags<MI>> fr(32);
                    for (int lane = 0; lane < 32; lane++)
                        tc_load_frags<MI>(lane, As.data() + wr * V4_LDA, V4_LDA, Bs.data() + wc, V4_LDB, kk, fr[lane]);
                    for (int mi = 0; mi < MI; mi++)
                        for (int ni = 0; ni < TC_NI; ni++) {
                            emulate_mma_3xtf32<MI>(fr, mi, ni, acc(big, warp, mi, ni), acc(small, warp, mi, ni));
                        }
                }
            }
        }
        for (int warp = 0; warp < 4; warp++) {
            int wr, wc;
            v4_warp_tile<COLS>(warp, row0, col0, wr, wc);
            for (int lane = 0; lane < 32; lane++)
                for (int mi = 0; mi < MI; mi++)
                    for (int ni = 0; ni < TC_NI; ni++)
                        for (int r = 0; r < 4; r++) {
                            int i, j;
                            tc_acc_coords(lane, mi, ni, r, i, j);
                            v4_store(C.data(), n, row0 + wr + i, col0 + wc + j,
                                     acc(big, warp, mi, ni)[lane][r] + acc(small, warp, mi, ni)[lane][r]);
                        }
        }
    }
    double worst = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            int li = std::max(i, j), lj = std::min(i, j);  // the lower element, mirrored
            double ref = 0.0, mag = 0.0;
            for (int k = 0; k < n; k++) {
                float a = A[(size_t)li * n + k], b = B[(size_t)k * n + lj];
                float ah = tf32_rna(a), bh = tf32_rna(b), al = tf32_rna(a - ah), bl = tf32_rna(b - bh);
                ref += (double)ah * bh + (double)ah * bl + (double)al * bh;
                mag += std::fabs((double)a * b);
            }
            double e = std::fabs((double)C[(size_t)i * n + j] - ref) / mag;
            worst = std::isnan(e) ? INFINITY : std::max(worst, e);
        }
    report(worst <= 1e-6, fmt("version 4 product on the CPU (its panel, warp and store code), %s, n=%d",
                              COLS == 64 ? "whole tiles" : "column halves", n),
           fmt("max |C - lower split product, mirrored| / sum |a b| = %.1e (bound 1e-6; NaN: an element unwritten)",
               worst));
}

// Version 3's split of a product over warps and blocks (v3_matmul's map, replayed): every element on or below the
// diagonal computed by exactly one warp of one block, every element of the NP x NP result written.
template <int NP, int CL>
static void test_v3_unit_map() {
    using C = V3Cfg<NP, CL>;
    std::vector<int> computed(NP * NP, 0), written(NP * NP, 0);
    for (int rank = 0; rank < CL; rank++)
        for (int warp = 0; warp < C::WARPS; warp++) {
            int unit = rank * C::WARPS + warp, br, bc;
            if (unit >= C::UNITS) continue;
            v3_unit(unit, br, bc);
            for (int i = br * 16; i < br * 16 + 16; i++)
                for (int j = bc * 32; j < bc * 32 + 32; j++) {
                    if (i >= NP || j >= NP) { computed[0] += 100; continue; }  // outside the matrix: a failure
                    if (i < j) continue;
                    computed[i * NP + j]++;
                    written[i * NP + j]++;
                    written[j * NP + i]++;
                }
        }
    bool ok = true;
    for (int i = 0; i < NP; i++)
        for (int j = 0; j < NP; j++) ok = ok && written[i * NP + j] > 0 && (i < j || computed[i * NP + j] == 1);
    report(ok, fmt("version 3 unit map NP=%d, %d block(s) per matrix, %d warps each", NP, CL, C::WARPS),
           ok ? "every lower element computed once, every element written" : "an element missed or computed twice");
}

// Newton-Schulz: the float64 run maps every singular value s of G / ||G||_F to phi^5(s) (phi(s) = a s + b s^3 +
// c s^5): the sorted singular values of the output equal the sorted phi^5(s_i). The bf16 twin stays within 16 bf16
// ulps (2^-8 relative) of it and inside the quintic's band.
static void test_ns_cpu(Rng& rng) {
    struct { int m, n; double kappa; } shapes[] = {{37, 53, 1e2}, {70, 29, 1e2}, {48, 48, 30}};
    for (auto& sh : shapes) {
        MatF G = make_with_singular_values(sh.m, sh.n, sh.kappa, rng);
        NsPair r = ns_pair(sh.m, sh.n, G);
        const std::vector<double>&xd = r.xd, &xe = r.xe, &sg = r.sg, &sd = r.sd, &se = r.se;
        const double fro = r.fro;
        std::vector<double> expect;
        for (double v : sg) expect.push_back(ns_scalar(v / (std::sqrt(fro) + 1e-7), NS_STEPS));
        std::sort(expect.begin(), expect.end());
        double worst = 0.0;
        for (size_t i = 0; i < sd.size(); i++) worst = std::max(worst, std::fabs(sd[i] - expect[i]));
        report(worst <= 1e-9, fmt("cpu Newton-Schulz float64 %dx%d: singular values are phi^5(s)", sh.m, sh.n),
               fmt("max |sigma - phi^5(s)| = %.1e (bound 1e-9), band [%.3f, %.3f]", worst, sd.front(), sd.back()));
        double e = rel_err(xe.size(), xe.data(), xd.data());
        bool band = se.front() >= 0.68 - 0.03 && se.back() <= 1.21 + 0.03;
        report(e <= 16.0 / 256.0 && band, fmt("cpu Newton-Schulz bf16 twin %dx%d vs float64", sh.m, sh.n),
               fmt("rel err %.2e (bound 16 u_bf16 = 6.3e-2), singular values [%.3f, %.3f] (band [0.65, 1.24])", e,
                   se.front(), se.back()));
    }
}

// The statistics oracle against a direct computation: integer inputs make every sum exact in float64, so the two
// must agree bitwise; the 3x3 patches are built here by explicit loops over the kernel taps.
static void test_stats_oracle(Rng& rng) {
    // the kernel's tile numbering: tiles 0 .. T (T + 1) / 2 - 1 are the lower-triangle tiles, each exactly once
    bool tiles_ok = true;
    for (int T = 1; T <= 400 && tiles_ok; T++) {
        std::vector<char> seen((size_t)T * T, 0);
        for (int t = 0; t < T * (T + 1) / 2; t++) {
            int bi, bj;
            lower_tile(t, bi, bj);
            if (bi < 0 || bi >= T || bj < 0 || bj > bi || seen[(size_t)bi * T + bj]++) tiles_ok = false;
        }
    }
    report(tiles_ok, "syrk_lower tile numbering covers the lower triangle once (T = 1 .. 400)",
           tiles_ok ? "every tile once" : "a tile missed or repeated");
    int m = 13, n = 29;
    MatF G((size_t)m * n), C0((size_t)n * n);
    for (auto& v : G) v = (float)((int)(rng.next() % 17) - 8);
    for (int i = 0; i < n; i++)
        for (int j = 0; j <= i; j++) C0[(size_t)i * n + j] = C0[(size_t)j * n + i] = (float)((int)(rng.next() % 9) - 4);
    MatD ref, scale;
    syrk_oracle(n, m, [&](int i, int k) { return (double)G[(size_t)k * n + i]; }, 2.0, 3.0, C0.data(), ref, scale);
    bool ok = true;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0.0;
            for (int k = 0; k < m; k++) s += (double)G[(size_t)k * n + i] * G[(size_t)k * n + j];
            ok = ok && ref[(size_t)i * n + j] == 2.0 * s + 3.0 * C0[(size_t)i * n + j];
        }
    report(ok, "stats oracle R = 3 C + 2 G^T G (integers, exact)", ok ? "bitwise equal" : "differs");
    int B = 2, H = 5, W = 4, C = 3;
    MatF x((size_t)B * H * W * C);
    for (auto& v : x) v = (float)((int)(rng.next() % 7) - 3);
    for (int pad : {0, 1}) {
        int OH = H + 2 * pad - 2, OW = W + 2 * pad - 2, F = 9 * C, P = B * OH * OW;
        syrk_oracle(F, P, [&](int f, int k) { return im2col_value(x.data(), H, W, C, pad, f, k); }, 1.0, 0.0, nullptr,
                    ref, scale);
        MatD direct((size_t)F * F, 0.0);
        for (int b = 0; b < B; b++)
            for (int oy = 0; oy < OH; oy++)
                for (int ox = 0; ox < OW; ox++) {
                    std::vector<double> patch(F, 0.0);
                    for (int ky = 0; ky < 3; ky++)
                        for (int kx = 0; kx < 3; kx++)
                            for (int c = 0; c < C; c++) {
                                int iy = oy + ky - pad, ix = ox + kx - pad;
                                if (iy >= 0 && iy < H && ix >= 0 && ix < W)
                                    patch[(ky * 3 + kx) * C + c] = x[(((size_t)b * H + iy) * W + ix) * C + c];
                            }
                    for (int i = 0; i < F; i++)
                        for (int j = 0; j < F; j++) direct[(size_t)i * F + j] += patch[i] * patch[j];
                }
        report(direct == ref, fmt("stats oracle K-FAC conv patches pad %d vs explicit taps", pad),
               direct == ref ? "bitwise equal" : "differs");
    }
}

// ----------------------------------------------------------------------------------------------------------------
// --test, GPU part: every version against the oracle at awkward sizes, single matrices and batches, outputs
// poisoned with NaN first (an unwritten element fails).

static float* to_device(const float* h, size_t count) {
    float* d = nullptr;
    cudaCheck(cudaMalloc(&d, std::max<size_t>(1, count) * sizeof(float)));
    cudaCheck(cudaMemcpy(d, h, count * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}
static MatF to_host(const float* d, size_t count) {
    MatF h(count);
    cudaCheck(cudaMemcpy(h.data(), d, count * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}
static float* device_poisoned(size_t count) {
    float* d = nullptr;
    cudaCheck(cudaMalloc(&d, std::max<size_t>(1, count) * sizeof(float)));
    cudaCheck(cudaMemset(d, 0xFF, count * sizeof(float)));  // 0xFFFFFFFF is a NaN
    return d;
}

// blocks: version 3's blocks per matrix (0: a cluster of 2 where the GPU has them; 1: one block, sm_80's path).
// start: versions 1 to 3 (NewtonStart; version 1 maps it to V1Options::scaled); "v3 1blk unscaled" and
// "v1 3xtf32 unscaled" are the iterations before scaled steps, for comparison. products, lt, lower_block: version
// 1's V1Options (lower_block 0: the default).
struct RootVariant {
    const char* name;
    int version;
    Prec prec;
    RootMethod method;
    int blocks;
    NewtonStart start;
    V1Products products;
    bool lt;
    int lower_block;
    double delta_below;  // version 1: V1Options::delta_below
};
static const RootVariant ROOT_VARIANTS[] = {
    {"v0 cusolver", 0, PREC_FP32, METHOD_EIG, 0, NEWTON_UNSCALED},
    {"v1 newton fp32", 1, PREC_FP32, METHOD_NEWTON_FP32, 0, NEWTON_SCALED},
    {"v1 newton 3xtf32", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_CONCAT, false, 128,
     V1_DELTA_BELOW},
    {"v1 3xtf32 unscaled", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_UNSCALED},
    {"v1 3xtf32 split", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_SPLIT, false},
    {"v1 3xtf32 lt", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_CONCAT, true},
    {"v1 3xtf32 split lt", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_SPLIT, true},
    {"v1 3xtf32 lower", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_LOWER, false, 128},
    {"v1 3xtf32 lower64", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_LOWER, false, 64},
    {"v1 3xtf32 lower256", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_LOWER, false, 256},
    {"v1 3xtf32 no delta", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED},
    {"v1 newton 3xfp16", 1, PREC_3XTF32, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED, V1_F16, false, 128, V1_DELTA_BELOW},
    {"v2 fused newton", 2, PREC_FP32, METHOD_NEWTON_FP32, 0, NEWTON_SCALED},
    {"v3 tc fused", 3, PREC_3XTF32_2ACC, METHOD_NEWTON_3XTF32, 0, NEWTON_SCALED},
    {"v3 tc 1 block", 3, PREC_3XTF32_2ACC, METHOD_NEWTON_3XTF32, 1, NEWTON_SCALED},
    {"v3 1blk unscaled", 3, PREC_3XTF32_2ACC, METHOD_NEWTON_3XTF32, 1, NEWTON_UNSCALED},
    {"v4 tc coop", 4, PREC_3XTF32_2ACC, METHOD_NEWTON_3XTF32, 0, NEWTON_UNSCALED}};

// how the last version-1 call started, for the lines of --test and --bench
static std::string v1_start_text() {
    if (!g_v1_info.scaled) return " (unscaled)";
    const LanczosStart& ls = g_v1_info.start;
    return fmt(" (scaled: %d Lanczos steps in %.3f ms, M0 in [%.2e, 1], 1 / z %.3e, ||M0||_inf %.2f%s%s)", ls.k,
               g_v1_info.start_ms, ls.lo, 1.0 / ls.z, ls.z * ls.rowsum_max,
               g_v1_info.delta_steps ? fmt(", %d steps as I + D", g_v1_info.delta_steps).c_str() : "",
               g_v1_info.fell_back ? ", fell back to unscaled" : "");
}

// Versions 2 to 4 without a host synchronisation (their status stays on the device): nullptr or why not.
static const char* launch_fused_variant(const RootVariant& v, const float* d_A, float* d_X, int batch, int n, int p,
                                        float eps) {
    if (v.version == 2) return inv_root_v2(d_A, d_X, batch, n, p, eps, v.start);
    if (v.version == 3) return inv_root_v3(d_A, d_X, batch, n, p, eps, v.blocks, v.start);
    return inv_root_v4(d_A, d_X, batch, n, p, eps);
}

// Runs one variant on d_A (batch x n x n) into d_X. Returns nullptr or why it cannot run; steps: per matrix when
// known (versions 2 to 4), else the batch's.
static const char* run_root_variant(const RootVariant& v, const float* d_A, float* d_X, int batch, int n, int p,
                                    float eps, std::vector<int>& steps, std::string& trouble) {
    steps.assign(batch, 0);
    trouble.clear();
    if (v.version == 0) {
        int bad = inv_root_v0(d_A, d_X, batch, n, p, eps);
        if (bad) trouble = fmt("cuSOLVER reported %d matrices not converged", bad);
        return nullptr;
    }
    if (v.version == 1) {
        V1Options saved = g_v1;
        g_v1 = {v.start != NEWTON_UNSCALED, v.products, v.lt, v.lower_block ? v.lower_block : V1Options().lower_block,
                v.delta_below};
        NewtonState s = inv_root_v1(d_A, d_X, batch, n, p, eps, v.prec);
        g_v1 = saved;
        steps.assign(batch, s.iters);
        if (s.failed) trouble = fmt("left the convergence region (||M - I||_F = %.2e)", s.r);
        // one matrix takes the scaled steps; the unscaled fallback is there for safety, not for these matrices
        else if (g_v1_info.fell_back) trouble = "the scaled iteration did not converge (fell back to unscaled steps)";
        return nullptr;
    }
    const char* why = launch_fused_variant(v, d_A, d_X, batch, n, p, eps);
    if (why) return why;
    std::vector<float> r;
    std::vector<int> fell_back;
    newton_status(batch, steps, r, &fell_back);
    for (int b = 0; b < batch; b++) {
        if (steps[b] < 0) trouble = fmt("matrix %d left the convergence region (||M - I||_F = %.2e)", b, r[b]);
        // the scaled steps must work where the tests look (a silent fallback would leave them untested)
        else if (fell_back[b] && v.start == NEWTON_SCALED)
            trouble = fmt("matrix %d: the scaled iteration failed, the unscaled rerun ended at ||M - I||_F = %.2e", b,
                          r[b]);
    }
    return nullptr;
}

// One group: a batch of n x n matrices (one per case), every p, every variant (and, for batch > 1, each variant
// must also give every matrix what the oracle gives it).
static void test_roots_group(int n, const std::vector<MatF>& As, const std::vector<std::string>& names, float eps,
                             const std::vector<int>& ps) {
    int batch = (int)As.size();
    size_t nn = (size_t)n * n;
    MatF all;
    for (auto& a : As) all.insert(all.end(), a.begin(), a.end());
    float* d_A = to_device(all.data(), all.size());
    float* d_X = device_poisoned(all.size());
    for (int p : ps) {
        std::vector<RootOracle> oracles;
        for (auto& a : As) oracles.push_back(oracle_inv_root(n, a.data(), eps, p));
        for (const RootVariant& v : ROOT_VARIANTS) {
            std::string label = fmt("%s n=%d batch=%d p=%d", v.name, n, batch, p);
            cudaCheck(cudaMemset(d_X, 0xFF, all.size() * sizeof(float)));
            std::vector<int> steps;
            std::string trouble;
            const char* why = run_root_variant(v, d_A, d_X, batch, n, p, eps, steps, trouble);
            if (why) { skip(label, why); continue; }
            std::string start = v.version != 1 ? "" : v1_start_text();
            cudaCheck(cudaDeviceSynchronize());
            MatF X = to_host(d_X, all.size());
            for (int b = 0; b < batch; b++) {
                const RootOracle& o = oracles[b];
                double kappa = o.lmax / o.lmin;
                RootTol t = root_tolerance(v.method, n, p, kappa);
                const float* Xb = X.data() + b * nn;
                double e = rel_err(nn, Xb, o.X.data()), res = root_residual(n, p, Xb, As[b].data(), eps);
                bool ok = trouble.empty() && e <= t.rel && res <= t.res;  // NaN compares false: fails
                report(ok, label + " " + names[b],
                       fmt("kappa_eff %.1e, %d steps%s, rel err %.2e (tol %.2e), residual %.2e (tol %.2e)%s%s",
                           kappa, steps[b], start.c_str(), e, t.rel, res, t.res, trouble.empty() ? "" : ": ",
                           trouble.c_str()));
            }
        }
    }
    cudaCheck(cudaFree(d_A));
    cudaCheck(cudaFree(d_X));
}

// Version 1's lower-triangle product (gemm_lower) against its full product (gemm_nn, 3xTF32 concat) on the GPU: the
// output (poisoned first) exactly symmetric, and each element within the two products' error bounds of the full
// product's lower element: each is at most (12 + 3N) u sum_k |a_ik b_kj| from the exact product (the split drops
// lo lo, r b and a r, 12 u; K = 3N sums, truncating at worst). Sizes with and without padding, batches, each b.
static void test_gemm_lower_gpu(Rng& rng) {
    struct { int n, bs, batch; } cases[] = {{37, 64, 1}, {100, 64, 2}, {130, 64, 3}, {256, 128, 1}, {257, 128, 1},
                                            {300, 256, 2}, {1024, 128, 1}};
    for (auto& c : cases) {
        int n = c.n, batch = c.batch, N = (int)ceil_div_ll(n, c.bs) * c.bs;
        size_t nn = (size_t)n * n, total = nn * batch;
        MatF A(total), B(total);
        for (auto& v : A) v = (float)rng.normal();
        for (auto& v : B) v = (float)rng.normal();
        float *d_A = to_device(A.data(), total), *d_B = to_device(B.data(), total);
        float *d_full = device_poisoned(total), *d_low = device_poisoned(total);
        gemm_nn(d_A, d_B, d_full, n, batch, PREC_3XTF32);
        gemm_lower(d_A, d_B, d_low, n, batch, c.bs);
        cudaCheck(cudaDeviceSynchronize());
        MatF full = to_host(d_full, total), low = to_host(d_low, total);
        double worst = 0.0;
        bool symmetric = true;
        for (int m = 0; m < batch; m++)
            for (int i = 0; i < n; i++)
                for (int j = 0; j <= i; j++) {
                    size_t lo = m * nn + (size_t)i * n + j, up = m * nn + (size_t)j * n + i;
                    symmetric &= low[lo] == low[up];  // NaN: false
                    double scale = 0.0;
                    for (int k = 0; k < n; k++) scale += std::fabs((double)A[m * nn + (size_t)i * n + k] *
                                                                   B[m * nn + (size_t)k * n + j]);
                    double d = std::fabs((double)low[lo] - full[lo]) / (scale + 1e-30);
                    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
                }
        double tol = 2.0 * (12.0 + 3.0 * N) * U32;
        report(symmetric && worst <= tol, fmt("v1 lower product n=%d b=%d batch=%d", n, c.bs, batch),
               fmt("%s, worst |lower - full| / sum |a b| = %.2e (tol %.2e)", symmetric ? "symmetric" : "NOT symmetric",
                   worst, tol));
        float* fs[] = {d_A, d_B, d_full, d_low};
        for (float* f : fs) cudaCheck(cudaFree(f));
    }
}

static void test_roots_gpu(Rng& rng) {
    float eps = 1e-6f;
    auto cases = [&](int n) {
        std::vector<MatF> As;
        std::vector<std::string> names;
        for (const SpdCase& c : SPD_CASES) {
            As.push_back(make_spd(n, c.kappa, c.zeros_div ? std::max(1, n / c.zeros_div) : 0, rng));
            names.push_back(c.name);
        }
        return std::make_pair(As, names);
    };
    // single matrices: each case alone (syevd; v2 padded to 64 and 128)
    for (int n : {37, 100}) {
        auto c = cases(n);
        for (size_t i = 0; i < c.first.size(); i++) test_roots_group(n, {c.first[i]}, {c.second[i]}, eps, {1, 2, 4});
    }
    // batches: the five cases together (syevjBatched at n = 24, syevd per matrix at 70; v2 padded to 32 and 128)
    for (int n : {24, 70}) {
        auto c = cases(n);
        test_roots_group(n, c.first, c.second, eps, {1, 2, 4});
    }
    // a size past the fused kernel and two 64-tiles; 1x1 matrices
    test_roots_group(257, {make_spd(257, 1e4, 0, rng)}, {"kappa 1e4"}, eps, {4});
    test_roots_group(1, {MatF{2.5f}, MatF{1e-3f}, MatF{0.0f}}, {"2.5", "1e-3", "0"}, eps, {1, 2, 4});
}

// the five SPD_CASES at size n (make_spd, in order), one by one in As and side by side in all
static void spd_case_batch(int n, Rng& rng, std::vector<MatF>* As, MatF* all) {
    for (const SpdCase& c : SPD_CASES) {
        As->push_back(make_spd(n, c.kappa, c.zeros_div ? n / c.zeros_div : 0, rng));
        all->insert(all->end(), As->back().begin(), As->back().end());
    }
}

// Versions 2 and 3's start (lanczos23_start) against its twin (lanczos_warp_cpu, lanczos_newton_start): the Lanczos
// steps, the tridiagonal and the row sums bit for bit (the same operations in the same order); z and lo within the
// multisection's brackets (1e-7 and 1e-4 relative: the kernel's fused multiply-adds there may move a count by one
// point). Every padded size (32, 64, 128), a batch of the five cases, in each shape that runs the start (version 3's
// one block; version 2's layout and threads; version 3's cluster threads): every split of the products among warps.
static void test_start_shape_gpu(Rng& rng, int shape) {
    float eps = 1e-6f;
    const char* shape_name[] = {"v3", "v2 shape", "v3 pair shape"};
    for (int n : {5, 32, 37, 64, 80, 100, 128}) {
        std::vector<MatF> As;
        MatF all;
        spd_case_batch(n, rng, &As, &all);
        int batch = (int)As.size();
        float* d_A = to_device(all.data(), all.size());
        double* d_out;
        cudaCheck(cudaMalloc(&d_out, batch * LANCZOS23_OUT * sizeof(double)));
        std::string label = fmt("%s start (warp Lanczos) n=%d batch=%d against its twin", shape_name[shape], n, batch);
        const char* why = lanczos23_start(d_A, batch, n, eps, d_out, shape);
        if (why) {
            skip(label, why);
        } else {
            std::vector<double> out(batch * LANCZOS23_OUT);
            copy_to_host(out.data(), d_out, out.size() * sizeof(double));
            for (int b = 0; b < batch; b++) {
                MatF Areg = As[b];
                for (int i = 0; i < n; i++) Areg[(size_t)i * n + i] += eps;
                double alpha[LANCZOS_STEPS], beta[LANCZOS_STEPS], rowsum_max, z = NAN, lo = NAN;
                int k = lanczos_warp_cpu(n, Areg.data(), alpha, beta, &rowsum_max);
                lanczos_newton_start(alpha, beta, k, &z, &lo, lanczos23_multisection_cpu(n));
                const double* o = out.data() + b * LANCZOS23_OUT;
                bool same = o[0] == k && o[3] == rowsum_max;
                for (int j = 0; j < k && same; j++)
                    same = o[4 + j] == alpha[j] && o[4 + LANCZOS23_STEPS + j] == beta[j];
                bool near = std::fabs(o[1] - z) <= 1e-6 * z && std::fabs(o[2] - lo) <= 2e-4 * lo + 1e-300;
                report(same && near, label + " " + SPD_CASES[b].name,
                       fmt("%d steps (twin %d), tridiagonal and row sums %s; z %.9e (twin %.9e), lo %.6e (twin %.6e)",
                           (int)o[0], k, same ? "bitwise equal" : "DIFFER", o[1], z, o[2], lo));
            }
        }
        cudaCheck(cudaFree(d_out));
        cudaCheck(cudaFree(d_A));
    }
}
static void test_start_gpu(Rng& rng) {
    for (int shape : {LZ23_V3, LZ23_V2, LZ23_V3_PAIR}) test_start_shape_gpu(rng, shape);
}

// Version 1's start (v1_lanczos: lanczos_tile_kernel up to n = LZT_COLS) against its twin (lanczos_grid_cpu): the
// tridiagonal, the step count and the row sum bit for bit; z and lo within the multisection's brackets as above.
// Above LZT_COLS (lanczos_kernel, atomics) the sums' order differs: the steps, and z to 1e-3 (z = 1 / (theta_max +
// ||residual||); once orthogonality is lost the order moves the residual term: 4.3e-4 of z at n = 1100 on the H100).
static void test_v1_start_gpu(Rng& rng) {
    float eps = 1e-6f;
    for (int n : {5, 32, 37, 100, 256, 1000, 1024, 1100}) {
        std::vector<MatF> As;
        std::vector<std::string> names;
        if (n <= 256) {
            for (const SpdCase& c : SPD_CASES) {
                As.push_back(make_spd(n, c.kappa, c.zeros_div ? n / c.zeros_div : 0, rng));
                names.push_back(c.name);
            }
        } else {  // 0.1 I + G G^T / 256, G n x 256 Gaussian (make_spd is O(n^3) on the host)
            const int m = 256;
            MatF G((size_t)n * m), A((size_t)n * n);
            for (float& x : G) x = (float)rng.normal();
            for (int i = 0; i < n; i++)
                for (int j = 0; j < n; j++) {
                    double t = i == j ? 0.1 * m : 0.0;
                    for (int c = 0; c < m; c++) t += (double)G[(size_t)i * m + c] * G[(size_t)j * m + c];
                    A[(size_t)i * n + j] = (float)(t / m);
                }
            As.push_back(A);
            names.push_back("0.1 I + G G^T / 256");
        }
        for (size_t b = 0; b < As.size(); b++) {
            float* d_A = to_device(As[b].data(), As[b].size());
            LanczosStart ls;
            std::vector<double> h;
            bool ok = v1_lanczos(d_A, n, eps, ls, &h);
            cudaCheck(cudaFree(d_A));
            std::string label = fmt("v1 start (grid Lanczos) n=%d against its twin %s", n, names[b].c_str());
            if (h.empty()) {
                skip(label, "no cooperative launch");
                continue;
            }
            double alpha[LANCZOS_STEPS], beta[LANCZOS_STEPS], rowsum_max, z = NAN, lo = NAN;
            int k = lanczos_grid_cpu(n, As[b].data(), eps, alpha, beta, &rowsum_max), kk = (int)(h.size() - 2) / 2;
            lanczos_newton_start(alpha, beta, k, &z, &lo);
            bool same = ls.k == k && h[2 * kk + 1] == rowsum_max;
            for (int j = 0; j < k && same; j++) same = h[j] == alpha[j] && h[kk + j] == beta[j];
            bool near = std::fabs(ls.z - z) <= 1e-6 * z && std::fabs(ls.lo - lo) <= 2e-4 * lo + 1e-300;
            bool pass = n <= LZT_COLS ? ok && same && near
                                      : ok && ls.k == k && std::fabs(ls.z - z) <= 1e-3 * z &&
                                            std::fabs(h[2 * kk + 1] - rowsum_max) <= 1e-5 * rowsum_max;
            report(pass, label,
                   fmt("%d steps (twin %d), tridiagonal and row sum %s; z %.9e (twin %.9e), lo %.6e (twin %.6e)", ls.k,
                       k, same ? "bitwise equal" : "differ", ls.z, z, ls.lo, lo));
        }
    }
}

// The fallback of versions 2 and 3: with an estimate of lambda_max 100x too small (NEWTON_SCALED_BAD_HI) every
// matrix's scaled iteration fails, and the unscaled rerun must give each its root within the usual tolerance.
static void test_fallback_gpu(Rng& rng) {
    int n = 37;
    float eps = 1e-6f;
    std::vector<MatF> As;
    MatF all;
    spd_case_batch(n, rng, &As, &all);
    int batch = (int)As.size();
    size_t nn = (size_t)n * n;
    float* d_A = to_device(all.data(), all.size());
    float* d_X = device_poisoned(all.size());
    for (int p : {1, 2, 4})
        for (const RootVariant& v : ROOT_VARIANTS) {
            if ((v.version != 2 && v.version != 3) || v.start != NEWTON_SCALED) continue;
            RootVariant bad = v;
            bad.start = NEWTON_SCALED_BAD_HI;
            std::string label = fmt("%s n=%d batch=%d p=%d, lambda_max estimate 100x low: unscaled rerun", v.name, n,
                                    batch, p);
            cudaCheck(cudaMemset(d_X, 0xFF, all.size() * sizeof(float)));
            const char* why = launch_fused_variant(bad, d_A, d_X, batch, n, p, eps);
            if (why) { skip(label, why); continue; }
            std::vector<int> steps, fell_back;
            std::vector<float> r;
            newton_status(batch, steps, r, &fell_back);
            MatF X = to_host(d_X, all.size());
            for (int b = 0; b < batch; b++) {
                RootOracle o = oracle_inv_root(n, As[b].data(), eps, p);
                RootTol t = root_tolerance(v.method, n, p, o.lmax / o.lmin);
                double e = rel_err(nn, X.data() + b * nn, o.X.data());
                double res = root_residual(n, p, X.data() + b * nn, As[b].data(), eps);
                report(steps[b] >= 0 && fell_back[b] && e <= t.rel && res <= t.res, label + " " + SPD_CASES[b].name,
                       fmt("%s, %d steps in all, rel err %.2e (tol %.2e), residual %.2e (tol %.2e)",
                           fell_back[b] ? "fell back" : "did NOT fall back", steps[b], e, t.rel, res, t.res));
            }
        }
    cudaCheck(cudaFree(d_A));
    cudaCheck(cudaFree(d_X));
}

// Newton-Schulz: the GPU result against the float64 run of the same iteration. Tolerance: 3x the error of the bf16
// twin (the same roundings at the same points; the GPU differs by its fp32 summation orders), at least 4 bf16 ulps;
// singular values inside the float64 run's range widened by 0.03 (8 bf16 ulps at 1).
static void test_ns_gpu(Rng& rng) {
    struct { int m, n, batch; double kappa; } cases[] = {{37, 53, 1, 1e2}, {100, 30, 1, 1e2}, {64, 64, 2, 30},
                                                         {48, 80, 3, 0}, {130, 70, 2, 1e2}, {1, 17, 1, 1}};
    for (auto& cs : cases) {
        size_t mn = (size_t)cs.m * cs.n;
        MatF all;
        for (int b = 0; b < cs.batch; b++) {
            MatF G(mn);
            if (cs.kappa > 0) G = make_with_singular_values(cs.m, cs.n, cs.kappa, rng);
            else for (auto& v : G) v = (float)rng.normal();
            all.insert(all.end(), G.begin(), G.end());
        }
        float* d_G = to_device(all.data(), all.size());
        float* d_out = device_poisoned(all.size());
        newton_schulz(d_G, d_out, cs.batch, cs.m, cs.n);
        MatF out = to_host(d_out, all.size());
        for (int b = 0; b < cs.batch; b++) {
            std::vector<double> xd, xe;
            ns_cpu<false>(cs.m, cs.n, all.data() + b * mn, xd);
            ns_cpu<true>(cs.m, cs.n, all.data() + b * mn, xe);
            std::vector<double> got(out.begin() + b * mn, out.begin() + (b + 1) * mn);
            double e = rel_err(mn, got.data(), xd.data()), e_twin = rel_err(mn, xe.data(), xd.data());
            double tol = std::max(3.0 * e_twin, 4.0 / 256.0);
            std::vector<double> sd = singular_values(cs.m, cs.n, xd.data());
            std::vector<double> sg = singular_values(cs.m, cs.n, got.data());
            bool band = sg.front() >= sd.front() - 0.03 && sg.back() <= sd.back() + 0.03;
            report(e <= tol && band, fmt("newton-schulz %dx%d batch %d matrix %d", cs.m, cs.n, cs.batch, b),
                   fmt("rel err vs float64 %.2e (tol %.2e = max(3 x bf16 twin's %.2e, 4 ulp)), singular values "
                       "[%.3f, %.3f] (float64 run [%.3f, %.3f])", e, tol, e_twin, sg.front(), sg.back(), sd.front(),
                       sd.back()));
        }
        cudaCheck(cudaFree(d_G));
        cudaCheck(cudaFree(d_out));
    }
}

// |got - ref| <= gamma_{K+4} scale: any fp32 summation order of K products, the rounding of alpha (computed in
// fp32 from the decay), its product and the beta term; and, for our kernel, exact symmetry (each element is written
// to both places from one register).
static void check_stats(const std::string& name, const MatF& got, const MatD& ref, const MatD& scale, int N, int K,
                        bool exact_symmetry) {
    double k = K + 4.0, gamma = k * U32 / (1.0 - k * U32);
    double worst = 0.0;
    long long bad = -1;
    bool symmetric = true;
    for (size_t i = 0; i < ref.size(); i++) {
        double err = std::fabs((double)got[i] - ref[i]), tol = gamma * scale[i] + 1e-30;
        if (!(err <= tol) && bad < 0) bad = (long long)i;  // NaN fails
        if (err / tol > worst || std::isnan(err)) worst = std::isnan(err) ? INFINITY : err / tol;
        size_t r = i / ((size_t)N * N) * N * N, e = i % ((size_t)N * N), ii = e / N, jj = e % N;
        if (exact_symmetry && got[i] != got[r + jj * N + ii]) symmetric = false;
    }
    report(bad < 0 && symmetric, name,
           fmt("worst |err| / (gamma_%d scale) = %.3f%s%s", K + 4, worst,
               bad >= 0 ? fmt(", first bad element %lld: %g vs %g", bad, got[bad], ref[bad]).c_str() : "",
               symmetric ? "" : ", not exactly symmetric"));
}

static MatF random_symmetric(int N, int batch, Rng& rng) {
    MatF C((size_t)batch * N * N);
    for (int b = 0; b < batch; b++)
        for (int i = 0; i < N; i++)
            for (int j = 0; j <= i; j++)
                C[((size_t)b * N + i) * N + j] = C[((size_t)b * N + j) * N + i] = (float)rng.normal();
    return C;
}

static void test_stats_gpu(Rng& rng) {
    // Shampoo, ours and cuBLAS syrk: beta = 0 with C poisoned (must not be read), running averages, sums
    struct { int m, n, batch; float alpha, beta; } sh[] = {{37, 53, 1, 1.0f, 0.0f}, {70, 19, 3, 0.05f, 0.95f},
                                                          {130, 65, 1, 1.0f, 1.0f}, {1, 200, 2, 0.1f, 0.9f},
                                                          {64, 64, 1, 1.0f, 0.0f}};
    for (auto& c : sh) {
        size_t mn = (size_t)c.m * c.n, mm = (size_t)c.m * c.m, nn = (size_t)c.n * c.n;
        MatF G((size_t)c.batch * mn);
        for (auto& v : G) v = (float)rng.normal();
        MatF L0 = random_symmetric(c.m, c.batch, rng), R0 = random_symmetric(c.n, c.batch, rng);
        MatD refL, refR, scL, scR;
        for (int b = 0; b < c.batch; b++) {
            const float* g = G.data() + b * mn;
            MatD r, s;
            syrk_oracle(c.m, c.n, [&](int i, int k) { return (double)g[(size_t)i * c.n + k]; }, c.alpha, c.beta,
                        c.beta != 0.0f ? L0.data() + b * mm : nullptr, r, s);
            refL.insert(refL.end(), r.begin(), r.end());
            scL.insert(scL.end(), s.begin(), s.end());
            syrk_oracle(c.n, c.m, [&](int i, int k) { return (double)g[(size_t)k * c.n + i]; }, c.alpha, c.beta,
                        c.beta != 0.0f ? R0.data() + b * nn : nullptr, r, s);
            refR.insert(refR.end(), r.begin(), r.end());
            scR.insert(scR.end(), s.begin(), s.end());
        }
        float* d_G = to_device(G.data(), G.size());
        for (int impl = 0; impl < 2; impl++) {
            float* d_L = c.beta != 0.0f ? to_device(L0.data(), L0.size()) : device_poisoned(L0.size());
            float* d_R = c.beta != 0.0f ? to_device(R0.data(), R0.size()) : device_poisoned(R0.size());
            if (impl == 0) shampoo_stats(d_G, d_L, d_R, c.batch, c.m, c.n, c.alpha, c.beta);
            else shampoo_stats_cublas(d_G, d_L, d_R, c.batch, c.m, c.n, c.alpha, c.beta);
            std::string base = fmt("%s %dx%d batch %d alpha %g beta %g",
                                   impl ? "shampoo cublas syrk" : "shampoo syrk_lower", c.m, c.n, c.batch, c.alpha,
                                   c.beta);
            check_stats(base + " L = G G^T", to_host(d_L, L0.size()), refL, scL, c.m, c.n, impl == 0);
            check_stats(base + " R = G^T G", to_host(d_R, R0.size()), refR, scR, c.n, c.m, impl == 0);
            cudaCheck(cudaFree(d_L));
            cudaCheck(cudaFree(d_R));
        }
        cudaCheck(cudaFree(d_G));
    }
    // K-FAC, linear layer inputs (with and without the bias's 1) and output gradients
    struct { int B, d; bool bias; float decay; } lin[] = {{33, 45, true, 0.9f}, {7, 130, false, 0.0f}};
    for (auto& c : lin) {
        int N = c.d + (c.bias ? 1 : 0);
        MatF a((size_t)c.B * c.d);
        for (auto& v : a) v = (float)rng.normal();
        MatF A0 = random_symmetric(N, 1, rng);
        MatD ref, sc;
        syrk_oracle(N, c.B, [&](int i, int k) { return i == c.d ? 1.0 : (double)a[(size_t)k * c.d + i]; },
                    (1.0 - c.decay) / c.B, c.decay, c.decay != 0.0f ? A0.data() : nullptr, ref, sc);
        float* d_a = to_device(a.data(), a.size());
        float* d_A = c.decay != 0.0f ? to_device(A0.data(), A0.size()) : device_poisoned(A0.size());
        kfac_linear_stats(d_a, d_A, c.B, c.d, c.bias, c.decay);
        check_stats(fmt("kfac linear A B=%d d=%d bias %d decay %g", c.B, c.d, (int)c.bias, c.decay),
                    to_host(d_A, A0.size()), ref, sc, N, c.B, true);
        cudaCheck(cudaMemset(d_A, 0xFF, A0.size() * sizeof(float)));
        kfac_grad_stats(d_a, d_A, c.B, c.d, 0.0f);  // G = E[g g^T] of the same rows read as gradients
        syrk_oracle(c.d, c.B, [&](int i, int k) { return (double)a[(size_t)k * c.d + i]; }, 1.0 / c.B, 0.0, nullptr,
                    ref, sc);
        MatF got = to_host(d_A, (size_t)c.d * c.d);
        check_stats(fmt("kfac grad G rows=%d d=%d", c.B, c.d), got, ref, sc, c.d, c.B, true);
        cudaCheck(cudaFree(d_a));
        cudaCheck(cudaFree(d_A));
    }
    // K-FAC, 3x3 convolution patches read from NHWC in place: padded, unpadded, MNIST's conv2 at batch 4
    struct { int B, H, W, C, pad; bool bias; float decay; } conv[] = {{2, 7, 6, 5, 1, true, 0.95f},
                                                                       {3, 9, 10, 8, 0, false, 0.0f},
                                                                       {4, 26, 26, 32, 0, false, 0.0f}};
    for (auto& c : conv) {
        int OH = c.H + 2 * c.pad - 2, OW = c.W + 2 * c.pad - 2, F = 9 * c.C + (c.bias ? 1 : 0), P = c.B * OH * OW;
        MatF x((size_t)c.B * c.H * c.W * c.C);
        for (auto& v : x) v = (float)rng.normal();
        MatF A0 = random_symmetric(F, 1, rng);
        MatD ref, sc;
        syrk_oracle(F, P, [&](int f, int k) { return f == 9 * c.C ? 1.0 : im2col_value(x.data(), c.H, c.W, c.C, c.pad,
                                                                                      f, k); },
                    (1.0 - c.decay) / P, c.decay, c.decay != 0.0f ? A0.data() : nullptr, ref, sc);
        float* d_x = to_device(x.data(), x.size());
        float* d_A = c.decay != 0.0f ? to_device(A0.data(), A0.size()) : device_poisoned(A0.size());
        kfac_conv_stats(d_x, d_A, c.B, c.H, c.W, c.C, c.pad, c.bias, c.decay);
        check_stats(fmt("kfac conv A B=%d H=%d W=%d C=%d pad %d bias %d decay %g", c.B, c.H, c.W, c.C, c.pad,
                        (int)c.bias, c.decay), to_host(d_A, A0.size()), ref, sc, F, P, true);
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_A));
    }
}

static bool gpu_available(std::string& why) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        why = err != cudaSuccess ? std::string("no CUDA GPU (") + cudaGetErrorString(err) + ")" : "no CUDA GPU";
        cudaGetLastError();  // clear the error so later calls do not see it
        return false;
    }
    return true;
}

static int run_tests(uint64_t seed) {
    printf("matrix_roots --test (seed %llu)\n", (unsigned long long)seed);
    Rng rng{seed};
    auto t0 = std::chrono::steady_clock::now();
    test_oracle(rng);
    test_newton_twin(rng);
    test_newton_scalar();
    test_scaled_pieces(rng);
    test_scaled_steps_bench(rng);
    test_lanczos_twin(rng);
    test_v1_options();
    test_f16_parts_cpu(rng);
    test_lower_blocks_cpu(rng);
    test_ns_cpu(rng);
    test_stats_oracle(rng);
    test_tc_fragments(rng);
    for (int n : {37, 70, 130}) {
        test_v4_product_emulated<64>(rng, n);
        test_v4_product_emulated<32>(rng, n);
    }
    test_v3_unit_map<32, 1>();
    test_v3_unit_map<64, 1>();
    test_v3_unit_map<64, 2>();
    test_v3_unit_map<128, 1>();
    test_v3_unit_map<128, 2>();
    printf("(CPU checks: %.1f s)\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::string why;
    if (!gpu_available(why)) {
        for (const char* v : {"inverse roots version 0 (cuSOLVER)", "inverse roots version 1 (Newton on cuBLAS)",
                              "inverse roots version 2 (fused Newton)",
                              "inverse roots version 3 (fused Newton on tensor cores)",
                              "inverse roots version 4 (cooperative Newton on tensor cores)",
                              "Newton-Schulz (cuBLAS bf16)",
                              "Kronecker statistics (SYRK-like kernel, cuBLAS syrk)"})
            skip(v, why);
        return finish();
    }
    gpu_init();
    printf("GPU: %s (sm_%d%d, %d SMs, %zu bytes of shared memory per block)\n", g_gpu.name, g_gpu.cc_major,
           g_gpu.cc_minor, g_gpu.sms, g_gpu.smem_optin);
    test_gemm_lower_gpu(rng);
    test_roots_gpu(rng);
    test_fallback_gpu(rng);
    test_start_gpu(rng);
    test_v1_start_gpu(rng);
    test_ns_gpu(rng);
    test_stats_gpu(rng);
    gpu_free();
    return finish();
}

// ----------------------------------------------------------------------------------------------------------------
// --bench: every version at n = 64 .. 4096 and batches, p = 4 (Shampoo's root), in ms. Inputs like Shampoo's
// statistics: A = G G^T / (2 n) with G an n x 2n Gaussian matrix (eigenvalues in about [0.09, 2.9]) and eps = 1e-6.
// Timing: CUDA events around each call after a warm-up call, median of repeats (as many as fit 0.3 s, 1 to 20).
// Checks of every row: the residual ||X^4 (A + eps I) - I||_F / sqrt(n) of the batch's first matrix (fp32 products
// on the GPU) and the relative difference to version 0's X over the whole batch.

__global__ void fill_normal_kernel(float* x, long long count, uint64_t seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        uint64_t z = seed + 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);  // splitmix64 of the index
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        double u1 = ((z >> 40) + 1.0) / 16777217.0, u2 = ((z >> 16) & 0xFFFFFF) / 16777216.0;
        x[i] = (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
}

static const char* g_json_path = nullptr;  // --json
static bool g_quick = false;                // --quick

struct BenchRow {
    std::string op, shape, version;
    double ms;
    int steps;
    double check;           // residual (roots), rel diff (stats), mean sigma^2 (Newton-Schulz)
    double diff;            // roots: rel diff to version 0 (-1: none)
    bool ok;
};

template <typename F>
static double time_ms(F fn) {
    fn();
    cudaCheck(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    auto once = [&]() {
        cudaCheck(cudaEventRecord(e0));
        fn();
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        float ms = 0.0f;
        cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        return (double)ms;
    };
    double first = once();
    int reps = (int)std::min(20.0, std::max(1.0, std::floor(300.0 / std::max(first, 1e-3))));
    std::vector<double> t{first};
    for (int r = 1; r < reps; r++) t.push_back(once());
    std::sort(t.begin(), t.end());
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    return t[t.size() / 2];
}

// ||X^p (A + eps I) - I||_F / sqrt(n) of one matrix, fp32 products on the GPU (a check of the benchmark's results;
// its own rounding is u sqrt(n) kappa, far below the 1e-3 threshold at these condition numbers)
static double gpu_root_residual(const float* X, const float* A, int n, int p, float eps) {
    long long nn = (long long)n * n;
    float *areg, *pw, *tmp;
    cudaCheck(cudaMalloc(&areg, nn * sizeof(float)));
    cudaCheck(cudaMalloc(&pw, nn * sizeof(float)));
    cudaCheck(cudaMalloc(&tmp, nn * sizeof(float)));
    add_eps_kernel<<<grid_for(nn, 256), 256>>>(A, areg, n, nn, eps);
    launchCheck();
    cudaCheck(cudaMemcpy(pw, X, nn * sizeof(float), cudaMemcpyDeviceToDevice));
    for (int q = 1; q < p; q *= 2) {
        gemm_nn(pw, pw, tmp, n, 1, PREC_FP32);
        std::swap(pw, tmp);
    }
    gemm_nn(pw, areg, tmp, n, 1, PREC_FP32);
    double* sums;
    cudaCheck(cudaMalloc(&sums, sizeof(double)));
    sumsq(tmp, sums, nullptr, 1, nn, n, p, 1.0f);
    double h = 0.0;
    cudaCheck(cudaMemcpy(&h, sums, sizeof(double), cudaMemcpyDeviceToHost));
    float* fs[] = {areg, pw, tmp};
    for (float* f : fs) cudaCheck(cudaFree(f));
    cudaCheck(cudaFree(sums));
    return std::sqrt(h / n);
}

static double rel_diff_device(const float* a, const float* b, size_t count) {
    MatF ha = to_host(a, count), hb = to_host(b, count);
    std::vector<double> hbd(hb.begin(), hb.end());
    return rel_err(count, ha.data(), hbd.data());
}

static void bench_roots(std::vector<BenchRow>& rows, int n, int batch) {
    const int p = 4;
    const float eps = 1e-6f;
    long long nn = (long long)n * n, total = nn * batch;
    float *G, *A, *X, *X0;
    cudaCheck(cudaMalloc(&G, 2 * total * sizeof(float)));
    cudaCheck(cudaMalloc(&A, total * sizeof(float)));
    cudaCheck(cudaMalloc(&X, total * sizeof(float)));
    cudaCheck(cudaMalloc(&X0, total * sizeof(float)));
    fill_normal_kernel<<<grid_for(2 * total, 256), 256>>>(G, 2 * total, 1234 + n + batch);
    launchCheck();
    syrk_lower(RowsLoader{G, 2 * nn, 2 * n}, A, batch, n, 2 * n, 1.0f / (2 * n), 0.0f);
    std::string shape = batch > 1 ? fmt("%d x %d^2", batch, n) : fmt("%d^2", n);
    for (const RootVariant& v : ROOT_VARIANTS) {
        if ((v.version == 2 || v.version == 3) && n > 128) continue;
        if (v.version == 4 && batch > 16) continue;  // one cooperative launch per matrix: for large matrices
        std::vector<int> steps;
        std::string trouble;
        const char* why = nullptr;
        // versions 2 to 4 need no host synchronisation: their status is read after the timing, not inside it
        double ms = time_ms([&]() {
            why = v.version >= 2 ? launch_fused_variant(v, A, X, batch, n, p, eps)
                                 : run_root_variant(v, A, X, batch, n, p, eps, steps, trouble);
        });
        if (why) {
            printf("  (%s at %s skipped: %s)\n", v.name, shape.c_str(), why);
            continue;
        }
        if (v.version >= 2) run_root_variant(v, A, X, batch, n, p, eps, steps, trouble);
        if (v.version == 0) cudaCheck(cudaMemcpy(X0, X, total * sizeof(float), cudaMemcpyDeviceToDevice));
        BenchRow r{"inv 4th root", shape, v.name, ms, *std::max_element(steps.begin(), steps.end()), 0.0, -1.0, true};
        r.check = gpu_root_residual(X, A, n, p, eps);
        r.diff = v.version == 0 ? 0.0 : rel_diff_device(X, X0, total);
        r.ok = trouble.empty() && r.check <= 1e-3 && r.diff <= 1e-3;  // kappa ~ 35: expected ~1e-6
        rows.push_back(r);
        printf("  %-14s %-12s %-18s %10.3f ms %4d steps  residual %.1e  diff to v0 %.1e%s%s\n", r.op.c_str(),
               shape.c_str(), v.name, ms, r.steps, r.check, r.diff, v.version == 1 ? v1_start_text().c_str() : "",
               r.ok ? "" : "  CHECK FAILED");
        fflush(stdout);
    }
    if (batch == 1) {  // version 1's scaled start alone: the Lanczos kernel and its one copy to the host
        LanczosStart ls;
        bool ok = false;
        double ms = time_ms([&]() { ok = v1_lanczos(A, n, eps, ls); });
        BenchRow r{"lanczos", shape, "v1 coop", ms, ls.k, ls.lo, -1.0, ok};
        rows.push_back(r);
        printf("  %-14s %-12s %-18s %10.3f ms %4d steps  M0 in [%.3e, 1], 1 / z %.4e, ||M0||_inf %.3f%s\n",
               r.op.c_str(), shape.c_str(), r.version.c_str(), ms, ls.k, ls.lo, 1.0 / ls.z, ls.z * ls.rowsum_max,
               ok ? "" : "  CHECK FAILED (not run)");
    }
    if (n <= 128) {  // versions 2 and 3's start alone (every matrix of the batch), matrix 0 against its twin
        double* d_out;
        cudaCheck(cudaMalloc(&d_out, batch * LANCZOS23_OUT * sizeof(double)));
        const char* why = nullptr;
        double ms = time_ms([&]() { why = lanczos23_start(A, batch, n, eps, d_out); });
        if (why) {
            printf("  (v3 start at %s skipped: %s)\n", shape.c_str(), why);
        } else {
            double o[LANCZOS23_OUT], alpha[LANCZOS_STEPS], beta[LANCZOS_STEPS], rowsum_max, z = NAN, lo = NAN;
            copy_to_host(o, d_out, sizeof o);
            MatF A0 = to_host(A, nn);
            for (int i = 0; i < n; i++) A0[(size_t)i * n + i] += eps;
            int k = lanczos_warp_cpu(n, A0.data(), alpha, beta, &rowsum_max);
            lanczos_newton_start(alpha, beta, k, &z, &lo, lanczos23_multisection_cpu(n));
            bool ok = o[0] == k && o[3] == rowsum_max && std::fabs(o[1] - z) <= 1e-6 * z;
            BenchRow r{"lanczos", shape, "v3 start", ms, (int)o[0], o[2], -1.0, ok};
            rows.push_back(r);
            printf("  %-14s %-12s %-18s %10.3f ms %4d steps  M0 in [%.3e, 1], 1 / z %.4e, ||M0||_inf %.3f%s\n",
                   r.op.c_str(), shape.c_str(), r.version.c_str(), ms, (int)o[0], o[2], 1.0 / o[1], o[1] * o[3],
                   ok ? "" : "  CHECK FAILED (twin differs)");
        }
        cudaCheck(cudaFree(d_out));
    }
    float* fs[] = {G, A, X, X0};
    for (float* f : fs) cudaCheck(cudaFree(f));
}

static void bench_ns(std::vector<BenchRow>& rows, int m, int n, int batch) {
    long long total = (long long)m * n * batch;
    float *G, *out;
    cudaCheck(cudaMalloc(&G, total * sizeof(float)));
    cudaCheck(cudaMalloc(&out, total * sizeof(float)));
    fill_normal_kernel<<<grid_for(total, 256), 256>>>(G, total, 99 + m + n);
    launchCheck();
    double ms = time_ms([&]() { newton_schulz(G, out, batch, m, n); });
    // mean squared singular value of the first matrix: ||out||_F^2 / min(m, n), inside [0.68^2, 1.21^2]
    MatF h = to_host(out, (size_t)m * n);
    double s = 0.0;
    for (float v : h) s += (double)v * v;
    s /= std::min(m, n);
    std::string shape = batch > 1 ? fmt("%d x %dx%d", batch, m, n) : fmt("%dx%d", m, n);
    BenchRow r{"newton-schulz", shape, "cublas bf16", ms, NS_STEPS, s, -1.0, s >= 0.68 * 0.68 && s <= 1.21 * 1.21};
    rows.push_back(r);
    printf("  %-14s %-12s %-18s %10.3f ms            mean sigma^2 %.3f%s\n", r.op.c_str(), shape.c_str(),
           r.version.c_str(), ms, s, r.ok ? "" : "  CHECK FAILED");
    fflush(stdout);
    cudaCheck(cudaFree(G));
    cudaCheck(cudaFree(out));
}

static void bench_stats(std::vector<BenchRow>& rows, int m, int n, int batch) {
    long long mn = (long long)m * n * batch, mm = (long long)m * m * batch, nn2 = (long long)n * n * batch;
    float *G, *L, *R, *L2, *R2;
    cudaCheck(cudaMalloc(&G, mn * sizeof(float)));
    cudaCheck(cudaMalloc(&L, mm * sizeof(float)));
    cudaCheck(cudaMalloc(&R, nn2 * sizeof(float)));
    cudaCheck(cudaMalloc(&L2, mm * sizeof(float)));
    cudaCheck(cudaMalloc(&R2, nn2 * sizeof(float)));
    fill_normal_kernel<<<grid_for(mn, 256), 256>>>(G, mn, 7 + m);
    launchCheck();
    std::string shape = batch > 1 ? fmt("%d x %dx%d", batch, m, n) : fmt("%dx%d", m, n);
    double ms0 = time_ms([&]() { shampoo_stats_cublas(G, L2, R2, batch, m, n, 1.0f, 0.0f); });
    double ms1 = time_ms([&]() { shampoo_stats(G, L, R, batch, m, n, 1.0f, 0.0f); });
    double d = std::max(rel_diff_device(L, L2, mm), rel_diff_device(R, R2, nn2));
    rows.push_back({"shampoo L,R", shape, "cublas syrk", ms0, 0, 0.0, -1.0, true});
    rows.push_back({"shampoo L,R", shape, "syrk_lower", ms1, 0, d, -1.0, d <= 1e-5});
    printf("  %-14s %-12s %-18s %10.3f ms\n", "shampoo L,R", shape.c_str(), "cublas syrk", ms0);
    printf("  %-14s %-12s %-18s %10.3f ms            rel diff to cublas %.1e%s\n", "shampoo L,R", shape.c_str(),
           "syrk_lower", ms1, d, d <= 1e-5 ? "" : "  CHECK FAILED");
    float* fs[] = {G, L, R, L2, R2};
    for (float* f : fs) cudaCheck(cudaFree(f));
}

static void bench_kfac_conv(std::vector<BenchRow>& rows, int B, int H, int W, int C) {
    long long count = (long long)B * H * W * C;
    int F = 9 * C;
    float *x, *A;
    cudaCheck(cudaMalloc(&x, count * sizeof(float)));
    cudaCheck(cudaMalloc(&A, (long long)F * F * sizeof(float)));
    fill_normal_kernel<<<grid_for(count, 256), 256>>>(x, count, 5);
    launchCheck();
    double ms = time_ms([&]() { kfac_conv_stats(x, A, B, H, W, C, 0, false, 0.0f); });
    std::string shape = fmt("%dx%dx%dx%d", B, H, W, C);
    rows.push_back({"kfac conv A", shape, "syrk_lower im2col", ms, 0, 0.0, -1.0, true});
    printf("  %-14s %-12s %-18s %10.3f ms            (A: %d x %d from %d patches)\n", "kfac conv A", shape.c_str(),
           "syrk_lower im2col", ms, F, F, B * (H - 2) * (W - 2));
    cudaCheck(cudaFree(x));
    cudaCheck(cudaFree(A));
}

static int run_bench() {
    std::string why;
    if (!gpu_available(why)) {
        printf("the benchmark needs a GPU: %s (./dev/matrix_roots --test runs the CPU checks)\n", why.c_str());
        return 0;
    }
    gpu_init();
    printf("matrix_roots --bench on %s (sm_%d%d, %d SMs)%s\n", g_gpu.name, g_gpu.cc_major, g_gpu.cc_minor, g_gpu.sms,
           g_quick ? " --quick" : "");
    std::vector<BenchRow> rows;
    std::vector<int> singles = g_quick ? std::vector<int>{128, 1024} : std::vector<int>{64, 128, 256, 512, 1024, 2048,
                                                                                        4096};
    std::vector<std::pair<int, int>> batches = g_quick ? std::vector<std::pair<int, int>>{{64, 128}}
                                                       : std::vector<std::pair<int, int>>{{1024, 32}, {256, 64},
                                                                                          {64, 128}, {16, 512}};
    for (int n : singles) bench_roots(rows, n, 1);
    for (auto& b : batches) bench_roots(rows, b.second, b.first);
    bench_ns(rows, 1024, 1024, 1);
    bench_ns(rows, 64, 128, 128);
    if (!g_quick) {
        bench_ns(rows, 4096, 4096, 1);
        bench_ns(rows, 4096, 1024, 1);
        bench_ns(rows, 256, 2304, 1);
    }
    bench_stats(rows, 1024, 4096, 1);
    bench_stats(rows, 128, 128, 64);
    bench_kfac_conv(rows, 64, 26, 26, 32);
    gpu_free();
    int bad = (int)std::count_if(rows.begin(), rows.end(), [](const BenchRow& r) { return !r.ok; });
    if (g_json_path) {
        std::string tmp = std::string(g_json_path) + ".tmp";
        FILE* f = fopen(tmp.c_str(), "w");
        if (!f) { fprintf(stderr, "error: cannot write %s: %s\n", tmp.c_str(), strerror(errno)); return 1; }
        for (auto& r : rows)
            fprintf(f, "{\"op\": \"%s\", \"shape\": \"%s\", \"version\": \"%s\", \"ms\": %.6f, \"steps\": %d, "
                    "\"check\": %.3e, \"diff_to_v0\": %.3e, \"ok\": %s, \"device\": \"%s\"}\n", r.op.c_str(),
                    r.shape.c_str(), r.version.c_str(), r.ms, r.steps, r.check, r.diff, r.ok ? "true" : "false",
                    g_gpu.name);
        if (fclose(f) != 0 || rename(tmp.c_str(), g_json_path) != 0) {
            fprintf(stderr, "error: cannot write %s: %s\n", g_json_path, strerror(errno));
            return 1;
        }
        printf("wrote %s\n", g_json_path);
    }
    if (bad) printf("%d rows failed their check\n", bad);
    return bad ? 1 : 0;
}

// ----------------------------------------------------------------------------------------------------------------
// command line

static void usage() {
    printf("usage: ./dev/matrix_roots [--test | --bench | --study] [--flag value ...]\n"
           "Inverse p-th roots, Newton-Schulz and Kronecker statistics (issue 21): GPU versions against a float64\n"
           "CPU oracle, and timings.\n"
           "Flags (default in brackets):\n"
           "  --test        every check: the CPU oracle and twins (no GPU needed), then every GPU version\n"
           "  --bench       time every version at n = 64 .. 4096 and batches (the default mode)\n"
           "  --study       CPU only: the iterations in fp32 / 3xTF32 / TF32 / bf16 against the oracle\n"
           "  --quick       --bench: fewer sizes and repeats\n"
           "  --json FILE   --bench: also write the table as JSON lines to FILE [none]\n"
           "  --seed S      random seed of the test matrices [1]\n"
           "  --help        this help\n");
}


int main(int argc, char** argv) {
    enum { BENCH, TEST, STUDY } mode = BENCH;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto value = [&](const char* flag) -> const char* {
            if (i + 1 >= argc) { fprintf(stderr, "error: flag %s expects a value, found none\n", flag); exit(1); }
            return argv[++i];
        };
        if (a == "--help" || a == "-h") { usage(); return 0; }
        else if (a == "--test") mode = TEST;
        else if (a == "--bench") mode = BENCH;
        else if (a == "--study") mode = STUDY;
        else if (a == "--quick") g_quick = true;
        else if (a == "--json") g_json_path = value("--json");
        else if (a == "--seed") {
            const char* v = value("--seed");
            char* end = nullptr;
            errno = 0;
            unsigned long long s = strtoull(v, &end, 10);
            if (*v == '\0' || *v == '-' || *end != '\0' || errno) {
                fprintf(stderr, "error: flag --seed expects a non-negative integer, found '%s'\n", v);
                return 1;
            }
            seed = s;
        } else {
            fprintf(stderr, "error: unknown flag %s (see --help)\n", a.c_str());
            return 1;
        }
    }
    if (mode == TEST) return run_tests(seed);
    if (mode == STUDY) return run_study(seed);
    return run_bench();
}

#endif  // DEV_KERNELS_ONLY
