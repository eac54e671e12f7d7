"""fattn's public API: attention(), attention_backward() and variants()."""
from . import _C
from . import _frameworks, _tuned
from ._frameworks import CPU, CUDA, EMPTY, current_stream, framework_of

CAUSAL = {False: 0, None: 0, True: 1, "top_left": 1, "bottom_right": 2}
LAYOUT = {"bhsd": 0, "bshd": 1}


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", window=(-1, -1), out=None, return_lse=False,
              variant=None, lse=None, deterministic=False):
    r"""Scaled dot-product attention, ``softmax(q k^T * scale) v``, computed by fattn's kernels.

    Arguments are any DLPack arrays (torch, CuPy, NumPy, ...), all on one device (CPU or one CUDA GPU), in any
    strides whose last dimension is contiguous: they are read in place, never copied.

    Args:
        q: ``(B, H, Sq, D)`` for layout ``"bhsd"`` (torch SDPA's), ``(B, Sq, H, D)`` for ``"bshd"``
            (flash-attention's).  float16, bfloat16 or float32; D a multiple of 8 up to 256.
        k, v: ``(B, H_kv, Sk, D)`` (or ``(B, Sk, H_kv, D)``), same dtype as q.  H_kv may divide H
            (grouped-query / multi-query attention: query head i reads kv head ``i // (H // H_kv)``).
        causal: ``False``; ``True`` or ``"top_left"`` (torch SDPA's ``is_causal``: query i sees keys
            ``j <= i``); or ``"bottom_right"`` (flash-attention's, what a KV cache needs when Sq < Sk: query i
            sees keys ``j <= i + Sk - Sq``).  For Sq = 3, Sk = 5 (x = visible)::

                top_left        bottom_right
                x . . . .       x x x . .
                x x . . .       x x x x .
                x x x . .       x x x x x

            A query row that sees no key (bottom-right with Sq > Sk, or Sk = 0) gives output 0 and LSE -inf.
        scale: softmax scale; default ``1 / sqrt(D)``.  Any real number finite in float32, negative included
            (a Python or NumPy scalar, or a 0-d array).
        layout: ``"bhsd"`` or ``"bshd"``; applies to q, k, v and out alike.
        window: ``(left, right)`` sliding window in keys around each query's position p (bottom-right aligned,
            p = i + Sk - Sq; top-left with ``causal="top_left"``): query i sees keys j with
            ``p - left <= j <= p + right``, -1 meaning unbounded on that side.  ``causal`` forces right = 0.
            Key blocks wholly outside the window are skipped, so the time is proportional to the window.
        out: optional writable array of q's shape and dtype to write into; otherwise one is allocated by the
            caller's framework (torch in, torch out; CuPy in, CuPy out; NumPy in, NumPy out).
        return_lse: also return the log-sum-exp of each row, float32 ``(B, H, Sq)``, natural log.
        variant: which implementation; ``fattn.variants(device)`` lists them.  Default: the fastest for the
            device (``"cpu"`` on the CPU).
        lse: optional writable float32 ``(B, H, Sq)`` array for the LSE (implies return_lse).
        deterministic: torch autograd only: the backward gives bitwise-repeatable gradients (no order-dependent
            atomics; slower on the GPU).  Also on when ``torch.use_deterministic_algorithms(True)``.

    Gradients: with torch tensors that require grad, the call goes through the registered op
    ``torch.ops.fattn.attention`` (autograd, torch.compile, torch.export, FakeTensor and meta tensors all see it);
    the backward is :func:`attention_backward`.  The LSE is not differentiable.  Other frameworks call
    :func:`attention_backward` themselves (JAX: ``fattn.jax.attention``).

    Returns:
        ``out``, or ``(out, lse)`` with return_lse.  Computation runs on the caller's current CUDA stream
        (torch / CuPy); nothing synchronises.

    Raises:
        TypeError / ValueError naming the offending argument for bad input; RuntimeError for errors from the
        kernels or the CUDA runtime (never left pending).
    """
    try:
        causal_code = CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}") from None
    try:
        layout_code = LAYOUT[layout]
    except (KeyError, TypeError):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}") from None
    if variant is not None and not isinstance(variant, str):
        raise TypeError(f"variant: expected a str or None, got {type(variant).__name__}")
    if scale is not None and not isinstance(scale, float):
        scale = _as_float(scale)
    window = _window(window)

    fw = framework_of(q)
    if fw == "torch":
        if not _frameworks.torch_ready:
            from . import _torch  # noqa: F401  registers torch's types and the ops (a real import under torch.compile too)
        if (_frameworks.is_compiling() or type(q) is not _frameworks.torch_tensor or q.is_meta
                or _frameworks.is_tracing() or (_frameworks.grad_enabled() and (
                    q.requires_grad or getattr(k, "requires_grad", False) or getattr(v, "requires_grad", False)))):
            return _torch_op(q, k, v, causal_code, scale, layout_code, window, variant, deterministic, out, lse,
                             return_lse)
        dev = q.get_device()
        dev_type, dev_id = (CUDA, dev) if dev >= 0 else (CPU, 0)
    else:
        dev_type, dev_id = _C.dlpack_device(q)
    if out is not None or lse is not None:
        _refuse_jax(out, lse)

    if out is None or ((return_lse or lse is not None) and lse is None):
        shape = tuple(q.shape)
        if len(shape) != 4:
            raise ValueError(f"q: expected a 4-D array ({'B, H, S, D' if layout_code == 0 else 'B, S, H, D'}), "
                             f"got {len(shape)}-D")
        if out is None:
            out = EMPTY[fw](q, shape, False)
        if (return_lse or lse is not None) and lse is None:
            b, h, s = (shape[0], shape[1], shape[2]) if layout_code == 0 else (shape[0], shape[2], shape[1])
            lse = EMPTY[fw](q, (b, h, s), True)

    if (dev_type, dev_id) not in _tuned.LOADED:
        _tuned.ensure(dev_type, dev_id)
    stream = current_stream(fw, dev_id) if dev_type == CUDA else None
    _C.forward(q, k, v, out, lse, causal=causal_code, scale=scale, layout=layout_code, window=window, variant=variant,
               stream=stream)
    return (out, lse) if lse is not None else out


