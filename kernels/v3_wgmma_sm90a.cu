/* v3_wgmma_sm90a.cu -- version 3: Hopper (sm_90a) forward, the FlashAttention-3 structure.
 *
 * Adds over v2: wgmma instead of mma.sync, TMA instead of cp.async, and warp specialisation.
 * A block is one producer warpgroup and CONSUMERS (2 or 3) consumer warpgroups of 64 query rows each:
 *   the producer: one thread issues every TMA load (Q per tile; K_j, V_j for each key block of Bc keys into a ring
 *     of STAGES shared-memory slots, each slot with a "full" mbarrier the TMA completes and an "empty" mbarrier the
 *     consumers arrive on), and gives its registers away (setmaxnreg.dec);
 *   the consumers (setmaxnreg.inc), per key block:
 *     S = Q K_j^T      wgmma m64nBck16, both operands in 128-byte-swizzled shared memory
 *     masked -> -inf   (only in diagonal / tail blocks: one compare + select per element)
 *     m' = max(m, rowmax S) (quad shuffles),  P = exp2(S c - m' c) with c = scale log2 e in one FFMA,
 *                      l = alpha l + rowsum P
 *     O = alpha O + P V_j   wgmma m64nDk16 with P from registers (the S accumulators re-packed as A fragments)
 *                      and V N-major from shared memory (transposed by the descriptor, no copy)
 *   software-pipelined inside each consumer: S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued back to back, the
 *   softmax of S_{j+1} runs while P_j V_j is still on the tensor cores; and ping-pong between consumers (named
 *   barriers): they take turns issuing GEMMs, so one's softmax overlaps another's GEMMs.
 * O is written back through a shared-memory tile (its own where it fits, else the consumer's Q slot; swizzled like
 * TMA's loads) by a TMA store, which drops rows past the sequence end; TMA loads fill rows past a sequence's end
 * with zeros, so no load reads past it.
 * Fully masked key blocks are never loaded.
 * Head dims are bucketed (DP = 64 / 128 / 256; columns past d zero-filled by TMA); fp16 and bf16.
 * Needs q, k, v, out 16-byte aligned with every stride a multiple of 8 elements (TMA's rule; K/V may broadcast
 * over heads or batch with stride 0) and a positive scale; other calls run v2, and by default decode-like calls
 * (Sq <= 64) go to v2's split-KV.
 * The grid is persistent (one block per SM, tiles in zig-zag rounds, head by head so the blocks in flight share
 * K/V in L2, or longest first over all heads where a causal schedule needs it for balance); the K/V ring and the
 * turns run on across tiles.  Configurations: kernels/v3_configs.h (bench/v3_sweep.py times them).
 * Speed (NVIDIA H100, fa3 grid, evidence/bench/h100_v3_ratios_54c5b31.md): 195-731 TFLOP/s fp16, 0.75-1.08x torch
 * cudnn and 1.23-2.67x torch flash; D=128 S=16k 653 (non-causal) TFLOP/s.  Weakest: D=64 causal at S=512-2k
 * (0.75-0.82x cudnn) and D=64 non-causal at S=512-1k (0.85-0.87x).
 */
#include <cuda.h> /* CUtensorMap and its enums: types only, the driver is reached through the runtime */

#include "hopper.cuh"
#include "mma.cuh"
#include "wgmma_ops.cuh"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "../csrc/gpu.h"
#include "v3_configs.h"

/* Register split per consumer count: the producer keeps PRODUCER_REGS, consumers get the rest (multiples of 8,
 * 128 * (producer + consumers * consumer) <= 65536). */
template <int CWG> struct v3_regs;
template <> struct v3_regs<2> { static constexpr int producer = 24, consumer = 240; };
template <> struct v3_regs<3> { static constexpr int producer = 32, consumer = 160; };

/* Shared memory of one block: Q (Br x DP), the O staging tile when SEP_O (else O is staged in Q's slot), STAGES
 * slots of K and of V (Bc x DP), the mbarriers, and 1 KB of slack to align the tiles to 1024 bytes (the 128-byte
 * swizzle's period). */
#define V3_NBARS(STAGES) (2 + 4 * (STAGES))
#define V3_SMEM_BYTES(DP, BC, STAGES, CWG, SEP_O) \
    ((size_t)(64 * (CWG) * ((SEP_O) ? 2 : 1) + 2 * (STAGES) * (BC)) * (DP) * 2 + V3_NBARS(STAGES) * 8 + 1024)
/* A separate O tile when it fits in the 227 KB a block may have. */
#define V3_SEP_O(DP, BC, STAGES, CWG) (V3_SMEM_BYTES(DP, BC, STAGES, CWG, 1) <= 227 * 1024)

