"""v3's (Hopper) backward beyond the shared gradient tests of test_grad.py: its Br = 80 row, dQ out, many key blocks
per SM with zero-ahead, and deterministic mode's stagger and descending order -- each against the float64 reference
by the accuracy rule at 3x.  `pytest -k grad_v3` (and `-k deterministic`)."""
import pytest

from conftest import DTYPES, kernels_launched, require, torch
from test_grad import CAUSALS, DET, check, grads, inputs, require_variant

import fattn
from fattn import _C
from fattn._api import CAUSAL

V3_BWD_BR80 = 3
BR80_SEQS = [(1, 1), (17, 17), (80, 80), (81, 300), (113, 17), (160, 1025), (1025, 1025), (239, 97)]


def dq_out_expected(sq, sk, causal, bc=128):
    """V3_BWD_DQ_OUT's rule (v3_bwd_configs.h) for a plain call on a config of whole 64-row steps and key blocks of
    bc (128; the wide kernel's, head dims above 128: 64): at most 16 key blocks, and on average at most 8.5 adds a
    64-row dQ tile (one for each key block some row of it sees)."""
    if -(-sk // bc) > 16:
        return False
    tiles, adds = -(-sq // 64), 0
    for t in range(tiles):
        last = min(64 * t + 63, sq - 1)  # a causal tile's last row sees the most keys
        hi = sk if not causal else max(0, min(sk, last + 1 + (sk - sq if causal == "bottom_right" else 0)))
        adds += -(-hi // bc)
    return 2 * adds <= 17 * tiles


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
    at most 5% more rows than Br = 64's, in both modes (but not for calls that take dQ out on Br = 64,
    dq_out_expected); a softcap keeps Br = 64 and refuses the Br = 80 row."""
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
        dq_out = dq_out_expected(sq, sk, causal)  # dQ added straight into dQ, on Br = 64
        for det in (False, True):
            assert (plan(deterministic=det)["config"] == V3_BWD_BR80) == (pads_little and not dq_out), (sq, det)
        assert plan(softcap=5.0)["config"] != V3_BWD_BR80
        with pytest.raises(ValueError, match="without a softcap"):
            plan(softcap=5.0, config=V3_BWD_BR80)
    q, k, v, dout = inputs(1, 2, 2, 512, 512, 128, DTYPES[dtype], "cuda", seed)  # 560 rows of steps against 512
    out, lse = fattn.attention(q, k, v, return_lse=True)
    e = [torch.empty_like(x) for x in (q, k, v)]
    assert _C._dev.plan_backward(dout, q, k, v, out, lse, *e, stream=stream, variant="v3")["config"] != V3_BWD_BR80


# dQ out's cases for key blocks of 128 (head dims to 128) and of 64 (above): (sq, sk, dtype, deterministic) -- few
# key blocks, GQA, Sq != Sk, both dtypes, deterministic mode; one key block past the limit without a mask; causal
# calls of up to 16 key blocks, one whose short query side sees nearly all of them, and 17 key blocks
DQ_OUT_CASES = {128: [(300, 1000, "fp16", False), (77, 1024, "fp16", False), (300, 1025, "fp16", False),
                      (300, 1000, "bf16", False), (300, 1000, "fp16", True), (1100, 1100, "fp16", False),
                      (1100, 1100, "fp16", True), (2000, 2000, "bf16", False), (300, 2000, "fp16", False),
                      (2100, 2100, "fp16", False)],
                64: [(300, 500, "fp16", False), (77, 512, "fp16", False), (300, 513, "fp16", False),
                     (300, 500, "bf16", False), (300, 500, "fp16", True), (550, 550, "fp16", False),
                     (550, 550, "fp16", True), (1000, 1000, "bf16", False), (150, 1000, "fp16", False),
                     (1100, 1100, "fp16", False)]}


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 72, 128, 200, 256])
@pytest.mark.parametrize("causal", CAUSALS, ids=["full", "tl", "br"])
def test_grad_v3_dq_out(d, causal, seed, request):
    """Calls of few key blocks (dq_out_expected: at most 8 without a mask, up to 16 under a causal one): v3's backward
    adds dQ, in its dtype, straight into dQ (no float32 accumulator, no convert kernel; v3_bwd_configs.h:
    V3_BWD_DQ_OUT; at head dims above 128 the wide kernel, by reds from registers) -- into a strided dQ whose padding
    columns must stay untouched, its rows past Sq and columns past d dropped, with GQA and Sq != Sk, fp16 and bf16;
    gradients against the reference, and in deterministic mode (its adds in turn) bitwise repeatable.  The other calls
    (9 key blocks without a mask; causal, 16 key blocks of which the short query side's tiles see nearly all; 17 key
    blocks) keep the float32 sum and its convert."""
    require("cuda")
    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    stream = torch.cuda.current_stream().cuda_stream or 1
    bc = 128 if d <= 128 else 64
    cases = DQ_OUT_CASES[bc]
    expected = {(sq, sk): dq_out_expected(sq, sk, causal, bc) for sq, sk, _, _ in cases}
    few, past, mid, whole, side, many = (cases[i][:2] for i in (0, 2, 5, 7, 8, 9))
    assert expected[few] and not expected[many], expected  # the rule's edges, as its comment has them
    if causal:
        assert expected[mid] and expected[whole], expected
        assert causal == "top_left" or not expected[side], expected
    else:
        assert not expected[past] and not expected[mid], expected
    for sq, sk, dt, det in cases:
        dt = DTYPES[dt]
        q, k, v, dout = inputs(2, 4, 2, sq, sk, d, dt, "cuda", seed)
        out, lse = fattn.attention(q, k, v, causal=causal, return_lse=True)
        buf = torch.full((2, 4, sq, d + 8), float("nan"), dtype=dt, device="cuda")
        dq, dk, dv = buf[..., :d], torch.empty_like(k), torch.empty_like(v)
        names = kernels_launched(lambda: _C._dev.backward(dout, q, k, v, out, lse, dq, dk, dv, causal=CAUSAL[causal],
                                                       stream=stream, variant="v3", deterministic=det))
        converts = [n for n in names if "convert" in n]
        assert (not converts) == expected[(sq, sk)], (sq, sk, dt, det, names)
        assert torch.isnan(buf[..., d:]).all(), "a write past dQ's columns"
        check((dq, dk, dv), q, k, v, dout, causal, request=request)
        if det:
            g2 = [torch.empty_like(x) for x in (q, k, v)]
            _C._dev.backward(dout, q, k, v, out, lse, *g2, causal=CAUSAL[causal], stream=stream, variant="v3",
                             deterministic=True)
            assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), g2))


def v3_call(b, h, hk, sq, sk, d, causal, seed):
    """A backward test's fp16 inputs on the GPU and their forward: (q, k, v, dout, out, lse); skips without v3."""
    require_variant("cuda", "v3")
    q, k, v, dout = inputs(b, h, hk, sq, sk, d, torch.float16, "cuda", seed)
    out, lse = fattn.attention(q, k, v, causal=causal, return_lse=True)
    return q, k, v, dout, out, lse


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
    q, k, v, dout, out, lse = v3_call(b, h, hk, sq, sk, d, causal, seed)
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


# (b, h, hk, sq, sk, d, causal): calls whose dQ goes through dq_accum and a convert pass -- D=64 (Br = 128), D=128 on
# Br = 80 and on Br = 64 (Sq = 64: 80-row steps would pad it), D=96 under a bottom-right mask, and D=256 / 200 (the
# wide kernel, whose convert runs behind it), GQA -- with more dK/dV blocks than an H100 has SMs (a last, partial
# wave) and more key blocks than dQ out takes
CONVERT_OVERLAP = [(2, 16, 16, 600, 2200, 64, False), (2, 8, 8, 2048, 2048, 128, False),
                   (4, 8, 4, 64, 2300, 128, False), (2, 8, 4, 700, 2300, 96, "bottom_right"),
                   (2, 8, 4, 600, 1100, 256, False), (2, 8, 4, 700, 1100, 200, "top_left")]


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,hk,sq,sk,d,causal", CONVERT_OVERLAP,
                         ids=["x".join(map(str, c[:6])) + f"-{c[6]}" for c in CONVERT_OVERLAP])
def test_grad_v3_convert_overlap(b, h, hk, sq, sk, d, causal, seed, request):
    """v3's backward with its convert pass launched as the dK/dV kernel's programmatic dependent, each convert block
    waiting for its group's count (kernels/sm90/v3_bwd_ring.cuh: v3b_done; default mode, head dims to 128): in each
    mode five calls back to back on one stream, each one's gradients copied by the stream's next operation before
    anything synchronises, every copy against the reference -- a convert block reading sums that had not all landed,
    or the copy running before the dK/dV kernel's stores, would show here; deterministic mode's copies (convert
    behind the dK/dV kernel) bitwise equal."""
    q, k, v, dout, out, lse = v3_call(b, h, hk, sq, sk, d, causal, seed)
    stream = torch.cuda.current_stream().cuda_stream
    e = [torch.empty_like(x) for x in (q, k, v)]
    plan = _C._dev.plan_backward(dout, q, k, v, out, lse, *e, causal=CAUSAL[causal], stream=stream, variant="v3")
    assert plan["variant"] == "v3" and plan["grid"][0] > 132, plan
    assert not dq_out_expected(sq, sk, causal, 128 if d <= 128 else 64), (sq, sk)
    for det in (False, True):
        copies = []
        for _ in range(5):
            g = [torch.full_like(x, float("nan")) for x in (q, k, v)]
            _C._dev.backward(dout, q, k, v, out, lse, *g, causal=CAUSAL[causal], stream=stream, variant="v3",
                             deterministic=det)
            copies.append([x.clone() for x in g])
        for g in copies:
            check(g, q, k, v, dout, causal, request=request)
        if det:
            assert all(torch.equal(a, b) for g in copies[1:] for a, b in zip(g, copies[0]))


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
