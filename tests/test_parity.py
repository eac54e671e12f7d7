"""Parity: every variant against torch SDPA (float64 reference, accuracy gate in conftest.check_close).

Run with `pytest -k parity`.  Each failure message names the exact pytest id that reproduces it (fixed seeds
derived from the test id)."""
import math

import pytest

from conftest import DTYPES, attention, check_close, randn, require, targets, targets_with_dtypes, torch, variant_dtypes

import fattn

SEQ_PAIRS = [(1, 1), (2, 3), (17, 17), (113, 113), (1025, 1025), (1, 257), (17, 113), (113, 17), (97, 239),
             (239, 97), (127, 1023), (257, 4224)]
CAUSAL = [False, "top_left", "bottom_right"]


def run(device, variant, q, k, v, **kw):
    return attention(q, k, v, variant=variant, **kw)


@pytest.mark.parametrize("device,variant,dtype", targets_with_dtypes(list(DTYPES)))
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "tl", "br"])
@pytest.mark.parametrize("sq,sk", SEQ_PAIRS, ids=[f"{a}x{b}" for a, b in SEQ_PAIRS])
def test_parity_seqlens(device, variant, dtype, causal, sq, sk, seed, request):
    require(device)
    dt = DTYPES[dtype]
    b, h, d = 1, 2, 64
    q = randn((b, h, sq, d), dt, device, seed)
    k = randn((b, h, sk, d), dt, device, seed + 1)
    v = randn((b, h, sk, d), dt, device, seed + 2)
    o, lse = run(device, variant, q, k, v, causal=causal, return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device == q.device
    check_close(o, q, k, v, causal, None, lse=lse, request=request)


HEAD_DIMS = list(range(8, 257, 8))


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_parity_head_dims(device, variant, d, seed, request):
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q = randn((1, 2, 33, d), dt, device, seed)
    k = randn((1, 2, 47, d), dt, device, seed + 1)
    v = randn((1, 2, 47, d), dt, device, seed + 2)
    o, lse = run(device, variant, q, k, v, causal="bottom_right", return_lse=True)
    check_close(o, q, k, v, "bottom_right", None, lse=lse, request=request)


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("h,hk", [(6, 1), (6, 2), (6, 3), (8, 8)])
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "tl", "br"])
def test_parity_gqa(device, variant, h, hk, causal, seed, request):
    require(device)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    q = randn((2, h, 65, 128), dt, device, seed)
    k = randn((2, hk, 130, 128), dt, device, seed + 1)
    v = randn((2, hk, 130, 128), dt, device, seed + 2)
    o, lse = run(device, variant, q, k, v, causal=causal, return_lse=True)
    check_close(o, q, k, v, causal, None, lse=lse, request=request)


