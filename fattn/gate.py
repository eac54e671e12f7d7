"""Regression gate: rerun a baseline's benchmark points on the machine at hand and fail on any correctness failure
or on a drop of fattn's ratio to the best torch backend that the measurement's own noise does not explain.

    python -m fattn.gate --baseline evidence/bench/h100_v2_fa3.json [--threshold 0.03] [--rounds 5] [--no-tests]

Ratios, not absolute times: machines are shared and clocks move, but fattn and torch measured back to back in one
process move together.  Steps: (1) `pytest -k parity` here (skipped with --no-tests); (2) every point of the
baseline measured in --rounds interleaved rounds (each round times every implementation once per point, so drift
hits them alike), giving one ratio per round; (3) per point the median ratio and its noise, both on a log scale
(ratios are factors): the noise is log(q75 / q25) of the rounds, and a point is "slower" only when log(median /
baseline) falls below -(threshold + its noise + the baseline's own noise) (the baseline's: its rows' ratio_noise,
recorded by a bench run of several rounds as a relative spread, about the same thing for small spreads; taken equal
to today's where the baseline has none) -- so no amount of noise hides a drop to a fraction of the baseline, as a
relative change bounded by -100% would, and the allowance for noise is capped at MAX_NOISE (log 1.5: a median below
about 0.65x the baseline fails however noisy the rounds); "wrong" when any round failed validation (also for fattn
rows without a ratio); (4) a table; exit 1 if anything failed, or if the baseline had no fattn row to compare.
"""
import argparse
import glob
import json
import math
import os
import subprocess
import sys

from .testing import grids, report, suite, timer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NOISE = math.log(1.5)  # the most noise (both runs, log scale) a comparison allows for


def row_key(r):
    return grids.key(r) + (r["impl"],)


def label(r):
    mode = r.get("mode", "fwd")
    return grids.describe(r) + f" {r['dtype']} {r['causal'] or 'non-causal'}" + ("" if mode == "fwd" else f" {mode}")


def compare(base_rows, rounds, threshold=0.03):
    """One result per fattn row of the baseline that has a ratio.  rounds: the rows of each measuring round.
    status: 'ok'; 'slower' (median ratio below base by more than threshold + noise); 'wrong' (failed validation in
    some round); 'missing' (did not run now)."""
    out = []
    for b in base_rows:
        if not b["impl"].startswith("fattn:"):
            continue
        now = [r for rows in rounds for r in rows if row_key(r) == row_key(b)]
        if not b.get("ratio_vs_best_torch"):  # nothing to compare speed with: correctness only
            if any(suite.bad(r) for r in now):
                out.append({"point": label(b), "impl": b["impl"], "base": None, "now": None, "noise": None,
                            "change": None, "rounds": [], "status": "wrong"})
            continue
        res = {"point": label(b), "impl": b["impl"], "base": b["ratio_vs_best_torch"], "now": None, "noise": None,
               "change": None, "rounds": [r.get("ratio_vs_best_torch") for r in now]}
        ratios = [x for x in res["rounds"] if x]
        if any(suite.bad(r) for r in now):
            res["status"] = "wrong"
        elif not ratios:
            res["status"] = "missing"
        else:
            med = timer.percentile(ratios, 0.5)
            noise = math.log(timer.percentile(ratios, 0.75) / timer.percentile(ratios, 0.25))
            base_noise = b.get("ratio_noise")
            noise = min(noise + (noise if base_noise is None else base_noise), MAX_NOISE)
            res.update(now=med, noise=noise, change=med / res["base"] - 1)
            res["status"] = "slower" if math.log(med / res["base"]) < -(threshold + noise) else "ok"
        out.append(res)
    return out


def format_results(results, threshold):
    lines = [f"{'point':44s} {'impl':10s} {'base':>6s} {'now':>6s} {'noise':>6s} {'change':>8s}  "
             f"status (slower: below -({threshold:.0%} + noise of both runs))"]
    for r in results:
        now = f"{r['now']:.3f}" if r["now"] is not None else "-"
        noise = f"{r['noise']:.1%}" if r["noise"] is not None else "-"
        ch = f"{r['change']:+.1%}" if r["change"] is not None else "-"
        base = f"{r['base']:.3f}" if r["base"] is not None else "-"
        lines.append(f"{r['point']:44s} {r['impl']:10s} {base:>6s} {now:>6s} {noise:>6s} {ch:>8s}  {r['status']}")
    bad = [r for r in results if r["status"] != "ok"]
    lines.append(f"{len(results) - len(bad)} ok, {len(bad)} failed")
    return "\n".join(lines)


