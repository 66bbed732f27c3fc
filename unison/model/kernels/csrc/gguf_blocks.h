// GGUF's block formats, run as the file stores them: Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q5_1, IQ4_NL,
// IQ4_XS and MXFP4. Part of quant_linear.c (included there, after its activations and paths).
//
// The weights are the file's blocks, regrouped for the kernel at the same bytes: a tile of 8
// columns and one file block per record (256 k for the K-quants and IQ4_XS, 32 for the others).
// Every column keeps its scales and values as stored; only their order changes.
//
// The value of a weight is exactly llama.cpp's dequantization: per block (32 k; per half block
// of 16 for Q6_K) a float scale s, per block a float min m (0 where the format has none), both
// computed from the stored fields as llama.cpp computes them (d * sc for the K-quants: an fp16
// times a 6- or 8-bit integer, exact in float32; nothing rounded), and an integer u in 0..255
// with a per-format offset o:  w = s * (u - o) + m.
// Against the activations of quant_linear.c (int16 per row and block: x = da * q), a block's
// product is  dot = sum (u - o) q  (an exact integer; per half for Q6_K), then
//   acc = fma(dot, s * da, acc)  (Q6_K: for each half in turn);  acc = fma(m, sa, acc)
// in that order on every path, so a row's result is the same bits on the portable, AVX2 and VNNI
// paths, alone or in any batch. (AMX runs the VNNI path for these formats.)
//
// The integer sums, where q = 256 hi + lo (hi signed, lo unsigned bytes):
//   VNNI: sum u q = 256 dpbusd(u, hi) + dpbusd(lo, u) for u <= 127; where u reaches 255 (the
//         signed formats, o = 128) dpbusd(lo, u - 128) + 128 sum(lo) replaces the second term.
//   AVX2: maddubs pairs, which saturate at 16 bits: u <= 63 fits (|63 * 128 * 2|, 255 * 63 * 2);
//         u up to 255 is split into nibbles, u = 16 uh + ul, each product then fits.
//   both then subtract o * sum(q) (act16's s16, l16 hold the per-half sums of q and of lo).
// Those decode the blocks in registers for every 4 rows; from 8 rows, VNNI widens a group of 4
// tiles once into int16 pairs of u - o and runs every row against it (quant_linear.c's
// pairs_linear, by vpdpwssd: the same integers).
//
// The record of each format (8 columns; fp16 fields are 8 halves, column by column):
//   nibbles (128 bytes per 32-block): byte 32c + 4 col + j holds k = 8c + j (low) and 8c + 4 + j
//     (high), as the int4 records, so a register of 32 bytes is 8 columns x 4 consecutive k;
//   a plane (32 bytes per 32-block): bit i of byte 4 col + j is one bit of k = 4i + j;
//   crumbs (64 bytes per 32-block, two 2-bit planes): bits 2i, 2i + 1 of byte 32 p + 4 col + j are
//     bits 4, 5 of k = 16 p + 4 i + j (Q6_K's high bits: one shift and mask per register);
//   Q4_K  1152: d, dmin (fp16), the 12 scale bytes of each column as 3 words (word w of column
//         col at 32 + 32 w + 4 col), then 8 blocks of nibbles.               u = q, o = 0, m
//   Q5_K  1408: Q4_K's 128 header bytes, then 8 blocks of nibbles and the bit-4 plane.
//   Q6_K  1680: d, the 16 int8 scales of each column (scale i of column col at 16 + 8 i + col),
//         then 8 blocks of nibbles and crumbs.                                u = q, o = 32
//   Q8_0   272: d, then 8 groups of 32 bytes: byte 32 i + 4 col + j holds k = 4 i + j.  o = 128
//   Q5_0   176: d, bit-4 plane, nibbles.                                      o = 16
//   Q5_1   192: d, m (fp16), bit-4 plane, nibbles.                             o = 0, m
//   IQ4_NL 144: d, nibbles (an index into llama.cpp's 16 values).            u = value + 128
//   IQ4_XS 1088: d, scales_h (16 bits), scales_l (4 bytes), then 8 blocks of nibbles.
//   MXFP4  136: e (an e8m0 byte per column: s = 2^(e - 128), llama.cpp's half scale), nibbles (an
//         index into e2m1's 16 values, doubled: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives).
//                                                                              u = value + 128

#define GGUF_FORMAT_BASE 4096  // a format code is 4096 + the GGML type id
enum { GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
       GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_MXFP4 = 39 };

static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

typedef struct {
    int superblock;  // k per record
    int record;  // bytes per record (8 columns)
    int offset;  // o
    int has_min;
    int halves;  // a scale per half block (Q6_K)
} block_format;

