// A mixture of experts' MLP for CPUs: route each row to its top-k experts, run every active
// expert once over the rows routed to it, and sum each row's expert outputs with their weights.
//
//   logits = x W_router^T (+ b_router) (float32, a fixed order of sums per row and expert)
//   top-k experts by logit (ties: the lower expert index), weights softmax(logits) at them,
//   renormalized over the k when norm_topk
//   y_e = down_e(act(gate_e(x)) * up_e(x))   for the rows routed to e, on quant_linear.c's kernels
//         (gpt-oss: each projection plus its expert's bias, as transformers adds them)
//   out = sum over the row's experts, in increasing expert index, of (y_e * w_e)
//
// The step's (row, expert) pairs are grouped by expert, as lora.c groups rows by adapter: each
// active expert's weights are read once per step, whatever its number of rows. The work is a
// list of (expert, column chunk) items shared by the threads, so that one row on 8 experts and
// 64 rows on 128 experts both keep every thread busy; each item runs the quantized GEMM on one
// thread. A row's result depends only on that row: the router sums in one order, each expert's
// GEMM is row-independent on every instruction-set path, and the combination runs in a fixed
// order, so outputs are bit-identical alone or in any batch.
//
// Built with the other kernels by unison/model/kernels/cpu_kernels.py (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
#endif

#define QBLOCK 32
#define TILE 8
// Rows per pass. Each pass reads every active expert's weights once and widens them for its
// rows, so a pass should give an expert about ROWS_PER_EXPERT rows: 128-row passes over 256
// experts of top-8 gave 4 each, and one layer at 512 rows took 154 ms against 122 in one pass.
// At least MIN_CHUNK rows, and the workspace within WORKSPACE_CAP bytes whatever the step's size.
#define ROWS_PER_EXPERT 16
#define MIN_CHUNK 128
#define WORKSPACE_CAP ((int64_t)256 << 20)
#define MIN_COLS 64  // columns per work item, at least
// Work items per thread and phase, about: enough for the dynamic schedule to even out experts of
// different row counts, few enough that each item's call costs nothing beside its weights (at one
// row, 64-column items over 8 experts cost a third of the layer's time in calls).
#define ITEMS_PER_THREAD 4
#define LANES 16  // the router's partial sums per dot product
#define ROUTER_TILE 4  // rows and experts of router logits computed together

void quant_gemm(const uint8_t *w, int64_t record, int64_t n, int64_t kp, void *act, int64_t m, float *out,
                int64_t ldo, int num_threads);
void quantize_act16(const float *x, int64_t x_stride, int64_t rows, int64_t k, int64_t kp, void *buf,
                    int num_threads);
int64_t act16_bytes(int64_t rows, int64_t kp);
int64_t quant_tile_bytes(int64_t format, int64_t kp);
void act_mul(const float *gate_up, float *out, int64_t rows, int64_t n, int activation, int num_threads);

