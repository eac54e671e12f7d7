"""The two strategies of context parallelism (fattn.distributed): ring and allgather, forward and backward, each
a function of this rank's shards and a communicator (fattn.distributed._Comm: rank, size, shift, all_gather,
reduce_scatter); which rows of the shards meet which keys (the zigzag); the exact merge of partial outputs by their
LSE.  fattn.distributed's docstring describes both strategies.  Imported only through fattn.distributed."""
import torch

from . import _api

SEQ_DIM = {"bshd": 1, "bhsd": 2}
KV_TAG, DKV_TAG = 1, 2  # separate message tags for K/V and for the travelling dK/dV


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


def _drain(*transfers):
    """After an error inside a ring step: complete this rank's posted transfers (the other ranks, raising the same
    error at the same step, complete theirs), so that the group stays usable for the next call."""
    for x in transfers:
        if x is not None:
            try:
                x.wait()
            except Exception:  # the error being raised is the one to report
                pass


def _ring_forward(q, k, v, comm, causal, scale, layout, softcap=0.0):
    length = q.shape[SEQ_DIM[layout]]
    kv = torch.stack((k, v))  # one buffer travels: (2, ...)
    out = lse = incoming = None
    try:
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
                kv, incoming = incoming.wait(), None
    except BaseException:
        _drain(incoming)
        raise
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, comm, causal, scale, layout, softcap=0.0):
    length = q.shape[SEQ_DIM[layout]]
    kv = torch.stack((k, v))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = returning = incoming = None
    try:
        for t in range(comm.size):
            incoming = comm.shift(kv, KV_TAG) if t < comm.size - 1 else None
            q_rows, k_rows, masked = _ring_step_block(comm.rank, (comm.rank - t) % comm.size, causal, length)
            dq_i, dk_i, dv_i = _api.attention_backward(
                _rows(dout, q_rows, layout), _rows(q, q_rows, layout), _rows(kv[0], k_rows, layout),
                _rows(kv[1], k_rows, layout), _rows(out, q_rows, layout), _lse_rows(lse, q_rows), causal=masked,
                scale=scale, layout=layout, softcap=softcap)
            _rows(dq, q_rows, layout).add_(dq_i)
            # This K/V shard's dK/dV accumulator: new at step 0, else what the previous rank sent along with it.
            if t == 0:
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            else:
                dkv, returning = returning.wait(), None
            _rows(dkv[0], k_rows, layout).add_(dk_i)
            _rows(dkv[1], k_rows, layout).add_(dv_i)
            if comm.size > 1:
                returning = comm.shift(dkv, DKV_TAG)  # after the last step this is the shard's way home
            if incoming is not None:
                kv, incoming = incoming.wait(), None
        if returning is not None:
            dkv, returning = returning.wait(), None
    except BaseException:
        _drain(incoming, returning)
        raise
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
# By name


FORWARD = {"ring": _ring_forward, "allgather": _allgather_forward}
BACKWARD = {"ring": _ring_backward, "allgather": _allgather_backward}
