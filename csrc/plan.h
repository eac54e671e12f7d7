/* plan.h -- plan, then launch.
 *
 * A call flows api -> args -> plan -> launch -> kernel.  One host step turns (params, device, tuned configs,
 * overrides) into a fattn_plan: which variant, which of its configs, the grid, the key splits, the block order and
 * the workspace.  A launcher takes (params, plan, stream) and nothing else: it allocates nothing, synchronises
 * nothing and keeps no state.  Overrides (tests, sweeps, the tuner) travel with the call; the plan that ran is what
 * the caller gets back.
 *
 * The GPU variants are the table in variants.h; each has a planner (plain C, a *_plan.c file in its kernels/ folder) and a
 * launcher (CUDA, a .cu file there).  The CPU backend plans in the same struct (plan.cpu).
 */
#ifndef FATTN_PLAN_H
#define FATTN_PLAN_H

#include <stddef.h>

#include "fattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The CPU backend's tunable configuration. */
typedef struct {
    int br;      /* query rows per task (Br) */
    int bc;      /* keys per block (Bc), a multiple of 16 */
    int threads; /* 0: OpenMP's default */
} fattn_cpu_config;

/* Block orders of a grid over (query block, head): */
#define FATTN_ORDER_HEADS 1  /* one head's query blocks after another (K/V of the heads in flight shared in L2) */
#define FATTN_ORDER_BLOCKS 2 /* every head's last (with causal masking: longest) query block first, heads fastest */

/* What a caller may force (tests, sweeps, the tuner); zero / -1 fields leave the choice to the planner. */
typedef struct {
    int config;           /* -1: the planner's; else an index into the variant's config table */
    fattn_cpu_config cpu; /* br = 0: the planner's */
    int splits;           /* 0: the planner's; n >= 1: n key splits (1: none) */
    int order;            /* 0: the planner's; FATTN_ORDER_HEADS or FATTN_ORDER_BLOCKS */
} fattn_overrides;

#define FATTN_NO_OVERRIDES {-1, {0, 0, 0}, 0, 0}

/* A CUDA device as the planners see it. */
typedef struct {
    int id;
    int sm;       /* compute capability, major * 10 + minor */
    int sm_count; /* multiprocessors */
} fattn_device;

struct fattn_variant;
struct fattn_bwd_variant;
struct fattn_tuned;

/* The stream's counters (fattn_plan.counters): words [0, FATTN_TILE_WORDS) are v3's tile counter (its dynamic
 * schedule), the FATTN_ARRIVALS after them v2's split arrivals (one per query block of a split call that merges in
 * the kernel: v2_fwd.cu). */
#define FATTN_TILE_WORDS 2
#define FATTN_ARRIVALS 1024
#define FATTN_COUNTERS (FATTN_TILE_WORDS + FATTN_ARRIVALS)

typedef struct fattn_plan {
    const struct fattn_variant *variant; /* the forward's; NULL: the CPU backend or a backward plan */
    const struct fattn_bwd_variant *bwd; /* a backward plan's; NULL: the CPU backend or a forward plan */
    fattn_device dev;
    int config;             /* index into the variant's config table (-1: the variant has none) */
    fattn_cpu_config cpu;   /* the CPU backend's configuration */
    unsigned grid_x, grid_y, threads;
    size_t smem;            /* dynamic shared memory per block, bytes */
    int splits;             /* key splits (split-KV); 1: none */
    int64_t split_blocks;   /* key blocks per split */
    int order;              /* FATTN_ORDER_* */
    int64_t head_group;     /* v3's tile order: (b, h) pairs per group (1: head by head); v2: query heads packed
                               as rows of their kv head (fattn_pack_gqa; 1: none) */
    size_t workspace_bytes; /* device scratch the launch needs (split-KV partials) */
    void *workspace;        /* filled in by the dispatch step before launching */
    int sinks_fused;        /* forward: the kernel applies attn_params.sinks itself; backward: dsinks come from the
                               workspace's D and LSE2 (fattn_launch_bwd_dsinks); either way no sinks pass after it,
                               re-reading out (and dO) */
    int use_counters;       /* 1: the launch counts on the stream's counters when it can have them (FATTN_COUNTERS) */
    unsigned *counters;     /* filled in by the dispatch step: FATTN_COUNTERS words, zero at launch (a kernel that
                               counts on them leaves them so); NULL (under CUDA graph capture, or no memory): the
                               launch does without (v3: its static schedule; v2: the separate merge kernel) */
} fattn_plan;

/* A variant's planner: fills plan (plan->dev is set) for p, or returns FATTN_ERR_UNSUPPORTED with the reason. */
typedef fattn_status (*fattn_plan_fn)(const attn_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov,
                                      fattn_plan *plan);
/* A variant's launcher: runs plan on `stream` (a cudaStream_t) on the current device. */
typedef fattn_status (*fattn_launch_fn)(const attn_params *p, const fattn_plan *plan, void *stream);
/* The backward's planner and launcher, the same contract for attn_bwd_params. */
typedef fattn_status (*fattn_plan_bwd_fn)(const attn_bwd_params *p, const struct fattn_tuned *tuned,
                                          const fattn_overrides *ov, fattn_plan *plan);
typedef fattn_status (*fattn_launch_bwd_fn)(const attn_bwd_params *p, const fattn_plan *plan, void *stream);
/* Once per device before the first launch there: raises the kernels' shared-memory limits and the like. */
typedef fattn_status (*fattn_prepare_fn)(int device);

/* Features of a call a kernel may not take (yet): its planner refuses the call naming the first one it lacks, and
 * the dispatch then picks a variant that takes it (the scalar family takes every one). */
#define FATTN_TAKES_SOFTCAP 1
#define FATTN_TAKES_VARLEN 2    /* cu_seqlens_q / cu_seqlens_k */
#define FATTN_TAKES_SEQUSED 4   /* seqused_k */
#define FATTN_TAKES_PAGED 8     /* block_table (a paged KV cache) */
#define FATTN_TAKES_ALIBI 16    /* alibi_slopes */
static inline const char *fattn_missing_feature(const attn_params *p, int takes) {
    if (p->softcap > 0.f && !(takes & FATTN_TAKES_SOFTCAP)) return "a softcap";
    if (p->cu_seqlens_q && !(takes & FATTN_TAKES_VARLEN)) return "variable-length batches (cu_seqlens)";
    if (p->seqused_k && !(takes & FATTN_TAKES_SEQUSED)) return "seqused_k";
    if (p->block_table && !(takes & FATTN_TAKES_PAGED)) return "a paged KV cache (block_table)";
    if (p->alibi_slopes && !(takes & FATTN_TAKES_ALIBI)) return "ALiBi (alibi_slopes)";
    return NULL;
}

/* The CPU backend's plan: the override, else the tuned config registered for p, else the built-in default. */
void fattn_cpu_plan(const attn_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov, fattn_plan *plan);

#ifdef __cplusplus
}
#endif
#endif
