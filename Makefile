# torchpar: `make test` and `make demo` do all their own set-up on a fresh machine.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
TORCH   ?= torch==2.13.0
NPROC   ?= 2
# ccache keeps rebuilds on the same machine quick; the build works without it. torch's
# cpp_extension puts ccache in front of g++ by itself when it is on PATH (setting
# CXX="ccache g++" here would wrap it twice: "ccache: Could not find compiler").
export MAX_JOBS ?= $(NPROC)
# Paths hashed relative to the build directory, and (-g builds) the build directory left out
# of the hash, so git worktrees of the project share one ccache.
export CCACHE_BASEDIR ?= $(abspath $(CURDIR)/..)
export CCACHE_NOHASHDIR ?= 1

SOURCES := setup.py $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' 2>/dev/null)

.PHONY: all deps build test test-py test-slow test-hosts test-conformance test-cpp fuzz demo bench build-cuda test-cuda-build test-gpu clean

all: build

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH) pytest pytest-timeout numpy ninja setuptools wheel matplotlib tqdm
	@touch $@

deps: $(VENV)/.deps

# OpenSSL's libcrypto (HMAC-SHA256 for the TCP handshake): Debian's libssl-dev, installed
# here when its headers are missing (CI runs as root).
OPENSSL_DEV := /usr/include/openssl/hmac.h
$(OPENSSL_DEV):
	apt-get install -y -q libssl-dev >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libssl-dev >/dev/null 2>&1) || \
	  (echo "torchpar needs OpenSSL's headers and libcrypto: install libssl-dev (Debian) or openssl-devel" && false)

# Editable install once (no build isolation: it would fetch a CUDA torch), then
# incremental in-place rebuilds whenever a C++ source changes.
$(VENV)/.installed: $(VENV)/.deps pyproject.toml | $(OPENSSL_DEV)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $@

torchpar/_C.stamp: $(VENV)/.installed $(SOURCES) | $(OPENSSL_DEV)
	$(PY) setup.py -q build_ext --inplace
	@touch $@

build: torchpar/_C.stamp

test: test-cpp test-py

# `make test` stays inside CI's budget: the slowest cases carry @pytest.mark.slow (or are named
# in their module's SLOW_VARIANTS, tests/conftest.py) and run in `make test-slow` (CI runs both).
test-py: build
	$(PY) -m pytest -q -m "not slow" --durations=25 tests

test-slow: build
	$(PY) -m pytest -q -m slow --durations=15 tests || test $$? -eq 5

# Jobs across test hosts (network namespaces joined by a bridge; needs root, skips without):
# torchrun --nnodes=2/3, collectives, DDP, a killed rank, a restart, a link going down
# (docs/hosts.md). Its cases are marked slow, so `make test-slow` runs them too.
test-hosts: build
	$(PY) -m pytest -q -rs tests/test_hosts.py

# PyTorch's own backend suite (torch/testing/_internal/distributed/distributed_test.py) run on
# torchpar, as a plugin and with gloo's cases, over shared memory and TCP, at world sizes 2
# and 3, beside gloo: fails on any case gloo passes and torchpar does not (docs/conformance.md).
test-conformance: build
	$(PIP) install -q expecttest
	$(PY) tests/conformance/run.py --world-sizes 2,3 --transports shm,tcp

