"""Bad input gets a typed error naming the argument (TESTING.md item 18)."""
import numpy as np
import pytest

from conftest import HAS_CUDA, torch

import fattn


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


CASES = [
    ("int dtype", lambda: (t(1, 2, 4, 8).int(), t(1, 2, 4, 8), t(1, 2, 4, 8)), {}, TypeError, r"q: dtype"),
    ("float64", lambda: (t(1, 2, 4, 8).double(),) * 3, {}, TypeError, r"q: dtype"),
    ("mixed dtypes", lambda: (t(1, 2, 4, 8), t(1, 2, 4, 8).half(), t(1, 2, 4, 8)), {}, TypeError, r"k: dtype differs"),
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


def test_requires_grad_is_refused():
    q = t(1, 2, 4, 8).requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward"):
        fattn.attention(q, q, q)
    with torch.no_grad():
        fattn.attention(q, q, q)


def test_variants_and_cuda_queries():
    assert fattn.variants("cpu") == ["cpu"]
    assert fattn.describe_variants("cpu")[0][0] == "cpu"
    with pytest.raises(ValueError, match="device:"):
        fattn.variants("tpu")
    if not HAS_CUDA:
        assert fattn.cuda_available() is False
        with pytest.raises(RuntimeError, match="fattn"):
            fattn.variants("cuda")


def test_numpy_mixed_dtypes_message():
    a = np.zeros((1, 1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="v: dtype differs"):
        fattn.attention(a, a, a.astype(np.float16))
