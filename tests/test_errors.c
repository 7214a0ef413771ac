/* tests/test_errors.c - every bad input returns its status, with a message that
 * says what was wrong, and writes nothing.
 *
 * A valid small f32 problem (B=2, T=20, H=HV=2, K=V=8, chunk 16, softplus gate
 * with A_log and dt_bias, beta logits, h0, ht, every gradient requested) is the
 * base; each case of the table applies one mutation. Before each call every
 * output buffer (o, ht, h, saved; dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias;
 * the state pool) is filled with a poison byte; after it, each must still be
 * bit-identical to the poison. The expected message is a list of pieces joined
 * by '|', all required; a piece "w:x" must appear as a whole word, and a piece
 * "null:x" as "x=" followed by what printf's %p prints for NULL (the library
 * names the missing input among the five it lists that way).
 *
 * Build: gcc -std=c11 -O2 -Wall -Wextra -Werror -o /tmp/test_errors tests/test_errors.c -lm -lpthread
 */
#define KDA_IMPLEMENTATION
#include "../kda.h"
#include "testlib.h"

#define POISON 0xA5

/* ------------------------------------------------------ buffers and base */

static t_inst I;          /* the base instance's fp32 inputs (40 rows) */
static kda_problem BASE;  /* fixed length */
static float *O, *HT, *HS, *DQ, *DK, *DV, *DG, *DBETA, *DH0, *DALOG, *DDTB, *POOL;
static void *SAVED;
#define NUM_SLOTS 3

typedef struct { void *ptr; size_t bytes; const char *name; } obuf;
static obuf OUTS[13];
static int NOUTS;

static void add_out(void *p, size_t bytes, const char *name) {
    OUTS[NOUTS].ptr = p; OUTS[NOUTS].bytes = bytes; OUTS[NOUTS].name = name; NOUTS++;
}
static void poison_all(void) {
    int i;
    for (i = 0; i < NOUTS; i++) memset(OUTS[i].ptr, POISON, OUTS[i].bytes);
}
/* Name of the first output buffer that is not all poison, or NULL. */
static const char *touched(void) {
    int i;
    size_t b;
    for (i = 0; i < NOUTS; i++)
        for (b = 0; b < OUTS[i].bytes; b++)
            if (((const unsigned char *)OUTS[i].ptr)[b] != POISON) return OUTS[i].name;
    return NULL;
}

static void setup(void) {
    size_t nh, saved;
    kda_problem pv;
    BASE = kda_problem_default(2, 20, 2, 8, 8);
    BASE.chunk_size = 16;
    BASE.gate = KDA_GATE_SOFTPLUS;
    BASE.beta_sigmoid = 1;
    t_seed(4242);
    t_inst_init(&I, &BASE, NULL, 1, 1);
    /* the varlen base (B=1, T=40, 2 sequences) has the same row count and N */
    pv = BASE;
    pv.B = 1; pv.T = 40; pv.num_seqs = 2;
    nh = (size_t)(kda_max_chunks(&BASE) > kda_max_chunks(&pv) ? kda_max_chunks(&BASE) : kda_max_chunks(&pv)) *
         BASE.HV * BASE.K * BASE.V;
    saved = kda_fwd_saved_size(&BASE) > kda_fwd_saved_size(&pv) ? kda_fwd_saved_size(&BASE) : kda_fwd_saved_size(&pv);
    O = t_alloc(I.nv); HT = t_alloc(I.ns); HS = t_alloc(nh); SAVED = t_alloc(saved / sizeof(float) + 1);
    DQ = t_alloc(I.nq); DK = t_alloc(I.nq); DV = t_alloc(I.nv); DG = t_alloc(I.ng); DBETA = t_alloc(I.nb);
    DH0 = t_alloc(I.ns); DALOG = t_alloc((size_t)BASE.HV); DDTB = t_alloc((size_t)BASE.HV * BASE.K);
    POOL = t_alloc((size_t)NUM_SLOTS * BASE.HV * BASE.K * BASE.V);
    add_out(O, I.nv * 4, "o"); add_out(HT, I.ns * 4, "ht"); add_out(HS, nh * 4, "h"); add_out(SAVED, saved, "saved");
    add_out(DQ, I.nq * 4, "dq"); add_out(DK, I.nq * 4, "dk"); add_out(DV, I.nv * 4, "dv"); add_out(DG, I.ng * 4, "dg");
    add_out(DBETA, I.nb * 4, "dbeta"); add_out(DH0, I.ns * 4, "dh0"); add_out(DALOG, (size_t)BASE.HV * 4, "dA_log");
    add_out(DDTB, (size_t)BASE.HV * BASE.K * 4, "ddt_bias");
    add_out(POOL, (size_t)NUM_SLOTS * BASE.HV * BASE.K * BASE.V * 4, "state_pool");
}
static void teardown(void) {
    free(O); free(HT); free(HS); free(SAVED); free(DQ); free(DK); free(DV); free(DG); free(DBETA); free(DH0);
    free(DALOG); free(DDTB); free(POOL);
    t_inst_free(&I);
}

/* One call's arguments: problem, inputs and the three ops' output structs. */
enum { MODE_FIXED, MODE_VARLEN, MODE_POOL };
typedef struct {
    kda_problem p;
    kda_inputs in;
    kda_fwd_outputs fo;
    kda_bwd_io bo;
    kda_recurrent_io ro;
    int32_t slots[2];
    int32_t cu32[3];
    int64_t cu64[3];
} env;

