// dev/unet_layers.cuh: what the UNet layer files of dev/ share (included after ../train_unet.cu with TESTING):
// the PASS/FAIL/SKIP counters and the closing line, an atol + rtol*|ref| comparison that reports the max error and
// its index, the PyTorch layer fixtures of dev/unet_layers.py (dev/fixtures/unet_layer_<name>.bin, scripts/binio.py
// UNET_LAYER_FIXTURE) with NCHW <-> NHWC conversions, the 3x3 convolution's CPU oracle and a one-convolution UNet
// shell so that train_unet.cu's launchers run unchanged.
#pragma once

static int n_pass = 0, n_fail = 0, n_skip = 0;

static void report(bool ok, const std::string& line) {
    printf("%s %s\n", ok ? "PASS" : "FAIL", line.c_str());
    ok ? n_pass++ : n_fail++;
}
static void skip(const std::string& line) {
    printf("SKIP %s\n", line.c_str());
    n_skip++;
}
static int finish() {
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}

// The command line every layer file takes: `--test` (returns 0) runs the checks; no argument or a version number
// 1..n_versions (returns it; no argument: default_version) validates and times that version. Anything else is an
// error naming the versions (`names`), exit code 1.
static int lab_version(int argc, char** argv, int n_versions, int default_version, const char* names) {
    if (argc < 2) return default_version;
    if (!strcmp(argv[1], "--test")) return 0;
    char* end = nullptr;
    long v = strtol(argv[1], &end, 10);
    if (end == argv[1] || *end != '\0' || v < 1 || v > n_versions) {
        fprintf(stderr, "error: unknown version %s (%s)\n", argv[1], names);
        exit(1);
    }
    return (int)v;
}

// |got - ref| <= atol + rtol * |ref| elementwise (NaN fails); prints the max error, its index and the worst
// err / tol. Returns true when every element is inside.
static bool check_close(const std::string& name, const float* got, const float* ref, size_t n, double atol,
                        double rtol) {
    double max_err = 0.0, worst = 0.0;
    size_t max_i = 0, worst_i = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - (double)ref[i]);
        if (!(err == err)) err = INFINITY;
        double tol = atol + rtol * fabs((double)ref[i]);
        if (!(err <= tol)) bad++;
        if (err > max_err || (err == INFINITY && max_err != INFINITY)) { max_err = err; max_i = i; }
        double r = tol > 0 ? err / tol : (err > 0 ? INFINITY : 0.0);
        if (r > worst) { worst = r; worst_i = i; }
    }
    char line[512];
    snprintf(line, sizeof line, "%s: max |err| %.3e at [%zu] (got %.8g, ref %.8g), worst err/tol %.2f at [%zu], "
             "%zu of %zu outside %.1e + %.1e*|ref|", name.c_str(), max_err, n ? max_i : 0, n ? got[max_i] : 0.f,
             n ? ref[max_i] : 0.f, worst, worst_i, bad, n, atol, rtol);
    report(bad == 0, line);
    return bad == 0;
}
static double max_abs(const std::vector<float>& v) {
    double s = 0;
    for (float x : v) s = std::max(s, (double)fabsf(x));
    return s;
}
// atol as a fraction of the reference tensor's largest magnitude (its scale) + rtol*|ref|
static bool check_scaled(const std::string& name, const std::vector<float>& got, const std::vector<float>& ref,
                         double atol_of_scale, double rtol) {
    if (got.size() != ref.size()) {
        report(false, name + ": size " + std::to_string(got.size()) + ", expected " + std::to_string(ref.size()));
        return false;
    }
    return check_close(name, got.data(), ref.data(), ref.size(), atol_of_scale * max_abs(ref), rtol);
}

// ---------------------------------------------------------------------------------------------------------------
// GPU helpers

static bool g_have_gpu = false;
static bool gpu_setup() {  // false (and no error left behind) on a machine without a GPU
    if (cuda_device_count() == 0) return false;
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    g_num_sms = prop.multiProcessorCount;
    cublasCheck(cublasCreate(&g_cublas));
    set_tf32(false);  // strict fp32 unless a version asks for TF32
    g_have_gpu = true;
    return true;
}
static void gpu_teardown() {
    if (g_have_gpu) cublasCheck(cublasDestroy(g_cublas));
}
static float* to_device(const std::vector<float>& h) {
    float* d = dev_alloc(std::max<size_t>(1, h.size()));
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    return d;
}
static std::vector<float> to_host(const float* d, size_t n) {
    std::vector<float> h(n);
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost));
    return h;
}
static void poison(float* d, size_t n) {
    cudaCheck(cudaMemset(d, 0xFF, n * 4));  // 0xFFFFFFFF is a NaN: an unwritten element fails
}
static std::vector<float> random_vec(size_t n, uint64_t seed, uint64_t stream, float lo, float hi) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = lo + (hi - lo) * rng_uniform(seed, stream, i);
    return v;
}

