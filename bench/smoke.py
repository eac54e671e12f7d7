"""smoke.py -- a fast first look at one GPU variant before the full suite: a handful of shapes, each checked by the
accuracy rule (fattn.testing.accuracy: output and LSE against float64, or with --mode bwd the gradients by the 3x
rule), then one timing per fa3 head dim.

    timeout 120 python3 bench/smoke.py --variant v3
    timeout 120 python3 bench/smoke.py --variant v3 --mode bwd    # the variant's backward
    timeout 120 python3 bench/smoke.py --variant v3 --mode bwd --deterministic   # its deterministic mode

Exit status 1 when any shape fails, so a caller can stop before spending minutes on tests and grids.  It is a
quick look only: the parity suite (tests/) is what says a variant is correct.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fattn  # noqa: E402
from fattn.testing import accuracy, timer  # noqa: E402

SHAPES = [  # (B, H, H_kv, Sq, Sk, D, causal)
    (1, 2, 2, 128, 128, 128, False),
    (2, 4, 4, 1025, 1025, 128, False),
    (2, 4, 2, 113, 300, 64, "bottom_right"),
    (1, 3, 3, 300, 113, 64, "top_left"),
    (1, 2, 1, 257, 257, 256, True),
    (1, 2, 2, 17, 1000, 96, False),
    (1, 2, 2, 1, 1, 128, False),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="v3")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--mode", default="fwd", choices=["fwd", "bwd"])
    ap.add_argument("--deterministic", action="store_true", help="--mode bwd: the deterministic backward")
    args = ap.parse_args()
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    bad = 0
    for B, H, HK, SQ, SK, D, causal in SHAPES:
        q = torch.randn(B, H, SQ, D, device="cuda", dtype=dt)
        k = torch.randn(B, HK, SK, D, device="cuda", dtype=dt)
        v = torch.randn(B, HK, SK, D, device="cuda", dtype=dt)
        o, lse = fattn.attention(q, k, v, causal=causal, variant=args.variant, return_lse=True)
        if args.mode == "bwd":
            dout = torch.randn_like(o)
            g = fattn.attention_backward(dout, q, k, v, o, lse, causal=causal, variant=args.variant,
                                         deterministic=args.deterministic)
            why, stats = accuracy.check_gradients(g, q, k, v, dout, causal, None, None)
            err = err_low = max(e for e, _ in stats) if stats else float("nan")
        else:
            why, err, err_low = accuracy.check_attention(o, q, k, v, causal, None, lse=lse)
        if why is None:
            verdict = f"ok   max err {err:.3e} (torch in {args.dtype}: {err_low:.3e})"
        else:
            bad += 1
            verdict = f"FAIL {why}"
        print(f"{verdict}  B={B} H={H}/{HK} Sq={SQ} Sk={SK} D={D} causal={causal}", flush=True)
    for D in (64, 128, 256):
        S = 4096
        q = torch.randn(16384 // S, 2048 // D, S, D, device="cuda", dtype=dt)
        if args.mode == "bwd":  # 2.5x the forward's FLOPs
            o, lse = fattn.attention(q, q, q, variant=args.variant, return_lse=True)
            run = lambda: fattn.attention_backward(o, q, q, q, o, lse, variant=args.variant,  # noqa: E731
                                                   deterministic=args.deterministic)
            flops = 10 * q.numel() * S
        else:
            run, flops = lambda: fattn.attention(q, q, q, variant=args.variant), 4 * q.numel() * S
        us = timer.percentile(timer.cuda_batch(run, 20, 3, 10), 0.5)
        print(f"time {args.mode} D={D} S={S}: {us:.0f} us, {flops / us / 1e6:.0f} TFLOP/s (no L2 flush)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
