"""The accuracy rule (flash-attention's): with ref computed in float64 from the same low-precision inputs and
out_lowp a plain implementation in the inputs' own dtype,

    max|out - ref| <= factor * max|out_lowp - ref| + eps,

factor 2 for outputs (3 for gradients), eps one rounding step of the output dtype at max|ref| -- for float32, whose
output rounding is below its arithmetic's, the typical rounding of a D-term dot product, u * sqrt(D) * max|ref|.
For gradients max|ref| is at least max|dP| (dP = dO V^T): dS = P (dP - D) cancels, so a gradient near zero carries
the rounding of terms of that size.  NaN never passes.
The LSE (float32 in every variant) against a plain float32 computation of it, lse_lowp (the scores and their
logsumexp in float32 from the same inputs): |lse - ref| <= LSE_FACTOR * max|lse_lowp - ref| + LSE_ULPS float32
rounding steps at max(1, |ref|), row by row (with a softcap c, plus c * TANH_APPROX: the GPU kernels' tanh.approx)
-- float32-level, so a constant slip of 1e-5 in a row's LSE fails.
"""
import math

ROUNDING = {"fp32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}  # unit roundoff 2^-p of each output dtype
LSE_FACTOR, LSE_ULPS = 4.0, 8.0  # the LSE's rule (the module's docstring)
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def dtype_name(dtype):
    """'fp32' / 'fp16' / 'bf16' from a torch or NumPy dtype or one of those names."""
    text = str(dtype).rsplit(".", 1)[-1]
    return DTYPE_NAMES.get(text, text)


def eps(dtype, ref_max, head_dim):
    e = ROUNDING[dtype_name(dtype)] * max(1.0, ref_max)
    return e * math.sqrt(head_dim) if dtype_name(dtype) == "fp32" else e


def bound(err_lowp, dtype, ref_max, head_dim, factor=2.0):
    """The largest error the rule allows."""
    return factor * err_lowp + eps(dtype, ref_max, head_dim)


def verdict(err, err_lowp, dtype, ref_max, head_dim, factor=2.0, what="out"):
    """None if err passes the rule, else the message saying by how much it fails."""
    limit = bound(err_lowp, dtype, ref_max, head_dim, factor)
    if err == err and err <= limit:  # err != err: NaN
        return None
    return (f"max|{what} - ref| = {err:.3g} > {factor:g} * max|{what}_lowp - ref| ({err_lowp:.3g}) + "
            f"{eps(dtype, ref_max, head_dim):.3g}")


def sdpa_lowp(q, k, v, causal=False, scale=None, window=None, softcap=0.0, alibi=None):
    """The plain same-dtype implementation for torch tensors: torch SDPA in q's dtype with reference.visible's mask
    (an explicit mask: torch's is_causal is top-left only) -- or, with a softcap or ALiBi, the same math written out
    in q's dtype; rows that see no key give 0."""
    import torch
    import torch.nn.functional as F

    from . import reference

    h, hk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if sk == 0:
        return torch.zeros_like(q)
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    mask = torch.from_numpy(reference.visible(sq, sk, causal, window)).to(q.device)
    if softcap or alibi is not None:
        s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if alibi is not None:
            s = s + torch.from_numpy(reference.alibi_bias(alibi, sq, sk)).to(q.device, q.dtype)
        s = s.masked_fill(~mask, -math.inf)
        out = torch.softmax(s.float(), -1).to(q.dtype).nan_to_num(0.0) @ v
    else:  # torch's math backend: its fused kernels are not "plain same-dtype math" (and some give NaN for scale <= 0)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.masked_fill(~mask.any(dim=1)[None, None, :, None], 0.0)


def lse_lowp(q, k, causal=False, scale=None, window=None, softcap=0.0, alibi=None):
    """The plain float32 LSE of torch tensors q (B, H, Sq, D), k (B, H_kv, Sk, D): the scores (softcap and ALiBi
    applied) and their logsumexp in float32 (-inf for rows that see no key) -- the baseline of the LSE's rule."""
    import torch

    from . import reference

    h, hk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if sk == 0:
        return torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    k32 = k.float().repeat_interleave(h // hk, dim=1) if hk != h else k.float()
    s = (q.float() @ k32.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s + torch.from_numpy(reference.alibi_bias(alibi, sq, sk)).to(q.device, torch.float32)
    mask = torch.from_numpy(reference.visible(sq, sk, causal, window)).to(q.device)
    return torch.logsumexp(s.masked_fill(~mask, -math.inf), dim=-1)


# tanh.approx.f32's largest relative error (PTX ISA), which the GPU kernels' softcap carries into each score: c tanh
# moves by at most softcap * TANH_APPROX, and the LSE with it
TANH_APPROX = 2.0 ** -10.987


def check_lse(lse, ref_lse, low_lse, softcap=0.0):
    """None if lse passes the LSE's rule against the float64 ref_lse, with low_lse the plain float32 baseline
    (lse_lowp, or another float32 computation of the same) -- with a softcap, plus softcap * TANH_APPROX; else the
    message saying what failed."""
    import torch

    lse, ref_lse, low_lse = lse.cpu(), ref_lse.cpu(), low_lse.cpu()
    dead = torch.isinf(ref_lse)
    if not torch.equal(torch.isinf(lse) & (lse < 0), dead):
        return "the rows with LSE -inf differ from the reference's (rows that see no key)"
    if not (~dead).any():
        return None
    ref = ref_lse[~dead]
    d = (lse.double()[~dead] - ref).abs()
    d_low = (low_lse.double()[~dead] - ref).abs().max().item()
    limit = LSE_FACTOR * d_low + LSE_ULPS * ROUNDING["fp32"] * ref.abs().clamp(min=1.0) + softcap * TANH_APPROX
    if not (d <= limit).all():  # (NaN fails)
        worst = int(torch.argmax(torch.nan_to_num(d / limit, nan=math.inf)))
        return (f"LSE error {d[worst].item():.3g} > {LSE_FACTOR:g} * max|lse_lowp - ref| ({d_low:.3g}) + "
                f"{LSE_ULPS:g} float32 rounding steps at |ref| = {ref[worst].abs().item():.3g}")
    return None


def check_attention(out, q, k, v, causal=False, scale=None, lse=None, window=None, softcap=0.0, alibi=None):
    """None if out (B, H, Sq, D) -- and lse (B, H, Sq) when given -- pass the rule for attention of torch tensors
    q, k, v, else the message saying what failed.  Returns (message, err, err_lowp)."""
    import torch

    from . import reference

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref, ref_lse = reference.attention(q, k, v, causal, scale, window, softcap=softcap, alibi=alibi)
    if torch.isnan(out).any():
        return "NaN in the output", float("nan"), None
    low = sdpa_lowp(q, k, v, causal, scale, window, softcap, alibi)
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    err_low = (low.double() - ref).abs().max().item() if out.numel() else 0.0
    ref_max = ref.abs().max().item() if out.numel() else 1.0
    why = verdict(err, err_low, dtype_name(q.dtype), ref_max, q.shape[-1])
    if why is None and lse is not None:
        why = check_lse(lse, ref_lse, lse_lowp(q, k, causal, scale, window, softcap, alibi), softcap)
    return why, err, err_low


def sdpa_lowp_gradients(q, k, v, dout, causal=False, scale=None, window=None, softcap=0.0, alibi=None):
    """(dq, dk, dv) of sdpa_lowp by torch autograd in the inputs' dtype (the plain same-dtype backward)."""
    import torch

    if q.shape[2] == 0 or k.shape[2] == 0:  # nothing attends: zero gradients
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    with torch.enable_grad():
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        out = sdpa_lowp(qs, ks, vs, causal, scale, window, softcap, alibi)
        return torch.autograd.grad(out, (qs, ks, vs), dout)


def check_gradients(grads, q, k, v, dout, causal=False, scale=None, window=None, softcap=0.0, alibi=None):
    """None if grads = (dq, dk, dv) of torch tensors pass the rule at 3x against the float64 reference, else the
    message saying which failed and by how much.  Returns (message, [(err, err_lowp) per gradient])."""
    import torch

    from . import reference

    refs = reference.gradients(q, k, v, dout, causal, scale, window, softcap, alibi)
    lows = sdpa_lowp_gradients(q, k, v, dout, causal, scale, window, softcap, alibi)
    rep = q.shape[1] // max(1, k.shape[1])
    dp_max = (dout.double() @ v.double().repeat_interleave(rep, 1).transpose(-1, -2)).abs().max().item() \
        if dout.numel() and v.numel() else 0.0
    stats, why = [], None
    for name, g, ref, low in zip(("dq", "dk", "dv"), grads, refs, lows):
        if g.numel() == 0:
            stats.append((0.0, 0.0))
            continue
        if torch.isnan(g).any():
            return f"NaN in {name}", stats
        err = (g.double() - ref).abs().max().item()
        err_low = (low.double() - ref).abs().max().item()
        stats.append((err, err_low))
        ref_max = max(ref.abs().max().item(), dp_max)
        why = why or verdict(err, err_low, dtype_name(q.dtype), ref_max, q.shape[-1], 3.0, name)
    return why, stats
