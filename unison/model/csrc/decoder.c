// The whole forward of a quantized decoder in one call, for CPUs.
//
// decoder.py's forward, op for op, through the same kernels (quant_linear.c, paged_attention.c,
// fused_ops.c): at batch 1 a step is about 120 small kernel calls, and from Python each costs
// 5-10 µs of argument passing and tensor allocation, a third of a decode step on this model.
// Here the step is one call. The layer's shape is data (DModel, DLayer), so every family of
// families.py runs here as it runs there.
//
// Built with the other kernels by unison/model/cpu_kernels.py (-O3 -march=native -fopenmp).

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
void rope(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows,
          int64_t heads, int64_t head_dim, int num_threads);
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

typedef struct {
    QLinear qkv, o_proj, gate_up, down;
    const float *input_norm, *post_attention_norm, *pre_mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    int64_t rope, window;  // window 0: attends to everything
    void *k_cache, *v_cache;  // this layer's [blocks, block_size, kv_heads, head_dim]
    const float *key_weight, *key_mean;  // int8 keys' rounding (store_kv); NULL: as they are, nearest
    const MoeLayer *moe;  // a mixture of experts instead of gate_up and down; NULL: dense
    const float *sinks;  // [heads]: learned logits in each softmax's denominator (gpt-oss); NULL: none
} DLayer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, block_size;
    float eps, attention_scale, embed_scale;  // embed_scale 0: none
    int activation, qk_norm, kv_dtype;  // qk_norm: 0 none, 1 per head, 2 over the projection
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
    // An image's rows (vision.py): these rows' embeddings replace their tokens', after the
    // embedding's scale; row_ahead (NULL: causal) is each row's keys seen past its own position.
    int64_t embed_count;
    const int64_t *embed_rows;
    const float *embed_values;  // [embed_count, hidden]
    const int64_t *row_ahead;
} DStep;

// The step's buffers, carved from one workspace. Widths have room for a linear's padding
// columns (up to 7, written then compacted away) and inputs for whole blocks of 32.
typedef struct {
    float *h, *x, *delta, *qkv, *q, *attn, *gate_up, *act;
    void *scratch, *moe;  // the linears' activations; the mixture of experts' workspace
} Buffers;

#define PAD 8
#define BLOCKS(k) (((k) + 31) / 32 * 32)

static int64_t widest(const DModel *m) {  // of the linears' inputs: hidden, intermediate, q heads
    const int64_t q = m->heads * m->head_dim, w = m->intermediate > m->hidden ? m->intermediate : m->hidden;
    return q > w ? q : w;
}

