// Quantized linear layers for CPUs: y[M, N] = x[M, K] @ W[N, K]^T with W in 4- or 8-bit blocks.
//
// Weights come in blocks of 32 along K, as in llama.cpp: w = d * q + m per block and column,
//   int4: q in [0, 15] (two per byte), d and m fp16   -> 5 bits per weight
//   int8: q in [-127, 127], d and m fp16                -> 9 bits per weight
// (m lets 4-bit blocks widen to int8 exactly; it is 0 for blocks quantized symmetrically.)
//
// Activations keep (nearly) their float precision. 8-bit activations per 32-block, as llama.cpp's
// Q8_0, move this model's logprobs by up to 0.4-1.0 against float32 (measured on the embedded
// SmolLM2; the qkv and down inputs have outlier channels), far past what greedy parity allows.
// So activations are int16 per row and 32-block, a = da * q, |q| <= 32767: exact to 1 part in
// 65534 of the block. Per block, every path computes the exact integer sum_k w_k q_k, then the
// same float operations in the same order (acc = fma(dot, d * da, acc); acc = fma(m, sa, acc),
// sa = da * sum_k q_k, blocks in order). A row's result depends only on that row, whatever M, N,
// the thread count or the instruction set: bit-identical alone or in any batch, on any CPU (one
// activation scale across the batch, as in fbgemm's and oneDNN's int8 paths, would not be).
//
// Packed weight layout: columns in tiles of 8; per (tile, block) one record, read in order:
//   int4: 128 bytes of nibbles, d[8] fp16, m[8] fp16                       (160 bytes)
//         byte 32 c + 4 col + j holds k = 8 c + j (low nibble) and k = 8 c + 4 + j (high nibble)
//   int8: 256 bytes, byte 8 k + col holds k; then d[8] fp16, m[8] fp16       (288 bytes)
//   int4 with m = -8 d (GGUF's Q4_0): the int4 record without its m          (144 bytes)
// The record's size names its format wherever a weight is passed (`record`). The third keeps a
// Q4_0 file's experts and linears at the file's own 4.5 bits; m = -8 d is computed in float32,
// exactly the float of the fp16 m the 160-byte record would hold (d times a power of two), so
// both records of the same blocks give the same bits. GGUF's other block formats (Q4_K, Q6_K,
// Q8_0, ...) keep their own blocks: gguf_blocks.h, format codes 4096 + the GGML type id.
//
// The paths, chosen at run time (quant_kernel_select) by what the CPU reports:
//   AVX2: int4 by maddubs on the activations' bytes (q = 256 h + l, h signed, l unsigned), or for
//         16+ rows by float FMAs on widened tiles (a block's sum is below 2^24: exact); int8 by
//         madd on int16 pairs. maddubs has one port on Zen 3, FMA two.
//   VNNI: vpdpwssd multiplies 32 int16 pairs per instruction; below 12 rows int4 runs vpdpbusd
//         on the records as they lie, from 12 rows a group of tiles is widened to pairs once.
//   AMX:  from 16 rows, the tile unit: activations' high and low bytes as two A tiles (signed
//         and unsigned), the weights as B tiles, two tile products per block.
// AVX2 where the compiler targets it, portable C otherwise. Built with the other kernels by
// unison/model/kernels/cpu_kernels.py (-O3 -march=native -fopenmp).

#define _GNU_SOURCE  // syscall(), for the AMX permission
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#endif
// The VNNI and AMX paths are compiled whatever -march says (function-level targets) and used only
// where the CPU reports them, so one source serves every x86 machine.
#if defined(QL_AVX2) && defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 9 || defined(__clang__))
#define QL_VNNI 1
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(QL_AMX_EMULATE)  // software tiles (tests on CPUs without AMX): see "AMX" below
#define QL_AMX 1
#define AMX_TARGET VNNI_TARGET
#elif __GNUC__ >= 11 || defined(__clang__)
#define QL_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#endif
#endif

// ---- which path runs (one per process: the engine core runs one model) -------------------------

enum { QL_PATH_PORTABLE = 0, QL_PATH_AVX2 = 1, QL_PATH_VNNI = 2, QL_PATH_AMX = 3 };

#ifdef QL_AMX
static int amx_refused;  // the errno of the kernel's refusal of the tile state, or 0

// Linux hands out the AMX tile state (8 KB per thread) only on request, once per process; a
// refusal (an old kernel, a seccomp filter) leaves the VNNI path.
static int amx_permitted(void) {
#ifdef QL_AMX_EMULATE
    return 1;
#else
    static int permitted = -1;
    unsigned a, b, c, d;
    if (permitted >= 0) return permitted;
    permitted = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
        return 0;  // no AMX-TILE, AMX-INT8
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
        amx_refused = errno;
        return 0;
    }
    return permitted = 1;
#endif
}
#endif

// The errno with which the kernel refused AMX on a CPU that has it (0: not refused).
int quant_kernel_amx_refused(void) {
#ifdef QL_AMX
    return amx_refused;
#else
    return 0;
#endif
}

static int quant_kernel_supported(int path) {
    switch (path) {
#ifdef QL_AVX2
    case QL_PATH_AVX2: return 1;
#else
    case QL_PATH_PORTABLE: return 1;
#endif
#ifdef QL_VNNI
    case QL_PATH_VNNI:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
#ifdef QL_AMX
    case QL_PATH_AMX: return quant_kernel_supported(QL_PATH_VNNI) && amx_permitted();
#endif
    default: return 0;
    }
}

static int ql_path = -1;  // -1: not chosen yet, the fastest supported on first use

// The fastest path this build and CPU support.
int quant_kernel_best(void) {
    for (int path = QL_PATH_AMX; path > QL_PATH_PORTABLE; path--)
        if (quant_kernel_supported(path)) return path;
    return QL_PATH_PORTABLE;
}

// Runs `path` from now on; -1 (and nothing changed) where this build or CPU cannot.
int quant_kernel_select(int path) {
    if (!quant_kernel_supported(path)) return -1;
    ql_path = path;
    return path;
}

int quant_kernel_path(void) {
    if (ql_path < 0) ql_path = quant_kernel_best();
    return ql_path;
}

#define QBLOCK 32
#define TILE 8
#define INT4_RECORD 160
#define INT4_SYM_RECORD 144
#define INT8_RECORD 288
#define INT4_ROWS 2  // rows of x per int4 micro-kernel call (two int16 sums each: registers)
#define INT8_ROWS 4  // rows of x per int8 micro-kernel call (the tile's pairs widen once for them)
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

// One column of a record, value by value: the layouts above in one place (the portable path,
// lookups and tests; the vector paths read whole registers of it).
static inline int32_t record_q(const uint8_t *rec, int64_t record, int col, int k) {
    if (record == INT8_RECORD) return (int8_t)rec[8 * k + col];
    const uint8_t byte = rec[32 * (k / 8) + 4 * col + k % 4];
    return k % 8 < 4 ? byte & 0x0f : byte >> 4;
}

static inline float record_d(const uint8_t *rec, int64_t record, int col) {
    uint16_t h;
    memcpy(&h, rec + (record == INT8_RECORD ? 256 : 128) + 2 * col, 2);
    return fp16_to_float(h);
}

