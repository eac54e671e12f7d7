/* v2_mma.cu -- version 2: tensor cores through mma.sync (sm_80+), the FlashAttention-2 structure.
 *
 * A block of WARPS warps owns Br = 16 * MT * WARPS query rows of one (b, h); each warp owns MT row tiles of 16,
 * so the online softmax never leaves the warp and every K/V fragment read from shared memory feeds MT MMAs.
 * Per key block K_j, V_j (Bc keys):
 *   S = Q K_j^T         mma.m16n8k16; Q fragments in registers when they fit beside S and O, else re-read by
 *                       ldmatrix; K fragments by ldmatrix from XOR-swizzled (bank-conflict-free) shared memory,
 *                       addressed as one base per operand XOR a compile-time step (swz_addr / swz_step)
 *   masked -> -inf (only in diagonal / tail blocks: unmasked blocks skip the test)
 *   m' = max(m, rowmax S) (quad shuffles),  P = exp2((S - m') * c) with c = |scale| log2 e (a negative scale
 *                       flips Q's sign bits instead, exact),  l = alpha * l + rowsum P
 *   O = alpha * O + P V_j   P re-packed from the S accumulators into A fragments (no shared memory),
 *                       V fragments by ldmatrix.trans
 * K and V stream through cp.async: STAGES = 1 interleaves them in one buffer each (V_j lands while S_j is
 * computed, K_{j+1} while P V_j is); STAGES = 2 double-buffers both, a whole block ahead.
 * Keys past the block's last visible key are zero-filled, never read (no reads past a sequence's end).
 * Head dims are bucketed at compile time (DP = 64 / 128 / 256, columns past d zero-filled); fp16 and bf16.
 * Needs 16-byte aligned q/k/v with strides a multiple of 8 elements (fattn falls back to v1 otherwise).
 * The (WARPS, MT, Bc, STAGES) configurations compiled in are the table in v2_configs.h; bench/v2_sweep.py times them;
 * any other configuration is compiled at run time by NVRTC (fattn/_rtc.py: this file with FATTN_V2_RTC and the
 * configuration as macros) for fattn.tune and the tuned-config cache.
 * Split-KV (flash-decoding): when the grid has fewer blocks than SMs (decode with a small batch), blockIdx.y splits
 * the key blocks, each split writes an fp32 partial O and its LSE, and v2_combine merges them; at (B, H) = (1, 32),
 * Sk = 8k, D = 128: 1.97 TB/s with 8 splits vs 0.71 without (evidence/bench/h100_split_sweep_fd91998.json).
 * Blocks go head by head (K/V shared in L2 by the blocks in flight) or heads fastest (longest first over all heads),
 * as v2_pick_order decides.
 * Speed (H100 80GB HBM3, evidence/bench/h100_v2_ratios_ad311e5.md): fa3 grid fp16 176-371 TFLOP/s, 0.94-1.33x torch's
 * FlashAttention-2 (>= 1.0 at 29 of 36 points; bf16 0.95-1.26x) and 0.47-0.72x torch cudnn; decode 2.60-3.11 TB/s of
 * K+V, 1.00-1.01x cudnn (h100_v2_decode_ad311e5.json).  Before the address and order work (e64432d): 0.79-1.07x.
 * Run: python -m fattn.bench --grid fa3.
 */
#include "mma.cuh"
#include "v2_configs.h"

#ifndef __CUDACC_RTC__
#include <pthread.h>
#include <string.h>

#include "../csrc/rtc.h"
#endif

/* Element offset of 16-byte chunk c of row r in a [rows][DP] tile, XOR-swizzled by the row's low 3 bits. */
template <int DP> DEV int swz(int r, int c) { return r * DP + ((c ^ (r & 7)) << 3); }

/* ldmatrix addressing without per-load arithmetic.  A lane reads 16-byte chunk 2 * step + half of row `row` of a
 * swizzled [rows][DP] tile (tile 128-byte aligned).  Since 2 * step + half = 8 * (step / 4) + (2 * (step % 4) | half),
 * its swizzled chunk is 8 * (step / 4) + ((2 * (step % 4)) ^ (half ^ (row & 7))): from the address a of step 0
 * (swz_addr), step is an XOR of address bits 5-6 by step % 4 and a compile-time 128 bytes per 4 steps (swz_step).
 * Row tiles, key tiles and stages are multiples of 128 bytes, added as immediates or once per key block. */
template <int DP> DEV unsigned swz_addr(unsigned tile, int row, int half) {
    return tile + row * DP * 2 + ((half ^ (row & 7)) << 4);
}
DEV unsigned swz_step(unsigned a, int step) { return (a ^ ((step & 3) << 5)) + (step >> 2) * 128; }

/* Rows [0, ROWS) of a ROWS x DP tile from global memory into swizzled shared memory; rows >= valid and columns >= d
 * are zero-filled without reading.  Thread tid always copies chunk c = tid % CHUNKS of rows r0 + RSTEP * it
 * (r0 = tid / CHUNKS); `src` is that thread's first element, tile + r0 * stride + 8 * c (load_origin), so the copy
 * loop needs no per-tile setup.  Row r0 + RSTEP * it has the swizzle of row r0 + RSTEP * (it % P) (P * RSTEP is a
 * multiple of 8): P offsets per thread and compile-time row steps address every copy.  A tile wholly inside the
 * sequence (every tile but the last) copies with no bounds test: one 64-bit pointer add and one cp.async per copy. */
