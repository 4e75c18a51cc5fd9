/*
 * CPU kernels of error-feedback 1-bit compression (docs/design.md 2.1, 2.2), and the segmented
 * element-wise passes around it (compressed_opt.cuda.segmented).
 *
 * Compiled at first use by compressed_opt.cuda.cpu with the system C compiler and loaded with
 * ctypes. Same contract as the CUDA kernels in onebit.cu and compressed_opt.cuda.reference:
 *   a buffer of world chunks travels as world rows, row j = [nb fp32 scales | chunk j's bits],
 *   nb = ceil(chunk / block), one scale per block of a chunk;
 *   bit k of a row's bits is bit (k % 8) of byte k / 8 (little bit order);
 *   bit = 1 iff u >= 0 (zero counts as +), 1 for invalid elements; value = scale * (2 bit - 1).
 * A compression walks each block twice while it is in cache: pass 1 forms u, packs its signs and
 * sums u^2, which gives the block's scale sqrt(sum / count); pass 2 turns u into the new error
 * u - scale * sign(u). The AVX2 paths are used when compiled with -march on a CPU that has it;
 * the scalar paths give bit-identical results (the sum of squares may differ in rounding).
 */
#include <math.h>
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
 * Compensate and pack n elements: error <- u = x + error (x == NULL means x = 0); packed <- the
 * signs of u, nbytes >= ceil(n / 8) bytes, the bits past n set to 1. Returns sum(u^2).
 */
static double compensate_pack(const float *x, float *error, uint8_t *packed, int64_t n, int64_t nbytes) {
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

/* error holds u; error <- u - scale * (u >= 0 ? 1 : -1), over n elements. */
static void subtract_decompressed(float *error, float scale, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        float u = error[i];
        error[i] = u - (u >= 0.0f ? scale : -scale);
    }
}

/*
 * Rows: chunk j of a buffer travels as row j, nb = ceil(chunk / block) fp32 scales (4 nb bytes)
 * then chunk / 8 bytes of bits; block b of a chunk is its elements [b block, min((b+1) block,
 * chunk)). chunk and block are multiples of 8 (the callers: of 32 and of 256).
 */
static int64_t blocks_of(int64_t chunk, int64_t block) { return (chunk + block - 1) / block; }

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* How many of the len elements starting at lo are among the first n: clamp(n - lo, 0, len). */
static int64_t valid_in(int64_t n, int64_t lo, int64_t len) { return n <= lo ? 0 : min64(n - lo, len); }

static float load_scale(const uint8_t *p) {
    float s;
    memcpy(&s, p, sizeof s);
    return s;
}

/*
 * The local momentum of the preconditioned exchange, clamp(c_s (r lerp(m, x, w)), -b_s, b_s), with
 * torch.lerp's two formulas (m + w (x - m) for |w| < 1/2, else x - (x - m)(1 - w)): one element.
 * co_lerp_scale_clamp and the pass fused into compression (co_lerp_scale_clamp_compress_rows) both
 * call these, so that the compiler forms (and contracts) the same expressions in both.
 */
static inline float clamp_to(float v, float b, float nb) { return v > b ? b : (v < nb ? nb : v); }

static inline float lsc_small(float x, float m, float w, float r, float c, float b, float nb) {
    return clamp_to(c * (r * (m + w * (x - m))), b, nb);
}

static inline float lsc_large(float x, float m, float wc, float r, float c, float b, float nb) {
    float d = x - m;
    return clamp_to(c * (r * (x - d * wc)), b, nb);
}

/* lerp(m, x, w) alone, torch.lerp's formulas (the fused pass without r, clamp and scale; what
 * torch.lerp computes only where it contracts as this does: the caller checks, see segmented.Lerp). */
static inline float lerp_small(float x, float m, float w) { return m + w * (x - m); }

static inline float lerp_large(float x, float m, float wc) {
    float d = x - m;
    return x - d * wc;
}

/* clamp(r x, -b, b): co_scale_clamp's element, and the fused pass's without lerp. */
static inline float sc_value(float x, float r, float b, float nb) { return clamp_to(r * x, b, nb); }

/*
 * A segmented lerp_scale_clamp pass (m != NULL) or scale_clamp pass (m == NULL: w and scales
 * unused), or a lerp alone (r == NULL: bounds and scales unused) over a flat buffer, run block by block inside a compression instead of over the whole
 * buffer before it: segment s is [off[s], off[s + 1]); elements past off[nseg] are x itself.
 * seg: the segment of the last element formed (blocks come in order).
 */
struct co_lsc {
    const float *x, *m, *r;
    float w;
    const double *bounds, *scales; /* scales == NULL: c_s = 1 */
    const int64_t *off;
    int64_t nseg, seg;
};

/*
 * error[0, len) <- u = v + error[0, len), v the pass's values of elements [lo, lo + len) of the flat
 * buffer (error: the worker error of element lo): compress_rows' compensation u = x + error with
 * the pass's x, in the loop that reads the pass's inputs (every stream read once, at once).
 */
static void lsc_compensate(struct co_lsc *p, int64_t lo, int64_t len, float *restrict error) {
    const int small = p->w < 0.5f && p->w > -0.5f;
    const float w = p->w, wc = 1.0f - p->w;
    const int64_t end = lo + len;
    int64_t k = lo, s = p->seg;
    while (k < end) {
        while (s < p->nseg && p->off[s + 1] <= k) ++s;
        float *restrict e = error + (k - lo);
        const float *restrict xs = p->x + k;
        if (s >= p->nseg) { /* past the segments: x as it is */
            for (int64_t i = 0; i < end - k; ++i) e[i] = xs[i] + e[i];
            break;
        }
        const int64_t stop = p->off[s + 1] < end ? p->off[s + 1] : end, n = stop - k;
        if (!p->r) {
            const float *restrict ms = p->m + k;
            if (small) {
                for (int64_t i = 0; i < n; ++i) e[i] = lerp_small(xs[i], ms[i], w) + e[i];
            } else {
                for (int64_t i = 0; i < n; ++i) e[i] = lerp_large(xs[i], ms[i], wc) + e[i];
            }
            k = stop;
            continue;
        }
        const float b = (float)p->bounds[s], nb = -b, c = p->scales ? (float)p->scales[s] : 1.0f;
        const float *restrict rs = p->r + k;
        if (!p->m) {
            for (int64_t i = 0; i < n; ++i) e[i] = sc_value(xs[i], rs[i], b, nb) + e[i];
            k = stop;
            continue;
        }
        const float *restrict ms = p->m + k;
        if (small) {
            for (int64_t i = 0; i < n; ++i) e[i] = lsc_small(xs[i], ms[i], w, rs[i], c, b, nb) + e[i];
        } else {
            for (int64_t i = 0; i < n; ++i) e[i] = lsc_large(xs[i], ms[i], wc, rs[i], c, b, nb) + e[i];
        }
        k = stop;
    }
    p->seg = s;
}

