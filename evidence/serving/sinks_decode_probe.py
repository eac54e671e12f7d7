"""B=1 / B=8 decode with sinks (gpt-oss-like, D=64): this tree against an older one (fattn_old), interleaved in one
process.  PYTHONPATH=. python3 evidence/serving/sinks_decode_probe.py OLD_TREE_DIR"""
import sys
import torch
sys.path.insert(0, sys.argv[1])  # the older tree (bench/old_tree.sh); run from the repository root, PYTHONPATH=.
import fattn
import fattn_old
from fattn.testing import timer

g = torch.Generator(device="cuda").manual_seed(3)
for b, sk in ((1, 32768), (8, 8192)):
    h, hk, d = 64, 8, 64
    q = torch.randn((b, 1, h, d), generator=g, device="cuda").half()
    kc, vc = (torch.randn((b, sk, hk, d), generator=g, device="cuda").half() for _ in range(2))
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    sinks = torch.randn((h,), generator=g, device="cuda")
    kw = {"cache_seqlens": lens, "check_indices": False}
    fns = {}
    for name, api in (("new", fattn), ("old", fattn_old)):
        fns[name + ":plain"] = lambda api=api: api.attention_with_kvcache(q, kc, vc, **kw)
        fns[name + ":lse"] = lambda api=api: api.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
        fns[name + ":sinks"] = lambda api=api: api.attention_with_kvcache(q, kc, vc, sinks=sinks, **kw)
    med = timer.interleaved(fns, 5, lambda fn: timer.cuda(fn, 20, 3))
    a = fattn.attention_with_kvcache(q, kc, vc, sinks=sinks, **kw)
    o = fattn_old.attention_with_kvcache(q, kc, vc, sinks=sinks, **kw)
    print(b, sk, {k: round(timer.percentile(v, 0.5), 1) for k, v in med.items()},
          "max |new - old| with sinks:", (a.float() - o.float()).abs().max().item())
