"""GPU behaviour beyond parity (TESTING.md items 16-18): the caller's stream, CUDA graphs, errors never left
pending, other DLPack producers on the GPU (CuPy, JAX).  Skipped without a GPU; run on the GPU machine."""
import pytest

from conftest import HAS_CUDA, V3, check_close, dev_forward, gpu_variants, kernels_launched, randn, torch

import fattn
from fattn import _C

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")]
VARIANTS = gpu_variants() if HAS_CUDA else [row[0] for row in _C._dev.variant_table()]


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


def test_more_streams_than_workspace_entries():
    """fattn keeps one workspace per (device, stream) in a table of 32 (gpu.c): calls on a 33rd and later stream (a
    program that makes streams as it goes) still get one -- the least recently used entry is freed for them -- so
    a key-split forward still splits and a backward given no workspace still runs, on each of 40 live streams and
    again on the first ones after they were pushed out, bitwise equal to the same calls on the default stream."""
    q = randn((1, 2, 1, 128), torch.float16, "cuda", 17)
    k = randn((1, 2, 4096, 128), torch.float16, "cuda", 18)
    qb, kb, vb, dout = (randn((1, 2, 200, 64), torch.float16, "cuda", 19 + i) for i in range(4))
    out_b, lse_b = fattn.attention(qb, kb, vb, return_lse=True)

    def run(stream):
        out = torch.empty_like(q)
        ran = _C._dev.forward(q, k, k, out, variant="v2", stream=stream, splits=8)
        g = [torch.empty_like(x) for x in (qb, kb, vb)]
        _C._dev.backward(dout, qb, kb, vb, out_b, lse_b, *g, stream=stream, deterministic=True)
        return ran["splits"], out, g

    torch.cuda.synchronize()
    splits, expect, expect_g = run(torch.cuda.current_stream().cuda_stream)
    assert splits == 8
    check_close(expect, q, k, k, False, None)
    streams = [torch.cuda.Stream() for _ in range(40)]
    for s in streams + streams[:4]:
        s.wait_stream(torch.cuda.current_stream())
        splits, out, g = run(s.cuda_stream)
        torch.cuda.current_stream().wait_stream(s)
        assert splits == 8
        assert torch.equal(out, expect) and all(torch.equal(a, b) for a, b in zip(g, expect_g))


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
@pytest.mark.parametrize("d", [64, 128])
def test_v2_split_merged_in_kernel(d):
    """Decode (Sq = 1, GQA rows packed: 4 a block) at head dims whose small-grid kernels merge their own splits, up
    to 16 splits: the last split of each query block merges them (no merge kernel is launched), O and LSE against the
    reference, on the default stream and on another one (each has its counters), bitwise equal on repeats, the split
    count changing between calls (each launch must leave its arrival counts at zero for the next) and every output
    word written (out and lse start as NaN)."""
    q = randn((2, 32, 1, d), torch.float16, "cuda", 60 + d)
    k = randn((2, 8, 3000, d), torch.float16, "cuda", 61 + d)
    v = randn((2, 8, 3000, d), torch.float16, "cuda", 62 + d)
    first = {}
    side = torch.cuda.Stream()
    for rep in range(2):
        for splits in (2, 16, 3, 9):
            for stream in (None, side):
                out = torch.full_like(q, float("nan"))
                lse = torch.full((2, 32, 1), float("nan"), device="cuda", dtype=torch.float32)

                def run():
                    if stream is None:
                        return dev_forward(q, k, v, variant="v2", out=out, lse=lse, splits=splits)[2]
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        plan = dev_forward(q, k, v, variant="v2", out=out, lse=lse, splits=splits)[2]
                    torch.cuda.current_stream().wait_stream(stream)
                    return plan
                names = kernels_launched(run)
                assert any("v2_fwd" in n for n in names) and not [n for n in names if "v2_combine" in n], names
                if (splits, stream) == (2, None) and rep == 0:
                    check_close(out, q, k, v, False, None, lse=lse)
                first.setdefault(splits, (out.clone(), lse.clone()))
                assert torch.equal(out, first[splits][0]) and torch.equal(lse, first[splits][1])
    for splits in (16, 3, 9):
        o, l = first[splits]
        check_close(o, q, k, v, False, None, lse=l)


@V2
@pytest.mark.parametrize("shape,splits", [((1, 8, 1, 256), 7), ((1, 4, 5, 128), 7), ((1, 4, 1, 128), 24)],
                         ids=["d256", "5rows", "24splits"])
def test_v2_split_merge_kernel_elsewhere(shape, splits):
    """Split calls the in-kernel merge does not take -- head dim 256 (its small-grid kernel is built for one block
    per SM), query blocks of more than 4 rows, more than 16 splits -- launch the merge kernel, and are right."""
    b, h, sq, d = shape
    q = randn(shape, torch.float16, "cuda", 70)
    k = randn((b, h, 4000, d), torch.float16, "cuda", 71)
    lse = torch.full((b, h, sq), float("nan"), device="cuda", dtype=torch.float32)
    out = torch.full_like(q, float("nan"))
    names = kernels_launched(lambda: dev_forward(q, k, k, variant="v2", out=out, lse=lse, splits=splits))
    assert any("v2_combine" in n for n in names), names
    check_close(out, q, k, k, False, None, lse=lse)


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
