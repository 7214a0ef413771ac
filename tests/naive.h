/* tests/naive.h - float64 reference KDA forward: the test oracle.
 *
 * Spec section 2.1, token by token, in double, written independently of kda.h's
 * implementation (only kda.h's types are used for the options). Header only.
 *
 * Per sequence, value head hv (q/k head hv / (HV/H)) and token t:
 *   q, k <- x / sqrt(sum x^2 + 1e-6) when p->qk_l2norm;  q <- scale q
 *   a = g, or the gate of g (spec 2.4);  b = beta, sigmoid(beta) or 2 sigmoid(beta)
 *   S <- Diag(exp(a)) S;  e = v - S^T k;  S <- S + b k e^T;  o = S^T q
 *
 * Layouts as in kda.h: q, k [B,T,H,K]; v, o [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV];
 * A_log [HV]; dt_bias [HV*K]; h0, ht [N,HV,K,V] (KDA_STATE_KV) or [N,HV,V,K]
 * (KDA_STATE_VK). Varlen when p->num_seqs > 0: B == 1, sequence n covers tokens
 * cu_seqlens[n] .. cu_seqlens[n+1]-1. Otherwise sequence n is batch row n.
 * Optional: A_log (softplus gate: NULL means A_log = 0, i.e. exp(A) = 1; lower
 * bound: NULL means c = 1), dt_bias, h0 (NULL = zeros), ht (NULL = not written).
 */
#ifndef KDA_TESTS_NAIVE_H
#define KDA_TESTS_NAIVE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../kda.h"

static inline double kda_naive__sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Log decay of key channel d for value head hv, from the given g value (spec 2.4). */
static inline double kda_naive__decay(const kda_problem *p, double g, int hv, int d, const double *A_log,
                                      const double *dt_bias)
{
    if (p->gate == KDA_GATE_NONE) return g;
    double z = g + (dt_bias ? dt_bias[(size_t)hv * p->K + d] : 0.0);
    double c = A_log ? exp(A_log[hv]) : 1.0;
    if (p->gate == KDA_GATE_SOFTPLUS) {
        double sp = z > 20.0 ? z : log1p(exp(z));
        return -c * sp;
    }
    return (double)p->lower_bound * kda_naive__sigmoid(c * z); /* KDA_GATE_LOWER_BOUND */
}

static inline void kda_naive_fwd(const kda_problem *p, const double *q, const double *k, const double *v,
                                 const double *g, const double *beta, const double *A_log,
                                 const double *dt_bias, const double *h0, const long long *cu_seqlens,
                                 double *o, double *ht)
{
    const int H = p->H, HV = p->HV, K = p->K, V = p->V, G = p->HV / p->H;
    const int N = p->num_seqs > 0 ? p->num_seqs : p->B;
    const double scale = p->scale != 0.0f ? (double)p->scale : 1.0 / sqrt((double)K);
    double *S = (double *)malloc(sizeof(double) * ((size_t)K * V + 2 * (size_t)K + V));
    double *qt = S + (size_t)K * V, *kt = qt + K, *e = kt + K;
    if (!S) abort();

    for (int n = 0; n < N; n++) {
        /* global token rows [r0, r1) of this sequence */
        long long r0 = p->num_seqs > 0 ? cu_seqlens[n] : (long long)n * p->T;
        long long r1 = p->num_seqs > 0 ? cu_seqlens[n + 1] : (long long)(n + 1) * p->T;
        for (int hv = 0; hv < HV; hv++) {
            const int h = hv / G;
            const size_t st = ((size_t)n * HV + hv) * K * V;
            for (int i = 0; i < K; i++)
                for (int j = 0; j < V; j++)
                    S[(size_t)i * V + j] = !h0 ? 0.0
                                           : p->state_layout == KDA_STATE_KV ? h0[st + (size_t)i * V + j]
                                                                             : h0[st + (size_t)j * K + i];
            for (long long r = r0; r < r1; r++) {
                const double *qr = q + ((size_t)r * H + h) * K, *kr = k + ((size_t)r * H + h) * K;
                const double *vr = v + ((size_t)r * HV + hv) * V, *gr = g + ((size_t)r * HV + hv) * K;
                double *orow = o + ((size_t)r * HV + hv) * V;
                /* 1. l2norm and scale */
                double nq = 1.0, nk = 1.0;
                if (p->qk_l2norm) {
                    double sq = 0.0, sk = 0.0;
                    for (int d = 0; d < K; d++) sq += qr[d] * qr[d], sk += kr[d] * kr[d];
                    nq = 1.0 / sqrt(sq + 1e-6), nk = 1.0 / sqrt(sk + 1e-6);
                }
                for (int d = 0; d < K; d++) qt[d] = scale * (qr[d] * nq), kt[d] = kr[d] * nk;
                /* 3. beta */
                double b = beta[(size_t)r * HV + hv];
                if (p->beta_sigmoid) b = (p->allow_neg_eigval ? 2.0 : 1.0) * kda_naive__sigmoid(b);
                /* 2, 4. decay each key row */
                for (int d = 0; d < K; d++) {
                    double f = exp(kda_naive__decay(p, gr[d], hv, d, A_log, dt_bias));
                    for (int j = 0; j < V; j++) S[(size_t)d * V + j] *= f;
                }
                /* 5. e = v - S^T k */
                for (int j = 0; j < V; j++) {
                    double s = 0.0;
                    for (int d = 0; d < K; d++) s += S[(size_t)d * V + j] * kt[d];
                    e[j] = vr[j] - s;
                }
                /* 6. S += b k e^T */
                for (int d = 0; d < K; d++)
                    for (int j = 0; j < V; j++) S[(size_t)d * V + j] += b * kt[d] * e[j];
                /* 7. o = S^T q */
                for (int j = 0; j < V; j++) {
                    double s = 0.0;
                    for (int d = 0; d < K; d++) s += S[(size_t)d * V + j] * qt[d];
                    orow[j] = s;
                }
            }
            if (ht)
                for (int i = 0; i < K; i++)
                    for (int j = 0; j < V; j++) {
                        if (p->state_layout == KDA_STATE_KV)
                            ht[st + (size_t)i * V + j] = S[(size_t)i * V + j];
                        else
                            ht[st + (size_t)j * K + i] = S[(size_t)i * V + j];
                    }
        }
    }
    free(S);
}

/* sum(o * dout) + sum(ht * dht) for the same inputs (dht may be NULL): the loss
 * whose finite differences the gradients must match. */
static inline double kda_naive_loss(const kda_problem *p, const double *q, const double *k, const double *v,
                                    const double *g, const double *beta, const double *A_log,
                                    const double *dt_bias, const double *h0, const long long *cu_seqlens,
                                    const double *dout, const double *dht)
{
    const int N = p->num_seqs > 0 ? p->num_seqs : p->B;
    const size_t no = (size_t)p->B * p->T * p->HV * p->V, ns = (size_t)N * p->HV * p->K * p->V;
    double *o = (double *)malloc(sizeof(double) * (no + ns + 1));
    double *ht = o + no;
    if (!o) abort();
    kda_naive_fwd(p, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, o, dht ? ht : NULL);
    double L = 0.0;
    for (size_t i = 0; i < no; i++) L += o[i] * dout[i];
    if (dht)
        for (size_t i = 0; i < ns; i++) L += ht[i] * dht[i];
    free(o);
    return L;
}

#endif /* KDA_TESTS_NAIVE_H */
