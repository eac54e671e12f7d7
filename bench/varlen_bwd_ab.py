"""varlen_bwd_ab.py -- attention_varlen_backward of this tree against an older one (fattn_old, bench/old_tree.sh),
interleaved rounds in one process, CUDA events: us per call (check_indices=False, causal, fp16).

    python3 bench/varlen_bwd_ab.py --old DIR [--rounds 7] [--calls 50]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [(8, 512, 8, 64), (4, 2048, 16, 128), (16, 128, 8, 64)]  # (B, S, H, D), every sequence S long


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="folder holding the package fattn_old")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    sys.path.insert(0, a.old)
    import fattn
    import fattn_old

    print(torch.cuda.get_device_name())
    for b, s, h, d in SHAPES:
        total = b * s
        torch.manual_seed(0)
        q, k, v, g = (torch.randn(total, h, d, device="cuda", dtype=torch.float16) for _ in range(4))
        cu = torch.arange(0, total + 1, s, device="cuda", dtype=torch.int32)
        kw = dict(max_seqlen_q=s, max_seqlen_k=s, causal=True, check_indices=False)
        out, lse = fattn.attention_varlen(q, k, v, cu, cu, return_lse=True, **kw)
        res = {}
        for _ in range(a.rounds):
            for tag, mod in (("new", fattn), ("old", fattn_old)):
                for _ in range(5):
                    mod.attention_varlen_backward(g, q, k, v, out, lse, cu, cu, **kw)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(a.calls):
                    mod.attention_varlen_backward(g, q, k, v, out, lse, cu, cu, **kw)
                e1.record()
                torch.cuda.synchronize()
                res.setdefault(tag, []).append(e0.elapsed_time(e1) * 1e3 / a.calls)
        n, o = statistics.median(res["new"]), statistics.median(res["old"])
        print(f"B={b} S={s} H={h} D={d}: new {n:.1f} us, old {o:.1f} us, new/old {n / o:.3f}  "
              f"(new {min(res['new']):.1f}-{max(res['new']):.1f}, old {min(res['old']):.1f}-{max(res['old']):.1f})")


if __name__ == "__main__":
    main()
