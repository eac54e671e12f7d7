"""Where one kernel's warps wait, instruction by instruction: Nsight Compute's warp-state sampling (its source page, in
SASS) on one launch of a fattn call -- the stall reasons over the whole kernel, then the instructions with the most
samples with their main reasons -- and the kernel's throughput rows (issue, shared memory, tensor pipe) beside them.

    python3 bench/ncu_source.py --shape 4,16,4096,128 --mode bwd --kernel _dkdv --out DIR [--causal] [--top 40]
        [--deterministic]
    python3 bench/ncu_source.py --from DIR [--range 560,1205]    # again from DIR/source.csv, no GPU needed
    python3 bench/ncu_source.py --kvcache 32,32,8,8192,128 --page 16 --kernel v2_fwd --out DIR
        # a decode step over a KV cache (B, H, H_kv, Sk, D; one query per sequence), paged with pages of --page keys in
        # fattn.testing.paged's shuffled pool, or contiguous (--page 0)
    python3 bench/ncu_source.py --kvcache 8,32,8,4096,128 --sq 512 --page 256 --kernel v3_fwd --out DIR
        # chunked prefill instead: --sq new queries a sequence (causal) over the Sk cached keys

The profiled calls are fattn.profile's child (--mode fwd / bwd).  Writes DIR/source.csv (every SASS instruction's
counters), DIR/details.csv (ncu's details page) and DIR/ncu_source.txt (what is printed).  --range A,B lists every
instruction with index A..B-1 (a main loop, found in a first listing) with its share and the running sum, so the
loop's share of the samples and where inside it they fall can be read off.
"""
import argparse
import csv
import io
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from fattn.profile import find_ncu  # noqa: E402

SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables",
            "WarpStateStats", "SourceCounters", "InstructionStats", "Occupancy", "LaunchStats"]
DETAIL_KEYS = ("Tensor", "Shared", "Issue", "Throughput", "Duration", "Registers", "Warp Cycles", "Pipe",
               "Bank", "L1", "Eligible", "Active Warps")
SAMPLES = "Warp Stall Sampling (All Samples)"