static void env_reset(env *e, int mode) {
    memset(e, 0, sizeof *e);
    e->p = BASE;
    e->in = t_inputs(&I);
    e->fo.o = O; e->fo.ht = HT; e->fo.h = HS; e->fo.saved = SAVED;
    e->bo.dout = I.dout; e->bo.dht = I.dht;
    e->bo.dq = DQ; e->bo.dk = DK; e->bo.dv = DV; e->bo.dg = DG; e->bo.dbeta = DBETA; e->bo.dh0 = DH0;
    e->bo.dA_log = DALOG; e->bo.ddt_bias = DDTB;
    e->ro.o = O; e->ro.ht = HT;
    e->cu32[0] = 0; e->cu32[1] = 17; e->cu32[2] = 40;
    e->cu64[0] = 0; e->cu64[1] = 17; e->cu64[2] = 40;
    e->slots[0] = 2; e->slots[1] = 0;
    if (mode == MODE_VARLEN) {
        e->p.B = 1; e->p.T = 40; e->p.num_seqs = 2; e->p.seqlens_type = KDA_INDEX_I32;
        e->in.cu_seqlens = e->cu32;
    }
    if (mode == MODE_POOL) {
        e->in.h0 = NULL;
        e->ro.ht = NULL;
        e->ro.state_pool = POOL; e->ro.slots = e->slots; e->ro.num_slots = NUM_SLOTS;
        e->fo.ht = NULL; e->fo.saved = NULL;
        e->fo.state_pool = POOL; e->fo.slots = e->slots; e->fo.num_slots = NUM_SLOTS;
    }
}

/* OP_P, OP_PF: the pool forms (MODE_POOL) of kda_recurrent_fwd and kda_chunk_fwd */
enum { OP_F = 1, OP_B = 2, OP_R = 4, OP_P = 8, OP_PF = 16, OP_FB = OP_F | OP_B, OP_FBR = OP_F | OP_B | OP_R, OP_POOLS = OP_P | OP_PF };
static const char *op_name(int op) {
    return op == OP_F ? "kda_chunk_fwd" : op == OP_B ? "kda_chunk_bwd" : op == OP_R ? "kda_recurrent_fwd"
                                                   : op == OP_P ? "kda_recurrent_fwd (pool)" : "kda_chunk_fwd (pool)";
}
static kda_status call_op(kda_context *ctx, int op, env *e) {
    if (op == OP_F || op == OP_PF) return kda_chunk_fwd(ctx, &e->p, &e->in, &e->fo);
    if (op == OP_B) return kda_chunk_bwd(ctx, &e->p, &e->in, &e->bo);
    return kda_recurrent_fwd(ctx, &e->p, &e->in, &e->ro);
}

/* Is `name` in msg as a whole word (not inside a longer identifier)? */
static int is_ident(char c) {
    return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}
static int has_word(const char *msg, const char *name, size_t n) {
    const char *s = msg;
    for (; *s; s++)
        if (strncmp(s, name, n) == 0 && (s == msg || !is_ident(s[-1])) && !is_ident(s[n])) return 1;
    return 0;
}
/* Every '|'-separated piece of want is in msg ("w:x" as a whole word). */
static int msg_matches(const char *msg, const char *want, char *missing, size_t cap) {
    const char *p = want;
    while (*p) {
        const char *e = strchr(p, '|');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        int word = n > 2 && p[0] == 'w' && p[1] == ':', ok;
        int null = n > 5 && strncmp(p, "null:", 5) == 0;
        const char *piece = word ? p + 2 : null ? p + 5 : p;
        size_t pn = word ? n - 2 : null ? n - 5 : n;
        if (null) {
            char buf[128];
            snprintf(buf, sizeof buf, "%.*s=%p", (int)pn, piece, (void *)NULL);
            ok = strstr(msg, buf) != NULL;
        } else if (word) {
            ok = has_word(msg, piece, pn);
        } else {
            char buf[128];
            snprintf(buf, sizeof buf, "%.*s", (int)pn, piece);
            ok = strstr(msg, buf) != NULL;
        }
        if (!ok) {
            snprintf(missing, cap, "%.*s", (int)n, p);
            return 0;
        }
        p += n;
        if (*p == '|') p++;
    }
    return 1;
}

/* ------------------------------------------------------------ the table */

enum {
    M_Q_NULL, M_K_NULL, M_V_NULL, M_G_NULL, M_BETA_NULL, M_O_NULL,
    M_B0, M_TNEG, M_H0, M_K0, M_V0, M_K257, M_V300, M_HV3,
    M_DTYPE7, M_GDT_F16_BF16, M_BDT_F16_F32, M_GDT_BF16_F16, M_BDT_BF16_F16, M_GDT7,
    M_CHUNK48, M_CHUNK0, M_GATE9, M_LB_M6, M_LB_0, M_LB_05, M_NEG_NO_SIG,
    M_SOFTPLUS_NO_ALOG, M_ALOG_GATE_NONE, M_DTB_GATE_NONE, M_SAFE_SOFTPLUS, M_LAYOUT5, M_SCALE_NAN, M_SCALE_INF,
    M_VARLEN_B2, M_NSEQ_NEG, M_NSEQ_NO_CU, M_CU_NO_NSEQ, M_CU_START, M_CU_START64, M_CU_DEC, M_CU_DEC64,
    M_CU_END, M_CU_END64, M_SEQTYPE3,
    M_DOUT_NULL, M_DALOG_GATE_NONE, M_DALOG_NO_ALOG, M_DDTB_NO_DTB, M_DDTB_GATE_NONE,
    M_SLOT_BIG, M_SLOT_DUP, M_POOL_H0, M_POOL_HT, M_POOL_SAVED, M_SLOTS_NO_POOL, M_POOL_NO_SLOTS, M_NUM_SLOTS0,
    M_POOL_DTYPE_F16, M_DTYPE_NO_POOL
};

