/*
Kernel lab for linear regression: the four versions of train_linreg.cu, checked and benchmarked.

Build:  make -C dev linreg
Check:  ./dev/linreg --test                  every version against the float64 CPU oracle at awkward sizes
Bench:  ./dev/linreg [--bench_json FILE]     per-operation breakdown of one epoch, the versions at 5M points,
                                             and a sweep over sizes from 500 to 100M points

Versions (defined in train_linreg.cu, selected there with --kernel):
  version 1: unfused: forward, loss, gradient, update, four kernels per epoch
  version 2: forward + loss + gradient fused in one kernel with block reductions, then the update kernel
  version 3: version 2 over several CUDA streams, joined with events before the update
  version 4: one persistent cooperative kernel for all epochs, points kept in registers and shared memory
*/
#define TESTING
#include "../train_linreg.cu"

#include <algorithm>

// ----------------------------------------------------------------------------------------------------------------
// CPU oracle: the same algorithm entirely in double (parameters too), independent of the trainer's CPU path.

typedef struct {
    std::vector<double> w;
    double b;
    std::vector<double> losses;
} OracleResult;

static OracleResult linreg_oracle(const float* x, const float* y, int n, int D, int epochs, double lr, double w0, double b0) {
    OracleResult r;
    r.w.assign(D, w0);
    r.b = b0;
    std::vector<double> g(D);
    for (int e = 0; e < epochs; e++) {
        double loss = 0.0, gb = 0.0;
        std::fill(g.begin(), g.end(), 0.0);
        for (int i = 0; i < n; i++) {
            double pred = r.b;
            for (int d = 0; d < D; d++) pred += r.w[d] * x[(size_t)i * D + d];
            double res = pred - y[i];
            loss += res * res;
            gb += res;
            for (int d = 0; d < D; d++) g[d] += res * x[(size_t)i * D + d];
        }
        r.losses.push_back(loss / n);
        for (int d = 0; d < D; d++) r.w[d] -= lr * 2.0 * g[d] / n;
        r.b -= lr * 2.0 * gb / n;
    }
    return r;
}

static int n_pass = 0, n_fail = 0, n_skip = 0;

// Relative error bound of one fp32 training run against the float64 oracle. Each epoch's loss is a sum of n
// squares accumulated in fp32 over at most ~40 terms per thread, then in double: about 40 * 6e-8 = 2.4e-6 relative
// at worst, plus the drift of fp32 parameters over the epochs; 1e-5 is the bound the issue asks for against PyTorch.
#define LINREG_RTOL 1e-5
#define LINREG_ATOL 1e-7  // losses that sit at ~0 (a perfect fit of 2 points) compare absolutely

static double rel_err(double got, double want) { return fabs(got - want) / (LINREG_ATOL / LINREG_RTOL + fabs(want)); }

// Compares a training result with the oracle; prints one PASS/FAIL line naming the worst quantity.
static void check_result(const char* name, const TrainResult& got, const OracleResult& want) {
    double worst = 0.0;
    char where[96] = "none";
    for (size_t e = 0; e < want.losses.size(); e++) {
        double err = std::isfinite(got.train_losses[e]) ? rel_err(got.train_losses[e], want.losses[e]) : INFINITY;
        if (err > worst || std::isnan(err)) { worst = err; snprintf(where, sizeof(where), "loss[%zu] %.9g vs %.9g", e, got.train_losses[e], want.losses[e]); }
    }
    for (size_t d = 0; d < want.w.size(); d++) {
        double err = rel_err(got.w[d], want.w[d]);
        if (err > worst || std::isnan(err)) { worst = err; snprintf(where, sizeof(where), "w[%zu] %.9g vs %.9g", d, got.w[d], want.w[d]); }
    }
    double err = rel_err(got.b, want.b);
    if (err > worst || std::isnan(err)) { worst = err; snprintf(where, sizeof(where), "b %.9g vs %.9g", got.b, want.b); }
    bool ok = worst <= LINREG_RTOL;
    printf("%s %s: max rel err %.3g at %s\n", ok ? "PASS" : "FAIL", name, worst, where);
    ok ? n_pass++ : n_fail++;
}