/*
 * A pass fused into a compression (co_lsc, 0/1 Adam's zo_before): error[0, len) <- u = v + error,
 * v the pass's values of the flat buffer's elements [lo, lo + len), formed as the block is
 * compensated. pass is the pass's own state.
 */
typedef void (*co_compensate)(void *pass, int64_t lo, int64_t len, float *error);

static void lsc_compensate_any(void *pass, int64_t lo, int64_t len, float *error) {
    lsc_compensate((struct co_lsc *)pass, lo, len, error);
}

/*
 * Compress one block of count valid elements (of len) held in error (u after compensate, or to
 * be compensated with xb): pack its bits into bits, its scale sqrt(sum(u^2) / count) into scale
 * (4 bytes), and subtract the decompressed values while the block is in cache. With compensate
 * (then xb is NULL): the pass's values of the buffer's elements from first on are formed and added
 * to the error as the block is compensated, so that they never travel to memory; the same
 * arithmetic as the pass, then the compression. No valid element: scale 0, bits 1.
 */
static void compress_block(const float *xb, float *error, uint8_t *scale, uint8_t *bits, int64_t len,
                           int64_t count, co_compensate compensate, void *pass, int64_t first) {
    float s = 0.0f;
    if (count > 0) {
        if (compensate) compensate(pass, first, count, error); /* then error holds u */
        double sumsq = compensate_pack(xb, error, bits, count, len / 8);
        s = (float)sqrt(sumsq / (double)count);
        subtract_decompressed(error, s, count);
    } else {
        memset(bits, 0xFF, (size_t)(len / 8));
    }
    memcpy(scale, &s, sizeof s);
}

/* compress_block over the blocks of one chunk, its valid elements [0, valid) (scales: 4 bytes each). */
static void compress_chunk(const float *x, float *error, uint8_t *scales, uint8_t *bits, int64_t chunk,
                           int64_t block, int64_t valid, co_compensate compensate, void *pass, int64_t first) {
    const int64_t nb = blocks_of(chunk, block);
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * block, len = min64(chunk - lo, block), count = valid_in(valid, lo, len);
        compress_block(x && count ? x + lo : NULL, error + lo, scales + 4 * b, bits + lo / 8, len, count, compensate,
                       pass, first + lo);
    }
}

/* Each of world rows (row_stride bytes apart) <- its chunk of the n valid elements, compressed
 * (compress_chunk; empty chunks: rows of scale 0). */
static void compress_each_row(const float *x, float *error, uint8_t *rows, int64_t row_stride, int64_t world,
                              int64_t chunk, int64_t block, int64_t n, co_compensate compensate, void *pass) {
    const int64_t nb = blocks_of(chunk, block);
    for (int64_t j = 0; j < world; ++j) {
        const int64_t lo = j * chunk, valid = valid_in(n, lo, chunk);
        uint8_t *row = rows + j * row_stride;
        const int64_t at = valid ? lo : 0; /* (no pointer past the buffers for empty chunks) */
        compress_chunk(x ? x + at : NULL, error + at, row, row + 4 * nb, chunk, block, valid, compensate, pass, at);
    }
}

/*
 * Worker: error <- u = x + error over the n valid elements of world chunks (x == NULL: x = 0);
 * row j of rows (row_stride bytes apart) <- chunk j compressed; error <- u - C(u).
 */
void co_compress_rows(const float *x, float *error, uint8_t *rows, int64_t row_stride, int64_t world,
                      int64_t chunk, int64_t block, int64_t n) {
    compress_each_row(x, error, rows, row_stride, world, chunk, block, n, NULL, NULL);
}

/*
 * co_lerp_scale_clamp(x, m, w, r, bounds, scales, off, nseg) then co_compress_rows(x, error, rows,
 * row_stride, world, chunk, block, n), bit for bit, in one pass over memory: per block, the pass's
 * values are formed and added to the error in one loop (error <- u), then packed, summed and
 * corrected while the block is in cache, as co_compress_rows does with x == NULL. x is only read
 * (not written): reads x, m, r and error once, writes error and the rows (5 streams where the two
 * passes take 7).
 */
void co_lerp_scale_clamp_compress_rows(const float *x, const float *m, float w, const float *r, const double *bounds,
                                      const double *scales, const int64_t *off, int64_t nseg, float *error,
                                      uint8_t *rows, int64_t row_stride, int64_t world, int64_t chunk, int64_t block,
                                      int64_t n) {
    struct co_lsc pass = {x, m, r, w, bounds, scales, off, nseg, 0};
    compress_each_row(NULL, error, rows, row_stride, world, chunk, block, n, lsc_compensate_any, &pass);
}

/* x[0, m_n) <- lerp(m, x, w) (torch.lerp's formulas, as this compiler contracts them), then
 * co_compress_rows(x, error, ...), in one pass over memory as co_lerp_scale_clamp_compress_rows (x
 * only read). */
void co_lerp_compress_rows(const float *x, const float *m, float w, int64_t m_n, float *error, uint8_t *rows,
                           int64_t row_stride, int64_t world, int64_t chunk, int64_t block, int64_t n) {
    const int64_t off[2] = {0, m_n};
    co_lerp_scale_clamp_compress_rows(x, m, w, NULL, NULL, NULL, off, 1, error, rows, row_stride, world, chunk, block,
                                      n);
}

/* co_scale_clamp(x, r, bounds, off, nseg) then co_compress_rows(x, error, ...), bit for bit, in one
 * pass over memory as co_lerp_scale_clamp_compress_rows (x only read). */
void co_scale_clamp_compress_rows(const float *x, const float *r, const double *bounds, const int64_t *off,
                                  int64_t nseg, float *error, uint8_t *rows, int64_t row_stride, int64_t world,
                                  int64_t chunk, int64_t block, int64_t n) {
    co_lerp_scale_clamp_compress_rows(x, NULL, 0.0f, r, bounds, NULL, off, nseg, error, rows, row_stride, world, chunk,
                                      block, n);
}

