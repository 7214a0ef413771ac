/* tests/gpu_shim.h - runs a host-pointer test program on the GPU unchanged.
 *
 * Included after kda.h's implementation when KDA_TEST_GPU is defined: t_ctx()
 * then makes CUDA contexts, and kda_chunk_fwd / kda_chunk_bwd /
 * kda_recurrent_fwd on such a context upload every input (the sizes follow from
 * the kda_problem), run on the device and download every output. The buffer a
 * forward saved for the backward stays on the device, found again by its host
 * address. So test_props.c, built with -DKDA_TEST_GPU, checks the properties
 * and the finite-difference gradients on the GPU itself. */
#ifndef KDA_TESTS_GPU_SHIM_H
#define KDA_TESTS_GPU_SHIM_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *shim_up(kda_context *ctx, const void *host, size_t bytes) {
    void *d = NULL;
    if (!host) return NULL;
    if (kda_malloc(ctx, bytes ? bytes : 1, &d) != KDA_OK) { printf("kda_malloc: %s\n", kda_last_error(ctx)); exit(2); }
    kda_memcpy(ctx, d, host, bytes, KDA_COPY_H2D);
    return d;
}
/* an output buffer holding the host buffer's current bytes (outputs untouched stay so) */
#define shim_out shim_up
static void shim_down(kda_context *ctx, void *host, void *dev, size_t bytes) {
    if (host && dev) kda_memcpy(ctx, host, dev, bytes, KDA_COPY_D2H);
    kda_free(ctx, dev);
}

typedef struct { size_t q, v, g, beta, state, nseq; long long nt; } shim_sizes;
static shim_sizes shim_sizes_of(const kda_problem *p, const void *cu_host) {
    shim_sizes s;
    size_t rows = (size_t)p->B * p->T;
    s.q = rows * p->H * p->K * kda_dtype_size(p->dtype);
    s.v = rows * p->HV * p->V * kda_dtype_size(p->dtype);
    s.g = rows * p->HV * p->K * kda_dtype_size(p->g_dtype);
    s.beta = rows * p->HV * kda_dtype_size(p->beta_dtype);
    s.nseq = (size_t)kda_num_seqs(p);
    s.state = s.nseq * p->HV * p->K * p->V * sizeof(float);
    s.nt = p->chunk_size ? kda_num_chunks(p, cu_host) : 0;
    return s;
}
static kda_inputs shim_inputs(kda_context *ctx, const kda_problem *p, const kda_inputs *in, const shim_sizes *s) {
    kda_inputs d = *in;
    d.q = shim_up(ctx, in->q, s->q); d.k = shim_up(ctx, in->k, s->q); d.v = shim_up(ctx, in->v, s->v);
    d.g = shim_up(ctx, in->g, s->g); d.beta = shim_up(ctx, in->beta, s->beta);
    d.A_log = (const float *)shim_up(ctx, in->A_log, sizeof(float) * p->HV);
    d.dt_bias = (const float *)shim_up(ctx, in->dt_bias, sizeof(float) * p->HV * p->K);
    d.h0 = (const float *)shim_up(ctx, in->h0, s->state);
    if (p->num_seqs > 0 && in->cu_seqlens) {
        d.cu_seqlens = shim_up(ctx, in->cu_seqlens, (s->nseq + 1) * (p->seqlens_type == KDA_INDEX_I64 ? 8 : 4));
        d.cu_seqlens_host = in->cu_seqlens;
    }
    return d;
}
static void shim_free_inputs(kda_context *ctx, kda_inputs *d) {
    kda_free(ctx, (void *)d->q); kda_free(ctx, (void *)d->k); kda_free(ctx, (void *)d->v); kda_free(ctx, (void *)d->g);
    kda_free(ctx, (void *)d->beta); kda_free(ctx, (void *)d->A_log); kda_free(ctx, (void *)d->dt_bias);
    kda_free(ctx, (void *)d->h0); kda_free(ctx, (void *)d->cu_seqlens);
}

/* saved buffers: host address -> device copy */
static struct { const void *host; void *dev; } shim_saved[16];
static void *shim_saved_dev(kda_context *ctx, const void *host, size_t bytes, int create) {
    int i, free_slot = -1;
    for (i = 0; i < 16; i++) {
        if (shim_saved[i].host == host) return shim_saved[i].dev;
        if (!shim_saved[i].host && free_slot < 0) free_slot = i;
    }
    if (!create || free_slot < 0) return NULL;
    shim_saved[free_slot].host = host;
    kda_malloc(ctx, bytes, &shim_saved[free_slot].dev);
    return shim_saved[free_slot].dev;
}

