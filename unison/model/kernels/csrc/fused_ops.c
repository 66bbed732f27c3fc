// The model's small per-layer operations fused, for CPUs: one pass over the rows instead of the
// 3-8 torch ops (each a dispatch, an allocation and a pass over memory) that make up each.
// At decode batch sizes those ops cost more in overhead than in arithmetic.
//
// Tensors are float32; rows of a matrix may be strided (`*_stride`, in floats), columns are not.
// Built with paged_attention.c into one shared object (see unison/model/kernels/cpu_kernels.py).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "q8.h"
#include "simd_math.h"

#define PARALLEL_ROWS 64  // fewer rows than this run on the calling thread

// h += delta (when delta is given); out = h * rsqrt(mean(h^2) + eps) * weight.
void add_rms_norm(float *h, const float *delta, const float *weight, float *out, int64_t rows,
                  int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * dim, *y = out + r * dim, ss = 0.0f;
        if (delta) {
            const float *d = delta + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) x[i] += d[i];
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) y[i] = weight[i] * (x[i] * inv);
    }
}

// RMS norm in place over groups of `dim` floats (the heads of q or k inside each fused QKV row:
// Qwen3's and Gemma 3's qk-norm): x * rsqrt(mean(x^2) + eps) * weight.
void norm_groups(float *x, int64_t row_stride, int64_t rows, int64_t groups, int64_t dim,
                 const float *weight, float eps) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float *v = x + r * row_stride + g * dim, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += v[i] * v[i];
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) v[i] = weight[i] * (v[i] * inv);
        }
}

// Rotary embedding, in place, on the first rot_dim of each of `heads` heads (head_stride apart)
// starting at each row of x: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos / sin
// [rows, rot_dim / 2]. rot_dim < head_stride: Qwen3-Next's and Qwen3.5's partial rotary.
void rope_partial(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows,
                  int64_t heads, int64_t head_stride, int64_t rot_dim, int num_threads) {
    const int64_t half = rot_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * row_stride + h * head_stride, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

// The whole of each head rotated.
void rope(float *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows,
          int64_t heads, int64_t head_dim, int num_threads) {
    rope_partial(x, row_stride, cos, sin, rows, heads, head_dim, head_dim, num_threads);
}

// out[r] = sigmoid(x[r] . w), summed in order: a shared expert's gate, the same bits at any row
// count.
void row_gates(const float *x, int64_t row_stride, const float *w, int64_t rows, int64_t dim, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * row_stride;
        float acc = 0.0f;
        for (int64_t i = 0; i < dim; i++) acc = fmaf(v[i], w[i], acc);
        out[r] = 1.0f / (1.0f + expf(-acc));
    }
}

// float -> bfloat16, rounding to nearest even as torch does (NaN stays a quiet NaN).
static inline uint16_t bf16_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// int8: llama.cpp's q8_0 blocks (q8.h): each 32 values over their largest magnitude, rounded to
// nearest even, then the float16 scale that brings them back.
static void store_q8(int8_t *dst, const float *x, int64_t n) {
    for (int64_t g = 0; g < n; g += 32, x += 32, dst += Q8_BLOCK) {
        float amax = 0.0f;
        for (int64_t i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const _Float16 scale = (_Float16)(amax / 127.0f);
        const float inv = (float)scale > 0.0f ? 1.0f / (float)scale : 0.0f;
        for (int64_t i = 0; i < 32; i++) {
            const float q = nearbyintf(x[i] * inv);
            dst[i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        }
        memcpy(dst + 32, &scale, sizeof scale);
    }
}

// float -> fp8 (vLLM's fp8_e4m3 and fp8_e5m2, torch's float8_e4m3fn and float8_e5m2), rounding
// to nearest even as torch does; past the largest finite value (448, 57344) they saturate, as
// vLLM's cache writes do, rather than become NaN (e4m3fn has no infinity).
static inline uint8_t e4m3_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(f);
    if (!(a < 448.0f)) return sign | 0x7e;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f);  // subnormal: units of 2^-9
    uint32_t au = u & 0x7fffffff;
    au += 0x7ffff + ((au >> 20) & 1);  // to 3 mantissa bits
    const int e = (int)(au >> 23) - 127 + 7, m = (int)((au >> 20) & 7);
    return (e > 15 || (e == 15 && m == 7)) ? (sign | 0x7e) : (uint8_t)(sign | (e << 3) | m);
}

