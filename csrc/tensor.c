/* tensor.c -- DLPack intake: versioned capsule first, legacy capsule as a fallback.
 *
 * A consumer that takes a capsule renames it to "used_*" and from then on owns the managed tensor: it must call
 * the producer's deleter exactly once.  A capsule that was never renamed is cleaned up by its own destructor,
 * which is what happens on every error path before the rename. */
#include "tensor.h"

static const char *device_name(int type) {
    switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed";
    default: return "unknown";
    }
}

int fattn_dlpack_device(const fattn_names *n, PyObject *obj, const char *arg, int *type, int *id) {
    DLTensor *t = NULL;
    if (PyCapsule_IsValid(obj, "dltensor_versioned"))
        t = &((DLManagedTensorVersioned *)PyCapsule_GetPointer(obj, "dltensor_versioned"))->dl_tensor;
    else if (PyCapsule_IsValid(obj, "dltensor"))
        t = &((DLManagedTensor *)PyCapsule_GetPointer(obj, "dltensor"))->dl_tensor;
    if (t) {
        *type = t->device.device_type;
        *id = t->device.device_id;
    } else if (PyCapsule_CheckExact(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: not a DLPack capsule (or one already consumed)", arg);
        return 0;
    } else {
        PyObject *dev = PyObject_CallMethodNoArgs(obj, n->s_dlpack_device);
        if (!dev) {
            if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "%s: expected an array supporting DLPack (__dlpack__), got %.200s", arg,
                             Py_TYPE(obj)->tp_name);
            }
            return 0;
        }
        int ok = PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2;
        if (ok) {
            *type = (int)PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
            *id = (int)PyLong_AsLong(PyTuple_GET_ITEM(dev, 1));
            ok = !PyErr_Occurred();
        }
        Py_DECREF(dev);
        if (!ok) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: __dlpack_device__() did not return a (type, id) tuple", arg);
            return 0;
        }
    }
    if (*type != kDLCPU && *type != kDLCUDA && *type != kDLCUDAHost) {
        PyErr_Format(PyExc_ValueError, "%s: arrays on device type %d (%s) are not supported; use cpu or cuda", arg,
                     *type, device_name(*type));
        return 0;
    }
    return 1;
}

static PyObject *call_dlpack(const fattn_names *n, PyObject *obj, const char *arg, PyObject *stream) {
    PyObject *method = PyObject_GetAttr(obj, n->s_dlpack);
    if (!method) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected an array supporting DLPack (__dlpack__), got %.200s", arg,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyObject *kw = Py_BuildValue("{OOOO}", n->s_stream, stream, n->s_max_version, n->max_version);
    PyObject *empty = PyTuple_New(0), *capsule = NULL;
    if (kw && empty) {
        capsule = PyObject_Call(method, empty, kw);
        if (!capsule && PyErr_ExceptionMatches(PyExc_TypeError)) { /* producer predates max_version */
            PyErr_Clear();
            PyDict_DelItem(kw, n->s_max_version);
            capsule = PyObject_Call(method, empty, kw);
        }
    }
    Py_XDECREF(kw);
    Py_XDECREF(empty);
    Py_DECREF(method);
    if (!capsule && PyErr_ExceptionMatches(PyExc_BufferError)) { /* the producer cannot export it: its dtype (NumPy's
                                                                    bfloat16, object), byte order or memory */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(PyExc_TypeError, "%s: this %.200s cannot be passed through DLPack (its library says: %S)", arg,
                     Py_TYPE(obj)->tp_name, value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    return capsule;
}

int fattn_tensor_take(const fattn_names *n, PyObject *obj, const char *arg, PyObject *stream, fattn_tensor *out) {
    memset(out, 0, sizeof *out);
    out->arg = arg;
    PyObject *capsule;
    if (PyCapsule_CheckExact(obj)) {
        capsule = Py_NewRef(obj);
    } else {
        capsule = call_dlpack(n, obj, arg, stream);
        if (!capsule) return -1;
    }
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (m->version.major != DLPACK_MAJOR_VERSION) {
            PyErr_Format(PyExc_TypeError, "%s: DLPack version %u.%u is not supported (fattn reads %d.x)", arg,
                         m->version.major, m->version.minor, DLPACK_MAJOR_VERSION);
            Py_DECREF(capsule);
            return -1;
        }
        if (PyCapsule_SetName(capsule, "used_dltensor_versioned") < 0) { Py_DECREF(capsule); return -1; }
        out->versioned = m;
        out->t = &m->dl_tensor;
        out->readonly = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    } else if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
        if (PyCapsule_SetName(capsule, "used_dltensor") < 0) { Py_DECREF(capsule); return -1; }
        out->legacy = m;
        out->t = &m->dl_tensor;
    } else {
        PyErr_Format(PyExc_TypeError, "%s: not a DLPack capsule (or one already consumed)", arg);
        Py_DECREF(capsule);
        return -1;
    }
    out->capsule = capsule;
    return 0;
}

