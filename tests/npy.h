/* tests/npy.h - .npy float32 I/O, the reference-case loader and the error ratio.
 *
 * Header only, every function static (inline, so an unused one draws no warning).
 * Include after kda.h (kda_case_problem fills a kda_problem); it calls nothing
 * from kda.h's implementation, so it also works with the declarations alone.
 *
 *   float *npy_load_f32(path, &ndim, shape)    '<f4' C-order .npy, v1/v2/v3 headers
 *   int    npy_save_f32(path, data, ndim, shape)
 *   int    kda_case_load(dir, &c) / kda_case_free(&c) / kda_case_problem(&c, dtype, chunk)
 *   double kda_err_ratio(ref, x, n)   RMS(ref - x) / RMS(ref); ref double* or float*
 *
 * The case format is described in shared/cases/README.md.
 */
#ifndef KDA_TESTS_NPY_H
#define KDA_TESTS_NPY_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kda.h"

#define NPY_MAX_DIM 8

/* ------------------------------------------------------------------------- */
/* .npy                                                                      */
/* ------------------------------------------------------------------------- */

/* Value text of 'key' in the header dict, or NULL. */
static inline const char *npy__dict_value(const char *hdr, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "'%s'", key);
    const char *s = strstr(hdr, pat);
    if (!s) {
        snprintf(pat, sizeof pat, "\"%s\"", key);
        s = strstr(hdr, pat);
    }
    if (!s) return NULL;
    s += strlen(pat);
    while (*s == ' ') s++;
    if (*s != ':') return NULL;
    s++;
    while (*s == ' ') s++;
    return s;
}

/* Reads a little-endian float32 C-order array. Returns malloc'd data (at least
 * one float even when empty) and fills *ndim and shape, or prints why to stderr
 * and returns NULL. */
