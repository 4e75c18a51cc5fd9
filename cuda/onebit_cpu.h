/*
 * What the CPU kernels' sources share (onebit_cpu.c: the compression; segmented_cpu.c: the
 * segmented passes around it; lamb_cpu.c: 1-bit LAMB's compression step; zero_one_cpu.c: 0/1
 * Adam's phase B), compiled together into one library by compressed_opt.cuda.cpu: the rows'
 * geometry, the elements that two passes must form alike (the compiler then contracts them alike),
 * and the compression loop that other passes fuse into.
 */
#ifndef CO_ONEBIT_CPU_H
#define CO_ONEBIT_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CO_AVX2 1
#if defined(__AVX512F__)
/* 16 floats a register, and masks: a byte of bits is a mask as it is (bit k, element k) */
#define CO_AVX512 1
#endif
#endif

#if defined(__GNUC__)
#define CO_INTERNAL __attribute__((visibility("hidden")))
#else
#define CO_INTERNAL
#endif

/*
 * A function whose every operation is rounded on its own, as PyTorch's one-kernel-per-operation
 * compositions round them (1-bit LAMB's and 0/1 Adam's passes): CO_EXACT on the function (GCC's
 * -O3 -march=native would contract a multiplication and an addition into an FMA), CO_NO_CONTRACT
 * at the top of its body (clang's form); an FMA where PyTorch's kernel is one is written as fmaf.
 */
#if defined(__clang__)
#define CO_EXACT
#define CO_NO_CONTRACT _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define CO_EXACT __attribute__((optimize("fp-contract=off")))
#define CO_NO_CONTRACT
#else
#define CO_EXACT
#define CO_NO_CONTRACT
#endif

/*
 * Rows: chunk j of a buffer travels as row j, nb = ceil(chunk / block) fp32 scales (4 nb bytes)
 * then chunk / 8 bytes of bits; block b of a chunk is its elements [b block, min((b+1) block,
 * chunk)). chunk and block are multiples of 8 (the callers: of 32 and of 256).
 */
