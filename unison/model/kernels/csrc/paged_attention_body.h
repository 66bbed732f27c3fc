// The body of paged_attention.c, once per KV cache element type: the includer defines KV_T
// (the element type), KV_FLOAT(x) (its value as float), KV_LOAD8(p) (8 of them as __m256, with
// AVX2), KV_NAME(name) (a suffixed name), and how a token's row holds its heads: KV_HEAD(h, d)
// (where head h starts, in elements) and KV_ROW(heads, d) (a row's length). KV_OWN_DOT: the
// includer defines KV_NAME(dot) and KV_NAME(axpy) itself. KV_DEQUANT(dst, src, n): the includer's
// conversion of a head's n values to float; with it, each K and V row is converted once for all
// the query heads and rows that read it (dot_wide / axpy_wide then do the arithmetic), instead of
// once per head: an 8-bit type's conversion costs more than its arithmetic. KV_DEQUANT_KEY(dst,
// src, n, mean): the same for a key of the head whose mean is `mean` (int8: blocks stored less
// it); KV_DEQUANT's by default. KV_DECODE(...): the includer's own path for a tile of one row,
// returning 1 where it served it. A tile's `recent` (q8.h; NULL: none) is read in the
// KV_DEQUANT path only: the int8 cache's.

#if defined(KV_DEQUANT) && !defined(KV_DEQUANT_KEY)
#define KV_DEQUANT_KEY(dst, src, n, mean) KV_DEQUANT(dst, src, n)
#endif

#ifndef KV_OWN_DOT  // (int8 brings its own: a scale per block of 32)
static inline float KV_NAME(dot)(const float *restrict a, const KV_T *restrict b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef ATTN_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), KV_LOAD8(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), KV_LOAD8(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), KV_LOAD8(b + i), acc0);
    s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * KV_FLOAT(b[i]);
    return s;
}