static inline float *npy_load_f32(const char *path, int *ndim, long long shape[NPY_MAX_DIM])
{
    FILE *f = fopen(path, "rb");
    char *hdr = NULL;
    float *data = NULL;
    if (!f) {
        fprintf(stderr, "npy: %s: cannot open (missing file?)\n", path);
        return NULL;
    }
    unsigned char pre[12];
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
        fprintf(stderr, "npy: %s: not a .npy file (bad magic)\n", path);
        goto fail;
    }
    unsigned long hlen;
    int major = pre[6];
    if (major == 1) {
        hlen = (unsigned long)pre[8] | ((unsigned long)pre[9] << 8);
    } else if (major == 2 || major == 3) {
        if (fread(pre + 10, 1, 2, f) != 2) {
            fprintf(stderr, "npy: %s: truncated header\n", path);
            goto fail;
        }
        hlen = (unsigned long)pre[8] | ((unsigned long)pre[9] << 8) | ((unsigned long)pre[10] << 16) |
               ((unsigned long)pre[11] << 24);
    } else {
        fprintf(stderr, "npy: %s: unsupported format version %d\n", path, major);
        goto fail;
    }
    if (hlen > (1ul << 24)) {
        fprintf(stderr, "npy: %s: header too long (%lu bytes)\n", path, hlen);
        goto fail;
    }
    hdr = (char *)malloc(hlen + 1);
    if (!hdr || fread(hdr, 1, hlen, f) != hlen) {
        fprintf(stderr, "npy: %s: truncated header\n", path);
        goto fail;
    }
    hdr[hlen] = 0;

    const char *d = npy__dict_value(hdr, "descr");
    if (!d) {
        fprintf(stderr, "npy: %s: header has no 'descr'\n", path);
        goto fail;
    }
    if (strncmp(d, "'<f4'", 5) != 0 && strncmp(d, "\"<f4\"", 5) != 0) {
        const char *e = d + 1;
        while (*e && *e != '\'' && *e != '"') e++;
        fprintf(stderr, "npy: %s: wrong dtype %.*s, need little-endian float32 '<f4'\n", path,
                (int)(e - d + 1), d);
        goto fail;
    }
    const char *fo = npy__dict_value(hdr, "fortran_order");
    if (!fo) {
        fprintf(stderr, "npy: %s: header has no 'fortran_order'\n", path);
        goto fail;
    }
    if (strncmp(fo, "False", 5) != 0) {
        fprintf(stderr, "npy: %s: fortran_order is not False; need C order\n", path);
        goto fail;
    }
    const char *s = npy__dict_value(hdr, "shape");
    if (!s || *s != '(') {
        fprintf(stderr, "npy: %s: header has no 'shape' tuple\n", path);
        goto fail;
    }
    s++;
    int nd = 0;
    long long count = 1;
    for (;;) {
        while (*s == ' ' || *s == ',') s++;
        if (*s == ')') break;
        char *end;
        long long dim = strtoll(s, &end, 10);
        if (end == s || dim < 0) {
            fprintf(stderr, "npy: %s: bad shape in header\n", path);
            goto fail;
        }
        if (nd == NPY_MAX_DIM) {
            fprintf(stderr, "npy: %s: more than %d dimensions\n", path, NPY_MAX_DIM);
            goto fail;
        }
        shape[nd++] = dim;
        count *= dim;
        s = end;
        while (*s == ' ' || *s == 'L') s++;
    }
    data = (float *)malloc(count > 0 ? (size_t)count * sizeof(float) : sizeof(float));
    if (!data) {
        fprintf(stderr, "npy: %s: out of memory for %lld floats\n", path, count);
        goto fail;
    }
    if (count > 0 && fread(data, sizeof(float), (size_t)count, f) != (size_t)count) {
        fprintf(stderr, "npy: %s: file too short for %lld floats\n", path, count);
        goto fail;
    }
    {   /* the data are little-endian; swap on a big-endian host */
        const unsigned one = 1;
        if (*(const unsigned char *)&one == 0) {
            unsigned char *b = (unsigned char *)data;
            for (long long i = 0; i < count; i++, b += 4) {
                unsigned char t0 = b[0], t1 = b[1];
                b[0] = b[3]; b[1] = b[2]; b[2] = t1; b[3] = t0;
            }
        }
    }
    free(hdr);
    fclose(f);
    *ndim = nd;
    return data;
fail:
    free(hdr);
    free(data);
    fclose(f);
    return NULL;
}

/* Writes a v1 .npy ('<f4', C order). Returns 0, or -1 with a message on stderr. */
static inline int npy_save_f32(const char *path, const float *data, int ndim, const long long *shape)
{
    char dict[512];
    int len;
    long long count = 1;
    if (ndim < 0 || ndim > NPY_MAX_DIM) {
        fprintf(stderr, "npy: %s: bad ndim %d\n", path, ndim);
        return -1;
    }
    len = snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (");
    for (int i = 0; i < ndim; i++) {
        len += snprintf(dict + len, sizeof dict - (size_t)len, "%lld,%s", shape[i],
                        (i + 1 < ndim) ? " " : "");
        count *= shape[i];
    }
    len += snprintf(dict + len, sizeof dict - (size_t)len, "), }");
    /* pad with spaces so magic(6)+version(2)+len(2)+header is a multiple of 64, ending in \n */
    int total = 10 + len + 1;
    int pad = (64 - total % 64) % 64;
    unsigned hlen = (unsigned)(len + pad + 1);
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "npy: %s: cannot create\n", path);
        return -1;
    }
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hlen & 0xff),
                             (unsigned char)(hlen >> 8)};
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)len, f) == (size_t)len;
    for (int i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    const unsigned one = 1;
    if (*(const unsigned char *)&one) {
        ok = ok && (count == 0 || fwrite(data, sizeof(float), (size_t)count, f) == (size_t)count);
    } else {
        for (long long i = 0; ok && i < count; i++) {
            const unsigned char *b = (const unsigned char *)(data + i);
            unsigned char le[4] = {b[3], b[2], b[1], b[0]};
            ok = fwrite(le, 1, 4, f) == 4;
        }
    }
    if (fclose(f) != 0) ok = 0;
    if (!ok) fprintf(stderr, "npy: %s: write failed\n", path);
    return ok ? 0 : -1;
}

