/* variants.h -- the table of GPU kernel variants, device queries, and the dispatch step (plan, workspace, launch).
 *
 * A new variant or GPU family is one row of FATTN_GPU_VARIANTS and its folder under kernels/ (a planner, a launcher,
 * a prepare hook); nothing else here changes.  Built without nvcc, the table still lists every variant with its
 * planner and configs, but has no launchers, and every GPU entry point returns a clear error (csrc/gpu.c).
 */
#ifndef FATTN_VARIANTS_H
#define FATTN_VARIANTS_H

#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One configuration of a variant, as data: what _C._dev.configs() lists and the tuner reads. */
#define FATTN_CONFIG_FIELDS 8
typedef struct {
    const char *role; /* "default", "small_grid", "rule", "sweep" (compiled ahead of time) or "runtime" (NVRTC) */
    int dtypes;       /* bitmask of 1 << fattn_dtype it is compiled for */
    size_t smem;      /* dynamic shared memory per block, bytes */
    int n;            /* fields */
    const char *names[FATTN_CONFIG_FIELDS];
    int64_t values[FATTN_CONFIG_FIELDS];
} fattn_config_info;

/* Config i of a variant (0 past the last one). */
typedef int (*fattn_configs_fn)(int i, fattn_config_info *out);
/* Whether a variant can run config `values` (its fields in configs()' order) at head dim d in dtype within
 * smem_limit bytes of shared memory: FATTN_ERR_UNSUPPORTED with the reason if not (the tuner's keep()). */
typedef fattn_status (*fattn_check_config_fn)(const int64_t *values, int n, int d, int dtype, size_t smem_limit);

typedef struct fattn_variant {
    const char *name;     /* "v0", "v1", ... */
    const char *family;   /* its folder under kernels/ */
    const char *file;     /* the forward kernel's source, relative to the source root */
    const char *summary;  /* one line: what the version adds */
    int min_sm, max_sm;   /* compute capabilities (major*10+minor) it runs on; max 0: no limit */
    int dtypes;           /* bitmask of 1 << fattn_dtype it accepts */
    const char *fallback; /* forced on a call its planner refuses, this variant runs instead (NULL: none) */
    fattn_plan_fn plan;
    fattn_launch_fn launch;
    fattn_prepare_fn prepare;
    fattn_configs_fn configs;
    fattn_check_config_fn check_config;
    int (*prefer)(const attn_params *p); /* the default where it plans (NULL: always) */
    const char *bwd;      /* the backward variant that differentiates its results */
} fattn_variant;

/* Every GPU variant, in version order.  bwd: the backward variant (FATTN_GPU_BWD_VARIANTS) that differentiates it.
 * X(name, family, file, summary, min_sm, max_sm, dtype mask, fallback, prefer, bwd) */
#define FATTN_GPU_VARIANTS(X)                                                                                     \
    X(v0, simt, "kernels/simt/v0_fwd.cu", "naive: one thread per query row, online softmax in registers", 50, 0, 7, \
      NULL, NULL, v1)                                                                                             \
    X(v1, simt, "kernels/simt/v1_fwd.cu", "tiled scalar: K/V tiles in shared memory, online softmax, warp reductions", \
      50, 0, 7, NULL, NULL, v1)                                                                                   \
    X(v2, sm80, "kernels/sm80/v2_fwd.cu",                                                                          \
      "tensor cores (mma.sync m16n8k16), ldmatrix from swizzled smem, cp.async K/V pipeline", 80, 0, 6, NULL, NULL,  \
      v2)                                                                                                         \
    X(v3, sm90, "kernels/sm90/v3_fwd.cu", "Hopper: wgmma, TMA K/V ring with mbarriers, producer/consumer warpgroups", \
      90, 90, 6, "v2", fattn_prefer_v3, v3)

#define FATTN_DECLARE_VARIANT(name, family, file, summary, min_sm, max_sm, dtypes, fallback, prefer, bwd)        \
    fattn_status fattn_plan_##name(const attn_params *p, const struct fattn_tuned *tuned, const fattn_overrides *ov, \
                                   fattn_plan *plan);                                                            \
    fattn_status fattn_launch_##name(const attn_params *p, const fattn_plan *plan, void *stream);                 \
    fattn_status fattn_prepare_##name(int device);                                                               \
    int fattn_configs_##name(int i, fattn_config_info *out);                                                     \
    fattn_status fattn_check_config_##name(const int64_t *values, int n, int d, int dtype, size_t smem_limit);
FATTN_GPU_VARIANTS(FATTN_DECLARE_VARIANT)
#undef FATTN_DECLARE_VARIANT
int fattn_prefer_v3(const attn_params *p);

/* Every GPU backward variant, in version order: the kernels that compute dQ, dK, dV (attn_bwd_params).
 * fallback: forced on a call its planner refuses, this backward variant runs instead (NULL: none).
 * X(name, family, file, summary, min_sm, max_sm, dtype mask, fallback) */
