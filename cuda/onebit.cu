/*
 * CUDA kernels of error-feedback 1-bit compression (docs/design.md 2.1, 2.2).
 *
 * Compiled at first use by compressed_opt.cuda.gpu with CuPy (NVRTC): no host code, no #include.
 * Same contract as onebit_cpu.c and reference.py, on fp32 buffers:
 *   a buffer of world chunks of chunk elements travels as world rows of bytes, row j =
 *   [nb fp32 scales (4 nb bytes, little endian) | chunk / 8 bytes of chunk j's sign bits],
 *   nb = ceil(chunk / block); block b of a chunk is its elements [b block, min((b+1) block, chunk)),
 *   and rows lie row_stride >= 4 nb + chunk / 8 bytes apart;
 *   bit k of a row's bits is bit (k % 8) of byte k / 8 (little bit order);
 *   bit = 1 iff u >= 0 (zero counts as +); bits of invalid elements are 1;
 *   per block, s = sqrt(sum(u^2) / count) over its valid elements (fp64 sum, 0 when count == 0),
 *   stored as fp32; decompressed value = s * (2 bit - 1), with that fp32 s.
 * chunk is a multiple of 32 and block a multiple of 256 (CO_TILE), so a block is whole warp tiles
 * (the last block of a chunk may end with a part of one, of whole bytes).
 *
 * Kernels (one launch each, no workspace, no grid-wide reduction, nothing waits for the host):
 *   co_compress_rows: one warp owns one unit (row j, block b) of the world * nb; pass 1 walks the
 *     block's tiles: u = x + error, stored in error, its bits packed, sum(u^2) accumulated in
 *     fp64; a shuffle reduction gives the block's fp32 scale; pass 2 walks the tiles again
 *     (reloading u from error, cache-hot) and stores error <- u - s (u >= 0 ? 1 : -1).
 *     Every byte of every row is written: empty blocks get scale 0 and bits 0xFF.
 *   co_average_compress_rows: the same over the nb blocks of one chunk, with u = z = error +
 *     sum_i w_ib (2 b_ik - 1), w_ib = scale_ib / (float)world, added in rank order i = 0, 1, ...
 *     like onebit_cpu.c (any world: lane l loads w for rank i0 + l, a shuffle hands it round).
 *   co_decompress_rows: blocks along y walk the rows, warps along x a row's tiles; a tile lies in
 *     one block, so it has one scale.
 *   co_lerp_scale_clamp_compress_rows: co_compress_rows whose x is formed in its pass 1, element by
 *     element in registers, as the local momentum of the preconditioned exchange
 *     (compressed_opt.cuda.segmented.lerp_scale_clamp_, PyTorch's ops on CUDA) forms it (mode 1), or
 *     as scale_clamp_ forms 0/1 Adam's exchanged value (mode 0), or as torch.lerp forms the
 *     momentum exchange's (mode 2); that value is never written.
 *
 * Work is cut into warp tiles of CO_TILE = 256 elements, i.e. 32 bytes of bits: lane l owns
 * elements 32 j + l (j < 8) of its tile, so every load and store of floats is coalesced; the
 * ballot of step j is the 32 bits of bytes 4 j .. 4 j + 3 of the tile, and lane l writes byte l.
 * Going the other way, lane l loads byte l of the tile and __shfl_sync hands each lane its byte.
 * Units and tiles are dealt to warps grid-stride, so any grid size is correct; launch with
 * blockDim.x == CO_BLOCK. Nothing needs aligned pointers: tensors may be views at any offset, and
 * scales are read and written byte by byte.
 */

#define CO_BLOCK 256 /* threads per block */
#define CO_WARPS (CO_BLOCK / 32)
#define CO_STEPS 8 /* a warp tile is CO_STEPS * 32 elements */
#define CO_TILE (CO_STEPS * 32)
#define CO_TILE_BYTES (CO_TILE / 8)
#define CO_ALL 0xffffffffu

typedef long long i64;
typedef unsigned char u8;

__device__ __forceinline__ int co_lane() { return threadIdx.x & 31; }