/* ------------------------------------------------------------------------- */
/* Reference cases                                                           */
/* ------------------------------------------------------------------------- */

typedef struct kda_case {
    char dir[1024];
    int B, T, H, HV, K, V, N;
    double scale;
    int use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval;
    int has_A_log, has_dt_bias, has_h0, grad;
    int has_lower_bound;
    double lower_bound;
    long long *cu_seqlens; /* [N+1] or NULL (fixed length) */
    /* inputs */
    float *q, *k, *v, *g, *beta, *h0, *A_log, *dt_bias;
    /* answers */
    float *o, *ht;
    /* backward (grad = 1): upstream gradients and answers */
    float *do_, *dht;
    float *dq, *dk, *dv, *dg, *dbeta, *dh0, *dA_log, *ddt_bias;
} kda_case;

/* Element counts, from the params. */
static inline size_t kda_case_n_qk(const kda_case *c) { return (size_t)c->B * c->T * c->H * c->K; }
static inline size_t kda_case_n_v(const kda_case *c) { return (size_t)c->B * c->T * c->HV * c->V; }
static inline size_t kda_case_n_g(const kda_case *c) { return (size_t)c->B * c->T * c->HV * c->K; }
static inline size_t kda_case_n_beta(const kda_case *c) { return (size_t)c->B * c->T * c->HV; }
static inline size_t kda_case_n_state(const kda_case *c) { return (size_t)c->N * c->HV * c->K * c->V; }

static inline void kda_case_free(kda_case *c)
{
    float **arrs[] = {&c->q,  &c->k,   &c->v,  &c->g,  &c->beta, &c->h0,  &c->A_log,
                      &c->dt_bias, &c->o, &c->ht, &c->do_, &c->dht, &c->dq, &c->dk,
                      &c->dv, &c->dg,  &c->dbeta, &c->dh0, &c->dA_log, &c->ddt_bias};
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++) {
        free(*arrs[i]);
        *arrs[i] = NULL;
    }
    free(c->cu_seqlens);
    c->cu_seqlens = NULL;
}

/* Loads dir/name.npy into *dst and checks its shape (ndim dims in want[]); when
 * numel_only, only the element count must match (A_log, dt_bias may come in any
 * shape). A missing file is an error when required, else leaves *dst NULL. */
static inline int kda_case__array(const kda_case *c, const char *name, int required, float **dst, int ndim,
                                  const long long *want, int numel_only)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s.npy", c->dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (required) {
            fprintf(stderr, "case %s: array '%s' is missing (%s)\n", c->dir, name, path);
            return -1;
        }
        return 0;
    }
    fclose(f);
    int nd = 0;
    long long shape[NPY_MAX_DIM];
    float *a = npy_load_f32(path, &nd, shape);
    if (!a) return -1;
    int ok;
    if (numel_only) {
        long long n = 1, m = 1;
        for (int i = 0; i < nd; i++) n *= shape[i];
        for (int i = 0; i < ndim; i++) m *= want[i];
        ok = n == m;
    } else {
        ok = nd == ndim;
        for (int i = 0; ok && i < nd; i++) ok = shape[i] == want[i];
    }
    if (!ok) {
        char got[256], exp[256];
        int lg = 0, le = 0;
        got[0] = exp[0] = 0;
        for (int i = 0; i < nd && lg < 200; i++)
            lg += snprintf(got + lg, sizeof got - (size_t)lg, "%s%lld", i ? "," : "", shape[i]);
        for (int i = 0; i < ndim && le < 200; i++)
            le += snprintf(exp + le, sizeof exp - (size_t)le, "%s%lld", i ? "," : "", want[i]);
        fprintf(stderr, "case %s: array '%s' has shape [%s], params say [%s]%s\n", c->dir, name, got, exp,
                numel_only ? " (element count differs)" : "");
        free(a);
        return -1;
    }
    *dst = a;
    return 0;
}

