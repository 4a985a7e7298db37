"""How the torch_ops library is built, for the JIT build of the first import (torch_ops/__init__.py) and for
`pip install` (setup.py): the sources, the compiler flags, and whether the CUDA kernels are built.

The CPU kernels (csrc/ops.cpp) are always built. The CUDA kernels (csrc/cuda_ops.cpp and csrc/*_lab.cu, which
include the lab files of dev/ and train_unet.cu) are built when PyTorch has CUDA and nvcc is found; TORCH_OPS_CUDA=0
builds the CPU kernels only, TORCH_OPS_CUDA=1 makes a missing CUDA an error. The CUDA build links cuBLAS and
cuSOLVER (dev/matrix_roots.cu's versions 0 and 1).
"""
import glob
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # dev/torch_ops/torch_ops
PROJECT_DIR = os.path.dirname(PACKAGE_DIR)  # dev/torch_ops
CSRC = os.path.join(PROJECT_DIR, "csrc")
CPU_SOURCES = ["ops.cpp"]
CUDA_SOURCES = ["cuda_ops.cpp", "softmax_forward_lab.cu", "softmax_backward_lab.cu", "matmul_lab.cu", "unet_lab.cu",
                "matrix_roots_lab.cu"]
DEFAULT_ARCHS = ["8.0", "9.0"]  # with no GPU to ask, as the project's Makefiles


def cuda_wanted():
    """(build the CUDA kernels?, why) from TORCH_OPS_CUDA (auto, 0 or 1), PyTorch's build and the CUDA toolkit."""
    import torch
    from torch.utils import cpp_extension
    env = os.environ.get("TORCH_OPS_CUDA", "auto")
    if env not in ("auto", "0", "1"):
        raise ValueError(f"TORCH_OPS_CUDA must be auto, 0 or 1, found {env!r}")
    if env == "0":
        return False, "TORCH_OPS_CUDA=0"
    if torch.version.cuda is None:
        why = f"this PyTorch ({torch.__version__}) is built without CUDA"
    elif cpp_extension.CUDA_HOME is None:
        why = "no CUDA toolkit found (nvcc; set CUDA_HOME)"
    else:
        return True, f"PyTorch {torch.__version__} with CUDA {torch.version.cuda}, toolkit {cpp_extension.CUDA_HOME}"
    if env == "1":
        raise RuntimeError(f"TORCH_OPS_CUDA=1 but {why}")
    return False, why


def cuda_archs():
    """Compute capabilities to build for ("9.0", "8.0+PTX"): TORCH_CUDA_ARCH_LIST, else the visible GPUs', else
    DEFAULT_ARCHS."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if env:
        return env
    import torch
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return [f"{major}.{minor}" for major, minor in sorted(caps)]
    return list(DEFAULT_ARCHS)


def gencode_flags(archs):
    """nvcc -gencode flags; 9.0 becomes the architecture-specific sm_90a, which the wgmma code of matmul version 7
    and of train_unet.cu's bf16 convolutions needs (as in the Makefiles)."""
    flags = []
    for arch in archs:
        ptx = arch.endswith("+PTX")
        num = arch.replace("+PTX", "").replace(".", "")
        if not num.rstrip("a").isdigit():
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot read compute capability {arch!r}")
        if num == "90":
            num = "90a"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def sources(with_cuda):
    return [os.path.join(CSRC, s) for s in CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])]


CXX_FLAGS = ["-O2", "-std=c++17"]
# No --use_fast_math: the kernels are compared with PyTorch in true fp32, as in the lab builds.
NVCC_BASE_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]


def nvcc_flags(archs=None):
    return NVCC_BASE_FLAGS + gencode_flags(archs if archs is not None else cuda_archs())


def cuda_ldflags():
    """-lcublas -lcublasLt -lcusolver, and run paths to the folders that hold them: PyTorch's own CUDA libraries
    first (the nvidia wheels next to torch; torch loads its cuSOLVER only when linalg first needs it), then the
    toolkit's."""
    import torch
    from torch.utils import cpp_extension
    site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    dirs = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcusolver.so*"))})
    if cpp_extension.CUDA_HOME:
        dirs += [os.path.join(cpp_extension.CUDA_HOME, d) for d in ("lib64", "lib")
                 if os.path.isdir(os.path.join(cpp_extension.CUDA_HOME, d))]
    return [f"-Wl,-rpath,{d}" for d in dirs] + ["-lcublas", "-lcublasLt", "-lcusolver"]
