"""The backward's call surface (../shared/TESTING.md 21-25): argument errors, NumPy and empty shapes, the GPU
dispatch of the backward (plans, fallbacks), CUDA graph capture, the caller's stream and device.  (Gradient accuracy:
test_grad.py.)  `pytest -k grad`."""
import pytest

from conftest import require, torch

import fattn
from fattn import _C
from fattn.testing import reference
from test_grad import check, inputs, require_variant

# ---- arguments -------------------------------------------------------------------------------------------------

def test_backward_argument_errors():
    q, k, v, dout = inputs(1, 2, 2, 8, 8, 16, torch.float32, "cpu", 0)
    out, lse = fattn.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse: the backward needs the forward's LSE"):
        _C.backward(dout, q, k, v, out, None, q.clone(), k.clone(), v.clone())
    with pytest.raises(ValueError, match="dk: shape must be k's"):
        fattn.attention_backward(dout, q, k, v, out, lse, dk=torch.empty(1, 2, 9, 16))
    with pytest.raises(TypeError, match="dv: dtype float16 differs from q's float32"):
        fattn.attention_backward(dout, q, k, v, out, lse, dv=v.half())
    with pytest.raises(ValueError, match="dout: shape must be q's"):
        fattn.attention_backward(dout[:, :, :4], q, k, v, out, lse)
    with pytest.raises(ValueError, match="dq: the last dimension must be contiguous"):
        fattn.attention_backward(dout, q, k, v, out, lse, dq=torch.empty(1, 2, 16, 8).transpose(-1, -2))
    with pytest.raises(ValueError, match="causal:"):
        fattn.attention_backward(dout, q, k, v, out, lse, causal="diagonal")
    with pytest.raises(ValueError, match="variant: 'v2' does not run on the CPU"):
        fattn.attention_backward(dout, q, k, v, out, lse, variant="v2")


def test_backward_gradients_need_memory_of_their_own():
    """dq, dk, dv may not share memory with what the backward reads (q, k, v, out, dout, lse) nor with one another,
    nor overlap themselves: each is written while the inputs are still read (dk = dv kept only dv); the workspace
    likewise.  Gradients in slices of one packed buffer (B, S, 3, H, D) are fine, and equal separate ones."""
    q, k, v, dout = inputs(1, 2, 2, 16, 16, 32, torch.float32, "cpu", 1)
    out, lse = fattn.attention(q, k, v, return_lse=True)
    for name, x in dict(q=q, k=k, v=v, out=out, dout=dout).items():
        with pytest.raises(ValueError, match=f"dq: shares memory with {name}, which the backward still reads"):
            fattn.attention_backward(dout, q, k, v, out, lse, dq=x)
    buf = torch.empty(32 + 1024)
    lse_in, dq_on_lse = buf[:32].view(1, 2, 16), buf[16:16 + 1024].view(1, 2, 16, 32)
    lse_in.copy_(lse)
    with pytest.raises(ValueError, match="dq: shares memory with lse"):
        fattn.attention_backward(dout, q, k, v, out, lse_in, dq=dq_on_lse)
    shared = torch.empty_like(k)
    with pytest.raises(ValueError, match="dv: shares memory with dk"):
        fattn.attention_backward(dout, q, k, v, out, lse, dk=shared, dv=shared)
    with pytest.raises(ValueError, match="dq: its elements overlap one another"):
        fattn.attention_backward(dout, q, k, v, out, lse, dq=torch.empty(1, 2, 1, 32).expand(1, 2, 16, 32))
    with pytest.raises(ValueError, match="workspace: shares memory with q"):
        _C.backward(dout, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                    workspace=q)
    qs, ks, vs, ds = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    os, ls = fattn.attention(qs, ks, vs, layout="bshd", return_lse=True)
    grads = torch.empty(1, 16, 3, 2, 32)
    got = fattn.attention_backward(ds, qs, ks, vs, os, ls, layout="bshd", dq=grads[:, :, 0], dk=grads[:, :, 1],
                                   dv=grads[:, :, 2])
    want = fattn.attention_backward(ds, qs, ks, vs, os, ls, layout="bshd")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # GQA: q's 4 heads beside k's and v's 2 in one (B, S, 4 + 2 + 2, D) buffer (views of one stride pattern, other
    # sizes: compared exactly too)
    q4, k2, v2, d4 = inputs(1, 4, 2, 16, 16, 32, torch.float32, "cpu", 2)
    q4, k2, v2, d4 = (x.transpose(1, 2).contiguous() for x in (q4, k2, v2, d4))
    o4, l4 = fattn.attention(q4, k2, v2, layout="bshd", return_lse=True)
    fused = torch.empty(1, 16, 8, 32)
    got = fattn.attention_backward(d4, q4, k2, v2, o4, l4, layout="bshd", dq=fused[:, :, :4], dk=fused[:, :, 4:6],
                                   dv=fused[:, :, 6:])
    want = fattn.attention_backward(d4, q4, k2, v2, o4, l4, layout="bshd")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="dv: shares memory with dk"):
        fattn.attention_backward(d4, q4, k2, v2, o4, l4, layout="bshd", dk=fused[:, :, 4:6], dv=fused[:, :, 5:7])


