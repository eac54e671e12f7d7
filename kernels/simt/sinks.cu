/* sinks.cu -- attention sinks on the GPU (csrc/sinks.h): the forward's rescale, one warp per row; the backward's
 * dsinks, one block per head summing its rows in a fixed order (bitwise repeatable). */
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
