/* v3_bwd_wide.cu -- v3's dK/dV kernel for head dim 256 (bucket 256: d in (128, 256]); v3_bwd_kernel.cuh has the
 * kernels for head dims to 128, v3_bwd.cu the launcher of the prep and convert passes around this one.
 *
 * Why a kernel of its own: a block's dK and dV at D = 256 are 256 floats a thread for 64 keys per consumer, more than
 * a thread has; so here the two consumer warpgroups split the head dim, not the keys.  A block owns BC = 64 keys and
 * walks the query blocks of BR = 64 rows that see them (v3_bwd_ring.cuh: the same block placement and producer);
 * consumer cw keeps dK and dV for all 64 keys and columns 128 cw + [0, 128) (64 + 64 floats).  Per step:
 *   S_w  = Q_i K_w^T     wgmma m64n32k16, both operands K-major: the 64 query rows x this consumer's 32 keys
 *   dP_w = dO_i V_w^T    the same, issued right behind S_w
 *   P_w  = exp2(S_w scale log2 e - LSE2_row)   (masked -> 0 on the mask's edge blocks only), and
 *   dS_w = P_w (dP_w - D_row): LSE2 and D are per row here, two of each per thread
 *   P and dS to shared memory (double-buffered, rows queries, 128-byte swizzled as TMA would); a named barrier: both
 *     consumers' halves are in
 *   dV_w += P^T dO_i     wgmma SS, P^T M-major and dO N-major (both transposed by their descriptors): 64 keys x
 *                        this consumer's 128 columns
 *   dK_w += dS^T Q_i     the same
 *   dQ_w  = dS K         wgmma SS, dS K-major and K N-major: 64 queries x this consumer's 128 columns, two of
 *                        dq_accum's 64 x 64 tiles, added from registers by 16-byte reds (no shared-memory tile: the
 *                        block's 227 KB hold K, V, two slots of Q and dO, and P and dS twice); DQ_OUT (calls of few
 *                        key blocks, v3_bwd_configs.h): scaled, in the dtype, into dQ itself by 8-byte reds
 * dQ is issued first, so its adds go out while dV and dK run.
 * Deterministic mode: each consumer adds its two tiles in a fixed order per tile (key-block order; descending under
 * a mask with a right edge, v3b_descends; without a mask the stagger's: by whole heads where a head's key blocks fit
 * in half the GPU, v3b_stagger_turn, else in chunks, v3w_turn -- the launcher's word, V3B_STAGGER_*).  Two warps of
 * the producer's warpgroup keep the turns, of alternate steps (v3w_keep_turns): a keeper waits on the step's tiles'
 * counters for the block's turn and lets the consumers add (a named barrier), each warpgroup stores (the first add:
 * the accumulator is not zeroed) or adds and signals, and the keeper counts the adds (one fence, then relaxed
 * adds).  The consumers never wait on global memory themselves.  On dense batches a tile's turns alternate between
 * two copies of dq_accum (the workspace's dq_copies; v3w_copy), so that a turn waits for the add two turns before
 * it: a tile gets an add every step, and with one copy each step's add waited for the last one's whole round trip
 * (add, land, count, poll) -- where staggered (without a mask); elsewhere copy 0 takes every turn.  The convert pass
 * sums the copies that were written, in copy order.
 * Rows past Sq read as zeros (TMA) with LSE2 = +inf, so P = dS = 0 there; keys past Sk are masked (the last key block
 * is an edge block) and never stored.  MODS (a softcap, ALiBi) and SEQ (packed batches) as v3_bwd_kernel.cuh's.
 * fp16 / bf16, positive scale (v3_bwd_plan.c).
 * Built for sm_90a only (kernels/sm90/gencode).
 * Speed (NVIDIA H100, fa3 grid at D=256 fp16, torch cudnn's backward in the same run,
 * evidence/backward/h100_v3_bwd_wide_85959aa.md): 0.944-1.164x cudnn (v2's kernel, which ran these calls before:
 * 0.57-0.73x); bf16 0.931-1.147x.  Deterministic mode (a3d77f8, evidence/backward/h100_v3_bwd_wide_det_a3d77f8.md):
 * 0.63-0.88x cudnn, 1.15-1.55x the default's time (1.49-1.86x before the turn keeper and the stagger); on an H200
 * after the descending order and the keeper's single fences (b1fedd5,
 * evidence/backward/h200_v3_bwd_det_order_792ba20.md): 0.81-0.94x cudnn, 1.02-1.19x the default's time causal,
 * 1.09-1.26x non-causal; on an H100 after whole heads and chunks of 32 staggered (fdd9407,
 * evidence/backward/h100_v3_bwd_stagger_88a1dbe.md): 0.81-0.94x cudnn, 1.02-1.26x the default's time causal,
 * 1.06-1.29x non-causal; with two turn keepers and, where staggered, two copies of dq_accum (3b2d311,
 * evidence/backward/h100_v3_bwd_wide_det_copies_3b2d311.md): 1.03-1.15x faster than before from S = 1k on, 0.90-1.19x
 * cudnn, 1.05-1.21x the default's time (the fa3 pass: within 15% at 8 of 12 points at D = 256).
 */