static inline float record_m(const uint8_t *rec, int64_t record, int col) {
    if (record == INT4_SYM_RECORD) return record_d(rec, record, col) * -8.0f;
    uint16_t h;
    memcpy(&h, rec + (record == INT8_RECORD ? 272 : 144) + 2 * col, 2);
    return fp16_to_float(h);
}

// ---- activations ------------------------------------------------------------------------------

// The kernels' view of x [rows, k] (row stride x_stride floats), per row and 32-block:
// q = round(x / da) in [-32767, 32767] as its high byte (hi, signed) and low byte (lo, unsigned),
// da, sa = da * sum(q) (for the weights' min term) and l8 = 8 * sum(lo) (for the kernel's signed
// low-byte weights), q itself as floats (qf, for the AVX2 many-row path), and q as int16 pairs in
// the VNNI path's order (q2: pair 4c + j of a block is q[8c + j], q[8c + 4 + j], the two nibbles
// of one packed weight byte), and per half block (16) sum(q) and sum(lo) (s16, l16: the offsets
// of the GGUF block formats, gguf_blocks.h). Columns k..kp (padding to a whole block) are 0.
typedef struct {
    int8_t *hi;
    uint8_t *lo;
    float *da, *sa;
    int32_t *l8;
    float *qf;
    int16_t *q2;
    int32_t *s16, *l16;
} act16;

static act16 act16_at(void *buf, int64_t rows, int64_t kp) {
    const int64_t nb = kp / QBLOCK;
    act16 a;
    a.hi = buf;
    a.lo = (uint8_t *)(a.hi + rows * kp);
    a.da = (float *)(a.lo + rows * kp);
    a.sa = a.da + rows * nb;
    a.l8 = (int32_t *)(a.sa + rows * nb);
    a.qf = (float *)(a.l8 + rows * nb);
    a.q2 = (int16_t *)(a.qf + rows * kp);
    a.s16 = (int32_t *)(a.q2 + rows * kp);
    a.l16 = a.s16 + rows * (kp / 16);
    return a;
}

// Scratch bytes for the activations of a linear of `rows` rows.
int64_t act16_bytes(int64_t rows, int64_t kp) { return rows * kp * 8 + rows * (kp / QBLOCK) * 12 + rows * kp / 2; }

#ifdef QL_AVX2
// One whole block, 8 lanes at a time: the same values as the scalar loop below (cvtps rounds to
// nearest even, as nearbyintf does), only faster: at 512 rows the scalar loop took a quarter as
// long as the GEMM it fed.
static inline void act16_block(const float *x, act16 a, int64_t at, int64_t rb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    const __m256i lim = _mm256_set1_epi32(32767), nlim = _mm256_set1_epi32(-32767), ff = _mm256_set1_epi32(0xff);
    __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, lows[2] = {sum[0], sum[0]};
    for (int i = 0; i < 4; i++) {
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        q = _mm256_max_epi32(_mm256_min_epi32(q, lim), nlim);
        const __m256i lo = _mm256_and_si256(q, ff);
        sum[i / 2] = _mm256_add_epi32(sum[i / 2], q);
        lows[i / 2] = _mm256_add_epi32(lows[i / 2], lo);
        _mm256_storeu_ps(a.qf + at + 8 * i, _mm256_cvtepi32_ps(q));
        const __m128i pairs = _mm_or_si128(  // (q[j], q[4 + j]) as int16 pairs: the nibbles' order
            _mm_and_si128(_mm256_castsi256_si128(q), _mm_set1_epi32(0xffff)),
            _mm_slli_epi32(_mm256_extracti128_si256(q, 1), 16));
        _mm_storeu_si128((__m128i *)(a.q2 + at + 8 * i), pairs);
        int32_t qs[8], ls[8];
        _mm256_storeu_si256((__m256i *)qs, _mm256_srai_epi32(q, 8));
        _mm256_storeu_si256((__m256i *)ls, lo);
        for (int j = 0; j < 8; j++) {
            a.hi[at + 8 * i + j] = (int8_t)qs[j];
            a.lo[at + 8 * i + j] = (uint8_t)ls[j];
        }
    }
    int32_t total = 0, low_total = 0;
    for (int h = 0; h < 2; h++) {  // the halves' sums, then the block's
        int32_t s8[8], l8[8], half = 0, low_half = 0;
        _mm256_storeu_si256((__m256i *)s8, sum[h]);
        _mm256_storeu_si256((__m256i *)l8, lows[h]);
        for (int j = 0; j < 8; j++) half += s8[j], low_half += l8[j];
        a.s16[2 * rb + h] = half;
        a.l16[2 * rb + h] = low_half;
        total += half, low_total += low_half;
    }
    a.da[rb] = d;
    a.sa[rb] = d * (float)total;
    a.l8[rb] = 8 * low_total;
}
#endif

void quantize_act16(const float *x, int64_t x_stride, int64_t rows, int64_t k, int64_t kp, void *buf,
                    int num_threads) {
    const int64_t nb = kp / QBLOCK;
    const act16 a = act16_at(buf, rows, kp);
#pragma omp parallel for num_threads(num_threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * QBLOCK, n = k - k0 < QBLOCK ? (k - k0 > 0 ? k - k0 : 0) : QBLOCK;
#ifdef QL_AVX2
            if (n == QBLOCK) {
                act16_block(xr + k0, a, r * kp + k0, r * nb + b);
                continue;
            }
#endif
            float amax = 0.0f;
            for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(xr[k0 + i]));
            const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int32_t sum = 0, lows = 0;
            for (int64_t i = 0; i < QBLOCK; i++) {
                int32_t v = i < n ? (int32_t)nearbyintf(xr[k0 + i] * inv) : 0;
                v = v > 32767 ? 32767 : v < -32767 ? -32767 : v;
                a.hi[r * kp + k0 + i] = (int8_t)(v >> 8);  // arithmetic: v = 256 hi + lo
                a.lo[r * kp + k0 + i] = (uint8_t)(v & 0xff);
                a.qf[r * kp + k0 + i] = (float)v;
                a.q2[r * kp + k0 + (i / 8) * 8 + (i % 4) * 2 + (i % 8) / 4] = (int16_t)v;
                sum += v;
                lows += v & 0xff;
                if (i == 15) a.s16[2 * (r * nb + b)] = sum, a.l16[2 * (r * nb + b)] = lows;
            }
            a.s16[2 * (r * nb + b) + 1] = sum - a.s16[2 * (r * nb + b)];
            a.l16[2 * (r * nb + b) + 1] = lows - a.l16[2 * (r * nb + b)];
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
// The record PREFETCH bytes ahead (a record spans three cache lines at most).
static inline void prefetch_record(const uint8_t *w) {
    _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
    _mm_prefetch((const char *)(w + PREFETCH + 128), _MM_HINT_T0);
}

static inline __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// The 8 columns' m of an int4 record: stored, or -8 d.
static inline __m256 int4_min(const uint8_t *rec, __m256 d, int64_t record) {
    if (record == INT4_SYM_RECORD) return _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 144)));
}

