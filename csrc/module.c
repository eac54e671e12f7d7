/* module.c -- fattn._C: the CPython extension.
 *
 *   forward(q, k, v, out, lse, causal, scale, layout, variant, stream) -> None
 *       q, k, v, out (and lse, or None): DLPack-capable arrays (or capsules), all on one device.
 *       causal: 0 none, 1 top-left, 2 bottom-right.  scale: float, or None for 1/sqrt(d).
 *       layout: 0 "bhsd", 1 "bshd".  variant: str, or None for the default.  stream: CUDA stream handle (int) or
 *       None; passed to __dlpack__ and used for the launch.
 *   dlpack_device(x) -> (device_type, device_id) of an array or a DLPack capsule
 *   variants(device_type, device_id) -> [(name, summary), ...]   the variants that run there
 *   cuda_device_count() -> int          raises RuntimeError when no driver / device can be used
 *   device_info(device_id) -> (name, compute capability, multiprocessors)
 *   cpu_config() -> (br, bc, threads);  set_cpu_config(br, bc, threads)
 *   forward(..., stream, config): config None (the tuned config if one is registered, else the default), a v2
 *       config index (GPU), or (br, bc, threads) (CPU).  time_forward(...): the C timing harness on one call.
 *   rtc_compile / v2_add_rtc / set_tuned / clear_tuned / seq_bucket: run-time compilation and the tuned-config
 *       cache, driven by fattn/_rtc.py and fattn/_tuned.py.
 *
 * Arguments are checked here, each error naming its argument; C errors come back as RuntimeError with file:line.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "cpu_attn.h"
#include "gemm_baseline.h"
#include "gpu.h"
#include "rtc.h"
#include "tensor.h"
#ifdef FATTN_WITH_CUDA
#include "../kernels/v2_configs.h"
#include "../kernels/v3_configs.h"
#endif

typedef struct {
    fattn_names names;
    fattn_cpu_config cpu;
    /* the tuned-config cache's CPU entries (fattn/_tuned.py): [dtype][head dim / 8 - 1][causal][sequence bucket],
     * br = 0 for none */
    fattn_cpu_config cpu_tuned[3][FATTN_MAX_HEADDIM / 8][2][FATTN_SEQ_BUCKETS];
    fattn_cpu_config last_cpu; /* the config of the last CPU call (last_config()) */
    int last_gpu;              /* 1 if the last call ran on the GPU */
    const char *last_variant;  /* the GPU variant of the last GPU call */
} module_state;

static module_state *get_state(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* ---- argument checks ------------------------------------------------------------------------------------- */

/* Shape and strides of a 4-D q/k/v/out in (b, h, s, d) order, whatever the layout. */
typedef struct {
    int64_t b, h, s, d;
    int64_t sb, sh, ss;
    char *data;
    fattn_dtype dtype;
} bhsd_view;

static int dtype_of(const fattn_tensor *t, fattn_dtype *dt) {
    DLDataType x = t->t->dtype;
    if (x.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: vector dtypes (lanes=%u) are not supported", t->arg, x.lanes);
        return -1;
    }
    if (x.code == kDLFloat && x.bits == 32) *dt = FATTN_F32;
    else if (x.code == kDLFloat && x.bits == 16) *dt = FATTN_F16;
    else if (x.code == kDLBfloat && x.bits == 16) *dt = FATTN_BF16;
    else {
        PyErr_Format(PyExc_TypeError, "%s: dtype (code %u, %u bits) is not supported; use float16, bfloat16 or float32",
                     t->arg, x.code, x.bits);
        return -1;
    }
    return 0;
}

/* Strides in elements, compact row-major when the producer gave none. */
static void strides_of(const DLTensor *t, int64_t *st) {
    int64_t acc = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        st[i] = t->strides ? t->strides[i] : acc;
        acc *= t->shape[i];
    }
}

static int view_4d(const fattn_tensor *t, int layout, bhsd_view *v) {
    const DLTensor *x = t->t;
    if (x->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "%s: expected a 4-D array (%s), got %d-D", t->arg, layout ? "B, S, H, D" : "B, H, S, D",
                     x->ndim);
        return -1;
    }
    if (dtype_of(t, &v->dtype) < 0) return -1;
    int64_t st[4];
    strides_of(x, st);
    const int hi = layout ? 2 : 1, si = layout ? 1 : 2;
    v->b = x->shape[0]; v->h = x->shape[hi]; v->s = x->shape[si]; v->d = x->shape[3];
    v->sb = st[0]; v->sh = st[hi]; v->ss = st[si];
    const int empty = v->b == 0 || v->h == 0 || v->s == 0; /* strides of an empty array mean nothing */
    if (st[3] != 1 && v->d > 1 && !empty) {
        PyErr_Format(PyExc_ValueError, "%s: the last dimension must be contiguous (stride 1), got stride %lld", t->arg,
                     (long long)st[3]);
        return -1;
    }
    v->data = (char *)x->data + x->byte_offset;
    const size_t esize = v->dtype == FATTN_F32 ? 4 : 2;
    if ((uintptr_t)v->data % esize) {
        PyErr_Format(PyExc_ValueError, "%s: data pointer is not aligned to its %zu-byte elements", t->arg, esize);
        return -1;
    }
    return 0;
}

static int same_device(const fattn_tensor *a, const fattn_tensor *ref) {
    const DLDevice x = a->t->device, y = ref->t->device;
    if (x.device_type != y.device_type || x.device_id != y.device_id) {
        PyErr_Format(PyExc_ValueError, "%s: on device (%d, %d) but %s is on (%d, %d); all arrays must share one device",
                     a->arg, x.device_type, x.device_id, ref->arg, y.device_type, y.device_id);
        return -1;
    }
    return 0;
}

