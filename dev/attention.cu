/*
dev/attention.cu: the UNet's AttentionBlock (GroupNorm, qkv conv1d, legacy-order multi-head attention, proj_out,
residual) over NHWC tokens, forward and backward as train_unet.cu runs it (attn_forward / attn_backward), checked
against a CPU oracle in double, and timed.

  make -C dev attention && ./dev/attention --test    # CPU: the oracle's backward against finite differences of
                                                      # its forward and against PyTorch; GPU: train_unet's block
                                                      # against the oracle and PyTorch
  ./dev/attention                                     # the same, then the UNet's shapes at batch 32 timed

version 1 (train_unet.cu, --precision fp32/tf32): qkv and proj_out as cuBLAS GEMMs over (B*L, C); QK^T, PV and the
four backward products as cublasSgemmBatched over (sample, head) with pointer arrays that address the legacy qkv
channel order (head h: q, k, v at channels 3dh, 3dh+d, 3dh+2d) in place, so nothing is transposed; softmax and its
backward are the softmax lab's short-row kernels (dev/softmax_forward.cu version 4, dev/softmax_backward.cu version
3: GROUP lanes per row holding it in registers), the backward's d^-1/2 folded into the dQ/dK products' alpha.
--test also checks the CPU oracle (CI) and the GPU block against PyTorch (dev/fixtures/unet_layer_attention.bin,
dev/unet_layers.py); the benchmark times the promoted softmax kernels against the previous warp-per-row ones at
the UNet's shapes (49152x256, 16384x64).
version 2 (train_unet.cu, --precision bf16): the same block in bf16 with the attention core fused (attn_fwd_kernel,
attn_bwd_dq_kernel, attn_bwd_dkv_kernel: mma.sync bf16 tensor cores, scores in registers, L <= 256, heads of 16, 32
or 64), checked against the same oracle with bf16 operands and a bf16 tolerance.
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"  // counters, checks, PyTorch fixtures


// ---------------------------------------------------------------------------------------------------------------
// CPU oracle in double. x (B, L, C) NHWC tokens; parameters: gamma, beta (C), wq (3C, C), bq (3C), wp (C, C), bp (C).
struct AttnParams {
    std::vector<double> gamma, beta, wq, bq, wp, bp;
};
struct AttnCache {
    std::vector<double> xn, qkv, P, a, mean, rstd;
};
static void oracle_forward(const std::vector<double>& x, const AttnParams& w, int B, int L, int C, int heads,
                           std::vector<double>* out, AttnCache* c) {
    const int G = 32, cg = C / G, d = C / heads;
    c->xn.assign((size_t)B * L * C, 0.0);
    c->mean.assign(B * G, 0.0);
    c->rstd.assign(B * G, 0.0);
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) {
            double s = 0, ss = 0, n = (double)L * cg;
            for (int t = 0; t < L; t++)
                for (int ch = g * cg; ch < (g + 1) * cg; ch++) s += x[((size_t)b * L + t) * C + ch];
            double mu = s / n;
            for (int t = 0; t < L; t++)
                for (int ch = g * cg; ch < (g + 1) * cg; ch++) {
                    double v = x[((size_t)b * L + t) * C + ch] - mu;
                    ss += v * v;
                }
            double rs = 1.0 / sqrt(ss / n + 1e-5);
            c->mean[b * G + g] = mu;
            c->rstd[b * G + g] = rs;
            for (int t = 0; t < L; t++)
                for (int ch = g * cg; ch < (g + 1) * cg; ch++) {
                    size_t i = ((size_t)b * L + t) * C + ch;
                    c->xn[i] = (x[i] - mu) * rs * w.gamma[ch] + w.beta[ch];
                }
        }
    c->qkv.assign((size_t)B * L * 3 * C, 0.0);
    for (size_t r = 0; r < (size_t)B * L; r++)
        for (int o = 0; o < 3 * C; o++) {
            double acc = w.bq[o];
            for (int i = 0; i < C; i++) acc += c->xn[r * C + i] * w.wq[(size_t)o * C + i];
            c->qkv[r * 3 * C + o] = acc;
        }
    double scale = 1.0 / sqrt(sqrt((double)d));
    c->P.assign((size_t)B * heads * L * L, 0.0);
    c->a.assign((size_t)B * L * C, 0.0);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < heads; h++) {
            auto q = [&](int t, int i) { return c->qkv[((size_t)b * L + t) * 3 * C + h * 3 * d + i]; };
            auto k = [&](int t, int i) { return c->qkv[((size_t)b * L + t) * 3 * C + h * 3 * d + d + i]; };
            auto v = [&](int t, int i) { return c->qkv[((size_t)b * L + t) * 3 * C + h * 3 * d + 2 * d + i]; };
            double* P = c->P.data() + ((size_t)b * heads + h) * L * L;
            for (int t = 0; t < L; t++) {
                double mx = -1e300;
                for (int s = 0; s < L; s++) {
                    double acc = 0;
                    for (int i = 0; i < d; i++) acc += (q(t, i) * scale) * (k(s, i) * scale);
                    P[(size_t)t * L + s] = acc;
                    mx = std::max(mx, acc);
                }
                double sum = 0;
                for (int s = 0; s < L; s++) sum += (P[(size_t)t * L + s] = exp(P[(size_t)t * L + s] - mx));
                for (int s = 0; s < L; s++) P[(size_t)t * L + s] /= sum;
                for (int i = 0; i < d; i++) {
                    double acc = 0;
                    for (int s = 0; s < L; s++) acc += P[(size_t)t * L + s] * v(s, i);
                    c->a[((size_t)b * L + t) * C + h * d + i] = acc;
                }
            }
        }
    out->assign((size_t)B * L * C, 0.0);
    for (size_t r = 0; r < (size_t)B * L; r++)
        for (int o = 0; o < C; o++) {
            double acc = w.bp[o];
            for (int i = 0; i < C; i++) acc += c->a[r * C + i] * w.wp[(size_t)o * C + i];
            (*out)[r * C + o] = x[r * C + o] + acc;
        }
}
static void oracle_backward(const std::vector<double>& x, const AttnParams& w, const AttnCache& c,
                            const std::vector<double>& dout, int B, int L, int C, int heads, std::vector<double>* dx,
                            AttnParams* dw) {
    const int G = 32, cg = C / G, d = C / heads;
    const size_t R = (size_t)B * L;
    dw->wp.assign((size_t)C * C, 0.0);
    dw->bp.assign(C, 0.0);
    std::vector<double> da(R * C, 0.0);
    for (size_t r = 0; r < R; r++)
        for (int o = 0; o < C; o++) {
            double g = dout[r * C + o];
            dw->bp[o] += g;
            for (int i = 0; i < C; i++) {
                dw->wp[(size_t)o * C + i] += g * c.a[r * C + i];
                da[r * C + i] += g * w.wp[(size_t)o * C + i];
            }
        }
    double s2 = 1.0 / sqrt((double)d);
    std::vector<double> dqkv(R * 3 * C, 0.0);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < heads; h++) {
            const double* P = c.P.data() + ((size_t)b * heads + h) * L * L;
            auto at = [&](int t, int part, int i) { return ((size_t)b * L + t) * 3 * C + h * 3 * d + part * d + i; };
            std::vector<double> dP((size_t)L * L, 0.0);
            for (int t = 0; t < L; t++)
                for (int s = 0; s < L; s++) {
                    double acc = 0;
                    for (int i = 0; i < d; i++) {
                        double g = da[((size_t)b * L + t) * C + h * d + i];
                        acc += g * c.qkv[at(s, 2, i)];
                        dqkv[at(s, 2, i)] += P[(size_t)t * L + s] * g;  // dV = P^T dA
                    }
                    dP[(size_t)t * L + s] = acc;
                }
            for (int t = 0; t < L; t++) {
                double dot = 0;
                for (int s = 0; s < L; s++) dot += P[(size_t)t * L + s] * dP[(size_t)t * L + s];
                for (int s = 0; s < L; s++) {
                    double dS = P[(size_t)t * L + s] * (dP[(size_t)t * L + s] - dot) * s2;
                    for (int i = 0; i < d; i++) {
                        dqkv[at(t, 0, i)] += dS * c.qkv[at(s, 1, i)];
                        dqkv[at(s, 1, i)] += dS * c.qkv[at(t, 0, i)];
                    }
                }
            }
        }
    dw->wq.assign((size_t)3 * C * C, 0.0);
    dw->bq.assign(3 * C, 0.0);
    std::vector<double> dxn(R * C, 0.0);
    for (size_t r = 0; r < R; r++)
        for (int o = 0; o < 3 * C; o++) {
            double g = dqkv[r * 3 * C + o];
            dw->bq[o] += g;
            for (int i = 0; i < C; i++) {
                dw->wq[(size_t)o * C + i] += g * c.xn[r * C + i];
                dxn[r * C + i] += g * w.wq[(size_t)o * C + i];
            }
        }
    dw->gamma.assign(C, 0.0);
    dw->beta.assign(C, 0.0);
    dx->assign(R * C, 0.0);
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) {
            double mu = c.mean[b * G + g], rs = c.rstd[b * G + g], n = (double)L * cg, m1 = 0, m2 = 0;
            for (int t = 0; t < L; t++)
                for (int ch = g * cg; ch < (g + 1) * cg; ch++) {
                    size_t i = ((size_t)b * L + t) * C + ch;
                    double xh = (x[i] - mu) * rs;
                    dw->gamma[ch] += dxn[i] * xh;
                    dw->beta[ch] += dxn[i];
                    m1 += dxn[i] * w.gamma[ch];
                    m2 += dxn[i] * w.gamma[ch] * xh;
                }
            m1 /= n;
            m2 /= n;
            for (int t = 0; t < L; t++)
                for (int ch = g * cg; ch < (g + 1) * cg; ch++) {
                    size_t i = ((size_t)b * L + t) * C + ch;
                    double xh = (x[i] - mu) * rs;
                    (*dx)[i] = rs * (dxn[i] * w.gamma[ch] - m1 - xh * m2) + dout[i];
                }
        }
}

static double frand(uint64_t seed, uint64_t stream, uint64_t i, double lo, double hi) {
    return lo + (hi - lo) * rng_uniform(seed, stream, i);
}
static AttnParams random_params(int C, uint64_t seed) {
    AttnParams w;
    uint64_t k = 0;
    double bq = 1.0 / sqrt((double)C);
    for (int i = 0; i < C; i++) w.gamma.push_back(frand(seed, 1, k++, 0.5, 1.5));
    for (int i = 0; i < C; i++) w.beta.push_back(frand(seed, 1, k++, -0.5, 0.5));
    for (int i = 0; i < 3 * C * C; i++) w.wq.push_back(frand(seed, 1, k++, -bq, bq));
    for (int i = 0; i < 3 * C; i++) w.bq.push_back(frand(seed, 1, k++, -bq, bq));
    for (int i = 0; i < C * C; i++) w.wp.push_back(frand(seed, 1, k++, -bq, bq));
    for (int i = 0; i < C; i++) w.bp.push_back(frand(seed, 1, k++, -bq, bq));
    return w;
}

// CPU: the oracle's backward against central differences of its forward (loss = sum(out * dout)), in double
static void selfcheck_oracle() {
    const int B = 2, L = 5, C = 32, heads = 2;
    AttnParams w = random_params(C, 11);
    std::vector<double> x((size_t)B * L * C), dout(x.size()), out, dx;
    for (size_t i = 0; i < x.size(); i++) {
        x[i] = frand(12, 1, i, -1.5, 2.0);
        dout[i] = frand(12, 2, i, -1, 1);
    }
    AttnCache c;
    oracle_forward(x, w, B, L, C, heads, &out, &c);
    AttnParams dw;
    oracle_backward(x, w, c, dout, B, L, C, heads, &dx, &dw);
    auto loss = [&](const std::vector<double>& xx, const AttnParams& ww) {
        std::vector<double> o;
        AttnCache cc;
        oracle_forward(xx, ww, B, L, C, heads, &o, &cc);
        double s = 0;
        for (size_t i = 0; i < o.size(); i++) s += o[i] * dout[i];
        return s;
    };
    const double h = 1e-5;
    double worst = 0;
    std::string where;
    auto probe = [&](std::vector<double>* v, double analytic, const char* name, size_t i, bool is_x) {
        double keep = (*v)[i];
        (*v)[i] = keep + h;
        double lp = is_x ? loss(*v, w) : loss(x, w);
        (*v)[i] = keep - h;
        double lm = is_x ? loss(*v, w) : loss(x, w);
        (*v)[i] = keep;
        double num = (lp - lm) / (2 * h);
        double err = fabs(num - analytic) / std::max(1e-3, fabs(num));
        if (err > worst) {
            worst = err;
            where = std::string(name) + "[" + std::to_string(i) + "]";
        }
    };
    for (size_t i = 0; i < x.size(); i += 7) probe(&x, dx[i], "x", i, true);
    for (size_t i = 0; i < w.wq.size(); i += 97) probe(&w.wq, dw.wq[i], "qkv.weight", i, false);
    for (size_t i = 0; i < w.wp.size(); i += 31) probe(&w.wp, dw.wp[i], "proj_out.weight", i, false);
    for (int i = 0; i < C; i += 3) probe(&w.gamma, dw.gamma[i], "norm.weight", i, false);
    for (int i = 0; i < C; i += 3) probe(&w.beta, dw.beta[i], "norm.bias", i, false);
    for (int i = 0; i < 3 * C; i += 5) probe(&w.bq, dw.bq[i], "qkv.bias", i, false);
    // central differences in double with h = 1e-5: truncation ~h^2 and cancellation ~1e-16/h, far below 1e-6
    bool ok = worst < 1e-6;
    printf("%s oracle backward vs finite differences: worst relative error %.2e at %s\n", ok ? "PASS" : "FAIL", worst,
           where.c_str());
    ok ? n_pass++ : n_fail++;
}

// ---------------------------------------------------------------------------------------------------------------
// GPU: train_unet.cu's block inside a one-level UNet whose first input block has attention

static void upload(float* d, const std::vector<double>& v) {
    std::vector<float> f(v.begin(), v.end());
    cudaCheck(cudaMemcpy(d, f.data(), f.size() * 4, cudaMemcpyHostToDevice));
}
static std::vector<float> tofloat(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
// |got - ref| <= rel * max|ref| + 10 rel * |ref|
static void compare_host(const std::string& name, const std::vector<float>& got, const std::vector<double>& ref,
                         double rel) {
    double scale = 0;
    for (double r : ref) scale = std::max(scale, fabs(r));
    std::vector<float> rf = tofloat(ref);
    check_close(name, got.data(), rf.data(), rf.size(), rel * scale, 10 * rel);
}

struct AttnLab {
    UNet m;
    Op* o = nullptr;
};
static bool lab_build(AttnLab* lab, int B, int S, int C, int head_channels, Precision prec = PREC_FP32) {
    UNetConfig cfg;
    cfg.image_size = S;
    cfg.model_channels = C;
    cfg.n_levels = 1;
    cfg.mult[0] = 1; cfg.mult[1] = cfg.mult[2] = cfg.mult[3] = 0;
    cfg.num_res_blocks = 1;
    cfg.attn_ds_mask = 1;
    cfg.num_head_channels = head_channels;
    if (!config_check(cfg).empty()) return false;
    unet_define(&lab->m, cfg, B);
    lab->m.prec = prec;
    unet_allocate(&lab->m);
    for (Op& op : lab->m.ops)
        if (op.kind == OP_ATTN) {
            lab->o = &op;
            break;
        }
    return lab->o != nullptr;
}

struct AttnResult {
    std::vector<float> out, dx;
    AttnParams dw;  // as float values in double vectors
};
static std::vector<double> fetch(const float* d, size_t n) {
    std::vector<float> f = to_host(d, n);
    return std::vector<double>(f.begin(), f.end());
}
static void upload_bf16(bf16* d, const std::vector<double>& v) {
    std::vector<bf16> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = __float2bfloat16_rn((float)v[i]);
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice));
}
static std::vector<double> fetch_bf16(const bf16* d, size_t n) {
    std::vector<bf16> h(n);
    cudaCheck(cudaMemcpy(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<double> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(h[i]);
    return v;
}
// train_unet.cu's block (strict fp32, or bf16: the fused attention kernels) on given x (B, L, C), parameters and
// dout; outputs poisoned first
static bool gpu_run(int B, int S, int C, int head_channels, const AttnParams& w, const std::vector<double>& x,
                    const std::vector<double>& dout, AttnResult* r, bool bf16_run = false) {
    AttnLab lab;
    if (!lab_build(&lab, B, S, C, head_channels, bf16_run ? PREC_BF16 : PREC_FP32)) {
        report(false, "attention B" + std::to_string(B) + " " + std::to_string(S) + "x" + std::to_string(S) + " C" +
                          std::to_string(C) + ": cannot build the lab model");
        return false;
    }
    UNet* m = &lab.m;
    Op& o = *lab.o;
    upload(m->p + o.n1.w, w.gamma);
    upload(m->p + o.n1.b, w.beta);
    upload(m->p + o.qkv.w, w.wq);
    upload(m->p + o.qkv.b, w.bq);
    upload(m->p + o.proj.w, w.wp);
    upload(m->p + o.proj.b, w.bp);
    poison(m->g, m->n_params);
    std::vector<double> out, dx;
    if (bf16_run) {
        if (!o.lse) {
            report(false, "attention bf16 B" + std::to_string(B) + ": the fused kernels do not take this layer");
            unet_free(m);
            return false;
        }
        unet_weights_changed(m);
        upload_bf16(o.in->xb, x);
        upload_bf16(o.out->gb, dout);
        cudaCheck(cudaMemset(o.out->xb, 0xFF, o.out->n * sizeof(bf16)));  // NaN
        cudaCheck(cudaMemset(o.in->gb, 0xFF, o.in->n * sizeof(bf16)));
        cudaCheck(cudaMemset(o.qkvb->gb, 0xFF, o.qkvb->n * sizeof(bf16)));
        attn_forward<bf16>(m, o);
        for (Buf* b : m->bufs) b->g_written = false;
        attn_backward<bf16>(m, o);
        cudaCheck(cudaDeviceSynchronize());
        out = fetch_bf16(o.out->xb, o.out->n);
        dx = fetch_bf16(o.in->gb, o.in->n);
    } else {
        upload(o.in->x, x);
        upload(o.out->g, dout);
        poison(o.out->x, o.out->n);
        poison(o.in->g, o.in->n);
        attn_forward<float>(m, o);
        for (Buf* b : m->bufs) b->g_written = false;
        attn_backward<float>(m, o);
        cudaCheck(cudaDeviceSynchronize());
        out = fetch(o.out->x, o.out->n);
        dx = fetch(o.in->g, o.in->n);
    }
    r->out.assign(out.begin(), out.end());
    r->dx.assign(dx.begin(), dx.end());
    r->dw.gamma = fetch(m->g + o.n1.w, C);
    r->dw.beta = fetch(m->g + o.n1.b, C);
    r->dw.wq = fetch(m->g + o.qkv.w, (size_t)3 * C * C);
    r->dw.bq = fetch(m->g + o.qkv.b, 3 * C);
    r->dw.wp = fetch(m->g + o.proj.w, (size_t)C * C);
    r->dw.bp = fetch(m->g + o.proj.b, C);
    unet_free(m);
    return true;
}

static void gpu_case(int B, int S, int C, int head_channels, uint64_t seed, bool bf16_run = false) {
    int L = S * S, heads = C / head_channels;
    AttnParams w = random_params(C, seed);
    std::vector<double> x((size_t)B * L * C), dout(x.size()), out, dx;
    for (size_t i = 0; i < x.size(); i++) {
        x[i] = frand(seed, 2, i, -1.5, 2.0);
        dout[i] = frand(seed, 3, i, -1, 1);
    }
    if (bf16_run)  // bf16 operands: the oracle sees the values the GPU reads
        for (size_t i = 0; i < x.size(); i++) {
            x[i] = __bfloat162float(__float2bfloat16_rn((float)x[i]));
            dout[i] = __bfloat162float(__float2bfloat16_rn((float)dout[i]));
        }
    AttnResult g;
    if (!gpu_run(B, S, C, head_channels, w, x, dout, &g, bf16_run)) return;
    AttnCache c;
    oracle_forward(x, w, B, L, C, heads, &out, &c);
    AttnParams dw;
    oracle_backward(x, w, c, dout, B, L, C, heads, &dx, &dw);
    char name[96];
    snprintf(name, sizeof name, "attention%s B%d L%d C%d heads %d", bf16_run ? " bf16 (fused)" : "", B, L, C, heads);
    std::string n = name;
    // strict fp32 (cuBLAS default math) against double: sums of <= L*d or B*L terms of O(1) values, so 1e-5 of
    // the tensor's scale for the output and 1e-4 for gradients (two more chained products) leave ample margin
    auto cmp = [&](const std::string& what, const std::vector<float>& got, const std::vector<double>& ref, double rel) {
        compare_host(n + " " + what, got, ref, rel);
    };
    // bf16: every stored activation (normalised x, qkv, probabilities, a, out and their gradients) is rounded to 8
    // significant bits (<= 2^-9 relative each); the 5-8 roundings on any path stay under 2% of a tensor's scale
    const double out_rel = bf16_run ? 2e-2 : 1e-5, grad_rel = bf16_run ? 2e-2 : 1e-4;
    cmp("out", g.out, out, out_rel);
    cmp("dx", g.dx, dx, grad_rel);
    cmp("grad norm.weight", tofloat(g.dw.gamma), dw.gamma, grad_rel);
    cmp("grad norm.bias", tofloat(g.dw.beta), dw.beta, grad_rel);
    cmp("grad qkv.weight", tofloat(g.dw.wq), dw.wq, grad_rel);
    cmp("grad qkv.bias", tofloat(g.dw.bq), dw.bq, grad_rel);
    cmp("grad proj_out.weight", tofloat(g.dw.wp), dw.wp, grad_rel);
    cmp("grad proj_out.bias", tofloat(g.dw.bp), dw.bp, grad_rel);
}

// ---------------------------------------------------------------------------------------------------------------
// PyTorch fixture (dev/fixtures/unet_layer_attention.bin: AttentionBlock(64, 16 channels per head) on (2, 64, 5, 5),
// every parameter random, fp32)
// Tolerances against PyTorch fp32: its sums have <= C = 64 (qkv, proj), d = 16 (QK^T), L = 25 (PV) or B*L = 50
// (weight gradients) terms, chained through softmax and GroupNorm: atol 3e-5 of the scale, rtol 1e-5 for the
// output; 1e-4 of the scale, rtol 1e-5 for gradients (a few chained fp32 products and sums more).
static void fixture_attention() {
    Fixture fx;
    if (!fixture_open(&fx, "attention", 1007)) return;
    std::vector<int> xs = fx_shape(&fx, "x");
    if (!fx.ok || xs.size() != 4 || xs[2] != xs[3]) {
        if (fx.ok) report(false, "fixture attention: x must be (B, C, S, S)");
        return;
    }
    int B = xs[0], C = xs[1], S = xs[2], L = S * S, hc = fx.f.hdr[5];
    if (hc < 1 || C % hc) {
        report(false, "fixture attention: header[5] aux (num_head_channels) is " + std::to_string(hc));
        return;
    }
    auto get = [&](const std::string& name, std::vector<int> shape) { return fx_get(&fx, name, shape); };
    std::vector<float> x = get("x", xs), y = get("y", xs), dy = get("dy", xs), dx = get("dx", xs);
    const char* pnames[6] = {"norm.weight", "norm.bias", "qkv.weight", "qkv.bias", "proj_out.weight", "proj_out.bias"};
    std::vector<std::vector<int>> pshapes = {{C}, {C}, {3 * C, C, 1}, {3 * C}, {C, C, 1}, {C}};
    std::vector<float> pv[6], gv[6];
    for (int i = 0; i < 6; i++) {
        pv[i] = get(pnames[i], pshapes[i]);
        gv[i] = get(std::string("grad.") + pnames[i], pshapes[i]);
    }
    if (!fx.ok) return;
    auto d = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
    AttnParams w;
    w.gamma = d(pv[0]); w.beta = d(pv[1]); w.wq = d(pv[2]); w.bq = d(pv[3]); w.wp = d(pv[4]); w.bp = d(pv[5]);
    std::vector<double> xt = d(nchw_to_nhwc(x, B, C, S, S)), dyt = d(nchw_to_nhwc(dy, B, C, S, S)), out, odx;
    std::vector<float> yt = nchw_to_nhwc(y, B, C, S, S), dxt = nchw_to_nhwc(dx, B, C, S, S);
    AttnCache c;
    oracle_forward(xt, w, B, L, C, C / hc, &out, &c);
    AttnParams dw;
    oracle_backward(xt, w, c, dyt, B, L, C, C / hc, &odx, &dw);
    std::vector<double>* og[6] = {&dw.gamma, &dw.beta, &dw.wq, &dw.bq, &dw.wp, &dw.bp};
    check_scaled("cpu oracle vs torch attention y", tofloat(out), yt, 3e-5, 1e-5);
    check_scaled("cpu oracle vs torch attention dx", tofloat(odx), dxt, 1e-4, 1e-5);
    for (int i = 0; i < 6; i++)
        check_scaled(std::string("cpu oracle vs torch attention grad ") + pnames[i], tofloat(*og[i]), gv[i], 1e-4, 1e-5);
    if (!g_have_gpu) return skip("v1 vs torch attention: no CUDA GPU");
    AttnResult g;
    if (!gpu_run(B, S, C, hc, w, xt, dyt, &g)) return;
    std::vector<double>* gg[6] = {&g.dw.gamma, &g.dw.beta, &g.dw.wq, &g.dw.bq, &g.dw.wp, &g.dw.bp};
    check_scaled("v1 vs torch attention y", g.out, yt, 3e-5, 1e-5);
    check_scaled("v1 vs torch attention dx", g.dx, dxt, 1e-4, 1e-5);
    for (int i = 0; i < 6; i++)
        check_scaled(std::string("v1 vs torch attention grad ") + pnames[i], tofloat(*gg[i]), gv[i], 1e-4, 1e-5);
}

static void bench_case(int B, int S, int C) {
    AttnLab lab;
    if (!lab_build(&lab, B, S, C, 32)) return;
    UNet* m = &lab.m;
    Op& o = *lab.o;
    cudaCheck(cudaMemset(m->p, 0, m->n_params * 4));
    cudaCheck(cudaMemset(o.in->x, 0, o.in->n * 4));
    cudaCheck(cudaMemset(o.out->g, 0, o.out->n * 4));
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    float ms[2];
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 23; i++) {
            if (i == 3) cudaCheck(cudaEventRecord(e0));
            if (pass == 0) attn_forward<float>(m, o);
            else {
                for (Buf* b : m->bufs) b->g_written = false;
                attn_backward<float>(m, o);
            }
        }
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        cudaCheck(cudaEventElapsedTime(&ms[pass], e0, e1));
        ms[pass] /= 20;
    }
    printf("     attention B%d %dx%d C%d (%d heads): forward %.3f ms, backward %.3f ms (%s)\n", B, S, S, C, C / 32, ms[0],
           ms[1], g_tf32 ? "TF32" : "fp32");
    unet_free(m);
}

// ---------------------------------------------------------------------------------------------------------------
// The attention softmax: train_unet.cu's kernels (promoted from dev/softmax_forward.cu version 4 and
// dev/softmax_backward.cu version 3) against the trainer's previous ones (one warp per row, kept here only as the
// baseline: the forward read each row three times, the backward twice), at the UNet's shapes (rows = B*heads*L).

// previous forward: one warp per row, in place: max pass, sum pass, write pass
__global__ void softmax_forward_warp_kernel(float* S, int rows, int L) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    float* r = S + (size_t)row * L;
    float mx = -INFINITY;
    for (int j = lane; j < L; j += 32) mx = fmaxf(mx, r[j]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
    float sum = 0.f;
    for (int j = lane; j < L; j += 32) sum += expf(r[j] - mx);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    float inv = 1.0f / sum;
    for (int j = lane; j < L; j += 32) r[j] = expf(r[j] - mx) * inv;
}
// previous backward: one warp per row, in place on dP, times scale
__global__ void softmax_backward_warp_kernel(const float* P, float* dP, int rows, int L, float scale) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float* p = P + (size_t)row * L;
    float* d = dP + (size_t)row * L;
    float dot = 0.f;
    for (int j = lane; j < L; j += 32) dot += p[j] * d[j];
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
    for (int j = lane; j < L; j += 32) d[j] = p[j] * (d[j] - dot) * scale;
}

static void softmax_bench() {
    // B = 32: 16x16 tokens with 6 heads (192 ch) -> 49152 rows of 256; 8x8 with 8 heads (256 ch) -> 16384 rows of 64
    // (the middle block and the 8x8 level). GB/s: forward 2 * rows * L * 4 bytes, backward 3 * rows * L * 4.
    struct Sh { int rows, L; } shapes[] = {{49152, 256}, {16384, 64}};
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (const Sh& sh : shapes) {
        size_t n = (size_t)sh.rows * sh.L;
        std::vector<float> h = random_vec(n, 5, 1, -4, 4);
        float *S = to_device(h), *P = to_device(h), *dP = to_device(h);
        float ms[4];
        for (int k = 0; k < 4; k++) {
            auto launch = [&]() {
                switch (k) {
                case 0: softmax_forward_warp_kernel<<<ceil_div(sh.rows, 8), 256>>>(S, sh.rows, sh.L); break;
                case 1: softmax_forward(S, sh.rows, sh.L); break;
                case 2: softmax_backward_warp_kernel<<<ceil_div(sh.rows, 8), 256>>>(P, dP, sh.rows, sh.L, 1.0f); break;
                default: softmax_backward(P, dP, sh.rows, sh.L); break;
                }
            };
            for (int i = 0; i < 5; i++) launch();
            cudaCheck(cudaGetLastError());
            cudaCheck(cudaEventRecord(e0));
            for (int i = 0; i < 50; i++) launch();
            cudaCheck(cudaEventRecord(e1));
            cudaCheck(cudaEventSynchronize(e1));
            cudaCheck(cudaEventElapsedTime(&ms[k], e0, e1));
            ms[k] /= 50;
            // keep values bounded between repetitions (the in-place forward of a softmax is a softmax again)
            cudaCheck(cudaMemcpy(S, h.data(), n * 4, cudaMemcpyHostToDevice));
            cudaCheck(cudaMemcpy(dP, h.data(), n * 4, cudaMemcpyHostToDevice));
        }
        printf("     softmax %dx%d: forward warp-per-row %.1f us (%.0f GB/s), v4 %.1f us (%.0f GB/s); backward "
               "warp-per-row %.1f us (%.0f GB/s), v3 %.1f us (%.0f GB/s)\n", sh.rows, sh.L, ms[0] * 1e3,
               2.0 * n * 4 / (ms[0] * 1e6), ms[1] * 1e3, 2.0 * n * 4 / (ms[1] * 1e6), ms[2] * 1e3,
               3.0 * n * 4 / (ms[2] * 1e6), ms[3] * 1e3, 3.0 * n * 4 / (ms[3] * 1e6));
        float* fs[] = {S, P, dP};
        for (float* f : fs) cudaCheck(cudaFree(f));
    }
}

int main(int argc, char** argv) {
    bool test = lab_version(argc, argv, 1, 1, "1: train_unet.cu's attention block") == 0;
    selfcheck_oracle();
    gpu_setup();
    fixture_attention();  // the CPU oracle against PyTorch runs in CI
    if (!g_have_gpu) {
        skip("attention GPU version 1 vs the CPU oracle: no CUDA GPU");
        return finish();
    }
    // awkward sizes: 7x7 and 5x5 tokens, 2 and 3 heads of 16 and 32 channels, batch 3 and 2
    gpu_case(3, 7, 64, 32, 21);
    gpu_case(2, 5, 96, 32, 22);
    gpu_case(2, 6, 32, 16, 23);
    // version 2 (bf16, fused kernels: mma.sync, any GPU of compute capability 8.0 or later): the same awkward sizes
    // (L = 49, 25, 36: keys past L masked), the UNet's shapes (L = 256 and 64, heads of 32) and heads of 64
    gpu_case(3, 7, 64, 32, 24, true);
    gpu_case(2, 5, 96, 32, 25, true);
    gpu_case(2, 6, 32, 16, 26, true);
    gpu_case(2, 16, 192, 32, 27, true);
    gpu_case(3, 8, 256, 32, 28, true);
    gpu_case(2, 9, 128, 64, 29, true);
    if (!test) {
        softmax_bench();
        for (int tf32 = 0; tf32 < 2; tf32++) {
            set_tf32(tf32 == 1);
            bench_case(32, 16, 192);
            bench_case(32, 8, 256);
        }
    }
    gpu_teardown();
    return finish();
}
