/* kda_bench.c - throughput of the chunked KDA path (CPU and GPU), decode on the
 * GPU, and the cost of compiling or loading the GPU kernels.
 *
 *     cc -std=c11 -O3 -march=native bench/kda_bench.c -o kda-bench -lm -lpthread -ldl
 *     ./kda-bench --device cpu [--reps N] [--threads N] [--ops fwd,bwd] [--shape B,T,H,K,V [--seqlens L1,..]]
 *     ./kda-bench --device gpu [--reps N] [--peak-gbps X] [--ops fwd,bwd,decode]
 *     (any of them: --dtype f16 for fp16 q, k, v, beta and o instead of bf16; gpu:
 *      --g-dtype act for g in that dtype too, as a model's gate projection gives it)
 *     ./kda-bench --jit [--arch sm_90a] [--threads N]
 *
 * Prints one JSON line per (shape, op):
 *     {"device":"cpu","op":"fwd"|"bwd","shape":{"B":..,"T":..,"H":..,"K":..,"V":..,
 *      "varlen":[cu_seqlens] or null},"dtype":"bf16","ms_median":..,"ms_min":..,
 *      "tokens_per_s":..,"gflops":..,"threads":..,"flop_model":".."}
 * CPU: ms_median and ms_min are over --reps timed calls (default 5) after one warm-up.
 * Inputs: bf16 (--dtype) q/k/v (randn), fp32 g = logsigmoid(randn) (--gate kimi, GPU: the softplus gate of
 * raw g = randn with Kimi Linear's initialisation, A_log = log U(1, 16) per head and
 * dt_bias = log(expm1(dt)), dt = exp U(log 1e-3, log 1e-1) per channel: some channels
 * then keep their state for thousands of tokens; --gate lb5, GPU: the lower-bound gate at -5
 * of raw g = randn + 3, most tokens near the bound, so that chunks span the widest gate
 * range the bounded gate allows), bf16 (--dtype) beta = sigmoid(randn),
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
 *   decode   = 7*K*V per (token, head): decay, S^T k, the rank-1 update, S^T q.
 *
 * --device gpu: the shapes of ANCHORS.md (same inputs and options as the CPU) and
 * decode (one token per sequence, N = 1, 32, 256 sequences, H = 32, K = V = 128,
 * the fp32 state in a pool of N slots updated in place; --decode-n one N, --pool-dtype bf16
 * a bf16 pool). --state pool: the forward in its pool form too (prefill into a state pool of N
 * slots, slot n for sequence n, fp32 or --pool-dtype's; its lines say "state":"pool"), not from
 * h0 into ht. All buffers are device
 * memory (kda_malloc) with one workspace set up front. --shape B,T,H,K,V times that
 * one shape instead (profiling). Timing: CUDA events on the
 * default stream (the stream kda uses unless kda_set_stream says otherwise), 2
 * warm-up calls, then --reps timed calls (default 10), each between two events.
 * The lines carry the CPU lines' fields ("threads" is null) plus
 *     "gpu": device name, "host_ms": the median time of one call on the host (what kda
 *     does before its kernels run: checks, the plan, launches; the GPU waits for it here),
 *     "bytes": the model below, "gbps": bytes / ms_median,
 *     "peak_gbps": the copy bandwidth the roofline uses (4300, an H200's device
 *     copy; --peak-gbps overrides it), "roofline_fraction": (bytes / peak) / ms_median.
 * Bytes model: each tensor the operation must touch, once:
 *     fwd    reads q, k, v, g, beta and writes o (h0 and ht left out)
 *     bwd    reads q, k, v, g, beta, dout and writes dq, dk, dv, dg, dbeta (h0, dh0 left out)
 *     decode reads and writes the state (fp32, or bf16), reads q, k, v, g, beta and writes o
 * A shape that does not fit in memory or fails prints {"device":"gpu",..,"error":".."}
 * and the run goes on. Without a usable GPU it prints {"device":"gpu","error":".."}
 * and exits 2.
 *
 * --jit (no GPU needed, only NVRTC): the kernels kda_kernels_needed lists for
 * B1 T4096 H4 K=V=128 bf16 (fp32 g, bf16 beta), chunk 64, l2norm (a forward, a
 * backward and a decode), for --arch (default sm_90a):
 *     {"jit":"kernel",..}         each kernel's NVRTC compile time and cubin size
 *     {"jit":"cold_compile",..}   wall time to compile them all through
 *                                 kda_compile_kernel, one thread per core (--threads)
 *     {"jit":"aot_load",..}       kda.h's own lookup of them all from KDA_CUBIN_DIR: read
 *                                 and SHA-256 verify (page cache hot), no GPU, so no
 *                                 cuModuleLoadData
 *     {"jit":"cache_load",..}     the same from the disk cache
 * and, when a CUDA context can be created (its arch must be --arch), the library's
 * own path through kda_warmup on fresh contexts:
 *     {"jit":"warmup_nvrtc",..}     empty disk cache, no KDA_CUBIN_DIR: NVRTC + load
 *     {"jit":"warmup_cubin_dir",..} KDA_CUBIN_DIR = the folder above: read + verify + load
 *     {"jit":"warmup_disk_cache",..} the cache the first run filled: read + verify + load
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, mkdtemp, setenv */
#define KDA_IMPLEMENTATION
#include "../kda.h"

#include <dirent.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FLOP_MODEL                                                                            \
    "fwd = HV * sum_n (6*T_n*K*V + 3*T_n*C*(K+V)/2 + T_n*C^2), C = chunk; bwd = 3 * fwd "    \
    "(2x fwd for the gradients + the fwd recompute)"
#define FLOP_MODEL_DECODE "decode = 7*K*V per (token, head)"
#define BYTES_MODEL_FWD "read q,k,v,g,beta + write o, once"
#define BYTES_MODEL_BWD "read q,k,v,g,beta,dout + write dq,dk,dv,dg,dbeta, once"
#define BYTES_MODEL_DECODE "fp32 state read + written, read q,k,v,g,beta + write o, once"

typedef struct shape {
    int B, T, H, K, V;
    const int32_t *cu_seqlens; /* NULL, or num_seqs + 1 entries (B = 1) */
    int num_seqs;
} shape;

static const int32_t varlen_mix[] = {0, 100, 1124, 1200, 3000, 4096};
static shape g_shape;                        /* --shape B,T,H,K,V: this one instead of the table */
static const char *g_ops = "fwd,bwd,decode"; /* --ops: which operations to time (decode: GPU only) */

static const shape shapes[] = {
    {1, 4096, 4, 128, 128, NULL, 0},
    {1, 4096, 4, 128, 128, varlen_mix, 5},
};

/* ANCHORS.md's shapes (FLA measured on an H200). */
static const shape gpu_shapes[] = {
    {1, 8192, 32, 128, 128, NULL, 0},
    {8, 4096, 16, 128, 128, NULL, 0},
    {1, 65536, 16, 128, 128, NULL, 0},
    {4, 4096, 32, 64, 64, NULL, 0},
    {2, 8192, 16, 128, 256, NULL, 0},
};
static const int decode_N[] = {1, 32, 256};
static int g_decode_n;     /* --decode-n: this one N instead of decode_N */
static int g_pool_bf16;    /* --pool-dtype bf16: the decode pool (and --state pool's) in bf16 */
static int g_fwd_pool;     /* --state pool: the forward in its pool form */
#define DECODE_H 32
#define DECODE_D 128

