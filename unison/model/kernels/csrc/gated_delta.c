// Gated DeltaNet for CPUs (Qwen3-Next, Qwen3.5): a linear-attention layer's short causal
// convolution and its gated delta-rule recurrence, for a step's requests, each over the state it
// holds in the state pool.
//
// For each request, over its new rows t in order (x: the layer's q|k|v projection, conv_dim wide):
//   c[t]   = silu(sum_j w[:, j] * x[t - K + 1 + j])      the convolution, over the last K-1 inputs
//                                                         kept from earlier steps, then these rows
//   q, k   = each key head of c[t] l2-normed; q also scaled by head_k_dim^-1/2
//   for each value head h, reading key head h / (num_v_heads / num_k_heads), or h % num_k_heads
//   where the value heads are tiled (a Qwen3.5 GGUF's order):
//     S      = S * exp(g[t, h])                          S: [head_k_dim, head_v_dim], float32
//     delta  = (v - S^T k) * beta[t, h]
//     S      = S + k delta^T
//     out[t] = S^T q
//
// Prefill and decode are the same loop, one token at a time, with one order of sums: a sum over
// the key dimension runs i = 0, 1, ... for each output column j, whatever the SIMD width (lanes
// run across j, never across i), and every multiply-add is an explicit fmaf. So a request's rows
// are the same bits whether its prompt came in one chunk or many, alone or in any batch, on AVX2
// or AVX-512. Requests and value heads are independent, and so are the convolution's channels:
// the threads share them out.
//
// Built with the other kernels by unison/model/kernels/cpu_kernels.py (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

// Value columns of S taken through a request's rows together: 8 columns a register, one register
// each for kv and o per 8, as many as the registers allow (32 with AVX-512's, else 16). Any
// width gives the same bits: the columns are independent.
#ifdef __AVX512VL__
#define COLS 64
#else
#define COLS 32
#endif
#define UNITS (COLS / 8)
#define CONV_CHUNK 512  // channels of one convolution task (a multiple of 8: see conv_rows)

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

// The convolution of channels [c0, c1) of one request's n rows (x rows at x_stride), writing c
// [n, conv_dim] and leaving those channels' last K-1 inputs in state [K-1, conv_dim] (oldest
// first). silu runs 8 channels at a time (simd_math.h) and scalar on the last conv_dim % 8: with
// c0 a multiple of 8, each channel takes the same path whatever the tasks' split.
static void conv_rows(const float *x, int64_t x_stride, int64_t n, const float *w, int64_t K,
                      int64_t conv_dim, int64_t c0, int64_t c1, float *state, float *c) {
    for (int64_t t = 0; t < n; t++) {
        float *out = c + t * conv_dim;
        for (int64_t ch = c0; ch < c1; ch++) out[ch] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t src = t - (K - 1) + j;  // < 0: from the state
            const float *in = src < 0 ? state + (K - 1 + src) * conv_dim : x + src * x_stride;
#pragma omp simd
            for (int64_t ch = c0; ch < c1; ch++) out[ch] = fmaf(w[ch * K + j], in[ch], out[ch]);
        }
        int64_t ch = c0;
#ifdef UNISON_AVX2
        for (; ch + 8 <= c1; ch += 8) _mm256_storeu_ps(out + ch, silu8(_mm256_loadu_ps(out + ch)));
#endif
        for (; ch < c1; ch++) out[ch] = silu(out[ch]);
    }
    // The new state: the last K-1 of (old state, these rows), row by row (a row moves up from
    // further down, never from a row already written).
    const int64_t keep = K - 1, bytes = (c1 - c0) * sizeof(float);
    for (int64_t r = 0; r < keep; r++) {
        const int64_t src = r + n - keep;  // < 0: the old state's row keep + src
        const float *from = src < 0 ? state + (keep + src) * conv_dim : x + src * x_stride;
        memcpy(state + r * conv_dim + c0, from + c0, bytes);
    }
}

// x * (sum(x^2) + 1e-6)^-1/2 * scale, in place, summed in order.
static void l2norm(float *x, int64_t d, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss = fmaf(x[i], x[i], ss);
    const float inv = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < d; i++) x[i] *= inv;
}

