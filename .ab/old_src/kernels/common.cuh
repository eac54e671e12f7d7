/* common.cuh -- small device helpers shared by the kernel families: element conversion, warp reductions,
 * CUDA error checking (csrc/cuda_check.h).  Everything is static and inline; each kernel file includes this once. */
#ifndef FATTN_COMMON_CUH
#define FATTN_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifdef __CUDACC_RTC__ /* NVRTC (fattn/_rtc.py): device code only, no system headers */
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#else
#include <cuda_runtime.h>
#include <math.h>

#include "../csrc/cuda_check.h"
#endif
#include "../csrc/fattn.h"

#define DEV static __device__ __forceinline__

DEV float to_f32(float x) { return x; }
DEV float to_f32(__half x) { return __half2float(x); }
DEV float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

DEV void from_f32(float *dst, float x) { *dst = x; }
DEV void from_f32(__half *dst, float x) { *dst = __float2half_rn(x); }
DEV void from_f32(__nv_bfloat16 *dst, float x) { *dst = __float2bfloat16_rn(x); }

DEV float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

DEV float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Base pointers of head (b, h) of q and o, and of its kv head. */
#define HEAD_OFFSETS(p, b, h)                                                                                  \
    const int64_t hk_ = (h) / (p).h_per_kv;                                                                    \
    const int64_t q_off = (b) * (p).q_stride_b + (h) * (p).q_stride_h;                                         \
    const int64_t k_off = (b) * (p).k_stride_b + hk_ * (p).k_stride_h;                                         \
    const int64_t v_off = (b) * (p).v_stride_b + hk_ * (p).v_stride_h;                                         \
    const int64_t o_off = (b) * (p).o_stride_b + (h) * (p).o_stride_h

/* The softcap in log2 units: a score S2 = s log2(e) becomes cap2 tanh(S2 / cap2), cap2 = c log2(e) (c tanh(s / c)). */
DEV float softcap2(float s2, float cap2) { return cap2 * tanhf(s2 / cap2); }

/* The same for the backward: the capped score, with *dcap = d(capped) / d(s2) = 1 - tanh^2 (1 when cap2 <= 0: no cap). */
DEV float softcap2_grad(float s2, float cap2, float *dcap) {
    if (!(cap2 > 0.f)) {
        *dcap = 1.f;
        return s2;
    }
    const float t = tanhf(s2 / cap2);
    *dcap = 1.f - t * t;
    return t * cap2;
}

/* Natural-log LSE from the base-2 running max and sum; -inf for a row that saw no key. */
DEV float lse_from(float m_log2, float l) { return l > 0.f ? (m_log2 + __log2f(l)) * FATTN_LN2 : -INFINITY; }

#endif
