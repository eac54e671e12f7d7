"""varlen_host_probe.py -- where a checked packed call's extra time goes (issue 17): one packed batch through
attention_varlen with check_indices=True (cu_seqlens_k the same array as cu_seqlens_q, or a copy; the same
tensors every call -- after the first, remembered as checked (fattn/_indices.py) -- or tensors not seen before, from
a pool larger than what fattn remembers) and False, timed back to back (events: the GPU's time per call, or the
host's where that is longer), the host's time to issue those same calls (the loop's wall time: the host's cost of
a call, waits for read backs included), and one call at a time from a synchronized start, beside a bare read of
cu_seqlens to the host.  --profile prints cProfile's top entries for the unchecked call (time in fattn._C.forward
is the C side: argument checks, planning, launches).  --old DIR times fattn_old (bench/old_tree.sh) beside this
tree, interleaved.  --grad times forward and backward through torch autograd instead.  --kvcache PAGE times a
decode step over a paged KV cache instead (attention_with_kvcache: one new token per sequence appended, B sequences
of --seqlen cached keys in pages of PAGE, H_kv = H / 4), its cache_seqlens and
block_table checked or not.

    python3 bench/varlen_host_probe.py [--old DIR] [--batch 8] [--seqlen 2048] [--heads 16] [--dim 128] [--causal]
    python3 bench/varlen_host_probe.py --grad --causal [--old DIR]
    python3 bench/varlen_host_probe.py --kvcache 16 --batch 8 --seqlen 4096 --heads 32
"""
import argparse
import importlib
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (name, check_indices, one array for both, arrays not seen before)
KINDS = (("unchecked", False, True, False), ("checked, one array", True, True, False),
         ("checked, two arrays", True, False, False), ("checked, new arrays", True, True, True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="folder holding the package fattn_old")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kvcache", type=int, metavar="PAGE", help="a paged decode step instead (page size)")
    ap.add_argument("--profile", action="store_true", help="cProfile the unchecked call")
    ap.add_argument("--grad", action="store_true", help="forward and backward through torch autograd")
    a = ap.parse_args()
    mods = {"new": importlib.import_module("fattn")}
    if a.old:
        sys.path.insert(0, a.old)
        mods["old"] = importlib.import_module("fattn_old")
    dev = torch.device("cuda")
    total = a.batch * a.seqlen
    q, k, v = (torch.randn(total, a.heads, a.dim, device=dev, dtype=torch.float16) for _ in range(3))
    cu = torch.arange(0, total + 1, a.seqlen, device=dev, dtype=torch.int32)
    cu_k = cu.clone()
    pool = itertools.cycle([cu.clone() for _ in range(2 * 32 + 1)])  # more than fattn remembers (_indices.LIMIT)

    if a.grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        dout = torch.randn_like(q)

    def call(mod, checked, same, fresh):
        c = next(pool) if fresh else cu
        o = mod.attention_varlen(q, k, v, c, c if same else cu_k, max_seqlen_q=a.seqlen,
                                 max_seqlen_k=a.seqlen, causal=a.causal, check_indices=checked)
        if a.grad:
            o.backward(dout)
        return o
    kinds = KINDS
    if a.kvcache:
        same = {"checked, one array": "checked, same arrays"}  # one pair of index arrays
        call, kinds = decode_step(a, dev), [(same.get(x[0], x[0]), *x[1:]) for x in KINDS if x[2]]

    loop, issue, host = {}, {}, {}
    for _ in range(a.rounds):
        for tag, mod in mods.items():
            for name, *how in kinds:
                for _ in range(5):
                    call(mod, *how)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    call(mod, *how)
                t1 = time.perf_counter()
                e1.record()
                torch.cuda.synchronize()
                loop.setdefault((tag, name), []).append(e0.elapsed_time(e1) * 1e3 / a.reps)
                issue.setdefault((tag, name), []).append((t1 - t0) * 1e6 / a.reps)
                for _ in range(a.reps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    call(mod, *how)
                    host.setdefault((tag, name), []).append((time.perf_counter() - t0) * 1e6)
    reads = []
    for _ in range(a.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cu.cpu()
        reads.append((time.perf_counter() - t0) * 1e6)
    what = f"decode, pages of {a.kvcache}" if a.kvcache else f"causal={a.causal}"
    what += ", forward + backward" if a.grad else ""
    print(f"{torch.cuda.get_device_name()}  B={a.batch} S={a.seqlen} H={a.heads} D={a.dim} {what}, "
          f"{a.rounds} rounds x {a.reps} calls")
    print(f"{'tree':<5} {'call':<22} {'back to back us/call (rounds)':>36} {'issue us/call':>14} "
          f"{'host us p50, idle GPU':>22}")
    for (tag, name), us in loop.items():
        print(f"{tag:<5} {name:<22} {statistics.median(us):>10.1f} ({', '.join(f'{x:.1f}' for x in us)})"
              f" {statistics.median(issue[(tag, name)]):>14.1f} {statistics.median(host[(tag, name)]):>16.1f}")
    print(f"cu_seqlens.cpu() (torch) on an idle stream: p50 {statistics.median(reads):.1f} us")
    if a.profile:
        import cProfile
        import pstats
        for tag, mod in mods.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10 * a.reps):
                call(mod, *kinds[0][1:])
            prof.disable()
            torch.cuda.synchronize()
            print(f"{tag}: cProfile of {10 * a.reps} {kinds[0][0]} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def decode_step(a, dev):
    """call(mod, checked, same, fresh) for --kvcache: one decode step over a paged cache, the new token written at
    the same slot each call (cache_seqlens stays put)."""
    ps, hk = a.kvcache, max(1, a.heads // 4)
    per = -(-a.seqlen // ps)
    pages = a.batch * per
    kc, vc = (torch.randn(pages, ps, hk, a.dim, device=dev, dtype=torch.float16) for _ in range(2))
    table = torch.randperm(pages, device=dev).reshape(a.batch, per).to(torch.int32)
    lens = torch.full((a.batch,), a.seqlen - 1, device=dev, dtype=torch.int32)
    q = torch.randn(a.batch, 1, a.heads, a.dim, device=dev, dtype=torch.float16)
    kn = torch.randn(a.batch, 1, hk, a.dim, device=dev, dtype=torch.float16)
    pool = itertools.cycle([(lens.clone(), table.clone()) for _ in range(2 * 32 + 1)])

    def call(mod, checked, same, fresh):
        used, tab = next(pool) if fresh else (lens, table)
        return mod.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=kn, cache_seqlens=used, block_table=tab,
                                          check_indices=checked)
    return call


if __name__ == "__main__":
    main()
