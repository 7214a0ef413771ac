#!/usr/bin/env bash
# The GPU tests (make test-gpu). Without a GPU: says so and exits 0. Ends with
# "N passed, N failed" and writes BUILD/GPU_RESULTS.md (device, date, commands, counts).
# KDA_GPU_STEPS="racecheck memcheck ..." runs only those steps (of: kernels generic props
# stress cases memcheck racecheck; default all): the whole takes about 13 minutes on an
# H200, so a session with shorter calls can run it in two parts.
set -u
build=${1:-build}
all=" kernels generic props stress cases memcheck racecheck "
steps=" ${KDA_GPU_STEPS:-$all} "
want() { [[ "$steps" == *" $1 "* ]]; }
for s in $steps; do
    [[ "$all" == *" $s "* ]] || { echo "KDA_GPU_STEPS: no step '$s'"; exit 2; }
done
cases=${KDA_CASES:-../shared/cases}
log="$build/gpu_tests.log"
: > "$log"
probe=$("$build/test_gpu" --quick prepare 2>&1); rc=$?
if [ $rc = 3 ]; then
    echo "no GPU here ($(echo "$probe" | head -n 1)); the GPU tests need one. Nothing run."
    exit 0
fi
pass=0; fail=0
summary=()
run() { # name, command...: a program that ends with "N passed, N failed"
    local name=$1; shift
    local out; out=$("$@" 2>&1); local rc=$?
    echo "$out" >> "$log"
    echo "$out" | grep -E '^FAIL' | head -n 20
    local line; line=$(echo "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -z "$line" ]; then fail=$((fail + 1)); line="did not finish (exit $rc)"; echo "$out" | tail -n 15;
    else pass=$((pass + ${line%% passed*})); f=${line#*passed, }; fail=$((fail + ${f%% failed})); fi
    # a sanitizer reports through the exit status and its summary line
    if [ $rc != 0 ]; then fail=$((fail + 1)); line="$line; exit status $rc"; fi
    local sumline; sumline=$(echo "$out" | grep -E '(ERROR|RACECHECK) SUMMARY' | tail -n 1 | sed 's/^=* *//')
    [ -n "$sumline" ] && line="$line; $sumline"
    echo "$name: $line"
    summary+=("| $name | \`$*\` | $line |")
}
want kernels && run "every kernel vs its CPU twin, whole ops" "$build/test_gpu"
# the fused forward's generic kernels (the gate read at run time: kda_compile_kernel's, and
# ahead-of-time cubins made without SPECS); the run above takes kda.h's specialisations
want generic && run "the fused forward, generic kernels (KDA_SPECIALIZE=0)" env KDA_SPECIALIZE=0 "$build/test_gpu" --quick fused
want props && run "properties and finite-difference gradients on the GPU" "$build/test_props_gpu"
want stress && run "numerical stress" "$build/test_gpu_stress"
# every reference case, every dtype and chunk size, on the GPU
if want cases; then
    n=0; nf=0
    for dir in "$cases"/*/; do
        for dt in f32 f16 bf16; do
            for ch in 16 32 64; do
                out=$("$build/kda-case" "$dir" --device gpu --dtype $dt --chunk $ch 2>&1)
                echo "== kda-case $dir $dt $ch" >> "$log"; echo "$out" >> "$log"
                n=$((n + 1))
                if [ "$(echo "$out" | tail -n 1)" != PASS ]; then nf=$((nf + 1)); echo "FAIL: kda-case $dir --dtype $dt --chunk $ch"; echo "$out" | grep -v ' ok$'; fi
            done
        done
    done
    pass=$((pass + n - nf)); fail=$((fail + nf))
    echo "kda-case --device gpu: $((n - nf)) passed, $nf failed"
    summary+=("| reference cases | \`kda-case CASE --device gpu --dtype {f32,f16,bf16} --chunk {16,32,64}\` | $((n - nf)) passed, $nf failed ($n runs) |")
fi
# compute-sanitizer: memory errors on forward, backward and decode; shared-memory races
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if ! want memcheck && ! want racecheck; then
    :
elif [ -n "$san" ]; then
    want memcheck && run "compute-sanitizer memcheck" "$san" --tool memcheck --error-exitcode 9 "$build/test_gpu" --quick
    # racecheck leaves out fwd_fused: its factor warps hand buffers to the state warps
    # with bar.arrive -> bar.sync (a producer/consumer pattern the PTX ISA documents),
    # and a factor group's warps share a chunk through the group's own bar.sync of 128
    # threads; racecheck models neither and reports every such write/read pair as a
    # hazard (tests/GPU_RESULTS.md). make test-race checks the kernel for races instead (the emulator under
    # ThreadSanitizer, in CI); memcheck above covers its accesses. Its pairs kernels
    # (Hopper clusters) stay off here: racecheck fails on a kernel that copies into another
    # block's shared memory and is left out of its checks (tests/cluster_racecheck_probe.cu
    # shows it in 30 lines), and instrumenting them trips on the named barriers as above.
    want racecheck && run "compute-sanitizer racecheck (all kernels but fwd_fused)" env KDA_FUSED_PAIRS=0 "$san" --tool racecheck --racecheck-report all \
        --kernel-name-exclude kns=fwd_fused --error-exitcode 9 "$build/test_gpu" --quick
else
    fail=$((fail + 1)); echo "FAIL: compute-sanitizer not found"
fi
dev=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
# the commit, and whether the tracked files differ from it (a copy of a working tree, as a
# remote GPU machine gets, may carry an older .git); KDA_COMMIT names it instead
commit=${KDA_COMMIT:-$(c=$(git rev-parse --short HEAD 2>/dev/null) && { git diff --quiet HEAD -- 2>/dev/null && echo "$c" || echo "$c with uncommitted changes"; } || echo unknown)}
{
    echo "# GPU test results"
    echo
    echo "Device: ${dev:-unknown}. Date: $(date -u +%Y-%m-%d). Commit: $commit."
    echo "Command: \`${KDA_GPU_STEPS:+KDA_GPU_STEPS=\"$KDA_GPU_STEPS\" }make test-gpu\` (tests/run_gpu_tests.sh)."
    echo
    echo "| what | command | result |"
    echo "|---|---|---|"
    printf '%s\n' "${summary[@]}"
    echo
    echo "Total: $pass passed, $fail failed."
} > "$build/GPU_RESULTS.md"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
