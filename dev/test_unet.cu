/*
dev/test_unet.cu: checks train_unet.cu (included with TESTING, so the real code runs) against dev/unet.py.

  make -C dev test_unet && ./dev/test_unet [DEBUG_STATE.bin ...]
  default: dev/fixtures/unet_debug_small.bin when present, and the forward fixture dev/fixtures/unet_forward_small.bin

Every check runs in true fp32 (--tf32 0 on our side; dev/unet.py sets allow_tf32 False on its side):
  debug state (UNET_DEBUG_STATE, python3 dev/unet.py --debug_state F [--batch_size B --zero_init 0|1 ...]):
    x_t, the model output, the loss, every parameter gradient by name, and the n_steps AdamW-step losses;
  forward fixture (UNET_FIXTURE, dev/unet.py --forward_fixture): the output on the fixture's x_t and t;
  resume: 2N steps in one run vs N steps + --resume + N steps on data/sunflowers64.bin: identical losses (tf32,
  and bf16 where it runs).
--precision bf16 (debug states given on the command line, made with --autocast_bf16 1; compute capability >= 8.0):
  our error against the fp32 reference is at most 2x PyTorch bf16 autocast's own error, tensor by tensor (L2); with
  the sm_90a build on a 9.0 GPU twice, the convolutions on wgmma and then forced onto mma.sync (g_conv8_force).
Muon (the fixture dev/fixtures/unet_muon_small.bin): the CPU step against PyTorch's, gram against standard, the GPU
against the CPU, the bf16 products on muon_mm_kernel (the m x m ones also on wgmma with sm_90a) against cuBLASLt,
the overlap on against off.
CPU checks (also without a GPU, so in CI): the parameter table, the initialisation's distributions, the weight
layout conversion, the loader's draws, Muon's plans and muon_mm_kernel's tile lists. Without a GPU every other check
is SKIPPED. Prints PASS/FAIL/SKIP lines and the closing `N passed, N failed, N skipped`.
*/
#define TESTING
#include "../train_unet.cu"
#include <map>

static int n_pass = 0, n_fail = 0, n_skip = 0;
// python3 dev/unet.py --debug_state dev/fixtures/unet_muon_small.bin --optimizer muon --device cpu (MUON_FIXTURE_CMD)
static const char* MUON_FIXTURE = "dev/fixtures/unet_muon_small.bin";
static void report(const char* status, const std::string& name, const std::string& detail) {
    printf("%s %s: %s\n", status, name.c_str(), detail.c_str());
    fflush(stdout);
    if (!strcmp(status, "PASS")) n_pass++;
    else if (!strcmp(status, "FAIL")) n_fail++;
    else n_skip++;
}

// |got - ref| <= atol + rtol*|ref| for every element; reports the max error, its index and the worst
// error/tolerance ratio. atol = atol_rel * max|ref| (the tensor's own scale) + atol_abs.
static bool check_tensor(const std::string& name, const float* got, const float* ref, size_t n, double atol_rel,
                         double atol_abs, double rtol, bool quiet_pass = false) {
    double scale = 0.0;
    for (size_t i = 0; i < n; i++) scale = std::max(scale, (double)fabsf(ref[i]));
    double atol = atol_rel * scale + atol_abs;
    double max_err = 0.0, worst = 0.0;
    size_t max_i = 0, worst_i = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - (double)ref[i]);
        if (!(err == err)) err = INFINITY;  // NaN fails
        double tol = atol + rtol * fabs((double)ref[i]);
        if (err > max_err) { max_err = err; max_i = i; }
        double r = tol > 0 ? err / tol : (err > 0 ? INFINITY : 0.0);
        if (r > worst) { worst = r; worst_i = i; }
        if (!(err <= tol)) bad++;
    }
    char buf[512];
    snprintf(buf, sizeof buf, "max |err| %.3e at [%zu] (ours %.7g, ref %.7g), scale %.3e, worst err/tol %.3f at [%zu], "
             "%zu of %zu outside atol %.2e + rtol %.1e", max_err, max_i, n ? got[max_i] : 0.f, n ? ref[max_i] : 0.f,
             scale, worst, worst_i, bad, n, atol, rtol);
    if (bad) report("FAIL", name, buf);
    else if (!quiet_pass) report("PASS", name, buf);
    else n_pass++;
    return bad == 0;
}

// NCHW (B, C, H, W) <-> NHWC
static void nchw_to_nhwc(const float* src, float* dst, int B, int C, int H, int W) {
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++)
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++)
                    dst[(((size_t)b * H + y) * W + x) * C + c] = src[(((size_t)b * C + c) * H + y) * W + x];
}
static void nhwc_to_nchw(const float* src, float* dst, int B, int C, int H, int W) {
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++)
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++)
                    dst[(((size_t)b * C + c) * H + y) * W + x] = src[(((size_t)b * H + y) * W + x) * C + c];
}
static std::vector<float> download_nchw(const float* d_nhwc, int B, int C, int H, int W) {
    size_t n = (size_t)B * C * H * W;
    std::vector<float> nhwc(n), nchw(n);
    cudaCheck(cudaMemcpy(nhwc.data(), d_nhwc, n * 4, cudaMemcpyDeviceToHost));
    nhwc_to_nchw(nhwc.data(), nchw.data(), B, C, H, W);
    return nchw;
}
static void upload_nchw(const float* nchw, float* d_nhwc, int B, int C, int H, int W) {
    size_t n = (size_t)B * C * H * W;
    std::vector<float> nhwc(n);
    nchw_to_nhwc(nchw, nhwc.data(), B, C, H, W);
    cudaCheck(cudaMemcpy(d_nhwc, nhwc.data(), n * 4, cudaMemcpyHostToDevice));
}
static std::string base_name(const std::string& p) {
    size_t s = p.find_last_of('/');
    return s == std::string::npos ? p : p.substr(s + 1);
}

// ---------------------------------------------------------------------------------------------------------------
// tolerances (true fp32 on both sides; every one is atol_rel * max|ref| + atol_abs + rtol * |ref|)
// x_t: the same two float products and one sum as PyTorch: equal up to the rounding of a contracted product.
static const double XT_ATOL_REL = 0.0, XT_ATOL = 1e-6, XT_RTOL = 1e-6;
// output: ~30 layers of fp32 convolutions whose summation order differs from cuDNN's (which may also use FFT or
// Winograd algorithms in fp32); a NumPy fp32 forward of the same model differs from PyTorch by ~1.5e-6 on O(1)
// outputs (dev/test_unet_scripts.py). 1e-5 of the output's scale leaves ~10x margin.
static const double OUT_ATOL_REL = 1e-5, OUT_ATOL = 1e-7, OUT_RTOL = 1e-4;
// loss: a mean of B*3*H*W squares; ours sums in double.
static const double LOSS_RTOL = 1e-5;
// gradients: sums over up to B*H*W = 131072 products per weight element, after the whole backward chain, in a
// different order than cuDNN's; elements near zero are judged against the tensor's scale (1e-4 of max|grad|).
static const double GRAD_ATOL_REL = 1e-4, GRAD_ATOL = 1e-12, GRAD_RTOL = 1e-3;
// plus a floor of a few fp32 ulps of the largest gradient of the whole model: a gradient that is zero
// mathematically holds only the rounding noise of terms that cancelled, whose size is set by the gradients around
// it, not by its own scale. (In the 32-channel fixture GroupNorm has one channel per group, which removes any
// per-channel constant, so the embedding weights and the biases before a GroupNorm get exactly zero gradient:
// PyTorch's values there are ~1e-9 noise, ~4e-8 of the largest gradient.)
static const double GRAD_ATOL_GLOBAL_REL = 2e-7;
// AdamW-step losses: each loss is O(1) and depends on all gradients through Adam's normalised updates;
// gradient differences of ~1e-5 relative move these losses by far less than 1e-4 relative.
static const double STEP_LOSS_RTOL = 1e-4;

static bool load_weights(UNet* m, const BinFile* f, const std::string& tag) {
    std::string e = unet_load_tensors(m, f, "", m->p);
    if (!e.empty()) {
        report("FAIL", tag + " weights", e);
        return false;
    }
    return true;
}