static void mutate(env *e, int m) {
    kda_problem *p = &e->p;
    switch (m) {
    case M_Q_NULL: e->in.q = NULL; break;
    case M_K_NULL: e->in.k = NULL; break;
    case M_V_NULL: e->in.v = NULL; break;
    case M_G_NULL: e->in.g = NULL; break;
    case M_BETA_NULL: e->in.beta = NULL; break;
    case M_O_NULL: e->fo.o = NULL; e->ro.o = NULL; break;
    case M_B0: p->B = 0; break;
    case M_TNEG: p->T = -1; break;
    case M_H0: p->H = 0; break;
    case M_K0: p->K = 0; break;
    case M_V0: p->V = 0; break;
    case M_K257: p->K = 257; break;
    case M_V300: p->V = 300; break;
    case M_HV3: p->HV = 3; break;
    case M_DTYPE7: p->dtype = (kda_dtype)7; break;
    case M_GDT_F16_BF16: p->dtype = KDA_BF16; p->g_dtype = KDA_F16; break;
    case M_BDT_F16_F32: p->beta_dtype = KDA_F16; break;
    case M_GDT_BF16_F16: p->dtype = KDA_F16; p->g_dtype = KDA_BF16; break;
    case M_BDT_BF16_F16: p->dtype = KDA_F16; p->beta_dtype = KDA_BF16; break;
    case M_GDT7: p->g_dtype = (kda_dtype)7; break;
    case M_CHUNK48: p->chunk_size = 48; break;
    case M_CHUNK0: p->chunk_size = 0; break;
    case M_GATE9: p->gate = (kda_gate)9; break;
    case M_LB_M6: p->gate = KDA_GATE_LOWER_BOUND; p->lower_bound = -6.0f; break;
    case M_LB_0: p->gate = KDA_GATE_LOWER_BOUND; p->lower_bound = 0.0f; break;
    case M_LB_05: p->gate = KDA_GATE_LOWER_BOUND; p->lower_bound = 0.5f; break;
    case M_NEG_NO_SIG: p->beta_sigmoid = 0; p->allow_neg_eigval = 1; break;
    case M_SOFTPLUS_NO_ALOG: e->in.A_log = NULL; e->bo.dA_log = NULL; break;
    case M_ALOG_GATE_NONE:
        p->gate = KDA_GATE_NONE; e->in.dt_bias = NULL; e->bo.dA_log = NULL; e->bo.ddt_bias = NULL; break;
    case M_DTB_GATE_NONE:
        p->gate = KDA_GATE_NONE; e->in.A_log = NULL; e->bo.dA_log = NULL; e->bo.ddt_bias = NULL; break;
    case M_SAFE_SOFTPLUS: p->safe_gate = 1; break;
    case M_LAYOUT5: p->state_layout = (kda_layout)5; break;
    case M_SCALE_NAN: p->scale = NAN; break;
    case M_SCALE_INF: p->scale = INFINITY; break;
    case M_VARLEN_B2: /* fixed base (B=2, T=20) marked varlen */
        p->num_seqs = 2; e->cu32[1] = 10; e->cu32[2] = 20; e->in.cu_seqlens = e->cu32; break;
    case M_NSEQ_NEG: p->num_seqs = -1; break;
    case M_NSEQ_NO_CU: e->in.cu_seqlens = NULL; break;
    case M_CU_NO_NSEQ: e->in.cu_seqlens = e->cu32; break;
    case M_CU_START: e->cu32[0] = 1; break;
    case M_CU_START64: p->seqlens_type = KDA_INDEX_I64; e->in.cu_seqlens = e->cu64; e->cu64[0] = 1; break;
    case M_CU_DEC: e->cu32[1] = 41; break; /* 0, 41, 40 */
    case M_CU_DEC64: p->seqlens_type = KDA_INDEX_I64; e->in.cu_seqlens = e->cu64; e->cu64[1] = 41; break;
    case M_CU_END: e->cu32[2] = 39; break;
    case M_CU_END64: p->seqlens_type = KDA_INDEX_I64; e->in.cu_seqlens = e->cu64; e->cu64[2] = 39; break;
    case M_SEQTYPE3: p->seqlens_type = (kda_index_type)3; break;
    case M_DOUT_NULL: e->bo.dout = NULL; break;
    case M_DALOG_GATE_NONE: /* a consistent ungated problem that still asks for dA_log */
        p->gate = KDA_GATE_NONE; e->in.A_log = NULL; e->in.dt_bias = NULL; e->bo.ddt_bias = NULL; break;
    case M_DALOG_NO_ALOG: p->gate = KDA_GATE_LOWER_BOUND; p->lower_bound = -2.0f; e->in.A_log = NULL; break;
    case M_DDTB_NO_DTB: e->in.dt_bias = NULL; break;
    case M_DDTB_GATE_NONE:
        p->gate = KDA_GATE_NONE; e->in.A_log = NULL; e->in.dt_bias = NULL; e->bo.dA_log = NULL; break;
    case M_SLOT_BIG: e->slots[0] = NUM_SLOTS; break;
    case M_SLOT_DUP: e->slots[0] = 1; e->slots[1] = 1; break;
    case M_POOL_H0: e->in.h0 = I.h0; break;
    case M_POOL_HT: e->ro.ht = HT; e->fo.ht = HT; break;
    case M_POOL_SAVED: e->fo.saved = SAVED; break;
    case M_SLOTS_NO_POOL: e->ro.state_pool = NULL; e->fo.state_pool = NULL; break;
    case M_POOL_NO_SLOTS: e->ro.slots = NULL; e->fo.slots = NULL; break;
    case M_NUM_SLOTS0: e->ro.num_slots = 0; e->fo.num_slots = 0; break;
    case M_POOL_DTYPE_F16: e->ro.state_dtype = KDA_F16; e->fo.state_dtype = KDA_F16; break;
    case M_DTYPE_NO_POOL: e->ro.state_dtype = KDA_BF16; e->fo.state_dtype = KDA_BF16; break;
    }
}

typedef struct {
    const char *name;
    int mut, mode, ops;
    kda_status want;
    const char *msg;
} ecase;