def layouts(device, dt, seed):
    """(name, q, k, v, layout, bhsd views of q/k/v) for the strided cases of TESTING.md item 7."""
    b, h, sq, sk, d = 2, 4, 77, 91, 64
    out = []
    q = randn((b, sq, h, d), dt, device, seed)
    k = randn((b, sk, h, d), dt, device, seed + 1)
    v = randn((b, sk, h, d), dt, device, seed + 2)
    out.append(("bshd", q, k, v, "bshd", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    out.append(("bhsd-view-of-bshd", q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "bhsd",
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    qkv = randn((b, sq, 3, h, d), dt, device, seed + 3)  # packed qkv, Sq == Sk
    qp, kp, vp = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out.append(("packed-qkv", qp, kp, vp, "bshd", qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2)))
    wide = randn((b, h, sk, d + 32), dt, device, seed + 4)  # padded rows: last dim is a slice
    kw = wide[..., :d]
    qw = randn((b, h, sq, d + 16), dt, device, seed + 5)[..., 8:8 + d]
    out.append(("padded-rows", qw, kw, kw, "bhsd", qw, kw, kw))
    k1 = randn((b, 1, sk, d), dt, device, seed + 6)
    ke = k1.expand(b, h, sk, d)  # stride 0 over heads
    qc = randn((b, h, sq, d), dt, device, seed + 7)
    out.append(("expanded-kv", qc, ke, ke, "bhsd", qc, ke, ke))
    return out


@pytest.mark.parametrize("device,variant,dtype", targets_with_dtypes(["fp16", "fp32"]))
@pytest.mark.parametrize("causal", CAUSAL, ids=["full", "tl", "br"])
def test_parity_strided(device, variant, dtype, causal, seed, request):
    """Strided inputs: correct, and bit-identical to the same values made contiguous."""
    require(device)
    dt = DTYPES[dtype]
    for name, q, k, v, layout, qv, kv, vv in layouts(device, dt, seed):
        o = run(device, variant, q, k, v, causal=causal, layout=layout)
        ob = o.transpose(1, 2) if layout == "bshd" else o
        check_close(ob, qv, kv, vv, causal, None, request=request)
        oc = run(device, variant, qv.contiguous(), kv.contiguous(), vv.contiguous(), causal=causal)
        assert torch.equal(ob, oc), f"{name}: strided result differs from contiguous. pytest '{request.node.nodeid}'"


@pytest.mark.parametrize("device,variant", targets())
def test_parity_fully_masked_rows(device, variant, seed):
    """bottom-right with Sq > Sk: the first Sq - Sk rows see nothing -> exactly 0 and LSE -inf; Sk = 0 likewise."""
    require(device)
    q = randn((1, 2, 40, 64), torch.float16, device, seed)
    k = randn((1, 2, 25, 64), torch.float16, device, seed + 1)
    o, lse = run(device, variant, q, k, k, causal="bottom_right", return_lse=True)
    assert torch.equal(o[:, :, :15], torch.zeros_like(o[:, :, :15]))
    assert torch.isneginf(lse[:, :, :15]).all() and torch.isfinite(lse[:, :, 15:]).all()
    check_close(o, q, k, k, "bottom_right", None, lse=lse)
    empty = k[:, :, :0]
    o, lse = run(device, variant, q, empty, empty, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("shape", [(0, 2, 5, 64), (1, 2, 0, 64)], ids=["b0", "sq0"])
def test_parity_empty(device, variant, shape):
    require(device)
    q = torch.randn(shape, device=device, dtype=torch.float16)
    k = torch.randn((shape[0], 2, 7, 64), device=device, dtype=torch.float16)
    o, lse = run(device, variant, q, k, k, return_lse=True)
    assert o.shape == q.shape and lse.shape == shape[:3]


@pytest.mark.parametrize("device,variant", targets())
def test_parity_nan_poison(device, variant, seed, request):
    """NaN just past the sequence ends and in unused columns must not leak in; every output element is written."""
    require(device)
    dt = torch.float16
    b, h, sq, sk, d = 2, 3, 50, 70, 40
    def poisoned(s, seed_):
        buf = torch.full((b, h, s + 9, d + 8), float("nan"), dtype=dt, device=device)
        buf[:, :, :s, :d] = randn((b, h, s, d), dt, device, seed_)
        return buf[:, :, :s, :d]
    q, k, v = poisoned(sq, seed), poisoned(sk, seed + 1), poisoned(sk, seed + 2)
    out = torch.full((b, h, sq, d), float("nan"), dtype=dt, device=device)
    for causal in CAUSAL:
        o = run(device, variant, q, k, v, causal=causal, out=out)
        assert o is out
        check_close(o, q, k, v, causal, None, request=request)


@pytest.mark.parametrize("device,variant", targets())
def test_parity_magnitudes_and_nan_rows(device, variant, seed):
    require(device)
    q = randn((1, 2, 33, 64), torch.float16, device, seed, scale=5.0)
    k = randn((1, 2, 45, 64), torch.float16, device, seed + 1, scale=5.0)
    v = randn((1, 2, 45, 64), torch.float16, device, seed + 2, scale=5.0)
    o = run(device, variant, q, k, v)
    assert torch.isfinite(o).all()
    check_close(o, q, k, v, False, None)
    qb = randn((1, 2, 17, 64), torch.bfloat16, device, seed + 3, scale=1e5)
    assert torch.isfinite(run(device, variant, qb, qb, qb)).all()
    qn = q.clone()
    qn[0, 1, 7, 3] = float("nan")
    o2 = run(device, variant, qn, k, v)
    assert torch.isnan(o2[0, 1, 7]).all()
    keep = torch.ones(o.shape[:3], dtype=torch.bool, device=o.device)
    keep[0, 1, 7] = False
    assert torch.equal(o2[keep], o[keep]), "a NaN in one query row changed other rows"


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("scale", [0.05, -0.3, 1.0])
def test_parity_scale(device, variant, scale, seed, request):
    require(device)
    dt = torch.float32 if "fp32" in variant_dtypes(variant) else torch.float16
    q = randn((1, 2, 31, 64), dt, device, seed)
    k = randn((1, 2, 29, 64), dt, device, seed + 1)
    o, lse = run(device, variant, q, k, k, scale=scale, causal=True, return_lse=True)
    check_close(o, q, k, k, True, scale, lse=lse, request=request)


@pytest.mark.parametrize("device,variant", targets())
def test_parity_repeatable(device, variant, seed):
    require(device)
    q = randn((2, 4, 300, 64), torch.float16, device, seed)
    k = randn((2, 4, 333, 64), torch.float16, device, seed + 1)
    first = run(device, variant, q, k, k, causal=True)
    for _ in range(100 if device == "cuda" else 20):
        assert torch.equal(run(device, variant, q, k, k, causal=True), first)