static int64_t kp_of(int64_t k) { return (k + QBLOCK - 1) / QBLOCK * QBLOCK; }
static int64_t align64(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

// Expert e's packed weight: tiles of 8 columns.
static const uint8_t *expert_weight(const ExpertLinear *l, int64_t e) {
    return l->w + e * (l->n / TILE) * quant_tile_bytes(l->record, kp_of(l->k));
}

// ---- the workspace of one pass of `rows` rows ---------------------------------------------------

typedef struct {
    float *logits;  // [rows, experts]
    int32_t *top;  // [rows, top_k] experts, increasing
    float *weight;  // [rows, top_k]
    int32_t *pos;  // [rows, top_k]: where the pair sits in expert order
    int32_t *pair_row;  // [pairs] in expert order: the row of each
    int64_t *start;  // [experts + 1]: expert e's pairs are [start[e], start[e + 1])
    int32_t *items;  // [max items, 3]: (expert, which linear, first column)
    int64_t cols[2];  // columns per item: gate and up, down
    float *xg;  // [pairs, hidden] the rows gathered
    uint8_t *act_h;  // act16 of xg, expert e's at act16_bytes(start[e], kp)
    float *gate_up;  // [pairs, 2 * inter]
    float *a;  // [pairs, inter] act(gate) * up
    uint8_t *act_i;
    float *y;  // [pairs, hidden]
} Work;

static int64_t max_items(const MoeLayer *L) {
    return L->experts * (2 * ((L->inter + MIN_COLS - 1) / MIN_COLS) + (L->hidden + MIN_COLS - 1) / MIN_COLS);
}

static Work carve(const MoeLayer *L, int64_t rows, uint8_t *base) {
    const int64_t pairs = rows * L->top_k, kh = kp_of(L->hidden), ki = kp_of(L->inter);
    Work w;
    uint8_t *p = base;
#define TAKE(field, bytes) (w.field = (void *)p, p += align64(bytes))
    TAKE(logits, 4 * rows * L->experts);
    TAKE(top, 4 * pairs);
    TAKE(weight, 4 * pairs);
    TAKE(pos, 4 * pairs);
    TAKE(pair_row, 4 * pairs);
    TAKE(start, 8 * (L->experts + 1));
    TAKE(items, 12 * max_items(L));
    TAKE(xg, 4 * pairs * L->hidden);
    TAKE(act_h, act16_bytes(pairs, kh));
    TAKE(gate_up, 4 * pairs * 2 * L->inter);
    TAKE(a, 4 * pairs * L->inter);
    TAKE(act_i, act16_bytes(pairs, ki));
    TAKE(y, 4 * pairs * L->hidden);
#undef TAKE
    (void)p;
    return w;
}

static int64_t pass_bytes(const MoeLayer *L, int64_t rows) {
    uint8_t *end = (uint8_t *)carve(L, rows, NULL).y + align64(4 * rows * L->top_k * L->hidden);
    return (int64_t)(uintptr_t)end + 64;
}

static int64_t chunk_rows(const MoeLayer *L, int64_t rows) {
    int64_t chunk = (ROWS_PER_EXPERT * L->experts + L->top_k - 1) / L->top_k;
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk;
    while (chunk > MIN_CHUNK && pass_bytes(L, chunk) > WORKSPACE_CAP) chunk /= 2;
    return rows < chunk ? rows : chunk;
}

int64_t moe_workspace_bytes(const MoeLayer *L, int64_t rows) { return pass_bytes(L, chunk_rows(L, rows)); }

// ---- routing ----------------------------------------------------------------------------------

// logits[r, e] for rows [0, nr) and experts [0, ne) of a tile: per (row, expert) LANES partial
// sums (lane l takes i = l, l + LANES, ...), added pairwise at the end. Inlined with constant
// sizes for a whole tile, so that its 16 chains of fmas stay in registers: one chain at a time
// was bound by the fma's latency (3 GMAC/s, a quarter of a 512-token prefill's experts).
static inline __attribute__((always_inline)) void router_tile(
        const float *x, int64_t x_stride, const float *router, const float *bias, int64_t hidden,
        int64_t nr, int64_t ne, float *logits, int64_t experts) {
    float acc[ROUTER_TILE][ROUTER_TILE][LANES] = {{{0}}};
    const int64_t body = hidden / LANES * LANES;
    for (int64_t i = 0; i < body; i += LANES)
        for (int64_t r = 0; r < nr; r++)
            for (int64_t e = 0; e < ne; e++)
                for (int l = 0; l < LANES; l++)
                    acc[r][e][l] = fmaf(x[r * x_stride + i + l], router[e * hidden + i + l], acc[r][e][l]);
    for (int64_t r = 0; r < nr; r++)
        for (int64_t e = 0; e < ne; e++) {
            float tail = 0.0f, *a = acc[r][e];
            for (int64_t i = body; i < hidden; i++)
                tail = fmaf(x[r * x_stride + i], router[e * hidden + i], tail);
            for (int width = LANES / 2; width >= 1; width /= 2)
                for (int l = 0; l < width; l++) a[l] += a[l + width];
            logits[r * experts + e] = a[0] + tail;
            if (bias) logits[r * experts + e] += bias[e];
        }
}

// logits[r, e] for experts [e0, e0 + ne): the same operations whatever the rows, threads or tiles.
static void router_block(const float *x, int64_t x_stride, int64_t rows, const float *router,
                         const float *bias, int64_t hidden, int64_t e0, int64_t ne, float *logits,
                         int64_t experts) {
    for (int64_t e = e0; e < e0 + ne; e += ROUTER_TILE) {
        const int64_t te = e0 + ne - e < ROUTER_TILE ? e0 + ne - e : ROUTER_TILE;
        const float *w = router + e * hidden, *b = bias ? bias + e : NULL;
        for (int64_t r0 = 0; r0 < rows; r0 += ROUTER_TILE) {
            const int64_t nr = rows - r0 < ROUTER_TILE ? rows - r0 : ROUTER_TILE;
            const float *xr = x + r0 * x_stride;
            float *out = logits + r0 * experts + e;
            if (nr == ROUTER_TILE && te == ROUTER_TILE)
                router_tile(xr, x_stride, w, b, hidden, ROUTER_TILE, ROUTER_TILE, out, experts);
            else
                router_tile(xr, x_stride, w, b, hidden, nr, te, out, experts);
        }
    }
}

// The row's top-k experts (ties: the lower index) and their weights, experts in increasing order.
static void select_experts(const MoeLayer *L, const float *logits, int32_t *top, float *weight) {
    const int64_t E = L->experts, K = L->top_k;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; e++) mx = fmaxf(mx, logits[e]);
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - mx);
    uint8_t taken[1024] = {0};  // experts <= 1024, checked at load
    for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || logits[e] > logits[best])) best = e;
        taken[best] = 1;
        top[j] = (int32_t)best;
    }
    float chosen = 0.0f;  // in the softmax's order of size, as the reference sums them
    for (int64_t j = 0; j < K; j++) {
        weight[j] = expf(logits[top[j]] - mx) / sum;
        chosen += weight[j];
    }
    if (L->norm_topk)
        for (int64_t j = 0; j < K; j++) weight[j] /= chosen;
    for (int64_t j = 1; j < K; j++)  // by expert index: the combination's fixed order
        for (int64_t i = j; i > 0 && top[i - 1] > top[i]; i--) {
            const int32_t t = top[i]; top[i] = top[i - 1]; top[i - 1] = t;
            const float f = weight[i]; weight[i] = weight[i - 1]; weight[i - 1] = f;
        }
}

