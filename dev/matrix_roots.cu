/*
dev/matrix_roots.cu: matrix functions for second-order optimizers (issue 21, items 1 and 2).

Inverse p-th roots X = (A + eps I)^(-1/p), p = 1, 2, 4, of symmetric positive semi-definite fp32 matrices, one n x n
matrix or a batch of them (row-major, contiguous), as Shampoo uses them; Muon's Newton-Schulz orthogonalisation;
the Kronecker-factor statistics of Shampoo (L = G G^T, R = G^T G) and K-FAC (A = E[a a^T], G = E[g g^T]).

  make -C dev matrix_roots && ./dev/matrix_roots --test     the CPU oracle checks (run without a GPU, in CI), then
                                                            every GPU version against the oracle
  ./dev/matrix_roots --bench [--quick] [--json FILE]        time every version (n = 64 .. 4096 and batches), in ms
  ./dev/matrix_roots --study                                CPU only: fp32 / TF32 / bf16 emulations of the
                                                            iterations against the oracle (dev/matrix_roots_NOTES.md)
  python3 dev/matrix_roots.py                               PyTorch's eigh and coupled Newton in the same run

Inverse roots:
version 0: cuSOLVER eigendecomposition: syevd per matrix (syevjBatched for batches of n <= 32), then
           X = V diag(max(lambda, eps)^(-1/p)) V^T by a scaled copy of V and one strict-fp32 GEMM.
version 1: coupled Newton iteration on cuBLAS: TF32 tensor-core products while the iteration converges, then M =
           X^p A recomputed in strict fp32 and fp32 steps to the end (strict fp32 throughout where the TF32 phase
           is not safe, see newton_tf32_safe); one host decision per iteration from ||M - I||_F.
version 2: one kernel runs the whole coupled Newton iteration of a matrix in shared memory (fp32 FMA, products in
           place through registers), one block per matrix, n <= 128 (n <= 64 where shared memory is short).
Newton-Schulz (Muon): the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, (a, b, c) = (3.4445, -4.7750,
           2.0315), 5 steps on X0 = G / (||G||_F + 1e-7), bf16 operands and fp32 accumulation (cuBLAS GemmEx), a
           batch of same-shape matrices, tall ones transposed.
Kronecker statistics: C = beta C + alpha P P^T computing only the lower triangle and mirroring it (a SYRK-like
           kernel): P = G (Shampoo L), G^T (Shampoo R), the layer inputs a (K-FAC A, optionally with a column of
           ones for the bias), the 3x3 im2col patches of an NHWC input (K-FAC A of a convolution, read in place), the
           output gradients (K-FAC G). beta = 0 never reads C. cuBLAS syrk is the baseline.
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
#include <string>
#include <type_traits>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <cusolverDn.h>

// ----------------------------------------------------------------------------------------------------------------
// error checking

static void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "[CUDA ERROR] %s failed at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)
// every kernel launch is followed by this
#define launchCheck() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

static void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "[cuBLAS ERROR] %s failed at %s:%d: status %d\n", call, file, line, (int)status);
        exit(EXIT_FAILURE);
    }
}
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)

static void cusolver_check(cusolverStatus_t status, const char* call, const char* file, int line) {
    if (status != CUSOLVER_STATUS_SUCCESS) {
        fprintf(stderr, "[cuSOLVER ERROR] %s failed at %s:%d: status %d (7 = internal error, 3 = invalid value: "
                "check n, lda and the workspace size)\n", call, file, line, (int)status);
        exit(EXIT_FAILURE);
    }
}
#define cusolverCheck(call) cusolver_check((call), #call, __FILE__, __LINE__)

static void fail_arg(const char* fn, const char* what, long long found, const char* expected) {
    fprintf(stderr, "%s: argument %s = %lld, expected %s\n", fn, what, found, expected);
    exit(EXIT_FAILURE);
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
};

// Steps the scalar map needs from the smallest eigenvalue M0 can have (z eps: A positive semi-definite) and from
// the largest ((p + 1) / 2) to within 1e-4 of 1; every eigenvalue in between needs no more (the map is increasing
// on (0, 1] and decreasing on [1, p + 1)). Plus slack for rounding.
static int newton_max_iter(int p, double m_min) {
    auto steps = [p](double m) {
        int k = 0;
        while (std::fabs(1.0 - m) > 1e-4 && k < 1000) { m *= std::pow((p + 1 - m) / p, p); k++; }
        return k;
    };
    return std::max(steps(std::max(m_min, 1e-30)), steps((p + 1) / 2.0)) + 8;
}

// Called with r = ||M - I||_F before each step (the largest over a batch); says what to do next.
static NewtonAction newton_decide(NewtonState& s, double r) {
    s.r = r;
    // after the first step every eigenvalue of M is in (0, 1], so ||M - I||_F <= sqrt(n): far above it, rounding
    // has pushed an eigenvalue out of the convergence region
    if (!std::isfinite(r) || r > 2.0 * std::sqrt((double)s.n) + 2.0) { s.failed = true; return NEWTON_FAIL; }
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
// CPU twins of the GPU iterations in fp32, with the GPU's reduced-precision products emulated (operands rounded to
// TF32 or bf16, fp32 sums): they run in CI, where the GPU versions cannot, and --study measures with them.

enum Prec { PREC_FP32, PREC_3XTF32, PREC_TF32, PREC_BF16 };
static const char* prec_name(Prec p) {
    return p == PREC_FP32 ? "fp32" : p == PREC_3XTF32 ? "3xtf32" : p == PREC_TF32 ? "tf32" : "bf16";
}

static float round_prec(float x, Prec p) {
    if (p == PREC_FP32 || p == PREC_3XTF32 || !std::isfinite(x)) return x;
    uint32_t u;
    memcpy(&u, &x, 4);
    if (p == PREC_TF32) u = (u + 0x1000u) & ~0x1FFFu;           // 10 mantissa bits, ties away (cvt.rna.tf32)
    else u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;      // 7 mantissa bits, ties to even (bf16)
    memcpy(&x, &u, 4);
    return x;
}

// C = A B (n x n), operands rounded to prec, fp32 sums in k order. 3xTF32: one sum over the concatenated
// k ranges of a_hi b_hi, a_hi b_lo and a_lo b_hi (hi = TF32 rounding, lo = TF32 rounding of the rest), as version 1
// runs it (one GEMM with K = 3n).
static void matmul_f(int n, const float* A, const float* B, float* C, Prec prec) {
    size_t nn = (size_t)n * n;
    bool split = prec == PREC_3XTF32;
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
    auto accumulate = [n, C](const MatF& a, const MatF& b) {
        for (int i = 0; i < n; i++)
            for (int k = 0; k < n; k++) {
                float aik = a[(size_t)i * n + k];
                const float* bk = &b[(size_t)k * n];
                float* ci = C + (size_t)i * n;
                for (int j = 0; j < n; j++) ci[j] = fmaf(aik, bk[j], ci[j]);
            }
    };
    accumulate(ah, bh);
    if (split) {
        accumulate(ah, bl);
        accumulate(al, bh);
    }
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
static void matpow_f(int n, int p, const float* Y, float* P, Prec prec) {
    if (p == 1) { std::copy(Y, Y + (size_t)n * n, P); return; }
    matmul_f(n, Y, Y, P, prec);
    if (p == 4) {
        MatF t(P, P + (size_t)n * n);
        matmul_f(n, t.data(), t.data(), P, prec);
    }
}

// The coupled Newton iteration of versions 1 and 2 on the CPU, products in prec.
static NewtonState newton_cpu(int n, int p, float eps, const float* A, float* X, Prec prec) {
    size_t nn = (size_t)n * n;
    MatF Areg(A, A + nn), M(nn), T(nn), Tp(nn), W(nn);
    for (int i = 0; i < n; i++) Areg[(size_t)i * n + i] += eps;
    double nrm = 0.0;
    for (float v : Areg) nrm += (double)v * v;
    float z = (float)((p + 1) / (2.0 * std::sqrt(nrm)));
    NewtonState s;
    s.n = n;
    s.p = p;
    s.max_iter = newton_max_iter(p, z * (double)eps);
    float x0 = std::pow(z, 1.0f / p);
    for (size_t i = 0; i < nn; i++) { M[i] = z * Areg[i]; X[i] = 0.0f; }
    for (int i = 0; i < n; i++) X[(size_t)i * n + i] = x0;
    for (;;) {
        NewtonAction act = newton_decide(s, frob_minus_identity(n, M.data()));
        if (act == NEWTON_FAIL) break;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++)
                T[(size_t)i * n + j] = ((i == j ? (float)(p + 1) : 0.0f) - M[(size_t)i * n + j]) / (float)p;
        matmul_f(n, X, T.data(), W.data(), prec);
        std::copy(W.begin(), W.end(), X);
        if (act == NEWTON_LAST) break;
        matpow_f(n, p, T.data(), Tp.data(), prec);
        matmul_f(n, Tp.data(), M.data(), W.data(), prec);
        M.swap(W);
        s.iters++;
    }
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
// fp32 A + eps I, already move lambda_min by u lambda_max. Measured constants (--study, and numpy's fp32 syevd on
// the same matrices for version 0; dev/matrix_roots_NOTES.md), each tolerance about 3x the worst case measured:
//   eigendecomposition: rel err <= 0.02 u kappa / p + 0.3 u sqrt(n) (kappa 1)   -> tol u (2 sqrt(n) + 0.2 kappa / p)
//   coupled Newton fp32: rel err <= 0.075 u sqrt(n) kappa / p (it loses ~10x to the eigendecomposition at large kappa)
//                                                                                 -> tol u sqrt(n) (2 + 0.25 kappa / p)
//   coupled Newton 3xTF32: 2-3x the fp32 errors (operands carry 21-22 bits)       -> tol u sqrt(n) (4 + 0.75 kappa / p)
//   residual ||X^p A - I||_F / sqrt(n), every method: <= 0.7 u sqrt(n) kappa  -> tol u sqrt(n) (2 p + 2 kappa), 3xTF32
//                                                                               u sqrt(n) (4 p + 4 kappa)
constexpr double U32 = 5.9604644775390625e-08;  // 2^-24, the unit roundoff of fp32
enum RootMethod { METHOD_EIG, METHOD_NEWTON_FP32, METHOD_NEWTON_3XTF32 };
struct RootTol { double rel, res; };
static RootTol root_tolerance(RootMethod m, int n, int p, double kappa) {
    double sn = std::sqrt((double)n);
    if (m == METHOD_EIG) return {U32 * (2.0 * sn + 0.2 * kappa / p), U32 * sn * (2.0 * p + 2.0 * kappa)};
    if (m == METHOD_NEWTON_FP32) return {U32 * sn * (2.0 + 0.25 * kappa / p), U32 * sn * (2.0 * p + 2.0 * kappa)};
    return {U32 * sn * (4.0 + 0.75 * kappa / p), U32 * sn * (4.0 * p + 4.0 * kappa)};
}

// ----------------------------------------------------------------------------------------------------------------
// --study (CPU only): how the iterations behave in each precision, against the oracle. Its output is the
// measurement behind the tolerances and the precision choices (dev/matrix_roots_NOTES.md).

struct SpdCase { const char* name; double kappa; int zeros_div; };  // zeros_div > 0: n / zeros_div zero eigenvalues
static const SpdCase SPD_CASES[] = {{"kappa 1", 1.0, 0}, {"kappa 1e2", 1e2, 0}, {"kappa 1e4", 1e4, 0},
                                    {"kappa 1e6", 1e6, 0}, {"singular", 1e2, 4}};

static int run_study(uint64_t seed) {
    printf("coupled Newton, CPU twin: rel err vs the float64 oracle / residual ||X^p A - I||_F / sqrt(n) / steps "
           "(fast-phase steps), A with lambda_max = 1\n");
    printf("%-4s %-3s %-10s %-7s %-7s | %-23s | %-23s | %-23s | %-23s\n", "n", "p", "case", "eps", "kap_eff",
           "fp32", "3xtf32", "tf32", "bf16");
    Rng rng{seed};
    double worst[4][2] = {};  // fp32, 3xtf32: max rel err / tol and residual / tol
    for (int n : {32, 96})
        for (const SpdCase& c : SPD_CASES)
            for (float eps : {1e-6f, 1e-3f}) {
                MatF A = make_spd(n, c.kappa, c.zeros_div ? n / c.zeros_div : 0, rng);
                for (int p : {1, 2, 4}) {
                    RootOracle o = oracle_inv_root(n, A.data(), eps, p);
                    printf("%-4d %-3d %-10s %-7.0e %-7.1e", n, p, c.name, eps, o.lmax / o.lmin);
                    for (Prec prec : {PREC_FP32, PREC_3XTF32, PREC_TF32, PREC_BF16}) {
                        MatF X((size_t)n * n);
                        NewtonState s = newton_cpu(n, p, eps, A.data(), X.data(), prec);
                        double e = rel_err(X.size(), X.data(), o.X.data());
                        double res = root_residual(n, p, X.data(), A.data(), eps);
                        printf(" | %7.1e %7.1e %3d%s", e, res, s.iters, s.failed ? "F" : s.converged ? " " : "s");
                        RootTol t = root_tolerance(prec == PREC_FP32 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32,
                                                   n, p, o.lmax / o.lmin);
                        worst[prec][0] = std::max(worst[prec][0], e / t.rel);
                        worst[prec][1] = std::max(worst[prec][1], res / t.res);
                    }
                    printf("\n");
                    fflush(stdout);
                }
            }
    for (Prec prec : {PREC_FP32, PREC_3XTF32})
        printf("worst over these cases, %s: rel err / tolerance %.3f, residual / tolerance %.3f\n", prec_name(prec),
               worst[prec][0], worst[prec][1]);
    printf("\nNewton-Schulz, bf16 emulation vs float64: rel err, singular values of both (min, max)\n");
    struct { int m, n; double kappa; } shapes[] = {{37, 53, 1e2}, {100, 30, 1e2}, {64, 64, 1e2}, {96, 96, 1e3},
                                                   {128, 64, 10}, {64, 64, 0}, {48, 160, 0}};
    for (auto& sh : shapes) {
        MatF G((size_t)sh.m * sh.n);
        if (sh.kappa > 0) G = make_with_singular_values(sh.m, sh.n, sh.kappa, rng);
        else for (auto& v : G) v = (float)rng.normal();
        std::vector<double> xd, xe, gd(G.begin(), G.end());
        ns_cpu<false>(sh.m, sh.n, G.data(), xd);
        ns_cpu<true>(sh.m, sh.n, G.data(), xe);
        std::vector<double> sg = singular_values(sh.m, sh.n, gd.data()), sd = singular_values(sh.m, sh.n, xd.data()),
                            se = singular_values(sh.m, sh.n, xe.data());
        double fro = 0.0;
        for (double v : sg) fro += v * v;
        printf("%4dx%-4d kappa %-6.0e input s/||G|| [%.1e, %.2f]: rel err %.2e; float64 [%.3f, %.3f], bf16 [%.3f, "
               "%.3f]\n", sh.m, sh.n, sh.kappa, sg.front() / std::sqrt(fro), sg.back() / std::sqrt(fro),
               rel_err(xe.size(), xe.data(), xd.data()), sd.front(), sd.back(), se.front(), se.back());
    }
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
                for (int k = 0; k < n; k++) s += Q[(size_t)k * n + i] * std::pow(d[k] + eps, -1.0 / p) * Q[(size_t)k * n + j];
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
            for (Prec prec : {PREC_FP32, PREC_3XTF32}) {
                MatF X((size_t)n * n);
                NewtonState st = newton_cpu(n, p, eps, A.data(), X.data(), prec);
                RootTol t = root_tolerance(prec == PREC_FP32 ? METHOD_NEWTON_FP32 : METHOD_NEWTON_3XTF32, n, p, kappa);
                double e = rel_err(X.size(), X.data(), o.X.data()), res = root_residual(n, p, X.data(), A.data(), eps);
                report(!st.failed && e <= t.rel && res <= t.res,
                       fmt("cpu twin Newton %s n=%d p=%d %s (kappa_eff %.1e)", prec_name(prec), n, p, c.name, kappa),
                       fmt("%d steps, rel err %.2e (tol %.2e), residual %.2e (tol %.2e)", st.iters, e, t.rel, res,
                           t.res));
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
            report(e_wrong > root_tolerance(METHOD_NEWTON_3XTF32, n, p, kappa).rel,
                   fmt("tolerance rejects the root for 2 eps, %s", c.name),
                   fmt("rel err %.2e > widest tol %.2e", e_wrong, root_tolerance(METHOD_NEWTON_3XTF32, n, p, kappa).rel));
        }
    }
}

// Newton-Schulz: the float64 run maps every singular value s of G / ||G||_F to phi^5(s) (phi(s) = a s + b s^3 +
// c s^5): the sorted singular values of the output equal the sorted phi^5(s_i). The bf16 twin stays within 16 bf16
// ulps (2^-8 relative) of it and inside the quintic's band.
static void test_ns_cpu(Rng& rng) {
    struct { int m, n; double kappa; } shapes[] = {{37, 53, 1e2}, {70, 29, 1e2}, {48, 48, 30}};
    for (auto& sh : shapes) {
        MatF G = make_with_singular_values(sh.m, sh.n, sh.kappa, rng);
        std::vector<double> xd, xe, gd(G.begin(), G.end());
        ns_cpu<false>(sh.m, sh.n, G.data(), xd);
        ns_cpu<true>(sh.m, sh.n, G.data(), xe);
        std::vector<double> sg = singular_values(sh.m, sh.n, gd.data()), sd = singular_values(sh.m, sh.n, xd.data()),
                            se = singular_values(sh.m, sh.n, xe.data());
        double fro = 0.0;
        for (double v : sg) fro += v * v;
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
    test_ns_cpu(rng);
    test_stats_oracle(rng);
    printf("(CPU checks: %.1f s)\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::string why;
    if (!gpu_available(why)) {
        for (const char* v : {"inverse roots version 0 (cuSOLVER)", "inverse roots version 1 (Newton on cuBLAS)",
                              "inverse roots version 2 (fused Newton)", "Newton-Schulz (cuBLAS bf16)",
                              "Kronecker statistics (SYRK-like kernel, cuBLAS syrk)"})
            skip(v, why);
        return finish();
    }
    return finish();
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

static const char* g_json_path = nullptr;
static bool g_quick = false;
static int run_bench();

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

static int run_bench() {
    std::string why;
    if (!gpu_available(why)) {
        printf("the benchmark needs a GPU: %s (./dev/matrix_roots --test runs the CPU checks)\n", why.c_str());
        return 0;
    }
    return 0;
}