/* Named barriers (0 is __syncthreads): 1..3 a consumer warpgroup's own epilogue, 4..6 the ping-pong turns. */
#define V3_BAR_EPILOGUE 1
#define V3_BAR_TURN 4

/* The work of one block of the persistent grid: tile `tile` of nqb * b * h.  Heads come in groups of `group`
 * (b, h) pairs; inside a group query blocks run in reverse order (longest first when causal) with the heads
 * fastest.  group = 1 walks one head's query blocks after another, so the blocks running at once share one or a
 * few heads' K and V (read from DRAM about once); group = b * h walks every head's last query block first, which
 * balances causal tiles of very different lengths but leaves K and V little reuse in L2.  The host picks
 * (v3_order). */
typedef struct {
    int64_t i0;  /* first query row */
    int b, h;    /* batch, query head */
    int nblocks; /* key blocks of BC keys any row of the tile sees */
} v3_tile;

/* The persistent grid's k-th tile for block x (of G): rounds of G tiles, walked forwards in even rounds and
 * backwards in odd ones, so a block that got a long causal tile in one round gets a short one in the next. */
FATTN_HD int64_t v3_tile_index(int64_t k, int64_t x, int64_t G) { return k * G + ((k & 1) ? G - 1 - x : x); }

/* Host and device: the host replays the schedule to choose the order (v3_order). */
FATTN_HD v3_tile v3_tile_of(const attn_params &p, int br, int bc, int64_t tile, int group) {
    const int64_t nqb = (p.sq + br - 1) / br, nbh = p.b * p.h, first = tile / (group * nqb) * group;
    const int64_t in_group = nbh - first < group ? nbh - first : group, r = tile - first * nqb;
    const int64_t bh = first + r % in_group;
    v3_tile w;
    w.i0 = (nqb - 1 - r / in_group) * br;
    w.b = (int)(bh / p.h);
    w.h = (int)(bh % p.h);
    const int64_t i_last = (w.i0 + br < p.sq ? w.i0 + br : p.sq) - 1;
    w.nblocks = (int)((fattn_row_kend(&p, i_last) + bc - 1) / bc);
    return w;
}

/* CWG consumer warpgroups of 64 rows each (Br = 64 CWG); PP: ping-pong, the consumers take turns issuing their
 * GEMMs (named barriers), so one's softmax runs while another's GEMMs use the tensor cores.  The grid is
 * persistent (v3_tile_index: one tile per block per round, zig-zag); the K/V ring and the turns run on across
 * tiles, so the producer loads the next tile's Q and first K/V while the consumers finish the current one. */
