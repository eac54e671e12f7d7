"""Regression gate: rerun a baseline's benchmark rows on the GPU at hand and fail on any correctness failure or
on a drop of fattn's ratio to the best torch backend, both measured in the same run.

    python -m fattn.gate --baseline evidence/bench/h100_v2_fa3.json [--threshold 0.03] [--no-tests]

Ratios, not absolute times: GPUs are shared and clocks move, but fattn and torch measured back to back in one
process move together.  Steps: (1) `pytest -k parity` on this machine (skipped with --no-tests); (2) every point
of the baseline rerun with the same implementations, and any point that looks slower measured once more (the
better measurement stands: timing noise only ever makes things look slower); (3) a table of what moved; exit 1
if anything failed.
"""
import argparse
import glob
import json
import os
import subprocess
import sys

from . import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row_key(r):
    return tuple(str(r[k]) for k in bench.POINT_KEYS) + (r["impl"],)



def compare(base_rows, new_rows, threshold=0.03):
    """One result per fattn row of the baseline that has a ratio: status 'ok', 'slower' (ratio fell more than
    `threshold`), 'wrong' (fails validation now) or 'missing' (did not run now)."""
    new = {row_key(r): r for r in new_rows}
    out = []
    for b in base_rows:
        if not b["impl"].startswith("fattn:") or not b.get("ratio_vs_best_torch"):
            continue
        n = new.get(row_key(b))
        res = {"point": bench.describe(b) + f" {b['dtype']} {b['causal'] or 'non-causal'}", "impl": b["impl"],
               "base": b["ratio_vs_best_torch"], "now": None, "change": None}
        if n is None or n.get("ratio_vs_best_torch") is None:
            res["status"] = "wrong" if n is not None and bench._bad(n) else "missing"
        elif bench._bad(n):
            res.update(now=n["ratio_vs_best_torch"], status="wrong")
        else:
            res["now"] = n["ratio_vs_best_torch"]
            res["change"] = res["now"] / res["base"] - 1
            res["status"] = "slower" if res["change"] < -threshold else "ok"
        out.append(res)
    return out


def format_results(results, threshold):
    lines = [f"{'point':44s} {'impl':10s} {'base':>6s} {'now':>6s} {'change':>8s}  status (fail below -{threshold:.0%})"]
    for r in results:
        now = f"{r['now']:.3f}" if r["now"] is not None else "-"
        ch = f"{r['change']:+.1%}" if r["change"] is not None else "-"
        lines.append(f"{r['point']:44s} {r['impl']:10s} {r['base']:6.3f} {now:>6s} {ch:>8s}  {r['status']}")
    bad = [r for r in results if r["status"] != "ok"]
    lines.append(f"{len(results) - len(bad)} ok, {len(bad)} failed")
    return "\n".join(lines)


def points_of(rows, device):
    """The distinct benchmark points of baseline rows, as bench.point dicts."""
    seen, pts = set(), []
    for r in rows:
        k = tuple(str(r[x]) for x in bench.POINT_KEYS)
        if k in seen:
            continue
        seen.add(k)
        pts.append(bench.point(r["grid"], r["B"], r["H"], r["Sq"], r["D"], Sk=r["Sk"], H_kv=r["H_kv"],
                               causal=r["causal"], dtype=r["dtype"], device=device))
    return pts


def default_baseline(device):
    """The newest evidence/bench JSON measured on this kind of device."""
    best = None
    for path in glob.glob(os.path.join(ROOT, "evidence", "bench", "*.json")):
        try:
            meta = json.load(open(path))["meta"]
        except (OSError, ValueError, KeyError):
            continue
        if meta.get("device", "cuda") == device and (best is None or meta["date"] > best[0]):
            best = (meta["date"], path)
    return best[1] if best else None


def run_tests():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-k", "parity", os.path.join(ROOT, "tests")],
                       cwd=ROOT)
    return r.returncode


def main(argv=None):
    import fattn

    ap = argparse.ArgumentParser(prog="python -m fattn.gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a python -m fattn.bench --json file (default: the newest for this device)")
    ap.add_argument("--threshold", type=float, default=0.03, help="largest allowed relative drop of a ratio")
    ap.add_argument("--no-tests", action="store_true", help="skip pytest -k parity")
    ap.add_argument("--reps", type=int, help="timed repeats per point (default: the bench's)")
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args(argv)
    here = "cuda" if fattn.cuda_available() else "cpu"
    path = args.baseline or default_baseline(here)
    if not path:
        ap.error(f"no baseline given and none for {here} under evidence/bench")
    doc = json.load(open(path))
    device = doc["meta"].get("device") or here  # rerun where the baseline was measured
    if device == "cuda" and here != "cuda":
        ap.error(f"--baseline {path} was measured on a GPU; no usable GPU here")
    base_rows = doc["rows"]
    print(f"gate: baseline {path} ({doc['meta'].get('gpu')}, git {doc['meta'].get('git_sha')})", flush=True)
    if not args.no_tests and run_tests() != 0:
        print("gate: FAILED: pytest -k parity failed", file=sys.stderr)
        return 1
    impls = sorted({r["impl"] for r in base_rows})
    missing = [i for i in impls if i.startswith("fattn:") and i[6:] not in fattn.variants(device)]
    if missing:
        print(f"gate: note: {missing} do not run here", file=sys.stderr)
    timer = doc["meta"].get("timer", "events")
    meta, new_rows = bench.run(points_of(base_rows, device), [i for i in impls if i not in missing], reps=args.reps,
                               timer=timer if timer in ("events", "triton", "batch") else "events", quiet=True)
    results = compare(base_rows, new_rows, args.threshold)
    suspects = [r for r in results if r["status"] == "slower"]
    if suspects:  # a second measurement of each suspect; the better one stands (noise is one-sided)
        keys = {r["point"] for r in suspects}
        again = [b for b in base_rows if bench.describe(b) + f" {b['dtype']} {b['causal'] or 'non-causal'}" in keys]
        _, rows2 = bench.run(points_of(again, device), [i for i in impls if i not in missing], reps=args.reps,
                             timer=timer if timer in ("events", "triton", "batch") else "events", quiet=True)
        best = {row_key(r): r for r in new_rows}
        for r in rows2:
            k = row_key(r)
            if r.get("ratio_vs_best_torch") and (k not in best or not best[k].get("ratio_vs_best_torch") or
                                                 r["ratio_vs_best_torch"] > best[k]["ratio_vs_best_torch"]):
                best[k] = r
        new_rows = list(best.values())
        results = compare(base_rows, new_rows, args.threshold)
        print(f"gate: re-measured {len(suspects)} point(s) that looked slower", flush=True)
    print(format_results(results, args.threshold))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": path, "meta": meta, "threshold": args.threshold, "results": results}, f, indent=1)
    return 1 if any(r["status"] != "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
