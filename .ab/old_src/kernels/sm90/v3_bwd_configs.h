/* v3_bwd_configs.h -- the tile configurations of v3's backward (v3_bwd.cu), as data: the kernel file and the planner
 * (v3_bwd_plan.c) expand this one list.  Plain C, no CUDA.
 *
 * A row is X(dp, br, bc, stages, mods): a block owns bc = 128 keys (two consumer warpgroups of 64 keys each) and
 * walks the query blocks of br rows that see them, Q_i / dO_i / LSE_i / D_i in a ring of `stages` slots (mods: below).
 * dQ = dS K is split between the consumers by rows when br = 128 (each takes 64 query rows, all dp columns) and by
 * columns when br = 64 (each takes dp / 2 columns); either way a consumer's dQ tile is 64 x 64 (wgmma_sstt<64>).
 * Registers per consumer thread (240 at most, 2 consumers): dK and dV (dp / 2 floats each), S^T and dP^T (br / 2
 * each) -- 192 at D=64 (br 128) and at D=128 (br 64).
 * V3_BWD_WIDE_CONFIGS: head dim 256 (v3_bwd_wide.cu), whose dK and dV (256 floats a thread for 64 keys) do not fit
 * that split: a block owns bc = 64 keys, the consumers split the head dim (128 columns each: dK, dV and dQ 64 floats
 * each), and dQ is added from registers (no dQ tile in shared memory).
 */
#ifndef FATTN_V3_BWD_CONFIGS_H
#define FATTN_V3_BWD_CONFIGS_H

#include <stddef.h>

typedef struct {
    int dp, br, bc, stages, mods;
} v3_bwd_config;

/* One row per head-dim bucket, in bucket order.  mods: its softcap / ALiBi kernels are compiled (D=64's, at br = 128,
 * spill and serialize their wgmmas in 240 registers: such calls run v2's backward). */
#define V3_BWD_NARROW_CONFIGS(X) \
    X(64, 128, 128, 2, 0)        \
    X(128, 64, 128, 2, 1)
#define V3_BWD_WIDE_CONFIGS(X) X(256, 64, 64, 2, 1)
/* Rows that have only the plain kernels (no softcap / ALiBi or packed batches), for such calls: D=128 at br = 80,
 * FlashAttention-3's tile for non-causal head dim 128, here faster with a causal mask too (v3_bwd_plan.c: where its
 * padding of Sq is small).  br is not a
 * multiple of 64, so dQ is computed transposed, dQ^T = K^T dS^T: each consumer's 64 columns by the step's 80 rows
 * (40 registers a thread), from dS stored K-major (rows: queries) by stmatrix .trans.  Registers: dK, dV 128, S^T and
 * dP^T 80 (LSE and D read from shared memory where used, not preloaded). */
#define V3_BWD_PLAIN_CONFIGS(X) X(128, 80, 128, 2, 0)
#define V3_BWD_CONFIGS(X) V3_BWD_NARROW_CONFIGS(X) V3_BWD_WIDE_CONFIGS(X) V3_BWD_PLAIN_CONFIGS(X)

/* LSE2 and D in the workspace in v3's order (bwd_common.cuh: bwd_v3_row_pos), which the kernels of 64-row steps read
 * a float4 per k-step: D=64 (1.03-1.08x on an H200; with the reads on distinct banks, ae7257e, another 1.02-1.07x on
 * an H100: evidence/backward/h100_v3_bwd_br80_777e632.md, section 7) and D=128 at Br = 64 (in the order that had
 * bank conflicts 0.90-0.97x, h100_v3_bwd_step_order_a65f84f.md, section 7; on distinct banks, 5e7d3b4 against
 * c282b59 at S = 512 on an H100, 1.003-1.016x, deterministic mode 1.016-1.025x:
 * h100_ab_bwd_d128_br64_quads_5e7d3b4_vs_c282b59.json).  Br = 80 steps, which do not start on 64-row blocks, read
 * row order.  The launcher tells bwd_prep, the kernels read. */
#define V3_BWD_LSE_V3_ORDER(dp, br) ((dp) == 64 || ((dp) == 128 && (br) == 64))

