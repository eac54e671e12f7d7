/* v3_fwd_producer.cuh -- the producer of v3's forward (v3_fwd_kernel.cuh): one thread of the producer warpgroup
 * (PAGED: lanes of its first warp, that thread the first) issues every load -- each tile's Q into a slot of QB
 * (free once the tile QB before it has released it), each of its key blocks' K and V into the ring of STAGES
 * slots (each once the consumers have released the slot) -- walking the same tiles as the consumers: the static schedule (v3_schedule.h: rounds of the persistent grid, split tails'
 * places) or, for per-sequence calls with a counter, the dynamic one.
 * A paged KV cache (PAGED kernels) has each key block loaded in pieces, each from the page its sequence's block
 * table names, lane r's page the one of piece r, read from the table a key block ahead (the block's pages in one
 * read across the lanes, their latency behind the block before).  Where a page holds whole blocks (v3_page_copies
 * false) the pieces are TMA boxes of v3_page_rows rows, lane r loading piece r of K and of V; pieces past the
 * sequence's keys name no page (an index past the pool: TMA fills them with zeros).  Where pages are smaller than
 * a block the whole warp copies it by cp.async, 16 rows a piece (v3_copy_paged_block), each lane arriving on the
 * slot's full barrier once its copies have landed.  The lanes walk the schedule alike; the first takes the dynamic
 * schedule's numbers and writes its entries.  With one thread reading each piece's page just before its load,
 * pages of 64 / 16 ran at 1.33x / 2.34x the contiguous call's time (H100, chunked prefill); with a lane per piece
 * of TMA boxes at 1.08-1.09x / 1.28-1.34x (evidence/serving/h100_v3_paged_warp_3b0354c.md). */
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

/* The producer warpgroup's named barrier where its four warps copy (v3_page_copies; 1-8 are the consumers'). */
#define V3_BAR_PRODUCER 9

/* Key block j of a paged K (or V) by cp.async (v3_page_copies: pages smaller than a block): the producer
 * warpgroup's four warps copy it, warp w the pieces of 16 rows w, w + 4, ..., into the 128-byte-swizzled panels a
 * TMA box would fill (chunk c of row r at chunk c ^ (r % 8) of its 128-byte row; DP / 64 panels of BC rows from
 * the shared-space address dst).  Piece i comes from the page lane i of each warp holds (`page`, read a block
 * ahead; page 0 past the keys, so that every address stays inside the pool), from row (row0 + 16 i) % ps of it;
 * rows at or past `valid` and columns at or past d are written as zeros (and not read).  Each instruction copies 4
 * rows of 128 bytes; a row step is one 64-bit add, the panels immediate offsets. */
template <typename T, int DP, int BC>
DEV void v3_copy_paged_block(unsigned dst, const T *head, int64_t page_stride, int64_t row_stride, int page,
                             int row0, int ps, int valid, int d, int tid) {
    constexpr int PANELS = DP / 64, PIECES = BC / 16;
    const int lane = tid % 32, warp = tid / 32;
    const int c = lane % 8, sub = lane / 8; /* the lane's 16-byte chunk of a row, and its row of each four */
    const T *lane_src = head + sub * row_stride + c * 8;
    const int64_t step = 4 * row_stride;
    bool col_in[PANELS]; /* the lane's chunk of panel pn holds data */
#pragma unroll
    for (int pn = 0; pn < PANELS; pn++) col_in[pn] = pn * 64 + c * 8 < d;
#pragma unroll
    for (int pc = warp; pc < PIECES; pc += 4) {
        const int pg = __shfl_sync(0xffffffffu, page, pc);
        const T *src = lane_src + (int64_t)pg * page_stride + (int64_t)((row0 + 16 * pc) % ps) * row_stride;
        const int rows = valid - pc * 16 - sub; /* the lane's row q * 4 of the piece holds a key while q * 4 < rows */
        const unsigned at = dst + (pc * 16 + sub) * 128;
#pragma unroll
        for (int q = 0; q < 4; q++, src += step) {
            const unsigned row_at = at + q * 4 * 128 + ((c ^ ((q * 4 + sub) & 7)) << 4);
#pragma unroll
            for (int pn = 0; pn < PANELS; pn++)
                cp_async_16_to(row_at + pn * BC * 128, src + pn * 64, q * 4 < rows && col_in[pn] ? 16 : 0);
        }
    }
}

