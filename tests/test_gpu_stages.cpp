// tests/test_gpu_stages.cpp - every GPU kernel against its CPU twin.
//
// Built two ways from this one source:
//   build/test_gpu_stages  (KDA_TEST_EMU) the generated kernels run on the CPU
//                          through tests/cuda_emu.h, behind kda.h's own device
//                          backend code: CI checks every kernel without a GPU;
//   build/test_gpu         the real CUDA backend on the machine's GPU (make test-gpu).
// All device data goes through kda_malloc / kda_memcpy / kda_memset.
//
//   build/test_gpu_stages [--quick] [--race] [stage ...]    (stages: prepare intra ... bwd_qkb ops, fused, plan, emulator)
//
// For each problem and stage: the CPU runs the stages up to this one; the device
// starts from a copy of the CPU's work buffer taken just before the stage, with
// the stage's outputs poisoned (NaN), runs the stage, and every output must match
// the CPU's. Then the whole operations (kda_chunk_fwd/bwd, kda_recurrent_fwd in
// both forms) run on the emulated device and are compared with the CPU's.
#include <algorithm>
#include <stddef.h>
#include <string>
#include <vector>

#define KDA_IMPLEMENTATION
#include "../kda.h"
#include "testlib.h"

#ifdef KDA_TEST_EMU
// kda_common.cuh.j2 writes kda.h's dtype and gate numbers and the log decay's floor again (NVRTC
// compiles the kernels without kda.h): its values (kda_emu_common_enums; its KDA_LOG_DECAY_MIN
// replaces kda.h's) must equal kda.h's
static constexpr double t_kda_h_floor = KDA_LOG_DECAY_MIN;
#include "cuda_emu.h"
#include "../build/emu/kernels_emu.inc"

static_assert(kda_emu_common_enums[0] == KDA_F32 && kda_emu_common_enums[1] == KDA_F16 && kda_emu_common_enums[2] == KDA_BF16,
              "kda_common.cuh.j2's dtype numbers differ from kda.h's");
static_assert(kda_emu_common_enums[3] == KDA_GATE_NONE && kda_emu_common_enums[4] == KDA_GATE_SOFTPLUS &&
                  kda_emu_common_enums[5] == KDA_GATE_LOWER_BOUND,
              "kda_common.cuh.j2's gate numbers differ from kda.h's");
static_assert(t_kda_h_floor == KDA_LOG_DECAY_MIN, "kda_common.cuh.j2's KDA_LOG_DECAY_MIN differs from kda.h's");

static_assert(sizeof(KdaParams) == sizeof(kda__kparams), "KdaParams and kda__kparams differ");
static_assert(offsetof(KdaParams, scale) == offsetof(kda__kparams, scale), "KdaParams layout");
static_assert(offsetof(KdaParams, Gc) == offsetof(kda__kparams, Gc), "KdaParams layout");
static_assert(offsetof(KdaParams, dw) == offsetof(kda__kparams, dw), "KdaParams layout");
static_assert(offsetof(KdaParams, num_slots) == offsetof(kda__kparams, num_slots), "KdaParams layout");
static_assert(offsetof(KdaParams, fz_any) == offsetof(kda__kparams, fz_any), "KdaParams layout");
static_assert(offsetof(KdaParams, fz_call) == offsetof(kda__kparams, fz_call), "KdaParams layout");

// ---- the emulated device: host memory, kernels from kda_emu_kernels ----
static kda_status emu_alloc(kda_context *, size_t bytes, void **ptr) {
    *ptr = malloc(bytes);
    if (*ptr) memset(*ptr, 0xff, bytes); // NaN: reading memory nothing wrote shows
    return *ptr ? KDA_OK : KDA_ERROR_OUT_OF_MEMORY;
}
static kda_status emu_release(kda_context *, void *ptr) { free(ptr); return KDA_OK; }
static kda_status emu_copy(kda_context *, void *dst, const void *src, size_t bytes, int) {
    memmove(dst, src, bytes);
    return KDA_OK;
}
static kda_status emu_fill(kda_context *, void *dst, int byte, size_t bytes) { memset(dst, byte, bytes); return KDA_OK; }
static int emu_launches, emu_fused, emu_fused_bv, emu_fused_nseg; // fused launches, the last one's value tile and most segments of a sequence
static int emu_pairs;                                               // launches of the fused forward's pairs kernels
static std::vector<int> emu_flags, emu_pieces; // the last bounded split's flags ([piece][HV]: the bound failed) and piece table
static std::vector<int> emu_warm_flags;         // the flags fwd_bound wrote (the warm-ups alone)
static int emu_any;                             // and its fz_any (-1: none, fixed lengths)
static int emu_redo_bound, emu_redo;            // fz_redo holds the call's tag after fwd_bound, after the bounded pass (-1: none)
static std::vector<unsigned char> emu_o_bounded; // o as the bounded pass left it (emu_o_bytes of it)
static size_t emu_o_bytes;                       // (0: none copied; a test that sets it clears it after)
static long long emu_cut[2];                    // and its pieces a sequence and their chunks (fixed lengths)
static long long emu_exact_cut[3];              // the exact passes' after it: pieces, a sequence's, their chunks
static int emu_fixups;                           // fwd_fixup launches (the exact split's fix-up)
static long long emu_trans_cut[2] = {-1, -1};   // the last transition pass's fz_each and fz_lead (fixed lengths' cut)
static std::vector<int> emu_trans_first;        // and its piece table's first chunks by slot (varlen)
static std::vector<double> emu_warm_sums;      // fwd_bound's bound recomputed on the host: [slot][HV], NAN where no state is dropped
// B = sum over a piece's warm-up tokens of max_d g_t[d] / ln 2 in double, from the launch's
// own pieces (its table; fixed lengths cut by kda.h's kda__fz_cut, which kda_fz_span follows)
// and kda.h's gate in double (kda__gate_value)
static void emu_warm_sums_of(const kda__kparams *a) {
    emu_warm_sums.assign((size_t)a->fz_npieces * a->HV, NAN);
    kda_problem gp = kda_problem_default(1, 1, 1, (int)a->K, 1); // what kda__gate_value reads: gate, K, lower bound
    gp.gate = (kda_gate)a->gate, gp.lower_bound = (float)a->lower_bound;
    kda_inputs gi;
    memset(&gi, 0, sizeof gi);
    gi.A_log = a->A_log, gi.dt_bias = a->dt_bias;
    std::vector<int> first(a->fz_piece ? 0 : a->fz_nseg);
    if (!a->fz_piece) kda__fz_cut((a->T + 15) / 16, a->fz_nseg, a->fz_lead, first.data());
    for (long long slot = 0; slot < a->fz_npieces; slot++) {
        const long long n = a->fz_piece ? a->fz_piece[a->fz_npieces + slot] : slot / a->fz_nseg;
        const long long cb = a->fz_piece ? a->fz_piece[2 * a->fz_npieces + slot] : first[slot % a->fz_nseg];
        const long long base = a->fz_piece ? a->fz_piece[3 * a->fz_npieces + n] : n * a->fz_nseg;
        const long long cw = std::max(cb - a->fz_warm, 0LL), bos = a->varlen ? a->seq_bos[n] : n * a->T;
        if (slot == base || cw == 0) continue;
        for (long long hv = 0; hv < a->HV; hv++) {
            double B = 0.0;
            for (long long t = bos + 16 * cw; t < bos + 16 * cb; t++) {
                double m = -INFINITY;
                for (long long d = 0; d < a->K; d++)
                    m = std::max(m, kda__gate_value(&gp, &gi, (int)hv, (int)d,
                                                    kda__ld(a->g, (kda_dtype)a->g_dtype, (size_t)((t * a->HV + hv) * a->K + d))));
                B += m / log(2.0);
            }
            emu_warm_sums[slot * a->HV + hv] = B;
        }
    }
}
static int emu_most_pieces(const kda__kparams *a) { // of one sequence, by the piece table (kda_fz_base)
    int most = a->fz_piece ? 1 : (int)a->fz_nseg;
    for (long long n = 0; a->fz_piece && n < a->N; n++)
        most = std::max(most, a->fz_piece[3 * a->fz_npieces + n + 1] - a->fz_piece[3 * a->fz_npieces + n]);
    return most;
}
// fwd_combine's walk, start_1 = SL_0, start_{s+1} = P_s start_s + SL_s, recomputed in double
// from the launch's own fz_trans, for every sequence and head it walks (kda_fz_exact's rule:
// a flagged piece, or a sequence left whole where fwd_bound flagged any): each start within
// 1e-5 of the largest element (fp32 sums of K products). Every emulated combine is checked.
static void emu_check_combine(const kda__kparams *a) {
    const long long HV = a->HV, K = a->K, V = a->V, rows = V + K;
    for (long long n = 0; n < a->N; n++)
        for (long long hv = 0; hv < HV; hv++) {
            if (a->fz_flags) {
                const long long b = a->fz_fseq ? a->fz_fseq[n] : n * a->fz_fnseg, e = a->fz_fseq ? a->fz_fseq[n + 1] : b + a->fz_fnseg;
                bool exact = e == b + 1 ? a->fz_any && *a->fz_any : false;
                for (long long sl = b + 1; sl < e; sl++) exact |= a->fz_flags[sl * HV + hv] != 0;
                if (!exact) continue;
            }
            const long long base = a->fz_piece ? a->fz_piece[3 * a->fz_npieces + n] : n * a->fz_nseg;
            const long long last = (a->fz_piece ? a->fz_piece[3 * a->fz_npieces + n + 1] - base : a->fz_nseg) - 1;
            auto tr = [&](long long sl) { return a->fz_trans + ((base + sl) * HV + hv) * rows * K; };
            std::vector<double> st(tr(0), tr(0) + V * K), nx(V * K); // start^T [v][key]
            for (long long sl = 1; sl <= last; sl++) {
                const float *got = a->fz_start + ((base + sl) * HV + hv) * V * K;
                double big = 0.0, worst = 0.0;
                for (long long i = 0; i < V * K; i++) big = std::max(big, fabs(st[i])), worst = std::max(worst, fabs(got[i] - st[i]));
                CHECK(worst <= 1e-5 * big + 1e-30, "fwd_combine: sequence %lld head %lld start %lld off by %.3g of %.3g", n, hv, sl, worst, big);
                if (sl == last) break;
                const float *t = tr(sl);
                for (long long v = 0; v < V; v++)
                    for (long long d = 0; d < K; d++) {
                        double x = t[v * K + d];
                        for (long long e = 0; e < K; e++) x += st[v * K + e] * t[(V + e) * K + d];
                        nx[v * K + d] = x;
                    }
                st.swap(nx);
            }
        }
}
static kda_status emu_launch(kda_context *ctx, const kda__kdesc *k, const unsigned grid[3], const kda__kparams *a) {
    if (!strncmp(k->stage, "fwd_fused", 9)) emu_fused++, emu_fused_bv = k->bv, emu_fused_nseg = emu_most_pieces(a);
    for (const kda_emu_kernel &e : kda_emu_kernels)
        if (!strcmp(e.name, k->name)) {
            kda_emu_dim3 g;
            g.x = grid[0]; g.y = grid[1]; g.z = grid[2];
            KdaParams prm;
            memcpy(&prm, a, sizeof prm);
            const bool pairs = kda__fused_is_pairs(k); // (clusters of two, as kda.h's launch makes them)
            kda_emu_launch(e.fn, g, (unsigned)k->threads, prm, (size_t)k->smem, pairs ? 2u : 1u, kda__fused_pair_axis(grid));
            emu_launches++;
            if (pairs) emu_pairs++;
            if (!strncmp(k->stage, "fwd_combine", 11)) emu_check_combine(a); // (and fwd_combine_ht, which walks on to ht)
            if (!strcmp(k->stage, "fwd_bound"))
                emu_warm_flags.assign(a->fz_flags, a->fz_flags + a->fz_npieces * a->HV), emu_warm_sums_of(a),
                    emu_any = a->fz_any ? *a->fz_any : -1, emu_redo_bound = a->fz_redo ? *a->fz_redo == (int)a->fz_call : -1;
            if (!strcmp(k->stage, "fwd_fused_bounded") || !strcmp(k->stage, "fwd_fused_bounded_pairs"))
                emu_flags.assign(a->fz_flags, a->fz_flags + a->fz_npieces * a->HV),
                    emu_pieces.assign(a->fz_piece, a->fz_piece ? a->fz_piece + 3 * a->fz_npieces + a->N + 1 : a->fz_piece),
                    emu_cut[0] = a->fz_nseg, emu_cut[1] = a->fz_each, emu_redo = a->fz_redo ? *a->fz_redo == (int)a->fz_call : -1,
                    emu_o_bounded.assign((const unsigned char *)a->o, (const unsigned char *)a->o + emu_o_bytes);
            const bool trans = !strncmp(k->stage, "fwd_fused_trans", 15); // (the fix-up's transition pass)
            if ((!strcmp(k->stage, "fwd_fused") || !strcmp(k->stage, "fwd_fused_pairs") || trans) && a->fz_mode == 1)
                emu_trans_cut[0] = a->fz_each, emu_trans_cut[1] = a->fz_lead,
                emu_trans_first.assign(a->fz_piece ? a->fz_piece + 2 * a->fz_npieces : a->fz_piece,
                                       a->fz_piece ? a->fz_piece + 3 * a->fz_npieces : a->fz_piece);
            if ((((!strcmp(k->stage, "fwd_fused") || !strcmp(k->stage, "fwd_fused_pairs")) && a->fz_mode == 0) || trans) && a->fz_flags)
                emu_exact_cut[0] = a->fz_npieces, emu_exact_cut[1] = a->fz_nseg, emu_exact_cut[2] = a->fz_each;
            emu_fixups += !strcmp(k->stage, "fwd_fixup");
            return KDA_OK;
        }
    return kda__fail(ctx, KDA_ERROR_INTERNAL, "emulator: no kernel %s", k->name);
}
static kda_status emu_sync(kda_context *) { return KDA_OK; }
static void emu_destroy(kda_context *) {}
static int emu_smem_limit; // dynamic shared memory the emulated device gives a block (0: unknown)
static int emu_smem_optin(kda_context *) { return emu_smem_limit; }
static int emu_pairs_ok(kda_context *) { return 1; } // the emulator runs clusters (tests/cuda_emu.h)
static const kda__devops emu_ops = {"emulator", emu_alloc, emu_release, emu_copy, emu_fill, emu_launch, emu_sync, emu_destroy,
                                    nullptr, emu_smem_optin, nullptr, emu_pairs_ok};

static kda_context *dev_ctx() {
    kda_context *ctx = NULL;
    if (kda__context_create_dev(&ctx, KDA_BACKEND_CUDA, &emu_ops, NULL, NULL) != KDA_OK) exit(2);
    return ctx;
}
#else
static kda_context *dev_ctx() {
    kda_context *ctx = NULL;
    kda_status s = kda_context_create(&ctx, KDA_BACKEND_CUDA, NULL);
    if (s != KDA_OK) {
        printf("no GPU: %s\n", ctx ? kda_last_error(ctx) : "out of memory");
        exit(3);
    }
    return ctx;
}
#endif

// ---- device buffers ----
static kda_context *g_dev;
static std::vector<void *> g_allocs;
static void *dalloc(size_t bytes) {
    void *p = NULL;
    if (kda_malloc(g_dev, bytes ? bytes : 1, &p) != KDA_OK) { printf("kda_malloc: %s\n", kda_last_error(g_dev)); exit(2); }
    g_allocs.push_back(p);
    return p;
}
static void *dup(const void *host, size_t bytes) {
    if (!host) return NULL;
    void *p = dalloc(bytes);
    kda_memcpy(g_dev, p, host, bytes, KDA_COPY_H2D);
    return p;
}
static void down(void *host, const void *dev, size_t bytes) {
    if (kda_memcpy(g_dev, host, dev, bytes, KDA_COPY_D2H) != KDA_OK) printf("kda_memcpy: %s\n", kda_last_error(g_dev));
}
static void dpoison(void *dev, size_t bytes) { if (dev && bytes) kda_memset(g_dev, dev, 0xff, bytes); }
static void dfree_all() {
    for (void *p : g_allocs) kda_free(g_dev, p);
    g_allocs.clear();
}

// ---- problems ----
struct Cfg {
    const char *name;
    kda_problem p;
    std::vector<long long> cu;
    int has_h0, has_dht;
};
static std::vector<Cfg> configs(bool quick) {
    std::vector<Cfg> v;
    kda_problem p;
    p = kda_problem_default(2, 21, 1, 7, 5); p.HV = 2; p.chunk_size = 16;
    v.push_back({"fixed_B2_T21_K7_V5_gva_bt16", p, {}, 1, 1});
    p = kda_problem_default(1, 90, 1, 20, 9); p.HV = 2; p.chunk_size = 32; p.num_seqs = 3; p.seqlens_type = KDA_INDEX_I32;
    p.gate = KDA_GATE_SOFTPLUS; p.qk_l2norm = 1; p.beta_sigmoid = 1; p.state_layout = KDA_STATE_VK; p.dtype = KDA_BF16;
    v.push_back({"varlen_empty_softplus_l2norm_vk_bf16_bt32", p, {0, 37, 37, 90}, 1, 1});
    if (quick) return v;
    p = kda_problem_default(1, 70, 2, 60, 100); p.chunk_size = 64; p.gate = KDA_GATE_LOWER_BOUND; p.lower_bound = -5.0f;
    p.beta_sigmoid = 1; p.allow_neg_eigval = 1; p.dtype = KDA_F16; p.g_dtype = KDA_F16; p.beta_dtype = KDA_F16;
    v.push_back({"lowerbound_negeig_K60_V100_f16_bt64", p, {}, 1, 1});
    p = kda_problem_default(1, 40, 1, 130, 33); p.chunk_size = 16; p.num_seqs = 2; p.seqlens_type = KDA_INDEX_I64;
    v.push_back({"varlen_K130_V33_nostate_bt16", p, {0, 1, 40}, 0, 0});
    p = kda_problem_default(1, 33, 1, 200, 40); p.chunk_size = 32; p.qk_l2norm = 1; p.dtype = KDA_BF16;
    v.push_back({"K200_V40_l2norm_bf16_bt32", p, {}, 1, 0});
    /* decode: one token from a given state, which the pool test's result then mostly is (a long
       sequence forgets its initial state, and would let an error in loading it pass) */
    p = kda_problem_default(4, 1, 2, 128, 128); p.chunk_size = 64; p.qk_l2norm = 1; p.dtype = KDA_BF16;
    v.push_back({"decode_B4_T1_K128_V128_l2norm_bf16", p, {}, 1, 0});
    p = kda_problem_default(3, 1, 1, 64, 40); p.chunk_size = 16; p.state_layout = KDA_STATE_VK;
    v.push_back({"decode_B3_T1_K64_V40_vk", p, {}, 1, 0});
    return v;
}