#define FATTN_GPU_BWD_VARIANTS(X)                                                                                 \
    X(v1, simt, "kernels/simt/v1_bwd.cu", "scalar: a warp per query row for dQ, per key row for dK and dV", 50, 0, 7, \
      NULL)                                                                                                       \
    X(v2, sm80, "kernels/sm80/v2_bwd.cu",                                                                          \
      "tensor cores (mma.sync): a block per key block walks the query blocks, dQ in float32 by atomics", 80, 0, 6,  \
      NULL)                                                                                                       \
    X(v3, sm90, "kernels/sm90/v3_bwd.cu",                                                                          \
      "Hopper: wgmma for all five products, TMA ring of Q / dO, producer and consumer warpgroups", 90, 90, 6, "v2")

typedef struct fattn_bwd_variant {
    const char *name, *family, *file, *summary;
    int min_sm, max_sm, dtypes;
    const char *fallback;
    fattn_plan_bwd_fn plan;
    fattn_launch_bwd_fn launch;
    fattn_prepare_fn prepare;
} fattn_bwd_variant;

#define FATTN_DECLARE_BWD_VARIANT(name, family, file, summary, min_sm, max_sm, dtypes, fallback)                 \
    fattn_status fattn_plan_bwd_##name(const attn_bwd_params *p, const struct fattn_tuned *tuned,                \
                                       const fattn_overrides *ov, fattn_plan *plan);                             \
    fattn_status fattn_launch_bwd_##name(const attn_bwd_params *p, const fattn_plan *plan, void *stream);         \
    fattn_status fattn_prepare_bwd_##name(int device);
FATTN_GPU_BWD_VARIANTS(FATTN_DECLARE_BWD_VARIANT)
#undef FATTN_DECLARE_BWD_VARIANT

/* NULL-terminated table built from FATTN_GPU_VARIANTS.  Without CUDA launch and prepare are NULL (the planners and
 * config tables still answer). */
extern const fattn_variant fattn_gpu_variants[];
extern const fattn_bwd_variant fattn_gpu_bwd_variants[];

/* 1 if `v` runs on a device of compute capability sm. */
static inline int fattn_variant_runs_on(const fattn_variant *v, int sm) {
    return sm >= v->min_sm && (!v->max_sm || sm <= v->max_sm);
}
const fattn_variant *fattn_find_variant(const char *name);
/* The backward variant that differentiates forward variant `name` (the names are the forward's). */
const fattn_bwd_variant *fattn_find_bwd_variant(const char *name);

/* 1 if fattn was built with CUDA support. */
int fattn_gpu_compiled(void);
/* 1 if `stream` is being captured into a CUDA graph, or its capture status cannot be had (0 without CUDA). */
int fattn_gpu_stream_capturing(void *stream);
/* Copies n pieces of device memory (on `device`), bytes[i] from src[i] to dst[i] on the host, ordered after the work
 * queued on `stream`, and waits for them once (small synchronous reads: the index arrays' checks).  Not on a stream
 * being captured into a CUDA graph (the read would fail and end the capture): callers ask
 * fattn_gpu_stream_capturing first. */
fattn_status fattn_gpu_read_many(int n, void *const *dst, const void *const *src, const size_t *bytes, int device,
                                 void *stream);

/* Number of usable CUDA devices; a non-OK status (no driver, no device) comes with a message saying so. */
fattn_status fattn_gpu_device_count(int *count);
/* The device's compute capability and multiprocessor count (cached), and its name when name != NULL. */
fattn_status fattn_gpu_device(int device, fattn_device *dev, char *name, int name_len);

/* Plans p on dev: the variant `forced` (NULL: the highest one that runs there, takes p's dtype, plans and prefers
 * p).  A forced variant whose planner refuses p runs its fallback if it has one; otherwise the planner's reason
 * is returned (FATTN_ERR_UNSUPPORTED). */
fattn_status fattn_plan_gpu(const attn_params *p, const fattn_device *dev, const struct fattn_tuned *tuned,
                            const char *forced, const fattn_overrides *ov, fattn_plan *plan);

/* Readies a plan on `stream`: switches to plan->dev.id if needed (and back), prepares the device once, gives the plan
 * its workspace -- or, when none can be had without risk (the stream is being captured into a CUDA graph), plans
 * p again with one key split -- and its counters.  The plan to launch is left in *plan.  Everything that can refuse
 * a call before its kernels run happens here, so a caller that writes first (a KV cache's append) readies, then
 * writes, then launches. */
fattn_status fattn_ready_gpu(const attn_params *p, const struct fattn_tuned *tuned, const char *forced,
                             const fattn_overrides *ov, fattn_plan *plan, void *stream);
/* Launches a readied plan on `stream` (on plan->dev.id). */
fattn_status fattn_launch_gpu(const attn_params *p, const fattn_plan *plan, void *stream);

/* The backward's dispatch: plans p (the backward variant of forced variant `forced`, else the highest that runs on
 * dev, takes p's dtype and plans p) and runs it on `stream`.  p->dq_accum / p->dpsum set: a workspace the caller
 * gave (at least fattn_bwd_workspace_bytes); NULL: one from the (device, stream) cache, refused under graph capture.
 * The plan that ran is left in *plan. */
fattn_status fattn_plan_gpu_bwd(const attn_bwd_params *p, const fattn_device *dev, const struct fattn_tuned *tuned,
                                const char *forced, const fattn_overrides *ov, fattn_plan *plan);
fattn_status fattn_run_gpu_bwd(const attn_bwd_params *p, const fattn_plan *plan, void *stream);

#ifdef __cplusplus
}
#endif
#endif
