/* v3_fwd_producer.cuh -- the producer of v3's forward (v3_fwd_kernel.cuh): one thread of the producer warpgroup
 * (PAGED: the first lanes of its first warp, one per piece of a key block, that thread the first) issues every TMA
 * load -- each tile's Q into a slot of QB (free once the tile QB before it has released it), each of its key
 * blocks' K and V into the ring of STAGES slots (each once the consumers have released the slot) -- walking the
 * same tiles as the consumers: the static schedule (v3_schedule.h: rounds of the persistent grid, split tails'
 * places) or, for per-sequence calls with a counter, the dynamic one.
 * A paged KV cache (PAGED kernels) has each key block loaded in pieces of v3_page_rows rows, each from the page its
 * sequence's block table names: lane r loads piece r of K and of V, its page read from the table a key block ahead
 * (the block's pages in one read across the lanes, their latency behind the block before); pieces past the
 * sequence's keys name no page (an index past the pool: TMA fills them with zeros).  The lanes walk the schedule
 * alike; the first takes the dynamic schedule's numbers and writes its entries.  With one thread reading each
 * piece's page just before its load, pages of 64 / 16 ran at 1.33x / 2.34x the contiguous call's time (H100,
 * chunked prefill); with a lane per piece at 1.08-1.09x / 1.28-1.34x
 * (evidence/serving/h100_v3_paged_warp_3b0354c.md).  Copying the blocks of pages smaller than a block by cp.async (the
 * four producer warps, 16-byte chunks into the swizzled panels, arrivals by cp.async.mbarrier.arrive) measured
 * 1.28-1.31x at pages of 16, 32 and 64 alike: no faster at 16, slower at 32 and 64; K by TMA boxes with V copied
 * was slower still (evidence/serving/h100_paged_copies_c3290fa.md). */
#ifndef FATTN_V3_FWD_PRODUCER_CUH
#define FATTN_V3_FWD_PRODUCER_CUH

#include <cuda.h> /* CUtensorMap */

#include "hopper.cuh"
#include "v3_addr.h"
#include "v3_configs.h"
#include "v3_schedule.h"

/* The block's shared memory as v3_fwd lays it out: Q's slots, K's and V's ring, the dynamic schedule's tiles beside
 * the Q slots (q_tile), and the mbarriers. */
template <typename T> struct v3_fwd_smem {
    T *q, *k, *v;
    int4 *q_tile;
    uint64_t *q_full, *q_empty, *k_full, *v_full, *k_empty, *v_empty, *q_read;
};

/* Where a tile of the static schedule sits, as the producer and the consumers of a kernel both place it: in 64
 * bits in the kernels that run tiles back to back (FLAT), else in 32 (v3_schedule.h says why). */
template <bool FLAT>
DEV v3_tile v3_fwd_place(const attn_params *p, int br, int64_t tile, int64_t group, int split) {
    return FLAT ? v3_tile_place_wide(p, br, tile, group, split) : v3_tile_place(p, br, tile, group, split);
}

