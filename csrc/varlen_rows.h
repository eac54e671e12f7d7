/* varlen_rows.h -- the rows of a packed batch that no sequence covers.
 *
 * cu_seqlens are non-decreasing prefix sums from >= 0 that may end before the packed array does (a padded batch):
 * rows [0, cu[0]) and [cu[B], total) belong to no sequence.  Their gradients are zero -- nothing computed depends on
 * them -- so a packed backward writes zeros there in dq (total_q rows) and in dk and dv (total_k rows), after its
 * kernel, from the offsets as the device holds them (trusted calls included: the offsets are clamped to the array). */
#ifndef FATTN_VARLEN_ROWS_H
#define FATTN_VARLEN_ROWS_H

#include "fattn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The uncovered rows of one side: [0, first) and [last, total), with 0 <= first <= last <= total. */
FATTN_HD void fattn_uncovered_rows(const int32_t *cu, int64_t batch, int64_t total, int64_t *first, int64_t *last) {
    int64_t a = cu[0], z = cu[batch];
    a = a < 0 ? 0 : a > total ? total : a;
    z = z < a ? a : z > total ? total : z;
    *first = a;
    *last = z;
}

/* On the CPU (p->fwd.cu_seqlens_q set: a packed call). */
void fattn_cpu_zero_uncovered(const attn_bwd_params *p);

/* On the GPU (csrc/gpu.c; kernels/simt/varlen_rows.cu), on `stream` of `device`. */
fattn_status fattn_gpu_zero_uncovered(const attn_bwd_params *p, int device, void *stream);
#ifdef FATTN_WITH_CUDA
fattn_status fattn_launch_zero_uncovered(const attn_bwd_params *p, void *stream);
#endif

#ifdef __cplusplus
}
#endif
#endif
