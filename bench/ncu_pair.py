"""Nsight Compute on v2 and torch's FlashAttention-2 kernel at one shape, side by side: the details page of both
(speed of light, warp stalls, instruction mix, scheduler, occupancy) and the SASS source page with per-instruction
counters, for reading where v2 spends issue slots that FlashAttention-2 does not.

    python3 bench/ncu_pair.py --shape 8,16,2048,128 [--config 128:4:2:64:1] [--causal] --out DIR

Writes DIR/details.txt (both kernels), DIR/sass_v2.csv, DIR/sass_flash.csv, DIR/pair.ncu-rep, and prints (and writes
DIR/summary.md) each kernel's warp-stall reasons and executed-instruction mix from the SASS pages.
`python3 bench/ncu_pair.py --summarize DIR` redoes the summary from a DIR written earlier.
"""
import collections
import csv
import gzip
import re
import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats",
            "InstructionStats", "SchedulerStats", "Occupancy", "LaunchStats", "SourceCounters"]
KERNELS = r"regex:v2_fwd|fattn_v2_rtc|flash_fwd_kernel"


def child(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, ROOT)
    from fattn import _C, _rtc

    b, h, s, d = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    kw = {}
    if args.config:
        cfg = dict(zip(("dp", "warps", "mt", "bc", "stages"), (int(x) for x in args.config.split(":"))))
        kw["config"] = _rtc.v2_index(cfg, "fp16", _C.device_info(0)[1])
    out = torch.empty_like(q)
    st = torch.cuda.current_stream().cuda_stream or 1
    for _ in range(2):  # the first launch of each is skipped by the filter below (warm caches, lazy loading)
        _C._dev.forward(q, k, v, out, causal=1 if args.causal else 0, variant="v2", stream=st, **kw)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
    torch.cuda.synchronize()


def sass_summary(path):
    """(warp-inst executed, {stall reason: share of samples}, {opcode: warp-inst}) from an ncu SASS source page."""
    rows = list(csv.reader(gzip.open(path, "rt") if path.endswith(".gz") else open(path)))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    stalls, ops, samples, total = collections.Counter(), collections.Counter(), 0, 0
    for r in data:
        try:
            n = int(r[ix["Instructions Executed"]] or 0)
        except ValueError:
            continue
        text = r[ix["Source"]].strip()
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] if text else "?"
        ops[op] += n
        total += n
        for c in stall_cols:
            if r[ix[c]] not in ("", "0"):
                stalls[c[len("stall_"):]] += int(r[ix[c]])
        samples += int(r[ix["# Samples"]] or 0)
    return total, {k: v / max(samples, 1) for k, v in stalls.most_common(8)}, dict(ops.most_common(16))


def summarize(out):
    lines = []
    for name in ("v2", "flash"):
        path = os.path.join(out, f"sass_{name}.csv")
        if not os.path.exists(path):
            path += ".gz"  # as kept in evidence/profile
        if not os.path.exists(path):
            continue
        total, stalls, ops = sass_summary(path)
        lines.append(f"{name}: {total / 1e6:.1f}M warp-instructions executed")
        lines.append("  stalls (share of samples): " + ", ".join(f"{k} {v:.1%}" for k, v in stalls.items()))
        lines.append("  instruction mix (M): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in ops.items()))
    text = "\n".join(lines)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", help="B,H,S,D")
    ap.add_argument("--summarize", metavar="DIR", help="only summarise the SASS pages of an earlier --out DIR")
    ap.add_argument("--config", help="v2 DP:WARPS:MT:BC:STAGES (default: fattn's choice)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.summarize:
        return summarize(args.summarize)
    if not args.out or not args.shape:
        ap.error("--shape and --out are required")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    os.makedirs(args.out, exist_ok=True)
    rep = os.path.join(args.out, "pair.ncu-rep")
    cmd = [ncu, "--clock-control", "none", "--kernel-name-base", "function", "--kernel-name", KERNELS,
           "--launch-skip", "2", "--launch-count", "2", "--import-source", "no", "-f", "-o", rep[:-len(".ncu-rep")]]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", "--shape", args.shape]
    cmd += (["--config", args.config] if args.config else []) + (["--causal"] if args.causal else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
        return 1
    details = subprocess.run([ncu, "-i", rep, "--page", "details"], capture_output=True, text=True).stdout
    with open(os.path.join(args.out, "details.txt"), "w") as f:
        f.write(details)
    for i, name in enumerate(("v2", "flash")):
        src = subprocess.run([ncu, "-i", rep, "--page", "source", "--print-source", "sass", "--csv",
                              "--launch-skip", str(i), "--launch-count", "1"], capture_output=True, text=True)
        with open(os.path.join(args.out, f"sass_{name}.csv"), "w") as f:
            f.write(src.stdout if src.returncode == 0 else src.stderr)
    summarize(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
