"""ALiBi (issue 17): alibi_slopes (H,) or (B, H) in attention, attention_varlen, attention_with_kvcache and the
backward, against the float64 reference with the bias written out (fattn.testing.reference.alibi_bias): forward by
the accuracy rule, gradients by the 3x rule, odd shapes, every mask kind, with a softcap and a window; every GPU
variant runs it itself (the plan says so), v2's and v3's score-modifying kernels at each config that has one;
argument errors name alibi_slopes.  `pytest -k alibi`."""
import pytest

from conftest import HAS_CUDA, randn, repro, require, torch

import fattn
from fattn.testing import accuracy, reference

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def devices():
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def dtypes_for(device):
    return ["fp32"] if device == "cpu" else ["fp16", "bf16"]


def slopes(shape, device, seed):
    """ALiBi's usual geometric slopes 2^(-8 (h + 1) / H), shuffled per batch row for (B, H)."""
    h = shape[-1]
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
    if len(shape) == 1:
        return base.to(device)
    g = torch.Generator().manual_seed(seed)
    return torch.stack([base[torch.randperm(h, generator=g)] for _ in range(shape[0])]).to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(1, 17), (17, 113), (113, 17), (64, 64), (1025, 1025)])
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
def test_alibi_forward_and_grad(device, causal, sq, sk, per_batch, seed, request):
    """Forward and gradients by the rule; the bias changes the result (the check sees it); the torch op's autograd
    gives the same gradients as attention_backward."""
    require(device)
    for dname in dtypes_for(device):
        dt = DT[dname]
        q = randn((2, 4, sq, 64), dt, device, seed, 2.0)
        k = randn((2, 2, sk, 64), dt, device, seed + 1, 2.0)
        v = randn((2, 2, sk, 64), dt, device, seed + 2)
        dout = randn((2, 4, sq, 64), dt, device, seed + 3)
        al = slopes((2, 4) if per_batch else (4,), device, seed)
        out, lse = fattn.attention(q, k, v, causal=causal, alibi_slopes=al, return_lse=True)
        why, _, _ = accuracy.check_attention(out, q, k, v, causal, None, lse, None, 0.0, al)
        assert why is None, f"{dname}: {why}. {repro(request)}"
        plain = fattn.attention(q, k, v, causal=causal)
        if reference.visible(sq, sk, causal).sum(1).max() > 1:  # a row with two keys or more: the bias tells
            assert not torch.equal(out, plain), "alibi_slopes changed nothing"
        g = fattn.attention_backward(dout, q, k, v, out, lse, causal=causal, alibi_slopes=al, deterministic=True)
        why, stats = accuracy.check_gradients(g, q, k, v, dout, causal, alibi=al)
        assert why is None, f"{dname}: {why} {stats}. {repro(request)}"
        leafs = [x.clone().requires_grad_() for x in (q, k, v)]
        fattn.attention(*leafs, causal=causal, alibi_slopes=al, deterministic=True).backward(dout)  # bitwise
        for a, b in zip(g, leafs):
            assert torch.equal(a, b.grad)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("window,softcap", [((16, 4), 0.0), ((-1, -1), 5.0), ((8, -1), 2.0)],
                         ids=["window", "softcap", "both"])
def test_alibi_with_window_and_softcap(device, window, softcap, seed, request):
    """The bias joins after the softcap and inside the window; strided (bshd) inputs with Sq != Sk."""
    require(device)
    for dname in dtypes_for(device):
        dt = DT[dname]
        q = randn((1, 113, 4, 64), dt, device, seed, 4.0).transpose(1, 2)
        k = randn((1, 129, 4, 64), dt, device, seed + 1, 4.0).transpose(1, 2)
        v = randn((1, 129, 4, 64), dt, device, seed + 2).transpose(1, 2)
        dout = randn((1, 4, 113, 64), dt, device, seed + 3)
        al = slopes((4,), device, seed) * 4
        out, lse = fattn.attention(q, k, v, window=window, softcap=softcap, alibi_slopes=al, return_lse=True)
        why, _, _ = accuracy.check_attention(out, q, k, v, False, None, lse, window, softcap, al)
        assert why is None, f"{dname}: {why}. {repro(request)}"
        g = fattn.attention_backward(dout, q, k, v, out, lse, window=window, softcap=softcap, alibi_slopes=al)
        why, stats = accuracy.check_gradients(g, q, k, v, dout, False, None, window, softcap, al)
        assert why is None, f"{dname}: {why} {stats}. {repro(request)}"