static inline block_format block_format_of(int type) {
    switch (type) {
    case GGML_Q4_K: return (block_format){256, 1152, 0, 1, 0};
    case GGML_Q5_K: return (block_format){256, 1408, 0, 1, 0};
    case GGML_Q6_K: return (block_format){256, 1680, 32, 0, 1};
    case GGML_Q8_0: return (block_format){32, 272, 128, 0, 0};
    case GGML_Q5_0: return (block_format){32, 176, 16, 0, 0};
    case GGML_Q5_1: return (block_format){32, 192, 0, 1, 0};
    case GGML_IQ4_NL: return (block_format){32, 144, 128, 0, 0};
    case GGML_IQ4_XS: return (block_format){256, 1088, 128, 0, 0};
    case GGML_MXFP4: return (block_format){32, 136, 128, 0, 0};
    default: return (block_format){0, 0, 0, 0, 0};
    }
}

static inline int is_block_format(int64_t format) { return format >= GGUF_FORMAT_BASE; }

// Bytes of one tile's records over kp inputs (a multiple of the format's block).
static int64_t block_tile_bytes(int64_t format, int64_t kp) {
    const block_format f = block_format_of((int)(format - GGUF_FORMAT_BASE));
    return kp / f.superblock * f.record;
}

// ---- value by value (the portable path, embedding rows, tests) --------------------------------

static inline int nibble_at(const uint8_t *at, int col, int k) {
    const uint8_t byte = at[32 * (k / 8) + 4 * col + k % 4];
    return k % 8 < 4 ? byte & 0x0f : byte >> 4;
}

static inline int plane_at(const uint8_t *at, int col, int k) { return (at[4 * col + k % 4] >> (k / 4)) & 1; }

static inline int crumb_at(const uint8_t *at, int col, int k) {
    return (at[32 * (k / 16) + 4 * col + k % 4] >> (2 * (k % 16 / 4))) & 3;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_float(h);
}

// An e8m0 exponent as llama.cpp's half scale, 2^(e - 128), exactly (subnormal for e < 2).
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t word_at(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

// Sub-block j's 6-bit scale and min from a Q4_K / Q5_K column's 12 bytes as words w0..w2
// (llama.cpp's get_scale_min_k4).
static inline void k4_scale_min(uint32_t w0, uint32_t w1, uint32_t w2, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = (int)(w0 >> 8 * j) & 63;
        *mn = (int)(w1 >> 8 * j) & 63;
    } else {
        const int at = 8 * (j - 4);
        *sc = (int)((w2 >> at) & 15) | (int)(((w0 >> at) >> 6 & 3) << 4);
        *mn = (int)((w2 >> at) >> 4 & 15) | (int)(((w1 >> at) >> 6 & 3) << 4);
    }
}

typedef struct {
    uint8_t u[TILE][QBLOCK];
    float s[2][TILE];  // per half block
    float m[TILE];
} block_values;

// Block b (32 k) of a record, columns [col0, col1) (an embedding row needs one: a lookup decodes
// only its own).
static void block_decode(int type, const uint8_t *rec, int b, int col0, int col1, block_values *v) {
    for (int col = col0; col < col1; col++) {
        const float d = type == GGML_MXFP4 ? e8m0_half(rec[col]) : half_at(rec + 2 * col);
        float s = d, m = 0.0f;
        for (int k = 0; k < QBLOCK; k++) {
            int u;
            switch (type) {
            case GGML_Q4_K: u = nibble_at(rec + 128 + 128 * b, col, k); break;
            case GGML_Q5_K: u = nibble_at(rec + 128 + 160 * b, col, k) | plane_at(rec + 256 + 160 * b, col, k) << 4; break;
            case GGML_Q6_K: {
                const uint8_t *at = rec + 144 + 192 * b;
                u = nibble_at(at, col, k) | crumb_at(at + 128, col, k) << 4;
                break;
            }
            case GGML_Q8_0: u = rec[16 + 32 * (k / 4) + 4 * col + k % 4] ^ 0x80; break;
            case GGML_Q5_0: u = nibble_at(rec + 48, col, k) | plane_at(rec + 16, col, k) << 4; break;
            case GGML_Q5_1: u = nibble_at(rec + 64, col, k) | plane_at(rec + 32, col, k) << 4; break;
            case GGML_IQ4_NL: u = iq4_values[nibble_at(rec + 16, col, k)] + 128; break;
            case GGML_MXFP4: u = mxfp4_values[nibble_at(rec + 8, col, k)] + 128; break;
            default: u = iq4_values[nibble_at(rec + 64 + 128 * b, col, k)] + 128; break;  // IQ4_XS
            }
            v->u[col][k] = (uint8_t)u;
        }
        if (type == GGML_Q4_K || type == GGML_Q5_K) {
            int sc, mn;
            k4_scale_min(word_at(rec + 32 + 4 * col), word_at(rec + 64 + 4 * col), word_at(rec + 96 + 4 * col), b, &sc, &mn);
            s = d * (float)sc;
            m = -(half_at(rec + 16 + 2 * col) * (float)mn);
        } else if (type == GGML_Q5_1) {
            m = half_at(rec + 16 + 2 * col);
        } else if (type == GGML_IQ4_XS) {
            uint16_t high;
            memcpy(&high, rec + 16 + 2 * col, 2);
            const int ls = (int)((word_at(rec + 32 + 4 * col) >> 4 * b) & 15) | (((high >> 2 * b) & 3) << 4);
            s = d * (float)(ls - 32);
        }
        v->s[0][col] = v->s[1][col] = s;
        if (type == GGML_Q6_K) {
            v->s[0][col] = d * (float)(int8_t)rec[16 + 8 * (2 * b) + col];
            v->s[1][col] = d * (float)(int8_t)rec[16 + 8 * (2 * b + 1) + col];
        }
        v->m[col] = m;
    }
}

