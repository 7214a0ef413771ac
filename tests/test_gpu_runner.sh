#!/usr/bin/env bash
# tests/run_gpu_tests.sh (make test-gpu) without a GPU: stand-in programs that print what
# the real ones print, so that its counting, its exit status, KDA_GPU_STEPS and its no-GPU
# exit are checked where CI runs. Ends with "N passed, N failed".
set -u
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
b="$tmp/build"
mkdir -p "$b" "$tmp/bin" "$tmp/cases/one"
# a test program: "3 passed, 0 failed", or what STUB_<name> says (fail: one failed; crash:
# no count line, exit 1; none: no GPU, exit 3 as test_gpu's probe does)
for t in test_gpu test_props_gpu test_gpu_stress; do
    cat > "$b/$t" <<EOF
#!/usr/bin/env bash
case "\${STUB_$t:-}" in
fail) echo "FAIL: made up"; echo "2 passed, 1 failed"; exit 1 ;;
crash) echo "Segmentation fault"; exit 139 ;;
none) echo "no CUDA device"; exit 3 ;;
*) echo "3 passed, 0 failed" ;;
esac
EOF
done
printf '#!/bin/sh\necho PASS\n' > "$b/kda-case"
# compute-sanitizer: runs the program after its options, then its summary line
cat > "$tmp/bin/compute-sanitizer" <<'EOF'
#!/usr/bin/env bash
while [ "$1" != --error-exitcode ]; do shift; done
shift 2
"$@"; rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
EOF
chmod +x "$b"/* "$tmp/bin/compute-sanitizer"
runner() { PATH="$tmp/bin:$PATH" KDA_CASES="$tmp/cases" tests/run_gpu_tests.sh "$b" 2>&1; }

out=$(runner); rc=$?
check "every step runs by default and passes" '[ $rc = 0 ] && [ "$(echo "$out" | tail -n 1)" = "27 passed, 0 failed" ]'
check "the results file lists the seven steps" '[ "$(grep -c "^| [a-z]" "$b/GPU_RESULTS.md")" = 8 ]'
out=$(KDA_GPU_STEPS="cases racecheck" runner); rc=$?
check "KDA_GPU_STEPS runs only its steps" '[ $rc = 0 ] && [ "$(echo "$out" | tail -n 1)" = "12 passed, 0 failed" ] && ! echo "$out" | grep -q memcheck'
check "and the results file names them" 'grep -q "KDA_GPU_STEPS=\"cases racecheck\" make test-gpu" "$b/GPU_RESULTS.md"'
KDA_COMMIT=abc1234 runner > /dev/null
check "KDA_COMMIT names the commit in the results file" 'grep -q "Commit: abc1234\." "$b/GPU_RESULTS.md"'
out=$(KDA_GPU_STEPS="cases racechek" runner); rc=$?
check "an unknown step is an error" '[ $rc = 2 ] && echo "$out" | grep -q "no step .racechek."'
out=$(STUB_test_props_gpu=fail runner); rc=$?
check "a failed test fails the run" '[ $rc != 0 ] && echo "$out" | tail -n 1 | grep -q "^26 passed, [1-9]"'
out=$(STUB_test_gpu_stress=crash runner); rc=$?
check "a program without its count line fails the run" '[ $rc != 0 ] && echo "$out" | grep -q "numerical stress: did not finish (exit 139)"'
out=$(STUB_test_gpu=none runner); rc=$?
check "no GPU: says so and exits 0" '[ $rc = 0 ] && echo "$out" | grep -q "no GPU here" && [ "$(echo "$out" | wc -l)" = 1 ]'
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
