/*
 * 1-bit LAMB's compression-stage passes (compressed_opt.cuda.lamb_passes).
 *
 * Its own helpers (lamb_*), and its own rounding rule (CO_EXACT, onebit_cpu.h). Every operation is one
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

#include "onebit_cpu.h"


/* torch.nan_to_num(x, nan=0, posinf=0) (neginf: the lowest float), as a max's operand. */
static inline CO_EXACT float lamb_finite_or_zero(float x) {
    float z = (x != x || x == INFINITY) ? 0.0f : x;
    return z == -INFINITY ? -FLT_MAX : z;
}

/* The scalars of co_lamb_variance_maxima's element, and the element itself (see there). */
struct lamb_scalars {
    float nb1, b2, scale, bc2_sqrt, eps;
    int divided; /* whether to divide by bc2_sqrt: not where it is 1 (x / 1 == x exactly) */
};

static inline CO_EXACT float lamb_element(float mt, float *mp, float *vp, float d, const struct lamb_scalars *k) {
    CO_NO_CONTRACT
    const float g = fmaf(*mp, k->nb1, mt);
    *mp = mt;
    const float decayed = *vp * k->b2;
    const float sg = k->scale * g;
    const float vn = fmaf(sg, g, decayed);
    *vp = vn;
    const float root = sqrtf(vn);
    const float unbiased = k->divided ? root / k->bc2_sqrt : root;
    const float q = unbiased + k->eps;
    return lamb_finite_or_zero(d / q);
}

#ifdef CO_AVX2
/* Eight elements of co_lamb_variance_maxima at once, the same operations (the same roundings). */
static inline CO_EXACT __m256 lamb_element8(__m256 mt, float *mp, float *vp, const float *dp,
                                              const struct lamb_scalars *k) {
    const __m256 g = _mm256_fmadd_ps(_mm256_loadu_ps(mp), _mm256_set1_ps(k->nb1), mt);
    _mm256_storeu_ps(mp, mt);
    const __m256 decayed = _mm256_mul_ps(_mm256_loadu_ps(vp), _mm256_set1_ps(k->b2));
    const __m256 vn = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k->scale), g), g, decayed);
    _mm256_storeu_ps(vp, vn);
    const __m256 root = _mm256_sqrt_ps(vn);
    const __m256 q = _mm256_add_ps(k->divided ? _mm256_div_ps(root, _mm256_set1_ps(k->bc2_sqrt)) : root,
                                   _mm256_set1_ps(k->eps));
    __m256 f = _mm256_div_ps(_mm256_loadu_ps(dp), q);
    const __m256 bad = _mm256_or_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q),
                                    _mm256_cmp_ps(f, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
    f = _mm256_andnot_ps(bad, f);
    return _mm256_blendv_ps(f, _mm256_set1_ps(-FLT_MAX), _mm256_cmp_ps(f, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}
#endif

/*
 * The max of f over n elements of one segment, m_t formed from ys (y / r, 0 where r == 0, with rs;
 * y / c with divided; else y), m and v written (co_lamb_variance_maxima's element, below); -inf for
 * n == 0. Eight elements at a time (lamb_element8) then one at a time (lamb_element): the same
 * operations, so which of the two forms an element changes none of its bits.
 */
static inline CO_EXACT float lamb_span(const float *ys, const float *rs, int divided, float c, float *ms, float *vs,
                                       const float *ds, int64_t n, const struct lamb_scalars *k) {
    CO_NO_CONTRACT
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
        } else if (divided) {
            mt = _mm256_div_ps(mt, cv);
        }
        best8 = _mm256_max_ps(lamb_element8(mt, ms + i, vs + i, ds + i, k), best8);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best8);
    for (int j = 0; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
#endif
    for (; i < n; ++i) {
        const float mt = rs ? quotient_or_zero(ys[i], rs[i]) : divided ? ys[i] / c : ys[i];
        const float f = lamb_element(mt, ms + i, vs + i, ds[i], k);
        best = f > best ? f : best;
    }
    return best;
}

/*
 * Over segment s = [off[s], off[s + 1]) of the flat buffers, for each element:
 *   m_t  = y / r (+0 where r == 0)             r != NULL: the preconditioned exchange
 *        = y / c_s                              r == NULL, divisors != NULL: the momentum exchange
 *        = y                                    neither
 *   g    = fma(m_prev, -b1, m_t)                torch.add(m_t, m_prev, alpha=-b1): (1 - b1) g~
 *   v    = fma(scale * g, g, v * b2)            v.mul_(b2).addcmul_(g, g, value=scale)
 *   q    = (sqrt(v) / bc2_sqrt) + eps           torch.sqrt(v).div_(bc2_sqrt).add_(eps)
 *                                               (bc2_sqrt == 1, as from about step 16,600 at b2 0.999:
 *                                               no division, x / 1 == x exactly)
 *   f    = nan_to_num(denom / q, nan=0, posinf=0)
 *   m    <- m_t (m held m_prev); v written; nothing else is written (g, q and f stay in registers)
 * and maxima[s] = max of f over the segment (1 for an empty segment: what the composition's
 * per-layer maximum gives an empty layer). m, v, y, r and denom: fp32, numel off[nseg] each.
 */
CO_EXACT void co_lamb_variance_maxima(const float *y, const float *r, const double *divisors, float *m, float *v,
                                        const float *denom, const int64_t *off, int64_t nseg, float b1, float b2,
                                        float scale, float bc2_sqrt, float eps, float *maxima) {
    CO_NO_CONTRACT
    const struct lamb_scalars k = {-b1, b2, scale, bc2_sqrt, eps, bc2_sqrt != 1.0f};
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        if (n == 0) {
            maxima[s] = 1.0f;
            continue;
        }
        maxima[s] = lamb_span(y + lo, r ? r + lo : NULL, divisors != NULL, divisors ? (float)divisors[s] : 1.0f,
                              m + lo, v + lo, denom + lo, n, &k);
    }
}

