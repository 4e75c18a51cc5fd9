/*
 * 0/1 Adam's phase-B passes (compressed_opt.cuda.local_steps).
 *
 * One pass over a bucket for each of: a local step, the step's work before its synchronisation's
 * exchange, and the work after it. Segment s is [off[s], off[s + 1]) of the flat buffers, one
 * parameter; per-segment scalars are doubles used as floats (as torch uses a Python scalar on an
 * fp32 tensor); dests[s] is the address of segment s's parameter (0: none, then nothing of it is
 * written). sden is the frozen denominator sqrt(v) + eps as PyTorch made it, its sign bit set
 * where v == 0: den = |sden|, and a negative sden marks a coordinate without variance (m and the
 * exchanged y are 0 there), one stream for both. (PyTorch's sqrt is not the correctly rounded
 * sqrtf on every build, MKL's is not: the passes take PyTorch's.) The gradient g is the flat
 * buffer g, or with srcs (non-NULL) segment s's at address srcs[s] (each parameter's own gradient,
 * read where it lies: no gather into g first; elements past the segments are g's).
 *
 * Rounding: each operation is rounded on its own, in the order of the PyTorch composition
 * (compressed_opt/zero_one_local.py), so that the results are that composition's bit for bit; no
 * contraction into FMA (CO_EXACT, onebit_cpu.h) but the
 * lerp's, written as torch's vector kernel computes it on CPUs with FMA: fma(w, g - m, m) for
 * |w| < 1/2, else fma(w - 1, g - m, g).
 */
#include "onebit_cpu.h"

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

/* m <- lerp(m, g, w) as torch's vector kernel (co_torch_lerp), 0 where v == 0. */
#define ZO_MOMENTUM(mi, mk, gk, sk, coeff, small)                                                                   \
    const float mi = zo_where_variance(co_torch_lerp((mk), (gk), (coeff), (small)), (sk))

/*
 * A local step (no synchronisation), per element of segment s (c_s = steps[s], as a float):
 *   m <- lerp(m, g, w), 0 where v == 0;      den = |sden|
 *   acc <- acc + (lr * m) / den
 *   p <- p * decay (when decayed);  p <- p + (c_s * m) / den      (c_s = -lr f_s)
 * Elements past off[nseg] (up to n) get m and acc only.
 */
