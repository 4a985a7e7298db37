/*
dev/muon_ns.cu: Muon's Newton-Schulz iteration on train_unet's weight matrices (issue 21): the bf16 path's
muon_mm_kernel against cuBLASLt and the strict-fp32 iteration (train_unet.cu included with TESTING, so the real
code runs).

  make -C dev muon_ns && ./dev/muon_ns --test     the checks (a GPU of compute capability 8.0+; SKIP without one)
  ./dev/muon_ns                                   the times of the whole iteration and of each product

The default model's 113 conv and linear weights in one phase (a group per shape, MG_SHAPE), each filled with random
entries and scaled to Frobenius norm 1 as Muon's normalisation leaves it, then 5 steps of each form: standard (bf16,
torch.optim.Muon's iteration) and gram (fp16), each three ways: ours (what train_unet runs: muon_mm_kernel, the m x m
products on muon_sq_wgmma_kernel on an sm_90a GPU, and also all on muon_mm_kernel there), cuBLASLt per shape group
(torch's bf16 iteration: bf16 operands and outputs, fp32 accumulation) and strict fp32 (cuBLASLt, from the same
rounded inputs).
--test: per matrix, the relative Frobenius error of our result (each way above) against strict fp32 is at most 2x
that of cuBLASLt's (the project's rule for reduced precision); and ours gives the same bits without Programmatic
Dependent Launch. These shapes are the trainer's own (X X^T split over K up to 4608), larger than
dev/test_unet.cu's fixture. Prints PASS/FAIL/SKIP lines and `N passed, N failed, N skipped`; exit 1 on a failure.
Timing: CUDA events around 5 runs, the median of 21 (dev/unet_NOTES.md, session 23).
*/
#define TESTING
#include "../train_unet.cu"

#include <functional>

static int n_pass = 0, n_fail = 0, n_skip = 0;
static void report(const char* status, const std::string& name, const std::string& detail) {
    printf("%s %s: %s\n", status, name.c_str(), detail.c_str());
    fflush(stdout);
    if (!strcmp(status, "PASS")) n_pass++;
    else if (!strcmp(status, "FAIL")) n_fail++;
    else n_skip++;
}

// The default model's Muon matrices as the bf16 path groups them (one phase); half false: the fp32 iteration with
// the same layout (a group per shape)
static MuonPlan* ns_plan(const UNet* model, int ns, bool half, bool mm, bool wgmma = true) {
    g_muon_mm = mm;
    g_muon_wgmma = wgmma;
    MuonPlan* mp = muon_create(model, 0.02f, 0.95f, 1, 5, MG_SHAPE, ns, half, false);
    g_muon_mm = true;
    g_muon_wgmma = true;
    return mp;
}
// Every matrix's wide orientation filled with uniform entries, zero padding, each scaled to Frobenius norm 1 in
// double, then rounded to S; returns the rounded values as floats (the fp32 iteration starts from the same ones)
template <typename S>
static std::vector<float> ns_fill(MuonPlan* mp, int buf, uint64_t seed) {
    std::vector<float> v(mp->w_elems, 0.f);
    uint64_t s = seed;
    auto rnd = [&]() {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return (double)(s >> 11) / 9007199254740992.0 - 0.5;
    };
    for (const MuonMat& k : mp->mats) {
        const int m = std::min(k.rows, k.cols), M = std::max(k.rows, k.cols);
        std::vector<double> x((size_t)m * M);
        double ss = 0.0;
        for (double& e : x) {
            e = rnd();
            ss += e * e;
        }
        for (int j = 0; j < M; j++)
            for (int i = 0; i < m; i++)
                v[k.w_off + (size_t)j * k.m_pad + i] = muon_to_float(muon_from_float<S>((float)(x[(size_t)j * m + i] /
                                                                                                 sqrt(ss))));
    }
    std::vector<S> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = muon_from_float<S>(v[i]);
    cudaCheck(cudaMemcpy(mp->x[buf], h.data(), h.size() * sizeof(S), cudaMemcpyHostToDevice));
    return v;
}
template <typename S>
static void ns_put(MuonPlan* mp, int buf, const std::vector<float>& v) {
    std::vector<S> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = muon_from_float<S>(v[i]);
    cudaCheck(cudaMemcpy(mp->x[buf], h.data(), h.size() * sizeof(S), cudaMemcpyHostToDevice));
}
template <typename S>
static std::vector<float> ns_get(MuonPlan* mp) {
    std::vector<S> h(mp->w_elems);
    cudaCheck(cudaStreamSynchronize(g_stream));
    cudaCheck(cudaMemcpy(h.data(), mp->x[muon_final_x(mp)], h.size() * sizeof(S), cudaMemcpyDeviceToHost));
    std::vector<float> v(h.size());
    for (size_t i = 0; i < h.size(); i++) v[i] = muon_to_float(h[i]);
    return v;
}
// the whole iteration of every phase, on g_stream
template <typename S>
static void ns_run(MuonPlan* mp) {
    for (int ph = 0; ph + 1 < (int)mp->phase_first.size(); ph++) {
        if (mp->ns == MUON_NS_GRAM) muon_ns_gram<S>(mp, ph, g_stream);
        else muon_ns_standard<S>(mp, ph, g_stream);
    }
}
// ||a - b||_F / ||b||_F over matrix k's elements
static double ns_rel(const MuonMat& k, size_t end, const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0.0, n = 0.0;
    for (size_t e = k.w_off; e < end; e++) {
        d += ((double)a[e] - b[e]) * ((double)a[e] - b[e]);
        n += (double)b[e] * b[e];
    }
    return n > 0.0 ? sqrt(d / n) : d > 0.0 ? INFINITY : 0.0;
}

