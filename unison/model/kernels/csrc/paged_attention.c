// Attention over a paged KV cache, for CPUs: prefill chunks and decodes alike.
//
// Each query row attends over its own request's cached keys and values, read in place through
// the block table: no gather into a padded copy, no mask. Rows of one request go in tiles of up
// to TILE_Q consecutive positions, so each K/V row is read once for the whole tile (and all of a
// KV head's query heads). A row's result is computed by the same operations in the same order
// whatever tile, batch or chunk it is in: a prompt prefilled whole, in chunks, or after a
// prefix-cache hit gives bit-identical attention, as does a decode alone or beside 63 others.
// (Torch's path, index_select into a buffer and then SDPA over the padded batch, moves every
// byte three times and sums in an order that depends on the shapes.)
//
// Layouts (contiguous; q and out float32, the cache float32, float16, bfloat16, int8 in q8
// blocks (see Q8_BLOCK) or fp8):
//   q, out       [rows, num_heads, head_dim]
//   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
//   block_tables [seqs, table_stride]  int64, block ids of each request in order
//   row_seq      [rows]                int64, the request (row of block_tables) of each query row
//   row_len      [rows]                int64, tokens the row attends to (its position + 1)
//   row_ahead    [rows] or NULL        int64, keys past its own position the row also sees
// window > 0 keeps only the last `window` tokens (sliding-window attention) before the row's own
// position: `row_ahead` widens what a row sees forward, never backward.
//
// Built at first use by unison/model/kernels/cpu_kernels.py with -O3 -march=native -fopenmp.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q8.h"
#include "simd_math.h"

#ifdef UNISON_AVX2
#define ATTN_AVX2 1

// s[0, n) = exp(s - max) / sum: the softmax of one head's scores, in place. `sink` (gpt-oss's
// learned per-head logit; -INFINITY: none) is one more score in the denominator, with no value:
// added to the sum last, so that without one the bits are the plain softmax's.
static inline void softmax(float *s, int64_t n, float sink) {
    float mx = sink, sum = 0.0f;
    int64_t i = 0;
    for (i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    __m256 acc = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx);
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
    for (; i < n; i++) sum += (s[i] = expf(s[i] - mx));
    sum += expf(sink - mx);
    const float inv = 1.0f / sum;
    for (i = 0; i < n; i++) s[i] *= inv;
}

#endif

// Blocks sit anywhere in the pool, and hardware prefetchers stop at page boundaries: while a
// block's rows are used, each row's counterpart in the next block is fetched ahead.
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)row + i);
}

#ifndef ATTN_AVX2
static inline void softmax(float *s, int64_t n, float sink) {
    float mx = sink, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    for (int64_t i = 0; i < n; i++) sum += (s[i] = expf(s[i] - mx));
    sum += expf(sink - mx);
    for (int64_t i = 0; i < n; i++) s[i] /= sum;
}
#endif

static inline float f32_of_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define TILE_Q 16  // query rows of one request that share each K/V row read

void hadamard_rotate(float *x, int64_t count, int64_t d);  // fused_ops.c: int8 rows are stored rotated

#ifdef ATTN_AVX2
static inline __m256 q8_load8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

// a . b over n = head_dim values, b in q8 blocks: each block's sum scaled once.
static inline float dot_i8(const float *restrict a, const int8_t *restrict b, int64_t n) {
    float s = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < n; g += 32, b += Q8_BLOCK) {
        __m512 part = _mm512_mul_ps(_mm512_loadu_ps(a + g),
                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b))));
        part = _mm512_fmadd_ps(_mm512_loadu_ps(a + g + 16),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16)))),
                               part);
        acc = _mm512_fmadd_ps(part, _mm512_set1_ps(q8_scale(b)), acc);
    }
    s = _mm512_reduce_add_ps(acc);
#elif defined(ATTN_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < n; g += 32, b += Q8_BLOCK) {
        __m256 part = _mm256_mul_ps(_mm256_loadu_ps(a + g), q8_load8(b));
        part = _mm256_fmadd_ps(_mm256_loadu_ps(a + g + 8), q8_load8(b + 8), part);
        part = _mm256_fmadd_ps(_mm256_loadu_ps(a + g + 16), q8_load8(b + 16), part);
        part = _mm256_fmadd_ps(_mm256_loadu_ps(a + g + 24), q8_load8(b + 24), part);
        acc = _mm256_fmadd_ps(part, _mm256_set1_ps(q8_scale(b)), acc);
    }
    s = hsum8(acc);