// Out [count, k] = the float weights of columns ids (llama.cpp's dequantization).
static void block_dequantize_columns(int64_t format, const uint8_t *w, int64_t kp, int64_t k, const int64_t *ids,
                                     int64_t count, float *out) {
    const int type = (int)(format - GGUF_FORMAT_BASE);
    const block_format f = block_format_of(type);
    const int per = f.superblock / QBLOCK;
    block_values v;
    for (int64_t i = 0; i < count; i++) {
        const int col = (int)(ids[i] % TILE);
        const uint8_t *rec = w + ids[i] / TILE * block_tile_bytes(format, kp);
        for (int64_t b = 0; b < kp / QBLOCK; b++) {
            block_decode(type, rec + b / per * f.record, (int)(b % per), col, col + 1, &v);
            for (int j = 0; j < QBLOCK && b * QBLOCK + j < k; j++) {
                const float x = v.s[j / 16][col] * (float)((int)v.u[col][j] - f.offset);
                out[i * k + b * QBLOCK + j] = f.has_min ? x + v.m[col] : x;
            }
        }
    }
}

// Bytes ahead of the block in use to prefetch (2048 read 3-5 % faster than 1024 at one row, Zen 4).
#define BLOCK_PREFETCH 2048
#define BLOCK_ROWS 4  // rows of x per tile call (the most registers allow)

// The exact integer sum (u - o) q over k in [k0, k1) of a block (activations from act16 at `at`),
// given sum q there.
static inline int32_t block_dot(const block_values *v, int col, int k0, int k1, act16 a, int64_t at, int offset,
                                int32_t sum_q) {
    int32_t dot = 0;
    for (int k = k0; k < k1; k++) dot += (int32_t)v->u[col][k] * (256 * a.hi[at + k] + a.lo[at + k]);
    return dot - offset * sum_q;
}

static void portable_block_tile(int type, const uint8_t *w, int64_t nsb, act16 a, int64_t kp, float *out, int64_t ldo,
                                int nrows) {
    const block_format f = block_format_of(type);
    const int per = f.superblock / QBLOCK;
    const int64_t nb = kp / QBLOCK;
    float acc[BLOCK_ROWS][TILE] = {{0}};
    block_values v;
    for (int64_t s = 0; s < nsb; s++)
        for (int b = 0; b < per; b++) {
            block_decode(type, w + s * f.record, b, 0, TILE, &v);
            const int64_t kb = s * per + b;
            for (int r = 0; r < nrows; r++) {
                const int64_t rb = r * nb + kb;
                const int64_t at = r * kp + kb * QBLOCK;
                const int32_t *s16 = a.s16 + 2 * rb;
                for (int col = 0; col < TILE; col++) {
                    if (f.halves) {
                        for (int h = 0; h < 2; h++) {
                            const int32_t dot = block_dot(&v, col, 16 * h, 16 * h + 16, a, at, f.offset, s16[h]);
                            acc[r][col] = fmaf((float)dot, v.s[h][col] * a.da[rb], acc[r][col]);
                        }
                    } else {
                        const int32_t dot = block_dot(&v, col, 0, QBLOCK, a, at, f.offset, s16[0] + s16[1]);
                        acc[r][col] = fmaf((float)dot, v.s[0][col] * a.da[rb], acc[r][col]);
                    }
                    if (f.has_min) acc[r][col] = fmaf(v.m[col], a.sa[rb], acc[r][col]);
                }
            }
        }
    for (int r = 0; r < nrows; r++) memcpy(out + r * ldo, acc[r], sizeof(acc[r]));
}

