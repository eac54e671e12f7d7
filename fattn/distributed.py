r"""Context parallelism: one attention over a sequence split across the ranks of a torch.distributed group.

    import torch.distributed as dist, fattn.distributed as fd
    dist.init_process_group("nccl")                      # or "gloo" for CPU tensors
    q, k, v = (fd.shard(x, causal=True) for x in (q_full, k_full, v_full))   # (B, S/N, H, D) each
    out = fd.attention(q, k, v, causal=True)             # this rank's shard of the output; autograd works
    out_full = fd.unshard(out, causal=True)

Every rank holds a shard of q, k and v along the sequence; ``attention`` returns this rank's shard of the output,
and its backward (torch autograd) this rank's shards of dq, dk and dv.  All ranks of the group must make the same
calls in the same order (forward and backward are collective).  ``import fattn`` never imports this module (nor
torch); import it explicitly.

Layout of the shards (:func:`shard` makes it, :func:`unshard` undoes it).  With N ranks:

- non-causal: the sequence is cut into N equal chunks; rank r holds chunk r.
- causal: the sequence is cut into 2N equal chunks and rank r holds chunks r and 2N-1-r, concatenated (the
  "zigzag").  Under a causal mask chunk a sees a+1 chunks of keys, so the pair (r, 2N-1-r) always sees 2N+1 chunks:
  every rank does the same work.  For N = 2 (chunks 0..3): rank 0 holds [0, 3], rank 1 holds [1, 2].

Strategies:

- ``"ring"``: the K/V shards travel around the ring (rank r sends to r+1 and receives from r-1, batched P2P);
  the transfer for the next step is posted before the attention on the shard in hand, so the two overlap.  After
  N-1 transfers every rank has seen every K/V shard.  Each step gives a partial output ``o_i`` and its log-sum-exp
  ``lse_i`` over the keys it saw; the partials merge exactly, in float32::

      lse = log(sum_i exp(lse_i))          out = sum_i exp(lse_i - lse) * o_i

  folded in step by step as they arrive (``lse' = logaddexp(lse, lse_i)``, ``out' = exp(lse - lse') out +
  exp(lse_i - lse') o_i``; a row that sees no key has lse -inf and output 0, and stays so: never NaN; the output
  is rounded to q's dtype once, at the end).  In the causal zigzag, at step t
  rank r holds the K/V chunks {s, 2N-1-s} of rank s = (r - t) mod N, and each step is one kernel call:
  s == r: the local shard against itself under the causal mask (its positions increase along the shard);
  s < r: both query chunks see key chunk s in full, neither sees 2N-1-s (later than both): all queries against
  the first half of the keys, unmasked;  s > r: query chunk r sees neither key chunk, query chunk 2N-1-r sees both
  in full: the second half of the queries against all keys, unmasked.
  Backward (FlashAttention-2's, with the final out and lse): each step gives that K/V shard's exact share of dq and
  its dk, dv for these queries; dq adds up locally, and a float32 dK/dV accumulator travels with its K/V shard,
  gathering every rank's share, and arrives home after N transfers.

- ``"allgather"``: all-gather the K/V shards once, then attend the local queries to the whole K/V in one call
  (non-causal) or two (causal: each local query chunk a against the keys of chunks 0..a, masked bottom-right);
  backward: K/V gathered again (not kept from the forward), the same calls' gradients, dK/dV reduce-scattered
  back to their owners (float32).  It moves the same
  bytes as the ring but does not overlap them with compute; it pays off when K/V are small next to Q (grouped-query
  attention) and it makes fewer, larger kernel calls.

- ``"auto"``: :func:`choose_strategy`: ``"allgather"`` on groups of up to four ranks (measured faster there) or
  when K/V have at most a quarter of q's heads (``H_kv * 4 <= H``: K/V are at most a quarter of Q's size), else
  ``"ring"``.

No step materialises the S x S scores or the whole sequence's Q; allgather holds the whole sequence's K/V.

This module is the API, the checks and the communicator; the strategies themselves are fattn/_cp_strategies.py.
"""
import struct

