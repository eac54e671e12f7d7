"""torch autograd through the registered op torch.ops.fattn.attention and, eagerly, its lean autograd.Function
(../shared/TESTING.md 25): gradients equal
fattn.attention_backward's, torch.compile(fullgraph=True), torch.export, checkpointing, meta / fake tensors,
jit.trace, opcheck, double backward refused, out= / lse= buffers, and a transformer block trained beside SDPA."""
import math

import pytest

from conftest import require, torch
from test_grad import inputs

import fattn


def autograd_targets():
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def leafs(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


@pytest.mark.parametrize("device", autograd_targets())
def test_autograd_matches_attention_backward(device, seed):
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, dout = inputs(2, 4, 2, 77, 91, 64, dt, device, seed)
    ql, kl, vl = leafs(q, k, v)
    out = fattn.attention(ql, kl, vl, causal="bottom_right")
    out.backward(dout)
    with torch.no_grad():
        o, lse = fattn.attention(q, k, v, causal="bottom_right", return_lse=True)
        want = fattn.attention_backward(dout, q, k, v, o, lse, causal="bottom_right")
    assert torch.equal(out.detach(), o)
    for a, b_ in zip((ql.grad, kl.grad, vl.grad), want):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("device", autograd_targets())
def test_autograd_compile_fullgraph_export_and_checkpoint(device, seed):
    require(device)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, dout = inputs(1, 2, 1, 64, 64, 32, dt, device, seed)

    def f(q, k, v):
        return fattn.attention(q, k, v, causal=True)

    ql, kl, vl = leafs(q, k, v)
    f(ql, kl, vl).backward(dout)
    eager = (ql.grad, kl.grad, vl.grad)
    qc, kc, vc = leafs(q, k, v)
    torch.compile(f, fullgraph=True)(qc, kc, vc).backward(dout)
    for a, b_ in zip(eager, (qc.grad, kc.grad, vc.grad)):
        assert torch.equal(a, b_)

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return f(q, k, v)

    ep = torch.export.export(M(), (q, k, v))
    assert "fattn.attention" in str(ep.graph_module.code)
    assert torch.equal(ep.module()(q, k, v), f(q, k, v))

    from torch.utils.checkpoint import checkpoint

    qk, kk, vk = leafs(q, k, v)
    checkpoint(f, qk, kk, vk, use_reentrant=False).backward(dout)
    for a, b_ in zip(eager, (qk.grad, kk.grad, vk.grad)):
        assert torch.equal(a, b_)


def test_autograd_meta_fake_jit_trace_and_opcheck():
    q, k, v, _ = inputs(1, 2, 2, 16, 16, 32, torch.float32, "cpu", 5)
    m = fattn.attention(q.to("meta"), k.to("meta"), v.to("meta"), return_lse=True)
    assert m[0].device.type == "meta" and m[0].shape == q.shape and m[1].shape == (1, 2, 16)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        f = mode.from_tensor(q)
        assert fattn.attention(f, f, f).shape == q.shape
    traced = torch.jit.trace(lambda x: fattn.attention(x, x, x, causal=True), (q,))
    assert torch.equal(traced(q), fattn.attention(q, q, q, causal=True))
    ql, kl, vl = leafs(q, k, v)
    torch.library.opcheck(torch.ops.fattn.attention.default,
                          (ql, kl, vl, 1, None, 0, -1, -1, 0.0, None, None, 0, 0, None, False))
    torch.library.opcheck(torch.ops.fattn.attention.default,  # a window and a softcap
                          (ql, kl, vl, 2, 0.5, 0, 4, 2, 3.0, None, None, 0, 0, None, False))


def test_autograd_eager_path_matches_the_op():
    """Eager calls with gradients take a lean torch.autograd.Function (torch.library's per-call handling of the op's
    arguments cost ~200 us of host time a call); its output and gradients equal those of the registered op's
    autograd formula, bitwise."""
    import fattn._torch  # noqa: F401  registers torch.ops.fattn

    q, k, v, dout = inputs(1, 2, 2, 17, 23, 32, torch.float32, "cpu", 11)
    a, b = leafs(q, k, v), leafs(q, k, v)
    out_a = fattn.attention(*a, causal=True)
    assert type(out_a.grad_fn).__name__ == "_EagerAttentionBackward"
    out_b, _ = torch.ops.fattn.attention(*b, 1, None, 0, -1, -1, 0.0, None, None, 0, 0, None, False)
    assert type(out_b.grad_fn).__name__ != "_EagerAttentionBackward"
    assert torch.equal(out_a, out_b)
    ga, gb = torch.autograd.grad(out_a, a, dout), torch.autograd.grad(out_b, b, dout)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_autograd_double_backward_is_a_clear_error():
    q, k, v, _ = inputs(1, 2, 2, 16, 16, 32, torch.float32, "cpu", 6)
    ql = q.requires_grad_()
    (gq,) = torch.autograd.grad(fattn.attention(ql, k, v).sum(), ql, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        gq.sum().backward()


def test_autograd_lse_and_out_buffers():
    """return_lse with gradients: out is differentiable, lse is not; out= is written and stays in the graph."""
    q, k, v, dout = inputs(1, 2, 2, 16, 20, 32, torch.float32, "cpu", 7)
    ql, kl, vl = leafs(q, k, v)
    out, lse = fattn.attention(ql, kl, vl, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    given = torch.empty_like(q)
    o2 = fattn.attention(ql, kl, vl, out=given)
    assert o2 is given and torch.equal(given, out.detach())
    o2.backward(dout)
    assert ql.grad is not None and not torch.isnan(ql.grad).any()
    # out= is checked as the call without gradients checks it (the C intake's rules), before anything runs
    for bad, exc, match in [(kl.detach()[:, :, :16], ValueError, "out: shares memory with k"),
                            (torch.zeros(1, 2, 1, 32).expand(1, 2, 16, 32), ValueError, "out: its elements overlap"),
                            (torch.empty(1, 2, 16, 32, dtype=torch.float64), TypeError, "out: dtype float64"),
                            (torch.empty(1, 2, 16, 16), ValueError, r"out: shape \(1, 2, 16, 16\) differs")]:
        with pytest.raises(exc, match=match):
            fattn.attention(ql, kl, vl, out=bad)
    with pytest.raises(ValueError, match="lse: shape must be"):
        fattn.attention(ql, kl, vl, lse=torch.empty(1, 2, 15))


@pytest.mark.parametrize("device", autograd_targets())
def test_training_a_transformer_block_matches_sdpa(device):
    """A few optimizer steps of a small pre-norm transformer block (GQA attention, causal) with fattn and with torch
    SDPA from the same weights and data: the losses agree step by step."""
    require(device)
    torch.manual_seed(0)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    dim, heads, kv_heads, seq, batch = 128, 4, 2, 96, 4

    class Block(torch.nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn
            self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv = torch.nn.Linear(dim, dim + 2 * dim * kv_heads // heads)
            self.proj = torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

        def forward(self, x):
            b, s, _ = x.shape
            hd = dim // heads
            q, k, v = self.qkv(self.norm1(x)).split([dim, dim * kv_heads // heads, dim * kv_heads // heads], -1)
            q = q.view(b, s, heads, hd).transpose(1, 2)
            k = k.view(b, s, kv_heads, hd).transpose(1, 2)
            v = v.view(b, s, kv_heads, hd).transpose(1, 2)
            x = x + self.proj(self.attn(q, k, v).transpose(1, 2).reshape(b, s, dim))
            return x + self.mlp(self.norm2(x))

    def sdpa(q, k, v):
        rep = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                                v.repeat_interleave(rep, 1), is_causal=True)

    a = Block(lambda q, k, v: fattn.attention(q, k, v, causal=True)).to(device, dt)
    b = Block(sdpa).to(device, dt)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (a, b))
    data = torch.randn(batch, seq, dim, device=device, dtype=dt)
    target = torch.randn(batch, seq, dim, device=device, dtype=dt)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    for step in range(5):
        losses = []
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(data).float(), target.float())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert math.isfinite(losses[0])
        assert abs(losses[0] - losses[1]) <= tol * abs(losses[1]), f"step {step}: {losses}"


def test_forward_mode_ad_is_refused():
    """Dual tensors (forward-mode AD) are refused naming the argument: fattn has no forward-mode rule, and before
    the output silently carried no tangent (a zero directional derivative)."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with fwAD.dual_level():
        dq = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="q: forward-mode AD"):
            fattn.attention(dq, k, v)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        packed = fwAD.make_dual(torch.randn(8, 2, 16), torch.ones(8, 2, 16))
        with pytest.raises(NotImplementedError, match="q: forward-mode AD"):
            fattn.attention_varlen(packed, packed.detach(), packed.detach(), cu, cu)
        assert fattn.attention(q, k, v).shape == q.shape  # plain tensors inside dual_level still run


def test_torch_func_grad_and_vjp_work_vmap_and_jvp_refused():
    """torch.func.grad and vjp give fattn's gradients (they need the Function's setup_context); vmap (and jacrev,
    hessian, which map the backward) and jvp have no rule in fattn and are refused naming it."""
    q, k, v, dout = inputs(1, 4, 2, 17, 23, 32, torch.float32, "cpu", 12)
    f = lambda q, k, v: (fattn.attention(q, k, v, causal=True) * dout).sum()  # noqa: E731
    got = torch.func.grad(f, argnums=(0, 1, 2))(q, k, v)
    ls = leafs(q, k, v)
    f(*ls).backward()
    assert all(torch.equal(a, b.grad) for a, b in zip(got, ls))
    out, vjp = torch.func.vjp(lambda q: fattn.attention(q, k, v, causal=True), q)
    assert torch.equal(vjp(dout)[0], ls[0].grad)
    with pytest.raises(NotImplementedError, match="torch.func.vmap"):
        torch.func.vmap(lambda q: fattn.attention(q, k, v))(q[None])
    with pytest.raises(NotImplementedError, match="torch.func.vmap"):
        torch.func.jacrev(lambda q: fattn.attention(q, k, v).sum(-1))(q)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda q: fattn.attention(q, k, v), (q,), (q,))
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.func.grad(lambda q: torch.func.grad(f)(q, k, v).sum())(q)
    # tensors that need no gradient inside the transform are still its wrappers (no memory of their own)
    g = torch.func.grad(lambda x: (fattn.attention(x.detach(), k, v) * x).sum())(q)
    assert torch.equal(g, fattn.attention(q, k, v))


def test_traced_calls_accept_what_eager_calls_accept():
    """The fake kernels' checks refuse nothing the eager call takes: a loss that is the sum of the output (dout of
    stride 0, made contiguous by the backward as eagerly), and under automatic dynamic shapes a max_seqlen that
    becomes symbolic while the tensors stay static (not read: it would specialise)."""
    import torch._dynamo

    q, k, v, _ = inputs(1, 4, 2, 16, 16, 32, torch.float32, "cpu", 14)
    ls = leafs(q, k, v)
    torch.compile(lambda q, k, v: fattn.attention(q, k, v).sum(), fullgraph=True, backend="aot_eager")(*ls).backward()
    want = leafs(q, k, v)
    fattn.attention(*want).sum().backward()
    assert all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(ls, want))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, cu, m: fattn.attention_varlen(q, k, v, cu, cu, max_seqlen_q=m,
                                                                          max_seqlen_k=m),
                             fullgraph=True, backend="aot_eager")
    for lens in ([12, 12], [4, 20], [10, 14]):
        cu = torch.tensor([0, lens[0], 24], dtype=torch.int32)
        x = [torch.randn(24, 2, 32, requires_grad=True) for _ in range(3)]
        y = compiled(*x, cu, max(lens))
        y.backward(torch.ones_like(y))
        assert torch.allclose(y, fattn.attention_varlen(*[t.detach() for t in x], cu, cu), atol=1e-6)


def test_traced_calls_refused_as_eager_ones():
    """The ops' fake kernels check a call by C's rules (_C.check_forward / check_backward), so torch.export, meta
    and fake tensors refuse bad input at trace time with the eager message (they returned shapes for anything)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, dout = inputs(1, 4, 2, 16, 16, 32, torch.float32, "cpu", 13)

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return fattn.attention(q, k, v)

    with pytest.raises(ValueError, match="k: 3 heads do not divide q's 4 heads"):
        torch.export.export(Block(), (q, k[:, :1].expand(1, 3, 16, 32).contiguous(), v[:, :1].expand(1, 3, 16, 32)))
    assert torch.export.export(Block(), (q, k, v)) is not None
    with pytest.raises(ValueError, match="v: head dim 16 differs from q's 32"):
        fattn.attention(q.to("meta"), k.to("meta"), v[..., :16].to("meta"))
    with pytest.raises(ValueError, match="k: on cpu but q is on meta"):
        fattn.attention(q.to("meta"), k, v.to("meta"))
    cu, cu64 = torch.tensor([0, 7, 16], dtype=torch.int32), torch.tensor([0, 7, 16])
    cache_seqlens64 = torch.zeros(2, dtype=torch.int64)
    cache, q1 = torch.zeros(2, 32, 2, 32), torch.zeros(2, 1, 4, 32)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v, dout)]  # (16, H, 32)
    with FakeTensorMode() as mode:
        fq, fk, fv, fd = (mode.from_tensor(x) for x in packed)
        with pytest.raises(TypeError, match="cu_seqlens_q: dtype must be int32"):
            fattn.attention_varlen(fq, fk, fv, mode.from_tensor(cu64), mode.from_tensor(cu), max_seqlen_q=9,
                                   max_seqlen_k=9)
        out, lse = torch.ops.fattn.attention(fq, fk, fv, 0, None, 0, -1, -1, 0.0, mode.from_tensor(cu),
                                             mode.from_tensor(cu), 9, 9, None, False)
        with pytest.raises(ValueError, match="dout: shape must be q's"):
            torch.ops.fattn.attention_backward(fd[:15], fq, fk, fv, out, lse, 0, None, 0, -1, -1, 0.0,
                                               mode.from_tensor(cu), mode.from_tensor(cu), 9, 9, None, False)
        fattn_grads = torch.ops.fattn.attention_backward(fd, fq, fk, fv, out, lse, 0, None, 0, -1, -1, 0.0,
                                                         mode.from_tensor(cu), mode.from_tensor(cu), 9, 9, None,
                                                         False)
        assert [tuple(g.shape) for g in fattn_grads[:3]] == [tuple(fq.shape), tuple(fk.shape), tuple(fv.shape)]
        fc = mode.from_tensor(cache)
        with torch.no_grad(), pytest.raises(TypeError, match="cache_seqlens: dtype must be int32"):
            fattn.attention_with_kvcache(mode.from_tensor(q1), fc, fc, cache_seqlens=mode.from_tensor(cache_seqlens64))


def test_register_torch_ops_makes_the_ops_available():
    """fattn.register_torch_ops() registers torch.ops.fattn.* without a torch tensor having reached fattn (what
    torch.export.load of a program using fattn needs in a fresh process)."""
    import subprocess
    import sys

    code = ("import torch, fattn; fattn.register_torch_ops(); "
            "print(hasattr(torch.ops.fattn, 'attention') and hasattr(torch.ops.fattn, 'attention_backward'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]
