"""fattn.testing.paged -- the paged grid: decode steps over a paged KV cache (attention_with_kvcache), beside the same
call on a contiguous cache and torch's SDPA on the contiguous keys.  Through fattn.bench:

    python -m fattn.bench --grid paged --json paged.json

Points: B in 1, 8, 32, 64; H=32, H_kv=8, D=128, fp16, one query per sequence (Sq=1), every sequence Sk keys
(2k, 8k, 32k) already in the cache; pages of 16, 64 and 256 keys in a random physical order (--page-order
sequential: in the contiguous cache's order, which tells the pages' scattered addresses apart from the kernel's
per-page work).  Each point is
validated first (paged and contiguous outputs against torch's, the accuracy rule's tolerance for fp16), then timed
with CUDA events, the L2 flushed before each call, in interleaved rounds.  fattn's calls pass check_indices=False
(no read-back of cache_seqlens and the block table: what a decode loop runs) unless --check-indices.  gbps: K+V
bytes read per second (2 * B * Sk * H_kv * D * 2 bytes / p50).  Rows: grid "paged", impl (fattn:paged, fattn:contiguous, torch:<backend>),
B, Sk, page, p50_us, gbps, ratio_vs_contiguous (contiguous p50 / this p50), ratio_vs_best_torch.
"""
import argparse
import datetime
import json
import os
import sys

import fattn
from fattn.testing import timer

H, H_KV, D = 32, 8, 128


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fattn.bench --grid paged", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--sk", default="2048,8192,32768")
    ap.add_argument("--pages", default="16,64,256")
    ap.add_argument("--torch-backends", default="flash,cudnn", help="torch SDPA backends timed on the contiguous cache")
    ap.add_argument("--variant", help="fattn variant (default: fattn's choice)")
    ap.add_argument("--check-indices", action="store_true",
                    help="time fattn with its index checks (a synchronous read-back of the indices per call)")
    ap.add_argument("--page-order", choices=("random", "sequential"), default="random",
                    help="the pages' physical order in the pool (sequential: the contiguous cache's layout)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.sk = [int(x) for x in args.sk.split(",")]
    args.pages = [int(x) for x in args.pages.split(",")]
    args.torch_backends = [x for x in args.torch_backends.split(",") if x]
    return args


def make_point(b, sk, pages, seed=0, order="random"):
    """q, the contiguous cache, a paged copy per page size (pools, tables) and cache_seqlens."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed + b + sk)
    dev = "cuda"
    q = torch.randn((b, 1, H, D), generator=g, device=dev).half()
    k = torch.randn((b, sk, H_KV, D), generator=g, device=dev).half()
    v = torch.randn((b, sk, H_KV, D), generator=g, device=dev).half()
    lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
    return q, k, v, lens, {ps: page_cache(k, v, ps, order) for ps in pages}


def page_cache(k, v, ps, order="random"):
    """(pool_k, pool_v, block_table): the contiguous cache k, v (B, S, H_kv, D), S a multiple of ps, copied into pages
    of ps keys in a shuffled pool (the permutation seeded by ps), or (order "sequential") in the cache's own order."""
    import torch

    b, sk, tail = k.shape[0], k.shape[1], k.shape[2:]
    n = sk // ps
    if order == "sequential":
        perm = torch.arange(b * n, device=k.device)
    else:
        perm = torch.randperm(b * n, generator=torch.Generator().manual_seed(ps)).to(k.device)
    table = perm.reshape(b, n).to(torch.int32)
    pool_k = torch.empty((b * n, ps) + tail, dtype=k.dtype, device=k.device)
    pool_v = torch.empty_like(pool_k)
    pool_k[perm] = k.reshape((b * n, ps) + tail)
    pool_v[perm] = v.reshape((b * n, ps) + tail)
    return pool_k, pool_v, table


def torch_call(backend, q, k, v):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run():
        with sdpa_kernel(kind):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
    run()
    torch.cuda.synchronize()
    return run


def run_point(args, b, sk):
    import torch

    q, k, v, lens, paged = make_point(b, sk, args.pages, order=args.page_order)
    fns, notes = {}, {}
    check = args.check_indices
    fns["fattn:contiguous"] = lambda: fattn.attention_with_kvcache(q, k, v, cache_seqlens=lens, variant=args.variant,
                                                                   check_indices=check)
    for ps, (pk, pv, table) in paged.items():
        fns[f"fattn:paged{ps}"] = (lambda pk=pk, pv=pv, table=table: fattn.attention_with_kvcache(
            q, pk, pv, cache_seqlens=lens, block_table=table, variant=args.variant, check_indices=check))
    for name in args.torch_backends:
        try:
            fns[f"torch:{name}"] = torch_call(name, q, k, v)
        except Exception as e:  # noqa: BLE001  a backend may refuse the shape: the row says why
            notes[f"torch:{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(  # float32, a few sequences at a time
        q[i:i + 4].transpose(1, 2).float(), k[i:i + 4].transpose(1, 2).float(), v[i:i + 4].transpose(1, 2).float(),
        enable_gqa=True).transpose(1, 2) for i in range(0, b, 4)])
    errs = {}
    for name, fn in list(fns.items()):
        err = (fn().float() - ref).abs().max().item()
        errs[name] = err
        if not err <= 2e-2:  # fp16 decode over unit-variance values: a wrong kernel is far past this
            notes[name] = f"validation failed: max err {err:.3g}"
            del fns[name]
    med = timer.interleaved(fns, args.rounds, lambda fn: timer.cuda(fn, args.reps, args.warmup))
    p50 = {name: timer.percentile(ms, 0.5) for name, ms in med.items()}
    kv_bytes = 2 * b * sk * H_KV * D * 2
    best_torch = min((us for n, us in p50.items() if n.startswith("torch:")), default=None)
    rows = []
    for name in list(fns) + [n for n in notes if n not in fns]:
        us = p50.get(name)
        page = int(name[len("fattn:paged"):]) if name.startswith("fattn:paged") else None
        rows.append({"grid": "paged", "impl": "fattn:paged" if page else name, "B": b, "H": H, "H_kv": H_KV, "D": D,
                     "Sq": 1, "Sk": sk, "page": page, "page_order": args.page_order if page else None,
                     "dtype": "fp16", "p50_us": us,
                     "gbps": kv_bytes / us / 1e3 if us else None,
                     "ratio_vs_contiguous": p50["fattn:contiguous"] / us if us and "fattn:contiguous" in p50 else None,
                     "ratio_vs_best_torch": best_torch / us if us and best_torch else None,
                     "max_abs_err": errs.get(name), "note": notes.get(name, "")})
    return rows


