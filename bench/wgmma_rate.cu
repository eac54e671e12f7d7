/* wgmma_rate.cu -- how fast the tensor cores run the wgmma shapes v3's kernels issue, alone and beside other
 * shared-memory traffic: is a 64 x 64 SS product (both operands from shared memory: 4 KB per 32 clocks, the 128 bytes
 * a clock shared memory gives) held back by shared-memory bandwidth where an RS one (A from registers) or a wider
 * SS one is not?
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc bench/wgmma_rate.cu -o /tmp/wgmma_rate
 *   /tmp/wgmma_rate            # TFLOP/s per mode, one block of WGS consumer warpgroups per SM
 *
 * Each mode: 132 x 4 blocks, each consumer warpgroup issuing groups of 16 dependent wgmmas (one accumulator) and
 * waiting for each group; optionally a "noise" warpgroup storing and loading float4s to shared memory all along
 * (what the backward's dS / dQ tile traffic and TMA writes add).  Operands hold small nonzero values. */
#include <cstdio>
#include <cuda_fp16.h>

#include "../kernels/sm90/hopper.cuh"
#include "../kernels/sm90/wgmma_ops.cuh"

#define ITERS 256
#define GROUP 16

enum { SS64, RS64, SS128, RS128, SS256_N64x4 };

template <int MODE, int WGS, bool NOISE>
__global__ void __launch_bounds__(128 * (WGS + 1), 1) rate(float *sink) {
    extern __shared__ unsigned char raw[];
    __half *s = (__half *)smem_align1024(raw); /* A: 64 x 64 per warpgroup, B: 128 x 64 shared, noise: 16 KB */
    const int tid = threadIdx.x;
    for (int i = tid; i < (WGS * 64 * 64 + 2 * 128 * 64 + 8192); i += blockDim.x)
        s[i] = __float2half(((i * 2654435761u) >> 20 & 15) * 0.0625f - 0.5f);
    __syncthreads();
    const int wg = warpgroup_index();
    if (wg == WGS) { /* noise: float4 stores and loads in a 16 KB region */
        if (!NOISE) return;
        float4 *n = (float4 *)(s + WGS * 64 * 64 + 2 * 128 * 64);
        float4 acc = make_float4(0, 0, 0, 0);
        for (int it = 0; it < ITERS * 24; it++) {
            const int k = (tid + it * 128) % 1024;
            n[k] = make_float4(acc.x + 1, acc.y, acc.z, acc.w);
            acc = n[(k + 513) % 1024];
        }
        if (acc.x == 12345.f) sink[0] = acc.y;
        return;
    }
    constexpr int N = MODE == SS128 || MODE == RS128 ? 128 : 64;
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) d[i] = 0.f;
    const unsigned a_lo = desc_lo(s + wg * 64 * 64, 0), b_lo = desc_lo(s + WGS * 64 * 64, 128 * 128);
    unsigned a[4];
    for (int i = 0; i < 4; i++) a[i] = 0x3c003c00u ^ (tid * 977u + i);
    for (int it = 0; it < ITERS; it++) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < GROUP; k++) {
            const unsigned koff = ((k % 4) * 32) >> 4;
            if constexpr (MODE == SS64 || MODE == SS128) wgmma_ss<N, __half>(d, a_lo + koff, b_lo + koff, 1);
            else wgmma_rs<N, __half>(d, a, b_lo + koff, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(d);
    }
    float x = 0.f;
#pragma unroll
    for (int i = 0; i < N / 2; i++) x += d[i];
    if (x == 12345.f) sink[0] = x;
}

template <int MODE, int WGS, bool NOISE> static void run(const char *name, float *sink) {
    const size_t smem = (WGS * 64 * 64 + 2 * 128 * 64 + 8192) * 2 + 1024;
    auto k = rate<MODE, WGS, NOISE>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    const int blocks = 132 * 4;
    k<<<blocks, 128 * (WGS + 1), smem>>>(sink); /* warm-up */
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float best = 1e30f;
    for (int r = 0; r < 5; r++) {
        cudaEventRecord(e0);
        k<<<blocks, 128 * (WGS + 1), smem>>>(sink);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        best = ms < best ? ms : best;
    }
    const int n = MODE == SS128 || MODE == RS128 ? 128 : 64;
    const double flop = 2.0 * 64 * n * 16 * GROUP * ITERS * WGS * (double)blocks;
    cudaError_t err = cudaGetLastError();
    printf("%-34s %8.1f TFLOP/s  (%.3f ms)%s%s\n", name, flop / (best * 1e-3) / 1e12, best, err ? " ERROR " : "",
           err ? cudaGetErrorString(err) : "");
}

int main() {
    float *sink;
    cudaMalloc(&sink, 64);
    run<SS64, 2, false>("ss m64n64k16, 2 warpgroups", sink);
    run<RS64, 2, false>("rs m64n64k16, 2 warpgroups", sink);
    run<SS128, 2, false>("ss m64n128k16, 2 warpgroups", sink);
    run<RS128, 2, false>("rs m64n128k16, 2 warpgroups", sink);
    run<SS64, 2, true>("ss m64n64k16, 2 wg + smem noise", sink);
    run<RS64, 2, true>("rs m64n64k16, 2 wg + smem noise", sink);
    run<SS128, 2, true>("ss m64n128k16, 2 wg + smem noise", sink);
    run<RS128, 2, true>("rs m64n128k16, 2 wg + smem noise", sink);
    run<SS64, 3, false>("ss m64n64k16, 3 warpgroups", sink);
    return 0;
}
