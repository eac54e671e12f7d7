"""Index arrays that a call has read back and checked -- a packed batch's cu_seqlens, a KV cache's cache_seqlens and
block_table -- remembered so that later calls with the same, unchanged arrays skip the read: on a GPU a synchronous
device-to-host copy that drains the stream.  A model's layers all take one batch's (or one decode step's) arrays: the
first layer's call reads them, the others do not.

Only arrays whose changes fattn can see are remembered: torch tensors (their version counter, which every in-place
write made through torch advances, and their data pointer) and JAX arrays (immutable).  A tensor written behind
torch's back -- by another library through DLPack, by a CUDA graph's replay, through its raw pointer -- does not look
changed: pass a new tensor or check_indices=False there.  torch's inference tensors carry no version counter and are
never remembered, nor are CuPy or NumPy arrays.

A check's verdict also depends on what the arrays were checked against (row counts, max_seqlen arguments, the cache's
shape, the new keys' count): the callers pass that as `against`, which must match too.
"""
import weakref

from . import _frameworks
from ._frameworks import framework_of

LIMIT = 32  # entries kept; the oldest goes first
_checked = {}


def _watchable(arrays):
    """True if every array (or None) can be told unchanged later: torch tensors outside torch.compile / jit tracing
    (not fake or other subclasses: the traced call must check as it is told), JAX arrays."""
    for a in arrays:
        fw = None if a is None else framework_of(a)
        if fw == "torch":
            if type(a) is not _frameworks.torch_tensor or _frameworks.is_compiling() or _frameworks.is_tracing():
                return False
        elif fw not in (None, "jax"):
            return False
    return True


def _stamp(a):
    """What tells later whether `a` (None: no array) is unchanged: (weak reference, version, data pointer); False
    where that cannot be told."""
    if a is None:
        return None
    try:
        ref = weakref.ref(a)
        if framework_of(a) == "jax":
            return ref, 0, 0
        return ref, a._version, a.data_ptr()
    except (TypeError, RuntimeError):  # not weakly referable; an inference tensor's missing version counter
        return False


def _same(stamp, a):
    if stamp is None:
        return a is None
    ref, version, ptr = stamp
    return ref() is a and (framework_of(a) == "jax" or (a._version, a.data_ptr()) == (version, ptr))


def _key(arrays, against):
    return tuple((id(a), tuple(getattr(a, "shape", ()))) for a in arrays), against


def remembered(arrays, against):
    """What remember() noted for these very arrays (a tuple; None entries for arrays not given), unchanged since,
    checked against the same `against` (hashable); else None."""
    if not _watchable(arrays):
        return None
    hit = _checked.get(_key(arrays, against))
    if hit is None or not all(_same(s, a) for s, a in zip(hit[0], arrays)):
        return None
    return hit[1]


def remember(arrays, against, value):
    """Notes that a call read and checked `arrays` against `against`; remembered() gives `value` back."""
    if not _watchable(arrays):
        return
    stamps = tuple(_stamp(a) for a in arrays)
    if False in stamps:
        return
    key = _key(arrays, against)
    _checked.pop(key, None)
    while len(_checked) >= LIMIT:
        del _checked[next(iter(_checked))]
    _checked[key] = (stamps, value)
