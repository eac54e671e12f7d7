"""serving_targets.py -- issue 17's timing targets, fattn's default variant choice, fp16, on one GPU:

  window   S=16k, H=16, D=128, causal with window (1024, 0) against full causal (target: >= 8x faster)
  varlen   a batch of 8 equal sequences of 2048, packed (attention_varlen) against the dense call on the same data
           (target >= 0.97x), non-causal and causal; varlen: checked, the same cu_seqlens every call (remembered as
           checked after the first: fattn/_indices.py); varlen-new-arrays: checked, cu_seqlens not seen before every
           call (each call's synchronous copy and host checks in the events); varlen-trusted: check_indices=False
  ragged   8 sequences of lengths drawn from 128..8k, packed, against the dense call on the batch padded to the
           longest (target: >= real / padded tokens, within 10%)
  varlen_bwd  the backward of the equal-lengths packed batch against the dense backward on the same data
  mods     a softcap (30), ALiBi, both, against the plain call, for the default variant (v3 on Hopper) and v2,
           forward and backward, B=4, H=16, S=4k, D=64 / 128 / 256, causal and not: what the scores' changes cost
  sinks    attention sinks against the plain call (forward, default variant): as the call applies them, and as the
           plain call with the sinks pass after it (_C.sinks: what every call ran before v3 applied them in its
           epilogue); gpt-oss-like prefill (H=64, H_kv=8, D=64, causal, full and a 128-key window) and D=128;
           gpt-oss-like decode (attention_with_kvcache, one query, B=1 with 32k keys and B=8 with 8k: split calls;
           B=64 with 8k: unsplit)
  paged_prefill  chunked prefill over a KV cache (attention_with_kvcache, 512 new queries a sequence against 4k cached
           keys, B=8, H=32, H_kv=8, D=128, causal): v3 and v2 on pages of 16 / 32 / 64 / 256 (in random order, or
           with --page-order sequential in the contiguous cache's own) and on the contiguous cache (target: paged
           within 5% of contiguous)
  sinks_bwd  the backward with sinks against the plain backward (default variant), the same prefill shapes: dsinks as
           the call gives it, and as the sinks pass gives it after the plain backward (_C.sinks(..., dout=, dsinks=):
           what every backward with sinks ran before v2 and v3 took dsinks from their own workspace)

    python bench/serving_targets.py --json serving.json
    python bench/serving_targets.py --targets paged_prefill,varlen --with-old /tmp/old   # + an older tree, interleaved

--with-old DIR (a tree built by bench/old_tree.sh): the varlen, ragged and paged_prefill targets also time that
tree's calls, named old:..., in the same interleaved rounds as this tree's.

Each pair is timed interleaved (CUDA events, L2 flushed, p50 of each round's median); rows name the variant that ran.
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fattn  # noqa: E402
from fattn.testing import timer  # noqa: E402


def timed(fns, args):
    med = timer.interleaved(fns, args.rounds, lambda fn: timer.cuda(fn, args.reps, args.warmup))
    return {name: timer.percentile(xs, 0.5) for name, xs in med.items()}


OLD = None  # --with-old: the older tree's package (fattn_old)


def with_old(mks):
    """The calls that mks (name -> builder of a call from a package: lambda api: ...) build from this tree, and
    where --with-old is given from the older tree as well, named old:NAME."""
    out = {name: mk(fattn) for name, mk in mks.items()}
    if OLD is not None:
        out.update({"old:" + name: mk(OLD) for name, mk in mks.items()})
    return out


def old_of(impl):
    """"old:" for the older tree's rows, else "" (their peers' names)."""
    return "old:" if impl.startswith("old:") else ""


def variant_of(q, k, v, **kw):
    return fattn._C._dev.plan(q, k, v, torch.empty_like(q), **kw)["variant"]


def window_rows(args):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((1, 16, 16384, 128), generator=g, device="cuda").half() for _ in range(3))
    fns = {"causal": lambda: fattn.attention(q, k, v, causal=True),
           "window1k": lambda: fattn.attention(q, k, v, causal=True, window=(1024, 0))}
    p50 = timed(fns, args)
    return [{"target": "window", "impl": name, "p50_us": us, "variant": variant_of(
        q, k, v, causal=1, window=(1024, 0) if name == "window1k" else None),
        "speedup_vs_causal": p50["causal"] / us} for name, us in p50.items()]


def batch(lengths, count, seed):
    """`count` fp16 arrays of a batch of `lengths` (H=16, D=128): dense (B, S_max, H, D), the same rows packed
    (total, H, D), the prefix sums and S_max."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    smax = max(lengths)
    dense = [torch.randn((len(lengths), smax, 16, 128), generator=g, device="cuda").half() for _ in range(count)]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    packed = [torch.cat([x[i, :n] for i, n in enumerate(lengths)]) for x in dense]
    return dense, packed, cu, smax