// the model config in an opened file's header; false (after a FAIL line) when train_unet cannot build it
static bool config_from_file(const BinFile& f, const std::string& tag, UNetConfig* cfg) {
    *cfg = config_from_header(f.hdr);
    std::string ce = config_check(*cfg);
    if (!ce.empty()) {
        report("FAIL", tag, "header describes a model train_unet cannot build: " + ce);
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------------------------
// --optimizer muon (debug states of python3 dev/unet.py --optimizer muon): header slots of the optimizer fields
enum { DS_OPTIMIZER = 25, DS_MUON_LR, DS_MUON_MOMENTUM, DS_MUON_NESTEROV, DS_NS_STEPS, DS_N_FIXED };
static int g_muon_grouping = MG_AUTO;  // the grouping the GPU checks use
// the debug state's optimizer on m (allocated): Muon's plan on the GPU when the state was made with Muon
static void debug_state_optimizer(UNet* m, const BinFile* f) {
    const int32_t* h = f->hdr;
    if (h[DS_OPTIMIZER] != OPT_MUON) return;
    m->muon = muon_create(m, hdr_float(h, DS_MUON_LR), hdr_float(h, DS_MUON_MOMENTUM), h[DS_MUON_NESTEROV],
                          h[DS_NS_STEPS], g_muon_grouping, MUON_NS_STANDARD, m->prec == PREC_BF16, false);
}
// Muon's updates after the debug state's n_steps, weight by weight: final.<name> - initial against ours - initial.
// Newton-Schulz maps the normalised update through ns_steps quintics whose slope at 0 is a = 3.44, so a relative
// error of the gradient (~1e-5 here, GRAD_RTOL's regime) can grow by up to a^5 ~ 480 in directions of small singular
// values: 1e-3 of the update's scale, with rtol 1e-2 for the elements near it. A weight whose gradient is rounding
// noise (max|grad| below 1e-5 of the model's largest: in the 32-channel fixtures GroupNorm cancels the embedding
// weights' gradient) is not compared: Muon scales any nonzero gradient to a full step in the noise's direction.
static const double MUON_FINAL_ATOL_REL = 1e-3, MUON_FINAL_RTOL = 1e-2, MUON_NOISE_GRAD = 1e-5;
static void check_muon_final(UNet* m, const BinFile* f, const std::string& tag) {
    if (!bin_find(f, "final." + m->params[0].name)) {
        report("SKIP", tag + " final", "no final.* tensors (a debug state from before them: re-run dev/unet.py)");
        return;
    }
    std::vector<float> p(m->n_params);
    cudaCheck(cudaMemcpy(p.data(), m->p, m->n_params * 4, cudaMemcpyDeviceToHost));
    std::string e;
    double gmax = 0.0;
    for (const Param& q : m->params) {
        const float* gr = (const float*)bin_expect(f, "grad." + q.name, DT_F32, q.ndim, q.shape, &e);
        for (size_t i = 0; gr && i < q.n; i++) gmax = std::max(gmax, (double)fabsf(gr[i]));
    }
    int compared = 0, noise = 0;
    for (const Param& q : m->params) {
        if (!muon_param(q)) continue;
        const float* init = (const float*)bin_expect(f, q.name, DT_F32, q.ndim, q.shape, &e);
        const float* fin = init ? (const float*)bin_expect(f, "final." + q.name, DT_F32, q.ndim, q.shape, &e) : nullptr;
        const float* gr = fin ? (const float*)bin_expect(f, "grad." + q.name, DT_F32, q.ndim, q.shape, &e) : nullptr;
        if (!gr) {
            report("FAIL", tag + " final." + q.name, e);
            continue;
        }
        double qmax = 0.0;
        for (size_t i = 0; i < q.n; i++) qmax = std::max(qmax, (double)fabsf(gr[i]));
        if (qmax < MUON_NOISE_GRAD * gmax) {
            noise++;
            continue;
        }
        std::vector<float> ours(q.n), d_ours(q.n), d_ref(q.n);
        param_to_torch(q, p.data() + q.off, ours.data());
        for (size_t i = 0; i < q.n; i++) {
            d_ours[i] = ours[i] - init[i];
            d_ref[i] = fin[i] - init[i];
        }
        check_tensor(tag + " muon update " + q.name, d_ours.data(), d_ref.data(), q.n, MUON_FINAL_ATOL_REL, 0.0,
                     MUON_FINAL_RTOL, true);
        compared++;
    }
    printf("     %s: Muon's updates of %d weights compared with final.* (%d with a rounding-noise gradient left out)\n",
           tag.c_str(), compared, noise);
}

// A debug state with fixed_grad.* (dev/unet.py --debug_state): its file (kept open: the references), the model, the
// initial weights and the gradient grad.* (ours layout), the optimizer and its settings from the header
struct FixedGrad {
    BinFile f;
    UNet model;
    std::vector<float> p0, g;
    int n_fixed = 0, opt = 0;
    float lr = 0, beta1 = 0, beta2 = 0, eps = 0, wd = 0;
};
// false (reported: SKIP without the file or its fixed_grad.* tensors, else FAIL) where path does not load
static bool fixed_grad_load(const std::string& path, const std::string& tag, FixedGrad* fx) {
    std::string e = bin_open(&fx->f, path.c_str(), UNET_DEBUG_MAGIC, UNET_FORMAT_VERSION, "unet debug state");
    if (!e.empty()) {
        if (access(path.c_str(), F_OK) != 0) report("SKIP", tag, "no file " + path);
        else report("FAIL", tag, e);
        return false;
    }
    UNetConfig cfg;
    if (!config_from_file(fx->f, tag, &cfg)) return false;
    const int32_t* h = fx->f.hdr;
    fx->n_fixed = h[DS_N_FIXED];
    fx->opt = h[DS_OPTIMIZER];
    if (fx->n_fixed == 0 && !bin_find(&fx->f, "fixed_grad." + std::string("out.2.bias"))) {
        report("SKIP", tag, "no fixed_grad.* tensors (a debug state from before them: re-run dev/unet.py)");
        return false;
    }
    if (fx->n_fixed < 1 || fx->opt < 0 || fx->opt > 1) {
        report("FAIL", tag, strfmt("header: n_fixed %d (expected >= 1), optimizer %d (expected 0 or 1)", fx->n_fixed,
                                   fx->opt));
        return false;
    }
    fx->lr = hdr_float(h, 20), fx->beta1 = hdr_float(h, 21), fx->beta2 = hdr_float(h, 22);
    fx->eps = hdr_float(h, 23), fx->wd = hdr_float(h, 24);
    unet_define(&fx->model, cfg, h[18]);
    fx->p0.assign(fx->model.n_params, 0.f);
    fx->g.assign(fx->model.n_params, 0.f);
    for (const Param& q : fx->model.params) {
        const float* w = (const float*)bin_expect(&fx->f, q.name, DT_F32, q.ndim, q.shape, &e);
        const float* gr = w ? (const float*)bin_expect(&fx->f, "grad." + q.name, DT_F32, q.ndim, q.shape, &e) : nullptr;
        if (!gr) {
            report("FAIL", tag, e);
            return false;
        }
        param_from_torch(q, w, fx->p0.data() + q.off);
        param_from_torch(q, gr, fx->g.data() + q.off);
    }
    return true;
}
// The parameters (ours layout) after fx.n_fixed steps that each take grad.* as the gradient: AdamW (adamw_elem on the
// CPU), or Muon's plan (grouping, Newton-Schulz form ns) on the CPU's host arrays or on the GPU (bf16 group buffers
// where half). plan, when given: the plan's matrices and groups, in words.
static std::vector<float> fixed_grad_steps(FixedGrad& fx, bool cpu, int grouping, int ns, bool half,
                                           std::string* plan = nullptr) {
    const int32_t* h = fx.f.hdr;
    const size_t np = fx.model.n_params;
    MuonPlan* mp = fx.opt == OPT_MUON ? muon_create(&fx.model, hdr_float(h, DS_MUON_LR), hdr_float(h, DS_MUON_MOMENTUM),
                                                    h[DS_MUON_NESTEROV], h[DS_NS_STEPS], grouping, ns, half, cpu)
                                      : nullptr;
    std::vector<float> p = fx.p0, m1(np, 0.f), v(np, 0.f);
    float *dp = nullptr, *dg = nullptr, *dm = nullptr, *dv = nullptr, *dh = nullptr;
    if (!cpu && !mp) {
        report("FAIL", "fixed_grad_steps", "the GPU runs Muon's step only (AdamW's is checked elsewhere)");
        return p;
    }
    if (!cpu) {
        for (float** a : {&dp, &dg, &dm, &dv}) cudaCheck(cudaMalloc(a, np * sizeof(float)));
        cudaCheck(cudaMalloc(&dh, 3 * sizeof(float)));
        cudaCheck(cudaMemcpy(dp, p.data(), np * sizeof(float), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(dg, fx.g.data(), np * sizeof(float), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemset(dm, 0, np * sizeof(float)));
        cudaCheck(cudaMemset(dv, 0, np * sizeof(float)));
    }
    for (int t = 1; t <= fx.n_fixed; t++) {
        float hyper[3];
        adam_hyper(t, hyper, fx.lr, fx.beta1, fx.beta2, 0.f);
        if (!cpu) {
            cudaCheck(cudaMemcpy(dh, hyper, sizeof hyper, cudaMemcpyHostToDevice));
            muon_step(mp, dp, dg, dm, dv, nullptr, dh, fx.beta1, fx.beta2, fx.eps, fx.lr, fx.wd);
            cudaCheck(cudaDeviceSynchronize());
        } else if (mp) {
            muon_step(mp, p.data(), fx.g.data(), m1.data(), v.data(), nullptr, hyper, fx.beta1, fx.beta2, fx.eps,
                      fx.lr, fx.wd);
        } else {
            for (size_t i = 0; i < np; i++)
                adamw_elem(p.data(), fx.g.data(), m1.data(), v.data(), nullptr, i, fx.beta1, fx.beta2, fx.lr * fx.wd,
                           fx.eps, hyper);
        }
    }
    if (!cpu) {
        cudaCheck(cudaMemcpy(p.data(), dp, np * sizeof(float), cudaMemcpyDeviceToHost));
        for (float* a : {dp, dg, dm, dv, dh}) cudaCheck(cudaFree(a));
    }
    if (mp && plan) *plan = strfmt("%zu matrices in %zu groups", mp->mats.size(), mp->groups.size());
    if (mp) muon_destroy(mp);
    return p;
}

// The optimizer step on the CPU (CI): from the debug state's initial weights, n_fixed steps that each take grad.*
// as the gradient, through the trainer's own functors (muon_step on host arrays, Newton-Schulz in fp32 with double
// accumulation; AdamW: adamw_elem), against PyTorch's fixed_grad.* (fp32, torch.optim.Muon with an fp32 iteration).
// Muon: with every grouping of the matrices (auto, one group per shape, one group for all: the padding is exact).
// The same gradients on both sides: the differences are fp32 roundings (of the products, the norm, and the
// parameters themselves: an ulp of a 0.3 weight is 3e-8, 4e-6 of a 3-step change of 8e-3), measured at most 1.2e-5
// of the change's scale; the parameters after n_fixed steps are compared through their change from the initial
// weights with 1e-4 of its scale, rtol 1e-3.
static const double FIXED_ATOL_REL = 1e-4, FIXED_RTOL = 1e-3;
static void test_fixed_grad_cpu(const std::string& path) {
    std::string tag = base_name(path) + " cpu step", e;
    FixedGrad fx;
    if (!fixed_grad_load(path, tag, &fx)) return;
    const int runs = fx.opt == OPT_MUON ? 3 : 1;
    for (int grouping = 0; grouping < runs; grouping++) {
        std::string plan;
        const std::vector<float> p = fixed_grad_steps(fx, true, grouping, MUON_NS_STANDARD, false, &plan);
        const std::string run = tag + " " + OPTIMIZER_NAME[fx.opt] +
                                (fx.opt == OPT_MUON ? std::string(" ") + MUON_GROUPING_NAME[grouping] : std::string());
        int fails = 0;
        for (const Param& q : fx.model.params) {
            const float* w = (const float*)bin_expect(&fx.f, q.name, DT_F32, q.ndim, q.shape, &e);
            const float* ref = (const float*)bin_expect(&fx.f, "fixed_grad." + q.name, DT_F32, q.ndim, q.shape, &e);
            if (!ref) {
                report("FAIL", run, e);
                fails++;
                break;
            }
            std::vector<float> ours(q.n), d_ours(q.n), d_ref(q.n);
            param_to_torch(q, p.data() + q.off, ours.data());
            for (size_t i = 0; i < q.n; i++) {
                d_ours[i] = ours[i] - w[i];
                d_ref[i] = ref[i] - w[i];
            }
            if (!check_tensor(run + " " + q.name, d_ours.data(), d_ref.data(), q.n, FIXED_ATOL_REL, 0.0, FIXED_RTOL,
                              true))
                fails++;
        }
        std::string detail = strfmt("%d steps on grad.*: %zu tensors against fixed_grad.*, %d failed", fx.n_fixed,
                                    fx.model.params.size(), fails);
        if (!plan.empty()) detail += " (" + plan + ")";
        printf("     %s: %s\n", run.c_str(), detail.c_str());
    }
}

// --muon_ns gram against the standard form, from the Muon fixture (grad.* for n_fixed steps), tensor by tensor.
// The change of every parameter after the steps: fixed_grad_steps less the initial weights.
static std::vector<float> muon_fixture_change(FixedGrad& fx, bool cpu, int ns, bool half) {
    std::vector<float> p = fixed_grad_steps(fx, cpu, MG_AUTO, ns, half);
    for (size_t i = 0; i < p.size(); i++) p[i] -= fx.p0[i];
    return p;
}
// the Muon fixture loaded, or false (reported)
static bool muon_fixture_load(const std::string& tag, FixedGrad* fx) {
    if (!fixed_grad_load(MUON_FIXTURE, tag, fx)) return false;
    if (fx->opt == OPT_MUON) return true;
    report("FAIL", tag, strfmt("%s: optimizer %d, expected 1 (muon)", MUON_FIXTURE, fx->opt));
    return false;
}
// ||a - b||_F / ||b||_F over parameter q (0 where both are 0)
static double muon_rel_diff(const Param& q, const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0.0, n = 0.0;
    for (size_t i = q.off; i < q.off + q.n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        n += (double)b[i] * b[i];
    }
    return n > 0.0 ? sqrt(d / n) : d > 0.0 ? INFINITY : 0.0;
}
// keeps the largest r (NaN counts as infinity) and where it was; true where r is the new largest
static bool keep_worst(double r, const std::string& at, double* worst, std::string* worst_at) {
    if (!(r == r)) r = INFINITY;
    if (!worst_at->empty() && r <= *worst) return false;
    *worst = r;
    *worst_at = at;
    return true;
}

// CI: gram and standard on the CPU (fp32 products with double accumulation) give the same changes within
// MUON_GRAM_CPU_REL per Muon weight (the Gram form's fp32 error against float64, restarts included, was at most
// 2e-5 on 64..256 x 576..2880 matrices with singular values down to 1e-8; dev/unet_NOTES.md), AdamW's bit for bit
static const double MUON_GRAM_CPU_REL = 2e-4;
static void test_muon_gram_cpu() {
    const std::string tag = "muon gram cpu";
    FixedGrad fx;
    if (!muon_fixture_load(tag, &fx)) return;
    const std::vector<float> std_d = muon_fixture_change(fx, true, MUON_NS_STANDARD, false);
    const std::vector<float> gram_d = muon_fixture_change(fx, true, MUON_NS_GRAM, false);
    double worst = 0.0;
    std::string worst_name;
    bool adam_same = true;
    int n_muon = 0;
    for (const Param& q : fx.model.params) {
        if (!muon_param(q)) {
            adam_same = adam_same && !memcmp(&std_d[q.off], &gram_d[q.off], q.n * sizeof(float));
            continue;
        }
        n_muon++;
        keep_worst(muon_rel_diff(q, gram_d, std_d), q.name, &worst, &worst_name);
    }
    const bool ok = worst <= MUON_GRAM_CPU_REL && adam_same && n_muon > 0;
    report(ok ? "PASS" : "FAIL", tag,
           strfmt("%d steps, %d Muon weights: worst ||gram - standard|| / ||standard|| %.2e (%s; tol %.0e), AdamW's "
                  "parameters %s", fx.n_fixed, n_muon, worst, worst_name.c_str(), MUON_GRAM_CPU_REL,
                  adam_same ? "identical" : "DIFFER"));
}

// GPU: the project's rule for reduced precision, tensor by tensor. Against the CPU's standard fp32 step (the
// reference), gram's error in fp16 must be at most twice the standard bf16 form's (torch's Muon); in fp32 (strict
// products) the GPU's gram must equal the CPU's gram within MUON_GRAM_GPU_REL (summation order only).
static const double MUON_GRAM_GPU_REL = 1e-4;
static void test_muon_gram_gpu() {
    const std::string tag = "muon gram gpu";
    FixedGrad fx;
    if (!muon_fixture_load(tag, &fx)) return;
    const std::vector<float> ref = muon_fixture_change(fx, true, MUON_NS_STANDARD, false);
    set_tf32(false);
    const std::vector<float> gram_cpu = muon_fixture_change(fx, true, MUON_NS_GRAM, false);
    const std::vector<float> gram_fp32 = muon_fixture_change(fx, false, MUON_NS_GRAM, false);
    double worst32 = 0.0, worst_ratio = 0.0, err_std_at = 0.0, err_gram_at = 0.0;
    std::string name32, name_ratio;
    const bool bf = have_bf16_mma();
    std::vector<float> std_bf, gram_fp16;
    if (bf) {
        std_bf = muon_fixture_change(fx, false, MUON_NS_STANDARD, true);
        gram_fp16 = muon_fixture_change(fx, false, MUON_NS_GRAM, true);
    }
    int n_muon = 0;
    for (const Param& q : fx.model.params) {
        if (!muon_param(q)) continue;
        n_muon++;
        keep_worst(muon_rel_diff(q, gram_fp32, gram_cpu), q.name, &worst32, &name32);
        if (!bf) continue;
        const double es = muon_rel_diff(q, std_bf, ref), eg = muon_rel_diff(q, gram_fp16, ref);
        if (keep_worst(es > 0.0 ? eg / es : eg > 0.0 ? INFINITY : 0.0, q.name, &worst_ratio, &name_ratio)) {
            err_std_at = es;
            err_gram_at = eg;
        }
    }
    const bool ok32 = worst32 <= MUON_GRAM_GPU_REL && n_muon > 0;
    report(ok32 ? "PASS" : "FAIL", tag + " fp32",
           strfmt("%d steps, %d Muon weights: worst ||GPU - CPU|| / ||CPU|| of the gram step %.2e (%s; tol %.0e)",
                  fx.n_fixed, n_muon, worst32, name32.c_str(), MUON_GRAM_GPU_REL));
    if (!bf) {
        report("SKIP", tag + " fp16", "needs a GPU of compute capability 8.0 or newer");
        return;
    }
    report(worst_ratio <= 2.0 ? "PASS" : "FAIL", tag + " fp16",
           strfmt("error against the CPU's fp32 standard step, gram fp16 / standard bf16, worst %.3f (%s: %.2e / %.2e; "
                  "at most 2)", worst_ratio, name_ratio.c_str(), err_gram_at, err_std_at));
}

// The bf16 path's products on muon_mm_kernel (one launch per product over a phase, split-K and mirrored symmetric
// tiles) against the same step with every product through cuBLASLt per group (torch's bf16 iteration: bf16 operands
// and outputs, fp32 accumulation): tensor by tensor, each one's error against the CPU's fp32 standard step is at most
// 2x cuBLASLt's (the project's rule for reduced precision), for the standard and the gram form; and the same bits
// with muon_mm_kernel launched without Programmatic Dependent Launch (a product reading before its input is final
// would differ). On an sm_90a GPU the m x m products run on muon_sq_wgmma_kernel, so a second run puts them on
// muon_mm_kernel (g_muon_wgmma off) under the same rule.
static void test_muon_mm_gpu() {
    const std::string tag = "muon mm bf16";
    if (!have_bf16_mma()) {
        report("SKIP", tag, "needs a GPU of compute capability 8.0 or newer");
        return;
    }
    FixedGrad fx;
    if (!muon_fixture_load(tag, &fx)) return;
    set_tf32(false);
    const std::vector<float> ref = muon_fixture_change(fx, true, MUON_NS_STANDARD, false);
    for (int ns : {MUON_NS_STANDARD, MUON_NS_GRAM}) {
        const std::vector<float> ours = muon_fixture_change(fx, false, ns, true);
        g_muon_pdl = false;
        const std::vector<float> serial = muon_fixture_change(fx, false, ns, true);
        g_muon_pdl = true;
        g_muon_mm = false;
        const std::vector<float> lt = muon_fixture_change(fx, false, ns, true);
        g_muon_mm = true;
        g_muon_wgmma = false;  // the m x m products on muon_mm_kernel (on an sm_90a GPU the line above ran wgmma)
        const std::vector<float> mma = muon_fixture_change(fx, false, ns, true);
        g_muon_wgmma = true;
        double worst_mma = 0.0;
        std::string name_mma;
        const bool same = memcmp(ours.data(), serial.data(), ours.size() * sizeof(float)) == 0;
        double worst = 0.0, e_ours = 0.0, e_lt = 0.0;
        std::string name;
        int n_muon = 0;
        for (const Param& q : fx.model.params) {
            if (!muon_param(q)) continue;
            n_muon++;
            const double eo = muon_rel_diff(q, ours, ref), el = muon_rel_diff(q, lt, ref);
            if (keep_worst(el > 0.0 ? eo / el : eo > 0.0 ? INFINITY : 0.0, q.name, &worst, &name)) {
                e_ours = eo;
                e_lt = el;
            }
            const double em = muon_rel_diff(q, mma, ref);
            keep_worst(el > 0.0 ? em / el : em > 0.0 ? INFINITY : 0.0, q.name, &worst_mma, &name_mma);
        }
        report(worst <= 2.0 && n_muon > 0 && same ? "PASS" : "FAIL", tag + " " + MUON_NS_NAME[ns],
               strfmt("%d steps, %d Muon weights: error against the CPU's fp32 standard step, ours / "
                      "cuBLASLt's, worst %.3f (%s: %.2e / %.2e; at most 2); without PDL: %s", fx.n_fixed, n_muon, worst,
                      name.c_str(), e_ours, e_lt, same ? "the same bits" : "DIFFERENT BITS"));
        report(worst_mma <= 2.0 && n_muon > 0 ? "PASS" : "FAIL", tag + " " + MUON_NS_NAME[ns] + ", no wgmma",
               strfmt("the m x m products on muon_mm_kernel: error / cuBLASLt's, worst %.3f (%s; at most 2)", worst_mma,
                      name_mma.c_str()));
    }
}

// ---------------------------------------------------------------------------------------------------------------
static void test_debug_state(const std::string& path, bool required) {
    std::string tag = base_name(path);
    BinFile f;
    std::string e = bin_open(&f, path.c_str(), UNET_DEBUG_MAGIC, UNET_FORMAT_VERSION, "unet debug state");
    if (!e.empty()) {
        if (!required && access(path.c_str(), F_OK) != 0) {
            report("SKIP", tag, "no file " + path + " (make it on a GPU machine: python3 dev/unet.py --debug_state " +
                   path + " --image_size 8 --model_channels 32 --channel_mult 1 --num_res_blocks 1 --attn_ds 1 "
                   "--num_head_channels 16 --batch_size 3 --zero_init 0 --n_steps 5)");
        } else {
            report("FAIL", tag, e + " (re-run python3 dev/unet.py --debug_state to regenerate it)");
        }
        return;
    }
    UNetConfig cfg;
    if (!config_from_file(f, tag, &cfg)) return;
    const int32_t* h = f.hdr;
    int B = h[18], S = h[19];
    float lr = hdr_float(h, 20), beta1 = hdr_float(h, 21), beta2 = hdr_float(h, 22), eps = hdr_float(h, 23),
          wd = hdr_float(h, 24);
    int H = cfg.image_size;
    UNet model;
    UNet* m = &model;
    unet_define(m, cfg, B);
    unet_allocate(m);
    debug_state_optimizer(m, &f);
    char buf[256];
    snprintf(buf, sizeof buf, "%s: B=%d, image %d, %zu parameters, %d %s steps", tag.c_str(), B, H, m->n_params, S,
             OPTIMIZER_NAME[f.hdr[DS_OPTIMIZER]]);
    printf("---- %s\n", buf);
    if (!load_weights(m, &f, tag)) {
        unet_free(m);
        return;
    }
    int s4[4] = {B, 3, H, H}, s1[1] = {B}, s2[2] = {S, B}, sS[1] = {S}, sN[4] = {S * B, 3, H, H};
    const float* x0 = (const float*)bin_expect(&f, "x0", DT_F32, 4, s4, &e);
    const int* t = x0 ? (const int*)bin_expect(&f, "t", DT_I32, 1, s1, &e) : nullptr;
    const float* noise = t ? (const float*)bin_expect(&f, "noise", DT_F32, 4, s4, &e) : nullptr;
    const float* xt_ref = noise ? (const float*)bin_expect(&f, "x_t", DT_F32, 4, s4, &e) : nullptr;
    const float* out_ref = xt_ref ? (const float*)bin_expect(&f, "out", DT_F32, 4, s4, &e) : nullptr;
    const float* loss_ref = out_ref ? (const float*)bin_expect(&f, "loss", DT_F32, 0, s1, &e) : nullptr;
    const int* step_t = loss_ref ? (const int*)bin_expect(&f, "step_t", DT_I32, 2, s2, &e) : nullptr;
    const float* step_noise = step_t ? (const float*)bin_expect(&f, "step_noise", DT_F32, 4, sN, &e) : nullptr;
    const float* step_losses = step_noise ? (const float*)bin_expect(&f, "step_losses", DT_F32, 1, sS, &e) : nullptr;
    if (!step_losses) {
        report("FAIL", tag, e);
        unet_free(m);
        return;
    }
    // one forward and backward on (x0, t, noise)
    upload_nchw(x0, m->x0, B, 3, H, H);
    upload_nchw(noise, m->noise, B, 3, H, H);
    cudaCheck(cudaMemcpy(m->t, t, B * sizeof(int), cudaMemcpyHostToDevice));
    unet_q_sample(m);
    size_t nimg = (size_t)B * 3 * H * H;
    std::vector<float> xt = download_nchw(m->xt->x, B, 3, H, H);
    check_tensor(tag + " x_t", xt.data(), xt_ref, nimg, XT_ATOL_REL, XT_ATOL, XT_RTOL);
    unet_forward(m);
    unet_loss(m);
    std::vector<float> out = download_nchw(m->out->x, B, 3, H, H);
    check_tensor(tag + " out", out.data(), out_ref, nimg, OUT_ATOL_REL, OUT_ATOL, OUT_RTOL);
    float loss;
    cudaCheck(cudaMemcpy(&loss, m->loss, 4, cudaMemcpyDeviceToHost));
    check_tensor(tag + " loss", &loss, loss_ref, 1, 0.0, 0.0, LOSS_RTOL);
    unet_backward(m);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> g(m->n_params);
    cudaCheck(cudaMemcpy(g.data(), m->g, m->n_params * 4, cudaMemcpyDeviceToHost));
    int grad_fail = 0;
    double worst_rel = 0.0, global_scale = 0.0;
    for (const Param& p : m->params) {
        const float* ref = (const float*)bin_expect(&f, "grad." + p.name, DT_F32, p.ndim, p.shape, &e);
        for (size_t i = 0; ref && i < p.n; i++) global_scale = std::max(global_scale, (double)fabsf(ref[i]));
    }
    std::string worst_name;
    for (const Param& p : m->params) {
        const float* ref = (const float*)bin_expect(&f, "grad." + p.name, DT_F32, p.ndim, p.shape, &e);
        if (!ref) {
            report("FAIL", tag + " grad." + p.name, e);
            grad_fail++;
            continue;
        }
        std::vector<float> ours(p.n);
        param_to_torch(p, g.data() + p.off, ours.data());
        if (!check_tensor(tag + " grad." + p.name, ours.data(), ref, p.n, GRAD_ATOL_REL,
                          GRAD_ATOL + GRAD_ATOL_GLOBAL_REL * global_scale, GRAD_RTOL)) grad_fail++;
        double scale = 0.0, err = 0.0;
        for (size_t i = 0; i < p.n; i++) {
            scale = std::max(scale, (double)fabsf(ref[i]));
            err = std::max(err, (double)fabsf(ours[i] - ref[i]));
        }
        if (scale > 0 && err / scale > worst_rel) {
            worst_rel = err / scale;
            worst_name = p.name;
        }
    }
    printf("     %s: %zu gradients, %d failed; largest max|err|/max|grad| %.3e (%s)\n", tag.c_str(), m->params.size(),
           grad_fail, worst_rel, worst_name.c_str());
    // S AdamW steps on the same x0 with fresh t and noise per step
    std::vector<float> losses(S);
    for (int i = 0; i < S; i++) {
        upload_nchw(step_noise + (size_t)i * nimg, m->noise, B, 3, H, H);
        cudaCheck(cudaMemcpy(m->t, step_t + (size_t)i * B, B * sizeof(int), cudaMemcpyHostToDevice));
        unet_q_sample(m);
        unet_forward(m);
        unet_loss(m);
        unet_backward(m);
        unet_update(m, lr, beta1, beta2, eps, wd, -1.f);
        cudaCheck(cudaMemcpy(&losses[i], m->loss, 4, cudaMemcpyDeviceToHost));
    }
    if (S > 0) {
        std::string l = " (ours/ref:";
        for (int i = 0; i < std::min(S, 4); i++) {
            snprintf(buf, sizeof buf, " %.6f/%.6f", losses[i], step_losses[i]);
            l += buf;
        }
        printf("     %s step losses%s%s)\n", tag.c_str(), l.c_str(), S > 4 ? " ..." : "");
        check_tensor(tag + " step_losses", losses.data(), step_losses, S, 0.0, 0.0, STEP_LOSS_RTOL);
    }
    if (m->muon) check_muon_final(m, &f, tag);
    unet_free(m);
}

// ---------------------------------------------------------------------------------------------------------------
// --precision bf16 against the same debug state (python3 dev/unet.py --debug_state F --autocast_bf16 1 ...): for the
// output, the loss, every parameter gradient and the AdamW-step losses, our error against the fp32 reference must be
// at most BF16_ERR_RATIO times PyTorch's own bf16-autocast error against it (autocast.* tensors), tensor by tensor.
// The error of a tensor is the L2 norm of its difference (robust to the single elements where two bf16 roundings
// happen to land on opposite sides); the max-abs ratio is printed beside it. Tensors whose reference is zero and
// that both reproduce exactly (zero-initialised layers) pass with both errors 0.
static const double BF16_ERR_RATIO = 2.0;

static double l2_diff(const float* a, const float* b, size_t n, double* max_abs = nullptr) {
    double s = 0.0, mx = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        if (!(d == d)) d = INFINITY;
        s += d * d;
        mx = std::max(mx, fabs(d));
    }
    if (max_abs) *max_abs = mx;
    return sqrt(s);
}
// ours vs PyTorch bf16, both against ref; returns pass
static bool check_bf16_ratio(const std::string& name, const float* ours, const float* torch_bf16, const float* ref,
                             size_t n, bool quiet_pass, double* worst_ratio, std::string* worst_name) {
    double mo, mt;
    const double eo = l2_diff(ours, ref, n, &mo), et = l2_diff(torch_bf16, ref, n, &mt);
    double norm = 0.0;
    for (size_t i = 0; i < n; i++) norm += (double)ref[i] * ref[i];
    norm = sqrt(norm);
    // the floor: fp32 rounding of the reference itself (a tensor both reproduce to ~1e-7 relative passes)
    const bool ok = eo <= BF16_ERR_RATIO * et + 1e-6 * norm;
    const double ratio = et > 0 ? eo / et : (eo > 0 ? INFINITY : 0.0);
    if (ratio > *worst_ratio && norm > 0) {
        *worst_ratio = ratio;
        *worst_name = name;
    }
    char buf[400];
    snprintf(buf, sizeof buf, "L2 err ours %.3e, PyTorch bf16 %.3e (ratio %.2f, limit %.1f), |ref| %.3e; max |err| "
             "ours %.3e, PyTorch %.3e", eo, et, ratio, BF16_ERR_RATIO, norm, mo, mt);
    if (!ok) report("FAIL", name, buf);
    else if (!quiet_pass) report("PASS", name, buf);
    else n_pass++;
    return ok;
}
static std::vector<float> download_nchw_bf16(const bf16* d_nhwc, int B, int C, int H, int W) {
    size_t n = (size_t)B * C * H * W;
    std::vector<bf16> hb(n);
    cudaCheck(cudaMemcpy(hb.data(), d_nhwc, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<float> nhwc(n), nchw(n);
    for (size_t i = 0; i < n; i++) nhwc[i] = __bfloat162float(hb[i]);
    nhwc_to_nchw(nhwc.data(), nchw.data(), B, C, H, W);
    return nchw;
}

static void test_debug_state_bf16(const std::string& path) {
    std::string tag = base_name(path) + " bf16 " + (conv_bf16_wgmma() ? "wgmma" : "mma.sync");
    BinFile f;
    std::string e = bin_open(&f, path.c_str(), UNET_DEBUG_MAGIC, UNET_FORMAT_VERSION, "unet debug state");
    if (!e.empty()) {
        report("FAIL", tag, e);
        return;
    }
    if (!bin_find(&f, "autocast.out")) {
        report("SKIP", tag, "no autocast.* tensors (make the state with python3 dev/unet.py ... --autocast_bf16 1)");
        return;
    }
    UNetConfig cfg;
    if (!config_from_file(f, tag, &cfg)) return;
    const int32_t* h = f.hdr;
    int B = h[18], S = h[19], H = cfg.image_size;
    float lr = hdr_float(h, 20), beta1 = hdr_float(h, 21), beta2 = hdr_float(h, 22), eps = hdr_float(h, 23),
          wd = hdr_float(h, 24);
    UNet model;
    UNet* m = &model;
    unet_define(m, cfg, B);
    m->prec = PREC_BF16;
    unet_allocate(m);
    debug_state_optimizer(m, &f);
    printf("---- %s: B=%d, image %d, %d AdamW steps, --precision bf16 against PyTorch bf16 autocast\n", tag.c_str(), B,
           H, S);
    if (!load_weights(m, &f, tag)) {
        unet_free(m);
        return;
    }
    unet_weights_changed(m);
    int s4[4] = {B, 3, H, H}, s1[1] = {B}, s2[2] = {S, B}, sS[1] = {S}, sN[4] = {S * B, 3, H, H};
    const float* x0 = (const float*)bin_expect(&f, "x0", DT_F32, 4, s4, &e);
    const int* t = x0 ? (const int*)bin_expect(&f, "t", DT_I32, 1, s1, &e) : nullptr;
    const float* noise = t ? (const float*)bin_expect(&f, "noise", DT_F32, 4, s4, &e) : nullptr;
    const float* out_ref = noise ? (const float*)bin_expect(&f, "out", DT_F32, 4, s4, &e) : nullptr;
    const float* out_bf = out_ref ? (const float*)bin_expect(&f, "autocast.out", DT_F32, 4, s4, &e) : nullptr;
    const float* loss_ref = out_bf ? (const float*)bin_expect(&f, "loss", DT_F32, 0, s1, &e) : nullptr;
    const float* loss_bf = loss_ref ? (const float*)bin_expect(&f, "autocast.loss", DT_F32, 0, s1, &e) : nullptr;
    const int* step_t = loss_bf ? (const int*)bin_expect(&f, "step_t", DT_I32, 2, s2, &e) : nullptr;
    const float* step_noise = step_t ? (const float*)bin_expect(&f, "step_noise", DT_F32, 4, sN, &e) : nullptr;
    const float* sl_ref = step_noise ? (const float*)bin_expect(&f, "step_losses", DT_F32, 1, sS, &e) : nullptr;
    const float* sl_bf = sl_ref ? (const float*)bin_expect(&f, "autocast.step_losses", DT_F32, 1, sS, &e) : nullptr;
    if (!sl_bf) {
        report("FAIL", tag, e);
        unet_free(m);
        return;
    }
    upload_nchw(x0, m->x0, B, 3, H, H);
    upload_nchw(noise, m->noise, B, 3, H, H);
    cudaCheck(cudaMemcpy(m->t, t, B * sizeof(int), cudaMemcpyHostToDevice));
    unet_q_sample(m);
    unet_forward(m);
    unet_loss(m);
    double worst = 0.0;
    std::string worst_name;
    size_t nimg = (size_t)B * 3 * H * H;
    std::vector<float> out = download_nchw_bf16(m->out->xb, B, 3, H, H);
    check_bf16_ratio(tag + " out", out.data(), out_bf, out_ref, nimg, false, &worst, &worst_name);
    float loss;
    cudaCheck(cudaMemcpy(&loss, m->loss, 4, cudaMemcpyDeviceToHost));
    check_bf16_ratio(tag + " loss", &loss, loss_bf, loss_ref, 1, false, &worst, &worst_name);
    unet_backward(m);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> g(m->n_params);
    cudaCheck(cudaMemcpy(g.data(), m->g, m->n_params * 4, cudaMemcpyDeviceToHost));
    int fails = 0;
    for (const Param& p : m->params) {
        const float* ref = (const float*)bin_expect(&f, "grad." + p.name, DT_F32, p.ndim, p.shape, &e);
        const float* tb = ref ? (const float*)bin_expect(&f, "autocast.grad." + p.name, DT_F32, p.ndim, p.shape, &e)
                              : nullptr;
        if (!tb) {
            report("FAIL", tag + " grad." + p.name, e);
            fails++;
            continue;
        }
        std::vector<float> ours(p.n);
        param_to_torch(p, g.data() + p.off, ours.data());
        if (!check_bf16_ratio(tag + " grad." + p.name, ours.data(), tb, ref, p.n, true, &worst, &worst_name)) fails++;
    }
    printf("     %s: %zu gradients, %d failed; largest ratio of L2 errors ours/PyTorch %.2f (%s)\n", tag.c_str(),
           m->params.size(), fails, worst, worst_name.c_str());
    std::vector<float> losses(S);
    for (int i = 0; i < S; i++) {
        upload_nchw(step_noise + (size_t)i * nimg, m->noise, B, 3, H, H);
        cudaCheck(cudaMemcpy(m->t, step_t + (size_t)i * B, B * sizeof(int), cudaMemcpyHostToDevice));
        unet_q_sample(m);
        unet_forward(m);
        unet_loss(m);
        unet_backward(m);
        unet_update(m, lr, beta1, beta2, eps, wd, -1.f);
        cudaCheck(cudaMemcpy(&losses[i], m->loss, 4, cudaMemcpyDeviceToHost));
    }
    if (S > 0) check_bf16_ratio(tag + " step_losses", losses.data(), sl_bf, sl_ref, S, false, &worst, &worst_name);
    unet_free(m);
}

// UNET_FIXTURE: weights, x_t (B, 3, H, W), t, out = model(x_t, t)
static void test_forward_fixture(const std::string& path) {
    std::string tag = base_name(path);
    BinFile f;
    std::string e = bin_open(&f, path.c_str(), 20260304, UNET_FORMAT_VERSION, "unet forward fixture");
    if (!e.empty()) {
        if (access(path.c_str(), F_OK) != 0) report("SKIP", tag, "no file " + path);
        else report("FAIL", tag, e);
        return;
    }
    UNetConfig cfg;
    if (!config_from_file(f, tag, &cfg)) return;
    int B = f.hdr[18], H = cfg.image_size;
    UNet model;
    UNet* m = &model;
    unet_define(m, cfg, B);
    unet_allocate(m);
    printf("---- %s: B=%d, image %d, %zu parameters\n", tag.c_str(), B, H, m->n_params);
    if (load_weights(m, &f, tag)) {
        int s4[4] = {B, 3, H, H}, s1[1] = {B};
        const float* xt = (const float*)bin_expect(&f, "x_t", DT_F32, 4, s4, &e);
        const int* t = xt ? (const int*)bin_expect(&f, "t", DT_I32, 1, s1, &e) : nullptr;
        const float* out_ref = t ? (const float*)bin_expect(&f, "out", DT_F32, 4, s4, &e) : nullptr;
        if (!out_ref) {
            report("FAIL", tag, e);
        } else {
            upload_nchw(xt, m->xt->x, B, 3, H, H);
            cudaCheck(cudaMemcpy(m->t, t, B * sizeof(int), cudaMemcpyHostToDevice));
            unet_forward(m);
            std::vector<float> out = download_nchw(m->out->x, B, 3, H, H);
            check_tensor(tag + " out", out.data(), out_ref, (size_t)B * 3 * H * H, OUT_ATOL_REL, OUT_ATOL, OUT_RTOL);
        }
    }
    unet_free(m);
}

// 2N steps in one run vs N steps, --resume, N steps: the same losses bit for bit (every draw is a function of
// (seed, step), every reduction has a fixed order)
// The EMA's warm-up (decay min(ema_rate, (1 + t) / (10 + t)) at step t): with zero gradients AdamW leaves p = 1,
// so an EMA started at 0 must read 1 - prod_k decay_k after t steps. Without the warm-up it would keep
// ema_rate^t of its start (the bias that made DDIM samples saturated noise: dev/unet_NOTES.md, "DDIM").
static void test_ema_warmup() {
    const size_t n = 257;
    const int steps = 20;
    const float rate = 0.999f;
    UNet m;
    m.n_params = m.n_alloc = m.n_state = n;  // one GPU: state for every parameter
    std::vector<float> ones(n, 1.0f);
    m.p = dev_alloc(n); m.g = dev_alloc(n); m.m = dev_alloc(n); m.v = dev_alloc(n); m.ema = dev_alloc(n);
    cudaCheck(cudaMemcpy(m.p, ones.data(), n * 4, cudaMemcpyHostToDevice));
    float* zero[] = {m.g, m.m, m.v, m.ema};
    for (float* z : zero) cudaCheck(cudaMemset(z, 0, n * 4));
    cudaCheck(cudaMalloc(&m.adam_dev, sizeof(int)));
    m.adam_hyper = dev_alloc(3);
    unet_set_adam_step(&m, 0);
    double keep = 1.0;  // share of the EMA's start left after each step
    for (int t = 1; t <= steps; t++) {
        unet_update(&m, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.f, rate);
        keep *= std::min((double)rate, (1.0 + t) / (10.0 + t));
    }
    std::vector<float> ema(n);
    cudaCheck(cudaMemcpy(ema.data(), m.ema, n * 4, cudaMemcpyDeviceToHost));
    double expect = 1.0 - keep, err = 0.0;
    for (float e : ema) err = std::max(err, fabs((double)e - expect));
    // 20 float32 multiply-adds of values <= 1: rounding ~20 * 2^-24 = 1.2e-6
    char buf[256];
    snprintf(buf, sizeof buf, "after %d steps EMA of p = 1 (started at 0) is %.7f, expected 1 - prod min(%.3f, "
             "(1+t)/(10+t)) = %.7f (no warm-up: %.7f); max |err| %.2e", steps, ema[0], rate, expect,
             1.0 - pow((double)rate, steps), err);
    report(err <= 1e-5 ? "PASS" : "FAIL", "ema warm-up", buf);
    float* fs[] = {m.p, m.g, m.m, m.v, m.ema, m.adam_hyper};
    for (float* f : fs) cudaCheck(cudaFree(f));
    cudaCheck(cudaFree(m.adam_dev));
}

// A small UNet (64x64 images, 32 channels, 3 levels, one resblock each, attention at 16x16) trained quietly on data
// at batch 5, logging every step: the whole-run checks below
static TrainArgs small_run(const char* data, Precision prec) {
    TrainArgs a;
    a.data_file = data;
    a.cfg.image_size = 64;
    a.cfg.model_channels = 32;
    a.cfg.n_levels = 3;
    a.cfg.mult[0] = 1; a.cfg.mult[1] = 2; a.cfg.mult[2] = 2; a.cfg.mult[3] = 0;
    a.cfg.num_res_blocks = 1;
    a.cfg.attn_ds_mask = 4;  // 16x16
    a.cfg.num_head_channels = 32;
    a.batch_size = 5;
    a.log_every = 1;
    a.precision = prec;
    a.precision_given = true;
    a.quiet = true;
    return a;
}

static void test_resume(Precision prec) {
    const char* data = "data/sunflowers64.bin";
    if (access(data, F_OK) != 0) {
        report("SKIP", std::string("resume ") + PREC_NAME[prec], std::string("no ") + data);
        return;
    }
    char dir[] = "/tmp/test_unet_XXXXXX";
    if (!mkdtemp(dir)) {
        report("FAIL", std::string("resume ") + PREC_NAME[prec], "mkdtemp failed");
        return;
    }
    TrainArgs a = small_run(data, prec);
    const int N = 4;
    std::vector<float> whole, first, second;
    a.steps = 2 * N;
    a.save_every = 0;
    a.output_dir = std::string(dir) + "/whole";
    int rc1 = unet_train(a, &whole);
    a.steps = N;
    a.save_every = N;
    a.output_dir = std::string(dir) + "/split";
    int rc2 = unet_train(a, &first);
    a.steps = 2 * N;
    a.resume = a.output_dir + "/model.bin";
    int rc3 = unet_train(a, &second);
    std::string cmd = std::string("rm -rf ") + dir;
    if (system(cmd.c_str()) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
    if (rc1 || rc2 || rc3 || whole.size() != 2 * N || first.size() != N || second.size() != N) {
        char buf[128];
        snprintf(buf, sizeof buf, "runs returned %d %d %d with %zu, %zu, %zu losses", rc1, rc2, rc3, whole.size(),
                 first.size(), second.size());
        report("FAIL", std::string("resume ") + PREC_NAME[prec], buf);
        return;
    }
    std::vector<float> joined = first;
    joined.insert(joined.end(), second.begin(), second.end());
    int diff = -1;
    for (int i = 0; i < 2 * N; i++)
        if (memcmp(&joined[i], &whole[i], 4) != 0 && diff < 0) diff = i;
    std::string l;
    char buf[64];
    for (int i = 0; i < 2 * N; i++) {
        snprintf(buf, sizeof buf, " %.7f/%.7f", whole[i], joined[i]);
        l += buf;
    }
    const std::string tag = std::string("resume ") + PREC_NAME[prec];
    if (diff < 0)
        report("PASS", tag, std::to_string(2 * N) + " steps vs " + std::to_string(N) + " + resume + " +
                                std::to_string(N) + ": identical losses (whole/split:" + l + ")");
    else report("FAIL", tag, "first difference at step " + std::to_string(diff) + " (whole/split:" + l + ")");
}

// --optimizer muon with the overlap (each group's Newton-Schulz on a side stream during the backward pass, inside the
// step's CUDA graph) and without it: the same kernels on the same buffers in the same order, so after a few steps the
// checkpoints (weights, EMA, momentum) must be identical byte for byte, and so must the losses.
static void test_muon_overlap(Precision prec, int ns) {
    const std::string tag = std::string("muon overlap ") + PREC_NAME[prec] + (ns == MUON_NS_GRAM ? " gram" : "");
    const char* data = "data/sunflowers64.bin";
    if (access(data, F_OK) != 0) {
        report("SKIP", tag, std::string("no ") + data);
        return;
    }
    char dir[] = "/tmp/test_unet_XXXXXX";
    if (!mkdtemp(dir)) {
        report("FAIL", tag, "mkdtemp failed");
        return;
    }
    TrainArgs a = small_run(data, prec);
    a.optimizer = OPT_MUON;
    a.muon_ns = ns;
    a.steps = 5;  // the first eagerly, then the graph: both paths
    a.save_every = a.steps;
    std::vector<float> losses[2];
    std::vector<char> ckpt[2];
    int rc[2];
    for (int on = 0; on < 2; on++) {
        a.muon_overlap = on;
        a.output_dir = std::string(dir) + (on ? "/on" : "/off");
        rc[on] = unet_train(a, &losses[on]);
        FILE* fp = fopen((a.output_dir + "/model.bin").c_str(), "rb");
        for (int c; fp && (c = fgetc(fp)) != EOF;) ckpt[on].push_back((char)c);
        if (fp) fclose(fp);
    }
    std::string cmd = std::string("rm -rf ") + dir;
    if (system(cmd.c_str()) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
    if (rc[0] || rc[1] || (int)losses[0].size() != a.steps || (int)losses[1].size() != a.steps || ckpt[0].empty()) {
        report("FAIL", tag, strfmt("runs returned %d %d with %zu, %zu losses, a checkpoint of %zu bytes", rc[0], rc[1],
                                   losses[0].size(), losses[1].size(), ckpt[0].size()));
        return;
    }
    size_t diff = ckpt[0].size() == ckpt[1].size() ? ckpt[0].size() : 0;
    for (size_t i = 0; i < std::min(ckpt[0].size(), ckpt[1].size()) && diff == ckpt[0].size(); i++)
        if (ckpt[0][i] != ckpt[1][i]) diff = i;
    const bool same_loss = memcmp(losses[0].data(), losses[1].data(), a.steps * sizeof(float)) == 0;
    const bool ok = diff == ckpt[0].size() && same_loss;
    report(ok ? "PASS" : "FAIL", tag,
           strfmt("%d steps with and without: losses %s (last %.7f/%.7f), checkpoints (%zu bytes) %s", a.steps,
                  same_loss ? "identical" : "DIFFER", losses[1].back(), losses[0].back(), ckpt[0].size(),
                  ok ? "identical" : diff < ckpt[0].size() ? strfmt("differ first at byte %zu", diff).c_str()
                                                           : "differ in length"));
}

// Muon's plan for the default model (CI): under each grouping every element of every conv and linear weight is read
// from one place of the group buffers and every other parameter's is AdamW's, exactly once; the padded shapes hold
// their matrices; the groups tile the matrices in order, each starts (ready) no earlier than the stage that
// finishes its last member's gradient (op_grad_params), and they come in the order the backward pass starts them;
// the phases (the bf16 path's launch units) hold consecutive groups and start after all of them are ready.
// Prints auto's groups, launches, FLOPs per step and the cost model's time.
static void test_muon_plan() {
    UNet model;
    unet_define(&model, UNetConfig(), 32);
    const MuonStages st = muon_stages(&model, true);
    std::vector<int> stage_at(model.n_params, -1);  // per parameter float: the stage of its gradient
    for (size_t pi = 0; pi < model.params.size(); pi++)
        for (size_t i = 0; i < model.params[pi].n; i++) stage_at[model.params[pi].off + i] = st.stage[pi];
    for (int grouping = 0; grouping < 3; grouping++) {
        MuonPlan mp;
        mp.grouping = grouping;
        mp.half = true;
        muon_plan(&mp, model.params, st);
        std::vector<int> seen(model.n_params, 0);
        for (int i : mp.adam_idx) seen[i]++;
        bool fits = true, timely = true;
        int next_mat = 0;
        for (size_t gi = 0; gi < mp.groups.size(); gi++) {
            const MuonGroup& g = mp.groups[gi];
            fits = fits && g.first_mat == next_mat && mp.mats[g.first_mat].w_off == g.w_off;
            next_mat += g.count;
            timely = timely && (gi == 0 || mp.groups[gi - 1].ready <= g.ready) && g.ready < mp.n_stages;
            const int ph = g.phase;
            fits = fits && ph >= 0 && ph + 1 < (int)mp.phase_first.size() && mp.phase_first[ph] <= (int)gi &&
                   (int)gi < mp.phase_first[ph + 1];
            timely = timely && ph < (int)mp.phase_ready.size() && g.ready <= mp.phase_ready[ph] &&
                     (ph == 0 || mp.phase_ready[ph - 1] <= g.ready);
        }
        fits = fits && next_mat == (int)mp.mats.size() && !mp.phase_first.empty() && mp.phase_first[0] == 0 &&
               mp.phase_first.back() == (int)mp.groups.size();
        for (size_t k = 0; k < mp.mats.size(); k++) {
            const MuonMat& q = mp.mats[k];
            const size_t end = k + 1 < mp.mats.size() ? mp.mats[k + 1].w_off : mp.w_elems;
            int gk = 0;  // its group
            while (gk + 1 < (int)mp.groups.size() && mp.groups[gk + 1].first_mat <= (int)k) gk++;
            timely = timely && stage_at[q.p_off] <= mp.groups[gk].ready && q.m_pad == mp.groups[gk].m_pad;
            fits = fits && std::min(q.rows, q.cols) <= q.m_pad && (end - q.w_off) % q.m_pad == 0 &&
                   (size_t)std::max(q.rows, q.cols) <= (end - q.w_off) / q.m_pad;
            for (size_t e = q.w_off; e < end; e++) {
                fits = fits && muon_mat_of(mp.mats.data(), (int)mp.mats.size(), e) == (int)k;
                const long long src = muon_src(q, e - q.w_off);
                if (src >= 0) seen[src]++;
            }
        }
        size_t once = 0, twice = 0, missed = 0;
        for (const Param& q : model.params)
            for (size_t i = 0; i < q.n; i++) {
                const int c = seen[q.off + i];
                once += c == 1;
                twice += c > 1;
                missed += c == 0;
            }
        const bool ok = fits && timely && twice == 0 && missed == 0 && mp.mats.size() == 113;
        report(ok ? "PASS" : "FAIL", std::string("muon plan ") + MUON_GROUPING_NAME[grouping],
               strfmt("%zu matrices in %zu groups and %zu phases, %zu of %zu parameter floats placed once, %zu twice, "
                      "%zu never; shapes fit: %s; ready after their gradients, in order: %s; bf16 step: %d launches, "
                      "%.1f GFLOP of Newton-Schulz, model %.0f us (%.0f after the backward)", mp.mats.size(),
                      mp.groups.size(), mp.phase_first.size() - 1, once, (size_t)22080323, twice, missed,
                      fits ? "yes" : "NO", timely ? "yes" : "NO", mp.launches, mp.gflop, mp.est_us,
                      mp.est_exposed_us));
        if (grouping == MG_AUTO)
            for (const MuonGroup& g : mp.groups)
                printf("     phase %d, group %d x %d: %d matrices, ready at stage %d of %d\n", g.phase, g.m_pad,
                       g.M_pad, g.count, g.ready, mp.n_stages);
    }
}

// muon_mm_kernel's tile lists for the default model's bf16 plan (CI): per phase and kind, every output tile of every
// matrix (GRAM and SQ: the lower triangle, LEFT: all) once, its splits covering its k-tiles in order without gaps,
// each split on its own workspace slot and each split tile on its own counter, the longest first
static void test_muon_mm_tiles() {
    UNet model;
    unet_define(&model, UNetConfig(), 32);
    MuonPlan mp;
    mp.half = true;
    muon_plan(&mp, model.params, muon_stages(&model, true));
    bool ok = mp.grouped;
    int launches = 0, items = 0, splits = 0;
    for (size_t ph = 0; ph + 1 < mp.phase_first.size(); ph++) {
        const int k0 = mp.groups[mp.phase_first[ph]].first_mat;
        const MuonGroup& last = mp.groups[mp.phase_first[ph + 1] - 1];
        const int k1 = last.first_mat + last.count;
        for (int kind = 0; kind < MUON_MM_KINDS; kind++) {
            int slots = 0, ctrs = 0;
            const std::vector<MuonMMTile> t = muon_mm_tiles(mp.mats, k0, k1 - k0, kind, &slots, &ctrs);
            launches++;
            items += (int)t.size();
            std::map<std::array<int, 3>, std::vector<MuonMMTile>> by_tile;
            std::vector<int> slot_use(slots, 0), ctr_use(ctrs, 0);
            for (size_t i = 0; i < t.size(); i++) {
                by_tile[{t[i].mat, t[i].ti, t[i].tj}].push_back(t[i]);
                ok = ok && (i == 0 || t[i - 1].k1 - t[i - 1].k0 >= t[i].k1 - t[i].k0) && t[i].mat >= k0 &&
                     t[i].mat < k1;
                if (t[i].nsplit > 1) {
                    const int sl = t[i].slot0 + t[i].split;
                    ok = ok && sl >= 0 && sl < slots && t[i].ctr >= 0 && t[i].ctr < ctrs;
                    if (ok) slot_use[sl]++;
                }
            }
            for (int q = k0; q < k1; q++) {
                const MuonMat& mq = mp.mats[q];
                const int bt = MUON_MM_BT[kind], nt = ceil_div(mq.m_pad, bt);
                const int nc = kind == MUON_MM_LEFT ? ceil_div(mq.M_pad, bt) : nt;
                const int kt = ceil_div(kind == MUON_MM_GRAM ? mq.M_pad : mq.m_pad, MUON_MM_BK[kind]);
                for (int i = 0; i < nt; i++)
                    for (int j = 0; j < (kind == MUON_MM_LEFT ? nc : i + 1); j++) {
                        auto it = by_tile.find({q, i, j});
                        if (it == by_tile.end()) {
                            ok = false;
                            continue;
                        }
                        std::vector<MuonMMTile> v = it->second;
                        by_tile.erase(it);
                        std::sort(v.begin(), v.end(),
                                  [](const MuonMMTile& a, const MuonMMTile& b) { return a.split < b.split; });
                        int k = 0;
                        for (size_t s = 0; s < v.size(); s++) {
                            ok = ok && v[s].split == (int)s && v[s].nsplit == (int)v.size() && v[s].k0 == k &&
                                 v[s].k1 > v[s].k0 && v[s].ctr == v[0].ctr && v[s].slot0 == v[0].slot0;
                            k = v[s].k1;
                        }
                        ok = ok && k == kt && (v.size() == 1 || kind == MUON_MM_GRAM);
                        if (v.size() > 1 && v[0].ctr >= 0 && v[0].ctr < ctrs) ctr_use[v[0].ctr]++;
                        splits += v.size() > 1;
                    }
            }
            ok = ok && by_tile.empty();  // no tile outside the matrices
            for (int u : slot_use) ok = ok && u == 1;
            for (int u : ctr_use) ok = ok && u == 1;
        }
    }
    report(ok ? "PASS" : "FAIL", "muon mm tiles",
           strfmt("%d launches (%zu phases x %d kinds), %d blocks, %d split tiles: every output tile once, its splits "
                  "tiling K in order, slots and counters each used once, longest first: %s", launches,
                  mp.phase_first.size() - 1, MUON_MM_KINDS, items, splits, ok ? "yes" : "NO"));
}

// ---------------------------------------------------------------------------------------------------------------
// CPU checks (run in CI): the model's parameter table, our initialisation against PyTorch's default
// distributions, the layout conversion, and the loader's draws.
static void cpu_checks() {
    UNet model;
    UNet* m = &model;
    unet_define(m, UNetConfig(), 32);
    size_t total = 0;
    for (const Param& p : m->params) total += p.n;
    // dev/unet.py --list_params for the default model: 22080323 parameters in 338 tensors
    bool ok = total == 22080323 && m->params.size() == 338 && unet_param(m, "output_blocks.8.1.conv.weight") && unet_param(m, "output_blocks.5.2.conv.weight") &&
              unet_param(m, "input_blocks.9.0.op.weight") && unet_param(m, "middle_block.1.qkv.weight");
    report(ok ? "PASS" : "FAIL", "parameter table", std::to_string(total) + " parameters in " +
           std::to_string(m->params.size()) + " tensors (dev/unet.py: 22080323 in 338)");

    // init: GroupNorm 1/0, zero_module layers exactly 0, everything else U(-1/sqrt(fan_in), 1/sqrt(fan_in)):
    // inside the bound, and for tensors of >= 4096 values a variance within 5% of bound^2/3 (the standard error
    // of the variance estimate of a uniform is < 1.2% there) and a mean within 5 standard errors of 0
    std::vector<float> w = unet_init_host(m, 1337);
    int bad = 0;
    std::string first_bad;
    for (size_t pi = 0; pi < m->params.size(); pi++) {
        const Param& p = m->params[pi];
        const std::string& n = p.name;
        std::vector<float> t(p.n);
        param_to_torch(p, w.data() + p.off, t.data());
        bool norm = n.find("in_layers.0.") != std::string::npos || n.find("out_layers.0.") != std::string::npos ||
                    n.find(".norm.") != std::string::npos || n.rfind("out.0.", 0) == 0;
        bool zero = n.find("out_layers.3.") != std::string::npos || n.find("proj_out.") != std::string::npos ||
                    n.rfind("out.2.", 0) == 0;
        bool good = true;
        if (norm) {
            float want = n.compare(n.size() - 7, 7, ".weight") == 0 ? 1.f : 0.f;
            for (float v : t) good = good && v == want;
        } else if (zero) {
            for (float v : t) good = good && v == 0.f;
        } else {
            const Param& wp = n.compare(n.size() - 5, 5, ".bias") == 0 ? m->params[pi - 1] : p;
            double bound = 1.0 / sqrt((double)(wp.n / wp.shape[0]));
            double s = 0, ss = 0;
            for (float v : t) {
                good = good && fabs(v) <= bound;
                s += v;
                ss += (double)v * v;
            }
            if (p.n >= 4096) {
                double mean = s / p.n, var = ss / p.n - mean * mean, want = bound * bound / 3;
                good = good && fabs(var / want - 1) < 0.05 && fabs(mean) < 5 * bound / sqrt(3.0 * p.n);
            }
        }
        if (!good) {
            if (!bad) first_bad = n;
            bad++;
        }
    }
    report(bad ? "FAIL" : "PASS", "init", bad ? std::to_string(bad) + " tensors off, first " + first_bad
           : "338 tensors: GroupNorm 1/0, zero-inits 0, the rest U(+-1/sqrt(fan_in)) with the right variance");

    // layout: PyTorch -> ours -> PyTorch is the identity, and ours is [tap][cin][cout] for 3x3 convs
    bool round = true;
    for (const Param& p : m->params) {
        std::vector<float> a(p.n), b(p.n), c(p.n);
        for (size_t i = 0; i < p.n; i++) a[i] = (float)i;
        param_from_torch(p, a.data(), b.data());
        param_to_torch(p, b.data(), c.data());
        round = round && a == c;
        if (p.kind == PK_CONV3 && p.n > 1) {  // torch (co, ci, ky, kx) = (1, 0, 2, 1) -> ours [(2*3+1)][0][1]
            int co_n = p.shape[0], ci_n = p.shape[1];
            size_t src = ((size_t)1 * ci_n + 0) * 9 + 7, dst = ((size_t)7 * ci_n + 0) * co_n + 1;
            round = round && co_n > 1 && b[dst] == a[src];
        }
    }
    report(round ? "PASS" : "FAIL", "weight layout", "PyTorch (cout, cin, 3, 3) <-> [tap][cin][cout] round trip");

    // loader: every epoch a permutation of the N images, both flips, t in [0, T); draws from step 7 on equal
    // the uninterrupted run's (resume)
    const int N = 37, B = 5, T = 1000, S = 30;
    std::vector<int> codes, ts, codes2, ts2;
    batch_draws(1337, N, T, 0, S, B, &codes, &ts);
    batch_draws(1337, N, T, 7, S - 7, B, &codes2, &ts2);
    bool perm = true, flips[2] = {false, false}, trange = true;
    int epochs = S * B / N;
    for (int e = 0; e < epochs; e++) {
        std::vector<int> seen(N, 0);
        for (int i = 0; i < N; i++) seen[codes[(size_t)e * N + i] >> 1]++;
        for (int c : seen) perm = perm && c == 1;
    }
    for (size_t i = 0; i < codes.size(); i++) {
        flips[codes[i] & 1] = true;
        trange = trange && ts[i] >= 0 && ts[i] < T;
    }
    bool resume = std::equal(codes2.begin(), codes2.end(), codes.begin() + 7 * B) &&
                  std::equal(ts2.begin(), ts2.end(), ts.begin() + 7 * B);
    ok = perm && flips[0] && flips[1] && trange && resume;
    report(ok ? "PASS" : "FAIL", "loader draws", std::to_string(epochs) + " epochs each a permutation of " +
           std::to_string(N) + " images: " + (perm ? "yes" : "NO") + "; both flips: " +
           (flips[0] && flips[1] ? "yes" : "NO") + "; t in [0, T): " + (trange ? "yes" : "NO") +
           "; draws from step 7 equal the uninterrupted run's: " + (resume ? "yes" : "NO"));
}

int main(int argc, char** argv) {
    std::vector<std::string> paths;
    for (int i = 1; i < argc; i++) paths.push_back(argv[i]);
    if (paths.empty()) {
        cpu_checks();
        test_muon_plan();
        test_muon_mm_tiles();
    }
    for (const std::string& p : paths.empty() ? std::vector<std::string>{MUON_FIXTURE} : paths) test_fixed_grad_cpu(p);
    if (paths.empty()) test_muon_gram_cpu();
    if (cuda_device_count() == 0) {
        report("SKIP", "test_unet", "no CUDA GPU (debug state, forward fixture and resume checks need one)");
        printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
        return 0;
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    g_num_sms = prop.multiProcessorCount;
    printf("device: %s\n", prop.name);
    if (paths.empty()) {
        cublasCheck(cublasCreate(&g_cublas));
        set_tf32(false);
        test_debug_state("dev/fixtures/unet_debug_small.bin", false);
        test_debug_state(MUON_FIXTURE, false);
        test_forward_fixture("dev/fixtures/unet_forward_small.bin");
        cublasCheck(cublasDestroy(g_cublas));
        test_resume(PREC_TF32);
        if (have_bf16_mma()) test_resume(PREC_BF16);
        else report("SKIP", "resume bf16", "needs a GPU of compute capability 8.0 or newer");
        test_ema_warmup();
        test_muon_gram_gpu();
        test_muon_mm_gpu();
        test_muon_overlap(PREC_TF32, MUON_NS_STANDARD);
        if (have_bf16_mma()) {
            test_muon_overlap(PREC_BF16, MUON_NS_STANDARD);
            test_muon_overlap(PREC_BF16, MUON_NS_GRAM);
        } else {
            report("SKIP", "muon overlap bf16", "needs a GPU of compute capability 8.0 or newer");
        }
    } else {
        for (const std::string& p : paths) {
            cublasCheck(cublasCreate(&g_cublas));
            set_tf32(false);
            test_debug_state(p, true);
            if (have_bf16_mma()) {
                test_debug_state_bf16(p);  // convolutions on wgmma with sm_90a, else on mma.sync
                if (have_sm90a()) {        // and the mma.sync path of other GPUs, forced
                    g_conv8_force = true;
                    test_debug_state_bf16(p);
                    g_conv8_force = false;
                }
            } else {
                report("SKIP", base_name(p) + " bf16", "needs a GPU of compute capability 8.0 or newer");
            }
            cublasCheck(cublasDestroy(g_cublas));
        }
    }
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
