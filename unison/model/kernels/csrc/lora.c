// LoRA updates for CPUs: y[r] += (x[r] A) B for each row r on its own adapter (none: unchanged).
//
// The S-LoRA / Punica shape: a mixed batch in one call, each row through its adapter's two small
// matrices, never a merged weight. A row's result depends on that row alone: each t = x A is one
// chain of fused multiply-adds over k in order, each update (t B)[c] one chain over the rank in
// order, added to y once, whatever the batch, its other adapters or the thread count. torch's
// GEMMs (and oneDNN's) block by M, so their rows change with the batch: this kernel is what keeps
// a LoRA step batch invariant.
//
// Work: rows run in groups of up to 4 on one adapter, which share each load of A and B. First
// t = x A for every group, part (q, k, v of a fused linear) and 8 or 16 ranks; then y += t B for
// every group, part and 64 columns: enough pieces for every thread at batch 1, where the bytes
// of A and B are the cost. So that a piece reads whole cache lines, in order, A is stored in
// panels of 8 ranks, [ceil(rank / 8), k, 8], and B in tiles of 16 columns, [ceil(n / 16), rank,
// 16]. AVX2 + FMA where the compiler targets it, portable C (fmaf, the same roundings) otherwise.
// Called by decoder.c after each of a layer's four linears, and by the Python forward
// (decoder.py) the same way. Built with the other kernels by unison/model/kernels/cpu_kernels.py
// (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lora.h"

#define GROUP 4  // rows that share A's and B's loads
#define CHUNK 64  // output columns per piece of y += t B (a multiple of 16)
// Floats ahead to prefetch: at batch 1 A and B stream from memory in short runs, too short for the
// hardware prefetchers to reach full speed (as quant_linear.c found for its weights).
#define PREFETCH 256

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline void vadd_to(float *p, vec v) { _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v)); }
#else
typedef struct { float f[8]; } vec;
static inline vec vzero(void) { return (vec){{0}}; }
static inline vec vload(const float *p) { vec v; memcpy(v.f, p, sizeof v.f); return v; }
static inline vec vbroadcast(const float *p) { vec v; for (int i = 0; i < 8; i++) v.f[i] = *p; return v; }
static inline vec vfma(vec a, vec b, vec c) { for (int i = 0; i < 8; i++) c.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return c; }
static inline void vstore(float *p, vec v) { memcpy(p, v.f, sizeof v.f); }
static inline void vadd_to(float *p, vec v) { for (int i = 0; i < 8; i++) p[i] += v.f[i]; }
#endif

#define INLINE static inline __attribute__((always_inline))

// t[g][8 q .. 8 (q + NP)) = x[g] A over the panels q .. q + NP, for the group's G rows.
INLINE void down(const int G, const int NP, const float *const *x, int64_t k, const float *a, int64_t q,
                 float *const *t) {
    vec acc[GROUP][2];
    for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = vzero();
    const float *a0 = a + q * k * 8, *a1 = a0 + k * 8;
    for (int64_t i = 0; i < k; i++) {
        __builtin_prefetch(a0 + 8 * i + PREFETCH);
        if (NP > 1) __builtin_prefetch(a1 + 8 * i + PREFETCH);
        const vec w0 = vload(a0 + 8 * i), w1 = NP > 1 ? vload(a1 + 8 * i) : vzero();
        for (int g = 0; g < G; g++) {
            const vec xi = vbroadcast(x[g] + i);
            acc[g][0] = vfma(xi, w0, acc[g][0]);
            if (NP > 1) acc[g][1] = vfma(xi, w1, acc[g][1]);
        }
    }
    for (int g = 0; g < G; g++) {
        vstore(t[g] + 8 * q, acc[g][0]);
        if (NP > 1) vstore(t[g] + 8 * q + 8, acc[g][1]);
    }
}

static void down_any(int G, int NP, const float *const *x, int64_t k, const float *a, int64_t q, float *const *t) {
    switch (G * 2 + NP - 1) {
    case 2: down(1, 1, x, k, a, q, t); break;
    case 3: down(1, 2, x, k, a, q, t); break;
    case 4: down(2, 1, x, k, a, q, t); break;
    case 5: down(2, 2, x, k, a, q, t); break;
    case 6: down(3, 1, x, k, a, q, t); break;
    case 7: down(3, 2, x, k, a, q, t); break;
    case 8: down(4, 1, x, k, a, q, t); break;
    default: down(4, 2, x, k, a, q, t); break;
    }
}

// y[g][offset + c0 .. c1) += t[g] B, c0 and c1 on tiles of 16 columns: per column one chain over
// the rank in order, then one add. A last tile past n is computed whole and written in part.
INLINE void up(const int G, const float *const *t, const LoraPart *p, int64_t c0, int64_t c1, float *const *y) {
    const int64_t R = p->rank;
    for (int64_t c = c0; c < c1; c += 16) {
        const float *b = p->b + c * R;  // the tile: [R, 16]
        vec acc[GROUP][2];
        for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = vzero();
        for (int64_t j = 0; j < R; j++) {
            __builtin_prefetch(b + 16 * j + PREFETCH);
            const vec b0 = vload(b + 16 * j), b1 = vload(b + 16 * j + 8);
            for (int g = 0; g < G; g++) {
                const vec tj = vbroadcast(t[g] + j);
                acc[g][0] = vfma(tj, b0, acc[g][0]);
                acc[g][1] = vfma(tj, b1, acc[g][1]);
            }
        }
        for (int g = 0; g < G; g++) {
            float *out = y[g] + p->offset + c;
            if (c + 16 <= p->n) {
                vadd_to(out, acc[g][0]);
                vadd_to(out + 8, acc[g][1]);
            } else {
                float tile[16];
                vstore(tile, acc[g][0]);
                vstore(tile + 8, acc[g][1]);
                for (int64_t i = 0; i < p->n - c; i++) out[i] += tile[i];
            }
        }
    }
}

