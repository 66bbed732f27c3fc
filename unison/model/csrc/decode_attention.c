// Decode attention over a paged KV cache, for CPUs.
//
// One query token per request attends over its request's cached keys and values, read in place
// through the block table: no gather into a padded copy, no mask, each K/V byte read once and in
// address order (a block's rows are contiguous). Torch's path (index_select into a buffer, then
// SDPA over the padded batch) moves every byte three times.
//
// Layouts (float32, contiguous):
//   q, out       [num_seqs, num_heads, head_dim]
//   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
//   block_tables [num_seqs, table_stride]  int64, block ids of each sequence in order
//   context_lens [num_seqs]                int64, tokens to attend to (the new one included)
// window > 0 keeps only the last `window` tokens (sliding-window attention).
//
// Built at first use by unison/model/cpu_kernels.py with -O3 -march=native -fopenmp.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

// Blocks sit anywhere in the pool, and hardware prefetchers stop at page boundaries: while a
// block's rows are used, each row's counterpart in the next block is fetched ahead.
static inline void prefetch_row(const float *row, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i);
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

// The query heads [h0, h1) of one sequence; each K/V row is read once for all of them. Inlined
// into a copy per common head_dim, so that the compiler unrolls the inner loops fully.
static inline __attribute__((always_inline)) void attend_heads(
        const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
        int64_t first, int64_t len, float *out, int64_t h0, int64_t h1, int64_t group,
        int64_t kv_heads, const int64_t head_dim, int64_t block_size, float scale, float *scores) {
    const int64_t n = len - first, row = kv_heads * head_dim;
    const int64_t last = (len - 1) / block_size;
    for (int64_t b = first / block_size, i = 0; b * block_size < len; b++) {
        const float *block = k_cache + table[b] * block_size * row;
        const float *next = b < last ? k_cache + table[b + 1] * block_size * row : NULL;
        const int64_t t0 = b * block_size < first ? first - b * block_size : 0;
        const int64_t t1 = len - b * block_size < block_size ? len - b * block_size : block_size;
        for (int64_t t = t0; t < t1; t++, i++) {
            if (next) prefetch_row(next + t * row, row);
            for (int64_t h = h0; h < h1; h++)
                scores[(h - h0) * n + i] =
                    dot(q + h * head_dim, block + t * row + h / group * head_dim, head_dim) * scale;
        }
    }
    for (int64_t h = h0; h < h1; h++) {  // softmax, in place
        float *s = scores + (h - h0) * n, mx = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
        for (int64_t i = 0; i < n; i++) sum += (s[i] = expf(s[i] - mx));
        for (int64_t i = 0; i < n; i++) s[i] /= sum;
    }
    for (int64_t i = h0 * head_dim; i < h1 * head_dim; i++) out[i] = 0.0f;
    for (int64_t b = first / block_size, i = 0; b * block_size < len; b++) {
        const float *block = v_cache + table[b] * block_size * row;
        const float *next = b < last ? v_cache + table[b + 1] * block_size * row : NULL;
        const int64_t t0 = b * block_size < first ? first - b * block_size : 0;
        const int64_t t1 = len - b * block_size < block_size ? len - b * block_size : block_size;
        for (int64_t t = t0; t < t1; t++, i++) {
            if (next) prefetch_row(next + t * row, row);
            for (int64_t h = h0; h < h1; h++)
                axpy(out + h * head_dim, scores[(h - h0) * n + i],
                     block + t * row + h / group * head_dim, head_dim);
        }
    }
}

typedef void attend_fn(const float *, const float *, const float *, const int64_t *, int64_t,
                       int64_t, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       float, float *);

#define ATTEND(NAME, D)                                                                            \
    static void NAME(const float *q, const float *k, const float *v, const int64_t *table,        \
                     int64_t first, int64_t len, float *out, int64_t h0, int64_t h1,              \
                     int64_t group, int64_t kv_heads, int64_t head_dim, int64_t block_size,       \
                     float scale, float *scores) {                                                \
        (void)head_dim;                                                                           \
        attend_heads(q, k, v, table, first, len, out, h0, h1, group, kv_heads, D, block_size,     \
                     scale, scores);                                                              \
    }
ATTEND(attend_64, 64)
ATTEND(attend_128, 128)
ATTEND(attend_any, head_dim)

int decode_attention(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                     float *out, int64_t num_seqs, int64_t num_heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t window, float scale,
                     int num_threads) {
    attend_fn *attend = head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any;
    const int64_t group = num_heads / kv_heads;
    // A task is a sequence with all its heads (rows read whole, once); with fewer sequences than
    // threads, a (sequence, kv head) pair, so that a single long decode still uses every thread.
    const int64_t splits = num_seqs >= 2 * num_threads ? 1 : kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int64_t cap = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * splits; task++) {
            const int64_t s = task / splits, part = task % splits;
            const int64_t h0 = part * num_heads / splits, h1 = (part + 1) * num_heads / splits;
            const int64_t len = context_lens[s];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            const int64_t need = (h1 - h0) * (len - first);
            if (need > cap) {
                free(scores);
                scores = malloc(sizeof(float) * need);
                cap = scores ? need : 0;
            }
            if (!scores) {
                failed = 1;
                continue;
            }
            const int64_t off = s * num_heads * head_dim;
            attend(q + off, k_cache, v_cache, block_tables + s * table_stride, first, len, out + off,
                   h0, h1, group, kv_heads, head_dim, block_size, scale, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
