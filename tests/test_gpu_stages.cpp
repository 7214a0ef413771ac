// tests/test_gpu_stages.cpp - every GPU kernel against its CPU twin, without a
// GPU: the generated kernels run on tests/cuda_emu.h through kda.h's own device
// backend code (kernel choice, launch geometry, kernel arguments, sequence
// tables, workspace), with a device table whose memory is host memory.
//
//   build/test_gpu_stages [--quick] [stage ...]    (stages: prepare intra ... recurrent ops)
//
// For each problem and stage: the CPU runs the stages up to this one; the device
// starts from a copy of the CPU's work buffer taken just before the stage, with
// the stage's outputs poisoned (NaN), runs the stage, and every output must match
// the CPU's. Then the whole operations (kda_chunk_fwd/bwd, kda_recurrent_fwd in
// both forms) run on the emulated device and are compared with the CPU's.
#include <stddef.h>
#include <string>
#include <vector>

#define KDA_IMPLEMENTATION
#include "../kda.h"
#include "testlib.h"

#include "cuda_emu.h"
#include "../build/emu/kernels_emu.inc"

static_assert(sizeof(KdaParams) == sizeof(kda__kparams), "KdaParams and kda__kparams differ");
static_assert(offsetof(KdaParams, scale) == offsetof(kda__kparams, scale), "KdaParams layout");
static_assert(offsetof(KdaParams, Gc) == offsetof(kda__kparams, Gc), "KdaParams layout");
static_assert(offsetof(KdaParams, dw) == offsetof(kda__kparams, dw), "KdaParams layout");
static_assert(offsetof(KdaParams, num_slots) == offsetof(kda__kparams, num_slots), "KdaParams layout");

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
static int emu_launches;
static kda_status emu_launch(kda_context *ctx, const kda__kdesc *k, const unsigned grid[3], const kda__kparams *a) {
    for (const kda_emu_kernel &e : kda_emu_kernels)
        if (!strcmp(e.name, k->name)) {
            kda_emu_dim3 g;
            g.x = grid[0]; g.y = grid[1]; g.z = grid[2];
            KdaParams prm;
            memcpy(&prm, a, sizeof prm);
            kda_emu_launch(e.fn, g, (unsigned)k->threads, prm);
            emu_launches++;
            return KDA_OK;
        }
    return kda__fail(ctx, KDA_ERROR_INTERNAL, "emulator: no kernel %s", k->name);
}
static kda_status emu_sync(kda_context *) { return KDA_OK; }
static void emu_destroy(kda_context *) {}
static const kda__devops emu_ops = {"emulator", emu_alloc, emu_release, emu_copy, emu_fill, emu_launch, emu_sync, emu_destroy};