template <int DP> DEV int64_t load_origin(int64_t stride, int tid) {
    return (int64_t)(tid / (DP / 8)) * stride + tid % (DP / 8) * 8;
}
template <typename T, int DP, int ROWS, int THREADS>
DEV void load_tile(T *smem, const T *src, int64_t stride, int64_t valid, int d, int tid) {
    constexpr int CHUNKS = DP / 8, RSTEP = THREADS / CHUNKS, ITERS = ROWS * CHUNKS / THREADS;
    constexpr int P = RSTEP % 8 == 0 ? 1 : 8 / RSTEP;
    static_assert(THREADS % CHUNKS == 0 && (ROWS * CHUNKS) % THREADS == 0, "tile must split evenly over threads");
    static_assert(8 % RSTEP == 0 || RSTEP % 8 == 0, "row step must divide or be a multiple of the swizzle period");
    const int c = tid % CHUNKS, r0 = tid / CHUNKS;
    int soff[P];
#pragma unroll
    for (int k = 0; k < P; k++) soff[k] = swz<DP>(r0 + k * RSTEP, c);
    auto dst = [&](int it) { return smem + soff[it % P] + (it / P) * P * RSTEP * DP; };
    const bool col_in = c * 8 < d;
    if (valid >= ROWS && col_in) {
#pragma unroll
        for (int it = 0; it < ITERS; it++, src += RSTEP * stride) cp_async_16(dst(it), src, 16);
    } else {
        const T *first = src;
        const int rows = valid <= 0 ? 0 : (int)valid; /* < ROWS here unless col_in is false */
#pragma unroll
        for (int it = 0; it < ITERS; it++, src += RSTEP * stride) {
            const bool in = col_in && r0 + it * RSTEP < rows;
            cp_async_16(dst(it), in ? src : first, in ? 16 : 0);
        }
    }
}

/* Flips the sign bit of every fp16/bf16 element of a ROWS x DP tile in shared memory (16 bytes per thread-step). */
template <int DP, int ROWS, int THREADS> DEV void flip_sign_bits(void *smem, int tid) {
    uint4 *t = (uint4 *)smem;
    for (int i = tid; i < ROWS * DP / 8; i += THREADS) {
        uint4 x = t[i];
        x.x ^= 0x80008000u, x.y ^= 0x80008000u, x.z ^= 0x80008000u, x.w ^= 0x80008000u;
        t[i] = x;
    }
}

/* Split-KV (flash-decoding): with o_part set, split blockIdx.y of a grid of gridDim.y splits covers key blocks
 * [y * blocks_per_split, (y + 1) * blocks_per_split) and writes its normalised partial output (fp32) and its LSE
 * instead of O; v2_combine merges the splits.  o_part NULL: one split, O written directly. */
typedef struct {
    float *o_part;        /* [splits][b * h][sq][d] */
    float *lse_part;      /* [splits][b * h][sq], natural log, -inf for a split that saw no key */
    int blocks_per_split; /* key blocks of BC keys per split */
    int heads_fastest;    /* block order (v2_pick_order): 1 = every head's last query block, then every head's next;
                             0 = one head's query blocks after another, the last first */
} v2_split;

/* The forward pass of one block; v2_fwd (compiled ahead of time) and fattn_v2_rtc (compiled at run time by NVRTC
 * with the configuration as macros) are both this body. */
