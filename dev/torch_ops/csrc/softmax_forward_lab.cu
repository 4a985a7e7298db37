// dev/softmax_forward.cu for dev/torch_ops: the lab file itself (its kernels, launchers and dispatchers, without its
// tests, benchmark and main), its failed CUDA calls raised as exceptions, behind labs::softmax_forward.
#define DEV_KERNELS_ONLY
#define CUDA_CHECK_THROWS
#include "../../softmax_forward.cu"
#include "labs.h"
#include <mutex>

namespace dev_lab {

static std::mutex g_lock;  // the lab's stream, device facts and dispatcher cache are globals

void softmax_forward(float* y, const float* x, int rows, int cols, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&g_cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    cudaCheck(cudaDeviceGetAttribute(&g_num_sms, cudaDevAttrMultiProcessorCount, dev));
    g_stream = stream;
    const char* why = ::softmax_forward(14, y, x, rows, cols, 0);  // version 14: the tuned dispatcher
    g_stream = 0;
    if (why) throw std::runtime_error(std::string("softmax_forward (dev/softmax_forward.cu version 14): ") + why);
}

}  // namespace dev_lab
