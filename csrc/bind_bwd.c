/* bind_bwd.c -- the backward call: parse, plan, launch, raise.
 *
 *   _C.backward(dout, q, k, v, out, lse, dq, dk, dv, *, causal=0, scale=None, layout=0, window=None, variant=None,
 *               stream=None, deterministic=False, workspace=None, softcap=0, cu_seqlens_q=None, cu_seqlens_k=None,
 *               max_seqlen_q=None, max_seqlen_k=None, alibi_slopes=None, check_indices=True, sinks=None,
 *               dsinks=None)
 *   _C._dev.backward(..., config=None) -> the plan that ran (a dict), or None for an empty call
 *   _C._dev.plan_backward(...)         -> the plan a call would run, without running it
 *   _C.check_backward(...)             -> None: backward()'s arguments checked, nothing run; its torch tensors may
 *                                         be fake or meta (torch's fake kernels)
 *   _C.backward_workspace_bytes(b, h, sq, d, deterministic=False) -> the bytes a GPU backward's workspace needs
 *                                      (deterministic mode at head dim 256 keeps two copies of dQ's accumulator)
 *
 * The forward's arguments mean what they mean in forward() (bind.c) and must be those of the call that produced
 * out and lse; dq, dk, dv (q's, k's and v's shapes and dtype, any strides with a contiguous last dimension) are
 * written, in packed calls their rows outside every sequence too (zeros; csrc/varlen_rows.h).  variant names the forward variant whose backward runs (its table row's bwd); config overrides a GPU
 * backward's config index or the CPU's (br, bc, threads).  workspace: a writable array on the call's device of at
 * least backward_workspace_bytes(b, h, sq, d, deterministic) bytes (GPU only; None: one cached per device and
 * stream, which cannot be had while the stream is being captured into a CUDA graph).  sinks (float32 (H,)) and
 * dsinks (a writable float32 (H,)) go together: out and lse are then the sink-adjusted ones, and dsinks is written
 * (csrc/sinks.h) -- from the backward's own D and LSE2 where its planner says so (fattn_plan.sinks_fused: v2, v3),
 * else by the sinks pass. */
#include "module.h"

#include "cpu_attn.h"
#include "overlap.h"
#include "sinks.h"
#include "varlen_rows.h"
#include "variants.h"

const char *const fattn_backward_arg_names[FATTN_BACKWARD_ARGS] = {
    "dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "causal", "scale", "layout", "window", "variant", "stream",
    "deterministic", "workspace", "softcap", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    "alibi_slopes", "check_indices", "sinks", "dsinks", "config"};
enum { B_DOUT, B_Q, B_K, B_V, B_OUT, B_LSE, B_DQ, B_DK, B_DV, B_CAUSAL, B_SCALE, B_LAYOUT, B_WINDOW, B_VARIANT,
       B_STREAM, B_DETERMINISTIC, B_WORKSPACE, B_SOFTCAP, B_CU_Q, B_CU_K, B_MAX_Q, B_MAX_K, B_ALIBI,
       B_CHECK_INDICES, B_SINKS, B_DSINKS, B_CONFIG };
#define NARGS_PUBLIC (FATTN_BACKWARD_ARGS - 1)
#define NTENSORS 10 /* dout .. dv, workspace */

typedef struct {
    fattn_tensor ts[NTENSORS]; /* q, k, v, out, lse (fattn_build_params' order), dout, dq, dk, dv, workspace */
    fattn_tensor seqs[3];      /* cu_seqlens_q, cu_seqlens_k, (no seqused_k) */
    fattn_tensor alibi;        /* alibi_slopes */
    fattn_tensor sinks[2];     /* sinks, dsinks */
    fattn_sink_params sp;      /* the sinks pass's backward, for a backward that does not give dsinks itself */
    attn_bwd_params p;
    const char *variant;
    fattn_overrides ov;
    void *stream;
    int gpu, device;
    size_t ws_bytes; /* the workspace given (0: none) */
} call;

