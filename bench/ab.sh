#!/usr/bin/env bash
# A/B timing of kernel variants on one GPU: kda-bench's forward median for each named
# source tree, the trees interleaved shape by shape and round by round, so that clock and
# thermal drift fall on all of them alike (bench/RESULTS.md's "two rounds" tables).
#
#   bench/ab.sh OUTDIR main=. variant=path/to/tree ...
#   SHAPES="8,4096,16,128,128 2,8192,16,128,256" ROUNDS=3 REPS=20 bench/ab.sh ...
#   ARGS="--gate kimi" bench/ab.sh ...      (more kda-bench options, the same for every run)
#   bench/ab.sh OUTDIR main=. exact=.:KDA_SPLIT=exact:KDA_PDL=0   (a variant with environment settings)
#   bench/ab.sh --summary OUTDIR           (the closing table again, from OUTDIR/ab.txt)
#
# A tree is a copy of this repository, edited as the variant needs; each builds its own
# build/kda-bench by the Makefile's rule, so every variant is compiled as `make` compiles
# it (kernels_generated/ is rendered again where templates/ is newer). A variant may add
# VAR=value settings after its tree, each after a colon, for its runs alone: the same build
# under another run-time switch. Prints and appends to OUTDIR/ab.txt one line per run:
# round, shape (B,T,H,K,V), name, median ms; kda-bench's stderr, and its output where a run
# fails, go to OUTDIR/ab_err.txt. Then a table: per shape, each tree's median over the rounds,
# its change against the first tree's, and the rounds themselves.
set -u
[ $# -ge 2 ] || { sed -n '2,19p' "$0"; exit 2; }
# (the rounds of each shape and tree, in the order they first ran, and how many failed)
summary() {
    awk '{
        k = $4; n = $5
        if (!(k in nk)) { shapes[++ns] = k; nk[k] = 0 }
        if (!((k, n) in cnt)) { names[k, ++nk[k]] = n; cnt[k, n] = 0; nf[k, n] = 0 }
        if ($6 == "failed") { nf[k, n]++; next }
        v[k, n, ++cnt[k, n]] = $6
    }
    function median(k, n,    m, i, j, t, a) {
        m = cnt[k, n]
        for (i = 1; i <= m; i++) a[i] = v[k, n, i] + 0
        for (i = 2; i <= m; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
        return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
    }
    END {
        for (i = 1; i <= ns; i++) {
            k = shapes[i]; b = names[k, 1]; base = cnt[k, b] ? median(k, b) : 0
            for (j = 1; j <= nk[k]; j++) {
                n = names[k, j]; m = cnt[k, n] ? median(k, n) : 0; rounds = ""
                for (r = 1; r <= cnt[k, n]; r++) rounds = rounds " " v[k, n, r]
                ch = j == 1 || !m || !base ? "       " : sprintf("%+6.1f%%", 100 * (m / base - 1))
                printf "%-22s %-10s %s %s  (%s )%s\n", (j == 1 ? k : ""), n, m ? sprintf("%.4f", m) : "failed",
                       ch, rounds, nf[k, n] ? sprintf(" %d failed", nf[k, n]) : ""
            }
        }
    }' "$1/ab.txt"
}
if [ "$1" = --summary ]; then summary "$2"; exit; fi
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
summary "$out"