static inline uint8_t e5m2_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(f);
    if (!(a < 57344.0f)) return sign | 0x7b;
    if (a < 6.103515625e-05f) return sign | (uint8_t)nearbyintf(a * 65536.0f);  // subnormal: of 2^-16
    uint32_t au = u & 0x7fffffff;
    au += 0xfffff + ((au >> 21) & 1);  // to 2 mantissa bits
    const int e = (int)(au >> 23) - 127 + 15, m = (int)((au >> 21) & 3);
    return e > 30 ? (sign | 0x7b) : (uint8_t)(sign | (e << 2) | m);
}

// int8 keys and values are stored rotated: each head's vector times an orthonormal Hadamard
// matrix (symmetric, its own inverse; in blocks of the largest power of two dividing head_dim),
// so that a few large channels spread over the block instead of setting its q8 scale alone
// (QuaRot's idea). paged_attention.c rotates the queries alike, so q . k is unchanged, and
// rotates its result back. Keys carry most of the int8 cache's error (doubling their step
// tripled the first-step logprob distance to float16; doubling the values', 1.4x): rotated,
// its median fell from 0.018 to 0.010 (16 prompts of 1,000 tokens, SmolLM2-135M).
void hadamard_rotate(float *x, int64_t count, int64_t d) {
    const int64_t r = d & -d;
    const float scale = (float)(1.0 / sqrt((double)r));
    for (int64_t at = 0; at < count * d; at += r) {
        float *p = x + at;
        for (int64_t h = 1; h < r; h *= 2)
            for (int64_t i = 0; i < r; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = p[j], b = p[j + h];
                    p[j] = a + b;
                    p[j + h] = a - b;
                }
        for (int64_t i = 0; i < r; i++) p[i] *= scale;
    }
}

// int8 keys: the error that matters is a query's dot with it, q . (k' - k), and queries are far
// from isotropic (one mean direction holds half a head's query energy). So after rounding to
// nearest, a key moves a few of its values to their other neighbour (each still within one
// step) where that lowers e^T W e, e the key's error and W = E[q q^T] over its head's queries,
// rotated as the key is (measured once at load: unison/model/layers/key_rounding.py). Greedy, one value
// a pass, a pass for each KEY_VALUES_PER_PASS values of the head: the score error's rms fell by a
// third, and the first-step logprob distance to float16's with it (BENCHMARKS.md). Four passes
// for any head_dim left Gemma 3's heads of 256 at 0.55 of nearest's e^T W e; a pass per 16
// values, 0.45 (64: still four). The cache's layout and its reader are unchanged: these are q8
// blocks like any other, only better chosen.
#define KEY_VALUES_PER_PASS 16

static void shape_key_q8(int8_t *dst, const float *x, int64_t d, const float *restrict w) {
    float err[d], step[d], we[d];  // the error, each value's step (its block's scale), W e
    for (int64_t j = 0; j < d; j++) {
        step[j] = q8_scale(dst + j / 32 * Q8_BLOCK);
        err[j] = (float)dst[q8_at(j)] * step[j] - x[j];
        we[j] = 0.0f;
    }
    for (int64_t j = 0; j < d; j++)  // W is symmetric: its row j is its column j
        for (int64_t i = 0; i < d; i++) we[i] += w[j * d + i] * err[j];
    for (int64_t pass = 0; pass < d / KEY_VALUES_PER_PASS; pass++) {
        int64_t best = -1;
        float best_change = 0.0f;
        for (int64_t j = 0; j < d; j++) {
            const int8_t q = dst[q8_at(j)];
            const int up = err[j] <= 0.0f;  // rounded down (or exact): the other neighbour is above
            if (up ? q == 127 : q == -127) continue;
            const float move = up ? step[j] : -step[j];
            const float change = 2.0f * move * we[j] + move * move * w[j * d + j];
            if (change < best_change) best_change = change, best = j;
        }
        if (best < 0) break;
        const float move = err[best] <= 0.0f ? step[best] : -step[best];
        dst[q8_at(best)] += move > 0.0f ? 1 : -1;
        err[best] += move;
        for (int64_t i = 0; i < d; i++) we[i] += move * w[best * d + i];
    }
}