/* Sum over the warp, the same value in every lane (the butterfly adds the same pairs in each). */
__device__ __forceinline__ double co_warp_allsum(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(CO_ALL, v, offset);
    return v;
}

/* The fp32 at p (4 bytes, little endian, any alignment). */
__device__ __forceinline__ float co_load_scale(const u8 *p) {
    return __uint_as_float((unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) |
                           ((unsigned)p[3] << 24));
}

/* Store s at p (4 bytes, little endian, any alignment): lanes 0..3 write one byte each. */
__device__ __forceinline__ void co_store_scale(u8 *p, float s) {
    const int lane = co_lane();
    if (lane < 4) p[lane] = (u8)(__float_as_uint(s) >> (8 * lane));
}

/* min(max(v, 0), hi) */
__device__ __forceinline__ i64 co_clamp(i64 v, i64 hi) { return v < 0 ? 0 : (v > hi ? hi : v); }

/*
 * u[j] = src[c] for c = t * CO_TILE + 32 j + lane < count, else 0 (whole tiles load unguarded).
 * src is not __restrict__: pass 2 reloads what pass 1 stored, which the read-only (non-coherent)
 * cache path must not serve.
 */
__device__ __forceinline__ void co_load_tile(const float *src, i64 t, i64 count, float *u) {
    const i64 c0 = t * CO_TILE + co_lane();
    if ((t + 1) * CO_TILE <= count) {
#pragma unroll
        for (int j = 0; j < CO_STEPS; ++j) u[j] = src[c0 + 32 * j];
    } else {
#pragma unroll
        for (int j = 0; j < CO_STEPS; ++j) u[j] = c0 + 32 * j < count ? src[c0 + 32 * j] : 0.0f;
    }
}

/* dst[c] = u[j] for c = t * CO_TILE + 32 j + lane < count. */
__device__ __forceinline__ void co_store_tile(const float *u, i64 t, i64 count, float *__restrict__ dst) {
    const i64 c0 = t * CO_TILE + co_lane();
#pragma unroll
    for (int j = 0; j < CO_STEPS; ++j)
        if (c0 + 32 * j < count) dst[c0 + 32 * j] = u[j];
}

/* Sum of the squares of the tile's u[j], in fp64 (u[j] == 0 past count; each square is exact). */
__device__ __forceinline__ double co_sumsq_tile(const float *u) {
    double sq = 0.0;
#pragma unroll
    for (int j = 0; j < CO_STEPS; ++j) sq += (double)u[j] * (double)u[j];
    return sq;
}

/*
 * Pack the signs of tile t of a block, u[j] = u_c for c = t * CO_TILE + 32 j + lane (bits of
 * c >= count are 1): byte t * CO_TILE_BYTES + lane of bits, if below nbytes, is written by this lane.
 */
__device__ __forceinline__ void co_pack_tile(const float *u, i64 t, i64 count, i64 nbytes,
                                             u8 *__restrict__ bits) {
    const int lane = co_lane();
    unsigned mine = 0;
#pragma unroll
    for (int j = 0; j < CO_STEPS; ++j) {
        const i64 c = t * CO_TILE + 32 * j + lane;
        const unsigned word = __ballot_sync(CO_ALL, c >= count || u[j] >= 0.0f);
        if ((lane >> 2) == j) mine = word;
    }
    const i64 b = t * CO_TILE_BYTES + lane;
    if (b < nbytes) bits[b] = (u8)(mine >> (8 * (lane & 3)));
}

/*
 * End of a unit, called by the whole warp with its lane's share `acc` of sum(u^2) over the count
 * valid elements of the block, which error (the block's first element) holds as u: the scale
 * s = sqrt(sum / count) (0 when count == 0) goes to scale_slot, and error <- u - s (2 [u >= 0] - 1).
 */
__device__ __forceinline__ void co_finish_unit(double acc, i64 count, float *__restrict__ error,
                                               u8 *__restrict__ scale_slot) {
    const double total = co_warp_allsum(acc);
    const float s = count > 0 ? (float)sqrt(total / (double)count) : 0.0f;
    co_store_scale(scale_slot, s);
    const i64 tiles = (count + CO_TILE - 1) / CO_TILE;
    for (i64 t = 0; t < tiles; ++t) {
        float u[CO_STEPS];
        co_load_tile(error, t, count, u);
#pragma unroll
        for (int j = 0; j < CO_STEPS; ++j) u[j] = u[j] - (u[j] >= 0.0f ? s : -s);
        co_store_tile(u, t, count, error);
    }
}

