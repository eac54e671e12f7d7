"""fattn as torch custom operators, so that autograd, torch.compile, torch.export and FakeTensor see it.

    torch.ops.fattn.attention(q, k, v, causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q,
                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant, deterministic, sinks,
                              alibi_slopes, check_indices) -> (out, lse)
    torch.ops.fattn.attention_backward(dout, q, k, v, out, lse, <the same arguments>) -> (dq, dk, dv, dsinks)
    torch.ops.fattn.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, ...)
                                                                    -> (out, lse), k_cache / v_cache mutated

One pair serves dense calls ((B, H, S, D) or (B, S, H, D), lse (B, H, Sq)) and packed variable-length ones
(cu_seqlens given: (total, H, D), lse (H, total_q)).  With sinks (float32 (H,), differentiable) out and lse are the
sink-adjusted ones (csrc/sinks.h); without, dsinks is an empty tensor.  alibi_slopes (float32 (H,) or (B, H)) are
constants: no gradient.  check_indices=False (packed batches, max_seqlen given) reads no index back in either op:
no host sync per layer.  The forward's autograd formula saves q, k, v, out, lse (sinks, alibi_slopes) and calls the
backward op; lse is not differentiable.  Eager calls (nothing traced) take the same forward and backward through
_EagerAttention, a plain autograd.Function, without the op's per-call overhead (attention_call picks).  Both save
cu_seqlens, so the backward trusts the forward's check of them (torch refuses a backward whose saved tensors were
written in place since) and reads nothing back.  The ops' fake (meta) implementations give the shapes and, where
the sizes are static, check the call by C's own rules (_C.check_forward / check_backward: the tensors described,
index arrays not read), so that torch.compile and torch.export refuse what the eager call refuses.
Imported, and torch's types registered with the C side (the lean call path), by fattn.attention the first time a
torch tensor arrives; `import fattn` never imports torch.
"""
import torch

from . import _C, _args, _frameworks, _tuned
from ._frameworks import current_stream

_frameworks.register_torch(_C)

_LIB = "fattn"
Tensor = torch.Tensor


def _stream(t):
    """t's device's current stream (None on the CPU); and, once per process and device, the tuning cache's entries
    registered there (fattn/_tuned.py), as the lean path does -- every op calls this before it runs."""
    key = (_frameworks.CUDA, t.get_device()) if t.is_cuda else (_frameworks.CPU, 0)
    if key not in _tuned.LOADED:
        _tuned.ensure(*key)
    return current_stream("torch", key[1]) if key[0] == _frameworks.CUDA else None


# The op's arguments after q, k, v: twelve parameters (causal .. deterministic), then sinks, alibi_slopes and
# check_indices -- _SINKS is sinks' place among them.
_SINKS = 12


def _window(left, right):
    return None if left < 0 and right < 0 else (left, right)


def _lse_shape(q, layout, varlen):
    return (q.shape[1], q.shape[0]) if varlen else _args.bhs(q.shape, layout)


def _seq_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    if cu_seqlens_q is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k}


def _call_kw(causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k, variant, alibi_slopes, check_indices):
    """The keywords of _C.forward / _C.backward (and their check_ twins) for the op's arguments."""
    return dict(causal=causal, scale=scale, layout=layout, window=_window(window_left, window_right), softcap=softcap,
                variant=variant, alibi_slopes=alibi_slopes, check_indices=check_indices,
                **_seq_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _static(tensors, *ints):
    """True when every shape and stride of the tensors (None: absent) and every one of `ints` (the op's integer
    arguments: max_seqlen, window) is a plain int: the fake kernels then check their call through C's own rules
    (_C.check_forward / check_backward).  Symbolic values (dynamic shapes) are not read, which would specialise them;
    the op checks those calls when it runs."""
    return (all(type(x) is int for x in ints)
            and all(type(x) is int for t in tensors if t is not None for x in (*t.shape, *t.stride())))


def _out_lse(q, lse_shape):
    """A call's outputs as the op allocates them: out like q, lse float32 of lse_shape."""
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


def _grads_like(q, k, v, sinks):
    """A backward's outputs as the op allocates them: dq, dk, dv like q, k, v; dsinks like sinks (empty without)."""
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((0,), dtype=torch.float32) if sinks is None else torch.empty_like(sinks))


def _rows_contiguous(dout):
    """dout as the kernels take it: its last dimension contiguous (the expanded gradient of a sum() is not)."""
    return dout if dout.stride(-1) == 1 else dout.contiguous()


def _attention(q: Tensor, k: Tensor, v: Tensor, causal: int, scale: float | None, layout: int, window_left: int,
               window_right: int, softcap: float, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
               max_seqlen_q: int, max_seqlen_k: int, variant: str | None, deterministic: bool,
               sinks: Tensor | None = None, alibi_slopes: Tensor | None = None,
               check_indices: bool = True) -> tuple[Tensor, Tensor]:
    out, lse = _out_lse(q, _lse_shape(q, layout, cu_seqlens_q is not None))
    _C.forward(q, k, v, out, lse, stream=_stream(q), sinks=None if sinks is None else sinks.detach(),
               **_call_kw(causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, variant, alibi_slopes, check_indices))
    return out, lse