static kda_context *emu_ctx() {
    kda_context *ctx = NULL;
    if (kda__context_create_dev(&ctx, KDA_BACKEND_CUDA, &emu_ops, NULL, NULL) != KDA_OK) exit(2);
    return ctx;
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
static void poison(void *p, size_t bytes) { if (p) memset(p, 0xff, bytes); }

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

static void run_config(const Cfg &cf) {
    kda_context *cpu = t_cpu(), *dev = emu_ctx();
    t_inst I;
    t_inst_init(&I, &cf.p, cf.cu.empty() ? NULL : cf.cu.data(), cf.has_h0, cf.has_dht);
    const kda_problem &p = I.p;
    Data D;
    D.q = conv(I.q, I.nq, p.dtype); D.k = conv(I.k, I.nq, p.dtype); D.v = conv(I.v, I.nv, p.dtype);
    D.g = conv(I.g, I.ng, p.g_dtype); D.beta = conv(I.beta, I.nb, p.beta_dtype); D.dout = conv(I.dout, I.nv, p.dtype);
    kda_inputs in = t_inputs(&I);
    in.q = D.q.data(); in.k = D.k.data(); in.v = D.v.data(); in.g = D.g.data(); in.beta = D.beta.data();
    const size_t wsz = kda_work_layout(&p, KDA_WORK_FWD | KDA_WORK_BWD, NULL, NULL);
    unsigned char *wc_buf = (unsigned char *)aligned_alloc(256, (wsz + 255) & ~(size_t)255);
    unsigned char *wb_buf = (unsigned char *)aligned_alloc(256, (wsz + 255) & ~(size_t)255);
    unsigned char *wd_buf = (unsigned char *)aligned_alloc(256, (wsz + 255) & ~(size_t)255);
    memset(wc_buf, 0, wsz);
    kda_work wc, wd;
    kda_work_layout(&p, KDA_WORK_FWD | KDA_WORK_BWD, wc_buf, &wc);
    kda_work_layout(&p, KDA_WORK_FWD | KDA_WORK_BWD, wd_buf, &wd);
    const size_t es = kda_dtype_size(p.dtype);
    const size_t nst = I.ns;
    // external outputs, CPU and device copies
    std::vector<unsigned char> o_c(I.nv * es), o_d(I.nv * es), dv_c(I.nv * es), dv_d(I.nv * es);
    std::vector<unsigned char> dq_c(I.nq * es), dq_d(I.nq * es), dk_c(I.nq * es), dk_d(I.nq * es);
    std::vector<unsigned char> dg_c(I.ng * kda_dtype_size(p.g_dtype)), dg_d(dg_c.size());
    std::vector<unsigned char> db_c(I.nb * kda_dtype_size(p.beta_dtype)), db_d(db_c.size());
    std::vector<float> ht_c(nst + 1), ht_d(nst + 1), dh0_c(nst + 1), dh0_d(nst + 1);
    std::vector<float> dA_c(p.HV), dA_d(p.HV), ddt_c((size_t)p.HV * p.K), ddt_d(ddt_c.size());
    float *dA_cp = I.A_log ? dA_c.data() : NULL, *dA_dp = I.A_log ? dA_d.data() : NULL;
    float *ddt_cp = I.dt_bias ? ddt_c.data() : NULL, *ddt_dp = I.dt_bias ? ddt_d.data() : NULL;
    const size_t rows = (size_t)p.B * p.T, VK = rows * p.HV * p.K, VV = rows * p.HV * p.V;
    /* states: only the NT chunks that exist are written (the buffer holds an upper bound) */
    const size_t VB = rows * p.HV * p.chunk_size, HK = rows * p.H * p.K;
    const size_t S = (size_t)kda_num_chunks(&p, p.num_seqs ? (const void *)(p.seqlens_type == KDA_INDEX_I64 ? (const void *)I.cu : (const void *)I.cu32) : NULL) * p.HV * p.K * p.V;
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
        kda_status sc = KDA_OK, sd = KDA_OK;
        auto run = [&](kda_context *ctx, kda_work *w, bool is_dev) -> kda_status {
            void *o = is_dev ? (void *)o_d.data() : (void *)o_c.data();
            float *ht = is_dev ? ht_d.data() : ht_c.data(), *dh0 = is_dev ? dh0_d.data() : dh0_c.data();
            switch (si) {
            case 0: return kda_stage_prepare(ctx, &p, &in, w);
            case 1: return kda_stage_gate_cumsum(ctx, &p, &in, w);
            case 2: return kda_stage_intra(ctx, &p, &in, w);
            case 3: return kda_stage_solve(ctx, &p, &in, w);
            case 4: return kda_stage_wu(ctx, &p, &in, w);
            case 5: return kda_stage_state(ctx, &p, &in, w, ht);
            case 6: return kda_stage_output(ctx, &p, &in, w, o);
            case 7: return kda_stage_bwd_dAv(ctx, &p, &in, w, D.dout.data());
            case 8: return kda_stage_bwd_dhu(ctx, &p, &in, w, D.dout.data(), I.dht, cf.has_h0 ? dh0 : NULL);
            case 9: return kda_stage_bwd_wy(ctx, &p, &in, w, D.dout.data(), is_dev ? dv_d.data() : dv_c.data());
            case 10: return kda_stage_bwd_intra(ctx, &p, &in, w);
            case 11: return kda_stage_bwd_cumsum(ctx, &p, &in, w);
            case 12: return kda_stage_bwd_gate(ctx, &p, &in, w, is_dev ? dg_d.data() : dg_c.data(),
                                               is_dev ? dA_dp : dA_cp, is_dev ? ddt_dp : ddt_cp);
            default: return kda_stage_bwd_qkb(ctx, &p, &in, w, is_dev ? dq_d.data() : dq_c.data(),
                                              is_dev ? dk_d.data() : dk_c.data(), is_dev ? db_d.data() : db_c.data());
            }
        };
        sc = run(cpu, &wc, false);
        CHECK(sc == KDA_OK, "%s: CPU stage %s failed: %s", cf.name, st.name, kda_last_error(cpu));
        if (!want(st.name)) continue;
        t_current = st.name;
        memcpy(wd_buf, wb_buf, wsz);
        unsigned char *dbase = (unsigned char *)wd.qn;
        if (!accumulates[si])
            for (const Field &f : st.out) poison(dbase + f.off, f.count * (f.dbl ? 8 : 4));
        poison(o_d.data(), o_d.size()); poison(ht_d.data(), nst * 4); poison(dh0_d.data(), nst * 4);
        poison(dv_d.data(), dv_d.size()); poison(dg_d.data(), dg_d.size()); poison(dq_d.data(), dq_d.size());
        poison(dk_d.data(), dk_d.size()); poison(db_d.data(), db_d.size()); poison(dA_d.data(), dA_d.size() * 4);
        poison(ddt_d.data(), ddt_d.size() * 4);
        sd = run(dev, &wd, true);
        CHECK(sd == KDA_OK, "%s: device stage %s failed: %s", cf.name, st.name, kda_last_error(dev));
        if (sd != KDA_OK) continue;
        for (const Field &f : st.out) {
            double e = f.dbl ? err_d((const double *)(base + f.off), (const double *)(dbase + f.off), f.count)
                             : err_f((const float *)(base + f.off), (const float *)(dbase + f.off), f.count);
            /* G is a double cumsum on both sides; everything else is fp32 arithmetic */
            double tol = strcmp(f.name, "G") == 0 ? 1e-12 : 1e-5;
            CHECK(e <= tol, "%s: %s.%s error ratio %.3g > %.3g", cf.name, st.name, f.name, e, tol);
        }
        const double tx = p.dtype == KDA_F32 ? 1e-5 : 1e-2; // external outputs are rounded to the dtype
        switch (si) {
        case 5: CHECK(err_f(ht_c.data(), ht_d.data(), nst) <= 1e-5, "%s: state.ht", cf.name); break;
        case 6: CHECK(err_t(o_c.data(), o_d.data(), I.nv, p.dtype) <= tx, "%s: output.o", cf.name); break;
        case 8: if (cf.has_h0) CHECK(err_f(dh0_c.data(), dh0_d.data(), nst) <= 1e-5, "%s: bwd_dhu.dh0", cf.name); break;
        case 9: CHECK(err_t(dv_c.data(), dv_d.data(), I.nv, p.dtype) <= tx, "%s: bwd_wy.dv", cf.name); break;
        case 12:
            CHECK(err_t(dg_c.data(), dg_d.data(), I.ng, p.g_dtype) <= (p.g_dtype == KDA_F32 ? 1e-5 : 1e-2), "%s: bwd_gate.dg", cf.name);
            if (dA_cp) CHECK(err_f(dA_c.data(), dA_d.data(), p.HV) <= 1e-5, "%s: bwd_gate.dA_log", cf.name);
            if (ddt_cp) CHECK(err_f(ddt_c.data(), ddt_d.data(), ddt_c.size()) <= 1e-5, "%s: bwd_gate.ddt_bias", cf.name);
            break;
        case 13:
            CHECK(err_t(dq_c.data(), dq_d.data(), I.nq, p.dtype) <= tx, "%s: bwd_qkb.dq", cf.name);
            CHECK(err_t(dk_c.data(), dk_d.data(), I.nq, p.dtype) <= tx, "%s: bwd_qkb.dk", cf.name);
            CHECK(err_t(db_c.data(), db_d.data(), I.nb, p.beta_dtype) <= (p.beta_dtype == KDA_F32 ? 1e-5 : 1e-2),
                  "%s: bwd_qkb.dbeta", cf.name);
            break;
        }
    }
    free(wc_buf); free(wb_buf); free(wd_buf);
    t_inst_free(&I);
    kda_context_destroy(cpu);
    kda_context_destroy(dev);
}

