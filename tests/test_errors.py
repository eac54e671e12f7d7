"""Bad input gets a typed error naming the argument (TESTING.md item 18)."""
import numpy as np
import pytest

from conftest import HAS_CUDA, torch

import fattn


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


CASES = [
    ("int dtype", lambda: (t(1, 2, 4, 8).int(), t(1, 2, 4, 8), t(1, 2, 4, 8)), {}, TypeError, r"q: dtype"),
    ("float64", lambda: (t(1, 2, 4, 8).double(),) * 3, {}, TypeError, r"q: dtype float64 is not supported"),
    ("mixed dtypes", lambda: (t(1, 2, 4, 8), t(1, 2, 4, 8).half(), t(1, 2, 4, 8)), {}, TypeError,
     r"k: dtype float16 differs from q's float32"),
    ("3-D q", lambda: (t(2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)), {}, ValueError, r"q: expected a 4-D"),
    ("5-D k", lambda: (t(1, 2, 4, 8), t(1, 1, 2, 4, 8), t(1, 2, 4, 8)), {}, ValueError, r"k: expected a 4-D"),
    ("head dim 4", lambda: (t(1, 2, 4, 4),) * 3, {}, ValueError, r"q: head dim 4 is not supported"),
    ("head dim 12", lambda: (t(1, 2, 4, 12),) * 3, {}, ValueError, r"q: head dim 12"),
    ("head dim 264", lambda: (t(1, 2, 4, 264),) * 3, {}, ValueError, r"q: head dim 264"),
    ("k head dim", lambda: (t(1, 2, 4, 8), t(1, 2, 4, 16), t(1, 2, 4, 16)), {}, ValueError, r"k: head dim"),
    ("batch", lambda: (t(1, 2, 4, 8), t(2, 2, 4, 8), t(2, 2, 4, 8)), {}, ValueError, r"k: batch"),
    ("v seq", lambda: (t(1, 2, 4, 8), t(1, 2, 5, 8), t(1, 2, 6, 8)), {}, ValueError, r"v: shape"),
    ("head ratio", lambda: (t(1, 6, 4, 8), t(1, 4, 4, 8), t(1, 4, 4, 8)), {}, ValueError, r"k: 4 heads do not divide"),
    ("last dim stride", lambda: (t(1, 2, 8, 4).transpose(-1, -2), t(1, 2, 4, 8), t(1, 2, 4, 8)), {}, ValueError,
     r"q: the last dimension must be contiguous"),
    ("causal", lambda: (t(1, 2, 4, 8),) * 3, {"causal": "diagonal"}, ValueError, r"causal:"),
    ("layout", lambda: (t(1, 2, 4, 8),) * 3, {"layout": "sbhd"}, ValueError, r"layout:"),
    ("variant type", lambda: (t(1, 2, 4, 8),) * 3, {"variant": 2}, TypeError, r"variant:"),
    ("gpu variant on cpu", lambda: (t(1, 2, 4, 8),) * 3, {"variant": "v1"}, ValueError, r"variant: 'v1' does not run on the CPU"),
    ("scale type", lambda: (t(1, 2, 4, 8),) * 3, {"scale": "big"}, TypeError, r"scale:"),
    ("scale inf", lambda: (t(1, 2, 4, 8),) * 3, {"scale": float("inf")}, ValueError, r"scale: must be finite"),
    ("out shape", lambda: (t(1, 2, 4, 8),) * 3, {"out": torch.empty(1, 2, 5, 8)}, ValueError, r"out: shape"),
    ("out dtype", lambda: (t(1, 2, 4, 8),) * 3, {"out": torch.empty(1, 2, 4, 8, dtype=torch.half)}, TypeError,
     r"out: dtype"),
    ("lse dtype", lambda: (t(1, 2, 4, 8),) * 3, {"lse": torch.empty(1, 2, 4, dtype=torch.half)}, TypeError, r"lse: dtype"),
    ("lse shape", lambda: (t(1, 2, 4, 8),) * 3, {"lse": torch.empty(1, 2, 5)}, ValueError, r"lse: shape"),
    ("lse float64", lambda: (t(1, 2, 4, 8),) * 3, {"lse": torch.empty(1, 2, 4, dtype=torch.float64)}, TypeError,
     r"lse: dtype must be float32, got float64"),  # not q's advice (float16, bfloat16 or float32): float32 only
    ("v None", lambda: (t(1, 2, 4, 8), t(1, 2, 4, 8), None), {}, TypeError, r"^v: expected an array, got None"),
    ("k None", lambda: (t(1, 2, 4, 8), None, t(1, 2, 4, 8)), {}, TypeError, r"^k: expected an array, got None"),
    ("window past 64 bits", lambda: (t(1, 2, 4, 8),) * 3, {"window": (2 ** 70, 0)}, ValueError,
     r"^window: .* fit in 64 bits"),
    ("not an array", lambda: ([[1.0]], t(1, 2, 4, 8), t(1, 2, 4, 8)), {}, TypeError, r"q: expected an array"),
    ("k not an array", lambda: (t(1, 2, 4, 8), "k", t(1, 2, 4, 8)), {}, TypeError, r"k: expected an array"),
]


