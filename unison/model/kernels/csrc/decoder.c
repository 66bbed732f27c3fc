// The whole forward of a quantized decoder in one call, for CPUs.
//
// decoder.py's forward, op for op, through the same kernels (quant_linear.c, paged_attention.c,
// fused_ops.c): at batch 1 a step is about 120 small kernel calls, and from Python each costs
// 5-10 µs of argument passing and tensor allocation, a third of a decode step on this model.
// Here the step is one call. The layer's shape is data (DModel, DLayer), so every family of
// families.py runs here as it runs there: a hybrid's Gated DeltaNet layers (gated_delta.c) over
// the state pool's slots, its gated attention, a mixture's shared expert.
//
// Built with the other kernels by unison/model/kernels/cpu_kernels.py (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "lora.h"
#include "moe.h"
#include "q8.h"

// ---- the kernels this calls (the other files of this shared object) ---------------------------

void quant_linear_parts(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t kp,
                        int64_t parts, const int64_t *records, const int64_t *weights,
                        const int64_t *n_padded, const int64_t *col_offset, void *scratch,
                        float *out, int64_t ldo, int num_threads);
int64_t act16_bytes(int64_t rows, int64_t kp);
void dequantize_columns(int64_t record, const uint8_t *w, int64_t kp, int64_t k, const int64_t *ids,
                        int64_t count, float *out);
void add_rms_norm(float *h, const float *delta, const float *weight, float *out, int64_t rows,
                  int64_t dim, float eps, int num_threads);
void rope_partial(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows,
                  int64_t heads, int64_t head_stride, int64_t rot_dim, int num_threads);
void mul_act(float *x, int64_t x_stride, const float *gate, int64_t gate_stride, int64_t rows, int64_t n,
             int activation, int num_threads);
void row_gates(const float *x, int64_t row_stride, const float *w, int64_t rows, int64_t dim, float *out);
void delta_gates(const float *a, const float *b, int64_t stride, int64_t rows, int64_t heads,
                 const float *dt_bias, const float *neg_a, float *g, float *beta);
void gated_delta(const float *x, int64_t x_stride, const float *g, const float *beta, int64_t gb_stride,
                 const float *conv_w, int64_t K, float *conv_state, float *rec_state,
                 const int64_t *slots, const int64_t *row_start, const int64_t *row_count, int64_t items,
                 int64_t hk, int64_t hv, int64_t dk, int64_t dv, int tiled, float *c, float *out,
                 int num_threads);
void store_kv(const float *k, const float *v, int64_t row_stride, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t rows, int64_t width, int64_t head_dim, int dtype,
              const float *key_weight, const float *key_mean, void *recent_k, void *recent_v, void *twin_k,
              void *twin_v, const int64_t *twin_slots);
void act_mul(const float *gate_up, float *out, int64_t rows, int64_t n, int activation, int num_threads);
void norm_groups(float *x, int64_t row_stride, int64_t rows, int64_t groups, int64_t dim,
                 const float *weight, float eps);
int paged_attention(const float *q, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, int64_t table_stride, const int64_t *row_seq,
                    const int64_t *row_len, float *out, int64_t rows, int64_t num_heads,
                    int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                    float scale, int num_threads, int dtype, const float *key_mean, const RecentRows *recent,
                    const float *sinks, const int64_t *row_ahead);

// ---- the model as data (mirrored by ctypes Structures in cpu_kernels.py) -----------------------

typedef struct {  // a quantized linear's parts, as quant_linear_parts takes them
    int64_t parts;
    const int64_t *records, *weights, *n_padded, *offsets;  // records: each part's format (bytes)
    int64_t k, kp, n, out_cols;
    const float *bias;  // NULL: none
} QLinear;

