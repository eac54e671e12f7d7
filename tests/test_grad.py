"""Gradients (../shared/TESTING.md 21-25): fattn's backward on every target against the float64 reference, by the
accuracy rule at 3x (fattn.testing.accuracy.check_gradients), through fattn.attention_backward.  (The backward's
arguments, GPU dispatch and streams: test_grad_api.py; torch autograd through the registered op: test_autograd.py.)
`pytest -k grad`."""
import math

import pytest

from conftest import DTYPES, kernels_launched, randn, repro, require, torch

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
V3_BWD_BR80 = 3
BR80_SEQS = [(1, 1), (17, 17), (80, 80), (81, 300), (113, 17), (160, 1025), (1025, 1025), (239, 97)]


def v3_bwd_br80_grads(q, k, v, dout, out, lse, deterministic, causal=False):
    """(dq, dk, dv) from v3's backward forced to the Br = 80 row."""
    g = [torch.empty_like(x) for x in (q, k, v)]
    plan = _C._dev.backward(dout, q, k, v, out, lse, *g, causal=CAUSAL[causal],
                            stream=torch.cuda.current_stream().cuda_stream, variant="v3", config=V3_BWD_BR80,
                            deterministic=deterministic)
    assert (plan["variant"], plan["config"]) == ("v3", V3_BWD_BR80), plan
    return g


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", CAUSALS, ids=["full", "tl", "br"])
@pytest.mark.parametrize("sq,sk", BR80_SEQS, ids=[f"{a}x{b}" for a, b in BR80_SEQS])
def test_grad_v3_br80(dtype, causal, sq, sk, seed, request):
    """v3's backward at D=128 on the Br = 80 row (dQ^T = K^T dS^T, dS stored K-major by stmatrix .trans, dQ^T's own
    convert), forced: gradients against the reference at odd lengths (a last step of 1-79 rows, Sq != Sk), with and
    without a causal mask, with GQA (two query heads per kv head), at head dims 128 and 72 (the bucket's columns past
    d zero), in default and deterministic mode (bitwise repeatable).  The planner picks it where its steps pad Sq by
    at most 5% more rows than Br = 64's, in both modes (but calls of at most 8 key blocks, which take dQ out on
    Br = 64); a softcap keeps Br = 64 and refuses the Br = 80 row."""
    require_variant("cuda", "v3")
    stream = torch.cuda.current_stream().cuda_stream
    pads_little = -(-sq // 80) * 80 * 20 <= -(-sq // 64) * 64 * 21
    for d, h, hk in [(128, 4, 2), (72, 2, 2)]:
        q, k, v, dout = inputs(2, h, hk, sq, sk, d, DTYPES[dtype], "cuda", seed)
        out, lse = fattn.attention(q, k, v, causal=causal, return_lse=True)
        check(v3_bwd_br80_grads(q, k, v, dout, out, lse, False, causal), q, k, v, dout, causal, request=request)
        g_det = v3_bwd_br80_grads(q, k, v, dout, out, lse, True, causal)
        check(g_det, q, k, v, dout, causal, request=request)
        assert all(torch.equal(a, b) for a, b in zip(g_det, v3_bwd_br80_grads(q, k, v, dout, out, lse, True, causal)))
        e = [torch.empty_like(x) for x in (q, k, v)]
        plan = lambda **kw: _C._dev.plan_backward(dout, q, k, v, out, lse, *e, causal=CAUSAL[causal], stream=stream,
                                                  variant="v3", **kw)
        # at most 8 key blocks: dQ added straight into dQ, on Br = 64 (V3_BWD_DQ_OUT)
        dq_out = -(-sk // 128) <= 8
        for det in (False, True):
            assert (plan(deterministic=det)["config"] == V3_BWD_BR80) == (pads_little and not dq_out), (sq, det)
        assert plan(softcap=5.0)["config"] != V3_BWD_BR80
        with pytest.raises(ValueError, match="without a softcap"):
            plan(softcap=5.0, config=V3_BWD_BR80)
    q, k, v, dout = inputs(1, 2, 2, 512, 512, 128, DTYPES[dtype], "cuda", seed)  # 560 rows of steps against 512
    out, lse = fattn.attention(q, k, v, return_lse=True)
    e = [torch.empty_like(x) for x in (q, k, v)]
    assert _C._dev.plan_backward(dout, q, k, v, out, lse, *e, stream=stream, variant="v3")["config"] != V3_BWD_BR80


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 72, 128])
@pytest.mark.parametrize("causal", CAUSALS, ids=["full", "tl", "br"])
def test_grad_v3_dq_out(d, causal, seed, request):
    """At most 8 key blocks: v3's backward adds dQ, in its dtype, straight into dQ (no float32 accumulator, no convert
    kernel; v3_bwd_configs.h: V3_BWD_DQ_OUT) -- into a strided dQ whose padding columns must stay untouched, its rows
    past Sq and columns past d dropped, with GQA and Sq != Sk, fp16 and bf16; gradients against the reference, and
    in deterministic mode (its adds in turn) bitwise repeatable.  Nine key blocks keep the float32 sum and its
    convert."""
    require("cuda")
    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    stream = torch.cuda.current_stream().cuda_stream or 1
    for sq, sk, dt, det, direct in [(300, 1000, torch.float16, False, True), (77, 1024, torch.float16, False, True),
                                    (300, 1025, torch.float16, False, False), (300, 1000, torch.bfloat16, False, True),
                                    (300, 1000, torch.float16, True, True)]:
        q, k, v, dout = inputs(2, 4, 2, sq, sk, d, dt, "cuda", seed)
        out, lse = fattn.attention(q, k, v, causal=causal, return_lse=True)
        buf = torch.full((2, 4, sq, d + 8), float("nan"), dtype=dt, device="cuda")
        dq, dk, dv = buf[..., :d], torch.empty_like(k), torch.empty_like(v)
        names = kernels_launched(lambda: _C._dev.backward(dout, q, k, v, out, lse, dq, dk, dv, causal=CAUSAL[causal],
                                                       stream=stream, variant="v3", deterministic=det))
        converts = [n for n in names if "convert" in n]
        assert (not converts) == direct, (sq, sk, dt, det, names)
        assert torch.isnan(buf[..., d:]).all(), "a write past dQ's columns"
        check((dq, dk, dv), q, k, v, dout, causal, request=request)
        if det:
            g2 = [torch.empty_like(x) for x in (q, k, v)]
            _C._dev.backward(dout, q, k, v, out, lse, *g2, causal=CAUSAL[causal], stream=stream, variant="v3",
                             deterministic=True)
            assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), g2))


