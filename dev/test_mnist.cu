/*
Tests of train_mnist.cu: includes the trainer (TESTING) and runs its real code.

Build: make -C dev test_mnist        Run (repo root): ./dev/test_mnist
  CPU (always, also in CI): the CPU path's outputs, loss, gradients and 5 SGD / 5 AdamW step losses against the
    committed fixture dev/fixtures/mnist_fixture.bin (PyTorch, hash-initialized weights, B=8); checkpoint round trip
    and resume continuing the same trajectory; Muon, Shampoo and K-FAC (on SGD and on AdamW) over 4 steps against
    dev/fixtures/mnist_optimizers_fixture.bin (dev/mnist_optimizers.py: torch.optim.Muon, plain-PyTorch Shampoo and
    K-FAC).
    Per-sample gradients (--clip_per_sample, --precond fisher_diag) against dev/fixtures/mnist_per_sample_fixture.bin
    (torch.func.vmap): per-sample norms, the clipped gradient, clipped SGD and Fisher-preconditioned steps, the
    DP noise's statistics.
  GPU (skipped without a device): per-sample gradients (our kernel and cuBLAS) against the CPU path; Muon's, Shampoo's and K-FAC's steps on our kernel (strict fp32) against the CPU path; our matmul kernel (fp32 and TF32) against a CPU oracle at awkward sizes for every
    operand kind, outputs poisoned with NaN first; the specialised conv2 TF32 kernels (forward with max-pool and
    window codes, weight and input gradient from dpooled + codes) against the same oracle, with the full and a
    capped persistent grid; fc1's fast kernels (split-K forward + head, backward, its fused optimizer step); the
    optimizer's counter advance; the fixture on the GPU with our kernel and with cuBLAS; the full
    debug state dev/mnist_debug_state.bin (B=64, PyTorch's init; when missing, this test runs python3 dev/mnist.py to
    write it) with both, and the fused fast training step against the unfused one on it.
All comparisons in true fp32 (TF32 off on both sides) unless the check's name says tf32.
Last line: N passed, N failed, N skipped; exit code 1 iff a check failed.
*/
#define TESTING
#include "../train_mnist.cu"
#include <sys/wait.h>
#include <unistd.h>

static int n_pass = 0, n_fail = 0, n_skip = 0;
static void report(bool ok, const std::string& name, const std::string& detail) {
    printf("%s %s: %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
    (ok ? n_pass : n_fail)++;
}
static void skip(const std::string& name, const std::string& why) { printf("SKIP %s: %s\n", name.c_str(), why.c_str()); n_skip++; }

// |got - ref| <= atol + rtol*|ref| elementwise; reports the worst element (largest error/tolerance) and its index.
static bool compare(const std::string& name, const float* got, const float* ref, size_t n, double atol, double rtol) {
    double worst = -1, worst_err = 0; size_t wi = 0; double max_abs = 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - (double)ref[i]);
        if (!(err == err)) err = INFINITY;  // NaN (an unwritten or broken element) always fails
        double ratio = err / (atol + rtol * fabs((double)ref[i]));
        max_abs = std::max(max_abs, err);
        if (ratio > worst) { worst = ratio; worst_err = err; wi = i; }
    }
    char buf[256];
    snprintf(buf, sizeof buf, "n=%zu max|err|=%.3g, worst at [%zu] got %.8g ref %.8g (err %.3g = %.3g of atol %.1g + rtol %.1g*|ref|)",
             n, max_abs, wi, n ? got[wi] : 0.0f, n ? ref[wi] : 0.0f, worst_err, worst, atol, rtol);
    report(worst <= 1.0, name, buf);
    return worst <= 1.0;
}
// An optimizer's update compared in norm: ||(got - init) - (ref - init)||_F <= rtol ||ref - init||_F (the tensor's
// relative error of the update, where single elements are ill-conditioned; test_mnist's optimizer checks say where).
static bool compare_update(const std::string& name, const float* got, const float* ref, const float* init, size_t n,
                           double rtol) {
    double err = 0, size = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)got[i] - ref[i], u = (double)ref[i] - init[i];
        err += d * d; size += u * u;
    }
    err = sqrt(err); size = sqrt(size);
    const bool ok = err <= rtol * size;  // NaN fails
    char buf[200];
    snprintf(buf, sizeof buf, "n=%zu ||err||=%.3g of the update's ||%.4g|| = %.3g of rtol %.1g (in norm)", n, err, size,
             size > 0 ? err / size / rtol : INFINITY, rtol);
    report(ok, name, buf);
    return ok;
}
static double max_abs_of(const float* x, size_t n) { double m = 0; for (size_t i = 0; i < n; i++) m = std::max(m, (double)fabs(x[i])); return m; }

// The fixture's weights: an integer hash, bit-exact with dev/mnist.py's hash_init. Returns the flat PyTorch layout.
static std::vector<float> hash_init(int init_seed, size_t n_params) {
    std::vector<float> w(n_params);
    const int fan_in[8] = {9, 9, KC2, KC2, FC_IN, FC_IN, FC_H, FC_H};
    for (int ti = 0; ti < N_PARAM_TENSORS; ti++) {
        uint32_t add = (uint32_t)(ti + 1) * 0x85EBCA77u + (uint32_t)init_seed * 0xC2B2AE3Du;
        float bound = (float)(1.0 / sqrt((double)fan_in[ti]));
        for (size_t i = 0; i < PARAMS[ti].numel; i++) {
            uint32_t x = (uint32_t)i * 0x9E3779B1u + add;
            x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
            float u = (float)(x >> 8) * (1.0f / 16777216.0f);
            w[PARAMS[ti].offset + i] = bound * (2.0f * u - 1.0f);
        }
    }
    return w;
}

static void set_params_torch(Mnist* m, const std::vector<float>& torch_flat) {
    std::vector<float> internal(m->n_params);
    for (int i = 0; i < N_PARAM_TENSORS; i++) param_from_torch(i, torch_flat.data() + PARAMS[i].offset, internal.data() + PARAMS[i].offset);
    mnist_copy_in(m, m->params, internal.data(), m->n_params);
    std::vector<float> zeros(m->n_params, 0.0f);
    mnist_copy_in(m, m->m1, zeros.data(), m->n_params);
    mnist_copy_in(m, m->m2, zeros.data(), m->n_params);
}
static std::vector<float> get_torch(const Mnist* m, const float* buf) {
    std::vector<float> internal(m->n_params), t(m->n_params);
    mnist_copy_out(m, buf, internal.data(), m->n_params);
    for (int i = 0; i < N_PARAM_TENSORS; i++) param_to_torch(i, internal.data() + PARAMS[i].offset, t.data() + PARAMS[i].offset);
    return t;
}
static void set_batch(Mnist* m, const float* x, const int* y, int B) {
    mnist_copy_in(m, m->x, x, (size_t)B * IMG * IMG);
    if (m->cpu) memcpy(m->y, y, B * sizeof(int));
    else cudaCheck(cudaMemcpy(m->y, y, B * sizeof(int), cudaMemcpyHostToDevice));
}
// forward + loss (+ backward); returns the mean loss over the batch
static double forward_loss(Mnist* m, int B, float* losses_buf, bool backward) {
    mnist_forward(m, B);
    mnist_loss(m, B, losses_buf, nullptr, nullptr, 0, true);
    if (backward) mnist_backward(m, B);
    std::vector<float> l(B);
    if (m->cpu) memcpy(l.data(), losses_buf, B * 4);
    else { cudaCheck(cudaMemcpy(l.data(), losses_buf, B * 4, cudaMemcpyDeviceToHost)); }
    double s = 0;
    for (float v : l) s += v;
    return s / B;
}

struct Reference {
    int B = 0, S = 0;
    float lr, momentum, weight_decay, adam_lr, beta1, beta2, eps, adam_wd;
    std::vector<float> params;  // PyTorch layout, flat
    std::vector<float> x; std::vector<int> y;
    std::vector<float> out; float loss;
    std::vector<std::vector<float>> grads;  // per tensor; fc1.weight: all rows (debug state) or the first 4 (fixture)
    std::vector<float> sgd_losses, adamw_losses;
};
static Reference load_reference(const char* path, bool fixture) {
    BinFile bf;
    bin_read(&bf, path, fixture ? 20260204 : 20260203, 1);
    Reference r;
    r.B = bf.header[3]; r.S = bf.header[4];
    r.lr = bin_field_f(&bf, 5); r.momentum = bin_field_f(&bf, 6); r.weight_decay = bin_field_f(&bf, 7);
    r.adam_lr = bin_field_f(&bf, 8); r.beta1 = bin_field_f(&bf, 9); r.beta2 = bin_field_f(&bf, 10); r.eps = bin_field_f(&bf, 11);
    r.adam_wd = bin_field_f(&bf, 12);
    size_t n_params = params_setup();
    if (fixture) r.params = hash_init(bf.header[13], n_params);
    else {
        r.params.resize(n_params);
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const float* p = (const float*)bin_expect(&bf, PARAMS[i].name, 0, PARAMS[i].ndim, PARAMS[i].shape);
            memcpy(r.params.data() + PARAMS[i].offset, p, PARAMS[i].numel * 4);
        }
    }
    int xs[4] = {r.B, 1, IMG, IMG}, ys[1] = {r.B}, os[2] = {r.B, NCLS}, ss[1] = {r.S};
    const float* x = (const float*)bin_expect(&bf, "x", 0, 4, xs); r.x.assign(x, x + (size_t)r.B * IMG * IMG);
    const int* y = (const int*)bin_expect(&bf, "y", 1, 1, ys); r.y.assign(y, y + r.B);
    const float* o = (const float*)bin_expect(&bf, "out", 0, 2, os); r.out.assign(o, o + r.B * NCLS);
    r.loss = *(const float*)bin_expect(&bf, "loss", 0, 0, nullptr);
    for (int i = 0; i < N_PARAM_TENSORS; i++) {
        const float* g;
        size_t n = PARAMS[i].numel;
        if (fixture && i == P_WF1) { int rs[2] = {4, FC_IN}; g = (const float*)bin_expect(&bf, "grad.fc1.weight.rows", 0, 2, rs); n = 4 * FC_IN; }
        else g = (const float*)bin_expect(&bf, (std::string("grad.") + PARAMS[i].name).c_str(), 0, PARAMS[i].ndim, PARAMS[i].shape);
        r.grads.emplace_back(g, g + n);
    }
    const float* sl = (const float*)bin_expect(&bf, "sgd_losses", 0, 1, ss); r.sgd_losses.assign(sl, sl + r.S);
    const float* al = (const float*)bin_expect(&bf, "adamw_losses", 0, 1, ss); r.adamw_losses.assign(al, al + r.S);
    return r;
}

// Runs the model on the reference's batch and weights; compares outputs, loss, every gradient, then S optimizer
// steps' losses for SGD and AdamW.
//   Tolerances (true fp32 on both sides, different summation orders):
//   out: atol 1e-5, rtol 1e-4: logits ~0.1..1 come out of sums of 288 and 9216 products; fp32 rounding of such sums
//        is ~sqrt(K)*6e-8 ~ 1e-5 relative to the sum of |terms|.
//   loss: atol 1e-6, rtol 1e-5: the mean of B log-softmax values, each accurate to a few ulp of the logits' error.
//   gradients: atol = 2e-4 * max|ref| of the tensor, rtol 1e-3: the weight gradients sum up to B*676 = 43264 products
//        of mixed sign; the absolute rounding error tracks the size of the terms (bounded by the tensor's scale), not
//        of the (possibly cancelled) result, so the absolute part is tied to the tensor's largest element.
//   step losses: SGD rtol 1e-4 (five steps amplify the gradients' rounding little); AdamW rtol 1e-3 (m/sqrt(v)
//        turns a tiny gradient's rounding into an update of up to lr, so small weights can differ by ~lr).
static void check_against(const std::string& tag, Mnist* m, const Reference& r, float* losses_buf) {
    set_params_torch(m, r.params);
    set_batch(m, r.x.data(), r.y.data(), r.B);
    double loss = forward_loss(m, r.B, losses_buf, true);
    std::vector<float> out(r.B * NCLS);
    mnist_copy_out(m, m->logits, out.data(), out.size());
    compare(tag + " out", out.data(), r.out.data(), out.size(), 1e-5, 1e-4);
    float lf = (float)loss;
    compare(tag + " loss", &lf, &r.loss, 1, 1e-6, 1e-5);
    std::vector<float> g = get_torch(m, m->grads);
    for (int i = 0; i < N_PARAM_TENSORS; i++) {
        const std::vector<float>& ref = r.grads[i];
        compare(tag + " grad." + PARAMS[i].name + (ref.size() < PARAMS[i].numel ? " (first 4 rows)" : ""),
                g.data() + PARAMS[i].offset, ref.data(), ref.size(), 2e-4 * max_abs_of(ref.data(), ref.size()), 1e-3);
    }
    for (int opt = 0; opt < 2; opt++) {
        set_params_torch(m, r.params);
        m->opt = OptConfig();
        m->opt.optimizer = opt; m->opt.schedule = SCHED_CONSTANT; m->opt.warmup_steps = 0;
        m->opt.lr = opt ? r.adam_lr : r.lr; m->opt.momentum = r.momentum; m->opt.weight_decay = opt ? r.adam_wd : r.weight_decay;
        m->opt.beta1 = r.beta1; m->opt.beta2 = r.beta2; m->opt.eps = r.eps;
        mnist_set_counters(m, 0, 0);
        std::vector<float> losses;
        for (int s = 0; s < r.S; s++) {
            losses.push_back((float)forward_loss(m, r.B, losses_buf, true));
            mnist_update(m);
            mnist_advance(m, 0);
        }
        const std::vector<float>& ref = opt ? r.adamw_losses : r.sgd_losses;
        compare(tag + (opt ? " adamw" : " sgd") + " step losses", losses.data(), ref.data(), r.S, 0.0, opt ? 1e-3 : 1e-4);
    }
}

