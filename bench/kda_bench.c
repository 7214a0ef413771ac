/* kda_bench.c - forward and backward throughput of the chunked KDA path.
 *
 *     cc -std=c11 -O3 -march=native bench/kda_bench.c -o kda-bench -lm -lpthread -ldl
 *     ./kda-bench --device cpu [--reps N] [--threads N]
 *
 * Prints one JSON line per (shape, op):
 *     {"device":"cpu","op":"fwd"|"bwd","shape":{"B":..,"T":..,"H":..,"K":..,"V":..,
 *      "varlen":[cu_seqlens] or null},"dtype":"bf16","ms_median":..,"ms_min":..,
 *      "tokens_per_s":..,"gflops":..,"threads":..,"flop_model":".."}
 * ms_median and ms_min are over --reps timed calls (default 5) after one warm-up.
 * Inputs: bf16 q/k/v (randn), fp32 g = logsigmoid(randn), bf16 beta = sigmoid(randn),
 * fp32 random initial state, qk l2norm in the kernel, chunk 64. The forward also
 * writes the final state; the backward gets dout (randn), no dht, no saved buffer
 * (so it recomputes the forward's intermediates), and writes every gradient
 * including dh0. One workspace is set up front, so no timed call allocates.
 *
 * FLOP model (the one in ANCHORS.md, generalised to K != V):
 *   forward  = HV * sum over sequences n of  6*T_n*K*V + 3*T_n*C*(K+V)/2 + T_n*C^2
 *              (C = chunk size; for K = V = d this is 6 T d^2 + 3 T C d + T C^2 per head)
 *   backward = 3 x forward: twice the forward's FLOPs for the gradients, plus the
 *              forward recompute.
 *
 * --device gpu prints {"device":"gpu","error":"..."} and exits 2 when no CUDA
 * context can be created (and, for now, also when one can: the benchmark has no
 * device buffers yet).
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

#define FLOP_MODEL                                                                            \
    "fwd = HV * sum_n (6*T_n*K*V + 3*T_n*C*(K+V)/2 + T_n*C^2), C = chunk; bwd = 3 * fwd "    \
    "(2x fwd for the gradients + the fwd recompute)"

typedef struct shape {
    int B, T, H, K, V;
    const int32_t *cu_seqlens; /* NULL, or num_seqs + 1 entries (B = 1) */
    int num_seqs;
} shape;

static const int32_t varlen_mix[] = {0, 100, 1124, 1200, 3000, 4096};

static const shape shapes[] = {
    {1, 4096, 4, 128, 128, NULL, 0},
    {1, 4096, 4, 128, 128, varlen_mix, 5},
};