#else
    for (int64_t g = 0; g < n; g += 32, b += Q8_BLOCK) {
        float part = 0.0f;
        for (int64_t j = 0; j < 32; j++) part += a[g + j] * (float)b[j];
        s += part * q8_scale(b);
    }
#endif
    return s;
}

// A head's n values from q8 blocks, as float (KV_DEQUANT); keys' marked blocks get `mean` (the
// head's, rotated) added back, values' never are (mean NULL).
static inline void dequant_i8(float *restrict dst, const int8_t *restrict x, int64_t n,
                              const float *restrict mean) {
    for (int64_t g = 0; g < n; g += 32, x += Q8_BLOCK) {
        const int add = mean != NULL && q8_shifted(x);
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 s = _mm512_set1_ps(q8_scale(x));
        for (int64_t j = 0; j < 32; j += 16) {
            __m512 y = _mm512_mul_ps(
                s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + j)))));
            if (add) y = _mm512_add_ps(y, _mm512_loadu_ps(mean + g + j));  // as q8_row16 adds it
            _mm512_storeu_ps(dst + g + j, y);
        }
#elif defined(ATTN_AVX2)
        const __m256 s = _mm256_set1_ps(q8_scale(x));
        for (int64_t j = 0; j < 32; j += 8) {
            __m256 y = _mm256_mul_ps(s, q8_load8(x + j));
            if (add) y = _mm256_add_ps(y, _mm256_loadu_ps(mean + g + j));
            _mm256_storeu_ps(dst + g + j, y);
        }
#else
        for (int64_t j = 0; j < 32; j++) dst[g + j] = q8_scale(x) * (float)x[j];
        if (add)
            for (int64_t j = 0; j < 32; j++) dst[g + j] += mean[g + j];
#endif
    }
}

// y += a * x over n values, x in q8 blocks.
static inline void axpy_i8(float *restrict y, float a, const int8_t *restrict x, int64_t n) {
    for (int64_t g = 0; g < n; g += 32, x += Q8_BLOCK) {
        const float f = a * q8_scale(x);
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 vf = _mm512_set1_ps(f);
        for (int64_t j = 0; j < 32; j += 16)
            _mm512_storeu_ps(y + g + j, _mm512_fmadd_ps(
                vf, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + j)))),
                _mm512_loadu_ps(y + g + j)));
#elif defined(ATTN_AVX2)
        const __m256 vf = _mm256_set1_ps(f);
        for (int64_t j = 0; j < 32; j += 8)
            _mm256_storeu_ps(y + g + j, _mm256_fmadd_ps(vf, q8_load8(x + j), _mm256_loadu_ps(y + g + j)));
#else
        for (int64_t j = 0; j < 32; j++) y[g + j] += f * (float)x[j];
#endif
    }
}

// One copy of the kernel per cache element type: KV_T, its conversion to float, the suffix, and
// its row layout (the float types: kv_heads * head_dim elements).
#define KV_HEAD(h, d) ((h) * (d))
#define KV_ROW(heads, d) ((heads) * (d))
#define KV_T float
#define KV_FLOAT(x) (x)
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_NAME(name) name##_f32
#include "paged_attention_body.h"
#define KV_T _Float16
#define KV_FLOAT(x) ((float)(x))
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_NAME(name) name##_f16
#define KV_HEAD(h, d) ((h) * (d))
#define KV_ROW(heads, d) ((heads) * (d))
#include "paged_attention_body.h"
#define KV_T uint16_t
#define KV_FLOAT(x) f32_of_bf16(x)
#define KV_LOAD8(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define KV_NAME(name) name##_bf16
#define KV_HEAD(h, d) ((h) * (d))
#define KV_ROW(heads, d) ((heads) * (d))
#include "paged_attention_body.h"
// fp8 (kv_cache_dtype="fp8_e4m3" / "fp8_e5m2"), one byte a value, no scale (vLLM's default of
// 1.0). Both widen exactly to float16: e5m2 is float16's top byte; e4m3's bits, moved to
// float16's places, read 2^8 too small (its exponent bias is 7, not 15), subnormals included.
static inline float f32_of_e5m2(uint8_t x) {
    const uint16_t h = (uint16_t)(x << 8);
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}