#define INV KDA_ERROR_INVALID_ARGUMENT
static const ecase CASES[] = {
    {"q_null_is_rejected", M_Q_NULL, MODE_FIXED, OP_FBR, INV, "null:q|required"},
    {"k_null_is_rejected", M_K_NULL, MODE_FIXED, OP_FBR, INV, "null:k|required"},
    {"v_null_is_rejected", M_V_NULL, MODE_FIXED, OP_FBR, INV, "null:v|required"},
    {"g_null_is_rejected", M_G_NULL, MODE_FIXED, OP_FBR, INV, "null:g|required"},
    {"beta_null_is_rejected", M_BETA_NULL, MODE_FIXED, OP_FBR, INV, "null:beta|required"},
    {"o_null_is_rejected", M_O_NULL, MODE_FIXED, OP_F | OP_R | OP_P, INV, "w:o|required"},
    {"B_0_is_rejected", M_B0, MODE_FIXED, OP_FBR, INV, "B=0"},
    {"T_negative_is_rejected", M_TNEG, MODE_FIXED, OP_FBR, INV, "T=-1"},
    {"H_0_is_rejected", M_H0, MODE_FIXED, OP_FBR, INV, "H=0"},
    {"K_0_is_rejected", M_K0, MODE_FIXED, OP_FBR, INV, "K=0"},
    {"V_0_is_rejected", M_V0, MODE_FIXED, OP_FBR, INV, "V=0"},
    {"K_257_is_rejected", M_K257, MODE_FIXED, OP_FBR, INV, "K=257"},
    {"V_300_is_rejected", M_V300, MODE_FIXED, OP_FBR, INV, "V=300"},
    {"HV_not_multiple_of_H_is_rejected", M_HV3, MODE_FIXED, OP_FBR, INV, "HV=3|H=2"},
    {"dtype_7_is_rejected", M_DTYPE7, MODE_FIXED, OP_FBR, INV, "dtype=7"},
    {"g_dtype_f16_with_bf16_is_rejected", M_GDT_F16_BF16, MODE_FIXED, OP_FBR, INV, "g_dtype=f16|bf16"},
    {"beta_dtype_f16_with_f32_is_rejected", M_BDT_F16_F32, MODE_FIXED, OP_FBR, INV, "beta_dtype=f16"},
    {"g_dtype_bf16_with_f16_is_rejected", M_GDT_BF16_F16, MODE_FIXED, OP_FBR, INV, "g_dtype=bf16"},
    {"beta_dtype_bf16_with_f16_is_rejected", M_BDT_BF16_F16, MODE_FIXED, OP_FBR, INV, "beta_dtype=bf16"},
    {"g_dtype_7_is_rejected", M_GDT7, MODE_FIXED, OP_FBR, INV, "g_dtype"},
    {"chunk_size_48_is_rejected", M_CHUNK48, MODE_FIXED, OP_FB, INV, "chunk_size=48"},
    {"chunk_size_0_is_rejected", M_CHUNK0, MODE_FIXED, OP_FB, INV, "chunk_size=0"},
    {"gate_9_is_rejected", M_GATE9, MODE_FIXED, OP_FBR, INV, "gate=9"},
    {"lower_bound_minus_6_is_rejected", M_LB_M6, MODE_FIXED, OP_FBR, INV, "lower_bound=-6"},
    {"lower_bound_0_is_rejected", M_LB_0, MODE_FIXED, OP_FBR, INV, "lower_bound=0"},
    {"lower_bound_0_5_is_rejected", M_LB_05, MODE_FIXED, OP_FBR, INV, "lower_bound=0.5"},
    {"allow_neg_eigval_without_beta_sigmoid_is_rejected", M_NEG_NO_SIG, MODE_FIXED, OP_FBR, INV,
     "allow_neg_eigval|beta_sigmoid"},
    {"softplus_gate_without_A_log_is_rejected", M_SOFTPLUS_NO_ALOG, MODE_FIXED, OP_FBR, INV, "w:A_log"},
    {"A_log_with_gate_none_is_rejected", M_ALOG_GATE_NONE, MODE_FIXED, OP_FBR, INV, "w:A_log"},
    {"dt_bias_with_gate_none_is_rejected", M_DTB_GATE_NONE, MODE_FIXED, OP_FBR, INV, "w:dt_bias"},
    {"safe_gate_with_softplus_is_rejected", M_SAFE_SOFTPLUS, MODE_FIXED, OP_FBR, INV, "safe_gate"},
    {"state_layout_5_is_rejected", M_LAYOUT5, MODE_FIXED, OP_FBR, INV, "state_layout=5"},
    {"scale_nan_is_rejected", M_SCALE_NAN, MODE_FIXED, OP_FBR, INV, "w:scale"},
    {"scale_infinity_is_rejected", M_SCALE_INF, MODE_FIXED, OP_FBR, INV, "w:scale"},
    {"varlen_with_B_2_is_rejected", M_VARLEN_B2, MODE_FIXED, OP_FBR, INV, "B=2|num_seqs"},
    {"num_seqs_negative_is_rejected", M_NSEQ_NEG, MODE_FIXED, OP_FBR, INV, "num_seqs=-1"},
    {"num_seqs_without_cu_seqlens_is_rejected", M_NSEQ_NO_CU, MODE_VARLEN, OP_FBR, INV, "cu_seqlens"},
    {"cu_seqlens_with_num_seqs_0_is_rejected", M_CU_NO_NSEQ, MODE_FIXED, OP_FBR, INV, "cu_seqlens|num_seqs"},
    {"cu_seqlens_not_starting_at_0_is_rejected_i32", M_CU_START, MODE_VARLEN, OP_FBR, INV, "cu_seqlens[0]=1"},
    {"cu_seqlens_not_starting_at_0_is_rejected_i64", M_CU_START64, MODE_VARLEN, OP_FBR, INV, "cu_seqlens[0]=1"},
    {"cu_seqlens_decreasing_is_rejected_i32", M_CU_DEC, MODE_VARLEN, OP_FBR, INV, "cu_seqlens|41"},
    {"cu_seqlens_decreasing_is_rejected_i64", M_CU_DEC64, MODE_VARLEN, OP_FBR, INV, "cu_seqlens|41"},
    {"cu_seqlens_not_ending_at_T_is_rejected_i32", M_CU_END, MODE_VARLEN, OP_FBR, INV, "cu_seqlens[2]=39|T=40"},
    {"cu_seqlens_not_ending_at_T_is_rejected_i64", M_CU_END64, MODE_VARLEN, OP_FBR, INV, "cu_seqlens[2]=39|T=40"},
    {"seqlens_type_3_is_rejected", M_SEQTYPE3, MODE_VARLEN, OP_FBR, INV, "seqlens_type=3"},
    {"bwd_dout_null_is_rejected", M_DOUT_NULL, MODE_FIXED, OP_B, INV, "w:dout"},
    {"bwd_dA_log_with_gate_none_is_rejected", M_DALOG_GATE_NONE, MODE_FIXED, OP_B, INV, "w:dA_log"},
    {"bwd_dA_log_without_A_log_is_rejected", M_DALOG_NO_ALOG, MODE_FIXED, OP_B, INV, "w:dA_log|w:A_log"},
    {"bwd_ddt_bias_without_dt_bias_is_rejected", M_DDTB_NO_DTB, MODE_FIXED, OP_B, INV, "w:ddt_bias|w:dt_bias"},
    {"bwd_ddt_bias_with_gate_none_is_rejected", M_DDTB_GATE_NONE, MODE_FIXED, OP_B, INV, "w:ddt_bias"},
    {"pool_slot_past_num_slots_is_rejected", M_SLOT_BIG, MODE_POOL, OP_POOLS, INV, "slots[0]=3|num_slots=3"},
    {"pool_two_sequences_on_one_slot_is_rejected", M_SLOT_DUP, MODE_POOL, OP_POOLS, INV, "slots[1]"},
    {"pool_with_h0_is_rejected", M_POOL_H0, MODE_POOL, OP_POOLS, INV, "w:h0"},
    {"pool_with_ht_is_rejected", M_POOL_HT, MODE_POOL, OP_POOLS, INV, "w:ht"},
    {"pool_with_saved_is_rejected", M_POOL_SAVED, MODE_POOL, OP_PF, INV, "w:saved|backward"},
    {"slots_without_pool_is_rejected", M_SLOTS_NO_POOL, MODE_POOL, OP_POOLS, INV, "w:slots|state_pool"},
    {"pool_without_slots_is_rejected", M_POOL_NO_SLOTS, MODE_POOL, OP_POOLS, INV, "w:slots"},
    {"pool_num_slots_0_is_rejected", M_NUM_SLOTS0, MODE_POOL, OP_POOLS, INV, "num_slots=0"},
    {"pool_state_dtype_f16_is_rejected", M_POOL_DTYPE_F16, MODE_POOL, OP_POOLS, INV, "state_dtype=f16"},
    {"state_dtype_without_pool_is_rejected", M_DTYPE_NO_POOL, MODE_FIXED, OP_F | OP_R, INV, "w:state_dtype|w:h0"},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

/* Checks one call: status, message, outputs untouched. */
static void check_rejected(kda_context *ctx, const char *what, kda_status s, kda_status want, const char *msg_want) {
    const char *msg = kda_last_error(ctx), *t = touched();
    char missing[128];
    CHECK(s == want, "%s: status %s (%d), want %s", what, kda_status_string(s), (int)s, kda_status_string(want));
    CHECK(msg_matches(msg, msg_want, missing, sizeof missing), "%s: message \"%s\" lacks \"%s\"", what, msg, missing);
    CHECK(t == NULL, "%s: wrote into %s", what, t ? t : "");
}

static void test_base_problems_are_accepted_and_write_their_outputs(void) {
    kda_context *ctx = t_cpu();
    const int modes[3] = {MODE_FIXED, MODE_VARLEN, MODE_POOL};
    int mi, op;
    t_current = "test_base_problems_are_accepted_and_write_their_outputs";
    for (mi = 0; mi < 3; mi++)
        for (op = 1; op <= OP_PF; op <<= 1) {
            env e;
            kda_status s;
            if ((modes[mi] == MODE_POOL) != ((op & OP_POOLS) != 0)) continue;
            env_reset(&e, modes[mi]);
            poison_all();
            s = call_op(ctx, op, &e);
            CHECK(s == KDA_OK, "mode %d %s: %s", modes[mi], op_name(op), kda_last_error(ctx));
            CHECK(kda_last_error(ctx)[0] == 0, "mode %d %s: last error \"%s\" after success", modes[mi], op_name(op),
                  kda_last_error(ctx));
            /* the poison check of the cases below is not vacuous: a valid call writes */
            CHECK(touched() != NULL, "mode %d %s: a valid call wrote none of its outputs", modes[mi], op_name(op));
        }
    kda_context_destroy(ctx);
}

static void test_bad_inputs_return_status_and_message_and_write_nothing(void) {
    kda_context *ctx = t_cpu();
    int ci, op;
    for (ci = 0; ci < NCASES; ci++) {
        t_current = CASES[ci].name;
        for (op = 1; op <= OP_PF; op <<= 1) {
            env e;
            char what[160];
            kda_status s;
            if (!(CASES[ci].ops & op)) continue;
            env_reset(&e, CASES[ci].mode);
            mutate(&e, CASES[ci].mut);
            poison_all();
            s = call_op(ctx, op, &e);
            snprintf(what, sizeof what, "%s", op_name(op));
            check_rejected(ctx, what, s, CASES[ci].want, CASES[ci].msg);
        }
    }
    kda_context_destroy(ctx);
}

static void test_problem_check_follows_dtype_rules(void) {
    static const struct { kda_dtype d, g, b; int ok; } C[] = {
        {KDA_F32, KDA_F32, KDA_F32, 1},   {KDA_BF16, KDA_F32, KDA_BF16, 1}, {KDA_BF16, KDA_BF16, KDA_F32, 1},
        {KDA_F16, KDA_F16, KDA_F16, 1},   {KDA_F16, KDA_F32, KDA_F32, 1},   {KDA_BF16, KDA_F16, KDA_F32, 0},
        {KDA_F32, KDA_F32, KDA_F16, 0},   {KDA_F32, KDA_BF16, KDA_F32, 0},  {KDA_F16, KDA_F32, KDA_BF16, 0},
    };
    kda_context *ctx = t_cpu();
    size_t i;
    t_current = "test_problem_check_follows_dtype_rules";
    for (i = 0; i < sizeof C / sizeof C[0]; i++) {
        kda_problem p = BASE;
        kda_status s;
        p.dtype = C[i].d; p.g_dtype = C[i].g; p.beta_dtype = C[i].b;
        s = kda_problem_check(ctx, &p);
        CHECK(s == (C[i].ok ? KDA_OK : KDA_ERROR_INVALID_ARGUMENT), "dtype %s g %s beta %s: status %s (%s)",
              kda_dtype_name(C[i].d), kda_dtype_name(C[i].g), kda_dtype_name(C[i].b), kda_status_string(s),
              kda_last_error(ctx));
        if (!C[i].ok)
            CHECK(strstr(kda_last_error(ctx), "dtype") != NULL, "dtype %s g %s beta %s: message \"%s\"",
                  kda_dtype_name(C[i].d), kda_dtype_name(C[i].g), kda_dtype_name(C[i].b), kda_last_error(ctx));
        else
            CHECK(kda_last_error(ctx)[0] == 0, "valid problem left last error \"%s\"", kda_last_error(ctx));
    }
    kda_context_destroy(ctx);
}

static void test_recurrent_ignores_chunk_size(void) {
    kda_context *ctx = t_cpu();
    env e;
    kda_status s;
    t_current = "test_recurrent_ignores_chunk_size";
    env_reset(&e, MODE_FIXED);
    e.p.chunk_size = 48;
    s = call_op(ctx, OP_R, &e);
    CHECK(s == KDA_OK, "recurrent with chunk_size 48: %s", kda_last_error(ctx));
    kda_context_destroy(ctx);
}

static void test_small_workspace_fails_with_both_sizes_and_none_recovers(void) {
    kda_context *ctx = t_cpu();
    env e;
    size_t need_f, need_b, big;
    unsigned char *ws;
    char want[96];
    kda_status s;
    int op;
    t_current = "test_small_workspace_fails_with_both_sizes_and_none_recovers";
    env_reset(&e, MODE_FIXED);
    e.fo.saved = NULL; /* the forward's work then lives in the workspace */
    s = kda_chunk_fwd_workspace(ctx, &e.p, &e.fo, NULL, &need_f);
    CHECK(s == KDA_OK && need_f == kda_fwd_workspace_size(&e.p), "kda_chunk_fwd_workspace on the CPU: %s, %zu bytes, "
          "kda_fwd_workspace_size %zu", kda_status_string(s), need_f, kda_fwd_workspace_size(&e.p));
    need_b = kda_bwd_workspace_size(&e.p, 0);
    big = need_f > need_b ? need_f : need_b;
    CHECK(need_f > 0 && need_b > 0, "workspace sizes %zu %zu", need_f, need_b);
    ws = (unsigned char *)malloc(big);
    if (!ws) exit(2);
    for (op = OP_F; op <= OP_B; op <<= 1) {
        size_t need = op == OP_F ? need_f : need_b;
        memset(ws, POISON, big);
        kda_set_workspace(ctx, ws, need - 1);
        poison_all();
        s = call_op(ctx, op, &e);
        snprintf(want, sizeof want, "%zu|%zu", need, need - 1);
        check_rejected(ctx, op_name(op), s, KDA_ERROR_OUT_OF_MEMORY, want);
        {
            size_t b, bad = 0;
            for (b = 0; b < big; b++) bad += ws[b] != POISON;
            CHECK(bad == 0, "%s: wrote %zu bytes into the too-small workspace", op_name(op), bad);
        }
        kda_set_workspace(ctx, ws, need); /* exactly enough */
        s = call_op(ctx, op, &e);
        CHECK(s == KDA_OK, "%s with a workspace of exactly %zu bytes: %s", op_name(op), need, kda_last_error(ctx));
        kda_set_workspace(ctx, ws, need - 1);
        s = call_op(ctx, op, &e);
        CHECK(s == KDA_ERROR_OUT_OF_MEMORY, "%s: too small again: %s", op_name(op), kda_status_string(s));
        kda_set_workspace(ctx, NULL, 0);
        s = call_op(ctx, op, &e);
        CHECK(s == KDA_OK, "%s after kda_set_workspace(ctx, NULL, 0): %s", op_name(op), kda_last_error(ctx));
        CHECK(kda_last_error(ctx)[0] == 0, "%s: last error not cleared", op_name(op));
    }
    free(ws);
    kda_context_destroy(ctx);
}

/* kda_chunk_fwd_workspace follows the outputs' form (saved: the forward's work lives there;
 * the pool form on the CPU: no copy of the states), reads cu_seqlens_host where given, and
 * rejects what kda_chunk_fwd would, with the reason */
static void test_fwd_workspace_query_follows_the_outputs_and_checks_its_arguments(void) {
    kda_context *ctx = t_cpu();
    env e;
    size_t b = 1, plain;
    kda_status s;
    t_current = "test_fwd_workspace_query_follows_the_outputs_and_checks_its_arguments";
    env_reset(&e, MODE_VARLEN);
    plain = kda_fwd_workspace_size(&e.p);
    s = kda_chunk_fwd_workspace(ctx, &e.p, NULL, NULL, &b);
    CHECK(s == KDA_OK && b == plain, "no outputs given: %s, %zu bytes, want %zu", kda_status_string(s), b, plain);
    s = kda_chunk_fwd_workspace(ctx, &e.p, &e.fo, e.cu32, &b); /* (e.fo has saved) */
    CHECK(s == KDA_OK && b > 0 && b < plain, "with saved: %s, %zu bytes, want the tables alone (< %zu)", kda_status_string(s), b, plain);
    e.fo.saved = NULL;
    kda_set_workspace(ctx, SAVED, b); /* (the saved buffer, bigger than b) */
    s = kda_chunk_fwd(ctx, &e.p, &e.in, &e.fo);
    CHECK(s == KDA_ERROR_OUT_OF_MEMORY, "the tables' workspace without saved: %s", kda_status_string(s));
    kda_set_workspace(ctx, NULL, 0);
    env_reset(&e, MODE_POOL);
    s = kda_chunk_fwd_workspace(ctx, &e.p, &e.fo, NULL, &b);
    CHECK(s == KDA_OK && b == kda_fwd_workspace_size(&e.p), "pool form on the CPU: %s, %zu bytes, want %zu", kda_status_string(s), b,
          kda_fwd_workspace_size(&e.p));
    env_reset(&e, MODE_FIXED);
    poison_all();
    s = kda_chunk_fwd_workspace(ctx, &e.p, &e.fo, NULL, NULL);
    check_rejected(ctx, "bytes NULL", s, KDA_ERROR_INVALID_ARGUMENT, "w:bytes");
    e.p.chunk_size = 48;
    s = kda_chunk_fwd_workspace(ctx, &e.p, &e.fo, NULL, &b);
    check_rejected(ctx, "chunk 48", s, KDA_ERROR_INVALID_ARGUMENT, "chunk_size=48");
    CHECK(b == 0, "chunk 48: %zu bytes, want 0", b);
    env_reset(&e, MODE_VARLEN);
    e.cu32[2] = 39;
    s = kda_chunk_fwd_workspace(ctx, &e.p, &e.fo, e.cu32, &b);
    check_rejected(ctx, "cu_seqlens_host ending at 39", s, KDA_ERROR_INVALID_ARGUMENT, "cu_seqlens[2]=39|T=40");
    kda_context_destroy(ctx);
}

static void test_context_create_rejects_cuda_here_and_bogus_backend(void) {
    kda_context *ctx = NULL;
    kda_status s;
    t_current = "test_context_create_rejects_cuda_here_and_bogus_backend";
    s = kda_context_create(&ctx, KDA_BACKEND_CUDA, NULL);
    CHECK(ctx != NULL, "kda_context_create(CUDA) left *ctx NULL");
    if (ctx) {
        if (s == KDA_OK) { /* a build with a working GPU backend on a GPU machine */
            CHECK(kda_context_backend(ctx) == KDA_BACKEND_CUDA && kda_last_error(ctx)[0] == 0,
                  "CUDA context created but backend/last error wrong");
        } else {
            CHECK(s == KDA_ERROR_UNSUPPORTED, "CUDA: status %s, want unsupported", kda_status_string(s));
            CHECK(strlen(kda_last_error(ctx)) > 10, "CUDA: message \"%s\" is empty or too short", kda_last_error(ctx));
        }
        kda_context_destroy(ctx);
    }
    ctx = NULL;
    s = kda_context_create(&ctx, (kda_backend)42, NULL);
    CHECK(s == KDA_ERROR_INVALID_ARGUMENT, "backend 42: status %s, want invalid argument", kda_status_string(s));
    CHECK(ctx != NULL, "backend 42: *ctx left NULL");
    if (ctx) {
        char missing[64];
        CHECK(msg_matches(kda_last_error(ctx), "backend|42", missing, sizeof missing),
              "backend 42: message \"%s\" lacks \"%s\"", kda_last_error(ctx), missing);
        kda_context_destroy(ctx);
    }
    CHECK(kda_context_create(NULL, KDA_BACKEND_CPU, NULL) == KDA_ERROR_INVALID_ARGUMENT,
          "kda_context_create(NULL, ...) must be an invalid argument");
}

static void test_stage_functions_reject_null_work(void) {
    kda_context *ctx = t_cpu();
    env e;
    int st;
    t_current = "test_stage_functions_reject_null_work";
    env_reset(&e, MODE_FIXED);
    for (st = 0; st < 14; st++) {
        kda_status s = KDA_OK;
        static const char *const names[14] = {
            "kda_stage_prepare", "kda_stage_gate_cumsum", "kda_stage_intra", "kda_stage_solve", "kda_stage_wu",
            "kda_stage_state", "kda_stage_output", "kda_stage_bwd_dAv", "kda_stage_bwd_dhu", "kda_stage_bwd_wy",
            "kda_stage_bwd_intra", "kda_stage_bwd_cumsum", "kda_stage_bwd_gate", "kda_stage_bwd_qkb"};
        poison_all();
        switch (st) {
        case 0: s = kda_stage_prepare(ctx, &e.p, &e.in, NULL); break;
        case 1: s = kda_stage_gate_cumsum(ctx, &e.p, &e.in, NULL); break;
        case 2: s = kda_stage_intra(ctx, &e.p, &e.in, NULL); break;
        case 3: s = kda_stage_solve(ctx, &e.p, &e.in, NULL); break;
        case 4: s = kda_stage_wu(ctx, &e.p, &e.in, NULL); break;
        case 5: s = kda_stage_state(ctx, &e.p, &e.in, NULL, HT); break;
        case 6: s = kda_stage_output(ctx, &e.p, &e.in, NULL, O); break;
        case 7: s = kda_stage_bwd_dAv(ctx, &e.p, &e.in, NULL, I.dout); break;
        case 8: s = kda_stage_bwd_dhu(ctx, &e.p, &e.in, NULL, I.dout, I.dht, DH0); break;
        case 9: s = kda_stage_bwd_wy(ctx, &e.p, &e.in, NULL, I.dout, DV); break;
        case 10: s = kda_stage_bwd_intra(ctx, &e.p, &e.in, NULL); break;
        case 11: s = kda_stage_bwd_cumsum(ctx, &e.p, &e.in, NULL); break;
        case 12: s = kda_stage_bwd_gate(ctx, &e.p, &e.in, NULL, DG, DALOG, DDTB); break;
        case 13: s = kda_stage_bwd_qkb(ctx, &e.p, &e.in, NULL, DQ, DK, DBETA); break;
        }
        check_rejected(ctx, names[st], s, KDA_ERROR_INVALID_ARGUMENT, "w:work");
    }
    kda_context_destroy(ctx);
}

/* The pool check finds two sequences on one slot however they lie in the batch (it sorts the
 * slots), names the first sequence, in batch order, whose slot an earlier one has, and lets any
 * number of padding sequences (slot < 0) through. Five sequences over the 40 rows. */
static void test_pool_slot_repeats_are_named_in_batch_order(void) {
    static const struct {
        int32_t slots[5];
        const char *want; /* NULL: accepted */
    } cases[] = {
        {{2, 1, -1, 1, 2}, "slots[3]|slot 1"}, /* slot 1 repeats at 3, slot 2 only at 4 */
        {{2, 0, 2, 0, -1}, "slots[2]|slot 2"}, /* sorted, slot 0's run comes first: its repeat is at 3 */
        {{0, -1, -1, -7, 2}, NULL},
        {{-1, -1, -1, -1, -1}, NULL},
    };
    kda_context *ctx = t_cpu();
    int32_t cu[6] = {0, 8, 16, 24, 32, 40};
    int i, op;
    t_current = "test_pool_slot_repeats_are_named_in_batch_order";
    for (i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++)
        for (op = OP_P; op <= OP_PF; op <<= 1) {
            env e;
            int32_t sl[5];
            char what[96];
            memcpy(sl, cases[i].slots, sizeof sl);
            env_reset(&e, MODE_POOL);
            e.p.B = 1; e.p.T = 40; e.p.num_seqs = 5; e.p.seqlens_type = KDA_INDEX_I32;
            e.in.cu_seqlens = cu;
            e.ro.slots = e.fo.slots = sl;
            e.fo.h = NULL; /* (sized for the base problems' chunks: five sequences have more) */
            snprintf(what, sizeof what, "%s, slots {%d %d %d %d %d}", op_name(op), sl[0], sl[1], sl[2], sl[3], sl[4]);
            poison_all();
            if (cases[i].want) check_rejected(ctx, what, call_op(ctx, op, &e), INV, cases[i].want);
            else CHECK(call_op(ctx, op, &e) == KDA_OK, "%s: %s", what, kda_last_error(ctx));
        }
    kda_context_destroy(ctx);
}

static void test_success_after_failure_clears_last_error(void) {
    kda_context *ctx = t_cpu();
    int op;
    t_current = "test_success_after_failure_clears_last_error";
    for (op = 1; op <= OP_PF; op <<= 1) {
        env e;
        kda_status s;
        env_reset(&e, op & OP_POOLS ? MODE_POOL : MODE_FIXED);
        e.p.K = 257;
        s = call_op(ctx, op, &e);
        CHECK(s != KDA_OK && kda_last_error(ctx)[0] != 0, "%s with K=257: status %s, message \"%s\"", op_name(op),
              kda_status_string(s), kda_last_error(ctx));
        e.p.K = BASE.K;
        s = call_op(ctx, op, &e);
        CHECK(s == KDA_OK, "%s: %s", op_name(op), kda_last_error(ctx));
        CHECK(kda_last_error(ctx)[0] == 0, "%s: last error \"%s\" not cleared by a successful call", op_name(op),
              kda_last_error(ctx));
    }
    {
        kda_problem p = BASE;
        p.chunk_size = 7;
        CHECK(kda_problem_check(ctx, &p) == KDA_ERROR_INVALID_ARGUMENT && kda_last_error(ctx)[0],
              "kda_problem_check(chunk 7) did not fail with a message");
        CHECK(kda_problem_check(ctx, &BASE) == KDA_OK && kda_last_error(ctx)[0] == 0,
              "kda_problem_check(valid) did not clear the last error: \"%s\"", kda_last_error(ctx));
    }
    kda_context_destroy(ctx);
}

/* counting allocator and log sink */
typedef struct { int allocs, frees, lines, bad_lines; long long live; char last[256]; } counters;
static void *cnt_alloc(void *user, size_t bytes) {
    counters *c = (counters *)user;
    size_t *p = (size_t *)malloc(bytes + 16);
    if (!p) return NULL;
    c->allocs++;
    c->live++;
    p[0] = bytes;
    return (char *)p + 16;
}
static void cnt_free(void *user, void *ptr) {
    counters *c = (counters *)user;
    if (!ptr) return;
    c->frees++;
    c->live--;
    free((char *)ptr - 16);
}
static void cnt_log(void *user, const char *line) {
    counters *c = (counters *)user;
    c->lines++;
    if (!line || !line[0] || strchr(line, '\n')) c->bad_lines++;
    snprintf(c->last, sizeof c->last, "%s", line ? line : "(null)");
}

static void test_custom_allocator_and_log_callback_are_used(void) {
    counters cnt;
    kda_context_options o;
    kda_context *ctx = NULL;
    env e;
    kda_status s;
    int a0, a1;
    t_current = "test_custom_allocator_and_log_callback_are_used";
    memset(&cnt, 0, sizeof cnt);
    memset(&o, 0, sizeof o);
    o.alloc = cnt_alloc; o.free = cnt_free; o.log = cnt_log; o.user = &cnt;
    s = kda_context_create(&ctx, KDA_BACKEND_CPU, &o);
    CHECK(s == KDA_OK && ctx, "kda_context_create with options: %s", ctx ? kda_last_error(ctx) : "NULL");
    if (!ctx) return;
    a0 = cnt.allocs;
    CHECK(a0 >= 1, "the context itself was not allocated through opts.alloc (%d calls)", a0);
    CHECK(cnt.lines >= 1, "the log callback received no line on context creation");
    env_reset(&e, MODE_FIXED);
    e.fo.saved = NULL; /* the forward must allocate its workspace */
    s = call_op(ctx, OP_F, &e);
    CHECK(s == KDA_OK, "fwd: %s", kda_last_error(ctx));
    a1 = cnt.allocs;
    CHECK(a1 > a0, "kda_chunk_fwd without a workspace made no call to opts.alloc");
    CHECK(cnt.live == a0, "kda_chunk_fwd left %lld allocations live", cnt.live - a0);
    s = call_op(ctx, OP_B, &e);
    CHECK(s == KDA_OK, "bwd: %s", kda_last_error(ctx));
    CHECK(cnt.allocs > a1, "kda_chunk_bwd without a workspace made no call to opts.alloc");
    kda_context_destroy(ctx);
    CHECK(cnt.live == 0 && cnt.frees == cnt.allocs, "after destroy: %d allocs, %d frees", cnt.allocs, cnt.frees);
    CHECK(cnt.bad_lines == 0, "%d log lines were empty or held a newline (last \"%s\")", cnt.bad_lines, cnt.last);
}

int main(void) {
    setup();
    test_base_problems_are_accepted_and_write_their_outputs();
    test_bad_inputs_return_status_and_message_and_write_nothing();
    test_problem_check_follows_dtype_rules();
    test_recurrent_ignores_chunk_size();
    test_small_workspace_fails_with_both_sizes_and_none_recovers();
    test_fwd_workspace_query_follows_the_outputs_and_checks_its_arguments();
    test_context_create_rejects_cuda_here_and_bogus_backend();
    test_stage_functions_reject_null_work();
    test_success_after_failure_clears_last_error();
    test_pool_slot_repeats_are_named_in_batch_order();
    test_custom_allocator_and_log_callback_are_used();
    teardown();
    return t_report();
}