// ---- in registers (AVX2 and VNNI) ------------------------------------------------------------

#ifdef QL_AVX2
typedef struct {
    __m256i u[8];  // register i: 8 columns x k = 4i .. 4i + 3
    __m256 s[2], m;
} block_vec;

static inline __attribute__((always_inline)) void nibble_quads(const uint8_t *at, __m256i u[8]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(at + 32 * c));
        u[2 * c] = _mm256_and_si256(v, low);
        u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}

// ORs a plane's bits into bit `bit` of each value. (16-bit shifts: the mask keeps each byte's own.)
static inline __attribute__((always_inline)) void add_plane(const uint8_t *at, __m256i u[8], const int bit) {
    const __m256i p = _mm256_loadu_si256((const __m256i *)at), mask = _mm256_set1_epi8((char)(1 << bit));
    for (int i = 0; i < 8; i++) {
        const __m256i x = i > bit ? _mm256_srli_epi16(p, i - bit) : _mm256_slli_epi16(p, bit - i);
        u[i] = _mm256_or_si256(u[i], _mm256_and_si256(x, mask));
    }
}

// ORs crumbs into bits 4, 5 of each value.
static inline __attribute__((always_inline)) void add_crumbs(const uint8_t *at, __m256i u[8]) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    for (int p = 0; p < 2; p++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(at + 32 * p));
        u[4 * p] = _mm256_or_si256(u[4 * p], _mm256_and_si256(_mm256_slli_epi16(c, 4), mask));
        u[4 * p + 1] = _mm256_or_si256(u[4 * p + 1], _mm256_and_si256(_mm256_slli_epi16(c, 2), mask));
        u[4 * p + 2] = _mm256_or_si256(u[4 * p + 2], _mm256_and_si256(c, mask));
        u[4 * p + 3] = _mm256_or_si256(u[4 * p + 3], _mm256_and_si256(_mm256_srli_epi16(c, 2), mask));
    }
}

static inline __m256 halves8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256i byte_of(__m256i words, int j) {
    return _mm256_and_si256(_mm256_srli_epi32(words, 8 * j), _mm256_set1_epi32(0xff));
}

static inline __m256 negate(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }

static inline __attribute__((always_inline)) void table_lookup(__m256i u[8], const int8_t values[16]) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_xor_si128(
        _mm_loadu_si128((const __m128i *)values), _mm_set1_epi8((char)0x80)));  // value + 128
    for (int i = 0; i < 8; i++) u[i] = _mm256_shuffle_epi8(table, u[i]);
}

// 8 e8m0 bytes (one per column) as e8m0_half's scales.
static inline __m256 e8m0_halves8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);  // e < 2: subnormal
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}

// Block b of a record into registers: block_decode's values, 8 columns at a time.
static inline __attribute__((always_inline)) void block_decode_vec(const int type, const uint8_t *rec, int b,
                                                                   block_vec *v) {
    const __m256 d = type == GGML_MXFP4 ? e8m0_halves8(rec) : halves8(rec);
    v->s[0] = v->s[1] = d;
    v->m = _mm256_setzero_ps();
    switch (type) {
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(rec + 32));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(rec + 64));
        const __m256i w2 = _mm256_loadu_si256((const __m256i *)(rec + 96));
        const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15);
        __m256i sc, mn;
        if (b < 4) {
            sc = _mm256_and_si256(byte_of(w0, b), six);
            mn = _mm256_and_si256(byte_of(w1, b), six);
        } else {
            const __m256i x = byte_of(w2, b - 4);
            sc = _mm256_or_si256(_mm256_and_si256(x, four), _mm256_slli_epi32(_mm256_srli_epi32(byte_of(w0, b - 4), 6), 4));
            mn = _mm256_or_si256(_mm256_srli_epi32(x, 4), _mm256_slli_epi32(_mm256_srli_epi32(byte_of(w1, b - 4), 6), 4));
        }
        v->s[0] = v->s[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        v->m = negate(_mm256_mul_ps(halves8(rec + 16), _mm256_cvtepi32_ps(mn)));
        const uint8_t *at = rec + 128 + b * (type == GGML_Q4_K ? 128 : 160);
        nibble_quads(at, v->u);
        if (type == GGML_Q5_K) add_plane(at + 128, v->u, 4);
        break;
    }
    case GGML_Q6_K: {
        const uint8_t *at = rec + 144 + 192 * b;
        nibble_quads(at, v->u);
        add_crumbs(at + 128, v->u);
        for (int h = 0; h < 2; h++) {
            const __m128i sc = _mm_loadl_epi64((const __m128i *)(rec + 16 + 8 * (2 * b + h)));
            v->s[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        }
        break;
    }
    case GGML_Q8_0:
        for (int i = 0; i < 8; i++)
            v->u[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + 16 + 32 * i)), _mm256_set1_epi8((char)0x80));
        break;
    case GGML_Q5_0:
        nibble_quads(rec + 48, v->u);
        add_plane(rec + 16, v->u, 4);
        break;
    case GGML_Q5_1:
        nibble_quads(rec + 64, v->u);
        add_plane(rec + 32, v->u, 4);
        v->m = halves8(rec + 16);
        break;
    case GGML_IQ4_NL:
        nibble_quads(rec + 16, v->u);
        table_lookup(v->u, iq4_values);
        break;
    case GGML_MXFP4:
        nibble_quads(rec + 8, v->u);
        table_lookup(v->u, mxfp4_values);
        break;
    default: {  // IQ4_XS
        const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rec + 16)));
        const __m256i low = _mm256_loadu_si256((const __m256i *)(rec + 32));
        const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(low, 4 * b), _mm256_set1_epi32(15)),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * b), _mm256_set1_epi32(3)), 4));
        v->s[0] = v->s[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
        nibble_quads(rec + 64 + 128 * b, v->u);
        table_lookup(v->u, iq4_values);
        break;
    }
    }
}

