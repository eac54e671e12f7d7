"""Shared test helpers: devices/variants under test, inputs, and the accuracy gate of fattn.testing applied to torch
tensors.

The accuracy rule (../shared/TESTING.md, flash-attention's; fattn/testing/accuracy.py): with ref computed in float64
from the same low-precision inputs and out_lowp from torch SDPA in the inputs' own dtype,
    max|out - ref| <= 2 * max|out_lowp - ref| + eps.
"""
import math
import os
import zlib

import pytest

# Tests never read the user's tuned-config cache: each test that wants one points FATTN_TUNED_CACHE at its own.
os.environ["FATTN_TUNED_CACHE"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "no-tuned-cache.json")

torch = pytest.importorskip("torch")
import fattn  # noqa: E402
from fattn import _C  # noqa: E402
from fattn._api import CAUSAL  # noqa: E402
from fattn.testing import accuracy  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fattn.cuda_available()
# tests of the Hopper variant v3 (sm_90 only)
V3 = pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() != (9, 0), reason="v3 needs sm_90 (H100/H200)")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def gpu_variants():
    return fattn.variants("cuda") if HAS_CUDA else []


def variant_dtypes(variant):
    """dtype names a variant accepts (v2 and later: half precision only)."""
    return ["fp32", "fp16", "bf16"] if variant in ("cpu", "v0", "v1") else ["fp16", "bf16"]


SPLIT = "-split"
FORCED_SPLITS = 3


def targets():
    """(device, variant) pairs under test: the CPU backend always, every GPU variant when a GPU is present."""
    out = [pytest.param("cpu", "cpu", id="cpu")]
    # GPU params are always listed so that a GPU-less run reports them as skipped, never silently absent.
    names = gpu_variants() if HAS_CUDA else [row[0] for row in _C._dev.variant_table()]
    for name in names:
        out.append(pytest.param("cuda", name, id=f"cuda-{name}", marks=pytest.mark.gpu))
        if name == "v2":  # v2 with split-KV forced on: every parity test runs the split + combine path too
            out.append(pytest.param("cuda", name + SPLIT, id=f"cuda-{name}{SPLIT}", marks=pytest.mark.gpu))
    return out


def stream_for(t):
    return (torch.cuda.current_stream(t.device).cuda_stream or 1) if t.is_cuda else None


def dev_forward(q, k, v, *, causal=False, scale=None, layout="bhsd", window=None, variant=None, out=None,
                lse=None, **overrides):
    """fattn._C._dev.forward on torch tensors (out allocated here): (out, lse, the plan that ran).  overrides:
    config, splits, order."""
    out = torch.empty_like(q) if out is None else out
    _C._dev.forward(q, k, v, out, lse, causal=CAUSAL[causal], scale=scale, layout=fattn._api.LAYOUT[layout],
                    window=window, variant=variant, stream=stream_for(q), **overrides)
    plan = _C._dev.plan(q, k, v, out, lse, causal=CAUSAL[causal], scale=scale, layout=fattn._api.LAYOUT[layout],
                        window=window, variant=variant, stream=stream_for(q), **overrides)
    return out, lse, plan


def plan_of(q, k, v, causal=False, variant=None, out=None, **overrides):
    """The plan fattn would run for this call (fattn._C._dev.plan)."""
    out = torch.empty_like(q) if out is None else out
    return _C._dev.plan(q, k, v, out, causal=fattn._api.CAUSAL[causal], variant=variant, stream=stream_for(q),
                        **overrides)


def attention(q, k, v, variant=None, **kw):
    """fattn.attention under no_grad; a variant named "<v>-split" runs <v> with FORCED_SPLITS key splits."""
    with torch.no_grad():
        if variant and variant.endswith(SPLIT):
            want_lse = kw.pop("return_lse", False)
            layout = kw.get("layout", "bhsd")
            lse = None
            if want_lse:
                b, h, s = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
                lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
            out, lse, _ = dev_forward(q, k, v, variant=variant[: -len(SPLIT)], splits=FORCED_SPLITS, lse=lse, **kw)
            return (out, lse) if want_lse else out
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


def packed(lengths_q, lengths_k, h, hk, d, dt, device, seed, mag=1.0):
    """A packed batch: q (total_q, h, d), k / v (total_k, hk, d) and the int32 prefix sums cu_seqlens_q / _k."""
    from itertools import accumulate

    cq = torch.tensor([0] + list(accumulate(lengths_q)), dtype=torch.int32, device=device)
    ck = torch.tensor([0] + list(accumulate(lengths_k)), dtype=torch.int32, device=device)
    q = randn((int(cq[-1]), h, d), dt, device, seed, mag)
    k = randn((int(ck[-1]), hk, d), dt, device, seed + 1, mag)
    v = randn((int(ck[-1]), hk, d), dt, device, seed + 2)
    return q, k, v, cq, ck


def per_sequence(x, cu, b):
    """Sequence b of a packed (total, H, D) array as (1, H, S, D)."""
    return x[int(cu[b]):int(cu[b + 1])].transpose(0, 1).unsqueeze(0)


def replay_captured(fn, out):
    """fn() warmed up on a side stream, captured in a CUDA graph, then replayed into out (zeroed first): out."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out


def kernels_launched(fn):
    """The names of the CUDA kernels fn() launches (torch's profiler)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def repro(request):
    return f"reproduce: pytest '{request.node.nodeid}'" if request is not None else ""


def check_close(out, q, k, v, causal, scale, lse=None, request=None, window=None):
    """The accuracy gate (fattn.testing.accuracy) on out (B, H, Sq, D) and, if given, lse (B, H, Sq)."""
    why, err, err_low = accuracy.check_attention(out, q, k, v, causal, scale, lse, window)
    assert why is None, f"{why}. {repro(request)}"
    return err, err_low


@pytest.fixture
def seed(request):
    return seed_for(request.node.nodeid)


def pytest_report_header(config):
    return [f"fattn {fattn.__version__}: cuda_compiled={bool(_C.cuda_compiled)} cuda_usable={HAS_CUDA} "
            f"gpu_variants={gpu_variants()} torch={torch.__version__} pid={os.getpid()}"]
