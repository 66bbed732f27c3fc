// Quantized linear layers for CPUs: y[M, N] = x[M, K] @ W[N, K]^T with W in 4- or 8-bit blocks.
//
// Weights come in blocks of 32 along K, as in llama.cpp: w = d * q + m per block and column,
//   int4: q in [0, 15] (two per byte), d and m fp16   -> 5 bits per weight
//   int8: q in [-127, 127], d and m fp16                -> 9 bits per weight
// (m lets 4-bit blocks widen to int8 exactly; it is 0 for blocks quantized symmetrically.)
//
// Activations keep (nearly) their float precision. 8-bit activations per 32-block, as llama.cpp's
// Q8_0, move this model's logprobs by up to 0.4-1.0 against float32 (measured on the embedded
// SmolLM2; the qkv and down inputs have outlier channels), far past what greedy parity allows:
//   int4: activations as int16 per row and 32-block, a = da * q, |q| <= 32767, fed to maddubs as
//         two bytes, q = 256 h + l (h signed, l unsigned): exact to 1 part in 65534 of the block.
//   int8: activations in float32, the weights widened to float in registers (FMA).
// A row's result depends only on that row, and K is reduced in one fixed order whatever M, N or
// the thread count: results are bit-identical alone or in any batch (one activation scale across
// the batch, as in fbgemm's and oneDNN's int8 paths, would not be).
//
// Packed weight layout: columns in tiles of 8; per (tile, block) one record, read in order:
//   int4: 128 bytes of nibbles, d[8] fp16, m[8] fp16                       (160 bytes)
//         byte 32 c + 4 col + j holds k = 8 c + j (low nibble) and k = 8 c + 4 + j (high nibble)
//   int8: 256 bytes, byte 8 k + col holds k; then d[8] fp16, m[8] fp16       (288 bytes)
// int4: four consecutive k of 8 columns fill one 256-bit register, so a broadcast of 4 activation
// bytes against it gives 8 columns' partial dots per maddubs. int8: the 8 columns of one k
// sign-extend into one register of 8 lanes. Either way, no horizontal sums.
//
// On AVX2 (Zen 3 here) maddubs issues on one port, 32 multiply-adds a cycle, against two FMA
// ports at 16: int4 with 16-bit activations (two maddubs) and int8 with float activations both
// run at about float32's rate once compute-bound; at batch 1 they read a quarter and a half of its
// bytes. AVX2 where the compiler targets it, portable C otherwise. Built with the other kernels
// by unison/model/cpu_kernels.py (-O3 -march=native -fopenmp).

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#endif

#define QBLOCK 32
#define TILE 8
#define INT4_RECORD 160
#define INT8_RECORD 288
#define INT4_ROWS 2  // rows of x per int4 micro-kernel call (two int16 sums each: registers)
#define INT8_ROWS 6  // rows per int8 call: the widened weights are shared by all of them
// Bytes ahead of the record in use to prefetch: at batch 1 the weights stream from memory, and
// each linear is too short a stream for the hardware prefetchers to reach full speed.
#define PREFETCH 1024

static inline float fp16_to_float(uint16_t h) {
#ifdef QL_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        uint32_t m = man;
        do { m <<= 1; e++; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// ---- activations for int4 ---------------------------------------------------------------------

// The int4 kernel's view of x [rows, k] (row stride x_stride floats), per row and 32-block:
// q = round(x / da) in [-32767, 32767] as its high byte (hi, signed) and low byte (lo, unsigned),
// da, sa = da * sum(q) (for the weights' min term) and l8 = 8 * sum(lo) (for the kernel's signed
// low-byte weights). Columns k..kp (padding to a whole block) are 0.
typedef struct {
    int8_t *hi;
    uint8_t *lo;
    float *da, *sa;
    int32_t *l8;
} act16;

static act16 act16_at(void *buf, int64_t rows, int64_t kp) {
    const int64_t nb = kp / QBLOCK;
    act16 a;
    a.hi = buf;
    a.lo = (uint8_t *)(a.hi + rows * kp);
    a.da = (float *)(a.lo + rows * kp);
    a.sa = a.da + rows * nb;
    a.l8 = (int32_t *)(a.sa + rows * nb);
    return a;
}

// Scratch bytes for a linear of `rows` rows: act16 (int4 parts) and the block sums (int8 parts).
int64_t act16_bytes(int64_t rows, int64_t kp) { return rows * kp * 2 + rows * (kp / QBLOCK) * 16; }

void quantize_act16(const float *x, int64_t x_stride, int64_t rows, int64_t k, int64_t kp, void *buf,
                    int num_threads) {
    const int64_t nb = kp / QBLOCK;
    const act16 a = act16_at(buf, rows, kp);
#pragma omp parallel for num_threads(num_threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * QBLOCK, n = k - k0 < QBLOCK ? (k - k0 > 0 ? k - k0 : 0) : QBLOCK;
            float amax = 0.0f;
            for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(xr[k0 + i]));
            const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int32_t sum = 0, lows = 0;
            for (int64_t i = 0; i < QBLOCK; i++) {
                int32_t v = i < n ? (int32_t)nearbyintf(xr[k0 + i] * inv) : 0;
                v = v > 32767 ? 32767 : v < -32767 ? -32767 : v;
                a.hi[r * kp + k0 + i] = (int8_t)(v >> 8);  // arithmetic: v = 256 hi + lo
                a.lo[r * kp + k0 + i] = (uint8_t)(v & 0xff);
                sum += v;
                lows += v & 0xff;
            }
            a.da[r * nb + b] = d;
            a.sa[r * nb + b] = d * (float)sum;
            a.l8[r * nb + b] = 8 * lows;
        }
    }
}

