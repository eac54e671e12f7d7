"""fattn's public API for dense batches: attention(), attention_backward(), variants().  (Variable-length batches
and KV caches: _serving.py; the argument rules: _args.py.)"""
from . import _C, _args, _frameworks, _tuned
from ._args import CAUSAL, LAYOUT  # noqa: F401  (the codes, for callers of fattn._C)
from ._frameworks import CPU, CUDA, EMPTY, current_stream, framework_of


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", window=(-1, -1), softcap=0.0, out=None,
              return_lse=False, variant=None, lse=None, deterministic=False, sinks=None, alibi_slopes=None):
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
            (a Python or NumPy scalar, or a 0-d array or tensor, read as a constant: no gradient reaches it, and
            under torch.compile a tensor scale is read by .item(), so pass a number there).
        layout: ``"bhsd"`` or ``"bshd"``; applies to q, k, v and out alike.
        window: ``(left, right)`` sliding window in keys around each query's position p (bottom-right aligned,
            p = i + Sk - Sq; top-left with ``causal="top_left"``): query i sees keys j with
            ``p - left <= j <= p + right``, -1 meaning unbounded on that side.  ``causal`` forces right = 0.
            Key blocks wholly outside the window are skipped, so the time is proportional to the window.
        softcap: ``c > 0`` caps the scores: each ``s = scale * q.k`` becomes ``c * tanh(s / c)`` before the softmax
            (Gemma 2, Grok); 0 means none.  Every variant takes it (v2 and v3 in score-modifying kernels of their
            own; v3's backward at head dims above 64, v2's at 64 and below).
        alibi_slopes: optional float32 ``(H,)`` or ``(B, H)``: ALiBi (Press et al.), adding
            ``-slope * |p - j|`` to the score of query i and key j after the softcap, p = i + Sk - Sq (bottom-right,
            whatever ``causal`` says: flash-attention's rule).  Not differentiable (the slopes are constants).  Every
            variant takes it, forward and backward.
        out: optional writable array of q's shape and dtype to write into; otherwise one is allocated by the
            caller's framework (torch in, torch out; CuPy in, CuPy out; NumPy in, NumPy out).
        return_lse: also return the log-sum-exp of each row, float32 ``(B, H, Sq)``, natural log.
        variant: which implementation; ``fattn.variants(device)`` lists them.  Default: the fastest for the
            device (``"cpu"`` on the CPU).
        lse: optional writable float32 ``(B, H, Sq)`` array for the LSE (implies return_lse).
        deterministic: torch autograd only: the backward gives bitwise-repeatable gradients (no order-dependent
            atomics; slower on the GPU).  Also on when ``torch.use_deterministic_algorithms(True)``.
        sinks: optional float32 ``(H,)``: attention sinks (gpt-oss), a logit per head that joins every row's
            softmax denominator and attends to nothing; differentiable.  out and lse are then the sink-adjusted
            ones (csrc/sinks.h: v3 applies them in its epilogue, v2 where it merges key splits, the rest by a pass
            after the kernel).

    Gradients: with torch tensors that require grad, eager calls go through an autograd Function over fattn's
    kernels, and traced ones (torch.compile, torch.export, FakeTensor and meta tensors) through the registered op
    ``torch.ops.fattn.attention``; the backward is :func:`attention_backward` either way.  The LSE is not
    differentiable, nor are forward-mode AD and torch.func.vmap supported (torch.func.grad and vjp are).  Other frameworks call
    :func:`attention_backward` themselves (JAX: ``fattn.jax.attention``).

    Returns:
        ``out``, or ``(out, lse)`` with return_lse.  Computation runs on the caller's current CUDA stream
        (torch / CuPy); nothing synchronises.

    Raises:
        TypeError / ValueError naming the offending argument for bad input; RuntimeError for errors from the
        kernels or the CUDA runtime (never left pending).
    """
    causal_code, scale, window, softcap, variant = _args.call_options(causal, scale, window, softcap, variant)
    layout_code = _args.layout_code(layout)

    fw = framework_of(q)
    if fw == "torch":
        _args.torch_registered()
        _args.refuse_dual(q=q, k=k, v=v, sinks=sinks)
        if out is None:
            q, k, v = _args.autocast(q, k, v)
        if _args.refuse_transforms() or _args.needs_torch_op(q, k, v, out, lse) or _args.sinks_need_grad(sinks):
            return _torch_op(q, k, v, causal_code, scale, layout_code, window, softcap, variant, deterministic, out,
                             lse, return_lse, sinks, alibi_slopes)
        dev_type, dev_id = (CUDA, q.get_device()) if q.is_cuda else (CPU, 0)  # mps / xpu: refused by the C intake
    else:
        dev_type, dev_id = _C.dlpack_device(q)
    if out is not None or lse is not None:
        _args.refuse_jax(out=out, lse=lse)

    want_lse = return_lse or lse is not None
    given = out, lse  # the caller's, written in place (torch: their version counters advance)
    if out is None or ((want_lse or sinks is not None) and lse is None):
        if not hasattr(q, "shape"):  # a raw DLPack capsule: nothing to allocate the results by (it says so)
            EMPTY["other"](q, (), False, "out")
        shape = tuple(q.shape)
        if len(shape) != 4:
            raise ValueError(f"q: expected a 4-D array ({'B, H, S, D' if layout_code == 0 else 'B, S, H, D'}), "
                             f"got {len(shape)}-D")
        if out is None:
            out = EMPTY[fw](q, shape, False, "out")
        if (want_lse or sinks is not None) and lse is None:
            lse = EMPTY[fw](q, _args.bhs(shape, layout_code), True, "lse")  # the sinks need it even when not returned

    if (dev_type, dev_id) not in _tuned.LOADED:
        _tuned.ensure(dev_type, dev_id)
    stream = current_stream(fw, dev_id) if dev_type == CUDA else None
    sinks = _args.sinks_arg(sinks, q, fw, _args.bhs(q.shape, layout_code)[1]) if sinks is not None else None
    _C.forward(q, k, v, out, lse, causal=causal_code, scale=scale, layout=layout_code, window=window, softcap=softcap,
               variant=variant, stream=stream, alibi_slopes=_args.alibi_arg(alibi_slopes, fw), sinks=sinks)
    if fw == "torch":
        _frameworks.written_in_place(*given)
    return (out, lse) if want_lse else out


def _torch_op(q, k, v, causal, scale, layout, window, softcap, variant, deterministic, out, lse, return_lse,
              sinks=None, alibi_slopes=None):
    """The call through torch.ops.fattn.attention: what autograd, torch.compile, torch.export, torch.jit.trace,
    FakeTensor and meta tensors need."""
    from . import _torch

    alibi_slopes = _args.alibi_arg(alibi_slopes, "torch")
    _args.same_device(q, k=k, v=v, sinks=sinks, alibi_slopes=alibi_slopes)
    _args.torch_results(q, k, v, layout, out, lse)
    left, right = window or (-1, -1)
    o, lse_out = _torch.attention_call(q, k, v, causal, scale, layout, left, right, softcap, None, None, 0, 0, variant,
                                       bool(deterministic), sinks, alibi_slopes, True)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(lse_out)
        lse_out = lse
    return (o, lse_out) if (return_lse or lse is not None) else o


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, layout="bhsd", window=(-1, -1),
                       softcap=0.0, dq=None, dk=None, dv=None, deterministic=False, variant=None, sinks=None,
                       alibi_slopes=None):
    r"""Gradients of :func:`attention`: ``(dq, dk, dv)`` from the gradient ``dout`` of its output; with ``sinks``,
    ``(dq, dk, dv, dsinks)`` (dsinks float32 ``(H,)``).

    Arguments are DLPack arrays on one device, as for :func:`attention`; q, k, v, causal, scale, layout and variant
    (and window, softcap, alibi_slopes) must be those of the forward call, and out and lse what it returned
    (``attention(..., return_lse=True)``).
    FlashAttention-2's backward: P is recomputed from q, k and lse, never stored.

    Args:
        dout: the gradient of out, out's shape and dtype.
        dq, dk, dv: optional writable arrays of q's, k's and v's shapes and dtype to write into; otherwise allocated
            by the caller's framework.  With grouped-query attention dk and dv are the sums over each group's query
            heads.  They must not share memory with q, k, v, out, dout, lse or one another (slices of one fused
            buffer that do not share memory are fine).
        deterministic: bitwise-repeatable gradients (on the GPU: dQ's float32 sums added in a fixed order -- v3
            in key-block order, descending under a causal mask, staggered without one at head dims to 64 and at
            256, there alternating between two float32 copies summed in order (a workspace twice dQ's accumulator);
            v2 by a separate dQ pass; slower).  The CPU backend is always deterministic.

    With sinks, out and lse are the sink-adjusted ones the forward returned (the same backward kernels then give dq,
    dk, dv).  Rows that see no key get zero gradients.  Runs on the caller's current CUDA stream; a GPU call's float32
    workspace is allocated by the caller's framework (so it is safe under CUDA graph capture).  dQ is summed in
    float32 and rounded once, except in the Hopper backward's calls of few key blocks (at most 8, or 16 under a causal
    mask: 1024 / 2048 keys, half that at head dims above 128; no softcap / ALiBi, not packed), which add each key
    block's dQ, in the dtype, straight into dq: one rounding per key block (README.md).
    """
    causal_code, scale, window, softcap, variant = _args.call_options(causal, scale, window, softcap, variant)
    layout_code = _args.layout_code(layout)
    fw = framework_of(q)
    if fw == "torch":
        _args.torch_registered()
        if dq is None and dk is None and dv is None:  # in the dtype the forward ran in (under torch.autocast)
            q, k, v, dout = _args.as_forward_ran(out, q, k, v, dout)
        _args.refuse_grad_buffers(dq=dq, dk=dk, dv=dv)
        if _args.traced_or_fake(q):
            from . import _torch

            if dq is not None or dk is not None or dv is not None:
                raise ValueError("dq: cannot write into given arrays under torch.compile or with fake tensors")
            left, right = window or (-1, -1)
            g = _torch.attention_backward(dout, q, k, v, out, lse, causal_code, scale, layout_code, left, right,
                                          softcap, None, None, 0, 0, variant, bool(deterministic), sinks,
                                          _args.alibi_arg(alibi_slopes, fw))
            return g if sinks is not None else g[:3]
    dev_type, dev_id = _args.device_of(fw, q)
    _args.refuse_jax(dq=dq, dk=dk, dv=dv)
    grads = []
    for name, like, given in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        if given is None:
            if len(like.shape) != 4:
                raise ValueError(f"{'q' if name == 'dq' else name[1]}: expected a 4-D array "
                                 f"({'B, H, S, D' if layout_code == 0 else 'B, S, H, D'}), got {len(like.shape)}-D")
            given = EMPTY[fw](like, tuple(like.shape), False, name)
        grads.append(given)
    workspace, stream = None, None
    if dev_type == CUDA:
        stream = current_stream(fw, dev_id)
        nbytes = _C.backward_workspace_bytes(*_args.bhs(q.shape, layout_code), q.shape[3], bool(deterministic))
        workspace = EMPTY[fw](q, (nbytes // 4,), True, "workspace", False)
    sinks = _args.sinks_arg(sinks, q, fw, _args.bhs(q.shape, layout_code)[1]) if sinks is not None else None
    dsinks = EMPTY[fw](q, (sinks.shape[0],), True, "dsinks", False) if sinks is not None else None
    _C.backward(dout, q, k, v, out, lse, *grads, causal=causal_code, scale=scale, layout=layout_code, window=window,
                softcap=softcap, variant=variant, stream=stream, deterministic=bool(deterministic),
                workspace=workspace, alibi_slopes=_args.alibi_arg(alibi_slopes, fw), sinks=sinks, dsinks=dsinks)
    if fw == "torch":
        _frameworks.written_in_place(dq, dk, dv)  # the caller's (None: made here)
    return tuple(grads) + ((dsinks,) if sinks is not None else ())


def _parse_device(device):
    """'cpu' / 'cpu:N' / 'cuda' / 'cuda:N' / torch.device / (dlpack_type, id) / an array -> ('cpu'|'cuda', id)."""
    if hasattr(device, "__dlpack_device__"):
        t, i = device.__dlpack_device__()
        return ("cuda" if t == CUDA else "cpu"), (i if t == CUDA else 0)
    if isinstance(device, tuple) and len(device) == 2:
        return ("cuda" if device[0] == CUDA else "cpu"), int(device[1])
    text = str(device)
    if text == "cpu" or (text.startswith("cpu:") and text[4:].isdigit()):  # torch.device("cpu", 0) reads "cpu:0"
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
