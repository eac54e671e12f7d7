/* v3_bwd_convert.cuh -- the last pass of v3's backward (v3_bwd.cu): dQ = scale * dq_accum in the dtype, from the
 * tile layouts the dK/dV kernels add into (v3_bwd_ring.cuh: v3_dq_index).  v3_bwd_convert reads 64 x 64 tiles,
 * v3_bwd_convert_t the dQ^T tiles of the Br = 80 row (80 rows x 64 columns).  wait_blocks > 0 (the launcher's rule,
 * v3_bwd.cu): launched beside the dK/dV kernel's last blocks, a block first waits until its group (b, kv head) has
 * counted wait_blocks dK/dV blocks done (v3_bwd_ring.cuh: v3b_done). */
#ifndef FATTN_V3_BWD_CONVERT_CUH
#define FATTN_V3_BWD_CONVERT_CUH

#include "v3_bwd_ring.cuh"

/* Launched behind the dK/dV kernel as its programmatic dependent (wait_blocks > 0: v3b_wait_done), the convert grid
 * could complete before the dK/dV kernel's last dK / dV stores: its first block waits for that grid at its end, so
 * the work queued after convert still runs after both. */
DEV void v3b_convert_done(int wait_blocks) {
    if (wait_blocks && blockIdx.x == 0 && threadIdx.x == 0) griddep_wait();
}

/* dQ = scale * dq_accum in the dtype, rows < Sq, columns < d: a block of 128 threads per 64 x 64 tile of dq_accum,
 * read in v3_dq_index's order (thread tid its own float4s, coalesced), turned row-major in shared memory, and written
 * as 16-byte stores, eight threads to a 128-byte row (the planner: dq 16-byte aligned, strides a multiple of 8
 * elements, d a multiple of 8).  Deterministic mode stores each tile's first add instead of zeroing the accumulator,
 * so a tile no key block added to (rows that see no key) is unwritten there: its counter is 0, and its dQ is 0; at
 * head dim 256 a tile's adds alternate between the workspace's two copies (v3_bwd_wide.cu), summed here in copy
 * order, each if its counter says it was written. */
template <typename T, int DP, bool SEQ>
__global__ void __launch_bounds__(128) v3_bwd_convert(const attn_bwd_params all, const int wait_blocks) {
    __shared__ float tile[64][72]; /* 72: the float2 stores of a half-warp (4 rows x 4 threads) hit distinct banks */
    const int64_t nrb = (all.fwd.sq + 63) / 64, rb = (blockIdx.x / (DP / 64)) % nrb, bh = blockIdx.x / (DP / 64) / nrb;
    /* SEQ (a packed batch): sequence bh / h's params alone (its dQ rows, its length, its workspace rows) */
    attn_bwd_params seq;
    if (SEQ) fattn_seq_bwd_params(&all, bh / all.fwd.h, &seq);
    const attn_bwd_params &p = SEQ ? seq : all;
    const attn_params &f = p.fwd;
    if (SEQ && rb * 64 >= f.sq) return; /* past its sequence's rows */
    const int panel = (int)(blockIdx.x % (DP / 64)), tid = threadIdx.x;
    if (!SEQ && wait_blocks) v3b_wait_done(p, bh / f.h_per_kv, wait_blocks);
    /* the tile as the dK/dV kernel numbered it: from p's workspace pointers (a sequence's: moved by its rows) */
    const int64_t t = v3_dq_tile<DP>(SEQ ? bh % f.h : bh, p.ws_rows, rb * 64, panel);
    const int G = DP == 256 && !SEQ ? p.dq_copies : 1; /* (v3_bwd_wide.cu: the wide kernel's copies) */
    const bool added = !p.deterministic || p.dq_sem[v3_dq_copy(t, G, 0)] > 0;
    const bool added2 = G > 1 && p.dq_sem[v3_dq_copy(t, G, 1)] > 0; /* (deterministic mode only) */
    const float *src = p.dq_accum + 4096 * v3_dq_copy(t, G, 0);
    const int row = (tid / 32) * 16 + (tid % 32) / 4;
#pragma unroll
    for (int v4 = 0; v4 < 8; v4++) {
        float4 x = added ? *(const float4 *)(src + v3_dq_index(tid, 4 * v4)) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (added2) {
            const float4 y = *(const float4 *)(src + 4096 + v3_dq_index(tid, 4 * v4));
            x = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
        }
        const int col = 8 * v4 + 2 * (tid % 4);
        *(float2 *)&tile[row][col] = make_float2(x.x, x.y);
        *(float2 *)&tile[row + 8][col] = make_float2(x.z, x.w);
    }
    __syncthreads();
    T *out = (T *)p.dq + (SEQ ? 0 : (bh / f.h) * p.dq_stride_b) + (bh % f.h) * p.dq_stride_h;
    const float s = f.scale;
#pragma unroll
    for (int c = tid; c < 64 * 8; c += 128) { /* 8 columns each */
        const int r = c / 8, col = (c % 8) * 8;
        const int64_t i = rb * 64 + r;
        if (i >= f.sq || panel * 64 + col >= f.d) continue;
        const float4 a = *(const float4 *)&tile[r][col], z = *(const float4 *)&tile[r][col + 4];
        *(uint4 *)(out + i * p.dq_stride_s + panel * 64 + col) =
            make_uint4(pack2(a.x * s, a.y * s, T()), pack2(a.z * s, a.w * s, T()), pack2(z.x * s, z.y * s, T()),
                       pack2(z.z * s, z.w * s, T()));
    }
    v3b_convert_done(wait_blocks);
}

