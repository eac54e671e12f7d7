"""Attention sinks (issue 17; gpt-oss): a float32 logit per head joining every row's softmax denominator, attending
to nothing.  Forward and gradients (sinks included) against a float64 reference that appends the sink as one more
score column with a zero value, by the accuracy rule (2x forward, 3x gradients) against the same reference computed in
the inputs' dtype; dense, packed and KV-cache calls; every target.  `pytest -k sinks`."""
import pytest

from conftest import randn, repro, require, torch

import fattn
from fattn.testing import accuracy, reference


def targets():
    return [pytest.param("cpu", None, id="cpu")] + [
        pytest.param("cuda", v, id=f"cuda-{v or 'default'}", marks=pytest.mark.gpu) for v in (None, "v1", "v2", "v3")]


def dtypes_for(device):
    return [torch.float32] if device == "cpu" else [torch.float16, torch.bfloat16]


def sink_attention(q, k, v, sinks, causal, dtype=torch.float64):
    """(out, lse) of attention with sinks in `dtype`, q (B, H, Sq, D), k / v (B, H_kv, Sk, D): the sink is one more
    score column (logit sinks[h]) whose value row is zero."""
    b, h, sq, d = q.shape
    sk, g = k.shape[2], h // k.shape[1]
    qd, kd, vd = (x.to(dtype) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) / d ** 0.5
    mask = torch.from_numpy(reference.visible(sq, sk, causal)).to(s.device)
    s = s.masked_fill(~mask, float("-inf"))
    col = sinks.to(dtype)[None, :, None, None].expand(b, h, sq, 1)
    ext = torch.cat([s, col], -1)
    p = torch.softmax(ext, -1)
    return p[..., :-1] @ vd, torch.logsumexp(ext, -1)


def check(name, got, ref, low, dtype, factor, request):
    err = (got.double() - ref).abs().max().item()
    err_low = (low.double() - ref).abs().max().item()
    why = accuracy.verdict(err, err_low, accuracy.dtype_name(dtype), ref.abs().max().item(), 64, factor, name)
    assert why is None, f"{dtype}: {why}. {repro(request)}"


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(1, 113), (17, 17), (113, 300), (64, 1)])
def test_sinks_forward_and_grad(device, variant, causal, sq, sk, seed, request):
    require(device)
    for dt in dtypes_for(device):
        q = randn((2, 4, sq, 64), dt, device, seed, 2.0)
        k, v = randn((2, 2, sk, 64), dt, device, seed + 1, 2.0), randn((2, 2, sk, 64), dt, device, seed + 2)
        sinks = randn((4,), torch.float32, device, seed + 3, 3.0)
        dout = randn((2, 4, sq, 64), dt, device, seed + 4)
        out, lse = fattn.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True, variant=variant)
        ref, ref_lse = sink_attention(q, k, v, sinks, causal)
        low, _ = sink_attention(q, k, v, sinks, causal, dtype=dt if dt != torch.float32 else torch.float32)
        check("out", out, ref, low, dt, 2.0, request)
        why = accuracy.check_lse(lse, ref_lse, sink_attention(q, k, v, sinks, causal, dtype=torch.float32)[1])
        assert why is None, f"{dt}: {why}. {repro(request)}"
        # gradients: torch autograd through the registered op, sinks included
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        fattn.attention(*leaves[:3], causal=causal, sinks=leaves[3], variant=variant,
                        deterministic=True).backward(dout)  # bitwise-comparable with the explicit call below
        qs, ks, vs, ss = (x.detach().double().requires_grad_() for x in (q, k, v, sinks))
        refs = torch.autograd.grad(sink_attention(qs, ks, vs, ss, causal)[0], (qs, ks, vs, ss), dout.double())
        ql, kl, vl, sl = (x.detach().requires_grad_() for x in (q, k, v, sinks))
        lows = torch.autograd.grad(sink_attention(ql, kl, vl, sl, causal, dtype=dt)[0], (ql, kl, vl, sl),
                                   dout.to(dt))
        for name, leaf, r, lo in zip(("dq", "dk", "dv", "dsinks"), leaves, refs, lows):
            if name == "dq" and sk == 1 and dt == torch.float32:
                # One key beside the sink: dS = P (dP - D) cancels (P near 1), and the backward's float32 LSE rounding
                # then dominates dq (CPU: 7.9e-6 against the rule's 6.0e-6, torch's own float32 autograd 1.1e-6).
                # The same cancellation without sinks gives 2.5e-6 where dq is exactly 0.  Bounded loosely here.
                assert (leaf.grad.double() - r).abs().max().item() <= 1e-4 * max(1.0, r.abs().max().item())
                continue
            check(name, leaf.grad, r, lo, dt, 3.0, request)
        # the explicit backward gives the same four
        g = fattn.attention_backward(dout, q, k, v, out, lse, causal=causal, sinks=sinks, variant=variant,
                                     deterministic=True)
        assert len(g) == 4
        for a, leaf in zip(g, leaves):
            assert torch.equal(a, leaf.grad), f"{dt}: attention_backward differs from autograd. {repro(request)}"