# GoogleTest of the transport and collectives layers, threads as ranks (no Python).
# Needs Debian's libgtest-dev, installed here when missing; without it (no root, no
# network) these tests are skipped with a note and the Python suite still runs.
TORCH_DIR = $(VENV)/lib/python3.11/site-packages/torch
CPP_SOURCES := $(wildcard csrc/transport/*.cpp csrc/transport/shm/*.cpp csrc/transport/tcp/*.cpp \
	csrc/collectives/*.cpp csrc/collectives/p2p/*.cpp)
CPP_TESTS := $(wildcard tests/cpp/*.cpp)
CPP_HEADERS := $(wildcard csrc/*/*.h csrc/*/*/*.h tests/cpp/*.h)
CPP_FLAGS := -O2 -std=c++20 -mavx2 -mfma -mf16c -DCPU_CAPABILITY_AVX2 -DCPU_CAPABILITY=AVX2 -Wno-unknown-pragmas \
	-Icsrc -I$(TORCH_DIR)/include
# One object per source, so that `make -j` compiles them in parallel (test-cpp passes -j$(NPROC)).
CPP_OBJECTS := $(patsubst %.cpp,build/cpp-obj/%.o,$(CPP_SOURCES) $(CPP_TESTS))
build/cpp-obj/%.o: %.cpp $(CPP_HEADERS) $(VENV)/.deps | $(OPENSSL_DEV)
	@mkdir -p $(dir $@)
	c++ $(CPP_FLAGS) -c $< -o $@
build/cpp-tests: $(CPP_OBJECTS)
	c++ $(CPP_OBJECTS) -L$(TORCH_DIR)/lib -Wl,-rpath,$(abspath $(TORCH_DIR))/lib -lc10 -lgtest -lgtest_main -lcrypto \
	  -lpthread -lrt -o $@

# The same tests under ThreadSanitizer (the point-to-point engine's threads: progress thread,
# callers of isend writing the send fast path, waiters). Slower to build; run by hand:
# make build/cpp-tests-tsan && build/cpp-tests-tsan --gtest_brief=1 --gtest_filter='P2P.*'
# The ranks of a test are threads of one process, but ThreadSanitizer sees no order between
# them through a socket pair or through the shared-memory segment (each rank maps it at its
# own address). In-place collectives send a chunk and later receive the reduced chunk into
# the same place, which the peer can only send after it got ours: when the send and the
# receive run on different threads of a rank (the caller's fast path, the progress thread),
# the Hosts tests report them as races. They are not; P2P.*, Groups.* and Transport* are
# the set to read.
build/cpp-tests-tsan: $(VENV)/.deps $(CPP_SOURCES) $(CPP_TESTS) $(CPP_HEADERS) | $(OPENSSL_DEV)
	@mkdir -p build
	c++ -O1 -g -fsanitize=thread -std=c++20 -mavx2 -mfma -mf16c -DCPU_CAPABILITY_AVX2 -DCPU_CAPABILITY=AVX2 \
	  -Wno-unknown-pragmas -Icsrc -I$(TORCH_DIR)/include $(CPP_SOURCES) $(CPP_TESTS) \
	  -L$(TORCH_DIR)/lib -Wl,-rpath,$(abspath $(TORCH_DIR))/lib -lc10 -lgtest -lgtest_main -lcrypto -lpthread -lrt -o $@

test-cpp:
	@test -f /usr/include/gtest/gtest.h || (apt-get install -y -q libgtest-dev >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libgtest-dev >/dev/null 2>&1)) || true
	@if test -f /usr/include/gtest/gtest.h; then $(MAKE) --no-print-directory -j$(NPROC) build/cpp-tests && \
	  build/cpp-tests --gtest_brief=1; else echo "NOTE: libgtest-dev unavailable: C++ tests skipped"; fi

# libFuzzer on the parsers of what other processes send (tests/fuzz/fuzz_wire.cpp): the
# store's records, the TCP handshake's messages, the point-to-point frame stream; built with
# clang's address and undefined-behaviour sanitizers (Debian's clang-14 and libfuzzer-14-dev,
# installed here when missing), run for FUZZ_SECONDS. The corpus it grows stays in build/.
FUZZ_SECONDS ?= 30
FUZZ_SOURCES := csrc/transport/records.cpp csrc/transport/tcp/handshake.cpp csrc/transport/p2p_engine.cpp \
	csrc/transport/request.cpp
build/fuzz-wire: tests/fuzz/fuzz_wire.cpp $(FUZZ_SOURCES) $(wildcard csrc/*/*.h csrc/*/*/*.h) | $(OPENSSL_DEV)
	@(command -v clang++-14 >/dev/null && dpkg -s libfuzzer-14-dev >/dev/null 2>&1) || \
	  apt-get install -y -q clang-14 libfuzzer-14-dev >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q clang-14 libfuzzer-14-dev >/dev/null 2>&1)
	@mkdir -p build
	clang++-14 -g -O1 -std=c++20 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Icsrc \
	  tests/fuzz/fuzz_wire.cpp $(FUZZ_SOURCES) -lcrypto -lpthread -o $@

fuzz: build/fuzz-wire
	@mkdir -p build/fuzz-corpus
	build/fuzz-wire -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 build/fuzz-corpus

# The project's main job (issue 20, docs/gpt.md): a byte-level GPT trained on 4 ranks with
# tensor x pipeline parallelism (dp=1 tp=2 pp=2) on the stdlib's sources, a couple of minutes.
DEMO_OUT ?= runs/demo
demo: build
	$(VENV)/bin/torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --dp 1 --tp 2 --pp 2 \
	  --model small --steps 300 --eval-every 50 --out $(DEMO_OUT)

# The collectives benchmark (torchpar against gloo), formerly `make demo`.
bench: build
	$(PY) -m torchpar.bench collectives --json bench-results/collectives.json --plot bench-results/collectives.png \
	  --markdown bench-results/collectives.md