/* Units are walked grid-stride, one warp per unit: the first unit of this warp, and the step. */
__device__ __forceinline__ i64 co_first_warp() { return (i64)blockIdx.x * CO_WARPS + (threadIdx.x >> 5); }
__device__ __forceinline__ i64 co_warp_stride() { return (i64)gridDim.x * CO_WARPS; }

/*
 * Worker: over the n <= world * chunk valid elements, u = x + error (x == NULL: u = error);
 * row j of rows (world rows, row_stride bytes apart) <- chunk j compressed, one scale per block;
 * error <- u - C(u). Units: world * nb, unit q = (row q / nb, block q % nb).
 */
extern "C" __global__ void co_compress_rows(const float *__restrict__ x, float *__restrict__ error,
                                            u8 *__restrict__ rows, i64 row_stride, i64 world, i64 chunk,
                                            i64 block, i64 n) {
    const i64 nb = (chunk + block - 1) / block;
    const i64 units = world * nb;
    for (i64 q = co_first_warp(); q < units; q += co_warp_stride()) {
        const i64 j = q / nb, b = q - j * nb;
        const i64 lo = b * block;                              /* the block's first element in the chunk */
        const i64 len = chunk - lo < block ? chunk - lo : block; /* its elements, a multiple of 32 */
        const i64 base = j * chunk + lo;                       /* ... and in the buffer */
        const i64 count = co_clamp(n - base, len);             /* of which valid */
        u8 *row = rows + j * row_stride;
        u8 *bits = row + 4 * nb + lo / 8;
        float *e = error + base;
        const float *xs = x != 0 ? x + base : 0;
        const i64 tiles = (len + CO_TILE - 1) / CO_TILE;
        double acc = 0.0;
        for (i64 t = 0; t < tiles; ++t) {
            float u[CO_STEPS];
            co_load_tile(e, t, count, u);
            if (xs != 0) {
                float v[CO_STEPS];
                co_load_tile(xs, t, count, v);
#pragma unroll
                for (int k = 0; k < CO_STEPS; ++k) u[k] = v[k] + u[k];
                co_store_tile(u, t, count, e);
            } /* else error already holds u */
            acc += co_sumsq_tile(u);
            co_pack_tile(u, t, count, len / 8, bits);
        }
        co_finish_unit(acc, count, e, row + 4 * b);
    }
}

/*
 * The segment of buffer element k: the s with off[s] <= k < off[s + 1] (the last such s, which
 * skips empty segments), or nseg for k >= off[nseg]. off: nseg + 1 offsets, off[0] = 0.
 */
__device__ __forceinline__ i64 co_segment_of(const i64 *__restrict__ off, i64 nseg, i64 k) {
    if (k >= off[nseg]) return nseg;
    i64 lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) >> 1;
        if (off[mid] <= k) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/*
 * clamp(c (r lerp(m, x, w)), -b, b), rounded as PyTorch's ops on CUDA round it: torch.lerp(m, x, w)
 * is m + w (x - m) for |w| < 1/2, else x - (x - m)(1 - w), each contracted into one FMA (nvcc's
 * default), then x * r, then * c (foreach_mul_), then clamp_max / clamp_min (NaN stays NaN);
 * written with intrinsics so that no other contraction can happen. onebit_cpu.c forms the same.
 */
__device__ __forceinline__ float co_local_momentum(float x, float m, float r, float w, bool small, float c,
                                                   float b) {
    const float d = __fsub_rn(x, m);
    const float l = small ? __fmaf_rn(w, d, m) : __fmaf_rn(-d, __fsub_rn(1.0f, w), x);
    const float v = __fmul_rn(c, __fmul_rn(l, r));
    return v > b ? b : (v < -b ? -b : v);
}

