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
"""
import torch
import torch.distributed as dist

from . import _api, _args

SEQ_DIM = {"bshd": 1, "bhsd": 2}
HEAD_DIM = {"bshd": 2, "bhsd": 1}
STRATEGIES = ("auto", "ring", "allgather")
CAUSAL = {False: False, None: False, True: True, "top_left": True, "bottom_right": True}  # Sq == Sk: both alike
KV_TAG, DKV_TAG = 1, 2  # separate message tags for K/V and for the travelling dK/dV

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
        check: all-gather the shards' shapes first and raise the same ValueError on every rank if they differ (one
            small collective; on a GPU it waits for the device).  With False, unequal shards are undefined behaviour.

    Differentiable through torch autograd: the backward is distributed as well, so every rank must run it.

    Raises:
        ValueError naming the argument: no initialised process group (``group``), this process not in the group,
        bad layout / strategy / causal, q/k/v shapes that do not agree (a layout mix-up), an odd S_local when
        causal, or shards of unequal shapes across the ranks.
    """
    comm = _Comm(group)
    causal = _causal_flag(causal)
    softcap = _args.softcap_value(softcap)
    _check_choice("layout", layout, tuple(SEQ_DIM))
    _check_choice("strategy", strategy, STRATEGIES)
    problem = _local_problem(q, k, v, causal, layout)
    if check:
        _agree_across_ranks(comm, q, k, problem)
    elif problem:
        raise ValueError(problem)
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
    length = x.shape[dim]
    if length % pieces:
        raise ValueError(f"x: length {length} along dim {dim} does not divide into {pieces} equal chunks "
                         f"({n} ranks{', two chunks each when causal' if causal else ''})")
    c = length // pieces
    if not causal:
        return x.narrow(dim, r * c, c).clone(memory_format=torch.contiguous_format)
    return torch.cat((x.narrow(dim, r * c, c), x.narrow(dim, (2 * n - 1 - r) * c, c)), dim=dim)


def unshard(x_local, group=None, dim=1, causal=False):
    """The full sequence from every rank's shard ``x_local`` (all of equal shape), in order: all-gathers and undoes
    :func:`shard`'s layout.  Every rank gets the whole; not differentiable (for evaluation and tests)."""
    comm = _Comm(group)
    n = comm.size
    if causal and x_local.shape[dim] % 2:
        raise ValueError(f"x_local: length {x_local.shape[dim]} along dim {dim} is odd; a causal shard holds two "
                         "equal zigzag chunks")
    shards = comm.all_gather(x_local.detach()).unbind(0)
    if not causal:
        return torch.cat(shards, dim=dim)
    halves = [s.chunk(2, dim=dim) for s in shards]
    order = [halves[j][0] for j in range(n)] + [halves[2 * n - 1 - j][1] for j in range(n, 2 * n)]
    return torch.cat(order, dim=dim)


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
    """The message of what is wrong with this rank's q, k, v (None if nothing)."""
    names = "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name}: expected a 4-D torch tensor {names} for layout {layout!r}"
    if tuple(k.shape) != tuple(v.shape):
        return f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}"
    s, h = SEQ_DIM[layout], HEAD_DIM[layout]
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or k.shape[s] != q.shape[s] or q.shape[h] % k.shape[h]:
        return (f"k: shape {tuple(k.shape)} does not fit q's {tuple(q.shape)} in layout {layout!r} {names}: "
                "same batch, sequence shard length and head dim, and kv heads dividing q's heads (are q, k, v all "
                "in one layout?)")
    if causal and q.shape[s] % 2:
        return (f"q: local sequence length {q.shape[s]} is odd; causal context parallelism holds two equal zigzag "
                "chunks per rank")
    return None


def _shape4(t):
    return list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4


def _agree_across_ranks(comm, q, k, problem):
    """Raise the same ValueError on every rank if any rank's shard is bad or the shards' shapes differ."""
    mine = torch.tensor(_shape4(q) + _shape4(k) + [int(problem is not None)], dtype=torch.int64,
                        device=q.device if isinstance(q, torch.Tensor) else "cpu")
    rows = comm.all_gather(mine).tolist()
    if problem:
        raise ValueError(problem)
    bad = [r for r, row in enumerate(rows) if row[-1]]
    if bad:
        raise ValueError(f"q: the shards of rank(s) {bad} are invalid (see the error raised there)")
    if any(row != rows[0] for row in rows):
        shapes = "; ".join(f"rank {r}: q {tuple(row[:4])}, k {tuple(row[4:8])}" for r, row in enumerate(rows))
        raise ValueError(f"q: shards must have equal shapes on every rank (equal sequence lengths); got {shapes}")


