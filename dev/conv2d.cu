/*
dev/conv2d.cu: the 3x3 convolution (padding 1, stride 1 or 2) of train_unet.cu over NHWC, forward, backward-data
and weight gradient, checked against a CPU oracle (dev/unet_layers.cuh) and a PyTorch fixture
(dev/fixtures/unet_layer_conv3x3.bin, dev/unet_layers.py; the oracle against it runs in CI), and timed.

  make -C dev conv2d && ./dev/conv2d --test      # every version, awkward sizes, poisoned outputs, vs the CPU
  ./dev/conv2d [version]                          # validate + benchmark the UNet's 3x3 layer shapes at batch 32
                                                  # (default 5)

version 1: naive direct convolution, one thread per output element (reference on the GPU)
version 2: implicit GEMM, 128x64x32 tiles through shared memory, fp32 FMAs (train_unet.cu conv_igemm_kernel,
           TF32 = false): the strict-fp32 path the UNet test uses
version 3: the same implicit GEMM on TF32 tensor cores (wmma m16n16k8, TF32 = true)
version 4: version 2 with a 3-stage cp.async pipeline (conv_igemm_pipe_kernel, TF32 = false): the strict path of
           train_unet.cu for layers whose channels fit the tile (the others take version 2)
version 5: version 4 on TF32 tensor cores: the training default (the others take version 3)
Backward-data runs the forward kernel on dY with flipped, transposed weights (stride 2: a gather that skips odd
positions); the weight gradient is the GEMM (9*Cin x Cout) over B*Ho*Wo pixels split in chunks (split-K) and
summed in a fixed order.
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"  // counters, checks, PyTorch fixtures, the CPU oracle, the ConvLab shell

// ---------------------------------------------------------------------------------------------------------------
// version 1: naive direct convolution
__global__ void conv_naive_forward_kernel(const float* x, const float* w, const float* bias, float* y, int B, int H,
                                          int W, int Cin, int Cout, int s, int Ho, int Wo) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * Ho * Wo * Cout) return;
    int co = (int)(i % Cout);
    size_t p = i / Cout;
    int ox = (int)(p % Wo), oy = (int)((p / Wo) % Ho), b = (int)(p / ((size_t)Ho * Wo));
    float acc = bias ? bias[co] : 0.f;
    for (int tap = 0; tap < 9; tap++) {
        int iy = oy * s - 1 + tap / 3, ix = ox * s - 1 + tap % 3;
        if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
        for (int ci = 0; ci < Cin; ci++)
            acc = fmaf(x[(((size_t)b * H + iy) * W + ix) * Cin + ci], w[((size_t)tap * Cin + ci) * Cout + co], acc);
    }
    y[i] = acc;
}

static void fill_nan(float* d, size_t n) { poison(d, n); }

// |got - ref| <= rtol_mag * sum|products| per element (the CPU oracle's magnitudes)
static void check(const std::string& name, const float* d_got, const float* ref, const float* mag, size_t n,
                  double rtol_mag) {
    std::vector<float> got = to_host(d_got, n);
    double max_err = 0.0;
    size_t max_i = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - ref[i]);
        if (!(err == err)) err = INFINITY;
        double tol = rtol_mag * mag[i] + 1e-30;
        if (!(err <= tol)) bad++;
        if (err > max_err || (bad == 1 && !(err <= tol))) { max_err = err; max_i = i; }
    }
    char line[512];
    snprintf(line, sizeof line, "%s: max |err| %.3e at [%zu] (got %.7g, ref %.7g), %zu of %zu above %.0e * sum|products|",
             name.c_str(), max_err, max_i, got[max_i], ref[max_i], bad, n, rtol_mag);
    report(bad == 0, line);
}

// fp32 (versions 1, 2): error of a length-K sum in any order <= ~K * 2^-24 * sum|products|; K <= 9*Cin here, so
// 1e-5 of sum|products| has margin. TF32 (version 3) rounds both operands to 10-bit mantissas: <= ~2^-10 relative
// per product, so 2e-3 of sum|products|.
static double version_rtol(int v) { return (v == 3 || v == 5) ? 2e-3 : 1e-5; }
static void select_version(int v) {
    g_tf32 = v == 3 || v == 5;
    g_conv_pipe = v >= 4;
}

static void run_case(int version, int B, int H, int W, int cin, int cout, int s, uint64_t seed) {
    ConvLab L;
    lab_init(&L, B, H, W, cin, cout, s);
    size_t nx = (size_t)B * H * W * cin, ny = (size_t)B * L.Ho * L.Wo * cout, nw = 9 * (size_t)cin * cout;
    std::vector<float> x(nx), w(nw), bias(cout), dy(ny);
    uint64_t k = 0;
    for (auto& v : x) v = 2.f * rng_uniform(seed, 7, k++) - 1.f;
    for (auto& v : w) v = (2.f * rng_uniform(seed, 8, k++) - 1.f) / sqrtf(9.f * cin);
    for (auto& v : bias) v = 2.f * rng_uniform(seed, 9, k++) - 1.f;
    for (auto& v : dy) v = 2.f * rng_uniform(seed, 10, k++) - 1.f;
    std::vector<float> y(ny), ymag(ny), dx(nx), dxmag(nx), dw(nw), dwmag(nw);
    conv3x3_cpu_forward(x.data(), w.data(), bias.data(), y.data(), ymag.data(), B, H, W, cin, cout, s);
    conv3x3_cpu_backward(x.data(), w.data(), dy.data(), dx.data(), dxmag.data(), dw.data(), dwmag.data(), nullptr, B, H, W, cin, cout, s);
    float *d_x = dev_alloc(nx), *d_y = dev_alloc(ny), *d_dy = dev_alloc(ny), *d_dx = dev_alloc(nx);
    cudaCheck(cudaMemcpy(d_x, x.data(), nx * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_dy, dy.data(), ny * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p, w.data(), nw * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p + L.c.b, bias.data(), cout * 4, cudaMemcpyHostToDevice));
    char name[160];
    snprintf(name, sizeof name, "v%d B%d %dx%d cin %d cout %d stride %d", version, B, H, W, cin, cout, s);
    double rt = version_rtol(version);
    fill_nan(d_y, ny);
    if (version == 1) {
        conv_naive_forward_kernel<<<ceil_div(ny, 256), 256>>>(d_x, L.m.p, L.m.p + L.c.b, d_y, B, H, W, cin, cout, s,
                                                              L.Ho, L.Wo);
        cudaCheck(cudaGetLastError());
        check(std::string(name) + " forward", d_y, y.data(), ymag.data(), ny, rt);
    } else {
        select_version(version);
        conv3x3_forward(&L.m, L.c, d_x, d_y, H, W, nullptr, false);
        check(std::string(name) + " forward", d_y, y.data(), ymag.data(), ny, rt);
        fill_nan(d_dx, nx);
        conv3x3_backward_data(&L.m, L.c, d_dy, d_dx, H, W, false);
        check(std::string(name) + " backward-data", d_dx, dx.data(), dxmag.data(), nx, rt);
        fill_nan(L.m.g, nw);
        conv3x3_backward_weight(&L.m, L.c, d_x, d_dy, H, W);
        check(std::string(name) + " weight-grad", L.m.g, dw.data(), dwmag.data(), nw, rt);
    }
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_y));
    cudaCheck(cudaFree(d_dy));
    cudaCheck(cudaFree(d_dx));
    lab_free(&L);
}

// ---------------------------------------------------------------------------------------------------------------
// PyTorch fixture (dev/fixtures/unet_layer_conv3x3.bin: nn.Conv2d(5, 7, 3, padding=1) on (2, 5, 9, 6), fp32)

// Tolerances against PyTorch fp32: its sums have <= 9*Cin = 45 (y), 9*Cout = 63 (dx) or B*H*W = 108 (dw, db)
// terms of O(1) values, rounding <= K * 2^-24 * sum|terms| ~ 1e-5 of the tensor's scale at worst: atol 2e-5 of the
// scale, rtol 1e-5. TF32 versions round each operand to 10 mantissa bits (~5e-4 relative per product): 4e-3, 4e-3.
static void fixture_tolerance(bool tf32, double* atol, double* rtol) {
    *atol = tf32 ? 4e-3 : 2e-5;
    *rtol = tf32 ? 4e-3 : 1e-5;
}
// CPU oracle on the fixture's input against PyTorch's y, dx, dw, db
static void fixture_cpu(const ConvFixture& f, const std::string& name, int s) {
    size_t ny = f.y.size();
    std::vector<float> y(ny), dx(f.x.size()), dw(f.w.size()), db(f.Cout);
    conv3x3_cpu_forward(f.x.data(), f.w.data(), f.bias.data(), y.data(), nullptr, f.B, f.H, f.W, f.Cin, f.Cout, s);
    conv3x3_cpu_backward(f.x.data(), f.w.data(), f.dy.data(), dx.data(), nullptr, dw.data(), nullptr, db.data(), f.B,
                         f.H, f.W, f.Cin, f.Cout, s);
    double at, rt;
    fixture_tolerance(false, &at, &rt);
    check_scaled("cpu oracle vs torch " + name + " y", y, f.y, at, rt);
    check_scaled("cpu oracle vs torch " + name + " dx", dx, f.dx, at, rt);
    check_scaled("cpu oracle vs torch " + name + " grad weight", dw, f.dw, at, rt);
    check_scaled("cpu oracle vs torch " + name + " grad bias", db, f.db, at, rt);
}
// GPU version (1: forward only; 2..5) on the fixture's input against PyTorch's y, dx, dw, db (outputs poisoned first)
static void fixture_gpu(const ConvFixture& f, const std::string& name, int s, int version) {
    ConvLab L;
    lab_init(&L, f.B, f.H, f.W, f.Cin, f.Cout, s);
    select_version(version);
    float *d_x = to_device(f.x), *d_dy = to_device(f.dy), *d_y = dev_alloc(f.y.size()), *d_dx = dev_alloc(f.x.size());
    cudaCheck(cudaMemcpy(L.m.p, f.w.data(), f.w.size() * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p + L.c.b, f.bias.data(), f.Cout * 4, cudaMemcpyHostToDevice));
    poison(d_y, f.y.size());
    poison(d_dx, f.x.size());
    poison(L.m.g, L.m.n_params);
    double at, rt;
    fixture_tolerance(version == 3 || version == 5, &at, &rt);
    std::string v = "v" + std::to_string(version) + " vs torch " + name;
    if (version == 1) {  // the naive kernel: forward only
        conv_naive_forward_kernel<<<ceil_div(f.y.size(), 256), 256>>>(d_x, L.m.p, L.m.p + L.c.b, d_y, f.B, f.H, f.W,
                                                                      f.Cin, f.Cout, s, f.Ho, f.Wo);
        cudaCheck(cudaGetLastError());
        check_scaled(v + " y", to_host(d_y, f.y.size()), f.y, at, rt);
    } else {
        conv3x3_forward(&L.m, L.c, d_x, d_y, f.H, f.W, nullptr, false);
        conv3x3_backward_data(&L.m, L.c, d_dy, d_dx, f.H, f.W, false);
        conv3x3_backward_weight(&L.m, L.c, d_x, d_dy, f.H, f.W);
        channel_sums(&L.m, d_dy, L.m.g + L.c.b, f.B, f.Ho * f.Wo, f.Cout, 0, 0);
        check_scaled(v + " y", to_host(d_y, f.y.size()), f.y, at, rt);
        check_scaled(v + " dx", to_host(d_dx, f.x.size()), f.dx, at, rt);
        check_scaled(v + " grad weight", to_host(L.m.g, f.w.size()), f.dw, at, rt);
        check_scaled(v + " grad bias", to_host(L.m.g + L.c.b, f.Cout), f.db, at, rt);
    }
    float* fs[] = {d_x, d_dy, d_y, d_dx};
    for (float* q : fs) cudaCheck(cudaFree(q));
    lab_free(&L);
    select_version(5);
}

// ---------------------------------------------------------------------------------------------------------------
// benchmark: the UNet's 3x3 layer shapes at batch 32 (FLOPs = 2 * B*Ho*Wo * 9*Cin * Cout per pass)
static void bench(int version) {
    struct Shape { int H, cin, cout, s; } shapes[] = {
        {64, 64, 64, 1}, {64, 128, 64, 1}, {32, 128, 128, 1}, {16, 192, 192, 1}, {8, 256, 256, 1}, {8, 512, 256, 1},
        {64, 64, 64, 2}};
    const int B = 32;
    printf("version %d (%s), batch %d; ms per pass, TFLOP/s\n", version, version_rtol(version) > 1e-4 ? "TF32" : "fp32", B);
    printf("%-26s %18s %18s %18s\n", "shape", "forward", "backward-data", "weight-grad");
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (const Shape& sh : shapes) {
        ConvLab L;
        lab_init(&L, B, sh.H, sh.H, sh.cin, sh.cout, sh.s);
        size_t nx = (size_t)B * sh.H * sh.H * sh.cin, ny = (size_t)B * L.Ho * L.Wo * sh.cout;
        float *d_x = dev_alloc(nx), *d_y = dev_alloc(ny), *d_dx = dev_alloc(nx);
        cudaCheck(cudaMemset(d_x, 0, nx * 4));
        cudaCheck(cudaMemset(d_y, 0, ny * 4));
        cudaCheck(cudaMemset(L.m.p, 0, L.m.n_params * 4));
        select_version(version);
        double flops = 2.0 * B * L.Ho * L.Wo * 9.0 * sh.cin * sh.cout;
        float ms[3];
        for (int pass = 0; pass < 3; pass++) {
            auto launch = [&]() {
                if (version == 1 && pass == 0)
                    conv_naive_forward_kernel<<<ceil_div(ny, 256), 256>>>(d_x, L.m.p, nullptr, d_y, B, sh.H, sh.H,
                                                                          sh.cin, sh.cout, sh.s, L.Ho, L.Wo);
                else if (pass == 0) conv3x3_forward(&L.m, L.c, d_x, d_y, sh.H, sh.H, nullptr, false);
                else if (pass == 1) conv3x3_backward_data(&L.m, L.c, d_y, d_dx, sh.H, sh.H, false);
                else conv3x3_backward_weight(&L.m, L.c, d_x, d_y, sh.H, sh.H);
            };
            if (version == 1 && pass > 0) { ms[pass] = NAN; continue; }
            for (int i = 0; i < 3; i++) launch();
            cudaCheck(cudaEventRecord(e0));
            const int reps = 20;
            for (int i = 0; i < reps; i++) launch();
            cudaCheck(cudaEventRecord(e1));
            cudaCheck(cudaEventSynchronize(e1));
            cudaCheck(cudaEventElapsedTime(&ms[pass], e0, e1));
            ms[pass] /= reps;
        }
        char shape[64];
        snprintf(shape, sizeof shape, "%dx%d %d->%d s%d", sh.H, sh.H, sh.cin, sh.cout, sh.s);
        printf("%-26s", shape);
        for (int pass = 0; pass < 3; pass++) printf("  %7.3f ms %6.1f", ms[pass], flops / (ms[pass] * 1e-3) / 1e12);
        printf("\n");
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_y));
        cudaCheck(cudaFree(d_dx));
        lab_free(&L);
    }
}

int main(int argc, char** argv) {
    int version = lab_version(argc, argv, 5, 5, "1 naive, 2/3 implicit GEMM fp32/TF32, 4/5 pipelined fp32/TF32");
    bool test = version == 0;
    ConvFixture fx;
    bool have_fx = conv_fixture_load(&fx, "conv3x3", 1001, "", 1, false);
    if (have_fx) fixture_cpu(fx, "conv3x3", 1);  // CPU: runs in CI
    if (!gpu_setup()) {
        skip("conv2d GPU versions: no CUDA GPU");
        return finish();
    }
    // awkward sizes: odd spatial sizes, channels off the tile (scalar loader) and on it (float4 loader), stride 2
    struct Case { int B, H, W, cin, cout, s; } cases[] = {
        {3, 7, 5, 3, 37, 1}, {2, 9, 9, 40, 3, 1}, {3, 7, 7, 64, 96, 1}, {2, 9, 11, 96, 64, 2}, {1, 8, 8, 32, 32, 2},
        {2, 13, 6, 20, 12, 2}, {5, 16, 16, 64, 128, 1}};
    std::vector<int> versions = test ? std::vector<int>{1, 2, 3, 4, 5} : std::vector<int>{version};
    uint64_t seed = 1;
    for (int v : versions) {
        for (const Case& c : cases) run_case(v, c.B, c.H, c.W, c.cin, c.cout, c.s, seed++);
        if (have_fx) fixture_gpu(fx, "conv3x3", 1, v);
    }
    if (!test) bench(version);
    gpu_teardown();
    return finish();
}