/* Loads a case folder (params.txt + .npy files). Returns 0, or -1 with the reason
 * on stderr (and nothing left allocated). */
static inline int kda_case_load(const char *dir, kda_case *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->dir, sizeof c->dir, "%s", dir);
    char path[1200];
    snprintf(path, sizeof path, "%s/params.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "case %s: cannot open %s\n", dir, path);
        return -1;
    }
    enum { NREQ = 8 };
    int seen[NREQ] = {0};
    char line[4096];
    int bad = 0, ncu = 0;
    while (!bad && fgets(line, sizeof line, f)) {
        char key[64];
        int off = 0;
        if (sscanf(line, " %63s%n", key, &off) != 1 || key[0] == '#') continue;
        const char *val = line + off;
        int *ip = NULL;
        int req = -1;
        if (!strcmp(key, "B")) ip = &c->B, req = 0;
        else if (!strcmp(key, "T")) ip = &c->T, req = 1;
        else if (!strcmp(key, "H")) ip = &c->H, req = 2;
        else if (!strcmp(key, "HV")) ip = &c->HV, req = 3;
        else if (!strcmp(key, "K")) ip = &c->K, req = 4;
        else if (!strcmp(key, "V")) ip = &c->V, req = 5;
        else if (!strcmp(key, "N")) ip = &c->N, req = 6;
        else if (!strcmp(key, "use_qk_l2norm_in_kernel")) ip = &c->use_qk_l2norm_in_kernel;
        else if (!strcmp(key, "use_gate_in_kernel")) ip = &c->use_gate_in_kernel;
        else if (!strcmp(key, "use_beta_sigmoid_in_kernel")) ip = &c->use_beta_sigmoid_in_kernel;
        else if (!strcmp(key, "allow_neg_eigval")) ip = &c->allow_neg_eigval;
        else if (!strcmp(key, "has_A_log")) ip = &c->has_A_log;
        else if (!strcmp(key, "has_dt_bias")) ip = &c->has_dt_bias;
        else if (!strcmp(key, "has_h0")) ip = &c->has_h0;
        else if (!strcmp(key, "grad")) ip = &c->grad;
        if (ip) {
            if (sscanf(val, "%d", ip) != 1) bad = 1;
            if (req >= 0) seen[req] = 1;
        } else if (!strcmp(key, "scale")) {
            if (sscanf(val, "%lf", &c->scale) != 1) bad = 1;
            seen[7] = 1;
        } else if (!strcmp(key, "lower_bound")) {
            if (sscanf(val, "%lf", &c->lower_bound) != 1) bad = 1;
            c->has_lower_bound = 1;
        } else if (!strcmp(key, "cu_seqlens")) {
            size_t cap = 16;
            long long *cu = (long long *)malloc(cap * sizeof *cu);
            const char *s = val;
            ncu = 0;
            while (cu) {
                char *end;
                long long x = strtoll(s, &end, 10);
                if (end == s) break;
                if ((size_t)ncu == cap) {
                    long long *nc = (long long *)realloc(cu, 2 * cap * sizeof *cu);
                    if (!nc) {
                        free(cu);
                        cu = NULL;
                        break;
                    }
                    cu = nc, cap *= 2;
                }
                cu[ncu++] = x;
                s = end;
            }
            free(c->cu_seqlens);
            c->cu_seqlens = cu;
            if (!cu || ncu < 2) bad = 1;
        } else {
            fprintf(stderr, "case %s: params.txt: ignoring unknown key '%s'\n", dir, key);
        }
        if (bad) fprintf(stderr, "case %s: params.txt: bad value for '%s'\n", dir, key);
    }
    fclose(f);
    if (bad) goto fail;
    {
        static const char *names[NREQ] = {"B", "T", "H", "HV", "K", "V", "N", "scale"};
        for (int i = 0; i < NREQ; i++)
            if (!seen[i]) {
                fprintf(stderr, "case %s: params.txt lacks '%s'\n", dir, names[i]);
                goto fail;
            }
    }
    if (c->B <= 0 || c->T < 0 || c->H <= 0 || c->HV <= 0 || c->K <= 0 || c->V <= 0 || c->N <= 0 ||
        c->HV % c->H != 0) {
        fprintf(stderr, "case %s: bad sizes B=%d T=%d H=%d HV=%d K=%d V=%d N=%d\n", dir, c->B, c->T, c->H,
                c->HV, c->K, c->V, c->N);
        goto fail;
    }
    if (c->cu_seqlens) {
        if (ncu != c->N + 1) {
            fprintf(stderr, "case %s: cu_seqlens has %d entries, N=%d needs %d\n", dir, ncu, c->N, c->N + 1);
            goto fail;
        }
        if (c->B != 1) {
            fprintf(stderr, "case %s: cu_seqlens given but B=%d (varlen needs B=1)\n", dir, c->B);
            goto fail;
        }
        if (c->cu_seqlens[0] != 0 || c->cu_seqlens[c->N] != c->T) {
            fprintf(stderr, "case %s: cu_seqlens must start at 0 and end at T=%d\n", dir, c->T);
            goto fail;
        }
        for (int i = 0; i < c->N; i++)
            if (c->cu_seqlens[i + 1] < c->cu_seqlens[i]) {
                fprintf(stderr, "case %s: cu_seqlens decreases at entry %d\n", dir, i + 1);
                goto fail;
            }
    } else if (c->N != c->B) {
        fprintf(stderr, "case %s: N=%d but B=%d (no cu_seqlens)\n", dir, c->N, c->B);
        goto fail;
    }
    {
        const long long B = c->B, T = c->T, H = c->H, HV = c->HV, K = c->K, V = c->V, N = c->N;
        const long long s_qk[4] = {B, T, H, K}, s_v[4] = {B, T, HV, V}, s_g[4] = {B, T, HV, K},
                        s_b[3] = {B, T, HV}, s_st[4] = {N, HV, K, V}, s_a[1] = {HV}, s_dt[1] = {HV * K};
        const int gr = c->grad;
        int e = 0;
        e |= kda_case__array(c, "q", 1, &c->q, 4, s_qk, 0);
        e |= kda_case__array(c, "k", 1, &c->k, 4, s_qk, 0);
        e |= kda_case__array(c, "v", 1, &c->v, 4, s_v, 0);
        e |= kda_case__array(c, "g", 1, &c->g, 4, s_g, 0);
        e |= kda_case__array(c, "beta", 1, &c->beta, 3, s_b, 0);
        e |= kda_case__array(c, "h0", c->has_h0, &c->h0, 4, s_st, 0);
        e |= kda_case__array(c, "A_log", c->has_A_log, &c->A_log, 1, s_a, 1);
        e |= kda_case__array(c, "dt_bias", c->has_dt_bias, &c->dt_bias, 1, s_dt, 1);
        e |= kda_case__array(c, "o", 1, &c->o, 4, s_v, 0);
        e |= kda_case__array(c, "ht", 0, &c->ht, 4, s_st, 0);
        e |= kda_case__array(c, "do", gr, &c->do_, 4, s_v, 0);
        e |= kda_case__array(c, "dht", 0, &c->dht, 4, s_st, 0);
        e |= kda_case__array(c, "dq", gr, &c->dq, 4, s_qk, 0);
        e |= kda_case__array(c, "dk", gr, &c->dk, 4, s_qk, 0);
        e |= kda_case__array(c, "dv", gr, &c->dv, 4, s_v, 0);
        e |= kda_case__array(c, "dg", gr, &c->dg, 4, s_g, 0);
        e |= kda_case__array(c, "dbeta", gr, &c->dbeta, 3, s_b, 0);
        e |= kda_case__array(c, "dh0", gr && c->has_h0, &c->dh0, 4, s_st, 0);
        e |= kda_case__array(c, "dA_log", 0, &c->dA_log, 1, s_a, 1);
        e |= kda_case__array(c, "ddt_bias", 0, &c->ddt_bias, 1, s_dt, 1);
        if (e) goto fail;
        if (c->h0 && !c->has_h0) {
            fprintf(stderr, "case %s: h0.npy present but has_h0=0\n", dir);
            goto fail;
        }
        if ((c->A_log && !c->has_A_log) || (c->dt_bias && !c->has_dt_bias)) {
            fprintf(stderr, "case %s: A_log/dt_bias present but has_A_log/has_dt_bias=0\n", dir);
            goto fail;
        }
    }
    return 0;
