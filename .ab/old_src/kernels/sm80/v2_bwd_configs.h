/* v2_bwd_configs.h -- the tile configurations of v2's backward (v2_bwd.cu), as data: the kernel file and the planner
 * (v2_bwd_plan.c) expand this one list.  Plain C, no CUDA.
 *
 * A row is X(dp, br, bc, warps, wm_s, wm_kv, wm_q, stages, dq_first, dq_bc):
 *   dp            head-dim bucket (64 / 128 / 256) the kernels are compiled for
 *   br, bc        query rows per query block (Br) and keys per key block (Bc) of the dK/dV kernel, whose block owns
 *                 one key block and walks the query blocks that see it
 *   warps         warps of the dK/dV kernel's block
 *   wm_s          warps stacked along the query rows for S = Q K^T and dP = dO V^T (the rest split the keys)
 *   wm_kv         warps stacked along the keys for dV = P^T dO and dK = dS^T Q (the rest split the head dim)
 *   wm_q          warps stacked along the query rows for dQ = dS K (the rest split the head dim)
 *   stages        1: Q_i and dO_i single-buffered, 2: double-buffered (the next pair lands during a whole step)
 *   dq_first      double-buffered, one dQ pass: 1 runs dQ = dS K before dV and dK and spreads its atomics over both
 *                 (holding dQ's registers through dV), 0 runs it between them and spreads them over dK.  Measured on
 *                 the H100 (fa3 grid, fp16): D=128 0.98 -> 1.00-1.04x FlashAttention-2 with 1, D=64 0.94-1.01 with 0
 *                 (0.91-1.00 with 1).  Ignored single-buffered and at D=256 (two dQ passes, each one's atomics spread
 *                 over the product after it).
 *   dq_bc         keys per block of the deterministic mode's dQ kernel (4 warps, 64 query rows, K/V double-buffered)
 * Each warp's tile is (rows / wm) x (cols / (warps / wm)): m16 row tiles by n8 column tiles, the n8 count even (one
 * ldmatrix.x4 feeds two).  Bigger warp tiles read fewer shared-memory bytes per MMA (per k-step an a x b tile of
 * m16 x n8 MMAs costs a + b / 2 ldmatrix.x4 for a * b MMAs), which is what bounds this kernel on the H100; the dK
 * and dV accumulators (bc x dp x 2 floats over the block) bound the tiles from the other side.
 */
#ifndef FATTN_V2_BWD_CONFIGS_H
#define FATTN_V2_BWD_CONFIGS_H

#include <stddef.h>

typedef struct {
    int dp, br, bc, warps, wm_s, wm_kv, wm_q, stages, dq_first, dq_bc;
} v2_bwd_config;

/* In preference order: the planner runs the first row of the call's bucket whose shared memory fits the device.
 * The first three are FlashAttention-2's sm80 tilings (Br x Bc, 8 warps) for 162 KiB / 161 KiB / 209 KiB (H100);
 * then the A100's D=256 (Q and dO single-buffered, 144.5 KiB), then the 99 KiB parts' (sm_86 / sm_89 / sm_120). */
#define V2_BWD_CONFIGS(X)                    \
    X(64, 128, 128, 8, 4, 4, 4, 2, 0, 128)   \
    X(128, 64, 128, 8, 2, 4, 2, 2, 1, 64)    \
    X(256, 64, 64, 8, 4, 2, 2, 2, 1, 32)     \
    X(256, 64, 64, 8, 4, 2, 2, 1, 1, 32)     \
    X(64, 64, 128, 8, 2, 4, 2, 1, 0, 64)     \
    X(128, 64, 64, 8, 4, 2, 2, 1, 0, 64)

#define V2_BWD_COUNT(...) +1
enum { V2_BWD_NCONFIGS = 0 V2_BWD_CONFIGS(V2_BWD_COUNT) };

/* The deterministic dQ kernel's block: 4 warps of 16 query rows. */
#define V2_BWD_DQ_WARPS 4
#define V2_BWD_DQ_BR (16 * V2_BWD_DQ_WARPS)

/* Dynamic shared memory, bytes.  dK/dV kernel: Q_i and dO_i (stages each), K_j and V_j, P and dS (fp16 / bf16),
 * then the rows' LSE and D (float, stages each).  dQ kernel: Q_i and dO_i, K_j and V_j double-buffered. */
#define V2_BWD_SMEM(dp, br, bc, stages) \
    ((size_t)(2 * (stages) * (br) * (dp) + 2 * (bc) * (dp) + 2 * (br) * (bc)) * 2 + (size_t)2 * (stages) * (br) * 4)
#define V2_BWD_DQ_SMEM(dp, dq_bc) ((size_t)(2 * V2_BWD_DQ_BR * (dp) + 4 * (dq_bc) * (dp)) * 2)

#endif