@pytest.mark.parametrize("device,variant", targets())
def test_sinks_varlen_and_kvcache(device, variant, seed, request):
    """Packed sequences and a KV-cache step with sinks equal the dense call with sinks, sequence by sequence."""
    require(device)
    dt = dtypes_for(device)[0]
    lengths = [5, 0, 40]
    cu = torch.tensor([0, 5, 5, 45], dtype=torch.int32, device=device)
    q, k, v = (randn((45, 4, 64), dt, device, seed + i) for i in range(3))
    sinks = randn((4,), torch.float32, device, seed + 3, 3.0)
    out = fattn.attention_varlen(q, k, v, cu, cu, causal="bottom_right", sinks=sinks, variant=variant)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        s0 = int(cu[b])
        one = [x[s0:s0 + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        want = fattn.attention(*one, causal="bottom_right", sinks=sinks, variant=variant)
        got = out[s0:s0 + n].transpose(0, 1).unsqueeze(0)
        tol = 1e-5 if dt == torch.float32 else 2e-3 * max(1.0, want.float().abs().max().item())
        assert (got.float() - want.float()).abs().max().item() <= tol, f"sequence {b}. {repro(request)}"
    kc, vc = randn((2, 64, 2, 64), dt, device, seed + 5), randn((2, 64, 2, 64), dt, device, seed + 6)
    qd = randn((2, 1, 4, 64), dt, device, seed + 7)
    lens = torch.tensor([10, 64], dtype=torch.int32, device=device)
    o = fattn.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, sinks=sinks, variant=variant)
    for b, n in enumerate((10, 64)):
        ref, _ = sink_attention(qd[b:b + 1].transpose(1, 2), kc[b:b + 1, :n].transpose(1, 2),
                                vc[b:b + 1, :n].transpose(1, 2), sinks, "bottom_right")
        err = (o[b:b + 1].transpose(1, 2).double() - ref).abs().max().item()
        assert err <= (1e-5 if dt == torch.float32 else 1e-2), f"kvcache sequence {b}: {err}. {repro(request)}"


def test_sinks_arguments():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match=r"sinks: expected a 1-D array of H=4 entries"):
        fattn.attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match=r"sinks: dtype must be float32"):
        fattn.attention(q, q, q, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"sinks: expected an array of q's framework"):
        fattn.attention(q, q, q, sinks=[0.0] * 4)
    np = pytest.importorskip("numpy")
    qn = q.numpy()
    out = fattn.attention(qn, qn, qn, sinks=np.zeros(4, dtype=np.float32))
    ref, _ = sink_attention(q, q, q, torch.zeros(4), False)
    assert abs(out - ref.numpy()).max() < 1e-5