fail:
    kda_case_free(c);
    return -1;
}

/* The kda_problem of a case, for the given dtype and chunk size. */
static inline kda_problem kda_case_problem(const kda_case *c, kda_dtype dtype, int chunk)
{
    kda_problem p;
    memset(&p, 0, sizeof p);
    p.B = c->B, p.T = c->T, p.H = c->H, p.HV = c->HV, p.K = c->K, p.V = c->V;
    p.dtype = dtype;
    p.chunk_size = chunk;
    p.scale = (float)c->scale;
    p.qk_l2norm = c->use_qk_l2norm_in_kernel;
    if (c->use_gate_in_kernel)
        p.gate = c->has_lower_bound ? KDA_GATE_LOWER_BOUND : KDA_GATE_SOFTPLUS;
    else
        p.gate = KDA_GATE_NONE;
    p.lower_bound = p.gate == KDA_GATE_LOWER_BOUND ? (float)c->lower_bound : 0.0f;
    p.beta_sigmoid = c->use_beta_sigmoid_in_kernel;
    p.allow_neg_eigval = c->allow_neg_eigval;
    p.safe_gate = 0;
    p.state_layout = KDA_STATE_KV;
    p.num_seqs = c->cu_seqlens ? c->N : 0;
    p.seqlens_type = KDA_INDEX_I64;
    /* g and beta in fp32 (a gate/beta projection's usual output); kda-case's
     * --gb-dtype act puts them in the activation dtype instead */
    p.g_dtype = KDA_F32;
    p.beta_dtype = KDA_F32;
    return p;
}