template <typename T, int DP, int WARPS, int MT, int BC, int STAGES>
DEV void v2_body(const attn_params p, const v2_split sp) {
    constexpr int THREADS = WARPS * 32, BR = 16 * MT * WARPS;
    constexpr int KSTEPS = DP / 16; /* k-steps of S = Q K^T */
    constexpr int NT = BC / 8;      /* n8 tiles of S */
    constexpr int DT = DP / 8;      /* n8 tiles of O */
    /* Q's fragments stay in registers when they and the S and O accumulators fit (else ldmatrix per k-step) */
    constexpr bool Q_IN_REGS = MT * DP <= 128 && MT * (DP / 8 + BC / 8 + DP / 16) * 4 <= 200;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sQ = (T *)smem_raw, *sK = sQ + BR * DP, *sV = sK + STAGES * BC * DP;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int mi = lane >> 3, r8 = lane & 7; /* ldmatrix: which 8x8 matrix this lane addresses, and its row */
    const int64_t nqb = (p.sq + BR - 1) / BR, nbh = p.b * p.h;
    /* Block order (the hardware hands blocks out in order; v2_pick_order chooses): head by head, the blocks running
     * at once share a few heads' K and V in L2; heads fastest, every head's last (with causal masking, longest)
     * query block runs first and the grid ends on short blocks.  Either way a head's last query block comes first. */
    const int64_t bh = sp.heads_fastest ? blockIdx.x % nbh : blockIdx.x / nqb;
    const int64_t i0 = (nqb - 1 - (sp.heads_fastest ? blockIdx.x / nbh : blockIdx.x % nqb)) * BR;
    const int64_t b = bh / p.h, h = bh % p.h;
    HEAD_OFFSETS(p, b, h);
    const T *q = (const T *)p.q + q_off + i0 * p.q_stride_s;
    const T *k = (const T *)p.k + k_off, *v = (const T *)p.v + v_off;
    const int d = (int)p.d;

    const int64_t i_last = (i0 + BR < p.sq ? i0 + BR : p.sq) - 1;
    const int64_t kend = fattn_row_kend(&p, i_last); /* no row of the block sees key kend or later */
    const int64_t kfull = fattn_row_kend(&p, i0);    /* every row of the block sees keys [0, kfull) */
    const int nblocks = (int)((kend + BC - 1) / BC), nfull = (int)(kfull / BC);
    const int jb_begin = sp.o_part ? (int)blockIdx.y * sp.blocks_per_split : 0;
    const int jb_end = sp.o_part ? min(nblocks, jb_begin + sp.blocks_per_split) : nblocks;
    const int wrow = warp * 16 * MT;                 /* the warp's first row in the block; this thread's rows
                                                        are wrow + 16 mt + g (+ 8) */
    /* ldmatrix addresses of step 0 (swz_addr): Q and P V's V by k-step / d-step, K by k-step */
    const unsigned qa = swz_addr<DP>(smem_u32(sQ), wrow + r8 + (mi & 1) * 8, mi >> 1);
    const unsigned ka = swz_addr<DP>(smem_u32(sK), r8 + (mi >> 1) * 8, mi & 1);
    const unsigned va = swz_addr<DP>(smem_u32(sV), r8 + (mi & 1) * 8, mi >> 1);

    const T *kthr = k + load_origin<DP>(p.k_stride_s, tid), *vthr = v + load_origin<DP>(p.v_stride_s, tid);
    auto load_v = [&](int jb, int stage) {
        const int64_t j0 = (int64_t)jb * BC;
        load_tile<T, DP, BC, THREADS>(sV + stage * BC * DP, vthr + j0 * p.v_stride_s, p.v_stride_s, kend - j0, d, tid);
    };
    auto load_kv = [&](int jb, int stage, bool with_v) {
        const int64_t j0 = (int64_t)jb * BC;
        load_tile<T, DP, BC, THREADS>(sK + stage * BC * DP, kthr + j0 * p.k_stride_s, p.k_stride_s, kend - j0, d, tid);
        if (with_v) load_v(jb, stage);
    };
    load_tile<T, DP, BR, THREADS>(sQ, q + load_origin<DP>(p.q_stride_s, tid), p.q_stride_s, p.sq - i0, d, tid);
    if (jb_begin < jb_end) load_kv(jb_begin, 0, STAGES == 2);
    cp_async_commit();
    if (STAGES == 2) {
        if (jb_begin + 1 < jb_end) load_kv(jb_begin + 1, 1, true);
        cp_async_commit();
    }

    float o[MT][DT][4], m_i[MT][2], l_i[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        m_i[mt][0] = m_i[mt][1] = -INFINITY;
        l_i[mt][0] = l_i[mt][1] = 0.f;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
    }
    unsigned qf[Q_IN_REGS ? MT : 1][Q_IN_REGS ? KSTEPS : 1][4]; /* Q fragments of each row tile */
    /* S is computed as (sign * Q) K^T with sign = sign(scale), so that S * |scale_log2| keeps the order of S: the
     * row max is taken on raw S.  A negative scale flips Q's sign bits once in shared memory (exact for fp16/bf16),
     * so the k-step loop reads Q as it is. */
    const bool flip_q = p.scale_log2 < 0.f;
    const float sl = fabsf(p.scale_log2);
    /* A warp whose rows all lie past Sq (decode: Sq = 1 uses one warp of the block) only helps load K and V. */
    const bool warp_live = i0 + wrow < p.sq;

    for (int jb = jb_begin; jb < jb_end; jb++) {
        const int64_t j0 = (int64_t)jb * BC;
        const int stage = STAGES == 2 ? (jb - jb_begin) & 1 : 0;
        const unsigned kaj = ka + stage * BC * DP * 2, vaj = va + stage * BC * DP * 2;
        if (STAGES == 2) cp_async_wait<1>(); /* block j's group is complete; j+1's may be in flight */
        else cp_async_wait<0>();
        __syncthreads(); /* K_j (and Q) have landed; every warp is done with the buffers about to be refilled */
        if (STAGES == 1) {
            load_v(jb, 0);
            cp_async_commit();
        }
        if (flip_q && jb == jb_begin) { /* Q has landed (waited and synchronised above) */
            flip_sign_bits<DP, BR, THREADS>(sQ, tid);
            __syncthreads();
        }
        if (Q_IN_REGS && jb == jb_begin && warp_live) {
#pragma unroll
            for (int mt = 0; mt < (Q_IN_REGS ? MT : 0); mt++)
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ks++)
                    ldmatrix_x4(qf[mt][ks], swz_step(qa, ks) + 16 * mt * DP * 2);
        }

        float s[MT][NT][4];
        if (warp_live) { /* S = Q K_j^T */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if (Q_IN_REGS) {
#pragma unroll
                        for (int x = 0; x < 4; x++) a[mt][x] = qf[Q_IN_REGS ? mt : 0][Q_IN_REGS ? ks : 0][x];
                    } else {
                        ldmatrix_x4(a[mt], swz_step(qa, ks) + 16 * mt * DP * 2);
                    }
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    unsigned kb[4];
                    ldmatrix_x4(kb, swz_step(kaj, ks) + np * 16 * DP * 2);
                    const unsigned b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_16816(s[mt][2 * np], a[mt], b0, T());
                        mma_16816(s[mt][2 * np + 1], a[mt], b1, T());
                    }
                }
            }

            /* mask keys a row cannot see (diagonal and tail blocks only), in 32-bit offsets from j0 */
            if (jb >= nfull) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        /* visible keys of this row, recomputed here: keeping them costs registers the
                         * unmasked blocks need */
                        const int64_t lim64 = fattn_row_kend(&p, i0 + wrow + 16 * mt + g + 8 * r) - j0;
                        const int lim = lim64 < 0 ? 0 : (lim64 > BC ? BC : (int)lim64);
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) {
                            if (nt * 8 + 2 * t >= lim) s[mt][nt][2 * r] = -INFINITY;
                            if (nt * 8 + 2 * t + 1 >= lim) s[mt][nt][2 * r + 1] = -INFINITY;
                        }
                    }
            }

            /* online softmax on this thread's 2 * MT rows: m on raw S, P = exp2((S - m) * sl).  (The one-FFMA form
             * S * sl - m * sl cancels catastrophically once |m * sl| nears 2^24: inputs of magnitude 1e5 do that.) */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    const float m_new = fmaxf(m_i[mt][r], quad_max(mx));
                    const float m_use = m_new == -INFINITY ? 0.f : m_new;
                    const float alpha = fast_exp2((m_i[mt][r] - m_use) * sl);
                    m_i[mt][r] = m_new;
                    float rs = 0.f;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        s[mt][nt][2 * r] = fast_exp2((s[mt][nt][2 * r] - m_use) * sl);
                        s[mt][nt][2 * r + 1] = fast_exp2((s[mt][nt][2 * r + 1] - m_use) * sl);
                        rs += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
                    }
                    l_i[mt][r] = l_i[mt][r] * alpha + rs;
                    /* O *= alpha, skipped when no row max of the warp moved (the common case once a row has seen
                     * its largest scores): one vote instead of DT * 2 multiplies */
                    if (__any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
                        for (int dt = 0; dt < DT; dt++) {
                            o[mt][dt][2 * r] *= alpha;
                            o[mt][dt][2 * r + 1] *= alpha;
                        }
                    }
                }
        }

        if (STAGES == 1) {
            cp_async_wait<0>();
            __syncthreads(); /* V_j has landed; every warp is done with K_j */
            if (jb + 1 < jb_end) load_kv(jb + 1, 0, false);
            cp_async_commit();
        }

        if (warp_live) { /* O += P V_j */
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    a[mt][0] = pack2(s[mt][2 * kk][0], s[mt][2 * kk][1], T());
                    a[mt][1] = pack2(s[mt][2 * kk][2], s[mt][2 * kk][3], T());
                    a[mt][2] = pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1], T());
                    a[mt][3] = pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3], T());
                }
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    unsigned vb[4];
                    ldmatrix_x4_trans(vb, swz_step(vaj, dp) + kk * 16 * DP * 2);
                    const unsigned b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_16816(o[mt][2 * dp], a[mt], b0, T());
                        mma_16816(o[mt][2 * dp + 1], a[mt], b1, T());
                    }
                }
            }
        }

        if (STAGES == 2) {
            __syncthreads(); /* every warp is done with stage `stage`: refill it with block j + 2 */
            if (jb + 2 < jb_end) load_kv(jb + 2, stage, true);
            cp_async_commit();
        }
    }
    cp_async_wait<0>(); /* nothing may stay in flight into a block that exits */

    /* O = acc / l, LSE = (m + log2 l) ln 2 */
    T *out = (T *)p.o + o_off;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int64_t i = i0 + wrow + 16 * mt + g + 8 * r;
            const float l = quad_sum(l_i[mt][r]);
            if (i >= p.sq) continue;
            const float inv = l > 0.f ? 1.f / l : 0.f;
            if (sp.o_part) { /* a split: partial O in fp32 and its LSE, merged by v2_combine */
                const int64_t row = ((int64_t)blockIdx.y * nbh + bh) * p.sq + i;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    const int col = dt * 8 + 2 * t;
                    if (col < d)
                        *(float2 *)(sp.o_part + row * d + col) =
                            make_float2(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
                }
                if (t == 0) sp.lse_part[row] = lse_from(m_i[mt][r] * sl, l);
                continue;
            }
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                const int col = dt * 8 + 2 * t;
                if (col < d)
                    *(unsigned *)(out + i * p.o_stride_s + col) =
                        pack2(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv, T());
            }
            if (p.lse && t == 0) p.lse[b * p.lse_stride_b + h * p.lse_stride_h + i] = lse_from(m_i[mt][r] * sl, l);
        }
}

