"""Index arrays that a call has read back and checked -- a packed batch's cu_seqlens, a KV cache's cache_seqlens and
block_table -- remembered so that later calls with the same, unchanged arrays skip the read: on a GPU a synchronous
device-to-host copy that drains the stream.  A model's layers all take one batch's (or one decode step's) arrays: the
first layer's call reads them, the others do not.  Only the check is skipped: a call still uses the arrays' values on
the device as they are when it runs.

Only arrays whose read costs a sync and whose changes fattn can see are remembered: CUDA torch tensors (their version
counter, which every in-place write made through torch advances, and their data pointer) and JAX arrays (immutable).
A CUDA tensor written behind torch's back -- by another library through DLPack, by a CUDA graph's replay, through
`.data` or its raw pointer -- does not look changed: pass a new tensor or check_indices=False there.  Never
remembered: CPU tensors (read without a sync, so checked every call: one may share its memory with a NumPy array
that changes it unseen), torch's inference tensors (no version counter), tensor subclasses, calls under torch.compile
or jit tracing (the traced call checks as it is told) and under CUDA graph capture (a captured call must say
check_indices=False itself), CuPy and NumPy arrays.

A check's verdict also depends on what the arrays were checked against (row counts, max_seqlen arguments, the cache's
shape, the new keys' count): the callers pass that as `against`, which must match too.  The arrays' state is taken
before the call that checks them (stamps()), so a write made while it runs is seen.
"""
import threading
import weakref

from . import _frameworks
from ._frameworks import framework_of

LIMIT = 32  # entries kept; the one noted first goes first
_checked = {}
_lock = threading.Lock()


def _watchable(arrays):
    """True if every array (or None) can be told unchanged later, and this is a call to remember."""
    for a in arrays:
        fw = None if a is None else framework_of(a)
        if fw == "torch":
            if type(a) is not _frameworks.torch_tensor or _frameworks.is_compiling() or _frameworks.is_tracing():
                return False
            if not a.is_cuda or _frameworks.is_capturing():
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
    """True if a call checked these very arrays (a tuple; None for arrays not given), unchanged since, against the
    same `against` (hashable)."""
    if not _watchable(arrays):
        return False
    hit = _checked.get(_key(arrays, against))
    return hit is not None and all(_same(s, a) for s, a in zip(hit, arrays))


def stamps(arrays):
    """The arrays' state before a call checks them, for remember(); None where they cannot be remembered."""
    if not _watchable(arrays):
        return None
    got = tuple(_stamp(a) for a in arrays)
    return None if False in got else got


def to_check(arrays, against, check_indices, rememberable=True):
    """(check, stamped) for a call given check_indices: whether it must still read and check `arrays` -- not when
    told not to, nor when they are remembered() against `against` -- and, if so and they may be remembered, their
    state for remember() (else None)."""
    if not check_indices:
        return False, None
    if not rememberable or all(a is None for a in arrays):
        return True, None
    if remembered(arrays, against):
        return False, None
    return True, stamps(arrays)


def remember(arrays, against, stamped):
    """Notes that a call checked `arrays` (in the state `stamped`, from stamps()) against `against`."""
    if stamped is None:
        return
    key = _key(arrays, against)
    with _lock:
        _checked.pop(key, None)
        while len(_checked) >= LIMIT:
            del _checked[next(iter(_checked))]
        _checked[key] = stamped
