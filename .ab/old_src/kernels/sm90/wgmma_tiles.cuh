/* wgmma_tiles.cuh -- whole-tile products over the wgmma wrappers (wgmma_ops.cuh), in the shared-memory layout of
 * hopper.cuh: tiles of 64-column panels, 128-byte swizzled. */
#ifndef FATTN_WGMMA_TILES_CUH
#define FATTN_WGMMA_TILES_CUH

#include "wgmma_ops.cuh"

/* d (+)= A B^T over a reduction of DP columns, A (64 rows) and B (N rows) K-major tiles whose 64-column panels hold
 * ROWS_A and ROWS_B rows: DP / 16 k-steps, four per panel, 32 bytes apart inside it.  a_lo, b_lo: the descriptors'
 * low words at the tiles' first rows (hopper.cuh: desc_lo).  The first k-step overwrites d.  Callers fence and
 * commit. */
template <int N, typename T, int DP, int ROWS_A, int ROWS_B>
DEV void wgmma_kmajor_tiles(float (&d)[N / 2], unsigned a_lo, unsigned b_lo) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++)
        wgmma_ss<N, T>(d, a_lo + (((kk / 4) * ROWS_A * 128 + (kk % 4) * 32) >> 4),
                       b_lo + (((kk / 4) * ROWS_B * 128 + (kk % 4) * 32) >> 4), kk > 0);
}

#endif
