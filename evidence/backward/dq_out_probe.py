"""dQ's error against float64 for this tree, an older one and torch cudnn: two heads of each point (batch 0), a causal
mask (top-left; Sq = Sk) or none (CAUSAL=0).  The older tree is the package fattn_old built by bench/old_tree.sh into /tmp/fattn_old_tree.
Run from the repository root on a GPU machine: SHAPES="8,32,2048,64 8,16,2048,128" DTYPES="fp16 bf16" python3
evidence/backward/dq_out_probe.py (h100_v3_bwd_dq_out_causal_probe_278d447.txt)."""
import os, sys
import torch
sys.path = [os.getcwd(), "/tmp/fattn_old_tree"] + [x for x in sys.path if ".abold" not in x]
import fattn, fattn_old
from fattn.testing import reference, suite

SH = [tuple(int(x) for x in s.split(",")) for s in os.environ.get("SHAPES", "8,32,2048,64 8,16,2048,128").split()]
for dt in os.environ.get("DTYPES", "fp16").split():
    for B, H, S, D in SH:
        causal = "top_left" if os.environ.get("CAUSAL", "1") != "0" else False
        p = dict(B=B, H=H, Sq=S, Sk=S, D=D, H_kv=H, dtype=dt, device="cuda", causal=causal)
        q, k, v = suite.make_inputs(p)
        dout = suite.make_inputs(p, 1)[0]
        qs, ks, vs, ds = (x[:1, :2].contiguous() for x in (q, k, v, dout))
        out, lse = fattn.attention(qs, ks, vs, causal=causal, return_lse=True)
        ref = reference.gradients(qs, ks, vs, ds, causal)[0]
        e_new = (fattn.attention_backward(ds, qs, ks, vs, out, lse, causal=causal)[0].double() - ref).abs()
        e_old = (fattn_old.attention_backward(ds, qs, ks, vs, out, lse, causal=causal)[0].double() - ref).abs()
        # torch cudnn on the same inputs ((B, H, S, D), sdpa's layout too)
        qt, kt, vt = (x.detach().clone().requires_grad_() for x in (qs, ks, vs))
        from torch.nn.attention import sdpa_kernel, SDPBackend
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
            o.backward(ds)
        e_cud = (qt.grad.double() - ref).abs()
        print(f"{dt} {B},{H},{S},{D} {causal} dq err max new {e_new.max().item():.2e} old {e_old.max().item():.2e} "
              f"cudnn {e_cud.max().item():.2e} | mean new {e_new.mean().item():.2e} old {e_old.mean().item():.2e} "
              f"cudnn {e_cud.mean().item():.2e} | |ref|max {ref.abs().max().item():.2f}", flush=True)