typedef struct {  // a Gated DeltaNet layer (linear_attention.py DeltaNet) and its slice of the state pool
    QLinear in_proj, out_proj;  // in_proj's columns, once `order`ed: [q|k|v, z, b, a]
    const int64_t *order;  // [in_proj.n]: the column each comes from (a fused checkpoint's); NULL: as is
    const float *conv_w, *dt_bias, *neg_a, *norm;  // conv_w [conv_dim, K]; neg_a = -exp(A_log)
    float *conv_state, *rec_state;  // [slots, K-1, conv_dim], [slots, hv, dk, dv]
    int64_t k_heads, v_heads, k_dim, v_dim, conv_kernel;
    int tiled;  // value head h reads key head h % k_heads (else h / (v_heads / k_heads))
} DeltaLayer;

typedef struct {  // moe.py SharedExpert: a dense gated MLP every row runs, scaled by sigmoid(x . gate)
    QLinear gate_up, down;  // its width is down.k; its activation the model's
    const float *gate;  // [hidden]
} SharedMlp;

typedef struct {
    QLinear qkv, o_proj, gate_up, down;
    const float *input_norm, *post_attention_norm, *pre_mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    int64_t rope, window;  // window 0: attends to everything
    void *k_cache, *v_cache;  // this layer's [blocks, block_size, kv_heads, head_dim]
    const float *key_weight, *key_mean;  // int8 keys' rounding (store_kv); NULL: as they are, nearest
    const MoeLayer *moe;  // a mixture of experts instead of gate_up and down; NULL: dense
    const float *sinks;  // [heads]: learned logits in each softmax's denominator (gpt-oss); NULL: none
    const DeltaLayer *delta;  // a linear-attention layer's mixer instead of attention; NULL: attention
    const SharedMlp *shared;  // beside `moe`; NULL: none
    int64_t kv_layer;  // this attention layer's index among the attention layers (the twins')
} DLayer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, block_size;
    float eps, attention_scale, embed_scale;  // embed_scale 0: none
    int activation, qk_norm, kv_dtype;  // qk_norm: 0 none, 1 per head, 2 over the projection
    int output_gate;  // q_proj gives each head's q, then its gate: attention * sigmoid(gate)
    int64_t rotary_dim;  // the leading dims of each head that rope rotates
    int64_t embed_record, embed_kp;
    const uint8_t *embed;
    const float *norm;
    QLinear lm_head;
    const DLayer *layer;
} DModel;

typedef struct {
    int64_t rows;
    const int64_t *ids;
    const float *const *cos, *const *sin;  // per rope: [rows, head_dim / 2]
    const int64_t *slots, *tables, *row_seq, *row_len;
    int64_t table_stride;
    int64_t logit_rows;  // rows of logits wanted, those in logit_index (NULL: every row)
    const int64_t *logit_index;
    void *workspace;  // decoder_workspace_bytes(model, rows)
    float *logits;  // [logit_rows, vocab]
    int num_threads, attention_threads;
    const int64_t *lora_row;  // each row's index into `lora` (< 0: the base model); NULL: no adapters
    const LoraLinear *const *lora;  // the step's adapters' tables of linears, [layers * 4] each
    // int8 caches' recent rows (q8.h); recent_k NULL: none. The twins are every layer's,
    // [layers, twins, block_size, kv_heads, head_dim]; recent_k / recent_v one layer's, reused.
    _Float16 *recent_k, *recent_v, *twin_k, *twin_v;
    int64_t twin_layer;  // elements from one layer's twins to the next's
    const int64_t *twin_slots, *first_row, *twin;  // [rows], [requests], [requests]
    // An image's rows (vision/encoder.py): these rows' embeddings replace their tokens', after the
    // embedding's scale; row_ahead (NULL: causal) is each row's keys seen past its own position.
    int64_t embed_count;
    const int64_t *embed_rows;
    const float *embed_values;  // [embed_count, hidden]
    const int64_t *row_ahead;
    // A hybrid's linear-attention states (linear_attention.py DeltaStep): item i's rows are
    // [state_start[i], + state_count[i]) and its state is slot state_slots[i].
    int64_t state_items;
    const int64_t *state_slots, *state_start, *state_count;
} DStep;