def test_backward_numpy_and_empty_shapes():
    np = pytest.importorskip("numpy")
    q, k, v, dout = (x.numpy() for x in inputs(1, 2, 1, 20, 25, 32, torch.float32, "cpu", 3))
    out, lse = fattn.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = fattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert isinstance(dq, np.ndarray) and dq.shape == q.shape and dk.shape == k.shape
    ref = reference.gradients(q, k, v, dout, True)
    for a, r in zip((dq, dk, dv), ref):
        assert np.abs(a - r).max() < 1e-4
    # Sq = 0: dk, dv are zero; Sk = 0: dq is zero
    for sq, sk in ((0, 5), (5, 0)):
        q, k, v, dout = inputs(1, 2, 2, sq, sk, 16, torch.float32, "cpu", 1)
        out, lse = fattn.attention(q, k, v, return_lse=True)
        g = fattn.attention_backward(dout, q, k, v, out, lse)
        for x in g:
            assert x.numel() == 0 or (x == 0).all()
    # the GPU workspace is never empty (with Sq = 0 the dK / dV kernel still runs and needs an address)
    assert _C.backward_workspace_bytes(2, 4, 0, 64) == 16 and _C.backward_workspace_bytes(0, 4, 9, 64) == 16
    # 4 bytes a row (Sq = 100: 256 rows, 80-row steps then 128-row blocks) for each column of dQ's accumulator (the
    # head-dim bucket), D, LSE and the counters; deterministic mode at head dim 256 keeps two copies of the accumulator
    assert _C.backward_workspace_bytes(1, 2, 100, 256) == 4 * 2 * 256 * (256 + 3)
    assert _C.backward_workspace_bytes(1, 2, 100, 256, True) == 4 * 2 * 256 * (2 * 256 + 3)
    assert _C.backward_workspace_bytes(1, 2, 100, 200, True) == 4 * 2 * 256 * (2 * 256 + 3)
    assert _C.backward_workspace_bytes(1, 2, 100, 128, True) == _C.backward_workspace_bytes(1, 2, 100, 128)
    with pytest.raises(TypeError, match="backward_workspace_bytes"):
        _C.backward_workspace_bytes(1, 2, 100)


# ---- GPU dispatch: plans, fallback, graphs, streams -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_grad_gpu_empty_shapes(variant, seed):
    """Sq = 0 (dK = dV = 0, through a workspace that is never empty) and Sk = 0 (dQ = 0) on the tensor-core
    backwards, both modes (forced to v3, such calls run v2's: an empty tensor has no address for TMA)."""
    require_variant("cuda", variant)
    for sq, sk in ((0, 130), (70, 0)):
        q, k, v, dout = inputs(2, 4, 2, sq, sk, 64, torch.float16, "cuda", seed)
        out, lse = fattn.attention(q, k, v, return_lse=True)
        for det in (False, True):
            g = [torch.full_like(x, float("nan")) for x in (q, k, v)]
            fattn.attention_backward(dout, q, k, v, out, lse, variant=variant, deterministic=det, dq=g[0], dk=g[1],
                                     dv=g[2])
            for x in g:
                assert x.numel() == 0 or (x == 0).all(), (sq, sk, det)