template <typename T, int DP, int BC, int STAGES, int CWG, bool PP>
__global__ void __launch_bounds__(128 * (CWG + 1), 1)
v3_fwd(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
       const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o, const attn_params p,
       const int kv_batch_step, const int head_group) {
    constexpr int BR = 64 * CWG;
    constexpr bool SEP_O = V3_SEP_O(DP, BC, STAGES, CWG);
    constexpr int PANELS = DP / 64;           /* 64-column panels of a tile */
    constexpr int Q_TILE = BR * DP, KV_TILE = BC * DP; /* elements */
    constexpr int NS = BC / 2, NO = DP / 2;   /* accumulators per thread: S (64 x Bc) and O (64 x DP) */
    constexpr int KS = BC / 16;               /* k-steps of O += P V, and A fragments of P */
    extern __shared__ unsigned char smem_raw[];
    T *sQ = (T *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    T *sO = SEP_O ? sQ + Q_TILE : sQ;
    T *sK = sQ + (SEP_O ? 2 : 1) * Q_TILE, *sV = sK + STAGES * KV_TILE;
    uint64_t *bar = (uint64_t *)(sV + STAGES * KV_TILE);
    uint64_t *q_full = bar, *q_empty = bar + 1, *k_full = bar + 2, *v_full = k_full + STAGES,
             *k_empty = v_full + STAGES, *v_empty = k_empty + STAGES;
    const int64_t ntiles = (p.sq + BR - 1) / BR * p.b * p.h;

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 4 * CWG); /* one arrival per consumer warp */
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
            mbar_init(&k_empty[s], 4 * CWG);
            mbar_init(&v_empty[s], 4 * CWG);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) { /* ---- producer ---- */
        setmaxnreg_dec<v3_regs<CWG>::producer>();
        if (warp != 0 || lane != 0) return;
        tma_prefetch_map(&tm_q);
        tma_prefetch_map(&tm_k);
        tma_prefetch_map(&tm_v);
        int ring = 0, round = 0; /* K/V ring position and tiles done, across tiles */
        for (int64_t tile; (tile = v3_tile_index(round, blockIdx.x, gridDim.x)) < ntiles; round++) {
            const v3_tile w = v3_tile_of(p, BR, BC, tile, head_group);
            const int hk = (int)(w.h / p.h_per_kv), kb = w.b * kv_batch_step;
            if (round > 0) mbar_wait(q_empty, (round - 1) & 1);
            mbar_arrive_expect_tx(q_full, Q_TILE * 2);
#pragma unroll
            for (int c = 0; c < PANELS; c++) tma_load_4d(sQ + c * BR * 64, &tm_q, q_full, c * 64, (int)w.i0, w.h, w.b);
            for (int j = 0; j < w.nblocks; j++, ring++) {
                const int s = ring % STAGES;
                const unsigned parity = ((ring / STAGES) & 1) ^ 1; /* the phase the consumers completed last round */
                /* key block j of K (or V) into slot s once the consumers have released it */
                auto load = [&](T *dst, const CUtensorMap *map, uint64_t *full, uint64_t *empty) {
                    if (ring >= STAGES) mbar_wait(empty, parity);
                    mbar_arrive_expect_tx(full, KV_TILE * 2);
#pragma unroll
                    for (int c = 0; c < PANELS; c++) tma_load_4d(dst + c * BC * 64, map, full, c * 64, j * BC, hk, kb);
                };
                load(sK + s * KV_TILE, &tm_k, &k_full[s], &k_empty[s]);
                load(sV + s * KV_TILE, &tm_v, &v_full[s], &v_empty[s]);
            }
        }
        return;
    }

    /* ---- consumers ---- */
    setmaxnreg_inc<v3_regs<CWG>::consumer>();
    const int cw = wg - 1, g = lane / 4, t = lane % 4;
    const float c = p.scale_log2; /* > 0: fattn_launch_v3 sends other scales to v2 */
    T *sQw = sQ + cw * 64 * 64, *sOw = sO + cw * 64 * 64; /* this warpgroup's 64 rows of panel 0 */

    float o[NO], s[NS], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; /* m: raw row max of S */
    bool exact = false;             /* see softmax */
    int64_t row0, row1;             /* this thread's two query rows in the current tile */
    unsigned pa[KS][4];

    /* Descriptors: the start-address field (low word) of each tile's base, computed once; a k-step adds a
     * compile-time byte offset >> 4 to it (no carry: shared addresses stay below 256 KB). */
    const unsigned q_lo = desc_lo(sQw, 0), k_lo = desc_lo(sK, 0), v_lo = desc_lo(sV, BC * 128);
    /* S = Q K^T from slot st: DP / 16 k-steps, four per 64-column panel, 32 bytes apart inside it. */
    auto issue_s = [&](int st) {
        const unsigned k_st = k_lo + st * (KV_TILE * 2 >> 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DP / 16; kk++)
            wgmma_ss<BC, T>(s, q_lo + (((kk / 4) * BR * 128 + (kk % 4) * 32) >> 4),
                            k_st + (((kk / 4) * BC * 128 + (kk % 4) * 32) >> 4), kk > 0);
        wgmma_commit();
    };
    /* O += P V from slot st: Bc / 16 k-steps of 16 keys (2048 bytes) each; V's panels are BC * 128 bytes apart. */
    auto issue_pv = [&](int st) {
        const unsigned v_st = v_lo + st * (KV_TILE * 2 >> 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KS; kk++) wgmma_rs<DP, T>(o, pa[kk], v_st + ((kk * 2048) >> 4), 1);
        wgmma_commit();
    };
    /* Online softmax of key block j in s (raw S -> P, float), with c = scale * log2 e > 0 folded into one FFMA:
     * P = exp2(S c - round(m c)).  MASKED (diagonal and tail blocks only): keys a row must not see count as -inf;
     * each row's limit is computed once per block, so the test is one compare and one select per element.  a[]:
     * alpha of the thread's two rows. */
    auto softmax = [&](int j, float a[2], auto masked) {
        float mx[2] = {m[0], m[1]};
        if constexpr (decltype(masked)::value) {
            const int64_t kbase = (int64_t)j * BC;
            int lim[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int64_t e = p.sk - kbase;
                if (p.causal) {
                    const int64_t ec = (r ? row1 : row0) + p.causal_offset + 1 - kbase;
                    e = ec < e ? ec : e;
                }
                lim[r] = e < 0 ? 0 : e > BC ? BC : (int)e;
            }
#pragma unroll
            for (int i = 0; i < NS; i++)
                if (8 * (i / 4) + 2 * t + (i & 1) >= lim[(i >> 1) & 1]) s[i] = -INFINITY;
        }
#pragma unroll
        for (int i = 0; i < NS; i++) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
        float sum[2] = {0.f, 0.f}, mu[2], mc[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = quad_max(mx[r]);
            mu[r] = mx[r] == -INFINITY ? 0.f : mx[r]; /* a row that has seen no key yet: P = 0, not NaN */
            mc[r] = mu[r] * c;
        }
        /* P = exp2(S c - round(m c)) is exact up to a factor common to the row (it cancels in O / l) but overflows
         * once |m c| >= 2^30 (the rounding of m c exceeds 64); such rows, which only absurd logits reach, take
         * P = exp2((S - m) c) from then on.  The flag depends on quad-uniform values only, so a row's four lanes
         * always agree. */
        exact |= !(fabsf(mc[0]) < 0x1p30f && fabsf(mc[1]) < 0x1p30f);
        if (!exact) {
#pragma unroll
            for (int r = 0; r < 2; r++) a[r] = fast_exp2(m[r] * c - mc[r]); /* m = -inf (first block): alpha = 0 */
#pragma unroll
            for (int i = 0; i < NS; i++) {
                s[i] = fast_exp2(fmaf(s[i], c, -mc[(i >> 1) & 1]));
                sum[(i >> 1) & 1] += s[i];
            }
        } else {
#pragma unroll
            for (int r = 0; r < 2; r++) a[r] = fast_exp2((m[r] - mu[r]) * c);
#pragma unroll
            for (int i = 0; i < NS; i++) {
                s[i] = fast_exp2((s[i] - mu[(i >> 1) & 1]) * c);
                sum[(i >> 1) & 1] += s[i];
            }
        }
        m[0] = mx[0];
        m[1] = mx[1];
        l[0] = l[0] * a[0] + sum[0]; /* per-thread partial sums; the quad's are added at the end */
        l[1] = l[1] * a[1] + sum[1];
    };
    /* P (float, the S accumulator layout) -> A fragments: k-step kk takes S's n8 tiles 2 kk and 2 kk + 1. */
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            pa[kk][0] = pack2(s[8 * kk + 0], s[8 * kk + 1], T());
            pa[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3], T());
            pa[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5], T());
            pa[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7], T());
        }
    };
    auto release = [&](uint64_t *b_) {
        __syncwarp();
        if (lane == 0) mbar_arrive(b_);
    };
    /* Ping-pong: each GEMM-issue slot of consumer cw waits for cw's turn and hands the turn to the next consumer.
     * Every consumer has the same slots (per tile: S_0; S_j with P_{j-1} V_{j-1}; the last P V).  The last
     * consumer opens consumer 0's first turn, and consumer 0 takes one extra turn at the end, so every barrier
     * sees as many arrivals as waits. */
    auto turn_wait = [&]() {
        if (PP) named_barrier_sync(V3_BAR_TURN + cw, 256);
    };
    auto turn_pass = [&]() {
        if (PP) named_barrier_arrive(V3_BAR_TURN + (cw + 1) % CWG, 256);
    };
    if (PP && cw == CWG - 1) named_barrier_arrive(V3_BAR_TURN, 256);

    int ring = 0, round = 0;
    for (int64_t tile; (tile = v3_tile_index(round, blockIdx.x, gridDim.x)) < ntiles; round++) {
        const v3_tile w = v3_tile_of(p, BR, BC, tile, head_group);
        const int64_t wg_row = w.i0 + cw * 64; /* the warpgroup's first row */
        row0 = wg_row + warp * 16 + g;
        row1 = row0 + 8;
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
        exact = false;
#pragma unroll
        for (int i = 0; i < NO; i++) o[i] = 0.f;
        /* Key blocks [0, nfree) need no mask for any row of this warpgroup: every key exists and is visible. */
        int64_t nfree64 = p.sk / BC;
        if (p.causal) {
            const int64_t e = (wg_row + p.causal_offset + 1) / BC; /* wg_row sees keys < wg_row + off + 1 */
            nfree64 = wg_row + p.causal_offset + 1 <= 0 ? 0 : e < nfree64 ? e : nfree64;
        }
        const int nfree = (int)(nfree64 < w.nblocks ? nfree64 : w.nblocks);
        /* One step of the pipeline: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together, the softmax of S_j
         * while P_{j-1} V_{j-1} runs, then O rescaled and P_j packed.  Ring slot of block j: ring + j. */
        auto step = [&](int j, float a[2], auto masked) {
            const int rs = ring + j, st = rs % STAGES, sp = (rs - 1) % STAGES;
            mbar_wait(&k_full[st], (rs / STAGES) & 1);
            mbar_wait(&v_full[sp], ((rs - 1) / STAGES) & 1);
            turn_wait();
            issue_s(st);
            issue_pv(sp);
            turn_pass();
            wgmma_wait<1>(); /* S_j done; P_{j-1} V_{j-1} may still run */
            reg_fence(s);
            release(&k_empty[st]);
            softmax(j, a, masked);
            wgmma_wait<0>();
            reg_fence(o);
            release(&v_empty[sp]);
#pragma unroll
            for (int i = 0; i < NO; i++) o[i] *= a[(i >> 1) & 1];
            pack_p();
        };

        mbar_wait(q_full, round & 1);
        if (w.nblocks > 0) {
            float a[2];
            const int st0 = ring % STAGES;
            mbar_wait(&k_full[st0], (ring / STAGES) & 1);
            turn_wait();
            issue_s(st0);
            turn_pass();
            wgmma_wait<0>();
            reg_fence(s);
            release(&k_empty[st0]);
            if (nfree > 0)
                softmax(0, a, std::false_type());
            else
                softmax(0, a, std::true_type());
            pack_p();
            int j = 1;
            for (; j < nfree; j++) step(j, a, std::false_type());
            for (; j < w.nblocks; j++) step(j, a, std::true_type());
            const int rl = ring + w.nblocks - 1, sp = rl % STAGES;
            if (SEP_O) release(q_empty); /* the last S GEMM has read Q: the next tile's Q may land */
            mbar_wait(&v_full[sp], (rl / STAGES) & 1);
            turn_wait();
            issue_pv(sp);
            turn_pass();
            wgmma_wait<0>();
            reg_fence(o);
            release(&v_empty[sp]);
            ring += w.nblocks;
        } else if (SEP_O) {
            release(q_empty);
        }

        /* ---- epilogue: O / l through the O tile (or Q's slot) to a TMA store; LSE directly ---- */
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float lr = quad_sum(l[r]);
            inv[r] = lr > 0.f ? 1.f / lr : 0.f;
            const int64_t row = r ? row1 : row0;
            if (p.lse && t == 0 && row < p.sq)
                p.lse[w.b * p.lse_stride_b + w.h * p.lse_stride_h + row] = lse_from(m[r] * c, lr); /* m: raw units */
        }
        if (tid == 0) tma_store_wait_read(); /* the previous tile's store has read the O tile */
        named_barrier_sync(V3_BAR_EPILOGUE + cw, 128); /* ... and (O in Q's slot) every warp's last S GEMM is done */
