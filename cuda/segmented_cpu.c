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

/*
 * Sums of squares in double, 8 lanes per sum: element i of a segment goes into lane i % 8 (in
 * order), the lanes are added as a fixed tree, then the last n % 8 elements one by one. Squares of
 * gradients down to 1e-160 stay representable, where fp32 ones would underflow. One segment's
 * lanes are one vector of additions, each waiting for the one before (4 cycles here), so up to
 * CO_SUMSQ_WAYS segments are summed side by side over their common length: independent chains,
 * the same additions in the same order, the same bits.
 */
#define CO_SUMSQ_WAYS 4

/* acc[j] += x[i + j]^2 for i in [from, to) step 8. */
static inline void lanes_add(const float *restrict x, int64_t from, int64_t to, double *restrict acc) {
    for (int64_t i = from; i < to; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += (double)x[i + j] * x[i + j];
}

/* The 8 lanes added as the one fixed tree every sum of squares here uses. */
static inline double lanes_tree(const double *acc) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The sum of the lanes (filled up to n & ~7) and of the last n % 8 squares. */
static inline double lanes_total(const double *acc, const float *x, int64_t n) {
    double total = lanes_tree(acc);
    for (int64_t i = n & ~(int64_t)7; i < n; ++i) total += (double)x[i] * x[i];
    return total;
}

/* out[k] <- the sum of squares of x[k][0, n[k]) for k < ways (<= CO_SUMSQ_WAYS). */
static void sumsq_side_by_side(const float *const *x, const int64_t *n, int64_t ways, double *out) {
    double acc[CO_SUMSQ_WAYS][8] = {{0}};
    int64_t common = n[0];
    for (int64_t k = 1; k < ways; ++k) common = min64(common, n[k]);
    common &= ~(int64_t)7;
    if (ways == CO_SUMSQ_WAYS) {
        for (int64_t i = 0; i < common; i += 8)
            for (int k = 0; k < CO_SUMSQ_WAYS; ++k)
                for (int j = 0; j < 8; ++j) acc[k][j] += (double)x[k][i + j] * x[k][i + j];
    } else {
        for (int64_t k = 0; k < ways; ++k) lanes_add(x[k], 0, common, acc[k]);
    }
    for (int64_t k = 0; k < ways; ++k) {
        lanes_add(x[k], common, n[k] & ~(int64_t)7, acc[k]);
        out[k] = lanes_total(acc[k], x[k], n[k]);
    }
}

/* out[s] <- the sum of squares of the n[s] floats at x[s] for s < count (0 for a NULL x[s] or none). */
static void sumsq_many(const float *const *x, const int64_t *n, int64_t count, double *out) {
    const float *xs[CO_SUMSQ_WAYS];
    int64_t ns[CO_SUMSQ_WAYS], at[CO_SUMSQ_WAYS], ways = 0;
    for (int64_t s = 0; s <= count; ++s) {
        if (s < count && (!x[s] || !n[s])) {
            out[s] = 0.0;
            continue;
        }
        if (s < count) {
            xs[ways] = x[s], ns[ways] = n[s], at[ways] = s;
            ++ways;
        }
        if (ways == CO_SUMSQ_WAYS || (s == count && ways)) {
            double sums[CO_SUMSQ_WAYS];
            sumsq_side_by_side(xs, ns, ways, sums);
            for (int64_t k = 0; k < ways; ++k) out[at[k]] = sums[k];
            ways = 0;
        }
    }
}

/* out[s] <- the sum of squares of segment s: the floats at base + off[s] (srcs == NULL), or at
 * address srcs[s] (0: none), in groups of up to 64 segments for sumsq_many. */
static void sumsq_segments(const float *base, const int64_t *srcs, const int64_t *off, int64_t nseg, double *out) {
    const float *xs[64];
    int64_t ns[64];
    for (int64_t s0 = 0; s0 < nseg; s0 += 64) {
        const int64_t count = min64(64, nseg - s0);
        for (int64_t k = 0; k < count; ++k) {
            xs[k] = srcs ? (const float *)(intptr_t)srcs[s0 + k] : base + off[s0 + k];
            ns[k] = off[s0 + k + 1] - off[s0 + k];
        }
        sumsq_many(xs, ns, count, out + s0);
    }
}

/* out[s] = the sum of squares over segment s of the flat x (above: in double, 8 lanes). */
void co_segment_sumsq(const float *x, const int64_t *off, int64_t nseg, double *out) {
    sumsq_segments(x, NULL, off, nseg, out);
}

/* out[s] = the sum of squares of the off[s + 1] - off[s] floats at address srcs[s] (0 for a NULL
 * address), as co_segment_sumsq and co_gather's sumsq accumulate them: one read of each tensor,
 * where torch's float64 norm of an fp32 tensor first copies it to float64. */
void co_sumsq_each(const int64_t *srcs, const int64_t *off, int64_t nseg, double *out) {
    sumsq_segments(NULL, srcs, off, nseg, out);
}

/* One element of co_direction_sumsq's direction (kind: 1 divided by den, 2 plus wd p). */
#define CO_DIRECTION(KIND, i) \
    (((KIND) & 2) ? fmaf(ps[i], wd, (((KIND) & 1) ? xs[i] / ds[i] : xs[i]) * a) \
                  : (((KIND) & 1) ? xs[i] / ds[i] : xs[i]) * a)

/* One segment of co_direction_sumsq, a loop per kind (so that each vectorizes without branches). */
static CO_EXACT double direction_segment(const float *restrict xs, const float *restrict ds, const float *restrict ps,
                                         int64_t n, float a, float wd, int kind) {
    CO_NO_CONTRACT
    const int64_t n8 = n & ~(int64_t)7;
    double acc[8] = {0};
#define CO_DIRECTION_LANES(KIND)                                                                                     \
    for (int64_t i = 0; i < n8; i += 8)                                                                               \
        for (int j = 0; j < 8; ++j) {                                                                                 \
            const float d = CO_DIRECTION(KIND, i + j);                                                                \
            acc[j] += (double)d * d;                                                                                  \
        }
    switch (kind) {
    case 0: CO_DIRECTION_LANES(0); break;
    case 1: CO_DIRECTION_LANES(1); break;
    case 2: CO_DIRECTION_LANES(2); break;
    default: CO_DIRECTION_LANES(3); break;
    }
#undef CO_DIRECTION_LANES
    double total = lanes_tree(acc);
    for (int64_t i = n8; i < n; ++i) {
        const float d = kind == 0 ? CO_DIRECTION(0, i) : kind == 1 ? CO_DIRECTION(1, i)
                      : kind == 2 ? CO_DIRECTION(2, i) : CO_DIRECTION(3, i);
        total += (double)d * d;
    }
    return total;
}

/*
 * out[s] <- the sum of squares over segment s of the direction d = fma(p, wd, q * a_s), q = x / den
 * (den == NULL: x), a_s = (float)scales[s], p segment s's parameter at address dests[s] (dests ==
 * NULL: d = q * a_s), each operation rounded on its own as the PyTorch composition rounds it
 * (torch.div, _foreach_mul by a scalar, _foreach_add_ with alpha: one FMA in its CPU kernels), and
 * summed as co_segment_sumsq sums (8 lanes in order, a fixed tree, the tail): bit for bit forming d
 * in a buffer, then its sums. 1-bit LAMB's trust-ratio norms: one read of x, den and p where the
 * composition wrote and read d twice more.
 */
CO_EXACT void co_direction_sumsq(const float *x, const float *den, const double *scales, const int64_t *dests, float wd,
                                 const int64_t *off, int64_t nseg, double *out) {
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t lo = off[s];
        const float *ps = dests ? (const float *)(intptr_t)dests[s] : NULL;
        const int kind = (den ? 1 : 0) | (ps ? 2 : 0);
        out[s] = direction_segment(x + lo, den ? den + lo : x + lo, ps ? ps : x + lo, off[s + 1] - lo,
                                   (float)scales[s], wd, kind);
    }
}
#undef CO_DIRECTION

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
        double total = lanes_tree(acc);
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
