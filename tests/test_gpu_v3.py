"""v3 (Hopper) on the GPU: each compiled config on odd shapes, the lazy row max, the planner's config rules and
tile order, config overrides and fallbacks.  Skipped without an sm_90 GPU; run on the GPU machine."""
import pytest

from conftest import HAS_CUDA, V3, check_close, dev_forward, plan_of, randn, repro, torch

import fattn
from fattn import _C

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")]


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
    """The lazy row max (v3_fwd_kernel.cuh, V3_MAX_SLACK = 8 in log2 units): scores that climb from one group of 64 keys to
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


@V3
def test_v3_config_rules():
    """kernels/sm90/v3_configs.h's V3_RULES: D=64 causal calls with Sk <= 1024 and at least one default tile per SM
    run one consumer at Bc = 64 (three blocks per SM); D=64 calls with Sk <= 512 run one consumer at Bc = 128 (two
    blocks per SM) when causal (fewer tiles) or when the default's tiles are at most 2 per SM; D=64 causal calls with Sk <= 1024 run Br = 128 without ping-pong; D=128
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
             (64, 2, 600, 1025, True, default[64]), (64, 2, 600, 2048, True, default[64]),
             (64, 2, 600, 700, False, default[64]),
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


def three_consumer_configs():
    return [c["index"] for c in _C._dev.configs("v3") if c["consumers"] == 3]