#pragma unroll
        for (int i = 0; i < NO; i += 2) {
            const int col = 8 * (i / 4) + 2 * t, r = cw * 64 + warp * 16 + g + ((i & 2) ? 8 : 0);
            const int chunk = (col % 64) / 8;
            unsigned *dst = (unsigned *)(sO + (col / 64) * BR * 64 + r * 64 + ((chunk ^ (r & 7)) * 8) + col % 8);
            *dst = pack2(o[i] * inv[(i >> 1) & 1], o[i + 1] * inv[(i >> 1) & 1], T());
        }
        fence_proxy_async();
        named_barrier_sync(V3_BAR_EPILOGUE + cw, 128);
        if (tid == 0) {
            if (wg_row < p.sq) {
#pragma unroll
                for (int c2 = 0; c2 < PANELS; c2++) tma_store_4d(&tm_o, sOw + c2 * BR * 64, c2 * 64, (int)wg_row, w.h, w.b);
                tma_store_commit();
            }
            if (!SEP_O) { /* Q's slot is free once the store has read it: four arrivals, one per warp's worth */
                tma_store_wait_read();
                mbar_arrive_cnt(q_empty, 4);
            }
        }
    }
    if (PP && cw == 0) turn_wait(); /* the last consumer's final hand-over */
    if (tid == 0) tma_store_wait_read();
}

