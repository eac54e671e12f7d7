"""DLPack intake (TESTING.md item 8): producers, capsules, byte_offset, NULL strides, zero-size tensors, bad
devices / dtypes / lanes, ownership (the producer's deleter runs exactly once)."""
import numpy as np
import pytest

from conftest import check_close, torch
from dlpack_capsule import Capsule, f32

import fattn


def test_numpy_in_numpy_out():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 17, 64)).astype(np.float16)
    o, lse = fattn.attention(q, q, q, return_lse=True)
    assert type(o) is np.ndarray and o.dtype == np.float16 and lse.dtype == np.float32 and lse.shape == (1, 2, 17)
    t = torch.from_numpy(q)
    check_close(torch.from_numpy(o), t, t, t, False, None, lse=torch.from_numpy(lse))


def test_torch_cpu_and_capsule_inputs():
    q = torch.randn(2, 3, 19, 32)
    expect = fattn.attention(q, q, q)
    caps = [torch.utils.dlpack.to_dlpack(q) for _ in range(3)]
    out = torch.empty_like(q)
    fattn.attention(*caps, out=out)
    assert torch.equal(out, expect)


def test_capsule_byte_offset_and_null_strides():
    shape = (1, 2, 9, 16)
    n = int(np.prod(shape))
    base = f32(n + 8)
    ref_np = base[8:].reshape(shape)
    before = Capsule.deleted
    q = Capsule(base, shape, byte_offset=32).capsule                      # NULL strides, offset 8 floats
    k = Capsule(base, shape, byte_offset=32, versioned=False).capsule     # legacy capsule
    v = Capsule(base, shape, byte_offset=32, strides=(288, 144, 16, 1)).capsule
    out = np.empty(shape, np.float32)
    fattn.attention(q, k, v, out=out)
    t = torch.from_numpy(ref_np)
    check_close(torch.from_numpy(out), t, t, t, False, None)
    assert Capsule.deleted - before == 3, "each consumed capsule's deleter must run exactly once"


def test_consumed_capsule_is_rejected():
    shape = (1, 1, 4, 8)
    c = Capsule(f32(32), shape).capsule
    other = np.zeros(shape, np.float32)
    fattn.attention(c, other, other, out=np.empty(shape, np.float32))
    with pytest.raises(TypeError, match="q: not a DLPack capsule"):
        fattn.attention(c, other, other, out=np.empty(shape, np.float32))


def test_zero_size_capsule():
    c = Capsule(f32(1), (1, 2, 0, 8)).capsule
    k = np.zeros((1, 2, 3, 8), np.float32)
    out = np.empty((1, 2, 0, 8), np.float32)
    fattn.attention(c, k, k, out=out)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(lanes=2), TypeError, "q: dtype float32x2 is not supported"),
    (dict(code=0, bits=32), TypeError, "q: dtype int32 is not supported"),
    (dict(code=5, bits=64), TypeError, "q: dtype complex64 is not supported"),
    (dict(device=(4, 0)), ValueError, "q: arrays on device type 4"),
    (dict(major=2), TypeError, "q: DLPack version 2"),
])
def test_bad_capsules(kw, exc, match):
    shape = (1, 1, 4, 8)
    c = Capsule(f32(64), shape, **kw).capsule
    k = np.zeros(shape, np.float32)
    with pytest.raises(exc, match=match):
        fattn.attention(c, k, k, out=np.empty(shape, np.float32))


def test_readonly_out_rejected():
    q = np.zeros((1, 1, 4, 8), np.float32)
    out = np.empty_like(q)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: the array is read-only"):
        fattn.attention(q, q, q, out=out)


def test_misaligned_pointer_rejected():
    base = np.zeros(1 + 32, np.float16)
    shape = (1, 1, 4, 8)
    c = Capsule(base, shape, byte_offset=1, code=2, bits=16).capsule
    k = np.zeros(shape, np.float16)
    with pytest.raises(ValueError, match="q: data pointer is not aligned"):
        fattn.attention(c, k, k, out=np.empty(shape, np.float16))


def test_torch_index_arrays_skip_dlpack(monkeypatch):
    """torch tensors of the dtypes the lean path describes -- int32 index arrays, float32 alibi_slopes and sinks among
    them -- are read without torch's __dlpack__ (Python code that, given a stream, also looks up torch's streams);
    other dtypes still go through DLPack, so their own checks name the dtype; results match the NumPy path."""
    from conftest import packed
    calls = []
    real = torch.Tensor.__dlpack__

    def counted(self, *a, **kw):
        calls.append(self.dtype)
        return real(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "__dlpack__", counted)
    q, k, v, cq, ck = packed([3, 9, 1], [5, 9, 4], 4, 2, 32, torch.float32, "cpu", 0)
    slopes, sinks = torch.rand(4), torch.randn(4)
    got = fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=9, max_seqlen_k=9, alibi_slopes=slopes, sinks=sinks)
    kc = torch.randn(4, 16, 2, 32)
    table, used = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), torch.tensor([17, 3], dtype=torch.int32)
    fattn.attention_with_kvcache(torch.randn(2, 1, 4, 32), kc, kc, cache_seqlens=used, block_table=table)
    assert calls == []
    want = fattn.attention_varlen(*(x.numpy() for x in (q, k, v, cq, ck)), max_seqlen_q=9, max_seqlen_k=9,
                                  alibi_slopes=slopes.numpy(), sinks=sinks.numpy())
    assert np.array_equal(got.numpy(), want)
    with pytest.raises(TypeError, match="cu_seqlens_q: .*int64"):
        fattn.attention_varlen(q, k, v, cq.long(), ck, max_seqlen_q=9, max_seqlen_k=9)
    assert calls == [torch.int64]
    # meta tensors (data_ptr() 0) are refused, not read, nor taken for "not given"
    meta = dict(cu_seqlens_q=cq.to("meta"), alibi_slopes=slopes.to("meta"), sinks=sinks.to("meta"))
    for name, x in meta.items():
        kw = dict(cu_seqlens_q=cq, alibi_slopes=None, sinks=None, max_seqlen_q=9, max_seqlen_k=9)
        kw[name] = x
        with pytest.raises(ValueError, match=f"{name}: the array has no data"):
            fattn.attention_varlen(q, k, v, cu_seqlens_k=ck, **kw)
    with pytest.raises(ValueError, match="cu_seqlens_q: the array has no data"):
        fattn.attention_varlen(q, k, v, cq.to("meta"), ck)  # max_seqlen read from the arrays