/*
 * Server: over the m valid elements of this rank's chunk, error <- z = error + sum_i w_ib (2 b_i - 1),
 * w_ib = (scale b of row i) / world, added in rank order i = 0, 1, ...; b_i the bits of row i of
 * rows (world rows, row_stride bytes apart); each block then compressed while it is in cache: out_row
 * <- z compressed, error <- z - C(z).
 * Returns -1 if world > 1024 (the caller checks), else 0.
 */
int co_average_compress_rows(const uint8_t *rows, int64_t row_stride, int64_t world, int64_t chunk,
                             int64_t block, float *error, uint8_t *out_row, int64_t m) {
    float w[1024];
    if (world > 1024) return -1;
    const int64_t nb = blocks_of(chunk, block);
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * block, len = min64(chunk - lo, block), count = valid_in(m, lo, len);
        if (count == 0) { /* (past the valid elements: a block of scale 0, its bits 1) */
            compress_block(NULL, error + lo, out_row + 4 * b, out_row + 4 * nb + lo / 8, len, 0, NULL, NULL, 0);
            continue;
        }
        for (int64_t i = 0; i < world; ++i) w[i] = load_scale(rows + i * row_stride + 4 * b) / (float)world;
        float *z = error + lo;
        const int64_t byte0 = 4 * nb + lo / 8, full_bytes = count / 8;
#ifdef CO_AVX2
        const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (int64_t k = 0; k < full_bytes; ++k) {
            __m256 acc = _mm256_loadu_ps(z + 8 * k);
            for (int64_t i = 0; i < world; ++i) {
                __m256i bitm = _mm256_and_si256(_mm256_set1_epi32(rows[i * row_stride + byte0 + k]), lane);
                __m256 pos = _mm256_set1_ps(w[i]);
                __m256 neg = _mm256_set1_ps(-w[i]);
                acc = _mm256_add_ps(acc, _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(bitm, lane))));
            }
            _mm256_storeu_ps(z + 8 * k, acc);
        }
#else
        for (int64_t k = 0; k < full_bytes; ++k) {
            float v[8];
            for (int j = 0; j < 8; ++j) v[j] = z[8 * k + j];
            for (int64_t i = 0; i < world; ++i) {
                unsigned byte = rows[i * row_stride + byte0 + k];
                for (int j = 0; j < 8; ++j) v[j] += (byte >> j) & 1u ? w[i] : -w[i];
            }
            for (int j = 0; j < 8; ++j) z[8 * k + j] = v[j];
        }
#endif
        for (int64_t e = 8 * full_bytes; e < count; ++e) {
            float v = z[e];
            for (int64_t i = 0; i < world; ++i)
                v += (rows[i * row_stride + byte0 + e / 8] >> (e % 8)) & 1u ? w[i] : -w[i];
            z[e] = v;
        }
        /* compressed while the block is in cache: one pass over the error, not two */
        compress_block(NULL, z, out_row + 4 * b, out_row + 4 * nb + lo / 8, len, count, NULL, NULL, 0);
    }
    return 0;
}

/* dst[k] <- s (2 b_k - 1) for k < count, b_k bit k % 8 of src[k / 8] (one block's elements, from its first). */
static void expand_signs(const uint8_t *src, float s, float *dst, int64_t count) {
    const int64_t full_bytes = count / 8;
#ifdef CO_AVX2
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 pos = _mm256_set1_ps(s), neg = _mm256_set1_ps(-s);
    for (int64_t k = 0; k < full_bytes; ++k) {
        __m256i m = _mm256_and_si256(_mm256_set1_epi32(src[k]), lane);
        _mm256_storeu_ps(dst + 8 * k, _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, lane))));
    }
#else
    for (int64_t k = 0; k < full_bytes; ++k) {
        unsigned byte = src[k];
        for (int j = 0; j < 8; ++j) dst[8 * k + j] = (byte >> j) & 1u ? s : -s;
    }
#endif
    for (int64_t e = 8 * full_bytes; e < count; ++e) dst[e] = (src[e / 8] >> (e % 8)) & 1u ? s : -s;
}

/*
 * Decompress: out[k] = s (2 b_k - 1) for k < n, with row r = k / chunk (row_stride bytes apart),
 * s the scale of block (k % chunk) / block of row r, b_k bit k % chunk of row r's bits.
 */
void co_decompress_rows(const uint8_t *rows, int64_t row_stride, int64_t nrows, int64_t chunk, int64_t block,
                        float *out, int64_t n) {
    const int64_t nb = blocks_of(chunk, block);
    for (int64_t r = 0; r < nrows && r * chunk < n; ++r) {
        const uint8_t *row = rows + r * row_stride;
        const uint8_t *bits = row + 4 * nb;
        const int64_t valid = min64(n - r * chunk, chunk);
        for (int64_t b = 0; b * block < valid; ++b) {
            const int64_t lo = b * block, count = min64(valid - lo, block);
            expand_signs(bits + lo / 8, load_scale(row + 4 * b), out + r * chunk + lo, count);
        }
    }
}

/*
 * Segmented passes: segment s is [off[s], off[s + 1]) of a flat buffer, off[0] = 0; per-segment
 * scalars are doubles, used as floats (as torch uses a Python scalar on an fp32 tensor).
 */

/* out[s] = sum of x^2 over segment s, accumulated in double (8 independent lanes: vectorizes):
 * squares of gradients down to 1e-160 stay representable, where fp32 ones would underflow. */
static double sumsq_f64(const float *restrict x, int64_t n) {
    double acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += (double)x[i + j] * x[i + j];
    double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) total += (double)x[i] * x[i];
    return total;
}

void co_segment_sumsq(const float *x, const int64_t *off, int64_t nseg, double *out) {
    for (int64_t s = 0; s < nseg; ++s) out[s] = sumsq_f64(x + off[s], off[s + 1] - off[s]);
}

/* out[s] = the sum of squares of the off[s + 1] - off[s] floats at address srcs[s] (0 for a NULL
 * address), as co_segment_sumsq and co_gather's sumsq accumulate them: one read of each tensor,
 * where torch's float64 norm of an fp32 tensor first copies it to float64. */
