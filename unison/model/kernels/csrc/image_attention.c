// Attention over one image's patches in a vision tower (Qwen3.5 / Qwen3-VL, Gemma 3's SigLIP):
// every patch sees every patch, n of them (3,136 for an 896 x 896 picture), in bfloat16 dot
// products with float32 sums, the way the towers' GPU kernels compute it.
//
// A tower whose linears run in bfloat16 already has q, k and v as bfloat16 values, so their dot
// products lose nothing; the softmax is float32; its weights are rounded to bfloat16 for the
// product with v (as flash attention's are on a GPU). AVX-512 BF16's dot product of pairs
// (vdpbf16ps) does twice the multiply-adds of a float32 FMA per instruction: torch's float32
// attention ran at about 160 GFLOP/s on two Zen 4 cores, and its bfloat16 one no faster.
//
// Per head: K and V are packed once into pair layouts (k: 16 keys x 2 dims a register; v: 16
// dims x 2 keys), then each block of ROWS queries takes every score into a scratch row (n floats
// each: 12 KB at 3,136 patches, in L2), its softmax, and the product with V. Heads x query blocks
// are the threads' tasks. Without AVX-512 BF16 the entry point returns -1 and the caller uses
// torch's attention.
//
// Built with the other kernels by unison/model/kernels/cpu_kernels.py (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"

#if defined(UNISON_AVX2) && defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#include <omp.h>

#define ROWS 8      // queries a score block (8 x 2 accumulators)
#define OUT_ROWS 4  // queries a block of the product with V (4 x up to 5 accumulators)
#define MAX_CHUNKS 5  // 16-wide column chunks of V per pass (d <= 80 in one)

static inline uint16_t to_bf16(float x) {  // round to nearest even, as vcvtneps2bf16
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// exp(x) for x <= 0, 16 at a time: simd_math.h's exp8 on each half (Zen 4 runs a 512-bit
// operation as two 256-bit ones anyway).
static inline __m512 exp16(__m512 x) {
    const __m512 low = _mm512_castps256_ps512(exp8(_mm512_castps512_ps256(x)));
    return _mm512_insertf32x8(low, exp8(_mm512_extractf32x8_ps(x, 1)), 1);
}

typedef struct {
    int64_t n, heads, d, stride;  // stride: floats between one patch's rows of q (and of k, v, out)
    int64_t pairs;                // d / 2 rounded up: the pairs of a query or key
    int64_t key_blocks;           // n / 32 rounded up: key blocks of the score pass
    int64_t key_pairs;            // n / 2 rounded up: key pairs of the product with V
    int64_t chunks;               // d / 16 rounded up: V's column chunks
} Shape;

// keys [key_blocks * 32, pairs, 2] as [block of 16][pair][16 keys][2]: one register per (16 keys, pair)
static void pack_keys(const float *k, uint16_t *out, const Shape *s) {
    const int64_t padded = s->key_blocks * 32;
    for (int64_t j = 0; j < padded; j++)
        for (int64_t p = 0; p < s->pairs; p++)
            for (int e = 0; e < 2; e++) {
                const int64_t dim = 2 * p + e;
                const float x = j < s->n && dim < s->d ? k[j * s->stride + dim] : 0.0f;
                out[((j / 16 * s->pairs + p) * 16 + j % 16) * 2 + e] = to_bf16(x);
            }
}

// values as [key pair][chunks * 16 dims][2 keys]: one register per (key pair, 16 dims)
static void pack_values(const float *v, uint16_t *out, const Shape *s) {
    const int64_t width = s->chunks * 16;
    for (int64_t j = 0; j < s->key_pairs; j++)
        for (int64_t c = 0; c < width; c++)
            for (int e = 0; e < 2; e++) {
                const int64_t key = 2 * j + e;
                const float x = key < s->n && c < s->d ? v[key * s->stride + c] : 0.0f;
                out[(j * width + c) * 2 + e] = to_bf16(x);
            }
}

// scores[r][0, key_blocks * 32) = (q[row0 + r] . k) * scale, rows past n repeat the last
static void scores(const float *q, const uint16_t *keys, float *scores, int64_t row0, float scale,
                   const Shape *s) {
    uint32_t qp[ROWS][64];  // a query's bfloat16 pairs (d <= 128)
    for (int r = 0; r < ROWS; r++) {
        const int64_t row = row0 + r < s->n ? row0 + r : s->n - 1;
        for (int64_t p = 0; p < s->pairs; p++) {
            const float lo = q[row * s->stride + 2 * p];
            const float hi = 2 * p + 1 < s->d ? q[row * s->stride + 2 * p + 1] : 0.0f;
            qp[r][p] = (uint32_t)to_bf16(lo) | (uint32_t)to_bf16(hi) << 16;
        }
    }
    const int64_t width = s->key_blocks * 32;
    for (int64_t b = 0; b < s->key_blocks; b++) {
        __m512 acc[ROWS][2];
        for (int r = 0; r < ROWS; r++)
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const uint16_t *k0 = keys + (2 * b) * s->pairs * 32, *k1 = k0 + s->pairs * 32;
        for (int64_t p = 0; p < s->pairs; p++) {
            const __m512bh a0 = (__m512bh)_mm512_loadu_si512(k0 + p * 32);
            const __m512bh a1 = (__m512bh)_mm512_loadu_si512(k1 + p * 32);
            for (int r = 0; r < ROWS; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)qp[r][p]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a0, x);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a1, x);
            }
        }
        const __m512 sc = _mm512_set1_ps(scale);
        for (int r = 0; r < ROWS; r++) {
            _mm512_storeu_ps(scores + r * width + 32 * b, _mm512_mul_ps(acc[r][0], sc));
            _mm512_storeu_ps(scores + r * width + 32 * b + 16, _mm512_mul_ps(acc[r][1], sc));
        }
    }
}

