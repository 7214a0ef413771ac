# kda - build, test and benchmark. Everything builds from the one header.
#   make demo        the demo on the embedded default problem (GPU if present, else CPU)
#   make test        every test that needs no GPU (what CI runs); make test-sanitize: under ASan+UBSan
#   make test-race   the fused forward's kernel in the emulator under ThreadSanitizer (CI runs it)
#   make test-gpu    the GPU tests (says so and exits 0 where there is no GPU)
#   make nvrtc-check every kernel compiled for sm_80 and sm_90a; make gen: regenerate kernels_generated/
#   make bench       CPU throughput (JSON lines)
CC      ?= cc
CXX     ?= c++
# 512-bit vectors where the compiler takes the flag (the CPU GEMM tiles for them)
OPT     ?= -O3 -march=native $(shell $(CC) -mprefer-vector-width=512 -E -x c /dev/null >/dev/null 2>&1 && echo -mprefer-vector-width=512)
WARN     = -std=c11 -Wall -Wextra -Werror
LDLIBS   = -lm -lpthread -ldl
BUILD   ?= build
KDA_CASES ?= ../shared/cases
export KDA_CASES

TOOLS = $(BUILD)/kda-case $(BUILD)/kda-bench $(BUILD)/demo
UNITS = $(BUILD)/test_props $(BUILD)/test_stages $(BUILD)/test_errors

.PHONY: test-gpu deps all demo test test-sanitize test-race bench clean gen gen-check nvrtc-check ptxas-baseline cubins
all: $(TOOLS) $(UNITS) $(BUILD)/test_gpu_stages

# the tools embed the kernels (kda.h includes kernels_generated/kda_kernels.h)
$(BUILD)/kda-case: tests/kda_case.c tests/npy.h kda.h kernels_generated/kda_kernels.h
$(BUILD)/kda-bench: bench/kda_bench.c kda.h kernels_generated/kda_kernels.h
$(BUILD)/demo: examples/demo.c kda.h kernels_generated/kda_kernels.h
$(BUILD)/test_props: tests/test_props.c tests/testlib.h tests/naive.h kda.h
$(BUILD)/test_stages: tests/test_stages.c tests/testlib.h kda.h
$(BUILD)/test_errors: tests/test_errors.c tests/testlib.h kda.h
$(TOOLS) $(UNITS):
	@mkdir -p $(dir $@)
	$(CC) $(WARN) $(OPT) $(CFLAGS) -o $@ $< $(LDLIBS)

