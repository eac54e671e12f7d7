"""A small sweep of every GPU variant for compute-sanitizer: odd sequence lengths, Sq != Sk both ways, both
causal alignments, sliding windows, GQA, decode with split-KV, head dims 64/128/136/256, fp16/bf16 (fp32 for the
scalar variants).

    compute-sanitizer --tool memcheck python3 bench/sanitize_sweep.py
    FATTN_SANITIZE_VARIANTS=v3 ...   # only the variants named
Exits non-zero if any result is NaN where it must not be (the sanitizer's own report is what this is for)."""
import os
import sys

import torch

import fattn
from fattn._api import CAUSAL

CASES = [(1, 1), (17, 113), (130, 65), (1, 700)]  # (1, 700): decode, split-KV


def main():
    bad = 0
    chosen = os.environ.get("FATTN_SANITIZE_VARIANTS")  # e.g. "v3": a subset, comma-separated
    for variant in chosen.split(",") if chosen else fattn.variants("cuda"):
        dtypes = [torch.float16, torch.bfloat16] + ([torch.float32] if variant in ("v0", "v1") else [])
        for dt in dtypes:
            for d in (64, 128, 136, 256):
                for sq, sk in CASES:
                    for causal in (False, "top_left", "bottom_right"):
                        q = torch.randn(1, 4, sq, d, device="cuda", dtype=dt)
                        k = torch.randn(1, 2, sk, d, device="cuda", dtype=dt)
                        o, lse = fattn.attention(q, k, k, causal=causal, variant=variant, return_lse=True)
                        bad += int(torch.isnan(o).any().item())
                        for window in ((5, 3), (40, -1)):  # the mask block's window, through the dev hook
                            fattn._C._dev.forward(q, k, k, o, lse, causal=CAUSAL[causal], window=window,
                                                  variant=variant, stream=torch.cuda.current_stream().cuda_stream or 1)
                            bad += int(torch.isnan(o).any().item())
        print(f"{variant}: swept", flush=True)
    torch.cuda.synchronize()
    print("sweep done, NaN results:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
