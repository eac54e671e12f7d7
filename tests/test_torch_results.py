"""What torch sees of fattn's results: writes into caller-supplied tensors advance their version counters (so
autograd refuses a backward that saved them), an out= that requires grad is written by a copy autograd records, a
result fattn allocates is laid out like q (as torch SDPA's) whichever path made it, and torch.autocast casts q, k, v
as it does for SDPA.  CPU and GPU."""
import pytest

from conftest import require, torch

import fattn


def targets():
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def qkv(device, b=1, s=17, h=2, d=16, dtype=None, seed=0):
    dtype = dtype or (torch.float32 if device == "cpu" else torch.float16)
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g).to(device, dtype) for _ in range(3)]


def saved_by_exp(like):
    """(x, y): y = exp(x), which autograd saves for its backward."""
    x = torch.randn(like.shape, dtype=like.dtype, device=like.device).requires_grad_()
    return x, x.exp()


def refuses_backward(y):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", targets())
def test_out_and_lse_written_in_place_advance_the_version(device):
    require(device)
    q, k, v = qkv(device)
    x, y = saved_by_exp(q)
    with torch.no_grad():
        fattn.attention(q, k, v, out=y)
    refuses_backward(y)
    lse = torch.empty(1, 2, 17, device=device, dtype=torch.float32)
    before = lse._version
    with torch.no_grad():
        fattn.attention(q, k, v, lse=lse)
    assert lse._version > before


@pytest.mark.parametrize("device", targets())
def test_gradients_written_in_place_advance_the_version(device):
    require(device)
    q, k, v = qkv(device)
    o, lse = fattn.attention(q, k, v, return_lse=True)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    before = [t._version for t in (dq, dk, dv)]
    fattn.attention_backward(torch.ones_like(o), q, k, v, o, lse, dq=dq, dk=dk, dv=dv)
    assert all(t._version > b for t, b in zip((dq, dk, dv), before))


@pytest.mark.parametrize("device", targets())
def test_varlen_and_kvcache_out_advance_the_version(device):
    require(device)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in qkv(device))  # (17, 2, 16) packed
    cu = torch.tensor([0, 5, 17], dtype=torch.int32, device=device)
    x, y = saved_by_exp(q)
    with torch.no_grad():
        fattn.attention_varlen(q, k, v, cu, cu, max_seqlen_q=12, max_seqlen_k=12, out=y)
    refuses_backward(y)
    qc = q[None, :1]  # (1, 1, 2, 16)
    cache = k[None]   # (1, 17, 2, 16)
    x, y = saved_by_exp(qc)
    with torch.no_grad():
        fattn.attention_with_kvcache(qc, cache, cache, out=y)
    refuses_backward(y)


@pytest.mark.parametrize("device", targets())
def test_out_that_requires_grad_is_written_by_a_recorded_copy(device):
    require(device)
    q, k, v = qkv(device)
    x = torch.randn(q.shape, dtype=q.dtype, device=device).requires_grad_()
    y = x * 2
    r = fattn.attention(q, k, v, out=y)
    assert r is y
    y.sum().backward()
    assert torch.count_nonzero(x.grad) == 0  # y holds attention's output now: a constant in x
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        fattn.attention(q, k, v, out=torch.nn.Parameter(torch.empty_like(q)))
    with pytest.raises(ValueError, match="^out: requires grad"):
        fattn.attention_with_kvcache(q.transpose(1, 2)[:, :1], k.transpose(1, 2), v.transpose(1, 2),
                                     out=torch.empty_like(q.transpose(1, 2)[:, :1]).requires_grad_())


@pytest.mark.parametrize("device", targets())
def test_results_are_laid_out_like_q_on_every_path(device):
    """(B, H, S, D) views of a (B, S, 3, H, D) buffer: the output's memory is (B, S, H, D), as SDPA's, so the usual
    merge of heads by view works whether or not gradients are recorded or the call is compiled."""
    require(device)
    b, s, h, d = 2, 17, 4, 16
    buf = torch.randn(b, s, 3, h, d).to(device, torch.float32 if device == "cpu" else torch.float16)
    q, k, v = (t.transpose(1, 2) for t in buf.unbind(2))
    with torch.no_grad():
        lean = fattn.attention(q, k, v)
    grad = fattn.attention(q.detach().requires_grad_(), k, v)
    compiled = torch.compile(lambda a, c, e: fattn.attention(a, c, e), fullgraph=True, backend="aot_eager")(q, k, v)
    want = torch.empty_like(q).stride()
    assert lean.stride() == grad.stride() == compiled.stride() == want
    assert torch.equal(lean, grad.detach())
    lean.transpose(1, 2).view(b, s, h * d)
    with torch.no_grad():
        dq, dk, dv = fattn.attention_backward(torch.ones_like(lean), q, k, v, *fattn.attention(q, k, v,
                                                                                                return_lse=True))
    assert dq.stride() == want and dk.stride() == want


@pytest.mark.parametrize("device", targets())
def test_autocast_casts_q_k_v_as_for_sdpa(device):
    require(device)
    low = torch.bfloat16 if device == "cpu" else torch.float16
    q, k, v = qkv(device, dtype=torch.float32)
    ql = q.clone().requires_grad_()
    with torch.autocast(device, dtype=low):
        o = fattn.attention(ql, k, v, causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        mixed = fattn.attention(q.to(low), k, v)  # one input already low, the others float32
        packed = fattn.attention_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)),
                                        *(torch.tensor([0, 17], dtype=torch.int32, device=device),) * 2)
        compiled = torch.compile(lambda a, c, e: fattn.attention(a, c, e), fullgraph=True,
                                 backend="aot_eager")(q, k, v)
    assert o.dtype == ref.dtype == mixed.dtype == packed.dtype == compiled.dtype == low
    torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
    o.float().sum().backward()
    assert ql.grad.dtype == torch.float32 and torch.isfinite(ql.grad).all()
    with torch.no_grad():  # outside autocast: float32 in, float32 out
        assert fattn.attention(q, k, v).dtype == torch.float32


def test_autocast_skips_calls_with_out_and_pairs_with_the_backward():
    """torch autocasts no call given out= (a float32 out keeps the call in float32); an autograd Function that saves
    its float32 inputs and calls attention_backward works under autocast, with or without torch.amp.custom_bwd."""
    q, k, v = qkv("cpu", dtype=torch.float32)
    out = torch.empty_like(q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fattn.attention(q, k, v, out=out) is out and out.dtype == torch.float32

    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            o, lse = fattn.attention(q, k, v, return_lse=True)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, do):
            return fattn.attention_backward(do.contiguous(), *ctx.saved_tensors)

    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = Attn.apply(ql, kl, vl)
    assert o.dtype == torch.bfloat16
    o.float().sum().backward()
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fattn.attention(*want).float().sum().backward()
    for a, b in zip((ql, kl, vl), want):
        assert a.grad.dtype == torch.float32
        torch.testing.assert_close(a.grad, b.grad)


def test_gradient_buffers_that_require_grad_are_refused():
    q, k, v = qkv("cpu")
    o, lse = fattn.attention(q, k, v, return_lse=True)
    dq = torch.empty_like(q).requires_grad_()
    with pytest.raises(ValueError, match="^dq: requires grad"):
        fattn.attention_backward(torch.ones_like(o), q, k, v, o, lse, dq=dq)
    with torch.no_grad():
        fattn.attention_backward(torch.ones_like(o), q, k, v, o, lse, dq=dq)  # outside grad mode: written
    assert dq._version > 0