// The step's buffers, carved from one workspace. Widths have room for a linear's padding
// columns (up to 7, written then compacted away) and inputs for whole blocks of 32.
typedef struct {
    float *h, *x, *delta, *qkv, *q, *attn, *gate_up, *act;
    float *gate;  // a gated attention's gates
    float *g, *beta, *conv, *ordered;  // a Gated DeltaNet's
    float *shared, *row_gate;  // a shared expert's output and its scales
    void *scratch, *moe;  // the linears' activations; the mixture of experts' workspace
} Buffers;

#define PAD 8
#define ACT_SILU 0  // activations as fused_ops.c numbers them
#define ACT_SIGMOID 2
#define BLOCKS(k) (((k) + 31) / 32 * 32)

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static const DeltaLayer *first_delta(const DModel *m) {  // every linear layer has the same shape
    for (int64_t i = 0; i < m->layers; i++)
        if (m->layer[i].delta) return m->layer[i].delta;
    return NULL;
}

static int64_t shared_width(const DModel *m) {
    int64_t w = 0;
    for (int64_t i = 0; i < m->layers; i++)
        if (m->layer[i].shared) w = max64(w, m->layer[i].shared->down.k);
    return w;
}

static int64_t value_width(const DeltaLayer *D) { return D ? D->v_heads * D->v_dim : 0; }

static int64_t widest(const DModel *m) {  // of the linears' inputs: hidden, the MLPs', q heads, values
    const int64_t mlp = max64(m->intermediate, shared_width(m));
    return max64(max64(m->heads * m->head_dim, value_width(first_delta(m))), max64(mlp, m->hidden));
}