// Checkpoint round trip and resume on the CPU: 3 steps straight == 2 steps, save, load into a fresh model, 1 step.
static void check_checkpoint_resume(const Reference& r) {
    auto make = [&](Mnist* m) {
        mnist_build(m, true, r.B, r.B);
        m->opt = OptConfig(); m->opt.optimizer = OPT_ADAMW; m->opt.schedule = SCHED_COSINE; m->opt.warmup_steps = 1;
        m->opt.total_steps = 5; m->opt.lr = 1e-3f;
    };
    std::vector<float> lbuf(r.B);
    Mnist a; make(&a);
    set_params_torch(&a, r.params); set_batch(&a, r.x.data(), r.y.data(), r.B); mnist_set_counters(&a, 0, 0);
    for (int s = 0; s < 3; s++) { forward_loss(&a, r.B, lbuf.data(), true); mnist_update(&a); mnist_advance(&a, 0); }
    Mnist b; make(&b);
    set_params_torch(&b, r.params); set_batch(&b, r.x.data(), r.y.data(), r.B); mnist_set_counters(&b, 0, 0);
    for (int s = 0; s < 2; s++) { forward_loss(&b, r.B, lbuf.data(), true); mnist_update(&b); mnist_advance(&b, 0); }
    const char* path = "dev/test_mnist_ckpt.bin";
    // a checkpoint as the trainer writes it after epoch 1 of 2 over 2 batches (the header must pass its validation)
    CheckpointMeta meta; meta.epoch = 1; meta.step = 2; meta.batch_size = r.B; meta.train_images = 2 * r.B;
    meta.epochs = 2; meta.has_optimizer = 1; meta.opt = b.opt;
    std::string err = mnist_save_checkpoint(&b, path, meta);
    if (!err.empty()) report(false, "cpu checkpoint round trip", "the save failed: " + err);
    Mnist c; make(&c);
    CheckpointMeta got = mnist_load_checkpoint(&c, path, true, OPT_ADAMW);
    set_batch(&c, r.x.data(), r.y.data(), r.B); mnist_set_counters(&c, got.step, 0);
    bool same_state = !memcmp(b.params, c.params, b.n_params * 4) && !memcmp(b.m1, c.m1, b.n_params * 4) && !memcmp(b.m2, c.m2, b.n_params * 4);
    report(same_state && got.step == 2, "cpu checkpoint round trip", "parameters, adam_m, adam_v bit-identical after save + load; step restored");
    forward_loss(&c, r.B, lbuf.data(), true); mnist_update(&c); mnist_advance(&c, 0);
    size_t diff = 0;
    for (size_t i = 0; i < a.n_params; i++) diff += a.params[i] != c.params[i];
    report(diff == 0, "cpu resume trajectory", "3 straight steps vs 2 + checkpoint + 1: " + std::to_string(diff) + " parameters differ");
    remove(path);
    mnist_free(&a); mnist_free(&b); mnist_free(&c);
}

// ---------------------------------------------------------------------------------------------------------------
// Muon and Shampoo (issue 21) against dev/mnist_optimizers.py's fixture (PyTorch: torch.optim.Muon with its
// Newton-Schulz in fp32, and plain-PyTorch Shampoo grafted on SGD and on AdamW): from hash_init weights, S steps on
// the fixture's batch, the loss before every step and the final parameters.
struct OptReference {
    int B = 0, S = 0, init_seed = 0, nesterov = 1, ns_steps = 5, precond_every = 1, precond_start = 0, max_dim = 1;
    float lr, momentum, weight_decay, adam_lr, beta1, beta2, eps, adam_wd, muon_lr, muon_momentum, p_eps, p_damping;
    float kfac_decay, kfac_damping;
    std::vector<float> x; std::vector<int> y;
    // runs 5, 6: runs 1, 3 with --precond_delay 1 (opt_run_base)
    std::vector<std::string> runs = {"muon",      "shampoo_sgd",        "shampoo_adam",   "kfac_sgd",
                                     "kfac_adam", "shampoo_sgd_delay1", "kfac_sgd_delay1"};
    std::vector<std::vector<float>> losses;                 // per run
    std::vector<std::vector<std::vector<float>>> finals;   // per run, per parameter (fc1.weight: 4 rows)
};
static OptReference load_opt_reference(const char* path) {
    BinFile bf;
    bin_read(&bf, path, 20260205, 2);
    OptReference r;
    const int32_t* h = bf.header;
    r.B = h[3]; r.S = h[4]; r.init_seed = h[5];
    r.lr = bin_field_f(&bf, 6); r.momentum = bin_field_f(&bf, 7); r.weight_decay = bin_field_f(&bf, 8);
    r.adam_lr = bin_field_f(&bf, 9); r.beta1 = bin_field_f(&bf, 10); r.beta2 = bin_field_f(&bf, 11);
    r.eps = bin_field_f(&bf, 12); r.adam_wd = bin_field_f(&bf, 13); r.muon_lr = bin_field_f(&bf, 14);
    r.muon_momentum = bin_field_f(&bf, 15); r.nesterov = h[16]; r.ns_steps = h[17]; r.precond_every = h[18];
    r.precond_start = h[19]; r.max_dim = h[20]; r.p_eps = bin_field_f(&bf, 21); r.p_damping = bin_field_f(&bf, 22);
    r.kfac_decay = bin_field_f(&bf, 23); r.kfac_damping = bin_field_f(&bf, 24);
    int xs[4] = {r.B, 1, IMG, IMG}, ys[1] = {r.B}, ss[1] = {r.S}, rows[2] = {4, FC_IN};
    const float* x = (const float*)bin_expect(&bf, "x", 0, 4, xs); r.x.assign(x, x + (size_t)r.B * IMG * IMG);
    const int* y = (const int*)bin_expect(&bf, "y", 1, 1, ys); r.y.assign(y, y + r.B);
    params_setup();
    for (const std::string& run : r.runs) {
        const float* l = (const float*)bin_expect(&bf, (run + "_losses").c_str(), 0, 1, ss);
        r.losses.emplace_back(l, l + r.S);
        r.finals.emplace_back();
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const bool fc1 = i == P_WF1;
            const std::string name = run + "." + PARAMS[i].name + (fc1 ? ".rows" : "");
            const float* p = (const float*)bin_expect(&bf, name.c_str(), 0, fc1 ? 2 : PARAMS[i].ndim,
                                                      fc1 ? rows : PARAMS[i].shape);
            r.finals.back().emplace_back(p, p + (fc1 ? 4 * FC_IN : PARAMS[i].numel));
        }
    }
    return r;
}
// The run a delayed one repeats with --precond_delay 1 (shampoo_sgd_delay1: shampoo_sgd, kfac_sgd_delay1: kfac_sgd)
static int opt_run_base(int run) { return run == 5 ? 1 : run == 6 ? 3 : run; }
static bool opt_run_adam(int run) { return opt_run_base(run) == 2 || opt_run_base(run) == 4; }
static bool opt_run_kfac(int run) { return opt_run_base(run) >= 3; }
static OptConfig opt_config_for(const OptReference& r, int run) {
    OptConfig c;
    c.precond_delay = run == opt_run_base(run) ? 0 : 1;
    run = opt_run_base(run);
    c.schedule = SCHED_CONSTANT; c.warmup_steps = 0;
    c.beta1 = r.beta1; c.beta2 = r.beta2; c.eps = r.eps; c.momentum = r.momentum;
    c.muon_lr = r.muon_lr; c.muon_momentum = r.muon_momentum; c.nesterov = r.nesterov; c.ns_steps = r.ns_steps;
    c.precond_every = r.precond_every; c.precond_start = r.precond_start; c.max_precond_dim = r.max_dim;
    c.precond_eps = r.p_eps; c.precond_damping = r.p_damping; c.kfac_stat_decay = r.kfac_decay;
    const bool sgd = run == 1 || run == 3;
    c.optimizer = run == 0 ? OPT_MUON : run <= 2 ? OPT_SHAMPOO : OPT_KFAC;
    if (c.optimizer == OPT_KFAC) c.precond_damping = r.kfac_damping;  // dev/mnist_optimizers.py says why
    c.graft = sgd ? GRAFT_SGD : GRAFT_ADAM;
    c.lr = sgd ? r.lr : r.adam_lr; c.weight_decay = sgd ? r.weight_decay : r.adam_wd;
    return c;
}
// S steps of run's optimizer from the fixture's weights and batch; the losses before each step.
static std::vector<float> run_opt_steps(Mnist* m, const OptReference& r, int run, float* lbuf) {
    m->opt = opt_config_for(r, run);
    set_params_torch(m, hash_init(r.init_seed, m->n_params));
    matrix_opt_build(m);  // fresh state
    set_batch(m, r.x.data(), r.y.data(), r.B);
    mnist_set_counters(m, 0, 0);
    std::vector<float> losses;
    for (int s = 0; s < r.S; s++) {
        losses.push_back((float)forward_loss(m, r.B, lbuf, true));
        matrix_opt_update(m, r.B, 0);
    }
    return losses;
}
// Tolerances (fp32 on both sides, other summation orders; PyTorch's roots by float64 eigh or inv, ours by float64
// Newton):
//   step losses rtol 1e-4 as SGD's (check_against): Muon's and Shampoo's updates are smooth functions of the
//        gradients (Newton-Schulz's polynomial, fixed roots times the gradient, a ratio of norms), so the
//        gradients' rounding passes through them about unamplified; Shampoo-on-AdamW rtol 1e-3 as AdamW's (its graft
//        direction is AdamW's m / sqrt(v));
//   final parameters: atol 1e-5 of the tensor's largest element + rtol 1e-4: 4 updates of at most lr each, each
//        exact to the gradients' ~1e-4 relative rounding (check_against's gradient rtol 1e-3 is per element, an
//        update's size is a norm over many elements); AdamW-grafted: atol 1e-4 of the largest element (a tiny
//        gradient's rounding turns into an update of up to lr);
//   K-FAC's final parameters in norm (compare_update, rtol 1e-4: the same relative accuracy of the update as a
//        norm): an element of its direction is ill-conditioned. A convolution's factor sums B S = 4608 rows (conv2),
//        whose fp32 rounding differs by up to K u = 2.7e-4 of an element between summation orders, and the inverse
//        multiplies a factor's relative error by up to its condition number (<= 1 + n / damping: 33 at the fixture's
//        damping 1); measured per element on conv2.weight: 1.6x its element tolerance at damping 1 (4x at 0.1); in
//        norm at most 0.25 of rtol at damping 1 (conv1.bias 1.07 at 0.1).
static void check_optimizers_cpu(const OptReference& r) {
    g_run.backend = BACKEND_CPU;
    Mnist m; mnist_build(&m, true, r.B, r.B);
    std::vector<float> lbuf(r.B);
    const std::vector<float> init = hash_init(r.init_seed, m.n_params);
    for (int run = 0; run < (int)r.runs.size(); run++) {
        const bool adam = opt_run_adam(run), kfac = opt_run_kfac(run);
        std::vector<float> losses = run_opt_steps(&m, r, run, lbuf.data());
        const std::string tag = "cpu " + r.runs[run];
        compare(tag + " step losses", losses.data(), r.losses[run].data(), r.S, 0.0, adam ? 1e-3 : 1e-4);
        std::vector<float> p = get_torch(&m, m.params);
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const std::vector<float>& ref = r.finals[run][i];
            const std::string name = tag + " final " + PARAMS[i].name + (i == P_WF1 ? " (first 4 rows)" : "");
            const float* got = p.data() + PARAMS[i].offset;
            if (kfac) compare_update(name, got, ref.data(), init.data() + PARAMS[i].offset, ref.size(), 1e-4);
            else compare(name, got, ref.data(), ref.size(), (adam ? 1e-4 : 1e-5) * max_abs_of(ref.data(), ref.size()),
                         1e-4);
        }
    }
    mnist_free(&m);
}
// GPU: the same steps on our kernel in strict fp32 (--tf32 0) against the CPU path: every parameter within the
// tolerances above (both paths compute the same functions in fp32, in other orders; the GPU's roots are fp32
// Newton, the CPU's float64), the AdamW-grafted runs' parameters in norm (compare_update, rtol 1e-4) as K-FAC's:
// the graft's own AdamW step (every block's before its first roots) divides by sqrt(v) + eps per element, so an
// element whose gradient cancels to about eps (1e-8) turns its absolute rounding into a step of up to lr (the
// derivative of g / (|g| + eps) is 1 / (4 eps) at |g| = eps). That, not the roots, is what the H100's one element
// of shampoo_adam's fc1.weight at 5.3x its element tolerance was (dev/mnist_NOTES.md: the CPU with fp32 roots moves
// that tensor by 0.13 of its tolerance; 1e-7 relative noise in fc1's inputs, by 1.2x, at one element).
static void check_optimizers_gpu(const OptReference& r) {
    std::vector<std::vector<float>> cpu_params, cpu_losses;
    const int backend = g_run.backend, tf32 = g_run.tf32;
    g_run.backend = BACKEND_CPU;
    {
        Mnist m; mnist_build(&m, true, r.B, r.B);
        std::vector<float> lbuf(r.B);
        for (int run = 0; run < (int)r.runs.size(); run++) {
            cpu_losses.push_back(run_opt_steps(&m, r, run, lbuf.data()));
            cpu_params.push_back(get_torch(&m, m.params));
        }
        mnist_free(&m);
    }
    g_run.backend = BACKEND_OURS; g_run.tf32 = 0;
    Mnist m; mnist_build(&m, false, r.B, r.B);
    float* lbuf; cudaCheck(cudaMalloc(&lbuf, r.B * 4));
    const std::vector<float> init = hash_init(r.init_seed, m.n_params);
    for (int run = 0; run < (int)r.runs.size(); run++) {
        const bool adam = opt_run_adam(run), kfac = opt_run_kfac(run);
        std::vector<float> losses = run_opt_steps(&m, r, run, lbuf);
        const std::string tag = "gpu vs cpu " + r.runs[run];
        compare(tag + " step losses", losses.data(), cpu_losses[run].data(), r.S, 0.0, adam ? 1e-3 : 1e-4);
        std::vector<float> p = get_torch(&m, m.params);
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const float* ref = cpu_params[run].data() + PARAMS[i].offset;
            const size_t n = PARAMS[i].numel;
            const float* got = p.data() + PARAMS[i].offset;
            if (kfac || adam) compare_update(tag + " final " + PARAMS[i].name, got, ref, init.data() + PARAMS[i].offset,
                                             n, 1e-4);
            else compare(tag + " final " + PARAMS[i].name, got, ref, n, 1e-5 * max_abs_of(ref, n), 1e-4);
        }
    }
    cudaCheck(cudaFree(lbuf));
    mnist_free(&m);
    g_run.backend = backend; g_run.tf32 = tf32;
}