static void call_release(call *c) {
    for (int i = 0; i < NTENSORS; i++) fattn_tensor_release(&c->ts[i]);
    for (int i = 0; i < 3; i++) fattn_tensor_release(&c->seqs[i]);
    fattn_tensor_release(&c->alibi);
    for (int i = 0; i < 2; i++) fattn_tensor_release(&c->sinks[i]);
}

/* sinks and dsinks, together or neither: into c->sp (the pass's view of out, lse, dO) and the params. */
static int take_sinks(const fattn_names *names, PyObject **a, PyObject *stream_obj, int layout, call *c) {
    const int n = (a[B_SINKS] && a[B_SINKS] != Py_None) + (a[B_DSINKS] && a[B_DSINKS] != Py_None);
    if (n == 0) return 0;
    if (n == 1) {
        PyErr_SetString(PyExc_TypeError, "dsinks: sinks and dsinks go together (dsinks receives sinks' gradient)");
        return -1;
    }
    bhsd_view o;
    if (fattn_take(names, a[B_SINKS], "sinks", stream_obj, &c->sinks[0]) ||
        fattn_take(names, a[B_DSINKS], "dsinks", stream_obj, &c->sinks[1]) ||
        fattn_take_sink_rows(&c->ts[3], &c->ts[4], &c->sinks[0], layout, &o, &c->sp) ||
        fattn_take_sink_grads(&c->ts[5], &c->sinks[1], &c->ts[3], layout, &o, &c->sp))
        return -1;
    /* sinks, read, share memory with no gradient; dsinks, written, with no array of the call */
    const fattn_tensor *grads[4] = {&c->ts[6], &c->ts[7], &c->ts[8], &c->sinks[1]}; /* dq, dk, dv, dsinks */
    if (fattn_refuse_shared(&c->sinks[0], grads, 4)) return -1;
    for (int i = 0; i < 9; i++) /* q, k, v, out, lse, dout, dq, dk, dv */
        if (fattn_refuse_shared(&c->ts[i], &grads[3], 1)) return -1;
    c->p.fwd.sinks = c->sp.sinks;
    c->p.dsinks = c->sp.dsinks;
    return 0;
}

/* The caller's workspace: a writable array on q's device, its bytes counted from its shape and dtype, sharing no
 * memory with the call's arrays (not compared where an array is described: no memory). */
static int take_workspace(call *c) {
    const int describe = fattn_any_described(c->ts, NTENSORS);
    const fattn_tensor *w = &c->ts[9];
    const DLTensor *x = w->t;
    if (!x) return 0;
    if (x->device.device_type != c->ts[0].t->device.device_type || x->device.device_id != c->ts[0].t->device.device_id) {
        char dw[48], dq[48];
        fattn_device_str(x->device, dw, sizeof dw);
        fattn_device_str(c->ts[0].t->device, dq, sizeof dq);
        PyErr_Format(PyExc_ValueError, "workspace: on %s but q is on %s", dw, dq);
        return -1;
    }
    int64_t n = 1, expect = 1;
    for (int i = x->ndim - 1; i >= 0; i--) {
        if (x->strides && x->shape[i] > 1 && x->strides[i] != expect) {
            PyErr_SetString(PyExc_ValueError, "workspace: must be contiguous");
            return -1;
        }
        expect *= x->shape[i];
        n *= x->shape[i];
    }
    if (w->readonly) {
        PyErr_SetString(PyExc_ValueError, "workspace: the array is read-only");
        return -1;
    }
    for (int i = 0; i < NTENSORS - 1 && !describe; i++) /* scratch written throughout the call: no array's memory */
        if (c->ts[i].t && fattn_spans_meet(x, c->ts[i].t)) {
            PyErr_Format(PyExc_ValueError, "workspace: shares memory with %s; it is scratch the backward writes",
                         c->ts[i].arg);
            return -1;
        }
    c->ws_bytes = (size_t)n * ((x->dtype.bits * x->dtype.lanes + 7) / 8);
    const size_t need =
        (size_t)fattn_bwd_workspace_bytes(c->p.fwd.b, c->p.fwd.h, c->p.fwd.sq, c->p.fwd.d, c->p.deterministic);
    if (c->gpu && c->ws_bytes < need) {
        PyErr_Format(PyExc_ValueError, "workspace: %zu bytes, need %zu (backward_workspace_bytes%s)", c->ws_bytes, need,
                     c->p.deterministic ? ", deterministic=True" : "");
        return -1;
    }
    char *base = (char *)x->data + x->byte_offset;
    if ((uintptr_t)base % 16) {
        PyErr_SetString(PyExc_ValueError, "workspace: data pointer is not 16-byte aligned");
        return -1;
    }
    fattn_bwd_workspace_set(&c->p, (float *)base);
    return 0;
}

