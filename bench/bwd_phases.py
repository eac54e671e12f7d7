"""Where a GPU backward's time goes, kernel by kernel: Nsight Compute on one attention_backward call (after a warm-up
call), every kernel it launches (preprocess, dK/dV, dQ convert), with each kernel's duration, DRAM bytes and
tensor-pipe use, and its warps' stall reasons (warps stalled per issued instruction, the largest six).

    python3 bench/bwd_phases.py --shape 32,16,512,128 [--causal] [--variant v3] [--deterministic] [--csv FILE]

ncu profiles each kernel alone (caches flushed between them), so the durations add to a little more than the call's
time under the events timer.  The profiled calls are fattn.profile's (its --child, --mode bwd); ncu is found and
its CSV read by fattn.profile too.
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fattn.profile import find_ncu, parse_ncu_csv  # noqa: E402

METRICS = ["gpu__time_duration.sum", "dram__bytes.sum",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed"]
STALLS = ["long_scoreboard", "short_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle", "lg_throttle",
          "membar", "sleeping", "dispatch_stall", "no_instruction", "selected", "not_selected", "branch_resolving",
          "drain", "imc_miss", "tex_throttle"]
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
KERNELS = "regex:bwd_prep|bwd_convert|_dkdv|_bwd_dq"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--csv", help="also write ncu's raw CSV here")
    args = ap.parse_args()
    ncu = find_ncu()
    if not ncu:
        sys.exit("bwd_phases: ncu (Nsight Compute) not found: put it on PATH or set FATTN_NCU")
    child = [sys.executable, "-m", "fattn.profile", "--child", "--mode", "bwd", "--shape", args.shape] + \
        (["--causal"] if args.causal else []) + (["--variant", args.variant] if args.variant else []) + \
        (["--deterministic"] if args.deterministic else [])
    # the child makes three backward calls of three kernels at most (prep, main, convert / dQ pass): skip the first's
    metrics = METRICS + [STALL_METRIC.format(s) for s in STALLS]
    cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--kernel-name", KERNELS, "--launch-skip", "3",
           "--launch-count", "3", "--metrics", ",".join(metrics)] + child
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.join(os.path.dirname(__file__), ".."))
    if r.returncode != 0:
        sys.exit(f"ncu failed ({r.returncode}): {r.stderr[-2000:]}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(r.stdout)
    print(f"shape {args.shape} causal={args.causal} variant={args.variant or 'default'} "
          f"deterministic={args.deterministic}")
    for rec in parse_ncu_csv(r.stdout):
        name = rec["kernel"].split("(")[0].split("<")[0]
        dur, dram = rec.get(METRICS[0]), rec.get(METRICS[1])
        tensor = rec.get(METRICS[2])
        print(f"  {name:14s} {dur or 0:>10.0f} ns dram {dram or 0:>12.0f} byte tensor {tensor or 0:6.2f}%")
        stalls = sorted(((rec[STALL_METRIC.format(s)], s) for s in STALLS if STALL_METRIC.format(s) in rec),
                        reverse=True)[:6]
        print("      warps stalled per issued instruction: " + ", ".join(f"{s} {v:.2f}" for v, s in stalls))


if __name__ == "__main__":
    main()
