"""packed_train_step.py -- a packed-sequence training step through fattn's autograd, the way a model calls it: L layers
of (qkv projection, attention_varlen, output projection) on one packed batch, loss.backward(), every layer given the
same cu_seqlens tensor.  Times the step back to back (events) with the default checked call and with
check_indices=False, for this tree and, with --old DIR, fattn_old (bench/old_tree.sh) interleaved in one
process.  Shows what per-layer index reads cost a real step: each
read waits for the GPU, so the host cannot run ahead of it.

    python3 bench/packed_train_step.py [--old DIR] [--layers 12] [--batch 8] [--seqlen 512] [--heads 8] [--dim 64]
"""
import argparse
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="folder holding the package fattn_old")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    mods = {"new": importlib.import_module("fattn")}
    if a.old:
        sys.path.insert(0, a.old)
        mods["old"] = importlib.import_module("fattn_old")
    dev, dt = torch.device("cuda"), torch.float16
    torch.manual_seed(0)
    width, total = a.heads * a.dim, a.batch * a.seqlen
    qkv = [torch.nn.Linear(width, 3 * width, device=dev, dtype=dt) for _ in range(a.layers)]
    proj = [torch.nn.Linear(width, width, device=dev, dtype=dt) for _ in range(a.layers)]
    x0 = torch.randn(total, width, device=dev, dtype=dt, requires_grad=True)
    cu = torch.arange(0, total + 1, a.seqlen, device=dev, dtype=torch.int32)

    def step(mod, checked):
        x = x0
        for wq, wo in zip(qkv, proj):
            q, k, v = wq(x).view(total, 3, a.heads, a.dim).unbind(1)
            o = mod.attention_varlen(q, k, v, cu, cu, max_seqlen_q=a.seqlen, max_seqlen_k=a.seqlen, causal=True,
                                     check_indices=checked)
            x = x + wo(o.reshape(total, width))
        x.float().square().mean().backward()

    times = {}
    for _ in range(a.rounds):
        for tag, mod in mods.items():
            for checked in (True, False):
                for _ in range(3):
                    step(mod, checked)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(a.steps):
                    step(mod, checked)
                e1.record()
                torch.cuda.synchronize()
                times.setdefault((tag, checked), []).append(e0.elapsed_time(e1) * 1e3 / a.steps)
    print(f"{torch.cuda.get_device_name()}  {a.layers} layers, packed {a.batch} x {a.seqlen}, H={a.heads} D={a.dim}, "
          f"causal, fp16; {a.rounds} rounds x {a.steps} steps")
    print(f"{'tree':<5} {'call':<10} {'us/step (rounds)':>40}")
    for (tag, checked), us in times.items():
        print(f"{tag:<5} {'checked' if checked else 'unchecked':<10} {statistics.median(us):>10.1f} "
              f"({', '.join(f'{x:.1f}' for x in us)})")


if __name__ == "__main__":
    main()
