/* tests/test_stages.c - every stage of the chunked path (kda.h "Stages") against
 * its naive formula (spec KDA.md sections 2-4), one stage at a time.
 *
 * For each configuration the stages run in order on the CPU over a kda_work
 * carved with kda_work_layout and pre-filled with 0xff bytes (NaN in float and
 * double, so an entry a stage forgets to write cannot pass). Before checking a
 * stage, the stages before it run unchecked; the stage under test then runs and
 * what it wrote is compared with a float64 computation from its inputs *as found
 * in the work buffer*, written from the spec: full matrices, exact per-pair
 * exponents exp(G_i - G_j) in natural log (work.G is in log2 units), no 16-row
 * sub-chunk blocking. Shapes are small and odd on purpose: varlen with an empty
 * sequence, partial chunks, K = 7 (scalar tails) and K = 20 (vector + tail),
 * H = 1 with HV = 2 (GVA).
 *
 * Build: gcc -std=c11 -O2 -Wall -Wextra -Werror -o /tmp/test_stages tests/test_stages.c -lm -lpthread
 */
#define KDA_IMPLEMENTATION
#include "../kda.h"
#include "testlib.h"

#define LN2 0.69314718055994530942
/* fp32 stage vs float64 formula. Every stage accumulates at most a few hundred
 * fp32 products of O(1) numbers, and exp2 is a fit with ~1e-7 relative error. */
#define TOL 1e-5
/* G is computed and stored in double (kda_work.G): only double rounding separates
 * it from the reference. */
#define TOL_G 1e-12

/* size limits of the configurations below (static scratch) */
#define BTM 64
#define KM 32
#define VM 16

enum { S_PREP, S_GCS, S_INTRA, S_SOLVE, S_WU, S_STATE, S_OUT, S_DAV, S_DHU, S_WY, S_BINTRA, S_BCUMSUM,
       S_BGATE, S_BQKB, S_COUNT };
static const char *const STAGE_NAME[S_COUNT] = {"prepare", "gate_cumsum", "intra", "solve", "wu", "state",
                                                "output", "bwd_dAv", "bwd_dhu", "bwd_wy", "bwd_intra",
                                                "bwd_cumsum", "bwd_gate", "bwd_qkb"};

typedef struct {
    const char *name;
    int B, T, K, V, BT, nseq;
    long long cu[5];
    int idx64;
    kda_gate gate;
    float lb;
    int has_alog, has_dtb;
    int l2, bsig, neg;
    float scale;
    int h0, dht, want_ht, want_dh0;
    kda_layout layout;
} cfg;

static const cfg CFGS[] = {
    {"varlen{0,37,37,90} BT32 K7 V5 gate none, l2norm, sigmoid, h0+dht, KV, i32",
     1, 90, 7, 5, 32, 3, {0, 37, 37, 90}, 0, KDA_GATE_NONE, 0.0f, 0, 0, 1, 1, 0, 0.0f, 1, 1, 1, 1, KDA_STATE_KV},
    {"varlen{0,37,37,90} BT64 K7 V5 softplus+dt_bias, plain q/k/beta, scale 0.8, VK, i64",
     1, 90, 7, 5, 64, 3, {0, 37, 37, 90}, 1, KDA_GATE_SOFTPLUS, 0.0f, 1, 1, 0, 0, 0, 0.8f, 0, 0, 1, 1, KDA_STATE_VK},
    {"B2 T21 BT16 K7 V5 lower_bound -3 + A_log + dt_bias, l2norm, 2*sigmoid, h0+dht, VK",
     2, 21, 7, 5, 16, 0, {0}, 0, KDA_GATE_LOWER_BOUND, -3.0f, 1, 1, 1, 1, 1, 0.0f, 1, 1, 1, 1, KDA_STATE_VK},
    {"B2 T21 BT16 K7 V5 lower_bound -5 no A_log, sigmoid, dht, no ht/dh0 requested, KV",
     2, 21, 7, 5, 16, 0, {0}, 0, KDA_GATE_LOWER_BOUND, -5.0f, 0, 1, 0, 1, 0, 0.0f, 0, 1, 0, 0, KDA_STATE_KV},
    {"varlen{0,37,37,90} BT64 K20 V9 softplus no dt_bias, l2norm, h0, VK, i64",
     1, 90, 20, 9, 64, 3, {0, 37, 37, 90}, 1, KDA_GATE_SOFTPLUS, 0.0f, 1, 0, 1, 0, 0, 0.0f, 1, 0, 1, 1, KDA_STATE_VK},
    {"varlen{0,37,37,90} BT32 K20 V9 gate none, 2*sigmoid, dht, KV, i32",
     1, 90, 20, 9, 32, 3, {0, 37, 37, 90}, 0, KDA_GATE_NONE, 0.0f, 0, 0, 0, 1, 1, 0.0f, 0, 1, 1, 1, KDA_STATE_KV},
};
#define NCFG ((int)(sizeof CFGS / sizeof CFGS[0]))

typedef struct { long long t0, gc; int n, seq; } chk;

typedef struct {
    const cfg *c;
    kda_context *ctx;
    t_inst I;
    kda_problem p;
    kda_inputs in;
    kda_work w;
    unsigned char *buf;
    size_t bytes, rows;
    int N, NT, H, HV, G, K, V, BT;
    long long bos[8], len[8], chunk0[9];
    chk ch[64];
    double scale;
    float *o, *ht, *dh0, *dv, *dg, *dq, *dk, *dbeta, *dA_log, *ddt_bias;
} fx;

/* ---------------------------------------------------------------- helpers */

static double *dal(size_t n) {
    double *p = (double *)calloc(n ? n : 1, sizeof(double));
    if (!p) { printf("out of memory\n"); exit(2); }
    return p;
}
static float *nanbuf(size_t n) {
    float *p = t_alloc(n);
    memset(p, 0xff, n * sizeof(float));
    return p;
}
/* Error ratio RMS(ref-x)/RMS(ref) of two double arrays (as t_err_d). */
static double err_dd(const double *ref, const double *x, size_t n) {
    double num = 0.0, den = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        double d = ref[i] - x[i];
        if (x[i] != x[i]) return INFINITY;
        num += d * d;
        den += ref[i] * ref[i];
    }
    if (num == 0.0) return 0.0;
    return den > 0.0 ? sqrt(num / den) : INFINITY;
}
static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }
/* exp of a difference of log2-unit cumsums, in natural units */
static double ex2(double gi, double gj) { return exp((gi - gj) * LN2); }

/* Checks err <= tol, naming the array and the configuration. */
static void close_(const fx *f, const char *what, double err, double tol) {
    char nm[256];
    snprintf(nm, sizeof nm, "%s [%s]", what, f->c->name);
    CHECK_CLOSE(nm, err, tol);
}

/* Is `name` in msg as a whole word (not inside a longer identifier)? */
static int has_word(const char *msg, const char *name) {
    size_t n = strlen(name);
    const char *s = msg;
    while ((s = strstr(s, name)) != NULL) {
        int pre = s > msg && (s[-1] == '_' || (s[-1] >= 'a' && s[-1] <= 'z') || (s[-1] >= 'A' && s[-1] <= 'Z') ||
                              (s[-1] >= '0' && s[-1] <= '9'));
        char c = s[n];
        int post = c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        if (!pre && !post) return 1;
        s++;
    }
    return 0;
}

