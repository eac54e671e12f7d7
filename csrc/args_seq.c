/* args_seq.c -- the sequence-level arguments (args.h): packed variable-length batches (cu_seqlens), used key
 * counts (seqused_k, cache_seqlens), and a KV cache's pages and new keys (block_table, k_new, v_new).  Index arrays
 * are read to the host and checked before anything runs. */
#include "args.h"
#include "kvcache.h"
#include "views.h"

/* cu_seqlens values: >= 0, non-decreasing, the last within `total` rows; the longest difference in *longest. */
static int check_prefix_sums(const char *arg, const int32_t *cu, int64_t n, int64_t total, int64_t *longest) {
    *longest = 0;
    REQUIRE(cu[0] >= 0, PyExc_ValueError, "%s: entry 0 is %d; offsets must be >= 0", arg, cu[0]);
    for (int64_t i = 1; i < n; i++) {
        REQUIRE(cu[i] >= cu[i - 1], PyExc_ValueError, "%s: decreases at entry %lld (%d after %d); it must be "
                "non-decreasing prefix sums of the lengths", arg, (long long)i, cu[i], cu[i - 1]);
        if (cu[i] - cu[i - 1] > *longest) *longest = cu[i] - cu[i - 1];
    }
    REQUIRE(cu[n - 1] <= total, PyExc_ValueError, "%s: the last offset %d is past the end of the packed array (%lld "
            "rows)", arg, cu[n - 1], (long long)total);
    return 0;
}

/* 1 if a and b are the same 1-D array (self-attention's packed batches pass one cu_seqlens twice): read it once. */
static int same_array(const fattn_tensor *a, const fattn_tensor *b) {
    const DLTensor *x = a->t, *y = b->t;
    return x->data == y->data && x->byte_offset == y->byte_offset && x->device.device_type == y->device.device_type &&
           x->device.device_id == y->device.device_id && x->ndim == 1 && y->ndim == 1 && x->shape[0] == y->shape[0] &&
           x->dtype.code == y->dtype.code && x->dtype.bits == y->dtype.bits;
}

/* The variable-length part of a call: the sequences' offsets checked, q/k/v/out views set to their sequence
 * count and longest lengths. */
int fattn_take_varlen(const fattn_call_opts *o, const fattn_tensor *q_t, bhsd_view *q, bhsd_view *k, bhsd_view *v,
                       bhsd_view *out, attn_params *p, void *stream) {
    int32_t *cq = NULL, *ck = NULL;
    int64_t n = 0, nk = 0, longest_q = 0, longest_k = 0;
    int rc = -1;
    if (!o->cu_seqlens_k || !o->cu_seqlens_k->t) {
        PyErr_SetString(PyExc_ValueError, "cu_seqlens_k: needed with cu_seqlens_q");
        return -1;
    }
    if (o->trust_indices) { /* check_indices=False: shapes and dtypes only, the longest lengths as given */
        REQUIRE(o->max_seqlen_q >= 0 && o->max_seqlen_k >= 0, PyExc_ValueError, "max_seqlen_q: needed (with "
                "max_seqlen_k) when check_indices=False: cu_seqlens are then not read");
        if (fattn_take_int32(o->cu_seqlens_q, q_t, -1, NULL, &n, stream) ||
            fattn_take_int32(o->cu_seqlens_k, q_t, n, NULL, &nk, stream))
            return -1;
    } else {
        /* both read with one wait for the stream; one array for both (self-attention's) read once, checked against
         * each side's rows */
        const int same = same_array(o->cu_seqlens_q, o->cu_seqlens_k);
        const fattn_tensor *arrays[2] = {o->cu_seqlens_q, o->cu_seqlens_k};
        int32_t *values[2] = {NULL, NULL};
        if (fattn_take_int32(o->cu_seqlens_q, q_t, -1, NULL, &n, stream) ||
            fattn_take_int32(o->cu_seqlens_k, q_t, n, NULL, &nk, stream) ||
            fattn_read_int32s(same ? 1 : 2, arrays, values, stream))
            goto done;
        cq = values[0];
        ck = values[1];
        if (check_prefix_sums("cu_seqlens_q", cq, n, q->s, &longest_q) ||
            check_prefix_sums("cu_seqlens_k", same ? cq : ck, n, k->s, &longest_k))
            goto done;
    }
    if (o->max_seqlen_q >= 0 && o->max_seqlen_q < longest_q) {
        PyErr_Format(PyExc_ValueError, "max_seqlen_q: %lld is less than the longest query sequence (%lld)",
                     (long long)o->max_seqlen_q, (long long)longest_q);
        goto done;
    }
    if (o->max_seqlen_k >= 0 && o->max_seqlen_k < longest_k) {
        PyErr_Format(PyExc_ValueError, "max_seqlen_k: %lld is less than the longest key sequence (%lld)",
                     (long long)o->max_seqlen_k, (long long)longest_k);
        goto done;
    }
    p->total_q = q->s;
    p->total_k = k->s;
    q->b = k->b = v->b = out->b = n - 1;
    /* a given longest length past the packed rows (a generous bound) sizes the call by the rows: no sequence is
     * longer than the array that holds it */
    q->s = out->s = o->max_seqlen_q >= 0 ? (o->max_seqlen_q < q->s ? o->max_seqlen_q : q->s) : longest_q;
    k->s = v->s = o->max_seqlen_k >= 0 ? (o->max_seqlen_k < k->s ? o->max_seqlen_k : k->s) : longest_k;
    p->cu_seqlens_q = (const int32_t *)((const char *)o->cu_seqlens_q->t->data + o->cu_seqlens_q->t->byte_offset);
    p->cu_seqlens_k = (const int32_t *)((const char *)o->cu_seqlens_k->t->data + o->cu_seqlens_k->t->byte_offset);
    rc = 0;
done:
    PyMem_Free(cq);
    PyMem_Free(ck);
    return rc;
}