// Random dataset with D features: x ~ U[-2, 3), y = x.w* + b* + noise (not the trainer's generator on purpose).
static void random_data(LinregData* d, int n, int D, unsigned seed) {
    memset(d, 0, sizeof(*d));
    d->n_points = n;
    d->n_features = D;
    d->n_train = n > 2 ? (int)(0.8 * n) : 1;
    d->x = (float*)mallocCheck(sizeof(float) * (size_t)n * D);
    d->y = (float*)mallocCheck(sizeof(float) * n);
    srand(seed);
    for (size_t i = 0; i < (size_t)n * D; i++) d->x[i] = -2.0f + 5.0f * (float)rand() / RAND_MAX;
    for (int i = 0; i < n; i++) {
        float v = 0.25f;
        for (int k = 0; k < D; k++) v += (0.3f + 0.1f * k) * d->x[(size_t)i * D + k];
        d->y[i] = v + 0.1f * ((float)rand() / RAND_MAX - 0.5f);
    }
}

static int run_tests(void) {
    struct { int n, D, epochs; } cases[] = {
        {2, 1, 30}, {3, 1, 30}, {1000, 1, 50}, {100003, 1, 20}, {1000, 3, 30}, {4099, 7, 20}, {333, 32, 10},
        {6000001, 1, 4},  // 4.8M training points: more than registers + shared memory hold, so the L2 path runs too
    };
    // CPU checks: they run everywhere, CI included.
    for (auto& c : cases) {
        if (c.n > 200000) continue;
        LinregData d;
        random_data(&d, c.n, c.D, 1000 + c.n);
        OracleResult want = linreg_oracle(d.x, d.y, d.n_train, c.D, c.epochs, 0.01, 0.83, 0.7645);
        TrainConfig cfg = {c.epochs, 0.01f, 0.83f, 0.7645f, 0, 1};
        TrainResult got = linreg_train_cpu(&d, &cfg);
        char name[96];
        snprintf(name, sizeof(name), "cpu path N=%d D=%d epochs=%d", c.n, c.D, c.epochs);
        check_result(name, got, want);
        linreg_data_free(&d);
    }
    // Dataset round trip through the file format.
    {
        LinregData d, back;
        random_data(&d, 1001, 3, 7);
        const char* path = "dev/linreg_roundtrip.tmp.bin";
        bool ok = linreg_write_dataset(path, &d) == 0 && linreg_read_dataset(path, &back) == 0 &&
                  back.n_points == d.n_points && back.n_features == 3 && back.n_train == d.n_train &&
                  memcmp(back.x, d.x, sizeof(float) * 3003) == 0 && memcmp(back.y, d.y, sizeof(float) * 1001) == 0;
        printf("%s dataset write/read round trip\n", ok ? "PASS" : "FAIL");
        ok ? n_pass++ : n_fail++;
        remove(path);
        linreg_data_free(&d);
        if (ok) linreg_data_free(&back);
    }
    if (cuda_device_count() == 0) {
        printf("SKIP GPU checks of versions 1-4 at %zu sizes: no CUDA device\n", sizeof(cases) / sizeof(cases[0]));
        n_skip += 4 * (int)(sizeof(cases) / sizeof(cases[0]));
        // The GPU and CPU data generators must agree; on a GPU machine this is checked below.
        printf("SKIP GPU data generation against cuRAND's host generator: no CUDA device\n");
        n_skip++;
        return 0;
    }
    for (auto& c : cases) {
        LinregData d;
        random_data(&d, c.n, c.D, 1000 + c.n);
        OracleResult want = linreg_oracle(d.x, d.y, d.n_train, c.D, c.epochs, 0.01, 0.83, 0.7645);
        float *d_x, *d_y;
        cudaCheck(cudaMalloc(&d_x, sizeof(float) * (size_t)c.n * c.D));
        cudaCheck(cudaMalloc(&d_y, sizeof(float) * c.n));
        cudaCheck(cudaMemcpy(d_x, d.x, sizeof(float) * (size_t)c.n * c.D, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_y, d.y, sizeof(float) * c.n, cudaMemcpyHostToDevice));
        for (int version = 1; version <= 4; version++) {
            LinregGpu g;
            linreg_gpu_build(&g, d_x, d_y, c.n, c.D, d.n_train, c.epochs, 3);
            TrainConfig cfg = {c.epochs, 0.01f, 0.83f, 0.7645f, version, 3};
            TrainResult got = linreg_train_gpu(&g, &cfg);
            char name[96];
            snprintf(name, sizeof(name), "version %d N=%d D=%d epochs=%d", version, c.n, c.D, c.epochs);
            check_result(name, got, want);
            linreg_gpu_free(&g);
        }
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_y));
        linreg_data_free(&d);
    }
    // The GPU generator and cuRAND's host generator (the CPU path) must give the same data: uniform draws are
    // exact; the normal draws may differ by float rounding of the Box-Muller transform.
    {
        LinregData gpu, cpu;
        float ms;
        float *d_x, *d_y;
        linreg_generate(&gpu, 100001, 0.8f, 42, 0.0f, 10.0f, 0.7f, 0.3f, 0.1f, true, &ms, &d_x, &d_y);
        linreg_generate(&cpu, 100001, 0.8f, 42, 0.0f, 10.0f, 0.7f, 0.3f, 0.1f, false, &ms, NULL, NULL);
        double worst_x = 0, worst_y = 0;
        for (int i = 0; i < 100001; i++) {
            worst_x = std::max(worst_x, (double)fabsf(gpu.x[i] - cpu.x[i]));
            worst_y = std::max(worst_y, (double)fabsf(gpu.y[i] - cpu.y[i]));
        }
        bool ok = worst_x == 0.0 && worst_y <= 1e-5;  // y up to ~8: a few ulp of the noise term
        printf("%s GPU data generation equals cuRAND's host generator: max |dx| %.3g, max |dy| %.3g\n", ok ? "PASS" : "FAIL", worst_x, worst_y);
        ok ? n_pass++ : n_fail++;
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_y));
        linreg_data_free(&gpu);
        linreg_data_free(&cpu);
    }
    return 0;
}

