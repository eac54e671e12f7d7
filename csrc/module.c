/* module.c -- fattn._C: module state, multi-phase init, the public method table, and the _dev namespace.
 *
 * Public (fattn/_api.py calls these):
 *   forward(q, k, v, out, lse=None, *, causal, scale, layout, window, variant, stream)   bind.c
 *   backward(dout, q, k, v, out, lse, dq, dk, dv, *, causal, scale, layout, window, variant, stream,
 *            deterministic, workspace)                                                  bind_bwd.c
 *   backward_workspace_bytes(b, h, sq, d, deterministic=False) -> bytes a GPU backward's workspace needs
 *                                                                      bind_bwd.c
 *   check_forward(...), check_backward(...): forward's / backward's arguments checked, nothing run (torch's fake
 *            kernels: fake and meta tensors)                                          bind.c, bind_bwd.c
 *   sinks(out, lse, sinks, *, layout, stream, dout, dsinks): attention sinks            bind_sinks.c
 *   dlpack_device(x) -> (device_type, device_id) of an array or a DLPack capsule
 *   variants(device_type, device_id) -> [(name, summary), ...]   the variants that run there
 *   cuda_device_count() -> int          RuntimeError when no driver / device can be used
 *   device_info(device_id) -> (name, compute capability, multiprocessors)
 *   register_torch(torch.Tensor, float32, float16, bfloat16, int32)   the lean torch path, once
 *   cuda_compiled                       1 if built with CUDA
 * Developer hooks (tests, bench, tuner) live in fattn._C._dev (dev.c).
 */
#include "module.h"

#include "variants.h"

/* ---- queries --------------------------------------------------------------------------------------------- */

static PyObject *py_dlpack_device(PyObject *module, PyObject *obj) {
    int type = 0, id = 0;
    if (!fattn_dlpack_device(&fattn_state(module)->names, obj, "q", &type, &id)) return NULL;
    return Py_BuildValue("(ii)", type, id);
}

static PyObject *py_longest_sequence(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "longest_sequence(cu_seqlens, stream=None, name='cu_seqlens')");
        return NULL;
    }
    module_state *st = fattn_state(module);
    if (fattn_find_torch(&st->names)) return NULL;
    void *stream = NULL;
    PyObject *stream_obj = nargs > 1 ? args[1] : Py_None;
    const char *name = nargs > 2 ? PyUnicode_AsUTF8(args[2]) : "cu_seqlens"; /* the caller's argument name */
    if (!name || fattn_arg_stream(stream_obj, &stream)) return NULL;
    fattn_tensor t;
    memset(&t, 0, sizeof t);
    int64_t longest = 0;
    const int rc = fattn_take(&st->names, args[0], name, stream_obj, &t) ||
                   fattn_longest_sequence(&t, &longest, stream);
    fattn_tensor_release(&t);
    return rc ? NULL : PyLong_FromLongLong(longest);
}

static PyObject *py_cuda_device_count(PyObject *module, PyObject *unused) {
    (void)module; (void)unused;
    int n = 0;
    if (fattn_gpu_device_count(&n)) return fattn_raise_status();
    return PyLong_FromLong(n);
}

static PyObject *py_device_info(PyObject *module, PyObject *arg) {
    (void)module;
    long id = 0;
    if (fattn_arg_long(arg, "device", 0, 1 << 16, &id)) return NULL;
    fattn_device dev;
    char name[256] = "";
    if (fattn_gpu_device((int)id, &dev, name, sizeof name)) return fattn_raise_status();
    return Py_BuildValue("(sii)", name, dev.sm, dev.sm_count);
}

