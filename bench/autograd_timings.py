"""The torch call paths of one attention, timed on the GPU (CUDA events, L2 flushed, median of 10): the forward
direct, with the LSE, and through autograd (inputs that require grad); the backward direct and through autograd;
forward + backward through autograd -- what showed the registered op's host time (evidence/backward/
h100_autograd_5f62ada.md).  Also prints the plans (variant, config, grid) forward and backward would run.

    python3 bench/autograd_timings.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fattn  # noqa: E402
from fattn import _C  # noqa: E402
from fattn.testing import timer  # noqa: E402


def med(fn):
    return timer.percentile(timer.cuda(fn, 10, 2), 0.5)


def main():
    for (b, h, s, d) in ((16, 16, 1024, 128), (32, 32, 512, 64)):
        for causal in (False, "top_left"):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
            out, lse = fattn.attention(q, k, v, causal=causal, return_lse=True)
            leafs = tuple(x.detach().requires_grad_() for x in (q, k, v))
            o2 = fattn.attention(*leafs, causal=causal)
            t = {"fwd": med(lambda: fattn.attention(q, k, v, causal=causal)),
                 "fwd+lse": med(lambda: fattn.attention(q, k, v, causal=causal, return_lse=True)),
                 "fwd autograd": med(lambda: fattn.attention(*leafs, causal=causal)),
                 "bwd": med(lambda: fattn.attention_backward(do, q, k, v, out, lse, causal=causal)),
                 "fwd+bwd autograd": med(lambda: torch.autograd.grad(fattn.attention(*leafs, causal=causal), leafs,
                                                                     do)),
                 "bwd autograd": med(lambda: torch.autograd.grad(o2, leafs, do, retain_graph=True))}
            print(b, h, s, d, causal, " ".join(f"{name}={us:.1f}" for name, us in t.items()), flush=True)
            code = 1 if causal else 0
            print("    plan", _C._dev.plan(q, k, v, out, lse, causal=code))
            print("    plan_backward", _C._dev.plan_backward(do, q, k, v, out, lse, q, k, v, causal=code))


if __name__ == "__main__":
    main()
