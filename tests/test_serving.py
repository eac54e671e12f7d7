"""Serving and packed training (../shared/TESTING.md 26-27): softcap and packed variable-length batches on every
target, forward and gradients, against the float64 reference with explicit masks; argument errors.
`pytest -k serving`."""
import pytest

from conftest import packed, per_sequence, randn, replay_captured, repro, require, stream_for, torch

import fattn
from fattn.testing import accuracy


def devices():
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def dtypes_for(device):
    return ["fp32"] if device == "cpu" else ["fp16", "bf16"]


DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("softcap", [1.0, 30.0])
def test_serving_softcap_forward_and_grad(device, causal, softcap, seed, request):
    """Scores x8 so that the cap bites (|s| well past c); gradients by the 3x rule."""
    require(device)
    for dname in dtypes_for(device):
        dt = DT[dname]
        q = randn((1, 4, 77, 64), dt, device, seed, 8.0)
        k = randn((1, 2, 93, 64), dt, device, seed + 1, 8.0)
        v = randn((1, 2, 93, 64), dt, device, seed + 2)
        dout = randn((1, 4, 77, 64), dt, device, seed + 3)
        out, lse = fattn.attention(q, k, v, causal=causal, softcap=softcap, return_lse=True)
        why, _, _ = accuracy.check_attention(out, q, k, v, causal, None, lse, None, softcap)
        assert why is None, f"{dname}: {why}. {repro(request)}"
        g = fattn.attention_backward(dout, q, k, v, out, lse, causal=causal, softcap=softcap, deterministic=True)
        why, stats = accuracy.check_gradients(g, q, k, v, dout, causal, softcap=softcap)
        assert why is None, f"{dname}: {why} {stats}. {repro(request)}"
        leafs = [x.clone().requires_grad_() for x in (q, k, v)]
        fattn.attention(*leafs, causal=causal, softcap=softcap, deterministic=True).backward(dout)  # bitwise
        for a, b in zip(g, leafs):
            assert torch.equal(a, b.grad)


def test_serving_softcap_arguments():
    """A softcap is 0 or within float32's range as the kernels use it (c log2 e and its inverse normal): 3e38
    overflowed to NaN scores and 1e-46 rounded to 0 (silently no cap)."""
    q = torch.randn(1, 1, 4, 8)
    for bad, exc in [(-1.0, ValueError), ("x", TypeError), (float("inf"), ValueError), (3e38, ValueError),
                     (1e-46, ValueError)]:
        with pytest.raises(exc, match="softcap"):
            fattn.attention(q, q, q, softcap=bad)
    for fine in (2.3e38, 1e-37):
        assert not fattn.attention(q, q, q, softcap=fine).isnan().any()


