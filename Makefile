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

.PHONY: all test bench gpu-check clean
all: $(TRAINERS)

train_mnist: LDLIBS += -lz
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
	$(NVCC) $(NVCCFLAGS) $(GENCODE) -o $@ $< $(LDLIBS)

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
	$(MAKE) -j16 all
	$(MAKE) -C dev -j16 all
	$(PYTHON) dev/run_tests.py
	$(PYTHON) dev/run_benchmarks.py --quick --out bench_results

clean:
	rm -f $(TRAINERS) *.tmp
	$(MAKE) -C dev clean
	rm -rf bench_results