static Buffers carve(const DModel *m, int64_t rows, void *base) {
    const int64_t H = m->hidden, q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    const DeltaLayer *D = first_delta(m);
    const int64_t proj = D ? D->in_proj.n : 0, conv = D ? 2 * D->k_heads * D->k_dim + value_width(D) : 0;
    const int64_t any_order = D && D->order ? proj : 0, hv = D ? D->v_heads : 0;
    const int64_t mlp = max64(m->intermediate, shared_width(m)), shared = shared_width(m) ? H + PAD : 0;
    const int64_t qkv = max64((m->output_gate ? 2 : 1) * q + 2 * kv, proj);
    const int64_t widths[] = {H, H, H + PAD, qkv + PAD, q, max64(q, value_width(D)), 2 * mlp + PAD, mlp,
                              m->output_gate ? q : 0, hv, hv, conv, any_order, shared, shared ? 1 : 0};
    float *p = base;
    Buffers b;
    float **order[] = {&b.h, &b.x, &b.delta, &b.qkv, &b.q, &b.attn, &b.gate_up, &b.act,
                       &b.gate, &b.g, &b.beta, &b.conv, &b.ordered, &b.shared, &b.row_gate};
    for (int i = 0; i < (int)(sizeof(widths) / sizeof(widths[0])); i++) {
        *order[i] = p;
        p += rows * widths[i];
    }
    b.scratch = (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    b.moe = (uint8_t *)b.scratch + act16_bytes(rows, BLOCKS(widest(m)));
    return b;
}

int64_t decoder_workspace_bytes(const DModel *m, int64_t rows) {
    const Buffers b = carve(m, rows, NULL);
    int64_t moe = 0;
    for (int64_t i = 0; i < m->layers; i++)
        if (m->layer[i].moe) moe = max64(moe, moe_workspace_bytes(m->layer[i].moe, rows));
    return (int64_t)(uintptr_t)b.moe + moe + 64;
}

static void linear(const QLinear *l, const float *x, int64_t rows, float *out, Buffers *b, int threads) {
    quant_linear_parts(x, l->k, rows, l->k, l->kp, l->parts, l->records, l->weights, l->n_padded, l->offsets,
                       b->scratch, out, l->out_cols, threads);
    if (l->out_cols != l->n)  // compact the padding columns away
        for (int64_t r = 1; r < rows; r++) memmove(out + r * l->n, out + r * l->out_cols, sizeof(float) * l->n);
    if (l->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < l->n; i++) out[r * l->n + i] += l->bias[i];
}

// h += delta; x = norm(h), or a copy of h where no norm follows (OLMo 2's pre-norm-less layers).
static void add_norm(float *h, const float *delta, const float *weight, float *x, int64_t rows, int64_t dim,
                     float eps, int threads) {
    if (weight) {
        add_rms_norm(h, delta, weight, x, rows, dim, eps, threads);
        return;
    }
    for (int64_t i = 0; delta && i < rows * dim; i++) h[i] += delta[i];
    memcpy(x, h, sizeof(float) * rows * dim);
}

// Attention over the paged cache: x [n, H] -> out [n, H] (o_proj's output). A gated family's
// q_proj gives each head's q then its gate; the gates are copied out and applied after the
// attention, as decoder.py's _qkv and forward do.
static int attention_mixer(const DModel *m, const DLayer *L, int64_t li, const DStep *s, const float *x,
                           float *out, Buffers *b) {
    const int64_t n = s->rows, H = m->hidden, d = m->head_dim, q = m->heads * d, kv = m->kv_heads * d;
    const int64_t qw = (m->output_gate ? 2 : 1) * q, qkv_w = qw + 2 * kv;
    const int t = s->num_threads;
    float *qkv = b->qkv, *qbuf = b->q, *k = qkv + qw;
    linear(&L->qkv, x, n, qkv, b, t);
    if (s->lora_row) lora_apply(x, H, H, qkv, qkv_w, n, s->lora_row, s->lora, 4 * li, t);
    const int64_t q_heads = m->output_gate ? m->heads : 0;  // q copied out before its norm and rope
    for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < q_heads; h++) {
            memcpy(qbuf + r * q + h * d, qkv + r * qkv_w + h * 2 * d, sizeof(float) * d);
            memcpy(b->gate + r * q + h * d, qkv + r * qkv_w + h * 2 * d + d, sizeof(float) * d);
        }
    float *qsrc = m->output_gate ? qbuf : qkv;
    const int64_t q_stride = m->output_gate ? q : qkv_w;
    if (m->qk_norm) {
        const int per_head = m->qk_norm == 1;
        norm_groups(qsrc, q_stride, n, per_head ? m->heads : 1, per_head ? d : q, L->q_norm, m->eps);
        norm_groups(k, qkv_w, n, per_head ? m->kv_heads : 1, per_head ? d : kv, L->k_norm, m->eps);
    }
    const float *cos = s->cos[L->rope], *sin = s->sin[L->rope];
    if (m->output_gate) {
        rope_partial(qbuf, q, cos, sin, n, m->heads, d, m->rotary_dim, t);
        rope_partial(k, qkv_w, cos, sin, n, m->kv_heads, d, m->rotary_dim, t);
    } else {  // q and k heads side by side
        rope_partial(qkv, qkv_w, cos, sin, n, m->heads + m->kv_heads, d, m->rotary_dim, t);
    }
    const int64_t twins = s->recent_k ? L->kv_layer * s->twin_layer : 0;
    _Float16 *twin_k = s->recent_k ? s->twin_k + twins : NULL, *twin_v = s->recent_k ? s->twin_v + twins : NULL;
    store_kv(k, k + kv, qkv_w, L->k_cache, L->v_cache, s->slots, n, kv, d, m->kv_dtype, L->key_weight,
             L->key_mean, s->recent_k, s->recent_v, twin_k, twin_v, s->twin_slots);
    const RecentRows recent = {s->recent_k, s->recent_v, twin_k, twin_v, s->first_row, s->twin};
    if (!m->output_gate)
        for (int64_t r = 0; r < n; r++) memcpy(qbuf + r * q, qkv + r * qkv_w, sizeof(float) * q);
    if (paged_attention(qbuf, L->k_cache, L->v_cache, s->tables, s->table_stride, s->row_seq, s->row_len,
                        b->attn, n, m->heads, m->kv_heads, d, m->block_size, L->window, m->attention_scale,
                        s->attention_threads, m->kv_dtype, L->key_mean, s->recent_k ? &recent : NULL, L->sinks,
                        s->row_ahead) != 0)
        return -1;
    if (m->output_gate) mul_act(b->attn, q, b->gate, q, n, q, ACT_SIGMOID, t);
    linear(&L->o_proj, b->attn, n, out, b, t);
    if (s->lora_row) lora_apply(b->attn, q, q, out, H, n, s->lora_row, s->lora, 4 * li + 1, t);
    return 0;
}

