"""fattn's API for packed variable-length batches (flash-attention's conventions, what vLLM, SGLang and packed
training call): attention_varlen() and attention_varlen_backward()."""
import operator

from . import _C, _args, _frameworks, _indices, _tuned
from ._frameworks import CUDA, EMPTY, current_stream, framework_of


def _given(value, name):
    """A max_seqlen argument: an int (under torch.compile a symbolic one, kept as it is: converting it would
    specialise the graph on its value) or another integer scalar as an int (NumPy's, e.g. np.diff(cu).max()), or
    None."""
    if value is None:
        return None
    n = value
    if not isinstance(value, int) and type(value).__name__ != "bool_":
        try:
            n = operator.index(value)
        except TypeError:
            n = None
    if n is None or isinstance(value, bool) or type(value).__name__ == "bool_" or n < 0:
        raise TypeError(f"{name}: expected an int >= 0 or None, got {value!r}")
    return n


class _Lengths:
    """A packed call's max_seqlen pair (a max_seqlen not given: the longest sequence, read from cu_seqlens) and
    whether its cu_seqlens are still to be checked: not with check_indices=False, nor when an earlier call checked
    these same, unchanged arrays against the same row counts and max_seqlen arguments (fattn/_indices.py).
    Remembered only where a stale entry could at worst skip a check: both max_seqlen given (one read from the arrays
    would go stale with them), no seqused_k (the call reads it itself), not under torch.compile (the traced op checks
    as told), with gradients only where the backward can trust the forward's check (fattn/_torch.py: torch
    refuses it if the arrays were written since; not under saved-tensor hooks).  need: which of (max_q, max_k) the caller must know; a checking call works
    out the others itself from the one read it makes (None here), a read saved."""

    def __init__(self, cu_q, cu_k, q, k, max_seqlen_q, max_seqlen_k, check_indices, rememberable, stream,
                 need=(True, True)):
        self.arrays = cu_q, cu_k
        given = _given(max_seqlen_q, "max_seqlen_q"), _given(max_seqlen_k, "max_seqlen_k")
        if not check_indices and None in given:
            missing = "max_seqlen_q" if given[0] is None else "max_seqlen_k"
            raise ValueError(f"{missing}: needed (both max_seqlen_q and max_seqlen_k) when check_indices=False: "
                             "cu_seqlens are then not read")
        self.against = tuple(getattr(x, "shape", (None,))[0] for x in (q, k)), given  # what the check compares
        self.check, self.stamps = _indices.to_check(self.arrays, self.against, check_indices,
                                                    rememberable and None not in given)
        self.max_q, self.max_k = (g if g is not None else _C.longest_sequence(cu, stream, name) if needed else None
                                  for g, cu, needed, name in zip(given, self.arrays, need,
                                                                 ("cu_seqlens_q", "cu_seqlens_k")))

    def checked(self):
        """After the call succeeded: the arrays it checked are remembered."""
        _indices.remember(self.arrays, self.against, self.stamps)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
                     causal=False, scale=None, window=(-1, -1), softcap=0.0, out=None, return_lse=False, variant=None,
                     deterministic=False, sinks=None, alibi_slopes=None, check_indices=True):
    r"""Attention over a batch of packed sequences of different lengths (no padding).

    Args:
        q: ``(total_q, H, D)``, the batch's queries one sequence after another; k, v: ``(total_k, H_kv, D)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` prefix sums: sequence b's queries are rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (and its keys rows of k, v likewise).  Checked when called
            (non-decreasing, within the arrays): on a GPU that reads them back (a small synchronous copy).
        max_seqlen_q, max_seqlen_k: the longest sequences (computed from cu_seqlens when None).
        seqused_k: optional int32 ``(batch,)``: sequence b uses only its first ``seqused_k[b]`` keys (vLLM's).
        causal, scale, window, softcap, variant, deterministic, sinks: as for :func:`fattn.attention`, per sequence,
            except that ``causal=True`` means ``"bottom_right"`` here (flash-attention's varlen convention: each
            sequence's queries are its last positions); ``"top_left"`` still asks for top-left.  Windows are
            bottom-right aligned within each sequence.
        alibi_slopes: optional float32 ``(H,)`` or ``(batch, H)`` (one row per sequence): ALiBi as for
            :func:`fattn.attention`, positions counted within each sequence.
        out: optional ``(total_q, H, D)`` array to write; return_lse: also return the LSE, float32 ``(H, total_q)``.
        check_indices: ``True`` (default): cu_seqlens (and seqused_k) are read back and checked before anything runs
            -- on a GPU a small synchronous copy.  With max_seqlen_q and max_seqlen_k given, checked cu_seqlens are
            remembered (not under torch.compile): a later call with the same torch tensors (or JAX arrays),
            unchanged since by torch's version counter, and the same row counts and max_seqlen arguments reads
            nothing (fattn/_indices.py; a tensor written behind torch's back, e.g. by a CUDA graph's replay, needs a
            new tensor or ``False``).  ``False`` with max_seqlen_q and max_seqlen_k
            given: their values are trusted (no host sync, in the backward of a call that records gradients too; an
            offset outside the arrays is then undefined behaviour, as in flash-attention).

    Differentiable with torch autograd (the registered op) and through :func:`attention_varlen_backward`.  Through
    autograd (eager or compiled) the backward trusts the forward's check of cu_seqlens and reads nothing: torch
    refuses the backward ("modified by an inplace operation") if they were written in place since the forward;
    under saved-tensor hooks (``torch.autograd.graph.save_on_cpu``), where torch checks no version, the backward
    checks them again.  On the
    GPU both run v3 on Hopper (v2 elsewhere; at head dim 64 a backward with a softcap or ALiBi runs v2's).
    """
    causal_code, scale, window, softcap, variant = _args.call_options(causal, scale, window, softcap, variant,
                                                                      "bottom_right")
    fw = framework_of(q)
    if len(_args.array_shape(q, "q")) != 3:
        raise ValueError(f"q: expected a 3-D packed array (total, H, D), got {len(q.shape)}-D")
    if fw == "torch":
        _args.torch_registered()
        _args.refuse_dual(q=q, k=k, v=v, sinks=sinks)
        if out is None:
            q, k, v = _args.autocast(q, k, v)
        if _args.refuse_transforms() or _args.needs_torch_op(q, k, v, out) or _args.sinks_need_grad(sinks):
            from . import _torch

            traced = _args.traced_or_fake(q)
            if traced and (max_seqlen_q is None or max_seqlen_k is None):
                raise ValueError(f"{'max_seqlen_q' if max_seqlen_q is None else 'max_seqlen_k'}: needed (both "
                                 "max_seqlen_q and max_seqlen_k) under torch.compile, torch.export and for fake or "
                                 "meta tensors: cu_seqlens cannot be read while tracing")
            # remembered only where the backward may trust the forward (fattn/_torch.py); never when traced
            watched = not traced and _torch.watchable_indices((cu_seqlens_q, cu_seqlens_k))
            # a max_seqlen not given is read from cu_seqlens on the caller's current stream, as the lean path reads it
            stream = current_stream(fw, q.get_device()) if not traced and q.is_cuda else None
            lens = _Lengths(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k, check_indices, watched,
                            stream)
            if seqused_k is not None:
                raise ValueError("seqused_k: not taken with gradients or under torch.compile (a KV cache is "
                                 "inference only)")

            alibi_slopes = _args.alibi_arg(alibi_slopes, fw)
            _args.same_device(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              alibi_slopes=alibi_slopes)
            _args.torch_results(q, k, v, None, out, None, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=lens.max_q, max_seqlen_k=lens.max_k)
            left, right = window or (-1, -1)
            o, lse = _torch.attention_call(q, k, v, causal_code, scale, 0, left, right, softcap, cu_seqlens_q,
                                           cu_seqlens_k, lens.max_q, lens.max_k, variant, bool(deterministic), sinks,
                                           alibi_slopes, lens.check)
            lens.checked()
            if out is not None:
                out.copy_(o)
                o = out
            return (o, lse) if return_lse else o
    dev_type, dev_id = _args.device_of(fw, q)
    stream = current_stream(fw, dev_id) if dev_type == CUDA else None
    lens = _Lengths(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k, check_indices, seqused_k is None,
                    stream, need=(False, False))
    _args.refuse_jax(out=out)
    given_out = out  # the caller's, written in place (torch: its version counter advances)
    if out is None:
        out = EMPTY[fw](q, tuple(q.shape), False, "out")
    lse = EMPTY[fw](q, (q.shape[1], q.shape[0]), True, "lse", False) if return_lse or sinks is not None else None
    if (dev_type, dev_id) not in _tuned.LOADED:
        _tuned.ensure(dev_type, dev_id)
    sinks = _args.sinks_arg(sinks, q, fw, q.shape[1])
    _C.forward(q, k, v, out, lse, causal=causal_code, scale=scale, window=window, softcap=softcap, variant=variant,
               stream=stream, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
               max_seqlen_q=lens.max_q, max_seqlen_k=lens.max_k, alibi_slopes=_args.alibi_arg(alibi_slopes, fw),
               check_indices=lens.check, sinks=sinks)
    lens.checked()
    if fw == "torch":
        _frameworks.written_in_place(given_out)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, causal=False, scale=None, window=(-1, -1), softcap=0.0, dq=None,
                              dk=None, dv=None, deterministic=False, variant=None, sinks=None, alibi_slopes=None,
                              check_indices=True):
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen` (packed like q, k, v) from dout, given its out and lse
    (``return_lse=True``); the other arguments must be the forward's.  With sinks, ``(dq, dk, dv, dsinks)``.
    check_indices=False (max_seqlen_q / max_seqlen_k given): cu_seqlens are trusted, no host sync; checked ones are
    remembered as in :func:`attention_varlen`."""
    causal_code, scale, window, softcap, variant = _args.call_options(causal, scale, window, softcap, variant,
                                                                      "bottom_right")
    fw = framework_of(q)
    if fw == "torch":
        _args.torch_registered()
        if dq is None and dk is None and dv is None:  # in the dtype the forward ran in (under torch.autocast)
            q, k, v, dout = _args.as_forward_ran(out, q, k, v, dout)
        _args.refuse_grad_buffers(dq=dq, dk=dk, dv=dv)
    dev_type, dev_id = _args.device_of(fw, q)
    stream = current_stream(fw, dev_id) if dev_type == CUDA else None
    lens = _Lengths(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k, check_indices, True, stream,
                    need=(dev_type == CUDA, False))  # the GPU workspace's size
    _args.refuse_jax(dq=dq, dk=dk, dv=dv)
    grads = [g if g is not None else EMPTY[fw](x, tuple(x.shape), False, name)
             for g, x, name in ((dq, q, "dq"), (dk, k, "dk"), (dv, v, "dv"))]
    workspace = None
    if dev_type == CUDA:
        nseq = cu_seqlens_q.shape[0] - 1
        nbytes = _C.backward_workspace_bytes(nseq, q.shape[1], lens.max_q, q.shape[2], bool(deterministic))
        workspace = EMPTY[fw](q, (nbytes // 4,), True, "workspace", False)
    sinks = _args.sinks_arg(sinks, q, fw, q.shape[1])
    dsinks = EMPTY[fw](q, (sinks.shape[0],), True, "dsinks", False) if sinks is not None else None
    _C.backward(dout, q, k, v, out, lse, *grads, causal=causal_code, scale=scale, window=window, softcap=softcap,
                variant=variant, stream=stream, deterministic=bool(deterministic), workspace=workspace,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=lens.max_q, max_seqlen_k=lens.max_k,
                alibi_slopes=_args.alibi_arg(alibi_slopes, fw), check_indices=lens.check, sinks=sinks,
                dsinks=dsinks)
    lens.checked()
    if fw == "torch":
        _frameworks.written_in_place(dq, dk, dv)
    return tuple(grads) + ((dsinks,) if sinks is not None else ())