// The record's lines ahead of block b, for the prefetcher (one file block per record).
static inline __attribute__((always_inline)) void block_prefetch(const uint8_t *rec, int record, int per, int b) {
    const int bytes = record / per, at = b * bytes;
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(rec + at + i + BLOCK_PREFETCH), _MM_HINT_T0);
}

// acc += the block's product for one row, from its integer sums: hs[g] = sum u hi and ls[g] =
// sum u lo (VNNI: with u - 128 for o = 128), in two groups of quads (the halves where the format
// has a scale per half, else even and odd quads). The float epilogue every path shares.
static inline __attribute__((always_inline)) __m256 block_epilogue(const block_format f, const block_vec *v,
                                                                   const __m256i hs[2], const __m256i ls[2], act16 a,
                                                                   int64_t rb, int vnni, __m256 acc) {
    const __m256 da = _mm256_set1_ps(a.da[rb]);
    const int32_t *s16 = a.s16 + 2 * rb, *l16 = a.l16 + 2 * rb;
    if (f.halves) {
        for (int h = 0; h < 2; h++) {
            const int32_t fix = (vnni && f.offset == 128 ? 128 * l16[h] : 0) - f.offset * s16[h];
            const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(hs[h], 8), ls[h]), _mm256_set1_epi32(fix));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(v->s[h], da), acc);
        }
    } else {
        const int32_t fix = (vnni && f.offset == 128 ? 128 * (l16[0] + l16[1]) : 0) - f.offset * (s16[0] + s16[1]);
        const __m256i h = _mm256_add_epi32(hs[0], hs[1]), l = _mm256_add_epi32(ls[0], ls[1]);
        const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(h, 8), l), _mm256_set1_epi32(fix));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(v->s[0], da), acc);
    }
    return f.has_min ? _mm256_fmadd_ps(v->m, _mm256_set1_ps(a.sa[rb]), acc) : acc;
}

