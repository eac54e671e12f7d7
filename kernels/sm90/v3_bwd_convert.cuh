/* v3_bwd_convert.cuh -- the last step of v3's backward (v3_bwd.cu): dQ = scale * dq_accum in the dtype, from the
 * tile layouts the dK/dV kernels add into (v3_bwd_ring.cuh: v3_dq_index).  Tiles are 64 rows x 64 columns, or (dQ^T,
 * the Br = 80 row) 80 rows x 64 columns.  Either a pass of its own after the dK/dV kernel (v3_bwd_convert,
 * v3_bwd_convert_t: a block of 128 threads per tile), or, in default mode where a kv head's dQ is small, inside the
 * dK/dV kernel: the block whose count completes a kv head converts its query heads' tiles (v3_bwd.cu). */
#ifndef FATTN_V3_BWD_CONVERT_CUH
#define FATTN_V3_BWD_CONVERT_CUH

#include "v3_bwd_ring.cuh"

/* A staging tile: ROWS rows of floats, PITCH apart -- 72 for 64-row tiles (the float2 stores of a half-warp, 4 rows
 * x 4 threads, hit distinct banks), 68 for dQ^T's (a warp's stores, rows 2 (tid % 4) + .., columns (tid % 32) / 4 +
 * .., hit distinct banks). */
template <int ROWS> struct v3b_dq_stage {
    static constexpr int PITCH = ROWS == 64 ? 72 : 68, FLOATS = ROWS * PITCH;
};

/* One tile of dQ: its floats in dq_accum; whether it was added to at all (deterministic mode stores each tile's
 * first add instead of zeroing the accumulator, so a tile no key block added to -- rows that see no key -- is
 * unwritten there, its counter 0, and its dQ 0); its first element in dQ, the row stride, and the rows (<= ROWS)
 * and columns (<= 64) to write. */
template <typename T> struct v3b_dq_ref {
    const float *src;
    T *out;
    int64_t stride;
    int rows, cols;
    bool added;
};

/* The tile of row block rb (ROWS rows) and 64-column panel of (b, h) in p (a packed batch's sequence: its own params,
 * b = 0).  ROWS = 64: tile v3_dq_tile's 4096 floats and counter; else (dQ^T) rows rb ROWS + [0, ROWS) of (b, h),
 * DP floats each, the panels' ROWS x 64 tiles side by side, its counter at its offset / (64 ROWS).  rows <= 0: the
 * tile lies past Sq. */
template <typename T, int DP, int ROWS>
DEV v3b_dq_ref<T> v3b_dq_ref_of(const attn_bwd_params &p, int64_t b, int64_t h, int64_t rb, int panel) {
    const attn_params &f = p.fwd;
    int64_t off, sem;
    if constexpr (ROWS == 64) {
        sem = v3_dq_tile<DP>(b * f.h + h, p.ws_rows, rb * 64, panel);
        off = 4096 * sem;
    } else {
        off = ((b * f.h + h) * p.ws_rows + rb * ROWS) * DP + panel * 64 * ROWS;
        sem = off / (64 * ROWS);
    }
    v3b_dq_ref<T> r;
    r.src = p.dq_accum + off;
    r.stride = p.dq_stride_s;
    r.out = (T *)p.dq + b * p.dq_stride_b + h * p.dq_stride_h + rb * ROWS * r.stride + panel * 64;
    const int64_t rows = f.sq - rb * ROWS;
    r.rows = rows < ROWS ? (int)rows : ROWS;
    r.cols = f.d - panel * 64 < 64 ? f.d - panel * 64 : 64;
    r.added = !p.deterministic || p.dq_sem[sem] > 0;
    return r;
}

/* dQ = scale * dq_accum for the first n of NB tiles at once, by 128 threads (tid; bar: a named barrier of those 128,
 * 0 where they are the block) with NB staging tiles at stage: every tile's floats read in v3_dq_index's order
 * (thread tid its own float4s, coalesced, from L2: inside the dK/dV kernel other blocks added them there), turned
 * row-major in shared memory, and written as 16-byte stores, eight threads to a 128-byte row (the planner: dq
 * 16-byte aligned, strides a multiple of 8 elements, d a multiple of 8).  discard: once read, the tiles' lines are
 * dropped from L2 (no write-back of sums nothing reads again).  The caller joins the 128 again before it reuses the
 * staging tiles. */
