# moemesh — one Makefile for the whole tree.
#
#   make            build the CPU binaries into build/bin
#   make run        build and serve the default model through the whole local mesh (:8000)
#   make test       build and run every test (last line: "N passed, N failed[, N skipped]")
#   make asan       build with AddressSanitizer into build/asan and run the test suite there
#   make ubsan      the same with UndefinedBehaviorSanitizer
#   make cuda       also build kernels/cuda with nvcc (sm_90 + PTX)
#   make hip        compile kernels/cuda for AMD (gfx90a, gfx1030) with Debian's hipcc
#   make proto      regenerate the protobuf-c code only
#   make deps       install the Debian packages the build needs (idempotent)
#   make test-rdma  rdma:// suite on soft-RoCE in a qemu VM (BENCH=1: benchmark rows too)
#   make install    install binaries, launcher and systemd units (PREFIX, DESTDIR; docs/OPERATIONS.md)
#   make test-twobox  two-box rehearsal in network namespaces (root; deploy/twobox.sh)
#
# Sources are found by wildcard: a new common/*.c, kernels/cpu/*.c, tests/**/*_test.c or
# services/<daemon>/*.c needs no Makefile change.

SHELL     := /bin/bash
BUILD     ?= build
SAN       ?=
CC        ?= cc
OPT       ?= -O2
PORT      ?= 8000

# Debian packages the build and the tests need.
DEB_PKGS := build-essential pkg-config libnng-dev libprotobuf-c-dev protobuf-c-compiler \
            libibverbs-dev rdma-core libuv1-dev libh2o-dev libssl-dev libjansson-dev \
            libpcre2-dev libutf8proc-dev zlib1g-dev curl python3 bc \
            docker-compose systemd

CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g $(OPT) -fPIC -pthread \
               -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla \
               -Icommon/include -Ikernels -I$(BUILD)/gen -Iproto
# GCC leaves float-cast-overflow (a float out of an integer's range converted to it: undefined
# behaviour, e.g. a NaN logit turned into an index) out of -fsanitize=undefined; both builds add it.
SAN_FLAGS :=
ifeq ($(SAN),address)
SAN_FLAGS := -fsanitize=address,undefined,float-cast-overflow -fno-omit-frame-pointer \
             -fno-sanitize-recover=undefined,float-cast-overflow
endif
ifeq ($(SAN),undefined)
SAN_FLAGS := -fsanitize=undefined,float-cast-overflow \
             -fno-sanitize-recover=undefined,float-cast-overflow -fno-omit-frame-pointer
endif
CFLAGS  := $(CFLAGS_BASE) $(SAN_FLAGS) $(EXTRA_CFLAGS)
LDFLAGS := $(SAN_FLAGS) -pthread
LDLIBS  := -lnng -lprotobuf-c -lh2o -luv -lssl -lcrypto -lz \
           -ljansson -lpcre2-8 -lutf8proc -libverbs -lm -ldl

