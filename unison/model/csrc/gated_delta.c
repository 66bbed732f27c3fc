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
// or AVX-512. Requests and value heads are independent: the threads share them out.
//
// Built with the other kernels by unison/model/cpu_kernels.py (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

// The convolution of one request's n rows (x rows at x_stride), writing c [n, conv_dim] and
// leaving the last K-1 inputs in state [K-1, conv_dim] (oldest first).
static void conv_rows(const float *x, int64_t x_stride, int64_t n, const float *w, int64_t K,
                      int64_t conv_dim, float *state, float *c) {
    for (int64_t t = 0; t < n; t++) {
        float *out = c + t * conv_dim;
        for (int64_t ch = 0; ch < conv_dim; ch++) out[ch] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t src = t - (K - 1) + j;  // < 0: from the state
            const float *in = src < 0 ? state + (K - 1 + src) * conv_dim : x + src * x_stride;
#pragma omp simd
            for (int64_t ch = 0; ch < conv_dim; ch++) out[ch] = fmaf(w[ch * K + j], in[ch], out[ch]);
        }
#pragma omp simd
        for (int64_t ch = 0; ch < conv_dim; ch++) out[ch] = silu(out[ch]);
    }
    // The new state: the last K-1 of (old state, these rows).
    const int64_t keep = K - 1;
    if (n >= keep) {
        for (int64_t r = 0; r < keep; r++)
            memcpy(state + r * conv_dim, x + (n - keep + r) * x_stride, conv_dim * sizeof(float));
    } else {
        memmove(state, state + n * conv_dim, (keep - n) * conv_dim * sizeof(float));
        for (int64_t r = 0; r < n; r++)
            memcpy(state + (keep - n + r) * conv_dim, x + r * x_stride, conv_dim * sizeof(float));
    }
}

// x * (sum(x^2) + 1e-6)^-1/2 * scale, in place, summed in order.
static void l2norm(float *x, int64_t d, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss = fmaf(x[i], x[i], ss);
    const float inv = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < d; i++) x[i] *= inv;
}

// One value head of one request over its n rows: S [dk, dv] in place; out rows at out_stride.
static void recurrence(int64_t conv_dim, const float *q_off, const float *k_off,
                       const float *v_off, const float *g, const float *beta, int64_t gb_stride,
                       int64_t n, int64_t dk, int64_t dv, float *S, float *out, int64_t out_stride,
                       float *kv) {
    for (int64_t t = 0; t < n; t++) {
        const float *q = q_off + t * conv_dim, *k = k_off + t * conv_dim, *v = v_off + t * conv_dim;
        const float decay = expf(g[t * gb_stride]), b = beta[t * gb_stride];
        for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {  // S *= decay, kv = S^T k
            float *s = S + i * dv;
            const float ki = k[i];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                s[j] *= decay;
                kv[j] = fmaf(s[j], ki, kv[j]);
            }
        }
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) kv[j] = (v[j] - kv[j]) * b;  // kv is delta from here
        float *o = out + t * out_stride;
        for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {  // S += k delta^T, o = S^T q
            float *s = S + i * dv;
            const float ki = k[i], qi = q[i];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                s[j] = fmaf(ki, kv[j], s[j]);
                o[j] = fmaf(s[j], qi, o[j]);
            }
        }
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
// beta, and state slot slots[i]: conv_state [slots, K-1, conv_dim] and rec_state
// [slots, hv, dk, dv] are this layer's. c: workspace [rows, conv_dim]; out: [rows, hv * dv].
// Returns 0, or -1 when the workspace cannot be allocated.
int gated_delta(const float *x, int64_t x_stride, const float *g, const float *beta, int64_t gb_stride,
                const float *conv_w, int64_t K, float *conv_state, float *rec_state,
                const int64_t *slots, const int64_t *row_start, const int64_t *row_count, int64_t items,
                int64_t hk, int64_t hv, int64_t dk, int64_t dv, int tiled, float *c, float *out,
                int num_threads) {
    const int64_t key_dim = hk * dk, conv_dim = 2 * key_dim + hv * dv, group = hv / hk;
    const float scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (items > 1)
    for (int64_t i = 0; i < items; i++) {
        const int64_t r0 = row_start[i], n = row_count[i];
        float *ci = c + r0 * conv_dim;
        conv_rows(x + r0 * x_stride, x_stride, n, conv_w, K, conv_dim,
                  conv_state + slots[i] * (K - 1) * conv_dim, ci);
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = 0; h < 2 * hk; h++)  // q heads, then k heads
                l2norm(ci + t * conv_dim + h * dk, dk, h < hk ? scale : 1.0f);
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (items * hv > 1)
    {
        float *kv = malloc(dv * sizeof(float));
        if (!kv) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t i = 0; i < items; i++)
            for (int64_t h = 0; h < hv; h++) {
                if (!kv) continue;
                const int64_t r0 = row_start[i], kh = tiled ? h % hk : h / group;
                const float *ci = c + r0 * conv_dim;
                recurrence(conv_dim, ci + kh * dk, ci + key_dim + kh * dk, ci + 2 * key_dim + h * dv,
                           g + r0 * gb_stride + h, beta + r0 * gb_stride + h, gb_stride, row_count[i], dk, dv,
                           rec_state + (slots[i] * hv + h) * dk * dv, out + r0 * hv * dv + h * dv, hv * dv, kv);
            }
        free(kv);
    }
    return failed ? -1 : 0;
}
