"""Nsight Compute on two or more candidates at one shape, their counters side by side: where an A/B says one is
slower, this says how (instructions, issue stalls, tensor-pipe use, DRAM).

    python3 bench/ncu_ab.py --shape 16,32,1024,64 --candidates v3 old:v3 --old /tmp/fattn_old_tree [--causal]

Candidates as in bench/ab.py (VARIANT[:config=I...], old:VARIANT).  Each runs in its own ncu child (one profiled
launch after two skipped); the table prints every metric of fattn/profile.py plus instruction and stall counters.
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

EXTRA = {
    "inst_executed": "smsp__inst_executed.sum",
    "warp_cycles_per_inst": "smsp__average_warp_latency_per_inst_issued.ratio",
    "stall_barrier": "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "stall_long_sb": "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "stall_wait": "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "stall_math": "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "stall_branch": "smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio",
    "stall_no_inst": "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio",
    "stall_membar": "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio",
    "stall_sleeping": "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio",
    "l1i_miss": "sm__icc_requests_lookup_miss.sum",
}


def child(args):
    import torch

    sys.path.insert(0, ROOT)
    import importlib

    import ab  # bench/ab.py: the candidate syntax and callables

    old = None
    if args.old:
        sys.path.insert(0, args.old)
        old = importlib.import_module("fattn_old")
    b, h, s, d = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    fn = ab.make_fn(ab.parse_candidate(args.candidate), q, k, v, "top_left" if args.causal else False, old)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True)
    ap.add_argument("--candidates", nargs="+", required=True)
    ap.add_argument("--old")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--kernel", default=r"regex:v[0-9]+_fwd", help="ncu --kernel-name filter")
    ap.add_argument("--candidate", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.candidate:
        return child(args)
    from fattn import profile

    ncu = profile.find_ncu()
    if not ncu:
        sys.exit("ncu not found")
    metrics = dict(profile.METRICS, **EXTRA)
    cols = {}
    for cand in args.candidates:
        cmd = [ncu, "--clock-control", "none", "--kernel-name-base", "function", "--kernel-name", args.kernel,
               "--launch-skip", "2", "--launch-count", "1", "--metrics", ",".join(metrics.values()), "--csv",
               "--page", "raw", "--print-units", "base", sys.executable, os.path.abspath(__file__), "--shape",
               args.shape, "--candidates", "x", "--candidate", cand] + (["--old", args.old] if args.old else []) + \
              (["--causal"] if args.causal else [])
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        recs = profile.parse_ncu_csv(r.stdout)
        if not recs:
            print(f"{cand}: ncu gave nothing\n{(r.stderr + r.stdout)[-1500:]}")
            continue
        cols[cand] = recs[0]
    print(f"{'metric':28s} " + " ".join(f"{c:>16s}" for c in cols))
    for label, name in metrics.items():
        cells = []
        for rec in cols.values():
            x = rec.get(name)
            cells.append(f"{x:16.4g}" if isinstance(x, float) else f"{'-':>16s}")
        print(f"{label:28s} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
