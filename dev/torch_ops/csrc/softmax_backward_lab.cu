// dev/softmax_backward.cu for dev/torch_ops: the lab file itself (its kernels, launchers and dispatchers, without
// its tests, benchmark and main), its failed CUDA calls raised as exceptions, behind labs::softmax_backward.
#define DEV_KERNELS_ONLY
#define CUDA_CHECK_THROWS
#include "../../softmax_backward.cu"
#include "labs.h"
#include <mutex>

namespace dev_lab {

static std::mutex g_lock;  // the lab's stream, device facts and dispatcher cache are globals

void softmax_backward(float* dx, const float* y, const float* dy, int rows, int cols, cudaStream_t stream) {
    std::lock_guard<std::mutex> guard(g_lock);
    int dev;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&g_cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    cudaCheck(cudaDeviceGetAttribute(&g_num_sms, cudaDevAttrMultiProcessorCount, dev));
    g_stream = stream;
    const char* why = ::softmax_backward(11, dx, y, dy, rows, cols, 0);  // version 11: the tuned dispatcher
    g_stream = 0;
    if (why) throw std::runtime_error(std::string("softmax_backward (dev/softmax_backward.cu version 11): ") + why);
}

}  // namespace dev_lab
