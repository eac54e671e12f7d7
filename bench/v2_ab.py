"""A/B of v2 tile configurations at a few shapes, interleaved with torch's flash and cudnn backends.

Every round times each candidate once, and each torch backend once, at every shape (CUDA events, L2 flushed,
median over reps); the table reports the median over rounds, so clock and thermal drift hit every candidate alike.
A configuration is DP:WARPS:MT:BC:STAGES (kernels/v2_configs.h); one not compiled ahead of time is compiled at run
time by NVRTC (fattn/_rtc.py), in parallel.  "auto" is fattn's own choice.  Each candidate is checked against torch
(the tests' accuracy rule) at the shape's head dim, causal both ways, and is not timed if wrong.

    python3 bench/v2_ab.py --configs auto,128:4:2:64:1 --shapes 16,16,1024,128 8,32,1,2048,128 [--causal] \\
        [--dtype bf16] [--rounds 5] [--json F] [--alt OLD.cu]

--orders 1,2 times every configuration in each block order (1 head by head, 2 heads fastest; 0 v2's choice).
--alt also compiles every listed configuration from another copy of kernels/v2_mma.cu (say the last commit's, from
`git show HEAD~1:kernels/v2_mma.cu > old.cu`, placed in the tree), labelled alt:..., to A/B a kernel change in one run.

A shape is B,H,S,D (Sq = Sk = S) or B,H,Sq,Sk,D.
"""
import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import check_close  # noqa: E402

from fattn import _C, _rtc  # noqa: E402
from fattn.bench import collect_meta  # noqa: E402
from v2_sweep import time_us  # noqa: E402
from v3_sweep import CAUSAL, stream  # noqa: E402
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ORDER_TAGS = {0: "", 1: "@hbh", 2: "@hf"}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def parse_config(text):
    if text == "auto":
        return "auto"
    parts = text.split(":")
    if len(parts) != 5:
        sys.exit(f"--configs: {text!r} is not DP:WARPS:MT:BC:STAGES")
    return dict(zip(("dp", "warps", "mt", "bc", "stages"), (int(x) for x in parts)))


def parse_shape(text):
    xs = [int(x) for x in text.split(",")]
    if len(xs) == 4:
        return xs[0], xs[1], xs[2], xs[2], xs[3]
    if len(xs) == 5:
        return tuple(xs)
    sys.exit(f"--shapes: {text!r} is not B,H,S,D or B,H,Sq,Sk,D")


def label(cfg):
    if cfg == "auto":
        return "auto"
    return ("alt:" if cfg.get("alt") else "") + ":".join(str(cfg[k]) for k in ("dp", "warps", "mt", "bc", "stages"))


def forward(q, k, v, out, causal, idx):
    _C.forward(q, k, v, out, None, CAUSAL[causal], None, 0, "v2", stream(), None if idx == "auto" else idx)
    return out