/* ---- host side ------------------------------------------------------------------------------------------- */

typedef struct {
    v3_config cfg;
    const void *kern[2]; /* fp16, bf16 */
    size_t smem;
} v3_entry;

#define V3_ENTRY(DP, BC, STAGES, CWG, PP)                                                                       \
    {{DP, BC, STAGES, CWG, PP},                                                                                 \
     {(const void *)v3_fwd<__half, DP, BC, STAGES, CWG, PP>, (const void *)v3_fwd<__nv_bfloat16, DP, BC, STAGES, CWG, PP>}, \
     V3_SMEM_BYTES(DP, BC, STAGES, CWG, V3_SEP_O(DP, BC, STAGES, CWG))},
static const v3_entry v3_table[] = {V3_DEFAULT_CONFIGS(V3_ENTRY) V3_SWEEP_CONFIGS(V3_ENTRY)};
#undef V3_ENTRY
#define V3_NCONFIGS ((int)(sizeof v3_table / sizeof v3_table[0]))
#define V3_DEVICES 64
static unsigned long long v3_smem_set[V3_NCONFIGS][2]; /* bit dev: the shared-memory limit is raised there */
static int v3_last = -1;                               /* table index of the last launch, -1: it ran v2 */

extern "C" int fattn_v3_config_count(void) { return V3_NCONFIGS; }
extern "C" const v3_config *fattn_v3_config(int i) { return i >= 0 && i < V3_NCONFIGS ? &v3_table[i].cfg : NULL; }
extern "C" int fattn_v3_last_config(void) { return v3_last; }
extern "C" size_t fattn_v3_config_smem(int i) { return i >= 0 && i < V3_NCONFIGS ? v3_table[i].smem : 0; }