@pytest.mark.parametrize("device", devices())
def test_alibi_varlen_per_sequence(device, seed, request):
    """(batch, H) slopes: sequence b uses row b, positions counted within the sequence (lengths 0, 1, 17, 300)."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    lq, lk = [0, 1, 17, 300], [3, 1, 30, 300]
    cq = torch.tensor([0, 0, 1, 18, 318], dtype=torch.int32, device=device)
    ck = torch.tensor([0, 3, 4, 34, 334], dtype=torch.int32, device=device)
    q, k, v = (randn((n, 4, 64), dt, device, seed + i, 2.0) for i, n in enumerate((318, 334, 334)))
    dout = randn((318, 4, 64), dt, device, seed + 3)
    al = slopes((4, 4), device, seed)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right", alibi_slopes=al, return_lse=True)
    g = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal="bottom_right", alibi_slopes=al)
    for b in range(4):
        def seq(x, cu):
            return x[int(cu[b]):int(cu[b + 1])].transpose(0, 1).unsqueeze(0)
        qs, ks, vs = seq(q, cq), seq(k, ck), seq(v, ck)
        ls = lse[:, int(cq[b]):int(cq[b + 1])].unsqueeze(0)
        why, _, _ = accuracy.check_attention(seq(out, cq), qs, ks, vs, "bottom_right", None, ls, alibi=al[b:b + 1])
        assert why is None, f"sequence {b} ({lq[b]} x {lk[b]}): {why}. {repro(request)}"
        gs = [seq(g[0], cq), seq(g[1], ck), seq(g[2], ck)]
        why, stats = accuracy.check_gradients(gs, qs, ks, vs, seq(dout, cq), "bottom_right", alibi=al[b:b + 1])
        assert why is None, f"sequence {b}: {why} {stats}. {repro(request)}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_alibi_kvcache_decode_gqa(device, paged, seed, request):
    """A GQA decode step over a cache with new keys appended: query i sits at cache_seqlens[b] + S_new - Sq + i."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    b, hk, h, d, cap = 3, 2, 8, 64, 128
    lens = torch.tensor([0, 37, 120], dtype=torch.int32, device=device)
    if paged:
        table = torch.randperm(3 * 8, generator=torch.Generator().manual_seed(seed)).reshape(3, 8)
        table = table.to(torch.int32).to(device)
        kc, vc = (randn((24, 16, hk, d), dt, device, seed + i) for i in range(2))
    else:
        table = None
        kc, vc = (randn((b, cap, hk, d), dt, device, seed + i) for i in range(2))
    kn, vn = (randn((b, 1, hk, d), dt, device, seed + 5 + i) for i in range(2))
    q = randn((b, 1, h, d), dt, device, seed + 7, 2.0)
    al = slopes((b, h), device, seed)
    out, lse = fattn.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=vn, cache_seqlens=lens, block_table=table,
                                            alibi_slopes=al, return_lse=True)
    for i in range(b):
        n = int(lens[i]) + 1
        if table is None:
            ks, vs = kc[i, :n], vc[i, :n]
        else:
            rows = torch.arange(n, device=kc.device)
            ks, vs = (c[table[i].long()[rows // 16], rows % 16] for c in (kc, vc))
        why, _, _ = accuracy.check_attention(out[i:i + 1].transpose(1, 2), q[i:i + 1].transpose(1, 2),
                                             ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                             "bottom_right", None, lse[i:i + 1], alibi=al[i:i + 1])
        assert why is None, f"sequence {i} ({n} keys): {why}. {repro(request)}"


@pytest.mark.gpu
def test_alibi_every_gpu_variant(seed, request):
    """Every GPU variant runs ALiBi itself when named (the plan says so, no fall-back), and right; so does the
    default."""
    require("cuda")
    from conftest import stream_for

    q = randn((2, 4, 77, 64), torch.float16, "cuda", seed, 2.0)
    k = randn((2, 4, 93, 64), torch.float16, "cuda", seed + 1, 2.0)
    v = randn((2, 4, 93, 64), torch.float16, "cuda", seed + 2)
    al = slopes((4,), "cuda", seed)
    for variant in [None] + fattn.variants("cuda"):
        plan = fattn._C._dev.plan(q, k, v, torch.empty_like(q), causal=2, alibi_slopes=al, variant=variant,
                                  stream=stream_for(q))
        if variant is not None:
            assert plan["variant"] == variant, plan
        out, lse = fattn.attention(q, k, v, causal="bottom_right", alibi_slopes=al, return_lse=True, variant=variant)
        why, _, _ = accuracy.check_attention(out, q, k, v, "bottom_right", None, lse, alibi=al)
        assert why is None, f"{variant} ({plan['variant']} ran): {why}. {repro(request)}"


def test_alibi_arguments():
    q = torch.randn(2, 4, 8, 16)
    for bad, exc, match in [(torch.ones(4, dtype=torch.float64), TypeError, "alibi_slopes: dtype must be float32, "
                             "got float64"),
                            (torch.ones(3), ValueError, r"alibi_slopes: expected shape \(H,\) = \(4,\)"),
                            (torch.ones(3, 4), ValueError, r"\(B, H\) = \(2, 4\)"),
                            (torch.ones(2, 4, 1), ValueError, "alibi_slopes: expected shape"),
                            (torch.ones(8)[::2], ValueError, "alibi_slopes: the heads must be contiguous")]:
        with pytest.raises(exc, match=match):
            fattn.attention(q, q, q, alibi_slopes=bad)
    import numpy as np

    with pytest.raises(TypeError, match="alibi_slopes: expected an array of q's framework"):
        fattn.attention(q, q, q, alibi_slopes=np.ones(4, dtype=np.float32))
    # NumPy in, NumPy slopes: fine
    qn = q.numpy()
    out = fattn.attention(qn, qn, qn, alibi_slopes=np.full(4, 0.5, dtype=np.float32))
    ref = fattn.attention(q, q, q, alibi_slopes=torch.full((4,), 0.5))
    assert np.array_equal(out, ref.numpy())


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_alibi_device_mismatch():
    q = torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="alibi_slopes: on cpu but q is on cuda:0"):
        fattn.attention(q, q, q, alibi_slopes=torch.ones(2))


def test_alibi_opcheck():
    """The registered op with alibi_slopes (and sinks absent) passes torch.library.opcheck."""
    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    al = torch.tensor([0.5, 0.25])
    torch.library.opcheck(torch.ops.fattn.attention.default,
                          (q, q.detach().clone().requires_grad_(), q.detach().clone().requires_grad_(), 2, None, 0,
                           -1, -1, 0.0, None, None, 0, 0, None, False, None, al))


@pytest.mark.gpu
@pytest.mark.parametrize("d,configs", [(64, (0, 3)), (128, (1, 4)), (256, (2, 5))])
@pytest.mark.parametrize("splits", [1, 3])
def test_v2_score_mods_every_config(d, configs, splits, seed, request):
    """v2's score-modifying kernels (a softcap, ALiBi, both) at each config that has one, with and without split
    keys, odd lengths and Sq != Sk, causal bottom-right; a config without one is refused by name."""
    require("cuda")
    from conftest import dev_forward

    for dname in ("fp16", "bf16"):
        dt = DT[dname]
        q = randn((2, 4, 113, d), dt, "cuda", seed, 3.0)
        k = randn((2, 2, 301, d), dt, "cuda", seed + 1, 3.0)
        v = randn((2, 2, 301, d), dt, "cuda", seed + 2)
        al = slopes((2, 4), "cuda", seed)
        for softcap, alibi in ((5.0, None), (0.0, al), (2.0, al)):
            for config in configs:
                lse = torch.empty(2, 4, 113, device="cuda")
                out, lse, plan = dev_forward(q, k, v, causal="bottom_right", variant="v2", config=config,
                                             splits=splits, lse=lse, softcap=softcap, alibi_slopes=alibi)
                assert plan["variant"] == "v2" and plan["config"] == config and plan["splits"] == splits, plan
                why, _, _ = accuracy.check_attention(out, q, k, v, "bottom_right", None, lse, None, softcap, alibi)
                assert why is None, f"{dname} softcap={softcap} alibi={alibi is not None} {plan}: {why}. " \
                                    f"{repro(request)}"
    q = randn((1, 1, 16, d), torch.float16, "cuda", seed)
    with pytest.raises(ValueError, match="no softcap / ALiBi kernel"):  # config 6: a fp16 sweep config
        dev_forward(q, q, q, variant="v2", config=6, softcap=5.0)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_score_mods_backward(variant, d, deterministic, seed, request):
    """v2's and v3's backward score-modifying kernels (v2: dK/dV and the deterministic dQ kernel; v3: dK/dV at head
    dims above 64, D=64 runs v2's): gradients by the 3x rule with a softcap, ALiBi and both, GQA, odd lengths,
    Sq != Sk, causal bottom-right; deterministic mode bitwise repeatable."""
    require("cuda")
    if variant not in fattn.variants("cuda"):
        pytest.skip(f"{variant} does not run on this GPU")
    from conftest import stream_for

    ran = "v2" if variant == "v3" and d <= 64 else variant
    for dname in ("fp16", "bf16"):
        dt = DT[dname]
        q = randn((2, 4, 113, d), dt, "cuda", seed, 3.0)
        k = randn((2, 2, 177, d), dt, "cuda", seed + 1, 3.0)
        v = randn((2, 2, 177, d), dt, "cuda", seed + 2)
        dout = randn((2, 4, 113, d), dt, "cuda", seed + 3)
        al = slopes((2, 4), "cuda", seed)
        for softcap, alibi in ((5.0, None), (0.0, al), (2.0, al)):
            kw = dict(causal="bottom_right", softcap=softcap, alibi_slopes=alibi, variant=variant)
            out, lse = fattn.attention(q, k, v, return_lse=True, **kw)
            g = fattn.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw)
            plan = fattn._C._dev.plan_backward(dout, q, k, v, out, lse, *g, causal=2, softcap=softcap,
                                               alibi_slopes=alibi, variant=variant, deterministic=deterministic,
                                               stream=stream_for(q))
            assert plan["variant"] == ran, plan  # the score-modifying kernels ran, not a fallback
            why, stats = accuracy.check_gradients(g, q, k, v, dout, "bottom_right", None, None, softcap, alibi)
            assert why is None, f"{dname} softcap={softcap} alibi={alibi is not None}: {why} {stats}. " \
                                f"{repro(request)}"
            if deterministic:
                again = fattn.attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
                assert all(torch.equal(a, b) for a, b in zip(g, again)), "deterministic gradients differ"


@pytest.mark.gpu
@pytest.mark.parametrize("d,config", [(64, 0), (128, 1), (256, 2)])
@pytest.mark.parametrize("causal,window", [(False, None), ("bottom_right", None), ("top_left", None),
                                           (False, (100, 30))], ids=["full", "causal-br", "causal-tl", "window"])
def test_v3_score_mods(d, config, causal, window, seed, request):
    """v3's score-modifying kernels (the default configs): a softcap, ALiBi and both, against the reference; odd
    lengths, Sq != Sk, GQA, every mask kind; the plan says v3 ran; a sweep config without one is refused."""
    require("cuda")
    from conftest import dev_forward

    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    for dname in ("fp16", "bf16"):
        dt = DT[dname]
        q = randn((2, 4, 301, d), dt, "cuda", seed, 3.0)
        k = randn((2, 2, 477, d), dt, "cuda", seed + 1, 3.0)
        v = randn((2, 2, 477, d), dt, "cuda", seed + 2)
        al = slopes((2, 4), "cuda", seed)
        for softcap, alibi in ((5.0, None), (0.0, al), (2.0, al)):
            lse = torch.empty(2, 4, 301, device="cuda")
            out, lse, plan = dev_forward(q, k, v, causal=causal, window=window, variant="v3", config=config, lse=lse,
                                         softcap=softcap, alibi_slopes=alibi)
            assert plan["variant"] == "v3" and plan["config"] == config, plan
            why, _, _ = accuracy.check_attention(out, q, k, v, causal, None, lse, window, softcap, alibi)
            assert why is None, f"{dname} softcap={softcap} alibi={alibi is not None}: {why}. {repro(request)}"
    with pytest.raises(ValueError, match="no softcap / ALiBi kernel"):
        dev_forward(q, k, v, variant="v3", config=3 + config, softcap=5.0)