attention = torch.library.custom_op(f"{_LIB}::attention", mutates_args=())(_attention)


@attention.register_fake
def _(q, k, v, causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, variant, deterministic, sinks=None, alibi_slopes=None, check_indices=True):
    out, lse = _out_lse(q, _lse_shape(q, layout, cu_seqlens_q is not None))
    if _static((q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes), max_seqlen_q, max_seqlen_k, window_left,
               window_right):
        _C.check_forward(q, k, v, out, lse, sinks=sinks,
                         **_call_kw(causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant, alibi_slopes, check_indices))
    return out, lse


def _attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: int,
                       scale: float | None, layout: int, window_left: int, window_right: int, softcap: float,
                       cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                       variant: str | None, deterministic: bool,
                       sinks: Tensor | None = None, alibi_slopes: Tensor | None = None,
                       check_indices: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dsinks = _grads_like(q, k, v, sinks)
    workspace = None
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if q.is_cuda:
        b, h, sq = (cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q) if cu_seqlens_q is not None \
            else _args.bhs(q.shape, layout)
        workspace = q.new_empty((_C.backward_workspace_bytes(b, h, sq, q.shape[-1], deterministic) // 4,),
                                dtype=torch.float32)
    dout = _rows_contiguous(dout)
    sink_kw = {} if sinks is None else {"sinks": sinks.detach(), "dsinks": dsinks}
    _C.backward(dout, q, k, v, out, lse, dq, dk, dv, stream=_stream(q), deterministic=deterministic,
                workspace=workspace, **sink_kw,
                **_call_kw(causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, variant, alibi_slopes, check_indices))
    return dq, dk, dv, dsinks


attention_backward = torch.library.custom_op(f"{_LIB}::attention_backward", mutates_args=())(_attention_backward)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, variant, deterministic, sinks=None, alibi_slopes=None, check_indices=True):
    dq, dk, dv, dsinks = _grads_like(q, k, v, sinks)
    dout = _rows_contiguous(dout)
    if _static((dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes), max_seqlen_q, max_seqlen_k,
               window_left, window_right):
        sink_kw = {} if sinks is None else {"sinks": sinks, "dsinks": dsinks}
        _C.check_backward(dout, q, k, v, out, lse, dq, dk, dv, **sink_kw,
                          **_call_kw(causal, scale, layout, window_left, window_right, softcap, cu_seqlens_q,
                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant, alibi_slopes, check_indices))
    return dq, dk, dv, dsinks


# The op's parameters after q, k, v that hold cu_seqlens_q and cu_seqlens_k (None for dense calls).
_CU = slice(6, 8)


def _setup_context(ctx, inputs, output):
    """Saves what the backward needs, cu_seqlens among them: torch then refuses the backward if they were written in
    place since the forward (its saved-tensor version check; compiled graphs' saved inputs too), so the backward
    trusts the forward's check instead of reading them back again."""
    q, k, v, *params = inputs
    out, lse = output
    sinks = params[_SINKS] if len(params) > _SINKS else None
    alibi_slopes = params[_SINKS + 1] if len(params) > _SINKS + 1 else None
    ctx.check_indices = params[_SINKS + 2] if len(params) > _SINKS + 2 else True
    cu = tuple(params[_CU]) if watchable_indices(params[_CU]) else ()
    ctx.save_for_backward(q, k, v, out, lse, sinks, alibi_slopes, *cu)
    ctx.params = params[:_SINKS]
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)


def watchable_indices(cu):
    """True for cu_seqlens (a pair) whose in-place writes torch's saved-tensor check will refuse and whose read costs
    a sync: CUDA torch tensors, saveable (an inference tensor is not), saved without saved-tensor hooks
    (torch.autograd.graph.save_on_cpu, checkpointing and other saved_tensors_hooks: with hooks torch checks no
    version).  Only such arrays may skip the forward's check (remembered) or the backward's (saved).  CPU arrays are
    read without a sync, so checked every time: one may share its memory with a NumPy array that changes it unseen."""
    return (all(isinstance(c, Tensor) and c.is_cuda and not c.is_inference() for c in cu)
            and not _saved_tensor_hooks())