#include <cuda.h> /* CUtensorMap and its enums: types only */

#include "v3_bwd_ring.cuh"
#include "wgmma_tiles.cuh"

#include "../../csrc/variants.h"
#include "v3_bwd_configs.h"

/* Named barriers (0 is __syncthreads): 1 both consumers' P and dS of the step are in shared memory; deterministic
 * mode, between consumer cw and the turn keeper of steps of parity par (v3w_keep_turns): V3W_BAR_TURN (cw, par) its
 * turn has come, V3W_BAR_ADDED (cw, par) its adds are issued -- 2 .. 9 (6 is v3b_zero's too, in default mode's
 * zero-ahead kernels only). */
#define V3W_BAR_PDS 1
#define V3W_BAR_TURN(cw, par) (2 + (cw) + 2 * (par))
#define V3W_BAR_ADDED(cw, par) (6 + (cw) + 2 * (par))
#define V3W_KEEPER_THREADS (128 + 32) /* a consumer and a turn keeper's warp */
#define V3W_KEEPERS 2                 /* turn-keeper warps, one per parity of step */
/* Deterministic mode's grid order: chunks of key blocks, every head's (v3b_place) -- V3B_DET_CHUNK staggered (dense
 * batches), V3W_SEQ_CHUNK in key-block order (packed batches) */
#define V3W_SEQ_CHUNK 8

/* Deterministic mode's stagger.  Unstaggered, every block of a chunk walks the query blocks in the same order, so the
 * chunk's l-th block reaches each dQ tile right behind the (l-1)-th and waits for its add: a chain of turns, with l
 * steps of fill and the chunk's blocks in lock step after.  Staggered, key block kb starts its walk kb query blocks
 * further on (v3b_row0's rot = kb mod nm): at any step a chunk's w blocks are at w different tiles, and a tile's adds
 * come chunk by chunk, within a chunk in the order its blocks reach the tile, a step apart.  For block kb = c G + l
 * and the tile the unrotated walk visits u-th, with u' = (u - c G) mod nm: the chunk reaches it first by block
 * min(u', w - 1), then by those below, then by those above, so the turn is c G (the earlier chunks' adds) +
 * min(u', w - 1) - l when l <= u', else + u' + w - l.  A turn waits only on an add of an earlier step of the chunk or
 * on an earlier chunk: no cycle.  Rotating by kb, not by l, keeps a chunk's blocks behind the chunk before it on
 * every tile when the two run at once (long sequences, few heads): rotated by l, the next chunk's first block would
 * reach tile 0 at its first step and wait for the whole walk of the chunk before.  It needs every key block to see
 * every query block (no causal mask, no window, a dense batch) and at least w query blocks, and the chunk's blocks
 * able to run at once (the launcher's V3B_STAGGER_CHUNKS).  nkb: key blocks per head. */
DEV bool v3w_staggers(const v3b_block &blk, int nkb) {
    return blk.nm >= (nkb < V3B_DET_CHUNK ? nkb : V3B_DET_CHUNK);
}

/* Block blk's turn on step it's dQ tiles: the adds that come before its own (the first is a store).  stagger: how
 * (V3B_STAGGER_*): unstaggered, key-block order, or descending under a mask with a right edge (v3b_turn; sp: the key
 * blocks the tile's rows see); in chunks, the order above; by whole heads, v3b_stagger_turn's. */
