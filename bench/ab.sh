#!/usr/bin/env bash
# A/B timing of kernel variants on one GPU: kda-bench's forward median for each named
# source tree, the trees interleaved shape by shape and round by round, so that clock and
# thermal drift fall on all of them alike (bench/RESULTS.md's "two rounds" tables).
#
#   bench/ab.sh OUTDIR main=. variant=path/to/tree ...
#   SHAPES="8,4096,16,128,128 2,8192,16,128,256" ROUNDS=3 REPS=20 bench/ab.sh ...
#   ARGS="--gate kimi" bench/ab.sh ...      (more kda-bench options, the same for every run)
#   bench/ab.sh OUTDIR main=. exact=.:KDA_SPLIT=exact:KDA_PDL=0   (a variant with environment settings)
#
# A tree is a copy of this repository, edited as the variant needs; each builds its own
# build/kda-bench by the Makefile's rule, so every variant is compiled as `make` compiles
# it (kernels_generated/ is rendered again where templates/ is newer). A variant may add
# VAR=value settings after its tree, each after a colon, for its runs alone: the same build
# under another run-time switch. Prints and appends to OUTDIR/ab.txt one line per run:
# round, shape (B,T,H,K,V), name, median ms; kda-bench's stderr, and its output where a run
# fails, go to OUTDIR/ab_err.txt.
set -u
[ $# -ge 2 ] || { sed -n '2,15p' "$0"; exit 2; }
out=$1; shift
mkdir -p "$out"
SHAPES=${SHAPES:-"8,4096,16,128,128 4,4096,32,64,64 2,8192,16,128,256 1,8192,32,128,128 1,65536,16,128,128"}
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-20}
tree() { local t=${1#*=}; echo "${t%%:*}"; }                   # name=tree[:VAR=value...] -> tree
settings() { local t=${1#*=}; [ "$t" = "${t#*:}" ] || echo "${t#*:}" | tr ':' ' '; } # -> VAR=value ...
for nd in "$@"; do
    make -s -C "$(tree "$nd")" build/kda-bench || exit 1
done
for round in $(seq "$ROUNDS"); do
    for s in $SHAPES; do
        for nd in "$@"; do
            n=${nd%%=*} d=$(tree "$nd")
            # shellcheck disable=SC2046,SC2086 # (the settings and ARGS split at spaces: values without them)
            line=$(env $(settings "$nd") "$d/build/kda-bench" --device gpu --ops fwd --reps "$REPS" --shape "$s" ${ARGS:-} 2>>"$out/ab_err.txt")
            ms=$(echo "$line" | grep -o '"ms_median":[0-9.]*' | cut -d: -f2)
            [ -n "$ms" ] || echo "round $round shape $s $n: $line" >>"$out/ab_err.txt" # (kda-bench's error line)
            echo "round $round shape $s $n ${ms:-failed}" | tee -a "$out/ab.txt"
        done
    done
done
