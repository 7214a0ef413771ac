/* tests/test_jit.c - the kernel loading path without a GPU: one kernel's cubin
 * through kda.h's own lookup (embedded, KDA_CUBIN_DIR, disk cache, NVRTC) for a
 * stand-in device of a given architecture. tests/test_jit.sh drives it.
 *
 *   test_jit get NAME [ARCH [GATE G_DTYPE]]
 *                              prints "embedded" | "aot" | "cache hit" | "cache miss"
 *                              and "specialised" | "generic", and exits 0, or prints the error and exits 1; in
 *                              both cases it then runs a small CPU forward and
 *                              prints "cpu ok" (the CPU path works without NVRTC).
 *                              GATE G_DTYPE (kda_gate, kda_dtype numbers): what a
 *                              launch for a problem with them gets (kda__kspec,
 *                              kda__cubin_resolve: KDA_SPECIALIZE and KDA_CUBIN_DIR
 *                              decide between the specialisation and the generic kernel)
 *   test_jit list              the kernel names */
#define KDA_IMPLEMENTATION
#include "../kda.h"

#include <stdio.h>
#include <string.h>

static int cpu_forward(void) {
    kda_context *ctx = NULL;
    kda_problem p = kda_problem_default(1, 40, 1, 8, 8);
    float q[320], k[320], v[320], g[320], beta[40], o[320];
    kda_inputs in;
    kda_fwd_outputs out;
    int i, ok;
    for (i = 0; i < 320; i++) { q[i] = k[i] = 0.35f; v[i] = (float)(i % 7); g[i] = -0.1f; }
    for (i = 0; i < 40; i++) beta[i] = 0.5f;
    memset(&in, 0, sizeof in);
    in.q = q; in.k = k; in.v = v; in.g = g; in.beta = beta;
    memset(&out, 0, sizeof out);
    out.o = o;
    ok = kda_context_create(&ctx, KDA_BACKEND_CPU, NULL) == KDA_OK && kda_chunk_fwd(ctx, &p, &in, &out) == KDA_OK && o[319] == o[319];
    kda_context_destroy(ctx);
    return ok;
}

int main(int argc, char **argv) {
    kda_context *ctx = NULL;
    kda__cuda c;
    const kda__kdesc *k = NULL;
    unsigned char *buf = NULL;
    const unsigned char *payload = NULL;
    size_t n = 0;
    int i, origin = 0, wfail = 0, rc, spec, used = 0;
    kda_status s;
    if (argc >= 2 && !strcmp(argv[1], "list")) {
        for (i = 0; i < kda_kernel_count(); i++) printf("%s\n", kda_kernel_name(i));
        return 0;
    }
    if (argc < 3 || strcmp(argv[1], "get") != 0) {
        fprintf(stderr, "usage: test_jit get NAME [ARCH [GATE G_DTYPE]] | test_jit list\n");
        return 2;
    }
    for (i = 0; i < KDA__NUM_KERNELS; i++)
        if (!strcmp(kda__kernels[i].name, argv[2])) k = &kda__kernels[i];
    if (!k) { printf("no kernel %s\n", argv[2]); return 2; }
    kda_context_create(&ctx, KDA_BACKEND_CPU, NULL);
    memset(&c, 0, sizeof c);
    snprintf(c.arch, sizeof c.arch, "%s", argc > 3 ? argv[3] : "sm_90a");
    c.nv_ok = kda__nvrtc_load(&c.nv, c.nv_tried, sizeof c.nv_tried) == 0;
    kda__cache_prepare(ctx, &c);
    kda__spec_policy(&c); /* as a CUDA context sets it: KDA_SPECIALIZE, ahead-of-time cubins at hand */
    spec = argc > 5 ? kda__kspec_of(&c, k, atoi(argv[4]), atoi(argv[5])) : 0;
    s = kda__cubin_resolve(ctx, &c, k, spec, &buf, &n, &payload, &origin, &wfail, &used);
    if (wfail) kda__cache_write_failed(ctx, &c);
    if (s == KDA_OK && payload) {
        printf("%s\n%s\n", kda__origin[origin], used ? "specialised" : "generic");
        rc = 0;
    } else {
        printf("error %s: %s\n", kda_status_string(s), kda_last_error(ctx));
        rc = 1;
    }
    free(buf);
    if (c.nv.lib) dlclose(c.nv.lib);
    kda_context_destroy(ctx);
    printf("%s\n", cpu_forward() ? "cpu ok" : "cpu FAILED");
    return rc;
}
