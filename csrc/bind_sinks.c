/* bind_sinks.c -- attention sinks (sinks.h) on a forward's results:
 *
 *   _C.sinks(out, lse, sinks, *, layout=0, stream=None)                      out, lse -> O', LSE' (in place)
 *   _C.sinks(out, lse, sinks, *, layout=0, stream=None, dout=.., dsinks=..)  dsinks from dO, O', LSE'
 *
 * out: the forward's output (4-D in `layout`, or packed (total, H, D) with lse (H, total)); lse float32 (B, H, Sq);
 * sinks float32 (H,); dsinks a writable float32 (H,).  Arrays on one device; GPU work runs on `stream`. */
#include "module.h"

#include "sinks.h"
#include "variants.h"
#include "views.h"

static const char *const names[] = {"out", "lse", "sinks", "layout", "stream", "dout", "dsinks"};
enum { S_OUT, S_LSE, S_SINKS, S_LAYOUT, S_STREAM, S_DOUT, S_DSINKS, S_N };

/* A float32 (h,) contiguous array on out's device. */
static int head_vector(const fattn_tensor *t, const fattn_tensor *out, int64_t h, int write) {
    const DLTensor *x = t->t;
    REQUIRE(x->ndim == 1 && x->shape[0] == h, PyExc_ValueError, "%s: expected a 1-D array of H=%lld entries", t->arg,
            (long long)h);
    if (fattn_require_float32(t)) return -1;
    REQUIRE(!x->strides || h <= 1 || x->strides[0] == 1, PyExc_ValueError, "%s: must be contiguous", t->arg);
    REQUIRE(!write || !t->readonly, PyExc_ValueError, "%s: the array is read-only", t->arg);
    return fattn_same_device(t, out);
}

/* out (or dout) rows as (b, h, s) with strides; packed 3-D arrays as b = 1. */
static int rows_of(const fattn_tensor *t, int layout, bhsd_view *v) {
    if (t->t->ndim == 3) {
        if (fattn_view_3d(t, v)) return -1;
        v->b = 1;
        return 0;
    }
    return fattn_view_4d(t, layout, v);
}

static int take_lse(const fattn_tensor *t, const fattn_tensor *out, const bhsd_view *o, fattn_sink_params *p) {
    const DLTensor *x = t->t;
    const int packed = x->ndim == 2;
    if (fattn_require_float32(t)) return -1;
    REQUIRE(packed ? x->shape[0] == o->h && x->shape[1] == o->s
                   : x->ndim == 3 && x->shape[0] == o->b && x->shape[1] == o->h && x->shape[2] == o->s,
            PyExc_ValueError, "lse: shape must be out's (B, H, Sq), or (H, total) for packed arrays");
    int64_t st[3];
    fattn_strides_of(x, st);
    REQUIRE(st[x->ndim - 1] == 1 || o->s <= 1, PyExc_ValueError, "lse: the last dimension must be contiguous");
    p->lse = (float *)((char *)x->data + x->byte_offset);
    p->lse_sb = packed ? 0 : st[0];
    p->lse_sh = packed ? st[0] : st[1];
    return fattn_same_device(t, out);
}

int fattn_take_sink_rows(const fattn_tensor *out, const fattn_tensor *lse, const fattn_tensor *sinks, int layout,
                         bhsd_view *o, fattn_sink_params *p) {
    memset(p, 0, sizeof *p);
    if (rows_of(out, layout, o) || take_lse(lse, out, o, p) || head_vector(sinks, out, o->h, 0)) return -1;
    p->o = o->data;
    p->o_sb = o->sb; p->o_sh = o->sh; p->o_ss = o->ss;
    p->b = o->b; p->h = o->h; p->s = o->s; p->d = o->d;
    p->dtype = o->dtype;
    p->sinks = (const float *)((char *)sinks->t->data + sinks->t->byte_offset);
    return 0;
}

int fattn_take_sink_grads(const fattn_tensor *dout, const fattn_tensor *dsinks, const fattn_tensor *out, int layout,
                          const bhsd_view *o, fattn_sink_params *p) {
    bhsd_view g;
    if (rows_of(dout, layout, &g) || fattn_same_device(dout, out) || head_vector(dsinks, out, o->h, 1)) return -1;
    REQUIRE(g.b == o->b && g.h == o->h && g.s == o->s && g.d == o->d && g.dtype == o->dtype, PyExc_ValueError,
            "dout: shape and dtype must be out's");
    p->dout = g.data;
    p->do_sb = g.sb; p->do_sh = g.sh; p->do_ss = g.ss;
    p->dsinks = (float *)((char *)dsinks->t->data + dsinks->t->byte_offset);
    return 0;
}

/* The pass on out's device (stream) or the CPU: 0, or -1 with an exception set. */
static int run_sinks(const fattn_tensor *out, const fattn_sink_params *p, int backward, void *stream) {
    int device = 0;
    if (fattn_call_device(out, &device)) {
        if (fattn_gpu_sinks(p, backward, device, stream)) {
            fattn_raise_status();
            return -1;
        }
        return 0;
    }
    Py_BEGIN_ALLOW_THREADS
    if (backward) fattn_cpu_sinks_backward(p);
    else fattn_cpu_sinks_forward(p);
    Py_END_ALLOW_THREADS
    return 0;
}

PyObject *fattn_py_sinks(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    module_state *st = fattn_state(module);
    PyObject *a[S_N];
    if (fattn_parse_args("sinks", args, nargs, kwnames, names, NULL, S_N, 3, a) || fattn_find_torch(&st->names))
        return NULL;
    long layout = 0;
    void *stream = NULL;
    if (fattn_arg_long(a[S_LAYOUT], "layout", 0, 1, &layout) || fattn_arg_stream(a[S_STREAM], &stream)) return NULL;
    const int backward = a[S_DOUT] && a[S_DOUT] != Py_None;
    if (backward != (a[S_DSINKS] && a[S_DSINKS] != Py_None)) {
        PyErr_SetString(PyExc_TypeError, "dsinks: dout and dsinks go together (the backward)");
        return NULL;
    }
    PyObject *stream_obj = a[S_STREAM] ? a[S_STREAM] : Py_None;
    if (fattn_refuse_none(a, names, 3)) return NULL; /* out, lse, sinks */
    fattn_tensor ts[S_N];
    memset(ts, 0, sizeof ts);
    PyObject *result = NULL;
    fattn_sink_params p;
    bhsd_view o;
    for (int i = 0; i < S_N; i++) {
        if (i == S_LAYOUT || i == S_STREAM || !a[i] || a[i] == Py_None) continue;
        if (fattn_take(&st->names, a[i], names[i], stream_obj, &ts[i])) goto done;
    }
    if (fattn_take_sink_rows(&ts[S_OUT], &ts[S_LSE], &ts[S_SINKS], (int)layout, &o, &p)) goto done;
    if (!backward && (ts[S_OUT].readonly || ts[S_LSE].readonly)) { /* the forward pass rewrites both */
        PyErr_Format(PyExc_ValueError, "%s: the array is read-only", ts[S_OUT].readonly ? "out" : "lse");
        goto done;
    }
    const fattn_tensor *written = &ts[S_OUT];
    if (fattn_refuse_shared(&ts[S_LSE], &written, 1)) goto done;
    if (backward && fattn_take_sink_grads(&ts[S_DOUT], &ts[S_DSINKS], &ts[S_OUT], (int)layout, &o, &p)) goto done;
    if (run_sinks(&ts[S_OUT], &p, backward, stream)) goto done;
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < S_N; i++) fattn_tensor_release(&ts[i]);
    return result;
}
