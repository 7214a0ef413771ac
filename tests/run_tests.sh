#!/usr/bin/env bash
# Runs every CPU test and ends with one line "N passed, N failed".
#   tests/run_tests.sh BUILD_DIR     (KDA_CASES: the reference cases; KDA_QUICK=1, the sanitizers' run:
#                                     no header builds, kernel loading or compare_fla checks)
set -u
build=${1:-build}
cases=${KDA_CASES:-../shared/cases}
pass=0; fail=0
ok()  { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }
# counted NAME COMMAND...: a test program or script that ends with "N passed, N failed": its
# counts added, its FAIL lines shown; no count line, or a failing exit without a failed
# check, fails
counted() {
    local name=$1 out line p f rc
    shift
    out=$("$@" 2>&1); rc=$?
    echo "$out" | grep -E '^FAIL' || true
    line=$(echo "$out" | tail -n 1)
    echo "$name: $line"
    p=$(echo "$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\1/p')
    f=$(echo "$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\2/p')
    if [ -z "$p" ]; then bad "$name did not finish (exit $rc)"; echo "$out" | tail -n 20; return; fi
    pass=$((pass + p)); fail=$((fail + f))
    [ "$rc" -eq 0 ] || [ "$f" -gt 0 ] || bad "$name exit $rc"
}

# 1. The header alone: C++ and clang builds, single-threaded build, no warnings.
if [ -z "${KDA_QUICK:-}" ]; then
    tmp=$(mktemp -d)
    printf '#define KDA_IMPLEMENTATION\n#include "%s/kda.h"\nint main(void){return kda_dtype_size(KDA_BF16)==2?0:1;}\n' "$PWD" > "$tmp/u.c"
    cp "$tmp/u.c" "$tmp/u.cpp"
    ${CXX:-c++} -Wall -Wextra -Werror -O2 -o "$tmp/cxx" "$tmp/u.cpp" -lpthread -ldl && "$tmp/cxx" && ok || bad "kda.h as C++"
    if command -v clang >/dev/null; then
        clang -std=c11 -Wall -Wextra -Werror -O2 -o "$tmp/cl" "$tmp/u.c" -lm -lpthread -ldl && "$tmp/cl" && ok || bad "kda.h with clang"
    fi
    # the CPU core is strict ISO C11 (the CUDA part has kernel sources longer than -pedantic's 4095)
    ${CC:-cc} -std=c11 -Wall -Wextra -Werror -pedantic -O2 -DKDA_NO_THREADS -DKDA_NO_CUDA -o "$tmp/nt" "$tmp/u.c" -lm -ldl && "$tmp/nt" && ok || bad "kda.h with KDA_NO_THREADS KDA_NO_CUDA -pedantic"
    ${CC:-cc} -std=c11 -Wall -Wextra -Werror -O2 -DKDA_NO_THREADS -o "$tmp/nt2" "$tmp/u.c" -lm -ldl && "$tmp/nt2" && ok || bad "kda.h with KDA_NO_THREADS"
    rm -rf "$tmp"
fi

# 2. Unit and property programs: each prints "N passed, N failed" last. test_gpu_stages
#    runs every CUDA kernel on the CPU emulator against its CPU twin.
for t in test_props test_stages test_errors test_gpu_stages; do
    counted "$t" "$build/$t"
done

# 3. The kernel loading path (cache, AOT, embedded cubins, generator) without a GPU.
if [ -z "${KDA_QUICK:-}" ]; then
    counted test_jit tests/test_jit.sh "$build"
fi

# 3b. make test-gpu's runner (tests/run_gpu_tests.sh), with stand-in programs: its counts,
#     exit status, step selection and no-GPU exit.
counted test_gpu_runner tests/test_gpu_runner.sh

# 4. bench/compare_fla.py's ctypes mirrors of kda.h's structs and its inputs (the softplus
#    gate's A_log and dt_bias among them), through the CPU backend against numpy: what the
#    GPU comparison with FLA relies on, checked where there is no GPU.
if [ -z "${KDA_QUICK:-}" ]; then
    out=$(${PYTHON:-python3} bench/compare_fla.py --lib "$build/libkda.so" --selftest-cpu 2>&1)
    if [ "$(echo "$out" | tail -n 1)" = "selftest-cpu: PASS" ]; then ok; else bad "compare_fla.py --selftest-cpu"; echo "$out" | tail -n 20; fi
fi

# 4a. bench/ncu_phases.py's report (phases, stall shares, heaviest instructions) on a made-up
#     ncu source page whose figures are known: the profiler's reading, checked without a GPU.
if [ -z "${KDA_QUICK:-}" ]; then
    out=$(${PYTHON:-python3} bench/ncu_phases.py --selftest 2>&1)
    if [ "$(echo "$out" | tail -n 1)" = "selftest: PASS" ]; then ok; else bad "ncu_phases.py --selftest"; echo "$out" | tail -n 20; fi
fi

# 4a'. bench/ptx_blocks.py reads a kernel's source out of kernels_generated/, compiles it to PTX
#     through NVRTC (with kda.h's options, from kda-aot) and ptxas, and finds no block that
#     differs between a tree and itself.
if [ -z "${KDA_QUICK:-}" ]; then
    out=$(${PYTHON:-python3} bench/ptx_blocks.py --aot "$build/kda-aot" kda_gate_cumsum_bt16_gatenone . 2>&1)
    echo "$out" | grep -q '^\.: [1-9][0-9]* PTX lines; ptxas: .*bytes spill stores' &&
        [ "$(echo "$out" | tail -n 1 | sed 's/^blocks \([0-9]*\) and \1; 0 (0 instructions) only in the first, 0 (0) only in the second$/same/')" = same ] &&
        ok || { bad "ptx_blocks.py kda_gate_cumsum_bt16_gatenone ."; echo "$out" | tail -n 20; }
fi

# 4a''. bench/wgmma_chain.py (the state warps' wgmma round trips, bench/RESULTS.md) renders and
#     compiles for sm_90a with nvcc: the benchmark a GPU run needs stays buildable.
if [ -z "${KDA_QUICK:-}" ]; then
    out=$(${PYTHON:-python3} bench/wgmma_chain.py --compile-only 2>&1)
    [ "$(echo "$out" | tail -n 1)" = "compiled for sm_90a" ] && ok || { bad "wgmma_chain.py --compile-only"; echo "$out" | tail -n 20; }
fi

# 4a'''. bench/graph_if_probe (a CUDA graph's IF node around the fused forward's exact passes,
#     bench/RESULTS.md): its kernels compile for sm_90a without relocatable code, its host side
#     against the driver API's stubs, so that a GPU run of it needs no fixing first.
if [ -z "${KDA_QUICK:-}" ]; then
    cu=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}
    out=$("$cu/bin/nvcc" -arch=sm_90a -cubin -o "$build/graph_if_probe.cubin" bench/graph_if_probe.cu 2>&1 &&
        ${CC:-cc} -Wall -Wextra -Werror -I"$cu/include" -o "$build/graph_if_probe" bench/graph_if_probe.c -L"$cu/lib64/stubs" -lcuda 2>&1) &&
        ok || { bad "bench/graph_if_probe: nvcc / cc"; echo "$out" | tail -n 20; }
fi

# 4b. kda-bench on the CPU times the shape and operations asked for, and refuses the GPU's own
#     options rather than printing its default table without them.
if [ -z "${KDA_QUICK:-}" ]; then
    out=$("$build/kda-bench" --device cpu --reps 1 --ops fwd --shape 2,63,3,60,40 2>&1)
    [ "$(echo "$out" | wc -l)" -eq 1 ] && echo "$out" | grep -q '"op":"fwd","shape":{"B":2,"T":63,"H":3,"K":60,"V":40,"varlen":null}' &&
        ok || { bad "kda-bench --device cpu --ops fwd --shape 2,63,3,60,40"; echo "$out"; }
    out=$("$build/kda-bench" --device cpu --reps 1 --ops bwd --shape 1,100,2,64,64 --seqlens 37,63 2>&1)
    [ "$(echo "$out" | wc -l)" -eq 1 ] && echo "$out" | grep -q '"op":"bwd","shape":{"B":1,"T":100,"H":2,"K":64,"V":64,"varlen":\[0,37,100\]}' &&
        ok || { bad "kda-bench --device cpu --ops bwd --seqlens 37,63"; echo "$out"; }
    out=$("$build/kda-bench" --device cpu --gate kimi 2>&1) && bad "kda-bench --device cpu --gate kimi ran" ||
        { echo "$out" | grep -q -- "--gate is for --device gpu only" && ok || { bad "kda-bench --device cpu --gate kimi: $out"; }; }
fi

# 5. Every reference case, every dtype and chunk size (kda-case prints PASS/FAIL last).
if [ ! -d "$cases" ]; then
    bad "reference cases not found at $cases (set KDA_CASES)"
else
    n=0
    for dir in "$cases"/*/; do
        for dt in f32 f16 bf16; do
            for ch in 16 32 64; do
                out=$("$build/kda-case" "$dir" --dtype "$dt" --chunk "$ch" 2>&1)
                if [ "$(echo "$out" | tail -n 1)" = PASS ]; then ok; else bad "kda-case $dir --dtype $dt --chunk $ch"; echo "$out" | grep -v ' ok$'; fi
                n=$((n + 1))
            done
        done
    done
    echo "kda-case: $n runs over $(ls -d "$cases"/*/ | wc -l) cases"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