// ---- helpers ----
static std::vector<std::string> g_only;
static bool want(const char *stage) {
    if (g_only.empty()) return true;
    for (auto &s : g_only)
        if (s == stage) return true;
    return false;
}
static double err_f(const float *ref, const float *x, size_t n) { return t_err(ref, x, n); }
static double err_d(const double *ref, const double *x, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return INFINITY;
        double d = ref[i] - x[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    if (num == 0) return 0;
    return den > 0 ? sqrt(num / den) : INFINITY;
}
// an external output of n elements of dtype t, compared as floats
static double err_t(const void *ref, const void *x, size_t n, kda_dtype t) {
    std::vector<float> a(n), b(n);
    for (size_t i = 0; i < n; i++) { a[i] = kda__ld(ref, t, i); b[i] = kda__ld(x, t, i); }
    return t_err(a.data(), b.data(), n);
}

// Converts the instance's fp32 inputs to the problem's dtypes.
struct Data {
    std::vector<unsigned char> q, k, v, g, beta, dout;
};
static std::vector<unsigned char> conv(const float *x, size_t n, kda_dtype t) {
    std::vector<unsigned char> out(n * kda_dtype_size(t) + 1);
    for (size_t i = 0; i < n; i++) kda__st(out.data(), t, i, x[i]);
    return out;
}

// ---- per-stage comparison ----
struct Field { const char *name; size_t off; size_t count; int dbl; };

// The instance's inputs on the device (fp32 data converted to the problem's dtypes).
struct DevIn {
    Data D;
    kda_inputs host, dev; // host: for the CPU; dev: device pointers plus the host copy of cu_seqlens
    void *dout, *dht;
};
static void dev_inputs(DevIn &X, const t_inst &I) {
    const kda_problem &p = I.p;
    X.D.q = conv(I.q, I.nq, p.dtype); X.D.k = conv(I.k, I.nq, p.dtype); X.D.v = conv(I.v, I.nv, p.dtype);
    X.D.g = conv(I.g, I.ng, p.g_dtype); X.D.beta = conv(I.beta, I.nb, p.beta_dtype); X.D.dout = conv(I.dout, I.nv, p.dtype);
    X.host = t_inputs(&I);
    X.host.q = X.D.q.data(); X.host.k = X.D.k.data(); X.host.v = X.D.v.data(); X.host.g = X.D.g.data();
    X.host.beta = X.D.beta.data();
    X.dev = X.host;
    X.dev.q = dup(X.D.q.data(), X.D.q.size()); X.dev.k = dup(X.D.k.data(), X.D.k.size());
    X.dev.v = dup(X.D.v.data(), X.D.v.size()); X.dev.g = dup(X.D.g.data(), X.D.g.size());
    X.dev.beta = dup(X.D.beta.data(), X.D.beta.size());
    X.dev.A_log = (const float *)dup(I.A_log, sizeof(float) * p.HV);
    X.dev.dt_bias = (const float *)dup(I.dt_bias, sizeof(float) * p.HV * p.K);
    X.dev.h0 = (const float *)dup(I.h0, sizeof(float) * I.ns);
    if (p.num_seqs) {
        size_t cb = (size_t)(p.num_seqs + 1) * (p.seqlens_type == KDA_INDEX_I64 ? 8 : 4);
        X.dev.cu_seqlens = dup(X.host.cu_seqlens, cb);
        X.dev.cu_seqlens_host = X.host.cu_seqlens;
    }
    X.dout = dup(X.D.dout.data(), X.D.dout.size());
    X.dht = dup(I.dht, sizeof(float) * I.ns);
}

// One output tensor: a host copy for the CPU, a device buffer, and a host copy of that.
struct Out {
    std::vector<unsigned char> c, h; // CPU result, device result (downloaded)
    void *d;
    size_t bytes;
    void init(size_t b) { bytes = b; c.assign(b + 4, 0); h.assign(b + 4, 0); d = dalloc(b + 4); }
    void poison() { dpoison(d, bytes); }
    void fetch() { down(h.data(), d, bytes); }
};

static void run_config(const Cfg &cf) {
    kda_context *cpu = t_cpu();
    t_inst I;
    t_inst_init(&I, &cf.p, cf.cu.empty() ? NULL : cf.cu.data(), cf.has_h0, cf.has_dht);
    const kda_problem &p = I.p;
    DevIn X;
    dev_inputs(X, I);
    const kda_inputs &in = X.host, &din = X.dev;
    const size_t wsz = kda_work_layout(&p, KDA_WORK_FWD | KDA_WORK_BWD, NULL, NULL);
    unsigned char *wc_buf = (unsigned char *)aligned_alloc(256, (wsz + 255) & ~(size_t)255);
    unsigned char *wb_buf = (unsigned char *)aligned_alloc(256, (wsz + 255) & ~(size_t)255);
    unsigned char *wh_buf = (unsigned char *)aligned_alloc(256, (wsz + 255) & ~(size_t)255);
    unsigned char *wd_buf = (unsigned char *)dalloc(wsz + 256);
    wd_buf += (256 - ((uintptr_t)wd_buf & 255)) & 255; /* the same alignment as the host copies */
    memset(wc_buf, 0, wsz);
    kda_work wc, wd;
    kda_work_layout(&p, KDA_WORK_FWD | KDA_WORK_BWD, wc_buf, &wc);
    kda_work_layout(&p, KDA_WORK_FWD | KDA_WORK_BWD, wd_buf, &wd);
    const size_t es = kda_dtype_size(p.dtype), nst = I.ns;
    Out o, dv, dq, dk, dg, db, ht, dh0, dA, ddt;
    o.init(I.nv * es); dv.init(I.nv * es); dq.init(I.nq * es); dk.init(I.nq * es);
    dg.init(I.ng * kda_dtype_size(p.g_dtype)); db.init(I.nb * kda_dtype_size(p.beta_dtype));
    ht.init(nst * 4); dh0.init(nst * 4); dA.init(sizeof(float) * p.HV); ddt.init(sizeof(float) * p.HV * p.K);
    const size_t rows = (size_t)p.B * p.T, VK = rows * p.HV * p.K, VV = rows * p.HV * p.V;
    /* states: only the NT chunks that exist are written (the buffer holds an upper bound) */
    const size_t VB = rows * p.HV * p.chunk_size, HK = rows * p.H * p.K;
    const size_t S = (size_t)kda_num_chunks(&p, in.cu_seqlens) * p.HV * p.K * p.V;
    auto off = [&](const void *f) { return (size_t)((const unsigned char *)f - (const unsigned char *)wc.qn); };
    const unsigned char *base = (const unsigned char *)wc.qn;
    struct Stage { const char *name; std::vector<Field> out; };
    std::vector<Stage> stages = {
        {"prepare", {{"qn", off(wc.qn), HK, 0}, {"kn", off(wc.kn), HK, 0}, {"beta", off(wc.beta), rows * p.HV, 0}}},
        {"gate_cumsum", {{"G", off(wc.G), VK, 1}}},
        {"intra", {{"Aqk", off(wc.Aqk), VB, 0}, {"L", off(wc.L), VB, 0}}},
        {"solve", {{"M", off(wc.M), VB, 0}}},
        {"wu", {{"w", off(wc.w), VK, 0}, {"u", off(wc.u), VV, 0}, {"kg", off(wc.kg), VK, 0}, {"qg", off(wc.qg), VK, 0}}},
        {"state", {{"h", off(wc.h), S, 0}, {"vn", off(wc.vn), VV, 0}}},
        {"output", {}},
        {"bwd_dav", {{"dAqk", off(wc.dAqk), VB, 0}, {"dvl", off(wc.dvl), VV, 0}}},
        {"bwd_dhu", {{"dh", off(wc.dh), S, 0}, {"dv2", off(wc.dv2), VV, 0}}},
        {"bwd_wy", {{"dqh", off(wc.dqh), VK, 0}, {"dkh", off(wc.dkh), VK, 0}, {"dG", off(wc.dG), VK, 1},
                    {"dL", off(wc.dL), VB, 0}, {"dbeta", off(wc.dbeta), rows * p.HV, 0}, {"dw", off(wc.dw), VK, 0}}},
        {"bwd_intra", {{"dqh", off(wc.dqh), VK, 0}, {"dkh", off(wc.dkh), VK, 0}, {"dG", off(wc.dG), VK, 1},
                       {"dbeta", off(wc.dbeta), rows * p.HV, 0}}},
        {"bwd_cumsum", {{"dgate", off(wc.dgate), VK, 0}}},
        {"bwd_gate", {}},
        {"bwd_qkb", {{"dqn", off(wc.dqn), HK, 0}, {"dkn", off(wc.dkn), HK, 0}}},
    };
    if (p.qk_l2norm) {
        stages[0].out.push_back({"rstd_q", off(wc.rstd_q), rows * p.H, 0});
        stages[0].out.push_back({"rstd_k", off(wc.rstd_k), rows * p.H, 0});
    }
    const bool accumulates[] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0}; // bwd_intra adds to its outputs
    for (size_t si = 0; si < stages.size(); si++) {
        const Stage &st = stages[si];
        memcpy(wb_buf, wc_buf, wsz); // the work before the stage
        auto run = [&](bool is_dev) -> kda_status {
            kda_context *ctx = is_dev ? g_dev : cpu;
            kda_work *w = is_dev ? &wd : &wc;
            const kda_inputs *ip = is_dev ? &din : &in;
            auto P = [&](Out &x) -> void * { return is_dev ? x.d : (void *)x.c.data(); };
            const void *dout = is_dev ? X.dout : X.D.dout.data();
            const float *dht = is_dev ? (const float *)X.dht : I.dht;
            switch (si) {
            case 0: return kda_stage_prepare(ctx, &p, ip, w);
            case 1: return kda_stage_gate_cumsum(ctx, &p, ip, w);
            case 2: return kda_stage_intra(ctx, &p, ip, w);
            case 3: return kda_stage_solve(ctx, &p, ip, w);
            case 4: return kda_stage_wu(ctx, &p, ip, w);
            case 5: return kda_stage_state(ctx, &p, ip, w, (float *)P(ht));
            case 6: return kda_stage_output(ctx, &p, ip, w, P(o));
            case 7: return kda_stage_bwd_dAv(ctx, &p, ip, w, dout);
            case 8: return kda_stage_bwd_dhu(ctx, &p, ip, w, dout, dht, cf.has_h0 ? (float *)P(dh0) : NULL);
            case 9: return kda_stage_bwd_wy(ctx, &p, ip, w, dout, P(dv));
            case 10: return kda_stage_bwd_intra(ctx, &p, ip, w);
            case 11: return kda_stage_bwd_cumsum(ctx, &p, ip, w);
            case 12: return kda_stage_bwd_gate(ctx, &p, ip, w, P(dg), I.A_log ? (float *)P(dA) : NULL,
                                               I.dt_bias ? (float *)P(ddt) : NULL);
            default: return kda_stage_bwd_qkb(ctx, &p, ip, w, P(dq), P(dk), P(db));
            }
        };
        kda_status sc = run(false);
        CHECK(sc == KDA_OK, "%s: CPU stage %s failed: %s", cf.name, st.name, kda_last_error(cpu));
        if (!want(st.name)) continue;
        t_current = st.name;
        kda_memcpy(g_dev, wd_buf, wb_buf, wsz, KDA_COPY_H2D);
        if (!accumulates[si])
            for (const Field &f : st.out) dpoison(wd_buf + f.off, f.count * (f.dbl ? 8 : 4));
        for (Out *x : {&o, &dv, &dq, &dk, &dg, &db, &ht, &dh0, &dA, &ddt}) x->poison();
        kda_status sd = run(true);
        CHECK(sd == KDA_OK, "%s: device stage %s failed: %s", cf.name, st.name, kda_last_error(g_dev));
        if (sd != KDA_OK) continue;
        CHECK(kda_synchronize(g_dev) == KDA_OK, "%s: %s: %s", cf.name, st.name, kda_last_error(g_dev));
        down(wh_buf, wd_buf, wsz);
        for (const Field &f : st.out) {
            double e = f.dbl ? err_d((const double *)(base + f.off), (const double *)(wh_buf + f.off), f.count)
                             : err_f((const float *)(base + f.off), (const float *)(wh_buf + f.off), f.count);
            /* G is a double cumsum on both sides; everything else is fp32 arithmetic */
            double tol = strcmp(f.name, "G") == 0 ? 1e-12 : 1e-5;
            CHECK(e <= tol, "%s: %s.%s error ratio %.3g > %.3g", cf.name, st.name, f.name, e, tol);
        }
        const double tx = p.dtype == KDA_F32 ? 1e-5 : 1e-2; // external outputs are rounded to the dtype
        auto cmp_t = [&](Out &x, size_t n, kda_dtype t, double tol, const char *what) {
            x.fetch();
            CHECK(err_t(x.c.data(), x.h.data(), n, t) <= tol, "%s: %s", cf.name, what);
        };
        auto cmp_f = [&](Out &x, size_t n, const char *what) {
            x.fetch();
            CHECK(err_f((const float *)x.c.data(), (const float *)x.h.data(), n) <= 1e-5, "%s: %s", cf.name, what);
        };
        switch (si) {
        case 5: cmp_f(ht, nst, "state.ht"); break;
        case 6: cmp_t(o, I.nv, p.dtype, tx, "output.o"); break;
        case 8: if (cf.has_h0) cmp_f(dh0, nst, "bwd_dhu.dh0"); break;
        case 9: cmp_t(dv, I.nv, p.dtype, tx, "bwd_wy.dv"); break;
        case 12:
            cmp_t(dg, I.ng, p.g_dtype, p.g_dtype == KDA_F32 ? 1e-5 : 1e-2, "bwd_gate.dg");
            if (I.A_log) cmp_f(dA, p.HV, "bwd_gate.dA_log");
            if (I.dt_bias) cmp_f(ddt, (size_t)p.HV * p.K, "bwd_gate.ddt_bias");
            break;
        case 13:
            cmp_t(dq, I.nq, p.dtype, tx, "bwd_qkb.dq");
            cmp_t(dk, I.nq, p.dtype, tx, "bwd_qkb.dk");
            cmp_t(db, I.nb, p.beta_dtype, p.beta_dtype == KDA_F32 ? 1e-5 : 1e-2, "bwd_qkb.dbeta");
            break;
        }
    }
    free(wc_buf); free(wb_buf); free(wh_buf);
    dfree_all();
    t_inst_free(&I);
    kda_context_destroy(cpu);
}

// ---- the tensor-core fragment layout: D = A B + C, one warp per product ----
// The emulator (tests/cuda_emu.h) mirrors the PTX layouts; on a GPU the same test
// checks that the mirror is the hardware's, so kernels built on mma can be
// trusted when CI runs them on the emulator.
static void run_mma() {
    const int M = 64;
    t_current = "selftest_mma";
    for (int dt = 1; dt <= 2; dt++) { /* KDA_F16, KDA_BF16 */
        kda_problem p = kda_problem_default(1, 1, 1, 16, 8);
        p.dtype = (kda_dtype)dt;
        const kda__kdesc *k = kda__kernel_find(g_dev, KDA__STAGE_SELFTEST_MMA, &p);
        CHECK(k != NULL, "no selftest_mma kernel for %s", kda_dtype_name(p.dtype));
        if (!k) continue;
        std::vector<float> A((size_t)M * 256), B((size_t)M * 128), C((size_t)M * 128), D((size_t)M * 128);
        auto rnd = [&](float x) { return dt == KDA_BF16 ? kda_bf16_to_f32(kda_f32_to_bf16(x)) : kda_f16_to_f32(kda_f32_to_f16(x)); };
        for (float &x : A) x = rnd((float)t_randn());
        for (float &x : B) x = rnd((float)t_randn());
        for (float &x : C) x = (float)t_randn();
        kda__kparams a;
        memset(&a, 0, sizeof a);
        a.qn = (float *)dup(A.data(), A.size() * 4);
        a.kn = (float *)dup(B.data(), B.size() * 4);
        a.Aqk = (float *)dup(C.data(), C.size() * 4);
        a.L = (float *)dalloc(D.size() * 4);
        a.HV = M;
        unsigned grid[3] = {(unsigned)M, 1, 1};
        CHECK(g_dev->dev->launch(g_dev, k, grid, &a) == KDA_OK, "launch %s: %s", k->name, kda_last_error(g_dev));
        down(D.data(), a.L, D.size() * 4);
        double worst = 0;
        for (int m = 0; m < M; m++)
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < 8; j++) {
                    double ref = C[(size_t)m * 128 + i * 8 + j];
                    for (int kk = 0; kk < 16; kk++) ref += (double)A[(size_t)m * 256 + i * 16 + kk] * B[(size_t)m * 128 + kk * 8 + j];
                    double e = fabs(D[(size_t)m * 128 + i * 8 + j] - ref) / (1.0 + fabs(ref));
                    if (!(e <= worst)) worst = e;
                }
        CHECK(worst < 1e-5, "%s: D = A B + C off by %.3g (a fragment layout differs)", k->name, worst);
        dfree_all();
    }
}