/* co_lamb_rows_variance_maxima's arguments, for its spans (walk_result_rows). */
struct lamb_rows_maxima {
    const float *r, *denom;
    const double *divisors;
    float *m, *v, *maxima;
    const struct lamb_scalars *k;
};

CO_EXACT static void lamb_rows_maxima_span(void *pass, const float *y, int64_t i, int64_t stop, int64_t s) {
    const struct lamb_rows_maxima *p = (const struct lamb_rows_maxima *)pass;
    const float best = lamb_span(y, p->r ? p->r + i : NULL, p->divisors != NULL,
                                 p->divisors ? (float)p->divisors[s] : 1.0f, p->m + i, p->v + i, p->denom + i,
                                 stop - i, p->k);
    p->maxima[s] = best > p->maxima[s] ? best : p->maxima[s];
}

/*
 * co_decompress_rows(rows, row_stride, nrows, chunk, block, y, off[nseg]) then
 * co_lamb_variance_maxima(y, ...), bit for bit, without y in memory: y is decompressed tile by tile
 * (at most CO_TILE elements of one block of one row) into the stack and consumed there, as
 * co_rows_divide_zero_descend does (reads the rows, r, m, v and denom; writes m and v). A segment's
 * maximum is the max of its pieces' (one per tile it meets): max is exact and f is never NaN, so
 * how the elements fall into tiles and vector lanes changes nothing.
 */
void co_lamb_rows_variance_maxima(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block,
                                  const float *r, const double *divisors, float *m, float *v, const float *denom,
                                  const int64_t *off, int64_t nseg, float b1, float b2, float scale, float bc2_sqrt,
                                  float eps, float *maxima) {
    const struct lamb_scalars k = {-b1, b2, scale, bc2_sqrt, eps, bc2_sqrt != 1.0f};
    for (int64_t s = 0; s < nseg; ++s) maxima[s] = off[s + 1] > off[s] ? -INFINITY : 1.0f;
    struct lamb_rows_maxima pass = {r, denom, divisors, m, v, maxima, &k};
    walk_result_rows(rows, row_stride, chunk, block, off, nseg, lamb_rows_maxima_span, &pass);
}

/*
 * The update, written through each segment's own pointer dests[s] (a parameter's memory; 0: a
 * parameter without elements, skipped): over segment s,
 *   u = (m / denom) * alpha_s;   p <- (p * decay_s) + u      (decays == NULL: p <- p + u)
 * each operation rounded as torch.div, then torch._foreach_mul_ of the parameters and of the
 * direction's views, then torch._foreach_add_ round them. alpha_s, decay_s: doubles, used as floats.
 */
