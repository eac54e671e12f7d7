/* v3_bwd_ring.cuh -- what v3's dK/dV kernels share (v3_bwd_kernel.cuh: head dims to 128; v3_bwd_wide.cu: 256):
 * which key block and query blocks a block owns, and the producer thread that fills its shared memory -- K_j and
 * V_j once, then per step Q_i, dO_i (TMA) and the rows' LSE2 and D (bulk copies from the workspace, where bwd_prep
 * put them) into a ring of STAGES slots, each with a "full" mbarrier (one arrival and the copies' bytes) and an
 * "empty" one every consumer thread arrives on once it has read the slot. */
#ifndef FATTN_V3_BWD_RING_CUH
#define FATTN_V3_BWD_RING_CUH

#include "hopper.cuh"
#include "../bwd_common.cuh"

/* dq_accum's layout for v3: 64 x 64 float tiles (rows i0 + [0, 64) of a (b, h), columns 64 p + [0, 64) at
 * ((b h + h) ws_rows + i0) ws_cols + 64 * 64 p), each in the order a consumer warpgroup holds it -- float e of
 * accumulator quad v of thread tid at 4 (128 v + tid) + e -- so that its 128 threads store it to shared memory as
 * float4s without bank conflicts and one bulk reduce-add copies it out (v3_bwd_kernel.cuh), or add it from registers
 * with one 16-byte red per quad, a warp's 32 covering 512 contiguous bytes (v3_bwd_wide.cu).  Thread tid's element
 * i is row 16 (tid / 32) + (tid % 32) / 4 + 8 ((i >> 1) & 1), column 8 (i / 4) + 2 (tid % 4) + (i & 1) (wgmma's
 * accumulator). */
DEV int v3_dq_index(int tid, int i) { return 4 * (128 * (i / 4) + tid) + i % 4; }

/* The number of the 64 x 64 tile of rows r0 + [0, 64), columns 64 panel + [0, 64) of (b, h) = bh: its floats are
 * dq_accum[4096 t ..] (the layout above) and its counter dq_sem[t] (deterministic mode: the adds that have landed). */
template <int DP> DEV int64_t v3_dq_tile(int64_t bh, int64_t ws_rows, int64_t r0, int panel) {
    return (bh * ws_rows + r0) / 64 * (DP / 64) + panel;
}

/* Copy c of G (the workspace's dq_copies, fattn.h: fattn_bwd_dq_copies; the wide kernel's deterministic mode on
 * dense batches, else G = 1) of tile t: dq_accum[4096 v3_dq_copy(t, G, c) ..] and its counter dq_sem[v3_dq_copy(t,
 * G, c)] -- a tile's copies side by side, so that a (b, h)'s tiles stay within its rows of dq_accum and dq_sem. */
DEV int64_t v3_dq_copy(int64_t t, int G, int c) { return G * t + c; }

/* setmaxnreg: the block is launched with 168 registers a thread (384 threads); the producer warpgroup gives up what
 * the consumers take, exactly: 128 (168 - 24) = 256 (240 - 168).  (A consumer asking for more than was given back
 * waits in setmaxnreg forever.) */
#define V3B_PRODUCER_REGS 24
#define V3B_CONSUMER_REGS 240
static_assert(128 * (168 - V3B_PRODUCER_REGS) >= 256 * (V3B_CONSUMER_REGS - 168),
              "setmaxnreg: registers given < taken");

/* MODS (a softcap, ALiBi): the raw score s as the forward takes it -- s c in log2 units, the softcap c2 tanh(S2 / c2)
 * (inv_cap2 = 1 / c2; none at c2 = 0), ALiBi's -slope2 |dist| (dist = pos - key) -- before the mask and the
 * exponential; *dcap = 1 - tanh^2, the softcap's factor in dS's chain rule (1 without one). */
DEV float v3b_mods_score(float s, float c, float cap2, float inv_cap2, float slope2, float dist, float *dcap) {
    float x = s * c;
    *dcap = 1.f;
    if (cap2 > 0.f) {
        const float th = fast_tanh(x * inv_cap2);
        x = cap2 * th;
        *dcap = 1.f - th * th;
    }
    return fmaf(-slope2, fabsf(dist), x);
}

