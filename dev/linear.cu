/*
dev/linear.cu: the UNet's linear layers as train_unet.cu runs them (linear_forward / linear_backward): nn.Linear
(time embedding, emb_layers) and the 1x1 convolution (ResBlock skip_connection, the same GEMM over B*H*W NHWC
rows), forward and backward, checked against a CPU oracle (double) and PyTorch fixtures.

  make -C dev linear && ./dev/linear --test     # CPU oracle vs PyTorch (CI); GPU vs oracle and PyTorch
  ./dev/linear                                   # the same, then the UNet's shapes at batch 32 timed

version 1 (train_unet.cu, the only one): y = x W^T (cuBLAS sgemm, row-major view) then a bias kernel (+ residual);
dW = dy^T x (sgemm), db = deterministic column sums of dy (channel_sums), dx = dy W (sgemm). Strict fp32 here
(cuBLAS default math); the trainer's --precision tf32 allows TF32 in these products (bf16: cublasGemmEx).
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"

// CPU oracle in double: x (R, in), w (out, in), b (out), dy (R, out) -> y, dx, dw, db
static void cpu_linear(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b,
                       const std::vector<float>& dy, int R, int in, int out, std::vector<float>* y,
                       std::vector<float>* dx, std::vector<float>* dw, std::vector<float>* db) {
    y->assign((size_t)R * out, 0.f);
    dx->assign((size_t)R * in, 0.f);
    dw->assign((size_t)out * in, 0.f);
    db->assign(out, 0.f);
    std::vector<double> adw((size_t)out * in, 0.0), adb(out, 0.0);
    for (int r = 0; r < R; r++) {
        for (int o = 0; o < out; o++) {
            double acc = b[o];
            for (int i = 0; i < in; i++) acc += (double)x[(size_t)r * in + i] * w[(size_t)o * in + i];
            (*y)[(size_t)r * out + o] = (float)acc;
            double g = dy[(size_t)r * out + o];
            adb[o] += g;
            for (int i = 0; i < in; i++) adw[(size_t)o * in + i] += g * x[(size_t)r * in + i];
        }
        for (int i = 0; i < in; i++) {
            double acc = 0;
            for (int o = 0; o < out; o++) acc += (double)dy[(size_t)r * out + o] * w[(size_t)o * in + i];
            (*dx)[(size_t)r * in + i] = (float)acc;
        }
    }
    for (size_t i = 0; i < adw.size(); i++) (*dw)[i] = (float)adw[i];
    for (int o = 0; o < out; o++) (*db)[o] = (float)adb[o];
}

// train_unet.cu's linear layer on the GPU (strict fp32): outputs poisoned, then forward and backward. Bq*P = R
// rows (P: pixels per sample of a 1x1 conv, 1 for a Linear).
struct LinOut {
    std::vector<float> y, dx, dw, db;
};
static LinOut gpu_linear(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b,
                         const std::vector<float>& dy, int Bq, int P, int in, int out) {
    int R = Bq * P;
    UNet m;
    m.B = Bq;
    LinP l;
    l.in = in; l.out = out; l.w = 0; l.b = (size_t)in * out;
    m.n_params = (size_t)in * out + out;
    std::vector<float> p(w);
    p.insert(p.end(), b.begin(), b.end());
    m.p = to_device(p);
    m.g = dev_alloc(m.n_params);
    unet_alloc_chan(&m, Bq, 0);
    float *d_x = to_device(x), *d_dy = to_device(dy), *d_y = dev_alloc((size_t)R * out), *d_dx = dev_alloc((size_t)R * in);
    poison(d_y, (size_t)R * out);
    poison(d_dx, (size_t)R * in);
    poison(m.g, m.n_params);
    linear_forward<float>(&m, l, d_x, d_y, R, nullptr);
    linear_backward(&m, l, d_x, d_dy, d_dx, Bq, P, false);
    LinOut o;
    o.y = to_host(d_y, (size_t)R * out);
    o.dx = to_host(d_dx, (size_t)R * in);
    o.dw = to_host(m.g, (size_t)in * out);
    o.db = to_host(m.g + l.b, out);
    float* fs[] = {d_x, d_dy, d_y, d_dx, m.p, m.g};
    for (float* f : fs) cudaCheck(cudaFree(f));
    unet_free_chan(&m);
    return o;
}

// Tolerances: fp32 sums of K <= max(in, out, rows) <= 70 products of O(1) values (PyTorch and cuBLAS, any order):
// rounding <= K * 2^-24 * sum|products| ~ 1e-5 of the tensor's scale at worst: atol 2e-5 of the scale, rtol 1e-5.
static const double ATOL = 2e-5, RTOL = 1e-5;
static void compare_all(const std::string& who, const LinOut& got, const LinOut& ref) {
    check_scaled(who + " y", got.y, ref.y, ATOL, RTOL);
    check_scaled(who + " dx", got.dx, ref.dx, ATOL, RTOL);
    check_scaled(who + " grad weight", got.dw, ref.dw, ATOL, RTOL);
    check_scaled(who + " grad bias", got.db, ref.db, ATOL, RTOL);
}

// fixture: linear (x (R, in)) or conv1x1 (x (B, Cin, H, W), weight (Cout, Cin, 1, 1)), in our row layout
static void fixture_case(const std::string& name, int code, bool conv) {
    Fixture fx;
    if (!fixture_open(&fx, name, code)) return;
    std::vector<int> xs = fx_shape(&fx, "x"), ws = fx_shape(&fx, "weight");
    if (!fx.ok || xs.size() != (conv ? 4u : 2u) || ws.size() != (conv ? 4u : 2u)) {
        if (fx.ok) report(false, "fixture " + name + ": unexpected ranks of x / weight");
        return;
    }
    int out = ws[0], in = ws[1], Bq = xs[0], P = conv ? xs[2] * xs[3] : 1;
    std::vector<int> ys = conv ? std::vector<int>{Bq, out, xs[2], xs[3]} : std::vector<int>{Bq, out};
    std::vector<int> wshape = conv ? std::vector<int>{out, in, 1, 1} : std::vector<int>{out, in};
    std::vector<float> x = fx_get(&fx, "x", xs), w = fx_get(&fx, "weight", wshape), b = fx_get(&fx, "bias", {out});
    LinOut ref;
    ref.y = fx_get(&fx, "y", ys);
    std::vector<float> dy = fx_get(&fx, "dy", ys);
    ref.dx = fx_get(&fx, "dx", xs);
    ref.dw = fx_get(&fx, "grad.weight", wshape);
    ref.db = fx_get(&fx, "grad.bias", {out});
    if (!fx.ok) return;
    if (conv) {  // NCHW -> rows (B*H*W, C)
        x = nchw_to_nhwc(x, Bq, in, xs[2], xs[3]);
        dy = nchw_to_nhwc(dy, Bq, out, xs[2], xs[3]);
        ref.y = nchw_to_nhwc(ref.y, Bq, out, xs[2], xs[3]);
        ref.dx = nchw_to_nhwc(ref.dx, Bq, in, xs[2], xs[3]);
    }
    LinOut cpu;
    cpu_linear(x, w, b, dy, Bq * P, in, out, &cpu.y, &cpu.dx, &cpu.dw, &cpu.db);
    compare_all("cpu oracle vs torch " + name, cpu, ref);
    if (!g_have_gpu) {
        skip("v1 vs torch " + name + ": no CUDA GPU");
        return;
    }
    compare_all("v1 vs torch " + name, gpu_linear(x, w, b, dy, Bq, P, in, out), ref);
}

// GPU against the CPU oracle at awkward sizes, fresh random inputs
static void random_case(int Bq, int P, int in, int out, uint64_t seed) {
    int R = Bq * P;
    float bw = 1.0f / sqrtf((float)in);
    std::vector<float> x = random_vec((size_t)R * in, seed, 1, -1, 1), w = random_vec((size_t)out * in, seed, 2, -bw, bw),
                       b = random_vec(out, seed, 3, -bw, bw), dy = random_vec((size_t)R * out, seed, 4, -1, 1);
    LinOut cpu;
    cpu_linear(x, w, b, dy, R, in, out, &cpu.y, &cpu.dx, &cpu.dw, &cpu.db);
    char name[96];
    snprintf(name, sizeof name, "v1 vs cpu oracle B%d P%d in %d out %d", Bq, P, in, out);
    // here K reaches B*P = 300 rows (grad weight): atol 5e-5 of the scale
    LinOut g = gpu_linear(x, w, b, dy, Bq, P, in, out);
    check_scaled(std::string(name) + " y", g.y, cpu.y, ATOL, RTOL);
    check_scaled(std::string(name) + " dx", g.dx, cpu.dx, ATOL, RTOL);
    check_scaled(std::string(name) + " grad weight", g.dw, cpu.dw, 5e-5, RTOL);
    check_scaled(std::string(name) + " grad bias", g.db, cpu.db, 5e-5, RTOL);
}

static void bench() {
    // the UNet's shapes at batch 32: emb_layers (32 x 256 -> 384), skip 1x1 (32*1024 px, 192 -> 128), qkv (32*256
    // tokens, 192 -> 576); FLOPs 2*R*in*out per product, 3 products per forward + backward
    struct S { int Bq, P, in, out; } shapes[] = {{32, 1, 256, 384}, {32, 1024, 192, 128}, {32, 256, 192, 576}};
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (const S& s : shapes) {
        int R = s.Bq * s.P;
        UNet m;
        m.B = s.Bq;
        LinP l;
        l.in = s.in; l.out = s.out; l.w = 0; l.b = (size_t)s.in * s.out;
        m.n_params = l.b + s.out;
        m.p = dev_alloc(m.n_params);
        m.g = dev_alloc(m.n_params);
        cudaCheck(cudaMemset(m.p, 0, m.n_params * 4));
        unet_alloc_chan(&m, s.Bq, 0);
        float *x = dev_alloc((size_t)R * s.in), *y = dev_alloc((size_t)R * s.out), *dx = dev_alloc((size_t)R * s.in);
        cudaCheck(cudaMemset(x, 0, (size_t)R * s.in * 4));
        cudaCheck(cudaMemset(y, 0, (size_t)R * s.out * 4));
        for (int i = 0; i < 23; i++) {
            if (i == 3) cudaCheck(cudaEventRecord(e0));
            linear_forward<float>(&m, l, x, y, R, nullptr);
            linear_backward(&m, l, x, y, dx, s.Bq, s.P, false);
        }
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        ms /= 20;
        printf("     linear rows %d, %d -> %d: forward + backward %.3f ms (%.1f TFLOP/s, fp32)\n", R, s.in, s.out, ms,
               6.0 * R * s.in * s.out / (ms * 1e9));
        float* fs[] = {x, y, dx, m.p, m.g};
        for (float* f : fs) cudaCheck(cudaFree(f));
        unet_free_chan(&m);
    }
}

int main(int argc, char** argv) {
    bool test = lab_version(argc, argv, 1, 1, "1: train_unet.cu's linear layer") == 0;
    gpu_setup();
    fixture_case("linear", 1003, false);  // CPU part in CI
    fixture_case("conv1x1", 1002, true);
    if (!g_have_gpu) {
        skip("linear GPU version 1 vs the CPU oracle: no CUDA GPU");
        return finish();
    }
    random_case(7, 1, 37, 53, 1);   // a Linear: 7 rows
    random_case(3, 25, 29, 40, 2);  // a 1x1 conv over 3 samples of 5x5 pixels
    random_case(2, 150, 64, 3, 3);
    if (!test) bench();
    gpu_teardown();
    return finish();
}
