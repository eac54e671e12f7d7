/* sinks.cu -- attention sinks on the GPU (csrc/sinks.h): the forward's rescale, one warp per row; the backward's
 * dsinks, one block per head summing its rows in a fixed order (bitwise repeatable) -- from dO and O (the pass), or
 * from the D and LSE2 a tensor-core backward left in its workspace. */
#include "../common.cuh"

#include "../../csrc/sinks.h"
#include "cuda_check.h"

#define SINK_THREADS 256

template <typename T> __global__ void __launch_bounds__(SINK_THREADS) sinks_forward(const fattn_sink_params p) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (SINK_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= p.b * p.h * p.s) return;
    const int64_t i = row % p.s, h = row / p.s % p.h, b = row / (p.s * p.h);
    float *l = p.lse + b * p.lse_sb + h * p.lse_sh + i;
    const float lse = *l, lse2 = fattn_sink_lse(lse, p.sinks[h]);
    const float f = fattn_sink_factor(lse, p.sinks[h]);
    T *o = (T *)p.o + b * p.o_sb + h * p.o_sh + i * p.o_ss;
    for (int64_t e = lane; e < p.d; e += 32) from_f32(&o[e], to_f32(o[e]) * f);
    __syncwarp();
    if (lane == 0) *l = lse2;
}

template <typename T> __global__ void __launch_bounds__(SINK_THREADS) sinks_backward(const fattn_sink_params p) {
    __shared__ float part[SINK_THREADS / 32];
    const int64_t h = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc = 0.f;
    for (int64_t row = warp; row < p.b * p.s; row += SINK_THREADS / 32) { /* each warp a fixed set of rows */
        const int64_t b = row / p.s, i = row % p.s;
        const T *o = (const T *)p.o + b * p.o_sb + h * p.o_sh + i * p.o_ss;
        const T *g = (const T *)p.dout + b * p.do_sb + h * p.do_sh + i * p.do_ss;
        float dd = 0.f;
        for (int64_t e = lane; e < p.d; e += 32) dd += to_f32(g[e]) * to_f32(o[e]);
        for (int off = 16; off; off >>= 1) dd += __shfl_xor_sync(0xffffffffu, dd, off);
        acc += expf(p.sinks[h] - p.lse[b * p.lse_sb + h * p.lse_sh + i]) * dd;
    }
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int w = 0; w < SINK_THREADS / 32; w++) sum += part[w];
        p.dsinks[h] = -sum;
    }
}

/* dsinks from a tensor-core backward's workspace: bwd_prep left each row's D and LSE' log2 e there (rows past Sq: D = 0,
 * LSE2 = +inf; v3 permutes rows inside 64-row blocks, which a sum over all of them does not see).  One block per
 * head, its b * ws_rows rows four at a time in a fixed order (bitwise repeatable). */
__global__ void __launch_bounds__(SINK_THREADS) bwd_dsinks(const attn_bwd_params p) {
    __shared__ float part[SINK_THREADS / 32];
    const int64_t h = blockIdx.x, quads = p.ws_rows / 4; /* ws_rows: a multiple of 64 */
    const float s2 = p.fwd.sinks[h] * FATTN_LOG2E;
    float acc = 0.f;
    for (int64_t b = 0; b < p.fwd.b; b++) {
        const float4 *dd = (const float4 *)(p.dpsum + (b * p.fwd.h + h) * p.ws_rows);
        const float4 *l2 = (const float4 *)(p.lse2 + (b * p.fwd.h + h) * p.ws_rows);
#pragma unroll 4
        for (int64_t r = threadIdx.x; r < quads; r += SINK_THREADS) {
            const float4 x = dd[r], y = l2[r];
            acc += exp2f(s2 - y.x) * x.x + exp2f(s2 - y.y) * x.y + exp2f(s2 - y.z) * x.z + exp2f(s2 - y.w) * x.w;
        }
    }
    for (int off = 16; off; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int w = 0; w < SINK_THREADS / 32; w++) sum += part[w];
        p.dsinks[h] = -sum;
    }
}

extern "C" fattn_status fattn_launch_bwd_dsinks(const attn_bwd_params *p, void *stream) {
    if (p->fwd.h == 0) return FATTN_OK;
    bwd_dsinks<<<dim3((unsigned)p->fwd.h), SINK_THREADS, 0, (cudaStream_t)stream>>>(*p);
    FATTN_CUDA_CHECK(cudaGetLastError());
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_sinks(const fattn_sink_params *p, int backward, void *stream) {
    const int64_t rows = p->b * p->h * p->s;
    if (rows == 0 && !backward) return FATTN_OK;
    cudaStream_t s = (cudaStream_t)stream;
    if (backward) {
        const dim3 grid((unsigned)p->h);
        if (p->dtype == FATTN_F32) sinks_backward<float><<<grid, SINK_THREADS, 0, s>>>(*p);
        else if (p->dtype == FATTN_F16) sinks_backward<__half><<<grid, SINK_THREADS, 0, s>>>(*p);
        else sinks_backward<__nv_bfloat16><<<grid, SINK_THREADS, 0, s>>>(*p);
    } else {
        const dim3 grid((unsigned)((rows + SINK_THREADS / 32 - 1) / (SINK_THREADS / 32)));
        if (p->dtype == FATTN_F32) sinks_forward<float><<<grid, SINK_THREADS, 0, s>>>(*p);
        else if (p->dtype == FATTN_F16) sinks_forward<__half><<<grid, SINK_THREADS, 0, s>>>(*p);
        else sinks_forward<__nv_bfloat16><<<grid, SINK_THREADS, 0, s>>>(*p);
    }
    FATTN_CUDA_CHECK(cudaGetLastError());
    return FATTN_OK;
}