static void store_row(void *cache, int64_t slot, const float *x, int64_t width, int dtype) {
    if (dtype == 4 || dtype == 5) {
        uint8_t *dst = (uint8_t *)cache + slot * width;
        for (int64_t i = 0; i < width; i++) dst[i] = dtype == 4 ? e4m3_of_f32(x[i]) : e5m2_of_f32(x[i]);
    } else if (dtype == 3) {  // heads one after another (head_dim a multiple of 32): width / 32 blocks
        store_q8((int8_t *)cache + slot * Q8_HEAD(width), x, width);
    } else if (dtype == 1) {
        _Float16 *dst = (_Float16 *)cache + slot * width;
        for (int64_t i = 0; i < width; i++) dst[i] = (_Float16)x[i];  // nearest even, as torch
    } else if (dtype == 2) {
        uint16_t *dst = (uint16_t *)cache + slot * width;
        for (int64_t i = 0; i < width; i++) dst[i] = bf16_of_f32(x[i]);
    } else {
        memcpy((float *)cache + slot * width, x, sizeof(float) * width);
    }
}

// int8 keys: about half a key's energy lies along a direction every key of its head shares, and
// it sets the blocks' scales. So each block of 32 is stored less the head's mean where that needs
// the smaller scale, marked by its scale's sign bit (q8.h), and the reader adds the mean back.
// Not every block: the first token, which takes a third to two thirds of the attention in later
// layers, has a key far from the mean; stored less it, its step would grow 3-5x (BENCHMARKS.md).
static void shift_key_blocks(float *x, const float *mean, int64_t width, uint8_t *shifted) {
    for (int64_t g = 0; g < width; g += 32) {
        float whole = 0.0f, less = 0.0f;
        for (int64_t i = g; i < g + 32; i++) {
            whole = fmaxf(whole, fabsf(x[i]));
            less = fmaxf(less, fabsf(x[i] - mean[i]));
        }
        shifted[g / 32] = less < whole;
        if (shifted[g / 32])
            for (int64_t i = g; i < g + 32; i++) x[i] -= mean[i];
    }
}

static void mark_shifted(int8_t *row, const uint8_t *shifted, int64_t blocks) {
    for (int64_t b = 0; b < blocks; b++) {
        if (!shifted[b]) continue;
        const uint16_t bits = q8_scale_bits(row + b * Q8_BLOCK) | Q8_SHIFTED;
        memcpy(row + b * Q8_BLOCK + 32, &bits, sizeof bits);
    }
}

// k_cache / v_cache rows [slots[r]] = rows r of k and v (width floats each: heads of head_dim),
// converted to the cache's element type (dtype: 0 float32, 1 float16, 2 bfloat16, 3 int8 in q8
// blocks of 32, rotated, 4 fp8 e4m3, 5 fp8 e5m2). int8 keys, if given (key_rounding.py):
// key_mean [width] (rotated) for shift_key_blocks, and key_weight [heads, head_dim, head_dim]
// for shape_key_q8; NULL: keys stored whole, rounded to nearest. int8's recent rows (q8.h),
// rotated, whole, as float16: row r goes to row r of recent_k / recent_v ([rows, width]; NULL:
// none) and to row twin_slots[r] of twin_k / twin_v where that is >= 0.
void store_kv(const float *k, const float *v, int64_t row_stride, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t rows, int64_t width, int64_t head_dim, int dtype,
              const float *key_weight, const float *key_mean, void *recent_k, void *recent_v, void *twin_k,
              void *twin_v, const int64_t *twin_slots) {
    float rotated[dtype == 3 ? width : 1];
    uint8_t shifted[dtype == 3 ? width / 32 : 1];
    const int shift = dtype == 3 && key_mean != NULL;
    for (int64_t r = 0; r < rows; r++) {
        const float *rows_kv[2] = {k + r * row_stride, v + r * row_stride};
        void *caches[2] = {k_cache, v_cache}, *recent[2] = {recent_k, recent_v}, *twins[2] = {twin_k, twin_v};
        for (int i = 0; i < 2; i++) {
            const float *x = rows_kv[i];
            if (dtype == 3) {
                memcpy(rotated, x, sizeof(float) * width);
                hadamard_rotate(rotated, width / head_dim, head_dim);
                if (recent[i] != NULL) store_row(recent[i], r, rotated, width, 1);
                if (recent[i] != NULL && twin_slots[r] >= 0)
                    store_row(twins[i], twin_slots[r], rotated, width, 1);
                if (i == 0 && shift) shift_key_blocks(rotated, key_mean, width, shifted);
                x = rotated;
            }
            store_row(caches[i], slots[r], x, width, dtype);
            if (i == 0 && shift) mark_shifted((int8_t *)k_cache + slots[r] * Q8_HEAD(width), shifted, width / 32);
            if (dtype == 3 && i == 0 && key_weight != NULL)
                for (int64_t h = 0; h < width / head_dim; h++)
                    shape_key_q8((int8_t *)k_cache + slots[r] * Q8_HEAD(width) + h * Q8_HEAD(head_dim),
                                 x + h * head_dim, head_dim, key_weight + h * head_dim * head_dim);
        }
    }
}