// A score row to bfloat16 weights exp(x - max) over its n keys (zero past them, to the next
// pair); returns 1 / their sum.
static float softmax_row(const float *row, uint16_t *weights, const Shape *s) {
    const int64_t n = s->n, full = n / 16 * 16;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += 16)
        m = _mm512_max_ps(m, _mm512_loadu_ps(row + j));
    float max = _mm512_reduce_max_ps(m);
    for (int64_t j = full; j < n; j++)
        max = row[j] > max ? row[j] : max;
    const __m512 mx = _mm512_set1_ps(max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < full; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), mx));
        // sum what the product with V uses: the weights as rounded
        const __m256bh b = _mm512_cvtneps_pbh(e);
        _mm256_storeu_si256((__m256i *)(weights + j), (__m256i)b);
        // widened by a shift (_mm512_cvtpbh_ps needs GCC 12)
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16)));
    }
    float total = _mm512_reduce_add_ps(sum);
    for (int64_t j = full; j < 2 * s->key_pairs; j++) {
        const uint16_t w = j < n ? to_bf16(expf(row[j] - max)) : 0;
        weights[j] = w;
        uint32_t u = (uint32_t)w << 16;
        float f;
        memcpy(&f, &u, 4);
        total += f;
    }
    return 1.0f / total;
}