// ---------------------------------------------------------------------------------------------------------------
// PyTorch layer fixtures

static const int UNET_LAYER_FIXTURE_MAGIC = 20260304;  // the unet fixture magic; slot 3 = layer code 1001..1012
struct Fixture {
    BinFile f;
    std::string name;
    bool ok = false;
};
// Opens dev/fixtures/unet_layer_<name>.bin (run from the repository root) and checks its layer code.
static bool fixture_open(Fixture* fx, const std::string& name, int code) {
    fx->name = name;
    std::string path = "dev/fixtures/unet_layer_" + name + ".bin";
    std::string e = bin_open(&fx->f, path.c_str(), UNET_LAYER_FIXTURE_MAGIC, UNET_FORMAT_VERSION, "unet layer fixture");
    if (e.empty() && fx->f.hdr[3] != code)
        e = path + ": header[3] layer is " + std::to_string(fx->f.hdr[3]) + ", expected " + std::to_string(code) +
            " (" + name + ")";
    fx->ok = e.empty();
    if (!fx->ok) report(false, "fixture " + name + ": " + e + " (regenerate: python3 dev/unet_layers.py)");
    return fx->ok;
}
// The shape of tensor `name` (empty and a FAIL when missing).
static std::vector<int> fx_shape(Fixture* fx, const std::string& name) {
    const BinEntry* e = bin_find(&fx->f, name);
    if (!e) {
        report(false, "fixture " + fx->name + ": tensor " + name + " is missing");
        fx->ok = false;
        return {};
    }
    return std::vector<int>(e->shape, e->shape + e->ndim);
}
// Tensor `name` as float32 of exactly this shape, else a FAIL naming the field and an empty vector.
static std::vector<float> fx_get(Fixture* fx, const std::string& name, const std::vector<int>& shape) {
    std::string err;
    const void* p = bin_expect(&fx->f, name, DT_F32, (int)shape.size(), shape.data(), &err);
    if (!p) {
        report(false, "fixture " + fx->name + ": " + err);
        fx->ok = false;
        return {};
    }
    size_t n = 1;
    for (int s : shape) n *= (size_t)s;
    std::vector<float> v(n);
    memcpy(v.data(), p, n * 4);
    return v;
}
// (B, C, H, W) <-> (B, H, W, C)
static std::vector<float> nchw_to_nhwc(const std::vector<float>& x, int B, int C, int H, int W) {
    std::vector<float> y(x.size());
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++)
            for (int p = 0; p < H * W; p++) y[((size_t)b * H * W + p) * C + c] = x[((size_t)b * C + c) * H * W + p];
    return y;
}
static std::vector<float> nhwc_to_nchw(const std::vector<float>& x, int B, int C, int H, int W) {
    std::vector<float> y(x.size());
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++)
            for (int p = 0; p < H * W; p++) y[((size_t)b * C + c) * H * W + p] = x[((size_t)b * H * W + p) * C + c];
    return y;
}
// conv weight (Cout, Cin, 3, 3) <-> train_unet's [tap][cin][cout]
static std::vector<float> conv_w_to_ours(const std::vector<float>& w, int cout, int cin) {
    std::vector<float> o(w.size());
    for (int co = 0; co < cout; co++)
        for (int ci = 0; ci < cin; ci++)
            for (int tap = 0; tap < 9; tap++) o[((size_t)tap * cin + ci) * cout + co] = w[((size_t)co * cin + ci) * 9 + tap];
    return o;
}
static std::vector<float> conv_w_to_torch(const std::vector<float>& w, int cout, int cin) {
    std::vector<float> o(w.size());
    for (int co = 0; co < cout; co++)
        for (int ci = 0; ci < cin; ci++)
            for (int tap = 0; tap < 9; tap++) o[((size_t)co * cin + ci) * 9 + tap] = w[((size_t)tap * cin + ci) * cout + co];
    return o;
}

