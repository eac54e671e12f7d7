"""Tune fattn's kernel configurations: a microbenchmark sweep (micro) or an evolutionary search (evo).

examples:
    python -m fattn.tune micro --shape 8,16,2048,128                  # v2 on the GPU: Top-K of the whole space
    python -m fattn.tune evo --shape 8,16,2048,128 --budget 32 --seed 1 --save
    python -m fattn.tune evo --device cpu --dtype fp32 --shape 1,4,512,64 --budget 12 --save

micro writes OUT/micro_log.csv (every config: ok / wrong / compile_failed / launch_failed / pruned) and
OUT/micro_best.json (Top-K); evo writes OUT/evo_log.csv and OUT/evo_best.json (leaderboard, the default's time)
and with --save re-measures the winner against the default, interleaved, and stores it in the tuned-config cache
(fattn/_tuned.py; --cache or $FATTN_TUNED_CACHE) that fattn.attention consults only if it is faster beyond the noise.
OUT defaults to ~/.cache/fattn/tune/<problem>.  Progress goes to stderr, a summary to stdout.
Exit status: 0; 1 when no candidate passed; 2 for usage errors.
"""
import argparse
import os
import sys

import fattn

from . import search
from .space import Problem

CAUSAL = {"none": False, "top_left": "top_left", "bottom_right": "bottom_right"}


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m fattn.tune", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("micro", "evo"):
        p = sub.add_parser(name)
        p.add_argument("--shape", required=True, help="B,H,S,D (Sq = Sk = S unless --sk)")
        p.add_argument("--sk", type=int, help="key length when it differs from S")
        p.add_argument("--hkv", type=int, default=0, help="kv heads (GQA); default H")
        p.add_argument("--causal", choices=list(CAUSAL), default="none")
        p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                       help="default fp16 on the GPU, fp32 on the CPU")
        p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        p.add_argument("--family", choices=["v2", "cpu"], help="kernel family (default: v2 on cuda, cpu on cpu)")
        p.add_argument("--out", help="directory for the logs (default ~/.cache/fattn/tune/<problem>)")
        p.add_argument("--reps", type=int, default=None, help="timed repeats per candidate")
        p.add_argument("--quiet", action="store_true")
        p.add_argument("--top", type=int, default=5)
        if name == "micro":
            p.add_argument("--limit", type=int, help="time only the first N kept configs")
        else:
            p.add_argument("--budget", type=int, default=24, help="candidates to evaluate (default 24)")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--population", type=int, default=8)
            p.add_argument("--seeds-from", help="micro_best.json to seed from (default OUT/micro_best.json)")
            p.add_argument("--save", action="store_true", help="store the winner in the tuned-config cache")
            p.add_argument("--cache", help="tuned-config cache path (default $FATTN_TUNED_CACHE or ~/.cache/fattn)")
    args = ap.parse_args(argv)
    try:
        b, h, s, d = (int(x) for x in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape: expected B,H,S,D, got {args.shape!r}")
    if min(b, h, s, d) < 1 or (args.sk is not None and args.sk < 1):
        ap.error(f"--shape / --sk: every size must be >= 1, got {args.shape!r}" +
                 (f", --sk {args.sk}" if args.sk is not None else ""))
    for flag in ("reps", "top", "limit", "budget", "population"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            ap.error(f"--{flag}: must be >= 1, got {value}")
    if args.out and (os.path.exists(args.out) and not os.path.isdir(args.out)):
        ap.error(f"--out {args.out}: not a folder (it holds the search's logs)")
    if getattr(args, "save", False) and args.cache:
        if os.path.isdir(args.cache):
            ap.error(f"--cache {args.cache}: is a folder; give the cache file's name")
        folder = os.path.dirname(os.path.abspath(args.cache))
        existing = folder
        while not os.path.isdir(existing):  # save() creates the missing folders
            existing = os.path.dirname(existing)
        if not os.access(existing, os.W_OK) or (os.path.exists(args.cache) and not os.access(args.cache, os.W_OK)):
            ap.error(f"--cache {args.cache}: not writable")
    if args.device == "cuda" and not fattn.cuda_available():
        ap.error("--device cuda (the default): no usable CUDA GPU here; tune the CPU backend with --device cpu")
    dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    args.problem = Problem(b, h, s, args.sk or s, d, CAUSAL[args.causal], dtype, args.device, args.hkv)
    args.out = args.out or search.default_out_dir(args.problem)
    try:  # the logs' folder, before the search rather than after it
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {args.out}: {e.strerror or e}")
    if not os.access(args.out, os.W_OK):
        ap.error(f"--out {args.out}: not writable")
    return args


def main(argv=None):
    args = parse(argv)
    reps = args.reps or (20 if args.device == "cuda" else 5)
    try:
        if args.cmd == "micro":
            best, rows = search.micro(args.problem, family=args.family, top=args.top, out_dir=args.out, reps=reps,
                                      quiet=args.quiet, limit=args.limit)
            print(f"micro {args.problem.label()}: {sum(r['status'] == 'ok' for r in rows)} ok of {len(rows)}; top:")
            for t in best["top"]:
                print(f"  {t['config']}  {t['tflops']:.2f} TFLOP/s  {t['p50_us']:.1f} us")
            return 0 if best["top"] else 1
        best, rows = search.evo(args.problem, family=args.family, budget=args.budget, seed=args.seed,
                                population=args.population, out_dir=args.out, seeds_from=args.seeds_from, reps=reps,
                                quiet=args.quiet, top=args.top)
    except ValueError as e:
        print(f"fattn.tune: {e}", file=sys.stderr)
        return 2
    print(f"evo {args.problem.label()}: {best['counts']}")
    if not best["leaderboard"]:
        print("no candidate passed the gate")
        return 1
    top = best["leaderboard"][0]
    print(f"  default {best['default']['config']}  {best['default']['p50_us'] or float('nan'):.1f} us")
    print(f"  best    {top['config']}  {top['p50_us']:.1f} us  ({search.speedup(best):.3f}x the default)")
    print(f"  logs in {args.out}")
    if args.save:
        from .. import _tuned

        check = search.confirm(args.problem, best["family"], best, reps=reps, quiet=args.quiet)
        if not check["confirmed"]:
            print(f"  not saved: re-measured against the default, interleaved over {check['rounds']} rounds, the winner "
                  f"is {check['speedup']:.3f}x ({check['why']})")
            return 0
        entry = search.cache_entry(args.problem, best["family"], best)
        entry["confirmed_speedup"] = check["speedup"]
        try:
            path = _tuned.save([entry], args.cache)
        except OSError as e:
            print(f"fattn.tune: not saved: --cache {args.cache or _tuned.path()}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"  confirmed {check['speedup']:.3f}x over {check['rounds']} interleaved rounds; saved to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