/* ------------------------------------------------------------------------- */
/* Error ratio                                                               */
/* ------------------------------------------------------------------------- */

/* RMS(ref - x) / RMS(ref): 0 when both are 0, +inf when x has a NaN or an inf
 * (or ref is all zero and x is not). */
static inline double kda_err_ratio(const double *ref, const float *x, size_t n)
{
    double se = 0.0, sr = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return INFINITY;
        double d = ref[i] - (double)x[i];
        se += d * d;
        sr += ref[i] * ref[i];
    }
    if (se == 0.0) return 0.0;
    if (sr == 0.0) return INFINITY;
    return sqrt(se / sr);
}

static inline double kda_err_ratio_f(const float *ref, const float *x, size_t n)
{
    double se = 0.0, sr = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return INFINITY;
        double r = (double)ref[i];
        double d = r - (double)x[i];
        se += d * d;
        sr += r * r;
    }
    if (se == 0.0) return 0.0;
    if (sr == 0.0) return INFINITY;
    return sqrt(se / sr);
}

/* "Overload": kda_err_ratio(ref, x, n) with ref double* or float*. */
#define kda_err_ratio(ref, x, n)                                                                     \
    _Generic((ref), float *: kda_err_ratio_f, const float *: kda_err_ratio_f, default: (kda_err_ratio))( \
        ref, x, n)

#endif /* KDA_TESTS_NPY_H */
