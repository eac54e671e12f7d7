"""The command lines (python -m fattn.bench / gate / plot / profile / tune, the cp grid): bad arguments and unusable
output paths refused before the run with a usage error (rc 2), failures reported in one line, not a traceback."""
import json

import pytest

import fattn


def test_clis_fail_clearly(tmp_path):
    """A bench point fattn cannot run exits 1 (it used to exit 0); plot on a missing or wrong file is a usage error,
    not a traceback; tune --help prints its usage once."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fattn.bench", "--device", "cpu", "--shape", "1,1,16,63", "--reps", "1",
                        "--torch-backends", "none", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 1 and "fattn:cpu could not run B=1 H=1 S=16 D=63" in r.stderr
    r = subprocess.run([sys.executable, "-m", "fattn.bench", "--device", "cpu", "--shape", "1,1,16,64", "--reps", "1",
                        "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0 and "fattn:cpu" in r.stdout
    for target in (tmp_path / "missing.json", tmp_path):
        r = subprocess.run([sys.executable, "-m", "fattn.plot", str(target), "-o", str(tmp_path / "x.png")],
                           capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "not a readable" in r.stderr


def test_cli_arguments_refused_before_the_run(tmp_path):
    """Bad arguments that would only fail after a run (an output folder that does not exist) or give nonsense (a
    non-positive --sk) are refused first, with rc 2; fattn.tune without a GPU says to use --device cpu."""
    from fattn import bench
    from fattn.tune import __main__ as tune_main

    for argv in (["--sk", "-5"], ["--sk", "0"], ["--json", str(tmp_path / "nodir" / "r.json")],
                 ["--timer", "batch"]):  # cuda timers: a cpu run times by perf_counter (it was silently ignored)
        with pytest.raises(SystemExit) as e:
            bench.main(["--device", "cpu", "--shape", "1,2,40,16"] + argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # a grid runs its own points: --causal would be silently ignored
        bench.main(["--grid", "cpu", "--causal"])
    assert e.value.code == 2
    if not fattn.cuda_available():
        with pytest.raises(SystemExit) as e:
            tune_main.main(["micro", "--shape", "1,4,64,32"])
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        tune_main.main(["evo", "--device", "cpu", "--shape", "1,4,0,64"])
    assert e.value.code == 2


def test_output_paths_and_counts_refused_before_the_run(tmp_path, monkeypatch):
    """An output path that is a folder, a picture format matplotlib is not asked for, counts below 1, an --out that
    is a file, a named --seeds-from that does not exist, the cp grid's malformed lists and a run outside torchrun:
    one-line usage errors (rc 2) before anything is measured, not tracebacks after it."""
    from fattn import bench, plot
    from fattn.testing import cp
    from fattn.tune import __main__ as tune_main

    shape = ["--device", "cpu", "--shape", "1,2,40,16"]
    for argv in (["--json", str(tmp_path)], ["--md", str(tmp_path)], ["--plot", str(tmp_path / "x.xyz")]):
        with pytest.raises(SystemExit) as e:
            bench.main(shape + argv)
        assert e.value.code == 2, argv
    assert plot.output_path("p") == "p.png" and plot.output_path("p.svg") == "p.svg"
    evo = ["evo", "--device", "cpu", "--shape", "1,4,64,32"]
    (tmp_path / "file").write_text("x")
    for argv in (["--budget", "0"], ["--population", "0"], ["--reps", "-1"], ["--top", "0"],
                 ["--out", str(tmp_path / "file")], ["--save", "--cache", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            tune_main.main(evo + argv)
        assert e.value.code == 2, argv
    rc = tune_main.main(evo + ["--budget", "1", "--quiet", "--out", str(tmp_path / "logs"),
                               "--seeds-from", str(tmp_path / "none.json")])
    assert rc == 2
    monkeypatch.delenv("RANK", raising=False)
    for argv in (["--tokens", "1,x"], ["--kv-heads", "0"], ["--dim", "12", "--device", "cpu"], ["--device", "cpu"]):
        with pytest.raises(SystemExit) as e:
            cp.parse_args(argv)
        assert e.value.code == 2, argv


def test_tuned_cache_save_drops_malformed_entries(tmp_path):
    """A cache file with a malformed entry (no device) is merged without it, with a warning, not a KeyError."""
    from fattn import _tuned

    path = tmp_path / "tc.json"
    path.write_text(json.dumps({"format": _tuned.FORMAT, "entries": [{"family": "cpu"}]}))
    entry = {"family": "cpu", "device": {"type": "cpu"}, "dtype": "fp32", "head_dim": 64, "causal": False,
             "seq_bucket": 512, "config": {}}
    with pytest.warns(RuntimeWarning, match="dropping 1 malformed"):
        _tuned.save([entry], str(path))
    assert json.loads(path.read_text())["entries"] == [entry]