// ----------------------------------------------------------------------------------------------------------------
// benchmarks

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0f : v[v.size() / 2];
}

// Median over `reps` runs of `launch` (warm-up first), in ms per run, timed with CUDA events.
template <typename F>
static float time_ms(int reps, F launch) {
    cudaEvent_t a, b;
    cudaCheck(cudaEventCreate(&a));
    cudaCheck(cudaEventCreate(&b));
    launch();
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int r = 0; r < reps; r++) {
        cudaCheck(cudaEventRecord(a));
        launch();
        cudaCheck(cudaEventRecord(b));
        cudaCheck(cudaEventSynchronize(b));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    cudaCheck(cudaEventDestroy(a));
    cudaCheck(cudaEventDestroy(b));
    return median(t);
}

static int run_bench(const char* json_path) {
    if (cuda_device_count() == 0) {
        fprintf(stderr, "error: benchmarks need a CUDA device\n");
        return 1;
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    FILE* js = json_path ? fopen(json_path, "w") : NULL;
    if (json_path && !js) { fprintf(stderr, "error: cannot write %s\n", json_path); return 1; }
    if (js) fprintf(js, "{\n  \"gpu\": \"%s\",\n", prop.name);
    const int epochs = 200;

    // Per-operation breakdown of one epoch at 5M points (4M training).
    {
        LinregData data;
        float gen_ms;
        float *d_x, *d_y;
        linreg_generate(&data, 5000000, 0.8f, 1337, 0.0f, 10.0f, 0.7f, 0.3f, 0.1f, true, &gen_ms, &d_x, &d_y);
        LinregGpu g;
        linreg_gpu_build(&g, d_x, d_y, data.n_points, 1, data.n_train, epochs, 4);
        TrainConfig cfg = {1, 0.0f, 0.83f, 0.7645f, 1, 4};
        linreg_train_gpu(&g, &cfg);  // parameters in place
        int n = g.n_train, rows = linreg_grid_size(n);
        const int reps = 200;
        float t_fwd = time_ms(reps, [&] { linreg_forward_kernel<1><<<rows, LINREG_THREADS>>>(g.x, g.params, n, 1, g.pred); cudaCheck(cudaGetLastError()); });
        float t_loss = time_ms(reps, [&] { linreg_loss_kernel<<<rows, LINREG_THREADS>>>(g.pred, g.y, n, 1, g.partials); cudaCheck(cudaGetLastError()); });
        float t_grad = time_ms(reps, [&] { linreg_gradient_kernel<1><<<rows, LINREG_THREADS>>>(g.x, g.y, g.pred, n, 1, g.partials); cudaCheck(cudaGetLastError()); });
        float t_upd = time_ms(reps, [&] { linreg_update_kernel<<<1, LINREG_THREADS>>>(g.partials, rows, 1, n, 0.0f, g.params, g.test_loss, 0); cudaCheck(cudaGetLastError()); });
        float t_fused = time_ms(reps, [&] { linreg_launch_fused(g.x, g.y, g.params, n, 1, g.partials, rows, 0); });
        printf("\none epoch at 5M points (4M training), %s, median of %d launches\n", prop.name, reps);
        printf("| operation | unfused (us) | fused (us) |\n|---|---|---|\n");
        printf("| forward | %.2f | \n| loss | %.2f | \n| gradient | %.2f | \n| forward+loss+gradient | %.2f | %.2f |\n| update | %.2f | %.2f |\n| epoch | %.2f | %.2f |\n",
               t_fwd * 1e3, t_loss * 1e3, t_grad * 1e3, (t_fwd + t_loss + t_grad) * 1e3, t_fused * 1e3, t_upd * 1e3, t_upd * 1e3,
               (t_fwd + t_loss + t_grad + t_upd) * 1e3, (t_fused + t_upd) * 1e3);
        if (js) fprintf(js, "  \"breakdown_us\": {\"forward\": %.4f, \"loss\": %.4f, \"gradient\": %.4f, \"update\": %.4f, \"fused\": %.4f},\n",
                        t_fwd * 1e3, t_loss * 1e3, t_grad * 1e3, t_upd * 1e3, t_fused * 1e3);
        if (js) fprintf(js, "  \"datagen_ms_5M\": %.4f,\n", gen_ms);
        printf("data generation (cuRAND Philox, 5M points): %.3f ms\n", gen_ms);
        linreg_gpu_free(&g);
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_y));
        linreg_data_free(&data);
    }

    // Sweep: every version, 200 epochs, sizes from 500 to 100M points.
    long long sizes[] = {500, 5000, 50000, 500000, 5000000, 50000000, 100000000};
    printf("\n200 epochs, ms (median of 5, CUDA events), %s\n| points | v1 unfused | v2 fused | v3 streams | v4 persistent |\n|---|---|---|---|---|\n", prop.name);
    if (js) fprintf(js, "  \"sweep\": [\n");
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        int n = (int)sizes[si];
        LinregData data;
        float gen_ms;
        float *d_x, *d_y;
        linreg_generate(&data, n, 0.8f, 1337, 0.0f, 10.0f, 0.7f, 0.3f, 0.1f, true, &gen_ms, &d_x, &d_y);
        float ms[5] = {0};
        float w4 = 0, b4 = 0;
        for (int version = 1; version <= 4; version++) {
            LinregGpu g;
            linreg_gpu_build(&g, d_x, d_y, n, 1, data.n_train, epochs, 4);
            TrainConfig cfg = {epochs, 0.01f, 0.83f, 0.7645f, version, 4};
            std::vector<float> t;
            for (int r = 0; r < 6; r++) {
                TrainResult res = linreg_train_gpu(&g, &cfg);
                if (r > 0) t.push_back(res.train_ms);  // the first run is the warm-up
                if (version == 4) { w4 = res.w[0]; b4 = res.b; }
            }
            ms[version] = median(t);
            linreg_gpu_free(&g);
        }
        printf("| %lld | %.3f | %.3f | %.3f | %.3f |\n", sizes[si], ms[1], ms[2], ms[3], ms[4]);
        if (js) fprintf(js, "    {\"points\": %lld, \"v1\": %.5f, \"v2\": %.5f, \"v3\": %.5f, \"v4\": %.5f, \"datagen_ms\": %.4f, \"w\": %.9g, \"b\": %.9g}%s\n",
                        sizes[si], ms[1], ms[2], ms[3], ms[4], gen_ms, w4, b4, si + 1 < sizeof(sizes) / sizeof(sizes[0]) ? "," : "");
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_y));
        linreg_data_free(&data);
    }
    if (js) {
        fprintf(js, "  ]\n}\n");
        fclose(js);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 2 && strcmp(argv[1], "--test") == 0) {
        run_tests();
        printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
        return n_fail ? 1 : 0;
    }
    const char* json = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--bench_json") == 0 && i + 1 < argc) json = argv[++i];
        else {
            fprintf(stderr, "usage: ./dev/linreg [--test | --bench_json FILE]\n");
            return 1;
        }
    }
    return run_bench(json);
}