DEV int v3w_turn(const v3b_block &blk, int it, const fattn_span &sp, int stagger, int nkb) {
    if (stagger == V3B_STAGGER_HEADS) return v3b_stagger_turn(blk, it, nkb);
    if (stagger == V3B_STAGGER_NONE) return v3b_turn(blk, sp.n_min, sp.n_max);
    const int c = blk.kb / V3B_DET_CHUNK, l = blk.kb % V3B_DET_CHUNK;
    const int w = nkb - c * V3B_DET_CHUNK < V3B_DET_CHUNK ? nkb - c * V3B_DET_CHUNK : V3B_DET_CHUNK;
    const int u = ((it % blk.nm + blk.rot) % blk.nm - c * V3B_DET_CHUNK % blk.nm + blk.nm) % blk.nm; /* u' */
    return c * V3B_DET_CHUNK + (l <= u ? (u < w - 1 ? u : w - 1) - l : u + w - l);
}

/* A tile's turn t where the turns alternate between `ways` copies of dq_accum (1 or 2): its copy c = t mod ways and
 * the turn within it (0: the copy's first add, a store). */
typedef struct {
    int c, turn;
} v3w_copy;
DEV v3w_copy v3w_copy_of(int t, int ways) { return v3w_copy{t & (ways - 1), t >> (ways - 1)}; }

/* Deterministic mode's turns, kept by two warps (V3W_KEEPERS), keeper par taking the steps of parity par, so that
 * the consumers never wait on global memory: for each step, lane 0 polls the four dQ tiles' counters of the step's
 * rows (relaxed loads, all four at once) until each shows the adds of the key blocks before this one, then one
 * fence (the acquire pattern), and the warp lets both consumers add (V3W_BAR_TURN); once both have issued their adds
 * (V3W_BAR_ADDED) lane 0 fences once and counts one add on each counter (the release pattern: the barrier orders the
 * consumers' adds before the fence, as the PTX memory model's barriers do).  The release fence waits for the step's
 * adds to land; with one keeper the next step's poll waited behind it, so a step's turn came no sooner than the
 * step before had landed -- with two, the next step's keeper polls meanwhile.  Every block adds to all four tiles of
 * a step and counts them together, so the four counters move as one.  A count never waits on another block, and a
 * turn waits only on adds that come earlier in v3w_turn's order, so the waits cannot close a cycle.  G: the copies
 * of dq_accum side by side (v3_dq_copy); where the turns alternate between them (ways = G, v3w_copy) a tile's turn t
 * goes to copy t mod G as its add t / G, and waits on that copy's counter only: for the add G turns before it. */
template <int DP, int BR, int BC>
DEV void v3w_keep_turns(const attn_bwd_params &p, const v3b_block &blk, int stagger, int nkb, int G, int ways,
                        int par, int lane) {
    const attn_params &f = p.fwd;
    for (int it = par; it < blk.n_it; it += V3W_KEEPERS) {
        const int i0 = v3b_row0<BR, true>(blk, it);
        const fattn_span sp = stagger ? fattn_span{} : fattn_key_span(&f.mask, f.sq, f.sk, i0, BR, BC);
        const v3w_copy cp = v3w_copy_of(v3w_turn(blk, it, sp, stagger, nkb), ways);
        /* the four tiles' counters of copy cp.c, G apart */
        int *sem = p.dq_sem + v3_dq_copy(v3_dq_tile<DP>(blk.b * f.h + blk.h0 + it / blk.nm, p.ws_rows, i0, 0), G, cp.c);
        if (lane == 0) {
            for (;;) {
                const int c0 = ld_relaxed(sem), c1 = ld_relaxed(sem + G), c2 = ld_relaxed(sem + 2 * G),
                          c3 = ld_relaxed(sem + 3 * G);
                if (c0 == cp.turn && c1 == cp.turn && c2 == cp.turn && c3 == cp.turn) break;
            }
            fence_acq_rel_gpu();
        }
        __syncwarp();
        /* consumer 0 adds tiles 0, 1; consumer 1 tiles 2, 3 */
        named_barrier_arrive(V3W_BAR_TURN(0, par), V3W_KEEPER_THREADS);
        named_barrier_arrive(V3W_BAR_TURN(1, par), V3W_KEEPER_THREADS);
        named_barrier_sync(V3W_BAR_ADDED(0, par), V3W_KEEPER_THREADS);
        named_barrier_sync(V3W_BAR_ADDED(1, par), V3W_KEEPER_THREADS);
        if (lane == 0) {
            fence_acq_rel_gpu();
#pragma unroll
            for (int t = 0; t < 4; t++) red_relaxed_add(sem + t * G, 1);
        }
    }
}

/* DQ_OUT (v3_bwd_configs.h: V3_BWD_DQ_OUT, the planner's rule): dQ_w scaled, rounded to T and added straight into
 * dQ by 8-byte reds (bwd_prep zeroed it; deterministic mode keeps its turns), in kernels of their own: no dq_accum,
 * no convert. */