CO_EXACT void co_lamb_descend(const int64_t *dests, const float *m, const float *denom, const int64_t *off,
                                int64_t nseg, const double *decays, const double *alphas) {
    CO_NO_CONTRACT
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
 * LAMB's warmup (compressed_opt.cuda.lamb_warmup.warmup_moments_), over n elements of the flat g,
 * m and v:
 *   m <- lerp(m, g, w)                     as torch's vector lerp (co_torch_lerp)
 *   v <- fma(scale * g, g, v * b2)         v.mul_(b2).addcmul_(g, g, value=scale)
 */
CO_EXACT void co_lamb_warmup_moments(const float *g, float *m, float *v, int64_t n, float w, float b2, float scale) {
    CO_NO_CONTRACT
    const int small = w < 0.5f && w > -0.5f;
    const float coeff = small ? w : w - 1.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i];
        m[i] = co_torch_lerp(m[i], gi, coeff, small);
        v[i] = fmaf(scale * gi, gi, v[i] * b2);
    }
}

/* u <- m / (((u / bc2_sqrt) + eps) * bc1) (divided: else no division by bc2_sqrt), then (p != NULL)
 * u <- fma(p, wd, u): one element of co_lamb_warmup_direction. */
#define LAMB_DIRECTION_LOOP(divided, decayed)                                                                     \
    for (int64_t i = 0; i < n; ++i) {                                                                             \
        const float den = ((divided) ? u[i] / bc2_sqrt : u[i]) + eps;                                             \
        const float q = m[i] / (den * bc1);                                                                       \
        u[i] = (decayed) ? fmaf(p[i], wd, q) : q;                                                                 \
    }

/* One span of co_lamb_warmup_direction, one loop per kind (bit 0: decayed, bit 1: divided). */
static CO_EXACT __attribute__((noinline)) void lamb_direction_span(float *restrict u, const float *restrict m,
                                                                  const float *restrict p, int64_t n, float bc2_sqrt,
                                                                  float eps, float bc1, float wd, int kind) {
    CO_NO_CONTRACT
    switch (kind) {
    case 0: LAMB_DIRECTION_LOOP(0, 0); break;
    case 1: LAMB_DIRECTION_LOOP(0, 1); break;
    case 2: LAMB_DIRECTION_LOOP(1, 0); break;
    default: LAMB_DIRECTION_LOOP(1, 1); break;
    }
}

/*
 * LAMB's warmup direction (compressed_opt.cuda.lamb_warmup.warmup_direction_): u holds sqrt(v)
 * (PyTorch's: torch.sqrt is not the correctly rounded sqrtf everywhere), and becomes the update
 * direction m_hat / (sqrt(v_hat) + eps) + wd p, rounded as the composition rounds it:
 *   u <- u / bc2_sqrt (divided);  u <- u + eps;  u <- u * bc1;  u <- m / u;  u <- fma(p, wd, u) (decayed)
 * over segment s = [off[s], off[s + 1]), p segment s's parameter at address dests[s] (0: none), or
 * with dests == NULL the flat p itself (a ZeRO chunk's values).
 */
void co_lamb_warmup_direction(float *u, const float *m, const float *p, const int64_t *dests, const int64_t *off,
                              int64_t nseg, float bc2_sqrt, int divided, float eps, float bc1, float wd, int decayed) {
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t lo = off[s], n = off[s + 1] - lo;
        if (n == 0) continue;
        const float *ps = !decayed ? NULL : dests ? (const float *)(intptr_t)dests[s] : p + lo;
        lamb_direction_span(u + lo, m + lo, ps, n, bc2_sqrt, eps, bc1, wd, (ps ? 1 : 0) | (divided ? 2 : 0));
    }
}

/*
 * LAMB's step of each layer by its trust ratio (compressed_opt.cuda.lamb_warmup.step_layers_):
 * segment s's parameter (address dests[s], 0: none) <- p + u * scales[s] over [off[s], off[s + 1])
 * of u, each operation rounded on its own (torch._foreach_mul_ of u's views by the scales, then
 * torch._foreach_add_ of them to the parameters); u is only read. scales: doubles, used as floats.
 */
CO_EXACT void co_lamb_step_layers(const int64_t *dests, const float *u, const int64_t *off, int64_t nseg,
                                  const double *scales) {
    CO_NO_CONTRACT
    for (int64_t s = 0; s < nseg; ++s) {
        float *restrict p = (float *)(intptr_t)dests[s];
        const int64_t lo = off[s], n = off[s + 1] - off[s];
        if (!p || n == 0) continue;
        const float c = (float)scales[s];
        const float *restrict us = u + lo;
        for (int64_t i = 0; i < n; ++i) {
            const float step = us[i] * c;
            p[i] = p[i] + step;
        }
    }
}
