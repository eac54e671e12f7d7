"""Where a GPU backward's time goes, kernel by kernel: Nsight Compute on one attention_backward call (after a warm-up
call), every kernel it launches (preprocess, dK/dV, dQ convert), with each kernel's duration, DRAM bytes and
tensor-pipe use, and its warps' stall reasons (warps stalled per issued instruction, the largest six).

    python3 bench/bwd_phases.py --shape 32,16,512,128 [--causal] [--variant v3] [--deterministic] [--csv FILE]

ncu profiles each kernel alone (caches flushed between them), so the durations add to a little more than the call's
time under the events timer.
"""
import argparse
import csv
import io
import os
import subprocess
import sys

METRICS = ["gpu__time_duration.sum", "dram__bytes.sum",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed"]
STALLS = ["long_scoreboard", "short_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle", "lg_throttle",
          "membar", "sleeping", "dispatch_stall", "no_instruction", "selected", "not_selected", "branch_resolving",
          "drain", "imc_miss", "tex_throttle"]
METRICS += [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]
KERNELS = "regex:bwd_prep|bwd_convert|_dkdv|_bwd_dq"


def child(args):
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import fattn

    b, h, s, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    causal = "top_left" if args.causal else False
    out, lse = fattn.attention(q, k, v, causal=causal, variant=args.variant, return_lse=True)
    for _ in range(2):  # the first call warms up; ncu profiles the second one's kernels (--launch-skip)
        fattn.attention_backward(do, q, k, v, out, lse, causal=causal, variant=args.variant,
                                 deterministic=args.deterministic)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--csv", help="also write ncu's raw CSV here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    me = [sys.executable, os.path.abspath(__file__), "--child", "--shape", args.shape] + \
        (["--causal"] if args.causal else []) + (["--variant", args.variant] if args.variant else []) + \
        (["--deterministic"] if args.deterministic else [])
    # three kernels per call at most (prep, main, convert / dQ pass): skip the warm-up call's
    cmd = [os.environ.get("FATTN_NCU", "ncu"), "--csv", "--page", "details", "--kernel-name", KERNELS,
           "--launch-skip", "3", "--launch-count", "3", "--metrics", ",".join(METRICS)] + me
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ncu failed ({r.returncode}): {r.stderr[-2000:]}")
    text = r.stdout[r.stdout.find('"ID"'):]
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(text)
    rows = list(csv.DictReader(io.StringIO(text)))
    kernels = {}
    for row in rows:
        kid = (row["ID"], row["Kernel Name"].split("(")[0].split("<")[0])
        kernels.setdefault(kid, {})[row["Metric Name"]] = (row["Metric Value"], row["Metric Unit"])
    print(f"shape {args.shape} causal={args.causal} variant={args.variant or 'default'} "
          f"deterministic={args.deterministic}")
    for (kid, name), m in kernels.items():
        dur = m.get("gpu__time_duration.sum", ("?", ""))
        dram = m.get("dram__bytes.sum", ("?", ""))
        tens = m.get("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", ("?", ""))
        print(f"  {name:14s} {dur[0]:>10s} {dur[1]:6s} dram {dram[0]:>9s} {dram[1]:6s} tensor {tens[0]:>6s}%")
        stalls = sorted(((float(v[0].replace(",", "")), k.split("stalled_")[1].split("_per_")[0])
                         for k, v in m.items() if "issue_stalled" in k), reverse=True)[:6]
        print("      warps stalled per issued instruction: " + ", ".join(f"{k} {val:.2f}" for val, k in stalls))


if __name__ == "__main__":
    main()