static PyObject *py_variants(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "variants(device_type, device_id)");
        return NULL;
    }
    const char *type = PyUnicode_AsUTF8(args[0]);
    long id = 0;
    if (!type || fattn_arg_long(args[1], "device", 0, 1 << 16, &id)) return NULL;
    if (!strcmp(type, "cpu")) return Py_BuildValue("[(ss)]", "cpu", "tiled flash attention in C, OpenMP over (b, h, q-block)");
    if (strcmp(type, "cuda")) {
        PyErr_Format(PyExc_ValueError, "device: unknown device type '%s'", type);
        return NULL;
    }
    if (!fattn_gpu_compiled()) return fattn_not_built();
    fattn_device dev;
    if (fattn_gpu_device((int)id, &dev, NULL, 0)) return fattn_raise_status();
    PyObject *list = PyList_New(0);
    for (const fattn_variant *v = fattn_gpu_variants; list && v->name; v++) {
        if (!fattn_variant_runs_on(v, dev.sm)) continue;
        PyObject *row = Py_BuildValue("(ss)", v->name, v->summary);
        if (!row || PyList_Append(list, row) < 0) Py_CLEAR(list);
        Py_XDECREF(row);
    }
    return list;
}

/* register_torch(torch.Tensor, torch.float32, torch.float16, torch.bfloat16, torch.int32): enables the lean torch
 * path. */
static PyObject *py_register_torch(PyObject *module, PyObject *args) {
    PyObject *type, *f32, *f16, *bf16, *i32;
    if (!PyArg_ParseTuple(args, "OOOOO:register_torch", &type, &f32, &f16, &bf16, &i32)) return NULL;
    if (fattn_register_torch(&fattn_state(module)->names, type, f32, f16, bf16, i32)) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))fattn_py_forward, METH_FASTCALL | METH_KEYWORDS,
     "forward(q, k, v, out, lse=None, *, causal=0, scale=None, layout=0, window=None, variant=None, stream=None): "
     "attention into out (and lse)."},
    {"backward", (PyCFunction)(void (*)(void))fattn_py_backward, METH_FASTCALL | METH_KEYWORDS,
     "backward(dout, q, k, v, out, lse, dq, dk, dv, *, causal=0, scale=None, layout=0, window=None, variant=None, "
     "stream=None, deterministic=False, workspace=None, softcap=0, cu_seqlens_q=None, cu_seqlens_k=None, "
     "max_seqlen_q=None, max_seqlen_k=None, alibi_slopes=None, check_indices=True, sinks=None, dsinks=None): dq, dk, "
     "dv (and dsinks) of the forward call that gave out and lse."},
    {"check_forward", (PyCFunction)(void (*)(void))fattn_py_check_forward, METH_FASTCALL | METH_KEYWORDS,
     "check_forward(<forward's arguments>): raises as forward() would for them, runs nothing; torch tensors may be "
     "fake or meta (described by shape, strides, dtype and device; index arrays are not read)."},
    {"check_backward", (PyCFunction)(void (*)(void))fattn_py_check_backward, METH_FASTCALL | METH_KEYWORDS,
     "check_backward(<backward's arguments>): raises as backward() would for them, runs nothing; torch tensors may "
     "be fake or meta."},
    {"sinks", (PyCFunction)(void (*)(void))fattn_py_sinks, METH_FASTCALL | METH_KEYWORDS,
     "sinks(out, lse, sinks, *, layout=0, stream=None, dout=None, dsinks=None): attention sinks applied to a "
     "forward's out and lse in place, or (with dout, dsinks) their gradient."},
    {"backward_workspace_bytes", (PyCFunction)(void (*)(void))fattn_py_backward_workspace_bytes, METH_FASTCALL,
     "backward_workspace_bytes(b, h, sq, d, deterministic=False) -> bytes of workspace a GPU backward needs."},
    {"dlpack_device", py_dlpack_device, METH_O, "dlpack_device(array or capsule) -> (device_type, device_id)."},
    {"longest_sequence", (PyCFunction)(void (*)(void))py_longest_sequence, METH_FASTCALL,
     "longest_sequence(cu_seqlens, stream=None, name='cu_seqlens') -> the longest sequence of int32 prefix sums "
     "(checked; errors name the array `name`)."},
    {"variants", (PyCFunction)(void (*)(void))py_variants, METH_FASTCALL,
     "variants(device_type, device_id): [(name, summary)] of the variants that run there."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS, "Number of CUDA devices; RuntimeError if none usable."},
    {"device_info", py_device_info, METH_O, "device_info(id) -> (name, compute capability, multiprocessors)."},
    {"register_torch", py_register_torch, METH_VARARGS, "register_torch(Tensor, float32, float16, bfloat16)."},
    {NULL, NULL, 0, NULL},
};