// mo_sumsq (the matrix optimizers' sums of squares: norms, the Newton residual) on the GPU against the CPU's float64
// sum of the same fp32 terms, at awkward shapes and row strides, with and without the identity subtracted, and twice
// (the same bits: a fixed order, the last block's ticket reset). rtol 1e-5: each of the <= 128 block sums adds at
// most a few dozen positive terms per thread, then two 8-level trees, so its relative error is below 60 u = 4e-6.
static void check_sumsq_gpu() {
    Mnist m;  // m.cpu false: mo_sumsq's GPU side
    struct Case { int rows, cols, ld; bool minus_identity; };
    const Case cases[] = {{1, 1, 1, false}, {97, 1025, 1031, false}, {1024, 1024, 1024, true}, {300, 7, 9, false},
                          {289, 289, 289, true}, {10, 10, 10, true}, {128, 1024, 9217, false}};
    float *d, *out, *scratch;
    cudaCheck(cudaMalloc(&d, (size_t)1024 * 9217 * 4)); cudaCheck(cudaMalloc(&out, 8));
    cudaCheck(cudaMalloc(&scratch, (SUMSQ_MAX_BLOCKS + 1) * 4));
    cudaCheck(cudaMemset(scratch, 0, (SUMSQ_MAX_BLOCKS + 1) * 4));
    uint64_t seed = 99;
    for (const Case& c : cases) {
        std::vector<float> h((size_t)c.rows * c.ld);
        for (float& v : h) v = 2.0f * rand_uniform(&seed) - 1.0f;
        cudaCheck(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
        mo_sumsq(&m, out, d, c.rows, c.cols, c.ld, scratch, c.minus_identity);
        mo_sumsq(&m, out + 1, d, c.rows, c.cols, c.ld, scratch, c.minus_identity);
        float got[2];
        cudaCheck(cudaMemcpy(got, out, 8, cudaMemcpyDeviceToHost));
        Mnist cpu; cpu.cpu = true;
        float ref;
        mo_sumsq(&cpu, &ref, h.data(), c.rows, c.cols, c.ld, nullptr, c.minus_identity);
        const std::string name = "gpu mo_sumsq " + std::to_string(c.rows) + "x" + std::to_string(c.cols) + " ld " +
                                 std::to_string(c.ld) + (c.minus_identity ? " minus I" : "");
        compare(name, got, &ref, 1, 0.0, 1e-5);
        report(memcmp(&got[0], &got[1], 4) == 0, name + " repeats bit-identically",
               std::to_string(got[0]) + " then " + std::to_string(got[1]));
    }
    cudaCheck(cudaFree(d)); cudaCheck(cudaFree(out)); cudaCheck(cudaFree(scratch));
}

// ---------------------------------------------------------------------------------------------------------------
// Per-sample gradients (issue 21 item 4) against dev/mnist_optimizers.py's per-sample fixture (torch.func.vmap(grad)
// of each sample's loss): the per-sample norms of every parameter tensor and of the whole model, the clipped mean
// gradient at C between the two middle norms, S SGD steps on it, S SGD steps with the Fisher-diagonal preconditioner;
// then the DP noise's statistics; on the GPU the same against the CPU path.
struct PsReference {
    int B = 0, S = 0, init_seed = 0;
    float lr, momentum, weight_decay, clip, fisher_lr, beta2, p_eps, p_damping, power;
    std::vector<float> x, norms, total; std::vector<int> y;
    std::vector<std::vector<float>> clip_grad;                   // per parameter (fc1.weight: 4 rows)
    std::vector<float> losses[2]; std::vector<std::vector<float>> finals[2];  // runs clip, fisher
};
static PsReference load_ps_reference(const char* path) {
    BinFile bf;
    bin_read(&bf, path, 20260207, 1);
    PsReference r;
    const int32_t* h = bf.header;
    r.B = h[3]; r.S = h[4]; r.init_seed = h[5];
    r.lr = bin_field_f(&bf, 6); r.momentum = bin_field_f(&bf, 7); r.weight_decay = bin_field_f(&bf, 8);
    r.clip = bin_field_f(&bf, 9); r.fisher_lr = bin_field_f(&bf, 10); r.beta2 = bin_field_f(&bf, 11);
    r.p_eps = bin_field_f(&bf, 12); r.p_damping = bin_field_f(&bf, 13); r.power = bin_field_f(&bf, 14);
    int xs[4] = {r.B, 1, IMG, IMG}, ys[1] = {r.B}, ns[2] = {r.B, N_PARAM_TENSORS}, ss[1] = {r.S}, rows[2] = {4, FC_IN};
    const float* x = (const float*)bin_expect(&bf, "x", 0, 4, xs); r.x.assign(x, x + (size_t)r.B * IMG * IMG);
    const int* y = (const int*)bin_expect(&bf, "y", 1, 1, ys); r.y.assign(y, y + r.B);
    const float* nr = (const float*)bin_expect(&bf, "norms", 0, 2, ns); r.norms.assign(nr, nr + r.B * N_PARAM_TENSORS);
    const float* t = (const float*)bin_expect(&bf, "total", 0, 1, ys); r.total.assign(t, t + r.B);
    params_setup();
    auto tensors = [&](const std::string& prefix, std::vector<std::vector<float>>& out) {
        for (int i = 0; i < N_PARAM_TENSORS; i++) {
            const bool fc1 = i == P_WF1;
            const float* p = (const float*)bin_expect(&bf, (prefix + "." + PARAMS[i].name + (fc1 ? ".rows" : "")).c_str(),
                                                      0, fc1 ? 2 : PARAMS[i].ndim, fc1 ? rows : PARAMS[i].shape);
            out.emplace_back(p, p + (fc1 ? 4 * FC_IN : PARAMS[i].numel));
        }
    };
    tensors("clip_grad", r.clip_grad);
    const char* runs[2] = {"clip", "fisher"};
    for (int k = 0; k < 2; k++) {
        const float* l = (const float*)bin_expect(&bf, (std::string(runs[k]) + "_losses").c_str(), 0, 1, ss);
        r.losses[k].assign(l, l + r.S);
        tensors(runs[k], r.finals[k]);
    }
    return r;
}
static void ps_setup(Mnist* m, const PsReference& r, bool fisher, float noise = 0.0f) {
    m->opt = OptConfig();
    m->opt.schedule = SCHED_CONSTANT; m->opt.warmup_steps = 0; m->opt.momentum = r.momentum;
    m->opt.weight_decay = r.weight_decay; m->opt.lr = fisher ? r.fisher_lr : r.lr;
    if (fisher) {
        m->opt.precond = PRECOND_FISHER_DIAG; m->opt.beta2 = r.beta2; m->opt.precond_eps = r.p_eps;
        m->opt.precond_damping = r.p_damping; m->opt.fisher_power = r.power;
    } else {
        m->opt.clip = r.clip; m->opt.noise = noise;
    }
    per_sample_build(m);  // fresh buffers, a zero Fisher average
    m->ps->seed = 12345;
    set_params_torch(m, hash_init(r.init_seed, m->n_params));
    set_batch(m, r.x.data(), r.y.data(), r.B);
    mnist_set_counters(m, 0, 0);
}
// S steps of the clip (fisher = false) or Fisher run; the loss before each
static std::vector<float> ps_steps(Mnist* m, const PsReference& r, bool fisher, float* lbuf) {
    ps_setup(m, r, fisher);
    std::vector<float> losses;
    for (int s = 0; s < r.S; s++) {
        losses.push_back((float)forward_loss(m, r.B, lbuf, false));
        mnist_backward_per_sample(m, r.B);
        mnist_update(m);
        mnist_advance(m, 0);
    }
    return losses;
}
// What one backward of the clip run leaves: norms (B x 8), totals (B), the clipped gradient (PyTorch layout)
struct PsOutputs { std::vector<float> norms, total, grads; };
static PsOutputs ps_one_backward(Mnist* m, const PsReference& r, float* lbuf, float clip, float noise, int step) {
    ps_setup(m, r, false, noise);
    m->opt.clip = clip;
    mnist_set_counters(m, step, 0);
    forward_loss(m, r.B, lbuf, false);
    mnist_backward_per_sample(m, r.B);
    PsOutputs o;
    o.norms.resize((size_t)r.B * N_PARAM_TENSORS); o.total.resize(r.B);
    mnist_copy_out(m, m->ps->norms, o.norms.data(), o.norms.size());
    mnist_copy_out(m, m->ps->total, o.total.data(), o.total.size());
    o.grads = get_torch(m, m->grads);
    return o;
}
// Tolerances:
//   norms rtol 1e-5 (the issue's bound): sums of squares of fp32 values, ours from row norms and per-sample products,
//        vmap's from the materialised per-sample gradients, both sums of at most a few thousand products of terms
//        of one sign (the squares) on top of gradients each accurate to ~1e-6 relative;
//   clipped gradient as check_against's gradients (atol 2e-4 max|ref|, rtol 1e-3) and clip steps as its SGD steps
//        (losses rtol 1e-4; final parameters atol 1e-5 max|ref| + rtol 1e-4 as check_optimizers_cpu's): the scales
//        s_i are smooth functions of the norms;
//   Fisher steps as AdamW's (losses rtol 1e-3, final parameters atol 1e-4 max|ref| + rtol 1e-4): g / sqrt(F) turns
//        a tiny gradient's rounding into an update of up to lr, as m / sqrt(v) does.
static void ps_compare(const std::string& tag, const PsOutputs& o, const std::vector<float>& norms,
                       const std::vector<float>& total, const std::vector<std::vector<float>>& grads) {
    compare(tag + " per-sample norms (8 tensors x B)", o.norms.data(), norms.data(), norms.size(), 0.0, 1e-5);
    compare(tag + " per-sample whole-model norms", o.total.data(), total.data(), total.size(), 0.0, 1e-5);
    for (int i = 0; i < N_PARAM_TENSORS; i++) {
        const std::vector<float>& ref = grads[i];
        compare(tag + " clipped grad." + PARAMS[i].name + (ref.size() < PARAMS[i].numel ? " (first 4 rows)" : ""),
                o.grads.data() + PARAMS[i].offset, ref.data(), ref.size(), 2e-4 * max_abs_of(ref.data(), ref.size()),
                1e-3);
    }
}
static void ps_compare_steps(const std::string& tag, bool fisher, const std::vector<float>& losses,
                             const std::vector<float>& params, const std::vector<float>& ref_losses,
                             const std::vector<std::vector<float>>& ref_finals) {
    const std::string run = fisher ? " fisher_diag" : " clipped sgd";
    compare(tag + run + " step losses", losses.data(), ref_losses.data(), ref_losses.size(), 0.0, fisher ? 1e-3 : 1e-4);
    for (int i = 0; i < N_PARAM_TENSORS; i++) {
        const std::vector<float>& ref = ref_finals[i];
        compare(tag + run + " final " + PARAMS[i].name + (ref.size() < PARAMS[i].numel ? " (first 4 rows)" : ""),
                params.data() + PARAMS[i].offset, ref.data(), ref.size(),
                (fisher ? 1e-4 : 1e-5) * max_abs_of(ref.data(), ref.size()), 1e-4);
    }
}
// DP noise: noisy - clean gradients over every parameter are N(0, sigma^2), sigma = s C / B: the sample's std
// within 1% (its own relative error is 1/sqrt(2n) = 0.06% at n = 1.2M: 15 of those) and its mean within 5 sigma /
// sqrt(n); the same (seed, step) gives the same bits, the next step other draws.
static void ps_check_noise(const std::string& tag, Mnist* m, const PsReference& r, float* lbuf) {
    const float s = 1.3f, sigma = s * r.clip / (float)r.B;
    const PsOutputs clean = ps_one_backward(m, r, lbuf, r.clip, 0.0f, 3);
    const PsOutputs noisy = ps_one_backward(m, r, lbuf, r.clip, s, 3);
    const PsOutputs again = ps_one_backward(m, r, lbuf, r.clip, s, 3);
    const PsOutputs next = ps_one_backward(m, r, lbuf, r.clip, s, 4);
    const size_t n = clean.grads.size();
    double sum = 0, sq = 0;
    size_t same_next = 0;
    for (size_t j = 0; j < n; j++) {
        const double d = (double)noisy.grads[j] - clean.grads[j];
        sum += d; sq += d * d;
        same_next += next.grads[j] == noisy.grads[j];
    }
    const double mean = sum / n, sd = sqrt(sq / n - mean * mean);
    char buf[256];
    snprintf(buf, sizeof buf, "n=%zu std %.6g (sigma %.6g, ratio %.5f), mean %.3g (bound %.3g); next step: %zu equal",
             n, sd, sigma, sd / sigma, mean, 5 * sigma / sqrt((double)n), same_next);
    report(fabs(sd / sigma - 1) < 0.01 && fabs(mean) < 5 * sigma / sqrt((double)n) && same_next < n / 1000,
           tag + " dp noise statistics", buf);
    report(!memcmp(noisy.grads.data(), again.grads.data(), n * 4), tag + " dp noise repeatable",
           "the same seed and step give bit-identical noisy gradients");
}
static void check_per_sample_cpu(const PsReference& r) {
    g_run.backend = BACKEND_CPU;
    Mnist m; mnist_build(&m, true, r.B, r.B);
    std::vector<float> lbuf(r.B);
    ps_compare("cpu", ps_one_backward(&m, r, lbuf.data(), r.clip, 0.0f, 0), r.norms, r.total, r.clip_grad);
    // a clip norm above every sample's: the per-sample backward's gradients are the ordinary backward's
    const PsOutputs unclipped = ps_one_backward(&m, r, lbuf.data(), 1e9f, 0.0f, 0);
    m.opt = OptConfig();
    forward_loss(&m, r.B, lbuf.data(), true);
    const std::vector<float> plain = get_torch(&m, m.grads);
    compare("cpu per-sample backward without clipping == mnist_backward", unclipped.grads.data(), plain.data(),
            plain.size(), 1e-6 * max_abs_of(plain.data(), plain.size()), 1e-5);
    for (int fisher = 0; fisher < 2; fisher++) {
        std::vector<float> losses = ps_steps(&m, r, fisher, lbuf.data());
        ps_compare_steps("cpu", fisher, losses, get_torch(&m, m.params), r.losses[fisher], r.finals[fisher]);
    }
    ps_check_noise("cpu", &m, r, lbuf.data());
    mnist_free(&m);
}
// GPU (our kernel and cuBLAS, strict fp32) against the CPU path, with the tolerances above
static void check_per_sample_gpu(const PsReference& r) {
    const int backend = g_run.backend, tf32 = g_run.tf32;
    g_run.backend = BACKEND_CPU;
    PsOutputs cpu;
    std::vector<float> cpu_losses[2], cpu_params[2];
    {
        Mnist m; mnist_build(&m, true, r.B, r.B);
        std::vector<float> lbuf(r.B);
        cpu = ps_one_backward(&m, r, lbuf.data(), r.clip, 0.0f, 0);
        for (int fisher = 0; fisher < 2; fisher++) {
            cpu_losses[fisher] = ps_steps(&m, r, fisher, lbuf.data());
            cpu_params[fisher] = get_torch(&m, m.params);
        }
        mnist_free(&m);
    }
    std::vector<std::vector<float>> cpu_grads, cpu_finals[2];
    for (int i = 0; i < N_PARAM_TENSORS; i++) {
        const size_t o = PARAMS[i].offset, n = PARAMS[i].numel;
        cpu_grads.emplace_back(cpu.grads.begin() + o, cpu.grads.begin() + o + n);
        for (int k = 0; k < 2; k++) cpu_finals[k].emplace_back(cpu_params[k].begin() + o, cpu_params[k].begin() + o + n);
    }
    for (int be = BACKEND_OURS; be <= BACKEND_CUBLAS; be++) {
        g_run.backend = be; g_run.tf32 = 0;
        const std::string tag = std::string("gpu ") + (be == BACKEND_OURS ? "ours" : "cublas") + " vs cpu";
        Mnist m; mnist_build(&m, false, r.B, r.B);
        float* lbuf; cudaCheck(cudaMalloc(&lbuf, r.B * 4));
        ps_compare(tag, ps_one_backward(&m, r, lbuf, r.clip, 0.0f, 0), cpu.norms, cpu.total, cpu_grads);
        for (int fisher = 0; fisher < 2; fisher++) {
            std::vector<float> losses = ps_steps(&m, r, fisher, lbuf);
            ps_compare_steps(tag, fisher, losses, get_torch(&m, m.params), cpu_losses[fisher], cpu_finals[fisher]);
        }
        ps_check_noise(tag, &m, r, lbuf);
        cudaCheck(cudaFree(lbuf));
        mnist_free(&m);
    }
    g_run.backend = backend; g_run.tf32 = tf32;
}

// ---------------------------------------------------------------------------------------------------------------
// GPU: our kernel against a double-precision CPU oracle. Bound per element: fp32 K*2^-23*sum|a*b| (the worst-case
// rounding of a K-term fp32 sum); TF32 adds 2^-10*sum|a*b| (each input rounded to a 10-bit mantissa).
static std::vector<float> rand_vec(size_t n, uint64_t seed) {
    std::vector<float> v(n); uint64_t s = seed;
    for (auto& x : v) x = 2.0f * rand_uniform(&s) - 1.0f;
    return v;
}
static void check_kernel_case(const char* name, int akind, int bkind, int M, int N, int K, int a_rows, int a_cols, int b_rows,
                              int b_cols, bool with_epilogue, uint64_t seed) {
    for (int tf32 = 0; tf32 < 2; tf32++) {
        g_run.backend = BACKEND_OURS; g_run.tf32 = tf32;
        std::vector<float> ha = rand_vec((size_t)a_rows * a_cols, seed), hb = rand_vec((size_t)b_rows * b_cols, seed + 1);
        std::vector<float> hbias = rand_vec(N, seed + 2), hmask = rand_vec((size_t)M * N, seed + 3);
        float *da, *db, *dc, *dbias, *dmask, *drow;
        cudaCheck(cudaMalloc(&da, ha.size() * 4)); cudaCheck(cudaMalloc(&db, hb.size() * 4)); cudaCheck(cudaMalloc(&dc, (size_t)M * N * 4));
        cudaCheck(cudaMalloc(&dbias, N * 4)); cudaCheck(cudaMalloc(&dmask, (size_t)M * N * 4)); cudaCheck(cudaMalloc(&drow, M * 4));
        cudaCheck(cudaMemcpy(da, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(db, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(dbias, hbias.data(), N * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(dmask, hmask.data(), (size_t)M * N * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemset(dc, 0xFF, (size_t)M * N * 4));  // NaN poison: an unwritten element fails
        cudaCheck(cudaMemset(drow, 0xFF, M * 4));
        int lda = akind == V_ROW ? a_cols : akind == V_COL ? a_cols : 0, ldb = bkind == V_ROW ? b_cols : bkind == V_COL ? b_cols : 0;
        Epilogue ep;
        if (with_epilogue) { ep.bias = dbias; ep.relu = 1; ep.mask = dmask; }
        if (akind == V_COL) ep.rowsum = drow;
        matmul_forward(dc, N, {akind, da, lda}, {bkind, db, ldb}, M, N, K, ep);
        cudaCheck(cudaDeviceSynchronize());
        std::vector<float> got((size_t)M * N), gotrow(M), ref((size_t)M * N), tol((size_t)M * N);
        cudaCheck(cudaMemcpy(got.data(), dc, got.size() * 4, cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(gotrow.data(), drow, M * 4, cudaMemcpyDeviceToHost));
        MatView A = {akind, ha.data(), lda}, B = {bkind, hb.data(), ldb};
        std::vector<float> bm((size_t)K * N);
        for (int k = 0; k < K; k++) for (int c = 0; c < N; c++) bm[(size_t)k * N + c] = view_get_host(B, k, c);
        std::vector<double> row(N), arow(K);
        double worst = 0; size_t wi = 0; double rworst = 0;
        for (int r = 0; r < M; r++) {
            double rs = 0, rabs = 0;
            for (int k = 0; k < K; k++) { arow[k] = view_get_host(A, r, k); rs += arow[k]; rabs += fabs(arow[k]); }
            for (int c = 0; c < N; c++) {
                double s = 0, sa = 0;
                for (int k = 0; k < K; k++) { double p = arow[k] * bm[(size_t)k * N + c]; s += p; sa += fabs(p); }
                double bound = (K * ldexp(1.0, -23) + (tf32 ? ldexp(1.0, -10) : 0.0)) * sa + 1e-30;
                size_t i = (size_t)r * N + c;
                double v = s, g = got[i];
                if (with_epilogue) {
                    v += hbias[c];
                    bound += fabs(hbias[c]) * ldexp(1.0, -23);
                    if (v < 0) v = 0;
                    if (!(hmask[i] > 0)) { v = 0; bound = 0; }
                    // ReLU near zero: a value within the bound of 0 may be clipped on one side only; both are right
                    if (fabs(s + hbias[c]) <= bound && g == 0.0) v = 0;
                }
                double e = fabs(g - v) / (bound + 1e-30);
                if (!(g == g)) e = INFINITY;
                if (e > worst) { worst = e; wi = i; }
            }
            if (akind == V_COL) {
                double e = fabs(gotrow[r] - rs) / (K * ldexp(1.0, -23) * rabs + 1e-30);
                if (!(gotrow[r] == gotrow[r])) e = INFINITY;
                rworst = std::max(rworst, e);
            }
        }
        char buf[256];
        snprintf(buf, sizeof buf, "M=%d N=%d K=%d: worst error %.3g of the bound at [%zu]%s", M, N, K, worst, wi,
                 akind == V_COL ? (", rowsum " + std::to_string(rworst) + " of its bound").c_str() : "");
        report(worst <= 1.0 && rworst <= 1.0, std::string("gpu kernel ") + (tf32 ? "tf32 " : "fp32 ") + name, buf);
        cudaFree(da); cudaFree(db); cudaFree(dc); cudaFree(dbias); cudaFree(dmask); cudaFree(drow);
    }
}

// GPU: the specialised conv2 TF32 kernels (forward, weight gradient with bias, input gradient) against the double
// CPU oracle of the same GEMMs through the views, with check_kernel_case's TF32 bound, outputs poisoned with NaN.
// The gradient kernels read dact2 as the pooled gradient + window codes: both random here (codes 0..4, 4 = no
// gradient), the oracle's dact2 is their expansion. ctas > 0 caps the persistent grids so that blocks loop over
// several bands and the weight gradient adds several blocks' partial sums.
static void check_conv2_tf32(int B, int ctas, uint64_t seed) {
    Conv2Tf32 saved = g_conv2;
    if (ctas > 0) { g_conv2.fwd_ctas = g_conv2.dgrad_ctas = ctas; g_conv2.wgrad_ctas = std::min(ctas, saved.wgrad_ctas); }
    size_t n1 = (size_t)B * H1 * H1 * C1, n2 = (size_t)B * H2 * H2 * C2;
    size_t nx = (size_t)B * IMG * IMG, np = (size_t)B * FC_IN;
    std::vector<float> act1 = rand_vec(n1, seed), dpooled = rand_vec(np, seed + 1), w2 = rand_vec(C2 * KC2, seed + 2), b2 = rand_vec(C2, seed + 3);
    std::vector<float> x = rand_vec(nx, seed + 4), w1 = rand_vec(C1 * K1, seed + 5), b1 = rand_vec(C1, seed + 6);
    std::vector<uint8_t> codes_in(np);
    {
        uint64_t s = seed + 7;
        for (auto& c : codes_in) c = (uint8_t)(splitmix64(&s) % 5);
    }
    std::vector<float> dact2(n2);  // the expansion the kernels do on the fly
    for (int bb = 0; bb < B; bb++) for (int y = 0; y < H2; y++) for (int xx = 0; xx < H2; xx++) for (int c = 0; c < C2; c++) {
        size_t pi = (((size_t)bb * HP + y / 2) * HP + xx / 2) * C2 + c;
        dact2[(((size_t)bb * H2 + y) * H2 + xx) * C2 + c] = codes_in[pi] == (y % 2) * 2 + xx % 2 ? dpooled[pi] : 0.0f;
    }
    float *d_act1, *d_dpooled, *d_w2, *d_b2, *d_act2, *d_dact1, *d_dw, *d_db, *d_x, *d_w1, *d_b1, *d_pooled, *d_act1f, *d_dw1, *d_db1;
    uint8_t *d_codes_in, *d_codes_out;
    cudaCheck(cudaMalloc(&d_codes_in, np)); cudaCheck(cudaMalloc(&d_codes_out, np));
    cudaCheck(cudaMemcpy(d_codes_in, codes_in.data(), np, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemset(d_codes_out, 0xFF, np));
    cudaCheck(cudaMalloc(&d_x, nx * 4)); cudaCheck(cudaMalloc(&d_w1, C1 * K1 * 4)); cudaCheck(cudaMalloc(&d_b1, C1 * 4));
    cudaCheck(cudaMalloc(&d_pooled, np * 4)); cudaCheck(cudaMalloc(&d_act1f, n1 * 4));
    cudaCheck(cudaMalloc(&d_dw1, C1 * K1 * 4)); cudaCheck(cudaMalloc(&d_db1, C1 * 4));
    cudaCheck(cudaMemcpy(d_x, x.data(), nx * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_w1, w1.data(), C1 * K1 * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_b1, b1.data(), C1 * 4, cudaMemcpyHostToDevice));
    for (float* p : {d_pooled, d_act1f}) cudaCheck(cudaMemset(p, 0xFF, (p == d_pooled ? np : n1) * 4));
    cudaCheck(cudaMemset(d_dw1, 0xFF, C1 * K1 * 4)); cudaCheck(cudaMemset(d_db1, 0xFF, C1 * 4));
    cudaCheck(cudaMalloc(&d_act1, n1 * 4)); cudaCheck(cudaMalloc(&d_dpooled, np * 4)); cudaCheck(cudaMalloc(&d_w2, C2 * KC2 * 4));
    cudaCheck(cudaMalloc(&d_b2, C2 * 4)); cudaCheck(cudaMalloc(&d_act2, n2 * 4)); cudaCheck(cudaMalloc(&d_dact1, n1 * 4));
    cudaCheck(cudaMalloc(&d_dw, C2 * KC2 * 4)); cudaCheck(cudaMalloc(&d_db, C2 * 4));
    cudaCheck(cudaMemcpy(d_act1, act1.data(), n1 * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_dpooled, dpooled.data(), np * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_w2, w2.data(), C2 * KC2 * 4, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_b2, b2.data(), C2 * 4, cudaMemcpyHostToDevice));
    for (float* p : {d_act2, d_dact1, d_dw, d_db}) cudaCheck(cudaMemset(p, 0xFF, (p == d_act2 ? n2 : p == d_dact1 ? n1 : p == d_dw ? C2 * KC2 : C2) * 4));
    // act1's signs: the forward's of the act1 it makes (poisoned first: every word must be written), and, for the
    // input gradient, those of the random act1 above (from the host)
    uint32_t *d_sign_f, *d_sign_in;
    std::vector<uint32_t> sign_in((size_t)B * H1 * H1, 0u);
    for (size_t q = 0; q < sign_in.size(); q++)
        for (int c = 0; c < C1; c++) sign_in[q] |= (act1[q * C1 + c] > 0.0f ? 1u : 0u) << c;
    cudaCheck(cudaMalloc(&d_sign_f, sign_in.size() * 4)); cudaCheck(cudaMalloc(&d_sign_in, sign_in.size() * 4));
    cudaCheck(cudaMemset(d_sign_f, 0xAB, sign_in.size() * 4));
    cudaCheck(cudaMemcpy(d_sign_in, sign_in.data(), sign_in.size() * 4, cudaMemcpyHostToDevice));
    ConvInput in;
    in.x = d_x;
    conv2_forward_tf32(d_act2, d_pooled, d_codes_out, d_act1f, d_sign_f, in, d_w1, d_b1, d_w2, d_b2, B);  // + conv1, into act1f
    // the forward made the input gradient's weight image, which that kernel loads before its wait: in the training
    // step three kernels run in between, here the host waits
    cudaCheck(cudaDeviceSynchronize());
    SplitsJob jd = conv2_dgrad_tf32(d_dact1, d_dw1, d_db1, d_dpooled, d_codes_in, d_sign_in, d_x, B);
    conv2_wgrad_tf32(d_dw, d_db, d_dpooled, d_codes_in, d_act1, B, jd);  // + the reduction of conv1's partial sums
    cudaCheck(cudaDeviceSynchronize());
    std::vector<uint8_t> codes_out(np);
    cudaCheck(cudaMemcpy(codes_out.data(), d_codes_out, np, cudaMemcpyDeviceToHost));
    std::vector<float> act1f(n1), pooled(np), dw1(C1 * K1), db1(C1);
    cudaCheck(cudaMemcpy(act1f.data(), d_act1f, n1 * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(pooled.data(), d_pooled, np * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(dw1.data(), d_dw1, dw1.size() * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(db1.data(), d_db1, db1.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<float> act2(n2), dact1(n1), dw(C2 * KC2), db(C2);
    cudaCheck(cudaMemcpy(act2.data(), d_act2, n2 * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(dact1.data(), d_dact1, n1 * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(dw.data(), d_dw, dw.size() * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(db.data(), d_db, db.size() * 4, cudaMemcpyDeviceToHost));
    // worst |got - ref| / bound over C = A * B (+ bias, ReLU, mask); rowsum: the bias gradient (fp32 bound)
    auto worst_of = [&](const std::vector<float>& got, MatView A, MatView Bv, int M, int N, int K, const float* bias,
                        const float* mask, const std::vector<float>* rowsum, size_t* wi, double* rworst) {
        std::vector<float> bm((size_t)K * N);
        for (int k = 0; k < K; k++) for (int c = 0; c < N; c++) bm[(size_t)k * N + c] = view_get_host(Bv, k, c);
        std::vector<double> arow(K);
        double worst = 0;
        *rworst = 0;
        for (int r = 0; r < M; r++) {
            double rs = 0, rabs = 0;
            for (int k = 0; k < K; k++) { arow[k] = view_get_host(A, r, k); rs += arow[k]; rabs += fabs(arow[k]); }
            for (int c = 0; c < N; c++) {
                double sum = 0, sa = 0;
                const float* bcol = &bm[c];
                for (int k = 0; k < K; k++) { double p = arow[k] * bcol[(size_t)k * N]; sum += p; sa += fabs(p); }
                double bound = (K * ldexp(1.0, -23) + ldexp(1.0, -10)) * sa + 1e-30, v = sum;
                size_t i = (size_t)r * N + c;
                double gv = got[i];
                if (bias) {
                    v += bias[c]; bound += fabs(bias[c]) * ldexp(1.0, -23);
                    if (fabs(v) <= bound && gv == 0.0) v = 0;  // ReLU at the edge: both sides are right
                    if (v < 0) v = 0;
                }
                if (mask && !(mask[i] > 0)) { v = 0; bound = 1e-30; }
                double e = fabs(gv - v) / bound;
                if (!(gv == gv)) e = INFINITY;
                if (e > worst) { worst = e; *wi = i; }
            }
            if (rowsum) {
                double e = fabs((*rowsum)[r] - rs) / (K * ldexp(1.0, -23) * rabs + 1e-30);
                if (!((*rowsum)[r] == (*rowsum)[r])) e = INFINITY;
                *rworst = std::max(*rworst, e);
            }
        }
        return worst;
    };
    char buf[256]; size_t wi = 0; double rw = 0, w;
    std::string tag = "B=" + std::to_string(B) + (ctas > 0 ? ", " + std::to_string(ctas) + " blocks" : ", full grid");
    // the forward's conv2 runs on the act1 its conv1 made (checked below)
    w = worst_of(act2, {V_CONV2_IN, act1f.data(), 0}, {V_COL, w2.data(), KC2}, B * H2 * H2, C2, KC2, b2.data(), nullptr, nullptr, &wi, &rw);
    snprintf(buf, sizeof buf, "%s: worst error %.3g of the bound at [%zu]", tag.c_str(), w, wi);
    report(w <= 1.0, "gpu conv2 tf32 forward + bias + relu", buf);
    w = worst_of(dw, {V_COL, dact2.data(), C2}, {V_CONV2_IN, act1.data(), 0}, C2, KC2, B * H2 * H2, nullptr, nullptr, &db, &wi, &rw);
    snprintf(buf, sizeof buf, "%s: worst error %.3g of the bound at [%zu], bias gradient %.3g of its bound", tag.c_str(), w, wi, rw);
    report(w <= 1.0 && rw <= 1.0, "gpu conv2 tf32 weight + bias gradient", buf);
    w = worst_of(dact1, {V_CONV2_DOUT, dact2.data(), 0}, {V_CONV2_WT, w2.data(), 0}, B * H1 * H1, C1, 9 * C2, nullptr, act1.data(), nullptr, &wi, &rw);
    snprintf(buf, sizeof buf, "%s: worst error %.3g of the bound at [%zu]", tag.c_str(), w, wi);
    report(w <= 1.0, "gpu conv2 tf32 input gradient + relu mask", buf);
    // the pooled output must be exactly the max of the four act2 values the kernel wrote, and its window code the
    // position of the first maximum in the order (0,0), (0,1), (1,0), (1,1) when that maximum is > 0, else 4
    size_t bad = 0, first_bad = 0, bad_code = 0, first_bad_code = 0, no_grad = 0;
    for (int bb = 0; bb < B; bb++) for (int py = 0; py < HP; py++) for (int px = 0; px < HP; px++) for (int c = 0; c < C2; c++) {
        const float* base = act2.data() + (((size_t)bb * H2 + 2 * py) * H2 + 2 * px) * C2 + c;
        const float win[4] = {base[0], base[C2], base[H2 * C2], base[H2 * C2 + C2]};
        float ref = std::max(std::max(win[0], win[1]), std::max(win[2], win[3]));
        int arg = 0;
        for (int k = 1; k < 4; k++) if (win[k] > win[arg]) arg = k;
        int code = ref > 0.0f ? arg : 4;
        no_grad += code == 4;
        size_t i = (((size_t)bb * HP + py) * HP + px) * C2 + c;
        if (!(pooled[i] == ref)) { if (!bad) first_bad = i; bad++; }
        if (codes_out[i] != code) { if (!bad_code) first_bad_code = i; bad_code++; }
    }
    report(bad == 0, "gpu conv2 tf32 fused max-pool", tag + ": " + std::to_string(bad) + " of " + std::to_string(np) +
           " pooled values differ from the max of their act2 window" + (bad ? " (first at " + std::to_string(first_bad) + ")" : ""));
    report(bad_code == 0 && no_grad < np, "gpu conv2 tf32 max-pool window codes", tag + ": " + std::to_string(bad_code) + " of " +
           std::to_string(np) + " codes differ from the first maximum of their act2 window (" + std::to_string(no_grad) +
           " windows with no gradient)" + (bad_code ? " (first at " + std::to_string(first_bad_code) + ")" : ""));
    // conv1 forward (direct fp32, inside conv2's forward kernel; an unwritten element is NaN): an fp32 bound
    {
        MatView A = {V_CONV1_IN, x.data(), 0};
        double worst = 0; size_t wi1 = 0;
        for (int r = 0; r < B * H1 * H1; r++)
            for (int c = 0; c < C1; c++) {
                double sum = b1[c], sa = fabs(b1[c]);
                for (int k = 0; k < K1; k++) { double p = (double)view_get_host(A, r, k) * w1[c * K1 + k]; sum += p; sa += fabs(p); }
                double bound = 10 * ldexp(1.0, -23) * sa + 1e-30, v = sum < 0 ? 0 : sum, gv = act1f[(size_t)r * C1 + c];
                if (fabs(sum) <= bound && gv == 0.0) v = 0;
                double e = fabs(gv - v) / bound;
                if (!(gv == gv)) e = INFINITY;
                if (e > worst) { worst = e; wi1 = (size_t)r * C1 + c; }
            }
        snprintf(buf, sizeof buf, "%s: worst error %.3g of the fp32 bound at [%zu]", tag.c_str(), worst, wi1);
        report(worst <= 1.0, "gpu conv1 forward (in conv2's forward kernel) + bias + relu", buf);
        // its sign words, bit c: act1f[q][c] > 0 (exactly: the same values)
        std::vector<uint32_t> sign_f(sign_in.size());
        cudaCheck(cudaMemcpy(sign_f.data(), d_sign_f, sign_f.size() * 4, cudaMemcpyDeviceToHost));
        size_t bad = 0, first = 0;
        for (size_t q = 0; q < sign_f.size(); q++) {
            uint32_t want = 0;
            for (int c = 0; c < C1; c++) want |= (act1f[q * C1 + c] > 0.0f ? 1u : 0u) << c;
            if (sign_f[q] != want && bad++ == 0) first = q;
        }
        snprintf(buf, sizeof buf, "%s: %zu of %zu pixels' sign words differ from act1's signs%s", tag.c_str(), bad, sign_f.size(),
                 bad ? (" (first at pixel " + std::to_string(first) + ")").c_str() : "");
        report(bad == 0, "gpu act1's sign words (in conv2's forward kernel)", buf);
    }
    // conv1's weight and bias gradient, fused into the input gradient: against the oracle on the dact1 it wrote
    // (checked above), fp32 bound (these sums take no TF32 rounding)
    {
        std::vector<double> ref(C1 * 10, 0.0), sa(C1 * 10, 0.0);
        MatView X = {V_CONV1_IN, x.data(), 0};
        for (int r = 0; r < B * H1 * H1; r++)
            for (int c = 0; c < C1; c++) {
                double d = dact1[(size_t)r * C1 + c];
                if (d == 0.0) continue;
                for (int k = 0; k < 9; k++) { double p = d * view_get_host(X, r, k); ref[c * 10 + k] += p; sa[c * 10 + k] += fabs(p); }
                ref[c * 10 + 9] += d; sa[c * 10 + 9] += fabs(d);
            }
        double worst = 0; int wq = 0;
        for (int q = 0; q < C1 * 10; q++) {
            double gv = q % 10 < 9 ? dw1[(q / 10) * 9 + q % 10] : db1[q / 10];
            double e = fabs(gv - ref[q]) / ((double)B * H1 * H1 * ldexp(1.0, -23) * sa[q] + 1e-30);
            if (!(gv == gv)) e = INFINITY;
            if (e > worst) { worst = e; wq = q; }
        }
        snprintf(buf, sizeof buf, "%s: worst error %.3g of the fp32 bound at channel %d, %s", tag.c_str(), worst, wq / 10,
                 wq % 10 < 9 ? ("tap " + std::to_string(wq % 10)).c_str() : "bias");
        report(worst <= 1.0, "gpu conv1 weight + bias gradient fused in conv2's input gradient", buf);
    }
    for (float* p : {d_act1, d_dpooled, d_w2, d_b2, d_act2, d_dact1, d_dw, d_db, d_x, d_w1, d_b1, d_pooled, d_act1f, d_dw1, d_db1}) cudaFree(p);
    cudaFree(d_codes_in); cudaFree(d_codes_out); cudaFree(d_sign_f); cudaFree(d_sign_in);
    g_conv2 = saved;
}

// A random dataset of n images and labels from seed, on the host and on the GPU, with epoch perm_epoch's permutation
struct RandomDataset {
    std::vector<uint8_t> img, lab;
    std::vector<int> perm;
    DeviceData d;
    int* perm_dev = nullptr;
    RandomDataset(int n, uint64_t seed, int perm_epoch) : img((size_t)n * IMG * IMG), lab(n) {
        uint64_t s = seed;
        for (auto& v : img) v = (uint8_t)(splitmix64(&s) & 255);
        for (auto& v : lab) v = (uint8_t)(splitmix64(&s) % NCLS);
        epoch_permutation(perm, n, (int)seed, perm_epoch);
        d.n = n;
        cudaCheck(cudaMalloc(&d.images, img.size())); cudaCheck(cudaMalloc(&d.labels, n)); cudaCheck(cudaMalloc(&perm_dev, n * 4));
        cudaCheck(cudaMemcpy(d.images, img.data(), img.size(), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d.labels, lab.data(), n, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(perm_dev, perm.data(), n * 4, cudaMemcpyHostToDevice));
    }
    ~RandomDataset() { cudaFree(d.images); cudaFree(d.labels); cudaFree(perm_dev); }
};

// GPU: the training step's forward gathers its batch from the dataset's bytes itself (ConvInput: sample perm[pos + b]
// at pos = counters[1]; or pos = offset + b without perm and counters). x, y, act1, pooled, the window codes and
// fc1's partial sums must be bit-identical to gather_batch_kernel's batch put through the forward on x, every output
// poisoned with NaN (0xFF) before each run. ctas > 0: a grid of that many blocks (bands in several rounds).
static void check_gathered_forward(int B, int ctas, uint64_t seed) {
    Mnist m;
    mnist_build(&m, false, B, B);
    mnist_init_params(&m, seed);
    Conv2Tf32 saved = g_conv2;
    if (ctas > 0) g_conv2.fwd_ctas = ctas;
    const int n = 3 * B + 11, off = 2 * B + 3;
    RandomDataset ds(n, seed, 1);
    const std::vector<uint8_t>& lab = ds.lab;
    const std::vector<int>& perm = ds.perm;
    const DeviceData& d = ds.d;
    int* perm_dev = ds.perm_dev;
    const size_t nx = (size_t)B * IMG * IMG, n1 = (size_t)B * H1 * H1 * C1, np = (size_t)B * FC_IN, nh = (size_t)FC1F_PARTS * B * FC_H;
    auto run = [&](bool gathered, bool with_perm) {
        cudaCheck(cudaMemset(m.x, 0xFF, nx * 4)); cudaCheck(cudaMemset(m.y, 0xFF, B * 4));
        cudaCheck(cudaMemset(m.act1, 0xFF, n1 * 4)); cudaCheck(cudaMemset(m.pooled, 0xFF, np * 4));
        cudaCheck(cudaMemset(m.pool_codes, 0xFF, np)); cudaCheck(cudaMemset(m.hpart, 0xFF, nh * 4));
        mnist_set_counters(&m, 0, off);
        const int* pp = with_perm ? perm_dev : nullptr;
        const int* cp = with_perm ? m.counters : nullptr;
        if (gathered) {
            ConvInput in;
            in.images = d.images; in.labels = d.labels; in.perm = pp; in.counters = cp; in.offset = with_perm ? 0 : off;
            mnist_forward(&m, B, &in);
        } else {
            mnist_gather(&m, d, pp, cp, with_perm ? 0 : off, B);
            mnist_forward(&m, B);
        }
        cudaCheck(cudaDeviceSynchronize());
        std::vector<uint8_t> out(nx * 4 + B * 4 + n1 * 4 + np * 4 + np + nh * 4);
        uint8_t* o = out.data();
        cudaCheck(cudaMemcpy(o, m.x, nx * 4, cudaMemcpyDeviceToHost)); o += nx * 4;
        cudaCheck(cudaMemcpy(o, m.y, B * 4, cudaMemcpyDeviceToHost)); o += B * 4;
        cudaCheck(cudaMemcpy(o, m.act1, n1 * 4, cudaMemcpyDeviceToHost)); o += n1 * 4;
        cudaCheck(cudaMemcpy(o, m.pooled, np * 4, cudaMemcpyDeviceToHost)); o += np * 4;
        cudaCheck(cudaMemcpy(o, m.pool_codes, np, cudaMemcpyDeviceToHost)); o += np;
        cudaCheck(cudaMemcpy(o, m.hpart, nh * 4, cudaMemcpyDeviceToHost));
        return out;
    };
    for (int with_perm = 1; with_perm >= 0; with_perm--) {
        std::vector<uint8_t> ref = run(false, with_perm), got = run(true, with_perm);
        size_t nbad = 0, first = 0;
        for (size_t i = 0; i < ref.size(); i++) if (ref[i] != got[i]) { if (!nbad) first = i; nbad++; }
        // y must hold labels (a poisoned -1 would mean not written), x finite: the comparison is not NaN against NaN
        std::vector<int> y(B);
        memcpy(y.data(), ref.data() + nx * 4, B * 4);
        bool labels_ok = true;
        for (int b = 0; b < B; b++) labels_ok &= y[b] == lab[with_perm ? perm[off + b] : off + b];
        std::string tag = "B=" + std::to_string(B) + (ctas > 0 ? ", " + std::to_string(ctas) + " blocks" : ", full grid") +
                          (with_perm ? ", perm at counters[1]" : ", offset");
        report(nbad == 0 && labels_ok, "gpu forward gathers its batch (" + tag + ")",
               std::to_string(nbad) + " of " + std::to_string(ref.size()) + " bytes of x, y, act1, pooled, codes, fc1 partial sums differ" +
               (nbad ? " (first at byte " + std::to_string(first) + ")" : "") + (labels_ok ? "" : "; the gather's labels are wrong"));
    }
    g_conv2 = saved;
    // the training step's fused forward (conv2's forward kernel with fc1 and the head, two grid barriers; always its
    // full grid of FC1F_SPLITS blocks) against the three launches (forward, fc1_forward_kernel, head_kernel): x, y,
    // act1, pooled, codes, h, logits, dlogits, dh, the losses and predictions bit-identical, every output poisoned
    // first, and the fused outputs finite (a value neither path wrote would compare NaN to NaN) and codes <= 4; also the
    // input gradient's weight image (at B = 7 most of the fused grid's blocks have no band but still write their share)
    if (!mnist_fused_forward(&m, B)) {
        skip("gpu fused forward (B=" + std::to_string(B) + ")", "the fused forward is off on this GPU (sm_90 and " +
             std::to_string(FC1F_SPLITS) + " co-resident blocks needed)");
    } else {
        float* lbuf; int* pbuf;
        cudaCheck(cudaMalloc(&lbuf, n * 4)); cudaCheck(cudaMalloc(&pbuf, n * 4));
        const size_t nl = (size_t)B * NCLS, nhh = (size_t)B * FC_H;
        struct Out { const void* p; size_t bytes; bool is_float; };
        const Out outs[] = {{m.x, nx * 4, true}, {m.y, (size_t)B * 4, false}, {m.act1, n1 * 4, true}, {m.pooled, np * 4, true},
                            {m.pool_codes, np, false}, {m.h, nhh * 4, true}, {m.logits, nl * 4, true}, {m.dlogits, nl * 4, true},
                            {m.dh, nhh * 4, true}, {lbuf + off, (size_t)B * 4, true}, {pbuf + off, (size_t)B * 4, false},
                            {g_conv2.wimg_dgrad, (size_t)DG_WS * 4, false}};
        auto run_loss = [&](bool fused, bool with_perm) {
            for (const Out& o : outs) cudaCheck(cudaMemset((void*)o.p, 0xFF, o.bytes));
            mnist_set_counters(&m, 0, off);
            ConvInput in;
            in.images = d.images; in.labels = d.labels; in.perm = with_perm ? perm_dev : nullptr;
            in.counters = with_perm ? m.counters : nullptr; in.offset = with_perm ? 0 : off;
            g_run.fused_forward = fused;
            mnist_forward_loss(&m, B, &in, lbuf, pbuf, in.counters, in.offset, true);
            g_run.fused_forward = true;
            cudaCheck(cudaDeviceSynchronize());
            std::vector<std::vector<uint8_t>> r;
            for (const Out& o : outs) {
                r.emplace_back(o.bytes);
                cudaCheck(cudaMemcpy(r.back().data(), o.p, o.bytes, cudaMemcpyDeviceToHost));
            }
            return r;
        };
        for (int with_perm = 1; with_perm >= 0; with_perm--) {
            auto ref = run_loss(false, with_perm), got = run_loss(true, with_perm);
            size_t nbad = 0, total = 0, nonfinite = 0;
            for (size_t k = 0; k < ref.size(); k++) {
                total += ref[k].size();
                for (size_t i = 0; i < ref[k].size(); i++) nbad += ref[k][i] != got[k][i];
                if (outs[k].is_float)
                    for (size_t i = 0; i + 4 <= got[k].size(); i += 4) { float v; memcpy(&v, &got[k][i], 4); nonfinite += !std::isfinite(v); }
            }
            size_t bad_codes = 0;
            for (uint8_t c : got[4]) bad_codes += c > POOL_NO_GRAD;
            const float* wi = (const float*)got.back().data();  // [3][C2 / 4][3 C1][4], no pads
            for (size_t i = 0; i < (size_t)DG_WS; i++) nonfinite += !std::isfinite(wi[i]);
            std::string tag = "B=" + std::to_string(B) + (with_perm ? ", perm at counters[1]" : ", offset");
            report(nbad == 0 && nonfinite == 0 && bad_codes == 0, "gpu fused forward + loss = forward, fc1, head (" + tag + ")",
                   std::to_string(nbad) + " of " + std::to_string(total) + " bytes of x, y, act1, pooled, codes, h, logits, dlogits, "
                   "dh, losses, predictions, weight image differ; " + std::to_string(nonfinite) + " fused floats not finite, " +
                   std::to_string(bad_codes) + " codes > 4");
        }
        cudaFree(lbuf); cudaFree(pbuf);
        cudaCheck(cudaMemset(g_conv2.wimg_dgrad, 0, (size_t)DG_WS * 4));  // back to its state at allocation
    }
    mnist_free(&m);
}

// GPU: a sequence of training steps (mnist_train_steps), in which every step gathers the next one's batch in its
// weight-gradient kernel (BatchPrefetch::xb) and the next forward reads those bytes (ConvInput::staged), against the
// same steps each gathering its own batch (mnist_train_step one by one): the parameters, both optimizer buffers, the
// losses, the counters and the last step's x and y bit-identical. Two fresh models from the same seed, a random
// dataset, nsteps steps of batch B then one of tail, SGD (momentum, weight decay) or AdamW with warm-up + cosine.
// B = 64: the fused forward; B = 100: conv2's forward kernel alone, some blocks with two bands (the second band's
// staged bytes loaded in the loop).
// vs_unfused: the same sequence (staged) against itself with g_run.fused_forward = false instead, over whole training
// steps (forward, backward, optimizer): at batch <= 64 the fused forward (conv2's forward kernel with fc1 and the
// head) against its three launches (conv2's forward, fc1_forward_kernel, head_kernel): the same bits required.
static void check_staged_batches(int B, int nsteps, int tail, int opt, uint64_t seed, bool vs_unfused = false) {
    const int n = nsteps * B + tail, steps = nsteps + (tail > 0);
    RandomDataset ds(n, seed, 0);
    const std::vector<uint8_t>& img = ds.img;
    const std::vector<int>& perm = ds.perm;
    float* lbuf;
    cudaCheck(cudaMalloc(&lbuf, n * 4));
    const int last_B = tail > 0 ? tail : B;
    std::vector<float> state[2];
    std::vector<int> ctr[2];
    int staged_bad = 0;
    for (int seq = 0; seq < 2; seq++) {
        Mnist m;
        mnist_build(&m, false, B, B);
        mnist_init_params(&m, seed);
        m.opt = OptConfig(); m.opt.optimizer = opt; m.opt.schedule = SCHED_COSINE; m.opt.warmup_steps = 2;
        m.opt.total_steps = steps; m.opt.lr = opt == OPT_ADAMW ? 1e-3f : 0.05f;
        m.opt.weight_decay = opt == OPT_ADAMW ? 0.01f : 5e-4f;
        cudaCheck(cudaMemset(lbuf, 0xFF, n * 4));
        mnist_set_counters(&m, 0, 0);
        if (vs_unfused) {
            g_run.fused_forward = seq == 1;
            mnist_train_steps(&m, ds.d, ds.perm_dev, lbuf, B, nsteps, tail);
            g_run.fused_forward = true;
        } else if (seq) mnist_train_steps(&m, ds.d, ds.perm_dev, lbuf, B, nsteps, tail);
        else for (int i = 0; i < steps; i++) mnist_train_step(&m, ds.d, ds.perm_dev, lbuf, i < nsteps ? B : tail);
        cudaCheck(cudaDeviceSynchronize());
        const size_t nx = (size_t)last_B * IMG * IMG;
        state[seq].resize(3 * m.n_params + n + nx + last_B);
        float* o = state[seq].data();
        const float* bufs[3] = {m.params, m.m1, m.m2};
        for (int k = 0; k < 3; k++) mnist_copy_out(&m, bufs[k], o + k * m.n_params, m.n_params);
        o += 3 * m.n_params;
        cudaCheck(cudaMemcpy(o, lbuf, n * 4, cudaMemcpyDeviceToHost)); o += n;
        cudaCheck(cudaMemcpy(o, m.x, nx * 4, cudaMemcpyDeviceToHost)); o += nx;
        cudaCheck(cudaMemcpy(o, m.y, last_B * 4, cudaMemcpyDeviceToHost));
        ctr[seq].resize(3);
        cudaCheck(cudaMemcpy(ctr[seq].data(), m.counters, 3 * sizeof(int), cudaMemcpyDeviceToHost));
        if (seq) {  // the staging ran: the buffer holds the last batch's bytes, gathered by the step before it
            std::vector<uint8_t> xb(nx);
            cudaCheck(cudaMemcpy(xb.data(), m.xb, nx, cudaMemcpyDeviceToHost));
            for (int b = 0; b < last_B; b++) staged_bad += memcmp(xb.data() + (size_t)b * IMG * IMG, img.data() + (size_t)perm[n - last_B + b] * IMG * IMG, IMG * IMG) != 0;
        }
        mnist_free(&m);
    }
    size_t nbad = 0, nonfinite = 0;
    for (size_t i = 0; i < state[0].size(); i++) nbad += memcmp(&state[0][i], &state[1][i], 4) != 0;
    for (size_t i = 0; i + last_B < state[1].size(); i++) nonfinite += !std::isfinite(state[1][i]);  // (y: ints)
    const bool ctr_ok = ctr[0] == ctr[1] && ctr[1][0] == steps && ctr[1][1] == n && ctr[1][2] == 0;
    const std::string tag = std::string(opt == OPT_ADAMW ? "adamw" : "sgd") + ", B=" + std::to_string(B) + ", " +
                            std::to_string(nsteps) + " steps + tail " + std::to_string(tail);
    report(nbad == 0 && nonfinite == 0 && ctr_ok && staged_bad == 0,
           std::string("gpu training steps ") + (vs_unfused ? "with the fused forward = its three launches (" :
                                                               "with staged batches = one by one (") + tag + ")",
           std::to_string(nbad) + " of " + std::to_string(state[0].size()) + " words (parameters, m1, m2, losses, x, y) differ, " +
           std::to_string(nonfinite) + " floats not finite; counters " + std::to_string(ctr[1][0]) + "," +
           std::to_string(ctr[1][1]) + "," + std::to_string(ctr[1][2]) + " (" + std::to_string(steps) + "," + std::to_string(n) + ",0); " +
           std::to_string(staged_bad) + " of the last batch's " + std::to_string(last_B) + " images not in the staging buffer");
    cudaFree(lbuf);
}

// GPU: fc1 on the fast path against the double CPU oracle, outputs poisoned with NaN first.
//   forward (sm_90): fc1_forward_kernel's split-K partial sums added by head_kernel, + bias, ReLU: h, TF32 bound;
//   backward: fc1_backward_kernel's dpooled and fc1 weight gradient (TF32 bound), fc1's bias gradient and fc2's
//   weight and bias gradient (fp32 bounds: no TF32 in them);
//   fc1.weight's fused SGD step (fc1_step_share, which the input-gradient kernel's idle warp runs in a training
//   step; momentum and weight decay, at step 7 of a warm-up + cosine schedule, in 129 and in 5 shares) against
//   optimizer_kernel on the gradient fc1_backward_kernel stored: the same function of the same inputs, every rounding
//   written out: bit-identical parameters and momentum required.
// B = 70 takes two chunks of 64 batch rows (the second partial) and two row tiles in the forward.
__global__ void fc1_step_test_kernel(Fc1Step u) { if (threadIdx.x < 32) fc1_step_share(u, blockIdx.x, gridDim.x, threadIdx.x); }
static void check_fc1_fast(int B, uint64_t seed) {
    const size_t nw = (size_t)FC_H * FC_IN, npool = (size_t)B * FC_IN;
    std::vector<float> pooled = rand_vec(npool, seed), w = rand_vec(nw, seed + 1), bf1 = rand_vec(FC_H, seed + 2);
    std::vector<float> dh = rand_vec((size_t)B * FC_H, seed + 3), dlogits = rand_vec((size_t)B * NCLS, seed + 4);
    std::vector<float> h = rand_vec((size_t)B * FC_H, seed + 5), wf2 = rand_vec(NCLS * FC_H, seed + 6), bf2 = rand_vec(NCLS, seed + 7);
    std::vector<int> y(B);
    for (int b = 0; b < B; b++) y[b] = b % NCLS;
    auto up = [](const std::vector<float>& v) { float* d; cudaCheck(cudaMalloc(&d, v.size() * 4)); cudaCheck(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice)); return d; };
    auto poison = [](size_t n) { float* d; cudaCheck(cudaMalloc(&d, n * 4)); cudaCheck(cudaMemset(d, 0xFF, n * 4)); return d; };
    float *d_pooled = up(pooled), *d_w = up(w), *d_bf1 = up(bf1), *d_dh = up(dh), *d_dlogits = up(dlogits), *d_h = up(h);
    float *d_wf2 = up(wf2), *d_bf2 = up(bf2);
    int* d_y; cudaCheck(cudaMalloc(&d_y, B * 4)); cudaCheck(cudaMemcpy(d_y, y.data(), B * 4, cudaMemcpyHostToDevice));
    const std::string tag = "B=" + std::to_string(B);
    char buf[256];
    auto fin = [](double e, float g) { return g == g ? e : INFINITY; };
    if (g_run.fc1_cluster) {
        float *d_part = poison((size_t)FC1F_PARTS * B * FC_H), *d_hout = poison((size_t)B * FC_H), *d_logits = poison((size_t)B * NCLS);
        launch_pdl(fc1_forward_kernel, dim3(FC1F_SPLITS, ceil_div(B, 64)), 256, FC1F_SMEM, FC1F_CLUSTER, d_part, d_pooled, d_w, B);
        launch_pdl(head_kernel<FC1F_PARTS>, ceil_div(B, 8), 256, 0, 1, d_logits, nullptr, nullptr, nullptr, nullptr, d_hout, d_part,
                   d_bf1, d_wf2, d_bf2, d_y, nullptr, 0, B);
        cudaCheck(cudaDeviceSynchronize());
        std::vector<float> got((size_t)B * FC_H);
        cudaCheck(cudaMemcpy(got.data(), d_hout, got.size() * 4, cudaMemcpyDeviceToHost));
        double worst = 0; size_t wi = 0;
        for (int r = 0; r < B; r++)
            for (int j = 0; j < FC_H; j++) {
                double sum = 0, sa = 0;
                for (int k = 0; k < FC_IN; k++) { double p = (double)pooled[(size_t)r * FC_IN + k] * w[(size_t)j * FC_IN + k]; sum += p; sa += fabs(p); }
                double bound = (FC_IN * ldexp(1.0, -23) + ldexp(1.0, -10)) * sa + fabs(bf1[j]) * ldexp(1.0, -23) + 1e-30;
                double v = sum + bf1[j], gv = got[(size_t)r * FC_H + j];
                if (fabs(v) <= bound && gv == 0.0) v = 0;  // ReLU at the edge: both sides are right
                if (v < 0) v = 0;
                double e = fin(fabs(gv - v) / bound, (float)gv);
                if (e > worst) { worst = e; wi = (size_t)r * FC_H + j; }
            }
        snprintf(buf, sizeof buf, "%s: worst error %.3g of the bound at [%zu]", tag.c_str(), worst, wi);
        report(worst <= 1.0, "gpu fc1 forward split-K + cluster reduction + head (bias, relu)", buf);
        cudaFree(d_part); cudaFree(d_hout); cudaFree(d_logits);
    } else {
        skip("gpu fc1 forward split-K + cluster reduction + head (bias, relu)", "device below sm_90 (no clusters): fc1's forward runs on the generic kernel");
    }
    // backward, gradient stored
    float *d_dpooled = poison(npool), *d_gw = poison(nw), *d_gbf1 = poison(FC_H), *d_gwf2 = poison(NCLS * FC_H), *d_gbf2 = poison(NCLS);
    int* d_counters; cudaCheck(cudaMalloc(&d_counters, 12));
    const int counters[3] = {7, 0, 0};
    cudaCheck(cudaMemcpy(d_counters, counters, 12, cudaMemcpyHostToDevice));
    Fc1BackwardArgs a;
    a.dpooled = d_dpooled; a.wf1 = d_w; a.gwf1 = d_gw; a.gbf1 = d_gbf1; a.gwf2 = d_gwf2; a.gbf2 = d_gbf2;
    a.dh = d_dh; a.pooled = d_pooled; a.dlogits = d_dlogits; a.h = d_h; a.counters = d_counters; a.B = B;
    fc1_backward(a);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> gdp(npool), ggw(nw), ggb1(FC_H), ggw2(NCLS * FC_H), ggb2(NCLS);
    cudaCheck(cudaMemcpy(gdp.data(), d_dpooled, npool * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(ggw.data(), d_gw, nw * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(ggb1.data(), d_gbf1, FC_H * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(ggw2.data(), d_gwf2, NCLS * FC_H * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(ggb2.data(), d_gbf2, NCLS * 4, cudaMemcpyDeviceToHost));
    {
        double worst = 0; size_t wi = 0;
        std::vector<double> acc(FC_IN), sa(FC_IN);
        for (int r = 0; r < B; r++) {
            std::fill(acc.begin(), acc.end(), 0.0); std::fill(sa.begin(), sa.end(), 0.0);
            for (int j = 0; j < FC_H; j++) {
                double d = dh[(size_t)r * FC_H + j];
                const float* wr = &w[(size_t)j * FC_IN];
                for (int c = 0; c < FC_IN; c++) { double p = d * wr[c]; acc[c] += p; sa[c] += fabs(p); }
            }
            for (int c = 0; c < FC_IN; c++) {
                double bound = (FC_H * ldexp(1.0, -23) + ldexp(1.0, -10)) * sa[c] + 1e-30, gv = gdp[(size_t)r * FC_IN + c];
                double e = fin(fabs(gv - acc[c]) / bound, (float)gv);
                if (e > worst) { worst = e; wi = (size_t)r * FC_IN + c; }
            }
        }
        snprintf(buf, sizeof buf, "%s: worst error %.3g of the bound at [%zu]", tag.c_str(), worst, wi);
        report(worst <= 1.0, "gpu fc1 backward input gradient (dpooled)", buf);
    }
    {
        double worst = 0; size_t wi = 0;
        std::vector<double> acc(FC_IN), sa(FC_IN);
        for (int j = 0; j < FC_H; j++) {
            std::fill(acc.begin(), acc.end(), 0.0); std::fill(sa.begin(), sa.end(), 0.0);
            for (int r = 0; r < B; r++) {
                double d = dh[(size_t)r * FC_H + j];
                const float* pr = &pooled[(size_t)r * FC_IN];
                for (int c = 0; c < FC_IN; c++) { double p = d * pr[c]; acc[c] += p; sa[c] += fabs(p); }
            }
            for (int c = 0; c < FC_IN; c++) {
                double bound = (B * ldexp(1.0, -23) + ldexp(1.0, -10)) * sa[c] + 1e-30, gv = ggw[(size_t)j * FC_IN + c];
                double e = fin(fabs(gv - acc[c]) / bound, (float)gv);
                if (e > worst) { worst = e; wi = (size_t)j * FC_IN + c; }
            }
        }
        snprintf(buf, sizeof buf, "%s: worst error %.3g of the bound at [%zu]", tag.c_str(), worst, wi);
        report(worst <= 1.0, "gpu fc1 backward weight gradient", buf);
    }
    {
        // fp32 sums over the batch: |err| <= B * 2^-23 * sum |terms|
        double worst = 0; std::string where;
        for (int j = 0; j < FC_H; j++) {
            double s = 0, sa = 0;
            for (int r = 0; r < B; r++) { s += dh[(size_t)r * FC_H + j]; sa += fabs(dh[(size_t)r * FC_H + j]); }
            double e = fin(fabs(ggb1[j] - s) / (B * ldexp(1.0, -23) * sa + 1e-30), ggb1[j]);
            if (e > worst) { worst = e; where = "fc1.bias[" + std::to_string(j) + "]"; }
        }
        for (int j = 0; j < NCLS; j++) {
            double sb = 0, sba = 0;
            for (int r = 0; r < B; r++) { sb += dlogits[(size_t)r * NCLS + j]; sba += fabs(dlogits[(size_t)r * NCLS + j]); }
            double e = fin(fabs(ggb2[j] - sb) / (B * ldexp(1.0, -23) * sba + 1e-30), ggb2[j]);
            if (e > worst) { worst = e; where = "fc2.bias[" + std::to_string(j) + "]"; }
            for (int k = 0; k < FC_H; k++) {
                double s = 0, sa = 0;
                for (int r = 0; r < B; r++) { double p = (double)dlogits[(size_t)r * NCLS + j] * h[(size_t)r * FC_H + k]; s += p; sa += fabs(p); }
                double e2 = fin(fabs(ggw2[j * FC_H + k] - s) / (B * ldexp(1.0, -23) * sa + 1e-30), ggw2[j * FC_H + k]);
                if (e2 > worst) { worst = e2; where = "fc2.weight[" + std::to_string(j * FC_H + k) + "]"; }
            }
        }
        snprintf(buf, sizeof buf, "%s: worst error %.3g of the fp32 bound at %s", tag.c_str(), worst, where.c_str());
        report(worst <= 1.0, "gpu fc1 backward bias gradient, fc2 weight + bias gradient", buf);
    }
    // the fused SGD step against optimizer_kernel on the stored gradient
    for (int shares : {129, 5}) {
        OptConfig c;
        c.optimizer = OPT_SGD; c.schedule = SCHED_COSINE; c.warmup_steps = 3; c.total_steps = 20; c.lr = 0.05f; c.weight_decay = 5e-4f;
        std::vector<float> m1 = rand_vec(nw, seed + 10);
        float *wa = up(w), *m1a = up(m1), *wb = up(w), *m1b = up(m1);
        Fc1Step u;
        u.p = wa; u.g = d_gw; u.m1 = m1a; u.counters = d_counters; u.c = c;
        launch_pdl(fc1_step_test_kernel, shares, 64, 0, 1, u);
        launch_pdl(optimizer_kernel, (unsigned)((nw / 4 + 256) / 256), 256, 0, 1, wb, (const float*)d_gw, m1b, (float*)nullptr, nw, c,
                   d_counters, -1);
        cudaCheck(cudaDeviceSynchronize());
        std::vector<float> pa(nw), pb(nw), ma(nw), mb(nw);
        cudaCheck(cudaMemcpy(pa.data(), wa, nw * 4, cudaMemcpyDeviceToHost)); cudaCheck(cudaMemcpy(pb.data(), wb, nw * 4, cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(ma.data(), m1a, nw * 4, cudaMemcpyDeviceToHost)); cudaCheck(cudaMemcpy(mb.data(), m1b, nw * 4, cudaMemcpyDeviceToHost));
        size_t diff = 0, moved = 0; double maxd = 0;
        for (size_t i = 0; i < nw; i++) {
            diff += memcmp(&pa[i], &pb[i], 4) || memcmp(&ma[i], &mb[i], 4);
            moved += pa[i] != w[i];
            maxd = std::max(maxd, (double)fabs(pa[i] - pb[i]));
        }
        snprintf(buf, sizeof buf, "%s, %d shares: %zu of %zu elements differ from optimizer_kernel's (max |dp| %.3g); %zu weights moved",
                 tag.c_str(), shares, diff, nw, maxd, moved);
        report(diff == 0 && moved > nw / 2, "gpu fc1 fused sgd step of fc1.weight (bit-identical)", buf);
        for (float* p : {wa, m1a, wb, m1b}) cudaFree(p);
    }
    for (float* p : {d_pooled, d_w, d_bf1, d_dh, d_dlogits, d_h, d_wf2, d_bf2, d_dpooled, d_gw, d_gbf1, d_gwf2, d_gbf2}) cudaFree(p);
    cudaFree(d_y); cudaFree(d_counters);
}

// The grid barriers' watchdog (grid_barrier_wait): one block waits on a barrier that never opens. Run in a child process
// (`test_mnist --watchdog_probe`), since the trap ends its CUDA context: cuda_check must name the barrier and exit
// non-zero; falling through is a failure of its own (exit 3).
__global__ void watchdog_probe_kernel(unsigned long long* bar) { grid_barrier_wait(bar, 1, 2); }
static int watchdog_probe() {
    run_config_decide(BACKEND_OURS, 1, 1);  // the launch configuration the workspaces are sized for
    conv2_tf32_setup();                     // maps the watchdog's host word
    cudaCheck(cudaMemset(g_conv2.wgrad_bar, 0, sizeof(unsigned long long)));
    watchdog_probe_kernel<<<1, 32>>>(g_conv2.wgrad_bar);
    cudaCheck(cudaGetLastError());
    cudaCheck(cudaDeviceSynchronize());
    printf("watchdog probe: the barrier's wait returned without its arrivals\n");
    return 3;
}
static void check_watchdog() {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) { report(false, "gpu grid barrier watchdog", "cannot read /proc/self/exe"); return; }
    self[n] = 0;
    std::string cmd = "'" + std::string(self) + "' --watchdog_probe 2>&1";
    auto t0 = std::chrono::steady_clock::now();
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) { report(false, "gpu grid barrier watchdog", "popen failed"); return; }
    std::string out;
    char buf[512];
    while (fgets(buf, sizeof buf, p)) out += buf;
    int st = pclose(p);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bool exited = st != -1 && WIFEXITED(st);
    int rc = exited ? WEXITSTATUS(st) : -1;
    bool named = out.find("conv2_wgrad_tf32_kernel: grid barrier not reached by all blocks after 2 s") != std::string::npos;
    std::string last = out;
    while (!last.empty() && last.back() == '\n') last.pop_back();
    if (last.rfind('\n') != std::string::npos) last = last.substr(last.rfind('\n') + 1);
    char d[160];
    snprintf(d, sizeof d, "child exit %d after %.1f s; ", rc, secs);
    report(exited && rc == EXIT_FAILURE && named && secs >= 2.0, "gpu grid barrier watchdog (a barrier that never opens)",
           d + (named ? "message: " + last : "no barrier named in: " + out.substr(0, 300)));
}

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    if (argc == 2 && !strcmp(argv[1], "--watchdog_probe")) return watchdog_probe();
    if (argc > 1) { fprintf(stderr, "usage: %s (no arguments; --watchdog_probe is the watchdog test's child)\n", argv[0]); return 2; }
    run_config_decide(BACKEND_CPU, 1, std::max(1u, std::thread::hardware_concurrency()));
    const char* fixture_path = "dev/fixtures/mnist_fixture.bin";
    const char* debug_path = "dev/mnist_debug_state.bin";
    FILE* ff = fopen(fixture_path, "rb");
    Reference fx;
    bool have_fixture = ff != nullptr;
    if (ff) fclose(ff);
    if (have_fixture) {
        fx = load_reference(fixture_path, true);
        g_run.backend = BACKEND_CPU;
        Mnist m; mnist_build(&m, true, fx.B, fx.B);
        std::vector<float> lbuf(fx.B);
        check_against("cpu fixture", &m, fx, lbuf.data());
        mnist_free(&m);
        check_checkpoint_resume(fx);
    } else {
        report(false, "cpu fixture", std::string(fixture_path) + " is missing (python3 dev/mnist.py writes it; it is committed)");
    }

    const char* opt_fixture_path = "dev/fixtures/mnist_optimizers_fixture.bin";
    FILE* of = fopen(opt_fixture_path, "rb");
    const bool have_opt_fixture = of != nullptr;
    if (of) fclose(of);
    OptReference ofx;
    if (have_opt_fixture) {
        ofx = load_opt_reference(opt_fixture_path);
        check_optimizers_cpu(ofx);
    } else {
        report(false, "cpu muon / shampoo", std::string(opt_fixture_path) + " is missing (python3 dev/mnist_optimizers.py "
               "writes it; it is committed)");
    }

    const char* ps_fixture_path = "dev/fixtures/mnist_per_sample_fixture.bin";
    FILE* pf = fopen(ps_fixture_path, "rb");
    const bool have_ps_fixture = pf != nullptr;
    if (pf) fclose(pf);
    PsReference psx;
    if (have_ps_fixture) {
        psx = load_ps_reference(ps_fixture_path);
        check_per_sample_cpu(psx);
    } else {
        report(false, "cpu per-sample gradients", std::string(ps_fixture_path) + " is missing (python3 "
               "dev/mnist_optimizers.py writes it; it is committed)");
    }

    int ndev = 0;
    cudaError_t derr = cudaGetDeviceCount(&ndev);
    if (derr != cudaSuccess) { (void)cudaGetLastError(); ndev = 0; }
    if (ndev == 0) {
        std::string why = std::string("no CUDA device (") + cudaGetErrorString(derr) + ")";
        for (const char* n : {"gpu kernel", "gpu fixture ours", "gpu fixture cublas", "gpu debug state ours", "gpu debug state cublas",
                              "gpu vs cpu muon / shampoo / kfac", "gpu vs cpu per-sample gradients"}) skip(n, why);
    } else {
        run_config_decide(BACKEND_OURS, g_run.tf32, g_run.cpu_threads);  // (and what the GPU supports)
        cudaCheck(cudaStreamCreate(&g_mm.stream));  // programmatic dependent launch needs a stream of our own
        Mnist ws; mnist_build(&ws, false, 4, 4);  // allocates the split-K workspace the kernel checks use
        // every operand kind the network uses, at awkward sizes (not tile multiples); conv kinds at batch 3
        check_kernel_case("row x row 97x1025x257 + bias/relu/mask", V_ROW, V_ROW, 97, 1025, 257, 97, 257, 257, 1025, true, 11);
        check_kernel_case("row x col 131x67x333", V_ROW, V_COL, 131, 67, 333, 131, 333, 67, 333, false, 12);
        check_kernel_case("col x row 37x45x5000 split-K + rowsum", V_COL, V_ROW, 37, 45, 5000, 5000, 37, 5000, 45, false, 13);
        check_kernel_case("col x col 70x33x129", V_COL, V_COL, 70, 33, 129, 129, 70, 33, 129, false, 14);
        check_kernel_case("conv1 implicit x col (B=3)", V_CONV1_IN, V_COL, 3 * H1 * H1, C1, K1, 3, IMG * IMG, C1, K1, true, 15);
        check_kernel_case("conv2 implicit x col (B=3)", V_CONV2_IN, V_COL, 3 * H2 * H2, C2, KC2, 3, H1 * H1 * C1, C2, KC2, true, 16);
        check_kernel_case("col x conv2 implicit dW (B=3)", V_COL, V_CONV2_IN, C2, KC2, 3 * H2 * H2, 3 * H2 * H2, C2, 3, H1 * H1 * C1, false, 17);
        check_kernel_case("col x conv1 implicit dW (B=3)", V_COL, V_CONV1_IN, C1, K1, 3 * H1 * H1, 3 * H1 * H1, C1, 3, IMG * IMG, false, 18);
        check_kernel_case("conv2 dX implicit x weight (B=3)", V_CONV2_DOUT, V_CONV2_WT, 3 * H1 * H1, C1, 9 * C2, 3, H2 * H2 * C2, C2, KC2, true, 19);

        check_conv2_tf32(3, 0, 21);
        check_conv2_tf32(5, 4, 22);
        check_gathered_forward(64, 0, 23);
        check_gathered_forward(7, 5, 24);
        check_staged_batches(64, 4, 21, OPT_SGD, 25);
        check_staged_batches(64, 3, 0, OPT_ADAMW, 26);
        check_staged_batches(100, 2, 37, OPT_SGD, 27);
        if (g_run.fc1_cluster && g_run.fused_forward_fits) {  // (run_config_decide)
            check_staged_batches(64, 3, 21, OPT_SGD, 28, true);
            check_staged_batches(64, 2, 0, OPT_ADAMW, 29, true);
            check_staged_batches(40, 2, 0, OPT_SGD, 30, true);
        } else {
            skip("gpu training steps with the fused forward", "the fused forward is off on this GPU");
        }
        check_sumsq_gpu();
        if (have_opt_fixture) check_optimizers_gpu(ofx);
        if (have_ps_fixture) check_per_sample_gpu(psx);
        check_fc1_fast(5, 31);
        check_fc1_fast(70, 32);
        check_watchdog();
        {   // the optimizer's fused counter advance (the last of its ~4700 blocks advances the counters)
            Mnist mc; mnist_build(&mc, false, 4, 4);
            mnist_set_counters(&mc, 0, 0);
            for (int i = 0; i < 3; i++) mnist_update(&mc, 5);
            mnist_update(&mc, 7);
            int c[3];
            cudaCheck(cudaMemcpy(c, mc.counters, sizeof c, cudaMemcpyDeviceToHost));
            report(c[0] == 4 && c[1] == 22 && c[2] == 0, "gpu optimizer advances the counters",
                   "after 3 updates with B=5 and 1 with B=7: step " + std::to_string(c[0]) + " (4), offset " + std::to_string(c[1]) +
                   " (22), ticket " + std::to_string(c[2]) + " (0)");
            mnist_free(&mc);
        }

        mnist_free(&ws);
        bool have_debug = false;
        FILE* df = fopen(debug_path, "rb");
        if (!df) {  // a GPU machine has torch: write the debug state (skipped below when that fails, e.g. no torch)
            printf("(%s missing: running python3 dev/mnist.py --fixture \"\")\n", debug_path);
            int rc = system("python3 dev/mnist.py --fixture \"\" > /dev/null 2>&1");
            (void)rc;
            df = fopen(debug_path, "rb");
        }
        if (df) { fclose(df); have_debug = true; }
        Reference dbg;
        if (have_debug) dbg = load_reference(debug_path, false);
        std::vector<float> cublas_tf32_grads;  // the gradients of cuBLAS TF32 on the debug state: the TF32 error scale
        if (have_debug) {
            g_run.backend = BACKEND_CUBLAS; g_run.tf32 = 1;
            Mnist mc; mnist_build(&mc, false, dbg.B, dbg.B);
            float* lb; cudaCheck(cudaMalloc(&lb, dbg.B * 4));
            set_params_torch(&mc, dbg.params); set_batch(&mc, dbg.x.data(), dbg.y.data(), dbg.B);
            forward_loss(&mc, dbg.B, lb, true);
            cublas_tf32_grads = get_torch(&mc, mc.grads);
            cudaFree(lb); mnist_free(&mc);
            g_run.tf32 = 0;
        }
        for (int backend = BACKEND_OURS; backend <= BACKEND_CUBLAS; backend++) {
            g_run.backend = backend; g_run.tf32 = 0;  // true fp32, as the reference
            const char* bn = backend == BACKEND_OURS ? "ours" : "cublas";
            int Bmax = std::max(fx.B, have_debug ? dbg.B : 1);
            Mnist m; mnist_build(&m, false, Bmax, Bmax);
            float* lbuf; cudaCheck(cudaMalloc(&lbuf, Bmax * 4));
            if (have_fixture) check_against(std::string("gpu fixture ") + bn, &m, fx, lbuf);
            else skip(std::string("gpu fixture ") + bn, "fixture missing");
            if (have_debug) check_against(std::string("gpu debug state ") + bn, &m, dbg, lbuf);
            else skip(std::string("gpu debug state ") + bn, std::string(debug_path) + " missing and python3 dev/mnist.py could not write it (no torch?)");
            if (have_debug && backend == BACKEND_OURS) {
                // TF32 (the training default): loss only, with TF32's 2^-11 input rounding as the tolerance scale
                g_run.tf32 = 1;
                set_params_torch(&m, dbg.params); set_batch(&m, dbg.x.data(), dbg.y.data(), dbg.B);
                float l = (float)forward_loss(&m, dbg.B, lbuf, false);
                compare("gpu debug state ours tf32 loss", &l, &dbg.loss, 1, 0.0, 2e-3);
                // and every gradient (conv on the specialised TF32 kernels) against the fp32 reference, with a bound
                // tied to cuBLAS's own error at the same precision (cuBLAS TF32 on the same work, measured above):
                // atol = 4 x cuBLAS TF32's largest error on the tensor + 1e-3 of its largest element. TF32 rounds
                // inputs to 2^-11 and the small conv1/bias gradients are sums of ~40000 terms with heavy
                // cancellation, so the absolute error is what both share; an indexing error is O(max|ref|)
                mnist_backward(&m, dbg.B);
                std::vector<float> g = get_torch(&m, m.grads);
                for (int i = 0; i < N_PARAM_TENSORS; i++) {
                    const float* ref = dbg.grads[i].data();
                    size_t n = dbg.grads[i].size();
                    double cub_err = 0;
                    for (size_t j = 0; j < n; j++) cub_err = std::max(cub_err, (double)fabs(cublas_tf32_grads[PARAMS[i].offset + j] - ref[j]));
                    compare(std::string("gpu debug state ours tf32 grad.") + PARAMS[i].name + " (cuBLAS TF32 max|err| " +
                            std::to_string(cub_err) + ")", g.data() + PARAMS[i].offset, ref, n, 4 * cub_err + 1e-3 * max_abs_of(ref, n), 0.0);
                }
                // the training step's fusions (fc1.weight's optimizer step in the input-gradient kernel, every other
                // parameter's in the weight-gradient kernel's split reduction, the step counter advanced there and the
                // batch position in fc1's backward) against the unfused sequence
                // (gradients stored, optimizer_kernel, advance_counters_kernel), one step from the debug state (a
                // second step would carry the first one's rounding differences into the gradients): SGD and AdamW
                // bit-identical (opt_update_elem writes every rounding out), and the counters advanced by both to
                // (1, 3, 0)
                for (int opt = 0; opt < 2; opt++) {
                    std::vector<float> st[2][3];
                    int ctr[2][3];
                    for (int fused = 0; fused < 2; fused++) {
                        set_params_torch(&m, dbg.params); set_batch(&m, dbg.x.data(), dbg.y.data(), dbg.B);
                        m.opt = OptConfig(); m.opt.optimizer = opt; m.opt.schedule = SCHED_COSINE; m.opt.warmup_steps = 2;
                        m.opt.total_steps = 6; m.opt.lr = opt ? 1e-3f : 0.05f; m.opt.weight_decay = opt ? 0.01f : 5e-4f;
                        mnist_set_counters(&m, 0, 0);
                        forward_loss(&m, dbg.B, lbuf, false);
                        if (fused) mnist_backward(&m, dbg.B, 3);
                        else {
                            mnist_backward(&m, dbg.B);
                            mnist_update(&m); mnist_advance(&m, 3);
                        }
                        const float* bufs[3] = {m.params, m.m1, m.m2};
                        for (int k = 0; k < 3; k++) { st[fused][k].resize(m.n_params); mnist_copy_out(&m, bufs[k], st[fused][k].data(), m.n_params); }
                        cudaCheck(cudaMemcpy(ctr[fused], m.counters, sizeof ctr[fused], cudaMemcpyDeviceToHost));
                    }
                    bool ctr_ok = ctr[1][0] == 1 && ctr[1][1] == 3 && ctr[1][2] == 0 && !memcmp(ctr[0], ctr[1], sizeof ctr[0]);
                    std::string cs = "; counters " + std::to_string(ctr[1][0]) + "," + std::to_string(ctr[1][1]) + "," +
                                     std::to_string(ctr[1][2]) + " (1,3,0)";
                    size_t diff = 0, nd = 0;
                    for (int k = 0; k < 3; k++) diff += memcmp(st[0][k].data(), st[1][k].data(), m.n_params * 4) != 0;
                    for (size_t i = 0; i < m.n_params; i++) nd += memcmp(&st[0][0][i], &st[1][0][i], 4) != 0;
                    report(diff == 0 && ctr_ok, std::string("gpu debug state ours tf32 fused training step (") +
                           (opt == OPT_ADAMW ? "adamw" : "sgd") + ", bit-identical)",
                           std::to_string(nd) + " of " + std::to_string(m.n_params) + " parameters differ from the unfused step" +
                           (diff ? " (or the optimizer state does)" : ", optimizer state identical") + cs);
                }
                g_run.tf32 = 0;
            }
            cudaFree(lbuf);
            mnist_free(&m);
        }
    }
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
