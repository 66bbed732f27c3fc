// int8 (kv_cache_dtype="int8"): llama.cpp's q8_0 blocks. Each head's row of a token is head_dim / 32
// blocks of 32 int8 values and their float16 scale (value = int8 * scale), 34 bytes a block,
// written by store_kv (fused_ops.c) from the row times a Hadamard matrix, read in place by
// paged_attention.c.
#pragma once

#include <stdint.h>
#include <string.h>

#define Q8_BLOCK 34
#define Q8_HEAD(d) ((d) / 32 * Q8_BLOCK)

static inline float q8_scale(const int8_t *block) {
    _Float16 s;
    memcpy(&s, block + 32, sizeof s);
    return (float)s;
}

// The byte of value j (0 <= j < head_dim) in a head's row of q8 blocks.
static inline int64_t q8_at(int64_t j) { return j / 32 * Q8_BLOCK + j % 32; }
