"""Host time of one attention training step through torch autograd, beside torch cudnn and a do-nothing autograd
Function (the engine's own floor): for each, the forward of q, k, v that require grad, then torch.autograd.grad, each
step started from a synchronized GPU, p50 / min of 50 steps in microseconds of CPU wall time.  Where the host time
exceeds the kernels' GPU time, the step is host-bound and events timers read host time
(evidence/backward/h100_host_path_ed700ef.md).  Also the cost of Tensor.__dlpack__(stream) on a CUDA tensor.

    python3 bench/autograd_host.py [--shape 32,16,512,128] [--causal]
"""
import argparse
import os
import statistics as st
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fattn  # noqa: E402


class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        return g, g, g


def measure(fwd, leafs, dout, n=60, skip=10):
    f_, g_ = [], []
    for i in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.enable_grad():
            o = fwd()
        t1 = time.perf_counter()
        torch.autograd.grad(o, leafs, dout)
        t2 = time.perf_counter()
        if i >= skip:
            f_.append((t1 - t0) * 1e6)
            g_.append((t2 - t1) * 1e6)
    torch.cuda.synchronize()
    return f"fwd p50 {st.median(f_):6.1f} | grad() p50 {st.median(g_):6.1f} min {min(g_):6.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32,16,512,128", help="B,H,S,D (fp16)")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    leafs = [x.detach().requires_grad_() for x in (q, k, v)]
    stream = torch.cuda.current_stream().cuda_stream or 1
    xs = []
    for _ in range(60):
        t0 = time.perf_counter()
        q.__dlpack__(stream=stream)
        xs.append((time.perf_counter() - t0) * 1e6)
    print(f"Tensor.__dlpack__(stream) p50 {st.median(xs[10:]):.1f} us")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for _ in range(2):
        print("noop Function ", measure(lambda: Noop.apply(*leafs), leafs, dout))
        print("fattn         ", measure(lambda: fattn.attention(*leafs, causal=args.causal), leafs, dout))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            print("torch cudnn   ", measure(lambda: sdpa(*leafs, is_causal=args.causal), leafs, dout))


if __name__ == "__main__":
    main()
