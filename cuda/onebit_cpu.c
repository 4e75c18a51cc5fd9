/*
 * CPU kernels of error-feedback 1-bit compression (docs/design.md 2.1, 2.2), and the passes fused
 * into it (the local momentum's, LerpScaleClamp in compressed_opt.cuda.segmented); the segmented
 * passes around it are segmented_cpu.c's, 1-bit LAMB's lamb_cpu.c's, 0/1 Adam's zero_one_cpu.c's
 * (onebit_cpu.h: what they share).
 *
 * Compiled at first use by compressed_opt.cuda.cpu with the system C compiler and loaded with
 * ctypes. Same contract as the CUDA kernels in onebit.cu and compressed_opt.cuda.reference:
 *   a buffer of world chunks travels as world rows, row j = [nb fp32 scales | chunk j's bits],
 *   nb = ceil(chunk / block), one scale per block of a chunk;
 *   bit k of a row's bits is bit (k % 8) of byte k / 8 (little bit order);
 *   bit = 1 iff u >= 0 (zero counts as +), 1 for invalid elements; value = scale * (2 bit - 1).
 * A compression walks each block twice while it is in cache: pass 1 forms u, packs its signs and
 * sums u^2, which gives the block's scale sqrt(sum / count); pass 2 turns u into the new error
 * u - scale * sign(u). The AVX2 paths are used when compiled with -march on a CPU that has it,
 * and where it has AVX-512 (CO_AVX512) the packing walk, the server's average and the expansion of
 * signs take 16 elements a register, two bytes of bits as one mask: the AVX2 paths' operations and
 * bits. The scalar paths give bit-identical results (the sum of squares may differ in rounding).
 */
#include "onebit_cpu.h"

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
 * The server's average of a block, formed where the compression first reads it: element e is
 * z[e] + sum_i (bit e of row i's bits ? w_i : -w_i), added in rank order i = 0, 1, ... (bits: the
 * block's first byte in row 0, rows row_stride bytes apart; z: the block's error).
 */
struct co_average {
    const uint8_t *bits;
    int64_t row_stride, world;
    const float *w;
};

static inline float averaged(const float *z, const struct co_average *a, int64_t e) {
    float v = z[e];
    for (int64_t i = 0; i < a->world; ++i)
        v += (a->bits[i * a->row_stride + e / 8] >> (e % 8)) & 1u ? a->w[i] : -a->w[i];
    return v;
}

#ifdef CO_AVX512
/* The 16 elements of bytes k and k + 1 of the block, averaged as averaged() adds them. */
static inline __m512 averaged16(const float *z, const struct co_average *a, int64_t k) {
    __m512 acc = _mm512_loadu_ps(z + 8 * k);
    for (int64_t i = 0; i < a->world; ++i) {
        uint16_t bits;
        memcpy(&bits, a->bits + i * a->row_stride + k, sizeof bits);
        acc = _mm512_add_ps(acc, _mm512_mask_blend_ps((__mmask16)bits, _mm512_set1_ps(-a->w[i]),
                                                      _mm512_set1_ps(a->w[i])));
    }
    return acc;
}
#endif

#ifdef CO_AVX2
/* The 8 elements of byte k of the block, averaged as averaged() adds them. */
static inline __m256 averaged8(const float *z, const struct co_average *a, int64_t k) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256 acc = _mm256_loadu_ps(z + 8 * k);
    for (int64_t i = 0; i < a->world; ++i) {
        const __m256i bitm = _mm256_and_si256(_mm256_set1_epi32(a->bits[i * a->row_stride + k]), lane);
        const __m256 pos = _mm256_set1_ps(a->w[i]), neg = _mm256_set1_ps(-a->w[i]);
        acc = _mm256_add_ps(acc, _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(bitm, lane))));
    }
    return acc;
}
#endif

/*
 * Compensate and pack n elements: error <- u = x + error (x == NULL means x = 0), or with avg the
 * server's average of the block added to the error (x unused); packed <- the signs of u, nbytes >=
 * ceil(n / 8) bytes, the bits past n set to 1. Returns sum(u^2).
 */
