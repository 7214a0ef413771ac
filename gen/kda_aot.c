#define _POSIX_C_SOURCE 200809L /* strdup, strtok_r, sysconf, mkdir */
/* kda-aot: compiles the kernel table through kda.h's own NVRTC path, no GPU needed.
 *
 *   kda-aot [--arch "sm_80 sm_90a"] [--only NAME]... [--spec GATE,G_DTYPE]... [--out DIR] [--embed FILE]
 *           [--threads N]
 *
 * Without --out it only checks that every kernel compiles (make nvrtc-check) and
 * prints "compiled N kernels for sm_80 sm_90a, F failed" with each failure's log.
 * With --out it writes each cubin (with kda's verification header) as
 * DIR/<kernel>_<arch>_<digest>.cubin, the names KDA_CUBIN_DIR is searched by, plus
 * DIR/manifest.txt; --embed also writes FILE, the header KDA_EMBED_CUBINS includes.
 * --spec adds, for each fused forward kernel, its specialisation for a problem with that
 * gate form and g dtype (kda_gate, kda_dtype numbers; kda_compile_kernel_gate), which
 * kda.h then takes from DIR or FILE instead of the generic kernel; g dtypes that a kernel
 * never sees (f16 g for a bf16 kernel) are left out.
 * --ptxas-check prints what ptxas reports beyond registers: each kernel's spill code and any
 * wgmma it serialises. --ptxas-baseline FILE (make nvrtc-check: gen/ptxas_baseline.txt) also
 * fails a kernel whose spill code grew past FILE's line for it (none: no spill code) or that
 * serialises wgmma, where FILE was written by this NVRTC version (with another, it only
 * reports); --ptxas-write FILE writes the baseline (make ptxas-baseline). Exit status 0 only
 * when every kernel compiled and passed those checks.
 * --print-options compiles nothing: it prints, one a line, the NVRTC options kda.h compiles the
 * first selected kernel with (the first --only, --arch and --spec), so that bench/ptx_blocks.py
 * compiles its PTX as kda.h does. */
#include <sys/stat.h>
#define KDA_IMPLEMENTATION
#include "../kda.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int kernel, gate, g_dtype; /* gate -1: the generic kernel */
    const char *arch;
    void *cubin;
    size_t size;
    char file[256];
    kda_status status;
    char *error;
    char *report; /* --ptxas-check: ptxas's lines on spill code and serialised wgmma */
    int spill_st, spill_ld, serial; /* from them: spill bytes stored and loaded, wgmma serialised */
    int base_st, base_ld;           /* --ptxas-baseline: its line for the job (spill_st, spill_ld then count past it) */
} job;