/* cuTensorMapEncodeTiled, reached through the runtime (fattn links no driver library). */
typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                    const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static encode_tiled_fn v3_encode;
static pthread_once_t v3_encode_once = PTHREAD_ONCE_INIT;
static void v3_find_encode(void) {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        v3_encode = (encode_tiled_fn)fn;
    cudaGetLastError();
}

/* A tensor's 4-D map (d, s, heads, batch): boxes of 64 columns x `box_rows` rows, 128-byte swizzled, zeros out of
 * bounds.  Strides are in elements; a dimension of size 1 gets a harmless stride (TMA wants multiples of 16 bytes
 * even where the coordinate is always 0). */
static fattn_status v3_map(CUtensorMap *map, const void *base, fattn_dtype dt, int64_t d, int64_t s, int64_t heads,
                           int64_t batch, int64_t ss, int64_t sh, int64_t sb, int box_rows, const char *name) {
    cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)s, (cuuint64_t)heads, (cuuint64_t)batch};
    int64_t st[3] = {ss, sh, sb};
    for (int i = 0; i < 3; i++) /* size 1: the extent of the dimension inside it, rounded up to 8 elements */
        if (dims[i + 1] == 1) st[i] = ((i ? st[i - 1] : 1) * (int64_t)dims[i] + 7) / 8 * 8;
    cuuint64_t strides[3] = {(cuuint64_t)st[0] * 2, (cuuint64_t)st[1] * 2, (cuuint64_t)st[2] * 2};
    cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1}, estr[4] = {1, 1, 1, 1};
    CUresult r = v3_encode(map, dt == FATTN_F16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
                           (void *)base, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return FATTN_FAIL(FATTN_ERR_CUDA, "v3: cuTensorMapEncodeTiled(%s) failed (CUresult %d)", name, (int)r);
    return FATTN_OK;
}

static bool v3_stride_ok(int64_t stride, int64_t size) { return size == 1 || (stride > 0 && stride % 8 == 0 && stride < (1ll << 38)); }
static bool v3_aligned(const void *ptr) { return (uintptr_t)ptr % 16 == 0; }
/* K and V's head or batch dimension: TMA-addressable, or broadcast (stride 0 in both: expanded K/V, read as one). */
static bool v3_kv_dim_ok(int64_t ks, int64_t vs, int64_t size) {
    return (ks == 0 && vs == 0) || (v3_stride_ok(ks, size) && v3_stride_ok(vs, size));
}

/* 1 if TMA can address every tensor of p: 16-byte aligned bases, positive strides a multiple of 16 bytes (a size-1
 * dimension's stride does not matter; K/V may broadcast heads or batch), 32-bit coordinates. */
static bool v3_tma_ok(const attn_params *p) {
    return v3_aligned(p->q) && v3_aligned(p->k) && v3_aligned(p->v) && v3_aligned(p->o) &&
           v3_stride_ok(p->q_stride_s, p->sq) && v3_stride_ok(p->q_stride_h, p->h) && v3_stride_ok(p->q_stride_b, p->b) &&
           v3_stride_ok(p->k_stride_s, p->sk) && v3_stride_ok(p->v_stride_s, p->sk) &&
           v3_kv_dim_ok(p->k_stride_h, p->v_stride_h, p->h_kv) && v3_kv_dim_ok(p->k_stride_b, p->v_stride_b, p->b) &&
           v3_stride_ok(p->o_stride_s, p->sq) && v3_stride_ok(p->o_stride_h, p->h) && v3_stride_ok(p->o_stride_b, p->b) &&
           p->sq <= 0x7fffffff && p->sk <= 0x7fffffff && p->h <= 0x7fffffff && p->b <= 0x7fffffff;
}

/* v3 accepts what v2 accepts: where TMA cannot address the tensors (odd strides, an output aligned to less than 16
 * bytes) or the scale is not positive, the launch runs v2 instead (fattn._C.last_config() then says v2). */
extern "C" fattn_status fattn_check_v3(const attn_params *p) { return fattn_check_v2(p); }

/* Where v3 is the default on sm_90: TMA-addressable tensors, a positive scale and more than 64 query rows
 * (decode-like calls go to v2's split-KV). */