template <typename T, int DP, int WARPS, int MT, int BC, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) v2_fwd(const attn_params p, const v2_split sp) {
    v2_body<T, DP, WARPS, MT, BC, STAGES>(p, sp);
}

#ifdef FATTN_V2_RTC /* one configuration compiled by NVRTC (fattn/_rtc.py): V2_T, V2_DP, ... given as macros */
extern "C" __global__ void __launch_bounds__(V2_WARPS * 32) fattn_v2_rtc(const attn_params p, const v2_split sp) {
    v2_body<V2_T, V2_DP, V2_WARPS, V2_MT, V2_BC, V2_STAGES>(p, sp);
}
#endif

/* Merges the splits of v2_fwd: one warp per query row.  LSE = log sum_s exp(LSE_s);  O = sum_s exp(LSE_s - LSE) O_s.
 * Splits that saw no key (LSE_s = -inf) weigh 0; a row no split saw gets O = 0, LSE = -inf.  Fixed order: the result
 * is bitwise repeatable. */
template <typename T>
__global__ void __launch_bounds__(128) v2_combine(const attn_params p, const v2_split sp, int splits) {
    const int lane = threadIdx.x & 31;
    const int64_t nrows = p.b * p.h * p.sq, row = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= nrows) return;
    const int64_t bh = row / p.sq, i = row % p.sq, b = bh / p.h, h = bh % p.h;
    float mx = -INFINITY;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, sp.lse_part[s * nrows + row]);
    float sum = 0.f;
    for (int s = 0; s < splits; s++) {
        const float ls = sp.lse_part[s * nrows + row];
        if (ls != -INFINITY) sum += __expf(ls - mx);
    }
    const float lse = sum > 0.f ? mx + __logf(sum) : -INFINITY;
    T *out = (T *)p.o + b * p.o_stride_b + h * p.o_stride_h + i * p.o_stride_s;
    for (int col = 2 * lane; col < p.d; col += 64) {
        float a0 = 0.f, a1 = 0.f;
        for (int s = 0; s < splits; s++) {
            const float ls = sp.lse_part[s * nrows + row];
            if (ls == -INFINITY) continue;
            const float w = __expf(ls - lse);
            const float2 x = *(const float2 *)(sp.o_part + (s * nrows + row) * p.d + col);
            a0 += w * x.x;
            a1 += w * x.y;
        }
        *(unsigned *)(out + col) = pack2(a0, a1, T());
    }
    if (p.lse && lane == 0) p.lse[b * p.lse_stride_b + h * p.lse_stride_h + i] = lse;
}