// ---- the fused forward (o and ht only) against the CPU's staged fp32 forward ----
// The fused kernel rounds its matmul operands to bf16, so it is held to 1e-2 (error
// ratio) where the staged kernels are held to 1e-5; kda-case --device gpu holds both
// to the float64 references. It must also differ from the staged device path: that
// is how this test knows the fused kernel ran (the emulator also counts launches).
static std::vector<Cfg> fused_configs() {
    std::vector<Cfg> v;
    kda_problem p;
    p = kda_problem_default(2, 70, 1, 64, 72); p.HV = 2; p.dtype = KDA_BF16; p.gate = KDA_GATE_SOFTPLUS;
    p.qk_l2norm = 1; p.beta_sigmoid = 1;
    v.push_back({"fused_B2_T70_K64_V72_gva_softplus_l2norm_bf16", p, {}, 1, 0});
    p = kda_problem_default(1, 77, 1, 128, 64); p.dtype = KDA_F16; p.g_dtype = KDA_F16; p.beta_dtype = KDA_F16;
    p.num_seqs = 4; p.seqlens_type = KDA_INDEX_I32; p.gate = KDA_GATE_LOWER_BOUND; p.lower_bound = -5.0f;
    p.state_layout = KDA_STATE_VK; p.beta_sigmoid = 1; p.allow_neg_eigval = 1;
    v.push_back({"fused_varlen_K128_V64_lowerbound_negeig_vk_f16", p, {0, 5, 40, 40, 77}, 1, 0});
    p = kda_problem_default(1, 100, 1, 32, 16); p.dtype = KDA_BF16;
    v.push_back({"fused_split3_T100_K32_V16_bf16", p, {}, 1, 0});
    p = kda_problem_default(1, 50, 1, 48, 24); p.dtype = KDA_BF16; p.gate = KDA_GATE_SOFTPLUS;
    v.push_back({"fused_wide_gate_T50_K48_V24_bf16", p, {}, 0, 0});
    p = kda_problem_default(1, 60, 1, 128, 32); p.dtype = KDA_BF16; p.gate = KDA_GATE_SOFTPLUS; p.qk_l2norm = 1;
    v.push_back({"fused_strong_gate_T60_K128_V32_bf16", p, {}, 1, 0});
    p.K = 48;
    v.push_back({"fused_strong_gate_T60_K48_V32_bf16", p, {}, 1, 0});
    v.push_back({"fused_edge_gate_T60_K48_V32_bf16", p, {}, 1, 0});
    p.K = 128;
    v.push_back({"fused_edge_gate_T60_K128_V32_bf16", p, {}, 1, 0});
    // K, V % 8 != 0: rows are not 16-byte aligned, the inputs come and o leaves element by element
    p = kda_problem_default(2, 63, 2, 60, 36); p.dtype = KDA_BF16; p.g_dtype = KDA_BF16; p.gate = KDA_GATE_SOFTPLUS;
    p.qk_l2norm = 1;
    v.push_back({"fused_B2_T63_K60_V36_bf16g_unaligned_rows", p, {}, 1, 0});
    p.gate = KDA_GATE_LOWER_BOUND; p.lower_bound = -5.0f; p.g_dtype = KDA_F32; p.K = 56; p.V = 40; // (rows and channels past the 64-key tile)
    v.push_back({"fused_B2_T63_K56_V40_lowerbound_rate_0_and_inf", p, {}, 1, 0});
    // steps of -inf decay (cut): g as given, and the softplus gate of g = +inf with exp(A_log)
    // past FLT_MAX and below 1e-36 (bf16 g); l2norm, so that segments 2 and 3 take the bounded split
    p = kda_problem_default(2, 70, 1, 64, 40); p.dtype = KDA_BF16; p.qk_l2norm = 1;
    v.push_back({"fused_B2_T70_K64_V40_cut", p, {}, 1, 0});
    p = kda_problem_default(1, 75, 1, 128, 32); p.HV = 2; p.dtype = KDA_BF16; p.g_dtype = KDA_BF16;
    p.gate = KDA_GATE_SOFTPLUS; p.qk_l2norm = 1;
    v.push_back({"fused_B1_T75_K128_V32_cut_softplus_bf16g", p, {}, 1, 0});
    // several column blocks (V = 144: the last block's columns past V masked; bv 64: 3 blocks;
    // bv 128: two, on Hopper and in the emulator a pair sharing its factors), fixed lengths and
    // varlen, K 128 and 64 (small: the emulator runs these under the sanitizers in CI)
    p = kda_problem_default(2, 80, 1, 128, 144); p.dtype = KDA_BF16; p.gate = KDA_GATE_SOFTPLUS; p.qk_l2norm = 1;
    v.push_back({"fused_B2_T80_K128_V144_two_column_blocks_bf16", p, {}, 1, 0});
    p = kda_problem_default(1, 90, 1, 64, 256); p.dtype = KDA_F16; p.qk_l2norm = 1; p.num_seqs = 3; p.seqlens_type = KDA_INDEX_I32;
    v.push_back({"fused_varlen_K64_V256_two_column_blocks_f16", p, {0, 7, 40, 90}, 1, 0});
    // fp16 q and k through the row norms by mma of the 128 x 128 kernels (m16n8k8 in fp16)
    p = kda_problem_default(1, 45, 2, 128, 128); p.dtype = KDA_F16; p.qk_l2norm = 1;
    v.push_back({"fused_B1_T45_K128_V128_l2norm_f16", p, {}, 1, 0});
    // the same norms over a tile with channels past K (zero), fetched in 16-byte pieces (the
    // bounded split's K = 100 tests fetch element by element)
    p = kda_problem_default(1, 45, 1, 120, 128); p.dtype = KDA_BF16; p.qk_l2norm = 1;
    v.push_back({"fused_B1_T45_K120_V128_l2norm_bf16", p, {}, 1, 0});
    // a slow decay (g / 50: about 0.77 a chunk), so that the state a chunk carries into the next
    // counts in o (with logsigmoid gates it is 2^-18 of itself after a chunk)
    p = kda_problem_default(1, 100, 2, 128, 128); p.dtype = KDA_BF16; p.qk_l2norm = 1;
    v.push_back({"fused_B1_T100_K128_V128_slow_gate_bf16", p, {}, 1, 0});
    // the slow decay in the kernels that take a chunk's factors from elsewhere: varlen (chunks
    // from the piece table; V = 160: three column blocks at bv 64, at bv 128 a pair with its last
    // columns masked) and V = 256 (a pair: half of the chunks' factors, their decays among them,
    // come from the other block's groups)
    p = kda_problem_default(1, 150, 1, 128, 160); p.dtype = KDA_BF16; p.qk_l2norm = 1; p.num_seqs = 3; p.seqlens_type = KDA_INDEX_I32;
    v.push_back({"fused_varlen_K128_V160_slow_gate_bf16", p, {0, 90, 107, 150}, 1, 0});
    p = kda_problem_default(1, 100, 1, 128, 256); p.dtype = KDA_BF16; p.qk_l2norm = 1;
    v.push_back({"fused_B1_T100_K128_V256_slow_gate_pairs_bf16", p, {}, 1, 0});
    return v;
}
// the fused config of that name into *cf, or false (a renamed config must not drop out unseen)
static bool fused_config(const char *name, Cfg *cf) {
    for (const Cfg &c : fused_configs())
        if (!strcmp(name, c.name)) return *cf = c, true;
    return false;
}
// Gates at the edge of the fused kernel's factored products: every 7th token forgets
// (wide: g -> -1000, past SPAN: the per-pair fallback), or half the channels decay by 5 a
// token from token 17 through chunk 2 (strong: 58 (base 2) a half chunk, past the four-tile
// bound: factored through row 7 with exponents near 2^58; the other half keeps the state, so
// o still depends on it), or by 3.8 a token (edge: 44 a half chunk, under the bound: four
// tiles with exponents near 2^88); or (rate_0_and_inf) exp(A_log) underflows to 0 on head 0:
// the lower-bound gate is lb / 2 everywhere, and g's -inf padding must still gate to 0; and
// overflows on head 1 (A_log = 100): a step, lb where z > 0 and 0 where z < 0; or (cut) steps of
// -inf decay: every 23rd token at every channel, every 23rd (+9) at half of them (-inf and
// -1e30 by turns; the softplus gate: g = +inf and 1e30), and with the softplus gate
// exp(A_log) = inf on the last head (every step forgets, and the padding must still gate to 0)
// and 4e-44 on head 0 (no step forgets but those of g = +inf)
enum FusedGate { GATE_PLAIN, GATE_WIDE, GATE_STRONG, GATE_EDGE, GATE_RATE_0_AND_INF, GATE_CUT, GATE_SLOW };
static FusedGate fused_gate(const Cfg &cf) {
    return strstr(cf.name, "wide") ? GATE_WIDE : strstr(cf.name, "strong") ? GATE_STRONG
         : strstr(cf.name, "edge") ? GATE_EDGE : strstr(cf.name, "rate_0_and_inf") ? GATE_RATE_0_AND_INF
         : strstr(cf.name, "cut") ? GATE_CUT : strstr(cf.name, "slow") ? GATE_SLOW : GATE_PLAIN;
}
// (bv: the value tile, KDA_FUSED_BV; the automatic choice takes 64 on problems this small)
static void run_fused(const Cfg &cf, const char *segments, FusedGate gate, const char *bv) {
    kda_context *cpu = t_cpu();
    t_inst I;
    t_current = "fused";
    t_inst_init(&I, &cf.p, cf.cu.empty() ? NULL : cf.cu.data(), cf.has_h0, 0);
    const kda_problem &p = I.p;
    if (gate == GATE_RATE_0_AND_INF)
        for (int c = 0; c < p.HV; c++) I.A_log[c] = c % 2 ? 100.0f : -200.0f;
    else if (gate == GATE_SLOW)
        for (size_t e = 0; e < (size_t)p.B * p.T * p.HV * p.K; e++) I.g[e] *= 0.02f;
    else if (gate == GATE_CUT) {
        const float s = p.gate == KDA_GATE_NONE ? -1.0f : 1.0f; // (a = -inf: g = -inf, or softplus of +inf)
        for (size_t r = 0; r < (size_t)p.B * p.T; r++)
            for (int c = 0; c < p.HV * p.K; c++) {
                if (r % 23 == 5) I.g[r * p.HV * p.K + c] = s * INFINITY;
                if (r % 23 == 14 && c % 2 == 0) I.g[r * p.HV * p.K + c] = s * (c % 4 ? 1e30f : INFINITY);
            }
        if (I.A_log) I.A_log[0] = -100.0f, I.A_log[p.HV - 1] = 100.0f;
    } else if (gate != GATE_PLAIN) { // g = -softplus(raw + dt_bias); chunk 0 stays in range
        for (int c = 0; c < p.HV; c++) I.A_log[c] = 0.0f;
        for (size_t r = 17; r < (size_t)p.B * p.T; r++)
            for (int c = 0; c < p.HV * p.K; c++) {
                if (gate == GATE_WIDE && r % 7 == 3) I.g[r * p.HV * p.K + c] = 1000.0f;
                if (gate == GATE_STRONG && r % p.T < 48 && c % 2 == 0) I.g[r * p.HV * p.K + c] = 5.0f - I.dt_bias[c];
                if (gate == GATE_EDGE && r % p.T < 48 && c % 2 == 0) I.g[r * p.HV * p.K + c] = 3.777f - I.dt_bias[c]; // softplus 3.8
            }
    }
    DevIn X;
    dev_inputs(X, I);
    const size_t es = kda_dtype_size(p.dtype), nst = I.ns;
    // Where the column blocks may go in pairs (a device that takes them, Hopper or the emulator;
    // 128 columns; V an even number of blocks, or V + K in the exact split's transition pass; no
    // KDA_FUSED_PAIRS from the caller, as the GPU tests' racecheck run sets), a fourth side: the
    // same forward unpaired, which must give its bits. The value blocks pair in every pass; the
    // transition's only where the exact split runs, which the emulator tells (and where they
    // did not, the repeat is left out there).
    const bool may_pair = !getenv("KDA_FUSED_PAIRS") && g_dev->dev->pairs && g_dev->dev->pairs(g_dev) && !strcmp(bv, "128") &&
                          ((p.V + 127) / 128 % 2 == 0 || ((p.V + 127) / 128 + (p.K + 127) / 128) % 2 == 0);
    [[maybe_unused]] const bool v_paired = may_pair && (p.V + 127) / 128 % 2 == 0; // (the emulator's checks)
    bool paired = may_pair;
    Out o, ht, os, op, htp; // CPU (o.c, ht.c) and device fused (o.h, ht.h); device staged; device fused without pairs
    o.init(I.nv * es); ht.init(nst * 4); os.init(I.nv * es);
    if (paired) op.init(I.nv * es), htp.init(nst * 4);
    setenv("KDA_SEGMENTS", segments, 1);
    setenv("KDA_FUSED_BV", bv, 1);
    // The exact split's fix-up or its output pass, whichever the model times faster, may differ
    // between the paired and the unpaired plan: both sides take the fix-up where it applies
    // (an odd number of segments) or neither (even), so that each path meets its twin
    const bool had_fixup = getenv("KDA_FIXUP") != NULL;
    if (!had_fixup) setenv("KDA_FIXUP", atoi(segments) % 2 ? "2" : "0", 1);
#ifdef KDA_TEST_EMU
    const int before = emu_fused, pairs_before = emu_pairs;
#endif
    for (int side = 0; side < (paired ? 4 : 3); side++) { /* CPU, device fused, device staged, device fused unpaired */
        kda_context *ctx = side ? g_dev : cpu;
#ifdef KDA_TEST_EMU
        if (side == 3 && emu_pairs == pairs_before) { paired = false; break; } // (none ran)
#endif
        Out &oo = side == 2 ? os : side == 3 ? op : o;
        if (side) oo.poison();
        if (side == 1) ht.poison();
        if (side == 3) htp.poison();
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = side ? oo.d : (void *)o.c.data();
        out.ht = side == 1 ? (float *)ht.d : side == 3 ? (float *)htp.d : side == 0 ? (float *)ht.c.data() : NULL;
        setenv("KDA_FUSED", side == 2 ? "0" : "1", 1);
        if (side == 3) setenv("KDA_FUSED_PAIRS", "0", 1);
        CHECK(kda_chunk_fwd(ctx, &p, side ? &X.dev : &X.host, &out) == KDA_OK, "%s: fwd (%d): %s", cf.name, side,
              kda_last_error(ctx));
    }
    unsetenv("KDA_FUSED");
    if (paired) unsetenv("KDA_FUSED_PAIRS");
    unsetenv("KDA_SEGMENTS");
    unsetenv("KDA_FUSED_BV");
    if (!had_fixup) unsetenv("KDA_FIXUP");
#ifdef KDA_TEST_EMU
    CHECK(emu_fused > before, "%s: the fused kernel did not run", cf.name);
    CHECK(may_pair || emu_pairs == pairs_before, "%s (segments %s, bv %s): pairs ran %d times", cf.name, segments, bv,
          emu_pairs - pairs_before);
    CHECK(!v_paired || emu_pairs > pairs_before, "%s (segments %s, bv %s): the value blocks did not pair", cf.name, segments, bv);
#endif
    o.fetch(); ht.fetch(); os.fetch();
    if (paired) {
        op.fetch(); htp.fetch();
        CHECK(!memcmp(o.h.data(), op.h.data(), I.nv * es) && !memcmp(ht.h.data(), htp.h.data(), nst * 4),
              "%s (segments %s, bv %s): o or ht differ without pairs", cf.name, segments, bv);
    }
    const double eo = err_t(o.c.data(), o.h.data(), I.nv, p.dtype), eh = err_f((float *)ht.c.data(), (float *)ht.h.data(), nst);
    CHECK(eo <= 1e-2, "%s (segments %s, bv %s): o error %.3g", cf.name, segments, bv, eo);
    CHECK(eh <= 1e-2, "%s (segments %s, bv %s): ht error %.3g", cf.name, segments, bv, eh);
    CHECK(memcmp(o.h.data(), os.h.data(), I.nv * es) != 0, "%s: fused o equals the staged o bit for bit", cf.name);
    // the staged kernels (fp32 math, as the CPU's) round o as the CPU does but for last-bit flips
    const double es_ = err_t(o.c.data(), os.h.data(), I.nv, p.dtype);
    CHECK(es_ <= 1e-3, "%s (segments %s, bv %s): the staged path's o error %.3g", cf.name, segments, bv, es_);
    printf("  %s segments=%s bv=%s: o %.2e ht %.2e (staged o %.2e)\n", cf.name, segments, bv, eo, eh, es_);
    dfree_all();
    t_inst_free(&I);
    kda_context_destroy(cpu);
}

// The exact split with its first piece the longer (KDA_LEAD=2, KDA_SPLIT=exact, KDA_SEGMENTS=3),
// as run_fused checks a forward: B2 T150 (10 chunks: pieces of 5, 3 and 2, which the
// emulator's transition pass shows as fz_each 5 and fz_lead 2) and varlen sequences of 150,
// 40 and 97 tokens (its piece table: the first from chunks 0, 5 and 8, the second whole, the
// third from 0 and 5), 128 columns (the transition pass's value and identity blocks in pairs)
// and 64
static void run_fused_exact_split_with_a_lead() {
    kda_problem p = kda_problem_default(2, 150, 1, 128, 128);
    p.HV = 2; p.dtype = KDA_BF16; p.gate = KDA_GATE_SOFTPLUS; p.qk_l2norm = 1;
    const Cfg fixed = {"fused_B2_T150_exact_split_lead2", p, {}, 1, 0};
    p = kda_problem_default(1, 287, 1, 128, 128);
    p.HV = 2; p.dtype = KDA_BF16; p.gate = KDA_GATE_SOFTPLUS; p.qk_l2norm = 1; p.num_seqs = 3; p.seqlens_type = KDA_INDEX_I64;
    const Cfg varlen = {"fused_varlen_exact_split_lead2", p, {0, 150, 190, 287}, 1, 0};
    // the slow decay's problem, so that the segments' transitions and end states are far from
    // zero and the combined start states count in o
    Cfg slow;
    t_current = "fused";
    const bool has_slow = fused_config("fused_B1_T100_K128_V128_slow_gate_bf16", &slow);
    CHECK(has_slow, "the exact split's slow-decay run names a fused config");
    slow.name = "fused_B1_T100_exact_split_slow_gate";
    setenv("KDA_SPLIT", "exact", 1); setenv("KDA_LEAD", "2", 1);
    for (const char *bv : {"128", "64"}) {
#ifdef KDA_TEST_EMU
        emu_trans_cut[0] = emu_trans_cut[1] = -1;
#endif
        run_fused(fixed, "3", GATE_PLAIN, bv);
#ifdef KDA_TEST_EMU
        CHECK(emu_trans_cut[0] == 5 && emu_trans_cut[1] == 2, "exact split with a lead (bv %s): the transition pass cut fz_each %lld, fz_lead %lld (want 5, 2)",
              bv, emu_trans_cut[0], emu_trans_cut[1]);
        emu_trans_first.clear();
#endif
        run_fused(varlen, "3", GATE_PLAIN, bv);
#ifdef KDA_TEST_EMU
        CHECK(emu_trans_first == std::vector<int>({0, 5, 8, 0, 0, 5}), "exact split with a lead (varlen, bv %s): the piece table's first chunks are not 0 5 8 0 0 5", bv);
#endif
        if (has_slow) run_fused(slow, "3", GATE_SLOW, bv);
    }
    unsetenv("KDA_SPLIT"); unsetenv("KDA_LEAD");
}