// ---------------------------------------------------------------------------------------------------------------
// 3x3 convolution (padding 1, stride s) CPU oracle in double. x (B, H, W, Cin), w [tap][cin][cout] (train_unet's
// layout), y (B, Ho, Wo, Cout). mag (optional) gets the sum of |products| per output: the scale of the rounding
// error of any summation order.
static void conv3x3_cpu_forward(const float* x, const float* w, const float* bias, float* y, float* mag, int B, int H,
                                int W, int Cin, int Cout, int s) {
    int Ho = (H - 1) / s + 1, Wo = (W - 1) / s + 1;
    for (int b = 0; b < B; b++)
        for (int oy = 0; oy < Ho; oy++)
            for (int ox = 0; ox < Wo; ox++)
                for (int co = 0; co < Cout; co++) {
                    double acc = bias ? bias[co] : 0.0, a = bias ? fabs(bias[co]) : 0.0;
                    for (int tap = 0; tap < 9; tap++) {
                        int iy = oy * s - 1 + tap / 3, ix = ox * s - 1 + tap % 3;
                        if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                        for (int ci = 0; ci < Cin; ci++) {
                            double p = (double)x[(((size_t)b * H + iy) * W + ix) * Cin + ci] *
                                       w[((size_t)tap * Cin + ci) * Cout + co];
                            acc += p;
                            a += fabs(p);
                        }
                    }
                    size_t i = (((size_t)b * Ho + oy) * Wo + ox) * Cout + co;
                    y[i] = (float)acc;
                    if (mag) mag[i] = (float)a;
                }
}
// dx (B, H, W, Cin), dw [tap][cin][cout], db (Cout) (each optional) from dy (B, Ho, Wo, Cout)
static void conv3x3_cpu_backward(const float* x, const float* w, const float* dy, float* dx, float* dxmag, float* dw,
                                 float* dwmag, float* db, int B, int H, int W, int Cin, int Cout, int s) {
    int Ho = (H - 1) / s + 1, Wo = (W - 1) / s + 1;
    std::vector<double> adx((size_t)B * H * W * Cin, 0.0), mdx(adx.size(), 0.0);
    std::vector<double> adw((size_t)9 * Cin * Cout, 0.0), mdw(adw.size(), 0.0), adb(Cout, 0.0);
    for (int b = 0; b < B; b++)
        for (int oy = 0; oy < Ho; oy++)
            for (int ox = 0; ox < Wo; ox++) {
                const float* g = dy + (((size_t)b * Ho + oy) * Wo + ox) * Cout;
                for (int co = 0; co < Cout; co++) adb[co] += g[co];
                for (int tap = 0; tap < 9; tap++) {
                    int iy = oy * s - 1 + tap / 3, ix = ox * s - 1 + tap % 3;
                    if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                    size_t xi = (((size_t)b * H + iy) * W + ix) * Cin;
                    for (int ci = 0; ci < Cin; ci++)
                        for (int co = 0; co < Cout; co++) {
                            size_t wi = ((size_t)tap * Cin + ci) * Cout + co;
                            double p = (double)g[co] * w[wi], q = (double)g[co] * x[xi + ci];
                            adx[xi + ci] += p;
                            mdx[xi + ci] += fabs(p);
                            adw[wi] += q;
                            mdw[wi] += fabs(q);
                        }
                }
            }
    for (size_t i = 0; i < adx.size(); i++) {
        if (dx) dx[i] = (float)adx[i];
        if (dxmag) dxmag[i] = (float)mdx[i];
    }
    for (size_t i = 0; i < adw.size(); i++) {
        if (dw) dw[i] = (float)adw[i];
        if (dwmag) dwmag[i] = (float)mdw[i];
    }
    if (db)
        for (int c = 0; c < Cout; c++) db[c] = (float)adb[c];
}