import torch
import torch.distributed as dist

from . import _C, _api, _args
from ._cp_strategies import BACKWARD, FORWARD, SEQ_DIM, _global_order

HEAD_DIM = {"bshd": 2, "bhsd": 1}
STRATEGIES = ("auto", "ring", "allgather")
CAUSAL = {False: False, None: False, True: True, "top_left": True, "bottom_right": True}  # Sq == Sk: both alike

_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


# ----------------------------------------------------------------------------------------------------------------
# Public API


def attention(q, k, v, *, group=None, causal=False, scale=None, layout="bshd", strategy="auto", check=True,
              softcap=0.0):
    r"""Attention of this rank's query shard to the whole distributed sequence; returns this rank's output shard.

    Args:
        q, k, v: this rank's shards, ``(B, S_local, H, D)`` for layout ``"bshd"`` or ``(B, H, S_local, D)`` for
            ``"bhsd"``; k and v may have H_kv heads dividing H (grouped-query attention).  float16, bfloat16 or
            float32, on the device of the group's backend (CUDA for NCCL, CPU for gloo).  The global sequence is
            the shards in :func:`shard`'s layout (contiguous chunks; the zigzag when causal), all of equal length.
        group: the process group (default: the world).
        causal: ``False`` or ``True`` (``"top_left"`` and ``"bottom_right"`` mean the same here: q and k cover the
            same positions).  Causal needs an even S_local (two zigzag chunks per rank).
        scale: softmax scale, default ``1 / sqrt(D)``.
        softcap: ``c > 0`` caps the scores at ``c * tanh(s / c)`` (as :func:`fattn.attention`); the merge by LSE
            and the backward are exact for it too.
        layout: ``"bshd"`` (default) or ``"bhsd"``.
        strategy: ``"ring"``, ``"allgather"`` or ``"auto"`` (:func:`choose_strategy`: allgather on up to four
            ranks or when ``H_kv * 4 <= H``, else ring); see the module's docstring.
        check: all-gather the shards' shapes and dtypes and the call's arguments first, and raise the same
            ValueError on every rank if they differ between ranks (one small collective; on a GPU it waits for the
            device).  With False, shards or arguments that differ between ranks are undefined behaviour.

    Differentiable through torch autograd: the backward is distributed as well, so every rank must run it.

    Raises:
        ValueError naming the argument: no initialised process group (``group``), this process not in the group,
        bad layout / strategy / causal, q/k/v shapes that do not agree (a layout mix-up), an odd S_local when
        causal, shards of unequal shapes or dtypes across the ranks, or ranks whose causal, scale, softcap, layout
        or strategy differ.  TypeError: k or v of another dtype than q (as :func:`fattn.attention`).  With check,
        every rank raises: the rank whose shards are bad its own error, the others a ValueError naming that rank.
    """
    comm = _Comm(group)
    try:  # a bad argument on one rank is raised on every rank (below), not before the others' collective
        causal = _causal_flag(causal)
        softcap = _args.softcap_value(softcap)
        scale = _args.scale_value(scale)
        _check_choice("layout", layout, tuple(SEQ_DIM))
        _check_choice("strategy", strategy, STRATEGIES)
        problem = _local_problem(q, k, v, causal, layout)
    except (ValueError, TypeError) as e:
        problem = e
    if check:
        _agree_across_ranks(comm, q, k, v, problem, causal, scale, softcap, layout, strategy)
    elif problem:
        raise problem
    if strategy == "auto":
        strategy = choose_strategy(q.shape[HEAD_DIM[layout]], k.shape[HEAD_DIM[layout]], comm.size)
    return _Attention.apply(q, k, v, comm, causal, scale, layout, strategy, softcap)


