/* tests/testlib.h - shared pieces of the CPU test programs: a check macro that
 * counts, a seeded RNG, and a random KDA problem instance with fp32 host data.
 * Include after kda.h (the implementation is compiled in each test program). */
#ifndef KDA_TESTS_TESTLIB_H
#define KDA_TESTS_TESTLIB_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kda.h"

static int t_pass, t_fail;
static const char *t_current = "";

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (cond) {                                                             \
            t_pass++;                                                           \
        } else {                                                                \
            t_fail++;                                                           \
            printf("FAIL [%s] %s:%d: ", t_current, __FILE__, __LINE__);          \
            printf(__VA_ARGS__);                                                \
            printf("\n");                                                       \
        }                                                                       \
    } while (0)

/* Checks an error ratio RMS(ref-x)/RMS(ref) against tol, naming the array. */
#define CHECK_CLOSE(name, err, tol) CHECK((err) <= (tol), "%s: error ratio %.3g > %.3g", name, (double)(err), (double)(tol))

static inline int t_report(void) {
    printf("%d passed, %d failed\n", t_pass, t_fail);
    return t_fail ? 1 : 0;
}

/* ---- RNG (xorshift64*, Box-Muller) ---- */
static unsigned long long t_rng = 0x9E3779B97F4A7C15ull;
static inline void t_seed(unsigned long long s) { t_rng = s * 2654435761ull + 0x9E3779B97F4A7C15ull; }
static inline double t_unif(void) {
    t_rng ^= t_rng >> 12; t_rng ^= t_rng << 25; t_rng ^= t_rng >> 27;
    return ((t_rng * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}
static inline double t_randn(void) {
    double u = t_unif(), v = t_unif();
    if (u < 1e-300) u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}
static inline float *t_alloc(size_t n) {
    float *p = (float *)calloc(n ? n : 1, sizeof(float));
    if (!p) { printf("out of memory\n"); exit(2); }
    return p;
}
static inline double t_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Error ratio RMS(a-b)/RMS(a); 0 when both are 0; inf on NaN. */
static inline double t_err(const float *ref, const float *x, size_t n) {
    double num = 0.0, den = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        double d = (double)ref[i] - (double)x[i];
        if (x[i] != x[i]) return INFINITY;
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    if (num == 0.0) return 0.0;
    return den > 0.0 ? sqrt(num / den) : INFINITY;
}
static inline double t_err_d(const double *ref, const float *x, size_t n) {
    double num = 0.0, den = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        double d = ref[i] - (double)x[i];
        if (x[i] != x[i]) return INFINITY;
        num += d * d;
        den += ref[i] * ref[i];
    }
    if (num == 0.0) return 0.0;
    return den > 0.0 ? sqrt(num / den) : INFINITY;
}

/* ---- a problem instance: fp32 host data for every input ---- */
typedef struct {
    kda_problem p;
    long long cu[33];
    int32_t cu32[33];
    float *q, *k, *v, *g, *beta, *A_log, *dt_bias, *h0, *dout, *dht;
    size_t nq, nv, ng, nb, ns; /* element counts: q/k, v/o, g, beta, states */
} t_inst;

static inline int t_nseq(const t_inst *I) { return kda_num_seqs(&I->p); }

/* Random inputs in FLA's test style: unit-norm q, k unless l2norm is done in the
 * op; g = logsigmoid(randn) when precomputed, raw randn when gated; beta a
 * probability or a logit. cu (with num_seqs entries + 1) is taken from `cu` when
 * p->num_seqs > 0. has_h0 / has_dht choose the optional states. */
static inline void t_inst_init(t_inst *I, const kda_problem *p, const long long *cu, int has_h0, int has_dht) {
    size_t i, rows;
    int d, n;
    memset(I, 0, sizeof *I);
    I->p = *p;
    rows = (size_t)p->B * p->T;
    if (p->num_seqs > 0)
        for (n = 0; n <= p->num_seqs; n++) { I->cu[n] = cu[n]; I->cu32[n] = (int32_t)cu[n]; }
    I->nq = rows * p->H * p->K; I->nv = rows * p->HV * p->V; I->ng = rows * p->HV * p->K; I->nb = rows * p->HV;
    I->ns = (size_t)kda_num_seqs(p) * p->HV * p->K * p->V;
    I->q = t_alloc(I->nq); I->k = t_alloc(I->nq); I->v = t_alloc(I->nv); I->g = t_alloc(I->ng);
    I->beta = t_alloc(I->nb); I->dout = t_alloc(I->nv);
    for (i = 0; i < I->nq; i++) { I->q[i] = (float)t_randn(); I->k[i] = (float)t_randn(); }
    if (!p->qk_l2norm)
        for (i = 0; i < rows * p->H; i++) {
            double sq = 0, sk = 0;
            for (d = 0; d < p->K; d++) { sq += (double)I->q[i * p->K + d] * I->q[i * p->K + d]; sk += (double)I->k[i * p->K + d] * I->k[i * p->K + d]; }
            for (d = 0; d < p->K; d++) { I->q[i * p->K + d] /= (float)sqrt(sq); I->k[i * p->K + d] /= (float)sqrt(sk); }
        }
    for (i = 0; i < I->nv; i++) { I->v[i] = (float)t_randn(); I->dout[i] = (float)t_randn(); }
    for (i = 0; i < I->ng; i++) {
        double x = t_randn();
        I->g[i] = p->gate == KDA_GATE_NONE ? (float)(-log1p(exp(-x))) : (float)x;
    }
    for (i = 0; i < I->nb; i++) {
        double x = t_randn();
        I->beta[i] = p->beta_sigmoid ? (float)x : (float)t_sigmoid(x);
    }
    if (p->gate != KDA_GATE_NONE) {
        I->A_log = t_alloc((size_t)p->HV);
        I->dt_bias = t_alloc((size_t)p->HV * p->K);
        for (d = 0; d < p->HV; d++) I->A_log[d] = (float)(0.5 * t_randn());
        for (i = 0; i < (size_t)p->HV * p->K; i++) I->dt_bias[i] = (float)(0.5 * t_randn());
    }
    if (has_h0) { I->h0 = t_alloc(I->ns); for (i = 0; i < I->ns; i++) I->h0[i] = (float)(0.5 * t_randn()); }
    if (has_dht) { I->dht = t_alloc(I->ns); for (i = 0; i < I->ns; i++) I->dht[i] = (float)t_randn(); }
}

static inline void t_inst_free(t_inst *I) {
    free(I->q); free(I->k); free(I->v); free(I->g); free(I->beta); free(I->A_log); free(I->dt_bias);
    free(I->h0); free(I->dout); free(I->dht);
    memset(I, 0, sizeof *I);
}

/* kda_inputs pointing at the instance's fp32 arrays (the problem must be all-f32). */
static inline kda_inputs t_inputs(const t_inst *I) {
    kda_inputs in;
    memset(&in, 0, sizeof in);
    in.q = I->q; in.k = I->k; in.v = I->v; in.g = I->g; in.beta = I->beta;
    in.A_log = I->A_log; in.dt_bias = I->dt_bias; in.h0 = I->h0;
    if (I->p.num_seqs > 0) in.cu_seqlens = I->p.seqlens_type == KDA_INDEX_I64 ? (const void *)I->cu : (const void *)I->cu32;
    return in;
}

/* Gradients of one backward call, fp32. */
typedef struct { float *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA_log, *ddt_bias; } t_grads;
static inline void t_grads_alloc(t_grads *G, const t_inst *I) {
    G->dq = t_alloc(I->nq); G->dk = t_alloc(I->nq); G->dv = t_alloc(I->nv); G->dg = t_alloc(I->ng);
    G->dbeta = t_alloc(I->nb); G->dh0 = t_alloc(I->ns);
    G->dA_log = I->A_log ? t_alloc((size_t)I->p.HV) : NULL;
    G->ddt_bias = I->dt_bias ? t_alloc((size_t)I->p.HV * I->p.K) : NULL;
}
static inline void t_grads_free(t_grads *G) {
    free(G->dq); free(G->dk); free(G->dv); free(G->dg); free(G->dbeta); free(G->dh0); free(G->dA_log); free(G->ddt_bias);
}

/* Forward (o, ht) and backward of the instance on ctx; returns the status. */
static inline kda_status t_fwd(kda_context *ctx, const t_inst *I, float *o, float *ht) {
    kda_inputs in = t_inputs(I);
    kda_fwd_outputs out;
    kda_status s;
    memset(&out, 0, sizeof out);
    out.o = o; out.ht = ht;
    s = kda_chunk_fwd(ctx, &I->p, &in, &out);
    if (s) printf("  kda_chunk_fwd: %s\n", kda_last_error(ctx));
    return s;
}
static inline kda_status t_bwd(kda_context *ctx, const t_inst *I, t_grads *G) {
    kda_inputs in = t_inputs(I);
    kda_bwd_io io;
    kda_status s;
    memset(&io, 0, sizeof io);
    io.dout = I->dout; io.dht = I->dht;
    io.dq = G->dq; io.dk = G->dk; io.dv = G->dv; io.dg = G->dg; io.dbeta = G->dbeta; io.dh0 = G->dh0;
    io.dA_log = G->dA_log; io.ddt_bias = G->ddt_bias;
    s = kda_chunk_bwd(ctx, &I->p, &in, &io);
    if (s) printf("  kda_chunk_bwd: %s\n", kda_last_error(ctx));
    return s;
}

static inline double *t_to_d(const float *x, size_t n) {
    double *y = (double *)malloc(sizeof(double) * (n ? n : 1));
    size_t i;
    if (!y) exit(2);
    for (i = 0; i < n; i++) y[i] = x ? x[i] : 0.0;
    return y;
}

/* The context tests run on: the CPU, or with KDA_TEST_GPU (tests/gpu_shim.h) the
 * GPU, where a program without one exits 3. */
static inline kda_context *t_cpu(void) {
    kda_context *ctx = NULL;
#ifdef KDA_TEST_GPU
    if (kda_context_create(&ctx, KDA_BACKEND_CUDA, NULL) != KDA_OK) {
        printf("no GPU: %s\n", ctx ? kda_last_error(ctx) : "out of memory");
        exit(3);
    }
#else
    if (kda_context_create(&ctx, KDA_BACKEND_CPU, NULL) != KDA_OK) {
        printf("cannot create a CPU context: %s\n", ctx ? kda_last_error(ctx) : "out of memory");
        exit(2);
    }
#endif
    return ctx;
}

#endif /* KDA_TESTS_TESTLIB_H */