static inline float f32_of_e4m3(uint8_t x) {
    const uint16_t h = (uint16_t)(((x & 0x7f) << 7) | ((x & 0x80) << 8));
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f * 256.0f;
}

#ifdef ATTN_AVX2
static inline __m256 e5m2_load8(const uint8_t *p) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
}

static inline __m256 e4m3_load8(const uint8_t *p) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7),
                                   _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
#endif

// The 8-bit types' arithmetic, on rows already converted to float (KV_DEQUANT): a . b and
// y += a * x, 16 values a step where the CPU has AVX-512.
static inline float dot_wide(const float *restrict a, const float *restrict b, int64_t n) {
#if defined(__AVX512F__)
    int64_t i = 0;
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
#else
    return dot_f32(a, b, n);
#endif
}

static inline void axpy_wide(float *restrict y, float a, const float *restrict x, int64_t n) {
#if defined(__AVX512F__)
    int64_t i = 0;
    const __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
#else
    axpy_f32(y, a, x, n);
#endif
}

// A head's n fp8 values as float (KV_DEQUANT).
static inline void dequant_e4m3(float *restrict dst, const uint8_t *restrict src, int64_t n) {
    int64_t i = 0;
#ifdef ATTN_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, e4m3_load8(src + i));
#endif
    for (; i < n; i++) dst[i] = f32_of_e4m3(src[i]);
}

static inline void dequant_e5m2(float *restrict dst, const uint8_t *restrict src, int64_t n) {
    int64_t i = 0;
#ifdef ATTN_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, e5m2_load8(src + i));
#endif
    for (; i < n; i++) dst[i] = f32_of_e5m2(src[i]);
}

#define KV_T uint8_t
#define KV_FLOAT(x) f32_of_e4m3(x)
#define KV_LOAD8(p) e4m3_load8(p)
#define KV_DEQUANT(dst, src, n) dequant_e4m3(dst, src, n)
#define KV_NAME(name) name##_e4m3
#define KV_HEAD(h, d) ((h) * (d))
#define KV_ROW(heads, d) ((heads) * (d))
#include "paged_attention_body.h"
#define KV_T uint8_t
#define KV_FLOAT(x) f32_of_e5m2(x)
#define KV_LOAD8(p) e5m2_load8(p)
#define KV_DEQUANT(dst, src, n) dequant_e5m2(dst, src, n)
#define KV_NAME(name) name##_e5m2
#define KV_HEAD(h, d) ((h) * (d))
#define KV_ROW(heads, d) ((heads) * (d))
#include "paged_attention_body.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
// Decode over an int8 cache: one query row, heads [h0, h1), head_dim 16 * nc (64, 128 or 256). Each
// key and value row is converted once for all the query heads that read it, and the dot products
// are reduced four at a time. Every result has the bits of attend_tile's general path (the same
// products and sums, in the same order), which prefill's rows take: a token's output does not
// depend on how it was batched.
static inline __m512 q8_load16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

// Lane 4 h: the sum of a[h]'s lanes, added as _mm512_reduce_add_ps adds them (256-bit halves,
// then 128-bit halves, then lanes 0+2 and 1+3, then those two).
static inline __m512 reduce_add4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0xEE), _mm512_shuffle_f32x4(a0, a1, 0x44));
    const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0xEE), _mm512_shuffle_f32x4(a2, a3, 0x44));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0xDD), _mm512_shuffle_f32x4(t0, t1, 0x88));
    const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    return _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
}

