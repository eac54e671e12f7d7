"""The tools around the kernels, on synthetic results (no GPU needed): gate comparison logic, plots, reports."""
import json
import math

import pytest

import fattn
from fattn import gate
from fattn.testing import report


def row(impl, ratio=None, err=1e-4, B=1, S=512, causal=False, p50=10.0, dtype="fp16"):
    r = {"grid": "seeds", "B": B, "H": 8, "H_kv": 8, "Sq": S, "Sk": S, "D": 64, "causal": causal, "dtype": dtype,
         "impl": impl, "p50_us": p50, "p90_us": p50 * 1.1, "tflops": 4 * B * 8 * S * S * 64 / p50 / 1e6,
         "max_abs_err": err, "tol": 1e-2, "ratio_vs_best_torch": ratio}
    return r


def test_compare_statuses():
    base = [row("fattn:v2", 1.00, S=512), row("fattn:v2", 1.00, S=1024), row("fattn:v2", 1.00, S=2048),
            row("fattn:v2", 1.00, S=4096), row("fattn:v2", 1.00, S=8192), row("torch:cudnn", None, S=512),
            row("fattn:v1", None, S=512)]

    def rnd(r512, r1024, r8192, err2048=1e-4):
        return [row("fattn:v2", r512, S=512), row("fattn:v2", r1024, S=1024),
                row("fattn:v2", 1.2, S=2048, err=err2048), row("fattn:v2", r8192, S=8192),
                row("torch:cudnn", None, S=512)]  # S=4096 missing in every round

    rounds = [rnd(0.98, 0.90, 0.90), rnd(0.99, 0.92, 0.60), rnd(0.97, 0.88, 1.10, err2048=float("nan")),
              rnd(0.98, 0.91, 1.05), rnd(0.98, 0.89, 0.70)]
    res = {r["point"].split()[2]: r for r in gate.compare(base, rounds, threshold=0.03)}
    assert res["S=512"]["status"] == "ok" and res["S=512"]["change"] == pytest.approx(-0.02)
    assert res["S=1024"]["status"] == "slower"  # -10% with 2% noise, the baseline's taken the same
    assert res["S=1024"]["noise"] == pytest.approx(2 * math.log(0.91 / 0.89))  # log(q75 / q25), twice
    assert res["S=2048"]["status"] == "wrong"    # NaN error in one round: wrong, however fast
    assert res["S=4096"]["status"] == "missing"
    assert res["S=8192"]["status"] == "ok"       # median -10%, but the rounds swing by 39%: noise, not a verdict
    assert len(res) == 5  # torch rows and fattn rows without a ratio are not gated
    text = gate.format_results(list(res.values()), 0.03)
    assert "2 ok, 3 failed" in text and "slower" in text
    # a baseline that recorded its own noise: -7% (log 0.93 = -0.073; today's rounds agree, noise 0) passes within
    # 3% + 5%, fails within 3% + 1%
    for base_noise, status in ((0.05, "ok"), (0.01, "slower")):
        b = dict(row("fattn:v2", 1.00, S=512), ratio_noise=base_noise)
        now = [[row("fattn:v2", x, S=512)] for x in (0.925, 0.93, 0.935, 0.93, 0.93)]
        assert gate.compare([b], now)[0]["status"] == status


def test_compare_drop_beyond_any_noise():
    """A drop to a small fraction of the baseline is 'slower' however widely the rounds swing: on a linear scale a
    change is bounded by -100% while the spread is not (rounds 0.001-0.01 against 1.0: -99.7% against a spread of
    +-67%), on the log scale the drop (log 0.003) outweighs the spread (2 log 2)."""
    base = [row("fattn:cpu", 1.0, S=64)]
    rounds = [[row("fattn:cpu", x, S=64)] for x in (0.001, 0.004, 0.002, 0.003, 0.01)]
    res = gate.compare(base, rounds, threshold=0.03)[0]
    assert res["change"] == pytest.approx(-0.997) and res["noise"] == pytest.approx(gate.MAX_NOISE)  # capped
    assert res["status"] == "slower"