@pytest.mark.parametrize("device,variant", targets())
def test_sinks_nan_and_minus_inf(device, variant, seed, request):
    """A NaN sink poisons its head's rows and nothing else: LSE' NaN on every row, O' NaN on every row that sees a key
    (rows that see none keep O' = 0, the rule for empty rows); a sink of -inf is no sink (the plain call's out and
    LSE).  v3's epilogue orders the row's LSE and the sink by a comparison, like the pass, so neither drops the NaN."""
    require(device)
    for dt in dtypes_for(device):
        q = randn((2, 4, 113, 64), dt, device, seed, 2.0)
        k, v = (randn((2, 2, 97, 64), dt, device, seed + i) for i in (1, 2))
        sinks = torch.tensor([0.5, float("nan"), float("-inf"), 2.0], device=device)
        out, lse = fattn.attention(q, k, v, causal="bottom_right", sinks=sinks, return_lse=True, variant=variant)
        plain, plain_lse = fattn.attention(q, k, v, causal="bottom_right", return_lse=True, variant=variant)
        ref, ref_lse = sink_attention(q, k, v, sinks, "bottom_right")
        empty = 113 - 97  # bottom-right causal: rows 0 .. 15 see no key
        assert torch.isnan(lse[:, 1]).all() and torch.isnan(out[:, 1, empty:]).all(), f"{dt}: NaN sink. {repro(request)}"
        assert torch.count_nonzero(out[:, 1, :empty]).item() == 0, f"{dt}: NaN sink, empty rows. {repro(request)}"
        assert not torch.isnan(out[:, [0, 2, 3]]).any(), f"{dt}: NaN outside the NaN sink's head. {repro(request)}"
        assert torch.equal(out[:, 2], plain[:, 2]), f"{dt}: a -inf sink changed out. {repro(request)}"
        assert torch.equal(lse[:, 2], plain_lse[:, 2]), f"{dt}: a -inf sink changed LSE. {repro(request)}"
        low, _ = sink_attention(q, k, v, sinks, "bottom_right", dtype=dt)
        heads = [0, 3]
        check("out", out[:, heads], ref[:, heads], low[:, heads], dt, 2.0, request)
        low_lse = sink_attention(q, k, v, sinks, "bottom_right", dtype=torch.float32)[1]
        why = accuracy.check_lse(lse[:, heads], ref_lse[:, heads], low_lse[:, heads])
        assert why is None, f"{dt}: {why}. {repro(request)}"
        # dsinks: NaN for the NaN sink; 0 for the -inf one, its rows that see no key included (LSE' = -inf there)
        dout = randn(tuple(q.shape), dt, device, seed + 5)
        ds = fattn.attention_backward(dout, q, k, v, out, lse, causal="bottom_right", sinks=sinks, variant=variant)[3]
        assert torch.isnan(ds[1]) and ds[2].item() == 0.0 and torch.isfinite(ds[heads]).all(), \
            f"{dt}: dsinks {ds}. {repro(request)}"