/* indices into the token-major tensors */
static size_t iq(const fx *f, long long r, int h) { return ((size_t)r * f->H + h) * f->K; }
static size_t ik(const fx *f, long long r, int hv) { return ((size_t)r * f->HV + hv) * f->K; }
static size_t iv(const fx *f, long long r, int hv) { return ((size_t)r * f->HV + hv) * f->V; }
static size_t ib(const fx *f, long long r, int hv) { return ((size_t)r * f->HV + hv) * f->BT; }
static size_t ibeta(const fx *f, long long r, int hv) { return (size_t)r * f->HV + hv; }
/* per-chunk work states, always [K,V] */
static size_t iw(const fx *f, long long gc, int hv, int d, int v) {
    return (((size_t)gc * f->HV + hv) * f->K + d) * f->V + v;
}
/* caller-layout states (h0, ht, dht, dh0) */
static size_t iu(const fx *f, int n, int hv, int d, int v) {
    size_t base = ((size_t)n * f->HV + hv) * f->K * f->V;
    return f->p.state_layout == KDA_STATE_KV ? base + (size_t)d * f->V + v : base + (size_t)v * f->K + d;
}

static void fx_init(fx *f, const cfg *c, unsigned long long seed) {
    kda_problem p = kda_problem_default(c->B, c->T, 1, c->K, c->V);
    int n;
    long long t, gc = 0;
    memset(f, 0, sizeof *f);
    f->c = c;
    f->ctx = t_cpu();
    p.HV = 2;
    p.chunk_size = c->BT;
    p.scale = c->scale;
    p.qk_l2norm = c->l2;
    p.gate = c->gate;
    p.lower_bound = c->lb;
    p.beta_sigmoid = c->bsig;
    p.allow_neg_eigval = c->neg;
    p.state_layout = c->layout;
    p.num_seqs = c->nseq;
    p.seqlens_type = c->idx64 ? KDA_INDEX_I64 : KDA_INDEX_I32;
    t_seed(seed);
    t_inst_init(&f->I, &p, c->cu, c->h0, c->dht);
    if (!c->has_alog) { free(f->I.A_log); f->I.A_log = NULL; }
    if (!c->has_dtb) { free(f->I.dt_bias); f->I.dt_bias = NULL; }
    f->p = f->I.p;
    f->in = t_inputs(&f->I);
    f->H = p.H; f->HV = p.HV; f->G = p.HV / p.H; f->K = p.K; f->V = p.V; f->BT = p.chunk_size;
    f->rows = (size_t)p.B * p.T;
    f->scale = p.scale != 0.0f ? (double)p.scale : 1.0 / sqrt((double)p.K);
    f->N = kda_num_seqs(&p);
    for (n = 0; n < f->N; n++) {
        f->bos[n] = c->nseq ? c->cu[n] : (long long)n * c->T;
        f->len[n] = c->nseq ? c->cu[n + 1] - c->cu[n] : c->T;
        f->chunk0[n] = gc;
        for (t = 0; t < f->len[n]; t += c->BT) {
            f->ch[gc].t0 = f->bos[n] + t;
            f->ch[gc].n = (int)(f->len[n] - t < c->BT ? f->len[n] - t : c->BT);
            f->ch[gc].seq = n;
            f->ch[gc].gc = gc;
            gc++;
        }
    }
    f->chunk0[f->N] = gc;
    f->NT = (int)gc;
    f->bytes = kda_work_layout(&f->p, KDA_WORK_FWD | KDA_WORK_BWD, NULL, NULL);
    f->buf = (unsigned char *)malloc(f->bytes);
    if (!f->buf) exit(2);
    memset(f->buf, 0xff, f->bytes); /* NaN in float and double */
    memset(&f->w, 0, sizeof f->w);
    CHECK(kda_work_layout(&f->p, KDA_WORK_FWD | KDA_WORK_BWD, f->buf, &f->w) == f->bytes,
          "kda_work_layout returns a different size when carving [%s]", c->name);
    f->o = nanbuf(f->I.nv); f->ht = nanbuf(f->I.ns); f->dh0 = nanbuf(f->I.ns);
    f->dv = nanbuf(f->I.nv); f->dg = nanbuf(f->I.ng); f->dq = nanbuf(f->I.nq); f->dk = nanbuf(f->I.nq);
    f->dbeta = nanbuf(f->I.nb); f->dA_log = nanbuf((size_t)f->HV); f->ddt_bias = nanbuf((size_t)f->HV * f->K);
}

static void fx_free(fx *f) {
    kda_context_destroy(f->ctx);
    t_inst_free(&f->I);
    free(f->buf);
    free(f->o); free(f->ht); free(f->dh0); free(f->dv); free(f->dg); free(f->dq); free(f->dk);
    free(f->dbeta); free(f->dA_log); free(f->ddt_bias);
}

/* Runs stage s on work w with the fixture's outputs. */
static kda_status fx_stage(fx *f, int s, kda_work *w) {
    kda_context *x = f->ctx;
    const kda_problem *p = &f->p;
    const kda_inputs *in = &f->in;
    switch (s) {
    case S_PREP: return kda_stage_prepare(x, p, in, w);
    case S_GCS: return kda_stage_gate_cumsum(x, p, in, w);
    case S_INTRA: return kda_stage_intra(x, p, in, w);
    case S_SOLVE: return kda_stage_solve(x, p, in, w);
    case S_WU: return kda_stage_wu(x, p, in, w);
    case S_STATE: return kda_stage_state(x, p, in, w, f->c->want_ht ? f->ht : NULL);
    case S_OUT: return kda_stage_output(x, p, in, w, f->o);
    case S_DAV: return kda_stage_bwd_dAv(x, p, in, w, f->I.dout);
    case S_DHU: return kda_stage_bwd_dhu(x, p, in, w, f->I.dout, f->I.dht, f->c->want_dh0 ? f->dh0 : NULL);
    case S_WY: return kda_stage_bwd_wy(x, p, in, w, f->I.dout, f->dv);
    case S_BINTRA: return kda_stage_bwd_intra(x, p, in, w);
    case S_BCUMSUM: return kda_stage_bwd_cumsum(x, p, in, w);
    case S_BGATE:
        return kda_stage_bwd_gate(x, p, in, w, f->dg, f->I.A_log ? f->dA_log : NULL,
                                  f->I.dt_bias ? f->ddt_bias : NULL);
    case S_BQKB: return kda_stage_bwd_qkb(x, p, in, w, f->dq, f->dk, f->dbeta);
    }
    return KDA_ERROR_INTERNAL;
}

/* Runs the stages before `upto` (unchecked), then `upto` itself when run_it.
 * 0 (with a failed check) when a stage returns an error. */
static int fx_run(fx *f, int upto, int run_it) {
    int s;
    for (s = 0; s < upto + (run_it ? 1 : 0); s++) {
        kda_status st = fx_stage(f, s, &f->w);
        if (st != KDA_OK) {
            CHECK(0, "stage %s failed (%s): %s [%s]", STAGE_NAME[s], kda_status_string(st), kda_last_error(f->ctx),
                  f->c->name);
            return 0;
        }
    }
    return 1;
}

/* ------------------------------------------------------- forward stages */