static double compensate_pack(const float *x, const struct co_average *avg, float *error, uint8_t *packed, int64_t n,
                              int64_t nbytes) {
    double total = 0.0;
    int64_t full = n & ~(int64_t)15; /* multiple of 16 handled by the vector loop */
#if defined(CO_AVX512)
    /* as the AVX2 loop below, 16 elements a register: lanes 0-7 are its a0's, 8-15 its a1's, and
     * the two bytes of signs one mask; the same operations, the same bits */
    const __m512 zero16 = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < full; i0 += CO_SUM_BLOCK) {
        const int64_t i1 = min64(i0 + CO_SUM_BLOCK, full);
        __m512 a = zero16;
        for (int64_t i = i0; i < i1; i += 16) {
            __m512 u;
            if (avg) {
                u = averaged16(error, avg, i / 8);
                _mm512_storeu_ps(error + i, u);
            } else if (x) {
                u = _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(error + i));
                _mm512_storeu_ps(error + i, u);
            } else {
                u = _mm512_loadu_ps(error + i);
            }
            a = _mm512_fmadd_ps(u, u, a);
            const uint16_t signs = (uint16_t)_mm512_cmp_ps_mask(u, zero16, _CMP_GE_OQ);
            memcpy(packed + i / 8, &signs, sizeof signs);
        }
        float part[8];
        const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); /* (AVX-512F) */
        _mm256_storeu_ps(part, _mm256_add_ps(_mm512_castps512_ps256(a), high));
        for (int j = 0; j < 8; ++j) total += part[j];
    }
