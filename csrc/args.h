/* args.h -- the extension's argument layer: keyword arguments of vectorcall methods, DLPack / torch tensors taken
 * and checked into attn_params, and the user's words for devices and dtypes ("cuda:0", "float64").  Every check
 * raises a TypeError / ValueError naming the argument. */
#ifndef FATTN_ARGS_H
#define FATTN_ARGS_H

#include "kvcache.h"
#include "tensor.h"

/* Parses a METH_FASTCALL | METH_KEYWORDS call of `fname`: names[0..n) may come positionally (in order) or by
 * keyword; the first `required` must be given.  interned: the names as interned strings (keywords from Python
 * code match them by pointer), or NULL.  out[i]: a borrowed reference, or NULL when absent.  0, or -1 with a
 * TypeError set. */
int fattn_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                     const char *const *names, PyObject *const *interned, int n, int required, PyObject **out);
/* TypeError "<name>: expected an array, got None" for the first of a[0..n) that is None (names[i] the user's word for
 * a[i]); 0 when none is. */
int fattn_refuse_none(PyObject *const *a, const char *const *names, int n);

/* The user's words for a DLPack device ("cpu", "cuda:1") and dtype ("float64", "int32", "bfloat16"). */
void fattn_device_str(DLDevice dev, char *buf, size_t n);
void fattn_dtype_str(DLDataType dt, char *buf, size_t n);
/* An array's shape as the user wrote it: "(2, 32, 4, 64)". */
void fattn_shape_str(const DLTensor *t, char *buf, size_t n);
/* 0 if index array t is int32, else -1 with a TypeError naming its argument and dtype. */
int fattn_require_int32(const fattn_tensor *t);
/* The same for float32 (an LSE, sinks, ALiBi slopes). */
int fattn_require_float32(const fattn_tensor *t);

/* An int / float argument with range checks; `arg` names it in errors.  NULL obj: the default stays. */
int fattn_arg_long(PyObject *obj, const char *arg, long lo, long hi, long *v);
/* scale: None (NaN: 1/sqrt(d) later) or a number finite in float32. */
int fattn_arg_scale(PyObject *obj, double *scale);
/* window: None or a (left, right) pair of ints >= -1. */
int fattn_arg_window(PyObject *obj, int64_t *left, int64_t *right);
/* stream: None (0) or an int handle. */
int fattn_arg_stream(PyObject *obj, void **stream);

/* Takes argument `obj` into `out`: torch tensors of the dtypes the lean path describes (fattn_tensor_from_torch) that
 * way, anything else through DLPack, which is told `stream` only when the producer is on a CUDA device -- so a dtype
 * an argument refuses (float64, int64) is named by that argument's own check. */
int fattn_take(const fattn_names *names, PyObject *obj, const char *arg, PyObject *stream, fattn_tensor *out);

/* The forward call's tensors, taken and checked.  ts: q, k, v, out, lse (lse may be empty). */
typedef struct {
    int layout;              /* 0: (B, H, S, D); 1: (B, S, H, D) */
    int causal;              /* fattn_causal */
    int64_t window_left, window_right;
    double scale;            /* NaN: 1/sqrt(d) */
    int read_only;           /* 1: out and lse are only read (the backward): read-only arrays are fine */
    double softcap;          /* 0: none */
    /* variable-length batches: the int32 tensors (NULL .t: absent) and the longest lengths the caller gave (-1) */
    const fattn_tensor *cu_seqlens_q, *cu_seqlens_k, *seqused_k; /* seqused_k: or cache_seqlens (its arg name) */
    int64_t max_seqlen_q, max_seqlen_k;
    /* a KV cache (attention_with_kvcache; NULL .t: absent): k and v are the cache, paged with block_table (layout
     * bshd); k_new / v_new are appended at cache_seqlens (the seqused_k slot), described in *append for the caller
     * to run after planning (a refused call writes nothing) */
    const fattn_tensor *block_table, *k_new, *v_new;
    fattn_append *append;
    int trust_indices;       /* 1: cache_seqlens' and block_table's values are not read back and checked */
    const fattn_tensor *alibi_slopes; /* NULL or NULL .t: no ALiBi; float32 (H,) or (B, H) */
} fattn_call_opts;

/* Fills p from the taken tensors (q, k, v, out, and lse when ts[4].t is set); every mismatch raises naming the
 * argument.  With cu_seqlens_q / cu_seqlens_k (both or neither) q, k, v, out are packed (total, H, D) and lse is
 * (H, total_q); their values are read (a small device-to-host copy on the GPU, on `stream`) and checked: int32,
 * non-decreasing from >= 0, within the packed tensors; the longest sequences size the call. */
int fattn_build_params(fattn_tensor *ts, const fattn_call_opts *o, attn_params *p, void *stream);

/* 1 if one of t[0 .. n) is a described view (no memory: the rules on addresses cannot apply). */
int fattn_any_described(const fattn_tensor *t, int n);

/* The backward's gradient tensors, taken and checked against the forward's params p (built by fattn_build_params
 * from q, k, v, out, lse; the caller checks lse is given): ts = dout, dq, dk, dv; q: q, then k, v, out, lse.  dq, dk,
 * dv must not share memory with an input or one another (overlap.h; not compared where an array is described).
 * Fills bp (its workspace pointers stay NULL). */
int fattn_build_bwd_params(fattn_tensor *ts, const fattn_tensor *q, int layout, const attn_params *p,
                           attn_bwd_params *bp); /* q: the forward's tensors from q on (q, k, ...) */

/* The longest sequence of cu_seqlens (an int32 prefix-sum array on any device; checked non-decreasing from >= 0):
 * 0, or -1 with an exception naming the argument. */
int fattn_longest_sequence(const fattn_tensor *cu, int64_t *longest, void *stream);

/* 1 if the call's tensors live on a CUDA device (then *device is its id), 0 for the CPU. */
int fattn_call_device(const fattn_tensor *q, int *device);

/* -1 with a ValueError "<a>: shares memory with <b>, which the call writes" when array a, which the call reads,
 * meets one of written[0..n) (entries that are NULL, absent or without memory are skipped); else 0 (args_overlap.c,
 * beside views.h's refusals of views that share memory). */
int fattn_refuse_shared(const fattn_tensor *a, const fattn_tensor *const *written, int n);
#endif
