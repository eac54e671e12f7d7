/* rtc.h -- run-time compilation of kernels: NVRTC compiles a kernels/ source with one configuration given as
 * macros, the CUDA driver API loads the image and launches it.  Both libraries are opened with dlopen on first
 * use: importing fattn never needs them.  The disk cache of compiled images lives in fattn/_rtc.py. */
#ifndef FATTN_RTC_H
#define FATTN_RTC_H

#include <stddef.h>

#include "fattn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fattn_rtc_kernel fattn_rtc_kernel;

/* Version of the NVRTC library at `nvrtc_path` (NULL or "": the default sonames). */
fattn_status fattn_rtc_version(const char *nvrtc_path, int *major, int *minor);

/* Compiles `source` (called `name` in messages) with `opts` into a cubin.  On success *image (size *image_size)
 * and *log are malloc'd and the caller frees them; on a compile error *log holds the compiler's log. */
fattn_status fattn_rtc_compile(const char *nvrtc_path, const char *source, const char *name, const char *const *opts,
                               int nopts, char **image, size_t *image_size, char **log);

/* Kernel `func` (an extern "C" name) of a cubin image, which is copied; loaded per device on its first launch. */
fattn_rtc_kernel *fattn_rtc_kernel_new(const void *image, size_t size, const char *func);

/* Launches k on the current device on `stream` (a cudaStream_t): grid (gx, gy), `block` threads, `smem` bytes of
 * dynamic shared memory (opted in above 48 KB), kernel arguments `args` as for cudaLaunchKernel. */
fattn_status fattn_rtc_launch(fattn_rtc_kernel *k, unsigned gx, unsigned gy, unsigned block, unsigned smem,
                              void *stream, void **args);

/* The registry of kernels compiled at run time: an append-only, process-wide list (loaded modules are process-wide
 * anyway).  An entry is one configuration of one variant for one dtype; the variant's planner numbers its entries
 * after its ahead-of-time configs. */
#define FATTN_RTC_FIELDS 8
typedef struct {
    char variant[8];
    int64_t cfg[FATTN_RTC_FIELDS]; /* the variant's config fields, in its own order */
    int dtype;
    fattn_rtc_kernel *kernel;
} fattn_rtc_entry;

/* Adds an entry (the kernel is owned by the registry from then on); *index: its registry position. */
fattn_status fattn_rtc_register(const char *variant, const int64_t *cfg, int n, int dtype, fattn_rtc_kernel *k,
                                int *index);
/* Entry i, or NULL; entries never move or change once added. */
const fattn_rtc_entry *fattn_rtc_entry_at(int i);

#ifdef __cplusplus
}
#endif
#endif
