// The machine's memory read bandwidth, as a decode step meets it: threads streaming disjoint
// halves of a buffer far larger than the caches, with 256-bit loads (`unison bench bandwidth`).
// A float sum in torch reads slower than the quantized kernels do, so it cannot be their bound.

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Reads `bytes` (a multiple of 256) from x on `num_threads` threads; returns a value depending on
// every byte read, so that the reads cannot be dropped.
uint64_t read_memory(const uint8_t *x, int64_t bytes, int num_threads) {
    uint64_t total = 0;
    const int64_t chunks = bytes / 256;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(^ : total)
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t *p = x + c * 256;
#if defined(__AVX2__)
        __m256i acc = _mm256_setzero_si256();
        for (int i = 0; i < 256; i += 32) acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(p + i)));
        total ^= (uint64_t)_mm256_extract_epi64(acc, 0) ^ (uint64_t)_mm256_extract_epi64(acc, 3);
#else
        for (int i = 0; i < 256; i += 8) total ^= *(const uint64_t *)(p + i);
#endif
    }
    return total;
}
