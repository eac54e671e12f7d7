/* views.h -- inside the argument layer (args.c, args_seq.c): arrays seen as (b, h, s, d) views, the checks shared
 * by every tensor argument, and int32 index arrays read to the host.  Each check raises naming the argument and
 * returns -1. */
#ifndef FATTN_VIEWS_H
#define FATTN_VIEWS_H

#include "args.h"

/* Shape and strides of a 4-D q/k/v/out in (b, h, s, d) order, whatever the layout. */
typedef struct {
    int64_t b, h, s, d;
    int64_t sb, sh, ss;
    char *data;
    fattn_dtype dtype;
} bhsd_view;

#define REQUIRE(cond, exc, ...)                                                                                    \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            PyErr_Format(exc, __VA_ARGS__);                                                                        \
            return -1;                                                                                             \
        }                                                                                                          \
    } while (0)

/* The most entries an int32 index array (cu_seqlens, seqused_k, cache_seqlens, block_table) may have. */
#define FATTN_MAX_SEQS (1 << 20)

int fattn_dtype_of(const fattn_tensor *t, fattn_dtype *dt);
const char *fattn_dtype_name(fattn_dtype dt);
/* Strides in elements, compact row-major when the producer gave none. */
void fattn_strides_of(const DLTensor *t, int64_t *st);
/* A 4-D array in `layout` (0: B, H, S, D; 1: B, S, H, D), last dimension contiguous, aligned. */
int fattn_view_4d(const fattn_tensor *t, int layout, bhsd_view *v);
/* A packed (total, H, D) varlen array as a view of batch 0 (s = total rows; the caller sets b and s). */
int fattn_view_3d(const fattn_tensor *t, bhsd_view *v);
int fattn_same_device(const fattn_tensor *a, const fattn_tensor *ref);
int fattn_same_dtype(const bhsd_view *x, const bhsd_view *q, const char *arg);
/* An int32 1-D contiguous array of n entries on q's device (n < 0: any length >= 1), its values copied to `host`
 * (PyMem_Free it; at most FATTN_MAX_SEQS entries; read on `stream` from a GPU).  host NULL: checked, not read. */
int fattn_take_int32(const fattn_tensor *t, const fattn_tensor *q, int64_t n, int32_t **host, int64_t *count,
                     void *stream);
/* The values of n (<= FATTN_MAX_READS) arrays that fattn_take_int32 described, each copied to host[i] (PyMem_Free
 * them; NULL on failure): those on a GPU in one read, one wait for `stream`; refused (RuntimeError naming the first)
 * on a stream being captured into a CUDA graph. */
#define FATTN_MAX_READS 4
int fattn_read_int32s(int n, const fattn_tensor *const *t, int32_t **host, void *stream);


/* ---- args_seq.c: the sequence-level arguments ---- */

/* A paged cache's table, as fattn_take_pages found it. */
typedef struct {
    const int32_t *table;
    int64_t stride, page_size, num_pages;
} fattn_pages;

/* cu_seqlens_q / cu_seqlens_k read and checked; q/k/v/out views set to the sequence count and longest lengths. */
int fattn_take_varlen(const fattn_call_opts *o, const fattn_tensor *q_t, bhsd_view *q, bhsd_view *k, bhsd_view *v,
                      bhsd_view *out, attn_params *p, void *stream);
/* seqused_k / cache_seqlens; check 0: shape and dtype only, values trusted (no host read). */
int fattn_take_seqused(const fattn_tensor *t, const fattn_tensor *q_t, attn_params *p, int check, void *stream);
int fattn_take_lse_varlen(const fattn_tensor *l, const bhsd_view *q, int64_t total, int read_only, attn_params *p);
int fattn_take_pages(const fattn_tensor *t, const fattn_tensor *q_t, int64_t batch, bhsd_view *k, bhsd_view *v,
                     fattn_pages *pages, int check, void *stream);
int fattn_take_new_kv(const fattn_tensor *kn, const fattn_tensor *vn, const fattn_tensor *cache_k,
                      const fattn_tensor *cache_v, const fattn_tensor *cache_seqlens, attn_params *p, fattn_append *a,
                      bhsd_view *kx, bhsd_view *vy);

/* Refusals of views that share memory (args_overlap.c; the rules: overlap.h): each -1 with a ValueError naming the
 * arrays, else 0. */
/* out sharing memory with k or v, with q other than as q itself, or with itself. */
int fattn_out_overlaps(const bhsd_view *q, const bhsd_view *k, const bhsd_view *v, const bhsd_view *out,
                       const char *k_arg, const char *v_arg);
/* lse (ts[4]: (B, H, Sq), or (H, total_q) packed) sharing memory with q, k, v or out (ts[0..3], a paged cache's
 * whole pool), or its elements one another. */
int fattn_lse_overlaps(const fattn_tensor *ts);
/* An append (k_new, v_new -- views x, y -- into the caches' memory k_mem, v_mem) that would write what the call still
 * reads: the caches sharing elements (slots of one fused buffer are fine), a cache whose elements overlap, k_new or
 * v_new inside a cache, or q inside one (the append lands before q is read). */
int fattn_append_overlaps(const bhsd_view *x, const bhsd_view *y, const bhsd_view *q, const bhsd_view *k_mem,
                          const bhsd_view *v_mem, const char *k_arg, const char *v_arg);

#endif