/*
 * co_compress_rows(x', error, rows, ...) of x' = the segmented pass over x: on segment s (elements
 * [off[s], off[s + 1]) of the buffer) x'_k = co_local_momentum(x_k, m_k, r_k, w, |w| < 1/2, c_s,
 * b_s), b_s = scalars[s], c_s = scalars[nseg + s] (mode 1), or x'_k = clamp(x_k r_k, -b_s, b_s)
 * (mode 0: m, w and the c_s unused, as PyTorch's mul_ then clamps round it), or x'_k = lerp(m_k,
 * x_k, w) (mode 2: r and scalars unused, torch.lerp's formulas); past off[nseg], x'_k = x_k. x' is formed in registers in pass 1 and never written (x, m, r are only read): bit for
 * bit the pass, then co_compress_rows. Units as co_compress_rows.
 */
extern "C" __global__ void co_lerp_scale_clamp_compress_rows(const float *__restrict__ x, const float *__restrict__ m,
                                                             float w, const float *__restrict__ r,
                                                             const float *__restrict__ scalars,
                                                             const i64 *__restrict__ off, i64 nseg, int mode,
                                                             float *__restrict__ error, u8 *__restrict__ rows,
                                                             i64 row_stride, i64 world, i64 chunk, i64 block, i64 n) {
    const i64 nb = (chunk + block - 1) / block;
    const i64 units = world * nb;
    const bool small = w < 0.5f && w > -0.5f;
    for (i64 q = co_first_warp(); q < units; q += co_warp_stride()) {
        const i64 j = q / nb, b = q - j * nb;
        const i64 lo = b * block;
        const i64 len = chunk - lo < block ? chunk - lo : block;
        const i64 base = j * chunk + lo;
        const i64 count = co_clamp(n - base, len);
        u8 *row = rows + j * row_stride;
        u8 *bits = row + 4 * nb + lo / 8;
        float *e = error + base;
        const float *xs = x + (count > 0 ? base : 0);
        const i64 tiles = (len + CO_TILE - 1) / CO_TILE;
        double acc = 0.0;
        for (i64 t = 0; t < tiles; ++t) {
            float u[CO_STEPS], v[CO_STEPS];
            co_load_tile(e, t, count, u);
            co_load_tile(xs, t, count, v);
#pragma unroll
            for (int k = 0; k < CO_STEPS; ++k) {
                const i64 c = t * CO_TILE + 32 * k + co_lane();
                if (c < count) {
                    const i64 g = base + c;
                    const i64 s = co_segment_of(off, nseg, g);
                    if (s < nseg && mode == 1) {
                        v[k] = co_local_momentum(v[k], m[g], r[g], w, small, scalars[nseg + s], scalars[s]);
                    } else if (s < nseg && mode == 2) {
                        const float d = __fsub_rn(v[k], m[g]);
                        v[k] = small ? __fmaf_rn(w, d, m[g]) : __fmaf_rn(-d, __fsub_rn(1.0f, w), v[k]);
                    } else if (s < nseg) {
                        const float y = __fmul_rn(v[k], r[g]), b = scalars[s];
                        v[k] = y > b ? b : (y < -b ? -b : y);
                    }
                }
                u[k] = __fadd_rn(v[k], u[k]);
            }
            co_store_tile(u, t, count, e);
            acc += co_sumsq_tile(u);
            co_pack_tile(u, t, count, len / 8, bits);
        }
        co_finish_unit(acc, count, e, row + 4 * b);
    }
}

/*
 * Server, one chunk: over the m <= chunk valid elements, error <- z = error + sum_i w_ib (2 b_ik - 1)
 * with w_ib = (scale b of row i) / world in fp32, added in rank order i = 0, 1, ...; rows: world
 * rows, row_stride bytes apart. Then out_row <- z compressed (one scale per block), error <- z - C(z).
 * Units: the nb blocks of the chunk.
 */