#define REQUIRE(cond, exc, ...)                                                                                    \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            PyErr_Format(exc, __VA_ARGS__);                                                                        \
            return -1;                                                                                             \
        }                                                                                                          \
    } while (0)

/* Fills p from the taken tensors; every mismatch raises naming the argument. */
static int build_params(fattn_tensor *ts, int has_lse, int layout, int causal, PyObject *scale, attn_params *p) {
    bhsd_view q, k, v, o;
    if (view_4d(&ts[0], layout, &q) || view_4d(&ts[1], layout, &k) || view_4d(&ts[2], layout, &v) ||
        view_4d(&ts[3], layout, &o))
        return -1;
    for (int i = 1; i < 4 + has_lse; i++)
        if (same_device(&ts[i], &ts[0])) return -1;
    REQUIRE(k.dtype == q.dtype, PyExc_TypeError, "k: dtype differs from q's; q, k, v and out must share one dtype");
    REQUIRE(v.dtype == q.dtype, PyExc_TypeError, "v: dtype differs from q's; q, k, v and out must share one dtype");
    REQUIRE(o.dtype == q.dtype, PyExc_TypeError, "out: dtype differs from q's; q, k, v and out must share one dtype");
    REQUIRE(q.d % 8 == 0 && q.d >= 8 && q.d <= FATTN_MAX_HEADDIM, PyExc_ValueError,
            "q: head dim %lld is not supported; use a multiple of 8 from 8 to %d", (long long)q.d, FATTN_MAX_HEADDIM);
    REQUIRE(k.d == q.d, PyExc_ValueError, "k: head dim %lld differs from q's %lld", (long long)k.d, (long long)q.d);
    REQUIRE(v.d == q.d, PyExc_ValueError, "v: head dim %lld differs from q's %lld", (long long)v.d, (long long)q.d);
    REQUIRE(k.b == q.b, PyExc_ValueError, "k: batch %lld differs from q's %lld", (long long)k.b, (long long)q.b);
    REQUIRE(v.b == q.b && v.h == k.h && v.s == k.s, PyExc_ValueError,
            "v: shape (B=%lld, H=%lld, S=%lld) differs from k's (B=%lld, H=%lld, S=%lld)", (long long)v.b,
            (long long)v.h, (long long)v.s, (long long)k.b, (long long)k.h, (long long)k.s);
    REQUIRE(k.h >= 1 && q.h % k.h == 0, PyExc_ValueError,
            "k: %lld heads do not divide q's %lld heads (grouped-query attention needs h %% h_kv == 0)", (long long)k.h,
            (long long)q.h);
    REQUIRE(o.b == q.b && o.h == q.h && o.s == q.s && o.d == q.d, PyExc_ValueError,
            "out: shape differs from q's (B=%lld, H=%lld, Sq=%lld, D=%lld in layout %s)", (long long)q.b, (long long)q.h,
            (long long)q.s, (long long)q.d, layout ? "bshd" : "bhsd");
    REQUIRE(!ts[3].readonly, PyExc_ValueError, "out: the array is read-only");

    memset(p, 0, sizeof *p);
    p->config = -1;
    p->q = q.data; p->k = k.data; p->v = v.data; p->o = o.data;
    p->q_stride_b = q.sb; p->q_stride_h = q.sh; p->q_stride_s = q.ss;
    p->k_stride_b = k.sb; p->k_stride_h = k.sh; p->k_stride_s = k.ss;
    p->v_stride_b = v.sb; p->v_stride_h = v.sh; p->v_stride_s = v.ss;
    p->o_stride_b = o.sb; p->o_stride_h = o.sh; p->o_stride_s = o.ss;
    p->b = q.b; p->h = q.h; p->h_kv = k.h; p->sq = q.s; p->sk = k.s; p->d = q.d;
    p->h_per_kv = q.h / k.h;
    p->dtype = q.dtype;

    if (has_lse) {
        const fattn_tensor *l = &ts[4];
        const DLTensor *x = l->t;
        REQUIRE(x->ndim == 3, PyExc_ValueError, "lse: expected a 3-D float32 array (B, H, Sq), got %d-D", x->ndim);
        REQUIRE(x->dtype.code == kDLFloat && x->dtype.bits == 32 && x->dtype.lanes == 1, PyExc_TypeError,
                "lse: dtype must be float32");
        REQUIRE(x->shape[0] == q.b && x->shape[1] == q.h && x->shape[2] == q.s, PyExc_ValueError,
                "lse: shape must be (B=%lld, H=%lld, Sq=%lld)", (long long)q.b, (long long)q.h, (long long)q.s);
        REQUIRE(!l->readonly, PyExc_ValueError, "lse: the array is read-only");
        int64_t st[3];
        strides_of(x, st);
        REQUIRE(st[2] == 1 || q.s <= 1 || q.b * q.h == 0, PyExc_ValueError, "lse: the last dimension must be contiguous");
        p->lse = (float *)((char *)x->data + x->byte_offset);
        REQUIRE((uintptr_t)p->lse % 4 == 0, PyExc_ValueError, "lse: data pointer is not 4-byte aligned");
        p->lse_stride_b = st[0];
        p->lse_stride_h = st[1];
    }

    double sc = 1.0 / sqrt((double)q.d);
    if (scale != Py_None) {
        sc = PyFloat_AsDouble(scale);
        if (sc == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "scale: expected a float or None, got %.200s", Py_TYPE(scale)->tp_name);
            return -1;
        }
        REQUIRE(isfinite(sc), PyExc_ValueError, "scale: must be finite, got %R", scale);
    }
    p->scale = (float)sc;
    p->scale_log2 = (float)(sc * 1.4426950408889634);
    REQUIRE(causal >= 0 && causal <= 2, PyExc_ValueError, "causal: internal code %d is not 0, 1 or 2", causal);
    p->causal = causal;
    p->causal_offset = causal == FATTN_CAUSAL_BOTTOM_RIGHT ? p->sk - p->sq : 0;
    return 0;
}