/* names->describe: a check-only call (tensors without memory described, not taken; index values not read). */
static int call_take(const fattn_names *names, PyObject **a, call *c) {
    memset(c, 0, sizeof *c);
    /* a[] index of each entry of c->ts */
    static const int order[NTENSORS] = {B_Q, B_K, B_V, B_OUT, B_LSE, B_DOUT, B_DQ, B_DK, B_DV, B_WORKSPACE};
    long causal = 0, layout = 0;
    fattn_call_opts o = {0, 0, -1, -1, 0.0, 1, 0.0, NULL, NULL, NULL, -1, -1};
    int deterministic = 0;
    if (fattn_arg_long(a[B_CAUSAL], "causal", 0, 2, &causal) || fattn_arg_long(a[B_LAYOUT], "layout", 0, 1, &layout) ||
        fattn_arg_scale(a[B_SCALE], &o.scale) || fattn_arg_window(a[B_WINDOW], &o.window_left, &o.window_right) ||
        fattn_arg_stream(a[B_STREAM], &c->stream) || fattn_parse_overrides(a[B_CONFIG], NULL, NULL, &c->ov) ||
        fattn_arg_variant(a[B_VARIANT], &c->variant) || fattn_arg_softcap(a[B_SOFTCAP], &o.softcap))
        return -1;
    if (a[B_DETERMINISTIC] && (deterministic = PyObject_IsTrue(a[B_DETERMINISTIC])) < 0) return -1;
    if (fattn_arg_check_indices(a[B_CHECK_INDICES], &o.trust_indices)) return -1; /* cu_seqlens, as forward() */
    o.trust_indices |= names->describe;
    o.causal = (int)causal;
    o.layout = (int)layout;
    if (!a[B_LSE] || a[B_LSE] == Py_None) {
        PyErr_SetString(PyExc_ValueError, "lse: the backward needs the forward's LSE (attention(..., return_lse=True))");
        return -1;
    }
    PyObject *stream_obj = a[B_STREAM] ? a[B_STREAM] : Py_None;
    for (int i = 0; i < NTENSORS - 1; i++) /* dout .. dv are arrays; the workspace may be None */
        if (fattn_refuse_none(&a[order[i]], &fattn_backward_arg_names[order[i]], 1)) return -1;
    for (int i = 0; i < NTENSORS; i++) { /* the workspace may have any dtype */
        PyObject *x = a[order[i]];
        if (x && x != Py_None && fattn_take(names, x, fattn_backward_arg_names[order[i]], stream_obj, &c->ts[i]))
            return -1;
    }
    if (a[B_ALIBI] && a[B_ALIBI] != Py_None &&
        fattn_take(names, a[B_ALIBI], "alibi_slopes", stream_obj, &c->alibi))
        return -1;
    o.alibi_slopes = &c->alibi;
    const fattn_tensor *grads[3] = {&c->ts[6], &c->ts[7], &c->ts[8]}; /* dq, dk, dv: written while the slopes are read */
    if (fattn_refuse_shared(&c->alibi, grads, 3)) return -1;
    PyObject *seq_objs[3] = {a[B_CU_Q], a[B_CU_K], NULL};
    attn_params fwd;
    if (fattn_take_varlen_args(names, seq_objs, a[B_MAX_Q], a[B_MAX_K], stream_obj, c->seqs, &o) ||
        fattn_build_params(c->ts, &o, &fwd, c->stream) || fattn_build_bwd_params(c->ts + 5, &c->ts[0], o.layout, &fwd, &c->p))
        return -1;
    c->p.deterministic = deterministic;
    if (take_sinks(names, a, stream_obj, o.layout, c)) return -1;
    c->gpu = fattn_call_device(&c->ts[0], &c->device);
    if (take_workspace(c)) return -1;
    if (c->gpu ? c->ov.cpu.br != 0 : c->ov.config >= 0) {
        PyErr_SetString(PyExc_TypeError, c->gpu ? "config: a GPU variant takes a config index"
                                                : "config: the CPU backend takes a (br, bc, threads) tuple");
        return -1;
    }
    return 0;
}