def test_compare_noise_allowance_is_capped():
    """A baseline whose recorded noise is huge (one outlier round: ratio_noise 111.6) or rounds that swing by
    orders of magnitude cannot hide a drop below about 0.65x: the allowance stops at MAX_NOISE (log 1.5).  Rows
    without a ratio are still checked for wrong results."""
    base = [dict(row("fattn:cpu", 76.5, S=64), ratio_noise=111.6)]
    rounds = [[row("fattn:cpu", x, S=64)] for x in (0.62, 0.63, 0.61, 0.64, 0.62)]
    res = gate.compare(base, rounds)[0]
    assert res["status"] == "slower" and res["noise"] == pytest.approx(gate.MAX_NOISE)
    base = [dict(row("fattn:cpu", 1.0, S=64), ratio_noise=111.6)]
    assert gate.compare(base, [[row("fattn:cpu", 0.7, S=64)]])[0]["status"] == "ok"  # within 1.5x and 3%
    assert gate.compare(base, [[row("fattn:cpu", 0.6, S=64)]])[0]["status"] == "slower"
    no_ratio = [row("fattn:cpu", None, S=64)]
    assert gate.compare(no_ratio, [[row("fattn:cpu", None, S=64)]]) == []
    res = gate.compare(no_ratio, [[row("fattn:cpu", None, S=64, err=float("nan"))]])
    assert [r["status"] for r in res] == ["wrong"] and "wrong" in gate.format_results(res, 0.03)


def test_gate_fails_when_nothing_is_compared(tmp_path):
    """A baseline without ratios (benchmarked with --torch-backends none) compares nothing: the gate fails instead
    of passing vacuously; deterministic-mode rows (-det) run where their variant does."""
    base = {"meta": {"device": "cpu", "date": "x", "gpu": "cpu", "git_sha": None, "timer": "perf_counter"},
            "rows": [dict(row("fattn:cpu", None, S=32, dtype="fp32"), grid="shape")]}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(base))
    assert gate.main(["--baseline", str(path), "--no-tests", "--reps", "1", "--rounds", "1"]) == 1
    assert gate.not_here(["fattn:cpu-det", "fattn:cpu", "fattn:v9", "torch:cpu"], "cpu") == ["fattn:v9"]


@pytest.mark.parametrize("doc,match", [([1], "not a fattn.bench --json file"),
                                       ({"meta": {}, "rows": [{"impl": "fattn:cpu"}]}, "row 0 has no grid"),
                                       ({"meta": {}, "rows": [[1]]}, "row 0 has no grid")])
def test_baselines_of_another_shape_are_refused(tmp_path, doc, match):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        report.read_json(str(path))
    with pytest.raises(SystemExit) as e:
        gate.main(["--baseline", str(path), "--no-tests"])
    assert e.value.code == 2


def test_points_of_dedupes():
    rows = [row("fattn:v2", 1.0), row("torch:cudnn"), row("fattn:v2", 1.0, S=1024)]
    pts = gate.points_of(rows, "cpu")
    assert [p["Sq"] for p in pts] == [512, 1024] and all(p["device"] == "cpu" for p in pts)


@pytest.mark.parametrize("base_ratio,expect", [(1e-9, 0), (1e9, 1)])
def test_gate_end_to_end_on_cpu(tmp_path, base_ratio, expect):
    """A baseline ratio far below any real one must pass, far above must fail: deterministic despite noise.  (On the
    16-core GPU machine, 3 rounds of a 64-row CPU call swung by a log-spread of 9.3, more than a baseline of 1e3
    stands above the measured 0.5: 1e9 is beyond any such spread.)"""
    base = {"meta": {"device": "cpu", "date": "x", "gpu": "cpu", "git_sha": None, "timer": "perf_counter"},
            "rows": [dict(row("fattn:cpu", base_ratio, S=64, dtype="fp32"), grid="shape"),
                     dict(row("torch:cpu", None, S=64, dtype="fp32"), grid="shape")]}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(base))
    out = tmp_path / "gate.json"
    rc = gate.main(["--baseline", str(path), "--no-tests", "--reps", "3", "--rounds", "3", "--json", str(out)])
    assert rc == expect
    res = json.loads(out.read_text())["results"]
    assert len(res) == 1 and res[0]["status"] == ("ok" if expect == 0 else "slower")


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from fattn import plot

    meta = {"gpu": "test", "torch": "x", "git_sha": "abc"}
    seq = [dict(row(i, S=s, p50=s / 10), grid="fa3") for s in (512, 1024, 2048) for i in ("fattn:v2", "torch:flash")]
    lat = [row(i, B=b) for b in (1, 4) for i in ("fattn:v2", "torch:cudnn")]
    for rows in (seq, lat):
        p = tmp_path / "x.png"
        plot.plot(rows, meta, str(p))
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert plot.is_seqlen_grid(seq) and not plot.is_seqlen_grid(lat)
    with pytest.raises(ValueError):
        plot.plot([], meta, str(tmp_path / "y.png"))


