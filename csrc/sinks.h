/* sinks.h -- attention sinks (gpt-oss): a float32 logit s_h per head that joins every row's softmax denominator and
 * attends to nothing.  Exact on top of any forward kernel's O and LSE (natural log):
 *
 *   LSE' = log(exp(LSE) + exp(s_h))      O' = O exp(LSE - LSE')
 *
 * (a row that saw no key gets LSE' = s_h, O' = 0).  The gradient goes through any backward kernel given O' and LSE'
 * (the sink is one more key whose value is 0, so P', dP and dS of the real keys are the backward's own), plus
 *
 *   dsinks_h = -sum over the head's rows of exp(s_h - LSE') D,      D = rowsum(dO * O').
 *
 * Rows are addressed like out: (b, h, s) with strides in elements (packed varlen arrays: b = 1, s = total). */
#ifndef FATTN_SINKS_H
#define FATTN_SINKS_H

#include "fattn.h"

#ifndef __CUDACC__
#include <math.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    void *o;                          /* O, rewritten as O' (forward); read (backward) */
    const void *dout;                 /* dO (backward) */
    float *lse;                       /* LSE, rewritten as LSE' (forward); read (backward) */
    const float *sinks;               /* (h,) */
    float *dsinks;                    /* (h,), written (backward) */
    int64_t b, h, s, d;
    int64_t o_sb, o_sh, o_ss, do_sb, do_sh, do_ss, lse_sb, lse_sh;
    fattn_dtype dtype;
} fattn_sink_params;

void fattn_cpu_sinks_forward(const fattn_sink_params *p);
void fattn_cpu_sinks_backward(const fattn_sink_params *p);
/* On the GPU (csrc/gpu.c; kernels/simt/sinks.cu), on `stream` of `device`. */
fattn_status fattn_gpu_sinks(const fattn_sink_params *p, int backward, int device, void *stream);
#ifdef FATTN_WITH_CUDA
fattn_status fattn_launch_sinks(const fattn_sink_params *p, int backward, void *stream);
/* dsinks of a tensor-core backward (p->dsinks, p->fwd.sinks set), from the D and LSE2 its bwd_prep left in the
 * workspace (kernels/bwd_common.cuh): 8 bytes a row read instead of the pass's dO and O rows.  After the backward's
 * kernels, on the same stream. */
fattn_status fattn_launch_bwd_dsinks(const attn_bwd_params *p, void *stream);
#endif

/* The forward's rule for one row (the CPU and the GPU share it): LSE' = max + log1p(exp(-|LSE - s|)), and O's factor
 * exp(LSE - LSE') = 1 / (1 + exp(s - LSE)) (0 for a row that saw no key). */
FATTN_HD float fattn_sink_lse(float lse, float sink) {
    if (lse == -INFINITY) return sink;
    const float hi = lse > sink ? lse : sink, lo = lse > sink ? sink : lse;
    return hi + log1pf(expf(lo - hi));
}
FATTN_HD float fattn_sink_factor(float lse, float sink) {
    return lse == -INFINITY ? 0.f : 1.f / (1.f + expf(sink - lse));
}
/* The backward's weight of a row's D in dsinks, exp(s - LSE') -- 0 for a row with LSE' = -inf (a sink of -inf on a
 * row that saw no key: D = 0 there, and exp(-inf + inf) would make it NaN; the tensor-core backwards' LSE2 is +inf
 * for such rows, kernels/bwd_common.cuh, which gives 0 too). */
FATTN_HD float fattn_sink_weight(float lse, float sink) { return lse == -INFINITY ? 0.f : expf(sink - lse); }

#ifdef __cplusplus
}
#endif
#endif