// A Gated DeltaNet layer: x [n, H] -> out [n, H], advancing the step's items' states, as
// linear_attention.py's DeltaNet.forward does (its kernels, in its order).
static void delta_mixer(const DModel *m, const DeltaLayer *D, const DStep *s, const float *x, float *out,
                        Buffers *b) {
    const int64_t n = s->rows, P = D->in_proj.n, hv = D->v_heads, vd = hv * D->v_dim;
    const int64_t conv = 2 * D->k_heads * D->k_dim + vd;
    const int t = s->num_threads;
    float *proj = b->qkv;
    linear(&D->in_proj, x, n, proj, b, t);
    if (D->order) {
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < P; i++) b->ordered[r * P + i] = proj[r * P + D->order[i]];
        proj = b->ordered;
    }
    delta_gates(proj + conv + vd + hv, proj + conv + vd, P, n, hv, D->dt_bias, D->neg_a, b->g, b->beta);
    gated_delta(proj, P, b->g, b->beta, hv, D->conv_w, D->conv_kernel, D->conv_state, D->rec_state,
                s->state_slots, s->state_start, s->state_count, s->state_items, D->k_heads, hv, D->k_dim,
                D->v_dim, D->tiled, b->conv, b->attn, t);
    norm_groups(b->attn, vd, n, hv, D->v_dim, D->norm, m->eps);
    mul_act(b->attn, vd, proj + conv, P, n, vd, ACT_SILU, t);
    linear(&D->out_proj, b->attn, n, out, b, t);
}

// The MLP: x [n, H] -> out [n, H]: dense, or a mixture of experts plus its shared expert's
// output scaled by sigmoid(x . gate) (the product rounded, then added: moe.py's order).
static void mlp(const DModel *m, const DLayer *L, int64_t li, const DStep *s, const float *x, float *out,
                Buffers *b) {
    const int64_t n = s->rows, H = m->hidden, I = m->intermediate;
    const int t = s->num_threads;
    if (!L->moe) {
        linear(&L->gate_up, x, n, b->gate_up, b, t);
        if (s->lora_row) lora_apply(x, H, H, b->gate_up, 2 * I, n, s->lora_row, s->lora, 4 * li + 2, t);
        act_mul(b->gate_up, b->act, n, I, m->activation, t);
        linear(&L->down, b->act, n, out, b, t);
        if (s->lora_row) lora_apply(b->act, I, I, out, H, n, s->lora_row, s->lora, 4 * li + 3, t);
        return;
    }
    // (LoRA adapters never target the experts: refused at load)
    moe_forward(L->moe, x, H, n, out, H, b->moe, t);
    const SharedMlp *S = L->shared;
    if (!S) return;
    linear(&S->gate_up, x, n, b->gate_up, b, t);
    act_mul(b->gate_up, b->act, n, S->down.k, m->activation, t);
    linear(&S->down, b->act, n, b->shared, b, t);
    row_gates(x, H, S->gate, n, H, b->row_gate);
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < H; i++) {
            const float scaled = b->shared[r * H + i] * b->row_gate[r];
            out[r * H + i] += scaled;
        }
}