def test_bench_writers(tmp_path):
    meta = {"gpu": "test", "date": "d", "git_sha": "abc", "notes": []}
    rows = [row("fattn:v2", 1.1), row("torch:cudnn")]
    report.write_json(str(tmp_path / "a.json"), meta, rows)
    report.write_csv(str(tmp_path / "a.csv"), meta, rows)
    report.write_md(str(tmp_path / "a.md"), meta, rows)
    assert report.read_json(str(tmp_path / "a.json"))[1][0]["tol"] == 1e-2
    assert json.loads((tmp_path / "a.json").read_text())["rows"][0]["impl"] == "fattn:v2"
    assert (tmp_path / "a.csv").read_text().splitlines()[0].startswith("grid,B,H")
    assert "fattn:v2" in (tmp_path / "a.md").read_text()


def test_profile_parses_recorded_ncu_csv():
    """tests/data/ncu_v2_d128.csv: ncu --csv --page raw --print-units base of v2 at (4, 16, 4096, 128) fp16 on
    the H100 (evidence/profile/)."""
    import pathlib

    from fattn import profile

    text = (pathlib.Path(__file__).parent / "data" / "ncu_v2_d128.csv").read_text()
    recs = profile.parse_ncu_csv(text)
    assert len(recs) == 1
    rec = recs[0]
    assert rec["kernel"].startswith("void v2_fwd<__half, 128, 4, 2, 48, 1>")
    dur = rec[profile.METRICS["duration_ns"]]
    assert 1e5 < dur < 1e8  # nanoseconds: 0.1 to 100 ms
    assert rec[profile.METRICS["local_ld_bytes"]] == 0
    assert 0 < rec[profile.METRICS["tensor_mma_pct"]] <= 100

    class Args:
        shape, sk, causal = (4, 16, 4096, 128), None, False

    ceil = {"matmul_tflops": 760.0, "copy_gbps": 3000.0, "gemm_tflops": 326.0}
    m = profile.summarize(rec, Args, ceil)
    assert m["tflops"] == pytest.approx(4 * 4 * 16 * 4096 * 4096 * 128 / (dur * 1e-9) / 1e12)
    assert 0 < m["frac_of_matmul_peak"] < 1 and m["frac_of_cublas_gemm"] == pytest.approx(m["tflops"] / 326.0)
    table = profile.format_summary(rec["kernel"], m, ceil)
    assert "TFLOP/s" in table and "registers / thread" in table
    assert profile.parse_ncu_csv("==PROF== nothing profiled\n") == []


def test_profile_backward_mode():
    """--mode bwd profiles the backward's dK/dV kernel (v2_bwd_dkdv, v1_dkdv; not the forward, nor prep / convert)
    in a child that runs attention_backward, and counts 2.5x the forward's FLOPs."""
    import re

    from fattn import profile

    class Args:
        shape, sk, causal, dtype, variant, mode = (2, 4, 256, 64), None, True, "fp16", "v2", "bwd"

    cmd = profile.ncu_command("ncu", Args, ["m"])
    pattern = cmd[cmd.index("--kernel-name") + 1].removeprefix("regex:")
    for name, hit in (("v2_bwd_dkdv", True), ("v1_dkdv", True), ("v2_fwd", False), ("bwd_prep", False),
                      ("bwd_convert", False), ("v3_fwd", False), ("v3_bwd_dkdv", True),
                      ("v3_bwd_dkdv_wide", True)):
        assert bool(re.search(pattern, name)) == hit, name
    assert cmd[cmd.index("--mode") + 1] == "bwd" and "--causal" in cmd
    rec = {profile.METRICS["duration_ns"]: 1e6}
    ceil = {"matmul_tflops": 760.0, "copy_gbps": 3000.0}
    assert profile.summarize(rec, Args, ceil)["tflops"] == pytest.approx(2.5 * 4 * 2 * 4 * 256 * 256 * 64 / 2 / 1e-3
                                                                         / 1e12)


@pytest.mark.parametrize("sq,sk,causal,window", [(64, 64, True, (10, 0)), (37, 90, False, (5, 3)),
                                                 (90, 37, True, (-1, 0)), (50, 50, False, (-1, 7)),
                                                 (17, 17, True, None), (17, 40, False, None), (17, 40, True, None),
                                                 (40, 17, True, None)])