def points_of(rows, device):
    """The distinct benchmark points of baseline rows, as grids.point dicts."""
    seen, pts = set(), []
    for r in rows:
        k = grids.key(r)
        if k in seen:
            continue
        seen.add(k)
        pts.append(grids.point(r["grid"], r["B"], r["H"], r["Sq"], r["D"], Sk=r["Sk"], H_kv=r["H_kv"],
                               causal=r["causal"], dtype=r["dtype"], device=device, mode=r.get("mode", "fwd")))
    return pts


def default_baseline(device):
    """The newest evidence/bench JSON measured on this kind of device."""
    best = None
    for path in glob.glob(os.path.join(ROOT, "evidence", "bench", "*.json")):
        try:
            meta = json.load(open(path))["meta"]
        except (OSError, ValueError, KeyError):
            continue
        date = meta.get("date")
        if date and meta.get("device", "cuda") == device and (best is None or date > best[0]):
            best = (date, path)
    return best[1] if best else None


def not_here(impls, device):
    """The fattn implementations among `impls` that cannot run on `device` (a -det suffix is the backward's
    deterministic mode of its variant, suite.DET)."""
    import fattn

    return [i for i in impls if i.startswith("fattn:") and i[6:].removesuffix(suite.DET) not in fattn.variants(device)]


def run_tests():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-k", "parity", os.path.join(ROOT, "tests")],
                       cwd=ROOT)
    return r.returncode


def main(argv=None):
    import fattn

    ap = argparse.ArgumentParser(prog="python -m fattn.gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a python -m fattn.bench --json file (default: the newest for this device)")
    ap.add_argument("--threshold", type=float, default=0.03, help="allowed drop of a ratio beyond the noise")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved measuring rounds (default 5)")
    ap.add_argument("--no-tests", action="store_true", help="skip pytest -k parity")
    ap.add_argument("--reps", type=int, help="timed repeats per point and round (default: the bench's)")
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.json:
        report.check_writable(args.json, "--json", ap.error)
    here = "cuda" if fattn.cuda_available() else "cpu"
    path = args.baseline or default_baseline(here)
    if not path:
        ap.error(f"no baseline given and none for {here} under evidence/bench")
    try:
        base_meta, base_rows = report.read_json(path)
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"--baseline {path}: {e}")
    device = base_meta.get("device") or here  # rerun where the baseline was measured
    if device == "cuda" and here != "cuda":
        ap.error(f"--baseline {path} was measured on a GPU; no usable GPU here")
    print(f"gate: baseline {path} ({base_meta.get('gpu')}, git {base_meta.get('git_sha')})", flush=True)
    if not args.no_tests and run_tests() != 0:
        print("gate: FAILED: pytest -k parity failed", file=sys.stderr)
        return 1
    impls = sorted({r["impl"] for r in base_rows})
    missing = not_here(impls, device)
    if missing:
        print(f"gate: note: {missing} do not run here", file=sys.stderr)
    timer_name = base_meta.get("timer") if base_meta.get("timer") in ("events", "batch") else "events"
    points, run_impls = points_of(base_rows, device), [i for i in impls if i not in missing]
    rounds, meta = [], None
    for n in range(args.rounds):
        meta, rows = suite.run(points, run_impls, reps=args.reps, timer_name=timer_name, quiet=True)
        rounds.append(rows)
        print(f"gate: round {n + 1}/{args.rounds} measured", flush=True)
    results = compare(base_rows, rounds, args.threshold)
    if meta and base_meta.get("gpu") and meta.get("gpu") != base_meta.get("gpu"):
        print(f"gate: WARNING: the baseline was measured on {base_meta['gpu']!r}, this run on {meta.get('gpu')!r}: "
              "the ratios to torch compare two machines, so a 'slower' row may be the machine, not a regression; "
              "pass a --baseline measured here", file=sys.stderr)
    print(format_results(results, args.threshold))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"baseline": path, "meta": meta, "threshold": args.threshold, "rounds": args.rounds,
                           "results": results}, f, indent=1)
        except OSError as e:
            print(f"gate: FAILED: --json {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    if not any(r["base"] is not None for r in results) and not any(r["status"] == "wrong" for r in results):
        print(f"gate: FAILED: --baseline {path} has no fattn row with a ratio to torch (run the bench with a torch "
              "backend): nothing was compared", file=sys.stderr)
        return 1
    return 1 if any(r["status"] != "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