// ---- whole operations on the emulated device against the CPU ----
static void run_ops(const Cfg &cf) {
    kda_context *cpu = t_cpu(), *dev = emu_ctx();
    t_inst I;
    t_current = "ops";
    t_inst_init(&I, &cf.p, cf.cu.empty() ? NULL : cf.cu.data(), cf.has_h0, cf.has_dht);
    const kda_problem &p = I.p;
    const size_t es = kda_dtype_size(p.dtype), nst = I.ns;
    Data D;
    D.q = conv(I.q, I.nq, p.dtype); D.k = conv(I.k, I.nq, p.dtype); D.v = conv(I.v, I.nv, p.dtype);
    D.g = conv(I.g, I.ng, p.g_dtype); D.beta = conv(I.beta, I.nb, p.beta_dtype); D.dout = conv(I.dout, I.nv, p.dtype);
    kda_inputs in = t_inputs(&I);
    in.q = D.q.data(); in.k = D.k.data(); in.v = D.v.data(); in.g = D.g.data(); in.beta = D.beta.data();
    const long long NT = kda_num_chunks(&p, in.cu_seqlens);
    const double tx = p.dtype == KDA_F32 ? 1e-5 : 1e-2;
    struct Out {
        std::vector<unsigned char> o, dq, dk, dv, dg, db, saved;
        std::vector<float> ht, h, dh0, dA, ddt;
    } R[2];
    for (int side = 0; side < 2; side++) {
        Out &r = R[side];
        kda_context *ctx = side ? dev : cpu;
        r.o.assign(I.nv * es, 0xff); r.ht.assign(nst + 1, NAN); r.h.assign((size_t)NT * p.HV * p.K * p.V + 1, NAN);
        r.saved.assign(kda_fwd_saved_size(&p), 0xff);
        kda_fwd_outputs out;
        memset(&out, 0, sizeof out);
        out.o = r.o.data(); out.ht = r.ht.data(); out.h = r.h.data(); out.saved = r.saved.data();
        CHECK(kda_chunk_fwd(ctx, &p, &in, &out) == KDA_OK, "%s: fwd on %s: %s", cf.name, side ? "device" : "cpu", kda_last_error(ctx));
        for (int saved = 0; saved < 2; saved++) {
            r.dq.assign(I.nq * es, 0xff); r.dk.assign(I.nq * es, 0xff); r.dv.assign(I.nv * es, 0xff);
            r.dg.assign(I.ng * kda_dtype_size(p.g_dtype), 0xff); r.db.assign(I.nb * kda_dtype_size(p.beta_dtype), 0xff);
            r.dh0.assign(nst + 1, NAN); r.dA.assign(p.HV, NAN); r.ddt.assign((size_t)p.HV * p.K, NAN);
            kda_bwd_io io;
            memset(&io, 0, sizeof io);
            io.dout = D.dout.data(); io.dht = I.dht; io.saved = saved ? r.saved.data() : NULL;
            io.dq = r.dq.data(); io.dk = r.dk.data(); io.dv = r.dv.data(); io.dg = r.dg.data(); io.dbeta = r.db.data();
            io.dh0 = r.dh0.data(); io.dA_log = I.A_log ? r.dA.data() : NULL; io.ddt_bias = I.dt_bias ? r.ddt.data() : NULL;
            CHECK(kda_chunk_bwd(ctx, &p, &in, &io) == KDA_OK, "%s: bwd on %s: %s", cf.name, side ? "device" : "cpu", kda_last_error(ctx));
            if (side == 1) {
                const char *how = saved ? "saved" : "recompute";
                Out &c = R[0];
                CHECK(err_t(c.dq.data(), r.dq.data(), I.nq, p.dtype) <= tx, "%s: dq (%s)", cf.name, how);
                CHECK(err_t(c.dk.data(), r.dk.data(), I.nq, p.dtype) <= tx, "%s: dk (%s)", cf.name, how);
                CHECK(err_t(c.dv.data(), r.dv.data(), I.nv, p.dtype) <= tx, "%s: dv (%s)", cf.name, how);
                CHECK(err_t(c.dg.data(), r.dg.data(), I.ng, p.g_dtype) <= (p.g_dtype ? 1e-2 : 1e-5), "%s: dg (%s)", cf.name, how);
                CHECK(err_t(c.db.data(), r.db.data(), I.nb, p.beta_dtype) <= (p.beta_dtype ? 1e-2 : 1e-5), "%s: dbeta (%s)", cf.name, how);
                CHECK(err_f(c.dh0.data(), r.dh0.data(), nst) <= 1e-5, "%s: dh0 (%s)", cf.name, how);
                if (I.A_log) CHECK(err_f(c.dA.data(), r.dA.data(), p.HV) <= 1e-5, "%s: dA_log (%s)", cf.name, how);
                if (I.dt_bias) CHECK(err_f(c.ddt.data(), r.ddt.data(), r.ddt.size()) <= 1e-5, "%s: ddt_bias (%s)", cf.name, how);
            } else if (saved == 0) {
                R[0].dq.swap(R[0].dq); /* keep the CPU's recompute result for both comparisons */
            }
        }
    }
    CHECK(err_t(R[0].o.data(), R[1].o.data(), I.nv, p.dtype) <= tx, "%s: o", cf.name);
    CHECK(err_f(R[0].ht.data(), R[1].ht.data(), nst) <= 1e-5, "%s: ht", cf.name);
    CHECK(err_f(R[0].h.data(), R[1].h.data(), (size_t)NT * p.HV * p.K * p.V) <= 1e-5, "%s: intermediate states", cf.name);
    /* recurrence, plain form, then the pool form with padding and untouched slots */
    std::vector<unsigned char> ro[2];
    std::vector<float> rht[2];
    for (int side = 0; side < 2; side++) {
        kda_context *ctx = side ? dev : cpu;
        kda_recurrent_io io;
        ro[side].assign(I.nv * es, 0xff);
        rht[side].assign(nst + 1, NAN);
        memset(&io, 0, sizeof io);
        io.o = ro[side].data(); io.ht = rht[side].data();
        CHECK(kda_recurrent_fwd(ctx, &p, &in, &io) == KDA_OK, "%s: recurrent on %s: %s", cf.name, side ? "device" : "cpu", kda_last_error(ctx));
    }
    CHECK(err_t(ro[0].data(), ro[1].data(), I.nv, p.dtype) <= tx, "%s: recurrent o", cf.name);
    CHECK(err_f(rht[0].data(), rht[1].data(), nst) <= 1e-5, "%s: recurrent ht", cf.name);
    {
        const int N = kda_num_seqs(&p), nslots = 2 * N + 2;
        const size_t sl = (size_t)p.HV * p.K * p.V;
        std::vector<int32_t> slots(N);
        for (int n = 0; n < N; n++) slots[n] = n == 1 ? -1 : 2 * n + 1; /* sequence 1 is padding */
        std::vector<float> pool[2];
        for (int side = 0; side < 2; side++) {
            kda_context *ctx = side ? dev : cpu;
            pool[side].assign(nslots * sl, 1e30f);
            for (int n = 0; n < N; n++)
                if (slots[n] >= 0 && I.h0) memcpy(&pool[side][slots[n] * sl], I.h0 + n * sl, sl * 4);
            ro[side].assign(I.nv * es, 0x7f);
            kda_inputs pin = in;
            pin.h0 = NULL;
            kda_recurrent_io io;
            memset(&io, 0, sizeof io);
            io.o = ro[side].data(); io.state_pool = pool[side].data(); io.slots = slots.data(); io.num_slots = nslots;
            CHECK(kda_recurrent_fwd(ctx, &p, &pin, &io) == KDA_OK, "%s: pool on %s: %s", cf.name, side ? "device" : "cpu", kda_last_error(ctx));
        }
        CHECK(err_t(ro[0].data(), ro[1].data(), I.nv, p.dtype) <= tx, "%s: pool o", cf.name);
        CHECK(err_f(pool[0].data(), pool[1].data(), pool[0].size()) <= 1e-5, "%s: pool states", cf.name);
        size_t changed = 0;
        for (int s = 0; s < nslots; s++) {
            bool named = false;
            for (int n = 0; n < N; n++) named |= slots[n] == s;
            if (!named)
                for (size_t i = 0; i < sl; i++) changed += pool[1][s * sl + i] != 1e30f;
        }
        CHECK(changed == 0, "%s: %zu values changed in slots no sequence names", cf.name, changed);
    }
    t_inst_free(&I);
    kda_context_destroy(cpu);
    kda_context_destroy(dev);
}

int main(int argc, char **argv) {
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else g_only.push_back(argv[i]);
    }
    for (const Cfg &cf : configs(quick)) {
        printf("problem %s\n", cf.name);
        fflush(stdout);
        run_config(cf);
        if (want("ops")) run_ops(cf);
    }
    printf("%d kernel launches emulated\n", emu_launches);
    return t_report();
}
