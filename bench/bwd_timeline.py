"""Kernel timeline of one fattn backward call (torch's profiler): each kernel's start and end relative to the first
one's start, in us, and how long the last two overlapped -- whether convert runs beside the dK/dV kernel's last wave.

    python3 bench/bwd_timeline.py --shape 8,16,2048,128 [--causal] [--deterministic] [--variant v3] [--old DIR]

--old DIR: the same call through fattn_old, an older tree built by bench/old_tree.sh into DIR.
"""
import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--variant", default="v3")
    ap.add_argument("--old", help="import fattn_old from this directory instead of fattn")
    a = ap.parse_args()
    if a.old:
        sys.path.insert(0, a.old)
    fattn = importlib.import_module("fattn_old" if a.old else "fattn")
    b, h, s, d = map(int, a.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    out, lse = fattn.attention(q, k, v, causal=a.causal, return_lse=True)
    call = lambda: fattn.attention_backward(do, q, k, v, out, lse, causal=a.causal, variant=a.variant,  # noqa: E731
                                            deterministic=a.deterministic)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(1000000)  # the call's kernels queued behind this one, launched back to back
        call()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and
                 "sleep" not in e.name), key=lambda e: e.time_range.start)
    t0 = ev[0].time_range.start
    for e in ev:
        print(f"{e.time_range.start - t0:9.1f} {e.time_range.end - t0:9.1f}  {e.name[:90]}")
    if len(ev) >= 2:
        print(f"last two kernels overlap by {ev[-2].time_range.end - ev[-1].time_range.start:.1f} us; "
              f"the call took {ev[-1].time_range.end - t0:.1f} us")


if __name__ == "__main__":
    main()
