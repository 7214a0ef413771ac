#!/usr/bin/env python3
"""kda (build/libkda.so through ctypes) against FLA's Triton chunk_kda, forward only.

On a machine with a GPU, PyTorch, Triton and flash-linear-attention 0.6.0:
    make build/libkda.so
    python3 bench/compare_fla.py [--safe-gate | --kimi-gate] [--fp16] [--out results.md] [--peak-gbps 4300]
For each shape of ANCHORS.md (plus one varlen case) it runs both, prints the error
ratio RMS(kda - FLA) / RMS(FLA) of o and of the final state, times both forwards with
triton.testing.do_bench (median, warmup 25 ms, rep 100 ms) and prints a table with the
speed-up (FLA / kda) and the fraction of the memory roofline each reaches.

Without a GPU:
    python3 bench/compare_fla.py --selftest-cpu
checks the ctypes struct mirrors against the library and runs small kda_chunk_fwd calls
on the CPU backend against a float64 numpy recurrence (numpy only, no torch).

Exit status: 0 ok, 1 a check failed (error ratio above the threshold, a kda call failed),
2 a requirement is missing (FLA, torch, a GPU, the library).
"""
import argparse
import ctypes as C
import datetime
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# --------------------------------------------------------------------------
# ctypes mirrors of kda.h's public structs (enums are C ints)
# --------------------------------------------------------------------------
KDA_OK = 0
KDA_F32, KDA_F16, KDA_BF16 = 0, 1, 2
KDA_BACKEND_CPU, KDA_BACKEND_CUDA = 0, 1
KDA_GATE_NONE, KDA_GATE_SOFTPLUS, KDA_GATE_LOWER_BOUND = 0, 1, 2
KDA_STATE_KV, KDA_STATE_VK = 0, 1
KDA_INDEX_I32, KDA_INDEX_I64 = 0, 1


class KdaProblem(C.Structure):
    _fields_ = [
        ("B", C.c_int), ("T", C.c_int), ("H", C.c_int), ("HV", C.c_int), ("K", C.c_int), ("V", C.c_int),
        ("dtype", C.c_int),          # kda_dtype
        ("g_dtype", C.c_int),        # kda_dtype
        ("beta_dtype", C.c_int),     # kda_dtype
        ("chunk_size", C.c_int),
        ("scale", C.c_float),
        ("qk_l2norm", C.c_int),
        ("gate", C.c_int),           # kda_gate
        ("lower_bound", C.c_float),
        ("beta_sigmoid", C.c_int),
        ("allow_neg_eigval", C.c_int),
        ("safe_gate", C.c_int),
        ("state_layout", C.c_int),   # kda_layout
        ("num_seqs", C.c_int),
        ("seqlens_type", C.c_int),   # kda_index_type
    ]


class KdaInputs(C.Structure):
    _fields_ = [
        ("q", C.c_void_p), ("k", C.c_void_p), ("v", C.c_void_p), ("g", C.c_void_p), ("beta", C.c_void_p),
        ("A_log", C.c_void_p), ("dt_bias", C.c_void_p), ("h0", C.c_void_p),
        ("cu_seqlens", C.c_void_p), ("cu_seqlens_host", C.c_void_p),
    ]


class KdaFwdOutputs(C.Structure):
    _fields_ = [("o", C.c_void_p), ("ht", C.c_void_p), ("h", C.c_void_p), ("saved", C.c_void_p),
                ("state_pool", C.c_void_p), ("slots", C.c_void_p), ("num_slots", C.c_int), ("slots_host", C.c_void_p),
                ("state_dtype", C.c_int)]