@pytest.mark.parametrize("device", devices())
def test_serving_large_softcap_is_no_cap(device, seed):
    """A large softcap c changes scores by |s|^3 / (3 c^2): at c = 1e4 and 1e8 the output is the uncapped one to
    float32 rounding (the CPU's tanh had an absolute error of 1e-7, c * 1e-7 in the scores: 1e-3 at c = 1e4,
    uniform attention at 1e8)."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v = (randn((1, 2, 64, 64), dt, device, seed + i) for i in range(3))
    plain = fattn.attention(q, k, v)
    tol = 2e-6 if device == "cpu" else 2e-3
    for c in (1e4, 1e8):
        assert (fattn.attention(q, k, v, softcap=c) - plain).abs().max().item() < tol, c


LENGTHS = [[0, 1, 17, 300, 5], [64, 64, 64], [1], [3, 0, 0, 129]]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["ragged", "equal", "one", "empties"])
@pytest.mark.parametrize("kv_extra", [0, 7], ids=["sq=sk", "sk>sq"])
def test_serving_varlen_forward_and_grad(device, causal, lengths, kv_extra, seed, request):
    """Each sequence of the packed batch equals the dense call on that sequence alone (against the reference, by
    the accuracy rule); gradients by the 3x rule per sequence; lse is (H, total_q)."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    lk = [n + kv_extra for n in lengths]
    q, k, v, cq, ck = packed(lengths, lk, 4, 2, 64, dt, device, seed)
    dout = randn(tuple(q.shape), dt, device, seed + 3)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    g = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal, deterministic=True)
    for b in range(len(lengths)):
        qs, ks, vs, os_ = (per_sequence(x, c, b) for x, c in ((q, cq), (k, ck), (v, ck), (out, cq)))
        ls = lse[:, int(cq[b]):int(cq[b + 1])].unsqueeze(0)
        why, _, _ = accuracy.check_attention(os_, qs, ks, vs, causal, None, ls)
        assert why is None, f"sequence {b}: {why}. {repro(request)}"
        gs = [per_sequence(x, c, b) for x, c in ((g[0], cq), (g[1], ck), (g[2], ck))]
        why, stats = accuracy.check_gradients(gs, qs, ks, vs, per_sequence(dout, cq, b), causal)
        assert why is None, f"sequence {b}: {why} {stats}. {repro(request)}"
    leafs = [x.clone().requires_grad_() for x in (q, k, v)]
    fattn.attention_varlen(*leafs, cq, ck, causal=causal, deterministic=True).backward(dout)  # bitwise: no atomics
    for a, b_ in zip(g, leafs):
        assert torch.equal(a, b_.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v1", "v2", "v3"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["ragged", "equal", "one", "empties"])
def test_serving_varlen_forward_variants(variant, causal, lengths, seed, request):
    """Each GPU variant that takes packed batches, forward (fp16 and bf16), sequence by sequence; the plan says the
    variant itself ran."""
    require("cuda")
    if variant not in fattn.variants("cuda"):
        pytest.skip(f"{variant} does not run on this GPU")
    for dt in (torch.float16, torch.bfloat16):
        q, k, v, cq, ck = packed(lengths, [n + 5 for n in lengths], 4, 2, 128, dt, "cuda", seed)
        plan = fattn._C._dev.plan(q, k, v, torch.empty_like(q), causal=2 if causal else 0, cu_seqlens_q=cq,
                                  cu_seqlens_k=ck, variant=variant, stream=stream_for(q))
        assert plan["variant"] == variant, plan
        out, lse = fattn.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True, variant=variant)
        for b in range(len(lengths)):
            qs, ks, vs, os_ = (per_sequence(x, c, b) for x, c in ((q, cq), (k, ck), (v, ck), (out, cq)))
            ls = lse[:, int(cq[b]):int(cq[b + 1])].unsqueeze(0)
            why, _, _ = accuracy.check_attention(os_, qs, ks, vs, causal, None, ls)
            assert why is None, f"{dt} sequence {b}: {why}. {repro(request)}"


@pytest.mark.parametrize("device", devices())
def test_serving_varlen_seqused_k_caps_the_keys(device, seed):
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cq, ck = packed([5, 9], [40, 60], 2, 2, 32, dt, device, seed)
    used = torch.tensor([13, 60], dtype=torch.int32, device=device)
    out = fattn.attention_varlen(q, k, v, cq, ck, seqused_k=used, causal="bottom_right")
    for b, n in enumerate((13, 60)):
        qs = per_sequence(q, cq, b)
        ks, vs = (per_sequence(x, ck, b)[:, :, :n] for x in (k, v))
        why, _, _ = accuracy.check_attention(per_sequence(out, cq, b), qs, ks, vs, "bottom_right")
        assert why is None, f"sequence {b}: {why}"