static inline __attribute__((always_inline)) void int4_tile(
        const uint8_t *w, int64_t record, int64_t nb, act16 a, int64_t kp, float *out, int64_t ldo,
        const int nrows) {
    const __m256i low = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
    const __m256i ones = _mm256_set1_epi16(1), x256 = _mm256_set1_epi16(256);
    __m256 acc[INT4_ROWS];
    for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += record) {
        prefetch_record(w);
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
        const __m256 m = int4_min(w, d, record);
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

// ---- int8 on AVX2 ---------------------------------------------------------------------------
//
// Pairs of int16 as VNNI takes them: (w, q) of k = 8c + j and 8c + 4 + j in one int32 lane per
// column, the order of act16's q2; madd multiplies a pair and adds it in int32 (|w q| <= 127 *
// 32767, 32 of them stay below 2^28), so each block's dot is the exact integer.

// Pair p = 4c + j of an int8 record's block, for its 8 columns (lane = column).
static inline __m256i int8_pairs(const uint8_t *rec, int p) {
    const int k = 8 * (p / 4) + p % 4;
    const __m128i lo = _mm_loadl_epi64((const __m128i *)(rec + 8 * k));
    const __m128i hi = _mm_loadl_epi64((const __m128i *)(rec + 8 * (k + 4)));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi));
}

static inline __attribute__((always_inline)) void int8_tile(
        const uint8_t *w, int64_t nb, act16 a, int64_t kp, float *out, int64_t ldo, const int nrows) {
    __m256 acc[INT8_ROWS];
    for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += INT8_RECORD) {
        for (int i = 0; i < INT8_RECORD; i += 64) _mm_prefetch((const char *)(w + PREFETCH + i), _MM_HINT_T0);
        __m256i dot[INT8_ROWS][2];  // even and odd pairs: two chains
        for (int r = 0; r < nrows; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int p = 0; p < 16; p++) {
            const __m256i wp = int8_pairs(w, p);
            for (int r = 0; r < nrows; r++)
                dot[r][p & 1] = _mm256_add_epi32(dot[r][p & 1], _mm256_madd_epi16(wp, bcast4(a.q2 + r * kp + b * QBLOCK + 2 * p)));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 256)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 272)));
        for (int r = 0; r < nrows; r++) {
            const int64_t rb = r * nb + b;
            const __m256i sum = _mm256_add_epi32(dot[r][0], dot[r][1]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(a.da[rb])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sa[rb]), acc[r]);
        }
    }
    for (int r = 0; r < nrows; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#else
// Without AVX2, either record, value by value: the same integer and float operations.
static void portable_tile(const uint8_t *w, int64_t record, int64_t nb, act16 a, int64_t kp, float *out,
                          int64_t ldo, const int nrows) {
    for (int r = 0; r < nrows; r++) {
        float acc[TILE] = {0};
        const uint8_t *rec = w;
        for (int64_t b = 0; b < nb; b++, rec += record) {
            const int64_t at = r * kp + b * QBLOCK, rb = r * nb + b;
            for (int col = 0; col < TILE; col++) {
                int32_t dot = 0;
                for (int k = 0; k < QBLOCK; k++) dot += record_q(rec, record, col, k) * (256 * a.hi[at + k] + a.lo[at + k]);
                acc[col] = fmaf((float)dot, record_d(rec, record, col) * a.da[rb], acc[col]);
                acc[col] = fmaf(record_m(rec, record, col), a.sa[rb], acc[col]);
            }
        }
        memcpy(out + r * ldo, acc, sizeof(acc));
    }
}
#endif

// With many rows int4's sums go through the FMA ports instead (maddubs has one port on Zen 3,
// FMA two): a group of column tiles is widened once to floats, then every row runs against it.
// The weights widen to 0..15 and q is taken as floats: a block's sum of at most 32 products
// |15 * 32767| stays below 2^24, so it is the exact integer whatever the order, and bit-identical
// to the maddubs path's; so is everything after it.
#define FMA_ROWS 6  // rows x FMA_TILES tiles of 8 columns: 12 accumulators, 12 FMA chains
#define FMA_TILES 2
#define INT4_FMA_MIN_ROWS 16  // int4 batches from this size take the FMA path

#ifdef QL_AVX2
// wf [kp][ntiles][8]: the int4 tiles' q as floats, k-major, the group's tiles side by side.
static void widen_tiles(const uint8_t *w, int64_t record, int64_t nb, int ntiles, float *wf) {
    const int64_t stride = ntiles * TILE;
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int t = 0; t < ntiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = w + (t * nb + b) * record;
            float *o = wf + b * QBLOCK * stride + t * TILE;
            for (int c = 0; c < 4; c++) {  // lane col holds bytes j of k = 8c + j and 8c + 4 + j
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 32 * c));
                for (int j = 0; j < 4; j++) {
                    const __m256i byte = _mm256_srli_epi32(v, 8 * j);
                    _mm256_storeu_ps(o + (8 * c + j) * stride, _mm256_cvtepi32_ps(_mm256_and_si256(byte, low)));
                    _mm256_storeu_ps(o + (8 * c + 4 + j) * stride,
                                     _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(byte, 4), low)));
                }
            }
        }
}

// Rows [0, nrows) of a (row-major, row stride a_stride) against ntiles widened tiles. Per block
// and output: part = sum_k w q; out = part * d * s1 + m * s2 + out, with s1 = da, s2 = sa. out is
// the accumulator between blocks.
static inline __attribute__((always_inline)) void fma_tile(
        const float *wf, const uint8_t *const *rec, int64_t record, int64_t nb, const float *a,
        int64_t a_stride, const float *s1, const float *s2, float *out, int64_t ldo, const int nrows,
        const int ntiles) {
    const int64_t stride = ntiles * TILE;
    for (int64_t b = 0; b < nb; b++) {
        __m256 part[FMA_ROWS][FMA_TILES];
        for (int r = 0; r < nrows; r++)
            for (int t = 0; t < ntiles; t++) part[r][t] = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int k = 0; k < QBLOCK; k++) {
            __m256 wk[FMA_TILES];
            for (int t = 0; t < ntiles; t++) wk[t] = _mm256_loadu_ps(wf + (b * QBLOCK + k) * stride + t * TILE);
            for (int r = 0; r < nrows; r++) {
                const __m256 x = _mm256_broadcast_ss(a + r * a_stride + b * QBLOCK + k);
                for (int t = 0; t < ntiles; t++) part[r][t] = _mm256_fmadd_ps(wk[t], x, part[r][t]);
            }
        }
        for (int t = 0; t < ntiles; t++) {
            const uint8_t *rt = rec[t] + b * record;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rt + 128)));
            const __m256 m = int4_min(rt, d, record);
            for (int r = 0; r < nrows; r++) {
                float *o = out + r * ldo + t * TILE;
                __m256 acc = b ? _mm256_loadu_ps(o) : _mm256_setzero_ps();
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(s1[r * nb + b]));
                acc = _mm256_fmadd_ps(part[r][t], scale, acc);
                acc = _mm256_fmadd_ps(m, _mm256_set1_ps(s2[r * nb + b]), acc);
                _mm256_storeu_ps(o, acc);
            }
        }
    }
}

static void fma_rows(const float *wf, const uint8_t *const *rec, int64_t record, int64_t nb, const float *a,
                     int64_t a_stride, const float *s1, const float *s2, float *out, int64_t ldo, int nrows,
                     int ntiles) {
#define FMA_CASE(R)                                                                                  \
    case R:                                                                                          \
        if (ntiles == 2)                                                                             \
            fma_tile(wf, rec, record, nb, a, a_stride, s1, s2, out, ldo, R, 2);                      \
        else                                                                                         \
            fma_tile(wf, rec, record, nb, a, a_stride, s1, s2, out, ldo, R, 1);                      \
        break;
    switch (nrows) {  // constant shapes: registers, unrolled loops
        FMA_CASE(6) FMA_CASE(5) FMA_CASE(4) FMA_CASE(3) FMA_CASE(2)
        default: FMA_CASE(1)
    }
#undef FMA_CASE
}