def packed_rows(args, lengths, name):
    dense, packed, cu, smax = batch(lengths, 3, seed=1)
    b = len(lengths)
    rows = []
    pool = itertools.cycle([cu.clone() for _ in range(65)])  # more arrays than fattn remembers (_indices.LIMIT)
    for causal in (False, True):
        mode = "bottom_right" if causal else False

        def fresh(api, c, mode=mode):
            return api.attention_varlen(*packed, c, c, max_seqlen_q=smax, max_seqlen_k=smax, causal=mode)
        fns = with_old({
            "dense": lambda api: lambda: api.attention(*dense, causal=mode, layout="bshd"),
            "varlen": lambda api: lambda: api.attention_varlen(*packed, cu, cu, max_seqlen_q=smax, max_seqlen_k=smax,
                                                               causal=mode),
            "varlen-new-arrays": lambda api: lambda: fresh(api, next(pool)),
            "varlen-trusted": lambda api: lambda: api.attention_varlen(*packed, cu, cu, max_seqlen_q=smax,
                                                                       max_seqlen_k=smax, causal=mode,
                                                                       check_indices=False)})
        p50 = timed(fns, args)
        real = sum(lengths) if not causal else sum(n * (n + 1) / 2 for n in lengths)
        padded = b * smax if not causal else b * smax * (smax + 1) / 2
        vplan = fattn._C._dev.plan(packed[0], packed[1], packed[2], torch.empty_like(packed[0]), causal=2 if causal
                                   else 0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=smax, max_seqlen_k=smax)
        dplan = fattn._C._dev.plan(*dense, torch.empty_like(dense[0]), causal=2 if causal else 0, layout=1)
        for impl, us in p50.items():
            rows.append({"target": name, "impl": impl, "causal": causal, "lengths": lengths, "p50_us": us,
                         "variant": (dplan if impl.endswith("dense") else vplan)["variant"],
                         "speed_vs_dense": p50[old_of(impl) + "dense"] / us, "real_over_padded_work": real / padded})
    return rows


def packed_bwd_rows(args, lengths, name):
    """The backward of a packed batch (attention_varlen_backward) against the dense backward on the same data."""
    dense, packed, cu, smax = batch(lengths, 4, seed=3)
    rows = []
    for causal in (False, True):
        mode = "bottom_right" if causal else False
        fns, dense_of = {}, {}
        for cap in (0.0, 30.0):  # plain, and a softcap (v2's packed x score-modifying kernels; v1 beside them)
            sfx = "-softcap" if cap else ""
            do, dl = fattn.attention(*dense[:3], causal=mode, layout="bshd", softcap=cap, return_lse=True)
            po, pl = fattn.attention_varlen(*packed[:3], cu, cu, max_seqlen_q=smax, max_seqlen_k=smax, causal=mode,
                                            softcap=cap, return_lse=True)
            fns["dense" + sfx] = lambda do=do, dl=dl, cap=cap: fattn.attention_backward(
                dense[3], *dense[:3], do, dl, causal=mode, layout="bshd", softcap=cap)
            for var in ((None, "v1") if cap else (None,)):
                fns["varlen" + sfx + ("-v1" if var else "")] = lambda po=po, pl=pl, cap=cap, var=var: \
                    fattn.attention_varlen_backward(packed[3], *packed[:3], po, pl, cu, cu, max_seqlen_q=smax,
                                                    max_seqlen_k=smax, causal=mode, softcap=cap, variant=var)
                dense_of["varlen" + sfx + ("-v1" if var else "")] = "dense" + sfx
        p50 = timed(fns, args)
        for impl, us in p50.items():
            rows.append({"target": name, "impl": impl, "causal": causal, "lengths": lengths, "p50_us": us,
                         "speed_vs_dense": p50[dense_of.get(impl, impl)] / us})
    return rows


