/* bwd_common.cuh -- what the tensor-core backwards (v2's sm80 kernels, v3's sm90 ones) share: the preprocess kernel
 * before the dK/dV pass, LSE in base 2, the rows that see a key block; and, v2's alone, the 8-byte dQ atomic and the
 * convert kernel of its row-major dQ accumulator (v3 keeps its own tile layout and convert, v3_bwd.cu).
 * The workspace's layout (fattn.h: fattn_bwd_workspace_bytes) is the contract between them. */
#ifndef FATTN_BWD_COMMON_CUH
#define FATTN_BWD_COMMON_CUH

#include "mma.cuh"

/* One b32 of two 16-bit elements -> two floats (x = the low half). */
DEV float2 unpack2(unsigned u, __half) { return __half22float2(*(__half2 *)&u); }
DEV float2 unpack2(unsigned u, __nv_bfloat16) { return __bfloat1622float2(*(__nv_bfloat162 *)&u); }

/* dq_accum[a..a+1] += (x, y).  sm_90 has 8-byte float atomics: one red instead of two. */
DEV void red_add2(float *a, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd((float2 *)a, make_float2(x, y));
#else
    atomicAdd(a, x);
    atomicAdd(a + 1, y);
#endif
}

/* LSE in base 2 for the exponent of P; +inf for a row past Sq or one that saw no key (LSE = -inf), so that
 * P = exp2(S * scale_log2 - lse2) = 0 there whatever the sign of the scale. */
DEV float lse2_of(const float *lse, int64_t i, int64_t sq) {
    if (i >= sq) return INFINITY;
    const float l = lse[i];
    return l == -INFINITY ? INFINITY : l * FATTN_LOG2E;
}

/* ---- preprocess and convert: one group of DP / 8 lanes per row, 16 bytes per lane -------------------------------- */

/* bwd_prep's flags: zero dq_accum (its first add is an add); LSE2 and D in v3's order (below); dQ added in tiles of
 * FATTN_BWD_STEP_ROWS rows (v3's Br = 80 row), not 64; zero dQ itself (v3's kernels that add dQ in its own dtype,
 * sm90/v3_bwd_configs.h: V3_BWD_DQ_OUT). */
enum { BWD_PREP_ZERO_DQ = 1, BWD_PREP_V3_ORDER = 2, BWD_PREP_STEP_ROWS = 4, BWD_PREP_ZERO_DQ_OUT = 8 };

/* v3's order of LSE2 and D inside each 64-row block of the workspace: the rows a consumer thread reads together side
 * by side.  A thread of lane quad position t reads rows 8 j + 2 t + y (j = 0..7, y = 0, 1: wgmma's accumulator
 * columns), those of j = 2 k, 2 k + 1 at once; they sit at 16 k + 4 t + 2 (j & 1) + y, so each read is a float4 and
 * the four t's float4s are side by side: distinct banks (kernels/sm90/v3_bwd_kernel.cuh).  (At 16 t + 2 j + y,
 * t = 0 and 2 shared banks: a 2-way conflict on every read, 39.9 M in ncu at B=8 H=32 S=2k D=64.) */
DEV int64_t bwd_v3_row_pos(int64_t i) {
    const int r = (int)(i & 63), j = r >> 3;
    return (i - r) + 16 * (j >> 1) + 4 * ((r & 7) >> 1) + 2 * (j & 1) + (r & 1);
}

/* The rows of a query head's dq_accum that a backward adds into and its convert reads: those of the dQ tiles that
 * hold rows below sq (sq rounded up to 64, or to FATTN_BWD_STEP_ROWS for v3's Br = 80 tiles; a tile's floats lie
 * anywhere in its rows' span).  bwd_prep zeroes them, or (v3, zero-ahead) the dK/dV kernel does. */
DEV int64_t bwd_dq_rows(int64_t sq, bool step_rows) {
    const int64_t tile_rows = step_rows ? FATTN_BWD_STEP_ROWS : 64;
    return (sq + tile_rows - 1) / tile_rows * tile_rows;
}

/* D_i = rowsum(dO_i * O_i) and LSE_i in base 2 for the b * h * ws_rows workspace rows (0 and +inf for rows past Sq,
 * so nothing there is ever uninitialised), in row order or v3's (BWD_PREP_V3_ORDER); dQ zeroed (BWD_PREP_ZERO_DQ_OUT:
 * rows < Sq, columns < d); dq_accum zeroed when the first
 * add to it is an add (BWD_PREP_ZERO_DQ) -- bwd_dq_rows of each query head b h + h below zero_heads (the rest: v3's
 * dK/dV kernel zeroes them, v3_bwd_kernel.cuh), not the rows past them, which no convert reads --;
 * dq_sem zeroed (v3's deterministic mode counts the adds to each dQ tile; its default mode, the zero-ahead). */