# ----------------------------------------------------------------------------------------------------------------
# Which rows meet which keys


def _ring_step_block(rank, src, causal, length):
    """(query rows, key rows, masked) of the one kernel call for this rank's queries against rank src's K/V shard
    (rows as slices of the local shards; see the module's docstring for the zigzag cases)."""
    whole = slice(0, length)
    if not causal:
        return whole, whole, False
    half = length // 2
    if src == rank:
        return whole, whole, True
    if src < rank:
        return whole, slice(0, half), False
    return slice(half, length), whole, False


def _rows(x, rows, layout):
    """The rows `rows` (a slice) of x along its sequence dim."""
    return x.narrow(SEQ_DIM[layout], rows.start, rows.stop - rows.start)


def _lse_rows(lse, rows):
    return lse[..., rows]


def _per_row(lse, layout):
    """An LSE-shaped (B, H, S) tensor broadcastable against an output (B, S, H, D) or (B, H, S, D)."""
    return (lse.transpose(1, 2) if layout == "bshd" else lse).unsqueeze(-1)


def _merge(out, lse, out_i, lse_i, layout):
    """Fold a partial (out_i, lse_i) into the float32 accumulators (out, lse) in place:
    lse' = logaddexp(lse, lse_i), out' = exp(lse - lse') out + exp(lse_i - lse') out_i.  Rows -inf in both stay
    -inf with output 0 (the exponent base is taken as 0 there, so no -inf - -inf)."""
    new = torch.logaddexp(lse, lse_i)
    base = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out.mul_(_per_row(torch.exp(lse - base), layout))
    out.add_(out_i.float() * _per_row(torch.exp(lse_i - base), layout))
    lse.copy_(new)


# ----------------------------------------------------------------------------------------------------------------
# Ring


def _ring_forward(q, k, v, comm, causal, scale, layout, softcap=0.0):
    length = q.shape[SEQ_DIM[layout]]
    kv = torch.stack((k, v))  # one buffer travels: (2, ...)
    out = lse = None
    for t in range(comm.size):
        incoming = comm.shift(kv, KV_TAG) if t < comm.size - 1 else None  # posted before this step's compute
        q_rows, k_rows, masked = _ring_step_block(comm.rank, (comm.rank - t) % comm.size, causal, length)
        out_i, lse_i = _api.attention(_rows(q, q_rows, layout), _rows(kv[0], k_rows, layout),
                                      _rows(kv[1], k_rows, layout), causal=masked, scale=scale, layout=layout,
                                      softcap=softcap, return_lse=True)
        if out is None:  # step 0 covers every row
            out, lse = out_i.float(), lse_i
        else:
            _merge(_rows(out, q_rows, layout), _lse_rows(lse, q_rows), out_i, lse_i, layout)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, comm, causal, scale, layout, softcap=0.0):
    length = q.shape[SEQ_DIM[layout]]
    kv = torch.stack((k, v))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = returning = None
    for t in range(comm.size):
        incoming = comm.shift(kv, KV_TAG) if t < comm.size - 1 else None
        q_rows, k_rows, masked = _ring_step_block(comm.rank, (comm.rank - t) % comm.size, causal, length)
        dq_i, dk_i, dv_i = _api.attention_backward(
            _rows(dout, q_rows, layout), _rows(q, q_rows, layout), _rows(kv[0], k_rows, layout),
            _rows(kv[1], k_rows, layout), _rows(out, q_rows, layout), _lse_rows(lse, q_rows), causal=masked,
            scale=scale, layout=layout, softcap=softcap)
        _rows(dq, q_rows, layout).add_(dq_i)
        # This K/V shard's dK/dV accumulator: new at step 0, else what the previous rank sent along with the shard.
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device) if t == 0 else returning.wait()
        _rows(dkv[0], k_rows, layout).add_(dk_i)
        _rows(dkv[1], k_rows, layout).add_(dv_i)
        if comm.size > 1:
            returning = comm.shift(dkv, DKV_TAG)  # after the last step this is the shard's way home
        if incoming is not None:
            kv = incoming.wait()
    if returning is not None:
        dkv = returning.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# ----------------------------------------------------------------------------------------------------------------
# All-gather


