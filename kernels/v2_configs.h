/* v2_configs.h -- the tile configurations of v2 compiled ahead of time, as data.
 *
 * X(DP, WARPS, MT, BC, STAGES): head-dim bucket, warps per block, 16-row tiles per warp (Br = 16 * MT * WARPS),
 * keys per block, K/V pipeline stages (1: interleaved single buffers, 2: double-buffered).
 * V2_DEFAULT_CONFIGS lists one default per head-dim bucket, in bucket order (64, 128, 256), for fp16 and bf16:
 * the winners of bench/v2_ab.py on the H100 beside torch's FlashAttention-2 (evidence/bench/h100_v2_ab_*.json).
 * V2_RULES: where calls of one kind run better on another config than their bucket's default, X(DP, WARPS, MT, BC,
 * STAGES, CAUSAL, SK_MIN, SK_MAX) for calls in bucket DP, causal or not (1 / 0), with SK_MIN <= Sk <= SK_MAX; the
 * first match wins; compiled for fp16 and bf16.  V2_SWEEP_CONFIGS are fp16 candidates that bench/v2_sweep.py times
 * against the defaults, each gated for correctness first.
 * Kept only if they can launch and do not spill: registers (MT * (D/8 + Bc/8) * 4 accumulators per thread, under
 * ~200; ptxas -v must report 0 spill bytes on sm_90) and shared memory ((Br + 2 * STAGES * Bc) * DP * 2 <= 227 KB).
 * Bc may be any multiple of 16 that divides the tile evenly over the threads (48 fits where 64 spills).
 */
#ifndef FATTN_V2_CONFIGS_H
#define FATTN_V2_CONFIGS_H

#include "../csrc/fattn.h"

typedef struct {
    int dp, warps, mt, bc, stages;
} v2_config;

#define V2_DEFAULT_CONFIGS(X) \
    X(64, 4, 2, 128, 2)       \
    X(128, 4, 2, 64, 1)       \
    X(256, 4, 1, 64, 1)

/* Used instead of the default when the default's grid would leave multiprocessors idle, or when Sq <= 64 (decode:
 * the default's taller tiles would compute rows that do not exist).  Same bucket order, fp16 and bf16.  D=128:
 * Bc = 32 double-buffered keeps the most K/V bytes in flight per multiprocessor (decode 1.00-1.01x cudnn). */
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

#ifndef __CUDACC_RTC__ /* host declarations; NVRTC compiles the kernels only */
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif
/* Implemented in kernels/v2_mma.cu (CUDA builds only). */
int fattn_v2_config_count(void);
int fattn_v2_rule_count(void);
/* Rule i of V2_RULES: its config, causal flag and Sk range (0 if i is out of range). */
int fattn_v2_rule(int i, v2_config *cfg, int *causal, long long *sk_min, long long *sk_max);
const v2_config *fattn_v2_config(int i);
int fattn_v2_active(int bucket);    /* bucket 0, 1, 2: head dims <= 64, <= 128, <= 256 */
fattn_status fattn_v2_select(int index); /* make config `index` the one used for its head-dim bucket */
int fattn_v2_config_aot(int i);  /* 1 if config i is compiled ahead of time, 0 if added at run time */
int fattn_v2_config_dtypes(int i); /* bit 0: fp16, bit 1: bf16 compiled for config i */
/* Adds a configuration compiled at run time (a cubin holding extern "C" kernel `func` for `dtype`); *index: its
 * table index, usable as attn_params.config and in fattn_v2_set_tuned. */
fattn_status fattn_v2_add_rtc(const v2_config *cfg, int dtype, const void *image, size_t size, const char *func,
                              int *index);
/* The tuned-config cache: config `index` (-1: none) for (device, dtype, head dim, causal, fattn_seq_bucket). */
fattn_status fattn_v2_set_tuned(int device, int dtype, int head_dim, int causal, int seq_bucket, int index);
void fattn_v2_clear_tuned(void);
int fattn_v2_last_config(void); /* table index the last v2 launch used */
int fattn_v2_last_splits(void); /* key splits the last v2 launch used (1: none) */
int fattn_v2_set_splits(int n); /* split-KV: 0 lets the heuristic decide, n >= 1 forces n splits; returns the old value */
int fattn_v2_set_order(int n);  /* block order: 0 lets v2 decide, 1 head by head, 2 heads fastest; returns the old value */
#ifdef __cplusplus
}
#endif
#endif /* __CUDACC_RTC__ */

#endif
