"""Gradients (../shared/TESTING.md 21-25): fattn's backward on every target against the float64 reference, by the
accuracy rule at 3x (fattn.testing.accuracy.check_gradients), through fattn.attention_backward.  (The backward's
arguments, GPU dispatch and streams: test_grad_api.py; torch autograd through the registered op: test_autograd.py; v3's
own rows, dQ out, zero-ahead and deterministic orders: test_grad_v3.py.)
`pytest -k grad`."""
import math

import pytest

from conftest import DTYPES, randn, repro, require, torch

import fattn
from fattn import _C
from fattn._api import CAUSAL
from fattn.testing import accuracy, reference

DET = "-det"


def bwd_targets():
    """(device, variant): the CPU backend, and each GPU backward (named by a forward variant it differentiates),
    v2's and v3's also in deterministic mode.  v3's (Hopper only) takes dense calls with head dims to 256 (above 128
    its own kernel, v3_bwd_wide.cu) and falls back to v2's for the rest, so its cases check both the Hopper kernels and
    the fallback."""
    out = [pytest.param("cpu", "cpu", id="cpu")]
    for name in ("v1", "v2", "v2" + DET, "v3", "v3" + DET):
        out.append(pytest.param("cuda", name, id=f"cuda-{name}", marks=pytest.mark.gpu))
    return out


def bwd_dtypes(variant):
    return ["fp32", "fp16", "bf16"] if variant in ("cpu", "v1") else ["fp16", "bf16"]


def targets_with(dtypes):
    out = []
    for t in bwd_targets():
        device, variant = t.values
        out += [pytest.param(device, variant, dt, id=f"{t.id}-{dt}", marks=t.marks) for dt in dtypes
                if dt in bwd_dtypes(variant)]
    return out


def require_variant(device, variant):
    require(device)
    if device == "cuda" and variant.split("-")[0] not in fattn.variants("cuda"):
        pytest.skip(f"{variant} does not run on this GPU")


def grads(q, k, v, dout, variant, causal=False, scale=None, window=None, layout="bhsd", **kw):
    """(out, lse, (dq, dk, dv)) from fattn's forward and backward (variant "<v>-det": deterministic)."""
    base = variant.split("-")[0]
    det = variant.endswith(DET)
    fwd = None if scale == 0 else base  # the v2 forward does not take scale 0 (the default runs v1 then)
    with torch.no_grad():
        if window is None:
            out, lse = fattn.attention(q, k, v, causal=causal, scale=scale, layout=layout, variant=fwd,
                                       return_lse=True)
            return out, lse, fattn.attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                      layout=layout, variant=base, deterministic=det, **kw)
        out, lse = torch.empty_like(q), torch.empty(lse_shape(q, layout), device=q.device)
        stream = torch.cuda.current_stream().cuda_stream if q.is_cuda else None
        lay = fattn._api.LAYOUT[layout]
        _C.forward(q, k, v, out, lse, causal=CAUSAL[causal], scale=scale, layout=lay, window=window, variant=base,
                   stream=stream)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _C.backward(dout, q, k, v, out, lse, dq, dk, dv, causal=CAUSAL[causal], scale=scale, layout=lay,
                    window=window, variant=base, stream=stream, deterministic=det)
        return out, lse, (dq, dk, dv)


def lse_shape(q, layout):
    return (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])


def inputs(b, h, hk, sq, sk, d, dt, device, seed, mag=1.0):
    q = randn((b, h, sq, d), dt, device, seed, mag)
    k = randn((b, hk, sk, d), dt, device, seed + 1, mag)
    v = randn((b, hk, sk, d), dt, device, seed + 2)
    dout = randn((b, h, sq, d), dt, device, seed + 3)
    return q, k, v, dout


def check(g, q, k, v, dout, causal=False, scale=None, window=None, request=None):
    why, stats = accuracy.check_gradients(g, q, k, v, dout, causal, scale, window)
    assert why is None, f"{why} (err, err_lowp per dq, dk, dv: {stats}). {repro(request)}"


SEQ_PAIRS = [(1, 1), (2, 3), (17, 17), (113, 113), (1025, 1025), (1, 257), (17, 113), (113, 17), (97, 239),
             (239, 97), (127, 1023)]
CAUSALS = [False, "top_left", "bottom_right"]


@pytest.mark.parametrize("device,variant,dtype", targets_with(list(DTYPES)))
@pytest.mark.parametrize("causal", CAUSALS, ids=["full", "tl", "br"])
@pytest.mark.parametrize("sq,sk", SEQ_PAIRS, ids=[f"{a}x{b}" for a, b in SEQ_PAIRS])
def test_grad_seqlens(device, variant, dtype, causal, sq, sk, seed, request):
    require_variant(device, variant)
    q, k, v, dout = inputs(1, 2, 2, sq, sk, 64, DTYPES[dtype], device, seed)
    out, lse, g = grads(q, k, v, dout, variant, causal)
    check(g, q, k, v, dout, causal, request=request)


