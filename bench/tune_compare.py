"""The tuned configs of a tuned-config cache beside v2's default config and torch's backends, at each entry's shape,
timed in one run (CUDA events, L2 flushed, median: fattn.bench.time_cuda).  Every config is checked against the
float64 reference first.

    python3 bench/tune_compare.py --cache OUT/tuned.json --json OUT/tune_compare.json --md OUT/tune_compare.md
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

from fattn import _C, _frameworks, _rtc, _tuned  # noqa: E402
from fattn._api import _CAUSAL  # noqa: E402
from fattn.bench import collect_meta, time_cuda  # noqa: E402
from fattn.tune.space import Problem, V2Space  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    entries = [e for e in _tuned.entries(args.cache) if e["family"] == "v2"]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    arch = _C.device_info(0)[1]
    rows, lines = [], ["| shape | causal | dtype | default config | tuned config | default us | tuned us | flash us |"
                       " cudnn us | tuned/default | tuned vs flash | tuned vs cudnn |", "|" + "---|" * 12]
    space = V2Space()
    _frameworks.register_torch(_C)
    for e in entries:
        b, h, sq, sk, d = e["shape"]
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[e["dtype"]]
        causal = e["causal"]
        prob = Problem(b, h, sq, sk, d, causal, e["dtype"], "cuda")
        q = torch.randn(b, h, sq, d, device="cuda", dtype=dt)
        k = torch.randn(b, h, sk, d, device="cuda", dtype=dt)
        v = torch.randn(b, h, sk, d, device="cuda", dtype=dt)
        out = torch.empty_like(q)
        stream = _frameworks.current_stream("torch", 0)
        cfgs = {"default": space.default(prob), "tuned": e["config"]}
        us = {}
        for name, cfg in cfgs.items():
            idx = _rtc.v2_index(space.full(cfg, prob), e["dtype"], arch)
            fn = lambda idx=idx: _C.forward(q, k, v, out, None, _CAUSAL[causal], None, 0, "v2", stream, idx)  # noqa: E731
            fn()
            check_close(out, q, k, v, causal, None)
            us[name] = time_cuda(fn, args.reps, 3, flush)[0]
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel([be]):
                us[name] = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)),
                                     args.reps, 3, flush)[0]
        fl = prob.flops()
        row = dict(shape=[b, h, sq, sk, d], causal=causal, dtype=e["dtype"], default_config=cfgs["default"],
                   tuned_config=cfgs["tuned"], us=us, tflops={k_: fl / t / 1e6 for k_, t in us.items()},
                   evo_p50_us=e.get("p50_us"), evo_default_p50_us=e.get("default_p50_us"))
        rows.append(row)
        fmt = lambda c: "/".join(str(c[k_]) for k_ in ("warps", "mt", "bc", "stages"))  # noqa: E731
        lines.append(f"| {b},{h},{sq},{d} | {causal} | {e['dtype']} | {fmt(cfgs['default'])} | {fmt(cfgs['tuned'])} | "
                     f"{us['default']:.1f} | {us['tuned']:.1f} | {us['flash']:.1f} | {us['cudnn']:.1f} | "
                     f"{us['default'] / us['tuned']:.3f} | {us['flash'] / us['tuned']:.3f} | {us['cudnn'] / us['tuned']:.3f} |")
        print(lines[-1], flush=True)
    meta = collect_meta("cuda", command="bench/tune_compare.py")
    if args.json:
        json.dump({"meta": meta, "rows": rows}, open(args.json, "w"), indent=1)
    if args.md:
        open(args.md, "w").write("config = warps/mt/bc/stages; ratios > 1: tuned faster\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