/* ---- dispatch -------------------------------------------------------------------------------------------- */

static const fattn_variant *find_gpu_variant(const char *name) {
    for (const fattn_variant *v = fattn_gpu_variants; v->name; v++)
        if (!strcmp(v->name, name)) return v;
    return NULL;
}

static PyObject *not_built(void) {
    PyErr_SetString(PyExc_RuntimeError, "fattn was built without CUDA support (nvcc was not found at build time)");
    return NULL;
}

static PyObject *raise_status(void) {
    PyErr_Format(PyExc_RuntimeError, "fattn: %s", fattn_last_error());
    return NULL;
}

/* The CPU config of a call: an explicit (br, bc, threads) tuple, else the tuned one registered for this problem, else
 * the module's (set_cpu_config). */
static int parse_cpu_config(PyObject *obj, fattn_cpu_config *c) {
    if (!PyArg_ParseTuple(obj, "iii", &c->br, &c->bc, &c->threads)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "config: expected a (br, bc, threads) tuple of ints for the CPU backend");
        return -1;
    }
    if (c->br < 1 || c->br > 1024 || c->bc < 16 || c->bc > 1024 || c->bc % 16 || c->threads < 0) {
        PyErr_SetString(PyExc_ValueError, "config: need 1 <= br <= 1024, bc a multiple of 16 in [16, 1024], threads >= 0");
        return -1;
    }
    return 0;
}

static int cpu_config_for(const module_state *st, PyObject *config, const attn_params *p, fattn_cpu_config *c) {
    if (config != Py_None) return parse_cpu_config(config, c);
    const fattn_cpu_config *t = &st->cpu_tuned[p->dtype][p->d / 8 - 1][p->causal != 0][fattn_seq_bucket(p->sq, p->sk)];
    *c = t->br ? *t : st->cpu;
    return 0;
}

static int check_cpu_variant(const char *variant) {
    if (variant && strcmp(variant, "cpu")) {
        PyErr_Format(PyExc_ValueError, "variant: '%s' does not run on the CPU; fattn.variants('cpu') lists what does",
                     variant);
        return -1;
    }
    return 0;
}

/* The GPU variant for a call: the named one (checked against p), or the default for the device. */
static const fattn_variant *gpu_variant_for(const char *variant, int device, const attn_params *p) {
    if (!fattn_gpu_compiled()) {
        not_built();
        return NULL;
    }
    const fattn_variant *v;
    if (variant) {
        v = find_gpu_variant(variant);
        if (!v) {
            PyErr_Format(PyExc_ValueError, "variant: unknown GPU variant '%s'; fattn.variants('cuda') lists them", variant);
            return NULL;
        }
        if (!(v->dtypes >> p->dtype & 1)) {
            PyErr_Format(PyExc_TypeError, "variant: %s does not support this dtype", variant);
            return NULL;
        }
        if (v->check(p)) {
            PyErr_Format(PyExc_ValueError, "variant: %s", fattn_last_error());
            return NULL;
        }
    } else if (!(v = fattn_gpu_default(device, p))) {
        raise_status();
    }
    return v;
}

/* The GPU config of a call: None (tuned or default) or an int index into the variant's config table. */
static int gpu_config_for(PyObject *config, attn_params *p) {
    if (config == Py_None) return 0;
    const long i = PyLong_Check(config) ? PyLong_AsLong(config) : -2;
    if (i < 0 || i > 0x7fffffff) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "config: expected None or a config index >= 0 for a GPU variant");
        return -1;
    }
    p->config = (int)i;
    return 0;
}

static int stream_of(PyObject *stream, void **s) {
    *s = NULL;
    if (stream == Py_None) return 0;
    *s = PyLong_AsVoidPtr(stream);
    /* DLPack's 1 and 2 (legacy and per-thread default streams) are also the runtime's cudaStreamLegacy and
     * cudaStreamPerThread handles, so the value is passed through unchanged. */
    return PyErr_Occurred() ? -1 : 0;
}

/* Takes argument `obj` into `out`: torch tensors through the lean path, anything else through DLPack, which is
 * told `stream` only when the producer is on a CUDA device (torch refuses one for a CPU tensor); a device mismatch
 * is reported later by build_params, naming the argument. */
static int take_arg(const module_state *st, PyObject *obj, const char *name, PyObject *stream, fattn_tensor *out) {
    if (fattn_is_torch(&st->names, obj)) return fattn_tensor_from_torch(&st->names, obj, name, out);
    int t = 0, id = 0;
    if (!fattn_dlpack_device(&st->names, obj, name, &t, &id)) return -1;
    return fattn_tensor_take(&st->names, obj, name, t == kDLCUDA ? stream : Py_None, out);
}

/* One call's arguments, taken and checked: forward() and time_forward() share this. */
typedef struct {
    fattn_tensor ts[5];
    attn_params p;
    const char *variant;
    PyObject *stream, *config;
    int gpu, device;
} call_args;

static void call_release(call_args *c) {
    for (int i = 0; i < 5; i++) fattn_tensor_release(&c->ts[i]);
}

/* args: q, k, v, out, lse, causal, scale, layout, variant, stream[, config].  0 on success (release with
 * call_release either way). */
