/*
dev/groupnorm.cu: GroupNorm(32 groups, eps 1e-5) over NHWC with the optional fused SiLU, forward and backward, as
train_unet.cu runs it, checked against a CPU oracle (double), PyTorch fixtures (dev/fixtures/unet_layer_groupnorm.bin,
unet_layer_groupnorm_silu.bin, dev/unet_layers.py; the oracle against them runs in CI) and timed.

  make -C dev groupnorm && ./dev/groupnorm --test     # oracle vs PyTorch; GPU vs PyTorch and the oracle at
                                                       # awkward sizes, poisoned outputs
  ./dev/groupnorm                                      # validate + benchmark the UNet's shapes at batch 32

version 1 (the only one so far, train_unet.cu): statistics as per-(sample, channel) partial sums over pixel chunks
(chan_reduce_kernel MODE 0, double accumulators, coalesced over channels), a per-(sample, group) finalize, then
an elementwise apply; backward: per-(sample, channel) sums of dz and dz*xhat (MODE 1), a finalize giving dgamma,
dbeta and the two group means, then an elementwise dx. Every reduction has a fixed order (deterministic).
Next version: fuse the apply into the following convolution's loader (the statistics are all it needs).
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"  // counters, checks, PyTorch fixtures

static void cpu_gn(const float* x, const float* gamma, const float* beta, const float* dy, float* y, float* dx,
                   float* dgamma, float* dbeta, int B, int P, int C, int silu) {
    const int G = 32, cg = C / G;
    for (int c = 0; c < C; c++) dgamma[c] = dbeta[c] = 0.f;
    std::vector<double> dg(C, 0.0), db(C, 0.0);
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) {
            double s = 0, ss = 0, n = (double)P * cg;
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) s += x[((size_t)b * P + p) * C + c];
            double mu = s / n;
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) {
                    double d = x[((size_t)b * P + p) * C + c] - mu;
                    ss += d * d;
                }
            double rs = 1.0 / sqrt(ss / n + 1e-5);
            double m1 = 0, m2 = 0;
            std::vector<double> dz((size_t)P * cg), xh((size_t)P * cg);
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) {
                    size_t i = ((size_t)b * P + p) * C + c, j = (size_t)p * cg + c - g * cg;
                    xh[j] = (x[i] - mu) * rs;
                    double z = xh[j] * gamma[c] + beta[c];
                    double sg = 1.0 / (1.0 + exp(-z));
                    y[i] = (float)(silu ? z * sg : z);
                    dz[j] = dy[i] * (silu ? sg * (1 + z * (1 - sg)) : 1.0);
                    dg[c] += dz[j] * xh[j];
                    db[c] += dz[j];
                    m1 += dz[j] * gamma[c];
                    m2 += dz[j] * gamma[c] * xh[j];
                }
            m1 /= n;
            m2 /= n;
            for (int p = 0; p < P; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) {
                    size_t i = ((size_t)b * P + p) * C + c, j = (size_t)p * cg + c - g * cg;
                    dx[i] = (float)(rs * (dz[j] * gamma[c] - m1 - xh[j] * m2));
                }
        }
    for (int c = 0; c < C; c++) {
        dgamma[c] = (float)dg[c];
        dbeta[c] = (float)db[c];
    }
}

// |got - ref| <= rel * (max|ref| + |ref|): fp32 arithmetic on O(1) values with double sums
static void check(const std::string& name, const float* d_got, const float* ref, size_t n, double rel) {
    std::vector<float> got = to_host(d_got, n);
    double scale = 0;
    for (size_t i = 0; i < n; i++) scale = std::max(scale, (double)fabsf(ref[i]));
    check_close(name, got.data(), ref, n, rel * scale, rel);
}

static void run_case(int B, int P, int C, int silu, uint64_t seed, bool bench) {
    UNet m;
    m.B = B;
    NormP n;
    n.C = C;
    n.w = 0;
    n.b = C;
    m.n_params = 2 * C;
    m.p = dev_alloc(2 * C);
    m.g = dev_alloc(2 * C);
    m.red_ws_items = (size_t)1024 * 2048;
    cudaCheck(cudaMalloc(&m.red_ws, m.red_ws_items * sizeof(double2)));
    cudaCheck(cudaMalloc(&m.gn_coef, (size_t)B * C * sizeof(float4)));
    cudaCheck(cudaMalloc(&m.gn_scale, (size_t)B * C * sizeof(float2)));
    size_t N = (size_t)B * P * C;
    std::vector<float> x(N), dy(N), gb(2 * C), y(N), dx(N), dg(C), db(C);
    uint64_t k = 0;
    for (auto& v : x) v = 3.f * rng_uniform(seed, 1, k++) - 1.f;  // mean 0.5: the one-pass variance must cope
    for (auto& v : dy) v = 2.f * rng_uniform(seed, 2, k++) - 1.f;
    for (int c = 0; c < C; c++) {
        gb[c] = 0.5f + rng_uniform(seed, 3, c);
        gb[C + c] = rng_uniform(seed, 4, c) - 0.5f;
    }
    cpu_gn(x.data(), gb.data(), gb.data() + C, dy.data(), y.data(), dx.data(), dg.data(), db.data(), B, P, C, silu);
    float *d_x = dev_alloc(N), *d_y = dev_alloc(N), *d_dy = dev_alloc(N), *d_dx = dev_alloc(N);
    float *mean = dev_alloc(B * 32), *rstd = dev_alloc(B * 32);
    cudaCheck(cudaMemcpy(d_x, x.data(), N * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_dy, dy.data(), N * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(m.p, gb.data(), 2 * C * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemset(d_y, 0xFF, N * 4));
    cudaCheck(cudaMemset(d_dx, 0xFF, N * 4));
    cudaCheck(cudaMemset(m.g, 0xFF, 2 * C * 4));
    groupnorm_forward(&m, n, d_x, d_y, mean, rstd, P, silu);
    groupnorm_backward(&m, n, d_x, d_dy, d_dx, mean, rstd, P, silu, false);
    char name[96];
    snprintf(name, sizeof name, "B%d P%d C%d silu%d", B, P, C, silu);
    // forward/dx: fp32 elementwise math on O(1) values: 1e-5; dgamma/dbeta: sums of B*P*C/32 terms kept in double
    check(std::string(name) + " y", d_y, y.data(), N, 1e-5);
    check(std::string(name) + " dx", d_dx, dx.data(), N, 1e-4);
    check(std::string(name) + " dgamma", m.g, dg.data(), C, 1e-5);
    check(std::string(name) + " dbeta", m.g + C, db.data(), C, 1e-5);
    if (bench) {
        cudaEvent_t e0, e1;
        cudaCheck(cudaEventCreate(&e0));
        cudaCheck(cudaEventCreate(&e1));
        float ms[2];
        for (int pass = 0; pass < 2; pass++) {
            cudaCheck(cudaEventRecord(e0));
            for (int i = 0; i < 20; i++) {
                if (pass == 0) groupnorm_forward(&m, n, d_x, d_y, mean, rstd, P, silu);
                else groupnorm_backward(&m, n, d_x, d_dy, d_dx, mean, rstd, P, silu, false);
            }
            cudaCheck(cudaEventRecord(e1));
            cudaCheck(cudaEventSynchronize(e1));
            cudaCheck(cudaEventElapsedTime(&ms[pass], e0, e1));
            ms[pass] /= 20;
        }
        // forward reads x twice and writes y: 3N floats; backward reads x, dy twice and writes dx: 5N floats
        printf("     %s: forward %.3f ms (%.0f GB/s), backward %.3f ms (%.0f GB/s)\n", name, ms[0],
               3.0 * N * 4 / (ms[0] * 1e6), ms[1], 5.0 * N * 4 / (ms[1] * 1e6));
    }
    float* fs[] = {d_x, d_y, d_dy, d_dx, mean, rstd, m.p, m.g};
    for (float* f : fs) cudaCheck(cudaFree(f));
    cudaCheck(cudaFree(m.red_ws));
    cudaCheck(cudaFree(m.gn_coef));
    cudaCheck(cudaFree(m.gn_scale));
}

// ---------------------------------------------------------------------------------------------------------------
// PyTorch fixtures: unet_layer_groupnorm.bin (GroupNorm32(64) on (3, 64, 5, 7)) and unet_layer_groupnorm_silu.bin
// (GroupNorm32(96) + SiLU on (2, 96, 3, 5)), x with mean 0.5, fp32.
// Tolerances: y is elementwise after fp32 statistics over a group of n = P*C/32 <= 105 values (torch: Welford in
// fp32, relative error ~n*2^-24 ~ 6e-6): atol 2e-5 of the scale, rtol 1e-5; dx and dgamma/dbeta add fp32 sums of
// n or B*P <= 105 products: atol 5e-5 of the scale, rtol 1e-5.
static void fixture_case(const std::string& name, int code, int silu) {
    Fixture fx;
    if (!fixture_open(&fx, name, code)) return;
    std::string pre = silu ? "0." : "";
    std::vector<int> xs = fx_shape(&fx, "x");
    if (!fx.ok || xs.size() != 4) {
        if (fx.ok) report(false, "fixture " + name + ": x must have 4 dims");
        return;
    }
    int B = xs[0], C = xs[1], H = xs[2], W = xs[3], P = H * W;
    std::vector<float> x = fx_get(&fx, "x", xs), gamma = fx_get(&fx, pre + "weight", {C}),
                       beta = fx_get(&fx, pre + "bias", {C}), y = fx_get(&fx, "y", xs), dy = fx_get(&fx, "dy", xs),
                       dx = fx_get(&fx, "dx", xs), dg = fx_get(&fx, "grad." + pre + "weight", {C}),
                       db = fx_get(&fx, "grad." + pre + "bias", {C});
    if (!fx.ok) return;
    x = nchw_to_nhwc(x, B, C, H, W);
    dy = nchw_to_nhwc(dy, B, C, H, W);
    y = nchw_to_nhwc(y, B, C, H, W);
    dx = nchw_to_nhwc(dx, B, C, H, W);
    size_t N = x.size();
    std::vector<float> cy(N), cdx(N), cdg(C), cdb(C);
    cpu_gn(x.data(), gamma.data(), beta.data(), dy.data(), cy.data(), cdx.data(), cdg.data(), cdb.data(), B, P, C, silu);
    check_scaled("cpu oracle vs torch " + name + " y", cy, y, 2e-5, 1e-5);
    check_scaled("cpu oracle vs torch " + name + " dx", cdx, dx, 5e-5, 1e-5);
    check_scaled("cpu oracle vs torch " + name + " grad weight", cdg, dg, 5e-5, 1e-5);
    check_scaled("cpu oracle vs torch " + name + " grad bias", cdb, db, 5e-5, 1e-5);
    if (!g_have_gpu) {
        skip("v1 vs torch " + name + ": no CUDA GPU");
        return;
    }
    UNet m;
    m.B = B;
    NormP n;
    n.C = C; n.w = 0; n.b = C;
    m.n_params = 2 * C;
    std::vector<float> gb(gamma);
    gb.insert(gb.end(), beta.begin(), beta.end());
    m.p = to_device(gb);
    m.g = dev_alloc(2 * C);
    m.red_ws_items = (size_t)1024 * 2048;
    cudaCheck(cudaMalloc(&m.red_ws, m.red_ws_items * sizeof(double2)));
    cudaCheck(cudaMalloc(&m.gn_coef, (size_t)B * C * sizeof(float4)));
    cudaCheck(cudaMalloc(&m.gn_scale, (size_t)B * C * sizeof(float2)));
    float *d_x = to_device(x), *d_dy = to_device(dy), *d_y = dev_alloc(N), *d_dx = dev_alloc(N);
    float *mean = dev_alloc(B * 32), *rstd = dev_alloc(B * 32);
    poison(d_y, N);
    poison(d_dx, N);
    poison(m.g, 2 * C);
    groupnorm_forward(&m, n, d_x, d_y, mean, rstd, P, silu);
    groupnorm_backward(&m, n, d_x, d_dy, d_dx, mean, rstd, P, silu, false);
    check_scaled("v1 vs torch " + name + " y", to_host(d_y, N), y, 2e-5, 1e-5);
    check_scaled("v1 vs torch " + name + " dx", to_host(d_dx, N), dx, 5e-5, 1e-5);
    check_scaled("v1 vs torch " + name + " grad weight", to_host(m.g, C), dg, 5e-5, 1e-5);
    check_scaled("v1 vs torch " + name + " grad bias", to_host(m.g + C, C), db, 5e-5, 1e-5);
    float* fs[] = {d_x, d_y, d_dy, d_dx, mean, rstd, m.p, m.g};
    for (float* f : fs) cudaCheck(cudaFree(f));
    cudaCheck(cudaFree(m.red_ws));
    cudaCheck(cudaFree(m.gn_coef));
    cudaCheck(cudaFree(m.gn_scale));
}

int main(int argc, char** argv) {
    bool test = lab_version(argc, argv, 1, 1, "1: train_unet.cu's GroupNorm") == 0;
    gpu_setup();
    fixture_case("groupnorm", 1004, 0);  // the CPU part runs in CI
    fixture_case("groupnorm_silu", 1005, 1);
    if (!g_have_gpu) {
        skip("groupnorm GPU version 1 vs the CPU oracle: no CUDA GPU");
        return finish();
    }
    int cases[][4] = {{3, 49, 64, 1}, {2, 37, 96, 0}, {5, 64, 448, 1}, {1, 7, 32, 1}, {4, 100, 320, 0}};
    uint64_t seed = 1;
    for (auto& c : cases) run_case(c[0], c[1], c[2], c[3], seed++, false);
    if (!test) {
        int shapes[][3] = {{32, 4096, 64}, {32, 4096, 192}, {32, 1024, 256}, {32, 256, 448}, {32, 64, 512}};
        for (auto& s : shapes) run_case(s[0], s[1], s[2], 1, seed++, true);
    }
    gpu_teardown();
    return finish();
}
