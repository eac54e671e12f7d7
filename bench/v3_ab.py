"""A/B of v3 configurations at a few shapes, interleaved so clock and thermal drift hit every candidate alike.

bench/v3_sweep.py times one configuration after another; two configs within a few percent can swap places between
runs.  Here every round times each candidate once (and torch cudnn once) at every shape, and the table reports the
median over rounds.  Each candidate is checked against torch first (the tests' accuracy rule) and is not timed if
wrong.

    python3 bench/v3_ab.py --configs 1,8 --shapes 1,16,16384,128 2,16,8192,128 --rounds 5 [--causal] [--json F]
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import check_close  # noqa: E402

from fattn import _C  # noqa: E402
from v2_sweep import time_us  # noqa: E402
from v3_sweep import run, stream  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="comma-separated v3 config indices (fattn._C.v3_configs())")
    ap.add_argument("--shapes", nargs="+", required=True, help="B,H,S,D (Sq = Sk = S)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    idxs = [int(x) for x in args.configs.split(",")]
    table = {row[0]: row for row in _C.v3_configs()}
    for i in idxs:
        if i not in table:
            sys.exit(f"--configs: no v3 config {i} (there are {len(table)})")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    causal = "top_left" if args.causal else False
    results = []
    for shape in args.shapes:
        b, h, s, d = (int(x) for x in shape.split(","))
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
        out = torch.empty_like(q)
        flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
        live = []
        for i in idxs:
            if table[i][1] != (64 if d <= 64 else 128 if d <= 128 else 256):
                print(f"{shape}: config {i} is for another head-dim bucket, skipped")
                continue
            try:  # a reference on a slice keeps the check cheap at long S
                qs = q[:1, :2, : min(s, 1024)].contiguous()
                ks, vs = k[:1, :2, : min(s, 1024)].contiguous(), v[:1, :2, : min(s, 1024)].contiguous()
                check_close(run(qs, ks, vs, causal, i), qs, ks, vs, causal, None)
                live.append(i)
            except AssertionError as e:
                print(f"{shape}: config {i} WRONG, not timed: {str(e).splitlines()[0]}")
        times = {i: [] for i in live}
        times["cudnn"] = []
        for _ in range(args.rounds):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                times["cudnn"].append(time_us(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)), flush, args.reps, 2))
            for i in live:
                times[i].append(_C.time_forward(q, k, v, out, None, 1 if causal else 0, None, 0, "v3", stream(),
                                                i, args.reps, 2, True)[0])
        med = {key: statistics.median(ts) for key, ts in times.items()}
        line = f"{shape:>18} causal={bool(causal)!s:5}  cudnn {flops / med['cudnn'] / 1e6:4.0f} TF/s"
        for i in live:
            line += f" | cfg {i} {table[i][1:6]} {flops / med[i] / 1e6:4.0f} TF/s {med['cudnn'] / med[i]:.3f}x"
        print(line, flush=True)
        results.append({"shape": shape, "causal": bool(causal), "median_us": {str(k_): v_ for k_, v_ in med.items()},
                        "all_us": {str(k_): v_ for k_, v_ in times.items()}})
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(), "git_sha": os.environ.get("FATTN_GIT_SHA")}
        json.dump({"meta": meta, "rounds": args.rounds, "results": results}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
