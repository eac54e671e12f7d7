"""fattn's KV-cache call for inference (flash-attention's flash_attn_with_kvcache conventions, what decoding
servers call): attention_with_kvcache()."""
from . import _C, _args, _frameworks, _indices, _tuned
from ._frameworks import CUDA, EMPTY, current_stream, framework_of


def attention_with_kvcache(q, k_cache, v_cache, *, k_new=None, v_new=None, cache_seqlens=None, block_table=None,
                           causal=True, window=(-1, -1), softcap=0.0, scale=None, out=None, return_lse=False,
                           variant=None, check_indices=True, sinks=None, alibi_slopes=None):
    r"""Attention of new queries over a KV cache, appending this step's keys and values to it first.

    Args:
        q: ``(B, Sq, H, D)``: this step's queries (Sq = 1 for a decode step; more for a chunk of prefill or
            speculative tokens).
        k_cache, v_cache: the cache, ``(B, S_max, H_kv, D)``; or, with ``block_table``, a pool of pages
            ``(num_pages, page_size, H_kv, D)`` (page_size a multiple of 16).  Same dtype as q.
        k_new, v_new: optional ``(B, S_new, H_kv, D)``: written into the cache at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + S_new - 1`` of each sequence (in place, through the block table
            when paged), then attended to with the rest.  Nothing is written when the call is refused.
        cache_seqlens: int32 ``(B,)``: each sequence's cache length before this call (needed with k_new).  None:
            every sequence uses the whole cache (S_max, or max_pages * page_size).
        block_table: int32 ``(B, max_pages)``: sequence b's key j lives in page ``block_table[b, j // page_size]``,
            row ``j % page_size``.  Every entry is checked to be a page of the pool.
        causal: ``True`` (default): query i sees keys up to its own position ``i + S_k - Sq`` (bottom-right
            aligned, ``S_k = cache_seqlens[b] + S_new``); ``False``: every cached key.
        window, softcap, scale, variant, sinks, alibi_slopes: as for :func:`fattn.attention` (windows and ALiBi's
            positions bottom-right aligned per sequence: a query at i + S_k - Sq).
        out: optional writable ``(B, Sq, H, D)`` array; return_lse: also return the LSE, float32 ``(B, H, Sq)``.
        check_indices: ``True`` (default): cache_seqlens' and block_table's values are read back and checked (in
            range, room for k_new) before anything runs -- on a GPU a small synchronous copy.  Checked arrays are
            remembered (fattn/_indices.py): a later call with the same torch tensors, unchanged since by torch's
            version counter, against a cache of the same shape and as many new keys reads nothing -- a decode
            step's layers read them once.  ``False``:
            shapes and dtypes are still checked, the values are trusted (no host sync: what a decode loop over
            many layers wants; an out-of-range entry is then undefined behaviour, as in flash-attention).

    Inference only: not differentiable (torch tensors that require grad are refused while grad mode is on).  The
    cache's torch tensors are written in place and their version counters advance, as for a write through torch.  Under
    torch.compile (and for fake / meta tensors) the call is the op ``torch.ops.fattn.attention_with_kvcache``,
    which declares its writes into k_cache and v_cache.  On the GPU
    v2 (tensor cores) runs these calls, paged or not, with split keys for small batches (a softcap and ALiBi
    included); on Hopper v3 runs the calls with more than 64 queries (chunked prefill), paged caches of every page
    size included when cache_seqlens is given (TMA loads of each page's rows through the block table).
    """
    causal_code, scale, window, softcap, variant = _args.call_options(causal, scale, window, softcap, variant,
                                                                      "bottom_right")
    fw = framework_of(q)
    shape = _args.array_shape(q, "q")
    if len(shape) != 4:
        raise ValueError(f"q: expected a 4-D array (B, Sq, H, D), got {len(shape)}-D")
    if fw == "torch":
        _args.torch_registered()
        # not differentiable, and it would write a cache that autograd tracks behind its back
        _args.refuse_requires_grad("attention_with_kvcache is inference only (not differentiable); call it under "
                                   "torch.no_grad() or torch.inference_mode(), or detach it", q=q, k_cache=k_cache,
                                   v_cache=v_cache, k_new=k_new, v_new=v_new, sinks=sinks, out=out)
        if _args.traced_or_fake(q):  # torch.compile, fake or meta tensors: the op that declares its cache writes
            from . import _torch

            _args.torch_results(q, k_cache, v_cache, 1, out, None, cache_seqlens=cache_seqlens,
                                block_table=block_table, k_new=k_new, v_new=v_new)
            left, right = window or (-1, -1)
            o, lse = _torch.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
                                                   causal_code, left, right, softcap, scale, variant,
                                                   bool(check_indices), _args.sinks_arg(sinks, q, fw, shape[2]),
                                                   _args.alibi_arg(alibi_slopes, fw))
            if out is not None:
                out.copy_(o)
                o = out
            return (o, lse) if return_lse else o
    dev_type, dev_id = _args.device_of(fw, q)
    _args.refuse_jax(out=out, k_cache=k_cache if k_new is not None else None)
    given_out = out
    if out is None:
        out = EMPTY[fw](q, shape, False, "out")
    lse = EMPTY[fw](q, (shape[0], shape[2], shape[1]), True, "lse", False) if return_lse or sinks is not None else None
    if (dev_type, dev_id) not in _tuned.LOADED:
        _tuned.ensure(dev_type, dev_id)
    stream = current_stream(fw, dev_id) if dev_type == CUDA else None
    sinks = _args.sinks_arg(sinks, q, fw, shape[2])  # before the cache is written
    # the index arrays' check compares them with the cache's pages (or length) and the new keys' count
    arrays = (cache_seqlens, block_table)
    against = tuple(getattr(k_cache, "shape", ())[:2]), (getattr(k_new, "shape", ())[1:2] if k_new is not None else ())
    check, stamped = _indices.to_check(arrays, against, check_indices)  # stamped: before the call reads them
    _C.forward(q, k_cache, v_cache, out, lse, causal=causal_code, scale=scale, layout=1, window=window,
               softcap=softcap, variant=variant, stream=stream, cache_seqlens=cache_seqlens, block_table=block_table,
               k_new=k_new, v_new=v_new, check_indices=check, alibi_slopes=_args.alibi_arg(alibi_slopes, fw),
               sinks=sinks, kvcache=True)
    _indices.remember(arrays, against, stamped)
    if fw == "torch":
        _frameworks.written_in_place(given_out, *((k_cache, v_cache) if k_new is not None else ()))
    return (out, lse) if return_lse else out

