/* demo.c - the first program to run: Kimi Delta Attention, forward and backward,
 * on a realistic problem, checked against a float64 reference.
 *
 * Build and run (from the repository root):
 *
 *     cc -std=c11 -O3 -march=native examples/demo.c -o demo -lm -lpthread -ldl
 *     ./demo              # the GPU when there is one, otherwise the CPU
 *     ./demo --cpu        # always the CPU
 *     ./demo --T 1024     # shorter sequences, for a quick run
 *
 * The problem: B=2 sequences of T=4096 tokens, H=8 heads, K=V=128, bf16 q/k/v,
 * fp32 log decay g = logsigmoid(randn), beta = sigmoid(randn) in bf16, a random
 * fp32 initial state, q and k l2-normalised inside the kernel, chunks of 64.
 * KDA_NUM_THREADS sets the number of CPU threads (default: all cores).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#define KDA_IMPLEMENTATION
#include "../kda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------- */
/* Random inputs: xorshift64* and Box-Muller, fixed seed, so every run is alike. */

typedef struct rng { uint64_t s; } rng;

static uint64_t rng_next(rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1DULL;
}

static double rng_uniform(rng *r) /* in (0, 1) */
{
    return ((double)(rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double rng_normal(rng *r)
{
    double u1 = rng_uniform(r), u2 = rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double logsigmoid(double x) { return fmin(x, 0.0) - log1p(exp(-fabs(x))); }

static void fill_randn_bf16(uint16_t *x, size_t n, rng *r)
{
    for (size_t i = 0; i < n; i++) x[i] = kda_f32_to_bf16((float)rng_normal(r));
}

/* ------------------------------------------------------------------------- */
/* The tensors of one forward + backward. All are void* so the same struct
 * holds the host arrays and the backend's copies of them. */

typedef struct tensors {
    void *q, *k, *v, *g, *beta, *h0;              /* inputs */
    void *o, *ht;                                 /* forward outputs */
    void *dout, *dq, *dk, *dv, *dg, *dbeta, *dh0; /* backward input and outputs */
    void *work;                                   /* library workspace */
} tensors;

typedef struct sizes { size_t qk, v, g, beta, state, work; } sizes; /* bytes */

static sizes tensor_sizes(const kda_problem *p)
{
    size_t tokens = (size_t)p->B * p->T, N = (size_t)kda_num_seqs(p);
    size_t bwd_ws = kda_bwd_workspace_size(p, 0), fwd_ws = kda_fwd_workspace_size(p);
    sizes s;
    s.qk = tokens * p->H * p->K * kda_dtype_size(p->dtype);
    s.v = tokens * p->HV * p->V * kda_dtype_size(p->dtype);
    s.g = tokens * p->HV * p->K * kda_dtype_size(p->g_dtype);
    s.beta = tokens * p->HV * kda_dtype_size(p->beta_dtype);
    s.state = N * p->HV * p->K * p->V * sizeof(float);
    s.work = fwd_ws > bwd_ws ? fwd_ws : bwd_ws;
    return s;
}

/* ------------------------------------------------------------------------- */
/* Data movement. The kernels read and write the backend's memory: host memory
 * for the CPU backend (nothing to move), device memory for the CUDA backend.
 * Every copy between the two goes through these helpers. */

/* Gives the backend's copy of host[0..bytes): the host array itself on the CPU,
 * else device memory from kda_malloc, filled from host when `copy` (inputs) and
 * left as it is otherwise (outputs, workspace). Returns 0 when it cannot. */
static int upload(kda_context *ctx, void **dev, void *host, size_t bytes, int copy)
{
    kda_status st;
    *dev = NULL;
    if (kda_context_backend(ctx) == KDA_BACKEND_CPU) {
        *dev = host;
        return 1;
    }
    if ((st = kda_malloc(ctx, bytes, dev)) != KDA_OK) {
        printf("kda_malloc(%zu bytes) failed: %s: %s\n", bytes, kda_status_string(st), kda_last_error(ctx));
        *dev = NULL;
        return 0;
    }
    if (copy && (st = kda_memcpy(ctx, *dev, host, bytes, KDA_COPY_H2D)) != KDA_OK) {
        printf("kda_memcpy (to the device) failed: %s: %s\n", kda_status_string(st), kda_last_error(ctx));
        return 0;
    }
    return 1;
}

/* Copies the backend's dev[0..bytes) back into host (kda_memcpy to the host
 * returns when the data is there). Returns 0 when it cannot. */
static int download(kda_context *ctx, void *host, const void *dev, size_t bytes)
{
    kda_status st;
    if (kda_context_backend(ctx) == KDA_BACKEND_CPU) {
        if (host != dev) memcpy(host, dev, bytes);
        return 1;
    }
    if ((st = kda_memcpy(ctx, host, dev, bytes, KDA_COPY_D2H)) != KDA_OK) {
        printf("kda_memcpy (to the host) failed: %s: %s\n", kda_status_string(st), kda_last_error(ctx));
        return 0;
    }
    return 1;
}

static int upload_all(kda_context *ctx, const tensors *h, tensors *d, const sizes *s)
{
    return upload(ctx, &d->q, h->q, s->qk, 1) && upload(ctx, &d->k, h->k, s->qk, 1) &&
           upload(ctx, &d->v, h->v, s->v, 1) && upload(ctx, &d->g, h->g, s->g, 1) &&
           upload(ctx, &d->beta, h->beta, s->beta, 1) && upload(ctx, &d->h0, h->h0, s->state, 1) &&
           upload(ctx, &d->o, h->o, s->v, 0) && upload(ctx, &d->ht, h->ht, s->state, 0) &&
           upload(ctx, &d->dout, h->dout, s->v, 1) && upload(ctx, &d->dq, h->dq, s->qk, 0) &&
           upload(ctx, &d->dk, h->dk, s->qk, 0) && upload(ctx, &d->dv, h->dv, s->v, 0) &&
           upload(ctx, &d->dg, h->dg, s->g, 0) && upload(ctx, &d->dbeta, h->dbeta, s->beta, 0) &&
           upload(ctx, &d->dh0, h->dh0, s->state, 0) && upload(ctx, &d->work, h->work, s->work, 0);
}

/* Frees the device copies (nothing to do on the CPU, where they are the host arrays). */
static void free_all(kda_context *ctx, tensors *d)
{
    void *all[] = {d->q,  d->k,  d->v,  d->g,  d->beta, d->h0,  d->o,  d->ht,
                   d->dout, d->dq, d->dk, d->dv, d->dg, d->dbeta, d->dh0, d->work};
    if (kda_context_backend(ctx) != KDA_BACKEND_CPU)
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            if (all[i]) kda_free(ctx, all[i]);
    memset(d, 0, sizeof *d);
}

/* ------------------------------------------------------------------------- */
/* The float64 reference: the token-by-token recurrence of the spec (section 2.1)
 * for sequence b, value head hv, tokens [0, n). Writes o_ref [n, V]. */

static void reference(const kda_problem *p, const tensors *h, int b, int hv, int n, double *o_ref)
{
    const int T = p->T, H = p->H, HV = p->HV, K = p->K, V = p->V;
    const int hq = hv / (HV / H); /* the q/k head of value head hv */
    const uint16_t *q = h->q, *k = h->k, *v = h->v, *beta = h->beta;
    const float *g = h->g, *h0 = h->h0;
    double *S = malloc(sizeof(double) * K * V), qt[KDA_MAX_HEAD_DIM], kt[KDA_MAX_HEAD_DIM],
           e[KDA_MAX_HEAD_DIM];
    const double scale = 1.0 / sqrt((double)K);

    for (int i = 0; i < K * V; i++) S[i] = h0[((size_t)b * HV + hv) * K * V + i];

    for (int t = 0; t < n; t++) {
        size_t row = (size_t)b * T + t; /* token index in [B, T] */
        const uint16_t *qr = q + (row * H + hq) * K, *kr = k + (row * H + hq) * K;
        const uint16_t *vr = v + (row * HV + hv) * V;
        const float *gr = g + (row * HV + hv) * K;
        double bt = kda_bf16_to_f32(beta[row * HV + hv]), sq = 0, sk = 0;

        /* l2norm q and k (eps inside the sqrt), then scale q */
        for (int d = 0; d < K; d++) {
            qt[d] = kda_bf16_to_f32(qr[d]);
            kt[d] = kda_bf16_to_f32(kr[d]);
            sq += qt[d] * qt[d];
            sk += kt[d] * kt[d];
        }
        for (int d = 0; d < K; d++) {
            qt[d] *= scale / sqrt(sq + 1e-6);
            kt[d] /= sqrt(sk + 1e-6);
        }
        /* S <- diag(exp(g_t)) S;  e = v_t - S^T k_t;  S += beta_t k_t e^T;  o_t = S^T q_t */
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) S[i * V + j] *= exp((double)gr[i]);
        for (int j = 0; j < V; j++) {
            double sk_j = 0;
            for (int i = 0; i < K; i++) sk_j += S[i * V + j] * kt[i];
            e[j] = kda_bf16_to_f32(vr[j]) - sk_j;
        }
        for (int i = 0; i < K; i++)
            for (int j = 0; j < V; j++) S[i * V + j] += bt * kt[i] * e[j];
        for (int j = 0; j < V; j++) {
            double oj = 0;
            for (int i = 0; i < K; i++) oj += S[i * V + j] * qt[i];
            o_ref[(size_t)t * V + j] = oj;
        }
    }
    free(S);
}

/* ------------------------------------------------------------------------- */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* The thread count the CPU backend will use, by the library's rule. */
static int cpu_threads(void)
{
    const char *env = getenv("KDA_NUM_THREADS");
    if (env && atoi(env) > 0) return atoi(env);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static int check(kda_context *ctx, kda_status st, const char *what)
{
    if (st == KDA_OK) return 1;
    fprintf(stderr, "%s failed: %s: %s\n", what, kda_status_string(st),
            ctx ? kda_last_error(ctx) : "no context");
    return 0;
}

int main(int argc, char **argv)
{
    int B = 2, T = 4096, H = 8, K = 128, V = 128, force_cpu = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cpu")) force_cpu = 1;
        else if (!strcmp(argv[i], "--T") && i + 1 < argc && atoi(argv[i + 1]) > 0) T = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--cpu] [--T tokens]\n", argv[0]);
            return 2;
        }
    }

    /* 1. The problem: shapes, dtypes and options. */
    kda_problem p = kda_problem_default(B, T, H, K, V); /* HV = H, chunk 64 */
    p.dtype = KDA_BF16;      /* q, k, v, o (and their gradients) */
    p.g_dtype = KDA_F32;     /* g is the precomputed log decay */
    p.beta_dtype = KDA_BF16;
    p.qk_l2norm = 1;
    p.chunk_size = 64;
    const int HV = p.HV;
    const sizes sz = tensor_sizes(&p);

    /* 2. Inputs on the host. */
    tensors host = {0}, dev = {0};
    size_t n_qk = sz.qk / 2, n_v = sz.v / 2, n_g = sz.g / 4, n_beta = sz.beta / 2,
           n_state = sz.state / 4;
    host.q = xmalloc(sz.qk), host.k = xmalloc(sz.qk), host.v = xmalloc(sz.v);
    host.g = xmalloc(sz.g), host.beta = xmalloc(sz.beta), host.h0 = xmalloc(sz.state);
    host.o = xmalloc(sz.v), host.ht = xmalloc(sz.state), host.dout = xmalloc(sz.v);
    host.dq = xmalloc(sz.qk), host.dk = xmalloc(sz.qk), host.dv = xmalloc(sz.v);
    host.dg = xmalloc(sz.g), host.dbeta = xmalloc(sz.beta), host.dh0 = xmalloc(sz.state);
    host.work = xmalloc(sz.work);

    rng r = {0x9E3779B97F4A7C15ULL};
    fill_randn_bf16(host.q, n_qk, &r);
    fill_randn_bf16(host.k, n_qk, &r);
    fill_randn_bf16(host.v, n_v, &r);
    for (size_t i = 0; i < n_g; i++) ((float *)host.g)[i] = (float)logsigmoid(rng_normal(&r));
    for (size_t i = 0; i < n_beta; i++)
        ((uint16_t *)host.beta)[i] = kda_f32_to_bf16((float)sigmoid(rng_normal(&r)));
    for (size_t i = 0; i < n_state; i++) ((float *)host.h0)[i] = (float)rng_normal(&r);
    fill_randn_bf16(host.dout, n_v, &r);

    /* 3. A context: the GPU if we can, else the CPU. */
    kda_context_options opts = {0};
    opts.num_threads = cpu_threads();
    kda_context *ctx = NULL;
    int on_gpu = 0;
    if (!force_cpu) {
        kda_status st = kda_context_create(&ctx, KDA_BACKEND_CUDA, &opts);
        if (st == KDA_OK) {
            on_gpu = upload_all(ctx, &host, &dev, &sz);
            if (!on_gpu) {
                free_all(ctx, &dev);
                printf("cannot set up the GPU buffers; falling back to the CPU\n");
            }
        } else {
            printf("no CUDA backend (%s); falling back to the CPU\n",
                   ctx ? kda_last_error(ctx) : kda_status_string(st));
        }
        if (!on_gpu && ctx) {
            kda_context_destroy(ctx);
            ctx = NULL;
        }
    }
    if (!on_gpu) {
        kda_status st = kda_context_create(&ctx, KDA_BACKEND_CPU, &opts);
        if (!check(ctx, st, "kda_context_create")) return 1;
        upload_all(ctx, &host, &dev, &sz); /* the CPU uses the host arrays themselves */
    }
    /* Optional: one workspace for every call, so the timed calls do not allocate. */
    kda_set_workspace(ctx, dev.work, sz.work);

    printf("backend : %s", on_gpu ? "cuda" : "cpu");
    if (!on_gpu) printf(", %d threads", opts.num_threads);
    printf("\nproblem : B=%d T=%d H=%d K=%d V=%d, %s q/k/v/o, fp32 g, %s beta, fp32 state, "
           "qk l2norm, chunk %d\n",
           B, T, H, K, V, kda_dtype_name(p.dtype), kda_dtype_name(p.beta_dtype), p.chunk_size);

    /* 4. On the GPU, compile (or load from the cache) every kernel this problem
     *    needs before timing anything; without this the first call would wait
     *    for NVRTC. On the CPU there is nothing to prepare. */
    if (on_gpu) {
        double tw = now_ms();
        if (!check(ctx, kda_warmup(ctx, &p), "kda_warmup")) return 1;
        printf("warm-up : %.0f ms (kda_warmup: kernels compiled or loaded from the cache)\n", now_ms() - tw);
    }

    /* 5. Forward: one warm-up call, then one timed call. GPU calls return before
     *    the kernels finish, so the timing waits with kda_synchronize. */
    kda_inputs in = {0};
    in.q = dev.q, in.k = dev.k, in.v = dev.v, in.g = dev.g, in.beta = dev.beta, in.h0 = dev.h0;
    kda_fwd_outputs out = {0};
    out.o = dev.o, out.ht = dev.ht;
    if (!check(ctx, kda_chunk_fwd(ctx, &p, &in, &out), "kda_chunk_fwd")) return 1;
    if (!check(ctx, kda_synchronize(ctx), "kda_synchronize")) return 1;
    double t0 = now_ms();
    if (!check(ctx, kda_chunk_fwd(ctx, &p, &in, &out), "kda_chunk_fwd")) return 1;
    if (!check(ctx, kda_synchronize(ctx), "kda_synchronize")) return 1;
    double fwd_ms = now_ms() - t0;
    if (!download(ctx, host.o, dev.o, sz.v) || !download(ctx, host.ht, dev.ht, sz.state)) return 1;

    /* 6. Check o against the float64 recurrence on a slice: sequence 0, the
     *    first 256 tokens, the first and the last value head. */
    int n = T < 256 ? T : 256, heads[2] = {0, HV - 1};
    double *o_ref = xmalloc(sizeof(double) * n * V), d2 = 0, r2 = 0;
    for (int hi = 0; hi < 2; hi++) {
        reference(&p, &host, 0, heads[hi], n, o_ref);
        for (int t = 0; t < n; t++)
            for (int j = 0; j < V; j++) {
                double x = kda_bf16_to_f32(((uint16_t *)host.o)[((size_t)t * HV + heads[hi]) * V + j]);
                double ref = o_ref[(size_t)t * V + j];
                d2 += (ref - x) * (ref - x);
                r2 += ref * ref;
            }
    }
    double err = sqrt(d2 / r2), tol = 1e-2; /* RMS(ref - o) / RMS(ref) */
    int pass = err < tol; /* NaN fails too */
    printf("check   : o vs float64 recurrence (seq 0, tokens 0-%d, heads %d and %d): "
           "error ratio %.2e (tol %.0e) %s\n",
           n - 1, heads[0], heads[1], err, tol, pass ? "PASS" : "FAIL");

    /* FLOPs of the chunked forward, per head: 6 T d^2 + 3 T C d + T C^2. */
    double C = p.chunk_size, d = K;
    double flops = (double)B * HV * (6.0 * T * d * d + 3.0 * T * C * d + T * C * C);
    printf("forward : %.2f ms, %.0f tokens/s, %.1f GFLOP/s\n", fwd_ms, B * T / (fwd_ms * 1e-3),
           flops / (fwd_ms * 1e-3) / 1e9);

    /* 7. Backward: gradients of q, k, v, g, beta and h0 for the loss sum(o * dout).
     *    With saved = NULL it recomputes the forward's intermediates; a forward run
     *    with kda_fwd_outputs.saved (kda_fwd_saved_size bytes) spares that. */
    kda_bwd_io io = {0};
    io.dout = dev.dout, io.dq = dev.dq, io.dk = dev.dk, io.dv = dev.dv, io.dg = dev.dg;
    io.dbeta = dev.dbeta, io.dh0 = dev.dh0;
    t0 = now_ms();
    if (!check(ctx, kda_chunk_bwd(ctx, &p, &in, &io), "kda_chunk_bwd")) return 1;
    if (!check(ctx, kda_synchronize(ctx), "kda_synchronize")) return 1;
    double bwd_ms = now_ms() - t0;
    printf("backward: %.2f ms (first call, recomputes the forward)\n", bwd_ms);

    free_all(ctx, &dev);
    kda_context_destroy(ctx);
    free(o_ref);
    void *all[] = {host.q, host.k, host.v, host.g, host.beta, host.h0, host.o, host.ht, host.dout,
                   host.dq, host.dk, host.dv, host.dg, host.dbeta, host.dh0, host.work};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
    return pass ? 0 : 1;
}