static inline int64_t blocks_of(int64_t chunk, int64_t block) { return (chunk + block - 1) / block; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* How many of the len elements starting at lo are among the first n: clamp(n - lo, 0, len). */
static inline int64_t valid_in(int64_t n, int64_t lo, int64_t len) { return n <= lo ? 0 : min64(n - lo, len); }

/* Elements of a result's rows decompressed at once into a stack tile (1 KiB: in L1) by the passes
 * that read the rows in place of the result (co_rows_divide_zero_descend, co_lamb_rows_variance_maxima,
 * co_zo_sync_after_rows: next_tile). */
#define CO_TILE 256

/*
 * dst[0, len) <- src[0, len) (a tile in cache) with non-temporal stores where the CPU has AVX2, for a
 * buffer a pass only writes: the line is not read for ownership first, one stream of the buffer's
 * bytes where a plain store costs two. The values are the plain stores' (only where they go
 * differs); the pass ends with co_store_fence, so that its caller sees them.
 */
static inline void co_stream_out(float *restrict dst, const float *restrict src, int64_t len) {
    int64_t i = 0;
#ifdef CO_AVX2
    for (; i < len && ((uintptr_t)(dst + i) & 31u); ++i) dst[i] = src[i];
    for (; i + 8 <= len; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < len; ++i) dst[i] = src[i];
}

/* dst[0, len) <- +0, streamed out as co_stream_out streams (a buffer only written: no read for
 * ownership where the CPU has AVX2). */
static inline void co_stream_zeros(float *dst, int64_t len) {
    int64_t i = 0;
#ifdef CO_AVX2
    for (; i < len && ((uintptr_t)(dst + i) & 31u); ++i) dst[i] = 0.0f;
    for (; i + 8 <= len; i += 8) _mm256_stream_ps(dst + i, _mm256_setzero_ps());
#endif
    for (; i < len; ++i) dst[i] = 0.0f;
}

/* torch.lerp(m, g, w) as PyTorch's CPU vector kernel computes it with FMA: fma(w, g - m, m) for
 * |w| < 1/2 (small), else fma(w - 1, g - m, g); coeff is w or w - 1. The passes that replace a
 * composition's lerp_ (0/1 Adam's, LAMB's warmup) form it here; it is exact only inside functions
 * that contract nothing else (CO_EXACT). */
static inline __attribute__((always_inline)) float co_torch_lerp(float m, float g, float coeff, int small) {
    return fmaf(coeff, g - m, small ? m : g);
}

static inline void co_store_fence(void) {
#ifdef CO_AVX2
    _mm_sfence();
#endif
}

/*
 * The segment of element k and where its piece of [k, end) stops: *s advances (segments come in
 * order, off[nseg] ends the last) to the segment holding k, or to nseg past the segments, whose
 * piece runs to end. Every pass that walks a flat buffer's segments in pieces cuts them so.
 */
static inline int64_t segment_piece(const int64_t *off, int64_t nseg, int64_t *s, int64_t k, int64_t end) {
    while (*s < nseg && off[*s + 1] <= k) ++*s;
    return *s < nseg ? min64(off[*s + 1], end) : end;
}

static inline float load_scale(const uint8_t *p) {
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

/*
 * A pass fused into a compression (co_lsc, 0/1 Adam's zo_before): error[0, len) <- u = v + error,
 * v the pass's values of the flat buffer's elements [lo, lo + len), formed as the block is
 * compensated. pass is the pass's own state.
 */
typedef void (*co_compensate)(void *pass, int64_t lo, int64_t len, float *error);

/* The compression of the n valid elements of world chunks into world rows (row_stride bytes
 * apart), x + error or, with compensate, the pass's values + error (onebit_cpu.c). */
CO_INTERNAL void compress_each_row(const float *x, float *error, uint8_t *rows, int64_t row_stride, int64_t world,
                                   int64_t chunk, int64_t block, int64_t n, co_compensate compensate, void *pass);

/* dst[k] <- s (2 b_k - 1) for k < count, b_k bit k % 8 of src[k / 8] (onebit_cpu.c). */
CO_INTERNAL void expand_signs(const uint8_t *src, float s, float *dst, int64_t count);

/*
 * The tile of a result that starts at element k0 of n, decompressed from its rows (row_stride
 * bytes apart, chunk elements each, one scale per block) into tile: at most CO_TILE elements, never
 * across a block or a chunk (so from a whole byte of bits, with one scale). Returns its length.
 */
static inline int64_t next_tile(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block, int64_t k0,
                                int64_t n, float *tile) {
    const int64_t j = k0 / chunk, in_chunk = k0 - j * chunk, b = in_chunk / block;
    const int64_t len = min64(min64(CO_TILE, (b + 1) * block - in_chunk), min64(chunk - in_chunk, n - k0));
    const uint8_t *row = rows + j * row_stride;
    expand_signs(row + 4 * blocks_of(chunk, block) + in_chunk / 8, load_scale(row + 4 * b), tile, len);
    return len;
}

/*
 * A result's rows (row_stride bytes apart, chunk elements each, one scale per block) walked over its
 * first off[nseg] elements tile by tile (next_tile: decompressed into the stack), each tile cut at
 * the segments' ends: span(pass, y, k, stop, s) for each piece [k, stop) of segment s, y its
 * values. The passes that read an exchange's result from its rows walk it so (onebit_cpu.c).
 */
typedef void (*co_result_span)(void *pass, const float *y, int64_t k, int64_t stop, int64_t s);

CO_INTERNAL void walk_result_rows(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block,
                                  const int64_t *off, int64_t nseg, co_result_span span, void *pass);

/* The same walk over the elements [lo, end) of a result of n valid elements, *seg the segment of
 * the last element walked (advanced; pieces past the segments have s == nseg): a pass fused into
 * a compression walks each block's elements so (ZeRO's local momentum from its kept rows). */
CO_INTERNAL void walk_rows_range(const uint8_t *rows, int64_t row_stride, int64_t chunk, int64_t block, int64_t n,
                                 const int64_t *off, int64_t nseg, int64_t *seg, int64_t lo, int64_t end,
                                 co_result_span span, void *pass);

#endif