static PyObject *plan_dict(const fattn_plan *plan, int deterministic) {
    if (!plan->bwd)
        return Py_BuildValue("{sssssis(iii)sisisi}", "variant", "cpu", "family", "cpu", "device", 0, "config",
                             plan->cpu.br, plan->cpu.bc, plan->cpu.threads, "workspace", 0, "deterministic", 1,
                             "sinks_fused", 0);
    return Py_BuildValue("{sssssisis(II)sIsnsnsisi}", "variant", plan->bwd->name, "family", plan->bwd->family,
                         "device", plan->dev.id, "config", plan->config, "grid", plan->grid_x, plan->grid_y, "threads",
                         plan->threads, "smem", (Py_ssize_t)plan->smem, "workspace", (Py_ssize_t)plan->workspace_bytes,
                         "deterministic", deterministic, "sinks_fused", plan->sinks_fused);
}

static int plan_gpu(const module_state *st, const call *c, fattn_plan *plan) {
    if (!fattn_gpu_compiled()) {
        fattn_not_built();
        return -1;
    }
    fattn_device dev;
    if (fattn_gpu_device(c->device, &dev, NULL, 0)) {
        fattn_raise_status();
        return -1;
    }
    if (c->variant && fattn_check_variant(c->variant, c->p.fwd.dtype)) return -1;
    return fattn_raise_plan_status(fattn_plan_gpu_bwd(&c->p, &dev, &st->tuned, c->variant, &c->ov, plan), c->variant,
                                   &c->ov);
}

/* A packed call's gradient rows outside every sequence: zeros (csrc/varlen_rows.h). */
static fattn_status zero_uncovered(const call *c) {
    if (!c->p.fwd.cu_seqlens_q) return FATTN_OK;
    if (c->gpu) return fattn_gpu_zero_uncovered(&c->p, c->device, c->stream);
    fattn_cpu_zero_uncovered(&c->p);
    return FATTN_OK;
}

static fattn_status sinks_on_cpu(const fattn_sink_params *sp) {
    fattn_cpu_sinks_backward(sp);
    return FATTN_OK;
}

enum { PLAN, RUN, CHECK }; /* what backward() does with a call, as forward()'s modes (bind.c) */