#ifndef __CUDACC_RTC__ /* host code: the configuration table, split-KV planning, the launcher */
/* ---- the configuration table and the launcher ------------------------------------------------------------ */

typedef void (*v2_kernel)(const attn_params, const v2_split);

typedef struct {
    v2_config cfg;
    v2_kernel kern[2];           /* fp16, bf16 compiled ahead of time (NULL: not compiled for that dtype) */
    fattn_rtc_kernel *rtc[2];    /* or compiled at run time by NVRTC (fattn_v2_add_rtc) */
} v2_entry;

#define V2_ENTRY_F16(dp, w, mt, bc, st) {{dp, w, mt, bc, st}, {v2_fwd<__half, dp, w, mt, bc, st>, NULL}, {NULL, NULL}},
#define V2_ENTRY_BOTH(dp, w, mt, bc, st) \
    {{dp, w, mt, bc, st}, {v2_fwd<__half, dp, w, mt, bc, st>, v2_fwd<__nv_bfloat16, dp, w, mt, bc, st>}, {NULL, NULL}},
/* Ahead-of-time entries first (defaults, small-grid, rules, sweep), then the run-time compiled ones as they are
 * added. */
#define V2_RULE_ENTRY(dp, w, mt, bc, st, causal, sk_min, sk_max) V2_ENTRY_BOTH(dp, w, mt, bc, st)
#define V2_MAX_CONFIGS 512
static v2_entry v2_table[V2_MAX_CONFIGS] = {V2_DEFAULT_CONFIGS(V2_ENTRY_BOTH) V2_SMALL_GRID_CONFIGS(V2_ENTRY_BOTH)
                                                V2_RULES(V2_RULE_ENTRY) V2_SWEEP_CONFIGS(V2_ENTRY_F16)};
#undef V2_RULE_ENTRY
#define V2_COUNT(...) +1
enum {
    V2_FIRST_RULE = 0 V2_DEFAULT_CONFIGS(V2_COUNT) V2_SMALL_GRID_CONFIGS(V2_COUNT), /* table index of rule 0 */
    V2_NRULES = 0 V2_RULES(V2_COUNT),
    V2_NAOT = V2_FIRST_RULE + V2_NRULES V2_SWEEP_CONFIGS(V2_COUNT)
};
#undef V2_COUNT

typedef struct {
    v2_config cfg;
    int causal;
    long long sk_min, sk_max;
} v2_rule;
static const v2_rule v2_rules[V2_NRULES + 1] = { /* + 1: C++ has no empty arrays */
#define V2_RULE(dp, w, mt, bc, st, causal, sk_min, sk_max) {{dp, w, mt, bc, st}, causal, sk_min, sk_max},
    V2_RULES(V2_RULE)
#undef V2_RULE
    {{0, 0, 0, 0, 0}, -1, 0, 0}};

extern "C" int fattn_v2_rule_count(void) { return V2_NRULES; }
extern "C" int fattn_v2_rule(int i, v2_config *cfg, int *causal, long long *sk_min, long long *sk_max) {
    if (i < 0 || i >= V2_NRULES) return 0;
    *cfg = v2_rules[i].cfg;
    *causal = v2_rules[i].causal;
    *sk_min = v2_rules[i].sk_min;
    *sk_max = v2_rules[i].sk_max;
    return 1;
}
static int v2_nconfigs = V2_NAOT;
static pthread_mutex_t v2_table_lock = PTHREAD_MUTEX_INITIALIZER;

static int v2_active[3] = {0, 1, 2}; /* per head-dim bucket: index into v2_table (defaults come first, then
                                         the small-grid configs at 3 + bucket) */
static unsigned long long v2_smem_set[V2_MAX_CONFIGS][2]; /* bit per device: > 48 KB opt-in done (AOT kernels) */

/* The tuned-config cache as registered by fattn/_tuned.py: index + 1 into v2_table per (device, dtype, head dim / 8,
 * causal, sequence bucket), 0 for none. */
#define V2_TUNED_DEVICES 16
static short v2_tuned[V2_TUNED_DEVICES][2][FATTN_MAX_HEADDIM / 8][2][FATTN_SEQ_BUCKETS];