// The chunked forward's pool form (serving prefill) is its plain form with h0 read from the
// slots and ht written into them: o and every named slot bit for bit, on every path (the CPU,
// the fused kernels whole or split, the staged kernels), with an fp32 pool and a bf16 one (its
// plain twin starts from the pool's values and its ht is rounded once). Sequence 1 is padding
// (slot -1): it runs from zeros. Slots no sequence names keep their bits.
static void run_chunk_fwd_pool_form(const Cfg &cf, const char *segments, const char *bv) {
    kda_context *cpu = t_cpu();
    t_inst I;
    t_current = "chunk_fwd_pool_form";
    t_inst_init(&I, &cf.p, cf.cu.empty() ? NULL : cf.cu.data(), 1, 0);
    const kda_problem &p = I.p;
    const int N = kda_num_seqs(&p), nslots = 2 * N + 2;
    const size_t sl = (size_t)p.HV * p.K * p.V, ob = I.nv * kda_dtype_size(p.dtype);
    std::vector<int32_t> slots(N);
    std::vector<int> seq_of(nslots, -1); // the sequence a slot holds (-1: none)
    for (int n = 0; n < N; n++) {
        slots[n] = n == 1 ? -1 : 2 * (N - 1 - n) + 1; // (the slots in reverse order)
        if (slots[n] >= 0) seq_of[slots[n]] = n;
    }
    DevIn X;
    dev_inputs(X, I);
    void *slots_d = dup(slots.data(), slots.size() * 4);
    setenv("KDA_SEGMENTS", segments, 1);
    setenv("KDA_FUSED_BV", bv, 1);
    for (kda_dtype dt : {KDA_F32, KDA_BF16}) {
        const size_t es = kda_dtype_size(dt);
        // the pool: a named slot holds its sequence's h0 (in the pool's dtype), the others 1e30
        std::vector<unsigned char> pool0((size_t)nslots * sl * es);
        std::vector<float> h0((size_t)N * sl, 0.0f); // the plain twin's start: the pool's values, zeros for padding
        for (int s = 0; s < nslots; s++)
            for (size_t i = 0; i < sl; i++) {
                const int n = seq_of[s];
                kda__st(pool0.data(), dt, s * sl + i, n >= 0 ? I.h0[n * sl + i] : 1e30f);
                if (n >= 0) h0[n * sl + i] = kda__ld(pool0.data(), dt, s * sl + i);
            }
        const void *h0_d = dup(h0.data(), h0.size() * 4);
        for (int side = 0; side < 3; side++) { /* CPU, device fused, device staged */
            kda_context *ctx = side ? g_dev : cpu;
            setenv("KDA_FUSED", side == 2 ? "0" : "1", 1);
            std::vector<unsigned char> o_plain(ob), o_pool(ob), pool(pool0);
            std::vector<float> ht((size_t)N * sl);
            void *od = side ? dalloc(ob) : NULL, *htd = side ? dalloc(ht.size() * 4) : NULL;
            void *pd = side ? dup(pool0.data(), pool0.size()) : NULL;
            kda_inputs in = side ? X.dev : X.host;
            kda_fwd_outputs out;
            memset(&out, 0, sizeof out);
            in.h0 = side ? (const float *)h0_d : h0.data();
            out.o = side ? od : o_plain.data();
            out.ht = side ? (float *)htd : ht.data();
#ifdef KDA_TEST_EMU
            const int fused_before = emu_fused;
#endif
            const size_t wsp = kda_fwd_workspace_size(&p); // (a caller's workspace bounds the fused forward's pieces)
            if (side) kda_set_workspace(g_dev, dalloc(wsp), wsp);
            CHECK(kda_chunk_fwd(ctx, &p, &in, &out) == KDA_OK, "%s: plain fwd (side %d): %s", cf.name, side, kda_last_error(ctx));
            if (side) down(o_plain.data(), od, ob), down(ht.data(), htd, ht.size() * 4), dpoison(od, ob);
            in.h0 = NULL;
            out.o = side ? od : o_pool.data();
            out.ht = NULL;
            out.state_pool = (float *)(side ? pd : (void *)pool.data());
            out.slots = side ? (const int32_t *)slots_d : slots.data();
            out.slots_host = slots.data();
            out.num_slots = nslots;
            out.state_dtype = dt;
            // a workspace of the size kda.h documents for the pool form (the states' fp32 copy
            // more than the plain form's, which then leaves the fused forward's plan as it was)
            const size_t wsn = kda_fwd_workspace_size(&p) + (size_t)N * sl * 4 + 256;
            if (side) kda_set_workspace(g_dev, dalloc(wsn), wsn);
            CHECK(kda_chunk_fwd(ctx, &p, &in, &out) == KDA_OK, "%s: pool fwd (side %d): %s", cf.name, side, kda_last_error(ctx));
            if (side) kda_set_workspace(g_dev, NULL, 0);
            if (side) down(o_pool.data(), od, ob), down(pool.data(), pd, pool.size());
#ifdef KDA_TEST_EMU
            CHECK(side != 1 || emu_fused >= fused_before + 2, "%s: the fused kernel did not run", cf.name);
            CHECK(side != 2 || emu_fused == fused_before, "%s: KDA_FUSED=0 ran the fused kernel", cf.name);
#endif
            CHECK(!memcmp(o_plain.data(), o_pool.data(), ob), "%s (segments %s, bv %s, %s pool, side %d): o differs from the plain form's",
                  cf.name, segments, bv, kda_dtype_name(dt), side);
            size_t bad_named = 0, bad_other = 0;
            for (int s = 0; s < nslots; s++)
                for (size_t i = 0; i < sl; i++) {
                    const size_t e = s * sl + i;
                    const int n = seq_of[s];
                    std::vector<unsigned char> want(es);
                    if (n >= 0) kda__st(want.data(), dt, 0, ht[n * sl + i]);
                    else memcpy(want.data(), &pool0[e * es], es);
                    if (memcmp(want.data(), &pool[e * es], es)) (n >= 0 ? bad_named : bad_other)++;
                }
            CHECK(bad_named == 0, "%s (segments %s, bv %s, %s pool, side %d): %zu values of the named slots are not ht's", cf.name,
                  segments, bv, kda_dtype_name(dt), side, bad_named);
            CHECK(bad_other == 0, "%s (segments %s, bv %s, %s pool, side %d): %zu values changed in slots no sequence names",
                  cf.name, segments, bv, kda_dtype_name(dt), side, bad_other);
        }
    }
    unsetenv("KDA_FUSED");
    unsetenv("KDA_SEGMENTS");
    unsetenv("KDA_FUSED_BV");
    printf("  %s segments=%s bv=%s: pool form\n", cf.name, segments, bv);
    dfree_all();
    t_inst_free(&I);
    kda_context_destroy(cpu);
}

// A NaN in g (one value, row 20) or in A_log stays NaN in the fused forward's o, as on the
// CPU: the log decay's floor and the bounds on exp(A_log) keep NaN (max.NaN, min.NaN), where
// fmaxf would turn a NaN gate into a decay and hide the bad input. Rows 0-15 (before the
// fused kernel's chunk of the NaN) stay finite, on the CPU too.
static void run_fused_keeps_nan() {
    t_current = "fused_keeps_nan";
    for (int gate = 0; gate < 3; gate++)
        for (int in_a = 0; in_a < (gate ? 2 : 1); in_a++) {
            kda_context *cpu = t_cpu();
            kda_problem p = kda_problem_default(1, 40, 1, 64, 32);
            p.dtype = KDA_BF16; p.qk_l2norm = 1; p.gate = (kda_gate)gate;
            if (gate == KDA_GATE_LOWER_BOUND) p.lower_bound = -5.0f;
            t_inst I;
            t_inst_init(&I, &p, NULL, 1, 0);
            if (in_a) I.A_log[0] = NAN;
            else I.g[20 * 64 + 5] = NAN;
            DevIn X;
            dev_inputs(X, I);
            Out o;
            o.init(I.nv * 2);
            o.poison();
            kda_fwd_outputs out;
            memset(&out, 0, sizeof out);
            setenv("KDA_FUSED", "1", 1);
#ifdef KDA_TEST_EMU
            const int before = emu_fused;
#endif
            for (int side = 0; side < 2; side++) {
                out.o = side ? o.d : (void *)o.c.data();
                kda_context *ctx = side ? g_dev : cpu;
                CHECK(kda_chunk_fwd(ctx, &p, side ? &X.dev : &X.host, &out) == KDA_OK, "gate %d: %s", gate, kda_last_error(ctx));
            }
            unsetenv("KDA_FUSED");
#ifdef KDA_TEST_EMU
            CHECK(emu_fused > before, "gate %d: the fused kernel did not run", gate);
#endif
            o.fetch();
            for (int side = 0; side < 2; side++) {
                const unsigned char *ob = side ? o.h.data() : o.c.data();
                int early = 0, late = 0; // non-finite values in rows 0-15 and 20-39
                for (int r = 0; r < 40; r++)
                    for (int c = 0; c < 32; c++) {
                        const bool bad = !std::isfinite(kda__ld(ob, KDA_BF16, (size_t)r * 32 + c));
                        early += r < 16 && bad;
                        late += r >= 20 && bad;
                    }
                CHECK(late > 0, "gate %d, NaN in %s: %s o has no NaN after it", gate, in_a ? "A_log" : "g", side ? "the fused" : "the CPU's");
                CHECK(in_a ? early > 0 : early == 0, "gate %d, NaN in %s: %s o has %d non-finite values in rows 0-15", gate,
                      in_a ? "A_log" : "g", side ? "the fused" : "the CPU's", early);
            }
            dfree_all();
            t_inst_free(&I);
            kda_context_destroy(cpu);
        }
}

// The bounded split (KDA_SEGMENTS=3: the longest sequence in 3 pieces; KDA_WARMUP=2):
// where every key channel decays (head 0: g = -2 a token, 2^-92 over the warm-up) a piece
// keeps what its warm-up gave; where one keeps its state (head 1: g = logsigmoid(randn),
// about 2^-3) or, late, a gate inside the first sequence's piece 2 (chunks 10-12) is
// positive (LATE_GATE) or a b is outside [0, 2] (LATE_BETA), the bound fails and the exact split's passes redo that sequence and head, cut
// as the exact split cuts (no warm-up): bit for bit KDA_SPLIT=exact's o and ht. Everything within 1e-2 of the CPU's forward. K = 100
// leaves channels of the 128-key tile outside K, which must not enter the bound. Varlen:
// sequences of 13, 3 and 7 chunks in 3, 1 and 2 pieces, launched longest first. In the
// emulator: fwd_bound flags the warm-ups' failures (head 1) and not the later gate or b,
// which the bounded pass flags; and the bounded pass leaves a sequence and head that
// fwd_bound flagged to the exact passes (its o untouched), and the sequence of one piece too
// where any warm-up failed (the exact output pass runs it beside the others), else runs it.
// hold1: head 1 decays as head 0 does, so that no warm-up fails.
enum { LATE_NONE, LATE_GATE, LATE_BETA };
static void run_fused_bounded_split(int K, int late, bool varlen, const char *bv = "64", int V = 32, bool hold1 = false) {
    char name[96];
    const bool growth = late != LATE_NONE;
    snprintf(name, sizeof name, "fused_bounded_split_K%d_V%d%s%s_bv%s%s", K, V, late == LATE_GATE ? "_growth" : late == LATE_BETA ? "_wide_beta" : "",
             varlen ? "_varlen" : "", bv, hold1 ? "_head1_holds" : "");
    kda_context *cpu = t_cpu();
    kda_problem p0 = kda_problem_default(1, varlen ? 335 : 200, 1, K, V);
    p0.HV = 2; p0.dtype = KDA_BF16; p0.qk_l2norm = 1;
    const std::vector<long long> cu = {0, 200, 235, 335};
    if (varlen) p0.num_seqs = 3, p0.seqlens_type = KDA_INDEX_I64;
    t_inst I;
    t_current = "fused";
    t_inst_init(&I, &p0, varlen ? cu.data() : NULL, 1, 0);
    const kda_problem &p = I.p;
    const int N = varlen ? 3 : 1, pieces[3] = {3, 1, 2};
    for (int r = 0; r < p.T; r++)
        for (int hv = 0; hv < (hold1 ? 2 : 1); hv++)
            for (int c = 0; c < K; c++) I.g[((size_t)r * p.HV + hv) * K + c] = -2.0f;
    // token 170: the first sequence's piece 2 (tokens 160-199), after its warm-up (128-159)
    if (late == LATE_GATE) I.g[((size_t)170 * p.HV + 0) * K + 3] = 0.5f;
    if (late == LATE_BETA) I.beta[(size_t)170 * p.HV + 0] = 2.5f;
    auto warm_fails = [&](int hv) { return hv == 1 && !hold1; }; // fwd_bound's verdict
    auto fails = [&](int n, int hv) { return warm_fails(hv) || (growth && n == 0 && hv == 0); };
    DevIn X;
    dev_inputs(X, I);
    const size_t es = kda_dtype_size(p.dtype), nst = I.ns;
    Out o, ht, oe, hte; // CPU (c) and bounded (h); exact split (oe, hte: h)
    o.init(I.nv * es); ht.init(nst * 4); oe.init(I.nv * es); hte.init(nst * 4);
    setenv("KDA_SEGMENTS", "3", 1);
    setenv("KDA_WARMUP", "2", 1);
    setenv("KDA_FUSED_BV", bv, 1);
#ifdef KDA_TEST_EMU
    emu_flags.clear();
    emu_warm_flags.clear(), emu_any = emu_redo_bound = emu_redo = -2;
    memset(emu_exact_cut, 0, sizeof emu_exact_cut);
    emu_o_bytes = I.nv * es;
#endif
    for (int side = 0; side < 3; side++) { /* CPU, bounded split, exact split */
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = side == 0 ? (void *)o.c.data() : side == 1 ? o.d : oe.d;
        out.ht = side == 0 ? (float *)ht.c.data() : side == 1 ? (float *)ht.d : (float *)hte.d;
        if (side) dpoison(out.o, I.nv * es), dpoison(out.ht, nst * 4);
        setenv("KDA_SPLIT", side == 2 ? "exact" : "bounded", 1);
        CHECK(kda_chunk_fwd(side ? g_dev : cpu, &p, side ? &X.dev : &X.host, &out) == KDA_OK, "%s: fwd (%d): %s", name, side,
              kda_last_error(side ? g_dev : cpu));
#ifdef KDA_TEST_EMU
        if (side == 1) { // the pieces, their launch order and the flags of every piece after a sequence's first
            const std::vector<int> want_first = varlen ? std::vector<int>{0, 6, 10, 0, 0, 5} : std::vector<int>{0, 6, 10};
            const int np = (int)want_first.size();
            CHECK(emu_flags.size() == (size_t)np * 2, "%s: no bounded pass of %d pieces ran (%zu flags)", name, np, emu_flags.size());
            CHECK(emu_warm_flags.size() == (size_t)np * 2, "%s: fwd_bound did not run before it (%zu flags)", name, emu_warm_flags.size());
            // fwd_bound: head 1's warm-ups fail, head 0's hold (the positive gate lies in no warm-up)
            for (size_t f = 0; f < emu_warm_flags.size() && f < emu_flags.size(); f++)
                CHECK(emu_warm_flags[f] == (emu_flags[f] && f % 2 == 1), "%s: fwd_bound's flag %zu is %d (final %d)", name, f,
                      emu_warm_flags[f], emu_flags[f]);
            CHECK(emu_any == (varlen ? !hold1 : -1), "%s: fwd_bound's fz_any is %d", name, emu_any);
            // fz_redo: the call's tag from fwd_bound where a warm-up failed, from the bounded
            // pass where only a later chunk did (else the exact passes end at once: kda_fz_idle)
            CHECK(emu_redo_bound == !hold1 && emu_redo == (!hold1 || growth), "%s: fz_redo holds the call's tag after fwd_bound: %d, after the bounded pass: %d",
                  name, emu_redo_bound, emu_redo);
            // the bounded pass wrote o where fwd_bound's flags held, and nothing in head 1 of a
            // sequence of several pieces where its warm-ups failed; a sequence of one piece it
            // left alone where any warm-up failed, else wrote whole (o is [T][HV][V]; poisoned
            // 0xff before the call: 0xffff, a NaN, is no output)
            bool skipped = true, wrote = false, whole_left = true, whole_wrote = true;
            for (int n = 0; n < N && emu_o_bounded.size() == emu_o_bytes; n++)
                for (long long t = varlen ? cu[n] : 0; t < (varlen ? cu[n + 1] : p.T); t++)
                    for (int hv = 0; hv < 2; hv++)
                        for (size_t x = 0; x < p.V * es; x += 2) {
                            const unsigned char *b = &emu_o_bounded[((size_t)t * p.HV + hv) * p.V * es + x];
                            const bool poison = b[0] == 0xff && b[1] == 0xff;
                            if (pieces[n] == 1) whole_left &= poison, whole_wrote &= !poison;
                            else if (hv == 1 && warm_fails(1)) skipped &= poison;
                            else if (hv == 0) wrote |= !poison;
                        }
            CHECK(emu_o_bounded.size() == emu_o_bytes && skipped && wrote, "%s: the bounded pass skipped head 1 (%d), wrote head 0 (%d)",
                  name, skipped, wrote);
            if (varlen)
                CHECK(hold1 ? whole_wrote : whole_left, "%s: the bounded pass %s the sequence of one piece", name,
                      hold1 ? "did not write" : "wrote in");
            if (!varlen) { // no table: 3 pieces of 6 chunks, warm-up included (kda_fz_span), flags by slot = piece;
                // the exact passes after it cut for themselves: 3 pieces of 5 chunks, no warm-up
                CHECK(emu_pieces.empty() && emu_cut[0] == 3 && emu_cut[1] == 6, "%s: %zu table entries, %lld pieces of %lld chunks",
                      name, emu_pieces.size(), emu_cut[0], emu_cut[1]);
                CHECK(emu_exact_cut[0] == 3 && emu_exact_cut[1] == 3 && emu_exact_cut[2] == 5,
                      "%s: the exact passes ran %lld pieces, %lld a sequence, of %lld chunks", name, emu_exact_cut[0], emu_exact_cut[1],
                      emu_exact_cut[2]);
                for (int sl = 1; sl < 3 && emu_flags.size() == 6; sl++)
                    for (int hv = 0; hv < 2; hv++) {
                        // 1: fwd_bound's verdict (the bounded pass then skips it); 2: the bounded pass's own
                        const int want = warm_fails(hv) ? 1 : growth && sl == 2 && hv == 0 ? 2 : 0;
                        CHECK(emu_flags[sl * 2 + hv] == want, "%s: piece %d, head %d: flag %d, want %d", name, sl, hv, emu_flags[sl * 2 + hv], want);
                    }
                continue;
            }
            CHECK(emu_pieces.size() == (size_t)3 * np + N + 1, "%s: a piece table of %zu entries", name, emu_pieces.size());
            if (emu_pieces.size() != (size_t)3 * np + N + 1) continue;
            const int *seq = &emu_pieces[np], *first = &emu_pieces[2 * np], *base = &emu_pieces[3 * np];
            CHECK(std::vector<int>(first, first + np) == want_first, "%s: the pieces' first chunks", name);
            int prev = 1 << 30;
            for (int r = 0; r < np; r++) { // chunks run, warm-up included: never more than the piece before
                const int sl = emu_pieces[r], n = seq[sl], nch = (int)(((varlen ? cu[n + 1] - cu[n] : p.T) + 15) / 16);
                const int ce = sl + 1 == base[n + 1] ? nch : first[sl + 1], run = ce - (sl > base[n] ? std::max(first[sl] - 2, 0) : 0);
                CHECK(run <= prev, "%s: piece %d (%d chunks) launches after one of %d", name, sl, run, prev);
                prev = run;
            }
            for (int sl = 0; sl < np; sl++)
                for (int hv = 0; hv < 2 && sl > base[seq[sl]]; hv++) {
                    const int want = warm_fails(hv) ? 1 : growth && sl == 2 && hv == 0 ? 2 : 0; // (slot 2: the first sequence's piece 2)
                    CHECK(emu_flags[sl * 2 + hv] == want, "%s: piece %d, head %d: flag %d, want %d", name, sl, hv, emu_flags[sl * 2 + hv], want);
                }
        }
#endif
    }
    unsetenv("KDA_SEGMENTS"); unsetenv("KDA_WARMUP"); unsetenv("KDA_FUSED_BV"); unsetenv("KDA_SPLIT");
#ifdef KDA_TEST_EMU
    emu_o_bytes = 0; // (a later test's o may be smaller)
#endif
    o.fetch(); ht.fetch(); oe.fetch(); hte.fetch();
    const double eo = err_t(o.c.data(), o.h.data(), I.nv, p.dtype), eh = err_f((float *)ht.c.data(), (float *)ht.h.data(), nst);
    CHECK(eo <= 1e-2 && eh <= 1e-2, "%s: o error %.3g, ht error %.3g", name, eo, eh);
    // where the bound failed in a sequence of more than one piece, and in a sequence of one
    // piece where any warm-up failed: the exact split's bits; o is [T][HV][V], ht [N][HV][K][V]
    bool same_o = true, same_ht = true;
    for (int n = 0; n < N; n++)
        for (int hv = 0; hv < 2; hv++) {
            const long long b = varlen ? cu[n] : 0, e = varlen ? cu[n + 1] : p.T;
            if (pieces[n] == 1 ? hold1 : !fails(n, hv)) continue; // (else the bounded pass ran it)
            for (long long t = b; t < e; t++)
                same_o &= !memcmp(&o.h[((size_t)t * p.HV + hv) * p.V * es], &oe.h[((size_t)t * p.HV + hv) * p.V * es], p.V * es);
            const size_t h0 = ((size_t)n * p.HV + hv) * K * p.V * 4;
            same_ht &= !memcmp(&ht.h[h0], &hte.h[h0], (size_t)K * p.V * 4);
        }
    CHECK(same_o && same_ht, "%s: where the bound failed, o (%d) and ht (%d) are not the exact split's", name, same_o, same_ht);
    printf("  %s: o %.2e ht %.2e\n", name, eo, eh);
    dfree_all();
    t_inst_free(&I);
    kda_context_destroy(cpu);
}

