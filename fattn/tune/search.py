"""The two searches: `micro` (every kept configuration on a synthetic single-tile problem, ranked Top-K) and `evo`
(a genetic search on the real problem, seeded from micro's Top-K).  Every candidate is gated for correctness before
it is timed; a wrong, uncompilable or unlaunchable one is recorded with its status and never crashes the search."""
import csv
import dataclasses
import json
import math
import os
import random
import sys
import time

from .. import _C
from ..testing import timer
from . import space as spaces
from .runner import Runner

LOG_FIELDS = ["n", "generation", "config", "status", "p50_us", "p90_us", "tflops", "detail"]


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LOG_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(r[k], sort_keys=True) if k == "config" else r.get(k, "")) for k in LOG_FIELDS})


def _write_results(out_dir, stem, rows, best):
    """out_dir/<stem>_log.csv (every candidate) and out_dir/<stem>_best.json."""
    os.makedirs(out_dir, exist_ok=True)
    _write_csv(os.path.join(out_dir, f"{stem}_log.csv"), rows)
    with open(os.path.join(out_dir, f"{stem}_best.json"), "w") as f:
        json.dump(best, f, indent=1)


def _say(msg, quiet=False):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def synthetic(problem, space):
    """micro's single-tile problem for a config: one query tile per multiprocessor (GPU) or per thread (CPU), over
    the problem's full key length, so that configs of different tile heights are compared per tile."""
    if problem.device == "cuda":
        units = _C.device_info(0)[2]
        return lambda cfg: dataclasses.replace(problem, b=1, h=units, h_kv=0, sq=16 * cfg["mt"] * cfg["warps"])
    units = os.cpu_count() or 1
    return lambda cfg: dataclasses.replace(problem, b=1, h=units, h_kv=0, sq=cfg["br"])


def evaluate(runner, cfg, default_cfg, compile_errors, problem=None):
    """One candidate: compile (already attempted in batch), gate, time.  Returns (status, p50, p90, detail)."""
    err = compile_errors.get(runner.space.key(cfg))
    if err:
        return "compile_failed", None, None, err
    try:
        why = runner.gate(cfg, default_cfg)
    except Exception as e:
        return "launch_failed", None, None, f"{type(e).__name__}: {e}"
    if why:
        return "wrong", None, None, why
    try:
        if problem is None:
            p50, p90 = runner.time(cfg)
        else:
            arrays = runner.arrays((problem.b, problem.h, problem.sq, problem.d),
                                   (problem.b, problem.kv_heads, problem.sk, problem.d))
            p50, p90 = runner.time(cfg, arrays=arrays)
    except Exception as e:
        return "launch_failed", None, None, f"{type(e).__name__}: {e}"
    return "ok", p50, p90, ""


