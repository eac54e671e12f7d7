"""The SM clock and board power an implementation sustains: each implementation runs back to back (no flush) for a
few seconds while nvidia-smi samples the GPU every 100 ms; per implementation and phase (taking turns, so that heat
builds alike) the median SM clock, power and temperature of its samples, its calls' mean time, and the TFLOP/s
that gives.  Whether one implementation runs at lower clocks than another under the board's power cap at the same
shape -- which an events timer folds into its time -- is what this shows.

    python3 bench/clock_probe.py --shape 4,16,4096,128 --mode bwd [--causal] [--dtype bf16] [--seconds 3] [--turns 2]

Implementations: fattn (its default variant), torch cudnn.  Needs nvidia-smi on PATH.
"""
import argparse
import statistics as st
import subprocess
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
import fattn  # noqa: E402

QUERY = "clocks.sm,power.draw,temperature.gpu"


def sampled(run, seconds):
    """Call run() back to back for `seconds` while nvidia-smi samples; the samples and the calls' mean time (ms)."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # nvidia-smi's first samples
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            run()
        n += 5
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / n
    smi.terminate()
    out, _ = smi.communicate()
    rows = []
    for line in out.strip().splitlines()[3:]:  # skip the samples taken before the loop ran at full tilt
        try:
            rows.append([float(x) for x in line.split(",")])
        except ValueError:
            pass
    return rows, ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, help="B,H,S,D")
    ap.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--turns", type=int, default=2)
    args = ap.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    dt = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dt, generator=g) for _ in range(4))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flops = 4 * b * h * s * s * d * (0.5 if args.causal else 1.0) * (2.5 if args.mode == "bwd" else 1.0)

    def cudnn_call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return sdpa(q, k, v, is_causal=args.causal)

    if args.mode == "fwd":
        impls = {"fattn": lambda: fattn.attention(q, k, v, causal=args.causal), "torch:cudnn": cudnn_call}
    else:
        out, lse = fattn.attention(q, k, v, causal=args.causal, return_lse=True)
        impls = {"fattn": lambda: fattn.attention_backward(do, q, k, v, out, lse, causal=args.causal)}
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o_t = sdpa(qg, kg, vg, is_causal=args.causal)
        impls["torch:cudnn"] = lambda: torch.autograd.grad(o_t, (qg, kg, vg), do, retain_graph=True)
    for fn in impls.values():  # warm up, and leave the GPU busy so the first turn starts hot
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    print(f"shape {args.shape} mode {args.mode} causal={args.causal} dtype {args.dtype} "
          f"GPU {torch.cuda.get_device_name()}")
    print(f"{'turn':>4} {'impl':12} {'ms/call':>8} {'TFLOP/s':>8} {'MHz p50':>8} {'MHz min':>8} {'W p50':>6} {'C p50':>5}")
    for turn in range(args.turns):
        for name, fn in impls.items():
            rows, ms = sampled(fn, args.seconds)
            if not rows:
                print(f"{turn:>4} {name:12} {ms:8.3f}  (no clock samples)")
                continue
            mhz = [r[0] for r in rows]
            print(f"{turn:>4} {name:12} {ms:8.3f} {flops / ms / 1e9:8.1f} {st.median(mhz):8.0f} {min(mhz):8.0f} "
                  f"{st.median(r[1] for r in rows):6.0f} {st.median(r[2] for r in rows):5.0f}")


if __name__ == "__main__":
    main()
