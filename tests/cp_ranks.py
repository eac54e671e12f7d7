"""The ranks of tests/test_distributed.py: the cases, what each rank runs, and spawning a world of ranks that run a
kind of case and report each case's traceback (or None) through a queue.  Imported by the test module and by every
spawned rank (the spawn start method imports this module in the child)."""
import contextlib
import datetime
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import fattn
import fattn.distributed as fd
from fattn.testing import accuracy, reference

B, H, D = 1, 4, 32
CHUNK = 96  # sequence per rank (S = CHUNK * world)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SPAWN_DEADLINE_S = 150
PG_TIMEOUT_S = 40


def _case(strategy, causal, kv_heads, layout="bshd", dtype="fp32", softcap=0.0):
    return {"strategy": strategy, "causal": causal, "kv_heads": kv_heads, "layout": layout, "dtype": dtype,
            "softcap": softcap}


MATCH_CASES = {}
for _strategy in ("ring", "allgather"):
    for _causal in (False, True):
        for _hk in (4, 2):
            MATCH_CASES[f"{_strategy}-{'causal' if _causal else 'full'}-hkv{_hk}"] = _case(_strategy, _causal, _hk)
MATCH_CASES["ring-causal-hkv2-bhsd"] = _case("ring", True, 2, "bhsd")
MATCH_CASES["allgather-full-hkv4-bhsd"] = _case("allgather", False, 4, "bhsd")
MATCH_CASES["auto-causal-hkv1"] = _case("auto", True, 1)
MATCH_CASES["auto-full-hkv4"] = _case("auto", False, 4)
MATCH_CASES["ring-causal-hkv2-bf16"] = _case("ring", True, 2, dtype="bf16")
MATCH_CASES["allgather-causal-hkv1-bf16"] = _case("allgather", True, 1, dtype="bf16")
MATCH_CASES["ring-causal-hkv2-softcap"] = _case("ring", True, 2, softcap=1.0)
MATCH_CASES["allgather-full-hkv4-softcap"] = _case("allgather", False, 4, softcap=1.0)

ERROR_CASES = ["unequal_lengths", "odd_causal_length", "layout_mismatch", "one_rank_bad", "bad_strategy",
               "bad_layout", "shard_indivisible", "k_heads_differ", "dtype_differs", "kv_dtype_mixed",
               "causal_differs", "scale_differs", "softcap_differs", "strategy_differs", "unshard_unequal",
               "shard_bad_dim", "one_rank_bad_argument", "unshard_one_rank_bad_dim", "unshard_int_dtypes_differ",
               "refused_dtype_leaves_group_usable", "double_backward_refused"]
ROUND_TRIP_CASES = ["round_trip"]
GPU_CASES = {f"{s}-{'causal' if c else 'full'}-hkv{hk}": _case(s, c, hk, dtype="bf16")
             for s in ("ring", "allgather") for c in (False, True) for hk in (4, 2)}
# Long sequences, causal, bf16, GQA 4:1: the distributed output and gradients against the single-GPU call's, both
# measured against a float32 computation of the same (fattn in float32 on one GPU; float64 does not fit).  The
# length by world size on GPUs: 128k tokens on 2, 256k on 4 (issues 18 and 19).
LONG = {"tokens": {2: 131072, 4: 262144}, "heads": 4, "kv_heads": 1, "dim": 128}
LONG_CASES = ["ring-long", "allgather-long"]


# ----------------------------------------------------------------------------------------------------------------
# What each rank runs


def _inputs(world, case, device, dtype, seed):
    """Full q, k, v, dout (the same on every rank) in the case's layout."""
    s = CHUNK * world
    g = torch.Generator().manual_seed(seed)

    def make(heads):
        shape = (B, s, heads, D) if case["layout"] == "bshd" else (B, heads, s, D)
        return torch.randn(shape, generator=g).to(dtype=dtype, device=device)

    return make(H), make(case["kv_heads"]), make(case["kv_heads"]), make(H)


def _bhsd(x, layout):
    return x.transpose(1, 2) if layout == "bshd" else x


