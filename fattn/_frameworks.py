"""Per-framework glue: allocate outputs with the caller's own framework and find its current CUDA stream.

Each framework is recognised by the module its array type comes from; nothing here imports a framework that the
caller did not already use.
"""
import sys

# DLPack device types
CPU, CUDA = 1, 2


def framework_of(x):
    mod = type(x).__module__.split(".")[0]
    if mod in ("torch", "numpy", "cupy"):
        return mod
    if mod in ("jax", "jaxlib"):
        return "jax"
    return "other"


# EMPTY[framework](like, shape, float32, arg, settable): a new array of `shape` in like's dtype (float32: in float32)
# on like's device, for the result `arg` -- which the public call also takes as a keyword when `settable` (the JAX
# error says which to pass).


def _torch_empty(like, shape, float32, arg="out", settable=True):
    # A result of like's own shape and dtype is laid out as like is (torch.empty_like: a (B, H, S, D) view of a
    # (B, S, H, D) buffer gets (B, S, H, D) memory, as torch SDPA's output and fattn's autograd op's do, so that
    # o.transpose(1, 2).view(B, S, H * D) works whichever path made o); others are new and contiguous.  Both inherit
    # device (and empty_like dtype) without a torch.device object built per call.
    torch = sys.modules["torch"]
    if not float32 and like.shape == shape:
        return torch.empty_like(like)
    return like.new_empty(shape, dtype=torch.float32) if float32 else like.new_empty(shape)


def _numpy_empty(like, shape, float32, arg="out", settable=True):
    np = sys.modules["numpy"]
    return np.empty(shape, dtype=np.float32 if float32 else like.dtype)


def _cupy_empty(like, shape, float32, arg="out", settable=True):
    cp = sys.modules["cupy"]
    with like.device:
        return cp.empty(shape, dtype=cp.float32 if float32 else like.dtype)


def _jax_empty(like, shape, float32, arg="out", settable=True):
    how = (f"pass a writable torch / CuPy / NumPy array as {arg}=" if settable else
           f"this call takes no {arg}= to write into instead")
    raise TypeError(f"{arg}: JAX arrays are immutable, so fattn cannot make its {arg} one; {how}, use "
                    "fattn.jax.attention, or convert the inputs with numpy.from_dlpack / cupy.from_dlpack / "
                    "torch.from_dlpack")


def _other_empty(like, shape, float32, arg="out", settable=True):
    raise TypeError(
        f"fattn: cannot allocate an output like {type(like).__module__}.{type(like).__name__}; pass out= "
        "(and lse= with return_lse) as writable DLPack arrays"
    )


EMPTY = {"torch": _torch_empty, "numpy": _numpy_empty, "cupy": _cupy_empty, "jax": _jax_empty, "other": _other_empty}


_torch_raw_stream = None
torch_ready = False  # register_torch has run (a bool: torch.compile guards on it)
torch_tensor = None  # torch.Tensor once registered
is_tracing = None    # torch.jit's "is a trace being recorded", once registered
is_compiling = None  # torch.compiler.is_compiling, once registered
grad_enabled = None  # torch.is_grad_enabled, once registered
forward_ad = None    # torch.autograd.forward_ad, once registered
is_capturing = None  # torch.cuda.is_current_stream_capturing, once registered
any_autocast = None  # "is autocast on for any device" (one flag), once registered
autocast_on = None   # torch.is_autocast_enabled(device_type), once registered
autocast_dtype = None  # torch.get_autocast_dtype(device_type), once registered
torch_float64 = None  # torch.float64, once registered (traced code reads no sys.modules: torch.compile cannot)
increment_version = None  # torch.autograd.graph.increment_version, once registered
functorch_top = None  # torch._C._functorch.peek_interpreter_stack (None: no torch.func transform), once registered


def register_torch(C):
    """Tell the C extension about torch's tensor type and dtypes (the lean path), once, on first torch use, and keep
    the few torch functions the call path asks each time (without attribute lookups through torch's modules)."""
    global _torch_raw_stream, torch_tensor, is_tracing, is_compiling, grad_enabled, is_capturing, torch_ready
    global any_autocast, autocast_on, autocast_dtype, torch_float64
    torch = sys.modules["torch"]
    is_compiling = torch.compiler.is_compiling
    grad_enabled = torch.is_grad_enabled
    is_capturing = torch.cuda.is_current_stream_capturing
    any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)
    autocast_on, autocast_dtype, torch_float64 = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.float64
    C.register_torch(torch.Tensor, torch.float32, torch.float16, torch.bfloat16, torch.int32)
    torch_tensor = torch.Tensor
    global forward_ad, increment_version, functorch_top
    import torch.autograd.forward_ad as forward_ad  # noqa: F811  (its _current_level: -1 outside dual_level)
    increment_version = torch.autograd.graph.increment_version
    functorch_top = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    is_tracing = getattr(torch._C, "_is_tracing", None) or torch.jit.is_tracing
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, without building a Stream object
    _torch_raw_stream = raw or (lambda idx: torch.cuda.current_stream(idx).cuda_stream)
    torch_ready = True


def written_in_place(*tensors):
    """Tells torch that fattn wrote these torch tensors in place (through their memory, where torch cannot see it):
    their version counters advance, so autograd refuses a backward that saved them before (inference tensors keep
    no version)."""
    for t in tensors:
        if isinstance(t, torch_tensor) and not t.is_inference():
            increment_version(t)


def current_stream(fw, device_id):
    """The caller's current CUDA stream handle for device `device_id`, as DLPack's stream argument wants it."""
    handle = 0
    if fw == "torch":
        handle = _torch_raw_stream(device_id)
    elif fw == "cupy":
        with sys.modules["cupy"].cuda.Device(device_id):
            handle = sys.modules["cupy"].cuda.get_current_stream().ptr
    # DLPack reserves 0; the legacy default stream is 1 (also the CUDA runtime's cudaStreamLegacy handle).
    return handle or 1