static Buffers carve(const DModel *m, int64_t rows, void *base) {
    const int64_t H = m->hidden, q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    const int64_t widths[] = {H, H, H + PAD, q + 2 * kv + PAD, q, q, 2 * m->intermediate + PAD,
                              m->intermediate};
    float *p = base;
    Buffers b;
    float **order[] = {&b.h, &b.x, &b.delta, &b.qkv, &b.q, &b.attn, &b.gate_up, &b.act};
    for (int i = 0; i < 8; i++) {
        *order[i] = p;
        p += rows * widths[i];
    }
    b.scratch = (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    b.moe = (uint8_t *)b.scratch + act16_bytes(rows, BLOCKS(widest(m)));
    return b;
}

int64_t decoder_workspace_bytes(const DModel *m, int64_t rows) {
    const Buffers b = carve(m, rows, NULL);
    const int64_t moe = m->layer[0].moe ? moe_workspace_bytes(m->layer[0].moe, rows) : 0;
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

int decoder_forward(const DModel *m, const DStep *s) {
    const int64_t n = s->rows, H = m->hidden, d = m->head_dim, I = m->intermediate;
    const int64_t q = m->heads * d, kv = m->kv_heads * d, qkv_w = q + 2 * kv;
    const int t = s->num_threads;
    Buffers b = carve(m, n, s->workspace);
    float *h = b.h, *x = b.x, *delta = b.delta, *qkv = b.qkv, *qbuf = b.q, *attn = b.attn;
    float *gate_up = b.gate_up, *act = b.act;

    dequantize_columns(m->embed_record, m->embed, m->embed_kp, H, s->ids, n, h);
    if (m->embed_scale != 0.0f)
        for (int64_t i = 0; i < n * H; i++) h[i] *= m->embed_scale;
    for (int64_t i = 0; i < s->embed_count; i++)
        memcpy(h + s->embed_rows[i] * H, s->embed_values + i * H, sizeof(float) * H);
    add_norm(h, NULL, m->layer[0].input_norm, x, n, H, m->eps, t);
    for (int64_t li = 0; li < m->layers; li++) {
        const DLayer *L = &m->layer[li];
        linear(&L->qkv, x, n, qkv, &b, t);
        if (s->lora_row) lora_apply(x, H, H, qkv, qkv_w, n, s->lora_row, s->lora, 4 * li, t);
        if (m->qk_norm == 1) {
            norm_groups(qkv, qkv_w, n, m->heads, d, L->q_norm, m->eps);
            norm_groups(qkv + q, qkv_w, n, m->kv_heads, d, L->k_norm, m->eps);
        } else if (m->qk_norm == 2) {
            norm_groups(qkv, qkv_w, n, 1, q, L->q_norm, m->eps);
            norm_groups(qkv + q, qkv_w, n, 1, kv, L->k_norm, m->eps);
        }
        rope(qkv, qkv_w, s->cos[L->rope], s->sin[L->rope], n, m->heads + m->kv_heads, d, t);
        _Float16 *twin_k = s->recent_k ? s->twin_k + li * s->twin_layer : NULL;
        _Float16 *twin_v = s->recent_k ? s->twin_v + li * s->twin_layer : NULL;
        store_kv(qkv + q, qkv + q + kv, qkv_w, L->k_cache, L->v_cache, s->slots, n, kv, d, m->kv_dtype,
                 L->key_weight, L->key_mean, s->recent_k, s->recent_v, twin_k, twin_v, s->twin_slots);
        const RecentRows recent = {s->recent_k, s->recent_v, twin_k, twin_v, s->first_row, s->twin};
        for (int64_t r = 0; r < n; r++) memcpy(qbuf + r * q, qkv + r * qkv_w, sizeof(float) * q);
        if (paged_attention(qbuf, L->k_cache, L->v_cache, s->tables, s->table_stride, s->row_seq, s->row_len,
                            attn, n, m->heads, m->kv_heads, d, m->block_size, L->window,
                            m->attention_scale, s->attention_threads, m->kv_dtype, L->key_mean,
                            s->recent_k ? &recent : NULL, L->sinks, s->row_ahead) != 0)
            return -1;
        linear(&L->o_proj, attn, n, delta, &b, t);
        if (s->lora_row) lora_apply(attn, q, q, delta, H, n, s->lora_row, s->lora, 4 * li + 1, t);
        if (L->post_attention_norm) add_rms_norm(delta, NULL, L->post_attention_norm, delta, n, H, m->eps, t);
        add_norm(h, delta, L->pre_mlp_norm, x, n, H, m->eps, t);
        if (L->moe) {  // (LoRA adapters never target the experts: refused at load)
            moe_forward(L->moe, x, H, n, delta, H, b.moe, t);
        } else {
            linear(&L->gate_up, x, n, gate_up, &b, t);
            if (s->lora_row) lora_apply(x, H, H, gate_up, 2 * I, n, s->lora_row, s->lora, 4 * li + 2, t);
            act_mul(gate_up, act, n, I, m->activation, t);
            linear(&L->down, act, n, delta, &b, t);
            if (s->lora_row) lora_apply(act, I, I, delta, H, n, s->lora_row, s->lora, 4 * li + 3, t);
        }
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
    X(DLayer, key_weight) X(DLayer, key_mean) X(DLayer, moe) X(DLayer, sinks)                           \
    X(DModel, layers) X(DModel, hidden) X(DModel, heads) X(DModel, kv_heads) X(DModel, head_dim)        \
    X(DModel, intermediate) X(DModel, vocab) X(DModel, block_size) X(DModel, eps)                       \
    X(DModel, attention_scale) X(DModel, embed_scale) X(DModel, activation) X(DModel, qk_norm)          \
    X(DModel, kv_dtype) X(DModel, embed_record) X(DModel, embed_kp) X(DModel, embed) X(DModel, norm)    \
    X(DModel, lm_head) X(DModel, layer)                                                                 \
    X(DStep, rows) X(DStep, ids) X(DStep, cos) X(DStep, sin) X(DStep, slots) X(DStep, tables)           \
    X(DStep, row_seq) X(DStep, row_len) X(DStep, table_stride) X(DStep, logit_rows)                     \
    X(DStep, logit_index) X(DStep, workspace) X(DStep, logits) X(DStep, num_threads)                    \
    X(DStep, attention_threads) X(DStep, lora_row) X(DStep, lora) X(DStep, recent_k) X(DStep, recent_v) \
    X(DStep, twin_k) X(DStep, twin_v) X(DStep, twin_layer) X(DStep, twin_slots) X(DStep, first_row)     \
    X(DStep, twin) X(DStep, embed_count) X(DStep, embed_rows) X(DStep, embed_values) X(DStep, row_ahead)  \
    X(RecentRows, k) X(RecentRows, v) X(RecentRows, k_twins) X(RecentRows, v_twins)                     \
    X(RecentRows, first_row) X(RecentRows, twin)                                                        \
    X(LoraPart, a) X(LoraPart, b) X(LoraPart, rank) X(LoraPart, n) X(LoraPart, offset)                  \
    X(LoraLinear, parts) X(LoraLinear, part)
#define SIZES(X) X(QLinear) X(ExpertLinear) X(MoeLayer) X(DLayer) X(DModel) X(DStep) X(RecentRows) \
    X(LoraPart) X(LoraLinear)

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