/* ------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;

static double urand(void) /* xorshift64*, uniform in (0, 1) */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return ((double)((rng_state * 0x2545F4914F6CDD1DULL) >> 11) + 0.5) / 9007199254740992.0;
}

static double randn(void) /* Box-Muller */
{
    double u0 = urand(), u1 = urand();
    return sqrt(-2.0 * log(u0)) * cos(6.283185307179586 * u1);
}

static double logsigmoid(double x) { return fmin(x, 0.0) - log1p(exp(-fabs(x))); }

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "kda-bench: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static kda_dtype g_dtype = KDA_BF16; /* --dtype: of q, k, v, beta, o (and the gradients) */

static uint16_t to16(double x) { return g_dtype == KDA_F16 ? kda_f32_to_f16((float)x) : kda_f32_to_bf16((float)x); }

static uint16_t *randn16(size_t n)
{
    uint16_t *x = xmalloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = to16(randn());
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

static double median(double *ms, int n) /* sorts ms */
{
    qsort(ms, n, sizeof(double), cmp_double);
    return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
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

static int online_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
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

/* The problem every benchmark uses: bf16 (--dtype) q/k/v and beta, fp32 g, l2norm, chunk 64. */
static kda_problem bench_problem(const shape *s)
{
    kda_problem p = kda_problem_default(s->B, s->T, s->H, s->K, s->V);
    p.dtype = g_dtype;
    p.g_dtype = KDA_F32;
    p.beta_dtype = g_dtype;
    p.qk_l2norm = 1;
    p.chunk_size = 64;
    if (s->cu_seqlens) {
        p.num_seqs = s->num_seqs;
        p.seqlens_type = KDA_INDEX_I32;
    }
    return p;
}

/* {"device":..,"op":..,"shape":{..},"dtype":"bf16"|"f16" - the common head of a line (no closing brace). */
static void print_head(const char *device, const char *op, const shape *s)
{
    printf("{\"device\":\"%s\",\"op\":\"%s\",\"shape\":{\"B\":%d,\"T\":%d,\"H\":%d,\"K\":%d,\"V\":%d,"
           "\"varlen\":",
           device, op, s->B, s->T, s->H, s->K, s->V);
    if (s->cu_seqlens) {
        for (int i = 0; i <= s->num_seqs; i++)
            printf("%c%d", i ? ',' : '[', (int)s->cu_seqlens[i]);
        printf("]");
    } else {
        printf("null");
    }
    printf("},\"dtype\":\"%s\"", kda_dtype_name(g_dtype));
}

static void print_line(const char *op, const shape *s, double ms_median, double ms_min,
                       double flops, int threads)
{
    print_head("cpu", op, s);
    printf(",\"ms_median\":%.3f,\"ms_min\":%.3f,\"tokens_per_s\":%.0f,"
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

static kda_status run_rec(kda_context *ctx, const kda_problem *p, const kda_inputs *in, const void *io)
{
    return kda_recurrent_fwd(ctx, p, in, io);
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
    med = median(ms, reps);
    *ms_min = ms[0];
    free(ms);
    return med;
}

static void bench_shape(kda_context *ctx, const shape *s, int reps, int threads)
{
    kda_problem p = bench_problem(s);
    kda_status st = kda_problem_check(ctx, &p);
    if (st != KDA_OK) fail(ctx, st, "kda_problem_check");

    size_t tok = (size_t)p.B * p.T, N = (size_t)kda_num_seqs(&p);
    size_t n_qk = tok * p.H * p.K, n_v = tok * p.HV * p.V, n_g = tok * p.HV * p.K;
    size_t n_beta = tok * p.HV, n_state = N * p.HV * p.K * p.V;

    uint16_t *q = randn16(n_qk), *k = randn16(n_qk), *v = randn16(n_v);
    uint16_t *dout = randn16(n_v), *beta = xmalloc(n_beta * 2);
    float *g = xmalloc(n_g * 4), *h0 = xmalloc(n_state * 4);
    for (size_t i = 0; i < n_g; i++) g[i] = (float)logsigmoid(randn());
    for (size_t i = 0; i < n_beta; i++) beta[i] = to16(1.0 / (1.0 + exp(-randn())));
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
    if (strstr(g_ops, "fwd")) {
        ms = time_op(ctx, run_fwd, "kda_chunk_fwd", &p, &in, &out, reps, &ms_min);
        print_line("fwd", s, ms, ms_min, flops, threads);
    }
    if (strstr(g_ops, "bwd")) {
        ms = time_op(ctx, run_bwd, "kda_chunk_bwd", &p, &in, &io, reps, &ms_min);
        print_line("bwd", s, ms, ms_min, 3.0 * flops, threads);
    }

    kda_set_workspace(ctx, NULL, 0);
    void *all[] = {q, k, v, dout, beta, g, h0, o, dq, dk, dv, dg, dbeta, ht, dh0, ws};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

/* ===================================================================== GPU
 * CUDA events from libcuda, loaded here with dlopen (kda links nothing). kda
 * pushes its device's primary context around each call and pops it after, so
 * the benchmark makes that same primary context current for its own thread. */

typedef int cu_result;
typedef void *cu_event;
typedef void *cu_stream;
typedef void *cu_context;
typedef int cu_device;

static struct {
    void *lib;
    cu_context pctx;
    cu_device dev;
    char name[256];
    cu_result (*init)(unsigned);
    cu_result (*device_get)(cu_device *, int);
    cu_result (*device_name)(char *, int, cu_device);
    cu_result (*primary_retain)(cu_context *, cu_device);
    cu_result (*primary_release)(cu_device);
    cu_result (*ctx_push)(cu_context);
    cu_result (*ctx_pop)(cu_context *);
    cu_result (*event_create)(cu_event *, unsigned);
    cu_result (*event_record)(cu_event, cu_stream);
    cu_result (*event_sync)(cu_event);
    cu_result (*event_elapsed)(float *, cu_event, cu_event);
    cu_result (*event_destroy)(cu_event);
    cu_result (*error_string)(cu_result, const char **);
    cu_event ev[2];
} cu;

static char gpu_err[2600];

static const char *cu_msg(cu_result r)
{
    const char *s = NULL;
    if (!cu.error_string || cu.error_string(r, &s) != 0 || !s) s = "unknown CUDA error";
    return s;
}

/* 0, or -1 with gpu_err set. The device is kda's default (ordinal 0). */
static int cu_open(void)
{
    cu_result r;
    cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cu.lib) {
        snprintf(gpu_err, sizeof gpu_err, "cannot load libcuda.so.1 for CUDA events: %s", dlerror());
        return -1;
    }
/* the symbol a, else the older name b (NULL: none) */
#define SYM(field, a, b)                                                                          \
    *(void **)&cu.field = dlsym(cu.lib, a);                                                       \
    if (!cu.field && b) *(void **)&cu.field = dlsym(cu.lib, b ? b : a);                           \
    if (!cu.field) {                                                                              \
        snprintf(gpu_err, sizeof gpu_err, "libcuda.so.1 has no %s", a);                           \
        return -1;                                                                                \
    }
    SYM(init, "cuInit", NULL);
    SYM(device_get, "cuDeviceGet", NULL);
    SYM(device_name, "cuDeviceGetName", NULL);
    SYM(primary_retain, "cuDevicePrimaryCtxRetain", NULL);
    SYM(primary_release, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
    SYM(ctx_push, "cuCtxPushCurrent_v2", "cuCtxPushCurrent");
    SYM(ctx_pop, "cuCtxPopCurrent_v2", "cuCtxPopCurrent");
    SYM(event_create, "cuEventCreate", NULL);
    SYM(event_record, "cuEventRecord", NULL);
    SYM(event_sync, "cuEventSynchronize", NULL);
    SYM(event_elapsed, "cuEventElapsedTime", NULL);
    SYM(event_destroy, "cuEventDestroy_v2", "cuEventDestroy");
    SYM(error_string, "cuGetErrorString", NULL);
#undef SYM
    const char *step = "cuInit";
    if ((r = cu.init(0)) || (step = "cuDeviceGet", r = cu.device_get(&cu.dev, 0)) ||
        (step = "cuDevicePrimaryCtxRetain", r = cu.primary_retain(&cu.pctx, cu.dev))) {
        snprintf(gpu_err, sizeof gpu_err, "%s: %s", step, cu_msg(r));
        return -1;
    }
    if ((r = cu.ctx_push(cu.pctx)) || (step = "cuEventCreate", r = cu.event_create(&cu.ev[0], 0)) ||
        (r = cu.event_create(&cu.ev[1], 0))) {
        snprintf(gpu_err, sizeof gpu_err, "%s: %s", step, cu_msg(r));
        return -1;
    }
    if (cu.device_name(cu.name, sizeof cu.name, cu.dev) != 0) snprintf(cu.name, sizeof cu.name, "?");
    return 0;
}

static void cu_close(void)
{
    cu_context dummy;
    if (!cu.lib) return;
    for (int i = 0; i < 2; i++)
        if (cu.ev[i]) cu.event_destroy(cu.ev[i]);
    if (cu.pctx) {
        cu.ctx_pop(&dummy);
        cu.primary_release(cu.dev);
    }
    dlclose(cu.lib);
    memset(&cu, 0, sizeof cu);
}

/* 2 warm-up calls, then reps calls each between two events on the default
 * stream. 0 with *med, *mn and g_host_ms set; -1 with gpu_err set. */
static double g_host_ms; /* the median time one call takes on the host (gpu_time's last) */
static int gpu_time(kda_context *ctx, op_fn fn, const char *name, const kda_problem *p, const kda_inputs *in,
                    const void *outs, int reps, double *med, double *mn)
{
    double *ms = xmalloc(sizeof(double) * reps), *host = xmalloc(sizeof(double) * reps);
    kda_status st;
    cu_result r = 0;
    int rc = -1;
    for (int w = 0; w < 2; w++)
        if ((st = fn(ctx, p, in, outs)) != KDA_OK) goto kda_fail;
    if ((st = kda_synchronize(ctx)) != KDA_OK) {
        name = "kda_synchronize (after the warm-up calls)";
        goto kda_fail;
    }
    for (int i = 0; i < reps; i++) {
        float t = 0;
        double h0;
        if ((r = cu.event_record(cu.ev[0], NULL))) goto cu_fail;
        h0 = now_ms();
        if ((st = fn(ctx, p, in, outs)) != KDA_OK) goto kda_fail;
        host[i] = now_ms() - h0;
        if ((r = cu.event_record(cu.ev[1], NULL)) || (r = cu.event_sync(cu.ev[1])) ||
            (r = cu.event_elapsed(&t, cu.ev[0], cu.ev[1])))
            goto cu_fail;
        ms[i] = t;
    }
    *med = median(ms, reps);
    *mn = ms[0];
    g_host_ms = median(host, reps);
    rc = 0;
    goto done;
kda_fail:
    snprintf(gpu_err, sizeof gpu_err, "%s: %s: %s", name, kda_status_string(st), kda_last_error(ctx));
    goto done;
cu_fail:
    snprintf(gpu_err, sizeof gpu_err, "CUDA event timing around %s: %s", name, cu_msg(r));
done:
    free(ms);
    free(host);
    return rc;
}

/* Device buffers of one benchmark, freed together. */
typedef struct dbufs { void *p[24]; int n; } dbufs;

static void dfree_all(kda_context *ctx, dbufs *b)
{
    for (int i = 0; i < b->n; i++) kda_free(ctx, b->p[i]);
    b->n = 0;
}

/* Device memory of `bytes`, filled from host when host != NULL. NULL with gpu_err set. */
static void *dalloc(kda_context *ctx, dbufs *b, size_t bytes, const void *host)
{
    void *d = NULL;
    kda_status st = kda_malloc(ctx, bytes, &d);
    if (st != KDA_OK) {
        snprintf(gpu_err, sizeof gpu_err, "kda_malloc(%zu bytes): %s: %s", bytes, kda_status_string(st), kda_last_error(ctx));
        return NULL;
    }
    b->p[b->n++] = d;
    if (host && (st = kda_memcpy(ctx, d, host, bytes, KDA_COPY_H2D)) != KDA_OK) {
        snprintf(gpu_err, sizeof gpu_err, "kda_memcpy(%zu bytes, H2D): %s: %s", bytes, kda_status_string(st), kda_last_error(ctx));
        return NULL;
    }
    return d;
}

/* Random tensors for large shapes, cheaply: a pool of values drawn once, tiled
 * from a random offset per 4096-element block (the timings do not depend on
 * the values; the pools give the same distributions as the CPU benchmark). */
#define POOL_N (1 << 20)
static uint16_t *pool_randn16, *pool_sigmoid16, *pool_logsig16;
static float *pool_logsig, *pool_randn_f32;

static void pools_init(void)
{
    if (pool_randn16) return;
    pool_randn16 = xmalloc(POOL_N * 2), pool_sigmoid16 = xmalloc(POOL_N * 2), pool_logsig16 = xmalloc(POOL_N * 2);
    pool_logsig = xmalloc(POOL_N * 4), pool_randn_f32 = xmalloc(POOL_N * 4);
    for (size_t i = 0; i < POOL_N; i++) {
        pool_randn16[i] = to16(randn());
        pool_sigmoid16[i] = to16(1.0 / (1.0 + exp(-randn())));
        pool_logsig[i] = (float)logsigmoid(randn());
        pool_logsig16[i] = to16(pool_logsig[i]);
        pool_randn_f32[i] = (float)randn();
    }
}

static void pools_free(void)
{
    free(pool_randn16), free(pool_sigmoid16), free(pool_logsig16), free(pool_logsig), free(pool_randn_f32);
    pool_randn16 = pool_sigmoid16 = pool_logsig16 = NULL;
    pool_logsig = pool_randn_f32 = NULL;
}

/* n elements of es bytes tiled from pool (POOL_N elements). */
static void *tile(const void *pool, size_t n, size_t es)
{
    unsigned char *x = xmalloc(n * es);
    const size_t blk = 4096;
    for (size_t i = 0; i < n; i += blk) {
        size_t m = n - i < blk ? n - i : blk;
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        size_t off = (size_t)((rng_state * 0x2545F4914F6CDD1DULL) >> 11) % (POOL_N - blk);
        memcpy(x + i * es, (const unsigned char *)pool + off * es, m * es);
    }
    return x;
}

/* Device copy of n tiled elements. */
static void *dtile(kda_context *ctx, dbufs *b, const void *pool, size_t n, size_t es)
{
    void *h = tile(pool, n, es), *d = dalloc(ctx, b, n * es, h);
    free(h);
    return d;
}

static void gpu_print(const char *op, const shape *s, double med, double mn, double flops, double bytes,
                      double peak_gbps, const char *flop_model, const char *bytes_model, const char *extra)
{
    double tok = (double)s->B * s->T;
    print_head("gpu", op, s);
    printf(",\"ms_median\":%.4f,\"ms_min\":%.4f,\"host_ms\":%.4f,\"tokens_per_s\":%.0f,\"gflops\":%.2f,\"threads\":null,"
           "\"gpu\":\"",
           med, mn, g_host_ms, tok / (med * 1e-3), flops / (med * 1e-3) / 1e9);
    json_escape(stdout, cu.name);
    printf("\",\"bytes\":%.0f,\"gbps\":%.1f,\"peak_gbps\":%.0f,\"roofline_fraction\":%.4f,"
           "\"bytes_model\":\"%s\",\"flop_model\":\"%s\"%s}\n",
           bytes, bytes / (med * 1e-3) / 1e9, peak_gbps, (bytes / (peak_gbps * 1e9)) / (med * 1e-3), bytes_model,
           flop_model, extra ? extra : "");
    fflush(stdout);
}

static void gpu_error_line(const char *op, const shape *s, const char *extra)
{
    print_head("gpu", op, s);
    if (extra) printf("%s", extra);
    printf(",\"error\":\"");
    json_escape(stdout, gpu_err);
    printf("\"}\n");
    fflush(stdout);
}

static const char *g_gate;                    /* --gate kimi or lb5 (NULL: g = logsigmoid(randn)) */
static int g_g16;                             /* --g-dtype act: g in the activation dtype, not fp32 */
static int32_t g_cu[257];                     /* --seqlens: its varlen batch (B = 1, T = the sum) */

static void gpu_bench_shape(kda_context *ctx, const shape *s, int reps, double peak_gbps)
{
    kda_problem p = bench_problem(s);
    dbufs b = {{0}, 0};
    const int kimi = g_gate && !strcmp(g_gate, "kimi"), lb5 = g_gate && !strcmp(g_gate, "lb5");
    const size_t g_es = g_g16 ? 2 : 4; /* g's element size */
    char extra_fields[96] = ""; /* the line's gate and g_dtype fields, where not the defaults */
    if (g_gate) snprintf(extra_fields, sizeof extra_fields, ",\"gate\":\"%s\"", g_gate);
    if (g_g16) {
        p.g_dtype = g_dtype;
        snprintf(extra_fields + strlen(extra_fields), sizeof extra_fields - strlen(extra_fields), ",\"g_dtype\":\"%s\"",
                 kda_dtype_name(g_dtype));
    }
    if (g_fwd_pool)
        snprintf(extra_fields + strlen(extra_fields), sizeof extra_fields - strlen(extra_fields),
                 ",\"state\":\"pool\",\"state_dtype\":\"%s\"", g_pool_bf16 ? "bf16" : "f32");
    if (kimi) p.gate = KDA_GATE_SOFTPLUS;
    if (lb5) p.gate = KDA_GATE_LOWER_BOUND, p.lower_bound = -5.0;
    kda_status st = kda_problem_check(ctx, &p);
    if (st != KDA_OK) {
        snprintf(gpu_err, sizeof gpu_err, "kda_problem_check: %s", kda_last_error(ctx));
        gpu_error_line("fwd", s, NULL), gpu_error_line("bwd", s, NULL);
        return;
    }
    pools_init();
    size_t tok = (size_t)p.B * p.T, N = (size_t)kda_num_seqs(&p);
    size_t n_qk = tok * p.H * p.K, n_v = tok * p.HV * p.V, n_g = tok * p.HV * p.K;
    size_t n_beta = tok * p.HV, n_state = N * p.HV * p.K * p.V;
    /* the workspace: the forward's for this call (the fused forward's pieces, not the staged
     * kernels' GBs), and the backward's where it is timed */
    size_t ws_f = 0, ws_b = strstr(g_ops, "bwd") ? kda_bwd_workspace_size(&p, 0) : 0;

    kda_inputs in = {0};
    kda_fwd_outputs out = {0};
    kda_bwd_io io = {0};
    void *ws;
    if (!(in.q = dtile(ctx, &b, pool_randn16, n_qk, 2)) || !(in.k = dtile(ctx, &b, pool_randn16, n_qk, 2)) ||
        !(in.v = dtile(ctx, &b, pool_randn16, n_v, 2)) ||
        !(in.g = g_g16 ? dtile(ctx, &b, g_gate ? pool_randn16 : pool_logsig16, n_g, 2)
                       : dtile(ctx, &b, g_gate ? pool_randn_f32 : pool_logsig, n_g, 4)) ||
        !(in.beta = dtile(ctx, &b, pool_sigmoid16, n_beta, 2)) ||
        !(in.h0 = dtile(ctx, &b, pool_randn_f32, n_state, 4)) || !(out.o = dalloc(ctx, &b, n_v * 2, NULL)) ||
        !(out.ht = dalloc(ctx, &b, n_state * 4, NULL)) ||
        (s->cu_seqlens &&
         !(in.cu_seqlens = dalloc(ctx, &b, (size_t)(s->num_seqs + 1) * sizeof(int32_t), s->cu_seqlens)))) {
        gpu_error_line("fwd", s, NULL), gpu_error_line("bwd", s, NULL);
        dfree_all(ctx, &b);
        return;
    }
    /* (before fin = in below: the forward takes the gate's inputs too) */
    if (g_gate) { /* raw g = randn (above); Kimi Linear's decay rates, or (lb5) A = 1 and a bias of 3 */
        float *a = xmalloc((size_t)p.HV * 4), *dtb = xmalloc((size_t)p.HV * p.K * 4);
        for (int i = 0; i < p.HV; i++) a[i] = lb5 ? 0.0f : (float)log(1.0 + 15.0 * urand());
        for (int i = 0; i < p.HV * p.K; i++)
            dtb[i] = lb5 ? 3.0f : (float)log(expm1(exp(log(1e-3) + urand() * (log(1e-1) - log(1e-3)))));
        in.A_log = dalloc(ctx, &b, (size_t)p.HV * 4, a);
        in.dt_bias = dalloc(ctx, &b, (size_t)p.HV * p.K * 4, dtb);
        free(a), free(dtb);
        if (!in.A_log || !in.dt_bias) {
            gpu_error_line("fwd", s, extra_fields), gpu_error_line("bwd", s, extra_fields);
            dfree_all(ctx, &b);
            return;
        }
    }
    in.cu_seqlens_host = s->cu_seqlens;
    kda_inputs fin = in; /* the forward's: in.h0 stays the backward's */
    int32_t *slots_h = NULL;
    if (g_fwd_pool) { /* the pool form: slot n for sequence n, h0's values (bf16: rounded) */
        const size_t sb = g_pool_bf16 ? 2 : 4;
        void *ph = tile(pool_randn_f32, n_state, 4);
        slots_h = xmalloc(N * sizeof(int32_t));
        if (g_pool_bf16)
            for (size_t i = 0; i < n_state; i++) ((uint16_t *)ph)[i] = kda_f32_to_bf16(((float *)ph)[i]);
        for (size_t n = 0; n < N; n++) slots_h[n] = (int32_t)n;
        out.state_pool = dalloc(ctx, &b, n_state * sb, ph);
        out.slots = dalloc(ctx, &b, N * sizeof(int32_t), slots_h);
        out.slots_host = slots_h;
        out.num_slots = (int)N;
        out.state_dtype = g_pool_bf16 ? KDA_BF16 : KDA_F32;
        fin.h0 = NULL, out.ht = NULL;
        free(ph);
        if (!out.state_pool || !out.slots) {
            gpu_error_line("fwd", s, extra_fields);
            dfree_all(ctx, &b);
            free(slots_h);
            return;
        }
    }
    const kda_status wq = kda_chunk_fwd_workspace(ctx, &p, &out, s->cu_seqlens, &ws_f);
    const size_t ws_bytes = ws_f > ws_b ? ws_f : ws_b;
    if (wq != KDA_OK || !(ws = dalloc(ctx, &b, ws_bytes, NULL))) {
        gpu_error_line("fwd", s, extra_fields), gpu_error_line("bwd", s, extra_fields);
        dfree_all(ctx, &b);
        free(slots_h);
        return;
    }
    kda_set_workspace(ctx, ws, ws_bytes);

    double flops = fwd_flops(&p, s->cu_seqlens), med, mn;
    double in_bytes = 2.0 * n_qk * 2 + n_v * 2.0 + (double)n_g * g_es + n_beta * 2.0; /* q, k, v, g, beta */
    if (strstr(g_ops, "fwd")) {
        if (gpu_time(ctx, run_fwd, "kda_chunk_fwd", &p, &fin, &out, reps, &med, &mn) == 0)
            gpu_print("fwd", s, med, mn, flops, in_bytes + n_v * 2.0, peak_gbps, FLOP_MODEL, BYTES_MODEL_FWD, extra_fields);
        else
            gpu_error_line("fwd", s, extra_fields);
    }

    if (strstr(g_ops, "bwd")) {
        if (!(io.dout = dtile(ctx, &b, pool_randn16, n_v, 2)) || !(io.dq = dalloc(ctx, &b, n_qk * 2, NULL)) ||
            !(io.dk = dalloc(ctx, &b, n_qk * 2, NULL)) || !(io.dv = dalloc(ctx, &b, n_v * 2, NULL)) ||
            !(io.dg = dalloc(ctx, &b, n_g * g_es, NULL)) || !(io.dbeta = dalloc(ctx, &b, n_beta * 2, NULL)) ||
            !(io.dh0 = dalloc(ctx, &b, n_state * 4, NULL))) {
            gpu_error_line("bwd", s, extra_fields);
        } else if (gpu_time(ctx, run_bwd, "kda_chunk_bwd", &p, &in, &io, reps, &med, &mn) == 0) {
            double bytes = in_bytes + n_v * 2.0 /* dout */ + in_bytes /* the gradients, same sizes */;
            gpu_print("bwd", s, med, mn, 3.0 * flops, bytes, peak_gbps, FLOP_MODEL, BYTES_MODEL_BWD, extra_fields);
        } else {
            gpu_error_line("bwd", s, extra_fields);
        }
    }
    kda_set_workspace(ctx, NULL, 0);
    dfree_all(ctx, &b);
    free(slots_h);
}

/* Decode: N sequences of one token (B = N, T = 1), H = 32, K = V = 128, the
 * states in a pool of N slots (slot n for sequence n) updated in place. */
static void gpu_bench_decode(kda_context *ctx, int N, int reps, double peak_gbps)
{
    shape s = {N, 1, DECODE_H, DECODE_D, DECODE_D, NULL, 0};
    kda_problem p = bench_problem(&s);
    dbufs b = {{0}, 0};
    const char *extra = g_pool_bf16 ? ",\"state\":\"pool\",\"state_dtype\":\"bf16\"" : ",\"state\":\"pool\",\"state_dtype\":\"f32\"";
    const size_t sb = g_pool_bf16 ? 2 : 4; /* bytes per state value */
    size_t n_qk = (size_t)N * p.H * p.K, n_v = (size_t)N * p.HV * p.V, n_g = (size_t)N * p.HV * p.K;
    size_t n_beta = (size_t)N * p.HV, n_state = (size_t)N * p.HV * p.K * p.V;
    size_t ws_bytes = kda_recurrent_workspace_size(&p);
    int32_t *slots = xmalloc((size_t)N * sizeof(int32_t));
    for (int n = 0; n < N; n++) slots[n] = n;
    pools_init();

    kda_inputs in = {0};
    kda_recurrent_io io = {0};
    void *ws = NULL;
    float *pool_h = xmalloc(n_state * 4);
    for (size_t i = 0; i < n_state; i++) pool_h[i] = 0.1f * pool_randn_f32[i % POOL_N];
    if (g_pool_bf16) /* the same values in bf16, packed into the front of pool_h */
        for (size_t i = 0; i < n_state; i++) ((uint16_t *)pool_h)[i] = kda_f32_to_bf16(pool_h[i]);
    if (!(in.q = dtile(ctx, &b, pool_randn16, n_qk, 2)) || !(in.k = dtile(ctx, &b, pool_randn16, n_qk, 2)) ||
        !(in.v = dtile(ctx, &b, pool_randn16, n_v, 2)) || !(in.g = dtile(ctx, &b, pool_logsig, n_g, 4)) ||
        !(in.beta = dtile(ctx, &b, pool_sigmoid16, n_beta, 2)) || !(io.o = dalloc(ctx, &b, n_v * 2, NULL)) ||
        !(io.state_pool = dalloc(ctx, &b, n_state * sb, pool_h)) ||
        !(io.slots = dalloc(ctx, &b, (size_t)N * sizeof(int32_t), slots)) ||
        (ws_bytes && !(ws = dalloc(ctx, &b, ws_bytes, NULL)))) {
        gpu_error_line("decode", &s, extra);
    } else {
        double med, mn;
        io.slots_host = slots;
        io.num_slots = N;
        io.state_dtype = g_pool_bf16 ? KDA_BF16 : KDA_F32;
        kda_set_workspace(ctx, ws, ws_bytes);
        if (gpu_time(ctx, run_rec, "kda_recurrent_fwd", &p, &in, &io, reps, &med, &mn) == 0) {
            double bytes = 2.0 * n_state * sb + 2.0 * n_qk * 2 + n_v * 2.0 + n_g * 4.0 + n_beta * 2.0 + n_v * 2.0;
            gpu_print("decode", &s, med, mn, 7.0 * N * p.HV * p.K * p.V, bytes, peak_gbps, FLOP_MODEL_DECODE,
                      BYTES_MODEL_DECODE, extra);
        } else {
            gpu_error_line("decode", &s, extra);
        }
        kda_set_workspace(ctx, NULL, 0);
    }
    dfree_all(ctx, &b);
    free(slots);
    free(pool_h);
}

/* Without a usable GPU: {"device":"gpu","error":".."} and 2. */
static int gpu_unavailable(const char *msg)
{
    printf("{\"device\":\"gpu\",\"error\":\"");
    json_escape(stdout, msg);
    printf("\"}\n");
    return 2;
}

static int bench_gpu(int reps, double peak_gbps)
{
    kda_context *ctx = NULL;
    kda_status st = kda_context_create(&ctx, KDA_BACKEND_CUDA, NULL);
    if (st != KDA_OK) {
        const char *msg = ctx ? kda_last_error(ctx) : "";
        int rc = gpu_unavailable(*msg ? msg : kda_status_string(st));
        if (ctx) kda_context_destroy(ctx);
        return rc;
    }
    if (cu_open() != 0) {
        int rc = gpu_unavailable(gpu_err);
        cu_close();
        kda_context_destroy(ctx);
        return rc;
    }
    if (g_shape.B) gpu_bench_shape(ctx, &g_shape, reps, peak_gbps);
    else
        for (size_t i = 0; i < sizeof gpu_shapes / sizeof gpu_shapes[0]; i++)
            gpu_bench_shape(ctx, &gpu_shapes[i], reps, peak_gbps);
    if (strstr(g_ops, "decode") && g_decode_n) gpu_bench_decode(ctx, g_decode_n, reps, peak_gbps);
    else if (strstr(g_ops, "decode"))
        for (size_t i = 0; i < sizeof decode_N / sizeof decode_N[0]; i++) gpu_bench_decode(ctx, decode_N[i], reps, peak_gbps);
    pools_free();
    cu_close();
    kda_context_destroy(ctx);
    return 0;
}

/* ===================================================================== JIT */

typedef struct jit_item {
    int idx;
    kda_status st;
    double ms;
    void *cubin;
    size_t size;
    char file[512];
    char err[2200];
} jit_item;

typedef struct jit_pool {
    jit_item *items;
    int n, next;
    const char *arch;
    pthread_mutex_t mu;
} jit_pool;

static void *jit_worker(void *arg)
{
    jit_pool *jp = arg;
    kda_context *ctx = NULL;
    kda_context_options opts = {0};
    opts.num_threads = 1;
    kda_status cst = kda_context_create(&ctx, KDA_BACKEND_CPU, &opts); /* one context per thread */
    for (;;) {
        pthread_mutex_lock(&jp->mu);
        int i = jp->next++;
        pthread_mutex_unlock(&jp->mu);
        if (i >= jp->n) break;
        jit_item *it = &jp->items[i];
        if (cst != KDA_OK) {
            it->st = cst;
            snprintf(it->err, sizeof it->err, "kda_context_create: %s", ctx ? kda_last_error(ctx) : "out of memory");
            continue;
        }
        double t0 = now_ms();
        it->st = kda_compile_kernel(ctx, it->idx, jp->arch, &it->cubin, &it->size, it->file, sizeof it->file);
        it->ms = now_ms() - t0;
        if (it->st != KDA_OK) snprintf(it->err, sizeof it->err, "%s", kda_last_error(ctx));
    }
    if (ctx) kda_context_destroy(ctx);
    return NULL;
}

/* Removes the plain files of dir (one level), then dir. */
static void rm_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[1200];
    if (d) {
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
                snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
                remove(path);
            }
        closedir(d);
    }
    rmdir(dir);
}

static void jit_problem_json(void)
{
    const char *dt = kda_dtype_name(g_dtype);
    printf("\"problem\":{\"B\":1,\"T\":4096,\"H\":4,\"K\":128,\"V\":128,\"dtype\":\"%s\",\"g_dtype\":\"f32\","
           "\"beta_dtype\":\"%s\",\"chunk\":64,\"qk_l2norm\":1}",
           dt, dt);
}

/* kda_warmup on a fresh CUDA context (env as the caller set it); prints one line. */
static void jit_warmup_line(const char *what, int kernels, const char *note)
{
    kda_context *ctx = NULL;
    kda_status st = kda_context_create(&ctx, KDA_BACKEND_CUDA, NULL);
    shape s = {1, 4096, 4, 128, 128, NULL, 0};
    kda_problem p = bench_problem(&s);
    double ms = 0;
    if (st == KDA_OK) {
        double t0 = now_ms();
        st = kda_warmup(ctx, &p);
        ms = now_ms() - t0;
    }
    printf("{\"jit\":\"%s\",\"kernels\":%d,", what, kernels);
    if (st == KDA_OK) {
        printf("\"ms\":%.1f,\"note\":\"%s\"}\n", ms, note);
    } else {
        printf("\"error\":\"");
        json_escape(stdout, ctx ? kda_last_error(ctx) : kda_status_string(st));
        printf("\"}\n");
    }
    fflush(stdout);
    if (ctx) kda_context_destroy(ctx);
}

static int bench_jit(const char *arch, int threads)
{
    kda_context *ctx = NULL;
    kda_status st = kda_context_create(&ctx, KDA_BACKEND_CPU, NULL);
    shape s = {1, 4096, 4, 128, 128, NULL, 0};
    kda_problem p = bench_problem(&s);
    int idx[256], n, rc = 0;
    if (st != KDA_OK) fail(ctx, st, "kda_context_create");
    n = kda_kernels_needed(ctx, &p, idx, (int)(sizeof idx / sizeof idx[0]));
    if (n < 0 || n > (int)(sizeof idx / sizeof idx[0])) {
        printf("{\"jit\":\"cold_compile\",\"error\":\"");
        json_escape(stdout, n < 0 ? kda_last_error(ctx) : "more kernels than the benchmark's table holds");
        printf("\"}\n");
        kda_context_destroy(ctx);
        return 1;
    }
    kda_context_destroy(ctx);

    /* 1. cold: every kernel through NVRTC, one thread per core */
    jit_pool jp;
    memset(&jp, 0, sizeof jp);
    jp.items = calloc((size_t)n + 1, sizeof(jit_item));
    if (!jp.items) fail(NULL, KDA_ERROR_OUT_OF_MEMORY, "calloc");
    jp.n = n;
    jp.arch = arch;
    pthread_mutex_init(&jp.mu, NULL);
    for (int i = 0; i < n; i++) jp.items[i].idx = idx[i];
    if (threads <= 0) threads = online_cores();
    if (threads > n) threads = n > 0 ? n : 1;
    pthread_t *tid = xmalloc(sizeof(pthread_t) * (size_t)threads);
    int started = 0;
    double t0 = now_ms();
    for (int t = 0; t < threads; t++)
        if (pthread_create(&tid[t], NULL, jit_worker, &jp) == 0) started++;
    if (started == 0) jit_worker(&jp);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
    double wall = now_ms() - t0, sum = 0, mx = 0;
    size_t total = 0;
    int failed = 0;
    for (int i = 0; i < n; i++) {
        jit_item *it = &jp.items[i];
        printf("{\"jit\":\"kernel\",\"name\":\"%s\",\"arch\":\"%s\",", kda_kernel_name(it->idx), arch);
        if (it->st == KDA_OK) {
            printf("\"ms\":%.1f,\"cubin_bytes\":%zu,\"file\":\"", it->ms, it->size);
            json_escape(stdout, it->file);
            printf("\"}\n");
            sum += it->ms;
            if (it->ms > mx) mx = it->ms;
            total += it->size;
        } else {
            printf("\"error\":\"");
            json_escape(stdout, it->err);
            printf("\"}\n");
            failed++;
        }
    }
    printf("{\"jit\":\"cold_compile\",\"arch\":\"%s\",\"kernels\":%d,\"failed\":%d,\"ms\":%.1f,\"threads\":%d,"
           "\"ms_sum\":%.1f,\"ms_max_kernel\":%.1f,\"cubin_bytes\":%zu,\"scope\":\"kda_kernels_needed: fwd+bwd+decode\","
           "\"what\":\"kda_compile_kernel (NVRTC, no cache) for every kernel, in parallel threads\",",
           arch, n, failed, wall, started ? started : 1, sum, mx, total);
    jit_problem_json();
    printf("}\n");
    fflush(stdout);
    free(tid);
    if (failed) rc = 1;

    /* 2. warm: the cubins as KDA_CUBIN_DIR holds them, read back */
    char tmpl[1024], cache[1024];
    const char *tmp = getenv("TMPDIR");
    snprintf(tmpl, sizeof tmpl, "%s/kda-bench-cubins-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    snprintf(cache, sizeof cache, "%s/kda-bench-cache-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!failed && mkdtemp(tmpl)) {
        char path[1600];
        int werr = 0;
        for (int i = 0; i < n && !werr; i++) {
            snprintf(path, sizeof path, "%s/%s", tmpl, jp.items[i].file);
            FILE *f = fopen(path, "wb");
            if (!f || fwrite(jp.items[i].cubin, 1, jp.items[i].size, f) != jp.items[i].size) werr = 1;
            if (f && fclose(f) != 0) werr = 1;
        }
        if (werr) {
            printf("{\"jit\":\"warm_read_files\",\"error\":\"cannot write the cubins to %s\"}\n", tmpl);
        } else {
            /* kda.h's own lookup without a GPU: read + verify (SHA-256) of every cubin,
             * from KDA_CUBIN_DIR and from the disk cache (the same files under cache
             * keys); only cuModuleLoadData is left out */
            kda_context *hc = NULL;
            kda__cuda *c = calloc(1, sizeof *c);
            kda_context_create(&hc, KDA_BACKEND_CPU, NULL);
            snprintf(c->arch, sizeof c->arch, "%s", arch);
            c->nv_ok = kda__nvrtc_load(&c->nv, c->nv_tried, sizeof c->nv_tried) == 0;
            if (c->nv_ok && mkdtemp(cache)) {
                int cerr = 0;
                for (int i = 0; i < n && !cerr; i++) { /* the cache files: the same cubins under the cache key */
                    unsigned char key[32];
                    char hex[32];
                    const kda__kdesc *k = &kda__kernels[jp.items[i].idx];
                    kda__kernel_key(k, 0, arch, c->nv.major, c->nv.minor, key);
                    kda__hex(key, 8, hex);
                    memcpy((unsigned char *)jp.items[i].cubin + 24, key, 32);
                    snprintf(path, sizeof path, "%s/%s_%s_%s.cubin", cache, k->name, arch, hex);
                    FILE *f = fopen(path, "wb");
                    if (!f || fwrite(jp.items[i].cubin, 1, jp.items[i].size, f) != jp.items[i].size) cerr = 1;
                    if (f && fclose(f) != 0) cerr = 1;
                }
                snprintf(c->cache_dir, sizeof c->cache_dir, "%s", cache);
                c->cache_state = 1;
                for (int pass = 0; pass < 2 && !cerr; pass++) { /* 0: KDA_CUBIN_DIR, 1: the disk cache */
                    int bad = 0;
                    if (pass == 0) setenv("KDA_CUBIN_DIR", tmpl, 1);
                    else unsetenv("KDA_CUBIN_DIR");
                    t0 = now_ms();
                    for (int i = 0; i < n; i++) {
                        unsigned char *buf = NULL;
                        const unsigned char *payload = NULL;
                        size_t len = 0;
                        int origin = -1, wf = 0;
                        if (kda__cubin_get(hc, c, &kda__kernels[jp.items[i].idx], 0, 1, &buf, &len, &payload, &origin, &wf) != KDA_OK ||
                            origin != (pass == 0 ? 1 : 2))
                            bad++;
                        free(buf);
                    }
                    double ms = now_ms() - t0;
                    printf("{\"jit\":\"%s\",\"arch\":\"%s\",\"kernels\":%d,\"ms\":%.3f,\"misses\":%d,\"verified\":true,"
                           "\"what\":\"kda.h's lookup from %s: read + SHA-256 verify of every cubin, one thread, no GPU "
                           "(cuModuleLoadData not included; see the warmup_* lines where there is a GPU)\"}\n",
                           pass == 0 ? "aot_load" : "cache_load", arch, n, ms, bad, pass == 0 ? "KDA_CUBIN_DIR" : "the disk cache");
                }
                unsetenv("KDA_CUBIN_DIR");
                rm_dir(cache);
            } else {
                printf("{\"jit\":\"aot_load\",\"error\":\"NVRTC not found or no temporary folder\"}\n");
            }
            if (c->nv.lib) dlclose(c->nv.lib);
            free(c);
            kda_context_destroy(hc);
            snprintf(cache, sizeof cache, "%s/kda-bench-cache-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        }
        fflush(stdout);

        /* 3. the library's own load path, when there is a GPU */
        kda_context *g = NULL;
        st = kda_context_create(&g, KDA_BACKEND_CUDA, NULL);
        if (g) kda_context_destroy(g);
        if (st == KDA_OK && !werr && mkdtemp(cache)) {
            setenv("KDA_CACHE_DIR", cache, 1);
            unsetenv("KDA_CUBIN_DIR");
            jit_warmup_line("warmup_nvrtc", n, "kda_warmup on a fresh CUDA context, empty disk cache: NVRTC + load");
            char cache2[1024];
            snprintf(cache2, sizeof cache2, "%s/kda-bench-cache-XXXXXX", tmp && *tmp ? tmp : "/tmp");
            if (mkdtemp(cache2)) {
                setenv("KDA_CACHE_DIR", cache2, 1);
                setenv("KDA_CUBIN_DIR", tmpl, 1);
                jit_warmup_line("warmup_cubin_dir", n,
                                "kda_warmup on a fresh CUDA context, KDA_CUBIN_DIR holding the cubins above "
                                "(must match the device arch): read + verify + load");
                unsetenv("KDA_CUBIN_DIR");
                rm_dir(cache2);
            }
            setenv("KDA_CACHE_DIR", cache, 1);
            jit_warmup_line("warmup_disk_cache", n,
                            "kda_warmup on a fresh CUDA context, the disk cache warmup_nvrtc filled: read + verify + load");
            unsetenv("KDA_CACHE_DIR");
            rm_dir(cache);
        }
        rm_dir(tmpl);
    } else if (!failed) {
        printf("{\"jit\":\"warm_read_files\",\"error\":\"cannot create a folder like %s\"}\n", tmpl);
    }
    for (int i = 0; i < n; i++) free(jp.items[i].cubin);
    free(jp.items);
    pthread_mutex_destroy(&jp.mu);
    return rc;
}

/* ------------------------------------------------------------------------- */

static int usage(void)
{
    fprintf(stderr, "usage: kda-bench --device cpu|gpu [--reps N] [--threads N] [--peak-gbps X] [--ops fwd,bwd,decode]\n"
                    "                 [--shape B,T,H,K,V]   (this shape instead of the table: ANCHORS.md's on the gpu)\n"
                    "                 [--seqlens L1,L2,..]  (with --shape 1,T,H,K,V: a varlen batch of these lengths)\n"
                    "                 [--gate kimi|lb5]     (gpu: the softplus gate, Kimi Linear's initialisation;\n"
                    "                                        the lower-bound gate at -5, mostly near it)\n"
                    "                 [--dtype bf16|f16]    (q, k, v, beta, o; default bf16)\n"
                    "                 [--g-dtype f32|act]   (gpu: g in fp32, or in --dtype's dtype; default f32)\n"
                    "                 [--decode-n N]        (gpu: decode N sequences only, not 1, 32 and 256)\n"
                    "                 [--pool-dtype f32|bf16] (gpu: the state pool's dtype; default f32)\n"
                    "                 [--state pool]        (gpu: the forward in its pool form, slot n for sequence n)\n"
                    "       kda-bench --jit [--arch sm_90a] [--threads N]\n");
    return 1;
}

int main(int argc, char **argv)
{
    const char *device = "cpu", *arch = "sm_90a", *gpu_only = NULL; /* a GPU-only option given (the last) */
    int reps = 0, threads = 0, jit = 0;
    double peak_gbps = 4300.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--jit")) { jit = 1; continue; }
        if (!val) return usage();
        if (!strcmp(a, "--device")) device = val;
        else if (!strcmp(a, "--reps")) reps = atoi(val);
        else if (!strcmp(a, "--threads")) threads = atoi(val);
        else if (!strcmp(a, "--peak-gbps")) peak_gbps = atof(val);
        else if (!strcmp(a, "--arch")) arch = val;
        else if (!strcmp(a, "--ops")) g_ops = val;
        else if (!strcmp(a, "--dtype")) {
            if (strcmp(val, "bf16") && strcmp(val, "f16")) return usage();
            g_dtype = strcmp(val, "f16") ? KDA_BF16 : KDA_F16;
        }
        else if (!strcmp(a, "--g-dtype")) {
            gpu_only = a;
            if (strcmp(val, "f32") && strcmp(val, "act")) return usage();
            g_g16 = !strcmp(val, "act");
        }
        else if (!strcmp(a, "--decode-n")) {
            gpu_only = a;
            if ((g_decode_n = atoi(val)) < 1) return usage();
        }
        else if (!strcmp(a, "--state")) {
            gpu_only = a;
            if (strcmp(val, "pool")) return usage();
            g_fwd_pool = 1;
        }
        else if (!strcmp(a, "--pool-dtype")) {
            gpu_only = a;
            if (strcmp(val, "f32") && strcmp(val, "bf16")) return usage();
            g_pool_bf16 = !strcmp(val, "bf16");
        }
        else if (!strcmp(a, "--gate")) {
            gpu_only = a;
            if (strcmp(val, "kimi") && strcmp(val, "lb5")) return usage();
            g_gate = val;
        }
        else if (!strcmp(a, "--shape")) {
            shape *g = &g_shape;
            if (sscanf(val, "%d,%d,%d,%d,%d", &g->B, &g->T, &g->H, &g->K, &g->V) != 5 || g->B < 1 || g->T < 1 ||
                g->H < 1 || g->K < 1 || g->V < 1)
                return usage();
        } else if (!strcmp(a, "--seqlens")) { /* up to 256 lengths, comma-separated, nothing else */
            int n = 0;
            for (const char *c = val;; c++) {
                char *end;
                long len = strtol(c, &end, 10);
                if (end == c || len < 0 || n == 256) return usage();
                g_cu[n + 1] = g_cu[n] + (int32_t)len, n++;
                if (*(c = end) != ',') {
                    if (*c) return usage();
                    break;
                }
            }
            if (g_cu[n] < 1) return usage();
            g_shape.cu_seqlens = g_cu;
            g_shape.num_seqs = n;
        } else return usage();
        i++;
    }
    if (reps < 0 || threads < 0 || !(peak_gbps > 0)) return usage();
    if (g_shape.num_seqs) { /* the lengths set T */
        if (g_shape.B != 1) return usage();
        g_shape.T = g_cu[g_shape.num_seqs];
    }

    if (jit) return bench_jit(arch, threads);
    if (!strcmp(device, "gpu")) return bench_gpu(reps ? reps : 10, peak_gbps);
    if (strcmp(device, "cpu")) return usage();
    if (gpu_only) { /* (rather than a table of lines without what was asked for) */
        fprintf(stderr, "kda-bench: %s is for --device gpu only\n", gpu_only);
        return 1;
    }
    if (!strstr(g_ops, "fwd") && !strstr(g_ops, "bwd")) {
        fprintf(stderr, "kda-bench: --ops %s: the CPU times fwd and bwd (decode on the GPU only)\n", g_ops);
        return 1;
    }
    if (reps == 0) reps = 5;

    /* Threads: --threads, else $KDA_NUM_THREADS, else all online cores (the library's rule). */
    if (threads == 0) {
        const char *env = getenv("KDA_NUM_THREADS");
        threads = env && atoi(env) > 0 ? atoi(env) : online_cores();
    }
    kda_context_options opts = {0};
    opts.num_threads = threads;
    kda_context *ctx = NULL;
    kda_status st = kda_context_create(&ctx, KDA_BACKEND_CPU, &opts);
    if (st != KDA_OK) fail(ctx, st, "kda_context_create");

    if (g_shape.B) bench_shape(ctx, &g_shape, reps, threads);
    else
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) bench_shape(ctx, &shapes[i], reps, threads);

    kda_context_destroy(ctx);
    return 0;
}