@pytest.mark.parametrize("name,make,kw,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, make, kw, exc, match):
    q, k, v = make()
    with pytest.raises(exc, match=match):
        fattn.attention(q, k, v, **kw)


def test_bshd_shape_messages():
    q = t(1, 4, 2, 8)   # bshd: B=1, S=4, H=2
    k = t(1, 4, 3, 8)   # 3 kv heads do not divide 2
    with pytest.raises(ValueError, match="k: 3 heads do not divide q's 2"):
        fattn.attention(q, k, k, layout="bshd")


def test_variants_and_cuda_queries():
    assert fattn.variants("cpu") == ["cpu"]
    assert fattn.variants("cpu:0") == fattn.variants(torch.device("cpu", 0)) == ["cpu"]  # a CPU device's index
    assert fattn.describe_variants("cpu")[0][0] == "cpu"
    with pytest.raises(ValueError, match="device:"):
        fattn.variants("tpu")
    if not HAS_CUDA:
        assert fattn.cuda_available() is False
        with pytest.raises(RuntimeError, match="fattn"):
            fattn.variants("cuda")


def test_numpy_mixed_dtypes_message():
    a = np.zeros((1, 1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="v: dtype float16 differs from q's float32"):
        fattn.attention(a, a, a.astype(np.float16))


# ---- what a new user hit (issue: structure), each a clear error naming the argument ----

def test_mixed_meta_sparse_and_vmap_tensors_are_refused_naming_the_argument():
    """(All-meta and FakeTensor inputs give meta / fake results through the registered op: test_autograd.py.)"""
    q = t(1, 2, 4, 8)
    with pytest.raises(ValueError, match="k: the array has no data"):
        fattn.attention(q, q.to("meta"), q)
    with pytest.raises(ValueError, match="q: fattn cannot read this tensor's memory"):
        fattn.attention(q.to_sparse(), q, q)
    with pytest.raises(NotImplementedError, match="q: torch.func.vmap .* is not supported"):
        torch.func.vmap(lambda x: fattn.attention(x, x, x))(t(3, 1, 2, 4, 8))


class FakeJaxArray:
    """Stands for a jax.Array (fattn recognises frameworks by module name; JAX is not installed in CI)."""
    __module__ = "jaxlib.xla_extension"


def test_jax_arrays_are_never_written():
    q = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(TypeError, match="out: JAX arrays are immutable"):
        fattn.attention(q, q, q, out=FakeJaxArray())
    with pytest.raises(TypeError, match="lse: JAX arrays are immutable"):
        fattn.attention(q, q, q, lse=FakeJaxArray())


def test_devices_and_dtypes_in_the_users_words():
    from dlpack_capsule import Capsule, f32

    shape = (1, 1, 4, 8)
    k = np.zeros(shape, np.float32)
    on_gpu = Capsule(f32(32), shape, device=(2, 0)).capsule
    with pytest.raises(ValueError, match="k: on cuda:0 but q is on cpu"):
        fattn.attention(k, on_gpu, k, out=np.empty(shape, np.float32))
    with pytest.raises(TypeError, match="q: dtype float64 is not supported"):
        fattn.attention(k.astype(np.float64), k, k)
    with pytest.raises(TypeError, match="q: dtype int32 is not supported"):
        fattn.attention(k.astype(np.int32), k, k)


def test_zero_heads():
    e = t(1, 0, 4, 8)
    assert fattn.attention(e, e, e).shape == e.shape
    with pytest.raises(ValueError, match="k: has 0 heads"):
        fattn.attention(t(1, 2, 4, 8), e, e)


def test_scales_as_users_give_them():
    q = t(1, 2, 5, 8)
    expect = fattn.attention(q, q, q, scale=0.5)
    for s in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), np.array(0.5)):
        assert torch.equal(fattn.attention(q, q, q, scale=s), expect), type(s)
    with pytest.raises(ValueError, match="scale: must be finite in float32"):
        fattn.attention(q, q, q, scale=1e39)
    with pytest.raises(TypeError, match="scale: expected a real number"):
        fattn.attention(q, q, q, scale=torch.tensor([0.5, 0.5]))
    with pytest.raises(TypeError, match="scale: expected a real number"):
        fattn.attention(q, q, q, scale=True)


