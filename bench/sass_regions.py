#!/usr/bin/env python3
"""A fused kernel's SASS by warp role, without a GPU: instructions and spill code per region.

    make build/kda-aot build/test_jit
    python3 bench/sass_regions.py [--arch sm_90a] [--spec GATE,G_DTYPE] NAME [NAME ...]
    python3 bench/sass_regions.py kda_fwd_fused_dtypebf16_bk128_bv128_varlen0
    python3 bench/sass_regions.py --spec 0,0 kda_fwd_fused_dtypebf16_bk128_bv128_varlen0
    python3 bench/sass_regions.py --spec 0,0 --loop state kda_fwd_fused_pairs_dtypebf16_bk128_bv128_varlen0

--loop also prints one kind of warp's chunk loop, an instruction a line: where ptxas put a load
against its uses and the wgmma (S^T's decay: eight elast loads through one register quad, each
waited for by its FMULs; 2026-11-30, bench/RESULTS.md).

--spec looks at the specialisation kda.h's NVRTC compiles for a problem with that gate form and
g dtype (kda_gate, kda_dtype numbers; kda__kspec), through build/test_jit; without it, at the
generic kernel, as ahead-of-time cubins have it (build/kda-aot).

Compiles each kernel with build/kda-aot (kda.h's own NVRTC path), disassembles it with
cuobjdump and splits it at its setmaxnreg instructions: the prologue, the factor warps
(after USETMAXREG.DEALLOC) and the state warps (after USETMAXREG.TRY_ALLOC). For each
region it prints the instruction count and the local-memory stores and loads (STL, LDL:
spill code), in all and inside its longest loop (each kind of warp's chunk loop, which is
where they cost). Reloads inside the factor warps' loop cost the fused forward time: one
variant went from 5 to 17 of them and ran B8 10% slower (bench/RESULTS.md, 2026-11-26),
while code size alone moved little; where the state warps decayed S^T decided between 0 and
147 of them (2026-11-26). It also counts the wgmma instructions (HGMMA) and how many
of them are waited on alone (`gsb0` and a `WARPGROUP.DEPBAR` next): where ptxas serialises
the pipeline (a wgmma inside a branch, or too many registers held by matmuls in flight) every
one is, and the kernel ran 17% slower (2026-11-26). Check here before timing a kernel change
on a GPU.

cuobjdump comes from $CUDA_HOME/bin, /usr/local/cuda/bin or PATH (the nvidia-cuda-cuobjdump
wheel puts one in site-packages/nvidia/cu13/bin: give it with --cuobjdump; it runs nvdisasm, from
the nvidia-cuda-nvdisasm wheel, which must then be on PATH).
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_cuobjdump(given):
    if given:
        return given
    for d in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if d and os.access(os.path.join(d, "bin", "cuobjdump"), os.X_OK):
            return os.path.join(d, "bin", "cuobjdump")
    return shutil.which("cuobjdump")


def regions(sass):
    """(name, instruction lines) for the prologue, factor and state regions"""
    out, name, cur = [], "prologue", []
    for line in sass.splitlines():
        if not re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            continue
        if "USETMAXREG.DEALLOC" in line or "USETMAXREG.TRY_ALLOC" in line:
            out.append((name, cur))
            name, cur = ("factor warps" if "DEALLOC" in line else "state warps"), []
        cur.append(line)
    out.append((name, cur))
    return out


def spill_code(lines):
    """(STL, LDL): local-memory stores and loads"""
    return sum("STL" in x for x in lines), sum("LDL" in x for x in lines)


def wgmma_waits(lines):
    """(HGMMA count, how many carry gsb0 with a WARPGROUP.DEPBAR the next HGMMA or wait instruction)"""
    n = alone = 0
    for i, line in enumerate(lines):
        if "HGMMA" not in line:
            continue
        n += 1
        if "gsb0" in line:
            nxt = next((x for x in lines[i + 1:] if "HGMMA" in x or "WARPGROUP.DEPBAR" in x), "")
            alone += "WARPGROUP.DEPBAR" in nxt
    return n, alone


def chunk_loop(lines):
    """the region's chunk loop, its SASS lines: the widest span from a backward
    branch's target to the branch that holds a barrier or a wgmma (a chunk's hand-over) and no
    inner loop that holds one too (so that a loop around the chunk loop, over several pieces,
    does not take its place)"""
    at = {int(m.group(1), 16): i for i, m in enumerate(re.match(r"\s+/\*([0-9a-f]+)\*/", x) for x in lines) if m}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", line)
        j = at.get(int(m.group(1), 16)) if m else None
        if j is not None and j < i:
            loops.append((j, i))
    syncs = [any(k in x for k in ("BAR.", "HGMMA")) for x in lines]
    def holds(lo, hi):
        return any(syncs[lo:hi + 1])
    best = (0, 0)
    for lo, hi in loops:
        inner = any(lo <= a and b <= hi and (a, b) != (lo, hi) and holds(a, b) for a, b in loops)
        if holds(lo, hi) and not inner and hi - lo > best[1] - best[0]:
            best = (lo, hi)
    return lines[best[0]:best[1] + 1] if best[1] > best[0] else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="+", help="kernel names (kernels_generated/kda_kernels.h)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--cuobjdump", help="path to cuobjdump")
    ap.add_argument("--spec", help="GATE,G_DTYPE: the specialisation for that gate form and g dtype")
    ap.add_argument("--loop", choices=["state", "factor"], help="also print that kind of warp's chunk loop, instruction by instruction")
    a = ap.parse_args()
    tool = os.path.join(ROOT, "build", "test_jit" if a.spec else "kda-aot")
    cuobjdump = find_cuobjdump(a.cuobjdump)
    if not os.access(tool, os.X_OK):
        sys.exit(f"{tool} is missing: make {os.path.relpath(tool, ROOT)}")
    if not cuobjdump:
        sys.exit("cuobjdump not found: set CUDA_HOME or give --cuobjdump")
    status, listing = 0, []
    for name in a.names:
        with tempfile.TemporaryDirectory() as tmp:
            if a.spec:  # test_jit compiles it into a cache folder of its own
                cmd = [tool, "get", name, a.arch] + a.spec.split(",")
                r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, KDA_CACHE_DIR=tmp))
            else:
                r = subprocess.run([tool, "--arch", a.arch, "--only", name, "--out", tmp], capture_output=True, text=True)
            cubins = glob.glob(os.path.join(tmp, "*.cubin"))
            if r.returncode or not cubins:
                print(f"{name}: {os.path.basename(tool)} failed\n{r.stdout}{r.stderr}")
                status = 1
                continue
            data = open(cubins[0], "rb").read()
            if b"\x7fELF" not in data:
                print(f"{name}: no ELF image in {os.path.basename(cubins[0])}")
                status = 1
                continue
            elf = os.path.join(tmp, "k.elf")
            with open(elf, "wb") as f:
                f.write(data[data.find(b"\x7fELF"):])  # past kda's verification header
            sass = subprocess.run([cuobjdump, "-sass", elf], capture_output=True, text=True, check=True).stdout
            res = subprocess.run([cuobjdump, "-res-usage", elf], capture_output=True, text=True, check=True).stdout
        usage = " ".join(re.findall(r"(?:REG|STACK|SHARED):\d+", res))
        print(f"{name} ({a.arch}, {usage})")
        for region, lines in regions(sass):
            stl, ldl = spill_code(lines)
            gmma, alone = wgmma_waits(lines)
            wg = f", {gmma} HGMMA ({alone} waited on alone{': SERIALISED' if gmma > 4 and alone == gmma else ''})" if gmma else ""
            body = chunk_loop(lines)
            lstl, lldl = spill_code(body)
            loop = f"; chunk loop {len(body)}, spill code {lstl} STL, {lldl} LDL" if body and region != "prologue" else ""
            print(f"  {region:13s} {len(lines):6d} instructions, spill code: {stl} STL, {ldl} LDL{wg}{loop}")
            if a.loop and region == a.loop + " warps":
                listing.append((name, body))
    for name, body in listing:  # (after the summaries: which instruction waits for which, e.g. loads and their uses)
        print(f"\n{name}: {a.loop} warps' chunk loop")
        for line in body:
            m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*(?:/\*.*)?$", line)
            print(f"  {m.group(1)}  {m.group(2)}" if m else line)
    return status


if __name__ == "__main__":
    sys.exit(main())