def choose_strategy(heads, kv_heads, world_size):
    """What ``strategy="auto"`` runs: ``"allgather"`` on up to four ranks, or with small K/V (``kv_heads * 4 <=
    heads``); else ``"ring"``.  Measured (evidence/cp/; causal, B=1, H=16, D=128, bf16, H_kv 16 and 4):
    on 2 H200s at 128k-512k tokens allgather's fwd+bwd efficiency was 0.94-1.00 against the ring's 0.94-1.00, its
    forward 0.83-1.00 against 0.77-1.06; on 4 H200s at 256k-1M allgather led at every point, fwd+bwd 0.93-1.00
    against 0.92-0.95 and forward 0.95-1.04 against 0.82-0.93.  The ring's forward loses more than its transfers
    take (the persistent forward kernel shares SMs with NCCL's; see evidence/cp/README.md).  Beyond four ranks,
    unmeasured, the ring keeps its memory advantage: it holds two K/V shards where allgather holds them all."""
    return "allgather" if world_size <= 4 or kv_heads * 4 <= heads else "ring"


def shard(x, group=None, dim=1, causal=False):
    """This rank's shard of the full sequence ``x`` (the same on every rank) along ``dim``, in the layout
    :func:`attention` expects: non-causal, chunk r of N; causal, chunks r and 2N-1-r of 2N, concatenated (the
    zigzag).  Returns a new contiguous tensor (differentiable).  The length along dim must divide by N (by 2N when
    causal)."""
    comm = _Comm(group)
    n, r = comm.size, comm.rank
    pieces = 2 * n if causal else n
    dim = _dim_index(x, dim)
    length = x.shape[dim]
    if length % pieces:
        raise ValueError(f"x: length {length} along dim {dim} does not divide into {pieces} equal chunks "
                         f"({n} ranks{', two chunks each when causal' if causal else ''})")
    c = length // pieces
    if not causal:
        return x.narrow(dim, r * c, c).clone(memory_format=torch.contiguous_format)
    return torch.cat((x.narrow(dim, r * c, c), x.narrow(dim, (2 * n - 1 - r) * c, c)), dim=dim)


def unshard(x_local, group=None, dim=1, causal=False):
    """The full sequence from every rank's shard ``x_local`` (all of equal shape and dtype), in order: all-gathers
    and undoes :func:`shard`'s layout.  Every rank gets the whole; not differentiable (for evaluation and tests).
    Shards of unequal shapes or dtypes raise the same ValueError on every rank (one small collective first)."""
    comm = _Comm(group)
    problem = None
    try:
        dim = _dim_index(x_local, dim)
    except ValueError as e:  # raised on every rank (below), not before the others' collective
        problem = e
    if problem is None and causal and x_local.shape[dim] % 2:
        problem = ValueError(f"x_local: length {x_local.shape[dim]} along dim {dim} is odd; a causal shard holds two "
                             "equal zigzag chunks")
    shape = list(x_local.shape[:_MAX_NDIM]) + [-1] * (_MAX_NDIM - min(x_local.ndim, _MAX_NDIM))
    rows = comm.all_gather(_row(x_local.device, int(problem is not None), x_local.ndim, _dtype_code(x_local.dtype),
                                shape)).tolist()
    if problem:
        raise problem
    if any(row[0] for row in rows):
        raise ValueError(f"x_local: the shards of rank(s) {[r for r, row in enumerate(rows) if row[0]]} are "
                         "invalid (see the error raised there)")
    if any(row != rows[0] for row in rows):
        got = "; ".join(f"rank {r}: {tuple(row[3:3 + min(row[1], _MAX_NDIM)])} {_dtype_name(row[2])}"
                        for r, row in enumerate(rows))
        raise ValueError(f"x_local: shards must have equal shapes and dtypes on every rank; got {got}")
    return _global_order(comm.all_gather(x_local.detach()), causal, dim)