extern "C" int fattn_prefer_v3(const attn_params *p) { return p->sq > 64 && p->scale > 0.f && v3_tma_ok(p); }

static int dp_of(int64_t d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

/* The busiest block's work over the mean when `grid` persistent blocks walk the tiles in order `group`
 * (v3_tile_index's zig-zag rounds; a tile costs its key blocks plus one for its prologue and epilogue). */
static double v3_imbalance(const attn_params *p, int br, int bc, int64_t grid, int group, int64_t *load) {
    const int64_t ntiles = (p->sq + br - 1) / br * p->b * p->h;
    int64_t total = 0, most = 0;
    for (int64_t x = 0; x < grid; x++) load[x] = 0;
    for (int64_t k = 0; k * grid < ntiles; k++)
        for (int64_t x = 0; x < grid; x++) {
            const int64_t t = v3_tile_index(k, x, grid);
            if (t < ntiles) load[x] += v3_tile_of(*p, br, bc, t, group).nblocks + 1;
        }
    for (int64_t x = 0; x < grid; x++) {
        total += load[x];
        most = load[x] > most ? load[x] : most;
    }
    return total > 0 ? (double)most * grid / total : 1.0;
}

/* The tile order (v3_tile_of's head group): head by head (1), for K and V reuse in L2 -- measured on the H100 at
 * S = 512-2k: 1.1-1.5x faster than heads-fastest; unless the call is causal and the static schedule would then be
 * more than 5% less balanced than heads-fastest (b * h) (S = 16k, D = 128: a 1.54x busiest block by the replay,
 * 1.58x slower measured).  The replay runs once per shape (a few recent ones are remembered) and only for grids of
 * at most 2^20 tiles; larger causal calls take heads-fastest. */
#define V3_ORDER_MEMO 8
typedef struct {
    int64_t sq, sk, bh, offset, grid;
    int br, bc;
    int64_t group;
} v3_order_memo;
static v3_order_memo v3_memo[V3_ORDER_MEMO];
static int v3_memo_next;
static pthread_mutex_t v3_memo_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t v3_order(const attn_params *p, int br, int bc, int64_t grid) {
    const int64_t nbh = p->b * p->h < INT32_MAX ? p->b * p->h : INT32_MAX; /* a group of >= b * h: one group */
    const int64_t ntiles = (p->sq + br - 1) / br * p->b * p->h;
    if (!p->causal || nbh == 1) return 1;
    if (ntiles > (1 << 20)) return nbh;
    int64_t group = 0;
    pthread_mutex_lock(&v3_memo_lock);
    for (int i = 0; i < V3_ORDER_MEMO; i++) {
        const v3_order_memo *m = &v3_memo[i];
        if (m->group && m->sq == p->sq && m->sk == p->sk && m->bh == nbh && m->offset == p->causal_offset &&
            m->grid == grid && m->br == br && m->bc == bc)
            group = m->group;
    }
    pthread_mutex_unlock(&v3_memo_lock);
    if (group) return group;
    int64_t *load = (int64_t *)malloc((size_t)grid * sizeof(int64_t));
    if (!load) return nbh;
    const double by_head = v3_imbalance(p, br, bc, grid, 1, load);
    const double by_block = v3_imbalance(p, br, bc, grid, (int)nbh, load);
    free(load);
    group = by_head <= 1.05 * by_block ? 1 : nbh;
    pthread_mutex_lock(&v3_memo_lock);
    v3_memo[v3_memo_next] = (v3_order_memo){p->sq, p->sk, nbh, p->causal_offset, grid, br, bc, group};
    v3_memo_next = (v3_memo_next + 1) % V3_ORDER_MEMO;
    pthread_mutex_unlock(&v3_memo_lock);
    return group;
}

/* The table entry for p: an explicit p->config (checked), else the first of v3_configs.h's V3_RULES that matches
 * the call, else the default of its head-dim bucket. */
static fattn_status v3_choose(const attn_params *p, int *index) {
    if (p->config >= 0) {
        if (p->config >= V3_NCONFIGS)
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 config %d out of range [0, %d)", p->config, V3_NCONFIGS);
        if (v3_table[p->config].cfg.dp != dp_of(p->d))
            return FATTN_FAIL(FATTN_ERR_INVALID, "v3 config %d is for head dims in the %d bucket", p->config,
                              v3_table[p->config].cfg.dp);
        *index = p->config;
        return FATTN_OK;
    }
    typedef struct {
        v3_config cfg;
        int causal;
        int64_t sk_min, sk_max;
    } v3_rule;
    static const v3_rule rules[] = {
#define V3_RULE(DP, BC, STAGES, CWG, PP, CAUSAL, SK_MIN, SK_MAX) {{DP, BC, STAGES, CWG, PP}, CAUSAL, SK_MIN, SK_MAX},
        V3_RULES(V3_RULE)
#undef V3_RULE
    };
    const int dp = dp_of(p->d);
    *index = -1;
    for (int i = 0; i < V3_NCONFIGS && *index < 0; i++)
        if (v3_table[i].cfg.dp == dp) *index = i; /* the defaults come first, one per bucket */
    if (*index < 0) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3 has no config for head dim %lld", (long long)p->d);
    for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++) {
        const v3_rule *u = &rules[r];
        if (u->cfg.dp != dp || u->causal != (p->causal != 0) || p->sk < u->sk_min || p->sk > u->sk_max) continue;
        for (int i = 0; i < V3_NCONFIGS; i++)
            if (!memcmp(&v3_table[i].cfg, &u->cfg, sizeof(v3_config))) {
                *index = i;
                return FATTN_OK;
            }
    }
    return FATTN_OK;
}

