/* args.c -- the extension's argument layer (args.h). */
#include "args.h"

#include "variants.h" /* fattn_gpu_read_many */
#include "views.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>

/* ---- keyword arguments ------------------------------------------------------------------------------------- */

int fattn_parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                     const char *const *names, PyObject *const *interned, int n, int required, PyObject **out) {
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, n, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j);
        int i = 0;
        if (interned)
            while (i < n && key != interned[i]) i++;
        if (i == n || !interned)
            for (i = 0; i < n && PyUnicode_CompareWithASCIIString(key, names[i]) != 0;) i++;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, key);
            return -1;
        }
        if (out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, names[i]);
            return -1;
        }
        out[i] = args[nargs + j];
    }
    for (int i = 0; i < required; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    return 0;
}

int fattn_refuse_none(PyObject *const *a, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (a[i] == Py_None) {
            PyErr_Format(PyExc_TypeError, "%s: expected an array, got None", names[i]);
            return -1;
        }
    return 0;
}

/* ---- the user's words ---------------------------------------------------------------------------------------- */

void fattn_device_str(DLDevice dev, char *buf, size_t n) {
    switch (dev.device_type) {
    case kDLCPU: snprintf(buf, n, "cpu"); break;
    case kDLCUDA: snprintf(buf, n, "cuda:%d", dev.device_id); break;
    case kDLCUDAHost: snprintf(buf, n, "cuda pinned host memory"); break;
    case kDLCUDAManaged: snprintf(buf, n, "cuda managed memory"); break;
    case FATTN_DEVICE_META: snprintf(buf, n, "meta"); break;
    default: snprintf(buf, n, "DLPack device type %d", dev.device_type);
    }
}

void fattn_shape_str(const DLTensor *t, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "(");
    for (int i = 0; i < t->ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (used < n) snprintf(buf + used, n - used, t->ndim == 1 ? ",)" : ")");
}

void fattn_dtype_str(DLDataType dt, char *buf, size_t n) {
    const char *kind = dt.code == kDLInt ? "int" : dt.code == kDLUInt ? "uint" : dt.code == kDLFloat ? "float"
                     : dt.code == kDLBfloat ? "bfloat" : dt.code == kDLComplex ? "complex" : NULL;
    if (dt.code == kDLBool) snprintf(buf, n, "bool");
    else if (kind) snprintf(buf, n, "%s%u", kind, dt.bits);
    else snprintf(buf, n, "DLPack type code %u (%u bits)", dt.code, dt.bits);
    if (dt.lanes != 1) {
        const size_t used = strlen(buf);
        snprintf(buf + used, n - used, "x%u", dt.lanes);
    }
}

/* TypeError "<t's name>: dtype must be <want>, got <dtype>" unless t is one lane of (code, bits). */
static int require_dtype(const fattn_tensor *t, uint8_t code, uint8_t bits, const char *want) {
    const DLDataType x = t->t->dtype;
    if (x.code == code && x.bits == bits && x.lanes == 1) return 0;
    char name[64];
    fattn_dtype_str(x, name, sizeof name);
    PyErr_Format(PyExc_TypeError, "%s: dtype must be %s, got %s", t->arg, want, name);
    return -1;
}

int fattn_require_int32(const fattn_tensor *t) { return require_dtype(t, kDLInt, 32, "int32"); }
int fattn_require_float32(const fattn_tensor *t) { return require_dtype(t, kDLFloat, 32, "float32"); }

/* ---- scalars ------------------------------------------------------------------------------------------------- */

int fattn_arg_long(PyObject *obj, const char *arg, long lo, long hi, long *v) {
    if (!obj) return 0;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.200s", arg, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const long x = PyLong_AsLong(obj);
    if (x == -1 && PyErr_Occurred()) { /* an int past a C long */
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %R is out of range [%ld, %ld]", arg, obj, lo, hi);
        return -1;
    }
    if (x < lo || x > hi) {
        PyErr_Format(PyExc_ValueError, "%s: %ld is out of range [%ld, %ld]", arg, x, lo, hi);
        return -1;
    }
    *v = x;
    return 0;
}