static inline __attribute__((always_inline)) __m256i maddubs32(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// AVX2: 8 columns x nrows rows of a tile, maddubs as the header says.
static inline __attribute__((always_inline)) void avx2_block_tile(const int type, const uint8_t *w, int64_t nsb, act16 a,
                                                                  int64_t kp, float *out, int64_t ldo, const int nrows) {
    const block_format f = block_format_of(type);
    const int per = f.superblock / QBLOCK;
    const int64_t nb = kp / QBLOCK;
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256 acc[BLOCK_ROWS];
    for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += f.record)
        for (int b = 0; b < per; b++) {
            block_prefetch(w, f.record, per, b);
            block_vec v;
            block_decode_vec(type, w, b, &v);
            const int64_t kb = s * per + b;
            for (int r = 0; r < nrows; r++) {
                __m256i hs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, ls[2] = {hs[0], hs[0]};
                for (int i = 0; i < 8; i++) {
                    const int g = f.halves ? i / 4 : i & 1;
                    const int64_t at = r * kp + kb * QBLOCK + 4 * i;
                    const __m256i hi = bcast4(a.hi + at), lo = bcast4(a.lo + at);
                    if (f.offset == 128) {  // u up to 255: by nibbles
                        const __m256i uh = _mm256_and_si256(_mm256_srli_epi16(v.u[i], 4), nib);
                        const __m256i ul = _mm256_and_si256(v.u[i], nib);
                        hs[g] = _mm256_add_epi32(hs[g], _mm256_add_epi32(_mm256_slli_epi32(maddubs32(uh, hi), 4), maddubs32(ul, hi)));
                        ls[g] = _mm256_add_epi32(ls[g], _mm256_add_epi32(_mm256_slli_epi32(maddubs32(lo, uh), 4), maddubs32(lo, ul)));
                    } else {
                        hs[g] = _mm256_add_epi32(hs[g], maddubs32(v.u[i], hi));
                        ls[g] = _mm256_add_epi32(ls[g], maddubs32(lo, v.u[i]));
                    }
                }
                acc[r] = block_epilogue(f, &v, hs, ls, a, r * nb + kb, 0, acc[r]);
            }
        }
    for (int r = 0; r < nrows; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#endif

#ifdef QL_VNNI
// VNNI: as avx2_block_tile, by vpdpbusd.
static inline __attribute__((always_inline)) VNNI_TARGET void vnni_block_tile(
        const int type, const uint8_t *w, int64_t nsb, act16 a, int64_t kp, float *out, int64_t ldo, const int nrows) {
    const block_format f = block_format_of(type);
    const int per = f.superblock / QBLOCK;
    const int64_t nb = kp / QBLOCK;
    __m256 acc[BLOCK_ROWS];
    for (int r = 0; r < nrows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++, w += f.record)
        for (int b = 0; b < per; b++) {
            block_prefetch(w, f.record, per, b);
            block_vec v;
            block_decode_vec(type, w, b, &v);
            __m256i sv[8];  // the values as dpbusd's signed operand
            for (int i = 0; i < 8; i++)
                sv[i] = f.offset == 128 ? _mm256_xor_si256(v.u[i], _mm256_set1_epi8((char)0x80)) : v.u[i];
            const int64_t kb = s * per + b;
            for (int r = 0; r < nrows; r++) {
                __m256i hs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, ls[2] = {hs[0], hs[0]};
                for (int i = 0; i < 8; i++) {
                    const int g = f.halves ? i / 4 : i & 1;
                    const int64_t at = r * kp + kb * QBLOCK + 4 * i;
                    hs[g] = _mm256_dpbusd_epi32(hs[g], v.u[i], bcast4(a.hi + at));
                    ls[g] = _mm256_dpbusd_epi32(ls[g], bcast4(a.lo + at), sv[i]);
                }
                acc[r] = block_epilogue(f, &v, hs, ls, a, r * nb + kb, 1, acc[r]);
            }
        }
    for (int r = 0; r < nrows; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#endif

// ---- many rows: a group of tiles widened once (VNNI) -----------------------------------------
//
// As quant_linear.c's pairs path: a group of PAIR_TILES tiles is decoded once into int16 pairs
// of u - o, lane = column (pair 4c + j of a block: k = 8c + j and 8c + 4 + j, act16's q2 order),
// then every row runs against it by vpdpwssd. Each block's (or half block's) sum is the exact
// integer of the other paths, and the epilogue theirs: the same bits.

#ifdef QL_VNNI
#define BLOCK_WIDEN_MIN_ROWS 8  // from this many rows widening once beats decoding per 4 rows

// wq [nb][16][32] int32 pairs, dm [nb][3][32] float: s (first half), s (second half), m.
static VNNI_TARGET void block_widen(const uint8_t *w, int64_t format, int64_t nb, int ntiles, int32_t *wq, float *dm) {
    const int type = (int)(format - GGUF_FORMAT_BASE);
    const int64_t tile_bytes = block_tile_bytes(format, nb * QBLOCK);
    const block_format f = block_format_of(type);
    const int per = f.superblock / QBLOCK;
    const __m256i off = _mm256_set1_epi16((short)f.offset), ff = _mm256_set1_epi32(0xff);
    for (int64_t b = 0; b < nb; b++)
        for (int t = 0; t < PAIR_TILES; t++) {
            int32_t *o = wq + b * 16 * PAIR_COLS + t * TILE;
            float *d = dm + b * 3 * PAIR_COLS + t * TILE;
            if (t >= ntiles) {
                zero_pair_tile(o, d, 3);
                continue;
            }
            block_vec v;
            block_decode_vec(type, w + t * tile_bytes + b / per * f.record, (int)(b % per), &v);
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++) {
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(v.u[2 * c], 8 * j), ff);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(v.u[2 * c + 1], 8 * j), ff);
                    _mm256_storeu_si256((__m256i *)(o + (4 * c + j) * PAIR_COLS),
                                        _mm256_sub_epi16(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)), off));
                }
            _mm256_storeu_ps(d, v.s[0]);
            _mm256_storeu_ps(d + PAIR_COLS, v.s[1]);
            _mm256_storeu_ps(d + 2 * PAIR_COLS, v.m);
        }
}