extern "C" fattn_status fattn_launch_v3(const attn_params *p, void *stream) {
    fattn_status st = fattn_check_v3(p);
    if (st) return st;
    if (!v3_tma_ok(p) || !(p->scale > 0.f)) { /* the kernel folds a positive scale into one FFMA */
        v3_last = -1;
        attn_params p2 = *p;
        p2.config = -1; /* v3's config index means nothing to v2 */
        return fattn_launch_v2(&p2, stream);
    }
    int idx = 0;
    if ((st = v3_choose(p, &idx))) return st;
    const v3_entry *e = &v3_table[idx];
    const int ti = p->dtype - FATTN_F16, br = 64 * e->cfg.consumers;
    const int64_t nqb = (p->sq + br - 1) / br, blocks = nqb * p->b * p->h;
    v3_last = idx;
    if (blocks == 0) return FATTN_OK;
    if (blocks > 0x7fffffff) return FATTN_FAIL(FATTN_ERR_UNSUPPORTED, "v3: grid of %lld blocks is too large", (long long)blocks);
    pthread_once(&v3_encode_once, v3_find_encode);
    if (!v3_encode) return FATTN_FAIL(FATTN_ERR_CUDA, "v3: the driver has no cuTensorMapEncodeTiled (CUDA 12+ needed)");
    int dev = 0;
    FATTN_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= V3_DEVICES || !(v3_smem_set[idx][ti] >> dev & 1)) {
        FATTN_CUDA_CHECK(cudaFuncSetAttribute(e->kern[ti], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)e->smem));
        if (dev < V3_DEVICES) v3_smem_set[idx][ti] |= 1ull << dev;
    }
    /* Broadcast K/V dimensions (stride 0) become size 1: every query head reads kv head 0 (h_per_kv = h), every
     * batch kv batch 0.  With Sk = 0 no key block is loaded, but the map still needs a non-empty shape. */
    attn_params pk = *p;
    const int64_t kv_heads = p->k_stride_h == 0 && p->h_kv > 1 ? 1 : p->h_kv;
    const int64_t kv_batch = p->k_stride_b == 0 && p->b > 1 ? 1 : p->b, sk = p->sk > 0 ? p->sk : 1;
    if (kv_heads == 1) pk.h_per_kv = p->h;
    const int kv_batch_step = kv_batch == 1 ? 0 : 1;
    CUtensorMap tq, tk, tv, to;
    if ((st = v3_map(&tq, p->q, p->dtype, p->d, p->sq, p->h, p->b, p->q_stride_s, p->q_stride_h, p->q_stride_b, br, "q")) ||
        (st = v3_map(&tk, p->k, p->dtype, p->d, sk, kv_heads, kv_batch, p->k_stride_s, p->k_stride_h, p->k_stride_b, e->cfg.bc, "k")) ||
        (st = v3_map(&tv, p->v, p->dtype, p->d, sk, kv_heads, kv_batch, p->v_stride_s, p->v_stride_h, p->v_stride_b, e->cfg.bc, "v")) ||
        (st = v3_map(&to, p->o, p->dtype, p->d, p->sq, p->h, p->b, p->o_stride_s, p->o_stride_h, p->o_stride_b, 64, "out")))
        return st;
    const int64_t grid = blocks < p->sm_count ? blocks : p->sm_count; /* persistent: one block per SM */
    const int head_group = (int)v3_order(p, br, e->cfg.bc, grid);
    void *args[] = {&tq, &tk, &tv, &to, &pk, (void *)&kv_batch_step, (void *)&head_group};
    FATTN_CUDA_CHECK(cudaLaunchKernel(e->kern[ti], dim3((unsigned)(grid > 0 ? grid : 1)), dim3(128 * (e->cfg.consumers + 1)),
                                      args, e->smem, (cudaStream_t)stream));
    return FATTN_OK;
}
