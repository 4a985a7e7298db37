/*
dev/timestep_embedding.cu: the UNet's timestep embedding as train_unet.cu runs it: the sinusoidal embedding
(timestep_embedding_kernel: emb[b] = cat[cos(t_b f), sin(t_b f)], f_k = exp(-ln(10000) k / half), a zero column
when the width is odd) and the time_embed MLP (Linear(C, 4C), SiLU, Linear(4C, 4C)), forward and backward (the
embedding of an integer t has no gradient), checked against a CPU oracle and a PyTorch fixture.

  make -C dev timestep_embedding && ./dev/timestep_embedding --test   # CPU oracle vs PyTorch (CI); GPU vs both

version 1 (train_unet.cu, the only one): one thread per embedding element; the MLP through linear_forward /
linear_backward (cuBLAS, strict fp32 here) and silu_kernel / silu_backward_kernel, as unet_forward / unet_backward.
*/
#define TESTING
#include "../train_unet.cu"
#include "unet_layers.cuh"

// CPU oracle: the frequencies and the argument t*f rounded to float32 as PyTorch computes them (the argument of a
// t near 1000 carries ~6e-5 of rounding that cos/sin pass on, so double there would not be the model), cos and
// sin in double.
static std::vector<float> cpu_embedding(const std::vector<int>& t, int dim) {
    int half = dim / 2;
    std::vector<float> emb(t.size() * dim, 0.f);
    for (size_t b = 0; b < t.size(); b++)
        for (int k = 0; k < half; k++) {
            float f = expf((-9.210340371976184f * (float)k) / (float)half);
            float arg = (float)t[b] * f;
            emb[b * dim + k] = (float)cos((double)arg);
            emb[b * dim + half + k] = (float)sin((double)arg);
        }
    return emb;
}
struct MlpW {
    std::vector<float> w0, b0, w2, b2;  // (E, C), (E), (E, E), (E)
};
struct MlpOut {
    std::vector<float> y, demb, dw0, db0, dw2, db2;
};
// y = W2 silu(W0 emb + b0) + b2 and the gradients of sum(y * dy), in double
static MlpOut cpu_mlp(const std::vector<float>& emb, const MlpW& w, const std::vector<float>& dy, int B, int C, int E) {
    std::vector<double> h((size_t)B * E), a((size_t)B * E), dh((size_t)B * E);
    MlpOut o;
    o.y.assign((size_t)B * E, 0.f);
    o.demb.assign((size_t)B * C, 0.f);
    std::vector<double> dw0((size_t)E * C, 0), db0(E, 0), dw2((size_t)E * E, 0), db2(E, 0);
    for (int b = 0; b < B; b++) {
        for (int e = 0; e < E; e++) {
            double acc = w.b0[e];
            for (int c = 0; c < C; c++) acc += (double)emb[(size_t)b * C + c] * w.w0[(size_t)e * C + c];
            h[(size_t)b * E + e] = acc;
            a[(size_t)b * E + e] = acc / (1.0 + exp(-acc));
        }
        for (int e = 0; e < E; e++) {
            double acc = w.b2[e];
            for (int j = 0; j < E; j++) acc += a[(size_t)b * E + j] * w.w2[(size_t)e * E + j];
            o.y[(size_t)b * E + e] = (float)acc;
        }
        for (int j = 0; j < E; j++) {
            double da = 0;
            for (int e = 0; e < E; e++) {
                double g = dy[(size_t)b * E + e];
                da += g * w.w2[(size_t)e * E + j];
                dw2[(size_t)e * E + j] += g * a[(size_t)b * E + j];
            }
            double x = h[(size_t)b * E + j], s = 1.0 / (1.0 + exp(-x));
            dh[(size_t)b * E + j] = da * s * (1.0 + x * (1.0 - s));
        }
        for (int e = 0; e < E; e++) {
            db2[e] += dy[(size_t)b * E + e];
            db0[e] += dh[(size_t)b * E + e];
            for (int c = 0; c < C; c++) dw0[(size_t)e * C + c] += dh[(size_t)b * E + e] * emb[(size_t)b * C + c];
        }
        for (int c = 0; c < C; c++) {
            double acc = 0;
            for (int e = 0; e < E; e++) acc += dh[(size_t)b * E + e] * w.w0[(size_t)e * C + c];
            o.demb[(size_t)b * C + c] = (float)acc;
        }
    }
    auto cast = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    o.dw0 = cast(dw0); o.db0 = cast(db0); o.dw2 = cast(dw2); o.db2 = cast(db2);
    return o;
}

