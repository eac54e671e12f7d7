/* v0_fwd.cu -- version 0: one thread per query row.
 *
 * Each thread walks every visible key of its row once with the online softmax (m_i, l_i, acc in registers /
 * local memory): the simplest kernel that is right, the baseline every later version is checked against.
 * No shared memory, no reuse of K/V between rows: every thread streams the whole K and V of its head.
 * Each thread first takes its sequence's params (fattn_seq_params: dense, packed varlen, or a cache's used keys, paged or not).
 * Speed (H100, evidence/bench/h100_v0v1_seeds.json): 0.2-2.7 TFLOP/s on the seeds grid (K/V re-read per row).
 */
#include "../common.cuh"
#include "simt.h"

#ifndef __CUDACC_RTC__
#include "../../csrc/variants.h"
#endif

template <typename T>
__global__ void __launch_bounds__(V0_THREADS) v0_fwd(const attn_params all) {
    const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; /* over (b, h, i) */
    if (row >= all.b * all.h * all.sq) return;
    const int64_t i = row % all.sq, bh = row / all.sq, h = bh % all.h;
    attn_params p; /* sequence bh / h alone */
    fattn_seq_params(&all, bh / all.h, &p);
    if (i >= p.sq) return;
    const int64_t b = 0;
    HEAD_OFFSETS(p, b, h);
    const T *q = (const T *)p.q + q_off + i * p.q_stride_s;
    const T *k = (const T *)p.k + k_off;
    const T *v = (const T *)p.v + v_off;
    const int d = (int)p.d;

    float qs[FATTN_MAX_HEADDIM], acc[FATTN_MAX_HEADDIM];
    for (int e = 0; e < d; e++) {
        qs[e] = to_f32(q[e]) * p.scale_log2; /* S2 = q k * scale * log2(e) */
        acc[e] = 0.f;
    }
    float m_i = -INFINITY, l_i = 0.f;
    const float slope2 = fattn_alibi_slope2(&p, b, h);
    const int64_t pos = i + p.sk - p.sq; /* ALiBi's position */
    int64_t lo, hi; /* the keys this row sees */
    fattn_row_keys(&p.mask, p.sq, p.sk, i, &lo, &hi);
    for (int64_t j = lo; j < hi; j++) {
        const T *kj = k + fattn_key_offset(&p, j, p.k_stride_b, p.k_stride_s);
        const T *vj = v + fattn_key_offset(&p, j, p.v_stride_b, p.v_stride_s);
        float s = 0.f;
        for (int e = 0; e < d; e++) s += qs[e] * to_f32(kj[e]);
        if (p.softcap > 0.f) s = softcap2(s, p.softcap * FATTN_LOG2E);
        if (p.alibi_slopes) s += fattn_alibi_bias2(slope2, pos, j);
        const float m_new = fmaxf(m_i, s);
        const float alpha = exp2f(m_i - m_new), pj = exp2f(s - m_new); /* P = exp2(S2 - m) */
        l_i = l_i * alpha + pj;
        for (int e = 0; e < d; e++) acc[e] = acc[e] * alpha + pj * to_f32(vj[e]);
        m_i = m_new;
    }
    const float inv = l_i > 0.f ? 1.f / l_i : 0.f;
    T *o = (T *)p.o + o_off + i * p.o_stride_s;
    for (int e = 0; e < d; e++) from_f32(&o[e], acc[e] * inv);
    if (p.lse) p.lse[b * p.lse_stride_b + h * p.lse_stride_h + i] = lse_from(m_i, l_i);
}

typedef void (*v0_kernel)(const attn_params);
static const v0_kernel v0_kernels[] = {v0_fwd<float>, v0_fwd<__half>, v0_fwd<__nv_bfloat16>}; /* by fattn_dtype */

extern "C" fattn_status fattn_prepare_v0(int device) {
    (void)device;
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_v0(const attn_params *p, const fattn_plan *plan, void *stream) {
    void *args[] = {(void *)p};
    FATTN_CUDA_CHECK(cudaLaunchKernel((const void *)v0_kernels[p->dtype], dim3(plan->grid_x), dim3(plan->threads), args,
                                      0, (cudaStream_t)stream));
    return FATTN_OK;
}
