/*
dev/elementwise.cu: the UNet's elementwise layers as train_unet.cu runs them, forward and backward, checked against
CPU oracles (double) and PyTorch fixtures:
  SiLU            silu_kernel / silu_backward_kernel (the time embedding's; GroupNorm fuses its own SiLU)
  concatenation   concat_kernel / split_backward_kernel: an output block's cat([h, skip], channels) over NHWC
  MSE loss        mse_kernel + loss_finalize_kernel: mean((out - target)^2) (double partial sums, fixed order) and
                  dout = 2 (out - target) / n

  make -C dev elementwise && ./dev/elementwise --test    # CPU oracles vs PyTorch (CI); GPU vs oracles and PyTorch
  ./dev/elementwise                                       # the same (nothing here is worth timing alone)

version 1 (train_unet.cu, the only one): one thread per element.
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"

// ---------------------------------------------------------------------------------------------------------------
// CPU oracles (double)
static void cpu_silu(const std::vector<float>& x, const std::vector<float>& dy, std::vector<float>* y,
                     std::vector<float>* dx) {
    y->resize(x.size());
    dx->resize(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        double s = 1.0 / (1.0 + exp(-(double)x[i]));
        (*y)[i] = (float)(x[i] * s);
        (*dx)[i] = (float)(dy[i] * s * (1.0 + x[i] * (1.0 - s)));
    }
}
// NHWC: a (BP, C1), b (BP, C2) -> y (BP, C1 + C2); backward splits dy
static void cpu_concat(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& dy,
                       size_t BP, int C1, int C2, std::vector<float>* y, std::vector<float>* da,
                       std::vector<float>* db) {
    int C = C1 + C2;
    y->resize(BP * C);
    da->resize(BP * C1);
    db->resize(BP * C2);
    for (size_t p = 0; p < BP; p++)
        for (int c = 0; c < C; c++) {
            (*y)[p * C + c] = c < C1 ? a[p * C1 + c] : b[p * C2 + c - C1];
            (c < C1 ? (*da)[p * C1 + c] : (*db)[p * C2 + c - C1]) = dy[p * C + c];
        }
}
static void cpu_mse(const std::vector<float>& out, const std::vector<float>& target, float* loss,
                    std::vector<float>* dout) {
    double s = 0;
    size_t n = out.size();
    dout->resize(n);
    for (size_t i = 0; i < n; i++) {
        double d = (double)out[i] - target[i];
        s += d * d;
        (*dout)[i] = (float)(2.0 * d / (double)n);
    }
    *loss = (float)(s / (double)n);
}

// ---------------------------------------------------------------------------------------------------------------
// GPU (train_unet.cu's kernels), outputs poisoned first
static void gpu_silu(const std::vector<float>& x, const std::vector<float>& dy, std::vector<float>* y,
                     std::vector<float>* dx) {
    size_t n = x.size();
    float *d_x = to_device(x), *d_dy = to_device(dy), *d_y = dev_alloc(n), *d_dx = dev_alloc(n);
    poison(d_y, n);
    poison(d_dx, n);
    silu_kernel<<<ceil_div(n, EW), EW>>>(d_x, d_y, n);
    cudaCheck(cudaGetLastError());
    silu_backward_kernel<<<ceil_div(n, EW), EW>>>(d_x, d_dy, d_dx, n);
    cudaCheck(cudaGetLastError());
    *y = to_host(d_y, n);
    *dx = to_host(d_dx, n);
    float* fs[] = {d_x, d_dy, d_y, d_dx};
    for (float* f : fs) cudaCheck(cudaFree(f));
}
static void gpu_concat(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& dy,
                       size_t BP, int C1, int C2, std::vector<float>* y, std::vector<float>* da,
                       std::vector<float>* db) {
    size_t n = BP * (C1 + C2);
    float *d_a = to_device(a), *d_b = to_device(b), *d_dy = to_device(dy), *d_y = dev_alloc(n);
    float *d_da = dev_alloc(BP * C1), *d_db = dev_alloc(BP * C2);
    poison(d_y, n);
    poison(d_da, BP * C1);
    poison(d_db, BP * C2);
    concat_act((const float*)d_a, (const float*)d_b, d_y, BP, C1, C2);
    cudaCheck(cudaGetLastError());
    split_backward_act((const float*)d_dy, d_da, d_db, BP, C1, C2, false, false);
    cudaCheck(cudaGetLastError());
    *y = to_host(d_y, n);
    *da = to_host(d_da, BP * C1);
    *db = to_host(d_db, BP * C2);
    float* fs[] = {d_a, d_b, d_dy, d_y, d_da, d_db};
    for (float* f : fs) cudaCheck(cudaFree(f));
}
static void gpu_mse(const std::vector<float>& out, const std::vector<float>& target, float* loss,
                    std::vector<float>* dout) {
    size_t n = out.size();
    const int blocks = 264;  // as train_unet.cu's loss_blocks
    float *d_o = to_device(out), *d_t = to_device(target), *d_do = dev_alloc(n), *d_loss = dev_alloc(1);
    double* partial;
    cudaCheck(cudaMalloc(&partial, blocks * sizeof(double)));
    poison(d_do, n);
    poison(d_loss, 1);
    mse_kernel<<<blocks, 256>>>(d_o, d_t, d_do, partial, n);
    cudaCheck(cudaGetLastError());
    loss_finalize_kernel<<<1, 32>>>(partial, blocks, n, d_loss);
    cudaCheck(cudaGetLastError());
    *dout = to_host(d_do, n);
    *loss = to_host(d_loss, 1)[0];
    float* fs[] = {d_o, d_t, d_do, d_loss};
    for (float* f : fs) cudaCheck(cudaFree(f));
    cudaCheck(cudaFree(partial));
}

// ---------------------------------------------------------------------------------------------------------------
// PyTorch fixtures (unet_layer_silu.bin: x = 3 N(0,1) of (3, 5, 7, 11); unet_layer_concat.bin: a (2, 5, 4, 3),
// b (2, 3, 4, 3); unet_layer_mse.bin: out, target (3, 3, 7, 5)) and random awkward sizes.
// Tolerances: SiLU is one exp and a few fp32 operations per element (torch and CUDA expf within 2 ulp): atol 1e-6
// of the scale, rtol 2e-6. Concatenation is a copy: exact (0, 0). MSE: dout elementwise, atol 1e-6 of the scale,
// rtol 2e-6; the loss is a mean of n = 315 squares summed in fp32 by torch: rtol 1e-5 (n * 2^-24 = 2e-5 at worst,
// random-sign rounding ~ sqrt(n) * 2^-24 = 1e-6).

static void silu_fixture() {
    Fixture fx;
    if (!fixture_open(&fx, "silu", 1006)) return;
    std::vector<int> xs = fx_shape(&fx, "x");
    if (!fx.ok) return;
    std::vector<float> x = fx_get(&fx, "x", xs), y = fx_get(&fx, "y", xs), dy = fx_get(&fx, "dy", xs),
                       dx = fx_get(&fx, "dx", xs);
    if (!fx.ok) return;
    std::vector<float> cy, cdx;
    cpu_silu(x, dy, &cy, &cdx);  // elementwise: the layout does not matter
    check_scaled("cpu oracle vs torch silu y", cy, y, 1e-6, 2e-6);
    check_scaled("cpu oracle vs torch silu dx", cdx, dx, 1e-6, 2e-6);
    if (!g_have_gpu) return skip("v1 vs torch silu: no CUDA GPU");
    gpu_silu(x, dy, &cy, &cdx);
    check_scaled("v1 vs torch silu y", cy, y, 1e-6, 2e-6);
    check_scaled("v1 vs torch silu dx", cdx, dx, 1e-6, 2e-6);
}

static void concat_fixture() {
    Fixture fx;
    if (!fixture_open(&fx, "concat", 1010)) return;
    std::vector<int> as = fx_shape(&fx, "a"), bs = fx_shape(&fx, "b");
    if (!fx.ok || as.size() != 4 || bs.size() != 4) {
        if (fx.ok) report(false, "fixture concat: a and b must have 4 dims");
        return;
    }
    int B = as[0], C1 = as[1], C2 = bs[1], H = as[2], W = as[3];
    std::vector<int> ys = {B, C1 + C2, H, W};
    std::vector<float> a = fx_get(&fx, "a", as), b = fx_get(&fx, "b", {B, C2, H, W}), y = fx_get(&fx, "y", ys),
                       dy = fx_get(&fx, "dy", ys), da = fx_get(&fx, "da", as), db = fx_get(&fx, "db", {B, C2, H, W});
    if (!fx.ok) return;
    a = nchw_to_nhwc(a, B, C1, H, W);
    b = nchw_to_nhwc(b, B, C2, H, W);
    y = nchw_to_nhwc(y, B, C1 + C2, H, W);
    dy = nchw_to_nhwc(dy, B, C1 + C2, H, W);
    da = nchw_to_nhwc(da, B, C1, H, W);
    db = nchw_to_nhwc(db, B, C2, H, W);
    size_t BP = (size_t)B * H * W;
    std::vector<float> cy, cda, cdb;
    cpu_concat(a, b, dy, BP, C1, C2, &cy, &cda, &cdb);
    check_scaled("cpu oracle vs torch concat y", cy, y, 0, 0);
    check_scaled("cpu oracle vs torch concat da", cda, da, 0, 0);
    check_scaled("cpu oracle vs torch concat db", cdb, db, 0, 0);
    if (!g_have_gpu) return skip("v1 vs torch concat: no CUDA GPU");
    gpu_concat(a, b, dy, BP, C1, C2, &cy, &cda, &cdb);
    check_scaled("v1 vs torch concat y", cy, y, 0, 0);
    check_scaled("v1 vs torch concat da", cda, da, 0, 0);
    check_scaled("v1 vs torch concat db", cdb, db, 0, 0);
}

static void mse_fixture() {
    Fixture fx;
    if (!fixture_open(&fx, "mse", 1012)) return;
    std::vector<int> os = fx_shape(&fx, "out");
    if (!fx.ok) return;
    std::vector<float> out = fx_get(&fx, "out", os), target = fx_get(&fx, "target", os),
                       loss = fx_get(&fx, "loss", {}), dout = fx_get(&fx, "dout", os);
    if (!fx.ok) return;
    float l;
    std::vector<float> cd;
    cpu_mse(out, target, &l, &cd);
    check_close("cpu oracle vs torch mse loss", &l, loss.data(), 1, 0, 1e-5);
    check_scaled("cpu oracle vs torch mse dout", cd, dout, 1e-6, 2e-6);
    if (!g_have_gpu) return skip("v1 vs torch mse: no CUDA GPU");
    gpu_mse(out, target, &l, &cd);
    check_close("v1 vs torch mse loss", &l, loss.data(), 1, 0, 1e-5);
    check_scaled("v1 vs torch mse dout", cd, dout, 1e-6, 2e-6);
}

// GPU against the CPU oracles: fresh random inputs of awkward sizes (against double: loss rtol 1e-6, the GPU sums
// in double too)
static void random_cases() {
    std::vector<float> x = random_vec(100003, 1, 1, -8, 8), dy = random_vec(100003, 1, 2, -1, 1), y, dx, cy, cdx;
    cpu_silu(x, dy, &cy, &cdx);
    gpu_silu(x, dy, &y, &dx);
    check_scaled("v1 vs cpu oracle silu n 100003 y", y, cy, 1e-6, 2e-6);
    check_scaled("v1 vs cpu oracle silu n 100003 dx", dx, cdx, 1e-6, 2e-6);
    size_t BP = 3 * 7 * 9;
    int C1 = 37, C2 = 29;
    std::vector<float> a = random_vec(BP * C1, 2, 1, -1, 1), b = random_vec(BP * C2, 2, 2, -1, 1),
                       g = random_vec(BP * (C1 + C2), 2, 3, -1, 1), da, db, cda, cdb;
    cpu_concat(a, b, g, BP, C1, C2, &cy, &cda, &cdb);
    gpu_concat(a, b, g, BP, C1, C2, &y, &da, &db);
    check_scaled("v1 vs cpu oracle concat BP 189 C 37+29 y", y, cy, 0, 0);
    check_scaled("v1 vs cpu oracle concat BP 189 C 37+29 da", da, cda, 0, 0);
    check_scaled("v1 vs cpu oracle concat BP 189 C 37+29 db", db, cdb, 0, 0);
    std::vector<float> o = random_vec(3 * 3 * 61 * 61, 3, 1, -2, 2), t = random_vec(o.size(), 3, 2, -2, 2), d, cd;
    float l, cl;
    cpu_mse(o, t, &cl, &cd);
    gpu_mse(o, t, &l, &d);
    check_close("v1 vs cpu oracle mse n 33489 loss", &l, &cl, 1, 0, 1e-6);
    check_scaled("v1 vs cpu oracle mse n 33489 dout", d, cd, 1e-6, 2e-6);
}

int main(int argc, char** argv) {
    bool test = lab_version(argc, argv, 1, 1, "1: train_unet.cu's kernels") == 0;
    gpu_setup();
    silu_fixture();  // the CPU parts run in CI
    concat_fixture();
    mse_fixture();
    if (!g_have_gpu) skip("elementwise GPU version 1 vs the CPU oracles: no CUDA GPU");
    else random_cases();
    gpu_teardown();
    return finish();
}
