"""Arguments as the public functions take them, turned into what fattn._C takes -- one place for each rule -- and
the choice between fattn's lean torch path and the registered torch op."""
from . import _C, _frameworks
from ._frameworks import EMPTY, framework_of

CAUSAL = {False: 0, None: 0, True: 1, "top_left": 1, "bottom_right": 2}
LAYOUT = {"bhsd": 0, "bshd": 1}


def causal_code(causal, true="top_left"):
    """causal's code for fattn._C.  `true`: the alignment causal=True (or any true non-string value, e.g. NumPy's
    True) means for the caller -- "top_left" for attention (torch SDPA's is_causal), "bottom_right" for packed
    sequences and KV caches (flash-attention's, where a sequence's or cache's queries are its last positions)."""
    try:
        code = CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}") from None
    return CAUSAL[true] if code and not isinstance(causal, str) else code


def layout_code(layout):
    try:
        return LAYOUT[layout]
    except (KeyError, TypeError):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}") from None


def variant_name(variant):
    if variant is not None and not isinstance(variant, str):
        raise TypeError(f"variant: expected a str or None, got {type(variant).__name__}")
    return variant


def real(x, name):
    """A number given as any real scalar (int, NumPy scalar, 0-d array or tensor) as a float."""
    if isinstance(x, float):
        return x
    if isinstance(x, bool) or getattr(x, "ndim", 0) != 0 or not hasattr(x, "__float__"):
        raise TypeError(f"{name}: expected a real number or None, got {type(x).__name__}")
    return float(x)


def scale_value(scale):
    return None if scale is None else real(scale, "scale")


def softcap_value(softcap):
    """0.0 (none) or a softcap c > 0 (checked for range in C)."""
    if softcap is None or (softcap == 0.0 and type(softcap) is float):
        return 0.0
    c = real(softcap, "softcap")
    if not 0.0 <= c < float("inf"):
        raise ValueError(f"softcap: must be >= 0 and finite (0: none), got {softcap!r}")
    return c


def window_pair(window):
    """None (no window) or a (left, right) pair of ints >= -1, from what the caller gave."""
    if window is None or (type(window) is tuple and window == (-1, -1)):  # the default: no checks (the lean path)
        return None
    try:
        left, right = window
        ok = all(not isinstance(x, bool) and float(x).is_integer() for x in window)
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise TypeError(f"window: expected a (left, right) pair of ints, got {window!r}")
    if left < -1 or right < -1:
        raise ValueError(f"window: ({left}, {right}): each side is a key count >= 0, or -1 for unbounded")
    return None if left == -1 and right == -1 else (left, right)


def array_shape(x, name):
    """x's shape as a tuple, or a TypeError naming the argument for an object without one (a raw DLPack capsule,
    which fattn takes only where it allocates nothing from it)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected an array with a shape (a torch, NumPy, CuPy or JAX array), got "
                        f"{type(x).__name__}")
    return tuple(shape)


def bhs(shape, layout_code):
    """(B, H, S) of a 4-D q / out shape in the layout's order."""
    return (shape[0], shape[1], shape[2]) if layout_code == 0 else (shape[0], shape[2], shape[1])


def call_options(causal, scale, window, softcap, variant, causal_true="top_left"):
    """(causal code, scale, window, softcap, variant) as fattn._C takes them, each checked naming its argument;
    causal_true: what causal=True means (causal_code)."""
    return (causal_code(causal, causal_true), scale_value(scale), window_pair(window), softcap_value(softcap),
            variant_name(variant))


def refuse_jax(**arrays):
    for name, arr in arrays.items():
        if arr is not None and framework_of(arr) == "jax":
            raise TypeError(f"{name}: JAX arrays are immutable, so fattn cannot write into one; pass a writable "
                            "torch / CuPy / NumPy array")


def torch_registered():
    """Registers torch with fattn on the first torch tensor (a real import, also under torch.compile)."""
    if not _frameworks.torch_ready:
        from . import _torch  # noqa: F401


def traced_or_fake(q):
    """True under torch.compile or jit.trace tracing, and for fake or meta tensors: the call must be the registered
    op."""
    return (_frameworks.is_compiling() or type(q) is not _frameworks.torch_tensor or q.is_meta
            or _frameworks.is_tracing())


