/* args_overlap.c -- the call's refusals of arrays that share memory (args.h), by overlap.h's rules: what a call
 * writes must not meet what it still reads. */
#include "args.h"

#include "overlap.h"
#include "views.h"

int fattn_out_overlaps(const bhsd_view *q, const bhsd_view *k, const bhsd_view *v, const bhsd_view *out,
                       const char *k_arg, const char *v_arg) {
    REQUIRE(!fattn_overlaps(out, k) && !fattn_overlaps(out, v), PyExc_ValueError, "out: shares memory with %s; the output "
            "must not overlap %s or %s (nor q, except as q itself: out=q)", fattn_overlaps(out, k) ? k_arg : v_arg, k_arg,
            v_arg);
    REQUIRE(!fattn_overlaps(out, q) || fattn_same_view(out, q), PyExc_ValueError, "out: overlaps q without being q; the "
            "output must not overlap q, k or v except as q itself (out=q)");
    REQUIRE(fattn_self_disjoint(out), PyExc_ValueError, "out: its elements overlap one another (a stride of 0, or rows "
            "closer than their length): each would be written more than once");
    return 0;
}

int fattn_lse_overlaps(const fattn_tensor *ts) {
    const DLTensor *x = ts[4].t;
    for (int i = 0; i < 4; i++)
        REQUIRE(!fattn_spans_meet(x, ts[i].t), PyExc_ValueError, "lse: shares memory with %s; the LSE must not "
                "overlap the call's arrays", ts[i].arg);
    int64_t st[3] = {0, 0, 0};
    fattn_strides_of(x, st);
    const int packed = x->ndim == 2; /* (H, total_q): one batch */
    const bhsd_view lse = {packed ? 1 : x->shape[0], x->shape[packed ? 0 : 1], x->shape[packed ? 1 : 2], 1,
                           packed ? 0 : st[0], st[packed ? 0 : 1], st[packed ? 1 : 2],
                           (char *)x->data + x->byte_offset, FATTN_F32};
    REQUIRE(fattn_self_disjoint(&lse), PyExc_ValueError, "lse: its elements overlap one another (a stride of 0): each "
            "would be written more than once");
    return 0;
}

int fattn_append_overlaps(const bhsd_view *x, const bhsd_view *y, const bhsd_view *q, const bhsd_view *k_mem,
                          const bhsd_view *v_mem, const char *k_arg, const char *v_arg) {
    REQUIRE(!fattn_overlaps(k_mem, v_mem), PyExc_ValueError, "%s: shares elements with %s; k_new and v_new are "
            "written into them", v_arg, k_arg);
    REQUIRE(fattn_self_disjoint(k_mem), PyExc_ValueError, "%s: its elements overlap one another (a stride of 0): "
            "k_new would be written for several sequences at once", k_arg);
    REQUIRE(fattn_self_disjoint(v_mem), PyExc_ValueError, "%s: its elements overlap one another (a stride of 0): "
            "v_new would be written for several sequences at once", v_arg);
    const bhsd_view *news[2] = {x, y};
    for (int i = 0; i < 2; i++)
        REQUIRE(!fattn_overlaps(news[i], k_mem) && !fattn_overlaps(news[i], v_mem), PyExc_ValueError,
                "%s: shares memory with %s / %s, which it is written into", i ? "v_new" : "k_new", k_arg, v_arg);
    REQUIRE(!fattn_overlaps(q, k_mem) && !fattn_overlaps(q, v_mem), PyExc_ValueError, "q: shares memory with %s / "
            "%s, which k_new and v_new are written into before q is read", k_arg, v_arg);
    return 0;
}

int fattn_refuse_shared(const fattn_tensor *a, const fattn_tensor *const *written, int n) {
    if (!a || !a->t || a->described) return 0;
    for (int i = 0; i < n; i++) {
        const fattn_tensor *w = written[i];
        if (w && w->t && !w->described && fattn_spans_meet(a->t, w->t)) {
            PyErr_Format(PyExc_ValueError, "%s: shares memory with %s, which the call writes", a->arg, w->arg);
            return -1;
        }
    }
    return 0;
}
