// A mixture of experts' MLP as moe.c and decoder.c take it (mirrored by ctypes Structures in
// cpu_kernels.py).
#pragma once
#include <stdint.h>

typedef struct {  // one projection of every expert: expert e's [n, k] weight packed as quant_linear.c's
    int64_t record;  // the format, as quant_linear.c names it (quant_tile_bytes)
    const uint8_t *w;  // expert 0's; the experts follow each other, each the same size
    int64_t n, k;  // n a multiple of 8
} ExpertLinear;

typedef struct {
    int64_t experts, top_k, hidden, inter;
    int norm_topk, activation;  // activation as act_mul numbers them
    const float *router;  // [experts, hidden] float32
    ExpertLinear gate, up, down;  // gate, up: [inter, hidden]; down: [hidden, inter]
    // gpt-oss's biases, NULL where a family has none: the router's [experts], the experts' gate
    // and up [experts, inter], down [experts, hidden]
    const float *router_bias, *gate_bias, *up_bias, *down_bias;
} MoeLayer;

// out[r] (row stride out_stride) = the mixture's output for row r of x (row stride x_stride);
// workspace: moe_workspace_bytes(layer, rows) bytes.
void moe_forward(const MoeLayer *layer, const float *x, int64_t x_stride, int64_t rows, float *out,
                 int64_t out_stride, void *workspace, int num_threads);
int64_t moe_workspace_bytes(const MoeLayer *layer, int64_t rows);