/* A block's work: key block kb (keys j0 + [0, BC)) of batch b, kv head hk, for each query head h0 + [0, h_per_kv) of
 * its group, the nm query blocks of BR rows from i_begin that hold the rows seeing it: n_it steps in all, step it
 * being query head h0 + it / nm.  Blocks go head by head (a packed batch: sequence by sequence), key blocks in order,
 * or in chunks of key blocks of every head (v3b_place): a kv head's blocks run side by side sharing its Q and dO in
 * L2, and each starts no later than those of its higher key blocks, which deterministic mode's waits need (a block
 * never waits on one not yet scheduled). */
typedef struct {
    int kb, j0, i_begin, nm, n_it;
    int rot; /* deterministic mode: the walk of each head's query blocks rotated by rot steps (v3b_row0), 0 <= rot <
              * nm; 0 unless the blocks are staggered (v3b_stagger_turn; the wide kernel's own: v3w_turn) */
    int desc; /* deterministic mode under a mask with a right edge (v3b_descends): adds in descending key-block order,
               * query blocks walked first first, the grid's key blocks last first */
    int64_t b, hk, h0;
} v3b_block;

/* Deterministic mode's order of adds to a dQ tile.  Under a mask with a right edge (causal, or a window bounded on
 * the right) the key blocks that see a tile start their walks at different query blocks -- higher key blocks at
 * higher ones -- so walked first first, all starting together, a tile is reached by its key blocks in descending
 * order, one step apart: adds in that order wait on nothing that has not already come.  The grid then places a
 * head's key blocks last first, so that a block waits only on blocks placed before it (v3b_place).  Elsewhere
 * (no right edge, packed batches) key-block order, the grid in key-block order, and the walk last first. */
template <bool SEQ> DEV bool v3b_descends(const attn_params &f) { return !SEQ && f.mask.right >= 0; }

/* A block's turn on a tile whose rows see key blocks [n_min, n_max): the adds that come before its own. */
DEV int v3b_turn(const v3b_block &k, int64_t n_min, int64_t n_max) {
    return k.desc ? (int)(n_max - 1) - k.kb : k.kb - (int)n_min;
}

/* The launcher's word on deterministic mode's order of adds without a mask, in a dense batch (the dK/dV kernels' last
 * argument): key-block order (NONE), staggered in chunks of V3B_DET_CHUNK key blocks (the wide kernel: v3w_turn), or
 * staggered by whole heads (v3b_stagger_turn).  A staggered block's turn may wait on blocks placed after it in its
 * chunk or head, so the launcher asks for a stagger only where that many blocks fit in half the multiprocessors. */
enum { V3B_STAGGER_NONE, V3B_STAGGER_CHUNKS, V3B_STAGGER_HEADS };
/* The wide kernel's chunks of key blocks when staggered (32 against 8: 1.04-1.07x at S = 8k, 1.03x at 16k on an H100
 * in two runs, evidence/backward/h100_v3_bwd_stagger_88a1dbe.md) */
#define V3B_DET_CHUNK 32

/* The key blocks k < nkb with k mod nm < x (0 <= x <= nm). */
DEV int v3b_blocks_below(int nkb, int nm, int x) { return nkb / nm * x + (nkb % nm < x ? nkb % nm : x); }

/* Deterministic mode's stagger of whole heads (without a mask, in both dK/dV kernels).  Unstaggered, a head's key
 * blocks all walk the query blocks in one order, so each reaches a dQ tile right behind the one before it and waits
 * for its add: a chain of turns, nkb - 1 adds long before the head's last block can start.  Staggered, key block kb
 * starts its walk rot = kb mod nm query blocks further on, so at any step the head's blocks are at different tiles
 * (nkb <= nm), and a tile's adds go in the order its blocks reach it: at step u of its walk a block is at walk place
 * w = (u + rot) mod nm, and before it there come the blocks that reached w at steps 0 .. u - 1 -- those whose
 * residue mod nm lies in the cyclic interval (w - u, w] -- and, ties at step u (nkb > nm), the kb / nm of its own
 * residue below it.  A turn waits only on adds of an earlier step, or of the same step by a lower key block, so the
 * waits cannot close a cycle -- but they reach blocks placed after kb, so all of a head's blocks must be able to run
 * at once: the launcher staggers only heads of at most half the GPU's multiprocessors (one block each), at the head
 * dims of V3B_STAGGERS (v3_bwd_kernel.cuh: 64, 256, and 128 at br = 80 or with dQ out). */
