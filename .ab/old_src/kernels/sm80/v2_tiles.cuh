/* v2_tiles.cuh -- v2's shared-memory tiles: the XOR swizzle, ldmatrix addressing without per-load arithmetic, and the
 * cp.async copies of a tile from global memory (contiguous or through a paged cache's block table).  Used by
 * v2_fwd.cu (ahead of time and under NVRTC). */
#ifndef FATTN_V2_TILES_CUH
#define FATTN_V2_TILES_CUH

#include "../mma.cuh"

/* Element offset of 16-byte chunk c of row r in a [rows][DP] tile, XOR-swizzled by the row's low 3 bits. */
template <int DP> DEV int swz(int r, int c) { return r * DP + ((c ^ (r & 7)) << 3); }

/* ldmatrix addressing without per-load arithmetic.  A lane reads 16-byte chunk 2 * step + half of row `row` of a
 * swizzled [rows][DP] tile (tile 128-byte aligned).  Since 2 * step + half = 8 * (step / 4) + (2 * (step % 4) | half),
 * its swizzled chunk is 8 * (step / 4) + ((2 * (step % 4)) ^ (half ^ (row & 7))): from the address a of step 0
 * (swz_addr), step is an XOR of address bits 5-6 by step % 4 and a compile-time 128 bytes per 4 steps (swz_step).
 * Row tiles, key tiles and stages are multiples of 128 bytes, added as immediates or once per key block. */
template <int DP> DEV unsigned swz_addr(unsigned tile, int row, int half) {
    return tile + row * DP * 2 + ((half ^ (row & 7)) << 4);
}
DEV unsigned swz_step(unsigned a, int step) { return (a ^ ((step & 3) << 5)) + (step >> 2) * 128; }

/* Rows [0, ROWS) of a ROWS x DP tile from global memory into swizzled shared memory; rows >= valid and columns >= d
 * are zero-filled without reading.  Thread tid always copies chunk c = tid % CHUNKS of rows r0 + RSTEP * it
 * (r0 = tid / CHUNKS); `src` is that thread's first element, tile + r0 * stride + 8 * c (load_origin), so the copy
 * loop needs no per-tile setup.  Row r0 + RSTEP * it has the swizzle of row r0 + RSTEP * (it % P) (P * RSTEP is a
 * multiple of 8): P offsets per thread and compile-time row steps address every copy.  A tile wholly inside the
 * sequence (every tile but the last) copies with no bounds test: one 64-bit pointer add and one cp.async per copy. */
template <int DP> DEV int64_t load_origin(int64_t stride, int tid) {
    return (int64_t)(tid / (DP / 8)) * stride + tid % (DP / 8) * 8;
}
template <typename T, int DP, int ROWS, int THREADS>
DEV void load_tile(T *smem, const T *src, int64_t stride, int64_t valid, int d, int tid) {
    constexpr int CHUNKS = DP / 8, RSTEP = THREADS / CHUNKS, ITERS = ROWS * CHUNKS / THREADS;
    constexpr int P = RSTEP % 8 == 0 ? 1 : 8 / RSTEP;
    static_assert(THREADS % CHUNKS == 0 && (ROWS * CHUNKS) % THREADS == 0, "tile must split evenly over threads");
    static_assert(8 % RSTEP == 0 || RSTEP % 8 == 0, "row step must divide or be a multiple of the swizzle period");
    const int c = tid % CHUNKS, r0 = tid / CHUNKS;
    int soff[P];
#pragma unroll
    for (int k = 0; k < P; k++) soff[k] = swz<DP>(r0 + k * RSTEP, c);
    auto dst = [&](int it) { return smem + soff[it % P] + (it / P) * P * RSTEP * DP; };
    const bool col_in = c * 8 < d;
    if (valid >= ROWS && col_in) {
#pragma unroll
        for (int it = 0; it < ITERS; it++, src += RSTEP * stride) cp_async_16(dst(it), src, 16);
    } else {
        const T *first = src;
        const int rows = valid <= 0 ? 0 : (int)valid; /* < ROWS here unless col_in is false */
#pragma unroll
        for (int it = 0; it < ITERS; it++, src += RSTEP * stride) {
            const bool in = col_in && r0 + it * RSTEP < rows;
            cp_async_16(dst(it), in ? src : first, in ? 16 : 0);
        }
    }
}

