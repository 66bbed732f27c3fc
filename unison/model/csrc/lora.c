// LoRA updates for CPUs: y[r] += (x[r] A) B for each row r on its own adapter (none: unchanged).
//
// The S-LoRA / Punica shape: a mixed batch in one call, each row through its adapter's two small
// matrices, never a merged weight. A row's result depends on that row alone: t = x A is reduced
// over k in order, y's update over the rank in order, whatever the batch, its other adapters or
// the thread count. torch's GEMMs (and oneDNN's) pick their blocking by M, so their rows change
// with the batch: this kernel is what keeps a LoRA step batch invariant.
//
// Rows are taken in groups of up to 4 on the same adapter: each of A's and B's vectors is loaded
// once for the group. The group only shares loads, every row still runs the same fmaf sequence,
// so a row's bits do not depend on its group. Called by decoder.c after each of a layer's four
// linears, and by the Python forward (decoder.py) the same way. Built with the other kernels by
// unison/model/cpu_kernels.py (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lora.h"

#define GROUP 4  // rows that share A's and B's loads
#define TILE 16  // output columns accumulated in registers before y is touched

// t[g][0:rank] = x[g] A for the group's rows (over k in order).
static void down_project(const float *const *x, int64_t rows, int64_t k, const LoraPart *p, float (*t)[LORA_MAX_RANK]) {
    const int64_t R = p->rank;
    for (int64_t g = 0; g < rows; g++) memset(t[g], 0, sizeof(float) * R);
    for (int64_t i = 0; i < k; i++) {
        const float *a = p->a + i * R;
        for (int64_t g = 0; g < rows; g++) {
            const float xi = x[g][i];
            float *tg = t[g];
            for (int64_t j = 0; j < R; j++) tg[j] = fmaf(xi, a[j], tg[j]);
        }
    }
}

// y[g][offset + c] += (t[g] B)[c], in column tiles summed over the rank in order, then added once.
static void up_project(float *const *y, int64_t rows, const LoraPart *p, float (*t)[LORA_MAX_RANK]) {
    const int64_t R = p->rank, n = p->n;
    for (int64_t c0 = 0; c0 < n; c0 += TILE) {
        const int64_t w = n - c0 < TILE ? n - c0 : TILE;
        float acc[GROUP][TILE];
        for (int64_t g = 0; g < rows; g++) memset(acc[g], 0, sizeof(float) * TILE);
        for (int64_t j = 0; j < R; j++) {
            const float *b = p->b + j * n + c0;
            for (int64_t g = 0; g < rows; g++) {
                const float tj = t[g][j];
                if (w == TILE)  // a constant trip count: the tile stays in registers
                    for (int64_t c = 0; c < TILE; c++) acc[g][c] = fmaf(tj, b[c], acc[g][c]);
                else
                    for (int64_t c = 0; c < w; c++) acc[g][c] = fmaf(tj, b[c], acc[g][c]);
            }
        }
        for (int64_t g = 0; g < rows; g++) {
            float *out = y[g] + p->offset + c0;
            for (int64_t c = 0; c < w; c++) out[c] += acc[g][c];
        }
    }
}

static void apply_group(const float *const *x, float *const *y, int64_t rows, int64_t k, const LoraLinear *l) {
    float t[GROUP][LORA_MAX_RANK];
    for (int64_t i = 0; i < l->parts; i++) {
        down_project(x, rows, k, &l->part[i], t);
        up_project(y, rows, &l->part[i], t);
    }
}

// Runs of rows on one adapter, cut into groups of up to GROUP: the unit of work.
static int64_t groups(int64_t rows, const int64_t *row_adapter, int64_t *start, int64_t *len) {
    int64_t count = 0;
    for (int64_t r = 0; r < rows;) {
        if (row_adapter[r] < 0) {
            r++;
            continue;
        }
        int64_t e = r + 1;
        while (e < rows && e - r < GROUP && row_adapter[e] == row_adapter[r]) e++;
        start[count] = r, len[count++] = e - r;
        r = e;
    }
    return count;
}

void lora_apply(const float *x, int64_t x_stride, int64_t k, float *y, int64_t y_stride, int64_t rows,
                const int64_t *row_adapter, const LoraLinear *const *adapters, int64_t linear,
                int num_threads) {
    int64_t start[rows], len[rows];
    const int64_t n = groups(rows, row_adapter, start, len);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (n > 1 && num_threads > 1)
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = start[i];
        const float *xs[GROUP];
        float *ys[GROUP];
        for (int64_t g = 0; g < len[i]; g++) xs[g] = x + (r + g) * x_stride, ys[g] = y + (r + g) * y_stride;
        apply_group(xs, ys, len[i], k, &adapters[row_adapter[r]][linear]);
    }
}
