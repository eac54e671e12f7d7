"""Shared test helpers: devices/variants under test, inputs, the float64 reference and the accuracy gate.

The accuracy rule (../shared/TESTING.md, flash-attention's): with ref computed in float64 from the same
low-precision inputs and out_lowp from torch SDPA in the inputs' own dtype,
    max|out - ref| <= 2 * max|out_lowp - ref| + eps,
eps = one rounding step of the output dtype at max|ref| (fp16, bf16); for float32, whose output rounding is
below the arithmetic's, the typical rounding of a D-term dot product: u * sqrt(D) * max|ref|.
"""
import math
import os
import zlib

import pytest

# Tests never read the user's tuned-config cache: each test that wants one points FATTN_TUNED_CACHE at its own.
os.environ["FATTN_TUNED_CACHE"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "no-tuned-cache.json")

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import fattn  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fattn.cuda_available()
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# unit roundoff of each dtype's output (2^-p): one rounding step relative to the output's magnitude
ROUNDING = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def gpu_variants():
    return fattn.variants("cuda") if HAS_CUDA else []


def variant_dtypes(variant):
    """dtype names a variant accepts (v2 and later: half precision only)."""
    return ["fp32", "fp16", "bf16"] if variant in ("cpu", "v0", "v1") else ["fp16", "bf16"]


def targets():
    """(device, variant) pairs under test: the CPU backend always, every GPU variant when a GPU is present."""
    out = [pytest.param("cpu", "cpu", id="cpu")]
    # GPU params are always listed so that a GPU-less run reports them as skipped, never silently absent.
    names = gpu_variants() if HAS_CUDA else [name for name, _, _ in fattn._C.all_gpu_variants()] or ["v0"]
    for name in names:
        out.append(pytest.param("cuda", name, id=f"cuda-{name}", marks=pytest.mark.gpu))
        if name == "v2":  # v2 with split-KV forced on: every parity test runs the split + combine path too
            out.append(pytest.param("cuda", name + SPLIT, id=f"cuda-{name}{SPLIT}", marks=pytest.mark.gpu))
    return out


SPLIT = "-split"
FORCED_SPLITS = 3


def attention(q, k, v, variant=None, **kw):
    """fattn.attention under no_grad; a variant named "<v>-split" runs <v> with FORCED_SPLITS key splits."""
    with torch.no_grad():
        if variant and variant.endswith(SPLIT):
            old = fattn._C.v2_set_splits(FORCED_SPLITS)
            try:
                return fattn.attention(q, k, v, variant=variant[: -len(SPLIT)], **kw)
            finally:
                fattn._C.v2_set_splits(old)
        return fattn.attention(q, k, v, variant=variant, **kw)


def targets_with_dtypes(dtypes):
    """(device, variant, dtype) triples: every target with each of `dtypes` it accepts (v2 and later take half
    precision only; their refusal of float32 is tested in test_gpu.py)."""
    out = []
    for t in targets():
        device, variant = t.values
        for dt in dtypes:
            if dt in variant_dtypes(variant):
                out.append(pytest.param(device, variant, dt, id=f"{t.id}-{dt}", marks=t.marks))
    return out


def require(device):
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("no CUDA GPU usable by fattn here")


def seed_for(*key):
    return zlib.crc32(repr(key).encode()) & 0x7FFFFFFF


def randn(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype=dtype, device=device)


def causal_mask(sq, sk, causal, device):
    """Boolean (sq, sk) mask of visible keys, or None.  top_left: j <= i; bottom_right: j <= i + sk - sq."""
    if not causal:
        return None
    off = 0 if causal in (True, "top_left") else sk - sq
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + off


def sdpa(q, k, v, causal, scale, dtype=None):
    """torch SDPA in `dtype` (default: q's) with an explicit mask; (B, H, S, D) in, fully masked rows -> 0."""
    dtype = dtype or q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    h, hk = q.shape[1], k.shape[1]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    mask = causal_mask(q.shape[2], k.shape[2], causal, q.device)
    if k.shape[2] == 0:
        return torch.zeros_like(q)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is not None:
        dead = ~mask.any(dim=1)  # rows with no visible key
        out = out.masked_fill(dead[None, None, :, None], 0.0)
    return out


def reference_lse(q, k, causal, scale):
    q, k = q.double(), k.double()
    h, hk = q.shape[1], k.shape[1]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    mask = causal_mask(q.shape[2], k.shape[2], causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(s, dim=-1) if k.shape[2] else torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype)


def repro(request):
    return f"reproduce: pytest '{request.node.nodeid}'" if request is not None else ""


def check_close(out, q, k, v, causal, scale, lse=None, request=None):
    """The accuracy gate on out (B, H, Sq, D) and, if given, lse (B, H, Sq)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref = sdpa(q, k, v, causal, scale, dtype=torch.float64)
    low = sdpa(q, k, v, causal, scale)
    out64 = out.double()
    assert not torch.isnan(out64).any(), f"NaN in output. {repro(request)}"
    err = (out64 - ref).abs().max().item() if out.numel() else 0.0
    err_low = (low.double() - ref).abs().max().item() if out.numel() else 0.0
    eps = ROUNDING[q.dtype] * max(1.0, ref.abs().max().item() if out.numel() else 1.0)
    if q.dtype == torch.float32:
        eps *= math.sqrt(q.shape[-1])
    assert err <= 2 * err_low + eps, (
        f"max|out-ref| = {err:.3g} > 2 * max|out_lowp-ref| ({err_low:.3g}) + {eps:.3g}. {repro(request)}")
    if lse is not None:
        ref_lse = reference_lse(q, k, causal, scale)
        dead = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse.cpu()) & (lse.cpu() < 0), dead.cpu()), f"LSE -inf rows differ. {repro(request)}"
        live = ~dead
        if live.any():
            d = (lse.double()[live] - ref_lse[live]).abs()
            tol = 1e-4 + 2e-5 * ref_lse[live].abs()
            assert (d <= tol).all(), f"LSE error {d.max().item():.3g} over tolerance. {repro(request)}"
    return err, err_low


@pytest.fixture
def seed(request):
    return seed_for(request.node.nodeid)


def pytest_report_header(config):
    return [f"fattn {fattn.__version__}: cuda_compiled={bool(fattn._C.cuda_compiled)} cuda_usable={HAS_CUDA} "
            f"gpu_variants={gpu_variants()} torch={torch.__version__} pid={os.getpid()}"]