def _global_order(stacked, causal, seq_dim):
    """Rank-ordered shards stacked (N, ...) -> the whole sequence along seq_dim (of one shard), undoing the zigzag."""
    shards = stacked.unbind(0)
    if not causal:
        return torch.cat(shards, dim=seq_dim)
    n = len(shards)
    halves = [s.chunk(2, dim=seq_dim) for s in shards]
    return torch.cat([halves[j][0] for j in range(n)] + [halves[2 * n - 1 - j][1] for j in range(n, 2 * n)],
                     dim=seq_dim)


def _shard_order(whole, n, causal, seq_dim):
    """The inverse of _global_order: (N, ...) with rank r's shard at [r]."""
    if not causal:
        return torch.stack(whole.chunk(n, dim=seq_dim))
    c = whole.chunk(2 * n, dim=seq_dim)
    return torch.stack([torch.cat((c[r], c[2 * n - 1 - r]), dim=seq_dim) for r in range(n)])


def _query_chunks(comm, causal, length):
    """[(local query rows, number of key rows of the whole sequence they see, masked)]: non-causal, all rows see
    everything; causal, local chunk i is global chunk a (r, then 2N-1-r) and sees the (a+1) chunks up to its own,
    masked bottom-right (its last key row is its own position)."""
    if not causal:
        return [(slice(0, length), comm.size * length, False)]
    c = length // 2
    chunks = (comm.rank, 2 * comm.size - 1 - comm.rank)
    return [(slice(i * c, (i + 1) * c), (a + 1) * c, "bottom_right") for i, a in enumerate(chunks)]


def _gathered_kv(k, v, comm, causal, layout):
    """(2, ...) K and V of the whole sequence, in order."""
    return _global_order(comm.all_gather(torch.stack((k, v))), causal, SEQ_DIM[layout] + 1)


def _allgather_forward(q, k, v, comm, causal, scale, layout, softcap=0.0):
    kv = _gathered_kv(k, v, comm, causal, layout)
    length = q.shape[SEQ_DIM[layout]]
    out = torch.empty_like(q)
    lse = torch.empty(_lse_shape(q, layout), dtype=torch.float32, device=q.device)
    for q_rows, seen, masked in _query_chunks(comm, causal, length):
        keys = slice(0, seen)
        out_i, lse_i = _api.attention(_rows(q, q_rows, layout), _rows(kv[0], keys, layout),
                                      _rows(kv[1], keys, layout), causal=masked, scale=scale, layout=layout,
                                      softcap=softcap, return_lse=True)
        _rows(out, q_rows, layout).copy_(out_i)
        _lse_rows(lse, q_rows).copy_(lse_i)
    return out, lse


def _allgather_backward(dout, q, k, v, out, lse, comm, causal, scale, layout, softcap=0.0):
    kv = _gathered_kv(k, v, comm, causal, layout)  # gathered again rather than kept from the forward
    length = q.shape[SEQ_DIM[layout]]
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    for q_rows, seen, masked in _query_chunks(comm, causal, length):
        keys = slice(0, seen)
        dq_i, dk_i, dv_i = _api.attention_backward(
            _rows(dout, q_rows, layout), _rows(q, q_rows, layout), _rows(kv[0], keys, layout),
            _rows(kv[1], keys, layout), _rows(out, q_rows, layout), _lse_rows(lse, q_rows), causal=masked,
            scale=scale, layout=layout, softcap=softcap)
        _rows(dq, q_rows, layout).copy_(dq_i)
        _rows(dkv[0], keys, layout).add_(dk_i)
        _rows(dkv[1], keys, layout).add_(dv_i)
    mine = comm.reduce_scatter(_shard_order(dkv, comm.size, causal, SEQ_DIM[layout] + 1))
    return dq, mine[0].to(k.dtype), mine[1].to(v.dtype)


def _lse_shape(q, layout):
    b, x, y = q.shape[0], q.shape[1], q.shape[2]
    return (b, y, x) if layout == "bshd" else (b, x, y)


# ----------------------------------------------------------------------------------------------------------------
# Autograd


FORWARD = {"ring": _ring_forward, "allgather": _allgather_forward}
BACKWARD = {"ring": _ring_backward, "allgather": _allgather_backward}


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
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, scale, layout, strategy, softcap = ctx.args
        with torch.no_grad():
            dq, dk, dv = BACKWARD[strategy](dout.contiguous(), q, k, v, out, lse, comm, causal, scale, layout,
                                            softcap=softcap)
        return dq, dk, dv, None, None, None, None, None, None
