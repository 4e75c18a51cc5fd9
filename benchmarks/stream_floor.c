/*
 * The stream floor (benchmarks/stream_floor.py): the least time this machine takes to move a pass's
 * streams, measured with a loop that does nothing else. sf_loop reads nin fp32 streams of n elements
 * and writes nout: the first min(nin, nout) outputs are inputs written in place (read, then written:
 * a compression's error, an update's parameters), the others are only written, with non-temporal
 * stores where the CPU has AVX2 (as the passes write a buffer they only write: co_stream_out). With
 * no output it sums squares (of the inputs' sum, whole groups of 64 elements of each tile). Tile by tile (1 KiB a stream, in
 * L1), as the passes walk their streams: the inputs read side by side into the tile, the tile stored.
 */
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define SF_TILE 256

static void store_tile(float *dst, const float *src, int64_t len, float c, int stream) {
    int64_t i = 0;
#if defined(__AVX2__)
    if (stream) {
        const __m256 cv = _mm256_set1_ps(c);
        for (; i < len && ((uintptr_t)(dst + i) & 31u); ++i) dst[i] = src[i] * c;
        for (; i + 8 <= len; i += 8) _mm256_stream_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), cv));
    }
#else
    (void)stream;
#endif
    for (; i < len; ++i) dst[i] = src[i] * c;
}

/* t <- the sum of 1 to 5 inputs' elements [k, k + len), read side by side (element i of every
 * input, then element i + 1: as a fused pass reads them); more inputs are added one by one after. */
#define SF_AT(j) ((const float *)(intptr_t)in[j] + k)
static void sum_in(float *restrict t, const int64_t *in, int64_t nin, int64_t k, int64_t len) {
    const float *restrict a = SF_AT(0);
    if (nin == 1) {
        for (int64_t i = 0; i < len; ++i) t[i] = a[i];
        return;
    }
    const float *restrict b = SF_AT(1);
    if (nin == 2) {
        for (int64_t i = 0; i < len; ++i) t[i] = a[i] + b[i];
        return;
    }
    const float *restrict c = SF_AT(2);
    if (nin == 3) {
        for (int64_t i = 0; i < len; ++i) t[i] = (a[i] + b[i]) + c[i];
        return;
    }
    const float *restrict d = SF_AT(3);
    if (nin == 4) {
        for (int64_t i = 0; i < len; ++i) t[i] = ((a[i] + b[i]) + c[i]) + d[i];
        return;
    }
    const float *restrict e = SF_AT(4);
    for (int64_t i = 0; i < len; ++i) t[i] = (((a[i] + b[i]) + c[i]) + d[i]) + e[i];
    for (int64_t j = 5; j < nin; ++j) {
        const float *restrict x = SF_AT(j);
        for (int64_t i = 0; i < len; ++i) t[i] += x[i];
    }
}

/* The squares of t[0, len & ~63) added into 64 float lanes (element i into lane i % 64):
 * independent chains, so that the adds keep up with the reads. */
static void square_in(float *restrict lanes, const float *restrict t, int64_t len) {
    for (int64_t i = 0; i + 64 <= len; i += 64)
        for (int j = 0; j < 64; ++j) lanes[j] += t[i + j] * t[i + j];
}

/* Returns the sum of squares where nout == 0 (else 0). in, out: addresses of fp32 buffers; nin at
 * most 8. */
double sf_loop(const int64_t *in, int64_t nin, const int64_t *out, int64_t nout, int64_t n) {
    float tile[SF_TILE];
    float lanes[64] = {0};
    const int64_t aliased = nin < nout ? nin : nout;
    for (int64_t k = 0; k < n; k += SF_TILE) {
        const int64_t len = n - k < SF_TILE ? n - k : SF_TILE;
        if (nout == 0 && nin == 1) { /* (read where it lies: no tile) */
            square_in(lanes, (const float *)(intptr_t)in[0] + k, len);
            continue;
        }
        sum_in(tile, in, nin, k, len);
        if (nout == 0) {
            square_in(lanes, tile, len);
            continue;
        }
        for (int64_t o = 0; o < nout; ++o)
            store_tile((float *)(intptr_t)out[o] + k, tile, len, 0.5f + (float)o, o >= aliased);
    }
#if defined(__AVX2__)
    _mm_sfence();
#endif
    double total = 0.0;
    for (int j = 0; j < 64; ++j) total += lanes[j];
    return total;
}