HEAD_DIMS = list(range(8, 257, 8))


@pytest.mark.parametrize("device,variant", bwd_targets())
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_grad_head_dims(device, variant, d, seed, request):
    require_variant(device, variant)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, dout = inputs(1, 2, 2, 33, 47, d, dt, device, seed)
    _, _, g = grads(q, k, v, dout, variant, "bottom_right")
    check(g, q, k, v, dout, "bottom_right", request=request)


def gpu_tensor_core_targets():
    """v2's and v3's backward (and their deterministic modes): the kernels with a head-dim bucket of their own."""
    return [t for t in bwd_targets() if t.values[1].split("-")[0] in ("v2", "v3")]


WIDE_WINDOWS = [(16, -1), (-1, 8), (70, 3)]
WIDE_PAIRS = [(1, 1), (17, 17), (113, 113), (1025, 1025), (17, 113), (113, 17), (127, 1023), (300, 64), (1100, 600)]


@pytest.mark.parametrize("device,variant", gpu_tensor_core_targets())
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", CAUSALS, ids=["full", "tl", "br"])
@pytest.mark.parametrize("sq,sk", WIDE_PAIRS, ids=[f"{a}x{b}" for a, b in WIDE_PAIRS])
def test_grad_wide_head_dim(device, variant, dtype, causal, sq, sk, seed, request):
    """Head dim 256 (v3: the wide kernel, whose consumers split the head dim and add dQ from registers) at odd
    lengths, Sq != Sk, every causal alignment, GQA 2:1."""
    require_variant(device, variant)
    q, k, v, dout = inputs(2, 4, 2, sq, sk, 256, DTYPES[dtype], device, seed)
    _, _, g = grads(q, k, v, dout, variant, causal)
    check(g, q, k, v, dout, causal, request=request)


@pytest.mark.parametrize("device,variant", gpu_tensor_core_targets())
@pytest.mark.parametrize("window", WIDE_WINDOWS, ids=[f"w{a}_{b}" for a, b in WIDE_WINDOWS])
@pytest.mark.parametrize("d", [136, 200, 256])
def test_grad_wide_head_dim_windows(device, variant, window, d, seed, request):
    """Windows at head dims past 128 (columns past d zero-filled by TMA, never stored), 8 query heads per kv head."""
    require_variant(device, variant)
    q, k, v, dout = inputs(1, 8, 1, 150, 190, d, torch.float16, device, seed)
    _, _, g = grads(q, k, v, dout, variant, "bottom_right", window=window)
    check(g, q, k, v, dout, "bottom_right", window=window, request=request)


# kernels/sm90/v3_bwd_configs.h's rows in order: the narrow ones (D=64, D=128 at Br = 64), the wide one (D=256), the
# plain one (D=128 at Br = 80)


@pytest.mark.parametrize("device,variant", bwd_targets())
@pytest.mark.parametrize("ratio", range(1, 9))
@pytest.mark.parametrize("causal", CAUSALS, ids=["full", "tl", "br"])
def test_grad_gqa(device, variant, ratio, causal, seed, request):
    """dK, dV of a kv head are the sums over its group's query heads (ratios 1..8, kv heads 1 and 2)."""
    require_variant(device, variant)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    hk = 1 if ratio % 2 else 2
    q, k, v, dout = inputs(2, hk * ratio, hk, 65, 130, 128, dt, device, seed)
    _, _, g = grads(q, k, v, dout, variant, causal)
    check(g, q, k, v, dout, causal, request=request)


WINDOWS = [(16, -1), (-1, 8), (7, 3), (0, 0), (5000, 5000)]


@pytest.mark.parametrize("device,variant", bwd_targets())
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{a}_{b}" for a, b in WINDOWS])
@pytest.mark.parametrize("causal", CAUSALS, ids=["full", "tl", "br"])
@pytest.mark.parametrize("sq,sk", [(113, 257), (257, 113)], ids=["113x257", "257x113"])
def test_grad_windows(device, variant, window, causal, sq, sk, seed, request):
    require_variant(device, variant)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, dout = inputs(1, 4, 2, sq, sk, 64, dt, device, seed)
    _, _, g = grads(q, k, v, dout, variant, causal, window=window)
    check(g, q, k, v, dout, causal, window=window, request=request)


