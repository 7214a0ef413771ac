#!/usr/bin/env python3
"""A kernel's PTX, its ptxas spill code, and where two trees' PTX differ, block by block; no GPU.

    make build/kda-aot
    python3 bench/ptx_blocks.py [--spec GATE,G_DTYPE] [--arch sm_90a] NAME [OTHER_TREE] [--show]
    python3 bench/ptx_blocks.py --spec 0,0 kda_fwd_fused_dtypebf16_bk128_bv128_varlen0 .ab/base

Why: the fused kernel is one function, and NVVM (LLVM) optimises it whole. A change in the state
warps' code can change the factor warps' PTX, and ptxas then spills there (2026-11-29: the state
loop's bookkeeping in 32 bits hoisted the fetch's per-thread offsets out of the factor loop, 61
reloads, B8 T4096 H16 +18%; bench/RESULTS.md). bench/sass_regions.py shows the SASS that results;
this shows whether the PTX, the compiler's input, changed and where: it takes the kernel's source
from each tree's kernels_generated/kda_kernels.h, compiles it to PTX through NVRTC with kda.h's
options (build/kda-aot --print-options prints them; --spec: the specialisation kda.h compiles for
that gate form and g dtype; both trees take this tree's options), prints ptxas's
spill line for it, and with a second tree prints the basic blocks whose instructions (registers
and labels renamed) differ, with --show their diffs. Seconds a variant, where a GPU A/B takes
minutes.

libnvrtc and ptxas come from $CUDA_HOME (or /usr/local/cuda); KDA_NVRTC_PATH names libnvrtc.
"""
import argparse
import collections
import ctypes
import difflib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"


def c_strings(header, names):
    """{name: text} of the named string constants in a kernels_generated header (gen/kda_gen.py's
    c_string: one literal a line, escaping only backslash and quote)"""
    out, cur, text = {}, None, []
    for line in open(header):
        m = re.match(r"static const char (\w+)\[\] =(?: /\* (\w+) \*/)?", line)
        if m:
            if cur:
                out[cur] = "".join(text)
            key = m.group(2) or m.group(1)
            cur, text = (key if key in names else None), []
            continue
        if cur:
            m = re.match(r'\s*"(.*)"\s*(;?)\s*$', line)
            if not m:
                out[cur], cur = "".join(text), None
                continue
            text.append(re.sub(r"\\(.)", lambda e: "\n" if e.group(1) == "n" else e.group(1), m.group(1)))
            if m.group(2):
                out[cur], cur = "".join(text), None
    if cur:
        out[cur] = "".join(text)
    return out


def nvrtc():
    path = os.environ.get("KDA_NVRTC_PATH") or os.path.join(CUDA, "lib64", "libnvrtc.so")
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def nvrtc_options(aot, name, arch, spec):
    """kda.h's NVRTC options for kernel name (kda-aot --print-options)"""
    cmd = [aot, "--print-options", "--arch", arch, "--only", name] + (["--spec", spec] if spec else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"{aot}: {e}: make build/kda-aot")
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed\n{r.stdout}{r.stderr}")
    return r.stdout.split()


def ptx_of(lib, tree, name, opts):
    """NVRTC's PTX of kernel name in tree, with these options"""
    src = c_strings(os.path.join(tree, "kernels_generated", "kda_kernels.h"), {"kda__src_common", name})
    if name not in src:
        sys.exit(f"{tree}: no kernel {name} in kernels_generated/kda_kernels.h")
    prog = ctypes.c_void_p()
    hdr = (ctypes.c_char_p * 1)(src["kda__src_common"].encode())
    hname = (ctypes.c_char_p * 1)(b"kda_common.cuh")
    lib.nvrtcCreateProgram(ctypes.byref(prog), src[name].encode(), name.encode(), 1, hdr, hname)
    copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), copts)
    if r:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{tree}: nvrtcCompileProgram({name}): {lib.nvrtcGetErrorString(r).decode()}; options: "
                 f"{' '.join(opts)}\n{log.value.decode()}")
    n = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.value.decode()


def ptxas_spills(ptx, arch):
    """ptxas -v's stack and spill line for the PTX"""
    with tempfile.TemporaryDirectory() as tmp:
        f = os.path.join(tmp, "k.ptx")
        open(f, "w").write(ptx)
        r = subprocess.run([os.path.join(CUDA, "bin", "ptxas"), f"-arch={arch}", "-v", f, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    line = next((x.strip() for x in (r.stdout + r.stderr).splitlines() if "spill" in x), "")
    return line if r.returncode == 0 else f"ptxas failed: {r.stderr.strip()[:500]}"


def blocks(ptx):
    """{label: [instruction, ...]} of the entry's basic blocks, registers and labels renamed"""
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    out, name, cur = {}, "entry", []
    for line in body.splitlines():
        m = re.match(r"^(\$L__BB\d+_\d+):", line)
        if m:
            out[name], name, cur = cur, m.group(1), []
            continue
        line = line.strip()
        if line and line not in ("{", "}") and not line.startswith(("//", ".reg", ".loc")):
            cur.append(re.sub(r"\$L__BB\d+_\d+", "L", re.sub(r"%[a-z]+\d+", "R", line)))
    out[name] = cur
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", help="kernel name (kernels_generated/kda_kernels.h)")
    ap.add_argument("other", nargs="?", help="a second tree (a copy of this repository) to compare with this one")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--spec", help="GATE,G_DTYPE: the specialisation for that gate form and g dtype")
    ap.add_argument("--show", action="store_true", help="print the differing blocks' diffs")
    ap.add_argument("--out", help="write this tree's PTX here")
    ap.add_argument("--aot", default=os.path.join(ROOT, "build", "kda-aot"), help="kda-aot, for kda.h's NVRTC options")
    a = ap.parse_args()
    lib = nvrtc()
    opts = nvrtc_options(a.aot, a.name, a.arch, a.spec)
    trees = [ROOT] + ([a.other] if a.other else [])
    ptx = [ptx_of(lib, t, a.name, opts) for t in trees]
    if a.out:
        open(a.out, "w").write(ptx[0])
    for t, p in zip(trees, ptx):
        print(f"{os.path.relpath(t)}: {len(p.splitlines())} PTX lines; ptxas: {ptxas_spills(p, a.arch)}")
    if not a.other:
        return 0
    b0, b1 = blocks(ptx[0]), blocks(ptx[1])
    c0 = collections.Counter("\n".join(v) for v in b0.values())
    c1 = collections.Counter("\n".join(v) for v in b1.values())
    only0, only1 = list((c0 - c1).elements()), list((c1 - c0).elements())
    print(f"blocks {len(b0)} and {len(b1)}; {len(only0)} ({sum(len(x.splitlines()) for x in only0)} instructions) only in "
          f"the first, {len(only1)} ({sum(len(x.splitlines()) for x in only1)}) only in the second")
    for x in only0:  # each with the most alike block of the other
        y = max(only1, key=lambda y: difflib.SequenceMatcher(None, x, y).ratio(), default="")
        d = [l for l in difflib.unified_diff(x.splitlines(), y.splitlines(), lineterm="", n=0) if l[:1] in "+-" and l[:3] not in ("+++", "---")]
        print(f"- a block of {len(x.splitlines())} instructions: {len(d)} lines differ; it starts: {x.splitlines()[0] if x else ''}")
        if a.show:
            print("\n".join("    " + l for l in d[:40]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
