/* simt.h -- the scalar (CUDA-core) family's shapes, shared by its kernels (v0_fwd.cu, v1_fwd.cu) and planner. */
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

#endif