/* ------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;

static double randn(void) /* xorshift64* + Box-Muller */
{
    double u[2];
    for (int i = 0; i < 2; i++) {
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        u[i] = ((double)((rng_state * 0x2545F4914F6CDD1DULL) >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "kda-bench: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static uint16_t *randn_bf16(size_t n)
{
    uint16_t *x = xmalloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = kda_f32_to_bf16((float)randn());
    return x;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Writes s as a JSON string body (without the quotes). */
static void json_escape(FILE *f, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c == '\n') fputs("\\n", f);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
}

static void fail(kda_context *ctx, kda_status st, const char *what)
{
    fprintf(stderr, "kda-bench: %s failed: %s: %s\n", what, kda_status_string(st),
            ctx ? kda_last_error(ctx) : "no context");
    exit(1);
}

/* ------------------------------------------------------------------------- */

static double fwd_flops(const kda_problem *p, const int32_t *cu)
{
    double C = p->chunk_size, K = p->K, V = p->V, total = 0;
    int N = kda_num_seqs(p);
    for (int n = 0; n < N; n++) {
        double Tn = cu ? (double)(cu[n + 1] - cu[n]) : p->T;
        total += 6.0 * Tn * K * V + 3.0 * Tn * C * (K + V) / 2.0 + Tn * C * C;
    }
    return total * p->HV;
}

static void print_line(const char *op, const shape *s, double ms_median, double ms_min,
                       double flops, int threads)
{
    printf("{\"device\":\"cpu\",\"op\":\"%s\",\"shape\":{\"B\":%d,\"T\":%d,\"H\":%d,\"K\":%d,\"V\":%d,"
           "\"varlen\":",
           op, s->B, s->T, s->H, s->K, s->V);
    if (s->cu_seqlens) {
        for (int i = 0; i <= s->num_seqs; i++)
            printf("%c%d", i ? ',' : '[', (int)s->cu_seqlens[i]);
        printf("]");
    } else {
        printf("null");
    }
    printf("},\"dtype\":\"bf16\",\"ms_median\":%.3f,\"ms_min\":%.3f,\"tokens_per_s\":%.0f,"
           "\"gflops\":%.2f,\"threads\":%d,\"flop_model\":\"%s\"}\n",
           ms_median, ms_min, (double)s->B * s->T / (ms_median * 1e-3),
           flops / (ms_median * 1e-3) / 1e9, threads, FLOP_MODEL);
    fflush(stdout);
}

typedef kda_status (*op_fn)(kda_context *, const kda_problem *, const kda_inputs *, const void *);

static kda_status run_fwd(kda_context *ctx, const kda_problem *p, const kda_inputs *in, const void *out)
{
    return kda_chunk_fwd(ctx, p, in, out);
}

static kda_status run_bwd(kda_context *ctx, const kda_problem *p, const kda_inputs *in, const void *io)
{
    return kda_chunk_bwd(ctx, p, in, io);
}

/* One warm-up call, then reps timed calls; returns the median, *ms_min the fastest. */
static double time_op(kda_context *ctx, op_fn fn, const char *name, const kda_problem *p,
                      const kda_inputs *in, const void *outs, int reps, double *ms_min)
{
    double *ms = xmalloc(sizeof(double) * reps), med;
    kda_status st = fn(ctx, p, in, outs);
    if (st != KDA_OK) fail(ctx, st, name);
    for (int r = 0; r < reps; r++) {
        double t0 = now_ms();
        st = fn(ctx, p, in, outs);
        ms[r] = now_ms() - t0;
        if (st != KDA_OK) fail(ctx, st, name);
    }
    qsort(ms, reps, sizeof(double), cmp_double);
    med = reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
    *ms_min = ms[0];
    free(ms);
    return med;
}

static void bench_shape(kda_context *ctx, const shape *s, int reps, int threads)
{
    kda_problem p = kda_problem_default(s->B, s->T, s->H, s->K, s->V);
    p.dtype = KDA_BF16;
    p.g_dtype = KDA_F32;
    p.beta_dtype = KDA_BF16;
    p.qk_l2norm = 1;
    p.chunk_size = 64;
    if (s->cu_seqlens) {
        p.num_seqs = s->num_seqs;
        p.seqlens_type = KDA_INDEX_I32;
    }
    kda_status st = kda_problem_check(ctx, &p);
    if (st != KDA_OK) fail(ctx, st, "kda_problem_check");

    size_t tok = (size_t)p.B * p.T, N = (size_t)kda_num_seqs(&p);
    size_t n_qk = tok * p.H * p.K, n_v = tok * p.HV * p.V, n_g = tok * p.HV * p.K;
    size_t n_beta = tok * p.HV, n_state = N * p.HV * p.K * p.V;

    uint16_t *q = randn_bf16(n_qk), *k = randn_bf16(n_qk), *v = randn_bf16(n_v);
    uint16_t *dout = randn_bf16(n_v), *beta = xmalloc(n_beta * 2);
    float *g = xmalloc(n_g * 4), *h0 = xmalloc(n_state * 4);
    for (size_t i = 0; i < n_g; i++) {
        double x = randn();
        g[i] = (float)(fmin(x, 0.0) - log1p(exp(-fabs(x)))); /* logsigmoid */
    }
    for (size_t i = 0; i < n_beta; i++) beta[i] = kda_f32_to_bf16((float)(1.0 / (1.0 + exp(-randn()))));
    for (size_t i = 0; i < n_state; i++) h0[i] = (float)randn();

    void *o = xmalloc(n_v * 2), *dq = xmalloc(n_qk * 2), *dk = xmalloc(n_qk * 2);
    void *dv = xmalloc(n_v * 2), *dg = xmalloc(n_g * 4), *dbeta = xmalloc(n_beta * 2);
    float *ht = xmalloc(n_state * 4), *dh0 = xmalloc(n_state * 4);

    size_t ws_f = kda_fwd_workspace_size(&p), ws_b = kda_bwd_workspace_size(&p, 0);
    size_t ws_bytes = ws_f > ws_b ? ws_f : ws_b;
    void *ws = xmalloc(ws_bytes);
    kda_set_workspace(ctx, ws, ws_bytes);

    kda_inputs in = {0};
    in.q = q, in.k = k, in.v = v, in.g = g, in.beta = beta, in.h0 = h0, in.cu_seqlens = s->cu_seqlens;
    kda_fwd_outputs out = {0};
    out.o = o, out.ht = ht;
    kda_bwd_io io = {0};
    io.dout = dout, io.dq = dq, io.dk = dk, io.dv = dv, io.dg = dg, io.dbeta = dbeta, io.dh0 = dh0;

    double flops = fwd_flops(&p, s->cu_seqlens), ms_min, ms;
    ms = time_op(ctx, run_fwd, "kda_chunk_fwd", &p, &in, &out, reps, &ms_min);
    print_line("fwd", s, ms, ms_min, flops, threads);
    ms = time_op(ctx, run_bwd, "kda_chunk_bwd", &p, &in, &io, reps, &ms_min);
    print_line("bwd", s, ms, ms_min, 3.0 * flops, threads);

    kda_set_workspace(ctx, NULL, 0);
    void *all[] = {q, k, v, dout, beta, g, h0, o, dq, dk, dv, dg, dbeta, ht, dh0, ws};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

static int usage(void)
{
    fprintf(stderr, "usage: kda-bench --device cpu|gpu [--reps N] [--threads N]\n");
    return 1;
}

int main(int argc, char **argv)
{
    const char *device = "cpu";
    int reps = 5, threads = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--device")) device = argv[i + 1];
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else return usage();
    }
    if (argc % 2 == 0 || reps < 1 || threads < 0) return usage();

    if (!strcmp(device, "gpu")) {
        kda_context *ctx = NULL;
        kda_status st = kda_context_create(&ctx, KDA_BACKEND_CUDA, NULL);
        printf("{\"device\":\"gpu\",\"error\":\"");
        if (st != KDA_OK) {
            const char *msg = ctx ? kda_last_error(ctx) : "";
            json_escape(stdout, *msg ? msg : kda_status_string(st));
        } else {
            printf("the GPU benchmark needs device buffers, not wired yet");
        }
        printf("\"}\n");
        if (ctx) kda_context_destroy(ctx);
        return 2;
    }
    if (strcmp(device, "cpu")) return usage();

    /* Threads: --threads, else $KDA_NUM_THREADS, else all online cores (the library's rule). */
    if (threads == 0) {
        const char *env = getenv("KDA_NUM_THREADS");
        long n = env && atoi(env) > 0 ? atoi(env) : sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (int)n : 1;
    }
    kda_context_options opts = {0};
    opts.num_threads = threads;
    kda_context *ctx = NULL;
    kda_status st = kda_context_create(&ctx, KDA_BACKEND_CPU, &opts);
    if (st != KDA_OK) fail(ctx, st, "kda_context_create");

    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) bench_shape(ctx, &shapes[i], reps, threads);

    kda_context_destroy(ctx);
    return 0;
}