static job *jobs;
static int njobs, next_job, ptxas_check;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* --ptxas-check: keeps ptxas's lines that say what a kernel costs beyond its registers, the
 * spill code and the wgmma it serialises (which cost the fused forward 10% and 17%:
 * bench/RESULTS.md, 2026-11-26), on the job being compiled (user: the worker's job pointer) */
static void ptxas_line(void *user, const char *line) {
    job *j = *(job **)user;
    const char *sp = strstr(line, "bytes spill stores");
    size_t n, m;
    char *r;
    if (!j || !(strstr(line, "Performance Loss") || (sp && !(strstr(line, " 0 bytes spill stores, 0 bytes spill loads")))))
        return;
    n = j->report ? strlen(j->report) : 0, m = strlen(line);
    if ((r = (char *)realloc(j->report, n + m + 2)) == NULL) return;
    memcpy(r + n, line, m);
    r[n + m] = '\n', r[n + m + 1] = 0;
    j->report = r;
}

/* a context whose log lines go to *cur's report (--ptxas-check) */
static kda_context *compile_context(job **cur) {
    kda_context *ctx = NULL;
    kda_context_options o;
    memset(&o, 0, sizeof o);
    o.log = ptxas_check ? ptxas_line : NULL, o.user = cur;
    if (kda_context_create(&ctx, KDA_BACKEND_CPU, &o) != KDA_OK) return NULL;
    ctx->ptxas_info = ptxas_check;
    return ctx;
}

static void compile_job(kda_context *ctx, job *j) {
    j->status = j->gate < 0 ? kda_compile_kernel(ctx, j->kernel, j->arch, &j->cubin, &j->size, j->file, sizeof j->file)
                            : kda_compile_kernel_gate(ctx, j->kernel, (kda_gate)j->gate, (kda_dtype)j->g_dtype, j->arch, &j->cubin,
                                                      &j->size, j->file, sizeof j->file);
    if (j->status != KDA_OK) j->error = strdup(kda_last_error(ctx));
}

static void *worker(void *arg) {
    job *cur = NULL;
    kda_context *ctx = compile_context(&cur);
    (void)arg;
    if (!ctx) return NULL;
    for (;;) {
        job *j;
        pthread_mutex_lock(&lock);
        j = next_job < njobs ? &jobs[next_job++] : NULL;
        pthread_mutex_unlock(&lock);
        if (!j) break;
        cur = j;
        compile_job(ctx, j);
    }
    kda_context_destroy(ctx);
    return NULL;
}

static int write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(data, 1, n, f) == n;
    if (f && fclose(f) != 0) ok = 0;
    if (!ok) fprintf(stderr, "kda-aot: cannot write %s\n", path);
    return ok ? 0 : -1;
}

static int write_embed(const char *path) {
    FILE *f = fopen(path, "w");
    int i;
    size_t b;
    if (!f) { fprintf(stderr, "kda-aot: cannot write %s\n", path); return -1; }
    fprintf(f, "/* GENERATED by kda-aot: cubins for KDA_EMBED_CUBINS (build output, never committed). */\n");
    fprintf(f, "typedef struct { const char *name, *arch; const unsigned char *bytes; size_t size; } kda__cubin_entry;\n");
    for (i = 0; i < njobs; i++) {
        const unsigned char *p = (const unsigned char *)jobs[i].cubin;
        if (jobs[i].status != KDA_OK) continue;
        fprintf(f, "static const unsigned char kda__cubin_%d[] = {", i);
        for (b = 0; b < jobs[i].size; b++) fprintf(f, "%s%u,", b % 24 ? "" : "\n", p[b]);
        fprintf(f, "\n};\n");
    }
    fprintf(f, "static const kda__cubin_entry kda__embedded[] = {\n");
    for (i = 0; i < njobs; i++)
        if (jobs[i].status == KDA_OK)
            fprintf(f, "    {\"%s\", \"%s\", kda__cubin_%d, sizeof kda__cubin_%d},\n", kda_kernel_name(jobs[i].kernel),
                    jobs[i].arch, i, i);
    fprintf(f, "};\n");
    return fclose(f) == 0 ? 0 : -1;
}

static void ptxas_print(const job *j) {
    if (j->report)
        printf("PTXAS %s %s (gate %d, g %d):\n%s", kda_kernel_name(j->kernel), j->arch, j->gate, j->g_dtype, j->report);
}

/* the job's spill bytes and serialised wgmma, from its ptxas lines */
static void ptxas_parse(job *j) {
    const char *r = j->report, *at;
    int st, ld;
    for (at = r; at && (at = strstr(at, "bytes stack frame, ")) != NULL; at++)
        if (sscanf(at, "bytes stack frame, %d bytes spill stores, %d bytes spill loads", &st, &ld) == 2)
            j->spill_st += st, j->spill_ld += ld;
    j->serial = r && strstr(r, "Performance Loss") != NULL;
}

/* A job past the baseline, compiled again alone, twice at most; it keeps the compile that
 * spilled least. ptxas once spilled more in one compile of unchanged source (a clean clone's
 * make nvrtc-check, 2026-11-28: 48/100 bytes stored/loaded for bwd_dhu f32 bv32 on sm_80,
 * against its 32/84 in every run before and after), so a failure must hold in every compile;
 * a change that spills fails as before. Prints what each compile reported. */