def refuse_dual(**tensors):
    """NotImplementedError naming the first torch tensor that carries a forward-mode AD tangent (fattn would
    silently give its output none)."""
    fad = _frameworks.forward_ad
    if fad is None or fad._current_level < 0:
        return
    for name, t in tensors.items():
        if isinstance(t, _frameworks.torch_tensor) and fad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(f"{name}: forward-mode AD (a dual tensor) is not supported by fattn; use "
                                      "reverse mode (backward / torch.autograd.grad)")


def autocast(q, *rest):
    """(q, *rest) as torch.autocast hands a call's inputs to torch SDPA: under autocast for q's device (cuda / cpu),
    each floating torch tensor other than float64 in the autocast dtype (a cast autograd records); otherwise
    unchanged.  The caller skips it for calls given arrays to write (out=, dq=): torch autocasts no call with out=.
    Outside torch.compile one global flag is read first, so calls without autocast pay nothing more."""
    if not (_frameworks.is_compiling() or _frameworks.any_autocast()):
        return (q, *rest)
    kind = "cuda" if q.is_cuda else "cpu"
    if not _frameworks.autocast_on(kind):
        return (q, *rest)
    return _cast_floating(_frameworks.autocast_dtype(kind), (q, *rest))


def as_forward_ran(out, *arrays):
    """The backward's torch arrays (q, k, v, dout) in the dtype its forward computed in, out's: a forward under
    torch.autocast cast float32 inputs (autocast above), which a backward outside autocast -- an autograd Function's,
    without torch.amp.custom_bwd -- receives as saved.  Only floating torch tensors other than float64 are cast, and
    only where out is float16 / bfloat16; nothing changes when the dtypes already agree."""
    if not isinstance(out, _frameworks.torch_tensor) or out.dtype.itemsize != 2:
        return arrays
    return _cast_floating(out.dtype, arrays)


def _cast_floating(dt, arrays):
    """arrays with each floating torch tensor other than float64 in dtype dt (autograd records the casts)."""
    return tuple(t.to(dt) if isinstance(t, _frameworks.torch_tensor) and t.is_floating_point()
                 and t.dtype != dt and t.dtype != _frameworks.torch_float64 else t for t in arrays)


def refuse_requires_grad(reason, **tensors):
    """While grad mode is on, ValueError "<name>: requires grad, but <reason>" for the first of tensors that requires
    grad: arrays a call writes where autograd cannot see, or takes where it records nothing."""
    if not _frameworks.grad_enabled():
        return
    for name, t in tensors.items():
        if getattr(t, "requires_grad", False):
            raise ValueError(f"{name}: requires grad, but {reason}")


def refuse_grad_buffers(**buffers):
    """The backward's given gradient buffers (dq=, dk=, dv=): written in place where autograd cannot see (torch
    refuses such a write to a leaf too)."""
    refuse_requires_grad("the backward writes it in place outside autograd; pass a tensor that does not require "
                         "grad, or call under torch.no_grad()", **buffers)


def refuse_vmap():
    raise NotImplementedError("q: torch.func.vmap (also under jacrev, jacfwd, hessian) is not supported by fattn; "
                              "put the batch in q's B dimension, or loop")


def refuse_transforms():
    """NotImplementedError inside torch.func's vmap (jacrev, jacfwd and hessian use it) or jvp: fattn has no batching
    or forward-mode rule.  True inside its grad or vjp, which work: the call must take the op's Function (the
    transform's tensors are wrappers without memory, even those that need no gradient); else False."""
    if _frameworks.is_compiling() or not in_transform():
        return False  # (under torch.compile the traced op takes the call: no transform's interpreter to read)
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    kinds = {i.key().name for i in retrieve_all_functorch_interpreters()}
    if "Vmap" in kinds:
        refuse_vmap()
    if "Jvp" in kinds:
        raise NotImplementedError("q: forward-mode AD (torch.func.jvp, jacfwd) is not supported by fattn; use "
                                  "reverse mode (torch.func.grad, vjp, or backward)")
    return True


def needs_torch_op(q, k, v, out=None, lse=None):
    """True when a torch call must go through the registered op (or its eager Function): traced_or_fake, or gradients
    to record (a torch.func transform: refuse_transforms says) -- an out= or lse= that requires grad included, which
    the op path writes by copy_, so that autograd records the write (or refuses it, for a leaf).  Plain tensors take
    the lean path."""
    return traced_or_fake(q) or (_frameworks.grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in (q, k, v, out, lse)))