// One form (S: bf16 standard, fp16 gram) three ways from the same inputs; the checks of the header
template <typename S>
static void ns_check(const UNet* model, int ns) {
    const std::string tag = std::string("muon ns ") + MUON_NS_NAME[ns];
    const int xin = ns == MUON_NS_GRAM ? 1 : 0;  // where the iteration starts (the normalisation's output)
    MuonPlan *ours = ns_plan(model, ns, true, true), *lt = ns_plan(model, ns, true, false);
    MuonPlan *ref = ns_plan(model, ns, false, false), *mma = ns_plan(model, ns, true, true, false);
    bool same_layout = true;
    for (const MuonPlan* o : {lt, ref, mma}) {
        same_layout = same_layout && o->w_elems == ours->w_elems;
        for (size_t q = 0; same_layout && q < ours->mats.size(); q++)
            same_layout = o->mats[q].w_off == ours->mats[q].w_off && o->mats[q].m_pad == ours->mats[q].m_pad;
    }
    if (!same_layout) {
        report("FAIL", tag, "the plans place the matrices differently");
        for (MuonPlan* p : {ours, lt, ref, mma}) muon_destroy(p);
        return;
    }
    const std::vector<float> x = ns_fill<S>(ours, xin, 7);
    ns_put<S>(lt, xin, x);
    ns_put<float>(ref, xin, x);
    set_tf32(false);
    ns_run<S>(ours);
    const std::vector<float> a = ns_get<S>(ours);
    ns_put<S>(ours, xin, x);
    ours->pdl = false;
    ns_run<S>(ours);
    const std::vector<float> serial = ns_get<S>(ours);
    ns_run<S>(lt);
    const std::vector<float> b = ns_get<S>(lt);
    ns_run<float>(ref);
    const std::vector<float> r = ns_get<float>(ref);
    ns_put<S>(mma, xin, x);
    ns_run<S>(mma);
    const std::vector<float> c = ns_get<S>(mma);
    auto check = [&](const std::vector<float>& v, const std::string& what) {  // per matrix: error / cuBLASLt's
        double worst = 0.0, e_v = 0.0, e_lt = 0.0;
        int at = -1;
        for (size_t q = 0; q < ours->mats.size(); q++) {
            const size_t end = q + 1 < ours->mats.size() ? ours->mats[q + 1].w_off : ours->w_elems;
            const double ev = ns_rel(ours->mats[q], end, v, r), el = ns_rel(ours->mats[q], end, b, r);
            const double ratio = el > 0.0 ? ev / el : ev > 0.0 ? INFINITY : 0.0;
            if (at < 0 || ratio > worst) {
                worst = ratio;
                e_v = ev;
                e_lt = el;
                at = (int)q;
            }
        }
        const MuonMat& k = ours->mats[at];
        report(worst <= 2.0 ? "PASS" : "FAIL", tag + what,
               strfmt("%zu matrices, 5 steps: error against strict fp32, ours / cuBLASLt's, worst %.3f (matrix %d, %d "
                      "x %d: %.2e / %.2e; at most 2)", ours->mats.size(), worst, at, k.rows, k.cols, e_v, e_lt));
    };
    check(a, ours->wg ? " (m x m on wgmma)" : "");
    if (ours->wg) check(c, " (all on muon_mm_kernel)");
    const bool same = memcmp(a.data(), serial.data(), a.size() * sizeof(float)) == 0;
    report(same ? "PASS" : "FAIL", tag + " without PDL", same ? "the same bits" : "DIFFERENT BITS");
    for (MuonPlan* p : {ours, lt, ref, mma}) muon_destroy(p);
}