static int call_take(module_state *st, PyObject *const *args, int has_config, call_args *c) {
    static const char *names[5] = {"q", "k", "v", "out", "lse"};
    memset(c, 0, sizeof *c);
    PyObject *variant_o = args[8];
    c->stream = args[9];
    c->config = has_config ? args[10] : Py_None;
    const int has_lse = args[4] != Py_None;
    const long causal = PyLong_AsLong(args[5]), layout = PyLong_AsLong(args[7]);
    if (PyErr_Occurred()) return -1;
    if (variant_o != Py_None && !(c->variant = PyUnicode_AsUTF8(variant_o))) return -1;
    for (int i = 0; i < 4 + has_lse; i++)
        if (take_arg(st, args[i], names[i], c->stream, &c->ts[i])) return -1;
    if (build_params(c->ts, has_lse, (int)layout, (int)causal, args[6], &c->p)) return -1;
    c->gpu = c->ts[0].t->device.device_type == kDLCUDA; /* build_params checked that all share q's device */
    c->device = c->ts[0].t->device.device_id;
    return 0;
}

static PyObject *py_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10 && nargs != 11) {
        PyErr_Format(PyExc_TypeError, "forward() takes 10 or 11 positional arguments (%zd given)", nargs);
        return NULL;
    }
    module_state *st = get_state(module);
    call_args c;
    PyObject *result = NULL;
    if (call_take(st, args, nargs == 11, &c)) goto done;
    attn_params *p = &c.p;
    if (p->b * p->h * p->sq == 0) { result = Py_NewRef(Py_None); goto done; } /* nothing to compute */
    fattn_status s;
    if (c.gpu) {
        const fattn_variant *v = gpu_variant_for(c.variant, c.device, p);
        void *stream;
        if (!v || gpu_config_for(c.config, p) || stream_of(c.stream, &stream)) goto done;
        s = fattn_gpu_forward(v, c.device, p, stream);
        st->last_gpu = 1;
        st->last_variant = v->name;
    } else {
        fattn_cpu_config cfg;
        if (check_cpu_variant(c.variant) || cpu_config_for(st, c.config, p, &cfg)) goto done;
        st->last_cpu = cfg;
        st->last_gpu = 0;
        Py_BEGIN_ALLOW_THREADS
        s = fattn_cpu_forward(p, &cfg);
        Py_END_ALLOW_THREADS
    }
    if (s) { raise_status(); goto done; }
    result = Py_NewRef(Py_None);
done:
    call_release(&c);
    return result;
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double quantile(const float *sorted, int n, double q) {
    const double pos = (n - 1) * q;
    const int lo = (int)pos, hi = lo + 1 < n ? lo + 1 : n - 1;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

/* time_forward(q, k, v, out, lse, causal, scale, layout, variant, stream, config, reps, warmup, flush)
 *   -> (p50_us, p90_us, [us of each repeat])    the timing harness (gpu.h, cpu_attn.h) on one call's arguments */
static PyObject *py_time_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "time_forward(q, k, v, out, lse, causal, scale, layout, variant, stream, "
                                         "config, reps, warmup, flush)");
        return NULL;
    }
    const long reps = PyLong_AsLong(args[11]), warmup = PyLong_AsLong(args[12]);
    const int flush = PyObject_IsTrue(args[13]);
    if (PyErr_Occurred() || flush < 0) return NULL;
    if (reps < 1 || reps > FATTN_TIME_MAX_REPS || warmup < 0 || warmup > FATTN_TIME_MAX_REPS) {
        PyErr_Format(PyExc_ValueError, "reps: need 1 <= reps <= %d and 0 <= warmup <= %d", FATTN_TIME_MAX_REPS,
                     FATTN_TIME_MAX_REPS);
        return NULL;
    }
    module_state *st = get_state(module);
    call_args c;
    PyObject *result = NULL;
    float *us = NULL;
    if (call_take(st, args, 1, &c)) goto done;
    attn_params *p = &c.p;
    if (p->b * p->h * p->sq == 0) {
        PyErr_SetString(PyExc_ValueError, "q: nothing to time (an empty problem)");
        goto done;
    }
    if (!(us = (float *)PyMem_Calloc((size_t)reps, sizeof(float)))) { PyErr_NoMemory(); goto done; }
    fattn_status s;
    if (c.gpu) {
        const fattn_variant *v = gpu_variant_for(c.variant, c.device, p);
        void *stream;
        if (!v || gpu_config_for(c.config, p) || stream_of(c.stream, &stream)) goto done;
        Py_BEGIN_ALLOW_THREADS
        s = fattn_gpu_time(v, c.device, p, stream, (int)reps, (int)warmup, flush, us);
        Py_END_ALLOW_THREADS
    } else {
        fattn_cpu_config cfg;
        if (check_cpu_variant(c.variant) || cpu_config_for(st, c.config, p, &cfg)) goto done;
        Py_BEGIN_ALLOW_THREADS
        s = fattn_cpu_time(p, &cfg, (int)reps, (int)warmup, us);
        Py_END_ALLOW_THREADS
    }
    if (s) { raise_status(); goto done; }
    PyObject *samples = PyList_New(reps);
    for (long i = 0; samples && i < reps; i++) {
        PyObject *x = PyFloat_FromDouble(us[i]);
        if (!x) { Py_CLEAR(samples); break; }
        PyList_SET_ITEM(samples, i, x);
    }
    if (!samples) goto done;
    qsort(us, (size_t)reps, sizeof(float), cmp_float);
    result = Py_BuildValue("(ddN)", quantile(us, (int)reps, 0.5), quantile(us, (int)reps, 0.9), samples);
done:
    PyMem_Free(us);
    call_release(&c);
    return result;
}

/* ---- queries --------------------------------------------------------------------------------------------- */