template <typename T, int DP, int BC, int STAGES, int CWG, bool SEQ, bool DYN, bool PAGED>
DEV void v3_fwd_produce(const CUtensorMap *tm_q, const CUtensorMap *tm_k, const CUtensorMap *tm_v,
                        const attn_params &p, const v3_fwd_smem<T> &sm, int kv_batch_step, int head_group, int split,
                        unsigned *tile_ctr, int lane) {
    constexpr int BR = 64 * CWG, QB = V3_QB(DP, BC, STAGES, CWG), PANELS = DP / 64;
    constexpr int Q_TILE = BR * DP, KV_TILE = BC * DP; /* elements */
    constexpr bool dynamic = DYN;
    const bool leader = !PAGED || lane == 0; /* the thread that issues all but the paged K/V loads */
    static_assert(BC / 16 < 32, "a paged key block's pieces, one per lane");
    /* the lanes here: one per piece (v3_fwd_kernel.cuh) */
    const unsigned lanes = PAGED ? (1u << v3_page_pieces(p.page_size, BC)) - 1u : 1u;
    const int64_t ntiles = v3_ntiles(&p, BR);
    if (leader) {
        tma_prefetch_map(tm_q);
        tma_prefetch_map(tm_k);
        tma_prefetch_map(tm_v);
    }
    int ring = 0; /* K/V ring position */
    /* Tile w's Q into slot qr % QB (free once tile qr - QB's consumers released it) and its key blocks into the
     * ring; packed batches are one batch of rows, sequence b's starting at row q0 / k0 (x) */
    auto load_tile = [&](const v3_tile &w, const fattn_extent &x, int qr) {
        const int hk = (int)(w.h / p.h_per_kv), qb = SEQ && p.cu_seqlens_q ? 0 : w.b;
        const int kb = SEQ && p.cu_seqlens_k ? 0 : w.b * kv_batch_step, k0 = (int)x.k0;
        const int qs = qr % QB;
        if (leader) {
            mbar_arrive_expect_tx(&sm.q_full[qs], Q_TILE * 2);
#pragma unroll
            for (int c = 0; c < PANELS; c++)
                tma_load_4d(sm.q + qs * Q_TILE + c * BR * 64, tm_q, &sm.q_full[qs], c * 64, (int)(x.q0 + w.i0), w.h,
                            qb);
        }
        /* paged: this lane's piece of key block j -- its first row in the block, its page (none past the keys) */
        const int ps = (int)p.page_size, rows = PAGED ? v3_page_rows(ps, BC) : BC, r = lane * rows;
        const int32_t *table = PAGED ? p.block_table + (int64_t)w.b * p.block_table_stride : nullptr;
        auto page_of = [&](int j) {
            const int key = j * BC + r;
            return PAGED && key < x.sk ? __ldg(table + key / ps) : (int)p.num_pages;
        };
        int page = page_of(w.n_min);
        for (int j = w.n_min; j < w.n_min + w.nblocks; j++, ring++) {
            const int s = ring % STAGES;
            const unsigned parity = ((ring / STAGES) & 1) ^ 1; /* the phase the consumers completed last round */
            const int page_next = PAGED && j + 1 < w.n_min + w.nblocks ? page_of(j + 1) : 0;
            /* key block j of K (or V) into slot s once the consumers have released it.  Paged, the lanes' loads
             * may land before the first lane's expect_tx: the count goes below zero a while, and the phase cannot
             * complete before that arrival. */
            auto load = [&](T *dst, const CUtensorMap *map, uint64_t *full, uint64_t *empty) {
                if (ring >= STAGES) mbar_wait(empty, parity);
                if (leader) mbar_arrive_expect_tx(full, KV_TILE * 2);
                if (PAGED) {
#pragma unroll
                    for (int c = 0; c < PANELS; c++)
                        tma_load_4d(dst + c * BC * 64 + r * 64, map, full, c * 64, (j * BC + r) % ps, hk, page);
                    return;
                }
                if (leader) {
#pragma unroll
                    for (int c = 0; c < PANELS; c++)
                        tma_load_4d(dst + c * BC * 64, map, full, c * 64, k0 + j * BC, hk, kb);
                }
            };
            load(sm.k + s * KV_TILE, tm_k, &sm.k_full[s], &sm.k_empty[s]);
            load(sm.v + s * KV_TILE, tm_v, &sm.v_full[s], &sm.v_empty[s]);
            page = page_next;
        }
    };
    if (!dynamic) {
        int round = 0, qround = 0; /* tiles walked, Q tiles loaded (SEQ skips some) */
        for (int64_t tile; (tile = v3_tile_index(round, blockIdx.x, gridDim.x)) < ntiles; round++) {
            v3_tile w = v3_fwd_place<V3_FLAT(DP, BC, STAGES, CWG)>(&p, BR, tile, head_group, split);
            const fattn_extent x = SEQ ? fattn_extent_of(&p, w.b) : fattn_dense_extent(&p);
            if (SEQ && w.i0 >= x.sq) continue; /* past its sequence's queries: no tile at all */
            v3_tile_span(&p, BR, BC, x.sq, x.sk, &w);
            const int qr = SEQ ? qround++ : round;
            if (qr >= QB) mbar_wait(&sm.q_empty[qr % QB], (qr / QB - 1) & 1);
            load_tile(w, x, qr);
        }
        return;
    }
    /* dynamic: block x's first tile is number x, the next ones come from the counter (+ the grid), each number
     * read a tile ahead.  Beside each tile's Q goes the tile after it, so the consumers know a tile before its
     * Q lands and compute its span ahead of any wait (after a wait the compiler moved their ring and
     * descriptor arithmetic off the uniform datapath: 4-18% slower, evidence/serving/h100_v3_dyn_schedule_12be09c.md). */
    /* The producer keeps its tiles in shared memory too (q_tile: the current one is the entry written a tile
     * ago, or the first), so few values live across a tile's loads: with 24 registers the rest spill, and a
     * spilled tile number would wait for its atomic at once. */
    v3_seq_cursor seqs = {0, 0};
    unsigned t = 0u; /* the next tile's number (the first lane's: it takes them) */
    if (leader && sm.q_tile[QB].w) t = atomicAdd(tile_ctr, 1u) + gridDim.x; /* the second tile's number */
    for (int qr = 0;; qr++) {
        if (PAGED) __syncwarp(lanes); /* the first lane's entries are written */
        const int4 cur = sm.q_tile[qr == 0 ? QB : (qr - 1) % QB];
        if (!cur.w) break;
        v3_tile wn; /* the next tile, its number read a tile ago */
        const bool more_n = v3_seq_tile(&p, BR, PAGED ? (int)__shfl_sync(lanes, t, 0) : (int)t, &seqs, &wn);
        if (more_n && leader) t = atomicAdd(tile_ctr, 1u) + gridDim.x;
        const int qs = qr % QB;
        if (qr >= QB) mbar_wait(&sm.q_read[qs], (qr / QB - 1) & 1); /* the slot's last entry has been read */
        if (PAGED) __syncwarp(lanes); /* every lane has read cur */
        if (leader) sm.q_tile[qs] = more_n ? make_int4((int)wn.i0, wn.b, wn.h, 1) : make_int4(0, 0, 0, 0);
        v3_tile w;
        w.i0 = cur.x;
        w.b = cur.y;
        w.h = cur.z;
        const fattn_extent x = fattn_extent_of(&p, w.b);
        v3_tile_span(&p, BR, BC, x.sq, x.sk, &w);
        if (qr >= QB) mbar_wait(&sm.q_empty[qs], (qr / QB - 1) & 1); /* ... and its Q */
        load_tile(w, x, qr); /* its arrival on q_full releases the entry */
    }
    if (leader) { /* the last block to take its final number sets the counter back to zero for the next launch */
        __threadfence();
        if (atomicAdd(tile_ctr + 1, 1u) == gridDim.x - 1) {
            __threadfence();
            tile_ctr[0] = 0u;
            tile_ctr[1] = 0u;
        }
    }
}

#endif
