"""decode_splits.py -- decode steps over a KV cache (contiguous and paged, the paged grid's points) at forced key-split
counts beside the planner's own, timed interleaved in one process: how many blocks a decode grid wants per
multiprocessor.  Each candidate is validated against torch's float32 result first; the timer is the paged grid's
(CUDA events, the L2 flushed before each call).

    python3 bench/decode_splits.py --batches 8,32 --sk 8192,32768 --pages 16,64 --splits 0,2,4,8 [--json PATH]

splits 0 is the planner's choice, and config -1 (--configs: v2 config indices to force); the row says what ran.
Rows: B, Sk, cache (contiguous / page size), config, splits asked, splits run, grid blocks, p50 us, K+V GB/s, speed
over the planner's choice on the same cache.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fattn  # noqa: E402
from fattn.testing import paged, timer  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--sk", default="8192,32768")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--splits", default="0,2,4,8")
    ap.add_argument("--configs", default="-1", help="v2 config indices to force (-1: the planner's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    import torch

    ints = (lambda s: [int(x) for x in s.split(",") if x])
    splits, configs = ints(a.splits), ints(a.configs)
    rows = []
    print(f"{'B':>3} {'Sk':>6} {'cache':>10} {'cfg':>4} {'ask':>4} {'ran':>4} {'blocks':>6} {'p50 us':>9} {'GB/s':>6} "
          f"{'/ planner':>9}", flush=True)
    for b in ints(a.batches):
        for sk in ints(a.sk):
            q, k, v, lens, pools = paged.make_point(b, sk, ints(a.pages))
            caches = {"contiguous": (k, v, None)}
            caches.update({f"page{ps}": pools[ps] for ps in pools})
            ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                q[i:i + 4].transpose(1, 2).float(), k[i:i + 4].transpose(1, 2).float(),
                v[i:i + 4].transpose(1, 2).float(), enable_gqa=True).transpose(1, 2) for i in range(0, b, 4)])
            fns, plans = {}, {}
            stream = torch.cuda.current_stream().cuda_stream or 1
            for cname, (ck, cv, table) in caches.items():
                for cfg in configs:
                    for n in splits:
                        out = torch.empty_like(q)

                        def run(ck=ck, cv=cv, table=table, n=n, out=out, cfg=None if cfg < 0 else cfg):
                            return fattn._C._dev.forward(q, ck, cv, out, None, causal=2, layout=1, stream=stream,
                                                         cache_seqlens=lens, block_table=table, check_indices=False,
                                                         splits=n, config=cfg)
                        plans[(cname, cfg, n)] = run()
                        err = (out.float() - ref).abs().max().item()
                        if not err <= 2e-2:
                            print(f"{cname} config={cfg} splits={n}: validation failed, max err {err:.3g}",
                                  file=sys.stderr)
                            return 1
                        fns[(cname, cfg, n)] = run
            med = timer.interleaved(fns, a.rounds, lambda fn: timer.cuda(fn, a.reps, 3))
            p50 = {key: timer.percentile(ms, 0.5) for key, ms in med.items()}
            kv_bytes = 2 * b * sk * paged.H_KV * paged.D * 2
            for (cname, cfg, n), us in p50.items():
                plan = plans[(cname, cfg, n)]
                row = {"B": b, "Sk": sk, "cache": cname, "config_asked": cfg, "config": plan["config"],
                       "splits_asked": n, "splits": plan["splits"],
                       "blocks": plan["grid"][0] * plan["grid"][1], "p50_us": us, "gbps": kv_bytes / us / 1e3,
                       "vs_planner": p50[(cname, -1, 0)] / us if (cname, -1, 0) in p50 else None,
                       "rounds": med[(cname, cfg, n)]}
                rows.append(row)
                print(f"{b:>3} {sk:>6} {cname:>10} {plan['config']:>4} {n:>4} {row['splits']:>4} "
                      f"{row['blocks']!s:>6} {us:9.1f} "
                      f"{row['gbps']:6.0f} {row['vs_planner'] or 0:9.3f}", flush=True)
            del q, k, v, pools, caches, fns
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "flush": timer.flush_mode(),
                       "args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
