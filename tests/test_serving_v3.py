"""v3's kernels for packed batches and per-sequence lengths (the Hopper forward's SEQ kernels, static and dynamic
schedules, and its packed backward): every sequence against the float64 reference by the accuracy rule, on the GPU.
`pytest -k serving`."""
import numpy as np
import pytest

from conftest import packed, per_sequence, randn, replay_captured, repro, require, stream_for, torch

import fattn
from fattn.testing import accuracy


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 128, 256])  # 80: columns past d in the bucket, not stored
@pytest.mark.parametrize("causal,window", [(False, None), ("bottom_right", None), (False, (70, 10))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("mods", ["plain", "softcap", "alibi"])
def test_v3_varlen(d, causal, window, mods, seed, request):
    """v3's per-sequence kernels: a packed batch with empty, 1-row, partial-tile and multi-tile sequences (one over
    1025 rows), Sq != Sk per sequence, GQA, seqused_k capping some, with masks, a window, a softcap or ALiBi; each
    sequence by the accuracy rule against the reference; the rows after out's view (in the same buffer) untouched."""
    require("cuda")
    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    lq, lk = [0, 1, 17, 300, 1100, 64, 129], [5, 1, 40, 300, 1100, 0, 200]
    for dt in (torch.float16, torch.bfloat16):
        q, k, v, cq, ck = packed(lq, lk, 4, 2, d, dt, "cuda", seed, 2.0)
        used = torch.tensor([5, 1, 33, 300, 1000, 0, 129], dtype=torch.int32, device="cuda")
        kw = {"softcap": 5.0} if mods == "softcap" else {}
        al = None
        if mods == "alibi":
            al = torch.rand(7, 4, generator=torch.Generator().manual_seed(seed)).to("cuda") * 0.3
            kw["alibi_slopes"] = al
        buf = torch.full((q.shape[0] + 3, 4, d), float("nan"), dtype=dt, device="cuda")
        out = buf[:q.shape[0]]
        plan = fattn._C._dev.plan(q, k, v, out, causal=2 if causal else 0, window=window, cu_seqlens_q=cq,
                                  cu_seqlens_k=ck, seqused_k=used, variant="v3", stream=stream_for(q), **kw)
        assert plan["variant"] == "v3", plan
        _, lse = fattn.attention_varlen(q, k, v, cq, ck, seqused_k=used, causal=causal, window=window, out=out,
                                        return_lse=True, variant="v3", **kw)
        for b in range(len(lq)):
            n = int(used[b])
            qs, os_ = per_sequence(q, cq, b), per_sequence(out, cq, b)
            ks, vs = (per_sequence(x, ck, b)[:, :, :n] for x in (k, v))
            ls = lse[:, int(cq[b]):int(cq[b + 1])].unsqueeze(0)
            why, _, _ = accuracy.check_attention(os_, qs, ks, vs, causal, None, ls, window, kw.get("softcap", 0.0),
                                                 None if al is None else al[b:b + 1])
            assert why is None, f"{dt} sequence {b} ({lq[b]} x {n}): {why}. {repro(request)}"
        assert torch.isnan(buf[q.shape[0]:]).all(), "rows past the packed output were written"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_v3_varlen_backward_many_blocks(causal, seed, request):
    """v3's packed-batch backward with far more dK/dV blocks than SMs (7 sequences x 32 kv heads x the longest's
    9 key blocks), most of them past their own sequence's keys: every sequence's gradients by the 3x rule (and zero
    where a sequence has no queries or no keys), in default and deterministic mode."""
    require("cuda")
    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    lq, lk = [0, 1, 17, 300, 1100, 64, 129], [5, 1, 40, 300, 1100, 0, 200]
    q, k, v, cq, ck = packed(lq, lk, 32, 32, 128, torch.float16, "cuda", seed)
    dout = randn(tuple(q.shape), torch.float16, "cuda", seed + 3)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True, variant="v3")
    for det in (False, True):
        g = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal, deterministic=det,
                                            variant="v3")
        for b in range(len(lq)):
            gs = [per_sequence(x, c, b) for x, c in ((g[0], cq), (g[1], ck), (g[2], ck))]
            if lq[b] == 0 or lk[b] == 0:  # no query rows: dK = dV = 0; no keys: dQ = 0
                assert not any(x.any() for x in gs), f"det={det} sequence {b}: nonzero gradients"
                continue
            qs, ks, vs = (per_sequence(x, c, b) for x, c in ((q, cq), (k, ck), (v, ck)))
            why, stats = accuracy.check_gradients(gs, qs, ks, vs, per_sequence(dout, cq, b), causal)
            assert why is None, f"det={det} sequence {b}: {why} {stats}. {repro(request)}"


