/*
dev/resample.cu: the UNet's resampling layers as train_unet.cu runs them, forward and backward, checked against a
CPU oracle (double) and PyTorch fixtures:
  Upsample    nearest x2 (upsample_kernel) then a 3x3 conv; backward: the conv's backward-data and weight
              gradient, then upsample_backward_kernel sums each 2x2 block
  Downsample  3x3 conv with stride 2, padding 1 (odd inputs give (H+1)/2); backward-data gathers every 2nd position

  make -C dev resample && ./dev/resample --test    # CPU oracle vs PyTorch (CI); GPU vs oracle and PyTorch
  ./dev/resample                                    # the same, then the UNet's shapes at batch 32 timed

version 1 (train_unet.cu): the kernels above with the convolution in strict fp32 (dev/conv2d.cu version 2);
version 2: the same on TF32 tensor cores (dev/conv2d.cu version 6, 2 where its channels do not fit), --precision tf32.
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"

// nearest x2: (B, H, W, C) -> (B, 2H, 2W, C), and its adjoint (2x2 block sums)
static std::vector<float> cpu_upsample(const std::vector<float>& x, int B, int H, int W, int C) {
    std::vector<float> y((size_t)B * 4 * H * W * C);
    for (int b = 0; b < B; b++)
        for (int oy = 0; oy < 2 * H; oy++)
            for (int ox = 0; ox < 2 * W; ox++)
                for (int c = 0; c < C; c++)
                    y[(((size_t)b * 2 * H + oy) * 2 * W + ox) * C + c] = x[(((size_t)b * H + oy / 2) * W + ox / 2) * C + c];
    return y;
}
static std::vector<float> cpu_upsample_backward(const std::vector<float>& dy, int B, int H, int W, int C) {
    std::vector<float> dx((size_t)B * H * W * C);
    for (int b = 0; b < B; b++)
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++)
                for (int c = 0; c < C; c++) {
                    double s = 0;
                    for (int k = 0; k < 4; k++)
                        s += dy[(((size_t)b * 2 * H + 2 * y + k / 2) * 2 * W + 2 * x + k % 2) * C + c];
                    dx[(((size_t)b * H + y) * W + x) * C + c] = (float)s;
                }
    return dx;
}

struct ResampleOut {
    std::vector<float> y, dx, dw, db;
};
// The CPU oracle. f.x is the layer's input (B, Hin, Win, Cin); up: conv on the x2 upsampled input (f.H = 2 Hin).
static ResampleOut cpu_resample(const ConvFixture& f, bool up) {
    int s = up ? 1 : 2, Hin = up ? f.H / 2 : f.H, Win = up ? f.W / 2 : f.W;
    std::vector<float> xin = up ? cpu_upsample(f.x, f.B, Hin, Win, f.Cin) : f.x;
    ResampleOut o;
    o.y.resize(f.y.size());
    o.dw.resize(f.w.size());
    o.db.resize(f.Cout);
    std::vector<float> dxin(xin.size());
    conv3x3_cpu_forward(xin.data(), f.w.data(), f.bias.data(), o.y.data(), nullptr, f.B, f.H, f.W, f.Cin, f.Cout, s);
    conv3x3_cpu_backward(xin.data(), f.w.data(), f.dy.data(), dxin.data(), nullptr, o.dw.data(), nullptr, o.db.data(),
                         f.B, f.H, f.W, f.Cin, f.Cout, s);
    o.dx = up ? cpu_upsample_backward(dxin, f.B, Hin, Win, f.Cin) : dxin;
    return o;
}
// train_unet.cu's layer (as unet_forward / unet_backward run OP_UP and OP_DOWN), outputs poisoned first
static ResampleOut gpu_resample(const ConvFixture& f, bool up, bool tf32) {
    int s = up ? 1 : 2, Hin = up ? f.H / 2 : f.H, Win = up ? f.W / 2 : f.W;
    set_tf32(tf32);
    ConvLab L;
    lab_init(&L, f.B, f.H, f.W, f.Cin, f.Cout, s);
    size_t nup = (size_t)f.B * f.H * f.W * f.Cin;
    float *d_x = to_device(f.x), *d_dy = to_device(f.dy), *d_y = dev_alloc(f.y.size()), *d_dx = dev_alloc(f.x.size());
    float *d_up = dev_alloc(nup), *d_dup = dev_alloc(nup);
    cudaCheck(cudaMemcpy(L.m.p, f.w.data(), f.w.size() * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(L.m.p + L.c.b, f.bias.data(), f.Cout * 4, cudaMemcpyHostToDevice));
    poison(d_y, f.y.size());
    poison(d_dx, f.x.size());
    poison(L.m.g, L.m.n_params);
    if (up) {
        poison(d_up, nup);
        poison(d_dup, nup);
        upsample_act((const float*)d_x, d_up, f.B, Hin, Win, f.Cin);
        cudaCheck(cudaGetLastError());
        conv3x3_forward(&L.m, L.c, d_up, d_y, f.H, f.W, nullptr, nullptr);
        conv3x3_backward_weight(&L.m, L.c, d_up, d_dy, f.H, f.W);
        channel_sums(&L.m, d_dy, L.m.g + L.c.b, f.B, f.Ho * f.Wo, f.Cout, 0, 0);
        conv3x3_backward_data(&L.m, L.c, d_dy, d_dup, f.H, f.W, false);
        upsample_backward_act((const float*)d_dup, d_dx, f.B, Hin, Win, f.Cin, false);
        cudaCheck(cudaGetLastError());
    } else {
        conv3x3_forward(&L.m, L.c, d_x, d_y, f.H, f.W, nullptr, nullptr);
        conv3x3_backward_weight(&L.m, L.c, d_x, d_dy, f.H, f.W);
        channel_sums(&L.m, d_dy, L.m.g + L.c.b, f.B, f.Ho * f.Wo, f.Cout, 0, 0);
        conv3x3_backward_data(&L.m, L.c, d_dy, d_dx, f.H, f.W, false);
    }
    ResampleOut o;
    o.y = to_host(d_y, f.y.size());
    o.dx = to_host(d_dx, f.x.size());
    o.dw = to_host(L.m.g, f.w.size());
    o.db = to_host(L.m.g + L.c.b, f.Cout);
    float* fs[] = {d_x, d_dy, d_y, d_dx, d_up, d_dup};
    for (float* q : fs) cudaCheck(cudaFree(q));
    lab_free(&L);
    set_tf32(false);
    return o;
}

// Tolerances: fp32 sums of <= 9*C = 54 products (y, dx; upsample's dx adds a 4-term sum) or B*Ho*Wo <= 200 (dw, db)
// of O(1) values: rounding <= K * 2^-24 * sum|terms|, ~1e-5 of the scale at worst: atol 3e-5 of the scale, rtol
// 1e-5. TF32 (version 2) rounds operands to 10 mantissa bits (~5e-4 per product): atol 4e-3 of the scale, rtol 4e-3.
static void compare_all(const std::string& who, const ResampleOut& got, const ResampleOut& ref, bool tf32) {
    double at = tf32 ? 4e-3 : 3e-5, rt = tf32 ? 4e-3 : 1e-5;
    check_scaled(who + " y", got.y, ref.y, at, rt);
    check_scaled(who + " dx", got.dx, ref.dx, at, rt);
    check_scaled(who + " grad weight", got.dw, ref.dw, at, rt);
    check_scaled(who + " grad bias", got.db, ref.db, at, rt);
}
static ResampleOut fixture_ref(const ConvFixture& f) {
    ResampleOut r;
    r.y = f.y; r.dx = f.dx; r.dw = f.dw; r.db = f.db;
    return r;
}

// random inputs of awkward sizes (x (B, Hin, Win, C) -> conv C -> C), against the oracle
static ConvFixture random_layer(int B, int Hin, int Win, int C, bool up, uint64_t seed) {
    ConvFixture f;
    f.B = B; f.Cin = f.Cout = C;
    f.H = up ? 2 * Hin : Hin; f.W = up ? 2 * Win : Win;
    int s = up ? 1 : 2;
    f.Ho = (f.H - 1) / s + 1; f.Wo = (f.W - 1) / s + 1;
    float bw = 1.0f / sqrtf(9.0f * C);
    f.x = random_vec((size_t)B * Hin * Win * C, seed, 1, -1, 1);
    f.w = random_vec((size_t)9 * C * C, seed, 2, -bw, bw);
    f.bias = random_vec(C, seed, 3, -bw, bw);
    f.dy = random_vec((size_t)B * f.Ho * f.Wo * C, seed, 4, -1, 1);
    f.y.resize(f.dy.size());
    return f;
}

static void bench(bool tf32) {
    // the UNet's resampling layers at batch 32: downsample 64x64x64, 32x32x128, 16x16x192; upsample 8x8x256 (->16),
    // 16x16x192 (->32), 32x32x128 (->64)
    struct S { int Hin, C; bool up; } shapes[] = {{64, 64, false}, {32, 128, false}, {16, 192, false},
                                                  {8, 256, true}, {16, 192, true}, {32, 128, true}};
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (const S& s : shapes) {
        ConvFixture f = random_layer(32, s.Hin, s.Hin, s.C, s.up, 9);
        set_tf32(tf32);
        ConvLab L;
        lab_init(&L, f.B, f.H, f.W, f.Cin, f.Cout, s.up ? 1 : 2);
        size_t nup = (size_t)f.B * f.H * f.W * f.Cin;
        float *x = dev_alloc(f.x.size()), *y = dev_alloc(f.dy.size()), *dx = dev_alloc(f.x.size());
        float *upb = dev_alloc(nup), *dup = dev_alloc(nup);
        cudaCheck(cudaMemset(x, 0, f.x.size() * 4));
        cudaCheck(cudaMemset(y, 0, f.dy.size() * 4));
        cudaCheck(cudaMemset(L.m.p, 0, L.m.n_params * 4));
        float ms[2];
        for (int pass = 0; pass < 2; pass++) {
            for (int i = 0; i < 13; i++) {
                if (i == 3) cudaCheck(cudaEventRecord(e0));
                const float* in = s.up ? upb : x;
                if (pass == 0) {
                    if (s.up) upsample_act((const float*)x, upb, f.B, s.Hin, s.Hin, f.Cin);
                    conv3x3_forward(&L.m, L.c, in, y, f.H, f.W, nullptr, nullptr);
                } else {
                    conv3x3_backward_weight(&L.m, L.c, in, y, f.H, f.W);
                    channel_sums(&L.m, y, L.m.g + L.c.b, f.B, f.Ho * f.Wo, f.Cout, 0, 0);
                    conv3x3_backward_data(&L.m, L.c, y, s.up ? dup : dx, f.H, f.W, false);
                    if (s.up) upsample_backward_act((const float*)dup, dx, f.B, s.Hin, s.Hin, f.Cin, false);
                }
            }
            cudaCheck(cudaEventRecord(e1));
            cudaCheck(cudaEventSynchronize(e1));
            cudaCheck(cudaEventElapsedTime(&ms[pass], e0, e1));
            ms[pass] /= 10;
        }
        printf("     %s %dx%d C%d B32 (%s): forward %.3f ms, backward %.3f ms\n", s.up ? "upsample" : "downsample",
               s.Hin, s.Hin, s.C, tf32 ? "TF32" : "fp32", ms[0], ms[1]);
        float* fs[] = {x, y, dx, upb, dup};
        for (float* q : fs) cudaCheck(cudaFree(q));
        lab_free(&L);
    }
    set_tf32(false);
}

int main(int argc, char** argv) {
    bool test = lab_version(argc, argv, 2, 1, "1: fp32, 2: TF32") == 0;
    gpu_setup();
    const char* names[2] = {"upsample", "downsample"};
    for (int k = 0; k < 2; k++) {
        bool up = k == 0;
        ConvFixture f;
        if (!conv_fixture_load(&f, names[k], up ? 1008 : 1009, up ? "conv." : "op.", up ? 1 : 2, up)) continue;
        compare_all(std::string("cpu oracle vs torch ") + names[k], cpu_resample(f, up), fixture_ref(f), false);
        if (!g_have_gpu) {
            skip(std::string("v1, v2 vs torch ") + names[k] + ": no CUDA GPU");
            continue;
        }
        for (int v = 1; v <= 2; v++)
            compare_all("v" + std::to_string(v) + " vs torch " + names[k], gpu_resample(f, up, v == 2), fixture_ref(f),
                        v == 2);
    }
    if (!g_have_gpu) {
        skip("resample GPU versions vs the CPU oracle: no CUDA GPU");
        return finish();
    }
    struct Case { int B, Hin, Win, C; bool up; } cases[] = {
        {3, 5, 7, 37, true}, {2, 4, 4, 64, true}, {3, 9, 7, 37, false}, {2, 11, 10, 64, false}};
    uint64_t seed = 100;
    for (const Case& c : cases) {
        ConvFixture f = random_layer(c.B, c.Hin, c.Win, c.C, c.up, seed++);
        ResampleOut ref = cpu_resample(f, c.up);
        char name[96];
        snprintf(name, sizeof name, "%s B%d %dx%d C%d", c.up ? "upsample" : "downsample", c.B, c.Hin, c.Win, c.C);
        for (int v = 1; v <= 2; v++)
            compare_all("v" + std::to_string(v) + " vs cpu oracle " + name, gpu_resample(f, c.up, v == 2), ref, v == 2);
    }
    if (!test) {
        bench(false);
        bench(true);
    }
    gpu_teardown();
    return finish();
}