def print_rows(rows, header):
    if header:
        print(f"{'B':>3} {'Sk':>6} {'impl':>18} {'page':>5} {'p50 us':>9} {'GB/s':>7} {'vs contig':>9} "
              f"{'vs torch':>8}  note")
    for r in rows:
        f = (lambda x, spec: format(x, spec) if x is not None else "-")
        print(f"{r['B']:>3} {r['Sk']:>6} {r['impl']:>18} {f(r['page'], '>5')} {f(r['p50_us'], '9.1f'):>9} "
              f"{f(r['gbps'], '7.0f'):>7} {f(r['ratio_vs_contiguous'], '9.3f'):>9} "
              f"{f(r['ratio_vs_best_torch'], '8.3f'):>8}  {r['note']}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not (torch.cuda.is_available() and fattn.cuda_available()):
        print("the paged grid needs a CUDA GPU usable by torch and fattn", file=sys.stderr)
        return 2
    rows = []
    for b in args.batches:
        for sk in args.sk:
            try:
                point = run_point(args, b, sk)
            except torch.OutOfMemoryError as e:
                point = [{"grid": "paged", "impl": "fattn:paged", "B": b, "H": H, "H_kv": H_KV, "D": D, "Sq": 1,
                          "Sk": sk, "page": None, "dtype": "fp16", "p50_us": None, "gbps": None,
                          "ratio_vs_contiguous": None, "ratio_vs_best_torch": None, "max_abs_err": None,
                          "note": f"out of memory: {str(e).splitlines()[0][:100]}"}]
            print_rows(point, header=not rows)
            rows += point
            torch.cuda.empty_cache()
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version(), "fattn": fattn.__version__,
                "git_sha": os.environ.get("FATTN_GIT_SHA", "unknown"),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "flush": timer.flush_mode(), "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json} ({len(rows)} rows)")
    bad = [r for r in rows if r["impl"].startswith("fattn") and r["p50_us"] is None]
    return 1 if bad else 0
