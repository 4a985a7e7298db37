// train_unet.cu's GroupNorm(+SiLU) and 3x3 convolution for dev/torch_ops (the layers dev/groupnorm.cu and
// dev/conv2d.cu check and time): the trainer itself with TESTING (no main), its failed CUDA calls raised as
// exceptions, its launchers driven through a UNet shell whose parameters and workspaces are the caller's buffers.
#define TESTING
#define CUDA_CHECK_THROWS
// cpp_extension defines these for every .cu; the trainer's bf16 code converts implicitly, as in its own build
#undef __CUDA_NO_HALF_OPERATORS__
#undef __CUDA_NO_HALF_CONVERSIONS__
#undef __CUDA_NO_BFLOAT16_CONVERSIONS__
#undef __CUDA_NO_HALF2_OPERATORS__
#include "../../../train_unet.cu"
#include "labs.h"
#include <mutex>

namespace dev_lab {

static std::mutex g_lock;  // the trainer's stream, precision switches and SM count are globals

static const size_t ALIGN = 256;
static size_t round_up(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

// Hands out consecutive 256-byte aligned pieces of the caller's workspace.
struct Carve {
    char* p;
    template <typename T>
    T* take(size_t count) {
        T* out = reinterpret_cast<T*>(p);
        p += round_up(count * sizeof(T));
        return out;
    }
};

// The globals every call sets: the stream, the SM count (split-K plans, reduction chunks), TF32, and version 6's plan.
static void set_globals(cudaStream_t stream, bool tf32) {
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&g_num_sms, cudaDevAttrMultiProcessorCount, dev));
    g_stream = stream;
    g_tf32 = tf32;
    g_conv6_tile = -1;
    g_conv6_splits = 0;
}

// chan_reduce takes C channels as float4 (C % 4 == 0, C / 4 <= 256 threads) or one by one (C <= 256); its
// partial sums fill at most max(Bq, 1024) x C slots of red_ws (the chunk count S is capped at 1024 / Bq)
static bool channel_reduce_ok(int C) { return C % 4 == 0 ? C <= 1024 : C <= 256; }
static size_t red_ws_items(int B, int C) { return (size_t)std::max(B, 1024) * C; }

// ---------------------------------------------------------------------------------------------------------------
// GroupNorm

size_t groupnorm_workspace_bytes(int B, int C) {
    return round_up(red_ws_items(B, C) * sizeof(double2)) + round_up((size_t)B * C * sizeof(float2)) +
           round_up((size_t)B * C * sizeof(float4));
}

static UNet groupnorm_shell(const float* gamma_beta, int B, int C, void* workspace, NormP& n) {
    UNet m;
    m.B = B;
    m.p = const_cast<float*>(gamma_beta);  // read only: the forward and backward read gamma and beta there
    n.C = C;
    n.w = 0;
    n.b = (size_t)C;
    Carve carve = {static_cast<char*>(workspace)};
    m.red_ws_items = red_ws_items(B, C);
    m.red_ws = carve.take<double2>(m.red_ws_items);
    m.gn_scale = carve.take<float2>((size_t)B * C);
    m.gn_coef = carve.take<float4>((size_t)B * C);
    return m;
}

void groupnorm_forward(const float* x, const float* gamma_beta, float* y, float* mean, float* rstd, int B, int P,
                       int C, bool silu, void* workspace, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    set_globals(stream, false);
    NormP n;
    UNet m = groupnorm_shell(gamma_beta, B, C, workspace, n);
    ::groupnorm_forward<float>(&m, n, x, y, mean, rstd, P, silu ? 1 : 0);
}

void groupnorm_backward(const float* dy, const float* x, const float* gamma_beta, const float* mean,
                        const float* rstd, float* dx, float* dgamma_dbeta, int B, int P, int C, bool silu,
                        void* workspace, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    set_globals(stream, false);
    NormP n;
    UNet m = groupnorm_shell(gamma_beta, B, C, workspace, n);
    m.g = dgamma_dbeta;
    ::groupnorm_backward<float>(&m, n, x, dy, dx, mean, rstd, P, silu ? 1 : 0, false);
}

// ---------------------------------------------------------------------------------------------------------------
// 3x3 convolution

size_t conv3x3_bias_offset(int cin, int cout) {
    return ((size_t)9 * cin * cout + 7) / 8 * 8;  // 32-byte aligned, as the trainer places every parameter
}

static ConvP conv_p(int cin, int cout, int stride) {
    ConvP c;
    c.cin = cin;
    c.cout = cout;
    c.stride = stride;
    c.w = 0;
    c.b = conv3x3_bias_offset(cin, cout);
    return c;
}

bool conv3x3_channel_sums_ok(int cout) { return channel_reduce_ok(cout); }

size_t conv3x3_workspace_bytes(int B, int H, int W, int cin, int cout, int stride) {
    std::lock_guard<std::mutex> guard(g_lock);
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&g_num_sms, cudaDevAttrMultiProcessorCount, dev));  // the split-K plans
    ConvP c = conv_p(cin, cout, stride);
    return round_up(conv_ws_floats_need(B, c, H, W) * sizeof(float)) +
           round_up(conv_scratch_floats_need(B, c, H, W) * sizeof(float)) +
           round_up(red_ws_items(B, cout) * sizeof(double2));
}

static UNet conv_shell(const float* w_bias, int B, int H, int W, const ConvP& c, void* workspace) {
    UNet m;
    m.B = B;
    m.p = const_cast<float*>(w_bias);  // read only: the passes read the weights and the bias there
    Carve carve = {static_cast<char*>(workspace)};
    m.conv_ws_floats = conv_ws_floats_need(B, c, H, W);
    m.conv_ws = carve.take<float>(m.conv_ws_floats);
    m.wflip_floats = conv_scratch_floats_need(B, c, H, W);
    m.wflip = carve.take<float>(m.wflip_floats);
    m.red_ws_items = red_ws_items(B, c.cout);
    m.red_ws = carve.take<double2>(m.red_ws_items);
    return m;
}

void conv3x3_forward(const float* x, const float* w_bias, float* y, int B, int H, int W, int cin, int cout,
                     int stride, bool tf32, void* workspace, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    set_globals(stream, tf32);
    ConvP c = conv_p(cin, cout, stride);
    UNet m = conv_shell(w_bias, B, H, W, c, workspace);
    ::conv3x3_forward<float>(&m, c, x, y, H, W, nullptr, nullptr);
}

void conv3x3_backward(const float* dy, const float* x, const float* w_bias, float* dx, float* dw_db, int B, int H,
                      int W, int cin, int cout, int stride, bool tf32, void* workspace, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    set_globals(stream, tf32);
    ConvP c = conv_p(cin, cout, stride);
    UNet m = conv_shell(w_bias, B, H, W, c, workspace);
    m.g = dw_db;
    ::conv3x3_backward_data<float>(&m, c, dy, dx, H, W, false);
    ::conv3x3_backward_weight<float>(&m, c, x, dy, H, W);
    if (channel_reduce_ok(cout)) {
        const int Ho = (H - 1) / stride + 1, Wo = (W - 1) / stride + 1;
        channel_sums<float>(&m, dy, m.g + c.b, B, Ho * Wo, cout, 0, 0);
    }
}

}  // namespace dev_lab