/* dQ = scale * dq_accum for the dQ^T tiles (DQ_SWAP, D=128): a block of 128 threads per BR rows and 64 columns
 * (panel) of a (b, h), read in v3_dq_index's order -- thread tid's element i is column 16 (tid / 32) + (tid % 32) / 4
 * + 8 ((i >> 1) & 1), row 8 (i / 4) + 2 (tid % 4) + (i & 1): the accumulator of dQ^T -- turned row-major in shared
 * memory and written as 16-byte stores, eight threads to a 128-byte row.  Deterministic mode: a tile no key block
 * added to (its counter, at its offset / (64 BR), is 0) was never written, and its dQ is 0. */
template <typename T, int BR>
__global__ void __launch_bounds__(128) v3_bwd_convert_t(const attn_bwd_params p, const int wait_blocks) {
    constexpr int DP = 128;
    __shared__ float tile[BR][68]; /* 68: a warp's stores (rows 2 (tid % 4) + .., columns (tid % 32) / 4 + ..) hit
                                      distinct banks */
    const attn_params &f = p.fwd;
    const int64_t nrb = (f.sq + BR - 1) / BR, rb = (blockIdx.x / 2) % nrb, bh = blockIdx.x / 2 / nrb;
    const int panel = (int)(blockIdx.x % 2), tid = threadIdx.x;
    if (wait_blocks) v3b_wait_done(p, bh / f.h_per_kv, wait_blocks);
    const int64_t off = (bh * p.ws_rows + rb * BR) * DP + panel * 64 * BR;
    const bool added = !p.deterministic || p.dq_sem[off / (64 * BR)] > 0;
    const float *src = p.dq_accum + off;
    const int col = 16 * (tid / 32) + (tid % 32) / 4, row = 2 * (tid % 4);
#pragma unroll
    for (int v4 = 0; v4 < BR / 8; v4++) {
        const float4 x = added ? *(const float4 *)(src + v3_dq_index(tid, 4 * v4)) : make_float4(0.f, 0.f, 0.f, 0.f);
        tile[8 * v4 + row][col] = x.x;
        tile[8 * v4 + row + 1][col] = x.y;
        tile[8 * v4 + row][col + 8] = x.z;
        tile[8 * v4 + row + 1][col + 8] = x.w;
    }
    __syncthreads();
    T *out = (T *)p.dq + (bh / f.h) * p.dq_stride_b + (bh % f.h) * p.dq_stride_h;
    const float s = f.scale;
#pragma unroll
    for (int c = tid; c < BR * 8; c += 128) { /* 8 columns each */
        const int r = c / 8, cc = (c % 8) * 8;
        const int64_t i = rb * BR + r;
        if (i >= f.sq || panel * 64 + cc >= f.d) continue;
        const float4 a = *(const float4 *)&tile[r][cc], z = *(const float4 *)&tile[r][cc + 4];
        *(uint4 *)(out + i * p.dq_stride_s + panel * 64 + cc) =
            make_uint4(pack2(a.x * s, a.y * s, T()), pack2(a.z * s, a.w * s, T()), pack2(z.x * s, z.y * s, T()),
                       pack2(z.z * s, z.w * s, T()));
    }
    v3b_convert_done(wait_blocks);
}

#endif
