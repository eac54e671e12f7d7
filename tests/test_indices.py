"""Index arrays remembered once checked (fattn/_indices.py): packed calls' cu_seqlens, KV-cache calls' cache_seqlens
and block_table -- the same unchanged arrays are not read back again; anything that changed them, or could have, is
checked again, so bad indices still raise.  The reads are counted through fattn._C.  `pytest -k remembered`."""
import pytest

from conftest import packed, require, torch
from test_kvcache import _assert_refused, _paged
from test_serving import devices

import fattn

# Only CUDA tensors are remembered (a CPU array is read without a sync, so checked every call): test_cpu_arrays_*.
CUDA = [pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


class _Reads:
    """Counts, through fattn._C, the reads of index arrays calls make: longest_sequence() calls, and calls of
    forward() / backward() given index arrays that check (read) them."""

    INDEX_ARGS = ("cu_seqlens_q", "cache_seqlens", "block_table")

    def __init__(self, monkeypatch):
        self.longest, self.checking = 0, 0
        for name in ("longest_sequence", "forward", "backward"):
            monkeypatch.setattr(fattn._C, name, self.counted(name, getattr(fattn._C, name)))

    def counted(self, name, fn):
        def call(*args, **kw):
            if name == "longest_sequence":
                self.longest += 1
            elif any(kw.get(a) is not None for a in self.INDEX_ARGS) and kw.get("check_indices", True):
                self.checking += 1
            return fn(*args, **kw)
        return call

    def take(self):
        got, self.longest, self.checking = (self.longest, self.checking), 0, 0
        return got


@pytest.mark.parametrize("device", CUDA)
def test_varlen_checked_arrays_remembered(device, seed, monkeypatch):
    """Checked cu_seqlens are remembered (fattn/_indices.py) when both max_seqlen are given: the same unchanged
    tensors with the same rows and max_seqlen arguments are not read again by the forward or the backward, and give
    the same result; a write through torch (version counter), other max_seqlen arguments, other row counts or an
    inference tensor (no version counter) are checked again, so bad offsets still raise.  Never remembered: calls
    that read max_seqlen from the arrays.  Through autograd the remembered forward and its backward read nothing."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, dt, device, seed)
    kw = dict(max_seqlen_q=70, max_seqlen_k=70, causal="bottom_right")
    reads = _Reads(monkeypatch)
    want = fattn.attention_varlen(q, k, v, cq, ck, **kw)
    assert reads.take() == (0, 1)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    assert reads.take() == (0, 0) and torch.equal(out, want)
    dout = torch.ones_like(q)
    g = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, deterministic=True, **kw)
    assert reads.take() == (0, 0)
    leafs = [x.clone().requires_grad_() for x in (q, k, v)]
    fattn.attention_varlen(*leafs, cq, ck, deterministic=True, **kw).backward(dout)
    assert reads.take() == (0, 0) and all(torch.equal(a, b.grad) for a, b in zip(g, leafs))
    for _ in range(2):  # max_seqlen from the arrays: the call's own check finds it (one read), every call
        assert torch.equal(fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right"), want)
    assert reads.take() == (0, 2)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right", return_lse=True)
    reads.take()
    g2 = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal="bottom_right", deterministic=True)
    # the backward's workspace needs max_seqlen_q first on a GPU (a read of cu_seqlens_q), then its check
    assert reads.take() == ((1 if device == "cuda" else 0), 1) and all(torch.equal(a, b) for a, b in zip(g, g2))
    for _ in range(2):  # other max_seqlen arguments: checked once more, then remembered
        fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right", max_seqlen_q=71, max_seqlen_k=70)
    assert reads.take() == (0, 1)
    with pytest.raises(ValueError, match="max_seqlen_q: 69 is less than the longest query sequence"):
        fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=69, max_seqlen_k=70)
    with pytest.raises(ValueError, match="cu_seqlens_q: the last offset 90 is past the end"):
        fattn.attention_varlen(q[:80], k, v, cq, ck, max_seqlen_q=70, max_seqlen_k=70, out=torch.empty_like(q[:80]))
    assert reads.take() == (0, 2)  # each checked (and refused): a refused call is not remembered
    cq[1] = cq[1]  # a write through torch, even of the same value, is seen
    fattn.attention_varlen(q, k, v, cq, ck, **kw)
    assert reads.take() == (0, 1)
    cq[2] = 2  # now decreasing: the next call checks and refuses it
    with pytest.raises(ValueError, match="cu_seqlens_q: decreases at entry 2"):
        fattn.attention_varlen(q, k, v, cq, ck, **kw)
    assert reads.take() == (0, 1)
    with torch.inference_mode():
        cqi, cki = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, dt, device, seed)[3:]
    for _ in range(2):
        fattn.attention_varlen(q, k, v, cqi, cki, **kw)
        assert reads.take() == (0, 1)


@pytest.mark.parametrize("device", CUDA)
def test_varlen_autograd_backward_trusts_forward(device, seed, monkeypatch):
    """Eager autograd saves cu_seqlens for the backward, which then reads nothing back: the forward checked them (or
    was told not to), and torch refuses the backward if they were written in place since.  Gradients match the
    checked backward's.  Checked by the backward again: an inference tensor (which autograd cannot save), and any
    array under saved-tensor hooks (save_on_cpu, non-reentrant checkpointing: torch checks no version there), where
    the forward does not take remembered arrays on trust either."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, dt, device, seed)
    kw = dict(max_seqlen_q=70, max_seqlen_k=70, causal="bottom_right", deterministic=True)
    dout = torch.randn_like(q)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    want = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq.clone(), ck.clone(), **kw)
    reads = _Reads(monkeypatch)
    for cu in ((cq.clone(), ck.clone()), (cq.clone(),) * 2):  # new arrays: the forward checks them, once
        leafs = [x.clone().requires_grad_() for x in (q, k, v)]
        y = fattn.attention_varlen(*leafs, *cu, **kw)
        assert reads.take() == (0, 1)
        if cu[0] is cu[1]:  # one array for q and k: lengths as q's, so compare with its own checked backward
            o2, l2 = fattn.attention_varlen(q, k, v, *cu, return_lse=True, **kw)
            want = fattn.attention_varlen_backward(dout, q, k, v, o2, l2, *cu, **kw)
            reads.take()
        y.backward(dout)
        assert reads.take() == (0, 0)
        n = int(cu[1][-1])  # key rows past the last sequence get no gradient written
        assert torch.equal(want[0], leafs[0].grad)
        assert all(torch.equal(a[:n], b.grad[:n]) for a, b in zip(want[1:], leafs[1:]))
    leafs = [x.clone().requires_grad_() for x in (q, k, v)]
    cu = cq.clone()
    y = fattn.attention_varlen(*leafs, cu, ck, **kw)
    cu[1] = cu[1]  # a write through torch, even of the same value
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dout)
    with torch.inference_mode():
        cqi, cki = cq.clone(), ck.clone()
    reads.take()
    fattn.attention_varlen(*leafs, cqi, cki, **kw).backward(dout)
    assert reads.take() == (0, 2)
    # saved-tensor hooks (save_on_cpu, offloading, checkpointing): torch checks no version through them, so the
    # forward checks even remembered arrays and the backward checks again
    cu = cq.clone()
    fattn.attention_varlen(q, k, v, cu, ck, **kw)  # checked, remembered
    assert reads.take() == (0, 1)
    with torch.autograd.graph.save_on_cpu():
        y = fattn.attention_varlen(*leafs, cu, ck, **kw)
    assert reads.take() == (0, 1)
    cu[2] = 2  # decreasing now
    with pytest.raises(ValueError, match="cu_seqlens_q: decreases at entry 2"):
        y.backward(dout)
    assert reads.take() == (0, 1)
    # non-reentrant checkpointing (saved-tensor hooks): the gradients of a plain call
    cu, cu_k = cq.clone(), ck.clone()
    leafs = [x.clone().requires_grad_() for x in (q, k, v)]
    y = torch.utils.checkpoint.checkpoint(lambda *x: fattn.attention_varlen(*x, cu, cu_k, **kw), *leafs,
                                          use_reentrant=False)
    y.backward(dout)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    want = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, **kw)
    assert all(torch.equal(a, b.grad) for a, b in zip(want, leafs))


