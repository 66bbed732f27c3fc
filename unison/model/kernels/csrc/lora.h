// LoRA adapters as lora.c and decoder.c take them (mirrored by ctypes Structures in cpu_kernels.py).
#pragma once
#include <stdint.h>

typedef struct {  // one part of a fused linear: y[:, offset : offset + n] += (x a) b
    const float *a;  // [ceil(rank / 8), k, 8]: panels of 8 ranks, input by input (zeros past rank)
    const float *b;  // [ceil(n / 16), rank, 16]: tiles of 16 columns (zeros past n), the scale folded in
    int64_t rank, n, offset;
} LoraPart;

typedef struct {  // one adapter on one linear: q, k, v of qkv, gate, up of gate_up; parts it targets
    int64_t parts;
    LoraPart part[3];
} LoraLinear;

// y[r] += the update of x[r] by adapter row_adapter[r] (< 0: none) for every row r, where
// adapters[a] is adapter a's table of linears, [layers * 4] (qkv, o_proj, gate_up, down).
void lora_apply(const float *x, int64_t x_stride, int64_t k, float *y, int64_t y_stride, int64_t rows,
                const int64_t *row_adapter, const LoraLinear *const *adapters, int64_t linear,
                int num_threads);
