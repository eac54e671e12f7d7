/* varlen_rows.c -- zero gradients in the rows of a packed batch that no sequence covers, on the CPU (varlen_rows.h). */
#include "varlen_rows.h"

#include <string.h>

static void zero_rows(char *x, int64_t from, int64_t to, int64_t ss, int64_t sh, int64_t h, int64_t d, int64_t esize) {
    for (int64_t r = from; r < to; r++)
        for (int64_t hh = 0; hh < h; hh++) memset(x + (r * ss + hh * sh) * esize, 0, (size_t)(d * esize));
}

/* Rows [0, first) and [last, total) of a (total, h, d) array with row stride ss and head stride sh (elements). */
static void zero_side(void *x, int64_t ss, int64_t sh, int64_t h, int64_t d, int64_t esize, const int32_t *cu,
                      int64_t batch, int64_t total) {
    int64_t first, last;
    fattn_uncovered_rows(cu, batch, total, &first, &last);
    zero_rows((char *)x, 0, first, ss, sh, h, d, esize);
    zero_rows((char *)x, last, total, ss, sh, h, d, esize);
}

void fattn_cpu_zero_uncovered(const attn_bwd_params *p) {
    const attn_params *f = &p->fwd;
    const int64_t e = fattn_elem_bytes(f->dtype);
    zero_side(p->dq, p->dq_stride_s, p->dq_stride_h, f->h, f->d, e, f->cu_seqlens_q, f->b, f->total_q);
    zero_side(p->dk, p->dk_stride_s, p->dk_stride_h, f->h_kv, f->d, e, f->cu_seqlens_k, f->b, f->total_k);
    zero_side(p->dv, p->dv_stride_s, p->dv_stride_h, f->h_kv, f->d, e, f->cu_seqlens_k, f->b, f->total_k);
}
