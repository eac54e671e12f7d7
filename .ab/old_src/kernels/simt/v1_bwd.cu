/* v1_bwd.cu -- the scalar backward: dQ, dK, dV on CUDA cores, the correctness baseline of every GPU backward.
 *
 * Three kernels, no atomics (so the result is bitwise repeatable, deterministic or not):
 *   v1_dpsum   a warp per query row:  D_i = rowsum(dO_i * O_i) into the workspace (dpsum)
 *   v1_dq      a block per tile of V1B_T query rows of one (b, h); walks the key tiles the rows see.  Per tile K_j,
 *              V_j (float32 in shared memory), lane = key:  S = Q K_j^T,  P = exp2(S - LSE2),  dP = dO V_j^T,
 *              dS = P (dP - D); then lane = column:  dQ += dS K_j.  dQ = scale * dQ.
 *   v1_dkdv    a block per tile of V1B_T keys of one kv head; walks the group's query heads and the query tiles that
 *              see its keys.  Per tile Q_i, dO_i, lane = query row:  P and dS as above; then lane = column:
 *              dV += P^T dO_i,  dK += dS^T Q_i.  dK = scale * dK.
 * S is recomputed twice (once per kernel): the price of having no atomics.  A softcap c maps S to c tanh(S / c) and
 * multiplies dS by 1 - tanh^2; ALiBi's bias joins S after it (no gradient of its own).  Each block first takes its
 * sequence's params (fattn_seq_bwd_params): dense or packed variable-length batches alike.  Every dtype (float32,
 * float16, bfloat16), any alignment and stride; head dims bucketed at compile time (DMAX 64 / 128 / 256, columns past d zero).
 */
#include "../common.cuh"
#include "simt.h"

#include "../../csrc/variants.h"

#define T_ V1B_T
#define PER_WARP (V1B_T / V1B_WARPS) /* rows (v1_dq) or keys (v1_dkdv) per warp */
#define THREADS (V1B_WARPS * 32)

/* LSE in base 2 for P = exp2(S2 - LSE2); a row that sees no key (LSE = -inf) gets +inf, so its P is 0, not NaN. */
DEV float lse2_of(float lse) { return lse == -INFINITY ? INFINITY : lse * FATTN_LOG2E; }

DEV int64_t row_of_ws(const attn_bwd_params &p, int64_t b, int64_t h, int64_t i) {
    return (b * p.fwd.h + h) * p.ws_rows + i;
}

template <typename T> __global__ void __launch_bounds__(THREADS) v1_dpsum(const attn_bwd_params all) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * V1B_WARPS + threadIdx.x / 32; /* over (b, h, i) */
    if (row >= all.fwd.b * all.fwd.h * all.fwd.sq) return;
    const int64_t i = row % all.fwd.sq, bh = row / all.fwd.sq, h = bh % all.fwd.h, b = 0;
    attn_bwd_params p;
    fattn_seq_bwd_params(&all, bh / all.fwd.h, &p);
    if (i >= p.fwd.sq) return;
    const T *dout = (const T *)p.dout + b * p.do_stride_b + h * p.do_stride_h + i * p.do_stride_s;
    const T *o = (const T *)p.fwd.o + b * p.fwd.o_stride_b + h * p.fwd.o_stride_h + i * p.fwd.o_stride_s;
    float acc = 0.f;
    for (int64_t e = lane; e < p.fwd.d; e += 32) acc += to_f32(dout[e]) * to_f32(o[e]);
    acc = warp_sum(acc);
    if (lane == 0) p.dpsum[row_of_ws(p, b, h, i)] = acc;
}

/* Rows [0, T_) of a T_ x ld float tile from `src` (row stride `stride`), rows >= valid and columns >= d zero. */
template <typename T, int DMAX>
DEV void stage(float *dst, int ld, const T *src, int64_t stride, int64_t valid, int d, float mul) {
    for (int idx = threadIdx.x; idx < T_ * DMAX; idx += THREADS) {
        const int r = idx / DMAX, e = idx % DMAX;
        dst[r * ld + e] = (r < valid && e < d) ? to_f32(src[r * stride + e]) * mul : 0.f;
    }
}