template <typename T, int DP, int BC, int STAGES, int CWG, bool SEQ, bool DYN, bool PAGED>
DEV void v3_fwd_produce(const CUtensorMap *tm_q, const CUtensorMap *tm_k, const CUtensorMap *tm_v,
                        const attn_params &p, const v3_fwd_smem<T> &sm, int kv_batch_step, int head_group, int split,
                        unsigned *tile_ctr, int tid) {
    constexpr int BR = 64 * CWG, QB = V3_QB(DP, BC, STAGES, CWG), PANELS = DP / 64;
    constexpr int Q_TILE = BR * DP, KV_TILE = BC * DP; /* elements */
    constexpr bool dynamic = DYN;
    const int lane = tid % 32;
    const bool leader = !PAGED || tid == 0; /* the thread that issues all but the paged K/V loads */
    static_assert(BC / 16 < 32, "a paged key block's pieces, one per lane");
    /* the threads here (v3_fwd_kernel.cuh): the first warp's lanes, one per piece of TMA boxes, or the whole
     * warpgroup copying (v3_page_copies) */
    const bool copies = PAGED && v3_page_copies(p.page_size, BC);
    const unsigned lanes = !PAGED ? 1u : (1u << v3_page_pieces(p.page_size, BC)) - 1u;
    auto sync_producers = [&]() {
        if (copies) named_barrier_sync(V3_BAR_PRODUCER, 128);
        else if (PAGED) __syncwarp(lanes);
    };
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
        /* paged: this lane's piece of key block j -- its first row in the block, its page (none past the keys:
         * TMA boxes an index past the pool, copies page 0; copies: pieces of 16 rows, every warp's lanes reading
         * the block's pages, lanes past its pieces none) */
        const int ps = (int)p.page_size, rows = !PAGED ? BC : copies ? 16 : v3_page_rows(ps, BC), r = lane * rows;
        /* copies: K still by TMA boxes of v3_page_rows rows, lane r of the first warp box r, its page from the lane
         * holding the box's first 16 rows */
        const int box_rows = PAGED ? v3_page_rows(ps, BC) : BC, box_r = lane * box_rows;
        const bool box_lane = !copies || (tid < 32 && lane < v3_page_pieces(ps, BC));
        const int32_t *table = PAGED ? p.block_table + (int64_t)w.b * p.block_table_stride : nullptr;
        auto page_of = [&](int j) {
            const int key = j * BC + r;
            return PAGED && r < BC && key < x.sk ? __ldg(table + key / ps) : copies ? 0 : (int)p.num_pages;
        };
        int page = page_of(w.n_min);
        for (int j = w.n_min; j < w.n_min + w.nblocks; j++, ring++) {
            const int s = ring % STAGES;
            const unsigned parity = ((ring / STAGES) & 1) ^ 1; /* the phase the consumers completed last round */
            const int page_next = PAGED && j + 1 < w.n_min + w.nblocks ? page_of(j + 1) : 0;
            /* key block j of K (or V) into slot s once the consumers have released it.  Paged, the lanes' loads
             * may land before the first lane's expect_tx: the count goes below zero a while, and the phase cannot
             * complete before that arrival. */
            auto load = [&](T *dst, const CUtensorMap *map, uint64_t *full, uint64_t *empty, const T *pool,
                            int64_t stride_h, int64_t stride_page, int64_t stride_row, bool copy) {
                if (ring >= STAGES) mbar_wait(empty, parity);
                if (copy) { /* every thread: its share of the block, then its arrival once that has landed */
                    v3_copy_paged_block<T, DP, BC>(smem_addr(dst), pool + hk * stride_h, stride_page, stride_row,
                                                   page, (j * BC) % ps, ps, x.sk - j * BC, (int)p.d, tid);
                    cp_async_arrive_noinc(full);
                    return;
                }
                if (leader) mbar_arrive_expect_tx(full, KV_TILE * 2);
                if (PAGED) {
                    int box_page = page;
                    if (copies) { /* the box's page from the lane of its first 16 rows; none past the keys */
                        box_page = __shfl_sync(0xffffffffu, page, (lane * box_rows / 16) & 31);
                        if (j * BC + box_r >= x.sk) box_page = (int)p.num_pages;
                    }
                    if (box_lane) {
#pragma unroll
                        for (int c = 0; c < PANELS; c++)
                            tma_load_4d(dst + c * BC * 64 + box_r * 64, map, full, c * 64, (j * BC + box_r) % ps, hk,
                                        box_page);
                    }
                    return;
                }
                if (leader) {
#pragma unroll
                    for (int c = 0; c < PANELS; c++)
                        tma_load_4d(dst + c * BC * 64, map, full, c * 64, k0 + j * BC, hk, kb);
                }
            };
            load(sm.k + s * KV_TILE, tm_k, &sm.k_full[s], &sm.k_empty[s], (const T *)p.k, p.k_stride_h,
                 p.k_stride_b, p.k_stride_s, false);
            load(sm.v + s * KV_TILE, tm_v, &sm.v_full[s], &sm.v_empty[s], (const T *)p.v, p.v_stride_h,
                 p.v_stride_b, p.v_stride_s, copies);
            page = page_next;
        }
    };
    if (!dynamic) {
        int round = 0, qround = 0; /* tiles walked, Q tiles loaded (SEQ skips some) */
        for (int64_t tile; (tile = v3_tile_index(round, blockIdx.x, gridDim.x)) < ntiles; round++) {
            v3_tile w = v3_tile_place(&p, BR, tile, head_group, split);
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
    /* Copies (four warps): the number of the tile after an entry's travels in the entry's flag, as that number + 1
     * (the consumers only test the flag), the first tile's written there before the loop. */
    v3_seq_cursor seqs = {0, 0};
    unsigned t = 0u; /* the next tile's number (the first thread's: it takes them) */
    if (leader && sm.q_tile[QB].w) {
        t = atomicAdd(tile_ctr, 1u) + gridDim.x; /* the second tile's number */
        if (copies) sm.q_tile[QB].w = (int)t + 1;
    }
    for (int qr = 0;; qr++) {
        sync_producers(); /* the first thread's entries are written */
        const int4 cur = sm.q_tile[qr == 0 ? QB : (qr - 1) % QB];
        if (!cur.w) break;
        v3_tile wn; /* the next tile, its number read a tile ago */
        const int tn = copies ? cur.w - 1 : PAGED ? (int)__shfl_sync(lanes, t, 0) : (int)t;
        const bool more_n = v3_seq_tile(&p, BR, tn, &seqs, &wn);
        if (more_n && leader) t = atomicAdd(tile_ctr, 1u) + gridDim.x;
        const int qs = qr % QB;
        if (qr >= QB) mbar_wait(&sm.q_read[qs], (qr / QB - 1) & 1); /* the slot's last entry has been read */
        sync_producers(); /* every thread has read cur */
        if (leader)
            sm.q_tile[qs] = more_n ? make_int4((int)wn.i0, wn.b, wn.h, copies ? (int)t + 1 : 1) : make_int4(0, 0, 0, 0);
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