// A head's row (nc chunks of 16) as float, in registers; a key's marked blocks get `mean` added
// back (dequant_i8's arithmetic: the general path's bits).
static inline __attribute__((always_inline)) void q8_row16(__m512 *x, const int8_t *row, const int64_t nc,
                                                           const float *mean) {
    for (int64_t c = 0; c < nc; c++) {
        const int8_t *block = row + c / 2 * Q8_BLOCK;
        x[c] = _mm512_mul_ps(_mm512_set1_ps(q8_scale(block)), q8_load16(block + c % 2 * 16));
        if (mean != NULL && q8_shifted(block)) x[c] = _mm512_add_ps(x[c], _mm512_loadu_ps(mean + 16 * c));
    }
}

// A head's float16 row (a recent one, q8.h) as float, in registers.
static inline __attribute__((always_inline)) void f16_row16(__m512 *x, const _Float16 *row, const int64_t nc) {
    for (int64_t c = 0; c < nc; c++) x[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 16 * c)));
}

// Key head kh's row of position pos in registers. The head's row ROWS_AHEAD positions on is
// fetched ahead, a row at a time: at 8,000 keys the rows come from memory, in blocks anywhere in
// the pool, and a whole block fetched at its first row left the reads waiting on latency.
#define ROWS_AHEAD 16
static inline __attribute__((always_inline)) void q8_row_at(
        __m512 *x, const int8_t *cache, const int64_t *table, int64_t pos, int64_t len, int64_t kh,
        int64_t row, const int64_t nc, int64_t block_size, const float *mean) {
    const int64_t head = Q8_HEAD(16 * nc), ahead = pos + ROWS_AHEAD;
    if (ahead < len) {
        const int8_t *next =
            cache + (table[ahead / block_size] * block_size + ahead % block_size) * row + kh * head;
        prefetch_row(next, head);
        __builtin_prefetch(next + head - 1);
    }
    q8_row16(x, cache + (table[pos / block_size] * block_size + pos % block_size) * row + kh * head, nc, mean);
}

// A row of the query's own block from `recent` where it holds it, else from the q8 cache.
static inline __attribute__((always_inline)) void decode_row(
        __m512 *x, const int8_t *cache, const int64_t *table, int64_t pos, int64_t len, int64_t kh,
        int64_t row, const int64_t nc, int64_t block_size, const Recent *recent, int value, int64_t kv_heads,
        const float *mean) {
    const _Float16 *own = recent && pos / block_size == (len - 1) / block_size
        ? recent_row(recent, value, pos, kh, kv_heads, 16 * nc, block_size) : NULL;
    if (own)
        f16_row16(x, own, nc);
    else
        q8_row_at(x, cache, table, pos, len, kh, row, nc, block_size, mean);
}

// scores[(h - h0) * span + pos - lo] = q_h . key_pos * scale, four heads of a key head at a time.
static inline __attribute__((always_inline)) void decode_scores_i8(
        const float *q, const int8_t *k_cache, const int64_t *table, int64_t len, int64_t lo,
        int64_t h0, int64_t h1, int64_t group, int64_t row, const int64_t nc, int64_t block_size,
        float scale, const float *key_mean, const Recent *recent, int64_t kv_heads, float *scores) {
    const int64_t d = 16 * nc, span = len - lo;
    for (int64_t kh = h0 / group; kh * group < h1; kh++) {
        const int64_t ha = kh * group > h0 ? kh * group : h0;
        const int64_t hb = (kh + 1) * group < h1 ? (kh + 1) * group : h1;
        const float *mean = key_mean != NULL ? key_mean + kh * d : NULL;
        for (int64_t pos = lo; pos < len; pos++) {
            __m512 key[16];
            decode_row(key, k_cache, table, pos, len, kh, row, nc, block_size, recent, 0, kv_heads, mean);
            for (int64_t h = ha; h < hb; h += 4) {
                __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                                 _mm512_setzero_ps()};
                const int64_t n = hb - h < 4 ? hb - h : 4;
                for (int64_t j = 0; j < n; j++)
                    for (int64_t c = 0; c < nc; c++)
                        acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (h + j) * d + 16 * c), key[c], acc[j]);
                float sums[16];
                _mm512_storeu_ps(sums, reduce_add4(acc[0], acc[1], acc[2], acc[3]));
                for (int64_t j = 0; j < n; j++) scores[(h + j - h0) * span + pos - lo] = sums[4 * j] * scale;
            }
        }
    }
}

