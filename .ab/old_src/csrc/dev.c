/* dev.c -- fattn._C._dev: developer hooks for tests, benchmarks and the tuner.  Nothing here is public API.
 *
 *   forward(...) / plan(...)            bind.c: a call with overrides, returning the plan that ran / would run
 *   variant_table()                     [(name, family, file, summary, min_sm, max_sm)] of every GPU variant
 *   configs(variant)                    [{index, role, dtypes, smem, <fields>}] of a variant's configs
 *   check_config(variant, fields, head_dim, dtype, smem_limit) -> reason or None: whether it can run (keep())
 *   add_rtc(variant, fields, dtype, cubin, func) -> config index of a kernel compiled at run time
 *   rtc_version(nvrtc_path), rtc_compile(nvrtc_path, source, name, options) -> (cubin, log)
 *   tuned_set(variant, device, dtype, head_dim, causal, bucket, config), tuned_clear()
 *   seq_bucket(sq, sk), head_dim_bucket(d)
 *   gemm_baseline(q, k, v, s, out, stream, cublas_path)
 */
#include <math.h>
#include <stdlib.h>

#include "cpu_attn.h"
#include "gemm_baseline.h"
#include "module.h"
#include "rtc.h"
#include "variants.h"

static int dtype_code(const char *name) {
    return !strcmp(name, "fp32") ? FATTN_F32 : !strcmp(name, "fp16") ? FATTN_F16 : !strcmp(name, "bf16") ? FATTN_BF16 : -1;
}

static int parse_dtype(const char *name) {
    const int dt = dtype_code(name);
    if (dt < 0) PyErr_Format(PyExc_ValueError, "dtype: expected 'fp32', 'fp16' or 'bf16', got '%s'", name);
    return dt;
}

static const fattn_variant *variant_named(const char *name) {
    const fattn_variant *v = fattn_find_variant(name);
    if (!v) PyErr_Format(PyExc_ValueError, "variant: unknown GPU variant '%s'", name);
    return v;
}

