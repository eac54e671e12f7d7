"""Context parallelism (fattn.distributed): the distributed forward and backward against one process's fattn call
on the whole sequence and the float64 reference, for each strategy, causal or not, with and without grouped-query
heads, in both layouts, float32 and bfloat16; the LSE merge; shard / unshard round trips; the errors.

Each world (2 or 3 CPU processes on gloo; 2 or 4 GPUs on NCCL) is spawned once per module and runs every case of its
kind; each case reports its traceback (or None) from every rank through a queue, and a test fails with the text of
the rank that failed.  Joins have deadlines and process groups a timeout, so nothing hangs."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import fattn  # noqa: E402
import fattn.distributed as fd  # noqa: E402
from fattn import _cp_strategies  # noqa: E402

from cp_ranks import (ERROR_CASES, GPU_CASES, LONG_CASES, MATCH_CASES, ROUND_TRIP_CASES,  # noqa: E402
                      SPAWN_DEADLINE_S, _assert_ok, spawn)

# The ranks' cases, what each runs and the spawning: tests/cp_ranks.py.


@pytest.fixture(scope="module")
def gloo_match():
    return {n: spawn(n, "gloo", "match", MATCH_CASES) for n in (2, 3)}


@pytest.fixture(scope="module")
def gloo_misc():
    """Round trips on 2 and 3 ranks; the errors on 2."""
    return {
        2: {**spawn(2, "gloo", "round_trip", ROUND_TRIP_CASES), **spawn(2, "gloo", "error", ERROR_CASES)},
        3: spawn(3, "gloo", "round_trip", ROUND_TRIP_CASES),
    }


# ----------------------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(MATCH_CASES))
def test_matches_single_process(gloo_match, world, name):
    _assert_ok(gloo_match[world], name)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_unshard_round_trip(gloo_misc, world):
    _assert_ok(gloo_misc[world], "round_trip")


@pytest.mark.parametrize("name", ERROR_CASES)
def test_errors(gloo_misc, name):
    _assert_ok(gloo_misc[2], name)


def test_not_initialised():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x = torch.zeros(1, 8, 4, 32)
    for call in (lambda: fd.attention(x, x, x), lambda: fd.shard(x), lambda: fd.unshard(x)):
        with pytest.raises(ValueError, match=r"group: torch.distributed is not initialised"):
            call()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_lse_merge_is_exact(layout):
    """Two partials (keys split in two) merge into the one-call result; rows that see no key in either partial
    stay 0 / -inf (no NaN); a row that sees keys in one partial only takes that partial."""
    g = torch.Generator().manual_seed(7)
    shape = (1, 40, 2, 16) if layout == "bshd" else (1, 2, 40, 16)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    seq = fd.SEQ_DIM[layout]
    whole, whole_lse = fattn.attention(q, k, v, layout=layout, return_lse=True)
    parts = [fattn.attention(q, k.narrow(seq, a, n), v.narrow(seq, a, n), layout=layout, return_lse=True)
             for a, n in ((0, 15), (15, 25))]
    out, lse = parts[0][0].clone(), parts[0][1].clone()
    _cp_strategies._merge(out, lse, *parts[1], layout)
    assert (out - whole).abs().max().item() <= 1e-6
    assert (lse - whole_lse).abs().max().item() <= 1e-5
    dead = torch.full_like(lse, -float("inf"))
    out, lse = torch.zeros_like(out), dead.clone()
    _cp_strategies._merge(out, lse, torch.zeros_like(out), dead, layout)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, dead)
    _cp_strategies._merge(out, lse, parts[1][0], parts[1][1], layout)
    assert torch.equal(out, parts[1][0]) and torch.equal(lse, parts[1][1])


def test_auto_rule():
    assert fd.choose_strategy(16, 16, 2) == "allgather"
    assert fd.choose_strategy(16, 16, 3) == "allgather"
    assert fd.choose_strategy(16, 16, 4) == "allgather"
    assert fd.choose_strategy(16, 16, 5) == "ring"
    assert fd.choose_strategy(16, 8, 8) == "ring"
    assert fd.choose_strategy(16, 4, 2) == "allgather"
    assert fd.choose_strategy(16, 1, 4) == "allgather"
    assert fd.choose_strategy(16, 16, 1) == "allgather"


def test_import_fattn_leaves_torch_distributed_alone():
    code = "import sys, fattn; sys.exit(1 if [m for m in sys.modules if m.startswith('torch')] else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))).returncode == 0


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _all_pass(world, backend, kind, names, deadline_s=SPAWN_DEADLINE_S):
    """Run `names` of `kind` on `world` ranks and fail with every failing rank's text."""
    report = spawn(world, backend, kind, names, deadline_s=deadline_s)
    fails = {name: text for name, text in report.items() if text}
    assert not fails, "\n\n".join(f"{name}:\n" + "\n".join(text) for name, text in fails.items())


def _needs_gpus(n):
    return pytest.mark.skipif(_gpus() < n or not fattn.cuda_available() or not dist.is_nccl_available(),
                              reason=f"needs {n} CUDA GPUs usable by fattn and NCCL")


@pytest.mark.gpu
@_needs_gpus(2)
def test_nccl_two_gpus_bf16():
    _all_pass(2, "nccl", "gpu", GPU_CASES)


@pytest.mark.gpu
@_needs_gpus(4)
def test_nccl_four_gpus_bf16():
    _all_pass(4, "nccl", "gpu", GPU_CASES)


def test_long_exact_gloo():
    """run_long's check itself, on 2 CPU processes at 1024 tokens."""
    _all_pass(2, "gloo", "long", LONG_CASES)


@pytest.mark.gpu
@_needs_gpus(2)
def test_nccl_two_gpus_128k_exact():
    _all_pass(2, "nccl", "long", LONG_CASES, deadline_s=400)


@pytest.mark.gpu
@_needs_gpus(4)
def test_nccl_four_gpus_256k_exact():
    _all_pass(4, "nccl", "long", LONG_CASES, deadline_s=400)
