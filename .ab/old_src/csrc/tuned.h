/* tuned.h -- the tuned-config table: configurations `python -m fattn.tune evo ... --save` found, registered from the
 * cache file by fattn/_tuned.py and consulted by the planners.  One store for every kernel family and the CPU
 * backend; the extension's module state owns it (no process-wide table). */
#ifndef FATTN_TUNED_H
#define FATTN_TUNED_H

#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FATTN_TUNED_MAX 256
#define FATTN_TUNED_CPU (-1) /* the `variant` of the CPU backend's entries */

/* The sequence-length bucket of an entry: Sk <= 512, <= 1k, ..., <= 32k, more (8 buckets), doubled by whether the
 * queries fit one 64-row tile (decode-like calls tune differently). */
#define FATTN_SEQ_BUCKETS 16
static inline int fattn_seq_bucket(int64_t sq, int64_t sk) {
    int b = 0;
    while (b < 7 && sk > ((int64_t)512 << b)) b++;
    return b + (sq <= 64 ? 8 : 0);
}

typedef struct {
    int variant;          /* index in fattn_gpu_variants, or FATTN_TUNED_CPU */
    int device;           /* CUDA device id (0 for the CPU) */
    int dtype, head_dim, causal, bucket;
    int config;           /* the variant's config index */
    fattn_cpu_config cpu; /* the CPU backend's */
} fattn_tuned_entry;

typedef struct fattn_tuned {
    int n;
    fattn_tuned_entry e[FATTN_TUNED_MAX];
} fattn_tuned;

/* The entry for (variant, device) matching p's dtype, head dim, causality and sequence bucket, or NULL. */
const fattn_tuned_entry *fattn_tuned_find(const fattn_tuned *t, int variant, int device, const attn_params *p);
/* Adds or replaces the entry with e's key; FATTN_ERR_INVALID when the table is full or a field is out of range. */
fattn_status fattn_tuned_set(fattn_tuned *t, const fattn_tuned_entry *e);

#ifdef __cplusplus
}
#endif
#endif
