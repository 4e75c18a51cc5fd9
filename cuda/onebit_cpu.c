/*
 * CPU kernels of error-feedback 1-bit compression (docs/design.md 2.1, 2.2), and the segmented
 * element-wise passes around it (compressed_opt.cuda.segmented).
 *
 * Compiled at first use by compressed_opt.cuda.cpu with the system C compiler and loaded with
 * ctypes. Same contract as the CUDA kernels in onebit.cu:
 *   bit k of a packed buffer is bit (k % 8) of byte k / 8 (little bit order);
 *   bit = 1 iff u >= 0 (zero counts as +); decompressed value = scale * (2 bit - 1).
 * Each compression is two passes over memory: pass 1 forms u, packs its signs and returns
 * sum(u^2); the caller turns that into scale = sqrt(sum / n); pass 2 turns u into the new error
 * u - scale * sign(u). The AVX2 paths are used when compiled with -march on a CPU that has it;
 * the scalar paths give bit-identical results (the sum of squares may differ in rounding).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CO_AVX2 1
#endif

#define CO_SUM_BLOCK 4096 /* float partial sums are folded into a double every block */

int co_has_avx2(void) {
#ifdef CO_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Pack the signs of u[0..n) (positions >= n count as u = 0, bit 1) into packed[0..nbytes). */
static inline uint8_t sign_byte_tail(const float *u, int64_t start, int64_t n) {
    unsigned bits = 0;
    for (int j = 0; j < 8; ++j) {
        int64_t k = start + j;
        bits |= (unsigned)(k >= n || u[k] >= 0.0f) << j;
    }
    return (uint8_t)bits;
}

/*
 * Worker pass 1: error <- u = x + error (x == NULL means x = 0); packed <- signs of u.
 * n elements are valid; packed has nbytes >= ceil(n / 8) bytes, the bits past n are set to 1.
 * Returns sum(u^2) over the n valid elements.
 */
double co_compensate_pack(const float *x, float *error, uint8_t *packed, int64_t n, int64_t nbytes) {
    double total = 0.0;
    int64_t full = n & ~(int64_t)15; /* multiple of 16 handled by the vector loop */
#ifdef CO_AVX2
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t i0 = 0; i0 < full; i0 += CO_SUM_BLOCK) {
        int64_t i1 = i0 + CO_SUM_BLOCK < full ? i0 + CO_SUM_BLOCK : full;
        __m256 a0 = zero, a1 = zero;
        for (int64_t i = i0; i < i1; i += 16) {
            __m256 u0 = _mm256_loadu_ps(error + i), u1 = _mm256_loadu_ps(error + i + 8);
            if (x) {
                u0 = _mm256_add_ps(_mm256_loadu_ps(x + i), u0);
                u1 = _mm256_add_ps(_mm256_loadu_ps(x + i + 8), u1);
                _mm256_storeu_ps(error + i, u0);
                _mm256_storeu_ps(error + i + 8, u1);
            }
            a0 = _mm256_fmadd_ps(u0, u0, a0);
            a1 = _mm256_fmadd_ps(u1, u1, a1);
            packed[i / 8] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(u0, zero, _CMP_GE_OQ));
            packed[i / 8 + 1] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(u1, zero, _CMP_GE_OQ));
        }
        float part[8];
        _mm256_storeu_ps(part, _mm256_add_ps(a0, a1));
        for (int j = 0; j < 8; ++j) total += part[j];
    }
#else
    for (int64_t i0 = 0; i0 < full; i0 += CO_SUM_BLOCK) {
        int64_t i1 = i0 + CO_SUM_BLOCK < full ? i0 + CO_SUM_BLOCK : full;
        float part[16] = {0};
        for (int64_t i = i0; i < i1; i += 16) {
            unsigned lo = 0, hi = 0;
            for (int j = 0; j < 16; ++j) {
                float u = x ? x[i + j] + error[i + j] : error[i + j];
                error[i + j] = u;
                part[j] += u * u;
                if (j < 8) lo |= (unsigned)(u >= 0.0f) << j;
                else hi |= (unsigned)(u >= 0.0f) << (j - 8);
            }
            packed[i / 8] = (uint8_t)lo;
            packed[i / 8 + 1] = (uint8_t)hi;
        }
        for (int j = 0; j < 16; ++j) total += part[j];
    }
#endif
    for (int64_t i = full; i < n; ++i) {
        float u = x ? x[i] + error[i] : error[i];
        error[i] = u;
        total += (double)u * u;
    }
    for (int64_t b = full / 8; b < nbytes; ++b) packed[b] = sign_byte_tail(error, 8 * b, n);
    return total;
}