def load_lib(path):
    if not os.path.exists(path):
        print(f"error: {path} not found; build it with `make build/libkda.so`", file=sys.stderr)
        sys.exit(2)
    lib = C.CDLL(path)
    P, I, O = C.POINTER(KdaProblem), C.POINTER(KdaInputs), C.POINTER(KdaFwdOutputs)
    sig = {
        "kda_context_create": (C.c_int, [C.POINTER(C.c_void_p), C.c_int, C.c_void_p]),
        "kda_context_destroy": (None, [C.c_void_p]),
        "kda_context_backend": (C.c_int, [C.c_void_p]),
        "kda_last_error": (C.c_char_p, [C.c_void_p]),
        "kda_status_string": (C.c_char_p, [C.c_int]),
        "kda_set_workspace": (None, [C.c_void_p, C.c_void_p, C.c_size_t]),
        "kda_set_stream": (None, [C.c_void_p, C.c_void_p]),
        "kda_problem_default": (KdaProblem, [C.c_int] * 5),
        "kda_problem_check": (C.c_int, [C.c_void_p, P]),
        "kda_fwd_workspace_size": (C.c_size_t, [P]),
        "kda_chunk_fwd_workspace": (C.c_int, [C.c_void_p, P, O, C.c_void_p, C.POINTER(C.c_size_t)]),
        "kda_warmup": (C.c_int, [C.c_void_p, P]),
        "kda_chunk_fwd": (C.c_int, [C.c_void_p, P, I, O]),
        "kda_synchronize": (C.c_int, [C.c_void_p]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    if hasattr(lib, "kda_bench_layout"):
        lib.kda_bench_layout.restype, lib.kda_bench_layout.argtypes = C.c_size_t, [C.c_int]
    check_layout(lib)
    return lib


def check_layout(lib):
    """The mirrors must match the C structs byte for byte (bench/libkda.c reports them)."""
    if not hasattr(lib, "kda_bench_layout"):
        print("warning: libkda.so has no kda_bench_layout; struct layout not checked", file=sys.stderr)
        return
    want = [C.sizeof(KdaProblem), C.sizeof(KdaInputs), C.sizeof(KdaFwdOutputs),
            KdaProblem.seqlens_type.offset, KdaInputs.cu_seqlens_host.offset, KdaFwdOutputs.state_dtype.offset,
            KdaProblem.scale.offset]
    got = [lib.kda_bench_layout(i) for i in range(len(want))]
    if got != want:
        raise SystemExit(f"error: ctypes struct mirrors do not match kda.h: C {got}, Python {want}")


class Ctx:
    def __init__(self, lib, backend):
        self.lib = lib
        self.h = C.c_void_p()
        st = lib.kda_context_create(C.byref(self.h), backend, None)
        if st != KDA_OK:
            msg = lib.kda_last_error(self.h).decode() if self.h else "out of memory"
            if self.h:
                lib.kda_context_destroy(self.h)
            self.h = None
            raise RuntimeError(f"kda_context_create({'cuda' if backend else 'cpu'}): "
                               f"{lib.kda_status_string(st).decode()}: {msg}")

    def check(self, st, what):
        if st != KDA_OK:
            raise RuntimeError(f"{what}: {self.lib.kda_status_string(st).decode()}: "
                               f"{self.lib.kda_last_error(self.h).decode()}")

    def close(self):
        if self.h:
            self.lib.kda_context_destroy(self.h)
            self.h = None


def make_problem(B, T, H, HV, K, V, dtype, g_dtype, beta_dtype, chunk=64, safe_gate=0, num_seqs=0,
                 seqlens_type=KDA_INDEX_I64, gate=KDA_GATE_NONE):
    p = KdaProblem()
    p.B, p.T, p.H, p.HV, p.K, p.V = B, T, H, HV, K, V
    p.dtype, p.g_dtype, p.beta_dtype = dtype, g_dtype, beta_dtype
    p.chunk_size = chunk
    p.scale = 0.0                      # K^-0.5
    p.qk_l2norm = 1
    p.gate = gate                      # KDA_GATE_NONE: g is the precomputed log decay
    p.lower_bound = 0.0
    p.beta_sigmoid = 0
    p.allow_neg_eigval = 0
    p.safe_gate = safe_gate
    p.state_layout = KDA_STATE_KV
    p.num_seqs = num_seqs
    p.seqlens_type = seqlens_type
    return p


# --------------------------------------------------------------------------
# CPU self-test (numpy only)
# --------------------------------------------------------------------------
def np_bf16_round(x):
    """float32 -> bf16 bits (uint16), round to nearest even; and back to float32."""
    import numpy as np
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    return bits, back


def np_reference(q, k, v, g, beta, h0, cu, H, HV, scale=None):
    """float64 token-by-token recurrence, FLA layouts, B = 1 when cu is given.
    S <- diag(exp(g_t)) S; S <- S + b_t k_t (v_t - S^T k_t)^T; o_t = S^T (scale q_t); q, k l2-normalised."""
    import numpy as np
    q, k, v, g, beta, h0 = (np.asarray(a, dtype=np.float64) for a in (q, k, v, g, beta, h0))
    B, T, _, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    grp = HV // H
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    o = np.zeros((B, T, HV, V))
    segs = [(b, 0, T) for b in range(B)] if cu is None else [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]
    ht = np.zeros((len(segs), HV, K, V))
    for n, (b, t0, t1) in enumerate(segs):
        for hv in range(HV):
            h = hv // grp
            S = h0[n, hv].copy()
            for t in range(t0, t1):
                S *= np.exp(g[b, t, hv])[:, None]
                kt = k[b, t, h]
                S += beta[b, t, hv] * np.outer(kt, v[b, t, hv] - S.T @ kt)
                o[b, t, hv] = S.T @ (scale * q[b, t, h])
            ht[n, hv] = S
    return o, ht


def err_ratio_np(a, b):
    import numpy as np
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def selftest_cpu(args):
    import numpy as np
    lib = load_lib(args.lib)
    print(f"struct mirrors match kda.h: sizeof problem/inputs/fwd_outputs = "
          f"{C.sizeof(KdaProblem)}/{C.sizeof(KdaInputs)}/{C.sizeof(KdaFwdOutputs)}")
    d = lib.kda_problem_default(2, 3, 4, 5, 6)
    assert (d.B, d.T, d.H, d.HV, d.K, d.V, d.chunk_size, d.dtype, d.num_seqs) == (2, 3, 4, 4, 5, 6, 64, KDA_F32, 0), \
        "kda_problem_default round trip"
    ctx = Ctx(lib, KDA_BACKEND_CPU)
    assert lib.kda_context_backend(ctx.h) == KDA_BACKEND_CPU
    bad = make_problem(1, 8, 1, 1, 300, 8, KDA_F32, KDA_F32, KDA_F32)
    st = lib.kda_problem_check(ctx.h, C.byref(bad))
    assert st != KDA_OK, "K=300 must be rejected"
    print(f"bad problem rejected: {lib.kda_last_error(ctx.h).decode()}")

    rng = np.random.default_rng(0)
    ok = True

    def logsigmoid(x):
        return -np.logaddexp(0.0, -x)

    def run(name, B, T, H, HV, K, V, chunk, dt, cu=None, safe=0, tol=1e-4, kimi=False):
        nonlocal ok
        N = B if cu is None else len(cu) - 1
        q = rng.standard_normal((B, T, H, K)).astype(np.float32)
        k = rng.standard_normal((B, T, H, K)).astype(np.float32)
        v = rng.standard_normal((B, T, HV, V)).astype(np.float32)
        g = logsigmoid(rng.standard_normal((B, T, HV, K))).astype(np.float32)
        graw = A_log = dt_bias = None
        if kimi:  # the library gets the raw gate, the reference its decay (--kimi-gate's initialisation)
            graw = rng.standard_normal((B, T, HV, K)).astype(np.float32)
            A_log = np.log(rng.uniform(1.0, 16.0, HV)).astype(np.float32)
            dt_bias = np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), HV * K)))).astype(np.float32)
            g = (-np.exp(A_log.astype(np.float64))[:, None] * np.logaddexp(0.0, graw + dt_bias.reshape(HV, K))).astype(np.float32)
        if safe:
            g = np.clip(g * 3, -5, 0).astype(np.float32)
        beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, HV))))).astype(np.float32)
        h0 = rng.standard_normal((N, HV, K, V)).astype(np.float32)
        if dt == KDA_BF16:   # the library reads bf16 bits; the reference sees the rounded values
            (qb, q), (kb, k), (vb, v), (bb, beta) = (np_bf16_round(a) for a in (q, k, v, beta))
            q_, k_, v_, b_ = qb, kb, vb, bb
            o = np.zeros((B, T, HV, V), np.uint16)
        else:
            q_, k_, v_, b_ = q, k, v, beta
            o = np.zeros((B, T, HV, V), np.float32)
        ht = np.zeros((N, HV, K, V), np.float32)
        p = make_problem(B, T, H, HV, K, V, dt, KDA_F32, dt, chunk=chunk, safe_gate=safe,
                         num_seqs=0 if cu is None else N, gate=KDA_GATE_SOFTPLUS if kimi else KDA_GATE_NONE)
        cu_arr = None if cu is None else np.asarray(cu, dtype=np.int64)
        inp = KdaInputs()
        inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0 = (a.ctypes.data for a in (q_, k_, v_, g if graw is None else graw, b_, h0))
        if kimi:
            inp.A_log, inp.dt_bias = A_log.ctypes.data, dt_bias.ctypes.data
        if cu_arr is not None:
            inp.cu_seqlens = inp.cu_seqlens_host = cu_arr.ctypes.data
        out = KdaFwdOutputs()
        out.o, out.ht = o.ctypes.data, ht.ctypes.data
        need = C.c_size_t(0)
        ctx.check(lib.kda_chunk_fwd_workspace(ctx.h, C.byref(p), C.byref(out), inp.cu_seqlens_host, C.byref(need)),
                  "kda_chunk_fwd_workspace")
        ws_bytes, staged = need.value, lib.kda_fwd_workspace_size(C.byref(p))
        if ws_bytes != staged:   # the CPU runs the staged forward
            ok = False
            print(f"{name}: kda_chunk_fwd_workspace {ws_bytes} B, kda_fwd_workspace_size {staged} B")
        ws = np.empty(ws_bytes, np.uint8)
        lib.kda_set_workspace(ctx.h, ws.ctypes.data, ws_bytes)
        ctx.check(lib.kda_warmup(ctx.h, C.byref(p)), "kda_warmup")
        ctx.check(lib.kda_chunk_fwd(ctx.h, C.byref(p), C.byref(inp), C.byref(out)), f"kda_chunk_fwd {name}")
        lib.kda_set_workspace(ctx.h, None, 0)
        o_f = (o.astype(np.uint32) << 16).view(np.float32) if dt == KDA_BF16 else o
        ro, rht = np_reference(q, k, v, g, beta, h0, cu_arr, H, HV)
        eo, eh = err_ratio_np(o_f, ro), err_ratio_np(ht, rht)
        good = eo < tol and eh < tol
        ok &= good
        print(f"{name:42s} workspace {ws_bytes:9d} B  err o {eo:.2e}  err ht {eh:.2e}  "
              f"{'ok' if good else 'FAIL (tol %.0e)' % tol}")

    run("fp32 B2 T45 H2 HV4 K16 V24 chunk16", 2, 45, 2, 4, 16, 24, 16, KDA_F32)
    run("fp32 B1 T100 H2 K32 V16 chunk64", 1, 100, 2, 2, 32, 16, 64, KDA_F32)
    run("bf16 varlen [0,13,50,70] H2 K32 V16 safe", 1, 70, 2, 2, 32, 16, 32, KDA_BF16,
        cu=[0, 13, 50, 70], safe=1, tol=1e-2)
    run("fp32 B1 T90 H2 K32 V16 softplus gate (Kimi)", 1, 90, 2, 2, 32, 16, 32, KDA_F32, kimi=True)
    ctx.close()
    print("selftest-cpu:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


# --------------------------------------------------------------------------
# GPU comparison
# --------------------------------------------------------------------------
SHAPES = [  # (B, T, H, K, V) of ANCHORS.md
    (1, 8192, 32, 128, 128),
    (8, 4096, 16, 128, 128),
    (1, 65536, 16, 128, 128),
    (4, 4096, 32, 64, 64),
    (2, 8192, 16, 128, 256),
]
VARLEN = (32768, 16, 128, 128, 8)  # total T, H, K, V, number of sequences


def varlen_cu(total, n, seed):
    import random
    r = random.Random(seed)
    cuts = sorted(r.sample(range(1, total), n - 1))
    return [0] + cuts + [total]


def fla_configs():
    """The config each of FLA's autotuned kernels chose at its latest call (Triton's
    Autotuner.best_config), as 'kernel: config' lines. FLA's time for a shape has moved by up to
    1.7x from one run to the next (B1 T8192 H32 1.08, 1.45, 1.55 or 1.79 ms, K=V=64 1.06 to 1.70;
    H200, 2026-11-29/30), each run a fresh process that autotunes afresh; these lines say whether
    the slow runs chose other configs (at 1.08, 1.45 and 1.79 ms its state kernel's was the same).
    Best effort: any failure gives the reason instead."""
    try:
        from triton.runtime.autotuner import Autotuner
        out = set()
        for name, mod in list(sys.modules.items()):
            if not name.startswith("fla.ops") or mod is None:
                continue
            for obj in list(vars(mod).values()):
                for _ in range(4):  # through wrappers such as triton.heuristics (their .fn)
                    if isinstance(obj, Autotuner) or obj is None:
                        break
                    obj = getattr(obj, "fn", None)
                cfg = getattr(obj, "best_config", None) if isinstance(obj, Autotuner) else None
                if cfg is not None:  # (obj.fn: the JITFunction; its .fn the Python function)
                    fn = getattr(obj, "fn", None)
                    out.add(f"{getattr(getattr(fn, 'fn', fn), '__name__', '?')}: {cfg}")
        return sorted(out)
    except Exception as e:  # a diagnostic: never the benchmark's failure
        return [f"(no configs: {type(e).__name__}: {e})"]


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except Exception:
        return None


def main_gpu(args):
    try:
        import torch
        import torch.nn.functional as F
        import triton
        from triton.testing import do_bench
    except ImportError as e:
        print(f"error: needs PyTorch and Triton ({e})", file=sys.stderr)
        return 2
    try:
        import fla
        from fla.ops.kda import chunk_kda
    except ImportError as e:
        print(f"error: flash-linear-attention is missing ({e}).\n"
              "  install the wheels flash-linear-attention==0.6.0 and fla-core==0.6.0, e.g.\n"
              "  python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && "
              "export PYTHONPATH=/tmp/site", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device visible to PyTorch", file=sys.stderr)
        return 2
    fla_version = getattr(fla, "__version__", "?")
    if fla_version != "0.6.0":
        print(f"warning: FLA version {fla_version}, this comparison was written for 0.6.0", file=sys.stderr)

    lib = load_lib(args.lib)
    dev = torch.device("cuda")
    torch.cuda.init()
    dev_name = torch.cuda.get_device_name()
    if args.peak_gbps:
        peak = args.peak_gbps * 1e9
    elif "H200" in dev_name:
        peak = 4.3e12
    elif "H100" in dev_name:
        peak = 3.0e12
    else:
        peak = None
        print(f"warning: no memory peak known for {dev_name}; give --peak-gbps for the roofline column",
              file=sys.stderr)
    try:
        ctx = Ctx(lib, KDA_BACKEND_CUDA)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stream = torch.cuda.current_stream().cuda_stream
    lib.kda_set_stream(ctx.h, C.c_void_p(stream))

    tdt = torch.float16 if args.fp16 else torch.bfloat16
    kdt = KDA_F16 if args.fp16 else KDA_BF16
    dname = "fp16" if args.fp16 else "bf16"
    safe = bool(args.safe_gate)
    kimi = bool(args.kimi_gate)
    if safe and kimi:
        print("error: --safe-gate and --kimi-gate are two different gates; give one", file=sys.stderr)
        return 2

    cases = [("fixed", s) for s in SHAPES] + ([] if args.no_varlen else [("varlen", VARLEN)])
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        cases = [c for i, c in enumerate(cases) if i in keep]

    def run_case(kind, shape):
        """One case: inputs, agreement, timing. Returns a row dict (with 'err' when a call failed)."""
        torch.manual_seed(args.seed)
        if kind == "fixed":
            B, T, H, K, V = shape
            cu, N = None, B
            label = f"B{B} T{T} H{H} K{K} V{V}"
        else:
            T, H, K, V, N = shape
            B = 1
            cu = varlen_cu(T, N, args.seed)
            label = f"varlen N{N} T{T} H{H} K{K} V{V}"
        HV = H
        sys.stderr.write(f"[{label}] inputs...\n")
        q = torch.randn(B, T, H, K, dtype=tdt, device=dev)
        k = torch.randn(B, T, H, K, dtype=tdt, device=dev)
        v = torch.randn(B, T, HV, V, dtype=tdt, device=dev)
        A_log = dt_bias = None
        if kimi:  # the raw gate input; both compute -exp(A_log) softplus(g + dt_bias) in the kernel
            g = torch.randn(B, T, HV, K, dtype=torch.float32, device=dev)
            A_log = torch.empty(HV, dtype=torch.float32, device=dev).uniform_(1.0, 16.0).log_()
            dt = torch.empty(HV * K, dtype=torch.float32, device=dev).uniform_(math.log(1e-3), math.log(1e-1)).exp_()
            dt_bias = torch.expm1(dt).log_()
        else:
            g = F.logsigmoid(torch.randn(B, T, HV, K, dtype=torch.float32, device=dev))
        if safe:
            g = g.clamp_(-5.0, 0.0)
        beta = torch.sigmoid(torch.randn(B, T, HV, dtype=torch.float32, device=dev)).to(tdt)
        h0 = torch.randn(N, HV, K, V, dtype=torch.float32, device=dev)
        cu_dev = cu_cpu = None
        if cu is not None:
            cu_cpu = torch.tensor(cu, dtype=torch.int64)
            cu_dev = cu_cpu.to(dev)
        o_kda = torch.empty(B, T, HV, V, dtype=tdt, device=dev)
        ht_kda = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)

        p = make_problem(B, T, H, HV, K, V, kdt, KDA_F32, kdt, chunk=64, safe_gate=int(safe),
                         num_seqs=0 if cu is None else N, seqlens_type=KDA_INDEX_I64,
                         gate=KDA_GATE_SOFTPLUS if kimi else KDA_GATE_NONE)
        inp = KdaInputs()
        inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0 = (t.data_ptr() for t in (q, k, v, g, beta, h0))
        if kimi:
            inp.A_log, inp.dt_bias = A_log.data_ptr(), dt_bias.data_ptr()
        if cu is not None:
            inp.cu_seqlens = cu_dev.data_ptr()
            inp.cu_seqlens_host = cu_cpu.data_ptr()   # host copy: no read-back, no stream wait
        out = KdaFwdOutputs()
        out.o, out.ht = o_kda.data_ptr(), ht_kda.data_ptr()
        need = C.c_size_t(0)   # the fused forward's need (its pieces' states), not the staged one's GBs
        ctx.check(lib.kda_chunk_fwd_workspace(ctx.h, C.byref(p), C.byref(out), inp.cu_seqlens_host, C.byref(need)),
                  "kda_chunk_fwd_workspace")
        ws_bytes = need.value
        ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=dev)
        lib.kda_set_workspace(ctx.h, C.c_void_p(ws.data_ptr()), ws_bytes)
        lib.kda_set_stream(ctx.h, C.c_void_p(torch.cuda.current_stream().cuda_stream))
        pr, ir, orf = C.byref(p), C.byref(inp), C.byref(out)
        fwd = lib.kda_chunk_fwd

        def run_kda():
            st = fwd(ctx.h, pr, ir, orf)
            if st != KDA_OK:
                ctx.check(st, "kda_chunk_fwd")

        try:
            sys.stderr.write(f"[{label}] kda warmup (workspace {ws_bytes / 2**20:.0f} MiB)...\n")
            ctx.check(lib.kda_warmup(ctx.h, pr), "kda_warmup")
            run_kda()
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"{label}: kda failed: {e}", file=sys.stderr)
            return dict(label=label, err=f"kda: {e}")

        fla_kw = dict(scale=None, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu)
        if safe:
            fla_kw.update(safe_gate=True, lower_bound=-5.0)
        if kimi:
            fla_kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

        def run_fla():
            return chunk_kda(q, k, v, g, beta, **fla_kw)

        sys.stderr.write(f"[{label}] FLA (the first call autotunes)...\n")
        with torch.no_grad():
            try:
                o_fla, ht_fla = run_fla()
                torch.cuda.synchronize()
            except Exception as e:
                print(f"{label}: FLA failed: {type(e).__name__}: {e}", file=sys.stderr)
                return dict(label=label, err=f"FLA: {type(e).__name__}: {e}")

            def ratio(a, b):
                a, b = a.double(), b.double()
                return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()

            cfgs = fla_configs()
            for line in cfgs:
                print(f"{label}: FLA config {line}", flush=True)
            eo, eh = ratio(o_kda, o_fla), ratio(ht_kda, ht_fla)
            bad = not (math.isfinite(eo) and math.isfinite(eh)) or eo > args.tol or eh > args.tol
            print(f"{label}: err o {eo:.3e}  err ht {eh:.3e}" + ("  <-- ABOVE %g" % args.tol if bad else ""),
                  flush=True)
            del o_fla, ht_fla

            kda_ms = fla_ms = float("nan")
            if not args.no_bench:
                sys.stderr.write(f"[{label}] timing...\n")
                kda_ms = do_bench(run_kda, warmup=25, rep=100, return_mode="median")
                fla_ms = do_bench(run_fla, warmup=25, rep=100, return_mode="median")

        es = torch.finfo(tdt).bits // 8
        tok_heads = B * T * HV
        nbytes = (B * T * H * K * es * 2          # q, k read
                  + tok_heads * V * es * 2        # v read, o written
                  + tok_heads * K * 4             # g fp32 read
                  + tok_heads * es                # beta read
                  + N * HV * K * V * 4 * 2)       # h0 read, ht written (fp32)
        roof_ms = nbytes / peak * 1e3 if peak else float("nan")
        if not args.no_bench:
            print(f"{label}: kda {kda_ms:.3f} ms  FLA {fla_ms:.3f} ms  speed-up {fla_ms / kda_ms:.2f}x  "
                  f"roofline {roof_ms * 1e3:.0f} us -> kda {roof_ms / kda_ms:.1%}, FLA {roof_ms / fla_ms:.1%}",
                  flush=True)
        return dict(label=label, kda_ms=kda_ms, fla_ms=fla_ms, eo=eo, eh=eh, bad=bad, gb=nbytes / 1e9,
                    roof_ms=roof_ms, cfgs=cfgs)

    rows, failed = [], False
    for kind, shape in cases:
        r = run_case(kind, shape)
        rows.append(r)
        failed |= "err" in r or r["bad"]
        lib.kda_set_workspace(ctx.h, None, 0)   # the case's workspace tensor is gone
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    ctx.close()

    commit = args.commit or git_commit() or "unknown"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    peak_s = f"{peak / 1e12:.2f} TB/s" if peak else "unknown"
    head = [
        f"# kda vs FLA chunk_kda, forward ({dname}{', safe_gate' if safe else ''}{', Kimi-init gates' if kimi else ''})",
        "",
        f"Device: {dev_name}. Date: {date}. Commit: {commit}. torch {torch.__version__}, triton "
        f"{triton.__version__}, FLA {fla_version}.",
        (f"Inputs: {dname} q/k/v randn, g = randn fp32 through the softplus gate in the kernel, "
         f"-exp(A_log) softplus(g + dt_bias), with Kimi Linear's initialisation: A_log = log U(1, 16) a head, "
         f"dt_bias = log(expm1(dt)), dt = exp U(log 1e-3, log 1e-1) a channel (FLA use_gate_in_kernel=True, "
         f"kda KDA_GATE_SOFTPLUS), " if kimi else
         f"Inputs: {dname} q/k/v randn, g = logsigmoid(randn) fp32{' clamped to [-5, 0]' if safe else ''}, ") +
        f"beta = sigmoid(randn) {dname}, l2norm in kernel, fp32 h0 and ht, chunk 64"
        f"{', FLA safe_gate=True lower_bound=-5, kda safe_gate=1' if safe else ''}.",
        f"Timing: triton.testing.do_bench median (warmup 25, rep 100), forward only. Error ratio: "
        f"RMS(kda - FLA) / RMS(FLA) (flagged above {args.tol:g}). Roofline: bytes of q, k, v, g, beta read "
        f"and o written once plus fp32 h0/ht, at {peak_s}.",
        "",
        "| shape | kda ms | FLA ms | speed-up (FLA/kda) | kda % roofline | FLA % roofline | GB | err o | err ht |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines = []
    for r in rows:
        if "err" in r:
            lines.append(f"| {r['label']} | failed: {r['err'][:120]} | | | | | | | |")
            continue
        flag = " **!**" if r["bad"] else ""
        lines.append(
            f"| {r['label']} | {r['kda_ms']:.3f} | {r['fla_ms']:.3f} | {r['fla_ms'] / r['kda_ms']:.2f}x | "
            f"{100 * r['roof_ms'] / r['kda_ms']:.1f}% | {100 * r['roof_ms'] / r['fla_ms']:.1f}% | {r['gb']:.3f} | "
            f"{r['eo']:.2e}{flag} | {r['eh']:.2e}{flag} |")
    valid = [r for r in rows if "err" not in r and r["kda_ms"] > 0 and r["fla_ms"] > 0]
    if valid and not args.no_bench:
        gm = math.exp(sum(math.log(r["fla_ms"] / r["kda_ms"]) for r in valid) / len(valid))
        lines.append(f"| geomean | | | {gm:.2f}x | | | | | |")
    # FLA's configs beside its times: a slow FLA run can then be told from a fast one by them
    cfg = [f"- {r['label']}: " + "; ".join(r["cfgs"]) for r in rows if r.get("cfgs")]
    if cfg:
        lines += ["", "FLA's autotuned configs (Triton's best_config after each shape's first call):", ""] + cfg
    md = "\n".join(head + lines) + "\n"
    print()
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
        print(f"wrote {args.out}")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "libkda.so"), help="path of libkda.so")
    ap.add_argument("--selftest-cpu", action="store_true",
                    help="no GPU: check the struct mirrors and run kda_chunk_fwd on the CPU against numpy")
    ap.add_argument("--safe-gate", action="store_true",
                    help="g clamped to [-5, 0]; FLA safe_gate=True lower_bound=-5; kda safe_gate=1")
    ap.add_argument("--kimi-gate", action="store_true",
                    help="the softplus gate in both kernels on raw g = randn, with Kimi Linear's A_log and "
                         "dt_bias initialisation (slow channels: the split shapes take kda's exact split)")
    ap.add_argument("--fp16", action="store_true", help="q, k, v, beta, o in fp16 instead of bf16")
    ap.add_argument("--out", help="also write the table as markdown to this file")
    ap.add_argument("--commit", help="commit to print when `git rev-parse` is not available")
    ap.add_argument("--peak-gbps", type=float, help="memory peak in GB/s (default: 4300 H200, 3000 H100)")
    ap.add_argument("--tol", type=float, default=1e-2, help="flag error ratios above this (default 1e-2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="comma-separated case indices (0-4 the ANCHORS shapes, 5 varlen)")
    ap.add_argument("--no-varlen", action="store_true", help="leave out the varlen case")
    ap.add_argument("--no-bench", action="store_true", help="agreement only, no timing")
    args = ap.parse_args()
    if args.selftest_cpu:
        return selftest_cpu(args)
    return main_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