int fattn_longest_sequence(const fattn_tensor *cu, int64_t *longest, void *stream) {
    int32_t *host = NULL;
    int64_t n = 0;
    if (fattn_take_int32(cu, cu, -1, &host, &n, stream)) return -1;
    const int rc = check_prefix_sums(cu->arg, host, n, (int64_t)1 << 62, longest);
    PyMem_Free(host);
    return rc;
}

/* seqused_k (or cache_seqlens): int32 (B,), each entry plus p->seqused_k_plus (the call's new keys) within
 * [0, Sk] (Sk: the longest key sequence, or the cache's capacity). */
int fattn_take_seqused(const fattn_tensor *t, const fattn_tensor *q_t, attn_params *p, int check, void *stream) {
    int32_t *used = NULL;
    int64_t n = 0;
    if (fattn_take_int32(t, q_t, p->b, check ? &used : NULL, &n, stream)) return -1;
    if (!check) n = 0; /* trusted */
    for (int64_t i = 0; i < n; i++) {
        if (used[i] >= 0 && used[i] + p->seqused_k_plus <= p->sk) continue;
        if (p->seqused_k_plus && used[i] >= 0)
            PyErr_Format(PyExc_ValueError, "%s: entry %lld is %d: with the %lld new keys of k_new the sequence needs "
                         "%lld slots, but the cache holds %lld", t->arg, (long long)i, used[i],
                         (long long)p->seqused_k_plus, (long long)(used[i] + p->seqused_k_plus), (long long)p->sk);
        else
            PyErr_Format(PyExc_ValueError, "%s: entry %lld is %d, outside [0, %lld]", t->arg, (long long)i, used[i],
                         (long long)p->sk);
        PyMem_Free(used);
        return -1;
    }
    PyMem_Free(used);
    p->seqused_k = (const int32_t *)((const char *)t->t->data + t->t->byte_offset);
    return 0;
}

int fattn_take_lse_varlen(const fattn_tensor *l, const bhsd_view *q, int64_t total, int read_only, attn_params *p) {
    const DLTensor *x = l->t;
    REQUIRE(x->ndim == 2, PyExc_ValueError, "lse: expected a 2-D float32 array (H, total_q) with cu_seqlens, got %d-D",
            x->ndim);
    if (fattn_require_float32(l)) return -1;
    REQUIRE(x->shape[0] == q->h && x->shape[1] == total, PyExc_ValueError, "lse: shape must be (H=%lld, total_q=%lld)",
            (long long)q->h, (long long)total);
    REQUIRE(!l->readonly || read_only, PyExc_ValueError, "lse: the array is read-only");
    int64_t st[2];
    fattn_strides_of(x, st);
    REQUIRE(st[1] == 1 || total <= 1, PyExc_ValueError, "lse: the last dimension must be contiguous");
    p->lse = (float *)((char *)x->data + x->byte_offset);
    REQUIRE((uintptr_t)p->lse % 4 == 0, PyExc_ValueError, "lse: data pointer is not 4-byte aligned");
    p->lse_stride_b = 0;
    p->lse_stride_h = st[0];
    return 0;
}


/* block_table: int32 (B, max_pages), C-contiguous, on q's device, every entry a page of the pools k and v
 * (num_pages, page_size, H_kv, D), page_size a multiple of 16.  The views of k and v become the batch's: B sequences
 * of max_pages * page_size keys. */