static void up_any(int G, const float *const *t, const LoraPart *p, int64_t c0, int64_t c1, float *const *y) {
    switch (G) {
    case 1: up(1, t, p, c0, c1, y); break;
    case 2: up(2, t, p, c0, c1, y); break;
    case 3: up(3, t, p, c0, c1, y); break;
    default: up(4, t, p, c0, c1, y); break;
    }
}

typedef struct {
    const int64_t *rows;  // the group's rows, all on one adapter (at most GROUP)
    int64_t count;
    const LoraLinear *linear;
    int32_t part, index;  // the part, and its first panel (down) or first column (up)
} Piece;

static int64_t panels(const LoraPart *p) { return (p->rank + 7) / 8; }

// A part's first rank in a row's t (parts side by side, each padded to whole panels).
static int64_t t_offset(const LoraLinear *l, int part) {
    int64_t off = 0;
    for (int i = 0; i < part; i++) off += 8 * panels(&l->part[i]);
    return off;
}

// The rows on adapters, sorted by adapter (stable): groups are cut from runs of one adapter, so
// that rows interleaved across adapters still share loads.
static int64_t sort_rows(const int64_t *row_adapter, int64_t rows, int64_t *order) {
    int64_t adapters = 0, count = 0;
    for (int64_t r = 0; r < rows; r++) adapters = row_adapter[r] >= adapters ? row_adapter[r] + 1 : adapters;
    for (int64_t a = 0; a < adapters; a++)
        for (int64_t r = 0; r < rows; r++)
            if (row_adapter[r] == a) order[count++] = r;
    return count;
}

// The end of the group that starts at order[i]: up to GROUP rows of one adapter.
static int64_t group_end(const int64_t *order, int64_t adapted, const int64_t *row_adapter, int64_t i) {
    int64_t e = i + 1;
    while (e < adapted && e - i < GROUP && row_adapter[order[e]] == row_adapter[order[i]]) e++;
    return e;
}

void lora_apply(const float *x, int64_t x_stride, int64_t k, float *y, int64_t y_stride, int64_t rows,
                const int64_t *row_adapter, const LoraLinear *const *adapters, int64_t linear,
                int num_threads) {
    int64_t *order = malloc(sizeof(int64_t) * (rows + 1));
    if (!order) abort();
    const int64_t adapted = sort_rows(row_adapter, rows, order);
    int64_t width = 0, groups = 0;  // a row's t, the widest of the step's adapters; groups with work
    for (int64_t i = 0; i < adapted; i = group_end(order, adapted, row_adapter, i)) {
        const LoraLinear *l = &adapters[row_adapter[order[i]]][linear];
        const int64_t w = t_offset(l, (int)l->parts);
        width = w > width ? w : width;
        groups += l->parts > 0;
    }
    // Pieces: pairs of panels and whole parts when there are groups enough to keep every thread
    // busy, single panels and chunks of columns else (batch 1: the bytes of A and B are the cost).
    const int many = groups >= 2 * num_threads, pair = many ? 2 : 1;
    int64_t downs = 0, ups = 0;
    for (int64_t i = 0; i < adapted; i = group_end(order, adapted, row_adapter, i)) {
        const LoraLinear *l = &adapters[row_adapter[order[i]]][linear];
        for (int p = 0; p < l->parts; p++) {
            downs += (panels(&l->part[p]) + pair - 1) / pair;
            ups += many ? 1 : (l->part[p].n + CHUNK - 1) / CHUNK;
        }
    }
    Piece *pieces = malloc(sizeof(Piece) * (downs + ups + 1));
    float *t = malloc(sizeof(float) * (rows * width + 1));
    if (!pieces || !t) abort();
    int64_t d = 0, u = downs;
    for (int64_t i = 0, e; i < adapted; i = e) {
        e = group_end(order, adapted, row_adapter, i);
        const LoraLinear *l = &adapters[row_adapter[order[i]]][linear];
        for (int p = 0; p < l->parts; p++) {
            const LoraPart *part = &l->part[p];
            for (int64_t q = 0; q < panels(part); q += pair) pieces[d++] = (Piece){order + i, e - i, l, p, (int32_t)q};
            for (int64_t c = 0; c < part->n; c += many ? part->n : CHUNK)
                pieces[u++] = (Piece){order + i, e - i, l, p, (int32_t)c};
        }
    }
    const int threads = num_threads > 1 && downs + ups > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < downs; i++) {
            const Piece *s = &pieces[i];
            const LoraPart *p = &s->linear->part[s->part];
            const float *xs[GROUP];
            float *ts[GROUP];
            for (int64_t g = 0; g < s->count; g++)
                xs[g] = x + s->rows[g] * x_stride, ts[g] = t + s->rows[g] * width + t_offset(s->linear, s->part);
            const int np = pair == 2 && s->index + 1 < panels(p) ? 2 : 1;
            down_any((int)s->count, np, xs, k, p->a, s->index, ts);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = downs; i < downs + ups; i++) {
            const Piece *s = &pieces[i];
            const LoraPart *p = &s->linear->part[s->part];
            const float *ts[GROUP];
            float *ys[GROUP];
            for (int64_t g = 0; g < s->count; g++)
                ts[g] = t + s->rows[g] * width + t_offset(s->linear, s->part), ys[g] = y + s->rows[g] * y_stride;
            const int64_t c0 = s->index, c1 = many || c0 + CHUNK > p->n ? (p->n + 15) / 16 * 16 : c0 + CHUNK;
            up_any((int)s->count, ts, p, c0, c1, ys);
        }
    }
    free(t);
    free(pieces);
    free(order);
}
