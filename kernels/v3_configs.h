/* v3_configs.h -- the configurations of v3 compiled ahead of time, as data.
 *
 * X(DP, BC, STAGES, CONSUMERS, PINGPONG): head-dim bucket, keys per block, K/V ring slots, consumer warpgroups
 * (Br = 64 * CONSUMERS query rows per block), and whether the consumers take turns issuing their GEMMs.
 * V3_DEFAULT_CONFIGS: one per head-dim bucket, in bucket order (64, 128, 256); V3_SWEEP_CONFIGS: candidates that
 * bench/v3_sweep.py times against them (fattn._C.v3_configs() lists all; an explicit config index runs one).
 * The defaults are the winners of bench/v3_sweep.py on the H200 and the H100 (evidence/bench/*_v3_sweep_*.json).
 * V3_SHORT_CAUSAL_CONFIGS: where a bucket's causal calls with Sk <= V3_SHORT_SK run better on another config (they
 * must also be in the sweep list): D=64 causal at S = 512-2k on the H100, 0.58-0.78x -> 0.77-0.82x torch cudnn
 * with two consumers and no ping-pong (Br = 128: less of each tile is masked away than with Br = 192).
 * Kept only if ptxas -v reports little or no spilling (a few words per thread at most) and (64 * CONSUMERS + 2 * STAGES * BC) * DP * 2 + 1 KB <= 227 KB.
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

#define V3_SHORT_SK 2048
#define V3_SHORT_CAUSAL_CONFIGS(X) \
    X(64, 128, 2, 2, 0)

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