def test_gpu_calls_without_a_gpu_say_why():
    if HAS_CUDA:
        pytest.skip("a GPU is present: the no-GPU messages cannot show here")
    with pytest.raises(RuntimeError) as e:
        fattn.variants("cuda")
    msg = str(e.value)
    if fattn._C.cuda_compiled:
        assert "no usable NVIDIA driver" in msg or "no CUDA GPU found" in msg, msg
        assert "insufficient" not in msg
    else:
        assert "built without CUDA support" in msg


def test_arrays_their_library_cannot_export_are_named():
    """An array whose own library refuses to export it through DLPack (NumPy: bfloat16 from ml_dtypes, object
    arrays, non-native byte order) gets a TypeError naming the argument and quoting the library, not the library's
    bare BufferError."""
    q = np.zeros((1, 2, 4, 16), np.float32)
    for bad in (q.astype(">f4"), q.astype(object)):
        with pytest.raises(TypeError, match=r"k: this numpy.ndarray cannot be passed through DLPack \(its library "
                           r"says: DLPack only supports"):
            fattn.attention(q, bad, q)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["lean", "autograd"])
def test_out_and_lse_checked_on_both_torch_paths(requires_grad):
    """out= and lse= are checked alike whether the call records gradients (the registered op, which writes them by
    copy_: before, a float64 out of another batch size was cast and broadcast into) or not."""
    q = t(1, 2, 6, 16).requires_grad_(requires_grad)
    k, v = t(1, 2, 6, 16), t(1, 2, 6, 16)
    for kw, exc, match in [({"out": torch.zeros(1, 2, 6, 16, dtype=torch.float64)}, TypeError, r"out: dtype float64"),
                           ({"out": torch.zeros(3, 2, 6, 16)}, ValueError, r"out: shape"),
                           ({"lse": torch.zeros(1, 2, 6, dtype=torch.float64)}, TypeError, r"lse: dtype must be float32"),
                           ({"lse": torch.zeros(1, 2, 5)}, ValueError, r"lse: shape must be \(B=1, H=2, Sq=6\)")]:
        with pytest.raises(exc, match=match):
            fattn.attention(q, k, v, **kw)
    if requires_grad:  # arrays of another library beside a torch q that records gradients: named, not an AttributeError
        with pytest.raises(TypeError, match=r"out: expected a torch tensor like q, got numpy.ndarray"):
            fattn.attention(q, k, v, out=np.zeros((1, 2, 6, 16), np.float32))
        with pytest.raises(TypeError, match=r"k: expected a torch tensor like q, got numpy.ndarray"):
            fattn.attention(q, k.numpy(), v.numpy())