@pytest.mark.gpu
def test_v3_kvcache_chunked_prefill(seed, request):
    """A chunk of 200 queries over a contiguous cache with new keys appended: per-sequence key counts (seqused_k)
    on v3, dense q."""
    require("cuda")
    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    b, hk, h, d, cap = 3, 2, 4, 128, 1024
    kc, vc = (randn((b, cap, hk, d), torch.float16, "cuda", seed + i) for i in range(2))
    kn, vn = (randn((b, 200, hk, d), torch.float16, "cuda", seed + 2 + i) for i in range(2))
    q = randn((b, 200, h, d), torch.float16, "cuda", seed + 4)
    lens = torch.tensor([0, 333, 800], dtype=torch.int32, device="cuda")
    plan = fattn._C._dev.plan(q, kc, vc, torch.empty_like(q), causal=2, layout=1, cache_seqlens=lens, k_new=kn,
                              v_new=vn, stream=stream_for(q))
    assert plan["variant"] == "v3", plan
    out, lse = fattn.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=vn, cache_seqlens=lens, return_lse=True)
    for i in range(b):
        n = int(lens[i]) + 200
        why, _, _ = accuracy.check_attention(out[i:i + 1].transpose(1, 2), q[i:i + 1].transpose(1, 2),
                                             kc[i:i + 1, :n].transpose(1, 2), vc[i:i + 1, :n].transpose(1, 2),
                                             "bottom_right", None, lse[i:i + 1])
        assert why is None, f"sequence {i}: {why}. {repro(request)}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_v3_varlen_dynamic_schedule(d, causal, seed, request):
    """v3's packed calls take tiles from a per-stream counter (the dynamic schedule) eagerly and walk a static
    schedule under CUDA graph capture: on 160 ragged sequences (empty ones, one row, one of 1100) with Sq != Sk, every
    sequence by the accuracy rule; three calls in a row equal (the counter is back at zero after each); the captured
    call's replay bitwise equal to the eager one; two streams at once (two counters) each equal to its own result."""
    require("cuda")
    if "v3" not in fattn.variants("cuda"):
        pytest.skip("v3 runs on compute capability 9.0 only")
    rng = np.random.default_rng(seed)
    lq = [int(x) for x in rng.integers(0, 300, 160)]
    lq[3], lq[50], lq[51], lq[100] = 0, 1, 1100, 0
    lk = [n + int(x) for n, x in zip(lq, rng.integers(0, 40, 160))]
    q, k, v, cq, ck = packed(lq, lk, 4, 2, d, torch.float16, "cuda", seed)
    kw = dict(max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=causal, variant="v3")
    outs = [fattn.attention_varlen(q, k, v, cq, ck, **kw) for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "repeated calls differ"
    for b in range(len(lq)):
        if lq[b] == 0:
            continue
        qs, ks, vs, os_ = (per_sequence(x, c, b) for x, c in ((q, cq), (k, ck), (v, ck), (outs[0], cq)))
        why, _, _ = accuracy.check_attention(os_, qs, ks, vs, causal)
        assert why is None, f"sequence {b} ({lq[b]} x {lk[b]}): {why}. {repro(request)}"
    # the static schedule: a captured call (no counter under capture)
    out = torch.empty_like(q)
    replay_captured(lambda: fattn.attention_varlen(q, k, v, cq, ck, check_indices=False, out=out, **kw), out)
    assert torch.equal(out, outs[0]), "the static schedule's result differs from the dynamic one's"
    # two streams at once, each with its own counter
    q2 = randn(tuple(q.shape), torch.float16, "cuda", seed + 9)
    want2 = fattn.attention_varlen(q2, k, v, cq, ck, **kw)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    got1, got2 = [], []
    for _ in range(4):
        with torch.cuda.stream(s1):
            got1.append(fattn.attention_varlen(q, k, v, cq, ck, check_indices=False, **kw))
        with torch.cuda.stream(s2):
            got2.append(fattn.attention_varlen(q2, k, v, cq, ck, check_indices=False, **kw))
    torch.cuda.synchronize()
    assert all(torch.equal(g, outs[0]) for g in got1) and all(torch.equal(g, want2) for g in got2)