int fattn_arg_scale(PyObject *obj, double *scale) {
    *scale = NAN;
    if (!obj || obj == Py_None) return 0;
    const double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "scale: expected a float or None, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    /* the kernels use scale and scale * log2(e) in float32: both must be finite there */
    if (!isfinite(s) || !isfinite((float)s) || !isfinite((float)(s * 1.4426950408889634))) {
        PyErr_Format(PyExc_ValueError, "scale: must be finite in float32 (|scale| below about 2.3e38), got %R", obj);
        return -1;
    }
    *scale = s;
    return 0;
}

int fattn_arg_window(PyObject *obj, int64_t *left, int64_t *right) {
    *left = *right = -1;
    if (!obj || obj == Py_None) return 0;
    long long l, r;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2 || !PyLong_Check(PyTuple_GET_ITEM(obj, 0)) ||
        !PyLong_Check(PyTuple_GET_ITEM(obj, 1))) {
        PyErr_Format(PyExc_TypeError, "window: expected a (left, right) tuple of ints, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    l = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, 0));
    r = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, 1));
    if (PyErr_Occurred()) { /* an int past 64 bits */
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "window: %R: each side must fit in 64 bits (-1 for unbounded)", obj);
        return -1;
    }
    if (l < -1 || r < -1) {
        PyErr_Format(PyExc_ValueError, "window: (%lld, %lld): each side is a key count >= 0, or -1 for unbounded", l, r);
        return -1;
    }
    *left = l;
    *right = r;
    return 0;
}

int fattn_arg_stream(PyObject *obj, void **stream) {
    *stream = NULL;
    if (!obj || obj == Py_None) return 0;
    /* DLPack's 1 and 2 (legacy and per-thread default streams) are also the runtime's cudaStreamLegacy and
     * cudaStreamPerThread handles, so the value is passed through unchanged. */
    if (PyLong_Check(obj)) *stream = PyLong_AsVoidPtr(obj);
    if (!PyLong_Check(obj) || PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "stream: expected a CUDA stream handle (an int) or None, got %R", obj);
        return -1;
    }
    return 0;
}

/* ---- tensors ------------------------------------------------------------------------------------------------- */

/* rc of a take; a taken array of some elements must have memory: a meta tensor gives data_ptr() 0 (and
 * get_device() -1, which reads as cpu), and a NULL pointer reads as "not given" further on (alibi_slopes, sinks). */
static int has_data(int rc, const fattn_tensor *t) {
    if (rc) return rc;
    int64_t numel = 1;
    for (int i = 0; i < t->t->ndim; i++) numel *= t->t->shape[i];
    if (t->t->data || !numel) return 0;
    PyErr_Format(PyExc_ValueError, "%s: the array has no data (a meta or fake tensor?); fattn computes on cpu or cuda "
                 "arrays", t->arg);
    return -1;
}

static int take_dlpack(const fattn_names *names, PyObject *obj, const char *arg, PyObject *stream, fattn_tensor *out) {
    int type = 0, id = 0;
    if (!fattn_dlpack_device(names, obj, arg, &type, &id)) return -1;
    return has_data(fattn_tensor_take(names, obj, arg, type == kDLCUDA ? stream : Py_None, out), out);
}

/* 1 if a torch tensor has memory to take (0: a fake or meta tensor, whose data_ptr() raises or is 0). */
static int has_memory(PyObject *obj) {
    PyObject *ptr = PyObject_CallMethod(obj, "data_ptr", NULL);
    const int has = ptr && PyLong_AsVoidPtr(ptr) != NULL;
    Py_XDECREF(ptr);
    PyErr_Clear();
    return has;
}

int fattn_take(const fattn_names *names, PyObject *obj, const char *arg, PyObject *stream, fattn_tensor *out) {
    if (!fattn_is_torch(names, obj)) return take_dlpack(names, obj, arg, stream, out);
    if (names->describe && !has_memory(obj)) return fattn_tensor_describe_torch(obj, arg, out);
    const int rc = fattn_tensor_from_torch(names, obj, arg, out);
    if (rc <= 0) return has_data(rc, out);
    /* another dtype: detached (torch exports no tensor that requires grad), so the argument's check names it */
    PyObject *plain = PyObject_CallMethod(obj, "detach", NULL);
    if (!plain) return -1;
    const int taken = take_dlpack(names, plain, arg, stream, out);
    Py_DECREF(plain); /* the capsule keeps the memory alive */
    return taken;
}