// out [m, ldo] columns [0, n) for int4 W of records `record` through widened tile groups: each thread
// widens a group, then runs every row against it. Returns 0, or -1 without the memory (nothing
// written).
static int fma_linear(int64_t record, const uint8_t *w, int64_t n, int64_t kp, const float *a,
                      int64_t a_stride, const float *s1, const float *s2, int64_t m, float *out, int64_t ldo,
                      int num_threads) {
    const int64_t nb = kp / QBLOCK, tiles = n / TILE, groups = (tiles + FMA_TILES - 1) / FMA_TILES;
    float *widened = malloc(sizeof(float) * kp * TILE * FMA_TILES * num_threads);
    if (!widened) return -1;
    // Rows in chunks whose activations stay in L2 while all of a thread's tile groups pass them
    // (re-reading every row from L3 for every group halved the speed at 512 rows).
    int64_t chunk = (256 << 10) / (kp * 4);
    chunk = chunk < 24 ? 24 : chunk / FMA_ROWS * FMA_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        float *wf = widened + omp_get_thread_num() * kp * TILE * FMA_TILES;
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            // static: each thread gets the same groups in every chunk, so no chunk waits for another
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const int ntiles = tiles - g * FMA_TILES < FMA_TILES ? (int)(tiles - g * FMA_TILES) : FMA_TILES;
                const uint8_t *rec[FMA_TILES];
                for (int t = 0; t < ntiles; t++) rec[t] = w + (g * FMA_TILES + t) * nb * record;
                widen_tiles(rec[0], record, nb, ntiles, wf);
                for (int64_t r = m0; r < m1; r += FMA_ROWS) {
                    const int nr = m1 - r < FMA_ROWS ? (int)(m1 - r) : FMA_ROWS;
                    fma_rows(wf, rec, record, nb, a + r * a_stride, a_stride, s1 + r * nb,
                             s2 + r * nb, out + r * ldo + g * FMA_TILES * TILE, ldo, nr, ntiles);
                }
            }
        }
    }
    free(widened);
    return 0;
}
// ---- int16 pairs, widened ---------------------------------------------------------------------
//
// For many rows, a group of PAIR_TILES column tiles (32 columns) is widened once into int16
// pairs, lane = column: pair 4c + j of a block holds q of k = 8c + j and 8c + 4 + j (for int4 the
// low and high nibble of byte 32c + 4 col + j), matching act16's q2. Then every row runs against
// it: on AVX2 by madd (int8 weights: their sums pass 2^24, so the FMA path cannot take them), on
// VNNI by vpdpwssd (both kinds).
#define PAIR_TILES 4
#define PAIR_COLS (PAIR_TILES * TILE)
#define PAIR_ROWS 2  // AVX2: rows x 4 registers of int32 sums
#define INT8_PAIR_MIN_ROWS 2  // int8 from 2 rows widens a group once (1B head: 2x at 4-16 rows)

// A group's tile past its last: zeros in its 16 pair rows and dm_rows scale rows (its lanes are
// never stored).
static inline void zero_pair_tile(int32_t *o, float *d, int dm_rows) {
    for (int p = 0; p < 16; p++) _mm256_storeu_si256((__m256i *)(o + p * PAIR_COLS), _mm256_setzero_si256());
    for (int i = 0; i < dm_rows; i++) _mm256_storeu_ps(d + i * PAIR_COLS, _mm256_setzero_ps());
}

// wq [nb][16][32] int32 (pairs, lane = column), dm [nb][2][32] float (d, then m, per column).
static void widen_pairs(const uint8_t *w, int64_t record, int64_t nb, int ntiles, int32_t *wq, float *dm) {
    const __m256i low = _mm256_set1_epi32(0x0f), high = _mm256_set1_epi32(0x0f0000);
    for (int64_t b = 0; b < nb; b++)
        for (int t = 0; t < PAIR_TILES; t++) {
            int32_t *o = wq + b * 16 * PAIR_COLS + t * TILE;
            float *d = dm + b * 2 * PAIR_COLS + t * TILE;
            if (t >= ntiles) {
                zero_pair_tile(o, d, 2);
                continue;
            }
            const uint8_t *rec = w + (t * nb + b) * record;
            if (record == INT8_RECORD) {
                for (int p = 0; p < 16; p++) _mm256_storeu_si256((__m256i *)(o + p * PAIR_COLS), int8_pairs(rec, p));
                _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256))));
                _mm256_storeu_ps(d + PAIR_COLS, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 272))));
                continue;
            }
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 32 * c));
                for (int j = 0; j < 4; j++) {
                    const __m256i byte = _mm256_srli_epi32(v, 8 * j);
                    const __m256i pair = _mm256_or_si256(_mm256_and_si256(byte, low),
                                                         _mm256_and_si256(_mm256_slli_epi32(byte, 12), high));
                    _mm256_storeu_si256((__m256i *)(o + (4 * c + j) * PAIR_COLS), pair);
                }
            }
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 128)));
            _mm256_storeu_ps(d, scale);
            _mm256_storeu_ps(d + PAIR_COLS, int4_min(rec, scale, record));
        }
}

static inline __attribute__((always_inline)) void pair_tile(
        const int32_t *wq, const float *dm, int64_t nb, const int16_t *q2, int64_t kp, const float *da,
        const float *sa, float *out, int64_t ldo, int cols, const int nrows) {
    float acc[PAIR_ROWS][PAIR_COLS] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(acc));
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[PAIR_ROWS][4];
        for (int r = 0; r < nrows; r++)
            for (int i = 0; i < 4; i++) dot[r][i] = _mm256_setzero_si256();
        const int32_t *wb = wq + b * 16 * PAIR_COLS;
#pragma GCC unroll 2
        for (int p = 0; p < 16; p++) {
            __m256i wp[4];
            for (int i = 0; i < 4; i++) wp[i] = _mm256_loadu_si256((const __m256i *)(wb + p * PAIR_COLS + 8 * i));
            for (int r = 0; r < nrows; r++) {
                const __m256i x = bcast4(q2 + r * kp + b * QBLOCK + 2 * p);
                for (int i = 0; i < 4; i++) dot[r][i] = _mm256_add_epi32(dot[r][i], _mm256_madd_epi16(wp[i], x));
            }
        }
        const float *db = dm + b * 2 * PAIR_COLS;
        for (int r = 0; r < nrows; r++) {
            const __m256 s1 = _mm256_set1_ps(da[r * nb + b]), s2 = _mm256_set1_ps(sa[r * nb + b]);
            for (int i = 0; i < 4; i++) {
                const __m256 d = _mm256_loadu_ps(db + 8 * i), m = _mm256_loadu_ps(db + PAIR_COLS + 8 * i);
                __m256 x = _mm256_load_ps(acc[r] + 8 * i);
                x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][i]), _mm256_mul_ps(d, s1), x);
                _mm256_store_ps(acc[r] + 8 * i, _mm256_fmadd_ps(m, s2, x));
            }
        }
    }
    for (int r = 0; r < nrows; r++) memcpy(out + r * ldo, acc[r], sizeof(float) * cols);
}