// Pairs grouped by expert (rows in order within each); work items for the two GEMM phases.
static void group_pairs(const MoeLayer *L, int64_t rows, Work *w, int64_t *n_up, int64_t *n_down) {
    const int64_t E = L->experts, K = L->top_k;
    memset(w->start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < rows * K; p++) w->start[w->top[p] + 1]++;
    for (int64_t e = 0; e < E; e++) w->start[e + 1] += w->start[e];
    int64_t *fill = (int64_t *)w->items;  // scratch for the cursors, before the items are written
    for (int64_t e = 0; e < E; e++) fill[e] = w->start[e];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < K; j++) {
            const int64_t at = fill[w->top[r * K + j]]++;
            w->pair_row[at] = (int32_t)r;
            w->pos[r * K + j] = (int32_t)at;
        }
    int64_t n = 0, active = 0;
    for (int64_t e = 0; e < E; e++) active += w->start[e + 1] > w->start[e];
    for (int pass = 0; pass < 2; pass++) {  // gate and up items first, then down's
        const int64_t width = pass ? L->hidden : L->inter;
        const int64_t share = active * (pass ? 1 : 2) * width / (ITEMS_PER_THREAD * omp_get_num_threads());
        int64_t cols = (share + TILE - 1) / TILE * TILE;
        cols = cols < MIN_COLS ? MIN_COLS : cols > width ? width : cols;
        w->cols[pass] = cols;
        for (int64_t e = 0; e < E; e++) {
            if (w->start[e + 1] == w->start[e]) continue;
            for (int which = 0; which < (pass ? 1 : 2); which++)
                for (int64_t c = 0; c < width; c += cols) {
                    w->items[3 * n] = (int32_t)e;
                    w->items[3 * n + 1] = pass ? 2 : which;
                    w->items[3 * n + 2] = (int32_t)c;
                    n++;
                }
        }
        if (!pass) *n_up = n;
    }
    *n_down = n - *n_up;
}

// ---- the experts --------------------------------------------------------------------------------

// Rows [start, start + count) of the act16 buffer `act` (prepared by prepare()) through columns
// [c0, c0 + cols) of expert e's linear `l`, into `out` (row stride ldo) at those columns.
static void expert_gemm(const ExpertLinear *l, int64_t e, int64_t c0, int64_t cols, const uint8_t *act,
                        int64_t start, int64_t count, float *out, int64_t ldo) {
    const int64_t kp = kp_of(l->k);
    const uint8_t *wt = expert_weight(l, e) + (c0 / TILE) * quant_tile_bytes(l->record, kp);
    quant_gemm(wt, l->record, cols, kp, (void *)(act + act16_bytes(start, kp)), count, out + start * ldo + c0, ldo, 1);
}

// The kernels' activations of rows [start, start + count) of x [.., k] into act.
static void prepare(const float *x, int64_t k, int64_t start, int64_t count, uint8_t *act) {
    const int64_t kp = kp_of(k);
    quantize_act16(x + start * k, k, count, k, kp, act + act16_bytes(start, kp), 1);
}