/* Worker and server pass 2: error holds u; error <- u - scale * (u >= 0 ? 1 : -1). */
void co_subtract_decompressed(float *error, float scale, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        float u = error[i];
        error[i] = u - (u >= 0.0f ? scale : -scale);
    }
}

/*
 * Server pass 1: error <- z = error + (1/N) sum_i scales[i] * (2 b_i - 1), over the n valid
 * elements of this rank's chunk; b_i is chunk row i of `chunks` (N rows of row_bytes bytes).
 * Then packs the signs of z like co_compensate_pack and returns sum(z^2).
 */
double co_average_compensate_pack(const uint8_t *chunks, const float *scales, int64_t world,
                                  int64_t row_bytes, float *error, uint8_t *packed, int64_t n) {
    float weight[1024];
    float *w = world <= 1024 ? weight : NULL;
    if (!w) return -1.0; /* the caller checks world <= 1024 */
    for (int64_t i = 0; i < world; ++i) w[i] = scales[i] / (float)world;
    int64_t full_bytes = n / 8;
#ifdef CO_AVX2
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int64_t b = 0; b < full_bytes; ++b) {
        __m256 z = _mm256_loadu_ps(error + 8 * b);
        for (int64_t i = 0; i < world; ++i) {
            __m256i m = _mm256_and_si256(_mm256_set1_epi32(chunks[i * row_bytes + b]), lane);
            __m256 pos = _mm256_set1_ps(w[i]);
            __m256 neg = _mm256_set1_ps(-w[i]);
            z = _mm256_add_ps(z, _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, lane))));
        }
        _mm256_storeu_ps(error + 8 * b, z);
    }
#else
    for (int64_t b = 0; b < full_bytes; ++b) {
        float z[8];
        for (int j = 0; j < 8; ++j) z[j] = error[8 * b + j];
        for (int64_t i = 0; i < world; ++i) {
            unsigned byte = chunks[i * row_bytes + b];
            for (int j = 0; j < 8; ++j) z[j] += (byte >> j) & 1u ? w[i] : -w[i];
        }
        for (int j = 0; j < 8; ++j) error[8 * b + j] = z[j];
    }
#endif
    for (int64_t k = 8 * full_bytes; k < n; ++k) {
        float z = error[k];
        for (int64_t i = 0; i < world; ++i)
            z += (chunks[i * row_bytes + k / 8] >> (k % 8)) & 1u ? w[i] : -w[i];
        error[k] = z;
    }
    return co_compensate_pack(NULL, error, packed, n, row_bytes);
}

/*
 * Decompress: out[k] = scales[r] * (2 b_k - 1) for k < n, where row r = k / (8 * row_bytes) starts
 * at packed + r * row_stride and b_k is bit k % (8 * row_bytes) of that row.
 */
void co_decompress(const uint8_t *packed, const float *scales, int64_t rows, int64_t row_bytes,
                   int64_t row_stride, float *out, int64_t n) {
    int64_t chunk = 8 * row_bytes;
    for (int64_t r = 0; r < rows && r * chunk < n; ++r) {
        const uint8_t *row = packed + r * row_stride;
        float *dst = out + r * chunk;
        int64_t valid = n - r * chunk < chunk ? n - r * chunk : chunk;
        int64_t full_bytes = valid / 8;
        float s = scales[r];
#ifdef CO_AVX2
        const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
        for (int64_t b = 0; b < full_bytes; ++b) {
            __m256i m = _mm256_and_si256(_mm256_set1_epi32(row[b]), lane);
            _mm256_storeu_ps(dst + 8 * b, _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, lane))));
        }
#else
        for (int64_t b = 0; b < full_bytes; ++b) {
            unsigned byte = row[b];
            for (int j = 0; j < 8; ++j) dst[8 * b + j] = (byte >> j) & 1u ? s : -s;
        }
#endif
        for (int64_t k = 8 * full_bytes; k < valid; ++k) dst[k] = (row[k / 8] >> (k % 8)) & 1u ? s : -s;
    }
}

/*
 * Segmented passes: segment s is [off[s], off[s + 1]) of a flat buffer, off[0] = 0; per-segment
 * scalars are doubles, used as floats (as torch uses a Python scalar on an fp32 tensor).
 */

/* out[s] = sum of x^2 over segment s, accumulated in double (8 independent lanes: vectorizes):
 * squares of gradients down to 1e-160 stay representable, where fp32 ones would underflow. */
