/* gpu.h -- the CUDA side as the C extension sees it: device queries and the table of GPU kernel variants.
 * Implemented in csrc/gpu.c (runtime calls) and the kernels/ sources (one launcher per variant).  When fattn is built
 * without nvcc, csrc/gpu.c reports that CUDA support was not compiled in. */
#ifndef FATTN_GPU_H
#define FATTN_GPU_H

#include "fattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A launcher runs one forward pass on `stream` (a cudaStream_t) for the current device; it never allocates and
 * never synchronises.  p->sm_count is filled in by the caller.  A check says, without touching the GPU, whether
 * the variant can run these params (alignment, dtype, ...): FATTN_ERR_UNSUPPORTED with a reason if not. */
typedef fattn_status (*fattn_launch_fn)(const attn_params *p, void *stream);
typedef fattn_status (*fattn_check_fn)(const attn_params *p);

/* A preference says whether the variant should be the default for p where it can run (NULL: always). */
typedef int (*fattn_prefer_fn)(const attn_params *p);

typedef struct {
    const char *name;    /* "v0", "v1", ... */
    const char *summary; /* one line: what the version adds */
    int min_sm;          /* lowest compute capability (major*10+minor) it runs on */
    int max_sm;          /* highest (0: no limit); sm_90a code runs on compute capability 9.0 only */
    int dtypes;          /* bitmask of 1 << fattn_dtype it accepts */
    fattn_launch_fn launch;
    fattn_check_fn check;
    fattn_prefer_fn prefer;
} fattn_variant;

/* X-macro: every GPU variant, in version order.  X(name, summary, min_sm, max_sm, dtype mask, prefer) */
#define FATTN_GPU_VARIANTS(X)                                                                                     \
    X(v0, "naive: one thread per query row, online softmax in registers", 50, 0, 7, NULL)                         \
    X(v1, "tiled scalar: K/V tiles in shared memory, online softmax, warp reductions", 50, 0, 7, NULL)            \
    X(v2, "tensor cores (mma.sync m16n8k16), ldmatrix from swizzled smem, cp.async K/V pipeline", 80, 0, 6, NULL) \
    X(v3, "Hopper: wgmma, TMA K/V ring with mbarriers, producer/consumer warpgroups", 90, 90, 6, fattn_prefer_v3)

#define FATTN_DECLARE_LAUNCH(name, summary, min_sm, max_sm, dtypes, prefer)                                       \
    fattn_status fattn_launch_##name(const attn_params *p, void *stream);                                        \
    fattn_status fattn_check_##name(const attn_params *p);
FATTN_GPU_VARIANTS(FATTN_DECLARE_LAUNCH)
#undef FATTN_DECLARE_LAUNCH
int fattn_prefer_v3(const attn_params *p);

/* 1 if `variant` runs on a device of compute capability sm (major*10+minor). */
static inline int fattn_variant_runs_on(const fattn_variant *variant, int sm) {
    return sm >= variant->min_sm && (!variant->max_sm || sm <= variant->max_sm);
}

/* NULL-terminated table built from FATTN_GPU_VARIANTS (empty without CUDA). */
extern const fattn_variant fattn_gpu_variants[];

/* 1 if fattn was built with CUDA support. */
int fattn_gpu_compiled(void);
/* Number of usable CUDA devices; a non-OK status (no driver, no device) comes with a message. */
fattn_status fattn_gpu_device_count(int *count);
/* Compute capability (major*10+minor) and multiprocessor count of `device`. */
fattn_status fattn_gpu_device_info(int device, int *sm, int *sm_count, char *name, int name_len);
/* The variant fattn uses by default on `device` for p: the highest version that runs there, whose check passes
 * and that prefers p (v1 runs everything, so there always is one).  NULL with a message if the device cannot be queried. */
const fattn_variant *fattn_gpu_default(int device, const attn_params *p);
/* Runs `variant` on `device`: switches the current device if needed and restores it afterwards. */
fattn_status fattn_gpu_forward(const fattn_variant *variant, int device, attn_params *p, void *stream);

/* The timing harness: `reps` launches of variant on `stream`, after `warmup` untimed ones, each between two CUDA
 * events, the L2 flushed (a memset of twice its size, outside the events) before each when `flush`.  us[i]: the
 * microseconds of launch i.  Waits for the last event (the caller releases the GIL). */
#define FATTN_TIME_MAX_REPS 10000
fattn_status fattn_gpu_time(const fattn_variant *variant, int device, attn_params *p, void *stream, int reps,
                            int warmup, int flush, float *us);

#ifdef __cplusplus
}
#endif
#endif