// A path's widened groups: `widen` fills a thread's wq and dm from a group of ntiles tiles of
// format `record` at w, then `rows` runs `step` rows (or the last few) against them.
typedef void (*widen_fn)(const uint8_t *w, int64_t record, int64_t nb, int ntiles, int32_t *wq, float *dm);
typedef void (*pair_rows_fn)(int64_t record, const int32_t *wq, const float *dm, int64_t nb, const int16_t *q2,
                             int64_t kp, const float *da, const float *sa, float *out, int64_t ldo, int cols,
                             int nrows);
typedef struct {
    widen_fn widen;
    pair_rows_fn rows;
    int step;
    int dm_rows;  // floats per block and column after the pairs (d and m)
    int64_t chunk_bytes;  // activations per chunk of rows: the chunk stays cached while the groups pass it
} pair_kernel;

int64_t quant_tile_bytes(int64_t format, int64_t kp);

static void avx2_pair_rows(int64_t record, const int32_t *wq, const float *dm, int64_t nb, const int16_t *q2,
                           int64_t kp, const float *da, const float *sa, float *out, int64_t ldo, int cols,
                           int nrows) {
    (void)record;
    if (nrows == 2)  // constant shapes: registers
        pair_tile(wq, dm, nb, q2, kp, da, sa, out, ldo, cols, 2);
    else
        pair_tile(wq, dm, nb, q2, kp, da, sa, out, ldo, cols, 1);
}

// out [m, ldo] columns [0, n) for W of format `record`, as quant_gemm: each thread widens a tile
// group, then runs every `step` rows against it, by `pk`. Returns 0, or -1 without the memory
// (nothing written).
static int pairs_linear(const pair_kernel *pk, const uint8_t *w, int64_t record, int64_t n, int64_t kp, act16 a,
                        int64_t m, float *out, int64_t ldo, int num_threads) {
    const int64_t nb = kp / QBLOCK, tiles = n / TILE, groups = (tiles + PAIR_TILES - 1) / PAIR_TILES;
    const int64_t per_thread = nb * (16 + pk->dm_rows) * PAIR_COLS, tile_bytes = quant_tile_bytes(record, kp);
    const int step = pk->step;
    int32_t *widened = aligned_alloc(64, sizeof(int32_t) * per_thread * num_threads);
    if (!widened) return -1;
    int64_t chunk = pk->chunk_bytes / (kp * 2);
    chunk = chunk < 16 ? 16 : chunk / step * step;
#pragma omp parallel num_threads(num_threads) if (groups > 1)
    {
        int32_t *wq = widened + omp_get_thread_num() * per_thread;
        float *dm = (float *)(wq + nb * 16 * PAIR_COLS);
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            // static: each thread gets the same groups in every chunk, so no chunk waits for another
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const int ntiles = tiles - g * PAIR_TILES < PAIR_TILES ? (int)(tiles - g * PAIR_TILES) : PAIR_TILES;
                pk->widen(w + g * PAIR_TILES * tile_bytes, record, nb, ntiles, wq, dm);
                for (int64_t r = m0; r < m1; r += step) {
                    const int nr = m1 - r < step ? (int)(m1 - r) : step;
                    pk->rows(record, wq, dm, nb, a.q2 + r * kp, kp, a.da + r * nb, a.sa + r * nb,
                             out + r * ldo + g * PAIR_COLS, ldo, ntiles * TILE, nr);
                }
            }
        }
    }
    free(widened);
    return 0;
}
#endif

// ---- AVX-512 VNNI ------------------------------------------------------------------------------
//
// From 12 rows, a widened group (above): per block, 16 vpdpwssd per 512-bit register give the
// exact integer dot, and the float epilogue is the AVX2 path's, lane for lane.

#ifdef QL_VNNI
#define VNNI_ROWS 4  // rows x 2 registers: 8 int32 sums and 8 float accumulators
#define VNNI_MIN_ROWS 12  // from this many rows widening a group once beats vnni_narrow (measured)