template <typename T, int DMAX> __global__ void __launch_bounds__(THREADS) v1_dq(const attn_bwd_params all) {
    constexpr int DPL = DMAX / 32;
    extern __shared__ float smem[];
    float *Qs = smem;                   /* [T][DMAX], scaled by scale_log2 */
    float *dOs = Qs + T_ * DMAX;        /* [T][DMAX] */
    float *Ks = dOs + T_ * DMAX;        /* [T][DMAX + 1] */
    float *Vs = Ks + T_ * (DMAX + 1);   /* [T][DMAX + 1] */
    float *dSs = Vs + T_ * (DMAX + 1);  /* [T][T] */

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = (int)all.fwd.d;
    const int64_t nqt = (all.fwd.sq + T_ - 1) / T_, nbh = all.fwd.b * all.fwd.h;
    const int64_t bh = blockIdx.x % nbh, i0 = (nqt - 1 - blockIdx.x / nbh) * T_, b = 0, h = bh % all.fwd.h;
    attn_bwd_params p; /* sequence bh / h alone */
    fattn_seq_bwd_params(&all, bh / all.fwd.h, &p);
    const attn_params &f = p.fwd;
    if (i0 >= f.sq) return;
    HEAD_OFFSETS(f, b, h);
    (void)o_off;
    const T *k = (const T *)f.k + k_off, *v = (const T *)f.v + v_off;
    stage<T, DMAX>(Qs, DMAX, (const T *)f.q + q_off + i0 * f.q_stride_s, f.q_stride_s, f.sq - i0, d, f.scale_log2);
    stage<T, DMAX>(dOs, DMAX, (const T *)p.dout + b * p.do_stride_b + h * p.do_stride_h + i0 * p.do_stride_s,
                   p.do_stride_s, f.sq - i0, d, 1.f);

    float dq[PER_WARP][DPL], lse2[PER_WARP], dsum[PER_WARP];
    int64_t lo[PER_WARP], hi[PER_WARP];
#pragma unroll
    for (int rr = 0; rr < PER_WARP; rr++) {
        const int64_t i = i0 + warp * PER_WARP + rr;
        const bool in = i < f.sq;
        lse2[rr] = in ? lse2_of(f.lse[b * f.lse_stride_b + h * f.lse_stride_h + i]) : INFINITY;
        dsum[rr] = in ? p.dpsum[row_of_ws(p, b, h, i)] : 0.f;
        fattn_row_keys(&f.mask, f.sq, f.sk, i, &lo[rr], &hi[rr]);
#pragma unroll
        for (int t = 0; t < DPL; t++) dq[rr][t] = 0.f;
    }
    const float slope2 = fattn_alibi_slope2(&f, b, h);
    const fattn_span span = fattn_key_span(&f.mask, f.sq, f.sk, i0, T_, T_);
    for (int64_t j0 = span.n_min * T_; j0 < span.n_max * T_; j0 += T_) {
        __syncthreads(); /* the previous tile is consumed (and Q, dO staged on the first pass) */
        stage<T, DMAX>(Ks, DMAX + 1, k + j0 * f.k_stride_s, f.k_stride_s, span.k_end - j0, d, 1.f);
        stage<T, DMAX>(Vs, DMAX + 1, v + j0 * f.v_stride_s, f.v_stride_s, span.k_end - j0, d, 1.f);
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < PER_WARP; rr++) { /* lane = key j0 + lane */
            const int r = warp * PER_WARP + rr;
            float s = 0.f, dp = 0.f;
            for (int e = 0; e < DMAX; e++) {
                s += Qs[r * DMAX + e] * Ks[lane * (DMAX + 1) + e];
                dp += dOs[r * DMAX + e] * Vs[lane * (DMAX + 1) + e];
            }
            const int64_t j = j0 + lane;
            float dcap;
            s = softcap2_grad(s, f.softcap * FATTN_LOG2E, &dcap);
            if (f.alibi_slopes) s += fattn_alibi_bias2(slope2, i0 + r + f.sk - f.sq, j);
            const float pr = (j >= lo[rr] && j < hi[rr]) ? exp2f(s - lse2[rr]) : 0.f;
            dSs[r * T_ + lane] = pr * (dp - dsum[rr]) * dcap;
        }
        __syncwarp();
        for (int c = 0; c < T_; c++) { /* lane = column */
            float kc[DPL];
#pragma unroll
            for (int t = 0; t < DPL; t++) kc[t] = Ks[c * (DMAX + 1) + lane + 32 * t];
#pragma unroll
            for (int rr = 0; rr < PER_WARP; rr++) {
                const float ds = dSs[(warp * PER_WARP + rr) * T_ + c];
#pragma unroll
                for (int t = 0; t < DPL; t++) dq[rr][t] += ds * kc[t];
            }
        }
    }
    T *out = (T *)p.dq + b * p.dq_stride_b + h * p.dq_stride_h;
#pragma unroll
    for (int rr = 0; rr < PER_WARP; rr++) {
        const int64_t i = i0 + warp * PER_WARP + rr;
        if (i >= f.sq) continue;
#pragma unroll
        for (int t = 0; t < DPL; t++)
            if (lane + 32 * t < d) from_f32(&out[i * p.dq_stride_s + lane + 32 * t], dq[rr][t] * f.scale);
    }
}