int fattn_take_pages(const fattn_tensor *t, const fattn_tensor *q_t, int64_t batch, bhsd_view *k, bhsd_view *v,
                     fattn_pages *pages, int check, void *stream) {
    const DLTensor *x = t->t;
    REQUIRE(x->ndim == 2, PyExc_ValueError, "%s: expected a 2-D int32 array (B, max_pages), got %d-D", t->arg, x->ndim);
    if (fattn_require_int32(t) || fattn_same_device(t, q_t)) return -1;
    REQUIRE(x->shape[0] == batch, PyExc_ValueError, "%s: %lld rows, but q has batch %lld", t->arg,
            (long long)x->shape[0], (long long)batch);
    REQUIRE(x->shape[1] >= 1, PyExc_ValueError, "%s: needs at least one page per sequence", t->arg);
    REQUIRE(batch * x->shape[1] <= FATTN_MAX_SEQS, PyExc_ValueError, "%s: more than %d entries", t->arg,
            FATTN_MAX_SEQS);
    int64_t st[2];
    fattn_strides_of(x, st);
    REQUIRE(st[1] == 1 && (st[0] == x->shape[1] || batch == 1), PyExc_ValueError, "%s: must be contiguous", t->arg);
    REQUIRE(k->s % 16 == 0 && k->s > 0, PyExc_ValueError, "k_cache: page size %lld (dim 1 of a paged cache) is not a "
            "multiple of 16", (long long)k->s);
    REQUIRE(v->b == k->b && v->s == k->s, PyExc_ValueError, "v_cache: %lld pages of %lld differ from k_cache's %lld "
            "of %lld", (long long)v->b, (long long)v->s, (long long)k->b, (long long)k->s);
    const int32_t *table = (const int32_t *)((const char *)x->data + x->byte_offset);
    REQUIRE((uintptr_t)table % 4 == 0, PyExc_ValueError, "%s: data pointer is not 4-byte aligned", t->arg);
    /* the entries, read as one flat array */
    DLTensor flat = *x;
    int64_t count = batch * x->shape[1], one = 1;
    flat.ndim = 1;
    flat.shape = &count;
    flat.strides = &one;
    fattn_tensor ft = *t;
    ft.t = &flat;
    int32_t *host = NULL;
    int64_t n = 0;
    if (fattn_take_int32(&ft, q_t, count, check ? &host : NULL, &n, stream)) return -1;
    if (!check) n = 0; /* trusted */
    for (int64_t i = 0; i < n; i++)
        if (host[i] < 0 || host[i] >= k->b) {
            PyErr_Format(PyExc_ValueError, "%s: entry [%lld, %lld] is %d, not a page of the cache (0 .. %lld)", t->arg,
                         (long long)(i / x->shape[1]), (long long)(i % x->shape[1]), host[i], (long long)(k->b - 1));
            PyMem_Free(host);
            return -1;
        }
    PyMem_Free(host);
    pages->table = table;
    pages->stride = x->shape[1];
    pages->page_size = k->s;
    pages->num_pages = k->b;
    k->b = v->b = batch;
    k->s = v->s = x->shape[1] * pages->page_size;
    return 0;
}

/* k_new, v_new: (B, S_new, H_kv, D) (layout bshd) in the cache's dtype on its device, appended to a writable cache;
 * cache_seqlens must say where.  Fills a, p->seqused_k_plus and the views *kx, *vy of k_new and v_new. */
int fattn_take_new_kv(const fattn_tensor *kn, const fattn_tensor *vn, const fattn_tensor *cache_k,
                      const fattn_tensor *cache_v, const fattn_tensor *cache_seqlens, attn_params *p, fattn_append *a,
                      bhsd_view *kx, bhsd_view *vy) {
    bhsd_view x, y;
    REQUIRE(vn && vn->t, PyExc_ValueError, "v_new: needed with k_new");
    REQUIRE(cache_seqlens && cache_seqlens->t, PyExc_ValueError, "cache_seqlens: needed with k_new (where the new "
            "keys go)");
    if (fattn_view_4d(kn, 1, &x) || fattn_view_4d(vn, 1, &y) || fattn_same_device(kn, cache_k) ||
        fattn_same_device(vn, cache_k))
        return -1;
    REQUIRE(x.dtype == p->dtype, PyExc_TypeError, "k_new: dtype %s differs from the cache's %s",
            fattn_dtype_name(x.dtype), fattn_dtype_name(p->dtype));
    REQUIRE(y.dtype == p->dtype, PyExc_TypeError, "v_new: dtype %s differs from the cache's %s",
            fattn_dtype_name(y.dtype), fattn_dtype_name(p->dtype));
    REQUIRE(x.b == p->b && x.h == p->h_kv && x.d == p->d, PyExc_ValueError, "k_new: shape must be (B=%lld, S_new, "
            "H_kv=%lld, D=%lld)", (long long)p->b, (long long)p->h_kv, (long long)p->d);
    REQUIRE(y.b == x.b && y.s == x.s && y.h == x.h && y.d == x.d, PyExc_ValueError, "v_new: shape differs from k_new's");
    REQUIRE(!cache_k->readonly, PyExc_ValueError, "k_cache: the array is read-only (k_new is written into it)");
    REQUIRE(!cache_v->readonly, PyExc_ValueError, "v_cache: the array is read-only (v_new is written into it)");
    a->k_new = x.data; a->v_new = y.data;
    a->kn_stride_b = x.sb; a->kn_stride_h = x.sh; a->kn_stride_s = x.ss;
    a->vn_stride_b = y.sb; a->vn_stride_h = y.sh; a->vn_stride_s = y.ss;
    a->s_new = x.s;
    p->seqused_k_plus = x.s;
    *kx = x;
    *vy = y;
    return 0;
}