def test_profile_counts_window_flops(sq, sk, causal, window):
    """--window: the child gets the window and the FLOPs count the pairs the window leaves (the reference's rule:
    around i + Sk - Sq, or i when causal=True, which is top-left); without one, the grids' count (half of Sq Sk when
    causal with Sq = Sk, else the pairs the mask leaves)."""
    from fattn import profile
    from fattn.testing import grids, reference

    want = reference.visible(sq, sk, "top_left" if causal else False, window).sum() if window else (
        sq * sk / 2 if causal and sq == sk else reference.visible(sq, sk, "top_left" if causal else False).sum())
    assert grids.visible_pairs(sq, sk, causal, window) == want

    class Args:
        shape, sk, dtype, variant, mode = (1, 2, 64, 64), None, "fp16", None, "fwd"

    Args.causal, Args.window = causal, window
    cmd = profile.ncu_command("ncu", Args, ["m"])
    assert any(c.startswith("--window") for c in cmd) == bool(window)
    if window:  # one token: a separate "-1,0" would read as a flag
        assert f"--window={window[0]},{window[1]}" in cmd
        assert profile.parse_args(cmd[cmd.index("-m") + 2:]).window == tuple(window)


@pytest.mark.parametrize("mode", ["bwd", "fwdbwd"])
def test_bench_gradient_modes_validate_and_count_flops(tmp_path, mode):
    """--mode bwd / fwdbwd: rows carry the mode, pass validation (gradients against the float64 reference at 3x),
    and count 2.5x / 3.5x the forward's FLOPs."""
    import json

    from fattn import bench
    from fattn.testing import grids

    path = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--shape", "1,4,64,32", "--hkv", "2", "--causal", "--mode", mode, "--reps", "1",
                     "--rounds", "1", "--warmup", "0", "--quiet", "--json", str(path)])
    assert rc == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"fattn:cpu", "torch:cpu"}
    for r in rows:
        assert r["mode"] == mode and r["max_abs_err"] <= r["tol"]
        fwd = 4 * 1 * 4 * 64 * 64 * 32 / 2
        assert abs(r["tflops"] * 1e12 * r["p50_us"] * 1e-6 - fwd * grids.MODES[mode]) < 1e-3 * fwd


def test_bench_deterministic_suffix(tmp_path):
    """'cpu-det' times the CPU backward with deterministic=True (--mode bwd, validated like the others); in the other
    modes a -det variant is skipped, not run as something else."""
    import json

    import torch

    from fattn import bench
    from fattn.testing import suite

    path = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--shape", "1,2,40,16", "--mode", "bwd", "--variants", "cpu-det",
                     "--torch-backends", "none", "--reps", "1", "--rounds", "1", "--warmup", "0", "--quiet",
                     "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert rc == 0 and [r["impl"] for r in rows] == ["fattn:cpu-det"] and rows[0]["max_abs_err"] <= rows[0]["tol"]
    q = torch.randn(1, 2, 8, 16)
    for mode in ("fwd", "fwdbwd"):
        with pytest.raises(suite.Skip, match="-det"):
            suite.make_impl("fattn:cpu-det", q, q, q, False, mode=mode, dout=q)


def test_bench_own_runner_grids():
    """--grid cp / paged go to their own runners with the remaining arguments; other grids stay with the suite."""
    from fattn.bench import own_runner_args

    assert own_runner_args(["--grid", "cp", "--tokens", "512"]) == ("cp", ["--tokens", "512"])
    assert own_runner_args(["--json", "x.json", "--grid=paged"]) == ("paged", ["--json", "x.json"])
    assert own_runner_args(["--grid", "fa3"]) is None
    assert own_runner_args(["--grid"]) is None


def _cp_row(gpus, impl, strategy, p50_us, tokens=1024, kv=4, mode="fwd"):
    return {"grid": "cp", "tokens": tokens, "heads": 4, "kv_heads": kv, "dim": 32, "batch": 1, "dtype": "fp32",
            "causal": True, "mode": mode, "gpus": gpus, "strategy": strategy, "impl": impl, "p50_us": p50_us,
            "efficiency": 0.5, "max_abs_err": None, "note": ""}