// x[r, :n] += bias for `rows` rows of stride `stride`.
static void add_bias(float *x, int64_t stride, int64_t rows, const float *bias, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) x[r * stride + i] += bias[i];
}

static int64_t item_cols(const Work *w, int pass, int64_t c0, int64_t width) {
    return c0 + w->cols[pass] <= width ? w->cols[pass] : width - c0;
}

static void moe_pass(const MoeLayer *L, const float *x, int64_t x_stride, int64_t rows, float *out,
                     int64_t out_stride, Work *w, int num_threads) {
    const int64_t E = L->experts, K = L->top_k, H = L->hidden, I = L->inter;
    int64_t n_up = 0, n_down = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t e0 = 0; e0 < E; e0 += ROUTER_TILE)
            router_block(x, x_stride, rows, L->router, L->router_bias, H, e0,
                         E - e0 < ROUTER_TILE ? E - e0 : ROUTER_TILE, w->logits, E);
#pragma omp single
        {
            for (int64_t r = 0; r < rows; r++)
                select_experts(L, w->logits + r * E, w->top + r * K, w->weight + r * K);
            group_pairs(L, rows, w, &n_up, &n_down);
        }
        // Each active expert's rows, gathered and prepared for its gate and up.
#pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; e++) {
            const int64_t start = w->start[e], count = w->start[e + 1] - start;
            if (!count) continue;
            for (int64_t p = start; p < start + count; p++)
                memcpy(w->xg + p * H, x + w->pair_row[p] * x_stride, sizeof(float) * H);
            prepare(w->xg, H, start, count, w->act_h);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_up; i++) {
            const int64_t e = w->items[3 * i], which = w->items[3 * i + 1], c0 = w->items[3 * i + 2];
            const ExpertLinear *l = which ? &L->up : &L->gate;
            expert_gemm(l, e, c0, item_cols(w, 0, c0, I), w->act_h, w->start[e],
                        w->start[e + 1] - w->start[e], w->gate_up + which * I, 2 * I);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; e++) {
            const int64_t start = w->start[e], count = w->start[e + 1] - start;
            if (!count) continue;
            if (L->gate_bias) add_bias(w->gate_up + start * 2 * I, 2 * I, count, L->gate_bias + e * I, I);
            if (L->up_bias) add_bias(w->gate_up + start * 2 * I + I, 2 * I, count, L->up_bias + e * I, I);
            act_mul(w->gate_up + start * 2 * I, w->a + start * I, count, I, L->activation, 1);
            prepare(w->a, I, start, count, w->act_i);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = n_up; i < n_up + n_down; i++) {
            const int64_t e = w->items[3 * i], c0 = w->items[3 * i + 2];
            expert_gemm(&L->down, e, c0, item_cols(w, 1, c0, H), w->act_i, w->start[e],
                        w->start[e + 1] - w->start[e], w->y, H);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *o = out + r * out_stride;
            memset(o, 0, sizeof(float) * H);
            for (int64_t j = 0; j < K; j++) {  // increasing expert index; the product rounded first
                const float *y = w->y + (int64_t)w->pos[r * K + j] * H, wt = w->weight[r * K + j];
                const float *b = L->down_bias ? L->down_bias + (int64_t)w->top[r * K + j] * H : NULL;
                if (b)
                    for (int64_t h = 0; h < H; h++) o[h] += (y[h] + b[h]) * wt;
                else
                    for (int64_t h = 0; h < H; h++) o[h] += y[h] * wt;
            }
        }
    }
}

void moe_forward(const MoeLayer *L, const float *x, int64_t x_stride, int64_t rows, float *out,
                 int64_t out_stride, void *workspace, int num_threads) {
    const int64_t chunk = chunk_rows(L, rows);
    Work w = carve(L, chunk, (uint8_t *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63));
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
        moe_pass(L, x + r0 * x_stride, x_stride, n, out + r0 * out_stride, out_stride, &w, num_threads);
    }
}

// The router's choice for rows of x, for tests: top [rows, top_k], weight [rows, top_k].
void moe_route(const MoeLayer *L, const float *x, int64_t x_stride, int64_t rows, int32_t *top, float *weight) {
    float *logits = malloc(sizeof(float) * rows * L->experts);
    if (!logits) return;
    router_block(x, x_stride, rows, L->router, L->router_bias, L->hidden, 0, L->experts, logits, L->experts);
    for (int64_t r = 0; r < rows; r++)
        select_experts(L, logits + r * L->experts, top + r * L->top_k, weight + r * L->top_k);
    free(logits);
}