static PyObject *py_dlpack_device(PyObject *module, PyObject *obj) {
    int type = 0, id = 0;
    if (!fattn_dlpack_device(&get_state(module)->names, obj, "q", &type, &id)) return NULL;
    return Py_BuildValue("(ii)", type, id);
}

static PyObject *py_cuda_device_count(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    int n = 0;
    if (fattn_gpu_device_count(&n)) return raise_status();
    return PyLong_FromLong(n);
}

static PyObject *py_device_info(PyObject *module, PyObject *arg) {
    (void)module;
    const int dev = (int)PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    int sm = 0, count = 0;
    char name[256] = "";
    if (fattn_gpu_device_info(dev, &sm, &count, name, sizeof name)) return raise_status();
    return Py_BuildValue("(sii)", name, sm, count);
}

static PyObject *py_variants(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "variants(device_type, device_id)"); return NULL; }
    const char *type = PyUnicode_AsUTF8(args[0]);
    const int dev = (int)PyLong_AsLong(args[1]);
    if (!type || PyErr_Occurred()) return NULL;
    if (!strcmp(type, "cpu")) return Py_BuildValue("[(ss)]", "cpu", "tiled flash attention in C, OpenMP over (b, h, q-block)");
    if (strcmp(type, "cuda")) { PyErr_Format(PyExc_ValueError, "device: unknown device type '%s'", type); return NULL; }
    int sm = 0, count = 0;
    if (fattn_gpu_device_info(dev, &sm, &count, NULL, 0)) return raise_status();
    PyObject *list = PyList_New(0);
    for (const fattn_variant *v = fattn_gpu_variants; list && v->name; v++) {
        if (!fattn_variant_runs_on(v, sm)) continue;
        PyObject *row = Py_BuildValue("(ss)", v->name, v->summary);
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
    return list;
}

static PyObject *py_all_variants(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    PyObject *list = PyList_New(0);
    for (const fattn_variant *v = fattn_gpu_variants; list && v->name; v++) {
        PyObject *row = Py_BuildValue("(ssi)", v->name, v->summary, v->min_sm);
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
    return list;
}

static PyObject *py_cpu_config(PyObject *module, PyObject *unused) {
    (void)unused;
    const fattn_cpu_config c = get_state(module)->cpu;
    return Py_BuildValue("(iii)", c.br, c.bc, c.threads);
}

static PyObject *py_set_cpu_config(PyObject *module, PyObject *args) {
    fattn_cpu_config c;
    if (parse_cpu_config(args, &c)) return NULL;
    get_state(module)->cpu = c;
    Py_RETURN_NONE;
}

/* ---- run-time compilation and the tuned-config cache (fattn/_rtc.py, fattn/_tuned.py) ------------------- */

static PyObject *py_rtc_version(PyObject *module, PyObject *arg) {
    (void)module;
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path) return NULL;
    int major = 0, minor = 0;
    if (fattn_rtc_version(path, &major, &minor)) return raise_status();
    return Py_BuildValue("(ii)", major, minor);
}

/* rtc_compile(nvrtc_path, source, name, [options]) -> (cubin bytes, log); RuntimeError with the log on failure. */
static PyObject *py_rtc_compile(PyObject *module, PyObject *args) {
    (void)module;
    const char *path, *source, *name;
    PyObject *opts_o;
    if (!PyArg_ParseTuple(args, "sssO!:rtc_compile", &path, &source, &name, &PyList_Type, &opts_o)) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(opts_o);
    const char **opts = (const char **)PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (!opts) return PyErr_NoMemory();
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(opts[i] = PyUnicode_AsUTF8(PyList_GET_ITEM(opts_o, i)))) goto done;
    char *image = NULL, *log = NULL;
    size_t size = 0;
    fattn_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fattn_rtc_compile(path, source, name, opts, (int)n, &image, &size, &log);
    Py_END_ALLOW_THREADS
    if (st) PyErr_Format(PyExc_RuntimeError, "fattn: %s\n%s", fattn_last_error(), log ? log : "");
    else result = Py_BuildValue("(y#s)", image, (Py_ssize_t)size, log ? log : "");
    free(image);
    free(log);
done:
    PyMem_Free(opts);
    return result;
}

static int dtype_code(const char *name) {
    return !strcmp(name, "fp32") ? FATTN_F32 : !strcmp(name, "fp16") ? FATTN_F16 : !strcmp(name, "bf16") ? FATTN_BF16 : -1;
}

/* v2_add_rtc(cubin, func, dtype, dp, warps, mt, bc, stages) -> config index */
static PyObject *py_v2_add_rtc(PyObject *module, PyObject *args) {
    (void)module;
    const char *image, *func, *dtype;
    Py_ssize_t size;
    int dp, warps, mt, bc, stages;
    if (!PyArg_ParseTuple(args, "y#ssiiiii:v2_add_rtc", &image, &size, &func, &dtype, &dp, &warps, &mt, &bc, &stages))
        return NULL;
#ifdef FATTN_WITH_CUDA
    const v2_config cfg = {dp, warps, mt, bc, stages};
    int index = -1;
    if (fattn_v2_add_rtc(&cfg, dtype_code(dtype), image, (size_t)size, func, &index)) return raise_status();
    return PyLong_FromLong(index);
#else
    (void)image; (void)func; (void)dtype; (void)size;
    return not_built();
#endif
}

/* set_tuned(kind, device, dtype, head_dim, causal, seq_bucket, config): kind "v2" (config: an index, -1 clears) or
 * "cpu" (config: (br, bc, threads), or None to clear). */
