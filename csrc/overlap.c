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

/* One dim of a pair of views of one stride pattern: the index differences m = a - b (a of x, b of y) in [lo, hi],
 * in steps of st bytes (a negative stride flips the range). */
typedef struct {
    int64_t lo, hi, st;
} pair_dim;

/* The dims either view has more than one of, largest step first; 0 if the views' strides differ in one of them
 * (or dtype, head dim), else how many (1 + that, so 1 means none: views of single rows). */
static int pair_dims(const bhsd_view *x, const bhsd_view *y, pair_dim *r) {
    if (x->dtype != y->dtype || x->d != y->d) return 0;
    const int64_t e = fattn_elem_bytes(x->dtype);
    const int64_t nx[3] = {x->b, x->h, x->s}, ny[3] = {y->b, y->h, y->s};
    const int64_t sx[3] = {x->sb, x->sh, x->ss}, sy[3] = {y->sb, y->sh, y->ss};
    int k = 0;
    for (int i = 0; i < 3; i++) {
        if (nx[i] < 2 && ny[i] < 2) continue;
        if (nx[i] > 1 && ny[i] > 1 && sx[i] != sy[i]) return 0;
        const int64_t st = nx[i] > 1 ? sx[i] : sy[i], lo = -(ny[i] - 1), hi = nx[i] - 1;
        r[k].lo = st < 0 ? -hi : lo;
        r[k].hi = st < 0 ? -lo : hi;
        r[k++].st = llabs(st) * e;
    }
    for (int i = 0; i < k; i++)
        for (int j = i + 1; j < k; j++)
            if (r[j].st > r[i].st) {
                const pair_dim a = r[i];
                r[i] = r[j];
                r[j] = a;
            }
    return k + 1;
}

/* 1 if each dim's step exceeds all that its inner dims (and a row of `row` bytes) can reach: then a difference of
 * addresses pins each index difference to the two quotients next to it. */
static int nested(const pair_dim *r, int k, int64_t row) {
    int64_t extent = row;
    for (int i = k - 1; i >= 0; i--) {
        if (r[i].st < extent) return 0;
        extent += r[i].st * (r[i].hi > -r[i].lo ? r[i].hi : -r[i].lo);
    }
    return 1;
}

/* 1 if delta (bytes) is sum_i m_i st_i + t with lo_i <= m_i <= hi_i and |t| < row (dims nested). */
static int reaches(int64_t delta, const pair_dim *r, int k, int64_t row) {
    if (k == 0) return llabs(delta) < row;
    for (int64_t m = delta / r->st - 1; m <= delta / r->st + 1; m++)
        if (m >= r->lo && m <= r->hi && reaches(delta - m * r->st, r + 1, k - 1, row)) return 1;
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
    pair_dim r[3];
    const int k = pair_dims(x, y, r) - 1;
    const int64_t row = x->d * fattn_elem_bytes(x->dtype);
    if (k < 0 || !nested(r, k, row)) return 1; /* by spans: they meet */
    return reaches((int64_t)(y->data - x->data), r, k, row);
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