/* The same tile of a paged cache: key row j0 + r is row (j0 + r) % ps of page table[(j0 + r) / ps], each row its own
 * address; rows >= valid and columns >= d zero-filled.  `head` is the pool plus the kv head's offset.  Kept out of
 * line with 32-bit row arithmetic: inlined, the per-row addressing spilled up to 250 bytes in the paged kernels. */
template <typename T, int DP, int ROWS, int THREADS>
__device__ __noinline__ void load_tile_paged(T *smem, const T *head, const int32_t *table, int ps, int64_t stride_b,
                                             int64_t stride_s, int j0, int valid, int d, int tid) {
    constexpr int CHUNKS = DP / 8, RSTEP = THREADS / CHUNKS, ITERS = ROWS * CHUNKS / THREADS;
    const int c = tid % CHUNKS, r0 = tid / CHUNKS;
    const bool col_in = c * 8 < d;
    head += c * 8;
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int r = r0 + it * RSTEP, j = j0 + r;
        const bool in = col_in && r < valid;
        const int page = in ? __ldg(table + j / ps) : 0;
        const T *src = head + (int64_t)page * stride_b + (int64_t)(j % ps) * stride_s;
        cp_async_16(smem + swz<DP>(r, c), in ? src : head, in ? 16 : 0);
    }
}

/* The same tile of a paged cache whose pages are a whole fraction of a tile (ROWS a multiple of the page size
 * 1 << shift, so the tile starts a page): row r is row r & (ps - 1) of page table[j0 / ps + r / ps] -- shifts and
 * masks where load_tile_paged divides.  Rows >= valid and columns >= d zero-filled (and no table read past them).
 * smem2 != NULL: the same rows of a second tensor (head2, its strides) into smem2 as well -- K's and V's tiles of
 * one key block from one table read and one row address a copy (load_kv in v2_fwd.cu; at B=32, Sk=8k, pages of 16,
 * the two calls' instructions kept the issue slots 31% busy against 13% on a contiguous cache).  Out of line as
 * load_tile_paged: inlined, it spilled up to 272 bytes in the paged kernels of Bc >= 64. */
template <typename T, int DP, int ROWS, int THREADS>
__device__ __noinline__ void load_tile_pages(T *smem, const T *head, int64_t stride_b, int64_t stride_s, T *smem2,
                                             const T *head2, int64_t stride_b2, int64_t stride_s2,
                                             const int32_t *table, int shift, int j0, int valid, int d, int tid) {
    constexpr int CHUNKS = DP / 8, RSTEP = THREADS / CHUNKS, ITERS = ROWS * CHUNKS / THREADS;
    const int c = tid % CHUNKS, r0 = tid / CHUNKS, in_page = (1 << shift) - 1;
    const bool col_in = c * 8 < d;
    const int32_t *tab = table + (j0 >> shift);
    head += c * 8;
    head2 += c * 8;
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        const int r = r0 + it * RSTEP;
        const bool in = col_in && r < valid;
        const int64_t page = in ? __ldg(tab + (r >> shift)) : 0, row = r & in_page;
        const T *src = head + page * stride_b + row * stride_s;
        cp_async_16(smem + swz<DP>(r, c), in ? src : head, in ? 16 : 0);
        if (smem2) {
            const T *src2 = head2 + page * stride_b2 + row * stride_s2;
            cp_async_16(smem2 + swz<DP>(r, c), in ? src2 : head2, in ? 16 : 0);
        }
    }
}

/* Flips the sign bit of every fp16/bf16 element of a ROWS x DP tile in shared memory (16 bytes per thread-step). */
template <int DP, int ROWS, int THREADS> DEV void flip_sign_bits(void *smem, int tid) {
    uint4 *t = (uint4 *)smem;
    for (int i = tid; i < ROWS * DP / 8; i += THREADS) {
        uint4 x = t[i];
        x.x ^= 0x80008000u, x.y ^= 0x80008000u, x.z ^= 0x80008000u, x.w ^= 0x80008000u;
        t[i] = x;
    }
}

#endif
