/* v1_tiled.cu -- version 1: tiled scalar FlashAttention with online softmax in shared memory.
 *
 * A block of V1_WARPS warps owns Br = V1_BR query rows of one (b, h); each warp owns Br / V1_WARPS rows.  The
 * block walks the visible keys in tiles of Bc = 32 (one key per lane): K_j and V_j are staged in shared memory as
 * float32 (K padded by one word per row: conflict-free column reads), then each warp computes
 *   S = Q K_j^T       lane c holds S[r][c] for its rows r
 *   m' = max(m, warp_max(S)),  P = exp2(S - m'),  l = alpha*l + P (kept per lane, summed once at the end)
 *   acc = alpha*acc + P V_j    lane holds acc[r][e] for e = lane + 32*t
 * with P passed through shared memory.  Two __syncthreads per tile (stage, then release), warp shuffles for the
 * row max.  Head dims are bucketed at compile time (DMAX 64 / 128 / 256); any multiple of 8 up to 256 works.
 * Causal blocks stop at the last visible key of their last row; blocks are issued last-query-block first.
 * Speed (H100, evidence/bench/h100_v0v1_fa3.json): 4-20 TFLOP/s on the fa3 grid, CUDA cores only.
 */
#include "common.cuh"

#define V1_BR 32
#define V1_BC 32
#define V1_WARPS 4
#define V1_RW (V1_BR / V1_WARPS) /* rows per warp */

static size_t v1_smem_bytes(int dmax) {
    return sizeof(float) * ((size_t)V1_BR * dmax + (size_t)V1_BC * (dmax + 1) + (size_t)V1_BC * dmax + V1_BR * V1_BC);
}

template <typename T, int DMAX>
__global__ void __launch_bounds__(V1_WARPS * 32) v1_fwd(const attn_params p) {
    constexpr int DPL = DMAX / 32; /* head-dim elements per lane in the output accumulator */
    extern __shared__ float smem[];
    float *Qs = smem;                     /* [Br][DMAX], scaled by scale_log2 */
    float *Ks = Qs + V1_BR * DMAX;        /* [Bc][DMAX + 1] */
    float *Vs = Ks + V1_BC * (DMAX + 1);  /* [Bc][DMAX] */
    float *Ps = Vs + V1_BC * DMAX;        /* [Br][Bc] */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, d = (int)p.d;
    const int64_t nqb = (p.sq + V1_BR - 1) / V1_BR, nbh = p.b * p.h;
    const int64_t bh = blockIdx.x % nbh, i0 = (nqb - 1 - blockIdx.x / nbh) * V1_BR;
    const int64_t b = bh / p.h, h = bh % p.h;
    HEAD_OFFSETS(p, b, h);
    const T *q = (const T *)p.q + q_off, *k = (const T *)p.k + k_off, *v = (const T *)p.v + v_off;

    for (int idx = tid; idx < V1_BR * DMAX; idx += V1_WARPS * 32) {
        const int r = idx / DMAX, e = idx % DMAX;
        const int64_t i = i0 + r;
        Qs[idx] = (i < p.sq && e < d) ? to_f32(q[i * p.q_stride_s + e]) * p.scale_log2 : 0.f;
    }

    float m_i[V1_RW], l_i[V1_RW], acc[V1_RW][DPL];
    int64_t kend_r[V1_RW];
#pragma unroll
    for (int rr = 0; rr < V1_RW; rr++) {
        m_i[rr] = -INFINITY;
        l_i[rr] = 0.f;
        kend_r[rr] = fattn_row_kend(&p, i0 + warp * V1_RW + rr);
#pragma unroll
        for (int t = 0; t < DPL; t++) acc[rr][t] = 0.f;
    }
    const int64_t i_last = (i0 + V1_BR < p.sq ? i0 + V1_BR : p.sq) - 1;
    const int64_t kend = fattn_row_kend(&p, i_last); /* no row of the block sees past this key */

    for (int64_t j0 = 0; j0 < kend; j0 += V1_BC) {
        __syncthreads(); /* previous tile fully consumed */
        for (int idx = tid; idx < V1_BC * DMAX; idx += V1_WARPS * 32) {
            const int c = idx / DMAX, e = idx % DMAX;
            const int64_t j = j0 + c;
            const bool in = j < kend && e < d;
            Ks[c * (DMAX + 1) + e] = in ? to_f32(k[j * p.k_stride_s + e]) : 0.f;
            Vs[c * DMAX + e] = in ? to_f32(v[j * p.v_stride_s + e]) : 0.f;
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
            const float sv = (j0 + lane < kend_r[rr]) ? s[rr] : -INFINITY;
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
static unsigned long long v1_smem_set[3][3]; /* bit per device: opt-in to > 48 KB of shared memory done */

extern "C" fattn_status fattn_check_v1(const attn_params *p) { /* runs every dtype, alignment and shape */
    (void)p;
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_v1(const attn_params *p, void *stream) {
    const int64_t nqb = (p->sq + V1_BR - 1) / V1_BR, blocks = nqb * p->b * p->h;
    if (blocks == 0) return FATTN_OK;
    if (blocks > 0x7fffffff) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v1: grid of %lld blocks is too large", (long long)blocks);
    const int di = p->d <= 64 ? 0 : p->d <= 128 ? 1 : 2;
    const v1_kernel kern = v1_kernels[p->dtype][di];
    const size_t smem = v1_smem_bytes(v1_dmax[di]);
    int dev = 0;
    FATTN_CUDA_CHECK(cudaGetDevice(&dev));
    if (smem > 48 * 1024 && !(v1_smem_set[p->dtype][di] >> dev & 1)) {
        FATTN_CUDA_CHECK(cudaFuncSetAttribute((const void *)kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        v1_smem_set[p->dtype][di] |= 1ull << dev;
    }
    void *args[] = {(void *)p};
    FATTN_CUDA_CHECK(cudaLaunchKernel((const void *)kern, dim3((unsigned)blocks), dim3(V1_WARPS * 32), args, smem,
                                (cudaStream_t)stream));
    return FATTN_OK;
}