@pytest.mark.gpu
def test_grad_gpu_plans_and_unaligned_fallback(seed):
    require("cuda")
    q, k, v, dout = inputs(1, 4, 2, 70, 90, 64, torch.float16, "cuda", seed)
    out, lse = fattn.attention(q, k, v, return_lse=True)
    g = [torch.empty_like(x) for x in (q, k, v)]
    stream = torch.cuda.current_stream().cuda_stream
    plan = _C._dev.plan_backward(dout, q, k, v, out, lse, *g, stream=stream)
    sm = torch.cuda.get_device_capability()
    assert plan["variant"] == ("v3" if sm == (9, 0) else "v2" if sm >= (8, 0) else "v1")
    assert plan["workspace"] == _C.backward_workspace_bytes(1, 4, 70, 64)
    if "v3" in fattn.variants("cuda"):  # forced to v3, a call v3's backward does not take (scale < 0) runs v2's
        assert _C._dev.plan_backward(dout, q, k, v, out, lse, *g, stream=stream, variant="v3",
                                     deterministic=True)["variant"] == "v3"
        q2, k2, v2_, d2 = inputs(1, 2, 2, 70, 90, 256, torch.float16, "cuda", seed)
        o2, l2 = fattn.attention(q2, k2, v2_, return_lse=True)
        g2 = [torch.empty_like(x) for x in (q2, k2, v2_)]
        assert _C._dev.plan_backward(d2, q2, k2, v2_, o2, l2, *g2, stream=stream, variant="v3")["variant"] == "v3"
        o3, l3 = fattn.attention(q2, k2, v2_, scale=-0.2, return_lse=True)
        assert _C._dev.plan_backward(d2, q2, k2, v2_, o3, l3, *g2, stream=stream, variant="v3",
                                     scale=-0.2)["variant"] == "v2"
    assert _C._dev.plan_backward(dout, q, k, v, out, lse, *g, stream=stream, variant="v0")["variant"] == "v1"
    # q one element off 16-byte alignment: v2 cannot read it with 16-byte copies; the default falls back to v1
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    qu = buf[1:].view(q.shape).copy_(q)
    ou, lu = fattn.attention(qu, k, v, return_lse=True)
    assert _C._dev.plan_backward(dout, qu, k, v, ou, lu, *g, stream=stream)["variant"] == "v1"
    with pytest.raises(ValueError, match="variant: .*align"):
        _C._dev.plan_backward(dout, qu, k, v, ou, lu, *g, stream=stream, variant="v2")
    got = fattn.attention_backward(dout, qu, k, v, ou, lu)
    check(got, q, k, v, dout)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_grad_cuda_graph_capture_and_replay(deterministic, seed):
    """attention_backward captured into a CUDA graph (its workspace from torch's allocator, capture-safe) replays
    to the eager result; without a workspace the C call refuses cleanly under capture."""
    require("cuda")
    q, k, v, dout = inputs(2, 4, 2, 200, 200, 64, torch.float16, "cuda", seed)
    out, lse = fattn.attention(q, k, v, causal=True, return_lse=True)
    want = fattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)  # warm up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    graph.replay()
    torch.cuda.synchronize()
    for a, b_ in zip(got, want):
        if deterministic:
            assert torch.equal(a, b_)
        else:
            torch.testing.assert_close(a, b_, rtol=1e-2, atol=1e-2)
    g = [torch.empty_like(x) for x in (q, k, v)]
    graph2 = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="no workspace for the backward"):
        with torch.cuda.graph(graph2):
            _C.backward(dout, q, k, v, out, lse, *g, causal=1, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()  # nothing left pending
    assert torch.equal(fattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)[0], want[0])