static kda_status shim_chunk_fwd(kda_context *ctx, const kda_problem *p, const kda_inputs *in, const kda_fwd_outputs *out) {
    shim_sizes s;
    kda_inputs d;
    kda_fwd_outputs o;
    kda_status st;
    size_t hb;
    if (kda_context_backend(ctx) == KDA_BACKEND_CPU || !p || !in || !out) return kda_chunk_fwd(ctx, p, in, out);
    s = shim_sizes_of(p, in->cu_seqlens);
    hb = (size_t)(s.nt > 0 ? s.nt : 0) * p->HV * p->K * p->V * sizeof(float);
    d = shim_inputs(ctx, p, in, &s);
    o = *out;
    o.o = shim_out(ctx, out->o, s.v);
    o.ht = (float *)shim_out(ctx, out->ht, s.state);
    o.h = (float *)shim_out(ctx, out->h, hb);
    if (out->saved) o.saved = shim_saved_dev(ctx, out->saved, kda_fwd_saved_size(p), 1);
    st = kda_chunk_fwd(ctx, p, &d, &o);
    shim_down(ctx, out->o, o.o, s.v);
    shim_down(ctx, out->ht, o.ht, s.state);
    shim_down(ctx, out->h, o.h, hb);
    shim_free_inputs(ctx, &d);
    return st;
}

static kda_status shim_chunk_bwd(kda_context *ctx, const kda_problem *p, const kda_inputs *in, const kda_bwd_io *io) {
    shim_sizes s;
    kda_inputs d;
    kda_bwd_io b;
    kda_status st;
    if (kda_context_backend(ctx) == KDA_BACKEND_CPU || !p || !in || !io) return kda_chunk_bwd(ctx, p, in, io);
    s = shim_sizes_of(p, in->cu_seqlens);
    d = shim_inputs(ctx, p, in, &s);
    b = *io;
    b.dout = shim_up(ctx, io->dout, s.v);
    b.dht = (const float *)shim_up(ctx, io->dht, s.state);
    b.saved = io->saved ? shim_saved_dev(ctx, io->saved, 0, 0) : NULL;
    b.dq = shim_out(ctx, io->dq, s.q); b.dk = shim_out(ctx, io->dk, s.q); b.dv = shim_out(ctx, io->dv, s.v);
    b.dg = shim_out(ctx, io->dg, s.g); b.dbeta = shim_out(ctx, io->dbeta, s.beta);
    b.dh0 = (float *)shim_out(ctx, io->dh0, s.state);
    b.dA_log = (float *)shim_out(ctx, io->dA_log, sizeof(float) * p->HV);
    b.ddt_bias = (float *)shim_out(ctx, io->ddt_bias, sizeof(float) * p->HV * p->K);
    st = kda_chunk_bwd(ctx, p, &d, &b);
    shim_down(ctx, io->dq, b.dq, s.q); shim_down(ctx, io->dk, b.dk, s.q); shim_down(ctx, io->dv, b.dv, s.v);
    shim_down(ctx, io->dg, b.dg, s.g); shim_down(ctx, io->dbeta, b.dbeta, s.beta);
    shim_down(ctx, io->dh0, b.dh0, s.state); shim_down(ctx, io->dA_log, b.dA_log, sizeof(float) * p->HV);
    shim_down(ctx, io->ddt_bias, b.ddt_bias, sizeof(float) * p->HV * p->K);
    kda_free(ctx, (void *)b.dout); kda_free(ctx, (void *)b.dht);
    shim_free_inputs(ctx, &d);
    return st;
}

static kda_status shim_recurrent_fwd(kda_context *ctx, const kda_problem *p, const kda_inputs *in, const kda_recurrent_io *io) {
    shim_sizes s;
    kda_inputs d;
    kda_recurrent_io r;
    kda_status st;
    size_t pool = 0;
    if (kda_context_backend(ctx) == KDA_BACKEND_CPU || !p || !in || !io) return kda_recurrent_fwd(ctx, p, in, io);
    s = shim_sizes_of(p, in->cu_seqlens);
    d = shim_inputs(ctx, p, in, &s);
    r = *io;
    r.o = shim_out(ctx, io->o, s.v);
    r.ht = (float *)shim_out(ctx, io->ht, s.state);
    if (io->state_pool) {
        pool = (size_t)(io->num_slots > 0 ? io->num_slots : 0) * p->HV * p->K * p->V * kda_dtype_size(io->state_dtype);
        r.state_pool = (float *)shim_out(ctx, io->state_pool, pool);
        r.slots = (const int32_t *)shim_up(ctx, io->slots, s.nseq * sizeof(int32_t));
        r.slots_host = io->slots;
    }
    st = kda_recurrent_fwd(ctx, p, &d, &r);
    shim_down(ctx, io->o, r.o, s.v);
    shim_down(ctx, io->ht, r.ht, s.state);
    if (io->state_pool) { shim_down(ctx, io->state_pool, r.state_pool, pool); kda_free(ctx, (void *)r.slots); }
    shim_free_inputs(ctx, &d);
    return st;
}

#define kda_chunk_fwd shim_chunk_fwd
#define kda_chunk_bwd shim_chunk_bwd
#define kda_recurrent_fwd shim_recurrent_fwd
#endif /* KDA_TESTS_GPU_SHIM_H */
