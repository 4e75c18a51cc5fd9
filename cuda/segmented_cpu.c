/*
 * CPU kernels of the segmented element-wise passes around the compression
 * (compressed_opt.cuda.segmented, compressed_opt.cuda.update): the gather of the gradients and
 * their sums of squares, the local momentum alone, the momentum from the exchange and the update.
 */
#include "onebit_cpu.h"

/*
 * Segment s is [off[s], off[s + 1]) of a flat buffer, off[0] = 0; per-segment
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

/* The momentum exchange's update, one span: m <- y (m == NULL: not kept; streamed out, m is only
 * written: co_stream_out); p <- fma((y / den) f, alpha, p d) (decayed == 0: p), each operation rounded
 * on its own but torch's add-with-alpha, one FMA in its CPU kernels. */
CO_EXACT static void keep_descend_span(const float *restrict y, const float *restrict den, float *restrict m,
                                       float *restrict p, int64_t n, float f, float d, int decayed, float alpha) {
    CO_NO_CONTRACT
    if (m) co_stream_out(m, y, n);
    if (decayed) {
        for (int64_t i = 0; i < n; ++i) p[i] = fmaf((y[i] / den[i]) * f, alpha, p[i] * d);
    } else {
        for (int64_t i = 0; i < n; ++i) p[i] = fmaf((y[i] / den[i]) * f, alpha, p[i]);
    }
}

/* co_rows_keep_descend's arguments, for its spans (walk_result_rows). */
struct rows_keep_descend {
    const float *den;
    float *m;
    const double *factors;
    const int64_t *off, *dests;
    float d, alpha;
    int decayed;
};

static void rows_keep_descend_span(void *pass, const float *y, int64_t k, int64_t stop, int64_t s) {
    const struct rows_keep_descend *p = (const struct rows_keep_descend *)pass;
    keep_descend_span(y, p->den + k, p->m ? p->m + k : NULL, (float *)(intptr_t)p->dests[s] + (k - p->off[s]), stop - k,
                      (float)p->factors[s], p->d, p->decayed, p->alpha);
}

/*
 * The momentum exchange's update from the result's rows (compressed_opt.cuda.update): over the
 * off[nseg] elements, y decompressed tile by tile into the stack, m <- y (m == NULL: ZeRO, whose
 * momentum is the kept rows) and segment s's parameter
 * (at address dests[s], non-NULL for every non-empty segment) <- p d + alpha (y / den) f_s, bit for
 * bit the decompression then m.copy_(y), torch.div(y, den), the factors' torch._foreach_mul_ and
 * compressed_opt.moments.descend_. Reads the rows, den and each parameter; writes m and the parameters.
 */
void co_rows_keep_descend(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block, const float *den,
                          float *m, const double *factors, const int64_t *off, int64_t nseg, const int64_t *dests,
                          float d, int decayed, float alpha) {
    struct rows_keep_descend pass = {den, m, factors, off, dests, d, alpha, decayed};
    walk_result_rows(rows, row_stride, chunk, block, off, nseg, rows_keep_descend_span, &pass);
    co_store_fence();
}