def test_serving_varlen_errors_write_nothing():
    q, k, v, cq, ck = packed([4, 6], [4, 6], 2, 2, 16, torch.float32, "cpu", 0)
    out = torch.full_like(q, float("nan"))
    cases = [
        (cq.long(), ck, TypeError, "cu_seqlens_q: dtype must be int32"),
        (torch.tensor([0, 6, 4], dtype=torch.int32), ck, ValueError, "cu_seqlens_q: decreases at entry 2"),
        (cq, torch.tensor([0, 4, 99], dtype=torch.int32), ValueError, "cu_seqlens_k: the last offset 99 is past"),
        (cq, ck[:2], ValueError, "cu_seqlens_k: expected 3 entries, got 2"),
        (torch.tensor([-1, 4, 10], dtype=torch.int32), ck, ValueError, "cu_seqlens_q: entry 0 is -1"),
    ]
    for cu_q, cu_k, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fattn.attention_varlen(q, k, v, cu_q, cu_k, out=out, max_seqlen_q=6, max_seqlen_k=6)
        assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="max_seqlen_q: 3 is less than the longest query sequence"):
        fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=3, out=out)
    with pytest.raises(ValueError, match="q: expected a 3-D packed array"):
        fattn.attention_varlen(q[None], k, v, cq, ck)
    with pytest.raises(ValueError, match="seqused_k: entry 1 is 7, outside"):
        fattn.attention_varlen(q, k, v, cq, ck, seqused_k=torch.tensor([1, 7], dtype=torch.int32), out=out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("device", devices())
def test_serving_varlen_check_indices_false(device, seed):
    """check_indices=False trusts cu_seqlens (no read-back): the same result as the checked call, bitwise; it needs
    max_seqlen_q and max_seqlen_k, and still checks shapes and dtypes."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, dt, device, seed)
    want = fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right")
    got = fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=70, max_seqlen_k=70, causal="bottom_right",
                                 check_indices=False)
    assert torch.equal(want, got)
    with pytest.raises(ValueError, match="max_seqlen_q: needed"):
        fattn.attention_varlen(q, k, v, cq, ck, check_indices=False)
    with pytest.raises(ValueError, match="max_seqlen_k: needed"):
        fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=70, check_indices=False)
    with pytest.raises(TypeError, match="cu_seqlens_q: dtype must be int32"):
        fattn.attention_varlen(q, k, v, cq.long(), ck, max_seqlen_q=70, max_seqlen_k=70, check_indices=False)
    with pytest.raises(ValueError, match="max_seqlen_q: needed"):  # the C rule, for callers of fattn._C
        fattn._C.forward(q, k, v, torch.empty_like(q), cu_seqlens_q=cq, cu_seqlens_k=ck, check_indices=False)


@pytest.mark.parametrize("true", [True, 1, "numpy"], ids=["True", "1", "np.True_"])
def test_serving_causal_true_is_bottom_right(true):
    """In attention_varlen (forward and backward) and attention_with_kvcache, causal=True -- or any true value that
    is not a string, such as NumPy's True -- is bottom-right, flash-attention's convention there (a sequence's
    queries are its last positions); "top_left" still gives top-left.  (Before, varlen took True as top-left, and
    the cache took NumPy's True or 1 as top-left.)"""
    import numpy as np
    true = np.True_ if true == "numpy" else true
    q, k, v, cq, ck = packed([2, 5], [6, 9], 2, 1, 16, torch.float32, "cpu", 3)  # Sq < Sk in each sequence
    want = fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right", return_lse=True)
    got = fattn.attention_varlen(q, k, v, cq, ck, causal=true, return_lse=True)
    top = fattn.attention_varlen(q, k, v, cq, ck, causal="top_left")
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and not torch.equal(top, want[0])
    dout = randn(q.shape, torch.float32, "cpu", 9)
    g_true = fattn.attention_varlen_backward(dout, q, k, v, *want, cq, ck, causal=true)
    g_want = fattn.attention_varlen_backward(dout, q, k, v, *want, cq, ck, causal="bottom_right")
    assert all(torch.equal(a, b) for a, b in zip(g_true, g_want))
    qc = randn((2, 3, 2, 16), torch.float32, "cpu", 4)
    kc, vc = randn((2, 8, 1, 16), torch.float32, "cpu", 5), randn((2, 8, 1, 16), torch.float32, "cpu", 6)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    cache = fattn.attention_with_kvcache(qc, kc, vc, cache_seqlens=lens, causal=true)
    assert torch.equal(cache, fattn.attention_with_kvcache(qc, kc, vc, cache_seqlens=lens, causal="bottom_right"))
    assert not torch.equal(cache, fattn.attention_with_kvcache(qc, kc, vc, cache_seqlens=lens, causal="top_left"))


def test_serving_varlen_traced_needs_max_seqlen():
    """Traced (torch.compile, torch.export) or fake / meta tensors cannot read cu_seqlens: without max_seqlen_q and
    max_seqlen_k the call says so, naming the missing one (before: a graph break, or under fullgraph an opaque
    "marked as skipped" error)."""
    q = torch.empty(17, 4, 32, device="meta")
    cu = torch.tensor([0, 5, 17], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q: needed .* under torch.compile"):
        fattn.attention_varlen(q, q, q, cu, cu)
    with pytest.raises(ValueError, match="max_seqlen_k: needed"):
        fattn.attention_varlen(q, q, q, cu, cu, max_seqlen_q=12)


def test_serving_kvcache_refuses_tensors_that_require_grad():
    """attention_with_kvcache is inference only: with grad mode on, a q (or k_new / v_new) that requires grad is
    refused (before, eager calls returned a silently detached output and compiled ones failed in the backend);
    under torch.no_grad the same call runs."""
    q = torch.randn(1, 1, 2, 16, requires_grad=True)
    kc, vc = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="inference only"):
        fattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
    with torch.no_grad():
        assert fattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lens).shape == q.shape


@pytest.mark.gpu
def test_serving_varlen_first_call_of_a_process():
    """attention_varlen as a process's first fattn call on a GPU (finding torch's current stream needs fattn's torch
    glue set up first): it runs and matches the per-sequence dense call."""
    require("cuda")
    import os
    import subprocess
    import sys
    code = ("import torch, fattn; q = torch.randn(10, 2, 16, device='cuda', dtype=torch.float16); "
            "cu = torch.tensor([0, 4, 10], dtype=torch.int32, device='cuda'); o = fattn.attention_varlen(q, q, q, cu, cu); "
            "s = q[4:].transpose(0, 1)[None]; "
            "print(torch.allclose(o[4:], fattn.attention(s, s, s)[0].transpose(0, 1), atol=1e-3))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]


@pytest.mark.gpu
def test_serving_varlen_check_indices_false_captures(seed):
    """check_indices=False reads nothing back: the call can be captured in a CUDA graph (where a host read-back
    fails) and replays to the checked call's result.  (A checked call under capture: the next test.)"""
    require("cuda")
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, torch.float16, "cuda", seed)
    want = fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right")
    out = torch.empty_like(q)
    kw = dict(max_seqlen_q=70, max_seqlen_k=70, causal="bottom_right", out=out)
    replay_captured(lambda: fattn.attention_varlen(q, k, v, cq, ck, check_indices=False, **kw), out)
    assert torch.equal(out, want)


@pytest.mark.gpu
def test_serving_varlen_checked_call_refused_under_capture(seed):
    """A checked call being captured cannot read its cu_seqlens back: it is refused before any CUDA call, with a
    RuntimeError naming the array and check_indices=False, so the capture goes on -- the same call with
    check_indices=False is captured after it and replays to the eager result, and torch's CUDA generator still works
    afterwards.  (Before, the read was attempted: it ended the capture, and at db26266 left torch's generator
    raising "Offset increment outside graph capture encountered unexpectedly" in a later test.)"""
    require("cuda")
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, torch.float16, "cuda", seed)
    want = fattn.attention_varlen(q, k, v, cq, ck)
    out, x = torch.full_like(q, float("nan")), torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        x += 1
        with pytest.raises(RuntimeError, match=r"cu_seqlens_q: cannot be read back .* check_indices=False"):
            fattn.attention_varlen(q, k, v, cq, ck, out=out)
        fattn.attention_varlen(q, k, v, cq, ck, max_seqlen_q=70, max_seqlen_k=70, check_indices=False, out=out)
        x += 1
    graph.replay()
    torch.cuda.synchronize()
    assert x.item() == 2 and torch.equal(out, want), "the replay differs from the eager call"
    assert torch.randn(4, device="cuda").isfinite().all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_backward(variant, d, causal, deterministic, seed, request):
    """v2's and v3's backward on packed batches (their SEQ kernels; the plan says which ran): empty, 1-row,
    partial-tile and long sequences, Sq != Sk, GQA; each sequence's gradients by the 3x rule; deterministic mode
    bitwise repeatable."""
    require("cuda")
    if variant not in fattn.variants("cuda"):
        pytest.skip(f"{variant} does not run on this GPU")
    lq, lk = [0, 1, 17, 300, 1100, 64, 129], [5, 1, 40, 300, 1100, 0, 200]
    for dt in (torch.float16, torch.bfloat16):
        q, k, v, cq, ck = packed(lq, lk, 4, 2, d, dt, "cuda", seed)
        dout = randn(tuple(q.shape), dt, "cuda", seed + 3)
        out, lse = fattn.attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True)
        g = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal,
                                            deterministic=deterministic, variant=variant)
        plan = fattn._C._dev.plan_backward(dout, q, k, v, out, lse, *g, causal=2 if causal else 0, cu_seqlens_q=cq,
                                           cu_seqlens_k=ck, max_seqlen_q=1100, max_seqlen_k=1100, variant=variant,
                                           deterministic=deterministic, stream=stream_for(q))
        assert plan["variant"] == variant, plan
        for b in range(len(lq)):
            qs, ks, vs = per_sequence(q, cq, b), per_sequence(k, ck, b), per_sequence(v, ck, b)
            gs = [per_sequence(g[0], cq, b), per_sequence(g[1], ck, b), per_sequence(g[2], ck, b)]
            why, stats = accuracy.check_gradients(gs, qs, ks, vs, per_sequence(dout, cq, b), causal)
            assert why is None, f"{dt} sequence {b} ({lq[b]} x {lk[b]}): {why} {stats}. {repro(request)}"
        if deterministic:
            again = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal,
                                                    deterministic=True, variant=variant)
            assert all(torch.equal(a, b) for a, b in zip(g, again)), "deterministic gradients differ"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_backward_softcap_alibi(variant, deterministic, seed, request):
    """v2's and v3's packed backward with a softcap and with ALiBi ((batch, H) slopes: a row per sequence), GQA, odd
    lengths; each sequence's gradients by the 3x rule; the plan says which ran."""
    require("cuda")
    if variant not in fattn.variants("cuda"):
        pytest.skip(f"{variant} does not run on this GPU")
    lq, lk = [0, 1, 17, 300, 129], [5, 1, 40, 300, 200]
    q, k, v, cq, ck = packed(lq, lk, 4, 2, 128, torch.float16, "cuda", seed, 3.0)
    dout = randn(tuple(q.shape), torch.float16, "cuda", seed + 3)
    al = torch.rand(5, 4, generator=torch.Generator().manual_seed(seed)).to("cuda") * 0.3
    for softcap, alibi in ((5.0, None), (0.0, al), (2.0, al)):
        kw = dict(causal="bottom_right", softcap=softcap, alibi_slopes=alibi)
        out, lse = fattn.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
        g = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, deterministic=deterministic,
                                            variant=variant, **kw)
        plan = fattn._C._dev.plan_backward(dout, q, k, v, out, lse, *g, causal=2, softcap=softcap, alibi_slopes=alibi,
                                           cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=300, max_seqlen_k=300,
                                           deterministic=deterministic, variant=variant, stream=stream_for(q))
        assert plan["variant"] == variant, plan
        for b in range(len(lq)):
            qs, ks, vs = per_sequence(q, cq, b), per_sequence(k, ck, b), per_sequence(v, ck, b)
            gs = [per_sequence(g[0], cq, b), per_sequence(g[1], ck, b), per_sequence(g[2], ck, b)]
            why, stats = accuracy.check_gradients(gs, qs, ks, vs, per_sequence(dout, cq, b), "bottom_right", None,
                                                  None, softcap, None if alibi is None else alibi[b:b + 1])
            assert why is None, f"softcap={softcap} alibi={alibi is not None} sequence {b}: {why} {stats}. " \
                                f"{repro(request)}"


@pytest.mark.parametrize("device", devices())
def test_serving_varlen_autograd_check_indices_false(device, seed):
    """Packed training without host syncs: check_indices=False through the torch op gives the checked call's output
    and gradients, bitwise (deterministic mode); attention_varlen_backward takes it too."""
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cq, ck = packed([3, 70, 17], [5, 70, 40], 4, 2, 64, dt, device, seed)
    dout = randn(tuple(q.shape), dt, device, seed + 3)
    results = []
    for check in (True, False):
        leafs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fattn.attention_varlen(*leafs, cq, ck, max_seqlen_q=70, max_seqlen_k=70, causal="bottom_right",
                                     deterministic=True, check_indices=check)
        out.backward(dout)
        results.append([out.detach()] + [x.grad for x in leafs])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    out, lse = fattn.attention_varlen(q, k, v, cq, ck, causal="bottom_right", return_lse=True)
    g = fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, max_seqlen_q=70, max_seqlen_k=70,
                                        causal="bottom_right", deterministic=True, check_indices=False)
    for a, b in zip(g, results[0][1:]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="max_seqlen_q: needed"):
        fattn.attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, check_indices=False)
