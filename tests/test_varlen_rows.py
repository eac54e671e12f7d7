"""Packed calls' rows and names (attention_varlen): rows outside every sequence get zero gradients, errors name the
user's arrays and shapes, a generous max_seqlen sizes the call by the rows.  `pytest -k varlen`."""
import pytest

from conftest import packed, randn, require, torch
from test_serving import devices

import fattn


@pytest.mark.parametrize("device", devices())
def test_varlen_padding_rows_get_zero_gradients(device, seed):
    """Rows of a packed batch outside every sequence (before cu_seqlens[0], past cu_seqlens[-1]) get zero gradients,
    through autograd and attention_varlen_backward (they were left as torch.empty allocated them), and the call's
    other rows are unchanged by the padding."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cq, ck = packed([3, 17], [4, 30], 2, 1, 64, dt, device, seed)
    pad = lambda x, before, after: torch.cat([randn((before, *x.shape[1:]), dt, device, seed + 7), x,
                                              randn((after, *x.shape[1:]), dt, device, seed + 8)])
    qp, kp, vp = pad(q, 2, 3), pad(k, 5, 1), pad(v, 5, 1)
    cqp, ckp = cq + 2, ck + 5
    dout = randn(tuple(qp.shape), dt, device, seed + 9)
    leafs = [x.clone().requires_grad_() for x in (qp, kp, vp)]
    fattn.attention_varlen(*leafs, cqp, ckp, causal=True, deterministic=True).backward(dout)
    out, lse = fattn.attention_varlen(qp, kp, vp, cqp, ckp, causal=True, return_lse=True)
    grads = fattn.attention_varlen_backward(dout, qp, kp, vp, out, lse, cqp, ckp, causal=True, deterministic=True)
    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    fattn.attention_varlen(*plain, cq, ck, causal=True, deterministic=True).backward(dout[2:-3])
    for g, leaf, x, (before, after) in zip(grads, leafs, plain, [(2, 3), (5, 1), (5, 1)]):
        for got in (g, leaf.grad):
            assert not got[:before].any() and not got[got.shape[0] - after:].any()
            assert torch.equal(got[before:got.shape[0] - after], x.grad)


def test_varlen_errors_name_the_array():
    """Errors of a packed call name the user's array: cu_seqlens_k read for its longest sequence, out's shape as
    given."""
    q, k, v, cq, ck = packed([3, 5], [4, 6], 2, 2, 16, torch.float32, "cpu", 0)
    leafs = [x.clone().requires_grad_() for x in (q, k, v)]
    with pytest.raises(ValueError, match="cu_seqlens_k: decreases"):
        fattn.attention_varlen(*leafs, cq, torch.tensor([0, 5, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_k: dtype must be int32"):
        fattn.attention_varlen(*leafs, cq, ck.long())
    with pytest.raises(ValueError, match=r"out: shape \(8, 2, 24\) differs from q's \(8, 2, 16\)"):
        fattn.attention_varlen(q, k, v, cq, ck, out=torch.zeros(8, 2, 24))


def test_varlen_generous_max_seqlen():
    """A max_seqlen past the packed rows is a valid upper bound: the call is sized by the rows (it asked the CPU
    for 2^31 rows of scratch and failed)."""
    q, k, v, cq, ck = packed([3, 5], [4, 6], 2, 2, 16, torch.float32, "cpu", 0)
    want = fattn.attention_varlen(q, k, v, cq, ck)
    got = fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=2**31 - 1, max_seqlen_k=2**31 - 1)
    assert torch.equal(got, want)