// The column plan end to end (KDA_SEGMENTS=columns, KDA_WARMUP=2): varlen sequences of 40, 21
// and 9 chunks, two heads, K = 64, V = 32 in 64-column blocks (2 blocks a piece). Columns
// (6 or more: 12 multiprocessors in the emulator, the GPU's own count) hold them at a makespan
// of 33 chunk-times, the first sequence cut at chunk 21 (the emulator checks the bounded
// pass's piece table). o and ht are within 1e-2 of the CPU's forward where every bound holds
// (g = -2 in both heads) and where head 1's fail (g = logsigmoid(randn): the exact passes
// redo it, cut as they cut for themselves).
#ifdef KDA_TEST_EMU
static kda_context *emu_ctx_sms(int sms, const char *what); // (below: a device of sms multiprocessors)
#endif
static void run_fused_column_plan_end_to_end(bool fail1) {
    char name[64];
    snprintf(name, sizeof name, "fused_column_plan%s", fail1 ? "_head1_fails" : "");
    t_current = "fused";
#ifdef KDA_TEST_EMU
    kda_context *dev = emu_ctx_sms(12, name);
    if (!dev) return;
#else
    kda_context *dev = g_dev;
#endif
    kda_context *cpu = t_cpu();
    const std::vector<long long> cu = {0, 640, 976, 1120};
    kda_problem p0 = kda_problem_default(1, 1120, 1, 64, 32);
    p0.HV = 2; p0.dtype = KDA_BF16; p0.qk_l2norm = 1; p0.num_seqs = 3; p0.seqlens_type = KDA_INDEX_I64;
    t_inst I;
    t_inst_init(&I, &p0, cu.data(), 1, 0);
    const kda_problem &p = I.p;
    for (int r = 0; r < p.T; r++)
        for (int hv = 0; hv < (fail1 ? 1 : 2); hv++)
            for (int c = 0; c < p.K; c++) I.g[((size_t)r * p.HV + hv) * p.K + c] = -2.0f;
    DevIn X;
    dev_inputs(X, I);
    const size_t es = kda_dtype_size(p.dtype);
    Out o, ht;
    o.init(I.nv * es); ht.init(I.ns * 4);
    kda_fwd_outputs out;
    memset(&out, 0, sizeof out);
    out.o = o.c.data(), out.ht = (float *)ht.c.data();
    CHECK(kda_chunk_fwd(cpu, &p, &X.host, &out) == KDA_OK, "%s: CPU fwd: %s", name, kda_last_error(cpu));
    out.o = o.d, out.ht = (float *)ht.d;
    dpoison(out.o, I.nv * es), dpoison(out.ht, I.ns * 4);
    setenv("KDA_SEGMENTS", "columns", 1); setenv("KDA_WARMUP", "2", 1); setenv("KDA_FUSED_BV", "64", 1); setenv("KDA_SPLIT", "bounded", 1);
#ifdef KDA_TEST_EMU
    emu_pieces.clear();
#endif
    CHECK(kda_chunk_fwd(dev, &p, &X.dev, &out) == KDA_OK, "%s: fwd: %s", name, kda_last_error(dev));
    unsetenv("KDA_SEGMENTS"); unsetenv("KDA_WARMUP"); unsetenv("KDA_FUSED_BV"); unsetenv("KDA_SPLIT");
#ifdef KDA_TEST_EMU
    // 4 pieces (sequence 0 at chunks 0 and 21, 1 and 2 whole), launched by planned start
    // (all at 0), then the longer: 21 chunks, 21 (19 and a warm-up of 2), 21, 9
    const std::vector<int> want = {0, 1, 2, 3, /* sequences */ 0, 0, 1, 2, /* first chunks */ 0, 21, 0, 0, /* first pieces */ 0, 2, 3, 4};
    CHECK(emu_pieces == want, "%s: the bounded pass's piece table is not the column plan's", name);
#endif
    o.fetch(), ht.fetch();
    const double eo = err_t(o.c.data(), o.h.data(), I.nv, p.dtype), eh = err_f((float *)ht.c.data(), (float *)ht.h.data(), I.ns);
    CHECK(eo <= 1e-2 && eh <= 1e-2, "%s: o error %.3g, ht error %.3g", name, eo, eh);
    printf("  %s: o %.2e ht %.2e\n", name, eo, eh);
    dfree_all();
    t_inst_free(&I);
#ifdef KDA_TEST_EMU
    kda_context_destroy(dev);
#endif
    kda_context_destroy(cpu);
}

// A seeded uniform in [0, 1) (an LCG): a test's own values, apart from t_randn's stream
struct Uni {
    unsigned s;
    double operator()() { s = s * 1664525u + 1013904223u; return (double)(s >> 8) / 16777216.0; }
};
// Kimi Linear's initialisation (kda-bench --gate kimi) for the softplus gate: raw g = randn,
// A = U(1, 16) a head, dt_bias = log(expm1(dt)), dt = exp U(log 1e-3, log 1e-1) a channel;
// its slow channels fail every warm-up
static void kimi_gates(t_inst &I, int HV, int K, Uni &uni) {
    for (int hv = 0; hv < HV; hv++) {
        I.A_log[hv] = (float)log(1.0 + 15.0 * uni());
        for (int d = 0; d < K; d++) I.dt_bias[hv * K + d] = (float)log(expm1(exp(log(1e-3) + uni() * (log(1e-1) - log(1e-3)))));
    }
    for (size_t i = 0; i < I.ng; i++) I.g[i] = (float)t_randn();
}
// A fixed-length problem's inputs with Kimi Linear's initialised gates and uniform betas, on the device
static void kimi_inputs(t_inst &I, DevIn &X, const kda_problem &p0, unsigned seed) {
    t_inst_init(&I, &p0, NULL, 1, 0);
    Uni uni{seed};
    kimi_gates(I, p0.HV, p0.K, uni);
    for (size_t i = 0; i < I.nb; i++) I.beta[i] = (float)uni();
    dev_inputs(X, I);
}

#ifdef KDA_TEST_EMU
// fwd_bound flags a piece exactly where its warm-up's bound B (the sum over its tokens of the
// largest gate, base 2) exceeds -24: each gate form and g dtype, per-channel biases, K that
// takes the rows' 4-value loads (64, 128) and K that does not (50), fixed lengths and varlen.
// Each head's raw gates sit at a level that puts B on one side of -24 or the other, with
// noise over channels and tokens, so the largest gate is a different channel every token.
static void run_fused_bound_flags_match_the_warmup_sums() {
    struct G { int gate; kda_dtype gd; int K; bool varlen, kimi; double lo, hi; } cases[] = {
        {KDA_GATE_NONE, KDA_F32, 64, false, false, -1.2, -0.2},         // g itself: B from -55 to -9 over 32 tokens
        {KDA_GATE_SOFTPLUS, KDA_BF16, 50, false, false, -2.0, 1.5},     // -softplus(z): its largest at the smallest z
        {KDA_GATE_SOFTPLUS, KDA_F32, 128, true, false, -2.0, 1.5},
        {KDA_GATE_LOWER_BOUND, KDA_F16, 64, false, false, -4.0, 0.5},   // -5 sigmoid(z): its largest at the smallest z
        {KDA_GATE_LOWER_BOUND, KDA_BF16, 128, true, false, -4.0, 0.5},
        // Kimi Linear's initialisation (kimi_gates): its slow channels fail every warm-up
        {KDA_GATE_SOFTPLUS, KDA_F32, 128, false, true, 0.0, 0.0},
    };
    kda_context *cpu = t_cpu();
    t_current = "fused";
    for (const G &c : cases) {
        char name[96];
        snprintf(name, sizeof name, "fused_bound_flags_gate%d_g%d_K%d%s%s", c.gate, (int)c.gd, c.K, c.varlen ? "_varlen" : "", c.kimi ? "_kimi" : "");
        const int HV = 4;
        kda_problem p0 = kda_problem_default(1, c.varlen ? 290 : 200, 1, c.K, 16);
        p0.HV = HV; p0.dtype = c.gd == KDA_F16 ? KDA_F16 : KDA_BF16; p0.g_dtype = c.gd; p0.qk_l2norm = 1; p0.gate = (kda_gate)c.gate; p0.lower_bound = -5.0f;
        const std::vector<long long> cu = {0, 200, 290};
        if (c.varlen) p0.num_seqs = 2, p0.seqlens_type = KDA_INDEX_I64;
        t_inst I;
        t_inst_init(&I, &p0, c.varlen ? cu.data() : NULL, 1, 0);
        const kda_problem &p = I.p;
        Uni uni{12345u + (unsigned)c.K};
        for (int hv = 0; hv < HV && I.A_log; hv++) { // (the gated forms')
            I.A_log[hv] = (float)(0.3 * (uni() - 0.5));
            for (int d = 0; d < c.K; d++) I.dt_bias[hv * c.K + d] = (float)(0.4 * (uni() - 0.5));
        }
        for (long long t = 0; t < p.T; t++)
            for (int hv = 0; hv < HV; hv++) // head hv's level, from lo to hi
                for (int d = 0; d < c.K; d++)
                    I.g[((size_t)t * HV + hv) * c.K + d] = (float)(c.lo + (c.hi - c.lo) * hv / (HV - 1) + 0.6 * (uni() - 0.5));
        for (size_t i = 0; i < I.nb; i++) I.beta[i] = (float)uni(); // in [0, 1): no b fails
        if (c.kimi) kimi_gates(I, HV, c.K, uni);
        DevIn X;
        dev_inputs(X, I);
        Out o, ht;
        o.init(I.nv * kda_dtype_size(p.dtype)); ht.init(I.ns * 4);
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = o.c.data(), out.ht = (float *)ht.c.data();
        CHECK(kda_chunk_fwd(cpu, &p, &X.host, &out) == KDA_OK, "%s: CPU fwd: %s", name, kda_last_error(cpu));
        out.o = o.d, out.ht = (float *)ht.d;
        setenv("KDA_SEGMENTS", "4", 1); setenv("KDA_WARMUP", "2", 1); setenv("KDA_SPLIT", "bounded", 1);
        emu_warm_flags.clear(), emu_warm_sums.clear(), emu_any = emu_redo_bound = -2;
        emu_o_bytes = I.nv * kda_dtype_size(p.dtype); // (what the hook copies of o: this o's size, not the last test's)
        CHECK(kda_chunk_fwd(g_dev, &p, &X.dev, &out) == KDA_OK, "%s: fwd: %s", name, kda_last_error(g_dev));
        unsetenv("KDA_SEGMENTS"); unsetenv("KDA_WARMUP"); unsetenv("KDA_SPLIT");
        emu_o_bytes = 0;
        // the output either way: bounded where the flags held, the exact split (fwd_combine
        // included, K % 4 != 0 too) where they failed
        o.fetch(), ht.fetch();
        const double eo = err_t(o.c.data(), o.h.data(), I.nv, p.dtype), eh = err_f((float *)ht.c.data(), (float *)ht.h.data(), I.ns);
        CHECK(eo <= 1e-2 && eh <= 1e-2, "%s: o error %.3g, ht error %.3g", name, eo, eh);
        int held = 0, failed = 0, wrong = 0;
        CHECK(!emu_warm_sums.empty() && emu_warm_flags.size() == emu_warm_sums.size(), "%s: fwd_bound ran (%zu flags, %zu sums)", name,
              emu_warm_flags.size(), emu_warm_sums.size());
        for (size_t f = 0; f < emu_warm_sums.size() && f < emu_warm_flags.size(); f++) {
            const double B = emu_warm_sums[f];
            if (std::isnan(B)) { CHECK(emu_warm_flags[f] == 0, "%s: slot %zu drops no state but is flagged", name, f / HV); continue; }
            if (fabs(B + 24.0) < 1e-3) continue; // (float and double may part there)
            const int want = B > -24.0;
            held += !want, failed += want;
            if (emu_warm_flags[f] != want && wrong++ < 3)
                CHECK(false, "%s: slot %zu head %zu: B = %.4f, flag %d", name, f / HV, f % HV, B, emu_warm_flags[f]);
        }
        CHECK((held >= 4 || c.kimi) && failed >= 4, "%s: %d warm-ups held and %d failed: the levels do not straddle the bound", name, held, failed);
        bool any = false; // fz_any: set where any flag is (varlen: its piece table has it)
        for (int f : emu_warm_flags) any |= f != 0;
        CHECK(emu_any == (c.varlen ? (int)any : -1), "%s: fz_any %d where a flag is set: %d", name, emu_any, (int)any);
        CHECK(emu_redo_bound == (int)any, "%s: fz_redo %s the call's tag where a flag is set: %d", name,
              emu_redo_bound ? "holds" : "does not hold", (int)any);
        printf("  %s: %d warm-ups held, %d failed, %d flags wrong; o %.2e ht %.2e\n", name, held, failed, wrong, eo, eh);
        dfree_all();
        t_inst_free(&I);
    }
    kda_context_destroy(cpu);
}
#endif

// The fused forward's plan (host only). kda__launch_time, which hands out whole rounds at
// once, ends where handing out block by block to the first free multiprocessor ends; and
// kda__fz_cut covers a sequence with pieces that each run the same chunks, warm-up included,
// but the last, which runs no more.
static void run_fused_plan_model() {
    t_current = "fused";
    unsigned rng = 12345;
    int bad = 0;
    auto next = [&](int m) { rng = rng * 1664525u + 1013904223u; return (int)((rng >> 8) % (unsigned)m); };
    for (int trial = 0; trial < 300; trial++) {
        const int sms = trial % 3 == 0 ? 1 : trial % 3 == 1 ? 7 : 132, kinds = 1 + next(12);
        std::vector<kda__blocks> b(kinds);
        long long total = 0;
        for (kda__blocks &k : b) k.d = 1 + next(300), k.n = 1 + next(sms * 4 / kinds + 2), total += k.n;
        if (total > 4LL * sms) continue; // (past 4 blocks a multiprocessor the model takes the work per multiprocessor)
        std::vector<kda__blocks> sorted = b;
        std::sort(sorted.begin(), sorted.end(), [](const kda__blocks &x, const kda__blocks &y) { return x.d > y.d; });
        std::vector<double> end(sms, 0.0), heap(sms);
        for (const kda__blocks &k : sorted)
            for (long long i = 0; i < k.n; i++) *std::min_element(end.begin(), end.end()) += k.d;
        const double want = *std::max_element(end.begin(), end.end()), got = kda__launch_time(b.data(), kinds, sms, heap.data());
        if (got != want && !bad++) printf("  launch time of %d kinds on %d multiprocessors: %g, block by block %g\n", kinds, sms, got, want);
    }
    CHECK(!bad, "the launch time model differs from handing out block by block in %d of 300 launches", bad);
    bad = 0;
    for (long long nch = 0; nch <= 80; nch++)
        for (long long sn = 1; sn <= 9; sn++)
            for (long long warm : {-1LL, 0LL, 2LL, 16LL}) {
                int first[9];
                const long long np = kda__fz_cut(nch, sn, warm, first), w = warm > 0 ? warm : 0;
                const long long each = (nch + (sn - 1) * w + sn - 1) / sn;
                bool ok = np >= 1 && np <= sn && first[0] == 0;
                for (long long s = 0; s < np && ok; s++) {
                    const long long ce = s + 1 < np ? first[s + 1] : nch, run = ce - (s ? std::max(first[s] - w, 0LL) : 0);
                    ok = ce > first[s] || nch == 0;
                    ok = ok && (s + 1 < np ? run == each : run <= each);
                }
                if (!ok && !bad++) printf("  cut of %lld chunks into %lld pieces, warm-up %lld: %lld pieces\n", nch, sn, warm, np);
            }
    CHECK(!bad, "%d cuts of a sequence into pieces are uneven or leave a chunk out", bad);
}

#ifdef KDA_TEST_EMU
// The exact split's plan (host only), B1 T8192 H32 K=V=128 on 132 multiprocessors: the
// bounded split takes 4 pieces (128 blocks, one wave); the exact passes that redo it where
// a bound fails take 5 (a transition pass of 224 blocks in two waves of 103 chunks ends
// before 4 pieces' 160 blocks in two waves of 128). Timing only the last candidate of a
// wave count, as the bounded split may, counts the output pass's blocks and gives 4. On
// the H100 with Kimi Linear's gates: 5 pieces 0.676 ms, 4 pieces 0.742 (2026-11-25).
static int emu_sms_n; // multiprocessors the plan tests' device reports (one context at a time)
static int emu_sms(kda_context *) { return emu_sms_n; }
static kda_context *emu_ctx_sms(int sms, const char *what) {
    static kda__devops ops = emu_ops;
    ops.sm_count = emu_sms;
    emu_sms_n = sms;
    kda_context *ctx = NULL;
    CHECK(kda__context_create_dev(&ctx, KDA_BACKEND_CUDA, &ops, NULL, NULL) == KDA_OK, "%s: no context", what);
    return ctx;
}
static const kda__kdesc *emu_fused_128(void) { // the bf16 fused kernel with 128 keys and columns, fixed lengths
    for (int i = 0; i < KDA__NUM_KERNELS; i++)
        if (!strcmp(kda__kernels[i].name, "kda_fwd_fused_dtypebf16_bk128_bv128_varlen0")) return &kda__kernels[i];
    return NULL;
}
static void run_fused_exact_plan_times_every_candidate() {
    t_current = "fused";
    kda_context *ctx = emu_ctx_sms(132, "exact plan");
    if (!ctx) return;
    kda_problem p = kda_problem_default(1, 8192, 32, 128, 128);
    p.dtype = KDA_BF16; p.qk_l2norm = 1;
    const kda__kdesc *kf = emu_fused_128();
    const long long len = 8192;
    kda__fz_plan bounded, exact;
    memset(&bounded, 0, sizeof bounded); memset(&exact, 0, sizeof exact);
    CHECK(kf && kda__fused_plan(ctx, &p, kf, &len, 1, LLONG_MAX, 16, 0, &bounded) == KDA_OK &&
              kda__fused_plan(ctx, &p, kf, &len, 1, LLONG_MAX, -1, 0, &exact) == KDA_OK, "exact plan: %s", kda_last_error(ctx));
    CHECK(bounded.np == 4 && exact.np == 5, "exact plan: the bounded split in %lld pieces (want 4), the exact one in %lld (want 5)",
          bounded.np, exact.np);
    kda_context_destroy(ctx);
}

// The exact split's lead (host only), on 132 multiprocessors, the split that Kimi Linear's
// gates run (every warm-up's bound fails): K = V = 64 B1 T8192 H32 leads, its first piece 97
// chunks longer than the other 4 (model 229.6 chunk-times against 276 without; H100, Kimi-init
// gates: -8%); K128 V256 B2 T8192 H16 takes 128-column blocks in 3 pieces a sequence led by 137
// chunks (393.2) over 64-column blocks unsplit (419.2; -5.5%); K = V = 128 B1 T8192 H32, whose
// transition pass pairs, does not lead (the model misses there: +12-28% measured); nor does
// K128 V256 B1 T16384 H8, where the lead's 4.6% is under the 5% it must beat lead 0 by
static void run_fused_exact_split_leads_with_a_longer_first_piece() {
    t_current = "fused";
    kda_context *ctx = emu_ctx_sms(132, "exact lead");
    if (!ctx) return;
    auto kernel = [](const char *name) -> const kda__kdesc * {
        for (int i = 0; i < KDA__NUM_KERNELS; i++)
            if (!strcmp(kda__kernels[i].name, name)) return &kda__kernels[i];
        return NULL;
    };
    const kda__kdesc *k64 = kernel("kda_fwd_fused_dtypebf16_bk64_bv64_varlen0"), *k128 = emu_fused_128();
    struct Want { int B, T, H, K, V; int bv; long long np, lead; double time, unled; } want[] = {
        {1, 8192, 32, 64, 64, 64, 5, 97, 229.6, 276.0},
        {2, 8192, 16, 128, 256, 128, 6, 137, 393.19, 419.2},
        {1, 8192, 32, 128, 128, 128, 5, 0, 315.1, 315.1},
        {1, 16384, 8, 128, 256, 128, 6, 0, 342.21, 342.21},
    };
    for (const Want &w : want) {
        kda_problem p = kda_problem_default(w.B, w.T, w.H, w.K, w.V);
        p.dtype = KDA_BF16; p.qk_l2norm = 1;
        const std::vector<long long> len((size_t)w.B, w.T);
        kda__fz_plan pl[2], pe[2];
        const kda__kdesc *ke = NULL, *kx[2] = {NULL, NULL};
        kda_status st = KDA_OK;
        for (int led = 0; led < 2; led++) { // KDA_LEAD=0, then the plan's own
            memset(&pl[led], 0, sizeof pl[led]); memset(&pe[led], 0, sizeof pe[led]);
            if (!led) setenv("KDA_LEAD", "0", 1);
            kx[led] = kda__fused_variant(ctx, &p, w.K <= 64 ? k64 : k128, len.data(), w.B, LLONG_MAX, -1, 0, &pl[led], &pe[led], &ke, &st);
            unsetenv("KDA_LEAD");
            CHECK(kx[led] && st == KDA_OK, "exact lead: %s", kda_last_error(ctx));
        }
        if (kx[0] && kx[1])
            CHECK(kx[1]->bv == w.bv && pl[1].np == w.np && pl[1].lead == w.lead && fabs(pl[1].time - w.time) < 0.01 &&
                      fabs(pl[0].time - w.unled) < 0.01,
                  "exact lead, B%d T%d H%d K%d V%d: %d columns, %lld pieces led by %lld, %g chunk-times (%g without) (want %d, %lld, %lld, %g, %g)",
                  w.B, w.T, w.H, w.K, w.V, kx[1]->bv, pl[1].np, pl[1].lead, pl[1].time, pl[0].time, w.bv, w.np, w.lead, w.time, w.unled);
        for (int led = 0; led < 2; led++) kda__fused_drop(ctx, &pl[led], &pe[led]);
    }
    kda_context_destroy(ctx);
}