extern "C" __global__ void co_average_compress_rows(const u8 *__restrict__ rows, i64 row_stride, int world,
                                                    i64 chunk, i64 block, float *__restrict__ error,
                                                    u8 *__restrict__ out_row, i64 m) {
    const int lane = co_lane();
    const i64 nb = (chunk + block - 1) / block;
    const float fworld = (float)world;
    for (i64 b = co_first_warp(); b < nb; b += co_warp_stride()) {
        const i64 lo = b * block;
        const i64 len = chunk - lo < block ? chunk - lo : block;
        const i64 count = co_clamp(m - lo, len);
        const u8 *in_bits = rows + 4 * nb + lo / 8; /* row 0's bits of this block */
        const u8 *in_scale = rows + 4 * b;          /* row 0's scale of this block */
        float *e = error + lo;
        const i64 tiles = (len + CO_TILE - 1) / CO_TILE;
        double acc = 0.0;
        for (i64 t = 0; t < tiles; ++t) {
            float z[CO_STEPS];
            co_load_tile(e, t, count, z);
            if (t * CO_TILE < count) {
                const i64 byte = t * CO_TILE_BYTES + lane; /* the byte of each row this lane loads */
                const bool mine = 8 * byte < count;
                for (int i0 = 0; i0 < world; i0 += 32) {
                    /* lane l holds w of rank i0 + l; the shuffle below hands each rank's to all */
                    const float w_lane = i0 + lane < world
                        ? co_load_scale(in_scale + (i64)(i0 + lane) * row_stride) / fworld : 0.0f;
                    const int ranks = world - i0 < 32 ? world - i0 : 32;
#pragma unroll 4
                    for (int r = 0; r < ranks; ++r) {
                        const float w = __shfl_sync(CO_ALL, w_lane, r);
                        const unsigned packed = mine ? in_bits[(i64)(i0 + r) * row_stride + byte] : 0u;
#pragma unroll
                        for (int j = 0; j < CO_STEPS; ++j) {
                            /* element c = t * CO_TILE + 32 j + lane: bit lane % 8 of tile byte 4 j + lane / 8 */
                            const unsigned bits = __shfl_sync(CO_ALL, packed, 4 * j + (lane >> 3));
                            if (t * CO_TILE + 32 * j + lane < count) z[j] += (bits >> (lane & 7)) & 1u ? w : -w;
                        }
                    }
                }
                co_store_tile(z, t, count, e);
            }
            acc += co_sumsq_tile(z);
            co_pack_tile(z, t, count, len / 8, out_row + 4 * nb + lo / 8);
        }
        co_finish_unit(acc, count, e, out_row + 4 * b);
    }
}

/*
 * Decompress: out[k] = s (2 b_k - 1) for k < n, with row r = k / chunk (row_stride bytes apart),
 * s the scale of block (k % chunk) / block of row r and b_k bit k % chunk of row r's bits.
 * Row r is handled by blocks blockIdx.y = r (mod gridDim.y); nrows covers ceil(n / chunk).
 */
extern "C" __global__ void co_decompress_rows(const u8 *__restrict__ rows, i64 row_stride, i64 nrows,
                                              i64 chunk, i64 block, float *__restrict__ out, i64 n) {
    const int lane = co_lane();
    const i64 nb = (chunk + block - 1) / block;
    for (i64 r = blockIdx.y; r < nrows; r += gridDim.y) {
        const i64 valid = co_clamp(n - r * chunk, chunk);
        const u8 *row = rows + r * row_stride;
        const u8 *bits = row + 4 * nb;
        float *dst = out + r * chunk;
        const i64 tiles = (valid + CO_TILE - 1) / CO_TILE;
        for (i64 t = co_first_warp(); t < tiles; t += co_warp_stride()) {
            const float s = co_load_scale(row + 4 * (t * CO_TILE / block)); /* one block per tile */
            const i64 byte = t * CO_TILE_BYTES + lane;
            const unsigned packed = 8 * byte < valid ? bits[byte] : 0u;
#pragma unroll
            for (int j = 0; j < CO_STEPS; ++j) {
                const unsigned b = __shfl_sync(CO_ALL, packed, 4 * j + (lane >> 3));
                const i64 c = t * CO_TILE + 32 * j + lane;
                if (c < valid) dst[c] = (b >> (lane & 7)) & 1u ? s : -s;
            }
        }
    }
}