def test_sinks_forward_binding():
    """_C.forward applies the sinks itself (a kernel's epilogue, or the sinks pass after it): lse is required with
    them, and out / lse come back as attention(..., sinks=) gives them."""
    q, k, v = (torch.randn(1, 4, 9, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = torch.empty_like(q)
    with pytest.raises(TypeError, match=r"lse: needed with sinks"):
        fattn._C.forward(q, k, v, out, sinks=sinks)
    lse = torch.empty(1, 4, 9)
    fattn._C.forward(q, k, v, out, lse, causal=1, sinks=sinks)
    want, want_lse = sink_attention(q, k, v, sinks, "top_left")
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - want_lse).abs().max().item() < 1e-5


def test_sinks_no_grad_and_requires_grad_sinks():
    """Sinks that require grad under torch.no_grad (the lean path) and through autograd alone (q, k, v plain)."""
    q = torch.randn(1, 2, 5, 16)
    s = torch.zeros(2, requires_grad=True)
    with torch.no_grad():
        a = fattn.attention(q, q, q, sinks=s)
    b = fattn.attention(q, q, q, sinks=s)
    b.sum().backward()
    assert torch.allclose(a, b.detach()) and s.grad is not None and s.grad.shape == (2,)


def _pass_after(q, k, v, sinks, **kw):
    """v3's plain call with the sinks pass after it: (out, lse), the result the epilogue must match."""
    out, lse = fattn.attention(q, k, v, return_lse=True, variant="v3", **kw)
    fattn._C.sinks(out, lse, sinks, stream=torch.cuda.current_stream().cuda_stream or 1)
    return out, lse


def _same(got, want, dt, what, request):
    (out, lse), (want_out, want_lse) = got, want
    assert (lse - want_lse).abs().max().item() <= 1e-4, f"{dt} {what}: LSE. {repro(request)}"
    tol = (2e-3 if dt == torch.float16 else 1.6e-2) * max(1.0, want_out.float().abs().max().item())
    err = (out.float() - want_out.float()).abs().max().item()
    assert err <= tol, f"{dt} {what}: out differs by {err}. {repro(request)}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "bottom_right", "window", "softcap_alibi"])
def test_sinks_v3_epilogue_matches_pass(d, mask, seed, request):
    """v3 applies the sinks in its epilogue (fattn_plan.sinks_fused): the same out and LSE as v3's plain call with the
    sinks pass (csrc/sinks.h) run after it, within rounding -- fp16 and bf16, GQA; bottom-right causal with Sq > Sk
    has rows that see no key (LSE' = the sink, O' = 0); the score-modifying kernels keep the row max in log2 units."""
    require("cuda")
    kw = {"none": {}, "bottom_right": {"causal": "bottom_right"}, "window": {"window": (64, 0)},
          "softcap_alibi": {"softcap": 30.0,
                            "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")}}[mask]
    for dt in (torch.float16, torch.bfloat16):
        q = randn((2, 4, 301, d), dt, "cuda", seed, 2.0)
        k, v = (randn((2, 2, 277, d), dt, "cuda", seed + i) for i in (1, 2))
        sinks = randn((4,), torch.float32, "cuda", seed + 3, 3.0)
        plan = fattn._C._dev.plan(q, k, v, torch.empty_like(q), variant="v3",
                                  **{**kw, "causal": 2 if "causal" in kw else 0})
        assert plan["variant"] == "v3", f"v3 did not plan this call: {plan}"
        got = fattn.attention(q, k, v, sinks=sinks, return_lse=True, variant="v3", **kw)
        _same(got, _pass_after(q, k, v, sinks, **kw), dt, mask, request)
        if mask == "bottom_right":  # rows 0 .. Sq - Sk - 1 see no key
            empty = slice(0, 301 - 277)
            assert (got[1][:, :, empty] - sinks[None, :, None]).abs().max().item() <= 1e-5, f"{dt}: LSE' = s"
            assert torch.count_nonzero(got[0][:, :, empty]).item() == 0, f"{dt}: O' = 0 where no key is seen"


@pytest.mark.gpu
def test_sinks_v3_epilogue_split_tails_and_packed(seed, request):
    """The sinks on v3's other epilogue paths: split tails (a head's last <= 64 rows over three consumers, merged by
    consumer 0; forced with splits=3 on D=64's default config) and packed sequences (their last rows stored by each
    thread, LSE at the sequence's offset), against the plain call with the pass."""
    require("cuda")
    stream = torch.cuda.current_stream().cuda_stream or 1
    for dt in (torch.float16, torch.bfloat16):
        q = randn((2, 4, 424, 64), dt, "cuda", seed, 2.0)  # 424 = 2 x 192 + 40: a 40-row tail
        k, v = (randn((2, 4, 424, 64), dt, "cuda", seed + i) for i in (1, 2))
        sinks = randn((4,), torch.float32, "cuda", seed + 3, 3.0)
        out, lse = torch.empty_like(q), torch.empty(2, 4, 424, device="cuda")
        plan = fattn._C._dev.forward(q, k, v, out, lse, sinks=sinks, variant="v3", config=0, splits=3, stream=stream)
        assert plan["variant"] == "v3" and plan["splits"] == 3, f"not the split-tail plan: {plan}"
        want_out, want_lse = torch.empty_like(q), torch.empty(2, 4, 424, device="cuda")
        fattn._C._dev.forward(q, k, v, want_out, want_lse, variant="v3", config=0, splits=3, stream=stream)
        fattn._C.sinks(want_out, want_lse, sinks, stream=stream)
        _same((out, lse), (want_out, want_lse), dt, "split tails", request)
        cu = torch.tensor([0, 5, 5, 150, 301], dtype=torch.int32, device="cuda")
        qp, kp, vp = (randn((301, 4, 64), dt, "cuda", seed + 10 + i) for i in range(3))
        got = fattn.attention_varlen(qp, kp, vp, cu, cu, causal="bottom_right", sinks=sinks, return_lse=True,
                                     variant="v3")
        want = fattn.attention_varlen(qp, kp, vp, cu, cu, causal="bottom_right", return_lse=True, variant="v3")
        fattn._C.sinks(want[0], want[1], sinks, stream=stream)
        _same(got, want, dt, "packed", request)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [4, 16])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("h_kv", [8, 2])
