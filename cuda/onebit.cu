/*
 * CUDA kernels of error-feedback 1-bit compression (docs/design.md 2.1, 2.2).
 *
 * Compiled at first use by compressed_opt.cuda.gpu with CuPy (NVRTC): no host code, no #include.
 * Same contract as onebit_cpu.c and reference.py, on fp32 buffers:
 *   bit k of a packed buffer is bit (k % 8) of byte k / 8 (little bit order);
 *   bit = 1 iff u >= 0 (zero counts as +); bits past the n valid elements are 1;
 *   decompressed value = scale * (2 bit - 1).
 *
 * A compression is two launches on one stream and never waits for the host:
 *   pass 1 (co_compress_pack, co_average_compress_pack) forms u, stores it in error, packs its
 *     signs and reduces scale = sqrt(sum(u^2) / n) on the device: each block stores its partial
 *     sum (fp64), and the last block to finish (a ticket counter that wraps back to 0) adds the
 *     partials in a fixed order and writes the fp32 scale to scale_out;
 *   pass 2 (co_subtract_decompressed) reads scale_out: error <- u - scale * (u >= 0 ? 1 : -1).
 *
 * Work is cut into warp tiles of CO_TILE = 256 elements, i.e. 32 bytes of bits: lane l owns
 * elements 32 j + l (j < 8) of its tile, so every load and store of floats is coalesced; the
 * ballot of step j is the 32 bits of bytes 4 j .. 4 j + 3 of the tile, and lane l writes byte l.
 * Going the other way, lane l loads byte l of the tile and __shfl_sync hands each lane its byte.
 * Tiles are dealt to warps grid-stride, so any grid size is correct; launch with
 * blockDim.x == CO_BLOCK and, for pass 1, gridDim.x <= the length of the partials workspace.
 * Nothing needs aligned pointers: tensors may be views at any offset.
 */

#define CO_BLOCK 256 /* threads per block */
#define CO_WARPS (CO_BLOCK / 32)
#define CO_STEPS 8 /* a warp tile is CO_STEPS * 32 elements */
#define CO_TILE (CO_STEPS * 32)
#define CO_TILE_BYTES (CO_TILE / 8)
#define CO_ALL 0xffffffffu

typedef long long i64;
typedef unsigned char u8;

/* Sum over the warp, complete in lane 0. */
__device__ __forceinline__ double co_warp_sum(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(CO_ALL, v, offset);
    return v;
}

/* Sum over the block, complete in thread 0; called by every thread of the block. */
__device__ double co_block_sum(double v) {
    __shared__ double warp_part[CO_WARPS];
    v = co_warp_sum(v);
    if ((threadIdx.x & 31) == 0) warp_part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < CO_WARPS ? warp_part[threadIdx.x] : 0.0;
    if (threadIdx.x < 32) v = co_warp_sum(v);
    __syncthreads(); /* warp_part may be reused by the next call */
    return v;
}

/*
 * End of pass 1, called by every thread with its share `acc` of sum(u^2): block b stores its
 * partial sum in partials[b]; the last block adds partials[0 .. gridDim.x) and writes
 * scale_out[0] = sqrt(sum / n) (0 when n == 0). The ticket returns to 0 for the next launch.
 */
__device__ void co_finish_scale(double acc, double *partials, unsigned *ticket, i64 n,
                                float *scale_out) {
    __shared__ bool last;
    double block_total = co_block_sum(acc);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = block_total;
        __threadfence();
        last = atomicInc(ticket, gridDim.x - 1) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    double total = 0.0;
    for (unsigned b = threadIdx.x; b < gridDim.x; b += CO_BLOCK) total += __ldcg(partials + b);
    total = co_block_sum(total);
    if (threadIdx.x == 0) scale_out[0] = n > 0 ? (float)sqrt(total / (double)n) : 0.0f;
}

/*
 * Pack the signs of tile t, u[j] = u_k for k = t * CO_TILE + 32 j + lane (bits k >= n are 1):
 * byte t * CO_TILE_BYTES + lane of packed, if below nbytes, is written by this lane.
 */