def test_cp_efficiency_against_each_librarys_own_single_run(tmp_path):
    """The cp grid's efficiency: T_1 / (gpus T) with T_1 the same library's single-GPU row of the same point (fattn's
    for fattn, torch SDPA's for torch CP), none where that row is missing; --plot-from draws several runs' files
    together (older files' efficiencies recomputed the same way)."""
    pytest.importorskip("torch")
    from fattn.testing import cp

    rows = [_cp_row(1, "fattn", "single", 400.0), _cp_row(1, "torch-sdpa", "single", 600.0),
            _cp_row(2, "fattn", "ring", 250.0), _cp_row(2, "torch-cp", "allgather", 200.0),
            _cp_row(2, "fattn", "ring", 100.0, tokens=2048)]  # no single row at 2048 tokens
    eff = [r["efficiency"] for r in cp.with_own_efficiency(rows)]
    assert eff[:4] == [1.0, 1.0, 400.0 / 500.0, 600.0 / 400.0] and eff[4] is None
    pytest.importorskip("matplotlib")
    paths = []
    for gpus in (2, 4):
        path = tmp_path / f"cp{gpus}.json"
        meta = {"device": "cpu", "gpus": gpus, "torch": "x", "fattn_git_sha": f"sha{gpus}"}
        path.write_text(json.dumps({"meta": meta, "rows": rows[:2] + [dict(r, gpus=gpus) for r in rows[2:]]}))
        paths.append(str(path))
    out = tmp_path / "cp.png"
    assert cp.main(["--plot-from", *paths, "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000
    with pytest.raises(SystemExit, match="--plot"):
        cp.main(["--plot-from", *paths])


def test_timer_flush_mode(monkeypatch):
    """FATTN_FLUSH picks how the GPU timer evicts the L2 (zeroing by default, or reading); anything else is refused
    by name before a timing runs."""
    from fattn.testing import timer

    monkeypatch.delenv("FATTN_FLUSH", raising=False)
    assert timer.flush_mode() == "write"
    monkeypatch.setenv("FATTN_FLUSH", "read")
    assert timer.flush_mode() == "read"
    monkeypatch.setenv("FATTN_FLUSH", "clean")
    with pytest.raises(ValueError, match="FATTN_FLUSH: 'clean' is neither"):
        timer.flush_mode()


@pytest.mark.parametrize("sq,sk", [(64, 200), (200, 64), (1, 300), (33, 33)])
def test_bench_counts_causal_pairs_of_either_alignment(sq, sk):
    """The bench's FLOPs under a causal mask with Sq != Sk count the pairs the alignment leaves (a bottom-right
    decode step sees every key: not half of them); with Sq = Sk half of Sq Sk (BENCH.md's count)."""
    from fattn.testing import grids, reference

    for causal in ("top_left", "bottom_right"):
        want = sq * sk / 2 if sq == sk else reference.visible(sq, sk, causal).sum()
        assert grids.visible_pairs(sq, sk, causal) == want
        p = grids.point("x", 2, 3, sq, 64, Sk=sk, causal=causal, mode="bwd")
        assert grids.flops(p) == 4 * 2 * 3 * 64 * want * 2.5


def test_bench_bwd_row_failing_validation_is_flagged(tmp_path, monkeypatch):
    """--mode bwd with a gradient past its bound: the row is marked and the run ends with rc 1, its files written --
    not a crash formatting the tuple of bounds (as before)."""
    import json

    import fattn
    from fattn import bench

    real = fattn.attention_backward

    def wrong(*a, **kw):
        dq, dk, dv = real(*a, **kw)
        dq += 1.0
        return dq, dk, dv

    monkeypatch.setattr(fattn, "attention_backward", wrong)
    path = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--shape", "1,2,40,16", "--mode", "bwd", "--torch-backends", "none",
                     "--reps", "1", "--rounds", "1", "--warmup", "0", "--quiet", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert rc == 1 and rows and all(r["max_abs_err"] > r["tol"] for r in rows if r["impl"].startswith("fattn:"))


def test_gate_keeps_modes_and_baselines_without_a_date(tmp_path, monkeypatch):
    """The gate re-times a backward baseline as a backward (its points keep their mode, its labels say it), and a
    JSON without a date in its meta is skipped when looking for the newest baseline, not a KeyError."""
    import json

    rows = [dict(row("fattn:cpu", 1.0, S=64, dtype="fp32"), mode="bwd")]
    pts = gate.points_of(rows, "cpu")
    assert pts[0]["mode"] == "bwd" and gate.label(pts[0]).endswith(" bwd")
    bench_dir = tmp_path / "evidence" / "bench"
    bench_dir.mkdir(parents=True)
    (bench_dir / "nodate.json").write_text(json.dumps({"meta": {"device": "cpu"}, "rows": []}))
    (bench_dir / "dated.json").write_text(json.dumps({"meta": {"device": "cpu", "date": "2026"}, "rows": []}))
    monkeypatch.setattr(gate, "ROOT", str(tmp_path))
    assert gate.default_baseline("cpu").endswith("dated.json")