DEV int v3b_stagger_turn(const v3b_block &k, int it, int nkb) {
    const int nm = k.nm, u = it % nm, w = u + k.rot < nm ? u + k.rot : u + k.rot - nm, lo = w - u + 1;
    const int before = lo >= 0 ? v3b_blocks_below(nkb, nm, w + 1) - v3b_blocks_below(nkb, nm, lo)
                               : v3b_blocks_below(nkb, nm, w + 1) + nkb - v3b_blocks_below(nkb, nm, lo + nm);
    return before + k.kb / nm;
}

/* The block's grid place: key block kb of batch (packed: sequence) b, kv head hk.  nkb key blocks per (b, kv head),
 * of the longest sequence's keys in a packed batch.  G = 0: head by head, key blocks in order.  G > 0: in chunks of
 * G key blocks -- chunk c is key blocks [c G, c G + G) of every (b, kv head), head by head -- so the blocks in flight
 * span several heads and deterministic mode's turns on a dQ tile chain G blocks a wave, not a wave's worth (the wide
 * kernel's deterministic mode, G = 16, against head by head: causal 1.10-1.20x faster at S >= 2k, non-causal
 * 0.95-1.06x, S <= 1k unchanged: evidence/backward/h100_ab_bwd_wide_det_chunks_3c1c4a8.json).  Either way a block's
 * lower key blocks of its head come earlier in the grid -- or, desc (v3b_descends), its higher ones: key block
 * nkb - 1 - k takes k's place.  heads: head by head whatever G (whole heads staggered: v3b_stagger_turn). */
template <int BC, int G>
DEV void v3b_place(const attn_params &all, bool desc, bool heads, int *kb, int64_t *b, int64_t *hk) {
    const int nkb = (int)((all.sk + BC - 1) / BC);
    int64_t bhk;
    /* desc: no turn waits on another block's walk to chain, so head by head; heads: asked for (v3b_stagger_turn) */
    if (G == 0 || desc || heads) {
        bhk = blockIdx.x / nkb;
        *kb = (int)(blockIdx.x % nkb);
    } else {
        const int64_t per_chunk = (int64_t)G * all.b * all.h_kv, c = blockIdx.x / per_chunk;
        const int64_t r = blockIdx.x - c * per_chunk, w = nkb - c * G < G ? nkb - c * G : G; /* the last is narrower */
        bhk = r / w;
        *kb = (int)(c * G + r % w);
    }
    if (desc) *kb = nkb - 1 - *kb; /* key blocks last first (v3b_descends) */
    *b = bhk / all.h_kv;
    *hk = bhk % all.h_kv;
}

/* The work of key block kb, kv head hk, batch b of f (a packed batch's sequence: its own params, b = 0). */
template <int BR, int BC> DEV v3b_block v3b_block_of(const attn_params &f, int kb, int64_t b, int64_t hk) {
    v3b_block k;
    k.kb = kb;
    k.j0 = kb * BC;
    k.b = b;
    k.hk = hk;
    k.h0 = hk * f.h_per_kv;
    int64_t i_lo, i_hi;
    fattn_rows_seeing(&f.mask, f.sq, f.sk, k.j0, (k.j0 + BC < f.sk ? k.j0 + BC : f.sk) - 1, &i_lo, &i_hi);
    k.i_begin = (int)(i_lo / BR) * BR;
    k.nm = i_lo < i_hi ? (int)((i_hi + BR - 1) / BR) - k.i_begin / BR : 0;
    k.n_it = k.nm * (int)f.h_per_kv;
    k.rot = 0;
    k.desc = 0;
    return k;
}

/* A dK/dV block's params: the call's, or (SEQ, a packed batch) sequence b's alone as a batch of one (fattn.h:
 * fattn_seq_bwd_params), whose rows start at q0 / k0 of the tensor maps (built over all the rows, one batch).
 * Returns false where the block has no keys (past its sequence's). */
template <int BC, bool SEQ, int G = 0> struct v3b_params {
    attn_bwd_params seq;
    int64_t b, hk;
    int kb, q0, k0, tma_b; /* TMA row offsets and batch coordinate */
    __device__ __forceinline__ bool init(const attn_bwd_params &all, bool desc = false, bool heads = false) {
        v3b_place<BC, G>(all.fwd, desc, heads, &kb, &b, &hk);
        q0 = k0 = 0;
        tma_b = (int)b;
        if constexpr (SEQ) {
            fattn_seq_bwd_params(&all, b, &seq);
            const fattn_extent x = fattn_extent_of(&all.fwd, b);
            q0 = (int)x.q0;
            k0 = (int)x.k0;
            b = 0;
            tma_b = 0;
            return kb * BC < seq.fwd.sk;
        }
        return true;
    }
};

