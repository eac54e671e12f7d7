/* v3_fwd_kernel.cuh -- version 3: Hopper (sm_90a) forward, the FlashAttention-3 structure.
 *
 * Adds over v2: wgmma instead of mma.sync, TMA instead of cp.async, and warp specialisation.
 * A block is one producer warpgroup and CONSUMERS (2 or 3) consumer warpgroups of 64 query rows each:
 *   the producer: one thread (for a paged cache a lane per page piece) issues every TMA load (Q per tile; K_j, V_j
 *     for each key block of Bc keys into a ring of STAGES shared-memory slots, each slot with a "full" mbarrier the
 *     TMA completes and an "empty" mbarrier the consumers arrive on), and gives its registers away
 *     (setmaxnreg.dec) -- v3_fwd_producer.cuh;
 *   the consumers (setmaxnreg.inc), per key block:
 *     S = Q K_j^T      wgmma m64nBck16, both operands in 128-byte-swizzled shared memory
 *     MODS             (kernels of their own, the defaults' configs): S in log2 units, the softcap c2 tanh(S2 / c2)
 *                      by tanh.approx, ALiBi's -slope2 |pos - j|; the softmax then runs at scale 1
 *     masked -> -inf   (only in edge blocks of the mask, a uniform branch around it: two compares + a select per
 *                      element; one copy of the step serves both kinds of block, which keeps the kernel small)
 *     m' = max(m, rowmax S) (quad shuffles) -- lazily: a warp keeps m unless a row's max grew by more than
 *                      V3_MAX_SLACK, and only then rescales O --,  P = exp2(S c - m' c) with c = scale log2 e in one
 *                      FFMA,  l = alpha l + rowsum P
 *     O = alpha O + P V_j   wgmma m64nDk16 with P from registers (the S accumulators re-packed as A fragments)
 *                      and V N-major from shared memory (transposed by the descriptor, no copy)
 *   software-pipelined inside each consumer: S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued back to back, the
 *   softmax of S_{j+1} runs while P_j V_j is still on the tensor cores; and ping-pong between consumers (named
 *   barriers): they take turns issuing GEMMs, so one's softmax overlaps another's GEMMs.
 * Q has two slots where they fit with the O tile (v3_configs.h: D=64 and D=128 at Bc = 128), so a tile's Q loads
 * while the tile before it runs; there (FLAT, two consumers) the tiles run back to back: a tile's last P V is
 * issued with the next tile's S_0, and its epilogue runs once both are done.
 * O is written back through a shared-memory tile (its own where it fits, else the consumer's Q slot; swizzled like
 * TMA's loads) by a TMA store, which drops rows past the sequence end; attention sinks (p.sinks) join each row's
 * denominator there (csrc/sinks.h: the rule the sinks pass applies after other kernels).  TMA loads fill rows past a
 * sequence's end with zeros, so no load reads past it.  A tile visits only the key blocks its rows see (mask.h:
 * fattn_key_span), and in dense calls a consumer computes only those its own rows see: past them it takes its turns
 * and releases the blocks (causal D=256 S=512 / 1k 1.035 / 1.041x, D=64 4k 1.027x on an H100).
 * Split tails (three consumers, dense calls; the rule and the grid: v3_plan.c): a head's last query block of at most
 * 64 rows has every consumer on its rows, consumer c taking key blocks c, c + 3, ..., and consumer 0 merging the
 * three partial results (see split_tail_tile) -- else two consumers compute rows that do not exist through the
 * tile.  H100, D=64 non-causal: S=1k 1.073x faster (0.93 -> 1.00x cudnn), 4k 1.022x.  A consumer with no rows in
 * a tile (a tail of 65-128 rows, not split) only passes its turns and releases the blocks: S=512
 * 1.043x (evidence/bench/h100_v3_fwd_split_tails_8223c72.md).
 * SEQ (kernels of their own, V3_SEQ_CONFIGS: the D=128 / 256 defaults, D=64 on two consumers): per-sequence
 * lengths -- packed batches (TMA maps over all the rows, a sequence's tiles starting at its first row) and
 * seqused_k.  Rows of the next sequence that a tile's loads pick up are masked (keys) or never stored: a sequence's
 * last, partial 64 rows of O are stored by each thread instead of by TMA.  Static schedule: tiles past a sequence's
 * queries skipped by producer and consumers alike.  DYN (the SEQ kernels again): the dynamic schedule -- tiles
 * from a counter, only those that exist (v3_schedule.h: v3_seq_tile), the producer naming each tile's successor
 * beside its Q; run wherever the dispatch has a counter (not under CUDA graph capture).  H100, against the static
 * schedule: ragged batches 1.06-1.62x, equal lengths 0.98-1.03x (evidence/serving/h100_v3_dyn_schedule_*.md).
 * PAGED (the SEQ kernels again, either schedule): K and V from a paged cache through the block table, loaded by
 * a lane of the producer's first warp per piece of a key block (v3_fwd_producer.cuh); kernels of their own, since
 * the warp cost the contiguous calls 1.5-6% where they shared the kernel
 * (evidence/serving/h100_v3_paged_warp_3b0354c.md).
 * Head dims are bucketed (DP = 64 / 128 / 256; columns past d zero-filled by TMA); fp16 and bf16.
 * Needs q, k, v, out 16-byte aligned with every stride a multiple of 8 elements (TMA's rule; K/V may broadcast
 * over heads or batch with stride 0) and a positive scale; other calls run v2, and by default decode-like calls
 * (Sq <= 64) go to v2's split-KV.
 * The grid is persistent (one block per SM, two or three with one consumer; tiles in zig-zag rounds, head by head
 * so the blocks in flight share K/V in L2, or longest first over all heads where a causal schedule needs it for
 * balance; v3_schedule.h, chosen by v3_plan.c); the K/V ring and the turns run on across tiles.  Configurations:
 * v3_configs.h (bench/ab.py times them).  Built for sm_90a only (kernels/sm90/gencode).  Speed (H100, fa3 fp16,
 * evidence/bench/h100_v3_ratios_f464541.md): 0.88-1.24x torch cudnn, >= 1.05 at 17 of 36 points; D=128 S=16k
 * non-causal 686 TFLOP/s in 9034942's pass (617 in f464541's, cudnn 647 / 616).  Weakest: D=64 causal at
 * S=512-2k (0.88-0.90x, the rule configs). */