int fattn_register_torch(fattn_names *n, PyObject *tensor_type, PyObject *f32, PyObject *f16, PyObject *bf16,
                         PyObject *i32) {
    if (!PyType_Check(tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "register_torch: expected torch.Tensor");
        return -1;
    }
    Py_XSETREF(n->torch_type, Py_NewRef(tensor_type));
    Py_XSETREF(n->torch_dtypes[FATTN_F32], Py_NewRef(f32));
    Py_XSETREF(n->torch_dtypes[FATTN_F16], Py_NewRef(f16));
    Py_XSETREF(n->torch_dtypes[FATTN_BF16], Py_NewRef(bf16));
    Py_XSETREF(n->torch_int32, Py_NewRef(i32));
    return 0;
}

int fattn_find_torch(fattn_names *n) {
    if (n->torch_type) return 0;
    PyObject *torch = PyImport_GetModule(n->s_torch); /* new reference, or NULL: not imported */
    if (!torch) return PyErr_Occurred() ? -1 : 0;
    PyObject *t = PyObject_GetAttrString(torch, "Tensor"), *f32 = PyObject_GetAttrString(torch, "float32");
    PyObject *f16 = PyObject_GetAttrString(torch, "float16"), *bf16 = PyObject_GetAttrString(torch, "bfloat16");
    PyObject *i32 = PyObject_GetAttrString(torch, "int32");
    Py_DECREF(torch);
    int rc = 0;
    if (t && f32 && f16 && bf16 && i32) rc = fattn_register_torch(n, t, f32, f16, bf16, i32);
    else PyErr_Clear(); /* a partly imported or foreign "torch": the DLPack path still works */
    Py_XDECREF(t);
    Py_XDECREF(f32);
    Py_XDECREF(f16);
    Py_XDECREF(bf16);
    Py_XDECREF(i32);
    return rc;
}

int fattn_is_torch(const fattn_names *n, PyObject *obj) {
    return n->torch_type && PyObject_TypeCheck(obj, (PyTypeObject *)n->torch_type);
}

/* A tuple of ints (torch.Size or the stride() tuple) into dst; returns its length, or -1 if not ints. */
static int int_tuple(PyObject *tup, int64_t *dst) {
    if (!tup || !PyTuple_Check(tup) || PyTuple_GET_SIZE(tup) > FATTN_MAX_NDIM) return -1;
    const int n = (int)PyTuple_GET_SIZE(tup);
    for (int i = 0; i < n; i++) {
        dst[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tup, i));
        if (dst[i] == -1 && PyErr_Occurred()) return -1;
    }
    return n;
}

/* 1 if torch tensor obj, which has a device index, is on a CUDA device; else 0 with a ValueError naming its device
 * (mps, xpu: torch gives their tensors an index too). */