int decoder_forward(const DModel *m, const DStep *s) {
    const int64_t n = s->rows, H = m->hidden;
    const int t = s->num_threads;
    Buffers b = carve(m, n, s->workspace);
    float *h = b.h, *x = b.x, *delta = b.delta;

    dequantize_columns(m->embed_record, m->embed, m->embed_kp, H, s->ids, n, h);
    if (m->embed_scale != 0.0f)
        for (int64_t i = 0; i < n * H; i++) h[i] *= m->embed_scale;
    for (int64_t i = 0; i < s->embed_count; i++)
        memcpy(h + s->embed_rows[i] * H, s->embed_values + i * H, sizeof(float) * H);
    add_norm(h, NULL, m->layer[0].input_norm, x, n, H, m->eps, t);
    for (int64_t li = 0; li < m->layers; li++) {
        const DLayer *L = &m->layer[li];
        if (L->delta)
            delta_mixer(m, L->delta, s, x, delta, &b);
        else if (attention_mixer(m, L, li, s, x, delta, &b) != 0)
            return -1;
        if (L->post_attention_norm) add_rms_norm(delta, NULL, L->post_attention_norm, delta, n, H, m->eps, t);
        add_norm(h, delta, L->pre_mlp_norm, x, n, H, m->eps, t);
        mlp(m, L, li, s, x, delta, &b);
        if (L->post_mlp_norm) add_rms_norm(delta, NULL, L->post_mlp_norm, delta, n, H, m->eps, t);
        add_norm(h, delta, li + 1 < m->layers ? m->layer[li + 1].input_norm : m->norm, x, n, H, m->eps, t);
    }
    // The LM head is costly: only the rows that need logits, gathered.
    const float *rows = x;
    if (s->logit_index) {
        float *sel = delta;  // free by now, and a hidden row wide
        for (int64_t r = 0; r < s->logit_rows; r++) memcpy(sel + r * H, x + s->logit_index[r] * H, sizeof(float) * H);
        rows = sel;
    }
    if (s->logit_rows > 0) linear(&m->lm_head, rows, s->logit_rows, s->logits, &b, t);
    return 0;
}

// ---- the structs' layout, for cpu_kernels.py's ctypes mirrors to check when the library loads ---