/* Step it's first query row.  Deterministic mode walks the query blocks last first (with k.rot, starting k.rot
 * blocks further on, cyclically), or first first where its adds descend (k.desc, v3b_descends).  The rotation wraps
 * by a modulo, or (SUB) by one conditional subtract (rot < nm): on an H100 v3_bwd_kernel.cuh's D=64 stagger ran
 * 1.06-1.18x faster than without it with the subtract (1eb5bb2) and 0.90-1.02x with the modulo (e9d9023), while
 * the wide kernel ran 0.96-0.99x with the subtract (1eb5bb2: its only change), so each keeps the form it was measured
 * fastest with. */
template <int BR, bool DET, bool SUB = false> DEV int v3b_row0(const v3b_block &k, int it) {
    const int u = it % k.nm;
    if constexpr (SUB) {
        const int w = k.rot ? (u + k.rot < k.nm ? u + k.rot : u + k.rot - k.nm) : u;
        return k.i_begin + (DET && !k.desc ? k.nm - 1 - w : u) * BR;
    }
    return k.i_begin + (DET && !k.desc ? k.nm - 1 - (k.rot ? (u + k.rot) % k.nm : u) : u) * BR;
}

/* Named barrier 6 (neither dK/dV kernel uses it otherwise): the zero-ahead warps (the producer warpgroup's last
 * two). */
#define V3B_BAR_ZERO 6

/* Zero-ahead (default mode, dense batches): dq_accum's zero fill moved off bwd_prep's pass into the dK/dV kernel's
 * idle warps.  Blocks go group by group in the grid (a group: a batch's kv head; block x is key block x mod nkb of
 * group x / nkb), so the blocks of group g + ahead start after every block of group g has.  Each block of group g
 * zeroes its share of the dq_accum rows (bwd_dq_rows) that group g + ahead's query heads add into and counts it on
 * that group's counter (count); before a block of a group >= ahead adds to dQ, one of its threads waits until all nkb
 * shares of its group are counted (wait): v3_bwd_kernel.cuh's dQ writer before its first add, v3_bwd_wide.cu's
 * producer before its first Q / dO load (its consumers add from registers once those have landed).  The launcher
 * (v3_bwd.cu: its rule and the measurements behind it) picks ahead so that a group's first block starts V3B_ZERO_LEAD
 * blocks after the last of its zeroers did, and bwd_prep zeroes the groups below ahead.
 * Both read only the block index and the params, so that no register carries them from the block's start (the
 * producer warpgroup runs on 24). */