static PyObject *backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int nnames,
                          int mode, int want_plan) {
    static const char *fnames[3] = {"plan_backward", "backward", "check_backward"};
    module_state *st = fattn_state(module);
    PyObject *a[FATTN_BACKWARD_ARGS];
    if (fattn_parse_args(fnames[mode], args, nargs, kwnames, fattn_backward_arg_names, st->backward_args, nnames, 9,
                         a) ||
        fattn_find_torch(&st->names))
        return NULL;
    for (int i = nnames; i < FATTN_BACKWARD_ARGS; i++) a[i] = NULL;
    const int run = mode == RUN;
    fattn_names names = st->names;
    names.describe = mode == CHECK;
    call c;
    PyObject *result = NULL;
    fattn_plan plan;
    memset(&plan, 0, sizeof plan);
    if (call_take(&names, a, &c)) goto done;
    if (mode == CHECK) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    const attn_params *f = &c.p.fwd;
    fattn_status s = FATTN_OK;
    if (f->b * f->h * f->sq == 0 && f->b * f->h_kv * f->sk == 0) { /* nothing to compute but dsinks' zeros */
        if (run && c.p.dsinks) s = c.gpu ? fattn_gpu_sinks(&c.sp, 1, c.device, c.stream) : sinks_on_cpu(&c.sp);
        if (run && !s) s = zero_uncovered(&c);
        result = s ? NULL : Py_NewRef(Py_None);
        if (s) fattn_raise_status();
        goto done;
    }
    if (c.gpu) {
        if (plan_gpu(st, &c, &plan)) goto done;
        if (run) s = fattn_run_gpu_bwd(&c.p, &plan, c.stream);
        if (run && !s && c.p.dsinks && !plan.sinks_fused) s = fattn_gpu_sinks(&c.sp, 1, c.device, c.stream);
        if (run && !s) s = zero_uncovered(&c);
    } else {
        if (c.variant && strcmp(c.variant, "cpu")) {
            PyErr_Format(PyExc_ValueError, "variant: '%s' does not run on the CPU; fattn.variants('cpu') lists what does",
                         c.variant);
            goto done;
        }
        fattn_cpu_plan_bwd(&c.p, &c.ov, &plan);
        if (run) {
            Py_BEGIN_ALLOW_THREADS
            s = fattn_cpu_backward(&c.p, &plan.cpu);
            if (!s && c.p.dsinks) fattn_cpu_sinks_backward(&c.sp);
            if (!s) s = zero_uncovered(&c);
            Py_END_ALLOW_THREADS
        }
    }
    if (s) {
        fattn_raise_status();
        goto done;
    }
    result = want_plan ? plan_dict(&plan, c.p.deterministic) : Py_NewRef(Py_None);
done:
    call_release(&c);
    return result;
}

PyObject *fattn_py_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return backward(module, args, nargs, kwnames, NARGS_PUBLIC, RUN, 0);
}

PyObject *fattn_py_check_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return backward(module, args, nargs, kwnames, NARGS_PUBLIC, CHECK, 0);
}

PyObject *fattn_dev_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return backward(module, args, nargs, kwnames, FATTN_BACKWARD_ARGS, RUN, 1);
}

PyObject *fattn_dev_plan_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return backward(module, args, nargs, kwnames, FATTN_BACKWARD_ARGS, PLAN, 1);
}

PyObject *fattn_py_backward_workspace_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    static const char *names[4] = {"b", "h", "sq", "d"};
    long v[4];
    int deterministic = 0;
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "backward_workspace_bytes(b, h, sq, d, deterministic=False)");
        return NULL;
    }
    for (int i = 0; i < 4; i++)
        if (fattn_arg_long(args[i], names[i], 0, 1L << 40, &v[i])) return NULL;
    if (nargs == 5 && (deterministic = PyObject_IsTrue(args[4])) < 0) return NULL;
    /* the product in 64 bits (v[3] <= 2^40 is bucketed to at most 256 columns, times at most 2 copies, plus 3) */
    int64_t n = 4 * (256 * 2 + 3);
    if (__builtin_mul_overflow(n, (int64_t)v[0], &n) || __builtin_mul_overflow(n, (int64_t)v[1], &n) ||
        __builtin_mul_overflow(n, fattn_bwd_ws_rows(v[2]), &n)) {
        PyErr_Format(PyExc_ValueError, "backward_workspace_bytes: b=%ld, h=%ld, sq=%ld need more than 2^63 bytes", v[0],
                     v[1], v[2]);
        return NULL;
    }
    return PyLong_FromLongLong(fattn_bwd_workspace_bytes(v[0], v[1], v[2], v[3], deterministic));
}