def _saved_tensor_hooks():
    """True if saved-tensor hooks are active (or torch cannot say)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _grads(ctx, dout, backward):
    q, k, v, out, lse, sinks, alibi_slopes, *cu = ctx.saved_tensors
    if dout is None:
        return (None,) * ctx.n_inputs
    params, check = ctx.params, ctx.check_indices
    if cu:  # unchanged since the forward checked them (or was told not to): no read back
        params, check = [*params[:_CU.start], *cu, *params[_CU.stop:]], False
    dq, dk, dv, dsinks = backward(dout, q, k, v, out, lse, *params, sinks, alibi_slopes, check)
    grads = (dq, dk, dv) + (None,) * len(ctx.params) + (dsinks if sinks is not None else None, None, None)
    return grads[:ctx.n_inputs]


def _backward(ctx, dout, dlse):
    return _grads(ctx, dout, torch.ops.fattn.attention_backward)


attention.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager autograd of the same forward and backward, without the registered op: torch.library's per-call handling
    of the op's eighteen arguments (fill_defaults in its autograd wrapper) cost about 200 us of host time per call,
    25x the call itself on a small shape; what is traced (torch.compile, export, fake tensors) still goes through
    the op."""

    # apply(q, k, v, sinks, rest): the op's other fourteen arguments in one tuple -- autograd's apply walks every
    # argument it is given (unwrap_dead_wrappers, the requires_grad checks): apply alone took 12.4 us with eighteen
    # arguments and 7.8 with four on the 2-core machine.  forward and setup_context apart: what torch.func's grad
    # and vjp transforms need of a Function (their vmap and jvp are refused before: _args.refuse_transforms).
    @staticmethod
    def forward(q, k, v, sinks, rest):
        return _attention(q, k, v, *rest[:_SINKS], sinks, *rest[_SINKS:])  # the op's order

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, sinks, rest = inputs
        _setup_context(ctx, (q, k, v, *rest[:_SINKS], sinks, *rest[_SINKS:]), output)

    @staticmethod
    def vmap(info, in_dims, *args):
        _args.refuse_vmap()

    @staticmethod
    def backward(ctx, dout, dlse):
        # create_graph=True or torch.func.grad (grad mode on here): a backward whose own backward is the clear
        # double-backward error
        g = _grads(ctx, dout, _BackwardOnce.apply if torch.is_grad_enabled() else _attention_backward)
        return g[0], g[1], g[2], g[3 + _SINKS], None  # dq, dk, dv, dsinks (None without sinks), nothing for rest


class _BackwardOnce(torch.autograd.Function):
    """_attention_backward where its result could be differentiated again (create_graph=True, torch.func.grad): the
    gradients' own gradient is refused clearly rather than taken as zero."""

    @staticmethod
    def forward(*args):
        return _attention_backward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        _no_double_backward(ctx)

    @staticmethod
    def vmap(info, in_dims, *args):  # torch.func.jacrev and hessian map vmap over the backward
        _args.refuse_vmap()


def attention_call(q, k, v, *params):
    """torch.ops.fattn.attention(q, k, v, *params) -- all eighteen of the op's arguments -- with its autograd:
    eagerly through _EagerAttention, traced or on fake tensors through the op."""
    if _args.traced_or_fake(q):
        return attention(q, k, v, *params)
    return _EagerAttention.apply(q, k, v, params[_SINKS], params[:_SINKS] + params[_SINKS + 1:])


@torch.library.custom_op(f"{_LIB}::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Tensor | None, v_new: Tensor | None,
                           cache_seqlens: Tensor | None, block_table: Tensor | None, causal: int, window_left: int,
                           window_right: int, softcap: float, scale: float | None, variant: str | None,
                           check_indices: bool, sinks: Tensor | None,
                           alibi_slopes: Tensor | None) -> tuple[Tensor, Tensor]:
    """fattn.attention_with_kvcache as an op that writes k_new / v_new into the caches (declared mutated, so
    torch.compile and functionalization order it): returns (out, lse)."""
    out, lse = _out_lse(q, (q.shape[0], q.shape[2], q.shape[1]))
    _C.forward(q, k_cache, v_cache, out, lse, stream=_stream(q), sinks=None if sinks is None else sinks.detach(),
               **_cache_kw(k_new, v_new, cache_seqlens, block_table, causal, window_left, window_right, softcap, scale,
                           variant, check_indices, alibi_slopes))
    return out, lse


def _cache_kw(k_new, v_new, cache_seqlens, block_table, causal, window_left, window_right, softcap, scale, variant,
              check_indices, alibi_slopes):
    """The keywords of _C.forward (and check_forward) for attention_with_kvcache's op arguments."""
    return dict(causal=causal, scale=scale, layout=1, window=_window(window_left, window_right), softcap=softcap,
                variant=variant, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
                check_indices=check_indices, alibi_slopes=alibi_slopes, kvcache=True)


@attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, causal, window_left, window_right, softcap,
      scale, variant, check_indices, sinks, alibi_slopes):
    out, lse = _out_lse(q, (q.shape[0], q.shape[2], q.shape[1]))
    if _static((q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, sinks, alibi_slopes), window_left,
               window_right):
        _C.check_forward(q, k_cache, v_cache, out, lse, sinks=sinks,
                         **_cache_kw(k_new, v_new, cache_seqlens, block_table, causal, window_left, window_right,
                                     softcap, scale, variant, check_indices, alibi_slopes))
    return out, lse


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("fattn: double backward (a gradient of fattn's gradients, create_graph=True) is not "
                              "supported")


def _setup_nothing(ctx, inputs, output):
    pass


attention_backward.register_autograd(_no_double_backward, setup_context=_setup_nothing)
