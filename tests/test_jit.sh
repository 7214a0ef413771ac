#!/usr/bin/env bash
# The kernel cache, ahead-of-time cubins and the generator, without a GPU (needs
# NVRTC and Jinja2). Ends with "N passed, N failed".   tests/test_jit.sh BUILD_DIR
set -u
build=${1:-build}
jit="$build/test_jit"
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $1"; fi; }
tmp=$(mktemp -d)
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
K=kda_solve_bt64
K2=kda_gate_cumsum_bt32_gatesoftplus
file_of() { ls "$1"/${2}_sm_90a_*.cubin 2>/dev/null | grep -v '\.tmp\.' | head -n 1; }

# a miss, then a hit, across two processes
export KDA_CACHE_DIR="$tmp/cache"
check "first load is a miss" '[ "$($jit get $K | head -n 1)" = "cache miss" ]'
check "the cache folder is private (0700)" '[ "$(stat -c %a "$tmp/cache")" = 700 ]'
check "second process hits" '[ "$($jit get $K | head -n 1)" = "cache hit" ]'
f=$(file_of "$tmp/cache" $K)
check "cache file named <kernel>_<arch>_<digest>.cubin" '[ -n "$f" ]'

# a corrupted, a truncated and a wrong-key file are each detected and rebuilt
printf '\x55' | dd of="$f" bs=1 seek=4000 conv=notrunc status=none
check "corrupted file is a miss" '[ "$($jit get $K | head -n 1)" = "cache miss" ]'
check "and was rebuilt" '[ "$($jit get $K | head -n 1)" = "cache hit" ]'
truncate -s 3000 "$f"
check "truncated file is a miss" '[ "$($jit get $K | head -n 1)" = "cache miss" ]'
check "and was rebuilt" '[ "$($jit get $K | head -n 1)" = "cache hit" ]'
$jit get $K2 >/dev/null
cp "$(file_of "$tmp/cache" $K2)" "$f"
check "a valid file for another key is a miss" '[ "$($jit get $K | head -n 1)" = "cache miss" ]'
check "and was rebuilt" '[ "$($jit get $K | head -n 1)" = "cache hit" ]'

# 8 processes warming one empty cache at once: all succeed, only valid files remain
export KDA_CACHE_DIR="$tmp/race"
pids=""
for i in 1 2 3 4 5 6 7 8; do $jit get $K2 > "$tmp/race.$i" 2>&1 & pids="$pids $!"; done
ok=1; for p in $pids; do wait $p || ok=0; done
check "8 concurrent processes all succeed" '[ $ok = 1 ]'
check "exactly one cache file, no temp files left" '[ "$(ls "$tmp/race" | wc -l)" = 1 ]'
check "the file left is valid" '[ "$($jit get $K2 | head -n 1)" = "cache hit" ]'

# a cache folder that cannot be created, and one that cannot be written: still works, warns once
touch "$tmp/afile"
export KDA_CACHE_DIR="$tmp/afile/cache"
out=$($jit get $K 2>&1)
check "uncreatable cache folder still compiles" 'echo "$out" | grep -qx "cache miss"'
check "and warns once" '[ "$(echo "$out" | grep -c "compiling in memory only")" = 1 ]'
if [ "$(id -u)" = 0 ]; then ro=/proc/self; else mkdir "$tmp/ro"; chmod 555 "$tmp/ro"; ro="$tmp/ro"; fi
export KDA_CACHE_DIR="$ro"
out=$($jit get $K 2>&1)
check "read-only cache folder still compiles" 'echo "$out" | grep -qx "cache miss"'
check "and warns once" '[ "$(echo "$out" | grep -c "compiling in memory only")" = 1 ]'

# a missing NVRTC gives its status, and the CPU path still works
export KDA_CACHE_DIR="$tmp/nonvrtc"
out=$(KDA_NVRTC_PATH="$tmp/no/libnvrtc.so" $jit get $K 2>&1)
check "missing NVRTC: unsupported, naming KDA_NVRTC_PATH" 'echo "$out" | grep -q "^error unsupported: .*NVRTC is not available.*KDA_NVRTC_PATH"'
check "missing NVRTC: the CPU path still runs" 'echo "$out" | grep -qx "cpu ok"'