// ---- int4 -------------------------------------------------------------------------------------
//
// sum_k w q = 256 sum_k w hi + sum_k w lo, w the nibble in [0, 15]. maddubs multiplies unsigned
// by signed bytes: the high part as (w, hi), the low part as (lo, w - 8), plus 8 sum lo. Per pair
// |15 * 128 * 2| <= 3840 and |255 * 8 * 2| <= 4080, so eight of them add up within int16.

#ifdef QL_AVX2
static inline __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void int4_tile(
        const uint8_t *w, int64_t nb, act16 a, int64_t kp, float *out, int64_t ldo, const int nrows) {
    const __m256i low = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
    const __m256i ones = _mm256_set1_epi16(1), x256 = _mm256_set1_epi16(256);
    __m256 acc[INT4_ROWS];
    for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += INT4_RECORD) {
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 128), _MM_HINT_T0);
        __m256i hsum[INT4_ROWS], lsum[INT4_ROWS];
        for (int r = 0; r < nrows; r++) hsum[r] = lsum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++) {  // not unrolled: more live products would spill registers
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
            const __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i s0 = _mm256_sub_epi8(w0, eight), s1 = _mm256_sub_epi8(w1, eight);
            for (int r = 0; r < nrows; r++) {
                const int64_t at = r * kp + b * QBLOCK + 8 * c;
                hsum[r] = _mm256_add_epi16(hsum[r], _mm256_maddubs_epi16(w0, bcast4(a.hi + at)));
                hsum[r] = _mm256_add_epi16(hsum[r], _mm256_maddubs_epi16(w1, bcast4(a.hi + at + 4)));
                lsum[r] = _mm256_add_epi16(lsum[r], _mm256_maddubs_epi16(bcast4(a.lo + at), s0));
                lsum[r] = _mm256_add_epi16(lsum[r], _mm256_maddubs_epi16(bcast4(a.lo + at + 4), s1));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 128)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 144)));
        for (int r = 0; r < nrows; r++) {
            const int64_t rb = r * nb + b;
            const __m256i dot = _mm256_add_epi32(
                _mm256_add_epi32(_mm256_madd_epi16(hsum[r], x256), _mm256_madd_epi16(lsum[r], ones)),
                _mm256_set1_epi32(a.l8[rb]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.da[rb])),
                                     acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sa[rb]), acc[r]);
        }
    }
    for (int r = 0; r < nrows; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#else
static void int4_tile(const uint8_t *w, int64_t nb, act16 a, int64_t kp, float *out, int64_t ldo,
                      const int nrows) {
    for (int r = 0; r < nrows; r++) {
        float acc[TILE] = {0};
        const uint8_t *rec = w;
        for (int64_t b = 0; b < nb; b++, rec += INT4_RECORD) {
            const int64_t at = r * kp + b * QBLOCK, rb = r * nb + b;
            for (int col = 0; col < TILE; col++) {
                int32_t dot = 0;
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = rec[32 * c + 4 * col + j];
                        for (int half = 0; half < 2; half++) {
                            const int32_t q = half ? byte >> 4 : byte & 0x0f;
                            const int64_t i = at + 8 * c + 4 * half + j;
                            dot += 256 * q * a.hi[i] + (q - 8) * a.lo[i];
                        }
                    }
                dot += a.l8[rb];
                uint16_t dh, mh;
                memcpy(&dh, rec + 128 + 2 * col, 2);
                memcpy(&mh, rec + 144 + 2 * col, 2);
                acc[col] = fmaf((float)dot, fp16_to_float(dh) * a.da[rb], acc[col]);
                acc[col] = fmaf(fp16_to_float(mh), a.sa[rb], acc[col]);
            }
        }
        memcpy(out + r * ldo, acc, sizeof(acc));
    }
}
#endif