def test_max_seqlen_as_numpy_integers():
    """max_seqlen_q / max_seqlen_k take any integer scalar -- np.diff(cu).max() is NumPy's -- and refuse bools,
    negatives and floats naming the argument."""
    q = np.random.default_rng(0).standard_normal((10, 2, 16)).astype(np.float32)
    cu = np.array([0, 4, 10], np.int32)
    want = fattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=6, max_seqlen_k=6)
    got = fattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=np.diff(cu).max(), max_seqlen_k=np.int64(6))
    assert np.array_equal(got, want)
    for bad in (np.True_, True, -1, 2.0):
        with pytest.raises(TypeError, match=r"max_seqlen_q: expected an int >= 0 or None"):
            fattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=bad)


def test_out_overlapping_the_inputs_is_refused():
    """out= may be q itself (each tile reads its queries before writing them), but not share memory with k or v, nor
    overlap q otherwise: refused naming out, before anything is written (before, out=v gave wrong values)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=g) for _ in range(3))
    want = fattn.attention(q, k, v)
    qq = q.clone()
    assert torch.equal(fattn.attention(qq, k, v, out=qq), want)
    for out, which in ((v, "v"), (k, "k")):
        before = out.clone()
        with pytest.raises(ValueError, match=f"out: shares memory with {which}"):
            fattn.attention(q, k, v, out=out)
        assert torch.equal(out, before)
    big = torch.randn(1, 2, 201, 32, generator=g)
    with pytest.raises(ValueError, match="out: overlaps q without being q"):
        fattn.attention(big[:, :, :200], k, v, out=big[:, :, 1:])
    # slices of one packed buffer interleave but do not overlap: out beside q, k, v in a (B, S, 4, H, D) buffer
    qkvo = torch.randn(1, 200, 4, 2, 32, generator=g)
    pq, pk, pv, po = (qkvo[:, :, i] for i in range(4))
    want_packed = fattn.attention(pq.clone(), pk.clone(), pv.clone(), layout="bshd")
    assert torch.equal(fattn.attention(pq, pk, pv, layout="bshd", out=po), want_packed)
    with pytest.raises(ValueError, match="out: shares memory with k"):  # half a row off: it overlaps k
        fattn.attention(pq, pk, pv, layout="bshd", out=qkvo.view(-1)[16 + 64:].as_strided(pq.shape, pq.stride()))
    row = torch.zeros(1, 2, 1, 32)
    for bad in (row.expand(1, 2, 200, 32), torch.zeros(1, 2, 400 * 32).as_strided((1, 2, 200, 32), (0, 400 * 16, 16, 1))):
        with pytest.raises(ValueError, match="out: its elements overlap one another"):
            fattn.attention(q, k, v, out=bad)


def test_lse_overlapping_the_arrays_is_refused():
    """lse= may not share memory with q, k, v or out, nor have two elements at one address (a stride of 0): each was
    accepted and gave wrong values (out off by 3.7, the LSE by 1.1); packed batches' (H, total_q) lse alike.  Nothing
    is written."""
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 8, 16)).astype(np.float32) for _ in range(3))
    out = np.zeros_like(q)
    qq = q.copy()
    zero_h = np.lib.stride_tricks.as_strided(np.zeros(16, np.float32), (2, 2, 8), (32, 0, 4))
    for kw, call_q, match in ((dict(out=out, lse=out[:, :, 0, :8]), q, "lse: shares memory with out"),
                              (dict(lse=qq[1, :, :2, :8]), qq, "lse: shares memory with q"),
                              (dict(lse=k[0, :, :2, :8]), q, "lse: shares memory with k"),
                              (dict(lse=zero_h), q, "lse: its elements overlap one another")):
        before = [x.copy() for x in (call_q, k, v, out)]
        with pytest.raises(ValueError, match=match):
            fattn.attention(call_q, k, v, **kw)
        assert all(np.array_equal(a, b) for a, b in zip((call_q, k, v, out), before))
    assert fattn.attention(q, k, v, lse=np.empty((2, 2, 8), np.float32))[1].shape == (2, 2, 8)  # a separate lse
    p = rng.standard_normal((8, 2, 16)).astype(np.float32)  # packed: lse (H, total_q) through the C call
    cu = np.array([0, 3, 8], np.int32)
    with pytest.raises(ValueError, match="lse: shares memory with q"):
        fattn._C.forward(p, p.copy(), p.copy(), np.empty_like(p), p[0, :, :8], cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_raw_capsule_q_without_out_is_named():
    """A raw DLPack capsule has no shape to allocate results by: fattn.attention says to pass out= (with out= it
    runs); the packed and KV-cache calls, which read q's shape first, name q (they said 'got 0-D' or raised an
    AttributeError)."""
    import numpy as np

    q = np.random.default_rng(1).standard_normal((1, 2, 8, 16)).astype(np.float32)
    with pytest.raises(TypeError, match=r"pass out= \(and lse= with return_lse\) as writable DLPack arrays"):
        fattn.attention(q.__dlpack__(), q, q)
    out = np.empty_like(q)
    fattn.attention(q.__dlpack__(), q.__dlpack__(), q.__dlpack__(), out=out)
    assert np.allclose(out, fattn.attention(q, q, q), atol=1e-6)
    cu = np.array([0, 8], np.int32)
    for call in (lambda: fattn.attention_varlen(q[0].transpose(1, 0, 2).copy().__dlpack__(), q[0], q[0], cu, cu),
                 lambda: fattn.attention_with_kvcache(q.__dlpack__(), q, q)):
        with pytest.raises(TypeError, match=r"q: expected an array with a shape .* got PyCapsule"):
            call()


def test_float64_that_requires_grad_is_named_by_its_dtype():
    """A float64 tensor that requires grad gets the dtype error (not torch's refusal to export a tensor that requires
    grad through DLPack)."""
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="q: dtype float64 is not supported"):
        fattn.attention(q, q, q)


def test_out_overlap_matches_numpy_for_slices_of_one_buffer():
    """For views of one layout (packed-buffer slices) the overlap test is exact: out is refused exactly when NumPy
    says it shares memory with k or v (or with q without being q), over random offsets into one buffer."""
    rng = np.random.default_rng(0)
    buf = np.zeros(1 * 9 * 5 * 2 * 16 + 200, np.float32)
    shape, strides = (1, 9, 2, 16), (9 * 5 * 2 * 16 * 4, 5 * 2 * 16 * 4, 16 * 4, 4)  # (B, S, H, D) in 5 slots

    def view(offset):
        return np.lib.stride_tricks.as_strided(buf[offset:], shape, strides)

    q, k, v = view(0), view(32), view(64)
    for offset in list(range(0, 200, 3)) + [96, 128, 0]:
        out = view(offset)
        shared = any(np.shares_memory(out, x) for x in (k, v)) or (np.shares_memory(out, q) and offset != 0)
        try:
            fattn.attention(q, k, v, layout="bshd", out=out)
            refused = False
        except ValueError as e:
            assert "out:" in str(e)
            refused = True
        assert refused == shared, (offset, shared)


def test_none_for_an_array_is_named_on_every_entry_point():
    """None where an array is required is a TypeError naming it (each of these crashed the interpreter)."""
    from fattn import _C

    q = t(1, 2, 4, 8)
    o, lse = fattn.attention(q, q, q, return_lse=True)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    calls = [
        (lambda: fattn.attention_with_kvcache(q.transpose(1, 2), q.transpose(1, 2), None), "v_cache"),
        (lambda: fattn.attention_varlen(q[0].transpose(0, 1), q[0].transpose(0, 1), None, cu, cu), "v"),
        (lambda: fattn.attention_backward(o, q, q, q, None, lse), "out"),
        (lambda: _C.forward(q, q, q, None, None), "out"),
        (lambda: _C.check_forward(q, None, q, o, None), "k"),
        (lambda: _C.sinks(o, lse, None), "sinks"),
    ]
    for call, name in calls:
        with pytest.raises(TypeError, match=f"^{name}: expected an array, got None"):
            call()


def test_integers_past_c_longs_and_bad_streams_are_named():
    from fattn import _C

    q = t(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: \d+ is out of range"):
        _C.forward(q[0], q[0], q[0], torch.empty_like(q[0]), None, cu_seqlens_q=cu, cu_seqlens_k=cu,
                   max_seqlen_q=2 ** 70, max_seqlen_k=4)
    with pytest.raises(TypeError, match=r"^stream: expected a CUDA stream handle \(an int\) or None, got 'x'"):
        _C.forward(q, q, q, torch.empty_like(q), None, stream="x")
    with pytest.raises(ValueError, match=r"^backward_workspace_bytes: .* more than 2\^63 bytes"):
        _C.backward_workspace_bytes(2 ** 40, 2 ** 40, 2 ** 40, 256)
    assert _C.backward_workspace_bytes(1, 2, 64, 64) > 0


def test_sinks_pass_refuses_a_read_only_or_shared_lse():
    """_C.sinks rewrites out and lse in place: a read-only lse is refused as a read-only out is (it was rewritten),
    and an lse sharing memory with out too; nothing is written."""
    np = pytest.importorskip("numpy")
    from fattn import _C

    q = np.random.default_rng(0).standard_normal((1, 2, 4, 8)).astype(np.float32)
    o, lse = fattn.attention(q, q, q, return_lse=True)
    before = lse.copy()
    lse.setflags(write=False)
    with pytest.raises(ValueError, match=r"^lse: the array is read-only"):
        _C.sinks(o, lse, np.zeros(2, np.float32))
    assert np.array_equal(lse, before)
    buf = np.zeros(64 + 8, np.float32)
    with pytest.raises(ValueError, match=r"^lse: shares memory with out"):
        _C.sinks(buf[:64].reshape(1, 2, 4, 8), buf[56:64].reshape(1, 2, 4), np.zeros(2, np.float32))


def test_sinks_and_slopes_sharing_memory_with_what_a_call_writes_are_refused():
    """The kernels read sinks and ALiBi slopes while they write out, lse and the gradients: arrays sharing memory
    with those were accepted and gave wrong results (out off by 0.6)."""
    np = pytest.importorskip("numpy")
    q = np.random.default_rng(1).standard_normal((1, 2, 4, 8)).astype(np.float32)
    lse = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match=r"^sinks: shares memory with lse, which the call writes"):
        fattn.attention(q, q, q, lse=lse, sinks=lse[0, 0, :2])
    out = np.zeros_like(q)
    with pytest.raises(ValueError, match=r"^alibi_slopes: shares memory with out, which the call writes"):
        fattn.attention(q, q, q, out=out, alibi_slopes=out[0, 0, 0, :2])
    o, lse = fattn.attention(q, q, q, return_lse=True, sinks=np.zeros(2, np.float32))
    dq = np.zeros_like(q)
    with pytest.raises(ValueError, match=r"^sinks: shares memory with dq, which the call writes"):
        fattn.attention_backward(np.ones_like(o), q, q, q, o, lse, dq=dq, sinks=dq[0, 0, 0, :2])