#elif defined(CO_AVX2)
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t i0 = 0; i0 < full; i0 += CO_SUM_BLOCK) {
        int64_t i1 = i0 + CO_SUM_BLOCK < full ? i0 + CO_SUM_BLOCK : full;
        __m256 a0 = zero, a1 = zero;
        for (int64_t i = i0; i < i1; i += 16) {
            __m256 u0, u1;
            if (avg) {
                u0 = averaged8(error, avg, i / 8);
                u1 = averaged8(error, avg, i / 8 + 1);
                _mm256_storeu_ps(error + i, u0);
                _mm256_storeu_ps(error + i + 8, u1);
            } else {
                u0 = _mm256_loadu_ps(error + i), u1 = _mm256_loadu_ps(error + i + 8);
            }
            if (x && !avg) {
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
                float u = avg ? averaged(error, avg, i + j) : x ? x[i + j] + error[i + j] : error[i + j];
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
        float u = avg ? averaged(error, avg, i) : x ? x[i] + error[i] : error[i];
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
 * A segmented lerp_scale_clamp pass (m != NULL) or scale_clamp pass (m == NULL: w and scales
 * unused), or a lerp alone (r == NULL: bounds and scales unused) over a flat buffer, run block by block inside a compression instead of over the whole
 * buffer before it: segment s is [off[s], off[s + 1]); elements past off[nseg] are x itself.
 * seg: the segment of the last element formed (blocks come in order).
 */
struct co_lsc {
    const float *x, *m, *r;
    const int64_t *srcs; /* NULL: x's segment s is x + off[s]; else the floats at address srcs[s] */
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
/* One piece [k, k + n) of segment s (s == nseg: past the segments, x as it is): e[i] <- v + e[i], v
 * the pass's value, with ms the piece's m (NULL where the pass has none). */
static void lsc_piece(const struct co_lsc *p, int64_t s, int64_t k, int64_t n, const float *restrict ms,
                      float *restrict e) {
    if (s >= p->nseg) {
        const float *restrict xs = p->x + k;
        for (int64_t i = 0; i < n; ++i) e[i] = xs[i] + e[i];
        return;
    }
    const int small = p->w < 0.5f && p->w > -0.5f;
    const float w = p->w, wc = 1.0f - p->w;
    const float *restrict xs = p->srcs ? (const float *)(intptr_t)p->srcs[s] + (k - p->off[s]) : p->x + k;
    if (!p->r) {
        if (small) {
            for (int64_t i = 0; i < n; ++i) e[i] = lerp_small(xs[i], ms[i], w) + e[i];
        } else {
            for (int64_t i = 0; i < n; ++i) e[i] = lerp_large(xs[i], ms[i], wc) + e[i];
        }
        return;
    }
    const float b = (float)p->bounds[s], nb = -b, c = p->scales ? (float)p->scales[s] : 1.0f;
    const float *restrict rs = p->r + k;
    if (!ms) {
        for (int64_t i = 0; i < n; ++i) e[i] = sc_value(xs[i], rs[i], b, nb) + e[i];
    } else if (small) {
        for (int64_t i = 0; i < n; ++i) e[i] = lsc_small(xs[i], ms[i], w, rs[i], c, b, nb) + e[i];
    } else {
        for (int64_t i = 0; i < n; ++i) e[i] = lsc_large(xs[i], ms[i], wc, rs[i], c, b, nb) + e[i];
    }
}

static void lsc_compensate(struct co_lsc *p, int64_t lo, int64_t len, float *restrict error) {
    const int64_t end = lo + len;
    int64_t k = lo, s = p->seg;
    while (k < end) {
        const int64_t stop = segment_piece(p->off, p->nseg, &s, k, end);
        lsc_piece(p, s, k, stop - k, p->m ? p->m + k : NULL, error + (k - lo));
        k = stop;
    }
    p->seg = s;
}

static void lsc_compensate_any(void *pass, int64_t lo, int64_t len, float *error) {
    lsc_compensate((struct co_lsc *)pass, lo, len, error);
}

/*
 * Compress one block of count valid elements (of len) held in error (u after compensate, or to
 * be compensated with xb, or to have the server's average added with avg): pack its bits into
 * bits, its scale sqrt(sum(u^2) / count) into scale (4 bytes), and subtract the decompressed values
 * while the block is in cache. With compensate
 * (then xb is NULL): the pass's values of the buffer's elements from first on are formed and added
 * to the error as the block is compensated, so that they never travel to memory; the same
 * arithmetic as the pass, then the compression. No valid element: scale 0, bits 1.
 */
static void compress_block(const float *xb, const struct co_average *avg, float *error, uint8_t *scale,
                           uint8_t *bits, int64_t len, int64_t count, co_compensate compensate, void *pass,
                           int64_t first) {
    float s = 0.0f;
    if (count > 0) {
        if (compensate) compensate(pass, first, count, error); /* then error holds u */
        double sumsq = compensate_pack(xb, avg, error, bits, count, len / 8);
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
        compress_block(x && count ? x + lo : NULL, NULL, error + lo, scales + 4 * b, bits + lo / 8, len, count,
                       compensate, pass, first + lo);
    }
}

/* Each of world rows (row_stride bytes apart) <- its chunk of the n valid elements, compressed
 * (compress_chunk; empty chunks: rows of scale 0). */
CO_INTERNAL void compress_each_row(const float *x, float *error, uint8_t *rows, int64_t row_stride, int64_t world,
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
    struct co_lsc pass = {x, m, r, NULL, w, bounds, scales, off, nseg, 0};
    compress_each_row(NULL, error, rows, row_stride, world, chunk, block, n, lsc_compensate_any, &pass);
}

/*
 * co_lerp_scale_clamp_compress_rows with x's segment s read where it lies, the floats at address
 * srcs[s] (each parameter's gradient, non-NULL for every non-empty segment), not gathered into a
 * flat buffer first: bit for bit co_gather(srcs, x, off, nseg) then that pass (elements past
 * off[nseg] are x's own), and the gather's two streams (read, write) are never moved.
 */
void co_lerp_scale_clamp_compress_sources(const int64_t *srcs, const float *x, const float *m, float w,
                                          const float *r, const double *bounds, const double *scales,
                                          const int64_t *off, int64_t nseg, float *error, uint8_t *rows,
                                          int64_t row_stride, int64_t world, int64_t chunk, int64_t block, int64_t n) {
    struct co_lsc pass = {x, m, r, srcs, w, bounds, scales, off, nseg, 0};
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

/* co_lerp_compress_rows with x's segment s read where it lies, the floats at address srcs[s] (the
 * gradients: co_gather(srcs, x, off, nseg) then co_lerp_compress_rows(x, m, w, n, ...), bit for
 * bit; elements past off[nseg] are x's own, not lerped: the caller has none there). */
void co_lerp_compress_sources(const int64_t *srcs, const float *x, const float *m, float w, const int64_t *off,
                              int64_t nseg, float *error, uint8_t *rows, int64_t row_stride, int64_t world,
                              int64_t chunk, int64_t block, int64_t n) {
    struct co_lsc pass = {x, m, NULL, srcs, w, NULL, NULL, off, nseg, 0};
    compress_each_row(NULL, error, rows, row_stride, world, chunk, block, n, lsc_compensate_any, &pass);
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
 * <- z compressed, error <- z - C(z). The average is formed in the compression's first walk over
 * the block, the one that packs and sums it (compensate_pack with avg): one walk fewer.
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
            compress_block(NULL, NULL, error + lo, out_row + 4 * b, out_row + 4 * nb + lo / 8, len, 0, NULL, NULL, 0);
            continue;
        }
        for (int64_t i = 0; i < world; ++i) w[i] = load_scale(rows + i * row_stride + 4 * b) / (float)world;
        const struct co_average avg = {rows + 4 * nb + lo / 8, row_stride, world, w};
        compress_block(NULL, &avg, error + lo, out_row + 4 * b, out_row + 4 * nb + lo / 8, len, count, NULL, NULL, 0);
    }
    return 0;
}

/* dst[k] <- s (2 b_k - 1) for k < count, b_k bit k % 8 of src[k / 8] (one block's elements, from its first). */
CO_INTERNAL void expand_signs(const uint8_t *src, float s, float *dst, int64_t count) {
    const int64_t full_bytes = count / 8;
#if defined(CO_AVX512)
    /* 16 elements a step: two bytes of bits are the blend's mask as they are (bit k, element k) */
    const __m512 pos16 = _mm512_set1_ps(s), neg16 = _mm512_set1_ps(-s);
    int64_t k = 0;
    for (; k + 2 <= full_bytes; k += 2) {
        uint16_t bits;
        memcpy(&bits, src + k, sizeof bits);
        _mm512_storeu_ps(dst + 8 * k, _mm512_mask_blend_ps((__mmask16)bits, neg16, pos16));
    }
    for (; k < full_bytes; ++k) {
        const unsigned byte = src[k];
        for (int j = 0; j < 8; ++j) dst[8 * k + j] = (byte >> j) & 1u ? s : -s;
    }
#elif defined(CO_AVX2)
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

CO_INTERNAL void walk_rows_range(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block, int64_t n,
                                 const int64_t *off, int64_t nseg, int64_t *seg, int64_t lo, int64_t end,
                                 co_result_span span, void *pass) {
    float tile[CO_TILE];
    for (int64_t k0 = lo; k0 < end;) {
        const int64_t stop_tile = k0 + min64(next_tile(rows, row_stride, chunk, block, k0, n, tile), end - k0);
        for (int64_t k = k0; k < stop_tile;) {
            const int64_t stop = segment_piece(off, nseg, seg, k, stop_tile);
            span(pass, tile + (k - k0), k, stop, *seg);
            k = stop;
        }
        k0 = stop_tile;
    }
}

CO_INTERNAL void walk_result_rows(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block,
                                  const int64_t *off, int64_t nseg, co_result_span span, void *pass) {
    int64_t s = 0;
    walk_rows_range(rows, row_stride, chunk, block, off[nseg], off, nseg, &s, 0, off[nseg], span, pass);
}