// train_unet.cu's kernels: the embedding of t, and the MLP on a given emb (forward, then backward as unet_backward
// with dx of the first linear requested), outputs poisoned first
static std::vector<float> gpu_embedding(const std::vector<int>& t, int dim) {
    int B = (int)t.size();
    int* d_t;
    cudaCheck(cudaMalloc(&d_t, B * sizeof(int)));
    cudaCheck(cudaMemcpy(d_t, t.data(), B * sizeof(int), cudaMemcpyHostToDevice));
    float* d_e = dev_alloc((size_t)B * dim);
    poison(d_e, (size_t)B * dim);
    timestep_embedding_kernel<<<ceil_div(B * dim, EW), EW>>>(d_t, d_e, B, dim);
    cudaCheck(cudaGetLastError());
    std::vector<float> e = to_host(d_e, (size_t)B * dim);
    cudaCheck(cudaFree(d_t));
    cudaCheck(cudaFree(d_e));
    return e;
}
static MlpOut gpu_mlp(const std::vector<float>& emb, const MlpW& w, const std::vector<float>& dy, int B, int C, int E) {
    UNet m;
    m.B = B;
    LinP l0, l2;
    l0.in = C; l0.out = E; l0.w = 0; l0.b = (size_t)E * C;
    l2.in = E; l2.out = E; l2.w = l0.b + E; l2.b = l2.w + (size_t)E * E;
    m.n_params = l2.b + E;
    std::vector<float> p(w.w0);
    for (const std::vector<float>* v : {&w.b0, &w.w2, &w.b2}) p.insert(p.end(), v->begin(), v->end());
    m.p = to_device(p);
    m.g = dev_alloc(m.n_params);
    unet_alloc_chan(&m, B, 0);
    size_t ne = (size_t)B * E;
    float *d_emb = to_device(emb), *d_dy = to_device(dy), *h = dev_alloc(ne), *a = dev_alloc(ne), *y = dev_alloc(ne);
    float *da = dev_alloc(ne), *demb = dev_alloc((size_t)B * C);
    float* outs[] = {h, a, y, da, demb, m.g};
    size_t sizes[] = {ne, ne, ne, ne, (size_t)B * C, m.n_params};
    for (int i = 0; i < 6; i++) poison(outs[i], sizes[i]);
    linear_forward<float>(&m, l0, d_emb, h, B, nullptr);
    silu_kernel<<<ceil_div(ne, EW), EW>>>(h, a, ne);
    cudaCheck(cudaGetLastError());
    linear_forward<float>(&m, l2, a, y, B, nullptr);
    linear_backward(&m, l2, a, d_dy, da, B, 1, false);
    silu_backward_kernel<<<ceil_div(ne, EW), EW>>>(h, da, da, ne);
    cudaCheck(cudaGetLastError());
    linear_backward(&m, l0, d_emb, da, demb, B, 1, false);
    MlpOut o;
    o.y = to_host(y, ne);
    o.demb = to_host(demb, (size_t)B * C);
    o.dw0 = to_host(m.g + l0.w, (size_t)E * C);
    o.db0 = to_host(m.g + l0.b, E);
    o.dw2 = to_host(m.g + l2.w, (size_t)E * E);
    o.db2 = to_host(m.g + l2.b, E);
    float* fs[] = {d_emb, d_dy, h, a, y, da, demb, m.p, m.g};
    for (float* f : fs) cudaCheck(cudaFree(f));
    unet_free_chan(&m);
    return o;
}

// Tolerances. emb: cos/sin of a float32 argument up to ~1000 rad: the libraries' cos/sin differ by ~1 ulp of the
// result after range reduction, and expf's frequency by 1 ulp moves t*f by up to 1000 * 2^-24 * f ~ 6e-5: atol 1e-4,
// rtol 0. The MLP (fed PyTorch's emb): fp32 sums of <= 4C = 84 products and a SiLU: atol 3e-5 of the scale, rtol
// 1e-5.
static void compare_mlp(const std::string& who, const MlpOut& got, const MlpOut& ref) {
    check_scaled(who + " y", got.y, ref.y, 3e-5, 1e-5);
    check_scaled(who + " demb", got.demb, ref.demb, 3e-5, 1e-5);
    check_scaled(who + " grad time_embed.0.weight", got.dw0, ref.dw0, 3e-5, 1e-5);
    check_scaled(who + " grad time_embed.0.bias", got.db0, ref.db0, 3e-5, 1e-5);
    check_scaled(who + " grad time_embed.2.weight", got.dw2, ref.dw2, 3e-5, 1e-5);
    check_scaled(who + " grad time_embed.2.bias", got.db2, ref.db2, 3e-5, 1e-5);
}