# Every kernel as C++ for the CPU emulator (tests/cuda_emu.h), in shards that make -j builds
# at once, and the test that runs each one against its CPU twin through kda.h's device
# backend code.
PYTHON  ?= python3
TEMPLATES = $(wildcard templates/*.j2) gen/kda_gen.py gen/table.py
EMU_SHARDS = 0 1 2 3
EMU_CXX = $(CXX) -std=c++20 -O1 -DKDA_TEST_EMU $(SAN) -Wall -Wextra -Wno-unused-function -Wno-missing-field-initializers \
          -Wno-unknown-pragmas $(CFLAGS) -pthread
build/emu/kernels_emu.inc kernels_generated/kda_kernels.h: $(TEMPLATES)
	@mkdir -p $(dir $@)
	$(PYTHON) gen/kda_gen.py --allow-missing --emu build/emu/kernels_emu.inc --emu-shards $(words $(EMU_SHARDS)) >/dev/null
$(BUILD)/emu/shard%.o: tests/emu_shard.cpp tests/cuda_emu.h build/emu/kernels_emu.inc
	@mkdir -p $(dir $@)
	$(EMU_CXX) -DKDA_EMU_SHARD=$* -c -o $@ $<
$(BUILD)/emu/test_gpu_stages.o: tests/test_gpu_stages.cpp tests/cuda_emu.h tests/testlib.h kda.h build/emu/kernels_emu.inc
	@mkdir -p $(dir $@)
	$(EMU_CXX) -c -o $@ $<
$(BUILD)/test_gpu_stages: $(BUILD)/emu/test_gpu_stages.o $(foreach s,$(EMU_SHARDS),$(BUILD)/emu/shard$(s).o)
	$(EMU_CXX) -o $@ $^ $(LDLIBS)
# the same test on the machine's GPU
$(BUILD)/test_gpu: tests/test_gpu_stages.cpp tests/testlib.h kda.h kernels_generated/kda_kernels.h
	@mkdir -p $(dir $@)
	$(CXX) -std=c++20 -O2 -Wall -Wextra -Wno-unused-function -Wno-missing-field-initializers $(CFLAGS) -pthread -o $@ $< $(LDLIBS)

# Regenerate kernels_generated/ from templates/ (Jinja2: pip install -r gen/requirements.txt).
gen:
	$(PYTHON) gen/kda_gen.py
gen-check:
	$(PYTHON) gen/kda_gen.py --check

# Compile every kernel of the table through kda.h's NVRTC path (no GPU needed).
$(BUILD)/kda-aot: gen/kda_aot.c kda.h kernels_generated/kda_kernels.h
	@mkdir -p $(dir $@)
	$(CC) $(WARN) -O2 $(CFLAGS) -o $@ $< $(LDLIBS)
NVRTC_ARCH ?= sm_80 sm_90a
# With ptxas's spill code checked against gen/ptxas_baseline.txt (kda-aot's --ptxas-baseline),
# for the generic kernels and the fused forward's specialisations the benchmarks run (g as
# given and the softplus gate, fp32 g): spill code that grows fails, as does a serialised wgmma.
# After a change that removes spill code, or with another NVRTC: make ptxas-baseline
PTXAS_SPECS = --spec 0,0 --spec 1,0
nvrtc-check: $(BUILD)/kda-aot
	./$(BUILD)/kda-aot --arch "$(NVRTC_ARCH)" $(PTXAS_SPECS) --ptxas-baseline gen/ptxas_baseline.txt
ptxas-baseline: $(BUILD)/kda-aot
	./$(BUILD)/kda-aot --arch "$(NVRTC_ARCH)" $(PTXAS_SPECS) --ptxas-write gen/ptxas_baseline.txt
# Ahead-of-time cubins for KDA_CUBIN_DIR (and kda_cubins.h for KDA_EMBED_CUBINS):
#   make cubins ARCH="80 90a" [KERNELS="kda_state_bt64_bk128_bv32 ..."] [SPECS="1,0 0,0"]
# SPECS: the fused forward's specialisations for these gate forms and g dtypes (kda_gate,
# kda_dtype numbers: "1,0" is the softplus gate with fp32 g), which kda.h takes instead of
# the generic kernels (0-7% slower) where a problem has that gate and g dtype
ARCH ?= 90a
cubins: $(BUILD)/kda-aot
	./$(BUILD)/kda-aot --arch "$(ARCH)" --out $(BUILD)/cubins --embed $(BUILD)/cubins/kda_cubins.h \
	    $(foreach k,$(KERNELS),--only $(k)) $(foreach s,$(SPECS),--spec $(s))

demo: $(BUILD)/demo
	./$(BUILD)/demo

test: deps $(TOOLS) $(UNITS) $(BUILD)/test_gpu_stages $(BUILD)/test_jit $(BUILD)/kda-aot $(BUILD)/libkda.so
	CC="$(CC)" CXX="$(CXX)" PYTHON="$(PYTHON)" tests/run_tests.sh $(BUILD)

# Jinja2 for the generator check, numpy for compare_fla.py's CPU check of its ctypes mirrors
# (the library itself needs no Python)
deps:
	@$(PYTHON) -c "import jinja2" 2>/dev/null || $(PYTHON) -m pip install -q -r gen/requirements.txt
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PYTHON) -m pip install -q numpy

# The same programs under AddressSanitizer and UndefinedBehaviorSanitizer, every emulator test
# included (82 s here). Build time is most of it: -g1 gives the line tables the reports need;
# UBSan's object-size (AddressSanitizer's job here), pointer-overflow and vptr checks (no
# classes) made the emulator's kernels build 40% slower.
SAN_FLAGS = -g1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize=object-size,pointer-overflow,vptr \
            -fno-sanitize-recover=all
test-sanitize:
	$(MAKE) BUILD=build/san OPT="-O1 $(SAN_FLAGS)" SAN="$(SAN_FLAGS)" \
	    $(addprefix build/san/,kda-case test_props test_stages test_errors test_gpu_stages)
	KDA_QUICK=1 tests/run_tests.sh build/san

# The fused forward in the emulator under ThreadSanitizer: its warps hand shared-memory
# buffers to each other through named barriers, which compute-sanitizer's racecheck does
# not model; here an access that no barrier orders against another thread's write of
# the same bytes (cp.async's included: they land at the wait) stops the run. The whole
# operations of the two quick problems (ops: the staged kernels and the recurrence, 15 s)
# run too: a __syncthreads taken out of the recurrence's state store is reported. The probe,
# a kernel with such an access, must be reported: the emulator's fibers order nothing themselves.
test-race:
	$(MAKE) BUILD=build/race SAN="-g1 -fsanitize=thread" build/race/test_gpu_stages
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" ./build/race/test_gpu_stages --quick --race fused emulator ops
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" ./build/race/test_gpu_stages --race-probe >/dev/null 2>&1; \
	    rc=$$?; [ $$rc -eq 66 ] && echo "race probe: reported" || { echo "FAIL: race probe exit $$rc, not ThreadSanitizer's report (66)"; exit 1; }

bench: $(BUILD)/kda-bench
	./$(BUILD)/kda-bench --device cpu

clean:
	rm -rf build

# The kernel loading path (cache, AOT, NVRTC) without a GPU; tests/test_jit.sh drives it.
$(BUILD)/test_jit: tests/test_jit.c kda.h kernels_generated/kda_kernels.h
	@mkdir -p $(dir $@)
	$(CC) $(WARN) -O2 $(CFLAGS) -o $@ $< $(LDLIBS)
$(BUILD)/test_props_gpu: tests/test_props.c tests/gpu_shim.h tests/testlib.h tests/naive.h kda.h kernels_generated/kda_kernels.h
	@mkdir -p $(dir $@)
	$(CC) $(WARN) -O2 -DKDA_TEST_GPU $(CFLAGS) -o $@ $< $(LDLIBS)
$(BUILD)/test_gpu_stress: tests/test_gpu_stress.c tests/testlib.h kda.h kernels_generated/kda_kernels.h
	@mkdir -p $(dir $@)
	$(CC) $(WARN) -O2 $(CFLAGS) -o $@ $< $(LDLIBS)

# On a machine with a GPU: every kernel against its CPU twin, every reference case,
# numerical stress, compute-sanitizer; writes build/GPU_RESULTS.md. Without a GPU
# it says so and exits 0.
test-gpu: $(BUILD)/test_gpu $(BUILD)/test_props_gpu $(BUILD)/test_gpu_stress $(BUILD)/kda-case
	tests/run_gpu_tests.sh $(BUILD)

# kda.h as a shared library for bench/compare_fla.py (ctypes; FLA comparison on a GPU)
$(BUILD)/libkda.so: bench/libkda.c kda.h kernels_generated/kda_kernels.h
	@mkdir -p $(dir $@)
	$(CC) $(WARN) -O3 -fPIC -shared $(CFLAGS) -o $@ $< $(LDLIBS)
