"""Sweep of v3's compiled configurations (kernels/v3_configs.h) on fa3-grid points, beside torch cudnn and flash.

Every configuration is gated first (the tests' accuracy rule on odd shapes, both causal alignments, fp16 and bf16);
a wrong one is reported and never timed.  Survivors are timed through the C harness (fattn._C.time_forward: CUDA
events, L2 flushed, median), torch's backends with CUDA events and the same flush, all in this one process.

    python3 bench/v3_sweep.py --json OUT.json [--points 2048,16384]
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
from fattn import _C  # noqa: E402
from v2_sweep import time_us  # noqa: E402  (CUDA events around each call, L2 flushed, median)

CAUSAL = {False: 0, True: 1, "top_left": 1, "bottom_right": 2}


def stream():
    return torch.cuda.current_stream().cuda_stream or 1  # DLPack: 1 is the legacy default stream, 0 is reserved


def run(q, k, v, causal, idx, out=None, lse=None):
    out = torch.empty_like(q) if out is None else out
    _C.forward(q, k, v, out, lse, CAUSAL[causal], None, 0, "v3", stream(), idx)
    return out


def gate(idx, dp):
    for dt in (torch.float16, torch.bfloat16):
        for sq, sk, causal in [(113, 257, "bottom_right"), (257, 113, "top_left"), (300, 300, False), (65, 1030, True)]:
            q = torch.randn(2, 4, sq, dp, device="cuda", dtype=dt)
            k = torch.randn(2, 2, sk, dp, device="cuda", dtype=dt)
            v = torch.randn(2, 2, sk, dp, device="cuda", dtype=dt)
            lse = torch.empty(2, 4, sq, device="cuda", dtype=torch.float32)
            o = run(q, k, v, causal, idx, lse=lse)
            try:
                check_close(o, q, k, v, causal, None, lse=lse)
            except AssertionError as e:
                return f"{dt} {sq}x{sk} {causal}: {e}"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--points", default="2048,16384", help="sequence lengths of the fa3 grid to time")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    seqs = [int(x) for x in args.points.split(",")]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    configs = _C.v3_configs()
    rows, torch_us = [], {}
    for dp in (64, 128, 256):
        for s in seqs:
            b, h = 16384 // s, 2048 // dp
            q, k, v = (torch.randn(b, h, s, dp, device="cuda", dtype=torch.float16) for _ in range(3))
            for causal in (False, True):
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    with sdpa_kernel([be]):
                        torch_us[(dp, s, causal, name)] = time_us(
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flush, args.reps, 2)
    for idx, dp, bc, stages, cons, pp, default, *_ in configs:
        cfg = dict(index=idx, dp=dp, bc=bc, stages=stages, consumers=cons, pingpong=pp, default=default)
        err = gate(idx, dp)
        if err:
            rows.append(dict(cfg, status="wrong", error=err))
            print(f"config {cfg}: FAILED the gate: {err}", flush=True)
            continue
        for s in seqs:
            b, h = 16384 // s, 2048 // dp
            q, k, v = (torch.randn(b, h, s, dp, device="cuda", dtype=torch.float16) for _ in range(3))
            out = torch.empty_like(q)
            for causal in (False, True):
                p50, p90, _ = _C.time_forward(q, k, v, out, None, CAUSAL[causal], None, 0, "v3",
                                              stream(), idx, args.reps, 2, True)
                flops = 4 * b * h * s * s * dp / (2 if causal else 1)
                cu, fl = torch_us[(dp, s, causal, "cudnn")], torch_us[(dp, s, causal, "flash")]
                rows.append(dict(cfg, status="ok", S=s, causal=causal, us=p50, tflops=flops / p50 / 1e6,
                                 vs_cudnn=cu / p50, vs_flash=fl / p50, cudnn_tflops=flops / cu / 1e6))
        print(f"config {cfg}: timed", flush=True)

    print(f"\n{'idx':>3} {'D':>4} {'Bc':>4} {'st':>2} {'wg':>2} {'pp':>2}  " +
          "  ".join(f"S={s}{c:>3}" for s in seqs for c in ("", "/c")) + "   geo vs cudnn")
    for idx, dp, bc, stages, cons, pp, default, *_ in configs:
        rs = [r for r in rows if r["index"] == idx and r["status"] == "ok"]
        if not rs:
            print(f"{idx:>3} {dp:>4} {bc:>4} {stages:>2} {cons:>2} {pp:>2}  wrong")
            continue
        cells = "  ".join(f"{r['tflops']:4.0f}/{r['vs_cudnn']:.2f}" for r in rs)
        geo = math.exp(statistics.mean(math.log(r["vs_cudnn"]) for r in rs))
        print(f"{idx:>3} {dp:>4} {bc:>4} {stages:>2} {cons:>2} {pp:>2}  {cells}   {geo:.3f}" + ("  (default)" if default else ""))
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(), "git_sha": os.environ.get("FATTN_GIT_SHA")}
        json.dump({"meta": meta, "torch_us": {repr(k): v for k, v in torch_us.items()}, "rows": rows},
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
