/* v1_fwd.cu -- version 1: tiled scalar FlashAttention with online softmax in shared memory.
 *
 * A block of V1_WARPS warps owns Br = V1_BR query rows of one (b, h); each warp owns Br / V1_WARPS rows.  The
 * block walks the visible keys in tiles of Bc = 32 (one key per lane): K_j and V_j are staged in shared memory as
 * float32 (K padded by one word per row: conflict-free column reads), then each warp computes
 *   S = Q K_j^T       lane c holds S[r][c] for its rows r
 *   m' = max(m, warp_max(S)),  P = exp2(S - m'),  l = alpha*l + P (kept per lane, summed once at the end)
 *   acc = alpha*acc + P V_j    lane holds acc[r][e] for e = lane + 32*t
 * with P passed through shared memory.  Two __syncthreads per tile (stage, then release), warp shuffles for the
 * row max.  Head dims are bucketed at compile time (DMAX 64 / 128 / 256); any multiple of 8 up to 256 works.
 * A block visits only the key tiles its rows see (mask.h); blocks are issued last-query-block first.  A block first
 * takes its sequence's params (fattn_seq_params: dense, packed varlen, or a cache's used keys, paged or not);
 * softcap and ALiBi in place.
 * Speed (H100, evidence/bench/h100_v0v1_fa3.json): 4-20 TFLOP/s on the fa3 grid, CUDA cores only.
 */
#include "../common.cuh"
#include "simt.h"

#ifndef __CUDACC_RTC__
#include "../../csrc/variants.h"
#endif