template <int BC> struct v3b_zero {
    const attn_bwd_params &p;
    __device__ __forceinline__ int64_t nkb() const { return (p.fwd.sk + BC - 1) / BC; }
    __device__ __forceinline__ int64_t group() const { return blockIdx.x / nkb(); }
    /* row 0 of group g's first query head in dq_sem: zeroed by bwd_prep, otherwise unused in default mode */
    __device__ __forceinline__ int *count(int64_t g) const { return p.dq_sem + g * p.fwd.h_per_kv * p.ws_rows; }

    /* This block's share of group g + ahead's rows, zeroed by 64 threads (tid), then counted.  The share is a stretch
     * of the group's heads' rows laid end to end (per_head float4s each, < 2^31: the launcher's rule), taken head by
     * head. */
    __device__ __forceinline__ void fill(int ahead, bool step_rows, int tid) const {
        const attn_params &f = p.fwd;
        const int64_t n = nkb(), g = group(), kb = blockIdx.x - g * n, target = g + ahead;
        if (target >= f.b * f.h_kv) return;
        const int per_head = (int)(bwd_dq_rows(f.sq, step_rows) * p.ws_cols / 4); /* float4s of a head's rows */
        const int64_t total = f.h_per_kv * per_head, lo = total * kb / n, hi = total * (kb + 1) / n;
        int64_t hh = lo / per_head;
        int at = (int)(lo - hh * per_head), left = (int)(hi - lo);
        while (left > 0) {
            float4 *rows = (float4 *)(p.dq_accum + ((target * f.h_per_kv + hh) * p.ws_rows) * p.ws_cols);
            const int end = per_head - at < left ? per_head : at + left;
            for (int i = at + tid; i < end; i += 64) rows[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            left -= end - at;
            at = 0;
            hh++;
        }
        fence_acq_rel_gpu(); /* each thread's zeros, before the count that releases them */
        named_barrier_sync(V3B_BAR_ZERO, 64);
        if (tid == 0) red_release_add(count(target), 1);
    }

    /* One thread, before its block's first add: its group's rows zeroed (groups below ahead: by bwd_prep). */
    __device__ __forceinline__ void wait(int ahead) const {
        const int64_t g = group();
        if (g < ahead) return;
        while (ld_acquire(count(g)) < nkb()) {
        }
        fence_proxy_async_global(); /* the zeros, before this thread's bulk adds or loads (the async proxy) */
    }
};

/* The convert pass beside the dK/dV kernel's last blocks (default mode, dense batches, dQ in dq_accum: the launcher's
 * rule, v3_bwd.cu): every dK/dV block counts itself done on its group's counter once its dQ adds have landed, and
 * each convert block waits until its group (b, kv head) has all nkb of them, so the convert grid can be launched as
 * the dK/dV kernel's programmatic dependent and run on the multiprocessors its last wave leaves idle.  The counter:
 * row 1 of the group's first query head in dq_sem (zeroed by bwd_prep; row 0 is zero-ahead's, and deterministic mode,
 * whose tile counters fill dq_sem from its start, does not count). */
DEV int *v3b_done(const attn_bwd_params &p, int64_t g) { return p.dq_sem + g * p.fwd.h_per_kv * p.ws_rows + 1; }
/* One thread of a dK/dV block, after its adds have landed (cp.async.bulk.wait_group 0) */
DEV void v3b_signal_done(const attn_bwd_params &p, int64_t g) {
    fence_proxy_async_global();
    red_release_add(v3b_done(p, g), 1);
}
/* A whole convert block, before it reads dq_accum: group g counted n blocks done */
DEV void v3b_wait_done(const attn_bwd_params &p, int64_t g, int n) {
    if (threadIdx.x == 0)
        while (ld_acquire(v3b_done(p, g)) < n) __nanosleep(256);
    __syncthreads();
}

/* The shared memory the producer fills: K and V (BC x DP), STAGES slots of Q and dO (BR x DP) and of the rows' LSE2
 * and D (BR floats), the mbarriers kv_full, q_full[STAGES], q_empty[STAGES]. */
template <typename T> struct v3b_ring {
    T *k, *v, *q, *dout;
    float *lse, *dsum;
    uint64_t *kv_full, *q_full, *q_empty;
};

/* The producer: one thread.  K_j, V_j once, then each step's slot once its consumers have released it.  q0, k0: the
 * rows of the tensor maps where the block's sequence starts; tma_b its batch coordinate; SUB: v3b_row0's. */
template <typename T, int DP, int BR, int BC, int STAGES, bool DET, bool SUB = false>
DEV void v3b_produce(const CUtensorMap *tm_q, const CUtensorMap *tm_k, const CUtensorMap *tm_v,
                     const CUtensorMap *tm_do, const attn_bwd_params &p, const v3b_block &k, const v3b_ring<T> &r,
                     int q0, int k0, int tma_b, int zero_wait = 0) {
    constexpr int PANELS = DP / 64, KV_TILE = BC * DP, Q_TILE = BR * DP;
    tma_prefetch_map(tm_q);
    tma_prefetch_map(tm_do);
    mbar_arrive_expect_tx(r.kv_full, 2 * KV_TILE * 2);
#pragma unroll
    for (int c = 0; c < PANELS; c++) {
        tma_load_4d(r.k + c * BC * 64, tm_k, r.kv_full, c * 64, k0 + k.j0, (int)k.hk, tma_b);
        tma_load_4d(r.v + c * BC * 64, tm_v, r.kv_full, c * 64, k0 + k.j0, (int)k.hk, tma_b);
    }
    if (zero_wait > 0) v3b_zero<BC>{p}.wait(zero_wait); /* zero-ahead, v3_bwd_wide.cu: dQ's rows zeroed first */
    const attn_params &f = p.fwd;
    for (int it = 0; it < k.n_it; it++) {
        const int s = it % STAGES, i0 = v3b_row0<BR, DET, SUB>(k, it);
        const int64_t h = k.h0 + it / k.nm;
        if (it >= STAGES) mbar_wait(&r.q_empty[s], (it / STAGES - 1) & 1);
        const int64_t row = (k.b * f.h + h) * p.ws_rows + i0; /* ws_rows >= every step's rows */
        mbar_arrive_expect_tx(&r.q_full[s], 2 * Q_TILE * 2 + 2 * BR * 4);
        bulk_load(r.lse + s * BR, p.lse2 + row, BR * 4, &r.q_full[s]);
        bulk_load(r.dsum + s * BR, p.dpsum + row, BR * 4, &r.q_full[s]);
#pragma unroll
        for (int c = 0; c < PANELS; c++) {
            tma_load_4d(r.q + s * Q_TILE + c * BR * 64, tm_q, &r.q_full[s], c * 64, q0 + i0, (int)h, tma_b);
            tma_load_4d(r.dout + s * Q_TILE + c * BR * 64, tm_do, &r.q_full[s], c * 64, q0 + i0, (int)h, tma_b);
        }
    }
}

/* The epilogue's staging of a consumer's dK or dV (64 keys x COLS columns, fp16 / bf16) in shared memory that its
 * GEMMs no longer read: rows of COLS elements, the 16-byte chunk ch of row r at ch ^ (r mod 8) within its group of
 * eight, so that a warp's pair stores from the accumulators (rows g, g + 8 of its 16, one chunk) and a quarter warp's
 * 16-byte reads of one row's eight chunks both fall on distinct banks.  The element offset of (r, chunk ch). */
template <int COLS> DEV int v3b_stage_at(int r, int ch) { return r * COLS + 8 * (ch ^ (r & 7)); }

/* A consumer thread's share of its scale * dK and its dV, from wgmma accumulators of 64 keys x COLS columns (element
 * i: key row + 8 ((i >> 1) & 1), row = 16 warp + lane / 4; column 8 (i / 4) + 2 t + (i & 1), t = lane % 4), into the
 * staging tiles sdk, sdv (v3b_stage_at), in the dtype. */
template <typename T, int COLS>
DEV void v3b_stage(T *sdk, T *sdv, const float *dk, const float *dv, float scale, int row, int t) {
#pragma unroll
    for (int i = 0; i < COLS / 2; i += 2) {
        const int at = v3b_stage_at<COLS>(row + 8 * ((i >> 1) & 1), i / 4) + 2 * t;
        *(unsigned *)(sdk + at) = pack2(dk[i] * scale, dk[i + 1] * scale, T());
        *(unsigned *)(sdv + at) = pack2(dv[i], dv[i + 1], T());
    }
}

/* A consumer's 128 threads store its staged dK and dV (rows key0 + [0, 64) of dk / dv, which point at the tile's
 * first column; rows < sk and columns < d only) a 16-byte chunk at a time, a warp covering whole rows (the
 * planner's rule: gradients 16-byte aligned, strides and d multiples of 8). */
template <typename T, int COLS>
DEV void v3b_store_rows(T *dk, int64_t dk_stride, const T *sdk, T *dv, int64_t dv_stride, const T *sdv, int64_t key0,
                        int64_t sk, int d, int tid) {
    constexpr int CHUNKS = COLS / 8;
#pragma unroll
    for (int q = tid; q < 64 * CHUNKS; q += 128) {
        const int r = q / CHUNKS, ch = q % CHUNKS;
        const int64_t key = key0 + r;
        if (key < sk && 8 * ch < d) {
            *(uint4 *)(dk + key * dk_stride + 8 * ch) = *(const uint4 *)(sdk + v3b_stage_at<COLS>(r, ch));
            *(uint4 *)(dv + key * dv_stride + 8 * ch) = *(const uint4 *)(sdv + v3b_stage_at<COLS>(r, ch));
        }
    }
}

/* The barriers' initial counts: kv_full and q_full[s] one arrival (the producer's, with the bytes), q_empty[s]
 * every consumer thread's.  Thread 0, before the block's first __syncthreads. */
template <typename T, int STAGES> DEV void v3b_ring_init(const v3b_ring<T> &r, int consumer_threads) {
    mbar_init(r.kv_full, 1);
    for (int s = 0; s < STAGES; s++) {
        mbar_init(&r.q_full[s], 1);
        mbar_init(&r.q_empty[s], consumer_threads);
    }
    mbar_init_fence();
}

#endif
