/* v3_bwd_kernel.cuh -- version 3's backward (host side: v3_bwd.cu): Hopper (sm_90a), wgmma for all five products,
 * TMA loads into an mbarrier ring, warp specialisation; the FlashAttention-3 structure.  The math is v2's
 * (kernels/sm80/v2_bwd.cu): P recomputed from the forward's LSE, D_i = rowsum(dO_i * O_i), dV = P^T dO,
 * dP = dO V^T, dS = P (dP - D), dK = scale dS^T Q, dQ = scale dS K.  Three kernels on the stream: bwd_prep (D_i,
 * dQ's accumulator and counters zeroed -- at D=128 / 256 in default mode only the first groups' accumulator, the
 * dK/dV kernel zeroing the rest: zero-ahead, below; kernels/bwd_common.cuh), v3_bwd_dkdv, v3_bwd_convert or
 * v3_bwd_convert_t (dQ = scale * dq_accum in the dtype, from v3's tile layouts; v3_bwd_convert.cuh) -- in default
 * mode on dense batches launched as the dK/dV kernel's programmatic dependent, so that it runs on the
 * multiprocessors the dK/dV kernel's last wave leaves idle, each convert block once its group's dK/dV blocks have
 * counted their dQ adds landed (V3B_COUNTS_DONE below; v3_bwd_ring.cuh: v3b_done).  Calls of at most 8 key blocks
 * (v3_bwd_configs.h: V3_BWD_DQ_OUT) run two: bwd_prep zeroes dQ itself, and the dK/dV kernel adds its dQ tiles,
 * scaled and in the dtype, straight into dQ by TMA reductions (DQ_OUT, below).
 *
 * v3_bwd_dkdv: a block per (key block of BC = 128 keys, b, kv head); K_j and V_j stay in shared memory, dK_j and
 * dV_j in the consumers' registers, while the block walks every query block of BR rows that sees key block j, for
 * each query head of the kv head's group (GQA: dK, dV summed in registers).
 *   the producer (one thread): K_j, V_j once (TMA); per step Q_i and dO_i (TMA) and the rows' LSE (base 2, +inf
 *     past Sq or for a row that saw no key) and D (bulk copies from the workspace, where bwd_prep put them) into a
 *     ring of STAGES slots, a "full" mbarrier each (one arrival + the copies' bytes) and an "empty" one every
 *     consumer thread arrives on once it has read the slot (each reader's own release: what compute-sanitizer's
 *     racecheck can follow, where a warp's reads behind __syncwarp and one lane's arrival were reported as races);
 *   two consumer warpgroups, 64 keys each (setmaxnreg: 240 registers), per step:
 *     S^T  = K_w Q_i^T     wgmma m64nBRk16, both operands K-major in 128-byte-swizzled shared memory
 *     dP^T = V_w dO_i^T    the same, issued right behind S^T
 *     P^T  = exp2(S^T scale log2 e - LSE2_col)     (masked -> 0 on the mask's edge blocks only)
 *     dS^T = P^T (dP^T - D_col)                    packed likewise, and to shared memory (double-buffered,
 *                                                  swizzled as TMA would: rows keys, 64-query panels)
 *     dV  += P^T dO_i      wgmma RS: A (P^T packed to fp16 / bf16) from registers, dO N-major (transposed by the
 *                          descriptor, no copy), issued once dP^T is done and dS^T stored
 *     (named barrier: both consumers' dS^T in shared memory)
 *     dQ_i = dS K          wgmma SS with both operands transposed by their descriptors (dS^T M-major, K N-major):
 *                          a 64 x 64 tile per consumer -- BR = 128: its 64 query rows; BR = 64: its 64 columns
 *     dK  += dS^T Q_i      wgmma RS as dV, issued behind dQ: it runs while the dQ tile goes to shared memory
 *   then dK * scale and dV are stored (rows < Sk, columns < d): staged in K's and V's tiles, once both consumers'
 *     GEMMs are done, and written a 16-byte chunk a thread, each warp whole rows (v3_bwd_ring.cuh: v3b_store_rows);
 *   the dQ writer warp (the producer warpgroup's second): each consumer's dQ tile from shared memory into the float32
 *     dq_accum by one bulk reduce-add (cp.reduce.async.bulk), the slot handed back once read (named barriers); with
 *     DQ_OUT the tile is scaled and in the dtype, laid out as TMA's 64 x 64 box, and goes into dQ itself by one
 *     tensor reduction (cp.reduce.async.bulk.tensor ... .add).
 *     Deterministic mode (DET): the adds to a tile go in key-block order -- the writer waits on the tile's counter in
 *     the workspace (dq_sem) for its turn and counts its add once it has landed; the first is a plain store, so the
 *     accumulator needs no zeroing -- so the sums, and dQ, are bitwise repeatable; blocks start head by head in
 *     key-block order, so a wait is always on a block already running, and walk their query blocks last first.
 *     Under a mask with a right edge (causal) all of that is mirrored (v3_bwd_ring.cuh: v3b_descends): adds in
 *     descending key-block order, key blocks placed last first, query blocks walked first first, so that a tile's
 *     key blocks reach it in the order of their adds.  Without a mask (a dense batch, head dims to 64), where a
 *     head's key blocks fit in half the GPU, each block's walk is rotated by its key block and a tile's adds go in
 *     the order its blocks reach it (v3_bwd_ring.cuh: v3b_stagger_turn; the launcher decides, `stagger`).
 * Rows past Sq read as zeros (TMA) with LSE2 = +inf, so P = dS = 0 there; keys past Sk are masked (the last key
 * block is an edge block) and never stored.
 * MODS (kernels of their own): a softcap c2 tanh(S2 / c2) and ALiBi's -slope2 |pos - key| on the score in log2
 * units, as the forward; P packed, then dS's chain rule (1 - tanh^2) folded into the registers that held P.
 * SEQ (kernels of their own): packed batches -- the tensor maps span all the rows (total_q / total_k, one batch) and
 * a block takes its sequence's params (fattn_seq_bwd_params: lengths, pointers, workspace rows), its loads starting
 * at the sequence's first row; rows of the next sequence that a load picks up have LSE2 = +inf (prep) or are masked
 * keys, and are never stored.  Their values still meet the products as zeros times them (P = 0 for those rows and
 * keys, dS = 0), so they must be finite: a NaN or inf in the next sequence's rows, or in rows past cu_seqlens' last
 * entry, would reach this sequence's gradients (v2's packed kernels zero-fill such rows instead).
 * fp16 / bf16, head dims to 256, positive scale; v3_bwd_plan.c sends the rest (seqused_k, score mods at D=64) to
 * v2.  Head dim 256 runs its own dK/dV kernel (v3_bwd_wide.cu: the consumers split the head dim)
 * between this file's prep and convert passes; the block placement and the producer are shared (v3_bwd_ring.cuh).
 * Built for sm_90a only (kernels/sm90/gencode).  Configurations: v3_bwd_configs.h.
 * BR = 80 (V3_BWD_PLAIN_CONFIGS: D=128 where 80-row steps pad Sq little): dQ cannot be split into 64-row wgmma tiles,
 * so it is computed transposed, dQ^T = K^T dS^T (K's panel of the consumer's 64 columns M-major, dS K-major), a
 * 64 x 80 tile per consumer; dS goes to shared memory as dS (rows: queries) by stmatrix .trans, and the convert pass
 * of these tiles is v3_bwd_convert_t.  LSE and D are read from shared memory where used (no room to preload).
 * Speed (NVIDIA H100, fa3 grid fp16, torch cudnn's backward in the same run): at f836224, after a block's start
 * lost its two bisections over the rows (csrc/mask.h: fattn_rows_seeing; 1.07-1.15x at S = 512 / 1k), >= 1.05x at 31
 * of 36 points, bf16 30 (evidence/backward/h100_v3_bwd_block_start_f836224.md).  Earlier: one pass at a868a54
 * (after zero-ahead, f6adb8d: D=128 S=512 1.07-1.11x, 1k 1.02-1.05x against the tree before) 0.951-1.158x cudnn,
 * >= 1.05x at 16 of 36
 * points (evidence/backward/h100_fa3_bwd_a868a54.json).  One pass at 9034942 (after the staged
 * epilogue, 6ceffe0: 1.04-1.13x at S = 512 / 1k, evidence/backward/h100_v3_bwd_epilogue_6ceffe0.md) 0.956-1.152x
 * cudnn over D = 64 / 128 / 256, >= 1.05x at 14 of 36 points (h100_fa3_bwd_9034942.json).  At BR = 80 (8328cbe)
 * D=128 non-causal 0.90-1.06x cudnn at S >= 1k (1.04-1.20x the BR = 64 kernel), causal 0.89-1.09x (1.02-1.11x),
 * evidence/backward/h100_v3_bwd_br80_777e632.md.  Before it: D=128 0.86-0.98x cudnn (494 TFLOP/s
 * at S=16k), 1.01-1.07x the speed of b90005c's step order (dV while dP^T finished), deterministic mode 1.04-1.26x
 * the default's time (evidence/backward/h100_v3_bwd_step_order_a65f84f.md); D=64 0.84-0.97x at a213fcc
 * (h100_v3_bwd_a213fcc.md), then 1.03-1.08x faster with LSE2 and D read as float4s (34b28d2, the same file's
 * section 7: 0.87-0.99x cudnn on an H200).  Where a step's time goes: sections 1-4 there.  Deterministic mode on an
 * H100 at 88a1dbe: 1.00-1.07x the default's time at D=64 (the stagger: 1.07-1.17x faster without a mask, S = 512 ..
 * 8k), 0.99-1.20x at D=128 (evidence/backward/h100_v3_bwd_stagger_88a1dbe.md).  This kernel's first version ran at
 * 0.99-1.35x the speed of v2's backward (evidence/backward/h100_v3_bwd_first_14d0171.md, the same run).
 */
