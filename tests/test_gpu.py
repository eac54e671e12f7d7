"""GPU behaviour beyond parity (TESTING.md items 16-18): the caller's stream, CUDA graphs, errors never left
pending, other DLPack producers on the GPU (CuPy, JAX).  Skipped without a GPU; run on the GPU machine."""
import pytest

from conftest import HAS_CUDA, check_close, gpu_variants, randn, torch

import fattn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")]
VARIANTS = gpu_variants() if HAS_CUDA else [name for name, _, _ in fattn._C.all_gpu_variants()]


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
    old = fattn._C.v2_set_splits(1)  # a captured v2 call never splits the keys (it may hold no workspace): so neither
    try:                              # may the uncaptured call it is compared with bit for bit
        expect = fattn.attention(q, k, k, causal="bottom_right", variant=variant)
    finally:
        fattn._C.v2_set_splits(old)
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
    with pytest.raises(ValueError, match="k: on device"):
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
    with pytest.raises(TypeError, match="variant: v2 does not support this dtype"):
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
    old = fattn._C.v2_set_splits(splits)
    try:
        o, lse = fattn.attention(q, k, v, causal=causal, variant="v2", return_lse=True)
        bc = {c[0]: c[4] for c in fattn._C.v2_configs()}[fattn._C.last_config()[1]]
        nkb = -(-1000 // bc)  # key blocks of the config that ran, dealt out evenly
        per = -(-nkb // min(splits, nkb))
        assert fattn._C.v2_last_splits() == -(-nkb // per)
    finally:
        fattn._C.v2_set_splits(old)
    check_close(o, q, k, v, causal, None, lse=lse)


@V2
def test_v2_split_automatic_for_decode():
    """Decode with few heads leaves most SMs idle: the heuristic splits; the result matches the unsplit one within
    the accuracy gate, and forcing 1 split gives the unsplit kernel."""
    q = randn((1, 4, 1, 128), torch.bfloat16, "cuda", 13)
    k = randn((1, 4, 8192, 128), torch.bfloat16, "cuda", 14)
    old = fattn._C.v2_set_splits(0)
    try:
        auto, lse = fattn.attention(q, k, k, variant="v2", return_lse=True)
        assert fattn._C.v2_last_splits() > 1
        fattn._C.v2_set_splits(1)
        single = fattn.attention(q, k, k, variant="v2")
        assert fattn._C.v2_last_splits() == 1
    finally:
        fattn._C.v2_set_splits(old)
    check_close(auto, q, k, k, False, None, lse=lse)
    check_close(single, q, k, k, False, None)


@V2
def test_v2_split_not_used_under_graph_capture():
    """Under capture the split path allocates nothing and falls back to one split: capture and replay work and
    give the unsplit result exactly; outside capture the same call splits again."""
    q = randn((1, 2, 1, 128), torch.float16, "cuda", 15)
    k = randn((1, 2, 4096, 128), torch.float16, "cuda", 16)
    old = fattn._C.v2_set_splits(1)
    try:
        unsplit = fattn.attention(q, k, k, variant="v2")
        fattn._C.v2_set_splits(8)
        split = fattn.attention(q, k, k, variant="v2")
        assert fattn._C.v2_last_splits() == 8
        out = torch.empty_like(q)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fattn.attention(q, k, k, variant="v2", out=out)
        assert fattn._C.v2_last_splits() == 1
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
    finally:
        fattn._C.v2_set_splits(old)
    assert torch.equal(out, unsplit)
    check_close(split, q, k, k, False, None)


def test_v2_set_splits_checks_its_argument():
    with pytest.raises(ValueError, match="splits"):
        fattn._C.v2_set_splits(-1)
    with pytest.raises(ValueError, match="splits"):
        fattn._C.v2_set_splits(1000)
    assert fattn._C.v2_set_splits(0) == 0


V3 = pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0), reason="v3 needs sm_90 (H100/H200)")


def run_v3_config(q, k, v, causal, idx, lse=None):
    out = torch.empty_like(q)
    fattn._C.forward(q, k, v, out, lse, {False: 0, "top_left": 1, "bottom_right": 2}[causal], None, 0, "v3",
                     torch.cuda.current_stream().cuda_stream or 1, idx)
    return out


@V3
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_v3_every_compiled_config(dtype):
    """Each of v3's compiled configs (defaults and sweep candidates), run explicitly, on odd shapes both ways."""
    configs = fattn._C.v3_configs()
    assert sorted({c[1] for c in configs if c[6]}) == [64, 128, 256]  # one default per head-dim bucket
    for idx, dp, *_ in configs:
        for sq, sk, causal in [(113, 300, "bottom_right"), (300, 113, "top_left"), (257, 257, False)]:
            q = randn((2, 4, sq, dp), dtype, "cuda", idx)
            k = randn((2, 2, sk, dp), dtype, "cuda", idx + 1)
            v = randn((2, 2, sk, dp), dtype, "cuda", idx + 2)
            lse = torch.empty(2, 4, sq, device="cuda", dtype=torch.float32)
            o = run_v3_config(q, k, v, causal, idx, lse)
            assert fattn._C.last_config() == ("v3", idx)
            check_close(o, q, k, v, causal, None, lse=lse)


@V3
def test_v3_config_index_checked():
    q = randn((1, 2, 100, 128), torch.float16, "cuda", 3)
    n = len(fattn._C.v3_configs())
    with pytest.raises(RuntimeError, match="v3 config .* out of range"):
        run_v3_config(q, q, q, False, n)
    other = next(c[0] for c in fattn._C.v3_configs() if c[1] != 128)
    with pytest.raises(RuntimeError, match="v3 config .* is for head dims"):
        run_v3_config(q, q, q, False, other)


@V3
def test_v3_default_on_sm90_and_fallbacks():
    """On sm_90 fattn uses v3 for Sq > 64 with TMA-addressable tensors; decode goes to v2 (split-KV); K/V expanded
    over heads (stride 0) run on v3 as one kv head; forced v3 on tensors TMA cannot address (an output whose rows
    are only 4-byte aligned) runs v2 and says so, correctly."""
    q = randn((2, 4, 200, 128), torch.float16, "cuda", 4)
    check_close(fattn.attention(q, q, q, causal=True), q, q, q, True, None)
    assert fattn._C.last_config()[0] == "v3"
    qd = randn((2, 4, 1, 128), torch.float16, "cuda", 5)
    fattn.attention(qd, q, q)
    assert fattn._C.last_config()[0] == "v2"
    k1 = randn((2, 1, 200, 128), torch.float16, "cuda", 6)
    ke = k1.expand(2, 4, 200, 128)  # stride 0 over heads
    o = fattn.attention(q, ke, ke, variant="v3")
    assert fattn._C.last_config()[0] == "v3"
    check_close(o, q, ke, ke, False, None)
    out = torch.empty(2, 4, 200, 128 + 2, device="cuda", dtype=torch.float16)[..., 2:]
    fattn.attention(q, q, q, variant="v3", out=out)
    assert fattn._C.last_config()[0] == "v2"
    check_close(out, q, q, q, False, None)


@V3
@V2
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_v2_block_orders_agree(causal):
    """Head by head and heads fastest run the same blocks in another order: bitwise the same output, and right."""
    q = randn((2, 6, 333, 64), torch.float16, "cuda", 30)
    k = randn((2, 3, 290, 64), torch.float16, "cuda", 31)
    outs = []
    for order in (1, 2):
        old = fattn._C.v2_set_order(order)
        try:
            outs.append(fattn.attention(q, k, k, causal=causal, variant="v2"))
        finally:
            fattn._C.v2_set_order(old)
    assert torch.equal(outs[0], outs[1])
    check_close(outs[0], q, k, k, causal, None)
    with pytest.raises(ValueError, match="order"):
        fattn._C.v2_set_order(3)


def test_v2_config_rules():
    """kernels/v2_configs.h: the defaults per head-dim bucket for calls that fill the GPU, the small-grid configs for
    decode (Sq <= 64), V2_RULES (empty at present); all correct."""
    rows = {c[0]: tuple(c[1:6]) for c in fattn._C.v2_configs()}
    defaults = {rows[i][0]: rows[i] for i in range(3)}
    small = {rows[i][0]: rows[i] for i in range(3, 6)}
    assert fattn._C.v2_rules() == []  # none at present (kernels/v2_configs.h says why)
    heads = fattn._C.device_info(0)[2] + 8  # enough query blocks that the grid fills every multiprocessor
    cases = [(64, 128, 1024, True, defaults[64]), (64, 128, 1024, False, defaults[64]), (128, 128, 700, True, defaults[128]),
             (256, 128, 300, False, defaults[256]), (128, 1, 2048, False, small[128]), (64, 64, 999, True, small[64])]
    for d, sq, sk, causal, want in cases:
        q = randn((1, heads, sq, d), torch.float16, "cuda", sq)
        k = randn((1, heads, sk, d), torch.float16, "cuda", sk)
        o = fattn.attention(q, k, k, causal=causal, variant="v2")
        kind, idx = fattn._C.last_config()
        assert kind == "v2" and rows[idx] == want, (d, sq, sk, causal, rows[idx], want)
        check_close(o, q, k, k, causal, None)


def test_v3_config_rules():
    """kernels/v3_configs.h's V3_RULES: D=64 causal calls with Sk <= 2048 run Br = 128 without ping-pong, D=128
    non-causal calls with Sk >= 8192 run Bc = 176; the calls next to them run the bucket's default; all correct."""
    configs = fattn._C.v3_configs()
    default = {c[1]: c[0] for c in configs if c[6]}
    by_cfg = {tuple(c[1:6]): c[0] for c in configs}
    cases = [(64, 600, 700, True, by_cfg[(64, 128, 2, 2, 0)]), (64, 600, 700, False, default[64]),
             (64, 300, 2049, True, default[64]), (128, 100, 8192, False, by_cfg[(128, 176, 2, 2, 1)]),
             (128, 100, 8191, False, default[128]), (128, 100, 8192, True, default[128])]
    for d, sq, sk, causal, want in cases:
        q = randn((1, 2, sq, d), torch.float16, "cuda", sq)
        k = randn((1, 2, sk, d), torch.float16, "cuda", sk)
        o = fattn.attention(q, k, k, causal=causal)
        assert fattn._C.last_config() == ("v3", want), (d, sq, sk, causal)
        check_close(o, q, k, k, causal, None)