static void ns_time(const char* name, const std::function<void()>& f) {
    for (int r = 0; r < 3; r++) f();
    cudaCheck(cudaStreamSynchronize(g_stream));
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < 21; r++) {
        cudaCheck(cudaEventRecord(e0, g_stream));
        for (int q = 0; q < 5; q++) f();
        cudaCheck(cudaEventRecord(e1, g_stream));
        cudaCheck(cudaEventSynchronize(e1));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms / 5);
    }
    std::sort(t.begin(), t.end());
    printf("%-52s %9.1f us\n", name, t[10] * 1000);
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
}
// The iteration's times (its buffers rewritten in place each run: the values drift, the work does not)
template <typename S>
static void ns_bench(const UNet* model, int ns) {
    const bool gram = ns == MUON_NS_GRAM;
    MuonPlan *ours = ns_plan(model, ns, true, true), *lt = ns_plan(model, ns, true, false);
    const std::vector<float> x = ns_fill<S>(ours, gram ? 1 : 0, 7);
    ns_put<S>(lt, gram ? 1 : 0, x);
    const std::string form = gram ? "gram (fp16)" : "standard (bf16)";
    ns_time((form + ", 5 steps: ours" + (ours->wg ? " (m x m on wgmma)" : "")).c_str(), [&]() { ns_run<S>(ours); });
    if (ours->wg) {
        MuonPlan* mma = ns_plan(model, ns, true, true, false);
        ns_put<S>(mma, gram ? 1 : 0, x);
        ns_time((form + ", 5 steps: all on muon_mm_kernel").c_str(), [&]() { ns_run<S>(mma); });
        S *A = (S*)mma->sq[0], *B = (S*)mma->sq[1];
        ns_time("  one m x m product on muon_mm_kernel",
                [&]() { muon_prod<S>(mma, 0, g_stream, MUON_MM_SQ, 1, A, A, A, B, MUON_C, MUON_B, 0.f); });
        muon_destroy(mma);
    }
    const bool pdl = ours->pdl;
    ours->pdl = false;
    ns_time((form + ", 5 steps: muon_mm_kernel, no PDL").c_str(), [&]() { ns_run<S>(ours); });
    ours->pdl = pdl;
    ns_time((form + ", 5 steps: cuBLASLt per shape").c_str(), [&]() { ns_run<S>(lt); });
    S *X = (S*)ours->x[gram ? 1 : 0], *Y = (S*)ours->x[gram ? 0 : 1], *A = (S*)ours->sq[0], *B = (S*)ours->sq[1];
    ns_time("  one X X^T", [&]() { muon_prod<S>(ours, 0, g_stream, MUON_MM_GRAM, 0, X, X, A, A, 1.f, 0.f, 0.f); });
    ns_time("  one m x m product (c A A + b A)",
            [&]() { muon_prod<S>(ours, 0, g_stream, MUON_MM_SQ, 1, A, A, A, B, MUON_C, MUON_B, 0.f); });
    ns_time("  one B X + a X",
            [&]() { muon_prod<S>(ours, 0, g_stream, MUON_MM_LEFT, 2, B, X, X, Y, 1.f, MUON_A, 0.f); });
    muon_destroy(ours);
    muon_destroy(lt);
}

int main(int argc, char** argv) {
    bool test = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--test")) test = true;
        else {
            fprintf(stderr, "usage: %s [--test]\n", argv[0]);
            return 1;
        }
    }
    const char* why = nullptr;
    if (cuda_device_count(&why) == 0 || !have_bf16_mma()) {
        if (!test) {
            fprintf(stderr, "error: dev/muon_ns times the bf16 path: it needs a CUDA GPU of compute capability 8.0+\n");
            return 1;
        }
        report("SKIP", "muon ns", "needs a CUDA GPU of compute capability 8.0 or newer");
        printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
        return 0;
    }
    gpu_init(PREC_BF16);
    UNet model;
    unet_define(&model, UNetConfig(), 32);
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s\n", prop.name);
    if (test) {
        ns_check<bf16>(&model, MUON_NS_STANDARD);
        ns_check<__half>(&model, MUON_NS_GRAM);
        printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
        return n_fail ? 1 : 0;
    }
    ns_bench<bf16>(&model, MUON_NS_STANDARD);
    ns_bench<__half>(&model, MUON_NS_GRAM);
    return 0;
}
