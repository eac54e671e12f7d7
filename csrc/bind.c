/* bind.c -- the forward call: parse, plan, launch, raise.
 *
 *   _C.forward(q, k, v, out, lse=None, *, causal=0, scale=None, layout=0, window=None, variant=None, stream=None,
 *              softcap=0, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None,
 *              max_seqlen_k=None, cache_seqlens=None, block_table=None, k_new=None, v_new=None,
 *              check_indices=True, alibi_slopes=None, sinks=None, kvcache=False)
 *   _C._dev.forward(..., config=None, splits=0, order=0) -> the plan that ran (a dict), or None for an empty call
 *   _C._dev.plan(...)                                   -> the plan a call would run, without running it
 *   _C.check_forward(...)                               -> None: forward()'s arguments checked, nothing run; its
 *                                                          torch tensors may be fake or meta (torch's fake kernels)
 *
 * q, k, v, out (and lse) are DLPack arrays (or capsules) on one device; causal is 0 (none), 1 (top-left) or 2
 * (bottom-right); layout 0 is (B, H, S, D), 1 is (B, S, H, D); window a (left, right) pair; softcap c > 0 caps
 * the scores at c tanh(s / c).  With cu_seqlens_q and cu_seqlens_k (int32 prefix sums, B + 1 entries) q, k, v, out
 * are packed (total, H, D) and lse is (H, total_q); seqused_k (int32, B) caps each sequence's keys.  A KV cache
 * (attention_with_kvcache; layout 1): k and v are the cache, paged (num_pages, page_size, H_kv, D) with block_table
 * (int32, B x max_pages); k_new / v_new (B, S_new, H_kv, D) are written at cache_seqlens (int32, B: the lengths
 * before the call) once the call is planned, and attended to (kvcache=True: a cache call, its errors naming k_cache and
 * v_cache, with or without those arguments); check_indices=False trusts cache_seqlens' and
 * block_table's values (no read back: no host sync), and with max_seqlen_q / max_seqlen_k given, cu_seqlens' too.
 * alibi_slopes: float32 (H,) or (B, H), ALiBi's slopes (attn_params).  sinks: float32 (H,), attention sinks (gpt-oss;
 * csrc/sinks.h), lse required with them: out and lse come back sink-adjusted -- applied by the kernel where its
 * planner says so (fattn_plan.sinks_fused: v3's epilogue; v2's softmax, or its split merge), else by the sinks pass
 * after the kernel.  Overrides: config (a GPU variant's config index, or (br, bc, threads) on the CPU), splits (key
 * splits, 0: the planner's; v3: 1 or 3, its split tails, kernels/sm90/v3_plan.c), order (block order, 0: the
 * planner's).  The plan dict says what ran: variant, config, grid, threads, smem, splits, order, head_group,
 * workspace, sinks_fused (1: the kernel joins the sinks, 0: the sinks pass does, or there are none to join). */
#include "module.h"

#include "cpu_attn.h"
#include "variants.h"

const char *const fattn_forward_arg_names[FATTN_FORWARD_ARGS] = {
    "q", "k", "v", "out", "lse", "causal", "scale", "layout", "window", "variant", "stream", "softcap",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "cache_seqlens", "block_table",
    "k_new", "v_new", "check_indices", "alibi_slopes", "sinks", "kvcache", "config", "splits", "order"};
#define NARGS_PUBLIC 25
#define NARGS_DEV FATTN_FORWARD_ARGS
enum { A_Q, A_K, A_V, A_OUT, A_LSE, A_CAUSAL, A_SCALE, A_LAYOUT, A_WINDOW, A_VARIANT, A_STREAM, A_SOFTCAP, A_CU_Q,
       A_CU_K, A_USED_K, A_MAX_Q, A_MAX_K, A_CACHE_SEQLENS, A_BLOCK_TABLE, A_K_NEW, A_V_NEW, A_CHECK_INDICES,
       A_ALIBI, A_SINKS, A_KVCACHE, A_CONFIG, A_SPLITS, A_ORDER };