def test_sinks_v2_split_merge_matches_pass(splits, softcap, h_kv, seed, request):
    """v2 joins the sinks where it merges its key splits (in the kernel, or v2_combine for the score-modifying
    kernels): the same out and LSE as the split call without sinks and the sinks pass after it -- decode rows, with
    GQA packing (the group's query heads as one head's rows: each row its own sink) and without."""
    require("cuda")
    stream = torch.cuda.current_stream().cuda_stream or 1
    for dt in (torch.float16, torch.bfloat16):
        q = randn((3, 8, 1, 128), dt, "cuda", seed, 2.0)
        k, v = (randn((3, h_kv, 2000, 128), dt, "cuda", seed + i) for i in (1, 2))
        sinks = randn((8,), torch.float32, "cuda", seed + 3, 3.0)
        out, lse = torch.empty_like(q), torch.empty(3, 8, 1, device="cuda")
        kw = dict(variant="v2", splits=splits, softcap=softcap, stream=stream, causal=2)
        plan = fattn._C._dev.forward(q, k, v, out, lse, sinks=sinks, **kw)
        assert plan["variant"] == "v2" and plan["splits"] > 1, f"not a split v2 call: {plan}"
        want_out, want_lse = torch.empty_like(q), torch.empty(3, 8, 1, device="cuda")
        fattn._C._dev.forward(q, k, v, want_out, want_lse, **kw)
        fattn._C.sinks(want_out, want_lse, sinks, stream=stream)
        _same((out, lse), (want_out, want_lse), dt, f"v2 splits={splits}", request)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h_kv", [8, 2])
def test_sinks_v2_unsplit_decode_matches_pass(d, h_kv, seed, request):
    """v2's decode kernels join the sinks in an unsplit call as the key that starts each row's softmax
    (V2_SINKS_AT_START, fattn_plan.sinks_fused): the plain call with the sinks pass after it, within rounding -- one
    query row with and without GQA packing, and eight rows on five keys (bottom-right causal: rows 0 .. 2 see none,
    O' = 0 and LSE' = the sink there).  A NaN sink makes its head's LSE NaN, and O NaN on the rows that see a key (0
    on the others); a sink of -inf is no sink (the plain call's out and LSE, bitwise)."""
    require("cuda")
    stream = torch.cuda.current_stream().cuda_stream or 1
    for dt in (torch.float16, torch.bfloat16):
        for n, (sq, sk) in enumerate(((1, 3000), (8, 5))):
            q = randn((3, 8, sq, d), dt, "cuda", seed + n, 2.0)
            k, v = (randn((3, h_kv, sk, d), dt, "cuda", seed + n + i) for i in (1, 2))
            sinks = randn((8,), torch.float32, "cuda", seed + 3, 3.0)
            sinks[5], sinks[6] = float("nan"), float("-inf")
            out, lse = torch.empty_like(q), torch.empty(3, 8, sq, device="cuda")
            kw = dict(variant="v2", splits=1, stream=stream, causal=2)
            plan = fattn._C._dev.forward(q, k, v, out, lse, sinks=sinks, **kw)
            assert (plan["variant"], plan["splits"], plan["sinks_fused"]) == ("v2", 1, 1), plan
            plain, plain_lse = torch.empty_like(q), torch.empty(3, 8, sq, device="cuda")
            fattn._C._dev.forward(q, k, v, plain, plain_lse, **kw)
            assert torch.equal(out[:, 6], plain[:, 6]) and torch.equal(lse[:, 6], plain_lse[:, 6]), \
                f"{dt} sq={sq}: a -inf sink changed the call. {repro(request)}"
            empty = max(sq - sk, 0)
            assert torch.isnan(lse[:, 5]).all() and torch.isnan(out[:, 5, empty:]).all(), \
                f"{dt} sq={sq}: NaN sink. {repro(request)}"
            assert torch.count_nonzero(out[:, 5, :empty]).item() == 0, f"{dt}: NaN sink, empty rows. {repro(request)}"
            want_out, want_lse = plain.clone(), plain_lse.clone()
            fattn._C.sinks(want_out, want_lse, sinks, stream=stream)
            heads = [0, 1, 2, 3, 4, 7]
            _same((out[:, heads], lse[:, heads]), (want_out[:, heads], want_lse[:, heads]), dt,
                  f"v2 unsplit sq={sq}", request)
            if empty:
                assert torch.count_nonzero(out[:, heads, :empty]).item() == 0, f"{dt}: empty rows. {repro(request)}"