template <typename T, int DP>
__global__ void __launch_bounds__(256) bwd_prep(const attn_bwd_params p, const int flags, const int64_t zero_heads) {
    constexpr int G = DP / 8, RPB = 256 / G;
    const attn_params &f = p.fwd;
    const int c = threadIdx.x % G;
    const int64_t row = (int64_t)blockIdx.x * RPB + threadIdx.x / G, nrows = f.b * f.h * p.ws_rows;
    const bool live = row < nrows;
    const int64_t bh = row / p.ws_rows, i = row % p.ws_rows, b = bh / f.h, h = bh % f.h;
    /* a packed batch: sequence b's rows start at q0 and number its own sq */
    const fattn_extent x_ = f.cu_seqlens_q && live ? fattn_extent_of(&f, b) : fattn_dense_extent(&f);
    const int64_t iq = x_.q0 + i;
    float acc = 0.f;
    if (live && i < x_.sq && c * 8 < f.d) {
        const uint4 x = *(const uint4 *)((const T *)p.dout + b * p.do_stride_b + h * p.do_stride_h + iq * p.do_stride_s + c * 8);
        const uint4 y = *(const uint4 *)((const T *)f.o + b * f.o_stride_b + h * f.o_stride_h + iq * f.o_stride_s + c * 8);
        const unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float2 a = unpack2(xs[k], T()), o = unpack2(ys[k], T());
            acc = fmaf(a.x, o.x, fmaf(a.y, o.y, acc));
        }
    }
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (!live) return;
    if (c == 0) {
        const int64_t at = flags & BWD_PREP_V3_ORDER ? bwd_v3_row_pos(row) : row; /* ws_rows: a multiple of 64 */
        p.dpsum[at] = acc;
        p.lse2[at] = i < x_.sq ? lse2_of(f.lse + b * f.lse_stride_b + h * f.lse_stride_h + x_.q0, i, x_.sq) : INFINITY;
        if (p.dq_sem) p.dq_sem[row] = 0;
    }
    if ((flags & BWD_PREP_ZERO_DQ_OUT) && i < x_.sq && c * 8 < f.d)
        *(uint4 *)((T *)p.dq + b * p.dq_stride_b + h * p.dq_stride_h + iq * p.dq_stride_s + c * 8) =
            make_uint4(0, 0, 0, 0);
    if ((flags & BWD_PREP_ZERO_DQ) && bh < zero_heads && i < bwd_dq_rows(x_.sq, flags & BWD_PREP_STEP_ROWS)) {
        float4 *z = (float4 *)(p.dq_accum + row * DP + c * 8);
        z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

/* dQ = scale * dq_accum, rows < Sq, columns < d, in the dtype. */
template <typename T, int DP>
__global__ void __launch_bounds__(256) bwd_convert(const attn_bwd_params p) {
    constexpr int G = DP / 8, RPB = 256 / G;
    const attn_params &f = p.fwd;
    const int c = threadIdx.x % G;
    const int64_t row = (int64_t)blockIdx.x * RPB + threadIdx.x / G;
    if (row >= f.b * f.h * f.sq || c * 8 >= f.d) return;
    const int64_t bh = row / f.sq, i = row % f.sq, b = bh / f.h, h = bh % f.h;
    /* a packed batch: sequence b's rows start at q0 and number its own sq */
    const fattn_extent x_ = f.cu_seqlens_q ? fattn_extent_of(&f, b) : fattn_dense_extent(&f);
    if (i >= x_.sq) return;
    const float4 *src = (const float4 *)(p.dq_accum + (bh * p.ws_rows + i) * DP + c * 8);
    const float4 x = src[0], y = src[1];
    const float s = f.scale;
    uint4 out;
    out.x = pack2(x.x * s, x.y * s, T());
    out.y = pack2(x.z * s, x.w * s, T());
    out.z = pack2(y.x * s, y.y * s, T());
    out.w = pack2(y.z * s, y.w * s, T());
    *(uint4 *)((T *)p.dq + b * p.dq_stride_b + h * p.dq_stride_h + (x_.q0 + i) * p.dq_stride_s + c * 8) = out;
}

#endif