static int dp_bucket(int64_t d) { return d <= 64 ? 0 : d <= 128 ? 1 : 2; }

extern "C" int fattn_v2_config_count(void) { return v2_nconfigs; }
extern "C" const v2_config *fattn_v2_config(int i) { return i >= 0 && i < v2_nconfigs ? &v2_table[i].cfg : NULL; }
extern "C" int fattn_v2_config_aot(int i) { return i >= 0 && i < V2_NAOT; }
extern "C" int fattn_v2_config_dtypes(int i) {
    if (i < 0 || i >= v2_nconfigs) return 0;
    const v2_entry *e = &v2_table[i];
    return (e->kern[0] || e->rtc[0] ? 1 : 0) | (e->kern[1] || e->rtc[1] ? 2 : 0);
}
extern "C" int fattn_v2_active(int bucket) { return v2_active[bucket]; }

extern "C" fattn_status fattn_v2_select(int index) {
    if (index < 0 || index >= v2_nconfigs)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2 config %d out of range [0, %d)", index, v2_nconfigs);
    v2_active[dp_bucket(v2_table[index].cfg.dp)] = index;
    return FATTN_OK;
}

extern "C" fattn_status fattn_v2_add_rtc(const v2_config *cfg, int dtype, const void *image, size_t size,
                                         const char *func, int *index) {
    if (dtype != FATTN_F16 && dtype != FATTN_BF16)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2 runs float16 and bfloat16 only");
    fattn_rtc_kernel *k = fattn_rtc_kernel_new(image, size, func);
    if (!k) return FATTN_FAIL(FATTN_ERR_NOMEM, "out of memory for a run-time compiled kernel");
    fattn_status st = FATTN_OK;
    pthread_mutex_lock(&v2_table_lock);
    if (v2_nconfigs >= V2_MAX_CONFIGS) {
        st = FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 holds at most %d configurations", V2_MAX_CONFIGS);
    } else {
        v2_entry *e = &v2_table[v2_nconfigs];
        memset(e, 0, sizeof *e);
        e->cfg = *cfg;
        e->rtc[dtype - FATTN_F16] = k;
        *index = v2_nconfigs++;
    }
    pthread_mutex_unlock(&v2_table_lock);
    return st; /* on failure k is leaked: it holds only host memory and this happens at most once per call */
}

extern "C" fattn_status fattn_v2_set_tuned(int device, int dtype, int head_dim, int causal, int seq_bucket, int index) {
    if (device < 0 || device >= V2_TUNED_DEVICES || (dtype != FATTN_F16 && dtype != FATTN_BF16) || head_dim < 8 ||
        head_dim > FATTN_MAX_HEADDIM || head_dim % 8 || seq_bucket < 0 || seq_bucket >= FATTN_SEQ_BUCKETS ||
        index < -1 || index >= v2_nconfigs)
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2 tuned entry out of range");
    if (index >= 0 && (v2_table[index].cfg.dp < head_dim || (!v2_table[index].kern[dtype - 1] && !v2_table[index].rtc[dtype - 1])))
        return FATTN_FAIL(FATTN_ERR_INVALID, "v2 config %d cannot run head dim %d in this dtype", index, head_dim);
    v2_tuned[device][dtype - FATTN_F16][head_dim / 8 - 1][causal != 0][seq_bucket] = (short)(index + 1);
    return FATTN_OK;
}

extern "C" void fattn_v2_clear_tuned(void) { memset(v2_tuned, 0, sizeof v2_tuned); }

static size_t v2_smem_bytes(const v2_config *c) {
    return (size_t)(16 * c->mt * c->warps + 2 * c->stages * c->bc) * c->dp * 2;
}

static bool aligned(const void *ptr, int64_t bytes) { return (uintptr_t)ptr % (uintptr_t)bytes == 0; }

extern "C" fattn_status fattn_check_v2(const attn_params *p) {
    if (p->dtype != FATTN_F16 && p->dtype != FATTN_BF16)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2 runs float16 and bfloat16 only");
    const bool ok = aligned(p->q, 16) && aligned(p->k, 16) && aligned(p->v, 16) && aligned(p->o, 4) &&
                    p->q_stride_b % 8 == 0 && p->q_stride_h % 8 == 0 && p->q_stride_s % 8 == 0 &&
                    p->k_stride_b % 8 == 0 && p->k_stride_h % 8 == 0 && p->k_stride_s % 8 == 0 &&
                    p->v_stride_b % 8 == 0 && p->v_stride_h % 8 == 0 && p->v_stride_s % 8 == 0 &&
                    p->o_stride_b % 2 == 0 && p->o_stride_h % 2 == 0 && p->o_stride_s % 2 == 0;
    if (!ok)
        return FATTN_FAIL(FATTN_ERR_UNSUPPORTED,
                          "v2 needs q, k, v 16-byte aligned with strides a multiple of 8 elements (and out 4-byte "
                          "aligned with even strides)");
    return FATTN_OK;
}

/* ---- split-KV: how many splits, and where their partial results live ---------------------------------------- */

static int v2_forced_splits = 0; /* 0: the heuristic decides; n >= 1: always n splits (tests, sweeps) */
static int v2_last_splits = 0;   /* splits of the last launch (tests ask) */

static int v2_last_config = -1;   /* table index of the last launch */

extern "C" int fattn_v2_last_splits(void) { return v2_last_splits; }
extern "C" int fattn_v2_last_config(void) { return v2_last_config; }