// out_h = sum over pos of scores_h[pos] * value_pos. DECODE_ROWS value rows at a time are
// converted once into `rows` (L1) for all the heads that read them, and each head's sums go
// through them in position order: axpy_wide's products and sums, so the general path's bits.
#define DECODE_ROWS 8
static inline __attribute__((always_inline)) void decode_values_i8(
        const int8_t *v_cache, const int64_t *table, int64_t len, int64_t lo, float *out, int64_t h0,
        int64_t h1, int64_t group, int64_t row, const int64_t nc, int64_t block_size, const Recent *recent,
        int64_t kv_heads, const float *scores) {
    const int64_t d = 16 * nc, span = len - lo;
    __m512 rows[DECODE_ROWS][16];
    for (int64_t h = h0; h < h1; h++) memset(out + h * d, 0, sizeof(float) * d);
    for (int64_t kh = h0 / group; kh * group < h1; kh++) {
        const int64_t ha = kh * group > h0 ? kh * group : h0;
        const int64_t hb = (kh + 1) * group < h1 ? (kh + 1) * group : h1;
        for (int64_t p0 = lo; p0 < len; p0 += DECODE_ROWS) {
            const int64_t n = len - p0 < DECODE_ROWS ? len - p0 : DECODE_ROWS;
            for (int64_t i = 0; i < n; i++)
                decode_row(rows[i], v_cache, table, p0 + i, len, kh, row, nc, block_size, recent, 1, kv_heads,
                           NULL);
            for (int64_t h = ha; h < hb; h++) {
                const float *s = scores + (h - h0) * span + p0 - lo;
                __m512 weight[DECODE_ROWS];
                for (int64_t i = 0; i < n; i++) weight[i] = _mm512_set1_ps(s[i]);
                for (int64_t c = 0; c < nc; c++) {
                    __m512 acc = _mm512_loadu_ps(out + h * d + 16 * c);
                    if (n == DECODE_ROWS)  // (a constant count: unrolled)
                        for (int64_t i = 0; i < DECODE_ROWS; i++) acc = _mm512_fmadd_ps(weight[i], rows[i][c], acc);
                    else
                        for (int64_t i = 0; i < n; i++) acc = _mm512_fmadd_ps(weight[i], rows[i][c], acc);
                    _mm512_storeu_ps(out + h * d + 16 * c, acc);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void decode_i8(
        const float *q, const int8_t *k_cache, const int8_t *v_cache, const int64_t *table, int64_t len,
        int64_t lo, float *out, int64_t h0, int64_t h1, int64_t group, int64_t kv_heads, const int64_t nc,
        int64_t block_size, float scale, const float *key_mean, const Recent *recent, const float *sinks,
        float *scores) {
    const int64_t row = kv_heads * Q8_HEAD(16 * nc), span = len - lo;
    decode_scores_i8(q, k_cache, table, len, lo, h0, h1, group, row, nc, block_size, scale, key_mean, recent,
                     kv_heads, scores);
    for (int64_t h = 0; h < h1 - h0; h++) softmax(scores + h * span, span, sinks ? sinks[h0 + h] : -INFINITY);
    decode_values_i8(v_cache, table, len, lo, out, h0, h1, group, row, nc, block_size, recent, kv_heads, scores);
}

// attend_tile's one-row case where the decode path above serves it: 1 when it did.
static int decode_i8_tile(const float *q, const int8_t *k, const int8_t *v, const int64_t *table,
                          int64_t len, int64_t lo, float *out, int64_t h0, int64_t h1, int64_t group,
                          int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          const float *key_mean, const Recent *recent, const float *sinks, float *scores) {
    if (head_dim == 64)
        decode_i8(q, k, v, table, len, lo, out, h0, h1, group, kv_heads, 4, block_size, scale, key_mean, recent,
                  sinks, scores);
    else if (head_dim == 128)
        decode_i8(q, k, v, table, len, lo, out, h0, h1, group, kv_heads, 8, block_size, scale, key_mean, recent,
                  sinks, scores);
    else if (head_dim == 256)
        decode_i8(q, k, v, table, len, lo, out, h0, h1, group, kv_heads, 16, block_size, scale, key_mean, recent,
                  sinks, scores);
    else
        return 0;
    return 1;
}
#define KV_DECODE(...) decode_i8_tile(__VA_ARGS__)
#endif

#define KV_T int8_t
#define KV_DEQUANT(dst, src, n) dequant_i8(dst, src, n, NULL)
#define KV_DEQUANT_KEY(dst, src, n, mean) dequant_i8(dst, src, n, mean)
#define KV_NAME(name) name##_i8
#define KV_HEAD(h, d) ((h) * Q8_HEAD(d))
#define KV_ROW(heads, d) ((heads) * Q8_HEAD(d))
#define KV_OWN_DOT
#include "paged_attention_body.h"

// dtype: 0 float32, 1 float16, 2 bfloat16, 3 int8 in q8 blocks, 4 fp8 e4m3, 5 fp8 e5m2 (the
// cache's element type). key_mean: int8's [kv_heads, head_dim] (rotated), which the keys' marked
// blocks were stored less (q8.h); NULL: none were. recent: int8's recent rows (q8.h), or NULL.
// sinks: a learned logit per query head in each softmax's denominator (gpt-oss), or NULL.
// row_ahead: where a row sees keys past its own position (an image's tokens see their whole
// image, Gemma 3), or NULL: causal. With int8's recent rows, such a row reads exact the block of
// the last key it sees (its position plus its keys ahead): a rule of positions, as for any row;
// an image is never split over forwards, so its keys ahead are all this forward's rows.
// Returns -1 when out of memory for the scores.
int paged_attention(const float *q, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, int64_t table_stride, const int64_t *row_seq,
                    const int64_t *row_len, float *out, int64_t rows, int64_t num_heads,
                    int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                    float scale, int num_threads, int dtype, const float *key_mean, const RecentRows *recent,
                    const float *sinks, const int64_t *row_ahead) {
    switch (dtype) {
    case 1:
        return paged_attention_f16(q, k_cache, v_cache, block_tables, table_stride, row_seq, row_len,
                                   out, rows, num_heads, kv_heads, head_dim, block_size, window, scale,
                                   num_threads, NULL, NULL, sinks, row_ahead);
    case 4:
        return paged_attention_e4m3(q, k_cache, v_cache, block_tables, table_stride, row_seq, row_len,
                                    out, rows, num_heads, kv_heads, head_dim, block_size, window, scale,
                                    num_threads, NULL, NULL, sinks, row_ahead);
    case 5:
        return paged_attention_e5m2(q, k_cache, v_cache, block_tables, table_stride, row_seq, row_len,
                                    out, rows, num_heads, kv_heads, head_dim, block_size, window, scale,
                                    num_threads, NULL, NULL, sinks, row_ahead);
    case 3: {  // keys and values are stored rotated (fused_ops.c's hadamard_rotate): so are the queries
        float *rotated = malloc(sizeof(float) * rows * num_heads * head_dim);
        if (rotated == NULL) return -1;
        memcpy(rotated, q, sizeof(float) * rows * num_heads * head_dim);
        hadamard_rotate(rotated, rows * num_heads, head_dim);
        const int rc = paged_attention_i8(rotated, k_cache, v_cache, block_tables, table_stride, row_seq,
                                          row_len, out, rows, num_heads, kv_heads, head_dim, block_size,
                                          window, scale, num_threads, key_mean, recent, sinks, row_ahead);
        free(rotated);
        hadamard_rotate(out, rows * num_heads, head_dim);  // the values' rotation, undone
        return rc;
    }
    case 2:
        return paged_attention_bf16(q, k_cache, v_cache, block_tables, table_stride, row_seq, row_len,
                                    out, rows, num_heads, kv_heads, head_dim, block_size, window, scale,
                                    num_threads, NULL, NULL, sinks, row_ahead);
    default:
        return paged_attention_f32(q, k_cache, v_cache, block_tables, table_stride, row_seq, row_len,
                                   out, rows, num_heads, kv_heads, head_dim, block_size, window, scale,
                                   num_threads, NULL, NULL, sinks, row_ahead);
    }
}
