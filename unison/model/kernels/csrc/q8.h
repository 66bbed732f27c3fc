// int8 (kv_cache_dtype="int8"): llama.cpp's q8_0 blocks. Each head's row of a token is head_dim / 32
// blocks of 32 int8 values and their float16 scale (value = int8 * scale), 34 bytes a block,
// written by store_kv (fused_ops.c) from the row times a Hadamard matrix, read in place by
// paged_attention.c.
#pragma once

#include <stdint.h>
#include <string.h>

#define Q8_BLOCK 34
#define Q8_HEAD(d) ((d) / 32 * Q8_BLOCK)

// int8 keys may be stored less their head's mean (key_rounding.py): a block so stored has its
// scale's sign bit set (a scale is never negative otherwise), and its reader adds the mean back.
#define Q8_SHIFTED 0x8000

static inline uint16_t q8_scale_bits(const int8_t *block) {
    uint16_t bits;
    memcpy(&bits, block + 32, sizeof bits);
    return bits;
}

static inline float q8_scale(const int8_t *block) {  // the magnitude: the mark is not part of it
    const uint16_t bits = q8_scale_bits(block) & (uint16_t)~Q8_SHIFTED;
    _Float16 s;
    memcpy(&s, &bits, sizeof s);
    return (float)s;
}

static inline int q8_shifted(const int8_t *block) { return (q8_scale_bits(block) & Q8_SHIFTED) != 0; }

// The byte of value j (0 <= j < head_dim) in a head's row of q8 blocks.
static inline int64_t q8_at(int64_t j) { return j / 32 * Q8_BLOCK + j % 32; }

// int8 caches read the keys and values of a query's own block as float16, exact as a float16 cache
// holds them (KIVI's full-precision recent tokens, block-aligned): a query weighs its nearest
// tokens most, so their rounding cost the most (BENCHMARKS.md). Both sources are rotated, like the
// q8 rows. Block-aligned, the rows a query reads exact were all computed by its own request (a
// prefix-cache hit ends at a block boundary), so whether a row is read exact depends on positions
// only: a prompt whole, in chunks or after a hit still gives bit-identical attention.
typedef struct {
    // the request's rows of this forward, from position `first`: [rows, kv_heads, head_dim]
    const _Float16 *k, *v;
    // the rows of the block of `first` before it (its twin): [block_size, kv_heads, head_dim]
    const _Float16 *k_twin, *v_twin;
    int64_t first;
} Recent;

// Where row pos's head kh is, float16 (value: V, else K); NULL where it is not held (a block's rows
// before `first` with no twin: the caller reads the q8 row).
static inline const _Float16 *recent_row(const Recent *r, int value, int64_t pos, int64_t kh,
                                         int64_t kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t row = kv_heads * head_dim;
    if (pos >= r->first) return (value ? r->v : r->k) + (pos - r->first) * row + kh * head_dim;
    const _Float16 *twin = value ? r->v_twin : r->k_twin;
    return twin ? twin + pos % block_size * row + kh * head_dim : NULL;
}

// A forward's recent rows, one layer's (NULL: none): the rows it computes, the twins (the float16
// copies of blocks that requests continue mid-way), and per request (row of the block tables) its
// first row in the forward and the twin of that row's block (-1: none, the row starts a block).
typedef struct {
    const _Float16 *k, *v;  // [rows, kv_heads, head_dim]
    const _Float16 *k_twins, *v_twins;  // [twins, block_size, kv_heads, head_dim]
    const int64_t *first_row, *twin;  // [requests]
} RecentRows;

// Request seq's view of `r` in `own`; NULL when r is.
static inline const Recent *recent_of(const RecentRows *r, Recent *own, int64_t seq,
                                      const int64_t *row_len, int64_t row, int64_t block_size) {
    if (r == NULL) return NULL;
    const int64_t first = r->first_row[seq], twin = r->twin[seq];
    own->k = r->k + first * row;
    own->v = r->v + first * row;
    own->k_twin = twin < 0 ? NULL : r->k_twins + twin * block_size * row;
    own->v_twin = twin < 0 ? NULL : r->v_twins + twin * block_size * row;
    own->first = row_len[first] - 1;
    return own;
}
