/*
 * CPU kernels of ZeRO's compression step with the preconditioned exchange (compressed_opt.zero,
 * docs/design.md 2.5): every rank keeps the momentum as the last result's 1-bit rows, R m, and
 * steps its whole replica of the parameters. Two passes, each bit for bit the PyTorch composition
 * of compressed_opt.cuda.zero_passes (every operation rounded on its own: CO_EXACT; torch's
 * addcmul and add-with-alpha are one FMA each in its CPU kernels, fmaf here):
 *
 *   the local momentum, inside the worker's compression (co_zero_momentum_compress_rows):
 *     x = clamp(fma(h_s r, g, t k_s), -b_s, b_s), 0 where r == 0; u = x + error, compressed
 *     t the kept rows' value (R m times the last exchange factor), g the gradient where it lies
 *     (the momentum exchange, r == NULL: x = fma(h_s, g, t k_s), t = m);
 *   the update, from this step's result rows (co_zero_rows_descend):
 *     q = (y / (r eps + c_s)) f_s, 0 where r == 0;  p <- fma(q, alpha, p d)
 * and 1-bit LAMB's (below): its previous momentum from the kept rows, its update from the result's.
 */
#include "onebit_cpu.h"

/* The local momentum's pass (see the file's comment), run block by block inside a compression. */
struct co_zlm {
    const uint8_t *prev; /* the kept rows, row_stride bytes apart, chunk elements each */
    int64_t row_stride, chunk, block, n;
    const float *r;
    const int64_t *srcs; /* segment s's gradient (0: none, x = t k_s) */
    const double *keep, *gain, *bounds;
    const int64_t *off;
    int64_t nseg, seg;
    int add; /* 1: added to the error (the compression's compensation); 0: stored (the pass alone) */
    float *error; /* the error (or x) of element lo, while a block is compensated */
    int64_t lo;
};

/* v, or +0 where r == 0 (masked with integer operations: a form compilers vectorize). */
static inline float zero_where_zero(float v, float r) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits &= -(uint32_t)(r != 0.0f);
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* e[i] <- v + e[i] (add) or v, v the pass's value of element i (the loops of zlm_span). */
#define ZLM_LOOP(V)                                                                                                  \
    do {                                                                                                             \
        if (add) {                                                                                                   \
            for (int64_t i = 0; i < n; ++i) e[i] = (V) + e[i];                                                       \
        } else {                                                                                                     \
            for (int64_t i = 0; i < n; ++i) e[i] = (V);                                                              \
        }                                                                                                            \
    } while (0)

CO_EXACT static void zlm_span(const float *restrict t, const float *restrict r, const float *restrict g,
                              float *restrict e, int64_t n, float k, float h, float b, int add) {
    CO_NO_CONTRACT
    const float nb = -b;
    if (!r) { /* the momentum exchange: fma(h, g, t k), neither zeroed nor bounded */
        if (g) {
            ZLM_LOOP(fmaf(h, g[i], t[i] * k));
        } else {
            ZLM_LOOP(t[i] * k);
        }
    } else if (g) { /* torch's addcmul: one FMA */
        ZLM_LOOP(clamp_to(zero_where_zero(fmaf(h * r[i], g[i], t[i] * k), r[i]), b, nb));
    } else {
        ZLM_LOOP(clamp_to(zero_where_zero(t[i] * k, r[i]), b, nb));
    }
}
#undef ZLM_LOOP

static void zlm_piece(void *pass, const float *t, int64_t k, int64_t stop, int64_t s) {
    const struct co_zlm *p = (const struct co_zlm *)pass;
    const float *g = p->srcs[s] ? (const float *)(intptr_t)p->srcs[s] + (k - p->off[s]) : NULL;
    zlm_span(t, p->r ? p->r + k : NULL, g, p->error + (k - p->lo), stop - k, (float)p->keep[s], (float)p->gain[s],
             p->bounds ? (float)p->bounds[s] : 0.0f, p->add);
}

/* error[0, len) <- x + error over the flat buffer's elements [lo, lo + len) (co_compensate). */
static void zlm_compensate(void *pass, int64_t lo, int64_t len, float *error) {
    struct co_zlm *p = (struct co_zlm *)pass;
    p->error = error;
    p->lo = lo;
    walk_rows_range(p->prev, p->row_stride, p->chunk, p->block, p->n, p->off, p->nseg, &p->seg, lo, lo + len,
                    zlm_piece, p);
}

/*
 * The local momentum of the segments [off[s], off[s + 1]) (n = off[nseg] elements, the kept rows
 * prev of world rows in the compression's geometry) fused into co_compress_rows: reads the rows,
 * r, each gradient and the error once, writes the error and the rows.
 */
void co_zero_momentum_compress_rows(const uint8_t *prev, const float *r, const int64_t *srcs, const double *keep,
                                    const double *gain, const double *bounds, const int64_t *off, int64_t nseg,
                                    float *error, uint8_t *rows, int64_t row_stride, int64_t world, int64_t chunk,
                                    int64_t block) {
    const int64_t n = off[nseg];
    struct co_zlm pass = {prev, row_stride, chunk, block, n, r, srcs, keep, gain, bounds, off, nseg, 0, 1, NULL, 0};
    compress_each_row(NULL, error, rows, row_stride, world, chunk, block, n, zlm_compensate, &pass);
}

