"""Device time of each call, from the profiler's kernel records rather than CUDA events: which kernels a call runs,
how long each takes, and the span from its first kernel's start to its last one's end (kernels plus the gaps
between them, none of the host time that events can count when the host path outlasts the L2 flush before it).

    python3 bench/kernel_times.py --candidates v2 v2:splits=64 api:v2 torch:cudnn --shapes 1,32,1,128,32768,8
    python3 bench/kernel_times.py --mode bwd --candidates api:v3 torch:cudnn --shapes 4,16,4096,128 [--no-flush]

The L2 flush is timer.flush_l2's (FATTN_FLUSH=write, the default, or read); --no-flush profiles calls back to back
instead (the previous call's kernels still running when the next is launched).  Candidates and shapes as
bench/ab.py's (--mode bwd: api:X, X-det, torch:B, the gradients of a forward done once), and kv:contiguous /
kv:pageN: attention_with_kvcache on the
same keys in (B, S, H_kv, D) or in pages of N keys in a shuffled pool (check_indices=False, as the paged grid), and
read:sum -- torch's sum of K and of V, the read bandwidth a kernel of the same bytes reaches.  Each call follows an L2 flush and a synchronize; the flush
kernels separate the calls in the trace.  Prints per candidate: the median span, the median sum of kernel times, the
kernels with their median times, and (for comparison) the events timer's median.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ab  # noqa: E402
from fattn.testing import grids, paged, suite, timer  # noqa: E402

FLUSH_MIN_US = 40.0  # the 256 MB flush takes ~80 us on an H100; the flush's own kernels at least this long


def cuda_kernels(fn):
    """[(name, start, end)] of the CUDA kernels fn() runs, in start order, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e[1])


def profile_back_to_back(fn, reps):
    """[(span_us, [(kernel name, us), ...]) per call] of `reps` calls launched back to back, no flush: each call's
    kernels are those of one fn() (the profiler is run around a batch; a call's kernels counted by the first call's
    kernel count)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = len(cuda_kernels(fn))

    def calls_fn():
        for _ in range(reps):
            fn()
    ks = cuda_kernels(calls_fn)
    out = []
    for i in range(0, len(ks) - per_call + 1, per_call):
        c = ks[i:i + per_call]
        out.append((max(x[2] for x in c) - min(x[1] for x in c), [(n, b - a) for n, a, b in c]))
    return out


def profile_calls(fn, reps):
    """[(span_us, [(kernel name, us), ...]) per call]: kernels grouped between the flushes (timer.flush_l2).  A flush
    is told apart by its long kernel (name and length); the short ones it runs before that (the read flush's
    reduction starts with a Memset) are taken off the end of the call before it."""
    timer.flush_buffer()
    ref = cuda_kernels(timer.flush_l2)
    at = next(i for i, (n, a, b) in enumerate(ref) if b - a >= FLUSH_MIN_US)
    flush_names, lead = {ref[at][0]}, [n for n, _, _ in ref[:at]]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def calls_fn():
        for _ in range(reps):
            timer.flush_l2()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    calls, cur = [], None
    for name, start, end in cuda_kernels(calls_fn):
        if end - start >= FLUSH_MIN_US and name in flush_names:
            if cur and lead and [n for n, _, _ in cur[-len(lead):]] == lead:
                del cur[-len(lead):]
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append((name, start, end))
    out = []
    for c in calls:
        if c:
            out.append((max(x[2] for x in c) - min(x[1] for x in c), [(n, b - a) for n, a, b in c]))
    return out


def kv_fn(text, q, k, v):
    """attention_with_kvcache on q, k, v ((B, H, S, D) from suite.make_inputs), contiguous or paged."""
    import fattn

    qc, kc, vc = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    b, sk = kc.shape[0], kc.shape[1]
    lens = torch.full((b,), sk, dtype=torch.int32, device=q.device)
    if text == "kv:contiguous":
        return lambda: fattn.attention_with_kvcache(qc, kc, vc, cache_seqlens=lens, check_indices=False)
    pk, pv, table = paged.page_cache(kc, vc, int(text.removeprefix("kv:page")))
    return lambda: fattn.attention_with_kvcache(qc, pk, pv, cache_seqlens=lens, block_table=table,
                                                check_indices=False)


def read_fn(k, v):
    return lambda: (k.sum(), v.sum())  # a sum of fp16: not the flush's int32 max, so never taken for a flush


def short(name, width=70):
    name = name.split("(")[0]
    return name if len(name) <= width else name[:width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", nargs="+", required=True)
    ap.add_argument("--shapes", nargs="+", required=True, help="B,H,S,D[,SK[,HKV]]")
    ap.add_argument("--causal", choices=("none", "top_left", "bottom_right"), default="none")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--no-flush", action="store_true", help="calls back to back, no L2 flush between them")
    args = ap.parse_args()
    causal = {"none": False}.get(args.causal, args.causal)
    if args.mode == "bwd" and any(t.startswith("kv:") or t == "read:sum" for t in args.candidates):
        ap.error("--mode bwd: kv:* and read:sum time a forward; give api:VARIANT[-det] or torch:BACKEND")
    for s in args.shapes:
        x = [int(t) for t in s.split(",")]
        p = grids.point("shape", *x[:4], Sk=x[4] if len(x) > 4 else None, H_kv=x[5] if len(x) > 5 else None,
                        causal=causal, dtype=args.dtype, mode=args.mode)
        q, k, v = suite.make_inputs(p)
        dout = suite.make_inputs(p, 1)[0] if args.mode == "bwd" else None
        kv_bytes = 2 * k.numel() * k.element_size()
        flush = "none" if args.no_flush else timer.flush_mode()
        print(f"== {grids.describe(p)} causal={args.causal} mode={args.mode}  K+V {kv_bytes / 1e6:.1f} MB  "
              f"flush={flush}")
        for t in args.candidates:
            try:
                fn = (kv_fn(t, q, k, v) if t.startswith("kv:") else read_fn(k, v) if t == "read:sum"
                      else ab.make_fn(ab.parse_candidate(t), q, k, v, causal, None, dout))
                fn()
            except Exception as e:
                print(f"  {t}: cannot run ({type(e).__name__}: {str(e).splitlines()[0]})")
                continue
            calls = profile_back_to_back(fn, args.reps) if args.no_flush else profile_calls(fn, args.reps)
            ev = timer.percentile((timer.cuda_batch if args.no_flush else timer.cuda)(fn, args.reps, 3), 0.5)
            span = statistics.median(c[0] for c in calls)
            total = statistics.median(sum(d for _, d in c[1]) for c in calls)
            print(f"  {t:22s} span {span:8.1f} us ({kv_bytes / span / 1e6:5.2f} TB/s)  kernels {total:8.1f} us  "
                  f"{'batch' if args.no_flush else 'events'} {ev:8.1f} us")
            names = {}
            for _, ks in calls:
                for i, (n, d) in enumerate(ks):
                    names.setdefault((i, n), []).append(d)
            for (i, n), ds in sorted(names.items()):
                print(f"      {i} {short(n):70s} {statistics.median(ds):8.1f} us  x{len(ds)}")
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