static void recheck(job *j) {
    job *cur = NULL;
    kda_context *ctx = compile_context(&cur);
    int k;
    for (k = 0; ctx && k < 2 && (j->spill_st > 0 || j->spill_ld > 0 || j->serial); k++) {
        job again = *j;
        again.report = NULL, again.error = NULL, again.cubin = NULL;
        again.spill_st = again.spill_ld = again.serial = 0;
        cur = &again;
        compile_job(ctx, &again);
        ptxas_parse(&again);
        again.spill_st -= j->base_st, again.spill_ld -= j->base_ld; /* past the baseline */
        printf("RECHECK %s %s (gate %d, g %d): %d/%d bytes past the baseline, then %d/%d\n", kda_kernel_name(j->kernel), j->arch,
               j->gate, j->g_dtype, j->spill_st, j->spill_ld, again.spill_st, again.spill_ld);
        if (again.status == KDA_OK && again.spill_st <= j->spill_st && again.spill_ld <= j->spill_ld && !again.serial) {
            free(j->report), free(j->cubin);
            j->report = again.report, j->cubin = again.cubin, j->size = again.size, again.report = NULL, again.cubin = NULL;
            j->spill_st = again.spill_st, j->spill_ld = again.spill_ld, j->serial = again.serial;
        }
        free(again.report), free(again.error), free(again.cubin);
    }
    if (ctx) kda_context_destroy(ctx);
}

/* The baseline's "nvrtc MAJOR.MINOR" line and one line a kernel with spill code:
 * "NAME ARCH GATE G_DTYPE STORED LOADED". Checks every job against it; returns the failures,
 * or 0 with a note where the file is another NVRTC version's (compilers spill differently) */
static int ptxas_baseline(const char *path, int major, int minor) {
    FILE *f = fopen(path, "r");
    char line[512], name[256], arch[32];
    int bmaj = -1, bmin = -1, gate, gd, st, ld, i, bad = 0, better = 0;
    if (!f) { printf("FAILED: cannot read the ptxas baseline %s\n", path); return 1; }
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "nvrtc %d.%d", &bmaj, &bmin) == 2) continue;
        if (line[0] == '#' || sscanf(line, "%255s %31s %d %d %d %d", name, arch, &gate, &gd, &st, &ld) != 6) continue;
        for (i = 0; i < njobs; i++)
            if (!strcmp(kda_kernel_name(jobs[i].kernel), name) && !strcmp(jobs[i].arch, arch) && jobs[i].gate == gate &&
                jobs[i].g_dtype == gd)
                jobs[i].spill_st -= st, jobs[i].spill_ld -= ld, /* now the growth past the baseline */
                    jobs[i].base_st = st, jobs[i].base_ld = ld;
    }
    fclose(f);
    if (bmaj != major || bmin != minor) {
        for (i = 0; i < njobs; i++) ptxas_print(&jobs[i]);
        printf("ptxas baseline %s is NVRTC %d.%d's, this is %d.%d: spill code reported above, not checked\n", path, bmaj, bmin,
               major, minor);
        return 0;
    }
    for (i = 0; i < njobs; i++) {
        job *j = &jobs[i];
        if (j->spill_st > 0 || j->spill_ld > 0 || j->serial) recheck(j);
        if (j->spill_st > 0 || j->spill_ld > 0 || j->serial) {
            printf("FAILED %s %s (gate %d, g %d): %s\n", kda_kernel_name(j->kernel), j->arch, j->gate, j->g_dtype,
                   j->serial ? "ptxas serialises its wgmma" : "more spill code than the ptxas baseline");
            ptxas_print(j);
            bad++;
        }
        better += j->spill_st < 0 || j->spill_ld < 0;
    }
    if (better) printf("%d kernel(s) spill less than %s says: make ptxas-baseline records that\n", better, path);
    return bad;
}

