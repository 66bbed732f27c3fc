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