/*
 * The same local momentum alone, into x[0, off[nseg]) (the kept rows prev of world rows, chunk
 * elements each, row_stride bytes apart): co_zero_momentum_compress_rows's values, stored instead
 * of compensated and compressed, for a step that forms the local momentum before its exchange
 * compresses it (an exchange launched from backward; 1-bit LAMB's measuring steps, which read it
 * whole). Reads the rows, r and each gradient; writes x.
 */
void co_zero_local_momentum(const uint8_t *prev, int64_t row_stride, int64_t chunk, int64_t block, const float *r,
                            const int64_t *srcs, const double *keep, const double *gain, const double *bounds,
                            const int64_t *off, int64_t nseg, float *x) {
    const int64_t n = off[nseg];
    struct co_zlm pass = {prev, row_stride, chunk, block, n, r, srcs, keep, gain, bounds, off, nseg, 0, 0, NULL, 0};
    zlm_compensate(&pass, 0, n, x);
}

CO_EXACT static void zrd_span(const float *restrict y, const float *restrict r, float *restrict p, int64_t n,
                              float eps, float c, float f, float d, int decayed, float alpha, float *restrict m,
                              float v) {
    CO_NO_CONTRACT
    if (m) { /* stage 0 keeps the momentum beside: m = (y / r) / v, 0 where r == 0 (v = 1: none), formed
              * a tile at a time in the stack and streamed out (m is only written: co_stream_out) */
        float mt[CO_TILE];
        for (int64_t k = 0; k < n; k += CO_TILE) {
            const int64_t len = min64(CO_TILE, n - k);
            const float *restrict yk = y + k, *restrict rk = r + k;
            float *restrict pk = p + k;
            if (decayed) {
                for (int64_t i = 0; i < len; ++i) {
                    const float yi = yk[i], ri = rk[i];
                    mt[i] = quotient_or_zero(yi, ri) / v;
                    pk[i] = fmaf(zero_where_zero(yi / (ri * eps + c), ri) * f, alpha, pk[i] * d);
                }
            } else {
                for (int64_t i = 0; i < len; ++i) {
                    const float yi = yk[i], ri = rk[i];
                    mt[i] = quotient_or_zero(yi, ri) / v;
                    pk[i] = fmaf(zero_where_zero(yi / (ri * eps + c), ri) * f, alpha, pk[i]);
                }
            }
            co_stream_out(m + k, mt, len);
        }
        return;
    }
    if (decayed) {
        for (int64_t i = 0; i < n; ++i) p[i] = fmaf(zero_where_zero(y[i] / (r[i] * eps + c), r[i]) * f, alpha, p[i] * d);
    } else {
        for (int64_t i = 0; i < n; ++i) p[i] = fmaf(zero_where_zero(y[i] / (r[i] * eps + c), r[i]) * f, alpha, p[i]);
    }
}

/* co_zero_rows_descend's arguments, for its spans (walk_result_rows); m == NULL: no momentum kept. */
struct zero_rows_descend {
    const float *r;
    const double *coeffs, *factors;
    const int64_t *off, *dests;
    float eps, d, alpha;
    int decayed;
    float *m;
    const double *divisors;
};

static void zero_rows_descend_span(void *pass, const float *y, int64_t k, int64_t stop, int64_t s) {
    const struct zero_rows_descend *p = (const struct zero_rows_descend *)pass;
    zrd_span(y, p->r + k, (float *)(intptr_t)p->dests[s] + (k - p->off[s]), stop - k, p->eps, (float)p->coeffs[s],
             (float)p->factors[s], p->d, p->decayed, p->alpha, p->m ? p->m + k : NULL,
             p->divisors ? (float)p->divisors[s] : 1.0f);
}

/*
 * The update from the result's rows (row_stride bytes apart, chunk elements each, one scale per
 * block), decompressed tile by tile into the stack: each segment's parameter at address dests[s]
 * (0: an empty one) <- fma(q, alpha, p d) (decayed == 0: p), q as in the file's comment.
 */
void co_zero_rows_descend(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block, const float *r,
                          float eps, const double *coeffs, const double *factors, const int64_t *off, int64_t nseg,
                          const int64_t *dests, float d, int decayed, float alpha) {
    struct zero_rows_descend pass = {r, coeffs, factors, off, dests, eps, d, alpha, decayed, NULL, NULL};
    walk_result_rows(rows, row_stride, chunk, block, off, nseg, zero_rows_descend_span, &pass);
}

/*
 * The preconditioned exchange's last pass in stage 0 (compressed_opt.cuda.update.divide_descend_):
 * co_zero_rows_descend's update, and the momentum m = (y / r) / divisors[s] (0 where r == 0;
 * divisors == NULL: none) written into m beside it, y read once: from the result's rows
 * (co_rows_divide_zero_descend, y decompressed tile by tile into the stack) or a flat y
 * (co_divide_zero_descend). Only the segments' elements of m are written.
 */