// The column plan (host only), compare_fla's varlen batch (its 8 lengths, H16, K = V = 128)
// on 132 multiprocessors: 8 columns of 16 blocks at a makespan of 290 chunk-times, which the
// bounded split takes over the best uniform cut (candidate 4: 305 by the same model). Its
// piece table covers every sequence once in pieces of at least 8 chunks (a sequence whole may
// be shorter), and handing its blocks out in launch order, block by block to the first free
// multiprocessor, ends at the makespan: a long piece shares a multiprocessor with a short one.
static void run_fused_column_plan_pairs_long_pieces_with_short() {
    t_current = "fused";
    kda_context *ctx = emu_ctx_sms(132, "column plan");
    if (!ctx) return;
    const std::vector<long long> len = {1327, 7158, 4139, 1158, 11055, 2834, 1501, 3596};
    const long long N = (long long)len.size(), warm = 16;
    kda_problem p = kda_problem_default(1, 32768, 16, 128, 128);
    p.dtype = KDA_BF16; p.qk_l2norm = 1; p.num_seqs = (int)N; p.seqlens_type = KDA_INDEX_I64;
    const kda__kdesc *kf = emu_fused_128();
    kda__fz_plan pl, uni;
    memset(&pl, 0, sizeof pl); memset(&uni, 0, sizeof uni);
    setenv("KDA_SEGMENTS", "4", 1);
    CHECK(kf && kda__fused_plan(ctx, &p, kf, len.data(), N, LLONG_MAX, warm, 0, &uni) == KDA_OK, "column plan: %s", kda_last_error(ctx));
    unsetenv("KDA_SEGMENTS");
    CHECK(kf && kda__fused_plan(ctx, &p, kf, len.data(), N, LLONG_MAX, warm, 0, &pl) == KDA_OK &&
              kda__fused_table(ctx, &p, len.data(), N, warm, &pl) == KDA_OK && pl.tab, "column plan: %s", kda_last_error(ctx));
    CHECK(uni.cols == 0 && pl.cols == 290 && pl.ncol == 8 && pl.time == 290 + KDA__FZ_CHECK && uni.time == 305 + KDA__FZ_CHECK,
          "column plan: makespan %lld on %lld columns, %g chunk-times against the uniform cut's %g", pl.cols, pl.ncol, pl.time, uni.time);
    if (!pl.tab) { kda_context_destroy(ctx); return; }
    const long long np = pl.np;
    const int *seq = pl.tab + np, *first = pl.tab + 2 * np, *base = pl.tab + 3 * np;
    std::vector<int> launched(np, 0);
    bool ok = base[0] == 0 && base[N] == np;
    for (long long r = 0; r < np && ok; r++) ok = pl.tab[r] >= 0 && pl.tab[r] < np && !launched[pl.tab[r]]++;
    std::vector<double> run(np);
    for (long long n = 0; n < N && ok; n++) {
        const long long nch = (len[n] + 15) / 16;
        ok = base[n] < base[n + 1] && first[base[n]] == 0;
        for (long long sl = base[n]; sl < base[n + 1] && ok; sl++) {
            const long long ce = sl + 1 < base[n + 1] ? first[sl + 1] : nch;
            ok = seq[sl] == n && (ce - first[sl] >= 8 || base[n + 1] - base[n] == 1);
            run[sl] = (double)(ce - std::max(first[sl] - warm, 0LL)) + KDA__FZ_FIXED;
        }
    }
    CHECK(ok, "column plan: its piece table does not cover every sequence once in order");
    std::vector<double> end(132, 0.0);
    for (long long r = 0; r < np && ok; r++)
        for (int b = 0; b < 16; b++) *std::min_element(end.begin(), end.end()) += run[pl.tab[r]];
    const double last = *std::max_element(end.begin(), end.end());
    CHECK(!ok || last == 290.0, "column plan: launched in its order the blocks end at %g chunk-times, not 290", last);
    kda__free(ctx, pl.tab);
    kda_context_destroy(ctx);
}

// The exact passes pick their own value tile (host only), K128 V256 B4 T2048 H8 on 132
// multiprocessors: the bounded split runs 128-column pairs, while the exact passes that redo
// it where a bound fails run 64-column blocks, the tile and plan the exact split alone
// (KDA_SPLIT=exact) takes. (B2 T8192 H16 did so too until the exact split's lead: now 128
// columns in 3 pieces a sequence there, run_fused_exact_split_leads_with_a_longer_first_piece.)
static void run_fused_exact_passes_pick_their_own_tile() {
    t_current = "fused";
    kda_context *ctx = emu_ctx_sms(132, "exact tile");
    if (!ctx) return;
    kda_problem p = kda_problem_default(4, 2048, 8, 128, 256);
    p.dtype = KDA_BF16; p.qk_l2norm = 1;
    const kda__kdesc *kf = emu_fused_128(), *ke = NULL, *kb, *kx, *kxe;
    const long long len[4] = {2048, 2048, 2048, 2048};
    kda__fz_plan pl, pe, xl, xe;
    kda_status st = KDA_OK;
    memset(&pl, 0, sizeof pl); memset(&pe, 0, sizeof pe); memset(&xl, 0, sizeof xl); memset(&xe, 0, sizeof xe);
    kb = kf ? kda__fused_variant(ctx, &p, kf, len, 4, LLONG_MAX, 16, 0, &pl, &pe, &ke, &st) : NULL;
    CHECK(kb && ke && st == KDA_OK, "exact tile: %s", kda_last_error(ctx));
    kx = kf && kb ? kda__fused_variant(ctx, &p, kf, len, 4, LLONG_MAX, -1, 0, &xl, &xe, &kxe, &st) : NULL;
    CHECK(kx && kxe == kx && st == KDA_OK, "exact tile, the exact split alone: %s", kda_last_error(ctx));
    if (kb && ke && kx) {
        CHECK(kb->bv == 128 && ke->bv == 64, "exact tile: the bounded split's tile %d (want 128), the exact passes' %d (want 64)",
              kb->bv, ke->bv);
        CHECK(ke == kx && pe.np == xl.np && pe.nseg == xl.nseg,
              "exact tile: the exact passes' tile %d in %lld pieces, the exact split alone's %d in %lld", ke->bv, pe.np, kx->bv, xl.np);
    }
    kda__fused_drop(ctx, &pl, &pe);
    kda__fused_drop(ctx, &xl, &xe);
    kda_context_destroy(ctx);
}

// End to end, where every warm-up's bound fails (Kimi Linear's initialised gates): K128 V256
// T320 on 6 multiprocessors, the bounded split runs 128-column pairs in 3 pieces and the exact
// passes redo it whole in 64-column blocks, their own tile, with the bits of the exact split
// alone (KDA_SPLIT=exact), which runs that tile and plan without the bounded pass.
static void run_fused_failed_bounds_redone_in_the_exact_tile() {
    t_current = "fused";
    kda_context *ctx = emu_ctx_sms(6, "exact tile e2e");
    if (!ctx) return;
    kda_problem p0 = kda_problem_default(1, 320, 1, 128, 256);
    p0.dtype = KDA_BF16; p0.qk_l2norm = 1; p0.gate = KDA_GATE_SOFTPLUS;
    t_inst I;
    DevIn X;
    kimi_inputs(I, X, p0, 777u);
    const size_t ob = I.nv * kda_dtype_size(I.p.dtype);
    Out o[2], ht[2];
    int bv[2] = {0, 0};
    bool bounded[2] = {false, false};
    setenv("KDA_WARMUP", "2", 1);
    for (int run = 0; run < 2; run++) { // the bounded split, then the exact split alone
        o[run].init(ob); ht[run].init(I.ns * 4);
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = o[run].d, out.ht = (float *)ht[run].d;
        if (run) setenv("KDA_SPLIT", "exact", 1);
        emu_flags.clear();
        CHECK(kda_chunk_fwd(ctx, &I.p, &X.dev, &out) == KDA_OK, "exact tile e2e: fwd %d: %s", run, kda_last_error(ctx));
        bv[run] = emu_fused_bv, bounded[run] = !emu_flags.empty();
        unsetenv("KDA_SPLIT");
    }
    unsetenv("KDA_WARMUP");
    o[0].fetch(); o[1].fetch(); ht[0].fetch(); ht[1].fetch();
    CHECK(bounded[0] && !bounded[1], "exact tile e2e: the bounded pass ran %d (want 1), with KDA_SPLIT=exact %d (want 0)",
          (int)bounded[0], (int)bounded[1]);
    CHECK(bv[0] == 64 && bv[1] == 64, "exact tile e2e: the output pass's tile %d after the bounded split, %d alone (want 64)", bv[0], bv[1]);
    CHECK(!memcmp(o[0].h.data(), o[1].h.data(), ob) && !memcmp(ht[0].h.data(), ht[1].h.data(), I.ns * 4),
          "exact tile e2e: o and ht after the failed bounded split are not the exact split's");
    dfree_all();
    t_inst_free(&I);
    kda_context_destroy(ctx);
}

// kda_chunk_fwd_workspace (host only, 132 multiprocessors): the fused forward's need is the
// plans' pieces' states, not the staged kernels' GBs, and is tight: a workspace of that many
// bytes gives the plans the forward makes with its own (same tiles, pieces and cuts), one byte
// less loses a piece. Shapes of the benchmark: the exact split (B1 T8192 H32, no l2norm), the
// bounded split and its exact passes, no split (B8: the tables' slack alone), V = 256, and two
// varlen batches, 8 sequences and 64 (too many to split), whose bounds over every cu_seqlens
// hold the needs of 200 random batches of up to as many sequences and tokens each. The pool
// form adds its states' fp32 copy; outputs that ask for h take the staged kernels' need.
static void run_fused_workspace_query_is_the_plans_need() {
    t_current = "fused";
    kda_context *ctx = emu_ctx_sms(132, "workspace query");
    if (!ctx) return;
    struct Shape { int B, T, H, K, V, l2, nseq; bool split; } shapes[] = {
        {1, 8192, 32, 128, 128, 0, 0, true}, {1, 8192, 32, 128, 128, 1, 0, true}, {8, 4096, 16, 128, 128, 1, 0, false},
        {2, 8192, 16, 128, 256, 1, 0, true}, {1, 32768, 16, 128, 128, 1, 8, true}, {1, 65536, 16, 128, 128, 1, 64, false},
    };
    Uni uni{4242u};
    for (const Shape &sh : shapes) {
        kda_problem p = kda_problem_default(sh.B, sh.T, sh.H, sh.K, sh.V);
        p.dtype = KDA_BF16; p.qk_l2norm = sh.l2; p.num_seqs = sh.nseq; p.seqlens_type = KDA_INDEX_I64;
        const long long N = kda_num_seqs(&p);
        std::vector<long long> cu((size_t)N + 1, 0), len((size_t)N, sh.T);
        if (sh.nseq) { // the benchmark's varlen batch: lengths in ratio 1..8 (N = 8), or even
            for (long long n = 0; n < N; n++) cu[(size_t)n + 1] = cu[(size_t)n] + (N == 8 ? (n + 1) * sh.T / 36 : sh.T / N);
            cu[(size_t)N] = sh.T;
            for (long long n = 0; n < N; n++) len[(size_t)n] = cu[(size_t)n + 1] - cu[(size_t)n];
        }
        char name[96];
        snprintf(name, sizeof name, "workspace query B%d T%d H%d K%d V%d l2norm %d varlen %d", sh.B, sh.T, sh.H, sh.K, sh.V, sh.l2, sh.nseq);
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        const kda__kdesc *kf = kda__fused_wanted(ctx, &p, &out);
        size_t q = 0;
        CHECK(kf && kda_chunk_fwd_workspace(ctx, &p, &out, sh.nseq ? cu.data() : NULL, &q) == KDA_OK, "%s: %s", name, kda_last_error(ctx));
        if (!kf) continue;
        const long long warm = kda__fused_warm(ctx, kf, &p);
        const kda__fz_mem m = kda__fz_mem_of(&p, N, warm, 0);
        kda__fz_plan pl[3], pe[3];
        const kda__kdesc *k[3], *ke[3];
        long long caps[3] = {LLONG_MAX, 0, 0}, P = 0;
        const int fx = kda__fused_fixup(&p);
        for (int c = 0; c < (P > 0 ? 3 : c ? 2 : 1); c++) {
            kda_status st = KDA_OK;
            memset(&pl[c], 0, sizeof pl[c]); memset(&pe[c], 0, sizeof pe[c]);
            k[c] = kda__fused_variant(ctx, &p, kf, len.data(), N, caps[c], warm, fx, &pl[c], &pe[c], &ke[c], &st);
            CHECK(k[c] && st == KDA_OK, "%s: the plan with a cap of %lld: %s", name, caps[c], kda_last_error(ctx));
            if (c || !k[0]) continue;
            // the pieces the query holds, and the exact split's fix-up's qt where its plan takes it
            const size_t qt = pe[0].np > N && pe[0].fx ? m.qt : 0;
            CHECK(q >= m.fixed + qt && (q - m.fixed - qt) % m.piece == 0, "%s: %zu bytes, not %zu (+ %zu) and whole pieces of %zu", name,
                  q, m.fixed, qt, m.piece);
            P = (long long)((q - m.fixed - qt) / m.piece);
            caps[1] = P, caps[2] = P - 1;
            CHECK(sh.split ? P > 0 && q < kda_fwd_workspace_size(&p) / (qt ? 4 : 20) : q == m.fixed,
                  "%s: %zu bytes (%lld pieces), the staged need %zu", name, q, P, kda_fwd_workspace_size(&p));
        }
        if (!k[0] || !k[1]) continue;
        const long long most = std::max(pl[0].np > N ? pl[0].np : 0, pe[0].np > N ? pe[0].np : 0);
        CHECK(most == P, "%s: the plans' pieces %lld and %lld, the query's %lld", name, pl[0].np, pe[0].np, P);
        CHECK(k[1] == k[0] && ke[1] == ke[0] && pl[1].np == pl[0].np && pe[1].np == pe[0].np && pl[1].cand == pl[0].cand &&
                  pe[1].cand == pe[0].cand && pl[1].lead == pl[0].lead && pe[1].lead == pe[0].lead && pl[1].cols == pl[0].cols &&
                  pe[1].fx == pe[0].fx,
              "%s: a workspace of the query's bytes plans %s in %lld/%lld pieces, its own %s in %lld/%lld", name, k[1]->name, pl[1].np,
              pe[1].np, k[0]->name, pl[0].np, pe[0].np);
        if (P > 0 && k[2])
            CHECK(std::max(pl[2].np, pe[2].np) < P || (pl[2].np <= N && pe[2].np <= N), "%s: one byte less still plans %lld/%lld pieces",
                  name, pl[2].np, pe[2].np);
        for (int c = 0; c < (P > 0 ? 3 : 2); c++)
            if (k[c]) kda__fused_drop(ctx, &pl[c], &pe[c]);
        // the pool form adds the states' fp32 copy; asking for h (the staged kernels) the staged need
        kda_fwd_outputs pool = out, hs = out;
        size_t qp = 0, qh = 0;
        pool.state_pool = (float *)&qp, hs.h = (float *)&qh; // (the pointers are not read)
        CHECK(kda_chunk_fwd_workspace(ctx, &p, &pool, sh.nseq ? cu.data() : NULL, &qp) == KDA_OK && qp == q + kda__pool_f32_size(&p),
              "%s: the pool form needs %zu, want %zu + %zu", name, qp, q, kda__pool_f32_size(&p));
        CHECK(kda_chunk_fwd_workspace(ctx, &p, &hs, sh.nseq ? cu.data() : NULL, &qh) == KDA_OK && qh == kda_fwd_workspace_size(&p),
              "%s: with h (staged) %zu, want kda_fwd_workspace_size's %zu", name, qh, kda_fwd_workspace_size(&p));
        if (!sh.nseq) continue;
        size_t any = 0;
        CHECK(kda_chunk_fwd_workspace(ctx, &p, &out, NULL, &any) == KDA_OK && any >= q,
              "%s: the bound over any lengths %zu, the batch's need %zu", name, any, q);
        for (int r = 0; r < 200; r++) { // random smaller batches: N2 <= N sequences, T2 <= T tokens cut at random points
            const long long N2 = 1 + (long long)(uni() * N), T2 = N2 + (long long)(uni() * (sh.T - N2));
            kda_problem p2 = p;
            p2.num_seqs = (int)N2, p2.T = (int)T2;
            std::vector<long long> c2((size_t)N2 + 1, 0);
            for (long long n = 1; n < N2; n++) c2[(size_t)n] = (long long)(uni() * T2);
            c2[(size_t)N2] = T2;
            std::sort(c2.begin(), c2.end());
            size_t q2 = 0;
            CHECK(kda_chunk_fwd_workspace(ctx, &p2, &out, c2.data(), &q2) == KDA_OK && q2 <= any,
                  "%s: random batch %d of %lld sequences, %lld tokens needs %zu, over the bound %zu (%s)", name, r, N2, T2, q2, any,
                  kda_last_error(ctx));
        }
    }
    kda_context_destroy(ctx);
}