// Rows [0, nrows) against a widened group (vnni_tile's loop, with the block formats' epilogue).
static inline __attribute__((always_inline)) VNNI_TARGET void vnni_block_pairs_tile(
        const int32_t *wq, const float *dm, int64_t nb, act16 a, int64_t kp, float *out, int64_t ldo,
        __mmask16 mask0, __mmask16 mask1, const int nrows, const int halves, const int has_min) {
    __m512 acc[VNNI_ROWS][2];
    for (int r = 0; r < nrows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i dot[VNNI_ROWS][2][2];  // row, columns 0-15 / 16-31, half block (or all of it)
        for (int r = 0; r < nrows; r++)
            for (int i = 0; i < 4; i++) dot[r][i / 2][i % 2] = _mm512_setzero_si512();
        const int32_t *wb = wq + b * 16 * PAIR_COLS;
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {  // unrolled: h a constant, the sums in registers
            const int h = halves ? half : 0;
#pragma GCC unroll 4
            for (int p = 8 * half; p < 8 * half + 8; p++) {
                const __m512i w0 = _mm512_loadu_si512(wb + p * PAIR_COLS), w1 = _mm512_loadu_si512(wb + p * PAIR_COLS + 16);
                for (int r = 0; r < nrows; r++) {
                    int32_t pair;
                    memcpy(&pair, a.q2 + r * kp + b * QBLOCK + 2 * p, 4);
                    const __m512i x = _mm512_set1_epi32(pair);
                    dot[r][0][h] = _mm512_dpwssd_epi32(dot[r][0][h], w0, x);
                    dot[r][1][h] = _mm512_dpwssd_epi32(dot[r][1][h], w1, x);
                }
            }
        }
        const float *db = dm + b * 3 * PAIR_COLS;
        for (int r = 0; r < nrows; r++) {
            const __m512 da = _mm512_set1_ps(a.da[r * (kp / QBLOCK) + b]), sa = _mm512_set1_ps(a.sa[r * (kp / QBLOCK) + b]);
            for (int c = 0; c < 2; c++) {
                for (int h = 0; h < 1 + halves; h++) {
                    const __m512 s = _mm512_loadu_ps(db + h * PAIR_COLS + 16 * c);
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c][h]), _mm512_mul_ps(s, da), acc[r][c]);
                }
                if (has_min) acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(db + 2 * PAIR_COLS + 16 * c), sa, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < nrows; r++) {
        _mm512_mask_storeu_ps(out + r * ldo, mask0, acc[r][0]);
        _mm512_mask_storeu_ps(out + r * ldo + 16, mask1, acc[r][1]);
    }
}

static VNNI_TARGET void vnni_block_pairs_rows(int64_t format, const int32_t *wq, const float *dm, int64_t nb,
                                              const int16_t *q2, int64_t kp, const float *da, const float *sa,
                                              float *out, int64_t ldo, int cols, int nrows) {
    const block_format f = block_format_of((int)(format - GGUF_FORMAT_BASE));
    const int halves = f.halves, has_min = f.has_min;
    const act16 a = {NULL, NULL, (float *)da, (float *)sa, NULL, NULL, (int16_t *)q2, NULL, NULL};
    const __mmask16 mask0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 mask1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
#define PAIRS_CASE(R, H, M) vnni_block_pairs_tile(wq, dm, nb, a, kp, out, ldo, mask0, mask1, R, H, M)
#define PAIRS_ROWS(H, M)                                                                             \
    switch (nrows) {  /* constant shapes: registers, unrolled loops */                              \
    case 4: PAIRS_CASE(4, H, M); break;                                                              \
    case 3: PAIRS_CASE(3, H, M); break;                                                              \
    case 2: PAIRS_CASE(2, H, M); break;                                                              \
    default: PAIRS_CASE(1, H, M); break;                                                             \
    }
    if (halves) PAIRS_ROWS(1, 0)
    else if (has_min) PAIRS_ROWS(0, 1)
    else PAIRS_ROWS(0, 0)
#undef PAIRS_ROWS
#undef PAIRS_CASE
}

// The block formats' widened groups: 4 MiB chunks of rows (at 256 KiB, as pairs_linear's int4,
// a k = 8192 group was widened 32 times over 512 rows: 2.5x the time).
static const pair_kernel vnni_block_pairs = {block_widen, vnni_block_pairs_rows, VNNI_ROWS, 3, 4 << 20};
#endif

// ---- the linear --------------------------------------------------------------------------------

