/* simt.h -- the scalar (CUDA-core) family's shapes, shared by its kernels (v0_fwd.cu, v1_fwd.cu, v1_bwd.cu) and
 * planner. */
#ifndef FATTN_SIMT_H
#define FATTN_SIMT_H

#define V0_THREADS 128 /* v0: one thread per query row */

#define V1_BR 32                 /* v1: query rows per block */
#define V1_BC 32                 /* keys per tile: one per lane */
#define V1_WARPS 4
#define V1_RW (V1_BR / V1_WARPS) /* rows per warp */
/* Q (Br x DMAX), K (Bc x DMAX + 1, padded), V (Bc x DMAX), P (Br x Bc), float32 */
#define V1_SMEM_BYTES(DMAX) \
    (4 * ((size_t)V1_BR * (DMAX) + (size_t)V1_BC * ((DMAX) + 1) + (size_t)V1_BC * (DMAX) + V1_BR * V1_BC))

/* v1 backward: tiles of V1B_T query rows and V1B_T keys (one per lane), V1B_WARPS warps of V1B_T / V1B_WARPS rows
 * (dQ kernel) or keys (dK dV kernel) each.  Shared memory, float32: two row tiles of DMAX and two of DMAX + 1 (padded
 * for conflict-free reads by lane), and one or two T x T score tiles. */
#define V1B_T 32
#define V1B_WARPS 8
#define V1B_SMEM_BYTES(DMAX) (4 * ((size_t)2 * V1B_T * (DMAX) + (size_t)2 * V1B_T * ((DMAX) + 1) + 2 * V1B_T * V1B_T + \
                                   2 * V1B_T))

#endif