// out[rows] = weights[rows] . V, each row times its 1 / sum, for `rows` <= OUT_ROWS queries
static void weighted_values(const uint16_t *weights, int64_t weights_stride, const float *inv_sum,
                            const uint16_t *values, float *out, int64_t rows, const Shape *s) {
    const int64_t width = s->chunks * 16;
    for (int64_t c0 = 0; c0 < s->chunks; c0 += MAX_CHUNKS) {
        const int64_t nc = s->chunks - c0 < MAX_CHUNKS ? s->chunks - c0 : MAX_CHUNKS;
        __m512 acc[OUT_ROWS][MAX_CHUNKS];
        for (int r = 0; r < OUT_ROWS; r++)
            for (int c = 0; c < MAX_CHUNKS; c++)
                acc[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < s->key_pairs; j++) {
            const uint16_t *vj = values + (j * width + c0 * 16) * 2;
            __m512bh v[MAX_CHUNKS];
            for (int c = 0; c < MAX_CHUNKS; c++)
                if (c < nc)
                    v[c] = (__m512bh)_mm512_loadu_si512(vj + c * 32);
            for (int r = 0; r < OUT_ROWS; r++) {
                if (r >= rows)
                    break;
                uint32_t pair;
                memcpy(&pair, weights + r * weights_stride + 2 * j, 4);
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int c = 0; c < MAX_CHUNKS; c++)
                    if (c < nc)
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], x);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < nc; c++) {
                float tmp[16];
                _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv_sum[r])));
                for (int64_t i = 0; i < 16; i++) {
                    const int64_t dim = (c0 + c) * 16 + i;
                    if (dim < s->d)
                        out[r * s->stride + dim] = tmp[i];
                }
            }
    }
}

// q, k, v, out: [n, heads, d] float32 with `stride` floats between patches (heads * d when
// contiguous); out may not alias them. Returns 0, or -1 where d > 128.
int image_attention(const float *q, const float *k, const float *v, float *out, int64_t n,
                    int64_t heads, int64_t d, int64_t stride, float scale, int threads) {
    if (d > 128 || n <= 0 || threads < 1)
        return -1;
    Shape s = {n, heads, d, stride, (d + 1) / 2, (n + 31) / 32, (n + 1) / 2, (d + 15) / 16};
    const int64_t key_size = s.key_blocks * 32 * s.pairs * 2, value_size = s.key_pairs * s.chunks * 32;
    const int64_t blocks = (n + ROWS - 1) / ROWS, width = s.key_blocks * 32;
    // packed K and V, then each thread's score rows (float) and weights (bfloat16)
    const size_t packed = sizeof(uint16_t) * (size_t)((key_size + value_size) * heads);
    const size_t scratch = (sizeof(float) + sizeof(uint16_t)) * (size_t)(ROWS * width);
    char *memory = malloc(packed + scratch * (size_t)threads);
    if (memory == NULL)
        return -1;
    uint16_t *keys = (uint16_t *)memory, *values = keys + key_size * heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t h = 0; h < heads; h++) {
        pack_keys(k + h * d, keys + h * key_size, &s);
        pack_values(v + h * d, values + h * value_size, &s);
    }
#pragma omp parallel num_threads(threads)
    {
        float *score = (float *)(memory + packed + scratch * (size_t)omp_get_thread_num());
        uint16_t *weights = (uint16_t *)(score + ROWS * width);
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < heads * blocks; task++) {
            const int64_t h = task / blocks, row0 = task % blocks * ROWS;
            const int64_t rows = n - row0 < ROWS ? n - row0 : ROWS;
            scores(q + h * d, keys + h * key_size, score, row0, scale, &s);
            float inv_sum[ROWS];
            for (int64_t r = 0; r < rows; r++)
                inv_sum[r] = softmax_row(score + r * width, weights + r * width, &s);
            for (int64_t r = 0; r < rows; r += OUT_ROWS)
                weighted_values(weights + r * width, width, inv_sum + r, values + h * value_size,
                                out + (row0 + r) * stride + h * d, rows - r < OUT_ROWS ? rows - r : OUT_ROWS, &s);
        }
    }
    free(memory);
    return 0;
}

#else

int image_attention(const float *q, const float *k, const float *v, float *out, int64_t n,
                    int64_t heads, int64_t d, int64_t stride, float scale, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)n, (void)heads, (void)d, (void)stride, (void)scale;
    (void)threads;
    return -1;  // no AVX-512 BF16 here: the caller runs torch's attention
}

#endif