// A UNet shell around one 3x3 convolution (weights at p[0], bias after them) with the workspaces its launchers and
// channel_sums (bias gradient) need.
static const size_t LAB_MAX_SPLITS = 4;  // the largest K split dev/conv2d.cu forces
struct ConvLab {
    UNet m;
    ConvP c;
    int H, W, Ho, Wo;
};
static void lab_init(ConvLab* L, int B, int H, int W, int cin, int cout, int s) {
    L->m.B = B;
    L->c.cin = cin; L->c.cout = cout; L->c.stride = s;
    L->c.w = 0;
    L->c.b = (size_t)9 * cin * cout;
    L->H = H; L->W = W; L->Ho = (H - 1) / s + 1; L->Wo = (W - 1) / s + 1;
    size_t np = L->c.b + cout;
    L->m.n_params = np;
    L->m.p = dev_alloc(np);
    L->m.g = dev_alloc(np);
    // every pass's split-K partials (versions 5 and 6, any v6 tile), and room for dev/conv2d.cu's forced splits
    size_t most = std::max({(size_t)B * H * W * cin, (size_t)B * L->Ho * L->Wo * cout, 9 * (size_t)cin * cout});
    L->m.conv_ws_floats = std::max(conv_ws_floats_need(B, L->c, H, W), LAB_MAX_SPLITS * most);
    L->m.conv_ws = dev_alloc(L->m.conv_ws_floats);
    L->m.wflip_floats = conv_scratch_floats_need(B, L->c, H, W);
    L->m.wflip = dev_alloc(L->m.wflip_floats);
    unet_alloc_chan(&L->m, B, 0);
}
static void lab_free(ConvLab* L) {
    cudaCheck(cudaFree(L->m.p));
    cudaCheck(cudaFree(L->m.g));
    cudaCheck(cudaFree(L->m.conv_ws));
    cudaCheck(cudaFree(L->m.wflip));
    unet_free_chan(&L->m);
    L->m.red_ws = nullptr;
}

// ---------------------------------------------------------------------------------------------------------------
// a convolution fixture (conv3x3, upsample's conv, downsample) in our layouts: x (B, H, W, Cin) (upsample: the
// nearest x2 input), w [tap][cin][cout], y/dy (B, Ho, Wo, Cout), dx like x, dw like w, db (Cout)
struct ConvFixture {
    int B = 0, Cin = 0, Cout = 0, H = 0, W = 0, Ho = 0, Wo = 0;
    std::vector<float> x, w, bias, y, dy, dx, dw, db;
};
// wname: "" (Conv2d), "conv." (Upsample), "op." (Downsample); up: the input is upsampled x2 before the conv
static bool conv_fixture_load(ConvFixture* f, const std::string& name, int code, const std::string& wname, int stride,
                              bool up) {
    Fixture fx;
    if (!fixture_open(&fx, name, code)) return false;
    std::vector<int> xs = fx_shape(&fx, "x"), ws = fx_shape(&fx, wname + "weight");
    if (!fx.ok || xs.size() != 4 || ws.size() != 4) {
        if (fx.ok) report(false, "fixture " + name + ": x and " + wname + "weight must have 4 dims");
        return false;
    }
    f->B = xs[0]; f->Cin = xs[1]; f->Cout = ws[0];
    int Hin = xs[2], Win = xs[3];
    f->H = up ? 2 * Hin : Hin; f->W = up ? 2 * Win : Win;
    f->Ho = (f->H - 1) / stride + 1; f->Wo = (f->W - 1) / stride + 1;
    std::vector<float> x = fx_get(&fx, "x", xs);
    std::vector<float> w = fx_get(&fx, wname + "weight", {f->Cout, f->Cin, 3, 3});
    f->bias = fx_get(&fx, wname + "bias", {f->Cout});
    std::vector<float> y = fx_get(&fx, "y", {f->B, f->Cout, f->Ho, f->Wo});
    std::vector<float> dy = fx_get(&fx, "dy", {f->B, f->Cout, f->Ho, f->Wo});
    std::vector<float> dx = fx_get(&fx, "dx", xs);
    std::vector<float> dw = fx_get(&fx, "grad." + wname + "weight", {f->Cout, f->Cin, 3, 3});
    f->db = fx_get(&fx, "grad." + wname + "bias", {f->Cout});
    if (!fx.ok) return false;
    f->x = nchw_to_nhwc(x, f->B, f->Cin, Hin, Win);
    f->dx = nchw_to_nhwc(dx, f->B, f->Cin, Hin, Win);
    f->w = conv_w_to_ours(w, f->Cout, f->Cin);
    f->dw = conv_w_to_ours(dw, f->Cout, f->Cin);
    f->y = nchw_to_nhwc(y, f->B, f->Cout, f->Ho, f->Wo);
    f->dy = nchw_to_nhwc(dy, f->B, f->Cout, f->Ho, f->Wo);
    return true;
}