// End to end (6 multiprocessors, Kimi Linear's gates: the exact split): a caller's workspace
// of kda_chunk_fwd_workspace's bytes runs the split the forward makes with its own, with
// its bits.
static void run_fused_runs_its_own_split_in_the_queried_workspace() {
    t_current = "fused";
    kda_context *ctx = emu_ctx_sms(6, "workspace query e2e");
    if (!ctx) return;
    kda_problem p0 = kda_problem_default(1, 512, 1, 64, 64);
    p0.dtype = KDA_BF16; p0.gate = KDA_GATE_SOFTPLUS;
    t_inst I;
    DevIn X;
    kimi_inputs(I, X, p0, 99u);
    const size_t ob = I.nv * kda_dtype_size(I.p.dtype);
    Out o[2], ht[2];
    int nseg[2] = {0, 0};
    size_t q = 0;
    kda_fwd_outputs out;
    memset(&out, 0, sizeof out);
    CHECK(kda_chunk_fwd_workspace(ctx, &I.p, &out, NULL, &q) == KDA_OK, "workspace query e2e: %s", kda_last_error(ctx));
    void *ws = dalloc(q);
    for (int run = 0; run < 2; run++) { // the library's workspace, then the caller's of q bytes
        o[run].init(ob); ht[run].init(I.ns * 4);
        out.o = o[run].d, out.ht = (float *)ht[run].d;
        kda_set_workspace(ctx, run ? ws : NULL, run ? q : 0);
        CHECK(kda_chunk_fwd(ctx, &I.p, &X.dev, &out) == KDA_OK, "workspace query e2e: fwd %d: %s", run, kda_last_error(ctx));
        nseg[run] = emu_fused_nseg;
    }
    kda_set_workspace(ctx, NULL, 0);
    o[0].fetch(); o[1].fetch(); ht[0].fetch(); ht[1].fetch();
    CHECK(nseg[0] > 1 && nseg[1] == nseg[0], "workspace query e2e: %d pieces with the library's workspace (want > 1), %d in %zu bytes",
          nseg[0], nseg[1], q);
    CHECK(!memcmp(o[0].h.data(), o[1].h.data(), ob) && !memcmp(ht[0].h.data(), ht[1].h.data(), I.ns * 4),
          "workspace query e2e: o and ht in the queried workspace are not those in the library's");
    dfree_all();
    t_inst_free(&I);
    kda_context_destroy(ctx);
}

// The fused forward keeps its plan for calls that repeat it and makes a new one when the
// lengths change: after a batch of 200, 35 and 100 tokens, one of 35, 200 and 100 (same
// problem, same total) gets the pieces and the bits of a fresh context.
static void run_fused_replans_for_new_lengths() {
    t_current = "fused";
    kda_problem p0 = kda_problem_default(1, 335, 1, 64, 32);
    p0.HV = 2; p0.dtype = KDA_BF16; p0.qk_l2norm = 1; p0.num_seqs = 3; p0.seqlens_type = KDA_INDEX_I64;
    const long long cu1[] = {0, 200, 235, 335}, cu2[] = {0, 35, 235, 335};
    t_inst I1, I2;
    t_inst_init(&I1, &p0, cu1, 1, 0);
    t_inst_init(&I2, &p0, cu2, 1, 0);
    DevIn X1, X2;
    dev_inputs(X1, I1);
    dev_inputs(X2, I2);
    const size_t es = kda_dtype_size(p0.dtype);
    Out o1, o2, of;
    o1.init(I1.nv * es); o2.init(I2.nv * es); of.init(I2.nv * es);
    setenv("KDA_SEGMENTS", "3", 1);
    setenv("KDA_WARMUP", "2", 1);
    std::vector<int> again, fresh;
    kda_context *other = dev_ctx();
    for (int call = 0; call < 3; call++) { // g_dev: batch 1, then batch 2; a fresh context: batch 2
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = call == 0 ? o1.d : call == 1 ? o2.d : of.d;
        CHECK(kda_chunk_fwd(call == 2 ? other : g_dev, &I1.p, call ? &X2.dev : &X1.dev, &out) == KDA_OK, "replan: fwd %d: %s",
              call, kda_last_error(call == 2 ? other : g_dev));
        (call == 1 ? again : fresh) = emu_pieces;
    }
    unsetenv("KDA_SEGMENTS"); unsetenv("KDA_WARMUP");
    o2.fetch(); of.fetch();
    CHECK(!again.empty() && again == fresh, "replan: the second batch's piece table (%zu entries) is not a fresh context's (%zu)",
          again.size(), fresh.size());
    CHECK(!memcmp(o2.h.data(), of.h.data(), I2.nv * es), "replan: the second batch's o differs from a fresh context's");
    kda_context_destroy(other);
    dfree_all();
    t_inst_free(&I1);
    t_inst_free(&I2);
}
#endif

// The exact split's fix-up (a transition pass of every piece, fwd_combine on to ht, fwd_fixup)
// against its output pass (KDA_FIXUP=0), end to end with Kimi Linear's gates (the emulator:
// 6 multiprocessors): against the CPU's forward, o and ht as close as the output
// pass's to within a quarter (the rounding of o's extra pass and of the identity blocks'
// outputs; bf16, f16; fixed lengths and varlen, whose short sequence runs whole in the
// transition pass, its ht from there; K = 30, rows of odd lengths), three pieces (KDA_SEGMENTS) and the fix-up taken
// where it applies (KDA_FIXUP=2) whatever the model says. A caller's workspace a byte short
// of the fix-up's least (its qt and two pieces) runs the output pass; K > V runs it too (the
// identity blocks' outputs go where o's would).
static void run_fused_fixup_matches_the_output_pass(bool race) {
    t_current = "fused";
    struct S { int T, K, V; kda_dtype dt; bool varlen; } shapes[] = {
        {512, 64, 64, KDA_BF16, false}, {400, 48, 72, KDA_F16, false}, {520, 64, 64, KDA_BF16, true}, {1024, 72, 48, KDA_BF16, false},
        {300, 30, 40, KDA_F16, false}}; // (K = 30: fwd_fixup's element-wise loads)
    for (size_t i = 0; i < (race ? 1 : std::size(shapes)); i++) { // (--race: fwd_fixup's copies and barriers, once)
        const S &sh = shapes[i];
#ifdef KDA_TEST_EMU
        kda_context *ctx = emu_ctx_sms(6, "fix-up");
        if (!ctx) return;
#else
        kda_context *ctx = g_dev;
#endif
        char name[96];
        snprintf(name, sizeof name, "fused_fixup_T%d_K%d_V%d_%s%s", sh.T, sh.K, sh.V, kda_dtype_name(sh.dt), sh.varlen ? "_varlen" : "");
        kda_problem p0 = kda_problem_default(1, sh.T, 1, sh.K, sh.V);
        p0.dtype = sh.dt; p0.gate = KDA_GATE_SOFTPLUS;
        std::vector<long long> cu = {0, 40, sh.T}; // (varlen: a short sequence beside a long one)
        if (sh.varlen) p0.num_seqs = 2, p0.seqlens_type = KDA_INDEX_I64;
        t_inst I;
        DevIn X;
        t_inst_init(&I, &p0, sh.varlen ? cu.data() : NULL, 1, 0);
        Uni uni{7u + (unsigned)sh.T};
        kimi_gates(I, p0.HV, p0.K, uni);
        for (size_t i = 0; i < I.nb; i++) I.beta[i] = (float)uni();
        dev_inputs(X, I);
        const size_t ob = I.nv * kda_dtype_size(I.p.dtype);
        Out o[3], ht[3];
        int fixups[3], nseg = 0;
        size_t qo = 0, qf = 0;
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        o[0].init(ob); ht[0].init(I.ns * 4);
        out.o = o[0].c.data(), out.ht = (float *)ht[0].c.data();
        kda_context *cpu = t_cpu();
        CHECK(kda_chunk_fwd(cpu, &I.p, &X.host, &out) == KDA_OK, "%s: CPU fwd: %s", name, kda_last_error(cpu));
        kda_context_destroy(cpu);
        setenv("KDA_SEGMENTS", "3", 1);
        setenv("KDA_FIXUP", "0", 1);
        CHECK(kda_chunk_fwd_workspace(ctx, &I.p, &out, sh.varlen ? cu.data() : NULL, &qo) == KDA_OK, "%s: %s", name, kda_last_error(ctx));
        setenv("KDA_FIXUP", "2", 1);
        CHECK(kda_chunk_fwd_workspace(ctx, &I.p, &out, sh.varlen ? cu.data() : NULL, &qf) == KDA_OK, "%s: %s", name, kda_last_error(ctx));
        const bool fx = sh.K <= sh.V;
        CHECK(fx ? qf > qo : qf == qo, "%s: the fix-up's workspace %zu, the output pass's %zu", name, qf, qo);
        const kda__kdesc *kf = kda__fused_wanted(ctx, &I.p, &out);
        const kda__fz_mem m = kda__fz_mem_of(&I.p, kda_num_seqs(&I.p), kf ? kda__fused_warm(ctx, kf, &I.p) : -1, 0);
        const size_t short_ws = m.fixed + m.qt + 2 * m.piece - 1;
        void *ws = dalloc(short_ws);
        for (int run = 0; run < 3; run++) { // KDA_FIXUP=0; the default; the default in a workspace short of the fix-up's
            if (run) o[run].init(ob), ht[run].init(I.ns * 4), o[run].c = o[0].c, ht[run].c = ht[0].c;
            out.o = o[run].d, out.ht = (float *)ht[run].d;
            setenv("KDA_FIXUP", run ? "2" : "0", 1);
            kda_set_workspace(ctx, run == 2 ? ws : NULL, run == 2 ? short_ws : 0);
#ifdef KDA_TEST_EMU
            emu_fixups = 0;
#endif
            CHECK(kda_chunk_fwd(ctx, &I.p, &X.dev, &out) == KDA_OK, "%s: fwd %d: %s", name, run, kda_last_error(ctx));
#ifdef KDA_TEST_EMU
            fixups[run] = emu_fixups;
            if (run == 1) nseg = emu_fused_nseg;
#endif
            o[run].fetch(); ht[run].fetch();
        }
        kda_set_workspace(ctx, NULL, 0);
        unsetenv("KDA_FIXUP");
        unsetenv("KDA_SEGMENTS");
#ifdef KDA_TEST_EMU
        CHECK(nseg > 1, "%s: %d pieces (want a split)", name, nseg);
        CHECK(fixups[0] == 0 && fixups[1] == (fx ? 1 : 0) && fixups[2] == 0, "%s: fwd_fixup ran %d, %d and %d times", name, fixups[0],
              fixups[1], fixups[2]);
#else
        (void)nseg, (void)fixups;
#endif
        double eo[3], eh[3]; // (device against CPU)
        for (int run = 0; run < 3; run++)
            eo[run] = err_t(o[run].c.data(), o[run].h.data(), I.nv, I.p.dtype),
            eh[run] = err_f((const float *)ht[run].c.data(), (const float *)ht[run].h.data(), I.ns);
        for (int run = 1; run < 3; run++)
            CHECK(eo[run] <= 1.25 * eo[0] && eh[run] <= 1.25 * eh[0] + 1e-6,
                  "%s: against the CPU, run %d's o %.3g and ht %.3g, the output pass's %.3g and %.3g", name, run, eo[run], eh[run], eo[0], eh[0]);
        CHECK(fx ? memcmp(o[0].h.data(), o[1].h.data(), ob) != 0 : !memcmp(o[0].h.data(), o[1].h.data(), ob), "%s: o %s", name,
              fx ? "the same bits: no fix-up" : "differs");
        printf("%s: o %.3g (output pass %.3g), ht %.3g (%.3g)\n", name, eo[1], eo[0], eh[1], eh[0]);
        dfree_all();
        t_inst_free(&I);
#ifdef KDA_TEST_EMU
        kda_context_destroy(ctx);
#endif
    }
}


#ifdef KDA_TEST_EMU
// A fused config's inputs on the host and the device, for the tests that call the
// forward by hand; device memory is freed with them.
struct FusedInputs {
    t_inst I;
    DevIn X;
    explicit FusedInputs(const Cfg &cf) {
        t_current = "fused";
        t_inst_init(&I, &cf.p, cf.cu.empty() ? NULL : cf.cu.data(), cf.has_h0, 0);
        dev_inputs(X, I);
    }
    ~FusedInputs() {
        dfree_all();
        t_inst_free(&I);
    }
};

// A device that gives a block 163 KB (sm_80) runs K=128 with the 128-column tile (153 KB)
// where the 64-column one (221 KB) does not fit, whichever the model prefers.
static void run_fused_takes_the_tile_that_fits(const Cfg &cf) {
    FusedInputs F(cf);
    const t_inst &I = F.I;
    DevIn &X = F.X;
    Out o;
    o.init(I.nv * kda_dtype_size(I.p.dtype));
    kda_fwd_outputs out;
    memset(&out, 0, sizeof out);
    out.o = o.d;
    emu_smem_limit = 166912;
    const int before = emu_fused;
    CHECK(kda_chunk_fwd(g_dev, &I.p, &X.dev, &out) == KDA_OK, "%s: fwd with 163 KB: %s", cf.name, kda_last_error(g_dev));
    emu_smem_limit = 0;
    CHECK(emu_fused > before && emu_fused_bv == 128, "%s: 163 KB of shared memory: %d fused launches, tile %d", cf.name,
          emu_fused - before, emu_fused_bv);
}

// A caller's workspace bounds the split: asked for 3 segments, a workspace that holds the
// states of 2 runs 2 (same bits as KDA_SEGMENTS=2 with the library's own workspace), one
// that holds none runs unsplit (same bits as KDA_SEGMENTS=1), instead of failing for want
// of memory.
static void run_fused_splits_as_far_as_the_workspace_holds(const Cfg &cf) {
    FusedInputs F(cf);
    const t_inst &I = F.I;
    const kda_problem &p = I.p;
    DevIn &X = F.X;
    const size_t es = kda_dtype_size(p.dtype), tb = kda__tables_size(&p);
    // a piece: its transition, start state and 3 ints of the piece table (one sequence); 2048
    // bytes more cover the alignment and the table's last int
    const size_t seg = (size_t)p.HV * (2 * p.V + p.K) * p.K * sizeof(float) + 3 * sizeof(int);
    CHECK(kda_num_seqs(&p) == 1 && !p.qk_l2norm, "%s: the test sizes the workspace for one sequence, exact split", cf.name);
    for (int segs = 1; segs <= 2; segs++) {
        const size_t ws_bytes = tb + 2048 + (segs == 2 ? 2 * seg : seg - 1);
        void *ws = dalloc(ws_bytes);
        Out o, o1;
        o.init(I.nv * es); o1.init(I.nv * es);
        int nseg = 0;
        for (int side = 0; side < 2; side++) { /* 3 segments asked for in the caller's workspace; segs without one */
            kda_fwd_outputs out;
            memset(&out, 0, sizeof out);
            out.o = side ? o1.d : o.d;
            setenv("KDA_SEGMENTS", side ? (segs == 2 ? "2" : "1") : "3", 1);
            kda_set_workspace(g_dev, side ? NULL : ws, side ? 0 : ws_bytes);
            CHECK(kda_chunk_fwd(g_dev, &p, &X.dev, &out) == KDA_OK, "%s: fwd (%s): %s", cf.name,
                  side ? "the library's workspace" : "3 segments in the caller's workspace", kda_last_error(g_dev));
            if (!side) nseg = emu_fused_nseg;
        }
        kda_set_workspace(g_dev, NULL, 0);
        unsetenv("KDA_SEGMENTS");
        CHECK(nseg == segs, "%s: a workspace for %d segment(s) ran %d", cf.name, segs, nseg);
        o.fetch(); o1.fetch();
        CHECK(memcmp(o.h.data(), o1.h.data(), I.nv * es) == 0, "%s: %d segment(s) in the caller's workspace differ from %d in the library's",
              cf.name, segs, segs);
    }
}

// A device that gives a block less shared memory than the fused kernel needs (sm_86's
// 99 KB against 153 KB) runs the staged forward: same bits as KDA_FUSED=0, no fused launch.
static void run_fused_declines_without_shared_memory(const Cfg &cf) {
    FusedInputs F(cf);
    const t_inst &I = F.I;
    const kda_problem &p = I.p;
    DevIn &X = F.X;
    const size_t es = kda_dtype_size(p.dtype);
    Out o, os;
    o.init(I.nv * es); os.init(I.nv * es);
    emu_smem_limit = 1024;
    const int before = emu_fused;
    for (int side = 0; side < 2; side++) {
        Out &oo = side ? os : o;
        oo.poison();
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = oo.d;
        setenv("KDA_FUSED", side ? "0" : "1", 1);
        CHECK(kda_chunk_fwd(g_dev, &p, &X.dev, &out) == KDA_OK, "%s: fwd with a small shared memory: %s", cf.name,
              kda_last_error(g_dev));
    }
    unsetenv("KDA_FUSED");
    emu_smem_limit = 0;
    o.fetch(); os.fetch();
    CHECK(emu_fused == before, "%s: the fused kernel ran on a device without its shared memory", cf.name);
    CHECK(memcmp(o.h.data(), os.h.data(), I.nv * es) == 0, "%s: the declined forward differs from the staged one", cf.name);
}
#endif

