"""Hand-built DLPack capsules (ctypes) for the corners real producers rarely emit: byte_offset != 0, NULL
strides, lanes != 1, unknown dtypes and devices, versioned and legacy capsules."""
import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_KEEP = []  # structs, shapes and deleters must outlive the capsules made in a test


class Capsule:
    """A DLPack capsule over `base` (a NumPy array kept alive), viewing `shape` at `byte_offset` bytes in."""

    deleted = 0

    def __init__(self, base, shape, byte_offset=0, strides=None, code=2, bits=None, lanes=1, device=(1, 0),
                 versioned=True, major=1, readonly=False):
        bits = bits or base.dtype.itemsize * 8
        self.base = base
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(shape))(*strides) if strides is not None else None

        def on_delete(_):
            Capsule.deleted += 1

        self.deleter = DELETER(on_delete)
        t = DLTensor(ctypes.c_void_p(base.ctypes.data), DLDevice(*device), len(shape), DLDataType(code, bits, lanes),
                     self.shape, self.strides, byte_offset)
        if versioned:
            self.m = DLManagedTensorVersioned(DLPackVersion(major, 0), None, self.deleter, 1 if readonly else 0, t)
            name = b"dltensor_versioned"
        else:
            self.m = DLManagedTensor(t, None, self.deleter)
            name = b"dltensor"
        # the capsule keeps a pointer to its name (renamed to used_* on consumption): keep the bytes alive
        self.name = ctypes.create_string_buffer(name)
        _KEEP.append(self)
        self.capsule = _new_capsule(ctypes.addressof(self.m), ctypes.cast(self.name, ctypes.c_char_p), None)


def f32(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)
