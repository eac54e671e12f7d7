"""Packed batches' cu_seqlens that a call has read back and checked, remembered so that later calls with the same,
unchanged arrays skip the read -- on a GPU a synchronous device-to-host copy that drains the stream.  A model's
layers all take one batch's cu_seqlens: the first layer's call reads them, the others do not.

Only arrays whose changes fattn can see are remembered: torch tensors (their version counter, which every in-place
write made through torch advances) and JAX arrays (immutable).  A tensor written behind torch's back -- by another
library through DLPack, by a CUDA graph's replay, through its raw pointer -- does not look changed: pass a new tensor
or check_indices=False there.  torch's inference tensors carry no version counter and are never remembered.
"""
import weakref

from ._frameworks import framework_of

LIMIT = 32  # entries kept; the oldest goes first
_checked = {}


def _stamp(a):
    """What tells later whether `a` is unchanged: (weak reference, version, data pointer), or None."""
    fw = framework_of(a)
    if fw not in ("torch", "jax"):
        return None
    try:
        ref = weakref.ref(a)
        if fw == "jax":
            return ref, 0, 0
        return ref, a._version, a.data_ptr()
    except (TypeError, RuntimeError):  # not weakly referable; an inference tensor's missing version counter
        return None


def _same(stamp, a):
    ref, version, ptr = stamp
    if ref() is not a:
        return False
    return framework_of(a) == "jax" or (a._version, a.data_ptr()) == (version, ptr)


def _key(cu_q, cu_k, totals, given):
    return id(cu_q), id(cu_k), totals, given


def remembered(cu_q, cu_k, totals, given):
    """(max_seqlen_q, max_seqlen_k) of an earlier call that checked these very arrays, unchanged since, against the
    same row counts `totals` and the same given max_seqlen pair `given`; else None."""
    hit = _checked.get(_key(cu_q, cu_k, totals, given))
    if hit is None or not (_same(hit[0], cu_q) and _same(hit[1], cu_k)):
        return None
    return hit[2]


def remember(cu_q, cu_k, totals, given, lengths):
    """Notes that a call checked cu_q and cu_k against `totals` and `given` (their max_seqlen pair: `lengths`)."""
    sq, sk = _stamp(cu_q), _stamp(cu_k)
    if sq is None or sk is None:
        return
    key = _key(cu_q, cu_k, totals, given)
    _checked.pop(key, None)
    while len(_checked) >= LIMIT:
        del _checked[next(iter(_checked))]
    _checked[key] = (sq, sk, lengths)
