/* v3_schedule.h -- v3's tile scheduler, host and device: the kernel walks it, the planner replays it to choose the
 * tile order (v3_plan.c).  Plain C.
 *
 * The persistent grid's work is nqb * b * h tiles of Br query rows.  Heads come in groups of `group` (b, h) pairs;
 * inside a group query blocks run in reverse order (longest first when causal) with the heads fastest.  group = 1
 * walks one head's query blocks after another, so the blocks running at once share one or a few heads' K and V
 * (read from DRAM about once); group = b * h walks every head's last query block first, which balances causal tiles
 * of very different lengths but leaves K and V little reuse in L2.
 */
#ifndef FATTN_V3_SCHEDULE_H
#define FATTN_V3_SCHEDULE_H

#include "../../csrc/fattn.h"

typedef struct {
    int64_t i0;  /* first query row */
    int b, h;    /* batch, query head */
    int n_min;   /* first key block (of Bc keys) any row of the tile sees */
    int nblocks; /* key blocks from n_min on that some row of the tile sees */
} v3_tile;

/* The persistent grid's k-th tile for block x (of G): rounds of G tiles, walked forwards in even rounds and
 * backwards in odd ones, so a block that got a long causal tile in one round gets a short one in the next. */
FATTN_HD int64_t v3_tile_index(int64_t k, int64_t x, int64_t G) { return k * G + ((k & 1) ? G - 1 - x : x); }

/* Where tile `tile` sits: its (b, h) pair and first query row (the key span left empty). */
FATTN_HD v3_tile v3_tile_place(const attn_params *p, int br, int64_t tile, int64_t group) {
    const int64_t nqb = (p->sq + br - 1) / br, nbh = p->b * p->h, first = tile / (group * nqb) * group;
    const int64_t in_group = nbh - first < group ? nbh - first : group, r = tile - first * nqb;
    const int64_t bh = first + r % in_group;
    v3_tile w;
    w.i0 = (nqb - 1 - r / in_group) * br;
    w.b = (int)(bh / p->h);
    w.h = (int)(bh % p->h);
    w.n_min = w.nblocks = 0;
    return w;
}

/* The key blocks a placed tile visits, for a sequence of sq queries and sk keys (a varlen batch's own lengths; a
 * tile past its sequence's queries visits none). */
FATTN_HD void v3_tile_span(const attn_params *p, int br, int bc, int64_t sq, int64_t sk, v3_tile *w) {
    const fattn_span s = fattn_key_span(&p->mask, sq, sk, w->i0, br, bc);
    w->n_min = (int)s.n_min;
    w->nblocks = (int)(s.n_max - s.n_min);
}

FATTN_HD v3_tile v3_tile_of(const attn_params *p, int br, int bc, int64_t tile, int64_t group) {
    v3_tile w = v3_tile_place(p, br, tile, group);
    v3_tile_span(p, br, bc, p->sq, p->sk, &w);
    return w;
}

#endif