def mods_rows(args):
    g = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for d in (64, 128, 256):
        q, k, v, dout = (torch.randn((4, 16, 4096, d), generator=g, device="cuda").half() for _ in range(4))
        grads = [torch.empty_like(x) for x in (q, k, v)]
        stream = torch.cuda.current_stream().cuda_stream or 1  # (DLPack: 1 names the legacy default stream)
        al = torch.tensor([2.0 ** (-8.0 * (i + 1) / 16) for i in range(16)], device="cuda")
        kinds = {}
        for fam, vkw in (("default", {}), ("v2", {"variant": "v2"})):
            for mod, mkw in (("plain", {}), ("softcap", {"softcap": 30.0}), ("alibi", {"alibi_slopes": al}),
                             ("both", {"softcap": 30.0, "alibi_slopes": al})):
                kinds[f"{mod}-{fam}"] = {**vkw, **mkw}
        for causal in (False, True):
            saved = {name: fattn.attention(q, k, v, causal=causal, return_lse=True, **kw) for name, kw in kinds.items()}
            fwd = {name: (lambda kw=kw: fattn.attention(q, k, v, causal=causal, **kw)) for name, kw in kinds.items()}
            bwd = {name: (lambda kw=kw, o=saved[name]: fattn.attention_backward(dout, q, k, v, o[0], o[1],
                                                                                causal=causal, **kw))
                   for name, kw in kinds.items()}
            for mode, fns in (("fwd", fwd), ("bwd", bwd)):
                p50 = timed(fns, args)
                for name, us in p50.items():
                    if mode == "fwd":
                        plan = fattn._C._dev.plan(q, k, v, torch.empty_like(q), causal=int(causal), **kinds[name])
                    else:  # the backward's own plan: the variant whose backward ran
                        o = saved[name]
                        plan = fattn._C._dev.plan_backward(dout, q, k, v, o[0], o[1], *grads, causal=int(causal),
                                                           stream=stream, **kinds[name])
                    rows.append({"target": "mods", "impl": name, "mode": mode, "d": d, "causal": causal,
                                 "p50_us": us, "variant": plan["variant"],
                                 "time_vs_plain": us / p50["plain-" + name.split("-")[1]]})
    return rows


# gpt-oss-like prefill with sinks: (B, H, H_kv, S, D) and the mask -- full causal and its 128-key window layers
GPT_OSS_PREFILL = [((1, 64, 8, 4096, 64), {"causal": True}),
                   ((1, 64, 8, 4096, 64), {"causal": True, "window": (128, 0)}),
                   ((8, 64, 8, 1024, 64), {"causal": True})]


def sinks_rows(args):
    g = torch.Generator(device="cuda").manual_seed(3)
    stream = torch.cuda.current_stream().cuda_stream or 1
    rows = []
    for (b, h, hk, sq, d), kw in GPT_OSS_PREFILL + [((32, 16, 16, 512, 128), {})]:
        q = torch.randn((b, h, sq, d), generator=g, device="cuda").half()
        k, v = (torch.randn((b, hk, sq, d), generator=g, device="cuda").half() for _ in range(2))
        sinks = torch.randn((h,), generator=g, device="cuda")

        def with_pass():
            out, lse = fattn.attention(q, k, v, return_lse=True, **kw)
            fattn._C.sinks(out, lse, sinks, stream=stream)
        fns = {"plain": lambda: fattn.attention(q, k, v, **kw),
               "sinks": lambda: fattn.attention(q, k, v, sinks=sinks, **kw), "sinks-pass": with_pass}
        p50 = timed(fns, args)
        for name, us in p50.items():
            rows.append({"target": "sinks", "impl": name, "shape": [b, h, hk, sq, d], **kw, "p50_us": us,
                         "variant": variant_of(q, k, v, causal=1 if kw.get("causal") else 0,
                                               window=kw.get("window")),
                         "time_vs_plain": us / p50["plain"]})
    for b, sk in ((1, 32768), (8, 8192), (64, 8192)):  # split, split, unsplit (v2's decode kernels)
        h, hk, d = 64, 8, 64
        q = torch.randn((b, 1, h, d), generator=g, device="cuda").half()
        kc, vc = (torch.randn((b, sk, hk, d), generator=g, device="cuda").half() for _ in range(2))
        lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        sinks = torch.randn((h,), generator=g, device="cuda")
        kw = {"cache_seqlens": lens, "check_indices": False}

        def decode_pass():
            out, lse = fattn.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
            fattn._C.sinks(out, lse, sinks, layout=1, stream=stream)
        fns = {"plain": lambda: fattn.attention_with_kvcache(q, kc, vc, **kw),
               "sinks": lambda: fattn.attention_with_kvcache(q, kc, vc, sinks=sinks, **kw), "sinks-pass": decode_pass}
        p50 = timed(fns, args)
        for name, us in p50.items():
            rows.append({"target": "sinks", "impl": name, "decode": [b, h, hk, sk, d], "p50_us": us,
                         "time_vs_plain": us / p50["plain"]})
    return rows