static int on_cuda(const fattn_names *n, PyObject *obj, const char *arg) {
    PyObject *c = PyObject_GetAttr(obj, n->s_is_cuda);
    const int yes = c ? PyObject_IsTrue(c) : -1;
    Py_XDECREF(c);
    if (yes > 0) return 1;
    if (yes == 0) {
        PyObject *d = PyObject_GetAttrString(obj, "device");
        if (d) PyErr_Format(PyExc_ValueError, "%s: on %S; fattn takes cpu or cuda arrays", arg, d);
        Py_XDECREF(d);
    }
    return 0;
}

int fattn_tensor_from_torch(const fattn_names *n, PyObject *obj, const char *arg, fattn_tensor *out) {
    memset(out, 0, sizeof *out);
    out->arg = arg;
    DLTensor *t = &out->local;
    PyObject *dtype = PyObject_GetAttr(obj, n->s_dtype);
    if (!dtype) return -1;
    int dt = -1, i32 = dtype == n->torch_int32;
    for (int i = 0; i < 3; i++)
        if (dtype == n->torch_dtypes[i]) dt = i;
    Py_DECREF(dtype);
    if (dt < 0 && !i32) return 1; /* not described here: DLPack describes it, and the argument's own check says why
                                     it is refused */
    t->dtype.code = i32 ? kDLInt : dt == FATTN_BF16 ? kDLBfloat : kDLFloat;
    t->dtype.bits = i32 || dt == FATTN_F32 ? 32 : 16;
    t->dtype.lanes = 1;

    PyObject *ptr = PyObject_CallMethodNoArgs(obj, n->s_data_ptr);
    PyObject *dev = ptr ? PyObject_CallMethodNoArgs(obj, n->s_get_device) : NULL;
    PyObject *shape = dev ? PyObject_GetAttr(obj, n->s_shape) : NULL;
    PyObject *stride = shape ? PyObject_CallMethodNoArgs(obj, n->s_stride) : NULL;
    int ok = stride != NULL;
    const long device = ok ? PyLong_AsLong(dev) : -1;
    if (ok && device >= 0) ok = on_cuda(n, obj, arg); /* an index: cuda's, or another backend's (mps, xpu) */
    if (ok) {
        t->data = PyLong_AsVoidPtr(ptr);
        t->device.device_type = device < 0 ? kDLCPU : kDLCUDA;
        t->device.device_id = device < 0 ? 0 : (int32_t)device;
        const int nd = int_tuple(shape, out->local_shape), ns = int_tuple(stride, out->local_strides);
        ok = !PyErr_Occurred() && nd >= 0 && nd == ns;
        t->ndim = nd;
        t->shape = out->local_shape;
        t->strides = out->local_strides;
        if (!ok && !PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s: could not read the tensor's shape and strides", arg);
    }
    Py_XDECREF(ptr);
    Py_XDECREF(dev);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    if (!ok && !stride) { /* torch refused to give its memory: a sparse, nested, vmap-batched or fake tensor */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(PyExc_ValueError, "%s: fattn cannot read this tensor's memory (torch says: %S); it takes dense "
                     "cpu or cuda tensors, not sparse, meta, fake or vmap-batched ones", arg, value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    if (!ok) return -1;
    out->t = t;
    return 0;
}

/* A torch dtype as DLPack names it, from the dtype's own properties (torch.bool as DLPack's bool). */
static int describe_dtype(PyObject *dtype, DLDataType *dt) {
    PyObject *fp = PyObject_GetAttrString(dtype, "is_floating_point");
    PyObject *cx = fp ? PyObject_GetAttrString(dtype, "is_complex") : NULL;
    PyObject *sg = cx ? PyObject_GetAttrString(dtype, "is_signed") : NULL;
    PyObject *sz = sg ? PyObject_GetAttrString(dtype, "itemsize") : NULL;
    PyObject *name = sz ? PyObject_Str(dtype) : NULL;
    int ok = name != NULL;
    if (ok) {
        const long bytes = PyLong_AsLong(sz);
        const char *text = PyUnicode_AsUTF8(name);
        ok = bytes > 0 && text != NULL;
        if (ok) {
            dt->bits = (uint8_t)(8 * bytes);
            dt->lanes = 1;
            dt->code = !strcmp(text, "torch.bool")    ? kDLBool
                       : !strcmp(text, "torch.bfloat16") ? kDLBfloat
                       : PyObject_IsTrue(cx)           ? kDLComplex
                       : PyObject_IsTrue(fp)           ? kDLFloat
                       : PyObject_IsTrue(sg)           ? kDLInt
                                                       : kDLUInt;
        }
    }
    Py_XDECREF(fp);
    Py_XDECREF(cx);
    Py_XDECREF(sg);
    Py_XDECREF(sz);
    Py_XDECREF(name);
    return ok ? 0 : -1;
}

/* A torch device as a DLPack one: cpu, cuda:N, or FATTN_DEVICE_META; another type raises naming `arg`. */
static int describe_device(PyObject *device, const char *arg, DLDevice *dev) {
    PyObject *type = PyObject_GetAttrString(device, "type");
    PyObject *index = type ? PyObject_GetAttrString(device, "index") : NULL;
    const char *text = index ? PyUnicode_AsUTF8(type) : NULL;
    int ok = text != NULL;
    if (ok) {
        const long id = index == Py_None ? 0 : PyLong_AsLong(index);
        ok = !PyErr_Occurred();
        dev->device_id = (int32_t)id;
        if (!strcmp(text, "cpu")) dev->device_type = kDLCPU;
        else if (!strcmp(text, "cuda")) dev->device_type = kDLCUDA;
        else if (!strcmp(text, "meta")) dev->device_type = FATTN_DEVICE_META;
        else if (ok) {
            PyErr_Format(PyExc_ValueError, "%s: on %s; fattn takes cpu or cuda tensors", arg, text);
            ok = 0;
        }
    }
    Py_XDECREF(type);
    Py_XDECREF(index);
    return ok ? 0 : -1;
}

int fattn_tensor_describe_torch(PyObject *obj, const char *arg, fattn_tensor *out) {
    memset(out, 0, sizeof *out);
    out->arg = arg;
    DLTensor *t = &out->local;
    PyObject *dtype = PyObject_GetAttrString(obj, "dtype");
    PyObject *device = dtype ? PyObject_GetAttrString(obj, "device") : NULL;
    PyObject *shape = device ? PyObject_GetAttrString(obj, "shape") : NULL;
    PyObject *stride = shape ? PyObject_CallMethod(obj, "stride", NULL) : NULL;
    int ok = stride && !describe_dtype(dtype, &t->dtype) && !describe_device(device, arg, &t->device);
    if (ok) {
        const int nd = int_tuple(shape, out->local_shape), ns = int_tuple(stride, out->local_strides);
        ok = !PyErr_Occurred() && nd >= 0 && nd == ns;
        if (!ok && !PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s: could not read the tensor's shape and strides", arg);
        t->ndim = nd;
        t->shape = out->local_shape;
        t->strides = out->local_strides;
    }
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    if (!ok) return -1;
    /* no memory: a placeholder address, non-NULL (a pointer's presence says an optional array was given) and
     * aligned; the rules that compare or use addresses do not run on described views (fattn_call_opts.describe) */
    t->data = (void *)(uintptr_t)FATTN_DESCRIBED_DATA;
    out->described = 1;
    out->t = t;
    return 0;
}

void fattn_tensor_release(fattn_tensor *t) {
    if (!t->capsule) return;
    /* A deleter may run Python code (dropping the producer's array): keep a pending exception out of its way. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (t->versioned && t->versioned->deleter) t->versioned->deleter(t->versioned);
    if (t->legacy && t->legacy->deleter) t->legacy->deleter(t->legacy);
    Py_DECREF(t->capsule);
    PyErr_Restore(type, value, tb);
    t->versioned = NULL;
    t->legacy = NULL;
    t->t = NULL;
    t->capsule = NULL;
}