/* A config's fields from a tuple of ints into values[] (at most FATTN_CONFIG_FIELDS). */
static int fields_of(PyObject *t, int64_t *values, int *n) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) > FATTN_CONFIG_FIELDS) {
        PyErr_Format(PyExc_TypeError, "config: expected a tuple of at most %d ints", FATTN_CONFIG_FIELDS);
        return -1;
    }
    *n = (int)PyTuple_GET_SIZE(t);
    for (int i = 0; i < *n; i++) {
        values[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (values[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *dev_variant_table(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    PyObject *list = PyList_New(0);
    for (const fattn_variant *v = fattn_gpu_variants; list && v->name; v++) {
        PyObject *row = Py_BuildValue("(ssssii)", v->name, v->family, v->file, v->summary, v->min_sm, v->max_sm);
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
    return list;
}

static PyObject *dev_bwd_variant_table(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    PyObject *list = PyList_New(0);
    for (const fattn_bwd_variant *v = fattn_gpu_bwd_variants; list && v->name; v++) {
        PyObject *of = PyList_New(0); /* the forward variants it differentiates */
        for (const fattn_variant *f = fattn_gpu_variants; of && f->name; f++)
            if (!strcmp(f->bwd, v->name)) {
                PyObject *s = PyUnicode_FromString(f->name);
                if (!s || PyList_Append(of, s) < 0) Py_CLEAR(of);
                Py_XDECREF(s);
            }
        PyObject *row = of ? Py_BuildValue("(ssssiiN)", v->name, v->family, v->file, v->summary, v->min_sm, v->max_sm,
                                           of) : NULL;
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
    return list;
}

static PyObject *config_dict(int i, const fattn_config_info *c) {
    PyObject *d = Py_BuildValue("{sisssn}", "index", i, "role", c->role, "smem", (Py_ssize_t)c->smem);
    PyObject *dts = d ? PyList_New(0) : NULL;
    static const char *dt_names[3] = {"fp32", "fp16", "bf16"};
    for (int t = 0; dts && t < 3; t++)
        if (c->dtypes >> t & 1) {
            PyObject *s = PyUnicode_FromString(dt_names[t]);
            if (!s || PyList_Append(dts, s) < 0) Py_CLEAR(dts);
            Py_XDECREF(s);
        }
    if (!dts || PyDict_SetItemString(d, "dtypes", dts) < 0) Py_CLEAR(d);
    Py_XDECREF(dts);
    for (int k = 0; d && k < c->n; k++) {
        PyObject *x = PyLong_FromLongLong(c->values[k]);
        if (!x || PyDict_SetItemString(d, c->names[k], x) < 0) Py_CLEAR(d);
        Py_XDECREF(x);
    }
    return d;
}

static PyObject *dev_configs(PyObject *module, PyObject *arg) {
    (void)module;
    const char *name = PyUnicode_AsUTF8(arg);
    const fattn_variant *v = name ? variant_named(name) : NULL;
    if (!v) return NULL;
    PyObject *list = PyList_New(0);
    fattn_config_info c;
    for (int i = 0; list && v->configs(i, &c); i++) {
        if (!strcmp(c.role, "other")) continue;
        PyObject *d = config_dict(i, &c);
        if (!d || PyList_Append(list, d) < 0) Py_CLEAR(list);
        Py_XDECREF(d);
    }
    return list;
}

/* check_config(variant, fields, head_dim, dtype, smem_limit) -> None if the config can run, else the reason. */
static PyObject *dev_check_config(PyObject *module, PyObject *args) {
    (void)module;
    const char *name, *dtype;
    PyObject *fields;
    int d;
    Py_ssize_t smem_limit;
    if (!PyArg_ParseTuple(args, "sO!isn:check_config", &name, &PyTuple_Type, &fields, &d, &dtype, &smem_limit))
        return NULL;
    const int dt = parse_dtype(dtype);
    if (dt < 0) return NULL;
    fattn_status st;
    if (!strcmp(name, "cpu")) {
        int br = 0, bc = 0, threads = 0;
        if (!PyArg_ParseTuple(fields, "iii", &br, &bc, &threads)) return NULL;
        const fattn_cpu_config c = {br, bc, threads};
        st = fattn_cpu_check_config(&c);
    } else {
        const fattn_variant *v = variant_named(name);
        int64_t values[FATTN_CONFIG_FIELDS];
        int n = 0;
        if (!v || fields_of(fields, values, &n)) return NULL;
        st = v->check_config(values, n, d, dt, (size_t)smem_limit);
    }
    if (st == FATTN_OK) Py_RETURN_NONE;
    const char *msg = fattn_last_error(), *colon = strstr(msg, ": "); /* drop "file:line: " */
    return PyUnicode_FromString(colon ? colon + 2 : msg);
}

/* add_rtc(variant, fields, dtype, cubin, func) -> the config index of a kernel compiled at run time. */
static PyObject *dev_add_rtc(PyObject *module, PyObject *args) {
    (void)module;
    const char *name, *dtype, *image, *func;
    Py_ssize_t size;
    PyObject *fields;
    if (!PyArg_ParseTuple(args, "sO!sy#s:add_rtc", &name, &PyTuple_Type, &fields, &dtype, &image, &size, &func))
        return NULL;
    const fattn_variant *v = variant_named(name);
    const int dt = parse_dtype(dtype);
    int64_t values[FATTN_CONFIG_FIELDS];
    int n = 0;
    if (!v || dt < 0 || fields_of(fields, values, &n)) return NULL;
    int aot = 0; /* the variant's configs before its run-time ones */
    fattn_config_info c;
    while (v->configs(aot, &c) && strcmp(c.role, "runtime") && strcmp(c.role, "other")) aot++;
    fattn_rtc_kernel *k = fattn_rtc_kernel_new(image, (size_t)size, func);
    if (!k) return PyErr_NoMemory();
    int index = -1;
    if (fattn_rtc_register(v->name, values, n, dt, k, &index)) return fattn_raise_status(); /* k: leaked, host only */
    return PyLong_FromLong(aot + index);
}

static PyObject *dev_rtc_version(PyObject *module, PyObject *arg) {
    (void)module;
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path) return NULL;
    int major = 0, minor = 0;
    if (fattn_rtc_version(path, &major, &minor)) return fattn_raise_status();
    return Py_BuildValue("(ii)", major, minor);
}

/* rtc_compile(nvrtc_path, source, name, [options]) -> (cubin bytes, log); RuntimeError with the log on failure. */
static PyObject *dev_rtc_compile(PyObject *module, PyObject *args) {
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

/* tuned_set(variant, device, dtype, head_dim, causal, bucket, config): variant "cpu" takes (br, bc, threads), a
 * GPU variant a config index (checked against its table). */
static PyObject *dev_tuned_set(PyObject *module, PyObject *args) {
    const char *name, *dtype;
    int device, head_dim, causal, bucket;
    PyObject *config;
    if (!PyArg_ParseTuple(args, "sisiiiO:tuned_set", &name, &device, &dtype, &head_dim, &causal, &bucket, &config))
        return NULL;
    fattn_tuned_entry e;
    memset(&e, 0, sizeof e);
    e.device = device;
    e.head_dim = head_dim;
    e.causal = causal != 0;
    e.bucket = bucket;
    if ((e.dtype = parse_dtype(dtype)) < 0) return NULL;
    if (!strcmp(name, "cpu")) {
        e.variant = FATTN_TUNED_CPU;
        if (!PyArg_ParseTuple(config, "iii", &e.cpu.br, &e.cpu.bc, &e.cpu.threads)) return NULL;
        if (fattn_cpu_check_config(&e.cpu)) {
            PyErr_Format(PyExc_ValueError, "tuned entry: %s", fattn_last_error());
            return NULL;
        }
    } else {
        const fattn_variant *v = variant_named(name);
        if (!v) return NULL;
        e.variant = (int)(v - fattn_gpu_variants);
        long idx = 0;
        fattn_config_info c;
        if (fattn_arg_long(config, "config", 0, 1 << 20, &idx)) return NULL;
        if (!v->configs((int)idx, &c) || !(c.dtypes >> e.dtype & 1) || (c.n && c.values[0] < head_dim)) {
            PyErr_Format(PyExc_ValueError, "tuned entry: %s config %ld cannot run head dim %d in %s", name, idx, head_dim,
                         dtype);
            return NULL;
        }
        e.config = (int)idx;
    }
    if (fattn_tuned_set(&fattn_state(module)->tuned, &e)) {
        PyErr_Format(PyExc_ValueError, "%s", fattn_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *dev_tuned_clear(PyObject *module, PyObject *unused) {
    (void)unused;
    fattn_state(module)->tuned.n = 0;
    Py_RETURN_NONE;
}

static PyObject *dev_seq_bucket(PyObject *module, PyObject *args) {
    (void)module;
    long long sq, sk;
    if (!PyArg_ParseTuple(args, "LL:seq_bucket", &sq, &sk)) return NULL;
    return PyLong_FromLong(fattn_seq_bucket(sq, sk));
}

static PyObject *dev_head_dim_bucket(PyObject *module, PyObject *arg) {
    (void)module;
    long d = 0;
    if (fattn_arg_long(arg, "head_dim", 1, FATTN_MAX_HEADDIM, &d)) return NULL;
    return PyLong_FromLong(fattn_head_dim_bucket(d));
}

/* gemm_baseline(q, k, v, s, out, stream, cublas_path): the unfused two-GEMM baseline on contiguous (B, H, S, D)
 * fp16/bf16 arrays; s is a (B, H, Sq, Sk) scratch array of the same dtype. */
static PyObject *dev_gemm_baseline(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "gemm_baseline(q, k, v, s, out, stream, cublas_path)");
        return NULL;
    }
    module_state *st = fattn_state(module);
    static const char *names[5] = {"q", "k", "v", "s", "out"};
    const char *path = PyUnicode_AsUTF8(args[6]);
    if (!path) return NULL;
    fattn_tensor ts[5];
    memset(ts, 0, sizeof ts);
    PyObject *result = NULL;
    void *stream = NULL;
    if (fattn_find_torch(&st->names)) goto done;
    for (int i = 0; i < 5; i++)
        if (fattn_take(&st->names, args[i], names[i], args[5], &ts[i])) goto done;
    fattn_tensor qkvo[5] = {ts[0], ts[1], ts[2], ts[4], {0}};
    const fattn_call_opts o = {0, 0, -1, -1, NAN, 0, 0.0, NULL, NULL, NULL, -1, -1};
    attn_params p;
    if (fattn_build_params(qkvo, &o, &p, NULL)) goto done;
    if (p.dtype == FATTN_F32 || ts[0].t->device.device_type != kDLCUDA) {
        PyErr_SetString(PyExc_TypeError, "q: the gemm baseline takes float16 or bfloat16 CUDA arrays");
        goto done;
    }
    if (p.q_stride_s != p.d || p.q_stride_h != p.sq * p.d || p.k_stride_s != p.d || p.k_stride_h != p.sk * p.d ||
        p.v_stride_s != p.d || p.v_stride_h != p.sk * p.d || p.o_stride_s != p.d || p.o_stride_h != p.sq * p.d) {
        PyErr_SetString(PyExc_ValueError, "q: the gemm baseline needs contiguous (B, H, S, D) arrays");
        goto done;
    }
    if (fattn_arg_stream(args[5], &stream)) goto done;
    if (fattn_gemm_baseline(path, &p, (char *)ts[3].t->data + ts[3].t->byte_offset, stream)) {
        fattn_raise_status();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < 5; i++) fattn_tensor_release(&ts[i]);
    return result;
}

#define FASTKW (METH_FASTCALL | METH_KEYWORDS)
PyMethodDef fattn_dev_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))fattn_dev_forward, FASTKW,
     "forward(q, k, v, out, lse=None, *, ..., config=None, splits=0, order=0) -> the plan that ran (dict)."},
    {"plan", (PyCFunction)(void (*)(void))fattn_dev_plan, FASTKW, "plan(...): the plan forward(...) would run."},
    {"backward", (PyCFunction)(void (*)(void))fattn_dev_backward, FASTKW,
     "backward(dout, q, k, v, out, lse, dq, dk, dv, *, ..., config=None) -> the plan that ran (dict)."},
    {"plan_backward", (PyCFunction)(void (*)(void))fattn_dev_plan_backward, FASTKW,
     "plan_backward(...): the plan backward(...) would run."},
    {"variant_table", dev_variant_table, METH_NOARGS,
     "[(name, family, file, summary, min_sm, max_sm)] of every GPU variant."},
    {"bwd_variant_table", dev_bwd_variant_table, METH_NOARGS,
     "[(name, family, file, summary, min_sm, max_sm, [forward variants it differentiates])] of every GPU backward."},
    {"configs", dev_configs, METH_O, "configs(variant) -> [{index, role, dtypes, smem, <fields>}]."},
    {"check_config", dev_check_config, METH_VARARGS,
     "check_config(variant, fields, head_dim, dtype, smem_limit) -> None if it can run, else the reason."},
    {"add_rtc", dev_add_rtc, METH_VARARGS, "add_rtc(variant, fields, dtype, cubin, func) -> config index."},
    {"rtc_version", dev_rtc_version, METH_O, "rtc_version(nvrtc_path) -> (major, minor) of NVRTC."},
    {"rtc_compile", dev_rtc_compile, METH_VARARGS, "rtc_compile(nvrtc_path, source, name, options) -> (cubin, log)."},
    {"tuned_set", dev_tuned_set, METH_VARARGS,
     "tuned_set(variant, device, dtype, head_dim, causal, bucket, config): one tuned-config table entry."},
    {"tuned_clear", dev_tuned_clear, METH_NOARGS, "Forget every registered tuned config."},
    {"seq_bucket", dev_seq_bucket, METH_VARARGS, "seq_bucket(sq, sk) -> the tuned table's sequence bucket."},
    {"head_dim_bucket", dev_head_dim_bucket, METH_O, "head_dim_bucket(d) -> 64, 128 or 256."},
    {"gemm_baseline", (PyCFunction)(void (*)(void))dev_gemm_baseline, METH_FASTCALL,
     "gemm_baseline(q, k, v, s, out, stream, cublas_path): unfused S = Q K^T, O = S V through cuBLAS."},
    {NULL, NULL, 0, NULL},
};