int fattn_dtype_of(const fattn_tensor *t, fattn_dtype *dt) {
    const DLDataType x = t->t->dtype;
    if (x.lanes == 1 && x.code == kDLFloat && x.bits == 32) *dt = FATTN_F32;
    else if (x.lanes == 1 && x.code == kDLFloat && x.bits == 16) *dt = FATTN_F16;
    else if (x.lanes == 1 && x.code == kDLBfloat && x.bits == 16) *dt = FATTN_BF16;
    else {
        char name[64];
        fattn_dtype_str(x, name, sizeof name);
        PyErr_Format(PyExc_TypeError, "%s: dtype %s is not supported; use float16, bfloat16 or float32", t->arg, name);
        return -1;
    }
    return 0;
}

/* Strides in elements, compact row-major when the producer gave none. */
void fattn_strides_of(const DLTensor *t, int64_t *st) {
    int64_t acc = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        st[i] = t->strides ? t->strides[i] : acc;
        acc *= t->shape[i];
    }
}

int fattn_view_4d(const fattn_tensor *t, int layout, bhsd_view *v) {
    const DLTensor *x = t->t;
    if (x->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "%s: expected a 4-D array (%s), got %d-D", t->arg, layout ? "B, S, H, D" : "B, H, S, D",
                     x->ndim);
        return -1;
    }
    if (fattn_dtype_of(t, &v->dtype) < 0) return -1;
    int64_t st[4];
    fattn_strides_of(x, st);
    const int hi = layout ? 2 : 1, si = layout ? 1 : 2;
    v->b = x->shape[0]; v->h = x->shape[hi]; v->s = x->shape[si]; v->d = x->shape[3];
    v->sb = st[0]; v->sh = st[hi]; v->ss = st[si];
    const int empty = v->b == 0 || v->h == 0 || v->s == 0; /* strides of an empty array mean nothing */
    if (st[3] != 1 && v->d > 1 && !empty) {
        PyErr_Format(PyExc_ValueError, "%s: the last dimension must be contiguous (stride 1), got stride %lld", t->arg,
                     (long long)st[3]);
        return -1;
    }
    v->data = (char *)x->data + x->byte_offset; /* not NULL unless empty (fattn_take) */
    const size_t esize = v->dtype == FATTN_F32 ? 4 : 2;
    if ((uintptr_t)v->data % esize) {
        PyErr_Format(PyExc_ValueError, "%s: data pointer is not aligned to its %zu-byte elements", t->arg, esize);
        return -1;
    }
    return 0;
}

/* One device: the same CUDA device, or host memory (every kDLCPU id: JAX numbers its virtual CPU devices, whose
 * buffers are all the host's). */
int fattn_same_device(const fattn_tensor *a, const fattn_tensor *ref) {
    const DLDevice x = a->t->device, y = ref->t->device;
    if (x.device_type != y.device_type || (x.device_type != kDLCPU && x.device_id != y.device_id)) {
        char dx[48], dy[48];
        fattn_device_str(x, dx, sizeof dx);
        fattn_device_str(y, dy, sizeof dy);
        PyErr_Format(PyExc_ValueError, "%s: on %s but %s is on %s; all arrays must be on one device", a->arg, dx,
                     ref->arg, dy);
        return -1;
    }
    return 0;
}

const char *fattn_dtype_name(fattn_dtype dt) {
    return dt == FATTN_F32 ? "float32" : dt == FATTN_F16 ? "float16" : "bfloat16";
}

int fattn_same_dtype(const bhsd_view *x, const bhsd_view *q, const char *arg) {
    REQUIRE(x->dtype == q->dtype, PyExc_TypeError, "%s: dtype %s differs from q's %s; q, k, v and out must share one "
            "dtype", arg, fattn_dtype_name(x->dtype), fattn_dtype_name(q->dtype));
    return 0;
}