#ifndef FATTN_V3_FWD_KERNEL_CUH
#define FATTN_V3_FWD_KERNEL_CUH

#include <cuda.h> /* CUtensorMap: the kernel's TMA maps arrive as __grid_constant__ parameters */

#include "../mma.cuh"
#include "hopper.cuh"
#include "v3_configs.h"
#include "v3_fwd_producer.cuh"
#include "v3_schedule.h"
#include "wgmma_tiles.cuh"

/* Register split per consumer count and blocks per SM: the producer keeps `producer`, consumers get the rest
 * (multiples of 8, 128 * (producer + consumers * consumer) <= 65536 / blocks per SM). */
template <int CWG, int BLOCKS> struct v3_regs;
template <> struct v3_regs<1, 3> { static constexpr int producer = 24, consumer = 136; };
template <> struct v3_regs<1, 2> { static constexpr int producer = 24, consumer = 232; };
template <> struct v3_regs<2, 1> { static constexpr int producer = 24, consumer = 240; };
template <> struct v3_regs<3, 1> { static constexpr int producer = 32, consumer = 160; };

/* The lazy row max's slack, log2 units (see the softmax): P stays below 2^8, well inside fp16 and bf16. */
#define V3_MAX_SLACK 8.f

/* Named barriers (0 is __syncthreads): 1..3 a consumer warpgroup's own epilogue, 4..6 the ping-pong turns, 7 and 8
 * a split tail's merge (7: the merge area free, 8: the partials written). */
#define V3_BAR_EPILOGUE 1
#define V3_BAR_TURN 4
#define V3_BAR_MERGE_FREE 7
#define V3_BAR_MERGE_FULL 8

/* CWG consumer warpgroups of 64 rows each (Br = 64 CWG); PP: ping-pong, the consumers take turns issuing their
 * GEMMs (named barriers), so one's softmax runs while another's GEMMs use the tensor cores.  The grid is
 * persistent (v3_tile_index: one tile per block per round, zig-zag); the K/V ring and the turns run on across
 * tiles, so the producer loads the next tile's Q and first K/V while the consumers finish the current one. */
