/* v3_configs.h -- the configurations of v3 compiled ahead of time, as data.
 *
 * X(DP, BC, STAGES, CONSUMERS, PINGPONG): head-dim bucket, keys per block, K/V ring slots, consumer warpgroups
 * (Br = 64 * CONSUMERS query rows per block), and whether the consumers take turns issuing their GEMMs.  One
 * consumer (no ping-pong) runs two or three blocks per SM (V3_BLOCKS_PER_SM): independent tiles, each one's pipeline
 * fill and epilogue hidden behind the others' GEMMs, for short rows where a tile has few key blocks.
 * V3_DEFAULT_CONFIGS: one per head-dim bucket, in bucket order (64, 128, 256); V3_SWEEP_CONFIGS: candidates that
 * bench/ab.py times against them (fattn._C._dev.configs('v3') lists all; an explicit config index runs one).
 * The defaults are the winners of bench/ab.py on the H200 and the H100 (evidence/bench/h100_v3_sweep_f31bbc2.json, h200_v3_sweep_46c3fdc.json).
 * V3_RULES: where calls of one kind run better on another config than their bucket's default (the config must also
 * be in the sweep list).  X(DP, BC, STAGES, CONSUMERS, PINGPONG, CAUSAL, SK_MIN, SK_MAX, WAVES_MIN, WAVES_MAX): calls
 * in bucket DP, causal or not (CAUSAL 1 / 0), with SK_MIN <= Sk <= SK_MAX and the bucket default's tiles at least
 * WAVES_MIN (> 0) and at most WAVES_MAX (> 0) per SM.  Measured on the H100 (evidence/bench/h100_v3_*.json):
 *   D=64 causal, Sk <= 1k, at least one default tile per SM: one consumer at Bc = 64, three blocks per SM (the
 *   sweep at 2c94c1b, head by head: fa3 causal 512 / 1k 230 / 302 TFLOP/s against 199 / 286 on the rules' configs
 *   before it, 2k and 4k no better; the A/B of da6cba5 against 75d5a49: fa3 1.154 / 1.053x, seeds B=4 H=16 and B=8
 *   H=16 (1.5 and 2.9 tiles per SM) 1.032x, but B=1 H=8 and B=4 H=8 (0.2 and 0.7) 0.959 / 0.990x, so those keep
 *   the next rule; evidence/bench/h100_v3_three_blocks_2c94c1b.md); D=64, Sk <= 512, causal, or non-causal with at
 *   most 2 default tiles per SM: one consumer, two blocks per SM (bench/ab.py, 96c58d0: causal 1.05-1.25x,
 *   non-causal 1.04-1.32x on the seeds' grids, 0.93x on the fa3 grid's; at 11c1184 the default ran B=8 H=16, 2.9
 *   tiles per SM, 1.07x faster than one consumer, so 3 -> 2 tiles);
 *   D=64 causal, Sk <= 1k: Br = 128 without ping-pong, 0.58-0.78x -> 0.75-0.82x cudnn (less of each tile masked);
 *   up to 2k until the default's consumers skipped the key blocks past their own rows (f464541): then at causal 2k
 *   the default ran 1.084x faster than this config, 0.880 -> 0.954x cudnn (fa3's B=8 H=32;
 *   evidence/bench/h100_ab_fwd_d64_causal_configs_736d840.json; at 512 / 1k the rules above still win by 1.14x);
 *   D=128 non-causal, Sk >= 8k: Bc = 176 (bench/ab.py, interleaved medians: 16k 0.93 -> 0.97x, 8k 0.94 -> 0.97x;
 *   with the lazy row max, 4891d41, the three D=128 configs read within 1.5% of each other there); D=256, Sk >= 1k
 *   non-causal and >= 2k causal: Bc = 80 (the sweep at f97efb6, evidence/bench/h100_v3_sweep_d128_256_f97efb6.json:
 *   +1.5-3.5% at each of those points, -1.5% at S=512, even at causal 1k; the A/B of 825c551 against f97efb6:
 *   1.012-1.035x in fp16 and bf16 at the points whose config changed, but fp16 non-causal 2k, 1.002).  D=128 causal
 *   at 16k read 1.130 -> 1.192x cudnn on Bc = 176 in the sweep, but 0.979 / 0.959x (fp16 / bf16) in that A/B: no
 *   rule.  The first matching rule wins.
 */