def test_sinks_backward_binding():
    """_C.backward takes sinks and dsinks together (dsinks written: csrc/sinks.h's gradient, the pass's on the CPU);
    one without the other is refused, naming them."""
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 4, 9, 16, generator=g) for _ in range(4))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = fattn.attention(q, k, v, sinks=sinks, return_lse=True)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    with pytest.raises(TypeError, match=r"dsinks: sinks and dsinks go together"):
        fattn._C.backward(dout, q, k, v, out, lse, *grads, sinks=sinks)
    dsinks, want = torch.full((4,), float("nan")), torch.empty(4)
    fattn._C.backward(dout, q, k, v, out, lse, *grads, sinks=sinks, dsinks=dsinks)
    fattn._C.sinks(out, lse, sinks, dout=dout, dsinks=want)
    assert torch.equal(dsinks, want)
    with pytest.raises(ValueError, match=r"dsinks: expected a 1-D array of H=4 entries"):
        fattn._C.backward(dout, q, k, v, out, lse, *grads, sinks=sinks, dsinks=torch.empty(3))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_sinks_dsinks_from_workspace(variant, d, seed, request):
    """The tensor-core backwards give dsinks from the D and LSE2 their prep left in the workspace
    (fattn_plan.sinks_fused): equal, within float32 summation order, to the sinks pass's dsinks from dO and O' --
    GQA, bottom-right causal with Sq > Sk (rows that see no key: LSE' = s, D = 0), a packed batch; bitwise
    repeatable in deterministic mode."""
    require("cuda")
    stream = torch.cuda.current_stream().cuda_stream or 1
    for dt in (torch.float16, torch.bfloat16):
        q, dout = (randn((2, 4, 301, d), dt, "cuda", seed + i, 2.0) for i in (0, 4))
        k, v = (randn((2, 2, 277, d), dt, "cuda", seed + i) for i in (1, 2))
        sinks = randn((4,), torch.float32, "cuda", seed + 3, 3.0)
        out, lse = fattn.attention(q, k, v, causal="bottom_right", sinks=sinks, return_lse=True)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        plan = fattn._C._dev.backward(dout, q, k, v, out, lse, *grads, causal=2, variant=variant, stream=stream,
                                      sinks=sinks, dsinks=torch.empty_like(sinks))
        assert plan["variant"] == variant and plan["sinks_fused"] == 1, f"not {variant}'s own dsinks: {plan}"
        want = torch.empty_like(sinks)
        fattn._C.sinks(out, lse, sinks, dout=dout, dsinks=want, stream=stream)
        runs = [fattn.attention_backward(dout, q, k, v, out, lse, causal="bottom_right", sinks=sinks,
                                         variant=variant, deterministic=True)[3] for _ in range(2)]
        assert torch.equal(runs[0], runs[1]), f"{dt}: dsinks not repeatable. {repro(request)}"
        tol = 1e-4 * max(1.0, want.abs().max().item())
        assert (runs[0] - want).abs().max().item() <= tol, f"{dt}: {runs[0]} vs the pass's {want}. {repro(request)}"
        cu = torch.tensor([0, 5, 5, 150, 301], dtype=torch.int32, device="cuda")
        qp, kp, vp, dop = (randn((301, 4, d), dt, "cuda", seed + 10 + i) for i in range(4))
        po, pl = fattn.attention_varlen(qp, kp, vp, cu, cu, causal="bottom_right", sinks=sinks, return_lse=True)
        got = fattn.attention_varlen_backward(dop, qp, kp, vp, po, pl, cu, cu, causal="bottom_right", sinks=sinks,
                                              variant=variant)[3]
        want = torch.empty_like(sinks)
        fattn._C.sinks(po, pl, sinks, dout=dop, dsinks=want, stream=stream)
        tol = 1e-4 * max(1.0, want.abs().max().item())
        assert (got - want).abs().max().item() <= tol, f"{dt} packed: {got} vs the pass's {want}. {repro(request)}"