__device__ __forceinline__ void co_pack_tile(const float *u, i64 t, i64 n, i64 nbytes,
                                             u8 *packed) {
    const int lane = threadIdx.x & 31;
    unsigned mine = 0;
#pragma unroll
    for (int j = 0; j < CO_STEPS; ++j) {
        i64 k = t * CO_TILE + 32 * j + lane;
        unsigned word = __ballot_sync(CO_ALL, k >= n || u[j] >= 0.0f);
        if ((lane >> 2) == j) mine = word;
    }
    i64 b = t * CO_TILE_BYTES + lane;
    if (b < nbytes) packed[b] = (u8)(mine >> (8 * (lane & 3)));
}

/* u[j] = src[k] for k = t * CO_TILE + 32 j + lane < n, else 0 (whole tiles load unguarded). */
__device__ __forceinline__ void co_load_tile(const float *__restrict__ src, i64 t, i64 n, float *u) {
    const i64 k0 = t * CO_TILE + (threadIdx.x & 31);
    if ((t + 1) * CO_TILE <= n) {
#pragma unroll
        for (int j = 0; j < CO_STEPS; ++j) u[j] = src[k0 + 32 * j];
    } else {
#pragma unroll
        for (int j = 0; j < CO_STEPS; ++j) u[j] = k0 + 32 * j < n ? src[k0 + 32 * j] : 0.0f;
    }
}

/* Store u[j] (k < n) into error and return the sum of the squares of the tile's u[j]. */
__device__ __forceinline__ float co_store_tile(const float *u, i64 t, i64 n, float *error) {
    const i64 k0 = t * CO_TILE + (threadIdx.x & 31);
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < CO_STEPS; ++j) {
        if (k0 + 32 * j < n) error[k0 + 32 * j] = u[j];
        sq += u[j] * u[j]; /* u[j] == 0 past n */
    }
    return sq;
}

/* Tiles are walked grid-stride, one warp per tile: the first tile of this warp, and the step. */
__device__ __forceinline__ i64 co_first_tile() { return (i64)blockIdx.x * CO_WARPS + (threadIdx.x >> 5); }
__device__ __forceinline__ i64 co_tile_stride() { return (i64)gridDim.x * CO_WARPS; }

/*
 * Worker pass 1: u = x + error (x == NULL: u = error), error <- u, packed <- [u >= 0]
 * (nbytes >= ceil(n / 8) bytes, bits past n set to 1), scale_out <- sqrt(sum(u^2) / n).
 */
extern "C" __global__ void co_compress_pack(const float *__restrict__ x, float *__restrict__ error,
                                            u8 *__restrict__ packed, i64 n, i64 nbytes,
                                            float *scale_out, double *partials, unsigned *ticket) {
    const i64 tiles = (nbytes + CO_TILE_BYTES - 1) / CO_TILE_BYTES;
    double acc = 0.0;
    for (i64 t = co_first_tile(); t < tiles; t += co_tile_stride()) {
        float u[CO_STEPS];
        co_load_tile(error, t, n, u);
        if (x != 0) {
            float v[CO_STEPS];
            co_load_tile(x, t, n, v);
#pragma unroll
            for (int j = 0; j < CO_STEPS; ++j) u[j] = v[j] + u[j];
            acc += co_store_tile(u, t, n, error);
        } else {
            float sq = 0.0f; /* error already holds u */
#pragma unroll
            for (int j = 0; j < CO_STEPS; ++j) sq += u[j] * u[j];
            acc += sq;
        }
        co_pack_tile(u, t, n, nbytes, packed);
    }
    co_finish_scale(acc, partials, ticket, n, scale_out);
}

/*
 * Server pass 1: z = error + sum_i w_i (2 b_i - 1) with w_i = scales[i] / world (fp32), added
 * in the order i = 0, 1, ... like onebit_cpu.c; b_i is row i of chunks (world rows of row_bytes
 * bytes, contiguous). Then error <- z, packed (row_bytes bytes) <- [z >= 0], scale_out as above.
 * n <= 8 * row_bytes valid elements; world <= 1024.
 */