#define NCACHE 4 /* cache_seqlens, block_table, k_new, v_new */

PyObject *fattn_raise_status(void) {
    PyErr_Format(PyExc_RuntimeError, "fattn: %s", fattn_last_error());
    return NULL;
}

PyObject *fattn_not_built(void) {
    PyErr_SetString(PyExc_RuntimeError, "fattn was built without CUDA support (nvcc was not found at build time)");
    return NULL;
}

int fattn_arg_variant(PyObject *obj, const char **variant) {
    *variant = NULL;
    if (!obj || obj == Py_None) return 0;
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "variant: expected a str or None, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    return (*variant = PyUnicode_AsUTF8(obj)) ? 0 : -1;
}

/* The variant a call names, checked against the table and the call's dtype (ValueError / TypeError). */
int fattn_check_variant(const char *name, fattn_dtype dtype) {
    const fattn_variant *v = fattn_find_variant(name);
    if (!v) {
        PyErr_Format(PyExc_ValueError, "variant: unknown GPU variant '%s'; fattn.variants('cuda') lists them", name);
        return -1;
    }
    if (!(v->dtypes >> dtype & 1)) {
        PyErr_Format(PyExc_TypeError, "variant: %s does not support %s", name,
                     dtype == FATTN_F32 ? "float32" : dtype == FATTN_F16 ? "float16" : "bfloat16");
        return -1;
    }
    return 0;
}