static void test_prepare_normalises_qk_and_applies_beta_sigmoid(void) {
    int ci;
    t_current = "test_prepare_normalises_qk_and_applies_beta_sigmoid";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        size_t r, nr, i;
        int d;
        fx_init(&f, &CFGS[ci], 100 + ci);
        if (fx_run(&f, S_PREP, 1)) {
            const float *src[2] = {f.I.q, f.I.k};
            const float *got[2] = {f.w.qn, f.w.kn};
            const float *grs[2] = {f.w.rstd_q, f.w.rstd_k};
            const char *nm[2] = {"qn", "kn"}, *nr_[2] = {"rstd_q", "rstd_k"};
            int x;
            nr = f.rows * f.H;
            for (x = 0; x < 2; x++) {
                if (f.c->l2) {
                    double *ref = dal(f.I.nq), *rrs = dal(nr);
                    for (r = 0; r < nr; r++) {
                        double ss = 0.0, rs;
                        for (d = 0; d < f.K; d++) ss += (double)src[x][r * f.K + d] * src[x][r * f.K + d];
                        rs = 1.0 / sqrt(ss + 1e-6);
                        rrs[r] = rs;
                        for (d = 0; d < f.K; d++) ref[r * f.K + d] = src[x][r * f.K + d] * rs;
                    }
                    close_(&f, nm[x], t_err_d(ref, got[x], f.I.nq), TOL);
                    CHECK(grs[x] != NULL, "work.%s not carved with qk_l2norm [%s]", nr_[x], f.c->name);
                    if (grs[x]) close_(&f, nr_[x], t_err_d(rrs, grs[x], nr), TOL);
                    free(ref); free(rrs);
                } else {
                    CHECK(memcmp(src[x], got[x], f.I.nq * sizeof(float)) == 0,
                          "%s is not an exact copy of the input without qk_l2norm [%s]", nm[x], f.c->name);
                }
            }
            if (f.c->bsig) {
                double *ref = dal(f.I.nb);
                for (i = 0; i < f.I.nb; i++) ref[i] = (f.c->neg ? 2.0 : 1.0) * sigm(f.I.beta[i]);
                close_(&f, "beta (sigmoid)", t_err_d(ref, f.w.beta, f.I.nb), TOL);
                free(ref);
            } else {
                CHECK(memcmp(f.I.beta, f.w.beta, f.I.nb * sizeof(float)) == 0,
                      "beta is not an exact copy of the input without beta_sigmoid [%s]", f.c->name);
            }
        }
        fx_free(&f);
    }
}

/* a_t from the raw g (spec 2.4), natural log */
static double ref_gate(const fx *f, int hv, int d, double x) {
    double z, c;
    if (f->p.gate == KDA_GATE_NONE) return x;
    z = x + (f->I.dt_bias ? (double)f->I.dt_bias[(size_t)hv * f->K + d] : 0.0);
    if (f->p.gate == KDA_GATE_SOFTPLUS) return -exp((double)f->I.A_log[hv]) * (z > 20.0 ? z : log1p(exp(z)));
    c = f->I.A_log ? exp((double)f->I.A_log[hv]) : 1.0;
    return (double)f->p.lower_bound * sigm(c * z);
}

static void test_gate_cumsum_is_chunk_local_cumsum_of_gate_in_log2(void) {
    int ci;
    t_current = "test_gate_cumsum_is_chunk_local_cumsum_of_gate_in_log2";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 200 + ci);
        if (fx_run(&f, S_GCS, 1)) {
            double *ref = dal(f.I.ng);
            int c, hv, d, i;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++)
                    for (d = 0; d < f.K; d++) {
                        double acc = 0.0;
                        for (i = 0; i < f.ch[c].n; i++) {
                            long long r = f.ch[c].t0 + i;
                            acc += ref_gate(&f, hv, d, f.I.g[ik(&f, r, hv) + d]);
                            ref[ik(&f, r, hv) + d] = acc / LN2;
                        }
                    }
            close_(&f, "G", err_dd(ref, f.w.G, f.I.ng), TOL_G);
            free(ref);
        }
        fx_free(&f);
    }
}

static void test_intra_gives_masked_decayed_qk_and_beta_kk(void) {
    int ci;
    t_current = "test_intra_gives_masked_decayed_qk_and_beta_kk";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 300 + ci);
        if (fx_run(&f, S_INTRA, 1)) {
            size_t nb = f.rows * f.HV * f.BT, bad_a = 0, bad_l = 0;
            double *rA = dal(nb), *rL = dal(nb);
            int c, hv, i, j, d;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++) {
                    int h = hv / f.G, n = f.ch[c].n;
                    long long t0 = f.ch[c].t0;
                    for (i = 0; i < n; i++) {
                        const float *qi = f.w.qn + iq(&f, t0 + i, h), *ki = f.w.kn + iq(&f, t0 + i, h);
                        const double *Gi = f.w.G + ik(&f, t0 + i, hv);
                        double bi = f.w.beta[ibeta(&f, t0 + i, hv)];
                        for (j = 0; j < f.BT; j++) {
                            double sa = 0.0, sl = 0.0;
                            size_t at = ib(&f, t0 + i, hv) + j;
                            if (j <= i) {
                                const float *kj = f.w.kn + iq(&f, t0 + j, h);
                                const double *Gj = f.w.G + ik(&f, t0 + j, hv);
                                for (d = 0; d < f.K; d++) {
                                    double e = ex2(Gi[d], Gj[d]);
                                    sa += (double)qi[d] * kj[d] * e;
                                    sl += (double)ki[d] * kj[d] * e;
                                }
                                rA[at] = f.scale * sa;
                                rL[at] = j < i ? bi * sl : 0.0;
                            }
                            if (j > i && f.w.Aqk[at] != 0.0f) bad_a++;
                            if (j >= i && f.w.L[at] != 0.0f) bad_l++;
                        }
                    }
                }
            close_(&f, "Aqk", t_err_d(rA, f.w.Aqk, nb), TOL);
            close_(&f, "L", t_err_d(rL, f.w.L, nb), TOL);
            CHECK(bad_a == 0, "Aqk: %zu entries above the diagonal are not exactly 0 [%s]", bad_a, f.c->name);
            CHECK(bad_l == 0, "L: %zu entries on/above the diagonal are not exactly 0 [%s]", bad_l, f.c->name);
            free(rA); free(rL);
        }
        fx_free(&f);
    }
}

static void test_solve_gives_inverse_of_unit_lower_L(void) {
    int ci;
    t_current = "test_solve_gives_inverse_of_unit_lower_L";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 400 + ci);
        if (fx_run(&f, S_SOLVE, 1)) {
            double num = 0.0, den = 0.0;
            size_t bad_diag = 0, bad_upper = 0;
            int c, hv, i, j, m;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++) {
                    int n = f.ch[c].n;
                    long long t0 = f.ch[c].t0;
                    for (i = 0; i < n; i++) {
                        const float *Mi = f.w.M + ib(&f, t0 + i, hv);
                        for (j = 0; j < f.BT; j++) {
                            if (j == i && Mi[j] != 1.0f) bad_diag++;
                            if (j > i && Mi[j] != 0.0f) bad_upper++;
                        }
                        /* (M (I + L))[i][j] - I[i][j] */
                        for (j = 0; j < n; j++) {
                            double s = Mi[j] - (i == j ? 1.0 : 0.0);
                            for (m = 0; m < n; m++) s += (double)Mi[m] * f.w.L[ib(&f, t0 + m, hv) + j];
                            if (s != s) s = INFINITY;
                            num += s * s;
                        }
                        den += 1.0;
                    }
                }
            close_(&f, "M (I + L) - I (RMS vs I)", sqrt(num / den), 1e-6);
            CHECK(bad_diag == 0, "M: %zu diagonal entries are not exactly 1 [%s]", bad_diag, f.c->name);
            CHECK(bad_upper == 0, "M: %zu entries above the diagonal are not exactly 0 [%s]", bad_upper, f.c->name);
        }
        fx_free(&f);
    }
}