/* dQ out: plain calls (both modes, fp16 and bf16) on a config whose steps are whole 64-row tiles (D=64, D=128 at br =
 * 64, D=256: V3_BWD_DQ_OUT) with at most V3_BWD_DQ_OUT_KB_MAX key blocks, whose dQ tiles (64 rows) take on average at
 * most V3_BWD_DQ_OUT_ADDS2 / 2 adds (one per key block that some row of the tile sees; fattn_v3_bwd_dq_out), add each
 * dQ tile, scaled and in the dtype, straight into dQ by a TMA reduction (v3_bwd_kernel.cuh, DQ_OUT; the wide kernel,
 * D=256: by 8-byte reds from registers, v3_bwd_wide.cu): no float32 accumulator to zero, no convert pass.  dQ then
 * carries one rounding per key block adding to it.  On an H100 (fp16, two heads of each fa3 point, against float64):
 * without a mask, up to 8 key blocks, max error 1.0-2.3x and mean 1.2-1.8x the float32 sum's; 16 (S = 2k, D = 64) 4.2x
 * / 2.2x, where the gain was gone (0.997x).  Under a causal mask at S = 2k (16 key blocks, 8.5 adds a tile on average)
 * max error unchanged and equal to torch cudnn's, mean 1.55x (cudnn's: the float32 sum's), 1.055x faster at D = 64 and
 * D = 128 (deterministic 1.04 / 1.08x); at 4k (32 blocks, 16.5 adds) 0.997x, mean 1.9x: hence 16 blocks and a mean of
 * 8.5, which passes causal S = 2k but not 9 key blocks without a mask.  bf16 relative to its own rounding the same (a
 * CPU emulation: 1.0-2.8x / 1.2-1.8x).  D=128 then runs br = 64 (1.036 / 1.130x br = 80 with zero-ahead at S = 1k,
 * non-causal / causal; evidence/backward/h100_v3_bwd_dq_out_*.md).  The planner decides (fattn_v3_bwd_dq_out), the
 * launcher follows. */
#define V3_BWD_DQ_OUT(dp, br) ((br) % 64 == 0)
#define V3_BWD_DQ_OUT_KB_MAX 16
#define V3_BWD_DQ_OUT_ADDS2 17 /* twice the mean adds a dQ tile may take: 8.5 */

#define V3_BWD_COUNT(...) +1
enum { V3_BWD_NCONFIGS = 0 V3_BWD_CONFIGS(V3_BWD_COUNT),
       V3_BWD_FIRST_PLAIN = V3_BWD_NCONFIGS - (0 V3_BWD_PLAIN_CONFIGS(V3_BWD_COUNT)) };

/* The rows of a consumer's dQ tile (floats: 64 columns by these rows) and of a convert block: 64, or br where br is
 * not a multiple of 64 (dQ^T, above). */
#define V3_BWD_DQ_ROWS(br) ((br) % 64 ? (br) : 64)

/* Dynamic shared memory, bytes: K and V (bc x dp), Q and dO (stages x br x dp), dS^T twice (bc x br) -- the wide
 * kernel: P and dS twice each (br x bc) --, all fp16 / bf16; the consumers' dQ tiles (float, 64 x V3_BWD_DQ_ROWS;
 * not in the wide kernel); LSE and D of each stage's rows (float); the mbarriers; 1024 bytes of alignment slack
 * (128-byte swizzled tiles start on 1024-byte boundaries).  At most 227 KB (the wide config: 231464 bytes; br = 80:
 * 231720). */
#define V3_BWD_SMEM(dp, br, bc, stages)                                                                          \
    ((size_t)(2 * (bc) * (dp) + 2 * (stages) * (br) * (dp) + ((dp) == 256 ? 4 : 2) * (bc) * (br)) * 2 +          \
     (size_t)((dp) == 256 ? 0 : 2 * 64 * V3_BWD_DQ_ROWS(br) * 4) + (size_t)2 * (stages) * (br) * 4 +            \
     (size_t)(1 + 2 * (stages)) * 8 + 1024)

/* Whether the call p on `config` takes dQ out (v3_bwd_plan.c). */
struct attn_bwd_params;
#ifdef __cplusplus
extern "C" int fattn_v3_bwd_dq_out(const struct attn_bwd_params *p, int config);
#else
int fattn_v3_bwd_dq_out(const struct attn_bwd_params *p, int config);
#endif

#endif