template <typename T, int DMAX>
__global__ void __launch_bounds__(V1_WARPS * 32) v1_fwd(const attn_params all) {
    constexpr int DPL = DMAX / 32; /* head-dim elements per lane in the output accumulator */
    extern __shared__ float smem[];
    float *Qs = smem;                     /* [Br][DMAX], scaled by scale_log2 */
    float *Ks = Qs + V1_BR * DMAX;        /* [Bc][DMAX + 1] */
    float *Vs = Ks + V1_BC * (DMAX + 1);  /* [Bc][DMAX] */
    float *Ps = Vs + V1_BC * DMAX;        /* [Br][Bc] */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, d = (int)all.d;
    const int64_t nqb = (all.sq + V1_BR - 1) / V1_BR, nbh = all.b * all.h;
    const int64_t bh = blockIdx.x % nbh, i0 = (nqb - 1 - blockIdx.x / nbh) * V1_BR;
    const int64_t b = 0, h = bh % all.h;
    attn_params p; /* sequence bh / h alone (fattn_seq_params) */
    fattn_seq_params(&all, bh / all.h, &p);
    if (i0 >= p.sq) return; /* a shorter sequence of a varlen batch */
    HEAD_OFFSETS(p, b, h);
    const T *q = (const T *)p.q + q_off, *k = (const T *)p.k + k_off, *v = (const T *)p.v + v_off;

    for (int idx = tid; idx < V1_BR * DMAX; idx += V1_WARPS * 32) {
        const int r = idx / DMAX, e = idx % DMAX;
        const int64_t i = i0 + r;
        Qs[idx] = (i < p.sq && e < d) ? to_f32(q[i * p.q_stride_s + e]) * p.scale_log2 : 0.f;
    }

    float m_i[V1_RW], l_i[V1_RW], acc[V1_RW][DPL];
    int64_t lo_r[V1_RW], hi_r[V1_RW]; /* keys [lo, hi) each of the warp's rows sees */
#pragma unroll
    for (int rr = 0; rr < V1_RW; rr++) {
        m_i[rr] = -INFINITY;
        l_i[rr] = 0.f;
        fattn_row_keys(&p.mask, p.sq, p.sk, i0 + warp * V1_RW + rr, &lo_r[rr], &hi_r[rr]);
#pragma unroll
        for (int t = 0; t < DPL; t++) acc[rr][t] = 0.f;
    }
    const float slope2 = fattn_alibi_slope2(&p, b, h);
    const fattn_span span = fattn_key_span(&p.mask, p.sq, p.sk, i0, V1_BR, V1_BC);
    const int64_t kend = span.k_end; /* no row of the block sees key kend or later */

    for (int64_t j0 = span.n_min * V1_BC; j0 < span.n_max * V1_BC; j0 += V1_BC) {
        __syncthreads(); /* previous tile fully consumed */
        for (int idx = tid; idx < V1_BC * DMAX; idx += V1_WARPS * 32) {
            const int c = idx / DMAX, e = idx % DMAX;
            const int64_t j = j0 + c;
            const bool in = j < kend && e < d;
            Ks[c * (DMAX + 1) + e] = in ? to_f32(k[fattn_key_offset(&p, j, p.k_stride_b, p.k_stride_s) + e]) : 0.f;
            Vs[c * DMAX + e] = in ? to_f32(v[fattn_key_offset(&p, j, p.v_stride_b, p.v_stride_s) + e]) : 0.f;
        }
        __syncthreads();

        /* S = Q K_j^T: lane = key */
        float s[V1_RW];
#pragma unroll
        for (int rr = 0; rr < V1_RW; rr++) s[rr] = 0.f;
        const float *kc = Ks + lane * (DMAX + 1);
        for (int e = 0; e < DMAX; e += 4) {
            const float k0 = kc[e], k1 = kc[e + 1], k2 = kc[e + 2], k3 = kc[e + 3];
#pragma unroll
            for (int rr = 0; rr < V1_RW; rr++) {
                const float4 qv = *(const float4 *)(Qs + (warp * V1_RW + rr) * DMAX + e);
                s[rr] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
            }
        }
        /* online softmax, P into shared memory */
#pragma unroll
        for (int rr = 0; rr < V1_RW; rr++) {
            if (p.softcap > 0.f) s[rr] = softcap2(s[rr], p.softcap * FATTN_LOG2E);
            if (p.alibi_slopes) s[rr] += fattn_alibi_bias2(slope2, i0 + warp * V1_RW + rr + p.sk - p.sq, j0 + lane);
            const float sv = (j0 + lane >= lo_r[rr] && j0 + lane < hi_r[rr]) ? s[rr] : -INFINITY;
            const float m_new = fmaxf(m_i[rr], warp_max(sv));
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            const float pv = exp2f(sv - m_use), alpha = exp2f(m_i[rr] - m_use);
            l_i[rr] = l_i[rr] * alpha + pv;
            m_i[rr] = m_new;
#pragma unroll
            for (int t = 0; t < DPL; t++) acc[rr][t] *= alpha;
            Ps[(warp * V1_RW + rr) * V1_BC + lane] = pv;
        }
        __syncwarp();
        /* acc += P V_j: lane = head-dim column */
        for (int c = 0; c < V1_BC; c += 4) {
            float4 pr[V1_RW];
#pragma unroll
            for (int rr = 0; rr < V1_RW; rr++) pr[rr] = *(const float4 *)(Ps + (warp * V1_RW + rr) * V1_BC + c);
#pragma unroll
            for (int cc = 0; cc < 4; cc++) {
                float vv[DPL];
#pragma unroll
                for (int t = 0; t < DPL; t++) vv[t] = Vs[(c + cc) * DMAX + lane + 32 * t];
#pragma unroll
                for (int rr = 0; rr < V1_RW; rr++) {
                    const float pc = cc == 0 ? pr[rr].x : cc == 1 ? pr[rr].y : cc == 2 ? pr[rr].z : pr[rr].w;
#pragma unroll
                    for (int t = 0; t < DPL; t++) acc[rr][t] += pc * vv[t];
                }
            }
        }
    }

    T *o = (T *)p.o + o_off;
#pragma unroll
    for (int rr = 0; rr < V1_RW; rr++) {
        const int64_t i = i0 + warp * V1_RW + rr;
        const float l = warp_sum(l_i[rr]);
        if (i >= p.sq) continue;
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int t = 0; t < DPL; t++) {
            const int e = lane + 32 * t;
            if (e < d) from_f32(&o[i * p.o_stride_s + e], acc[rr][t] * inv);
        }
        if (p.lse && lane == 0) p.lse[b * p.lse_stride_b + h * p.lse_stride_h + i] = lse_from(m_i[rr], l);
    }
}

typedef void (*v1_kernel)(const attn_params);
#define V1_ROW(T) {v1_fwd<T, 64>, v1_fwd<T, 128>, v1_fwd<T, 256>}
static const v1_kernel v1_kernels[3][3] = {V1_ROW(float), V1_ROW(__half), V1_ROW(__nv_bfloat16)}; /* [dtype][dmax] */
static const int v1_dmax[3] = {64, 128, 256};

extern "C" fattn_status fattn_prepare_v1(int device) {
    (void)device;
    for (int t = 0; t < 3; t++)
        for (int di = 0; di < 3; di++)
            if (V1_SMEM_BYTES(v1_dmax[di]) > 48 * 1024)
                FATTN_CUDA_CHECK(cudaFuncSetAttribute((const void *)v1_kernels[t][di],
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      (int)V1_SMEM_BYTES(v1_dmax[di])));
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_v1(const attn_params *p, const fattn_plan *plan, void *stream) {
    const int di = p->d <= 64 ? 0 : p->d <= 128 ? 1 : 2;
    void *args[] = {(void *)p};
    FATTN_CUDA_CHECK(cudaLaunchKernel((const void *)v1_kernels[p->dtype][di], dim3(plan->grid_x), dim3(plan->threads),
                                      args, plan->smem, (cudaStream_t)stream));
    return FATTN_OK;
}