void co_rows_divide_zero_descend(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block,
                                 const float *r, float eps, const double *coeffs, const double *factors,
                                 const int64_t *off, int64_t nseg, const int64_t *dests, float d, int decayed,
                                 float alpha, float *m, const double *divisors) {
    struct zero_rows_descend pass = {r, coeffs, factors, off, dests, eps, d, alpha, decayed, m, divisors};
    walk_result_rows(rows, row_stride, chunk, block, off, nseg, zero_rows_descend_span, &pass);
    co_store_fence();
}

void co_divide_zero_descend(const float *y, const float *r, float eps, const double *coeffs, const double *factors,
                            const int64_t *off, int64_t nseg, const int64_t *dests, float d, int decayed, float alpha,
                            float *m, const double *divisors) {
    struct zero_rows_descend pass = {r, coeffs, factors, off, dests, eps, d, alpha, decayed, m, divisors};
    for (int64_t s = 0; s < nseg; ++s)
        if (off[s + 1] > off[s]) zero_rows_descend_span(&pass, y + off[s], off[s], off[s + 1], s);
    co_store_fence();
}

/*
 * 1-bit LAMB under ZeRO (compressed_opt.zero_lamb): from the kept rows and R, the previous momentum
 * of this rank's chunk, and the update of the whole replica; every operation rounded on its own,
 * as the composition of compressed_opt.cuda.zero_passes rounds it.
 */

/* out[k - lo] <- y_k / r[k], 0 where that is not finite (torch's nan_to_num), for k in [lo, hi):
 * y the values of the rows (row_stride bytes apart, chunk elements each, one scale per block); lo a
 * multiple of 8 (a whole byte of bits: a chunk's start is). */
CO_EXACT void co_rows_quotient_finite(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block,
                                      const float *r, int64_t lo, int64_t hi, float *out) {
    CO_NO_CONTRACT
    float tile[CO_TILE];
    for (int64_t k0 = lo; k0 < hi;) {
        const int64_t len = next_tile(rows, row_stride, chunk, block, k0, hi, tile);
        const float *restrict rs = r + k0;
        float *restrict o = out + (k0 - lo);
        for (int64_t i = 0; i < len; ++i) {
            const float q = tile[i] / rs[i];
            o[i] = isfinite(q) ? q : 0.0f;
        }
        k0 += len;
    }
}

/* One span of co_zero_lamb_rows_descend: p <- p d + ((y / r) / ((1 / r) c + eps)) a (decayed == 0: p + ...),
 * y / r 0 where r == 0. */
CO_EXACT static void zld_span(const float *restrict y, const float *restrict r, float *restrict p, int64_t n, float c,
                              float eps, float a, float d, int decayed) {
    CO_NO_CONTRACT
    if (decayed) {
        for (int64_t i = 0; i < n; ++i) {
            const float u = (quotient_or_zero(y[i], r[i]) / ((1.0f / r[i]) * c + eps)) * a;
            p[i] = p[i] * d + u;
        }
    } else {
        for (int64_t i = 0; i < n; ++i) p[i] = p[i] + (quotient_or_zero(y[i], r[i]) / ((1.0f / r[i]) * c + eps)) * a;
    }
}

/* co_zero_lamb_rows_descend's arguments, for its spans (walk_result_rows). */
struct zero_lamb_descend {
    const float *r;
    const double *coeffs, *alphas, *decays;
    const int64_t *off, *dests;
    float eps;
};

static void zero_lamb_descend_span(void *pass, const float *y, int64_t k, int64_t stop, int64_t s) {
    const struct zero_lamb_descend *p = (const struct zero_lamb_descend *)pass;
    zld_span(y, p->r + k, (float *)(intptr_t)p->dests[s] + (k - p->off[s]), stop - k, (float)p->coeffs[s], p->eps,
             (float)p->alphas[s], p->decays ? (float)p->decays[s] : 1.0f, p->decays != NULL);
}

/*
 * 1-bit LAMB's update of the whole replica from the result's rows, decompressed tile by tile: segment
 * s's parameter (address dests[s], 0: an empty one) <- p decays[s] + (m / denom) alphas[s] (decays ==
 * NULL: p + ...), m = y / r (0 where r == 0) the momentum, denom = (1 / r) coeffs[s] + eps the frozen
 * denominator sqrt(v_f) + eps made from R = c_s / sqrt(v_f) (inf where r == 0).
 */
void co_zero_lamb_rows_descend(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block, const float *r,
                               float eps, const double *coeffs, const int64_t *off, int64_t nseg, const int64_t *dests,
                               const double *decays, const double *alphas) {
    struct zero_lamb_descend pass = {r, coeffs, alphas, decays, off, dests, eps};
    walk_result_rows(rows, row_stride, chunk, block, off, nseg, zero_lamb_descend_span, &pass);
}