@pytest.mark.gpu
def test_varlen_new_arrays_remembered_only_while_alive(monkeypatch):
    """A remembered array that is dropped does not vouch for the next array Python puts at its address (id() is
    reused): each new cu_seqlens tensor is checked, and bad offsets in one raise."""
    import gc
    require("cuda")
    q, k, v, cq, ck = packed([3, 7, 1], [3, 7, 1], 2, 2, 16, torch.float16, "cuda", 0)
    reads = _Reads(monkeypatch)
    kw = dict(max_seqlen_q=7, max_seqlen_k=7)
    for i in range(20):
        cu = cq.clone()
        fattn.attention_varlen(q, k, v, cu, cu, **kw)
        assert reads.take() == (0, 1)
        del cu
        gc.collect()
        bad = torch.tensor([0, 9, 3, 11], dtype=torch.int32, device="cuda")  # decreasing
        with pytest.raises(ValueError, match="cu_seqlens_q: decreases at entry 2"):
            fattn.attention_varlen(q, k, v, bad, bad, **kw)
        assert reads.take() == (0, 1)


@pytest.mark.parametrize("device", devices())
def test_varlen_compiled_not_remembered(device):
    """Under torch.compile (fullgraph) nothing is remembered: the compiled call traces after an eager call that
    remembered the same cu_seqlens, gives its result, and still checks each run (a bad write refused)."""
    require(device)
    q = torch.randn(10, 2, 16, device=device, dtype=torch.float32 if device == "cpu" else torch.float16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)

    def f(q, cu):
        return fattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=6, max_seqlen_k=6)
    eager = f(q, cu)
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, cu), eager)
    cu[1] = 3  # lengths 3 and 7: longer than max_seqlen 6
    with pytest.raises(ValueError, match="max_seqlen_q: 6 is less than the longest query sequence"):
        compiled(q, cu)