// A tile's kernel for one format and path: nrows (1, 2 or 4) rows of act16 `a` against the tile
// at w (nsb records), into out.
typedef void (*block_tile_fn)(int type, const uint8_t *w, int64_t nsb, act16 a, int64_t kp, float *out, int64_t ldo,
                              int nrows);

// One kernel per format and path, its type and row count constant (registers, unrolled loops).
#define BLOCK_TILE(PATH, TARGET, T)                                                                          \
    static TARGET void PATH##_tile_##T(int type, const uint8_t *w, int64_t nsb, act16 a, int64_t kp,        \
                                       float *out, int64_t ldo, int nrows) {                                  \
        (void)type;                                                                                           \
        if (nrows == 4) PATH##_block_tile(GGML_##T, w, nsb, a, kp, out, ldo, 4);                             \
        else if (nrows == 2) PATH##_block_tile(GGML_##T, w, nsb, a, kp, out, ldo, 2);                        \
        else PATH##_block_tile(GGML_##T, w, nsb, a, kp, out, ldo, 1);                                        \
    }
#define BLOCK_TILES(PATH, TARGET)                                                                            \
    BLOCK_TILE(PATH, TARGET, Q4_K) BLOCK_TILE(PATH, TARGET, Q5_K) BLOCK_TILE(PATH, TARGET, Q6_K)             \
    BLOCK_TILE(PATH, TARGET, Q8_0) BLOCK_TILE(PATH, TARGET, Q5_0) BLOCK_TILE(PATH, TARGET, Q5_1)             \
    BLOCK_TILE(PATH, TARGET, IQ4_NL) BLOCK_TILE(PATH, TARGET, IQ4_XS) BLOCK_TILE(PATH, TARGET, MXFP4)        \
    static block_tile_fn PATH##_tile_of(int type) {                                                          \
        switch (type) {                                                                                       \
        case GGML_Q4_K: return PATH##_tile_Q4_K;                                                             \
        case GGML_Q5_K: return PATH##_tile_Q5_K;                                                             \
        case GGML_Q6_K: return PATH##_tile_Q6_K;                                                             \
        case GGML_Q8_0: return PATH##_tile_Q8_0;                                                             \
        case GGML_Q5_0: return PATH##_tile_Q5_0;                                                             \
        case GGML_Q5_1: return PATH##_tile_Q5_1;                                                             \
        case GGML_IQ4_NL: return PATH##_tile_IQ4_NL;                                                         \
        case GGML_MXFP4: return PATH##_tile_MXFP4;                                                           \
        default: return PATH##_tile_IQ4_XS;                                                                  \
        }                                                                                                     \
    }

#ifdef QL_AVX2
BLOCK_TILES(avx2, )
#endif
#ifdef QL_VNNI
BLOCK_TILES(vnni, VNNI_TARGET)
#endif

// out [m, ldo] columns [0, n) = x @ W^T for W in a GGUF block format, as quant_gemm: tiles split
// among threads, rows in chunks whose activations stay in cache while every tile passes them.
static void block_linear(int64_t format, const uint8_t *w, int64_t n, int64_t kp, act16 all, int64_t m, float *out,
                         int64_t ldo, int num_threads) {
    const int type = (int)(format - GGUF_FORMAT_BASE);
#ifdef QL_VNNI
    if (quant_kernel_path() >= QL_PATH_VNNI && m >= BLOCK_WIDEN_MIN_ROWS &&
        pairs_linear(&vnni_block_pairs, w, format, n, kp, all, m, out, ldo, num_threads) == 0)
        return;
#endif
    block_tile_fn tile = portable_block_tile;
#ifdef QL_AVX2
    tile = avx2_tile_of(type);
#endif
#ifdef QL_VNNI
    if (quant_kernel_path() >= QL_PATH_VNNI) tile = vnni_tile_of(type);  // (AMX: the VNNI kernels)
#endif
    const int64_t nb = kp / QBLOCK, tiles = n / TILE, tile_bytes = block_tile_bytes(format, kp);
    const int64_t nsb = kp / block_format_of(type).superblock;
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
        const int64_t m1 = m0 + ROW_CHUNK < m ? m0 + ROW_CHUNK : m;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tiles * (m1 - m0) >= 64)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t r = m0; r < m1;) {
                const act16 a = {all.hi + r * kp, all.lo + r * kp, all.da + r * nb, all.sa + r * nb, NULL, NULL, NULL,
                                 all.s16 + 2 * r * nb, all.l16 + 2 * r * nb};
                const int rows = m1 - r >= BLOCK_ROWS ? BLOCK_ROWS : m1 - r >= 2 ? 2 : 1;
                tile(type, w + t * tile_bytes, nsb, a, kp, out + r * ldo + t * TILE, ldo, rows);
                r += rows;
            }
    }
}
