"""Benchmark fattn's variants against torch's scaled_dot_product_attention backends.

Every point is validated first (the accuracy rule against a float64 reference on the same inputs), then timed: on
CUDA with CUDA events, L2 flushed before each repeat, p50 and p90 of the repeats; on the CPU with the monotonic
clock.  FLOPs are 4*B*H*Sq*Sk*D, halved when causal, times 2.5 for --mode bwd and 3.5 for --mode fwdbwd.  Needs PyTorch (a benchmark dependency only; fattn itself
never imports it).  The engine is fattn.testing.suite; this is its command line.

    python -m fattn.bench                                        # 1,8,512,64 on the default device
    python -m fattn.bench --shape 4,16,2048,128 --causal --dtype bf16
    python -m fattn.bench --shape 1,4,64,64 --sk 200 --causal-mode bottom_right --causal
    python -m fattn.bench --shape 8,32,1,128 --sk 8192 --hkv 8    # GQA decode step
    python -m fattn.bench --grid fa3 --json fa3.json --md fa3.md --csv fa3.csv
    python -m fattn.bench --grid decode --both-causal --causal-mode bottom_right
    python -m fattn.bench --grid cpu --reps 3
    python -m fattn.bench --grid fa3 --mode bwd                  # the backward alone; --mode fwdbwd: both
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=2 -m fattn.bench --grid cp --json cp.json --plot cp.png
    python -m fattn.bench --grid paged --json paged.json         # decode over a paged KV cache

Grids cp (context parallelism, fattn.testing.cp; under torchrun) and paged (decode over a paged KV cache,
fattn.testing.paged) take their own options (--grid cp --help).

Grids (fattn.testing.grids): seeds, fa3, decode, cpu; and cp, paged.  fattn:X / best torch = fastest torch p50 (of the backends
that passed validation) / fattn:X's p50, >1 = fattn faster.  --shape, --sk and --hkv apply to --shape runs only.
Exit status: 0; 1 when a fattn variant fails validation or cannot run a requested point; 2 for usage errors.
"""
import argparse
import sys

import fattn
from fattn.testing import grids, report, suite


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fattn.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,8,512,64", help="B,H,S,D (default 1,8,512,64)")
    ap.add_argument("--sk", type=int, help="key length (default S)")
    ap.add_argument("--hkv", type=int, help="kv heads, dividing H (default H)")
    ap.add_argument("--causal", action="store_true",
                    help="--shape runs: causal (grids choose their own; --both-causal runs a grid both ways)")
    ap.add_argument("--causal-mode", choices=("top_left", "bottom_right"),
                    help="the causal alignment (default top_left); on its own it also turns --causal on")
    ap.add_argument("--both-causal", action="store_true", help="run every point causal and non-causal")
    ap.add_argument("--dtype", choices=tuple(suite.DTYPES), help="default fp16 on cuda, fp32 on cpu")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default cuda if fattn.cuda_available()")
    ap.add_argument("--variants", help="fattn variants, comma-separated (default all); with --mode bwd, 'v3-det' "
                                       "times v3's backward in deterministic mode")
    ap.add_argument("--torch-backends", help="flash,efficient,cudnn,math on cuda; cpu on cpu; 'none' for no torch")
    ap.add_argument("--grid", choices=tuple(grids.GRIDS), help="run a named grid instead of --shape")
    ap.add_argument("--mode", choices=tuple(grids.MODES), default="fwd",
                    help="what is timed: fwd (default), bwd (the backward alone: gradients of a forward done once) "
                         "or fwdbwd (forward and backward)")
    for out in ("--json", "--csv", "--md"):
        ap.add_argument(out, metavar="PATH")
    ap.add_argument("--gemm", action="store_true",
                    help="add cublas:gemm, the two unfused batched GEMMs of the same shape through cuBLAS (cuda)")
    ap.add_argument("--plot", metavar="PATH", help="PNG: TFLOP/s vs sequence length, or latency bars (needs matplotlib)")
    ap.add_argument("--reps", type=int, help="timed repeats (default 50 on cuda, 10 on cpu)")
    ap.add_argument("--warmup", type=int, help="untimed calls first (default 10 on cuda, 2 on cpu)")
    ap.add_argument("--rounds", type=int, help="interleaved timing rounds per point (default 1 on cuda, 3 on cpu)")
    ap.add_argument("--timer", choices=("events", "batch"),
                    help="cuda timer: events around each call with the L2 flushed (default), or batch: events "
                         "around back-to-back calls (end-to-end latency); cpu calls are timed by perf_counter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress or notes on stderr")
    args = ap.parse_args(argv)
    try:
        args.shape = [int(x) for x in args.shape.split(",")]
        assert len(args.shape) == 4 and min(args.shape) > 0
    except (ValueError, AssertionError):
        ap.error(f"--shape: expected B,H,S,D positive integers, got {args.shape!r}")
    if args.hkv is not None and (args.hkv <= 0 or args.shape[1] % args.hkv):
        ap.error(f"--hkv {args.hkv} must divide H = {args.shape[1]}")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.sk is not None and args.sk < 1:
        ap.error(f"--sk {args.sk}: must be >= 1")
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--md", args.md)):
        if path:
            report.check_writable(path, flag, ap.error)
    if args.plot:
        from .plot import FORMATS, output_path

        report.check_writable(output_path(args.plot), "--plot", ap.error, FORMATS)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib (pip install matplotlib)")
    if args.grid and args.causal:
        ap.error(f"--causal: applies to --shape runs; --grid {args.grid} runs its own points (add --both-causal to "
                 "run each of them causal and non-causal)")
    args.device = "cpu" if args.grid == "cpu" else args.device or ("cuda" if fattn.cuda_available() else "cpu")
    args.error = ap.error
    return args


