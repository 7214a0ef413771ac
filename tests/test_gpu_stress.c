/* tests/test_gpu_stress.c - numerical stress on the GPU: extreme gates and inputs
 * must give no NaN or Inf, and stay close to the CPU path on the same inputs.
 *   1. 10% of g at -1000 (total forgetting), precomputed decay; then at -inf and -1e30
 *   2. the bounded gate at lower_bound -5 over T = 65536
 *   3. gates near 0 (g = -1e-6) over T = 65536: almost no forgetting
 *   4. large unnormalised q and k (x100, no l2norm)
 * Forward (o, ht) and backward (every gradient), fp32 data. Exit 3 without a GPU. */
#define KDA_IMPLEMENTATION
#include "../kda.h"
#include "testlib.h"

static kda_context *gpu;

static void *up(const void *h, size_t bytes) {
    void *d = NULL;
    if (!h) return NULL;
    kda_malloc(gpu, bytes, &d);
    kda_memcpy(gpu, d, h, bytes, KDA_COPY_H2D);
    return d;
}
static void *dbuf(size_t bytes) {
    void *d = NULL;
    kda_malloc(gpu, bytes, &d);
    kda_memset(gpu, d, 0xff, bytes);
    return d;
}
static int finite(const float *x, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

static void stress(const char *name, t_inst *I, double tol) {
    kda_context *cpu = t_cpu();
    const kda_problem *p = &I->p;
    kda_inputs in = t_inputs(I), din = in;
    kda_fwd_outputs out;
    kda_bwd_io io;
    t_grads G, GD;
    float *o = t_alloc(I->nv), *ht = t_alloc(I->ns), *od = t_alloc(I->nv), *htd = t_alloc(I->ns);
    void *d_o, *d_ht, *d_dq, *d_dk, *d_dv, *d_dg, *d_db, *d_dh0, *d_dA, *d_ddt;
    t_current = name;
    printf("%s: B%d T%d H%d K%d V%d\n", name, p->B, p->T, p->H, p->K, p->V);
    fflush(stdout);
    din.q = up(I->q, I->nq * 4); din.k = up(I->k, I->nq * 4); din.v = up(I->v, I->nv * 4);
    din.g = up(I->g, I->ng * 4); din.beta = up(I->beta, I->nb * 4); din.h0 = (const float *)up(I->h0, I->ns * 4);
    din.A_log = (const float *)up(I->A_log, sizeof(float) * p->HV);
    din.dt_bias = (const float *)up(I->dt_bias, sizeof(float) * p->HV * p->K);
    t_grads_alloc(&G, I);
    t_grads_alloc(&GD, I);
    /* CPU */
    memset(&out, 0, sizeof out);
    out.o = o; out.ht = ht;
    CHECK(kda_chunk_fwd(cpu, p, &in, &out) == KDA_OK, "cpu fwd: %s", kda_last_error(cpu));
    CHECK(t_bwd(cpu, I, &G) == KDA_OK, "cpu bwd");
    /* GPU */
    d_o = dbuf(I->nv * 4); d_ht = dbuf(I->ns * 4);
    memset(&out, 0, sizeof out);
    out.o = d_o; out.ht = (float *)d_ht;
    CHECK(kda_chunk_fwd(gpu, p, &din, &out) == KDA_OK, "gpu fwd: %s", kda_last_error(gpu));
    d_dq = dbuf(I->nq * 4); d_dk = dbuf(I->nq * 4); d_dv = dbuf(I->nv * 4); d_dg = dbuf(I->ng * 4);
    d_db = dbuf(I->nb * 4); d_dh0 = dbuf(I->ns * 4); d_dA = dbuf(sizeof(float) * p->HV);
    d_ddt = dbuf(sizeof(float) * p->HV * p->K);
    memset(&io, 0, sizeof io);
    io.dout = up(I->dout, I->nv * 4); io.dht = (const float *)up(I->dht, I->ns * 4);
    io.dq = d_dq; io.dk = d_dk; io.dv = d_dv; io.dg = d_dg; io.dbeta = d_db; io.dh0 = (float *)d_dh0;
    io.dA_log = I->A_log ? (float *)d_dA : NULL; io.ddt_bias = I->dt_bias ? (float *)d_ddt : NULL;
    CHECK(kda_chunk_bwd(gpu, p, &din, &io) == KDA_OK, "gpu bwd: %s", kda_last_error(gpu));
    CHECK(kda_synchronize(gpu) == KDA_OK, "gpu: %s", kda_last_error(gpu));
    kda_memcpy(gpu, od, d_o, I->nv * 4, KDA_COPY_D2H); kda_memcpy(gpu, htd, d_ht, I->ns * 4, KDA_COPY_D2H);
    kda_memcpy(gpu, GD.dq, d_dq, I->nq * 4, KDA_COPY_D2H); kda_memcpy(gpu, GD.dk, d_dk, I->nq * 4, KDA_COPY_D2H);
    kda_memcpy(gpu, GD.dv, d_dv, I->nv * 4, KDA_COPY_D2H); kda_memcpy(gpu, GD.dg, d_dg, I->ng * 4, KDA_COPY_D2H);
    kda_memcpy(gpu, GD.dbeta, d_db, I->nb * 4, KDA_COPY_D2H); kda_memcpy(gpu, GD.dh0, d_dh0, I->ns * 4, KDA_COPY_D2H);
    if (I->A_log) kda_memcpy(gpu, GD.dA_log, d_dA, sizeof(float) * p->HV, KDA_COPY_D2H);
    if (I->dt_bias) kda_memcpy(gpu, GD.ddt_bias, d_ddt, sizeof(float) * p->HV * p->K, KDA_COPY_D2H);
#define T_CMP(nm, a, b, n)                                                                  \
    do {                                                                                    \
        CHECK(finite(b, n), "%s: %s has NaN or Inf on the GPU", name, nm);                  \
        CHECK(finite(a, n), "%s: %s has NaN or Inf on the CPU", name, nm);                  \
        double e_ = t_err(a, b, n);                                                         \
        printf("  %-9s gpu vs cpu error ratio %.2e\n", nm, e_);                             \
        CHECK(e_ <= tol, "%s: %s error ratio %.3g > %.3g", name, nm, e_, tol);              \
    } while (0)
    T_CMP("o", o, od, I->nv);
    T_CMP("ht", ht, htd, I->ns);
    T_CMP("dq", G.dq, GD.dq, I->nq);
    T_CMP("dk", G.dk, GD.dk, I->nq);
    T_CMP("dv", G.dv, GD.dv, I->nv);
    T_CMP("dg", G.dg, GD.dg, I->ng);
    T_CMP("dbeta", G.dbeta, GD.dbeta, I->nb);
    T_CMP("dh0", G.dh0, GD.dh0, I->ns);
    if (I->A_log) T_CMP("dA_log", G.dA_log, GD.dA_log, (size_t)p->HV);
    if (I->dt_bias) T_CMP("ddt_bias", G.ddt_bias, GD.ddt_bias, (size_t)p->HV * p->K);
#undef T_CMP
    kda_free(gpu, (void *)din.q); kda_free(gpu, (void *)din.k); kda_free(gpu, (void *)din.v); kda_free(gpu, (void *)din.g);
    kda_free(gpu, (void *)din.beta); kda_free(gpu, (void *)din.h0); kda_free(gpu, (void *)din.A_log);
    kda_free(gpu, (void *)din.dt_bias); kda_free(gpu, (void *)io.dout); kda_free(gpu, (void *)io.dht);
    kda_free(gpu, d_o); kda_free(gpu, d_ht); kda_free(gpu, d_dq); kda_free(gpu, d_dk); kda_free(gpu, d_dv);
    kda_free(gpu, d_dg); kda_free(gpu, d_db); kda_free(gpu, d_dh0); kda_free(gpu, d_dA); kda_free(gpu, d_ddt);
    free(o); free(ht); free(od); free(htd);
    t_grads_free(&G); t_grads_free(&GD);
    kda_context_destroy(cpu);
}

int main(void) {
    kda_problem p;
    t_inst I;
    size_t i;
    if (kda_context_create(&gpu, KDA_BACKEND_CUDA, NULL) != KDA_OK) {
        printf("no GPU: %s\n", gpu ? kda_last_error(gpu) : "out of memory");
        return 3;
    }
    /* 1. total forgetting on 10% of the decay entries */
    p = kda_problem_default(2, 4096, 2, 128, 128);
    t_inst_init(&I, &p, NULL, 1, 1);
    for (i = 0; i < I.ng; i++)
        if (t_unif() < 0.1) I.g[i] = -1000.0f;
    stress("g_minus_1000", &I, 1e-5);
    /* the same at -inf and -1e30 (floored to KDA_LOG_DECAY_MIN: -inf - -inf must not give NaN) */
    for (i = 0; i < I.ng; i++)
        if (I.g[i] == -1000.0f) I.g[i] = i % 2 ? -INFINITY : -1e30f;
    stress("g_minus_inf", &I, 1e-5);
    t_inst_free(&I);
    /* 2. the bounded gate at its limit, long sequence */
    p = kda_problem_default(1, 65536, 1, 64, 64);
    p.gate = KDA_GATE_LOWER_BOUND; p.lower_bound = -5.0f; p.beta_sigmoid = 1; p.qk_l2norm = 1;
    t_inst_init(&I, &p, NULL, 1, 1);
    stress("lower_bound_-5_T65536", &I, 1e-5);
    t_inst_free(&I);
    /* 3. almost no forgetting over a long sequence */
    p = kda_problem_default(1, 65536, 1, 64, 64);
    t_inst_init(&I, &p, NULL, 1, 1);
    for (i = 0; i < I.ng; i++) I.g[i] = -1e-6f;
    stress("gate_near_0_T65536", &I, 1e-5);
    t_inst_free(&I);
    /* 4. large unnormalised q and k */
    p = kda_problem_default(1, 2048, 2, 128, 128);
    t_inst_init(&I, &p, NULL, 1, 1);
    for (i = 0; i < I.nq; i++) { I.q[i] *= 100.0f; I.k[i] *= 100.0f; }
    for (i = 0; i < I.nb; i++) I.beta[i] *= 1e-4f; /* keep the delta rule stable: beta |k|^2 < 2 */
    stress("large_q_k", &I, 1e-4);
    t_inst_free(&I);
    kda_context_destroy(gpu);
    return t_report();
}
