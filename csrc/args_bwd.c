/* args_bwd.c -- the backward's gradient-side arrays (dout, dq, dk, dv), taken and checked against the forward's
 * params: shapes, dtypes, devices, and memory of their own (overlap.h). */
#include "args.h"

#include "overlap.h"
#include "views.h"

/* A gradient-side array: same device and dtype as q, the shape of q (or of k: of_k), writable unless `read`.
 * Packed (varlen) calls compare the packed shapes. */
static int grad_view(const fattn_tensor *t, const fattn_tensor *q, int layout, const attn_params *p, int of_k, int read,
                     bhsd_view *v) {
    if (p->cu_seqlens_q) {
        const DLTensor *like = (q + of_k)->t; /* q, or k right after it */
        if (fattn_view_3d(t, v) || fattn_same_device(t, q)) return -1;
        REQUIRE(v->dtype == p->dtype, PyExc_TypeError, "%s: dtype %s differs from q's %s", t->arg,
                fattn_dtype_name(v->dtype), fattn_dtype_name(p->dtype));
        REQUIRE(t->t->shape[0] == like->shape[0] && t->t->shape[1] == like->shape[1] && t->t->shape[2] == like->shape[2],
                PyExc_ValueError, "%s: shape must be %s's (total=%lld, H=%lld, D=%lld)", t->arg, of_k ? "k" : "q",
                (long long)like->shape[0], (long long)like->shape[1], (long long)like->shape[2]);
        REQUIRE(read || !t->readonly, PyExc_ValueError, "%s: the array is read-only", t->arg);
        return 0;
    }
    if (fattn_view_4d(t, layout, v) || fattn_same_device(t, q)) return -1;
    REQUIRE(v->dtype == p->dtype, PyExc_TypeError, "%s: dtype %s differs from q's %s", t->arg, fattn_dtype_name(v->dtype),
            fattn_dtype_name(p->dtype));
    const int64_t h = of_k ? p->h_kv : p->h, s = of_k ? p->sk : p->sq;
    REQUIRE(v->b == p->b && v->h == h && v->s == s && v->d == p->d, PyExc_ValueError,
            "%s: shape must be %s's (B=%lld, H=%lld, S=%lld, D=%lld in layout %s)", t->arg, of_k ? "k" : "q",
            (long long)p->b, (long long)h, (long long)s, (long long)p->d, layout ? "bshd" : "bhsd");
    REQUIRE(read || !t->readonly, PyExc_ValueError, "%s: the array is read-only", t->arg);
    return 0;
}

/* dq, dk, dv against one another and against what the backward reads (q, k, v, out, dout, lse): each gradient is
 * written while the inputs are still read, and dk = dv would keep only dv. */
static int grads_disjoint(const bhsd_view *grads, const fattn_tensor *grad_ts, const fattn_tensor *q, int layout,
                          int varlen, const bhsd_view *dout) {
    static const char *in_names[4] = {"q", "k", "v", "out"};
    bhsd_view ins[5];
    for (int i = 0; i < 4; i++)
        if (varlen ? fattn_view_3d(&q[i], &ins[i]) : fattn_view_4d(&q[i], layout, &ins[i])) return -1;
    ins[4] = *dout;
    for (int g = 0; g < 3; g++) {
        const char *name = grad_ts[g].arg;
        REQUIRE(fattn_self_disjoint(&grads[g]), PyExc_ValueError, "%s: its elements overlap one another (a stride of "
                "0, or rows closer than their length): each would be written more than once", name);
        for (int i = 0; i < 5; i++)
            REQUIRE(!fattn_overlaps(&grads[g], &ins[i]), PyExc_ValueError, "%s: shares memory with %s, which the "
                    "backward still reads while it writes %s", name, i < 4 ? in_names[i] : "dout", name);
        REQUIRE(!q[4].t || !fattn_spans_meet(grad_ts[g].t, q[4].t), PyExc_ValueError, "%s: shares memory with lse, "
                "which the backward still reads while it writes %s", name, name);
        for (int h = 0; h < g; h++)
            REQUIRE(!fattn_overlaps(&grads[g], &grads[h]), PyExc_ValueError, "%s: shares memory with %s; each "
                    "gradient needs memory of its own", name, grad_ts[h].arg);
    }
    return 0;
}

int fattn_build_bwd_params(fattn_tensor *ts, const fattn_tensor *q, int layout, const attn_params *p,
                           attn_bwd_params *bp) {
    bhsd_view g, grads[3];
    bhsd_view *const dq = &grads[0], *const dk = &grads[1], *const dv = &grads[2];
    if (p->seqused_k || p->block_table) {
        PyErr_SetString(PyExc_ValueError, p->block_table ? "block_table: the backward takes no paged cache (a KV cache "
                        "is inference only)" : "seqused_k: the backward takes no seqused_k (a KV cache is inference "
                        "only)");
        return -1;
    }
    if (grad_view(&ts[0], q, layout, p, 0, 1, &g) || grad_view(&ts[1], q, layout, p, 0, 0, dq) ||
        grad_view(&ts[2], q, layout, p, 1, 0, dk) || grad_view(&ts[3], q, layout, p, 1, 0, dv) ||
        (!fattn_any_described(ts, 4) && !fattn_any_described(q, 5) &&
         grads_disjoint(grads, ts + 1, q, layout, p->cu_seqlens_q != NULL, &g)))
        return -1;
    memset(bp, 0, sizeof *bp);
    bp->fwd = *p;
    bp->dout = g.data; bp->dq = dq->data; bp->dk = dk->data; bp->dv = dv->data;
    bp->do_stride_b = g.sb; bp->do_stride_h = g.sh; bp->do_stride_s = g.ss;
    bp->dq_stride_b = dq->sb; bp->dq_stride_h = dq->sh; bp->dq_stride_s = dq->ss;
    bp->dk_stride_b = dk->sb; bp->dk_stride_h = dk->sh; bp->dk_stride_s = dk->ss;
    bp->dv_stride_b = dv->sb; bp->dv_stride_h = dv->sh; bp->dv_stride_s = dv->ss;
    return 0;
}
