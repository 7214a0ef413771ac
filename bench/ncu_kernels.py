#!/usr/bin/env python3
"""Where a forward's time goes, kernel by kernel: ncu's durations of the last forward's launches.

On a GPU machine (clocks left free, so the durations are kda-bench's; ncu runs the launches
one at a time, so their overlap under programmatic dependent launch is lost):

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        build/kda-bench --device gpu --ops fwd --reps 2 --shape 1,8192,32,128,128 > k.csv
    python3 bench/ncu_kernels.py k.csv

kda-bench's forwards are alike, so the last one's launches are the kernels from the last
launch of the first kernel of a forward (the kernel the file's first launch ran) to the end.
Prints each launch's kernel, grid and duration, and their sum; a bounded split's idle exact
passes (their blocks end at once) show as launches of a few microseconds
(bench/RESULTS.md, 2026-11-27: B1 T8192 H32 spends 22 us of 246 outside its bounded kernel).
"""
import argparse
import csv
import signal


SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}  # to microseconds


def launches(path):
    """[(kernel, grid, microseconds)] in launch order, from an ncu --csv file (program output
    before the table is skipped)"""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r[:1] == ["ID"] and "Kernel Name" in r)
    ix = {h: i for i, h in enumerate(rows[head])}
    seen = {}
    for r in rows[head + 1:]:
        if len(r) != len(rows[head]) or r[ix["Metric Name"]] != "gpu__time_duration.sum":
            continue
        unit = r[ix["Metric Unit"]]
        if unit not in SCALE:
            raise SystemExit(f"{path}: a duration in {unit!r}, a unit this script does not know")
        scale = SCALE[unit]
        seen[r[ix["ID"]]] = (r[ix["Kernel Name"]], r[ix["Grid Size"]], float(r[ix["Metric Value"]].replace(",", "")) * scale)
    return [seen[k] for k in sorted(seen, key=int)]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under | head
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --csv --metrics gpu__time_duration.sum output")
    a = ap.parse_args()
    ks = launches(a.csv)
    if not ks:
        raise SystemExit(f"{a.csv}: no gpu__time_duration.sum rows")
    first = ks[0][0]
    last = max(i for i, k in enumerate(ks) if k[0] == first)
    total = 0.0
    for name, grid, us in ks[last:]:
        total += us
        print(f"{name[:64]:64s} {grid:>14s} {us:9.1f} us")
    print(f"{'sum':64s} {'':>14s} {total:9.1f} us")


if __name__ == "__main__":
    main()
