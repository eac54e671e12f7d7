/* v3_configs.h -- the configurations of v3 compiled ahead of time, as data.
 *
 * X(DP, BC, STAGES, CONSUMERS, PINGPONG): head-dim bucket, keys per block, K/V ring slots, consumer warpgroups
 * (Br = 64 * CONSUMERS query rows per block), and whether the consumers take turns issuing their GEMMs.
 * V3_DEFAULT_CONFIGS: one per head-dim bucket, in bucket order (64, 128, 256); V3_SWEEP_CONFIGS: candidates that
 * bench/v3_sweep.py times against them (fattn._C.v3_configs() lists all; an explicit config index runs one).
 * The defaults are the winners of bench/v3_sweep.py on the H200 and the H100 (evidence/bench/*_v3_sweep_*.json).
 * V3_RULES: where calls of one kind run better on another config than their bucket's default (the config must also
 * be in the sweep list).  X(DP, BC, STAGES, CONSUMERS, PINGPONG, CAUSAL, SK_MIN, SK_MAX): calls in bucket DP,
 * causal or not (CAUSAL 1 / 0), with SK_MIN <= Sk <= SK_MAX.  Measured on the H100 (evidence/bench/h100_v3_*):
 *   D=64 causal, Sk <= 2k: Br = 128 without ping-pong, 0.58-0.78x -> 0.75-0.82x cudnn (less of each tile masked);
 *   D=128 / D=256 non-causal, Sk >= 8k: Bc = 176 / 80 (bench/v3_ab.py, interleaved medians: 16k 0.93 -> 0.97x,
 *   8k 0.94 -> 0.97x at D=128; 16k 1.00 -> 1.06x at D=256).  The first matching rule wins.
 */
#ifndef FATTN_V3_CONFIGS_H
#define FATTN_V3_CONFIGS_H

#include "../csrc/fattn.h"

typedef struct {
    int dp, bc, stages, consumers, pingpong;
} v3_config;

#define V3_DEFAULT_CONFIGS(X) \
    X(64, 128, 4, 3, 1)       \
    X(128, 128, 2, 2, 1)      \
    X(256, 64, 2, 2, 1)

#define V3_RULES(X)                                \
    X(64, 128, 2, 2, 0, 1, 0, 2048)                \
    X(128, 176, 2, 2, 1, 0, 8192, INT64_MAX)       \
    X(256, 80, 2, 2, 1, 0, 8192, INT64_MAX)

#define V3_SWEEP_CONFIGS(X) \
    X(64, 64, 4, 3, 1)      \
    X(64, 128, 2, 2, 1)     \
    X(64, 128, 2, 2, 0)     \
    X(64, 192, 2, 2, 1)     \
    X(128, 128, 2, 2, 0)    \
    X(128, 176, 2, 2, 1)    \
    X(128, 128, 3, 2, 1)    \
    X(256, 64, 2, 2, 0)     \
    X(256, 80, 2, 2, 1)

#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif
/* Implemented in kernels/v3_wgmma_sm90a.cu (CUDA builds only). */
int fattn_v3_config_count(void);
const v3_config *fattn_v3_config(int i);
size_t fattn_v3_config_smem(int i); /* dynamic shared memory per block of config i, bytes */
int fattn_v3_last_config(void); /* table index of the last v3 launch; -1 when it ran v2 (tensors TMA cannot address) */
#ifdef __cplusplus
}
#endif

#endif