def build_points(args):
    mode = args.causal_mode or "top_left"
    dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    if args.grid:
        pts = grids.GRIDS[args.grid](mode, dtype, args.device, args.both_causal or args.grid != "decode")
        return [dict(p, mode=args.mode) for p in pts]
    B, H, S, D = args.shape
    causal = mode if (args.causal or args.causal_mode) else False
    return [grids.point("shape", B, H, S, D, Sk=args.sk, H_kv=args.hkv, causal=c, dtype=dtype, device=args.device,
                        mode=args.mode) for c in ((False, mode) if args.both_causal else (causal,))]


def build_impls(args):
    import torch

    if args.device == "cuda" and not (fattn.cuda_available() and torch.cuda.is_available()):
        args.error("--device cuda: fattn was built without CUDA, or torch / fattn see no GPU")
    avail = fattn.variants(args.device)
    chosen = args.variants.split(",") if args.variants else avail
    unknown = [v for v in chosen if v.removesuffix(suite.DET) not in avail]
    if unknown:
        args.error(f"--variants: {unknown} not among {avail} for {args.device}")
    names = ["cpu"] if args.device == "cpu" else list(suite.TORCH_BACKENDS)
    if args.torch_backends:
        names = [] if args.torch_backends == "none" else args.torch_backends.split(",")
    ok = set(suite.TORCH_BACKENDS) | ({"cpu"} if args.device == "cpu" else set())
    if set(names) - ok:
        args.error(f"--torch-backends: {sorted(set(names) - ok)} not among {sorted(ok)} for {args.device}")
    if args.gemm and args.device != "cuda":
        args.error("--gemm: the cuBLAS baseline runs on cuda only")
    if args.timer and args.device != "cuda":
        args.error(f"--timer: chooses between cuda timers; {args.device} calls are timed by perf_counter")
    return [f"fattn:{v}" for v in chosen] + [f"torch:{n}" for n in names] + (["cublas:gemm"] if args.gemm else [])


def missing_fattn_rows(points, impls, rows):
    """The (impl, point) pairs of requested fattn variants that produced no row (could not run the point)."""
    have = {(r["impl"], grids.key(r)) for r in rows}
    return [(i, p) for p in points for i in impls if i.startswith("fattn:") and (i, grids.key(p)) not in have]


# Grids with a runner of their own (their own options: --grid NAME --help): name -> module of fattn.testing
OWN_RUNNERS = {"cp": "cp", "paged": "paged"}


def own_runner_args(argv):
    """(module name, the arguments without `--grid NAME`) for a grid with its own runner, else None."""
    for i, a in enumerate(argv):
        name = a[len("--grid="):] if a.startswith("--grid=") else argv[i + 1] if a == "--grid" and i + 1 < len(argv) \
            else None
        if name in OWN_RUNNERS:
            return OWN_RUNNERS[name], argv[:i] + argv[i + (1 if a.startswith("--grid=") else 2):]
    return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own = own_runner_args(argv)
    if own is not None:
        import importlib

        return importlib.import_module(f"fattn.testing.{own[0]}").main(own[1])
    args = parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("fattn.bench needs PyTorch (a benchmark dependency only): pip install torch", file=sys.stderr)
        return 2
    points, impls = build_points(args), build_impls(args)
    meta, rows = suite.run(points, impls, reps=args.reps, warmup=args.warmup, rounds=args.rounds,
                           timer_name=args.timer or "events", seed=args.seed,
                           quiet=args.quiet,
                           command=" ".join(["python", "-m", "fattn.bench"] + argv))
    if rows:
        print(report.format_table(rows))
    unwritten = []
    for flag, path, writer in (("--json", args.json, report.write_json), ("--csv", args.csv, report.write_csv),
                               ("--md", args.md, report.write_md)):
        if path and rows:
            try:
                writer(path, meta, rows)
            except OSError as e:
                unwritten.append(f"{flag} {path}: {e.strerror or e}")
    if args.plot and rows:
        from .plot import plot

        try:
            print(f"fattn.bench: plot {plot(rows, meta, args.plot)}")
        except (OSError, ValueError) as e:
            unwritten.append(f"--plot {args.plot}: {getattr(e, 'strerror', None) or e}")
    for line in unwritten:
        print(f"fattn.bench: not written: {line}", file=sys.stderr)
    missing = missing_fattn_rows(points, impls, rows)
    for impl, p in missing:
        print(f"fattn.bench: {impl} could not run {grids.describe(p)} causal={p['causal']} {p['dtype']} "
              "(see the notes above)", file=sys.stderr)
    if not rows:
        print("nothing could run (see the notes above)", file=sys.stderr)
    failed = any(suite.bad(r) and r["impl"].startswith("fattn:") for r in rows)
    return 1 if failed or missing or not rows or unwritten else 0


if __name__ == "__main__":
    sys.exit(main())