// Rows [0, nrows) (q2 pairs, row stride kp int16) against a widened group; columns outside
// `mask` are not stored.
static inline __attribute__((always_inline)) VNNI_TARGET void vnni_tile(
        const int32_t *wq, const float *dm, int64_t nb, const int16_t *q2, int64_t kp, const float *da,
        const float *sa, float *out, int64_t ldo, __mmask16 mask0, __mmask16 mask1, const int nrows) {
    __m512 acc[VNNI_ROWS][2];
    for (int r = 0; r < nrows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[VNNI_ROWS][2];
        for (int r = 0; r < nrows; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        const int32_t *wb = wq + b * 16 * PAIR_COLS;
#pragma GCC unroll 4
        for (int p = 0; p < 16; p++) {
            const __m512i w0 = _mm512_loadu_si512(wb + p * PAIR_COLS), w1 = _mm512_loadu_si512(wb + p * PAIR_COLS + 16);
            for (int r = 0; r < nrows; r++) {
                int32_t pair;
                memcpy(&pair, q2 + r * kp + b * QBLOCK + 2 * p, 4);
                const __m512i x = _mm512_set1_epi32(pair);
                dot[r][0] = _mm512_dpwssd_epi32(dot[r][0], w0, x);
                dot[r][1] = _mm512_dpwssd_epi32(dot[r][1], w1, x);
            }
        }
        const float *db = dm + b * 2 * PAIR_COLS;
        const __m512 d0 = _mm512_loadu_ps(db), d1 = _mm512_loadu_ps(db + 16);
        const __m512 m0 = _mm512_loadu_ps(db + PAIR_COLS), m1 = _mm512_loadu_ps(db + PAIR_COLS + 16);
        for (int r = 0; r < nrows; r++) {
            const __m512 s1 = _mm512_set1_ps(da[r * nb + b]), s2 = _mm512_set1_ps(sa[r * nb + b]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(d0, s1), acc[r][0]);
            acc[r][0] = _mm512_fmadd_ps(m0, s2, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(d1, s1), acc[r][1]);
            acc[r][1] = _mm512_fmadd_ps(m1, s2, acc[r][1]);
        }
    }
    for (int r = 0; r < nrows; r++) {
        _mm512_mask_storeu_ps(out + r * ldo, mask0, acc[r][0]);
        _mm512_mask_storeu_ps(out + r * ldo + 16, mask1, acc[r][1]);
    }
}

static VNNI_TARGET void vnni_rows(int64_t record, const int32_t *wq, const float *dm, int64_t nb, const int16_t *q2,
                                  int64_t kp, const float *da, const float *sa, float *out, int64_t ldo, int cols,
                                  int nrows) {
    (void)record;
    const __mmask16 mask0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 mask1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    switch (nrows) {  // constant shapes: registers, unrolled loops
    case 4: vnni_tile(wq, dm, nb, q2, kp, da, sa, out, ldo, mask0, mask1, 4); break;
    case 3: vnni_tile(wq, dm, nb, q2, kp, da, sa, out, ldo, mask0, mask1, 3); break;
    case 2: vnni_tile(wq, dm, nb, q2, kp, da, sa, out, ldo, mask0, mask1, 2); break;
    default: vnni_tile(wq, dm, nb, q2, kp, da, sa, out, ldo, mask0, mask1, 1); break;
    }
}

// Few rows: no widening (below 12 rows it cost more than it saved: 1B-shape linears, Zen 4).
// The AVX2 path's tile loop, with its split on 256-bit vpdpbusd: 256 sum(w hi) + sum(lo (w - 8))
// + 8 sum(lo), summed in int32 (no int16 sums to saturate). One tile at a time, as the AVX2
// path reads them: at one row the weights stream from memory, and two tiles read side by side
// (two short streams per thread) ran at a third of the speed.
#define VNNI_NARROW_ROWS 4

static inline __attribute__((always_inline)) VNNI_TARGET void vnni_narrow_tile(
        const uint8_t *w, int64_t record, int64_t nb, act16 a, int64_t kp, float *out, int64_t ldo,
        const int nrows) {
    const __m256i low = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
    __m256 acc[VNNI_NARROW_ROWS];
    for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += record) {
        prefetch_record(w);
        // Two sums of each kind per row (even and odd c): one chain of eight dependent vpdpbusd
        // per block would set the pace at one row.
        __m256i hsum[VNNI_NARROW_ROWS][2], lsum[VNNI_NARROW_ROWS][2];
        for (int r = 0; r < nrows; r++) hsum[r][0] = hsum[r][1] = lsum[r][0] = lsum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * c));
            const __m256i q0 = _mm256_and_si256(v, low), q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i s0 = _mm256_sub_epi8(q0, eight), s1 = _mm256_sub_epi8(q1, eight);
            for (int r = 0; r < nrows; r++) {
                const int64_t at = r * kp + b * QBLOCK + 8 * c;
                __m256i *h = &hsum[r][c & 1], *l = &lsum[r][c & 1];
                *h = _mm256_dpbusd_epi32(*h, q0, bcast4(a.hi + at));
                *h = _mm256_dpbusd_epi32(*h, q1, bcast4(a.hi + at + 4));
                *l = _mm256_dpbusd_epi32(*l, bcast4(a.lo + at), s0);
                *l = _mm256_dpbusd_epi32(*l, bcast4(a.lo + at + 4), s1);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 128)));
        const __m256 m = int4_min(w, d, record);
        for (int r = 0; r < nrows; r++) {
            const int64_t rb = r * nb + b;
            const __m256i h = _mm256_add_epi32(hsum[r][0], hsum[r][1]), l = _mm256_add_epi32(lsum[r][0], lsum[r][1]);
            const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(h, 8), l),
                                                 _mm256_set1_epi32(a.l8[rb]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.da[rb])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sa[rb]), acc[r]);
        }
    }
    for (int r = 0; r < nrows; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

static VNNI_TARGET void vnni_narrow_linear(const uint8_t *w, int64_t record, int64_t n, int64_t kp, act16 all,
                                           int64_t m, float *out, int64_t ldo, int num_threads) {
    const int64_t nb = kp / QBLOCK, tiles = n / TILE;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tiles * m >= 64)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *wt = w + t * nb * record;
        for (int64_t r = 0; r < m; r += VNNI_NARROW_ROWS) {
            const act16 a = {all.hi + r * kp, all.lo + r * kp, all.da + r * nb, all.sa + r * nb,
                             all.l8 + r * nb, NULL, NULL};
            float *o = out + r * ldo + t * TILE;
            switch (m - r < VNNI_NARROW_ROWS ? m - r : VNNI_NARROW_ROWS) {  // constant shapes: registers
            case 4: vnni_narrow_tile(wt, record, nb, a, kp, o, ldo, 4); break;
            case 3: vnni_narrow_tile(wt, record, nb, a, kp, o, ldo, 3); break;
            case 2: vnni_narrow_tile(wt, record, nb, a, kp, o, ldo, 2); break;
            default: vnni_narrow_tile(wt, record, nb, a, kp, o, ldo, 1); break;
            }
        }
    }
}

#endif

// ---- AMX ----------------------------------------------------------------------------------------
//
// The tile unit multiplies a 16 x 64-byte A tile by a B tile of 16 columns (each row of B holds
// 4 consecutive k of every column) into 16 x 16 int32, in one instruction for each of the four
// sign combinations. A block's 32 k are one product of depth 32, so each block's dot stays its
// own integer (its scales differ from the next block's). The 16-bit activations are two byte
// tiles that already lie in act16: hi (signed, row stride kp) and lo (unsigned). Per block and 16
// columns: C_hi = hi . w (tdpbssd), C_lo = lo . w (tdpbusd); dot = 256 C_hi + C_lo = sum_k q_k w_k,
// the integer of every other path (|C_hi| < 2^20, |C_lo| < 2^21), then the float epilogue of the
// VNNI path, lane for lane. Tiles: 0, 1 A (hi, lo); 2, 3 B (columns 0-15, 16-31 of the group);
// 4-7 C (hi and lo of each B).
//
// With QL_AMX_EMULATE the tile instructions are C loops over a thread's software tiles, checking
// the shapes as the hardware would fault on them: the tests run the path's packing, tile shapes
// and epilogue on CPUs without AMX (this file's AMX path was written on one).

#ifdef QL_AMX
#define AMX_ROWS 16
#define AMX_COLS 32  // columns per group: two B tiles of 16
#define AMX_MIN_ROWS 16  // one full A tile (fewer rows run the VNNI path)
// A group's bytes per block: two B tiles of 8 rows x 64 bytes, then d and m of its 32 columns.
#define AMX_B_BYTES 512
#define AMX_BLOCK_BYTES (2 * AMX_B_BYTES + 2 * AMX_COLS * 4)

typedef struct {  // the 64 bytes ldtilecfg reads (palette 1)
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#ifdef QL_AMX_EMULATE
static _Thread_local struct {
    tile_config cfg;
    uint8_t tile[8][16][64];
} emu;

static void emu_check(int ok) {
    if (!ok) abort();  // where the hardware would fault (#UD): a wrong shape is a bug, not a result
}

static void emu_load(int t, const void *p, int64_t stride) {
    emu_check(emu.cfg.palette == 1 && emu.cfg.rows[t] && emu.cfg.colsb[t] <= 64);
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy(emu.tile[t][r], (const uint8_t *)p + r * stride, emu.cfg.colsb[t]);
}

static void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy((uint8_t *)p + r * stride, emu.tile[t][r], emu.cfg.colsb[t]);
}

// C[m][n] += sum over k (colsb(A) / 4 groups of 4 bytes) of A[m][4k + i] * B[k][4n + i], B signed.
static void emu_dot(int c, int a, int b, int a_signed) {
    const tile_config *g = &emu.cfg;
    emu_check(g->rows[c] == g->rows[a] && g->colsb[a] / 4 == g->rows[b] && g->colsb[b] == g->colsb[c]);
    for (int m = 0; m < g->rows[c]; m++)
        for (int n = 0; n < g->colsb[c] / 4; n++) {
            int32_t sum;
            memcpy(&sum, &emu.tile[c][m][4 * n], 4);
            for (int k = 0; k < g->colsb[a]; k++) {
                const int32_t x = a_signed ? (int8_t)emu.tile[a][m][k] : emu.tile[a][m][k];
                sum += x * (int8_t)emu.tile[b][k / 4][4 * n + k % 4];
            }
            memcpy(&emu.tile[c][m][4 * n], &sum, 4);
        }
}
#define TILE_CONFIG(config) memcpy(&emu.cfg, config, sizeof(tile_config))
#define TILE_RELEASE() memset(&emu.cfg, 0, sizeof(tile_config))
#define TILE_LOAD(t, p, stride) emu_load(t, p, stride)
#define TILE_STORE(t, p, stride) emu_store(t, p, stride)
#define TILE_ZERO(t) memset(emu.tile[t], 0, sizeof(emu.tile[t]))
#define TILE_DOT_SS(c, a, b) emu_dot(c, a, b, 1)
#define TILE_DOT_US(c, a, b) emu_dot(c, a, b, 0)
#else
#define TILE_CONFIG(config) _tile_loadconfig(config)
#define TILE_RELEASE() _tile_release()
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DOT_SS(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_DOT_US(c, a, b) _tile_dpbusd(c, a, b)
#endif

// The shapes for `rows` rows of activations (tile configuration is per thread).
static AMX_TARGET void amx_configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t == 2 || t == 3 ? QBLOCK / 4 : (uint8_t)rows;
        cfg.colsb[t] = t < 2 ? QBLOCK : 64;
    }
    TILE_CONFIG(&cfg);
}