template <typename T, int ROWS, int NB>
DEV void v3b_convert_tiles(const v3b_dq_ref<T> (&ref)[NB], int n, float scale, int tid, float *stage, int bar,
                           bool discard) {
    constexpr int PITCH = v3b_dq_stage<ROWS>::PITCH, V4 = ROWS / 8; /* float4s a thread */
    float4 x[NB][V4];
#pragma unroll
    for (int k = 0; k < NB; k++)
#pragma unroll
        for (int v4 = 0; v4 < V4; v4++)
            x[k][v4] = k < n && ref[k].added ? __ldcg((const float4 *)(ref[k].src + v3_dq_index(tid, 4 * v4)))
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < NB; k++) {
        float *tile = stage + k * v3b_dq_stage<ROWS>::FLOATS;
#pragma unroll
        for (int v4 = 0; v4 < V4; v4++) {
            if constexpr (ROWS == 64) { /* rows 16 (tid / 32) + (tid % 32) / 4 (+ 8), columns 8 v4 + 2 (tid % 4) */
                const int row = (tid / 32) * 16 + (tid % 32) / 4, col = 8 * v4 + 2 * (tid % 4);
                *(float2 *)&tile[row * PITCH + col] = make_float2(x[k][v4].x, x[k][v4].y);
                *(float2 *)&tile[(row + 8) * PITCH + col] = make_float2(x[k][v4].z, x[k][v4].w);
            } else { /* dQ^T's accumulator: element i is column 16 (tid / 32) + (tid % 32) / 4 + 8 ((i >> 1) & 1),
                      * row 8 (i / 4) + 2 (tid % 4) + (i & 1) */
                const int col = 16 * (tid / 32) + (tid % 32) / 4, row = 8 * v4 + 2 * (tid % 4);
                tile[row * PITCH + col] = x[k][v4].x;
                tile[(row + 1) * PITCH + col] = x[k][v4].y;
                tile[row * PITCH + col + 8] = x[k][v4].z;
                tile[(row + 1) * PITCH + col + 8] = x[k][v4].w;
            }
        }
    }
    named_barrier_sync(bar, 128);
    if (discard) { /* every thread's reads have returned: a tile's 2 ROWS lines of 128 bytes */
#pragma unroll
        for (int k = 0; k < NB; k++)
            if (k < n && ref[k].added)
                for (int l = tid; l < 2 * ROWS; l += 128) l2_discard(ref[k].src + 32 * l);
    }
#pragma unroll
    for (int k = 0; k < NB; k++) {
        if (k >= n) break;
        const float *tile = stage + k * v3b_dq_stage<ROWS>::FLOATS;
#pragma unroll
        for (int c = tid; c < ROWS * 8; c += 128) { /* 8 columns each */
            const int r = c / 8, col = (c % 8) * 8;
            if (r >= ref[k].rows || col >= ref[k].cols) continue;
            const float4 a = *(const float4 *)&tile[r * PITCH + col], z = *(const float4 *)&tile[r * PITCH + col + 4];
            *(uint4 *)(ref[k].out + r * ref[k].stride + col) =
                make_uint4(pack2(a.x * scale, a.y * scale, T()), pack2(a.z * scale, a.w * scale, T()),
                           pack2(z.x * scale, z.y * scale, T()), pack2(z.z * scale, z.w * scale, T()));
        }
    }
}

/* The pass: a block of 128 threads per ROWS x 64 tile, blocks numbered (b h, row block, panel) with panels fastest.
 * SEQ (a packed batch, 64-row tiles): sequence b's params alone; its rows past its length have no tiles. */
template <typename T, int DP, int ROWS, bool SEQ>
DEV void v3b_convert_block(const attn_bwd_params &all) {
    __shared__ float stage[v3b_dq_stage<ROWS>::FLOATS];
    constexpr int PANELS = DP / 64;
    const int64_t nrb = (all.fwd.sq + ROWS - 1) / ROWS, rb = (blockIdx.x / PANELS) % nrb;
    const int64_t bh = blockIdx.x / PANELS / nrb;
    attn_bwd_params seq;
    if (SEQ) fattn_seq_bwd_params(&all, bh / all.fwd.h, &seq);
    const attn_bwd_params &p = SEQ ? seq : all;
    const v3b_dq_ref<T> ref[1] = {v3b_dq_ref_of<T, DP, ROWS>(p, SEQ ? 0 : bh / p.fwd.h, bh % p.fwd.h, rb,
                                                             (int)(blockIdx.x % PANELS))};
    if (ref[0].rows <= 0) return; /* past its sequence's rows */
    v3b_convert_tiles<T, ROWS, 1>(ref, 1, p.fwd.scale, threadIdx.x, stage, 0, false);
}

template <typename T, int DP, bool SEQ> __global__ void __launch_bounds__(128) v3_bwd_convert(const attn_bwd_params p) {
    v3b_convert_block<T, DP, 64, SEQ>(p);
}

/* dQ^T's tiles (DQ_SWAP, D=128): BR rows by 64 columns. */
template <typename T, int BR> __global__ void __launch_bounds__(128) v3_bwd_convert_t(const attn_bwd_params p) {
    v3b_convert_block<T, 128, BR, false>(p);
}

#endif
