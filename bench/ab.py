"""Interleaved A/B of fattn candidates beside torch's backends: every round times every candidate once at every point
(CUDA events, L2 flushed, fattn.testing.timer), so clock and thermal drift hit them alike; the table reports medians
over rounds.  Each candidate is validated first (the accuracy rule against the float64 reference) and not timed if
wrong.

    python3 bench/ab.py --candidates v3 v3:config=8 --shapes 1,16,16384,128 --rounds 5
    python3 bench/ab.py --all-configs v3 --grid fa3 --rounds 3              # v3's sweep (was v3_sweep.py)
    python3 bench/ab.py --candidates v2 --splits 0,1,2,4,8,16 --grid decode  # split-KV sweep
    python3 bench/ab.py --candidates v2:order=1 v2:order=2 --grid fa3 --causal top_left
    python3 bench/ab.py --old .ab/old --candidates v3 old:v3 --grid fa3      # this tree against an older one
    python3 bench/ab.py --old .ab/old --mode bwd --candidates api:v3 old:v3 --grid fa3 --torch cudnn   # backward

Candidates: VARIANT[:config=I][:splits=N][:order=O] (overrides through fattn._C._dev.forward), api:VARIANT (the
public fattn.attention, for end-to-end timing with --timer batch), old:VARIANT (the package `fattn_old` built from
another tree by bench/old_tree.sh, imported from --old), torch:BACKEND.  Shapes are
B,H,S,D[,SK[,HKV]].  For old:X beside X the table adds X's speed over old:X and whether their outputs are bitwise
equal.  --json writes every sample.
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import fattn  # noqa: E402
from fattn import _C  # noqa: E402
from fattn._api import CAUSAL  # noqa: E402
from fattn.testing import grids, suite, timer  # noqa: E402


def parse_candidate(text):
    """'v2:config=3:splits=2' -> ('fattn', 'v2', {'config': 3, 'splits': 2}); 'old:v3'; 'torch:cudnn'."""
    head, *opts = text.split(":")
    if head in ("old", "torch", "api"):
        return head, opts[0], {}
    kw = {}
    for o in opts:
        k, _, v = o.partition("=")
        if k not in ("config", "splits", "order") or not v.isdigit():
            raise SystemExit(f"--candidates: bad option {o!r} in {text!r}")
        kw[k] = int(v)
    return "fattn", head, kw


def make_fn(cand, q, k, v, causal, old, dout=None):
    """fn() -> the output, or with dout (--mode bwd) the gradients (dq, dk, dv) of a forward done once here."""
    kind, name, kw = cand
    if kind == "torch":
        fn, ctx = suite.make_impl(f"torch:{name}", q, k, v, causal, "bwd" if dout is not None else "fwd", dout)

        def run():
            with ctx():
                return fn()
        return run
    if dout is not None:
        if kind not in ("old", "api") and kw:
            raise SystemExit("--mode bwd: fattn candidates are api:VARIANT[-det] or old:VARIANT[-det]")
        lib = old if kind == "old" else fattn
        det = name.endswith(suite.DET)
        name = name.removesuffix(suite.DET)
        out, lse = lib.attention(q, k, v, causal=causal, variant=name, return_lse=True)
        return lambda: lib.attention_backward(dout, q, k, v, out, lse, causal=causal, variant=name, deterministic=det)
    if kind == "old":
        return lambda: old.attention(q, k, v, causal=causal, variant=name)
    if kind == "api":
        return lambda: fattn.attention(q, k, v, causal=causal, variant=name)
    out = torch.empty_like(q)
    stream = torch.cuda.current_stream().cuda_stream or 1

    def run():
        _C._dev.forward(q, k, v, out, causal=CAUSAL[causal], variant=name, stream=stream, **kw)
        return out
    return run


def equal(a, b):
    """Bitwise equality of two outputs, or of two gradient triples."""
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def applies(cand, d):
    """A config override belongs to one head-dim bucket."""
    kind, name, kw = cand
    if kind != "fattn" or "config" not in kw:
        return True
    return _C._dev.configs(name)[kw["config"]]["dp"] == _C._dev.head_dim_bucket(d)


def points_of(args):
    causal = {"none": [False], "both": [False, "top_left"], "top_left": ["top_left"],
              "bottom_right": ["bottom_right"]}[args.causal]
    dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else None
    if args.grid:
        pts = grids.GRIDS[args.grid]("top_left", args.dtype, "cuda", True)
        return [dict(p, mode=args.mode) for p in pts if p["causal"] in causal and (not dims or p["D"] in dims)]
    out = []
    for s in args.shapes:
        x = [int(t) for t in s.split(",")]
        b, h, sq, d = x[:4]
        for c in causal:
            out.append(grids.point("shape", b, h, sq, d, Sk=x[4] if len(x) > 4 else None,
                                   H_kv=x[5] if len(x) > 5 else None, causal=c, dtype=args.dtype, mode=args.mode))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--candidates", nargs="*", default=[])
    ap.add_argument("--all-configs", metavar="VARIANT", help="add VARIANT:config=I for each of its configs")
    ap.add_argument("--splits", help="add v2:splits=N for each N (0: the planner's choice)")
    ap.add_argument("--torch", default="flash,cudnn", help="torch backends to time beside (comma-separated)")
    ap.add_argument("--shapes", nargs="*", default=[])
    ap.add_argument("--grid", choices=tuple(grids.GRIDS))
    ap.add_argument("--head-dims", help="only the grid's points of these head dims (comma-separated)")
    ap.add_argument("--causal", choices=("none", "both", "top_left", "bottom_right"), default="none")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd",
                    help="bwd: time the backward alone (api:X, old:X, X-det for deterministic mode, torch:B)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--timer", choices=("events", "batch"), default="events",
                    help="events: each call, L2 flushed (kernel time); batch: back-to-back calls (end to end)")
    ap.add_argument("--old", help="folder holding the package fattn_old (bench/old_tree.sh builds it)")
    ap.add_argument("--json")
    args = ap.parse_args()
    old = None
    if args.old:
        sys.path.insert(0, args.old)
        import fattn_old as old  # noqa: F811
    texts = list(args.candidates)
    if args.all_configs:
        texts += [f"{args.all_configs}:config={c['index']}" for c in _C._dev.configs(args.all_configs)]
    if args.splits:
        texts += [f"v2:splits={n}" for n in args.splits.split(",")]
    texts += [f"torch:{b}" for b in args.torch.split(",") if b]
    cands = {t: parse_candidate(t) for t in texts}
    if any(c[0] == "old" for c in cands.values()) and old is None:
        raise SystemExit("--old: an old:VARIANT candidate needs the older tree's package")
    results = []
    for p in points_of(args):
        q, k, v = suite.make_inputs(p)
        nb, nh = suite.ref_slice(p)
        dout = suite.make_inputs(dict(p, H_kv=p["H"], Sk=p["Sq"]), 1)[0] if args.mode == "bwd" else None
        ref, tol = suite.validate(p, q, k, v, nb, nh, dout)
        fns, errs, outs = {}, {}, {}
        for t, c in cands.items():
            if not applies(c, p["D"]):
                continue
            try:
                fn = make_fn(c, q, k, v, p["causal"], old, dout)
                o = fn()
                o = tuple(g.clone() for g in o) if dout is not None else o.clone()
            except Exception as e:  # a candidate that cannot run this point is reported, never fatal
                print(f"{grids.describe(p)} {t}: cannot run ({type(e).__name__}: {str(e).splitlines()[0]})")
                continue
            errs[t], bound = suite.slice_error(o, ref, tol, nb, nh)
            if not errs[t] <= bound:
                print(f"{grids.describe(p)} {t}: WRONG (max err {errs[t]:.3g} > {bound:.3g}), not timed")
                continue
            fns[t], outs[t] = fn, o
        time_one = timer.cuda if args.timer == "events" else timer.cuda_batch
        med = timer.interleaved(fns, args.rounds, lambda fn: time_one(fn, args.reps, 2))
        us = {t: timer.percentile(m, 0.5) for t, m in med.items()}
        best_torch = min((u for t, u in us.items() if t.startswith("torch:")), default=None)
        fl = grids.flops(p)
        line = f"{grids.describe(p):28s} {str(p['causal'] or '-'):12s}"
        for t, u in us.items():
            line += f" | {t} {fl / u / 1e6:5.0f} TF/s" + (f" {best_torch / u:.3f}x" if best_torch else "")
        print(line, flush=True)
        pairs = [(new, t) for t, c in cands.items() if c[0] == "old" for new in (c[1], "api:" + c[1])
                 if t in us and new in us]
        for new, t in pairs:
            same = equal(outs[new], outs[t])
            print(f"    {new} / {t}: {us[t] / us[new]:.3f}x speed, outputs bitwise {'equal' if same else 'DIFFERENT'}")
        results.append({"point": {k_: p[k_] for k_ in grids.POINT_KEYS}, "median_us": us, "rounds_us": med,
                        "max_err": errs, "tol": tol, "best_torch_us": best_torch,
                        "bitwise_equal_to_old": {new: equal(outs[new], outs[t]) for new, t in pairs}})
        del q, k, v, dout, ref, outs
        torch.cuda.empty_cache()
    if args.json:
        meta = suite.collect_meta("cuda", args.timer, " ".join(sys.argv))
        meta.update(rounds=args.rounds, reps=args.reps, old=getattr(old, "__file__", None))
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