#ifndef FATTN_V3_CONFIGS_H
#define FATTN_V3_CONFIGS_H

#include "../../csrc/fattn.h"

typedef struct {
    int dp, bc, stages, consumers, pingpong;
} v3_config;

#define V3_DEFAULT_CONFIGS(X) \
    X(64, 128, 4, 3, 1)       \
    X(128, 128, 2, 2, 1)      \
    X(256, 64, 2, 2, 1)

#define V3_RULES(X)                                   \
    X(64, 64, 3, 1, 0, 1, 0, 1024, 1, 0)              \
    X(64, 128, 2, 1, 0, 1, 0, 512, 0, 0)              \
    X(64, 128, 2, 1, 0, 0, 0, 512, 0, 2)              \
    X(64, 128, 2, 2, 0, 1, 0, 1024, 0, 0)             \
    X(128, 176, 2, 2, 1, 0, 8192, INT64_MAX, 0, 0)    \
    X(256, 80, 2, 2, 1, 0, 1024, INT64_MAX, 0, 0)     \
    X(256, 80, 2, 2, 1, 1, 2048, INT64_MAX, 0, 0)

#define V3_SWEEP_CONFIGS(X) \
    X(64, 64, 4, 3, 1)      \
    X(64, 128, 2, 2, 1)     \
    X(64, 128, 2, 2, 0)     \
    X(64, 192, 2, 2, 1)     \
    X(128, 128, 2, 2, 0)    \
    X(128, 176, 2, 2, 1)    \
    X(128, 128, 3, 2, 1)    \
    X(256, 64, 2, 2, 0)     \
    X(256, 80, 2, 2, 1)     \
    X(64, 128, 2, 1, 0)     \
    X(64, 64, 4, 1, 0)      \
    X(64, 64, 2, 1, 0)      \
    X(64, 64, 3, 1, 0)      \
    X(128, 64, 2, 1, 0)     \
    X(128, 80, 2, 1, 0)

/* The configs whose per-sequence kernels (SEQ: packed variable-length batches, seqused_k) are compiled, one per
 * bucket in bucket order, each also in V3_TABLE.  D=64 takes two consumers: the default's three, at 160 registers
 * each, spill 128-168 bytes with SEQ's lengths and offsets. */
#define V3_SEQ_CONFIGS(X) \
    X(64, 128, 2, 2, 1)   \
    X(128, 128, 2, 2, 1)  \
    X(256, 64, 2, 2, 1)

/* The table compiled ahead of time, in index order: the defaults (index = bucket), then the sweep candidates; a
 * rule names one of these configs by value.  The kernel file and the planner expand this one list. */
#define V3_TABLE(X) V3_DEFAULT_CONFIGS(X) V3_SWEEP_CONFIGS(X)
#define V3_COUNT(...) +1
enum { V3_NCONFIGS = 0 V3_TABLE(V3_COUNT), V3_NRULES = 0 V3_RULES(V3_COUNT),
       V3_NDEFAULTS = 0 V3_DEFAULT_CONFIGS(V3_COUNT) /* = the buckets; V3_SEQ_CONFIGS has as many rows */ };

/* The bucket (0, 1, 2) of a head-dim bucket's width (64, 128, 256): the default's table index, and the row of
 * V3_SEQ_CONFIGS. */
static inline int v3_bucket(int dp) { return dp == 64 ? 0 : dp == 128 ? 1 : 2; }

/* The table index of a bucket's V3_SEQ_CONFIGS row (v3_plan.c): the planner chooses it, the launcher checks it. */
#ifdef __cplusplus
extern "C" int fattn_v3_seq_config(int dp);
#else
int fattn_v3_seq_config(int dp);
#endif