void co_sumsq_each(const int64_t *srcs, const int64_t *off, int64_t nseg, double *out) {
    for (int64_t s = 0; s < nseg; ++s) {
        const float *src = (const float *)(intptr_t)srcs[s];
        out[s] = src ? sumsq_f64(src, off[s + 1] - off[s]) : 0.0;
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
 * x <- clamp(c_s * (r * lerp(m, x, w)), -b_s, b_s) over segment s, with torch.lerp's formula
 * (m + w (x - m) for |w| < 1/2, else x - (x - m)(1 - w)); NaN stays NaN. scales == NULL: c_s = 1
 * (a multiplication by 1 is exact, so the result is the unscaled one bit for bit).
 */
void co_lerp_scale_clamp(float *x, const float *m, float w, const float *r, const double *bounds,
                         const double *scales, const int64_t *off, int64_t nseg) {
    const int small = w < 0.5f && w > -0.5f;
    const float wc = 1.0f - w;
    for (int64_t s = 0; s < nseg; ++s) {
        const float b = (float)bounds[s], nb = -b, c = scales ? (float)scales[s] : 1.0f;
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        float *restrict xs = x + lo;
        const float *restrict ms = m + lo, *restrict rs = r + lo;
        if (small) {
            for (int64_t i = 0; i < n; ++i) xs[i] = lsc_small(xs[i], ms[i], w, rs[i], c, b, nb);
        } else {
            for (int64_t i = 0; i < n; ++i) xs[i] = lsc_large(xs[i], ms[i], wc, rs[i], c, b, nb);
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
        for (int64_t i = 0; i < n; ++i) xs[i] = sc_value(xs[i], rs[i], b, nb);
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

/* (y / r) / c_s over segment s, or +0 where r == 0 (q may be y). */
void co_divide_where_nonzero_segments(float *y, const float *r, float *q, const double *divisors,
                                      const int64_t *off, int64_t nseg) {
    for (int64_t s = 0; s < nseg; ++s) {
        const float c = (float)divisors[s];
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        if (q == y) {
            float *restrict ys = y + lo;
            const float *restrict rs = r + lo;
            for (int64_t i = 0; i < n; ++i) ys[i] = quotient_or_zero(ys[i], rs[i]) / c;
        } else {
            const float *restrict ys = y + lo, *restrict rs = r + lo;
            float *restrict qs = q + lo;
            for (int64_t i = 0; i < n; ++i) qs[i] = quotient_or_zero(ys[i], rs[i]) / c;
        }
    }
}

/* One element of co_descend_scaled (and co_divide_descend: the compiler forms both alike). */
static inline float descend_decayed(float p, float d, float c, float y, float a) { return p * d + (c * y) * a; }

static inline float descend_plain(float p, float c, float y, float a) { return p + (c * y) * a; }

/*
 * p_s <- p_s d + (c_s y) a over segment s, written through the segment's own pointer dests[s]
 * (a parameter's memory, as co_gather reads it): the update of the preconditioned exchange in one
 * pass, where PyTorch takes two (a multiplication by d, then addcmul). decayed == 0: no
 * multiplication by d (d == 1). A NULL pointer (a parameter without elements) is skipped.
 */
void co_descend_scaled(const int64_t *dests, const float *y, const float *a, const int64_t *off, int64_t nseg,
                       float d, int decayed, const double *scales) {
    for (int64_t s = 0; s < nseg; ++s) {
        float *restrict p = (float *)(intptr_t)dests[s];
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        if (!p || n == 0) continue;
        const float c = (float)scales[s];
        const float *restrict ys = y + lo, *restrict as = a + lo;
        if (decayed) {
            for (int64_t i = 0; i < n; ++i) p[i] = descend_decayed(p[i], d, c, ys[i], as[i]);
        } else {
            for (int64_t i = 0; i < n; ++i) p[i] = descend_plain(p[i], c, ys[i], as[i]);
        }
    }
}

/*
 * The elements [0, n) of one segment: q <- (y / r) / v (0 where r == 0; no division by v when
 * divided == 0), p <- p d + (c y) a (decayed == 0: p + (c y) a), y read once.
 */
static void divide_descend_span(const float *restrict ys, const float *restrict rs, float *restrict qs,
                                float *restrict p, const float *restrict as, int64_t n, int divided, float v,
                                float c, float d, int decayed) {
    if (divided && decayed) {
        for (int64_t i = 0; i < n; ++i) {
            const float yi = ys[i];
            qs[i] = quotient_or_zero(yi, rs[i]) / v;
            p[i] = descend_decayed(p[i], d, c, yi, as[i]);
        }
    } else if (divided) {
        for (int64_t i = 0; i < n; ++i) {
            const float yi = ys[i];
            qs[i] = quotient_or_zero(yi, rs[i]) / v;
            p[i] = descend_plain(p[i], c, yi, as[i]);
        }
    } else if (decayed) {
        for (int64_t i = 0; i < n; ++i) {
            const float yi = ys[i];
            qs[i] = quotient_or_zero(yi, rs[i]);
            p[i] = descend_decayed(p[i], d, c, yi, as[i]);
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            const float yi = ys[i];
            qs[i] = quotient_or_zero(yi, rs[i]);
            p[i] = descend_plain(p[i], c, yi, as[i]);
        }
    }
}

/*
 * co_divide_where_nonzero_segments(y, r, q, divisors, off, nseg) (divisors == NULL: no division by
 * them, co_divide_where_nonzero's values) and co_descend_scaled(dests, y, a, off, nseg, d, decayed,
 * scales), bit for bit, in one pass: reads y, r, a and each destination once, writes q and the
 * destinations (the preconditioned exchange's m = y / (s_l R) and its update). q must not be y; only
 * the segments' elements of q are written.
 */
void co_divide_descend(const float *y, const float *r, float *q, const double *divisors, const int64_t *off,
                       int64_t nseg, const int64_t *dests, const float *a, float d, int decayed, const double *scales) {
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        if (n == 0) continue;
        divide_descend_span(y + lo, r + lo, q + lo, (float *)(intptr_t)dests[s], a + lo, n, divisors != NULL,
                            divisors ? (float)divisors[s] : 1.0f, (float)scales[s], d, decayed);
    }
}

#define CO_TILE 256 /* elements of y decompressed at once into a stack tile (1 KiB: in L1) */

/*
 * co_decompress_rows(rows, row_stride, nrows, chunk, block, y, off[nseg]) then co_divide_descend(y,
 * r, q, divisors, off, nseg, dests, a, d, decayed, scales), bit for bit, without y in memory: y is
 * decompressed tile by tile (at most CO_TILE elements of one block of one row) into the stack and
 * consumed there (reads r, a, each destination and the rows; writes q and the destinations).
 */
void co_rows_divide_descend(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block, const float *r,
                            float *q, const double *divisors, const int64_t *off, int64_t nseg, const int64_t *dests,
                            const float *a, float d, int decayed, const double *scales) {
    const int64_t nb = blocks_of(chunk, block), n = off[nseg];
    float tile[CO_TILE];
    int64_t s = 0;
    for (int64_t k0 = 0; k0 < n;) {
        const int64_t j = k0 / chunk, in_chunk = k0 - j * chunk, b = in_chunk / block;
        const int64_t len = min64(min64(CO_TILE, (b + 1) * block - in_chunk), min64(chunk - in_chunk, n - k0));
        const uint8_t *row = rows + j * row_stride;
        expand_signs(row + 4 * nb + in_chunk / 8, load_scale(row + 4 * b), tile, len);
        const int64_t end = k0 + len;
        for (int64_t k = k0; k < end;) {
            while (off[s + 1] <= k) ++s;
            const int64_t stop = min64(off[s + 1], end), lo = off[s];
            divide_descend_span(tile + (k - k0), r + k, q + k, (float *)(intptr_t)dests[s] + (k - lo), a + k, stop - k,
                                divisors != NULL, divisors ? (float)divisors[s] : 1.0f, (float)scales[s], d, decayed);
            k = stop;
        }
        k0 = end;
    }
}

/*
 * ---- 1-bit LAMB's compression-stage passes (compressed_opt.cuda.lamb_passes) ----
 *
 * Self-contained: its own helpers (lamb_*), and its own rounding rule. Every operation is one
 * rounded IEEE operation in the order the PyTorch composition it replaces runs them (one kernel
 * per operation), so that m, v and the parameters are that composition's bit for bit:
 * - no contraction of a multiplication and an addition into an FMA where PyTorch rounds both
 *   (fp-contract off for these functions: GCC's -O3 -march=native would contract otherwise);
 * - an explicit fmaf where PyTorch's kernel is one FMA: torch.add(a, b, alpha) is fma(b, alpha,
 *   a), addcmul_(t, t, value) is fma(value * t, t, self), in its vector loops and tails alike
 *   (measured: torch 2.13 on AVX2).
 * sqrtf is correctly rounded, PyTorch's fp32 sqrt is not (one ulp off in about one element in
 * five): the factor's maxima are within 2^-20 of the composition's. compressed_opt.cuda.lamb_passes
 * checks all of that at first use and composes in PyTorch where it does not hold.
 * Scalars arrive as float (PyTorch rounds a Python scalar to the tensor's fp32 the same way).
 */
#include <float.h>

#if defined(__clang__)
#define LAMB_EXACT
#define LAMB_NO_CONTRACT _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define LAMB_EXACT __attribute__((optimize("fp-contract=off")))
#define LAMB_NO_CONTRACT
#else
#define LAMB_EXACT
#define LAMB_NO_CONTRACT
#endif

/* torch.nan_to_num(x, nan=0, posinf=0) (neginf: the lowest float), as a max's operand. */
static inline LAMB_EXACT float lamb_finite_or_zero(float x) {
    float z = (x != x || x == INFINITY) ? 0.0f : x;
    return z == -INFINITY ? -FLT_MAX : z;
}

/* The scalars of co_lamb_variance_maxima's element, and the element itself (see there). */
struct lamb_scalars {
    float nb1, b2, scale, bc2_sqrt, eps;
};

static inline LAMB_EXACT float lamb_element(float mt, float *mp, float *vp, float d, const struct lamb_scalars *k) {
    LAMB_NO_CONTRACT
    const float g = fmaf(*mp, k->nb1, mt);
    *mp = mt;
    const float decayed = *vp * k->b2;
    const float sg = k->scale * g;
    const float vn = fmaf(sg, g, decayed);
    *vp = vn;
    const float root = sqrtf(vn);
    const float unbiased = root / k->bc2_sqrt;
    const float q = unbiased + k->eps;
    return lamb_finite_or_zero(d / q);
}

#ifdef CO_AVX2
/* Eight elements of co_lamb_variance_maxima at once, the same operations (the same roundings). */
static inline LAMB_EXACT __m256 lamb_element8(__m256 mt, float *mp, float *vp, const float *dp,
                                              const struct lamb_scalars *k) {
    const __m256 g = _mm256_fmadd_ps(_mm256_loadu_ps(mp), _mm256_set1_ps(k->nb1), mt);
    _mm256_storeu_ps(mp, mt);
    const __m256 decayed = _mm256_mul_ps(_mm256_loadu_ps(vp), _mm256_set1_ps(k->b2));
    const __m256 vn = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k->scale), g), g, decayed);
    _mm256_storeu_ps(vp, vn);
    const __m256 q = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vn), _mm256_set1_ps(k->bc2_sqrt)),
                                   _mm256_set1_ps(k->eps));
    __m256 f = _mm256_div_ps(_mm256_loadu_ps(dp), q);
    const __m256 bad = _mm256_or_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q),
                                    _mm256_cmp_ps(f, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
    f = _mm256_andnot_ps(bad, f);
    return _mm256_blendv_ps(f, _mm256_set1_ps(-FLT_MAX), _mm256_cmp_ps(f, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}
#endif

/*
 * Over segment s = [off[s], off[s + 1]) of the flat buffers, for each element:
 *   m_t  = y / r (+0 where r == 0)             r != NULL: the preconditioned exchange
 *        = y / c_s                              r == NULL, divisors != NULL: the momentum exchange
 *        = y                                    neither
 *   g    = fma(m_prev, -b1, m_t)                torch.add(m_t, m_prev, alpha=-b1): (1 - b1) g~
 *   v    = fma(scale * g, g, v * b2)            v.mul_(b2).addcmul_(g, g, value=scale)
 *   q    = (sqrt(v) / bc2_sqrt) + eps           torch.sqrt(v).div_(bc2_sqrt).add_(eps)
 *   f    = nan_to_num(denom / q, nan=0, posinf=0)
 *   m    <- m_t (m held m_prev); v written; nothing else is written (g, q and f stay in registers)
 * and maxima[s] = max of f over the segment (1 for an empty segment: what the composition's
 * per-layer maximum gives an empty layer). m, v, y, r and denom: fp32, numel off[nseg] each.
 */
LAMB_EXACT void co_lamb_variance_maxima(const float *y, const float *r, const double *divisors, float *m, float *v,
                                        const float *denom, const int64_t *off, int64_t nseg, float b1, float b2,
                                        float scale, float bc2_sqrt, float eps, float *maxima) {
    LAMB_NO_CONTRACT
    const struct lamb_scalars k = {-b1, b2, scale, bc2_sqrt, eps};
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        if (n == 0) {
            maxima[s] = 1.0f;
            continue;
        }
        const float c = divisors ? (float)divisors[s] : 1.0f;
        const float *ys = y + lo, *ds = denom + lo, *rs = r ? r + lo : NULL;
        float *ms = m + lo, *vs = v + lo;
        float best = -INFINITY;
        int64_t i = 0;
#ifdef CO_AVX2
        __m256 best8 = _mm256_set1_ps(-INFINITY);
        const __m256 zero = _mm256_setzero_ps(), cv = _mm256_set1_ps(c);
        for (; i + 8 <= n; i += 8) {
            __m256 mt = _mm256_loadu_ps(ys + i);
            if (rs) {
                const __m256 rv = _mm256_loadu_ps(rs + i);
                mt = _mm256_and_ps(_mm256_div_ps(mt, rv), _mm256_cmp_ps(rv, zero, _CMP_NEQ_UQ));
            } else if (divisors) {
                mt = _mm256_div_ps(mt, cv);
            }
            best8 = _mm256_max_ps(lamb_element8(mt, ms + i, vs + i, ds + i, &k), best8);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, best8);
        for (int j = 0; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
#endif
        for (; i < n; ++i) {
            const float mt = rs ? quotient_or_zero(ys[i], rs[i]) : divisors ? ys[i] / c : ys[i];
            const float f = lamb_element(mt, ms + i, vs + i, ds[i], &k);
            best = f > best ? f : best;
        }
        maxima[s] = best;
    }
}

/*
 * The update, written through each segment's own pointer dests[s] (a parameter's memory; 0: a
 * parameter without elements, skipped): over segment s,
 *   u = (m / denom) * alpha_s;   p <- (p * decay_s) + u      (decays == NULL: p <- p + u)
 * each operation rounded as torch.div, then torch._foreach_mul_ of the parameters and of the
 * direction's views, then torch._foreach_add_ round them. alpha_s, decay_s: doubles, used as floats.
 */
LAMB_EXACT void co_lamb_descend(const int64_t *dests, const float *m, const float *denom, const int64_t *off,
                                int64_t nseg, const double *decays, const double *alphas) {
    LAMB_NO_CONTRACT
    for (int64_t s = 0; s < nseg; ++s) {
        float *restrict p = (float *)(intptr_t)dests[s];
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        if (!p || n == 0) continue;
        const float a = (float)alphas[s];
        const float *restrict ms = m + lo, *restrict ds = denom + lo;
        if (decays) {
            const float d = (float)decays[s];
            for (int64_t i = 0; i < n; ++i) {
                const float direction = ms[i] / ds[i];
                const float u = direction * a;
                const float kept = p[i] * d;
                p[i] = kept + u;
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                const float direction = ms[i] / ds[i];
                const float u = direction * a;
                p[i] = p[i] + u;
            }
        }
    }
}

/*
 * ---- 0/1 Adam's phase-B passes (compressed_opt.cuda.local_steps) ----
 *
 * One pass over a bucket for each of: a local step, the step's work before its synchronisation's
 * exchange, and the work after it. Segment s is [off[s], off[s + 1]) of the flat buffers, one
 * parameter; per-segment scalars are doubles used as floats (as torch uses a Python scalar on an
 * fp32 tensor); dests[s] is the address of segment s's parameter (0: none, then nothing of it is
 * written). sden is the frozen denominator sqrt(v) + eps as PyTorch made it, its sign bit set
 * where v == 0: den = |sden|, and a negative sden marks a coordinate without variance (m and the
 * exchanged y are 0 there), one stream for both. (PyTorch's sqrt is not the correctly rounded
 * sqrtf on every build, MKL's is not: the passes take PyTorch's.)
 *
 * Rounding: each operation is rounded on its own, in the order of the PyTorch composition
 * (compressed_opt/zero_one_local.py), so that the results are that composition's bit for bit; no
 * contraction into FMA (fp-contract off: GCC's attribute, the STDC pragma for clang) but the
 * lerp's, written as torch's vector kernel computes it on CPUs with FMA: fma(w, g - m, m) for
 * |w| < 1/2, else fma(w - 1, g - m, g).
 */
#if defined(__GNUC__) && !defined(__clang__)
#define ZO_PASS __attribute__((optimize("-ffp-contract=off")))
#else
#define ZO_PASS
#endif
#ifdef __clang__
#define ZO_NO_CONTRACT _Pragma("STDC FP_CONTRACT OFF")
#else
#define ZO_NO_CONTRACT
#endif

/* x where sden's sign bit is clear (v != 0), else +0: masked with integer operations (a float
 * select after a comparison, which may trap, is a branch to GCC's vectorizer; see quotient_or_zero). */
static inline __attribute__((always_inline)) float zo_where_variance(float x, float sden) {
    uint32_t bits, sign;
    memcpy(&bits, &x, sizeof bits);
    memcpy(&sign, &sden, sizeof sign);
    bits &= (sign >> 31) - 1u;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* m <- lerp(m, g, w) as torch's vector kernel (coeff, base: w, m or w - 1, g), 0 where v == 0. */
#define ZO_MOMENTUM(mi, mk, gk, sk, coeff, small)                                                                   \
    const float mi##_m = (mk), mi##_g = (gk);                                                                       \
    const float mi = zo_where_variance(fmaf((coeff), mi##_g - mi##_m, (small) ? mi##_m : mi##_g), (sk))

/*
 * A local step (no synchronisation), per element of segment s (c_s = steps[s], as a float):
 *   m <- lerp(m, g, w), 0 where v == 0;      den = |sden|
 *   acc <- acc + (lr * m) / den
 *   p <- p * decay (when decayed);  p <- p + (c_s * m) / den      (c_s = -lr f_s)
 * Elements past off[nseg] (up to n) get m and acc only.
 */
ZO_PASS void co_zo_local_step(const int64_t *dests, const float *g, float *m, const float *sden, float *acc,
                              const int64_t *off, int64_t nseg, int64_t n, float w, float lr, float decay,
                              int decayed, const double *steps) {
    ZO_NO_CONTRACT
    const int small = w < 0.5f && w > -0.5f;
    const float coeff = small ? w : w - 1.0f;
    for (int64_t s = 0; s <= nseg; ++s) {
        const int64_t lo = s < nseg ? off[s] : off[nseg], hi = s < nseg ? off[s + 1] : n;
        if (hi <= lo) continue;
        float *restrict p = s < nseg ? (float *)(intptr_t)dests[s] : NULL;
        const float c = s < nseg ? (float)steps[s] : 0.0f;
        const float *restrict gs = g + lo, *restrict ds = sden + lo;
        float *restrict ms = m + lo, *restrict as = acc + lo;
        const int64_t len = hi - lo;
        if (!p) {
            for (int64_t i = 0; i < len; ++i) {
                ZO_MOMENTUM(mi, ms[i], gs[i], ds[i], coeff, small);
                const float den = fabsf(ds[i]);
                ms[i] = mi;
                as[i] = as[i] + (lr * mi) / den;
            }
        } else if (decayed) {
            for (int64_t i = 0; i < len; ++i) {
                ZO_MOMENTUM(mi, ms[i], gs[i], ds[i], coeff, small);
                const float den = fabsf(ds[i]);
                ms[i] = mi;
                as[i] = as[i] + (lr * mi) / den;
                const float q = p[i] * decay;
                p[i] = q + (c * mi) / den;
            }
        } else {
            for (int64_t i = 0; i < len; ++i) {
                ZO_MOMENTUM(mi, ms[i], gs[i], ds[i], coeff, small);
                const float den = fabsf(ds[i]);
                ms[i] = mi;
                as[i] = as[i] + (lr * mi) / den;
                p[i] = p[i] + (c * mi) / den;
            }
        }
    }
}

/*
 * Before a synchronisation's exchange, per element of segment s:
 *   m <- lerp(m, g, w), 0 where v == 0;      den = |sden|
 *   acc <- ((acc + (lr * m) / den) * den) * c_s      (c_s = scales[s]; no multiplication without scales)
 * acc then holds what the exchange averages (sum lr m, each layer times its coefficient). Elements
 * past off[nseg] (up to n): as in a segment without scale.
 */
ZO_PASS void co_zo_sync_before(const float *g, float *m, const float *sden, float *acc, const int64_t *off,
                               int64_t nseg, int64_t n, float w, float lr, const double *scales) {
    ZO_NO_CONTRACT
    const int small = w < 0.5f && w > -0.5f;
    const float coeff = small ? w : w - 1.0f;
    for (int64_t s = 0; s <= nseg; ++s) {
        const int64_t lo = s < nseg ? off[s] : off[nseg], hi = s < nseg ? off[s + 1] : n;
        if (hi <= lo) continue;
        const int scaled = scales && s < nseg;
        const float c = scaled ? (float)scales[s] : 1.0f;
        const float *restrict gs = g + lo, *restrict ds = sden + lo;
        float *restrict ms = m + lo, *restrict as = acc + lo;
        const int64_t len = hi - lo;
        if (scaled) {
            for (int64_t i = 0; i < len; ++i) {
                ZO_MOMENTUM(mi, ms[i], gs[i], ds[i], coeff, small);
                const float den = fabsf(ds[i]);
                ms[i] = mi;
                const float a = as[i] + (lr * mi) / den;
                const float x = a * den;
                as[i] = x * c;
            }
        } else {
            for (int64_t i = 0; i < len; ++i) {
                ZO_MOMENTUM(mi, ms[i], gs[i], ds[i], coeff, small);
                const float den = fabsf(ds[i]);
                ms[i] = mi;
                const float a = as[i] + (lr * mi) / den;
                as[i] = a * den;
            }
        }
    }
}

/*
 * After a synchronisation's exchange (y: its result), per element of segment s:
 *   y <- y / r (r != NULL);  y <- y / d_s (divisors != NULL);  y <- 0 where v == 0
 *   m <- y / lr_sum;         den = |sden|
 *   anchor <- anchor * decay (when decayed);  anchor <- anchor + (c_s * y) / den   (c_s = steps[s] = -f_s)
 *   p <- anchor;             y <- 0 (the accumulator restarts)
 * Elements past off[nseg] (up to n): y, m and anchor * decay only (no parameter, no step).
 */
/* One element of co_zo_sync_after; the flags are constants where it is expanded (one loop each). */
#define ZO_AFTER(i, DIVIDE_R, DIVIDE_D, DECAY, STEP)                                                                 \
    do {                                                                                                            \
        float yi = ys[i];                                                                                           \
        if (DIVIDE_R) yi = yi / rs[i];                                                                              \
        if (DIVIDE_D) yi = yi / d;                                                                                  \
        yi = zo_where_variance(yi, ds[i]);                                                                          \
        ms[i] = yi / lr_sum;                                                                                        \
        ys[i] = 0.0f;                                                                                               \
        float a = DECAY ? an[i] * decay : an[i];                                                                    \
        if (STEP) {                                                                                                 \
            a = a + (c * yi) / fabsf(ds[i]);                                                                        \
            p[i] = a;                                                                                               \
        }                                                                                                           \
        an[i] = a;                                                                                                  \
    } while (0)

#define ZO_AFTER_LOOP(DIVIDE_R, DIVIDE_D, DECAY, STEP)                                                               \
    for (int64_t i = 0; i < len; ++i) ZO_AFTER(i, DIVIDE_R, DIVIDE_D, DECAY, STEP)

/* One segment of co_zo_sync_after (kind: 8 divide by r, 4 by d, 2 decay, 1 step and write p), a
 * loop per kind; a function of its own, so that no copy of the loops sees a NULL pointer (GCC then
 * vectorizes none). */
static ZO_PASS __attribute__((noinline)) void zo_after_segment(
    float *restrict ys, const float *restrict rs, const float *restrict ds, float *restrict ms, float *restrict an,
    float *restrict p, int64_t len, float d, float c, float lr_sum, float decay, int kind) {
    ZO_NO_CONTRACT
    switch (kind) {
    case 0: ZO_AFTER_LOOP(0, 0, 0, 0); break;
    case 1: ZO_AFTER_LOOP(0, 0, 0, 1); break;
    case 2: ZO_AFTER_LOOP(0, 0, 1, 0); break;
    case 3: ZO_AFTER_LOOP(0, 0, 1, 1); break;
    case 4: ZO_AFTER_LOOP(0, 1, 0, 0); break;
    case 5: ZO_AFTER_LOOP(0, 1, 0, 1); break;
    case 6: ZO_AFTER_LOOP(0, 1, 1, 0); break;
    case 7: ZO_AFTER_LOOP(0, 1, 1, 1); break;
    case 8: ZO_AFTER_LOOP(1, 0, 0, 0); break;
    case 9: ZO_AFTER_LOOP(1, 0, 0, 1); break;
    case 10: ZO_AFTER_LOOP(1, 0, 1, 0); break;
    case 11: ZO_AFTER_LOOP(1, 0, 1, 1); break;
    case 12: ZO_AFTER_LOOP(1, 1, 0, 0); break;
    case 13: ZO_AFTER_LOOP(1, 1, 0, 1); break;
    case 14: ZO_AFTER_LOOP(1, 1, 1, 0); break;
    default: ZO_AFTER_LOOP(1, 1, 1, 1); break;
    }
}

ZO_PASS void co_zo_sync_after(const int64_t *dests, float *y, const float *r, const float *sden, float *m,
                              float *anchor, const int64_t *off, int64_t nseg, int64_t n, float lr_sum, float decay,
                              int decayed, const double *divisors, const double *steps) {
    for (int64_t s = 0; s <= nseg; ++s) {
        const int64_t lo = s < nseg ? off[s] : off[nseg], hi = s < nseg ? off[s + 1] : n;
        if (hi <= lo) continue;
        float *p = s < nseg ? (float *)(intptr_t)dests[s] : NULL;
        const int divided = divisors && s < nseg;
        const float d = divided ? (float)divisors[s] : 1.0f, c = s < nseg ? (float)steps[s] : 0.0f;
        const int kind = (r ? 8 : 0) | (divided ? 4 : 0) | (decayed ? 2 : 0) | (p ? 1 : 0);
        zo_after_segment(y + lo, (r ? r : sden) + lo, sden + lo, m + lo, anchor + lo, p ? p : anchor + lo, hi - lo, d,
                         c, lr_sum, decay, kind);
    }
}

/*
 * co_zo_sync_before, then the exchange's element-wise pass clamp(r x, -b_s, b_s) over the segments
 * (r != NULL: co_scale_clamp), then co_compress_rows(acc, error, ...), bit for bit, in one pass
 * over memory: per block of the compression, the passes' values are formed and added to the
 * worker error in one loop (error <- u), then packed, summed and corrected while the block is in
 * cache, as co_lerp_scale_clamp_compress_rows does. m is written; acc is only read (the exchange's
 * result overwrites it). Reads g, m, sden, acc, r and error once, writes m, error and the rows.
 */
struct zo_before {
    const float *g, *sden, *acc, *r;
    float *m;
    float coeff, lr;
    int small;
    const double *scales, *bounds;
    const int64_t *off;
    int64_t nseg, seg;
};

/* error[0, len) <- x + error for x the passes' values of len elements of one segment (kind: 1 times
 * c, 2 clamp(r x, -b, b)); m written. A function of its own, as zo_after_segment. */
static ZO_PASS __attribute__((noinline)) void zo_before_segment(
    const float *restrict gs, float *restrict ms, const float *restrict ds, const float *restrict as,
    const float *restrict rs, float *restrict e, int64_t len, float coeff, int small, float lr, float c, float b,
    int kind) {
    ZO_NO_CONTRACT
    const float nb = -b;
#define ZO_BEFORE_LOOP(SCALE, CLAMP)                                                                                 \
    for (int64_t i = 0; i < len; ++i) {                                                                             \
        ZO_MOMENTUM(mi, ms[i], gs[i], ds[i], coeff, small);                                                         \
        const float den = fabsf(ds[i]);                                                                             \
        ms[i] = mi;                                                                                                 \
        const float a = as[i] + (lr * mi) / den;                                                                    \
        float x = a * den;                                                                                          \
        if (SCALE) x = x * c;                                                                                       \
        if (CLAMP) x = sc_value(x, rs[i], b, nb);                                                                   \
        e[i] = x + e[i];                                                                                            \
    }
    switch (kind) {
    case 0: ZO_BEFORE_LOOP(0, 0); break;
    case 1: ZO_BEFORE_LOOP(1, 0); break;
    case 2: ZO_BEFORE_LOOP(0, 1); break;
    default: ZO_BEFORE_LOOP(1, 1); break;
    }
#undef ZO_BEFORE_LOOP
}

static void zo_before_compensate(struct zo_before *p, int64_t lo, int64_t len, float *error) {
    const int64_t end = lo + len;
    int64_t k = lo, s = p->seg;
    while (k < end) {
        while (s < p->nseg && p->off[s + 1] <= k) ++s;
        const int in = s < p->nseg;
        const int64_t stop = in && p->off[s + 1] < end ? p->off[s + 1] : end;
        const int kind = in ? (p->scales ? 1 : 0) | (p->r ? 2 : 0) : 0;
        zo_before_segment(p->g + k, p->m + k, p->sden + k, p->acc + k, (p->r ? p->r : p->sden) + k, error + (k - lo),
                          stop - k, p->coeff, p->small, p->lr, in && p->scales ? (float)p->scales[s] : 1.0f,
                          in && p->r ? (float)p->bounds[s] : 0.0f, kind);
        k = stop;
    }
    p->seg = s;
}

static void zo_before_compensate_any(void *pass, int64_t lo, int64_t len, float *error) {
    zo_before_compensate((struct zo_before *)pass, lo, len, error);
}

void co_zo_sync_before_compress_rows(const float *g, float *m, const float *sden, const float *acc, float w, float lr,
                                     const double *scales, const float *r, const double *bounds, const int64_t *off,
                                     int64_t nseg, float *error, uint8_t *rows, int64_t row_stride, int64_t world,
                                     int64_t chunk, int64_t block, int64_t n) {
    const int small = w < 0.5f && w > -0.5f;
    struct zo_before pass = {g, sden, acc, r, m, small ? w : w - 1.0f, lr, small, scales, bounds, off, nseg, 0};
    compress_each_row(NULL, error, rows, row_stride, world, chunk, block, n, zo_before_compensate_any, &pass);
}