template <typename T, int BR, int BC, int STAGES, bool DET, bool MODS, bool SEQ, bool ZA = false, bool DQ_OUT = false>
__global__ void __launch_bounds__(384, 1)
v3_bwd_dkdv_wide(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                 const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                 const attn_bwd_params all, const int stagger_asked, const int zero_ahead) {
    constexpr int DP = 256;
    static_assert(!ZA || (!DET && !MODS && !SEQ), "zero-ahead: default mode's plain kernels");
    static_assert(!DQ_OUT || (!MODS && !SEQ && !ZA), "dQ out: plain kernels");
    static_assert(BR == 64 && BC == 64, "a 64 x 64 P and dS, 32 keys of S per consumer");
    constexpr int KV_TILE = BC * DP, Q_TILE = BR * DP, PS_TILE = BR * BC; /* elements */
    constexpr int NS = BC / 4; /* S and dP accumulators per thread: 64 rows x 32 keys */
    constexpr int NA = 64;     /* dK, dV and dQ accumulators per thread: 64 rows x 128 columns */
    extern __shared__ unsigned char smem_raw[];
    T *sK = (T *)smem_align1024(smem_raw);
    T *sV = sK + KV_TILE, *sQ = sV + KV_TILE, *sdO = sQ + STAGES * Q_TILE, *sP = sdO + STAGES * Q_TILE;
    T *sdS = sP + 2 * PS_TILE;
    float *sLse = (float *)(sdS + 2 * PS_TILE), *sD = sLse + STAGES * BR;
    uint64_t *bar = (uint64_t *)(sD + STAGES * BR);
    const v3b_ring<T> ring = {sK, sV, sQ, sdO, sLse, sD, bar, bar + 1, bar + 1 + STAGES};

    v3b_params<BC, SEQ, DET ? (SEQ ? V3W_SEQ_CHUNK : V3B_DET_CHUNK) : 0> bp;
    /* stagger_asked: the launcher's V3B_STAGGER_* (none under a mask or in a packed batch) */
    const bool desc = DET && v3b_descends<SEQ>(all.fwd), heads = DET && !SEQ && stagger_asked == V3B_STAGGER_HEADS;
    if (!bp.init(all, desc, heads)) return; /* past its sequence's keys: no rows of dK, dV here */
    const attn_bwd_params &p = SEQ ? bp.seq : all;
    const attn_params &f = p.fwd;
    v3b_block blk = v3b_block_of<BR, BC>(f, bp.kb, bp.b, bp.hk);
    const int nkb = (int)((f.sk + BC - 1) / BC);
    /* deterministic mode's copies of dq_accum: the workspace's (fattn.h: fattn_bwd_dq_copies) where the adds go to
     * dq_accum of the whole batch, else one (dQ out; a packed batch's sequences each have one copy's rows) */
    static_assert(FATTN_BWD_DQ_COPIES == 2, "v3w_copy_of: one or two copies");
    const int G = DET && !SEQ && !DQ_OUT ? p.dq_copies : 1;
    const int stagger = heads && blk.nm > 0 ? V3B_STAGGER_HEADS
                        : DET && !SEQ && stagger_asked == V3B_STAGGER_CHUNKS && v3w_staggers(blk, nkb)
                            ? V3B_STAGGER_CHUNKS
                            : V3B_STAGGER_NONE;
    if (stagger != V3B_STAGGER_NONE) blk.rot = blk.kb % blk.nm;
    /* the turns alternate between the copies where staggered: there a tile gets an add every step, each waiting on
     * the one before it (with one copy every step waited for the last one's whole round trip).  Under a mask with a
     * right edge (descending order) the second copy cost more in L2 than it saved: on an H100 at causal 8k / 16k
     * 0.89 / 0.70x the speed of one copy, against 1.05-1.10x at non-causal 1k-4k
     * (evidence/backward/h100_v3_bwd_wide_det_copies_3b2d311.md) -- there copy 0 takes every turn. */
    const int ways = stagger != V3B_STAGGER_NONE ? G : 1;
    blk.desc = desc;
    const int wg = warpgroup_index(), tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    if (threadIdx.x == 0) v3b_ring_init<T, STAGES>(ring, 256);
    __syncthreads();

    if (wg == 0) { /* ---- producer: one thread; deterministic mode's turn keepers: warps 1, 2; zero-ahead: 2, 3 ---- */
        setmaxnreg_dec<V3B_PRODUCER_REGS>();
        if (ZA && warp >= 2) { /* v3_bwd_ring.cuh: v3b_zero; the producer waits for this block's group */
            if (zero_ahead > 0) v3b_zero<BC>{all}.fill(zero_ahead, false, tid - 64);
            return;
        }
        if (threadIdx.x == 0 && blk.n_it > 0)
            v3b_produce<T, DP, BR, BC, STAGES, DET>(&tm_q, &tm_k, &tm_v, &tm_do, p, blk, ring, bp.q0, bp.k0,
                                                    bp.tma_b, ZA ? zero_ahead : 0);
        if (DET && warp >= 1 && warp <= V3W_KEEPERS && blk.n_it > 0)
            v3w_keep_turns<DP, BR, BC>(p, blk, stagger, nkb, G, ways, warp - 1, lane);
        return;
    }

    /* ---- consumers ---- */
    setmaxnreg_inc<V3B_CONSUMER_REGS>();
    const int cw = wg - 1, g = lane / 4, t = lane % 4;
    const int qrow = warp * 16 + g; /* this thread's first query row of the step (the second is + 8) */
    const float c = f.scale_log2;   /* > 0 (the planner's rule): masked scores stay -inf */
    const float cap2 = f.softcap * FATTN_LOG2E, inv_cap2 = MODS && cap2 > 0.f ? 1.f / cap2 : 0.f; /* MODS */
    float dk[NA], dv[NA];
#pragma unroll
    for (int i = 0; i < NA; i++) dk[i] = dv[i] = 0.f;
    /* descriptors' low words: K, V rows 32 cw + [0, 32) as the B operand of S, dP (K-major); K's panels 2 cw, 2 cw + 1
     * as the B operand of dQ = dS K (N-major, panels BC * 128 bytes apart) */
    const unsigned k_lo = desc_lo(sK + cw * 32 * 64, 0), v_lo = desc_lo(sV + cw * 32 * 64, 0);
    const unsigned kn_lo = desc_lo(sK + cw * 2 * BC * 64, BC * 128);
    if (blk.n_it > 0) mbar_wait(ring.kv_full, 0);
    for (int it = 0; it < blk.n_it; it++) {
        const int s = it % STAGES, i0 = v3b_row0<BR, DET>(blk, it);
        const int64_t h = blk.h0 + it / blk.nm;
        T *q_s = sQ + s * Q_TILE, *do_s = sdO + s * Q_TILE, *p_b = sP + (it & 1) * PS_TILE;
        T *ds_b = sdS + (it & 1) * PS_TILE;
        const fattn_span sp = fattn_key_span(&f.mask, f.sq, f.sk, i0, BR, BC);
        const bool masked = !(blk.kb >= sp.n_full_min && blk.kb < sp.n_full_max);
        mbar_wait(&ring.q_full[s], (it / STAGES) & 1);

        /* S_w = Q K_w^T and dP_w = dO V_w^T: 16 k-steps each, four per 64-column panel */
        float st[NS], dpt[NS];
        wgmma_fence();
        wgmma_kmajor_tiles<32, T, DP, BR, BC>(st, desc_lo(q_s, 0), k_lo);
        wgmma_commit();
        wgmma_kmajor_tiles<32, T, DP, BR, BC>(dpt, desc_lo(do_s, 0), v_lo);
        wgmma_commit();
        const float lse[2] = {sLse[s * BR + qrow], sLse[s * BR + qrow + 8]};
        const float dsum[2] = {sD[s * BR + qrow], sD[s * BR + qrow + 8]};
        wgmma_wait<1>();
        reg_fence(st);
        /* element i: query row qrow + 8 ((i >> 1) & 1), key 32 cw + 8 (i / 4) + 2 t + (i & 1) of the block; key r, row
         * q visible iff pl <= r - q < pr and r < kc (mask.h, from the step's first row) */
        const fattn_block_mask bm = fattn_block_mask_of(&f.mask, f.sq, f.sk, i0, blk.j0);
        auto visible = [&](int i) {
            return fattn_block_sees(&bm, qrow + 8 * ((i >> 1) & 1), 32 * cw + 8 * (i / 4) + 2 * t + (i & 1));
        };
        /* P and dS in shared memory: row q, key r at q * 64 + ((r / 8) ^ (q % 8)) * 8 + r % 8 (one 128-byte-swizzled
         * panel; a warp's stores of one i fill 32 distinct banks) */
        auto at = [&](int i) {
            const int q = qrow + 8 * ((i >> 1) & 1), r = 32 * cw + 8 * (i / 4) + 2 * t;
            return q * 64 + (((r / 8) ^ (q & 7)) * 8) + r % 8;
        };
        if constexpr (MODS) { /* the score in log2 units, the softcap c2 tanh(S2 / c2) and ALiBi's -slope2 |pos - key|
                                 as the forward, the mask; P stored now and st = P (1 - tanh^2) from here on (dS's
                                 chain rule) */
            const float slope2 = fattn_alibi_slope2(&f, blk.b, h);
            const float base = (float)(i0 + f.sk - f.sq - blk.j0 + qrow - 32 * cw - 2 * t); /* pos - key, element 0 */
#pragma unroll
            for (int i = 0; i < NS; i += 2) {
                float pv[2];
#pragma unroll
                for (int y = 0; y < 2; y++) {
                    float dcap, x = v3b_mods_score(st[i + y], c, cap2, inv_cap2, slope2,
                                                   base + (float)(8 * ((i >> 1) & 1) - 8 * (i / 4) - y), &dcap);
                    if (masked && !visible(i + y)) x = -INFINITY;
                    pv[y] = fast_exp2(x - lse[(i >> 1) & 1]);
                    st[i + y] = pv[y] * dcap;
                }
                *(unsigned *)(p_b + at(i)) = pack2(pv[0], pv[1], T());
            }
        } else {
            if (masked) {
#pragma unroll
                for (int i = 0; i < NS; i++)
                    if (!visible(i)) st[i] = -INFINITY;
            }
#pragma unroll
            for (int i = 0; i < NS; i++) st[i] = fast_exp2(fmaf(st[i], c, -lse[(i >> 1) & 1]));
        }
        wgmma_wait<0>();
        reg_fence(dpt);
#pragma unroll
        for (int i = 0; i < NS; i += 2) {
            const float d = dsum[(i >> 1) & 1];
            if (!MODS) *(unsigned *)(p_b + at(i)) = pack2(st[i], st[i + 1], T());
            *(unsigned *)(ds_b + at(i)) = pack2(st[i] * (dpt[i] - d), st[i + 1] * (dpt[i + 1] - d), T());
        }
        fence_proxy_async(); /* the stores, before either consumer's wgmma reads them */
        named_barrier_sync(V3W_BAR_PDS, 256);

        /* dV_w += P^T dO and dK_w += dS^T Q (4 k-steps of 16 query rows, 2048 bytes each; dO's and Q's panels 2 cw,
         * 2 cw + 1, BR * 128 bytes apart), then dQ_w = dS K (4 k-steps of 16 keys, 32 bytes each in dS's rows) */
        const unsigned pt_lo = desc_lo(p_b, BR * 128), dst_lo = desc_lo(ds_b, BR * 128), ds_lo = desc_lo(ds_b, 0);
        const unsigned dot_lo = desc_lo(do_s + cw * 2 * BR * 64, BR * 128);
        const unsigned qt_lo = desc_lo(q_s + cw * 2 * BR * 64, BR * 128);
        float dq[NA];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++)
            wgmma_sst<128, T>(dq, ds_lo + ((kk * 32) >> 4), kn_lo + ((kk * 2048) >> 4), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < BR / 16; kk++)
            wgmma_sstt<128, T>(dv, pt_lo + ((kk * 2048) >> 4), dot_lo + ((kk * 2048) >> 4), 1);
#pragma unroll
        for (int kk = 0; kk < BR / 16; kk++)
            wgmma_sstt<128, T>(dk, dst_lo + ((kk * 2048) >> 4), qt_lo + ((kk * 2048) >> 4), 1);
        wgmma_commit();
        wgmma_wait<1>(); /* dQ done; dV and dK may still run while it is added */
        reg_fence(dq);

        /* dQ_w: columns [0, 64) of it are tile 2 cw of the rows, [64, 128) tile 2 cw + 1 (v3_dq_index's order) */
        const int64_t tile = v3_dq_tile<DP>(blk.b * f.h + h, p.ws_rows, i0, 2 * cw);
        /* dQ_w added from registers into the two tiles' copies at dst and dst + next, one 16-byte red a quad */
        auto red_tiles = [&](float *dst, int64_t next) {
#pragma unroll
            for (int v4 = 0; v4 < 16; v4++)
                red_add_v4(dst + next * (v4 / 8) + v3_dq_index(tid, 4 * (v4 % 8)), dq[4 * v4], dq[4 * v4 + 1],
                           dq[4 * v4 + 2], dq[4 * v4 + 3]);
        };
        /* DQ_OUT: element i of dQ_w is row i0 + qrow + 8 ((i >> 1) & 1), column 128 cw + 8 (i / 4) + 2 t (+ 1 for
         * i + 1).  Lanes t and t ^ 1 trade a pair of each two n8 tiles (2 pp, 2 pp + 1), so that an even t holds four
         * columns of tile 2 pp from 2 t on, an odd t four of tile 2 pp + 1 from 2 t - 2 on: a quad's 8-byte reds fill
         * whole 32-byte sectors.  On an H100 against the float32 path: S = 512 1.14x non-causal, 1.28x causal, 1k
         * causal 1.08x (4-byte reds, a pair each: 0.91x, 1.07x, 0.87x).  Rows < Sq, columns < d (a multiple of 8). */
        auto dq_out_add = [&]() {
            const bool odd = t & 1;
            const int c0 = 128 * cw + 4 * (t >> 1) + 8 * (t & 1); /* the thread's first column */
            T *row = (T *)p.dq + blk.b * p.dq_stride_b + h * p.dq_stride_h + (int64_t)(i0 + qrow) * p.dq_stride_s + c0;
#pragma unroll
            for (int r = 0; r < 2; r++) {
#pragma unroll
                for (int pp = 0; pp < NA / 8; pp++) {
                    const int ia = 8 * pp + 2 * r, ib = ia + 4; /* tiles 2 pp and 2 pp + 1 */
                    const unsigned a = pack2(dq[ia] * f.scale, dq[ia + 1] * f.scale, T());
                    const unsigned b = pack2(dq[ib] * f.scale, dq[ib + 1] * f.scale, T());
                    const unsigned got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
                    if (i0 + qrow + 8 * r < f.sq && c0 + 16 * pp < f.d)
                        red_add_x4(row + 8 * r * p.dq_stride_s + 16 * pp, odd ? got : a, odd ? b : got);
                }
            }
        };
        if constexpr (DQ_OUT && DET) {
            named_barrier_sync(V3W_BAR_TURN(cw, it & 1), V3W_KEEPER_THREADS); /* the turn keeper: both tiles' turn */
            dq_out_add();
            named_barrier_arrive(V3W_BAR_ADDED(cw, it & 1), V3W_KEEPER_THREADS); /* the turn keeper counts them */
        } else if constexpr (DQ_OUT) {
            dq_out_add();
        } else if constexpr (DET) {
            /* the tiles' copy (v3w_copy: the two tiles G copies apart), and the copy's first add */
            const v3w_copy cp = v3w_copy_of(v3w_turn(blk, it, sp, stagger, nkb), ways);
            float *const dst = p.dq_accum + 4096 * v3_dq_copy(tile, G, cp.c);
            const int64_t next = 4096 * G; /* tile 2 cw + 1's copy */
            named_barrier_sync(V3W_BAR_TURN(cw, it & 1), V3W_KEEPER_THREADS); /* the turn keeper: both tiles' turn */
            /* a copy's first add is a store (the accumulator is not zeroed); one branch around each loop, so that
             * each compiles as the default mode's reds do (per-add branches recomputed every address into the same
             * registers, each store or red waiting for the one before it to have read them) */
            if (cp.turn == 0) {
#pragma unroll
                for (int v4 = 0; v4 < 16; v4++)
                    *(float4 *)(dst + next * (v4 / 8) + v3_dq_index(tid, 4 * (v4 % 8))) =
                        make_float4(dq[4 * v4], dq[4 * v4 + 1], dq[4 * v4 + 2], dq[4 * v4 + 3]);
            } else {
                red_tiles(dst, next);
            }
            named_barrier_arrive(V3W_BAR_ADDED(cw, it & 1), V3W_KEEPER_THREADS); /* the turn keeper counts them */
        } else {
            red_tiles(p.dq_accum + 4096 * tile, 4096); /* (default mode: one copy) */
        }
        wgmma_wait<0>();
        reg_fence(dk);
        reg_fence(dv);
        mbar_arrive(&ring.q_empty[s]); /* Q_i, dO_i, LSE, D of slot s all read */
    }

    /* ---- epilogue: scale * dK and dV, rows < Sk, columns < d, staged in K's and V's tiles (free once both
     * consumers' GEMMs are done; consumer cw's 64 x 128 in its half of each) so that each warp stores whole rows,
     * 16 bytes a thread ---- */
    named_barrier_sync(V3W_BAR_PDS, 256);
    T *sdK = sK + cw * 64 * 128, *sdV = sV + cw * 64 * 128;
    v3b_stage<T, 128>(sdK, sdV, dk, dv, f.scale, qrow, t);
    named_barrier_sync(V3W_BAR_PDS, 256);
    v3b_store_rows<T, 128>((T *)p.dk + blk.b * p.dk_stride_b + blk.hk * p.dk_stride_h + 128 * cw, p.dk_stride_s, sdK,
                           (T *)p.dv + blk.b * p.dv_stride_b + blk.hk * p.dv_stride_h + 128 * cw, p.dv_stride_s, sdV,
                           blk.j0, f.sk, f.d - 128 * cw, tid);
}