/* ---- state and init -------------------------------------------------------------------------------------- */

/* fattn._C._dev: the developer hooks, bound to this module (their self is fattn._C, whose state they read). */
static int add_dev_namespace(PyObject *module) {
    PyObject *dev = PyModule_New("fattn._C._dev");
    if (!dev) return -1;
    int rc = PyModule_AddStringConstant(dev, "__doc__", "fattn's developer hooks: plans, overrides, config tables, "
                                                          "run-time compilation, the tuned table (tests, bench, tuner).");
    for (PyMethodDef *m = fattn_dev_methods; !rc && m->ml_name; m++) {
        PyObject *f = PyCFunction_NewEx(m, module, NULL);
        rc = f ? PyModule_AddObjectRef(dev, m->ml_name, f) : -1;
        Py_XDECREF(f);
    }
    if (!rc) rc = PyModule_AddObjectRef(module, "_dev", dev);
    Py_DECREF(dev);
    return rc;
}

static int module_exec(PyObject *module) {
    module_state *st = fattn_state(module);
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
    n->s_is_cuda = PyUnicode_InternFromString("is_cuda");
    n->s_torch = PyUnicode_InternFromString("torch");
    if (!n->s_dlpack || !n->s_dlpack_device || !n->s_stream || !n->s_max_version || !n->max_version ||
        !n->s_data_ptr || !n->s_shape || !n->s_stride || !n->s_dtype || !n->s_get_device || !n->s_is_cuda ||
        !n->s_torch)
        return -1;
    for (int i = 0; i < FATTN_FORWARD_ARGS; i++)
        if (!(st->forward_args[i] = PyUnicode_InternFromString(fattn_forward_arg_names[i]))) return -1;
    for (int i = 0; i < FATTN_BACKWARD_ARGS; i++)
        if (!(st->backward_args[i] = PyUnicode_InternFromString(fattn_backward_arg_names[i]))) return -1;
    st->tuned.n = 0;
    if (PyModule_AddIntConstant(module, "cuda_compiled", fattn_gpu_compiled()) < 0) return -1;
    return add_dev_namespace(module);
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    module_state *st = fattn_state(module);
    Py_VISIT(st->names.max_version);
    Py_VISIT(st->names.torch_type);
    for (int i = 0; i < 3; i++) Py_VISIT(st->names.torch_dtypes[i]);
    Py_VISIT(st->names.torch_int32);
    return 0;
}

static int module_clear(PyObject *module) {
    module_state *st = fattn_state(module);
    fattn_names *n = &st->names;
    Py_CLEAR(n->s_dlpack);
    Py_CLEAR(n->s_dlpack_device);
    Py_CLEAR(n->s_stream);
    Py_CLEAR(n->s_max_version);
    Py_CLEAR(n->max_version);
    Py_CLEAR(n->s_data_ptr);
    Py_CLEAR(n->s_shape);
    Py_CLEAR(n->s_stride);
    Py_CLEAR(n->s_dtype);
    Py_CLEAR(n->s_get_device);
    Py_CLEAR(n->s_is_cuda);
    Py_CLEAR(n->s_torch);
    for (int i = 0; i < FATTN_FORWARD_ARGS; i++) Py_CLEAR(st->forward_args[i]);
    for (int i = 0; i < FATTN_BACKWARD_ARGS; i++) Py_CLEAR(st->backward_args[i]);
    Py_CLEAR(n->torch_type);
    for (int i = 0; i < 3; i++) Py_CLEAR(n->torch_dtypes[i]);
    Py_CLEAR(n->torch_int32);
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