int fattn_arg_softcap(PyObject *obj, double *softcap) {
    *softcap = 0.0;
    if (!obj || obj == Py_None) return 0;
    *softcap = PyFloat_AsDouble(obj);
    if (*softcap == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "softcap: expected a float, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

int fattn_arg_check_indices(PyObject *obj, int *trust) {
    if (!obj || obj == Py_None) return 0;
    const int check = PyObject_IsTrue(obj);
    if (check < 0) return -1;
    *trust = !check;
    return 0;
}

int fattn_take_varlen_args(const fattn_names *names, PyObject **objs, PyObject *max_q, PyObject *max_k,
                           PyObject *stream, fattn_tensor *ts, fattn_call_opts *o) {
    static const char *arg_names[3] = {"cu_seqlens_q", "cu_seqlens_k", "seqused_k"};
    long mq = -1, mk = -1;
    if (fattn_arg_long(max_q && max_q != Py_None ? max_q : NULL, "max_seqlen_q", 0, 0x7fffffff, &mq) ||
        fattn_arg_long(max_k && max_k != Py_None ? max_k : NULL, "max_seqlen_k", 0, 0x7fffffff, &mk))
        return -1;
    o->max_seqlen_q = mq;
    o->max_seqlen_k = mk;
    for (int i = 0; i < 3; i++)
        if (objs[i] && objs[i] != Py_None && fattn_take(names, objs[i], arg_names[i], stream, &ts[i]))
            return -1;
    o->cu_seqlens_q = &ts[0];
    o->cu_seqlens_k = &ts[1];
    o->seqused_k = &ts[2];
    return 0;
}

/* One call's arguments, taken and checked. */
typedef struct {
    fattn_tensor ts[5];
    fattn_tensor seqs[3]; /* cu_seqlens_q, cu_seqlens_k, seqused_k */
    fattn_tensor cache[NCACHE];
    fattn_append append;  /* k_new / v_new, written after planning */
    fattn_tensor alibi;   /* alibi_slopes */
    fattn_tensor sinks;   /* sinks */
    fattn_sink_params sp; /* the sinks pass over out and lse, for a kernel that does not apply them */
    attn_params p;
    const char *variant;
    fattn_overrides ov;
    void *stream;
    int gpu, device;
} call;

static void call_release(call *c) {
    for (int i = 0; i < 5; i++) fattn_tensor_release(&c->ts[i]);
    for (int i = 0; i < 3; i++) fattn_tensor_release(&c->seqs[i]);
    for (int i = 0; i < NCACHE; i++) fattn_tensor_release(&c->cache[i]);
    fattn_tensor_release(&c->alibi);
    fattn_tensor_release(&c->sinks);
}

static int given(PyObject *obj) { return obj && obj != Py_None; }

/* A KV cache's arguments (attention_with_kvcache): cache_seqlens in the seqused_k slot, the pages, the new keys. */
static int take_cache_args(const fattn_names *names, PyObject **a, PyObject *stream_obj, call *c,
                           fattn_call_opts *o) {
    static const char *arg_names[NCACHE] = {"cache_seqlens", "block_table", "k_new", "v_new"};
    if (given(a[A_CACHE_SEQLENS]) && given(a[A_USED_K])) {
        PyErr_SetString(PyExc_TypeError, "cache_seqlens: not taken with seqused_k (give one)");
        return -1;
    }
    for (int i = 0; i < NCACHE; i++) {
        PyObject *obj = a[A_CACHE_SEQLENS + i];
        if (!given(obj)) continue;
        if (fattn_take(names, obj, arg_names[i], stream_obj, &c->cache[i])) return -1;
    }
    if (c->cache[0].t) o->seqused_k = &c->cache[0];
    o->block_table = &c->cache[1];
    o->k_new = &c->cache[2];
    o->v_new = &c->cache[3];
    o->append = &c->append;
    return 0;
}

int fattn_parse_overrides(PyObject *cfg, PyObject *splits_obj, PyObject *order_obj, fattn_overrides *ov) {
    const fattn_overrides none = FATTN_NO_OVERRIDES;
    *ov = none;
    long splits = 0, order = 0;
    if (fattn_arg_long(splits_obj, "splits", 0, 128, &splits) ||
        fattn_arg_long(order_obj, "order", 0, FATTN_ORDER_BLOCKS, &order))
        return -1;
    ov->splits = (int)splits;
    ov->order = (int)order;
    if (!cfg || cfg == Py_None) return 0;
    if (PyTuple_Check(cfg)) {
        if (!PyArg_ParseTuple(cfg, "iii", &ov->cpu.br, &ov->cpu.bc, &ov->cpu.threads)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "config: expected a (br, bc, threads) tuple of ints for the CPU backend");
            return -1;
        }
        if (fattn_cpu_check_config(&ov->cpu)) {
            PyErr_Format(PyExc_ValueError, "config: %s", fattn_last_error());
            return -1;
        }
        return 0;
    }
    long idx = 0;
    if (fattn_arg_long(cfg, "config", 0, 1 << 20, &idx)) return -1;
    ov->config = (int)idx;
    return 0;
}

/* names->describe: a check-only call (tensors without memory described, not taken; index values not read). */
static int call_take(const fattn_names *names, PyObject **a, call *c) {
    memset(c, 0, sizeof *c);
    static const char *const tensor_names[5] = {"q", "k", "v", "out", "lse"};
    static const char *const cache_names[5] = {"q", "k_cache", "v_cache", "out", "lse"};
    int cache = given(a[A_KVCACHE]) ? PyObject_IsTrue(a[A_KVCACHE]) : 0;
    if (cache < 0) return -1;
    for (int i = A_CACHE_SEQLENS; i < A_CACHE_SEQLENS + NCACHE; i++) cache |= given(a[i]);
    long causal = 0, layout = 0;
    fattn_call_opts o = {0, 0, -1, -1, 0.0, 0, 0.0, NULL, NULL, NULL, -1, -1};
    if (fattn_arg_long(a[A_CAUSAL], "causal", 0, 2, &causal) || fattn_arg_long(a[A_LAYOUT], "layout", 0, 1, &layout) ||
        fattn_arg_scale(a[A_SCALE], &o.scale) || fattn_arg_window(a[A_WINDOW], &o.window_left, &o.window_right) ||
        fattn_arg_stream(a[A_STREAM], &c->stream) || fattn_arg_softcap(a[A_SOFTCAP], &o.softcap) ||
        fattn_parse_overrides(a[A_CONFIG], a[A_SPLITS], a[A_ORDER], &c->ov))
        return -1;
    o.causal = (int)causal;
    o.layout = (int)layout;
    if (fattn_arg_variant(a[A_VARIANT], &c->variant)) return -1;
    /* cu_seqlens, seqused_k / cache_seqlens and block_table: trusted when check_indices is false */
    if (fattn_arg_check_indices(a[A_CHECK_INDICES], &o.trust_indices)) return -1;
    o.trust_indices |= names->describe;
    PyObject *stream_obj = a[A_STREAM] ? a[A_STREAM] : Py_None;
    if (fattn_refuse_none(a, cache ? cache_names : tensor_names, 4)) return -1; /* q, k, v, out; lse optional */
    for (int i = 0; i < 5; i++)
        if (given(a[i]) && fattn_take(names, a[i], (cache ? cache_names : tensor_names)[i], stream_obj, &c->ts[i]))
            return -1;
    if (given(a[A_ALIBI]) && fattn_take(names, a[A_ALIBI], "alibi_slopes", stream_obj, &c->alibi))
        return -1;
    o.alibi_slopes = &c->alibi;
    if (given(a[A_SINKS]) && fattn_take(names, a[A_SINKS], "sinks", stream_obj, &c->sinks)) return -1;
    if (fattn_take_varlen_args(names, a + A_CU_Q, a[A_MAX_Q], a[A_MAX_K], stream_obj, c->seqs, &o) ||
        (cache && take_cache_args(names, a, stream_obj, c, &o)) || fattn_build_params(c->ts, &o, &c->p, c->stream))
        return -1;
    if (c->sinks.t) {
        if (!c->ts[4].t) {
            PyErr_SetString(PyExc_TypeError, "lse: needed with sinks (they adjust it)");
            return -1;
        }
        bhsd_view rows;
        if (fattn_take_sink_rows(&c->ts[3], &c->ts[4], &c->sinks, (int)layout, &rows, &c->sp)) return -1;
        c->p.sinks = c->sp.sinks;
    }
    const fattn_tensor *written[2] = {&c->ts[3], &c->ts[4]}; /* out, lse: the kernels read these two meanwhile */
    if (fattn_refuse_shared(&c->sinks, written, 2) || fattn_refuse_shared(&c->alibi, written, 2)) return -1;
    c->gpu = fattn_call_device(&c->ts[0], &c->device);
    if (c->gpu ? c->ov.cpu.br != 0 : c->ov.config >= 0) {
        PyErr_SetString(PyExc_TypeError, c->gpu ? "config: a GPU variant takes a config index"
                                                : "config: the CPU backend takes a (br, bc, threads) tuple");
        return -1;
    }
    return 0;
}

static PyObject *plan_dict(const fattn_plan *plan) {
    if (!plan->variant)
        return Py_BuildValue("{sssssis(iii)sisisisi}", "variant", "cpu", "family", "cpu", "device", 0, "config",
                             plan->cpu.br, plan->cpu.bc, plan->cpu.threads, "splits", 1, "order", 0, "workspace", 0,
                             "sinks_fused", 0);
    return Py_BuildValue("{sssssisis(II)sIsnsisisLsnsi}", "variant", plan->variant->name, "family",
                         plan->variant->family, "device", plan->dev.id, "config", plan->config, "grid", plan->grid_x,
                         plan->grid_y, "threads", plan->threads, "smem", (Py_ssize_t)plan->smem, "splits", plan->splits,
                         "order", plan->order, "head_group", (long long)plan->head_group, "workspace",
                         (Py_ssize_t)plan->workspace_bytes, "sinks_fused", plan->sinks_fused);
}

/* The GPU plan of a call; NULL variant: the default for the device.  -1 with the exception set. */
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
    if (c->variant && fattn_check_variant(c->variant, c->p.dtype)) return -1;
    return fattn_raise_plan_status(fattn_plan_gpu(&c->p, &dev, &st->tuned, c->variant, &c->ov, plan), c->variant,
                                   &c->ov);
}