static int ptxas_write(const char *path, int major, int minor) {
    FILE *f = fopen(path, "w");
    int i;
    if (!f) { fprintf(stderr, "kda-aot: cannot write %s\n", path); return 1; }
    fprintf(f, "# kda-aot --ptxas-check baseline (make ptxas-baseline): every kernel with spill code,\n"
               "# name arch gate g_dtype bytes-stored bytes-loaded (gate -1: the generic kernel)\nnvrtc %d.%d\n", major, minor);
    for (i = 0; i < njobs; i++)
        if (jobs[i].status == KDA_OK && (jobs[i].spill_st || jobs[i].spill_ld))
            fprintf(f, "%s %s %d %d %d %d\n", kda_kernel_name(jobs[i].kernel), jobs[i].arch, jobs[i].gate, jobs[i].g_dtype,
                    jobs[i].spill_st, jobs[i].spill_ld);
    return fclose(f) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    const char *archs = "sm_80 sm_90a", *out = NULL, *embed = NULL, *baseline = NULL, *write = NULL;
    const char *only[256];
    char arch_list[256], arch_buf[8][32], *a, *save = NULL, *arch_v[8];
    int nonly = 0, narch = 0, nthreads = 0, i, k, failed = 0, nspec = 0, spec[9][2], x, print_options = 0;
    pthread_t tid[64];
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--arch") && i + 1 < argc) archs = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc && nonly < 256) only[nonly++] = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--embed") && i + 1 < argc) embed = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) nthreads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ptxas-check")) ptxas_check = 1;
        else if (!strcmp(argv[i], "--print-options")) print_options = 1;
        else if (!strcmp(argv[i], "--ptxas-baseline") && i + 1 < argc) baseline = argv[++i], ptxas_check = 1;
        else if (!strcmp(argv[i], "--ptxas-write") && i + 1 < argc) write = argv[++i], ptxas_check = 1;
        else if (!strcmp(argv[i], "--spec") && i + 1 < argc && nspec < 9 &&
                 sscanf(argv[i + 1], "%d,%d", &spec[nspec][0], &spec[nspec][1]) == 2 && spec[nspec][0] >= 0 &&
                 spec[nspec][0] <= 2 && spec[nspec][1] >= 0 && spec[nspec][1] <= 2)
            nspec++, i++;
        else {
            fprintf(stderr, "usage: kda-aot [--arch \"sm_80 sm_90a\"] [--only NAME]... [--spec GATE,G_DTYPE]... [--out DIR] "
                            "[--embed FILE] [--threads N] [--ptxas-check] [--ptxas-baseline FILE] [--ptxas-write FILE] "
                            "[--print-options]\n");
            return 2;
        }
    }
    snprintf(arch_list, sizeof arch_list, "%s", archs);
    for (a = strtok_r(arch_list, " ,", &save); a && narch < 8; a = strtok_r(NULL, " ,", &save)) {
        snprintf(arch_buf[narch], sizeof arch_buf[narch], "%s%s", strncmp(a, "sm_", 3) ? "sm_" : "", a); /* "90a" or "sm_90a" */
        arch_v[narch] = arch_buf[narch];
        narch++;
    }
    jobs = (job *)calloc((size_t)kda_kernel_count() * (size_t)narch * (size_t)(nspec + 1) + 1, sizeof(job));
    for (k = 0; k < kda_kernel_count(); k++) {
        const kda__kdesc *kd = &kda__kernels[k];
        const int fused = kda__kspec(kd, 0, 0) != 0; /* (kernels with specialisations) */
        int keep = nonly == 0;
        for (i = 0; i < nonly; i++) keep |= !strcmp(only[i], kd->name);
        for (x = -1; keep && x < (fused ? nspec : 0); x++) {
            if (x >= 0 && !kda__kspec_takes(kd, spec[x][1])) continue; /* a g dtype no problem gives it */
            for (i = 0; i < narch; i++) {
                jobs[njobs].kernel = k, jobs[njobs].arch = arch_v[i];
                jobs[njobs].gate = x < 0 ? -1 : spec[x][0], jobs[njobs].g_dtype = x < 0 ? -1 : spec[x][1];
                njobs++;
            }
        }
    }
    if (njobs == 0) { fprintf(stderr, "kda-aot: no kernel selected (%d in the table)\n", kda_kernel_count()); return 2; }
    if (print_options) { /* the first kernel for the first arch: its first --spec where it has one, else generic */
        const job *j = &jobs[0];
        const char *opts[8];
        char buf[3][32];
        for (i = 0; nspec && i < njobs && jobs[i].kernel == jobs[0].kernel; i++)
            if (jobs[i].arch == arch_v[0] && jobs[i].gate == spec[0][0] && jobs[i].g_dtype == spec[0][1]) j = &jobs[i];
        x = kda__nvrtc_options(j->arch, j->gate < 0 ? 0 : kda__kspec(&kda__kernels[j->kernel], j->gate, j->g_dtype), opts, buf);
        for (i = 0; i < x; i++) puts(opts[i]);
        return 0;
    }
    if (nthreads <= 0) nthreads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (nthreads > 64) nthreads = 64;
    for (i = 0; i < nthreads; i++) pthread_create(&tid[i], NULL, worker, NULL);
    for (i = 0; i < nthreads; i++) pthread_join(tid[i], NULL);
    for (i = 0; i < njobs; i++) {
        ptxas_parse(&jobs[i]);
        if (!baseline) ptxas_print(&jobs[i]); /* (against a baseline: the failures' alone) */
    }
    if (baseline || write) {
        kda__nvrtc nv;
        char tried[512];
        if (kda__nvrtc_load(&nv, tried, sizeof tried) != 0) { printf("FAILED: no NVRTC (%s)\n", tried); return 1; }
        if (write && ptxas_write(write, nv.major, nv.minor)) failed++;
        if (baseline) failed += ptxas_baseline(baseline, nv.major, nv.minor);
    }
    for (i = 0; i < njobs; i++)
        if (jobs[i].status != KDA_OK) {
            failed++;
            printf("FAILED %s %s (gate %d, g %d): %s\n", kda_kernel_name(jobs[i].kernel), jobs[i].arch, jobs[i].gate, jobs[i].g_dtype,
                   jobs[i].error ? jobs[i].error : "?");
        }
    if (out) {
        char path[1024];
        FILE *m;
        snprintf(path, sizeof path, "%s/manifest.txt", out);
        mkdir(out, 0755);
        m = fopen(path, "w");
        if (!m) { fprintf(stderr, "kda-aot: cannot write %s\n", path); return 1; }
        fprintf(m, "# kda %s cubins: file kernel arch bytes [gate g_dtype: a specialisation]\n", KDA_VERSION_STRING);
        for (i = 0; i < njobs; i++) {
            if (jobs[i].status != KDA_OK) continue;
            snprintf(path, sizeof path, "%s/%s", out, jobs[i].file);
            if (write_file(path, jobs[i].cubin, jobs[i].size)) failed++;
            fprintf(m, "%s %s %s %zu", jobs[i].file, kda_kernel_name(jobs[i].kernel), jobs[i].arch, jobs[i].size);
            if (jobs[i].gate >= 0) fprintf(m, " %d %d", jobs[i].gate, jobs[i].g_dtype);
            fprintf(m, "\n");
        }
        fclose(m);
    }
    if (embed && write_embed(embed)) failed++;
    printf("compiled %d kernels%s for", njobs / narch, nspec ? " (specialisations included)" : "");
    for (i = 0; i < narch; i++) printf(" %s", arch_v[i]);
    printf(", %d failed\n", failed);
    for (i = 0; i < njobs; i++) { free(jobs[i].cubin); free(jobs[i].error); free(jobs[i].report); }
    free(jobs);
    return failed ? 1 : 0;
}
