"""host_calls.py -- the host's time to issue fattn's forward and backward calls, dense and packed, public API and the
bare C calls (fattn._C.forward / backward), at a small shape (B=4, S=512, H=8, D=128, fp16, causal): 200 calls, no
sync between them, median of 3 rounds.  The gap between a public call and its C call is the Python side's
(argument handling, torch allocations of the outputs and the backward's workspace).

    PYTHONPATH=. python3 bench/host_calls.py
"""
import statistics
import time

import torch

import fattn
import fattn._C as C
import fattn._torch as T
B, H, S, D = 4, 8, 512, 128
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
def issue(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    res = []
    for r in range(3):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        res.append((time.perf_counter() - t0) * 1e6 / n)
        torch.cuda.synchronize()
    return statistics.median(res)
qp, kp, vp = (x.reshape(B * S, H, D) for x in (q, k, v))
cu = torch.arange(0, B * S + 1, S, device="cuda", dtype=torch.int32)
o, l = fattn.attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=S, max_seqlen_k=S, causal=True, return_lse=True)
do = torch.randn_like(o)
kw = dict(max_seqlen_q=S, max_seqlen_k=S, causal=True, check_indices=False)
print("varlen fwd      issue us", issue(lambda: fattn.attention_varlen(qp, kp, vp, cu, cu, **kw)))
print("varlen bwd      issue us", issue(lambda: fattn.attention_varlen_backward(do, qp, kp, vp, o, l, cu, cu,
                                                                                 **kw)))
print("_attention_backward (op body) issue us",
      issue(lambda: T._attention_backward(do, qp, kp, vp, o, l, 1, None, 0, -1, -1, 0.0, cu, cu, S, S, None, False,
                                          None, None, False)))
qd = q.transpose(1, 2)
od, ld = fattn.attention(qd, qd, qd, causal=True, return_lse=True)
print("dense fwd       issue us", issue(lambda: fattn.attention(qd, qd, qd, causal=True)))
dod = torch.randn_like(od)
print("dense bwd       issue us", issue(lambda: fattn.attention_backward(dod, qd, qd, qd, od, ld, causal=True)))
ws = torch.empty(C.backward_workspace_bytes(B, H, S, D, False) // 4, device="cuda", dtype=torch.float32)
dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
s = torch.cuda.current_stream().cuda_stream
seq = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S, check_indices=False)
print("_C.backward     issue us",
      issue(lambda: C.backward(do, qp, kp, vp, o, l, dq, dk, dv, causal=1, stream=s, workspace=ws, **seq)))
out2 = torch.empty_like(qp); l2 = torch.empty_like(l)
print("_C.forward      issue us", issue(lambda: C.forward(qp, kp, vp, out2, l2, causal=1, stream=s, **seq)))