// ---- int8 -------------------------------------------------------------------------------------
//
// The weights widened to float in registers, times float32 activations, each block's sum
// scaled by its d once (plus m times the block's sum of x, xs): the float32 path's arithmetic on
// the stored int8 values.

#ifdef QL_AVX2
static inline __attribute__((always_inline)) void int8_tile(
        const uint8_t *w, int64_t nb, const float *x, int64_t x_stride, const float *xs, float *out,
        int64_t ldo, const int nrows) {
    __m256 acc[INT8_ROWS];
    for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += INT8_RECORD) {
        for (int i = 0; i < INT8_RECORD; i += 64) _mm_prefetch((const char *)(w + PREFETCH + i), _MM_HINT_T0);
        __m256 part[INT8_ROWS];  // this block's sum of q * x; its scale d applied once, below
        for (int r = 0; r < nrows; r++) part[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int k = 0; k < QBLOCK; k++) {
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 8 * k))));
            for (int r = 0; r < nrows; r++)
                part[r] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(x + r * x_stride + b * QBLOCK + k), part[r]);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 256)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 272)));
        for (int r = 0; r < nrows; r++) {
            acc[r] = _mm256_fmadd_ps(part[r], d, acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < nrows; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#else
static void int8_tile(const uint8_t *w, int64_t nb, const float *x, int64_t x_stride, const float *xs,
                      float *out, int64_t ldo, const int nrows) {
    for (int r = 0; r < nrows; r++) {
        float acc[TILE] = {0};
        const uint8_t *rec = w;
        for (int64_t b = 0; b < nb; b++, rec += INT8_RECORD)
            for (int col = 0; col < TILE; col++) {
                uint16_t dh, mh;
                memcpy(&dh, rec + 256 + 2 * col, 2);
                memcpy(&mh, rec + 272 + 2 * col, 2);
                float part = 0.0f;
                for (int k = 0; k < QBLOCK; k++)
                    part = fmaf((float)(int8_t)rec[8 * k + col], x[r * x_stride + b * QBLOCK + k], part);
                acc[col] = fmaf(part, fp16_to_float(dh), acc[col]);
                acc[col] = fmaf(fp16_to_float(mh), xs[r * nb + b], acc[col]);
            }
        memcpy(out + r * ldo, acc, sizeof(acc));
    }
}
#endif

// ---- the GEMMs --------------------------------------------------------------------------------

#define ROW_CHUNK 64  // rows whose activations stay in cache while every column tile passes them

// out [m, ldo] columns [0, n) = x @ W^T for packed int4 W of n columns (a multiple of 8) and kp
// inputs, x given as quantize_act16's buffer. Columns are split among threads.
void int4_linear(const uint8_t *w, int64_t n, int64_t kp, void *act, int64_t m, float *out, int64_t ldo,
                 int num_threads) {
    const int64_t nb = kp / QBLOCK, tiles = n / TILE;
    const act16 all = act16_at(act, m, kp);
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
        const int64_t m1 = m0 + ROW_CHUNK < m ? m0 + ROW_CHUNK : m;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tiles * (m1 - m0) >= 64)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *wt = w + t * nb * INT4_RECORD;
            for (int64_t r = m0; r < m1; r += INT4_ROWS) {
                const act16 a = {all.hi + r * kp, all.lo + r * kp, all.da + r * nb, all.sa + r * nb,
                                 all.l8 + r * nb};
                float *o = out + r * ldo + t * TILE;
                if (m1 - r >= 2)
                    int4_tile(wt, nb, a, kp, o, ldo, 2);
                else
                    int4_tile(wt, nb, a, kp, o, ldo, 1);
            }
        }
    }
}

// xs [rows, kp / 32] = each 32-block's sum of x (the int8 kernel's min term).
void block_sums(const float *x, int64_t x_stride, int64_t rows, int64_t kp, float *xs) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < kp / QBLOCK; b++) {
            float s = 0.0f;
            for (int64_t i = 0; i < QBLOCK; i++) s += x[r * x_stride + b * QBLOCK + i];
            xs[r * (kp / QBLOCK) + b] = s;
        }
}

