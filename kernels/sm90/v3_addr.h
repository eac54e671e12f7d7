/* v3_addr.h -- what TMA can address: the rule both v3 planners (v3_plan.c, v3_bwd_plan.c) ask of a call's tensors,
 * and how a paged cache's key blocks are cut into loads (the forward's planner, launcher and producer).  Plain C;
 * v3_page_rows also on the device. */
#ifndef FATTN_V3_ADDR_H
#define FATTN_V3_ADDR_H

#include "../../csrc/fattn.h"

/* A dimension of `size` elements with this stride (in 2-byte elements): positive, a multiple of 16 bytes and below
 * 2^40 bytes (cuTensorMapEncodeTiled's limits); a size-1 dimension's stride does not matter. */
static inline int stride_ok(int64_t stride, int64_t size) {
    return size == 1 || (stride > 0 && stride % 8 == 0 && stride < (1ll << 38));
}
/* TMA's global addresses are 16-byte aligned. */
static inline int aligned16(const void *ptr) { return (uintptr_t)ptr % 16 == 0; }

/* A paged cache's key block of bc keys is loaded in pieces of this many rows, each inside one page (TMA boxes of a
 * page's rows): the whole block where pages hold whole blocks, a page where blocks hold whole pages, else 16 rows
 * (page sizes are multiples of 16, so are bc and the blocks' first keys).  The launcher's maps and the producer's
 * loads (v3_fwd.cu, v3_fwd_producer.cuh) both follow it. */
FATTN_HD int v3_page_rows(int64_t page_size, int bc) {
    return page_size % bc == 0 ? bc : bc % page_size == 0 ? (int)page_size : 16;
}
/* ... and this many pieces a key block (bc / 16 at most): one lane of v3's producer warp each. */
FATTN_HD int v3_page_pieces(int64_t page_size, int bc) { return bc / v3_page_rows(page_size, bc); }

#endif