extern "C" __global__ void co_average_compress_pack(const u8 *__restrict__ chunks,
                                                    const float *__restrict__ scales, int world,
                                                    i64 row_bytes, float *__restrict__ error,
                                                    u8 *__restrict__ packed, i64 n,
                                                    float *scale_out, double *partials,
                                                    unsigned *ticket) {
    __shared__ float weight[1024];
    for (int i = threadIdx.x; i < world; i += CO_BLOCK) weight[i] = scales[i] / (float)world;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const i64 tiles = (row_bytes + CO_TILE_BYTES - 1) / CO_TILE_BYTES;
    double acc = 0.0;
    for (i64 t = co_first_tile(); t < tiles; t += co_tile_stride()) {
        float z[CO_STEPS];
        co_load_tile(error, t, n, z);
        const i64 b = t * CO_TILE_BYTES + lane; /* the byte of each row this lane loads */
        const bool in_row = 8 * b < n;
#pragma unroll 4
        for (int i = 0; i < world; ++i) {
            const unsigned byte = in_row ? chunks[i * row_bytes + b] : 0u;
            const float w = weight[i];
#pragma unroll
            for (int j = 0; j < CO_STEPS; ++j) {
                /* element k = t * CO_TILE + 32 j + lane is bit lane % 8 of tile byte 4 j + lane / 8 */
                unsigned bits = __shfl_sync(CO_ALL, byte, 4 * j + (lane >> 3));
                if (t * CO_TILE + 32 * j + lane < n) z[j] += (bits >> (lane & 7)) & 1u ? w : -w;
            }
        }
        acc += co_store_tile(z, t, n, error);
        co_pack_tile(z, t, n, row_bytes, packed);
    }
    co_finish_scale(acc, partials, ticket, n, scale_out);
}

/* Pass 2: error holds u; error <- u - s (u >= 0 ? 1 : -1) with s = scale[0], the fp32 scale. */
extern "C" __global__ void co_subtract_decompressed(float *__restrict__ error,
                                                    const float *__restrict__ scale, i64 n) {
    const float s = scale[0];
    for (i64 k0 = (i64)blockIdx.x * 4 * CO_BLOCK + threadIdx.x; k0 < n;
         k0 += (i64)gridDim.x * 4 * CO_BLOCK) {
        float u[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = k0 + j * CO_BLOCK < n ? error[k0 + j * CO_BLOCK] : 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (k0 + j * CO_BLOCK < n) error[k0 + j * CO_BLOCK] = u[j] - (u[j] >= 0.0f ? s : -s);
    }
}

/*
 * Decompress: out[k] = scales[r] (2 b_k - 1) for k < n, with chunk c = 8 * row_bytes elements
 * per row, r = k / c, and b_k bit k % c of row r, which starts at packed + r * row_stride.
 * Row r is handled by blocks blockIdx.y = r (mod gridDim.y); rows covers ceil(n / c).
 */
extern "C" __global__ void co_decompress(const u8 *__restrict__ packed,
                                         const float *__restrict__ scales, i64 rows, i64 row_bytes,
                                         i64 row_stride, float *__restrict__ out, i64 n) {
    const int lane = threadIdx.x & 31;
    const i64 chunk = 8 * row_bytes;
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const i64 valid = n - r * chunk < chunk ? n - r * chunk : chunk;
        const u8 *row = packed + r * row_stride;
        float *dst = out + r * chunk;
        const float s = scales[r];
        const i64 tiles = (valid + CO_TILE - 1) / CO_TILE;
        for (i64 t = co_first_tile(); t < tiles; t += co_tile_stride()) {
            const i64 b = t * CO_TILE_BYTES + lane;
            const unsigned byte = 8 * b < valid ? row[b] : 0u;
#pragma unroll
            for (int j = 0; j < CO_STEPS; ++j) {
                unsigned bits = __shfl_sync(CO_ALL, byte, 4 * j + (lane >> 3));
                i64 c = t * CO_TILE + 32 * j + lane;
                if (c < valid) dst[c] = (bits >> (lane & 7)) & 1u ? s : -s;
            }
        }
    }
}