def gate(idx, d, dtype):
    """None if config `idx` is right on odd shapes at head dim d (causal both ways, Sq != Sk), else the error."""
    for sq, sk, causal in [(113, 257, "bottom_right"), (257, 113, "top_left"), (1, 300, False), (130, 130, False)]:
        q = torch.randn(2, 4, sq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(2, 2, sk, d, device="cuda", dtype=dtype) for _ in range(2))
        try:
            check_close(forward(q, k, v, torch.empty_like(q), causal, idx), q, k, v, causal, None)
        except (AssertionError, RuntimeError) as e:
            return str(e).splitlines()[0]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="comma-separated DP:WARPS:MT:BC:STAGES, or auto")
    ap.add_argument("--shapes", nargs="+", required=True, help="B,H,S,D or B,H,Sq,Sk,D")
    ap.add_argument("--causal", action="store_true", help="top-left causal (the fa3 grid's)")
    ap.add_argument("--dtype", choices=DTYPES, default="fp16")
    ap.add_argument("--backends", default="flash,cudnn")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--orders", default="0", help="block orders to time each config in: 0 auto, 1 head by head, "
                    "2 heads fastest")
    ap.add_argument("--alt", help="another v2 source file (relative to the repository root) to compile the configs from")
    args = ap.parse_args()
    cfgs = [parse_config(c) for c in args.configs.split(",")]
    orders = [int(o) for o in args.orders.split(",")]
    if any(o not in ORDER_TAGS for o in orders):
        sys.exit("--orders: expected 0, 1 or 2")
    shapes = [parse_shape(s) for s in args.shapes]
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            sys.exit(f"--backends: {b!r} is not one of {sorted(BACKENDS)}")
    dtype, arch = DTYPES[args.dtype], _C.device_info(0)[1]

    def index(cfg):
        try:
            return cfg, ("auto" if cfg == "auto" else _rtc.v2_index(cfg, args.dtype, arch)), None
        except Exception as e:  # a configuration that does not compile is reported, not fatal
            return cfg, None, str(e).splitlines()[0]

    def alt_index(cfg):
        try:
            cubin, _ = _rtc.compile_cubin(args.alt, _rtc.v2_options(cfg, args.dtype, arch), f"alt {label(cfg)}")
            return dict(cfg, alt=True), _C.v2_add_rtc(cubin, "fattn_v2_rtc", args.dtype, *(cfg[k] for k in (
                "dp", "warps", "mt", "bc", "stages"))), None
        except Exception as e:
            return dict(cfg, alt=True), None, str(e).splitlines()[0]

    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(index, cfgs))
        if args.alt:
            compiled += list(pool.map(alt_index, [c for c in cfgs if c != "auto"]))
    for cfg, idx, err in compiled:
        if err:
            print(f"config {label(cfg)}: does not compile: {err}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    causal = "top_left" if args.causal else False
    results, gated = [], {}
    for b, h, sq, sk, d in shapes:
        bucket = 64 if d <= 64 else 128 if d <= 128 else 256
        live = []
        for cfg, idx, err in compiled:
            if err or (cfg != "auto" and cfg["dp"] != bucket):
                continue
            for order in orders:
                name = label(cfg) + ORDER_TAGS[order]
                if (name, d) not in gated:  # shapes of one head dim share the check
                    _C.v2_set_order(order)
                    gated[name, d] = gate(idx, d, dtype)
                    _C.v2_set_order(0)
                bad = gated[name, d]
                if bad:
                    print(f"config {name} at d={d}: WRONG, not timed: {bad}")
                else:
                    live.append((name, idx, order))
        q = torch.randn(b, h, sq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, h, sk, d, device="cuda", dtype=dtype) for _ in range(2))
        out = torch.empty_like(q)
        times = {name: [] for name, _, _ in live}
        times.update({f"torch:{bk}": [] for bk in backends})
        for _ in range(args.rounds):
            for bk in backends:
                with sdpa_kernel([BACKENDS[bk]]):
                    times[f"torch:{bk}"].append(time_us(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)), flush, args.reps, 2))
            for name, idx, order in live:
                cfg_idx = None if idx == "auto" else idx
                _C.v2_set_order(order)
                try:
                    times[name].append(_C.time_forward(q, k, v, out, None, CAUSAL[causal], None, 0, "v2", stream(),
                                                       cfg_idx, args.reps, 2, True)[0])
                finally:
                    _C.v2_set_order(0)
        med = {key: statistics.median(ts) for key, ts in times.items()}
        flops = 4 * b * h * sq * sk * d / (2 if causal else 1)
        kv_bytes = 2 * k.numel() * k.element_size()
        unit, scale = ("TB/s", kv_bytes / 1e6) if sq == 1 else ("TF/s", flops / 1e6)
        ref = min((med[f"torch:{bk}"] for bk in backends), default=None)
        line = f"B={b} H={h} Sq={sq} Sk={sk} D={d} causal={bool(causal)!s:5}"
        for bk in backends:
            line += f" | {bk} {scale / med[f'torch:{bk}']:.2f}"
        for name, _, _ in live:
            line += f" | {name} {scale / med[name]:.2f} {unit}" + (f" {ref / med[name]:.3f}x" if ref else "")
        print(line, flush=True)
        results.append({"B": b, "H": h, "Sq": sq, "Sk": sk, "D": d, "causal": bool(causal), "dtype": args.dtype,
                        "unit": unit, "median_us": med, "all_us": times})
    if args.json:
        json.dump({"meta": collect_meta("cuda"), "rounds": args.rounds, "reps": args.reps, "results": results},
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