# ahead-of-time cubins: found in KDA_CUBIN_DIR without NVRTC; a corrupt one is refused
"$build/kda-aot" --arch sm_90a --only $K --out "$tmp/aot" > /dev/null
check "kda-aot wrote a manifest" 'grep -q "^${K}_sm_90a_" "$tmp/aot/manifest.txt"'
export KDA_CUBIN_DIR="$tmp/aot"
check "AOT cubin loads without NVRTC" '[ "$(KDA_NVRTC_PATH=$tmp/no $jit get $K | head -n 1)" = aot ]'
a=$(file_of "$tmp/aot" $K)
printf '\x55' | dd of="$a" bs=1 seek=2000 conv=notrunc status=none
check "a corrupt AOT cubin is refused" 'KDA_NVRTC_PATH=$tmp/no $jit get $K | head -n 1 | grep -q "^error"'
unset KDA_CUBIN_DIR

# a fused kernel's specialisation for a gate form and g dtype (kda__kspec): a cache file of
# its own; KDA_SPECIALIZE=0 turns it off
F=kda_fwd_fused_dtypebf16_bk64_bv64_varlen0 F2=kda_fwd_fused_dtypef16_bk64_bv64_varlen0
export KDA_CACHE_DIR="$tmp/spec"
check "a specialisation (softplus gate, fp32 g) compiles" '[ "$($jit get $F sm_90a 1 0 | head -n 2 | xargs)" = "cache miss specialised" ]'
check "and is cached" '[ "$($jit get $F sm_90a 1 0 | head -n 1)" = "cache hit" ]'
check "the generic kernel is not that file" '[ "$($jit get $F sm_90a | head -n 1)" = "cache miss" ] && [ "$(ls "$tmp/spec" | wc -l)" = 2 ]'
check "another (lower-bound gate, bf16 g) compiles for sm_80" '[ "$($jit get $F sm_80 2 2 | head -n 2 | xargs)" = "cache miss specialised" ]'
check "KDA_SPECIALIZE=0: the generic kernel" '[ "$(KDA_SPECIALIZE=0 $jit get $F sm_90a 1 0 | head -n 2 | xargs)" = "cache hit generic" ]'
# ahead-of-time cubins: a deployment's specialisations where it brought them, else its
# generic kernels, never a compile (unless KDA_SPECIALIZE=1)
"$build/kda-aot" --arch sm_90a --only $F --spec 1,0 --spec 1,1 --out "$tmp/aotf" > /dev/null
check "kda-aot --spec: the generic kernel and the specialisation (not f16 g for a bf16 kernel)" \
    '[ "$(grep -c "^${F}_sm_90a_" "$tmp/aotf/manifest.txt")" = 2 ] && grep -q "^${F}_sm_90a_.* 1 0$" "$tmp/aotf/manifest.txt"'
export KDA_CUBIN_DIR="$tmp/aotf" KDA_CACHE_DIR="$tmp/spec_aot"
check "a specialisation from its AOT cubin, without NVRTC" '[ "$(KDA_NVRTC_PATH=$tmp/no $jit get $F sm_90a 1 0 | head -n 2 | xargs)" = "aot specialised" ]'
check "another gate without its AOT cubin: the generic one, no compile" \
    '[ "$($jit get $F sm_90a 0 0 | head -n 2 | xargs)" = "aot generic" ] && [ -z "$(ls "$tmp/spec_aot" 2>/dev/null)" ]'
check "KDA_SPECIALIZE=1 compiles it all the same" '[ "$(KDA_SPECIALIZE=1 $jit get $F sm_90a 0 0 | head -n 2 | xargs)" = "cache miss specialised" ]'
check "a kernel the AOT cubins lack: its specialisation compiled" '[ "$($jit get $F2 sm_90a 0 0 | head -n 2 | xargs)" = "cache miss specialised" ]'
unset KDA_CUBIN_DIR
export KDA_CACHE_DIR="$tmp/cache"
check "a kernel outside the fused forward has no specialisations" '[ "$($jit get $K sm_90a 1 0 | head -n 2 | xargs)" = "cache hit generic" ]'