static void test_wu_gives_wy_vectors_and_gated_qk(void) {
    int ci;
    t_current = "test_wu_gives_wy_vectors_and_gated_qk";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 500 + ci);
        if (fx_run(&f, S_WU, 1)) {
            double *rw = dal(f.I.ng), *ru = dal(f.I.nv), *rkg = dal(f.I.ng), *rqg = dal(f.I.ng);
            int c, hv, i, j, d, v;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++) {
                    int h = hv / f.G, n = f.ch[c].n;
                    long long t0 = f.ch[c].t0;
                    const double *Gl = f.w.G + ik(&f, t0 + n - 1, hv);
                    for (i = 0; i < n; i++) {
                        const float *Mi = f.w.M + ib(&f, t0 + i, hv);
                        const double *Gi = f.w.G + ik(&f, t0 + i, hv);
                        const float *qi = f.w.qn + iq(&f, t0 + i, h), *ki = f.w.kn + iq(&f, t0 + i, h);
                        for (d = 0; d < f.K; d++) {
                            double s = 0.0;
                            for (j = 0; j <= i; j++)
                                s += (double)Mi[j] * f.w.beta[ibeta(&f, t0 + j, hv)] *
                                     f.w.kn[iq(&f, t0 + j, h) + d] * exp(f.w.G[ik(&f, t0 + j, hv) + d] * LN2);
                            rw[ik(&f, t0 + i, hv) + d] = s;
                            rkg[ik(&f, t0 + i, hv) + d] = ki[d] * ex2(Gl[d], Gi[d]);
                            rqg[ik(&f, t0 + i, hv) + d] = qi[d] * exp(Gi[d] * LN2);
                        }
                        for (v = 0; v < f.V; v++) {
                            double s = 0.0;
                            for (j = 0; j <= i; j++)
                                s += (double)Mi[j] * f.w.beta[ibeta(&f, t0 + j, hv)] * f.I.v[iv(&f, t0 + j, hv) + v];
                            ru[iv(&f, t0 + i, hv) + v] = s;
                        }
                    }
                }
            close_(&f, "w", t_err_d(rw, f.w.w, f.I.ng), TOL);
            close_(&f, "u", t_err_d(ru, f.w.u, f.I.nv), TOL);
            close_(&f, "kg", t_err_d(rkg, f.w.kg, f.I.ng), TOL);
            close_(&f, "qg", t_err_d(rqg, f.w.qg, f.I.ng), TOL);
            free(rw); free(ru); free(rkg); free(rqg);
        }
        fx_free(&f);
    }
}

static void test_state_scan_gives_chunk_start_states_deltas_and_final_state(void) {
    int ci;
    t_current = "test_state_scan_gives_chunk_start_states_deltas_and_final_state";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 600 + ci);
        if (fx_run(&f, S_STATE, 1)) {
            size_t nh = (size_t)f.NT * f.HV * f.K * f.V;
            double *rh = dal(nh), *rvn = dal(f.I.nv), *rht = dal(f.I.ns);
            static double S[KM][VM];
            int n, hv, d, v, i;
            long long gc;
            for (n = 0; n < f.N; n++)
                for (hv = 0; hv < f.HV; hv++) {
                    for (d = 0; d < f.K; d++)
                        for (v = 0; v < f.V; v++) S[d][v] = f.I.h0 ? f.I.h0[iu(&f, n, hv, d, v)] : 0.0;
                    for (gc = f.chunk0[n]; gc < f.chunk0[n + 1]; gc++) {
                        long long t0 = f.ch[gc].t0;
                        int cn = f.ch[gc].n;
                        const double *Gl = f.w.G + ik(&f, t0 + cn - 1, hv);
                        for (d = 0; d < f.K; d++)
                            for (v = 0; v < f.V; v++) rh[iw(&f, gc, hv, d, v)] = S[d][v];
                        for (i = 0; i < cn; i++)
                            for (v = 0; v < f.V; v++) {
                                double s = f.w.u[iv(&f, t0 + i, hv) + v];
                                for (d = 0; d < f.K; d++) s -= (double)f.w.w[ik(&f, t0 + i, hv) + d] * S[d][v];
                                rvn[iv(&f, t0 + i, hv) + v] = s;
                            }
                        for (d = 0; d < f.K; d++)
                            for (v = 0; v < f.V; v++) {
                                double s = exp(Gl[d] * LN2) * S[d][v];
                                for (i = 0; i < cn; i++)
                                    s += (double)f.w.kg[ik(&f, t0 + i, hv) + d] * rvn[iv(&f, t0 + i, hv) + v];
                                S[d][v] = s;
                            }
                    }
                    for (d = 0; d < f.K; d++)
                        for (v = 0; v < f.V; v++) rht[iu(&f, n, hv, d, v)] = S[d][v];
                }
            close_(&f, "h (chunk-start states)", t_err_d(rh, f.w.h, nh), TOL);
            close_(&f, "vn", t_err_d(rvn, f.w.vn, f.I.nv), TOL);
            if (f.c->want_ht) close_(&f, "ht", t_err_d(rht, f.ht, f.I.ns), TOL);
            free(rh); free(rvn); free(rht);
        }
        fx_free(&f);
    }
}

static void test_output_is_scaled_qg_h_plus_tril_Aqk_vn(void) {
    int ci;
    t_current = "test_output_is_scaled_qg_h_plus_tril_Aqk_vn";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 700 + ci);
        if (fx_run(&f, S_OUT, 1)) {
            double *ro = dal(f.I.nv);
            int c, hv, i, j, d, v;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++) {
                    long long t0 = f.ch[c].t0;
                    for (i = 0; i < f.ch[c].n; i++)
                        for (v = 0; v < f.V; v++) {
                            double a = 0.0, b = 0.0;
                            for (d = 0; d < f.K; d++)
                                a += (double)f.w.qg[ik(&f, t0 + i, hv) + d] * f.w.h[iw(&f, c, hv, d, v)];
                            for (j = 0; j <= i; j++)
                                b += (double)f.w.Aqk[ib(&f, t0 + i, hv) + j] * f.w.vn[iv(&f, t0 + j, hv) + v];
                            ro[iv(&f, t0 + i, hv) + v] = f.scale * a + b;
                        }
                }
            close_(&f, "o", t_err_d(ro, f.o, f.I.nv), TOL);
            free(ro);
        }
        fx_free(&f);
    }
}

/* ------------------------------------------------------ backward stages */

static void test_bwd_dAv_gives_masked_dAqk_and_local_dv(void) {
    int ci;
    t_current = "test_bwd_dAv_gives_masked_dAqk_and_local_dv";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 800 + ci);
        if (fx_run(&f, S_DAV, 1)) {
            size_t nb = f.rows * f.HV * f.BT, bad = 0;
            double *rdA = dal(nb), *rdvl = dal(f.I.nv);
            const float *dout = f.I.dout;
            int c, hv, i, j, v;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++) {
                    long long t0 = f.ch[c].t0;
                    int n = f.ch[c].n;
                    for (i = 0; i < n; i++)
                        for (j = 0; j < f.BT; j++) {
                            size_t at = ib(&f, t0 + i, hv) + j;
                            if (j <= i) {
                                double s = 0.0;
                                for (v = 0; v < f.V; v++)
                                    s += (double)dout[iv(&f, t0 + i, hv) + v] * f.w.vn[iv(&f, t0 + j, hv) + v];
                                rdA[at] = f.scale * s;
                            } else if (f.w.dAqk[at] != 0.0f) {
                                bad++;
                            }
                        }
                    for (j = 0; j < n; j++)
                        for (v = 0; v < f.V; v++) {
                            double s = 0.0;
                            for (i = j; i < n; i++)
                                s += (double)f.w.Aqk[ib(&f, t0 + i, hv) + j] * dout[iv(&f, t0 + i, hv) + v];
                            rdvl[iv(&f, t0 + j, hv) + v] = s;
                        }
                }
            close_(&f, "dAqk", t_err_d(rdA, f.w.dAqk, nb), TOL);
            close_(&f, "dvl", t_err_d(rdvl, f.w.dvl, f.I.nv), TOL);
            CHECK(bad == 0, "dAqk: %zu entries above the diagonal are not exactly 0 [%s]", bad, f.c->name);
            free(rdA); free(rdvl);
        }
        fx_free(&f);
    }
}