def rows_of(text):
    """The CSV rows of an ncu page; the source page opens with a ("Kernel Name", ...) line before its header."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"') and not ln.startswith('"Kernel Name"')]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def source_summary(text, top=40, span=None):
    """Lines describing a source page's CSV: the stall reasons' shares, the `top` instructions by samples, and
    (span = (a, b)) every instruction a..b-1 with its share and the running sum."""
    rows = rows_of(text)
    if not rows or SAMPLES not in rows[0]:
        return ["no source page in the report"]
    head = rows[0]
    col = {n: i for i, n in enumerate(head)}
    samp, src = col[SAMPLES], col["Source"]
    reasons = [i for i, n in enumerate(head) if n.startswith("stall_") and "Not Issued" not in n]
    body = [r for r in rows[1:] if len(r) == len(head)]
    total = sum(num(r[samp]) for r in body) or 1.0

    def why(r, k=3):
        top_r = sorted(((num(r[i]), head[i][6:]) for i in reasons), reverse=True)[:k]
        return ", ".join(f"{n} {v:.0f}" for v, n in top_r if v > 0)

    share = sorted(((sum(num(r[i]) for r in body), head[i][6:]) for i in reasons), reverse=True)
    out = [f"{total:.0f} stall samples over {len(body)} instructions; by reason: " +
           ", ".join(f"{n} {100 * v / total:.1f}%" for v, n in share[:10] if v > 0)]
    out.append(f"top {top} instructions (index, share of all samples, SASS, main reasons):")
    for idx, r in sorted(enumerate(body), key=lambda x: -num(x[1][samp]))[:top]:
        out.append(f"  {idx:5d} {100 * num(r[samp]) / total:5.1f}%  {r[src].strip()[:62]:62s} {why(r)}")
    if span:
        out.append(f"instructions {span[0]}..{span[1] - 1} (share, running sum):")
        acc = 0.0
        for idx in range(span[0], min(span[1], len(body))):
            v = num(body[idx][samp])
            acc += v
            out.append(f"  {idx:5d} {100 * v / total:5.2f}% {100 * acc / total:5.1f}%  "
                       f"{body[idx][src].strip()[:62]:62s} {why(body[idx], 2)}")
    return out


def details_summary(text):
    rows = rows_of(text)
    if not rows:
        return []
    col = {n: i for i, n in enumerate(rows[0])}
    if "Metric Name" not in col:
        return []
    out = []
    for r in rows[1:]:
        name = r[col["Metric Name"]]
        if any(k in name for k in DETAIL_KEYS):
            out.append(f"  {r[col['Section Name']][:28]:28s} {name[:58]:58s} {r[col['Metric Value']]:>14s} "
                       f"{r[col.get('Metric Unit', 0)]}")
    return out


def kvcache_child(spec, page, sq=1):
    """The profiled process of --kvcache: a few calls of attention_with_kvcache (decode steps, or chunked prefill of
    sq queries a sequence) at one shape."""
    import torch

    import fattn
    from fattn.testing.paged import page_cache

    b, h, hk, sk, d = (int(x) for x in spec.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((b, sq, h, d), generator=g, device="cuda").half()
    k, v = (torch.randn((b, sk, hk, d), generator=g, device="cuda").half() for _ in range(2))
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    kw = {}
    if page:
        k, v, kw["block_table"] = page_cache(k, v, page)
    for _ in range(4):
        fattn.attention_with_kvcache(q, k, v, cache_seqlens=lens, check_indices=False, **kw)
    torch.cuda.synchronize()


def profile(args, ncu):
    os.makedirs(args.out, exist_ok=True)
    rep = os.path.join(args.out, "prof")
    if args.kvcache:
        child = [sys.executable, os.path.abspath(__file__), "--kvcache-child", args.kvcache, "--page", str(args.page),
                 "--sq", str(args.sq)]
    else:
        child = [sys.executable, "-m", "fattn.profile", "--child", "--mode", args.mode, "--shape", args.shape]
        child += (["--causal"] if args.causal else []) + (["--variant", args.variant] if args.variant else [])
        child += ["--window", args.window] if args.window else []
        child += ["--deterministic"] if args.deterministic else []
    cmd = [ncu, "--clock-control", "none", "--kernel-name-base", "function", "--kernel-name", "regex:" + args.kernel,
           "--launch-skip", "2", "--launch-count", "1", "-f", "-o", rep]
    for s in SECTIONS:
        cmd += ["--section", s]
    r = subprocess.run(cmd + child, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0 or not os.path.exists(rep + ".ncu-rep"):
        sys.exit(f"ncu failed ({r.returncode}): {r.stdout[-1500:]} {r.stderr[-1500:]}")
    for page, name in (("details", "details.csv"), ("source", "source.csv")):
        extra = ["--print-source", "sass"] if page == "source" else []
        p = subprocess.run([ncu, "-i", rep + ".ncu-rep", "--page", page, "--csv"] + extra, capture_output=True,
                           text=True)
        with open(os.path.join(args.out, name), "w") as f:
            f.write(p.stdout)
    os.remove(rep + ".ncu-rep")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", help="B,H,S,D")
    ap.add_argument("--mode", default="bwd", choices=["fwd", "bwd"])
    ap.add_argument("--kernel", default="_dkdv", help="regex on the kernel's function name")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", help="LEFT,RIGHT: a sliding window")
    ap.add_argument("--variant")
    ap.add_argument("--deterministic", action="store_true", help="--mode bwd: the deterministic backward")
    ap.add_argument("--out", help="folder for the CSV files and the summary")
    ap.add_argument("--from", dest="src", help="summarise DIR/source.csv (and details.csv) of an earlier run")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--range", help="A,B: list instructions A..B-1 with their shares")
    ap.add_argument("--kvcache", help="B,H,H_kv,Sk,D: profile a decode step over a KV cache instead")
    ap.add_argument("--page", type=int, default=0, help="--kvcache: page size (0: a contiguous cache)")
    ap.add_argument("--sq", type=int, default=1, help="--kvcache: new queries a sequence (1: a decode step)")
    ap.add_argument("--kvcache-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kvcache_child:
        kvcache_child(args.kvcache_child, args.page, args.sq)
        return
    if args.src:
        args.out = args.src
    elif not ((args.shape or args.kvcache) and args.out):
        ap.error("--shape (or --kvcache) and --out, or --from DIR")
    else:
        ncu = find_ncu()
        if not ncu:
            sys.exit("ncu_source: ncu (Nsight Compute) not found: put it on PATH or set FATTN_NCU")
        profile(args, ncu)
    def read(name):
        path = os.path.join(args.out, name)
        return open(path).read() if os.path.exists(path) else ""
    span = tuple(int(x) for x in args.range.split(",")) if args.range else None
    lines = details_summary(read("details.csv")) + source_summary(read("source.csv"), args.top, span)
    text = "\n".join(lines)
    if not args.src:
        with open(os.path.join(args.out, "ncu_source.txt"), "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