def run_match(case, rank, world, device):
    """Distributed forward + autograd backward vs one process's fattn (float32: within 1e-5) and the float64
    reference (the accuracy rule: 2x for the output, 3x for the gradients), checked on rank 0."""
    layout, causal, dtype, cap = case["layout"], case["causal"], DTYPES[case["dtype"]], case["softcap"]
    dim = fd.SEQ_DIM[layout]
    q, k, v, dout = _inputs(world, case, device, dtype, seed=1000 + world)
    local = [fd.shard(x, dim=dim, causal=causal).requires_grad_() for x in (q, k, v)]
    out = fd.attention(*local, causal=causal, layout=layout, strategy=case["strategy"], softcap=cap)
    out.backward(fd.shard(dout, dim=dim, causal=causal))
    got = [fd.unshard(t, dim=dim, causal=causal) for t in (out.detach(), local[0].grad, local[1].grad,
                                                            local[2].grad)]
    if rank != 0:
        return
    bq, bk, bv, bdout = (_bhsd(x, layout) for x in (q, k, v, dout))
    out_d, dq, dk, dv = (_bhsd(x, layout) for x in got)
    with torch.no_grad():
        single = _bhsd(fattn.attention(q, k, v, causal=causal, layout=layout, softcap=cap), layout)
    if dtype == torch.float32:
        err = (out_d - single).abs().max().item()
        assert err <= 1e-5, f"forward: max |distributed - single process| = {err:.3g} > 1e-5"
    why, err, err_low = accuracy.check_attention(out_d, bq, bk, bv, causal, softcap=cap)
    assert why is None, f"forward: {why}"
    why, stats = accuracy.check_gradients((dq, dk, dv), bq, bk, bv, bdout, causal, softcap=cap)
    assert why is None, f"gradients: {why} (err, err_lowp per dq, dk, dv: {stats})"


def _attention_and_grads(fn, q, k, v, dout):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def run_long(strategy, rank, world, device):
    """LONG (1024 tokens on the CPU): every distributed tensor within 3x the single-GPU call's error, both against
    the float64 reference on the CPU (fattn's own float32 call on GPUs, where float64 does not fit: a kernel of
    another dtype, so its errors do not cancel the bf16 call's)."""
    g = torch.Generator(device=device).manual_seed(77)
    t, hd = (LONG["tokens"][world] if device != "cpu" else 1024), LONG["dim"]  # on gloo: the same check, shorter

    def make(heads):
        return torch.randn((1, t, heads, hd), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)

    q, k, v, dout = make(LONG["heads"]), make(LONG["kv_heads"]), make(LONG["kv_heads"]), make(LONG["heads"])

    def distributed(a, b, c):
        return fd.attention(a, b, c, causal=True, strategy=strategy)

    local = _attention_and_grads(distributed, *(fd.shard(x, causal=True) for x in (q, k, v)),
                                 fd.shard(dout, causal=True))
    got = [fd.unshard(x, causal=True) for x in local]
    if rank != 0:
        return
    def one_gpu(a, b, c):
        return fattn.attention(a, b, c, causal=True, layout="bshd")

    single = _attention_and_grads(one_gpu, q, k, v, dout)
    if device == "cpu":  # the float64 reference (bhsd), independent of fattn's kernels
        bh = [x.transpose(1, 2) for x in (q, k, v, dout)]
        ref = [reference.attention(*bh[:3], causal=True)[0]] + list(reference.gradients(*bh, causal=True))
        ref = [r.transpose(1, 2) for r in ref]
    else:
        ref = _attention_and_grads(one_gpu, *(x.float() for x in (q, k, v, dout)))
    for name, d, s1, r in zip(("out", "dq", "dk", "dv"), got, single, ref):
        err, err_single = (d.float() - r).abs().max().item(), (s1.float() - r).abs().max().item()
        bound = accuracy.bound(err_single, torch.bfloat16, r.abs().max().item(), hd, factor=3.0)
        assert err <= bound, f"{name}: max|distributed - fp32| = {err:.3g} > 3 x single-GPU's {err_single:.3g} + eps"


def run_round_trip(rank, world):
    """unshard(shard(x)) == x exactly; the zigzag shard is chunks r and 2N-1-r."""
    x = torch.arange(2 * 3 * 12 * world * 5, dtype=torch.float32).reshape(2, 3, 12 * world, 5)
    for causal in (False, True):
        for dim in (2, -2):
            part = fd.shard(x, dim=dim, causal=causal)
            assert part.is_contiguous()
            assert torch.equal(fd.unshard(part, dim=dim, causal=causal), x), (causal, dim)
    chunks = x.chunk(2 * world, dim=2)
    assert torch.equal(fd.shard(x, dim=2, causal=True), torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), 2))
    assert torch.equal(fd.shard(x, dim=2, causal=False), x.chunk(world, dim=2)[rank])