/* Shared memory of one block: QB slots of Q (Br x DP), the O staging tile when SEP_O (else O is staged in Q's slot),
 * STAGES slots of K and of V (Bc x DP), QB + 1 tiles of 16 bytes (the dynamic schedule's: the block's first, and
 * beside each Q slot the tile after that Q's), the mbarriers, and 1 KB of slack to align the tiles to 1024 bytes (the 128-byte
 * swizzle's period). */
#define V3_NBARS(QB, STAGES) (3 * (QB) + 4 * (STAGES))
#define V3_SMEM_BYTES(DP, BC, STAGES, CWG, QB, SEP_O)                                                               \
    ((size_t)(64 * (CWG) * ((QB) + ((SEP_O) ? 1 : 0)) + 2 * (STAGES) * (BC)) * (DP) * 2 + V3_NBARS(QB, STAGES) * 8 + \
     16 * ((QB) + 1) + 1024)
/* Blocks per SM: one consumer runs three where its tiles (with two Q slots and the O tile) fit in a third of the
 * SM's 228 KB, else two; more consumers, one.  A block may have 227 KB of shared memory, 113 KB when two share an SM,
 * 75 KB when three do (1 KB of each block's share is reserved). */
#define V3_SMEM_PER_BLOCK(BLOCKS) ((BLOCKS) == 3 ? 75 * 1024 : (BLOCKS) == 2 ? 113 * 1024 : 227 * 1024)
#define V3_BLOCKS_PER_SM(DP, BC, STAGES, CWG) \
    ((CWG) != 1 ? 1 : V3_SMEM_BYTES(DP, BC, STAGES, 1, 2, 1) <= V3_SMEM_PER_BLOCK(3) ? 3 : 2)
#define V3_SMEM_MAX(DP, BC, STAGES, CWG) V3_SMEM_PER_BLOCK(V3_BLOCKS_PER_SM(DP, BC, STAGES, CWG))
/* Two Q slots (the next tile's Q loads while this tile runs) with a separate O tile where they fit, else one Q
 * slot, and a separate O tile where that fits. */
#define V3_QB(DP, BC, STAGES, CWG) \
    (V3_SMEM_BYTES(DP, BC, STAGES, CWG, 2, 1) <= V3_SMEM_MAX(DP, BC, STAGES, CWG) ? 2 : 1)
#define V3_SEP_O(DP, BC, STAGES, CWG) \
    (V3_SMEM_BYTES(DP, BC, STAGES, CWG, V3_QB(DP, BC, STAGES, CWG), 1) <= V3_SMEM_MAX(DP, BC, STAGES, CWG))
/* Tiles back to back (v3_fwd_kernel.cuh): two Q slots and two consumers. */
#define V3_FLAT(DP, BC, STAGES, CWG) (V3_QB(DP, BC, STAGES, CWG) == 2 && (CWG) == 2)
/* Split tails (three consumers; v3_schedule.h, v3_fwd_kernel.cuh): consumers 1 and 2 hand consumer 0 their partial
 * O (64 x DP floats) and each thread's two row maxima and sums, in the O tile (Br x DP halves) and V3_MERGE_EXTRA
 * bytes after it (whole KB, so that K and V stay 1024-aligned). */
#define V3_MERGE_BYTES(DP, CWG) ((CWG) == 3 ? 2 * (64 * (DP) + 4 * 128) * 4 : 0)
#define V3_MERGE_EXTRA(DP, CWG)                                                                  \
    (V3_MERGE_BYTES(DP, CWG) > 128 * (CWG) * (DP)                                                \
         ? (V3_MERGE_BYTES(DP, CWG) - 128 * (CWG) * (DP) + 1023) / 1024 * 1024                   \
         : 0)
#define V3_SMEM(DP, BC, STAGES, CWG)                                                                 \
    (V3_SMEM_BYTES(DP, BC, STAGES, CWG, V3_QB(DP, BC, STAGES, CWG), V3_SEP_O(DP, BC, STAGES, CWG)) + \
     V3_MERGE_EXTRA(DP, CWG))

#endif