template <typename T, int DP, int BC, int STAGES, int CWG, bool PP, bool MODS, bool SEQ, bool DYN, bool PAGED>
__global__ void __launch_bounds__(128 * (CWG + 1), V3_BLOCKS_PER_SM(DP, BC, STAGES, CWG))
v3_fwd(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
       const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o, const attn_params p,
       const int kv_batch_step, const int head_group, const int split_tail, unsigned *const tile_ctr) {
    static_assert(!(PP && CWG == 1), "ping-pong needs two consumers");
    static_assert(V3_SMEM(DP, BC, STAGES, CWG) <= V3_SMEM_MAX(DP, BC, STAGES, CWG),
                  "the config's tiles exceed its shared memory");
    using regs = v3_regs<CWG, V3_BLOCKS_PER_SM(DP, BC, STAGES, CWG)>;
    constexpr int BR = 64 * CWG;
    constexpr int QB = V3_QB(DP, BC, STAGES, CWG); /* Q slots: tile t's Q in slot t % QB */
    constexpr bool SEP_O = V3_SEP_O(DP, BC, STAGES, CWG);
    /* tiles back to back (see the consumers' loop); two Q slots imply SEP_O.  Two consumers only: with three, at
     * 160 registers, the finished tile's state spilled 68-252 bytes; with one (two blocks per SM) it measured
     * 0.98-0.99x the per-tile loop at S=512 (evidence/bench/h100_v3_fwd_flat_c8570e5.md). */
    constexpr bool FLAT = V3_FLAT(DP, BC, STAGES, CWG);
    constexpr int PANELS = DP / 64;           /* 64-column panels of a tile */
    constexpr int Q_TILE = BR * DP, KV_TILE = BC * DP; /* elements */
    constexpr int NS = BC / 2, NO = DP / 2;   /* accumulators per thread: S (64 x Bc) and O (64 x DP) */
    constexpr int KS = BC / 16;               /* k-steps of O += P V, and A fragments of P */
    /* split tails (v3_schedule.h; split_tail from the plan): three consumers of the dense kernels, which have the
     * merge area (the O tile and V3_MERGE_EXTRA bytes after it) and take turns */
    constexpr bool CAN_SPLIT = CWG == 3 && !SEQ;
    static_assert(!CAN_SPLIT || (SEP_O && PP && !FLAT), "split tails merge in the O tile, between turns, per tile");
    const int split = CAN_SPLIT ? split_tail : 0;
    extern __shared__ unsigned char smem_raw[];
    T *sQ = (T *)smem_align1024(smem_raw);
    T *sK = sQ + (QB + (SEP_O ? 1 : 0)) * Q_TILE + V3_MERGE_EXTRA(DP, CWG) / 2, *sV = sK + STAGES * KV_TILE;
    /* DYN: beside Q slot i, the tile after the one whose Q it holds: (i0, b, h, 1), or zeros where there is none;
     * q_tile[QB]: the block's first tile */
    int4 *q_tile = (int4 *)(sV + STAGES * KV_TILE);
    uint64_t *bar = (uint64_t *)(q_tile + QB + 1);
    uint64_t *q_full = bar, *q_empty = bar + QB, *k_full = bar + 2 * QB, *v_full = k_full + STAGES,
             *k_empty = v_full + STAGES, *v_empty = k_empty + STAGES;
    uint64_t *q_read = v_empty + STAGES; /* DYN: every consumer warp has read q_tile[i] */
    const v3_fwd_smem<T> sm = {sQ, sK, sV, q_tile, q_full, q_empty, k_full, v_full, k_empty, v_empty, q_read};
    /* DYN (SEQ only): the dynamic schedule (v3_schedule.h: v3_seq_tile), tiles from tile_ctr (zero at launch) */
    static_assert(SEQ || !(DYN || PAGED), "the dynamic schedule and paged caches are for per-sequence calls");
    constexpr bool dynamic = DYN;
    const int64_t ntiles = v3_ntiles(&p, BR);

    /* Launched as the previous kernel's programmatic dependent (v3_fwd.cu): the launch and the blocks' start overlap
     * that kernel's end, and nothing here touches global memory before it has completed.  A kernel launched the
     * same way behind this one may start once every block here has begun (all are resident: the grid is
     * persistent); it waits for this grid itself. */
    griddep_wait();
    griddep_launch_dependents();
    const int wg = warpgroup_index(), tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    if (threadIdx.x == 0) {
        for (int i = 0; i < QB; i++) {
            mbar_init(&q_full[i], 1);
            mbar_init(&q_empty[i], 4 * CWG); /* one arrival per consumer warp */
            mbar_init(&q_read[i], 4 * CWG);
        }
        if (dynamic) { /* the block's first tile: number blockIdx.x */
            v3_seq_cursor seqs = {0, 0};
            v3_tile w;
            q_tile[QB] = v3_seq_tile(&p, BR, (int)blockIdx.x, &seqs, &w) ? make_int4((int)w.i0, w.b, w.h, 1)
                                                                           : make_int4(0, 0, 0, 0);
        }
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
            mbar_init(&k_empty[s], 4 * CWG);
            mbar_init(&v_empty[s], 4 * CWG);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) { /* ---- producer (v3_fwd_producer.cuh) ---- */
        setmaxnreg_dec<regs::producer>();
        if (warp == 0 && lane < (PAGED ? v3_page_pieces(p.page_size, BC) : 1)) /* paged: a lane per piece */
            v3_fwd_produce<T, DP, BC, STAGES, CWG, SEQ, DYN, PAGED>(&tm_q, &tm_k, &tm_v, p, sm, kv_batch_step,
                                                                    head_group, split, tile_ctr, lane);
        return;
    }

    /* ---- consumers ---- */
    setmaxnreg_inc<regs::consumer>();
    const int cw = wg - 1, g = lane / 4, t = lane % 4;
    /* c: the softmax's scale, > 0 (fattn_launch_v3 sends other scales to v2).  MODS (a softcap, ALiBi): S is taken
     * to log2 units first (S c_in), capped, biased, and the softmax runs at c = 1. */
    const float c_in = p.scale_log2, c = MODS ? 1.f : c_in;
    const float cap2 = p.softcap * FATTN_LOG2E, inv_cap2 = MODS && cap2 > 0.f ? 1.f / cap2 : 0.f;
    float slope2 = 0.f; /* ALiBi's slope of the tile's head (log2 units) */

    float o[NO], s[NS], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; /* m: raw row max of S */
    bool exact = false;             /* see softmax */
    int64_t row0, row1;             /* this thread's two query rows in the current tile */
    int seq_q = (int)p.sq, seq_k = (int)p.sk; /* the tile's sequence's lengths (SEQ: its own; < 2^31, the planner's rule) */
    int64_t k_first;                /* the first key of the tile's first key block */
    unsigned pa[KS][4];

    /* Descriptors: the start-address field (low word) of each tile's base, computed once; a k-step adds a
     * compile-time byte offset >> 4 to it (no carry: shared addresses stay below 256 KB). */
    const unsigned k_lo = desc_lo(sK, 0), v_lo = desc_lo(sV, BC * 128);
    unsigned q_lo; /* the current tile's Q slot, this warpgroup's 64 rows */
    /* S = Q K^T from slot st: DP / 16 k-steps, four per 64-column panel, 32 bytes apart inside it. */
    auto issue_s = [&](int st) {
        const unsigned k_st = k_lo + st * (KV_TILE * 2 >> 4);
        wgmma_fence();
        wgmma_kmajor_tiles<BC, T, DP, BR, BC>(s, q_lo, k_st);
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
     * P = exp2(S c - round(m c)).  masked (the mask's edge blocks only): keys a row must not see count as -inf;
     * each row's visible columns are computed once per block, so the test is two compares and one select per
     * element.  a[]: alpha of the thread's two rows.  The row max is lazy: a warp moves its rows' m only when one
     * of them grew by more than V3_MAX_SLACK (log2 units) since m was set, so P <= 2^V3_MAX_SLACK, and most blocks
     * leave O as it is.  Returns whether the warp moved m (the caller then rescales O by a). */
    auto softmax = [&](int j, float a[2], bool masked) -> bool {
        float mx[2] = {m[0], m[1]};
        if constexpr (MODS) { /* softcap, then ALiBi: the distance of row0 to key kbase + 2 t in float, once */
            const float dist0 = (float)(row0 + seq_k - seq_q - (k_first + (int64_t)j * BC) - 2 * t);
#pragma unroll
            for (int i = 0; i < NS; i++) {
                float e = s[i] * c_in;
                if (cap2 > 0.f) e = cap2 * fast_tanh(e * inv_cap2);
                s[i] = fmaf(-slope2, fabsf(dist0 + (float)(8 * ((i >> 1) & 1) - 8 * (i / 4) - (i & 1))), e);
            }
        }
        if (masked) {
            const int64_t kbase = k_first + (int64_t)j * BC;
            int lo[2], hi[2]; /* the keys of this block each of the thread's two rows sees */
            const fattn_block_mask bm = fattn_block_mask_of(&p.mask, SEQ ? seq_q : p.sq, SEQ ? seq_k : p.sk, row0, kbase);
            fattn_block_cols(&bm, 0, BC, &lo[0], &hi[0]);
            fattn_block_cols(&bm, 8, BC, &lo[1], &hi[1]);
#pragma unroll
            for (int i = 0; i < NS; i++) {
                const int col = 8 * (i / 4) + 2 * t + (i & 1), r = (i >> 1) & 1;
                if (col < lo[r] || col >= hi[r]) s[i] = -INFINITY;
            }
        }
#pragma unroll
        for (int i = 0; i < NS; i++) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
        float sum[2] = {0.f, 0.f}, mu[2], mc[2];
#pragma unroll
        for (int r = 0; r < 2; r++) mx[r] = quad_max(mx[r]);
        /* m = -inf grows on any finite max; a row still at -inf (NaN difference) does not */
        const bool moved =
            __any_sync(0xffffffffu, (mx[0] - m[0]) * c > V3_MAX_SLACK || (mx[1] - m[1]) * c > V3_MAX_SLACK);
        if (!moved) mx[0] = m[0], mx[1] = m[1];
#pragma unroll
        for (int r = 0; r < 2; r++) {
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
        return moved;
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

    int ring = 0, round = 0, qround = 0;
    /* dynamic: the next tile -- the block's first, then the one its Q slot names */
    int4 next_w = dynamic ? q_tile[QB] : make_int4(0, 0, 0, 0);
    /* The next tile this block runs (the producer skips the same ones): false when there is none. */
    auto next_tile = [&](v3_tile &w, fattn_extent &x, int &qr) -> bool {
        if (dynamic) {
            if (!next_w.w) return false;
            w.i0 = next_w.x;
            w.b = next_w.y;
            w.h = next_w.z;
            w.split = 0;
            x = fattn_extent_of(&p, w.b);
            v3_tile_span(&p, BR, BC, x.sq, x.sk, &w);
            qr = qround++;
            return true;
        }
        for (int64_t tile; (tile = v3_tile_index(round, blockIdx.x, gridDim.x)) < ntiles; round++) {
            w = v3_fwd_place<FLAT>(&p, BR, tile, head_group, split);
            x = SEQ ? fattn_extent_of(&p, w.b) : fattn_dense_extent(&p);
            if (SEQ && w.i0 >= x.sq) continue; /* past its sequence's queries: no tile at all */
            v3_tile_span(&p, BR, BC, x.sq, x.sk, &w);
            qr = SEQ ? qround++ : round;
            round++;
            return true;
        }
        return false;
    };
    /* What a tile's epilogue needs once the next tile's softmax has taken over m, l and the rows. */
    struct v3_done {
        int b, h, q0, seq_q, qs;
        int64_t wg_row; /* the thread's rows: wg_row + 16 warp + g, and + 8 */
        float m[2], l[2];
    };
    v3_done cur;    /* the current tile's (m, l filled in when it ends) */
    int f0 = 0, f1 = 0; /* the current tile's key blocks [f0, f1) are unmasked for this warpgroup's rows */
    int seen = 0;       /* its key blocks [0, seen) hold keys some row of this warpgroup's sees (none past them);
                           dense calls only (SEQ: with it D=256's kernels spilled 44 bytes) */
    /* Starts tile w (Q's slot waited for): the softmax's per-tile state, Q's descriptor, the mask's block range. */
    auto begin_tile = [&](const v3_tile &w, const fattn_extent &x, int qr) {
        cur.qs = qr % QB;
        cur.b = w.b;
        cur.h = w.h;
        cur.q0 = (int)x.q0; /* in 32 bits (registers are short at D = 64) */
        if (SEQ) {
            seq_q = (int)x.sq;
            seq_k = (int)x.sk;
        }
        cur.seq_q = SEQ ? seq_q : (int)p.sq;
        const int own_rows = CAN_SPLIT && w.split ? 0 : cw; /* a split tail: every consumer on the tile's 64 rows */
        cur.wg_row = w.i0 + own_rows * 64; /* the warpgroup's first row */
        row0 = cur.wg_row + warp * 16 + g;
        row1 = row0 + 8;
        k_first = (int64_t)w.n_min * BC;
        if (MODS) slope2 = fattn_alibi_slope2(&p, w.b, w.h);
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
        exact = false;
        q_lo = desc_lo(sQ + cur.qs * Q_TILE + own_rows * 64 * 64, 0);
        /* The tile's key blocks are n_min + [0, nblocks); of them, this warpgroup's rows all see [f0, f1) whole (no
         * mask); the blocks before f0 and from f1 on are masked. */
        const fattn_span wsp = fattn_key_span(&p.mask, SEQ ? seq_q : p.sq, SEQ ? seq_k : p.sk, cur.wg_row, 64, BC);
        f0 = (int)(wsp.n_full_min - w.n_min < 0 ? 0 : wsp.n_full_min - w.n_min > w.nblocks ? w.nblocks
                                                                                           : wsp.n_full_min - w.n_min);
        f1 = (int)(wsp.n_full_max - w.n_min < f0 ? f0 : wsp.n_full_max - w.n_min > w.nblocks ? w.nblocks
                                                                                             : wsp.n_full_max - w.n_min);
        if (!SEQ)
            seen = (int)(wsp.n_max - w.n_min < 0         ? 0
                         : wsp.n_max - w.n_min > w.nblocks ? w.nblocks
                                                           : wsp.n_max - w.n_min);
        if (cur.wg_row >= cur.seq_q) { /* rows past the sequence (a last, partial tile): never stored, so spare them the mask */
            f0 = 0;
            f1 = w.nblocks;
        }
        mbar_wait(&q_full[cur.qs], (qr / QB) & 1);
        if (dynamic) { /* the tile after this one, then the entry back to the producer */
            next_w = q_tile[cur.qs];
            release(&q_read[cur.qs]);
        }
    };
    auto masked = [&](int j) { return j < f0 || j >= f1; }; /* a window's left edge, the diagonal, the tail */
    auto finish = [&]() { /* the current tile's m and l, for its epilogue */
        cur.m[0] = m[0], cur.m[1] = m[1], cur.l[0] = l[0], cur.l[1] = l[1];
        return cur;
    };

    /* ---- epilogue of tile e: O / l (zeros for a tile that saw no key block) through the O tile (or Q's slot) to a
     * TMA store; LSE directly ---- */
    auto epilogue = [&](const v3_done &e, bool empty) {
        T *sO = SEP_O ? sQ + QB * Q_TILE : sQ + e.qs * Q_TILE;
        T *sOw = sO + cw * 64 * 64; /* this warpgroup's 64 rows of panel 0 */
        const int64_t r0 = e.wg_row + warp * 16 + g, r1 = r0 + 8;
        float inv[2];
        const float sink2 = p.sinks ? p.sinks[e.h] * FATTN_LOG2E : 0.f;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float lr = empty ? 0.f : quad_sum(e.l[r]);
            inv[r] = lr > 0.f ? 1.f / lr : 0.f;
            float lse2 = lr > 0.f ? e.m[r] * c + __log2f(lr) : -INFINITY; /* m: raw units (or log2 units at c = 1) */
            if (p.sinks) sink_join2(sink2, &lse2, &inv[r]);
            const int64_t row = r ? r1 : r0;
            if (p.lse && t == 0 && row < e.seq_q)
                p.lse[e.b * p.lse_stride_b + (SEQ ? e.q0 : 0) + e.h * p.lse_stride_h + row] = lse2 * FATTN_LN2;
        }
        auto out2 = [&](int i) { /* O's elements i, i + 1, packed */
            const float y = inv[(i >> 1) & 1];
            return empty ? 0u : pack2(o[i] * y, o[i + 1] * y, T());
        };
        if (tid == 0) tma_store_wait_read(); /* the previous tile's store has read the O tile */
        named_barrier_sync(V3_BAR_EPILOGUE + cw, 128); /* ... and (O in Q's slot) every warp's last S GEMM is done */
        if (SEQ && e.wg_row + 64 > e.seq_q) { /* a sequence's last rows: stored by each thread, none past its end (a
                                                TMA store of the 64 rows would write into the next sequence's) */
            T *out = (T *)p.o + (p.cu_seqlens_q ? 0 : e.b * p.o_stride_b) + (int64_t)e.q0 * p.o_stride_s +
                     e.h * p.o_stride_h;
#pragma unroll
            for (int i = 0; i < NO; i += 2) {
                const int col = 8 * (i / 4) + 2 * t;
                const int64_t row = ((i >> 1) & 1) ? r1 : r0;
                if (row < e.seq_q && col < p.d) *(unsigned *)(out + row * p.o_stride_s + col) = out2(i);
            }
            if (!SEP_O && tid == 0) mbar_arrive_cnt(&q_empty[e.qs], 4); /* Q's slot held no O: free once the GEMMs are */
            return;
        }
#pragma unroll
        for (int i = 0; i < NO; i += 2) {
            const int col = 8 * (i / 4) + 2 * t, r = cw * 64 + warp * 16 + g + ((i & 2) ? 8 : 0);
            const int chunk = (col % 64) / 8;
            *(unsigned *)(sO + (col / 64) * BR * 64 + r * 64 + ((chunk ^ (r & 7)) * 8) + col % 8) = out2(i);
        }
        fence_proxy_async();
        named_barrier_sync(V3_BAR_EPILOGUE + cw, 128);
        if (tid == 0) {
            if (e.wg_row < e.seq_q) {
                const int orow = (SEQ ? e.q0 : 0) + (int)e.wg_row, ob = SEQ && p.cu_seqlens_q ? 0 : e.b;
#pragma unroll
                for (int c2 = 0; c2 < PANELS; c2++) tma_store_4d(&tm_o, sOw + c2 * BR * 64, c2 * 64, orow, e.h, ob);
                tma_store_commit();
            }
            if (!SEP_O) { /* Q's slot is free once the store has read it: four arrivals, one per warp's worth */
                tma_store_wait_read();
                mbar_arrive_cnt(&q_empty[e.qs], 4);
            }
        }
    };

    /* One step of the pipeline: S_j = Q K_j^T (ring slot rs) and O += P V of the block before (slot rp, which every
     * caller passes as rs - 1; the parameter stays from an earlier form of the split tails because folding it back
     * changes the SASS, which no GPU run has checked) issued together, the softmax of S_j while that P V runs.
     * Returns with P V done, and whether m moved; the caller rescales O if it did (or, when the P V was another
     * tile's last, stores that tile) and packs P_j. */
    auto step_gemms = [&](int rs, int rp, int j, float a[2]) -> bool {
        const int st = rs % STAGES, sp = rp % STAGES;
        mbar_wait(&k_full[st], (rs / STAGES) & 1);
        mbar_wait(&v_full[sp], (rp / STAGES) & 1);
        turn_wait();
        issue_s(st);
        issue_pv(sp);
        turn_pass();
        wgmma_wait<1>(); /* S_j done; the P V may still run */
        reg_fence(s);
        release(&k_empty[st]);
        const bool moved = softmax(j, a, masked(j));
        wgmma_wait<0>();
        reg_fence(o);
        release(&v_empty[sp]);
        return moved;
    };
    /* The consumer's first S of a tile (block j, ring slot rs), alone (the first tile's, or every tile's without
     * FLAT), and its softmax; returns whether m moved */
    auto first_block = [&](int rs, int j, float a[2]) -> bool {
        const int st0 = rs % STAGES;
        mbar_wait(&k_full[st0], (rs / STAGES) & 1);
        turn_wait();
        issue_s(st0);
        turn_pass();
        wgmma_wait<0>();
        reg_fence(s);
        release(&k_empty[st0]);
        return softmax(j, a, masked(j));
    };
    /* a tile's last P V (ring slot rl), alone (the last tile's, or every tile's without FLAT) */
    auto last_pv = [&](int rl) {
        const int sp = rl % STAGES;
        mbar_wait(&v_full[sp], (rl / STAGES) & 1);
        turn_wait();
        issue_pv(sp);
        turn_pass();
        wgmma_wait<0>();
        reg_fence(o);
        release(&v_empty[sp]);
    };
    auto zero_o = [&]() {
#pragma unroll
        for (int i = 0; i < NO; i++) o[i] = 0.f;
    };
    auto rescale_o = [&](const float a[2]) {
#pragma unroll
        for (int i = 0; i < NO; i++) o[i] *= a[(i >> 1) & 1];
    };
    /* ---- a split tail (v3_schedule.h): one query block of at most 64 rows, Q's first 64 rows in every consumer,
     * consumer cw taking key blocks cw, cw + CWG, ...; the others' blocks it waits for and releases at once.  A
     * consumer runs each of its blocks whole -- S, the softmax, P V, two GEMM turns -- and so holds a V slot only
     * while its P V runs (with each P V issued beside the consumer's next S, as in full tiles, the three consumers
     * would hold three of the four V slots at once).  Whether that matters was not isolated: with the tails placed
     * after every full tile both forms ran 1.03x over no split at D=64, S=1k on an H100, for another reason
     * (evidence/bench/h100_v3_fwd_split_tails_8223c72.md).  Each consumer takes as many turns as the busiest one
     * (empty turns after its own), then consumers 1.. hand consumer 0 their O, m and l (per thread, in the
     * accumulator layout) through the merge area, and consumer 0 rescales them to the largest m, adds them up and
     * runs the epilogue. ---- */
    auto skip_block = [&](int rs) { /* a block this consumer does not compute: back to the producer once loaded */
        const int st = rs % STAGES;
        mbar_wait(&k_full[st], (rs / STAGES) & 1);
        release(&k_empty[st]);
        mbar_wait(&v_full[st], (rs / STAGES) & 1);
        release(&v_empty[st]);
    };
    auto whole_block = [&](int rs, int j) { /* S_j, its softmax, O += P_j V_j, each GEMM in a turn of its own */
        float a[2];
        if (first_block(rs, j, a)) rescale_o(a);
        pack_p();
        last_pv(rs);
    };
    auto merge_tail = [&]() {
        constexpr int PART = 64 * DP + 4 * 128; /* floats of a consumer's partial: O, then m and l per thread */
        float *area = (float *)(sQ + QB * Q_TILE);
        if (tid == 0) tma_store_wait_read(); /* this warpgroup's stores have read the O tile */
        if (cw > 0) {
            named_barrier_sync(V3_BAR_MERGE_FREE, 128 * CWG); /* consumer 0 has read the last tail's partials */
            float *part = area + (cw - 1) * PART;
#pragma unroll
            for (int i = 0; i < NO; i++) part[i * 128 + tid] = o[i];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                part[NO * 128 + r * 128 + tid] = m[r];
                part[NO * 128 + (2 + r) * 128 + tid] = l[r];
            }
            named_barrier_arrive(V3_BAR_MERGE_FULL, 128 * CWG);
            return;
        }
        named_barrier_arrive(V3_BAR_MERGE_FREE, 128 * CWG);
        named_barrier_sync(V3_BAR_MERGE_FULL, 128 * CWG);
        float mm[2] = {m[0], m[1]};
#pragma unroll
        for (int u = 1; u < CWG; u++)
#pragma unroll
            for (int r = 0; r < 2; r++) mm[r] = fmaxf(mm[r], area[(u - 1) * PART + NO * 128 + r * 128 + tid]);
        /* each partial is O and l up to the factor 2^(m c) of its own m: to the largest, 2^((m - mm) c) (0 for a
         * consumer that saw no key, m = -inf; a row no consumer saw keeps its zeros) */
        auto to_max = [&](float mr, int r) { return mm[r] == -INFINITY ? 0.f : exp2f((mr - mm[r]) * c); };
        float f[2] = {to_max(m[0], 0), to_max(m[1], 1)};
        rescale_o(f);
        l[0] *= f[0];
        l[1] *= f[1];
#pragma unroll
        for (int u = 1; u < CWG; u++) {
            const float *part = area + (u - 1) * PART;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                f[r] = to_max(part[NO * 128 + r * 128 + tid], r);
                l[r] += part[NO * 128 + (2 + r) * 128 + tid] * f[r];
            }
#pragma unroll
            for (int i = 0; i < NO; i++) o[i] += part[i * 128 + tid] * f[(i >> 1) & 1];
        }
        m[0] = mm[0];
        m[1] = mm[1];
        epilogue(finish(), false);
    };
    auto split_tail_tile = [&](int nb) {
        int done = 0, own = 0; /* [0, done): blocks handled */
        for (int j = cw; j < nb; j += CWG, own++) {
            for (; done < j; done++) skip_block(ring + done);
            whole_block(ring + j, j);
            done = j + 1;
        }
        release(&q_empty[cur.qs]); /* (SEP_O) the consumer's last S GEMM has read Q */
        for (; done < nb; done++) skip_block(ring + done);
        for (int u = own; u < (nb + CWG - 1) / CWG; u++) { /* the busiest consumer's blocks, two turns each */
            turn_wait();
            turn_pass();
            turn_wait();
            turn_pass();
        }
        ring += nb;
        merge_tail();
    };

    v3_tile w;
    fattn_extent x;
    int qr;
    if constexpr (FLAT) {
        /* Tiles back to back: a tile's last P V is issued with the next tile's S_0 (its Q already in the other slot),
         * and the tile's epilogue runs once both are done -- no GEMM issued alone at a tile's start or end but the
         * block's first and last.  Tiles that see no key block are stored (zeros) as they come. */
        auto next_nonempty = [&]() -> bool {
            while (next_tile(w, x, qr)) {
                begin_tile(w, x, qr);
                if (w.nblocks > 0) return true;
                release(&q_empty[cur.qs]);
                epilogue(finish(), true);
            }
            return false;
        };
        if (next_nonempty()) {
            float a[2];
            zero_o();
            first_block(ring, 0, a);
            pack_p();
            for (;;) {
                const int nb = w.nblocks;
                for (int j = 1; j < nb; j++) {
                    if (step_gemms(ring + j, ring + j - 1, j, a)) rescale_o(a);
                    pack_p();
                }
                release(&q_empty[cur.qs]); /* the tile's last S GEMM has read Q: a later tile's Q may land */
                const v3_done e = finish();
                const int rl = ring + nb - 1;
                ring += nb;
                if (!next_nonempty()) {
                    last_pv(rl);
                    epilogue(e, false);
                    break;
                }
                step_gemms(rl + 1, rl, 0, a); /* the new tile's S_0 with the last tile's P V (slot rl) */
                epilogue(e, false);
                zero_o();
                pack_p();
            }
        }
    } else {
        while (next_tile(w, x, qr)) {
            begin_tile(w, x, qr);
            zero_o();
            if (CAN_SPLIT && w.split) {
                split_tail_tile(w.nblocks);
                continue;
            }
            /* The consumer computes the key blocks its rows see, [0, seen); past them (a causal diagonal or a right
             * window edge beyond its rows, every block when none of its rows exist) it only takes its turns -- the
             * S_0 turn when it has no block, then one per block -- and releases each block once loaded. */
            const int nb = w.nblocks, seen_ = SEQ ? nb : seen;
            if (seen_ > 0) {
                float a[2];
                first_block(ring, 0, a);
                pack_p();
                for (int j = 1; j < seen_; j++) {
                    if (step_gemms(ring + j, ring + j - 1, j, a)) rescale_o(a);
                    pack_p();
                }
                if (SEP_O) release(&q_empty[cur.qs]); /* the last S GEMM has read Q: a later tile's Q may land */
                last_pv(ring + seen_ - 1);
            } else {
                if (nb > 0) {
                    turn_wait();
                    turn_pass();
                }
                if (SEP_O) release(&q_empty[cur.qs]);
            }
            for (int j = seen_; j < nb; j++) {
                skip_block(ring + j);
                turn_wait();
                turn_pass();
            }
            ring += nb;
            if (SEQ || !SEP_O || cur.wg_row < cur.seq_q) epilogue(finish(), false); /* (else: no row to store) */
        }
    }
    if (PP && cw == 0) turn_wait(); /* the last consumer's final hand-over */
    if (tid == 0) tma_store_wait_read();
}

#endif