# CUDA build: a separate venv with the CUDA build of torch; compiles every .cu file.
# An extension only loads into the torch it was built against: to build for a GPU host with
# another torch, name it, its Python and a folder of its own, e.g.
#   make build-cuda PYTHON=python3.12 CUDA_TORCH=torch==2.11.0 CUDA_VENV=.venv-cuda-2.11 \
#        CUDA_BUILD=build/cuda-2.11 CUDA_ARCHS=9.0
# and copy $(CUDA_BUILD)-lib/torchpar/_C*.so into that host's torchpar/.
CUDA_VENV  ?= .venv-cuda
CUDA_TORCH ?= torch==2.14.1
CUDA_BUILD ?= build/cuda
$(CUDA_VENV)/.deps:
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install -q $(CUDA_TORCH) nvidia-nccl-cu13 ninja setuptools wheel numpy pytest pytest-timeout
	@touch $@

# CUDA_HOME: the toolkit holding nvcc (nvcc on PATH may be a wrapper script, which would
# make torch guess /usr/local). The CUDA wheels torch pulls in ship the library headers
# ATen's CUDA headers include (cusparse.h, cublas_v2.h ...); CPATH hands them to g++ and nvcc.
# The NCCL wheel has only libnccl.so.2, so -lnccl links through a libnccl.so symlink.
CUDA_HOME ?= $(or $(lastword $(sort $(wildcard /usr/local/cuda-*))),$(patsubst %/bin/nvcc,%,$(shell command -v nvcc)))
CUDA_ARCHS ?= 8.0;9.0
# $(call cuda_setup,PYTHON,ARGS): setup.py build_ext ARGS with PYTHON's CUDA torch and NCCL wheel.
define cuda_setup
	NCCL_DIR=$$($(1) -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])"); \
	CU_INC=$$($(1) -c "import nvidia, os; print(':'.join(os.path.join(p, 'cu13', 'include') for p in nvidia.__path__))"); \
	mkdir -p build/nccl-lib && ln -sf $$NCCL_DIR/lib/libnccl.so.2 build/nccl-lib/libnccl.so; \
	CUDA_HOME=$(CUDA_HOME) CPATH=$$CU_INC$${CPATH:+:$$CPATH} \
	TORCHPAR_CUDA=1 NCCL_INCLUDE=$$NCCL_DIR/include NCCL_LIB=$(CURDIR)/build/nccl-lib:$$NCCL_DIR/lib \
	TORCH_CUDA_ARCH_LIST="$(CUDA_ARCHS)" $(1) setup.py -q build_ext $(2)
endef

build-cuda: $(CUDA_VENV)/.deps | $(OPENSSL_DEV)
	$(call cuda_setup,$(CUDA_VENV)/bin/python,--build-temp $(CUDA_BUILD)-temp --build-lib $(CUDA_BUILD)-lib)

# The CUDA build on a machine without a GPU: it loads (every symbol, NCCL included, resolves
# against the CUDA torch) and its CPU kernels and backend pass their tests; GPU tests skip.
CUDA_PKG := build/cuda-pkg
test-cuda-build: build-cuda
	rm -rf $(CUDA_PKG) && mkdir -p $(CUDA_PKG) && cp -r torchpar $(CUDA_PKG)/
	rm -f $(CUDA_PKG)/torchpar/_C*.so $(CUDA_PKG)/torchpar/_C.stamp && cp $(CUDA_BUILD)-lib/torchpar/_C*.so $(CUDA_PKG)/torchpar/
	cd $(CUDA_PKG) && PYTHONPATH=$(CURDIR)/$(CUDA_PKG) $(CURDIR)/$(CUDA_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  $(addprefix $(CURDIR)/,$(wildcard tests/test_kernels_*.py) tests/test_init.py tests/test_nccl.py)

# On a machine with a GPU whose $(GPU_PYTHON) holds a CUDA build of torch: build in place
# with it and run the kernel tests, the backend's CUDA (NCCL) tests and the GPT on the GPUs
# (tests/test_gpt_cuda.py: one rank per GPU), the GPU ones included.
# PYTHONPATH: the in-place build is not installed, and the tests' rank processes import it. CUDA_HOME defaults as above;
# e.g. `make test-gpu CUDA_ARCHS=9.0 MAX_JOBS=16` on an H100.
GPU_PYTHON ?= python3
GPU_PYTEST_ARGS ?= -q
test-gpu:
	$(call cuda_setup,$(GPU_PYTHON),--inplace)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(GPU_PYTHON) -m pytest $(GPU_PYTEST_ARGS) -p no:cacheprovider -rs tests/test_nccl.py tests/test_init.py tests/test_kernels_*.py \
	  tests/test_gpt_cuda.py

clean:
	rm -rf build torchpar/_C*.so torchpar/_C.stamp *.egg-info
