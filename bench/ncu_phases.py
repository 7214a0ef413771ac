#!/usr/bin/env python3
"""Where the fused forward's time goes: ncu's per-instruction warp samples, by phase.

On a GPU machine (ncu holds the SM clock at its base, so times run longer than kda-bench's):

    ncu --kernel-name regex:fwd_fused --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o prof \\
        build/kda-bench --device gpu --ops fwd --reps 3 --shape 8,4096,16,128,128
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python3 bench/ncu_phases.py prof.csv [--chunks N] [--top N]
    python3 bench/ncu_phases.py --selftest     (the report of a made-up page; make test runs it)

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
import os
import signal
import sys
import tempfile

CLOSERS = ("BAR.SYNC", "BAR.RED", "BAR.ARV", "WARPGROUP.DEPBAR", "DEPBAR.LE")


def number(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def report(path, chunks=0.0, min_share=0.3, top=0):
    """the report's lines for an ncu source page (csv) of the fused forward"""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    ix = {h: i for i, h in enumerate(rows[head])}
    data = [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    src = [r[ix["Source"]].strip() for r in data]
    samples = [number(r[ix["Warp Stall Sampling (All Samples)"]]) for r in data]
    executed = [number(r[ix["Instructions Executed"]]) for r in data]
    stalls = [h for h in rows[head] if h.startswith("stall_") and "(Not Issued)" not in h]
    total = sum(samples) or 1.0
    out = []

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
    per = (lambda n: f"{n / chunks:8.0f}") if chunks else (lambda n: f"{n / 1e6:7.2f}M")
    unit = "per chunk" if chunks else "executed"

    for name, lo, hi in (("prologue", 0, dealloc), ("factor warps", dealloc, alloc), ("state warps", alloc, len(data))):
        s = sum(samples[lo:hi])
        out.append(f"\n{name}: {100 * s / total:.1f}% of samples, {per(sum(executed[lo:hi]))} warp instructions {unit}; {reasons(lo, hi, 5)}")
        if name == "prologue":
            continue
        out.append(f"  {'SASS lines':>13} {'samples':>8} {'instr':>9}  closing instruction; most executed opcodes")
        start, s_acc, e_acc, ops = lo, 0.0, 0.0, collections.Counter()
        for i in range(lo, hi):
            s_acc += samples[i]
            e_acc += executed[i]
            op = src[i].split()[1] if src[i].startswith("@") else src[i].split()[0]
            ops[op.split(".")[0]] += executed[i]
            if i == hi - 1 or any(c in src[i] for c in CLOSERS):
                if 100 * s_acc / total >= min_share:
                    common = " ".join(k for k, _ in ops.most_common(4))
                    out.append(f"  {start:6d}-{i:6d} {100 * s_acc / total:7.2f}% {per(e_acc)}  {src[i][:44]}; {common}")
                    out.append(f"  {'':13} stalls: {reasons(start, i + 1, 3)}")
                start, s_acc, e_acc, ops = i + 1, 0.0, 0.0, collections.Counter()
        if top:
            out.append("  heaviest instructions: SASS line, samples, instruction; stalls")
            for i in sorted(range(lo, hi), key=lambda i: -samples[i])[:top]:
                out.append(f"  {i:6d} {100 * samples[i] / total:7.2f}%  {src[i][:44]}; {reasons(i, i + 1, 2)}")
    return out


def selftest():
    """the report of a made-up source page whose shares are known (make test runs it: no GPU)"""
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
            "stall_short_sb", "stall_barrier", "stall_wait", "stall_short_sb (Not Issued)"]
    page = [  # source, samples, executed, short_sb, barrier, wait (no ties: the orders are the counts')
        ("MOV R1, c[0x0][0x28]", 5, 10, 0, 0, 5),
        ("USETMAXREG.DEALLOC.CTAPOOL 0x78", 0, 10, 0, 0, 0),
        ("LDS.64 R16, [R37+0x9c00]", 5, 80, 0, 0, 5),
        ("FADD R47, RZ, R18", 30, 100, 24, 0, 6),
        ("BAR.SYNC.DEFER_BLOCKING R35, 0x80", 20, 90, 0, 20, 0),
        ("@P0 MUFU.EX2 R28, R49", 8, 50, 0, 0, 8),
        ("BAR.RED.OR.DEFER_BLOCKING R35, 0x80, P1", 12, 100, 0, 12, 0),
        ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x88", 0, 10, 0, 0, 0),
        ("HGMMA.64x16x16.F32.BF16 R24, gdesc[UR4], R24", 20, 100, 5, 0, 15),
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        w = csv.writer(f)
        w.writerow(["a line before the header"])
        w.writerow(cols)
        for k, (src, smp, ex, sb, bar, wait) in enumerate(page):
            w.writerow([hex(16 * k), src, smp, f"{ex:,}", sb, bar, wait, 99])
    try:
        got = report(f.name, chunks=10, min_share=0, top=2)
    finally:
        os.unlink(f.name)
    want = [  # 100 samples: 5 prologue, 75 factor warps, 20 state warps; 10 chunks
        "factor warps: 75.0% of samples, 43 warp instructions per chunk; barrier 43%, short_sb 32%, wait 25%",
        "1- 4 55.00% 28 BAR.SYNC.DEFER_BLOCKING R35, 0x80; FADD BAR LDS USETMAXREG",
        "stalls: short_sb 44%, barrier 36%, wait 20%",
        "5- 6 20.00% 15 BAR.RED.OR.DEFER_BLOCKING R35, 0x80, P1; BAR MUFU",
        "stalls: barrier 60%, wait 40%",
        "3 30.00% FADD R47, RZ, R18; short_sb 80%, wait 20%",
        "4 20.00% BAR.SYNC.DEFER_BLOCKING R35, 0x80; barrier 100%",
        "state warps: 20.0% of samples, 11 warp instructions per chunk; wait 75%, short_sb 25%",
    ]
    words = {" ".join(y.split()) for y in got}
    missing = [x for x in want if x not in words]
    for x in missing:
        print("missing:", x)
    if missing:
        print("the report was:", *got, sep="\n")
    print("selftest:", "FAIL" if missing else "PASS")
    return 1 if missing else 0


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under | head
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="?", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--chunks", type=float, default=0, help="chunks x column blocks of the launch")
    ap.add_argument("--min", type=float, default=0.3, help="hide phases under this %% of the samples")
    ap.add_argument("--top", type=int, default=0, help="list each region's N instructions with the most samples")
    ap.add_argument("--selftest", action="store_true", help="check the report on a made-up page (no GPU)")
    a = ap.parse_args()
    if a.selftest:
        return selftest()
    if not a.csv:
        ap.error("the csv is required")
    print("\n".join(report(a.csv, a.chunks, a.min, a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