void co_segment_sumsq(const float *x, const int64_t *off, int64_t nseg, double *out) {
    for (int64_t s = 0; s < nseg; ++s) {
        double acc[8] = {0};
        int64_t i = off[s], end = off[s + 1];
        for (; i + 8 <= end; i += 8)
            for (int j = 0; j < 8; ++j) acc[j] += (double)x[i + j] * x[i + j];
        double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < end; ++i) total += (double)x[i] * x[i];
        out[s] = total;
    }
}

/*
 * Gather: segment s of out <- src[s] (times scale when scaled; zeros where src[s] == 0, an
 * address); with sumsq, sumsq[s] = the sum of squares of what was written, as co_segment_sumsq.
 */
void co_gather(const int64_t *srcs, float *out, const int64_t *off, int64_t nseg, float scale, int scaled,
               double *sumsq) {
    for (int64_t s = 0; s < nseg; ++s) {
        const float *restrict src = (const float *)(intptr_t)srcs[s];
        float *restrict o = out + off[s];
        const int64_t n = off[s + 1] - off[s];
        if (!src) {
            memset(o, 0, (size_t)n * sizeof(float));
            if (sumsq) sumsq[s] = 0.0;
            continue;
        }
        const float f = scaled ? scale : 1.0f;
        if (!sumsq) {
            for (int64_t i = 0; i < n; ++i) o[i] = src[i] * f;
            continue;
        }
        double acc[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; ++j) {
                float v = src[i + j] * f;
                o[i + j] = v;
                acc[j] += (double)v * v;
            }
        double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < n; ++i) {
            float v = src[i] * f;
            o[i] = v;
            total += (double)v * v;
        }
        sumsq[s] = total;
    }
}

/*
 * x <- clamp(r * lerp(m, x, w), -b_s, b_s) over segment s, with torch.lerp's formula
 * (m + w (x - m) for |w| < 1/2, else x - (x - m)(1 - w)); NaN stays NaN.
 */
void co_lerp_scale_clamp(float *x, const float *m, float w, const float *r, const double *bounds,
                         const int64_t *off, int64_t nseg) {
    const int small = w < 0.5f && w > -0.5f;
    const float wc = 1.0f - w;
    for (int64_t s = 0; s < nseg; ++s) {
        const float b = (float)bounds[s], nb = -b;
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        float *restrict xs = x + lo;
        const float *restrict ms = m + lo, *restrict rs = r + lo;
        if (small) {
            for (int64_t i = 0; i < n; ++i) {
                float v = rs[i] * (ms[i] + w * (xs[i] - ms[i]));
                xs[i] = v > b ? b : (v < nb ? nb : v);
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                float d = xs[i] - ms[i];
                float v = rs[i] * (xs[i] - d * wc);
                xs[i] = v > b ? b : (v < nb ? nb : v);
            }
        }
    }
}

/* x <- clamp(r * x, -b_s, b_s) over segment s; NaN stays NaN. */
void co_scale_clamp(float *x, const float *r, const double *bounds, const int64_t *off, int64_t nseg) {
    for (int64_t s = 0; s < nseg; ++s) {
        const float b = (float)bounds[s], nb = -b;
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        float *restrict xs = x + lo;
        const float *restrict rs = r + lo;
        for (int64_t i = 0; i < n; ++i) {
            float v = rs[i] * xs[i];
            xs[i] = v > b ? b : (v < nb ? nb : v);
        }
    }
}

/* y / r, or +0 where r == 0: the division is done anyway and masked with integer operations, a
 * form compilers vectorize (a float select after a division that may trap they do not). */
static inline float quotient_or_zero(float y, float r) {
    float q = y / r;
    uint32_t bits;
    memcpy(&bits, &q, sizeof bits);
    bits &= -(uint32_t)(r != 0.0f);
    memcpy(&q, &bits, sizeof q);
    return q;
}

/* q <- y / r, 0 where r == 0, over n elements; q may be y itself. */
void co_divide_where_nonzero(float *y, const float *r, float *q, int64_t n) {
    if (q == y) {
        float *restrict ys = y;
        const float *restrict rs = r;
        for (int64_t i = 0; i < n; ++i) ys[i] = quotient_or_zero(ys[i], rs[i]);
    } else {
        const float *restrict ys = y, *restrict rs = r;
        float *restrict qs = q;
        for (int64_t i = 0; i < n; ++i) qs[i] = quotient_or_zero(ys[i], rs[i]);
    }
}