// The same for packed int8 W, x [m, kp] float32 itself and xs its block_sums.
void int8_linear(const uint8_t *w, int64_t n, int64_t kp, const float *x, int64_t x_stride,
                 const float *xs, int64_t m, float *out, int64_t ldo, int num_threads) {
    const int64_t nb = kp / QBLOCK, tiles = n / TILE;
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
        const int64_t m1 = m0 + ROW_CHUNK < m ? m0 + ROW_CHUNK : m;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tiles * (m1 - m0) >= 64)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *wt = w + t * nb * INT8_RECORD;
            for (int64_t r = m0; r < m1; r += INT8_ROWS) {
                const float *xr = x + r * x_stride, *sr = xs + r * nb;
                float *o = out + r * ldo + t * TILE;
                switch (m1 - r < INT8_ROWS ? m1 - r : INT8_ROWS) {  // constant row counts: registers
                case 6: int8_tile(wt, nb, xr, x_stride, sr, o, ldo, 6); break;
                case 5: int8_tile(wt, nb, xr, x_stride, sr, o, ldo, 5); break;
                case 4: int8_tile(wt, nb, xr, x_stride, sr, o, ldo, 4); break;
                case 3: int8_tile(wt, nb, xr, x_stride, sr, o, ldo, 3); break;
                case 2: int8_tile(wt, nb, xr, x_stride, sr, o, ldo, 2); break;
                default: int8_tile(wt, nb, xr, x_stride, sr, o, ldo, 1); break;
                }
            }
        }
    }
}

// The linear as the model calls it: x [m, k] (row stride x_stride, k == kp unless the caller
// padded nothing: the int8 kernel reads whole blocks, so x must hold kp columns), each part
// (fused q|k|v may mix kinds) into its columns of out. Parts go in order: a part's padding
// columns are overwritten by the next. `scratch` holds act16_bytes(m, kp) bytes.
void quant_linear_parts(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t kp,
                        int64_t parts, const int64_t *bits, const int64_t *weights,
                        const int64_t *n_padded, const int64_t *col_offset, void *scratch,
                        float *out, int64_t ldo, int num_threads) {
    int quantized = 0, summed = 0;
    float *xs = (float *)((uint8_t *)scratch + m * kp * 2 + m * (kp / QBLOCK) * 12);
    for (int64_t p = 0; p < parts; p++) {
        const uint8_t *w = (const uint8_t *)(intptr_t)weights[p];
        if (bits[p] == 8) {
            if (!summed) block_sums(x, x_stride, m, kp, xs);
            summed = 1;
            int8_linear(w, n_padded[p], kp, x, x_stride, xs, m, out + col_offset[p], ldo, num_threads);
            continue;
        }
        if (!quantized) quantize_act16(x, x_stride, m, k, kp, scratch, num_threads);
        quantized = 1;
        int4_linear(w, n_padded[p], kp, scratch, m, out + col_offset[p], ldo, num_threads);
    }
}

// ---- rows of W, for embedding lookups and tests ------------------------------------------------

// out [len(ids), k] = the float weights of columns ids (rows of the original [n, k] matrix).
void dequantize_columns(int bits, const uint8_t *w, int64_t kp, int64_t k, const int64_t *ids,
                        int64_t count, float *out) {
    const int64_t nb = kp / QBLOCK, record = bits == 4 ? INT4_RECORD : INT8_RECORD;
    for (int64_t i = 0; i < count; i++) {
        const int64_t col = ids[i] % TILE;
        const uint8_t *rec = w + ids[i] / TILE * nb * record;
        float *o = out + i * k;
        for (int64_t b = 0; b < nb; b++, rec += record) {
            uint16_t dh, mh;
            memcpy(&dh, rec + (bits == 4 ? 128 : 256) + 2 * col, 2);
            memcpy(&mh, rec + (bits == 4 ? 144 : 272) + 2 * col, 2);
            const float d = fp16_to_float(dh), mn = fp16_to_float(mh);
            for (int64_t j = 0; j < QBLOCK && b * QBLOCK + j < k; j++) {
                float q;
                if (bits == 4) {
                    const int64_t c = j / 8, half = (j % 8) / 4, jj = j % 4;
                    const uint8_t byte = rec[32 * c + 4 * col + jj];
                    q = (float)(half ? byte >> 4 : byte & 0x0f);
                } else {
                    q = (float)(int8_t)rec[8 * j + col];
                }
                o[b * QBLOCK + j] = d * q + mn;
            }
        }
    }
}