static PyObject *py_set_tuned(PyObject *module, PyObject *args) {
    const char *kind, *dtype;
    int device, head_dim, causal, bucket;
    PyObject *config;
    if (!PyArg_ParseTuple(args, "sisiiiO:set_tuned", &kind, &device, &dtype, &head_dim, &causal, &bucket, &config))
        return NULL;
    const int dt = dtype_code(dtype);
    if (dt < 0 || head_dim < 8 || head_dim > FATTN_MAX_HEADDIM || head_dim % 8 || bucket < 0 || bucket >= FATTN_SEQ_BUCKETS) {
        PyErr_SetString(PyExc_ValueError, "tuned entry: dtype, head_dim or seq_bucket out of range");
        return NULL;
    }
    if (!strcmp(kind, "cpu")) {
        fattn_cpu_config c = {0, 0, 0};
        if (config != Py_None && parse_cpu_config(config, &c)) return NULL;
        get_state(module)->cpu_tuned[dt][head_dim / 8 - 1][causal != 0][bucket] = c;
        Py_RETURN_NONE;
    }
    if (strcmp(kind, "v2")) {
        PyErr_Format(PyExc_ValueError, "tuned entry: unknown kernel family '%s'", kind);
        return NULL;
    }
#ifdef FATTN_WITH_CUDA
    const long index = PyLong_AsLong(config);
    if (index == -1 && PyErr_Occurred()) return NULL;
    if (fattn_v2_set_tuned(device, dt, head_dim, causal, bucket, (int)index)) {
        PyErr_Format(PyExc_ValueError, "tuned entry: %s", fattn_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
#else
    return not_built();
#endif
}

static PyObject *py_clear_tuned(PyObject *module, PyObject *unused) {
    (void)unused;
    module_state *st = get_state(module);
    memset(st->cpu_tuned, 0, sizeof st->cpu_tuned);
#ifdef FATTN_WITH_CUDA
    fattn_v2_clear_tuned();
#endif
    Py_RETURN_NONE;
}

/* last_config() -> ("cpu", (br, bc, threads)), ("v2", index), ("v3", index) or (variant, -1): what the last forward()
 * ran (tests ask).  A v3 call whose tensors TMA cannot address runs v2 and reports v2's config. */
static PyObject *py_last_config(PyObject *module, PyObject *unused) {
    (void)unused;
    const module_state *st = get_state(module);
    if (!st->last_gpu) return Py_BuildValue("(s(iii))", "cpu", st->last_cpu.br, st->last_cpu.bc, st->last_cpu.threads);
#ifdef FATTN_WITH_CUDA
    const char *v = st->last_variant ? st->last_variant : "";
    if (!strcmp(v, "v3") && fattn_v3_last_config() >= 0) return Py_BuildValue("(si)", "v3", fattn_v3_last_config());
    if (!strcmp(v, "v2") || !strcmp(v, "v3")) return Py_BuildValue("(si)", "v2", fattn_v2_last_config());
    return Py_BuildValue("(si)", v, -1);
#else
    Py_RETURN_NONE;
#endif
}

/* v3's compiled configurations: [(index, dp, bc, stages, consumers, pingpong, default, smem_bytes)]. */
static PyObject *py_v3_configs(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    PyObject *list = PyList_New(0);
#ifdef FATTN_WITH_CUDA
    for (int i = 0; list && i < fattn_v3_config_count(); i++) {
        const v3_config *c = fattn_v3_config(i);
        int is_default = 1; /* the default of a head-dim bucket is its first entry */
        for (int j = 0; j < i; j++) is_default &= fattn_v3_config(j)->dp != c->dp;
        PyObject *row = Py_BuildValue("(iiiiiiOn)", i, c->dp, c->bc, c->stages, c->consumers, c->pingpong,
                                      is_default ? Py_True : Py_False, (Py_ssize_t)fattn_v3_config_smem(i));
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
#endif
    return list;
}

static PyObject *py_seq_bucket(PyObject *module, PyObject *args) {
    (void)module;
    long long sq, sk;
    if (!PyArg_ParseTuple(args, "LL:seq_bucket", &sq, &sk)) return NULL;
    return PyLong_FromLong(fattn_seq_bucket(sq, sk));
}

/* v2's compiled configurations: [(index, dp, warps, mt, bc, stages, active)], and selecting one. */
static PyObject *py_v2_configs(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    PyObject *list = PyList_New(0);
#ifdef FATTN_WITH_CUDA
    for (int i = 0; list && i < fattn_v2_config_count(); i++) {
        const v2_config *c = fattn_v2_config(i);
        const int bucket = c->dp <= 64 ? 0 : c->dp <= 128 ? 1 : 2;
        const int dt = fattn_v2_config_dtypes(i);
        PyObject *row = Py_BuildValue("(iiiiiiOOs)", i, c->dp, c->warps, c->mt, c->bc, c->stages,
                                      fattn_v2_active(bucket) == i ? Py_True : Py_False,
                                      fattn_v2_config_aot(i) ? Py_True : Py_False,
                                      dt == 3 ? "fp16,bf16" : dt == 1 ? "fp16" : "bf16");
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
#endif
    return list;
}

/* v2's V2_RULES: [(dp, warps, mt, bc, stages, causal, sk_min, sk_max)] in match order. */
static PyObject *py_v2_rules(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    PyObject *list = PyList_New(0);
#ifdef FATTN_WITH_CUDA
    for (int i = 0; list && i < fattn_v2_rule_count(); i++) {
        v2_config c;
        int causal;
        long long lo, hi;
        if (!fattn_v2_rule(i, &c, &causal, &lo, &hi)) break;
        PyObject *row = Py_BuildValue("(iiiiiOLL)", c.dp, c.warps, c.mt, c.bc, c.stages, causal ? Py_True : Py_False,
                                      lo, hi);
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
#endif
    return list;
}

static PyObject *py_v2_select(PyObject *module, PyObject *arg) {
    (void)module;
    const long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
#ifdef FATTN_WITH_CUDA
    if (fattn_v2_select((int)i)) {
        PyErr_Format(PyExc_ValueError, "config: %s", fattn_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
#else
    return not_built();
#endif
}

/* *n = arg as an integer in [lo, hi]; -1 with ValueError(msg) (or the conversion's error) set otherwise. */
static int long_in_range(PyObject *arg, long lo, long hi, const char *msg, long *n) {
    *n = PyLong_AsLong(arg);
    if (*n == -1 && PyErr_Occurred()) return -1;
    if (*n < lo || *n > hi) {
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    return 0;
}

/* v2_set_order(n) -> previous: v2's block order forced (1: head by head, 2: heads fastest), or 0 for v2's choice. */
static PyObject *py_v2_set_order(PyObject *module, PyObject *arg) {
    (void)module;
    long n;
    if (long_in_range(arg, 0, 2, "order: expected 0 (automatic), 1 (head by head) or 2 (heads fastest)", &n)) return NULL;
#ifdef FATTN_WITH_CUDA
    return PyLong_FromLong(fattn_v2_set_order((int)n));
#else
    return not_built();
#endif
}

/* v2_set_splits(n) -> previous: split-KV forced to n splits (n >= 1), or 0 to let the heuristic decide.
 * v2_last_splits() -> the key splits the last v2 launch used (1: none). */
static PyObject *py_v2_set_splits(PyObject *module, PyObject *arg) {
    (void)module;
    long n;
    if (long_in_range(arg, 0, 128, "splits: expected 0 (automatic) or 1 to 128", &n)) return NULL;
#ifdef FATTN_WITH_CUDA
    return PyLong_FromLong(fattn_v2_set_splits((int)n));
#else
    return not_built();
#endif
}

static PyObject *py_v2_last_splits(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
#ifdef FATTN_WITH_CUDA
    return PyLong_FromLong(fattn_v2_last_splits());
#else
    return PyLong_FromLong(0);
#endif
}

/* gemm_baseline(q, k, v, s, o, stream, cublas_path): the unfused two-GEMM baseline on contiguous (B, H, S, D)
 * fp16/bf16 arrays; s is a (B, H, Sq, Sk) scratch array of the same dtype. */
static PyObject *py_gemm_baseline(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "gemm_baseline(q, k, v, s, o, stream, cublas_path)");
        return NULL;
    }
    module_state *st = get_state(module);
    static const char *names[5] = {"q", "k", "v", "s", "out"};
    const char *path = PyUnicode_AsUTF8(args[6]);
    if (!path) return NULL;
    fattn_tensor ts[5];
    memset(ts, 0, sizeof ts);
    PyObject *result = NULL;
    for (int i = 0; i < 5; i++)
        if (take_arg(st, args[i], names[i], args[5], &ts[i])) goto done;
    fattn_tensor qkvo[4] = {ts[0], ts[1], ts[2], ts[4]};
    attn_params p;
    if (build_params(qkvo, 0, 0, 0, Py_None, &p)) goto done;
    if (p.dtype == FATTN_F32 || ts[0].t->device.device_type != kDLCUDA) {
        PyErr_SetString(PyExc_TypeError, "q: the gemm baseline takes float16 or bfloat16 CUDA arrays");
        goto done;
    }
    if (p.q_stride_s != p.d || p.q_stride_h != p.sq * p.d || p.k_stride_s != p.d || p.k_stride_h != p.sk * p.d ||
        p.v_stride_s != p.d || p.v_stride_h != p.sk * p.d || p.o_stride_s != p.d || p.o_stride_h != p.sq * p.d) {
        PyErr_SetString(PyExc_ValueError, "q: the gemm baseline needs contiguous (B, H, S, D) arrays");
        goto done;
    }
    void *stream = PyLong_AsVoidPtr(args[5]);
    if (PyErr_Occurred()) goto done;
    if (fattn_gemm_baseline(path, &p, (char *)ts[3].t->data + ts[3].t->byte_offset, stream)) { raise_status(); goto done; }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 5; i++) fattn_tensor_release(&ts[i]);
    return result;
}

/* register_torch(torch.Tensor, torch.float32, torch.float16, torch.bfloat16): enables the lean torch path. */
static PyObject *py_register_torch(PyObject *module, PyObject *args) {
    PyObject *type, *f32, *f16, *bf16;
    if (!PyArg_ParseTuple(args, "O!OOO:register_torch", &PyType_Type, &type, &f32, &f16, &bf16)) return NULL;
    fattn_names *n = &get_state(module)->names;
    Py_XSETREF(n->torch_type, Py_NewRef(type));
    Py_XSETREF(n->torch_dtypes[FATTN_F32], Py_NewRef(f32));
    Py_XSETREF(n->torch_dtypes[FATTN_F16], Py_NewRef(f16));
    Py_XSETREF(n->torch_dtypes[FATTN_BF16], Py_NewRef(bf16));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"gemm_baseline", (PyCFunction)(void (*)(void))py_gemm_baseline, METH_FASTCALL,
     "gemm_baseline(q, k, v, s, o, stream, cublas_path): unfused S = Q K^T, O = S V through cuBLAS."},
    {"register_torch", py_register_torch, METH_VARARGS, "register_torch(Tensor, float32, float16, bfloat16)."},
    {"v2_rules", py_v2_rules, METH_NOARGS,
     "[(dp, warps, mt, bc, stages, causal, sk_min, sk_max)]: v2's per-call overrides of a bucket's default, in match "
     "order."},
    {"v2_configs", py_v2_configs, METH_NOARGS,
     "[(index, dp, warps, mt, bc, stages, active, ahead_of_time, 'fp16,bf16')] of v2's configs (run-time ones last)."},
    {"time_forward", (PyCFunction)(void (*)(void))py_time_forward, METH_FASTCALL,
     "time_forward(q, k, v, out, lse, causal, scale, layout, variant, stream, config, reps, warmup, flush) -> "
     "(p50_us, p90_us, samples): the C timing harness."},
    {"rtc_version", py_rtc_version, METH_O, "rtc_version(nvrtc_path) -> (major, minor) of NVRTC."},
    {"rtc_compile", py_rtc_compile, METH_VARARGS, "rtc_compile(nvrtc_path, source, name, options) -> (cubin, log)."},
    {"v2_add_rtc", py_v2_add_rtc, METH_VARARGS,
     "v2_add_rtc(cubin, func, dtype, dp, warps, mt, bc, stages) -> index of a run-time compiled v2 config."},
    {"set_tuned", py_set_tuned, METH_VARARGS,
     "set_tuned(kind, device, dtype, head_dim, causal, seq_bucket, config): one tuned-config cache entry."},
    {"clear_tuned", py_clear_tuned, METH_NOARGS, "Forget every registered tuned config."},
    {"last_config", py_last_config, METH_NOARGS,
     "What the last forward() ran: (\"cpu\", (br, bc, threads)), (\"v2\", index), (\"v3\", index) or (variant, -1)."},
    {"seq_bucket", py_seq_bucket, METH_VARARGS, "seq_bucket(sq, sk) -> the tuned cache's sequence bucket."},
    {"v3_configs", py_v3_configs, METH_NOARGS,
     "[(index, dp, bc, stages, consumers, pingpong, default, smem_bytes)] of v3's compiled configs (sm_90 only)."},
    {"v2_select", py_v2_select, METH_O, "v2_select(index): use config `index` for its head-dim bucket."},
    {"v2_set_order", py_v2_set_order, METH_O,
     "v2_set_order(n) -> previous: force v2's block order (1 head by head, 2 heads fastest), or 0 for v2's choice."},
    {"v2_set_splits", py_v2_set_splits, METH_O,
     "v2_set_splits(n) -> previous: force n key splits (1 = off), or 0 for the automatic choice."},
    {"v2_last_splits", py_v2_last_splits, METH_NOARGS, "Key splits the last v2 launch used (1: none)."},
    {"forward", (PyCFunction)(void (*)(void))py_forward, METH_FASTCALL,
     "forward(q, k, v, out, lse, causal, scale, layout, variant, stream[, config]): attention into out (and lse)."},
    {"dlpack_device", py_dlpack_device, METH_O, "dlpack_device(array or capsule) -> (device_type, device_id)."},
    {"variants", (PyCFunction)(void (*)(void))py_variants, METH_FASTCALL,
     "variants(device_type, device_id): [(name, summary)] of the variants that run there."},
    {"all_gpu_variants", py_all_variants, METH_NOARGS, "[(name, summary, min_sm)] of every compiled GPU variant."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, "Number of CUDA devices; RuntimeError if none usable."},
    {"device_info", py_device_info, METH_O, "device_info(id) -> (name, compute capability, multiprocessors)."},
    {"cpu_config", py_cpu_config, METH_NOARGS, "The CPU backend's (br, bc, threads)."},
    {"set_cpu_config", py_set_cpu_config, METH_VARARGS, "set_cpu_config(br, bc, threads)."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module) {
    module_state *st = get_state(module);
    fattn_names *n = &st->names;
    n->s_dlpack = PyUnicode_InternFromString("__dlpack__");
    n->s_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    n->s_stream = PyUnicode_InternFromString("stream");
    n->s_max_version = PyUnicode_InternFromString("max_version");
    n->max_version = Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, 1);
    n->s_data_ptr = PyUnicode_InternFromString("data_ptr");
    n->s_shape = PyUnicode_InternFromString("shape");
    n->s_stride = PyUnicode_InternFromString("stride");
    n->s_dtype = PyUnicode_InternFromString("dtype");
    n->s_get_device = PyUnicode_InternFromString("get_device");
    if (!n->s_dlpack || !n->s_dlpack_device || !n->s_stream || !n->s_max_version || !n->max_version ||
        !n->s_data_ptr || !n->s_shape || !n->s_stride || !n->s_dtype || !n->s_get_device)
        return -1;
    st->cpu = fattn_cpu_default_config();
    if (PyModule_AddIntConstant(module, "cuda_compiled", fattn_gpu_compiled()) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    module_state *st = get_state(module);
    Py_VISIT(st->names.max_version);
    Py_VISIT(st->names.torch_type);
    for (int i = 0; i < 3; i++) Py_VISIT(st->names.torch_dtypes[i]);
    return 0;
}

static int module_clear(PyObject *module) {
    module_state *st = get_state(module);
    Py_CLEAR(st->names.s_dlpack);
    Py_CLEAR(st->names.s_dlpack_device);
    Py_CLEAR(st->names.s_stream);
    Py_CLEAR(st->names.s_max_version);
    Py_CLEAR(st->names.max_version);
    Py_CLEAR(st->names.s_data_ptr);
    Py_CLEAR(st->names.s_shape);
    Py_CLEAR(st->names.s_stride);
    Py_CLEAR(st->names.s_dtype);
    Py_CLEAR(st->names.s_get_device);
    Py_CLEAR(st->names.torch_type);
    for (int i = 0; i < 3; i++) Py_CLEAR(st->names.torch_dtypes[i]);
    return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fattn._C",
    .m_doc = "fattn's C extension: attention kernels (CPU and CUDA) behind a DLPack interface.",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
