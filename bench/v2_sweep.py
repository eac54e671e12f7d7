"""Microbenchmark sweep of v2's compiled tile configurations (kernels/v2_configs.h), ranked Top-K per head dim.

Every configuration is first gated for correctness (the accuracy rule of tests/conftest.py on odd shapes, causal
both ways); a wrong one is recorded as failed and never timed.  The survivors are timed on fa3-grid points of
their head dim beside torch's flash and cudnn backends in the same run (CUDA events, L2 flushed, median).

    python3 bench/v2_sweep.py --json OUT.json
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import check_close  # noqa: E402

import fattn  # noqa: E402

POINTS = {64: [(8, 32, 2048), (2, 32, 8192)], 128: [(8, 16, 2048), (2, 16, 8192)], 256: [(8, 8, 2048), (2, 8, 8192)]}


def time_us(fn, flush, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)


def gate(d):
    """True if the active config for head dim d passes the accuracy rule on odd shapes."""
    for sq, sk, causal in [(113, 257, "bottom_right"), (257, 113, "top_left"), (130, 130, False), (1, 300, False)]:
        q = torch.randn(2, 4, sq, d, device="cuda", dtype=torch.float16)
        k = torch.randn(2, 2, sk, d, device="cuda", dtype=torch.float16)
        v = torch.randn(2, 2, sk, d, device="cuda", dtype=torch.float16)
        o, lse = fattn.attention(q, k, v, causal=causal, variant="v2", return_lse=True)
        try:
            check_close(o, q, k, v, causal, None, lse=lse)
        except AssertionError as e:
            return str(e)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    configs = fattn._C.v2_configs()
    defaults = {c[1]: c[0] for c in configs if c[6]}
    rows = []
    torch_us = {}
    for d, pts in POINTS.items():
        for (b, h, s) in pts:
            for causal in (False, True):
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel([be]):
                        torch_us[(d, b, h, s, causal, name)] = time_us(
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flush)
    for idx, dp, warps, mt, bc, stages, *_ in configs:
        fattn._C.v2_select(idx)
        cfg = dict(index=idx, dp=dp, warps=warps, mt=mt, bc=bc, stages=stages, default=defaults[dp] == idx)
        err = gate(dp)
        if err:
            rows.append(dict(cfg, status="wrong", error=err))
            print(f"config {idx} {cfg}: FAILED the accuracy gate: {err}", flush=True)
            continue
        for (b, h, s) in POINTS[dp]:
            for causal in (False, True):
                q, k, v = (torch.randn(b, h, s, dp, device="cuda", dtype=torch.float16) for _ in range(3))
                us = time_us(lambda: fattn.attention(q, k, v, causal=causal, variant="v2"), flush)
                flops = 4 * b * h * s * s * dp / (2 if causal else 1)
                fl, cu = torch_us[(dp, b, h, s, causal, "flash")], torch_us[(dp, b, h, s, causal, "cudnn")]
                rows.append(dict(cfg, status="ok", B=b, H=h, S=s, causal=causal, us=us, tflops=flops / us / 1e6,
                                 vs_flash=fl / us, vs_cudnn=cu / us))
        fattn._C.v2_select(defaults[dp])
        print(f"config {idx} {cfg}: timed", flush=True)

    print(f"\n{'D':>4} {'idx':>3} {'warps':>5} {'mt':>2} {'bc':>4} {'st':>2}  geo-mean TFLOP/s  vs flash  vs cudnn")
    for d in POINTS:
        ranked = []
        for c in configs:
            rs = [r for r in rows if r["index"] == c[0] and r["status"] == "ok"]
            if c[1] != d or not rs:
                continue
            gm = lambda key: math.exp(statistics.mean(math.log(r[key]) for r in rs))  # noqa: E731
            ranked.append((gm("tflops"), gm("vs_flash"), gm("vs_cudnn"), c))
        ranked.sort(key=lambda x: -x[0])
        for tf, vf, vc, c in ranked[: args.top]:
            print(f"{d:>4} {c[0]:>3} {c[2]:>5} {c[3]:>2} {c[4]:>4} {c[5]:>2}  {tf:16.1f}  {vf:8.2f}  {vc:8.2f}"
                  + ("  (default)" if c[6] else ""))
    if args.json:
        json.dump({"torch_us": {repr(k): v for k, v in torch_us.items()}, "rows": rows}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