int fattn_raise_plan_status(fattn_status s, const char *variant, const fattn_overrides *ov) {
    if (s == FATTN_ERR_UNSUPPORTED && variant) {
        PyErr_Format(PyExc_ValueError, "variant: %s", fattn_last_error());
        return -1;
    }
    if (s == FATTN_ERR_INVALID && ov->config >= 0) {
        PyErr_Format(PyExc_ValueError, "config: %s", fattn_last_error());
        return -1;
    }
    if (s) {
        fattn_raise_status();
        return -1;
    }
    return 0;
}

/* k_new / v_new into the cache, on the call's device and stream. */
static fattn_status append_kv(const call *c) {
    if (c->gpu) return fattn_gpu_append_kv(&c->p, &c->append, c->device, c->stream);
    fattn_cpu_append_kv(&c->p, &c->append);
    return FATTN_OK;
}

enum { PLAN, RUN, CHECK }; /* what forward() does with a call */

/* mode PLAN plans only, RUN runs, CHECK checks the arguments only (their tensors may be fake or meta: described by
 * shape, strides, dtype and device; index arrays not read), so that a traced call is refused as the eager one is.
 * want_plan: return the plan dict (else None). */
static PyObject *forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int nnames,
                         int mode, int want_plan) {
    static const char *fnames[3] = {"plan", "forward", "check_forward"};
    module_state *st = fattn_state(module);
    PyObject *a[NARGS_DEV];
    if (fattn_parse_args(fnames[mode], args, nargs, kwnames, fattn_forward_arg_names, st->forward_args, nnames, 4, a) ||
        fattn_find_torch(&st->names))
        return NULL;
    for (int i = nnames; i < NARGS_DEV; i++) a[i] = NULL;
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
    const attn_params *p = &c.p;
    fattn_status s = FATTN_OK;
    if (p->b * p->h * p->sq == 0) { /* nothing to compute; new keys are still appended */
        if (run && c.append.s_new && (s = append_kv(&c))) {
            fattn_raise_status();
            goto done;
        }
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (c.gpu) {
        if (plan_gpu(st, &c, &plan)) goto done;
        /* readied (workspace, counters) before the append: a call refused there writes nothing */
        if (run) s = fattn_ready_gpu(p, &st->tuned, c.variant, &c.ov, &plan, c.stream);
        if (run && !s && c.append.s_new) s = append_kv(&c);
        if (run && !s) s = fattn_launch_gpu(p, &plan, c.stream);
        if (run && !s && p->sinks && !plan.sinks_fused) s = fattn_gpu_sinks(&c.sp, 0, c.device, c.stream);
    } else {
        if (c.variant && strcmp(c.variant, "cpu")) {
            PyErr_Format(PyExc_ValueError, "variant: '%s' does not run on the CPU; fattn.variants('cpu') lists what does",
                         c.variant);
            goto done;
        }
        fattn_cpu_plan(p, &st->tuned, &c.ov, &plan);
        if (run) {
            Py_BEGIN_ALLOW_THREADS
            fattn_cpu_work *w = NULL; /* allocated before the append: a call refused for memory writes nothing */
            s = fattn_cpu_work_alloc(p, &plan.cpu, &w);
            if (!s && c.append.s_new) s = append_kv(&c);
            if (!s) s = fattn_cpu_forward(p, &plan.cpu, w);
            if (!s && p->sinks) fattn_cpu_sinks_forward(&c.sp);
            fattn_cpu_work_free(w);
            Py_END_ALLOW_THREADS
        }
    }
    if (s) {
        fattn_raise_status();
        goto done;
    }
    result = want_plan ? plan_dict(&plan) : Py_NewRef(Py_None);
done:
    call_release(&c);
    return result;
}

PyObject *fattn_py_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return forward(module, args, nargs, kwnames, NARGS_PUBLIC, RUN, 0);
}

PyObject *fattn_py_check_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return forward(module, args, nargs, kwnames, NARGS_PUBLIC, CHECK, 0);
}

PyObject *fattn_dev_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return forward(module, args, nargs, kwnames, NARGS_DEV, RUN, 1);
}

PyObject *fattn_dev_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return forward(module, args, nargs, kwnames, NARGS_DEV, PLAN, 1);
}