#ifndef FATTN_V3_BWD_KERNEL_CUH
#define FATTN_V3_BWD_KERNEL_CUH

#include <cuda.h> /* CUtensorMap and its enums: types only, the driver is reached through the runtime */

#include "v3_bwd_configs.h"
#include "v3_bwd_convert.cuh"
#include "v3_bwd_ring.cuh"
#include "wgmma_tiles.cuh"

/* Named barriers (0 is __syncthreads): 1 both consumers' dS^T of the step are in shared memory; 2 + cw consumer cw's
 * dQ tile is in shared memory (its 128 threads and the dQ writer warp), 4 + cw the writer has read it out. */
#define V3B_BAR_DS 1
#define V3B_BAR_DQ_FULL 2
#define V3B_BAR_DQ_EMPTY 4
#define V3B_DQ_THREADS 160

/* Zero-ahead (v3_bwd_ring.cuh: v3b_zero) runs in kernels of its own (ZA: the plain kernels of default mode), built
 * for head dims 128 (here) and 256 (v3_bwd_wide.cu) -- not 64: in D=64's kernel (Br = 128) its code made ptxas spill
 * in the consumers' loop and the dQ writer's -- and chosen by the launcher (v3_bwd.cu: V3B_ZERO_AHEAD_SK_MAX,
 * V3B_ZERO_SHARE_MAX).  On an H100 (bench/ab.py, fa3 grid, against the tree before): D=128 S=512 1.07-1.12x, 1k
 * 1.02-1.04x, 2k 0.99-1.02x, 4k-16k 0.96-0.99x (the zero fill's share of the call shrinks with S, while the dK/dV
 * kernel runs about 1% slower with it); D=256 S=512 1.06 / 1.08x, 1k 1.02 / 1.05x, 2k 1.03 / 1.02x, 4k 1.02 /
 * 1.02x (non-causal / causal). */