template <typename T, int DMAX> __global__ void __launch_bounds__(THREADS) v1_dkdv(const attn_bwd_params all) {
    constexpr int DPL = DMAX / 32;
    extern __shared__ float smem[];
    float *Ks = smem;                   /* [T][DMAX] */
    float *Vs = Ks + T_ * DMAX;         /* [T][DMAX] */
    float *Qs = Vs + T_ * DMAX;         /* [T][DMAX + 1] */
    float *dOs = Qs + T_ * (DMAX + 1);  /* [T][DMAX + 1] */
    float *Ps = dOs + T_ * (DMAX + 1);  /* [key][row] */
    float *dSs = Ps + T_ * T_;          /* [key][row] */
    float *lse2s = dSs + T_ * T_, *dsums = lse2s + T_;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = (int)all.fwd.d;
    const int64_t nbh = all.fwd.b * all.fwd.h_kv;
    const int64_t bhk = blockIdx.x % nbh, j0 = (blockIdx.x / nbh) * T_, b = 0, hk = bhk % all.fwd.h_kv;
    attn_bwd_params p; /* sequence bhk / h_kv alone */
    fattn_seq_bwd_params(&all, bhk / all.fwd.h_kv, &p);
    const attn_params &f = p.fwd;
    if (j0 >= f.sk) return;
    const int64_t nk = f.sk - j0 < T_ ? f.sk - j0 : T_;
    stage<T, DMAX>(Ks, DMAX, (const T *)f.k + b * f.k_stride_b + hk * f.k_stride_h + j0 * f.k_stride_s, f.k_stride_s,
                   nk, d, 1.f);
    stage<T, DMAX>(Vs, DMAX, (const T *)f.v + b * f.v_stride_b + hk * f.v_stride_h + j0 * f.v_stride_s, f.v_stride_s,
                   nk, d, 1.f);

    float dk[PER_WARP][DPL], dv[PER_WARP][DPL];
#pragma unroll
    for (int kk = 0; kk < PER_WARP; kk++)
#pragma unroll
        for (int t = 0; t < DPL; t++) dk[kk][t] = dv[kk][t] = 0.f;

    const int64_t nqt = (f.sq + T_ - 1) / T_, key_block = j0 / T_;
    for (int64_t g = 0; g < f.h_per_kv; g++) {
        const int64_t h = hk * f.h_per_kv + g;
        const float slope2 = fattn_alibi_slope2(&f, b, h);
        for (int64_t qt = 0; qt < nqt; qt++) {
            const int64_t i0 = qt * T_;
            const fattn_span span = fattn_key_span(&f.mask, f.sq, f.sk, i0, T_, T_);
            if (key_block < span.n_min || key_block >= span.n_max) continue; /* no row of this tile sees the keys */
            __syncthreads(); /* the previous tile is consumed */
            stage<T, DMAX>(Qs, DMAX + 1, (const T *)f.q + b * f.q_stride_b + h * f.q_stride_h + i0 * f.q_stride_s,
                           f.q_stride_s, f.sq - i0, d, 1.f);
            stage<T, DMAX>(dOs, DMAX + 1, (const T *)p.dout + b * p.do_stride_b + h * p.do_stride_h + i0 * p.do_stride_s,
                           p.do_stride_s, f.sq - i0, d, 1.f);
            if (threadIdx.x < T_) {
                const int64_t i = i0 + threadIdx.x;
                lse2s[threadIdx.x] = i < f.sq ? lse2_of(f.lse[b * f.lse_stride_b + h * f.lse_stride_h + i]) : INFINITY;
                dsums[threadIdx.x] = i < f.sq ? p.dpsum[row_of_ws(p, b, h, i)] : 0.f;
            }
            __syncthreads();
            int64_t lo, hi; /* keys of row i0 + lane */
            fattn_row_keys(&f.mask, f.sq, f.sk, i0 + lane, &lo, &hi);
            const bool row_in = i0 + lane < f.sq;
#pragma unroll
            for (int kk = 0; kk < PER_WARP; kk++) { /* lane = query row i0 + lane */
                const int c = warp * PER_WARP + kk;
                float s = 0.f, dp = 0.f;
                for (int e = 0; e < DMAX; e++) {
                    s += Ks[c * DMAX + e] * Qs[lane * (DMAX + 1) + e];
                    dp += Vs[c * DMAX + e] * dOs[lane * (DMAX + 1) + e];
                }
                const int64_t j = j0 + c;
                float dcap;
                float s2 = softcap2_grad(s * f.scale_log2, f.softcap * FATTN_LOG2E, &dcap);
                if (f.alibi_slopes) s2 += fattn_alibi_bias2(slope2, i0 + lane + f.sk - f.sq, j);
                const float pr = (row_in && j >= lo && j < hi) ? exp2f(s2 - lse2s[lane]) : 0.f;
                Ps[c * T_ + lane] = pr;
                dSs[c * T_ + lane] = pr * (dp - dsums[lane]) * dcap;
            }
            __syncwarp();
            for (int r = 0; r < T_; r++) { /* lane = column */
                float qc[DPL], dc[DPL];
#pragma unroll
                for (int t = 0; t < DPL; t++) {
                    qc[t] = Qs[r * (DMAX + 1) + lane + 32 * t];
                    dc[t] = dOs[r * (DMAX + 1) + lane + 32 * t];
                }
#pragma unroll
                for (int kk = 0; kk < PER_WARP; kk++) {
                    const int c = warp * PER_WARP + kk;
                    const float pr = Ps[c * T_ + r], ds = dSs[c * T_ + r];
#pragma unroll
                    for (int t = 0; t < DPL; t++) {
                        dv[kk][t] += pr * dc[t];
                        dk[kk][t] += ds * qc[t];
                    }
                }
            }
        }
    }
    T *dko = (T *)p.dk + b * p.dk_stride_b + hk * p.dk_stride_h, *dvo = (T *)p.dv + b * p.dv_stride_b + hk * p.dv_stride_h;
#pragma unroll
    for (int kk = 0; kk < PER_WARP; kk++) {
        const int64_t j = j0 + warp * PER_WARP + kk;
        if (j >= f.sk) continue;
#pragma unroll
        for (int t = 0; t < DPL; t++) {
            const int e = lane + 32 * t;
            if (e < d) {
                from_f32(&dko[j * p.dk_stride_s + e], dk[kk][t] * f.scale);
                from_f32(&dvo[j * p.dv_stride_s + e], dv[kk][t]);
            }
        }
    }
}