def _dim_index(x, dim):
    """dim as a non-negative index of x's dimensions (ValueError naming dim if it is not one)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim: expected an int in [{-x.ndim}, {x.ndim}) for a {x.ndim}-D tensor, got {dim!r}")
    return dim % x.ndim


# ----------------------------------------------------------------------------------------------------------------
# Communication


class _Comm:
    """The group, its size, this process's rank in it and its ring neighbours' global ranks, with the few
    collectives the strategies use."""

    def __init__(self, group):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised; call torch.distributed."
                             "init_process_group() first")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")
        self.size = dist.get_world_size(group)
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank):
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def shift(self, tensor, tag):
        """Post: send `tensor` to the next rank, receive the previous rank's into a new buffer.  Returns the
        transfer; .wait() gives the received tensor."""
        recv = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])
        return _Transfer(works, recv)

    def all_gather(self, tensor):
        """(N, *tensor.shape): every rank's tensor, stacked in rank order."""
        out = tensor.new_empty((self.size * tensor.numel(),))  # flat: every backend takes the concatenated form
        _all_gather_single(out, tensor.reshape(-1), group=self.group)
        return out.view((self.size,) + tuple(tensor.shape))

    def reduce_scatter(self, stacked):
        """stacked (N, ...): the sum over ranks of stacked[r] lands on rank r."""
        out = stacked.new_empty((stacked.numel() // self.size,))
        _reduce_scatter_single(out, stacked.reshape(-1), group=self.group)
        return out.view(stacked.shape[1:])


class _Transfer:
    def __init__(self, works, recv):
        self.works, self.recv = works, recv

    def wait(self):
        for w in self.works:
            w.wait()
        return self.recv


# ----------------------------------------------------------------------------------------------------------------
# Checks


def _causal_flag(causal):
    try:
        return CAUSAL[causal]
    except (KeyError, TypeError):
        raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}") from None


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def _local_problem(q, k, v, causal, layout):
    """What is wrong with this rank's q, k, v, as the exception to raise (ValueError; TypeError for k or v of
    another dtype than q, as fattn.attention's), or None."""
    names = "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return ValueError(f"{name}: expected a 4-D torch tensor {names} for layout {layout!r}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            return TypeError(f"{name}: dtype {str(t.dtype)[6:]} differs from q's {str(q.dtype)[6:]}; q, k and v "
                             "must share one dtype")
    if tuple(k.shape) != tuple(v.shape):
        return ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    s, h = SEQ_DIM[layout], HEAD_DIM[layout]
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or k.shape[s] != q.shape[s] or q.shape[h] % k.shape[h]:
        return ValueError(f"k: shape {tuple(k.shape)} does not fit q's {tuple(q.shape)} in layout {layout!r} "
                          f"{names}: same batch, sequence shard length and head dim, and kv heads dividing q's heads "
                          "(are q, k, v all in one layout?)")
    if causal and q.shape[s] % 2:
        return ValueError(f"q: local sequence length {q.shape[s]} is odd; causal context parallelism holds two equal "
                          "zigzag chunks per rank")
    # what fattn's kernels refuse (dtype, head dim, strides), by their own intake's rules on shape-only copies
    # (nothing read or run), refused here before any transfer: every rank then raises together
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            return ValueError(f"{name}: on {t.device} but q is on {q.device}; all arrays must be on one device")
    try:
        _C.check_forward(*(_described(t) for t in (q, k, v, q)), None, layout=_api.LAYOUT[layout])
    except (ValueError, TypeError) as e:
        return e
    return None


def _described(t):
    """A meta tensor of t's shape, strides and dtype: what the C intake's checks read."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


# every torch dtype, in a fixed order: each its own code in the cross-rank checks
_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str))
_MAX_NDIM = 8  # unshard compares this many leading sizes of a shard's shape


def _dtype_code(dtype):
    return _DTYPES.index(dtype)


def _dtype_name(code):
    return str(_DTYPES[code])[6:] if 0 <= code < len(_DTYPES) else "another dtype"


def _shape4(t):
    return list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4


def _bits(x):
    """A float (or None) as an int64, to be compared exactly across ranks."""
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", x))[0]


def _row(device, *values):
    flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return torch.tensor(flat, dtype=torch.int64, device=device)


def _agree_across_ranks(comm, q, k, v, problem, causal, scale, softcap, layout, strategy):
    """Raise the same ValueError on every rank if any rank's shard is bad, or the shards' shapes or dtypes or the
    call's arguments differ between ranks (they would make the collectives mismatch: a hang, a crash or a wrong
    result)."""
    dtypes = [_dtype_code(t.dtype) if isinstance(t, torch.Tensor) else -1 for t in (q, k, v)]
    # (a rank whose arguments were refused sends -1 for those it could not read: it raises its own error anyway)
    args = [int(causal) if isinstance(causal, bool) else -1,
            _bits(scale) if scale is None or isinstance(scale, float) else -1,
            _bits(softcap) if isinstance(softcap, float) else -1,
            tuple(SEQ_DIM).index(layout) if layout in SEQ_DIM else -1,
            STRATEGIES.index(strategy) if strategy in STRATEGIES else -1]
    device = q.device if isinstance(q, torch.Tensor) else "cpu"
    rows = comm.all_gather(_row(device, _shape4(q), _shape4(k), _shape4(v), dtypes, args,
                                int(problem is not None))).tolist()
    if problem:
        raise problem
    bad = [r for r, row in enumerate(rows) if row[-1]]
    if bad:
        raise ValueError(f"q: the shards of rank(s) {bad} are invalid (see the error raised there: its shards or "
                         "arguments)")
    fields = [(name, 4 * i, 4 * i + 4) for i, name in enumerate("qkv")] + \
             [(f"{name} dtype", 12 + i, 13 + i) for i, name in enumerate("qkv")] + \
             [(name, 15 + i, 16 + i) for i, name in enumerate(("causal", "scale", "softcap", "layout", "strategy"))]
    for name, a, b in fields:
        if any(row[a:b] != rows[0][a:b] for row in rows):
            arg = name.split()[0]
            if b - a == 4:  # a shape
                got = "; ".join(f"rank {r}: {tuple(row[a:b])}" for r, row in enumerate(rows))
                raise ValueError(f"{arg}: shards must have equal shapes on every rank (equal sequence lengths); "
                                 f"got {got}")
            if name.endswith("dtype"):
                got = "; ".join(f"rank {r}: {_dtype_name(row[a])}" for r, row in enumerate(rows))
                raise ValueError(f"{arg}: shards must have one dtype on every rank; got {got}")
            raise ValueError(f"{arg}: every rank must pass the same {arg}; the ranks' values differ (rank(s) "
                             f"{[r for r, row in enumerate(rows) if row[a:b] != rows[0][a:b]]} differ from rank 0)")


# ----------------------------------------------------------------------------------------------------------------
# Autograd



class _Attention(torch.autograd.Function):
    """Distributed forward and backward; saves this rank's q, k, v, output and LSE."""

    @staticmethod
    def forward(ctx, q, k, v, comm, causal, scale, layout, strategy, softcap):
        with torch.no_grad():
            out, lse = FORWARD[strategy](q, k, v, comm, causal, scale, layout, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (comm, causal, scale, layout, strategy, softcap)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # create_graph=True: these gradients have no graph of their own
            raise NotImplementedError("fattn.distributed: double backward (a gradient of its gradients, "
                                      "create_graph=True) is not supported")
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, scale, layout, strategy, softcap = ctx.args
        with torch.no_grad():
            dq, dk, dv = BACKWARD[strategy](dout.contiguous(), q, k, v, out, lse, comm, causal, scale, layout,
                                            softcap=softcap)
        return dq, dk, dv, None, None, None, None, None, None