// A group of up to 4 tiles (32 columns) as B tiles, per block: B row i, column n holds its q at
// k = 4i .. 4i + 3. For int4, row 2c is the low nibbles of bytes 32c .. 32c + 31 and row 2c + 1
// their high nibbles (k = 8c + j and 8c + 4 + j); for int8, four 8-byte rows of k interleaved.
static AMX_TARGET void amx_widen(const uint8_t *w, int64_t record, int64_t nb, int ntiles, uint8_t *wb) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *block = wb + b * AMX_BLOCK_BYTES;
        float *d = (float *)(block + 2 * AMX_B_BYTES), *m = d + AMX_COLS;
        for (int t = 0; t < AMX_COLS / TILE; t++) {
            uint8_t *bt = block + (t / 2) * AMX_B_BYTES + (t % 2) * 32;  // row i at bt + 64 i
            if (t >= ntiles) {  // past the last tile: zeros (its columns are never stored)
                for (int i = 0; i < QBLOCK / 4; i++) memset(bt + 64 * i, 0, 32);
                memset(d + t * TILE, 0, 4 * TILE);
                memset(m + t * TILE, 0, 4 * TILE);
                continue;
            }
            const uint8_t *rec = w + (t * nb + b) * record;
            for (int i = 0; i < QBLOCK / 4; i++) {
                __m256i row;
                if (record == INT8_RECORD) {
                    const uint8_t *k4 = rec + 32 * i;  // k = 4i .. 4i + 3, 8 columns each
                    const __m128i k01 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)k4),
                                                          _mm_loadl_epi64((const __m128i *)(k4 + 8)));
                    const __m128i k23 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(k4 + 16)),
                                                          _mm_loadl_epi64((const __m128i *)(k4 + 24)));
                    row = _mm256_set_m128i(_mm_unpackhi_epi16(k01, k23), _mm_unpacklo_epi16(k01, k23));
                } else {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 32 * (i / 2)));
                    row = _mm256_and_si256(i % 2 ? _mm256_srli_epi16(v, 4) : v, low);
                }
                _mm256_storeu_si256((__m256i *)(bt + 64 * i), row);
            }
            for (int col = 0; col < TILE; col++) {
                d[t * TILE + col] = record_d(rec, record, col);
                m[t * TILE + col] = record_m(rec, record, col);
            }
        }
    }
}

// Rows [0, rows) of act16 `a` (at the group's first row) against a widened group, into out;
// columns outside the masks are not stored. The tiles are configured for `rows` rows.
static AMX_TARGET void amx_rows(const uint8_t *wb, int64_t nb, act16 a, int64_t kp, int rows, float *out,
                                int64_t ldo, __mmask16 mask0, __mmask16 mask1) {
    float acc[AMX_ROWS][AMX_COLS] __attribute__((aligned(64)));
    int32_t c[4][AMX_ROWS][16] __attribute__((aligned(64)));  // hi, lo of columns 0-15, then 16-31
    memset(acc, 0, sizeof(acc));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *block = wb + b * AMX_BLOCK_BYTES;
        TILE_LOAD(0, a.hi + b * QBLOCK, kp);
        TILE_LOAD(1, a.lo + b * QBLOCK, kp);
        TILE_LOAD(2, block, 64);
        TILE_LOAD(3, block + AMX_B_BYTES, 64);
        TILE_ZERO(4);
        TILE_ZERO(5);
        TILE_ZERO(6);
        TILE_ZERO(7);
        TILE_DOT_SS(4, 0, 2);
        TILE_DOT_US(5, 1, 2);
        TILE_DOT_SS(6, 0, 3);
        TILE_DOT_US(7, 1, 3);
        TILE_STORE(4, c[0], 64);
        TILE_STORE(5, c[1], 64);
        TILE_STORE(6, c[2], 64);
        TILE_STORE(7, c[3], 64);
        const float *dm = (const float *)(block + 2 * AMX_B_BYTES);
        for (int r = 0; r < rows; r++) {
            const __m512 s1 = _mm512_set1_ps(a.da[r * nb + b]), s2 = _mm512_set1_ps(a.sa[r * nb + b]);
            for (int h = 0; h < 2; h++) {
                const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c[2 * h][r]), 8),
                                                     _mm512_load_si512(c[2 * h + 1][r]));
                const __m512 d = _mm512_loadu_ps(dm + 16 * h), m = _mm512_loadu_ps(dm + AMX_COLS + 16 * h);
                __m512 x = _mm512_load_ps(acc[r] + 16 * h);
                x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, s1), x);
                _mm512_store_ps(acc[r] + 16 * h, _mm512_fmadd_ps(m, s2, x));
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_mask_storeu_ps(out + r * ldo, mask0, _mm512_load_ps(acc[r]));
        _mm512_mask_storeu_ps(out + r * ldo + 16, mask1, _mm512_load_ps(acc[r] + 16));
    }
}

// out [m, ldo] columns [0, n) for W of either kind, as quant_gemm: each thread widens a group of
// 32 columns, then runs every 16 rows against it. Returns 0, or -1 without the memory.
static AMX_TARGET int amx_linear(const uint8_t *w, int64_t record, int64_t n, int64_t kp, act16 all, int64_t m,
                                 float *out, int64_t ldo, int num_threads) {
    const int64_t nb = kp / QBLOCK, tiles = n / TILE, groups = (tiles + AMX_COLS / TILE - 1) / (AMX_COLS / TILE);
    uint8_t *widened = aligned_alloc(64, nb * AMX_BLOCK_BYTES * num_threads);
    if (!widened) return -1;
    // Rows in chunks whose activations stay in L2 while all of a thread's groups pass them.
    int64_t chunk = (256 << 10) / (kp * 2);
    chunk = chunk < AMX_ROWS ? AMX_ROWS : chunk / AMX_ROWS * AMX_ROWS;
#pragma omp parallel num_threads(num_threads) if (groups > 1)
    {
        uint8_t *wb = widened + omp_get_thread_num() * nb * AMX_BLOCK_BYTES;
        int configured = 0;  // the rows the thread's tiles are shaped for
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++) {
                const int ntiles = tiles - 4 * g < 4 ? (int)(tiles - 4 * g) : 4, cols = ntiles * TILE;
                const __mmask16 mask0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
                const __mmask16 mask1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
                amx_widen(w + 4 * g * nb * record, record, nb, ntiles, wb);
                for (int64_t r = m0; r < m1; r += AMX_ROWS) {
                    const int rows = m1 - r < AMX_ROWS ? (int)(m1 - r) : AMX_ROWS;
                    if (rows != configured) amx_configure(configured = rows);
                    const act16 a = {all.hi + r * kp, all.lo + r * kp, all.da + r * nb, all.sa + r * nb,
                                     NULL, NULL, NULL};
                    amx_rows(wb, nb, a, kp, rows, out + r * ldo + g * AMX_COLS, ldo, mask0, mask1);
                }
            }
        }
        if (configured) TILE_RELEASE();
    }
    free(widened);
    return 0;
}
#endif

