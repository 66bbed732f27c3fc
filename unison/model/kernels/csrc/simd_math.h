// Small vector math shared by the kernels (AVX2 + FMA): a horizontal sum, exp(x) for x <= 0, and
// silu and sigmoid from it.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define UNISON_AVX2 1

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// exp(x) for x <= 0, 8 at a time: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6
// polynomial, 2^n through the exponent bits. Relative error under 2e-7; inputs below -87 give
// about 1.6e-38 rather than 0. (glibc's vector expf is declared only under -ffast-math.)
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln2 in two parts
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(x) = x / (1 + exp(-x)), with exp taken of -|x| only (it cannot overflow).
static inline __m256 silu8(__m256 x) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)));
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), x);  // x < 0: x e / (1 + e)
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// sigmoid(v): e / (1 + e) for v < 0, 1 / (1 + e) else, e = exp(-|v|).
static inline __m256 sigmoid8(__m256 v) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)));
    const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, v);
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif
