/* tensor.h -- a borrowed view of a DLPack tensor taken from a Python object, and its release. */
#ifndef FATTN_TENSOR_H
#define FATTN_TENSOR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dlpack.h"

typedef struct {
    PyObject *capsule;                   /* owned; NULL when empty */
    DLManagedTensorVersioned *versioned; /* one of the two is set once taken */
    DLManagedTensor *legacy;
    DLTensor *t;
    int readonly;
    const char *arg; /* argument name for error messages */
} fattn_tensor;

/* Interned names and constants the intake needs (module state). */
typedef struct {
    PyObject *s_dlpack, *s_dlpack_device, *s_stream, *s_max_version, *max_version;
} fattn_names;

/* The (device_type, device_id) of `obj` from __dlpack_device__() (or from a capsule). 0 with an exception set
 * naming `arg` on failure. */
int fattn_dlpack_device(const fattn_names *n, PyObject *obj, const char *arg, int *type, int *id);

/* Takes `obj` (an object with __dlpack__, or a DLPack capsule) into `out`; `stream` (a Python int or None) is
 * passed to __dlpack__.  Returns 0, or -1 with an exception naming `arg`. */
int fattn_tensor_take(const fattn_names *n, PyObject *obj, const char *arg, PyObject *stream, fattn_tensor *out);

/* Calls the producer's deleter and drops the capsule; safe on an empty view. */
void fattn_tensor_release(fattn_tensor *t);

#endif