static void test_bwd_dhu_reverse_scan_gives_end_of_chunk_state_grads(void) {
    int ci;
    t_current = "test_bwd_dhu_reverse_scan_gives_end_of_chunk_state_grads";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 900 + ci);
        if (fx_run(&f, S_DHU, 1)) {
            size_t nh = (size_t)f.NT * f.HV * f.K * f.V;
            double *rdh = dal(nh), *rdv2 = dal(f.I.nv), *rdh0 = dal(f.I.ns);
            const float *dout = f.I.dout;
            static double dS[KM][VM];
            int n, hv, d, v, i;
            long long gc;
            for (n = 0; n < f.N; n++)
                for (hv = 0; hv < f.HV; hv++) {
                    for (d = 0; d < f.K; d++)
                        for (v = 0; v < f.V; v++) dS[d][v] = f.I.dht ? f.I.dht[iu(&f, n, hv, d, v)] : 0.0;
                    for (gc = f.chunk0[n + 1] - 1; gc >= f.chunk0[n]; gc--) {
                        long long t0 = f.ch[gc].t0;
                        int cn = f.ch[gc].n;
                        const double *Gl = f.w.G + ik(&f, t0 + cn - 1, hv);
                        for (d = 0; d < f.K; d++)
                            for (v = 0; v < f.V; v++) rdh[iw(&f, gc, hv, d, v)] = dS[d][v];
                        for (i = 0; i < cn; i++)
                            for (v = 0; v < f.V; v++) {
                                double s = f.w.dvl[iv(&f, t0 + i, hv) + v];
                                for (d = 0; d < f.K; d++) s += (double)f.w.kg[ik(&f, t0 + i, hv) + d] * dS[d][v];
                                rdv2[iv(&f, t0 + i, hv) + v] = s;
                            }
                        for (d = 0; d < f.K; d++)
                            for (v = 0; v < f.V; v++) {
                                double s = exp(Gl[d] * LN2) * dS[d][v], a = 0.0, b = 0.0;
                                for (i = 0; i < cn; i++) {
                                    a += (double)f.w.qg[ik(&f, t0 + i, hv) + d] * dout[iv(&f, t0 + i, hv) + v];
                                    b += (double)f.w.w[ik(&f, t0 + i, hv) + d] * rdv2[iv(&f, t0 + i, hv) + v];
                                }
                                dS[d][v] = s + f.scale * a - b;
                            }
                    }
                    for (d = 0; d < f.K; d++)
                        for (v = 0; v < f.V; v++) rdh0[iu(&f, n, hv, d, v)] = dS[d][v];
                }
            close_(&f, "dh (end-of-chunk state grads)", t_err_d(rdh, f.w.dh, nh), TOL);
            close_(&f, "dv2", t_err_d(rdv2, f.w.dv2, f.I.nv), TOL);
            if (f.c->want_dh0) close_(&f, "dh0", t_err_d(rdh0, f.dh0, f.I.ns), TOL);
            free(rdh); free(rdv2); free(rdh0);
        }
        fx_free(&f);
    }
}

static void test_bwd_wy_gives_spec_step3_gradients(void) {
    int ci;
    t_current = "test_bwd_wy_gives_spec_step3_gradients";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 1000 + ci);
        if (fx_run(&f, S_WY, 1)) {
            size_t nb = f.rows * f.HV * f.BT;
            double *rdq = dal(f.I.ng), *rdk = dal(f.I.ng), *rdG = dal(f.I.ng), *rdL = dal(nb);
            double *rdb = dal(f.I.nb), *rdv = dal(f.I.nv);
            static double E[BTM][KM], dq[BTM][KM], dks[BTM][KM], dw[BTM][KM], dkb[BTM][KM];
            static double dM[BTM][BTM], Y[BTM][BTM], extra[KM], El[KM];
            const float *dout = f.I.dout;
            int c, hv, i, j, d, v, a;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++) {
                    int h = hv / f.G, n = f.ch[c].n;
                    long long t0 = f.ch[c].t0;
                    const double *Gl = f.w.G + ik(&f, t0 + n - 1, hv);
#define Q_(i, d) ((double)f.w.qn[iq(&f, t0 + (i), h) + (d)])
#define K_(i, d) ((double)f.w.kn[iq(&f, t0 + (i), h) + (d)])
#define B_(i) ((double)f.w.beta[ibeta(&f, t0 + (i), hv)])
#define DO_(i, v) ((double)dout[iv(&f, t0 + (i), hv) + (v)])
#define V_(i, v) ((double)f.I.v[iv(&f, t0 + (i), hv) + (v)])
#define VN_(i, v) ((double)f.w.vn[iv(&f, t0 + (i), hv) + (v)])
#define DV2_(i, v) ((double)f.w.dv2[iv(&f, t0 + (i), hv) + (v)])
#define S0_(d, v) ((double)f.w.h[iw(&f, c, hv, d, v)])
#define DS1_(d, v) ((double)f.w.dh[iw(&f, c, hv, d, v)])
#define M_(i, j) ((double)f.w.M[ib(&f, t0 + (i), hv) + (j)])
                    for (d = 0; d < f.K; d++) {
                        double s = 0.0;
                        El[d] = exp(Gl[d] * LN2);
                        for (v = 0; v < f.V; v++) s += S0_(d, v) * DS1_(d, v);
                        extra[d] = El[d] * s;
                    }
                    for (i = 0; i < n; i++)
                        for (d = 0; d < f.K; d++) {
                            double Gi = f.w.G[ik(&f, t0 + i, hv) + d], s1 = 0.0, s2 = 0.0, s3 = 0.0;
                            E[i][d] = exp(Gi * LN2);
                            for (v = 0; v < f.V; v++) {
                                s1 += DO_(i, v) * S0_(d, v);
                                s2 += VN_(i, v) * DS1_(d, v);
                                s3 += DV2_(i, v) * S0_(d, v);
                            }
                            dq[i][d] = f.scale * E[i][d] * s1;
                            dks[i][d] = ex2(Gl[d], Gi) * s2;
                            dw[i][d] = -s3;
                            extra[d] += K_(i, d) * dks[i][d];
                        }
                    /* dM = dv2 (beta v)^T + dw (beta k E)^T */
                    for (i = 0; i < n; i++)
                        for (j = 0; j < n; j++) {
                            double s = 0.0;
                            for (v = 0; v < f.V; v++) s += DV2_(i, v) * B_(j) * V_(j, v);
                            for (d = 0; d < f.K; d++) s += dw[i][d] * B_(j) * K_(j, d) * E[j][d];
                            dM[i][j] = s;
                        }
                    /* dbv = M^T dv2, dkb = M^T dw */
                    for (j = 0; j < n; j++) {
                        double db = 0.0;
                        for (v = 0; v < f.V; v++) {
                            double s = 0.0;
                            for (i = 0; i < n; i++) s += M_(i, j) * DV2_(i, v);
                            rdv[iv(&f, t0 + j, hv) + v] = B_(j) * s;
                            db += s * V_(j, v);
                        }
                        for (d = 0; d < f.K; d++) {
                            double s = 0.0;
                            for (i = 0; i < n; i++) s += M_(i, j) * dw[i][d];
                            dkb[j][d] = s;
                            db += s * K_(j, d) * E[j][d];
                        }
                        rdb[ibeta(&f, t0 + j, hv)] = db;
                        for (d = 0; d < f.K; d++) {
                            size_t at = ik(&f, t0 + j, hv) + d;
                            double t = dkb[j][d] * E[j][d] * B_(j);
                            rdq[at] = dq[j][d];
                            rdk[at] = dks[j][d] + t;
                            rdG[at] = Q_(j, d) * dq[j][d] - K_(j, d) * dks[j][d] + K_(j, d) * t +
                                      (j == n - 1 ? extra[d] : 0.0);
                        }
                    }
                    /* dL = -strict_lower(M^T strict_lower(dM) M^T) */
                    for (i = 0; i < n; i++)
                        for (j = 0; j < n; j++) {
                            double s = 0.0; /* Y = M^T sl(dM) */
                            for (a = 0; a < n; a++)
                                if (j < a) s += M_(a, i) * dM[a][j];
                            Y[i][j] = s;
                        }
                    for (i = 0; i < n; i++)
                        for (j = 0; j < f.BT; j++) {
                            double s = 0.0;
                            if (j < i)
                                for (a = 0; a < n; a++) s += Y[i][a] * M_(j, a);
                            rdL[ib(&f, t0 + i, hv) + j] = -s;
                        }
#undef Q_
#undef K_
#undef B_
#undef DO_
#undef V_
#undef VN_
#undef DV2_
#undef S0_
#undef DS1_
#undef M_
                }
            close_(&f, "dqh", t_err_d(rdq, f.w.dqh, f.I.ng), TOL);
            close_(&f, "dkh", t_err_d(rdk, f.w.dkh, f.I.ng), TOL);
            close_(&f, "dG", err_dd(rdG, f.w.dG, f.I.ng), TOL);
            close_(&f, "dL", t_err_d(rdL, f.w.dL, nb), TOL);
            close_(&f, "dbeta (work)", t_err_d(rdb, f.w.dbeta, f.I.nb), TOL);
            close_(&f, "dv", t_err_d(rdv, f.dv, f.I.nv), TOL);
            free(rdq); free(rdk); free(rdG); free(rdL); free(rdb); free(rdv);
        }
        fx_free(&f);
    }
}

