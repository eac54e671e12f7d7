/* v2_configs.h -- v2's tile configurations as data, and the rules every user of them shares (the kernel's
 * compile-time layout, the planner, the tuner's keep()).
 *
 * X(DP, WARPS, MT, BC, STAGES): head-dim bucket, warps per block, 16-row tiles per warp (Br = 16 * MT * WARPS),
 * keys per block, K/V pipeline stages (1: interleaved single buffers, 2: double-buffered).
 * V2_DEFAULT_CONFIGS lists one default per head-dim bucket, in bucket order (64, 128, 256), for fp16 and bf16:
 * the winners of an interleaved A/B on the H100 beside torch's FlashAttention-2 (evidence/bench/h100_v2_ab_*.json).
 * V2_RULES: where calls of one kind run better on another config than their bucket's default, X(DP, WARPS, MT, BC,
 * STAGES, CAUSAL, SK_MIN, SK_MAX) for calls in bucket DP, causal or not (1 / 0), with SK_MIN <= Sk <= SK_MAX; the
 * first match wins; compiled for fp16 and bf16.  V2_SWEEP_CONFIGS are fp16 candidates the sweeps time against the
 * defaults, each gated for correctness first.
 */
#ifndef FATTN_V2_CONFIGS_H
#define FATTN_V2_CONFIGS_H

#include "../../csrc/fattn.h"

typedef struct {
    int dp, warps, mt, bc, stages;
} v2_config;

#define V2_DEFAULT_CONFIGS(X) \
    X(64, 4, 2, 128, 2)       \
    X(128, 4, 2, 64, 1)       \
    X(256, 4, 1, 64, 1)

/* Used instead of the default when the default's grid would leave multiprocessors idle, or when Sq <= 64 (decode:
 * the default's taller tiles would compute rows that do not exist).  Same bucket order, fp16 and bf16.  D=128:
 * Bc = 32 double-buffered keeps the most K/V bytes in flight per multiprocessor (decode, B=8 H=32: 0.99-1.01x
 * cudnn; B=1 with 8 kv heads 0.91-0.97x, where cudnn's kernel takes the same time and the rest is the split-KV
 * combine; evidence/serving/README.md). */
#define V2_SMALL_GRID_CONFIGS(X) \
    X(64, 4, 1, 64, 1)           \
    X(128, 4, 1, 32, 2)          \
    X(256, 4, 1, 64, 1)

/* None at present: with the head-by-head order for short causal calls, D=64's Bc = 128 default beats the Bc = 64
 * that won before at S <= 1k (1.14x flash vs 1.05x at S=512, h100_v2_ab_orders_1abef9c.json). */
#define V2_RULES(X)

#define V2_SWEEP_CONFIGS(X) \
    X(64, 4, 2, 64, 1)      \
    X(64, 4, 2, 64, 2)      \
    X(64, 8, 2, 64, 2)      \
    X(64, 8, 1, 64, 2)      \
    X(128, 4, 2, 48, 1)     \
    X(128, 4, 2, 32, 1)     \
    X(128, 8, 2, 48, 1)     \
    X(128, 8, 1, 64, 2)     \
    X(128, 4, 1, 64, 1)     \
    X(256, 8, 1, 64, 1)     \
    X(256, 4, 1, 48, 1)     \
    X(256, 8, 1, 64, 2)     \
    X(256, 4, 1, 64, 2)

/* The blocks per multiprocessor the small-grid kernels (without softcap / ALiBi) are built for (__launch_bounds__):
 * four at D <= 128 -- 128 registers a thread, Q's fragments read from shared memory each k-step -- so that a decode
 * batch of 512 blocks (B=64, 8 kv heads) runs in one wave; one at D=256 (two fit by shared memory).  From sm_90 on
 * only (V2_ARCH_MIN_BLOCKS), where it was measured (evidence/serving/h100_ab_small_grid_four_blocks_*): sm_80's
 * 164 KB of shared memory holds three of D=128's 48 KB blocks, so there the 128-register cap would buy nothing. */