@pytest.mark.gpu
def test_grad_workspace_argument(seed):
    """The GPU backward's workspace: a torch float32 tensor (as fattn's torch integration allocates it, read through
    the lean torch path) and the same bytes in other dtypes (uint8 through DLPack, float16 through the lean path)
    give bitwise the same gradients, and right ones; too small, not contiguous, or on another device: a ValueError
    naming the workspace."""
    require("cuda")
    q, k, v, dout = inputs(2, 4, 2, 200, 150, 64, torch.float16, "cuda", seed)
    out, lse = fattn.attention(q, k, v, return_lse=True)
    nbytes = _C.backward_workspace_bytes(2, 4, 200, 64)
    stream = torch.cuda.current_stream().cuda_stream or 1  # DLPack's legacy default stream is 1, not 0

    def run(ws):
        g = [torch.empty_like(x) for x in (q, k, v)]
        _C.backward(dout, q, k, v, out, lse, *g, stream=stream, workspace=ws, deterministic=True)
        return g

    want = run(torch.empty(nbytes // 4, device="cuda", dtype=torch.float32))
    check(want, q, k, v, dout)
    for ws in (torch.empty(nbytes, device="cuda", dtype=torch.uint8),
               torch.empty(nbytes // 2, device="cuda", dtype=torch.float16)):
        assert all(torch.equal(a, b) for a, b in zip(run(ws), want)), ws.dtype
    for ws, match in ((torch.empty(nbytes // 4 - 4, device="cuda"), "workspace: .* need"),
                      (torch.empty(nbytes // 2, device="cuda")[::2], "workspace: must be contiguous"),
                      (torch.empty(nbytes // 4), "workspace: on cpu but q is on cuda:0")):
        with pytest.raises(ValueError, match=match):
            run(ws)
    torch.cuda.synchronize()  # nothing left pending


@pytest.mark.gpu
def test_grad_workspace_deterministic_wide(seed):
    """Deterministic mode at head dim 256 needs backward_workspace_bytes(..., deterministic=True), which holds two
    copies of dQ's accumulator (v3's wide kernel adds a tile's turns alternately into them): a workspace of that size
    gives the gradients of the one fattn allocates itself, bitwise, and right ones; one sized for the default mode is
    refused with a ValueError that says so."""
    require("cuda")
    q, k, v, dout = inputs(1, 4, 2, 700, 600, 256, torch.float16, "cuda", seed)
    out, lse = fattn.attention(q, k, v, return_lse=True)
    stream = torch.cuda.current_stream().cuda_stream or 1

    def run(ws):
        g = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        _C.backward(dout, q, k, v, out, lse, *g, stream=stream, workspace=ws, deterministic=True)
        return g

    nbytes = _C.backward_workspace_bytes(1, 4, 700, 256, True)
    assert nbytes > _C.backward_workspace_bytes(1, 4, 700, 256)
    want = run(None)
    check(want, q, k, v, dout)
    got = run(torch.full((nbytes // 4,), float("nan"), device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="workspace: .* need .*deterministic=True"):
        run(torch.empty(_C.backward_workspace_bytes(1, 4, 700, 256) // 4, device="cuda"))
    torch.cuda.synchronize()  # nothing left pending


@pytest.mark.gpu
def test_grad_runs_on_the_callers_stream_and_device(seed):
    require("cuda")
    n = torch.cuda.device_count()
    dev = f"cuda:{n - 1}"
    q, k, v, dout = inputs(1, 2, 2, 64, 64, 64, torch.float16, dev, seed)
    with torch.cuda.device(dev):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            out, lse = fattn.attention(q, k, v, return_lse=True)
            got = fattn.attention_backward(dout, q, k, v, out, lse)
        s.synchronize()
    check(got, q, k, v, dout)
