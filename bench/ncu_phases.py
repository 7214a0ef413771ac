#!/usr/bin/env python3
"""Where the fused forward's time goes: ncu's per-instruction warp samples, by phase.

On a GPU machine (ncu holds the SM clock at its base, so times run longer than kda-bench's):

    ncu --kernel-name regex:fwd_fused --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o prof \\
        build/kda-bench --device gpu --ops fwd --reps 3 --shape 8,4096,16,128,128
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python3 bench/ncu_phases.py prof.csv [--chunks N]

The kernel's SASS falls into three regions at its setmaxnreg instructions: the prologue,
the factor warps (after USETMAXREG.DEALLOC) and the state warps (after
USETMAXREG.TRY_ALLOC). Inside a region, each barrier or wait closes a phase. A phase's share
of the samples is the warp-time spent there, its stalls included, and its main stall
reasons follow it. Samples are taken per warp, so the region with more warps holds more of
them. --chunks N (chunks x column blocks) divides the instruction counts into per-chunk
figures. --top N lists each region's N instructions with the most samples and why they
stalled: which wait (a load's result, a barrier, a fixed latency) a phase's time goes to.
"""
import argparse
import collections
import csv
import signal

CLOSERS = ("BAR.SYNC", "BAR.RED", "BAR.ARV", "WARPGROUP.DEPBAR", "DEPBAR.LE")


def number(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under | head
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--chunks", type=float, default=0, help="chunks x column blocks of the launch")
    ap.add_argument("--min", type=float, default=0.3, help="hide phases under this %% of the samples")
    ap.add_argument("--top", type=int, default=0, help="list each region's N instructions with the most samples")
    a = ap.parse_args()

    rows = list(csv.reader(open(a.csv)))
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    ix = {h: i for i, h in enumerate(rows[head])}
    data = [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    src = [r[ix["Source"]].strip() for r in data]
    samples = [number(r[ix["Warp Stall Sampling (All Samples)"]]) for r in data]
    executed = [number(r[ix["Instructions Executed"]]) for r in data]
    stalls = [h for h in rows[head] if h.startswith("stall_") and "(Not Issued)" not in h]
    total = sum(samples) or 1.0

    def reasons(lo, hi, n):
        """the n main stall reasons of SASS lines lo..hi - 1, as shares of their samples"""
        why = collections.Counter()
        for r in data[lo:hi]:
            for h in stalls:
                why[h[6:]] += number(r[ix[h]])
        s = sum(samples[lo:hi])
        return ", ".join(f"{k} {100 * v / max(s, 1):.0f}%" for k, v in why.most_common(n) if v)

    def at(marker):
        return next((i for i, s in enumerate(src) if marker in s), None)

    dealloc, alloc = at("USETMAXREG.DEALLOC"), at("USETMAXREG.TRY_ALLOC")
    if dealloc is None or alloc is None:
        raise SystemExit("no setmaxnreg in this kernel: not the sm_90a fused forward")
    per = (lambda n: f"{n / a.chunks:8.0f}") if a.chunks else (lambda n: f"{n / 1e6:7.2f}M")
    unit = "per chunk" if a.chunks else "executed"

    for name, lo, hi in (("prologue", 0, dealloc), ("factor warps", dealloc, alloc), ("state warps", alloc, len(data))):
        s = sum(samples[lo:hi])
        print(f"\n{name}: {100 * s / total:.1f}% of samples, {per(sum(executed[lo:hi]))} warp instructions {unit}; {reasons(lo, hi, 5)}")
        if name == "prologue":
            continue
        print(f"  {'SASS lines':>13} {'samples':>8} {'instr':>9}  closing instruction; most executed opcodes")
        start, s_acc, e_acc, ops = lo, 0.0, 0.0, collections.Counter()
        for i in range(lo, hi):
            s_acc += samples[i]
            e_acc += executed[i]
            op = src[i].split()[1] if src[i].startswith("@") else src[i].split()[0]
            ops[op.split(".")[0]] += executed[i]
            if i == hi - 1 or any(c in src[i] for c in CLOSERS):
                if 100 * s_acc / total >= a.min:
                    common = " ".join(k for k, _ in ops.most_common(4))
                    print(f"  {start:6d}-{i:6d} {100 * s_acc / total:7.2f}% {per(e_acc)}  {src[i][:44]}; {common}")
                    print(f"  {'':13} stalls: {reasons(start, i + 1, 3)}")
                start, s_acc, e_acc, ops = i + 1, 0.0, 0.0, collections.Counter()
        if a.top:
            print(f"  heaviest instructions: SASS line, samples, instruction; stalls")
            for i in sorted(range(lo, hi), key=lambda i: -samples[i])[:a.top]:
                print(f"  {i:6d} {100 * samples[i] / total:7.2f}%  {src[i][:44]}; {reasons(i, i + 1, 2)}")


if __name__ == "__main__":
    main()