def default_out_dir(problem):
    """Where the command line writes its logs unless --out says: the user's cache, never the source tree (the
    library functions write only where out_dir names)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fattn", "tune", problem.label())


def micro(problem, *, family=None, top=5, out_dir=None, reps=10, warmup=2, quiet=False, limit=None):
    """Sweeps the whole (kept) space on the synthetic single-tile problem; writes micro_log.csv, micro_best.json."""
    space = spaces.space_for(problem, family)
    runner = Runner(problem, space, reps=reps, warmup=warmup)
    tile = synthetic(problem, space)
    default = runner.default()
    rows, kept = [], []
    for cfg, ok, why in space.all(problem):
        if ok:
            kept.append(cfg)
        else:
            rows.append(dict(n=len(rows), generation=0, config=cfg, status="pruned", detail=why))
    if limit:
        kept = kept[:limit]
    if space.key(default) not in {space.key(c) for c in kept}:
        kept.insert(0, default)
    _say(f"micro {problem.label()} [{space.family}]: {len(kept)} configs kept, {len(rows)} pruned by keep()", quiet)
    compile_errors = runner.prepare(kept)
    for i, cfg in enumerate(kept):
        p = tile(cfg)
        status, p50, p90, detail = evaluate(runner, cfg, default, compile_errors, problem=p)
        tf = p.flops() / p50 / 1e6 if p50 else None
        rows.append(dict(n=len(rows), generation=0, config=cfg, status=status, p50_us=p50, p90_us=p90, tflops=tf,
                         detail=detail))
        _say(f"  [{i + 1}/{len(kept)}] {cfg} {status}" + (f" {p50:.1f} us {tf:.2f} TFLOP/s" if p50 else f" {detail}"),
             quiet)
    ok_rows = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: -r["tflops"])
    best = {"problem": dataclasses.asdict(problem), "family": space.family, "default": default,
            "top": [dict(config=r["config"], tflops=r["tflops"], p50_us=r["p50_us"]) for r in ok_rows[:top]]}
    if out_dir:
        _write_results(out_dir, "micro", rows, best)
    return best, rows


def _mutate(rng, space, cfg, rate=0.35):
    child = dict(cfg)
    names = list(space.params)
    forced = rng.choice(names)  # at least one parameter moves
    for name in names:
        if name == forced or rng.random() < rate:
            vals = space.params[name]
            i = vals.index(child[name]) if child[name] in vals else rng.randrange(len(vals))
            child[name] = vals[max(0, min(len(vals) - 1, i + rng.choice((-1, 1))))]
    return child


def _crossover(rng, space, a, b):
    return {name: (a if rng.random() < 0.5 else b)[name] for name in space.params}


def _tournament(rng, scored, k=3):
    """The fittest (lowest p50) of k entrants drawn at random: selection biased to the fittest."""
    entrants = [scored[rng.randrange(len(scored))] for _ in range(min(k, len(scored)))]
    return min(entrants, key=lambda x: x[1])[0]


def evo(problem, *, family=None, budget=24, seed=0, population=8, out_dir=None, seeds_from=None,
        reps=20, warmup=3, quiet=False, measure=None, top=5):
    """Genetic search on `problem`.  `budget`: candidates evaluated (the default config included).  Population seeded
    from micro_best.json (seeds_from, or out_dir's) when it matches the family and head dim, else random kept
    configs.  `measure(cfg) -> (status, p50, p90, detail)` replaces gate + timing (tests use a deterministic one):
    given the same measurements, a seed always produces the same candidates.  Writes evo_log.csv, evo_best.json."""
    space = spaces.space_for(problem, family)
    rng = random.Random(seed)
    runner = None if measure else Runner(problem, space, reps=reps, warmup=warmup, seed=seed)
    default = runner.default() if runner else space.default(problem)
    compile_errors = {}

    def run(cfg):
        if measure:
            return measure(cfg)
        if space.key(cfg) not in compile_errors:
            compile_errors.update(runner.prepare([cfg]))
        return evaluate(runner, cfg, default, compile_errors)

    rows, seen, scored = [], {}, []

    def record(cfg, gen):
        key = space.key(cfg)
        if key in seen:
            return seen[key]
        ok, why = space.keep(cfg, problem)
        if not ok:
            rows.append(dict(n=len(rows), generation=gen, config=cfg, status="pruned", detail=why))
            seen[key] = None
            return None
        status, p50, p90, detail = run(cfg)
        tf = problem.flops() / p50 / 1e6 if p50 else None
        rows.append(dict(n=len(rows), generation=gen, config=cfg, status=status, p50_us=p50, p90_us=p90, tflops=tf,
                         detail=detail))
        seen[key] = p50 if status == "ok" else None
        if status == "ok":
            scored.append((cfg, p50))
        best = min(scored, key=lambda x: x[1]) if scored else None
        _say(f"  [{sum(r['status'] != 'pruned' for r in rows)}/{budget}] gen {gen} {cfg} {status}"
             + (f" {p50:.1f} us" if p50 else f" ({detail})")
             + (f"   best {best[1]:.1f} us" if best else ""), quiet)
        return seen[key]

    def evaluated():
        return sum(r["status"] != "pruned" for r in rows)

    # generation 0: the default, micro's Top-K, then random kept configs
    initial = [default]
    src = seeds_from or (os.path.join(out_dir, "micro_best.json") if out_dir else None)
    if seeds_from and not os.path.exists(seeds_from):
        raise ValueError(f"--seeds-from {seeds_from}: no such file")
    if src and os.path.exists(src):
        try:
            with open(src) as f:
                mb = json.load(f)
            if mb.get("family") == space.family and mb.get("problem", {}).get("d") == problem.d:
                seeds = [t["config"] for t in mb["top"]]
                for c in seeds:  # a seed is a whole config of this family
                    space.key(c)
                initial += seeds
                _say(f"evo: seeded from {src} ({len(seeds)} configs)", quiet)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if seeds_from:
                raise ValueError(f"--seeds-from {src}: not a micro_best.json of this tuner "
                                 f"({type(e).__name__}: {e})") from None
            _say(f"evo: ignoring {src}: {e}", quiet)
    kept = [c for c, ok, _ in space.all(problem) if ok]
    rng.shuffle(kept)
    initial += kept
    _say(f"evo {problem.label()} [{space.family}] budget {budget} seed {seed}", quiet)
    for cfg in initial:
        if evaluated() >= min(population, budget):
            break
        record(cfg, 0)
    gen, stale = 1, 0
    while evaluated() < budget and scored and stale < 200:
        a, b = _tournament(rng, scored), _tournament(rng, scored)
        child = _mutate(rng, space, _crossover(rng, space, a, b))
        if space.key(child) in seen:
            stale += 1
            continue
        stale = 0
        record(child, gen)
        if evaluated() % population == 0:
            gen += 1
    ok_rows = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["p50_us"])
    dflt = next((r for r in rows if r["status"] == "ok" and space.key(r["config"]) == space.key(default)), None)
    best = {"problem": dataclasses.asdict(problem), "family": space.family, "seed": seed, "budget": budget,
            "default": dict(config=default, p50_us=dflt["p50_us"] if dflt else None),
            "leaderboard": [dict(config=r["config"], p50_us=r["p50_us"], p90_us=r["p90_us"], tflops=r["tflops"])
                            for r in ok_rows[:top]],
            "counts": {s: sum(r["status"] == s for r in rows)
                       for s in ("ok", "wrong", "compile_failed", "launch_failed", "pruned")}}
    if out_dir:
        _write_results(out_dir, "evo", rows, best)
    return best, rows


def cache_entry(problem, family, best):
    """The tuned-cache entry for evo's winner (see fattn/_tuned.py)."""
    from .. import _tuned

    top = best["leaderboard"][0]
    dev = _tuned.cpu_device() if problem.device == "cpu" else _tuned.gpu_device(0)
    from .. import __version__

    return {"family": family, "device": dev, "dtype": problem.dtype, "head_dim": problem.d,
            "causal": bool(problem.causal), "seq_bucket": _C._dev.seq_bucket(problem.sq, problem.sk),
            "config": top["config"], "p50_us": top["p50_us"], "default_p50_us": best["default"]["p50_us"],
            "shape": [problem.b, problem.h, problem.sq, problem.sk, problem.d], "sources": _tuned.sources_id(),
            "fattn": __version__, "saved": time.strftime("%Y-%m-%dT%H:%M:%S")}


def confirm(problem, family, best, rounds=7, reps=20, warmup=3, quiet=False, noise=0.02):
    """Re-measures evo's winner against the default, interleaved (each round times both once), and says whether it
    is faster beyond the noise: {"confirmed", "speedup" (median of per-round ratios), "spread" (their interquartile
    range), "rounds"}.  Only a confirmed winner is worth caching: one search's timing alone is not."""
    space = spaces.space_for(problem, family)
    runner = Runner(problem, space, reps=reps, warmup=warmup)
    winner, default = best["leaderboard"][0]["config"], runner.default()
    if space.key(winner) == space.key(default):
        return {"confirmed": False, "speedup": 1.0, "spread": 0.0, "rounds": 0, "why": "the winner is the default"}
    runner.prepare([winner, default])
    fns = {"default": runner.call(default), "winner": runner.call(winner)}
    med = timer.interleaved(fns, rounds, runner.samples)
    ratios = sorted(d / w for d, w in zip(med["default"], med["winner"]))
    q1, q2, q3 = (timer.percentile(ratios, x) for x in (0.25, 0.5, 0.75))
    ok = q1 > 1.0 + noise  # three quarters of the rounds agree the winner is faster by more than the noise floor
    _say(f"confirm: winner {winner} vs default {default}: {q2:.3f}x (rounds' IQR {q1:.3f}-{q3:.3f}) -> "
         + ("confirmed" if ok else "not confirmed"), quiet)
    return {"confirmed": ok, "speedup": q2, "spread": q3 - q1, "rounds": rounds,
            "why": "" if ok else f"the winner's lower quartile ratio {q1:.3f} is not above {1 + noise:.2f}"}


def speedup(best):
    d = best["default"]["p50_us"]
    return d / best["leaderboard"][0]["p50_us"] if d and best["leaderboard"] else math.nan