#define V2_SMALL_GRID_MIN_BLOCKS(DP) ((DP) <= 128 ? 4 : 1)
/* Split-KV calls of at most V2_MERGE_SPLITS splits whose query blocks hold at most V2_MERGE_ROWS rows (decode: Sq =
 * 1, or a GQA group's query heads packed as rows) merge the splits in the kernel where it can (V2_KERNEL_MERGES): the
 * last split of a query block to finish merges them, a warp per row (v2_merge_rows: all V2_MERGE_SPLITS in one round
 * trip to L2), counted on the stream's counters (v2_plan.c asks for them).  Others, and calls that cannot have the
 * counters, launch the merge kernel (v2_combine.cuh).  On an H100 against the merge kernel (H=32, D=128;
 * evidence/serving/README.md): GQA decode (H_kv = 8) B=8 1.006-1.040x, B=1 at Sk = 2k (16 splits) 1.022x, MHA B=1
 * (8 splits) 1.018x; with 32 splits (B=1 at 8k / 32k, two round trips in the kernel's tail) 0.95-0.99x, hence the
 * bound. */
#define V2_MERGE_ROWS 4
#define V2_MERGE_SPLITS 16
/* Whether a kernel built for MINB blocks per multiprocessor merges its splits itself: the small-grid kernels at
 * D <= 128, the decode kernels.  The others launch the merge kernel (the merge's code in them made ptxas spill
 * more). */
#define V2_KERNEL_MERGES(MINB) ((MINB) > 1)
/* Whether such a kernel joins attention sinks itself in an unsplit call, as the key that starts each row's softmax
 * (v2_body): the decode kernels again.  In the others that code made ptxas spill (the defaults at D=64 / 128: 0 -> 120
 * and 8 -> 76 bytes in the sm_90 build), so the sinks pass runs after them. */
#define V2_SINKS_AT_START(MINB) ((MINB) > 1)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define V2_ARCH_MIN_BLOCKS(MINB) 1
#else
#define V2_ARCH_MIN_BLOCKS(MINB) (MINB)
#endif

/* The table compiled ahead of time, in index order: defaults (index = bucket), small-grid configs (3 + bucket), the
 * rules' configs, the sweep candidates.  BOTH(...) rows are built for fp16 and bf16, SMALL(...) the small-grid rows
 * (fp16 and bf16), F16(...) rows for fp16 only, RULE(...) rows take a rule's arguments.  The kernel file and the
 * planner expand this one list. */
#define V2_TABLE(BOTH, SMALL, F16, RULE) \
    V2_DEFAULT_CONFIGS(BOTH) V2_SMALL_GRID_CONFIGS(SMALL) V2_RULES(RULE) V2_SWEEP_CONFIGS(F16)
#define V2_COUNT(...) +1
enum {
    V2_FIRST_SMALL_GRID = 0 V2_DEFAULT_CONFIGS(V2_COUNT),
    V2_FIRST_RULE = V2_FIRST_SMALL_GRID V2_SMALL_GRID_CONFIGS(V2_COUNT),
    V2_NRULES = 0 V2_RULES(V2_COUNT),
    V2_NAOT = V2_FIRST_RULE + V2_NRULES V2_SWEEP_CONFIGS(V2_COUNT) /* table indices >= V2_NAOT: run-time compiled */
};

/* Q's fragments stay in registers when they and the S and O accumulators fit and the kernel is built for one block
 * per multiprocessor (MINB > 1 caps the registers: ldmatrix per k-step instead). */
#define V2_Q_IN_REGS(DP, MT, BC, MINB) \
    ((MINB) == 1 && (MT) * (DP) <= 128 && (MT) * ((DP) / 8 + (BC) / 8 + (DP) / 16) * 4 <= 200)
/* Accumulator registers per thread: S (MT x BC/8 n8 tiles) and O (MT x DP/8), plus Q's fragments when kept. */
#define V2_ACC_REGS(DP, MT, BC, MINB) \
    ((MT) * ((DP) / 8 * 4 + (BC) / 8 * 4) + (V2_Q_IN_REGS(DP, MT, BC, MINB) ? (MT) * (DP) / 16 * 4 : 0))
/* Above this ptxas spills in the main loop (-Xptxas -v on sm_90: 192 keeps at most 16 bytes of stack). */
#define V2_ACC_LIMIT 192
#define V2_SMEM_BYTES(DP, WARPS, MT, BC, STAGES) ((size_t)(16 * (MT) * (WARPS) + 2 * (STAGES) * (BC)) * (DP) * 2)

#endif