// Columns [j0, j0 + w) of one value head of one request over its n rows: S [dk, dv] in place;
// out rows at out_stride. Every column of S evolves on its own (the sums run over i), so a slab
// of at most COLS columns goes through all n rows while it sits in L1 (a token at a time over all
// of S read it from L2 twice a token). The portable form, and the AVX2 build's last columns.
static void recurrence_cols(
        int64_t conv_dim, const float *q_off, const float *k_off, const float *v_off, const float *g,
        const float *beta, int64_t gb_stride, int64_t n, int64_t dk, int64_t dv, float *S, float *out,
        int64_t out_stride, int64_t j0, int64_t w) {
    for (int64_t t = 0; t < n; t++) {
        const float *q = q_off + t * conv_dim, *k = k_off + t * conv_dim, *v = v_off + t * conv_dim + j0;
        const float decay = expf(g[t * gb_stride]), b = beta[t * gb_stride];
        float kv[COLS] = {0}, o[COLS] = {0};
        for (int64_t i = 0; i < dk; i++) {  // S *= decay, kv = S^T k
            float *s = S + i * dv + j0;
            const float ki = k[i];
#pragma omp simd
            for (int64_t j = 0; j < w; j++) {
                s[j] *= decay;
                kv[j] = fmaf(s[j], ki, kv[j]);
            }
        }
#pragma omp simd
        for (int64_t j = 0; j < w; j++) kv[j] = (v[j] - kv[j]) * b;  // kv is delta from here
        for (int64_t i = 0; i < dk; i++) {  // S += k delta^T, o = S^T q
            float *s = S + i * dv + j0;
            const float ki = k[i], qi = q[i];
#pragma omp simd
            for (int64_t j = 0; j < w; j++) {
                s[j] = fmaf(ki, kv[j], s[j]);
                o[j] = fmaf(s[j], qi, o[j]);
            }
        }
        memcpy(out + t * out_stride + j0, o, sizeof(float) * w);
    }
}

#ifdef UNISON_AVX2
// recurrence_cols for COLS columns with its sums in registers, UNITS chains of fmas side by side:
// the same operations, lane for lane (a compiler kept the sums on the stack, each fma waiting on
// a store and a load: 1.8x slower).
static void recurrence_wide(int64_t conv_dim, const float *q_off, const float *k_off, const float *v_off,
                            const float *g, const float *beta, int64_t gb_stride, int64_t n, int64_t dk,
                            int64_t dv, float *S, float *out, int64_t out_stride, int64_t j0) {
    for (int64_t t = 0; t < n; t++) {
        const float *q = q_off + t * conv_dim, *k = k_off + t * conv_dim, *v = v_off + t * conv_dim + j0;
        const __m256 decay = _mm256_set1_ps(expf(g[t * gb_stride])), b = _mm256_set1_ps(beta[t * gb_stride]);
        __m256 kv[UNITS], o[UNITS];
#pragma GCC unroll 8
        for (int u = 0; u < UNITS; u++) kv[u] = o[u] = _mm256_setzero_ps();
        for (int64_t i = 0; i < dk; i++) {  // S *= decay, kv = S^T k
            float *s = S + i * dv + j0;
            const __m256 ki = _mm256_set1_ps(k[i]);
#pragma GCC unroll 8
            for (int u = 0; u < UNITS; u++) {
                const __m256 su = _mm256_mul_ps(_mm256_loadu_ps(s + 8 * u), decay);
                _mm256_storeu_ps(s + 8 * u, su);
                kv[u] = _mm256_fmadd_ps(su, ki, kv[u]);
            }
        }
#pragma GCC unroll 8
        for (int u = 0; u < UNITS; u++)  // kv is delta from here
            kv[u] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + 8 * u), kv[u]), b);
        for (int64_t i = 0; i < dk; i++) {  // S += k delta^T, o = S^T q
            float *s = S + i * dv + j0;
            const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
#pragma GCC unroll 8
            for (int u = 0; u < UNITS; u++) {
                const __m256 su = _mm256_fmadd_ps(ki, kv[u], _mm256_loadu_ps(s + 8 * u));
                _mm256_storeu_ps(s + 8 * u, su);
                o[u] = _mm256_fmadd_ps(su, qi, o[u]);
            }
        }
#pragma GCC unroll 8
        for (int u = 0; u < UNITS; u++) _mm256_storeu_ps(out + t * out_stride + j0 + 8 * u, o[u]);
    }
}
#endif