static inline void KV_NAME(axpy)(float *restrict y, float a, const KV_T *restrict x, int64_t n) {
    int64_t i = 0;
#ifdef ATTN_AVX2
    const __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, KV_LOAD8(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * KV_FLOAT(x[i]);
}
#endif

// One tile: query rows [0, nrows) of one request at consecutive positions (row i attends to
// its last `window` tokens of [0, len0 + i)), heads [h0, h1). scores: nrows * (h1 - h0) * span.
static inline __attribute__((always_inline)) void KV_NAME(attend_tile)(
        const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *table,
        int64_t len0, int64_t nrows, int64_t window, float *out, int64_t num_heads, int64_t h0,
        int64_t h1, int64_t group, int64_t kv_heads, const int64_t head_dim, int64_t block_size,
        float scale, const float *key_mean, const Recent *recent, const float *sinks, float *scores) {
    (void)key_mean;  // read by KV_DEQUANT_KEY and KV_DECODE, where the type has a use for it
    const int64_t row = KV_ROW(kv_heads, head_dim), nh = h1 - h0, qstride = num_heads * head_dim;
    const int64_t end = len0 + nrows - 1;  // the last row's length: positions [lo, end)
    const int64_t lo = window > 0 && len0 > window ? len0 - window : 0, span = end - lo;
    const int64_t last = (end - 1) / block_size;
#ifdef KV_DECODE  // the includer's path for one row (a decode step), when it has one for head_dim
    if (nrows == 1 && KV_DECODE(q, k_cache, v_cache, table, len0, lo, out, h0, h1, group, kv_heads,
                                head_dim, block_size, scale, key_mean, recent, sinks, scores))
        return;
#endif
    for (int64_t b = lo / block_size; b * block_size < end; b++) {
        const KV_T *block = k_cache + table[b] * block_size * row;
        const KV_T *next = b < last ? k_cache + table[b + 1] * block_size * row : NULL;
        const int64_t t0 = b * block_size < lo ? lo - b * block_size : 0;
        const int64_t t1 = end - b * block_size < block_size ? end - b * block_size : block_size;
        for (int64_t t = t0; t < t1; t++) {
            const int64_t pos = b * block_size + t;
            if (next) prefetch_row(next + t * row, row * (int64_t)sizeof(KV_T));
#ifdef KV_DEQUANT
            // rows [ea, ea + block_size) are in pos's block: with `recent`, they read it exact
            const int64_t ea = b * block_size - len0 + 1;
            for (int64_t kh = h0 / group; kh * group < h1; kh++) {
                float key[head_dim], exact[head_dim];
                KV_DEQUANT_KEY(key, block + t * row + KV_HEAD(kh, head_dim), head_dim,
                               key_mean != NULL ? key_mean + kh * head_dim : NULL);
                const _Float16 *own = recent && ea < nrows && ea + block_size > 0
                    ? recent_row(recent, 0, pos, kh, kv_heads, head_dim, block_size) : NULL;
                for (int64_t x = 0; own && x < head_dim; x++) exact[x] = (float)own[x];
                const int64_t ha = kh * group > h0 ? kh * group : h0;
                const int64_t hb = (kh + 1) * group < h1 ? (kh + 1) * group : h1;
                for (int64_t i = pos < len0 ? 0 : pos - len0 + 1; i < nrows; i++) {
                    if (window > 0 && pos < len0 + i - window) break;  // before this row's window
                    const float *k = own && i >= ea && i < ea + block_size ? exact : key;
                    for (int64_t h = ha; h < hb; h++)
                        scores[(i * nh + h - h0) * span + pos - lo] =
                            dot_wide(q + i * qstride + h * head_dim, k, head_dim) * scale;
                }
            }
#else
            for (int64_t i = pos < len0 ? 0 : pos - len0 + 1; i < nrows; i++) {
                if (window > 0 && pos < len0 + i - window) break;  // before this row's window
                for (int64_t h = h0; h < h1; h++) {
                    const KV_T *key = block + t * row + KV_HEAD(h / group, head_dim);
                    scores[(i * nh + h - h0) * span + pos - lo] = KV_NAME(dot)(
                        q + i * qstride + h * head_dim, key, head_dim) * scale;
                }
            }
#endif
        }
    }
    for (int64_t i = 0; i < nrows; i++) {
        const int64_t len = len0 + i, first = window > 0 && len > window ? len - window : 0;
        for (int64_t h = h0; h < h1; h++) {
            softmax(scores + (i * nh + h - h0) * span + first - lo, len - first, sinks ? sinks[h] : -INFINITY);
            for (int64_t x = 0; x < head_dim; x++) out[i * qstride + h * head_dim + x] = 0.0f;
        }
    }
    for (int64_t b = lo / block_size; b * block_size < end; b++) {
        const KV_T *block = v_cache + table[b] * block_size * row;
        const KV_T *next = b < last ? v_cache + table[b + 1] * block_size * row : NULL;
        const int64_t t0 = b * block_size < lo ? lo - b * block_size : 0;
        const int64_t t1 = end - b * block_size < block_size ? end - b * block_size : block_size;
        for (int64_t t = t0; t < t1; t++) {
            const int64_t pos = b * block_size + t;
            if (next) prefetch_row(next + t * row, row * (int64_t)sizeof(KV_T));
#ifdef KV_DEQUANT
            const int64_t ea = b * block_size - len0 + 1;
            for (int64_t kh = h0 / group; kh * group < h1; kh++) {
                float value[head_dim], exact[head_dim];
                KV_DEQUANT(value, block + t * row + KV_HEAD(kh, head_dim), head_dim);
                const _Float16 *own = recent && ea < nrows && ea + block_size > 0
                    ? recent_row(recent, 1, pos, kh, kv_heads, head_dim, block_size) : NULL;
                for (int64_t x = 0; own && x < head_dim; x++) exact[x] = (float)own[x];
                const int64_t ha = kh * group > h0 ? kh * group : h0;
                const int64_t hb = (kh + 1) * group < h1 ? (kh + 1) * group : h1;
                for (int64_t i = pos < len0 ? 0 : pos - len0 + 1; i < nrows; i++) {
                    if (window > 0 && pos < len0 + i - window) break;
                    const float *v = own && i >= ea && i < ea + block_size ? exact : value;
                    for (int64_t h = ha; h < hb; h++)
                        axpy_wide(out + i * qstride + h * head_dim,
                                  scores[(i * nh + h - h0) * span + pos - lo], v, head_dim);
                }
            }
#else
            for (int64_t i = pos < len0 ? 0 : pos - len0 + 1; i < nrows; i++) {
                if (window > 0 && pos < len0 + i - window) break;
                for (int64_t h = h0; h < h1; h++) {
                    const KV_T *value = block + t * row + KV_HEAD(h / group, head_dim);
                    KV_NAME(axpy)(out + i * qstride + h * head_dim,
                                  scores[(i * nh + h - h0) * span + pos - lo], value, head_dim);
                }
            }
#endif
        }
    }
}

#define ATTEND(D)                                                                                  \
    static void KV_NAME(attend_##D)(const float *q, const KV_T *k, const KV_T *v,                 \
                                    const int64_t *table, int64_t len0, int64_t nrows,            \
                                    int64_t window, float *out, int64_t num_heads, int64_t h0,    \
                                    int64_t h1, int64_t group, int64_t kv_heads, int64_t head_dim, \
                                    int64_t block_size, float scale, const float *key_mean,       \
                                    const Recent *recent, const float *sinks, float *scores) {    \
        (void)head_dim;                                                                           \
        KV_NAME(attend_tile)(q, k, v, table, len0, nrows, window, out, num_heads, h0, h1, group,  \
                             kv_heads, D, block_size, scale, key_mean, recent, sinks, scores);    \
    }
ATTEND(64)
ATTEND(128)
ATTEND(256)
ATTEND(head_dim)
#undef ATTEND

static int KV_NAME(paged_attention)(
        const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *block_tables,
        int64_t table_stride, const int64_t *row_seq, const int64_t *row_len, float *out,
        int64_t rows, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
        int64_t window, float scale, int num_threads, const float *key_mean, const RecentRows *recent,
        const float *sinks, const int64_t *row_ahead) {
    void (*attend)(const float *, const KV_T *, const KV_T *, const int64_t *, int64_t, int64_t,
                   int64_t, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                   float, const float *, const Recent *, const float *, float *) =
        head_dim == 64 ? KV_NAME(attend_64) : head_dim == 128 ? KV_NAME(attend_128)
        : head_dim == 256 ? KV_NAME(attend_256) : KV_NAME(attend_head_dim);
    const int64_t group = num_heads / kv_heads;
    // Tiles: runs of up to TILE_Q rows of one request at consecutive positions.
    int64_t *tiles = malloc(sizeof(int64_t) * (rows + 1));
    if (!tiles) return -1;
    int64_t ntiles = 0;
    for (int64_t r = 0; r < rows; r++)
        if (r == 0 || r - tiles[ntiles - 1] >= TILE_Q || row_seq[r] != row_seq[r - 1] ||
            row_len[r] != row_len[r - 1] + 1 || (row_ahead && (row_ahead[r] | row_ahead[r - 1])))
            tiles[ntiles++] = r;  // (a row that sees keys ahead of it is a tile of its own)
    tiles[ntiles] = rows;
    // A task is a tile with all its heads (K/V rows read once); with fewer tiles than threads,
    // a (tile, kv head) pair, so that a single long decode still uses every thread.
    const int64_t splits = ntiles >= 2 * num_threads ? 1 : kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int64_t cap = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntiles * splits; task++) {
            const int64_t tile = task / splits, part = task % splits;
            const int64_t r0 = tiles[tile], nrows = tiles[tile + 1] - r0;
            const int64_t h0 = part * num_heads / splits, h1 = (part + 1) * num_heads / splits;
            // A row that sees `ahead` keys past its own (an image token of Gemma 3 sees its whole
            // image) attends as a row that long, its window as wide again: it starts where its
            // own position's window starts.
            const int64_t ahead = row_ahead ? row_ahead[r0] : 0, w = window > 0 ? window + ahead : 0;
            const int64_t len0 = row_len[r0] + ahead, end = len0 + nrows - 1;
            const int64_t lo = w > 0 && len0 > w ? len0 - w : 0;
            const int64_t need = nrows * (h1 - h0) * (end - lo);
            if (need > cap) {
                free(scores);
                scores = malloc(sizeof(float) * need);
                cap = scores ? need : 0;
            }
            if (!scores) {
                failed = 1;
                continue;
            }
            const int64_t off = r0 * num_heads * head_dim;
            Recent own;
            attend(q + off, k_cache, v_cache, block_tables + row_seq[r0] * table_stride, len0, nrows,
                   w, out + off, num_heads, h0, h1, group, kv_heads, head_dim, block_size, scale,
                   key_mean, recent_of(recent, &own, row_seq[r0], row_len, kv_heads * head_dim, block_size),
                   sinks, scores);
        }
        free(scores);
    }
    free(tiles);
    return failed ? -1 : 0;
}

#undef KV_T
#undef KV_FLOAT
#undef KV_LOAD8
#undef KV_NAME
#undef KV_HEAD
#undef KV_ROW
#undef KV_OWN_DOT
#undef KV_DEQUANT
#undef KV_DEQUANT_KEY
#undef KV_DECODE