@V3
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_v3_split_tails(dtype, request):
    """Split tails (v3_schedule.h, v3_plan.c: v3_split_tails): with three consumers (Br = 192), a head's last query
    block of at most 64 rows has its key blocks shared out over the consumers and merged in consumer 0 -- by the
    planner's rule on unmasked calls, forced (splits=3) on masked ones.  Tails of 1 .. 64 rows, tails only
    (Sq <= 64), fewer key blocks than consumers (two consumers without one), Sq != Sk, every mask kind, a window,
    strided (bshd) inputs, and more tails than the grid has blocks (each block merges several, between full
    tiles); output and LSE against the reference, and the same call without the split (splits=1) agreeing with
    it."""
    cases = [((2, 4, 1024, 1024), False, None, "bhsd"), ((2, 4, 200, 333), "bottom_right", None, "bhsd"),
             ((2, 3, 17, 100), False, None, "bhsd"), ((1, 4, 1, 300), "top_left", None, "bhsd"),
             ((2, 3, 64, 64), "top_left", None, "bhsd"), ((1, 5, 250, 1025), "bottom_right", None, "bshd"),
             ((2, 3, 256, 700), False, (100, 20), "bhsd"), ((2, 3, 448, 129), "bottom_right", None, "bhsd"),
             ((4, _C.device_info(0)[2] // 2 + 3, 424, 1030), "top_left", None, "bhsd")]
    for idx in three_consumer_configs():
        for (b, h, sq, sk), causal, window, layout in cases:
            assert 0 < sq % 192 <= 64, sq
            shape_q = (b, h, sq, 64) if layout == "bhsd" else (b, sq, h, 64)
            shape_k = (b, h, sk, 64) if layout == "bhsd" else (b, sk, h, 64)
            q = randn(shape_q, dtype, "cuda", sq + idx)
            k = randn(shape_k, dtype, "cuda", sk + 1)
            v = randn(shape_k, dtype, "cuda", sk + 2)
            outs = {}
            rule = 3 if not causal and window is None else 1
            for splits, want in ((0, rule), (1, 1), (3, 3)):
                lse = torch.empty(b, h, sq, device="cuda", dtype=torch.float32)
                o, lse, plan = dev_forward(q, k, v, causal=causal, window=window, layout=layout, variant="v3",
                                           lse=lse, config=idx, splits=splits)
                assert (plan["config"], plan["splits"]) == (idx, want), plan
                ob = o if layout == "bhsd" else o.transpose(1, 2)
                qb, kb, vb = (q, k, v) if layout == "bhsd" else (t.transpose(1, 2) for t in (q, k, v))
                check_close(ob, qb, kb, vb, causal, None, lse=lse, request=request, window=window)
                outs[want] = (ob.float(), lse)
            # the split changes only the order of the additions: within a few units of the dtype's last place
            tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
            assert (outs[3][0] - outs[1][0]).abs().max().item() <= tol, ((b, h, sq, sk), causal)
            finite = torch.isfinite(outs[1][1])
            assert torch.equal(finite, torch.isfinite(outs[3][1]))
            assert (outs[3][1][finite] - outs[1][1][finite]).abs().max().item() <= 1e-4


@V3
def test_v3_split_tails_score_mods(request):
    """The split tails of D=64's softcap / ALiBi kernel (three consumers): against the reference with the mods."""
    from fattn.testing import accuracy

    h = 4
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        q = randn((2, h, 200, 64), dtype, "cuda", 5, 3.0)
        k = randn((2, h, 301, 64), dtype, "cuda", 6, 3.0)
        v = randn((2, h, 301, 64), dtype, "cuda", 7)
        for softcap, alibi in ((5.0, None), (0.0, slopes), (2.0, slopes)):
            for causal in (False, "bottom_right"):
                lse = torch.empty(2, h, 200, device="cuda")
                out, lse, plan = dev_forward(q, k, v, causal=causal, variant="v3", config=0, lse=lse, splits=3,
                                             softcap=softcap, alibi_slopes=alibi)
                assert (plan["variant"], plan["config"], plan["splits"]) == ("v3", 0, 3), plan
                why, _, _ = accuracy.check_attention(out, q, k, v, causal, None, lse, None, softcap, alibi)
                assert why is None, f"causal={causal} softcap={softcap} alibi={alibi is not None}: {why}"


EDGE_BLOCK_CASES = [  # (sq, sk, causal, window): tiles whose last key block a warpgroup sees only the first half of
    (384, 384, "top_left", None),  # (the causal diagonal, the keys' end, a right edge) or whose first block only the
    (200, 330, "bottom_right", None),  # second half (a window's left edge), at several offsets; and some that see both
    (100, 164, "bottom_right", None),
    (130, 150, False, None),
    (257, 257, False, (-1, 30)),
    (520, 520, False, (70, 0)),
    (300, 300, False, (40, 20)),
    (64, 600, "bottom_right", (100, 0)),
    (1, 129, False, None),
]


@V3
@pytest.mark.parametrize("mods", [False, True], ids=["plain", "softcap"])
def test_v3_edge_blocks(mods, request):
    """The configs with 128-key blocks on edge blocks of every kind, where a warpgroup's rows see only one half of the
    block, against the reference; with a softcap through the defaults' mods kernels.  (Written for a trial that took
    P and P V on such halves only, evidence/bench/h100_v3_fwd_half_blocks_trial_7c86d37.md; it stays as coverage.)"""
    from fattn.testing import accuracy

    configs = [c for c in _C._dev.configs("v3") if c["bc"] == 128 and (not mods or c["role"] == "default")]
    assert configs
    softcap = 4.0 if mods else 0.0
    for c in configs:
        idx, dp = c["index"], c["dp"]
        for n, (sq, sk, causal, window) in enumerate(EDGE_BLOCK_CASES):
            q = randn((1, 2, sq, dp), torch.float16, "cuda", 10 * idx + n, 2.0)
            k = randn((1, 2, sk, dp), torch.float16, "cuda", 10 * idx + n + 1, 2.0)
            v = randn((1, 2, sk, dp), torch.float16, "cuda", 10 * idx + n + 2)
            lse = torch.empty(1, 2, sq, device="cuda")
            out, lse, plan = dev_forward(q, k, v, causal=causal, window=window, variant="v3", config=idx, lse=lse,
                                         softcap=softcap)
            assert (plan["variant"], plan["config"]) == ("v3", idx), plan
            why, _, _ = accuracy.check_attention(out, q, k, v, causal, None, lse, window, softcap)
            assert why is None, f"config {idx} sq={sq} sk={sk} causal={causal} window={window}: {why}. {repro(request)}"


@V3
def test_v3_split_tails_overrides():
    """splits on v3: 0 (the planner's) and 1 (no split) always; 3 only where a tail can be split (three consumers, a
    last query block of at most 64 rows, a dense call).  v3 does not take other counts: the call runs v2 (v3's
    fallback) with them (as many as its key blocks allow), and the plan says so."""
    q = randn((1, 2, 257, 64), torch.float16, "cuda", 1)  # 257 = 192 + 65: a tail of 65 rows
    assert dev_forward(q, q, q, variant="v3", config=0)[2]["splits"] == 1
    two = next(c["index"] for c in _C._dev.configs("v3") if c["dp"] == 64 and c["consumers"] == 2)
    q2 = randn((1, 2, 256, 64), torch.float16, "cuda", 2)  # a tail of 64 rows at Br = 192, none at 128
    for x, config, splits in ((q, 0, 3), (q2, 0, 2), (q2, two, 3), (q2, None, 2)):
        o, _, plan = dev_forward(x, x, x, variant="v3", config=config, splits=splits)
        assert plan["variant"] == "v2" and 1 < plan["splits"] <= splits, (config, splits, plan)
        check_close(o, x, x, x, False, None)


@V3
def test_v3_split_tails_grid():
    """With short tails (split, or one consumer idle) the planner sizes the persistent grid by a replay of the tiles
    (v3_plan.c: v3_tail_grid): at D=64, S=1k, 6 tiles a head, every slot would hand all the short tiles to every
    sixth block, so it takes fewer blocks than SMs there, and at S=512 (3 tiles a head, a tail of 128 rows: one
    consumer idle, not split) likewise; the 1k call with splits=1 (two idle consumers, not modelled) and masked
    calls (not split by the rule) take every slot."""
    sms = _C.device_info(0)[2]
    q = torch.empty((16, 32, 1024, 64), dtype=torch.float16, device="cuda")
    plan = plan_of(q, q, q)
    assert (plan["variant"], plan["config"], plan["splits"]) == ("v3", 0, 3), plan
    assert sms - 8 < plan["grid"][0] <= sms, plan
    if sms % 6 == 0:
        assert plan["grid"][0] < sms, plan
    assert plan_of(q, q, q, splits=1)["grid"][0] == sms
    assert plan_of(q, q, q, causal="top_left")["splits"] == 1
    q = torch.empty((32, 32, 512, 64), dtype=torch.float16, device="cuda")
    plan = plan_of(q, q, q)
    assert (plan["config"], plan["splits"]) == (0, 1) and sms - 8 < plan["grid"][0] <= sms, plan
    if sms % 3 == 0:
        assert plan["grid"][0] < sms, plan
    assert plan_of(q, q, q, causal=True)["splits"] == 1  # (causal 512 runs a one-consumer rule config)
