"""A small sweep of every GPU variant for compute-sanitizer: odd sequence lengths, Sq != Sk both ways, both
causal alignments, sliding windows, GQA, decode with split-KV, head dims 64/128/136/256, fp16/bf16 (fp32 for the
scalar variants); and each variant's backward (FATTN_SANITIZE_BACKWARD=0 skips it; v2's also deterministic).

    compute-sanitizer --tool memcheck python3 bench/sanitize_sweep.py
    FATTN_SANITIZE_VARIANTS=v3 ...   # only the variants named
    FATTN_SANITIZE_QUICK=1 ...       # fp16, head dims 64 / 128, two odd cases, no causal top-left, one window
                                     # (racecheck on the Hopper kernels is slow: the quick sweep fits a GPU call)
    FATTN_SANITIZE_DIMS=256 ...      # only these head dims (comma-separated), quick or not
    FATTN_SANITIZE_CASES=600x1100 ...  # these (Sq, Sk) instead (comma-separated): 600 x 1100 at D=256 runs the
                                     # deterministic backward's chunks of key blocks, staggered
A last call per head dim has more query tiles (2 x 80 heads x 300 rows) and key blocks than an H100 has
multiprocessors, so v3's persistent forward walks several tiles per block, and the backward runs several waves (at
D=128 with zero-ahead: its dK/dV kernel zeroes the later (batch, kv head) groups' dQ sums, kernels/sm90/v3_bwd.cu).
v2 and v3 also run per-sequence calls: a packed batch (lengths 0, 17, 300, 1; v3's dynamic schedule) and chunked
prefill over a KV cache, contiguous and paged (pages of 16, 48, 64, 128 in shuffled order; 100 new queries and keys
appended to sequences of 0, 70 and 260 cached keys).
Exits non-zero if any result is NaN where it must not be (the sanitizer's own report is what this is for)."""
import os
import sys

import torch

import fattn
from fattn._api import CAUSAL

CASES = [(1, 1), (17, 113), (130, 65), (1, 700)]  # (1, 700): decode, split-KV (v2: merged in its kernel)


def sweep_backward(q, k, o, lse, causal, window, variant):
    """The backward of one case (k doubles as v), default and deterministic: 1 if a gradient has a NaN."""
    stream = torch.cuda.current_stream().cuda_stream or 1
    bad = 0
    for det in (False, True) if variant in ("v2", "v3") else (False,):
        g = [torch.empty_like(x) for x in (q, k, k)]
        fattn._C.backward(o, q, k, k, o, lse, *g, causal=CAUSAL[causal], window=window, variant=variant,
                          stream=stream, deterministic=det)
        bad += int(any(torch.isnan(x).any().item() for x in g))
    return bad


def sweep_sequences(variant, d, dt):
    """Per-sequence calls of one head dim: a packed batch, then chunked prefill over contiguous and paged caches;
    1 if a result has a NaN."""
    lens = [0, 17, 300, 1]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 4, d, device="cuda", dtype=dt)
    k = torch.randn(sum(lens), 2, d, device="cuda", dtype=dt)
    bad = 0
    for causal in (False, True):
        o = fattn.attention_varlen(q, k, k, cu, cu, causal=causal, variant=variant)
        bad += int(torch.isnan(o).any().item())
    cached, s_new, cap = [0, 70, 260], 100, 384
    b = len(cached)
    qn = torch.randn(b, s_new, 4, d, device="cuda", dtype=dt)
    kn = torch.randn(b, s_new, 2, d, device="cuda", dtype=dt)
    for page in (None, 16, 48, 64, 128):
        table = None
        if page is None:
            kc, vc = (torch.randn(b, cap, 2, d, device="cuda", dtype=dt) for _ in range(2))
        else:
            per = cap // page
            kc, vc = (torch.randn(b * per + 1, page, 2, d, device="cuda", dtype=dt) for _ in range(2))
            table = torch.randperm(b * per, device="cuda").reshape(b, per).to(torch.int32)
        lens_c = torch.tensor(cached, dtype=torch.int32, device="cuda")
        o = fattn.attention_with_kvcache(qn, kc, vc, k_new=kn, v_new=kn, cache_seqlens=lens_c, block_table=table,
                                         variant=variant)
        bad += int(torch.isnan(o).any().item())
    return bad


def main():
    bad = 0
    backward = os.environ.get("FATTN_SANITIZE_BACKWARD", "1") != "0"
    chosen = os.environ.get("FATTN_SANITIZE_VARIANTS")  # e.g. "v3": a subset, comma-separated
    quick = os.environ.get("FATTN_SANITIZE_QUICK") == "1"
    dims = os.environ.get("FATTN_SANITIZE_DIMS")
    dims = [int(x) for x in dims.split(",")] if dims else [64, 128] if quick else [64, 128, 136, 256]
    cases = os.environ.get("FATTN_SANITIZE_CASES")
    cases = [tuple(int(n) for n in c.split("x")) for c in cases.split(",")] if cases else CASES[1:3] if quick else CASES
    for variant in chosen.split(",") if chosen else fattn.variants("cuda"):
        dtypes = [torch.float16, torch.bfloat16] + ([torch.float32] if variant in ("v0", "v1") else [])
        for dt in dtypes[:1] if quick else dtypes:
            for d in dims:
                for sq, sk in cases:
                    for causal in (False, "bottom_right") if quick else (False, "top_left", "bottom_right"):
                        q = torch.randn(1, 4, sq, d, device="cuda", dtype=dt)
                        k = torch.randn(1, 2, sk, d, device="cuda", dtype=dt)
                        o, lse = fattn.attention(q, k, k, causal=causal, variant=variant, return_lse=True)
                        bad += int(torch.isnan(o).any().item())
                        if backward:
                            bad += sweep_backward(q, k, o, lse, causal, None, variant)
                        for window in ((40, -1),) if quick else ((5, 3), (40, -1)):  # the mask's window (dev hook)
                            fattn._C._dev.forward(q, k, k, o, lse, causal=CAUSAL[causal], window=window,
                                                  variant=variant, stream=torch.cuda.current_stream().cuda_stream or 1)
                            bad += int(torch.isnan(o).any().item())
                            if backward:
                                bad += sweep_backward(q, k, o, lse, causal, window, variant)
            for d in dims:  # more tiles and key blocks than SMs: several per SM
                q = torch.randn(2, 80, 300, d, device="cuda", dtype=dt)
                for causal in (False, "bottom_right"):
                    o, lse = fattn.attention(q, q, q, causal=causal, variant=variant, return_lse=True)
                    bad += int(torch.isnan(o).any().item())
                    if backward:
                        bad += sweep_backward(q, q, o, lse, causal, None, variant)
            if variant in ("v2", "v3"):
                for d in dims:
                    bad += sweep_sequences(variant, d, dt)
        print(f"{variant}: swept", flush=True)
    torch.cuda.synchronize()
    print("sweep done, NaN results:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
