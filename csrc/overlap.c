/* overlap.c -- whether arrays share memory (overlap.h). */
#include "overlap.h"

#include <stdlib.h>

/* The bytes [*lo, *hi) a view spans (strides of any sign; empty if a size is 0). */
static void view_bytes(const bhsd_view *x, const char **lo, const char **hi) {
    const int64_t e = fattn_elem_bytes(x->dtype), n[3] = {x->b, x->h, x->s}, st[3] = {x->sb, x->sh, x->ss};
    int64_t a = 0, b = x->d * e;
    int empty = x->d == 0;
    for (int i = 0; i < 3; i++) {
        if (n[i] == 0) empty = 1;
        else *(st[i] < 0 ? &a : &b) += (n[i] - 1) * st[i] * e;
    }
    *lo = x->data + a;
    *hi = empty ? *lo : x->data + b;
}

/* Dims of more than one element as (size, |stride| in bytes), largest stride first; returns how many. */
static int dims_by_stride(const bhsd_view *x, int64_t *n, int64_t *st) {
    const int64_t e = fattn_elem_bytes(x->dtype), sizes[3] = {x->b, x->h, x->s}, strides[3] = {x->sb, x->sh, x->ss};
    int k = 0;
    for (int i = 0; i < 3; i++)
        if (sizes[i] > 1) {
            n[k] = sizes[i];
            st[k++] = llabs(strides[i]) * e;
        }
    for (int i = 0; i < k; i++)
        for (int j = i + 1; j < k; j++)
            if (st[j] > st[i]) {
                const int64_t a = st[i], c = n[i];
                st[i] = st[j], n[i] = n[j];
                st[j] = a, n[j] = c;
            }
    return k;
}

int fattn_self_disjoint(const bhsd_view *x) {
    if (!x->b || !x->h || !x->s || !x->d) return 1; /* nothing is written (its strides may be anything) */
    int64_t n[3], st[3], extent = x->d * fattn_elem_bytes(x->dtype); /* bytes spanned by the dims inside */
    for (int i = dims_by_stride(x, n, st) - 1; i >= 0; i--) {
        if (st[i] < extent) return 0;
        extent += st[i] * (n[i] - 1);
    }
    return 1;
}

/* 1 if delta (bytes) is sum_i m_i st[i] + t, |m_i| < n[i], |t| < row: two views of these dims (largest stride
 * first, nested as self_disjoint says), delta apart, share a byte.  Each dim's stride exceeds all that its inner
 * dims can add, so only the quotients next to delta / st[0] need trying. */
static int reaches(int64_t delta, const int64_t *n, const int64_t *st, int k, int64_t row) {
    if (k == 0) return llabs(delta) < row;
    for (int64_t m = delta / st[0] - 1; m <= delta / st[0] + 1; m++)
        if (llabs(m) < n[0] && reaches(delta - m * st[0], n + 1, st + 1, k - 1, row)) return 1;
    return 0;
}

/* 1 if two views have one layout: dtype, sizes, and the strides of dims of more than one element. */
static int same_layout(const bhsd_view *x, const bhsd_view *y) {
    return x->dtype == y->dtype && x->b == y->b && x->h == y->h && x->s == y->s && x->d == y->d &&
           (x->b < 2 || x->sb == y->sb) && (x->h < 2 || x->sh == y->sh) && (x->s < 2 || x->ss == y->ss);
}

int fattn_same_view(const bhsd_view *x, const bhsd_view *y) { return x->data == y->data && same_layout(x, y); }

int fattn_overlaps(const bhsd_view *x, const bhsd_view *y) {
    const char *xl, *xh, *yl, *yh;
    view_bytes(x, &xl, &xh);
    view_bytes(y, &yl, &yh);
    if (!(xl < xh && yl < yh && xl < yh && yl < xh)) return 0;
    if (!same_layout(x, y) || !fattn_self_disjoint(x)) return 1;
    int64_t n[3], st[3];
    const int k = dims_by_stride(x, n, st);
    return reaches((int64_t)(y->data - x->data), n, st, k, x->d * fattn_elem_bytes(x->dtype));
}

/* The bytes [*lo, *hi) an array of any shape spans (strides of any sign; empty if a size is 0). */
static void tensor_bytes(const DLTensor *t, const char **lo, const char **hi) {
    const int64_t e = (t->dtype.bits * t->dtype.lanes + 7) / 8;
    int64_t a = 0, b = e, acc = 1;
    int empty = 0;
    for (int i = t->ndim - 1; i >= 0; i--) {
        const int64_t st = t->strides ? t->strides[i] : acc;
        acc *= t->shape[i];
        if (t->shape[i] == 0) empty = 1;
        else *(st < 0 ? &a : &b) += (t->shape[i] - 1) * st * e;
    }
    *lo = (const char *)t->data + t->byte_offset + a;
    *hi = empty ? *lo : (const char *)t->data + t->byte_offset + b;
}

int fattn_spans_meet(const DLTensor *x, const DLTensor *y) {
    const char *xl, *xh, *yl, *yh;
    tensor_bytes(x, &xl, &xh);
    tensor_bytes(y, &yl, &yh);
    return xl < xh && yl < yh && xl < yh && yl < xh;
}