static void test_bwd_intra_adds_spec_step4_terms(void) {
    int ci;
    t_current = "test_bwd_intra_adds_spec_step4_terms";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 1100 + ci);
        if (fx_run(&f, S_BINTRA, 0)) {
            /* snapshot of what bwd_intra adds to */
            float *q0 = t_alloc(f.I.ng), *k0 = t_alloc(f.I.ng), *b0 = t_alloc(f.I.nb);
            double *G0 = dal(f.I.ng);
            memcpy(q0, f.w.dqh, f.I.ng * sizeof(float));
            memcpy(k0, f.w.dkh, f.I.ng * sizeof(float));
            memcpy(b0, f.w.dbeta, f.I.nb * sizeof(float));
            memcpy(G0, f.w.dG, f.I.ng * sizeof(double));
            {
                double *rq = dal(f.I.ng), *rk = dal(f.I.ng), *rG = dal(f.I.ng), *rb = dal(f.I.nb);
                double *gq = dal(f.I.ng), *gk = dal(f.I.ng), *gG = dal(f.I.ng), *gb = dal(f.I.nb);
                static double Rq[BTM][KM], Rk[BTM][KM], Cq[BTM][KM], Ck[BTM][KM];
                size_t x;
                int c, hv, i, j, d;
                kda_status st = kda_stage_bwd_intra(f.ctx, &f.p, &f.in, &f.w);
                CHECK(st == KDA_OK, "bwd_intra: %s [%s]", kda_last_error(f.ctx), f.c->name);
                for (c = 0; c < f.NT; c++)
                    for (hv = 0; hv < f.HV; hv++) {
                        int h = hv / f.G, n = f.ch[c].n;
                        long long t0 = f.ch[c].t0;
                        memset(Rq, 0, sizeof Rq); memset(Rk, 0, sizeof Rk);
                        memset(Cq, 0, sizeof Cq); memset(Ck, 0, sizeof Ck);
                        for (i = 0; i < n; i++)
                            for (j = 0; j <= i; j++) {
                                double dA = f.w.dAqk[ib(&f, t0 + i, hv) + j];
                                double dL = j < i ? f.w.dL[ib(&f, t0 + i, hv) + j] : 0.0;
                                double bi = f.w.beta[ibeta(&f, t0 + i, hv)];
                                for (d = 0; d < f.K; d++) {
                                    double e = ex2(f.w.G[ik(&f, t0 + i, hv) + d], f.w.G[ik(&f, t0 + j, hv) + d]);
                                    double qi = f.w.qn[iq(&f, t0 + i, h) + d], ki = f.w.kn[iq(&f, t0 + i, h) + d];
                                    double kj = f.w.kn[iq(&f, t0 + j, h) + d];
                                    Rq[i][d] += dA * kj * e;      /* rq_i = sum_{j<=i} dAqk_ij k_j e_ij */
                                    Rk[i][d] += dL * kj * e;      /* rk_i = sum_{j<i} dL_ij k_j e_ij */
                                    Cq[j][d] += dA * qi * e;      /* cq_j = sum_{i>=j} dAqk_ij q_i e_ij */
                                    Ck[j][d] += dL * bi * ki * e; /* ck_j = sum_{i>j} dL_ij beta_i k_i e_ij */
                                }
                            }
                        for (i = 0; i < n; i++) {
                            double bi = f.w.beta[ibeta(&f, t0 + i, hv)], db = 0.0;
                            for (d = 0; d < f.K; d++) {
                                size_t at = ik(&f, t0 + i, hv) + d;
                                double qi = f.w.qn[iq(&f, t0 + i, h) + d], ki = f.w.kn[iq(&f, t0 + i, h) + d];
                                rq[at] = Rq[i][d];
                                rk[at] = bi * Rk[i][d] + Cq[i][d] + Ck[i][d];
                                rG[at] = qi * Rq[i][d] + ki * (bi * Rk[i][d] - Cq[i][d] - Ck[i][d]);
                                db += ki * Rk[i][d];
                            }
                            rb[ibeta(&f, t0 + i, hv)] = db;
                        }
                    }
                for (x = 0; x < f.I.ng; x++) {
                    gq[x] = (double)f.w.dqh[x] - q0[x];
                    gk[x] = (double)f.w.dkh[x] - k0[x];
                    gG[x] = f.w.dG[x] - G0[x];
                }
                for (x = 0; x < f.I.nb; x++) gb[x] = (double)f.w.dbeta[x] - b0[x];
                close_(&f, "dqh increment", err_dd(rq, gq, f.I.ng), TOL);
                close_(&f, "dkh increment", err_dd(rk, gk, f.I.ng), TOL);
                close_(&f, "dG increment", err_dd(rG, gG, f.I.ng), TOL);
                close_(&f, "dbeta increment", err_dd(rb, gb, f.I.nb), TOL);
                free(rq); free(rk); free(rG); free(rb); free(gq); free(gk); free(gG); free(gb);
            }
            free(q0); free(k0); free(b0); free(G0);
        }
        fx_free(&f);
    }
}

static void test_bwd_cumsum_is_reverse_chunk_local_cumsum_of_dG(void) {
    int ci;
    t_current = "test_bwd_cumsum_is_reverse_chunk_local_cumsum_of_dG";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 1200 + ci);
        if (fx_run(&f, S_BCUMSUM, 1)) {
            double *ref = dal(f.I.ng);
            int c, hv, d, i;
            for (c = 0; c < f.NT; c++)
                for (hv = 0; hv < f.HV; hv++)
                    for (d = 0; d < f.K; d++) {
                        double acc = 0.0;
                        for (i = f.ch[c].n - 1; i >= 0; i--) {
                            size_t at = ik(&f, f.ch[c].t0 + i, hv) + d;
                            acc += f.w.dG[at];
                            ref[at] = acc;
                        }
                    }
            close_(&f, "dgate", t_err_d(ref, f.w.dgate, f.I.ng), TOL);
            free(ref);
        }
        fx_free(&f);
    }
}