#define LAYOUT(X)                                                                                      \
    X(QLinear, parts) X(QLinear, records) X(QLinear, weights) X(QLinear, n_padded) X(QLinear, offsets)  \
    X(QLinear, k) X(QLinear, kp) X(QLinear, n) X(QLinear, out_cols) X(QLinear, bias)                    \
    X(ExpertLinear, record) X(ExpertLinear, w) X(ExpertLinear, n) X(ExpertLinear, k)                    \
    X(MoeLayer, experts) X(MoeLayer, top_k) X(MoeLayer, hidden) X(MoeLayer, inter)                      \
    X(MoeLayer, norm_topk) X(MoeLayer, activation) X(MoeLayer, router) X(MoeLayer, gate)                \
    X(MoeLayer, up) X(MoeLayer, down) X(MoeLayer, router_bias) X(MoeLayer, gate_bias)                   \
    X(MoeLayer, up_bias) X(MoeLayer, down_bias)                                                         \
    X(DLayer, qkv) X(DLayer, o_proj) X(DLayer, gate_up) X(DLayer, down) X(DLayer, input_norm)           \
    X(DLayer, post_attention_norm) X(DLayer, pre_mlp_norm) X(DLayer, post_mlp_norm) X(DLayer, q_norm)   \
    X(DLayer, k_norm) X(DLayer, rope) X(DLayer, window) X(DLayer, k_cache) X(DLayer, v_cache)           \
    X(DLayer, key_weight) X(DLayer, key_mean) X(DLayer, moe) X(DLayer, sinks) X(DLayer, delta)          \
    X(DLayer, shared) X(DLayer, kv_layer)                                                               \
    X(DeltaLayer, in_proj) X(DeltaLayer, out_proj) X(DeltaLayer, order) X(DeltaLayer, conv_w)           \
    X(DeltaLayer, dt_bias) X(DeltaLayer, neg_a) X(DeltaLayer, norm) X(DeltaLayer, conv_state)           \
    X(DeltaLayer, rec_state) X(DeltaLayer, k_heads) X(DeltaLayer, v_heads) X(DeltaLayer, k_dim)         \
    X(DeltaLayer, v_dim) X(DeltaLayer, conv_kernel) X(DeltaLayer, tiled)                                \
    X(SharedMlp, gate_up) X(SharedMlp, down) X(SharedMlp, gate)                                         \
    X(DModel, layers) X(DModel, hidden) X(DModel, heads) X(DModel, kv_heads) X(DModel, head_dim)        \
    X(DModel, intermediate) X(DModel, vocab) X(DModel, block_size) X(DModel, eps)                       \
    X(DModel, attention_scale) X(DModel, embed_scale) X(DModel, activation) X(DModel, qk_norm)          \
    X(DModel, kv_dtype) X(DModel, output_gate) X(DModel, rotary_dim) X(DModel, embed_record)            \
    X(DModel, embed_kp) X(DModel, embed) X(DModel, norm) X(DModel, lm_head) X(DModel, layer)            \
    X(DStep, rows) X(DStep, ids) X(DStep, cos) X(DStep, sin) X(DStep, slots) X(DStep, tables)           \
    X(DStep, row_seq) X(DStep, row_len) X(DStep, table_stride) X(DStep, logit_rows)                     \
    X(DStep, logit_index) X(DStep, workspace) X(DStep, logits) X(DStep, num_threads)                    \
    X(DStep, attention_threads) X(DStep, lora_row) X(DStep, lora) X(DStep, recent_k) X(DStep, recent_v) \
    X(DStep, twin_k) X(DStep, twin_v) X(DStep, twin_layer) X(DStep, twin_slots) X(DStep, first_row)     \
    X(DStep, twin) X(DStep, embed_count) X(DStep, embed_rows) X(DStep, embed_values) X(DStep, row_ahead)  \
    X(DStep, state_items) X(DStep, state_slots) X(DStep, state_start) X(DStep, state_count)             \
    X(RecentRows, k) X(RecentRows, v) X(RecentRows, k_twins) X(RecentRows, v_twins)                     \
    X(RecentRows, first_row) X(RecentRows, twin)                                                        \
    X(LoraPart, a) X(LoraPart, b) X(LoraPart, rank) X(LoraPart, n) X(LoraPart, offset)                  \
    X(LoraLinear, parts) X(LoraLinear, part)
#define SIZES(X) X(QLinear) X(ExpertLinear) X(MoeLayer) X(DeltaLayer) X(SharedMlp) X(DLayer) X(DModel) \
    X(DStep) X(RecentRows) X(LoraPart) X(LoraLinear)

// "Struct=size;Struct.field=offset;..." into out (cap bytes); returns the length it needs.
int64_t struct_layout(char *out, int64_t cap) {
    int64_t n = 0;
#define LAYOUT_SIZE(S) n += snprintf(out + (n < cap ? n : cap), n < cap ? (size_t)(cap - n) : 0, \
                                     #S "=%zu;", sizeof(S));
#define LAYOUT_FIELD(S, f) n += snprintf(out + (n < cap ? n : cap), n < cap ? (size_t)(cap - n) : 0, \
                                         #S "." #f "=%zu;", offsetof(S, f));
    SIZES(LAYOUT_SIZE)
    LAYOUT(LAYOUT_FIELD)
    return n;
}