def _as_float(scale):
    """A scale given as any real scalar (int, NumPy scalar, 0-d array or tensor) as a float."""
    if isinstance(scale, bool) or getattr(scale, "ndim", 0) != 0 or not hasattr(scale, "__float__"):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    return float(scale)


def _window(window):
    """None (no window) or a (left, right) pair of ints >= -1, from what the caller gave."""
    if window is None:
        return None
    try:
        left, right = window
        left, right = int(left), int(right)
        ok = all(not isinstance(x, bool) and float(x).is_integer() for x in window)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise TypeError(f"window: expected a (left, right) pair of ints, got {window!r}")
    if left < -1 or right < -1:
        raise ValueError(f"window: ({left}, {right}): each side is a key count >= 0, or -1 for unbounded")
    return None if left == -1 and right == -1 else (left, right)


def _refuse_jax(out, lse, out_name="out"):
    for name, arr in ((out_name, out), ("lse", lse)):
        if arr is not None and framework_of(arr) == "jax":
            raise TypeError(f"{name}: JAX arrays are immutable, so fattn cannot write into one; pass a writable "
                            "torch / CuPy / NumPy array")


def _torch_op(q, k, v, causal, scale, layout, window, variant, deterministic, out, lse, return_lse):
    """The call through torch.ops.fattn.attention: what autograd, torch.compile, torch.export, torch.jit.trace,
    FakeTensor and meta tensors need (registered on first use)."""
    from . import _torch

    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device} but q is on {q.device}; all arrays must be on one device")
    left, right = window or (-1, -1)
    o, lse_out = _torch.attention(q, k, v, causal, scale, layout, left, right, variant, bool(deterministic))
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(lse_out)
        lse_out = lse
    return (o, lse_out) if (return_lse or lse is not None) else o


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, layout="bhsd", window=(-1, -1), dq=None,
                       dk=None, dv=None, deterministic=False, variant=None):
    r"""Gradients of :func:`attention`: ``(dq, dk, dv)`` from the gradient ``dout`` of its output.

    Arguments are DLPack arrays on one device, as for :func:`attention`; q, k, v, causal, scale, layout and variant
    (and window) must be those of the forward call, and out and lse what it returned (``attention(..., return_lse=True)``).
    FlashAttention-2's backward: P is recomputed from q, k and lse, never stored.

    Args:
        dout: the gradient of out, out's shape and dtype.
        dq, dk, dv: optional writable arrays of q's, k's and v's shapes and dtype to write into; otherwise allocated
            by the caller's framework.  With grouped-query attention dk and dv are the sums over each group's query
            heads.
        deterministic: bitwise-repeatable gradients (on the GPU: no order-dependent atomics, a separate dQ pass;
            slower).  The CPU backend is always deterministic.

    Rows that see no key get zero gradients.  Runs on the caller's current CUDA stream; a GPU call's float32
    workspace is allocated by the caller's framework (so it is safe under CUDA graph capture).
    """
    try:
        causal_code = CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}") from None
    try:
        layout_code = LAYOUT[layout]
    except (KeyError, TypeError):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}") from None
    if scale is not None and not isinstance(scale, float):
        scale = _as_float(scale)
    window = _window(window)
    fw = framework_of(q)
    if fw == "torch":
        if not _frameworks.torch_ready:
            from . import _torch  # noqa: F401
        if _frameworks.is_compiling() or type(q) is not _frameworks.torch_tensor or q.is_meta:
            from . import _torch

            if dq is not None or dk is not None or dv is not None:
                raise ValueError("dq: cannot write into given arrays under torch.compile or with fake tensors")
            left, right = window or (-1, -1)
            return _torch.attention_backward(dout, q, k, v, out, lse, causal_code, scale, layout_code, left, right,
                                             variant, bool(deterministic))
        dev = q.get_device()
        dev_type, dev_id = (CUDA, dev) if dev >= 0 else (CPU, 0)
    else:
        dev_type, dev_id = _C.dlpack_device(q)
    for name, arr in (("dq", dq), ("dk", dk), ("dv", dv)):
        if arr is not None and framework_of(arr) == "jax":
            _refuse_jax(arr, None, name)
    shapes = {}
    for name, like, given in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        if given is None:
            if len(like.shape) != 4:
                raise ValueError(f"{'q' if name == 'dq' else name[1]}: expected a 4-D array "
                                 f"({'B, H, S, D' if layout_code == 0 else 'B, S, H, D'}), got {len(like.shape)}-D")
            shapes[name] = EMPTY[fw](like, tuple(like.shape), False)
    dq, dk, dv = shapes.get("dq", dq), shapes.get("dk", dk), shapes.get("dv", dv)
    workspace, stream = None, None
    if dev_type == CUDA:
        stream = current_stream(fw, dev_id)
        b, x, y, d = q.shape
        h, sq = (x, y) if layout_code == 0 else (y, x)
        workspace = EMPTY[fw](q, (_C.backward_workspace_bytes(b, h, sq, d) // 4,), True)
    _C.backward(dout, q, k, v, out, lse, dq, dk, dv, causal=causal_code, scale=scale, layout=layout_code, window=window,
                variant=variant, stream=stream, deterministic=bool(deterministic), workspace=workspace)
    return dq, dk, dv


def _parse_device(device):
    """'cpu' / 'cuda' / 'cuda:N' / torch.device / (dlpack_type, id) / an array -> ('cpu'|'cuda', id)."""
    if hasattr(device, "__dlpack_device__"):
        t, i = device.__dlpack_device__()
        return ("cuda" if t == CUDA else "cpu"), (i if t == CUDA else 0)
    if isinstance(device, tuple) and len(device) == 2:
        return ("cuda" if device[0] == CUDA else "cpu"), int(device[1])
    text = str(device)
    if text in ("cpu",):
        return "cpu", 0
    if text.startswith("cuda"):
        _, _, idx = text.partition(":")
        if idx and not idx.isdigit():
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        return "cuda", int(idx) if idx else 0
    raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def variants(device="cpu"):
    """Names of the variants that can run on `device` ('cpu', 'cuda', 'cuda:N', a torch.device, or an array).

    Raises RuntimeError for a CUDA device when fattn was built without CUDA or no usable GPU is present."""
    kind, idx = _parse_device(device)
    return [name for name, _ in _C.variants(kind, idx)]


def describe_variants(device="cpu"):
    """[(name, one-line summary)] of the variants that run on `device`."""
    kind, idx = _parse_device(device)
    return list(_C.variants(kind, idx))


def cuda_available():
    """True if fattn was built with CUDA and a GPU can be used."""
    if not _C.cuda_compiled:
        return False
    try:
        return _C.cuda_device_count() > 0
    except RuntimeError:
        return False