/* A packed (total, H, D) varlen array as a view of batch 0 (s = total rows; the caller sets b and s). */
int fattn_view_3d(const fattn_tensor *t, bhsd_view *v) {
    const DLTensor *x = t->t;
    if (x->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "%s: expected a 3-D packed array (total, H, D) with cu_seqlens, got %d-D",
                     t->arg, x->ndim);
        return -1;
    }
    if (fattn_dtype_of(t, &v->dtype) < 0) return -1;
    int64_t st[3];
    fattn_strides_of(x, st);
    v->b = 1; v->s = x->shape[0]; v->h = x->shape[1]; v->d = x->shape[2];
    v->sb = 0; v->ss = st[0]; v->sh = st[1];
    const int empty = v->s == 0 || v->h == 0;
    if (st[2] != 1 && v->d > 1 && !empty) {
        PyErr_Format(PyExc_ValueError, "%s: the last dimension must be contiguous (stride 1), got stride %lld", t->arg,
                     (long long)st[2]);
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

int fattn_take_int32(const fattn_tensor *t, const fattn_tensor *q, int64_t n, int32_t **host, int64_t *count,
                      void *stream) {
    const DLTensor *x = t->t;
    REQUIRE(x->ndim == 1, PyExc_ValueError, "%s: expected a 1-D int32 array, got %d-D", t->arg, x->ndim);
    if (fattn_require_int32(t) || fattn_same_device(t, q)) return -1;
    REQUIRE(n < 0 ? x->shape[0] >= 1 : x->shape[0] == n, PyExc_ValueError,
            n < 0 ? "%s: needs at least one entry" : "%s: expected %lld entries, got %lld", t->arg, (long long)n,
            (long long)x->shape[0]);
    REQUIRE(x->shape[0] <= FATTN_MAX_SEQS, PyExc_ValueError, "%s: more than %d entries", t->arg, FATTN_MAX_SEQS);
    REQUIRE(!x->strides || x->shape[0] <= 1 || x->strides[0] == 1, PyExc_ValueError, "%s: must be contiguous", t->arg);
    const int32_t *src = (const int32_t *)((const char *)x->data + x->byte_offset);
    REQUIRE((uintptr_t)src % 4 == 0, PyExc_ValueError, "%s: data pointer is not 4-byte aligned", t->arg);
    *count = x->shape[0];
    return host ? fattn_read_int32s(1, &t, host, stream) : 0; /* (host NULL: described, not read) */
}

int fattn_read_int32s(int n, const fattn_tensor *const *t, int32_t **host, void *stream) {
    void *dst[FATTN_MAX_READS];
    const void *src[FATTN_MAX_READS];
    size_t bytes[FATTN_MAX_READS];
    int reads = 0, device = 0;
    const char *first = NULL; /* the first array read from the device, named if the read is refused */
    for (int i = 0; i < n; i++) host[i] = NULL;
    for (int i = 0; i < n; i++) {
        const DLTensor *x = t[i]->t;
        const size_t size = sizeof(int32_t) * (size_t)x->shape[0];
        const void *from = (const char *)x->data + x->byte_offset;
        host[i] = PyMem_Malloc(size > 0 ? size : 1);
        if (!host[i]) {
            PyErr_NoMemory();
            goto fail;
        }
        if (x->device.device_type != kDLCUDA) {
            memcpy(host[i], from, size);
            continue;
        }
        if (!first) first = t[i]->arg;
        dst[reads] = host[i]; /* every array is on q's device (fattn_take_int32) */
        src[reads] = from;
        bytes[reads++] = size;
        device = x->device.device_id;
    }
    if (reads && fattn_gpu_stream_capturing(stream)) { /* refused before any CUDA call, so the capture goes on */
        PyErr_Format(PyExc_RuntimeError, "%s: cannot be read back to be checked while the stream is being captured "
                     "into a CUDA graph; pass check_indices=False to trust the index arrays as given", first);
        goto fail;
    }
    fattn_status read = FATTN_OK;
    if (reads) { /* the wait for the stream lets other Python threads run (C state only; the error text per thread) */
        Py_BEGIN_ALLOW_THREADS
        read = fattn_gpu_read_many(reads, dst, src, bytes, device, stream);
        Py_END_ALLOW_THREADS
    }
    if (read) {
        PyErr_Format(PyExc_RuntimeError, "fattn: %s", fattn_last_error());
        goto fail;
    }
    return 0;
fail:
    for (int i = 0; i < n; i++) {
        PyMem_Free(host[i]);
        host[i] = NULL;
    }
    return -1;
}

/* The softcap c: 0 (none), or c > 0 such that the kernels' c log2 e and its inverse are normal float32 numbers (a
 * larger c overflowed to inf and gave NaN scores; a smaller one rounded to 0, silently no cap). */
static int check_softcap(double c) {
    const double c2 = c * 1.4426950408889634;
    if (c == 0) return 0;
    if (c > 0 && (float)c2 >= FLT_MIN && isfinite((float)c2) && 1.0 / c2 <= FLT_MAX) return 0;
    char text[160];
    snprintf(text, sizeof text, "softcap: must be 0 (none) or from %.3g to %.3g (float32's range), got %g",
             FLT_MIN / 1.4426950408889634 * 1.0001, FLT_MAX / 1.4426950408889634 / 1.0001, c);
    PyErr_SetString(PyExc_ValueError, text);
    return -1;
}

static int take_lse(const fattn_tensor *l, const bhsd_view *q, int read_only, attn_params *p) {
    const DLTensor *x = l->t;
    REQUIRE(x->ndim == 3, PyExc_ValueError, "lse: expected a 3-D float32 array (B, H, Sq), got %d-D", x->ndim);
    if (fattn_require_float32(l)) return -1;
    REQUIRE(x->shape[0] == q->b && x->shape[1] == q->h && x->shape[2] == q->s, PyExc_ValueError,
            "lse: shape must be (B=%lld, H=%lld, Sq=%lld)", (long long)q->b, (long long)q->h, (long long)q->s);
    REQUIRE(!l->readonly || read_only, PyExc_ValueError, "lse: the array is read-only");
    int64_t st[3];
    fattn_strides_of(x, st);
    REQUIRE(st[2] == 1 || q->s <= 1 || q->b * q->h == 0, PyExc_ValueError, "lse: the last dimension must be contiguous");
    p->lse = (float *)((char *)x->data + x->byte_offset);
    REQUIRE((uintptr_t)p->lse % 4 == 0, PyExc_ValueError, "lse: data pointer is not 4-byte aligned");
    p->lse_stride_b = st[0];
    p->lse_stride_h = st[1];
    return 0;
}

/* alibi_slopes: float32 (H,) or (B, H) (B: the batch, or the sequences of a packed one), heads contiguous, on q's
 * device.  Their values are not read on the host (no sync): any real slope is the caller's to give. */
static int take_alibi(const fattn_tensor *t, const fattn_tensor *q, attn_params *p) {
    const DLTensor *x = t->t;
    if (fattn_require_float32(t)) return -1;
    REQUIRE((x->ndim == 1 && x->shape[0] == p->h) || (x->ndim == 2 && x->shape[0] == p->b && x->shape[1] == p->h),
            PyExc_ValueError, "alibi_slopes: expected shape (H,) = (%lld,) or (B, H) = (%lld, %lld)", (long long)p->h,
            (long long)p->b, (long long)p->h);
    int64_t st[2] = {0, 1};
    fattn_strides_of(x, st);
    REQUIRE(st[x->ndim - 1] == 1 || p->h <= 1, PyExc_ValueError, "alibi_slopes: the heads must be contiguous");
    p->alibi_slopes = (const float *)((const char *)x->data + x->byte_offset);
    REQUIRE((uintptr_t)p->alibi_slopes % 4 == 0, PyExc_ValueError, "alibi_slopes: data pointer is not 4-byte aligned");
    p->alibi_stride_b = x->ndim == 2 && p->b > 1 ? st[0] : 0;
    return fattn_same_device(t, q);
}

int fattn_build_params(fattn_tensor *ts, const fattn_call_opts *o, attn_params *p, void *stream) {
    bhsd_view q, k, v, out;
    const int varlen = o->cu_seqlens_q && o->cu_seqlens_q->t;
    if (!varlen && o->cu_seqlens_k && o->cu_seqlens_k->t) {
        PyErr_SetString(PyExc_ValueError, "cu_seqlens_q: needed with cu_seqlens_k");
        return -1;
    }
    if (varlen ? fattn_view_3d(&ts[0], &q) || fattn_view_3d(&ts[1], &k) || fattn_view_3d(&ts[2], &v) ||
                     fattn_view_3d(&ts[3], &out)
               : fattn_view_4d(&ts[0], o->layout, &q) || fattn_view_4d(&ts[1], o->layout, &k) ||
                     fattn_view_4d(&ts[2], o->layout, &v) || fattn_view_4d(&ts[3], o->layout, &out))
        return -1;
    fattn_pages pages = {NULL, 0, 0};
    const bhsd_view k_mem = k, v_mem = v; /* the memory k and v span: a paged cache's whole pool */
    if (o->block_table && o->block_table->t) {
        REQUIRE(!varlen, PyExc_ValueError, "block_table: not taken with cu_seqlens");
        REQUIRE(o->layout == 1, PyExc_ValueError, "block_table: a paged cache is (num_pages, page_size, H_kv, D): "
                "layout bshd");
        if (fattn_same_device(&ts[1], &ts[0]) || fattn_same_device(&ts[2], &ts[0]) ||
            fattn_take_pages(o->block_table, &ts[0], q.b, &k, &v, &pages, !o->trust_indices, stream))
            return -1;
    }
    const int64_t total_q = q.s;
    const int has_lse = ts[4].t != NULL;
    for (int i = 1; i < 4 + has_lse; i++)
        if (fattn_same_device(&ts[i], &ts[0])) return -1;
    const char *k_arg = ts[1].arg, *v_arg = ts[2].arg; /* k, v; or k_cache, v_cache */
    if (fattn_same_dtype(&k, &q, k_arg) || fattn_same_dtype(&v, &q, v_arg) || fattn_same_dtype(&out, &q, "out"))
        return -1;
    REQUIRE(q.d % 8 == 0 && q.d >= 8 && q.d <= FATTN_MAX_HEADDIM, PyExc_ValueError,
            "q: head dim %lld is not supported; use a multiple of 8 from 8 to %d", (long long)q.d, FATTN_MAX_HEADDIM);
    REQUIRE(k.d == q.d, PyExc_ValueError, "%s: head dim %lld differs from q's %lld", k_arg, (long long)k.d,
            (long long)q.d);
    REQUIRE(v.d == q.d, PyExc_ValueError, "%s: head dim %lld differs from q's %lld", v_arg, (long long)v.d,
            (long long)q.d);
    REQUIRE(k.b == q.b, PyExc_ValueError, "%s: batch %lld differs from q's %lld", k_arg, (long long)k.b,
            (long long)q.b);
    if (!(v.b == q.b && v.h == k.h && v.s == k.s)) {
        char vs[96], ks[96];
        fattn_shape_str(ts[2].t, vs, sizeof vs);
        fattn_shape_str(ts[1].t, ks, sizeof ks);
        PyErr_Format(PyExc_ValueError, "%s: shape %s differs from %s's %s", v_arg, vs, k_arg, ks);
        return -1;
    }
    REQUIRE(k.h >= 1 || q.h == 0, PyExc_ValueError, "%s: has 0 heads; %s and %s need at least one head", k_arg, k_arg,
            v_arg);
    REQUIRE(k.h == 0 || q.h % k.h == 0, PyExc_ValueError,
            "%s: %lld heads do not divide q's %lld heads (grouped-query attention needs H %% H_kv == 0)", k_arg,
            (long long)k.h, (long long)q.h);
    if (!(out.b == q.b && out.h == q.h && out.s == q.s && out.d == q.d)) {
        char os[96], qs[96];
        fattn_shape_str(ts[3].t, os, sizeof os);
        fattn_shape_str(ts[0].t, qs, sizeof qs);
        PyErr_Format(PyExc_ValueError, "out: shape %s differs from q's %s", os, qs);
        return -1;
    }
    REQUIRE(!ts[3].readonly || o->read_only, PyExc_ValueError, "out: the array is read-only");
    if (!fattn_any_described(ts, 4) && fattn_out_overlaps(&q, &k_mem, &v_mem, &out, k_arg, v_arg)) return -1;
    if (check_softcap(o->softcap)) return -1;

    memset(p, 0, sizeof *p);
    if (varlen && fattn_take_varlen(o, &ts[0], &q, &k, &v, &out, p, stream)) return -1;
    p->q = q.data; p->k = k.data; p->v = v.data; p->o = out.data;
    p->q_stride_b = q.sb; p->q_stride_h = q.sh; p->q_stride_s = q.ss;
    p->k_stride_b = k.sb; p->k_stride_h = k.sh; p->k_stride_s = k.ss;
    p->v_stride_b = v.sb; p->v_stride_h = v.sh; p->v_stride_s = v.ss;
    p->o_stride_b = out.sb; p->o_stride_h = out.sh; p->o_stride_s = out.ss;
    p->b = q.b; p->h = q.h; p->h_kv = k.h; p->sq = q.s; p->sk = k.s; p->d = q.d;
    p->h_per_kv = k.h ? q.h / k.h : 1;
    p->dtype = q.dtype;
    p->block_table = pages.table;
    p->block_table_stride = pages.stride;
    p->page_size = pages.page_size;
    p->num_pages = pages.num_pages;
    if (has_lse && (varlen ? fattn_take_lse_varlen(&ts[4], &q, total_q, o->read_only, p)
                           : take_lse(&ts[4], &q, o->read_only, p)))
        return -1;
    if (has_lse && !o->read_only && !fattn_any_described(ts, 5) && fattn_lse_overlaps(ts)) return -1; /* (written) */
    if (o->k_new && o->k_new->t) { /* set by the forward's cache arguments, which give o->append with it */
        bhsd_view kn, vn;
        if (fattn_take_new_kv(o->k_new, o->v_new, &ts[1], &ts[2], o->seqused_k, p, o->append, &kn, &vn)) return -1;
        if (!fattn_any_described(ts, 4) && !o->k_new->described && !o->v_new->described &&
            fattn_append_overlaps(&kn, &vn, &q, &k_mem, &v_mem, k_arg, v_arg))
            return -1;
    } else {
        REQUIRE(!o->v_new || !o->v_new->t, PyExc_ValueError, "k_new: needed with v_new (v_new was given alone)");
    }
    if (o->seqused_k && o->seqused_k->t &&
        fattn_take_seqused(o->seqused_k, &ts[0], p, !o->trust_indices, stream))
        return -1;
    if (o->alibi_slopes && o->alibi_slopes->t && take_alibi(o->alibi_slopes, &ts[0], p)) return -1;
    p->softcap = (float)o->softcap;
    const double scale = isnan(o->scale) ? 1.0 / sqrt((double)q.d) : o->scale;
    p->scale = (float)scale;
    p->scale_log2 = (float)(scale * 1.4426950408889634);
    /* causal is right = 0 around the diagonal of its alignment; a window alone is bottom-right aligned
     * (flash-attention's convention) */
    p->mask.causal = o->causal;
    p->mask.bottom_right = o->causal != FATTN_CAUSAL_TOP_LEFT;
    p->mask.left = o->window_left;
    p->mask.right = o->causal ? 0 : o->window_right;
    return 0;
}

int fattn_any_described(const fattn_tensor *t, int n) {
    for (int i = 0; i < n; i++)
        if (t[i].described) return 1;
    return 0;
}

int fattn_call_device(const fattn_tensor *q, int *device) {
    *device = q->t->device.device_id;
    return q->t->device.device_type == kDLCUDA;
}