def in_transform():
    """True inside a torch.func transform (grad, vjp: vmap and jvp are refused before)."""
    return _frameworks.functorch_top is not None and _frameworks.functorch_top() is not None


def device_of(fw, q):
    """(DLPack device type, device id) of q: torch's get_device() for CUDA torch tensors (the C intake refuses other
    devices' -- mps, xpu -- which are taken for the CPU here), else DLPack's."""
    if fw == "torch":
        return (_frameworks.CUDA, q.get_device()) if q.is_cuda else (_frameworks.CPU, 0)
    return _C.dlpack_device(q)


def same_device(q, **others):
    """Each of others (torch tensors or None) on q's device."""
    for name, t in others.items():
        if t is None:
            continue
        if framework_of(t) != "torch":
            raise TypeError(f"{name}: expected a torch tensor like q, got {type(t).__module__}.{type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}; all arrays must be on one device")


def torch_results(q, k, v, layout, out, lse, **seq):
    """out= and lse= (None: not taken) of a call through the registered op, which writes them by copy_ (that would
    cast, broadcast, or overwrite k): checked as the lean path checks them, by the C intake itself
    (_C.check_forward: devices, dtypes, shapes in `layout` -- None: packed, with `seq` its cu_seqlens and
    max_seqlen --, and memory shared with q, k, v or itself).  Under torch.compile, which cannot trace that call,
    their devices, dtypes and shapes are checked here (not memory: the traced call computes its result before it
    copies it into out, so an out= over k there gives the right values and then overwrites k, as asked)."""
    if out is None and lse is None:
        return
    same_device(q, out=out, lse=lse)
    if not _frameworks.is_compiling():
        _C.check_forward(q, k, v, q if out is None else out, lse, layout=layout or 0, **seq)
        return
    if out is not None:
        if out.dtype != q.dtype:
            raise TypeError(f"out: dtype {str(out.dtype)[6:]} differs from q's {str(q.dtype)[6:]}; q, k, v and out "
                            "must share one dtype")
        if out.shape != q.shape:
            raise ValueError(f"out: shape {tuple(out.shape)} differs from q's {tuple(q.shape)}")
    if lse is not None:
        if str(lse.dtype) != "torch.float32":
            raise TypeError("lse: dtype must be float32")
        want = bhs(tuple(q.shape), layout)
        if tuple(lse.shape) != want:
            raise ValueError(f"lse: shape must be (B={want[0]}, H={want[1]}, Sq={want[2]}), got {tuple(lse.shape)}")


def sinks_arg(sinks, q, fw, heads):
    """None, or sinks as fattn._C takes them, checked before anything runs (a refused call writes nothing, a KV cache
    included): an array of q's framework and device, float32 (H,); a torch tensor detached (DLPack refuses one
    that requires grad; gradients go through the registered op).  C checks them again where it reads them."""
    if sinks is None:
        return None
    if framework_of(sinks) != fw:
        raise TypeError(f"sinks: expected an array of q's framework ({fw}), got {type(sinks).__name__}")
    shape = tuple(sinks.shape)
    if shape != (heads,):
        raise ValueError(f"sinks: expected a 1-D array of H={heads} entries, got shape {shape}")
    if not str(sinks.dtype).endswith("float32"):
        raise TypeError(f"sinks: dtype must be float32, got {str(sinks.dtype).removeprefix('torch.')}")
    if device_of(fw, sinks) != device_of(fw, q):
        raise ValueError("sinks: not on q's device; all arrays must be on one device")
    return sinks.detach() if fw == "torch" else sinks


def alibi_arg(alibi_slopes, fw):
    """None, or ALiBi's slopes as fattn._C takes them: an array of q's framework (its shape (H,) or (B, H), float32
    and device are checked in C, naming alibi_slopes); a torch tensor detached (the slopes get no gradient)."""
    if alibi_slopes is None:
        return None
    if framework_of(alibi_slopes) != fw:
        raise TypeError(f"alibi_slopes: expected an array of q's framework ({fw}), got {type(alibi_slopes).__name__}")
    return alibi_slopes.detach() if fw == "torch" else alibi_slopes


def sinks_need_grad(sinks):
    """True when torch sinks require grad (the call must then be the registered op)."""
    return sinks is not None and _frameworks.grad_enabled() and bool(getattr(sinks, "requires_grad", False))
