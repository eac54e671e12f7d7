"""smoke.py -- a fast first look at one GPU variant before the full suite: a handful of shapes against torch SDPA in
float32, each with its max error and pass/fail under the tests' rule, then one timing per fa3 head dim.

    timeout 120 python3 bench/smoke.py --variant v3

Exit status 1 when any shape fails, so a caller can stop before spending minutes on tests and grids.  It is a
quick look only: the parity suite (tests/) is what says a variant is correct.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

import fattn

SHAPES = [  # (B, H, H_kv, Sq, Sk, D, causal)
    (1, 2, 2, 128, 128, 128, False),
    (2, 4, 4, 1025, 1025, 128, False),
    (2, 4, 2, 113, 300, 64, "bottom_right"),
    (1, 3, 3, 300, 113, 64, "top_left"),
    (1, 2, 1, 257, 257, 256, True),
    (1, 2, 2, 17, 1000, 96, False),
    (1, 2, 2, 1, 1, 128, False),
]


def reference(q, k, v, causal):
    h, hk = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(h // hk, dim=1)
    v = v.float().repeat_interleave(h // hk, dim=1)
    mask = None
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        off = sk - sq if causal == "bottom_right" else 0
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + off
    o = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)
    return torch.nan_to_num(o)  # fully masked rows: SDPA gives NaN, fattn 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="v3")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = ap.parse_args()
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    bad = 0
    for B, H, HK, SQ, SK, D, causal in SHAPES:
        q = torch.randn(B, H, SQ, D, device="cuda", dtype=dt)
        k = torch.randn(B, HK, SK, D, device="cuda", dtype=dt)
        v = torch.randn(B, HK, SK, D, device="cuda", dtype=dt)
        o, lse = fattn.attention(q, k, v, causal=causal, variant=args.variant, return_lse=True)
        ref = reference(q, k, v, causal)
        low = torch.nan_to_num(reference(q.to(dt), k, v, causal).to(dt).float())
        err = (o.float() - ref).abs().max().item()
        tol = 2 * (low - ref).abs().max().item() + ref.abs().max().item() * (2**-10 if dt == torch.float16 else 2**-7)
        ok = err <= tol and torch.isfinite(o).all().item()
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} B={B} H={H}/{HK} Sq={SQ} Sk={SK} D={D} causal={causal}: max err {err:.3e} (tol {tol:.3e})",
              flush=True)
    for D in (64, 128, 256):
        S = 4096
        q = torch.randn(16384 // S, 2048 // D, S, D, device="cuda", dtype=dt)
        fn = lambda: fattn.attention(q, q, q, variant=args.variant)  # noqa: E731
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"time D={D} S={S}: {ms * 1e3:.0f} us, {4 * q.numel() * S / ms / 1e9:.0f} TFLOP/s (no L2 flush)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