static void test_bwd_gate_applies_gate_derivative_and_sums_parameter_grads(void) {
    int ci;
    t_current = "test_bwd_gate_applies_gate_derivative_and_sums_parameter_grads";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 1300 + ci);
        if (fx_run(&f, S_BGATE, 1)) {
            if (f.p.gate == KDA_GATE_NONE) {
                CHECK(memcmp(f.dg, f.w.dgate, f.I.ng * sizeof(float)) == 0,
                      "dg is not exactly dgate with KDA_GATE_NONE [%s]", f.c->name);
            } else {
                double *rdg = dal(f.I.ng), *rA = dal((size_t)f.HV), *rb = dal((size_t)f.HV * f.K);
                size_t r;
                int hv, d;
                for (r = 0; r < f.rows; r++)
                    for (hv = 0; hv < f.HV; hv++)
                        for (d = 0; d < f.K; d++) {
                            size_t at = ik(&f, (long long)r, hv) + d;
                            double dy = f.w.dgate[at], dx;
                            double z = f.I.g[at] + (f.I.dt_bias ? (double)f.I.dt_bias[(size_t)hv * f.K + d] : 0.0);
                            double c = f.I.A_log ? exp((double)f.I.A_log[hv]) : 1.0;
                            if (f.p.gate == KDA_GATE_SOFTPLUS) {
                                double sp = z > 20.0 ? z : log1p(exp(z));
                                dx = -c * sigm(z) * dy;
                                rA[hv] += dy * (-c * sp);
                            } else {
                                double s = sigm(c * z);
                                dx = dy * f.p.lower_bound * s * (1.0 - s) * c;
                                rA[hv] += dx * z;
                            }
                            rdg[at] = dx;
                            rb[(size_t)hv * f.K + d] += dx;
                        }
                close_(&f, "dg (through the gate)", t_err_d(rdg, f.dg, f.I.ng), TOL);
                if (f.I.A_log) close_(&f, "dA_log", t_err_d(rA, f.dA_log, (size_t)f.HV), TOL);
                if (f.I.dt_bias) close_(&f, "ddt_bias", t_err_d(rb, f.ddt_bias, (size_t)f.HV * f.K), TOL);
                free(rdg); free(rA); free(rb);
            }
        }
        fx_free(&f);
    }
}

static void test_bwd_qkb_sums_gva_groups_then_l2norm_and_sigmoid_backward(void) {
    int ci;
    t_current = "test_bwd_qkb_sums_gva_groups_then_l2norm_and_sigmoid_backward";
    for (ci = 0; ci < NCFG; ci++) {
        fx f;
        fx_init(&f, &CFGS[ci], 1400 + ci);
        if (fx_run(&f, S_BQKB, 1)) {
            const float *src[2] = {f.w.dqh, f.w.dkh}, *y[2] = {f.w.qn, f.w.kn}, *rs[2] = {f.w.rstd_q, f.w.rstd_k};
            const float *gsum[2] = {f.w.dqn, f.w.dkn}, *out[2] = {f.dq, f.dk};
            const char *nsum[2] = {"dqn (GVA sum)", "dkn (GVA sum)"}, *nout[2] = {"dq", "dk"};
            double *rsum = dal(f.I.nq), *rout = dal(f.I.nq), *rb = dal(f.I.nb);
            size_t r, i;
            int x, h, g, d;
            for (x = 0; x < 2; x++) {
                for (r = 0; r < f.rows; r++)
                    for (h = 0; h < f.H; h++) {
                        size_t at = iq(&f, (long long)r, h);
                        double dot = 0.0;
                        for (d = 0; d < f.K; d++) {
                            double s = 0.0;
                            for (g = 0; g < f.G; g++) s += src[x][ik(&f, (long long)r, h * f.G + g) + d];
                            rsum[at + d] = s;
                            dot += s * y[x][at + d];
                        }
                        for (d = 0; d < f.K; d++)
                            rout[at + d] = f.c->l2 ? rs[x][r * f.H + h] * (rsum[at + d] - dot * y[x][at + d])
                                                   : rsum[at + d];
                    }
                close_(&f, nsum[x], t_err_d(rsum, gsum[x], f.I.nq), TOL);
                close_(&f, nout[x], t_err_d(rout, out[x], f.I.nq), TOL);
            }
            for (i = 0; i < f.I.nb; i++) {
                double db = f.w.dbeta[i];
                if (f.c->bsig) {
                    double s = sigm(f.I.beta[i]);
                    db *= (f.c->neg ? 2.0 : 1.0) * s * (1.0 - s);
                }
                rb[i] = db;
            }
            close_(&f, "dbeta (raw)", t_err_d(rb, f.dbeta, f.I.nb), TOL);
            free(rsum); free(rout); free(rb);
        }
        fx_free(&f);
    }
}

/* ------------------------------------------------------- l2norm on its own */

static void test_l2norm_rows_fwd_bwd_match_formula_for_f32_and_bf16(void) {
    enum { ROWS = 13, D = 60 };
    const kda_dtype types[2] = {KDA_F32, KDA_BF16};
    const kda_dtype otypes[3] = {KDA_F32, KDA_BF16, KDA_F16};
    /* A 16-bit dx is the fp32 result rounded to nearest: relative error at most
     * 2^-9 (bf16, 8 significant bits) or 2^-12 (f16) per element, so the RMS ratio
     * is at most that plus the fp32 error. */
    const double otol[3] = {TOL, 1.0 / 512 + TOL, 1.0 / 4096 + TOL};
    kda_context *ctx = t_cpu();
    float *x = t_alloc(ROWS * D), *xv = t_alloc(ROWS * D), *y = t_alloc(ROWS * D), *rstd = t_alloc(ROWS);
    float *dy = t_alloc(ROWS * D), *dxf = t_alloc(ROWS * D);
    uint16_t *x16 = (uint16_t *)calloc(ROWS * D, 2), *dx16 = (uint16_t *)calloc(ROWS * D, 2);
    double *ry = dal(ROWS * D), *rr = dal(ROWS), *rdx = dal(ROWS * D), *gdx = dal(ROWS * D);
    int ti, oi, r, d;
    t_current = "test_l2norm_rows_fwd_bwd_match_formula_for_f32_and_bf16";
    t_seed(77);
    for (r = 0; r < ROWS; r++)
        for (d = 0; d < D; d++) /* row scales 1e-2 .. 1e2, and row 5 all zero */
            x[r * D + d] = r == 5 ? 0.0f : (float)(t_randn() * pow(10.0, (r % 5) - 2));
    for (r = 0; r < ROWS * D; r++) dy[r] = (float)t_randn();
    for (ti = 0; ti < 2; ti++) {
        const void *xin = x;
        char nm[64];
        kda_status s;
        if (types[ti] == KDA_BF16) {
            for (r = 0; r < ROWS * D; r++) { x16[r] = kda_f32_to_bf16(x[r]); xv[r] = kda_bf16_to_f32(x16[r]); }
            xin = x16;
        } else {
            memcpy(xv, x, sizeof(float) * ROWS * D);
        }
        memset(y, 0xff, sizeof(float) * ROWS * D);
        memset(rstd, 0xff, sizeof(float) * ROWS);
        s = kda_l2norm_fwd(ctx, ROWS, D, xin, types[ti], y, rstd);
        CHECK(s == KDA_OK, "kda_l2norm_fwd (%s): %s", kda_dtype_name(types[ti]), kda_last_error(ctx));
        for (r = 0; r < ROWS; r++) {
            double ss = 0.0;
            for (d = 0; d < D; d++) ss += (double)xv[r * D + d] * xv[r * D + d];
            rr[r] = 1.0 / sqrt(ss + 1e-6);
            for (d = 0; d < D; d++) ry[r * D + d] = xv[r * D + d] * rr[r];
        }
        snprintf(nm, sizeof nm, "l2norm y (x %s)", kda_dtype_name(types[ti]));
        CHECK_CLOSE(nm, t_err_d(ry, y, ROWS * D), TOL);
        snprintf(nm, sizeof nm, "l2norm rstd (x %s)", kda_dtype_name(types[ti]));
        CHECK_CLOSE(nm, t_err_d(rr, rstd, ROWS), TOL);
        /* backward from the y and rstd just computed */
        for (r = 0; r < ROWS; r++) {
            double dot = 0.0;
            for (d = 0; d < D; d++) dot += (double)dy[r * D + d] * y[r * D + d];
            for (d = 0; d < D; d++) rdx[r * D + d] = rstd[r] * (dy[r * D + d] - dot * y[r * D + d]);
        }
        for (oi = 0; oi < 3; oi++) {
            void *dx = otypes[oi] == KDA_F32 ? (void *)dxf : (void *)dx16;
            memset(dxf, 0xff, sizeof(float) * ROWS * D);
            memset(dx16, 0xff, 2 * ROWS * D);
            s = kda_l2norm_bwd(ctx, ROWS, D, y, rstd, dy, dx, otypes[oi]);
            CHECK(s == KDA_OK, "kda_l2norm_bwd (%s): %s", kda_dtype_name(otypes[oi]), kda_last_error(ctx));
            for (r = 0; r < ROWS * D; r++)
                gdx[r] = otypes[oi] == KDA_F32 ? (double)dxf[r]
                         : otypes[oi] == KDA_BF16 ? (double)kda_bf16_to_f32(dx16[r]) : (double)kda_f16_to_f32(dx16[r]);
            snprintf(nm, sizeof nm, "l2norm dx %s (x %s)", kda_dtype_name(otypes[oi]), kda_dtype_name(types[ti]));
            CHECK_CLOSE(nm, err_dd(rdx, gdx, ROWS * D), otol[oi]);
        }
    }
    free(x); free(xv); free(y); free(rstd); free(dy); free(dxf); free(x16); free(dx16);
    free(ry); free(rr); free(rdx); free(gdx);
    kda_context_destroy(ctx);
}