# ---- sources ---------------------------------------------------------------------------------
PROTOS      := $(wildcard proto/*.proto)
PROTO_C     := $(patsubst proto/%.proto,$(BUILD)/gen/proto/%.pb-c.c,$(PROTOS))
PROTO_H     := $(PROTO_C:.c=.h)
LIB_SRCS    := $(wildcard common/*.c common/transport/*.c kernels/*.c kernels/cpu/*.c)
LIB_OBJS    := $(patsubst %.c,$(BUILD)/obj/%.o,$(LIB_SRCS)) $(PROTO_C:.c=.o)

# ---- GPU (kernels/cuda, issue 7). The CPU build never needs nvcc: `make cuda` re-runs this
# Makefile with CUDA=1 into build/cuda, where libmoemesh.a also holds the nvcc objects (sm_90a
# machine code, for wgmma, + compute_90 PTX for newer parts) and binaries link the CUDA runtime
# statically. `make hip` compiles the same sources with Debian's hipcc for gfx90a and gfx1030
# (a compile check).
NVCC         ?= /usr/local/cuda/bin/nvcc
CUDA_HOME    ?= /usr/local/cuda
CUDA_GENCODE := -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90
HIPCC        ?= hipcc
HIP_ARCHS    := --offload-arch=gfx90a --offload-arch=gfx1030
GPU_SRCS     := $(wildcard kernels/cuda/*.cu)
GPU_HDRS     := $(wildcard kernels/cuda/*.h kernels/cuda/*.cuh kernels/cuda/vendor/*.h kernels/*.h)
GPU_EXTRA    ?= # more nvcc/hipcc flags, e.g. -DMM_GPU_DIAG_SKIP for a diagnostic build (kernels/cuda/backend.cu)
GPU_FLAGS    := -O3 -std=c++17 -Icommon/include -Ikernels -Ikernels/cuda -I$(BUILD)/gen $(GPU_EXTRA)
GPU_BENCH    := $(BUILD)/bin/moemesh-gpu-bench
ifeq ($(CUDA),1)
LIB_OBJS     += $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(GPU_SRCS))
CFLAGS       += -DMM_HAVE_CUDA -Ikernels/cuda
# -u pulls the backend out of the archive: kernels.c only references it weakly.
# -u mm_gpu_ipc_mem_export: the same for kernels/cuda/ipc.cu (cudaipc.c's references are weak).
LDFLAGS      += -Wl,--as-needed -Wl,-u,mm_cuda_backend_open -Wl,-u,mm_gpu_ipc_mem_export \
                -L$(CUDA_HOME)/lib64
LDLIBS       += -lcudart_static -lrt -lstdc++
endif
DAEMONS     := gateway router attention expert drafter
DAEMON_BINS := $(patsubst %,$(BUILD)/bin/moemesh-%,$(DAEMONS))
TOOL_SRCS   := $(wildcard tools/moemesh/*.c)
TEST_SRCS   := $(shell find tests -name '*_test.c' 2>/dev/null | sort)
TEST_BINS   := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRCS))
LIB         := $(BUILD)/libmoemesh.a

.PHONY: all run test asan ubsan deps proto clean cuda hip check-config test-bins
.PHONY: install test-twobox
all: deps $(DAEMON_BINS) $(BUILD)/bin/moemesh

# ---- dependencies ----------------------------------------------------------------------------
DEPS_STAMP := build/.deps-ok
deps: $(DEPS_STAMP)
$(DEPS_STAMP): Makefile
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then SUDO=sudo; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null || exit 1; \
	fi
	@command -v npm >/dev/null || { echo "deps: installing npm"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null; }
	@mkdir -p build && touch $@

# ---- protobuf-c -------------------------------------------------------------------------------
proto: $(PROTO_C)
# Generated code is a prerequisite of pattern rules only: keep make from deleting it as an
# intermediate file (which made every build regenerate it and recompile everything).
.SECONDARY: $(PROTO_C) $(PROTO_H)
$(BUILD)/gen/proto/%.pb-c.c $(BUILD)/gen/proto/%.pb-c.h: proto/%.proto | $(DEPS_STAMP)
	@mkdir -p $(BUILD)/gen
	protoc-c --c_out=$(BUILD)/gen $<

# ---- build id: rewritten only when the commit (or dirtiness) changes -------------------------
BUILD_ID := 0.1.0+$(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$(shell git diff --quiet HEAD -- 2>/dev/null || echo -dirty)
$(shell mkdir -p $(BUILD)/gen && echo '#define MM_BUILD_ID "$(BUILD_ID)"' > $(BUILD)/gen/build_id.h.tmp && \
  (cmp -s $(BUILD)/gen/build_id.h.tmp $(BUILD)/gen/build_id.h || mv $(BUILD)/gen/build_id.h.tmp $(BUILD)/gen/build_id.h); \
  rm -f $(BUILD)/gen/build_id.h.tmp)
# The same for the compile flags: objects depend on this file, so changed flags (SAN_FLAGS, OPT,
# EXTRA_CFLAGS) rebuild them instead of linking objects compiled with the old ones.
FLAGS_STAMP := $(BUILD)/gen/flags
$(shell mkdir -p $(BUILD)/gen && echo '$(CFLAGS)' > $(FLAGS_STAMP).tmp && \
  (cmp -s $(FLAGS_STAMP).tmp $(FLAGS_STAMP) || mv $(FLAGS_STAMP).tmp $(FLAGS_STAMP)); \
  rm -f $(FLAGS_STAMP).tmp)

# ---- objects ---------------------------------------------------------------------------------
$(BUILD)/obj/%.o: %.c $(PROTO_H) $(FLAGS_STAMP) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# Generated protobuf code is not ours: compile it without -Werror's stricter warnings.
$(BUILD)/gen/proto/%.pb-c.o: $(BUILD)/gen/proto/%.pb-c.c $(FLAGS_STAMP)
	$(CC) -std=c11 -D_GNU_SOURCE -g $(OPT) -fPIC $(SAN_FLAGS) -I$(BUILD)/gen -c $< -o $@

$(LIB): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	@rm -f $@
	ar rcs $@ $^

# ---- binaries --------------------------------------------------------------------------------
define daemon_rule
$(BUILD)/bin/moemesh-$(1): $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard services/$(1)/*.c)) $(LIB)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(LDFLAGS) -o $$@ $$^ $$(LDLIBS)
endef
$(foreach d,$(DAEMONS),$(eval $(call daemon_rule,$(d))))

$(BUILD)/bin/moemesh: $(patsubst %.c,$(BUILD)/obj/%.o,$(TOOL_SRCS)) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# every test binary depends on the tests' shared headers (mm_test.h, kernels/gpu_test.h, ...)
TEST_HDRS := $(shell find tests -name '*.h')
$(BUILD)/tests/%: tests/%.c $(TEST_HDRS) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< $(LIB) $(LDFLAGS) $(LDLIBS)

test-bins: $(TEST_BINS)

# ---- GPU rules ---------------------------------------------------------------------------------
$(BUILD)/obj/%.cu.o: %.cu $(GPU_HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(GPU_FLAGS) $(CUDA_GENCODE) -Xcompiler -fPIC -c $< -o $@

$(GPU_BENCH): kernels/cuda/bench/bench_gpu.cu $(GPU_HDRS) $(LIB)
	@mkdir -p $(dir $@)
	$(NVCC) $(GPU_FLAGS) $(CUDA_GENCODE) -o $@ $< $(LIB) -cudart static -ljansson -lm

cuda:
	@test -x $(NVCC) || { echo "cuda: $(NVCC) not found (set NVCC=/path/to/nvcc)"; exit 1; }
	$(MAKE) CUDA=1 BUILD=build/cuda all test-bins build/cuda/bin/moemesh-gpu-bench

HIP_BUILD ?= build/hip
HIP_OBJS := $(patsubst %.cu,$(HIP_BUILD)/obj/%.o,$(GPU_SRCS))
hip: $(HIP_OBJS)
	@rm -f $(HIP_BUILD)/libmoemesh_hip.a
	ar rcs $(HIP_BUILD)/libmoemesh_hip.a $(HIP_OBJS)
	@echo "hip: kernels/cuda compiled for gfx90a and gfx1030 into $(HIP_BUILD)/libmoemesh_hip.a"

# hipcc is only needed here, so it is installed by this target, not by `make deps`. Without
# --offload-arch hipcc probes for a GPU and silently builds gfx803 (DEPENDENCIES.md section 5).
$(HIP_BUILD)/.hipcc-ok:
	@command -v $(HIPCC) >/dev/null || { echo "hip: installing hipcc"; \
	  if [ "$$(id -u)" != 0 ]; then SUDO=sudo; fi; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends hipcc >/dev/null; }
	@mkdir -p $(dir $@) && touch $@

$(HIP_BUILD)/obj/%.o: %.cu $(GPU_HDRS) | $(HIP_BUILD)/.hipcc-ok
	@mkdir -p $(dir $@)
	$(HIPCC) -x hip -DMM_USE_HIP $(HIP_ARCHS) $(filter-out -I$(BUILD)/gen,$(GPU_FLAGS)) -Ibuild/gen -fPIC -c $< -o $@

# ---- run and test ----------------------------------------------------------------------------
run: all
	$(BUILD)/bin/moemesh up --model tests/fixtures/models/qwen3moe-tiny --port $(PORT)

test: all test-bins
	@BUILD=$(BUILD) bash tests/run.sh

# rdma:// on soft-RoCE: boots Debian's 6.1 kernel under qemu (TCG) with rdma_rxe and runs the
# transport conformance suite, tests/rdma and the whole mesh over rdma:// there
# (tests/rdma/suite.sh, vm.sh; installs qemu-system-x86, busybox-static, cpio if missing).
# `make test` runs it without the mesh as tests/rdma/softroce_test.sh.
# BENCH=1 adds the rdma/shm/tcp rows of docs/BENCHMARKS.md; TESTS=substring filters cases.
.PHONY: test-rdma
test-rdma: all test-bins
	tests/rdma/suite.sh $(BUILD) "$(TESTS)" $(if $(BENCH),bench,nobench) mesh

# Two-box rehearsal in two network namespaces (root; deploy/twobox.sh says what it shows). Exit
# 77 there means parts did not run (printed as SKIP); make reports that as success.
test-twobox: all
	@BIN=$(BUILD)/bin bash deploy/twobox.sh; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 77 ]

# Sanitizer suites (not part of `make test`): every case's limit is scaled (ASan+UBSan at -O1
# runs the model math several times slower), and any sanitizer report from any process of a case
# — a daemon's LeakSanitizer report at its exit included — fails that case (tests/run.sh).
SAN_ASAN_OPTIONS  := detect_leaks=1:abort_on_error=1
SAN_UBSAN_OPTIONS := print_stacktrace=1:halt_on_error=1
asan:
	ASAN_OPTIONS=$(SAN_ASAN_OPTIONS) UBSAN_OPTIONS=$(SAN_UBSAN_OPTIONS) MM_TEST_SANITIZER=1 \
	MM_TEST_TIMEOUT_SCALE=$${MM_TEST_TIMEOUT_SCALE:-4} $(MAKE) BUILD=build/asan SAN=address OPT=-O1 test

ubsan:
	UBSAN_OPTIONS=$(SAN_UBSAN_OPTIONS) MM_TEST_SANITIZER=1 \
	MM_TEST_TIMEOUT_SCALE=$${MM_TEST_TIMEOUT_SCALE:-2} $(MAKE) BUILD=build/ubsan SAN=undefined OPT=-O1 test

# Installs binaries, launcher, systemd units and docs (deploy/install.sh; see docs/OPERATIONS.md).
PREFIX ?= /usr/local
install: all
	BIN=$(BUILD)/bin PREFIX=$(PREFIX) DESTDIR=$(DESTDIR) bash deploy/install.sh

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
