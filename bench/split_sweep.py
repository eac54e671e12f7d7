"""Split-KV sweep for decode: v2 with the key sequence forced into 1, 2, 3, ... splits, and the automatic choice,
beside torch's flash and cudnn in the same run.  Judged in TB/s of K+V read (CUDA events, L2 flushed, median).
Every count is gated for correctness first.  The result picks the heuristic's constants in kernels/v2_mma.cu.

    python3 bench/split_sweep.py --json OUT.json
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import check_close  # noqa: E402

import fattn  # noqa: E402
from fattn.bench import collect_meta, time_cuda  # noqa: E402

SHAPES = [(8, 32, 2048), (8, 32, 8192), (8, 32, 32768), (1, 32, 8192), (1, 8, 32768), (2, 16, 4096)]
SPLITS = [0, 1, 2, 3, 4, 6, 8, 16, 32]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    print(f"{'B':>2} {'H':>3} {'Sk':>6}  " + " ".join(f"{('auto' if s == 0 else s):>6}" for s in SPLITS)
          + "   flash  cudnn   (TB/s of K+V; auto's split count in brackets)")
    for b, h, sk in SHAPES:
        q = torch.randn(b, h, 1, 128, device="cuda", dtype=torch.float16)
        k = torch.randn(b, h, sk, 128, device="cuda", dtype=torch.float16)
        v = torch.randn(b, h, sk, 128, device="cuda", dtype=torch.float16)
        nbytes = 2 * k.numel() * k.element_size()
        cells, auto_n = [], None
        for n in SPLITS:
            old = fattn._C.v2_set_splits(n)
            try:
                o = fattn.attention(q, k, v, variant="v2")
                used = fattn._C.v2_last_splits()
                try:
                    check_close(o, q, k, v, False, None)
                except AssertionError as e:
                    rows.append(dict(B=b, H=h, Sk=sk, splits=n, used=used, status="wrong", error=str(e)))
                    cells.append("WRONG")
                    continue
                p50, p90 = time_cuda(lambda: fattn.attention(q, k, v, variant="v2"), args.reps, 3, flush)
            finally:
                fattn._C.v2_set_splits(old)
            if n == 0:
                auto_n = used
            rows.append(dict(B=b, H=h, Sk=sk, splits=n, used=used, status="ok", p50_us=p50, p90_us=p90,
                             tbps=nbytes / p50 / 1e6))
            cells.append(f"{nbytes / p50 / 1e6:6.2f}")
        ref = {}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel([be]):
                p50, _ = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v), args.reps, 3, flush)
            ref[name] = p50
            rows.append(dict(B=b, H=h, Sk=sk, impl=name, p50_us=p50, tbps=nbytes / p50 / 1e6))
        print(f"{b:>2} {h:>3} {sk:>6}  " + " ".join(f"{c:>6}" for c in cells)
              + f"  {nbytes / ref['flash'] / 1e6:6.2f} {nbytes / ref['cudnn'] / 1e6:6.2f}   [auto={auto_n}]", flush=True)
    if args.json:
        meta = collect_meta("cuda", command="bench/split_sweep.py")
        json.dump({"meta": meta, "rows": rows}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