/* ----------------------------------------- a kda_work missing a needed field */

static int null_field(kda_work *w, const char *name) {
#define NF(fld) if (!strcmp(name, #fld)) { w->fld = NULL; return 1; }
    NF(qn) NF(kn) NF(rstd_q) NF(rstd_k) NF(beta) NF(G) NF(Aqk) NF(L) NF(M) NF(w) NF(u) NF(kg) NF(qg) NF(h)
    NF(vn) NF(dAqk) NF(dvl) NF(dh) NF(dv2) NF(dqh) NF(dkh) NF(dG) NF(dL) NF(dbeta) NF(dgate) NF(dqn) NF(dkn)
#undef NF
    return 0;
}

static void test_stages_reject_work_missing_a_needed_field(void) {
    /* the fields each stage reads or writes, from the comments of kda.h */
    static const struct { int stage; const char *field; } NEEDS[] = {
        {S_PREP, "qn"}, {S_PREP, "kn"}, {S_PREP, "beta"}, {S_PREP, "rstd_q"}, {S_PREP, "rstd_k"},
        {S_GCS, "G"},
        {S_INTRA, "qn"}, {S_INTRA, "kn"}, {S_INTRA, "beta"}, {S_INTRA, "G"}, {S_INTRA, "Aqk"}, {S_INTRA, "L"},
        {S_SOLVE, "L"}, {S_SOLVE, "M"},
        {S_WU, "M"}, {S_WU, "qn"}, {S_WU, "kn"}, {S_WU, "beta"}, {S_WU, "G"}, {S_WU, "w"}, {S_WU, "u"},
        {S_WU, "kg"}, {S_WU, "qg"},
        {S_STATE, "w"}, {S_STATE, "u"}, {S_STATE, "kg"}, {S_STATE, "G"}, {S_STATE, "h"}, {S_STATE, "vn"},
        {S_OUT, "qg"}, {S_OUT, "h"}, {S_OUT, "Aqk"}, {S_OUT, "vn"},
        {S_DAV, "vn"}, {S_DAV, "Aqk"}, {S_DAV, "dAqk"}, {S_DAV, "dvl"},
        {S_DHU, "qg"}, {S_DHU, "kg"}, {S_DHU, "w"}, {S_DHU, "G"}, {S_DHU, "dvl"}, {S_DHU, "dh"}, {S_DHU, "dv2"},
        {S_WY, "qn"}, {S_WY, "kn"}, {S_WY, "G"}, {S_WY, "beta"}, {S_WY, "h"}, {S_WY, "dh"}, {S_WY, "dv2"},
        {S_WY, "vn"}, {S_WY, "M"}, {S_WY, "dqh"}, {S_WY, "dkh"}, {S_WY, "dG"}, {S_WY, "dL"}, {S_WY, "dbeta"},
        {S_BINTRA, "qn"}, {S_BINTRA, "kn"}, {S_BINTRA, "G"}, {S_BINTRA, "beta"}, {S_BINTRA, "dAqk"},
        {S_BINTRA, "dL"}, {S_BINTRA, "dqh"}, {S_BINTRA, "dkh"}, {S_BINTRA, "dG"}, {S_BINTRA, "dbeta"},
        {S_BCUMSUM, "dG"}, {S_BCUMSUM, "dgate"},
        {S_BGATE, "dgate"},
        {S_BQKB, "dqh"}, {S_BQKB, "dkh"}, {S_BQKB, "dqn"}, {S_BQKB, "dkn"}, {S_BQKB, "dbeta"}, {S_BQKB, "qn"},
        {S_BQKB, "kn"}, {S_BQKB, "rstd_q"}, {S_BQKB, "rstd_k"},
    };
    fx f;
    size_t e;
    unsigned char *snap;
    t_current = "test_stages_reject_work_missing_a_needed_field";
    fx_init(&f, &CFGS[2], 1500); /* qk_l2norm on: rstd_q/rstd_k are needed too; gate with A_log, dt_bias */
    if (!fx_run(&f, S_BQKB, 1)) { fx_free(&f); return; }
    snap = (unsigned char *)malloc(f.bytes);
    if (!snap) exit(2);
    for (e = 0; e < sizeof NEEDS / sizeof NEEDS[0]; e++) {
        kda_work w2 = f.w;
        float *o0 = t_alloc(f.I.nv);
        kda_status s;
        const char *msg;
        CHECK(null_field(&w2, NEEDS[e].field), "unknown field %s", NEEDS[e].field);
        memcpy(snap, f.buf, f.bytes);
        memcpy(o0, f.o, f.I.nv * sizeof(float));
        s = fx_stage(&f, NEEDS[e].stage, &w2);
        msg = kda_last_error(f.ctx);
        CHECK(s == KDA_ERROR_INVALID_ARGUMENT, "stage %s without work.%s: status %s, want invalid argument",
              STAGE_NAME[NEEDS[e].stage], NEEDS[e].field, kda_status_string(s));
        CHECK(has_word(msg, NEEDS[e].field), "stage %s without work.%s: message \"%s\" does not name the field",
              STAGE_NAME[NEEDS[e].stage], NEEDS[e].field, msg);
        CHECK(memcmp(snap, f.buf, f.bytes) == 0, "stage %s without work.%s wrote into the work buffer",
              STAGE_NAME[NEEDS[e].stage], NEEDS[e].field);
        CHECK(memcmp(o0, f.o, f.I.nv * sizeof(float)) == 0, "stage %s without work.%s wrote o",
              STAGE_NAME[NEEDS[e].stage], NEEDS[e].field);
        free(o0);
    }
    free(snap);
    fx_free(&f);
}

int main(void) {
    test_prepare_normalises_qk_and_applies_beta_sigmoid();
    test_gate_cumsum_is_chunk_local_cumsum_of_gate_in_log2();
    test_intra_gives_masked_decayed_qk_and_beta_kk();
    test_solve_gives_inverse_of_unit_lower_L();
    test_wu_gives_wy_vectors_and_gated_qk();
    test_state_scan_gives_chunk_start_states_deltas_and_final_state();
    test_output_is_scaled_qg_h_plus_tril_Aqk_vn();
    test_bwd_dAv_gives_masked_dAqk_and_local_dv();
    test_bwd_dhu_reverse_scan_gives_end_of_chunk_state_grads();
    test_bwd_wy_gives_spec_step3_gradients();
    test_bwd_intra_adds_spec_step4_terms();
    test_bwd_cumsum_is_reverse_chunk_local_cumsum_of_dG();
    test_bwd_gate_applies_gate_derivative_and_sums_parameter_grads();
    test_bwd_qkb_sums_gva_groups_then_l2norm_and_sigmoid_backward();
    test_l2norm_rows_fwd_bwd_match_formula_for_f32_and_bf16();
    test_stages_reject_work_missing_a_needed_field();
    return t_report();
}
