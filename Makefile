# Builds the trainers. `make` builds every trainer present; `make test` builds everything and runs every test;
# `make bench` runs the benchmarks against PyTorch (GPU machine); `make gpu-check` is the whole GPU round.
NVCC ?= nvcc
PYTHON ?= python3
# Build for the GPU that is present, else for a fixed list so CI compiles what users run.
GPU_CC := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
ifneq ($(GPU_CC),)
  GENCODE ?= -gencode arch=compute_$(GPU_CC),code=sm_$(GPU_CC)
else
  GENCODE ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
endif
# No --use_fast_math: the trainers are compared with PyTorch in true fp32.
NVCCFLAGS ?= -O3 -std=c++17 -lineinfo
LDLIBS = -lcublas -lcurand
export NVCC PYTHON GENCODE NVCCFLAGS

TRAINERS := $(basename $(wildcard train_*.cu))

.PHONY: all test bench gpu-check clean nccl-info dev-all torch-ops
all: $(TRAINERS)

train_mnist: LDLIBS += -lz
# cuBLASLt: train_unet's Muon products (their output apart from the C they add)
train_unet: LDLIBS += -lcublasLt

# NCCL for train_unet's data parallelism (several GPUs): `make NCCL_HOME=/path` (include/, lib/ or lib64/), else the
# CUDA installation nvcc belongs to, else /usr (Debian's libnccl-dev), else the nvidia-nccl Python wheel PyTorch
# installs (its lib holds libnccl.so.2 only, hence -l:libnccl.so.2 and an rpath). Found: -DUNET_NCCL. Not found, or
# NCCL=0: the single-GPU build, which refuses a launch with several ranks.
NCCL ?= 1
ifneq ($(NCCL),0)
  CUDA_HOME_NVCC := $(patsubst %/bin/,%,$(dir $(shell command -v $(NVCC) 2>/dev/null)))
  NCCL_WHEEL := $(shell $(PYTHON) -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null)
  NCCL_HOMES := $(if $(NCCL_HOME),$(NCCL_HOME),$(CUDA_HOME_NVCC) /usr $(NCCL_WHEEL))
  nccl_lib = $(firstword $(foreach d,lib64 lib lib/x86_64-linux-gnu lib/aarch64-linux-gnu,\
                 $(wildcard $(1)/$(d)/libnccl.so.2)))
  nccl_ok = $(if $(and $(wildcard $(1)/include/nccl.h),$(call nccl_lib,$(1))),$(1))
  NCCL_FOUND := $(firstword $(foreach h,$(NCCL_HOMES),$(call nccl_ok,$(h))))
  ifneq ($(NCCL_FOUND),)
    NCCL_LIBDIR := $(patsubst %/,%,$(dir $(call nccl_lib,$(NCCL_FOUND))))
    train_unet: NVCCFLAGS_NCCL := -DUNET_NCCL -I$(NCCL_FOUND)/include
    train_unet: LDLIBS += -L$(NCCL_LIBDIR) -l:libnccl.so.2 -Xlinker -rpath -Xlinker $(NCCL_LIBDIR)
  else ifneq ($(NCCL_HOME),)
    $(error NCCL_HOME=$(NCCL_HOME) has no include/nccl.h with lib/ or lib64/libnccl.so.2)
  endif
endif
# train_mnist's conv2 products and train_unet's bf16 convolutions run on wgmma, which needs the architecture-specific
# sm_90a target: sm_90 becomes sm_90a for them (other targets compile their mma.sync / TF32 paths), in every spelling
# (-gencode arch=compute_90,code=sm_90, code=[sm_90,compute_90], -arch=sm_90; 90a stays 90a). `override`: a GENCODE
# given on the command line replaces the Makefile's assignments, target-specific ones too, unless they say override.
SM90A = $(subst compute_90,compute_90a,$(subst sm_90,sm_90a,$(subst compute_90a,compute_90,$(subst sm_90a,sm_90,$(1)))))
train_mnist train_unet: override GENCODE := $(call SM90A,$(GENCODE))
ifneq ($(filter %native %all %all-major,$(GENCODE)),)
  $(warning GENCODE "$(GENCODE)" names no architecture: train_mnist and train_unet cannot get sm_90a from it and build \
    their mma.sync / TF32 paths on an H100; for the wgmma paths pass -gencode arch=compute_90a,code=sm_90a)
endif

train_%: train_%.cu
	$(NVCC) $(NVCCFLAGS) $(NVCCFLAGS_NCCL) $(GENCODE) -o $@ $< $(LDLIBS)

# Builds every binary (trainers and dev/), then runs every suite; last line: N passed, N failed, N skipped.
test: all
	$(MAKE) -C dev all
	$(PYTHON) dev/run_tests.py

bench: all
	$(MAKE) -C dev all
	$(PYTHON) dev/run_benchmarks.py --out bench_results

# The whole GPU round in a few minutes: build, every test, every benchmark in its quick form; results in
# bench_results/. `make bench` runs the full benchmarks.
gpu-check:
	$(MAKE) -j16 all dev-all torch-ops
	$(PYTHON) dev/run_tests.py -j 8
	$(PYTHON) dev/run_benchmarks.py --quick --out bench_results

# gpu-check builds the trainers, dev/ and the PyTorch operators' JIT library in one make, so they overlap
dev-all:
	$(MAKE) -C dev all
torch-ops:
	$(PYTHON) -c "import sys; sys.path.insert(0, 'dev/torch_ops'); import torch_ops; print(torch_ops.BUILD_INFO)"

# Where train_unet's NCCL comes from (.ci/run asks before it installs the headers)
nccl-info:
	@echo "$(if $(NCCL_FOUND),NCCL $(NCCL_FOUND) (lib $(NCCL_LIBDIR)),NCCL not found: train_unet builds for one GPU)"

clean:
	rm -f $(TRAINERS) *.tmp
	$(MAKE) -C dev clean
	rm -rf bench_results