// One value head of one request over its n rows, COLS columns at a time.
static void recurrence(int64_t conv_dim, const float *q_off, const float *k_off, const float *v_off,
                       const float *g, const float *beta, int64_t gb_stride, int64_t n, int64_t dk, int64_t dv,
                       float *S, float *out, int64_t out_stride) {
    for (int64_t j0 = 0; j0 < dv; j0 += COLS) {
#ifdef UNISON_AVX2
        if (dv - j0 >= COLS) {
            recurrence_wide(conv_dim, q_off, k_off, v_off, g, beta, gb_stride, n, dk, dv, S, out, out_stride,
                            j0);
            continue;
        }
#endif
        recurrence_cols(conv_dim, q_off, k_off, v_off, g, beta, gb_stride, n, dk, dv, S, out, out_stride, j0,
                        dv - j0 < COLS ? dv - j0 : COLS);
    }
}

// The recurrence's gates from the projections a and b ([rows, heads], rows at `stride`):
// g = -exp(A_log) * softplus(a + dt_bias) (neg_a holds -exp(A_log)), beta = sigmoid(b), as
// transformers computes them (softplus linear above 20), one value at a time.
void delta_gates(const float *a, const float *b, int64_t stride, int64_t rows, int64_t heads,
                 const float *dt_bias, const float *neg_a, float *g, float *beta) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const float x = a[r * stride + h] + dt_bias[h];
            g[r * heads + h] = neg_a[h] * (x > 20.0f ? x : log1pf(expf(x)));
            beta[r * heads + h] = 1.0f / (1.0f + expf(-b[r * stride + h]));
        }
}

// One layer's step. Request i has rows [row_start[i], row_start[i] + row_count[i]) of x, g and
// beta (the requests' rows follow each other, in order), and state slot slots[i]: conv_state
// [slots, K-1, conv_dim] and rec_state [slots, hv, dk, dv] are this layer's. c: workspace
// [rows, conv_dim]; out: [rows, hv * dv].
void gated_delta(const float *x, int64_t x_stride, const float *g, const float *beta, int64_t gb_stride,
                const float *conv_w, int64_t K, float *conv_state, float *rec_state,
                const int64_t *slots, const int64_t *row_start, const int64_t *row_count, int64_t items,
                int64_t hk, int64_t hv, int64_t dk, int64_t dv, int tiled, float *c, float *out,
                int num_threads) {
    const int64_t key_dim = hk * dk, conv_dim = 2 * key_dim + hv * dv, group = hv / hk;
    const float scale = 1.0f / sqrtf((float)dk);
    const int64_t chunks = (conv_dim + CONV_CHUNK - 1) / CONV_CHUNK;
    const int64_t rows_from = items ? row_start[0] : 0;
    const int64_t rows_to = items ? row_start[items - 1] + row_count[items - 1] : 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t i = 0; i < items; i++)
            for (int64_t part = 0; part < chunks; part++) {
                const int64_t r0 = row_start[i], c0 = part * CONV_CHUNK;
                const int64_t c1 = c0 + CONV_CHUNK < conv_dim ? c0 + CONV_CHUNK : conv_dim;
                conv_rows(x + r0 * x_stride, x_stride, row_count[i], conv_w, K, conv_dim, c0, c1,
                          conv_state + slots[i] * (K - 1) * conv_dim, c + r0 * conv_dim);
            }
#pragma omp for schedule(static)
        for (int64_t t = rows_from; t < rows_to; t++)
            for (int64_t h = 0; h < 2 * hk; h++)  // q heads, then k heads
                l2norm(c + t * conv_dim + h * dk, dk, h < hk ? scale : 1.0f);
    }
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(num_threads) if (items * hv > 1)
    for (int64_t i = 0; i < items; i++)
        for (int64_t h = 0; h < hv; h++) {
            const int64_t r0 = row_start[i], kh = tiled ? h % hk : h / group;
            const float *ci = c + r0 * conv_dim;
            recurrence(conv_dim, ci + kh * dk, ci + key_dim + kh * dk, ci + 2 * key_dim + h * dv,
                       g + r0 * gb_stride + h, beta + r0 * gb_stride + h, gb_stride, row_count[i], dk, dv,
                       rec_state + (slots[i] * hv + h) * dk * dv, out + r0 * hv * dv + h * dv, hv * dv);
        }
}