/* The kernels of V3_BWD_WIDE_CONFIGS (v3_bwd_configs.h), for v3_bwd.cu's launcher: kind = 2 seq + mods (packed
 * batches, score mods); [deterministic][fp16, bf16] of the config (br, bc, stages), or NULL. */
#define V3W_PAIR(br, bc, st, det, mods, seq)                                                                     \
    {(const void *)v3_bwd_dkdv_wide<__half, br, bc, st, det, mods, seq>,                                        \
     (const void *)v3_bwd_dkdv_wide<__nv_bfloat16, br, bc, st, det, mods, seq>}
#define V3W_KERNELS(dp, br, bc, st, mods_)                                                                       \
    if (br_ == br && bc_ == bc && st_ == st) {                                                                  \
        static const void *const k[4][2][2] = {                                                                  \
            {V3W_PAIR(br, bc, st, false, false, false), V3W_PAIR(br, bc, st, true, false, false)},               \
            {V3W_PAIR(br, bc, st, false, true, false), V3W_PAIR(br, bc, st, true, true, false)},                 \
            {V3W_PAIR(br, bc, st, false, false, true), V3W_PAIR(br, bc, st, true, false, true)},                 \
            {V3W_PAIR(br, bc, st, false, true, true), V3W_PAIR(br, bc, st, true, true, true)}};                  \
        return k[kind][det != 0][bf16 != 0];                                                                     \
    }
