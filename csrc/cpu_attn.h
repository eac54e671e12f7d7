/* cpu_attn.h -- the CPU backend: its forward (cpu_attn.c) and backward (cpu_bwd.c) passes, configurations and plans. */
#ifndef FATTN_CPU_ATTN_H
#define FATTN_CPU_ATTN_H

#include "plan.h"

fattn_cpu_config fattn_cpu_default_config(void);
/* FATTN_ERR_UNSUPPORTED with the reason if the backend cannot run config c. */
fattn_status fattn_cpu_check_config(const fattn_cpu_config *c);

/* A forward's scratch (per thread: its query block and a head's packed keys), allocated before the call writes
 * anything -- a KV cache's append is made after it, so a call refused for memory writes nothing. */
typedef struct fattn_cpu_work fattn_cpu_work;
fattn_status fattn_cpu_work_alloc(const attn_params *p, const fattn_cpu_config *cfg, fattn_cpu_work **w);
void fattn_cpu_work_free(fattn_cpu_work *w);

/* Runs on the calling thread (and its OpenMP team) with w from fattn_cpu_work_alloc(p, cfg); never touches
 * Python. */
fattn_status fattn_cpu_forward(const attn_params *p, const fattn_cpu_config *cfg, fattn_cpu_work *w);

/* The backward (fattn.h: attn_bwd_params; dpsum and dq_accum unused): same contract; config from
 * fattn_cpu_plan_bwd (br, bc of its own blocks). */
fattn_cpu_config fattn_cpu_default_bwd_config(void);
void fattn_cpu_plan_bwd(const attn_bwd_params *p, const fattn_overrides *ov, fattn_plan *plan);
fattn_status fattn_cpu_backward(const attn_bwd_params *p, const fattn_cpu_config *cfg);

#endif