static int v2_forced_order = 0; /* 0: v2_pick_order decides; 1: head by head; 2: heads fastest */
extern "C" int fattn_v2_set_order(int n) {
    const int old = v2_forced_order;
    v2_forced_order = n < 0 || n > 2 ? 0 : n;
    return old;
}

/* 1 if the blocks should go heads fastest, 0 for head by head.  Causal calls with >= 2k keys: every head's longest
 * block first evens out blocks of very unequal length, and the blocks of one head running at once still share its
 * K/V.  Shorter causal calls and every non-causal call: head by head, or each block re-reads its head's K/V from
 * DRAM.  Measured on the H100, same kernel, only the order changed (bench/v2_ab.py --orders 1,2,
 * evidence/bench/h100_v2_ab_orders_1abef9c.json), fa3 grid, head by head / heads fastest in TFLOP/s: causal D=128
 * S=512 194 / 184, 2k 292 / 317, 16k 348 / 380; D=256 S=512 194 / 133, 2k 275 / 297; non-causal D=256 S=512
 * 265 / 164. */
static int v2_pick_order(const attn_params *p) {
    if (v2_forced_order) return v2_forced_order == 2;
    return p->causal && p->sk >= 2048;
}

extern "C" int fattn_v2_set_splits(int n) {
    const int old = v2_forced_splits;
    v2_forced_splits = n < 0 ? 0 : n;
    return old;
}

/* Splits of the key sequence for a grid of `blocks` query blocks, `nkb` key blocks each: only when the grid has
 * fewer blocks than multiprocessors (decode: Sq = 1 and a small batch), enough splits to give each multiprocessor
 * SPLIT_CTAS_PER_SM blocks, each split at least SPLIT_MIN_KEY_BLOCKS key blocks long.  Measured on the H100
 * and H200 (bench/split_sweep.py, evidence/bench/h1?0_split_sweep_*.json): about 2 blocks per SM is best at
 * B*H = 8, 32 (D = 128), and at B*H = 32 nine splits (288 blocks) lose to eight (256) by 14%; at B*H = 256 any
 * split is slower than none. */
#define SPLIT_CTAS_PER_SM 2
#define SPLIT_MIN_KEY_BLOCKS 4
#define SPLIT_MAX 128
static int v2_pick_splits(const attn_params *p, int64_t blocks, int64_t nkb) {
    int64_t n = v2_forced_splits;
    if (n == 0) {
        if (blocks >= p->sm_count) return 1;
        n = p->sm_count * SPLIT_CTAS_PER_SM / blocks; /* rounded down: a partial extra wave costs more than it gives */
        if (n > nkb / SPLIT_MIN_KEY_BLOCKS) n = nkb / SPLIT_MIN_KEY_BLOCKS;
    }
    if (n > nkb) n = nkb;
    if (n > SPLIT_MAX) n = SPLIT_MAX;
    return n < 1 ? 1 : (int)n;
}

/* One workspace per (device, stream), grown when a call needs more and never shared between streams (so calls on
 * different streams cannot race on it).  It is allocated on the first split call, not per call.  Under CUDA graph
 * capture nothing is allocated and no split is used: a captured graph must not hold a buffer a later call might
 * free.  Calls hold the GIL; the mutex keeps the table consistent if they ever do not. */
typedef struct {
    int device;
    void *stream;
    void *buf;
    size_t bytes;
} v2_workspace;
#define V2_WORKSPACES 32
static v2_workspace v2_ws[V2_WORKSPACES];
static int v2_nws;
static pthread_mutex_t v2_ws_lock = PTHREAD_MUTEX_INITIALIZER;

/* *buf = a workspace of >= bytes for (device, stream), or NULL when none can be had without risk (capture,
 * table full, out of memory): the caller then runs without splits. */
static void v2_workspace_get(int device, void *stream, size_t bytes, void **buf) {
    *buf = NULL;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing((cudaStream_t)stream, &cap) != cudaSuccess) {
        cudaGetLastError(); /* the legacy stream while another stream captures: treat as capturing */
        return;
    }
    if (cap != cudaStreamCaptureStatusNone) return;
    pthread_mutex_lock(&v2_ws_lock);
    v2_workspace *w = NULL;
    for (int i = 0; i < v2_nws && !w; i++)
        if (v2_ws[i].device == device && v2_ws[i].stream == stream) w = &v2_ws[i];
    if (!w && v2_nws < V2_WORKSPACES) {
        w = &v2_ws[v2_nws++];
        w->device = device;
        w->stream = stream;
    }
    if (w && w->bytes < bytes) {
        const size_t grow = bytes > 2 * w->bytes ? bytes : 2 * w->bytes;
        void *nb = NULL;
        if (cudaMalloc(&nb, grow) != cudaSuccess) {
            cudaGetLastError();
        } else {
            if (w->buf) cudaFree(w->buf); /* synchronises the device: no queued kernel still uses the old one */
            w->buf = nb;
            w->bytes = grow;
        }
    }
    if (w && w->bytes >= bytes) *buf = w->buf;
    pthread_mutex_unlock(&v2_ws_lock);
}

static const void *v2_combine_kernel[2] = {(const void *)v2_combine<__half>, (const void *)v2_combine<__nv_bfloat16>};

/* Which table entry runs p on `dev`: an explicit p->config, else the tuned config registered for this problem, else
 * the active config of the head-dim bucket; when that is the default: the small-grid config when the default's grid
 * would idle SMs or Sq fits 64 rows, else the first matching V2_RULES entry, else the default. */