int main(int argc, char** argv) {
    bool test = lab_version(argc, argv, 1, 1, "1: train_unet.cu's kernels") == 0;
    gpu_setup();
    Fixture fx;
    if (fixture_open(&fx, "timestep_embedding", 1011)) {
        std::vector<int> es = fx_shape(&fx, "emb");
        std::string err;
        int B = es.size() == 2 ? es[0] : 0, C = es.size() == 2 ? es[1] : 0, E = 4 * C;
        int tshape[1] = {B};
        const int* tp = (const int*)bin_expect(&fx.f, "t", DT_I32, 1, tshape, &err);
        if (!tp) report(false, "fixture timestep_embedding: " + err);
        std::vector<float> emb = fx_get(&fx, "emb", {B, C}), dy = fx_get(&fx, "dy", {B, E});
        MlpW w;
        w.w0 = fx_get(&fx, "time_embed.0.weight", {E, C});
        w.b0 = fx_get(&fx, "time_embed.0.bias", {E});
        w.w2 = fx_get(&fx, "time_embed.2.weight", {E, E});
        w.b2 = fx_get(&fx, "time_embed.2.bias", {E});
        MlpOut ref;
        ref.y = fx_get(&fx, "y", {B, E});
        ref.demb = fx_get(&fx, "demb", {B, C});
        ref.dw0 = fx_get(&fx, "grad.time_embed.0.weight", {E, C});
        ref.db0 = fx_get(&fx, "grad.time_embed.0.bias", {E});
        ref.dw2 = fx_get(&fx, "grad.time_embed.2.weight", {E, E});
        ref.db2 = fx_get(&fx, "grad.time_embed.2.bias", {E});
        if (fx.ok && tp) {
            std::vector<int> t(tp, tp + B);
            check_close("cpu oracle vs torch embedding (t up to 999, 21 channels)", cpu_embedding(t, C).data(),
                        emb.data(), emb.size(), 1e-4, 0);
            compare_mlp("cpu oracle vs torch time_embed", cpu_mlp(emb, w, dy, B, C, E), ref);
            if (!g_have_gpu) {
                skip("v1 vs torch timestep embedding: no CUDA GPU");
            } else {
                check_close("v1 vs torch embedding", gpu_embedding(t, C).data(), emb.data(), emb.size(), 1e-4, 0);
                compare_mlp("v1 vs torch time_embed", gpu_mlp(emb, w, dy, B, C, E), ref);
            }
        }
    }
    if (!g_have_gpu) {
        skip("timestep embedding GPU version 1 vs the CPU oracle: no CUDA GPU");
        return finish();
    }
    // every timestep of the default schedule, 64 channels (the UNet's), against the oracle
    std::vector<int> t(1000);
    for (int i = 0; i < 1000; i++) t[i] = i;
    std::vector<float> ref = cpu_embedding(t, 64);
    check_close("v1 vs cpu oracle embedding t 0..999, 64 channels", gpu_embedding(t, 64).data(), ref.data(),
                ref.size(), 1e-4, 0);
    int B = 5, C = 33, E = 4 * C;
    MlpW w;
    float b0 = 1.0f / sqrtf((float)C), b2 = 1.0f / sqrtf((float)E);
    w.w0 = random_vec((size_t)E * C, 7, 1, -b0, b0);
    w.b0 = random_vec(E, 7, 2, -b0, b0);
    w.w2 = random_vec((size_t)E * E, 7, 3, -b2, b2);
    w.b2 = random_vec(E, 7, 4, -b2, b2);
    std::vector<int> t5 = {3, 999, 500, 0, 77};
    std::vector<float> emb = cpu_embedding(t5, C), dy = random_vec((size_t)B * E, 7, 5, -1, 1);
    compare_mlp("v1 vs cpu oracle time_embed B5 C33", gpu_mlp(emb, w, dy, B, C, E), cpu_mlp(emb, w, dy, B, C, E));
    (void)test;
    gpu_teardown();
    return finish();
}
