/* cpu_attn.h -- the CPU backend: its forward pass, configuration and plan (plan.h: fattn_cpu_plan). */
#ifndef FATTN_CPU_ATTN_H
#define FATTN_CPU_ATTN_H

#include "plan.h"

fattn_cpu_config fattn_cpu_default_config(void);
/* FATTN_ERR_UNSUPPORTED with the reason if the backend cannot run config c. */
fattn_status fattn_cpu_check_config(const fattn_cpu_config *c);

/* Runs on the calling thread (and its OpenMP team); never touches Python. */
fattn_status fattn_cpu_forward(const attn_params *p, const fattn_cpu_config *cfg);

#endif
