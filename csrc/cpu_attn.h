/* cpu_attn.h -- the CPU backend's entry point and its tunable configuration. */
#ifndef FATTN_CPU_ATTN_H
#define FATTN_CPU_ATTN_H

#include "fattn.h"

typedef struct {
    int br;      /* query rows per task (Br) */
    int bc;      /* keys per block (Bc), a multiple of 16 */
    int threads; /* 0: OpenMP's default */
} fattn_cpu_config;

fattn_cpu_config fattn_cpu_default_config(void);

/* Runs on the calling thread (and its OpenMP team); never touches Python. */
fattn_status fattn_cpu_forward(const attn_params *p, const fattn_cpu_config *cfg);

/* The timing harness on the CPU: `reps` calls after `warmup` untimed ones, each timed by CLOCK_MONOTONIC;
 * us[i]: the microseconds of call i. */
fattn_status fattn_cpu_time(const attn_params *p, const fattn_cpu_config *cfg, int reps, int warmup, float *us);

#endif
