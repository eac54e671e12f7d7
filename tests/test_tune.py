"""fattn.tune: keep() pruning, the C timing harness, micro and evo on the CPU backend (CI), the tuned-config cache
(written, then used by fattn.attention; corrupt or stale files ignored with a warning), run-time compilation of v2
configs (GPU machine; compile-only where NVRTC is installed)."""
import csv
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from conftest import HAS_CUDA, check_close, randn, torch

import fattn
from fattn import _C, _rtc, _tuned
from fattn.tune import CPUSpace, Problem, V2Space, evo, micro, search

CPU_PROBLEM = Problem(1, 2, 96, 96, 32, False, "fp32", "cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("FATTN_TUNED_CACHE", str(path))
    _tuned.reset()
    yield path
    _tuned.reset()


def test_keep_prunes_what_cannot_launch():
    s = V2Space()
    p = Problem(1, 1, 512, 512, 256)
    ok, why = s.keep({"warps": 8, "mt": 4, "bc": 128, "stages": 2}, p)
    assert not ok and "shared memory" in why
    ok, why = s.keep({"warps": 4, "mt": 4, "bc": 128, "stages": 1}, Problem(1, 1, 512, 512, 128))
    assert not ok and "spill" in why
    ok, why = s.keep({"warps": 2, "mt": 1, "bc": 48, "stages": 1}, p)  # 48 rows x 32 chunks over 64 threads: fine
    assert ok, why
    ok, why = s.keep({"warps": 4, "mt": 1, "bc": 16, "stages": 1}, p)  # 16 x 32 chunks over 128 threads: fine
    assert ok
    ok, why = s.keep({"warps": 4, "mt": 1, "bc": 64, "stages": 1}, Problem(1, 1, 64, 64, 64, dtype="fp32"))
    assert not ok and "fp16" in why
    ok, why = CPUSpace().keep({"br": 64, "bc": 64, "threads": (os.cpu_count() or 1) + 1}, CPU_PROBLEM)
    assert not ok and "threads" in why
    kept = [c for c, ok, _ in V2Space().all(Problem(1, 1, 512, 512, 128)) if ok]
    assert {"warps": 4, "mt": 2, "bc": 48, "stages": 1} in kept  # the shipped default survives its own rule
    assert 0 < len(kept) < 108


def test_timing_harness_cpu():
    q = np.random.default_rng(0).standard_normal((1, 2, 64, 32)).astype(np.float32)
    out = np.empty_like(q)
    p50, p90, samples = _C.time_forward(q, q, q, out, None, 0, None, 0, None, None, (32, 64, 1), 5, 1, False)
    assert len(samples) == 5 and all(s > 0 for s in samples)
    assert min(samples) <= p50 <= p90 <= max(samples)
    check_close(torch.from_numpy(out), *(torch.from_numpy(q),) * 3, False, None)
    with pytest.raises(ValueError, match="reps"):
        _C.time_forward(q, q, q, out, None, 0, None, 0, None, None, None, 0, 1, False)
    with pytest.raises(ValueError, match="config"):
        _C.time_forward(q, q, q, out, None, 0, None, 0, None, None, (32, 8, 1), 2, 0, False)
    with pytest.raises(TypeError, match="config"):
        _C.forward(q, q, q, out, None, 0, None, 0, None, None, 7)


def test_micro_cpu_writes_logs_ranked(tmp_path):
    short = Problem(1, 2, 16, 96, 32, False, "fp32", "cpu")  # Sq = 16: Br above 64 is pruned before running
    best, rows = micro(short, out_dir=str(tmp_path), reps=2, warmup=1, quiet=True, limit=4, top=3)
    log = list(csv.DictReader(open(tmp_path / "micro_log.csv")))
    assert len(log) == len(rows) and {r["status"] for r in log} <= {"ok", "pruned", "wrong", "launch_failed"}
    assert any(r["status"] == "pruned" and "Br far above" in r["detail"] for r in log)
    saved = json.load(open(tmp_path / "micro_best.json"))
    tf = [t["tflops"] for t in saved["top"]]
    assert tf == sorted(tf, reverse=True) and 1 <= len(tf) <= 3


def fake_measure(cfg):
    """Deterministic fitness for the search's own logic: a bowl around br=48, bc=128."""
    return "ok", 100.0 + abs(cfg["br"] - 48) + abs(cfg["bc"] - 128) / 4 + cfg["threads"], None, ""


def test_evo_is_deterministic_for_a_seed():
    a, rows_a = evo(CPU_PROBLEM, budget=10, seed=3, population=4, out_dir=None, measure=fake_measure, quiet=True)
    b, rows_b = evo(CPU_PROBLEM, budget=10, seed=3, population=4, out_dir=None, measure=fake_measure, quiet=True)
    assert [r["config"] for r in rows_a] == [r["config"] for r in rows_b]
    assert sum(r["status"] == "ok" for r in rows_a) == 10
    c, rows_c = evo(CPU_PROBLEM, budget=10, seed=4, population=4, out_dir=None, measure=fake_measure, quiet=True)
    assert [r["config"] for r in rows_c] != [r["config"] for r in rows_a]
    assert a["leaderboard"][0]["p50_us"] <= a["default"]["p50_us"]


def test_evo_records_failures_and_never_crashes(monkeypatch, tmp_path):
    """A config keep() lets through but the C side refuses is recorded as launch_failed; a wrong one as wrong."""
    monkeypatch.setattr(CPUSpace, "keep", lambda self, cfg, problem: (True, ""))
    orig_init = CPUSpace.__init__

    def init(self):
        orig_init(self)
        self.params = {"br": [32, 48], "bc": [8, 64], "threads": [1]}  # bc = 8 is refused by the C extension

    monkeypatch.setattr(CPUSpace, "__init__", init)
    real_gate = search.Runner.gate

    def gate(self, cfg, default):
        return "forced wrong for the test" if cfg["br"] == 48 and cfg["bc"] == 64 else real_gate(self, cfg, default)

    monkeypatch.setattr(search.Runner, "gate", gate)
    best, rows = evo(CPU_PROBLEM, budget=5, seed=0, population=5, out_dir=str(tmp_path), reps=2, warmup=0, quiet=True)
    status = {(r["config"]["br"], r["config"]["bc"]): r["status"] for r in rows}
    assert status[(32, 8)] == "launch_failed" and status[(48, 8)] == "launch_failed"
    assert status[(48, 64)] == "wrong"
    assert best["counts"]["launch_failed"] == 2 and best["counts"]["wrong"] == 1
    log = list(csv.DictReader(open(tmp_path / "evo_log.csv")))
    assert any("bc a multiple of 16" in r["detail"] for r in log)


def test_evo_cpu_saves_and_attention_uses_the_cache(cache, tmp_path):
    best, rows = evo(CPU_PROBLEM, budget=6, seed=1, population=3, out_dir=str(tmp_path), reps=3, warmup=1, quiet=True)
    assert best["leaderboard"][0]["p50_us"] <= best["default"]["p50_us"]  # the default is a candidate
    assert (tmp_path / "evo_log.csv").exists() and (tmp_path / "evo_best.json").exists()
    entry = search.cache_entry(CPU_PROBLEM, "cpu", best)
    entry["config"] = {"br": 16, "bc": 32, "threads": 1}  # distinct from the default, so its use is visible
    _tuned.save([entry])
    q = np.random.default_rng(1).standard_normal((1, 2, 96, 32)).astype(np.float32)
    o = fattn.attention(q, q, q)
    assert _C.last_config() == ("cpu", (16, 32, 1))
    check_close(torch.from_numpy(o), *(torch.from_numpy(q),) * 3, False, None)
    q2 = np.random.default_rng(2).standard_normal((1, 2, 96, 40)).astype(np.float32)  # other head dim: default
    fattn.attention(q2, q2, q2)
    assert _C.last_config() == ("cpu", _C.cpu_config())


def test_cli_evo_cpu_save(cache, tmp_path):
    r = subprocess.run([sys.executable, "-m", "fattn.tune", "evo", "--device", "cpu", "--shape", "1,2,64,32",
                        "--budget", "3", "--population", "3", "--reps", "2", "--quiet", "--out", str(tmp_path),
                        "--save"], capture_output=True, text=True, env=dict(os.environ, FATTN_TUNED_CACHE=str(cache)))
    assert r.returncode == 0, r.stderr
    assert "saved to" in r.stdout and json.load(open(cache))["entries"][0]["family"] == "cpu"
    r = subprocess.run([sys.executable, "-m", "fattn.tune", "evo", "--shape", "1,2,64"], capture_output=True, text=True)
    assert r.returncode == 2 and "--shape" in r.stderr


def test_corrupt_and_stale_caches_are_ignored_with_a_warning(cache):
    q = np.random.default_rng(3).standard_normal((1, 2, 40, 32)).astype(np.float32)
    expect = fattn.attention(q, q, q)
    cache.write_text("{not json")
    _tuned.reset()
    with pytest.warns(RuntimeWarning, match="ignoring the tuned-config cache"):
        o = fattn.attention(q, q, q)
    assert np.array_equal(o, expect)
    entry = {"family": "cpu", "device": _tuned.cpu_device(), "dtype": "fp32", "head_dim": 32, "causal": False,
             "seq_bucket": _C.seq_bucket(40, 40), "config": {"br": 16, "bc": 32, "threads": 1}, "sources": "old"}
    cache.write_text(json.dumps({"format": _tuned.FORMAT, "entries": [entry]}))
    _tuned.reset()
    with pytest.warns(RuntimeWarning, match="stale"):
        fattn.attention(q, q, q)
    assert _C.last_config() == ("cpu", _C.cpu_config())
    entry.update(sources=_tuned.sources_id(), config={"br": 16, "bc": 8, "threads": 1})
    cache.write_text(json.dumps({"format": _tuned.FORMAT, "entries": [entry]}))
    _tuned.reset()
    with pytest.warns(RuntimeWarning, match="ignoring tuned-config entry"):
        fattn.attention(q, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fattn.attention(q, q, q)  # warned once per process and device, not per call


def test_seq_bucket_matches_the_documented_buckets():
    assert _C.seq_bucket(512, 512) == 0 and _C.seq_bucket(513, 513) == 1 and _C.seq_bucket(100, 40000) == 7
    assert _C.seq_bucket(1, 2048) == 8 + 2 and _C.seq_bucket(64, 512) == 8


def _nvrtc_usable():
    try:
        _C.rtc_version(_rtc.nvrtc_path())
        _rtc.cuda_include()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _nvrtc_usable(), reason="NVRTC or the CUDA headers are not installed here")
def test_rtc_compiles_and_caches_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("FATTN_CACHE_DIR", str(tmp_path))
    cfg = {"dp": 64, "warps": 2, "mt": 1, "bc": 32, "stages": 1}
    opts = _rtc.v2_options(cfg, "fp16", 90)
    img, cached = _rtc.compile_cubin("kernels/v2_mma.cu", opts, "test")
    assert img[:4] == b"\x7fELF" and not cached
    img2, cached = _rtc.compile_cubin("kernels/v2_mma.cu", opts, "test")
    assert cached and img2 == img and len(list(tmp_path.glob("*.cubin"))) == 1
    with pytest.raises(_rtc.RTCError, match="could not compile"):
        _rtc.compile_cubin("kernels/v2_mma.cu", opts + ["-DV2_BC=oops"], "broken")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")
def test_rtc_v2_config_runs_correctly(tmp_path, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("v2 needs sm_80")
    monkeypatch.setenv("FATTN_CACHE_DIR", str(tmp_path))
    arch = _C.device_info(0)[1]
    for dtype, tdt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        idx = _rtc.v2_index({"dp": 128, "warps": 4, "mt": 1, "bc": 96, "stages": 1}, dtype, arch)
        assert not [c for c in _C.v2_configs() if c[0] == idx][0][7]  # run-time compiled, not ahead of time
        for causal in (False, "top_left", "bottom_right"):
            q = randn((2, 4, 113, 128), tdt, "cuda", 1)
            k = randn((2, 2, 257, 128), tdt, "cuda", 2)
            out = torch.empty_like(q)
            lse = torch.empty(2, 4, 113, device="cuda")
            fattn._frameworks.register_torch(_C)
            _C.forward(q, k, k, out, lse, fattn._api._CAUSAL[causal], None, 0, "v2",
                       fattn._frameworks.current_stream("torch", 0), idx)
            assert _C.last_config() == ("v2", idx)
            check_close(out, q, k, k, causal, None, lse=lse)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")
def test_evo_gpu_small_and_cache_used(cache, tmp_path, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("v2 needs sm_80")
    monkeypatch.setenv("FATTN_CACHE_DIR", str(tmp_path / "kernels"))
    p = Problem(2, 8, 512, 512, 64, "bottom_right", "fp16", "cuda")
    best, rows = evo(p, budget=6, seed=0, population=3, out_dir=str(tmp_path), reps=5, warmup=1, quiet=True)
    assert best["leaderboard"][0]["p50_us"] <= best["default"]["p50_us"]
    entry = search.cache_entry(p, "v2", best)
    entry["config"] = {"warps": 4, "mt": 1, "bc": 32, "stages": 2}
    _tuned.save([entry])
    q = randn((2, 8, 512, 64), torch.float16, "cuda", 5)
    o = fattn.attention(q, q, q, causal="bottom_right", variant="v2")  # on sm_90 the default is v3
    kind, idx = _C.last_config()
    row = [c for c in _C.v2_configs() if c[0] == idx][0]
    assert kind == "v2" and row[1:6] == (64, 4, 1, 32, 2)
    check_close(o, q, q, q, "bottom_right", None)