extern "C" const void *fattn_v3_bwd_wide_kernel(int br_, int bc_, int st_, int kind, int det, int bf16) {
    if (kind < 0 || kind > 3) return NULL;
    V3_BWD_WIDE_CONFIGS(V3W_KERNELS)
    return NULL;
}
#undef V3W_KERNELS
#undef V3W_PAIR

/* The dQ-out kernel (plain, dense; default or deterministic mode) of a V3_BWD_WIDE_CONFIGS config, fp16 or bf16, or
 * NULL. */
#define V3W_OUT(det_, T, br, bc, st)                                                                              \
    (det_ ? (const void *)v3_bwd_dkdv_wide<T, br, bc, st, true, false, false, false, true>                        \
          : (const void *)v3_bwd_dkdv_wide<T, br, bc, st, false, false, false, false, true>)
#define V3W_OUTS(dp, br, bc, st, mods_)                                                                          \
    if (br_ == br && bc_ == bc && st_ == st)                                                                    \
        return bf16 ? V3W_OUT(det, __nv_bfloat16, br, bc, st) : V3W_OUT(det, __half, br, bc, st);
extern "C" const void *fattn_v3_bwd_wide_out_kernel(int br_, int bc_, int st_, int det, int bf16) {
    V3_BWD_WIDE_CONFIGS(V3W_OUTS)
    return NULL;
}
#undef V3W_OUTS
#undef V3W_OUT

/* The zero-ahead kernel (default mode, plain, dense) of a V3_BWD_WIDE_CONFIGS config, fp16 or bf16, or NULL. */
#define V3W_ZA(dp, br, bc, st, mods_)                                                                            \
    if (br_ == br && bc_ == bc && st_ == st)                                                                    \
        return bf16 ? (const void *)v3_bwd_dkdv_wide<__nv_bfloat16, br, bc, st, false, false, false, true>     \
                    : (const void *)v3_bwd_dkdv_wide<__half, br, bc, st, false, false, false, true>;
extern "C" const void *fattn_v3_bwd_wide_za_kernel(int br_, int bc_, int st_, int bf16) {
    V3_BWD_WIDE_CONFIGS(V3W_ZA)
    return NULL;
}
#undef V3W_ZA