#ifdef UNISON_AVX2
// tanh(x), with exp taken of -|x| only (it cannot overflow).
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_and_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_or_ps(t, sign);
}
#endif

// x[r] *= act(gate[r]) over n columns (rows of both may be strided); act: 0 silu, 2 sigmoid.
// The vector body and the scalar tail fall at the same columns in every row: a row's bits do not
// depend on the others (a gated attention's output, a Gated DeltaNet's silu(z)).
void mul_act(float *x, int64_t x_stride, const float *gate, int64_t gate_stride, int64_t rows, int64_t n,
             int activation, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *o = x + r * x_stride;
        const float *g = gate + r * gate_stride;
        int64_t i = 0;
#ifdef UNISON_AVX2
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(g + i);
            __m256 a;
            if (activation == 2) {
                a = sigmoid8(v);
            } else {
                a = silu8(v);
            }
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), a));
        }
#endif
        for (; i < n; i++) {
            const float v = g[i], s = 1.0f / (1.0f + expf(-v));
            o[i] *= activation == 2 ? s : v * s;
        }
    }
}

// GELU, tanh approximation (transformers' gelu_pytorch_tanh): 0.5 x (1 + tanh(c (x + 0.044715 x^3))).
#define GELU_C 0.7978845608028654f
// gpt-oss's clamped SwiGLU (activation 3), with transformers' constants
#define SWIGLU_ALPHA 1.702f
#define SWIGLU_LIMIT 7.0f

// out [rows, n] = act(gate) * up, for gate_up [rows, 2n] = gate | up side by side.
// activation: 0 silu, 1 gelu (tanh approximation), 3 gpt-oss's clamped SwiGLU:
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit).
void act_mul(const float *gate_up, float *out, int64_t rows, int64_t n, int activation, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
#ifdef UNISON_AVX2
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            __m256 a;
            if (activation == 3) {  // gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g clamped above
                const __m256 g = _mm256_min_ps(x, _mm256_set1_ps(SWIGLU_LIMIT));
                const __m256 s = sigmoid8(_mm256_mul_ps(_mm256_set1_ps(SWIGLU_ALPHA), g));
                const __m256 up = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(u + i), _mm256_set1_ps(-SWIGLU_LIMIT)),
                                                _mm256_set1_ps(SWIGLU_LIMIT));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_add_ps(up, _mm256_set1_ps(1.0f)), _mm256_mul_ps(g, s)));
                continue;
            } else if (activation == 1) {
                const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(GELU_C),
                    _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
                a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                                  _mm256_add_ps(_mm256_set1_ps(1.0f), tanh8(inner)));
            } else {
                a = silu8(x);
            }
            _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < n; i++) {
            if (activation == 3) {
                const float x = fminf(g[i], SWIGLU_LIMIT), up = fminf(fmaxf(u[i], -SWIGLU_LIMIT), SWIGLU_LIMIT);
                o[i] = (up + 1.0f) * (x * (1.0f / (1.0f + expf(-SWIGLU_ALPHA * x))));
                continue;
            }
            const float x = g[i];
            const float a = activation == 1 ? 0.5f * x * (1.0f + tanhf(GELU_C * (x + 0.044715f * x * x * x)))
                                            : x / (1.0f + expf(-x));
            o[i] = a * u[i];
        }
    }
}
