"""GPU behaviour beyond parity (TESTING.md items 16-18): the caller's stream, CUDA graphs, errors never left
pending, other DLPack producers on the GPU (CuPy, JAX).  Skipped without a GPU; run on the GPU machine."""
import pytest

from conftest import HAS_CUDA, check_close, dev_forward, gpu_variants, randn, stream_for, torch

import fattn
from fattn import _C

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")]
VARIANTS = gpu_variants() if HAS_CUDA else [row[0] for row in _C._dev.variant_table()]


def plan_of(q, k, v, causal=False, variant=None, out=None, **overrides):
    """The plan fattn would run for this call (fattn._C._dev.plan)."""
    out = torch.empty_like(q) if out is None else out
    return _C._dev.plan(q, k, v, out, causal=fattn._api.CAUSAL[causal], variant=variant, stream=stream_for(q),
                        **overrides)


@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_on_current_stream(variant):
    q = randn((2, 4, 257, 64), torch.float16, "cuda", 1)
    expect = fattn.attention(q, q, q, variant=variant)
    s = torch.cuda.Stream()
    out = torch.full_like(q, float("nan"))
    with torch.cuda.stream(s):
        torch.cuda._sleep(2_000_000)  # keep the side stream busy: a launch on another stream would race ahead
        fattn.attention(q, q, q, variant=variant, out=out)
        done = torch.cuda.Event()
        done.record(s)
    done.synchronize()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_graph_capture_and_replay(variant):
    q = randn((1, 8, 300, 128), torch.bfloat16, "cuda", 2)
    k = randn((1, 8, 333, 128), torch.bfloat16, "cuda", 3)
    out = torch.empty_like(q)
    # a captured call never splits the keys (it may hold no workspace): so neither may the one it is compared with
    expect, _, _ = dev_forward(q, k, k, causal="bottom_right", variant=variant, splits=1)
    check_close(expect, q, k, k, "bottom_right", None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (one-time attribute setup)
        fattn.attention(q, k, k, causal="bottom_right", variant=variant, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fattn.attention(q, k, k, causal="bottom_right", variant=variant, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


def test_errors_leave_no_cuda_error_pending():
    q = randn((1, 2, 16, 64), torch.float16, "cuda", 4)
    with pytest.raises(ValueError, match="variant: unknown GPU variant"):
        fattn.attention(q, q, q, variant="v99")
    with pytest.raises(ValueError, match="k: on cpu but q is on cuda:0"):
        fattn.attention(q, q.cpu(), q)
    with pytest.raises(ValueError, match="out: shape"):
        fattn.attention(q, q, q, out=torch.empty(1, 2, 15, 64, device="cuda", dtype=torch.float16))
    torch.cuda.synchronize()  # would raise if a CUDA error were pending
    check_close(fattn.attention(q, q, q), q, q, q, False, None)


def test_large_batch_heads_grid():
    """b * h >= 65536 (TESTING.md item 13): the grid is flattened with 64-bit indexing."""
    q = randn((1024, 64, 4, 64), torch.float16, "cuda", 5)
    for variant in VARIANTS:
        o = fattn.attention(q, q, q, variant=variant)
        check_close(o[-2:], q[-2:], q[-2:], q[-2:], False, None)


def test_variants_listed():
    names = fattn.variants("cuda")
    assert names[:2] == ["v0", "v1"]
    assert fattn.variants(torch.device("cuda:0")) == names
    if torch.cuda.get_device_capability() >= (8, 0):
        assert "v2" in names


@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() < (8, 0), reason="v2 needs sm_80")
def test_v2_refusals_and_fallback():
    """v2 takes fp16/bf16 with 16-byte aligned rows: forced, it refuses others clearly; by default fattn falls
    back to v1 for them and stays correct."""
    q32 = randn((1, 2, 40, 64), torch.float32, "cuda", 7)
    with pytest.raises(TypeError, match="variant: v2 does not support float32"):
        fattn.attention(q32, q32, q32, variant="v2")
    check_close(fattn.attention(q32, q32, q32), q32, q32, q32, False, None)
    buf = randn((1, 2, 40, 64 + 4), torch.float16, "cuda", 8)
    qm = buf[..., 4:]  # rows 8-byte aligned only, stride 68 elements
    with pytest.raises(ValueError, match="variant: .*v2 needs q, k, v 16-byte aligned"):
        fattn.attention(qm, qm, qm, variant="v2")
    check_close(fattn.attention(qm, qm, qm), qm, qm, qm, False, None)


def test_cupy_in_cupy_out():
    cp = pytest.importorskip("cupy")
    q = cp.random.standard_normal((1, 4, 65, 64), dtype=cp.float32).astype(cp.float16)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        o = fattn.attention(q, q, q, causal=True)
    s.synchronize()
    assert isinstance(o, cp.ndarray) and o.dtype == cp.float16
    t = torch.from_dlpack(q)
    check_close(torch.from_dlpack(o), t, t, t, True, None)


def test_jax_inputs_with_out():
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend here")
    import jax.numpy as jnp

    q = jax.device_put(jnp.asarray(torch.randn(1, 2, 33, 64).numpy(), dtype=jnp.float16), gpu)
    out = torch.empty((1, 2, 33, 64), dtype=torch.float16, device="cuda")
    fattn.attention(q, q, q, out=out)
    t = torch.from_dlpack(q)
    torch.cuda.synchronize()
    check_close(out, t, t, t, False, None)
    with pytest.raises(TypeError, match="JAX arrays are immutable"):
        fattn.attention(q, q, q)


V2 = pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() < (8, 0), reason="v2 needs sm_80")


@V2
@pytest.mark.parametrize("splits", [1, 2, 5, 16, 128])
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
def test_v2_split_counts(splits, causal):
    """Split-KV forced to each count (more splits than key blocks included) matches the reference; LSE too."""
    q = randn((2, 4, 3, 128), torch.float16, "cuda", 10)
    k = randn((2, 2, 1000, 128), torch.float16, "cuda", 11)
    v = randn((2, 2, 1000, 128), torch.float16, "cuda", 12)
    lse = torch.empty(2, 4, 3, device="cuda", dtype=torch.float32)
    o, lse, plan = dev_forward(q, k, v, causal=causal, variant="v2", lse=lse, splits=splits)
    bc = _C._dev.configs("v2")[plan["config"]]["bc"]
    nkb = -(-1000 // bc)  # key blocks of the config that ran, dealt out evenly
    per = -(-nkb // min(splits, nkb))
    assert plan["splits"] == -(-nkb // per)
    check_close(o, q, k, v, causal, None, lse=lse)


@V2
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [64, 200, 256])
def test_v2_split_combine_head_dims_and_repeatable(d, dtype):
    """The split-KV combine (a block per row, each warp folding 8 of its splits per round trip) at head dims that
    fill one, part of or every column a lane takes, split counts below, at and past one round trip per warp, with
    GQA-packed decode rows: O and LSE against the reference, and bitwise equal on repeats (a fixed order)."""
    q = randn((2, 16, 1, d), dtype, "cuda", 50 + d)
    k = randn((2, 4, 5000, d), dtype, "cuda", 51 + d)
    v = randn((2, 4, 5000, d), dtype, "cuda", 52 + d)
    for splits in (3, 33, 128):
        lse = torch.full((2, 16, 1), float("nan"), device="cuda", dtype=torch.float32)
        o, lse, plan = dev_forward(q, k, v, variant="v2", lse=lse, splits=splits)
        nkb = -(-5000 // _C._dev.configs("v2")[plan["config"]]["bc"])
        per = -(-nkb // min(splits, nkb))
        assert plan["splits"] == -(-nkb // per) > 1, plan  # 3, 27, 79: a warp with none, <= 8, > 16 each
        check_close(o, q, k, v, False, None, lse=lse)
        for _ in range(3):
            o2, lse2, _ = dev_forward(q, k, v, variant="v2", splits=splits, lse=torch.empty_like(lse))
            assert torch.equal(o, o2) and torch.equal(lse, lse2)


@V2
def test_v2_split_automatic_for_decode():
    """Decode with few heads leaves most SMs idle: the planner splits; the result matches the unsplit one within
    the accuracy gate, and forcing 1 split gives the unsplit kernel."""
    q = randn((1, 4, 1, 128), torch.bfloat16, "cuda", 13)
    k = randn((1, 4, 8192, 128), torch.bfloat16, "cuda", 14)
    lse = torch.empty(1, 4, 1, device="cuda", dtype=torch.float32)
    auto, lse, plan = dev_forward(q, k, k, variant="v2", lse=lse)
    assert plan["splits"] > 1 and plan["workspace"] > 0
    single, _, plan1 = dev_forward(q, k, k, variant="v2", splits=1)
    assert plan1["splits"] == 1 and plan1["workspace"] == 0
    check_close(auto, q, k, k, False, None, lse=lse)
    check_close(single, q, k, k, False, None)


@V2
def test_v2_split_not_used_under_graph_capture():
    """Under capture the split path allocates nothing and falls back to one split: capture and replay work and
    give the unsplit result exactly; outside capture the same call splits again."""
    q = randn((1, 2, 1, 128), torch.float16, "cuda", 15)
    k = randn((1, 2, 4096, 128), torch.float16, "cuda", 16)
    unsplit, _, _ = dev_forward(q, k, k, variant="v2", splits=1)
    split, _, plan = dev_forward(q, k, k, variant="v2", splits=8)
    assert plan["splits"] == 8
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        ran = _C._dev.forward(q, k, k, out, variant="v2", stream=s.cuda_stream, splits=8)
    assert ran["splits"] == 1 and ran["workspace"] == 0
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, unsplit)
    check_close(split, q, k, k, False, None)


def test_overrides_check_their_arguments():
    q = randn((1, 2, 16, 64), torch.float16, "cuda", 17)
    for kw, match in [({"splits": -1}, "splits"), ({"splits": 1000}, "splits"), ({"order": 3}, "order"),
                      ({"config": -2}, "config")]:
        with pytest.raises(ValueError, match=match):
            dev_forward(q, q, q, variant="v2", **kw)


V3 = pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0), reason="v3 needs sm_90 (H100/H200)")


@V3
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_v3_every_compiled_config(dtype):
    """Each of v3's compiled configs (defaults and sweep candidates), run explicitly, on odd shapes both ways."""
    configs = _C._dev.configs("v3")
    assert sorted(c["dp"] for c in configs if c["role"] == "default") == [64, 128, 256]  # one per head-dim bucket
    for c in configs:
        idx, dp = c["index"], c["dp"]
        for sq, sk, causal in [(113, 300, "bottom_right"), (300, 113, "top_left"), (257, 257, False)]:
            q = randn((2, 4, sq, dp), dtype, "cuda", idx)
            k = randn((2, 2, sk, dp), dtype, "cuda", idx + 1)
            v = randn((2, 2, sk, dp), dtype, "cuda", idx + 2)
            lse = torch.empty(2, 4, sq, device="cuda", dtype=torch.float32)
            o, lse, plan = dev_forward(q, k, v, causal=causal, variant="v3", lse=lse, config=idx)
            assert (plan["variant"], plan["config"]) == ("v3", idx)
            check_close(o, q, k, v, causal, None, lse=lse)
        # more tiles than the persistent grid has blocks (two per SM with one consumer): each block walks several
        q = randn((4, 16, 1025, dp), dtype, "cuda", idx + 3)
        k = randn((4, 16, 1025, dp), dtype, "cuda", idx + 4)
        for causal in (False, "top_left"):
            o, _, plan = dev_forward(q, k, k, causal=causal, variant="v3", config=idx)
            assert plan["grid"][0] < 4 * 16 * 17 and plan["config"] == idx, plan
            check_close(o, q, k, k, causal, None)


@V3
@pytest.mark.parametrize("d", [64, 128, 256])
def test_v3_tiles_without_keys_between_others(d):
    """Sq > Sk, bottom-right causal: the first Sq - Sk rows see no key, so the first query tile of every head is empty,
    and with many heads every block of the persistent grid walks empty tiles between others -- the case where a
    block whose tiles run back to back (FLAT) stores an empty tile while the last one's P V is still to come.
    Output rows that see nothing are zeros, their LSE -inf; each config of the bucket, both dtypes."""
    heads = _C.device_info(0)[2] + 7  # 3 query tiles a head at Br = 128: several tiles per block
    for dtype in (torch.float16, torch.bfloat16):
        q = randn((1, heads, 300, d), dtype, "cuda", d)
        k = randn((1, heads, 100, d), dtype, "cuda", d + 1)
        v = randn((1, heads, 100, d), dtype, "cuda", d + 2)
        for c in _C._dev.configs("v3"):
            if c["dp"] != _C._dev.head_dim_bucket(d):
                continue
            lse = torch.empty(1, heads, 300, device="cuda", dtype=torch.float32)
            o, lse, plan = dev_forward(q, k, v, causal="bottom_right", variant="v3", lse=lse, config=c["index"])
            assert plan["grid"][0] < heads * 3, plan
            check_close(o, q, k, v, "bottom_right", None, lse=lse)
            assert not o[:, :, :200].any() and torch.isinf(lse[:, :, :200]).all() and (lse[:, :, :200] < 0).all()


@V3
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_v3_row_max_growth(dtype):
    """The lazy row max (v3_fwd.cu, V3_MAX_SLACK = 8 in log2 units): scores that climb from one group of 64 keys to
    the next by 0.5, 7.9, 8.1 and 20 (log2 units), so some blocks leave m where it was (P up to 2^7.9) and others
    move it, in warps where some rows move and others do not; and scores that fall, so that m never moves after
    the first block.  Every v3 config of each bucket, non-causal and causal, output and LSE."""
    sq, sk = 300, 1025
    for d in (64, 128, 256):
        c2 = 4.0 / d ** 0.5 * 1.4426950408889634  # log2 units of score per unit of k[..., 0]
        steps = torch.tensor([0.5, 7.9, 8.1, 20.0]).repeat(sk // 64 + 1)[: sk // 64 + 1] / c2
        ramp = steps.cumsum(0)[torch.arange(sk) // 64]  # key j's score climb, group by group of 64
        q = randn((2, 3, sq, d), dtype, "cuda", d)
        q[..., 0] = 4.0
        q[:, :, ::2, 0] = 3.5  # rows of one warp climb by different amounts
        for sign in (1.0, -1.0):
            k = randn((2, 3, sk, d), dtype, "cuda", d + 1)
            k[..., 0] = (sign * ramp).to(dtype=dtype, device="cuda")
            v = randn((2, 3, sk, d), dtype, "cuda", d + 2)
            for c in _C._dev.configs("v3"):
                if c["dp"] != d:
                    continue
                for causal in (False, "bottom_right"):
                    lse = torch.empty(2, 3, sq, device="cuda", dtype=torch.float32)
                    o, lse, plan = dev_forward(q, k, v, causal=causal, variant="v3", lse=lse, config=c["index"])
                    assert plan["config"] == c["index"], plan
                    check_close(o, q, k, v, causal, None, lse=lse)


@V3
def test_v3_config_index_checked():
    q = randn((1, 2, 100, 128), torch.float16, "cuda", 3)
    n = len(_C._dev.configs("v3"))
    with pytest.raises(ValueError, match="config: .*v3 config .* out of range"):
        dev_forward(q, q, q, variant="v3", config=n)
    other = next(c["index"] for c in _C._dev.configs("v3") if c["dp"] != 128)
    with pytest.raises(ValueError, match="config: .*v3 config .* is for head dims"):
        dev_forward(q, q, q, variant="v3", config=other)


@V3
def test_v3_default_on_sm90_and_fallbacks():
    """On sm_90 fattn uses v3 for Sq > 64 with TMA-addressable tensors; decode goes to v2 (split-KV); K/V expanded
    over heads (stride 0) run on v3 as one kv head; forced v3 on tensors TMA cannot address (an output whose rows
    are only 4-byte aligned) runs v2 and says so, correctly."""
    q = randn((2, 4, 200, 128), torch.float16, "cuda", 4)
    check_close(fattn.attention(q, q, q, causal=True), q, q, q, True, None)
    assert plan_of(q, q, q, causal=True)["variant"] == "v3"
    qd = randn((2, 4, 1, 128), torch.float16, "cuda", 5)
    assert plan_of(qd, q, q)["variant"] == "v2"
    k1 = randn((2, 1, 200, 128), torch.float16, "cuda", 6)
    ke = k1.expand(2, 4, 200, 128)  # stride 0 over heads
    o = fattn.attention(q, ke, ke, variant="v3")
    assert plan_of(q, ke, ke, variant="v3")["variant"] == "v3"
    check_close(o, q, ke, ke, False, None)
    out = torch.empty(2, 4, 200, 128 + 2, device="cuda", dtype=torch.float16)[..., 2:]
    fattn.attention(q, q, q, variant="v3", out=out)
    assert plan_of(q, q, q, variant="v3", out=out)["variant"] == "v2"
    check_close(out, q, q, q, False, None)


@V3
@V2
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_block_orders_agree(causal):
    """Head by head and heads fastest run the same blocks in another order: bitwise the same output, and right
    (v2's grid and v3's persistent tiles)."""
    q = randn((2, 6, 333, 64), torch.float16, "cuda", 30)
    k = randn((2, 3, 290, 64), torch.float16, "cuda", 31)
    for variant in ("v2", "v3"):
        outs = [dev_forward(q, k, k, causal=causal, variant=variant, order=order)[0] for order in (1, 2)]
        assert torch.equal(outs[0], outs[1]), variant
        check_close(outs[0], q, k, k, causal, None)


@V3
def test_v3_tile_order_rule():
    """v3_plan.c's v3_order: a masked call walks head by head unless heads fastest is more than 5% better balanced,
    counted per SM.  D=64 causal 1k (the three-blocks-per-SM config; counted per block it went heads fastest, 1.7x
    slower) stays head by head; D=128 causal 16k, one block per SM, goes heads fastest (its busiest SM 1.54x the
    mean head by head); non-causal calls are always head by head."""
    three = next(c["index"] for c in _C._dev.configs("v3") if (c["dp"], c["bc"], c["stages"], c["consumers"]) ==
                 (64, 64, 3, 1))
    for shape, causal, want_config, want_order in [((16, 32, 1024, 64), "top_left", three, 1),
                                                   ((1, 16, 16384, 128), "top_left", None, 2),
                                                   ((1, 16, 16384, 128), False, None, 1)]:
        q = torch.empty(shape, dtype=torch.float16, device="cuda")
        plan = plan_of(q, q, q, causal=causal)
        assert plan["variant"] == "v3" and plan["order"] == want_order, (shape, causal, plan)
        assert want_config is None or plan["config"] == want_config, (shape, plan)


def test_v2_config_rules():
    """kernels/sm80/v2_configs.h: the defaults per head-dim bucket for calls that fill the GPU, the small-grid configs
    for decode (Sq <= 64), V2_RULES (empty at present); all correct."""
    configs = _C._dev.configs("v2")
    defaults = {c["dp"]: c["index"] for c in configs if c["role"] == "default"}
    small = {c["dp"]: c["index"] for c in configs if c["role"] == "small_grid"}
    assert not [c for c in configs if c["role"] == "rule"]  # none at present (v2_configs.h says why)
    heads = _C.device_info(0)[2] + 8  # enough query blocks that the grid fills every multiprocessor
    cases = [(64, 128, 1024, True, defaults[64]), (64, 128, 1024, False, defaults[64]), (128, 128, 700, True, defaults[128]),
             (256, 128, 300, False, defaults[256]), (128, 1, 2048, False, small[128]), (64, 64, 999, True, small[64])]
    for d, sq, sk, causal, want in cases:
        q = randn((1, heads, sq, d), torch.float16, "cuda", sq)
        k = randn((1, heads, sk, d), torch.float16, "cuda", sk)
        o, _, plan = dev_forward(q, k, k, causal=causal, variant="v2")
        assert plan["variant"] == "v2" and plan["config"] == want, (d, sq, sk, causal, plan, want)
        check_close(o, q, k, k, causal, None)


@V3
def test_v3_config_rules():
    """kernels/sm90/v3_configs.h's V3_RULES: D=64 causal calls with Sk <= 1024 and at least one default tile per SM
    run one consumer at Bc = 64 (three blocks per SM); D=64 calls with Sk <= 512 run one consumer at Bc = 128 (two
    blocks per SM) when causal (fewer tiles) or when the default's tiles are at most 2 per SM; D=64 causal calls with Sk <= 2048 run Br = 128 without ping-pong; D=128
    non-causal calls with Sk >= 8192 run Bc = 176; D=256 calls with Sk >= 1024 (non-causal) or >= 2048 (causal) run
    Bc = 80; the calls next to them run the bucket's default; all correct."""
    configs = _C._dev.configs("v3")
    default = {c["dp"]: c["index"] for c in configs if c["role"] == "default"}
    by_cfg = {(c["dp"], c["bc"], c["stages"], c["consumers"], c["pingpong"]): c["index"] for c in configs}
    one = by_cfg[(64, 128, 2, 1, 0)]
    sms = _C.device_info(0)[2]
    many = sms + 1  # heads: 3 default tiles of 512 rows each, more than 3 per SM in all (with (sms - 1) // 3 heads
    # fewer than one per SM, with one more at least one)
    three = by_cfg[(64, 64, 3, 1, 0)]
    cases = [(64, 2, 500, 512, True, one), (64, many, 512, 512, True, three), (64, many, 600, 1024, True, three),
             (64, (sms - 1) // 3, 512, 512, True, one), (64, (sms - 1) // 3 + 1, 512, 512, True, three),
             (64, (sms - 1) // 4, 600, 1024, True, by_cfg[(64, 128, 2, 2, 0)]),
             (64, 2, 512, 512, False, one),
             (64, many, 512, 512, False, default[64]), (64, 2, 512, 513, False, default[64]),
             (64, 2 * sms // 3, 512, 512, False, one), (64, 2 * sms // 3 + 1, 512, 512, False, default[64]),
             (64, 2, 600, 1025, True, by_cfg[(64, 128, 2, 2, 0)]), (64, 2, 600, 700, False, default[64]),
             (64, 2, 300, 2049, True, default[64]), (128, 2, 100, 8192, False, by_cfg[(128, 176, 2, 2, 1)]),
             (128, 2, 100, 8191, False, default[128]), (128, 2, 100, 8192, True, default[128]),
             (128, 2, 100, 16384, True, default[128]), (256, 2, 100, 1024, False, by_cfg[(256, 80, 2, 2, 1)]),
             (256, 2, 100, 1023, False, default[256]), (256, 2, 100, 2048, True, by_cfg[(256, 80, 2, 2, 1)]),
             (256, 2, 100, 2047, True, default[256])]
    for d, h, sq, sk, causal, want in cases:
        q = randn((1, h, sq, d), torch.float16, "cuda", sq)
        k = randn((1, h, sk, d), torch.float16, "cuda", sk)
        o = fattn.attention(q, k, k, causal=causal)
        assert (plan_of(q, k, k, causal=causal)["variant"], plan_of(q, k, k, causal=causal)["config"]) == ("v3", want)
        check_close(o, q, k, k, causal, None)