// ---- whole operations on the device against the CPU ----
static void run_ops(const Cfg &cf) {
    kda_context *cpu = t_cpu();
    t_inst I;
    t_current = "ops";
    t_inst_init(&I, &cf.p, cf.cu.empty() ? NULL : cf.cu.data(), cf.has_h0, cf.has_dht);
    const kda_problem &p = I.p;
    const size_t es = kda_dtype_size(p.dtype), nst = I.ns;
    DevIn X;
    dev_inputs(X, I);
    const long long NT = kda_num_chunks(&p, X.host.cu_seqlens);
    const size_t nh = (size_t)NT * p.HV * p.K * p.V;
    const double tx = p.dtype == KDA_F32 ? 1e-5 : 1e-2;
    Out o, ht, h, dq, dk, dv, dg, db, dh0, dA, ddt;
    o.init(I.nv * es); ht.init(nst * 4); h.init(nh * 4); dq.init(I.nq * es); dk.init(I.nq * es); dv.init(I.nv * es);
    dg.init(I.ng * kda_dtype_size(p.g_dtype)); db.init(I.nb * kda_dtype_size(p.beta_dtype)); dh0.init(nst * 4);
    dA.init(sizeof(float) * p.HV); ddt.init(sizeof(float) * p.HV * p.K);
    std::vector<unsigned char> saved_c(kda_fwd_saved_size(&p));
    void *saved_d = dalloc(kda_fwd_saved_size(&p));
    for (int side = 0; side < 2; side++) { /* 0: CPU, 1: device */
        kda_context *ctx = side ? g_dev : cpu;
        auto P = [&](Out &x) -> void * { return side ? x.d : (void *)x.c.data(); };
        if (side) for (Out *x : {&o, &ht, &h}) x->poison();
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = P(o); out.ht = (float *)P(ht); out.h = (float *)P(h); out.saved = side ? saved_d : saved_c.data();
        CHECK(kda_chunk_fwd(ctx, &p, side ? &X.dev : &X.host, &out) == KDA_OK, "%s: fwd on %s: %s", cf.name,
              side ? "device" : "cpu", kda_last_error(ctx));
    }
    o.fetch(); ht.fetch(); h.fetch();
    CHECK(err_t(o.c.data(), o.h.data(), I.nv, p.dtype) <= tx, "%s: o", cf.name);
    CHECK(err_f((float *)ht.c.data(), (float *)ht.h.data(), nst) <= 1e-5, "%s: ht", cf.name);
    CHECK(err_f((float *)h.c.data(), (float *)h.h.data(), nh) <= 1e-5, "%s: intermediate states", cf.name);
    for (int saved = 0; saved < 2; saved++) {
        const char *how = saved ? "saved" : "recompute";
        for (int side = 0; side < 2; side++) {
            kda_context *ctx = side ? g_dev : cpu;
            auto P = [&](Out &x) -> void * { return side ? x.d : (void *)x.c.data(); };
            if (side) for (Out *x : {&dq, &dk, &dv, &dg, &db, &dh0, &dA, &ddt}) x->poison();
            kda_bwd_io io;
            memset(&io, 0, sizeof io);
            io.dout = side ? X.dout : X.D.dout.data();
            io.dht = side ? (const float *)X.dht : I.dht;
            io.saved = saved ? (side ? saved_d : (void *)saved_c.data()) : NULL;
            io.dq = P(dq); io.dk = P(dk); io.dv = P(dv); io.dg = P(dg); io.dbeta = P(db); io.dh0 = (float *)P(dh0);
            io.dA_log = I.A_log ? (float *)P(dA) : NULL; io.ddt_bias = I.dt_bias ? (float *)P(ddt) : NULL;
            CHECK(kda_chunk_bwd(ctx, &p, side ? &X.dev : &X.host, &io) == KDA_OK, "%s: bwd on %s (%s): %s", cf.name,
                  side ? "device" : "cpu", how, kda_last_error(ctx));
        }
        for (Out *x : {&dq, &dk, &dv, &dg, &db, &dh0, &dA, &ddt}) x->fetch();
        CHECK(err_t(dq.c.data(), dq.h.data(), I.nq, p.dtype) <= tx, "%s: dq (%s)", cf.name, how);
        CHECK(err_t(dk.c.data(), dk.h.data(), I.nq, p.dtype) <= tx, "%s: dk (%s)", cf.name, how);
        CHECK(err_t(dv.c.data(), dv.h.data(), I.nv, p.dtype) <= tx, "%s: dv (%s)", cf.name, how);
        CHECK(err_t(dg.c.data(), dg.h.data(), I.ng, p.g_dtype) <= (p.g_dtype ? 1e-2 : 1e-5), "%s: dg (%s)", cf.name, how);
        CHECK(err_t(db.c.data(), db.h.data(), I.nb, p.beta_dtype) <= (p.beta_dtype ? 1e-2 : 1e-5), "%s: dbeta (%s)", cf.name, how);
        CHECK(err_f((float *)dh0.c.data(), (float *)dh0.h.data(), nst) <= 1e-5, "%s: dh0 (%s)", cf.name, how);
        if (I.A_log) CHECK(err_f((float *)dA.c.data(), (float *)dA.h.data(), p.HV) <= 1e-5, "%s: dA_log (%s)", cf.name, how);
        if (I.dt_bias)
            CHECK(err_f((float *)ddt.c.data(), (float *)ddt.h.data(), (size_t)p.HV * p.K) <= 1e-5, "%s: ddt_bias (%s)", cf.name, how);
    }
    /* recurrence, plain form */
    for (int side = 0; side < 2; side++) {
        kda_context *ctx = side ? g_dev : cpu;
        auto P = [&](Out &x) -> void * { return side ? x.d : (void *)x.c.data(); };
        if (side) { o.poison(); ht.poison(); }
        kda_recurrent_io io;
        memset(&io, 0, sizeof io);
        io.o = P(o); io.ht = (float *)P(ht);
        CHECK(kda_recurrent_fwd(ctx, &p, side ? &X.dev : &X.host, &io) == KDA_OK, "%s: recurrent on %s: %s", cf.name,
              side ? "device" : "cpu", kda_last_error(ctx));
    }
    o.fetch(); ht.fetch();
    CHECK(err_t(o.c.data(), o.h.data(), I.nv, p.dtype) <= tx, "%s: recurrent o", cf.name);
    CHECK(err_f((float *)ht.c.data(), (float *)ht.h.data(), nst) <= 1e-5, "%s: recurrent ht", cf.name);
    /* the pool form: sequence 1 is padding; slots no sequence names must stay bit-identical */
    {
        const int N = kda_num_seqs(&p), nslots = 2 * N + 2;
        const size_t sl = (size_t)p.HV * p.K * p.V;
        std::vector<int32_t> slots(N);
        std::vector<bool> named(nslots, false); // (a slot some sequence names)
        for (int n = 0; n < N; n++) slots[n] = n == 1 ? -1 : 2 * n + 1;
        for (int n = 0; n < N; n++)
            if (slots[n] >= 0) named[slots[n]] = true;
        std::vector<float> pool0((size_t)nslots * sl, 1e30f), poolc, poold((size_t)nslots * sl);
        /* a named slot starts from the sequence's h0, or zeros: the other slots' 1e30 would hide its errors */
        for (int n = 0; n < N; n++)
            if (slots[n] >= 0) {
                if (I.h0) memcpy(&pool0[slots[n] * sl], I.h0 + n * sl, sl * 4);
                else std::fill(pool0.begin() + slots[n] * sl, pool0.begin() + (slots[n] + 1) * sl, 0.0f);
            }
        /* the named slots' values alone: an error among them measured against their own size */
        auto named_err = [&](const std::vector<float> &ref, const std::vector<float> &x) {
            std::vector<float> r, y;
            for (int n = 0; n < N; n++)
                if (slots[n] >= 0) {
                    r.insert(r.end(), ref.begin() + slots[n] * sl, ref.begin() + (slots[n] + 1) * sl);
                    y.insert(y.end(), x.begin() + slots[n] * sl, x.begin() + (slots[n] + 1) * sl);
                }
            return err_f(r.data(), y.data(), r.size());
        };
        /* the CPU's pool pool_c and the device's pool_d, of dtype dt, through the recurrence */
        void *slots_d = dup(slots.data(), slots.size() * 4);
        auto run_pool = [&](void *pool_c, void *pool_d, kda_dtype dt) {
            for (int side = 0; side < 2; side++) {
                kda_context *ctx = side ? g_dev : cpu;
                kda_inputs pin = side ? X.dev : X.host;
                pin.h0 = NULL;
                if (side) o.poison(); else memset(o.c.data(), 0x7f, o.bytes);
                kda_recurrent_io io;
                memset(&io, 0, sizeof io);
                io.o = side ? o.d : (void *)o.c.data();
                io.state_pool = (float *)(side ? pool_d : pool_c);
                io.slots = side ? (const int32_t *)slots_d : slots.data();
                io.slots_host = slots.data();
                io.num_slots = nslots;
                io.state_dtype = dt;
                CHECK(kda_recurrent_fwd(ctx, &p, &pin, &io) == KDA_OK, "%s: %s pool on %s: %s", cf.name, kda_dtype_name(dt),
                      side ? "device" : "cpu", kda_last_error(ctx));
            }
        };
        poolc = pool0;
        void *pool_d = dup(pool0.data(), pool0.size() * 4);
        run_pool(poolc.data(), pool_d, KDA_F32);
        o.fetch();
        down(poold.data(), pool_d, poold.size() * 4);
        /* rows of the padded sequence are not compared: neither side writes them */
        std::vector<float> oc((size_t)I.nv), od((size_t)I.nv);
        for (size_t i = 0; i < (size_t)I.nv; i++) { oc[i] = kda__ld(o.c.data(), p.dtype, i); od[i] = kda__ld(o.h.data(), p.dtype, i); }
        {
            kda__seqs sq;
            kda__seqs_build(cpu, &p, X.host.cu_seqlens, &sq);
            long long r0 = sq.bos[1], r1 = sq.bos[1] + sq.len[1];
            for (long long r = r0; r < r1; r++)
                for (size_t e = 0; e < (size_t)p.HV * p.V; e++) oc[r * p.HV * p.V + e] = od[r * p.HV * p.V + e] = 0;
            kda__seqs_free(cpu, &sq);
        }
        CHECK(err_f(oc.data(), od.data(), oc.size()) <= tx, "%s: pool o", cf.name);
        CHECK(named_err(poolc, poold) <= 1e-5, "%s: pool states", cf.name);
        size_t changed = 0;
        for (size_t i = 0; i < poold.size(); i++) changed += !named[i / sl] && memcmp(&poold[i], &pool0[i], 4) != 0;
        CHECK(changed == 0, "%s: %zu values changed in slots no sequence names", cf.name, changed);
        /* the same with a bf16 pool: device and CPU round the same fp32 states */
        std::vector<uint16_t> p16((size_t)nslots * sl), p16c, p16d((size_t)nslots * sl);
        for (size_t i = 0; i < p16.size(); i++) p16[i] = kda_f32_to_bf16(pool0[i]);
        p16c = p16;
        void *pool16_d = dup(p16.data(), p16.size() * 2);
        run_pool(p16c.data(), pool16_d, KDA_BF16);
        down(p16d.data(), pool16_d, p16d.size() * 2);
        std::vector<float> a(p16.size()), b(p16.size());
        size_t changed16 = 0;
        for (size_t i = 0; i < p16.size(); i++) {
            a[i] = kda_bf16_to_f32(p16c[i]); b[i] = kda_bf16_to_f32(p16d[i]);
            changed16 += !named[i / sl] && p16d[i] != p16[i];
        }
        CHECK(named_err(a, b) <= 1e-2, "%s: bf16 pool states", cf.name);
        CHECK(changed16 == 0, "%s: bf16 pool: %zu values changed in slots no sequence names", cf.name, changed16);
    }
    dfree_all();
    t_inst_free(&I);
    kda_context_destroy(cpu);
}

#ifdef KDA_TEST_EMU
// ---- the emulator itself (tests/cuda_emu.h), which every kernel test here stands on
struct EmuArgs { int *out; int rounds; };
// each thread: a neighbour's value after __syncthreads, summed over its warp by shuffles; and
// warps 2-3 take `rounds` hands of 64 values from warps 0-1 through named barriers 1 (full)
// and 2 (empty), as the fused forward's factor and state warps hand over their buffers
static void emu_k_exchange(const EmuArgs a) {
    __shared__ int box[1024], hand[64];
    const int t = (int)threadIdx.x, n = (int)blockDim.x, b = (int)blockIdx.x;
    box[t] = t + 1000 * b;
    __syncthreads();
    int s = box[(t + 1) % n];
    for (int m = 16; m; m /= 2) s += __shfl_xor_sync(~0u, s, m);
    int got = 0;
    for (int r = 0; r < a.rounds; r++)
        if (t < 64) {
            if (r) kda_emu_bar(2, 128, true);
            hand[t] = 64 * r + t;
            kda_emu_bar(1, 128, false);
        } else if (t < 128) {
            kda_emu_bar(1, 128, true);
            got += hand[t - 64];
            kda_emu_bar(2, 128, false);
        }
    if (t < 64) kda_emu_bar(2, 128, true); // the last hand taken: every barrier ends the block balanced
    a.out[b * n + t] = s + got;
}
static void run_emu_barriers_and_shuffles_order_threads() {
    t_current = "emulator";
    const int n = 1024, blocks = 3, rounds = 50;
    std::vector<int> out((size_t)(n * blocks), -1);
    kda_emu_launch(emu_k_exchange, kda_emu_dim3{(unsigned)blocks, 1, 1}, (unsigned)n, EmuArgs{out.data(), rounds});
    int bad = 0;
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < n; t++) {
            long want = 0;
            for (int l = 0; l < 32; l++) want += (t / 32 * 32 + l + 1) % n + 1000 * b;
            if (t >= 64 && t < 128)
                for (int r = 0; r < rounds; r++) want += 64 * r + t - 64;
            bad += out[(size_t)(b * n + t)] != want;
        }
    CHECK(bad == 0, "%d of %d threads' values wrong", bad, n * blocks);
}
// make test-race's probe (--race-probe): warps 6-7 read what warps 2-3 wrote with only a
// barrier of warps 0-3 between, which ThreadSanitizer must report (exit 66) for its clean runs
// to mean anything: the fibers' switches must not order what the kernel leaves unordered
static void emu_k_unordered(const EmuArgs a) {
    __shared__ int box[64];
    const int t = (int)threadIdx.x;
    if (t >= 64 && t < 128) box[t - 64] = t;
    if (t < 128) kda_emu_bar(1, 128, true);
    if (t >= 192) a.out[t] = box[t - 192];
}
static int run_emu_race_probe() {
    std::vector<int> out(256, 0);
    kda_emu_launch(emu_k_unordered, kda_emu_dim3{1, 1, 1}, 256u, EmuArgs{out.data(), 0});
    printf("race probe ran unreported\n");
    return 0;
}
#if KDA_EMU_FIBERS && !defined(KDA_EMU_TSAN) // (ThreadSanitizer takes no fork of a process with threads: its fibers count)
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void emu_k_half_barrier(const EmuArgs) {
    if (threadIdx.x < 32) kda_emu_bar(3, 64, true); // (32 of the 64 threads it counts ever come)
}
// a barrier some threads never reach hangs a GPU; the emulator's fibers say so and abort
static void run_emu_reports_a_deadlock() {
    t_current = "emulator";
    int fd[2];
    CHECK(pipe(fd) == 0, "pipe");
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 2);
        kda_emu_launch(emu_k_half_barrier, kda_emu_dim3{1, 1, 1}, 128u, EmuArgs{nullptr, 0});
        _exit(0);
    }
    close(fd[1]);
    char msg[512] = "";
    size_t got = 0;
    for (ssize_t r; got + 1 < sizeof msg && (r = read(fd[0], msg + got, sizeof msg - 1 - got)) > 0;) got += (size_t)r;
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "the launch ended with status %d, not an abort", st);
    CHECK(strstr(msg, "deadlock: 128 threads wait"), "the report: %s", msg);
}
#endif
#endif

// --race (make test-race's run under ThreadSanitizer): one run of each path the fused kernels'
// warps take through memory and their shared buffers (key tile, value columns, pairs,
// varlen, element-wise fetch, the factor fallbacks), not every case of values, which make
// test runs (and make test-sanitize, under AddressSanitizer): every case under ThreadSanitizer
// took 14 of CI's minutes. A split, which runs segment 0 with output too.
struct PathRun { const char *config, *segments, *bv; };
static const PathRun path_runs[] = {
    {"fused_varlen_K128_V64_lowerbound_negeig_vk_f16", "3", "128"}, // 128-key tile, varlen
    {"fused_wide_gate_T50_K48_V24_bf16", "1", "64"},               // the per-pair fallback
    {"fused_strong_gate_T60_K128_V32_bf16", "2", "64"},            // factored through row 7
    {"fused_strong_gate_T60_K48_V32_bf16", "3", "128"},            // (64-key tile)
    {"fused_B2_T63_K60_V36_bf16g_unaligned_rows", "2", "64"},      // 64-key tile, element-wise fetch and store
    {"fused_B2_T80_K128_V144_two_column_blocks_bf16", "3", "128"}, // pairs
    {"fused_varlen_K64_V256_two_column_blocks_f16", "3", "128"},   // pairs, varlen
    {"fused_B1_T45_K128_V128_l2norm_f16", "3", "128"},             // the row norms by mma
};
// each path run on its config, which must still exist (a renamed config must not drop out unseen)
static void run_fused_paths() {
    for (const PathRun &r : path_runs) {
        Cfg cf;
        t_current = "fused";
        const bool found = fused_config(r.config, &cf);
        CHECK(found, "path run %s names a fused config", r.config);
        if (found) run_fused(cf, r.segments, fused_gate(cf), r.bv);
    }
}

int main(int argc, char **argv) {
    // race: make test-race's run (ThreadSanitizer makes each barrier slow): the fused forward's
    // kernel paths once each (path_runs)
    bool quick = false, race = false;
    for (int i = 1; i < argc; i++) {
#ifdef KDA_TEST_EMU
        if (!strcmp(argv[i], "--race-probe")) return run_emu_race_probe();
#endif
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--race")) race = true;
        else g_only.push_back(argv[i]);
    }
    g_dev = dev_ctx();
#ifdef KDA_TEST_EMU
    if (want("emulator")) {
        run_emu_barriers_and_shuffles_order_threads();
#if KDA_EMU_FIBERS && !defined(KDA_EMU_TSAN)
        run_emu_reports_a_deadlock();
#endif
    }
#endif
    if (want("selftest_mma")) run_mma();
    for (const Cfg &cf : configs(quick)) {
        printf("problem %s\n", cf.name);
        fflush(stdout);
        run_config(cf);
        if (want("ops")) run_ops(cf);
    }
    if (want("fused")) {
        const bool every = !quick && !race;
        run_fused_plan_model();
        if (race) run_fused_paths();
        else
            for (const Cfg &cf : fused_configs()) {
                const FusedGate gate = fused_gate(cf);
                run_fused(cf, "1", gate, "64"), run_fused(cf, "1", gate, "128");
                if (gate != GATE_WIDE) run_fused(cf, "2", gate, "64"), run_fused(cf, "3", gate, "128"); // varlen: sequences of 1, 2 and 3 segments, an empty one
            }
        if (!race) run_fused_keeps_nan();
        if (!race) { // the pool form: fixed lengths (bounded split where segments > 1), varlen with an empty sequence (vk)
            std::vector<Cfg> fc = fused_configs();
            fc[0].p.B = 3; // (B3: two named slots around the padding)
            run_chunk_fwd_pool_form(fc[0], "1", "64");
            run_chunk_fwd_pool_form(fc[0], "3", "128");
            if (every) run_chunk_fwd_pool_form(fc[1], "1", "128"), run_chunk_fwd_pool_form(fc[1], "3", "64");
        }
        if (every) run_fused_exact_split_with_a_lead(); // (clusters of two 512-thread blocks, slow under the sanitizers)
        // the bounded split: 64 columns, fixed lengths (K = 100: fetched element by element) and varlen
        if (!race) run_fused_bounded_split(100, LATE_NONE, false);
        run_fused_bounded_split(64, LATE_GATE, true);
        run_fused_bounded_split(64, LATE_BETA, false); // --race too: its b check reads the warm-up length a group's warps share (53c4c1e's race)
        // 128 columns, the bounded kernels the benchmark's split shapes run (the others take 64;
        // under ThreadSanitizer these two take 227 of --race's 431 s)
        run_fused_bounded_split(100, LATE_NONE, false, "128");
        // two 128-column blocks (on Hopper a pair: each block flags the chunks its own groups built)
        run_fused_bounded_split(64, LATE_GATE, true, "128", 144);
        if (!race) {
            run_fused_bounded_split(64, LATE_NONE, false);
            run_fused_bounded_split(64, LATE_GATE, false);
            run_fused_bounded_split(64, LATE_GATE, true, "128");
            run_fused_bounded_split(64, LATE_GATE, true, "64", 32, true); // no warm-up fails: the sequence of one piece in the bounded pass
            run_fused_bounded_split(100, LATE_NONE, false, "128", 144);
            run_fused_column_plan_end_to_end(false);
        }
        if (!race) run_fused_column_plan_end_to_end(true);
        run_fused_fixup_matches_the_output_pass(race);
#ifdef KDA_TEST_EMU
        if (!race) run_fused_replans_for_new_lengths();
        if (!race) run_fused_runs_its_own_split_in_the_queried_workspace();
        // (clusters of two 512-thread blocks, slow under the sanitizers: make test runs it)
        if (every) run_fused_failed_bounds_redone_in_the_exact_tile();
        if (!race) run_fused_bound_flags_match_the_warmup_sums(); // (values: the bounded splits above run both kernels)
        if (!race) { // (plans and declines, not races)
            run_fused_declines_without_shared_memory(fused_configs()[0]);
            run_fused_takes_the_tile_that_fits(fused_configs()[1]); // K = 128
            run_fused_splits_as_far_as_the_workspace_holds(fused_configs()[2]);
        }
#endif
    }
#ifdef KDA_TEST_EMU
    if (want("fused") || want("plan")) { // the fused forward's plans, host only
        run_fused_exact_plan_times_every_candidate();
        run_fused_exact_split_leads_with_a_longer_first_piece();
        run_fused_column_plan_pairs_long_pieces_with_short();
        run_fused_exact_passes_pick_their_own_tile();
        run_fused_workspace_query_is_the_plans_need();
    }
#endif
    kda_context_destroy(g_dev);
#ifdef KDA_TEST_EMU
    printf("%d kernel launches emulated\n", emu_launches);
#endif
    return t_report();
}