typedef void (*v1b_kernel)(const attn_bwd_params);
#define V1B_ROW(K, T) {K<T, 64>, K<T, 128>, K<T, 256>}
static const v1b_kernel v1_dq_kernels[3][3] = {V1B_ROW(v1_dq, float), V1B_ROW(v1_dq, __half),
                                               V1B_ROW(v1_dq, __nv_bfloat16)}; /* [dtype][dmax] */
static const v1b_kernel v1_dkdv_kernels[3][3] = {V1B_ROW(v1_dkdv, float), V1B_ROW(v1_dkdv, __half),
                                                 V1B_ROW(v1_dkdv, __nv_bfloat16)};
static const v1b_kernel v1_dpsum_kernels[3] = {v1_dpsum<float>, v1_dpsum<__half>, v1_dpsum<__nv_bfloat16>};
static const int v1b_dmax[3] = {64, 128, 256};

extern "C" fattn_status fattn_prepare_bwd_v1(int device) {
    (void)device;
    for (int t = 0; t < 3; t++)
        for (int di = 0; di < 3; di++) {
            const int bytes = (int)V1B_SMEM_BYTES(v1b_dmax[di]);
            if (bytes <= 48 * 1024) continue;
            FATTN_CUDA_CHECK(cudaFuncSetAttribute((const void *)v1_dq_kernels[t][di],
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
            FATTN_CUDA_CHECK(cudaFuncSetAttribute((const void *)v1_dkdv_kernels[t][di],
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        }
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_bwd_v1(const attn_bwd_params *p, const fattn_plan *plan, void *stream) {
    const attn_params *f = &p->fwd;
    const int di = f->d <= 64 ? 0 : f->d <= 128 ? 1 : 2;
    const cudaStream_t s = (cudaStream_t)stream;
    void *args[] = {(void *)p};
    const int64_t rows = f->b * f->h * f->sq, qtiles = (f->sq + T_ - 1) / T_ * f->b * f->h;
    const int64_t ktiles = (f->sk + T_ - 1) / T_ * f->b * f->h_kv;
    if (rows > 0) {
        FATTN_CUDA_CHECK(cudaLaunchKernel((const void *)v1_dpsum_kernels[f->dtype],
                                          dim3((unsigned)((rows + V1B_WARPS - 1) / V1B_WARPS)), dim3(THREADS), args, 0, s));
        FATTN_CUDA_CHECK(cudaLaunchKernel((const void *)v1_dq_kernels[f->dtype][di], dim3((unsigned)qtiles),
                                          dim3(THREADS), args, plan->smem, s));
    }
    if (ktiles > 0)
        FATTN_CUDA_CHECK(cudaLaunchKernel((const void *)v1_dkdv_kernels[f->dtype][di], dim3((unsigned)ktiles),
                                          dim3(THREADS), args, plan->smem, s));
    return FATTN_OK;
}