CO_EXACT void co_zo_local_step(const int64_t *dests, const float *g, const int64_t *srcs, float *m, const float *sden,
                              float *acc, const int64_t *off, int64_t nseg, int64_t n, float w, float lr, float decay,
                              int decayed, const double *steps) {
    CO_NO_CONTRACT
    const int small = w < 0.5f && w > -0.5f;
    const float coeff = small ? w : w - 1.0f;
    for (int64_t s = 0; s <= nseg; ++s) {
        const int64_t lo = s < nseg ? off[s] : off[nseg], hi = s < nseg ? off[s + 1] : n;
        if (hi <= lo) continue;
        float *restrict p = s < nseg ? (float *)(intptr_t)dests[s] : NULL;
        const float c = s < nseg ? (float)steps[s] : 0.0f;
        const float *restrict gs = srcs && s < nseg ? (const float *)(intptr_t)srcs[s] : g + lo;
        const float *restrict ds = sden + lo;
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
CO_EXACT void co_zo_sync_before(const float *g, const int64_t *srcs, float *m, const float *sden, float *acc,
                               const int64_t *off, int64_t nseg, int64_t n, float w, float lr, const double *scales) {
    CO_NO_CONTRACT
    const int small = w < 0.5f && w > -0.5f;
    const float coeff = small ? w : w - 1.0f;
    for (int64_t s = 0; s <= nseg; ++s) {
        const int64_t lo = s < nseg ? off[s] : off[nseg], hi = s < nseg ? off[s + 1] : n;
        if (hi <= lo) continue;
        const int scaled = scales && s < nseg;
        const float c = scaled ? (float)scales[s] : 1.0f;
        const float *restrict gs = srcs && s < nseg ? (const float *)(intptr_t)srcs[s] : g + lo;
        const float *restrict ds = sden + lo;
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
static CO_EXACT __attribute__((noinline)) void zo_after_segment(
    float *restrict ys, const float *restrict rs, const float *restrict ds, float *restrict ms, float *restrict an,
    float *restrict p, int64_t len, float d, float c, float lr_sum, float decay, int kind) {
    CO_NO_CONTRACT
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

/* zo_after_segment over len elements, CO_TILE at a time, m and p (only written) formed in stack tiles
 * and streamed out (co_stream_out: not read for ownership; the caller fences). */
static void zo_after_piece(float *ys, const float *rs, const float *ds, float *ms, float *an, float *p, int64_t len,
                           float d, float c, float lr_sum, float decay, int kind) {
    float mt[CO_TILE], pt[CO_TILE];
    for (int64_t k = 0; k < len; k += CO_TILE) {
        const int64_t l = min64(CO_TILE, len - k);
        zo_after_segment(ys + k, rs + k, ds + k, mt, an + k, (kind & 1) ? pt : an + k, l, d, c, lr_sum, decay, kind);
        co_stream_out(ms + k, mt, l);
        if (kind & 1) co_stream_out(p + k, pt, l);
    }
}

CO_EXACT void co_zo_sync_after(const int64_t *dests, float *y, const float *r, const float *sden, float *m,
                              float *anchor, const int64_t *off, int64_t nseg, int64_t n, float lr_sum, float decay,
                              int decayed, const double *divisors, const double *steps) {
    for (int64_t s = 0; s <= nseg; ++s) {
        const int64_t lo = s < nseg ? off[s] : off[nseg], hi = s < nseg ? off[s + 1] : n;
        if (hi <= lo) continue;
        float *p = s < nseg ? (float *)(intptr_t)dests[s] : NULL;
        const int divided = divisors && s < nseg;
        const float d = divided ? (float)divisors[s] : 1.0f, c = s < nseg ? (float)steps[s] : 0.0f;
        const int kind = (r ? 8 : 0) | (divided ? 4 : 0) | (decayed ? 2 : 0) | (p ? 1 : 0);
        zo_after_piece(y + lo, (r ? r : sden) + lo, sden + lo, m + lo, anchor + lo, p, hi - lo, d, c, lr_sum, decay,
                       kind);
    }
    co_store_fence();
}

/*
 * co_decompress_rows(rows, row_stride, ., chunk, block, acc, n) then co_zo_sync_after(dests, acc,
 * r, sden, m, anchor, off, nseg, n, lr_sum, decay, decayed, divisors, steps), bit for bit, without
 * y in memory: y (the exchange's result as its 1-bit rows, row_stride bytes apart, chunk elements
 * each, one scale per block) is decompressed tile by tile (at most CO_TILE elements of one block of
 * one row) into the stack and consumed there by the same loops (zo_after_segment on the tile), and
 * acc <- +0 tile by tile (co_stream_zeros: acc is only written, not read for ownership either).
 * Reads the rows, r, sden, anchor
 * and writes m, anchor, the destinations and acc; m and the destinations with non-temporal stores
 * (zo_after_piece).
 */
void co_zo_sync_after_rows(const int64_t *dests, const uint8_t *rows, int64_t row_stride, int64_t chunk,
                           int64_t block, float *acc, const float *r, const float *sden, float *m, float *anchor,
                           const int64_t *off, int64_t nseg, int64_t n, float lr_sum, float decay, int decayed,
                           const double *divisors, const double *steps) {
    float tile[CO_TILE];
    int64_t s = 0;
    for (int64_t k0 = 0; k0 < n;) {
        const int64_t len = next_tile(rows, row_stride, chunk, block, k0, n, tile);
        const int64_t end = k0 + len;
        for (int64_t k = k0; k < end;) {
            const int64_t stop = segment_piece(off, nseg, &s, k, end);
            const int in = s < nseg; /* (else: the elements past the segments) */
            float *p = in ? (float *)(intptr_t)dests[s] : NULL;
            const int divided = divisors && in;
            const float d = divided ? (float)divisors[s] : 1.0f, c = in ? (float)steps[s] : 0.0f;
            const int kind = (r ? 8 : 0) | (divided ? 4 : 0) | (decayed ? 2 : 0) | (p ? 1 : 0);
            zo_after_piece(tile + (k - k0), (r ? r : sden) + k, sden + k, m + k, anchor + k,
                           p ? p + (k - off[s]) : NULL, stop - k, d, c, lr_sum, decay, kind);
            k = stop;
        }
        co_stream_zeros(acc + k0, len);
        k0 = end;
    }
    co_store_fence();
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
    const int64_t *srcs; /* NULL: segment s's g at g + off[s]; else at srcs[s] */
    float *m;
    float coeff, lr;
    int small;
    const double *scales, *bounds;
    const int64_t *off;
    int64_t nseg, seg;
};

/* error[0, len) <- x + error for x the passes' values of len elements of one segment (kind: 1 times
 * c, 2 clamp(r x, -b, b)); m written. A function of its own, as zo_after_segment. */
static CO_EXACT __attribute__((noinline)) void zo_before_segment(
    const float *restrict gs, float *restrict ms, const float *restrict ds, const float *restrict as,
    const float *restrict rs, float *restrict e, int64_t len, float coeff, int small, float lr, float c, float b,
    int kind) {
    CO_NO_CONTRACT
    const float nb = -b;
#define ZO_BEFORE_LOOP(SCALE, CLAMP)                                                                                \
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
        const int64_t stop = segment_piece(p->off, p->nseg, &s, k, end);
        const int in = s < p->nseg;
        const int kind = in ? (p->scales ? 1 : 0) | (p->r ? 2 : 0) : 0;
        const float *gs = p->srcs && in ? (const float *)(intptr_t)p->srcs[s] + (k - p->off[s]) : p->g + k;
        zo_before_segment(gs, p->m + k, p->sden + k, p->acc + k, (p->r ? p->r : p->sden) + k,
                          error + (k - lo), stop - k, p->coeff, p->small, p->lr,
                          in && p->scales ? (float)p->scales[s] : 1.0f, in && p->r ? (float)p->bounds[s] : 0.0f, kind);
        k = stop;
    }
    p->seg = s;
}

static void zo_before_compensate_any(void *pass, int64_t lo, int64_t len, float *error) {
    zo_before_compensate((struct zo_before *)pass, lo, len, error);
}

void co_zo_sync_before_compress_rows(const float *g, const int64_t *srcs, float *m, const float *sden, const float *acc,
                                     float w, float lr, const double *scales, const float *r, const double *bounds,
                                     const int64_t *off, int64_t nseg, float *error, uint8_t *rows, int64_t row_stride,
                                     int64_t world, int64_t chunk, int64_t block, int64_t n) {
    const int small = w < 0.5f && w > -0.5f;
    struct zo_before pass = {g, sden, acc, r, srcs, m, small ? w : w - 1.0f, lr, small, scales, bounds, off, nseg, 0};
    compress_each_row(NULL, error, rows, row_stride, world, chunk, block, n, zo_before_compensate_any, &pass);
}

/*
 * Phase A's compressed step after its exchange (compressed_opt.cuda.local_steps.zero_one_phase_a_
 * update_), per element of a piece of segment s, y the exchange's result (the preconditioned
 * average of the ranks' R g_i), sden phase A's denominator sqrt(v) / bc2_sqrt + eps with its sign
 * bit set where v == 0:
 *   g <- y / r, 0 where v == 0;   m <- lerp(m, g, w), 0 where v == 0;
 *   p <- p * decay (when decayed);  p <- fma(m / |sden|, alpha, p)
 * kind: bit 0 a destination to write, bit 1 decayed. One loop per kind (see zo_after_segment).
 */
#define ZO_PHASE_A_LOOP(write_p, decayed_)                                                                       \
    for (int64_t i = 0; i < len; ++i) {                                                                           \
        const float sd = ds[i];                                                                                   \
        ZO_MOMENTUM(mi, ms[i], zo_where_variance(ys[i] / rs[i], sd), sd, coeff, small);                           \
        ms[i] = mi;                                                                                               \
        if (write_p) p[i] = fmaf(mi / fabsf(sd), alpha, (decayed_) ? p[i] * decay : p[i]);                        \
    }

static CO_EXACT __attribute__((noinline)) void zo_phase_a_piece(const float *restrict ys, const float *restrict rs,
                                                               const float *restrict ds, float *restrict ms,
                                                               float *restrict p, int64_t len, float coeff, int small,
                                                               float decay, float alpha, int kind) {
    CO_NO_CONTRACT
    switch (kind) {
    case 0: ZO_PHASE_A_LOOP(0, 0); break;
    case 1: ZO_PHASE_A_LOOP(1, 0); break;
    case 2: ZO_PHASE_A_LOOP(0, 1); break;
    default: ZO_PHASE_A_LOOP(1, 1); break;
    }
}

/* co_zo_phase_a_rows' arguments, for its spans (walk_result_rows). */
struct zo_phase_a {
    const float *r, *sden;
    float *m;
    const int64_t *off, *dests;
    float coeff, decay, alpha;
    int small, decayed;
};

static void zo_phase_a_span(void *pass, const float *y, int64_t k, int64_t stop, int64_t s) {
    const struct zo_phase_a *a = (const struct zo_phase_a *)pass;
    float *p = (float *)(intptr_t)a->dests[s];
    zo_phase_a_piece(y, a->r + k, a->sden + k, a->m + k, p ? p + (k - a->off[s]) : NULL, stop - k, a->coeff,
                     a->small, a->decay, a->alpha, (p ? 1 : 0) | (a->decayed ? 2 : 0));
}

/*
 * co_decompress_rows(rows, row_stride, ., chunk, block, y, n) then the element above over the
 * segments' n = off[nseg] elements (segment s's parameter at address dests[s], 0: none), without y
 * in memory: decompressed tile by tile (walk_result_rows) into the stack. Reads the rows, r, sden,
 * m and the parameters; writes m and the parameters.
 */
void co_zo_phase_a_rows(const int64_t *dests, const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block,
                        const float *r, const float *sden, float *m, const int64_t *off, int64_t nseg, float w,
                        float decay, int decayed, float alpha) {
    const int small = w < 0.5f && w > -0.5f;
    struct zo_phase_a pass = {r, sden, m, off, dests, small ? w : w - 1.0f, decay, alpha, small, decayed};
    walk_result_rows(rows, row_stride, chunk, block, off, nseg, zo_phase_a_span, &pass);
}