@pytest.mark.parametrize("device,variant", bwd_targets())
def test_grad_fully_masked_rows_are_zero(device, variant, seed):
    """bottom-right with Sq > Sk: the first Sq - Sk rows see no key; their dq is exactly 0 and nothing is NaN."""
    require_variant(device, variant)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, dout = inputs(1, 2, 1, 80, 30, 64, dt, device, seed)
    _, lse, (dq, dk, dv) = grads(q, k, v, dout, variant, "bottom_right")
    assert torch.isinf(lse[:, :, :50]).all()
    assert (dq[:, :, :50] == 0).all()
    for g in (dq, dk, dv):
        assert not torch.isnan(g).any()
    check((dq, dk, dv), q, k, v, dout, "bottom_right")


@pytest.mark.parametrize("device,variant", bwd_targets())
@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])
def test_grad_custom_scales(device, variant, scale, seed, request):
    require_variant(device, variant)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, dout = inputs(1, 2, 2, 70, 90, 64, dt, device, seed)
    _, _, g = grads(q, k, v, dout, variant, "top_left", scale=scale)
    check(g, q, k, v, dout, "top_left", scale=scale, request=request)


@pytest.mark.parametrize("device,variant", bwd_targets())
@pytest.mark.parametrize("d", [64, 256])
def test_grad_bshd_strided_inputs_and_strided_grads(device, variant, d, seed, request):
    """q, k, v as BSHD views of a packed QKV buffer; dq, dk, dv written into strided views of NaN-filled buffers
    with canaries around them: every element of the views is written, nothing else."""
    require_variant(device, variant)
    dt = torch.float32 if device == "cpu" else torch.float16
    b, s, h = 2, 97, 4
    qkv = randn((b, s, 3, h, d), dt, device, seed)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, S, H, D), strided
    dout = randn((b, s, h, d), dt, device, seed + 3)
    base = variant.split("-")[0]
    with torch.no_grad():
        out, lse = fattn.attention(q, k, v, causal=True, layout="bshd", variant=base, return_lse=True)
        bufs = [torch.full((b, s, h + 2, d + 8), float("nan"), dtype=dt, device=device) for _ in range(3)]
        views = [x[:, :, 1:h + 1, 8:] for x in bufs]  # strided, 16-byte aligned rows
        got = fattn.attention_backward(dout, q, k, v, out, lse, causal=True, layout="bshd", variant=base,
                                       dq=views[0], dk=views[1], dv=views[2], deterministic=variant.endswith(DET))
    for g, view, buf in zip(got, views, bufs):
        assert g is view
        assert not torch.isnan(view).any()
        rest = buf.clone()
        rest[:, :, 1:h + 1, 8:] = 0
        assert torch.isnan(rest[:, :, 0]).all() and torch.isnan(rest[:, :, h + 1]).all()
        assert torch.isnan(rest[..., :8]).all()
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    check(tuple(t(x) for x in got), t(q), t(k), t(v), t(dout), True, request=request)


@pytest.mark.parametrize("device,variant", bwd_targets())
@pytest.mark.parametrize("d", [64, 128, 256])
def test_grad_is_bitwise_repeatable(device, variant, d, seed):
    """The CPU backend, v1 and the deterministic modes of v2 and v3: bitwise-equal gradients over 100 runs (GPU:
    with other streams busy at the same time).  v3's three head-dim buckets split dQ between its consumers
    differently (by rows, by columns, and at 256 added from registers)."""
    require_variant(device, variant)
    if variant in ("v2", "v3"):
        pytest.skip(f"{variant}'s default mode accumulates dQ with atomics (deterministic=True is the repeatable one)")
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, dout = inputs(2, 4, 2, 300, 300, d, dt, device, seed)
    first = grads(q, k, v, dout, variant, True)[2]
    side = [torch.cuda.Stream() for _ in range(2)] if device == "cuda" else []
    for i in range(100 if device == "cuda" else 20):
        for s in side:  # other work in flight on other streams
            with torch.cuda.stream(s):
                fattn.attention(q, k, v)
        again = grads(q, k, v, dout, variant, True)[2]
        for a, b_ in zip(first, again):
            assert torch.equal(a, b_), f"run {i} differs"


def test_reference_gradients_match_float64_autograd(seed):
    """The formula reference against torch autograd in float64 (explicit mask, GQA, a fully masked row)."""
    q, k, v, dout = inputs(1, 4, 2, 40, 30, 16, torch.float64, "cpu", seed)
    want = reference.gradients(q, k, v, dout, "bottom_right", 0.7, (5, -1))
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    mask = torch.from_numpy(reference.visible(40, 30, "bottom_right", (5, -1)))
    s = (qs @ ks.repeat_interleave(2, 1).transpose(-1, -2) * 0.7).masked_fill(~mask, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    (p @ vs.repeat_interleave(2, 1)).backward(dout)
    for a, b_ in zip(want, (qs.grad, ks.grad, vs.grad)):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-12)