def run_error(name, rank, world):
    """Each bad call raises the expected ValueError on every rank (no rank is left waiting)."""
    def qkv(s, heads=H, kv=H, kv_layout="bshd"):
        q = torch.randn(B, s, heads, D)
        kshape = (B, s, kv, D) if kv_layout == "bshd" else (B, kv, s, D)
        return q, torch.randn(kshape), torch.randn(kshape)

    if name == "unequal_lengths":
        with pytest.raises(ValueError, match=r"q: shards must have equal shapes.*rank 1"):
            fd.attention(*qkv(8 if rank == 0 else 10))
    elif name == "odd_causal_length":
        with pytest.raises(ValueError, match=r"q: local sequence length 7 is odd"):
            fd.attention(*qkv(7), causal=True)
    elif name == "layout_mismatch":
        with pytest.raises(ValueError, match=r"k: shape .* does not fit q's"):
            fd.attention(*qkv(8, kv_layout="bhsd"), layout="bshd")
    elif name == "one_rank_bad":
        expect = r"k: shape" if rank == 1 else r"q: the shards of rank\(s\) \[1\] are invalid"
        with pytest.raises(ValueError, match=expect):
            fd.attention(*qkv(8, kv=3 if rank == 1 else H))
    elif name == "bad_strategy":
        with pytest.raises(ValueError, match=r"strategy: expected one of"):
            fd.attention(*qkv(8), strategy="tree")
    elif name == "bad_layout":
        with pytest.raises(ValueError, match=r"layout: expected one of"):
            fd.attention(*qkv(8), layout="sbhd")
    elif name == "shard_indivisible":
        with pytest.raises(ValueError, match=r"x: length 10 along dim 1 does not divide"):
            fd.shard(torch.zeros(1, 10, 2, 8), causal=True)
    # what differs between ranks, or within one, is refused on every rank before any transfer: before, these
    # crashed gloo (another dtype), hung (another strategy) or gave a wrong result (another causal or scale)
    elif name == "k_heads_differ":  # q alike on every rank, only k's (and v's) shards differ: named as k
        with pytest.raises(ValueError, match=r"k: shards must have equal shapes on every rank .*got rank 0: "
                           r"\(1, 8, 4, 32\); rank 1: \(1, 8, 2, 32\)"):
            fd.attention(*qkv(8, kv=H if rank == 0 else H // 2))
    elif name == "dtype_differs":
        q, k, v = (t.to(torch.bfloat16) if rank == 1 else t for t in qkv(8))
        with pytest.raises(ValueError, match=r"q: shards must have one dtype on every rank; got rank 0: float32; "
                           r"rank 1: bfloat16"):
            fd.attention(q, k, v)
    elif name == "kv_dtype_mixed":  # within one rank: the single-process call's TypeError there, named elsewhere
        q, k, v = qkv(8)
        if rank == 1:
            k = k.to(torch.bfloat16)
        with pytest.raises(TypeError if rank == 1 else ValueError,
                           match=r"k: dtype bfloat16 differs from q's float32" if rank == 1
                           else r"q: the shards of rank\(s\) \[1\] are invalid"):
            fd.attention(q, k, v)
    elif name in ("causal_differs", "scale_differs", "softcap_differs", "strategy_differs"):
        arg = name.split("_")[0]
        kw = {"causal": {"causal": rank == 0}, "scale": {"scale": 0.1 * (rank + 1)},
              "softcap": {"softcap": float(rank)}, "strategy": {"strategy": ("ring", "allgather")[rank % 2]}}[arg]
        with pytest.raises(ValueError, match=rf"{arg}: every rank must pass the same {arg}.*rank\(s\) \[1\]"):
            fd.attention(*qkv(8), **kw)
    elif name == "unshard_unequal":
        with pytest.raises(ValueError, match=r"x_local: shards must have equal shapes and dtypes on every rank; "
                           r"got rank 0: \(1, 8, 2, 4\) float32; rank 1: \(1, 10, 2, 4\) float32"):
            fd.unshard(torch.zeros(1, 8 if rank == 0 else 10, 2, 4))
    elif name == "shard_bad_dim":
        with pytest.raises(ValueError, match=r"dim: expected an int in \[-4, 4\) for a 4-D tensor, got 5"):
            fd.shard(torch.zeros(1, 8, 2, 4), dim=5)
    # an argument refused on one rank is raised on every rank, at once (it used to leave the others waiting in the
    # agreement's collective until the group's timeout)
    elif name == "one_rank_bad_argument":
        for kw in ({"strategy": "Ring"}, {"causal": "causal"}, {"softcap": -1.0}, {"layout": "BSHD"}):
            arg = next(iter(kw))
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=rf"{arg}: " if rank == 1
                               else r"q: the shards of rank\(s\) \[1\] are invalid"):
                fd.attention(*qkv(8), **(kw if rank == 1 else {}))
            assert time.monotonic() - t0 < PG_TIMEOUT_S / 2, kw
    elif name == "unshard_one_rank_bad_dim":
        with pytest.raises(ValueError, match=r"dim: expected an int" if rank == 1
                           else r"x_local: the shards of rank\(s\) \[1\] are invalid"):
            fd.unshard(torch.zeros(4, 2), dim=4 if rank == 1 else 0)
    elif name == "unshard_int_dtypes_differ":  # int32 and int64 shared one code: a mismatched gather, an abort
        with pytest.raises(ValueError, match=r"x_local: shards must have equal shapes and dtypes on every rank; "
                           r"got rank 0: \(4,\) int64; rank 1: \(4,\) int32"):
            fd.unshard(torch.arange(4, dtype=torch.int64 if rank == 0 else torch.int32), dim=0)
    elif name == "refused_dtype_leaves_group_usable":
        # what fattn's kernels refuse (float64, head dim 12, a strided head dim) is refused on every rank before the
        # ring posts a transfer, so the next calls still run (a posted, never-waited transfer broke the group)
        q, k, v = qkv(8)
        bad = [((q.double(), k.double(), v.double()), TypeError, r"q: dtype float64 is not supported"),
               ((q[..., :12], k[..., :12], v[..., :12]), ValueError, r"q: head dim 12 is not supported"),
               ((q, k.transpose(1, 3).contiguous().transpose(1, 3), v), ValueError,
                r"k: the last dimension must be contiguous")]
        for args, exc, match in bad:
            for strategy in ("ring", "allgather"):
                with pytest.raises(exc, match=match):
                    fd.attention(*args, strategy=strategy)
                out = fd.attention(q, k, v, strategy=strategy)
                assert out.shape == q.shape and torch.isfinite(out).all()
    elif name == "double_backward_refused":
        q, k, v = qkv(8)
        q.requires_grad_()
        out = fd.attention(q, k, v)
        with pytest.raises(NotImplementedError, match=r"double backward"):
            torch.autograd.grad(out.square().sum(), q, create_graph=True)
        (g,) = torch.autograd.grad(fd.attention(q, k, v).sum(), q)  # the group still works
        assert g.shape == q.shape
    else:
        raise KeyError(name)


def _worker(rank, world, port, backend, kind, names, results):
    """One rank: join the group, run every case, put (case, rank, traceback or None) on `results`."""
    try:
        device = "cpu"
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S if kind != "long" else 300))
    except Exception:
        results.put(("<init>", rank, traceback.format_exc()))
        return
    try:
        for name in names:
            try:
                if kind == "long":
                    run_long(name.split("-")[0], rank, world, device)
                elif kind in ("match", "gpu"):
                    run_match((MATCH_CASES if kind == "match" else GPU_CASES)[name], rank, world, device)
                elif kind == "round_trip":
                    run_round_trip(rank, world)
                else:
                    run_error(name, rank, world)
                results.put((name, rank, None))
            except BaseException:
                results.put((name, rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Spawning


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _child_env(**values):
    """Environment for the spawned children (inherited at start), restored afterwards."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spawn(world, backend, kind, names, deadline_s=SPAWN_DEADLINE_S):
    """Run `names` of `kind` on `world` spawned ranks; {case: [failure text of each failing rank]} with every case
    present (a case some rank never reported fails with whatever the parent knows)."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    with _child_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)):
        procs = [ctx.Process(target=_worker, args=(r, world, port, backend, kind, list(names), results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
    expected = world * len(names)
    reports, deadline = {}, time.monotonic() + deadline_s
    while len(reports) < expected and time.monotonic() < deadline:
        try:
            name, rank, text = results.get(timeout=1.0)
        except Exception:  # queue.Empty: see whether everyone died
            if not any(p.is_alive() for p in procs):
                break
            continue
        reports[(name, rank)] = text
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    fatal = [text for (name, _), text in reports.items() if name == "<init>"]
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    out = {}
    for name in names:
        fails = []
        for r in range(world):
            if (name, r) not in reports:
                fails.append(f"rank {r}: no report (exit codes {codes}; "
                             f"{'timed out' if time.monotonic() >= deadline else 'died'}){''.join(fatal)}")
            elif reports[(name, r)] is not None:
                fails.append(f"rank {r}:\n{reports[(name, r)]}")
        out[name] = fails
    return out


def _assert_ok(report, name):
    fails = report[name]
    assert not fails, "\n".join(fails)