def paged_prefill_rows(args):
    g = torch.Generator(device="cuda").manual_seed(5)
    b, h, hk, d, sq, sk = 8, 32, 8, 128, 512, 4096
    q = torch.randn((b, sq, h, d), generator=g, device="cuda").half()
    kc, vc = (torch.randn((b, sk, hk, d), generator=g, device="cuda").half() for _ in range(2))
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    mks, caches = {}, {"contiguous": (kc, vc, None)}
    for ps in (16, 32, 64, 256):
        n = b * sk // ps
        perm = (torch.arange(n) if args.page_order == "sequential"
                else torch.randperm(n, generator=torch.Generator().manual_seed(ps))).to("cuda")
        table = perm.reshape(b, sk // ps).to(torch.int32)
        pool_k, pool_v = (torch.empty((n, ps, hk, d), device="cuda", dtype=torch.half) for _ in range(2))
        pool_k[perm] = kc.reshape(n, ps, hk, d)  # page perm[i] holds the i-th page of the contiguous keys
        pool_v[perm] = vc.reshape(n, ps, hk, d)
        caches[f"paged{ps}"] = (pool_k, pool_v, table)
    for name, (k, v, table) in caches.items():
        for var in ("v3", "v2"):
            mks[f"{var}-{name}"] = lambda api, k=k, v=v, table=table, var=var: lambda: api.attention_with_kvcache(
                q, k, v, cache_seqlens=lens, block_table=table, variant=var, check_indices=False)
    p50 = timed(with_old(mks), args)
    rows = []
    for impl, us in p50.items():
        var = impl.split("-")[0]
        rows.append({"target": "paged_prefill", "impl": impl, "shape": [b, h, hk, sq, sk, d], "p50_us": us,
                     "page_order": args.page_order,
                     "time_vs_contiguous": us / p50[f"{var}-contiguous"],
                     "time_vs_v3_contiguous": us / p50[old_of(impl) + "v3-contiguous"]})
    return rows


def sinks_bwd_rows(args):
    g = torch.Generator(device="cuda").manual_seed(4)
    stream = torch.cuda.current_stream().cuda_stream or 1
    rows = []
    for (b, h, hk, sq, d), kw in GPT_OSS_PREFILL:
        q, dout = (torch.randn((b, h, sq, d), generator=g, device="cuda").half() for _ in range(2))
        k, v = (torch.randn((b, hk, sq, d), generator=g, device="cuda").half() for _ in range(2))
        sinks = torch.randn((h,), generator=g, device="cuda")
        out, lse = fattn.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
        dsinks = torch.empty_like(sinks)

        def with_pass():
            fattn.attention_backward(dout, q, k, v, out, lse, **kw)
            fattn._C.sinks(out, lse, sinks, stream=stream, dout=dout, dsinks=dsinks)
        fns = {"plain": lambda: fattn.attention_backward(dout, q, k, v, out, lse, **kw),
               "sinks": lambda: fattn.attention_backward(dout, q, k, v, out, lse, sinks=sinks, **kw),
               "sinks-pass": with_pass}
        p50 = timed(fns, args)
        for name, us in p50.items():
            rows.append({"target": "sinks_bwd", "impl": name, "shape": [b, h, hk, sq, d], **kw, "p50_us": us,
                         "time_vs_plain": us / p50["plain"]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--old", help="time an older tree built by bench/old_tree.sh in this folder (fattn_old) instead")
    ap.add_argument("--with-old", help="also time an older tree built by bench/old_tree.sh in this folder, "
                    "interleaved (varlen, ragged, paged_prefill)")
    ap.add_argument("--page-order", choices=("random", "sequential"), default="random",
                    help="paged_prefill: the pages' physical order in the pool (sequential: the contiguous cache's "
                    "own layout, so the paged call reads the same bytes in the same order through the table)")
    ap.add_argument("--targets", default="window,varlen,ragged,varlen_bwd,mods,sinks,sinks_bwd,paged_prefill",
                    help="comma-separated subset")
    args = ap.parse_args()
    if args.old:
        global fattn
        sys.path.insert(0, args.old)
        import fattn_old as fattn
    elif args.with_old:
        global OLD
        sys.path.insert(0, args.with_old)
        import fattn_old as OLD
    want = set(args.targets.split(","))
    rows = window_rows(args) if "window" in want else []
    if "varlen" in want:
        rows += packed_rows(args, [2048] * 8, "varlen-equal")
    g = torch.Generator().manual_seed(7)
    ragged = [int(x) for x in torch.randint(128, 8193, (8,), generator=g)]
    if "ragged" in want:
        rows += packed_rows(args, ragged, "ragged")
    if "varlen_bwd" in want:
        rows += packed_bwd_rows(args, [2048] * 8, "varlen-bwd-equal")
    if "mods" in want:
        rows += mods_rows(args)
    if "sinks" in want:
        rows += sinks_rows(args)
    if "paged_prefill" in want:
        rows += paged_prefill_rows(args)
    if "sinks_bwd" in want:
        rows += sinks_bwd_rows(args)
    for r in rows:
        extra = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("target", "impl", "p50_us", "lengths")}
        print(f"{r['target']:>13} {r['impl']:>9} {r['p50_us']:10.1f} us  {extra}")
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "git_sha": os.environ.get("FATTN_GIT_SHA", "unknown"), "flush": timer.flush_mode(),
                "ragged_lengths": ragged}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