@pytest.mark.parametrize("device", devices())
def test_varlen_compiled_backward_trusts_forward(device, monkeypatch):
    """Compiled with gradients, the forward checks cu_seqlens each run (nothing remembered) and on the GPU the
    backward trusts it, reading nothing; a write between the two is refused by torch (the compiled graph's saved
    inputs).  On the CPU the backward checks them again (CPU arrays are never taken on trust)."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, dt, device, 0)
    kw = dict(max_seqlen_q=70, max_seqlen_k=70, causal="bottom_right", deterministic=True)
    compiled = torch.compile(lambda q, k, v, cq, ck: fattn.attention_varlen(q, k, v, cq, ck, **kw), fullgraph=True)
    dout = torch.randn_like(q)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    want = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, **kw)
    reads = _Reads(monkeypatch)
    for _ in range(2):
        leafs = [x.clone().requires_grad_() for x in (q, k, v)]
        y = compiled(*leafs, cq, ck)
        assert reads.take() == (0, 1)
        y.backward(dout)
        assert reads.take() == (0, 0 if device == "cuda" else 1)
        assert all(torch.allclose(a, b.grad, atol=1e-5 if device == "cpu" else 2e-3) for a, b in zip(want, leafs))
    y = compiled(*leafs, cq, ck)
    if device == "cuda":
        cq[1] = cq[1]
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(dout)
    else:
        cq.numpy()[2] = 2  # decreasing, written behind torch's back
        with pytest.raises(ValueError, match="cu_seqlens_q: decreases at entry 2"):
            y.backward(dout)


@pytest.mark.gpu
def test_varlen_not_remembered_under_capture(seed):
    """Under CUDA graph capture nothing is looked up or noted (fattn/_indices.py): a captured checked call reads its
    cu_seqlens (and fails, as capture cannot read) rather than trusting an eager call's check, since a replay would
    not check what the static buffer holds later; a captured call must say check_indices=False itself."""
    require("cuda")
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, torch.float16, "cuda", seed)
    fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=70, max_seqlen_k=70)  # checked, remembered
    against = (q.shape[0], k.shape[0]), (70, 70)
    assert fattn._indices.remembered((cq, ck), against)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph, seen = torch.cuda.CUDAGraph(), []
    x = torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph, stream=s):
        x += 1  # something to capture
        seen.append((fattn._indices.remembered((cq, ck), against), fattn._indices.stamps((cq, ck))))
    assert seen == [(False, None)]
    assert fattn._indices.remembered((cq, ck), against)  # outside capture again


def _on_gpu(x):
    """A CPU test tensor on the GPU: floats as float16, index arrays as they are."""
    return x.cuda().half() if x.is_floating_point() else x.cuda()


@pytest.mark.gpu
def test_kvcache_checked_indices_remembered(monkeypatch):
    """Checked cache_seqlens and block_table are remembered: a decode step's later layers -- the same unchanged
    tensors, a cache of the same shape, as many new keys -- read nothing back and give the same result; a write
    through torch, another number of new keys or another pool size is checked again, so an entry out of range still
    raises and writes nothing."""
    require("cuda")
    reads = _Reads(monkeypatch)
    args = {name: _on_gpu(x) if isinstance(x, torch.Tensor) else x for name, x in _paged().items()}
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    first = fattn.attention_with_kvcache(q, kc, vc, **args)
    assert reads.take() == (0, 1)
    again = fattn.attention_with_kvcache(q, kc, vc, **args)  # the same new keys into the same slots
    assert reads.take() == (0, 0) and torch.equal(first, again)
    two = dict(args, k_new=_on_gpu(torch.randn(2, 2, 2, 32)), v_new=_on_gpu(torch.randn(2, 2, 2, 32)))
    fattn.attention_with_kvcache(q, kc, vc, **two)
    fattn.attention_with_kvcache(q, kc.clone(), vc.clone(), **two)  # another cache of the same shape
    bigger = _on_gpu(torch.randn(7, 16, 2, 32))
    fattn.attention_with_kvcache(q, bigger, bigger.clone(), **args)
    assert reads.take() == (0, 2)  # two new keys: checked, then remembered; another pool size: checked
    args["cache_seqlens"][0] = 31  # through torch: 31 + 1 new key fits, but is seen and checked
    fattn.attention_with_kvcache(q, kc, vc, **args)
    assert reads.take() == (0, 1)
    args["cache_seqlens"][0] = 32  # no room for the new key: refused again
    _assert_refused(dict(args, q=q, k_cache=kc, v_cache=vc), ValueError, r"cache_seqlens: entry 0 is 32")
    assert reads.take() == (0, 1)


def test_jax_cu_seqlens_remembered(monkeypatch):
    """JAX arrays are immutable: cu_seqlens given as JAX arrays are checked once and remembered, so a second packed
    call with the same arrays reads nothing and gives the same result."""
    jax = pytest.importorskip("jax")
    np = pytest.importorskip("numpy")
    from fattn.testing import reference
    rng = np.random.default_rng(0)
    q = rng.standard_normal((10, 2, 16)).astype(np.float32)
    cu = jax.device_put(np.array([0, 4, 10], dtype=np.int32), jax.devices("cpu")[0])  # beside q, on the host
    reads = _Reads(monkeypatch)
    first = fattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=6, max_seqlen_k=6)
    second = fattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=6, max_seqlen_k=6)
    assert reads.take() == (0, 1)
    assert np.array_equal(first, second)
    seq = q[None, 4:].transpose(0, 2, 1, 3)  # the second sequence, (1, H, 6, D)
    want, _ = reference.attention(seq, seq, seq)
    assert np.allclose(first[4:], np.asarray(want)[0].transpose(1, 0, 2), atol=1e-4)


def test_cpu_arrays_checked_every_call(monkeypatch):
    """CPU index arrays are never remembered: their read costs no sync, and one may share its memory with a NumPy
    array written behind torch's back (no version change).  A decode loop's cache_seqlens advanced through NumPy is
    checked again, so an entry past the cache is refused and nothing is written (it was written past the cache); a
    packed call's cu_seqlens changed through NumPy between forward and backward are checked again by the backward."""
    import numpy as np

    lens = np.array([3, 5], np.int32)
    seqlens = torch.from_numpy(lens)
    buf = torch.zeros(2 * 2 * 32 * 2 * 16)
    kc, neighbour = buf[:2048].view(2, 32, 2, 16), buf[2048:]
    vc, q, new = torch.zeros(2, 32, 2, 16), torch.randn(2, 1, 2, 16), torch.ones(2, 1, 2, 16)
    reads = _Reads(monkeypatch)
    fattn.attention_with_kvcache(q, kc, vc, k_new=new, v_new=new, cache_seqlens=seqlens)
    fattn.attention_with_kvcache(q, kc, vc, k_new=new, v_new=new, cache_seqlens=seqlens)
    assert reads.take() == (0, 2)
    lens[:] = [80, 5]  # through NumPy: torch's version counter does not move
    with pytest.raises(ValueError, match="cache_seqlens: entry 0 is 80"):
        fattn.attention_with_kvcache(q, kc, vc, k_new=new, v_new=new, cache_seqlens=seqlens)
    assert not neighbour.any()
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, torch.float32, "cpu", 0)
    offsets = cq.numpy()  # shares cq's memory
    leafs = [x.clone().requires_grad_() for x in (q, k, v)]
    y = fattn.attention_varlen(*leafs, cq, ck, max_seqlen_q=70, max_seqlen_k=70)
    offsets[2] = 2  # decreasing now, unseen by torch
    with pytest.raises(ValueError, match="cu_seqlens_q: decreases at entry 2"):
        y.backward(torch.ones_like(y))