#define V3B_ZERO_AHEAD(dp) ((dp) == 128)
/* The convert pass beside the dK/dV kernel's last wave (v3_bwd_ring.cuh: v3b_done): this file's kernels that add dQ
 * into dq_accum in default mode on dense batches count each block done on its group's counter and let the grid
 * launched behind them start early (griddepcontrol.launch_dependents, at every block's start); the launcher then
 * launches convert as their programmatic dependent, its blocks waiting for their groups' counts.  (The wide kernel,
 * head dim 256, does not count.) */
#define V3B_COUNTS_DONE(dp, det, seq, dq_out) ((dp) != 256 && !(det) && !(seq) && !(dq_out))
/* Deterministic mode's stagger of whole heads (v3b_stagger_turn) is built for these kernels: head-dim bucket 64, the
 * wide kernel's 256, 128 at br = 80, and 128 at br = 64 with dQ out (on an H100 1.046x faster at S = 512 and 1k
 * non-causal: evidence/backward/h100_v3_bwd_dq_out_causal_*.md).  D=128 at br = 64 with dQ in the float32 workspace
 * ran 0.95-1.03x with it, so those kernels are built without it; br = 80 1.057 / 1.090 / 1.075 / 1.014x at S = 1k /
 * 2k / 4k / 8k non-causal against br = 80 without it (evidence/backward/h100_v3_bwd_br80_777e632.md). */
#define V3B_STAGGERS(dp, br, dq_out) ((dp) == 64 || (dp) == 256 || (br) == 80 || (dq_out))
/* FATTN_BWD_PROBE (a diagnostic build, not the default; bench/bwd_probe.py): each block of the dK/dV kernel writes
 * its SM and the clock (clock64, the SM's own cycle counter) at a few points of its life into v3b_probe_buf, slot
 * V3B_PROBE_* of row blockIdx.x, so that where a block's time goes outside its steps -- the first loads, the
 * epilogue, the dQ writer's last add, the gap before the SM's next block -- can be read per block. */
#ifdef FATTN_BWD_PROBE
#define V3B_PROBE_ROWS 16384
#define V3B_PROBE_SLOTS 16
enum { V3B_PROBE_SM, V3B_PROBE_ENTRY, V3B_PROBE_ENTRY_NS, V3B_PROBE_STEPS, V3B_PROBE_KV, V3B_PROBE_Q0, V3B_PROBE_LOOP,
       V3B_PROBE_STORED0, V3B_PROBE_STORED1, V3B_PROBE_WRITER, V3B_PROBE_STORED0_NS, V3B_PROBE_PLACED,
       V3B_PROBE_REGS, V3B_PROBE_ISSUE };
__device__ unsigned long long v3b_probe_buf[V3B_PROBE_ROWS * V3B_PROBE_SLOTS];
DEV void v3b_probe(int slot, unsigned long long v) {
    if (blockIdx.x < V3B_PROBE_ROWS) v3b_probe_buf[blockIdx.x * V3B_PROBE_SLOTS + slot] = v;
}
DEV unsigned long long v3b_clock() {
    unsigned long long c;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
    return c;
}
DEV unsigned long long v3b_ns() {
    unsigned long long c;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c)::"memory");
    return c;
}
DEV unsigned long long v3b_smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
#define V3B_PROBE(slot, value) v3b_probe(slot, value)
#else
#define V3B_PROBE(slot, value) ((void)0)
#endif

/* Deterministic mode's turns: the adds to a dQ tile come from the key blocks that see its rows, in key-block order
 * (descending under a mask with a right edge).  The writer of key block kb waits until the tile has had its turn's
 * adds (v3b_turn: kb - n_min, or n_max - 1 - kb; [n_min, n_max) the key blocks its rows see; ld.acquire), and after
 * its own reduce has landed counts one more (red.release). */
template <typename T, int DP, int BR, int BC, int STAGES, bool DET, bool MODS, bool SEQ, bool ZA = false,
          bool DQ_OUT = false>
