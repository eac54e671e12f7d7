/* v3_schedule.h -- v3's tile scheduler, host and device: the kernel walks it, the planner replays it to choose the
 * tile order (v3_plan.c).  Plain C.
 *
 * The persistent grid's work is nqb * b * h tiles of Br query rows.  Heads come in groups of `group` (b, h) pairs;
 * inside a group query blocks run in reverse order (longest first when causal) with the heads fastest.  group = 1
 * walks one head's query blocks after another, so the blocks running at once share one or a few heads' K and V
 * (read from DRAM about once); group = b * h walks every head's last query block first, which balances causal tiles
 * of very different lengths but leaves K and V little reuse in L2.
 * Split tails (split = 1; three consumers, the planner's rule in v3_plan.c): where a head's last query block holds
 * at most 64 rows -- one consumer's, the other two idle through a whole tile -- the consumers share out its key
 * blocks instead (v3_fwd_kernel.cuh).  It keeps its place in the order, beside its head's other tiles, K and V
 * still in L2 (placed after every full tile, split tails gained 1.033x at D=64 S=1k instead of 1.073x -- from the
 * timings about 0.8 of a full tile each, K and V back from DRAM being the likely cause, not profiled), and the
 * planner sizes the grid so that the short tiles do not all fall to the same blocks.
 */
#ifndef FATTN_V3_SCHEDULE_H
#define FATTN_V3_SCHEDULE_H

#include "../../csrc/fattn.h"

typedef struct {
    int64_t i0;  /* first query row */
    int b, h;    /* batch, query head */
    int n_min;   /* first key block (of Bc keys) any row of the tile sees */
    int nblocks; /* key blocks from n_min on that some row of the tile sees */
    int split;   /* 1: a split tail (at most 64 rows, its key blocks shared out over the consumers) */
} v3_tile;

/* The persistent grid's tiles: every (b, h)'s query blocks of br rows. */
FATTN_HD int64_t v3_ntiles(const attn_params *p, int br) { return (p->sq + br - 1) / br * p->b * p->h; }

/* The persistent grid's k-th tile for block x (of G): rounds of G tiles, walked forwards in even rounds and
 * backwards in odd ones, so a block that got a long causal tile in one round gets a short one in the next. */
FATTN_HD int64_t v3_tile_index(int64_t k, int64_t x, int64_t G) { return k * G + ((k & 1) ? G - 1 - x : x); }

/* Where tile `tile` sits: its (b, h) pair and first query row (the key span left empty).  The arithmetic in U:
 * v3_tile_place in 32 bits -- the planner keeps the tiles below 2^31 (v3_plan.c), so the heads b h, their query
 * blocks and a group (1 or b h) fit too, and a division is a few instructions inline instead of a call of the
 * 64-bit routine (three of them between one tile's last GEMMs and the next tile's first): D=64 1.005-1.027x on the
 * seeds grid, 1.004-1.021x at fa3 S <= 2k (evidence/bench/h100_v3_fwd_place32_ffed617.md).
 * v3_tile_place_wide in 64 bits, for the kernels that run tiles back to back (V3_FLAT; v3_fwd_place): with the 32-bit
 * form ptxas scheduled their main loop differently and they ran 0.92-1.02x (74e1565), with the placement handed
 * over by the producer 0.935-1.01x (1d340a3). */
#define V3_TILE_PLACE(NAME, U)                                                                                     \
    FATTN_HD v3_tile NAME(const attn_params *p, int br, int64_t tile, int64_t group, int split) {               \
        const U nqb = (U)((p->sq + br - 1) / br), nbh = (U)(p->b * p->h), t = (U)tile, g = (U)group;              \
        const U first = t / (g * nqb) * g, in_group = nbh - first < g ? nbh - first : g, r = t - first * nqb;     \
        const U bh = first + r % in_group, hh = (U)p->h;                                                           \
        v3_tile w;                                                                                                 \
        w.i0 = (int64_t)(nqb - 1 - r / in_group) * br;                                                             \
        w.b = (int)(bh / hh);                                                                                      \
        w.h = (int)(bh % hh);                                                                                      \
        w.n_min = w.nblocks = 0;                                                                                   \
        w.split = split && r / in_group == 0; /* the head's last query block (the planner's rule: <= 64 rows) */  \
        return w;                                                                                                  \
    }
V3_TILE_PLACE(v3_tile_place, unsigned)
V3_TILE_PLACE(v3_tile_place_wide, int64_t)
#undef V3_TILE_PLACE

/* The key blocks a placed tile visits, for a sequence of sq queries and sk keys (a varlen batch's own lengths; a
 * tile past its sequence's queries visits none). */
FATTN_HD void v3_tile_span(const attn_params *p, int br, int bc, int64_t sq, int64_t sk, v3_tile *w) {
    const fattn_span s = fattn_key_span(&p->mask, sq, sk, w->i0, br, bc);
    w->n_min = (int)s.n_min;
    w->nblocks = (int)(s.n_max - s.n_min);
}

FATTN_HD v3_tile v3_tile_of(const attn_params *p, int br, int bc, int64_t tile, int64_t group, int split) {
    v3_tile w = v3_tile_place(p, br, tile, group, split);
    v3_tile_span(p, br, bc, p->sq, p->sk, &w);
    return w;
}

/* The dynamic schedule of per-sequence calls (SEQ: packed batches, seqused_k): block x's first tile is number x,
 * its others come from a counter in global memory (one add per tile, plus the grid), so a block that drew short
 * tiles draws more.  The numbers count only the tiles that exist -- sequence after sequence, in each its query
 * blocks from the last (the longest when causal) to the first with the heads fastest.  The static schedule walks
 * tiles sized for the longest sequence, skipping those past each one's end wherever they fall: on a ragged causal
 * batch its busiest block had 1.094x the mean work (a replay), the dynamic one's 1.004.  A block's numbers only
 * grow, so it walks the sequences forwards with a cursor (b, base: the tiles of the sequences before b), reading
 * each length once.  Returns 0 when tile t is past the last sequence's tiles. */
typedef struct {
    int b, base; /* 32 bits: the planner keeps tile counts below 2^31 (64-bit divisions cost the producer a stack) */
} v3_seq_cursor;

FATTN_HD int v3_seq_tile(const attn_params *p, int br, int t, v3_seq_cursor *c, v3_tile *w) {
    const int h = (int)p->h;
    for (; c->b < p->b; c->b++) {
        const int nqb = ((int)fattn_extent_of(p, c->b).sq + br - 1) / br, n = nqb * h;
        if (t < c->base + n) {
            const int r = (t - c->base) / h;
            w->b = c->b;
            w->h = t - c->base - r * h;
            w->i0 = (int64_t)(nqb - 1 - r) * br;
            w->n_min = w->nblocks = w->split = 0;
            return 1;
        }
        c->base += n;
    }
    return 0;
}

#endif