static fattn_status v2_choose(const attn_params *p, int dev, int *index) {
    const int bucket = dp_bucket(p->d), ti = p->dtype - FATTN_F16;
    int idx = p->config;
    if (idx >= 0) {
        if (idx >= v2_nconfigs) return FATTN_FAIL(FATTN_ERR_INVALID, "v2 config %d out of range [0, %d)", idx, v2_nconfigs);
        const v2_entry *e = &v2_table[idx];
        if (e->cfg.dp < p->d) return FATTN_FAIL(FATTN_ERR_INVALID, "v2 config %d is for head dims <= %d", idx, e->cfg.dp);
        if (!e->kern[ti] && !e->rtc[ti])
            return FATTN_FAIL(FATTN_ERR_INVALID, "v2 config %d is not compiled for this dtype", idx);
        *index = idx;
        return FATTN_OK;
    }
    if (dev < V2_TUNED_DEVICES) {
        const int t = v2_tuned[dev][ti][p->d / 8 - 1][p->causal != 0][fattn_seq_bucket(p->sq, p->sk)];
        if (t > 0) {
            *index = t - 1;
            return FATTN_OK;
        }
    }
    idx = v2_active[bucket];
    if (!v2_table[idx].kern[ti] && !v2_table[idx].rtc[ti]) idx = bucket; /* sweep configs are fp16-only */
    if (idx == bucket) { /* the default, unless the grid is small or a rule matches */
        const v2_config *c = &v2_table[idx].cfg;
        const int64_t br = 16 * c->mt * c->warps;
        if ((p->sq + br - 1) / br * p->b * p->h < p->sm_count || p->sq <= 64) {
            idx = 3 + bucket;
        } else {
            for (int r = 0; r < V2_NRULES; r++) {
                const v2_rule *w = &v2_rules[r];
                if (w->cfg.dp == c->dp && w->causal == (p->causal != 0) && p->sk >= w->sk_min && p->sk <= w->sk_max) {
                    idx = V2_FIRST_RULE + r;
                    break;
                }
            }
        }
    }
    *index = idx;
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_v2(const attn_params *p, void *stream) {
    fattn_status st = fattn_check_v2(p);
    if (st) return st;
    const int ti = p->dtype - FATTN_F16;
    int dev = 0, idx = 0;
    FATTN_CUDA_CHECK(cudaGetDevice(&dev));
    if ((st = v2_choose(p, dev, &idx))) return st;
    v2_last_config = idx;
    const v2_entry *e = &v2_table[idx];
    const int64_t br = 16 * e->cfg.mt * e->cfg.warps, nqb = (p->sq + br - 1) / br, blocks = nqb * p->b * p->h;
    if (blocks == 0) return FATTN_OK;
    if (blocks > 0x7fffffff) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2: grid of %lld blocks is too large", (long long)blocks);
    const size_t smem = v2_smem_bytes(&e->cfg);
    if (e->kern[ti] && smem > 48 * 1024 && !(v2_smem_set[idx][ti] >> dev & 1)) {
        FATTN_CUDA_CHECK(cudaFuncSetAttribute((const void *)e->kern[ti], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        v2_smem_set[idx][ti] |= 1ull << dev;
    }
    v2_split sp = {NULL, NULL, 0, v2_pick_order(p)};
    const int64_t nkb = (p->sk + e->cfg.bc - 1) / e->cfg.bc;
    int splits = v2_pick_splits(p, blocks, nkb);
    if (splits > 1) {
        sp.blocks_per_split = (int)((nkb + splits - 1) / splits);
        splits = (int)((nkb + sp.blocks_per_split - 1) / sp.blocks_per_split);
        const size_t rows = (size_t)(p->b * p->h * p->sq);
        void *ws = NULL;
        v2_workspace_get(dev, stream, (size_t)splits * rows * (size_t)(p->d + 1) * sizeof(float), &ws);
        if (ws) {
            sp.o_part = (float *)ws;
            sp.lse_part = sp.o_part + (size_t)splits * rows * (size_t)p->d;
        } else {
            splits = 1;
        }
    }
    if (!sp.o_part) splits = 1;
    v2_last_splits = splits;
    void *args[] = {(void *)p, (void *)&sp};
    if (e->kern[ti]) {
        FATTN_CUDA_CHECK(cudaLaunchKernel((const void *)e->kern[ti], dim3((unsigned)blocks, (unsigned)splits),
                                          dim3(e->cfg.warps * 32), args, smem, (cudaStream_t)stream));
    } else if ((st = fattn_rtc_launch(e->rtc[ti], (unsigned)blocks, (unsigned)splits, e->cfg.warps * 32, (unsigned)smem,
                                      stream, args))) {
        return st;
    }
    if (splits > 1) {
        int nsplit = splits;
        void *cargs[] = {(void *)p, (void *)&sp, (void *)&nsplit};
        const int64_t rows = p->b * p->h * p->sq, cblocks = (rows + 3) / 4;
        if (cblocks > 0x7fffffff) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v2: %lld rows are too many to split", (long long)rows);
        FATTN_CUDA_CHECK(cudaLaunchKernel(v2_combine_kernel[ti], dim3((unsigned)cblocks), dim3(128), cargs, 0,
                                          (cudaStream_t)stream));
    }
    return FATTN_OK;
}
#endif /* __CUDACC_RTC__ */