__global__ void __launch_bounds__(384, 1)
v3_bwd_dkdv(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
            const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
            const attn_bwd_params all, const int stagger, const int zero_ahead,
            const __grid_constant__ CUtensorMap tm_dq) {
    static_assert(BC == 128, "two consumers of 64 keys");
    if (threadIdx.x == 0) {
        V3B_PROBE(V3B_PROBE_ENTRY, v3b_clock());
        V3B_PROBE(V3B_PROBE_ENTRY_NS, v3b_ns());
        V3B_PROBE(V3B_PROBE_SM, v3b_smid());
    }
    constexpr bool COUNTS = V3B_COUNTS_DONE(DP, DET, SEQ, DQ_OUT);
    if constexpr (COUNTS) griddep_launch_dependents(); /* convert may start once every block has */
    constexpr int KV_TILE = BC * DP, Q_TILE = BR * DP, DS_TILE = BC * BR; /* elements */
    constexpr int NS = BR / 2;  /* S^T and dP^T accumulators per thread (64 keys x BR queries) */
    constexpr int KS = BR / 16; /* k-steps of dV += P^T dO and dK += dS^T Q: A fragments of P^T, dS^T */
    constexpr int NA = DP / 2;  /* dK and dV accumulators per thread (64 keys x DP) */
    constexpr bool DQ_ROWS = BR == 128; /* dQ split between the consumers by rows, else by columns */
    /* BR not a multiple of 64 (v3_bwd_configs.h: V3_BWD_PLAIN_CONFIGS): dQ^T = K^T dS^T, a consumer's 64 columns by
     * the step's BR rows, dS stored K-major (rows: queries); plain kernels only (no score mods, not packed) */
    constexpr bool DQ_SWAP = BR % 64 != 0;
    constexpr int DQ_TILE = 64 * V3_BWD_DQ_ROWS(BR); /* floats of a consumer's dQ tile */
    static_assert(!DQ_SWAP || (!MODS && !SEQ && DP == 128), "dQ^T: D=128's plain kernels");
    static_assert(!DQ_SWAP || BR == FATTN_BWD_STEP_ROWS, "the workspace's rows end where steps of BR rows do");
    /* LSE2 and D in the workspace's v3 order (v3_bwd_configs.h), and read a float4 per k-step (QUADS; the score-mod
     * and packed kernels read a float2 at a time: a float4's registers spill 8 bytes there) */
    constexpr bool V3_ORDER = V3_BWD_LSE_V3_ORDER(DP, BR), QUADS = V3_ORDER && !MODS && !SEQ;
    /* else LSE and D of the step's columns in registers before the GEMMs' results (32 registers at BR = 64; at 128,
     * 64 would spill) */
    constexpr bool PRELOAD = BR == 64 && !MODS && !QUADS;
    static_assert(DQ_ROWS ? DP == 64 : DP == 128, "a consumer's dQ tile is 64 x 64");
    extern __shared__ unsigned char smem_raw[];
    T *sK = (T *)smem_align1024(smem_raw);
    T *sV = sK + KV_TILE, *sQ = sV + KV_TILE, *sdO = sQ + STAGES * Q_TILE, *sdS = sdO + STAGES * Q_TILE;
    float *sdQ = (float *)(sdS + 2 * DS_TILE); /* [2][DQ_TILE]: each consumer's dQ tile, in v3_dq_index order */
    float *sLse = sdQ + 2 * DQ_TILE, *sD = sLse + STAGES * BR;
    uint64_t *bar = (uint64_t *)(sD + STAGES * BR);
    const v3b_ring<T> ring = {sK, sV, sQ, sdO, sLse, sD, bar, bar + 1, bar + 1 + STAGES};
    uint64_t *q_full = ring.q_full, *q_empty = ring.q_empty;

    v3b_params<BC, SEQ> bp;
    const bool desc = DET && v3b_descends<SEQ>(all.fwd);
    if (!bp.init(all, desc)) return; /* past its sequence's keys: no rows of dK, dV here */
    const attn_bwd_params &p = SEQ ? bp.seq : all;
    const attn_params &f = p.fwd;
    v3b_block blk = v3b_block_of<BR, BC>(f, bp.kb, bp.b, bp.hk);
    blk.desc = desc;
    const int nkb = (int)((f.sk + BC - 1) / BC);
    /* v3b_stagger_turn (the launcher's rule) */
    const bool staggered = DET && !SEQ && V3B_STAGGERS(DP, BR, DQ_OUT) && stagger == V3B_STAGGER_HEADS && blk.nm > 0;
    if (staggered) blk.rot = blk.kb % blk.nm;
    const int kb = blk.kb, j0 = blk.j0, nm = blk.nm, n_it = blk.n_it;
    const int64_t b = blk.b, hk = blk.hk, h0 = blk.h0;
    auto row0_of = [&](int it) { return v3b_row0<BR, DET, true>(blk, it); };

    const int wg = warpgroup_index(), tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    if (threadIdx.x == 0) V3B_PROBE(V3B_PROBE_PLACED, v3b_clock());
    if (threadIdx.x == 0) v3b_ring_init<T, STAGES>(ring, 256);
    __syncthreads();

    /* the number of step it's 64 x 64 dQ tile of consumer cw_ (BR = 128: its 64 rows; BR = 64: its 64 columns) */
    auto dq_tile = [&](int it, int cw_) {
        return v3_dq_tile<DP>(b * f.h + h0 + it / nm, p.ws_rows, row0_of(it) + (DQ_ROWS ? cw_ * 64 : 0),
                              DQ_ROWS ? 0 : cw_);
    };
    /* where that tile is added in dq_accum: DQ_SWAP, rows row0 + [0, BR) of (b, h) -- BR x DP floats, both consumers'
     * tiles side by side (v3_bwd_convert_t reads them) -- else tile dq_tile's 4096 floats; and its counter in dq_sem
     * (deterministic mode): DQ_SWAP, the tile's offset / DQ_TILE (tiles are DQ_TILE floats apart at least, so each
     * has its own, below b h ws_rows / 40), else dq_tile */
    auto dq_off = [&](int it, int cw_) -> int64_t {
        if constexpr (DQ_SWAP)
            return ((b * f.h + h0 + it / nm) * p.ws_rows + row0_of(it)) * DP + cw_ * DQ_TILE;
        else
            return 4096 * dq_tile(it, cw_);
    };
    auto dq_sem = [&](int it, int cw_) { return p.dq_sem + (DQ_SWAP ? dq_off(it, cw_) / DQ_TILE : dq_tile(it, cw_)); };
    /* DQ_OUT: consumer cw_'s tile of step it (T, in its slot) added into dQ's box -- 64 columns (D=128: cw_'s) by 64
     * rows -- of head h0 + it / nm, batch b */
    auto dq_out_add = [&](int it, int cw_) {
        tma_reduce_add_4d(&tm_dq, (T *)sdQ + cw_ * 4096, DQ_ROWS ? 0 : cw_ * 64,
                          (int)row0_of(it) + (DQ_ROWS ? cw_ * 64 : 0), (int)(h0 + it / nm), (int)b);
    };

    /* ZA: zero-ahead, in kernels of their own (V3B_ZERO_AHEAD); zero_ahead 0 where bwd_prep zeroes every group */
    static_assert(!ZA || (V3B_ZERO_AHEAD(DP) && !DET && !MODS && !SEQ), "zero-ahead: default mode's plain kernels");
    /* DQ_OUT: each consumer's dQ tile scaled, in T, and reduce-added by TMA straight into dQ (tm_dq: bwd_prep zeroed
     * it; deterministic mode keeps its turns), in kernels of their own (v3_bwd_configs.h: V3_BWD_DQ_OUT); no
     * dq_accum, no convert.  (Default mode's tile added by the consumers from registers instead, by 8-byte reds as
     * the wide kernel does: 0.99-1.01x at D=64, 0.92-0.95x at D=128 on an H100 --
     * evidence/backward/h100_ab_bwd_dq_out_reds_narrow_*_trial_vs_d0e5dce.json.) */
    static_assert(!DQ_OUT || (!MODS && !SEQ && !ZA && !DQ_SWAP), "dQ out: plain kernels");
    if (wg == 0) { /* ---- producer warp 0 (TMA, LSE, D), the dQ writer, warp 1, zero-ahead warps 2 and 3 ---- */
        setmaxnreg_dec<V3B_PRODUCER_REGS>();
        if (ZA && warp >= 2) {
            if (zero_ahead > 0) {
                if (n_it > 0) { /* after the block's first loads, whose latency the consumers wait on */
                    mbar_wait(ring.kv_full, 0);
                    mbar_wait(&q_full[0], 0);
                }
                v3b_zero<BC>{all}.fill(zero_ahead, DQ_SWAP, tid - 64);
            }
            return;
        }
        if (warp == 1 && n_it > 0) {
            if (ZA && zero_ahead > 0) {
                if (lane == 0) v3b_zero<BC>{all}.wait(zero_ahead);
                __syncwarp();
            }
            /* each step, each consumer's tile: from shared memory into dq_accum by one bulk reduce-add, then its slot
             * handed back.  Deterministic mode: in key-block order -- both tiles of the step once it is their turn,
             * then one wait for both adds to land before they are counted (a round trip per step, not per tile). */
            named_barrier_arrive(V3B_BAR_DQ_EMPTY, V3B_DQ_THREADS);
            named_barrier_arrive(V3B_BAR_DQ_EMPTY + 1, V3B_DQ_THREADS);
            for (int it = 0; it < n_it; it++) {
                if constexpr (DET) {
                    const fattn_span sp = fattn_key_span(&f.mask, f.sq, f.sk, row0_of(it), BR, BC);
                    const int turn = staggered ? v3b_stagger_turn(blk, it, nkb) : v3b_turn(blk, sp.n_min, sp.n_max);
                    named_barrier_sync(V3B_BAR_DQ_FULL, V3B_DQ_THREADS);
                    named_barrier_sync(V3B_BAR_DQ_FULL + 1, V3B_DQ_THREADS);
                    if (lane == 0) {
                        for (int w = 0; w < 2; w++) {
                            while (ld_acquire(dq_sem(it, w)) != turn) {
                            }
                            fence_proxy_async_global();
                            if constexpr (DQ_OUT) /* (dQ zeroed by bwd_prep) */
                                dq_out_add(it, w);
                            else if (turn == 0) /* the tile's first add: a store (the accumulator is not zeroed) */
                                bulk_store(p.dq_accum + dq_off(it, w), sdQ + w * DQ_TILE, DQ_TILE * 4);
                            else
                                bulk_reduce_add_f32(p.dq_accum + dq_off(it, w), sdQ + w * DQ_TILE, DQ_TILE * 4);
                        }
                        tma_store_commit();
                        tma_store_wait_all();
                        fence_proxy_async_global();
                        red_release_add(dq_sem(it, 0), 1);
                        red_release_add(dq_sem(it, 1), 1);
                    }
                    __syncwarp();
                    named_barrier_arrive(V3B_BAR_DQ_EMPTY, V3B_DQ_THREADS);
                    named_barrier_arrive(V3B_BAR_DQ_EMPTY + 1, V3B_DQ_THREADS);
                } else {
                    for (int w = 0; w < 2; w++) {
                        named_barrier_sync(V3B_BAR_DQ_FULL + w, V3B_DQ_THREADS);
                        if (lane == 0) {
                            if constexpr (DQ_OUT)
                                dq_out_add(it, w);
                            else
                                bulk_reduce_add_f32(p.dq_accum + dq_off(it, w), sdQ + w * DQ_TILE, DQ_TILE * 4);
                            tma_store_commit();
                            tma_store_wait_read();
                        }
                        __syncwarp();
                        named_barrier_arrive(V3B_BAR_DQ_EMPTY + w, V3B_DQ_THREADS);
                    }
                }
            }
            if (lane == 0) {
                tma_store_wait_all();
                if constexpr (COUNTS) v3b_signal_done(p, b * f.h_kv + hk);
                V3B_PROBE(V3B_PROBE_WRITER, v3b_clock());
            }
            return;
        }
        if (COUNTS && warp == 1 && lane == 0 && n_it == 0) v3b_signal_done(p, b * f.h_kv + hk); /* no adds */
        if (warp != 0 || lane != 0 || n_it == 0) return;
        V3B_PROBE(V3B_PROBE_ISSUE, v3b_clock());
        v3b_produce<T, DP, BR, BC, STAGES, DET, true>(&tm_q, &tm_k, &tm_v, &tm_do, p, blk, ring, bp.q0, bp.k0,
                                                      bp.tma_b);
        return;
    }

    /* ---- consumers ---- */
    setmaxnreg_inc<V3B_CONSUMER_REGS>();
    const int cw = wg - 1, g = lane / 4, t = lane % 4;
    if (tid == 0 && cw == 0) V3B_PROBE(V3B_PROBE_REGS, v3b_clock());
    const int krow = cw * 64 + warp * 16 + g; /* this thread's first key row in the block (the second is + 8) */
    const float c = f.scale_log2;             /* > 0 (the planner's rule): masked scores stay -inf */
    const float cap2 = f.softcap * FATTN_LOG2E, inv_cap2 = MODS && cap2 > 0.f ? 1.f / cap2 : 0.f; /* MODS */
    float dk[NA], dv[NA];
#pragma unroll
    for (int i = 0; i < NA; i++) dk[i] = dv[i] = 0.f;
    /* descriptors' low words: K, V as the A operand of S^T / dP^T (K-major, this consumer's 64 rows), K as the B
     * operand of dQ = dS K (N-major: 64-column panels BC * 128 bytes apart), or (DQ_SWAP) the A operand of
     * dQ^T = K^T dS^T (M-major, the same layout) */
    const unsigned k_lo = desc_lo(sK + cw * 64 * 64, 0), v_lo = desc_lo(sV + cw * 64 * 64, 0);
    const unsigned kn_lo = desc_lo(sK + (DQ_ROWS ? 0 : cw * BC * 64), BC * 128);
    float *sdQw = sdQ + cw * DQ_TILE;
    if (n_it > 0) mbar_wait(ring.kv_full, 0);
    if (tid == 0 && cw == 0) {
        V3B_PROBE(V3B_PROBE_KV, v3b_clock());
        V3B_PROBE(V3B_PROBE_STEPS, n_it);
    }
    for (int it = 0; it < n_it; it++) {
        const int s = it % STAGES, i0 = row0_of(it);
        T *q_s = sQ + s * Q_TILE, *do_s = sdO + s * Q_TILE, *ds_b = sdS + (it & 1) * DS_TILE;
        const fattn_span sp = fattn_key_span(&f.mask, f.sq, f.sk, i0, BR, BC);
        const bool masked = !(kb >= sp.n_full_min && kb < sp.n_full_max);
        mbar_wait(&q_full[s], (it / STAGES) & 1);
        if (it == 0 && tid == 0 && cw == 0) V3B_PROBE(V3B_PROBE_Q0, v3b_clock());

        /* S^T = K_w Q^T and dP^T = V_w dO^T: DP / 16 k-steps each, four per 64-column panel, 32 bytes apart */
        float st[NS], dpt[NS];
        const unsigned q_lo = desc_lo(q_s, 0), do_lo = desc_lo(do_s, 0);
        wgmma_fence();
        wgmma_kmajor_tiles<BR, T, DP, BC, BR>(st, k_lo, q_lo);
        wgmma_commit();
        wgmma_kmajor_tiles<BR, T, DP, BC, BR>(dpt, v_lo, do_lo);
        wgmma_commit();
        /* LSE and D of this thread's columns: element i is key krow + 8 ((i >> 1) & 1), query column 8 (i / 4) +
         * 2 t + (i & 1) of the step, so columns come in pairs, one float2 per n8 tile (pair j = i / 4).  PRELOAD:
         * read into registers while the GEMMs run (else each exponential waits on its shared-memory load).  In v3's
         * order (V3_ORDER) k-step kk's two pairs, j = 2 kk and 2 kk + 1, are one float4 (QUADS reads it so). */
        const float *lse_s = sLse + s * BR, *d_s = sD + s * BR;
        float2 lse2[PRELOAD ? NS / 4 : 1], dsum[PRELOAD ? NS / 4 : 1];
        /* where pair j (rows 8 j + 2 t, + 1) sits: V3_ORDER, bwd_v3_row_pos(8 j + 2 t) in 32-bit arithmetic (its
         * 64-bit form changed the D=64 kernels' SASS; the gradient tests check that both agree) */
        auto pair_at = [&](int j) {
            return V3_ORDER ? 64 * (j / 8) + 16 * ((j % 8) / 2) + 4 * t + 2 * (j % 2) : 8 * j + 2 * t;
        };
        auto pick = [&](const float2 *regs, const float *smem, int j) {
            if constexpr (PRELOAD) return regs[j];
            else return *(const float2 *)(smem + pair_at(j));
        };
        /* body(kk, e, the two floats of element pair e of k-step kk) for every pair, from regs (PRELOAD) or smem */
        auto each_pair = [&](const float2 *regs, const float *smem, auto &&body) {
            if constexpr (QUADS) {
#pragma unroll
                for (int kk = 0; kk < KS; kk++) {
                    const float4 q = *(const float4 *)(smem + pair_at(2 * kk));
#pragma unroll
                    for (int e = 0; e < 4; e++) body(kk, e, e < 2 ? make_float2(q.x, q.y) : make_float2(q.z, q.w));
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < KS; kk++)
#pragma unroll
                    for (int e = 0; e < 4; e++) body(kk, e, pick(regs, smem, 2 * kk + (e >> 1)));
            }
        };
        if constexpr (PRELOAD) {
#pragma unroll
            for (int j = 0; j < NS / 4; j++) lse2[j] = *(const float2 *)(lse_s + pair_at(j));
        }
        wgmma_wait<1>();
        reg_fence(st);

        if constexpr (PRELOAD) {
#pragma unroll
            for (int j = 0; j < NS / 4; j++) dsum[j] = *(const float2 *)(d_s + pair_at(j));
        }
        /* key r, column q visible iff pl <= r - q < pr and r < kc (mask.h, from the step's first row) */
        const fattn_block_mask bm = fattn_block_mask_of(&f.mask, f.sq, f.sk, i0, j0);
        auto visible = [&](int i) {
            return fattn_block_sees(&bm, 8 * (i / 4) + 2 * t + (i & 1), krow + 8 * ((i >> 1) & 1));
        };
        if (!MODS && masked) {
#pragma unroll
            for (int i = 0; i < NS; i++)
                if (!visible(i)) st[i] = -INFINITY;
        }
        /* P^T as A fragments (k-step kk: S^T's n8 tiles 2 kk, 2 kk + 1) for dV += P^T dO (BR / 16 k-steps of 16 query
         * rows, 2048 bytes each; dO's panels BR * 128 bytes apart), issued once dS^T is out (below).  MODS: the score
         * in log2 units, then the softcap c2 tanh(S2 / c2) and ALiBi's -slope2 |pos - key| as the forward, the mask,
         * P packed, and st = P (1 - tanh^2) from then on (dS's chain rule). */
        const float slope2 = MODS ? fattn_alibi_slope2(&f, b, h0 + it / nm) : 0.f;
        /* ALiBi's distance pos - key of element i: base + its column - its key row's offset */
        const float base = MODS ? (float)(i0 + f.sk - f.sq - j0 - krow) : 0.f;
        unsigned pp[KS][4], pd[KS][4];
        /* element pair e of k-step kk: P, packed (l2: the two columns' LSE2) */
        auto exp_pair = [&](int kk, int e, float2 l2) {
            const int i = 8 * kk + 2 * e;
            if constexpr (MODS) {
                float pv[2];
#pragma unroll
                for (int y = 0; y < 2; y++) {
                    float dcap, x = v3b_mods_score(st[i + y], c, cap2, inv_cap2, slope2,
                                                   base + (float)(8 * (i / 4) + 2 * t + y - 8 * ((i >> 1) & 1)),
                                                   &dcap);
                    if (masked && !visible(i + y)) x = -INFINITY;
                    pv[y] = fast_exp2(x - (y ? l2.y : l2.x));
                    st[i + y] = pv[y] * dcap;
                }
                pp[kk][e] = pack2(pv[0], pv[1], T());
            } else {
                st[i] = fast_exp2(fmaf(st[i], c, -l2.x));
                st[i + 1] = fast_exp2(fmaf(st[i + 1], c, -l2.y));
                pp[kk][e] = pack2(st[i], st[i + 1], T());
            }
        };
        each_pair(lse2, lse_s, exp_pair);
        const unsigned dot_lo = desc_lo(do_s, BR * 128), qt_lo = desc_lo(q_s, BR * 128);
        wgmma_wait<0>(); /* dP^T done */
        reg_fence(dpt);
        /* dS^T = P^T (dP^T - D): A fragments, and to shared memory for dQ (rows keys, 64-query panels, swizzled;
         * DQ_SWAP: after the loop) */
        auto ds_pair = [&](int kk, int e, float2 dd) { /* dd: the two columns' D */
            const int i = 8 * kk + 2 * e;
            pd[kk][e] = pack2(st[i] * (dpt[i] - dd.x), st[i + 1] * (dpt[i + 1] - dd.y), T());
            if constexpr (!DQ_SWAP) {
                const int col = 8 * (i / 4) + 2 * t, r = krow + 8 * (e & 1), chunk = (col % 64) / 8;
                *(unsigned *)(ds_b + (col / 64) * BC * 64 + r * 64 + ((chunk ^ (r & 7)) * 8) + col % 8) = pd[kk][e];
            }
        };
        each_pair(dsum, d_s, ds_pair);
        if constexpr (DQ_SWAP) {
            /* dS K-major: BR rows (queries) by BC keys in two 64-key panels, this consumer's the panel cw.  k-step kk's
             * four fragments pd[kk][m] are the 8 x 8 blocks (queries 16 kk + 8 (m >> 1) + [0, 8), keys 16 warp +
             * 8 (m & 1) + [0, 8)) of dS^T; stored transposed, lane 8 m + j addresses query row 16 kk + 8 (m >> 1) + j,
             * whose 16 bytes of keys sit in 16-byte chunk 2 warp + (m & 1), swizzled by the row */
            const unsigned ds_panel = smem_u32(ds_b + cw * BR * 64);
            const int m = lane >> 3, chunk = 2 * warp + (m & 1);
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                const int q = 16 * kk + 8 * (m >> 1) + (lane & 7);
                stmatrix_x4_trans(ds_panel + q * 128 + ((chunk ^ (q & 7)) << 4), pd[kk][0], pd[kk][1], pd[kk][2],
                                  pd[kk][3]);
            }
        }
        fence_proxy_async(); /* the dS^T stores, before the other consumer's wgmma reads them */
        /* dV += P^T dO, on the tensor cores while the consumers meet.  Issued here rather than while dP^T finishes (as
         * D=128 did before): 1.01-1.07x faster at D=128 (evidence/backward/h100_v3_bwd_step_order_a65f84f.md), where
         * dV's reads of dO would overlap dP^T's 64-wide products, both operands from shared memory. */
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KS; kk++) wgmma_rs<DP, T>(dv, pp[kk], dot_lo + ((kk * 2048) >> 4), 1);
        wgmma_commit();
        named_barrier_sync(V3B_BAR_DS, 256);

        /* dQ_i = dS K (BC / 16 k-steps of 16 keys; dS^T's panel of this consumer's rows (BR = 128) or the whole dS^T
         * with K's panel of its columns (BR = 64)), then dK += dS^T Q, which runs while dQ goes out */
        float dq[DQ_TILE / 128];
        wgmma_fence();
        if constexpr (DQ_SWAP) { /* dQ^T = K^T dS^T: K's panel cw M-major (A), dS K-major (B, BR rows a panel) */
            const unsigned dsk_lo = desc_lo(ds_b, 0);
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++)
                wgmma_ssta<BR, T>(dq, kn_lo + ((kk * 2048) >> 4),
                                  dsk_lo + (((kk / 4) * BR * 128 + (kk % 4) * 32) >> 4), kk > 0);
        } else {
            const unsigned ds_lo = desc_lo(ds_b + (DQ_ROWS ? cw * BC * 64 : 0), BC * 128);
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++)
                wgmma_sstt<64, T>(dq, ds_lo + ((kk * 2048) >> 4), kn_lo + ((kk * 2048) >> 4), kk > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < KS; kk++) wgmma_rs<DP, T>(dk, pd[kk], qt_lo + ((kk * 2048) >> 4), 1);
        wgmma_commit();
        wgmma_wait<1>(); /* dV and dQ done; dK may still run */
        reg_fence(dq);
        /* the dQ tile -> this consumer's slot, once the writer has read the last one out; the writer adds it to
         * dq_accum (whose tiles are laid out alike, v3_dq_index) */
        named_barrier_sync(V3B_BAR_DQ_EMPTY + cw, V3B_DQ_THREADS);
        if constexpr (DQ_OUT) { /* scale dQ, in T, as TMA's 64 x 64 box with the 128-byte swizzle: row r's 16-byte
                                   chunk j at r * 64 + 8 (j ^ (r & 7)); this thread's rows r0 and r0 + 8 share r & 7 */
            const int r0 = warp * 16 + g, x8 = 8 * (r0 & 7);
            T *sdQt = (T *)sdQ + cw * 4096 + r0 * 64 + 2 * t;
            const float sc = all.fwd.scale;
#pragma unroll
            for (int i = 0; i < 32; i += 2)
                *(unsigned *)(sdQt + ((i & 2) ? 512 : 0) + ((8 * (i / 4)) ^ x8)) =
                    pack2(dq[i] * sc, dq[i + 1] * sc, T());
        } else {
#pragma unroll
            for (int v4 = 0; v4 < DQ_TILE / 512; v4++)
                *(float4 *)(sdQw + v3_dq_index(tid, 4 * v4)) =
                    make_float4(dq[4 * v4], dq[4 * v4 + 1], dq[4 * v4 + 2], dq[4 * v4 + 3]);
        }
        fence_proxy_async();
        named_barrier_arrive(V3B_BAR_DQ_FULL + cw, V3B_DQ_THREADS);
        wgmma_wait<0>();
        reg_fence(dk);
        reg_fence(dv);
        mbar_arrive(&q_empty[s]); /* Q_i, dO_i, LSE, D of slot s all read */
    }

    /* ---- epilogue: scale * dK and dV, rows < Sk, columns < d, staged in K's and V's tiles (free once both
     * consumers' GEMMs are done) so that each warp stores whole rows, 16 bytes a thread ---- */
    if (tid == 0 && cw == 0) V3B_PROBE(V3B_PROBE_LOOP, v3b_clock());
    named_barrier_sync(V3B_BAR_DS, 256);
    T *sdK = sK + cw * 64 * DP, *sdV = sV + cw * 64 * DP; /* this consumer's 64 keys */
    v3b_stage<T, DP>(sdK, sdV, dk, dv, f.scale, krow - cw * 64, t);
    named_barrier_sync(V3B_BAR_DS, 256);
    v3b_store_rows<T, DP>((T *)p.dk + b * p.dk_stride_b + hk * p.dk_stride_h, p.dk_stride_s, sdK,
                          (T *)p.dv + b * p.dv_stride_b + hk * p.dv_stride_h, p.dv_stride_s, sdV,
                          j0 + cw * 64, f.sk, f.d, tid);
    if (tid == 0) {
        V3B_PROBE(cw ? V3B_PROBE_STORED1 : V3B_PROBE_STORED0, v3b_clock());
        if (cw == 0) V3B_PROBE(V3B_PROBE_STORED0_NS, v3b_ns());
    }
}

#endif