// ---- the GEMM ---------------------------------------------------------------------------------

#define ROW_CHUNK 64  // rows whose activations stay in cache while every column tile passes them

#include "gguf_blocks.h"

// Bytes of one tile (8 columns) of a weight of format `format` over kp inputs.
int64_t quant_tile_bytes(int64_t format, int64_t kp) {
    return is_block_format(format) ? block_tile_bytes(format, kp) : kp / QBLOCK * format;
}

// The micro-kernel of the path without widening: tiles split among threads, rows in chunks.
static void tile_linear(const uint8_t *w, int64_t record, int64_t n, int64_t kp, act16 all, int64_t m,
                        float *out, int64_t ldo, int num_threads) {
    const int64_t nb = kp / QBLOCK, tiles = n / TILE;
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
        const int64_t m1 = m0 + ROW_CHUNK < m ? m0 + ROW_CHUNK : m;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tiles * (m1 - m0) >= 64)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *wt = w + t * nb * record;
            for (int64_t r = m0; r < m1;) {
                const act16 a = {all.hi + r * kp, all.lo + r * kp, all.da + r * nb, all.sa + r * nb,
                                 all.l8 + r * nb, NULL, all.q2 + r * kp};
                float *o = out + r * ldo + t * TILE;
                const int64_t left = m1 - r;
#ifdef QL_AVX2
                if (record == INT8_RECORD) {
                    switch (left < INT8_ROWS ? left : INT8_ROWS) {  // constant shapes: registers
                    case 4: int8_tile(wt, nb, a, kp, o, ldo, 4); break;
                    case 3: int8_tile(wt, nb, a, kp, o, ldo, 3); break;
                    case 2: int8_tile(wt, nb, a, kp, o, ldo, 2); break;
                    default: int8_tile(wt, nb, a, kp, o, ldo, 1); break;
                    }
                    r += INT8_ROWS;
                } else {
                    if (left >= 2)
                        int4_tile(wt, record, nb, a, kp, o, ldo, 2);
                    else
                        int4_tile(wt, record, nb, a, kp, o, ldo, 1);
                    r += INT4_ROWS;
                }
#else
                portable_tile(wt, record, nb, a, kp, o, ldo, left < INT4_ROWS ? (int)left : INT4_ROWS);
                r += INT4_ROWS;
#endif
            }
        }
    }
}

// out [m, ldo] columns [0, n) = x @ W^T for packed W (records of `record` bytes: int4 with m or
// without, or int8) of n columns (a multiple of 8) and kp inputs, x given as quantize_act16's
// buffer. Each path where it is fastest (see the top of this file); the same bits on all.
void quant_gemm(const uint8_t *w, int64_t record, int64_t n, int64_t kp, void *act, int64_t m, float *out,
                int64_t ldo, int num_threads) {
    const act16 all = act16_at(act, m, kp);
    if (is_block_format(record)) {
        block_linear(record, w, n, kp, all, m, out, ldo, num_threads);
        return;
    }
    const int path = quant_kernel_path();
    (void)path;  // (a build without AVX2 has one path)
    // Each widening path returns -1 without the memory for it: the next one gives the same numbers.
#ifdef QL_AMX
    if (path == QL_PATH_AMX && m >= AMX_MIN_ROWS && amx_linear(w, record, n, kp, all, m, out, ldo, num_threads) == 0)
        return;
#endif
#ifdef QL_VNNI
    if (path >= QL_PATH_VNNI) {
        const int64_t widen_from = record == INT8_RECORD ? INT8_PAIR_MIN_ROWS : VNNI_MIN_ROWS;
        static const pair_kernel vnni = {widen_pairs, vnni_rows, VNNI_ROWS, 2, 256 << 10};
        if (m >= widen_from && pairs_linear(&vnni, w, record, n, kp, all, m, out, ldo, num_threads) == 0)
            return;
        if (record != INT8_RECORD) {
            vnni_narrow_linear(w, record, n, kp, all, m, out, ldo, num_threads);
            return;
        }
    }
#endif
#ifdef QL_AVX2
    if (path == QL_PATH_AVX2 && record != INT8_RECORD && m >= INT4_FMA_MIN_ROWS &&
        fma_linear(record, w, n, kp, all.qf, kp, all.da, all.sa, m, out, ldo, num_threads) == 0)
        return;
    static const pair_kernel avx2_pairs = {widen_pairs, avx2_pair_rows, PAIR_ROWS, 2, 256 << 10};
    if (path == QL_PATH_AVX2 && record == INT8_RECORD && m >= INT8_PAIR_MIN_ROWS &&
        pairs_linear(&avx2_pairs, w, record, n, kp, all, m, out, ldo, num_threads) == 0)
        return;
#endif
    tile_linear(w, record, n, kp, all, m, out, ldo, num_threads);
}

// The linear as the model calls it: x [m, k] (row stride x_stride), each part (fused q|k|v may mix
// kinds) into its columns of out. Parts go in order: a part's padding columns are overwritten by
// the next. `scratch` holds act16_bytes(m, kp) bytes.
void quant_linear_parts(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t kp,
                        int64_t parts, const int64_t *records, const int64_t *weights,
                        const int64_t *n_padded, const int64_t *col_offset, void *scratch,
                        float *out, int64_t ldo, int num_threads) {
    quantize_act16(x, x_stride, m, k, kp, scratch, num_threads);
    for (int64_t p = 0; p < parts; p++)
        quant_gemm((const uint8_t *)(intptr_t)weights[p], records[p], n_padded[p], kp, scratch, m,
                   out + col_offset[p], ldo, num_threads);
}

// ---- rows of W, for embedding lookups and tests ------------------------------------------------

// out [len(ids), k] = the float weights of columns ids (rows of the original [n, k] matrix).
void dequantize_columns(int64_t record, const uint8_t *w, int64_t kp, int64_t k, const int64_t *ids,
                        int64_t count, float *out) {
    if (is_block_format(record)) {
        block_dequantize_columns(record, w, kp, k, ids, count, out);
        return;
    }
    const int64_t nb = kp / QBLOCK;
    for (int64_t i = 0; i < count; i++) {
        const int col = (int)(ids[i] % TILE);
        const uint8_t *rec = w + ids[i] / TILE * nb * record;
        float *o = out + i * k;
        for (int64_t b = 0; b < nb; b++, rec += record) {
            const float d = record_d(rec, record, col), mn = record_m(rec, record, col);
            for (int j = 0; j < QBLOCK && b * QBLOCK + j < k; j++) o[b * QBLOCK + j] = d * (float)record_q(rec, record, col, j) + mn;
        }
    }
}