# embedded cubins (KDA_EMBED_CUBINS): no file, no NVRTC
"$build/kda-aot" --arch sm_90a --only $K --only $F --spec 1,0 --out "$tmp/emb" --embed "$tmp/emb/kda_cubins.h" > /dev/null
${CC:-cc} -std=c11 -O1 -DKDA_EMBED_CUBINS -I"$tmp/emb" -o "$tmp/jit_emb" tests/test_jit.c -lm -lpthread -ldl
check "embedded cubin loads with no NVRTC and no files" '[ "$(KDA_NVRTC_PATH=$tmp/no $tmp/jit_emb get $K | head -n 1)" = embedded ]'
check "an embedded specialisation too, beside its generic kernel" \
    '[ "$(KDA_NVRTC_PATH=$tmp/no $tmp/jit_emb get $F sm_90a 1 0 | head -n 2 | xargs)" = "embedded specialised" ] && [ "$(KDA_NVRTC_PATH=$tmp/no $tmp/jit_emb get $F sm_90a | head -n 2 | xargs)" = "embedded generic" ]'

# ptxas's report (make nvrtc-check): its option leaves the key and the code as they were; a baseline that
# kda-aot wrote holds; spill code past a kernel's line fails (a line below any real count: -8
# bytes), unless the baseline is another NVRTC version's, which only reports
"$build/kda-aot" --arch sm_90a --only $K --out "$tmp/pv0" > /dev/null
"$build/kda-aot" --arch sm_90a --only $K --out "$tmp/pv" --ptxas-write "$tmp/pb.txt" > /dev/null
# the code sections of a cubin past kda's header (ptxas's note of its options differs)
text_of() { python3 -c '
import struct, sys
d = open(sys.argv[1], "rb").read(); d = d[d.find(b"\x7fELF"):]
off, = struct.unpack_from("<Q", d, 0x28); es, n, si = struct.unpack_from("<HHH", d, 0x3A)
sh = [struct.unpack_from("<IIQQQQ", d, off + i * es) for i in range(n)]
nm = lambda o: d[sh[si][4] + o:d.index(b"\0", sh[si][4] + o)]
sys.stdout.write("".join(nm(s[0]).decode() + d[s[4]:s[4] + s[5]].hex() + "\n" for s in sh if nm(s[0]).startswith(b".text")))' "$1"; }
check "--ptxas-check: the same key and code as without it" \
    '[ -n "$(file_of "$tmp/pv" $K)" ] && [ "$(basename "$(file_of "$tmp/pv0" $K)")" = "$(basename "$(file_of "$tmp/pv" $K)")" ] && [ -n "$(text_of "$(file_of "$tmp/pv" $K)")" ] && [ "$(text_of "$(file_of "$tmp/pv0" $K)")" = "$(text_of "$(file_of "$tmp/pv" $K)")" ]'
check "a baseline that kda-aot wrote holds" '"$build/kda-aot" --arch sm_90a --only $K --ptxas-baseline "$tmp/pb.txt" > /dev/null'
{ grep '^nvrtc ' "$tmp/pb.txt"; echo "$K sm_90a -1 -1 -8 -8"; } > "$tmp/pb_low.txt"
"$build/kda-aot" --arch sm_90a --only $K --ptxas-baseline "$tmp/pb_low.txt" > "$tmp/pb_low.out"; rc=$?
check "spill code past the baseline fails" '[ $rc = 1 ] && grep -q "^FAILED $K sm_90a .*more spill code" "$tmp/pb_low.out"'
sed 's/^nvrtc .*/nvrtc 0.0/' "$tmp/pb_low.txt" > "$tmp/pb_other.txt"
check "another NVRTC's baseline only reports" \
    '"$build/kda-aot" --arch sm_90a --only $K --ptxas-baseline "$tmp/pb_other.txt" | grep -q "is NVRTC 0.0.s, this is .*not checked"'

# the generator: the committed output is a fresh render; a custom variant renders and compiles
check "kernels_generated/ equals a fresh render of templates/" 'python3 gen/kda_gen.py --check > /dev/null'
python3 gen/kda_gen.py --custom "state bt=64 bk=96 bv=32" --out "$tmp/custom.h" > /dev/null
${CC:-cc} -std=c11 -O1 -DKDA_KERNELS_HEADER="\"$tmp/custom.h\"" -o "$tmp/jit_custom" tests/test_jit.c -lm -lpthread -ldl
export KDA_CACHE_DIR="$tmp/custom"
check "a custom specialisation (K=96) renders and compiles" '[ "$($tmp/jit_custom get kda_state_bt64_bk96_bv32 sm_80 | head -n 1)" = "cache miss" ]'

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
