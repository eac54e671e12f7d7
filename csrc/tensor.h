/* tensor.h -- a borrowed view of a DLPack tensor taken from a Python object, and its release. */
#ifndef FATTN_TENSOR_H
#define FATTN_TENSOR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dlpack.h"
#include "fattn.h"

#define FATTN_MAX_NDIM 8

typedef struct {
    PyObject *capsule;                   /* owned; NULL when empty or when read from a torch tensor */
    DLManagedTensorVersioned *versioned; /* one of the two is set once taken */
    DLManagedTensor *legacy;
    DLTensor *t;
    int readonly;
    const char *arg; /* argument name for error messages */
    int described;   /* 1: a described view (fattn_tensor_describe_torch): shape, strides, dtype, device, no memory */
    DLTensor local;  /* the torch fast path describes the tensor here (t points at it) */
    int64_t local_shape[FATTN_MAX_NDIM], local_strides[FATTN_MAX_NDIM];
} fattn_tensor;

/* Interned names and constants the intake needs (module state).  torch_type and the torch dtypes are set the first
 * time a call happens while torch is imported (fattn_find_torch; fattn never imports torch itself). */
typedef struct {
    PyObject *s_dlpack, *s_dlpack_device, *s_stream, *s_max_version, *max_version;
    PyObject *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_get_device, *s_is_cuda, *s_torch;
    PyObject *torch_type, *torch_dtypes[3]; /* torch.Tensor; torch.float32, float16, bfloat16 (fattn_dtype order) */
    PyObject *torch_int32;                  /* torch.int32: index arrays */
    int describe; /* set in a per-call copy by the check-only calls (_C.check_forward / check_backward): torch
                     tensors without memory (fake, meta) are described by shape, strides, dtype and device alone,
                     with a placeholder data address; those with memory are taken as usual */
} fattn_names;

/* The (device_type, device_id) of `obj` from __dlpack_device__() (or from a capsule). 0 with an exception set
 * naming `arg` on failure. */
int fattn_dlpack_device(const fattn_names *n, PyObject *obj, const char *arg, int *type, int *id);

/* Takes `obj` (an object with __dlpack__, or a DLPack capsule) into `out`; `stream` (a Python int or None) is
 * passed to __dlpack__.  Returns 0, or -1 with an exception naming `arg`. */
int fattn_tensor_take(const fattn_names *n, PyObject *obj, const char *arg, PyObject *stream, fattn_tensor *out);

/* Registers torch's tensor type and dtypes once torch is in sys.modules (never imports it).  0, or -1 with an
 * exception set. */
int fattn_find_torch(fattn_names *n);
int fattn_register_torch(fattn_names *n, PyObject *tensor_type, PyObject *f32, PyObject *f16, PyObject *bf16,
                         PyObject *i32);

/* 1 if `obj` is a torch tensor (torch registered), read through the fast path. */
int fattn_is_torch(const fattn_names *n, PyObject *obj);

/* Describes a torch tensor from its data_ptr(), shape, stride(), dtype and get_device(), without DLPack: the
 * lean call path (torch's __dlpack__ and __dlpack_device__ are Python code, several microseconds each; given a
 * stream, __dlpack__ looks up torch's current and default streams too).  float32, float16, bfloat16 and int32.
 * Returns 0; 1 (no exception) for a tensor of another dtype, which the caller takes through DLPack instead; or -1
 * with an exception naming `arg`. */
int fattn_tensor_from_torch(const fattn_names *n, PyObject *obj, const char *arg, fattn_tensor *out);

/* The device type of a meta tensor in a described view (not a DLPack code: nothing runs on it). */
#define FATTN_DEVICE_META 0x7fff

/* The data address of a described view (below): a placeholder, never dereferenced. */
#define FATTN_DESCRIBED_DATA 4096

/* Describes a torch tensor (any dtype) from its shape, stride(), dtype and device, reading no memory: data is
 * FATTN_DESCRIBED_DATA and `described` is set.
 * For the check-only calls, whose tensors may be fake or meta.  Returns 0, or -1 with an exception naming `arg`. */
int fattn_tensor_describe_torch(PyObject *obj, const char *arg, fattn_tensor *out);

/* Calls the producer's deleter and drops the capsule; safe on an empty view. */
void fattn_tensor_release(fattn_tensor *t);

#endif
