"""pip install --no-build-isolation dev/torch_ops (from the repository root): builds csrc/ into torch_ops/_C*.so
against the PyTorch already installed, which the package then loads instead of building on import. The sources and
flags are those of the JIT build (torch_ops/_build.py): the CUDA kernels where PyTorch has CUDA and nvcc is found
(TORCH_OPS_CUDA=0: the CPU kernels only), for TORCH_CUDA_ARCH_LIST or the GPUs present (else sm_80 and sm_90a).
Build isolation would compile against another PyTorch than the one that loads the library: it is refused.
"""
import importlib.util
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    from torch.utils import cpp_extension
except ImportError:
    sys.exit("torch_ops builds against the PyTorch it runs with: install PyTorch first, then run "
             "pip install --no-build-isolation dev/torch_ops")

# _build.py alone: importing the package would load (and JIT-build) the library
spec = importlib.util.spec_from_file_location("torch_ops_build", os.path.join(HERE, "torch_ops", "_build.py"))
_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_build)

with_cuda, why = _build.cuda_wanted()
print(f"torch_ops: building {'the CPU and CUDA kernels' if with_cuda else 'the CPU kernels only'} ({why})")
sources = [os.path.relpath(s, HERE) for s in _build.sources(with_cuda)]
if with_cuda:
    ext = cpp_extension.CUDAExtension("torch_ops._C", sources,
                                      extra_compile_args={"cxx": _build.CXX_FLAGS, "nvcc": _build.nvcc_flags()},
                                      extra_link_args=_build.cuda_ldflags())
else:
    ext = cpp_extension.CppExtension("torch_ops._C", sources, extra_compile_args={"cxx": _build.CXX_FLAGS})

setup(
    name="torch_ops",
    version="0.1.0",
    description="The project's CUDA kernels (matmul, softmax, GroupNorm+SiLU, 3x3 conv, inverse roots, Newton-Schulz, "
                "Kronecker statistics) and a Shampoo optimizer as PyTorch custom operators",
    packages=["torch_ops"],
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.9",
)