# (b, h, hk, sq, sk, d, causal): more key blocks (128 keys; 64 at D=256) than an H100 has SMs: 432, 192, 480, 240
MANY_BLOCKS = [(3, 48, 48, 300, 300, 64, False), (2, 64, 32, 257, 301, 128, "bottom_right"),
               (2, 40, 40, 560, 700, 104, "top_left"), (2, 48, 24, 200, 260, 256, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,hk,sq,sk,d,causal", MANY_BLOCKS,
                         ids=["x".join(map(str, c[:6])) + f"-{c[6]}" for c in MANY_BLOCKS])
def test_grad_v3_many_key_blocks(b, h, hk, sq, sk, d, causal, seed, request):
    """v3's backward with several dK/dV blocks per SM (GQA, Sq != Sk, both causal alignments, a head dim below its
    bucket's): against the reference in default and deterministic mode (bitwise repeatable).  Each shape has more
    (batch, kv head) groups than the zero-ahead's lead, so at D=128 and 256 in default mode the dK/dV kernel zeroes
    the later groups' dQ sums itself (kernels/sm90/v3_bwd_ring.cuh: v3b_zero); a workspace filled with NaN first shows
    every row they add into was zeroed, by bwd_prep or by the kernel."""
    require("cuda")
    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    q, k, v, dout = inputs(b, h, hk, sq, sk, d, torch.float16, "cuda", seed)
    out, lse = fattn.attention(q, k, v, causal=causal, return_lse=True)
    stream = torch.cuda.current_stream().cuda_stream
    for det in (False, True):
        g = [torch.empty_like(x) for x in (q, k, v)]
        plan = _C._dev.backward(dout, q, k, v, out, lse, *g, causal=CAUSAL[causal], stream=stream, variant="v3",
                                deterministic=det)
        assert plan["variant"] == "v3", plan
        check(g, q, k, v, dout, causal, request=request)
        if not det:
            ws = torch.full((_C.backward_workspace_bytes(b, h, sq, d) // 4,), float("nan"), device="cuda")
            g3 = [torch.empty_like(x) for x in (q, k, v)]
            _C._dev.backward(dout, q, k, v, out, lse, *g3, causal=CAUSAL[causal], stream=stream or 1,
                             variant="v3", workspace=ws)  # (DLPack's name for the default stream is 1)
            check(g3, q, k, v, dout, causal, request=request)
        if det:
            g2 = [torch.empty_like(x) for x in (q, k, v)]
            _C._dev.backward(dout, q, k, v, out, lse, *g2, causal=CAUSAL[causal], stream=stream, variant="v3",
                             deterministic=True)
            assert all(torch.equal(x, y) for x, y in zip(g, g2))


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


STAGGER_SHAPES = [(2, 4, 2, 1100, 1100), (1, 4, 2, 1500, 600), (1, 2, 1, 600, 1500), (3, 2, 2, 300, 300),
                  (1, 2, 1, 300, 1500), (1, 2, 1, 100, 9000), (1, 2, 1, 2100, 4500)]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b,h,hk,sq,sk", STAGGER_SHAPES, ids=["x".join(map(str, s)) for s in STAGGER_SHAPES])
def test_grad_deterministic_stagger(b, h, hk, sq, sk, d, seed, request):
    """v3's deterministic mode without a mask staggers its key blocks' walks by whole heads where a head's key
    blocks fit in half the GPU (v3_bwd_ring.cuh: v3b_stagger_turn; head dims 64 and 256; more key blocks than query
    blocks, so ties in a tile's order, at Sq < Sk), else at 256 in chunks of 32 key blocks (v3_bwd_wide.cu: v3w_turn;
    Sk = 4500 and 9000 have 71 and 141 key blocks of 64 there, more than half an H100's or H200's multiprocessors;
    with fewer query blocks than a chunk's key blocks, Sq = 100, not staggered), and not at 128 (nor at Sk = 9000 at
    64: 71 key blocks of 128); Sq != Sk both ways, GQA: the gradients by the 3x rule, and bitwise the same over 20
    runs."""
    require_variant("cuda", "v3")
    q, k, v, dout = inputs(b, h, hk, sq, sk, d, torch.float16, "cuda", seed)
    first = grads(q, k, v, dout, "v3" + DET)[2]
    check(first, q, k, v, dout, request=request)
    for i in range(20):
        again = grads(q, k, v, dout, "v3" + DET)[2]
        for name, a, b_ in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b_), f"run {i}: {name} differs"


DESC_CASES = [(1, 4, 2, 1100, 1100, "top_left", None), (1, 2, 1, 1500, 600, "bottom_right", None),
              (1, 2, 2, 600, 1500, "bottom_right", None), (2, 2, 1, 700, 700, "top_left", (300, 0)),
              (1, 2, 1, 900, 900, False, (200, 64))]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b,h,hk,sq,sk,causal,window", DESC_CASES,
                         ids=["x".join(map(str, c[:5])) + f"-{c[5]}-{c[6]}" for c in DESC_CASES])
def test_grad_deterministic_descending_order(b, h, hk, sq, sk, causal, window, d, seed, request):
    """v3's deterministic mode under a mask with a right edge (causal of both alignments, windows bounded on the
    right) adds to each dQ tile in descending key-block order, its grid placing key blocks last first
    (v3_bwd_ring.cuh: v3b_descends): several of the wide kernel's chunks of 8 key blocks, Sq != Sk both ways, GQA,
    every head-dim bucket: the gradients by the 3x rule, and bitwise the same over 20 runs."""
    require_variant("cuda", "v3")
    q, k, v, dout = inputs(b, h, hk, sq, sk, d, torch.float16, "cuda", seed)
    first = grads(q, k, v, dout, "v3" + DET, causal=causal, window=window)[2]
    check(first, q, k, v, dout, causal=causal, window=window, request=request)
    for i in range(20):
        again = grads(q, k, v, dout, "v3" + DET, causal=causal, window=window)[2]
        for name, a, b_ in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b_), f"run {i}: {name} differs"


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
